//! `hopscope trace`: a recording and its analysis as a Perfetto protobuf trace
//! (open it in ui.perfetto.dev). What each track shows: docs/perfetto.md.
//!
//! - [`proto`]: the hand-written prost subset of Perfetto's schema;
//! - [`writer`]: the streaming TracePacket writer (interning, track
//!   descriptors before use, incremental-state flags, balanced slices);
//! - [`check`]: the invariant checker and structure summary tests run on
//!   every trace hopscope writes;
//! - this module: the layout — which tracks exist and what goes on them.
//!
//! The layout first lists every timeline item (a compact `(ts, what)` pair,
//! 24 bytes, far smaller than the records it comes from), sorts them stably
//! by time and then streams them through the writer, so the trace is written
//! in timestamp order with bounded writer memory. Items of one track are
//! listed in their nesting order, and the stable sort keeps that order among
//! equal timestamps. Engine steps, GPU kernels and copies will be further item
//! kinds on further tracks (see docs/perfetto.md, "later").

pub mod check;
pub mod proto;
pub mod writer;

#[cfg(test)]
mod tests;

use crate::correlate::{Analysis, Request};
use crate::model::Record;
use crate::recording::Meta;
use proto::{ChildOrdering, CounterUnit};
use std::collections::{BTreeSet, HashMap};
use std::io::Write;
pub use writer::{Arg, Event, PerfettoError, TrackId, TrackOpts, TraceWriter, Value, WriterStats};

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
    pub const DECODE: &str = "decode";
    pub const CHUNK: &str = "chunk";
    pub const OFF_CPU: &str = "off-cpu";
    pub const RUN_QUEUE: &str = "run queue";
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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    ReadDelay,
    Waiting,
    Decode,
    Frontend,
    Queue,
    Prefill,
    FirstOutput,
}

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::ReadDelay => names::READ_DELAY,
            Phase::Waiting => names::WAITING,
            Phase::Decode => names::DECODE,
            Phase::Frontend => names::FRONTEND,
            Phase::Queue => names::QUEUE,
            Phase::Prefill => names::PREFILL,
            Phase::FirstOutput => names::FIRST_OUTPUT,
        }
    }
}

/// One thing to draw at one time. Indexes point into the input.
#[derive(Debug, Clone, Copy)]
enum Item {
    Meta,
    HopBegin { req: u32, track: TrackId },
    RequestBegin { req: u32 },
    PhaseBegin { req: u32, phase: Phase },
    Chunk { req: u32 },
    StepBegin { step: u32, track: TrackId },
    GpuBegin { rec: u32, track: TrackId },
    StepEnd { step: u32, track: TrackId },
    OffCpuBegin { rec: u32, track: TrackId },
    RunQueueBegin { track: TrackId },
    End { track: TrackId },
    InFlight { delta: i32 },
    DropSnapshot { rec: u32 },
    DropFinal,
}

#[derive(Debug, Clone, Copy)]
struct Timed {
    ts: u64,
    item: Item,
}

/// The span a request's slice covers: from the wire arrival (else the read of
/// its first byte) to the write of its last byte, or to the end of the
/// recording when it never finished.
fn request_span(r: &Request, recording_end: u64) -> (u64, u64) {
    let start = r.wire_arrive_ns.filter(|w| *w <= r.arrive_ns).unwrap_or(r.arrive_ns);
    let end = match r.done_ns {
        Some(d) => d,
        None => {
            let seen = [Some(r.request_end_ns), r.response_head_ns, r.ttft_ns, r.content_ns.last().copied()];
            seen.into_iter().flatten().fold(recording_end, u64::max)
        }
    };
    (start, end.max(start))
}

/// The name Perfetto shows for a process: its comm from the recording's
/// process events (exec wins over exit over fork), else "pid N".
fn process_names(records: &[Record]) -> HashMap<u32, String> {
    let mut best: HashMap<u32, (u8, &str)> = HashMap::new();
    for r in records {
        if let Record::Proc { op, child_tgid, comm, .. } = r {
            if comm.is_empty() {
                continue;
            }
            let rank = match op {
                crate::event::ProcOp::Fork => 1,
                crate::event::ProcOp::Exit => 2,
                crate::event::ProcOp::Exec => 3,
            };
            let e = best.entry(*child_tgid).or_insert((rank, comm));
            if rank >= e.0 {
                *e = (rank, comm);
            }
        }
    }
    best.into_iter().map(|(pid, (_, c))| (pid, c.to_owned())).collect()
}

/// CUpti_ActivityMemcpyKind as a slice name.
fn memcpy_name(kind: u8) -> &'static str {
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

fn state_name(prev_state: u32) -> &'static str {
    // Linux task states at switch-out (include/linux/sched.h).
    match prev_state {
        0 => "preempted",
        1 => "sleeping",
        2 => "uninterruptible",
        _ => "other",
    }
}

/// Writes the trace of `input` into `out` (wrap files in a `BufWriter`) and
/// returns the writer's output and what was drawn.
pub fn write_trace<W: Write>(out: W, input: TraceInput<'_>) -> Result<(W, TraceStats), PerfettoError> {
    let TraceInput { meta, records, analysis, read_error } = input;
    let mut stats = TraceStats { requests: analysis.requests.len() as u64, chains: analysis.chains.len() as u64, ..TraceStats::default() };

    // Time bounds: the recording's start (when known) to its last event.
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
    let mut t_end = analysis.last_ns.unwrap_or(t0).max(t0);
    for r in &analysis.requests {
        t_end = t_end.max(request_span(r, t0).1);
    }

    let mut w = TraceWriter::new(out, t0)?;
    let mut items: Vec<Timed> = Vec::new();
    items.push(Timed { ts: t0, item: Item::Meta });

    // Metadata and loss.
    let meta_track = w.track(names::META_TRACK, TrackOpts { rank: Some(0), ..TrackOpts::default() });
    // Counter tracks for what was lost; activity counters (events seen, …) only
    // go to the metadata.
    let lossy: Vec<(&str, u64)> =
        analysis.drops.iter().filter(|(k, v)| **v > 0 && crate::sink::report::is_loss(k)).map(|(k, v)| (k.as_str(), *v)).collect();
    let mut drop_tracks: HashMap<&str, TrackId> = HashMap::new();
    for (name, _) in &lossy {
        let t = w.counter_track(&format!("{}{name}", names::DROPS_PREFIX), CounterUnit::Count, TrackOpts { parent: Some(meta_track), ..TrackOpts::default() });
        drop_tracks.insert(name, t);
    }
    for (i, rec) in records.iter().enumerate() {
        if let Record::Drops { ts_ns, counters } = rec {
            if counters.iter().any(|(k, _)| drop_tracks.contains_key(k.as_str())) {
                items.push(Timed { ts: (*ts_ns).clamp(t0, t_end), item: Item::DropSnapshot { rec: i as u32 } });
            }
        }
    }
    if !lossy.is_empty() {
        items.push(Timed { ts: t_end, item: Item::DropFinal });
    }

    // Processes: every pid the recording names.
    let pnames = process_names(records);
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
    let pname = |pid: u32| pnames.get(&pid).cloned().unwrap_or_else(|| format!("pid {pid}"));
    let process_tracks: Vec<TrackId> = pids.iter().map(|&pid| w.process_track(pid, &pname(pid))).collect();
    stats.processes = process_tracks.len() as u64;

    // Chains: one track per chain (plus a lane per overlap), one slice per hop.
    let chains_group = w.track(names::CHAINS, TrackOpts { rank: Some(1), child_ordering: Some(ChildOrdering::Explicit), ..TrackOpts::default() });
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
                    let t = w.track(&name, TrackOpts { parent: Some(chains_group), rank: Some(rank), ..TrackOpts::default() });
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
    let requests_group = w.track(names::REQUESTS, TrackOpts { rank: Some(2), child_ordering: Some(ChildOrdering::Explicit), ..TrackOpts::default() });
    let in_flight = w.counter_track(names::IN_FLIGHT, CounterUnit::Count, TrackOpts { parent: Some(requests_group), rank: Some(0), ..TrackOpts::default() });
    let mut request_tracks = Vec::with_capacity(analysis.requests.len());
    for (i, r) in analysis.requests.iter().enumerate() {
        let track = w.track(&r.id, TrackOpts { parent: Some(requests_group), rank: Some(i.min(i32::MAX as usize - 1) as i32 + 1), ..TrackOpts::default() });
        request_tracks.push(track);
        let req = i as u32;
        let (start, end) = request_span(r, t_end);
        let arrive = r.arrive_ns.clamp(start, end);
        items.push(Timed { ts: start, item: Item::RequestBegin { req } });
        items.push(Timed { ts: start, item: Item::InFlight { delta: 1 } });
        if start < arrive {
            items.push(Timed { ts: start, item: Item::PhaseBegin { req, phase: Phase::ReadDelay } });
            items.push(Timed { ts: arrive, item: Item::End { track } });
        }
        // With the engine IPC joined, the partition's phases; else what the
        // wire alone shows.
        let engine_marks = crate::correlate::engine::marks(r).filter(|m| m.arrive == arrive && m.done == end);
        if let Some(m) = engine_marks {
            let mut spans = vec![(m.arrive, m.submit, Phase::Frontend), (m.submit, m.scheduled, Phase::Queue)];
            match (m.first_token, m.ttft) {
                (Some(f), Some(t)) => spans.extend([(m.scheduled, f, Phase::Prefill), (f, t, Phase::FirstOutput), (t, m.done, Phase::Decode)]),
                (Some(f), None) => spans.extend([(m.scheduled, f, Phase::Prefill), (f, m.done, Phase::Decode)]),
                (None, Some(t)) => spans.extend([(m.scheduled, t, Phase::Prefill), (t, m.done, Phase::Decode)]),
                (None, None) => spans.push((m.scheduled, m.done, Phase::Prefill)),
            }
            for (a, b, phase) in spans {
                if b > a {
                    items.push(Timed { ts: a, item: Item::PhaseBegin { req, phase } });
                    items.push(Timed { ts: b, item: Item::End { track } });
                }
            }
            let mut at = arrive;
            for &c in &r.content_ns {
                at = c.clamp(at, end);
                items.push(Timed { ts: at, item: Item::Chunk { req } });
            }
        } else if let Some(ttft) = r.ttft_ns {
            let ttft = ttft.clamp(arrive, end);
            items.push(Timed { ts: arrive, item: Item::PhaseBegin { req, phase: Phase::Waiting } });
            items.push(Timed { ts: ttft, item: Item::End { track } });
            items.push(Timed { ts: ttft, item: Item::PhaseBegin { req, phase: Phase::Decode } });
            let mut at = ttft;
            for &c in &r.content_ns {
                at = c.clamp(at, end);
                items.push(Timed { ts: at, item: Item::Chunk { req } });
            }
            items.push(Timed { ts: end, item: Item::End { track } });
        }
        items.push(Timed { ts: end, item: Item::End { track } });
        items.push(Timed { ts: end, item: Item::InFlight { delta: -1 } });
    }

    // Engine steps that produced outputs (from the IPC). A step spans from the
    // previous step's end when the engine went straight on (gap under
    // STEP_GAP_NS); otherwise only its end is known: an instant.
    const STEP_GAP_NS: u64 = 250_000_000;
    if !analysis.steps.is_empty() {
        let steps_track = w.track(names::STEPS, TrackOpts { rank: Some(3), ..TrackOpts::default() });
        let mut prev: Option<u64> = None;
        for (k, st) in analysis.steps.iter().enumerate() {
            let end = st.end_ns;
            match prev {
                Some(p) if p < end && end - p <= STEP_GAP_NS => {
                    items.push(Timed { ts: p, item: Item::StepBegin { step: k as u32, track: steps_track } });
                    items.push(Timed { ts: end, item: Item::End { track: steps_track } });
                }
                _ => items.push(Timed { ts: end, item: Item::StepEnd { step: k as u32, track: steps_track } }),
            }
            prev = Some(prev.map_or(end, |p| p.max(end)));
        }
    }

    // Off-CPU intervals on their threads' tracks.
    let mut thread_free_at: HashMap<(u32, u32), u64> = HashMap::new();
    for (i, rec) in records.iter().enumerate() {
        let Record::OffCpu { ts_ns, tgid, tid, off_ns, wake_ns, .. } = rec else { continue };
        let free_at = thread_free_at.get(&(*tgid, *tid)).copied().unwrap_or(0);
        if off_ns > ts_ns || *off_ns < free_at {
            stats.offcpu_skipped += 1;
            continue;
        }
        thread_free_at.insert((*tgid, *tid), *ts_ns);
        let name = (tid == tgid).then(|| pname(*tgid));
        let track = w.thread_track(*tgid, *tid, name.as_deref());
        items.push(Timed { ts: *off_ns, item: Item::OffCpuBegin { rec: i as u32, track } });
        if let Some(wake) = wake_ns.filter(|wk| (*off_ns..=*ts_ns).contains(wk)) {
            items.push(Timed { ts: wake, item: Item::RunQueueBegin { track } });
            items.push(Timed { ts: *ts_ns, item: Item::End { track } });
        }
        items.push(Timed { ts: *ts_ns, item: Item::End { track } });
        stats.offcpu_slices += 1;
    }

    // GPU work: one track per (process, device, stream) under the process. A
    // stream runs its work in order; an item that starts before the previous
    // one ended (clock jitter, or CUPTI's per-node graph records) goes to an
    // overlap lane, since slices on one track must nest.
    const GPU_LANES: u32 = 4;
    let mut gpu: Vec<(u64, u64, u32, u32, u32, usize)> = Vec::new();
    for (i, rec) in records.iter().enumerate() {
        let (ts, end, pid, device, stream) = match rec {
            Record::GpuKernel { ts_ns, end_ns, pid, device, stream, .. }
            | Record::GpuMemcpy { ts_ns, end_ns, pid, device, stream, .. }
            | Record::GpuMemset { ts_ns, end_ns, pid, device, stream, .. } => (*ts_ns, *end_ns, *pid, *device, *stream),
            _ => continue,
        };
        if end < ts || ts < t0 {
            stats.gpu_skipped += 1;
            continue;
        }
        gpu.push((ts, end, pid, device, stream, i));
    }
    gpu.sort_unstable();
    let mut lanes: HashMap<(u32, u32, u32, u32), (TrackId, u64)> = HashMap::new();
    for (ts, end, pid, device, stream, i) in gpu {
        let lane = (0..GPU_LANES).find(|&l| lanes.get(&(pid, device, stream, l)).is_none_or(|&(_, free)| free <= ts));
        let Some(lane) = lane else {
            stats.gpu_skipped += 1;
            continue;
        };
        let track = match lanes.get(&(pid, device, stream, lane)) {
            Some(&(t, _)) => t,
            None => {
                let parent = w.process_track(pid, &pname(pid));
                let name = if lane == 0 { format!("GPU {device} stream {stream}") } else { format!("GPU {device} stream {stream} (overlap {lane})") };
                w.track(&name, TrackOpts { parent: Some(parent), ..TrackOpts::default() })
            }
        };
        lanes.insert((pid, device, stream, lane), (track, end));
        items.push(Timed { ts, item: Item::GpuBegin { rec: i as u32, track } });
        items.push(Timed { ts: end, item: Item::End { track } });
        stats.gpu_slices += 1;
    }

    // Stable: items of one track keep their listed (nesting) order at equal times.
    items.sort_by_key(|t| t.ts);

    let mut in_flight_now: i64 = 0;
    let mut in_flight_shown: Option<i64> = None;
    let mut drops_shown: HashMap<&str, u64> = HashMap::new();
    let mut cur_ts = t0;
    for Timed { ts, item } in items {
        if ts > cur_ts {
            if in_flight_shown != Some(in_flight_now) {
                w.counter(cur_ts, in_flight, in_flight_now)?;
                in_flight_shown = Some(in_flight_now);
            }
            cur_ts = ts;
        }
        match item {
            Item::Meta => {
                w.describe(meta_track)?;
                for t in &process_tracks {
                    w.describe(*t)?;
                }
                w.describe(chains_group)?;
                w.describe(requests_group)?;
                let pids = meta.pids.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
                let command = meta.command.join(" ");
                let mut a = vec![
                    Arg::u64("format_version", meta.format_version as u64),
                    Arg::str("hopscope_version", &meta.hopscope_version),
                    Arg::u64("created_unix_s", meta.created_unix_s),
                    Arg::u64("start_ns", meta.start_ns),
                    Arg::str("pids", &pids),
                    Arg::str("command", &command),
                    Arg::str("kernel", &meta.kernel),
                    Arg::str("hostname", &meta.hostname),
                    Arg::str("chain_header", &meta.chain_header),
                    Arg::u64("capture_len", meta.capture_len as u64),
                    Arg::bool("capture_payload", meta.capture_payload),
                    Arg::bool("gpu", meta.gpu),
                    Arg::u64("requests", analysis.requests.len() as u64),
                    Arg::u64("chains", analysis.chains.len() as u64),
                ];
                if let Some(e) = read_error {
                    a.push(Arg::str("read_error", e));
                }
                let drop_names: Vec<String> = analysis.drops.keys().map(|k| format!("drops.{k}")).collect();
                for ((_, v), n) in analysis.drops.iter().zip(&drop_names) {
                    a.push(Arg::u64(n, *v));
                }
                w.instant(ts, meta_track, &Event::named(names::META_EVENT).args(&a))?;
                for (name, _) in &lossy {
                    w.counter(ts, drop_tracks[name], 0)?;
                    drops_shown.insert(name, 0);
                }
                w.counter(ts, in_flight, 0)?;
                in_flight_shown = Some(0);
            }
            Item::HopBegin { req, track } => {
                let r = &analysis.requests[req as usize];
                let mut args = Vec::with_capacity(20);
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
                if r.done_ns.is_none() {
                    args.push(Arg::bool("unfinished", true));
                }
                let name = format!("hop {}", r.hop);
                let flows = flow_of[req as usize].as_slice();
                w.begin(ts, track, &Event::named(&name).args(&args).flows(flows))?;
            }
            Item::RequestBegin { req } => {
                let r = &analysis.requests[req as usize];
                let status = r.status.map(|s| s.to_string());
                let finish = r.finish_reason.as_deref();
                let mut args = Vec::with_capacity(20);
                args.push(Arg::str("id", &r.id));
                if let Some(x) = &r.x_request_id {
                    args.push(Arg::str("x_request_id", x));
                }
                args.push(Arg::str("chain", &r.chain));
                args.push(Arg::u64("hop", r.hop as u64));
                if let Some(s) = &status {
                    args.push(Arg::interned("status", s));
                }
                args.push(Arg::interned("method", &r.method));
                args.push(Arg::interned("path", &r.path));
                if let Some(v) = r.usage.prompt_tokens {
                    args.push(Arg::u64("prompt_tokens", v));
                }
                if let Some(v) = r.usage.completion_tokens {
                    args.push(Arg::u64("completion_tokens", v));
                }
                if let Some(v) = r.usage.cached_tokens {
                    args.push(Arg::u64("cached_tokens", v));
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
                if let Some(f) = finish {
                    args.push(Arg::interned("finish_reason", f));
                }
                args.push(Arg::u64("pid", r.conn.tgid as u64));
                if r.done_ns.is_none() {
                    args.push(Arg::bool("unfinished", true));
                }
                let flows = flow_of[req as usize].as_slice();
                w.begin(ts, request_tracks[req as usize], &Event::named(&r.id).args(&args).terminating_flows(flows))?;
            }
            Item::PhaseBegin { req, phase } => {
                w.begin(ts, request_tracks[req as usize], &Event::named(phase.name()))?;
            }
            Item::Chunk { req } => {
                w.instant(ts, request_tracks[req as usize], &Event::named(names::CHUNK))?;
            }
            Item::GpuBegin { rec, track } => match &records[rec as usize] {
                Record::GpuKernel { name, grid, block, graph_id, correlation_id, .. } => {
                    let (g, b) = (format!("{}x{}x{}", grid[0], grid[1], grid[2]), format!("{}x{}x{}", block[0], block[1], block[2]));
                    let args = [
                        Arg::str("grid", &g),
                        Arg::str("block", &b),
                        Arg::u64("graph_id", *graph_id as u64),
                        Arg::u64("correlation_id", *correlation_id as u64),
                    ];
                    let name = if name.is_empty() { "<unnamed kernel>" } else { name.as_str() };
                    w.begin(ts, track, &Event::named(name).args(&args))?;
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
            },
            Item::StepBegin { step, track } | Item::StepEnd { step, track } => {
                let st = &analysis.steps[step as usize];
                let tokens: u64 = st.members.iter().map(|m| m.1).sum();
                let firsts = st.members.iter().filter(|m| m.2).count() as u64;
                let args = [
                    Arg::u64("step", step as u64),
                    Arg::u64("requests", st.members.len() as u64),
                    Arg::u64("new_tokens", tokens),
                    Arg::u64("first_tokens", firsts),
                    Arg::u64("sent_ns", st.sent_ns),
                ];
                let ev = Event::named(names::STEP).args(&args);
                if matches!(item, Item::StepBegin { .. }) {
                    w.begin(ts, track, &ev)?;
                } else {
                    w.instant(ts, track, &ev)?;
                }
            }
            Item::OffCpuBegin { rec, track } => {
                let Record::OffCpu { ts_ns, off_ns, wake_ns, prev_state, .. } = &records[rec as usize] else { continue };
                let mut args = Vec::with_capacity(20);
                args.push(Arg::interned("state", state_name(*prev_state)));
                args.push(Arg::u64("prev_state", *prev_state as u64));
                if let Some(wake) = wake_ns.filter(|wk| (*off_ns..=*ts_ns).contains(wk)) {
                    args.push(Arg::f64("runq_delay_ms", (ts_ns - wake) as f64 / 1e6));
                }
                w.begin(ts, track, &Event::named(names::OFF_CPU).args(&args))?;
            }
            Item::RunQueueBegin { track } => {
                w.begin(ts, track, &Event::named(names::RUN_QUEUE))?;
            }
            Item::End { track } => w.end(ts, track)?,
            Item::InFlight { delta } => in_flight_now += delta as i64,
            Item::DropSnapshot { rec } => {
                let Record::Drops { counters, .. } = &records[rec as usize] else { continue };
                for (k, v) in counters {
                    if let Some(&t) = drop_tracks.get(k.as_str()) {
                        let shown = drops_shown.get_mut(k.as_str()).expect("every drop track starts shown");
                        if *shown != *v {
                            w.counter(ts, t, i64::try_from(*v).unwrap_or(i64::MAX))?;
                            *shown = *v;
                        }
                    }
                }
            }
            Item::DropFinal => {
                for (name, v) in &lossy {
                    if drops_shown.get(name) != Some(v) {
                        w.counter(ts, drop_tracks[name], i64::try_from(*v).unwrap_or(i64::MAX))?;
                        drops_shown.insert(name, *v);
                    }
                }
            }
        }
    }
    if in_flight_shown != Some(in_flight_now) {
        w.counter(cur_ts, in_flight, in_flight_now)?;
    }
    let (out, ws) = w.finish()?;
    stats.writer = ws;
    Ok((out, stats))
}
