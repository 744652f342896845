//! `hopscope report`: the JSON users script against (../shared/contract.md,
//! schema 1: add fields, never rename) and the human tables.

use crate::correlate::engine::partition;
use crate::correlate::{ms, percentile, Analysis, Request};
use crate::recording::Meta;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;

#[derive(Debug, Serialize)]
pub struct Report {
    pub schema: u32,
    pub recording: RecordingInfo,
    pub requests: Vec<RequestOut>,
    pub chains: Vec<ChainOut>,
    pub kernels: Vec<KernelOut>,
}

#[derive(Debug, Serialize)]
pub struct RecordingInfo {
    pub path: String,
    pub duration_ms: f64,
    pub pids: Vec<u32>,
    pub gpu: bool,
    pub drops: BTreeMap<String, u64>,
    /// The recording ended early (damaged or truncated file): what stopped the read.
    pub read_error: Option<String>,
    pub hopscope_version: String,
    pub kernel: String,
    /// GPUs reported by the injected processes (model, driver, memory).
    pub gpus: Vec<crate::correlate::GpuInfo>,
}

#[derive(Debug, Serialize)]
pub struct Phases {
    pub frontend: Option<f64>,
    pub queue: Option<f64>,
    pub prefill: Option<f64>,
    pub kv_transfer: Option<f64>,
    pub first_output: Option<f64>,
    pub decode: Option<f64>,
}

#[derive(Debug, Serialize)]
pub struct GpuMs {
    pub prefill: Option<f64>,
    pub decode: Option<f64>,
    pub kv_transfer: Option<f64>,
}

#[derive(Debug, Serialize)]
pub struct RequestOut {
    pub id: String,
    pub x_request_id: Option<String>,
    pub traceparent: Option<String>,
    pub chain: Option<String>,
    pub hop: Option<u32>,
    pub method: String,
    pub path: String,
    pub status: Option<u16>,
    pub arrive_ns: u64,
    pub ttft_ns: Option<u64>,
    pub done_ns: Option<u64>,
    pub ttft_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
    pub itl_ms: Vec<f64>,
    pub itl_p50_ms: Option<f64>,
    pub itl_p90_ms: Option<f64>,
    pub itl_p99_ms: Option<f64>,
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub phases_ms: Phases,
    pub gpu_ms: GpuMs,
    pub interference_ms: Option<f64>,
    pub steps: Option<u64>,
    // Additions beyond schema 1's list (allowed: add, never rename).
    /// Where the chain key came from: traceparent, header or connection.
    pub chain_source: String,
    /// Content chunks (SSE events carrying generated text) seen on the wire.
    pub content_chunks: usize,
    pub streamed: bool,
    pub request_bytes: u64,
    pub response_bytes: Option<u64>,
    pub finish_reason: Option<String>,
    pub pid: u32,
    pub fd: i32,
    /// When the request's first byte became readable in the server's socket
    /// (kernel sk_data_ready), before the server read it.
    pub wire_arrive_ns: Option<u64>,
    /// arrive_ns - wire_arrive_ns: the request sat unread this long (busy event loop).
    pub read_delay_ms: Option<f64>,
    /// TTFT and E2E from the wire arrival: what a client beside the server sees.
    pub wire_ttft_ms: Option<f64>,
    pub wire_e2e_ms: Option<f64>,
    /// Where the phases came from: "ipc" (engine IPC decoded and joined) or
    /// "wire" (HTTP/SSE only: decode alone is observable).
    pub phase_source: String,
    /// The engine's id for this request (vLLM: `<external id>-<8 hex>`).
    pub engine_request_id: Option<String>,
    /// How queue's end was found: "event" (SCHEDULED), "step" (end of the step
    /// before the first-token step), "submit" (no earlier step).
    pub scheduled_source: Option<String>,
    pub preemptions: Option<u32>,
    /// Requests whose co-batched prefill slowed this one's decode.
    pub interference_from: Vec<String>,
    /// Tokens the engine computed for the prompt (prompt - cached, with recompute).
    pub computed_tokens: Option<u64>,
    /// Marks found out of order and clamped so the phases still add up.
    pub marks_clamped: u32,
    /// Where `steps` and `interference_ms` came from: "ipc" (the engine's
    /// output messages) or "sse-clusters" (bursts of SSE writes: the fallback
    /// for servers whose IPC is unknown); null when neither saw the request.
    pub steps_source: Option<String>,
}

#[derive(Debug, Serialize)]
pub struct ChainOut {
    pub chain: String,
    pub hops: Vec<String>,
    pub e2e_ms: Option<f64>,
    pub ttft_ms: Vec<Option<f64>>,
    pub prefix_cache_hit: Vec<Option<f64>>,
    pub source: String,
}

#[derive(Debug, Serialize)]
pub struct KernelOut {
    pub name: String,
    pub count: u64,
    pub gpu_ms: f64,
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

fn request_out(r: &Request, all: &[Request]) -> RequestOut {
    let e = r.engine.as_ref();
    let w = r.wire_steps.as_ref();
    let part = partition(r);
    let itl = r.itl_ms();
    let s = sorted(itl.clone());
    RequestOut {
        id: r.id.clone(),
        x_request_id: r.x_request_id.clone(),
        traceparent: r.traceparent.clone(),
        chain: Some(r.chain.clone()),
        hop: Some(r.hop),
        method: r.method.clone(),
        path: r.path.clone(),
        status: r.status,
        arrive_ns: r.arrive_ns,
        ttft_ns: r.ttft_ns,
        done_ns: r.done_ns,
        ttft_ms: r.ttft_ms(),
        e2e_ms: r.e2e_ms(),
        itl_p50_ms: percentile(&s, 50.0),
        itl_p90_ms: percentile(&s, 90.0),
        itl_p99_ms: percentile(&s, 99.0),
        itl_ms: itl,
        prompt_tokens: r.usage.prompt_tokens.or(e.and_then(|e| e.prompt_tokens)),
        completion_tokens: r.usage.completion_tokens,
        cached_tokens: r.usage.cached_tokens.or(e.and_then(|e| e.cached_tokens)),
        // Wire alone shows decode (first content chunk → end); the engine IPC
        // adds frontend, queue, prefill and first_output. KV copies need the
        // GPU source: kv_transfer stays null until it is there.
        phases_ms: Phases {
            frontend: part.frontend,
            queue: part.queue,
            prefill: part.prefill,
            kv_transfer: None,
            first_output: part.first_output,
            decode: part.decode,
        },
        gpu_ms: GpuMs { prefill: None, decode: None, kv_transfer: None },
        interference_ms: e.map(|e| ms(e.interference_ns)).or(w.map(|w| ms(w.interference_ns))),
        steps: e.map(|e| u64::from(e.steps)).or(w.map(|w| u64::from(w.steps))),
        chain_source: serde_json::to_value(r.chain_source).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default(),
        content_chunks: r.content_ns.len(),
        streamed: r.streamed,
        request_bytes: r.request_bytes,
        response_bytes: r.response_bytes,
        finish_reason: r.finish_reason.clone(),
        pid: r.conn.tgid,
        fd: r.conn.fd,
        wire_arrive_ns: r.wire_arrive_ns,
        read_delay_ms: r.read_delay_ms(),
        wire_ttft_ms: r.wire_ttft_ms(),
        wire_e2e_ms: r.wire_e2e_ms(),
        phase_source: if e.is_some() { "ipc" } else { "wire" }.into(),
        engine_request_id: e.map(|e| e.engine_request_id.clone()),
        scheduled_source: e.map(|e| e.scheduled_source.to_owned()),
        preemptions: e.map(|e| e.preemptions),
        interference_from: match (e, w) {
            (Some(e), _) => e.interference_from.clone(),
            (None, Some(w)) => w.interference_from.iter().filter_map(|&i| all.get(i).map(|o| o.id.clone())).collect(),
            (None, None) => Vec::new(),
        },
        computed_tokens: e.and_then(|e| e.computed_tokens),
        marks_clamped: part.clamped,
        steps_source: match (e, w) {
            (Some(_), _) => Some("ipc".into()),
            (None, Some(_)) => Some("sse-clusters".into()),
            (None, None) => None,
        },
    }
}

/// How many kernels the report lists.
pub const TOP_KERNELS: usize = 20;

/// Builds the schema-1 report.
pub fn build(path: &str, meta: &Meta, analysis: &Analysis, read_error: Option<String>) -> Report {
    let duration_ms = match (analysis.first_ns, analysis.last_ns) {
        // From the start of recording when known, else from the first event.
        (Some(f), Some(l)) => ms(l.saturating_sub(if meta.start_ns > 0 && meta.start_ns <= f { meta.start_ns } else { f })),
        _ => 0.0,
    };
    let requests: Vec<RequestOut> = analysis.requests.iter().map(|r| request_out(r, &analysis.requests)).collect();
    let chains = analysis
        .chains
        .iter()
        .map(|c| {
            let hops: Vec<&Request> = c.hops.iter().map(|&i| &analysis.requests[i]).collect();
            let first = hops.first().map(|r| r.arrive_ns);
            let last_done = hops.iter().map(|r| r.done_ns).collect::<Option<Vec<u64>>>().and_then(|d| d.into_iter().max());
            ChainOut {
                chain: c.chain.clone(),
                hops: hops.iter().map(|r| r.id.clone()).collect(),
                e2e_ms: match (first, last_done) {
                    (Some(f), Some(l)) => Some(ms(l.saturating_sub(f))),
                    _ => None,
                },
                ttft_ms: hops.iter().map(|r| r.ttft_ms()).collect(),
                prefix_cache_hit: hops
                    .iter()
                    .map(|r| {
                        let e = r.engine.as_ref();
                        let cached = r.usage.cached_tokens.or(e.and_then(|e| e.cached_tokens));
                        let prompt = r.usage.prompt_tokens.or(e.and_then(|e| e.prompt_tokens));
                        match (cached, prompt) {
                            (Some(c), Some(p)) if p > 0 => Some(c as f64 / p as f64),
                            _ => None,
                        }
                    })
                    .collect(),
                source: serde_json::to_value(c.source).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default(),
            }
        })
        .collect();
    Report {
        schema: 1,
        recording: RecordingInfo {
            path: path.to_owned(),
            duration_ms,
            pids: meta.pids.clone(),
            gpu: meta.gpu,
            drops: analysis.drops.clone(),
            read_error,
            hopscope_version: meta.hopscope_version.clone(),
            kernel: meta.kernel.clone(),
            gpus: analysis.gpus.clone(),
        },
        requests,
        chains,
        // Top kernels by total GPU time (CUPTI records, every process).
        kernels: analysis
            .kernels
            .iter()
            .take(TOP_KERNELS)
            .map(|k| KernelOut {
                name: if k.name.is_empty() { "<unnamed>".into() } else { k.name.clone() },
                count: k.count,
                gpu_ms: ms(k.gpu_ns),
            })
            .collect(),
    }
}

fn opt(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{x:.2}"))
}

fn opt_u(v: Option<u64>) -> String {
    v.map_or_else(|| "-".into(), |x| x.to_string())
}

/// The human report: per request, per chain, and the loss counters.
pub fn render_text(rep: &Report) -> String {
    let mut s = String::new();
    let r = &rep.recording;
    let _ = writeln!(s, "recording {}  ({:.1} s, pids {:?}, gpu: {})", r.path, r.duration_ms / 1e3, r.pids, if r.gpu { "yes" } else { "no" });
    if let Some(e) = &r.read_error {
        let _ = writeln!(s, "WARNING: the recording ends early: {e} (report covers what precedes it)");
    }
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "{:<34} {:<18} {:>4} {:<6} {:<22} {:>6} {:>9} {:>9} {:>8} {:>8} {:>8} {:>6} {:>6} {:>6}",
        "request", "chain", "hop", "method", "path", "status", "ttft_ms", "e2e_ms", "itl_p50", "itl_p90", "itl_p99", "chunks", "in", "out"
    );
    for q in &rep.requests {
        let chain = q.chain.as_deref().unwrap_or("-");
        let _ = writeln!(
            s,
            "{:<34} {:<18} {:>4} {:<6} {:<22} {:>6} {:>9} {:>9} {:>8} {:>8} {:>8} {:>6} {:>6} {:>6}",
            trunc(&q.id, 34),
            trunc(chain, 18),
            q.hop.map_or("-".into(), |h| h.to_string()),
            q.method,
            trunc(&q.path, 22),
            q.status.map_or("-".into(), |x| x.to_string()),
            opt(q.ttft_ms),
            opt(q.e2e_ms),
            opt(q.itl_p50_ms),
            opt(q.itl_p90_ms),
            opt(q.itl_p99_ms),
            q.content_chunks,
            opt_u(q.prompt_tokens),
            opt_u(q.completion_tokens),
        );
    }
    let by_id: BTreeMap<&str, &RequestOut> = rep.requests.iter().map(|q| (q.id.as_str(), q)).collect();
    for c in rep.chains.iter().filter(|c| c.hops.len() > 1 || c.source != "connection") {
        let _ = writeln!(s, "\nchain {} ({}, {} hops, e2e {} ms)", c.chain, c.source, c.hops.len(), opt(c.e2e_ms));
        let _ = writeln!(
            s,
            "  {:>3} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>6} {:>6} {:>6} {:>6} {:>9}",
            "hop", "ttft_ms", "front", "queue", "prefill", "kv", "1st_out", "decode", "itl_avg", "itl90", "in", "out", "cached", "e2e_ms"
        );
        for (n, id) in c.hops.iter().enumerate() {
            let Some(q) = by_id.get(id.as_str()) else { continue };
            let avg = (!q.itl_ms.is_empty()).then(|| q.itl_ms.iter().sum::<f64>() / q.itl_ms.len() as f64);
            let p = &q.phases_ms;
            let _ = writeln!(
                s,
                "  {:>3} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>6} {:>6} {:>6} {:>6} {:>9}",
                n + 1,
                opt(q.ttft_ms),
                opt(p.frontend),
                opt(p.queue),
                opt(p.prefill),
                opt(p.kv_transfer),
                opt(p.first_output),
                opt(p.decode),
                opt(avg),
                opt(q.itl_p90_ms),
                opt_u(q.prompt_tokens),
                opt_u(q.completion_tokens),
                opt_u(q.cached_tokens),
                opt(q.e2e_ms),
            );
        }
    }
    for g in &r.gpus {
        let _ = writeln!(
            s,
            "gpu {}: {} (cc {}, {} SMs, {:.0} GiB, driver {}) used by pids {:?}",
            g.device,
            g.name,
            g.compute_capability,
            g.sm_count,
            g.total_mem_bytes as f64 / (1u64 << 30) as f64,
            g.driver_version,
            g.pids
        );
    }
    if !rep.kernels.is_empty() {
        let _ = writeln!(s, "\ngpu kernels (top by GPU time)\n  {:>10} {:>8}  name", "gpu_ms", "count");
        for k in &rep.kernels {
            let _ = writeln!(s, "  {:>10.3} {:>8}  {}", k.gpu_ms, k.count, trunc(&k.name, 100));
        }
    }
    let _ = writeln!(s, "\ndrops and anomalies (cumulative)");
    let losses: Vec<_> = r.drops.iter().filter(|(k, v)| **v > 0 && is_loss(k)).collect();
    if losses.is_empty() {
        let _ = writeln!(s, "  none");
    }
    for (k, v) in losses {
        let _ = writeln!(s, "  {k:<32} {v}");
    }
    let activity: Vec<String> = r.drops.iter().filter(|(k, v)| **v > 0 && !is_loss(k)).map(|(k, v)| format!("{k}={v}")).collect();
    if !activity.is_empty() {
        let _ = writeln!(s, "activity: {}", activity.join(" "));
    }
    s
}

/// Counters that only measure activity (events seen, messages decoded, short
/// off-CPU intervals folded in the kernel); every other counter means something
/// was lost or could not be interpreted.
pub fn is_loss(name: &str) -> bool {
    const ACTIVITY: &[&str] = &[
        "kernel_events",
        "kernel_wakeups",
        "kernel_sched_short",
        "kernel_sched_short_ns",
        "ipc_messages",
        "ipc_add",
        "ipc_outputs",
        "ipc_abort",
        "ipc_handshake",
        "ipc_utility",
        "zmtp_streams",
        "resyncs",
        "engine_requests_linked",
        "engine_steps_from_reader",
        "upgrades",
        "attach_mid_stream",
        // GPU source (source::cupti): connections and records, not losses.
        "gpu_conns",
        "gpu_records",
        "gpu_records_decoded",
        "gpu_records_sent",
        "gpu_connects",
    ];
    !ACTIVITY.contains(&name)
}

fn trunc(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_owned()
    } else {
        let mut t: String = s.chars().take(n.saturating_sub(1)).collect();
        t.push('…');
        t
    }
}
