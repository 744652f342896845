//! `cargo xtask demo [--out DIR]`: the first thing a new user runs.
//!
//! Starts the vLLM-shaped testbed (examples/) under `hopscope run`, drives a
//! 5-hop chain and then concurrent chains through it (their first hops ask
//! for a JSON answer: the scheduler's wait for a grammar), stops the recording and
//! prints hopscope's report (per request, per chain and hop). Writes
//! DIR/demo.hop, DIR/demo.pftrace (Perfetto), DIR/report.json,
//! DIR/client.jsonl (the client's own timings), DIR/truth.jsonl (the
//! testbed's ground truth, which hopscope never reads).

use crate::{cargo, ensure_toolchain, ensure_tracefs, root, run, venv_python, Interrupted};
use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn wait_healthy(port: u16, child: &mut Child) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(90);
    while Instant::now() < deadline {
        if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            use std::io::{Read, Write};
            let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
            let _ = write!(s, "GET /health HTTP/1.1\r\nHost: demo\r\nConnection: close\r\n\r\n");
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            if out.starts_with("HTTP/1.1 200") {
                return Ok(());
            }
        }
        if let Some(st) = child.try_wait()? {
            bail!("hopscope (or the testbed under it) exited early with {st}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    bail!("the testbed did not become healthy on port {port} within 90 s")
}

pub fn run_demo(args: &[String]) -> Result<()> {
    let opts = crate::Opts::parse(args, "cargo xtask demo [--out DIR (default demo-out)]", &["--out"])?;
    let out = PathBuf::from(opts.get("--out").unwrap_or("demo-out"));
    let out = if out.is_absolute() { out } else { std::env::current_dir()?.join(out) };
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    ensure_toolchain()?;
    ensure_tracefs()?;
    let py = venv_python()?;
    run(cargo().args(["build", "--release", "-p", "hopscope"]))?;
    let bin = root().join("target/release/hopscope");
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let hop = out.join("demo.hop");
    let truth = out.join("truth.jsonl");
    let client = out.join("client.jsonl");
    for f in [&truth, &client] {
        let _ = std::fs::remove_file(f);
    }
    eprintln!("demo: starting the testbed on 127.0.0.1:{port} under hopscope");
    let mut agent = Interrupted(Command::new(&bin)
        .args(["run", "--quiet", "-o"])
        .arg(&hop)
        .arg("--")
        .arg(&py)
        .arg(root().join("examples/serve.py"))
        .args(["--port", &port.to_string(), "--ground-truth"])
        .arg(&truth)
        .stdin(Stdio::null())
        .spawn()
        .context("starting hopscope run")?);
    let result = (|| -> Result<()> {
        wait_healthy(port, &mut agent.0)?;
        let base = format!("http://127.0.0.1:{port}");
        // A ReAct agent's stop string: the server holds back its length
        // less one character of text, which the hop table then tells.
        eprintln!("demo: one 5-hop chain (plan → write → review → refactor → test; a ReAct stop string, \"Observation:\")");
        run(Command::new(&py)
            .arg(root().join("examples/chain_client.py"))
            .args(["--base-url", &base, "--chains", "1", "--hops", "5", "--max-tokens", "48", "--traceparent", "--stop", "\nObservation:", "--out"])
            .arg(&client))?;
        eprintln!("demo: 4 concurrent 3-hop chains (queueing, prefix-cache reuse; a JSON answer at hop 1: structured output)");
        run(Command::new(&py)
            .arg(root().join("examples/chain_client.py"))
            .args(["--base-url", &base, "--chains", "4", "--hops", "3", "--max-tokens", "32", "--task-seed", "7", "--json-schema-hops", "1", "--append", "--out"])
            .arg(&client))?;
        Ok(())
    })();
    // Stop recording whatever happened, so nothing is left running.
    let st = agent.stop()?;
    result?;
    if !st.success() {
        bail!("hopscope exited with {st}");
    }
    let json = Command::new(&bin).arg("report").arg(&hop).arg("--json").output()?;
    if !json.status.success() {
        bail!("hopscope report failed: {}", String::from_utf8_lossy(&json.stderr));
    }
    std::fs::write(out.join("report.json"), &json.stdout)?;
    run(Command::new(&bin).arg("trace").arg(&hop).arg("-o").arg(out.join("demo.pftrace")))?;
    run(Command::new(&bin).arg("report").arg(&hop))?;
    eprintln!(
        "demo: wrote {}/{{demo.hop, demo.pftrace, report.json, client.jsonl, truth.jsonl}}; open demo.pftrace in https://ui.perfetto.dev",
        out.display()
    );
    Ok(())
}
