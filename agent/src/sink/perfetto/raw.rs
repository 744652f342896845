//! The record-driven part of the layout: tracks whose events come straight
//! from records in recording (timestamp) order — off-CPU intervals on thread
//! tracks, GPU work on stream tracks, engine steps, server counters (output
//! tokens/s, KV-cache usage, GPU memory and SM utilisation) and loss
//! counters. It holds one small state per track, never the records, so
//! `record --perfetto` feeds it live ([`super::live`]) and `hopscope trace`
//! feeds it a loaded recording; both write the same tracks.
//!
//! Every track here is on a packet sequence of its own (a thread's off-CPU
//! interval is known only at switch-in, after other tracks' later events;
//! each sequence only has to stay in time order on its own).

use super::writer::{Arg, Event, PerfettoError, TrackId, TrackOpts, TraceWriter};
use super::{memcpy_name, names, proto::CounterUnit, state_name, Ends, FLOW_HEAD};
use crate::event::{Dir, ProcOp};
use crate::correlate::FxMap;
use crate::model::Record;
use std::collections::{HashMap, VecDeque};
use std::io::Write;

/// A step spans from the previous step's end when the engine went straight
/// on (gap up to this); otherwise only its end is known: an instant.
pub const STEP_GAP_NS: u64 = 250_000_000;
/// Output tokens/s: tokens of the steps that ended in the last second.
pub const RATE_WINDOW_NS: u64 = 1_000_000_000;
/// Overlap lanes per GPU stream (work that overlaps the previous item).
pub const GPU_LANES: u32 = 4;

/// What the record-driven part drew and left out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RawStats {
    pub offcpu_slices: u64,
    /// Off-CPU records that could not be drawn: switch-out after switch-in, or
    /// overlapping the thread's previous interval (lost scheduler events).
    pub offcpu_skipped: u64,
    pub gpu_slices: u64,
    /// GPU records not drawn: end before start, start before the trace, or
    /// more overlap on one stream than the overlap lanes hold.
    pub gpu_skipped: u64,
    pub steps: u64,
    /// Steps that ended before the previous one (clock or decode error).
    pub steps_skipped: u64,
    /// Counter samples older than the track's previous one.
    pub counter_values_skipped: u64,
    /// GPU steps (CUPTI step ends) drawn, and those left out: more overlap
    /// than [`GPU_LANES`] lanes hold, or starting before the previous one.
    pub gpu_steps: u64,
    pub gpu_steps_skipped: u64,
    /// Steps drawn from records (live, streamed): request→step flows their
    /// members' requests did not take, as the offline layout counts them —
    /// memberships of requests never drawn (`flows_unmapped`), of steps not
    /// drawn (`flows_capped`) — and flow ids written on steps that no request
    /// slice names (`flows_unlinked`: the request, or its phase, was not drawn).
    pub flows_unmapped: u64,
    pub flows_capped: u64,
    pub flows_unlinked: u64,
    /// Steps drawn from records: engine steps during which kernels were
    /// drawn. Without CUPTI step ends their kernels are theirs by time, a
    /// rule a streamed trace cannot follow (kernels come before their step
    /// is known): they get no flows when no GPU step is in the recording.
    pub gpu_flows_not_drawn: u64,
    /// Steps drawn from records: flows from engine steps to their GPU steps,
    /// and from GPU steps to their first kernel and end copy
    /// ([`GpuMarks`]). The whole layout counts its own (`plan_flows`).
    pub gpu_step_flows: u64,
    pub kernel_flows: u64,
}

/// A request's place in the steps drawn from records (live and streamed
/// layouts): whether it got its first token, how many of its prefill and
/// decode steps were drawn, and which of them carry a flow to its prefill or
/// decode slice: the first [`FLOW_HEAD`] and the last (the first token's
/// step; the finishing output's), flow ids `base + slot`, slot
/// `phase × (FLOW_HEAD + 1) + k`. The request part takes it when it draws
/// the request ([`RawLayout::take_step_flows`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReqSteps {
    got_token: bool,
    finished: bool,
    /// Steps drawn: [prefill (up to and with the first token's), decode].
    pub drawn: [u32; 2],
    base: u64,
    mask: u16,
    /// The last drawn step it was in (for forgetting it).
    last_ns: u64,
}

/// Flow slots per phase: the first [`FLOW_HEAD`] steps and the last.
const SLOTS: usize = FLOW_HEAD + 1;

impl ReqSteps {
    fn phase_mask(&self, decode: bool) -> u16 {
        let m = (1u16 << SLOTS) - 1;
        if decode {
            self.mask >> SLOTS & m
        } else {
            self.mask & m
        }
    }

    /// The flow ids its prefill (or decode) steps carry, in step order.
    pub fn ids(&self, decode: bool) -> impl Iterator<Item = u64> + '_ {
        let m = self.phase_mask(decode);
        let first = if decode { SLOTS as u64 } else { 0 };
        (0..SLOTS as u64).filter(move |k| m >> k & 1 == 1).map(move |k| self.base + first + k)
    }

    /// How many flow ids its prefill (or decode) steps carry.
    pub fn count(&self, decode: bool) -> u64 {
        u64::from(self.phase_mask(decode).count_ones())
    }

    /// Forgets its prefill (or decode) flows: its slice is not drawn.
    pub fn drop_phase(&mut self, decode: bool) {
        let m = ((1u16 << SLOTS) - 1) << if decode { SLOTS } else { 0 };
        self.mask &= !m;
    }
}

/// Streamed `hopscope trace`: a request is handed out at most this long after
/// its last step (the correlator's settling, its wire clusters and its wait
/// for the open requests before it, [`crate::correlate::MAX_OPEN_NS`]); the
/// steps' flow ids of requests not taken by then are let go.
pub const STEP_FLOWS_KEEP_NS: u64 = crate::correlate::MAX_OPEN_NS + crate::correlate::SETTLE_NS + crate::correlate::wire_steps::MAX_CLUSTER_NS + 10_000_000_000;

/// Live traces (`record --perfetto`) draw requests at the stop: the requests
/// whose step flows are kept until then, at most (the oldest half are let go
/// when there are more; ~100 bytes each).
pub const LIVE_STEP_FLOW_REQUESTS: usize = 1 << 18;

/// The lane of the "GPU steps" tracks each GPU step is drawn on (None: not
/// drawn), and its drawn span. With async scheduling the host waits for a
/// step after it launched the next one, so a step's end (the sync's return)
/// may follow the next one's start: such steps go to overlap lanes. Each
/// engine (data parallelism: engines step on their own clocks) has its own
/// lanes: lane `n` of the `k`-th engine to have a step is
/// `k * GPU_LANES + n` ([`GpuStepLanes::track_name`]). Run by the offline
/// layout ahead of drawing too, so only drawn steps get flows.
pub fn gpu_step_lanes(steps: &[crate::correlate::gpu::GpuStep], t0: u64) -> Vec<Option<(u32, u64, u64)>> {
    let mut lanes = GpuStepLanes::default();
    steps.iter().map(|g| lanes.place(g, t0)).collect()
}

/// [`gpu_step_lanes`] one step at a time: a streamed trace draws GPU steps
/// as the correlator decides them, not all at its end.
#[derive(Default)]
pub struct GpuStepLanes {
    /// Per engine, in the order of their first step.
    engines: Vec<(Option<u32>, EngineLanes)>,
}

#[derive(Default)]
struct EngineLanes {
    free_at: Vec<u64>,
    last_start: u64,
}

impl GpuStepLanes {
    pub fn place(&mut self, g: &crate::correlate::gpu::GpuStep, t0: u64) -> Option<(u32, u64, u64)> {
        let k = crate::correlate::slot(&mut self.engines, g.engine);
        let lanes = &mut self.engines[k].1;
        let start = g.start_ns.max(t0);
        let end = g.end_ns.max(start);
        if start < lanes.last_start {
            return None;
        }
        lanes.last_start = start;
        let lane = match lanes.free_at.iter().position(|f| *f <= start) {
            Some(l) => l,
            None if lanes.free_at.len() < GPU_LANES as usize => {
                lanes.free_at.push(0);
                lanes.free_at.len() - 1
            }
            None => return None,
        };
        lanes.free_at[lane] = end;
        Some((k as u32 * GPU_LANES + lane as u32, start, end))
    }

    /// The name of lane `lane` ([`Self::place`]'s): the first engine's
    /// lanes are "GPU steps" (what a recording with one engine shows),
    /// every other engine's name its pid.
    pub fn track_name(&self, lane: u32) -> String {
        let (k, n) = ((lane / GPU_LANES) as usize, lane % GPU_LANES);
        let mut parts = Vec::new();
        if k > 0 {
            parts.push(self.engines.get(k).and_then(|e| e.0).map_or_else(|| "no engine".to_owned(), |pid| format!("engine {pid}")));
        }
        if n > 0 {
            parts.push(format!("overlap {n}"));
        }
        if parts.is_empty() {
            names::GPU_STEPS.to_owned()
        } else {
            format!("{} ({})", names::GPU_STEPS, parts.join(", "))
        }
    }
}

/// Which overlap lane of its stream each GPU item goes to: the first lane
/// free at its start. Deterministic, so the offline layout can run it ahead
/// of drawing to know which kernels get slices (and flows).
#[derive(Default)]
pub struct Lanes {
    /// Per (pid, device, stream): when each lane is free (None: never used).
    free_at: FxMap<(u32, u32, u32), [Option<u64>; GPU_LANES as usize]>,
}

impl Lanes {
    /// The lane for an item on (pid, device, stream) from `ts` to `end`, or
    /// None when every lane is still busy.
    pub fn place(&mut self, key: (u32, u32, u32), ts: u64, end: u64) -> Option<u32> {
        let lanes = self.free_at.entry(key).or_default();
        let lane = lanes.iter().position(|f| f.is_none_or(|free| free <= ts))?;
        lanes[lane] = Some(end);
        Some(lane as u32)
    }
}

/// The GPU item a record is: (start, end, pid, device, stream).
pub fn gpu_item(rec: &Record) -> Option<(u64, u64, u32, u32, u32)> {
    match rec {
        Record::GpuKernel { ts_ns, end_ns, pid, device, stream, .. }
        | Record::GpuMemcpy { ts_ns, end_ns, pid, device, stream, .. }
        | Record::GpuMemset { ts_ns, end_ns, pid, device, stream, .. } => Some((*ts_ns, *end_ns, *pid, *device, *stream)),
        _ => None,
    }
}

/// What a GPU record is to the GPU steps' flows ([`GpuMarks`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuMark {
    /// A copy that may end a step ([`crate::correlate::gpu::is_step_copy`]).
    StepCopy,
    /// The first drawn kernel of its process to start after one of its
    /// step copies ended.
    FirstKernel,
}

/// Step copies a process may have pending (ends no drawn kernel has passed):
/// past this the latest are forgotten (a process that copies but runs no
/// kernels), which only costs flows.
const PENDING_COPIES_MAX: usize = 64;

/// The rule GPU steps' flows follow in every layout: a GPU step flows, on
/// each of its processes (ranks), to its end copy and to the first kernel
/// that process started after its previous step's end copy finished, when
/// that kernel lies in the step (a process's first step has no such copy
/// before it: only its end copy; marking every process's first kernel would
/// leave ids no step names in recordings without step copies).
/// Both are known as the record is drawn — the recording is in start order,
/// so a copy is read before anything that starts after it ends — while the
/// correlator decides the step only a sync later: a streamed trace marks the
/// candidates as it draws them, with flow ids the GPU step names when it
/// comes; copies that turn out to end no step are candidates too (their ids
/// are counted unlinked). The whole layout runs the same marks ahead of
/// drawing, so both draw the same flows.
#[derive(Default)]
pub struct GpuMarks {
    procs: FxMap<u32, MarkState>,
    /// A step copy was seen: engine steps may get a GPU step.
    pub step_copies: bool,
}

#[derive(Default)]
struct MarkState {
    /// Ends of step copies no drawn kernel has started after yet.
    pending: Vec<u64>,
}

impl GpuMarks {
    /// Marks `rec` (in recording order, every GPU record: `drawn` says
    /// whether it got a slice; only drawn ones are marked, but every step
    /// copy ends a stretch).
    pub fn mark(&mut self, rec: &Record, drawn: bool) -> Option<GpuMark> {
        match rec {
            Record::GpuMemcpy { ts_ns, end_ns, pid, kind, dst_kind, bytes, .. } if crate::correlate::gpu::is_step_copy(*kind, *dst_kind, *bytes) => {
                // What the correlator cannot place cannot end its steps.
                if *ts_ns == 0 || end_ns < ts_ns {
                    return None;
                }
                self.step_copies = true;
                let p = self.procs.entry(*pid).or_default();
                if p.pending.len() < PENDING_COPIES_MAX {
                    p.pending.push(*end_ns);
                }
                drawn.then_some(GpuMark::StepCopy)
            }
            Record::GpuKernel { ts_ns, pid, .. } if drawn => {
                let p = self.procs.get_mut(pid)?;
                let first = p.pending.iter().any(|e| e < ts_ns);
                p.pending.retain(|e| e >= ts_ns);
                first.then_some(GpuMark::FirstKernel)
            }
            _ => None,
        }
    }
}

/// One process's marked records ([`GpuMarks`]) not yet taken by a GPU step,
/// in order: first kernels by start, step copies by end; `T` is what the
/// layout keeps of each (a flow id, a record's index).
#[derive(Debug)]
pub struct RankEnds<T> {
    firsts: VecDeque<(u64, T)>,
    copies: VecDeque<(u64, T)>,
}

impl<T> Default for RankEnds<T> {
    fn default() -> Self {
        RankEnds { firsts: VecDeque::new(), copies: VecDeque::new() }
    }
}

impl<T: Copy> RankEnds<T> {
    pub fn push(&mut self, mark: GpuMark, start: u64, end: u64, t: T) {
        match mark {
            GpuMark::FirstKernel => self.firsts.push_back((start, t)),
            GpuMark::StepCopy => {
                // Copies on several streams may end out of order.
                let at = self.copies.iter().rposition(|c| c.0 <= end).map_or(0, |i| i + 1);
                self.copies.insert(at, (end, t));
            }
        }
    }

    /// The ends of this process's step that `start`s and ends (its end copy
    /// finishes) at `end`, its previous one having ended at `prev`: its first
    /// kernel and its end copy. Marks before it are let go: returned too.
    pub fn take(&mut self, prev: Option<u64>, start: u64, end: u64, gone: &mut Vec<T>) -> (Option<T>, Option<T>) {
        while let Some(&(_, t)) = self.firsts.front().filter(|f| prev.is_some_and(|p| f.0 <= p)) {
            gone.push(t);
            self.firsts.pop_front();
        }
        let first = match self.firsts.front() {
            Some(&(ts, t)) if start <= ts && ts <= end => {
                self.firsts.pop_front();
                Some(t)
            }
            _ => None,
        };
        while let Some(&(_, t)) = self.copies.front().filter(|c| c.0 < end) {
            gone.push(t);
            self.copies.pop_front();
        }
        let copy = match self.copies.front() {
            Some(&(e, t)) if e == end => {
                self.copies.pop_front();
                Some(t)
            }
            _ => None,
        };
        (first, copy)
    }

    /// Lets go of marks before `cut` (their start, a copy's end).
    fn let_go_before(&mut self, cut: u64, gone: &mut u64) {
        for q in [&mut self.firsts, &mut self.copies] {
            while q.front().is_some_and(|f| f.0 < cut) {
                q.pop_front();
                *gone += 1;
            }
        }
    }

    /// Lets go of the older half of its marks (a live trace's cap).
    fn let_go_half(&mut self, gone: &mut u64) {
        for q in [&mut self.firsts, &mut self.copies] {
            let n = q.len() / 2;
            q.drain(..n);
            *gone += n as u64;
        }
    }

    fn len(&self) -> usize {
        self.firsts.len() + self.copies.len()
    }
}

/// Streamed `hopscope trace`: a GPU step is handed out at most this long
/// after its records (the correlator's longest wait for a step end, its
/// match wait and a step's lag behind its output, a drain tick, slack); the
/// flow ids of marks and engine steps not taken by then are let go.
pub const GPU_FLOWS_KEEP_NS: u64 = crate::correlate::gpu::MAX_STEP_NS + crate::correlate::gpu::MATCH_WAIT_NS + crate::correlate::gpu::IPC_AFTER_GPU_MAX_NS + 10_000_000_000;

/// Live traces draw GPU steps at the stop: marks and engine steps kept for
/// them, at most this many per process and for the engine steps (the oldest
/// half let go past it; 16 bytes each).
pub const LIVE_GPU_FLOW_MARKS: usize = 1 << 18;

/// The ids live and streamed traces put on GPU work and engine steps for
/// the GPU steps to name.
#[derive(Default)]
struct GpuFlowIds {
    /// Per process: its marks' flow ids.
    procs: FxMap<u32, RankEnds<u64>>,
    /// Per process: the end of its latest GPU step handed to the layout.
    prev_end: FxMap<u32, u64>,
    /// Engine steps drawn with an id for their GPU step: (end, id).
    engine: VecDeque<(u64, u64)>,
    pruned_at: u64,
}

/// Where step slices go: (start, end, slice?) from a step's end, or None when
/// it ended before the previous one of its engine (data parallelism:
/// engines step on their own clocks).
#[derive(Default)]
pub struct StepClock {
    /// Per engine index: its previous step's end.
    prev: Vec<(u64, Option<u64>)>,
}

impl StepClock {
    pub fn next(&mut self, engine: u64, end: u64) -> Option<(u64, bool)> {
        let k = crate::correlate::slot(&mut self.prev, engine);
        let prev = &mut self.prev[k].1;
        let span = match *prev {
            Some(p) if end < p => return None,
            Some(p) if p < end && end - p <= STEP_GAP_NS => (p, true),
            _ => (end, false),
        };
        *prev = Some(end);
        Some(span)
    }
}

/// A process's best name: its comm from exec, else exit, else fork.
#[derive(Default)]
pub struct ProcessNames {
    best: HashMap<u32, (u8, String)>,
}

impl ProcessNames {
    pub fn note(&mut self, rec: &Record) {
        if let Record::Proc { op, child_tgid, comm, .. } = rec {
            if comm.is_empty() {
                return;
            }
            let rank = match op {
                ProcOp::Fork => 1,
                ProcOp::Exit => 2,
                ProcOp::Exec => 3,
            };
            let e = self.best.entry(*child_tgid).or_insert((rank, comm.clone()));
            if rank >= e.0 {
                *e = (rank, comm.clone());
            }
        }
    }

    pub fn get(&self, pid: u32) -> String {
        self.best.get(&pid).map_or_else(|| format!("pid {pid}"), |(_, c)| c.clone())
    }

    /// [`get`](Self::get) without a copy when the name is known.
    fn get_cow(&self, pid: u32) -> std::borrow::Cow<'_, str> {
        match self.best.get(&pid) {
            Some((_, c)) => std::borrow::Cow::Borrowed(c),
            None => std::borrow::Cow::Owned(format!("pid {pid}")),
        }
    }
}

/// One engine step to draw.
pub struct StepInfo {
    /// The engine index (data-parallel rank) that ran it.
    pub engine: u64,
    pub index: u64,
    pub end_ns: u64,
    pub sent_ns: u64,
    pub requests: u64,
    pub new_tokens: u64,
    pub first_tokens: u64,
}

/// The record-driven layout's state.
pub struct RawLayout {
    t0: u64,
    pub names: ProcessNames,
    /// Draw steps from EngineOutputs records as they come (live); otherwise
    /// the caller passes them to [`RawLayout::step`].
    steps_from_records: bool,
    pub stats: RawStats,
    thread_free_at: FxMap<(u32, u32), u64>,
    lanes: Lanes,
    lane_tracks: FxMap<(u32, u32, u32, u32), TrackId>,
    /// Per engine index, in the order of their first step.
    steps_tracks: Vec<(u64, TrackId)>,
    gpu_step_tracks: FxMap<u32, TrackId>,
    gpu_step_lanes: GpuStepLanes,
    step_clock: StepClock,
    /// Live steps: the direction steps come from (the engine's writes win
    /// once one is seen); each engine request's place in them, by its id.
    step_dir: Option<Dir>,
    step_reqs: HashMap<String, ReqSteps, std::hash::BuildHasherDefault<IdHasher>>,
    /// Streamed (one pass): requests not in a step for this long are let go;
    /// None (live): up to [`LIVE_STEP_FLOW_REQUESTS`] are kept.
    step_reqs_keep: Option<u64>,
    /// Live: the most requests kept ([`LIVE_STEP_FLOW_REQUESTS`]).
    step_reqs_cap: usize,
    step_reqs_pruned_at: u64,
    /// A step's flow ids, reused from step to step.
    step_ids: Vec<u64>,
    /// Kernels were drawn since the last step (live steps).
    kernels_since_step: bool,
    /// Steps drawn from records: the GPU steps' flow marks and their ids
    /// until the GPU steps name them.
    marks: GpuMarks,
    gpu_ids: GpuFlowIds,
    shapes: Shapes,
    /// Live: the most GPU flow ids kept per process and for engine steps
    /// ([`LIVE_GPU_FLOW_MARKS`]).
    gpu_ids_cap: usize,
    rate: VecDeque<(u64, u64)>,
    rate_sum: u64,
    rate_track: Option<TrackId>,
    server: Option<TrackId>,
    kv_tracks: HashMap<Option<u64>, TrackId>,
    /// GPU counter tracks by (device, name).
    dev_tracks: HashMap<(u32, &'static str), TrackId>,
    proc_mem_tracks: HashMap<(u32, u32), TrackId>,
    /// Loss counters with a track: the track and the value last drawn.
    pub drop_tracks: HashMap<String, (TrackId, u64)>,
    meta_track: Option<TrackId>,
}

impl RawLayout {
    pub fn new(t0: u64, steps_from_records: bool) -> Self {
        RawLayout {
            t0,
            names: ProcessNames::default(),
            steps_from_records,
            stats: RawStats::default(),
            thread_free_at: FxMap::default(),
            lanes: Lanes::default(),
            lane_tracks: FxMap::default(),
            steps_tracks: Vec::new(),
            gpu_step_tracks: FxMap::default(),
            gpu_step_lanes: GpuStepLanes::default(),
            step_clock: StepClock::default(),
            step_dir: None,
            step_reqs: HashMap::default(),
            step_reqs_keep: None,
            step_reqs_cap: LIVE_STEP_FLOW_REQUESTS,
            step_reqs_pruned_at: 0,
            step_ids: Vec::new(),
            kernels_since_step: false,
            marks: GpuMarks::default(),
            gpu_ids: GpuFlowIds::default(),
            shapes: Shapes::default(),
            gpu_ids_cap: LIVE_GPU_FLOW_MARKS,
            rate: VecDeque::new(),
            rate_sum: 0,
            rate_track: None,
            server: None,
            kv_tracks: HashMap::new(),
            dev_tracks: HashMap::new(),
            proc_mem_tracks: HashMap::new(),
            drop_tracks: HashMap::new(),
            meta_track: None,
        }
    }

    /// The "hopscope" root track (metadata instant, loss counters).
    pub fn meta_track<W: Write>(&mut self, w: &mut TraceWriter<W>) -> TrackId {
        *self.meta_track.get_or_insert_with(|| w.track(names::META_TRACK, TrackOpts { rank: Some(0), ..TrackOpts::default() }))
    }

    /// The "Server" group of counters.
    pub fn server<W: Write>(&mut self, w: &mut TraceWriter<W>) -> TrackId {
        *self.server.get_or_insert_with(|| w.track(names::SERVER, TrackOpts { rank: Some(4), ..TrackOpts::default() }))
    }

    pub fn process<W: Write>(&mut self, w: &mut TraceWriter<W>, pid: u32) -> TrackId {
        match w.known_process(pid) {
            Some(t) => t,
            None => w.process_track(pid, &self.names.get_cow(pid)),
        }
    }

    /// GPU `device`'s counter track `name` (under the server), made on first use.
    fn device_track<W: Write>(&mut self, w: &mut TraceWriter<W>, device: u32, name: &'static str, unit: CounterUnit) -> TrackId {
        if let Some(t) = self.dev_tracks.get(&(device, name)) {
            return *t;
        }
        let g = self.server(w);
        let t = self.counter_track(w, &format!("GPU {device} {name}"), unit, g);
        self.dev_tracks.insert((device, name), t);
        t
    }

    fn counter_track<W: Write>(&mut self, w: &mut TraceWriter<W>, name: &str, unit: CounterUnit, parent: TrackId) -> TrackId {
        w.counter_track(name, unit, TrackOpts { parent: Some(parent), own_sequence: true, ..TrackOpts::default() })
    }

    fn value<W: Write>(&mut self, w: &mut TraceWriter<W>, track: TrackId, ts: u64, v: CounterValue) -> Result<(), PerfettoError> {
        if !w.in_order(track, ts) {
            self.stats.counter_values_skipped += 1;
            return Ok(());
        }
        match v {
            CounterValue::Int(v) => w.counter(ts, track, v),
            CounterValue::Float(v) => w.counter_f64(ts, track, v),
        }
    }

    /// Whether [`push`](Self::push) does anything with `rec`: most records
    /// (HTTP, IPC) it does not, and this one test of the variant (a bit
    /// mask) is cheaper for them than the call and its jump table.
    #[inline]
    pub fn uses(rec: &Record) -> bool {
        matches!(
            rec,
            Record::Proc { .. }
                | Record::OffCpu { .. }
                | Record::GpuKernel { .. }
                | Record::GpuMemcpy { .. }
                | Record::GpuMemset { .. }
                | Record::EngineOutputs { .. }
                | Record::EngineStats { .. }
                | Record::GpuSample { .. }
                | Record::Drops { .. }
        )
    }

    /// Draws what `rec` shows. `flows`: the flow ends of the record's slice
    /// (offline only: kernels to their step).
    pub fn push<W: Write>(&mut self, w: &mut TraceWriter<W>, rec: &Record, flows: Option<&Ends>) -> Result<(), PerfettoError> {
        match rec {
            Record::Proc { .. } => self.names.note(rec),
            Record::OffCpu { ts_ns, tgid, tid, off_ns, wake_ns, prev_state } => {
                let free_at = self.thread_free_at.get(&(*tgid, *tid)).copied().unwrap_or(0);
                if off_ns > ts_ns || *off_ns < free_at {
                    self.stats.offcpu_skipped += 1;
                    return Ok(());
                }
                self.thread_free_at.insert((*tgid, *tid), *ts_ns);
                // Switched out before the trace began: drawn from its start.
                let off = (*off_ns).max(self.t0);
                let on = (*ts_ns).max(off);
                self.process(w, *tgid);
                let track = match w.known_thread(*tgid, *tid) {
                    Some(t) => t,
                    None => {
                        let name = (tid == tgid).then(|| self.names.get_cow(*tgid));
                        w.thread_track(*tgid, *tid, name.as_deref(), true)
                    }
                };
                let wake = wake_ns.filter(|wk| (*off_ns..=*ts_ns).contains(wk));
                let args = [
                    Arg::interned("state", state_name(*prev_state)),
                    Arg::u64("prev_state", *prev_state as u64),
                    Arg::f64("runq_delay_ms", wake.map_or(0.0, |wk| (ts_ns - wk) as f64 / 1e6)),
                ];
                let args = if wake.is_some() { &args[..] } else { &args[..2] };
                w.begin(off, track, &Event::named(names::OFF_CPU).args(args))?;
                if let Some(wk) = wake {
                    w.begin(wk.max(off), track, &Event::named(names::RUN_QUEUE))?;
                    w.end(on, track)?;
                }
                w.end(on, track)?;
                self.stats.offcpu_slices += 1;
            }
            Record::GpuKernel { .. } | Record::GpuMemcpy { .. } | Record::GpuMemset { .. } => self.gpu(w, rec, flows)?,
            Record::EngineOutputs { ts_ns, dir, timestamp_s, outputs, engine_index, .. } if self.steps_from_records => {
                // The engine's own writes when traced, else the frontend's reads.
                match (self.step_dir, dir) {
                    (Some(Dir::Out), Dir::In) => return Ok(()),
                    _ => self.step_dir = Some(*dir),
                }
                // The correlator's end: its GPU step is matched by it.
                let end_ns = crate::correlate::oncpu::step_end_of(*ts_ns, *timestamp_s);
                let engine = engine_index.unwrap_or(0);
                let span = self.step_clock.next(engine, end_ns);
                let mut firsts = 0;
                let mut ids = std::mem::take(&mut self.step_ids);
                ids.clear();
                for o in outputs {
                    // Looked up before copying: most outputs are of requests already decoding.
                    let e = match self.step_reqs.get_mut(o.request_id.as_str()) {
                        Some(e) => e,
                        None => self.step_reqs.entry(o.request_id.clone()).or_insert(ReqSteps { base: w.new_flow_ids(2 * SLOTS as u64), ..ReqSteps::default() }),
                    };
                    if e.finished {
                        // Its id again after it finished: another request.
                        self.stats.flows_unmapped += u64::from(e.drawn[0] + e.drawn[1]);
                        self.stats.flows_unlinked += e.count(false) + e.count(true);
                        *e = ReqSteps { base: w.new_flow_ids(2 * SLOTS as u64), ..ReqSteps::default() };
                    }
                    let first = !e.got_token && o.new_tokens > 0;
                    let phase = usize::from(e.got_token);
                    if first {
                        e.got_token = true;
                        firsts += 1;
                    }
                    e.finished = o.finish_reason.is_some();
                    e.last_ns = end_ns;
                    if span.is_none() {
                        self.stats.flows_capped += 1;
                        continue;
                    }
                    // The step that ends the phase: the first token's, the finishing one.
                    let last = if phase == 0 { first } else { e.finished };
                    let n = e.drawn[phase] as usize;
                    e.drawn[phase] += 1;
                    let slot = if n < FLOW_HEAD { Some(n) } else { last.then_some(FLOW_HEAD) };
                    if let Some(k) = slot {
                        let slot = phase * SLOTS + k;
                        e.mask |= 1 << slot;
                        ids.push(e.base + slot as u64);
                    }
                }
                let info = StepInfo {
                    engine,
                    index: self.stats.steps + self.stats.steps_skipped,
                    end_ns,
                    sent_ns: *ts_ns,
                    requests: outputs.len() as u64,
                    new_tokens: outputs.iter().map(|o| o.new_tokens).sum(),
                    first_tokens: firsts,
                };
                let r = match span {
                    Some(span) => {
                        if std::mem::take(&mut self.kernels_since_step) {
                            self.stats.gpu_flows_not_drawn += 1;
                        }
                        if self.marks.step_copies {
                            // Its GPU step names this id when the correlator matches them.
                            let id = w.new_flow_id();
                            ids.push(id);
                            self.gpu_ids.engine.push_back((end_ns, id));
                        }
                        self.draw_step(w, &info, span, &ids, &[])
                    }
                    None => {
                        self.stats.steps_skipped += 1;
                        Ok(())
                    }
                };
                self.step_ids = ids;
                r?;
                self.prune_step_reqs(end_ns);
                self.prune_gpu_ids(end_ns);
            }
            Record::EngineStats { ts_ns, engine_index, kv_cache_usage: Some(u), .. } => {
                let t = match self.kv_tracks.get(engine_index) {
                    Some(t) => *t,
                    None => {
                        let g = self.server(w);
                        let name = match engine_index {
                            Some(e) if *e > 0 => format!("{} (engine {e})", names::KV_CACHE),
                            _ => names::KV_CACHE.to_owned(),
                        };
                        let t = self.counter_track(w, &name, CounterUnit::Unspecified, g);
                        self.kv_tracks.insert(*engine_index, t);
                        t
                    }
                };
                self.value(w, t, (*ts_ns).max(self.t0), CounterValue::Float(u * 100.0))?;
            }
            Record::GpuSample { ts_ns, device, mem_used_bytes, process_mem, sm_util_pct, mem_util_pct, pcie_tx_kib_s, pcie_rx_kib_s, nvlink_tx_kib_s, nvlink_rx_kib_s, .. } => {
                let ts = (*ts_ns).max(self.t0);
                let mem = self.device_track(w, *device, names::GPU_MEM, CounterUnit::SizeBytes);
                self.value(w, mem, ts, CounterValue::Int(i64::try_from(*mem_used_bytes).unwrap_or(i64::MAX)))?;
                // A figure NVML does not give on this GPU gets no track (not a line at 0).
                let figures = [
                    (names::SM_UTIL, sm_util_pct.map(u64::from)),
                    (names::MEM_UTIL, mem_util_pct.map(u64::from)),
                    (names::PCIE_TX, pcie_tx_kib_s.map(u64::from)),
                    (names::PCIE_RX, pcie_rx_kib_s.map(u64::from)),
                    (names::NVLINK_TX, *nvlink_tx_kib_s),
                    (names::NVLINK_RX, *nvlink_rx_kib_s),
                ];
                for (name, v) in figures {
                    if let Some(v) = v {
                        let t = self.device_track(w, *device, name, CounterUnit::Unspecified);
                        self.value(w, t, ts, CounterValue::Int(i64::try_from(v).unwrap_or(i64::MAX)))?;
                    }
                }
                for (pid, bytes) in process_mem {
                    let t = match self.proc_mem_tracks.get(&(*pid, *device)) {
                        Some(t) => *t,
                        None => {
                            let parent = self.process(w, *pid);
                            let t = self.counter_track(w, &format!("GPU {device} {}", names::GPU_MEM), CounterUnit::SizeBytes, parent);
                            self.proc_mem_tracks.insert((*pid, *device), t);
                            t
                        }
                    };
                    self.value(w, t, ts, CounterValue::Int(i64::try_from(*bytes).unwrap_or(i64::MAX)))?;
                }
            }
            Record::Drops { ts_ns, counters } => {
                let ts = (*ts_ns).max(self.t0);
                for (k, v) in counters {
                    self.drop_value(w, k, ts, *v)?;
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// A loss counter's value at `ts`: its track appears when it first is
    /// non-zero (0 at the start of the trace, then the value), and gets a
    /// point whenever the value changes. Activity counters are not drawn.
    pub fn drop_value<W: Write>(&mut self, w: &mut TraceWriter<W>, name: &str, ts: u64, v: u64) -> Result<(), PerfettoError> {
        if !crate::sink::report::is_loss(name) {
            return Ok(());
        }
        let v64 = i64::try_from(v).unwrap_or(i64::MAX);
        match self.drop_tracks.get_mut(name) {
            Some((t, shown)) if *shown != v => {
                let t = *t;
                *shown = v;
                self.value(w, t, ts, CounterValue::Int(v64))?;
            }
            Some(_) => {}
            None if v > 0 => {
                let m = self.meta_track(w);
                let t = self.counter_track(w, &format!("{}{name}", names::DROPS_PREFIX), CounterUnit::Count, m);
                self.drop_tracks.insert(name.to_owned(), (t, v));
                w.counter(self.t0, t, 0)?;
                self.value(w, t, ts, CounterValue::Int(v64))?;
            }
            None => {}
        }
        Ok(())
    }

    fn gpu<W: Write>(&mut self, w: &mut TraceWriter<W>, rec: &Record, flows: Option<&Ends>) -> Result<(), PerfettoError> {
        let Some((ts, end, pid, device, stream)) = gpu_item(rec) else { return Ok(()) };
        let lane = if end < ts || ts < self.t0 { None } else { self.lanes.place((pid, device, stream), ts, end) };
        // Live and streamed only: the whole layout ran the same marks ahead
        // of drawing and passes their flows in.
        let mark = if self.steps_from_records { self.marks.mark(rec, lane.is_some()) } else { None };
        let Some(lane) = lane else {
            self.stats.gpu_skipped += 1;
            return Ok(());
        };
        // The GPU step that ends or starts here names this id.
        let mut own = [0u64];
        if let Some(m) = mark {
            own[0] = w.new_flow_id();
            self.gpu_ids.procs.entry(pid).or_default().push(m, ts, end, own[0]);
        }
        if self.steps_from_records {
            self.prune_gpu_ids(ts);
        }
        let track = match self.lane_tracks.get(&(pid, device, stream, lane)) {
            Some(&t) => t,
            None => {
                let parent = self.process(w, pid);
                let name = if lane == 0 { format!("GPU {device} stream {stream}") } else { format!("GPU {device} stream {stream} (overlap {lane})") };
                // Kernels are most of a trace's events: a sequence per lane
                // lets them omit the track.
                let t = w.track(&name, TrackOpts { parent: Some(parent), own_sequence: true, ..TrackOpts::default() });
                self.lane_tracks.insert((pid, device, stream, lane), t);
                t
            }
        };
        let (starts, ends) = match flows {
            _ if mark.is_some() => (&own[..], &[][..]),
            Some(f) => (f.start.as_slice(), f.end.as_slice()),
            None => (&[][..], &[][..]),
        };
        match rec {
            Record::GpuKernel { name, grid, block, graph_id, correlation_id, .. } => {
                // Launch shapes repeat: interned (and their text kept). graph_id only for graph nodes.
                let (gi, bi) = (self.shapes.fill(grid), self.shapes.fill(block));
                let mut gb = [0u8; DIMS_MAX];
                let g = if gi == bi && grid != block { dims(&mut gb, grid) } else { self.shapes.text(gi) };
                let args = [
                    Arg::interned("grid", g),
                    Arg::interned("block", self.shapes.text(bi)),
                    Arg::u64("correlation_id", *correlation_id as u64),
                    Arg::u64("graph_id", *graph_id as u64),
                ];
                let args = if *graph_id != 0 { &args[..] } else { &args[..3] };
                let name = if name.is_empty() { "<unnamed kernel>" } else { name.as_str() };
                w.begin(ts, track, &Event::named(name).args(args).flows(starts).terminating_flows(ends))?;
                self.kernels_since_step = true;
            }
            Record::GpuMemcpy { kind, bytes, graph_id, .. } => {
                let args = [Arg::u64("bytes", *bytes), Arg::u64("graph_id", *graph_id as u64)];
                w.begin(ts, track, &Event::named(memcpy_name(*kind)).args(&args).flows(starts).terminating_flows(ends))?;
            }
            Record::GpuMemset { bytes, .. } => {
                let args = [Arg::u64("bytes", *bytes)];
                w.begin(ts, track, &Event::named("memset").args(&args))?;
            }
            _ => {}
        }
        w.end(end, track)?;
        self.stats.gpu_slices += 1;
        Ok(())
    }

    /// Draws the GPU steps (CUPTI step ends, in order) on the "GPU steps"
    /// track and its overlap lanes; `flows[k]`: step k's flow ends (the
    /// whole layout's plan). Steps drawn from records name the ids their
    /// marked GPU work carries ([`GpuMarks`]) and those of the engine steps
    /// `compute` (the correlator's, decided with them) matches them to.
    pub fn gpu_steps<W: Write>(&mut self, w: &mut TraceWriter<W>, steps: &[crate::correlate::gpu::GpuStep], flows: &[Ends], compute: &[crate::correlate::gpu::StepCompute]) -> Result<(), PerfettoError> {
        let mut from_engine: FxMap<u64, Vec<u64>> = FxMap::default();
        if self.steps_from_records {
            let mut matured = None;
            for c in compute {
                matured = matured.max(Some(c.end_ns));
                let Some(g) = c.gpu_end_ns else { continue };
                if let Some(at) = self.gpu_ids.engine.iter().position(|e| e.0 == c.end_ns) {
                    let (_, id) = self.gpu_ids.engine.remove(at).expect("found");
                    from_engine.entry(g).or_default().push(id);
                }
            }
            // Engine steps matched in order: those before the latest matched
            // one that nothing matched never will be.
            while self.gpu_ids.engine.front().is_some_and(|e| matured.is_some_and(|m| e.0 < m)) {
                self.gpu_ids.engine.pop_front();
                self.stats.flows_unlinked += 1;
            }
        }
        let mut ids: Vec<u64> = Vec::new();
        let mut gone: Vec<u64> = Vec::new();
        for (k, g) in steps.iter().enumerate() {
            // The step's number in the recording: this call may draw a later part of them.
            let index = self.stats.gpu_steps + self.stats.gpu_steps_skipped;
            let placed = self.gpu_step_lanes.place(g, self.t0);
            ids.clear();
            if self.steps_from_records {
                for r in &g.ranks {
                    let prev = self.gpu_ids.prev_end.insert(r.pid, r.gpu_end_ns);
                    let (first, copy) = self.gpu_ids.procs.entry(r.pid).or_default().take(prev, r.start_ns, r.gpu_end_ns, &mut gone);
                    ids.extend(first.into_iter().chain(copy));
                }
                let n = ids.len() as u64;
                ids.extend(from_engine.remove(&g.gpu_end_ns).unwrap_or_default());
                self.stats.flows_unlinked += gone.len() as u64;
                gone.clear();
                if placed.is_some() {
                    self.stats.kernel_flows += n;
                    self.stats.gpu_step_flows += ids.len() as u64 - n;
                } else {
                    self.stats.flows_unlinked += ids.len() as u64;
                }
            }
            let Some((lane, start, end)) = placed else {
                self.stats.gpu_steps_skipped += 1;
                continue;
            };
            if !self.gpu_step_tracks.contains_key(&lane) {
                let name = self.gpu_step_lanes.track_name(lane);
                let t = w.track(&name, TrackOpts { rank: Some(3), own_sequence: true, ..TrackOpts::default() });
                self.gpu_step_tracks.insert(lane, t);
            }
            let pids = g.ranks.iter().map(|r| r.pid.to_string()).collect::<Vec<_>>().join(",");
            let mut args = vec![
                Arg::u64("step", index),
                Arg::f64("gpu_ms", g.gpu_ns as f64 / 1e6),
                Arg::u64("gpu_end_ns", g.gpu_end_ns),
                Arg::u64("kernels", u64::from(g.kernels())),
                Arg::u64("graph_kernels", u64::from(g.graph_kernels())),
                Arg::u64("ranks", g.ranks.len() as u64),
                Arg::str("pids", &pids),
            ];
            if let Some(e) = g.engine {
                args.push(Arg::u64("engine_pid", u64::from(e)));
            }
            if let Some(t) = g.tokens {
                args.push(Arg::u64("tokens", t));
            }
            let (starts, ends) = match flows.get(k) {
                Some(f) => (f.start.as_slice(), f.end.as_slice()),
                None => (ids.as_slice(), &[][..]),
            };
            let track = self.gpu_step_tracks[&lane];
            w.begin(start, track, &Event::named(names::GPU_STEP).args(&args).flows(starts).terminating_flows(ends))?;
            w.end(end, track)?;
            self.stats.gpu_steps += 1;
        }
        // A matched GPU step not among these (not expected: the correlator
        // hands both out together).
        self.stats.flows_unlinked += from_engine.values().map(|v| v.len() as u64).sum::<u64>();
        Ok(())
    }

    /// Lets go of GPU flow ids no GPU step will name (see
    /// [`GPU_FLOWS_KEEP_NS`], [`LIVE_GPU_FLOW_MARKS`]); checked once a
    /// second of records.
    fn prune_gpu_ids(&mut self, now: u64) {
        let (g, cap) = (&mut self.gpu_ids, self.gpu_ids_cap);
        if now < g.pruned_at.saturating_add(1_000_000_000) {
            return;
        }
        g.pruned_at = now;
        let mut gone = 0;
        match self.step_reqs_keep {
            // Streamed: by age.
            Some(_) => {
                let cut = now.saturating_sub(GPU_FLOWS_KEEP_NS);
                for p in g.procs.values_mut() {
                    p.let_go_before(cut, &mut gone);
                }
                while g.engine.front().is_some_and(|e| e.0 < cut) {
                    g.engine.pop_front();
                    gone += 1;
                }
            }
            // Live: by count.
            None => {
                for p in g.procs.values_mut() {
                    if p.len() > cap {
                        p.let_go_half(&mut gone);
                    }
                }
                if g.engine.len() > cap {
                    let n = g.engine.len() / 2;
                    g.engine.drain(..n);
                    gone += n as u64;
                }
            }
        }
        g.procs.retain(|_, p| p.len() > 0);
        self.stats.flows_unlinked += gone;
    }

    /// Draws one engine step (in step order) and the tokens/s counter.
    pub fn step<W: Write>(&mut self, w: &mut TraceWriter<W>, st: &StepInfo, flows: Option<&Ends>) -> Result<(), PerfettoError> {
        let Some(span) = self.step_clock.next(st.engine, st.end_ns) else {
            self.stats.steps_skipped += 1;
            return Ok(());
        };
        let (starts, ends) = flows.map_or((&[][..], &[][..]), |f| (f.start.as_slice(), f.end.as_slice()));
        self.draw_step(w, st, span, starts, ends)
    }

    /// Streamed `hopscope trace` (one pass): requests not taken
    /// [`STEP_FLOWS_KEEP_NS`] after their last step are let go.
    pub fn keep_step_flows_for(&mut self, ns: u64) {
        self.step_reqs_keep = Some(ns);
    }

    /// The request→step flows of the engine request `id`'s steps, for its
    /// request slice (once: they are forgotten here).
    pub fn take_step_flows(&mut self, id: &str) -> Option<ReqSteps> {
        self.step_reqs.remove(id)
    }

    /// Flows taken by a request that is not drawn, or of one of its phases
    /// that is not ([`ReqSteps::drop_phase`] first).
    pub fn step_flows_not_drawn(&mut self, unmapped: u64, capped: u64, unlinked: u64) {
        self.stats.flows_unmapped += unmapped;
        self.stats.flows_capped += capped;
        self.stats.flows_unlinked += unlinked;
    }

    /// The end: no request takes the step flows left, and no GPU step the
    /// GPU flows.
    pub fn drop_step_flows(&mut self) {
        for (_, e) in self.step_reqs.drain() {
            self.stats.flows_unmapped += u64::from(e.drawn[0] + e.drawn[1]);
            self.stats.flows_unlinked += e.count(false) + e.count(true);
        }
        let g = std::mem::take(&mut self.gpu_ids);
        self.stats.flows_unlinked += g.engine.len() as u64 + g.procs.values().map(|p| p.len() as u64).sum::<u64>();
    }

    /// Whether this layout counts its step→GPU step and GPU step→kernel
    /// flows itself (steps drawn from records) rather than the whole
    /// layout's plan.
    pub fn draws_gpu_flows(&self) -> bool {
        self.steps_from_records
    }

    /// Lets go of requests no request slice will take (see
    /// [`STEP_FLOWS_KEEP_NS`], [`LIVE_STEP_FLOW_REQUESTS`]); checked once a
    /// second of steps.
    fn prune_step_reqs(&mut self, now: u64) {
        if now < self.step_reqs_pruned_at.saturating_add(1_000_000_000) {
            return;
        }
        self.step_reqs_pruned_at = now;
        let cut = match self.step_reqs_keep {
            Some(keep) => now.saturating_sub(keep),
            None if self.step_reqs.len() > self.step_reqs_cap => {
                // The oldest half.
                let mut last: Vec<u64> = self.step_reqs.values().map(|e| e.last_ns).collect();
                let mid = last.len() / 2;
                *last.select_nth_unstable(mid).1
            }
            None => return,
        };
        let stats = &mut self.stats;
        self.step_reqs.retain(|_, e| {
            let keep = e.last_ns >= cut;
            if !keep {
                stats.flows_unmapped += u64::from(e.drawn[0] + e.drawn[1]);
                stats.flows_unlinked += e.count(false) + e.count(true);
            }
            keep
        });
    }

    /// Draws a step whose clock said `(start, slice)`, with its flow ends.
    fn draw_step<W: Write>(&mut self, w: &mut TraceWriter<W>, st: &StepInfo, (start, slice): (u64, bool), starts: &[u64], ends: &[u64]) -> Result<(), PerfettoError> {
        let track = match self.steps_tracks.iter().find(|t| t.0 == st.engine) {
            Some(t) => t.1,
            None => {
                // Engine 0 (or the only one: no index) keeps the plain name.
                let name = if st.engine == 0 { names::STEPS.to_owned() } else { format!("{} (DP rank {})", names::STEPS, st.engine) };
                let t = w.track(&name, TrackOpts { rank: Some(3), own_sequence: true, ..TrackOpts::default() });
                self.steps_tracks.push((st.engine, t));
                t
            }
        };
        let args = [
            Arg::u64("step", st.index),
            Arg::u64("requests", st.requests),
            Arg::u64("new_tokens", st.new_tokens),
            Arg::u64("first_tokens", st.first_tokens),
            Arg::u64("sent_ns", st.sent_ns),
            Arg::u64("engine_index", st.engine),
        ];
        let args = if st.engine == 0 { &args[..5] } else { &args[..] };
        let ev = Event::named(names::STEP).args(args).flows(starts).terminating_flows(ends);
        let start = start.max(self.t0);
        let end = st.end_ns.max(start);
        if slice {
            w.begin(start, track, &ev)?;
            w.end(end, track)?;
        } else {
            w.instant(end, track, &ev)?;
        }
        self.stats.steps += 1;
        // Tokens of the steps that ended in the last second.
        self.rate.push_back((end, st.new_tokens));
        self.rate_sum += st.new_tokens;
        while let Some(&(t, n)) = self.rate.front() {
            if t + RATE_WINDOW_NS > end {
                break;
            }
            self.rate.pop_front();
            self.rate_sum -= n;
        }
        let rt = match self.rate_track {
            Some(t) => t,
            None => {
                let g = self.server(w);
                let t = self.counter_track(w, names::TOKENS_PER_S, CounterUnit::Unspecified, g);
                self.rate_track = Some(t);
                t
            }
        };
        let v = self.rate_sum as f64 * 1e9 / RATE_WINDOW_NS as f64;
        self.value(w, rt, end, CounterValue::Float(v))
    }
}

/// A request id's hash from its length and its first and last 16 bytes
/// (4 words), not every word: each engine step looks up every output's id
/// (~15 a step; ids like `chatcmpl-<16 hex>-<8 hex>` differ at both
/// ends). Ids alike in those bytes and their length only collide (a longer
/// probe, found by comparing the ids as before).
#[derive(Default)]
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    #[inline]
    fn write(&mut self, b: &[u8]) {
        use super::deflate::read64;
        let n = b.len();
        let v = if n >= 16 {
            read64(b, 0) ^ read64(b, 8).rotate_left(17) ^ read64(b, n - 16).rotate_left(31) ^ read64(b, n - 8).rotate_left(47)
        } else if n >= 8 {
            read64(b, 0) ^ read64(b, n - 8).rotate_left(31)
        } else {
            b.iter().fold(0, |h, &x| h << 8 | u64::from(x))
        };
        self.0 = (self.0.rotate_left(5) ^ v ^ (n as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }

    #[inline]
    fn write_u8(&mut self, x: u8) {
        // A `str`'s terminator (0xff).
        self.0 = (self.0.rotate_left(5) ^ u64::from(x)).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }

    #[inline]
    fn finish(&self) -> u64 {
        // The high bits (hashbrown's control bytes) from all of the state.
        self.0 ^ self.0 >> 29
    }
}

/// Room for a launch shape: three u32s and two separators.
const DIMS_MAX: usize = 3 * 10 + 2;

/// Launch shapes as text, by shape: a model's kernels repeat a few dozen
/// grids and blocks, and formatting two per kernel record was 2.8 % of
/// `hopscope trace`'s instructions on a CUPTI-shaped recording (callgrind,
/// session 17). Direct-mapped: a shape evicts the one in its slot.
struct Shapes {
    slots: Vec<([u32; 3], String)>,
}

const SHAPE_SLOTS: usize = 64;

impl Default for Shapes {
    fn default() -> Self {
        Shapes { slots: vec![([0; 3], String::new()); SHAPE_SLOTS] }
    }
}

impl Shapes {
    /// The slot holding `d`'s text (made when it holds another shape).
    #[inline]
    fn fill(&mut self, d: &[u32; 3]) -> usize {
        let h = (u64::from(d[0]) ^ u64::from(d[1]).rotate_left(21) ^ u64::from(d[2]).rotate_left(42)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let i = (h >> 58) as usize;
        let e = &mut self.slots[i];
        if e.1.is_empty() || e.0 != *d {
            let mut b = [0u8; DIMS_MAX];
            e.0 = *d;
            e.1.clear();
            e.1.push_str(dims(&mut b, d));
        }
        i
    }

    fn text(&self, slot: usize) -> &str {
        &self.slots[slot].1
    }
}

/// A launch shape as `XxYxZ` (what `format!("{}x{}x{}")` gives), written
/// into `buf`: kernels are most records, and this runs for each one.
fn dims<'a>(buf: &'a mut [u8; DIMS_MAX], d: &[u32; 3]) -> &'a str {
    let mut n = 0;
    for (i, &v) in d.iter().enumerate() {
        if i > 0 {
            buf[n] = b'x';
            n += 1;
        }
        let mut digits = [0u8; 10];
        let mut k = digits.len();
        let mut v = v;
        loop {
            k -= 1;
            digits[k] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        let len = digits.len() - k;
        buf[n..n + len].copy_from_slice(&digits[k..]);
        n += len;
    }
    std::str::from_utf8(&buf[..n]).expect("ascii digits")
}

#[derive(Clone, Copy)]
enum CounterValue {
    Int(i64),
    Float(f64),
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeSet, HashSet};

    #[test]
    fn a_set_hashed_by_id_tails_holds_what_a_plain_set_holds() {
        // Ids alike in their length and first and last 16 bytes (they
        // differ in the middle only: one hash, told apart by comparing),
        // short ones and the empty one, added and removed at random.
        let mut next = crate::testutil::xorshift(0x2545_f491_4f6c_dd1d);
        let mut ids: Vec<String> = (0..300).map(|k| format!("chatcmpl-{:016x}-{:08x}", next(), k)).collect();
        ids.extend((0..40).map(|k| format!("prefix-sixteen-b-{k:03}-suffix-sixteen-b")));
        ids.extend(["", "a", "ab", "abcdefg", "abcdefgh", "abcdefghi", "abcdefghabcdefgh"].map(String::from));
        let mut set: HashSet<String, std::hash::BuildHasherDefault<IdHasher>> = HashSet::default();
        let mut want = BTreeSet::new();
        for _ in 0..50_000 {
            let id = &ids[next() as usize % ids.len()];
            if next().is_multiple_of(3) {
                assert_eq!(set.remove(id.as_str()), want.remove(id), "{id}");
            } else {
                assert_eq!(!set.contains(id.as_str()) && set.insert(id.clone()), want.insert(id.clone()), "{id}");
            }
            assert_eq!(set.len(), want.len());
        }
        assert!(ids.iter().all(|id| set.contains(id.as_str()) == want.contains(id)));
    }

    fn outputs(ts_ns: u64, outs: &[(&str, u64, bool)]) -> Record {
        use crate::model::EngineOutput;
        Record::EngineOutputs {
            conn: crate::event::ConnKey { tgid: 7, fd: 31, ino: 31 },
            ts_ns,
            tid: 7,
            dir: Dir::Out,
            engine_index: Some(0),
            timestamp_s: None,
            outputs: outs.iter().map(|&(id, new_tokens, done)| EngineOutput { request_id: id.into(), new_tokens, finish_reason: done.then_some(0), events: vec![], prefill: None }).collect(),
            outputs_total: Some(outs.len() as u64),
            finished_requests: vec![],
            truncated: false,
        }
    }

    #[test]
    fn step_flows_are_the_first_four_and_the_last_of_each_phase_and_are_let_go_when_no_request_takes_them() {
        const MS: u64 = 1_000_000;
        let mut w = TraceWriter::with_encoding(Vec::new(), 0, super::super::Encoding::PLAIN).unwrap();
        let mut raw = RawLayout::new(0, true);
        raw.keep_step_flows_for(10_000 * MS);
        // a: 6 prefill steps (chunked), the 6th its first token, then 7
        // decode steps, the last finishing. b: one step at 1 ms, then gone.
        let mut t = MS;
        raw.push(&mut w, &outputs(t, &[("a", 0, false), ("b", 1, false)]), None).unwrap();
        for k in 1..13u64 {
            t += 10 * MS;
            raw.push(&mut w, &outputs(t, &[("a", u64::from(k >= 5), k == 12)]), None).unwrap();
        }
        let a = raw.take_step_flows("a").expect("a's steps");
        assert_eq!(a.drawn, [6, 7]);
        assert_eq!((a.count(false), a.count(true)), (5, 5), "the first four and the last of each");
        let ids: Vec<u64> = a.ids(false).chain(a.ids(true)).collect();
        assert_eq!(ids.len(), 10);
        assert!(ids.windows(2).all(|p| p[0] < p[1]), "distinct, in step order: {ids:?}");
        assert!(raw.take_step_flows("a").is_none(), "taken once");
        // b's last step is 10 s old at the next step after 10 s: let go, counted.
        raw.push(&mut w, &outputs(t + 10_000 * MS, &[("c", 1, false)]), None).unwrap();
        assert!(raw.take_step_flows("b").is_none());
        assert_eq!((raw.stats.flows_unmapped, raw.stats.flows_unlinked), (1, 1));
        // The end: c is never taken.
        raw.drop_step_flows();
        assert_eq!((raw.stats.flows_unmapped, raw.stats.flows_unlinked), (2, 2));
    }

    #[test]
    fn a_live_layout_keeps_step_flows_to_the_stop_up_to_its_cap_then_lets_the_oldest_half_go() {
        let mut w = TraceWriter::with_encoding(Vec::new(), 0, super::super::Encoding::PLAIN).unwrap();
        let mut raw = RawLayout::new(0, true);
        raw.step_reqs_cap = 8;
        // One request a step, 1.5 s apart (past any keep time a streamed pass would use).
        let ids: Vec<String> = (0..20).map(|k| format!("r{k}")).collect();
        for (k, id) in ids.iter().enumerate() {
            raw.push(&mut w, &outputs((k as u64 + 1) * 1_500_000_000, &[(id, 1, true)]), None).unwrap();
            assert!(raw.step_reqs.len() <= 9, "{} kept after {k}", raw.step_reqs.len());
        }
        let kept: Vec<&String> = ids.iter().filter(|id| raw.step_reqs.contains_key(id.as_str())).collect();
        assert!(kept.len() >= 4, "{kept:?}");
        // The newest are kept, the rest counted.
        assert!(ids[ids.len() - kept.len()..].iter().eq(kept.iter().copied()), "{kept:?}");
        let gone = (ids.len() - kept.len()) as u64;
        assert_eq!((raw.stats.flows_unmapped, raw.stats.flows_unlinked), (gone, gone));
    }

    #[test]
    fn an_id_seen_again_after_it_finished_is_another_request() {
        let mut w = TraceWriter::with_encoding(Vec::new(), 0, super::super::Encoding::PLAIN).unwrap();
        let mut raw = RawLayout::new(0, true);
        raw.push(&mut w, &outputs(1_000_000, &[("a", 1, true)]), None).unwrap();
        raw.push(&mut w, &outputs(2_000_000, &[("a", 1, false)]), None).unwrap();
        let a = raw.take_step_flows("a").unwrap();
        assert_eq!((a.drawn, a.count(false), a.count(true)), ([1, 0], 1, 0), "a fresh prefill");
        assert_eq!((raw.stats.flows_unmapped, raw.stats.flows_unlinked), (1, 1), "the first one's flow is not taken");
    }

    /// A kernel (`copy` None) or a copy (kind, destination kind, bytes) of
    /// the engine process, on stream 7.
    fn gpu(ts: u64, end: u64, copy: Option<(u8, u8, u64)>) -> Record {
        use super::super::tests::{gpu_copy, kernel};
        match copy {
            Some((kind, dst_kind, bytes)) => gpu_copy(7, ts, end, kind, 3, dst_kind, bytes),
            None => kernel(ts, end - ts, "k"),
        }
    }

    const STEP_COPY: Option<(u8, u8, u64)> = Some((2, 2, 64));

    #[test]
    fn launch_shapes_read_as_formatted_whatever_evicts_them() {
        let mut s = Shapes::default();
        let mut next = crate::testutil::xorshift(7);
        // 200 shapes in 64 slots, revisited at random: always the right text.
        let shapes: Vec<[u32; 3]> = (0..200).map(|_| [next() as u32 % 4096, next() as u32 % 3, u32::MAX - next() as u32 % 2]).collect();
        for _ in 0..5000 {
            let d = shapes[next() as usize % shapes.len()];
            let i = s.fill(&d);
            assert_eq!(s.text(i), format!("{}x{}x{}", d[0], d[1], d[2]));
        }
    }

    #[test]
    fn gpu_marks_are_step_copies_and_the_first_drawn_kernel_after_one_ends() {
        let mut m = GpuMarks::default();
        assert_eq!(m.mark(&gpu(10, 20, None), true), None, "no step copy before it");
        assert!(!m.step_copies);
        assert_eq!(m.mark(&gpu(30, 100, STEP_COPY), true), Some(GpuMark::StepCopy));
        assert!(m.step_copies);
        assert_eq!(m.mark(&gpu(40, 60, Some((1, 2, 64))), true), None, "host to device");
        assert_eq!(m.mark(&gpu(41, 60, Some((2, 1, 64))), true), None, "to pageable memory");
        assert_eq!(m.mark(&gpu(42, 60, Some((2, 2, 1 << 20))), true), None, "KV-sized");
        assert_eq!(m.mark(&gpu(90, 95, None), true), None, "started before the copy ended: its step's");
        assert_eq!(m.mark(&gpu(150, 160, None), true), Some(GpuMark::FirstKernel));
        assert_eq!(m.mark(&gpu(160, 170, None), true), None);
        // A copy not drawn still ends a stretch; a kernel not drawn is not marked and marks nothing.
        assert_eq!(m.mark(&gpu(180, 200, STEP_COPY), false), None);
        assert_eq!(m.mark(&gpu(250, 260, None), false), None);
        assert_eq!(m.mark(&gpu(260, 270, None), true), Some(GpuMark::FirstKernel));
        assert_eq!(m.mark(&gpu(0, 300, STEP_COPY), true), None, "a zero start places nothing");
        assert_eq!(m.mark(&gpu(310, 320, None), true), None);
    }

    #[test]
    fn rank_ends_give_a_step_its_first_kernel_and_end_copy_and_let_go_of_what_came_before() {
        let mut e: RankEnds<u32> = RankEnds::default();
        // Two streams' copies ending out of order; first kernels in start order.
        e.push(GpuMark::StepCopy, 90, 100, 1);
        e.push(GpuMark::FirstKernel, 110, 120, 2);
        e.push(GpuMark::FirstKernel, 150, 160, 3);
        e.push(GpuMark::StepCopy, 240, 300, 4);
        e.push(GpuMark::StepCopy, 230, 250, 5);
        e.push(GpuMark::FirstKernel, 310, 320, 6);
        let mut gone = Vec::new();
        // Its first step: nothing before it to start after, only its end copy.
        assert_eq!(e.take(None, 80, 100, &mut gone), (None, Some(1)));
        // (100, 250]: kernel 2; kernel 3 stays (after a copy that ended no step? not known yet).
        assert_eq!(e.take(Some(100), 105, 250, &mut gone), (Some(2), Some(5)));
        assert!(gone.is_empty());
        // (250, 300]: kernel 3 started before 250: let go; copy 4 ends it.
        assert_eq!(e.take(Some(250), 260, 300, &mut gone), (None, Some(4)));
        assert_eq!(gone, [3]);
        // A step whose work starts after the marked kernel: not its first.
        gone.clear();
        assert_eq!(e.take(Some(300), 315, 400, &mut gone), (None, None));
        assert_eq!(e.len(), 1);
    }

    #[test]
    fn gpu_flow_ids_no_gpu_step_names_are_let_go_by_age_when_streamed_and_by_count_when_live() {
        const S: u64 = 1_000_000_000;
        let mut w = TraceWriter::with_encoding(Vec::new(), 0, super::super::Encoding::PLAIN).unwrap();
        let mut raw = RawLayout::new(0, true);
        raw.keep_step_flows_for(STEP_FLOWS_KEEP_NS);
        // A step copy and the kernel after it: two ids, then nothing names them.
        raw.push(&mut w, &gpu(S, S + 10, STEP_COPY), None).unwrap();
        raw.push(&mut w, &gpu(S + 20, S + 30, None), None).unwrap();
        assert_eq!(raw.gpu_ids.procs[&super::super::tests::ENGINE].len(), 2);
        raw.push(&mut w, &gpu(S + GPU_FLOWS_KEEP_NS / 2, S + GPU_FLOWS_KEEP_NS / 2 + 10, None), None).unwrap();
        assert_eq!(raw.stats.flows_unlinked, 0, "kept while a GPU step may still come");
        raw.push(&mut w, &gpu(2 * S + GPU_FLOWS_KEEP_NS, 2 * S + GPU_FLOWS_KEEP_NS + 10, None), None).unwrap();
        assert_eq!(raw.stats.flows_unlinked, 2);
        assert!(raw.gpu_ids.procs.is_empty());

        // Live: kept to the stop, up to the cap, then the oldest half.
        let mut raw = RawLayout::new(0, true);
        raw.gpu_ids_cap = 8;
        for k in 0..12u64 {
            raw.push(&mut w, &gpu((2 * k + 1) * S, (2 * k + 1) * S + 10, STEP_COPY), None).unwrap();
            raw.push(&mut w, &gpu((2 * k + 2) * S, (2 * k + 2) * S + 10, None), None).unwrap();
        }
        let kept = raw.gpu_ids.procs[&super::super::tests::ENGINE].len() as u64;
        assert!((4..=9).contains(&kept), "{kept}");
        assert_eq!(raw.stats.flows_unlinked, 24 - kept);
        raw.drop_step_flows();
        assert_eq!(raw.stats.flows_unlinked, 24, "the end: every id counted once");
    }
}
