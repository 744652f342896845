//! OTLP/HTTP protobuf export of per-request spans (`hopscope export otlp`,
//! `record --otlp`).
//!
//! One SERVER span per HTTP request, with a child span per phase of the
//! partition. A request that carried a W3C `traceparent` joins the caller's
//! trace (same trace id, parent = the caller's span); others get a trace id
//! derived from their chain key, so a chain's hops share one trace.
//! Attributes follow the OpenTelemetry GenAI conventions and vLLM's span
//! names (`gen_ai.latency.*`), plus hopscope's own (`hopscope.*`).
//!
//! The message subset is written by hand with prost; field numbers are those
//! of opentelemetry-proto (`opentelemetry/proto/trace/v1/trace.proto`,
//! `common/v1/common.proto`, `collector/trace/v1/trace_service.proto`), and the
//! test decodes our bytes with the reference Python bindings.
//!
//! [`live`] sends the same spans while recording (`record --otlp`).

pub mod live;

use crate::correlate::engine::{marks, passed_over_span, scheduler_queue_span};
use crate::correlate::{Analysis, ChainSource, Config, Request};
use crate::recording::{Meta, Reader};
use crate::sink::report::{request_figures, stream_requests, Phases, RequestRef};
use crate::sink::summary::GpuMemIndex;
use prost::Message;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

#[derive(Clone, PartialEq, Message)]
pub struct ExportTraceServiceRequest {
    #[prost(message, repeated, tag = "1")]
    pub resource_spans: Vec<ResourceSpans>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ResourceSpans {
    #[prost(message, optional, tag = "1")]
    pub resource: Option<Resource>,
    #[prost(message, repeated, tag = "2")]
    pub scope_spans: Vec<ScopeSpans>,
}

#[derive(Clone, PartialEq, Message)]
pub struct Resource {
    #[prost(message, repeated, tag = "1")]
    pub attributes: Vec<KeyValue>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ScopeSpans {
    #[prost(message, optional, tag = "1")]
    pub scope: Option<InstrumentationScope>,
    #[prost(message, repeated, tag = "2")]
    pub spans: Vec<Span>,
}

#[derive(Clone, PartialEq, Message)]
pub struct InstrumentationScope {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub version: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct Span {
    #[prost(bytes = "vec", tag = "1")]
    pub trace_id: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub span_id: Vec<u8>,
    #[prost(bytes = "vec", tag = "4")]
    pub parent_span_id: Vec<u8>,
    #[prost(string, tag = "5")]
    pub name: String,
    /// SPAN_KIND_INTERNAL = 1, SPAN_KIND_SERVER = 2.
    #[prost(int32, tag = "6")]
    pub kind: i32,
    #[prost(fixed64, tag = "7")]
    pub start_time_unix_nano: u64,
    #[prost(fixed64, tag = "8")]
    pub end_time_unix_nano: u64,
    #[prost(message, repeated, tag = "9")]
    pub attributes: Vec<KeyValue>,
}

#[derive(Clone, PartialEq, Message)]
pub struct KeyValue {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(message, optional, tag = "2")]
    pub value: Option<AnyValue>,
}

#[derive(Clone, PartialEq, Message)]
pub struct AnyValue {
    #[prost(oneof = "Value", tags = "1, 2, 3, 4, 5")]
    pub value: Option<Value>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ArrayValue {
    #[prost(message, repeated, tag = "1")]
    pub values: Vec<AnyValue>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Value {
    #[prost(string, tag = "1")]
    Str(String),
    #[prost(bool, tag = "2")]
    Bool(bool),
    #[prost(int64, tag = "3")]
    Int(i64),
    #[prost(double, tag = "4")]
    Double(f64),
    #[prost(message, tag = "5")]
    Array(ArrayValue),
}

fn kv(key: &str, v: Value) -> KeyValue {
    KeyValue { key: key.to_owned(), value: Some(AnyValue { value: Some(v) }) }
}

fn s(key: &str, v: &str) -> KeyValue {
    kv(key, Value::Str(v.to_owned()))
}

#[derive(Debug, thiserror::Error)]
pub enum OtlpError {
    #[error("invalid otlp endpoint {0:?}: expected http://HOST:PORT[/path] (https is not supported; use a local collector)")]
    Endpoint(String),
    #[error("cannot reach the otlp endpoint {endpoint}")]
    Connect { endpoint: String, source: std::io::Error },
    #[error("otlp endpoint {endpoint} answered {status}")]
    Status { endpoint: String, status: String },
    #[error("export stopped after {sent} spans ({posts} messages) were accepted: {source}; the collector has the requests before that point")]
    Partial { sent: usize, posts: usize, source: Box<OtlpError> },
}

/// FNV-1a, 64 bit: stable ids from strings (no randomness: the same recording
/// always exports the same ids).
fn fnv(data: &[u8], seed: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for b in data {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn hex_bytes(s: &str) -> Option<Vec<u8>> {
    s.len().is_multiple_of(2).then_some(())?;
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect()
}

/// The caller's span, parent of a request whose chain key came from its
/// valid `traceparent`.
fn caller_span(r: &Request) -> Option<Vec<u8>> {
    hex_bytes(r.traceparent.as_deref()?.trim().split('-').nth(2)?)
}

/// Builds the whole export of an analysis at once (what [`export_streamed`]
/// sends in batches), attributes from the report's figures.
pub fn build(meta: &Meta, analysis: &Analysis, gpu_mem: &GpuMemIndex) -> ExportTraceServiceRequest {
    let (mut itl, mut sorted, mut spans) = (Vec::new(), Vec::new(), Vec::new());
    let mut chains = ChainSpans::default();
    for r in &analysis.requests {
        spans_of(meta, r, &request_figures(r, &mut itl, &mut sorted, gpu_mem), &mut spans);
        chains.note(r);
    }
    chains.finish(meta, &mut spans);
    wrap(&resource(meta), meta, spans)
}

/// The span a session chain (a chain keyed by the chain header) gets: its
/// hops' parent, from its first hop's arrival to its last hop's end, so a
/// session reads as one tree with the client's time between the hops in it.
/// Chains keyed by `traceparent` already sit in the caller's trace; those
/// keyed by a connection are not sessions anyone named.
#[derive(Default)]
struct ChainSpans {
    /// (first arrival, last end, hops, the hops' E2E added up) per chain key.
    open: crate::correlate::FxMap<String, (u64, u64, u32, u64)>,
}

/// Span id of a session chain's span (see [`ChainSpans`]).
fn chain_span_id(chain: &str) -> Vec<u8> {
    fnv(chain.as_bytes(), 4).to_be_bytes().to_vec()
}

/// Trace id of a request without a valid `traceparent`: its chain's.
fn chain_trace_id(chain: &str) -> [u8; 16] {
    let mut id = [0u8; 16];
    id[..8].copy_from_slice(&fnv(chain.as_bytes(), 1).to_be_bytes());
    id[8..].copy_from_slice(&fnv(chain.as_bytes(), 2).to_be_bytes());
    id
}

/// The trace a request's spans go to, from its chain key
/// ([`crate::correlate::chain_key`]): a key taken from a valid `traceparent`
/// is the caller's trace id, any other key names its chain's trace.
/// `record --metrics` names it in its exemplars, so a histogram bucket leads
/// to the spans.
pub fn request_trace_id(chain: &str, source: ChainSource) -> [u8; 16] {
    let caller = (source == ChainSource::Traceparent).then(|| hex_bytes(chain).and_then(|b| <[u8; 16]>::try_from(b).ok())).flatten();
    caller.unwrap_or_else(|| chain_trace_id(chain))
}

impl ChainSpans {
    /// A request whose spans were made ([`spans_of`]: it has an end).
    fn note(&mut self, r: &Request) {
        let Some(done) = r.waited_until_ns().filter(|_| r.chain_source == ChainSource::Header) else { return };
        let e = self.open.entry(r.chain.clone()).or_insert((r.arrive_ns, done, 0, 0));
        e.0 = e.0.min(r.arrive_ns);
        e.1 = e.1.max(done);
        e.2 += 1;
        e.3 += done.saturating_sub(r.arrive_ns);
    }

    /// Whether `chain` has hops noted whose span is not made yet.
    fn is_open(&self, chain: &str) -> bool {
        self.open.contains_key(chain)
    }

    /// The spans of the chains whose last hop ended at or before `cutoff`
    /// and that `held` does not name (a hop of theirs may still come), in
    /// the report's chain order; those chains are forgotten.
    fn take_idle(&mut self, meta: &Meta, cutoff: u64, held: &crate::correlate::FxMap<&str, ()>, spans: &mut Vec<Span>) {
        let idle: Vec<String> = self.open.iter().filter(|(k, v)| v.1 <= cutoff && !held.contains_key(k.as_str())).map(|(k, _)| k.clone()).collect();
        if idle.is_empty() {
            return;
        }
        let mut taken = ChainSpans::default();
        for k in idle {
            if let Some(v) = self.open.remove(&k) {
                taken.open.insert(k, v);
            }
        }
        taken.finish(meta, spans);
    }

    /// The chains' spans, in the report's chain order (first arrival, then key).
    fn finish(self, meta: &Meta, spans: &mut Vec<Span>) {
        let offset = unix_offset(meta);
        let unix = |mono: u64| (mono as i128 + offset).max(0) as u64;
        let mut chains: Vec<(String, (u64, u64, u32, u64))> = self.open.into_iter().collect();
        chains.sort_by(|a, b| (a.1 .0, &a.0).cmp(&(b.1 .0, &b.0)));
        for (chain, (first, last, hops, hops_ns)) in chains {
            let between = (last - first) as f64 / 1e9 - hops_ns as f64 / 1e9;
            spans.push(Span {
                trace_id: chain_trace_id(&chain).to_vec(),
                span_id: chain_span_id(&chain),
                parent_span_id: Vec::new(),
                name: "chain".into(),
                kind: 1,
                start_time_unix_nano: unix(first),
                end_time_unix_nano: unix(last),
                attributes: vec![s("hopscope.chain", &chain), kv("hopscope.chain.hops", Value::Int(i64::from(hops))), kv("hopscope.chain.between_hops", Value::Double(between))],
            });
        }
    }
}

/// CLOCK_MONOTONIC → Unix time: the offset stamped when recording began.
fn unix_offset(meta: &Meta) -> i128 {
    let start_unix = if meta.start_unix_ns > 0 { meta.start_unix_ns } else { meta.created_unix_s.saturating_mul(1_000_000_000) };
    start_unix as i128 - meta.start_ns as i128
}

/// `gen_ai.operation.name` of an OpenAI-compatible path (query string aside).
fn operation_name(path: &str) -> Option<&'static str> {
    match path.split('?').next().unwrap_or(path).trim_end_matches('/') {
        // The Responses API and Anthropic's Messages API are chat APIs too
        // (the conventions' `chat`: "chat completion operation such as
        // OpenAI Chat API").
        "/v1/chat/completions" | "/v1/responses" | "/v1/messages" => Some("chat"),
        "/v1/completions" => Some("text_completion"),
        "/v1/embeddings" => Some("embeddings"),
        _ => None,
    }
}

/// The spans of one request (none while it has no end): its SERVER span
/// and, when the engine was joined, one child per phase. A request whose
/// connection closed before its response ended ends at the close, marked
/// `hopscope.closed_early` (its client gave up: a timeout shows as such).
pub fn spans_of(meta: &Meta, r: &Request, q: &RequestRef, spans: &mut Vec<Span>) {
    let offset = unix_offset(meta);
    let unix = |mono: u64| (mono as i128 + offset).max(0) as u64;
    let Some(done) = r.waited_until_ns() else { return };
    // A session chain's hops are children of its span ([`ChainSpans`]).
    let trace_id = request_trace_id(&r.chain, r.chain_source).to_vec();
    let parent = match r.chain_source {
        ChainSource::Traceparent => caller_span(r).unwrap_or_default(),
        ChainSource::Header => chain_span_id(&r.chain),
        ChainSource::Connection => Vec::new(),
    };
    let span_id = fnv(format!("{}/{}/{}/{}", r.id, r.conn.tgid, r.conn.ino, r.seq).as_bytes(), 3).to_be_bytes().to_vec();
    let mut attrs = vec![
        s("gen_ai.request.id", &r.id),
        s("http.request.method", &r.method),
        s("url.path", &r.path),
        s("hopscope.chain", &r.chain),
        kv("hopscope.hop", Value::Int(r.hop as i64)),
        kv("process.pid", Value::Int(r.conn.tgid as i64)),
    ];
    if let Some(st) = r.status {
        attrs.push(kv("http.response.status_code", Value::Int(st as i64)));
    }
    // The GenAI conventions' operation and model: what a trace backend
    // groups LLM calls by.
    if let Some(op) = operation_name(&r.path) {
        attrs.push(s("gen_ai.operation.name", op));
    }
    if let Some(m) = &r.model {
        attrs.push(s("gen_ai.request.model", m));
    }
    // The id the client got back (`chatcmpl-…`, `resp_…`), when the server
    // wrote one: not an id made up from `x-request-id` or the connection.
    if r.id_from_response {
        attrs.push(s("gen_ai.response.id", &r.id));
    }
    // The conventions' finish reasons: one per choice; the first one's is known.
    if let Some(f) = &r.finish_reason {
        attrs.push(kv("gen_ai.response.finish_reasons", Value::Array(ArrayValue { values: vec![AnyValue { value: Some(Value::Str(f.clone())) }] })));
    }
    if q.closed_ns.is_some() {
        attrs.push(kv("hopscope.closed_early", Value::Bool(true)));
    }
    // The constraint its output was held to (the kind, never the schema);
    // a JSON one is the conventions' `gen_ai.output.type` "json".
    if let Some(kind) = q.structured_output {
        attrs.push(s("hopscope.structured_output", kind));
        if matches!(kind, "json" | "json_object") {
            attrs.push(s("gen_ai.output.type", "json"));
        }
    }
    if let Some(b) = q.structured_output_backend {
        attrs.push(s("hopscope.structured_output.backend", b));
    }
    let mut int = |k: &str, v: Option<u64>| {
        if let Some(v) = v {
            attrs.push(kv(k, Value::Int(v as i64)));
        }
    };
    int("gen_ai.usage.prompt_tokens", q.prompt_tokens);
    int("gen_ai.usage.completion_tokens", q.completion_tokens);
    // The same counts under the conventions' current names (what trace
    // backends' LLM views read); vLLM's own spans keep the older ones above.
    int("gen_ai.usage.input_tokens", q.prompt_tokens);
    int("gen_ai.usage.output_tokens", q.completion_tokens);
    int("hopscope.cached_tokens", q.cached_tokens);
    // The conventions' name for them: input tokens served from the
    // provider's cache (vLLM's prefix cache), part of the input tokens.
    int("gen_ai.usage.cache_read.input_tokens", q.cached_tokens);
    int("hopscope.steps", q.steps);
    int("hopscope.preemptions", q.preemptions.map(u64::from));
    int("hopscope.scheduler_passed_over_by", q.scheduler_passed_over_by.map(u64::from));
    int("hopscope.engine_index", q.engine_index);
    int("hopscope.tokens_before_first_content", q.tokens_before_first_content);
    int("hopscope.empty_chunks_before_content", q.empty_chunks_before_content.map(u64::from));
    int("hopscope.peak_gpu_mem_bytes", q.peak_gpu_mem_bytes);
    // Signed: vLLM's priorities may be negative.
    if let Some(p) = q.priority {
        attrs.push(kv("hopscope.priority", Value::Int(p)));
    }
    // Whose co-batched prefill took this request's decode time (the
    // report's `interference_from`): request ids, as the hop table names them.
    if !q.interference_from.is_empty() {
        let ids = q.interference_from.iter().map(|id| AnyValue { value: Some(Value::Str(id.to_string())) }).collect();
        attrs.push(kv("hopscope.interference_from", Value::Array(ArrayValue { values: ids })));
    }
    let secs = |ms: Option<f64>| ms.map(|m| Value::Double(m / 1e3));
    let p: &Phases = &q.phases_ms;
    for (k, v) in [
        ("gen_ai.latency.time_to_first_token", secs(q.ttft_ms)),
        ("gen_ai.latency.e2e", secs(q.e2e_ms)),
        ("gen_ai.latency.time_in_queue", secs(p.queue)),
        ("gen_ai.latency.time_in_model_prefill", secs(p.prefill)),
        ("gen_ai.latency.time_in_model_decode", secs(p.decode)),
        ("hopscope.latency.frontend", secs(p.frontend)),
        ("hopscope.latency.first_output", secs(p.first_output)),
        ("hopscope.latency.kv_transfer", secs(p.kv_transfer)),
        ("hopscope.latency.interference", secs(q.interference_ms)),
        ("hopscope.latency.read_delay", secs(q.read_delay_ms)),
        ("hopscope.latency.last_output", secs(q.last_output_ms)),
        ("hopscope.latency.first_output_held", secs(q.first_output_held_ms)),
        ("hopscope.latency.scheduler_queue", secs(q.scheduler_queue_ms)),
        ("hopscope.latency.scheduler_passed_over", secs(q.scheduler_passed_over_ms)),
        ("hopscope.latency.scheduler_grammar_ready", secs(q.scheduler_grammar_ready_ms)),
        ("hopscope.gpu.prefill", secs(q.gpu_ms.prefill)),
        ("hopscope.gpu.decode", secs(q.gpu_ms.decode)),
        ("hopscope.gpu.kv_transfer", secs(q.gpu_ms.kv_transfer)),
    ] {
        if let Some(v) = v {
            attrs.push(kv(k, v));
        }
    }
    // The kernels behind its GPU time (the report's `kernels`): names and
    // seconds in two arrays of the same order, most first.
    if let Some(ks) = q.kernels.filter(|k| !k.is_empty()) {
        let names = ks.iter().map(|k| AnyValue { value: Some(Value::Str(k.name.to_string())) }).collect();
        let times = ks.iter().map(|k| AnyValue { value: Some(Value::Double(k.gpu_ns as f64 / 1e9)) }).collect();
        attrs.push(kv("hopscope.gpu.kernels", Value::Array(ArrayValue { values: names })));
        attrs.push(kv("hopscope.gpu.kernel_seconds", Value::Array(ArrayValue { values: times })));
    }
    spans.push(Span {
        trace_id: trace_id.clone(),
        span_id: span_id.clone(),
        parent_span_id: parent,
        name: format!("{} {}", r.method, r.path),
        kind: 2,
        start_time_unix_nano: unix(r.arrive_ns),
        end_time_unix_nano: unix(done),
        attributes: attrs,
    });
    // Child spans: the partition's phases, when the engine was joined.
    if let Some(m) = marks(r) {
        let first = m.first_token.unwrap_or(m.scheduled);
        let ttft = m.ttft.unwrap_or(first);
        let phases = [("frontend", m.arrive, m.submit), ("queue", m.submit, m.scheduled), ("prefill", m.scheduled, first), ("first_output", first, ttft), ("decode", ttft, m.done)];
        for (k, (name, a, b)) in phases.into_iter().enumerate() {
            if b <= a {
                continue;
            }
            let phase_id = fnv(&span_id, 10 + k as u64).to_be_bytes().to_vec();
            spans.push(Span {
                trace_id: trace_id.clone(),
                span_id: phase_id.clone(),
                parent_span_id: span_id.clone(),
                name: name.to_owned(),
                kind: 1,
                start_time_unix_nano: unix(a),
                end_time_unix_nano: unix(b),
                attributes: vec![s("hopscope.phase", name)],
            });
            // Inside the queue: the engine scheduler's own part (not a phase).
            if let Some((qa, qb)) = (name == "queue").then(|| scheduler_queue_span(r)).flatten().filter(|(qa, qb)| qb > qa) {
                let sched_id = fnv(&span_id, 20).to_be_bytes().to_vec();
                spans.push(Span {
                    trace_id: trace_id.clone(),
                    span_id: sched_id.clone(),
                    parent_span_id: phase_id,
                    name: "scheduler_queue".to_owned(),
                    kind: 1,
                    start_time_unix_nano: unix(qa),
                    end_time_unix_nano: unix(qb),
                    attributes: Vec::new(),
                });
                // Inside it, the part later requests went past this one
                // (the trace's "passed over" slice).
                let passed = r.engine.as_ref().and_then(|e| Some((passed_over_span(e, (qa, qb))?, e.passed_over_by?)));
                if let Some(((pa, pb), by)) = passed {
                    spans.push(Span {
                        trace_id: trace_id.clone(),
                        span_id: fnv(&span_id, 21).to_be_bytes().to_vec(),
                        parent_span_id: sched_id,
                        name: "scheduler_passed_over".to_owned(),
                        kind: 1,
                        start_time_unix_nano: unix(pa),
                        end_time_unix_nano: unix(pb),
                        attributes: vec![kv("hopscope.scheduler_passed_over_by", Value::Int(i64::from(by)))],
                    });
                }
            }
        }
    }
}

/// One export message of `spans`, under `resource` ([`resource`]).
pub fn wrap(resource: &Resource, meta: &Meta, spans: Vec<Span>) -> ExportTraceServiceRequest {
    ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(resource.clone()),
            scope_spans: vec![ScopeSpans {
                scope: Some(InstrumentationScope { name: "hopscope".into(), version: meta.hopscope_version.clone() }),
                spans,
            }],
        }],
    }
}

/// The resource every message carries, read from the environment as
/// OpenTelemetry SDKs read it: `service.name` is `OTEL_SERVICE_NAME`, else
/// the `service.name` of `OTEL_RESOURCE_ATTRIBUTES`, else `hopscope`;
/// `host.name` the recording's host unless the attributes name one;
/// `hopscope.version`; then the other `OTEL_RESOURCE_ATTRIBUTES` pairs
/// (e.g. `k8s.pod.name=…,deployment.environment=prod`).
pub fn resource(meta: &Meta) -> Resource {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    resource_from(meta, var("OTEL_SERVICE_NAME").as_deref(), var("OTEL_RESOURCE_ATTRIBUTES").as_deref())
}

fn resource_from(meta: &Meta, service: Option<&str>, attrs: Option<&str>) -> Resource {
    // `key=value,…`, values percent-encoded (the spec's W3C Baggage octets);
    // a later key replaces an earlier one.
    let mut pairs: Vec<(String, String)> = Vec::new();
    for pair in attrs.unwrap_or_default().split(',') {
        let Some((k, v)) = pair.split_once('=') else { continue };
        let (k, v) = (k.trim(), percent_decode(v.trim()));
        if k.is_empty() {
            continue;
        }
        match pairs.iter_mut().find(|(pk, _)| pk == k) {
            Some(p) => p.1 = v,
            None => pairs.push((k.to_owned(), v)),
        }
    }
    let mut take = |key: &str| pairs.iter().position(|(k, _)| k == key).map(|i| pairs.remove(i).1);
    let service = service.map(str::to_owned).or_else(|| take("service.name")).unwrap_or_else(|| "hopscope".into());
    let _ = take("service.name");
    let host = take("host.name").unwrap_or_else(|| meta.hostname.clone());
    let _ = take("hopscope.version");
    let mut attributes = vec![s("service.name", &service), s("host.name", &host), s("hopscope.version", &meta.hopscope_version)];
    attributes.extend(pairs.iter().map(|(k, v)| s(k, v)));
    Resource { attributes }
}

/// `%XX` sequences decoded; anything else (an invalid one included) kept.
fn percent_decode(v: &str) -> String {
    let b = v.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (b[i], b.get(i + 1).copied().and_then(hex), b.get(i + 2).copied().and_then(hex)) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Spans per message of a streamed export: about half a KiB each, so ~2 MiB
/// messages, under collectors' default limits (the OpenTelemetry
/// Collector's OTLP/HTTP receiver takes 20 MiB, gRPC ones 4 MiB).
pub const BATCH_SPANS: usize = 4096;

/// What a streamed export sent.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Exported {
    pub spans: usize,
    pub requests: usize,
    pub posts: usize,
}

/// `hopscope export otlp`: reads the recording once, takes each request's
/// spans as it becomes final (report order, as [`build`] over the whole
/// analysis gives them) and POSTs every `batch` spans, so memory follows
/// the open requests and one message, not the recording, and a collector
/// never gets one message the size of the run. Returns what was sent and
/// the error that stopped the read early, if any (the export covers what
/// precedes it).
pub fn export_streamed<R: Read>(reader: &mut Reader<R>, cfg: Config, endpoint: &str, batch: usize) -> Result<(Exported, Option<String>), OtlpError> {
    let meta = reader.meta().clone();
    let res = resource(&meta);
    let mut spans: Vec<Span> = Vec::new();
    let mut done = Exported::default();
    let flush = |spans: &mut Vec<Span>, done: &mut Exported| -> Result<(), OtlpError> {
        if spans.is_empty() {
            return Ok(());
        }
        let n = send(endpoint, &wrap(&res, &meta, std::mem::take(spans))).map_err(|e| match e {
            // Nothing was sent yet: the plain error says it all.
            e if done.posts == 0 => e,
            e => OtlpError::Partial { sent: done.spans, posts: done.posts, source: Box::new(e) },
        })?;
        done.spans += n;
        done.posts += 1;
        Ok(())
    };
    // The report's reading loop: requests in report order as they become
    // final, with the report's figures; steps are not exported.
    let mut chains = ChainSpans::default();
    let take = |r: &Request, q: &RequestRef| -> Result<(), OtlpError> {
        done.requests += 1;
        spans_of(&meta, r, q, &mut spans);
        chains.note(r);
        if spans.len() >= batch.max(1) {
            flush(&mut spans, &mut done)?;
        }
        Ok(())
    };
    let (_, read_error) = stream_requests(reader, cfg, &mut GpuMemIndex::default(), take, |_, _| Ok(()))?;
    chains.finish(&meta, &mut spans);
    flush(&mut spans, &mut done)?;
    Ok((done, read_error))
}

/// `http://host:port[/path]` → (`host:port`, the path, `/v1/traces` when none).
pub fn endpoint_parts(endpoint: &str) -> Result<(&str, &str), OtlpError> {
    let rest = endpoint.strip_prefix("http://").ok_or_else(|| OtlpError::Endpoint(endpoint.to_owned()))?;
    let (hostport, path) = match rest.find('/') {
        Some(i) if i + 1 < rest.len() => (&rest[..i], &rest[i..]),
        Some(i) => (&rest[..i], "/v1/traces"),
        None => (rest, "/v1/traces"),
    };
    if hostport.is_empty() {
        return Err(OtlpError::Endpoint(endpoint.to_owned()));
    }
    Ok((hostport, path))
}

/// Whether the endpoint accepts a connection (nothing is sent).
pub fn probe(endpoint: &str) -> Result<(), OtlpError> {
    let (hostport, _) = endpoint_parts(endpoint)?;
    connect_timeout(hostport, Duration::from_secs(2)).map(drop).map_err(|e| OtlpError::Connect { endpoint: endpoint.to_owned(), source: e })
}

/// The first of `hostport`'s addresses that accepts within `limit` each: a
/// collector behind a dropped route costs seconds, not the system's minutes.
fn connect_timeout(hostport: &str, limit: Duration) -> std::io::Result<TcpStream> {
    use std::net::ToSocketAddrs;
    let mut last = std::io::Error::new(std::io::ErrorKind::NotFound, format!("{hostport} resolves to no address"));
    for a in hostport.to_socket_addrs()? {
        match TcpStream::connect_timeout(&a, limit) {
            Ok(c) => return Ok(c),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// POSTs the export to `endpoint` (`http://host:port`, `/v1/traces` appended
/// unless a path is given) as OTLP/HTTP protobuf. Returns the span count.
pub fn send(endpoint: &str, req: &ExportTraceServiceRequest) -> Result<usize, OtlpError> {
    let (hostport, path) = endpoint_parts(endpoint)?;
    let body = req.encode_to_vec();
    let connect = |e| OtlpError::Connect { endpoint: endpoint.to_owned(), source: e };
    let mut c = connect_timeout(hostport, Duration::from_secs(5)).map_err(connect)?;
    c.set_read_timeout(Some(Duration::from_secs(10))).map_err(connect)?;
    c.set_write_timeout(Some(Duration::from_secs(10))).map_err(connect)?;
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/x-protobuf\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    c.write_all(head.as_bytes()).and_then(|_| c.write_all(&body)).map_err(connect)?;
    let mut resp = Vec::new();
    let _ = c.read_to_end(&mut resp);
    let status_line = String::from_utf8_lossy(&resp).lines().next().unwrap_or("no response").to_owned();
    if !status_line.split_whitespace().nth(1).is_some_and(|c| c.starts_with('2')) {
        return Err(OtlpError::Status { endpoint: endpoint.to_owned(), status: status_line });
    }
    Ok(req.resource_spans.iter().flat_map(|r| &r.scope_spans).map(|s| s.spans.len()).sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_stable_and_traceparents_parse() {
        assert_eq!(fnv(b"chain", 1), fnv(b"chain", 1));
        assert_ne!(fnv(b"chain", 1), fnv(b"chain", 2));
        assert_eq!(hex_bytes("00ff10"), Some(vec![0, 255, 16]));
        assert_eq!(hex_bytes("0g"), None);
    }

    /// `record --metrics` names a request's trace in its exemplars by
    /// [`request_trace_id`]: it must be the trace the request's spans are in.
    #[test]
    fn a_requests_trace_id_is_the_one_its_spans_carry() {
        let (meta, analysis) = fixture_analysis();
        let spans = build(&meta, &analysis, &GpuMemIndex::default()).resource_spans.remove(0).scope_spans.remove(0).spans;
        let mut checked = 0;
        for r in analysis.requests.iter().filter(|r| r.done_ns.is_some()) {
            let want = request_trace_id(&r.chain, r.chain_source);
            let mine: Vec<&Span> = spans.iter().filter(|s| s.attributes.iter().any(|a| a.key == "gen_ai.request.id" && a.value == Some(AnyValue { value: Some(Value::Str(r.id.clone())) }))).collect();
            assert!(!mine.is_empty(), "{}: no span", r.id);
            for sp in mine {
                assert_eq!(sp.trace_id, want.to_vec(), "{}: span {} in another trace", r.id, sp.name);
            }
            checked += 1;
        }
        assert!(checked >= 3, "{checked} requests");
        // A caller's traceparent (any case): its trace id.
        let conn = crate::event::ConnKey { tgid: 1, fd: 2, ino: 3 };
        let key = |tp: &str| crate::correlate::chain_key(conn, &[("traceparent".into(), tp.into()), ("x-session-id".into(), "s1".into())], "x-session-id");
        let (chain, source) = key("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01");
        assert_eq!(request_trace_id(&chain, source), hex_bytes("4bf92f3577b34da6a3ce929d0e0e4736").unwrap()[..]);
        // An invalid one (all-zero id) is the session's, as for the spans.
        let (chain, source) = key("00-00000000000000000000000000000000-00f067aa0ba902b7-01");
        assert_eq!(request_trace_id(&chain, source), chain_trace_id("s1"));
    }

    /// A request with GPU records carries its GPU time per phase and its
    /// kernels (two aligned arrays); one without has none of them.
    #[test]
    fn gpu_time_and_kernels_are_span_attributes_only_when_recorded() {
        let (meta, mut analysis) = fixture_analysis();
        let i = analysis.requests.iter().position(|r| r.done_ns.is_some()).unwrap();
        let r = &mut analysis.requests[i];
        r.gpu = Some(crate::correlate::gpu::GpuShare { prefill_ns: 3_000_000, decode_ns: 1_500_000, ..Default::default() });
        r.kernels = Some(vec![
            crate::correlate::gpu::KernelShare { name: "flash_fwd_kernel".into(), gpu_ns: 2_500_000 },
            crate::correlate::gpu::KernelShare { name: "gemm".into(), gpu_ns: 500_000 },
        ]);
        let id = r.id.clone();
        let spans = build(&meta, &analysis, &GpuMemIndex::default()).resource_spans.remove(0).scope_spans.remove(0).spans;
        let attr = |sp: &Span, k: &str| sp.attributes.iter().find(|a| a.key == k).and_then(|a| a.value.clone()).and_then(|v| v.value);
        let is = |sp: &Span| attr(sp, "gen_ai.request.id") == Some(Value::Str(id.clone()));
        let sp = spans.iter().find(|sp| is(sp)).unwrap();
        assert_eq!(attr(sp, "hopscope.gpu.prefill"), Some(Value::Double(0.003)));
        assert_eq!(attr(sp, "hopscope.gpu.decode"), Some(Value::Double(0.0015)));
        assert_eq!(attr(sp, "hopscope.gpu.kv_transfer"), Some(Value::Double(0.0)));
        let arr = |k: &str| match attr(sp, k) {
            Some(Value::Array(a)) => a.values.into_iter().map(|v| v.value.unwrap()).collect::<Vec<_>>(),
            other => panic!("{k}: {other:?}"),
        };
        assert_eq!(arr("hopscope.gpu.kernels"), vec![Value::Str("flash_fwd_kernel".into()), Value::Str("gemm".into())]);
        assert_eq!(arr("hopscope.gpu.kernel_seconds"), vec![Value::Double(0.0025), Value::Double(0.0005)]);
        for sp in spans.iter().filter(|sp| sp.kind == 2 && !is(sp)) {
            assert!(sp.attributes.iter().all(|a| !a.key.starts_with("hopscope.gpu.")), "{:?}", sp.attributes);
        }
    }

    /// A request that asked for structured output names the constraint's
    /// kind and backend, and a JSON one the conventions' output type; the
    /// others carry none of them.
    #[test]
    fn a_structured_output_request_names_its_constraint_and_a_json_one_its_output_type() {
        for (kind, backend, output_type) in [("json", Some("xgrammar"), Some("json")), ("json_object", None, Some("json")), ("regex", Some("guidance"), None)] {
            let (meta, mut analysis) = fixture_analysis();
            let i = analysis.requests.iter().position(|r| r.engine.is_some() && r.done_ns.is_some()).expect("a request with its engine joined");
            let e = analysis.requests[i].engine.as_mut().unwrap();
            e.structured = Some(crate::correlate::engine::StructuredOutput { kind, backend: backend.map(Into::into) });
            let id = analysis.requests[i].id.clone();
            let spans = build(&meta, &analysis, &GpuMemIndex::default()).resource_spans.remove(0).scope_spans.remove(0).spans;
            let attr = |sp: &Span, k: &str| sp.attributes.iter().find(|a| a.key == k).and_then(|a| a.value.clone()).and_then(|v| v.value);
            let sp = spans.iter().find(|sp| sp.kind == 2 && attr(sp, "gen_ai.request.id") == Some(Value::Str(id.clone()))).expect("its span");
            assert_eq!(attr(sp, "hopscope.structured_output"), Some(Value::Str(kind.into())));
            assert_eq!(attr(sp, "hopscope.structured_output.backend"), backend.map(|b| Value::Str(b.into())));
            assert_eq!(attr(sp, "gen_ai.output.type"), output_type.map(|t| Value::Str(t.into())), "{kind}");
            let others = spans.iter().filter(|s| s.kind == 2 && s.span_id != sp.span_id);
            assert!(others.clone().count() > 0);
            for o in others {
                assert!(["hopscope.structured_output", "hopscope.structured_output.backend", "gen_ai.output.type"].iter().all(|k| attr(o, k).is_none()), "{:?}", o.attributes);
            }
        }
    }

    /// A request its client left before the response ended: a span to the
    /// close, marked, without an E2E; its phase children tile it.
    #[test]
    fn a_request_closed_early_has_a_span_to_its_close() {
        let (meta, mut analysis) = fixture_analysis();
        let i = analysis.requests.iter().position(|r| r.engine.is_some() && r.done_ns.is_some()).expect("a request with its engine joined");
        let r = &mut analysis.requests[i];
        let close = r.arrive_ns + (r.done_ns.unwrap() - r.arrive_ns) / 2;
        (r.closed_ns, r.done_ns, r.response_end_ns) = (Some(close), None, None);
        r.content_ns.retain(|&c| c <= close);
        let (id, arrive) = (r.id.clone(), r.arrive_ns);
        let spans = build(&meta, &analysis, &GpuMemIndex::default()).resource_spans.remove(0).scope_spans.remove(0).spans;
        let attr = |sp: &Span, k: &str| sp.attributes.iter().find(|a| a.key == k).and_then(|a| a.value.clone()).and_then(|v| v.value);
        let sp = spans.iter().find(|sp| sp.kind == 2 && attr(sp, "gen_ai.request.id") == Some(Value::Str(id.clone()))).expect("a span for the closed request");
        assert_eq!(attr(sp, "hopscope.closed_early"), Some(Value::Bool(true)));
        assert_eq!(attr(sp, "gen_ai.latency.e2e"), None);
        assert_eq!(sp.end_time_unix_nano - sp.start_time_unix_nano, close - arrive);
        let children: Vec<&Span> = spans.iter().filter(|c| c.parent_span_id == sp.span_id).collect();
        assert!(!children.is_empty());
        let tiled: u64 = children.iter().map(|c| c.end_time_unix_nano - c.start_time_unix_nano).sum();
        assert_eq!(tiled, close - arrive, "the phases tile the wait to the close");
        assert!(spans.iter().filter(|s| s.kind == 2 && s.span_id != sp.span_id).all(|s| attr(s, "hopscope.closed_early").is_none()));
    }

    /// The GenAI conventions' operation (from the path) and model (from the
    /// request body) on each request's span; no model attribute without one.
    #[test]
    fn a_requests_span_names_its_genai_operation_and_model() {
        let (meta, mut analysis) = fixture_analysis();
        let chat: Vec<usize> = (0..analysis.requests.len()).filter(|&i| analysis.requests[i].done_ns.is_some() && analysis.requests[i].path == "/v1/chat/completions").collect();
        assert!(chat.len() >= 2, "{} chat requests", chat.len());
        assert!(chat.iter().all(|&i| analysis.requests[i].model.is_some()), "the fixture's bodies name their model");
        let (with, without) = (analysis.requests[chat[0]].id.clone(), analysis.requests[chat[1]].id.clone());
        let model = analysis.requests[chat[0]].model.clone().unwrap();
        analysis.requests[chat[1]].model = None;
        let spans = build(&meta, &analysis, &GpuMemIndex::default()).resource_spans.remove(0).scope_spans.remove(0).spans;
        let attr = |sp: &Span, k: &str| sp.attributes.iter().find(|a| a.key == k).and_then(|a| a.value.clone()).and_then(|v| v.value);
        let span = |id: &str| spans.iter().find(|sp| sp.kind == 2 && attr(sp, "gen_ai.request.id") == Some(Value::Str(id.into()))).unwrap();
        assert_eq!(attr(span(&with), "gen_ai.operation.name"), Some(Value::Str("chat".into())));
        assert_eq!(attr(span(&with), "gen_ai.request.model"), Some(Value::Str(model)));
        assert_eq!(attr(span(&without), "gen_ai.operation.name"), Some(Value::Str("chat".into())));
        assert_eq!(attr(span(&without), "gen_ai.request.model"), None);
        assert_eq!(operation_name("/v1/completions?x=1"), Some("text_completion"));
        assert_eq!(operation_name("/v1/embeddings/"), Some("embeddings"));
        assert_eq!(operation_name("/v1/models"), None);
        assert_eq!(operation_name("/v1/responses"), Some("chat"));
        assert_eq!(operation_name("/v1/messages"), Some("chat"));
        assert_eq!(operation_name("/v1/messages/count_tokens"), None);
    }

    /// The id the server wrote back is the conventions' response id; an id
    /// hopscope made up (from `x-request-id` or the connection) is not.
    #[test]
    fn only_an_id_the_server_wrote_is_the_spans_response_id() {
        let (meta, mut analysis) = fixture_analysis();
        // The readiness probe's answer names no id: it is named by its connection.
        let probe = analysis.requests.iter().find(|r| r.path == "/health").expect("the fixture's probe");
        assert!(!probe.id_from_response && probe.id.starts_with("conn:"), "{}", probe.id);
        let done: Vec<usize> = (0..analysis.requests.len()).filter(|&i| analysis.requests[i].done_ns.is_some() && analysis.requests[i].path != "/health").collect();
        assert!(done.len() >= 2 && done.iter().all(|&i| analysis.requests[i].id_from_response && analysis.requests[i].id.starts_with("chatcmpl-")), "the fixture's chats carry their ids");
        let (named, made_up) = (analysis.requests[done[0]].id.clone(), format!("conn:1:9:{}", done[1]));
        analysis.requests[done[1]].id.clone_from(&made_up);
        analysis.requests[done[1]].id_from_response = false;
        let spans = build(&meta, &analysis, &GpuMemIndex::default()).resource_spans.remove(0).scope_spans.remove(0).spans;
        let attr = |sp: &Span, k: &str| sp.attributes.iter().find(|a| a.key == k).and_then(|a| a.value.clone()).and_then(|v| v.value);
        let span = |id: &str| spans.iter().find(|sp| sp.kind == 2 && attr(sp, "gen_ai.request.id") == Some(Value::Str(id.into()))).unwrap();
        assert_eq!(attr(span(&named), "gen_ai.response.id"), Some(Value::Str(named.clone())));
        assert_eq!(attr(span(&made_up), "gen_ai.response.id"), None);
    }

    /// A collector on a local port: answers each POST with the next status
    /// of `statuses` (200 once they run out) and hands the bodies back.
    pub(super) fn collector(statuses: Vec<u16>) -> (String, std::thread::JoinHandle<Vec<Vec<u8>>>) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let h = std::thread::spawn(move || {
            let mut bodies = Vec::new();
            let mut statuses = statuses.into_iter();
            l.set_nonblocking(false).unwrap();
            // Until the exporter has gone quiet for a second.
            let _ = l.set_nonblocking(true);
            let mut idle = std::time::Instant::now();
            loop {
                match l.accept() {
                    Ok((mut c, _)) => {
                        c.set_nonblocking(false).unwrap();
                        let mut buf = Vec::new();
                        let mut chunk = [0u8; 65536];
                        let body = loop {
                            let n = c.read(&mut chunk).unwrap();
                            if n == 0 && buf.is_empty() {
                                // A connection that sent nothing (the live export's probe).
                                break None;
                            }
                            buf.extend_from_slice(&chunk[..n]);
                            let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                                assert!(n > 0, "connection closed mid-head");
                                continue;
                            };
                            let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
                            let len: usize = head.lines().find_map(|l| l.strip_prefix("content-length: ")).unwrap().trim().parse().unwrap();
                            if buf.len() >= end + 4 + len {
                                break Some(buf[end + 4..end + 4 + len].to_vec());
                            }
                            assert!(n > 0, "connection closed mid-body");
                        };
                        let Some(body) = body else { continue };
                        let status = statuses.next().unwrap_or(200);
                        c.write_all(format!("HTTP/1.1 {status} X\r\nContent-Length: 0\r\n\r\n").as_bytes()).unwrap();
                        if status == 200 {
                            bodies.push(body);
                        }
                        idle = std::time::Instant::now();
                    }
                    Err(_) if idle.elapsed() > Duration::from_secs(1) => return bodies,
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        (url, h)
    }

    pub(super) fn fixture() -> std::path::PathBuf {
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chain3.hop")
    }

    /// The fixture's metadata and its analysis, as `export otlp` correlates it.
    fn fixture_analysis() -> (Meta, Analysis) {
        let mut reader = Reader::open(&fixture()).unwrap();
        let meta = reader.meta().clone();
        let mut c = crate::correlate::Correlator::new(Config { chain_header: meta.chain_header.clone(), use_ipc: true });
        while let Some(r) = reader.next_ref().unwrap() {
            c.ingest(r);
        }
        (meta, c.finish())
    }

    /// The streamed export sends, in messages of at most `batch` spans (a
    /// request's spans never split), exactly the spans the whole-analysis
    /// build gives, in the same order.
    #[test]
    fn streamed_export_sends_the_whole_exports_spans_in_batches() {
        let (meta, analysis) = fixture_analysis();
        let cfg = Config { chain_header: meta.chain_header.clone(), use_ipc: true };
        let whole = build(&meta, &analysis, &GpuMemIndex::default()).resource_spans.remove(0).scope_spans.remove(0).spans;
        assert!(whole.len() > 10, "{} spans", whole.len());
        let (url, rx) = collector(Vec::new());
        let (sent, err) = export_streamed(&mut Reader::open(&fixture()).unwrap(), cfg, &url, 7).unwrap();
        assert_eq!(err, None);
        let bodies = rx.join().unwrap();
        let got: Vec<Span> = bodies.iter().flat_map(|b| ExportTraceServiceRequest::decode(b.as_slice()).unwrap().resource_spans.remove(0).scope_spans.remove(0).spans).collect();
        assert_eq!(got, whole);
        assert_eq!((sent.spans, sent.requests, sent.posts), (whole.len(), analysis.requests.len(), bodies.len()));
        assert!(bodies.len() > 1, "batched: {} messages", bodies.len());
        for b in &bodies {
            let n = ExportTraceServiceRequest::decode(b.as_slice()).unwrap().resource_spans[0].scope_spans[0].spans.len();
            // At most a batch plus the rest of the request that filled it.
            assert!(n <= 7 + 5, "{n} spans in one message");
        }
    }

    /// A collector that refuses a later message: the error says how much it
    /// already accepted.
    #[test]
    fn a_refused_later_batch_says_what_was_already_exported() {
        let (url, rx) = collector(vec![200, 500]);
        let cfg = Config { chain_header: "x-session-id".into(), use_ipc: true };
        let e = export_streamed(&mut Reader::open(&fixture()).unwrap(), cfg, &url, 7).unwrap_err();
        let first = rx.join().unwrap();
        let n = ExportTraceServiceRequest::decode(first[0].as_slice()).unwrap().resource_spans[0].scope_spans[0].spans.len();
        match &e {
            OtlpError::Partial { sent, posts: 1, .. } => assert_eq!(*sent, n),
            other => panic!("{other:?}"),
        }
        assert!(e.to_string().contains("answered HTTP/1.1 500"), "{e}");
    }

    /// OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES as SDKs read them:
    /// the service name's precedence, percent-decoded values, later keys
    /// replacing earlier ones, our version kept.
    #[test]
    fn the_resource_takes_the_standard_otel_environment() {
        let meta = Meta { hostname: "gpu-node-3".into(), hopscope_version: "0.1.0".into(), ..Meta::default() };
        let attrs = |r: Resource| r.attributes.into_iter().map(|kv| (kv.key, match kv.value.and_then(|v| v.value) { Some(Value::Str(s)) => s, other => panic!("{other:?}") })).collect::<Vec<_>>();
        let kv = |v: &[(&str, &str)]| v.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<Vec<_>>();
        assert_eq!(attrs(resource_from(&meta, None, None)), kv(&[("service.name", "hopscope"), ("host.name", "gpu-node-3"), ("hopscope.version", "0.1.0")]));
        let env = "k8s.pod.name=vllm-0, deployment.environment=prod%2Ceu,service.name=from-attrs,host.name=pod-host,k8s.pod.name=vllm-1,hopscope.version=9,broken,=x,pct=100%";
        assert_eq!(
            attrs(resource_from(&meta, None, Some(env))),
            kv(&[("service.name", "from-attrs"), ("host.name", "pod-host"), ("hopscope.version", "0.1.0"), ("k8s.pod.name", "vllm-1"), ("deployment.environment", "prod,eu"), ("pct", "100%")])
        );
        assert_eq!(attrs(resource_from(&meta, Some("llm-gateway"), Some(env)))[0], ("service.name".into(), "llm-gateway".into()), "OTEL_SERVICE_NAME wins");
    }

    #[test]
    fn endpoints_without_http_are_refused_with_a_clear_error() {
        let e = send("https://collector:4318", &ExportTraceServiceRequest::default()).unwrap_err().to_string();
        assert!(e.contains("https is not supported"), "{e}");
    }
}
