//! NVML sampling end to end against the NVML test double
//! (tests/nvml-double: libnvidia-ml's C ABI with scripted values, never a
//! GPU): samples reach the recording with the scripted values, at the asked
//! period, for traced pids only, and the report's per-request peak GPU memory
//! is computed from them; without libnvidia-ml the recorder says so in one
//! line and records as usual. The real NVML path: scripts/gpu-check.sh.

use hopscope::model::Record;
use hopscope_integration::*;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

fn double() -> &'static PathBuf {
    static D: OnceLock<PathBuf> = OnceLock::new();
    D.get_or_init(|| {
        // Its own target dir: the test binary's cargo holds the main one.
        let target = workspace().join("target/nvml-double");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let out = Command::new(cargo)
            .current_dir(workspace())
            .args(["build", "--quiet", "-p", "nvml-test-double", "--target-dir"])
            .arg(&target)
            .output()
            .expect("running cargo build");
        assert!(out.status.success(), "building the NVML test double failed:\n{}", String::from_utf8_lossy(&out.stderr));
        let p = target.join("debug/libnvml_test_double.so");
        assert!(p.exists(), "{} not built", p.display());
        p
    })
}

fn get(port: u16) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(s, "GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    assert!(out.starts_with("HTTP/1.0 200") || out.starts_with("HTTP/1.1 200"), "{out}");
}

/// Records `pid` for `secs` with `extra` options while `during` runs;
/// returns hopscope's stderr.
fn record(hop: &Path, pid: u32, extra: &[&str], env: &[(&str, &Path)], during: impl FnOnce()) -> String {
    let mut c = Command::new(hopscope_bin());
    c.args(["record", "--quiet", "--duration", "3s", "--pid", &pid.to_string(), "-o"]).arg(hop).args(extra).stderr(Stdio::piped());
    for (k, v) in env {
        c.env(k, v);
    }
    let child = c.spawn().unwrap();
    // Attach takes a moment; requests before it would not be seen.
    std::thread::sleep(Duration::from_millis(1200));
    during();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "hopscope record failed: {err}");
    err
}

#[test]
fn nvml_samples_from_the_double_reach_the_recording_and_the_report_peak() {
    let Some(_serial) = privileged("nvml_samples_from_the_double_reach_the_recording_and_the_report_peak") else { return };
    let lib = double();
    let dir = scratch("nvml-double");
    let (mut server, port) = http_server(&dir);
    let pid = server.id();
    let script = dir.join("nvml.script");
    // pid 1 is on the GPU too, but not traced: it must never appear. On the
    // third GPU NVML will not say how much the server holds (its "not
    // available", all ones): missing from the sum, and counted. The first
    // GPU has GPM (a Hopper's NVLink throughput, MiB/s), the others not.
    std::fs::write(
        &script,
        format!(
            "driver 555.42.02\n\
             device total=150000000000 used=2000000 used_step=8192 sm=37 mem=12 pcie_tx=1234 pcie_rx=5678 nvlink_tx=300 nvlink_rx=100.5\n\
             device total=80000000000 used=5 pcie=unsupported\n\
             proc 0 {pid} 1000000 4096\n\
             proc 0 1 777 0\n\
             proc 1 {pid} 50 1\n\
             device total=40000000000 used=7\n\
             proc 2 {pid} 18446744073709551615 0\n\
             proc 2 1 5 0\n"
        ),
    )
    .unwrap();
    let hop = dir.join("run.hop");
    let err = record(&hop, pid, &["--nvml-period", "50", "--nvml-lib", lib.to_str().unwrap()], &[("NVML_TEST_DOUBLE_SCRIPT", &script)], || {
        for _ in 0..3 {
            get(port);
            std::thread::sleep(Duration::from_millis(250));
        }
    });
    let _ = server.kill();
    let _ = server.wait();
    let nvml_lines: Vec<&str> = err.lines().filter(|l| l.contains(" nvml:")).collect();
    assert_eq!(nvml_lines, ["hopscope: note: nvml: sampling 3 GPU(s) every 50 ms (driver 555.42.02; NVLink throughput from GPM on GPU 0 only)"], "{err}");
    assert!(!err.contains("not freed"), "every GPM sample freed: {err}");

    let loaded = hopscope::recording::load(&hop).unwrap();
    assert!(loaded.error.is_none());
    let mut by_dev: BTreeMap<u32, Vec<&Record>> = BTreeMap::new();
    for r in &loaded.records {
        if let Record::GpuSample { device, .. } = r {
            by_dev.entry(*device).or_default().push(r);
        }
    }
    assert_eq!(by_dev.keys().copied().collect::<Vec<_>>(), [0, 1, 2]);
    let (d0, d1) = (&by_dev[&0], &by_dev[&1]);
    assert_eq!(d0.len(), d1.len(), "every tick samples every device");
    assert_eq!(d0.len(), by_dev[&2].len(), "every tick samples every device");
    for r in &by_dev[&2] {
        let Record::GpuSample { process_mem, .. } = r else { unreachable!() };
        assert!(process_mem.is_empty(), "memory NVML did not give is not made up: {process_mem:?}");
    }
    // 3 s at 50 ms: about 60 ticks; NVML starts on the sampler thread while
    // the recording starts, so allow the first few to be missed.
    assert!((45..=62).contains(&d0.len()), "{} ticks in 3 s at 50 ms", d0.len());
    let mut ts = Vec::new();
    for (k, (a, b)) in d0.iter().zip(d1.iter()).enumerate() {
        let k = k as u64;
        let Record::GpuSample { ts_ns, mem_used_bytes, mem_total_bytes, process_mem, sm_util_pct, mem_util_pct, pcie_tx_kib_s, pcie_rx_kib_s, nvlink_tx_kib_s, nvlink_rx_kib_s, .. } = a else { unreachable!() };
        // The Nth read answers the scripted first value + N steps: nothing lost, nothing reordered
        // (read 0 was the device's description at the start, for its total).
        assert_eq!(*mem_used_bytes, 2_000_000 + 8192 * (k + 1));
        assert_eq!(*mem_total_bytes, 150_000_000_000);
        assert_eq!(process_mem, &vec![(pid, 1_000_000 + 4096 * k)], "only the traced pid, tick {k}");
        assert_eq!((*sm_util_pct, *mem_util_pct), (Some(37), Some(12)));
        assert_eq!((*pcie_tx_kib_s, *pcie_rx_kib_s), (Some(1234), Some(5678)));
        // The double answers rate × the samples between the two compared: the
        // scripted rate only from each tick's sample against the one before.
        assert_eq!((*nvlink_tx_kib_s, *nvlink_rx_kib_s), (Some(300 * 1024), Some(102_912)), "NVLink KiB/s from GPM, tick {k}");
        let Record::GpuSample { ts_ns: ts1, process_mem: pm1, pcie_tx_kib_s: tx1, mem_total_bytes: total1, nvlink_tx_kib_s: nvl1, .. } = b else { unreachable!() };
        assert_eq!(*nvl1, None, "no GPM, no NVLink figure (not 0)");
        assert_eq!(ts1, ts_ns, "one timestamp per tick");
        assert_eq!(pm1, &vec![(pid, 50 + k)]);
        assert_eq!((*tx1, *total1), (None, 80_000_000_000), "unsupported PCIe is null, not 0");
        ts.push(*ts_ns);
    }
    let mut gaps: Vec<f64> = ts.windows(2).map(|w| (w[1] - w[0]) as f64 / 1e6).collect();
    gaps.sort_by(f64::total_cmp);
    let median = gaps[gaps.len() / 2];
    assert!((45.0..=60.0).contains(&median), "median sampling period {median} ms (asked 50)");
    // A tick woken late is followed by one on time (a shorter gap by the
    // lateness, up to a CI machine's time slices); a sampler catching up on
    // missed ticks would fire them back to back, near 0 ms apart.
    assert!(gaps[0] >= 20.0, "fixed-rate ticks never bunch: shortest gap {} ms", gaps[0]);

    let rep = report_json(&hop);
    let drops = &rep["recording"]["drops"];
    assert_eq!(drops["nvml_samples"].as_u64(), Some(3 * d0.len() as u64));
    assert_eq!(drops["nvml_process_mem_unavailable"].as_u64(), Some(d0.len() as u64), "the traced server on the third GPU, every tick");
    assert_eq!(drops["nvml_sample_errors"].as_u64(), Some(0));
    assert_eq!(drops["nvml_field_errors"].as_u64(), Some(0), "NOT_SUPPORTED is not an error");
    assert_eq!(drops["nvml_samples_dropped"].as_u64(), Some(0));
    let reqs = rep["requests"].as_array().unwrap();
    assert_eq!(reqs.len(), 3, "{reqs:?}");
    // Traced memory per tick is the sum over devices; a request's peak is
    // the largest tick inside it or the level at its arrival.
    let level = |k: usize| 1_000_000 + 4096 * k as u64 + 50 + k as u64;
    for q in reqs {
        let (a, d) = (q["arrive_ns"].as_u64().unwrap(), q["done_ns"].as_u64().unwrap());
        let last = ts.iter().rposition(|t| *t <= d).expect("a sample before the request ended");
        assert!(a - ts[ts.iter().rposition(|t| *t <= a).unwrap()] < 60_000_000, "the level at arrival is a fresh sample");
        assert_eq!(q["peak_gpu_mem_bytes"].as_u64(), Some(level(last)), "request {}", q["id"]);
    }
    assert_eq!(rep["summary"]["gpu_samples"].as_u64(), Some(3 * d0.len() as u64));
    assert_eq!(rep["summary"]["peak_gpu_mem_bytes"].as_u64(), Some(level(d0.len() - 1)));
    // The model and the driver of a recording with no injected process (only NVML saw the GPUs).
    let devices: Vec<(u64, &str, &str, u64)> = rep["recording"]["nvml_gpus"]
        .as_array()
        .expect("recording.nvml_gpus")
        .iter()
        .map(|g| (g["device"].as_u64().unwrap(), g["name"].as_str().unwrap(), g["driver"].as_str().unwrap(), g["total_mem_bytes"].as_u64().unwrap()))
        .collect();
    let double = "NVML test double (not a GPU)";
    assert_eq!(
        devices,
        [(0, double, "555.42.02", 150_000_000_000), (1, double, "555.42.02", 80_000_000_000), (2, double, "555.42.02", 40_000_000_000)]
    );
    assert_eq!(rep["recording"]["gpus"].as_array().map(Vec::len), Some(0), "no injected process described a GPU");
    let peaks: Vec<[Option<u64>; 4]> = rep["recording"]["nvml_gpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| ["pcie_tx", "pcie_rx", "nvlink_tx", "nvlink_rx"].map(|k| g[format!("{k}_peak_kib_s")].as_u64()))
        .collect();
    assert_eq!(
        peaks,
        [[Some(1234), Some(5678), Some(307_200), Some(102_912)], [None; 4], [Some(0), Some(0), None, None]],
        "each GPU's peak throughput; null where NVML gave no figure (no PCIe counter, no GPM)"
    );
    let text = report_text(&hop);
    assert!(
        text.contains("gpu 0 (nvml): NVML test double (not a GPU) (140 GiB, driver 555.42.02), PCIe peak tx/rx 1.2/5.5 MiB/s, NVLink peak tx/rx 300.0/100.5 MiB/s\n"),
        "{text}"
    );
    assert!(text.contains("gpu 1 (nvml): NVML test double (not a GPU) (75 GiB, driver 555.42.02)\n"), "{text}");
    // GETs of a file server generate nothing: not "successful requests" in vLLM bench terms.
    assert_eq!((rep["summary"]["completed"].as_u64(), rep["summary"]["not_completed"].as_u64()), (Some(0), Some(3)));
}

#[test]
fn without_libnvidia_ml_the_recorder_prints_one_clear_line_and_records_normally() {
    let Some(_serial) = privileged("without_libnvidia_ml_the_recorder_prints_one_clear_line_and_records_normally") else { return };
    let dir = scratch("nvml-absent");
    let (mut server, port) = http_server(&dir);
    let missing = dir.join("no-such-dir/libnvidia-ml.so.1");
    let hop = dir.join("run.hop");
    // Through the environment, as a machine without a driver looks to the default lookup.
    let err = record(&hop, server.id(), &[], &[("HOPSCOPE_NVML_LIB", &missing)], || get(port));
    let hop_off = dir.join("off.hop");
    let err_off = record(&hop_off, server.id(), &["--nvml-period", "0"], &[("HOPSCOPE_NVML_LIB", &missing)], || get(port));
    let _ = server.kill();
    let _ = server.wait();
    let nvml_lines: Vec<&str> = err.lines().filter(|l| l.contains(" nvml:") || l.contains("NVIDIA")).collect();
    assert_eq!(
        nvml_lines,
        [format!("hopscope: note: nvml: no NVIDIA driver here ({} cannot be loaded): recording without GPU samples", missing.display())],
        "{err}"
    );
    assert!(!err_off.contains(" nvml:") && !err_off.contains("NVIDIA"), "--nvml-period 0 says nothing about NVML: {err_off}");
    for h in [&hop, &hop_off] {
        let loaded = hopscope::recording::load(h).unwrap();
        assert!(!loaded.records.iter().any(|r| matches!(r, Record::GpuSample { .. })));
        let rep = report_json(h);
        assert_eq!(rep["requests"].as_array().unwrap().len(), 1, "the request was recorded");
        assert_eq!(rep["requests"][0]["status"].as_u64(), Some(200));
        assert!(rep["requests"][0]["peak_gpu_mem_bytes"].is_null());
        assert!(rep["summary"]["peak_gpu_mem_bytes"].is_null());
        assert_eq!(rep["summary"]["gpu_samples"].as_u64(), Some(0));
    }
}

/// An agent in a container's pid namespace (`unshare --pid --mount-proc`, as
/// in a pod sharing its process namespace): NVML names the server by its host
/// pid, which the agent cannot see. The eBPF programs note each traced
/// process's host tgid, and the samples name it by the agent's pid; a host
/// process whose pid is the server's pid in the namespace is not it.
#[test]
fn in_a_pid_namespace_nvmls_host_pids_are_named_by_the_agents_pids() {
    let test = "in_a_pid_namespace_nvmls_host_pids_are_named_by_the_agents_pids";
    let Some(_serial) = privileged(test) else { return };
    if !util_linux_available("unshare", test) {
        return;
    }
    let lib = double();
    let dir = scratch("nvml-pidns");
    std::fs::write(dir.join("index.html"), "hello\n").unwrap();
    let port = free_port();
    let (script, go, pid_file, hop) = (dir.join("nvml.script"), dir.join("go"), dir.join("srv.pid"), dir.join("ns.hop"));
    // Inside the namespace: the server, then, once the test has written
    // NVML's script with the server's host pid, `hopscope record` of it.
    let inner = format!(
        "cd '{d}' && '{py}' -m http.server {port} --bind 127.0.0.1 >/dev/null 2>&1 & s=$!; echo $s > '{pid}'; \
         while [ ! -e '{go}' ]; do sleep 0.05; done; \
         '{bin}' record --quiet --duration 3s --nvml-period 50 --nvml-lib '{lib}' --pid $s -o '{hop}'; r=$?; kill $s; exit $r",
        d = dir.display(),
        py = python().display(),
        pid = pid_file.display(),
        go = go.display(),
        bin = hopscope_bin().display(),
        lib = lib.display(),
        hop = hop.display()
    );
    let child = Command::new("unshare")
        .args(["--pid", "--fork", "--mount-proc", "--kill-child", "--", "sh", "-c", &inner])
        .env("NVML_TEST_DOUBLE_SCRIPT", &script)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // However the test ends, the recorder starts and so ends.
    let go = TouchOnDrop(go);
    let needle = format!("http.server\0{port}\0");
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let (ns_pid, host_pid) = loop {
        let ns = std::fs::read_to_string(&pid_file).ok().and_then(|s| s.trim().parse::<u32>().ok());
        let host = std::fs::read_dir("/proc").unwrap().flatten().find_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            std::fs::read(e.path().join("cmdline")).ok()?.windows(needle.len()).any(|w| w == needle.as_bytes()).then_some(pid)
        });
        if let (Some(ns), Some(host)) = (ns, host) {
            break (ns, host);
        }
        assert!(std::time::Instant::now() < deadline, "the server did not start in its namespace");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_ne!(ns_pid, host_pid, "a pid namespace of its own");
    std::fs::write(&script, format!("driver 555.42.02\ndevice total=80000000000 used=5\nproc 0 {host_pid} 1000000 4096\nproc 0 {ns_pid} 777 0\n")).unwrap();
    drop(go);
    std::thread::sleep(Duration::from_millis(1500));
    for _ in 0..3 {
        get(port);
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "record in a pid namespace: {err}");
    let loaded = hopscope::recording::load(&hop).unwrap();
    let mems: Vec<&Vec<(u32, u64)>> = loaded.records.iter().filter_map(|r| if let Record::GpuSample { process_mem, .. } = r { Some(process_mem) } else { None }).collect();
    assert!(mems.len() >= 40, "{} samples: {err}", mems.len());
    // Until the server's first context switch while traced its host pid is unknown; from then on, every sample.
    let first = mems.iter().position(|m| !m.is_empty()).unwrap_or_else(|| panic!("the server's GPU memory never named: {err}"));
    assert!(first < 20, "named from sample {first} of {}", mems.len());
    for m in &mems[first..] {
        assert!(m.len() == 1 && m[0].0 == ns_pid && m[0].1 >= 1_000_000, "{m:?}: the server by its namespace pid {ns_pid}, never host pid {ns_pid}'s 777 bytes");
    }
    let rep = report_json(&hop);
    let reqs = rep["requests"].as_array().unwrap();
    assert_eq!(reqs.len(), 3, "{reqs:?}");
    for q in reqs {
        assert!(q["peak_gpu_mem_bytes"].as_u64().is_some_and(|b| b >= 1_000_000), "{q}");
    }
}

/// `hopscope doctor` names the GPUs NVML lists and whether NVLink throughput
/// will be sampled (GPM, Hopper and newer), without recording anything.
#[test]
fn doctor_says_which_gpus_give_nvlink_throughput() {
    let lib = double();
    let dir = scratch("nvml-doctor");
    let script = dir.join("nvml.script");
    let doctor = |script_text: &str| {
        std::fs::write(&script, script_text).unwrap();
        let out = Command::new(hopscope_bin()).args(["doctor", "--no-load", "--json"]).env("HOPSCOPE_NVML_LIB", lib).env("NVML_TEST_DOUBLE_SCRIPT", &script).output().unwrap();
        let checks: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("doctor --json: {e}: {}", String::from_utf8_lossy(&out.stderr)));
        let nvml = checks.as_array().unwrap().iter().find(|c| c["check"] == "nvml").expect("an nvml check").clone();
        assert_eq!(nvml["level"], "ok", "{nvml}");
        nvml["detail"].as_str().unwrap().to_owned()
    };
    let gpu = "NVML test double (not a GPU)";
    assert_eq!(
        doctor("driver 580.1\ndevice total=1 used=0 nvlink_tx=1\ndevice total=1 used=0\n"),
        format!("driver 580.1, 2 GPU(s): {gpu}, {gpu}; NVLink throughput from GPM on 1 of them")
    );
    assert_eq!(doctor("driver 580.1\ndevice total=1 used=0 nvlink_rx=0\n"), format!("driver 580.1, 1 GPU(s): {gpu}; NVLink throughput from GPM"));
    assert_eq!(doctor("driver 535.2\ndevice total=1 used=0\n"), format!("driver 535.2, 1 GPU(s): {gpu}; no NVLink throughput (it needs GPM: Hopper or newer)"));
}

/// Records an idle server for 3 s at a 50 ms NVML period through the NVML
/// test double playing `script`; returns hopscope's `nvml:` notes and the
/// recording.
fn record_through_the_double(name: &str, script: &str) -> (Vec<String>, PathBuf) {
    let dir = scratch(name);
    let (mut server, _port) = http_server(&dir);
    let script_path = dir.join("nvml.script");
    std::fs::write(&script_path, script).unwrap();
    let hop = dir.join("run.hop");
    let err = record(&hop, server.id(), &["--nvml-period", "50", "--nvml-lib", double().to_str().unwrap()], &[("NVML_TEST_DOUBLE_SCRIPT", &script_path)], || {});
    let _ = server.kill();
    let _ = server.wait();
    (err.lines().filter(|l| l.contains(" nvml:")).map(str::to_owned).collect(), hop)
}

/// GPM that starts failing mid-recording (another profiler holding the
/// counters) costs 10 counted errors and one note, then NVLink sampling
/// stops on that GPU; everything else goes on being sampled.
#[test]
fn gpm_failing_in_a_row_stops_nvlink_sampling_with_one_note() {
    let Some(_serial) = privileged("gpm_failing_in_a_row_stops_nvlink_sampling_with_one_note") else { return };
    // The start's sample and 4 ticks' succeed, then every GPM sample fails.
    let (notes, hop) = record_through_the_double("nvml-gpm-fails", "driver 580.1\ndevice total=80000000000 used=5 used_step=1 nvlink_tx=2 nvlink_rx=1 gpm_fail_after=5\n");
    assert_eq!(
        notes,
        [
            "hopscope: note: nvml: sampling 1 GPU(s) every 50 ms (driver 580.1; NVLink throughput from GPM)",
            "hopscope: note: nvml: GPU 0's GPM failed 10 times in a row (operation cannot be performed because the GPU is currently in use; another profiler using it?): NVLink throughput from it stops here"
        ]
    );
    let nvlink: Vec<Option<u64>> = hopscope::recording::load(&hop).unwrap().records.iter().filter_map(|r| if let Record::GpuSample { nvlink_tx_kib_s, .. } = r { Some(*nvlink_tx_kib_s) } else { None }).collect();
    assert!(nvlink.len() >= 40, "{} samples: the GPU is still sampled", nvlink.len());
    assert_eq!(nvlink[..4], [Some(2048); 4], "{nvlink:?}");
    assert!(nvlink[4..].iter().all(Option::is_none), "after the failures, no figure rather than a made-up one: {nvlink:?}");
    assert_eq!(report_json(&hop)["recording"]["drops"]["nvml_field_errors"].as_u64(), Some(10), "the ten failures counted, then no more asking");
}

/// NVLink figures follow the unit NVML names for its GPM metrics (nvml.h:
/// MiB/s); a unit not known here is taken as MiB/s and said once.
#[test]
fn gpm_nvlink_figures_follow_the_unit_nvml_names() {
    let Some(_serial) = privileged("gpm_nvlink_figures_follow_the_unit_nvml_names") else { return };
    let (notes, hop) = record_through_the_double("nvml-gpm-unit", "driver 580.1\ndevice total=8 used=1 nvlink_tx=2048 nvlink_rx=1024 gpm_unit=B/sec\ndevice total=8 used=1 nvlink_tx=1 gpm_unit=MB/s\n");
    assert_eq!(
        notes,
        [
            "hopscope: note: nvml: sampling 2 GPU(s) every 50 ms (driver 580.1; NVLink throughput from GPM)",
            "hopscope: note: nvml: GPU 1's GPM gives NVLink throughput in \"MB/s\", not a unit known here: taken as MiB/s (nvml.h)"
        ]
    );
    // Per device: each sample's NVLink (tx, rx) KiB/s.
    let mut by_dev: BTreeMap<u32, Vec<[Option<u64>; 2]>> = BTreeMap::new();
    for r in hopscope::recording::load(&hop).unwrap().records {
        if let Record::GpuSample { device, nvlink_tx_kib_s, nvlink_rx_kib_s, .. } = r {
            by_dev.entry(device).or_default().push([nvlink_tx_kib_s, nvlink_rx_kib_s]);
        }
    }
    assert!(by_dev[&0].len() >= 40, "{by_dev:?}");
    assert!(by_dev[&0].iter().all(|v| *v == [Some(2), Some(1)]), "B/s as KiB/s: {:?}", by_dev[&0]);
    assert!(by_dev[&1].iter().all(|v| *v == [Some(1024), Some(0)]), "taken as MiB/s: {:?}", by_dev[&1]);
}
