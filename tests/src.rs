//! Helpers for hopscope's privileged integration tests: real eBPF, real
//! processes. Tests that cannot run here (not root, no tracefs) print a loud
//! SKIPPED line and return; CI runs them as root, where they must pass.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_owned()
}

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(name)
}

static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Privileged tests run one at a time: each drives real servers and clients
/// whose timing must not be skewed by a neighbour test on a 2-core machine.
/// Returns the guard to hold for the test's duration, or None (and a loud
/// SKIPPED line) when the test cannot run here.
pub fn privileged(test: &str) -> Option<std::sync::MutexGuard<'static, ()>> {
    if !can_trace(test) {
        return None;
    }
    Some(SERIAL.lock().unwrap_or_else(|e| e.into_inner()))
}

fn can_trace(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let tracefs = Path::new("/sys/kernel/tracing/events").exists();
    if root && tracefs {
        return true;
    }
    let why = if !root { "needs root" } else { "tracefs not mounted (mount -t tracefs nodev /sys/kernel/tracing)" };
    // Straight to stderr: libtest hides eprintln! output of passing tests, and a
    // skip must never look like a pass.
    let _ = writeln!(std::io::stderr(), "\n!!!!! SKIPPED {test}: {why}: this is NOT a pass; run `cargo xtask test` as root !!!!!\n");
    false
}

/// The built `hopscope` binary (xtask builds it before the tests).
pub fn hopscope_bin() -> PathBuf {
    if let Ok(p) = std::env::var("HOPSCOPE_BIN") {
        return p.into();
    }
    let target = std::env::var("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|_| workspace().join("target"));
    let p = target.join("debug/hopscope");
    assert!(p.exists(), "{} not built: run `cargo build -p hopscope` (cargo xtask test does)", p.display());
    // `cargo test` does not build the binary the tests run: an edit since the
    // last `cargo build` would be tested against the old code, silently.
    static FRESH: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    FRESH.get_or_init(|| {
        let built = std::fs::metadata(&p).and_then(|m| m.modified()).unwrap();
        if let Some((t, src)) = newest_source() {
            assert!(t <= built, "{} is older than {}: run `cargo build -p hopscope` (cargo xtask test does), or set HOPSCOPE_BIN", p.display(), src.display());
        }
    });
    p
}

/// The most recently modified source file the `hopscope` binary is built from.
fn newest_source() -> Option<(std::time::SystemTime, PathBuf)> {
    fn walk(dir: &Path, newest: &mut Option<(std::time::SystemTime, PathBuf)>) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = e.path();
            let Ok(meta) = e.metadata() else { continue };
            if meta.is_dir() {
                walk(&path, newest);
            } else if let Ok(t) = meta.modified() {
                if newest.as_ref().is_none_or(|(n, _)| t > *n) {
                    *newest = Some((t, path));
                }
            }
        }
    }
    let mut newest = None;
    for dir in ["agent/src", "agent-ebpf/src", "hopscope-gpu-wire/src"] {
        walk(&workspace().join(dir), &mut newest);
    }
    newest
}

/// Python with the test packages (xtask's venv), else `.venv/bin/python`.
pub fn python() -> PathBuf {
    if let Ok(p) = std::env::var("HOPSCOPE_PYTHON") {
        return p.into();
    }
    let p = workspace().join(".venv/bin/python");
    assert!(p.exists(), "no python venv: run `cargo xtask setup` (or set HOPSCOPE_PYTHON)");
    p
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A plain HTTP server to trace (`python -m http.server` serving `dir`),
/// accepting connections, and its port.
pub fn http_server(dir: &Path) -> (Child, u16) {
    let port = free_port();
    let child = Command::new(python())
        .args(["-m", "http.server", &port.to_string(), "--bind", "127.0.0.1", "--directory"])
        .arg(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawning python -m http.server");
    let deadline = Instant::now() + Duration::from_secs(10);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "http.server did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    (child, port)
}

/// A fresh scratch directory under target/, of this call alone: tests run
/// in parallel threads of one process, and two that asked for the same name
/// (the OTLP tests export one fixture twice) emptied each other's.
pub fn scratch(name: &str) -> PathBuf {
    static CALLS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let d = workspace().join("target/itest").join(format!("{name}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Plain HTTP GET; the body on 200 (HTTP/1.1, or 1.0 as python's
/// http.server answers).
pub fn http_get(port: u16, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    (out.starts_with("HTTP/1.1 200") || out.starts_with("HTTP/1.0 200")).then(|| out.split("\r\n\r\n").nth(1).unwrap_or("").to_owned())
}

/// Polls `path` until it answers 200 (true) or `timeout` passes (false).
pub fn wait_http(port: u16, path: &str, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if http_get(port, path).is_some() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

pub fn wait_healthy(port: u16, timeout: Duration) {
    assert!(wait_http(port, "/health", timeout), "server on port {port} did not become healthy within {timeout:?}");
}

/// The util-linux `tool` (`setpriv`, `unshare`) is there; else `test`
/// says loudly that it is skipped, never passed.
pub fn util_linux_available(tool: &str, test: &str) -> bool {
    let ok = Command::new(tool).arg("--version").output().is_ok_and(|o| o.status.success());
    if !ok {
        let _ = writeln!(std::io::stderr(), "\n!!!!! SKIPPED {test}: util-linux {tool} not installed: this is NOT a pass !!!!!\n");
    }
    ok
}

/// Creates its file when dropped, however a test ends: the file a child
/// waits for to go on (and so end).
pub struct TouchOnDrop(pub PathBuf);

impl Drop for TouchOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::write(&self.0, "");
    }
}

/// `hopscope run -o FILE -- CMD…` in the background.
pub struct Recording {
    pub child: Child,
    pub path: PathBuf,
}

impl Recording {
    pub fn run(path: &Path, extra: &[&str], cmd: &[&str]) -> Recording {
        Recording::run_env(path, extra, &[], cmd)
    }

    /// [`Recording::run`] with `env` set for hopscope and so for `cmd`.
    pub fn run_env(path: &Path, extra: &[&str], env: &[(&str, &str)], cmd: &[&str]) -> Recording {
        let mut c = Recording::command(path, extra, cmd);
        c.envs(env.iter().copied());
        let child = c.stdout(Stdio::inherit()).stderr(Stdio::inherit()).spawn().expect("spawning hopscope");
        Recording { child, path: path.to_owned() }
    }

    /// The command [`Recording::run`] spawns, for a test that wants its
    /// output elsewhere.
    pub fn command(path: &Path, extra: &[&str], cmd: &[&str]) -> Command {
        let mut c = Command::new(hopscope_bin());
        c.arg("run").arg("-o").arg(path).arg("--quiet").args(extra).arg("--").args(cmd);
        c
    }

    pub fn record(path: &Path, pids: &[u32], extra: &[&str]) -> Recording {
        let mut c = Command::new(hopscope_bin());
        c.arg("record").arg("-o").arg(path).arg("--quiet");
        for p in pids {
            c.arg("--pid").arg(p.to_string());
        }
        let child = c.args(extra).spawn().expect("spawning hopscope");
        Recording { child, path: path.to_owned() }
    }

    /// Waits for the traced server on `port` to answer `/health`; fails at
    /// once, not at the timeout, when hopscope exits first (it could not
    /// start tracing: its error is above).
    pub fn wait_healthy(&mut self, port: u16, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(st) = self.child.try_wait().unwrap() {
                panic!("hopscope exited with {st} before the server on port {port} answered (its error is above)");
            }
            if http_get(port, "/health").is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("server on port {port} did not become healthy within {timeout:?}");
    }

    /// SIGINT, then waits; panics unless hopscope exits 0.
    pub fn stop(mut self) -> PathBuf {
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let st = self.child.wait().unwrap();
        assert!(st.success(), "hopscope exited with {st}");
        self.path
    }
}

/// `hopscope report FILE --json`, parsed.
pub fn report_json(path: &Path) -> serde_json::Value {
    let out = Command::new(hopscope_bin()).arg("report").arg(path).arg("--json").output().unwrap();
    assert!(out.status.success(), "report failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("report --json is json")
}

/// `hopscope report FILE` (the text report); panics on failure.
pub fn report_text(path: &Path) -> String {
    let out = Command::new(hopscope_bin()).arg("report").arg(path).output().unwrap();
    assert!(out.status.success(), "report failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).expect("the text report is UTF-8")
}

/// Runs a Python script from tests/fixtures with the test venv; panics on failure.
pub fn run_py(script: &str, args: &[&str]) -> String {
    let out = Command::new(python()).arg(fixture(script)).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{script} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn read_jsonl(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Nearest-rank-free percentile (numpy linear) of absolute values.
pub fn p(values: &[f64], pct: f64) -> f64 {
    let mut v: Vec<f64> = values.iter().map(|x| x.abs()).collect();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return 0.0;
    }
    let rank = pct / 100.0 * (v.len() - 1) as f64;
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (rank - lo as f64)
}

/// A recording of the testbed (examples/serve.py with `serve_args`) made by
/// `hopscope run`, with a chain client per entry of `clients`, run at once.
pub struct TestbedRun {
    pub hop: PathBuf,
    /// The testbed's ground truth (JSONL), which hopscope never reads.
    pub truth: PathBuf,
    /// The chain clients' own marks, one JSON line per hop (`--out`), all
    /// clients' in one file: `send_ns` is stamped before the request leaves.
    pub client: PathBuf,
}

/// [`TestbedRun`]: each entry of `clients` is one chain client's arguments.
/// Client `i` creates `{dir}/client-i.started` once every chain's first hop
/// has its response headers; `{dir}` in an argument is the run's directory,
/// so `["--start-after", "{dir}/client-0.started"]` starts a client once the
/// first one's first hops are in the engine (whatever their start-ups took).
pub fn record_testbed(name: &str, serve_args: &[&str], clients: &[&[&str]]) -> TestbedRun {
    record_testbed_with(name, &[], serve_args, clients)
}

/// [`record_testbed`] with `hopscope run` options (`record_args`).
pub fn record_testbed_with(name: &str, record_args: &[&str], serve_args: &[&str], clients: &[&[&str]]) -> TestbedRun {
    record_testbed_then(name, &[], record_args, serve_args, clients, || {})
}

/// [`record_testbed_with`] with `env` set for hopscope and the testbed,
/// calling `before_stop` once the clients are done, while hopscope still
/// records (to scrape its live `--metrics`).
pub fn record_testbed_then(
    name: &str,
    env: &[(&str, &str)],
    record_args: &[&str],
    serve_args: &[&str],
    clients: &[&[&str]],
    before_stop: impl FnOnce(),
) -> TestbedRun {
    let dir = scratch(name);
    let port = free_port();
    let py = python();
    let truth = dir.join("truth.jsonl");
    let serve = workspace().join("examples/serve.py");
    let mut cmd: Vec<String> =
        vec![py.display().to_string(), serve.display().to_string(), "--port".into(), port.to_string(), "--ground-truth".into(), truth.display().to_string()];
    cmd.extend(serve_args.iter().map(|s| s.to_string()));
    let cmd_ref: Vec<&str> = cmd.iter().map(String::as_str).collect();
    // One BLAS thread: on a 2-core machine a multi-threaded numpy engine starves
    // ZMQ's I/O threads, whose writes (what hopscope times) then lag the
    // application's send() calls (what the truth stamps) by milliseconds. A
    // real inference server has cores to spare for them.
    std::env::set_var("OPENBLAS_NUM_THREADS", "1");
    std::env::set_var("OMP_NUM_THREADS", "1");
    let mut rec = Recording::run_env(&dir.join("run.hop"), record_args, env, &cmd_ref);
    rec.wait_healthy(port, Duration::from_secs(60));
    let base = format!("http://127.0.0.1:{port}");
    // Several clients run at once (an agent's streamed calls beside another's
    // whole-answer ones), each its own process writing its own marks.
    let running: Vec<(PathBuf, Child)> = clients
        .iter()
        .enumerate()
        .map(|(i, args)| {
            let out = dir.join(format!("client-{i}.jsonl"));
            let started = dir.join(format!("client-{i}.started"));
            let args = args.iter().map(|a| a.replace("{dir}", &dir.display().to_string()));
            // The client runs niced, for the same reason.
            let child = Command::new("nice")
                .args(["-n", "10"])
                .arg(&py)
                .arg(workspace().join("examples/chain_client.py"))
                .args(["--base-url", &base, "--quiet", "--out"])
                .arg(&out)
                .arg("--signal-file")
                .arg(&started)
                .args(args)
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .expect("starting the chain client");
            (out, child)
        })
        .collect();
    let mut marks = Vec::new();
    for (out, child) in running {
        let done = child.wait_with_output().unwrap();
        assert!(done.status.success(), "chain client: {}", String::from_utf8_lossy(&done.stderr));
        marks.extend(std::fs::read(&out).unwrap());
    }
    let client = dir.join("client.jsonl");
    std::fs::write(&client, marks).unwrap();
    before_stop();
    TestbedRun { hop: rec.stop(), truth, client }
}

/// `hopscope ARGS…` in the background with stdout and stderr collected
/// (fault and privacy tests read the agent's lines and signal it).
pub struct Agent {
    pub child: Child,
    lines: std::sync::mpsc::Receiver<String>,
    /// Everything read so far from stderr and stdout (a process the agent
    /// launched may hold the pipes open after the agent is gone).
    stderr: std::sync::Arc<std::sync::Mutex<String>>,
    stdout: std::sync::Arc<std::sync::Mutex<String>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Agent {
    pub fn spawn(args: &[&str], env: &[(&str, String)]) -> Agent {
        use std::io::BufRead;
        let mut c = Command::new(hopscope_bin());
        for k in ["HOPSCOPE_GPU_SOCKET", "CUDA_INJECTION64_PATH", "HOPSCOPE_CUPTI_INJECTION", "VIRTUAL_ENV", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES"] {
            c.env_remove(k);
        }
        for (k, v) in env {
            c.env(k, v);
        }
        let mut child = c.args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawning hopscope");
        let (tx, lines) = std::sync::mpsc::channel();
        let (stderr, stdout) = (std::sync::Arc::new(std::sync::Mutex::new(String::new())), std::sync::Arc::new(std::sync::Mutex::new(String::new())));
        let err = child.stderr.take().unwrap();
        let err_buf = std::sync::Arc::clone(&stderr);
        let r1 = std::thread::spawn(move || {
            for l in std::io::BufReader::new(err).lines().map_while(Result::ok) {
                let _ = tx.send(l.clone());
                let mut b = err_buf.lock().unwrap();
                b.push_str(&l);
                b.push('\n');
            }
        });
        let out = child.stdout.take().unwrap();
        let out_buf = std::sync::Arc::clone(&stdout);
        let r2 = std::thread::spawn(move || {
            for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                let mut b = out_buf.lock().unwrap();
                b.push_str(&l);
                b.push('\n');
            }
        });
        Agent { child, lines, stderr, stdout, readers: vec![r1, r2] }
    }

    /// The first stderr line starting with `prefix` (panics after `timeout`).
    pub fn wait_line(&self, prefix: &str, timeout: Duration) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.starts_with(prefix) => return l,
                Ok(_) => {}
                Err(_) => panic!("hopscope printed no line starting with {prefix:?} within {timeout:?}"),
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything on the agent's stdout so far (a launched command's output goes there too).
    pub fn stdout_so_far(&self) -> String {
        self.stdout.lock().unwrap().clone()
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: plain kill(2) on our own child's pid.
        let rc = unsafe { libc::kill(self.child.id() as i32, sig) };
        assert_eq!(rc, 0, "kill({}, {sig})", self.child.id());
    }

    /// Waits (≤ `timeout`, then SIGKILL and panic) for exit: (status,
    /// stdout, stderr); the output is what arrived up to 5 s after the exit.
    pub fn wait(mut self, timeout: Duration) -> (std::process::ExitStatus, String, String) {
        let deadline = Instant::now() + timeout;
        let st = loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                break st;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("hopscope still running after {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let drained = Instant::now() + Duration::from_secs(5);
        while self.readers.iter().any(|r| !r.is_finished()) && Instant::now() < drained {
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = self.stdout.lock().unwrap().clone();
        let err = self.stderr.lock().unwrap().clone();
        (st, out, err)
    }

    /// SIGINT, then [`Agent::wait`]; panics unless hopscope exits 0.
    pub fn stop(self) -> (String, String) {
        self.signal(libc::SIGINT);
        let (st, out, err) = self.wait(Duration::from_secs(120));
        assert!(st.success(), "hopscope exited with {st}: {err}");
        (out, err)
    }
}

/// A test that panics must not leave the agent (and the server it launched) behind.
impl Drop for Agent {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            // SAFETY: plain kill(2) on our own child's pid.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while matches!(self.child.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The CUPTI injection library, the CUPTI ABI test double (a stand-in for
/// libcupti at the hardware boundary, never GPU evidence) and its host program.
pub struct CuptiDouble {
    pub injection: PathBuf,
    pub double: PathBuf,
    pub host: PathBuf,
}

/// Builds [`CuptiDouble`] into target/cupti-double (the surrounding `cargo
/// test` holds the lock on target/), once per test binary.
pub fn cupti_double_artifacts() -> &'static CuptiDouble {
    static BUILT: std::sync::OnceLock<CuptiDouble> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| {
        let target = workspace().join("target/cupti-double");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let out = Command::new(cargo)
            .current_dir(workspace())
            .args(["build", "--quiet", "-p", "agent-cupti", "-p", "cupti-abi-test-double", "--target-dir"])
            .arg(&target)
            .output()
            .expect("running cargo build");
        assert!(
            out.status.success(),
            "building the injection library and the test double failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let d = target.join("debug");
        let a = CuptiDouble {
            injection: d.join("libhopscope_cupti.so"),
            double: d.join("libcupti_abi_test_double.so"),
            host: d.join("cupti-abi-test-double-host"),
        };
        for p in [&a.injection, &a.double, &a.host] {
            assert!(p.exists(), "{} not built", p.display());
        }
        a
    })
}

/// tests/fixtures/otlp_receiver.py, listening: (process, port, spans file).
pub fn otlp_receiver(dir: &Path) -> (Child, u16, PathBuf) {
    let (out, port_file) = (dir.join("spans.jsonl"), dir.join("otlp.port"));
    let rx = Command::new(python()).arg(fixture("otlp_receiver.py")).arg("--out").arg(&out).arg("--port-file").arg(&port_file).stderr(Stdio::inherit()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let port = loop {
        if let Some(p) = std::fs::read_to_string(&port_file).ok().and_then(|p| p.trim().parse().ok()) {
            break p;
        }
        assert!(Instant::now() < deadline, "the OTLP receiver did not start");
        std::thread::sleep(Duration::from_millis(50));
    };
    (rx, port, out)
}
