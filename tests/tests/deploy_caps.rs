//! The capability sets docs/deploy.md documents, checked for real: hopscope
//! run as a non-root user (and as uid 0 with a reduced bounding set, which is
//! what a container with `capabilities: {drop: [ALL], add: [...]}` gets) with
//! exactly those capabilities, through util-linux `setpriv`.

use hopscope_integration::*;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

/// `setpriv` arguments: as `nobody` with these ambient capabilities, or as
/// uid 0 with only these in the bounding set.
fn as_nobody(caps: &str) -> Vec<String> {
    let plus: Vec<String> = caps.split(',').map(|c| format!("+{c}")).collect();
    let set = plus.join(",");
    ["--reuid=nobody", "--regid=nogroup", "--clear-groups", &format!("--inh-caps={set}"), &format!("--ambient-caps={set}"), "--"].map(String::from).to_vec()
}

fn as_root_with(caps: &str) -> Vec<String> {
    let plus: Vec<String> = caps.split(',').map(|c| format!("+{c}")).collect();
    vec![format!("--bounding-set=-all,{}", plus.join(",")), "--".into()]
}

/// `hopscope record` under `setpriv ARGS` for 3 s with one request once it
/// says it is recording (a CI run's attach once took longer than the 1.5 s
/// this waited blindly), or has exited (a refused set).
fn record_with(setpriv: &[String], pid: u32, port: u16, hop: &Path) -> Output {
    let mut child = Command::new("setpriv")
        .args(setpriv)
        .arg(hopscope_bin())
        .args(["record", "--quiet", "--duration", "3s", "--nvml-period", "0", "--pid", &pid.to_string(), "-o"])
        .arg(hop)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (recording, seen) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut said = String::new();
        for line in std::io::BufRead::lines(std::io::BufReader::new(stderr)).map_while(Result::ok) {
            if line.contains("recording pids") {
                let _ = recording.send(());
            }
            said.push_str(&line);
            said.push('\n');
        }
        said
    });
    // Recording, or it exited (the sender dropped): either way, on.
    let _ = seen.recv_timeout(Duration::from_secs(20));
    let _ = http_get(port, "/");
    let out = child.wait_with_output().unwrap();
    Output { stderr: reader.join().unwrap().into_bytes(), ..out }
}

#[test]
fn the_documented_capability_sets_record_and_fewer_fail_in_one_line() {
    let test = "the_documented_capability_sets_record_and_fewer_fail_in_one_line";
    let Some(_serial) = privileged(test) else { return };
    if !util_linux_available("setpriv", test) {
        return;
    }
    let dir = scratch("deploy-caps");
    // nobody writes its recordings here.
    std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let (mut srv, port) = http_server(&dir);
    let pid = srv.id();
    let mut results = Vec::new();
    for (name, args, works) in [
        // docs/deploy.md: a non-root agent needs CAP_DAC_READ_SEARCH for tracefs (0700 root).
        ("nobody: bpf,perfmon,dac_read_search", as_nobody("bpf,perfmon,dac_read_search"), true),
        ("nobody: bpf,perfmon", as_nobody("bpf,perfmon"), false),
        // uid 0 (a container's root with capabilities dropped): BPF + PERFMON suffice.
        ("uid 0: bpf,perfmon", as_root_with("bpf,perfmon"), true),
        ("uid 0: bpf", as_root_with("bpf"), false),
        ("uid 0: perfmon", as_root_with("perfmon"), false),
    ] {
        let hop = dir.join(format!("{}.hop", results.len()));
        let out = record_with(&args, pid, port, &hop);
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        if works {
            assert!(out.status.success(), "{name}: {err}");
            let rep = report_json(&hop);
            let reqs = rep["requests"].as_array().unwrap();
            assert_eq!(reqs.len(), 1, "{name}: the request was recorded: {err}");
            assert_eq!(reqs[0]["status"].as_u64(), Some(200), "{name}");
            assert!(err.contains("capabilities now CAP_BPF"), "{name}: only CAP_BPF is kept after attach: {err}");
        } else {
            assert!(!out.status.success(), "{name} must not be able to trace: {err}");
            assert_eq!(err.trim().lines().count(), 1, "{name}: one line: {err}");
            assert!(err.contains("tracefs") || err.contains("CAP_BPF,CAP_PERFMON"), "{name}: says what is missing: {err}");
        }
        results.push(format!("{name}: {}", if out.status.success() { "records" } else { "refused" }));
    }
    // doctor under the non-root set: every eBPF check passes (the load included).
    let out = Command::new("setpriv").args(as_nobody("bpf,perfmon,dac_read_search")).arg(hopscope_bin()).arg("doctor").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "doctor: {text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.lines().any(|l| l.starts_with("ok    ebpf load")), "{text}");
    let _ = srv.kill();
    let _ = srv.wait();
    eprintln!("capability sets: {}", results.join("; "));
}

/// A sidecar sharing the server's pid namespace (a pod with
/// `shareProcessNamespace`), not the host's: `hopscope run` inside a new pid
/// namespace (util-linux `unshare --pid --mount-proc`) knows its child by its
/// namespace pid, and the programs must see every task by that pid too — the
/// syscalls of the shell it runs, the server that shell forks (the fork
/// program follows it by its namespace tgid) and its context switches. With
/// global pids nothing would match and the recording would hold nothing.
#[test]
fn a_sidecar_in_the_servers_pid_namespace_traces_it_by_namespace_pids() {
    let test = "a_sidecar_in_the_servers_pid_namespace_traces_it_by_namespace_pids";
    let Some(_serial) = privileged(test) else { return };
    if !util_linux_available("unshare", test) {
        return;
    }
    let dir = scratch("pidns");
    std::fs::write(dir.join("index.html"), "hello\n").unwrap();
    let (hop, stop, srv_pid) = (dir.join("ns.hop"), dir.join("stop"), dir.join("srv.pid"));
    let stop_arg = stop.display().to_string();
    let port = free_port();
    // The server runs until the test creates `stop`; then `run` sees its child exit and writes the recording.
    let server = format!(
        "cd '{d}' && '{py}' -m http.server {port} --bind 127.0.0.1 >/dev/null 2>&1 & s=$!; echo $s > '{pid}'; while [ ! -e '{stop}' ]; do sleep 0.1; done; kill $s; wait",
        d = dir.display(),
        py = python().display(),
        pid = srv_pid.display(),
        stop = stop_arg
    );
    let mut child = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "--kill-child", "--"])
        .arg(hopscope_bin())
        // Every off-CPU interval counts as short: a counter that moves whenever a traced thread is switched back in.
        .args(["run", "--quiet", "--nvml-period", "0", "--min-offcpu", "1h", "-o"])
        .arg(&hop)
        .args(["--", "sh", "-c", &server])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // However the test ends, the server stops and `run` with it.
    let stopper = TouchOnDrop(stop);
    if !wait_http(port, "/index.html", Duration::from_secs(20)) {
        drop(stopper);
        let _ = child.kill();
        let out = child.wait_with_output().unwrap();
        panic!("no server on port {port} within 20 s: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    }
    for _ in 0..3 {
        assert_eq!(http_get(port, "/index.html").as_deref(), Some("hello\n"));
    }
    drop(stopper);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "run in a pid namespace: {err}");
    let ns_pid: u64 = std::fs::read_to_string(&srv_pid).unwrap().trim().parse().unwrap();
    assert!(ns_pid < 100, "the server's pid {ns_pid} is its namespace's");
    let rep = report_json(&hop);
    let reqs = rep["requests"].as_array().unwrap();
    // The readiness probes and the three GETs, every one of them the forked server's (its namespace tgid in the connection key).
    let gets: Vec<&serde_json::Value> = reqs.iter().filter(|r| r["path"] == "/index.html").collect();
    assert!(gets.len() >= 3, "{err}\n{}", rep["requests"]);
    for r in &gets {
        assert_eq!(r["status"].as_u64(), Some(200), "{r}");
        let id = r["id"].as_str().unwrap();
        assert!(id.starts_with(&format!("conn:{ns_pid}:")), "{id}: the server's namespace pid {ns_pid}");
    }
    let drops = &rep["recording"]["drops"];
    assert!(drops["kernel_sched_short"].as_u64().unwrap() > 0, "the traced threads' context switches were seen: {drops}");
    // doctor there: the namespace named and the translating programs verified;
    // without the namespace's own /proc, one line saying to mount it.
    let doctor = |args: &[&str]| {
        let out = Command::new("unshare").args(args).arg(hopscope_bin()).arg("doctor").output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let text = doctor(&["--pid", "--fork", "--mount-proc", "--kill-child", "--"]);
    assert!(text.lines().any(|l| l.starts_with("ok    pid namespace  a container's (pid:[")), "{text}");
    assert!(text.lines().any(|l| l.starts_with("ok    ebpf load")), "{text}");
    let text = doctor(&["--pid", "--fork", "--kill-child", "--"]);
    assert!(text.lines().any(|l| l.starts_with("FAIL  ebpf load") && l.contains("mount its own /proc")), "{text}");
}
