//! `cargo xtask fuzz [--seconds N] [TARGET…]`: builds the libFuzzer targets in
//! fuzz/ on stable Rust, seeds their corpora from the committed fixtures and
//! runs each for a bounded time, then prints execs, execs/s and crashes.
//!
//! Stable coverage: rustc's LLVM sanitizer-coverage pass (`-Cpasses=sancov-module`
//! plus its `-sanitizer-coverage-*` options) emits the inline 8-bit counters,
//! PC table and comparison hooks that libFuzzer (built from C++ by the
//! `libfuzzer-sys` crate) reads; this is what cargo-fuzz does with nightly's
//! `-Zsanitizer`, minus ASan (Rust code here is safe; see docs/reliability.md).
//! `--target <host>` keeps the instrumentation off build scripts and proc macros.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

pub const TARGETS: [&str; 9] = ["http_stream", "ipc_stream", "msgpack", "cupti_record", "gpu_wire", "recording", "record_decode", "deflate", "kernel_event"];

const COVERAGE_FLAGS: &str = "-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table -Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks";

/// One target's run.
struct Outcome {
    target: &'static str,
    seconds: f64,
    execs: u64,
    corpus: usize,
    crashes: Vec<PathBuf>,
}

fn host() -> Result<String> {
    let out = Command::new("rustc").arg("-vV").output().context("running rustc -vV")?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_owned))
        .context("rustc -vV printed no host triple")
}

pub fn run(args: &[String]) -> Result<()> {
    let mut seconds = 60u64;
    let mut chosen: Vec<&'static str> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--help" | "-h" => {
                println!("usage: cargo xtask fuzz [--seconds N (default 60, per target)] [TARGET…]\ntargets: {}", TARGETS.join(", "));
                std::process::exit(0);
            }
            "--seconds" => {
                let v = it.next().context("--seconds needs a number")?;
                seconds = v.parse().with_context(|| format!("--seconds {v:?} is not a whole number of seconds"))?;
            }
            t => match TARGETS.iter().find(|&&x| x == t) {
                Some(&x) => chosen.push(x),
                None => bail!("unknown fuzz target {t:?}: expected one of {}", TARGETS.join(", ")),
            },
        }
    }
    if chosen.is_empty() {
        chosen = TARGETS.to_vec();
    }
    let fuzz = crate::root().join("fuzz");
    let triple = host()?;
    let mut build = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    build
        .current_dir(&fuzz)
        .args(["build", "--release", "--target", &triple])
        .args(chosen.iter().flat_map(|t| ["--bin", t]))
        // Its own target dir: these flags would invalidate the shared one.
        .env("CARGO_TARGET_DIR", fuzz.join("target"))
        .env("RUSTFLAGS", COVERAGE_FLAGS)
        .env_remove("CARGO_ENCODED_RUSTFLAGS");
    if Command::new("clang++-19").arg("--version").output().is_ok_and(|o| o.status.success()) {
        build.env("CXX", "clang++-19").env("CC", "clang-19");
    }
    crate::run(&mut build).context("building the fuzz targets (libFuzzer's C++ part needs clang++ or g++ and libstdc++)")?;

    let mut outcomes = Vec::new();
    for &t in &chosen {
        let corpus = fuzz.join("corpus").join(t);
        std::fs::create_dir_all(&corpus)?;
        seed(t, &corpus)?;
        let artifacts = fuzz.join("artifacts").join(t);
        std::fs::create_dir_all(&artifacts)?;
        let bin = fuzz.join("target").join(&triple).join("release").join(t);
        outcomes.push(fuzz_one(t, &bin, &corpus, &artifacts, seconds)?);
    }
    eprintln!();
    eprintln!("{:<14} {:>8} {:>12} {:>10} {:>8} {:>8}", "target", "seconds", "execs", "execs/s", "corpus", "crashes");
    for o in &outcomes {
        let rate = if o.seconds > 0.0 { o.execs as f64 / o.seconds } else { 0.0 };
        eprintln!("{:<14} {:>8.0} {:>12} {:>10.0} {:>8} {:>8}", o.target, o.seconds, o.execs, rate, o.corpus, o.crashes.len());
    }
    let crashed: Vec<&Outcome> = outcomes.iter().filter(|o| !o.crashes.is_empty()).collect();
    if !crashed.is_empty() {
        for o in &crashed {
            for c in &o.crashes {
                eprintln!("xtask: {} crashed on {}: reproduce with fuzz/target/{triple}/release/{} {}", o.target, c.display(), o.target, c.display());
            }
        }
        bail!("{} fuzz target(s) found crashes", crashed.len());
    }
    Ok(())
}

fn files_in(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir).map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect()).unwrap_or_default()
}

fn fuzz_one(target: &'static str, bin: &Path, corpus: &Path, artifacts: &Path, seconds: u64) -> Result<Outcome> {
    let before: Vec<PathBuf> = files_in(artifacts);
    let mut prefix = artifacts.as_os_str().to_owned();
    prefix.push("/");
    eprintln!("xtask: fuzzing {target} for {seconds} s");
    let out = Command::new(bin)
        .arg(corpus)
        .arg(format!("-max_total_time={seconds}"))
        .arg("-print_final_stats=1")
        .arg("-rss_limit_mb=2048")
        .arg("-timeout=10")
        .arg("-max_len=65536")
        .arg({
            let mut a = std::ffi::OsString::from("-artifact_prefix=");
            a.push(&prefix);
            a
        })
        .output()
        .with_context(|| format!("running {}", bin.display()))?;
    let log = String::from_utf8_lossy(&out.stderr);
    let stat = |name: &str| -> Option<u64> { log.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.trim().parse().ok()) };
    let execs = stat("stat::number_of_executed_units:").unwrap_or(0);
    // "Done N runs in S second(s)" is printed only by a run that ended on time.
    let secs = log
        .lines()
        .find_map(|l| l.strip_prefix("Done ").and_then(|r| r.split(" in ").nth(1)).and_then(|s| s.split_whitespace().next()).and_then(|s| s.parse::<f64>().ok()))
        .unwrap_or(seconds as f64);
    let crashes: Vec<PathBuf> = files_in(artifacts).into_iter().filter(|p| !before.contains(p)).collect();
    if !out.status.success() && crashes.is_empty() {
        let tail: Vec<&str> = log.lines().rev().take(30).collect();
        bail!("{target} exited with {} without leaving a crash file:\n{}", out.status, tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
    }
    if !crashes.is_empty() {
        let tail: Vec<&str> = log.lines().rev().take(40).collect();
        eprintln!("{}", tail.into_iter().rev().collect::<Vec<_>>().join("\n"));
    }
    Ok(Outcome { target, seconds: secs, execs, corpus: files_in(corpus).len(), crashes })
}

/// The stream targets' input shape (fuzz/src/lib.rs `events`): one captured
/// syscall per `(ctl, len:u16le, data)`; keep the two in step.
fn event_seed(events: &[(u8, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    for (ctl, data) in events {
        for chunk in data.chunks(4096) {
            out.push(*ctl);
            out.extend_from_slice(&(chunk.len() as u16).to_le_bytes());
            out.extend_from_slice(chunk);
        }
    }
    out
}

const IN: u8 = 0;
const OUT: u8 = 1;
const ACCEPT: u8 = 6;
const CLOSE: u8 = 4;

fn seed(target: &str, corpus: &Path) -> Result<()> {
    let root = crate::root();
    let vllm = root.parent().map(|p| p.join("shared/fixtures/vllm-0.33.0")).filter(|p| p.is_dir());
    let fixtures = |ext: &str| -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = vllm.as_deref().map(files_in).unwrap_or_default().into_iter().filter(|p| p.to_string_lossy().ends_with(ext)).collect();
        v.sort();
        v
    };
    let mut seeds: Vec<(String, Vec<u8>)> = Vec::new();
    match target {
        "http_stream" => {
            let req = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nx-session-id: s1\r\nx-request-id: r1\r\ntraceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\nContent-Length: 60\r\n\r\n{\"model\":\"m\",\"stream\":true,\"messages\":[{\"role\":\"user\"}]}   ";
            let sse = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n5c\r\ndata: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n\r\n";
            let tail = b"80\r\ndata: {\"id\":\"chatcmpl-1\",\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n\r\n0\r\n\r\n";
            let json = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 98\r\n\r\n{\"id\":\"cmpl-2\",\"object\":\"text_completion\",\"choices\":[{\"text\":\"x\"}],\"usage\":{\"completion_tokens\":1}}";
            seeds.push(("sse".into(), event_seed(&[(ACCEPT, b""), (IN, req), (OUT, sse), (OUT, tail), (CLOSE, b"")])));
            seeds.push(("json".into(), event_seed(&[(ACCEPT, b""), (IN, b"GET /v1/models?key=1 HTTP/1.1\r\nHost: x\r\n\r\n"), (OUT, json)])));
            seeds.push(("client".into(), event_seed(&[(OUT, req), (IN, sse), (IN | 8, b"")])));
            seeds.push(("h2".into(), event_seed(&[(ACCEPT, b""), (IN, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")])));
            // The Responses API: `event:` lines, the type last, usage in the response.
            let rreq = b"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 40\r\n\r\n{\"input\":\"hi\",\"model\":\"m\",\"stream\":true}";
            let rsse = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n79\r\nevent: response.created\ndata: {\"response\":{\"id\":\"resp_1\",\"model\":\"m\",\"status\":\"in_progress\"},\"type\":\"response.created\"}\n\n\r\n";
            let rend = b"70\r\nevent: response.output_text.delta\ndata: {\"delta\":\"hi\",\"sequence_number\":1,\"type\":\"response.output_text.delta\"}\n\n\r\nc7\r\nevent: response.completed\ndata: {\"response\":{\"id\":\"resp_1\",\"status\":\"completed\",\"usage\":{\"input_tokens\":3,\"output_tokens\":1,\"input_tokens_details\":{\"cached_tokens\":0}}},\"type\":\"response.completed\"}\n\n\r\n0\r\n\r\n";
            seeds.push(("responses".into(), event_seed(&[(ACCEPT, b""), (IN, rreq), (OUT, rsse), (OUT, rend), (CLOSE, b"")])));
        }
        "ipc_stream" => {
            for f in fixtures(".zmtp.bin") {
                let bytes = std::fs::read(&f)?;
                let name = f.file_name().unwrap().to_string_lossy().into_owned();
                seeds.push((format!("in-{name}"), event_seed(&[(ACCEPT, b""), (IN, &bytes)])));
                seeds.push((format!("out-{name}"), event_seed(&[(OUT, &bytes)])));
            }
        }
        "msgpack" => {
            for f in fixtures(".msgpack.bin") {
                seeds.push((f.file_name().unwrap().to_string_lossy().into_owned(), std::fs::read(&f)?));
            }
        }
        "cupti_record" => {
            // (kind, size of the newest layout): a zeroed record of each kind.
            for (kind, size) in [(10u32, 248usize), (3, 248), (1, 112), (22, 96), (2, 104), (38, 56), (5, 40), (4, 40)] {
                for sel in [1u8, 6] {
                    let mut b = vec![sel];
                    b.extend_from_slice(&kind.to_le_bytes());
                    b.resize(1 + size * 2, 0);
                    b[1 + size..1 + size + 4].copy_from_slice(&kind.to_le_bytes());
                    seeds.push((format!("kind{kind}-v{sel}"), b));
                }
            }
        }
        "gpu_wire" => {
            use hopscope_gpu_wire as w;
            let msgs = [
                w::Message::Hello(w::Hello {
                    pid: 7,
                    ppid: 1,
                    cupti_version: 130_401,
                    clock: w::ClockSource::Callback,
                    enabled: 0x7f,
                    init_mono_ns: 1_000,
                    struct_sizes: [248, 112, 96, 104, 56, 40],
                    cupti_lib: "libcupti.so.13".into(),
                    comm: "python".into(),
                }),
                w::Message::Name(w::Name { id: 1, name: "_Z6kernelPf".into() }),
                w::Message::Kernel(w::Kernel {
                    start_ns: 2_000,
                    end_ns: 3_000,
                    device_id: 0,
                    context_id: 1,
                    stream_id: 7,
                    correlation_id: 9,
                    grid_id: 1,
                    grid: [1, 2, 3],
                    block: [128, 1, 1],
                    static_shared_mem: 0,
                    dynamic_shared_mem: 0,
                    registers_per_thread: 32,
                    launch_type: 0,
                    name_id: 1,
                    graph_id: 0,
                    graph_node_id: 0,
                }),
                w::Message::Calibration(w::Calibration { offset_ns: -5, error_ns: 2, at_mono_ns: 4_000 }),
                w::Message::Counters(w::Counters { values: vec![(1, 3), (2, 0)] }),
                w::Message::Goodbye,
            ];
            let mut all = vec![16u8];
            for (i, m) in msgs.iter().enumerate() {
                let f = m.to_frame();
                let mut one = vec![255u8];
                one.extend_from_slice(&f);
                seeds.push((format!("msg{i}"), one));
                all.extend_from_slice(&f);
            }
            seeds.push(("session".into(), all));
        }
        "recording" => {
            let mut hops: Vec<PathBuf> = files_in(&root.join("agent/tests/fixtures")).into_iter().filter(|p| p.extension().is_some_and(|e| e == "hop")).collect();
            hops.sort();
            for f in hops {
                let bytes = std::fs::read(&f)?;
                let name = f.file_name().unwrap().to_string_lossy().into_owned();
                for mode in [0u8, 1] {
                    let mut b = vec![mode];
                    b.extend_from_slice(&bytes);
                    seeds.push((format!("{mode}-{name}"), b));
                }
            }
        }
        "record_decode" => {
            // The fixtures' records, re-encoded, 16 to an input (`len:u16le
            // postcard` chunks): records of a kind follow each other, so the
            // slots are reused, and inputs stay small enough to run fast.
            let mut hops: Vec<PathBuf> = files_in(&root.join("agent/tests/fixtures")).into_iter().filter(|p| p.extension().is_some_and(|e| e == "hop")).collect();
            hops.sort();
            for f in hops {
                let loaded = hopscope::recording::load(&f)?;
                let name = f.file_name().unwrap().to_string_lossy().into_owned();
                for (i, group) in loaded.records.chunks(16).enumerate() {
                    let mut b = Vec::new();
                    for r in group {
                        let bytes = postcard::to_stdvec(r)?;
                        let Ok(len) = u16::try_from(bytes.len()) else { continue };
                        b.extend_from_slice(&len.to_le_bytes());
                        b.extend_from_slice(&bytes);
                    }
                    seeds.push((format!("{name}-{i}"), b));
                }
            }
        }
        "deflate" => {
            // Trace-like bytes: the fixtures' recordings (compressed blocks
            // and all) and a repetitive text.
            for f in files_in(&root.join("agent/tests/fixtures")).into_iter().filter(|p| p.extension().is_some_and(|e| e == "hop")) {
                let mut b = std::fs::read(&f)?;
                b.truncate(8_192);
                seeds.push((f.file_name().unwrap().to_string_lossy().into_owned(), b));
            }
            seeds.push(("text".into(), (0..400).flat_map(|k| format!("slice {k} track {}\n", k % 7).into_bytes()).collect()));
        }
        "kernel_event" => seeds.push(("zero".into(), vec![0u8; 64])),
        other => bail!("no seeds for {other}"),
    }
    // Inputs that once failed (committed; the corpus itself is not).
    for f in files_in(&root.join("fuzz/regressions").join(target)) {
        seeds.push((format!("regress-{}", f.file_name().unwrap().to_string_lossy()), std::fs::read(&f)?));
    }
    for (name, bytes) in seeds {
        std::fs::write(corpus.join(format!("seed-{name}")), bytes)?;
    }
    Ok(())
}
