//! A streaming Perfetto TrackEvent writer: one packet at a time, straight to a
//! [`Write`], with bounded memory (one packet buffer, the intern tables and the
//! track table; never the trace).
//!
//! What it guarantees, so that callers cannot produce a trace the UI
//! half-reads (`check` verifies every one of these on the decoded output):
//! - every packet carries the writer's `trusted_packet_sequence_id`;
//! - the first packet clears the sequence's incremental state
//!   (`SEQ_INCREMENTAL_STATE_CLEARED`), sets `TracePacketDefaults`
//!   (timestamps are CLOCK_MONOTONIC ns) and a `ClockSnapshot` that makes
//!   CLOCK_MONOTONIC the trace's primary clock; every later packet says
//!   `SEQ_NEEDS_INCREMENTAL_STATE`;
//! - event names, debug-annotation names and interned string values are sent
//!   once, in the packet that first uses them (`interned_data`), then by iid;
//! - a track's descriptor (and its parents', parents first) is written before
//!   the first event on it;
//! - timestamps never go backwards on the sequence;
//! - slice ends match begins on every track, and counters go only to counter
//!   tracks.
//!
//! Track uuids are small sequential numbers (1, 2, …): they are repeated in
//! every event, and a one-byte varint keeps slices small. They are unique
//! within one file; merging with another producer's trace would need an offset.

use super::proto::{self, ChildOrdering, CounterUnit, EventType};
use prost::Message;
use std::collections::HashMap;
use std::io::{self, Write};

/// The sequence id hopscope's packets carry (0 is invalid in Perfetto).
pub const SEQUENCE_ID: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum PerfettoError {
    #[error("writing the perfetto trace: {0}")]
    Io(#[from] io::Error),
    #[error("timestamp went backwards on the sequence: {ts} ns after {last} ns")]
    TimestampRegression { ts: u64, last: u64 },
    #[error("track {0} was never declared")]
    UnknownTrack(u64),
    #[error("track {uuid} ({name}) is a counter track: only counter values go there")]
    SliceOnCounterTrack { uuid: u64, name: String },
    #[error("track {uuid} ({name}) is not a counter track")]
    CounterOnSliceTrack { uuid: u64, name: String },
    #[error("slice end on track {uuid} ({name}) without an open slice")]
    UnbalancedEnd { uuid: u64, name: String },
    #[error("{open} slice(s) still open at the end of the trace (first on track {uuid}, {name})")]
    OpenSlices { open: u64, uuid: u64, name: String },
}

/// A declared track: its uuid. Cheap to copy; only valid with the writer that made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TrackId(u64);

impl TrackId {
    pub fn uuid(self) -> u64 {
        self.0
    }
}

/// Where a plain or counter track sits in the UI.
#[derive(Debug, Clone, Copy, Default)]
pub struct TrackOpts {
    /// Nest under this track (a process or thread parent makes the track a
    /// sibling of that process's tracks, see Perfetto's TrackDescriptor).
    pub parent: Option<TrackId>,
    /// How the UI orders this track's children.
    pub child_ordering: Option<ChildOrdering>,
    /// Position among siblings when the parent orders explicitly (lower first).
    pub rank: Option<i32>,
}

/// A debug-annotation value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value<'a> {
    /// A string sent inline (ids and other values that rarely repeat).
    Str(&'a str),
    /// A string sent once and then by iid (values that repeat: paths, methods, states).
    Interned(&'a str),
    U64(u64),
    I64(i64),
    F64(f64),
    Bool(bool),
}

/// One debug annotation (shown as the event's "args" in the UI).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Arg<'a> {
    pub name: &'a str,
    pub value: Value<'a>,
}

impl<'a> Arg<'a> {
    pub fn str(name: &'a str, v: &'a str) -> Self {
        Arg { name, value: Value::Str(v) }
    }
    pub fn interned(name: &'a str, v: &'a str) -> Self {
        Arg { name, value: Value::Interned(v) }
    }
    pub fn u64(name: &'a str, v: u64) -> Self {
        Arg { name, value: Value::U64(v) }
    }
    pub fn i64(name: &'a str, v: i64) -> Self {
        Arg { name, value: Value::I64(v) }
    }
    pub fn f64(name: &'a str, v: f64) -> Self {
        Arg { name, value: Value::F64(v) }
    }
    pub fn bool(name: &'a str, v: bool) -> Self {
        Arg { name, value: Value::Bool(v) }
    }
}

/// What a slice begin or an instant says: its (interned) name, annotations and flows.
#[derive(Debug, Clone, Copy, Default)]
pub struct Event<'a> {
    pub name: &'a str,
    pub args: &'a [Arg<'a>],
    /// Flows leaving this slice (continued by the next event naming the same id).
    pub flow_ids: &'a [u64],
    /// Flows that end at this slice.
    pub terminating_flow_ids: &'a [u64],
}

impl<'a> Event<'a> {
    pub fn named(name: &'a str) -> Self {
        Event { name, ..Event::default() }
    }
    pub fn args(mut self, args: &'a [Arg<'a>]) -> Self {
        self.args = args;
        self
    }
    pub fn flows(mut self, ids: &'a [u64]) -> Self {
        self.flow_ids = ids;
        self
    }
    pub fn terminating_flows(mut self, ids: &'a [u64]) -> Self {
        self.terminating_flow_ids = ids;
        self
    }
}

/// What the writer has written so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriterStats {
    pub packets: u64,
    pub bytes: u64,
    pub track_descriptors: u64,
    pub slices: u64,
    pub instants: u64,
    pub counter_values: u64,
    /// Strings sent in `interned_data` (event names, annotation names, values).
    pub interned: u64,
    pub flows: u64,
}

impl WriterStats {
    /// Track events of any kind (slice begins and ends, instants, counter values).
    pub fn events(&self) -> u64 {
        self.slices * 2 + self.instants + self.counter_values
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Slices,
    Counter,
}

struct TrackDecl {
    /// Until written: the descriptor to write.
    pending: Option<proto::TrackDescriptor>,
    parent: Option<u64>,
    kind: Kind,
    /// Open slices on the track.
    depth: u32,
    /// For error messages.
    name: Box<str>,
}

/// Strings sent once per sequence, then referred to by iid.
#[derive(Default)]
struct Interner {
    ids: HashMap<Box<str>, u64>,
}

impl Interner {
    /// The iid of `s`, and whether it is new (must be sent in this packet).
    fn get(&mut self, s: &str) -> (u64, bool) {
        if let Some(&iid) = self.ids.get(s) {
            return (iid, false);
        }
        let iid = self.ids.len() as u64 + 1;
        self.ids.insert(s.into(), iid);
        (iid, true)
    }
}

/// Streams TracePackets of one sequence into `out`. Wrap files in a `BufWriter`.
pub struct TraceWriter<W: Write> {
    out: W,
    buf: Vec<u8>,
    tracks: Vec<TrackDecl>,
    processes: HashMap<u32, TrackId>,
    threads: HashMap<(u32, u32), TrackId>,
    event_names: Interner,
    arg_names: Interner,
    string_values: Interner,
    last_ts: u64,
    next_flow: u64,
    stats: WriterStats,
}

impl<W: Write> TraceWriter<W> {
    /// Starts the trace: the first packet clears incremental state, sets the
    /// packet defaults (CLOCK_MONOTONIC timestamps) and a clock snapshot at
    /// `start_ns` that makes CLOCK_MONOTONIC the primary trace clock.
    pub fn new(out: W, start_ns: u64) -> Result<Self, PerfettoError> {
        let mut w = TraceWriter {
            out,
            buf: Vec::with_capacity(256),
            tracks: Vec::new(),
            processes: HashMap::new(),
            threads: HashMap::new(),
            event_names: Interner::default(),
            arg_names: Interner::default(),
            string_values: Interner::default(),
            last_ts: 0,
            next_flow: 1,
            stats: WriterStats::default(),
        };
        let first = proto::TracePacket {
            trusted_packet_sequence_id: Some(SEQUENCE_ID),
            sequence_flags: Some(proto::SEQ_INCREMENTAL_STATE_CLEARED),
            first_packet_on_sequence: Some(true),
            trace_packet_defaults: Some(proto::TracePacketDefaults {
                timestamp_clock_id: Some(proto::BUILTIN_CLOCK_MONOTONIC),
                track_event_defaults: None,
            }),
            data: Some(proto::Data::ClockSnapshot(proto::ClockSnapshot {
                clocks: vec![proto::Clock { clock_id: Some(proto::BUILTIN_CLOCK_MONOTONIC), timestamp: Some(start_ns), is_incremental: None }],
                primary_trace_clock: Some(proto::BUILTIN_CLOCK_MONOTONIC as i32),
            })),
            ..Default::default()
        };
        w.write_packet(&first)?;
        Ok(w)
    }

    fn declare(&mut self, mut desc: proto::TrackDescriptor, parent: Option<TrackId>, kind: Kind, name: &str) -> TrackId {
        let uuid = self.tracks.len() as u64 + 1;
        desc.uuid = Some(uuid);
        desc.parent_uuid = parent.map(TrackId::uuid);
        self.tracks.push(TrackDecl { pending: Some(desc), parent: parent.map(TrackId::uuid), kind, depth: 0, name: name.into() });
        TrackId(uuid)
    }

    /// The process's track (declared once per pid; later calls return it).
    pub fn process_track(&mut self, pid: u32, name: &str) -> TrackId {
        if let Some(&t) = self.processes.get(&pid) {
            return t;
        }
        let desc = proto::TrackDescriptor {
            process: Some(proto::ProcessDescriptor { pid: Some(pid as i32), cmdline: Vec::new(), process_name: Some(name.to_owned()) }),
            ..Default::default()
        };
        let t = self.declare(desc, None, Kind::Slices, name);
        self.processes.insert(pid, t);
        t
    }

    /// The thread's track, nested in its process (declared as "pid N" if
    /// unknown). Without a name the UI shows "Thread TID".
    pub fn thread_track(&mut self, pid: u32, tid: u32, name: Option<&str>) -> TrackId {
        if let Some(&t) = self.threads.get(&(pid, tid)) {
            return t;
        }
        let process = self.process_track(pid, &format!("pid {pid}"));
        let desc = proto::TrackDescriptor {
            thread: Some(proto::ThreadDescriptor { pid: Some(pid as i32), tid: Some(tid as i32), thread_name: name.map(str::to_owned) }),
            ..Default::default()
        };
        let t = self.declare(desc, Some(process), Kind::Slices, &format!("tid {tid}"));
        self.threads.insert((pid, tid), t);
        t
    }

    /// A named track for slices and instants (also a group, when others name it parent).
    pub fn track(&mut self, name: &str, opts: TrackOpts) -> TrackId {
        let desc = proto::TrackDescriptor {
            name: Some(name.to_owned()),
            child_ordering: opts.child_ordering.map(|o| o as i32),
            sibling_order_rank: opts.rank,
            ..Default::default()
        };
        self.declare(desc, opts.parent, Kind::Slices, name)
    }

    /// A counter track: only [`counter`](Self::counter) values go there.
    pub fn counter_track(&mut self, name: &str, unit: CounterUnit, opts: TrackOpts) -> TrackId {
        let desc = proto::TrackDescriptor {
            name: Some(name.to_owned()),
            counter: Some(proto::CounterDescriptor { unit: Some(unit as i32), unit_name: None }),
            child_ordering: opts.child_ordering.map(|o| o as i32),
            sibling_order_rank: opts.rank,
            ..Default::default()
        };
        self.declare(desc, opts.parent, Kind::Counter, name)
    }

    /// Writes the track's descriptor now (it is otherwise written before the
    /// track's first event): for tracks that should show even when empty.
    pub fn describe(&mut self, track: TrackId) -> Result<(), PerfettoError> {
        self.decl(track)?;
        self.ensure_described(track)
    }

    /// A fresh id for a flow (an arrow between slices), unique in this trace.
    pub fn new_flow_id(&mut self) -> u64 {
        let id = self.next_flow;
        self.next_flow += 1;
        id
    }

    /// Opens a slice on `track` at `ts`.
    pub fn begin(&mut self, ts: u64, track: TrackId, ev: &Event<'_>) -> Result<(), PerfettoError> {
        self.slice_event(ts, track, EventType::SliceBegin, Some(ev))?;
        self.tracks[track.0 as usize - 1].depth += 1;
        self.stats.slices += 1;
        Ok(())
    }

    /// Closes the innermost open slice on `track` at `ts`.
    pub fn end(&mut self, ts: u64, track: TrackId) -> Result<(), PerfettoError> {
        let decl = self.decl(track)?;
        if decl.depth == 0 && decl.kind == Kind::Slices {
            return Err(PerfettoError::UnbalancedEnd { uuid: track.0, name: decl.name.to_string() });
        }
        self.slice_event(ts, track, EventType::SliceEnd, None)?;
        self.tracks[track.0 as usize - 1].depth -= 1;
        Ok(())
    }

    /// A zero-duration event on `track` at `ts`.
    pub fn instant(&mut self, ts: u64, track: TrackId, ev: &Event<'_>) -> Result<(), PerfettoError> {
        self.slice_event(ts, track, EventType::Instant, Some(ev))?;
        self.stats.instants += 1;
        Ok(())
    }

    /// An integer counter value on a counter track.
    pub fn counter(&mut self, ts: u64, track: TrackId, value: i64) -> Result<(), PerfettoError> {
        self.counter_event(ts, track, Some(value), None)
    }

    /// A floating-point counter value on a counter track.
    pub fn counter_f64(&mut self, ts: u64, track: TrackId, value: f64) -> Result<(), PerfettoError> {
        self.counter_event(ts, track, None, Some(value))
    }

    pub fn stats(&self) -> WriterStats {
        self.stats
    }

    /// Checks that every slice was closed, flushes, and returns the output.
    pub fn finish(mut self) -> Result<(W, WriterStats), PerfettoError> {
        let open: u64 = self.tracks.iter().map(|t| t.depth as u64).sum();
        if open > 0 {
            let (i, t) = self.tracks.iter().enumerate().find(|(_, t)| t.depth > 0).expect("an open track exists");
            return Err(PerfettoError::OpenSlices { open, uuid: i as u64 + 1, name: t.name.to_string() });
        }
        self.out.flush()?;
        Ok((self.out, self.stats))
    }

    fn decl(&self, track: TrackId) -> Result<&TrackDecl, PerfettoError> {
        (track.0 as usize).checked_sub(1).and_then(|i| self.tracks.get(i)).ok_or(PerfettoError::UnknownTrack(track.0))
    }

    fn counter_event(&mut self, ts: u64, track: TrackId, int: Option<i64>, double: Option<f64>) -> Result<(), PerfettoError> {
        let decl = self.decl(track)?;
        if decl.kind != Kind::Counter {
            return Err(PerfettoError::CounterOnSliceTrack { uuid: track.0, name: decl.name.to_string() });
        }
        self.advance(ts)?;
        self.ensure_described(track)?;
        let ev = proto::TrackEvent {
            r#type: Some(EventType::Counter as i32),
            track_uuid: Some(track.0),
            counter_value: int,
            double_counter_value: double,
            ..Default::default()
        };
        self.write_event(ts, ev, proto::InternedData::default())?;
        self.stats.counter_values += 1;
        Ok(())
    }

    fn slice_event(&mut self, ts: u64, track: TrackId, ty: EventType, ev: Option<&Event<'_>>) -> Result<(), PerfettoError> {
        let decl = self.decl(track)?;
        if decl.kind != Kind::Slices {
            return Err(PerfettoError::SliceOnCounterTrack { uuid: track.0, name: decl.name.to_string() });
        }
        self.advance(ts)?;
        self.ensure_described(track)?;
        let mut interned = proto::InternedData::default();
        let mut te = proto::TrackEvent { r#type: Some(ty as i32), track_uuid: Some(track.0), ..Default::default() };
        if let Some(ev) = ev {
            let (iid, new) = self.event_names.get(ev.name);
            if new {
                interned.event_names.push(proto::EventName { iid: Some(iid), name: Some(ev.name.to_owned()) });
            }
            te.name_iid = Some(iid);
            te.debug_annotations.reserve(ev.args.len());
            for a in ev.args {
                te.debug_annotations.push(self.annotation(a, &mut interned));
            }
            te.flow_ids.extend_from_slice(ev.flow_ids);
            te.terminating_flow_ids.extend_from_slice(ev.terminating_flow_ids);
            self.stats.flows += ev.flow_ids.len() as u64;
        }
        self.write_event(ts, te, interned)
    }

    fn annotation(&mut self, a: &Arg<'_>, interned: &mut proto::InternedData) -> proto::DebugAnnotation {
        let (iid, new) = self.arg_names.get(a.name);
        if new {
            interned.debug_annotation_names.push(proto::DebugAnnotationName { iid: Some(iid), name: Some(a.name.to_owned()) });
        }
        let mut d = proto::DebugAnnotation { name_iid: Some(iid), ..Default::default() };
        match a.value {
            Value::Str(s) => d.string_value = Some(s.to_owned()),
            Value::Interned(s) => {
                let (iid, new) = self.string_values.get(s);
                if new {
                    interned.debug_annotation_string_values.push(proto::InternedString { iid: Some(iid), str: Some(s.as_bytes().to_vec()) });
                }
                d.string_value_iid = Some(iid);
            }
            Value::U64(v) => d.uint_value = Some(v),
            Value::I64(v) => d.int_value = Some(v),
            Value::F64(v) => d.double_value = Some(v),
            Value::Bool(v) => d.bool_value = Some(v),
        }
        d
    }

    fn advance(&mut self, ts: u64) -> Result<(), PerfettoError> {
        if ts < self.last_ts {
            return Err(PerfettoError::TimestampRegression { ts, last: self.last_ts });
        }
        self.last_ts = ts;
        Ok(())
    }

    /// Writes the descriptors of `track` and its undescribed ancestors, root first.
    fn ensure_described(&mut self, track: TrackId) -> Result<(), PerfettoError> {
        if self.tracks[track.0 as usize - 1].pending.is_none() {
            return Ok(());
        }
        let mut chain = vec![track.0];
        let mut cur = self.tracks[track.0 as usize - 1].parent;
        while let Some(p) = cur {
            let d = &self.tracks[p as usize - 1];
            if d.pending.is_none() {
                break;
            }
            chain.push(p);
            cur = d.parent;
        }
        for uuid in chain.into_iter().rev() {
            let desc = self.tracks[uuid as usize - 1].pending.take().expect("pending descriptor");
            let packet = proto::TracePacket {
                trusted_packet_sequence_id: Some(SEQUENCE_ID),
                sequence_flags: Some(proto::SEQ_NEEDS_INCREMENTAL_STATE),
                data: Some(proto::Data::TrackDescriptor(desc)),
                ..Default::default()
            };
            self.write_packet(&packet)?;
            self.stats.track_descriptors += 1;
        }
        Ok(())
    }

    fn write_event(&mut self, ts: u64, te: proto::TrackEvent, interned: proto::InternedData) -> Result<(), PerfettoError> {
        let n = interned.event_names.len() + interned.debug_annotation_names.len() + interned.debug_annotation_string_values.len();
        self.stats.interned += n as u64;
        let packet = proto::TracePacket {
            timestamp: Some(ts),
            trusted_packet_sequence_id: Some(SEQUENCE_ID),
            sequence_flags: Some(proto::SEQ_NEEDS_INCREMENTAL_STATE),
            interned_data: (n > 0).then_some(interned),
            data: Some(proto::Data::TrackEvent(te)),
            ..Default::default()
        };
        self.write_packet(&packet)
    }

    /// `Trace.packet` (field 1, length-delimited) around one encoded packet.
    fn write_packet(&mut self, p: &proto::TracePacket) -> Result<(), PerfettoError> {
        self.buf.clear();
        prost::encoding::encode_key(proto::TRACE_PACKET_FIELD, prost::encoding::WireType::LengthDelimited, &mut self.buf);
        // A Vec grows as needed: encoding into it cannot run out of room.
        p.encode_length_delimited(&mut self.buf).map_err(io::Error::other)?;
        self.out.write_all(&self.buf)?;
        self.stats.packets += 1;
        self.stats.bytes += self.buf.len() as u64;
        Ok(())
    }
}
