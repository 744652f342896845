//! `cargo xtask bench`: what tracing costs the traced server, measured side by
//! side in one run, and what each eBPF program costs per call.
//!
//! Server: tests/fixtures/sse_server.py (uvicorn + FastAPI, one worker). Load:
//! keep-alive HTTP/1.1 clients in this process. Phases alternate untraced and
//! traced (U T U T …) so drift hits both alike. Per-program cost comes from the
//! kernel's own accounting (kernel.bpf_stats_enabled=1, read with bpftool).

use crate::{cargo, ensure_tracefs, root, venv_python};
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
        let ours = ["sys_enter_", "sys_exit_", "sched_", "sock_"].iter().any(|pre| name.starts_with(pre))
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

fn stop_child(mut c: Child) -> Result<()> {
    Command::new("kill").arg("-INT").arg(c.id().to_string()).status()?;
    let st = c.wait()?;
    if !st.success() {
        bail!("hopscope exited with {st}");
    }
    Ok(())
}

pub fn run(args: &[String]) -> Result<()> {
    let rounds: usize = args.iter().position(|a| a == "--rounds").and_then(|i| args.get(i + 1)).map_or(Ok(3), |s| s.parse())?;
    let secs: f64 = args.iter().position(|a| a == "--secs").and_then(|i| args.get(i + 1)).map_or(Ok(4.0), |s| s.parse())?;
    ensure_tracefs()?;
    let py = venv_python()?;
    crate::run(cargo().args(["build", "--release", "-p", "hopscope"]))?;
    let bin = root().join("target/release/hopscope");
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let mut server = Command::new(&py)
        .arg(root().join("tests/fixtures/sse_server.py"))
        .args(["--port", &port.to_string()])
        .stdout(Stdio::null())
        .spawn()
        .context("starting the bench server")?;
    let result = (|| -> Result<()> {
        wait_port(port)?;
        std::fs::write("/proc/sys/kernel/bpf_stats_enabled", "1").context("enabling kernel.bpf_stats_enabled (needs root)")?;
        let conns = 4;
        let mut untraced = Vec::new();
        let mut traced = Vec::new();
        let mut progs = Vec::new();
        let out = std::env::temp_dir().join("hopscope-bench.hop");
        for _ in 0..rounds {
            untraced.push(load(port, conns, secs)?);
            let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs();
            let agent = Command::new(&bin)
                .args(["record", "--quiet", "--pid", &server.id().to_string(), "-o"])
                .arg(&out)
                .spawn()
                .context("starting hopscope")?;
            std::thread::sleep(Duration::from_millis(700));
            traced.push(load(port, conns, secs)?);
            progs = prog_stats(since)?;
            stop_child(agent)?;
        }
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let (u, t) = (mean(&untraced), mean(&traced));
        println!("server req/s (uvicorn + FastAPI, GET /v1/models, {conns} keep-alive clients, {rounds} rounds x {secs} s, alternating):");
        println!("  untraced {u:>9.1} req/s   rounds {untraced:.1?}");
        println!("  traced   {t:>9.1} req/s   rounds {traced:.1?}");
        println!("  ratio traced/untraced = {:.3}  (goal >= 0.97)", t / u);
        println!("eBPF programs (last traced round; kernel.bpf_stats_enabled):");
        println!("  {:<28} {:>12} {:>14} {:>10}", "program", "runs", "run_time_ns", "ns/run");
        let (mut all_cnt, mut all_ns) = (0u64, 0u64);
        for p in &progs {
            let avg = if p.run_cnt > 0 { p.run_time_ns as f64 / p.run_cnt as f64 } else { 0.0 };
            println!("  {:<28} {:>12} {:>14} {:>10.0}", p.name, p.run_cnt, p.run_time_ns, avg);
            all_cnt += p.run_cnt;
            all_ns += p.run_time_ns;
        }
        if all_cnt > 0 {
            println!("  {:<28} {:>12} {:>14} {:>10.0}  (goal <= 300)", "all programs", all_cnt, all_ns, all_ns as f64 / all_cnt as f64);
        }
        let _ = std::fs::remove_file(&out);
        Ok(())
    })();
    let _ = std::fs::write("/proc/sys/kernel/bpf_stats_enabled", "0");
    let _ = server.kill();
    let _ = server.wait();
    result
}
