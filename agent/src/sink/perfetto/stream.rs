//! The request-driven part of a trace written as requests become final
//! (`hopscope trace` on large recordings, `record --perfetto`'s finish):
//! memory follows the open requests, not the recording's length.
//!
//! The correlator hands requests out in report order (arrival) once final;
//! each one's timeline items (hop slice, request slice, phases, chunks,
//! counter changes) go into a time-ordered heap. The rule for writing: an
//! item is written once its time is before the watermark, the arrival of the
//! latest request handed out less [`READ_SLACK_NS`]: every request handed
//! out later arrived no earlier (report order) and its slice starts at its
//! wire arrival, at most the read delay before that. A request that would
//! still start before what is written (a read delay over the slack, or one
//! the correlator counted as late) is left out and counted
//! (`trace.requests_late`). Request tracks are retired from the writer once
//! their slices are closed, chains idle for [`CHAIN_IDLE_NS`] too (a later
//! hop of such a chain gets a fresh track of the same name).
//!
//! Request→step flows: the steps are written as they come, before the
//! requests they served are final, so the flow ids are chosen on the step
//! side ([`super::raw::ReqSteps`]: the first [`super::FLOW_HEAD`] steps of a
//! phase and its last, the whole layout's rule) and a request's prefill and
//! decode slices name the ids its engine request's steps carry
//! ([`RawLayout::take_step_flows`]); ids no slice names (its request or phase
//! is not drawn) are counted, `trace.flows_unlinked`.
//!
//! Step→GPU step and GPU step→kernel flows are chosen on the GPU side the
//! same way ([`super::raw::GpuMarks`]). Left out compared with the
//! whole-recording layout: in recordings with kernels but no CUPTI step
//! ends, the flows from steps to the kernels that ran in them by time (the
//! kernels are written before the step's span is known), counted per step
//! as `trace.flows_not_streamed`; the metadata instant is written last (at
//! the trace's start, on its own track), when the request and chain counts
//! are known.

use super::raw::{RawLayout, ReqSteps};
use super::{groups, meta_args, names, phase_spans, request_span, Groups, Item, Level, MetaStrings, Phase, RequestArgs, TraceStats};
use super::{Arg, CounterUnit, Event, NameIid, PerfettoError, TrackId, TrackOpts, TraceWriter};
use crate::correlate::{Analysis, FxHasher, FxMap, Request};
use crate::recording::Meta;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet};
use std::io::Write;

/// How far before the latest handed-out request's arrival a later request's
/// slice may start (its wire arrival before the read of its first byte).
pub const READ_SLACK_NS: u64 = 1_000_000_000;

/// A chain with no hop for this long (recording time) is forgotten.
pub const CHAIN_IDLE_NS: u64 = 60_000_000_000;

/// A heap key: the item's time, then the request's number (the order
/// requests were handed out), then its slot in `reqs` (not part of the
/// order: numbers are unique).
#[inline]
fn key(ts: u64, req: u32, slot: u32) -> u128 {
    (u128::from(ts) << 64) | (u128::from(req) << 32) | u128::from(slot)
}

#[inline]
fn unkey(k: u128) -> (u64, u32, u32) {
    ((k >> 64) as u64, (k >> 32) as u32, k as u32)
}

#[derive(Clone, Copy, Debug)]
enum S {
    I(Item),
    /// The request's track is forgotten (its slices are closed).
    Retire { track: TrackId },
}

/// A request handed out and not yet drawn to its end.
struct Held {
    r: Request,
    flow: Option<u64>,
    /// The flows to the steps that served its prefill and decode.
    steps: ReqSteps,
    /// The report's figures for its slices, made at the first one that shows them.
    args: Option<RequestArgs>,
}

/// A held request's items in drawing order, the next one to draw and its
/// track: apart from [`Held`] (over a KiB) so that drawing an item reads a
/// small entry, not a cache line of the request's.
struct Cursor {
    items: Vec<(u64, S)>,
    next: usize,
    track: TrackId,
}

struct ChainLanes {
    lanes: Vec<(TrackId, u64)>,
    last_end: u64,
}

/// See the module docs.
pub struct RequestStream {
    g: Groups,
    seq: usize,
    t0: u64,
    /// The next item of every held request, by (time, request): the items
    /// of one request are listed in order, so merging the lists by that key
    /// draws every item in time order, ties in the order requests were
    /// handed out and, within one, listed. Keys are [`key`]s: one integer
    /// compare per step of a sift, where a tuple compared field by field.
    heap: BinaryHeap<Reverse<u128>>,
    /// A request's items before its chunks, sorted apart (see
    /// [`Listing::list`]); kept: no allocation per request.
    head: Vec<(u64, S)>,
    /// The chunk instants' name iid (see [`NameIid`]).
    chunk_name: NameIid,
    /// Items listed and not yet drawn.
    queued: usize,
    /// Held requests by slot (an index, not a hash look-up per item drawn);
    /// free slots are reused, so this follows the most requests held at once.
    reqs: Vec<Option<Held>>,
    /// Their items, by the same slot.
    cursors: Vec<Cursor>,
    free: Vec<u32>,
    /// Requests whose track is not yet retired.
    live: usize,
    next_req: u32,
    chains: FxMap<String, ChainLanes>,
    chain_rank: i32,
    level_tracks: [Option<TrackId>; 3],
    level_now: [i64; 3],
    level_shown: [Option<i64>; 3],
    /// A level moved since the counters were last flushed (most items
    /// move none: [`flush_levels`](Self::flush_levels) then has nothing to do).
    levels_moved: bool,
    cur_ts: Option<u64>,
    open_hops: HashSet<u64, std::hash::BuildHasherDefault<FxHasher>>,
    latest_arrive: u64,
    written: u64,
    last_prune: u64,
    max_end: u64,
    late: u64,
    stats: TraceStats,
}

/// Sorts a request's items by time, stably. They are listed in a few
/// ascending runs (the hop, the request and its phases, the chunks, the
/// ends, the engine levels) that interleave only at their edges: an
/// insertion sort moves few items, where the standard sort's run detection
/// fell back to quicksort on lists this short. Long lists (many chunks) take
/// the standard sort.
fn sort_items(items: &mut [(u64, S)]) {
    if items.len() > 128 {
        items.sort_by_key(|t| t.0);
        return;
    }
    for k in 1..items.len() {
        let x = items[k];
        let mut j = k;
        while j > 0 && items[j - 1].0 > x.0 {
            items[j] = items[j - 1];
            j -= 1;
        }
        items[j] = x;
    }
}

/// What a request's items are made of (see [`Listing::list`]).
struct Listing<'a> {
    req: u32,
    start: u64,
    end: u64,
    arrive: u64,
    track: TrackId,
    hop_track: TrackId,
    spans: &'a [(u64, u64, Phase)],
    /// The phases are the engine's partition.
    engine: bool,
    kv: &'a [(u64, u64)],
    /// The scheduler's queue inside the queue slice ([`super::scheduler_slice`]).
    sched: Option<(u64, u64)>,
    /// Inside it, the span later requests went past ([`super::passed_over_slice`]).
    passed_over: Option<(u64, u64)>,
    /// Inside the first-output slice, the text held back ([`super::held_slice`]).
    held: Option<(u64, u64)>,
    open_decode: bool,
    /// Chunks are drawn, from this time on.
    chunks_from: Option<u64>,
    content: &'a [u64],
    /// The engine's waiting and running intervals.
    levels: &'a [(u64, u64, Level)],
}

impl Listing<'_> {
    /// The items before the chunks, as listed: the hop's begin, the
    /// request's, the in-flight rise, the read delay and the phases with
    /// their kv transfers. Returns the kv slices listed.
    fn head(&self, items: &mut Vec<(u64, S)>) -> u64 {
        let (req, track, start) = (self.req, self.track, self.start);
        let mut kv_slices = 0;
        // The hop's end is listed second, after its begin: put in its place
        // once the rest is sorted, not moved past every item.
        items.push((start, S::I(Item::HopBegin { req, track: self.hop_track })));
        items.push((start, S::I(Item::RequestBegin { req })));
        items.push((start, S::I(Item::Level { which: Level::InFlight, delta: 1 })));
        if start < self.arrive {
            items.push((start, S::I(Item::PhaseBegin { req, phase: Phase::ReadDelay })));
            items.push((self.arrive, S::I(Item::End { track })));
        }
        for &(a, b, phase) in self.spans {
            items.push((a, S::I(Item::PhaseBegin { req, phase })));
            if let Some((s, e)) = self.sched.filter(|_| self.engine && phase == Phase::Queue) {
                items.push((s, S::I(Item::PhaseBegin { req, phase: Phase::SchedulerQueue })));
                if let Some((ps, pe)) = self.passed_over {
                    items.push((ps, S::I(Item::PhaseBegin { req, phase: Phase::PassedOver })));
                    items.push((pe, S::I(Item::End { track })));
                }
                items.push((e, S::I(Item::End { track })));
            }
            if let Some((s, e)) = self.held.filter(|_| self.engine && phase == Phase::FirstOutput) {
                items.push((s, S::I(Item::PhaseBegin { req, phase: Phase::HeldBack })));
                items.push((e, S::I(Item::End { track })));
            }
            if self.engine && matches!(phase, Phase::Queue | Phase::Prefill) {
                for &(ka, kb) in self.kv {
                    let (ka, kb) = (ka.max(a), kb.min(b));
                    if kb > ka {
                        items.push((ka, S::I(Item::KvBegin { req, ns: kb - ka })));
                        items.push((kb, S::I(Item::End { track })));
                        kv_slices += 1;
                    }
                }
            }
            if !(self.open_decode && phase == Phase::Decode) {
                items.push((b, S::I(Item::End { track })));
            }
        }
        kv_slices
    }

    /// The chunks' times, in order (clamped: never before the previous one).
    fn chunks(&self) -> impl Iterator<Item = u64> + '_ {
        let end = self.end;
        let mut at = self.chunks_from.unwrap_or(0);
        let content = if self.chunks_from.is_some() { self.content } else { &[] };
        content.iter().map(move |&c| {
            at = c.clamp(at, end);
            at
        })
    }

    /// The items after the chunks, all at the request's end: the decode's
    /// and the request's ends, the in-flight fall.
    fn tail(&self) -> impl Iterator<Item = (u64, S)> {
        let (end, track) = (self.end, self.track);
        let open = self.open_decode.then_some((end, S::I(Item::End { track })));
        open.into_iter().chain([(end, S::I(Item::End { track })), (end, S::I(Item::Level { which: Level::InFlight, delta: -1 }))])
    }

    /// The engine's level changes, as listed.
    fn level_items(&self) -> impl Iterator<Item = (u64, S)> + '_ {
        self.levels.iter().flat_map(|&(a, b, which)| [(a, S::I(Item::Level { which, delta: 1 })), (b, S::I(Item::Level { which, delta: -1 }))])
    }

    /// The hop's end, where the stable sort would have put it as the
    /// second item listed: after every earlier item and after the hop's
    /// begin when that is at the same time (the first item listed), before
    /// the other items at its time. Listed second, it stood before most of
    /// the request's items in time and the insertion sort moved each of
    /// them past it: a quarter of the sort's moves.
    fn place_hop_end(&self, items: &mut Vec<(u64, S)>) {
        let at = items.partition_point(|t| t.0 < self.end) + usize::from(self.start == self.end);
        items.insert(at, (self.end, S::I(Item::End { track: self.hop_track })));
    }

    /// The request's items in drawing order: everything listed (head,
    /// chunks, tail, the engine's levels, the track's retirement), sorted
    /// by time, stably. The reference for [`list`](Self::list).
    fn list_by_sorting(&self) -> (Vec<(u64, S)>, u64) {
        let mut items = Vec::with_capacity(16 + 2 * self.content.len());
        let kv = self.head(&mut items);
        items.extend(self.chunks().map(|at| (at, S::I(Item::Chunk { req: self.req }))));
        items.extend(self.tail());
        items.extend(self.level_items());
        // The track is retired once its items up to the request's end are drawn.
        items.push((self.end, S::Retire { track: self.track }));
        // Stable by time: a track's items keep their nesting order at equal times.
        sort_items(&mut items);
        self.place_hop_end(&mut items);
        (items, kv)
    }

    /// [`list_by_sorting`](Self::list_by_sorting)'s items, put together in
    /// order: only the head is sorted (it is short and nearly in order);
    /// the chunks are in order and merged with it, the tail is at the end
    /// (after everything), the few level changes are merged in. Sorting it
    /// all moved each chunk past the decode's end and each level change
    /// past the chunks after it: ~1,300 instructions a request. None
    /// (nothing listed) when the head reaches past the end, where the
    /// tail would not be last: the caller sorts.
    fn list(&self, head: &mut Vec<(u64, S)>) -> Option<(Vec<(u64, S)>, u64)> {
        head.clear();
        let kv = self.head(head);
        sort_items(head);
        if head.last().is_some_and(|t| t.0 > self.end) {
            return None;
        }
        let mut lv = [(0, S::I(Item::Meta)); 4];
        let mut n = 0;
        for t in self.level_items() {
            lv[n] = t;
            n += 1;
        }
        sort_items(&mut lv[..n]);
        let lv = &lv[..n];
        let mut items = Vec::with_capacity(head.len() + self.content.len() + 8);
        // Level changes are listed after everything but the retirement:
        // one goes before an item only when earlier than it.
        let (mut i, mut k) = (0, 0);
        // The next level change's time (none: past every item's).
        let mut due = lv.first().map_or(u64::MAX, |t| t.0);
        let mut put = |items: &mut Vec<(u64, S)>, t: (u64, S)| {
            if t.0 > due {
                while k < lv.len() && lv[k].0 < t.0 {
                    items.push(lv[k]);
                    k += 1;
                }
                due = lv.get(k).map_or(u64::MAX, |t| t.0);
            }
            items.push(t);
        };
        for at in self.chunks() {
            // The head's items at the chunk's time were listed before it.
            while i < head.len() && head[i].0 <= at {
                put(&mut items, head[i]);
                i += 1;
            }
            put(&mut items, (at, S::I(Item::Chunk { req: self.req })));
        }
        for &t in &head[i..] {
            put(&mut items, t);
        }
        for t in self.tail() {
            put(&mut items, t);
        }
        // The retirement after the level changes up to its time.
        while k < lv.len() && lv[k].0 <= self.end {
            items.push(lv[k]);
            k += 1;
        }
        items.push((self.end, S::Retire { track: self.track }));
        items.extend_from_slice(&lv[k..]);
        self.place_hop_end(&mut items);
        Some((items, kv))
    }
}

impl RequestStream {
    /// Declares the request part's groups (on the current sequence) and its
    /// own sequence for what follows.
    pub fn new<W: Write>(w: &mut TraceWriter<W>, t0: u64) -> Result<Self, PerfettoError> {
        let g = groups(w)?;
        let prev = w.sequence();
        w.use_new_sequence();
        let seq = w.sequence();
        let in_flight = w.counter_track(names::IN_FLIGHT, CounterUnit::Count, TrackOpts { parent: Some(g.requests), rank: Some(0), ..TrackOpts::default() });
        w.set_sequence(prev);
        Ok(RequestStream {
            g,
            seq,
            t0,
            heap: BinaryHeap::new(),
            head: Vec::new(),
            chunk_name: NameIid::default(),
            queued: 0,
            reqs: Vec::new(),
            cursors: Vec::new(),
            free: Vec::new(),
            live: 0,
            next_req: 0,
            chains: FxMap::default(),
            chain_rank: 0,
            level_tracks: [Some(in_flight), None, None],
            level_now: [0; 3],
            level_shown: [None; 3],
            levels_moved: true,
            cur_ts: None,
            open_hops: HashSet::default(),
            latest_arrive: 0,
            written: 0,
            last_prune: 0,
            max_end: t0,
            late: 0,
            stats: TraceStats::default(),
        })
    }

    /// Requests and what is queued to draw (for tests and memory checks).
    pub fn held(&self) -> (usize, usize) {
        (self.live, self.queued)
    }

    /// Lists a final request's items (`now`: the end of an unfinished one).
    pub fn push<W: Write>(&mut self, w: &mut TraceWriter<W>, raw: &mut RawLayout, r: Request, now: u64) -> Result<(), PerfettoError> {
        let (start, end) = request_span(&r, now);
        self.latest_arrive = self.latest_arrive.max(r.arrive_ns);
        let mut steps = r.engine.as_ref().and_then(|e| raw.take_step_flows(&e.engine_request_id)).unwrap_or_default();
        if start < self.written || self.cur_ts.is_some_and(|c| start < c) {
            self.late += 1;
            raw.step_flows_not_drawn(u64::from(steps.drawn[0] + steps.drawn[1]), 0, steps.count(false) + steps.count(true));
            return Ok(());
        }
        self.max_end = self.max_end.max(end);
        if r.conn.tgid != 0 {
            let t = raw.process(w, r.conn.tgid);
            w.describe(t)?;
        }
        let prev = w.sequence();
        w.set_sequence(self.seq);
        let req = self.next_req;
        self.next_req += 1;
        self.stats.requests += 1;
        if r.hop <= 1 {
            self.stats.chains += 1;
        }
        // Chains: one track per chain (plus a lane per overlap), one slice per hop.
        if !self.chains.contains_key(&r.chain) {
            self.chains.insert(r.chain.clone(), ChainLanes { lanes: Vec::new(), last_end: 0 });
        }
        let ch = self.chains.get_mut(&r.chain).expect("inserted");
        let lane = match ch.lanes.iter().position(|(_, free_at)| *free_at <= start) {
            Some(l) => l,
            None => {
                let name = if ch.lanes.is_empty() { r.chain.clone() } else { format!("{} (overlap {})", r.chain, ch.lanes.len()) };
                let t = w.track(&name, TrackOpts { parent: Some(self.g.chains), rank: Some(self.chain_rank), ..TrackOpts::default() });
                self.chain_rank = self.chain_rank.saturating_add(1);
                ch.lanes.push((t, 0));
                self.stats.chain_tracks += 1;
                ch.lanes.len() - 1
            }
        };
        ch.lanes[lane].1 = end;
        ch.last_end = ch.last_end.max(end);
        let hop_track = ch.lanes[lane].0;
        let flow = w.new_flow_id();
        let rank = (req as usize).min(i32::MAX as usize - 1) as i32 + 1;
        let track = w.track(&r.id, TrackOpts { parent: Some(self.g.requests), rank: Some(rank), ..TrackOpts::default() });
        let arrive = r.arrive_ns.clamp(start, end);
        let spans = phase_spans(&r, arrive, end);
        // The offline layout's accounting: flows to a phase that is drawn,
        // the rest of its steps capped; a phase not drawn, all of them.
        for (phase, decode) in [(Phase::Prefill, false), (Phase::Decode, true)] {
            let drawn = u64::from(steps.drawn[usize::from(decode)]);
            let n = steps.count(decode);
            if spans.iter().any(|s| s.2 == phase) {
                self.stats.step_flows += n;
                raw.step_flows_not_drawn(0, drawn - n, 0);
            } else {
                steps.drop_phase(decode);
                raw.step_flows_not_drawn(0, drawn, n);
            }
        }
        let marks = crate::correlate::engine::marks(&r);
        let engine = marks.as_ref().is_some_and(|m| m.arrive == arrive && m.done == end);
        let wire_ttft = r.ttft_ns.filter(|_| !engine).map(|t| t.clamp(arrive, end));
        let mut levels = [(0, 0, Level::Waiting); 2];
        let mut n_levels = 0;
        if let Some(m) = &marks {
            for (a, b, which) in [(m.submit, m.scheduled, Level::Waiting), (m.scheduled, m.done, Level::Running)] {
                if b > a {
                    if self.level_tracks[Level::Running as usize].is_none() {
                        // Both, as soon as a request has engine marks (as the whole layout).
                        let server = raw.server(w);
                        for (l, name) in [(Level::Running, names::RUNNING), (Level::Waiting, names::WAITING_REQS)] {
                            self.level_tracks[l as usize] = Some(w.counter_track(name, CounterUnit::Count, TrackOpts { parent: Some(server), ..TrackOpts::default() }));
                        }
                        // Their zero is drawn at the next flush.
                        self.levels_moved = true;
                    }
                    levels[n_levels] = (a, b, which);
                    n_levels += 1;
                }
            }
        }
        w.set_sequence(prev);
        let kv = r.gpu.as_ref().map_or(&[][..], |g| g.kv_spans());
        let sched = spans.iter().find(|s| s.2 == Phase::Queue).and_then(|&(a, b, _)| super::scheduler_slice(&r, a, b, kv));
        let passed_over = sched.and_then(|q| super::passed_over_slice(&r, q));
        let held = spans.iter().find(|s| s.2 == Phase::FirstOutput).and_then(|&(a, b, _)| super::held_slice(&r, a, b));
        let l = Listing {
            req,
            start,
            end,
            arrive,
            track,
            hop_track,
            spans: &spans,
            engine,
            kv,
            sched,
            passed_over,
            held,
            open_decode: wire_ttft.is_some() && spans.iter().any(|s| s.2 == Phase::Decode),
            chunks_from: if engine || wire_ttft.is_some() { Some(wire_ttft.unwrap_or(arrive)) } else { None },
            content: &r.content_ns,
            levels: &levels[..n_levels],
        };
        let (items, kv) = match l.list(&mut self.head) {
            Some(listed) => listed,
            None => l.list_by_sorting(),
        };
        self.stats.kv_slices += kv;
        self.queued += items.len();
        self.live += 1;
        let first = items[0].0;
        let held = Some(Held { r, flow: Some(flow), steps, args: None });
        let cursor = Cursor { items, next: 0, track };
        let slot = match self.free.pop() {
            Some(k) => {
                self.reqs[k as usize] = held;
                self.cursors[k as usize] = cursor;
                k
            }
            None => {
                self.reqs.push(held);
                self.cursors.push(cursor);
                (self.reqs.len() - 1) as u32
            }
        };
        self.heap.push(Reverse(key(first, req, slot)));
        self.stats.held_requests_peak = self.stats.held_requests_peak.max(self.live as u64);
        self.stats.held_items_peak = self.stats.held_items_peak.max(self.queued as u64);
        Ok(())
    }

    /// Writes what no request still to come can precede.
    pub fn advance<W: Write>(&mut self, w: &mut TraceWriter<W>, raw: &mut RawLayout) -> Result<(), PerfettoError> {
        let mark = self.latest_arrive.saturating_sub(READ_SLACK_NS);
        self.write_until(w, raw, mark)?;
        if mark >= self.last_prune.saturating_add(CHAIN_IDLE_NS / 4) {
            self.last_prune = mark;
            let idle: Vec<String> = self.chains.iter().filter(|(_, c)| c.last_end.saturating_add(CHAIN_IDLE_NS) < self.written).map(|(k, _)| k.clone()).collect();
            for k in idle {
                if let Some(c) = self.chains.remove(&k) {
                    for (t, _) in c.lanes {
                        w.retire(t)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn write_until<W: Write>(&mut self, w: &mut TraceWriter<W>, raw: &mut RawLayout, mark: u64) -> Result<(), PerfettoError> {
        loop {
            let Some(mut top) = self.heap.peek_mut() else { break };
            let Reverse(k) = *top;
            let (ts, req, slot) = unkey(k);
            if ts >= mark {
                break;
            }
            let h = &mut self.cursors[slot as usize];
            let s = h.items[h.next].1;
            h.next += 1;
            let last = h.next == h.items.len();
            match h.items.get(h.next) {
                // Its next item, in the top's place (one sift instead of a pop and a push).
                Some(&(next, _)) => {
                    *top = Reverse(key(next, req, slot));
                    drop(top);
                }
                None => {
                    std::collections::binary_heap::PeekMut::pop(top);
                }
            }
            self.queued -= 1;
            self.draw(w, raw, ts, slot, s)?;
            if last {
                self.reqs[slot as usize] = None;
                self.cursors[slot as usize].items = Vec::new();
                self.free.push(slot);
            }
        }
        Ok(())
    }

    fn flush_levels<W: Write>(&mut self, w: &mut TraceWriter<W>, at: u64) -> Result<(), PerfettoError> {
        if !self.levels_moved {
            return Ok(());
        }
        self.levels_moved = false;
        for l in 0..3 {
            if let Some(t) = self.level_tracks[l] {
                if self.level_shown[l] != Some(self.level_now[l]) {
                    w.counter(at, t, self.level_now[l])?;
                    self.level_shown[l] = Some(self.level_now[l]);
                }
            }
        }
        Ok(())
    }

    /// Draws one item of the request held in `slot`.
    fn draw<W: Write>(&mut self, w: &mut TraceWriter<W>, _raw: &mut RawLayout, ts: u64, slot: u32, s: S) -> Result<(), PerfettoError> {
        match self.cur_ts {
            None => {
                // The counters start at zero when the trace does.
                let at = self.t0.min(ts);
                self.flush_levels(w, at)?;
                self.cur_ts = Some(ts);
            }
            Some(c) if ts > c => {
                // Checked here too: most items move no level, and the call cost more than the check.
                if self.levels_moved {
                    self.flush_levels(w, c)?;
                }
                self.cur_ts = Some(ts);
            }
            Some(_) => {}
        }
        self.written = self.written.max(ts);
        let item = match s {
            S::Retire { track } => {
                self.live -= 1;
                return w.retire(track);
            }
            S::I(i) => i,
        };
        match item {
            Item::HopBegin { req: _, track } => {
                let h = self.reqs[slot as usize].as_ref().expect("a drawn request is held");
                let args = super::hop_args(&h.r);
                let name = super::hop_label(&h.r);
                let ids = h.flow.as_slice();
                self.open_hops.extend(ids);
                w.begin(ts, track, &Event::named_once(&name).args(&args).flows(ids))?;
            }
            Item::RequestBegin { req: _ } => {
                let h = self.reqs[slot as usize].as_mut().expect("a drawn request is held");
                let held = h.args.get_or_insert_with(|| RequestArgs::of(&h.r));
                let args = held.args(&h.r);
                let id = h.flow.filter(|id| self.open_hops.remove(id));
                let track = self.cursors[slot as usize].track;
                w.begin(ts, track, &Event::named_once(&h.r.id).args(&args).terminating_flows(id.as_slice()))?;
            }
            Item::PhaseBegin { req: _, phase: Phase::PassedOver } => {
                let track = self.cursors[slot as usize].track;
                let h = self.reqs[slot as usize].as_ref().expect("a drawn request is held");
                let args = super::passed_over_args(&h.r);
                w.begin(ts, track, &Event::named(Phase::PassedOver.name()).args(&args))?;
            }
            Item::PhaseBegin { req: _, phase: Phase::HeldBack } => {
                let track = self.cursors[slot as usize].track;
                let h = self.reqs[slot as usize].as_ref().expect("a drawn request is held");
                let args = super::held_args(&h.r);
                w.begin(ts, track, &Event::named(Phase::HeldBack.name()).args(&args))?;
            }
            Item::PhaseBegin { req: _, phase } => {
                let track = self.cursors[slot as usize].track;
                if phase.has_figures() {
                    let h = self.reqs[slot as usize].as_mut().expect("a drawn request is held");
                    let args = h.args.get_or_insert_with(|| RequestArgs::of(&h.r)).phase_args(phase);
                    // Named in `flow_ids` (not terminating): the step may come
                    // first or last in time (see `Ends`).
                    let mut ids = [0u64; super::FLOW_HEAD + 1];
                    let mut n = 0;
                    if matches!(phase, Phase::Prefill | Phase::Decode) {
                        for id in h.steps.ids(phase == Phase::Decode) {
                            ids[n] = id;
                            n += 1;
                        }
                    }
                    w.begin(ts, track, &Event::named(phase.name()).args(&args).flows(&ids[..n]))?;
                } else {
                    w.begin(ts, track, &Event::named(phase.name()))?;
                }
            }
            Item::KvBegin { req: _, ns } => {
                let track = self.cursors[slot as usize].track;
                let args = [Arg::f64("kv_transfer_ms", ns as f64 / 1e6)];
                w.begin(ts, track, &Event::named(Phase::KvTransfer.name()).args(&args))?;
            }
            Item::Chunk { req: _ } => {
                let track = self.cursors[slot as usize].track;
                w.instant_known(ts, track, names::CHUNK, &mut self.chunk_name)?;
            }
            Item::End { track } => w.end(ts, track)?,
            Item::Level { which, delta } => {
                self.level_now[which as usize] += delta as i64;
                self.levels_moved = true;
            }
            Item::Meta | Item::DropFinal => {}
        }
        Ok(())
    }

    /// Lists the requests the correlator still held, writes everything, the
    /// loss counters' final values and the metadata instant.
    #[allow(clippy::too_many_arguments)]
    pub fn finish<W: Write>(
        mut self,
        w: &mut TraceWriter<W>,
        raw: &mut RawLayout,
        meta: &Meta,
        tail: &mut Analysis,
        last_ts: u64,
        read_error: Option<&str>,
    ) -> Result<TraceStats, PerfettoError> {
        // The end of the recording, as the whole layout takes it: unfinished
        // requests are drawn up to it.
        let mut t_end = tail.last_ns.unwrap_or(self.t0).max(self.t0).max(last_ts).max(self.max_end);
        for r in &tail.requests {
            t_end = t_end.max(request_span(r, 0).1);
        }
        for r in std::mem::take(&mut tail.requests) {
            self.push(w, raw, r, t_end)?;
        }
        raw.drop_step_flows();
        self.write_until(w, raw, u64::MAX)?;
        if let Some(c) = self.cur_ts {
            self.flush_levels(w, c)?;
        }
        for (name, v) in &tail.drops {
            raw.drop_value(w, name, t_end, *v)?;
        }
        let mut stats = self.stats;
        stats.add_raw(&raw.stats, raw.draws_gpu_flows());
        let strings = MetaStrings::of(meta, &tail.drops);
        let mut a = meta_args(meta, &strings, stats.requests, stats.chains, read_error, &tail.drops, &stats);
        a.extend([Arg::u64("trace.requests_late", self.late), Arg::u64("trace.flows_not_streamed", stats.flows_not_streamed)]);
        let meta_track = raw.meta_track(w);
        w.instant(self.t0, meta_track, &Event::named(names::META_EVENT).args(&a))?;
        stats.requests_late = self.late;
        Ok(stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::perfetto::Encoding;

    #[test]
    fn requests_items_put_together_in_order_are_the_stably_sorted_listing() {
        // Random requests' listings, the chunks and level changes anywhere
        // (before the start, past the end, at equal times), phases past
        // the end now and then (the sorted listing is kept then): put
        // together, they are the stably sorted listing, item for item.
        let mut w = TraceWriter::with_encoding(Vec::new(), 0, Encoding::PLAIN).expect("writer");
        let (track, hop_track) = (w.track("r", TrackOpts::default()), w.track("h", TrackOpts::default()));
        let mut next = crate::testutil::xorshift(0x9e37_79b9_7f4a_7c15);
        let phases = [Phase::Frontend, Phase::Queue, Phase::Prefill, Phase::FirstOutput, Phase::Decode, Phase::Waiting];
        let (mut fast, mut sorted) = (0, 0);
        let mut head = Vec::new();
        for round in 0..20_000u32 {
            // Few distinct times, so that many items share one.
            let span = 1 + next() % if round % 3 == 0 { 8 } else { 1000 };
            let t = |next: &mut dyn FnMut() -> u64| next() % (span + 4);
            let start = t(&mut next);
            let end = start + t(&mut next) % (span + 1);
            let arrive = (start + t(&mut next)).min(end);
            let spans: Vec<(u64, u64, Phase)> = (0..next() % 6)
                .map(|k| {
                    // Mostly within the request, sometimes anywhere.
                    let (a, b) = if next().is_multiple_of(16) {
                        let a = t(&mut next);
                        (a, a + 1 + t(&mut next))
                    } else {
                        let a = start + t(&mut next) % (end - start + 1);
                        (a, (a + 1 + t(&mut next) % 8).min(end.max(a + 1)))
                    };
                    (a, b, phases[(k as usize + next() as usize) % phases.len()])
                })
                .collect();
            let kv: Vec<(u64, u64)> = (0..next() % 3).map(|_| (t(&mut next), t(&mut next))).collect();
            let content: Vec<u64> = (0..next() % 40).map(|_| t(&mut next)).collect();
            let levels: Vec<(u64, u64, Level)> = (0..next() % 3)
                .map(|k| {
                    let a = t(&mut next) + if next().is_multiple_of(8) { end } else { 0 };
                    (a, a + 1 + t(&mut next), if k == 0 { Level::Waiting } else { Level::Running })
                })
                .collect();
            let engine = next().is_multiple_of(2);
            let sched = next().is_multiple_of(2).then(|| {
                let a = t(&mut next);
                (a, a + 1 + t(&mut next))
            });
            // Inside it, from its start (a pass span ends at or before it).
            let passed_over = sched.filter(|_| next().is_multiple_of(2)).map(|(a, b)| (a, a + 1 + next() % (b - a)));
            // Inside the first output, from its start.
            let held = spans.iter().find(|s| s.2 == Phase::FirstOutput).filter(|_| next().is_multiple_of(2)).map(|&(a, b, _)| (a, a + next() % (b - a + 1)));
            let l = Listing {
                req: round,
                start,
                end,
                arrive,
                track,
                hop_track,
                spans: &spans,
                engine,
                kv: &kv,
                sched,
                passed_over,
                held,
                open_decode: next().is_multiple_of(2),
                chunks_from: (!next().is_multiple_of(4)).then(|| arrive + t(&mut next) % (end - arrive + 1)),
                content: &content,
                levels: &levels,
            };
            let want = l.list_by_sorting();
            match l.list(&mut head) {
                Some(got) => {
                    fast += 1;
                    assert_eq!(format!("{got:?}"), format!("{want:?}"), "round {round}");
                }
                None => sorted += 1,
            }
        }
        assert!(fast > 12_000 && sorted > 1_000, "{fast} put together, {sorted} sorted");
    }
}
