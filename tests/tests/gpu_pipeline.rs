//! The GPU side of the agent end to end, without a GPU: `hopscope run`
//! launches two host processes of the CUPTI ABI TEST DOUBLE (tests/cupti-double)
//! at once, with the real injection library (libhopscope_cupti.so) injected
//! by hopscope itself. The test double delivers synthetic records through the
//! injection's real buffer callbacks; hopscope's receiver (source::cupti)
//! must admit both processes, reject a peer from outside the traced tree,
//! merge the records into the recording in timestamp order, and report them;
//! the GPU steps the double's small pinned copies end are drawn with the same
//! flows in the whole, streamed and live (`--perfetto`) traces.
//!
//! This exercises the agent side of the GPU path (socket, peer credentials,
//! wire validation, names, ordering, drop accounting, report) with a test
//! double of the CUPTI boundary. It says nothing about real GPUs: that is
//! scripts/gpu-check.sh.
//!
//! Needs root and tracefs (real eBPF, for the CPU side and the traced tree).

use hopscope::model::Record;
use hopscope::sink::perfetto::names::GPU_STEPS;
use hopscope_gpu_wire as wire;
use hopscope_integration::{cupti_double_artifacts, hopscope_bin, privileged, scratch, CuptiDouble};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a number: {v}"))
}

fn truth(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// The name a truth line's kernel must carry in the report.
fn report_name(t: &Value) -> String {
    match t["name"].as_str() {
        None => "<unnamed>".into(),
        Some(n) => wire::truncate_str(n, wire::MAX_STR).to_owned(),
    }
}

fn kind_of(r: &Record) -> Option<&'static str> {
    Some(match r {
        Record::GpuKernel { .. } => "kernel",
        Record::GpuMemcpy { peer: None, .. } => "memcpy",
        Record::GpuMemcpy { peer: Some(_), .. } => "memcpy_peer",
        Record::GpuMemset { .. } => "memset",
        Record::GpuSync { .. } => "sync",
        Record::GpuApi { .. } => "api",
        _ => return None,
    })
}

/// `hopscope` with the CUPTI ABI test double as its libcupti (CUPTI 13.4
/// layouts), a 50 ms flush, a long exit drain, and none of the caller's GPU
/// settings.
fn hopscope_over_the_double(a: &CuptiDouble) -> Command {
    let mut hs = Command::new(hopscope_bin());
    for k in ["HOPSCOPE_GPU_SOCKET", "CUDA_INJECTION64_PATH", "HOPSCOPE_CUPTI_INJECTION", "HOPSCOPE_CUPTI_GRAPHS", "VIRTUAL_ENV"] {
        hs.env_remove(k);
    }
    hs.env("HOPSCOPE_CUPTI_LIB", &a.double)
        .env("CUPTI_ABI_TEST_DOUBLE", &a.double)
        .env("CUPTI_ABI_TEST_DOUBLE_VERSION", "130401")
        .env("HOPSCOPE_CUPTI_FLUSH_MS", "50")
        .env("HOPSCOPE_GPU_EXIT_DRAIN_MS", "5000");
    hs
}

/// (pid, correlation id, start, end) of a GPU activity record.
fn activity(r: &Record) -> Option<(u32, u32, u64, u64)> {
    Some(match r {
        Record::GpuKernel { pid, correlation_id, ts_ns, end_ns, .. }
        | Record::GpuMemcpy { pid, correlation_id, ts_ns, end_ns, .. }
        | Record::GpuMemset { pid, correlation_id, ts_ns, end_ns, .. }
        | Record::GpuSync { pid, correlation_id, ts_ns, end_ns, .. }
        | Record::GpuApi { pid, correlation_id, ts_ns, end_ns, .. } => (*pid, *correlation_id, *ts_ns, *end_ns),
        _ => return None,
    })
}

#[test]
fn hopscope_run_records_the_test_doubles_gpu_records_in_order_and_reports_its_kernels() {
    let Some(_serial) = privileged("hopscope_run_records_the_test_doubles_gpu_records_in_order_and_reports_its_kernels") else { return };
    let a = cupti_double_artifacts();
    let dir = scratch("gpu-pipeline");
    let out = dir.join("run.hop");
    let go = dir.join("go");
    let (n, bad_every) = (3000u64, 61u64);
    // Two CUDA-like processes at once, each with its own truth file; both
    // connect at init and wait for `go` before emitting records.
    let host = |truth: &str| {
        format!(
            "CUPTI_ABI_TEST_DOUBLE_TRUTH={} {} wait-file:{} run:{n} wait-delivered:30000",
            dir.join(truth).display(),
            a.host.display(),
            go.display()
        )
    };
    let script = format!("{} & {} & wait", host("truth-a.jsonl"), host("truth-b.jsonl"));
    let mut hs = hopscope_over_the_double(a);
    hs.env("CUPTI_ABI_TEST_DOUBLE_BAD_EVERY", bad_every.to_string())
        .env("HOPSCOPE_GPU_REPORT_MS", "100")
        .arg("run")
        .arg("-o")
        .arg(&out)
        .arg("--quiet")
        .arg("--perfetto")
        .arg(out.with_extension("live.pftrace"))
        .arg("--cupti-lib")
        .arg(&a.injection)
        .args(["--", "sh", "-c", &script])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = hs.spawn().expect("spawning hopscope");
    let (tx, rx) = channel::<String>();
    let err = child.stderr.take().unwrap();
    let stderr_thread = std::thread::spawn(move || {
        let mut all = String::new();
        for l in BufReader::new(err).lines().map_while(Result::ok) {
            let _ = tx.send(l.clone());
            all.push_str(&l);
            all.push('\n');
        }
        all
    });
    let mut stdout = child.stdout.take().unwrap();
    let stdout_thread = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });

    // hopscope names its socket when it injects the library.
    let deadline = Instant::now() + Duration::from_secs(60);
    let socket = loop {
        let l = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).expect("hopscope announced the gpu socket");
        if let Some(rest) = l.strip_prefix("hopscope: gpu: injecting ") {
            let s = rest.split("(socket ").nth(1).expect("socket in the line").trim_end_matches(')');
            break PathBuf::from(s);
        }
    };
    let meta = std::fs::metadata(socket.parent().unwrap()).unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(meta.permissions().mode() & 0o777, 0o700, "private socket directory");
    assert_eq!(std::fs::metadata(&socket).unwrap().permissions().mode() & 0o777, 0o600);

    // A peer from outside the traced tree (this test process, root like
    // hopscope, but not below the command) speaks perfect wire: rejected.
    let mut rogue = UnixStream::connect(&socket).expect("connecting as an outsider");
    let now = std::time::Instant::now();
    let mut frames = Vec::new();
    wire::Message::Hello(wire::Hello {
        pid: std::process::id(),
        ppid: 1,
        cupti_version: 130401,
        clock: wire::ClockSource::Callback,
        enabled: 1,
        init_mono_ns: 1,
        struct_sizes: [0; 6],
        cupti_lib: "rogue".into(),
        comm: "rogue".into(),
    })
    .encode(&mut frames);
    wire::Message::Name(wire::Name { id: 1, name: "rogue_kernel".into() }).encode(&mut frames);
    rogue.write_all(&frames).unwrap();
    rogue.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut b = [0u8; 8];
    let closed = match rogue.read(&mut b) {
        Ok(0) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
        Ok(_) => false,
    };
    assert!(closed, "the agent closes an outsider's connection (waited {:?})", now.elapsed());
    drop(rogue);

    std::fs::write(&go, b"").unwrap();
    let deadline = Instant::now() + Duration::from_secs(180);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("hopscope run did not finish");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stderr = stderr_thread.join().unwrap();
    let stdout = stdout_thread.join().unwrap();
    assert!(status.success(), "hopscope run failed: {stderr}");
    assert!(stderr.contains("not in the traced process tree"), "the rejection is explained: {stderr}");
    let host_pids: Vec<u32> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("HOST "))
        .map(|j| serde_json::from_str::<Value>(j).unwrap())
        .filter(|v| v["step"] == "init")
        .map(|v| {
            assert_eq!(v["rc"], 1, "InitializeInjection succeeded: {v}");
            u(&v["pid"]) as u32
        })
        .collect();
    assert_eq!(host_pids.len(), 2, "{stdout}");
    assert!(!socket.exists() && !socket.parent().unwrap().exists(), "the socket directory is removed");

    // ---- The recording.
    let loaded = hopscope::recording::load(&out).unwrap();
    assert!(loaded.error.is_none(), "{:?}", loaded.error);
    assert!(loaded.meta.gpu, "meta says a GPU source contributed");
    let recs = &loaded.records;

    // Truth: which process wrote which file is found by its timestamps.
    let truths = [truth(&dir.join("truth-a.jsonl")), truth(&dir.join("truth-b.jsonl"))];
    let mut by_key: HashMap<(u32, u32), &Record> = HashMap::new();
    let mut kinds: BTreeMap<(u32, &str), u64> = BTreeMap::new();
    for r in recs {
        if let Some((pid, corr, _, _)) = activity(r) {
            assert!(by_key.insert((pid, corr), r).is_none(), "record ({pid}, {corr}) twice");
            *kinds.entry((pid, kind_of(r).unwrap())).or_default() += 1;
        }
    }
    let mut want_kernels: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    let mut bad: BTreeMap<String, u64> = BTreeMap::new();
    let mut good_total = 0u64;
    for t in &truths {
        assert_eq!(t.len() as u64, n);
        let first_good = t.iter().find(|t| t["bad"].is_null()).unwrap();
        let pid = *host_pids
            .iter()
            .find(|p| by_key.get(&(**p, u(&first_good["corr"]) as u32)).and_then(|r| activity(r)).map(|(_, _, s, _)| s) == Some(u(&first_good["start"])))
            .expect("a host process whose records carry this truth file's timestamps");
        let mut want_kinds: BTreeMap<&str, u64> = BTreeMap::new();
        for t in t {
            if let Some(b) = t["bad"].as_str() {
                *bad.entry(b.to_owned()).or_default() += 1;
                assert!(!by_key.contains_key(&(pid, u(&t["corr"]) as u32)), "a bad record was recorded: {t}");
                continue;
            }
            good_total += 1;
            let kind = t["kind"].as_str().unwrap();
            *want_kinds.entry(kind).or_default() += 1;
            let r = by_key.get(&(pid, u(&t["corr"]) as u32)).unwrap_or_else(|| panic!("record {t} of pid {pid} missing"));
            // CLOCK_MONOTONIC end to end: exactly the double's timestamps (callback clock).
            let (_, _, s, e) = activity(r).unwrap();
            assert_eq!((s, e), (u(&t["start"]), u(&t["end"])), "timestamps of {t}");
            assert_eq!(kind_of(r), Some(kind));
            if let Record::GpuKernel { name, grid, graph_id, .. } = r {
                let want = report_name(t);
                assert_eq!(if name.is_empty() { "<unnamed>" } else { name.as_str() }, want, "interned name resolved");
                assert_eq!(grid[0] as u64, u(&t["grid"][0]));
                assert_eq!(*graph_id as u64, u(&t["graph_id"]));
                let w = want_kernels.entry(want).or_default();
                w.0 += 1;
                w.1 += e - s;
            }
        }
        let got_kinds: BTreeMap<&str, u64> = kinds.iter().filter(|((p, _), _)| *p == pid).map(|((_, k), v)| (*k, *v)).collect();
        assert_eq!(got_kinds, want_kinds, "records per kind of pid {pid}");
    }
    assert_eq!(by_key.len() as u64, good_total, "nothing but the test double's good records (no rogue ones)");
    assert!(recs.iter().filter(|r| matches!(r, Record::GpuProcess { .. })).count() == 2);
    assert!(!recs.iter().any(|r| matches!(r, Record::GpuKernel { name, .. } if name == "rogue_kernel")));

    // GPU and CPU on one clock: each process's GPU records lie between its
    // exec and its exit as eBPF saw them.
    for pid in &host_pids {
        let exec = recs.iter().find_map(|r| match r {
            Record::Proc { tgid, op: hopscope::event::ProcOp::Exec, ts_ns, .. } if tgid == pid => Some(*ts_ns),
            _ => None,
        });
        let exit = recs.iter().find_map(|r| match r {
            Record::Proc { tgid, op: hopscope::event::ProcOp::Exit, ts_ns, .. } if tgid == pid => Some(*ts_ns),
            _ => None,
        });
        let (exec, exit) = (exec.expect("exec of the host seen by eBPF"), exit.expect("exit of the host seen by eBPF"));
        let spans: Vec<(u64, u64)> = by_key.iter().filter(|((p, _), _)| p == pid).map(|(_, r)| activity(r).map(|(_, _, s, e)| (s, e)).unwrap()).collect();
        let (first, last) = (spans.iter().map(|s| s.0).min().unwrap(), spans.iter().map(|s| s.1).max().unwrap());
        assert!(exec < first && last < exit, "pid {pid}: exec {exec} < gpu [{first}, {last}] < exit {exit}");
    }

    // In timestamp order: the kernel-side events (already ordered by the 20 ms
    // window) and the GPU records merged between them.
    let ordered: Vec<(u64, &str)> = recs
        .iter()
        .filter_map(|r| match r {
            Record::Proc { ts_ns, .. } | Record::OffCpu { ts_ns, .. } => Some((*ts_ns, "cpu")),
            r => kind_of(r).map(|k| (r.ts_ns(), k)),
        })
        .collect();
    let disorder: Vec<_> = ordered.windows(2).filter(|w| w[1].0 < w[0].0).take(5).collect();
    assert!(disorder.is_empty(), "records out of order: {disorder:?}");

    // ---- The report.
    let rep = Command::new(hopscope_bin()).args(["report", "--json"]).arg(&out).output().unwrap();
    assert!(rep.status.success(), "{}", String::from_utf8_lossy(&rep.stderr));
    let rep: Value = serde_json::from_slice(&rep.stdout).unwrap();
    assert_eq!(rep["recording"]["gpu"], true);
    let kernels = rep["kernels"].as_array().unwrap();
    assert_eq!(kernels.len(), want_kernels.len(), "every synthetic kernel name, once: {kernels:#?}");
    let mut last_ms = f64::INFINITY;
    for k in kernels {
        let name = k["name"].as_str().unwrap();
        let (count, ns) = want_kernels.get(name).unwrap_or_else(|| panic!("unexpected kernel {name:.80}"));
        assert_eq!(u(&k["count"]), *count, "count of {name:.80}");
        let ms = k["gpu_ms"].as_f64().unwrap();
        assert!((ms - *ns as f64 / 1e6).abs() <= 1e-9 * ms.max(1.0), "gpu_ms of {name:.80}: {ms} vs {ns} ns");
        assert!(ms <= last_ms, "most GPU time first");
        last_ms = ms;
    }
    let drops = &rep["recording"]["drops"];
    let d = |k: &str| drops[k].as_u64().unwrap_or_else(|| panic!("drop counter {k} missing: {drops}"));
    for b in ["zero", "reversed", "future", "past"] {
        assert!(bad.get(b).copied().unwrap_or(0) > 0, "the run covers {b} timestamps");
        assert_eq!(d(&format!("gpu_bad_timestamp_{b}")), bad[b], "the injection's {b} drops reach the report");
    }
    assert_eq!((d("gpu_conns"), d("gpu_conns_rejected")), (2, 1), "two hosts admitted, the outsider rejected");
    assert_eq!((d("gpu_frames_invalid"), d("gpu_conns_broken"), d("gpu_frames_torn")), (0, 0, 0));
    assert_eq!(d("gpu_records_sent"), good_total, "the senders' own count");
    assert_eq!(d("gpu_records_decoded"), good_total);
    for k in ["gpu_dropped_queue_full", "gpu_dropped_no_agent", "gpu_dropped_send_error", "gpu_cupti_dropped", "gpu_records_late", "gpu_records_implausible", "gpu_names_unknown"] {
        assert_eq!(d(k), 0, "{k}");
    }
    assert_eq!(d("gpu_name_truncated"), 2, "the 70 000-byte name is cut once per process");
    // ---- The Perfetto trace: every kernel, copy and memset on a GPU stream track.
    let trace = out.with_extension("pftrace");
    let t = Command::new(hopscope_bin()).arg("trace").arg(&out).arg("-o").arg(&trace).output().unwrap();
    assert!(t.status.success(), "{}", String::from_utf8_lossy(&t.stderr));
    let summary = hopscope::sink::perfetto::check::check_bytes(&std::fs::read(&trace).unwrap()).unwrap_or_else(|e| panic!("trace invalid: {e}"));
    let gpu_tracks: Vec<_> = summary.tracks.iter().filter(|t| t.name.starts_with("GPU ") && !t.name.starts_with(GPU_STEPS)).collect();
    assert!(!gpu_tracks.is_empty(), "GPU stream tracks");
    let drawn: u64 = gpu_tracks.iter().map(|t| t.slices.values().sum::<u64>()).sum();
    let activities = recs.iter().filter(|r| matches!(r, Record::GpuKernel { .. } | Record::GpuMemcpy { .. } | Record::GpuMemset { .. })).count() as u64;
    assert_eq!(drawn, activities, "one slice per kernel, copy and memset");
    // Streamed (large recordings' default), the same slices and flows: the
    // GPU steps' flows are marked on the GPU work as it is drawn.
    let streamed = out.with_extension("streamed.pftrace");
    let t = Command::new(hopscope_bin()).arg("trace").arg(&out).arg("-o").arg(&streamed).args(["--layout", "streamed"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&t.stderr);
    assert!(t.status.success(), "{stderr}");
    let s = hopscope::sink::perfetto::check::check_bytes(&std::fs::read(&streamed).unwrap()).unwrap_or_else(|e| panic!("streamed trace invalid: {e}"));
    assert_eq!((s.slices, s.flows), (summary.slices, summary.flows), "streamed: {stderr}");
    // The double's small pinned copies end GPU steps (a stream synchronize
    // waits for each): the steps are drawn, and each names its end copy and
    // first kernel per process in both layouts. The two processes are not in
    // lockstep as TP ranks are, so some merged steps start before the one
    // drawn ahead of them and are left out (counted in the trace). Steps that
    // overlap are drawn on tracks named after the first ("… (overlap N)").
    let steps_drawn: u64 = summary.tracks.iter().filter(|t| t.name.starts_with(GPU_STEPS)).map(|t| t.slices.values().sum::<u64>()).sum();
    let gpu_steps = rep["gpu_steps"].as_array().unwrap().len() as u64;
    assert!(steps_drawn > 0 && steps_drawn <= gpu_steps, "GPU steps drawn: {steps_drawn} of {gpu_steps}");
    assert!(summary.flows >= steps_drawn, "each drawn GPU step names its end copies: {} flows, {steps_drawn} steps", summary.flows);
    assert_eq!(summary.flows_unlinked, 0, "the whole layout marks only what a step names");
    // Live (`--perfetto` while recording): the same GPU work and steps' flows.
    let live = hopscope::sink::perfetto::check::check_bytes(&std::fs::read(out.with_extension("live.pftrace")).unwrap()).unwrap_or_else(|e| panic!("live trace invalid: {e}"));
    assert_eq!((live.slices, live.flows), (summary.slices, summary.flows), "live");

    eprintln!(
        "gpu pipeline: {good_total} test-double records from 2 processes recorded in order, {} kernel names reported, {gpu_steps} GPU steps ({steps_drawn} drawn, {} flows), {} bad timestamps counted, 1 outsider rejected",
        kernels.len(),
        summary.flows,
        bad.values().sum::<u64>()
    );
}

/// `hopscope run --gpu-graphs launch`: the injected library traces each graph
/// launch as one record (CUPTI's GRAPH_TRACE, emulated by the test double),
/// which reaches the recording as one kernel per launch named after its graph,
/// with the graph's time; no kernel of a graph's nodes.
#[test]
fn with_gpu_graphs_launch_each_graph_launch_is_one_kernel_in_the_recording_and_report() {
    let Some(_serial) = privileged("with_gpu_graphs_launch_each_graph_launch_is_one_kernel_in_the_recording_and_report") else { return };
    let a = cupti_double_artifacts();
    let dir = scratch("gpu-pipeline-graph-launches");
    let out = dir.join("run.hop");
    let truth_path = dir.join("truth.jsonl");
    let st = hopscope_over_the_double(a)
        .env("CUPTI_ABI_TEST_DOUBLE_TRUTH", &truth_path)
        .args(["run", "--quiet", "--gpu-graphs", "launch", "-o"])
        .arg(&out)
        .arg("--cupti-lib")
        .arg(&a.injection)
        .arg("--")
        .arg(&a.host)
        .args(["run:2000", "wait-delivered:30000"])
        .output()
        .expect("running hopscope");
    let stderr = String::from_utf8_lossy(&st.stderr);
    assert!(st.status.success(), "hopscope run failed: {stderr}");

    let truth = truth(&truth_path);
    let launches: Vec<&Value> = truth.iter().filter(|t| t["kind"] == "graph").collect();
    assert!(launches.len() > 100, "the double ran graphs: {}", launches.len());
    assert!(!truth.iter().any(|t| t["kind"] == "kernel" && u(&t["graph_id"]) != 0), "no graph node traced on its own");
    let loaded = hopscope::recording::load(&out).unwrap();
    assert!(loaded.error.is_none(), "{:?}", loaded.error);
    let mut wholes: HashMap<u32, (&str, u32, u64, u64)> = HashMap::new();
    for r in &loaded.records {
        if let Record::GpuKernel { graph_id, graph_node_id, correlation_id, name, ts_ns, end_ns, .. } = r {
            if *graph_id != 0 {
                assert_eq!(*graph_node_id, wire::WHOLE_GRAPH, "a graph's kernel is its whole launch: {r:?}");
                wholes.insert(*correlation_id, (name.as_str(), *graph_id, *ts_ns, *end_ns));
            }
        }
    }
    assert_eq!(wholes.len(), launches.len(), "every graph launch, once");
    for t in launches {
        let (name, graph_id, s, e) = wholes[&(u(&t["corr"]) as u32)];
        assert_eq!((graph_id as u64, s, e), (u(&t["graph_id"]), u(&t["start"]), u(&t["end"])), "{t}");
        assert_eq!(name, format!("[CUDA graph {graph_id}]"));
    }
    let rep = hopscope_integration::report_json(&out);
    let kernels: Vec<&str> = rep["kernels"].as_array().unwrap().iter().map(|k| k["name"].as_str().unwrap()).collect();
    for g in 1..=3 {
        assert!(kernels.contains(&format!("[CUDA graph {g}]").as_str()), "the report's kernels name graph {g}: {kernels:?}");
    }
    assert_eq!(rep["recording"]["drops"]["gpu_records_implausible"].as_u64(), Some(0));
    // The report says how the process traced; graphs per launch the injection's hello said.
    let cupti = rep["recording"]["cupti"].as_array().expect("recording.cupti");
    assert_eq!(cupti.len(), 1, "{cupti:?}");
    assert_eq!((cupti[0]["graphs"].as_str(), cupti[0]["cupti_version"].as_u64()), (Some("launch"), Some(130401)), "{cupti:?}");
    assert!(cupti[0]["traced"].as_array().unwrap().iter().any(|k| k == "graph_launch"), "{cupti:?}");

    // The same host traced per node, diffed against it: the graphs' GPU time
    // is one row either way, and the text warns that kernels inside graphs
    // do not compare.
    let node = dir.join("node.hop");
    let st = hopscope_over_the_double(a).args(["run", "--quiet", "-o"]).arg(&node).arg("--cupti-lib").arg(&a.injection).arg("--").arg(&a.host).args(["run:1000", "wait-delivered:30000"]).output().expect("running hopscope");
    assert!(st.status.success(), "hopscope run (per node) failed: {}", String::from_utf8_lossy(&st.stderr));
    assert_eq!(hopscope_integration::report_json(&node)["recording"]["cupti"][0]["graphs"], "node");
    let diff = |json: bool| {
        let mut c = Command::new(hopscope_bin());
        c.arg("diff");
        if json {
            c.arg("--json");
        }
        let o = c.arg(&node).arg(&out).output().expect("running hopscope diff");
        assert!(o.status.success(), "diff failed: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap()
    };
    let d: Value = serde_json::from_str(&diff(true)).expect("diff json");
    assert_eq!((d["before"]["gpu_graphs"].as_str(), d["after"]["gpu_graphs"].as_str()), (Some("node"), Some("launch")));
    let rows = d["kernels"]["rows"].as_array().expect("kernel rows");
    let graphs = rows.iter().find(|r| r["name"] == "[CUDA graph]").unwrap_or_else(|| panic!("a [CUDA graph] row: {rows:?}"));
    assert_eq!((graphs["status"].as_str(), graphs["before_count"].as_u64()), (Some("new"), Some(0)), "{graphs}");
    assert!(!rows.iter().any(|r| r["name"] == ""), "no kernel row without a name: {rows:?}");
    let text = diff(false);
    assert!(text.contains("WARNING: BEFORE traced CUDA graphs per node, AFTER per launch"), "{text}");
}

#[test]
fn run_stopped_by_a_signal_records_what_its_command_flushes_on_the_way_out() {
    let Some(_serial) = privileged("run_stopped_by_a_signal_records_what_its_command_flushes_on_the_way_out") else { return };
    let a = cupti_double_artifacts();
    let dir = scratch("gpu-pipeline-stop");
    let out = dir.join("run.hop");
    let truth_path = dir.join("truth.jsonl");
    // The library flushes once a minute: the records reach the agent only
    // with its exit flush, when the host, asked to stop, ends normally.
    let mut hs = hopscope_over_the_double(a)
        .env("CUPTI_ABI_TEST_DOUBLE_TRUTH", &truth_path)
        .env("HOPSCOPE_CUPTI_FLUSH_MS", "60000")
        .args(["run", "--quiet", "-o"])
        .arg(&out)
        .arg("--cupti-lib")
        .arg(&a.injection)
        .arg("--")
        .arg(&a.host)
        .args(["run:500", "wait-term:60000"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running hopscope");
    let mut lines = BufReader::new(hs.stdout.take().unwrap()).lines();
    let mut host = Vec::new();
    for l in lines.by_ref() {
        let l = l.unwrap();
        let ran = l.contains("\"step\":\"run\"");
        host.push(l);
        if ran {
            break;
        }
    }
    assert!(host.last().is_some_and(|l| l.contains("\"step\":\"run\"")), "the host ran: {host:?}");
    // SAFETY: plain kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(hs.id() as i32, libc::SIGINT) }, 0);
    host.extend(lines.map_while(Result::ok));
    let done = hs.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&done.stderr);
    assert!(done.status.success(), "hopscope run failed: {stderr}");
    assert!(stderr.contains("hopscope: stopping: sent SIGTERM to the command"), "{stderr}");
    assert!(host.iter().any(|l| l.contains("\"step\":\"wait-term\",\"ok\":true")), "the host was asked to stop: {host:?}");
    let truth = truth(&truth_path);
    assert!(truth.len() > 300, "{} records placed", truth.len());
    let loaded = hopscope::recording::load(&out).unwrap();
    assert!(loaded.error.is_none(), "{:?}", loaded.error);
    let got = loaded.records.iter().filter(|r| activity(r).is_some()).count();
    assert_eq!(got, truth.len(), "every record the host placed, flushed at its exit, is in the recording");
    let drops = &hopscope_integration::report_json(&out)["recording"]["drops"];
    for k in ["gpu_dropped_no_agent", "gpu_dropped_send_error", "gpu_frames_torn"] {
        assert_eq!(drops[k].as_u64().unwrap_or(0), 0, "{k}: {drops}");
    }
}
