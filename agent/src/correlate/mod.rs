//! The correlator: a pure state machine from recorded events to requests and
//! chains. No I/O, no clock, no globals: time comes from the records, which are
//! fed in timestamp order with [`Correlator::ingest`]. The same records always
//! give the same [`Analysis`].

pub mod engine;
pub mod gpu;
pub mod join;
pub mod oncpu;
pub mod slab;
pub mod wire_steps;

pub use engine::Step;

use crate::event::ConnKey;
use crate::model::{HttpRole, Record, SseKind, Usage};
use std::collections::{BTreeMap, BTreeSet, HashMap};

/// A request's name where many requests list it (whose prefill interfered
/// with their decode): one allocation, shared by every list.
pub type Name = std::sync::Arc<str>;

/// Adds `name` (of hash `h`, [`engine::name_hash`]) to an interference list
/// and its hashes unless it is there: the engine side's lists and the
/// wire-cluster fallback's are kept alike. `seen` has bit `h >> 58` set for
/// every hash in the list (0 for an empty one): a name whose bit is clear
/// is not there, and the list is not searched (most names are new to it).
#[inline(always)]
pub(crate) fn add_interferer(seen: &mut u64, hashes: &mut Vec<u64>, names: &mut Vec<Name>, h: u64, name: &Name) {
    let bit = 1u64 << (h >> 58);
    if *seen & bit != 0 {
        // The hashes alone first: names are compared only where one matches.
        let mut from = 0;
        while let Some(i) = hashes[from..].iter().position(|&wh| wh == h) {
            if names[from + i] == *name {
                return;
            }
            from += i + 1;
        }
    }
    *seen |= bit;
    if names.capacity() == 0 {
        first_interferer(hashes, names);
    }
    hashes.push(h);
    names.push(name.clone());
}

/// A decode is usually slowed by several prefills: one allocation for the
/// first 16 (out of line: [`add_interferer`] is inlined where it is called
/// per decoding member and newcomer).
#[inline(never)]
fn first_interferer(hashes: &mut Vec<u64>, names: &mut Vec<Name>) {
    hashes.reserve(16);
    names.reserve(16);
}

/// How requests are grouped into chains.
#[derive(Debug, Clone)]
pub struct Config {
    /// Header naming the chain when no `traceparent` is present (lower case).
    pub chain_header: String,
    /// Use the engine IPC records. Off: attribute from the wire alone, as for a
    /// server whose IPC hopscope cannot decode (and to measure that fallback).
    pub use_ipc: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config { chain_header: "x-session-id".into(), use_ipc: true }
    }
}

/// Where a request's chain key came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ChainSource {
    Traceparent,
    Header,
    Connection,
}

/// One HTTP request served by a traced process, with everything the wire told.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub conn: ConnKey,
    pub seq: u32,
    pub id: String,
    pub x_request_id: Option<String>,
    pub traceparent: Option<String>,
    pub chain: String,
    pub chain_source: ChainSource,
    pub hop: u32,
    pub method: String,
    pub path: String,
    /// The request body's `model` (read from its ends when it was longer
    /// than the capture), when it was JSON.
    pub model: Option<String>,
    pub status: Option<u16>,
    pub arrive_ns: u64,
    /// When the first byte became readable in the server's socket (before the
    /// server got around to reading it), if the kernel saw it.
    pub wire_arrive_ns: Option<u64>,
    pub request_end_ns: u64,
    pub response_head_ns: Option<u64>,
    /// Write carrying the last byte of the first content chunk.
    pub ttft_ns: Option<u64>,
    /// The end of the response as the client sees it: the write carrying the
    /// `data: [DONE]` event of a stream (design.md §3: "the final chunk /
    /// [DONE]"), else the write carrying the response's last byte.
    pub done_ns: Option<u64>,
    /// The write carrying the response's last byte (chunked terminator,
    /// Content-Length reached, or close).
    pub response_end_ns: Option<u64>,
    /// The server closed the connection before the response ended: the
    /// client gave up (a timeout, a cancelled agent step) and the server
    /// closed its end, or the server dropped it. The phases then partition
    /// the time to the close.
    pub closed_ns: Option<u64>,
    /// Timestamps of every content chunk, in order.
    pub content_ns: Vec<u64>,
    /// SSE events before the first content that carried no text, were no
    /// role, usage, finish or end: what a chat or completions stream sends
    /// for an output whose text the server holds back (vLLM's
    /// `"content": ""` / `"text": ""`).
    pub empty_chunks_before_content: u32,
    pub request_bytes: u64,
    pub response_bytes: Option<u64>,
    pub streamed: bool,
    pub usage: Usage,
    pub finish_reason: Option<String>,
    /// What the engine IPC said about this request, when it was decoded.
    pub engine: Option<engine::EnginePhases>,
    /// Steps and interference from clusters of SSE writes, when the IPC did
    /// not explain this request.
    pub wire_steps: Option<wire_steps::WireSteps>,
    /// GPU time by phase and KV copies on its path (`correlate::gpu`), when
    /// the IPC explained it and a GPU source recorded.
    pub gpu: Option<gpu::GpuShare>,
    /// Compute of the engine steps that carried it, and where it came from
    /// (the GPU steps, else the engine thread's on-CPU time).
    pub compute: Option<gpu::RequestCompute>,
    /// Its share of the GPU kernels' time by name, most first (at most
    /// [`gpu::KERNELS_PER_REQUEST`]), when a GPU source recorded.
    pub kernels: Option<Vec<gpu::KernelShare>>,
    /// The Responses API response this request continues (its body's
    /// `previous_response_id`): the chain is that response's when no
    /// `traceparent` or chain header names one.
    pub previous_response_id: Option<String>,
    /// `id` is the one the server wrote in the response (first SSE chunk or
    /// JSON body), not one made up from the request or its connection.
    pub id_from_response: bool,
}

impl Request {
    /// [`Request::empty_chunks_before_content`] where it means outputs: a
    /// streamed chat or completions response (other APIs send events
    /// without text before it that are not outputs).
    pub fn empty_chunks(&self) -> Option<u32> {
        let path = self.path.split('?').next().unwrap_or("");
        (self.streamed && path.ends_with("/completions")).then_some(self.empty_chunks_before_content)
    }

    pub fn ttft_ms(&self) -> Option<f64> {
        self.ttft_ns.map(|t| ms(t.saturating_sub(self.arrive_ns)))
    }
    pub fn e2e_ms(&self) -> Option<f64> {
        self.done_ns.map(|t| ms(t.saturating_sub(self.arrive_ns)))
    }
    /// The close of a request whose response never ended (a close after a
    /// `[DONE]` whose response's last bytes were not written yet is not).
    pub fn closed_early_ns(&self) -> Option<u64> {
        self.closed_ns.filter(|_| self.done_ns.is_none())
    }
    /// Arrival to the close of a request whose response never ended.
    pub fn closed_ms(&self) -> Option<f64> {
        self.closed_early_ns().map(|t| ms(t.saturating_sub(self.arrive_ns)))
    }
    /// The end of what the client waited for: the response's end, else the
    /// connection's close (the phases partition the time up to it).
    pub fn waited_until_ns(&self) -> Option<u64> {
        self.done_ns.or(self.closed_ns)
    }
    /// How long the request sat readable in the socket before the server read it.
    pub fn read_delay_ms(&self) -> Option<f64> {
        self.wire_arrive_ns.map(|w| ms(self.arrive_ns - w))
    }
    /// TTFT from the wire arrival: what a client next to the server sees.
    pub fn wire_ttft_ms(&self) -> Option<f64> {
        Some(ms(self.ttft_ns?.saturating_sub(self.wire_arrive_ns?)))
    }
    pub fn wire_e2e_ms(&self) -> Option<f64> {
        Some(ms(self.done_ns?.saturating_sub(self.wire_arrive_ns?)))
    }
    /// Gaps between consecutive content chunks: n chunks give n-1 gaps.
    pub fn itl_ms(&self) -> Vec<f64> {
        self.content_ns.windows(2).map(|w| ms(w[1].saturating_sub(w[0]))).collect()
    }
    /// Decode as the wire sees it: first content chunk to end of response
    /// (or to the close that cut it short).
    pub fn decode_ms(&self) -> Option<f64> {
        match (self.ttft_ns, self.waited_until_ns()) {
            (Some(t), Some(d)) if d >= t => Some(ms(d - t)),
            _ => None,
        }
    }
}

/// A chain of hops (requests sharing a chain key), in arrival order.
#[derive(Debug, Clone, PartialEq)]
pub struct Chain {
    pub chain: String,
    pub source: ChainSource,
    /// Indexes into [`Analysis::requests`].
    pub hops: Vec<usize>,
}

/// The correlator's result.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Analysis {
    pub requests: Vec<Request>,
    pub chains: Vec<Chain>,
    /// Loss counters: the recording's last kernel/decoder snapshot plus the
    /// correlator's own.
    pub drops: BTreeMap<String, u64>,
    pub first_ns: Option<u64>,
    pub last_ns: Option<u64>,
    /// Engine steps that produced outputs, in order (from the IPC).
    pub steps: Vec<engine::Step>,
    /// GPU kernels by name over the whole recording, most GPU time first.
    pub kernels: Vec<KernelStat>,
    /// The GPUs the injected processes reported, by device and model.
    pub gpus: Vec<GpuInfo>,
    /// The GPUs the host's driver (NVML) reported, by NVML index.
    pub nvml_gpus: Vec<NvmlGpu>,
    /// How the injected processes traced (their hellos), processes alike together.
    pub cupti: Vec<CuptiSetup>,
    /// Engine steps found in the CUPTI records (`correlate::gpu`), in order.
    pub gpu_steps: Vec<gpu::GpuStep>,
    /// Compute of each engine output step that has a figure, and its source.
    pub step_compute: Vec<gpu::StepCompute>,
}

/// How injected processes traced their GPU work, as their hellos said:
/// processes with the same CUPTI, clock, graph tracing, kinds and library
/// share one entry. A diff of two recordings compares kernels inside CUDA
/// graphs only when both traced graphs the same way.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CuptiSetup {
    /// `cuptiGetVersion` (12.4 = 22 … 13.0.1 = 130001).
    pub cupti_version: u32,
    /// How CUPTI's timestamps became CLOCK_MONOTONIC: "callback" (CUPTI asked
    /// ours) or "calibrated" (its own clock shifted by a measured offset).
    pub clock: String,
    /// "node": each kernel a CUDA graph ran is a record; "launch": each graph
    /// launch is one (`[CUDA graph N]`), its kernels unseen.
    pub graphs: &'static str,
    /// The record kinds the library had CUPTI enable (what CUPTI refused is
    /// missing, and the figures built on it with it).
    pub traced: Vec<&'static str>,
    pub cupti_lib: String,
    pub pids: Vec<u32>,
}

impl CuptiSetup {
    fn of(cupti_version: u32, clock: u8, enabled: u32, cupti_lib: &str) -> CuptiSetup {
        use hopscope_gpu_wire::enabled as e;
        const KINDS: [(u32, &str); 8] = [
            (e::KERNEL, "kernel"),
            (e::MEMCPY, "memcpy"),
            (e::MEMCPY_PEER, "memcpy_peer"),
            (e::MEMSET, "memset"),
            (e::SYNC, "sync"),
            (e::API_RUNTIME, "api_runtime"),
            (e::API_DRIVER, "api_driver"),
            (e::GRAPH_LAUNCH, "graph_launch"),
        ];
        CuptiSetup {
            cupti_version,
            clock: match clock {
                1 => "callback".into(),
                2 => "calibrated".into(),
                c => format!("unknown ({c})"),
            },
            graphs: if enabled & e::GRAPH_LAUNCH != 0 { "launch" } else { "node" },
            traced: KINDS.iter().filter(|(bit, _)| enabled & bit != 0).map(|(_, n)| *n).collect(),
            cupti_lib: cupti_lib.to_owned(),
            pids: Vec::new(),
        }
    }

    fn same_setup(&self, o: &CuptiSetup) -> bool {
        (self.cupti_version, &self.clock, self.graphs, &self.traced, &self.cupti_lib) == (o.cupti_version, &o.clock, o.graphs, &o.traced, &o.cupti_lib)
    }
}

/// One GPU as the host's driver (NVML) described it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct NvmlGpu {
    /// NVML's index (the host's order, not CUDA's).
    pub device: u32,
    pub name: String,
    /// The driver's version, e.g. "580.159.04".
    pub driver: String,
    pub total_mem_bytes: u64,
    /// The highest PCIe and NVLink throughput its samples gave, KiB/s
    /// (`None`: NVML never gave that figure for it; NVLink needs GPM).
    pub pcie_tx_peak_kib_s: Option<u64>,
    pub pcie_rx_peak_kib_s: Option<u64>,
    pub nvlink_tx_peak_kib_s: Option<u64>,
    pub nvlink_rx_peak_kib_s: Option<u64>,
}

/// One GPU as an injected process described it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct GpuInfo {
    pub device: u32,
    pub name: String,
    pub compute_capability: String,
    pub sm_count: u32,
    pub total_mem_bytes: u64,
    /// `cuDriverGetVersion`, e.g. 13000.
    pub driver_version: u32,
    /// Processes that used it.
    pub pids: Vec<u32>,
}

/// Executions of one kernel name (all processes and devices together).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelStat {
    pub name: String,
    pub count: u64,
    /// Sum of end - start.
    pub gpu_ns: u64,
}

/// Nanoseconds to milliseconds.
pub fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

/// Percentile with linear interpolation between closest ranks (numpy's default),
/// as `vllm bench serve` reports them.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (p / 100.0).clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64))
}

/// The trace-id of a W3C `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`), if valid.
pub fn trace_id(traceparent: &str) -> Option<&str> {
    let mut parts = traceparent.trim().split('-');
    let version = parts.next()?;
    let id = parts.next()?;
    let parent = parts.next()?;
    parts.next()?;
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    if !hex(version, 2) || !hex(id, 32) || !hex(parent, 16) || id.bytes().all(|b| b == b'0') {
        return None;
    }
    Some(id)
}

/// How long after the latest record a request's own records can still come
/// (the engine's last outputs after the HTTP response ended, a reader's copy
/// of an IPC message, records reordered by the recording's window). A request
/// is final [`SETTLE_NS`] + [`wire_steps::MAX_CLUSTER_NS`] after its response
/// ended; see [`Correlator::drain_final`].
pub const SETTLE_NS: u64 = 2_000_000_000;

/// A request still open this long after it arrived stops holding back the
/// requests behind it: it is handed out unfinished (counted as
/// `requests_final_while_open`), and what comes for it later is counted as
/// orphaned. This bounds the reorder buffer to the requests that arrive in
/// this time.
pub const MAX_OPEN_NS: u64 = 300_000_000_000;

/// When a reader of a recording hands final requests out: every 4096
/// records or 250 ms of recording time, whichever comes first, at a clock
/// that moves only when two records in a row agree (one corrupt far-future
/// time would otherwise hand every request out early).
#[derive(Debug, Default)]
pub struct DrainClock {
    now: u64,
    n: u64,
    next_drain: u64,
    prev_ts: u64,
}

impl DrainClock {
    /// The next record's time; `Some(now)` when it is time for
    /// [`Correlator::drain_final`] at `now`.
    pub fn tick(&mut self, ts_ns: u64) -> Option<u64> {
        self.now = self.now.max(self.prev_ts.min(ts_ns));
        self.prev_ts = ts_ns;
        self.n += 1;
        if self.n.is_multiple_of(4096) || self.now >= self.next_drain {
            self.next_drain = self.now.saturating_add(250_000_000);
            return Some(self.now);
        }
        None
    }
}

/// A fast hasher for the correlator's and the sinks' maps (SipHash was a
/// tenth of the correlator's time): each 8-byte word is folded in with a
/// 64×64→128-bit multiply whose halves are xored (foldhash's and aHash's
/// fallback mixing), so every input bit reaches every output bit. It was
/// rustc's FxHash, whose multiply carries only upward: ids that differ in
/// their last digits ("chatcmpl-…0012" / "…0021") then differed only in
/// high bits before the tail byte was mixed in, and 4 in 10 of a synthetic
/// 100 000-request recording's ids shared their whole hash with another,
/// each costing the maps a string compare. The seed is fixed, so outputs
/// stay deterministic; keys a client chooses (request ids, chain headers)
/// could still be crafted to collide, which costs time, never correctness.
#[derive(Clone, Copy)]
pub struct FxHasher(u64);

impl Default for FxHasher {
    fn default() -> Self {
        // π's first bits: any fixed value but 0 (a zero state stays zero over zero words).
        FxHasher(0x243f_6a88_85a3_08d3)
    }
}

/// The high and low halves of `a × b`, xored.
#[inline]
fn folded_multiply(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ ((p >> 64) as u64)
}

impl std::hash::Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        // The same words as zero-padded 8-byte chunks, without the call to
        // memcpy a variable-length copy compiles to (ids are hashed per step).
        let mut it = bytes.chunks_exact(8);
        for c in &mut it {
            self.write_u64(u64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
        let rest = it.remainder();
        if !rest.is_empty() {
            self.write_u64(rest.iter().rev().fold(0u64, |v, &b| (v << 8) | u64::from(b)));
        }
    }
    #[inline]
    fn write_u64(&mut self, v: u64) {
        self.0 = folded_multiply(self.0 ^ v, 0x5851_f42d_4c95_7f2d);
    }
    /// As `write(&[v])` (a `str`'s end marker, once per string key): one word.
    #[inline]
    fn write_u8(&mut self, v: u8) {
        self.write_u64(u64::from(v));
    }
    fn write_u32(&mut self, v: u32) {
        self.write_u64(u64::from(v));
    }
    fn write_i32(&mut self, v: i32) {
        self.write_u64(v as u32 as u64);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

/// A map with [`FxHasher`].
pub type FxMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<FxHasher>>;

/// The index of `key`'s entry in a map of a few keys kept as a vector (one
/// per engine: data-parallel ranks), made with a default value when new.
pub fn slot<K: PartialEq, V: Default>(map: &mut Vec<(K, V)>, key: K) -> usize {
    match map.iter().position(|e| e.0 == key) {
        Some(k) => k,
        None => {
            map.push((key, V::default()));
            map.len() - 1
        }
    }
}

/// A request's connection and sequence, as `open` keys it: hashed as one
/// word (one multiply where the fields' own hash takes four; an SSE chunk
/// looks its request up by it).
#[derive(Clone, Copy, PartialEq, Eq)]
struct OpenKey(ConnKey, u32);

impl std::hash::Hash for OpenKey {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        let c = &self.0;
        // Distinct keys may share the word (then they are told apart by
        // compare): it is a hash, not an identity.
        h.write_u64(u64::from(c.tgid) ^ (u64::from(c.fd as u32) << 32) ^ c.ino.rotate_left(17) ^ u64::from(self.1).rotate_left(40));
    }
}

/// Report order: arrival, then connection and sequence, then first seen
/// (a number). Last, where the request is held (never decides the order:
/// the number is unique).
type OrderKey = (u64, ConnKey, u32, u64, slab::SlabKey);

/// A request not yet handed out.
struct Live {
    r: Request,
    /// The wire cluster its content writes last joined
    /// ([`wire_steps::Clusters::write_marked`]).
    cluster: u64,
}

pub struct Correlator {
    cfg: Config,
    /// Requests not yet handed out (in a slab: an SSE chunk finds its
    /// request by connection, then by index), and their report order.
    live: slab::Slab<Live>,
    order: BTreeSet<OrderKey>,
    next: u64,
    open: FxMap<OpenKey, slab::SlabKey>,
    /// The last request handed out: a request arriving before it is late.
    emitted_up_to: Option<OrderKey>,
    /// Per chain key: hops handed out so far, by key source.
    hops: FxMap<String, [u32; 3]>,
    /// For a later turn naming a response as `previous_response_id`.
    responses: ResponseChains,
    wire: wire_steps::Clusters,
    drops: BTreeMap<String, u64>,
    own: BTreeMap<&'static str, u64>,
    engine: engine::EngineSide,
    /// Per thread: last switch-in, the wake-up before it, latest socket I/O.
    woke: FxMap<u32, engine::Woke>,
    /// Per process, the thread that served its latest HTTP request.
    http_threads: FxMap<u32, u32>,
    first_ns: Option<u64>,
    last_ns: Option<u64>,
    gpus: Vec<GpuInfo>,
    nvml_gpus: Vec<NvmlGpu>,
    cupti: Vec<CuptiSetup>,
    /// GPU steps, GPU shares, KV copies and step compute per engine request.
    attribution: gpu::Attribution,
    /// The attribution's keys for an engine record's requests, as the engine
    /// side keeps them ([`engine::EngineSide::attr_hints`]); reused.
    hints: Vec<slab::SlabKey>,
    /// One record per engine step when several API servers get its parts.
    joiner: join::StepJoiner,
    /// Records the joiner released, to ingest in turn; reused.
    released: Vec<Record>,
    /// Set while a released record is ingested.
    bypass_joiner: bool,
}

/// Responses remembered for later turns' `previous_response_id`
/// ([`Correlator::link_response`]): an agent's next turn comes within
/// seconds; 65 536 bounds the memory (~10 MB) of a long recording.
pub const RESPONSE_CHAINS: usize = 1 << 16;

/// Responses API response id → the chain (and its key's source) of the
/// request that made it; the oldest forgotten past [`RESPONSE_CHAINS`]. The
/// correlator's and the live metrics' one map, so both follow a turn's
/// `previous_response_id` to the same chain.
#[derive(Default)]
pub struct ResponseChains {
    chains: FxMap<String, (String, ChainSource)>,
    order: std::collections::VecDeque<String>,
}

impl ResponseChains {
    /// The chain of response `id`, if remembered.
    pub fn get(&self, id: &str) -> Option<&(String, ChainSource)> {
        self.chains.get(id)
    }

    /// Response `id` was made in `chain`: remembered when it is a Responses
    /// API id (`resp_…`) not remembered yet.
    pub fn remember(&mut self, id: &str, chain: &str, source: ChainSource) {
        if !id.starts_with("resp_") || self.chains.contains_key(id) {
            return;
        }
        if self.order.len() >= RESPONSE_CHAINS {
            if let Some(old) = self.order.pop_front() {
                self.chains.remove(&old);
            }
        }
        self.chains.insert(id.to_owned(), (chain.to_owned(), source));
        self.order.push_back(id.to_owned());
    }
}

/// A request's chain key: the `traceparent` trace-id, else the `chain_header`
/// header, else the client connection. One rule for the correlator and the
/// live metrics (whose exemplars name the request's trace). The correlator
/// then gives a Responses API turn keyed by its connection the chain of the
/// response it names as `previous_response_id` ([`Correlator::link_response`]);
/// the live metrics follow the same link (`sink::metrics`).
pub fn chain_key(conn: ConnKey, headers: &[(String, String)], chain_header: &str) -> (String, ChainSource) {
    if let Some(id) = header(headers, "traceparent").and_then(trace_id) {
        return (id.to_ascii_lowercase(), ChainSource::Traceparent);
    }
    if let Some(v) = header(headers, chain_header).filter(|v| !v.is_empty()) {
        return (v.to_owned(), ChainSource::Header);
    }
    (format!("conn:{}:{}:{}", conn.tgid, conn.fd, conn.ino), ChainSource::Connection)
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
}

fn merge_usage(into: &mut Usage, from: &Usage) {
    into.prompt_tokens = from.prompt_tokens.or(into.prompt_tokens);
    into.completion_tokens = from.completion_tokens.or(into.completion_tokens);
    into.cached_tokens = from.cached_tokens.or(into.cached_tokens);
}

impl Correlator {
    pub fn new(cfg: Config) -> Self {
        Correlator {
            cfg,
            live: slab::Slab::default(),
            order: BTreeSet::new(),
            next: 0,
            open: FxMap::default(),
            emitted_up_to: None,
            hops: FxMap::default(),
            responses: ResponseChains::default(),
            wire: wire_steps::Clusters::new(wire_steps::DEFAULT_GAP_NS),
            drops: BTreeMap::new(),
            own: BTreeMap::new(),
            engine: engine::EngineSide::default(),
            woke: FxMap::default(),
            http_threads: FxMap::default(),
            first_ns: None,
            last_ns: None,
            gpus: Vec::new(),
            nvml_gpus: Vec::new(),
            cupti: Vec::new(),
            attribution: gpu::Attribution::new(),
            hints: Vec::new(),
            joiner: join::StepJoiner::default(),
            released: Vec::new(),
            bypass_joiner: false,
        }
    }

    fn count(&mut self, what: &'static str) {
        *self.own.entry(what).or_default() += 1;
    }

    fn request_mut(&mut self, conn: ConnKey, seq: u32) -> Option<&mut Request> {
        match self.open.get(&OpenKey(conn, seq)) {
            Some(&i) => self.live.get_mut(i).map(|l| &mut l.r),
            None => None,
        }
    }

    /// Feeds one record. Records must come in timestamp order (the recording's order).
    pub fn ingest(&mut self, rec: &Record) {
        // Here, not past the joiner: a part merged into its step's first
        // message is never ingested on its own, and the recording's span
        // still covers it.
        let ts = rec.ts_ns();
        if ts > 0 {
            self.first_ns = Some(self.first_ns.map_or(ts, |f| f.min(ts)));
            self.last_ns = Some(self.last_ns.map_or(ts, |l| l.max(ts)));
        }
        // The stats too: which output message carried its step's stats.
        let engine_record = matches!(rec, Record::EngineRequest { .. } | Record::EngineAbort { .. } | Record::EngineOutputs { .. } | Record::EngineStats { .. });
        if self.cfg.use_ipc && !self.bypass_joiner && (engine_record || self.joiner.is_holding()) && self.join(rec) {
            return;
        }
        self.ingest_one(rec);
    }

    /// Offers `rec` to the step joiner and ingests what it released; true
    /// when `rec` itself was held (or merged into a held step).
    #[inline(never)]
    fn join(&mut self, rec: &Record) -> bool {
        if self.joiner.is_holding() {
            self.joiner.due(rec.ts_ns(), &mut self.released);
        }
        let held = self.joiner.offer(rec, &mut self.released) == join::Offer::Held;
        self.ingest_released();
        held
    }

    /// Ingests the messages the joiner still holds (the end of the input, or
    /// input time past their wait).
    fn release_held(&mut self, until_ns: u64) {
        if !self.joiner.is_holding() {
            return;
        }
        if until_ns == u64::MAX {
            self.joiner.drain(&mut self.released);
        } else {
            self.joiner.due(until_ns, &mut self.released);
        }
        self.ingest_released();
    }

    /// The records the joiner released, through [`Self::ingest`] past the
    /// joiner: [`Self::ingest_one`] keeps one caller, inlined there (a call
    /// per record, or a second inlined copy, cost 1–1.3 % of `report`).
    fn ingest_released(&mut self) {
        if self.released.is_empty() {
            return;
        }
        let mut released = std::mem::take(&mut self.released);
        self.bypass_joiner = true;
        for r in released.drain(..) {
            self.ingest(&r);
        }
        self.bypass_joiner = false;
        self.released = released;
    }

    fn ingest_one(&mut self, rec: &Record) {
        let ts = rec.ts_ns();
        if self.cfg.use_ipc && matches!(rec, Record::EngineStructuredOutput { .. } | Record::EnginePriority { .. } | Record::EngineConstraintKey { .. }) {
            self.engine.ingest(rec, &self.woke, &self.http_threads);
            return;
        }
        if self.cfg.use_ipc && matches!(rec, Record::EngineRequest { .. } | Record::EngineAbort { .. } | Record::EngineOutputs { .. }) {
            // The engine side first (the two keep no state in common): it
            // hands the attribution the keys it kept for these requests.
            self.engine.ingest(rec, &self.woke, &self.http_threads);
            let mut hints = std::mem::take(&mut self.hints);
            hints.clear();
            self.engine.attr_hints(&mut hints);
            self.attribution.ingest_hinted(rec, ts, &mut hints);
            self.engine.set_attr_hints(&hints);
            self.hints = hints;
            return;
        }
        self.attribution.tick(rec, ts);
        match rec {
            Record::HttpRequest { conn, role: HttpRole::Server, seq, start_ns, end_ns, tid, method, path, headers, body_len, stream, model, ready_ns } => {
                self.http_threads.insert(conn.tgid, *tid);
                // A readable-since older than the read by more than a minute is a
                // stale kernel entry (socket address reuse), not a wait.
                let wire_arrive_ns = match ready_ns {
                    Some(r) if *r <= *start_ns && start_ns - r <= 60_000_000_000 => Some(*r),
                    Some(_) => {
                        self.count("wire_arrival_implausible");
                        None
                    }
                    None => None,
                };
                let x_request_id = header(headers, "x-request-id").map(str::to_owned);
                let traceparent = header(headers, "traceparent").map(str::to_owned);
                let (chain, chain_source) = self.chain_key(*conn, headers);
                let n = self.next;
                self.next += 1;
                let at = self.live.insert(Live {
                    r: Request {
                    conn: *conn,
                    seq: *seq,
                    id: String::new(),
                    x_request_id,
                    traceparent,
                    chain,
                    chain_source,
                    hop: 0,
                    method: method.clone(),
                    path: path.clone(),
                    model: model.clone(),
                    status: None,
                    arrive_ns: *start_ns,
                    wire_arrive_ns,
                    request_end_ns: *end_ns,
                    response_head_ns: None,
                    ttft_ns: None,
                    done_ns: None,
                    response_end_ns: None,
                    closed_ns: None,
                    content_ns: Vec::with_capacity(16),
                    empty_chunks_before_content: 0,
                    request_bytes: *body_len,
                    response_bytes: None,
                    streamed: stream.unwrap_or(false),
                    usage: Usage::default(),
                    finish_reason: None,
                    engine: None,
                    wire_steps: None,
                    gpu: None,
                    compute: None,
                    kernels: None,
                    previous_response_id: None,
                    id_from_response: false,
                    },
                    cluster: 0,
                });
                let key = (*start_ns, *conn, *seq, n, at);
                if self.emitted_up_to.is_some_and(|e| key < e) {
                    // Requests after it in report order are already out.
                    self.count("requests_late");
                }
                self.order.insert(key);
                if self.open.insert(OpenKey(*conn, *seq), at).is_some() {
                    self.count("requests_duplicated");
                }
            }
            Record::HttpResponse { conn, role: HttpRole::Server, seq, ts_ns, status, headers, .. } => {
                let streamed = header(headers, "content-type").is_some_and(|c| c.starts_with("text/event-stream"));
                match self.request_mut(*conn, *seq) {
                    Some(r) => {
                        r.status = Some(*status);
                        r.response_head_ns = Some(*ts_ns);
                        r.streamed |= streamed;
                    }
                    None => self.count("responses_without_request"),
                }
            }
            Record::Sse { conn, seq, ts_ns, kind, id, finish_reason, usage, .. } => {
                let Some(&at) = self.open.get(&OpenKey(*conn, *seq)) else {
                    self.count("sse_without_request");
                    return;
                };
                let Some(Live { r, cluster }) = self.live.get_mut(at) else {
                    self.count("sse_without_request");
                    return;
                };
                r.streamed = true;
                if r.id.is_empty() {
                    if let Some(id) = id.as_deref().filter(|s| !s.is_empty()) {
                        r.id = id.to_owned();
                    }
                }
                if *kind == SseKind::Done && r.done_ns.is_none() {
                    r.done_ns = Some(*ts_ns);
                }
                if *kind == SseKind::Other && r.ttft_ns.is_none() {
                    r.empty_chunks_before_content = r.empty_chunks_before_content.saturating_add(1);
                }
                let mut first_chunk = None;
                if *kind == SseKind::Content {
                    if r.ttft_ns.is_none() {
                        r.ttft_ns = Some(*ts_ns);
                        if self.cfg.use_ipc {
                            self.engine.first_content(r, *ts_ns);
                        }
                    }
                    r.content_ns.push(*ts_ns);
                    first_chunk = Some(r.content_ns.len() == 1);
                }
                if let Some(u) = usage {
                    merge_usage(&mut r.usage, u);
                }
                if finish_reason.is_some() {
                    r.finish_reason.clone_from(finish_reason);
                }
                if let Some(first) = first_chunk {
                    if let Some(c) = self.wire.write_marked(*ts_ns, at, first, cluster) {
                        self.apply_cluster(c);
                    }
                }
            }
            Record::ResponseBody { conn, seq, id, usage, finish_reason, .. } => {
                let Some(r) = self.request_mut(*conn, *seq) else {
                    self.count("bodies_without_request");
                    return;
                };
                if r.id.is_empty() {
                    if let Some(id) = id.as_deref().filter(|s| !s.is_empty()) {
                        r.id = id.to_owned();
                    }
                }
                if let Some(u) = usage {
                    merge_usage(&mut r.usage, u);
                }
                if finish_reason.is_some() {
                    r.finish_reason.clone_from(finish_reason);
                }
            }
            Record::RequestLink { conn, seq, previous_response_id, .. } => {
                let Some(r) = self.request_mut(*conn, *seq) else {
                    self.count("request_links_without_request");
                    return;
                };
                r.previous_response_id = Some(previous_response_id.clone());
            }
            Record::ResponseModel { conn, seq, model, .. } => {
                let Some(r) = self.request_mut(*conn, *seq) else {
                    self.count("response_models_without_request");
                    return;
                };
                // The request's own `model` wins: a server may answer under
                // another name (an alias resolved, a router's choice).
                let what = match &r.model {
                    None => {
                        r.model = Some(model.clone());
                        "request_model_from_response"
                    }
                    Some(m) if m != model => "response_model_differs",
                    Some(_) => return,
                };
                self.count(what);
            }
            Record::HttpResponseEnd { conn, seq, ts_ns, body_len } => {
                let key = OpenKey(*conn, *seq);
                match self.open.remove(&key).and_then(|at| self.live.get_mut(at)) {
                    Some(Live { r, .. }) => {
                        r.response_end_ns = Some(*ts_ns);
                        r.done_ns = r.done_ns.or(Some(*ts_ns));
                        r.response_bytes = Some(*body_len);
                    }
                    None => self.count("response_ends_without_request"),
                }
            }
            Record::ConnClose { conn, ts_ns } => self.closed(*conn, *ts_ns),
            Record::OffCpu { ts_ns, tid, off_ns, wake_ns, prev_state, .. } => self.woke.entry(*tid).or_default().switched_in(*ts_ns, *off_ns, *wake_ns, *prev_state),
            Record::UnixIo { ts_ns, tid, .. } => self.woke.entry(*tid).or_default().io(*ts_ns),
            Record::WokenWrite { ts_ns, tid, wake_ns, on_ns, .. } => self.woke.entry(*tid).or_default().woken_write(*ts_ns, *wake_ns, *on_ns),
            Record::GpuProcess { pid, cupti_version, clock, enabled, cupti_lib, .. } => {
                let setup = CuptiSetup::of(*cupti_version, *clock, *enabled, cupti_lib);
                let at = match self.cupti.iter().position(|c| c.same_setup(&setup)) {
                    Some(at) => at,
                    None => {
                        self.cupti.push(setup);
                        self.cupti.len() - 1
                    }
                };
                let pids = &mut self.cupti[at].pids;
                if !pids.contains(pid) {
                    pids.push(*pid);
                }
            }
            Record::GpuDevice { pid, device, name, cc_major, cc_minor, sm_count, total_mem_bytes, driver_version, .. } => {
                match self.gpus.iter_mut().find(|g| g.device == *device && g.name == *name) {
                    Some(g) => {
                        if !g.pids.contains(pid) {
                            g.pids.push(*pid);
                        }
                    }
                    None => self.gpus.push(GpuInfo {
                        device: *device,
                        name: name.clone(),
                        compute_capability: format!("{cc_major}.{cc_minor}"),
                        sm_count: *sm_count,
                        total_mem_bytes: *total_mem_bytes,
                        driver_version: *driver_version,
                        pids: vec![*pid],
                    }),
                }
            }
            // One per device at the sampler's start; the first of an index stands.
            Record::NvmlDevice { device, name, driver, mem_total_bytes, .. } if !self.nvml_gpus.iter().any(|g| g.device == *device) => {
                self.nvml_gpus.push(NvmlGpu {
                    device: *device,
                    name: name.clone(),
                    driver: driver.clone(),
                    total_mem_bytes: *mem_total_bytes,
                    pcie_tx_peak_kib_s: None,
                    pcie_rx_peak_kib_s: None,
                    nvlink_tx_peak_kib_s: None,
                    nvlink_rx_peak_kib_s: None,
                });
            }
            Record::GpuSample { device, pcie_tx_kib_s, pcie_rx_kib_s, nvlink_tx_kib_s, nvlink_rx_kib_s, .. } => {
                if let Some(g) = self.nvml_gpus.iter_mut().find(|g| g.device == *device) {
                    let peak = |p: &mut Option<u64>, v: Option<u64>| *p = (*p).max(v);
                    peak(&mut g.pcie_tx_peak_kib_s, pcie_tx_kib_s.map(u64::from));
                    peak(&mut g.pcie_rx_peak_kib_s, pcie_rx_kib_s.map(u64::from));
                    peak(&mut g.nvlink_tx_peak_kib_s, *nvlink_tx_kib_s);
                    peak(&mut g.nvlink_rx_peak_kib_s, *nvlink_rx_kib_s);
                }
            }
            // Which output message carried its step's stats (the readers' join).
            Record::EngineStats { conn, ts_ns, .. } => self.engine.stats_seen(*conn, *ts_ns),
            // Where a written ADD that spanned writes began (its hand-over).
            Record::EngineRequestStart { conn, ts_ns, tid, dir: crate::event::Dir::Out, request_id, first_ns } => self.engine.request_started(*conn, *ts_ns, *tid, request_id, *first_ns),
            Record::Drops { counters, .. } => {
                // Cumulative snapshots: the latest wins.
                for (k, v) in counters {
                    self.drops.insert(k.clone(), *v);
                }
            }
            _ => {}
        }
    }

    /// The server closed `conn`: a request on it whose response had not
    /// ended never will (its response end came first when the close ended
    /// it, see `proto`). It ends at the close, which the client waited for.
    /// Scans the open requests: a close with one open is rare, and so is a
    /// server with thousands in flight.
    #[inline(never)]
    fn closed(&mut self, conn: ConnKey, ts_ns: u64) {
        let mut ended: Vec<(OpenKey, slab::SlabKey)> = Vec::new();
        for (k, &at) in &self.open {
            if k.0 == conn {
                ended.push((*k, at));
            }
        }
        for (k, at) in ended {
            self.open.remove(&k);
            if let Some(Live { r, .. }) = self.live.get_mut(at) {
                r.closed_ns = Some(ts_ns.max(r.arrive_ns).max(r.request_end_ns));
                self.count("requests_closed_unfinished");
            }
        }
    }

    fn chain_key(&self, conn: ConnKey, headers: &[(String, String)]) -> (String, ChainSource) {
        chain_key(conn, headers, &self.cfg.chain_header)
    }

    /// A Responses API turn sent with `previous_response_id` joins the chain
    /// of the response it names, unless a `traceparent` or the chain header
    /// named one: an agent's turns go out on whichever pooled connection is
    /// free, so the connection alone splits its chain (and mixes agents).
    /// The named response was handed out first (it ended before this request
    /// arrived). Then the request's own response is remembered for the next.
    fn link_response(&mut self, r: &mut Request) {
        if let Some(prev) = &r.previous_response_id {
            match self.responses.get(prev.as_str()) {
                Some((chain, source)) if r.chain_source == ChainSource::Connection => {
                    r.chain.clone_from(chain);
                    r.chain_source = *source;
                    self.count("request_links_followed");
                }
                Some(_) => {}
                None => self.count("request_links_unresolved"),
            }
        }
        self.responses.remember(&r.id, &r.chain, r.chain_source);
    }

    /// A closed wire cluster: a step for each member, and the excess charged
    /// to the members already decoding, naming the newcomers.
    fn apply_cluster(&mut self, c: wire_steps::Closed) {
        // Named now (a newcomer may be handed out before those it slowed).
        let slowed = (c.excess_ns > 0)
            .then(|| {
                let names: Vec<(u64, u64, Name)> =
                    c.newcomers.iter().filter_map(|&n| self.live.get(n).map(|l| name_ref(&l.r)).map(|name| (n, engine::name_hash(&name), Name::from(&*name)))).collect();
                (!names.is_empty()).then(|| std::sync::Arc::new(wire_steps::Slowed { names }))
            })
            .flatten();
        for &(n, first) in &c.members {
            let Some(Live { r, .. }) = self.live.get_mut(n) else {
                // Handed out before its last cluster closed: a late record.
                self.count("wire_steps_late");
                continue;
            };
            let w = r.wire_steps.get_or_insert_with(Default::default);
            w.steps += 1;
            if !first && c.excess_ns > 0 {
                w.interference_ns += c.excess_ns;
                if let Some(s) = &slowed {
                    // One allocation for the first 16 (a decode is usually
                    // slowed by several prefills).
                    if w.slowed.capacity() == 0 {
                        w.slowed.reserve(16);
                    }
                    w.slowed.push(s.clone());
                }
            }
        }
        self.wire.recycle(c.members);
    }

    /// Hands out the next request in report order (`key`, which the caller
    /// took out of `order`): names it, joins its engine request, numbers its
    /// hop.
    fn emit(&mut self, key: OrderKey, out: &mut Vec<Request>) {
        let Some(l) = self.live.remove(key.4) else { return };
        // Completed where it lies in `out`: a request is large, and each
        // move of it is a copy.
        out.push(l.r);
        let r = out.last_mut().expect("just pushed");
        if self.open.get(&OpenKey(r.conn, r.seq)) == Some(&key.4) {
            self.open.remove(&OpenKey(r.conn, r.seq));
        }
        let server_named = !r.id.is_empty();
        r.id_from_response = server_named;
        if r.id.is_empty() {
            r.id = name_of(r);
        }
        r.engine = self.engine.claim(r);
        if r.engine.is_none() && !server_named && r.closed_ns.is_some() {
            // Closed before the server wrote its id: the engine request the
            // server aborted for it, found by time (engine::claim_aborted).
            // It takes the id the server gave it (what its logs name), not
            // a connection's, which the next request on a reused fd shares.
            let live = &self.live;
            let named = |keys: &[&str]| live.iter().any(|(_, l)| keys.iter().any(|k| *k == l.r.id || l.r.x_request_id.as_deref() == Some(*k)));
            let mine = r.closed_ns.unwrap_or_default();
            let nearer = |submit: u64, abort: u64| {
                live.iter().any(|(_, l)| {
                    let o = &l.r;
                    o.id.is_empty()
                        && o.method == "POST"
                        && o.closed_early_ns().is_some_and(|c| o.arrive_ns <= submit && submit <= c && abort.abs_diff(c) + engine::ABORT_CLOSE_MARGIN_NS < abort.abs_diff(mine))
                })
            };
            if let Some((e, id)) = self.engine.claim_aborted(r, named, nearer) {
                r.engine = Some(e);
                r.id = id;
            }
        }
        if let Some(e) = &r.engine {
            (r.gpu, r.compute, r.kernels) = self.attribution.take(&e.engine_request_id);
        }
        // Requests the IPC did not explain keep their steps from the wire.
        if r.engine.is_some() || r.wire_steps.as_ref().is_some_and(|w| w.steps == 0) {
            r.wire_steps = None;
        }
        if let Some(w) = &mut r.wire_steps {
            w.resolve(key.4);
        }
        self.link_response(r);
        let hops = match self.hops.get_mut(r.chain.as_str()) {
            Some(h) => h,
            None => self.hops.entry(r.chain.clone()).or_default(),
        };
        let hop = &mut hops[r.chain_source as usize];
        *hop += 1;
        r.hop = *hop;
        self.emitted_up_to = Some(self.emitted_up_to.map_or(key, |e| e.max(key)));
    }

    /// Takes the requests that are final at `now_ns` (the latest record's
    /// time when reading a recording; the clock when live), in report order
    /// (arrival, then connection and sequence).
    ///
    /// Final: every record that can still change the request is past. With
    /// `horizon = now_ns - SETTLE_NS`, a request is final when its response
    /// ended at or before `horizon - MAX_CLUSTER_NS` (its engine outputs, its
    /// engine request's claim and its wire clusters are then settled), and
    /// every request before it in report order was handed out (the reorder
    /// buffer: what arrived since the oldest open request, at most
    /// [`MAX_OPEN_NS`] of arrivals). Records in timestamp order never touch a
    /// request after it is final; ones that do anyway are counted
    /// (`requests_late`, `wire_steps_late`, or as orphans). Handing requests
    /// out at any horizons gives the same requests as [`Correlator::finish`].
    pub fn drain_final(&mut self, now_ns: u64) -> Vec<Request> {
        self.release_held(now_ns);
        let horizon = now_ns.saturating_sub(SETTLE_NS);
        if self.cfg.use_ipc {
            self.engine.settle(horizon);
        }
        if let Some(c) = self.wire.settle(horizon) {
            self.apply_cluster(c);
        }
        let cut = horizon.saturating_sub(wire_steps::MAX_CLUSTER_NS);
        let mut out = Vec::new();
        while let Some(&key) = self.order.first() {
            let Some(Live { r, .. }) = self.live.get(key.4) else {
                self.order.pop_first();
                continue;
            };
            let open = self.open.get(&OpenKey(r.conn, r.seq)) == Some(&key.4);
            // A request displaced by a duplicate of its (connection, seq)
            // never ends: nothing reaches it after its last write.
            let settled = r.response_end_ns.or(r.closed_ns).or_else(|| (!open).then(|| r.content_ns.last().copied().max(r.response_head_ns).unwrap_or(r.request_end_ns)));
            let ended = settled.is_some_and(|e| e <= cut);
            if open && key.0.saturating_add(MAX_OPEN_NS) <= cut {
                self.count("requests_final_while_open");
            } else if open || !ended {
                break;
            }
            self.order.pop_first();
            if out.capacity() == 0 {
                // Most drains hand out tens: not a reallocation (and a copy
                // of every request so far) each time the list doubles.
                out.reserve(64);
            }
            self.emit(key, &mut out);
        }
        let oldest = self.order.first().map(|k| k.0);
        self.engine.forget_unclaimable(horizon, oldest);
        self.attribution.forget_untaken();
        out
    }

    /// Engine steps built since the last call, in output order (all of them
    /// end up in [`Analysis::steps`] when nobody takes them).
    pub fn take_steps(&mut self) -> Vec<Step> {
        self.engine.take_steps()
    }

    /// GPU steps (copies dropped) and output steps' compute decided since
    /// the last call, in order (all of them end up in [`Analysis::gpu_steps`]
    /// and [`Analysis::step_compute`] when nobody takes them): a streamed
    /// report takes them as they come so that they do not grow with the
    /// recording.
    pub fn take_gpu_steps(&mut self) -> (Vec<gpu::GpuStep>, Vec<gpu::StepCompute>) {
        self.attribution.take_steps()
    }

    /// What is held: requests not yet handed out, engine requests not yet
    /// claimed. Both follow the open requests, not the recording's length.
    pub fn held(&self) -> (usize, usize) {
        (self.live.len(), self.engine.open_requests())
    }

    /// The chain keys of the requests not handed out yet (arrived, not final).
    pub fn held_chains(&self) -> impl Iterator<Item = (&str, ChainSource)> + '_ {
        self.live.iter().map(|(_, l)| (l.r.chain.as_str(), l.r.chain_source))
    }

    /// Ends a streamed analysis: the requests not handed out yet (in report
    /// order, open ones unfinished), the steps not taken, the counters and
    /// totals. `chains` stays empty: whoever took the requests as they came
    /// has them.
    pub fn finish_streaming(mut self) -> Analysis {
        self.release_held(u64::MAX);
        if self.joiner.joined > 0 {
            self.own.insert("engine_outputs_joined", self.joiner.joined);
        }
        let unfinished = self.open.len() as u64;
        if unfinished > 0 {
            self.own.insert("requests_unfinished", unfinished);
        }
        if self.cfg.use_ipc {
            self.engine.settle(u64::MAX);
        }
        if let Some(c) = self.wire.close() {
            self.apply_cluster(c);
        }
        self.attribution.finish();
        let keys: Vec<OrderKey> = std::mem::take(&mut self.order).into_iter().collect();
        let mut requests: Vec<Request> = Vec::with_capacity(keys.len());
        for k in keys {
            self.emit(k, &mut requests);
        }
        self.engine.close();
        let steps = self.engine.take_steps();
        self.own.entry("engine_requests_linked").or_default();
        let mut drops = self.drops;
        for (k, v) in std::mem::take(&mut self.engine.counters) {
            *self.own.entry(k).or_default() += v;
        }
        for (k, v) in std::mem::take(&mut self.attribution.counters) {
            *self.own.entry(k).or_default() += v;
        }
        let (gpu_steps, step_compute) = self.attribution.take_steps();
        for (k, v) in self.own {
            drops.insert(k.to_owned(), v);
        }
        Analysis { requests, chains: Vec::new(), drops, first_ns: self.first_ns, last_ns: self.last_ns, steps, kernels: self.attribution.kernel_stats(), gpus: self.gpus, nvml_gpus: self.nvml_gpus, cupti: self.cupti, gpu_steps, step_compute }
    }

    /// Ends the analysis all at once: every request, in report order, with
    /// its chain.
    pub fn finish(self) -> Analysis {
        let mut a = self.finish_streaming();
        a.chains = chains_of(&a.requests);
        a
    }
}

/// The name a request is known by: the id the server gave it, else its
/// `x-request-id`, else its connection and sequence.
fn name_of(r: &Request) -> String {
    name_ref(r).into_owned()
}

/// [`name_of`], borrowed where the request holds it.
fn name_ref(r: &Request) -> std::borrow::Cow<'_, str> {
    if !r.id.is_empty() {
        return r.id.as_str().into();
    }
    match &r.x_request_id {
        Some(x) => x.as_str().into(),
        None => format!("conn:{}:{}:{}", r.conn.tgid, r.conn.fd, r.seq).into(),
    }
}

/// Chains of requests in report order: hops in arrival order, chains by
/// their first hop's arrival, then name.
pub fn chains_of(requests: &[Request]) -> Vec<Chain> {
    let mut by_chain: BTreeMap<(&str, u8), Vec<usize>> = BTreeMap::new();
    for (i, r) in requests.iter().enumerate() {
        by_chain.entry((r.chain.as_str(), r.chain_source as u8)).or_default().push(i);
    }
    let mut chains: Vec<Chain> = by_chain.into_iter().map(|((chain, _), hops)| Chain { chain: chain.to_owned(), source: requests[hops[0]].chain_source, hops }).collect();
    chains.sort_by(|a, b| requests[a.hops[0]].arrive_ns.cmp(&requests[b.hops[0]].arrive_ns).then_with(|| a.chain.cmp(&b.chain)));
    chains
}

/// The analysis of `records`, fed in order to a correlator with the default
/// configuration (the crate's tests).
#[cfg(test)]
pub(crate) fn analyse(records: &[Record]) -> Analysis {
    let mut c = Correlator::new(Config::default());
    for r in records {
        c.ingest(r);
    }
    c.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::HttpRole;

    fn conn(fd: i32) -> ConnKey {
        ConnKey { tgid: 100, fd, ino: 9000 + fd as u64 }
    }

    fn req(c: ConnKey, seq: u32, at: u64, headers: &[(&str, &str)]) -> Record {
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
            ready_ns: at.checked_sub(300_000),
        }
    }

    fn sse(c: ConnKey, seq: u32, at: u64, kind: SseKind, usage: Option<Usage>) -> Record {
        Record::Sse { conn: c, seq, ts_ns: at, kind, id: Some(format!("chatcmpl-{seq}")), content_bytes: 3, finish_reason: None, usage }
    }

    /// One streamed exchange: role, `n` content chunks 2 ms apart, usage, done, end.
    fn exchange(c: ConnKey, seq: u32, at: u64, n: u64, headers: &[(&str, &str)]) -> Vec<Record> {
        let mut v = vec![req(c, seq, at, headers)];
        v.push(Record::HttpResponse {
            conn: c,
            role: HttpRole::Server,
            seq,
            ts_ns: at + 1_000_000,
            tid: 100,
            status: 200,
            headers: vec![("content-type".into(), "text/event-stream; charset=utf-8".into())],
        });
        v.push(sse(c, seq, at + 1_500_000, SseKind::Role, None));
        for k in 0..n {
            v.push(sse(c, seq, at + 5_000_000 + k * 2_000_000, SseKind::Content, None));
        }
        let end = at + 5_000_000 + n * 2_000_000;
        let usage = Usage { prompt_tokens: Some(40), completion_tokens: Some(n), cached_tokens: Some(30) };
        v.push(sse(c, seq, end, SseKind::Usage, Some(usage)));
        v.push(sse(c, seq, end + 100, SseKind::Done, None));
        v.push(Record::HttpResponseEnd { conn: c, seq, ts_ns: end + 200, body_len: 999 });
        v
    }

    /// Ids that differ only in their last digits (every vLLM id does) must
    /// neither collide nor share the low bits hashbrown picks buckets by.
    #[test]
    fn the_hasher_spreads_ids_that_differ_in_their_last_digits() {
        use std::hash::BuildHasher;
        let b = std::hash::BuildHasherDefault::<FxHasher>::default();
        let n = 100_000u64;
        let mut full: Vec<u64> = (0..n).map(|i| b.hash_one(format!("chatcmpl-{i:016}").as_str())).collect();
        let mut buckets = vec![0u32; 1 << 12];
        for h in &full {
            buckets[(h & 0xfff) as usize] += 1;
        }
        full.sort_unstable();
        full.dedup();
        assert_eq!(full.len() as u64, n, "whole-hash collisions");
        // 24.4 per bucket on average; a uniform hash stays well under twice that.
        let max = *buckets.iter().max().unwrap();
        assert!(max < 50, "fullest of 4096 buckets holds {max} of {n} ids");
    }

    /// Random adds (names of a shared hash among them) against a list
    /// searched in full: each name once, in the order first added, whether
    /// or not its bucket bit was set.
    #[test]
    fn interference_lists_hold_each_name_once_in_the_order_first_added() {
        let mut next = crate::testutil::xorshift(0x1357_9bdf_2468_ace0);
        let names: Vec<Name> = (0..300).map(|i| Name::from(format!("chatcmpl-{i}"))).collect();
        // Every fifth name shares one hash: those are told apart by compare.
        let hash = |i: usize| if i.is_multiple_of(5) { 0xdead_beef_0000_0001 } else { engine::name_hash(&names[i]) };
        let mut repeats = 0;
        for round in 0..300u64 {
            let (mut seen, mut hashes, mut list) = (0u64, Vec::new(), Vec::new());
            let mut want: Vec<usize> = Vec::new();
            for _ in 0..next() % 100 {
                let i = (next() % (2 + round).min(300)) as usize;
                add_interferer(&mut seen, &mut hashes, &mut list, hash(i), &names[i]);
                if want.contains(&i) {
                    repeats += 1;
                } else {
                    want.push(i);
                }
            }
            assert_eq!(list, want.iter().map(|&i| names[i].clone()).collect::<Vec<_>>(), "round {round}");
            assert_eq!(hashes, want.iter().map(|&i| hash(i)).collect::<Vec<_>>(), "round {round}");
        }
        assert!(repeats > 1000, "{repeats} names added again");
    }

    /// `write_u8` (a string key's end marker) is a shortcut: the hashes, and
    /// so every map's layout and order, are the ones the byte path gives.
    #[test]
    fn a_byte_hashes_as_the_one_byte_slice_it_is() {
        use std::hash::Hasher;
        for v in 0..=255u8 {
            for seed in [0u64, 7, u64::MAX] {
                let (mut a, mut b) = (FxHasher::default(), FxHasher::default());
                a.write_u64(seed);
                b.write_u64(seed);
                a.write_u8(v);
                b.write(&[v]);
                assert_eq!(a.finish(), b.finish(), "byte {v}, after {seed}");
            }
        }
    }

    #[test]
    fn streamed_request_gets_wire_ttft_itl_e2e_and_usage() {
        let a = analyse(&exchange(conn(5), 0, 1_000_000_000, 4, &[]));
        assert_eq!(a.requests.len(), 1);
        let r = &a.requests[0];
        assert_eq!(r.id, "chatcmpl-0");
        assert_eq!(r.status, Some(200));
        assert_eq!(r.ttft_ms(), Some(5.0));
        assert_eq!(r.itl_ms(), vec![2.0, 2.0, 2.0]);
        assert_eq!(r.e2e_ms(), Some(13.0001), "done is the [DONE] write");
        assert_eq!(r.response_end_ns, Some(1_013_000_200));
        assert_eq!(r.usage.completion_tokens, Some(4));
        assert_eq!(r.usage.cached_tokens, Some(30));
        assert_eq!(r.decode_ms().map(|d| (d * 1e4).round() / 1e4), Some(8.0001));
        assert_eq!(r.read_delay_ms(), Some(0.3));
        assert_eq!(r.wire_ttft_ms(), Some(5.3));
    }

    #[test]
    fn chains_group_by_traceparent_then_header_then_connection_in_arrival_order() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut recs = Vec::new();
        recs.extend(exchange(conn(5), 0, 1_000_000_000, 2, &[("traceparent", tp), ("x-session-id", "ignored")]));
        recs.extend(exchange(conn(6), 0, 2_000_000_000, 2, &[("x-session-id", "s1")]));
        recs.extend(exchange(conn(7), 0, 3_000_000_000, 2, &[("traceparent", tp)]));
        recs.extend(exchange(conn(6), 1, 4_000_000_000, 2, &[("x-session-id", "s1")]));
        recs.extend(exchange(conn(8), 0, 5_000_000_000, 2, &[]));
        let a = analyse(&recs);
        assert_eq!(a.chains.len(), 3);
        assert_eq!(a.chains[0].chain, "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(a.chains[0].source, ChainSource::Traceparent);
        assert_eq!(a.chains[1].chain, "s1");
        assert_eq!(a.chains[2].source, ChainSource::Connection);
        let hops: Vec<(u64, u32)> = a.chains[1].hops.iter().map(|&i| (a.requests[i].arrive_ns, a.requests[i].hop)).collect();
        assert_eq!(hops, vec![(2_000_000_000, 1), (4_000_000_000, 2)]);
    }

    /// A Responses API turn: [`exchange`] answered as `resp_<id>`, sent with
    /// `previous_response_id` when `previous` is given.
    fn turn(c: ConnKey, seq: u32, at: u64, id: &str, previous: Option<&str>, headers: &[(&str, &str)]) -> Vec<Record> {
        let mut v = exchange(c, seq, at, 2, headers);
        for r in &mut v {
            if let Record::Sse { id: Some(i), .. } = r {
                *i = id.to_owned();
            }
        }
        if let Some(p) = previous {
            v.insert(1, Record::RequestLink { conn: c, seq, ts_ns: at + 10_000, previous_response_id: p.to_owned() });
        }
        v
    }

    /// An agent's turns sent with `previous_response_id` over whichever
    /// connection is free form one chain (the first turn's), in order;
    /// a chain header still wins; a link to a response the recording does
    /// not hold falls back to the connection and is counted.
    #[test]
    fn responses_turns_linked_by_previous_response_id_form_one_chain() {
        let mut recs = Vec::new();
        recs.extend(turn(conn(5), 0, 1_000_000_000, "resp_a1", None, &[]));
        recs.extend(turn(conn(6), 0, 2_000_000_000, "resp_b1", None, &[]));
        recs.extend(turn(conn(6), 1, 3_000_000_000, "resp_a2", Some("resp_a1"), &[]));
        recs.extend(turn(conn(7), 0, 4_000_000_000, "resp_a3", Some("resp_a2"), &[]));
        recs.extend(turn(conn(8), 0, 5_000_000_000, "resp_s2", Some("resp_b1"), &[("x-session-id", "s")]));
        recs.extend(turn(conn(9), 0, 6_000_000_000, "resp_x2", Some("resp_gone"), &[]));
        let a = analyse(&recs);
        let by_id = |id: &str| a.requests.iter().find(|r| r.id == id).unwrap_or_else(|| panic!("{id}"));
        let first = by_id("resp_a1");
        assert_eq!((first.chain_source, first.hop), (ChainSource::Connection, 1));
        for (id, hop) in [("resp_a2", 2), ("resp_a3", 3)] {
            let r = by_id(id);
            assert_eq!((r.chain.as_str(), r.chain_source, r.hop), (first.chain.as_str(), ChainSource::Connection, hop), "{id}");
        }
        // resp_b1's connection carried resp_a2 after it: b1's chain has b1 alone.
        let b1 = by_id("resp_b1");
        assert_ne!(b1.chain, first.chain);
        assert_eq!(a.chains.iter().find(|c| c.chain == b1.chain).map(|c| c.hops.len()), Some(1));
        assert_eq!((by_id("resp_s2").chain.as_str(), by_id("resp_s2").chain_source), ("s", ChainSource::Header));
        assert_eq!(by_id("resp_s2").previous_response_id.as_deref(), Some("resp_b1"));
        assert_eq!((by_id("resp_x2").chain.as_str(), by_id("resp_x2").hop), ("conn:100:9:9009", 1));
        for (k, n) in [("request_links_followed", 2), ("request_links_unresolved", 1)] {
            assert_eq!(a.drops.get(k), Some(&n), "{k}: {:?}", a.drops);
        }
    }

    /// A request whose body named no model (or lost it to the capture)
    /// takes the one its response named; one naming its own keeps it.
    #[test]
    fn a_request_without_a_model_takes_its_responses() {
        let named = |c: ConnKey, seq: u32, at: u64, model: &str| Record::ResponseModel { conn: c, seq, ts_ns: at, model: model.into() };
        let mut recs = exchange(conn(5), 0, 1_000_000_000, 2, &[]);
        recs.insert(2, named(conn(5), 0, 1_001_500_000, "served-a"));
        let mut asked = exchange(conn(6), 0, 2_000_000_000, 2, &[]);
        let Record::HttpRequest { model, .. } = &mut asked[0] else { unreachable!() };
        *model = Some("alias".into());
        asked.insert(2, named(conn(6), 0, 2_001_500_000, "served-b"));
        recs.extend(asked);
        recs.push(named(conn(9), 0, 3_000_000_000, "late"));
        let a = analyse(&recs);
        let models: Vec<Option<&str>> = a.requests.iter().map(|r| r.model.as_deref()).collect();
        assert_eq!(models, [Some("served-a"), Some("alias")]);
        for (k, n) in [("request_model_from_response", 1), ("response_model_differs", 1), ("response_models_without_request", 1)] {
            assert_eq!(a.drops.get(k), Some(&n), "{k}: {:?}", a.drops);
        }
    }

    #[test]
    fn invalid_traceparent_falls_back_to_the_chain_header() {
        let a = analyse(&exchange(conn(5), 0, 1, 1, &[("traceparent", "00-zz-xx-01"), ("x-session-id", "abc")]));
        assert_eq!(a.requests[0].chain, "abc");
        assert_eq!(a.requests[0].chain_source, ChainSource::Header);
    }

    #[test]
    fn unfinished_and_orphan_events_are_counted_not_guessed() {
        let mut recs = exchange(conn(5), 0, 1_000, 2, &[]);
        recs.pop(); // no response end
        recs.pop(); // and no [DONE]
        recs.push(sse(conn(9), 3, 99_000_000, SseKind::Content, None));
        let a = analyse(&recs);
        assert_eq!(a.requests[0].done_ns, None);
        assert_eq!(a.requests[0].e2e_ms(), None);
        assert_eq!(a.drops.get("requests_unfinished"), Some(&1));
        assert_eq!(a.drops.get("sse_without_request"), Some(&1));
    }

    #[test]
    fn request_without_sse_id_is_named_by_x_request_id_else_by_connection() {
        let recs = vec![req(conn(5), 0, 10, &[("x-request-id", "abc-123")]), req(conn(6), 2, 20, &[])];
        let a = analyse(&recs);
        assert_eq!(a.requests[0].id, "abc-123");
        assert_eq!(a.requests[1].id, "conn:100:6:2");
    }

    #[test]
    fn percentile_matches_numpy_linear_interpolation() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 50.0), Some(2.5));
        assert!((percentile(&v, 90.0).unwrap() - 3.7).abs() < 1e-12);
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn an_open_request_holds_back_later_ones_until_it_has_been_open_too_long() {
        const S: u64 = 1_000_000_000;
        let mut c = Correlator::new(Config::default());
        c.ingest(&req(conn(5), 0, S, &[]));
        for r in exchange(conn(6), 0, 2 * S, 2, &[]) {
            c.ingest(&r);
        }
        assert!(c.drain_final(60 * S).is_empty(), "the open request comes first in report order");
        assert_eq!(c.held().0, 2);
        let out = c.drain_final(S + MAX_OPEN_NS + SETTLE_NS + wire_steps::MAX_CLUSTER_NS);
        assert_eq!(out.iter().map(|r| (r.conn.fd, r.done_ns.is_some())).collect::<Vec<_>>(), vec![(5, false), (6, true)]);
        assert_eq!(c.held(), (0, 0));
        // What comes for it later is an orphan, and a request arriving before
        // ones already handed out is late.
        c.ingest(&sse(conn(5), 0, 400 * S, SseKind::Content, None));
        c.ingest(&req(conn(7), 0, S / 2, &[]));
        let a = c.finish_streaming();
        assert_eq!(a.requests.len(), 1);
        for (k, v) in [("requests_final_while_open", 1), ("sse_without_request", 1), ("requests_late", 1), ("requests_unfinished", 1)] {
            assert_eq!(a.drops.get(k), Some(&v), "{k}");
        }
    }

    #[test]
    fn a_request_whose_connection_closes_ends_there_and_holds_nothing_back() {
        const S: u64 = 1_000_000_000;
        let mut c = Correlator::new(Config::default());
        // The client of conn 5 gives up after 2 s, before any response byte.
        c.ingest(&req(conn(5), 0, S, &[]));
        for r in exchange(conn(6), 0, 2 * S, 2, &[]) {
            c.ingest(&r);
        }
        c.ingest(&Record::ConnClose { ts_ns: 3 * S, conn: conn(5) });
        let out = c.drain_final(3 * S + SETTLE_NS + wire_steps::MAX_CLUSTER_NS);
        assert_eq!(out.iter().map(|r| (r.conn.fd, r.closed_ns, r.done_ns.is_some())).collect::<Vec<_>>(), vec![(5, Some(3 * S), false), (6, None, true)], "final once closed, not after {MAX_OPEN_NS} ns");
        assert_eq!(out[0].closed_ms(), Some(2000.0));
        assert_eq!(out[0].waited_until_ns(), Some(3 * S));
        // A close after the response ended changes nothing.
        c.ingest(&Record::ConnClose { ts_ns: 4 * S, conn: conn(6) });
        let a = c.finish_streaming();
        assert_eq!(a.drops.get("requests_closed_unfinished"), Some(&1));
        assert_eq!(a.drops.get("requests_unfinished"), None);
    }

    #[test]
    fn a_request_is_final_once_the_settle_window_is_past_its_end() {
        let mut c = Correlator::new(Config::default());
        for r in exchange(conn(5), 0, 1_000_000_000, 3, &[]) {
            c.ingest(&r);
        }
        let end = 1_000_000_000 + 5_000_000 + 3 * 2_000_000 + 200;
        let settle = SETTLE_NS + wire_steps::MAX_CLUSTER_NS;
        assert!(c.drain_final(end + settle - 1).is_empty());
        let out = c.drain_final(end + settle);
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].hop, out[0].id.as_str(), out[0].wire_steps.as_ref().map(|w| w.steps)), (1, "chatcmpl-0", Some(3)));
    }

    /// A chat stream's chunks without text before its first content are
    /// counted (the outputs a server held back); the role chunk, and what
    /// comes after the first content, are not; other APIs report none.
    #[test]
    fn chunks_without_text_before_the_first_content_are_counted_for_chat_and_completions_streams() {
        const MS: u64 = 1_000_000;
        const SEC: u64 = 1_000 * MS;
        let mut recs = Vec::new();
        for (fd, path) in [(5, "/v1/chat/completions"), (6, "/v1/completions?x=1"), (7, "/v1/responses")] {
            let c = conn(fd);
            let mut ex = exchange(c, 0, SEC * fd as u64, 3, &[]);
            if let Record::HttpRequest { path: p, .. } = &mut ex[0] {
                *p = path.into();
            }
            // Held outputs after the role chunk, and one after the first content.
            let at = SEC * fd as u64;
            ex.extend([2, 3, 4].map(|k| sse(c, 0, at + k * MS, SseKind::Other, None)));
            ex.push(sse(c, 0, at + 6 * MS, SseKind::Other, None));
            recs.extend(ex);
        }
        recs.sort_by_key(Record::ts_ns);
        let a = analyse(&recs);
        let got: Vec<(&str, u32, Option<u32>)> = a.requests.iter().map(|r| (r.path.as_str(), r.empty_chunks_before_content, r.empty_chunks())).collect();
        assert_eq!(got, [("/v1/chat/completions", 3, Some(3)), ("/v1/completions?x=1", 3, Some(3)), ("/v1/responses", 3, None)]);
    }

    #[test]
    fn drop_snapshots_keep_the_latest_value() {
        let recs = vec![
            Record::Drops { ts_ns: 1, counters: vec![("kernel_ringbuf_full".into(), 3)] },
            Record::Drops { ts_ns: 2, counters: vec![("kernel_ringbuf_full".into(), 7)] },
        ];
        assert_eq!(analyse(&recs).drops.get("kernel_ringbuf_full"), Some(&7));
    }

    #[test]
    fn injected_processes_that_traced_alike_share_one_cupti_setup_and_graph_launches_are_told_apart() {
        use hopscope_gpu_wire::enabled as e;
        let node = e::KERNEL | e::MEMCPY | e::SYNC | e::API_RUNTIME;
        let hello = |ts_ns, pid, clock, enabled| Record::GpuProcess { ts_ns, pid, ppid: 1, own_pid: pid, comm: "python".into(), cupti_version: 130001, clock, enabled, init_ns: ts_ns, cupti_lib: "/venv/nvidia/cu13/lib/libcupti.so.13".into() };
        // Two TP workers alike, one reconnecting (a second hello), one traced per launch.
        let recs = vec![hello(1, 10, 2, node), hello(2, 11, 2, node), hello(3, 10, 2, node), hello(4, 12, 2, node | e::GRAPH_LAUNCH), hello(5, 13, 9, 0)];
        let got = analyse(&recs).cupti;
        let view: Vec<(&str, &str, Vec<&str>, Vec<u32>)> = got.iter().map(|c| (c.clock.as_str(), c.graphs, c.traced.clone(), c.pids.clone())).collect();
        assert_eq!(
            view,
            [
                ("calibrated", "node", vec!["kernel", "memcpy", "sync", "api_runtime"], vec![10, 11]),
                ("calibrated", "launch", vec!["kernel", "memcpy", "sync", "api_runtime", "graph_launch"], vec![12]),
                ("unknown (9)", "node", vec![], vec![13]),
            ]
        );
        assert!(got.iter().all(|c| c.cupti_version == 130001 && c.cupti_lib.ends_with("libcupti.so.13")));
    }
}
