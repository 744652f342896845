//! `cargo xtask bench`: what tracing costs the traced server, measured side by
//! side in one run, and what each eBPF program costs per call.
//!
//! Server: tests/fixtures/sse_server.py (uvicorn + FastAPI, one worker). Load:
//! keep-alive HTTP/1.1 clients in this process. Phases alternate untraced and
//! traced (U T U T …) so drift hits both alike. Per-program cost comes from the
//! kernel's own accounting (kernel.bpf_stats_enabled=1, read with bpftool),
//! summed over every traced round. `--baseline BIN` traces each round a
//! second time with another hopscope build (copied aside before a change),
//! the two taking turns at going first: per-program ns side by side, as this
//! VM's speed drifts too much between separate runs to compare them.

use crate::{cargo, ensure_tracefs, root, venv_python, Interrupted};
use anyhow::{bail, Context, Result};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn wait_port(port: u16) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("server did not listen on {port} within 30 s")
}

/// One keep-alive client: GET `path` in a loop until `stop`; counts responses.
fn client(port: u16, path: &str, stop: &AtomicBool, done: &AtomicU64) -> Result<()> {
    let s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_nodelay(true)?;
    let mut w = s.try_clone()?;
    let mut r = BufReader::new(s);
    let req = format!("GET {path} HTTP/1.1\r\nHost: bench\r\n\r\n");
    let mut line = String::new();
    while !stop.load(Ordering::Relaxed) {
        w.write_all(req.as_bytes())?;
        let mut len = 0usize;
        loop {
            line.clear();
            if r.read_line(&mut line)? == 0 {
                bail!("server closed the connection");
            }
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some(v) = l.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse()?;
            }
        }
        let mut body = vec![0u8; len];
        r.read_exact(&mut body)?;
        done.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// Requests per second over `secs` with `conns` keep-alive clients.
fn load(port: u16, conns: usize, secs: f64) -> Result<f64> {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let handles: Vec<_> = (0..conns)
        .map(|_| {
            let (stop, done) = (Arc::clone(&stop), Arc::clone(&done));
            std::thread::spawn(move || client(port, "/v1/models", &stop, &done))
        })
        .collect();
    // Warm-up, then measure.
    std::thread::sleep(Duration::from_millis(300));
    let start_n = done.load(Ordering::Relaxed);
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(secs));
    let n = done.load(Ordering::Relaxed) - start_n;
    let dt = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().map_err(|_| anyhow::anyhow!("load thread panicked"))??;
    }
    Ok(n as f64 / dt)
}

struct Prog {
    name: String,
    run_cnt: u64,
    run_time_ns: u64,
}

/// hopscope's programs as the kernel accounts them (bpftool prog show -j).
/// Debian's bpftool does not list owning pids, so programs are matched by
/// name (the kernel keeps 15 characters) and by load time after `since`.
fn prog_stats(since_unix: u64) -> Result<Vec<Prog>> {
    let out = Command::new("bpftool").args(["prog", "show", "-j"]).output().context("running bpftool (apt-get install bpftool)")?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("parsing bpftool output")?;
    let mut progs = Vec::new();
    for p in v.as_array().into_iter().flatten() {
        let name = p["name"].as_str().unwrap_or("");
        let ours = ["sys_enter_", "sys_exit_", "sched_", "sock_", "net_"].iter().any(|pre| name.starts_with(pre))
            && p["loaded_at"].as_u64().is_some_and(|t| t >= since_unix);
        if !ours {
            continue;
        }
        progs.push(Prog {
            name: p["name"].as_str().unwrap_or("?").to_owned(),
            run_cnt: p["run_cnt"].as_u64().unwrap_or(0),
            run_time_ns: p["run_time_ns"].as_u64().unwrap_or(0),
        });
    }
    Ok(progs)
}

/// The bench server, killed and reaped when dropped: an error between spawn
/// and stop, or a panic (`println!` into a closed pipe, `cargo xtask bench |
/// head`), must not leave it running. (The tracing agents are `Interrupted`.)
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        // Both are no-ops on a child already waited for.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Turns `kernel.bpf_stats_enabled` back off however the bench ends.
struct BpfStats;

impl BpfStats {
    fn enable() -> Result<BpfStats> {
        std::fs::write("/proc/sys/kernel/bpf_stats_enabled", "1").context("enabling kernel.bpf_stats_enabled (needs root)")?;
        Ok(BpfStats)
    }
}

impl Drop for BpfStats {
    fn drop(&mut self) {
        let _ = std::fs::write("/proc/sys/kernel/bpf_stats_enabled", "0");
    }
}

fn stop_child(mut c: Interrupted) -> Result<()> {
    let st = c.stop()?;
    if !st.success() {
        bail!("hopscope exited with {st}");
    }
    Ok(())
}

/// Per-program totals over every traced round of one binary.
fn add_stats(into: &mut Vec<Prog>, round: Vec<Prog>) {
    for p in round {
        match into.iter_mut().find(|q| q.name == p.name) {
            Some(q) => {
                q.run_cnt += p.run_cnt;
                q.run_time_ns += p.run_time_ns;
            }
            None => into.push(p),
        }
    }
}

fn ns_per_run(cnt: u64, ns: u64) -> String {
    if cnt == 0 {
        "-".into()
    } else {
        format!("{:.0}", ns as f64 / cnt as f64)
    }
}

const USAGE: &str = "cargo xtask bench [--rounds N (default 3)] [--secs S (default 4)] [--baseline HOPSCOPE_BIN]\n\
    --baseline: another hopscope build (copied aside) traced in turn with ours in every round:\n\
    req/s and per-program ns side by side";

pub fn run(args: &[String]) -> Result<()> {
    let opts = crate::Opts::parse(args, USAGE, &["--rounds", "--secs", "--baseline"])?;
    let rounds: usize = opts.num("--rounds", 3)?;
    let secs: f64 = opts.num("--secs", 4.0)?;
    if rounds == 0 || secs.is_nan() || secs <= 0.0 {
        bail!("--rounds and --secs must be positive\nusage: {USAGE}");
    }
    let baseline = opts.get("--baseline").map(std::path::PathBuf::from);
    if let Some(b) = &baseline {
        if !b.is_file() {
            bail!("--baseline {}: no such file (give the path of a hopscope binary)", b.display());
        }
    }
    ensure_tracefs()?;
    let py = venv_python()?;
    crate::run(cargo().args(["build", "--release", "-p", "hopscope"]))?;
    let bin = root().join("target/release/hopscope");
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let server = Reaped(
        Command::new(&py)
            .arg(root().join("tests/fixtures/sse_server.py"))
            .args(["--port", &port.to_string()])
            .stdout(Stdio::null())
            .spawn()
            .context("starting the bench server")?,
    );
    wait_port(port)?;
    let _stats = BpfStats::enable()?;
    let conns = 4;
    let out = std::env::temp_dir().join("hopscope-bench.hop");
    // Column 0: ours; column 1: the baseline's (when given).
    let bins: Vec<&std::path::Path> = std::iter::once(bin.as_path()).chain(baseline.as_deref()).collect();
    let mut untraced = Vec::new();
    let mut traced: Vec<Vec<f64>> = vec![Vec::new(); bins.len()];
    let mut progs: Vec<Vec<Prog>> = (0..bins.len()).map(|_| Vec::new()).collect();
    for round in 0..rounds {
        untraced.push(load(port, conns, secs)?);
        // With a baseline, who goes first alternates: drift within a
        // round then favours neither.
        for k in 0..bins.len() {
            let b = (k + round) % bins.len();
            let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs();
            let agent = Interrupted(
                Command::new(bins[b])
                    .args(["record", "--quiet", "--pid", &server.0.id().to_string(), "-o"])
                    .arg(&out)
                    .spawn()
                    .with_context(|| format!("starting {}", bins[b].display()))?,
            );
            std::thread::sleep(Duration::from_millis(700));
            traced[b].push(load(port, conns, secs)?);
            add_stats(&mut progs[b], prog_stats(since)?);
            stop_child(agent)?;
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let u = mean(&untraced);
    println!("server req/s (uvicorn + FastAPI, GET /v1/models, {conns} keep-alive clients, {rounds} rounds x {secs} s, alternating):");
    println!("  untraced    {u:>9.1} req/s   rounds {untraced:.1?}");
    let label = |b: usize| if b == 0 { "traced" } else { "baseline" };
    for (b, t) in traced.iter().enumerate() {
        println!("  {:<10}  {:>9.1} req/s   rounds {t:.1?}   ratio {:.3}  (goal >= 0.97)", label(b), mean(t), mean(t) / u);
    }
    println!("eBPF programs (all traced rounds; kernel.bpf_stats_enabled):");
    let mut names: Vec<&str> = progs.iter().flatten().map(|p| p.name.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    let cell = |b: usize, name: &str| progs[b].iter().find(|p| p.name == name).map_or((0, 0), |p| (p.run_cnt, p.run_time_ns));
    if bins.len() == 1 {
        println!("  {:<28} {:>12} {:>14} {:>10}", "program", "runs", "run_time_ns", "ns/run");
    } else {
        println!("  {:<28} {:>12} {:>10} {:>12} {:>10} {:>7}", "program", "runs", "ns/run", "base runs", "base ns", "ratio");
    }
    let mut all = vec![(0u64, 0u64); bins.len()];
    for name in names {
        let c: Vec<(u64, u64)> = (0..bins.len()).map(|b| cell(b, name)).collect();
        for (a, x) in all.iter_mut().zip(&c) {
            a.0 += x.0;
            a.1 += x.1;
        }
        row(name, &c);
    }
    row("all programs  (goal <= 300)", &all);
    let _ = std::fs::remove_file(&out);
    Ok(())
}

fn row(name: &str, c: &[(u64, u64)]) {
    if let [(n, t)] = c {
        println!("  {name:<28} {n:>12} {t:>14} {:>10}", ns_per_run(*n, *t));
    } else if let [(n, t), (bn, bt), ..] = c {
        let ratio = if *n > 0 && *bn > 0 && *bt > 0 { format!("{:.2}", (*t as f64 / *n as f64) / (*bt as f64 / *bn as f64)) } else { "-".into() };
        println!("  {name:<28} {n:>12} {:>10} {bn:>12} {:>10} {ratio:>7}", ns_per_run(*n, *t), ns_per_run(*bn, *bt));
    }
}
