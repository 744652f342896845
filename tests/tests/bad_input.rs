//! Hostile input on the wire never crashes hopscope: it is counted as
//! unparsed or dropped, and the good requests around it stay exact.

use hopscope_integration::*;
use std::time::Duration;

#[test]
fn garbage_h2_preface_huge_header_and_5000_idle_connections_are_counted_and_harmless() {
    let Some(_serial) = privileged("garbage_h2_preface_huge_header_and_5000_idle_connections_are_counted_and_harmless") else { return };
    let dir = scratch("bad-input");
    let port = free_port();
    let py = python();
    let server = fixture("sse_server.py");
    let mut rec = Recording::run(&dir.join("run.hop"), &[], &[py.to_str().unwrap(), server.to_str().unwrap(), "--port", &port.to_string()]);
    rec.wait_healthy(port, Duration::from_secs(30));
    let port_s = port.to_string();
    let bad = std::thread::spawn({
        let port_s = port_s.clone();
        move || run_py("bad_clients.py", &["--port", &port_s, "--idle", "5000", "--hold", "2"])
    });
    let out = dir.join("client.jsonl");
    run_py("sse_client.py", &["--base", &format!("http://127.0.0.1:{port}"), "--out", out.to_str().unwrap(), "--concurrent", "3x4", "--tokens", "10"]);
    let bad_out = bad.join().unwrap();
    assert!(bad_out.contains("5000 idle connections held"), "{bad_out}");
    let path = rec.stop();
    let report = report_json(&path);

    // Good requests: every one present with exact chunk counts.
    let client = read_jsonl(&out);
    for c in &client {
        let id = c["id"].as_str().unwrap();
        let r = report["requests"].as_array().unwrap().iter().find(|r| r["id"] == id).unwrap_or_else(|| panic!("lost {id}"));
        assert_eq!(r["content_chunks"].as_u64().unwrap() as usize, c["content_ns"].as_array().unwrap().len());
    }
    // The dribbled request was reassembled from 1-byte reads.
    let dribble = report["requests"].as_array().unwrap().iter().find(|r| r["x_request_id"] == "dribble-1");
    let dribble = dribble.expect("a request sent one byte per write is parsed");
    assert_eq!(dribble["path"], "/health");
    assert_eq!(dribble["status"], 200);

    let drops = &report["recording"]["drops"];
    let n = |k: &str| drops[k].as_u64().unwrap_or_else(|| panic!("counter {k} missing: {drops}"));
    // 3000 garbage bytes + the 1 MB header, at least.
    assert!(n("unparsed_bytes") >= 3000 + (1 << 20), "garbage and the huge head counted: {drops}");
    assert!(n("http2_preface") >= 1, "{drops}");
    // The huge head is seen through 4 KiB capture windows: it either overflows
    // the head buffer or falls into an uncaptured gap; both are counted.
    assert!(n("head_too_large") + n("gap_bytes_in_head") >= 1, "{drops}");
    assert_eq!(n("kernel_ringbuf_full"), 0, "{drops}");
    eprintln!("bad input counters: {drops}");
}
