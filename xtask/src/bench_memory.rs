//! `cargo xtask bench-memory [--requests N] [--baseline BIN] [--runs N] [--gpu]`:
//! `hopscope report --json`, `hopscope trace`, `hopscope report` (the
//! text tables) and `hopscope diff --json` (the recording against itself)
//! on a synthetic recording of N requests (default 1 000 000),
//! each run as a child process: peak RSS (the child's own `ru_maxrss`, from
//! wait4) and records/s on one core. The recording is made once and cached
//! in target/bench/; the trace goes there too. `--baseline BIN` runs another
//! hopscope binary (an earlier build copied aside) right after each of ours
//! on the same file and prints the ratios (a baseline from before session 4
//! held every request in the text report: gigabytes at 1 M requests).
//! `--runs N` runs each N times, ours and the baseline's in turn, and keeps
//! the run with the least CPU time (the largest peak RSS): on a VM whose
//! speed drifts within minutes, single runs a minute apart do not compare.
//!
//! The recording is shaped like a busy vLLM server traced on both ends of
//! its IPC: 16 closed-loop clients on keep-alive connections (agent chains of
//! 2-5 hops by `x-session-id`, some by `traceparent`, the rest by
//! connection), a continuous-batching engine stepping every 12 ms (+8 ms when
//! a prefill joins), each step's EngineCoreOutputs seen twice (engine write,
//! frontend read) and the engine thread's switch-in, per request the HTTP
//! request, the ADD (both copies), the response head, the SSE role, 8-24
//! content chunks, usage, [DONE] and the response end; each step's scheduler
//! stats (vLLM's default). `--gpu` adds what
//! CUPTI records of each step (a separate cached file): 48 kernels, the
//! sampled ids' copy to pinned memory and the sync that waits for it, as
//! vLLM's model runner ends a step (docs/attribution.md).

use anyhow::{bail, Context, Result};
use hopscope::event::{ConnKey, Dir};
use hopscope::model::{EngineEvent, EngineOutput, HttpRole, PrefillStats, Record, SseKind, Usage};
use hopscope::recording::{Meta, Writer, FORMAT_VERSION};
use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

const US: u64 = 1_000;
const MS: u64 = 1_000_000;
const CLIENTS: u64 = 16;
/// Bump when the generator changes: the cached file is remade.
const GENERATOR: u32 = 5;

struct Req {
    conn: ConnKey,
    seq: u32,
    id: String,
    eid: String,
    tokens: u64,
    done: u64,
    /// The engine's QUEUED stamp: when its loop took the request in.
    queued: u64,
}

struct Gen {
    out: BTreeMap<(u64, u64), Record>,
    order: u64,
    rng: u64,
}

impl Gen {
    fn emit(&mut self, r: Record) {
        self.order += 1;
        self.out.insert((r.ts_ns(), self.order), r);
    }
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo)
    }
}

/// Client `c`'s `k`-th request arrives at `at`: HTTP request, ADD (both
/// copies), response head, SSE role.
fn arrive(g: &mut Gen, c: u64, k: u64, n: u64, at: u64) -> Req {
    let conn = ConnKey { tgid: 1000, fd: 20 + c as i32, ino: 50_000 + c };
    let id = format!("chatcmpl-{n:016x}");
    let eid = format!("{id}-{:08x}", g.next() as u32);
    // Agent chains of 2-5 hops; every 4th client's chains by traceparent,
    // every 8th client's by the connection alone.
    let session = k / 4;
    let headers = match c % 8 {
        0 => vec![],
        4 => vec![("traceparent".into(), format!("00-{:016x}{:016x}-{:016x}-01", c + 1, session + 1, n + 1))],
        _ => vec![("x-session-id".into(), format!("agent-{c}-{session}"))],
    };
    let body_len = 3000 + g.range(0, 4000);
    g.emit(Record::HttpRequest {
        conn,
        role: HttpRole::Server,
        seq: k as u32,
        start_ns: at,
        end_ns: at + 40 * US,
        tid: 1001,
        method: "POST".into(),
        path: "/v1/chat/completions".into(),
        headers,
        body_len,
        stream: Some(true),
        // Every request names its model, as real clients' do (g3: the
        // report, summary and diff carry it since 2026-12-04).
        model: Some(if k % 4 == 3 { "lora/sql-adapter" } else { "meta-llama/Llama-3.1-8B-Instruct" }.into()),
        ready_ns: Some(at - 20 * US),
    });
    let ipc = ConnKey { tgid: 1000, fd: 9, ino: 7 };
    for (dir, dt, tid) in [(Dir::Out, 300 * US, 1002), (Dir::In, 320 * US, 2002)] {
        g.emit(Record::EngineRequest {
            conn: ipc,
            ts_ns: at + dt,
            tid,
            dir,
            request_id: eid.clone(),
            external_req_id: Some(id.clone()),
            prompt_tokens: Some(1500),
            max_tokens: Some(24),
            arrival_time_s: None,
            traceparent: None,
            data_parallel_rank: None,
            truncated: false,
        });
        // Every fifth asks for a JSON answer (g5: its constraint's kind
        // reaches the report, trace, diff and summary since 2026-12-05).
        if k % 5 == 2 {
            g.emit(Record::EngineStructuredOutput { conn: ipc, ts_ns: at + dt, dir, request_id: eid.clone(), kind: "json".into(), backend: Some("xgrammar".into()) });
        }
    }
    g.emit(Record::HttpResponse { conn, role: HttpRole::Server, seq: k as u32, ts_ns: at + 400 * US, tid: 1001, status: 200, headers: vec![("content-type".into(), "text/event-stream".into())] });
    g.emit(Record::Sse { conn, seq: k as u32, ts_ns: at + 450 * US, kind: SseKind::Role, id: Some(id.clone()), content_bytes: 0, finish_reason: None, usage: None });
    let tokens = g.range(8, 25);
    Req { conn, seq: k as u32, id, eid, tokens, done: 0, queued: 0 }
}

/// Writes the recording; returns its record count.
/// GPU kernels per engine step (`--gpu`).
const STEP_KERNELS: u64 = 48;

/// One step's GPU work from `t` to its output at `end` (`--gpu`).
fn gpu_step(g: &mut Gen, t: u64, end: u64) {
    const PID: u32 = 3000;
    let gap = (end - t - 600 * US) / STEP_KERNELS;
    for k in 0..STEP_KERNELS {
        let ts = t + 50 * US + k * gap;
        g.emit(Record::GpuKernel {
            ts_ns: ts,
            end_ns: ts + gap * 2 / 3,
            pid: PID,
            device: 0,
            context: 1,
            stream: 7,
            correlation_id: (g.order & 0xffff_ffff) as u32,
            graph_id: 0,
            graph_node_id: 0,
            name: ["ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", "flash_fwd_splitkv_kernel", "rms_norm_kernel", "silu_and_mul_kernel"][(k % 4) as usize].into(),
            grid: [132, 1, 1],
            block: [128, 1, 1],
            static_shared_mem: 0,
            dynamic_shared_mem: 49_152,
            registers_per_thread: 128,
        });
    }
    g.emit(Record::GpuMemcpy {
        ts_ns: end - 400 * US,
        end_ns: end - 390 * US,
        pid: PID,
        device: 0,
        context: 1,
        stream: 7,
        kind: 2,
        src_kind: 3,
        dst_kind: 2,
        flags: 1,
        bytes: 64,
        correlation_id: 1,
        runtime_correlation_id: 0,
        graph_id: 0,
        graph_node_id: 0,
        peer: None,
    });
    g.emit(Record::GpuSync { ts_ns: end - 2 * MS, end_ns: end - 300 * US, pid: PID, sync_type: 1, context: 1, stream: None, correlation_id: 2, cuda_event: Some(3) });
}

fn generate(path: &Path, requests: u64, gpu: bool) -> Result<u64> {
    let meta = Meta { format_version: FORMAT_VERSION, hopscope_version: "bench".into(), chain_header: "x-session-id".into(), kernel: "synthetic".into(), ..Meta::default() };
    let tmp = path.with_extension("tmp");
    let file = std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let mut w = Writer::new(std::io::BufWriter::new(file), &meta)?;
    let mut g = Gen { out: BTreeMap::new(), order: 0, rng: 0x9E37_79B9_7F4A_7C15 };
    let t0 = 10_000 * 1_000 * MS;
    let ipc = ConnKey { tgid: 1000, fd: 9, ino: 7 };
    let mut started = 0u64;
    let mut per_client = vec![0u64; CLIENTS as usize];
    let mut waiting: VecDeque<(u64, u64, Req)> = VecDeque::new(); // (ready, client, req)
    let mut running: Vec<(u64, Req)> = Vec::new();
    for c in 0..CLIENTS {
        let at = t0 + c * 700 * US;
        waiting.push_back((at + 320 * US, c, arrive(&mut g, c, 0, started, at)));
        per_client[c as usize] = 1;
        started += 1;
    }
    let mut t = t0 + 2 * MS;
    let mut written = 0u64;
    while !(waiting.is_empty() && running.is_empty()) {
        let mut newcomers = 0;
        while waiting.front().is_some_and(|w| w.0 <= t) {
            let (ready, c, mut r) = waiting.pop_front().expect("front checked");
            r.queued = (ready + 50 * US).min(t);
            running.push((c, r));
            newcomers += 1;
        }
        let end = t + 12 * MS + if newcomers > 0 { 8 * MS } else { 0 } + g.range(0, 500) * US;
        let off_ns = t.saturating_sub(g.range(100, 900) * US);
        g.emit(Record::OffCpu { ts_ns: t, tid: 3001, tgid: 3000, off_ns, wake_ns: Some(t - 20 * US), prev_state: 1 });
        if gpu {
            gpu_step(&mut g, t, end);
        }
        let mut outputs = Vec::with_capacity(running.len());
        let mut finished = Vec::new();
        for (i, (c, r)) in running.iter_mut().enumerate() {
            let first = r.done == 0;
            r.done += 1;
            let last = r.done == r.tokens;
            outputs.push(EngineOutput {
                request_id: r.eid.clone(),
                new_tokens: 1,
                finish_reason: last.then_some(1),
                // QUEUED and SCHEDULED, with the first output (as vLLM sends them).
                events: if first { vec![EngineEvent { kind: 1, timestamp_s: r.queued as f64 / 1e9 }, EngineEvent { kind: 2, timestamp_s: t as f64 / 1e9 }] } else { vec![] },
                prefill: first.then(|| PrefillStats { prompt_tokens: Some(1500), cached_tokens: Some(1024), ..PrefillStats::default() }),
            });
            let at = end + 150 * US + i as u64 * 8 * US;
            g.emit(Record::Sse { conn: r.conn, seq: r.seq, ts_ns: at, kind: SseKind::Content, id: Some(r.id.clone()), content_bytes: 4, finish_reason: None, usage: None });
            if last {
                let usage = Usage { prompt_tokens: Some(1500), completion_tokens: Some(r.tokens), cached_tokens: Some(1024) };
                g.emit(Record::Sse { conn: r.conn, seq: r.seq, ts_ns: at + 3 * US, kind: SseKind::Usage, id: Some(r.id.clone()), content_bytes: 0, finish_reason: Some("length".into()), usage: Some(usage) });
                g.emit(Record::Sse { conn: r.conn, seq: r.seq, ts_ns: at + 4 * US, kind: SseKind::Done, id: None, content_bytes: 0, finish_reason: None, usage: None });
                g.emit(Record::HttpResponseEnd { conn: r.conn, seq: r.seq, ts_ns: at + 5 * US, body_len: 200 * r.tokens });
                finished.push((*c, at + 5 * US));
            }
        }
        // vLLM logs stats by default: every step's output message carries
        // the scheduler's, decoded once (the writer's copy) ahead of it.
        g.emit(Record::EngineStats {
            conn: ipc,
            ts_ns: end + 30 * US,
            engine_index: Some(0),
            running: Some(running.len() as u64),
            waiting: Some(waiting.len() as u64),
            kv_cache_usage: Some(running.len() as f64 / 64.0),
            step_counter: None,
            prefix_cache_queries: Some(1500 * newcomers),
            prefix_cache_hits: Some(1024 * newcomers),
        });
        for (dir, dt, tid) in [(Dir::Out, 30 * US, 3002), (Dir::In, 60 * US, 1003)] {
            g.emit(Record::EngineOutputs {
                conn: ipc,
                ts_ns: end + dt,
                tid,
                dir,
                engine_index: Some(0),
                timestamp_s: Some(end as f64 / 1e9),
                outputs: outputs.clone(),
                outputs_total: Some(outputs.len() as u64),
                finished_requests: vec![],
                truncated: false,
            });
        }
        running.retain(|(_, r)| r.done < r.tokens);
        for (c, ended) in finished {
            if started < requests {
                let at = ended + g.range(1_000, 3_000) * US;
                let k = per_client[c as usize];
                per_client[c as usize] += 1;
                waiting.push_back((at + 320 * US, c, arrive(&mut g, c, k, started, at)));
                started += 1;
            }
        }
        waiting.make_contiguous().sort_by_key(|w| w.0);
        t = end + 500 * US;
        // Everything before the next step is final: write it in time order.
        while let Some(e) = g.out.first_entry() {
            if e.key().0 >= t {
                break;
            }
            w.push(&e.remove())?;
            written += 1;
        }
    }
    for (_, r) in std::mem::take(&mut g.out) {
        w.push(&r)?;
        written += 1;
    }
    w.finish(t)?;
    std::fs::rename(&tmp, path)?;
    Ok(written)
}

/// Runs `cmd` to completion with stdout to /dev/null: wall seconds, the
/// child's peak RSS in MiB and its CPU seconds (user + system; its own, from
/// wait4: not any earlier child's).
/// One run: wall seconds, peak RSS in MiB, CPU seconds.
type Run = (f64, f64, f64);

fn measure(cmd: &mut Command) -> Result<Run> {
    let t = Instant::now();
    let child = cmd.stdout(Stdio::null()).spawn().context("starting hopscope")?;
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value for wait4 to overwrite.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `pid` is our child, not yet waited for; `status` and `ru` are valid for writes.
    let rc = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
    let dt = t.elapsed().as_secs_f64();
    if rc != pid {
        bail!("waiting for hopscope: {}", std::io::Error::last_os_error());
    }
    if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        bail!("hopscope failed (wait status {status}): run it by hand to see why");
    }
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    Ok((dt, ru.ru_maxrss as f64 / 1024.0, secs(ru.ru_utime) + secs(ru.ru_stime)))
}

pub fn run(args: &[String]) -> Result<()> {
    if cfg!(debug_assertions) {
        // The generator is slow unoptimised: rerun optimised.
        return crate::run(crate::cargo().args(["run", "--quiet", "--release", "-p", "xtask", "--", "bench-memory"]).args(args));
    }
    let opts = crate::Opts::parse_with_flags(
        args,
        "cargo xtask bench-memory [--requests N (default 1000000)] [--baseline HOPSCOPE_BIN] [--runs N (default 1)] [--gpu]",
        &["--requests", "--baseline", "--runs"],
        &["--gpu"],
    )?;
    // CUPTI-shaped GPU work in every step: ~50 records a step more.
    let gpu = opts.flag("--gpu");
    let n: u64 = opts.num("--requests", 1_000_000)?;
    // Another hopscope binary (e.g. an earlier build copied aside) run right
    // after ours on the same file: side-by-side figures and ratios.
    let baseline: Option<PathBuf> = opts.get("--baseline").map(PathBuf::from);
    // This VM's speed drifts by 10-25 % within minutes: one run each is a
    // coin toss between two binaries. Each figure is then the least CPU
    // time of N runs, ours and the baseline's taking turns.
    let runs: usize = opts.num("--runs", 1)?;
    if runs == 0 {
        bail!("--runs 0: give at least 1");
    }
    if let Some(b) = &baseline {
        if !b.is_file() {
            bail!("--baseline {}: no such file (give the path of a hopscope binary)", b.display());
        }
    }
    crate::run(crate::cargo().args(["build", "--quiet", "--release", "-p", "hopscope"]))?;
    let root = crate::root();
    let dir = root.join("target/bench");
    std::fs::create_dir_all(&dir)?;
    let hop = dir.join(format!("synthetic-{n}-g{GENERATOR}{}.hop", if gpu { "-gpu" } else { "" }));
    let count_file = hop.with_extension("records");
    let records: u64 = match std::fs::read_to_string(&count_file).ok().and_then(|s| s.trim().parse().ok()).filter(|_| hop.exists()) {
        Some(c) => c,
        None => {
            eprintln!("bench-memory: writing {} (once)…", hop.display());
            let t = Instant::now();
            let c = generate(&hop, n, gpu)?;
            std::fs::write(&count_file, c.to_string())?;
            eprintln!("bench-memory: {c} records in {:.1} s", t.elapsed().as_secs_f64());
            c
        }
    };
    let size = std::fs::metadata(&hop)?.len();
    let bin: PathBuf = root.join("target/release/hopscope");
    println!(
        "hopscope report --json / trace / report / diff --json, one core, synthetic vLLM-shaped recording{}: {n} requests, {records} records, {:.0} MiB",
        if gpu { " with CUPTI records" } else { "" },
        size as f64 / (1 << 20) as f64
    );
    let line = |what: &str, (dt, rss, cpu): (f64, f64, f64), extra: &str| {
        println!("  {what:<27}{:.2} M records/s ({dt:.1} s wall, {:.2} M per CPU second), peak RSS {rss:.0} MiB{extra}", records as f64 / dt / 1e6, records as f64 / cpu / 1e6);
    };
    let ratio = |ours: (f64, f64, f64), base: (f64, f64, f64)| format!("  -> {:.2}x the baseline's records/s ({:.2}x per CPU second)", base.0 / ours.0, base.2 / ours.2);
    if runs > 1 {
        println!("  (each figure: the run with the least CPU time of {runs}, ours and the baseline's in turn; peak RSS: the largest)");
    }
    // The least-CPU run's wall and CPU time; the largest RSS of all.
    let best = |a: Option<Run>, b: Run| match a {
        Some(a) if a.2 <= b.2 => (a.0, a.1.max(b.1), a.2),
        Some(a) => (b.0, a.1.max(b.1), b.2),
        None => b,
    };
    // Ours and the baseline's, `runs` times in turn; `after` runs after each.
    let pair = |args: &[&str], out: &mut dyn FnMut()| -> Result<(Run, Option<Run>)> {
        let (mut ours, mut base) = (None, None);
        for _ in 0..runs {
            ours = Some(best(ours, measure(Command::new(&bin).args(args).arg(&hop).stderr(Stdio::null()))?));
            out();
            if let Some(b) = &baseline {
                base = Some(best(base, measure(Command::new(b).args(args).arg(&hop).stderr(Stdio::null()))?));
            }
        }
        Ok((ours.expect("runs >= 1"), base))
    };
    let (report, base) = pair(&["report", "--json"], &mut || {})?;
    line("streamed (report --json):", report, "   (goals: >= 2 M/s, <= 200 MB)");
    if let Some(base) = base {
        line("baseline (report --json):", base, "");
        println!("{}", ratio(report, base));
    }
    // Over its size threshold, so streamed.
    let trace = hop.with_extension("pftrace");
    let trace_arg = trace.to_string_lossy().into_owned();
    let mut trace_size = 0;
    let (traced, base) = pair(&["trace", "-o", &trace_arg], &mut || trace_size = std::fs::metadata(&trace).map_or(0, |m| m.len()))?;
    let _ = std::fs::remove_file(&trace);
    line("streamed (trace):", traced, &format!(", trace {:.0} MiB   (goals: >= 2 M/s, <= 200 MB)", trace_size as f64 / (1 << 20) as f64));
    if let Some(base) = base {
        line("baseline (trace):", base, "");
        println!("{}", ratio(traced, base));
    }
    let (text, base) = pair(&["report"], &mut || {})?;
    line("streamed (report, text):", text, "   (goals: >= 2 M/s, <= 200 MB)");
    if let Some(base) = base {
        line("baseline (report, text):", base, "");
        println!("{}", ratio(text, base));
    }
    // The recording against itself: both sides read, every request paired.
    // Records/s counts both sides' records.
    let hop_arg = hop.to_string_lossy().into_owned();
    let (diffed, base) = pair(&["diff", "--json", &hop_arg], &mut || {})?;
    let twice = |(dt, rss, cpu): Run| (dt / 2.0, rss, cpu / 2.0);
    line("diff --json (itself):", twice(diffed), "   (records/s: both sides' records)");
    if let Some(base) = base {
        line("baseline (diff --json):", twice(base), "");
        println!("{}", ratio(diffed, base));
    }
    Ok(())
}
