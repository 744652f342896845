//! The command line as users meet it: clear one-line errors, deterministic
//! reports, and recordings that survive the agent being killed.

use hopscope_integration::*;
use std::process::{Command, Stdio};
use std::time::Duration;

fn hopscope(args: &[&str]) -> std::process::Output {
    Command::new(hopscope_bin()).args(args).output().unwrap()
}

#[test]
fn a_missing_pid_is_one_clear_error_line() {
    let Some(_serial) = privileged("a_missing_pid_is_one_clear_error_line") else { return };
    let out = hopscope(&["record", "--pid", "999999999", "-o", "/dev/null", "--duration", "1s"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("pid 999999999 not found"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
}

#[test]
fn report_on_a_file_that_is_not_a_recording_says_so() {
    let dir = scratch("cli-bad-file");
    let f = dir.join("x.hop");
    std::fs::write(&f, b"definitely not a recording").unwrap();
    let out = hopscope(&["report", f.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a hopscope recording"), "{err}");
    let missing = hopscope(&["report", dir.join("nope.hop").to_str().unwrap()]);
    let err = String::from_utf8_lossy(&missing.stderr);
    assert!(err.contains("cannot open recording"), "{err}");
    // The cause once, though the error both says it and gives it as its source.
    assert_eq!(err.matches("No such file or directory").count(), 1, "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
}

/// The streamed reports spool to TMPDIR: when it fills up, one line says
/// where the spool was and what to do, for the JSON and the text report.
#[test]
fn a_full_tmpdir_is_one_line_naming_it_and_what_to_do() {
    let Some(_serial) = privileged("a_full_tmpdir_is_one_line_naming_it_and_what_to_do") else { return };
    let dir = scratch("cli-full-tmpdir");
    let tmp = dir.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    // One page of tmpfs: less than the fixture's spooled requests and hops need.
    let mounted = Command::new("mount").args(["-t", "tmpfs", "-o", "size=4k", "tmpfs"]).arg(&tmp).status().unwrap();
    assert!(mounted.success(), "mount tmpfs on {}", tmp.display());
    let hop = workspace().join("agent/tests/fixtures/chain3.hop");
    let mut outs = Vec::new();
    for json in [true, false] {
        let mut c = Command::new(hopscope_bin());
        c.arg("report");
        if json {
            c.arg("--json");
        }
        outs.push(c.arg(&hop).env("TMPDIR", &tmp).output().unwrap());
    }
    let _ = Command::new("umount").arg(&tmp).status();
    for out in outs {
        assert!(!out.status.success(), "a full TMPDIR fails the report");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("No space left on device") && err.contains(&format!("spools to {}", tmp.display())) && err.contains("point TMPDIR at a larger disk"), "{err}");
        assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    }
}

#[test]
fn bad_duration_is_rejected_with_the_accepted_forms() {
    let out = hopscope(&["record", "--pid", "1", "--duration", "soon"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("500ms, 30s, 2m"));
}

/// SIGKILL mid-recording: what was sealed more than a second before the kill
/// is readable, the report says the file ends early, and two reports of the
/// same file are byte-identical.
#[test]
fn a_killed_agent_leaves_a_readable_recording_and_reports_are_deterministic() {
    let Some(_serial) = privileged("a_killed_agent_leaves_a_readable_recording_and_reports_are_deterministic") else { return };
    let dir = scratch("cli-kill");
    let port = free_port();
    let py = python();
    let server = fixture("sse_server.py");
    let mut rec = Recording::run(&dir.join("run.hop"), &[], &[py.to_str().unwrap(), server.to_str().unwrap(), "--port", &port.to_string()]);
    rec.wait_healthy(port, Duration::from_secs(30));
    let out = dir.join("client.jsonl");
    run_py("sse_client.py", &["--base", &format!("http://127.0.0.1:{port}"), "--out", out.to_str().unwrap(), "--sequential", "5", "--sdk", "raw"]);
    std::thread::sleep(Duration::from_millis(2500));
    rec.child.kill().unwrap();
    rec.child.wait().unwrap();
    // The server outlives a SIGKILLed agent: find and stop it.
    let health = http_get(port, "/health").expect("server still up");
    let pid: i32 = serde_json::from_str::<serde_json::Value>(&health).unwrap()["pid"].as_i64().unwrap() as i32;
    // SAFETY: plain kill(2) of the server we started.
    unsafe { libc::kill(pid, libc::SIGTERM) };

    let a = report_json(&rec.path);
    let b = report_json(&rec.path);
    assert_eq!(a, b, "the same file gives the same report");
    let text1 = hopscope(&["report", rec.path.to_str().unwrap()]).stdout;
    let text2 = hopscope(&["report", rec.path.to_str().unwrap()]).stdout;
    assert_eq!(text1, text2);
    let client = read_jsonl(&out);
    for c in &client {
        let id = c["id"].as_str().unwrap();
        let r = a["requests"].as_array().unwrap().iter().find(|r| r["id"] == id).unwrap_or_else(|| panic!("{id} lost by the kill"));
        assert_eq!(r["content_chunks"].as_u64().unwrap() as usize, c["content_ns"].as_array().unwrap().len());
    }
}

#[test]
fn doctor_loads_the_programs_and_says_what_is_there() {
    let Some(_serial) = privileged("doctor_loads_the_programs_and_says_what_is_there") else { return };
    let out = hopscope(&["doctor"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    for check in ["kernel", "btf", "tracefs", "wire arrival", "wire departure", "privileges", "pid namespace", "ebpf build", "ebpf load"] {
        let line = text.lines().find(|l| l[6..].starts_with(check)).unwrap_or_else(|| panic!("no {check} line in\n{text}"));
        assert!(line.starts_with("ok"), "{line}");
    }
    let json: serde_json::Value = serde_json::from_slice(&hopscope(&["doctor", "--json", "--no-load"]).stdout).unwrap();
    assert!(json.as_array().unwrap().iter().all(|c| c["level"] != "fail"), "{json}");
}

#[test]
fn an_unprivileged_user_gets_one_line_saying_which_capabilities_are_needed() {
    let Some(_serial) = privileged("an_unprivileged_user_gets_one_line_saying_which_capabilities_are_needed") else { return };
    let dir = scratch("cli-nobody");
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(hopscope_bin())
        .args(["record", "--pid", "1", "--duration", "1s", "-o"])
        .arg(dir.join("x.hop"))
        .output()
        .expect("setpriv (util-linux) runs hopscope as nobody");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("run as root or grant CAP_BPF,CAP_PERFMON"), "{err}");
}

#[test]
fn record_with_perfetto_writes_a_valid_trace_when_it_stops() {
    let Some(_serial) = privileged("record_with_perfetto_writes_a_valid_trace_when_it_stops") else { return };
    let dir = scratch("cli-perfetto");
    let port = free_port();
    let py = python();
    let server = fixture("sse_server.py");
    let trace = dir.join("live.pftrace");
    let rec = Recording::run(
        &dir.join("run.hop"),
        &["--perfetto", trace.to_str().unwrap()],
        &[py.to_str().unwrap(), server.to_str().unwrap(), "--port", &port.to_string()],
    );
    wait_healthy(port, Duration::from_secs(30));
    let out = dir.join("client.jsonl");
    run_py("sse_client.py", &["--base", &format!("http://127.0.0.1:{port}"), "--out", out.to_str().unwrap(), "--sequential", "2", "--sdk", "raw"]);
    rec.stop();
    let summary = hopscope::sink::perfetto::check::check_bytes(&std::fs::read(&trace).expect("trace written")).unwrap_or_else(|e| panic!("{e}"));
    for c in read_jsonl(&out) {
        assert!(summary.track(c["id"].as_str().unwrap()).is_some(), "request track for {}", c["id"]);
    }
}

/// `--metrics`: scraped during the recording and parsed with the reference
/// Python parser (prometheus_client), the histograms count every request.
#[test]
fn metrics_endpoint_serves_vllm_style_histograms_during_the_recording() {
    let Some(_serial) = privileged("metrics_endpoint_serves_vllm_style_histograms_during_the_recording") else { return };
    let dir = scratch("cli-metrics");
    let port = free_port();
    let mport = free_port();
    let py = python();
    let server = fixture("sse_server.py");
    let rec = Recording::run(
        &dir.join("run.hop"),
        &["--metrics", &format!("127.0.0.1:{mport}"), "--chain-header", "x-session-id"],
        &[py.to_str().unwrap(), server.to_str().unwrap(), "--port", &port.to_string()],
    );
    wait_healthy(port, Duration::from_secs(30));
    let out = dir.join("client.jsonl");
    run_py("sse_client.py", &["--base", &format!("http://127.0.0.1:{port}"), "--out", out.to_str().unwrap(), "--sequential", "4", "--concurrent", "2x2", "--sdk", "raw", "--session", "s1"]);
    // Records reach the metrics when they leave the reorder window and the tick.
    std::thread::sleep(Duration::from_millis(1500));
    let scraped: serde_json::Value = serde_json::from_str(&run_py("scrape.py", &[&format!("http://127.0.0.1:{mport}/metrics")])).unwrap();
    let n = read_jsonl(&out).len() as f64;
    // The phase histograms come from the correlator, which hands a request
    // out once it has settled (~2 s after its end): decode only here, from
    // the wire (this server speaks no engine IPC).
    let decode = |s: &serde_json::Value| -> f64 {
        s["hopscope_request_decode_time_seconds"]["samples"].as_array().into_iter().flatten().filter(|x| x[0] == "hopscope_request_decode_time_seconds_count").map(|x| x[2].as_f64().unwrap()).sum()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let mut later = scraped.clone();
    while decode(&later) < n && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(500));
        later = serde_json::from_str(&run_py("scrape.py", &[&format!("http://127.0.0.1:{mport}/metrics")])).unwrap();
    }
    assert_eq!(decode(&later), n, "every request's decode phase: {}", later["hopscope_request_decode_time_seconds"]);
    assert_eq!(later["hopscope_request_queue_time_seconds"]["type"], "histogram");
    rec.stop();
    let count = |fam: &str, sample: &str| -> f64 {
        scraped[fam]["samples"].as_array().unwrap_or_else(|| panic!("no family {fam}: {scraped}")).iter().filter(|s| s[0] == sample).map(|s| s[2].as_f64().unwrap()).sum()
    };
    assert_eq!(scraped["hopscope_time_to_first_token_seconds"]["type"], "histogram");
    assert_eq!(count("hopscope_time_to_first_token_seconds", "hopscope_time_to_first_token_seconds_count"), n);
    // vLLM's `model_name` label: the model the client's bodies named.
    let named: f64 = scraped["hopscope_time_to_first_token_seconds"]["samples"].as_array().unwrap().iter().filter(|s| s[0] == "hopscope_time_to_first_token_seconds_count" && s[1]["model_name"] == "test-model").map(|s| s[2].as_f64().unwrap()).sum();
    assert_eq!(named, n, "{}", scraped["hopscope_time_to_first_token_seconds"]);
    // Every answered request, the health checks included.
    assert!(count("hopscope_e2e_request_latency_seconds", "hopscope_e2e_request_latency_seconds_count") >= n);
    // 12 chunks per request: 11 gaps each.
    assert_eq!(count("hopscope_inter_token_latency_seconds", "hopscope_inter_token_latency_seconds_count"), n * 11.0);
    // All 8 requests share the session header: hops 1..8.
    let hops = count("hopscope_hop_time_to_first_token_seconds", "hopscope_hop_time_to_first_token_seconds_count");
    assert_eq!(hops, n);
    // The client's time between hops: at least between the 4 sequential
    // ones; never before a hop that arrived with another still running.
    assert_eq!(scraped["hopscope_chain_between_hops_seconds"]["type"], "histogram");
    let gaps = count("hopscope_chain_between_hops_seconds", "hopscope_chain_between_hops_seconds_count");
    assert!((3.0..n).contains(&gaps), "{gaps} of {n} hops: {}", scraped["hopscope_chain_between_hops_seconds"]);
    assert!(count("hopscope_requests", "hopscope_requests_total") >= n, "{}", scraped["hopscope_requests"]);
    assert!(count("hopscope_generation_tokens", "hopscope_generation_tokens_total") >= n * 12.0);
}

/// openai-python 1.x writes `model` after `messages` (3.x before them):
/// behind a 60 KB prompt it is in the last bytes of the server's reads,
/// past the 4 KiB TCP prefix. With the TCP tail every request names its
/// model; with `--capture-tail-bytes 0` the requests whose last read began
/// more than 4 KiB before the body's end do not (counted as lost) and take
/// the model their response's chunks name.
#[test]
fn a_long_prompt_before_the_model_names_it_through_the_reads_tail() {
    let Some(_serial) = privileged("a_long_prompt_before_the_model_names_it_through_the_reads_tail") else { return };
    let dir = scratch("cli-long-body");
    let py = python();
    let server = fixture("sse_server.py");
    for tail in ["16384", "0"] {
        let port = free_port();
        let hop = dir.join(format!("tail-{tail}.hop"));
        let rec = Recording::run(&hop, &["--capture-tail-bytes", tail], &[py.to_str().unwrap(), server.to_str().unwrap(), "--port", &port.to_string()]);
        wait_healthy(port, Duration::from_secs(30));
        let out = dir.join(format!("client-{tail}.jsonl"));
        run_py("sse_client.py", &["--base", &format!("http://127.0.0.1:{port}"), "--out", out.to_str().unwrap(), "--sequential", "3", "--tokens", "4", "--prompt-bytes", "60000", "--prompt-first"]);
        rec.stop();
        let rep = report_json_of(&[hop]);
        // Two chat streams and a completions stream.
        let chat: Vec<&serde_json::Value> = rep["requests"].as_array().unwrap().iter().filter(|r| r["method"] == "POST").collect();
        assert_eq!(chat.len(), 3, "{rep}");
        for r in &chat {
            assert!(r["request_bytes"].as_u64().unwrap() > 60_000, "{r}");
            assert_eq!(r["completion_tokens"], 4, "the stream decoded: {r}");
        }
        let named = chat.iter().filter(|r| r["model"] == "test-model").count();
        let (lost, answered) = (counter(&rep, "json_meta_lost"), counter(&rep, "request_model_from_response"));
        eprintln!("tail {tail}: {named} of 3 named; json_body_ends {}, json_meta_lost {lost}, request_model_from_response {answered}", counter(&rep, "json_body_ends"));
        // Every request is named: by its body, else by its response's chunks.
        assert_eq!(named, 3, "{:?}", chat.iter().map(|r| &r["model"]).collect::<Vec<_>>());
        if tail == "0" {
            // Only a read that began within 4 KiB of the body's end has it;
            // the others take the model their response names.
            assert!(lost > 0, "without a tail the model is past the capture");
            assert_eq!(answered, lost);
        } else {
            assert_eq!((lost, answered), (0, 0));
        }
    }
}

/// Whether a process with exactly this command line is alive (not a zombie).
fn running(cmdline: &[&str]) -> bool {
    let want: Vec<u8> = cmdline.iter().flat_map(|a| a.bytes().chain([0])).collect();
    std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
        let p = e.path();
        std::fs::read(p.join("cmdline")).is_ok_and(|c| c == want)
            && std::fs::read_to_string(p.join("stat")).is_ok_and(|s| s.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')))
    })
}

/// `run` owns its command. What the user can fix (an output path, a port in
/// use) fails before the command is launched, leaving no empty recording
/// behind; a recording that fails later (its disk fills up)
/// stops the command instead of leaving it running untraced.
#[test]
fn run_never_leaves_its_command_running_untraced_when_recording_fails() {
    let Some(_serial) = privileged("run_never_leaves_its_command_running_untraced_when_recording_fails") else { return };
    let dir = scratch("cli-run-fails");
    let bin = hopscope_bin();
    let sleep = ["sleep", "1000.25"];

    let bad = dir.join("missing/x.hop");
    let out = Command::new(&bin).args(["run", "-o", bad.to_str().unwrap(), "--"]).args(sleep).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains(&format!("cannot create the recording {}: No such file or directory", bad.display())), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line, nothing launched: {err}");
    assert!(!running(&sleep), "the command was never launched");

    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().to_string();
    let hop = dir.join("port.hop");
    let out = Command::new(&bin).args(["run", "-o", hop.to_str().unwrap(), "--metrics", &port, "--"]).args(sleep).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains(&format!("cannot serve metrics on {port}: Address already in use")), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line, nothing launched: {err}");
    assert!(!running(&sleep), "the command was never launched");
    assert!(!hop.exists(), "no empty recording left behind");
    // An older recording at -o stays as it was when the start fails: the
    // port in use, or a command that cannot be launched (a typo).
    let older = dir.join("older.hop");
    let old_bytes: Vec<u8> = b"an older recording ".iter().copied().cycle().take(4 << 20).collect();
    std::fs::write(&older, &old_bytes).unwrap();
    let out = Command::new(&bin).args(["run", "-o", older.to_str().unwrap(), "--metrics", &port, "--"]).args(sleep).output().unwrap();
    assert!(!out.status.success() && !running(&sleep));
    assert!(std::fs::read(&older).unwrap() == old_bytes, "{}", String::from_utf8_lossy(&out.stderr));
    let out = Command::new(&bin).args(["run", "-o", older.to_str().unwrap(), "--", "/nonexistent/vllm-typo", "serve"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("cannot launch \"/nonexistent/vllm-typo\""), "{err}");
    assert!(std::fs::read(&older).unwrap() == old_bytes, "{err}");
    // A run that starts writes the file anew: none of the older bytes stay.
    let out = Command::new(&bin).args(["run", "--quiet", "-o", older.to_str().unwrap(), "--", "true"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let len = std::fs::metadata(&older).unwrap().len();
    assert!(len < 1 << 20, "{len} bytes: the older recording was not emptied");
    let rep = Command::new(&bin).arg("report").arg(&older).output().unwrap();
    assert!(rep.status.success() && rep.stderr.is_empty(), "{}", String::from_utf8_lossy(&rep.stderr));
    drop(taken);

    // A disk of 16 KiB and a command that forks and execs as fast as it can:
    // every exec and exit is recorded, so writing fails within seconds.
    let small = dir.join("small");
    std::fs::create_dir_all(&small).unwrap();
    let mounted = Command::new("mount").args(["-t", "tmpfs", "-o", "size=16k", "tmpfs"]).arg(&small).status().unwrap();
    assert!(mounted.success(), "mount tmpfs on {}", small.display());
    let busy = ["sh", "-c", "while :; do /bin/true; done", "hopscope-busy-1000.25"];
    let started = std::time::Instant::now();
    let out = Command::new(&bin)
        .args(["run", "--quiet", "--nvml-period", "0", "--duration", "60s", "-o", small.join("x.hop").to_str().unwrap(), "--"])
        .args(busy)
        .output()
        .unwrap();
    let _ = Command::new("umount").arg(&small).status();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a full disk fails the recording: {err}");
    assert!(started.elapsed() < Duration::from_secs(50), "failed long before --duration: {err}");
    assert!(err.contains("No space left on device"), "{err}");
    assert!(err.contains("stopping the launched command"), "{err}");
    assert!(!running(&busy), "the command is stopped with the recording: {err}");
}

/// `hopscope report … | head`: whatever reads the output stopped; the report
/// and the diff end quietly (exit 0, nothing on stderr) instead of an error
/// line about a broken pipe.
#[test]
fn output_to_a_reader_that_stopped_ends_quietly() {
    let hop = workspace().join("agent/tests/fixtures/chain3.hop");
    let hop = hop.to_str().unwrap();
    for args in [&["report", hop][..], &["report", "--json", hop], &["diff", hop, hop], &["diff", "--json", hop, hop]] {
        // A pipe whose only reader has exited: every write to it fails with EPIPE.
        let mut reader = Command::new("true").stdin(Stdio::piped()).spawn().unwrap();
        let pipe = reader.stdin.take().unwrap();
        assert!(reader.wait().unwrap().success());
        let out = Command::new(hopscope_bin()).args(args).stdout(Stdio::from(pipe)).stderr(Stdio::piped()).output().unwrap();
        assert!(out.status.success() && out.stderr.is_empty(), "{args:?}: {} {}", out.status, String::from_utf8_lossy(&out.stderr));
    }
}


/// `run` with its stderr piped to a reader that is gone, as after
/// `2>&1 | head -1`: waits (≤ 60 s) and returns its exit status.
fn run_with_stderr_closed(args: &[&str]) -> std::process::ExitStatus {
    let mut c = Command::new(hopscope_bin()).args(args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    // Our end of the pipe closed: every write of hopscope's to stderr fails (EPIPE).
    drop(c.stderr.take());
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(st) = c.try_wait().unwrap() {
            return st;
        }
        if std::time::Instant::now() > deadline {
            let _ = c.kill();
            panic!("hopscope {args:?} did not end within 60 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A recorder whose stderr nobody reads any more records to the end, and
/// when its recording fails it still stops its command. `eprintln!` panicked
/// at hopscope's first line there, and the panic in the drop that stops the
/// command aborted: the command ran on, untraced, and the recording was empty.
#[test]
fn run_with_a_closed_stderr_records_to_the_end_and_still_owns_its_command() {
    let Some(_serial) = privileged("run_with_a_closed_stderr_records_to_the_end_and_still_owns_its_command") else { return };
    let dir = scratch("cli-closed-stderr");
    let hop = dir.join("run.hop");
    let sleep = ["sleep", "2.125"];
    let mut args = vec!["run", "--nvml-period", "0", "-o", hop.to_str().unwrap(), "--"];
    args.extend(sleep);
    let st = run_with_stderr_closed(&args);
    assert!(st.success(), "recorded to the command's end: {st}");
    assert!(!running(&sleep));
    let rep = hopscope(&["report", hop.to_str().unwrap(), "--json"]);
    assert!(rep.status.success(), "{}", String::from_utf8_lossy(&rep.stderr));
    let v: serde_json::Value = serde_json::from_slice(&rep.stdout).unwrap();
    let ms = v["recording"]["duration_ms"].as_f64().unwrap();
    assert!(ms >= 2000.0, "the whole run is recorded: {ms} ms");

    // A recording that fails (a 16 KiB disk, a command that forks and execs
    // as fast as it can) stops its command though nothing hears it say so.
    let small = dir.join("small");
    std::fs::create_dir_all(&small).unwrap();
    let mounted = Command::new("mount").args(["-t", "tmpfs", "-o", "size=16k", "tmpfs"]).arg(&small).status().unwrap();
    assert!(mounted.success(), "mount tmpfs on {}", small.display());
    let busy = ["sh", "-c", "while :; do /bin/true; done", "hopscope-busy-closed-stderr"];
    let out = small.join("x.hop");
    let mut args = vec!["run", "--quiet", "--nvml-period", "0", "--duration", "50s", "-o", out.to_str().unwrap(), "--"];
    args.extend(busy);
    let st = run_with_stderr_closed(&args);
    let _ = Command::new("umount").arg(&small).status();
    assert!(!st.success(), "a full disk fails the recording");
    assert!(!running(&busy), "the command is stopped with the recording");
}

/// `hopscope ARGS` whose stdout reader has gone before it writes: its exit
/// status and stderr.
fn run_with_stdout_closed(args: &[&str]) -> (std::process::ExitStatus, String) {
    let mut c = Command::new(hopscope_bin()).args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    drop(c.stdout.take());
    let out = c.wait_with_output().unwrap();
    (out.status, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// One-shot commands whose output nobody reads any more (`| head` gone)
/// end quietly, as `cat` does — `doctor` printed with `println!`, which
/// panicked (exit 101). `doctor`'s status still says whether a check failed.
#[test]
fn one_shot_commands_with_a_closed_stdout_end_quietly_not_with_a_panic() {
    let hop = workspace().join("agent/tests/fixtures/chain3.hop");
    let (a, b) = (workspace().join("agent/tests/fixtures/queue2.hop"), workspace().join("agent/tests/fixtures/chain3.hop"));
    let reports: [&[&str]; 4] = [&["report", hop.to_str().unwrap(), "--json"], &["report", hop.to_str().unwrap()], &["diff", a.to_str().unwrap(), b.to_str().unwrap()], &["diff", "--json", a.to_str().unwrap(), b.to_str().unwrap()]];
    for args in reports {
        let (st, err) = run_with_stdout_closed(args);
        assert!(st.success() && err.is_empty(), "{args:?}: {st}: {err}");
    }
    for args in [&["doctor", "--json", "--no-load"][..], &["doctor", "--no-load"]] {
        let (st, err) = run_with_stdout_closed(args);
        let with_stdout = hopscope(args);
        assert_eq!(st.code(), with_stdout.status.code(), "{args:?}: the checks' verdict, whoever reads: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// The segments of a rotated recording in `dir` named `stem-NNNN.hop`, in order.
fn segments(dir: &std::path::Path, stem: &str) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with(&format!("{stem}-")) && n.ends_with(".hop")))
        .collect();
    v.sort();
    v
}

fn report_json_of(files: &[std::path::PathBuf]) -> serde_json::Value {
    let out = Command::new(hopscope_bin()).arg("report").args(files).arg("--json").output().unwrap();
    assert!(out.status.success(), "report failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("report --json is json")
}

fn counter(rep: &serde_json::Value, name: &str) -> u64 {
    rep["recording"]["drops"][name].as_u64().unwrap_or(0)
}

/// `--rotate-every`: the recording is cut into segments while requests are
/// in flight; read together they give every request whole (no request or
/// event cut at a boundary, as one file would have held them); one alone
/// says what it is and counts what its boundaries cut.
#[test]
fn a_rotated_recording_read_as_its_segments_gives_every_request_whole() {
    let Some(_serial) = privileged("a_rotated_recording_read_as_its_segments_gives_every_request_whole") else { return };
    let dir = scratch("cli-rotate");
    let port = free_port();
    let py = python();
    let server = fixture("sse_server.py");
    let mut rec = Recording::run(&dir.join("run.hop"), &["--rotate-every", "1s"], &[py.to_str().unwrap(), server.to_str().unwrap(), "--port", &port.to_string()]);
    rec.wait_healthy(port, Duration::from_secs(30));
    let out = dir.join("client.jsonl");
    // 2 connections × 8 requests of 30 chunks 15 ms apart: ~3.6 s of
    // requests always in flight across 1 s rotations.
    run_py("sse_client.py", &["--base", &format!("http://127.0.0.1:{port}"), "--out", out.to_str().unwrap(), "--concurrent", "2x8", "--tokens", "30", "--token-ms", "15", "--sdk", "raw"]);
    rec.stop();
    assert!(!dir.join("run.hop").exists(), "with rotation -o names the run, not a file");
    let segs = segments(&dir, "run");
    assert!(segs.len() >= 4, "a segment a second: {segs:?}");
    for (i, s) in segs.iter().enumerate() {
        assert!(s.ends_with(format!("run-{:04}.hop", i + 1)), "consecutive from 0001: {segs:?}");
    }
    let clients = read_jsonl(&out);
    assert_eq!(clients.len(), 16);

    let all = report_json_of(&segs);
    assert_eq!(all["recording"]["segments"]["first"], 1);
    assert_eq!(all["recording"]["segments"]["last"], segs.len());
    for c in &clients {
        let id = c["id"].as_str().unwrap();
        let r = all["requests"].as_array().unwrap().iter().find(|r| r["id"] == id).unwrap_or_else(|| panic!("request {id} in the joined report"));
        assert!(r["ttft_ms"].is_number() && r["e2e_ms"].is_number(), "{id} whole: {r}");
        assert_eq!(r["itl_ms"].as_array().unwrap().len(), 29, "{id}: every gap, across the boundary too");
    }
    for name in ["sse_without_request", "responses_without_request", "response_ends_without_request", "requests_unfinished"] {
        assert_eq!(counter(&all, name), 0, "{name}: nothing is cut when the segments are read together: {}", all["recording"]["drops"]);
    }

    // Alone, the segments cut what crossed their boundaries, and say so.
    let mut cut = 0;
    let mut whole = 0;
    for (i, s) in segs.iter().enumerate() {
        let one = report_json_of(std::slice::from_ref(s));
        assert_eq!((one["recording"]["segments"]["first"].as_u64(), one["recording"]["segments"]["last"].as_u64()), (Some(i as u64 + 1), Some(i as u64 + 1)));
        cut += counter(&one, "sse_without_request") + counter(&one, "requests_unfinished");
        whole += one["requests"].as_array().unwrap().iter().filter(|r| clients.iter().any(|c| c["id"] == r["id"]) && r["e2e_ms"].is_number()).count();
    }
    assert!(cut > 0, "the test cut no request at a rotation: it proves nothing");
    assert!(whole < clients.len(), "some requests are whole only when segments are read together ({whole} of {})", clients.len());
    let text = Command::new(hopscope_bin()).arg("report").arg(&segs[1]).output().unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("segment 2 of a rotated recording") && text.contains("report consecutive segments together"), "{text}");

    // A gap is refused, naming the missing segment.
    let gap = Command::new(hopscope_bin()).arg("report").arg(&segs[0]).arg(&segs[2]).output().unwrap();
    assert!(!gap.status.success());
    let err = String::from_utf8_lossy(&gap.stderr);
    assert!(err.contains("segment 2 of the run") && err.contains("missing"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
}

/// `--keep N` leaves the newest N segments, which read together.
#[test]
fn rotation_with_keep_leaves_the_newest_segments_readable_together() {
    let Some(_serial) = privileged("rotation_with_keep_leaves_the_newest_segments_readable_together") else { return };
    let dir = scratch("cli-rotate-keep");
    let port = free_port();
    let py = python();
    let server = fixture("sse_server.py");
    // An earlier run's segment, past where this one goes: left alone, named.
    let stale = dir.join("svc-0042.hop");
    std::fs::write(&stale, b"an earlier run's segment").unwrap();
    let log = dir.join("agent.log");
    let child = Recording::command(&dir.join("svc.hop"), &["--rotate-every", "1s", "--keep", "2"], &[py.to_str().unwrap(), server.to_str().unwrap(), "--port", &port.to_string()])
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut rec = Recording { child, path: dir.join("svc.hop") };
    rec.wait_healthy(port, Duration::from_secs(30));
    let out = dir.join("client.jsonl");
    run_py("sse_client.py", &["--base", &format!("http://127.0.0.1:{port}"), "--out", out.to_str().unwrap(), "--sequential", "8", "--tokens", "30", "--token-ms", "10", "--sdk", "raw"]);
    std::thread::sleep(Duration::from_millis(1200));
    rec.stop();
    let log = std::fs::read_to_string(&log).unwrap();
    assert!(log.contains(&format!("1 file(s) from an earlier recording to {} are there ({})", dir.join("svc.hop").display(), stale.display())), "{log}");
    assert!(log.contains("removed") && log.contains("(--keep)"), "{log}");
    assert_eq!(std::fs::read(&stale).unwrap(), b"an earlier run's segment", "not this run's: never removed");
    let e = Command::new(hopscope_bin()).arg("report").args(segments(&dir, "svc")).output().unwrap();
    assert!(String::from_utf8_lossy(&e.stderr).contains("svc-0042.hop: not a hopscope recording"), "{}", String::from_utf8_lossy(&e.stderr));
    std::fs::remove_file(&stale).unwrap();
    let segs = segments(&dir, "svc");
    assert_eq!(segs.len(), 2, "--keep 2: {segs:?}");
    let rep = report_json_of(&segs);
    let last = rep["recording"]["segments"]["last"].as_u64().unwrap();
    assert!(last >= 4, "older segments were written and removed: {}", rep["recording"]);
    assert_eq!(rep["recording"]["segments"]["first"].as_u64(), Some(last - 1));
    assert!(segs[1].ends_with(format!("svc-{last:04}.hop")), "{segs:?}");
}

/// Rotation options that cannot work together are refused before anything
/// is traced, each with what to do instead.
#[test]
fn rotation_options_that_do_not_fit_are_refused_with_what_to_do() {
    for (args, says) in [
        (&["--keep", "3"][..], "add --rotate-every or --rotate-mib"),
        (&["--rotate-every", "1h", "--perfetto", "x.pftrace"][..], "run `hopscope trace` on the segments"),
        // Rotation and --otlp go together; the endpoint is checked first.
        (&["--rotate-mib", "64", "--otlp", "https://collector:4318"][..], "https is not supported"),
        (&["--rotate-every", "10ms"][..], "at least 1s"),
        (&["--rotate-mib", "0"][..], "at least 1"),
    ] {
        let out = hopscope(&[&["record", "--pid", "1", "-o", "/dev/null"][..], args].concat());
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    }
}

/// `record --pid-file`: a server restarted under the recorder (a new pid
/// written to the file, as a start script does) is traced too; the stop
/// between is said, and both lives' requests are in the one recording.
#[test]
fn record_with_a_pid_file_follows_a_restarted_server() {
    let Some(_serial) = privileged("record_with_a_pid_file_follows_a_restarted_server") else { return };
    let dir = scratch("cli-pid-file");
    let (py, server) = (python(), fixture("sse_server.py"));
    let pid_file = dir.join("vllm.pid");
    let start = |port: u16| -> std::process::Child {
        let c = Command::new(&py).arg(&server).args(["--port", &port.to_string()]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
        std::fs::write(&pid_file, format!("{}\n", c.id())).unwrap();
        c
    };
    let client = |port: u16, out: &str| -> Vec<String> {
        wait_healthy(port, Duration::from_secs(30));
        let out = dir.join(out);
        run_py("sse_client.py", &["--base", &format!("http://127.0.0.1:{port}"), "--out", out.to_str().unwrap(), "--sequential", "2", "--tokens", "5", "--sdk", "raw"]);
        read_jsonl(&out).iter().map(|c| c["id"].as_str().unwrap().to_owned()).collect()
    };
    let (p1, p2) = (free_port(), free_port());
    let mut first = start(p1);
    let hop = dir.join("run.hop");
    let agent = Agent::spawn(&["record", "--pid-file", pid_file.to_str().unwrap(), "-o", hop.to_str().unwrap(), "--quiet", "--rotate-every", "1s"], &[]);
    agent.wait_line("hopscope: recording pids", Duration::from_secs(60));
    let ids1 = client(p1, "first.jsonl");
    first.kill().unwrap();
    first.wait().unwrap();
    agent.wait_line(&format!("hopscope: note: traced pid {} exited; waiting for", first.id()), Duration::from_secs(10));
    let mut second = start(p2);
    agent.wait_line(&format!("hopscope: note: {} now names pid {} (was {})", pid_file.display(), second.id(), first.id()), Duration::from_secs(10));
    let ids2 = client(p2, "second.jsonl");
    let (_, err) = agent.stop();
    second.kill().unwrap();
    second.wait().unwrap();
    let segs = segments(&dir, "run");
    let rep = report_json_of(&segs);
    let reqs = rep["requests"].as_array().unwrap();
    // Segments begun after the restart list the new pid in their header.
    let last = report_json_of(&segs[segs.len() - 1..]);
    let pids: Vec<u64> = last["recording"]["pids"].as_array().unwrap().iter().map(|p| p.as_u64().unwrap()).collect();
    assert!(pids.contains(&u64::from(second.id())), "{pids:?}");
    for (ids, pid) in [(&ids1, first.id()), (&ids2, second.id())] {
        assert_eq!(ids.len(), 2);
        for id in ids {
            let r = reqs.iter().find(|r| r["id"] == *id.as_str()).unwrap_or_else(|| panic!("{id} recorded: {err}"));
            assert_eq!(r["pid"].as_u64(), Some(u64::from(pid)), "{id}");
            assert!(r["e2e_ms"].is_number(), "{id} whole");
        }
    }
}

/// A pid file that does not hold a pid is one line saying what it must hold.
#[test]
fn a_pid_file_without_a_pid_is_one_line_saying_what_it_must_hold() {
    let dir = scratch("cli-pid-file-bad");
    let f = dir.join("vllm.pid");
    std::fs::write(&f, "starting\n").unwrap();
    let out = hopscope(&["record", "--pid-file", f.to_str().unwrap(), "-o", "/dev/null"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot read a pid from") && err.contains("\"starting\" is not a pid") && err.contains("echo $$ > FILE"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    let out = hopscope(&["record", "-o", "/dev/null"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--pid-file"), "a pid or a pid file is required: {}", String::from_utf8_lossy(&out.stderr));
}

/// `hopscope run [run_args] -o SCRATCH/run.hop -- sh -c '<trap> TERM; …'`,
/// a shell that loops once started, asked to stop by SIGINT: returns the
/// agent once it said it sent SIGTERM to the command, and the recording.
fn run_asked_to_stop(name: &str, trap: &str, run_args: &[&str]) -> (Agent, std::path::PathBuf) {
    let dir = scratch(name);
    let hop = dir.join("run.hop");
    let started = dir.join("started");
    let script = format!("trap '{trap}' TERM; touch {}; while :; do sleep 0.1; done", started.display());
    let mut args = vec!["run", "--quiet", "--nvml-period", "0"];
    args.extend_from_slice(run_args);
    args.extend(["-o", hop.to_str().unwrap(), "--", "sh", "-c", &script]);
    let agent = Agent::spawn(&args, &[]);
    let t = std::time::Instant::now();
    while !started.exists() {
        assert!(t.elapsed() < Duration::from_secs(30), "the command did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    agent.signal(libc::SIGINT);
    agent.wait_line("hopscope: stopping: sent SIGTERM to the command", Duration::from_secs(5));
    (agent, hop)
}

#[test]
fn run_asked_to_stop_gives_its_command_a_grace_then_stops_one_that_ignores_sigterm() {
    let Some(_serial) = privileged("run_asked_to_stop_gives_its_command_a_grace_then_stops_one_that_ignores_sigterm") else { return };
    // A command that ignores SIGTERM (its sleeps inherit that, and each ends
    // by itself), with a grace of its own (the default, 10 s, is in the help).
    let (agent, hop) = run_asked_to_stop("cli-stop-grace", "", &["--stop-grace", "2s"]);
    let asked = std::time::Instant::now();
    let (st, _, err) = agent.wait(Duration::from_secs(60));
    let took = asked.elapsed();
    assert!(st.success(), "hopscope: {err}");
    assert!(err.contains("(at most 2 s; a second signal stops now)"), "{err}");
    assert!(err.contains("still runs 2 s after it was asked to stop: recording ends here (a longer --stop-grace"), "{err}");
    assert!(err.contains("ignored SIGTERM for 5 s: SIGKILL"), "{err}");
    assert!(err.contains("command exited with signal: 9"), "{err}");
    assert!(took >= Duration::from_secs(7) && took < Duration::from_secs(14), "2 s of grace (not the default 10), 5 s for SIGTERM: {took:?}");
    assert!(report_json(&hop)["recording"]["pids"].is_array(), "the recording is whole");
    let help = String::from_utf8_lossy(&hopscope(&["run", "--help"]).stdout).into_owned();
    assert!(help.contains("--stop-grace <DURATION>") && help.contains("[default: 10s]"), "{help}");
}

/// timeout(1), asked to stop, signals its child and then its process group:
/// hopscope gets the signal twice at once. That is one request to stop, not
/// a second one that cuts the command's way out short (it lost the CUPTI
/// injection's last records of a testbed stopped under `timeout`).
#[test]
fn run_takes_a_stop_signal_delivered_twice_at_once_as_one() {
    let Some(_serial) = privileged("run_takes_a_stop_signal_delivered_twice_at_once_as_one") else { return };
    // A command that takes 1.5 s to leave once asked to; the signal again at once.
    let (agent, hop) = run_asked_to_stop("cli-stop-twice", "sleep 1.5; exit 0", &[]);
    agent.signal(libc::SIGINT);
    let asked = std::time::Instant::now();
    let (st, _, err) = agent.wait(Duration::from_secs(30));
    let took = asked.elapsed();
    assert!(st.success(), "hopscope: {err}");
    assert!(err.contains("command exited with exit status: 0"), "recorded until the command left: {err}");
    assert!(took >= Duration::from_millis(1200), "stopped after {took:?}");
    // The recording runs to the command's exit, 1.5 s after the signals
    // (cut at the second, it ended ~10 ms in).
    let recorded = report_json(&hop)["recording"]["duration_ms"].as_f64().expect("duration");
    assert!(recorded >= 1300.0, "the recording ends {recorded:.1} ms in: the second signal cut the command's way out short");
}

#[test]
fn run_stopped_at_its_terminal_leaves_the_commands_ctrl_c_alone_and_signals_it_when_killed() {
    let Some(_serial) = privileged("run_stopped_at_its_terminal_leaves_the_commands_ctrl_c_alone_and_signals_it_when_killed") else { return };
    let dir = scratch("cli-stop-terminal");
    let bin = hopscope_bin().display().to_string();
    for (how, want, said) in [("tty", "SIGINT", "as Ctrl-C asked it to"), ("kill", "SIGTERM", "sent SIGTERM to the command")] {
        let hop = dir.join(format!("{how}.hop"));
        let got: serde_json::Value = serde_json::from_str(&run_py("stop_in_a_terminal.py", &[&bin, hop.to_str().unwrap(), how])).unwrap();
        let term = got["terminal"].as_str().unwrap();
        // One signal each: a second one (uvicorn's, vLLM's) forces the exit.
        assert_eq!(got["signals"], serde_json::json!([want]), "{how}: {term}");
        assert_eq!(got["exit"], 0, "{how}: {term}");
        assert!(term.contains(said), "{how}: {term}");
        assert!(term.contains("command exited with exit status: 0"), "{how}: the command's way out was recorded: {term}");
    }
}
