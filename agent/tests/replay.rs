//! Replay: small recordings made by the testbed under `hopscope run`
//! (tests/fixtures/README.md says how) give exactly the report they gave when
//! they were made, through the library path `recording::Reader` →
//! `Correlator` → `sink::report::build` → JSON. The goldens were written by
//! `hopscope report FILE --json` from the workspace root, so the CLI and the
//! library must agree byte for byte too.
//!
//! Beside the byte comparison, each fixture is checked for what the client
//! really did (its `*.client.jsonl`: chains, hops, ids, token counts) and for
//! the partition's invariants, so a golden regenerated after an intentional
//! change still has to tell the truth.

use hopscope::correlate::{engine, Analysis, Config, Correlator};
use hopscope::event::Dir;
use hopscope::model::Record;
use hopscope::recording::{Meta, Reader};
use hopscope::sink::report;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

const FIXTURES: [&str; 7] = ["chain3", "queue2", "tp_chunked", "loaded", "dp_loaded", "long_adds", "structured"];

/// A real vLLM (0.32.0, its CPU build) under `hopscope run`: streamed chat,
/// whole answers, a stream without usage and the Responses API, one after
/// the other (tests/fixtures/README.md). Not in [`FIXTURES`], whose checks
/// assume streamed chat alone; its own below.
const REAL_VLLM: &str = "vllm_cpu";

fn fixture(file: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(file)
}

/// The path the goldens name: `hopscope report` was run from the workspace root.
fn report_path(name: &str) -> String {
    format!("agent/tests/fixtures/{name}.hop")
}

struct Replayed {
    meta: Meta,
    records: Vec<Record>,
    analysis: Analysis,
    read_error: Option<String>,
}

/// Fixture `name`'s text report as `hopscope report` prints it: written
/// while the recording is read.
fn streamed_table_text(name: &str) -> String {
    let bytes = std::fs::read(fixture(&format!("{name}.hop"))).unwrap();
    let mut reader = Reader::new(&bytes[..]).unwrap();
    let cfg = Config { chain_header: reader.meta().chain_header.clone(), use_ipc: true };
    let mut streamed = Vec::new();
    report::write_text(&mut reader, &report_path(name), cfg, hopscope::sink::summary::DEFAULT_PERCENTILES, &mut streamed).unwrap();
    String::from_utf8(streamed).unwrap()
}

/// Reads a recording from bytes the way `hopscope report` does (streamed,
/// keeping what precedes a damaged tail) and correlates it.
fn replay_bytes(bytes: &[u8]) -> Replayed {
    let mut reader = Reader::new(bytes).expect("fixture header reads");
    let meta = reader.meta().clone();
    let mut c = Correlator::new(Config { chain_header: meta.chain_header.clone(), use_ipc: true });
    let mut records = Vec::new();
    let read_error = loop {
        match reader.next_record() {
            Ok(Some(r)) => {
                c.ingest(&r);
                records.push(r);
            }
            Ok(None) => break None,
            Err(e) => break Some(e.to_string()),
        }
    };
    Replayed { meta, records, analysis: c.finish(), read_error }
}

fn replay(name: &str) -> Replayed {
    let bytes = std::fs::read(fixture(&format!("{name}.hop"))).expect("fixture present");
    replay_bytes(&bytes)
}

/// The report JSON exactly as `hopscope report FILE --json` prints it.
fn report_text(name: &str) -> String {
    let r = replay(name);
    let rep = report::build(&report_path(name), &r.meta, &r.analysis, r.read_error);
    let mut s = serde_json::to_string_pretty(&rep).expect("report serializes");
    s.push('\n');
    s
}

fn golden(name: &str) -> String {
    std::fs::read_to_string(fixture(&format!("{name}.report.json"))).expect("golden present")
}

fn client(name: &str) -> Vec<Value> {
    std::fs::read_to_string(fixture(&format!("{name}.client.jsonl")))
        .expect("client log present")
        .lines()
        .map(|l| serde_json::from_str(l).expect("client line is json"))
        .collect()
}

fn assert_matches_golden(name: &str) {
    let got = report_text(name);
    let want = golden(name);
    if got != want {
        let line = got.lines().zip(want.lines()).position(|(a, b)| a != b).unwrap_or_else(|| got.lines().count().min(want.lines().count()));
        panic!(
            "{name}: the report differs from tests/fixtures/{name}.report.json at line {}:\n  got:  {:?}\n  want: {:?}\n\
             If the change is intended, regenerate the goldens (tests/fixtures/README.md) and review the diff.",
            line + 1,
            got.lines().nth(line),
            want.lines().nth(line)
        );
    }
}

#[test]
fn chain3_report_equals_its_golden_json_byte_for_byte() {
    assert_matches_golden("chain3");
}

#[test]
fn queue2_report_equals_its_golden_json_byte_for_byte() {
    assert_matches_golden("queue2");
}

#[test]
fn tp_chunked_report_equals_its_golden_json_byte_for_byte() {
    assert_matches_golden("tp_chunked");
}

#[test]
fn replaying_the_same_fixture_twice_gives_byte_identical_reports() {
    for name in FIXTURES {
        assert_eq!(report_text(name), report_text(name), "{name}");
        assert_eq!(replay(name).analysis, replay(name).analysis, "{name}");
    }
}

#[test]
fn fixtures_read_cleanly_and_lose_nothing() {
    for name in FIXTURES.into_iter().chain([REAL_VLLM]) {
        let r = replay(name);
        assert!(r.read_error.is_none(), "{name}: {:?}", r.read_error);
        assert!(!r.meta.capture_payload, "{name}");
        assert!(!r.meta.gpu, "{name}");
        let losses: Vec<_> = r.analysis.drops.iter().filter(|(k, v)| **v > 0 && report::is_loss(k)).map(|(k, _)| k.as_str()).collect();
        assert!(losses.is_empty(), "{name}: {losses:?} in {:?}", r.analysis.drops);
        if name == "long_adds" {
            // Each long prompt's HTTP body is ~10 KB: past the 4 KiB TCP
            // capture, skipped by count, which costs no figure.
            let d = |k: &str| r.analysis.drops.get(k).copied().unwrap_or(0);
            assert!(d("gap_bytes_in_body") > 0 && d("kernel_truncated") == 4, "{:?}", r.analysis.drops);
        }
    }
}

/// Every streamed chat request: phases cover [arrive, done] exactly, none is
/// negative, and the marks are in order with nothing clamped.
#[test]
fn fixture_phases_add_up_to_e2e_and_are_non_negative() {
    for name in FIXTURES {
        let r = replay(name);
        let mut checked = 0;
        for q in r.analysis.requests.iter().filter(|q| q.path == "/v1/chat/completions") {
            let p = engine::partition(q);
            let parts = [p.frontend, p.queue, p.prefill, p.first_output, p.decode];
            assert!(parts.iter().all(|x| x.is_some()), "{name} {}: every phase known from the IPC: {p:?}", q.id);
            let parts: Vec<f64> = parts.iter().map(|x| x.unwrap()).collect();
            assert!(parts.iter().all(|&x| x >= 0.0), "{name} {}: {p:?}", q.id);
            let e2e = q.e2e_ms().expect("finished");
            assert!((parts.iter().sum::<f64>() - e2e).abs() < 1e-6, "{name} {}: {p:?} vs e2e {e2e}", q.id);
            let m = engine::marks(q).expect("engine joined");
            assert_eq!(m.clamped, 0, "{name} {}: the real recording's marks are already in order: {m:?}", q.id);
            let seq = [m.arrive, m.submit, m.scheduled, m.first_token.unwrap(), m.ttft.unwrap(), m.done];
            assert!(seq.windows(2).all(|w| w[0] <= w[1]), "{name} {}: {m:?}", q.id);
            checked += 1;
        }
        assert_eq!(checked, client(name).len(), "{name}: one checked request per hop the client sent");
    }
}

/// The chains and hops the client really made, with its ids and token counts,
/// come out of the report (the golden) in hop order.
#[test]
fn fixture_reports_show_the_chains_and_hops_the_client_made() {
    for name in FIXTURES {
        let rep: Value = serde_json::from_str(&golden(name)).unwrap();
        let hops = client(name);
        let mut by_chain: BTreeMap<i64, Vec<&Value>> = BTreeMap::new();
        for h in &hops {
            by_chain.entry(h["chain"].as_i64().unwrap()).or_default().push(h);
        }
        let chains = rep["chains"].as_array().unwrap();
        // One chain per client chain, plus the /health probe on its own connection.
        assert_eq!(chains.len(), by_chain.len() + 1, "{name}");
        for (c, hs) in &by_chain {
            let key = match hs[0]["traceparent"].as_str() {
                Some(tp) => tp.split('-').nth(1).unwrap().to_owned(),
                None => hs[0]["session_id"].as_str().unwrap().to_owned(),
            };
            let chain = chains.iter().find(|ch| ch["chain"] == key.as_str()).unwrap_or_else(|| panic!("{name}: chain {c} ({key}) missing"));
            let want_source = if hs[0]["traceparent"].is_string() { "traceparent" } else { "header" };
            assert_eq!(chain["source"], want_source, "{name} chain {c}");
            let ids: Vec<&str> = hs.iter().map(|h| h["id"].as_str().unwrap()).collect();
            let got: Vec<&str> = chain["hops"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
            assert_eq!(got, ids, "{name} chain {c}: hops in order");
            for h in hs {
                let q = rep["requests"].as_array().unwrap().iter().find(|q| q["id"] == h["id"]).unwrap();
                assert_eq!(q["hop"], h["hop"], "{name} {}", h["id"]);
                assert_eq!(q["status"], 200);
                assert_eq!(q["phase_source"], "ipc");
                assert_eq!(q["streamed"], true);
                for k in ["prompt_tokens", "cached_tokens", "completion_tokens"] {
                    assert_eq!(q[k], h[k], "{name} {} {k}", h["id"]);
                }
                assert_eq!(q["content_chunks"], h["content_chunks"], "{name} {}", h["id"]);
                assert_eq!(q["x_request_id"], h["x_request_id"], "{name} {}", h["id"]);
            }
        }
    }
}

#[test]
fn loaded_report_equals_its_golden_json_byte_for_byte() {
    assert_matches_golden("loaded");
}

/// `loaded` was recorded with two busy loops beside the testbed: some ADDs
/// left the frontend with no wake-up of their own and are placed by their
/// `arrival_time` from an earlier ADD's wake-up (docs/decisions.md). The
/// frontend's own marks around its send (its `truth.jsonl`, trimmed) bound
/// where the hand-over really was. Placed from the latest such ADD alone,
/// one submit came out 0.465 ms after that bracket (the anchor's own send
/// was late); from the least delayed of the recent ones, 0.173 ms.
#[test]
fn submits_placed_by_arrival_time_stay_near_the_frontends_send() {
    let (placed, worst) = submit_errors("loaded");
    assert!(placed >= 1, "the fixture holds submits placed by arrival_time");
    assert!(worst.placed <= 250_000, "a placed submit {} ns outside the frontend's send", worst.placed);
}

#[test]
fn dp_loaded_report_equals_its_golden_json_byte_for_byte() {
    assert_matches_golden("dp_loaded");
}

/// `dp_loaded`: two data-parallel engines, two busy loops beside the
/// testbed, recording format 3 (each unix write names the wake-up of its
/// thread's latest sleep: `WokenWrite`). One ADD was handed over while the
/// I/O thread was awake, built 2.1 ms before the API server's thread was
/// preempted and sent when it came back: placed by the least delayed
/// anchor alone it came out 2.1 ms before the frontend's send (the
/// attribution test failed on it); kept out of the thread's off-CPU time,
/// 0.03 ms. Every submit, wake-up or placed, is held within 0.25 ms.
#[test]
fn data_parallel_submits_under_load_stay_near_the_frontends_send() {
    let r = replay("dp_loaded");
    assert!(r.records.iter().any(|x| matches!(x, Record::WokenWrite { .. })), "a format 3 recording with the writes' wake-ups");
    let engines: BTreeSet<Option<u64>> = r.analysis.requests.iter().filter(|q| q.path == "/v1/chat/completions").map(|q| q.engine.as_ref().and_then(|e| e.engine_index)).collect();
    assert_eq!(engines, [Some(0), Some(1)].into_iter().collect(), "both engines served");
    let (placed, worst) = submit_errors("dp_loaded");
    assert!(placed >= 1, "the fixture holds submits placed by arrival_time");
    assert!(worst.placed <= 250_000 && worst.any <= 250_000, "a submit outside the frontend's send by {worst:?} ns");
}

#[test]
fn long_adds_report_equals_its_golden_json_byte_for_byte() {
    assert_matches_golden("long_adds");
}

/// `long_adds`: ~9.5 K-token prompts, recording format 4. libzmq wrote each
/// ADD as its 8 KiB batch and then the rest; each is preceded by where it
/// began (`EngineRequestStart`) and timed by the wake-up before its first
/// write, within 0.25 ms of the frontend's send. Read as a format 3
/// reader would (the start records left out), none is.
#[test]
fn adds_longer_than_a_zmq_batch_are_timed_by_their_first_writes_wake_up() {
    let r = replay("long_adds");
    assert_eq!(r.meta.format_version, 4);
    let starts = r.records.iter().filter(|x| matches!(x, Record::EngineRequestStart { dir: Dir::Out, first_ns, ts_ns, .. } if first_ns < ts_ns)).count();
    assert_eq!(starts, client("long_adds").len(), "every written ADD spanned two writes");
    let sources = |a: &Analysis| -> Vec<&'static str> { a.requests.iter().filter(|q| q.path == "/v1/chat/completions").map(|q| q.engine.as_ref().expect("engine joined").submit_source).collect() };
    assert_eq!(sources(&r.analysis), [engine::SUBMIT_WAKE; 4]);
    let (_, worst) = submit_errors("long_adds");
    assert!(worst.any <= 250_000, "a submit outside the frontend's send by {worst:?} ns");
    let mut c = Correlator::new(Config { chain_header: r.meta.chain_header.clone(), use_ipc: true });
    for x in r.records.iter().filter(|x| !matches!(x, Record::EngineRequestStart { .. })) {
        c.ingest(x);
    }
    let before = c.finish();
    assert!(sources(&before).iter().all(|&s| s != engine::SUBMIT_WAKE), "{:?}", sources(&before));
}

#[derive(Debug, Default)]
struct Worst {
    placed: u64,
    any: u64,
}

/// How many submits of fixture `name` were placed by arrival_time, and the
/// worst distance of those and of all from the frontend's marks around its
/// send (`NAME.truth.jsonl`).
fn submit_errors(name: &str) -> (usize, Worst) {
    let truth: BTreeMap<String, (u64, u64)> = std::fs::read_to_string(fixture(&format!("{name}.truth.jsonl")))
        .expect("truth present")
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).expect("truth line is json");
            let ns = |k: &str| v[k].as_u64().unwrap_or_else(|| panic!("{k} in {v}"));
            (v["id"].as_str().expect("id").to_owned(), (ns("submit_ns"), ns("submit_sent_ns")))
        })
        .collect();
    let r = replay(name);
    let (mut placed, mut worst) = (0, Worst::default());
    for q in r.analysis.requests.iter().filter(|q| q.path == "/v1/chat/completions") {
        let e = q.engine.as_ref().expect("engine joined");
        let m = engine::marks(q).expect("marks");
        let (lo, hi) = truth[&q.id];
        let err = lo.saturating_sub(m.submit).max(m.submit.saturating_sub(hi));
        worst.any = worst.any.max(err);
        if e.submit_source == engine::SUBMIT_ARRIVAL {
            placed += 1;
            worst.placed = worst.placed.max(err);
        }
    }
    (placed, worst)
}

#[test]
fn queue2_with_one_running_sequence_shows_queueing() {
    // --max-num-seqs 1 and two concurrent chains: one hop-1 waits for the other.
    let r = replay("queue2");
    let worst = r.analysis.requests.iter().filter_map(|q| engine::partition(q).queue).fold(0.0, f64::max);
    assert!(worst > 50.0, "a hop-1 queued behind the other chain's hop-1 (worst queue {worst} ms)");
}

#[test]
fn tp_chunked_without_engine_events_schedules_from_steps_and_submits() {
    // --disable-log-stats: no SCHEDULED events on the IPC.
    let r = replay("tp_chunked");
    for q in r.analysis.requests.iter().filter_map(|q| q.engine.as_ref()) {
        assert_ne!(q.scheduled_source, "event", "{q:?}");
    }
}

/// The chain tables say why a hop's decode was slow: under each hop that
/// lost decode time to co-batched prefill, a line names the requests whose
/// prefill it was, with the `interf` column's figure — in the streamed text
/// (`hopscope report`) and the in-memory one alike.
#[test]
fn the_text_report_names_whose_prefill_slowed_a_hops_decode() {
    let r = replay("tp_chunked");
    let rep = report::build(&report_path("tp_chunked"), &r.meta, &r.analysis, None);
    let slowed: Vec<_> = rep.requests.iter().filter(|q| !q.interference_from.is_empty()).collect();
    assert_eq!(slowed.len(), 1, "tp_chunked has one hop slowed by another's chunked prefill");
    for text in [streamed_table_text("tp_chunked"), report::render_text(&rep)] {
        let header = text.lines().find(|l| l.trim_start().starts_with("hop ")).expect("a chain table");
        let col = header.split_whitespace().position(|c| c == "interf").expect("an interf column");
        for q in &slowed {
            let interf = q.interference_ms.expect("a figure with its names");
            assert!(interf > 1.0, "{interf}");
            let note = format!("        ^ decode lost {interf:.2} ms to the co-batched prefill of {}", q.interference_from.join(", "));
            let lines: Vec<&str> = text.lines().collect();
            let at = lines.iter().position(|l| *l == note).unwrap_or_else(|| panic!("no line {note:?} in\n{text}"));
            // The line above is the hop's row: its e2e and interference figures.
            let row: Vec<&str> = lines[at - 1].split_whitespace().collect();
            assert_eq!(row.last().copied(), Some(format!("{:.2}", q.e2e_ms.unwrap()).as_str()), "{}", lines[at - 1]);
            assert_eq!(row[col], format!("{interf:.2}"), "{}", lines[at - 1]);
        }
        assert_eq!(text.matches("        ^ ").count(), slowed.len(), "{text}");
    }
}

/// Where the engine stamps QUEUED and SCHEDULED, a hop's long queue is
/// split under its row: in `dp_loaded` the engines ran second-long steps,
/// so requests waited outside the scheduler, which the report's
/// `scheduler_queue_ms` (vLLM's own queue time) does not hold.
#[test]
fn the_text_report_says_how_much_of_a_long_queue_passed_before_the_engine_took_the_request_in() {
    let r = replay("dp_loaded");
    let rep = report::build(&report_path("dp_loaded"), &r.meta, &r.analysis, None);
    let long: Vec<_> = rep.requests.iter().filter(|q| q.phases_ms.queue.is_some_and(|x| x >= 0.1 * q.e2e_ms.unwrap())).collect();
    assert!(long.len() >= 2, "dp_loaded has requests queued behind long steps");
    for text in [streamed_table_text("dp_loaded"), report::render_text(&rep)] {
        for q in &long {
            let (queue, sched) = (q.phases_ms.queue.unwrap(), q.scheduler_queue_ms.expect("the testbed logs stats"));
            assert!(sched < 1.0 && queue > 100.0, "{}: the wait was outside the scheduler: {queue} ms, {sched} ms in it", q.id);
            let note = format!("        ^ queued {queue:.2} ms: {:.2} before the engine took it in (the IPC, the step it was running), {sched:.2} in the scheduler's queue", queue - sched);
            let lines: Vec<&str> = text.lines().collect();
            let at = lines.iter().position(|l| l.starts_with(&note)).unwrap_or_else(|| panic!("no line {note:?} in\n{text}"));
            assert_eq!(lines[at - 1].split_whitespace().last(), Some(format!("{:.2}", q.e2e_ms.unwrap()).as_str()), "{}", lines[at - 1]);
        }
        assert_eq!(text.matches("        ^ queued ").count(), long.len(), "{text}");
    }
}

/// Each chain table ends with a `sum` row — its hops' TTFT, phases, tokens
/// and E2E added up — and the time the chain spent outside the server (its
/// E2E less its hops'), the same streamed and in memory.
#[test]
fn a_chain_table_adds_up_its_hops_and_the_clients_time_between_them() {
    for name in FIXTURES {
        let r = replay(name);
        let rep = report::build(&report_path(name), &r.meta, &r.analysis, None);
        let text = streamed_table_text(name);
        assert_eq!(text, report::render_text(&rep), "{name}");
        let lines: Vec<&str> = text.lines().collect();
        let mut checked = 0;
        for c in rep.chains.iter().filter(|c| c.hops.len() > 1) {
            let hops: Vec<&report::RequestOut> = c.hops.iter().map(|id| rep.requests.iter().rev().find(|q| &q.id == id).unwrap()).collect();
            let title = lines.iter().position(|l| l.starts_with(&format!("chain {} ", c.chain))).unwrap_or_else(|| panic!("{name}: no table for {}", c.chain));
            let cols: Vec<&str> = lines[title + 1].split_whitespace().collect();
            let at = lines[title..].iter().position(|l| l.trim_start().starts_with("sum ")).expect("a sum row") + title;
            let row: Vec<&str> = lines[at].split_whitespace().collect();
            assert_eq!(row.len(), cols.len(), "{}", lines[at]);
            let col = |n: &str| row[cols.iter().position(|c| *c == n).unwrap()];
            let e2e: f64 = hops.iter().map(|q| q.e2e_ms.unwrap()).sum();
            let prefill: f64 = hops.iter().map(|q| q.phases_ms.prefill.unwrap()).sum();
            let out: u64 = hops.iter().map(|q| q.completion_tokens.unwrap()).sum();
            assert_eq!(col("e2e_ms"), format!("{e2e:.2}"), "{name} {}", c.chain);
            assert_eq!(col("prefill"), format!("{prefill:.2}"), "{name} {}", c.chain);
            assert_eq!(col("out"), out.to_string(), "{name} {}", c.chain);
            assert_eq!(col("kv"), "-", "no hop has a KV transfer without a GPU");
            let chain = c.e2e_ms.unwrap();
            assert!(chain >= e2e, "{name} {}: the hops are sequential", c.chain);
            assert_eq!(lines[at + 1], format!("        between hops (the client's own time): {:.2} ms of the chain's {chain:.2} ms", chain - e2e));
            // The JSON says the same.
            assert_eq!(c.hops_e2e_ms, Some(e2e), "{name} {}", c.chain);
            assert_eq!(c.between_hops_ms, Some(chain - e2e), "{name} {}", c.chain);
            checked += 1;
        }
        assert!(checked >= 1, "{name}: a chain of several hops");
    }
}

/// Recordings are payload-free: none of the prompt text the client sent
/// (system prompt, instructions, the seeded task words) is in the file or in
/// any decoded record, and no raw-payload record is there.
#[test]
fn fixtures_hold_no_prompt_text() {
    // The first words of each fixture's seeded task text (chain_client.py
    // task_text with --task-seed 4242, 4343/4344, 4444/4445, 4545/4546,
    // 4646, 1-4).
    let planted = [
        "careful senior software engineer",
        "Task: build a small tool",
        "implement the plan",
        "profile buffer queue device host",
        "trace service profile phase response",
        "context retry handler protocol eviction",
        "capture trace worker timeout memory",
        "engine backend policy socket frontend",
        // `structured`: --task-seed 4545 (chains 0-1) and 4646.
        "queue device chunk buffer response",
        "parent socket backoff request channel",
        "budget latency attribution budget header",
        // The attribution tests' default --task-seed 1, chains 0-3 (`loaded`, `dp_loaded`).
        "memory engine backoff socket dealer phase",
        "block decode batch eviction client agent",
        "timeout buffer offload backend engine",
        "timeout session kernel copy handler",
    ];
    for name in FIXTURES.into_iter().chain([REAL_VLLM]) {
        let bytes = std::fs::read(fixture(&format!("{name}.hop"))).unwrap();
        let r = replay(name);
        assert!(!r.records.iter().any(|x| matches!(x, Record::RawIo { .. })), "{name}");
        let decoded = format!("{:?}", r.records);
        for p in planted {
            assert!(!decoded.contains(p), "{name}: decoded records contain {p:?}");
            assert!(!bytes.windows(p.len()).any(|w| w == p.as_bytes()), "{name}: file contains {p:?}");
        }
    }
}

#[test]
fn the_real_vllm_report_equals_its_golden_json_byte_for_byte() {
    assert_matches_golden(REAL_VLLM);
}

// What the real vLLM's recording holds, request by request, is checked
// beside the live runs of the same script: tests/tests/real_vllm.rs
// `the_committed_real_vllm_recording_joins_every_request_of_every_kind`.

/// The real vLLM recording's Perfetto trace passes the invariant checker and
/// draws each request's partition (a whole answer's without a first
/// output) and flows between requests and the engine's steps.
#[test]
fn the_real_vllm_trace_is_valid_and_draws_each_requests_partition() {
    use hopscope::sink::perfetto::{check, write_trace, TraceInput};
    let r = replay(REAL_VLLM);
    let (bytes, stats) = write_trace(Vec::new(), TraceInput { meta: &r.meta, records: &r.records, analysis: &r.analysis, read_error: None }).expect("trace written");
    let s = check::check_bytes(&bytes).unwrap_or_else(|e| panic!("the trace breaks an invariant: {e}"));
    assert_eq!(stats.requests, 11, "10 POSTs and the /health probe");
    assert!(s.flows > 0, "request → step flows drawn");
    for h in client(REAL_VLLM) {
        let id = h["id"].as_str().unwrap();
        let t = s.track(id).unwrap_or_else(|| panic!("{id}: no request track"));
        for phase in ["frontend", "prefill", "decode"] {
            assert_eq!(t.slices.get(phase), Some(&1), "{id}: {phase} in {:?}", t.slices);
        }
        assert_eq!(t.slices.contains_key("first output"), h["kind"] != "whole", "{id}: {:?}", t.slices);
    }
}

/// A recording cut short still replays: what precedes the cut is reported and
/// the error names the offset.
#[test]
fn truncated_fixture_gives_a_partial_report_naming_the_offset() {
    let bytes = std::fs::read(fixture("chain3.hop")).unwrap();
    let full = replay_bytes(&bytes);
    let cut = replay_bytes(&bytes[..bytes.len() * 2 / 3]);
    let err = cut.read_error.as_deref().expect("the cut is reported");
    assert!(err.contains("offset"), "{err}");
    assert!(!cut.records.is_empty() && cut.records.len() < full.records.len(), "{} of {}", cut.records.len(), full.records.len());
    assert_eq!(cut.records[..], full.records[..cut.records.len()], "the readable part is the file's prefix");
    let rep = report::build("cut.hop", &cut.meta, &cut.analysis, cut.read_error.clone());
    assert_eq!(rep.recording.read_error.as_deref(), Some(err));
    serde_json::to_string(&rep).expect("partial report serializes");
}

/// What `hopscope report --json` prints: the report written while the
/// recording is read.
fn streamed_text(bytes: &[u8], path: &str) -> (String, Option<String>) {
    let mut reader = Reader::new(bytes).expect("fixture header reads");
    let cfg = Config { chain_header: reader.meta().chain_header.clone(), use_ipc: true };
    let mut out = Vec::new();
    let err = report::write_json(&mut reader, path, cfg, hopscope::sink::summary::DEFAULT_PERCENTILES, &mut out).expect("the report writes");
    (String::from_utf8(out).expect("utf-8 json"), err)
}

#[test]
fn streamed_json_report_equals_the_in_memory_report_byte_for_byte() {
    for name in FIXTURES {
        let bytes = std::fs::read(fixture(&format!("{name}.hop"))).expect("fixture present");
        let (got, err) = streamed_text(&bytes, &report_path(name));
        assert_eq!(err, None, "{name}");
        assert_eq!(got, report_text(name), "{name}");
    }
    // A damaged tail: the readable part, and the error, as in memory.
    let bytes = std::fs::read(fixture("chain3.hop")).expect("fixture present");
    let cut = &bytes[..bytes.len() * 2 / 3];
    let r = replay_bytes(cut);
    let rep = report::build("cut.hop", &r.meta, &r.analysis, r.read_error.clone());
    let (got, err) = streamed_text(cut, "cut.hop");
    assert_eq!(err, r.read_error);
    assert_eq!(got, serde_json::to_string_pretty(&rep).expect("report serializes") + "\n");
}

/// NVML samples of the server's process put a peak-GPU-memory column into the
/// text report's per-hop table, with each hop's own peak.
#[test]
fn nvml_samples_add_each_hops_peak_gpu_memory_to_the_hop_table() {
    let r = replay("chain3");
    let pid = r.meta.pids[0];
    let (first, last) = (r.analysis.first_ns.unwrap(), r.analysis.last_ns.unwrap());
    let mib = |k: u64| (1024 + k) << 20;
    let mut records = r.records.clone();
    let mut k = 0;
    let mut t = first;
    while t <= last {
        records.push(Record::GpuSample {
            ts_ns: t,
            device: 0,
            mem_used_bytes: mib(k) + (1 << 30),
            mem_total_bytes: 141 << 30,
            process_mem: vec![(pid, mib(k))],
            sm_util_pct: Some(50),
            mem_util_pct: None,
            pcie_tx_kib_s: None,
            pcie_rx_kib_s: None,
            nvlink_tx_kib_s: None,
            nvlink_rx_kib_s: None,
        });
        k += 1;
        t += 10_000_000;
    }
    records.sort_by_key(Record::ts_ns);
    let mut c = Correlator::new(Config { chain_header: r.meta.chain_header.clone(), use_ipc: true });
    let mut gpu_mem = hopscope::sink::summary::GpuMemIndex::default();
    for rec in &records {
        c.ingest(rec);
        gpu_mem.ingest(rec);
    }
    // As `hopscope report` does: the peaks come from the samples beside the correlator.
    let mut rep = report::build(&report_path("chain3"), &r.meta, &c.finish(), None);
    gpu_mem.apply(&mut rep.requests, &mut rep.summary);
    let text = report::render_text(&rep);
    let header = text.lines().find(|l| l.trim_start().starts_with("hop ")).expect("a hop table");
    assert!(header.trim_end().ends_with("gpu_mem_mib"), "{header}");
    let chain = rep.chains.iter().find(|c| c.hops.len() > 1).expect("chain3 has a multi-hop chain");
    let rows: Vec<&str> = text.lines().skip_while(|l| !l.starts_with(&format!("chain {}", chain.chain))).skip(2).take(chain.hops.len()).collect();
    assert_eq!(rows.len(), chain.hops.len());
    for (row, id) in rows.iter().zip(&chain.hops) {
        let q = rep.requests.iter().find(|q| &q.id == id).unwrap();
        let peak = q.peak_gpu_mem_bytes.expect("every hop lies inside the sampled span");
        assert!(peak >= mib(0) && peak < mib(k), "{peak}");
        let shown: f64 = row.split_whitespace().last().unwrap().parse().unwrap();
        assert_eq!(shown, (peak >> 20) as f64, "{row}");
    }
}

#[test]
fn structured_report_equals_its_golden_json_byte_for_byte() {
    assert_matches_golden("structured");
}

/// `structured`: two JSON agents' first hops held for one grammar while a
/// plain agent goes past them. The engine's own stamps (its trimmed
/// `truth.jsonl`: queued, first scheduled, grammar ready) say who passed
/// whom and when the grammar was ready; the report must agree.
#[test]
fn structured_fixture_passes_and_grammar_readiness_agree_with_the_engines_truth() {
    let rep: Value = serde_json::from_str(&golden("structured")).unwrap();
    let truth: BTreeMap<String, Value> = std::fs::read_to_string(fixture("structured.truth.jsonl"))
        .expect("truth present")
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).expect("truth line is json"))
        .map(|v| (v["req"].as_str().expect("req").to_owned(), v))
        .collect();
    let ns = |v: &Value, k: &str| v[k].as_i64().unwrap_or_else(|| panic!("{k} in {v}"));
    let stamps: Vec<(i64, i64)> = truth.values().map(|t| (ns(t, "queued_ns"), ns(t, "scheduled_ns"))).collect();
    let (mut json, mut skipped, mut known) = (0, 0, 0);
    for r in rep["requests"].as_array().unwrap().iter().filter(|r| r["path"] == "/v1/chat/completions") {
        let id = r["id"].as_str().unwrap();
        let t = &truth[r["engine_request_id"].as_str().unwrap_or_else(|| panic!("{id}: engine joined"))];
        assert_eq!(r["structured_output"], t["structured_output"], "{id}");
        let (q, s) = (ns(t, "queued_ns"), ns(t, "scheduled_ns"));
        let passers: Vec<i64> = stamps.iter().filter(|(oq, os)| *oq > q && *os < s).map(|p| p.1).collect();
        assert_eq!(r["scheduler_passed_over_by"].as_u64(), Some(passers.len() as u64), "{id}: queued after it, scheduled before it");
        let want = passers.iter().max().map_or(0.0, |last| (last - q) as f64 / 1e6);
        let got = r["scheduler_passed_over_ms"].as_f64().unwrap_or_else(|| panic!("{id}: no pass span"));
        assert!((got - want).abs() < 0.01, "{id}: skipped for {got} ms, the truth's last pass {want} ms after it was queued");
        match t["grammar_ready_ns"].as_i64() {
            Some(ready) => {
                json += 1;
                skipped += usize::from(!passers.is_empty());
                let least = (ready - q).max(0) as f64 / 1e6;
                let sched = r["scheduler_queue_ms"].as_f64().expect("stamped");
                assert!(sched >= least - 1e-3, "{id}: scheduler queue {sched:.3} ms, its grammar took {least:.3} ms");
                if let Some(by) = r["scheduler_grammar_ready_ms"].as_f64() {
                    assert!(by >= least - 1e-3 && by <= sched + 1e-3, "{id}: known ready {by:.3} ms after QUEUED, the truth's {least:.3}, queue {sched:.3}");
                    known += 1;
                }
            }
            None => {
                assert!(passers.is_empty(), "{id}: FCFS lets nothing past a request it does not skip");
                assert!(r["scheduler_grammar_ready_ms"].is_null(), "{id}: no constraint");
            }
        }
    }
    // Kinds, never the schema (its field names are in every ADD and body).
    let bytes = std::fs::read(fixture("structured.hop")).unwrap();
    for field in ["next_step", "thought"] {
        assert!(!bytes.windows(field.len()).any(|w| w == field.as_bytes()), "the recording holds the schema's {field:?}");
    }
    assert_eq!(json, 2, "the two first hops asked for JSON");
    assert!(skipped >= 1 && known >= 1, "a JSON hop passed over ({skipped}) and one whose grammar is known ready ({known})");
}
