//! What a recording holds: validated, payload-free events in time order.
//!
//! The protocol decoders (`proto`) turn kernel I/O into these; the recording
//! stores them; the correlator consumes them. Prompt and completion text never
//! appear here: only ids, sizes, counts and times. The one exception is
//! [`Record::RawIo`], written only under `--capture-payload`.
//!
//! Stable on disk (postcard, see `recording`): add variants and fields only at the
//! end, and bump `recording::FORMAT_VERSION` when doing so.

use crate::event::{ConnKey, ConnOp, Dir, Family, ProcOp, Syscall};
use serde::{Deserialize, Serialize};

/// A header name/value kept from an HTTP head. Only an allow-list of headers is
/// kept (ids, chain keys, framing); never cookies or authorization.
pub type Header = (String, String);

/// Role of the traced process on a connection, as inferred from who sent the
/// first HTTP request line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum HttpRole {
    /// The traced process received the request (it is the server).
    Server,
    /// The traced process sent the request (it is a client of someone else).
    Client,
}

/// What one SSE `data:` event was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SseKind {
    /// Chat role chunk: delta with a role and empty/absent content.
    Role,
    /// Carries generated content (text, tool-call arguments, or a finish_reason
    /// on an otherwise empty delta counts as `Finish`, not content).
    Content,
    /// A choice's last chunk with `finish_reason` and no new content.
    Finish,
    /// `choices: []` with `usage`.
    Usage,
    /// `data: [DONE]`.
    Done,
    /// A JSON object with an `error` member.
    Error,
    /// Parsed but none of the above (comments, unknown JSON, truncated JSON).
    Other,
}

/// Token counts from an OpenAI `usage` object.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
}

/// One event of the recording.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Record {
    /// accept/connect on a traced socket.
    ConnOpen {
        ts_ns: u64,
        conn: ConnKey,
        op: ConnOp,
        family: Family,
        local: Option<String>,
        peer: Option<String>,
    },
    ConnClose {
        ts_ns: u64,
        conn: ConnKey,
    },
    /// A complete HTTP request head (and body accounted) on a connection.
    HttpRequest {
        conn: ConnKey,
        role: HttpRole,
        /// 0-based index of this request on its connection (keep-alive order).
        seq: u32,
        /// Exit time of the read that returned the request's first byte.
        start_ns: u64,
        /// Exit time of the read that completed the request (head + body).
        end_ns: u64,
        tid: u32,
        method: String,
        path: String,
        /// Allow-listed headers, names lower-cased.
        headers: Vec<Header>,
        /// Body bytes (Content-Length, or the de-chunked total).
        body_len: u64,
        /// From a JSON body when captured: `"stream": true/false`.
        stream: Option<bool>,
        /// From a JSON body when captured: `"model"`.
        model: Option<String>,
        /// When the request's first byte became readable on the socket
        /// (kernel sk_data_ready): the wire arrival. `start_ns - ready_ns` is
        /// how long the server left it unread. None when not seen.
        ready_ns: Option<u64>,
    },
    /// Response status line + headers written.
    HttpResponse {
        conn: ConnKey,
        role: HttpRole,
        seq: u32,
        /// When the write that carried the head's last byte sent it: its
        /// wire departure, else its exit (as every record of a write).
        ts_ns: u64,
        tid: u32,
        status: u16,
        headers: Vec<Header>,
    },
    /// One SSE event of a streamed response, timed by the write carrying its last byte.
    Sse {
        conn: ConnKey,
        seq: u32,
        ts_ns: u64,
        kind: SseKind,
        /// `id` of the JSON chunk (`chatcmpl-…`, `cmpl-…`).
        id: Option<String>,
        /// Bytes of generated text in this chunk (never the text itself).
        content_bytes: u32,
        finish_reason: Option<String>,
        usage: Option<Usage>,
    },
    /// Metadata read from a non-streaming JSON response body (id, usage).
    ResponseBody {
        conn: ConnKey,
        seq: u32,
        ts_ns: u64,
        id: Option<String>,
        usage: Option<Usage>,
        finish_reason: Option<String>,
    },
    /// The response's last byte was written (chunked terminator, Content-Length
    /// reached, or connection closed for close-delimited bodies).
    HttpResponseEnd {
        conn: ConnKey,
        seq: u32,
        ts_ns: u64,
        body_len: u64,
    },
    /// Bytes on a connection the decoders could not interpret (desync, HTTP/2,
    /// garbage, gaps inside a head). Counted in `unparsed_bytes` too.
    Unparsed {
        conn: ConnKey,
        ts_ns: u64,
        dir: Dir,
        bytes: u64,
        reason: String,
    },
    /// Data on a unix-domain socket (IPC), without payload. Later decoders (ZMTP)
    /// add richer records.
    UnixIo {
        conn: ConnKey,
        ts_ns: u64,
        enter_ns: u64,
        tid: u32,
        dir: Dir,
        len: u64,
    },
    Proc {
        ts_ns: u64,
        tgid: u32,
        op: ProcOp,
        child_tgid: u32,
        exit_code: i32,
        comm: String,
    },
    /// An off-CPU interval of a traced thread.
    OffCpu {
        /// Switch-in (the interval's end).
        ts_ns: u64,
        tgid: u32,
        tid: u32,
        /// Switch-out (the interval's start), a timestamp, not a duration.
        off_ns: u64,
        /// The wake-up before the switch-in, when seen (run-queue delay = ts_ns − wake_ns).
        wake_ns: Option<u64>,
        prev_state: u32,
    },
    /// Cumulative loss counters at `ts_ns` (kernel and user side). The last one in
    /// the file is authoritative.
    Drops {
        ts_ns: u64,
        counters: Vec<(String, u64)>,
    },
    /// Raw bytes of one syscall, only with `--capture-payload`.
    RawIo {
        conn: ConnKey,
        ts_ns: u64,
        enter_ns: u64,
        tid: u32,
        syscall: Syscall,
        dir: Dir,
        family: Family,
        len: u64,
        data: Vec<u8>,
    },
    /// vLLM engine IPC: an ADD (`EngineCoreRequest`) on the input socket
    /// (ZMTP over a unix socket, decoded by `proto/vllm.rs`). Timed by the syscall
    /// that carried the message's last byte; `dir` says whether the traced process
    /// sent it (the frontend: Out) or received it (the engine: In) — when both
    /// ends are traced the message appears once per end. Never token ids.
    EngineRequest {
        conn: ConnKey,
        ts_ns: u64,
        tid: u32,
        dir: Dir,
        /// Engine request id (`<external id>-<8 hex>` since vLLM 0.14).
        request_id: String,
        /// `external_req_id` (the `chatcmpl-…` id), when the layout has it.
        external_req_id: Option<String>,
        /// Prompt length, from the prompt-id array *header* (survives truncation).
        prompt_tokens: Option<u64>,
        /// `SamplingParams.max_tokens` when on the wire (absent = vLLM's default).
        max_tokens: Option<u64>,
        /// `arrival_time`: `time.time()` in the API server (wall clock, seconds).
        arrival_time_s: Option<f64>,
        /// `trace_headers["traceparent"]`, when forwarded.
        traceparent: Option<String>,
        data_parallel_rank: Option<u64>,
        /// The capture cut a wanted field (it is `None`): the prompt ids ran past
        /// the bytes captured and the fields after them were not recovered.
        truncated: bool,
    },
    /// vLLM engine IPC: an ABORT on the input socket.
    EngineAbort {
        conn: ConnKey,
        ts_ns: u64,
        tid: u32,
        dir: Dir,
        /// Engine request ids (those fully captured).
        request_ids: Vec<String>,
    },
    /// vLLM engine IPC: one `EngineCoreOutputs` message (one engine step, for
    /// steps that produced outputs) on the output socket.
    EngineOutputs {
        conn: ConnKey,
        ts_ns: u64,
        tid: u32,
        dir: Dir,
        engine_index: Option<u64>,
        /// `EngineCoreOutputs.timestamp`: the engine's `time.monotonic()` when
        /// the step's output was built (CLOCK_MONOTONIC, seconds).
        timestamp_s: Option<f64>,
        /// The outputs fully decoded, in wire order.
        outputs: Vec<EngineOutput>,
        /// Outputs the message declared (`None` if the capture cut the header);
        /// more than `outputs.len()` when the capture cut some.
        outputs_total: Option<u64>,
        /// `finished_requests` (ids), when present.
        finished_requests: Vec<String>,
        /// The capture cut the message: later outputs and fields are missing.
        truncated: bool,
    },
    // ---- GPU (CUPTI injection, `source::cupti`). Every `pid` is the peer's
    // pid as the agent's kernel sees it (SO_PEERCRED, the same namespace as the
    // eBPF tgids); every time is CLOCK_MONOTONIC ns, converted by the sender.
    /// A CUDA process connected its injection library (the wire's hello).
    /// Timed when the agent accepted it.
    GpuProcess {
        ts_ns: u64,
        pid: u32,
        ppid: u32,
        /// The pid the process reported itself (differs from `pid` only across
        /// pid namespaces).
        own_pid: u32,
        comm: String,
        /// `cuptiGetVersion` (12.4=22 … 13.4=130401).
        cupti_version: u32,
        /// 1: CUPTI's timestamp callback (CLOCK_MONOTONIC); 2: calibrated offset.
        clock: u8,
        /// The sender's enabled-kinds bits (hopscope-gpu-wire `enabled`).
        enabled: u32,
        /// CLOCK_MONOTONIC when the injection library initialised.
        init_ns: u64,
        /// Which libcupti the process used.
        cupti_lib: String,
    },
    /// One CUDA device as the process's driver reported it.
    GpuDevice {
        ts_ns: u64,
        pid: u32,
        device: u32,
        name: String,
        cc_major: u32,
        cc_minor: u32,
        sm_count: u32,
        total_mem_bytes: u64,
        /// `cuDriverGetVersion` (e.g. 13000).
        driver_version: u32,
    },
    /// A kernel execution (also each kernel node of a CUDA graph launch).
    GpuKernel {
        /// Start on the GPU.
        ts_ns: u64,
        end_ns: u64,
        pid: u32,
        device: u32,
        context: u32,
        stream: u32,
        /// Equals the launching [`Record::GpuApi`]'s (the graph launch's for graph nodes).
        correlation_id: u32,
        /// Nonzero when the kernel ran as a node of a CUDA graph.
        graph_id: u32,
        graph_node_id: u64,
        /// The (mangled) kernel name; empty when CUPTI gave none.
        name: String,
        grid: [u32; 3],
        block: [u32; 3],
        static_shared_mem: u32,
        dynamic_shared_mem: u32,
        registers_per_thread: u16,
    },
    /// A memory copy (peer-to-peer copies carry `peer`).
    GpuMemcpy {
        ts_ns: u64,
        end_ns: u64,
        pid: u32,
        device: u32,
        context: u32,
        stream: u32,
        /// CUpti_ActivityMemcpyKind, raw (1 HtoD, 2 DtoH, 8 DtoD, 10 PtoP, …).
        kind: u8,
        /// CUpti_ActivityMemoryKind of source and destination, raw (1 pageable, 2 pinned, 3 device, 4 array, 5 managed, …).
        src_kind: u8,
        dst_kind: u8,
        /// CUpti_ActivityFlag bits, raw (bit 0: async).
        flags: u8,
        bytes: u64,
        correlation_id: u32,
        runtime_correlation_id: u32,
        graph_id: u32,
        graph_node_id: u64,
        peer: Option<GpuPeer>,
    },
    GpuMemset {
        ts_ns: u64,
        end_ns: u64,
        pid: u32,
        device: u32,
        context: u32,
        stream: u32,
        bytes: u64,
        value: u32,
        /// CUpti_ActivityMemoryKind, raw.
        memory_kind: u16,
        flags: u16,
        correlation_id: u32,
        graph_id: u32,
        graph_node_id: u64,
    },
    /// A synchronization the host waited on.
    GpuSync {
        ts_ns: u64,
        end_ns: u64,
        pid: u32,
        /// CUpti_ActivitySynchronizationType, raw (1 event sync, 2 stream wait
        /// event, 3 stream sync, 4 context sync).
        sync_type: u32,
        context: u32,
        stream: Option<u32>,
        correlation_id: u32,
        cuda_event: Option<u32>,
    },
    /// A host-side CUDA API call the injection traces (kernel and graph
    /// launches, copies, memsets, host syncs: filtered by the sender).
    GpuApi {
        ts_ns: u64,
        end_ns: u64,
        pid: u32,
        tid: u32,
        /// 1 runtime, 2 driver.
        domain: u8,
        /// 1 kernel launch, 2 graph launch, 3 memcpy, 4 memset, 5 sync.
        class: u8,
        /// CUPTI callback id in `domain`.
        cbid: u32,
        /// The API function's name (`cudaLaunchKernel`, `cuGraphLaunch`, …).
        name: String,
        correlation_id: u32,
        return_value: u32,
    },
    /// The sender's CUPTI-clock→CLOCK_MONOTONIC offset (calibrated clock mode
    /// only; already applied to every timestamp), and how well it is known.
    GpuCalibration {
        ts_ns: u64,
        pid: u32,
        offset_ns: i64,
        error_ns: u64,
    },
    // ---- Added in format version 2.
    /// One NVML sample of one GPU (`source::nvml`), taken every `--nvml-period`.
    /// Fields NVML does not support on a device are `None`.
    GpuSample {
        ts_ns: u64,
        /// NVML device index.
        device: u32,
        /// Device memory in use by all processes, and the device's total.
        mem_used_bytes: u64,
        mem_total_bytes: u64,
        /// Memory used by each traced process on this device: (pid, bytes).
        process_mem: Vec<(u32, u64)>,
        /// SM and memory-controller utilisation over NVML's last sample period, %.
        sm_util_pct: Option<u32>,
        mem_util_pct: Option<u32>,
        /// PCIe throughput, KiB/s (NVML samples it over 20 ms).
        pcie_tx_kib_s: Option<u32>,
        pcie_rx_kib_s: Option<u32>,
        /// NVLink data bytes moved since the previous sample, summed over links,
        /// as a rate in KiB/s.
        nvlink_tx_kib_s: Option<u64>,
        nvlink_rx_kib_s: Option<u64>,
    },
    /// vLLM engine IPC: `EngineCoreOutputs.scheduler_stats` (sent when the
    /// server logs stats, vLLM's default), one per step that carried it.
    EngineStats {
        conn: ConnKey,
        ts_ns: u64,
        engine_index: Option<u64>,
        running: Option<u64>,
        waiting: Option<u64>,
        /// `kv_cache_usage`, 0..1.
        kv_cache_usage: Option<f64>,
        step_counter: Option<u64>,
        /// `prefix_cache_stats`: queries and hits (tokens) since the last stats.
        prefix_cache_queries: Option<u64>,
        prefix_cache_hits: Option<u64>,
    },
    /// A unix-socket write (the [`Record::UnixIo`] at the same `ts_ns`, which
    /// follows it) by a thread whose latest sleep ended with the wake-up at
    /// `wake_ns` and the switch-in at `on_ns`, however short the sleep
    /// ([`Record::OffCpu`] keeps only those of `--min-offcpu` or more). Which
    /// `send()` handed a ZMQ I/O thread the message it wrote. Format 3.
    WokenWrite {
        ts_ns: u64,
        tgid: u32,
        tid: u32,
        wake_ns: u64,
        on_ns: u64,
    },
    /// vLLM engine IPC: the ADD of the [`Record::EngineRequest`] that follows
    /// (same `conn`, `ts_ns`, `dir` and `request_id`) began in an earlier
    /// syscall, which returned at `first_ns`: libzmq writes a message longer
    /// than its 8 KiB batch in several. Its hand-over is that first write's
    /// wake-up. Only for ADDs that spanned syscalls. Format 4.
    EngineRequestStart {
        conn: ConnKey,
        ts_ns: u64,
        tid: u32,
        dir: Dir,
        request_id: String,
        first_ns: u64,
    },
    /// The `model` a response named (its first SSE chunk's, or a JSON body's),
    /// once per response, before the [`Record::Sse`] or
    /// [`Record::ResponseBody`] that carried it. A request whose body lost its
    /// own `model` to the capture takes this one. Format 5.
    ResponseModel {
        conn: ConnKey,
        seq: u32,
        ts_ns: u64,
        model: String,
    },
    /// The request `seq` on `conn` (the [`Record::HttpRequest`] just before,
    /// same `ts_ns`) continues the Responses API response
    /// `previous_response_id`: an agent's next turn sent with the id of its
    /// last instead of the whole conversation. Its chain is that
    /// response's. Format 6.
    RequestLink {
        conn: ConnKey,
        seq: u32,
        ts_ns: u64,
        previous_response_id: String,
    },
    /// The engine request `request_id` (the [`Record::EngineRequest`] just
    /// before, same `conn` and `ts_ns`) asked for structured output: its
    /// sampling params hold a constraint of this `kind` (`json`, `regex`,
    /// `choice`, `grammar`, `json_object`, `structural_tag`, or `other`),
    /// compiled by `backend` when the frontend named one. Never the schema,
    /// pattern or choices themselves. Format 7.
    EngineStructuredOutput {
        conn: ConnKey,
        ts_ns: u64,
        dir: Dir,
        request_id: String,
        kind: String,
        backend: Option<String>,
    },
    /// The engine request `request_id` (the [`Record::EngineRequest`] just
    /// before, same `conn` and `ts_ns`) has a `priority` other than the
    /// default 0: under `--scheduling-policy priority` vLLM's scheduler takes
    /// lower values first. Format 8.
    EnginePriority {
        conn: ConnKey,
        ts_ns: u64,
        dir: Dir,
        request_id: String,
        priority: i64,
    },
    /// The engine request `request_id` (after its [`Record::EngineStructuredOutput`],
    /// same `conn` and `ts_ns`) asked for a constraint whose bytes, whole in
    /// the capture, hash to `key` under a key the recorder drew at its start
    /// and never stored: two requests of one recording asking for the same
    /// schema (pattern, choices, grammar, backend) have the same `key`, which
    /// tells nothing of the schema to anyone else. Format 9.
    EngineConstraintKey {
        conn: ConnKey,
        ts_ns: u64,
        dir: Dir,
        request_id: String,
        key: u64,
    },
    /// One GPU as the host's NVIDIA driver (NVML, `--nvml-period`) describes
    /// it, once at the sampler's start: the model and driver of a recording
    /// with no injected process too. Format 10.
    NvmlDevice {
        ts_ns: u64,
        /// NVML device index (the host's order, not CUDA's).
        device: u32,
        name: String,
        /// `nvmlSystemGetDriverVersion`, e.g. "580.159.04".
        driver: String,
        mem_total_bytes: u64,
    },
}

/// vLLM's `StructuredOutputsParams` fields that name a constraint, in its
/// order (exactly one is set: vLLM refuses others): the kinds
/// [`Record::EngineStructuredOutput`] carries.
pub const STRUCTURED_KINDS: &[&str] = &["json", "regex", "choice", "grammar", "json_object", "structural_tag"];
/// The kind of a constraint none of [`STRUCTURED_KINDS`] names (a newer vLLM's).
pub const STRUCTURED_OTHER: &str = "other";

/// The peer side of a peer-to-peer copy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuPeer {
    pub src_device: u32,
    pub src_context: u32,
    pub dst_device: u32,
    pub dst_context: u32,
}

/// vLLM `EngineCoreEvent`: `kind` QUEUED=1, SCHEDULED=2, PREEMPTED=3.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineEvent {
    pub kind: u8,
    /// Engine `time.monotonic()` (CLOCK_MONOTONIC, seconds).
    pub timestamp_s: f64,
}

/// vLLM prefill statistics of a request (sent on its first output). Older
/// layouts carried only `num_cached_tokens` (and, briefly,
/// `num_external_computed_tokens`, reported as `external_cached_tokens`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillStats {
    pub prompt_tokens: Option<u64>,
    pub computed_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub local_cached_tokens: Option<u64>,
    pub external_cached_tokens: Option<u64>,
}

/// One vLLM `EngineCoreOutput`: a request that got tokens (or finished) in a step.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineOutput {
    pub request_id: String,
    /// Number of new token ids (the ids themselves are never kept).
    pub new_tokens: u64,
    /// vLLM FinishReason: STOP=0, LENGTH=1, ABORT=2, ERROR=3, REPETITION=4;
    /// `None` = not finished.
    pub finish_reason: Option<u8>,
    pub events: Vec<EngineEvent>,
    pub prefill: Option<PrefillStats>,
}

#[cfg(test)]
impl Record {
    /// An NVML sample of `device` holding the traced processes' memory (and
    /// their sum as the device's), nothing else sampled: for tests.
    pub(crate) fn test_gpu_sample(ts_ns: u64, device: u32, process_mem: Vec<(u32, u64)>) -> Record {
        Record::GpuSample {
            ts_ns,
            device,
            mem_used_bytes: process_mem.iter().map(|(_, b)| b).sum(),
            mem_total_bytes: 80 << 30,
            process_mem,
            sm_util_pct: None,
            mem_util_pct: None,
            pcie_tx_kib_s: None,
            pcie_rx_kib_s: None,
            nvlink_tx_kib_s: None,
            nvlink_rx_kib_s: None,
        }
    }
}

impl Record {
    /// Time the event happened (what the recording orders by).
    pub fn ts_ns(&self) -> u64 {
        match self {
            Record::ConnOpen { ts_ns, .. }
            | Record::ConnClose { ts_ns, .. }
            | Record::HttpResponse { ts_ns, .. }
            | Record::Sse { ts_ns, .. }
            | Record::ResponseBody { ts_ns, .. }
            | Record::HttpResponseEnd { ts_ns, .. }
            | Record::Unparsed { ts_ns, .. }
            | Record::UnixIo { ts_ns, .. }
            | Record::Proc { ts_ns, .. }
            | Record::OffCpu { ts_ns, .. }
            | Record::Drops { ts_ns, .. }
            | Record::RawIo { ts_ns, .. }
            | Record::EngineRequest { ts_ns, .. }
            | Record::EngineAbort { ts_ns, .. }
            | Record::EngineOutputs { ts_ns, .. }
            | Record::GpuProcess { ts_ns, .. }
            | Record::GpuDevice { ts_ns, .. }
            | Record::GpuKernel { ts_ns, .. }
            | Record::GpuMemcpy { ts_ns, .. }
            | Record::GpuMemset { ts_ns, .. }
            | Record::GpuSync { ts_ns, .. }
            | Record::GpuApi { ts_ns, .. }
            | Record::GpuCalibration { ts_ns, .. }
            | Record::GpuSample { ts_ns, .. }
            | Record::EngineStats { ts_ns, .. }
            | Record::WokenWrite { ts_ns, .. }
            | Record::ResponseModel { ts_ns, .. }
            | Record::RequestLink { ts_ns, .. }
            | Record::EngineStructuredOutput { ts_ns, .. }
            | Record::EnginePriority { ts_ns, .. }
            | Record::EngineConstraintKey { ts_ns, .. }
            | Record::NvmlDevice { ts_ns, .. }
            | Record::EngineRequestStart { ts_ns, .. } => *ts_ns,
            Record::HttpRequest { end_ns, .. } => *end_ns,
        }
    }
}
