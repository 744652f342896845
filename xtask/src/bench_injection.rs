//! `cargo xtask bench-injection [--records N] [--rounds N] [--cupti-version V] [--baseline LIB]`:
//! what the CUPTI injection library costs the traced server's CPU per GPU
//! record, and what receiving it costs the agent — measured through the
//! CUPTI ABI test double (tests/cupti-double), no GPU needed.
//!
//! The double's host program plays the application and the driver: it loads
//! `libhopscope_cupti.so` as the driver would, then emits N synthetic
//! activity records laid out as the chosen CUPTI version writes them
//! (kernels with their names, copies, memsets, syncs, API records), handing
//! full buffers to the library's real buffer-completed callback from a worker
//! thread as CUPTI does. The agent's side is `hopscope`'s own `GpuReceiver`,
//! in this process. CPU time is read per thread (`/proc/…/task/*/schedstat`,
//! ns) and, for the callback, by the double around each call
//! (`CLOCK_THREAD_CPUTIME_ID`), so the double's own record making is not
//! counted. A TEST DOUBLE stands in for CUPTI: these are the library's own
//! costs, not CUPTI's, and say nothing of a GPU's (scripts/gpu-check.sh
//! measures a real server's throughput with and without tracing).
//!
//! `--baseline LIB` runs another build of the library (copied aside before a
//! change) in the same rounds, the two taking turns at going first.

use crate::{cargo, root, Opts};
use anyhow::{bail, Context, Result};
use hopscope::source::cupti::{GpuConfig, GpuReceiver};
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const USAGE: &str = "cargo xtask bench-injection [--records N (default 1000000)] [--rounds N (default 3)] [--cupti-version V (default 130401: CUPTI 13.4)] [--baseline LIB (another libhopscope_cupti.so)]";

/// Record rates the figures are turned into a share of one core at: a
/// decode-heavy server on one GPU (a 32-layer model with CUDA graphs: ~300
/// kernel records a step, 10–20 ms steps) and a busy one with several
/// streams (tensor-parallel ranks each send their own).
const RATES: [f64; 2] = [30_000.0, 100_000.0];

/// The library's counters of records it decoded and did not send.
const LIBRARY_DROPS: [&str; 3] = ["gpu_dropped_queue_full", "gpu_dropped_no_agent", "gpu_dropped_send_error"];

/// CPU time of `pid`'s threads by name (ns, summed per name), from schedstat.
fn threads_cpu(pid: &str) -> Result<BTreeMap<String, u64>> {
    let mut out = BTreeMap::new();
    let dir = format!("/proc/{pid}/task");
    for e in std::fs::read_dir(&dir).with_context(|| format!("reading {dir}"))? {
        let p = e?.path();
        let (Ok(comm), Ok(stat)) = (std::fs::read_to_string(p.join("comm")), std::fs::read_to_string(p.join("schedstat"))) else { continue };
        let ns: u64 = stat.split_whitespace().next().and_then(|v| v.parse().ok()).context("schedstat without run time: is CONFIG_SCHED_INFO off?")?;
        *out.entry(comm.trim().to_owned()).or_default() += ns;
    }
    Ok(out)
}

fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; the clock always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// One run's figures, ns of CPU per record unless named otherwise.
#[derive(Debug, Clone, Copy, Default)]
struct Sample {
    /// Records the agent received.
    received: u64,
    /// Records lost anywhere (the library's drop counters + CUPTI's).
    lost: u64,
    /// Inside the buffer-completed callback: decode, check, convert, encode, enqueue.
    callback: f64,
    /// The library's sending and flushing threads (less callbacks run on the flusher).
    threads: f64,
    /// Wall time in buffer-requested on the application's thread.
    request: f64,
    /// The agent: connection threads (read, validate, convert) and the hand-over.
    agent: f64,
}

impl Sample {
    fn injection(&self) -> f64 {
        self.callback + self.threads + self.request
    }
}

struct Built {
    double: PathBuf,
    host: PathBuf,
    injection: PathBuf,
}

fn build() -> Result<Built> {
    let target = root().join("target/cupti-double");
    crate::run(cargo().args(["build", "--release", "--quiet", "-p", "agent-cupti", "-p", "cupti-abi-test-double", "--target-dir"]).arg(&target))?;
    let d = target.join("release");
    Ok(Built { double: d.join("libcupti_abi_test_double.so"), host: d.join("cupti-abi-test-double-host"), injection: d.join("libhopscope_cupti.so") })
}

fn measure(b: &Built, lib: &Path, records: u64, version: u32, scratch: &Path) -> Result<Sample> {
    let _ = std::fs::remove_dir_all(scratch);
    std::fs::create_dir_all(scratch)?;
    let go = scratch.join("go");
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    let mut rx = GpuReceiver::bind(GpuConfig { parent: Some(scratch.to_owned()), trusted_uids: vec![euid], ..GpuConfig::default() })
        .map_err(|e| anyhow::anyhow!("binding the agent's gpu socket: {e}"))?;
    let mut child = Command::new(&b.host)
        .args([format!("run:{records}"), "wait-delivered:120000".into(), "run:0".into(), format!("wait-file:{}", go.display())])
        .env("CUDA_INJECTION64_PATH", lib)
        .env("HOPSCOPE_CUPTI_LIB", &b.double)
        .env("CUPTI_ABI_TEST_DOUBLE", &b.double)
        .env("CUPTI_ABI_TEST_DOUBLE_VERSION", version.to_string())
        .env("HOPSCOPE_GPU_SOCKET", rx.socket_path())
        .env("HOPSCOPE_GPU_REPORT_MS", "100")
        .env_remove("CUPTI_ABI_TEST_DOUBLE_TRUTH")
        .env_remove("CUPTI_ABI_TEST_DOUBLE_BAD_EVERY")
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", b.host.display()))?;
    let pid = child.id().to_string();
    let (tx, lines) = mpsc::channel::<String>();
    let stdout = child.stdout.take().expect("piped");
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let mut drain_cpu = 0u64;
    let mut drain = |rx: &mut GpuReceiver| {
        let t = thread_cpu_ns();
        let n = rx.drain(|_| {});
        drain_cpu += thread_cpu_ns() - t;
        n
    };
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut stats: Option<Value> = None;
    let mut init_rc = None;
    let counters = |rx: &GpuReceiver| -> BTreeMap<String, u64> { rx.counters().into_iter().collect() };
    let get = |c: &BTreeMap<String, u64>, name: &str| c.get(name).copied().unwrap_or(0);
    // Until the double says every record reached the library and the
    // library's counters say every decoded record was sent or dropped, and
    // the agent holds every sent one.
    loop {
        if Instant::now() > deadline {
            let _ = child.kill();
            bail!("bench-injection: no end within 300 s (host stats {stats:?}, agent {} records)", rx.records());
        }
        while let Ok(l) = lines.try_recv() {
            let Some(json) = l.strip_prefix("HOST ") else { continue };
            let v: Value = serde_json::from_str(json).with_context(|| format!("host line {json}"))?;
            match v["step"].as_str() {
                Some("init") => init_rc = v["rc"].as_i64(),
                Some("run") if v["n"] == 0 => stats = Some(v["double"].clone()),
                Some("wait-delivered") if v["ok"] != true => bail!("the double's records did not all reach the library within 120 s"),
                _ => {}
            }
        }
        if init_rc.is_some_and(|rc| rc != 1) {
            bail!("InitializeInjection of {} returned {init_rc:?}: run with HOPSCOPE_CUPTI_LOG=1 to see why", lib.display());
        }
        if let Some(s) = &stats {
            let c = counters(&rx);
            let decoded = get(&c, "gpu_records_decoded");
            let sent = get(&c, "gpu_records_sent");
            let settled = sent + LIBRARY_DROPS.iter().map(|d| get(&c, d)).sum::<u64>();
            let delivered = s["delivered"].as_u64().unwrap_or(0);
            if decoded >= delivered && settled >= decoded && rx.records() >= sent {
                break;
            }
        }
        if drain(&mut rx) == 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    let host = threads_cpu(&pid)?;
    let agent = threads_cpu("self")?;
    std::fs::write(&go, b"")?;
    let st = child.wait()?;
    rx.shutdown(|_| {});
    if !st.success() {
        bail!("the double's host program failed: {st}");
    }
    let s = stats.expect("loop ends with stats");
    let n = |k: &str| s[k].as_u64().unwrap_or(0);
    let records = n("delivered");
    if records == 0 {
        bail!("the double delivered no records: {s}");
    }
    let per = |ns: u64| ns as f64 / records as f64;
    let flush_callbacks = n("complete_cpu_ns") - n("complete_cpu_ns_worker");
    let lib_threads = host.get("hopscope-send").copied().unwrap_or(0) + host.get("hopscope-flush").copied().unwrap_or(0).saturating_sub(flush_callbacks);
    let conn = agent.get("hopscope-gpu-conn").copied().unwrap_or(0);
    // Records the library dropped, and those the double had no buffer for
    // (what CUPTI reports as dropped: `gpu_cupti_dropped` counts the same
    // records, `gpu_buffer_pool_exhausted` buffers, not records).
    let c = counters(&rx);
    let lost = LIBRARY_DROPS.iter().map(|d| get(&c, d)).sum::<u64>() + n("no_buffer");
    Ok(Sample {
        received: rx.records(),
        lost,
        callback: per(n("complete_cpu_ns")),
        threads: per(lib_threads),
        request: per(n("request_ns")),
        agent: (conn + drain_cpu) as f64 / rx.records().max(1) as f64,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn run(args: &[String]) -> Result<()> {
    if cfg!(debug_assertions) {
        // The agent's side runs in this process: a debug build's figures mean nothing.
        return crate::run(cargo().args(["run", "--quiet", "--release", "-p", "xtask", "--", "bench-injection"]).args(args));
    }
    let opts = Opts::parse(args, USAGE, &["--records", "--rounds", "--cupti-version", "--baseline"])?;
    let records: u64 = opts.num("--records", 1_000_000)?;
    let rounds: usize = opts.num("--rounds", 3)?;
    let version: u32 = opts.num("--cupti-version", 130_401)?;
    if records == 0 || rounds == 0 {
        bail!("--records and --rounds must be at least 1\nusage: {USAGE}");
    }
    let b = build()?;
    let mut libs = vec![("this build".to_owned(), b.injection.clone())];
    if let Some(base) = opts.get("--baseline") {
        let p = PathBuf::from(base);
        if !p.is_file() {
            bail!("--baseline {base}: no such file (copy target/cupti-double/release/libhopscope_cupti.so aside before the change)");
        }
        libs.push(("baseline".to_owned(), p));
    }
    let scratch = root().join(format!("target/tmp/bench-injection-{}", std::process::id()));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("bench-injection: {records} records per run (CUPTI {version} layouts; the test double's mix of kernels, copies, memsets, syncs, API records), {rounds} rounds, {cores} cores");
    println!("ns of CPU per record: callback = inside buffer-completed (decode, check, encode, enqueue); threads = the library's sender + flusher; request = buffer-requested on the application's thread (wall); agent = receiving (read, validate, convert, hand over)");
    println!("{:<11} {:>5} {:>9} {:>9} {:>8} {:>9} {:>10} {:>9} {:>8}", "build", "round", "callback", "threads", "request", "injection", "agent", "received", "lost");
    let mut all: Vec<Vec<Sample>> = vec![Vec::new(); libs.len()];
    for round in 0..rounds {
        let order: Vec<usize> = if round % 2 == 0 { (0..libs.len()).collect() } else { (0..libs.len()).rev().collect() };
        for i in order {
            let s = measure(&b, &libs[i].1, records, version, &scratch)?;
            println!(
                "{:<11} {:>5} {:>9.1} {:>9.1} {:>8.2} {:>9.1} {:>10.1} {:>9} {:>8}",
                libs[i].0,
                round + 1,
                s.callback,
                s.threads,
                s.request,
                s.injection(),
                s.agent,
                s.received,
                s.lost
            );
            all[i].push(s);
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    println!("medians:");
    let mut meds = Vec::new();
    for (i, (name, _)) in libs.iter().enumerate() {
        let inj = median(all[i].iter().map(Sample::injection).collect());
        let agent = median(all[i].iter().map(|s| s.agent).collect());
        let cb = median(all[i].iter().map(|s| s.callback).collect());
        let share = RATES.iter().map(|r| format!("{:.2} % / {:.2} % of one core at {}k records/s", inj * r / 1e7, agent * r / 1e7, r / 1e3)).collect::<Vec<_>>().join("; ");
        println!("  {name}: injection {inj:.1} ns/record (callback {cb:.1}), agent {agent:.1} ns/record; injection / agent: {share}");
        meds.push((inj, agent));
    }
    if meds.len() == 2 {
        println!("this build / baseline: injection {:.3}×, agent {:.3}× (medians, side by side)", meds[0].0 / meds[1].0, meds[0].1 / meds[1].1);
    }
    let lost: u64 = all.iter().flatten().map(|s| s.lost).sum();
    if lost > 0 {
        println!("WARNING: {lost} records lost over the runs (the agent or the library fell behind a host emitting as fast as it can): the per-record figures count only records handled");
    }
    Ok(())
}
