//! A real vLLM under hopscope, live (root only): vLLM 0.32.0's CPU build
//! serving a tiny random-weight model, `examples/real-vllm/run.sh`. The
//! replay tests check the recording of such a run committed in 2026-12
//! (`agent/tests/fixtures/vllm_cpu.hop`); this one makes fresh recordings
//! with this checkout's eBPF programs and decoders, so a change that breaks
//! them on a real server fails here: every kind of request under
//! `hopscope run`, clients that give up, `record --pid` attached to a vLLM
//! already serving, two API server processes, speculative decoding and a KV
//! cache too small for the load (preemptions, a scheduler's queue).
//! hopscope's sums are also set beside vLLM's own
//! `/metrics` for the same requests.
//!
//! Needs the vLLM environment `cargo xtask test` installs
//! (`examples/real-vllm/install.sh`; `HOPSCOPE_REAL_VLLM_VENV` names it).
//! Without it, or without root: a loud SKIPPED line, never a pass.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use hopscope::sink::report::is_loss;
use hopscope_integration::{hopscope_bin, privileged, python, workspace};
use serde_json::Value;

fn venv() -> Option<PathBuf> {
    let v = std::env::var_os("HOPSCOPE_REAL_VLLM_VENV").map(PathBuf::from).unwrap_or_else(|| workspace().join("target/real-vllm/venv"));
    v.join("bin/python").exists().then_some(v)
}

fn json(p: &Path) -> Value {
    let s = std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&s).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn lines(p: &Path) -> Vec<Value> {
    let s = std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    s.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).collect()
}

/// No counter of the report is a loss, and hopscope said none at the end.
fn assert_nothing_lost(rep: &Value, log: &Path) {
    let drops = rep["recording"]["drops"].as_object().expect("drops");
    let lost: Vec<(&String, &Value)> = drops.iter().filter(|(k, v)| is_loss(k) && v.as_u64() != Some(0)).collect();
    assert!(lost.is_empty(), "{}: lost {lost:?}", log.display());
    let said = std::fs::read_to_string(log).unwrap_or_else(|e| panic!("{}: {e}", log.display()));
    assert!(!said.contains("lost while recording"), "{}", log.display());
    assert_eq!(drops.get("ipc_layout_inferred").and_then(Value::as_u64).unwrap_or(0), 0, "the layouts (vLLM 0.32.0's, 0.34.0's) are in the tables: {drops:?}");
}

/// Runs `examples/real-vllm/SCRIPT OUT` (a fresh OUT) with this checkout's
/// hopscope and the vLLM environment `venv`, serving on `port`; a failure
/// panics with the end of its log.
fn run_script(script: &str, venv: &Path, out: &Path, port: &str) {
    let _ = std::fs::remove_dir_all(out);
    std::fs::create_dir_all(out).unwrap();
    let log = std::fs::File::create(out.join("run.log")).unwrap();
    let st = Command::new("bash")
        .arg(workspace().join("examples/real-vllm").join(script))
        .arg(out)
        .current_dir(workspace())
        .env("VENV", venv)
        .env("HOPSCOPE_BIN", hopscope_bin())
        .env("PYTHON", python())
        .env("PORT", port)
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .status()
        .unwrap_or_else(|e| panic!("running examples/real-vllm/{script}: {e}"));
    if !st.success() {
        let said = std::fs::read_to_string(out.join("run.log")).unwrap_or_default();
        let tail: Vec<&str> = said.lines().rev().take(40).collect::<Vec<_>>().into_iter().rev().collect();
        panic!("examples/real-vllm/{script} failed ({st}); the end of {}:\n{}\n(the server logs are beside it)", out.join("run.log").display(), tail.join("\n"));
    }
}

fn request<'a>(rep: &'a Value, id: &str) -> &'a Value {
    rep["requests"].as_array().unwrap().iter().find(|q| q["id"] == id).unwrap_or_else(|| panic!("{id} not in the report"))
}

/// Every request the client finished is in the report under its id, joined to
/// its engine request by the IPC, its phases adding up to its E2E, its
/// tokens vLLM's: `max_tokens` each (a random model runs to its length).
fn assert_every_answer_joined(rep: &Value, hops: &[Value], max_tokens: u64) {
    for h in hops {
        let id = h["id"].as_str().unwrap_or_else(|| panic!("a client request without an id: {h}"));
        let q = request(rep, id);
        assert_eq!((&q["hop"], &q["status"]), (&h["hop"], &Value::from(200)), "{id}");
        assert_eq!(q["previous_response_id"], h["previous_response_id"], "{id}");
        // A JSON answer's constraint, from its ADD; vLLM's `auto` backend
        // picks xgrammar for a schema.
        assert_eq!(q["structured_output"], h["structured_output"], "{id}");
        let backend = if h["structured_output"].is_null() { Value::Null } else { Value::from("xgrammar") };
        assert_eq!(q["structured_output_backend"], backend, "{id}");
        if h["session_header"] != false {
            assert_eq!(q["chain"], h["session_id"], "{id}");
        }
        assert_eq!(q["phase_source"], "ipc", "{id}");
        assert!(q["engine_request_id"].as_str().is_some_and(|e| e.starts_with(id)), "{id}: {}", q["engine_request_id"]);
        let p = &q["phases_ms"];
        let sum: f64 = ["frontend", "queue", "prefill", "first_output", "decode"].iter().filter_map(|k| p[k].as_f64()).sum();
        assert!((sum - q["e2e_ms"].as_f64().unwrap()).abs() < 1e-6, "{id}: {p} vs {}", q["e2e_ms"]);
        assert_eq!(q["marks_clamped"], 0, "{id}");
        assert_eq!((&q["completion_tokens"], &q["finish_reason"]), (&Value::from(max_tokens), &Value::from("length")), "{id}");
        assert_eq!(q["content_chunks"], h["content_chunks"], "{id}");
        let kind = h["kind"].as_str().unwrap();
        let whole = kind.ends_with("whole");
        assert_eq!(q["streamed"], !whole, "{id}");
        assert_eq!(p["first_output"].is_null(), whole, "{id}: {p}");
        assert_eq!(q["completion_tokens_source"], if kind == "stream_no_usage" { "engine" } else { "usage" }, "{id}");
        let path = match kind.split('_').next() {
            Some("responses") => "/v1/responses",
            Some("messages") => "/v1/messages",
            _ => "/v1/chat/completions",
        };
        assert_eq!(q["path"], path, "{id}");
        // Chunks without text before the first content (vLLM's held outputs),
        // read on the wire: the client's count; other APIs and whole answers have none.
        if path == "/v1/chat/completions" && !whole {
            if let Some(n) = h["empty_chunks_before_content"].as_u64() {
                assert_eq!(q["empty_chunks_before_content"].as_u64(), Some(n), "{id}: chunks without text before the first content");
            }
        } else {
            assert!(q["empty_chunks_before_content"].is_null(), "{id}: {}", q["empty_chunks_before_content"]);
        }
        if let Some(n) = h["prompt_tokens"].as_u64() {
            assert_eq!(q["prompt_tokens"], n, "{id}");
        }
    }
}

/// vLLM 0.34.0's Rust frontend (`vllm-rs`: hyper/axum HTTP, the `zeromq`
/// crate's ZMTP, its own tokenizer and ids) under `hopscope run`, in front of
/// the testbed's engine speaking 0.34.0's engine IPC
/// (`examples/real-vllm/rust_frontend.sh`): every answer joined as a real
/// vLLM's, nothing lost (at 8 iovecs a `writev`, hyper's SSE bursts lost
/// their framing and every streamed answer read as closed early; before
/// vectored calls carried their last bytes, a Responses API answer with
/// long instructions lost its second event's chunk-size line in its first
/// writev's gap and read as closed early), its prompt length and queue end
/// the engine's own.
#[test]
fn vllm_0_34_rust_frontend_traced_live_joins_every_answer_and_loses_nothing() {
    let name = "vllm_0_34_rust_frontend_traced_live_joins_every_answer_and_loses_nothing";
    let Some(_serial) = privileged(name) else { return };
    let Some(venv) = venv().filter(|v| v.join("../vllm-rs-0.34.0/vllm-rs").exists()) else {
        eprintln!("\n!!!!! SKIPPED {name}: no vLLM environment with vllm-rs beside it (examples/real-vllm/install.sh target/real-vllm/venv, or HOPSCOPE_REAL_VLLM_VENV): this is NOT a pass; `cargo xtask test` installs it !!!!!\n");
        return;
    };
    let out = workspace().join("target/real-vllm/rsfe-out");
    run_script("rust_frontend.sh", &venv, &out, "18811");
    let rep = json(&out.join("rsfe.report.json"));
    assert_nothing_lost(&rep, &out.join("rsfe.server.log"));
    let hops = lines(&out.join("rsfe.client.jsonl"));
    assert_eq!(hops.len(), 12);
    assert_every_answer_joined(&rep, &hops, 16);
    assert!(hops.iter().filter(|h| h["kind"] == "responses").all(|h| h["prompt_chars"].as_u64().unwrap() > 3500), "{hops:?}");
    let truth: std::collections::HashMap<String, Value> =
        lines(&out.join("rsfe.truth.jsonl")).into_iter().filter(|t| t["type"] == "request").map(|t| (t["req"].as_str().unwrap().to_owned(), t)).collect();
    for h in &hops {
        let q = request(&rep, h["id"].as_str().unwrap());
        let t = &truth[q["engine_request_id"].as_str().unwrap()];
        assert_eq!(q["prompt_tokens"], t["prompt_tokens"], "{}: the ADD's packed ids", q["id"]);
        // The queue ends at vLLM's SCHEDULED event: the engine's own stamp.
        let p = &q["phases_ms"];
        let scheduled = q["arrive_ns"].as_f64().unwrap() + (p["frontend"].as_f64().unwrap() + p["queue"].as_f64().unwrap()) * 1e6;
        let off = (scheduled - t["scheduled_ns"].as_f64().unwrap()) / 1e6;
        assert!(off.abs() < 0.01, "{}: queue ends {off:.4} ms from the engine's scheduling", q["id"]);
    }
    eprintln!("vLLM 0.34.0's Rust frontend: {} answers joined, nothing lost", hops.len());
}

/// The recording of this script's first part committed as a replay fixture
/// (`agent/tests/fixtures/vllm_cpu.*`, session 38; its report is the golden
/// `agent/tests/replay.rs` checks byte for byte): a real vLLM's bytes, every
/// request joined as above, every IPC message of a known layout, and the
/// start-up's netlink reads and multiprocessing pipes no loss. Reads files:
/// runs everywhere.
#[test]
fn the_committed_real_vllm_recording_joins_every_request_of_every_kind() {
    let dir = workspace().join("agent/tests/fixtures");
    let rep = json(&dir.join("vllm_cpu.report.json"));
    let drops = &rep["recording"]["drops"];
    let d = |k: &str| drops[k].as_u64().unwrap_or(0);
    assert_eq!(d("ipc_layout_inferred"), 0, "vLLM 0.32.0's layouts are in the tables: {drops}");
    assert_eq!((d("unparsed_bytes"), d("attach_mid_stream")), (0, 0), "{drops}");
    assert!(d("io_other_family") > 0 && d("unix_not_zmtp") > 0, "{drops}");
    let hops = lines(&dir.join("vllm_cpu.client.jsonl"));
    assert_eq!(hops.len(), 10);
    let by_session: BTreeSet<&str> = hops.iter().map(|h| h["session_id"].as_str().unwrap()).collect();
    // One chain per client chain, plus the /health probe on its own connection.
    assert_eq!(rep["chains"].as_array().unwrap().len(), by_session.len() + 1);
    assert_every_answer_joined(&rep, &hops, 16);
    // Its client predates the count: here every chat stream's chunks without
    // text were one held output each (two streams' first tokens decoded to no
    // text yet), so the tokens by the first content are one more.
    let mut held = 0;
    for q in rep["requests"].as_array().unwrap().iter().filter(|q| q["path"] == "/v1/chat/completions" && q["ttft_ns"].is_u64()) {
        let (empty, tokens) = (q["empty_chunks_before_content"].as_u64().unwrap(), q["tokens_before_first_content"].as_u64().unwrap());
        assert_eq!(empty + 1, tokens, "{}: {empty} chunks without text, {tokens} tokens by the first content", q["id"]);
        held += empty;
    }
    assert_eq!(held, 2);
}

#[test]
fn a_real_vllm_traced_live_joins_every_request_of_every_kind_and_loses_nothing() {
    let name = "a_real_vllm_traced_live_joins_every_request_of_every_kind_and_loses_nothing";
    let Some(_serial) = privileged(name) else { return };
    let Some(venv) = venv() else {
        eprintln!("\n!!!!! SKIPPED {name}: no vLLM environment (examples/real-vllm/install.sh target/real-vllm/venv, or HOPSCOPE_REAL_VLLM_VENV): this is NOT a pass; `cargo xtask test` installs it !!!!!\n");
        return;
    };
    let out = workspace().join("target/real-vllm/test-out");
    run_script("run.sh", &venv, &out, "18810");
    eprintln!("{}", std::fs::read_to_string(out.join("compare.txt")).unwrap_or_default());

    // 1. Every kind of request under `hopscope run`.
    let rep = json(&out.join("report.json"));
    assert_nothing_lost(&rep, &out.join("vllm_cpu.server.log"));
    let hops = lines(&out.join("vllm_cpu.client.jsonl"));
    assert_eq!(hops.len(), 18);
    // A chat hop (`response_format`) and a Responses turn (`text.format`):
    // each request's kind is vLLM's ADD's (assert_every_answer_joined).
    let json_hops: Vec<&str> = hops.iter().filter(|h| h["structured_output"] == "json").map(|h| h["kind"].as_str().unwrap()).collect();
    assert_eq!(json_hops, ["stream", "responses"], "two hops asked for a JSON answer");
    let so = &rep["summary"]["structured_output"];
    assert_eq!((&so["requests"], &so["kinds"][0]["kind"]), (&Value::from(2), &Value::from("json")), "{so}");
    let kinds: BTreeSet<&str> = hops.iter().map(|h| h["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, BTreeSet::from(["messages", "messages_whole", "responses", "stream", "stream_no_usage", "whole"]));
    assert_every_answer_joined(&rep, &hops, 16);
    // The agent's turns sent with previous_response_id, no session header,
    // each on a new connection: one chain, its hops in order.
    let linked: Vec<&Value> = hops.iter().filter(|h| h["session_header"] == false).collect();
    assert_eq!(linked.len(), 2);
    let (a, b) = (request(&rep, linked[0]["id"].as_str().unwrap()), request(&rep, linked[1]["id"].as_str().unwrap()));
    assert_eq!((&b["chain"], &a["hop"], &b["hop"]), (&a["chain"], &Value::from(1), &Value::from(2)), "{a} {b}");
    assert_eq!(b["previous_response_id"], a["id"]);
    assert_eq!(rep["recording"]["drops"]["request_links_followed"], 1);
    // Beside vLLM's own histograms, summed over the same requests: prefill
    // is read from the same engine stamps (equal); hopscope's queue starts
    // at the hand-over to the engine and its E2E at the request's read,
    // both before vLLM's; decode differs by the output paths of the first
    // and last tokens (docs/benchmarks.md: -0.55 to -1.14 ms a request).
    // vLLM's token counters: the report's counts, prefix-cache hits included.
    let rows = compare_metrics(&out.join("report.json"), &out.join("vllm-metrics.txt"));
    for h in ["queue", "scheduler_queue", "prefill", "decode", "engine_decode", "inference", "tpot", "e2e"] {
        let r = rows.row(h);
        assert_eq!((r["n"].as_u64(), r["vllm_n"].as_u64()), (Some(18), Some(18)), "{r}");
    }
    let diff = |h: &str| rows.diff(h);
    rows.assert_engine_stamps_equal();
    assert!(diff("decode").abs() < 3.0 * 18.0, "decode {} ms from vLLM's: {}", diff("decode"), rows.0);
    assert!(diff("queue") > 0.0 && diff("e2e") > 0.0, "{}", rows.0);
    rows.assert_tokens_equal();

    // 2. Clients that give up: three in the queue (each joined by vLLM's
    // ABORT to its own engine request), one cut mid-stream (by its id).
    let rep = json(&out.join("report-abort.json"));
    assert_nothing_lost(&rep, &out.join("vllm_cpu_abort.server.log"));
    let drops = &rep["recording"]["drops"];
    assert_eq!((&drops["engine_requests_linked_by_abort"], &drops["requests_closed_unfinished"]), (&Value::from(3), &Value::from(4)), "{drops}");
    let hops = lines(&out.join("vllm_cpu_abort.client.jsonl"));
    let (quit, done): (Vec<&Value>, Vec<&Value>) = hops.iter().partition(|h| !h["error"].is_null());
    assert_eq!((quit.len(), done.len()), (4, 1), "{hops:?}");
    let done_q = request(&rep, done[0]["id"].as_str().unwrap());
    assert_eq!((&done_q["completion_tokens"], &done_q["phase_source"]), (&Value::from(1500), &Value::from("ipc")));
    for h in quit {
        let q = match h["id"].as_str() {
            // Cut mid-stream: joined by id, decoding to the close, its
            // tokens the engine's (at least the chunks the client read).
            Some(id) => {
                let q = request(&rep, id);
                assert!(q["completion_tokens"].as_u64().unwrap() >= h["content_chunks"].as_u64().unwrap(), "{id}: {q}");
                assert!(q["phases_ms"]["decode"].as_f64().unwrap() > 0.0, "{id}");
                q
            }
            // Gave up in the queue before any byte came back: one request of
            // its chain, named after the engine request its ABORT ended.
            None => {
                let chain: Vec<&Value> = rep["requests"].as_array().unwrap().iter().filter(|q| q["chain"] == h["session_id"]).collect();
                assert_eq!(chain.len(), 1, "{}: {chain:?}", h["session_id"]);
                assert_eq!(chain[0]["completion_tokens"], 0);
                chain[0]
            }
        };
        assert!(q["closed_ns"].as_u64().is_some(), "{q}");
        assert_eq!(q["phase_source"], "ipc", "{q}");
        assert!(q["engine_request_id"].as_str().is_some_and(|e| q["id"].as_str().is_some_and(|id| e.starts_with(id))), "{q}");
    }

    // 3. `record --pid` attached to a vLLM already serving.
    let rep = json(&out.join("report-attach.json"));
    assert_nothing_lost(&rep, &out.join("vllm_cpu_attach.record.log"));
    let hops = lines(&out.join("vllm_cpu_attach.client.jsonl"));
    assert_eq!(hops.len(), 8);
    assert_every_answer_joined(&rep, &hops, 16);
    // Two hops sent a 24-character stop string: vLLM's detokenizer held
    // back up to 23 characters of text and sent those outputs with empty
    // content, which the client counted; hopscope counts the tokens the
    // engine made by the first content (each such output's and the one
    // that freed the text, more when vLLM merged outputs for a slow
    // reader) and the time they took.
    let held: Vec<&Value> = hops.iter().filter(|h| h["stop"].is_array()).collect();
    assert_eq!(held.len(), 2);
    for h in &held {
        let id = h["id"].as_str().unwrap();
        let q = request(&rep, id);
        let empties = h["empty_chunks_before_content"].as_u64().unwrap();
        let tokens = q["tokens_before_first_content"].as_u64().unwrap_or_else(|| panic!("{id}: no token count: {q}"));
        let (held_ms, first_output) = (q["first_output_held_ms"].as_f64().unwrap(), q["phases_ms"]["first_output"].as_f64().unwrap());
        eprintln!("{id}: {empties} empty chunks before the first content; {tokens} tokens, {held_ms:.2} of {first_output:.2} ms held");
        assert!(empties >= 1, "{id}: vLLM sent no held output: {h}");
        assert_eq!(q["empty_chunks_before_content"].as_u64(), Some(empties), "{id}: hopscope counts on the wire what the client saw");
        assert!(tokens > empties, "{id}: {tokens} tokens before the first content, {empties} held outputs seen by the client");
        assert!(held_ms > 0.0 && held_ms <= first_output, "{id}: held {held_ms} ms of first_output {first_output} ms");
    }
    for h in hops.iter().filter(|h| h["kind"] == "stream" && h["stop"].is_null()) {
        let q = request(&rep, h["id"].as_str().unwrap());
        assert!(q["tokens_before_first_content"].as_u64().is_some_and(|n| n >= 1), "{q}");
    }

    // 4. Two API server processes: the connections (one per hop) shared
    // between them, each step's outputs sent to both as a message each and
    // joined into one step; every request joined, prefill vLLM's.
    let (rep, hops, rows) = check_compared_part(&out, "api2", 12, 16);
    let servers: BTreeSet<u64> = hops.iter().map(|h| request(&rep, h["id"].as_str().unwrap())["pid"].as_u64().unwrap()).collect();
    assert_eq!(servers.len(), 2, "12 connections served by both API server processes: {servers:?}");
    let drops = &rep["recording"]["drops"];
    assert!(drops["engine_outputs_joined"].as_u64().unwrap_or(0) > 0, "{drops}");
    assert!(rows.0.as_array().unwrap().iter().filter(|r| r["hopscope"] != "ttft" && r.get("n").is_some()).all(|r| r["n"] == 12 && r["vllm_n"] == 12), "{}", rows.0);

    // 5. Speculative decoding (n-gram, 3 draft tokens): steps whose output
    // carries several tokens of a request, and one prompt prefilled in two
    // chunks (over the 2048 tokens a step). Every request joined, prefill and
    // token counts vLLM's; the tokens beyond one a step are vLLM's accepted
    // drafts, less those a request's max_tokens cut off in its last step
    // (vLLM counts them accepted; its output drops them). A chunk that
    // outputs nothing is not one of a request's steps: vLLM sends nothing
    // of it.
    let (rep, hops, _) = check_compared_part(&out, "spec", 7, 48);
    assert!(hops.iter().any(|h| h["prompt_tokens"].as_u64().is_some_and(|n| n > 2048)), "no prompt over a step's 2048 tokens: {hops:?}");
    let accepted = vllm_counter(&out.join("vllm-metrics-spec.txt"), "vllm:spec_decode_num_accepted_tokens_total");
    assert!(accepted > 0, "vLLM accepted no draft token: the run did not decode speculatively");
    let beyond: u64 = hops
        .iter()
        .map(|h| {
            let q = request(&rep, h["id"].as_str().unwrap());
            let (tokens, steps) = (q["completion_tokens"].as_u64().unwrap(), q["steps"].as_u64().unwrap());
            assert!(steps >= 1 && steps <= tokens, "{}: {steps} steps for {tokens} tokens", q["id"]);
            tokens - steps
        })
        .sum();
    assert!(beyond > 0 && beyond <= accepted && accepted - beyond <= hops.len() as u64 * 3, "{beyond} tokens beyond one a step; vLLM accepted {accepted} drafts");
    eprintln!("speculative decoding: {beyond} tokens beyond one a step over {} requests; vLLM accepted {accepted} drafts", hops.len());

    // 6. A KV cache too small for the load (24 blocks for five ~720-token
    // prompts decoding 400 tokens): vLLM preempts running requests and holds
    // others in its scheduler's queue. Every request joined; preemptions,
    // the scheduler's queue, prefill (a preempted prefill's recompute
    // included) and decode equal to vLLM's own; the hop table says where a
    // long queue went.
    let (_, hops, rows) = check_compared_part(&out, "kv", 5, 400);
    assert!(rows.0.as_array().unwrap().iter().filter(|r| r.get("n").is_some()).all(|r| r["n"] == 5 && r["vllm_n"] == 5), "{}", rows.0);
    let preempted = rows.row("preemptions")["tokens"].as_u64().unwrap();
    assert!(preempted >= 1, "no request was preempted: the KV cache was not short: {}", rows.0);
    let held = rows.row("scheduler_queue")["ms"].as_f64().unwrap();
    assert!(held > 100.0, "the scheduler held no request waiting: {}", rows.0);
    let text = std::fs::read_to_string(out.join("report-kv.txt")).unwrap();
    assert!(text.contains("in the scheduler's queue") && (text.contains("^ preempted") || text.contains("; preempted")), "{text}");
    eprintln!("a short KV cache: {preempted} preemptions, {held:.1} ms in the scheduler's queue over {} requests", hops.len());
}

/// A part of `run.sh` beside vLLM's `/metrics` (`vllm_cpu_TAG.*`,
/// `report-TAG.json`, `vllm-metrics-TAG.txt`, `compare-TAG.txt`): its
/// comparison printed, nothing lost, `requests` client requests each joined
/// with `max_tokens` tokens, the figures of the engine's own stamps and the
/// token counters equal to vLLM's. Returns the report, the client's requests
/// and the comparison.
fn check_compared_part(out: &Path, tag: &str, requests: usize, max_tokens: u64) -> (Value, Vec<Value>, Rows) {
    eprintln!("{}", std::fs::read_to_string(out.join(format!("compare-{tag}.txt"))).unwrap_or_default());
    let rep = json(&out.join(format!("report-{tag}.json")));
    assert_nothing_lost(&rep, &out.join(format!("vllm_cpu_{tag}.server.log")));
    let hops = lines(&out.join(format!("vllm_cpu_{tag}.client.jsonl")));
    assert_eq!(hops.len(), requests, "{tag}");
    assert_every_answer_joined(&rep, &hops, max_tokens);
    let rows = compare_metrics(&out.join(format!("report-{tag}.json")), &out.join(format!("vllm-metrics-{tag}.txt")));
    rows.assert_engine_stamps_equal();
    rows.assert_tokens_equal();
    (rep, hops, rows)
}

/// A counter's value in vLLM's `/metrics` text, summed over its labels.
fn vllm_counter(metrics: &Path, name: &str) -> u64 {
    let text = std::fs::read_to_string(metrics).unwrap_or_else(|e| panic!("{}: {e}", metrics.display()));
    let values: Vec<f64> = text
        .lines()
        .filter(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' ')))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    assert!(!values.is_empty(), "{name} not in {}", metrics.display());
    values.iter().sum::<f64>() as u64
}

/// `compare_metrics.py --json`: hopscope's sums beside vLLM's `/metrics`.
struct Rows(Value);

impl Rows {
    fn row(&self, h: &str) -> &Value {
        self.0.as_array().unwrap().iter().find(|r| r["hopscope"] == h).unwrap_or_else(|| panic!("{h}: {}", self.0))
    }
    /// hopscope's sum less vLLM's, in ms.
    fn diff(&self, h: &str) -> f64 {
        self.row(h)["ms"].as_f64().unwrap() - self.row(h)["vllm_ms"].as_f64().unwrap()
    }
    /// Where both read the engine's own stamps they agree, summed over the
    /// same requests, within 0.01 ms: the scheduler's queue (QUEUED →
    /// SCHEDULED), prefill (SCHEDULED → first token), the engine's decode
    /// (first → last output: decode less the last output's path, with the
    /// first's), inference (SCHEDULED → last output) and the time per
    /// output token (engine decode over the tokens after the first).
    fn assert_engine_stamps_equal(&self) {
        for h in ["scheduler_queue", "prefill", "engine_decode", "inference", "tpot"] {
            assert!(self.diff(h).abs() < 0.01, "{h} {} ms from vLLM's: {}", self.diff(h), self.0);
        }
    }
    /// vLLM's token counters and the report's sums over the same requests
    /// are equal: prompt, prefix-cached, computed (prompt less cached: the
    /// sum of vLLM's per-request histogram) and generated tokens, and
    /// preemptions.
    fn assert_tokens_equal(&self) {
        for h in ["prompt_tokens", "cached_tokens", "computed_tokens", "completion_tokens", "preemptions"] {
            let r = self.row(h);
            assert!(r["tokens"].as_u64().is_some_and(|n| n > 0 || ["cached_tokens", "preemptions"].contains(&h)), "{r}");
            assert_eq!(r["tokens"], r["vllm_tokens"], "{h}: {}", self.0);
        }
    }
}

fn compare_metrics(report: &Path, metrics: &Path) -> Rows {
    let cmp = Command::new(python()).arg(workspace().join("examples/real-vllm/compare_metrics.py")).args([report, metrics]).arg("--json").output().expect("compare_metrics.py");
    assert!(cmp.status.success(), "compare_metrics.py: {}", String::from_utf8_lossy(&cmp.stderr));
    Rows(serde_json::from_slice(&cmp.stdout).expect("compare_metrics.py --json"))
}
