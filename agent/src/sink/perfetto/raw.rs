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
    /// drawn, and GPU steps, whose flows to GPU steps and kernels are not
    /// drawn (their kernels were written before the step was known).
    pub gpu_flows_not_drawn: u64,
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

/// The lane of the "GPU steps" track each GPU step is drawn on (None: not
/// drawn), and its drawn span. With async scheduling the host waits for a
/// step after it launched the next one, so a step's end (the sync's return)
/// may follow the next one's start: such steps go to overlap lanes. Run by
/// the offline layout ahead of drawing too, so only drawn steps get flows.
pub fn gpu_step_lanes(steps: &[crate::correlate::gpu::GpuStep], t0: u64) -> Vec<Option<(u32, u64, u64)>> {
    let mut lanes = GpuStepLanes::default();
    steps.iter().map(|g| lanes.place(g, t0)).collect()
}

/// [`gpu_step_lanes`] one step at a time: a streamed trace draws GPU steps
/// as the correlator decides them, not all at its end.
#[derive(Default)]
pub struct GpuStepLanes {
    free_at: Vec<u64>,
    last_start: u64,
}

impl GpuStepLanes {
    pub fn place(&mut self, g: &crate::correlate::gpu::GpuStep, t0: u64) -> Option<(u32, u64, u64)> {
        let start = g.start_ns.max(t0);
        let end = g.end_ns.max(start);
        if start < self.last_start {
            return None;
        }
        self.last_start = start;
        let lane = match self.free_at.iter().position(|f| *f <= start) {
            Some(l) => l,
            None if self.free_at.len() < GPU_LANES as usize => {
                self.free_at.push(0);
                self.free_at.len() - 1
            }
            None => return None,
        };
        self.free_at[lane] = end;
        Some((lane as u32, start, end))
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

/// Where step slices go: (start, end, slice?) from a step's end, or None when
/// it ended before the previous one.
#[derive(Default)]
pub struct StepClock {
    prev: Option<u64>,
}

impl StepClock {
    pub fn next(&mut self, end: u64) -> Option<(u64, bool)> {
        let span = match self.prev {
            Some(p) if end < p => return None,
            Some(p) if p < end && end - p <= STEP_GAP_NS => (p, true),
            _ => (end, false),
        };
        self.prev = Some(end);
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
    steps_track: Option<TrackId>,
    gpu_step_tracks: Vec<TrackId>,
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
    rate: VecDeque<(u64, u64)>,
    rate_sum: u64,
    rate_track: Option<TrackId>,
    server: Option<TrackId>,
    kv_tracks: HashMap<Option<u64>, TrackId>,
    dev_tracks: HashMap<u32, (TrackId, Option<TrackId>)>,
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
            steps_track: None,
            gpu_step_tracks: Vec::new(),
            gpu_step_lanes: GpuStepLanes::default(),
            step_clock: StepClock::default(),
            step_dir: None,
            step_reqs: HashMap::default(),
            step_reqs_keep: None,
            step_reqs_cap: LIVE_STEP_FLOW_REQUESTS,
            step_reqs_pruned_at: 0,
            step_ids: Vec::new(),
            kernels_since_step: false,
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
            Record::EngineOutputs { ts_ns, dir, timestamp_s, outputs, .. } if self.steps_from_records => {
                // The engine's own writes when traced, else the frontend's reads.
                match (self.step_dir, dir) {
                    (Some(Dir::Out), Dir::In) => return Ok(()),
                    _ => self.step_dir = Some(*dir),
                }
                let built = timestamp_s.filter(|s| s.is_finite() && *s > 0.0 && *s < 1e10).map(|s| (s * 1e9).round() as u64);
                let end_ns = built.filter(|b| b <= ts_ns).unwrap_or(*ts_ns);
                let span = self.step_clock.next(end_ns);
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
            Record::GpuSample { ts_ns, device, mem_used_bytes, process_mem, sm_util_pct, .. } => {
                let ts = (*ts_ns).max(self.t0);
                let (mem, sm) = match self.dev_tracks.get(device) {
                    Some(t) => *t,
                    None => {
                        let g = self.server(w);
                        let mem = self.counter_track(w, &format!("GPU {device} {}", names::GPU_MEM), CounterUnit::SizeBytes, g);
                        self.dev_tracks.insert(*device, (mem, None));
                        (mem, None)
                    }
                };
                self.value(w, mem, ts, CounterValue::Int(i64::try_from(*mem_used_bytes).unwrap_or(i64::MAX)))?;
                if let Some(v) = sm_util_pct {
                    let sm = match sm {
                        Some(t) => t,
                        None => {
                            let g = self.server(w);
                            let t = self.counter_track(w, &format!("GPU {device} {}", names::SM_UTIL), CounterUnit::Unspecified, g);
                            self.dev_tracks.insert(*device, (mem, Some(t)));
                            t
                        }
                    };
                    self.value(w, sm, ts, CounterValue::Int(*v as i64))?;
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
        if end < ts || ts < self.t0 {
            self.stats.gpu_skipped += 1;
            return Ok(());
        }
        let Some(lane) = self.lanes.place((pid, device, stream), ts, end) else {
            self.stats.gpu_skipped += 1;
            return Ok(());
        };
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
        let (starts, ends) = flows.map_or((&[][..], &[][..]), |f| (f.start.as_slice(), f.end.as_slice()));
        match rec {
            Record::GpuKernel { name, grid, block, graph_id, correlation_id, .. } => {
                let (mut gb, mut bb) = ([0u8; DIMS_MAX], [0u8; DIMS_MAX]);
                // Launch shapes repeat: interned. graph_id only for graph nodes.
                let args = [
                    Arg::interned("grid", dims(&mut gb, grid)),
                    Arg::interned("block", dims(&mut bb, block)),
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
                w.begin(ts, track, &Event::named(memcpy_name(*kind)).args(&args))?;
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
    /// track and its overlap lanes; `flows[k]`: step k's flow ends.
    pub fn gpu_steps<W: Write>(&mut self, w: &mut TraceWriter<W>, steps: &[crate::correlate::gpu::GpuStep], flows: &[Ends]) -> Result<(), PerfettoError> {
        for (k, g) in steps.iter().enumerate() {
            // The step's number in the recording: this call may draw a later part of them.
            let index = self.stats.gpu_steps + self.stats.gpu_steps_skipped;
            let Some((lane, start, end)) = self.gpu_step_lanes.place(g, self.t0) else {
                self.stats.gpu_steps_skipped += 1;
                continue;
            };
            while self.gpu_step_tracks.len() <= lane as usize {
                let n = self.gpu_step_tracks.len();
                let name = if n == 0 { names::GPU_STEPS.to_owned() } else { format!("{} (overlap {n})", names::GPU_STEPS) };
                self.gpu_step_tracks.push(w.track(&name, TrackOpts { rank: Some(3), own_sequence: true, ..TrackOpts::default() }));
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
            if let Some(t) = g.tokens {
                args.push(Arg::u64("tokens", t));
            }
            let (starts, ends) = flows.get(k).map_or((&[][..], &[][..]), |f| (f.start.as_slice(), f.end.as_slice()));
            let track = self.gpu_step_tracks[lane as usize];
            w.begin(start, track, &Event::named(names::GPU_STEP).args(&args).flows(starts).terminating_flows(ends))?;
            w.end(end, track)?;
            self.stats.gpu_steps += 1;
            if self.steps_from_records {
                self.stats.gpu_flows_not_drawn += 1;
            }
        }
        Ok(())
    }

    /// Draws one engine step (in step order) and the tokens/s counter.
    pub fn step<W: Write>(&mut self, w: &mut TraceWriter<W>, st: &StepInfo, flows: Option<&Ends>) -> Result<(), PerfettoError> {
        let Some(span) = self.step_clock.next(st.end_ns) else {
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

    /// The end: no request takes the step flows left.
    pub fn drop_step_flows(&mut self) {
        for (_, e) in self.step_reqs.drain() {
            self.stats.flows_unmapped += u64::from(e.drawn[0] + e.drawn[1]);
            self.stats.flows_unlinked += e.count(false) + e.count(true);
        }
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
        let track = *self.steps_track.get_or_insert_with(|| w.track(names::STEPS, TrackOpts { rank: Some(3), own_sequence: true, ..TrackOpts::default() }));
        let args = [
            Arg::u64("step", st.index),
            Arg::u64("requests", st.requests),
            Arg::u64("new_tokens", st.new_tokens),
            Arg::u64("first_tokens", st.first_tokens),
            Arg::u64("sent_ns", st.sent_ns),
        ];
        let ev = Event::named(names::STEP).args(&args).flows(starts).terminating_flows(ends);
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
}
