//! `hopscope export otlp` against a receiver built on the reference
//! opentelemetry-proto bindings: spans arrive with the right parents,
//! trace ids and GenAI attributes. The offline export uses the committed
//! replay fixtures (no root); `run --otlp` traces a real server (root).

use hopscope_integration::*;
use serde_json::Value;
use std::collections::HashMap;
use std::process::Command;
use std::time::{Duration, Instant};

fn export(fixture_name: &str) -> (Vec<Value>, Value) {
    let dir = scratch(&format!("otlp-{fixture_name}"));
    let (mut rx, port, out) = otlp_receiver(&dir);
    let hop = workspace().join("agent/tests/fixtures").join(format!("{fixture_name}.hop"));
    // The resource comes from the environment: none here, whatever the caller's.
    let res = Command::new(hopscope_bin())
        .args(["export", "otlp"])
        .arg(&hop)
        .args(["--endpoint", &format!("http://127.0.0.1:{port}")])
        .env_remove("OTEL_SERVICE_NAME")
        .env_remove("OTEL_RESOURCE_ATTRIBUTES")
        .output()
        .unwrap();
    rx.kill().unwrap();
    rx.wait().unwrap();
    assert!(res.status.success(), "{}", String::from_utf8_lossy(&res.stderr));
    (read_jsonl(&out), report_json(&hop))
}

fn attr(span: &Value, key: &str) -> Value {
    let a = &span["attributes"][key];
    a.get("stringValue").or(a.get("intValue")).or(a.get("doubleValue")).cloned().unwrap_or(Value::Null)
}

#[test]
fn every_request_becomes_a_server_span_with_one_child_per_phase_and_genai_attributes() {
    let (spans, report) = export("chain3");
    let reqs: Vec<&Value> = report["requests"].as_array().unwrap().iter().filter(|r| r["done_ns"].is_u64()).collect();
    let servers: Vec<&Value> = spans.iter().filter(|s| s["kind"] == 2).collect();
    assert_eq!(servers.len(), reqs.len(), "one SERVER span per finished request");
    // The readiness probe's answer has no id: its made-up name is no response id.
    let probe = servers.iter().find(|s| attr(s, "url.path") == "/health").expect("the probe's span");
    assert_eq!(attr(probe, "gen_ai.response.id"), Value::Null);
    let by_id: HashMap<&str, &Value> = servers.iter().map(|s| (s["span_id"].as_str().unwrap(), *s)).collect();
    for r in reqs.iter().filter(|r| r["path"] == "/v1/chat/completions") {
        let id = r["id"].as_str().unwrap();
        let s = servers.iter().find(|s| attr(s, "gen_ai.request.id") == *id).unwrap_or_else(|| panic!("no span for {id}"));
        assert_eq!(attr(s, "gen_ai.usage.prompt_tokens").as_str().map(|v| v.parse::<u64>().unwrap()), r["prompt_tokens"].as_u64());
        assert_eq!(attr(s, "gen_ai.usage.completion_tokens").as_str().map(|v| v.parse::<u64>().unwrap()), r["completion_tokens"].as_u64());
        // The current conventions' names for the same counts, and the finish reason.
        assert_eq!((attr(s, "gen_ai.usage.input_tokens"), attr(s, "gen_ai.usage.output_tokens")), (attr(s, "gen_ai.usage.prompt_tokens"), attr(s, "gen_ai.usage.completion_tokens")), "{id}");
        assert_eq!(attr(s, "gen_ai.usage.cache_read.input_tokens").as_str().map(|v| v.parse::<u64>().unwrap()), r["cached_tokens"].as_u64(), "{id}");
        assert_eq!(attr(s, "gen_ai.usage.cache_read.input_tokens"), attr(s, "hopscope.cached_tokens"), "{id}");
        let reasons: Vec<&str> = s["attributes"]["gen_ai.response.finish_reasons"]["arrayValue"]["values"].as_array().unwrap_or_else(|| panic!("{id}: no finish reasons in {s}")).iter().map(|v| v["stringValue"].as_str().unwrap()).collect();
        assert_eq!(reasons, [r["finish_reason"].as_str().unwrap()], "{id}");
        let ttft = attr(s, "gen_ai.latency.time_to_first_token").as_f64().unwrap();
        assert!((ttft * 1e3 - r["ttft_ms"].as_f64().unwrap()).abs() < 1e-6);
        assert!((attr(s, "gen_ai.latency.time_in_model_prefill").as_f64().unwrap() * 1e3 - r["phases_ms"]["prefill"].as_f64().unwrap()).abs() < 1e-6);
        assert!((attr(s, "hopscope.latency.last_output").as_f64().unwrap() * 1e3 - r["last_output_ms"].as_f64().unwrap()).abs() < 1e-6, "{id}");
        assert!((attr(s, "hopscope.latency.first_output_held").as_f64().unwrap() * 1e3 - r["first_output_held_ms"].as_f64().unwrap()).abs() < 1e-6, "{id}");
        assert_eq!(attr(s, "hopscope.tokens_before_first_content").as_str().map(|v| v.parse::<u64>().unwrap()), r["tokens_before_first_content"].as_u64(), "{id}");
        assert_eq!(attr(s, "hopscope.empty_chunks_before_content").as_str().map(|v| v.parse::<u64>().unwrap()), r["empty_chunks_before_content"].as_u64(), "{id}");
        assert!(r["empty_chunks_before_content"].is_u64(), "{id}: a chat stream");
        assert!((attr(s, "hopscope.latency.scheduler_queue").as_f64().unwrap() * 1e3 - r["scheduler_queue_ms"].as_f64().unwrap()).abs() < 1e-6, "{id}");
        assert_eq!(attr(s, "hopscope.hop").as_str(), Some(r["hop"].to_string().as_str()));
        // The GenAI conventions' operation and model, as the reference receiver decoded them.
        assert_eq!((attr(s, "gen_ai.operation.name"), attr(s, "gen_ai.request.model")), (Value::from("chat"), r["model"].clone()), "{id}");
        assert_eq!(r["model"], "hopscope-testbed");
        assert_eq!(attr(s, "gen_ai.response.id"), *id, "the id the server wrote back");
        let e2e_ns = s["end"].as_str().map_or_else(|| s["end"].as_u64().unwrap(), |v| v.parse().unwrap()) - s["start"].as_str().map_or_else(|| s["start"].as_u64().unwrap(), |v| v.parse().unwrap());
        assert!((e2e_ns as f64 / 1e6 - r["e2e_ms"].as_f64().unwrap()).abs() < 1e-3, "span length is e2e");
        let children: Vec<&Value> = spans.iter().filter(|c| c["parent_span_id"] == s["span_id"]).collect();
        let names: Vec<&str> = children.iter().map(|c| c["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["frontend", "queue", "prefill", "first_output", "decode"], "{id}");
        assert!(children.iter().all(|c| c["trace_id"] == s["trace_id"]));
        // The queue span holds the scheduler's part: its QUEUED stamp to scheduled.
        let queue = children[1];
        let inner: Vec<&Value> = spans.iter().filter(|c| c["parent_span_id"] == queue["span_id"]).collect();
        assert_eq!(inner.iter().map(|c| c["name"].as_str().unwrap()).collect::<Vec<_>>(), ["scheduler_queue"], "{id}");
        let ns = |s: &Value, k: &str| s[k].as_str().map_or_else(|| s[k].as_u64().unwrap(), |v| v.parse().unwrap());
        let len_ms = (ns(inner[0], "end") - ns(inner[0], "start")) as f64 / 1e6;
        assert!((len_ms - r["scheduler_queue_ms"].as_f64().unwrap()).abs() < 1e-3, "{id}: {len_ms} ms vs {}", r["scheduler_queue_ms"]);
        assert_eq!(ns(inner[0], "end"), ns(queue, "end"), "{id}: it ends with the queue");
    }
    // Hops of one chain share a trace (no traceparent here: derived from the chain key).
    let chat: Vec<&&Value> = servers.iter().filter(|s| attr(s, "url.path") == "/v1/chat/completions").collect();
    assert!(chat.windows(2).all(|w| w[0]["trace_id"] == w[1]["trace_id"]), "one trace per chain");
    let chain_spans: Vec<&str> = spans.iter().filter(|s| s["name"] == "chain").map(|s| s["span_id"].as_str().unwrap()).collect();
    assert!(chat.iter().all(|s| {
        let p = s["parent_span_id"].as_str().unwrap();
        p.is_empty() || by_id.contains_key(p) || chain_spans.contains(&p)
    }));
    // A session chain (keyed by x-session-id) is one span, its hops' parent,
    // from the first hop's arrival to the last one's end, saying the client's
    // time between them.
    for c in report["chains"].as_array().unwrap().iter().filter(|c| c["source"] == "header") {
        let key = c["chain"].as_str().unwrap();
        let spans_of_chain: Vec<&Value> = spans.iter().filter(|s| s["name"] == "chain" && attr(s, "hopscope.chain") == key).collect();
        assert_eq!(spans_of_chain.len(), 1, "{key}");
        let cs = spans_of_chain[0];
        assert_eq!(cs["kind"], 1);
        assert_eq!(cs["parent_span_id"], "");
        let hops: Vec<&&Value> = servers.iter().filter(|s| attr(s, "hopscope.chain") == key).collect();
        assert_eq!(hops.len(), c["hops"].as_array().unwrap().len(), "{key}");
        assert!(hops.iter().all(|h| h["parent_span_id"] == cs["span_id"] && h["trace_id"] == cs["trace_id"]), "{key}: hops are the chain span's children");
        let t = |s: &Value, k: &str| s[k].as_str().map_or_else(|| s[k].as_u64().unwrap(), |v| v.parse().unwrap());
        assert_eq!(t(cs, "start"), hops.iter().map(|h| t(h, "start")).min().unwrap());
        assert_eq!(t(cs, "end"), hops.iter().map(|h| t(h, "end")).max().unwrap());
        assert_eq!(attr(cs, "hopscope.chain.hops").as_str(), Some(hops.len().to_string().as_str()));
        let between = attr(cs, "hopscope.chain.between_hops").as_f64().unwrap();
        assert!((between * 1e3 - c["between_hops_ms"].as_f64().unwrap()).abs() < 1e-3, "{key}: {between} s vs the report's {}", c["between_hops_ms"]);
    }
    assert_eq!(servers[0]["resource"]["service.name"]["stringValue"], "hopscope");
}

#[test]
fn requests_with_traceparent_join_the_callers_trace() {
    let (spans, report) = export("tp_chunked");
    let mut joined = 0;
    for r in report["requests"].as_array().unwrap().iter().filter(|r| r["traceparent"].is_string()) {
        let tp = r["traceparent"].as_str().unwrap();
        let parts: Vec<&str> = tp.split('-').collect();
        let s = spans.iter().find(|s| s["kind"] == 2 && attr(s, "gen_ai.request.id") == r["id"]).unwrap();
        assert_eq!(s["trace_id"], parts[1], "the caller's trace id");
        assert_eq!(s["parent_span_id"], parts[2], "the caller's span is the parent");
        joined += 1;
    }
    assert!(joined >= 2, "the fixture's chains carry traceparent");
}

/// A hop slowed by another request's co-batched prefill says whose, as a
/// string array the reference bindings decode, beside the time it lost.
#[test]
fn a_slowed_requests_span_names_whose_prefill_slowed_it() {
    let (spans, report) = export("tp_chunked");
    let mut slowed = 0;
    for r in report["requests"].as_array().unwrap().iter().filter(|r| r["done_ns"].is_u64()) {
        let s = spans.iter().find(|s| s["kind"] == 2 && attr(s, "gen_ai.request.id") == r["id"]).unwrap();
        assert_eq!(attr(s, "hopscope.preemptions").as_str().map(|v| v.parse::<u64>().unwrap()), r["preemptions"].as_u64(), "{}", r["id"]);
        assert_eq!(attr(s, "hopscope.engine_index").as_str().map(|v| v.parse::<u64>().unwrap()), r["engine_index"].as_u64(), "{}", r["id"]);
        let from: Vec<&str> = r["interference_from"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
        let got: Vec<&str> = s["attributes"]["hopscope.interference_from"]["arrayValue"]["values"]
            .as_array()
            .map(|vs| vs.iter().map(|v| v["stringValue"].as_str().unwrap()).collect())
            .unwrap_or_default();
        assert_eq!(got, from, "{}", r["id"]);
        if !from.is_empty() {
            let lost = attr(s, "hopscope.latency.interference").as_f64().unwrap();
            assert!((lost * 1e3 - r["interference_ms"].as_f64().unwrap()).abs() < 1e-6);
            slowed += 1;
        }
    }
    assert_eq!(slowed, 1, "tp_chunked has one hop slowed by another's chunked prefill");
}

/// A span as the receiver wrote it, without what JSON spells two ways.
fn key(s: &Value) -> (String, String, String, String, String) {
    let t = |k: &str| s[k].as_str().map_or_else(|| s[k].to_string(), str::to_owned);
    (s["span_id"].as_str().unwrap().to_owned(), s["parent_span_id"].as_str().unwrap().to_owned(), s["trace_id"].as_str().unwrap().to_owned(), t("start"), t("end"))
}

/// `run --otlp` on a rotating recording: a session's request spans reach a
/// receiver built on the reference bindings while the server is still being
/// recorded, its chain span once the session has been idle for
/// `--otlp-chain-idle`, and what was sent live is exactly what `export otlp`
/// makes from the segments afterwards.
#[test]
fn run_with_otlp_sends_each_sessions_spans_while_recording_the_same_as_export() {
    let Some(_serial) = privileged("run_with_otlp_sends_each_sessions_spans_while_recording_the_same_as_export") else { return };
    let dir = scratch("otlp-live");
    let (mut rx, otlp_port, spans) = otlp_receiver(&dir);
    let url = format!("http://127.0.0.1:{otlp_port}");
    let port = free_port();
    let (py, server) = (python(), fixture("sse_server.py"));
    let hop = dir.join("run.hop");
    let mport = free_port().to_string();
    let args = ["run", "-o", hop.to_str().unwrap(), "--rotate-every", "2s", "--otlp", &url, "--otlp-chain-idle", "2s", "--metrics", &mport, "--", py.to_str().unwrap(), server.to_str().unwrap(), "--port", &port.to_string()];
    let agent = Agent::spawn(&args, &[]);
    agent.wait_line("hopscope: otlp: sending spans to", Duration::from_secs(60));
    wait_healthy(port, Duration::from_secs(30));
    let out = dir.join("client.jsonl");
    run_py("sse_client.py", &["--base", &format!("http://127.0.0.1:{port}"), "--out", out.to_str().unwrap(), "--sequential", "3", "--tokens", "10", "--session", "live-session", "--sdk", "raw"]);
    let ids: Vec<String> = read_jsonl(&out).iter().map(|c| c["id"].as_str().unwrap().to_owned()).collect();
    assert_eq!(ids.len(), 3);
    // Still recording: the hops' spans and then the session's arrive.
    let ended = Instant::now();
    let (mut hops_at, mut chain_at) = (None, None);
    while chain_at.is_none() && ended.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(100));
        let got = if spans.exists() { read_jsonl(&spans) } else { Vec::new() };
        if hops_at.is_none() && ids.iter().all(|id| got.iter().any(|s| s["kind"] == 2 && attr(s, "gen_ai.request.id") == *id.as_str())) {
            hops_at = Some(ended.elapsed());
        }
        if got.iter().any(|s| s["name"] == "chain" && attr(s, "hopscope.chain") == "live-session") {
            chain_at = Some(ended.elapsed());
        }
    }
    let (hops_at, chain_at) = (hops_at.expect("the hops' spans arrived while recording"), chain_at.expect("the session's span arrived while recording"));
    // Final ~2 s after the end (settle), sent at the next second's flush;
    // the session's span 2 s idle after that.
    assert!(hops_at < Duration::from_secs(8), "hop spans {hops_at:?} after the last hop ended");
    assert!(chain_at < Duration::from_secs(10), "chain span {chain_at:?} after the last hop ended");
    // The export's outcomes in /metrics (updated each second), read with
    // the reference parser.
    std::thread::sleep(Duration::from_millis(1500));
    let scraped: Value = serde_json::from_str(&run_py("scrape.py", &[&format!("http://127.0.0.1:{mport}/metrics")])).unwrap();
    let outcome = |o: &str| -> f64 {
        let fam = scraped["hopscope_otlp_spans"]["samples"].as_array().unwrap_or_else(|| panic!("no hopscope_otlp_spans family: {scraped}"));
        fam.iter().find(|s| s[1]["outcome"] == o).unwrap_or_else(|| panic!("no outcome {o}: {fam:?}"))[2].as_f64().unwrap()
    };
    assert!(outcome("sent") >= 4.0, "3 hops and the chain were sent: {}", scraped["hopscope_otlp_spans"]);
    assert_eq!((outcome("dropped"), outcome("failed")), (0.0, 0.0));
    // The phase histograms take the requests the export's correlator handed
    // out: this server speaks no engine IPC, so decode (from the wire) only.
    let phase_count = |fam: &str| -> f64 {
        scraped[fam]["samples"].as_array().unwrap_or_else(|| panic!("no family {fam}: {scraped}")).iter().filter(|s| s[0] == format!("{fam}_count")).map(|s| s[2].as_f64().unwrap()).sum()
    };
    assert_eq!(phase_count("hopscope_request_decode_time_seconds"), 3.0, "{}", scraped["hopscope_request_decode_time_seconds"]);
    assert_eq!(phase_count("hopscope_request_queue_time_seconds"), 0.0);
    // Scraped as Prometheus does (OpenMetrics, its strict reference parser):
    // the buckets' exemplars name traces the collector received spans in.
    let om: Value = serde_json::from_str(&run_py("scrape.py", &[&format!("http://127.0.0.1:{mport}/metrics"), "--openmetrics"])).unwrap();
    assert!(om["_content_type"].as_str().unwrap().starts_with("application/openmetrics-text"), "{}", om["_content_type"]);
    let exemplars: Vec<(String, f64)> = ["hopscope_time_to_first_token_seconds", "hopscope_e2e_request_latency_seconds", "hopscope_inter_token_latency_seconds", "hopscope_request_decode_time_seconds"]
        .iter()
        .flat_map(|f| om[*f]["samples"].as_array().unwrap_or_else(|| panic!("no family {f}: {om}")).clone())
        .filter(|s| !s[3].is_null())
        .map(|s| (s[3]["labels"]["trace_id"].as_str().unwrap().to_owned(), s[3]["timestamp"].as_f64().unwrap()))
        .collect();
    assert!(exemplars.len() >= 3, "exemplars on TTFT, E2E and ITL buckets: {om}");
    let received: std::collections::HashSet<String> = read_jsonl(&spans).iter().map(|s| s["trace_id"].as_str().unwrap().to_owned()).collect();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs_f64();
    for (trace, at) in &exemplars {
        assert!(received.contains(trace), "exemplar trace {trace} has no span at the collector (traces: {received:?})");
        assert!(at <= &now && now - at < 120.0, "exemplar time {at} is not this recording's (now {now})");
    }
    let (_, err) = agent.stop();
    let live = read_jsonl(&spans);
    let closing = err.lines().find(|l| l.starts_with("hopscope: otlp: ") && l.contains(" spans of ")).unwrap_or_else(|| panic!("no closing otlp line: {err}"));
    assert!(closing.starts_with(&format!("hopscope: otlp: {} spans of ", live.len())), "{closing} (received {})", live.len());

    // `export otlp` of the segments, to a second receiver.
    let segs: Vec<std::path::PathBuf> = {
        let mut v: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.file_name().unwrap().to_str().unwrap().starts_with("run-")).collect();
        v.sort();
        v
    };
    assert!(segs.len() >= 2, "rotated: {segs:?}");
    rx.kill().unwrap();
    rx.wait().unwrap();
    let dir2 = dir.join("offline");
    std::fs::create_dir_all(&dir2).unwrap();
    let (mut rx2, port2, spans2) = otlp_receiver(&dir2);
    let res = Command::new(hopscope_bin()).args(["export", "otlp"]).args(&segs).args(["--endpoint", &format!("http://127.0.0.1:{port2}")]).output().unwrap();
    assert!(res.status.success(), "{}", String::from_utf8_lossy(&res.stderr));
    rx2.kill().unwrap();
    rx2.wait().unwrap();
    let offline = read_jsonl(&spans2);
    let mut a: Vec<_> = live.iter().map(key).collect();
    let mut b: Vec<_> = offline.iter().map(key).collect();
    a.sort();
    b.sort();
    assert_eq!(a, b, "the spans sent live are export otlp's");
    let same_attrs = live.iter().all(|l| offline.iter().any(|o| o["span_id"] == l["span_id"] && o["attributes"] == l["attributes"] && o["name"] == l["name"]));
    assert!(same_attrs, "names and attributes match too");
}

/// A collector that is not there never stops the recording: the recording
/// is whole, and the stop says in one line how many spans did not go and
/// which command sends them.
#[test]
fn an_absent_collector_leaves_a_whole_recording_and_says_how_to_send_the_spans() {
    let Some(_serial) = privileged("an_absent_collector_leaves_a_whole_recording_and_says_how_to_send_the_spans") else { return };
    let dir = scratch("otlp-absent");
    let closed = free_port();
    let port = free_port();
    let (py, server) = (python(), fixture("sse_server.py"));
    let hop = dir.join("run.hop");
    let url = format!("http://127.0.0.1:{closed}");
    let args = ["run", "-o", hop.to_str().unwrap(), "--otlp", &url, "--", py.to_str().unwrap(), server.to_str().unwrap(), "--port", &port.to_string()];
    let agent = Agent::spawn(&args, &[]);
    wait_healthy(port, Duration::from_secs(60));
    let out = dir.join("client.jsonl");
    run_py("sse_client.py", &["--base", &format!("http://127.0.0.1:{port}"), "--out", out.to_str().unwrap(), "--sequential", "3", "--tokens", "10", "--sdk", "raw"]);
    agent.wait_line("hopscope: note: otlp: cannot reach", Duration::from_secs(20));
    agent.signal(libc::SIGINT);
    let stopping = Instant::now();
    let (st, _, err) = agent.wait(Duration::from_secs(60));
    assert!(stopping.elapsed() < Duration::from_secs(20), "the stop waited {:?} on the collector", stopping.elapsed());
    assert!(!st.success(), "spans were lost: not a clean exit\n{err}");
    let last = err.trim().lines().last().unwrap();
    assert!(last.contains("did not reach") && last.contains(&format!("hopscope export otlp {} --endpoint {url}", hop.display())), "{err}");
    let rep = report_json(&hop);
    let ids: Vec<String> = read_jsonl(&out).iter().map(|c| c["id"].as_str().unwrap().to_owned()).collect();
    for id in &ids {
        let r = rep["requests"].as_array().unwrap().iter().find(|r| r["id"] == *id.as_str()).unwrap_or_else(|| panic!("{id} recorded"));
        assert!(r["e2e_ms"].is_number(), "{id} whole");
    }
}

/// The OpenTelemetry exporters' standard environment: the endpoint from
/// OTEL_EXPORTER_OTLP_ENDPOINT (`/v1/traces` appended), the resource from
/// OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, as a receiver built on
/// the reference bindings decodes them; without an endpoint anywhere, one line.
#[test]
fn export_takes_the_standard_otel_environment_for_endpoint_and_resource() {
    let dir = scratch("otlp-env");
    let (mut rx, port, out) = otlp_receiver(&dir);
    let hop = workspace().join("agent/tests/fixtures/chain3.hop");
    let res = Command::new(hopscope_bin())
        .args(["export", "otlp"])
        .arg(&hop)
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://127.0.0.1:{port}/"))
        .env("OTEL_SERVICE_NAME", "llm-gateway")
        .env("OTEL_RESOURCE_ATTRIBUTES", "k8s.pod.name=vllm-0,deployment.environment=prod%2Ceu")
        .output()
        .unwrap();
    rx.kill().unwrap();
    rx.wait().unwrap();
    assert!(res.status.success(), "{}", String::from_utf8_lossy(&res.stderr));
    let spans = read_jsonl(&out);
    assert!(!spans.is_empty());
    for s in &spans {
        let r = &s["resource"];
        assert_eq!(r["service.name"]["stringValue"], "llm-gateway");
        assert_eq!(r["k8s.pod.name"]["stringValue"], "vllm-0");
        assert_eq!(r["deployment.environment"]["stringValue"], "prod,eu");
        assert!(r["hopscope.version"]["stringValue"].is_string() && r["host.name"]["stringValue"].is_string(), "{r}");
    }
    let none = Command::new(hopscope_bin()).args(["export", "otlp"]).arg(&hop).env_remove("OTEL_EXPORTER_OTLP_ENDPOINT").env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").output().unwrap();
    assert!(!none.status.success());
    let err = String::from_utf8_lossy(&none.stderr);
    assert!(err.contains("no otlp endpoint") && err.contains("OTEL_EXPORTER_OTLP_ENDPOINT"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
}

/// The `structured` fixture's JSON hops, held for their grammar while a
/// plain agent went past: their spans carry how long the scheduler skipped
/// them and when their grammar was known ready, and the skipped part is a
/// span of its own inside the scheduler's queue, as in the Perfetto trace.
#[test]
fn a_skipped_request_has_a_passed_over_span_inside_its_scheduler_queue_span() {
    let (spans, report) = export("structured");
    let ns = |s: &Value, k: &str| s[k].as_str().map_or_else(|| s[k].as_u64().unwrap(), |v| v.parse().unwrap());
    let close = |secs: &Value, ms: &Value| match (secs.as_f64(), ms.as_f64()) {
        (Some(s), Some(m)) => (s * 1e3 - m).abs() < 1e-6,
        (None, None) => true,
        _ => false,
    };
    let mut drawn = 0;
    for r in report["requests"].as_array().unwrap().iter().filter(|r| r["path"] == "/v1/chat/completions") {
        let id = r["id"].as_str().unwrap();
        let s = spans.iter().find(|s| s["kind"] == 2 && attr(s, "gen_ai.request.id") == *id).unwrap_or_else(|| panic!("no span for {id}"));
        assert!(close(&attr(s, "hopscope.latency.scheduler_passed_over"), &r["scheduler_passed_over_ms"]), "{id}: {} vs {}", attr(s, "hopscope.latency.scheduler_passed_over"), r["scheduler_passed_over_ms"]);
        assert!(close(&attr(s, "hopscope.latency.scheduler_grammar_ready"), &r["scheduler_grammar_ready_ms"]), "{id}: {} vs {}", attr(s, "hopscope.latency.scheduler_grammar_ready"), r["scheduler_grammar_ready_ms"]);
        let child = |parent: &Value, name: &str| spans.iter().find(|c| c["parent_span_id"] == parent["span_id"] && c["name"] == name).cloned();
        let queue = child(s, "queue").unwrap_or_else(|| panic!("{id}: a queue span"));
        let sched = child(&queue, "scheduler_queue").unwrap_or_else(|| panic!("{id}: a scheduler_queue span"));
        let inside: Vec<&Value> = spans.iter().filter(|c| c["parent_span_id"] == sched["span_id"]).collect();
        let skipped_ms = r["scheduler_passed_over_ms"].as_f64().unwrap();
        if skipped_ms > 0.0 {
            assert_eq!(inside.len(), 1, "{id}: one span inside the scheduler's queue");
            let p = inside[0];
            assert_eq!((p["name"].as_str(), p["kind"].as_u64()), (Some("scheduler_passed_over"), Some(1)), "{id}");
            assert_eq!(ns(p, "start"), ns(&sched, "start"), "{id}: it begins with the scheduler's queue");
            let len_ms = (ns(p, "end") - ns(p, "start")) as f64 / 1e6;
            assert!((len_ms - skipped_ms).abs() < 1e-3, "{id}: {len_ms} ms vs the report's {skipped_ms}");
            assert_eq!(attr(p, "hopscope.scheduler_passed_over_by").as_str(), Some(r["scheduler_passed_over_by"].to_string().as_str()), "{id}");
            drawn += 1;
        } else {
            assert!(inside.is_empty(), "{id}: nobody went past it: {inside:?}");
        }
    }
    assert!(drawn >= 1, "the fixture has a JSON hop the plain agent went past");
}
