//! `hopscope trace`: a recording and its analysis as a Perfetto protobuf trace
//! (open it in ui.perfetto.dev). What each track shows: docs/perfetto.md.
//!
//! - [`proto`]: the hand-written prost subset of Perfetto's schema;
//! - [`writer`]: the streaming TracePacket writer (interning, track
//!   descriptors before use, incremental-state flags, delta timestamps,
//!   balanced slices);
//! - [`check`]: the invariant checker and structure summary tests run on
//!   every trace hopscope writes;
//! - [`raw`]: the record-driven tracks (threads, GPU streams, engine steps,
//!   server and loss counters), drawn record by record;
//! - [`live`]: `record --perfetto`, the trace written while recording, and
//!   `write_trace_streamed` (`hopscope trace` over [`FULL_LAYOUT_MAX_BYTES`]);
//! - [`stream`]: the request-driven tracks streamed as the correlator hands
//!   requests out, in memory that follows the open requests;
//! - this module: the request-driven tracks (chains, requests and their
//!   phases, request counters), drawn from the correlator's analysis, and
//!   `write_trace`, the whole trace from a loaded recording.
//!
//! The trace is written in two parts, each in time order on its own packet
//! sequences: first the record-driven tracks (as records come), then the
//! request-driven ones on a sequence of their own (requests are final only
//! when the correlator is done). The request part lists every timeline item
//! (a compact `(ts, what)` pair), sorts them stably by time and streams them
//! through the writer; items of one track are listed in their nesting order,
//! and the stable sort keeps that order among equal timestamps.

pub mod check;
pub mod deflate;
pub mod live;
pub mod proto;
pub mod raw;
pub mod stream;
pub mod writer;

#[cfg(test)]
pub(crate) mod tests;

use crate::correlate::{Analysis, Request};
use crate::model::Record;
use crate::recording::Meta;
use proto::{ChildOrdering, CounterUnit};
use raw::{RawLayout, RawStats, StepClock, StepInfo};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::io::Write;
pub use writer::{Arg, Encoding, Event, NameIid, PerfettoError, TrackId, TrackOpts, TraceWriter, Value, WriterStats};

/// Names used in the trace (tests and docs refer to them).
pub mod names {
    pub const META_TRACK: &str = "hopscope";
    pub const META_EVENT: &str = "recording";
    pub const CHAINS: &str = "Chains";
    pub const REQUESTS: &str = "Requests";
    pub const IN_FLIGHT: &str = "in-flight requests";
    pub const DROPS_PREFIX: &str = "drops: ";
    pub const READ_DELAY: &str = "read delay";
    pub const WAITING: &str = "waiting for first token";
    pub const FRONTEND: &str = "frontend";
    pub const QUEUE: &str = "queue";
    pub const PREFILL: &str = "prefill";
    pub const FIRST_OUTPUT: &str = "first output";
    pub const STEPS: &str = "Engine steps";
    pub const STEP: &str = "step";
    pub const GPU_STEPS: &str = "GPU steps";
    pub const GPU_STEP: &str = "gpu step";
    pub const KV_TRANSFER: &str = "kv transfer";
    pub const SCHEDULER_QUEUE: &str = "scheduler queue";
    pub const PASSED_OVER: &str = "passed over";
    pub const HELD_BACK: &str = "held back";
    pub const DECODE: &str = "decode";
    pub const CHUNK: &str = "chunk";
    pub const OFF_CPU: &str = "off-cpu";
    pub const RUN_QUEUE: &str = "run queue";
    pub const SERVER: &str = "Server";
    pub const RUNNING: &str = "running requests";
    pub const WAITING_REQS: &str = "waiting requests";
    pub const TOKENS_PER_S: &str = "output tokens/s";
    pub const KV_CACHE: &str = "KV-cache usage %";
    pub const GPU_MEM: &str = "memory used";
    pub const SM_UTIL: &str = "SM utilisation %";
    pub const MEM_UTIL: &str = "memory-controller utilisation %";
    pub const PCIE_TX: &str = "PCIe tx KiB/s";
    pub const PCIE_RX: &str = "PCIe rx KiB/s";
    pub const NVLINK_TX: &str = "NVLink tx KiB/s";
    pub const NVLINK_RX: &str = "NVLink rx KiB/s";
}

/// What the trace is made from.
#[derive(Clone, Copy)]
pub struct TraceInput<'a> {
    pub meta: &'a Meta,
    /// The recording's records, in recording (timestamp) order.
    pub records: &'a [Record],
    /// The correlator's result for those records.
    pub analysis: &'a Analysis,
    /// Why reading the recording stopped early, if it did (shown in the metadata).
    pub read_error: Option<&'a str>,
}

/// What went into the trace.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TraceStats {
    pub writer: WriterStats,
    pub requests: u64,
    pub chains: u64,
    /// Chain tracks, counting extra lanes for hops that overlapped in time.
    pub chain_tracks: u64,
    pub processes: u64,
    pub offcpu_slices: u64,
    /// Off-CPU records that could not be drawn: switch-out after switch-in, or
    /// overlapping the thread's previous interval (lost scheduler events).
    pub offcpu_skipped: u64,
    /// GPU kernels, copies and memsets drawn on stream tracks.
    pub gpu_slices: u64,
    /// GPU records not drawn: end before start, or more overlap on one
    /// stream than the overlap lanes hold.
    pub gpu_skipped: u64,
    pub steps: u64,
    /// Steps that ended before the previous one (not drawn).
    pub steps_skipped: u64,
    /// Counter samples older than their track's previous one (not drawn).
    pub counter_values_skipped: u64,
    /// Flows from a request's prefill/decode slice to the engine steps that
    /// served it; from a GPU step to each of its processes' first kernel
    /// and end copy (without GPU steps: from an engine step to the first and
    /// last kernel that started in it).
    pub step_flows: u64,
    pub kernel_flows: u64,
    /// Request→step flows left out: beyond the first [`FLOW_HEAD`] and the last, or to a
    /// phase slice that has no duration and so is not drawn.
    pub flows_capped: u64,
    /// Step members whose engine request maps to no drawn request (not
    /// joined to an HTTP request, or the step list could not be replayed).
    pub flows_unmapped: u64,
    /// GPU steps (CUPTI step ends) drawn, and left out (overlap lanes full,
    /// or starting before the previous one).
    pub gpu_steps: u64,
    pub gpu_steps_skipped: u64,
    /// Flows from an engine step to the GPU step matched to it.
    pub gpu_step_flows: u64,
    /// KV transfer slices drawn inside requests' queue/prefill slices.
    pub kv_slices: u64,
    /// Streamed request part only ([`stream`]): requests left out because
    /// they would start before what was already written.
    pub requests_late: u64,
    /// Live and streamed, in recordings with kernels but no GPU step (no
    /// CUPTI step ends): engine steps during which kernels were drawn, drawn
    /// without flows to them (the whole layout's time rule needs the step
    /// before its kernels).
    pub flows_not_streamed: u64,
    /// Live and streamed: flow ids written that no other slice names: on
    /// steps, for a request or phase not drawn; on GPU work and engine
    /// steps, for a GPU step that does not come (a candidate end copy that
    /// ended no step, an engine step no GPU step matched). Trace processor
    /// ignores them, and the trace says how many (`trace.flows_unlinked`,
    /// which [`check`] verifies).
    pub flows_unlinked: u64,
    /// Streamed only: the most requests the request part held at once
    /// (handed out by the correlator, not yet written), and its largest queue
    /// of timeline items: what its memory follows.
    pub held_requests_peak: u64,
    pub held_items_peak: u64,
}

impl TraceStats {
    /// `from_records`: the raw part drew the GPU steps' flows (live and
    /// streamed), not the whole layout's plan, which counts its own.
    fn add_raw(&mut self, r: &RawStats, from_records: bool) {
        self.offcpu_slices = r.offcpu_slices;
        self.offcpu_skipped = r.offcpu_skipped;
        self.gpu_slices = r.gpu_slices;
        self.gpu_skipped = r.gpu_skipped;
        self.steps = r.steps;
        self.steps_skipped = r.steps_skipped;
        self.counter_values_skipped = r.counter_values_skipped;
        self.gpu_steps = r.gpu_steps;
        self.gpu_steps_skipped = r.gpu_steps_skipped;
        self.flows_unmapped = r.flows_unmapped;
        self.flows_capped = r.flows_capped;
        self.flows_unlinked = r.flows_unlinked;
        // With GPU steps every layout draws kernels' flows from them; without,
        // by time, which only the whole layout can.
        self.flows_not_streamed = if r.gpu_steps + r.gpu_steps_skipped > 0 { 0 } else { r.gpu_flows_not_drawn };
        if from_records {
            self.gpu_step_flows = r.gpu_step_flows;
            self.kernel_flows = r.kernel_flows;
        }
    }
}

/// `hopscope trace` lays out recordings up to this size whole (every record
/// and request in memory, with the request→step→kernel flows); larger ones
/// are streamed ([`live::write_trace_streamed`]) in memory that follows the
/// open requests. `HOPSCOPE_TRACE_FULL_MAX_BYTES` overrides it.
pub const FULL_LAYOUT_MAX_BYTES: u64 = 4 << 20;

/// A request's prefill or decode slice gets flows to the first `FLOW_HEAD`
/// steps that served it and to the last one (a long decode has hundreds of
/// steps; the arrows would hide the timeline). The first and the last, not
/// the last few: a streamed trace writes each step as it comes, when whether
/// it is among a request's last few is not known yet, but whether it is its
/// last is (its first token's step ends the prefill, the finishing output
/// the decode), and both layouts keep one rule.
pub const FLOW_HEAD: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Phase {
    ReadDelay,
    Waiting,
    Decode,
    Frontend,
    Queue,
    Prefill,
    FirstOutput,
    KvTransfer,
    /// Inside the queue: the engine's QUEUED stamp to scheduled (not a phase).
    SchedulerQueue,
    /// Inside the scheduler's queue: its start to the last time a request
    /// queued later was scheduled first (not a phase).
    PassedOver,
    /// Inside the first output: the first token to the last step before the
    /// first content, while the text was held back (not a phase).
    HeldBack,
}

impl Phase {
    /// Whether its slice shows report figures ([`phase_args`]).
    fn has_figures(self) -> bool {
        !matches!(self, Phase::ReadDelay | Phase::Waiting | Phase::KvTransfer | Phase::SchedulerQueue | Phase::PassedOver | Phase::HeldBack)
    }

    fn name(self) -> &'static str {
        match self {
            Phase::ReadDelay => names::READ_DELAY,
            Phase::Waiting => names::WAITING,
            Phase::Decode => names::DECODE,
            Phase::Frontend => names::FRONTEND,
            Phase::Queue => names::QUEUE,
            Phase::Prefill => names::PREFILL,
            Phase::FirstOutput => names::FIRST_OUTPUT,
            Phase::KvTransfer => names::KV_TRANSFER,
            Phase::SchedulerQueue => names::SCHEDULER_QUEUE,
            Phase::PassedOver => names::PASSED_OVER,
            Phase::HeldBack => names::HELD_BACK,
        }
    }
}

/// Counters that move by +1/-1 as intervals begin and end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Level {
    InFlight = 0,
    Running = 1,
    Waiting = 2,
}

/// One request-part thing to draw at one time. Indexes point into the analysis.
#[derive(Debug, Clone, Copy)]
enum Item {
    Meta,
    HopBegin { req: u32, track: TrackId },
    RequestBegin { req: u32 },
    PhaseBegin { req: u32, phase: Phase },
    /// A KV transfer slice of `ns` inside the queue or prefill slice.
    KvBegin { req: u32, ns: u64 },
    Chunk { req: u32 },
    End { track: TrackId },
    /// A change of one of the request-level counters.
    Level { which: Level, delta: i32 },
    DropFinal,
}

#[derive(Debug, Clone, Copy)]
struct Timed {
    ts: u64,
    item: Item,
}

/// A slice's flow ends: flows it starts and flows it terminates. Which end
/// starts a flow is decided by time (trace processor links flows in
/// timestamp order); when both ends begin at the same time on different
/// sequences their order is not fixed, so both name the flow in `flow_ids`
/// (whichever comes first starts it, the other continues it).
#[derive(Debug, Clone, Default)]
pub struct Ends {
    pub start: Vec<u64>,
    pub end: Vec<u64>,
}

/// Flows between the two parts of the trace, planned before either is
/// written (offline only: a live trace writes steps and kernels before the
/// requests they served are known).
#[derive(Default)]
struct Flows {
    steps: Vec<Ends>,
    gpu_steps: Vec<Ends>,
    /// By record index: kernels and copies (GPU steps' ends).
    kernels: HashMap<u32, Ends>,
    phases: HashMap<(u32, Phase), Ends>,
}

impl Flows {
    /// Links `a` (beginning at `ta`) and `b` (at `tb`) with flow `id`.
    fn link(id: u64, a: &mut Ends, ta: u64, b: &mut Ends, tb: u64) {
        match ta.cmp(&tb) {
            std::cmp::Ordering::Less => {
                a.start.push(id);
                b.end.push(id);
            }
            std::cmp::Ordering::Greater => {
                b.start.push(id);
                a.end.push(id);
            }
            std::cmp::Ordering::Equal => {
                a.start.push(id);
                b.start.push(id);
            }
        }
    }
}

/// The scheduler's queue drawn inside the queue slice `[a, b]`: the engine's
/// QUEUED stamp to the queue's end ([`scheduler_queue_span`]), when it lasted
/// and no KV copy of the request ran in the queue (those slices nest there,
/// and the two need not nest in each other).
///
/// [`scheduler_queue_span`]: crate::correlate::engine::scheduler_queue_span
fn scheduler_slice(r: &Request, a: u64, b: u64, kv: &[(u64, u64)]) -> Option<(u64, u64)> {
    let (s, e) = crate::correlate::engine::scheduler_queue_span(r)?;
    let (s, e) = (s.max(a), e.min(b));
    (e > s && !kv.iter().any(|&(ka, kb)| ka < b && kb > a)).then_some((s, e))
}

/// Inside the scheduler's queue slice `[s, e]` ([`scheduler_slice`]): its
/// start to the last time a request queued after this one was scheduled
/// first ([`passed_over_span`]), when one was: the part of the wait vLLM's
/// scheduler spent skipping it (its grammar, most often).
///
/// [`passed_over_span`]: crate::correlate::engine::passed_over_span
fn passed_over_slice(r: &Request, q: (u64, u64)) -> Option<(u64, u64)> {
    crate::correlate::engine::passed_over_span(r.engine.as_ref()?, q)
}

/// The "passed over" slice's args: how many went past, and the report's
/// `scheduler_passed_over_ms` (the slice's length).
fn passed_over_args(r: &Request) -> [Arg<'static>; 2] {
    let by = r.engine.as_ref().and_then(|e| e.passed_over_by).unwrap_or(0);
    let ms = crate::correlate::engine::scheduler_passed_over_ms(r).unwrap_or(0.0);
    [Arg::u64("scheduler_passed_over_by", u64::from(by)), Arg::f64("scheduler_passed_over_ms", ms)]
}

/// Inside the first-output slice `[a, b]`: the first token to the last step
/// with the request's tokens that ended before its first content
/// ([`first_output_held_span`]), when the engine made more than one token
/// before it: the text held back (stop strings, a parser), or an output
/// path a step behind.
///
/// [`first_output_held_span`]: crate::correlate::engine::first_output_held_span
fn held_slice(r: &Request, a: u64, b: u64) -> Option<(u64, u64)> {
    let (s, e) = crate::correlate::engine::first_output_held_span(r)?;
    let (s, e) = (s.max(a), e.min(b));
    (e > s).then_some((s, e))
}

/// The "held back" slice's args: the report's `tokens_before_first_content`
/// and `first_output_held_ms` (the slice's length).
fn held_args(r: &Request) -> [Arg<'static>; 2] {
    let tokens = r.engine.as_ref().and_then(|e| e.tokens_before_first_content).unwrap_or(0);
    let ms = crate::correlate::engine::first_output_held_ms(r).unwrap_or(0.0);
    [Arg::u64("tokens_before_first_content", tokens), Arg::f64("first_output_held_ms", ms)]
}

/// The phases drawn inside a request's slice `[arrive, end]`: with the engine
/// IPC joined, the partition's; else what the wire alone shows. Only spans
/// with a duration.
fn phase_spans(r: &Request, arrive: u64, end: u64) -> Vec<(u64, u64, Phase)> {
    let engine_marks = crate::correlate::engine::marks(r).filter(|m| m.arrive == arrive && m.done == end);
    // At most five: one allocation, not a growth per phase.
    let mut spans = Vec::with_capacity(5);
    if let Some(m) = engine_marks {
        spans.extend([(m.arrive, m.submit, Phase::Frontend), (m.submit, m.scheduled, Phase::Queue)]);
        match (m.first_token, m.ttft) {
            (Some(f), Some(t)) => spans.extend([(m.scheduled, f, Phase::Prefill), (f, t, Phase::FirstOutput), (t, m.done, Phase::Decode)]),
            (Some(f), None) => spans.extend([(m.scheduled, f, Phase::Prefill), (f, m.done, Phase::Decode)]),
            (None, Some(t)) => spans.extend([(m.scheduled, t, Phase::Prefill), (t, m.done, Phase::Decode)]),
            (None, None) => spans.push((m.scheduled, m.done, Phase::Prefill)),
        }
    } else if let Some(ttft) = r.ttft_ns {
        let ttft = ttft.clamp(arrive, end);
        spans.extend([(arrive, ttft, Phase::Waiting), (ttft, end, Phase::Decode)]);
    }
    spans.retain(|(a, b, _)| b > a);
    spans
}

/// The trace's time bounds for a loaded recording: from the recording's
/// start (or anything earlier it shows) to its last event.
fn bounds(meta: &Meta, records: &[Record], analysis: &Analysis) -> (u64, u64) {
    let mut t0 = analysis.first_ns.unwrap_or(u64::MAX);
    if meta.start_ns > 0 {
        t0 = t0.min(meta.start_ns);
    }
    for r in &analysis.requests {
        t0 = t0.min(request_span(r, 0).0);
    }
    for rec in records {
        if let Record::OffCpu { off_ns, .. } = rec {
            t0 = t0.min(*off_ns);
        }
    }
    if t0 == u64::MAX {
        t0 = 0;
    }
    let t_end = end_of(analysis, t0, records.last().map_or(t0, Record::ts_ns));
    (t0, t_end)
}

fn end_of(analysis: &Analysis, t0: u64, last_record: u64) -> u64 {
    let mut t_end = analysis.last_ns.unwrap_or(t0).max(t0).max(last_record);
    for r in &analysis.requests {
        t_end = t_end.max(request_span(r, t0).1);
    }
    t_end
}

/// Plans the flows request phase → engine steps → first and last kernel.
fn plan_flows<W: Write>(w: &mut TraceWriter<W>, records: &[Record], analysis: &Analysis, t0: u64, t_end: u64, stats: &mut TraceStats) -> Flows {
    let mut flows = Flows { steps: vec![Ends::default(); analysis.steps.len()], gpu_steps: vec![Ends::default(); analysis.gpu_steps.len()], ..Flows::default() };
    if analysis.steps.is_empty() && analysis.gpu_steps.is_empty() {
        return flows;
    }
    // Where each step is drawn (the raw part's rule), None when it is not.
    let mut clock = StepClock::default();
    let step_span: Vec<Option<(u64, u64)>> = analysis.steps.iter().map(|st| clock.next(st.engine, st.end_ns).map(|(a, _)| (a.max(t0), st.end_ns.max(a.max(t0))))).collect();

    // Each request's steps: those that carried its prefill (up to its first
    // token, chunked-prefill steps before it included), then its decode steps.
    let mut served: Vec<(Vec<u32>, Vec<u32>)> = vec![(Vec::new(), Vec::new()); analysis.requests.len()];
    // Per request: whether its drawn prefill steps end with its first
    // token's, and the last step it was in (drawn or not). A phase's last
    // flow goes to the step that ended it — the first token's, the
    // finishing output's — as a streamed trace, which knows no other last
    // when it writes the step, draws it: an aborted or unfinished request's
    // last step ended nothing.
    let mut tail: Vec<(bool, Option<u32>)> = vec![(false, None); analysis.requests.len()];
    // Per request: an output finished it (a finish reason).
    let mut finished = vec![false; analysis.requests.len()];
    let map = engine_request_map(records, analysis);
    let mut first_seen: HashSet<u32> = HashSet::new();
    for (k, st) in analysis.steps.iter().enumerate() {
        for &(ei, _, first) in &st.members {
            let Some((ri, fin)) = map.as_ref().and_then(|m| m.get(ei as usize).copied().flatten()) else {
                stats.flows_unmapped += 1;
                continue;
            };
            tail[ri as usize].1 = Some(k as u32);
            finished[ri as usize] = fin;
            if step_span[k].is_none() {
                stats.flows_capped += 1;
            } else {
                let (pre, dec) = &mut served[ri as usize];
                if first_seen.contains(&ei) {
                    dec.push(k as u32);
                } else {
                    pre.push(k as u32);
                    tail[ri as usize].0 = first;
                }
            }
            if first {
                first_seen.insert(ei);
            }
        }
    }
    for (i, r) in analysis.requests.iter().enumerate() {
        let (pre, dec) = std::mem::take(&mut served[i]);
        let finishes = finished[i] && dec.last().copied() == tail[i].1;
        let ends = [tail[i].0, finishes];
        let (start, end) = request_span(r, t_end);
        let arrive = r.arrive_ns.clamp(start, end);
        let spans = phase_spans(r, arrive, end);
        for (steps, phase) in [(pre, Phase::Prefill), (dec, Phase::Decode)] {
            let Some(&(at, _, _)) = spans.iter().find(|s| s.2 == phase) else {
                // Not drawn (no engine marks, or no duration).
                stats.flows_capped += steps.len() as u64;
                continue;
            };
            let (steps, left_out) = capped(&steps, ends[usize::from(phase == Phase::Decode)]);
            stats.flows_capped += left_out;
            let mut ends = Ends::default();
            for k in steps {
                let id = w.new_flow_id();
                let (ta, _) = step_span[k as usize].expect("only drawn steps are served");
                Flows::link(id, &mut ends, at, &mut flows.steps[k as usize], ta);
                stats.step_flows += 1;
            }
            flows.phases.insert((i as u32, phase), ends);
        }
    }

    // Kernels of the engine (the processes that write its step outputs, and
    // their children: tensor-parallel workers) whose GPU start falls in a
    // step's span ran for that step. Without a traced writer every process's
    // kernels count. The lanes are placed as the raw part will place them,
    // so only kernels that get a slice get a flow.
    let mut engine_pids: HashSet<u32> = HashSet::new();
    for rec in records {
        if let Record::EngineOutputs { conn, dir: crate::event::Dir::Out, .. } = rec {
            engine_pids.insert(conn.tgid);
        }
    }
    for rec in records {
        if let Record::Proc { op: crate::event::ProcOp::Fork, tgid, child_tgid, .. } = rec {
            if engine_pids.contains(tgid) {
                engine_pids.insert(*child_tgid);
            }
        }
    }
    let mut spans: Vec<(u64, u64, u32)> = step_span.iter().enumerate().filter_map(|(k, s)| s.map(|(a, b)| (a, b, k as u32))).collect();
    spans.sort_unstable();

    // With CUPTI step ends, each GPU step flows to each of its processes'
    // first kernel and end copy (`raw::GpuMarks`: the rule live and streamed
    // traces follow too) and each engine step to its matched GPU step;
    // without them, engine steps to their first and last kernel by time.
    let gpu_steps = &analysis.gpu_steps;
    let gpu_rule = !gpu_steps.is_empty();
    let gpu_lanes = raw::gpu_step_lanes(gpu_steps, t0);
    if gpu_rule {
        let by_gpu_end: HashMap<u64, usize> = gpu_steps.iter().enumerate().map(|(g, st)| (st.gpu_end_ns, g)).collect();
        let mut by_end: HashMap<u64, usize> = HashMap::new();
        for (k, st) in analysis.steps.iter().enumerate() {
            by_end.entry(st.end_ns).or_insert(k);
        }
        for c in &analysis.step_compute {
            let Some(g) = c.gpu_end_ns.and_then(|e| by_gpu_end.get(&e)).copied() else { continue };
            let Some(&k) = by_end.get(&c.end_ns) else { continue };
            let (Some((ta, _)), Some((_, tg, _))) = (step_span[k], gpu_lanes[g]) else { continue };
            let id = w.new_flow_id();
            Flows::link(id, &mut flows.steps[k], ta, &mut flows.gpu_steps[g], tg);
            stats.gpu_step_flows += 1;
        }
    }
    // Per engine step (time rule): its first and last kernel, as (GPU start, record index).
    type FirstLast = Option<((u64, u32), (u64, u32))>;
    let mut step_kernels: Vec<FirstLast> = vec![None; if gpu_rule { 0 } else { analysis.steps.len() }];
    // GPU rule: each process's marked records, as (record index, GPU start).
    let mut marks = raw::GpuMarks::default();
    let mut rank_ends: HashMap<u32, raw::RankEnds<(u32, u64)>> = HashMap::new();
    let mut lanes = raw::Lanes::default();
    for (i, rec) in records.iter().enumerate() {
        let Some((ts, end, pid, device, stream)) = raw::gpu_item(rec) else { continue };
        // Placed as the raw part will place them: only slices get flows.
        let drawn = !(end < ts || ts < t0) && lanes.place((pid, device, stream), ts, end).is_some();
        if gpu_rule {
            if let Some(m) = marks.mark(rec, drawn) {
                rank_ends.entry(pid).or_default().push(m, ts, end, (i as u32, ts));
            }
            continue;
        }
        if !drawn || !matches!(rec, Record::GpuKernel { .. }) || !(engine_pids.is_empty() || engine_pids.contains(&pid)) {
            continue;
        }
        if let Some(k) = step_at(&spans, ts) {
            let e = step_kernels[k as usize].get_or_insert(((ts, i as u32), (ts, i as u32)));
            e.0 = e.0.min((ts, i as u32));
            e.1 = e.1.max((ts, i as u32));
        }
    }
    let mut prev_end: HashMap<u32, u64> = HashMap::new();
    let mut gone = Vec::new();
    for (g, st) in gpu_steps.iter().enumerate() {
        for r in &st.ranks {
            let prev = prev_end.insert(r.pid, r.gpu_end_ns);
            let (first, copy) = rank_ends.entry(r.pid).or_default().take(prev, r.start_ns, r.gpu_end_ns, &mut gone);
            gone.clear();
            let Some((_, tg, _)) = gpu_lanes[g] else { continue };
            for (rec, tk) in first.into_iter().chain(copy) {
                let id = w.new_flow_id();
                Flows::link(id, &mut flows.gpu_steps[g], tg, flows.kernels.entry(rec).or_default(), tk);
                stats.kernel_flows += 1;
            }
        }
    }
    for (k, fl) in step_kernels.iter().enumerate() {
        let Some(((t_first, first), (t_last, last))) = *fl else { continue };
        let ta = step_span[k].expect("kernels only go to drawn steps").0;
        let ends = if first == last { vec![(first, t_first)] } else { vec![(first, t_first), (last, t_last)] };
        for (rec, tk) in ends {
            let id = w.new_flow_id();
            Flows::link(id, &mut flows.steps[k], ta, flows.kernels.entry(rec).or_default(), tk);
            stats.kernel_flows += 1;
        }
    }
    flows
}

/// The request part's group tracks; declared before the raw part offline so
/// the UI lists them in this order.
struct Groups {
    chains: TrackId,
    requests: TrackId,
}

fn groups<W: Write>(w: &mut TraceWriter<W>) -> Result<Groups, PerfettoError> {
    let chains = w.track(names::CHAINS, TrackOpts { rank: Some(1), child_ordering: Some(ChildOrdering::Explicit), ..TrackOpts::default() });
    let requests = w.track(names::REQUESTS, TrackOpts { rank: Some(2), child_ordering: Some(ChildOrdering::Explicit), ..TrackOpts::default() });
    w.describe(chains)?;
    w.describe(requests)?;
    Ok(Groups { chains, requests })
}

/// Writes the trace of `input` into `out` (wrap files in a `BufWriter`),
/// compressed, and returns the writer's output and what was drawn.
pub fn write_trace<W: Write>(out: W, input: TraceInput<'_>) -> Result<(W, TraceStats), PerfettoError> {
    write_trace_with(out, input, Encoding::default())
}

/// [`write_trace`] with the given encoding.
pub fn write_trace_with<W: Write>(out: W, input: TraceInput<'_>, enc: Encoding) -> Result<(W, TraceStats), PerfettoError> {
    let TraceInput { meta, records, analysis, .. } = input;
    let mut stats = TraceStats::default();
    let (t0, t_end) = bounds(meta, records, analysis);
    let mut w = TraceWriter::with_encoding(out, t0, enc)?;
    let mut raw = RawLayout::new(t0, false);
    for r in records {
        raw.names.note(r);
    }
    // Every process the recording names, described up front so empty ones show too.
    let meta_track = raw.meta_track(&mut w);
    w.describe(meta_track)?;
    let mut pids: BTreeSet<u32> = meta.pids.iter().copied().collect();
    pids.extend(analysis.requests.iter().map(|r| r.conn.tgid));
    for rec in records {
        match rec {
            Record::Proc { tgid, child_tgid, .. } => {
                pids.insert(*tgid);
                pids.insert(*child_tgid);
            }
            Record::OffCpu { tgid, .. } => {
                pids.insert(*tgid);
            }
            Record::GpuKernel { pid, .. } | Record::GpuMemcpy { pid, .. } | Record::GpuMemset { pid, .. } => {
                pids.insert(*pid);
            }
            _ => {}
        }
    }
    pids.remove(&0);
    for &pid in &pids {
        let t = raw.process(&mut w, pid);
        w.describe(t)?;
    }
    let g = groups(&mut w)?;
    let flows = plan_flows(&mut w, records, analysis, t0, t_end, &mut stats);
    // The raw part's stats carry every flow count (the streamed layout counts there).
    raw.stats.flows_capped += std::mem::take(&mut stats.flows_capped);
    raw.stats.flows_unmapped += std::mem::take(&mut stats.flows_unmapped);

    // The record-driven part: records in order, then the engine steps.
    for (i, rec) in records.iter().enumerate() {
        raw.push(&mut w, rec, flows.kernels.get(&(i as u32)))?;
    }
    for (k, st) in analysis.steps.iter().enumerate() {
        let info = StepInfo {
            engine: st.engine,
            index: k as u64,
            end_ns: st.end_ns,
            sent_ns: st.sent_ns,
            requests: st.members.len() as u64,
            new_tokens: st.members.iter().map(|m| m.1).sum(),
            first_tokens: st.members.iter().filter(|m| m.2).count() as u64,
        };
        raw.step(&mut w, &info, flows.steps.get(k))?;
    }
    raw.gpu_steps(&mut w, &analysis.gpu_steps, &flows.gpu_steps, &[])?;

    write_requests(&mut w, &mut raw, &g, input, Some(&flows), t0, t_end, &mut stats)?;
    stats.processes = w.processes() as u64;
    let (out, ws) = w.finish()?;
    stats.writer = ws;
    Ok((out, stats))
}

/// The request-driven part, on a sequence of its own: the metadata instant,
/// chains, requests with their phases, chunks and flows, the in-flight,
/// running and waiting counters, and the loss counters' final values.
#[allow(clippy::too_many_arguments)]
fn write_requests<W: Write>(
    w: &mut TraceWriter<W>,
    raw: &mut RawLayout,
    g: &Groups,
    input: TraceInput<'_>,
    flows: Option<&Flows>,
    t0: u64,
    t_end: u64,
    stats: &mut TraceStats,
) -> Result<(), PerfettoError> {
    let TraceInput { meta, analysis, read_error, .. } = input;
    stats.requests = analysis.requests.len() as u64;
    stats.chains = analysis.chains.len() as u64;
    stats.add_raw(&raw.stats, raw.draws_gpu_flows());
    w.use_new_sequence();
    let meta_track = raw.meta_track(w);
    let mut items: Vec<Timed> = vec![Timed { ts: t0, item: Item::Meta }];

    // Chains: one track per chain (plus a lane per overlap), one slice per hop.
    let mut flow_of: Vec<Option<u64>> = vec![None; analysis.requests.len()];
    let mut rank = 0;
    for c in &analysis.chains {
        let mut lanes: Vec<(TrackId, u64)> = Vec::new();
        for &i in &c.hops {
            let Some(r) = analysis.requests.get(i) else { continue };
            let (start, end) = request_span(r, t_end);
            let lane = match lanes.iter().position(|(_, free_at)| *free_at <= start) {
                Some(l) => l,
                None => {
                    let name = if lanes.is_empty() { c.chain.clone() } else { format!("{} (overlap {})", c.chain, lanes.len()) };
                    let t = w.track(&name, TrackOpts { parent: Some(g.chains), rank: Some(rank), ..TrackOpts::default() });
                    rank += 1;
                    lanes.push((t, 0));
                    lanes.len() - 1
                }
            };
            lanes[lane].1 = end;
            let track = lanes[lane].0;
            flow_of[i] = Some(w.new_flow_id());
            items.push(Timed { ts: start, item: Item::HopBegin { req: i as u32, track } });
            items.push(Timed { ts: end, item: Item::End { track } });
        }
        stats.chain_tracks += lanes.len() as u64;
    }

    // Requests: one track each, the request slice with its phases and chunks.
    let in_flight = w.counter_track(names::IN_FLIGHT, CounterUnit::Count, TrackOpts { parent: Some(g.requests), rank: Some(0), ..TrackOpts::default() });
    let mut level_tracks: [Option<TrackId>; 3] = [Some(in_flight), None, None];
    let mut request_tracks = Vec::with_capacity(analysis.requests.len());
    let mut levels: Vec<Timed> = Vec::new();
    for (i, r) in analysis.requests.iter().enumerate() {
        let track = w.track(&r.id, TrackOpts { parent: Some(g.requests), rank: Some(i.min(i32::MAX as usize - 1) as i32 + 1), ..TrackOpts::default() });
        request_tracks.push(track);
        let req = i as u32;
        let (start, end) = request_span(r, t_end);
        let arrive = r.arrive_ns.clamp(start, end);
        items.push(Timed { ts: start, item: Item::RequestBegin { req } });
        items.push(Timed { ts: start, item: Item::Level { which: Level::InFlight, delta: 1 } });
        if start < arrive {
            items.push(Timed { ts: start, item: Item::PhaseBegin { req, phase: Phase::ReadDelay } });
            items.push(Timed { ts: arrive, item: Item::End { track } });
        }
        let spans = phase_spans(r, arrive, end);
        // Without the engine, chunks are listed inside the decode slice
        // (from the first one on), which stays open until they are.
        let engine = crate::correlate::engine::marks(r).is_some_and(|m| m.arrive == arrive && m.done == end);
        let wire_ttft = r.ttft_ns.filter(|_| !engine).map(|t| t.clamp(arrive, end));
        let open_decode = wire_ttft.is_some() && spans.iter().any(|s| s.2 == Phase::Decode);
        // The request's KV copies (their union) nest inside the queue or
        // prefill slice they ran in, clipped to it (a copy across the
        // scheduling gives one slice in each).
        let kv = r.gpu.as_ref().map_or(&[][..], |g| g.kv_spans());
        for &(a, b, phase) in &spans {
            items.push(Timed { ts: a, item: Item::PhaseBegin { req, phase } });
            if let Some((s, e)) = (engine && phase == Phase::Queue).then(|| scheduler_slice(r, a, b, kv)).flatten() {
                items.push(Timed { ts: s, item: Item::PhaseBegin { req, phase: Phase::SchedulerQueue } });
                if let Some((ps, pe)) = passed_over_slice(r, (s, e)) {
                    items.push(Timed { ts: ps, item: Item::PhaseBegin { req, phase: Phase::PassedOver } });
                    items.push(Timed { ts: pe, item: Item::End { track } });
                }
                items.push(Timed { ts: e, item: Item::End { track } });
            }
            if let Some((s, e)) = (engine && phase == Phase::FirstOutput).then(|| held_slice(r, a, b)).flatten() {
                items.push(Timed { ts: s, item: Item::PhaseBegin { req, phase: Phase::HeldBack } });
                items.push(Timed { ts: e, item: Item::End { track } });
            }
            if engine && matches!(phase, Phase::Queue | Phase::Prefill) {
                for &(ka, kb) in kv {
                    let (ka, kb) = (ka.max(a), kb.min(b));
                    if kb > ka {
                        items.push(Timed { ts: ka, item: Item::KvBegin { req, ns: kb - ka } });
                        items.push(Timed { ts: kb, item: Item::End { track } });
                        stats.kv_slices += 1;
                    }
                }
            }
            if !(open_decode && phase == Phase::Decode) {
                items.push(Timed { ts: b, item: Item::End { track } });
            }
        }
        if engine || wire_ttft.is_some() {
            let mut at = wire_ttft.unwrap_or(arrive);
            for &c in &r.content_ns {
                at = c.clamp(at, end);
                items.push(Timed { ts: at, item: Item::Chunk { req } });
            }
        }
        if open_decode {
            items.push(Timed { ts: end, item: Item::End { track } });
        }
        items.push(Timed { ts: end, item: Item::End { track } });
        items.push(Timed { ts: end, item: Item::Level { which: Level::InFlight, delta: -1 } });
        // Waiting (submitted to the engine, not scheduled) and running
        // (scheduled, not finished), from the partition's marks.
        if let Some(m) = crate::correlate::engine::marks(r) {
            for (a, b, which) in [(m.submit, m.scheduled, Level::Waiting), (m.scheduled, m.done, Level::Running)] {
                if b > a {
                    levels.push(Timed { ts: a, item: Item::Level { which, delta: 1 } });
                    levels.push(Timed { ts: b, item: Item::Level { which, delta: -1 } });
                }
            }
        }
    }
    if !levels.is_empty() {
        let server = raw.server(w);
        level_tracks[Level::Running as usize] = Some(w.counter_track(names::RUNNING, CounterUnit::Count, TrackOpts { parent: Some(server), ..TrackOpts::default() }));
        level_tracks[Level::Waiting as usize] = Some(w.counter_track(names::WAITING_REQS, CounterUnit::Count, TrackOpts { parent: Some(server), ..TrackOpts::default() }));
        items.extend(levels);
    }
    items.push(Timed { ts: t_end, item: Item::DropFinal });

    // Stable: items of one track keep their listed (nesting) order at equal times.
    items.sort_by_key(|t| t.ts);

    let no_ends = Ends::default();
    let phase_ends = |req: u32, phase: Phase| flows.and_then(|f| f.phases.get(&(req, phase))).unwrap_or(&no_ends);
    let mut open_hops: HashSet<u64> = HashSet::new();
    let mut level_now = [0i64; 3];
    let mut level_shown: [Option<i64>; 3] = [None; 3];
    let mut cur_ts = t0;
    for Timed { ts, item } in items {
        if ts > cur_ts {
            for (l, t) in level_tracks.iter().enumerate() {
                if let Some(t) = *t {
                    if level_shown[l] != Some(level_now[l]) {
                        w.counter(cur_ts, t, level_now[l])?;
                        level_shown[l] = Some(level_now[l]);
                    }
                }
            }
            cur_ts = ts;
        }
        match item {
            Item::Meta => {
                let strings = MetaStrings::of(meta, &analysis.drops);
                let a = meta_args(meta, &strings, analysis.requests.len() as u64, analysis.chains.len() as u64, read_error, &analysis.drops, stats);
                w.instant(ts, meta_track, &Event::named(names::META_EVENT).args(&a))?;
                for (l, t) in level_tracks.iter().enumerate() {
                    if let Some(t) = *t {
                        w.counter(ts, t, 0)?;
                        level_shown[l] = Some(0);
                    }
                }
            }
            Item::HopBegin { req, track } => {
                let r = &analysis.requests[req as usize];
                let args = hop_args(r);
                let name = hop_label(r);
                // Same sequence, same time as its request: the hop is written first.
                let ids = flow_of[req as usize].as_slice();
                open_hops.extend(ids);
                w.begin(ts, track, &Event::named_once(&name).args(&args).flows(ids))?;
            }
            Item::RequestBegin { req } => {
                let r = &analysis.requests[req as usize];
                let held = RequestArgs::of(r);
                let args = held.args(r);
                let ids: Vec<u64> = flow_of[req as usize].iter().copied().filter(|id| open_hops.remove(id)).collect();
                w.begin(ts, request_tracks[req as usize], &Event::named(&r.id).args(&args).terminating_flows(&ids))?;
            }
            Item::PhaseBegin { req, phase: Phase::PassedOver } => {
                let args = passed_over_args(&analysis.requests[req as usize]);
                w.begin(ts, request_tracks[req as usize], &Event::named(Phase::PassedOver.name()).args(&args))?;
            }
            Item::PhaseBegin { req, phase: Phase::HeldBack } => {
                let args = held_args(&analysis.requests[req as usize]);
                w.begin(ts, request_tracks[req as usize], &Event::named(Phase::HeldBack.name()).args(&args))?;
            }
            Item::PhaseBegin { req, phase } => {
                let e = phase_ends(req, phase);
                let (figures, from) = phase_args(&analysis.requests[req as usize], phase);
                let args: Vec<Arg> = figures.iter().map(|(n, v)| Arg::f64(n, *v)).chain(from.as_deref().map(|s| Arg::str("interference_from", s))).collect();
                w.begin(ts, request_tracks[req as usize], &Event::named(phase.name()).args(&args).flows(&e.start).terminating_flows(&e.end))?;
            }
            Item::KvBegin { req, ns } => {
                let args = [Arg::f64("kv_transfer_ms", ns as f64 / 1e6)];
                w.begin(ts, request_tracks[req as usize], &Event::named(Phase::KvTransfer.name()).args(&args))?;
            }
            Item::Chunk { req } => {
                w.instant(ts, request_tracks[req as usize], &Event::named(names::CHUNK))?;
            }
            Item::End { track } => w.end(ts, track)?,
            Item::Level { which, delta } => level_now[which as usize] += delta as i64,
            Item::DropFinal => {
                for (name, v) in &analysis.drops {
                    raw.drop_value(w, name, ts, *v)?;
                }
            }
        }
    }
    for (l, t) in level_tracks.iter().enumerate() {
        if let Some(t) = *t {
            if level_shown[l] != Some(level_now[l]) {
                w.counter(cur_ts, t, level_now[l])?;
            }
        }
    }
    stats.add_raw(&raw.stats, raw.draws_gpu_flows());
    Ok(())
}

/// A phase slice's figures, as the report gives them: the phase's
/// `phases_ms` value (queue and prefill without the KV transfer nested in
/// them), and for prefill/decode the request's GPU share and step compute,
/// for decode its interference (and the ids of the requests that caused it).
/// The strings the metadata instant's args borrow (see [`meta_args`]).
struct MetaStrings {
    pids: String,
    command: String,
    missing_tracepoints: String,
    drop_names: Vec<String>,
}

impl MetaStrings {
    fn of(meta: &Meta, drops: &std::collections::BTreeMap<String, u64>) -> Self {
        MetaStrings {
            pids: meta.pids.iter().map(u32::to_string).collect::<Vec<_>>().join(","),
            command: meta.command.join(" "),
            missing_tracepoints: meta.missing_tracepoints.join(","),
            drop_names: drops.keys().map(|k| format!("drops.{k}")).collect(),
        }
    }
}

/// The recording-metadata instant's args, in both layouts: the recording's
/// metadata, request and chain counts, the read error, every drop counter,
/// and what the trace itself left out (see [`TraceStats`]).
fn meta_args<'a>(meta: &'a Meta, strings: &'a MetaStrings, requests: u64, chains: u64, read_error: Option<&'a str>, drops: &std::collections::BTreeMap<String, u64>, stats: &TraceStats) -> Vec<Arg<'a>> {
    let mut a = vec![
        Arg::u64("format_version", meta.format_version as u64),
        Arg::str("hopscope_version", &meta.hopscope_version),
        Arg::u64("created_unix_s", meta.created_unix_s),
        Arg::u64("start_ns", meta.start_ns),
        Arg::str("pids", &strings.pids),
        Arg::str("command", &strings.command),
        Arg::str("kernel", &meta.kernel),
        Arg::str("hostname", &meta.hostname),
        Arg::str("chain_header", &meta.chain_header),
        Arg::u64("capture_len", meta.capture_len as u64),
        Arg::u64("capture_len_unix", u64::from(meta.capture_len_unix)),
        Arg::u64("capture_tail_unix", u64::from(meta.capture_tail_unix)),
        Arg::u64("capture_tail", u64::from(meta.capture_tail)),
        Arg::bool("capture_payload", meta.capture_payload),
        Arg::bool("gpu", meta.gpu),
        Arg::u64("requests", requests),
        Arg::u64("chains", chains),
    ];
    // Only when something was: a trace's metadata lists what it lacks.
    if !strings.missing_tracepoints.is_empty() {
        a.push(Arg::str("missing_tracepoints", &strings.missing_tracepoints));
    }
    if let Some(e) = read_error {
        a.push(Arg::str("read_error", e));
    }
    for (v, n) in drops.values().zip(&strings.drop_names) {
        a.push(Arg::dynamic(n, Value::U64(*v)));
    }
    a.extend([
        Arg::u64("trace.offcpu_skipped", stats.offcpu_skipped),
        Arg::u64("trace.gpu_skipped", stats.gpu_skipped),
        Arg::u64("trace.steps_skipped", stats.steps_skipped),
        Arg::u64("trace.counter_values_skipped", stats.counter_values_skipped),
        Arg::u64("trace.flows_capped", stats.flows_capped),
        Arg::u64("trace.flows_unmapped", stats.flows_unmapped),
        Arg::u64("trace.flows_unlinked", stats.flows_unlinked),
        Arg::u64("trace.gpu_steps_skipped", stats.gpu_steps_skipped),
    ]);
    a
}

fn phase_args(r: &Request, phase: Phase) -> (Few<(&'static str, f64), 5>, Option<String>) {
    if !phase.has_figures() {
        return (Few::new(("", 0.0)), None);
    }
    let (out, from) = Figures::of(r);
    let from = from.filter(|_| phase == Phase::Decode);
    (phase_figures(&out, phase), from)
}

/// The report's figures a request's slices show, copied out of its
/// [`RequestRef`](crate::sink::report::RequestRef) (the report's own
/// computation, so the trace and the report agree) without the strings a
/// whole `RequestOut` would copy.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Figures {
    prompt_tokens: Option<u64>,
    completion_tokens: Option<u64>,
    cached_tokens: Option<u64>,
    phases_ms: crate::sink::report::Phases,
    gpu_ms: crate::sink::report::GpuMs,
    interference_ms: Option<f64>,
    compute_ms: Option<crate::sink::report::ComputeMs>,
    compute_source: Option<&'static str>,
    gpu_steps: Option<u32>,
    last_output_ms: Option<f64>,
    first_output_held_ms: Option<f64>,
    tokens_before_first_content: Option<u64>,
    scheduler_queue_ms: Option<f64>,
    scheduler_passed_over_by: Option<u32>,
    scheduler_passed_over_ms: Option<f64>,
    scheduler_grammar_ready_ms: Option<f64>,
}

impl Figures {
    /// The figures, and the ids of the requests whose prefill slowed its
    /// decode, comma-joined (`None` when there are none).
    ///
    /// The report's own figures ([`core_figures`](crate::sink::report::core_figures),
    /// which `request_ref` takes them from too), without the request's
    /// inter-token gaps, their sorted copy and percentiles (two allocations
    /// and a sort, ~2,000 instructions a request) that the trace does not
    /// show.
    fn of(r: &Request) -> (Self, Option<String>) {
        let q = crate::sink::report::core_figures(r);
        let f = Figures {
            prompt_tokens: q.prompt_tokens,
            completion_tokens: q.completion_tokens,
            cached_tokens: q.cached_tokens,
            phases_ms: q.phases_ms,
            gpu_ms: q.gpu_ms,
            interference_ms: q.interference_ms,
            compute_ms: q.compute_ms,
            compute_source: q.compute_source,
            gpu_steps: q.gpu_steps,
            last_output_ms: q.last_output_ms,
            first_output_held_ms: q.first_output_held_ms,
            tokens_before_first_content: q.tokens_before_first_content,
            scheduler_queue_ms: q.scheduler_queue_ms,
            scheduler_passed_over_by: q.scheduler_passed_over_by,
            scheduler_passed_over_ms: q.scheduler_passed_over_ms,
            scheduler_grammar_ready_ms: q.scheduler_grammar_ready_ms,
        };
        (f, (!q.interference_from.is_empty()).then(|| q.interference_from.join(",")))
    }
}

/// [`phase_args`]'s figures, from the request's report figures.
fn phase_figures(out: &Figures, phase: Phase) -> Few<(&'static str, f64), 5> {
    let p = &out.phases_ms;
    let c = out.compute_ms.as_ref();
    let all: &[(&'static str, Option<f64>)] = match phase {
        Phase::Frontend => &[("frontend_ms", p.frontend)],
        // The scheduler's part of the queue, and the last output's path
        // inside decode: figures of their slices, not slices (not phases).
        Phase::Queue => &[("queue_ms", p.queue), ("scheduler_queue_ms", out.scheduler_queue_ms)],
        Phase::Prefill => &[("prefill_ms", p.prefill), ("gpu_prefill_ms", out.gpu_ms.prefill), ("compute_prefill_ms", c.and_then(|c| c.prefill))],
        // The part of it the engine went on decoding while the text was held.
        Phase::FirstOutput => &[("first_output_ms", p.first_output), ("first_output_held_ms", out.first_output_held_ms)],
        Phase::Decode => &[("decode_ms", p.decode), ("gpu_decode_ms", out.gpu_ms.decode), ("compute_decode_ms", c.and_then(|c| c.decode)), ("interference_ms", out.interference_ms), ("last_output_ms", out.last_output_ms)],
        Phase::ReadDelay | Phase::Waiting | Phase::KvTransfer | Phase::SchedulerQueue | Phase::PassedOver | Phase::HeldBack => &[],
    };
    let mut v = Few::new(("", 0.0));
    for &(n, x) in all {
        if let Some(x) = x {
            v.push((n, x));
        }
    }
    v
}

/// Up to `N` items kept inline: a phase slice's few args, without the
/// allocation a `Vec` costs for each of a request's phases.
pub(crate) struct Few<T: Copy, const N: usize> {
    items: [T; N],
    len: usize,
}

impl<T: Copy, const N: usize> Few<T, N> {
    /// Empty; `fill` only stands in the unused places.
    fn new(fill: T) -> Self {
        Few { items: [fill; N], len: 0 }
    }

    /// Adds `t`; callers know their count is at most `N`.
    fn push(&mut self, t: T) {
        self.items[self.len] = t;
        self.len += 1;
    }
}

impl<T: Copy, const N: usize> std::ops::Deref for Few<T, N> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.items[..self.len]
    }
}

/// The span a request's slice covers: from the wire arrival (else the read of
/// its first byte) to the write of its last byte, or to the end of the
/// recording when it never finished.
/// A hop slice's args (kept inline: no allocation per hop).
pub(crate) fn hop_args(r: &Request) -> Few<Arg<'_>, 6> {
    let mut args = Few::new(Arg::bool("", false));
    args.push(Arg::str("id", &r.id));
    args.push(Arg::u64("hop", r.hop as u64));
    if let Some(v) = r.ttft_ms() {
        args.push(Arg::f64("ttft_ms", v));
    }
    if let Some(v) = r.e2e_ms() {
        args.push(Arg::f64("e2e_ms", v));
    }
    if let Some(v) = r.wire_ttft_ms() {
        args.push(Arg::f64("wire_ttft_ms", v));
    }
    if let Some(v) = r.closed_ms() {
        args.push(Arg::f64("closed_ms", v));
    } else if r.done_ns.is_none() {
        args.push(Arg::bool("unfinished", true));
    }
    args
}

/// What a request slice's args borrow: the report's figures for it (so a
/// reader sees the same numbers in the trace and the report) and the strings
/// made for the trace.
pub(crate) struct RequestArgs {
    out: Figures,
    status: Option<String>,
    interference_from: Option<String>,
    /// The report's `kernels`: `name gpu_ms; …`, when it has any.
    kernels: Option<String>,
    /// Where `interference_from` was sent: the request slice and its
    /// decode phase name one interned copy (the list is the largest of a
    /// request's values, ~350 bytes on the bench's recordings).
    from_sent: writer::Shared,
}

impl RequestArgs {
    pub(crate) fn of(r: &Request) -> Self {
        let (out, interference_from) = Figures::of(r);
        let status = r.status.map(|s| {
            let mut t = String::with_capacity(5);
            push_decimal(&mut t, u64::from(s));
            t
        });
        let kernels = r.kernels.as_deref().filter(|k| !k.is_empty()).map(|ks| {
            let mut t = String::new();
            for (i, k) in ks.iter().enumerate() {
                use std::fmt::Write as _;
                let _ = write!(t, "{}{} {:.3} ms", if i > 0 { "; " } else { "" }, k.name, crate::correlate::ms(k.gpu_ns));
            }
            t
        });
        RequestArgs { out, status, interference_from, kernels, from_sent: writer::Shared::new() }
    }

    /// A phase slice's args, as [`phase_args`] gives them, from the figures
    /// held for the request slice (the report's figures are made once per request).
    fn phase_args(&self, phase: Phase) -> Few<Arg<'_>, 6> {
        let mut args = Few::new(Arg::bool("", false));
        if !phase.has_figures() {
            return args;
        }
        for &(n, v) in phase_figures(&self.out, phase).iter() {
            args.push(Arg::f64(n, v));
        }
        if let Some(from) = self.interference_from.as_ref().filter(|_| phase == Phase::Decode) {
            args.push(Arg::shared("interference_from", from, &self.from_sent));
        }
        args
    }

    /// The request slice's args, each only when known.
    pub(crate) fn args<'a>(&'a self, r: &'a Request) -> Vec<Arg<'a>> {
        let out = &self.out;
        let mut args = Vec::with_capacity(32);
        args.push(Arg::str("id", &r.id));
        if let Some(x) = &r.x_request_id {
            args.push(Arg::str("x_request_id", x));
        }
        args.push(Arg::str("chain", &r.chain));
        args.push(Arg::u64("hop", r.hop as u64));
        if let Some(s) = &self.status {
            args.push(Arg::interned("status", s));
        }
        args.push(Arg::interned("method", &r.method));
        args.push(Arg::interned("path", &r.path));
        if let Some(m) = &r.model {
            args.push(Arg::interned("model", m));
        }
        if let Some(v) = out.prompt_tokens {
            args.push(Arg::u64("prompt_tokens", v));
        }
        if let Some(v) = out.completion_tokens {
            args.push(Arg::u64("completion_tokens", v));
        }
        if let Some(v) = out.cached_tokens {
            args.push(Arg::u64("cached_tokens", v));
        }
        let p = &out.phases_ms;
        for (name, v) in [
            ("phases_ms.frontend", p.frontend),
            ("phases_ms.queue", p.queue),
            ("phases_ms.prefill", p.prefill),
            ("phases_ms.kv_transfer", p.kv_transfer),
            ("phases_ms.first_output", p.first_output),
            ("phases_ms.decode", p.decode),
            ("gpu_prefill_ms", out.gpu_ms.prefill),
            ("gpu_decode_ms", out.gpu_ms.decode),
            ("gpu_kv_ms", out.gpu_ms.kv_transfer),
            ("interference_ms", out.interference_ms),
            ("last_output_ms", out.last_output_ms),
            ("first_output_held_ms", out.first_output_held_ms),
            ("scheduler_queue_ms", out.scheduler_queue_ms),
        ] {
            if let Some(v) = v {
                args.push(Arg::f64(name, v));
            }
        }
        if let Some(from) = self.interference_from.as_deref().filter(|f| !f.is_empty()) {
            args.push(Arg::shared("interference_from", from, &self.from_sent));
        }
        if let Some(c) = &out.compute_ms {
            if c.prefill.is_some() || c.decode.is_some() {
                args.push(Arg::f64("compute_ms", c.prefill.unwrap_or(0.0) + c.decode.unwrap_or(0.0)));
            }
        }
        if let Some(s) = &out.compute_source {
            args.push(Arg::str("compute_source", s));
        }
        if let Some(n) = out.tokens_before_first_content {
            args.push(Arg::u64("tokens_before_first_content", n));
        }
        if let Some(n) = r.empty_chunks() {
            args.push(Arg::u64("empty_chunks_before_content", u64::from(n)));
        }
        // How the frontend/queue and queue/prefill boundaries were timed.
        if let Some(e) = r.engine.as_ref() {
            args.push(Arg::str("submit_source", e.submit_source));
            args.push(Arg::str("scheduled_source", e.scheduled_source));
            if let Some(so) = &e.structured {
                args.push(Arg::str("structured_output", so.kind));
                if let Some(b) = &so.backend {
                    args.push(Arg::str("structured_output_backend", b));
                }
            }
            if let Some(p) = e.priority {
                args.push(Arg::i64("priority", p));
            }
        }
        // Only where someone went past it: the evidence that the scheduler
        // skipped it.
        if let (Some(n @ 1..), Some(p)) = (out.scheduler_passed_over_by, out.scheduler_passed_over_ms) {
            args.push(Arg::u64("scheduler_passed_over_by", u64::from(n)));
            args.push(Arg::f64("scheduler_passed_over_ms", p));
        }
        if let Some(r) = out.scheduler_grammar_ready_ms {
            args.push(Arg::f64("scheduler_grammar_ready_ms", r));
        }
        if let Some(n) = out.gpu_steps {
            args.push(Arg::u64("gpu_steps", u64::from(n)));
        }
        if let Some(k) = &self.kernels {
            args.push(Arg::str("kernels", k));
        }
        if let Some(e) = r.engine.as_ref().and_then(|e| e.engine_index) {
            args.push(Arg::u64("engine_index", e));
        }
        args.push(Arg::u64("content_chunks", r.content_ns.len() as u64));
        if let Some(v) = r.ttft_ms() {
            args.push(Arg::f64("ttft_ms", v));
        }
        if let Some(v) = r.e2e_ms() {
            args.push(Arg::f64("e2e_ms", v));
        }
        if let Some(v) = r.read_delay_ms() {
            args.push(Arg::f64("read_delay_ms", v));
        }
        if let Some(f) = r.finish_reason.as_deref() {
            args.push(Arg::interned("finish_reason", f));
        }
        args.push(Arg::u64("pid", r.conn.tgid as u64));
        if let Some(v) = r.closed_ms() {
            args.push(Arg::f64("closed_ms", v));
        } else if r.done_ns.is_none() {
            args.push(Arg::bool("unfinished", true));
        }
        args
    }
}

/// A hop slice's label, as the timeline shows it: `hop 2 · TTFT 20.2 ms ·
/// E2E 133.8 ms` (figures left out when unknown). Unique per hop, so not interned.
pub(crate) fn hop_label(r: &Request) -> String {
    // Room for the longest label: one allocation, not a growth per part.
    let mut name = String::with_capacity(48);
    name.push_str("hop ");
    push_decimal(&mut name, u64::from(r.hop));
    if let Some(v) = r.ttft_ms() {
        name.push_str(" · TTFT ");
        push_one_decimal(&mut name, v);
        name.push_str(" ms");
    }
    match r.e2e_ms() {
        Some(v) => {
            name.push_str(" · E2E ");
            push_one_decimal(&mut name, v);
            name.push_str(" ms");
        }
        None => match r.closed_ms() {
            Some(v) => {
                name.push_str(" · closed after ");
                push_one_decimal(&mut name, v);
                name.push_str(" ms");
            }
            None if r.done_ns.is_none() => name.push_str(" · unfinished"),
            None => {}
        },
    }
    name
}

/// Appends `v` as `format!("{v}")` writes it, without the formatter's
/// machinery (~200 instructions saved per hop label and status code).
fn push_decimal(out: &mut String, mut v: u64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    out.extend(digits[at..].iter().map(|&d| char::from(d)));
}

/// Appends `v` as `format!("{v:.1}")` writes it: the exact binary value
/// rounded to one decimal, an exact half to even. Worked out in integers
/// for the usual figure (finite, from 0 to 2^49): the formatter's general
/// path cost ~900 instructions a figure, two per request (hop labels).
fn push_one_decimal(out: &mut String, v: f64) {
    use std::fmt::Write as _;
    const MANTISSA: u32 = 52;
    let bits = v.to_bits();
    let exp = ((bits >> MANTISSA) & 0x7ff) as i32;
    if bits >> 63 != 0 || exp == 0x7ff || v >= (1u64 << 49) as f64 {
        // Negative (-0.0 included), not finite or huge: the formatter.
        let _ = write!(out, "{v:.1}");
        return;
    }
    // v = m * 2^e exactly (subnormals: no implicit bit, the least exponent).
    let frac = bits & ((1 << MANTISSA) - 1);
    let (m, e) = if exp == 0 { (frac, -1074) } else { (frac | 1 << MANTISSA, exp - 1075) };
    // Tenths: 10 * m * 2^e, rounded; 10 * m < 2^57, and e <= -4 (a normal
    // m is at least 2^52 and v < 2^49).
    let ten = 10 * m;
    let k = e.unsigned_abs();
    let tenths = if k >= 58 {
        // Under half a tenth (10 * m < 2^57 <= 2^(k - 1)).
        0
    } else {
        let q = ten >> k;
        let r = ten & ((1 << k) - 1);
        let half = 1u64 << (k - 1);
        q + u64::from(r > half || (r == half && q & 1 == 1))
    };
    // The whole part, then the tenth.
    push_decimal(out, tenths / 10);
    out.push('.');
    out.push(char::from(b'0' + (tenths % 10) as u8));
}

fn request_span(r: &Request, recording_end: u64) -> (u64, u64) {
    let start = r.wire_arrive_ns.filter(|w| *w <= r.arrive_ns).unwrap_or(r.arrive_ns);
    let end = match r.waited_until_ns() {
        Some(d) => d,
        None => {
            let seen = [Some(r.request_end_ns), r.response_head_ns, r.ttft_ns, r.content_ns.last().copied()];
            seen.into_iter().flatten().fold(recording_end, u64::max)
        }
    };
    (start, end.max(start))
}

/// CUpti_ActivityMemcpyKind as a slice name.
pub(crate) fn memcpy_name(kind: u8) -> &'static str {
    match kind {
        1 => "memcpy HtoD",
        2 => "memcpy DtoH",
        3 => "memcpy HtoA",
        4 => "memcpy AtoH",
        5 => "memcpy AtoA",
        6 => "memcpy AtoD",
        7 => "memcpy DtoA",
        8 => "memcpy DtoD",
        9 => "memcpy HtoH",
        10 => "memcpy PtoP",
        _ => "memcpy",
    }
}

pub(crate) fn state_name(prev_state: u32) -> &'static str {
    // Linux task states at switch-out (include/linux/sched.h).
    match prev_state {
        0 => "preempted",
        1 => "sleeping",
        2 => "uninterruptible",
        _ => "other",
    }
}

/// The engine's request order (what [`Step::members`](crate::correlate::engine::Step)
/// index) mapped to `analysis.requests`: the engine side is replayed over the
/// same records, in the same order, as the correlator saw them, so its
/// first-seen order is the correlator's; each engine request then maps to the
/// HTTP request that carries its id, with whether an output finished it (a
/// finish reason). `None` when the replay does not give the
/// analysis's steps back (then no request→step flow can be trusted).
fn engine_request_map(records: &[Record], analysis: &Analysis) -> Option<Vec<Option<(u32, bool)>>> {
    use crate::correlate::engine::{EngineSide, Woke};
    let mut side = EngineSide::default();
    // Wake-ups only move submit times, never the request order.
    let (woke, senders): (HashMap<u32, Woke>, HashMap<u32, u32>) = Default::default();
    // A step sent to several API servers is one step, as the correlator joins it.
    let mut joiner = crate::correlate::join::StepJoiner::default();
    let mut now = Vec::new();
    for r in records {
        if matches!(r, Record::EngineRequest { .. } | Record::EngineAbort { .. } | Record::EngineOutputs { .. }) {
            joiner.feed(r, &mut now);
            for r in now.drain(..) {
                side.ingest(&r, &woke, &senders);
            }
        }
    }
    joiner.drain(&mut now);
    for r in &now {
        side.ingest(r, &woke, &senders);
    }
    let (reqs, steps, _) = side.finish();
    let same = steps.len() == analysis.steps.len() && steps.iter().zip(&analysis.steps).all(|(a, b)| a.end_ns == b.end_ns && a.members == b.members);
    if !same {
        return None;
    }
    let by_id: HashMap<&str, u32> =
        analysis.requests.iter().enumerate().filter_map(|(i, r)| r.engine.as_ref().map(|e| (e.engine_request_id.as_str(), i as u32))).collect();
    Some(reqs.iter().map(|e| by_id.get(e.request_id.as_str()).map(|&i| (i, e.finish_reason.is_some()))).collect())
}

/// The step whose drawn span `[start, end]` holds `ts` (a kernel's GPU
/// start). `spans` are (start, end, step), sorted by start, not overlapping
/// except at their bounds, where the later step wins.
fn step_at(spans: &[(u64, u64, u32)], ts: u64) -> Option<u32> {
    let i = spans.partition_point(|s| s.0 <= ts);
    let (start, end, k) = *spans.get(i.checked_sub(1)?)?;
    (start <= ts && ts <= end).then_some(k)
}

/// The first [`FLOW_HEAD`] of `steps` and, when `ends` (the last step ended
/// the phase), the last one; and how many were left out.
fn capped(steps: &[u32], ends: bool) -> (Vec<u32>, u64) {
    let head = steps.len().min(FLOW_HEAD);
    let mut v = steps[..head].to_vec();
    if ends && steps.len() > head {
        v.push(steps[steps.len() - 1]);
    }
    let n = v.len();
    (v, (steps.len() - n) as u64)
}

