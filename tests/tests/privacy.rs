//! Data protection and least privilege, checked on real outputs (root):
//! a secret planted in prompts, query strings, credentials and completions
//! never reaches a recording, trace, export, metric or report unless
//! `--capture-payload` is given; the agent runs with a fixed, small
//! capability set after attaching; its listeners are on loopback.

use hopscope::model::Record;
use hopscope_integration::*;
use serde_json::Value;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// Sends a streaming chat completion and a non-streaming completion whose
/// prompts carry `secret` (also in the query string, Authorization and
/// Cookie); prints the completion texts as JSON.
const CLIENT: &str = r#"
import json, sys, urllib.request
base, secret = sys.argv[1], sys.argv[2]
def post(path, body):
    req = urllib.request.Request(base + path + "?api_key=" + secret, data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "Authorization": "Bearer " + secret, "Cookie": "session=" + secret,
        "x-session-id": "privacy-chain"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read().decode()
texts = []
raw = post("/v1/chat/completions", {"model": "hopscope-testbed", "stream": True, "max_tokens": 32,
    "messages": [{"role": "user", "content": "please repeat " + secret + " twice"}]})
text = ""
for line in raw.splitlines():
    if line.startswith("data: {"):
        for c in json.loads(line[6:]).get("choices") or []:
            text += (c.get("delta") or {}).get("content") or ""
texts.append(text)
body = json.loads(post("/v1/completions", {"model": "hopscope-testbed", "max_tokens": 32, "prompt": "the secret is " + secret}))
texts.append(body["choices"][0]["text"])
print(json.dumps(texts))
"#;

/// The longest run of `t` that any JSON or text output would carry verbatim
/// (printable ASCII but `"` and `\\`, which JSON escapes).
fn verbatim_run(t: &str) -> String {
    t.split(|c: char| !(' '..='~').contains(&c) || c == '"' || c == '\\').max_by_key(|r| r.len()).unwrap_or("").to_owned()
}

fn unique_secret() -> String {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos();
    format!("PLANTED{:x}{:x}SECRET", t, std::process::id())
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

/// Every byte a recording holds once decoded: each record's Debug form plus
/// the raw payload bytes of `RawIo` records.
fn decoded_recording(path: &Path) -> (Vec<u8>, usize) {
    let loaded = hopscope::recording::load(path).unwrap();
    assert!(loaded.error.is_none(), "{:?}", loaded.error);
    let mut all = format!("{:?}", loaded.meta).into_bytes();
    let mut raw = 0;
    for r in &loaded.records {
        all.extend_from_slice(format!("{r:?}").as_bytes());
        if let Record::RawIo { data, .. } = r {
            raw += 1;
            all.extend_from_slice(data);
        }
    }
    (all, raw)
}

/// A trace's packets decoded (strings as text even if a writer compresses or
/// interns them).
fn decoded_trace(path: &Path) -> Vec<u8> {
    let t = hopscope::sink::perfetto::check::decode(&std::fs::read(path).unwrap()).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    format!("{:?}", hopscope::sink::perfetto::check::flatten(&t)).into_bytes()
}

fn run_client(port: u16, secret: &str) -> Vec<String> {
    let out = Command::new(python()).arg("-c").arg(CLIENT).arg(format!("http://127.0.0.1:{port}")).arg(secret).output().unwrap();
    assert!(out.status.success(), "client: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// GET /metrics in one write (the endpoint reads the request once).
fn scrape(port: u16) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.1 200"), "{out}");
    out
}

fn testbed_cmd(port: u16) -> Vec<String> {
    vec![python().display().to_string(), workspace().join("examples/serve.py").display().to_string(), "--port".into(), port.to_string()]
}

fn hopscope_ok(args: &[&str]) -> Vec<u8> {
    let out = Command::new(hopscope_bin()).args(args).output().unwrap();
    assert!(out.status.success(), "hopscope {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    let mut all = out.stdout;
    all.extend_from_slice(&out.stderr);
    all
}

/// Local address of the TCP socket listening on `port`, from /proc/net/tcp{,6}.
fn listen_addrs(port: u16) -> Vec<String> {
    let mut out = Vec::new();
    for f in ["/proc/net/tcp", "/proc/net/tcp6"] {
        for l in std::fs::read_to_string(f).unwrap_or_default().lines().skip(1) {
            let cols: Vec<&str> = l.split_whitespace().collect();
            // st 0A = LISTEN
            if cols.len() > 3 && cols[3] == "0A" {
                if let Some((addr, p)) = cols[1].split_once(':') {
                    if u16::from_str_radix(p, 16).ok() == Some(port) {
                        out.push(addr.to_owned());
                    }
                }
            }
        }
    }
    out
}

#[test]
fn a_planted_secret_reaches_no_recording_trace_export_metric_or_report_unless_payload_capture_is_asked() {
    let Some(_serial) = privileged("a_planted_secret_reaches_no_recording_trace_export_metric_or_report_unless_payload_capture_is_asked") else { return };
    let dir = scratch("privacy");
    let secret = unique_secret();
    let (mut receiver, otlp_port, spans) = otlp_receiver(&dir);
    let (port, mport) = (free_port(), free_port());
    let (hop, live) = (dir.join("run.hop"), dir.join("live.pftrace"));
    let cmd = testbed_cmd(port);
    let otlp = format!("http://127.0.0.1:{otlp_port}");
    let mport_s = mport.to_string();
    let mut args = vec!["run", "-o", hop.to_str().unwrap(), "--quiet", "--perfetto", live.to_str().unwrap(), "--otlp", &otlp, "--metrics", &mport_s, "--"];
    args.extend(cmd.iter().map(String::as_str));
    let agent = Agent::spawn(&args, &[("OPENBLAS_NUM_THREADS", "1".into()), ("OMP_NUM_THREADS", "1".into())]);
    let metrics_line = agent.wait_line("hopscope: metrics on ", Duration::from_secs(60));
    wait_healthy(port, Duration::from_secs(90));
    let completions = run_client(port, &secret);
    // A bare --metrics port listens on loopback only.
    assert_eq!(metrics_line, format!("hopscope: metrics on http://127.0.0.1:{mport}/metrics"));
    assert_eq!(listen_addrs(mport), vec!["0100007F".to_owned()], "the metrics listener is bound to 127.0.0.1 only");
    std::thread::sleep(Duration::from_millis(1500));
    let metrics = scrape(mport);
    assert!(metrics.contains("hopscope_time_to_first_token_seconds"), "{metrics}");
    let (_, agent_err) = agent.stop();

    // What the client got back, as it would appear in any JSON or text output.
    let texts: Vec<String> = completions.iter().map(|t| verbatim_run(t)).filter(|r| r.len() >= 10).collect();
    assert!(!texts.is_empty(), "the testbed returned completions with 10 JSON-safe bytes in a row: {completions:?}");

    let mut outputs: Vec<(String, Vec<u8>)> = Vec::new();
    outputs.push(("run.hop (file)".into(), std::fs::read(&hop).unwrap()));
    let (decoded, raw) = decoded_recording(&hop);
    assert_eq!(raw, 0, "no payload records without --capture-payload");
    outputs.push(("run.hop (decoded records)".into(), decoded));
    outputs.push(("--perfetto".into(), std::fs::read(&live).expect("live trace written")));
    outputs.push(("--perfetto (decoded)".into(), decoded_trace(&live)));
    outputs.push(("--metrics".into(), metrics.into_bytes()));
    outputs.push(("agent stderr".into(), agent_err.lines().filter(|l| l.starts_with("hopscope")).collect::<Vec<_>>().join("\n").into_bytes()));
    let live_spans = std::fs::read(&spans).expect("--otlp spans received");
    assert!(contains(&live_spans, b"chat.completion") || !live_spans.is_empty());
    outputs.push(("--otlp".into(), live_spans));
    let report = hopscope_ok(&["report", "--json", hop.to_str().unwrap()]);
    let rep: Value = serde_json::from_slice(&report[..report.iter().rposition(|&b| b == b'}').unwrap() + 1]).unwrap();
    assert!(rep["requests"].as_array().unwrap().len() >= 2, "both requests reported");
    outputs.push(("report --json".into(), report));
    outputs.push(("report".into(), hopscope_ok(&["report", hop.to_str().unwrap()])));
    outputs.push(("diff".into(), hopscope_ok(&["diff", hop.to_str().unwrap(), hop.to_str().unwrap()])));
    let trace = dir.join("t.pftrace");
    hopscope_ok(&["trace", hop.to_str().unwrap(), "-o", trace.to_str().unwrap()]);
    outputs.push(("trace".into(), std::fs::read(&trace).unwrap()));
    outputs.push(("trace (decoded)".into(), decoded_trace(&trace)));
    let before = std::fs::metadata(&spans).unwrap().len();
    hopscope_ok(&["export", "otlp", hop.to_str().unwrap(), "--endpoint", &otlp]);
    let exported = std::fs::read(&spans).unwrap();
    assert!(exported.len() as u64 > before, "export otlp sent spans");
    outputs.push(("export otlp".into(), exported));
    receiver.kill().unwrap();
    receiver.wait().unwrap();

    let mut needles: Vec<(&str, Vec<u8>)> = vec![("secret", secret.as_bytes().to_vec())];
    for t in &texts {
        needles.push(("completion", t.as_bytes().to_vec()));
    }
    for (what, bytes) in &outputs {
        for (kind, needle) in &needles {
            assert!(!contains(bytes, needle), "the {kind} {:?} leaked into {what}", String::from_utf8_lossy(needle));
        }
    }

    // With --capture-payload the same check finds it: the scan can see it.
    let port2 = free_port();
    let hop2 = dir.join("payload.hop");
    let cmd2 = testbed_cmd(port2);
    let mut args2 = vec!["run", "-o", hop2.to_str().unwrap(), "--quiet", "--capture-payload", "--"];
    args2.extend(cmd2.iter().map(String::as_str));
    let agent2 = Agent::spawn(&args2, &[("OPENBLAS_NUM_THREADS", "1".into()), ("OMP_NUM_THREADS", "1".into())]);
    wait_healthy(port2, Duration::from_secs(90));
    let completions2 = run_client(port2, &secret);
    std::thread::sleep(Duration::from_millis(300));
    agent2.stop();
    let (decoded2, raw2) = decoded_recording(&hop2);
    assert!(raw2 > 0, "--capture-payload records payload");
    assert!(contains(&decoded2, secret.as_bytes()), "the planted secret is visible in a --capture-payload recording");
    // The non-streaming completion is one JSON body (a streamed one is one
    // byte-token per SSE event, never contiguous on the wire).
    let whole = verbatim_run(&completions2[1]);
    assert!(whole.len() >= 10, "{completions2:?}");
    assert!(contains(&decoded2, whole.as_bytes()), "completion bytes {whole:?} visible with --capture-payload");
    eprintln!("privacy: {} outputs scanned for the secret and {} completion texts; all clean; --capture-payload shows it", outputs.len(), texts.len());
}

/// After attaching, every thread of the agent has exactly the kept
/// capabilities (effective = permitted = CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_BPF;
/// bounding the same; inheritable and ambient empty), and recording still
/// works: kernel stats are read, the traced process's I/O is captured.
#[test]
fn the_agent_keeps_exactly_its_documented_capabilities_after_attaching() {
    let Some(_serial) = privileged("the_agent_keeps_exactly_its_documented_capabilities_after_attaching") else { return };
    let dir = scratch("privacy-caps");
    let go = dir.join("go");
    // Waits for `go`, then forks a child that talks over a socketpair.
    let script = format!(
        "import os, socket, time\nwhile not os.path.exists({go:?}): time.sleep(0.02)\na, b = socket.socketpair()\nif os.fork() == 0:\n    a.send(b'from-the-child'); os._exit(0)\nos.wait(); print(b.recv(100)); time.sleep(30)\n",
        go = go.display().to_string()
    );
    let mut target = Command::new(python()).arg("-c").arg(&script).stdout(std::process::Stdio::null()).spawn().unwrap();
    let hop = dir.join("run.hop");
    let pid = target.id().to_string();
    let agent = Agent::spawn(&["record", "--pid", &pid, "-o", hop.to_str().unwrap()], &[]);
    let line = agent.wait_line("hopscope: attached; capabilities now ", Duration::from_secs(60));
    assert_eq!(line, "hopscope: attached; capabilities now CAP_CHOWN,CAP_DAC_OVERRIDE,CAP_BPF");
    agent.wait_line("hopscope: recording ", Duration::from_secs(30));
    let kept = format!("{:016x}", hopscope::privilege::KEPT_MASK);
    let tasks: Vec<_> = std::fs::read_dir(format!("/proc/{}/task", agent.pid())).unwrap().map(|e| e.unwrap().path()).collect();
    assert!(!tasks.is_empty());
    let mut checked = 0;
    for t in &tasks {
        // A thread that exited since the listing holds no capabilities: its
        // status is gone (this raced once in clean CI); every live one is checked.
        let status = match std::fs::read_to_string(t.join("status")) {
            Ok(s) => s,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => panic!("{}: {e}", t.display()),
        };
        checked += 1;
        let field = |k: &str| status.lines().find_map(|l| l.strip_prefix(k)).map(|v| v.trim().to_owned()).unwrap_or_else(|| panic!("{k} missing"));
        assert_eq!(field("CapEff:"), kept, "{} CapEff", t.display());
        assert_eq!(field("CapPrm:"), kept, "{} CapPrm", t.display());
        assert_eq!(field("CapBnd:"), kept, "{} CapBnd", t.display());
        assert_eq!(field("CapInh:"), "0000000000000000", "{} CapInh", t.display());
        assert_eq!(field("CapAmb:"), "0000000000000000", "{} CapAmb", t.display());
    }
    assert!(checked > 0 && std::path::Path::new(&format!("/proc/{0}/task/{0}", agent.pid())).exists(), "the agent's main thread was checked");
    std::fs::write(&go, b"").unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    agent.stop();
    target.kill().unwrap();
    target.wait().unwrap();
    let report = report_json(&hop);
    let events = report["recording"]["drops"]["kernel_events"].as_u64().unwrap_or(0);
    assert!(events > 0, "kernel stats are still read after the drop: {}", report["recording"]["drops"]);
    let recs = hopscope::recording::load(&hop).unwrap().records;
    let child_io = recs.iter().any(|r| matches!(r, Record::UnixIo { conn, len: 14, .. } if conn.tgid != target.id()));
    assert!(child_io, "a child forked after the drop is traced");
    eprintln!("capabilities after attaching: {} on {} threads", hopscope::privilege::names(hopscope::privilege::KEPT_MASK), tasks.len());
}

/// `hopscope run` forks its command before dropping capabilities: tracing does
/// not change what the server may do (started as root, it keeps root's sets).
#[test]
fn hopscope_run_launches_its_command_with_the_capabilities_hopscope_was_given() {
    let Some(_serial) = privileged("hopscope_run_launches_its_command_with_the_capabilities_hopscope_was_given") else { return };
    let dir = scratch("privacy-run-caps");
    let out = dir.join("child-status");
    let hop = dir.join("run.hop");
    let script = format!("grep -E '^Cap(Eff|Prm|Bnd|Amb)' /proc/self/status > {}", out.display());
    let res = Command::new(hopscope_bin())
        .args(["run", "--quiet", "--nvml-period", "0", "-o"])
        .arg(&hop)
        .args(["--", "sh", "-c", &script])
        .output()
        .expect("hopscope runs");
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert!(res.status.success(), "hopscope run failed: {stderr}");
    assert!(stderr.contains("capabilities now"), "the agent dropped after launching: {stderr}");
    let caps = |text: &str| -> Vec<(String, String)> {
        text.lines()
            .filter(|l| l.starts_with("Cap") && !l.starts_with("CapInh"))
            .map(|l| {
                let (k, v) = l.split_once(':').unwrap();
                (k.to_string(), v.trim().to_string())
            })
            .collect()
    };
    let child = caps(&std::fs::read_to_string(&out).expect("the command ran"));
    let ours = caps(&std::fs::read_to_string("/proc/self/status").unwrap());
    assert_eq!(child.len(), 4, "{child:?}");
    for (k, v) in &child {
        if k == "CapAmb" {
            assert_eq!(v, "0000000000000000", "ambient capabilities are not passed on");
        } else {
            let want = &ours.iter().find(|(o, _)| o == k).unwrap().1;
            assert_eq!(v, want, "{k}: the command keeps what hopscope was given");
        }
    }
}
