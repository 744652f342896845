//! `hopscope report`: the JSON users script against (../shared/contract.md,
//! schema 1: add fields, never rename) and the human tables.

use crate::correlate::engine::{first_output_held_ms, last_output_ms, partition, passed_over_ms_in, scheduler_queue_span};
use crate::correlate::{ms, percentile, Analysis, ChainSource, Request};
use crate::sink::json;
use crate::sink::{printable, trunc};
use crate::recording::Meta;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;

#[derive(Debug, Serialize)]
pub struct Report {
    pub schema: u32,
    /// Before `recording`: the requests are written as they are final, and
    /// the recording-wide parts are known only at the end.
    pub requests: Vec<RequestOut>,
    pub recording: RecordingInfo,
    pub chains: Vec<ChainOut>,
    pub kernels: Vec<KernelOut>,
    /// Run-level figures in `vllm bench serve`'s terms (sink::summary).
    pub summary: crate::sink::summary::Summary,
    /// Engine steps found in the CUPTI records, in order (docs/attribution.md).
    pub gpu_steps: Vec<GpuStepOut>,
    /// Compute per engine output step, where a figure exists, and its source.
    pub step_compute: Vec<StepComputeOut>,
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
    /// GPUs the host's driver reported (`record --nvml-period`): model, driver, memory.
    pub nvml_gpus: Vec<crate::correlate::NvmlGpu>,
    /// How the injected processes traced (CUPTI version, clock, CUDA graphs
    /// per node or per launch, kinds), processes alike together.
    pub cupti: Vec<crate::correlate::CuptiSetup>,
    /// Optional kernel tracepoints the recording was made without (e.g.
    /// `sock:sk_data_ready` before kernel 6.6: the `wire_*` fields are null).
    pub missing_tracepoints: Vec<String>,
    /// Which segments of a rotated recording were read (as one stream);
    /// null for a recording that was not rotated.
    pub segments: Option<crate::recording::SegmentsRead>,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct Phases {
    pub frontend: Option<f64>,
    pub queue: Option<f64>,
    pub prefill: Option<f64>,
    pub kv_transfer: Option<f64>,
    pub first_output: Option<f64>,
    pub decode: Option<f64>,
}

#[derive(Debug, Clone, Copy, Serialize)]
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
    /// The request body's `model`.
    pub model: Option<String>,
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
    /// The engine that ran it: `EngineCoreOutputs.engine_index`, the
    /// data-parallel rank (0 with one engine); null without engine outputs.
    pub engine_index: Option<u64>,
    /// How queue's end was found: "event" (SCHEDULED), "step" (end of the step
    /// before the first-token step), "submit" (no earlier step).
    pub scheduled_source: Option<String>,
    /// How queue's start (the hand-over to the engine) was found: "wake" (the
    /// wake-up of the frontend's ZMQ I/O thread), "arrival_time" (an ADD whose
    /// send woke nobody: placed after the latest wake-up-timed ADD by its
    /// `arrival_time`; with several API servers, by another one's such ADDs
    /// when its own has none within a second), "write" (the frontend's
    /// write), "read" (the engine's read: the frontend was not traced).
    pub submit_source: Option<String>,
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
    /// Largest GPU memory of the traced processes (all devices) while the
    /// request was in flight, from the NVML samples; null without samples.
    pub peak_gpu_mem_bytes: Option<u64>,
    /// Compute of the engine steps that carried the request, not split among
    /// their members: prefill (up to its first token) and decode; null when
    /// no step of it has a figure (docs/attribution.md).
    pub compute_ms: Option<ComputeMs>,
    /// Where `compute_ms` came from: "cupti" (the GPU time of the matched GPU
    /// steps) or "oncpu" (the engine thread's on-CPU time, without a GPU).
    pub compute_source: Option<String>,
    /// GPU steps the request's `gpu_ms` came from.
    pub gpu_steps: Option<u32>,
    /// Its share of the GPU kernels' time by name, most first (at most 8);
    /// null without GPU records (docs/attribution.md).
    pub kernels: Option<Vec<RequestKernelOut>>,
    /// The server closed the connection before the response ended (the
    /// client gave up, or the server dropped it); `done_ns`/`e2e_ms` are
    /// then null and `phases_ms` partition `closed_ms`.
    pub closed_ns: Option<u64>,
    /// Arrival to that close: how long the client waited before leaving.
    pub closed_ms: Option<f64>,
    /// Where `completion_tokens` came from: "usage" (the server's usage
    /// object) or "engine" (the tokens the engine generated for it, when no
    /// usage was sent: a stream without `stream_options.include_usage`, a
    /// client that left); null when neither was seen.
    pub completion_tokens_source: Option<String>,
    /// The Responses API response this request continued (its body's
    /// `previous_response_id`): its chain is that response's when no
    /// `traceparent` or chain header named one. Null otherwise.
    pub previous_response_id: Option<String>,
    /// The last output's path to the client: from the end of the engine step
    /// that carried its last output to `done`, as `first_output` is the first
    /// token's ([`crate::correlate::engine::last_output_ms`]); null without
    /// the IPC or for a request closed early.
    pub last_output_ms: Option<f64>,
    /// The part of `phases_ms.first_output` in which the engine went on
    /// making the request's tokens while the client saw no content: from
    /// the end of the step that made its first token to the end of the last
    /// step with its tokens that ended by the first content
    /// ([`crate::correlate::engine::first_output_held_ms`]); 0 when the
    /// first token's text went straight out. Null without a first content
    /// or without the IPC.
    pub first_output_held_ms: Option<f64>,
    /// The tokens the engine had produced for it when its first content
    /// left: 1 when the first token's text went straight out, more when
    /// the server held text back (stop strings, incomplete UTF-8, a
    /// reasoning or tool-call parser) or its output path was slower than a
    /// step. Null without a first content or without the IPC.
    pub tokens_before_first_content: Option<u64>,
    /// Chunks of a streamed chat or completions response that went out
    /// before its first content without text (vLLM sends one per output
    /// whose text it holds back: a stop string may be starting, incomplete
    /// UTF-8); the role chunk is not counted. Read on the wire alone. Null
    /// for other APIs (their events before the text are not outputs) and
    /// answers not streamed.
    pub empty_chunks_before_content: Option<u32>,
    /// The engine scheduler's own queue: its QUEUED stamp (the engine loop
    /// took the request in) to its first SCHEDULED, vLLM's
    /// `request_queue_time`; the rest of `phases_ms.queue` is the way in
    /// ([`crate::correlate::engine::scheduler_queue_ms`]). Null when the
    /// engine sent no stamps (stats off) or it never output.
    pub scheduler_queue_ms: Option<f64>,
    /// The structured-output constraint its engine request carried, by kind
    /// (`json`: a JSON schema, also what `response_format: json_schema` and
    /// a required or named tool choice become; `json_object`, `regex`,
    /// `choice`, `grammar`, `structural_tag`; `other`): vLLM's scheduler
    /// holds such a request until its grammar is compiled, which shows in
    /// `scheduler_queue_ms`. Null when it asked for none or without the
    /// IPC. Never the schema itself.
    pub structured_output: Option<String>,
    /// The backend the frontend chose to compile it (`xgrammar`,
    /// `guidance`, `outlines`, …), when the ADD named one.
    pub structured_output_backend: Option<String>,
    /// How many requests its engine's scheduler took in after it and
    /// scheduled before it. vLLM's FCFS scheduler lets a later request past
    /// only by skipping the earlier one (its grammar not compiled yet,
    /// remote KV not loaded, no LoRA slot free, or, chunked prefill off, a
    /// prompt over the token budget left), never for want of room: a full
    /// batch or token budget holds everyone behind it. Null where
    /// `scheduler_queue_ms` is. A request of higher priority (a lower ADD
    /// `priority`, `--scheduling-policy priority`) goes first by right and
    /// is not counted.
    pub scheduler_passed_over_by: Option<u32>,
    /// The part of `scheduler_queue_ms` in which it is known to have been
    /// skipped: from its QUEUED stamp to the latest scheduling of a request
    /// that passed it; 0 when none did. Null where `scheduler_queue_ms` is.
    pub scheduler_passed_over_ms: Option<f64>,
    /// For a request asking for structured output: when its grammar is known
    /// to have been ready, ms after its QUEUED stamp (within
    /// `scheduler_queue_ms`): the first scheduling on its engine of a request
    /// asking for the same constraint (the same schema and options, told by
    /// a keyed hash, never the schema), 0 when one was scheduled before it
    /// was queued — the backend compiles a constraint once and caches it
    /// (xgrammar). Its scheduler's queue past that was not its grammar. Null
    /// when no such request was seen, or without the stamps.
    pub scheduler_grammar_ready_ms: Option<f64>,
    /// The priority its ADD carried (vLLM's `priority` request field: under
    /// `--scheduling-policy priority` a lower value is scheduled first), when
    /// not the default 0. Null for 0, without the IPC, or where the ADD's
    /// layout was inferred (docs/decisions.md "Passed over").
    pub priority: Option<i64>,
}

/// A request's share of one kernel's GPU time ([`RequestOut::kernels`]).
#[derive(Debug, Clone, Serialize)]
pub struct RequestKernelOut {
    pub name: String,
    pub gpu_ms: f64,
}

impl json::Value for crate::correlate::gpu::KernelShare {
    fn write(&self, b: &mut Vec<u8>, level: usize) {
        let mut o = json::Obj::new(b, level);
        o.field("name", &*self.name).field("gpu_ms", &ms(self.gpu_ns));
        o.end();
    }
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct ComputeMs {
    pub prefill: Option<f64>,
    pub decode: Option<f64>,
    /// Steps with a figure.
    pub steps: u32,
}

/// One engine step found in the CUPTI records (docs/attribution.md).
#[derive(Debug, Serialize)]
pub struct GpuStepOut {
    /// The host's synchronize on the step-end copy returned.
    pub end_ns: u64,
    /// The step-end copy finished on the GPU.
    pub gpu_end_ns: u64,
    pub start_ns: u64,
    /// GPU busy time (the slowest rank's).
    pub gpu_ms: f64,
    /// New tokens, from the `reshape_and_cache*` grid; null without such kernels.
    pub tokens: Option<u64>,
    pub kernels: u32,
    pub graph_kernels: u32,
    /// The processes (ranks) that ran it.
    pub pids: Vec<u32>,
    /// The engine process whose step it is, when the engine IPC named one
    /// (with data parallelism, each engine has its own steps).
    pub engine_pid: Option<u32>,
}

/// One engine output step's compute.
#[derive(Debug, Serialize)]
pub struct StepComputeOut {
    pub end_ns: u64,
    pub compute_ms: f64,
    /// "cupti" or "oncpu".
    pub source: crate::correlate::gpu::ComputeSource,
}

#[derive(Debug, Serialize)]
pub struct ChainOut {
    pub chain: String,
    pub hops: Vec<String>,
    pub e2e_ms: Option<f64>,
    pub ttft_ms: Vec<Option<f64>>,
    pub prefix_cache_hit: Vec<Option<f64>>,
    pub source: String,
    // Additions beyond schema 1's list (allowed: add, never rename).
    /// The hops' E2E added up; null when a hop has none.
    pub hops_e2e_ms: Option<f64>,
    /// The chain's time outside the server: `e2e_ms - hops_e2e_ms` (the
    /// agent's own work between its calls). Negative when hops overlapped.
    pub between_hops_ms: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct KernelOut {
    pub name: String,
    pub count: u64,
    pub gpu_ms: f64,
}

/// One request as the report shows it.
pub fn request_out(r: &Request) -> RequestOut {
    let (mut itl, mut sorted) = (Vec::new(), Vec::new());
    request_ref(r, &mut itl, &mut sorted).to_out()
}

/// [`RequestOut`] borrowing from its [`Request`] (and the caller's ITL
/// buffer): what the streamed report writes without copying a string per
/// field. [`request_ref`] is the one place the figures are computed.
#[derive(Debug)]
pub struct RequestRef<'a> {
    pub id: &'a str,
    pub x_request_id: Option<&'a str>,
    pub traceparent: Option<&'a str>,
    pub chain: &'a str,
    pub hop: u32,
    pub method: &'a str,
    pub path: &'a str,
    pub model: Option<&'a str>,
    pub status: Option<u16>,
    pub arrive_ns: u64,
    pub ttft_ns: Option<u64>,
    pub done_ns: Option<u64>,
    pub ttft_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
    pub itl_ms: &'a [f64],
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
    pub chain_source: &'static str,
    pub content_chunks: usize,
    pub streamed: bool,
    pub request_bytes: u64,
    pub response_bytes: Option<u64>,
    pub finish_reason: Option<&'a str>,
    pub pid: u32,
    pub fd: i32,
    pub wire_arrive_ns: Option<u64>,
    pub read_delay_ms: Option<f64>,
    pub wire_ttft_ms: Option<f64>,
    pub wire_e2e_ms: Option<f64>,
    pub phase_source: &'static str,
    pub engine_request_id: Option<&'a str>,
    pub engine_index: Option<u64>,
    pub scheduled_source: Option<&'static str>,
    pub submit_source: Option<&'static str>,
    pub preemptions: Option<u32>,
    pub interference_from: &'a [crate::correlate::Name],
    pub computed_tokens: Option<u64>,
    pub marks_clamped: u32,
    pub steps_source: Option<&'static str>,
    pub peak_gpu_mem_bytes: Option<u64>,
    pub compute_ms: Option<ComputeMs>,
    pub compute_source: Option<&'static str>,
    pub gpu_steps: Option<u32>,
    pub kernels: Option<&'a [crate::correlate::gpu::KernelShare]>,
    pub closed_ns: Option<u64>,
    pub closed_ms: Option<f64>,
    pub completion_tokens_source: Option<&'static str>,
    pub previous_response_id: Option<&'a str>,
    pub last_output_ms: Option<f64>,
    pub first_output_held_ms: Option<f64>,
    pub tokens_before_first_content: Option<u64>,
    pub empty_chunks_before_content: Option<u32>,
    pub scheduler_queue_ms: Option<f64>,
    pub structured_output: Option<&'static str>,
    pub structured_output_backend: Option<&'a str>,
    pub scheduler_passed_over_by: Option<u32>,
    pub scheduler_passed_over_ms: Option<f64>,
    pub scheduler_grammar_ready_ms: Option<f64>,
    pub priority: Option<i64>,
}

/// The report's name of a chain key's source (its serde name).
pub fn chain_source_name(s: ChainSource) -> &'static str {
    match s {
        ChainSource::Traceparent => "traceparent",
        ChainSource::Header => "header",
        ChainSource::Connection => "connection",
    }
}

/// The report's name of a compute source (its serde name).
pub fn compute_source_name(s: crate::correlate::gpu::ComputeSource) -> &'static str {
    match s {
        crate::correlate::gpu::ComputeSource::Cupti => "cupti",
        crate::correlate::gpu::ComputeSource::Oncpu => "oncpu",
    }
}

/// A request's figures that its inter-token gaps play no part in: what
/// [`request_ref`] and the trace's slices (which show no ITLs, and so do not
/// sort them) both take from here.
pub struct CoreFigures<'a> {
    pub prompt_tokens: Option<u64>,
    /// The usage's, else the engine's count ([`RequestOut::completion_tokens_source`]).
    pub completion_tokens: Option<u64>,
    pub completion_tokens_source: Option<&'static str>,
    pub cached_tokens: Option<u64>,
    pub phases_ms: Phases,
    pub gpu_ms: GpuMs,
    pub interference_ms: Option<f64>,
    pub interference_from: &'a [crate::correlate::Name],
    pub compute_ms: Option<ComputeMs>,
    pub compute_source: Option<&'static str>,
    pub gpu_steps: Option<u32>,
    pub marks_clamped: u32,
    pub last_output_ms: Option<f64>,
    pub first_output_held_ms: Option<f64>,
    pub tokens_before_first_content: Option<u64>,
    pub scheduler_queue_ms: Option<f64>,
    pub scheduler_passed_over_by: Option<u32>,
    pub scheduler_passed_over_ms: Option<f64>,
    pub scheduler_grammar_ready_ms: Option<f64>,
}

pub fn core_figures(r: &Request) -> CoreFigures<'_> {
    let e = r.engine.as_ref();
    let w = r.wire_steps.as_ref();
    let part = partition(r);
    let sched = scheduler_queue_span(r);
    // KV copies on the critical path are carved out of the phase they fell
    // in, so the phases still add up (docs/attribution.md).
    let g = r.gpu.as_ref();
    let (mut queue, mut prefill) = (part.queue, part.prefill);
    let kv_transfer = g.filter(|_| e.is_some()).map(|g| {
        let q = queue.map_or(0.0, |x| ms(g.kv_queue_ns).min(x));
        let p = prefill.map_or(0.0, |x| ms(g.kv_prefill_ns).min(x));
        queue = queue.map(|x| x - q);
        prefill = prefill.map(|x| x - p);
        q + p
    });
    let c = r.compute.as_ref();
    let (completion_tokens, completion_tokens_source) = match (r.usage.completion_tokens, e) {
        (Some(n), _) => (Some(n), Some("usage")),
        (None, Some(e)) => (Some(e.generated_tokens), Some("engine")),
        (None, None) => (None, None),
    };
    CoreFigures {
        prompt_tokens: r.usage.prompt_tokens.or(e.and_then(|e| e.prompt_tokens)),
        completion_tokens,
        completion_tokens_source,
        cached_tokens: r.usage.cached_tokens.or(e.and_then(|e| e.cached_tokens)),
        // Wire alone shows decode (first content chunk → end); the engine IPC
        // adds frontend, queue, prefill and first_output; the GPU source
        // kv_transfer.
        phases_ms: Phases { frontend: part.frontend, queue, prefill, kv_transfer, first_output: part.first_output, decode: part.decode },
        gpu_ms: GpuMs { prefill: g.map(|g| ms(g.prefill_ns)), decode: g.map(|g| ms(g.decode_ns)), kv_transfer: g.map(|g| ms(g.kv_gpu_ns)) },
        interference_ms: e.map(|e| ms(e.interference_ns)).or(w.map(|w| ms(w.interference_ns))),
        interference_from: match (e, w) {
            (Some(e), _) => &e.interference_from,
            (None, Some(w)) => &w.interference_from,
            (None, None) => &[],
        },
        compute_ms: c.map(|c| ComputeMs { prefill: c.prefill_ns.map(ms), decode: c.decode_ns.map(ms), steps: c.steps }),
        compute_source: c.map(|c| compute_source_name(c.source)),
        gpu_steps: g.map(|g| g.steps),
        marks_clamped: part.clamped,
        last_output_ms: last_output_ms(r),
        first_output_held_ms: first_output_held_ms(r),
        tokens_before_first_content: e.and_then(|e| e.tokens_before_first_content),
        // One span for the scheduler's queue and the part of it passed over.
        scheduler_queue_ms: sched.map(|(a, b)| ms(b - a)),
        scheduler_passed_over_by: e.and_then(|e| e.passed_over_by).filter(|_| sched.is_some()),
        scheduler_passed_over_ms: e.zip(sched).and_then(|(e, s)| passed_over_ms_in(e, s)),
        scheduler_grammar_ready_ms: e.zip(sched).and_then(|(e, s)| crate::correlate::engine::grammar_ready_ms_in(e, s)),
    }
}

/// One request as the report shows it, borrowed; `itl` and `sorted` are
/// buffers reused from request to request (`itl` holds its ITLs after).
pub fn request_ref<'a>(r: &'a Request, itl: &'a mut Vec<f64>, sorted: &mut Vec<f64>) -> RequestRef<'a> {
    let e = r.engine.as_ref();
    let w = r.wire_steps.as_ref();
    let f = core_figures(r);
    itl.clear();
    itl.extend(r.content_ns.windows(2).map(|w| ms(w[1].saturating_sub(w[0]))));
    sorted.clear();
    sorted.extend_from_slice(itl);
    // Values equal under total_cmp are the same bits: unstable is stable here.
    sorted.sort_unstable_by(f64::total_cmp);
    RequestRef {
        id: &r.id,
        x_request_id: r.x_request_id.as_deref(),
        traceparent: r.traceparent.as_deref(),
        chain: &r.chain,
        hop: r.hop,
        method: &r.method,
        path: &r.path,
        model: r.model.as_deref(),
        status: r.status,
        arrive_ns: r.arrive_ns,
        ttft_ns: r.ttft_ns,
        done_ns: r.done_ns,
        ttft_ms: r.ttft_ms(),
        e2e_ms: r.e2e_ms(),
        itl_p50_ms: percentile(sorted, 50.0),
        itl_p90_ms: percentile(sorted, 90.0),
        itl_p99_ms: percentile(sorted, 99.0),
        itl_ms: itl,
        prompt_tokens: f.prompt_tokens,
        completion_tokens: f.completion_tokens,
        cached_tokens: f.cached_tokens,
        phases_ms: f.phases_ms,
        gpu_ms: f.gpu_ms,
        interference_ms: f.interference_ms,
        steps: e.map(|e| u64::from(e.steps)).or(w.map(|w| u64::from(w.steps))),
        chain_source: chain_source_name(r.chain_source),
        content_chunks: r.content_ns.len(),
        streamed: r.streamed,
        request_bytes: r.request_bytes,
        response_bytes: r.response_bytes,
        finish_reason: r.finish_reason.as_deref(),
        pid: r.conn.tgid,
        fd: r.conn.fd,
        wire_arrive_ns: r.wire_arrive_ns,
        read_delay_ms: r.read_delay_ms(),
        wire_ttft_ms: r.wire_ttft_ms(),
        wire_e2e_ms: r.wire_e2e_ms(),
        phase_source: if e.is_some() { "ipc" } else { "wire" },
        engine_request_id: e.map(|e| e.engine_request_id.as_str()),
        engine_index: e.and_then(|e| e.engine_index),
        scheduled_source: e.map(|e| e.scheduled_source),
        submit_source: e.map(|e| e.submit_source),
        preemptions: e.map(|e| e.preemptions),
        interference_from: f.interference_from,
        computed_tokens: e.and_then(|e| e.computed_tokens),
        marks_clamped: f.marks_clamped,
        steps_source: match (e, w) {
            (Some(_), _) => Some("ipc"),
            (None, Some(_)) => Some("sse-clusters"),
            (None, None) => None,
        },
        peak_gpu_mem_bytes: None,
        compute_ms: f.compute_ms,
        compute_source: f.compute_source,
        gpu_steps: f.gpu_steps,
        kernels: r.kernels.as_deref(),
        closed_ns: r.closed_early_ns(),
        closed_ms: r.closed_ms(),
        completion_tokens_source: f.completion_tokens_source,
        previous_response_id: r.previous_response_id.as_deref(),
        last_output_ms: f.last_output_ms,
        first_output_held_ms: f.first_output_held_ms,
        tokens_before_first_content: f.tokens_before_first_content,
        empty_chunks_before_content: r.empty_chunks(),
        scheduler_queue_ms: f.scheduler_queue_ms,
        structured_output: e.and_then(|e| e.structured.as_ref()).map(|s| s.kind),
        structured_output_backend: e.and_then(|e| e.structured.as_ref()).and_then(|s| s.backend.as_deref()),
        scheduler_passed_over_by: f.scheduler_passed_over_by,
        scheduler_passed_over_ms: f.scheduler_passed_over_ms,
        scheduler_grammar_ready_ms: f.scheduler_grammar_ready_ms,
        priority: e.and_then(|e| e.priority),
    }
}

impl RequestRef<'_> {
    /// The owned [`RequestOut`].
    pub fn to_out(&self) -> RequestOut {
        let own = |s: Option<&str>| s.map(str::to_owned);
        RequestOut {
            id: self.id.to_owned(),
            x_request_id: own(self.x_request_id),
            traceparent: own(self.traceparent),
            chain: Some(self.chain.to_owned()),
            hop: Some(self.hop),
            method: self.method.to_owned(),
            path: self.path.to_owned(),
            model: own(self.model),
            status: self.status,
            arrive_ns: self.arrive_ns,
            ttft_ns: self.ttft_ns,
            done_ns: self.done_ns,
            ttft_ms: self.ttft_ms,
            e2e_ms: self.e2e_ms,
            itl_ms: self.itl_ms.to_vec(),
            itl_p50_ms: self.itl_p50_ms,
            itl_p90_ms: self.itl_p90_ms,
            itl_p99_ms: self.itl_p99_ms,
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
            cached_tokens: self.cached_tokens,
            phases_ms: Phases { ..self.phases_ms },
            gpu_ms: GpuMs { ..self.gpu_ms },
            interference_ms: self.interference_ms,
            steps: self.steps,
            chain_source: self.chain_source.to_owned(),
            content_chunks: self.content_chunks,
            streamed: self.streamed,
            request_bytes: self.request_bytes,
            response_bytes: self.response_bytes,
            finish_reason: own(self.finish_reason),
            pid: self.pid,
            fd: self.fd,
            wire_arrive_ns: self.wire_arrive_ns,
            read_delay_ms: self.read_delay_ms,
            wire_ttft_ms: self.wire_ttft_ms,
            wire_e2e_ms: self.wire_e2e_ms,
            phase_source: self.phase_source.to_owned(),
            engine_request_id: own(self.engine_request_id),
            engine_index: self.engine_index,
            scheduled_source: own(self.scheduled_source),
            submit_source: own(self.submit_source),
            preemptions: self.preemptions,
            interference_from: self.interference_from.iter().map(|n| n.to_string()).collect(),
            computed_tokens: self.computed_tokens,
            marks_clamped: self.marks_clamped,
            steps_source: own(self.steps_source),
            peak_gpu_mem_bytes: self.peak_gpu_mem_bytes,
            compute_ms: self.compute_ms.as_ref().map(|c| ComputeMs { ..*c }),
            compute_source: own(self.compute_source),
            gpu_steps: self.gpu_steps,
            kernels: self.kernels.map(|k| k.iter().map(|k| RequestKernelOut { name: k.name.to_string(), gpu_ms: ms(k.gpu_ns) }).collect()),
            closed_ns: self.closed_ns,
            closed_ms: self.closed_ms,
            completion_tokens_source: own(self.completion_tokens_source),
            previous_response_id: own(self.previous_response_id),
            last_output_ms: self.last_output_ms,
            first_output_held_ms: self.first_output_held_ms,
            tokens_before_first_content: self.tokens_before_first_content,
            empty_chunks_before_content: self.empty_chunks_before_content,
            scheduler_queue_ms: self.scheduler_queue_ms,
            structured_output: own(self.structured_output),
            structured_output_backend: own(self.structured_output_backend),
            scheduler_passed_over_by: self.scheduler_passed_over_by,
            scheduler_passed_over_ms: self.scheduler_passed_over_ms,
            scheduler_grammar_ready_ms: self.scheduler_grammar_ready_ms,
            priority: self.priority,
        }
    }

    /// The request as `to_writer_pretty` writes [`RequestOut`], its braces at `level`.
    pub fn write_json(&self, b: &mut Vec<u8>, level: usize) {
        let mut o = json::Obj::new(b, level);
        o.field("id", self.id)
            .field("x_request_id", &self.x_request_id)
            .field("traceparent", &self.traceparent)
            .field("chain", self.chain)
            .field("hop", &self.hop)
            .field("method", self.method)
            .field("path", self.path)
            .field("model", &self.model)
            .field("status", &self.status)
            .field("arrive_ns", &self.arrive_ns)
            .field("ttft_ns", &self.ttft_ns)
            .field("done_ns", &self.done_ns)
            .field("ttft_ms", &self.ttft_ms)
            .field("e2e_ms", &self.e2e_ms)
            .field("itl_ms", self.itl_ms)
            .field("itl_p50_ms", &self.itl_p50_ms)
            .field("itl_p90_ms", &self.itl_p90_ms)
            .field("itl_p99_ms", &self.itl_p99_ms)
            .field("prompt_tokens", &self.prompt_tokens)
            .field("completion_tokens", &self.completion_tokens)
            .field("cached_tokens", &self.cached_tokens);
        let p = &self.phases_ms;
        o.object("phases_ms", Some(p), |o, p| {
            o.field("frontend", &p.frontend)
                .field("queue", &p.queue)
                .field("prefill", &p.prefill)
                .field("kv_transfer", &p.kv_transfer)
                .field("first_output", &p.first_output)
                .field("decode", &p.decode);
        });
        o.object("gpu_ms", Some(&self.gpu_ms), |o, g| {
            o.field("prefill", &g.prefill).field("decode", &g.decode).field("kv_transfer", &g.kv_transfer);
        });
        o.field("interference_ms", &self.interference_ms)
            .field("steps", &self.steps)
            .field("chain_source", self.chain_source)
            .field("content_chunks", &self.content_chunks)
            .field("streamed", &self.streamed)
            .field("request_bytes", &self.request_bytes)
            .field("response_bytes", &self.response_bytes)
            .field("finish_reason", &self.finish_reason)
            .field("pid", &self.pid)
            .field("fd", &self.fd)
            .field("wire_arrive_ns", &self.wire_arrive_ns)
            .field("read_delay_ms", &self.read_delay_ms)
            .field("wire_ttft_ms", &self.wire_ttft_ms)
            .field("wire_e2e_ms", &self.wire_e2e_ms)
            .field("phase_source", self.phase_source)
            .field("engine_request_id", &self.engine_request_id)
            .field("engine_index", &self.engine_index)
            .field("scheduled_source", &self.scheduled_source)
            .field("submit_source", &self.submit_source)
            .field("preemptions", &self.preemptions)
            .field("interference_from", self.interference_from)
            .field("computed_tokens", &self.computed_tokens)
            .field("marks_clamped", &self.marks_clamped)
            .field("steps_source", &self.steps_source)
            .field("peak_gpu_mem_bytes", &self.peak_gpu_mem_bytes);
        o.object("compute_ms", self.compute_ms.as_ref(), |o, c| {
            o.field("prefill", &c.prefill).field("decode", &c.decode).field("steps", &c.steps);
        });
        o.field("compute_source", &self.compute_source)
            .field("gpu_steps", &self.gpu_steps)
            .field("kernels", &self.kernels)
            .field("closed_ns", &self.closed_ns)
            .field("closed_ms", &self.closed_ms)
            .field("completion_tokens_source", &self.completion_tokens_source)
            .field("previous_response_id", &self.previous_response_id)
            .field("last_output_ms", &self.last_output_ms)
            .field("first_output_held_ms", &self.first_output_held_ms)
            .field("tokens_before_first_content", &self.tokens_before_first_content)
            .field("empty_chunks_before_content", &self.empty_chunks_before_content)
            .field("scheduler_queue_ms", &self.scheduler_queue_ms)
            .field("structured_output", &self.structured_output)
            .field("structured_output_backend", &self.structured_output_backend)
            .field("scheduler_passed_over_by", &self.scheduler_passed_over_by)
            .field("scheduler_passed_over_ms", &self.scheduler_passed_over_ms)
            .field("scheduler_grammar_ready_ms", &self.scheduler_grammar_ready_ms)
            .field("priority", &self.priority);
        o.end();
    }
}

/// A chain's E2E less its hops' ([`ChainOut::between_hops_ms`]).
pub(crate) fn between_hops_ms(e2e_ms: Option<f64>, hops_e2e_ms: Option<f64>) -> Option<f64> {
    Some(e2e_ms? - hops_e2e_ms?)
}

/// The report's schema (../shared/contract.md): fields are added, never renamed.
pub const SCHEMA: u32 = 1;

/// How many kernels the report lists.
pub const TOP_KERNELS: usize = 20;

/// Builds the schema-1 report.
pub fn build(path: &str, meta: &Meta, analysis: &Analysis, read_error: Option<String>) -> Report {
    let duration_ms = match (analysis.first_ns, analysis.last_ns) {
        // From the start of recording when known, else from the first event.
        (Some(f), Some(l)) => ms(l.saturating_sub(if meta.start_ns > 0 && meta.start_ns <= f { meta.start_ns } else { f })),
        _ => 0.0,
    };
    let requests: Vec<RequestOut> = analysis.requests.iter().map(request_out).collect();
    let chains: Vec<ChainOut> = analysis
        .chains
        .iter()
        .map(|c| {
            let hops: Vec<&Request> = c.hops.iter().map(|&i| &analysis.requests[i]).collect();
            let first = hops.first().map(|r| r.arrive_ns);
            // A hop its client left ends at the close: the chain went on.
            let last_done = hops.iter().map(|r| r.waited_until_ns()).collect::<Option<Vec<u64>>>().and_then(|d| d.into_iter().max());
            let e2e_ms = match (first, last_done) {
                (Some(f), Some(l)) => Some(ms(l.saturating_sub(f))),
                _ => None,
            };
            let hops_e2e_ms = hops.iter().try_fold(0.0, |t, r| Some(t + r.e2e_ms().or(r.closed_ms())?));
            ChainOut {
                chain: c.chain.clone(),
                hops: hops.iter().map(|r| r.id.clone()).collect(),
                e2e_ms,
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
                source: chain_source_name(c.source).to_owned(),
                hops_e2e_ms,
                between_hops_ms: between_hops_ms(e2e_ms, hops_e2e_ms),
            }
        })
        .collect();
    let summary = crate::sink::summary::compute(&requests, &chains, crate::sink::summary::DEFAULT_PERCENTILES);
    Report {
        schema: SCHEMA,
        summary,
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
            nvml_gpus: analysis.nvml_gpus.clone(),
            cupti: analysis.cupti.clone(),
            missing_tracepoints: meta.missing_tracepoints.clone(),
            segments: meta.segment.as_ref().map(|g| crate::recording::SegmentsRead { run_start_ns: g.run_start_ns, first: g.index, last: g.index }),
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
        gpu_steps: analysis.gpu_steps.iter().map(gpu_step_out).collect(),
        step_compute: analysis.step_compute.iter().map(step_compute_out).collect(),
    }
}

fn gpu_step_out(g: &crate::correlate::gpu::GpuStep) -> GpuStepOut {
    GpuStepOut {
        end_ns: g.end_ns,
        gpu_end_ns: g.gpu_end_ns,
        start_ns: g.start_ns,
        gpu_ms: ms(g.gpu_ns),
        tokens: g.tokens,
        kernels: g.kernels(),
        graph_kernels: g.graph_kernels(),
        pids: g.ranks.iter().map(|r| r.pid).collect(),
        engine_pid: g.engine,
    }
}

fn step_compute_out(c: &crate::correlate::gpu::StepCompute) -> StepComputeOut {
    StepComputeOut { end_ns: c.end_ns, compute_ms: ms(c.compute_ns), source: c.source }
}

fn opt(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{x:.2}"))
}

fn opt_u(v: Option<u64>) -> String {
    v.map_or_else(|| "-".into(), |x| x.to_string())
}

/// What the text tables show of a request ([`RequestOut`] or, streamed,
/// [`RequestRef`]): one formatter for both, so they print the same bytes.
struct TextRow<'a> {
    id: &'a str,
    chain: Option<&'a str>,
    hop: Option<u32>,
    method: &'a str,
    path: &'a str,
    status: Option<u16>,
    ttft_ms: Option<f64>,
    e2e_ms: Option<f64>,
    itl_ms: &'a [f64],
    itl_p50_ms: Option<f64>,
    itl_p90_ms: Option<f64>,
    itl_p99_ms: Option<f64>,
    content_chunks: usize,
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    cached_tokens: Option<u64>,
    phases_ms: &'a Phases,
    interference_ms: Option<f64>,
    interference_from: Vec<&'a str>,
    preemptions: Option<u32>,
    gpu_ms: GpuMs,
    model: Option<&'a str>,
    closed_ms: Option<f64>,
    first_output_held_ms: Option<f64>,
    tokens_before_first_content: Option<u64>,
    empty_chunks_before_content: Option<u32>,
    scheduler_queue_ms: Option<f64>,
    structured_output: Option<&'a str>,
    scheduler_passed_over_by: Option<u32>,
    scheduler_passed_over_ms: Option<f64>,
    scheduler_grammar_ready_ms: Option<f64>,
}

impl<'a> From<&'a RequestOut> for TextRow<'a> {
    fn from(q: &'a RequestOut) -> Self {
        TextRow {
            id: &q.id,
            chain: q.chain.as_deref(),
            hop: q.hop,
            method: &q.method,
            path: &q.path,
            status: q.status,
            ttft_ms: q.ttft_ms,
            e2e_ms: q.e2e_ms,
            itl_ms: &q.itl_ms,
            itl_p50_ms: q.itl_p50_ms,
            itl_p90_ms: q.itl_p90_ms,
            itl_p99_ms: q.itl_p99_ms,
            content_chunks: q.content_chunks,
            prompt_tokens: q.prompt_tokens,
            completion_tokens: q.completion_tokens,
            cached_tokens: q.cached_tokens,
            phases_ms: &q.phases_ms,
            interference_ms: q.interference_ms,
            interference_from: q.interference_from.iter().map(|x| &**x).collect(),
            preemptions: q.preemptions,
            gpu_ms: q.gpu_ms,
            model: q.model.as_deref(),
            closed_ms: q.closed_ms,
            first_output_held_ms: q.first_output_held_ms,
            tokens_before_first_content: q.tokens_before_first_content,
            empty_chunks_before_content: q.empty_chunks_before_content,
            scheduler_queue_ms: q.scheduler_queue_ms,
            structured_output: q.structured_output.as_deref(),
            scheduler_passed_over_by: q.scheduler_passed_over_by,
            scheduler_passed_over_ms: q.scheduler_passed_over_ms,
            scheduler_grammar_ready_ms: q.scheduler_grammar_ready_ms,
        }
    }
}

impl<'a> From<&'a RequestRef<'a>> for TextRow<'a> {
    fn from(q: &'a RequestRef<'a>) -> Self {
        TextRow {
            id: q.id,
            chain: Some(q.chain),
            hop: Some(q.hop),
            method: q.method,
            path: q.path,
            status: q.status,
            ttft_ms: q.ttft_ms,
            e2e_ms: q.e2e_ms,
            itl_ms: q.itl_ms,
            itl_p50_ms: q.itl_p50_ms,
            itl_p90_ms: q.itl_p90_ms,
            itl_p99_ms: q.itl_p99_ms,
            content_chunks: q.content_chunks,
            prompt_tokens: q.prompt_tokens,
            completion_tokens: q.completion_tokens,
            cached_tokens: q.cached_tokens,
            phases_ms: &q.phases_ms,
            interference_ms: q.interference_ms,
            interference_from: q.interference_from.iter().map(|x| &**x).collect(),
            preemptions: q.preemptions,
            gpu_ms: q.gpu_ms,
            model: q.model,
            closed_ms: q.closed_ms,
            first_output_held_ms: q.first_output_held_ms,
            tokens_before_first_content: q.tokens_before_first_content,
            empty_chunks_before_content: q.empty_chunks_before_content,
            scheduler_queue_ms: q.scheduler_queue_ms,
            structured_output: q.structured_output,
            scheduler_passed_over_by: q.scheduler_passed_over_by,
            scheduler_passed_over_ms: q.scheduler_passed_over_ms,
            scheduler_grammar_ready_ms: q.scheduler_grammar_ready_ms,
        }
    }
}

/// The recording line, the read error and the request table's header.
fn text_head(s: &mut String, rep: &Report) {
    let r = &rep.recording;
    let _ = writeln!(s, "recording {}  ({:.1} s, pids {:?}, gpu: {})", r.path, r.duration_ms / 1e3, r.pids, if r.gpu { "yes" } else { "no" });
    if let Some(e) = &r.read_error {
        let _ = writeln!(s, "WARNING: the recording ends early: {e} (report covers what precedes it)");
    }
    match r.segments {
        Some(g) if g.first == g.last => {
            let _ = writeln!(s, "segment {} of a rotated recording: a request in flight when it began or ended has its other part in the segment before or after it (counted below as `…_without_request` / `requests_unfinished`); report consecutive segments together to join them", g.first);
        }
        Some(g) => {
            let _ = writeln!(s, "segments {}-{} of a rotated recording, read as one", g.first, g.last);
        }
        None => {}
    }
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "{:<34} {:<18} {:>4} {:<6} {:<22} {:>6} {:>9} {:>9} {:>8} {:>8} {:>8} {:>6} {:>6} {:>6}",
        "request", "chain", "hop", "method", "path", "status", "ttft_ms", "e2e_ms", "itl_p50", "itl_p90", "itl_p99", "chunks", "in", "out"
    );
}

/// A request's line in the request table. One whose connection closed
/// before its response ended shows `closed` for its status and, in
/// parentheses for its E2E, how long the client waited.
fn request_line(s: &mut String, q: &TextRow) {
    let chain = q.chain.unwrap_or("-");
    let (status, e2e) = match (q.e2e_ms, q.closed_ms) {
        (None, Some(c)) => ("closed".to_owned(), format!("({c:.2})")),
        _ => (q.status.map_or("-".into(), |x| x.to_string()), opt(q.e2e_ms)),
    };
    let _ = writeln!(
        s,
        "{:<34} {:<18} {:>4} {:<6} {:<22} {:>6} {:>9} {:>9} {:>8} {:>8} {:>8} {:>6} {:>6} {:>6}",
        trunc(q.id, 34),
        trunc(chain, 18),
        q.hop.map_or("-".into(), |h| h.to_string()),
        q.method,
        trunc(q.path, 22),
        status,
        opt(q.ttft_ms),
        e2e,
        opt(q.itl_p50_ms),
        opt(q.itl_p90_ms),
        opt(q.itl_p99_ms),
        q.content_chunks,
        opt_u(q.prompt_tokens),
        opt_u(q.completion_tokens),
    );
}

/// The models a chain's hops named, as its table shows them: none, one (in
/// its title), or several (a column).
#[derive(Debug, Clone, Copy, PartialEq)]
enum ChainModels<'a> {
    None,
    One(&'a str),
    Several,
}

/// A chain's hops' models seen so far, in hop order (`model_of` their
/// rows), which may come from a reused buffer: the first is kept.
#[derive(Default)]
struct ModelsSeen {
    hops: usize,
    first: Option<String>,
    several: bool,
}

impl ModelsSeen {
    /// Adds a hop's model; false once they are known to be several (no
    /// later hop can change that).
    fn add(&mut self, model: Option<&str>) -> bool {
        if self.hops == 0 {
            self.first = model.map(str::to_owned);
        } else if model != self.first.as_deref() {
            self.several = true;
        }
        self.hops += 1;
        !self.several
    }

    fn models(&self) -> ChainModels<'_> {
        match (self.several, &self.first) {
            (true, _) => ChainModels::Several,
            (false, Some(m)) => ChainModels::One(m),
            (false, None) => ChainModels::None,
        }
    }
}

impl ChainModels<'_> {
    /// Whether the rows end with a model column.
    fn column(self) -> bool {
        self == ChainModels::Several
    }
}

/// What a chain's title says.
struct ChainTitle<'a> {
    chain: &'a str,
    source: &'a str,
    hops: usize,
    e2e_ms: Option<f64>,
    models: ChainModels<'a>,
}

/// A chain's title and its hop table's header.
fn chain_head(s: &mut String, t: &ChainTitle<'_>, gpu: bool, gpu_mem: bool) {
    let ChainTitle { chain, source, hops, e2e_ms, models } = *t;
    let model = match models {
        ChainModels::One(m) => format!(", model {m}"),
        _ => String::new(),
    };
    let _ = writeln!(s, "\nchain {} ({}, {} hops, e2e {} ms{model})", printable(chain), source, hops, opt(e2e_ms));
    let _ = write!(s, "  {:>3} {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}", "hop", "ttft_ms", "front", "queue", "prefill", "kv", "1st_out", "decode", "interf");
    if gpu {
        let _ = write!(s, " {:>8} {:>8}", "gpu_pf", "gpu_dec");
    }
    let _ = write!(s, " {:>8} {:>6} {:>6} {:>6} {:>6} {:>9}", "itl_avg", "itl90", "in", "out", "cached", "e2e_ms");
    let _ = write!(s, "{}", if gpu_mem { format!(" {:>11}", "gpu_mem_mib") } else { String::new() });
    let _ = writeln!(s, "{}", if models.column() { "  model" } else { "" });
}

/// A hop's row after its number, without the GPU memory column: its figures
/// (no newline), then, after a newline, the note under it if it has one
/// ([`hop_note`]); [`write_hop`] puts the pieces together. `gpu`: the
/// recording has GPU records, so the row has the GPU shares of prefill and
/// decode (`gpu_ms`). Returns the figures, which the chain's sum row adds up.
fn hop_figures(s: &mut String, q: &TextRow, gpu: bool) -> HopSums {
    let avg = (!q.itl_ms.is_empty()).then(|| q.itl_ms.iter().sum::<f64>() / q.itl_ms.len() as f64);
    let h = HopSums::of(q);
    row_figures(s, &h, [avg, q.itl_p90_ms], gpu, q.e2e_ms.is_none() && q.closed_ms.is_some());
    if let Some(m) = q.model {
        // Escaped, so the separator cannot be in it.
        let _ = write!(s, "{MODEL_SEP}{}", printable(m));
    }
    hop_note(s, q);
    h
}

/// Between a hop row's figures and its model, when it named one.
const MODEL_SEP: char = '\u{1f}';

/// The model a hop's row ([`hop_figures`]) names, escaped.
fn model_of(row: &str) -> Option<&str> {
    row.split_once('\n').map_or(row, |(figures, _)| figures).split_once(MODEL_SEP).map(|(_, m)| m)
}

/// A chain table's row after its first column, in [`chain_head`]'s order:
/// `h`'s figures with `itl` (mean, p90) before the token counts; a hop's row
/// and the chain's sum row alike. `closed`: the hop's client left before
/// its response ended; its E2E column, its wait to the close, is in
/// parentheses (as in the request table).
fn row_figures(s: &mut String, h: &HopSums, itl: [Option<f64>; 2], gpu: bool, closed: bool) {
    let f = |k: usize| opt(h.0[k]);
    let _ = write!(s, " {:>9} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}", f(0), f(1), f(2), f(3), f(4), f(5), f(6), f(7));
    if gpu {
        let _ = write!(s, " {:>8} {:>8}", f(8), f(9));
    }
    // Token counts are whole (exact as f64 far past any count).
    let t = |k: usize| h.0[k].map_or_else(|| "-".into(), |v| format!("{v:.0}"));
    let e2e = match h.0[E2E] {
        Some(v) if closed => format!("({v:.2})"),
        _ => f(E2E),
    };
    let _ = write!(s, " {:>8} {:>6} {:>6} {:>6} {:>6} {:>9}", opt(itl[0]), opt(itl[1]), t(10), t(11), t(12), e2e);
}

/// Interferers named under a hop's row at most; the JSON report lists all.
const NOTE_NAMES: usize = 4;

/// The share of a hop's E2E its interference must reach to be told under
/// its row: on a busy server nearly every decode shares steps with some
/// prefill, and a line under every row would hide the hops it slowed down.
const NOTE_SHARE: f64 = 0.10;

/// The line under a hop's row saying why its decode was slow, when the
/// figures alone do not: whose co-batched prefill took its decode time
/// (`interference_from`) when that was at least [`NOTE_SHARE`] of its E2E,
/// how often the engine preempted it, when the client left before the
/// response ended, and, for a queue of at least [`NOTE_SHARE`] of its E2E
/// that the engine's stamps split, how much of it passed before the engine
/// took the request in (and, for a request later ones went past, that the
/// scheduler skipped it; else, for a request that asked for structured output
/// and spent most of its queue in the scheduler's, that it waited there for
/// a free slot or for its grammar: the stamps do not tell which, unless a
/// request asking for the same constraint was scheduled while it waited,
/// which says when its grammar was ready). Starts
/// with the newline that ends the row's figures.
fn hop_note(s: &mut String, q: &TextRow) {
    let mut parts = Vec::new();
    if let (None, Some(c)) = (q.e2e_ms, q.closed_ms) {
        parts.push(format!("connection closed {c:.2} ms after arrival, before the response ended (the client gave up): the phases run to the close"));
    }
    // Not with KV carved out of the queue: the scheduler's part holds it.
    let p = q.phases_ms;
    if let (Some(queue), Some(sched), Some(e2e), None) = (p.queue, q.scheduler_queue_ms, q.e2e_ms.or(q.closed_ms), p.kv_transfer.filter(|k| *k > 0.0)) {
        if queue > 0.0 && queue >= NOTE_SHARE * e2e {
            let mut note = format!("queued {queue:.2} ms: {:.2} before the engine took it in (the IPC, the step it was running), {sched:.2} in the scheduler's queue", (queue - sched).max(0.0));
            // Requests let past it prove the scheduler skipped it, whatever
            // share of the queue was the scheduler's (a long step before the
            // engine took it in can be most); none let past says nothing
            // either way (none may have come), so the either-or only where
            // the scheduler's queue is most of it: a grammar compiled before
            // holds nothing.
            match (q.scheduler_passed_over_by, q.structured_output) {
                (Some(n @ 1..), kind) => {
                    let _ = write!(
                        note,
                        " ({n} later request{} went past it, the last {:.2} ms after it was queued: vLLM's scheduler lets one past only while it skips this one, ",
                        if n == 1 { "" } else { "s" },
                        q.scheduler_passed_over_ms.unwrap_or(0.0)
                    );
                    match kind {
                        Some(kind) => {
                            let _ = write!(note, "here for its grammar: it asked for structured output, {}, which is held until its grammar is compiled)", printable(kind));
                        }
                        None => note.push_str("for remote KV not loaded yet, no free LoRA slot, or, chunked prefill off, a prompt over the token budget left)"),
                    }
                }
                // A request asking for the same constraint scheduled while
                // this one still waited: its grammar was ready (the backend
                // compiles a constraint once), so what held it after was
                // room (or the step in progress), when that was most of it.
                (_, Some(kind)) if sched >= 0.5 * queue && q.scheduler_grammar_ready_ms.is_some_and(|r| sched - r >= 0.5 * sched) => {
                    let ready = q.scheduler_grammar_ready_ms.unwrap_or(0.0);
                    let _ = write!(
                        note,
                        " (its grammar — structured output, {} — was ready within {ready:.2} ms, when a request asking for the same was scheduled; the {:.2} ms after it waited for room: a free slot, the token budget or KV blocks, or the step in progress)",
                        printable(kind),
                        sched - ready
                    );
                }
                (_, Some(kind)) if sched >= 0.5 * queue => {
                    let _ = write!(note, " (for a free slot, or for its grammar: it asked for structured output, {}, which vLLM's scheduler holds until its grammar is compiled)", printable(kind));
                }
                _ => {}
            }
            parts.push(note);
        }
    }
    if let Some(note) = held_note(q) {
        parts.push(note);
    }
    let material = matches!((q.interference_ms, q.e2e_ms), (Some(i), Some(e)) if i > 0.0 && i >= NOTE_SHARE * e);
    if material && !q.interference_from.is_empty() {
        let mut names = q.interference_from.iter().take(NOTE_NAMES).map(|n| printable(n)).collect::<Vec<_>>().join(", ");
        if q.interference_from.len() > NOTE_NAMES {
            let _ = write!(names, " and {} more", q.interference_from.len() - NOTE_NAMES);
        }
        parts.push(format!("decode lost {} ms to the co-batched prefill of {}", opt(q.interference_ms), names));
    }
    if let Some(n @ 1..) = q.preemptions {
        parts.push(format!("preempted {n} time{}", if n == 1 { "" } else { "s" }));
    }
    if !parts.is_empty() {
        let _ = write!(s, "\n        ^ {}", parts.join("; "));
    }
}

/// The note of a hop whose engine went on making tokens for at least
/// [`NOTE_SHARE`] of its TTFT (and 1 ms) before its first content left:
/// text the engine had made that the client did not see yet, which neither
/// the wire nor the engine's figures show alone.
fn held_note(q: &TextRow) -> Option<String> {
    let ttft = q.ttft_ms?;
    let (held, n) = (q.first_output_held_ms?, q.tokens_before_first_content?);
    if n < 2 || held < 1.0 || held < NOTE_SHARE * ttft {
        return None;
    }
    let mut note = format!("first content {held:.2} ms after the first token, {n} tokens generated by then");
    let why = match q.empty_chunks_before_content {
        // The stream sent those outputs, without their text: held, not late.
        Some(k @ 1..) => {
            let _ = write!(note, ", {k} chunk{} without text sent meanwhile", if k == 1 { "" } else { "s" });
            HELD_WHYS[0].0
        }
        _ => HELD_WHYS[1].0,
    };
    note.push_str(why);
    Some(note)
}

/// Why a first content can come tokens after the first token, and the few
/// words that stand for it once told: each is told once per chain table.
const HELD_WHYS: [(&str, &str); 2] = [
    (": the server held their text back (a stop string may have been starting, or incomplete UTF-8)", " (held back, as above)"),
    (": the server held their text back (stop strings, incomplete UTF-8, a parser waiting for a whole tag) or its output path fell behind the steps", " (held back or behind, as above)"),
];

/// What a chain table's notes have explained already (its hops' notes are
/// made one request at a time, without the chain): one bit per [`HELD_WHYS`].
#[derive(Default)]
struct NotesTold {
    held: u8,
}

/// A hop's line in its chain table: its number, its figures ([`hop_figures`],
/// made now or read back from the spool), its GPU memory column if the chain
/// has one, then the note under it.
fn write_hop(s: &mut String, n: usize, row: &str, gpu_mem: bool, peak_gpu_mem_bytes: Option<u64>, models: ChainModels<'_>, told: &mut NotesTold) {
    let (figures, note) = row.split_once('\n').unwrap_or((row, ""));
    let figures = figures.split_once(MODEL_SEP).map_or(figures, |(f, _)| f);
    let _ = write!(s, "  {:>3}{figures}", n);
    row_end(s, gpu_mem, peak_gpu_mem_bytes, models.column().then(|| model_of(row).unwrap_or("-")));
    if note.is_empty() {
        return;
    }
    for (bit, (why, again)) in HELD_WHYS.iter().enumerate() {
        if let Some((before, after)) = note.split_once(why) {
            if told.held & 1 << bit != 0 {
                let _ = writeln!(s, "{before}{again}{after}");
                return;
            }
            told.held |= 1 << bit;
        }
    }
    let _ = writeln!(s, "{note}");
}

/// The end of a chain table's row: its GPU memory column, if the chain has
/// one, and its model column, if the chain's hops named several.
fn row_end(s: &mut String, gpu_mem: bool, peak_gpu_mem_bytes: Option<u64>, model: Option<&str>) {
    let mib = peak_gpu_mem_bytes.map(|b| b as f64 / (1u64 << 20) as f64);
    let _ = write!(s, "{}", if gpu_mem { format!(" {:>11}", opt(mib)) } else { String::new() });
    let _ = writeln!(s, "{}", model.map_or_else(String::new, |m| format!("  {}", trunc(m, 48))));
}

/// What a chain's `sum` row adds up of each hop, in the table's column
/// order: TTFT, the six phases, interference, the GPU shares of prefill and
/// decode, prompt, output and cached tokens, E2E.
#[derive(Debug, Clone, Copy, PartialEq)]
struct HopSums([Option<f64>; SUMS]);

const SUMS: usize = 14;
const SUMS_BYTES: usize = SUMS * 8;
/// Where E2E is in [`HopSums`].
const E2E: usize = 13;

impl HopSums {
    fn of(q: &TextRow) -> Self {
        let p = q.phases_ms;
        let n = |v: Option<u64>| v.map(|x| x as f64);
        HopSums([
            q.ttft_ms,
            p.frontend,
            p.queue,
            p.prefill,
            p.kv_transfer,
            p.first_output,
            p.decode,
            q.interference_ms,
            q.gpu_ms.prefill,
            q.gpu_ms.decode,
            n(q.prompt_tokens),
            n(q.completion_tokens),
            n(q.cached_tokens),
            // A hop its client left: its wait, to the close.
            q.e2e_ms.or(q.closed_ms),
        ])
    }

    fn encode(&self) -> [u8; SUMS_BYTES] {
        let mut b = [0u8; SUMS_BYTES];
        for (k, v) in self.0.iter().enumerate() {
            b[8 * k..8 * k + 8].copy_from_slice(&opt_bits(*v));
        }
        b
    }

    fn decode(b: &[u8; SUMS_BYTES]) -> Self {
        HopSums(std::array::from_fn(|k| bits_opt(&b[8 * k..8 * k + 8])))
    }
}

/// A chain's `sum` row, added up hop by hop: a column's sum when every hop
/// has the figure, else `-`; the GPU memory column's largest peak.
#[derive(Default)]
struct ChainSums {
    hops: usize,
    total: [f64; SUMS],
    known: [usize; SUMS],
    peak: Option<u64>,
}

impl ChainSums {
    fn add(&mut self, h: &HopSums, peak_gpu_mem_bytes: Option<u64>) {
        self.hops += 1;
        for (k, v) in h.0.iter().enumerate() {
            if let Some(v) = v {
                self.total[k] += v;
                self.known[k] += 1;
            }
        }
        self.peak = self.peak.max(peak_gpu_mem_bytes);
    }

    fn get(&self, k: usize) -> Option<f64> {
        (self.known[k] == self.hops).then_some(self.total[k])
    }

    /// The sum row's figures.
    fn row(&self) -> HopSums {
        HopSums(std::array::from_fn(|k| self.get(k)))
    }

    /// The `sum` row, and under it the time the chain spent outside the
    /// server: its E2E less its hops' (the agent's own work between calls),
    /// or how much the hops overlapped. Nothing for a chain of one hop.
    fn write(&self, s: &mut String, gpu: bool, gpu_mem: bool, chain_e2e_ms: Option<f64>) {
        if self.hops < 2 {
            return;
        }
        let _ = write!(s, "  {:>3}", "sum");
        row_figures(s, &self.row(), [None, None], gpu, false);
        row_end(s, gpu_mem, self.peak, None);
        if let (Some(chain), Some(outside)) = (chain_e2e_ms, between_hops_ms(chain_e2e_ms, self.get(E2E))) {
            if outside >= 0.0 {
                let _ = writeln!(s, "        between hops (the client's own time): {outside:.2} ms of the chain's {chain:.2} ms");
            } else {
                let _ = writeln!(s, "        the hops overlap: their E2E add up to {:.2} ms more than the chain's {chain:.2} ms", -outside);
            }
        }
    }
}

/// The GPUs, the summary, the kernels and the counters.
fn text_tail(s: &mut String, rep: &Report) {
    let r = &rep.recording;
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
    for g in &r.nvml_gpus {
        let _ = write!(s, "gpu {} (nvml): {} ({:.0} GiB, driver {})", g.device, g.name, g.total_mem_bytes as f64 / (1u64 << 30) as f64, g.driver);
        let mib_s = |v: Option<u64>| v.map_or("-".to_owned(), |v| format!("{:.1}", v as f64 / 1024.0));
        for (link, tx, rx) in [("PCIe", g.pcie_tx_peak_kib_s, g.pcie_rx_peak_kib_s), ("NVLink", g.nvlink_tx_peak_kib_s, g.nvlink_rx_peak_kib_s)] {
            if tx.is_some() || rx.is_some() {
                let _ = write!(s, ", {link} peak tx/rx {}/{} MiB/s", mib_s(tx), mib_s(rx));
            }
        }
        s.push('\n');
    }
    for c in &r.cupti {
        let graphs = if c.graphs == "launch" { "per launch (their kernels unseen)" } else { "per node" };
        let _ = writeln!(s, "cupti {} (clock {}, CUDA graphs {graphs}; traced {}) in pids {:?}: {}", c.cupti_version, c.clock, c.traced.join(" "), c.pids, printable(&c.cupti_lib));
    }
    let _ = write!(s, "\n{}", crate::sink::summary::render_text(&rep.summary));
    if !rep.kernels.is_empty() {
        let _ = writeln!(s, "\ngpu kernels (top by GPU time)\n  {:>10} {:>8}  name", "gpu_ms", "count");
        for k in &rep.kernels {
            let _ = writeln!(s, "  {:>10.3} {:>8}  {}", k.gpu_ms, k.count, trunc(&k.name, 100));
        }
    }
    let _ = writeln!(s, "\ndrops and anomalies (cumulative; every counter: docs/counters.md)");
    let losses: Vec<_> = r.drops.iter().filter(|(k, v)| **v > 0 && is_loss(k)).collect();
    if losses.is_empty() {
        let _ = writeln!(s, "  none");
    }
    for (k, v) in losses {
        let _ = writeln!(s, "  {k:<32} {v}");
        if let Some(g) = gloss(k) {
            wrap_hanging(s, g.what, "      ", "      ", 100);
            if let Some(todo) = g.todo {
                wrap_hanging(s, &format!("what to do: {todo}"), "      ", "      ", 100);
            }
        }
    }
    let activity: Vec<String> = r.drops.iter().filter(|(k, v)| **v > 0 && !is_loss(k)).map(|(k, v)| format!("{k}={v}")).collect();
    if !activity.is_empty() {
        wrap_hanging(s, &format!("activity: {}", activity.join(" ")), "", "          ", 100);
    }
}

/// The human report: per request, per chain, and the loss counters.
pub fn render_text(rep: &Report) -> String {
    let mut s = String::new();
    text_head(&mut s, rep);
    for q in &rep.requests {
        request_line(&mut s, &q.into());
    }
    // A hop shows the figures of the last request with its id (ids are not
    // always unique: `conn:pid:fd:seq` repeats when a descriptor is reused);
    // the streamed [`write_text`] does the same.
    let by_id: BTreeMap<&str, &RequestOut> = rep.requests.iter().map(|q| (q.id.as_str(), q)).collect();
    let mut row = String::new();
    for c in rep.chains.iter().filter(|c| c.hops.len() > 1 || c.source != "connection") {
        // The peak GPU memory column only when NVML sampled something during the chain.
        let gpu_mem = c.hops.iter().any(|id| by_id.get(id.as_str()).is_some_and(|q| q.peak_gpu_mem_bytes.is_some()));
        let rows: Vec<(usize, String, HopSums, Option<u64>)> = c
            .hops
            .iter()
            .enumerate()
            .filter_map(|(n, id)| by_id.get(id.as_str()).map(|q| (n, q)))
            .map(|(n, q)| {
                row.clear();
                let h = hop_figures(&mut row, &(*q).into(), rep.recording.gpu);
                (n, row.clone(), h, q.peak_gpu_mem_bytes)
            })
            .collect();
        let mut seen = ModelsSeen::default();
        for (_, r, ..) in &rows {
            if !seen.add(model_of(r)) {
                break;
            }
        }
        let models = seen.models();
        chain_head(&mut s, &ChainTitle { chain: &c.chain, source: &c.source, hops: c.hops.len(), e2e_ms: c.e2e_ms, models }, rep.recording.gpu, gpu_mem);
        let mut sums = ChainSums::default();
        let mut told = NotesTold::default();
        for (n, r, h, peak) in &rows {
            write_hop(&mut s, n + 1, r, gpu_mem, *peak, models, &mut told);
            sums.add(h, *peak);
        }
        sums.write(&mut s, rep.recording.gpu, gpu_mem, c.e2e_ms);
    }
    text_tail(&mut s, rep);
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
        "kernel_sched_spilled",
        "kernel_inflight_spilled",
        "ipc_messages",
        "ipc_add",
        "ipc_outputs",
        "ipc_abort",
        "ipc_handshake",
        "ipc_utility",
        "ipc_stats",
        // Messages that are neither steps nor requests, by design: DP wave
        // and coordinator traffic, utility replies, stats meant for the
        // DP coordinator.
        "ipc_dp_wave",
        "ipc_dp_coordinator",
        "ipc_utility_outputs",
        "ipc_stats_elsewhere",
        // One step's messages to several API servers, merged (correlate::join;
        // the API servers' copies when no engine is traced).
        "engine_outputs_joined",
        "engine_reader_outputs_joined",
        "zmtp_streams",
        // Unix streams of another protocol: multiprocessing pipes
        // (socketpairs between vLLM's executor and its workers).
        "unix_not_zmtp",
        "resyncs",
        // Framing picked up again, a stream adopted mid-way, an ADD's
        // fields read from its transfer's end: recoveries (the desync and
        // the messages it lost are counted apart, as losses).
        "zmtp_resyncs",
        "zmtp_attach_mid_stream",
        "ipc_tail_recovered",
        // JSON bodies read from their two ends (what they lacked there is
        // `json_meta_lost`, a loss).
        "json_body_ends",
        "json_body_too_large",
        // A request's model named by its response instead (its body's lost
        // to the capture, or never sent), or answered under another name.
        "request_model_from_response",
        "response_model_differs",
        "request_links_followed",
        // A cut SSE event read from its last bytes (Responses API events):
        // nothing lost that a figure needs.
        "sse_events_from_ends",
        // Capture limits: bytes past a syscall's capture, skipped by count
        // with the framing kept. What a figure lacks for want of them is
        // counted by the decoder that needed them, as a loss
        // (gap_bytes_in_head, sse_events_truncated, ipc_truncated_fields,
        // ipc_outputs_truncated…); long prompts alone reach these.
        "kernel_truncated",
        "gap_bytes_in_body",
        "zmtp_gap_frames",
        "zmtp_gap_bytes",
        "engine_requests_linked",
        // Clients that left before their response ended, and the engine
        // requests found for them by their abort: workload, not loss.
        "requests_closed_unfinished",
        "responses_closed_early",
        "engine_requests_linked_by_abort",
        "engine_steps_from_reader",
        "upgrades",
        "attach_mid_stream",
        "io_other_family",
        // GPU source (source::cupti): connections and records, not losses.
        "gpu_conns",
        "gpu_records",
        "gpu_records_decoded",
        "gpu_records_sent",
        "gpu_connects",
        // Writes timed at their exit for want of a wire departure: a
        // coarser stamp, nothing lost.
        "writes_timed_at_exit",
        // Unix writes whose wake-up was not seen: timed without it, coarser.
        "write_wakeups_unseen",
        // NVML sampler (source::nvml).
        "nvml_devices",
        "nvml_samples",
        // Step attribution (correlate::gpu, correlate::oncpu): what was
        // inferred or is not a step's, not what was lost.
        "gpu_step_copies_unsynced",
        "gpu_records_outside_steps",
        "oncpu_windows_assumed",
        "oncpu_steps_without_start",
    ];
    !ACTIVITY.contains(&name)
}

/// docs/counters.md, the glossary of every counter: the text report explains
/// the losses it prints with it (one source for both; a test keeps it
/// complete and its kinds those of [`is_loss`]).
const GLOSSARY: &str = include_str!("../../../docs/counters.md");

/// The counter rows of [`GLOSSARY`]'s tables: [name, kind, what it counts,
/// what to do].
fn glossary_rows() -> impl Iterator<Item = [&'static str; 4]> {
    GLOSSARY.lines().filter_map(|line| {
        let cells: Vec<&'static str> = line.split('|').map(str::trim).collect();
        match cells[..] {
            ["", n, kind, what, todo, ""] => Some([n.strip_prefix('`')?.strip_suffix('`')?, kind, what, todo]),
            _ => None,
        }
    })
}

/// What a counter counts and, where a user can act, what to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Gloss {
    what: &'static str,
    todo: Option<&'static str>,
}

/// A counter's row of [`GLOSSARY`] (`gpu_counter_<id>` for every unknown
/// injection-library number); a "what to do" that only points at another
/// counter ("see `x`", "as `x`") is that counter's.
fn gloss(name: &str) -> Option<Gloss> {
    let row = |name: &str| glossary_rows().find(|r| r[0] == name).map(|[_, _, what, todo]| (what, todo));
    let key = match name.strip_prefix("gpu_counter_") {
        Some(id) if !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit()) => "gpu_counter_<id>",
        _ => name,
    };
    let (what, mut todo) = row(key)?;
    let pointer = todo.strip_prefix("see `").or_else(|| todo.strip_prefix("as `")).and_then(|t| t.strip_suffix('`'));
    if let Some((_, t)) = pointer.and_then(row) {
        todo = t;
    }
    Some(Gloss { what, todo: (todo != "—").then_some(todo) })
}

/// `text` as lines of at most `width` columns (a longer word gets its own),
/// the first after `first`, the others after `indent`.
fn wrap_hanging(s: &mut String, text: &str, first: &str, indent: &str, width: usize) {
    let mut line = String::new();
    let mut lead = first;
    for word in text.split_whitespace() {
        if !line.is_empty() && lead.len() + line.chars().count() + 1 + word.chars().count() > width {
            let _ = writeln!(s, "{lead}{line}");
            line.clear();
            lead = indent;
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        let _ = writeln!(s, "{lead}{line}");
    }
}


// ------------------------------------------------------------- streaming
//
// `hopscope report` (`--json` or text) on a long recording: requests are
// written as the correlator hands them out (`Correlator::drain_final`), so
// memory follows the open requests. The JSON is byte for byte what `build` +
// `to_writer_pretty` give, the text what `render_text` of it gives: the
// requests go to an unlinked spool file (JSON already indented, by the hand
// writer of sink::json; text as their table lines) while the recording is
// read, and are copied in when the rest of the report (counters, chains,
// summary) is known at the end.
//
// What is kept for the end, per request: its chain's hop entry (spooled:
// id, TTFT, token counts, peak GPU memory, the text row; in memory 24
// bytes), its summary figures (8 bytes each) and its ITLs (spilled past a
// run, below).

use crate::correlate::{Config, Correlator};
use crate::sink::summary::{self, from_total_key, total_key, ChainHitRate, Dist, GpuMemIndex, Summary};
use std::io::{self, Read, Seek, Write};

/// What a spool buffers before it writes to its file.
const SPOOL_CHUNK: usize = 1 << 16;

/// Chains as their hops come, in report order, without keeping the hops in
/// memory: each hop (id, TTFT, token counts, peak GPU memory and, for the
/// text report, its row) goes to an unlinked spool file; per chain only its
/// totals stay (first arrival, last end, prefix-cache totals, hop count:
/// ~100 bytes with its key), plus 24 bytes per hop (where it is in the spool,
/// which chain, its id's hash) to put hops back in chain order at the end and
/// find the ids that repeat.
#[derive(Debug)]
pub struct ChainBook {
    /// Chain number by key and key source.
    index: crate::correlate::FxMap<Box<str>, [u32; 3]>,
    chains: Vec<ChainAgg>,
    spool: io::BufWriter<std::fs::File>,
    spooled: u64,
    hop_at: Vec<u64>,
    chain_of: Vec<u32>,
    id_hash: Vec<u64>,
    /// Spool each hop's text row (`write_text`).
    rows: bool,
    /// The rows have the GPU share columns.
    gpu: bool,
    row: String,
}

#[derive(Debug)]
struct ChainAgg {
    first_arrive_ns: u64,
    last_done_ns: Option<u64>,
    all_done: bool,
    source: ChainSource,
    hops: u32,
    cached_tokens: u64,
    prompt_tokens: u64,
    hops_unknown: usize,
    /// Hops with a peak GPU memory (the text report's column).
    peaks: u32,
}

/// A hop in the spool: TTFT as f64 bits (NaN: unknown), cached and prompt
/// tokens, peak GPU memory, which of those three are known (bits 0-2), the
/// id's length, the row's length, E2E as f64 bits; then the id, the row and,
/// in the text report's spool, the figures its chain's sum row adds up
/// ([`HopSums`], `SUMS_BYTES`).
const HOP_HEAD: usize = 8 + 8 + 8 + 8 + 1 + 4 + 4 + 8;

fn opt_bits(v: Option<f64>) -> [u8; 8] {
    v.unwrap_or(f64::NAN).to_bits().to_le_bytes()
}

fn bits_opt(b: &[u8]) -> Option<f64> {
    let v = f64::from_bits(u64::from_le_bytes(b.try_into().expect("8 bytes")));
    (!v.is_nan()).then_some(v)
}

/// A row read back from the spool, which holds what [`hop_figures`] wrote.
fn spooled_str(row: &[u8]) -> io::Result<&str> {
    std::str::from_utf8(row).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("reading the report's spool file back: {e} (a bug: please report it)")))
}

/// A spooled hop's head, read back.
struct HopHead {
    ttft_ms: Option<f64>,
    e2e_ms: Option<f64>,
    cached_tokens: Option<u64>,
    prompt_tokens: Option<u64>,
    peak_gpu_mem_bytes: Option<u64>,
    id_len: usize,
    row_len: usize,
}

impl HopHead {
    fn encode(&self) -> [u8; HOP_HEAD] {
        let mut h = [0u8; HOP_HEAD];
        h[0..8].copy_from_slice(&opt_bits(self.ttft_ms));
        h[8..16].copy_from_slice(&self.cached_tokens.unwrap_or(0).to_le_bytes());
        h[16..24].copy_from_slice(&self.prompt_tokens.unwrap_or(0).to_le_bytes());
        h[24..32].copy_from_slice(&self.peak_gpu_mem_bytes.unwrap_or(0).to_le_bytes());
        h[32] = u8::from(self.cached_tokens.is_some()) | u8::from(self.prompt_tokens.is_some()) << 1 | u8::from(self.peak_gpu_mem_bytes.is_some()) << 2;
        h[33..37].copy_from_slice(&(self.id_len as u32).to_le_bytes());
        h[37..41].copy_from_slice(&(self.row_len as u32).to_le_bytes());
        h[41..49].copy_from_slice(&opt_bits(self.e2e_ms));
        h
    }

    fn decode(h: &[u8; HOP_HEAD]) -> Self {
        let u = |r: std::ops::Range<usize>, bit: u8| (h[32] & bit != 0).then(|| u64::from_le_bytes(h[r].try_into().expect("8 bytes")));
        let len = |r: std::ops::Range<usize>| u32::from_le_bytes(h[r].try_into().expect("4 bytes")) as usize;
        HopHead { ttft_ms: bits_opt(&h[0..8]), e2e_ms: bits_opt(&h[41..49]), cached_tokens: u(8..16, 1), prompt_tokens: u(16..24, 2), peak_gpu_mem_bytes: u(24..32, 4), id_len: len(33..37), row_len: len(37..41) }
    }

    /// The prefix-cache hit, as `build` computes it.
    fn hit(&self) -> Option<f64> {
        match (self.cached_tokens, self.prompt_tokens) {
            (Some(ca), Some(p)) if p > 0 => Some(ca as f64 / p as f64),
            _ => None,
        }
    }

    fn read(pages: &mut PageCache, off: u64) -> io::Result<Self> {
        let mut h = [0u8; HOP_HEAD];
        pages.read(off, &mut h)?;
        Ok(Self::decode(&h))
    }
}

impl ChainBook {
    /// The chains of the JSON report.
    pub fn new() -> io::Result<Self> {
        Ok(ChainBook {
            index: Default::default(),
            chains: Vec::new(),
            spool: io::BufWriter::with_capacity(SPOOL_CHUNK, spool_file()?),
            spooled: 0,
            hop_at: Vec::new(),
            chain_of: Vec::new(),
            id_hash: Vec::new(),
            rows: false,
            gpu: false,
            row: String::new(),
        })
    }

    /// The chains of the text report: each hop's row spooled with it (with
    /// the GPU share columns when `gpu`).
    pub fn with_rows(gpu: bool) -> io::Result<Self> {
        Ok(ChainBook { rows: true, gpu, ..Self::new()? })
    }

    /// The next hop of its chain (requests in report order).
    pub fn add(&mut self, r: &Request, q: &RequestRef) -> io::Result<()> {
        let n = self.chains.len() as u32;
        let slots = match self.index.get_mut(r.chain.as_str()) {
            Some(s) => s,
            None => self.index.entry(Box::from(r.chain.as_str())).or_insert([u32::MAX; 3]),
        };
        let slot = &mut slots[r.chain_source as usize];
        if *slot == u32::MAX {
            *slot = n;
        }
        let i = *slot as usize;
        if i == self.chains.len() {
            self.chains.push(ChainAgg { first_arrive_ns: r.arrive_ns, last_done_ns: None, all_done: true, source: r.chain_source, hops: 0, cached_tokens: 0, prompt_tokens: 0, hops_unknown: 0, peaks: 0 });
        }
        let c = &mut self.chains[i];
        c.hops += 1;
        match r.waited_until_ns() {
            Some(d) => c.last_done_ns = Some(c.last_done_ns.map_or(d, |l| l.max(d))),
            None => c.all_done = false,
        }
        match (q.cached_tokens, q.prompt_tokens) {
            (Some(ca), Some(p)) => {
                c.cached_tokens += ca;
                c.prompt_tokens += p;
            }
            _ => c.hops_unknown += 1,
        }
        c.peaks += u32::from(q.peak_gpu_mem_bytes.is_some());
        self.hop_at.push(self.spooled);
        self.chain_of.push(i as u32);
        self.id_hash.push(std::hash::BuildHasher::hash_one(&std::hash::BuildHasherDefault::<crate::correlate::FxHasher>::default(), q.id));
        self.row.clear();
        // The text report's row and what its chain's sum row adds up; the
        // JSON report needs neither.
        let sums = self.rows.then(|| hop_figures(&mut self.row, &q.into(), self.gpu));
        let head = HopHead { ttft_ms: q.ttft_ms, e2e_ms: q.e2e_ms.or(q.closed_ms), cached_tokens: q.cached_tokens, prompt_tokens: q.prompt_tokens, peak_gpu_mem_bytes: q.peak_gpu_mem_bytes, id_len: q.id.len(), row_len: self.row.len() };
        self.spool.write_all(&head.encode())?;
        self.spool.write_all(q.id.as_bytes())?;
        self.spool.write_all(self.row.as_bytes())?;
        self.spooled += (HOP_HEAD + q.id.len() + self.row.len()) as u64;
        if let Some(sums) = sums {
            // After the row.
            self.spool.write_all(&sums.encode())?;
            self.spooled += SUMS_BYTES as u64;
        }
        Ok(())
    }

    /// The chains in report order (first hop's arrival, then name, as
    /// `build`), ready to be written, and the hit rates the summary lists.
    pub fn finish(self) -> io::Result<(ChainsOut, Vec<ChainHitRate>)> {
        let file = self.spool.into_inner().map_err(io::IntoInnerError::into_error)?;
        let mut chains = self.chains;
        let over = {
            let mut pages = PageCache::new(&file, self.spooled);
            let over = last_of_same_id(&self.id_hash, &self.hop_at, &mut pages)?;
            // Where a hop's id repeats, `summary::compute` and `render_text`
            // count the last request with that id in the hop's place.
            for (&s, &t) in &over {
                let c = &mut chains[self.chain_of[s as usize] as usize];
                let (own, last) = (HopHead::read(&mut pages, self.hop_at[s as usize])?, HopHead::read(&mut pages, self.hop_at[t as usize])?);
                match (own.cached_tokens, own.prompt_tokens) {
                    (Some(ca), Some(p)) => {
                        c.cached_tokens -= ca;
                        c.prompt_tokens -= p;
                    }
                    _ => c.hops_unknown -= 1,
                }
                match (last.cached_tokens, last.prompt_tokens) {
                    (Some(ca), Some(p)) => {
                        c.cached_tokens += ca;
                        c.prompt_tokens += p;
                    }
                    _ => c.hops_unknown += 1,
                }
                c.peaks -= u32::from(own.peak_gpu_mem_bytes.is_some());
                c.peaks += u32::from(last.peak_gpu_mem_bytes.is_some());
            }
            over
        };
        let mut names: Vec<Box<str>> = vec![Box::from(""); chains.len()];
        for (name, slots) in self.index {
            for i in slots.into_iter().filter(|&i| i != u32::MAX) {
                names[i as usize] = name.clone();
            }
        }
        let mut order: Vec<u32> = (0..chains.len() as u32).collect();
        order.sort_by(|&a, &b| {
            let (x, y) = (&chains[a as usize], &chains[b as usize]);
            (x.first_arrive_ns, &names[a as usize], x.source as u8).cmp(&(y.first_arrive_ns, &names[b as usize], y.source as u8))
        });
        // Hops grouped by chain, in report order within each (counting sort).
        let mut start = vec![0u32; chains.len()];
        let mut at = 0u32;
        for &c in &order {
            start[c as usize] = at;
            at += chains[c as usize].hops;
        }
        let mut by_chain = vec![0u32; self.chain_of.len()];
        for (s, &c) in self.chain_of.iter().enumerate() {
            by_chain[start[c as usize] as usize] = s as u32;
            start[c as usize] += 1;
        }
        let mut hits = Vec::new();
        for &c in &order {
            let x = &chains[c as usize];
            if x.shown() {
                hits.push(ChainHitRate {
                    chain: names[c as usize].to_string(),
                    cached_tokens: x.cached_tokens,
                    prompt_tokens: x.prompt_tokens,
                    hit_rate: (x.prompt_tokens > 0).then(|| x.cached_tokens as f64 / x.prompt_tokens as f64),
                    hops_unknown: x.hops_unknown,
                });
            }
        }
        Ok((ChainsOut { file, len: self.spooled, chains, names, order, by_chain, hop_at: self.hop_at, over }, hits))
    }
}

impl ChainAgg {
    /// Whether the text report shows the chain and the summary lists it:
    /// chains keyed by their connection alone, with one hop, are left out.
    fn shown(&self) -> bool {
        self.hops > 1 || self.source != ChainSource::Connection
    }
}

/// Requests whose id a later request also has, each with the last such
/// request (by spool index, which is report order): `id_hash` sorted with
/// the indices, ids compared only where hashes are equal.
fn last_of_same_id(id_hash: &[u64], hop_at: &[u64], pages: &mut PageCache) -> io::Result<crate::correlate::FxMap<u32, u32>> {
    let mut over = crate::correlate::FxMap::default();
    let mut idx: Vec<u32> = (0..id_hash.len() as u32).collect();
    idx.sort_unstable_by_key(|&i| (id_hash[i as usize], i));
    let mut ids: Vec<Vec<u8>> = Vec::new();
    for group in idx.chunk_by(|&a, &b| id_hash[a as usize] == id_hash[b as usize]).filter(|g| g.len() > 1) {
        ids.clear();
        for &i in group {
            let off = hop_at[i as usize];
            let h = HopHead::read(pages, off)?;
            let mut id = vec![0; h.id_len];
            pages.read(off + HOP_HEAD as u64, &mut id)?;
            ids.push(id);
        }
        // The group is in report order: the map keeps each id's last request.
        let last: crate::correlate::FxMap<&[u8], u32> = group.iter().zip(&ids).map(|(&i, id)| (id.as_slice(), i)).collect();
        for (&i, id) in group.iter().zip(&ids) {
            let t = last[id.as_slice()];
            if t != i {
                over.insert(i, t);
            }
        }
    }
    Ok(over)
}

/// The report's chains, written one by one from the spool.
pub struct ChainsOut {
    file: std::fs::File,
    len: u64,
    chains: Vec<ChainAgg>,
    names: Vec<Box<str>>,
    order: Vec<u32>,
    by_chain: Vec<u32>,
    hop_at: Vec<u64>,
    /// Hops shown with a later request's figures (same id).
    over: crate::correlate::FxMap<u32, u32>,
}

/// Reads of a spool file through a few cached pages: a chain's hops are
/// scattered over the spool, mostly close to each other and to the previous
/// chain's, so a direct-mapped cache turns two reads per hop into about one
/// per page (and never more than one read per hop).
struct PageCache<'f> {
    file: &'f std::fs::File,
    len: u64,
    /// Page number + 1 held by each slot (0: none).
    tags: Vec<u64>,
    pages: Vec<u8>,
    /// Read through [`WINDOW`]-sized pieces instead: set for a long chain,
    /// whose hops go forward through the whole spool a page or so apart
    /// (one read per hop through the pages).
    forward: bool,
    /// The forward piece and where it starts in the file.
    window: Vec<u8>,
    window_at: u64,
}

const PAGE: usize = 4096;
const PAGE_SLOTS: usize = 256;
const WINDOW: usize = 1 << 16;
/// Chains with more hops than this are read forward (see [`PageCache::forward`]).
const LONG_CHAIN: u32 = 16;

impl<'f> PageCache<'f> {
    fn new(file: &'f std::fs::File, len: u64) -> Self {
        PageCache { file, len, tags: vec![0; PAGE_SLOTS], pages: vec![0; PAGE * PAGE_SLOTS], forward: false, window: Vec::new(), window_at: 0 }
    }

    fn read(&mut self, off: u64, dst: &mut [u8]) -> io::Result<()> {
        if self.forward && dst.len() <= WINDOW {
            return self.read_forward(off, dst);
        }
        self.read_paged(off, dst)
    }

    fn read_forward(&mut self, off: u64, dst: &mut [u8]) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        let end = off + dst.len() as u64;
        if off < self.window_at || end > self.window_at + self.window.len() as u64 {
            let n = (self.len.saturating_sub(off) as usize).min(WINDOW).max(dst.len());
            self.window.resize(n, 0);
            self.file.read_exact_at(&mut self.window, off)?;
            self.window_at = off;
        }
        let at = (off - self.window_at) as usize;
        dst.copy_from_slice(&self.window[at..at + dst.len()]);
        Ok(())
    }

    fn read_paged(&mut self, mut off: u64, dst: &mut [u8]) -> io::Result<()> {
        use std::os::unix::fs::FileExt;
        let mut done = 0;
        while done < dst.len() {
            let page = off / PAGE as u64;
            let slot = (page % PAGE_SLOTS as u64) as usize;
            let buf = &mut self.pages[slot * PAGE..(slot + 1) * PAGE];
            if self.tags[slot] != page + 1 {
                let from = page * PAGE as u64;
                let n = (self.len.saturating_sub(from) as usize).min(PAGE);
                self.file.read_exact_at(&mut buf[..n], from)?;
                self.tags[slot] = page + 1;
            }
            let at = (off % PAGE as u64) as usize;
            let k = (PAGE - at).min(dst.len() - done);
            dst[done..done + k].copy_from_slice(&buf[at..at + k]);
            done += k;
            off += k as u64;
        }
        Ok(())
    }
}

impl ChainsOut {
    fn len(&self) -> usize {
        self.order.len()
    }

    /// A chain's end to end: first arrival to last end, when every hop ended.
    fn e2e_ms(x: &ChainAgg) -> Option<f64> {
        x.last_done_ns.filter(|_| x.all_done).map(|l| ms(l.saturating_sub(x.first_arrive_ns)))
    }

    /// Writes the chains as the elements of the report's `chains` array,
    /// through `b` (handed to `out` whenever it holds a spool chunk).
    fn write(&self, b: &mut Vec<u8>, out: &mut dyn Write) -> io::Result<()> {
        let mut pages = PageCache::new(&self.file, self.len);
        let mut at = 0usize;
        let (mut ids, mut spans, mut ttfts, mut hits) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (k, &c) in self.order.iter().enumerate() {
            let x = &self.chains[c as usize];
            pages.forward = x.hops > LONG_CHAIN;
            ids.clear();
            spans.clear();
            ttfts.clear();
            hits.clear();
            let mut hops_e2e_ms = Some(0.0);
            for &s in &self.by_chain[at..at + x.hops as usize] {
                let off = self.hop_at[s as usize];
                let h = HopHead::read(&mut pages, off)?;
                let from = ids.len();
                ids.resize(from + h.id_len, 0);
                pages.read(off + HOP_HEAD as u64, &mut ids[from..])?;
                spans.push(from..from + h.id_len);
                ttfts.push(h.ttft_ms);
                hits.push(h.hit());
                hops_e2e_ms = hops_e2e_ms.zip(h.e2e_ms).map(|(t, e)| t + e);
            }
            at += x.hops as usize;
            if k > 0 {
                b.push(b',');
            }
            json::newline(b, 2);
            let mut o = json::Obj::new(b, 2);
            o.field("chain", &*self.names[c as usize]);
            o.array("hops", spans.iter().map(|r| String::from_utf8_lossy(&ids[r.clone()])));
            o.field("e2e_ms", &Self::e2e_ms(x));
            o.field("ttft_ms", &ttfts[..]).field("prefix_cache_hit", &hits[..]).field("source", chain_source_name(x.source));
            o.field("hops_e2e_ms", &hops_e2e_ms).field("between_hops_ms", &between_hops_ms(Self::e2e_ms(x), hops_e2e_ms));
            o.end();
            if b.len() >= SPOOL_CHUNK {
                out.write_all(b)?;
                b.clear();
            }
        }
        Ok(())
    }

    /// Reads hop `i`'s row (that of the last request with its id) into
    /// `row`: its head and where the row starts in the spool.
    fn read_row(&self, pages: &mut PageCache, i: u32, row: &mut Vec<u8>) -> io::Result<(HopHead, u64)> {
        let i = self.over.get(&i).copied().unwrap_or(i);
        let off = self.hop_at[i as usize];
        let h = HopHead::read(pages, off)?;
        row.resize(h.row_len, 0);
        let at_row = off + (HOP_HEAD + h.id_len) as u64;
        pages.read(at_row, row)?;
        Ok((h, at_row))
    }

    /// Writes the text report's chain tables (those [`ChainAgg::shown`]),
    /// from the rows spooled with the hops ([`ChainBook::with_rows`]).
    fn write_text(&self, out: &mut dyn Write, gpu: bool) -> io::Result<()> {
        let mut pages = PageCache::new(&self.file, self.len);
        let mut at = 0usize;
        let (mut s, mut row) = (String::new(), Vec::new());
        for &c in &self.order {
            let x = &self.chains[c as usize];
            let hops = &self.by_chain[at..at + x.hops as usize];
            at += x.hops as usize;
            if !x.shown() {
                continue;
            }
            pages.forward = x.hops > LONG_CHAIN;
            let gpu_mem = x.peaks > 0;
            // The models its hops named, read from their rows first: the
            // title names the one they share, else each row its own.
            let mut seen = ModelsSeen::default();
            for &i in hops {
                self.read_row(&mut pages, i, &mut row)?;
                if !seen.add(model_of(spooled_str(&row)?)) {
                    break;
                }
            }
            let models = seen.models();
            chain_head(&mut s, &ChainTitle { chain: &self.names[c as usize], source: chain_source_name(x.source), hops: hops.len(), e2e_ms: Self::e2e_ms(x), models }, gpu, gpu_mem);
            let mut sums = ChainSums::default();
            let mut told = NotesTold::default();
            for (n, &i) in hops.iter().enumerate() {
                let (h, at_row) = self.read_row(&mut pages, i, &mut row)?;
                let mut b = [0u8; SUMS_BYTES];
                pages.read(at_row + h.row_len as u64, &mut b)?;
                sums.add(&HopSums::decode(&b), h.peak_gpu_mem_bytes);
                write_hop(&mut s, n + 1, spooled_str(&row)?, gpu_mem, h.peak_gpu_mem_bytes, models, &mut told);
                if s.len() >= SPOOL_CHUNK {
                    out.write_all(s.as_bytes())?;
                    s.clear();
                }
            }
            sums.write(&mut s, gpu, gpu_mem, Self::e2e_ms(x));
        }
        out.write_all(s.as_bytes())
    }
}

impl json::Value for std::borrow::Cow<'_, str> {
    fn write(&self, b: &mut Vec<u8>, _: usize) {
        json::string(b, self)
    }
}

/// Pooled ITLs kept in memory: past this many, they are sorted and spilled
/// to a file in runs of about this size (8 MiB), merged at the end.
pub const ITL_RUN: usize = 1 << 20;

/// The completed requests' ITLs, pooled, for their distribution: in memory
/// up to [`ITL_RUN`], past that in sorted runs in an unlinked spool file.
/// The distribution is `summary::dist_of`'s to the bit (its sums are taken
/// over the sorted values, which the runs' merge gives in the same order),
/// with memory bounded by a run and a read buffer per run.
#[derive(Debug)]
struct ItlPool {
    /// Values per run ([`ITL_RUN`]; smaller in tests).
    run: usize,
    buf: Vec<f64>,
    spill: Option<io::BufWriter<std::fs::File>>,
    /// Values per spilled run, in file order.
    runs: Vec<u64>,
}

/// Values read at once from a spilled run.
const RUN_READ: usize = 8192;

/// One spilled run (or the merged values), read in order.
struct RunReader {
    off: u64,
    left: u64,
    buf: Vec<u64>,
    at: usize,
    bytes: Vec<u8>,
}

impl RunReader {
    fn new(off: u64, len: u64) -> Self {
        RunReader { off, left: len, buf: Vec::new(), at: 0, bytes: Vec::new() }
    }

    /// The next key, reading the next piece of `file` when the buffer is done.
    #[inline]
    fn next(&mut self, file: &std::fs::File) -> io::Result<Option<u64>> {
        if self.at == self.buf.len() && !self.fill(file)? {
            return Ok(None);
        }
        self.at += 1;
        Ok(Some(self.buf[self.at - 1]))
    }

    fn fill(&mut self, file: &std::fs::File) -> io::Result<bool> {
        use std::os::unix::fs::FileExt;
        if self.left == 0 {
            return Ok(false);
        }
        let n = (self.left as usize).min(RUN_READ);
        self.bytes.resize(n * 8, 0);
        file.read_exact_at(&mut self.bytes, self.off)?;
        self.off += self.bytes.len() as u64;
        self.left -= n as u64;
        self.buf.clear();
        self.buf.extend(self.bytes.chunks_exact(8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes"))));
        self.at = 0;
        Ok(true)
    }
}

/// The spilled runs merged: every value once, in `total_cmp` order (as
/// [`total_key`]s). A read error ends the values early and is kept in `err`.
struct Merge<'f> {
    file: &'f std::fs::File,
    runs: Vec<RunReader>,
    /// Each run's next key, smallest on top.
    heap: std::collections::BinaryHeap<std::cmp::Reverse<(u64, usize)>>,
    err: Option<io::Error>,
}

impl<'f> Merge<'f> {
    fn new(file: &'f std::fs::File, runs: &[u64]) -> Self {
        let mut off = 0;
        let runs = runs
            .iter()
            .map(|&n| {
                let r = RunReader::new(off, n);
                off += n * 8;
                r
            })
            .collect();
        let mut m = Merge { file, runs, heap: Default::default(), err: None };
        for i in 0..m.runs.len() {
            if let Some(k) = m.read(i) {
                m.heap.push(std::cmp::Reverse((k, i)));
            }
        }
        m
    }

    /// Run `i`'s next key, if any.
    fn read(&mut self, i: usize) -> Option<u64> {
        match self.runs[i].next(self.file) {
            Ok(k) => k,
            Err(e) => {
                self.err.get_or_insert(e);
                None
            }
        }
    }
}

impl Iterator for Merge<'_> {
    type Item = u64;
    fn next(&mut self) -> Option<u64> {
        let std::cmp::Reverse((k, i)) = *self.heap.peek()?;
        // The run's next key replaces its last in place: one sift, not a
        // pop's and a push's.
        match self.read(i) {
            Some(n) => *self.heap.peek_mut().expect("not empty") = std::cmp::Reverse((n, i)),
            None => {
                self.heap.pop();
            }
        }
        Some(k)
    }
}

impl Default for ItlPool {
    fn default() -> Self {
        ItlPool { run: ITL_RUN, buf: Vec::new(), spill: None, runs: Vec::new() }
    }
}

impl ItlPool {
    fn extend(&mut self, xs: &[f64]) -> io::Result<()> {
        // Spilled before it would pass a run, the buffer never grows past
        // one (or one request's ITLs).
        if !self.buf.is_empty() && self.buf.len() + xs.len() > self.run {
            self.spill_run()?;
        }
        self.buf.extend_from_slice(xs);
        Ok(())
    }

    fn spill_run(&mut self) -> io::Result<()> {
        let mut keys: Vec<u64> = self.buf.iter().map(|&x| total_key(x)).collect();
        summary::sort_keys(&mut keys);
        let spill = match &mut self.spill {
            Some(s) => s,
            None => self.spill.insert(io::BufWriter::with_capacity(SPOOL_CHUNK, spool_file()?)),
        };
        for k in &keys {
            spill.write_all(&k.to_le_bytes())?;
        }
        self.runs.push(self.buf.len() as u64);
        self.buf.clear();
        Ok(())
    }

    /// `summary::dist_of` of every value added.
    fn dist(mut self, percentiles: &[f64]) -> io::Result<Option<Dist>> {
        if self.runs.is_empty() {
            return Ok(summary::dist_of(self.buf, percentiles));
        }
        if !self.buf.is_empty() {
            self.spill_run()?;
        }
        let file = self.spill.take().expect("spilled").into_inner().map_err(io::IntoInnerError::into_error)?;
        let n: u64 = self.runs.iter().sum();
        // The ranks `summary::percentile` reads, and their values.
        let rank = |p: f64| (p / 100.0).clamp(0.0, 1.0) * (n - 1) as f64;
        let mut at: BTreeMap<u64, f64> = BTreeMap::new();
        for p in percentiles.iter().chain([&50.0]) {
            at.insert(rank(*p).floor() as u64, 0.0);
            at.insert(rank(*p).ceil() as u64, 0.0);
        }
        // One merge: the sum and the ranked values on the way, the merged
        // keys written after the runs for the variance's second pass, which
        // then reads them in order.
        let mut merged_out = io::BufWriter::with_capacity(SPOOL_CHUNK, &file);
        merged_out.seek(io::SeekFrom::Start(n * 8))?;
        let mut merged = Merge::new(&file, &self.runs);
        // -0.0: where Iterator::sum starts, for dist_of's bits.
        let (mut i, mut sum) = (0u64, -0.0f64);
        for k in merged.by_ref() {
            let x = from_total_key(k);
            if let Some(v) = at.get_mut(&i) {
                *v = x;
            }
            sum += x;
            i += 1;
            merged_out.write_all(&k.to_le_bytes())?;
        }
        if let Some(e) = merged.err {
            return Err(e);
        }
        merged_out.flush()?;
        drop(merged_out);
        let mean = sum / n as f64;
        let mut sorted = RunReader::new(n * 8, n);
        let mut var = -0.0f64;
        while let Some(k) = sorted.next(&file)? {
            let x = from_total_key(k);
            var += (x - mean) * (x - mean);
        }
        let var = var / n as f64;
        let pct = |p: f64| {
            let r = rank(p);
            let (lo, hi) = (at[&(r.floor() as u64)], at[&(r.ceil() as u64)]);
            lo + (hi - lo) * (r - r.floor())
        };
        Ok(Some(Dist {
            n: n as usize,
            mean,
            median: pct(50.0),
            std: var.sqrt(),
            percentiles: percentiles.iter().map(|&p| (summary::percentile_key(p), pct(p))).collect(),
        }))
    }
}

/// The summary's inputs, request by request: `summary::compute_views`
/// folded one request at a time (the same figures in the same order, so the
/// same bits). The per-request figures (TTFT, TPOT, E2EL, interactivity)
/// stay in memory, 8 bytes each per completed request; the pooled ITLs, of
/// which there are many per request, spill to a file ([`ItlPool`]).
#[derive(Debug, Default)]
pub struct SummaryAcc {
    completed: usize,
    not_completed: usize,
    failed: usize,
    closed_early: usize,
    ttfts: Vec<f64>,
    tpots: Vec<f64>,
    e2els: Vec<f64>,
    per_token_s: Vec<f64>,
    itls: ItlPool,
    total_in: u64,
    total_out: u64,
    tokens_unknown: usize,
    first_ns: Option<u64>,
    last_ns: Option<u64>,
    peak_gpu_mem_bytes: Option<u64>,
    /// Per model: a byte per TTFT, TPOT and E2EL value saying whose it is.
    models: summary::Models,
    structured: summary::StructuredAcc,
    held: summary::HeldAcc,
}

impl SummaryAcc {
    pub fn add(&mut self, q: &RequestRef) -> io::Result<()> {
        self.peak_gpu_mem_bytes = self.peak_gpu_mem_bytes.max(q.peak_gpu_mem_bytes);
        if let Some(e2e) = q.e2e_ms.filter(|_| summary::is_completed(q.status, q.e2e_ms, q.ttft_ms, q.completion_tokens)) {
            self.completed += 1;
            self.structured.add(
                q.structured_output,
                q.scheduler_queue_ms,
                q.ttft_ms,
                summary::skipped_ms(q.scheduler_passed_over_by, q.scheduler_passed_over_ms),
                summary::after_grammar_ms(q.scheduler_queue_ms, q.scheduler_grammar_ready_ms),
            );
            self.held.add(q.tokens_before_first_content, q.first_output_held_ms, q.ttft_ms, q.empty_chunks_before_content);
            let slot = self.models.slot(q.model, q.completion_tokens);
            self.e2els.push(e2e);
            self.models.e2el.push(slot);
            if let Some(t) = q.ttft_ms {
                self.ttfts.push(t);
                self.models.ttft.push(slot);
            }
            self.itls.extend(q.itl_ms)?;
            match (q.prompt_tokens, q.completion_tokens) {
                (Some(i), Some(o)) => {
                    self.total_in += i;
                    self.total_out += o;
                }
                _ => self.tokens_unknown += 1,
            }
            if let Some(o) = q.completion_tokens {
                if let Some(t) = q.ttft_ms.and_then(|t| summary::tpot_ms(e2e, t, o)) {
                    self.tpots.push(t);
                    self.models.tpot.push(slot);
                }
                if o > 0 {
                    self.per_token_s.push(e2e / 1e3 / o as f64);
                }
            }
            self.first_ns = Some(self.first_ns.map_or(q.arrive_ns, |f| f.min(q.arrive_ns)));
            if let Some(d) = q.done_ns {
                self.last_ns = Some(self.last_ns.map_or(d, |l| l.max(d)));
            }
        } else {
            self.not_completed += 1;
            let failed = summary::is_failed(q.status, q.e2e_ms);
            self.failed += usize::from(failed);
            self.closed_early += usize::from(failed && q.closed_ns.is_some());
        }
        Ok(())
    }

    pub fn finish(mut self, chains: Vec<ChainHitRate>, percentiles: &[f64]) -> io::Result<Summary> {
        let duration_s = match (self.first_ns, self.last_ns) {
            (Some(f), Some(l)) if l > f => Some((l - f) as f64 / 1e9),
            _ => None,
        };
        let rate = |x: f64| duration_s.map(|d| x / d);
        // Values equal under total_cmp are the same bits: unstable is stable here.
        self.per_token_s.sort_unstable_by(f64::total_cmp);
        let models = self.models.summaries(&self.ttfts, &self.tpots, &self.e2els, percentiles);
        Ok(Summary {
            completed: self.completed,
            not_completed: self.not_completed,
            failed: self.failed,
            duration_s,
            total_input_tokens: self.total_in,
            total_output_tokens: self.total_out,
            tokens_unknown: self.tokens_unknown,
            request_throughput: rate(self.completed as f64),
            output_throughput: rate(self.total_out as f64),
            total_token_throughput: rate((self.total_in + self.total_out) as f64),
            percentiles: percentiles.to_vec(),
            ttft_ms: summary::dist_of(self.ttfts, percentiles),
            tpot_ms: summary::dist_of(self.tpots, percentiles),
            itl_ms: self.itls.dist(percentiles)?,
            e2el_ms: summary::dist_of(self.e2els, percentiles),
            interactivity_p90_tok_s: percentile(&self.per_token_s, 90.0).filter(|p| *p > 0.0).map(|p| 1.0 / p),
            chains,
            models,
            gpu_samples: 0,
            closed_early: self.closed_early,
            peak_gpu_mem_bytes: self.peak_gpu_mem_bytes,
            structured_output: self.structured.finish(),
            first_content_held: self.held.finish(),
        })
    }
}

/// serde_json's pretty layout (two spaces a level) starting `level` levels
/// deep: a request serialized alone as an element of the report's
/// `requests` array, each newline and its indent written at once.
struct Nested {
    level: usize,
    has_value: bool,
}

const NEWLINE_INDENT: &[u8] = b"\n                                                                ";

fn newline<W: ?Sized + Write>(w: &mut W, level: usize) -> io::Result<()> {
    let n = 2 * level;
    if n < NEWLINE_INDENT.len() {
        return w.write_all(&NEWLINE_INDENT[..=n]);
    }
    w.write_all(b"\n")?;
    (0..level).try_for_each(|_| w.write_all(b"  "))
}

impl serde_json::ser::Formatter for Nested {
    fn begin_array<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(b"[")
    }
    fn end_array<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.level -= 1;
        if self.has_value {
            newline(w, self.level)?;
        }
        w.write_all(b"]")
    }
    fn begin_array_value<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        if !first {
            w.write_all(b",")?;
        }
        newline(w, self.level)
    }
    fn end_array_value<W: ?Sized + Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }
    fn begin_object<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.level += 1;
        self.has_value = false;
        w.write_all(b"{")
    }
    fn end_object<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        self.level -= 1;
        if self.has_value {
            newline(w, self.level)?;
        }
        w.write_all(b"}")
    }
    fn begin_object_key<W: ?Sized + Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        if !first {
            w.write_all(b",")?;
        }
        newline(w, self.level)
    }
    fn begin_object_value<W: ?Sized + Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b": ")
    }
    fn end_object_value<W: ?Sized + Write>(&mut self, _w: &mut W) -> io::Result<()> {
        self.has_value = true;
        Ok(())
    }
}

/// Elements of a top-level array of the report, written (already indented)
/// to `sink` as they come, in [`SPOOL_CHUNK`] pieces: the array's opening
/// `[` with the first element, nothing before it (an empty array is only
/// known at the end, see [`JsonArray::close`]).
struct JsonArray<S: Write> {
    sink: S,
    buf: Vec<u8>,
    written: usize,
}

impl<S: Write> JsonArray<S> {
    fn new(sink: S) -> Self {
        JsonArray { sink, buf: Vec::with_capacity(SPOOL_CHUNK + 4096), written: 0 }
    }

    /// The next element, written by `f` (braces at level 2: the array is a
    /// member of the report's top level).
    fn push(&mut self, f: impl FnOnce(&mut Vec<u8>)) -> io::Result<()> {
        self.buf.push(if self.written > 0 { b',' } else { b'[' });
        json::newline(&mut self.buf, 2);
        f(&mut self.buf);
        self.written += 1;
        if self.buf.len() >= SPOOL_CHUNK {
            self.sink.write_all(&self.buf)?;
            self.buf.clear();
        }
        Ok(())
    }

    /// Writes what is buffered, and returns the sink and whether any element was written.
    fn drain(mut self) -> io::Result<(S, bool)> {
        self.sink.write_all(&self.buf)?;
        Ok((self.sink, self.written > 0))
    }

    /// Ends the array where it was written (the elements follow what was
    /// written to the sink before, `"name": `).
    fn close(self) -> io::Result<S> {
        let (mut sink, any) = self.drain()?;
        sink.write_all(if any { b"\n  ]" } else { b"[]" })?;
        Ok(sink)
    }
}

/// A [`JsonArray`] in an unlinked spool file, copied in at the end: the
/// report's per-step arrays grow with the recording, not with what is open,
/// and are written while the requests are.
struct ArraySpool(JsonArray<std::fs::File>);

impl ArraySpool {
    fn new() -> io::Result<Self> {
        Ok(ArraySpool(JsonArray::new(spool_file()?)))
    }

    fn push(&mut self, f: impl FnOnce(&mut Vec<u8>)) -> io::Result<()> {
        self.0.push(f)
    }

    /// Writes `"[" elements "\n  ]"` (or `[]`) to `out`, after what `b` holds.
    fn finish(self, b: &mut Vec<u8>, out: &mut dyn Write) -> io::Result<()> {
        let (mut file, any) = self.0.drain()?;
        if !any {
            b.extend_from_slice(b"[]");
            return Ok(());
        }
        out.write_all(b)?;
        b.clear();
        file.seek(io::SeekFrom::Start(0))?;
        io::copy(&mut file, out)?;
        b.extend_from_slice(b"\n  ]");
        Ok(())
    }
}

impl json::Value for GpuStepOut {
    fn write(&self, b: &mut Vec<u8>, level: usize) {
        let mut o = json::Obj::new(b, level);
        o.field("end_ns", &self.end_ns)
            .field("gpu_end_ns", &self.gpu_end_ns)
            .field("start_ns", &self.start_ns)
            .field("gpu_ms", &self.gpu_ms)
            .field("tokens", &self.tokens)
            .field("kernels", &self.kernels)
            .field("graph_kernels", &self.graph_kernels)
            .field("pids", &self.pids)
            .field("engine_pid", &self.engine_pid);
        o.end();
    }
}

impl json::Value for StepComputeOut {
    fn write(&self, b: &mut Vec<u8>, level: usize) {
        let mut o = json::Obj::new(b, level);
        o.field("end_ns", &self.end_ns).field("compute_ms", &self.compute_ms).field("source", compute_source_name(self.source));
        o.end();
    }
}

/// `v` as serde_json writes it pretty, starting `level` levels deep (the
/// report's small, one-off parts).
pub(crate) fn serde_nested<T: Serialize + ?Sized>(b: &mut Vec<u8>, level: usize, v: &T) -> io::Result<()> {
    v.serialize(&mut serde_json::Serializer::with_formatter(b, Nested { level, has_value: false }))?;
    Ok(())
}

/// An unlinked file in the temporary directory: gone with the process.
fn spool_file() -> io::Result<std::fs::File> {
    let dir = std::env::temp_dir();
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let path = dir.join(format!(".hopscope-report-{}-{nanos}.json", std::process::id()));
    let f = std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(&path).map_err(|e| {
        io::Error::new(e.kind(), format!("creating the report's spool file {}: {e} (set TMPDIR to a writable directory)", path.display()))
    })?;
    std::fs::remove_file(&path)?;
    Ok(f)
}

/// Reads a recording through the correlator, handing each request to `put`
/// as soon as it is final (its figures computed, its peak GPU memory set
/// when there are NVML samples), in report order, and the GPU steps to
/// `steps` as they are found. Returns what is left of the analysis (the
/// recording-wide parts: counters, kernels, GPUs, first and last times) and
/// the error that stopped the read early, if any.
pub(crate) fn stream_requests<R: Read, E>(
    reader: &mut crate::recording::Reader<R>,
    cfg: Config,
    gpu_mem: &mut GpuMemIndex,
    mut put: impl FnMut(&Request, &RequestRef) -> Result<(), E>,
    mut steps: impl FnMut(&[crate::correlate::gpu::GpuStep], &[crate::correlate::gpu::StepCompute]) -> Result<(), E>,
) -> Result<(Analysis, Option<String>), E> {
    let mut feed = RequestFeed::new(cfg);
    let read_error = loop {
        match reader.next_ref() {
            Ok(Some(r)) => {
                gpu_mem.ingest(r);
                feed.push(r, gpu_mem, &mut put, &mut steps)?;
            }
            Ok(None) => break None,
            Err(e) => break Some(e.to_string()),
        }
    };
    Ok((feed.finish(gpu_mem, &mut put, &mut steps)?, read_error))
}

/// A request's figures as the report gives them, with its peak GPU memory
/// from `gpu_mem` (none without NVML samples).
pub(crate) fn request_figures<'a>(r: &'a Request, itl: &'a mut Vec<f64>, sorted: &mut Vec<f64>, gpu_mem: &GpuMemIndex) -> RequestRef<'a> {
    let mut q = request_ref(r, itl, sorted);
    q.peak_gpu_mem_bytes = gpu_mem.peak_during(q.arrive_ns, q.done_ns);
    q
}

/// The correlator as the streaming sinks drive it, fed one record at a time
/// in file order (from a reader, [`stream_requests`], or from the recorder's
/// pipeline, `record --otlp`): each request is handed out once final, with
/// the report's figures.
pub(crate) struct RequestFeed {
    c: Correlator,
    clock: crate::correlate::DrainClock,
    itl: Vec<f64>,
    sorted: Vec<f64>,
}

impl RequestFeed {
    pub(crate) fn new(cfg: Config) -> Self {
        RequestFeed { c: Correlator::new(cfg), clock: Default::default(), itl: Vec::new(), sorted: Vec::new() }
    }

    /// Takes the next record; when it is time to, hands the requests now
    /// final to `put` and the GPU steps found to `steps`. Returns the
    /// recording time of that hand-out, if there was one.
    pub(crate) fn push<E>(
        &mut self,
        r: &crate::model::Record,
        gpu_mem: &GpuMemIndex,
        put: &mut impl FnMut(&Request, &RequestRef) -> Result<(), E>,
        steps: &mut impl FnMut(&[crate::correlate::gpu::GpuStep], &[crate::correlate::gpu::StepCompute]) -> Result<(), E>,
    ) -> Result<Option<u64>, E> {
        self.c.ingest(r);
        let Some(now) = self.clock.tick(r.ts_ns()) else { return Ok(None) };
        for r in self.c.drain_final(now) {
            put(&r, &request_figures(&r, &mut self.itl, &mut self.sorted, gpu_mem))?;
        }
        // The report has no use for engine steps (the trace has).
        self.c.take_steps();
        let (g, sc) = self.c.take_gpu_steps();
        steps(&g, &sc)?;
        Ok(Some(now))
    }

    /// The requests not handed out yet, as the correlator holds them.
    pub(crate) fn correlator(&self) -> &Correlator {
        &self.c
    }

    /// Hands out the rest (open requests unfinished) and returns what is left
    /// of the analysis: the recording-wide parts.
    pub(crate) fn finish<E>(
        self,
        gpu_mem: &GpuMemIndex,
        put: &mut impl FnMut(&Request, &RequestRef) -> Result<(), E>,
        steps: &mut impl FnMut(&[crate::correlate::gpu::GpuStep], &[crate::correlate::gpu::StepCompute]) -> Result<(), E>,
    ) -> Result<Analysis, E> {
        let RequestFeed { c, mut itl, mut sorted, .. } = self;
        let mut tail = c.finish_streaming();
        for r in std::mem::take(&mut tail.requests) {
            put(&r, &request_figures(&r, &mut itl, &mut sorted, gpu_mem))?;
        }
        steps(&std::mem::take(&mut tail.gpu_steps), &std::mem::take(&mut tail.step_compute))?;
        Ok(tail)
    }
}

/// The schema-1 JSON report of a recording, written while it is read (what
/// `hopscope report --json` prints): the same bytes as [`build`] serialized
/// pretty, with memory that follows the open requests. Returns the error that
/// stopped the read early, if any (the report covers what precedes it).
pub fn write_json<R: Read, W: Write>(reader: &mut crate::recording::Reader<R>, path: &str, cfg: Config, percentiles: &[f64], out: W) -> io::Result<Option<String>> {
    let meta = reader.meta().clone();
    let mut gpu_mem = GpuMemIndex::default();
    let (mut chains, mut acc) = (ChainBook::new()?, SummaryAcc::default());
    let (mut gpu_steps, mut step_compute) = (ArraySpool::new()?, ArraySpool::new()?);
    // The report's top level in `Report`'s field order. The requests come
    // second, before the recording-wide parts that are known only at the
    // end, so that they go straight to the output as they are final.
    let mut out = io::BufWriter::with_capacity(SPOOL_CHUNK, out);
    let mut buf = Vec::with_capacity(SPOOL_CHUNK);
    let b = &mut buf;
    b.extend_from_slice(b"{");
    json::newline(b, 1);
    b.extend_from_slice(b"\"schema\": ");
    json::uint(b, u64::from(SCHEMA));
    b.extend_from_slice(b",");
    json::newline(b, 1);
    b.extend_from_slice(b"\"requests\": ");
    out.write_all(b)?;
    b.clear();
    let mut requests = JsonArray::new(&mut out);
    let put = |r: &Request, q: &RequestRef| -> io::Result<()> {
        requests.push(|b| q.write_json(b, 2))?;
        chains.add(r, q)?;
        acc.add(q)
    };
    let push_steps = |g: &[crate::correlate::gpu::GpuStep], sc: &[crate::correlate::gpu::StepCompute]| -> io::Result<()> {
        g.iter().try_for_each(|g| gpu_steps.push(|b| json::Value::write(&gpu_step_out(g), b, 2)))?;
        sc.iter().try_for_each(|x| step_compute.push(|b| json::Value::write(&step_compute_out(x), b, 2)))
    };
    let (tail, read_error) = stream_requests(reader, cfg, &mut gpu_mem, put, push_steps)?;
    requests.close()?;
    let mut rep = build(path, &meta, &tail, read_error.clone());
    rep.recording.segments = reader.segments_read();
    let (chain_outs, hits) = chains.finish()?;
    rep.summary = acc.finish(hits, percentiles)?;
    gpu_mem.apply(&mut [], &mut rep.summary);

    b.extend_from_slice(b",");
    json::newline(b, 1);
    b.extend_from_slice(b"\"recording\": ");
    serde_nested(b, 1, &rep.recording)?;
    b.extend_from_slice(b",");
    json::newline(b, 1);
    b.extend_from_slice(b"\"chains\": ");
    if chain_outs.len() > 0 {
        b.push(b'[');
        chain_outs.write(b, &mut out)?;
        b.extend_from_slice(b"\n  ]");
    } else {
        b.extend_from_slice(b"[]");
    }
    b.extend_from_slice(b",");
    json::newline(b, 1);
    b.extend_from_slice(b"\"kernels\": ");
    serde_nested(b, 1, &rep.kernels)?;
    b.extend_from_slice(b",");
    json::newline(b, 1);
    b.extend_from_slice(b"\"summary\": ");
    rep.summary.write_json(b, 1, SPOOL_CHUNK, &mut out)?;
    b.extend_from_slice(b",");
    json::newline(b, 1);
    b.extend_from_slice(b"\"gpu_steps\": ");
    gpu_steps.finish(b, &mut out)?;
    b.extend_from_slice(b",");
    json::newline(b, 1);
    b.extend_from_slice(b"\"step_compute\": ");
    step_compute.finish(b, &mut out)?;
    b.extend_from_slice(b"\n}\n");
    out.write_all(b)?;
    out.flush()?;
    Ok(read_error)
}

/// The text report of a recording, written while it is read (what
/// `hopscope report` prints): the same bytes as [`render_text`] of [`build`]
/// (with `percentiles` and the NVML samples applied, as `report` does), with
/// memory that follows the open requests. The request table's lines go to
/// a spool file as the requests come (the recording line above them is known
/// only at the end), the hops' rows to the [`ChainBook`]'s. Returns the error
/// that stopped the read early, if any (the report covers what precedes it).
pub fn write_text<R: Read, W: Write>(reader: &mut crate::recording::Reader<R>, path: &str, cfg: Config, percentiles: &[f64], out: W) -> io::Result<Option<String>> {
    let meta = reader.meta().clone();
    let mut gpu_mem = GpuMemIndex::default();
    let mut lines = io::BufWriter::with_capacity(SPOOL_CHUNK, spool_file()?);
    let (mut chains, mut acc, mut line) = (ChainBook::with_rows(meta.gpu)?, SummaryAcc::default(), String::new());
    let put = |r: &Request, q: &RequestRef| -> io::Result<()> {
        line.clear();
        request_line(&mut line, &q.into());
        lines.write_all(line.as_bytes())?;
        chains.add(r, q)?;
        acc.add(q)
    };
    // The text report shows no steps: they are only let go.
    let (tail, read_error) = stream_requests(reader, cfg, &mut gpu_mem, put, |_, _| Ok(()))?;
    let mut rep = build(path, &meta, &tail, read_error.clone());
    rep.recording.segments = reader.segments_read();
    let (chain_outs, hits) = chains.finish()?;
    rep.summary = acc.finish(hits, percentiles)?;
    gpu_mem.apply(&mut [], &mut rep.summary);

    let mut out = io::BufWriter::with_capacity(SPOOL_CHUNK, out);
    let mut s = String::new();
    text_head(&mut s, &rep);
    out.write_all(s.as_bytes())?;
    let mut lines = lines.into_inner().map_err(io::IntoInnerError::into_error)?;
    lines.seek(io::SeekFrom::Start(0))?;
    io::copy(&mut lines, &mut out)?;
    chain_outs.write_text(&mut out, meta.gpu)?;
    s.clear();
    text_tail(&mut s, &rep);
    out.write_all(s.as_bytes())?;
    out.flush()?;
    Ok(read_error)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::json::Value;
    use crate::model::Record;
    use crate::sink::summary::ReqView;

    const NASTY: &str = "a\"b\\c/d\u{0}\u{1f}\n\t\r\u{8}\u{c}\u{7f} é 日本 🚀";

    /// Counter names written as literals in `src`: `count("x"`,
    /// `entry("x"`, `(("x", n)`, `("x".to_owned()`, `("x".into()`.
    fn literal_counters(src: &str) -> Vec<String> {
        // Not the file's tests.
        let src = src.split("#[cfg(test)]").next().unwrap_or(src);
        let mut out = Vec::new();
        for pat in ["count(\"", "entry(\"", "((\"", "(\""] {
            for (at, _) in src.match_indices(pat) {
                let rest = &src[at + pat.len()..];
                let Some(end) = rest.find('"') else { continue };
                let name = &rest[..end];
                let follows = &rest[end + 1..];
                let literal = match pat {
                    "((\"" => follows.starts_with(", "),
                    "(\"" => follows.starts_with(".to_owned()") || follows.starts_with(".into()"),
                    _ => true,
                };
                if literal && !name.is_empty() && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_') {
                    out.push(name.to_owned());
                }
            }
        }
        out
    }

    /// Every counter a recording's `drops` can hold — the kernel's, the
    /// wire decoder's, the pipeline's, the GPU and NVML receivers' and the
    /// correlator's — is explained in docs/counters.md.
    #[test]
    fn every_counter_a_report_can_show_is_in_the_glossary() {
        let doc = GLOSSARY;
        let mut names: Vec<String> = crate::source::ebpf::KernelStats::default().iter().map(|(n, _)| n.to_owned()).collect();
        names.extend(crate::proto::WireDecoder::new(crate::proto::DecoderConfig::default()).counters().into_iter().map(|(n, _)| n.to_owned()));
        names.extend(hopscope_gpu_wire::Counter::ALL.iter().map(|c| format!("gpu_{}", c.name())));
        names.extend(["events_late", "events_invalid", "gpu_records_late"].map(str::to_owned));
        // The receivers' files name other things in literals too: only
        // their prefix's names are counters.
        for (src, prefix) in [
            (include_str!("../source/cupti.rs"), "gpu_"),
            (include_str!("../source/nvml.rs"), "nvml_"),
            (include_str!("../correlate/mod.rs"), ""),
            (include_str!("../correlate/engine.rs"), ""),
            (include_str!("../correlate/gpu.rs"), ""),
            (include_str!("../correlate/oncpu.rs"), ""),
            (include_str!("../correlate/wire_steps.rs"), ""),
            (include_str!("../correlate/join.rs"), ""),
        ] {
            names.extend(literal_counters(src).into_iter().filter(|n| n.starts_with(prefix)));
        }
        names.sort();
        names.dedup();
        assert!(names.len() > 100, "{} names: the scan found too few", names.len());
        let missing: Vec<&String> = names.iter().filter(|n| !doc.contains(&format!("`{n}`"))).collect();
        assert!(missing.is_empty(), "counters missing from docs/counters.md: {missing:?}");
        // Each row's kind is the one the report prints it under.
        let mut rows = 0;
        for [name, kind, ..] in glossary_rows() {
            if name.contains('<') {
                continue;
            }
            let want = if is_loss(name) { "loss" } else { "activity" };
            assert_eq!(kind, want, "docs/counters.md: {name}");
            rows += 1;
        }
        assert!(rows >= names.len(), "{rows} rows for {} names", names.len());
    }

    /// The text report says, under each loss it prints, what the counter
    /// counts and what to do, from the glossary.
    #[test]
    fn the_text_report_explains_each_loss_it_prints_and_what_to_do() {
        let mut rep = build("t.hop", &Meta::default(), &Analysis::default(), None);
        rep.recording.drops.clear();
        for (k, v) in [("kernel_ringbuf_full", 7), ("responses_missing", 2), ("gpu_counter_99", 1), ("not_a_counter_yet", 3), ("kernel_events", 50), ("kernel_iov_truncated", 0)] {
            rep.recording.drops.insert(k.into(), v);
        }
        let text = render_text(&rep);
        let tail = &text[text.find("drops and anomalies").expect("section")..];
        let lines: Vec<&str> = tail.lines().collect();
        let at = |name: &str| lines.iter().position(|l| l.trim_start().starts_with(&format!("{name} "))).unwrap_or_else(|| panic!("{name} in {tail}"));
        // Its meaning and the flag to raise, under it.
        let block = |name: &str| lines[at(name) + 1..].iter().take_while(|l| l.starts_with("      ")).map(|l| l.trim()).collect::<Vec<_>>().join(" ");
        let ring_text = block("kernel_ringbuf_full");
        assert!(ring_text.contains("ring buffer had no room") && ring_text.contains("what to do: a larger ring buffer: `--ringbuf-mib`"), "{tail}");
        assert!(lines.iter().all(|l| l.chars().count() <= 100), "wrapped at 100 columns: {tail}");
        // "as `x`" is x's advice.
        let gloss_missing = gloss("responses_missing").expect("row");
        assert_eq!(gloss_missing.todo, gloss("responses_incomplete").expect("row").todo);
        assert!(gloss_missing.todo.is_some_and(|t| !t.starts_with("as `")));
        // Unknown injection-library numbers share one row; a name the
        // glossary lacks is still printed, bare.
        assert!(block("gpu_counter_99").contains("injection-library counter"), "{tail}");
        assert!(gloss("not_a_counter_yet").is_none() && block("not_a_counter_yet").is_empty(), "{tail}");
        // Activity is not explained; zeros are not printed.
        assert!(!tail.contains("records the probes submitted") && !tail.contains("kernel_iov_truncated"), "{tail}");
        assert!(tail.contains("activity: kernel_events=50"), "{tail}");
        // A long activity line wraps under itself.
        let activity = glossary_rows().map(|r| r[0]).filter(|n| !is_loss(n));
        rep.recording.drops = activity.map(|n| (n.to_owned(), 12_345)).collect();
        let text = render_text(&rep);
        let act: Vec<&str> = text[text.find("activity: ").expect("activity")..].lines().collect();
        assert!(act.len() > 3 && act.iter().all(|l| l.chars().count() <= 100) && act[1..].iter().all(|l| l.starts_with("          ") && !l[10..].starts_with(' ')), "{act:?}");
        // Every row of the glossary parses, with a meaning.
        let rows = GLOSSARY.lines().filter(|l| l.starts_with("| `")).count();
        let parsed = glossary_rows().filter_map(|[n, ..]| gloss(if n == "gpu_counter_<id>" { "gpu_counter_1" } else { n })).filter(|g| !g.what.is_empty()).count();
        assert!(rows > 100, "{rows} rows");
        assert_eq!(parsed, rows, "rows without a meaning, or that do not parse");
    }

    #[test]
    fn the_report_says_how_each_group_of_injected_processes_traced_the_gpu() {
        use hopscope_gpu_wire::enabled as e;
        let hello = |pid, enabled| Record::GpuProcess { ts_ns: 1, pid, ppid: 1, own_pid: pid, comm: "python".into(), cupti_version: 130001, clock: 2, enabled, init_ns: 1, cupti_lib: "/v/libcupti.so.13\u{1b}[2J".into() };
        let a = crate::correlate::analyse(&[hello(10, e::KERNEL | e::SYNC), hello(11, e::KERNEL | e::SYNC), hello(12, e::KERNEL | e::GRAPH_LAUNCH)]);
        let rep = build("t.hop", &Meta::default(), &a, None);
        let v = serde_json::to_value(&rep.recording).unwrap();
        assert_eq!(v["cupti"][0]["graphs"], "node");
        assert_eq!(v["cupti"][0]["pids"], serde_json::json!([10, 11]));
        assert_eq!(v["cupti"][1]["traced"], serde_json::json!(["kernel", "graph_launch"]));
        let text = render_text(&rep);
        assert!(text.contains("cupti 130001 (clock calibrated, CUDA graphs per node; traced kernel sync) in pids [10, 11]: /v/libcupti.so.13"), "{text}");
        assert!(text.contains("CUDA graphs per launch (their kernels unseen); traced kernel graph_launch) in pids [12]"), "{text}");
        assert!(!text.contains('\u{1b}'), "the library path is printed escaped");
    }

    fn edge_request<'a>(itl: &'a [f64], from: &'a [crate::correlate::Name]) -> RequestRef<'a> {
        RequestRef {
            id: NASTY,
            x_request_id: Some(""),
            traceparent: None,
            chain: "conn:1:2:3",
            hop: u32::MAX,
            method: "POST",
            path: "/v1/\"x\"",
            model: Some("org/m\\\"1\u{2028}"),
            status: Some(200),
            arrive_ns: u64::MAX,
            ttft_ns: None,
            done_ns: Some(0),
            ttft_ms: Some(f64::NAN),
            e2e_ms: Some(f64::INFINITY),
            itl_ms: itl,
            itl_p50_ms: Some(1e-300),
            itl_p90_ms: Some(1.7976931348623157e308),
            itl_p99_ms: None,
            prompt_tokens: Some(0),
            completion_tokens: None,
            cached_tokens: Some(u64::MAX),
            phases_ms: Phases { frontend: Some(0.1), queue: Some(-0.0), prefill: None, kv_transfer: Some(f64::NEG_INFINITY), first_output: Some(22.488), decode: Some(1e21) },
            gpu_ms: GpuMs { prefill: None, decode: None, kv_transfer: None },
            interference_ms: Some(5e-324),
            steps: None,
            chain_source: "connection",
            content_chunks: 0,
            streamed: false,
            request_bytes: 0,
            response_bytes: None,
            finish_reason: Some(NASTY),
            pid: 7,
            fd: -1,
            wire_arrive_ns: None,
            read_delay_ms: Some(1.0 / 3.0),
            wire_ttft_ms: None,
            wire_e2e_ms: Some(123456789.125),
            phase_source: "wire",
            engine_request_id: None,
            engine_index: Some(u64::MAX),
            scheduled_source: Some("event"),
            submit_source: Some("arrival_time"),
            preemptions: Some(0),
            interference_from: from,
            computed_tokens: None,
            marks_clamped: 3,
            steps_source: None,
            peak_gpu_mem_bytes: Some(1 << 40),
            compute_ms: Some(ComputeMs { prefill: None, decode: Some(f64::NAN), steps: 0 }),
            compute_source: Some("oncpu"),
            gpu_steps: None,
            kernels: None,
            closed_ns: Some(u64::MAX),
            closed_ms: Some(-0.0),
            completion_tokens_source: Some("engine"),
            previous_response_id: Some("resp_\"q\\"),
            last_output_ms: Some(f64::INFINITY),
            first_output_held_ms: Some(f64::NAN),
            tokens_before_first_content: Some(u64::MAX),
            empty_chunks_before_content: Some(u32::MAX),
            scheduler_queue_ms: Some(f64::MIN_POSITIVE),
            structured_output: Some("json"),
            structured_output_backend: Some("x\"grammar\u{1}"),
            scheduler_passed_over_by: Some(u32::MAX),
            scheduler_passed_over_ms: Some(1e300),
            scheduler_grammar_ready_ms: Some(f64::MIN_POSITIVE),
            priority: Some(i64::MIN),
        }
    }

    fn written(f: impl FnOnce(&mut Vec<u8>)) -> String {
        let mut b = Vec::new();
        f(&mut b);
        String::from_utf8(b).expect("utf-8")
    }


    const MS: u64 = 1_000_000;
    const SEC: u64 = 1_000_000_000;

    /// One streamed exchange on connection `fd`: head, role, `n` content
    /// chunks about `itl` ms apart (`chunks`), usage (prompt and cached
    /// tokens, unless `tokens` is None), done, end.
    fn exchange(fd: i32, seq: u32, id: &str, at: u64, (n, itl): (u64, u64), headers: &[(&str, &str)], tokens: Option<(u64, u64)>) -> Vec<Record> {
        use crate::event::ConnKey;
        use crate::model::{HttpRole, SseKind, Usage};
        let c = ConnKey { tgid: 100, fd, ino: 9000 + fd as u64 };
        let sse = |ts_ns: u64, kind: SseKind, usage: Option<Usage>| Record::Sse { conn: c, seq, ts_ns, kind, id: Some(id.into()), content_bytes: 3, finish_reason: None, usage };
        let mut v = vec![
            Record::HttpRequest {
                conn: c,
                role: HttpRole::Server,
                seq,
                start_ns: at,
                end_ns: at + 10_000,
                tid: 100,
                method: "POST".into(),
                path: "/v1/chat/completions".into(),
                headers: headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
                body_len: 321,
                stream: Some(true),
                model: None,
                ready_ns: Some(at - 300_000),
            },
            Record::HttpResponse { conn: c, role: HttpRole::Server, seq, ts_ns: at + MS, tid: 100, status: 200, headers: vec![("content-type".into(), "text/event-stream".into())] },
            sse(at + 3 * MS / 2, SseKind::Role, None),
        ];
        // Uneven gaps, so an ITL average is not one of its ITLs.
        let mut t = at + 5 * MS;
        for k in 0..n {
            v.push(sse(t, SseKind::Content, None));
            t += itl * MS + k * 137_000;
        }
        let usage = tokens.map(|(prompt, cached)| Usage { prompt_tokens: Some(prompt), completion_tokens: Some(n), cached_tokens: Some(cached) });
        v.push(sse(t, SseKind::Usage, usage));
        v.push(sse(t + 100, SseKind::Done, None));
        v.push(Record::HttpResponseEnd { conn: c, seq, ts_ns: t + 200, body_len: 999 });
        v
    }

    fn gpu_sample(ts_ns: u64, bytes: u64) -> Record {
        Record::test_gpu_sample(ts_ns, 0, vec![(100, bytes)])
    }

    /// What `hopscope report` printed before it streamed: the whole analysis
    /// in memory, the summary recomputed for `percentiles`, the NVML samples
    /// applied.
    fn in_memory_text(bytes: &[u8], percentiles: &[f64]) -> String {
        let mut reader = crate::recording::Reader::new(bytes).expect("reader");
        let meta = reader.meta().clone();
        let (mut c, mut gpu_mem) = (Correlator::new(Config::default()), GpuMemIndex::default());
        let read_error = loop {
            match reader.next_record() {
                Ok(Some(r)) => {
                    gpu_mem.ingest(&r);
                    c.ingest(&r);
                }
                Ok(None) => break None,
                Err(e) => break Some(e.to_string()),
            }
        };
        let mut rep = build("text.hop", &meta, &c.finish(), read_error);
        rep.summary = summary::compute(&rep.requests, &rep.chains, percentiles);
        gpu_mem.apply(&mut rep.requests, &mut rep.summary);
        render_text(&rep)
    }

    fn text_row<'a>(phases: &'a Phases, interference_from: Vec<&'a str>, preemptions: Option<u32>) -> TextRow<'a> {
        TextRow {
            id: "chatcmpl-x",
            chain: Some("c"),
            hop: Some(1),
            method: "POST",
            path: "/v1/chat/completions",
            status: Some(200),
            ttft_ms: Some(10.0),
            e2e_ms: Some(50.0),
            itl_ms: &[],
            itl_p50_ms: None,
            itl_p90_ms: None,
            itl_p99_ms: None,
            content_chunks: 0,
            prompt_tokens: None,
            completion_tokens: None,
            cached_tokens: None,
            phases_ms: phases,
            interference_ms: Some(12.5),
            interference_from,
            preemptions,
            gpu_ms: GpuMs { prefill: None, decode: None, kv_transfer: None },
            model: None,
            closed_ms: None,
            first_output_held_ms: None,
            tokens_before_first_content: None,
            empty_chunks_before_content: None,
            scheduler_queue_ms: None,
            structured_output: None,
            scheduler_passed_over_by: None,
            scheduler_passed_over_ms: None,
            scheduler_grammar_ready_ms: None,
        }
    }

    /// A queue of a tenth of the hop's E2E or more, split by the engine's
    /// stamps, is told under the row: the part before the engine took the
    /// request in, and the scheduler's; not with KV carved out of it.
    #[test]
    fn a_hops_note_splits_a_long_queue_into_the_way_in_and_the_schedulers_queue() {
        let note_for = |queue: f64, kv: Option<f64>, sched: Option<f64>, structured: Option<&str>| {
            let phases = Phases { frontend: None, queue: Some(queue), prefill: None, kv_transfer: kv, first_output: None, decode: None };
            let mut q = text_row(&phases, vec![], None);
            q.scheduler_queue_ms = sched;
            q.structured_output = structured;
            let mut row = String::new();
            let _ = hop_figures(&mut row, &q, false);
            row.split_once('\n').map(|(_, n)| n.to_owned())
        };
        let note = |queue: f64, kv: Option<f64>, sched: Option<f64>| note_for(queue, kv, sched, None);
        // A structured-output request's wait is the scheduler's: its grammar.
        assert_eq!(note_for(20.0, None, Some(19.5), Some("json")).as_deref(), Some("        ^ queued 20.00 ms: 0.50 before the engine took it in (the IPC, the step it was running), 19.50 in the scheduler's queue (for a free slot, or for its grammar: it asked for structured output, json, which vLLM's scheduler holds until its grammar is compiled)"));
        assert_eq!(note_for(20.0, None, Some(10.0), Some("regex")).as_deref(), Some("        ^ queued 20.00 ms: 10.00 before the engine took it in (the IPC, the step it was running), 10.00 in the scheduler's queue (for a free slot, or for its grammar: it asked for structured output, regex, which vLLM's scheduler holds until its grammar is compiled)"));
        assert_eq!(note_for(20.0, None, Some(9.9), Some("json")).as_deref(), Some("        ^ queued 20.00 ms: 10.10 before the engine took it in (the IPC, the step it was running), 9.90 in the scheduler's queue"), "most of the queue before the scheduler's: no grammar to blame");
        assert_eq!(note(20.0, None, Some(0.25)).as_deref(), Some("        ^ queued 20.00 ms: 19.75 before the engine took it in (the IPC, the step it was running), 0.25 in the scheduler's queue"));
        assert_eq!(note(20.0, Some(0.0), Some(0.25)).as_deref(), Some("        ^ queued 20.00 ms: 19.75 before the engine took it in (the IPC, the step it was running), 0.25 in the scheduler's queue"));
        assert_eq!(note(4.9, None, Some(0.25)), None, "under a tenth of the 50 ms E2E");
        assert_eq!(note(20.0, None, None), None, "no engine stamps");
        assert_eq!(note(20.0, Some(3.0), Some(22.0)), None, "KV carved out of the queue");
    }

    /// A first content held back for a tenth of the TTFT or more (and 1 ms)
    /// is told under the row with the tokens made by then; a lone token or a
    /// short hold is not.
    #[test]
    fn a_hops_note_says_the_first_content_was_held_back_while_the_engine_made_tokens() {
        let note = |held: Option<f64>, tokens: Option<u64>| {
            let phases = Phases { frontend: None, queue: None, prefill: None, kv_transfer: None, first_output: held.map(|h| h + 0.5), decode: None };
            let mut q = text_row(&phases, vec![], None);
            (q.interference_ms, q.ttft_ms) = (None, Some(40.0));
            (q.first_output_held_ms, q.tokens_before_first_content) = (held, tokens);
            let mut row = String::new();
            let _ = hop_figures(&mut row, &q, false);
            row.split_once('\n').map(|(_, n)| n.to_owned())
        };
        assert_eq!(note(Some(25.0), Some(6)).as_deref(), Some("        ^ first content 25.00 ms after the first token, 6 tokens generated by then: the server held their text back (stop strings, incomplete UTF-8, a parser waiting for a whole tag) or its output path fell behind the steps"));
        assert!(note(Some(4.0), Some(2)).is_some(), "a tenth of the 40 ms TTFT");
        assert_eq!(note(Some(3.9), Some(2)), None, "under a tenth of the TTFT");
        assert_eq!(note(Some(0.0), Some(1)), None, "straight out");
        assert_eq!(note(Some(25.0), None), None, "no count: kept outputs ran out");
        assert_eq!(note(None, None), None, "no IPC");
        // Chunks without text sent meanwhile (a chat or completions stream) say it was held, not late.
        let with_empty = |k: Option<u32>| {
            let phases = Phases { frontend: None, queue: None, prefill: None, kv_transfer: None, first_output: Some(25.5), decode: None };
            let mut q = text_row(&phases, vec![], None);
            (q.interference_ms, q.ttft_ms, q.first_output_held_ms, q.tokens_before_first_content, q.empty_chunks_before_content) = (None, Some(40.0), Some(25.0), Some(6), k);
            let mut row = String::new();
            let _ = hop_figures(&mut row, &q, false);
            row
        };
        let note_of = |row: &str| row.split_once('\n').map(|(_, n)| n.to_owned());
        assert_eq!(note_of(&with_empty(Some(5))).as_deref(), Some("        ^ first content 25.00 ms after the first token, 6 tokens generated by then, 5 chunks without text sent meanwhile: the server held their text back (a stop string may have been starting, or incomplete UTF-8)"));
        assert!(note_of(&with_empty(Some(1))).unwrap().contains(", 1 chunk without text sent meanwhile: "));
        assert_eq!(note_of(&with_empty(Some(0))), note_of(&with_empty(None)), "none sent: held or behind, as before");

        // In a chain table the why is told once; the hops after it say so in
        // a few words, and what follows in their note stays.
        let row = |held: f64, from: Vec<&str>| {
            let phases = Phases { frontend: None, queue: None, prefill: None, kv_transfer: None, first_output: Some(held + 0.5), decode: None };
            let mut q = text_row(&phases, from, None);
            (q.e2e_ms, q.ttft_ms) = (Some(100.0), Some(40.0));
            (q.first_output_held_ms, q.tokens_before_first_content) = (Some(held), Some(6));
            let mut row = String::new();
            let _ = hop_figures(&mut row, &q, false);
            row
        };
        let chain = |rows: &[String], told: &mut NotesTold| {
            let mut s = String::new();
            for (n, r) in rows.iter().enumerate() {
                write_hop(&mut s, n + 1, r, false, None, ChainModels::None, told);
            }
            s.lines().filter(|l| l.contains('^')).map(str::to_owned).collect::<Vec<_>>()
        };
        let rows = [row(25.0, vec![]), row(30.0, vec!["chatcmpl-x"]), row(12.0, vec![])];
        let mut told = NotesTold::default();
        let notes = chain(&rows, &mut told);
        assert_eq!(notes.len(), 3, "{notes:?}");
        let (why, again) = HELD_WHYS[1];
        assert!(notes[0].ends_with(why), "{notes:?}");
        assert!(notes[1].starts_with(&format!("        ^ first content 30.00 ms after the first token, 6 tokens generated by then{again}; decode lost")) && notes[1].contains("chatcmpl-x"), "{notes:?}");
        assert_eq!(notes[2], format!("        ^ first content 12.00 ms after the first token, 6 tokens generated by then{again}"));
        // The next chain tells it again.
        assert!(chain(&rows, &mut NotesTold::default())[0].ends_with(why));
        // Each why is told once: a held hop, an ambiguous one, then each again.
        let rows = [with_empty(Some(3)), with_empty(Some(0)), with_empty(Some(2)), with_empty(None)];
        let notes = chain(&rows, &mut NotesTold::default());
        assert!(notes[0].ends_with(HELD_WHYS[0].0) && notes[1].ends_with(HELD_WHYS[1].0), "{notes:?}");
        assert!(notes[2].ends_with(&format!("2 chunks without text sent meanwhile{}", HELD_WHYS[0].1)) && notes[3].ends_with(HELD_WHYS[1].1), "{notes:?}");
    }

    /// Requests let past it say the scheduler skipped it: for its grammar if
    /// it asked for structured output, else for what else vLLM skips for;
    /// none let past leaves the either-or.
    #[test]
    fn a_hops_note_says_the_scheduler_skipped_a_request_that_later_ones_went_past() {
        let note_with = |sched: f64, passed: Option<u32>, structured: Option<&str>| {
            let phases = Phases { frontend: None, queue: Some(20.0), prefill: None, kv_transfer: None, first_output: None, decode: None };
            let mut q = text_row(&phases, vec![], None);
            (q.scheduler_queue_ms, q.structured_output) = (Some(sched), structured);
            (q.scheduler_passed_over_by, q.scheduler_passed_over_ms) = (passed, passed.map(|n| if n > 0 { sched - 2.25 } else { 0.0 }));
            let mut row = String::new();
            let _ = hop_figures(&mut row, &q, false);
            row.split_once('\n').map(|(_, n)| n.to_owned()).expect("a note")
        };
        let note_for = |passed: Option<u32>, structured: Option<&str>| note_with(19.5, passed, structured);
        let head = "        ^ queued 20.00 ms: 0.50 before the engine took it in (the IPC, the step it was running), 19.50 in the scheduler's queue";
        assert_eq!(note_for(Some(3), Some("json")), format!("{head} (3 later requests went past it, the last 17.25 ms after it was queued: vLLM's scheduler lets one past only while it skips this one, here for its grammar: it asked for structured output, json, which is held until its grammar is compiled)"));
        assert_eq!(note_for(Some(1), None), format!("{head} (1 later request went past it, the last 17.25 ms after it was queued: vLLM's scheduler lets one past only while it skips this one, for remote KV not loaded yet, no free LoRA slot, or, chunked prefill off, a prompt over the token budget left)"));
        let either = format!("{head} (for a free slot, or for its grammar: it asked for structured output, json, which vLLM's scheduler holds until its grammar is compiled)");
        assert_eq!(note_for(Some(0), Some("json")), either, "nobody went past: no proof either way");
        assert_eq!(note_for(None, Some("json")), either);
        assert_eq!(note_for(Some(0), None), head, "nothing to say about a plain request nobody passed");
        // A long step before the engine took it in (most of the queue) does
        // not hide the passes: they are proof whatever the scheduler's share.
        assert_eq!(
            note_with(9.0, Some(5), Some("json")),
            "        ^ queued 20.00 ms: 11.00 before the engine took it in (the IPC, the step it was running), 9.00 in the scheduler's queue (5 later requests went past it, the last 6.75 ms after it was queued: vLLM's scheduler lets one past only while it skips this one, here for its grammar: it asked for structured output, json, which is held until its grammar is compiled)"
        );
        assert_eq!(note_with(9.0, Some(0), Some("json")), "        ^ queued 20.00 ms: 11.00 before the engine took it in (the IPC, the step it was running), 9.00 in the scheduler's queue", "no passes, the scheduler's part under half: no guess");
    }

    /// A structured-output request nobody went past, whose constraint
    /// another request had scheduled while it waited: its grammar was ready
    /// then, and the note says what held it after — when that was most of
    /// its scheduler's queue; else the either-or stays.
    #[test]
    fn a_hops_note_says_a_request_waited_for_room_once_its_grammar_was_ready() {
        let note_for = |ready: Option<f64>| {
            let phases = Phases { frontend: None, queue: Some(20.0), prefill: None, kv_transfer: None, first_output: None, decode: None };
            let mut q = text_row(&phases, vec![], None);
            (q.scheduler_queue_ms, q.structured_output) = (Some(19.5), Some("json"));
            (q.scheduler_passed_over_by, q.scheduler_passed_over_ms, q.scheduler_grammar_ready_ms) = (Some(0), Some(0.0), ready);
            let mut row = String::new();
            let _ = hop_figures(&mut row, &q, false);
            row.split_once('\n').map(|(_, n)| n.to_owned()).expect("a note")
        };
        let head = "        ^ queued 20.00 ms: 0.50 before the engine took it in (the IPC, the step it was running), 19.50 in the scheduler's queue";
        assert_eq!(note_for(Some(4.0)), format!("{head} (its grammar — structured output, json — was ready within 4.00 ms, when a request asking for the same was scheduled; the 15.50 ms after it waited for room: a free slot, the token budget or KV blocks, or the step in progress)"));
        let either = format!("{head} (for a free slot, or for its grammar: it asked for structured output, json, which vLLM's scheduler holds until its grammar is compiled)");
        assert_eq!(note_for(Some(12.0)), either, "most of the wait before the grammar was known ready");
        assert_eq!(note_for(None), either, "no request of the same constraint seen");
    }

    /// The note under a hop: every interferer up to four, then how many
    /// more; the preemptions; nothing when there is neither; and the row's
    /// GPU memory column still ends the figures' line, not the note's.
    #[test]
    fn a_hops_note_names_four_interferers_then_counts_and_says_its_preemptions() {
        let phases = Phases { frontend: None, queue: None, prefill: None, kv_transfer: None, first_output: None, decode: None };
        let six = vec!["a", "b", "c", "d", "e", "f"];
        let note = |from: Vec<&str>, pre: Option<u32>| {
            let mut row = String::new();
            let _ = hop_figures(&mut row, &text_row(&phases, from, pre), false);
            let mut s = String::new();
            write_hop(&mut s, 3, &row, true, Some(3 << 20), ChainModels::None, &mut NotesTold::default());
            s
        };
        let s = note(six, Some(2));
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines.len(), 2, "{s}");
        assert!(lines[0].starts_with("    3 ") && lines[0].ends_with("       3.00"), "{s}");
        assert_eq!(lines[1], "        ^ decode lost 12.50 ms to the co-batched prefill of a, b, c, d and 2 more; preempted 2 times");
        assert_eq!(note(vec![], Some(1)).lines().nth(1), Some("        ^ preempted 1 time"));
        assert_eq!(note(vec!["a"], Some(0)).lines().nth(1), Some("        ^ decode lost 12.50 ms to the co-batched prefill of a"));
        assert_eq!(note(vec![], Some(0)).lines().count(), 1);
        // Under a tenth of the hop's E2E, the interf column says it all.
        let mut row = String::new();
        let mut small = text_row(&phases, vec!["a"], None);
        small.interference_ms = Some(4.9);
        let _ = hop_figures(&mut row, &small, false);
        assert!(!row.contains('\n'), "{row}");
        small.interference_ms = Some(5.0);
        row.clear();
        let _ = hop_figures(&mut row, &small, false);
        assert!(row.ends_with("\n        ^ decode lost 5.00 ms to the co-batched prefill of a"), "{row}");
        assert_eq!(note(vec![], None).lines().count(), 1);
    }

    /// A `sum` column is `-` unless every hop has the figure; hops that ran
    /// at the same time overlap rather than leave the client time; the GPU
    /// memory column shows the largest peak; a lone hop has no sum row.
    #[test]
    fn a_chain_sum_needs_every_hop_and_says_when_hops_overlap() {
        let hop = |ttft: Option<f64>, e2e: f64| {
            let mut v = [Some(1.0); SUMS];
            v[0] = ttft;
            v[13] = Some(e2e);
            HopSums(v)
        };
        assert_eq!(HopSums::decode(&hop(None, 2.5).encode()), hop(None, 2.5));
        let mut sums = ChainSums::default();
        sums.add(&hop(Some(10.0), 100.0), Some(1 << 20));
        sums.add(&hop(None, 60.0), Some(3 << 20));
        let mut s = String::new();
        sums.write(&mut s, false, true, Some(150.0));
        let lines: Vec<&str> = s.lines().collect();
        let row: Vec<&str> = lines[0].split_whitespace().collect();
        assert_eq!((row[0], row[1], row[2]), ("sum", "-", "2.00"), "{s}");
        assert_eq!(&row[row.len() - 2..], ["160.00", "3.00"], "{s}");
        assert_eq!(lines[1], "        the hops overlap: their E2E add up to 10.00 ms more than the chain's 150.00 ms");
        let mut s = String::new();
        sums.write(&mut s, false, false, None);
        assert_eq!(s.lines().count(), 1, "no chain E2E, no line about the time between hops: {s}");
        let mut one = ChainSums::default();
        one.add(&hop(Some(1.0), 1.0), None);
        let mut s = String::new();
        one.write(&mut s, false, false, Some(5.0));
        assert!(s.is_empty(), "{s}");
    }

    /// A recording with GPU records: the chain tables get the GPU share of
    /// each hop's prefill and decode (`gpu_ms`), streamed and in memory alike;
    /// a recording without has no such columns.
    #[test]
    fn a_gpu_recordings_hop_table_shows_the_gpu_share_of_prefill_and_decode() {
        let recs = crate::sink::perfetto::tests::gpu_served_request();
        let bytes = |gpu: bool| {
            let meta = crate::recording::Meta { chain_header: "x-session-id".into(), gpu, ..crate::recording::Meta::default() };
            let mut w = crate::recording::Writer::new(Vec::new(), &meta).expect("writer");
            for r in &recs {
                w.push(r).expect("push");
            }
            w.finish(recs.last().map_or(0, Record::ts_ns)).expect("finish")
        };
        let (with, without) = (bytes(true), bytes(false));
        let streamed = |b: &[u8]| {
            let mut reader = crate::recording::Reader::new(b).expect("reader");
            let mut got = Vec::new();
            write_text(&mut reader, "text.hop", Config::default(), summary::DEFAULT_PERCENTILES, &mut got).expect("streamed text report");
            String::from_utf8(got).expect("utf-8")
        };
        let text = streamed(&with);
        assert_eq!(text, in_memory_text(&with, summary::DEFAULT_PERCENTILES));
        // The figures the JSON report gives.
        let mut reader = crate::recording::Reader::new(&with[..]).expect("reader");
        let mut c = Correlator::new(Config::default());
        while let Some(r) = reader.next_record().expect("record") {
            c.ingest(&r);
        }
        let rep = build("text.hop", reader.meta(), &c.finish(), None);
        let q = rep.requests.iter().find(|q| q.chain.as_deref() == Some("s1")).expect("the served request");
        let (pf, dec) = (q.gpu_ms.prefill.expect("a prefill share"), q.gpu_ms.decode.expect("a decode share"));
        assert!(pf > 0.0 && dec > 0.0, "{:?}", q.gpu_ms);
        let lines: Vec<&str> = text.lines().collect();
        let head = lines.iter().position(|l| l.starts_with("chain s1 ")).expect("the chain's table") + 1;
        let cols: Vec<&str> = lines[head].split_whitespace().collect();
        let row: Vec<&str> = lines[head + 1].split_whitespace().collect();
        assert_eq!(cols.len(), row.len(), "{}\n{}", lines[head], lines[head + 1]);
        let at = |name: &str| row[cols.iter().position(|c| *c == name).unwrap_or_else(|| panic!("no {name} column: {}", lines[head]))];
        assert_eq!((at("gpu_pf"), at("gpu_dec")), (format!("{pf:.2}").as_str(), format!("{dec:.2}").as_str()));
        assert_eq!(at("e2e_ms"), format!("{:.2}", q.e2e_ms.unwrap()));
        let plain = streamed(&without);
        assert!(!plain.contains("gpu_pf") && !plain.contains("gpu_dec"), "{plain}");
        assert_eq!(plain, in_memory_text(&without, summary::DEFAULT_PERCENTILES));
    }

    #[test]
    fn the_streamed_text_report_prints_what_the_in_memory_one_does() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut recs = Vec::new();
        // A traceparent chain of two hops, a header chain of two, a
        // connection chain of two, connection chains of one (not shown).
        recs.extend(exchange(5, 0, "chatcmpl-a", SEC, (4, 2), &[("traceparent", tp)], Some((40, 30))));
        recs.extend(exchange(6, 0, "chatcmpl-dup", SEC + 20 * MS, (6, 3), &[("x-session-id", "s1")], Some((50, 10))));
        recs.extend(exchange(7, 0, "chatcmpl-b", 3 * SEC, (2, 5), &[("traceparent", tp)], None));
        recs.extend(exchange(6, 1, "chatcmpl-c", 4 * SEC + 500 * MS, (3, 1), &[("x-session-id", "s1")], Some((80, 64))));
        // The header chain's third hop: its client left after 300 ms, its
        // response head sent, no chunk yet.
        recs.extend(exchange(13, 0, "-", 4 * SEC + 800 * MS, (1, 1), &[("x-session-id", "s1")], None).into_iter().take(2));
        recs.push(Record::ConnClose { ts_ns: 5 * SEC + 100 * MS, conn: crate::event::ConnKey { tgid: 100, fd: 13, ino: 9013 } });
        recs.extend(exchange(8, 0, "chatcmpl-d", 5 * SEC, (5, 2), &[], Some((10, 0))));
        recs.extend(exchange(8, 1, "chatcmpl-e", 5 * SEC + 500 * MS, (1, 2), &[], Some((12, 12))));
        // The header chain's first hop's id again, later, without token
        // counts or GPU memory: a hop is shown with the last request of its id.
        recs.extend(exchange(9, 0, "chatcmpl-dup", 6 * SEC, (2, 7), &[], None));
        recs.extend(exchange(10, 0, "chatcmpl-f", 6 * SEC + 100 * MS, (3, 4), &[], Some((7, 1))));
        // NVML saw the first second's requests and the traceparent chain's second hop only.
        for (k, b) in [(0, 3 << 30), (10, 5 << 30), (30, 4 << 30)] {
            recs.push(gpu_sample(SEC + k * MS, b));
        }
        recs.push(gpu_sample(3 * SEC + 2 * MS, 6 << 30));
        // Lost with the damaged block: a request in flight at the cut, and one after.
        recs.extend(exchange(11, 0, "chatcmpl-g", 7 * SEC - 2 * MS, (3, 4), &[], Some((7, 1))));
        recs.extend(exchange(12, 0, "chatcmpl-h", 8 * SEC, (3, 4), &[], Some((7, 1))));
        // The traceparent chain's hops name one model, the header chain's
        // two (one with a terminal escape in it), the connection chain's none.
        for r in &mut recs {
            if let Record::HttpRequest { conn, seq, model, .. } = r {
                *model = match (conn.fd, *seq) {
                    (5 | 7 | 6 | 9, 0) => Some("m-big".into()),
                    (6, 1) => Some("m-small\u{1b}[2J".into()),
                    _ => None,
                };
            }
        }
        recs.sort_by_key(Record::ts_ns);
        let meta = crate::recording::Meta::default();
        let mut w = crate::recording::Writer::new(Vec::new(), &meta).expect("writer");
        let mut sealed = false;
        for r in &recs {
            if r.ts_ns() >= 7 * SEC && !sealed {
                w.seal(r.ts_ns()).expect("seal");
                sealed = true;
            }
            w.push(r).expect("push");
        }
        let mut bytes = w.finish(8 * SEC + SEC).expect("finish");
        bytes.truncate(bytes.len() - 7);
        for p in [&[25.0, 75.0, 99.9][..], summary::DEFAULT_PERCENTILES] {
            let want = in_memory_text(&bytes, p);
            let mut reader = crate::recording::Reader::new(&bytes[..]).expect("reader");
            let mut got = Vec::new();
            let err = write_text(&mut reader, "text.hop", Config::default(), p, &mut got).expect("streamed text report");
            assert!(err.as_deref().is_some_and(|e| e.contains("truncated")), "{err:?}");
            let got = String::from_utf8(got).expect("utf-8");
            if got != want {
                let at = got.lines().zip(want.lines()).position(|(a, b)| a != b);
                panic!("first differing line {at:?}\n--- streamed:\n{got}\n--- in memory:\n{want}");
            }
            // What the comparison covers: three chain tables, the GPU memory
            // column in the traceparent chain's only (the header chain's
            // first hop is shown as the later chatcmpl-dup, without a peak),
            // the read error, the percentiles asked for.
            assert_eq!(got.matches("\nchain ").count(), 3, "{got}");
            // The hop its client left: closed in both tables, its wait in
            // parentheses, the chain's E2E to the close.
            assert!(got.lines().any(|l| l.starts_with("conn:100:13:0 ") && l.contains(" closed ") && l.contains("(300.00)")), "{got}");
            assert!(got.contains("chain s1 (header, 3 hops, e2e 4080.00 ms"), "{got}");
            assert!(got.contains("^ connection closed 300.00 ms after arrival"), "{got}");
            assert_eq!(got.matches("gpu_mem_mib").count(), 1, "{got}");
            assert!(got.contains("WARNING: the recording ends early"), "{got}");
            assert!(p.iter().all(|&p| got.contains(&format!("P{} TTFT (ms):", &summary::percentile_key(p)[1..]))), "{got}");
            // One model: in the title; several: a column, escaped; none: neither.
            assert!(got.contains(" hops, e2e ") && got.lines().any(|l| l.starts_with("chain 4bf92f3577b34da6a3ce929d0e0e4736 (traceparent, 2 hops, e2e ") && l.ends_with(" ms, model m-big)")), "{got}");
            let s1 = &got[got.find("\nchain s1 ").expect("s1's table")..];
            let s1: Vec<&str> = s1.lines().skip(1).take(4).collect();
            assert!(s1[1].ends_with("  model") && s1[2].ends_with("  m-big") && s1[3].ends_with("  m-small\\u{1b}[2J"), "{s1:#?}");
            assert!(!got.contains('\u{1b}') && !got.contains(MODEL_SEP), "{got}");
            let tables = &got[..got.find("==== Serving Summary").expect("summary")];
            assert_eq!(tables.matches("model").count(), 2, "the title's and s1's column: {got}");
            // Nine requests: chatcmpl-g unfinished at the cut, chatcmpl-h lost with the block.
            assert_eq!(got.lines().filter(|l| l.starts_with("chatcmpl-")).count(), 9, "{got}");
            // s1's hit rate: chatcmpl-c's 64 of 80 alone (the later chatcmpl-dup has no counts).
            assert!(got.contains(&format!("{:<40} {:<10}\n", "s1:", "80.00%")), "{got}");
        }
    }

    #[test]
    fn request_writer_gives_serde_json_pretty_bytes_on_edge_values() {
        let itls = [20.827, 0.0, f64::NAN, 1e-7, 1e16, 12.759];
        let from: [crate::correlate::Name; 2] = [NASTY.into(), "".into()];
        for (itl, from) in [(&itls[..], &from[..]), (&[][..], &[][..])] {
            let q = edge_request(itl, from);
            assert_eq!(written(|b| q.write_json(b, 0)), serde_json::to_string_pretty(&q.to_out()).unwrap());
            let q = RequestRef { compute_ms: None, compute_source: None, x_request_id: None, ..edge_request(itl, from) };
            assert_eq!(written(|b| q.write_json(b, 0)), serde_json::to_string_pretty(&q.to_out()).unwrap());
        }
        // Its kernels: none, and names that need escaping with odd times.
        use crate::correlate::gpu::KernelShare;
        let kernels = [KernelShare { name: NASTY.into(), gpu_ns: 1 }, KernelShare { name: "".into(), gpu_ns: u64::MAX }, KernelShare { name: "_Z4gemmPf".into(), gpu_ns: 0 }];
        for k in [&kernels[..], &[][..]] {
            let q = RequestRef { kernels: Some(k), ..edge_request(&itls, &from) };
            assert_eq!(written(|b| q.write_json(b, 0)), serde_json::to_string_pretty(&q.to_out()).unwrap());
        }
    }

    #[test]
    fn step_writers_and_source_names_give_serde_json_bytes() {
        use crate::correlate::gpu::ComputeSource;
        for g in [
            GpuStepOut { end_ns: 1, gpu_end_ns: u64::MAX, start_ns: 0, gpu_ms: f64::NAN, tokens: None, kernels: 0, graph_kernels: u32::MAX, pids: vec![], engine_pid: None },
            GpuStepOut { end_ns: 5, gpu_end_ns: 6, start_ns: 2, gpu_ms: 0.25, tokens: Some(512), kernels: 40, graph_kernels: 3, pids: vec![1, 2], engine_pid: Some(7) },
        ] {
            assert_eq!(written(|b| g.write(b, 0)), serde_json::to_string_pretty(&g).unwrap());
        }
        for source in [ComputeSource::Cupti, ComputeSource::Oncpu] {
            let s = StepComputeOut { end_ns: 9, compute_ms: 1e-9, source };
            assert_eq!(written(|b| s.write(b, 0)), serde_json::to_string_pretty(&s).unwrap());
            assert_eq!(serde_json::to_value(source).unwrap(), compute_source_name(source));
        }
        for s in [ChainSource::Traceparent, ChainSource::Header, ChainSource::Connection] {
            assert_eq!(serde_json::to_value(s).unwrap(), chain_source_name(s));
        }
    }

    fn view<'a>(q: &'a RequestRef) -> ReqView<'a> {
        ReqView {
            id: q.id,
            status: q.status,
            arrive_ns: q.arrive_ns,
            done_ns: q.done_ns,
            ttft_ms: q.ttft_ms,
            e2e_ms: q.e2e_ms,
            itl_ms: q.itl_ms,
            prompt_tokens: q.prompt_tokens,
            completion_tokens: q.completion_tokens,
            cached_tokens: q.cached_tokens,
            peak_gpu_mem_bytes: q.peak_gpu_mem_bytes,
            model: q.model,
            closed: q.closed_ns.is_some(),
            structured_output: q.structured_output,
            scheduler_queue_ms: q.scheduler_queue_ms,
            passed_over_ms: summary::skipped_ms(q.scheduler_passed_over_by, q.scheduler_passed_over_ms),
            after_grammar_ms: summary::after_grammar_ms(q.scheduler_queue_ms, q.scheduler_grammar_ready_ms),
            tokens_before_first_content: q.tokens_before_first_content,
            first_output_held_ms: q.first_output_held_ms,
            empty_chunks_before_content: q.empty_chunks_before_content,
        }
    }

    /// More models than the summary names apart.
    const MODEL_NAMES: [&str; 20] = ["m0", "m1", "m2", "m3", "m4", "m5", "m6", "m7", "m8", "m9", "m10", "m11", "m12", "m13", "m14", "m15", "m16", "m17", "m18", "m19"];

    /// `n` requests: every seventh failed, every fifth without token counts,
    /// every fourth naming no model, the others one of 20.
    fn requests(n: usize, itls: &[Vec<f64>]) -> Vec<RequestRef<'_>> {
        (0..n)
            .map(|i| {
                let arrive_ns = 1_000_000 * i as u64;
                let e2e = 50.0 + (i % 97) as f64 * 1.5;
                // Every eleventh: its client left (no end, a close).
                let closed = i % 11 == 5;
                RequestRef {
                    status: Some(if i % 7 == 3 { 500 } else { 200 }),
                    arrive_ns,
                    done_ns: (!closed).then_some(arrive_ns + (e2e * 1e6) as u64),
                    ttft_ms: Some(10.0 + (i % 13) as f64),
                    e2e_ms: (!closed).then_some(e2e),
                    closed_ns: closed.then_some(arrive_ns + 1),
                    closed_ms: closed.then_some(1e-6),
                    prompt_tokens: (i % 5 != 0).then_some(100 + i as u64 % 50),
                    completion_tokens: (i % 5 != 0).then_some(1 + i as u64 % 20),
                    peak_gpu_mem_bytes: Some(i as u64 % 1000),
                    model: (i % 4 != 0).then_some(MODEL_NAMES[(i / 4) % 20]),
                    // Every sixth asked for structured output (a kind of eight, one unknown).
                    structured_output: (i % 6 == 1).then_some(["json", "json_object", "regex", "choice", "grammar", "structural_tag", "other", "json"][(i / 6) % 8]),
                    scheduler_queue_ms: (i % 9 != 0).then_some(0.01 * (i % 31) as f64),
                    // Most with a token count by the first content, some held.
                    tokens_before_first_content: (i % 8 != 0).then_some(1 + i as u64 % 6),
                    first_output_held_ms: (i % 8 != 0).then_some(0.37 * (i % 6) as f64),
                    empty_chunks_before_content: (i % 3 != 0).then_some((i % 4) as u32),
                    ..edge_request(&itls[i % itls.len()], &[])
                }
            })
            .collect()
    }

    #[test]
    fn total_keys_order_as_total_cmp_and_give_the_same_floats_back() {
        let xs = [f64::NEG_INFINITY, -1e300, -2.5, -f64::MIN_POSITIVE, -0.0, 0.0, 5e-324, 1.0, 12.759, 1e12, f64::INFINITY, f64::NAN, -f64::NAN];
        for a in xs {
            assert_eq!(from_total_key(total_key(a)).to_bits(), a.to_bits(), "{a}");
            for b in xs {
                assert_eq!(total_key(a).cmp(&total_key(b)), a.total_cmp(&b), "{a} vs {b}");
            }
        }
    }

    #[test]
    fn summary_accumulator_is_compute_views_to_the_bit_with_its_itls_in_memory_or_spilled_in_runs() {
        // ITLs with repeats across requests, zeros, and huge values: the
        // runs' merge must give the sorted order the sums are taken in.
        let itls: Vec<Vec<f64>> = (0..11).map(|k| (0..k).map(|j| if j == 3 { 0.0 } else { 5.0 + (k * j) as f64 * 0.37 + if k == 7 { 1e12 } else { 0.0 } }).collect()).collect();
        let p = [50.0, 90.0, 99.0, 99.9, 0.0, 100.0];
        for (n, run) in [(0, ITL_RUN), (1, ITL_RUN), (3000, ITL_RUN), (3, 1), (3000, 1), (3000, 7), (20_000, 1000)] {
            let qs = requests(n, &itls);
            let mut acc = SummaryAcc { itls: ItlPool { run, ..ItlPool::default() }, ..SummaryAcc::default() };
            qs.iter().for_each(|q| acc.add(q).expect("add"));
            let spilled = acc.itls.runs.len();
            let got = acc.finish(Vec::new(), &p).expect("summary");
            let views: Vec<ReqView> = qs.iter().map(view).collect();
            let want = summary::compute_views(&views, &[], &p);
            assert_eq!(got, want, "{n} requests, runs of {run}");
            assert_eq!(got.closed_early, (0..n).filter(|i| i % 11 == 5).count());
            if n >= 3000 {
                let h = got.first_content_held.as_ref().expect("token counts");
                assert!(h.requests > 0 && h.requests < h.of_requests && h.sent_without_text > 0 && h.held_ms_mean.is_some(), "{h:?}");
                let so = got.structured_output.as_ref().expect("structured requests");
                assert_eq!(so.kinds.iter().map(|k| k.kind).collect::<Vec<_>>(), crate::model::STRUCTURED_KINDS.iter().copied().chain(["other"]).collect::<Vec<_>>());
                assert_eq!(so.kinds.iter().map(|k| k.requests).sum::<usize>(), so.requests);
                assert!(so.scheduler_queue_ms_mean.is_some() && so.others_scheduler_queue_ms_mean.is_some());
            }
            if n >= 3000 {
                // 16 named, `other`, and those that named none.
                assert_eq!(got.models.len(), 18, "{:?}", got.models.iter().map(|m| &m.model).collect::<Vec<_>>());
                assert!(got.models.iter().any(|m| m.model.as_deref() == Some("other")) && got.models.iter().any(|m| m.model.is_none()));
                assert_eq!(got.models.iter().map(|m| m.completed).sum::<usize>(), got.completed);
                assert_eq!(got.models.iter().map(|m| m.e2el_ms.as_ref().map_or(0, |d| d.n)).sum::<usize>(), got.completed);
            }
            let pooled = want.itl_ms.as_ref().map_or(0, |d| d.n);
            // Runs are filled to at most `run` (or one request's ITLs).
            assert_eq!(spilled > 0, pooled > run, "{n} requests, runs of {run}: {spilled} runs of {pooled} ITLs");
        }
    }
}
