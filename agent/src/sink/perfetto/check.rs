//! The invariant checker every trace hopscope writes must pass, and the
//! structure summary golden tests compare (track names, slice names and
//! counts per track, never bytes).
//!
//! Compressed batches (`TracePacket.compressed_packets`) are inflated and
//! their packets checked in their place, as trace processor reads them; an
//! outer packet must carry nothing else (trace processor ignores the rest).
//!
//! Rules checked (per `trusted_packet_sequence_id`):
//! - every packet names a non-zero sequence id;
//! - the first packet of a sequence sets `SEQ_INCREMENTAL_STATE_CLEARED`; every
//!   later packet sets `SEQ_NEEDS_INCREMENTAL_STATE`;
//! - every interned iid an event uses (event name, annotation name, string
//!   value) was defined earlier on the sequence, or in the same packet, and
//!   never redefined to something else;
//! - every track uuid an event or a descriptor's parent refers to was
//!   described earlier; no uuid is described twice differently;
//! - track events carry a timestamp in a known clock: a builtin one, or a
//!   sequence-scoped clock (64–127) that a clock snapshot on the same
//!   sequence tied to a builtin clock; an incremental clock's timestamps are
//!   deltas from the sequence's previous timestamp on it, starting at the
//!   snapshot's value; resolved timestamps never go backwards on a sequence;
//! - an event without a track uuid takes its sequence's
//!   `TrackEventDefaults.track_uuid`, which must be set;
//! - slice begins and ends balance per track and nest (an end closes the
//!   innermost open slice, never before it began); counter values go only to
//!   counter tracks and slices never do;
//! - in timestamp order (as trace processor links them), every flow that
//!   starts is terminated or continued later — except exactly as many as the
//!   trace declares in a `trace.flows_unlinked` annotation (a streamed
//!   trace's steps carry flow ids for requests it may not draw) — and nothing
//!   terminates a flow that did not start.

use super::proto::{self, Data, EventType, Trace};
use prost::Message;
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("trace does not decode: {0}")]
    Decode(#[from] prost::DecodeError),
    #[error("packet {packet}'s compressed_packets: {why}")]
    Compressed { packet: usize, why: String },
    #[error("{} invariant violation(s), first: {}", .0.len(), .0.iter().take(10).cloned().collect::<Vec<_>>().join("; "))]
    Violations(Vec<String>),
}

/// What a track held.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrackSummary {
    pub uuid: u64,
    /// The descriptor's name; for process tracks "NAME (pid N)", for thread
    /// tracks "THREAD_NAME (tid N)" or "tid N".
    pub name: String,
    pub parent: Option<u64>,
    /// "process", "thread", "counter" or "track".
    pub kind: &'static str,
    pub rank: Option<i32>,
    /// Slice name → how many slices of that name.
    pub slices: BTreeMap<String, u64>,
    pub instants: BTreeMap<String, u64>,
    pub counter_values: u64,
    pub max_depth: u32,
}

/// A trace's structure, in descriptor order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Summary {
    /// TracePackets, those inside compressed batches counted one by one.
    pub packets: u64,
    /// Compressed batches (outer packets with `compressed_packets`).
    pub batches: u64,
    pub tracks: Vec<TrackSummary>,
    pub slices: u64,
    pub instants: u64,
    pub counter_values: u64,
    /// Flows that started and terminated.
    pub flows: u64,
    /// Flows that started and were never linked (as declared).
    pub flows_unlinked: u64,
    pub first_ts: Option<u64>,
    pub last_ts: Option<u64>,
}

impl Summary {
    pub fn track(&self, name: &str) -> Option<&TrackSummary> {
        self.tracks.iter().find(|t| t.name == name)
    }

    /// Children of `parent` (None: root tracks), in descriptor order.
    pub fn children(&self, parent: Option<u64>) -> impl Iterator<Item = &TrackSummary> {
        self.tracks.iter().filter(move |t| t.parent == parent)
    }

    /// The track tree as indented text, one line per track: name, kind, then
    /// slice and instant names with counts. Deterministic: what golden tests
    /// compare.
    pub fn render(&self) -> String {
        let mut out = String::new();
        self.render_level(None, 0, &mut out);
        out
    }

    fn render_level(&self, parent: Option<u64>, depth: usize, out: &mut String) {
        for t in self.children(parent) {
            let _ = write!(out, "{}{} [{}]", "  ".repeat(depth), t.name, t.kind);
            for (n, c) in &t.slices {
                let _ = write!(out, " {n}×{c}");
            }
            for (n, c) in &t.instants {
                let _ = write!(out, " !{n}×{c}");
            }
            if t.counter_values > 0 {
                let _ = write!(out, " values×{}", t.counter_values);
            }
            out.push('\n');
            self.render_level(Some(t.uuid), depth + 1, out);
        }
    }
}

#[derive(Default)]
struct SeqState {
    started: bool,
    event_names: HashMap<u64, String>,
    arg_names: HashMap<u64, String>,
    string_values: HashMap<u64, Vec<u8>>,
    /// The defaults' clock and track.
    clock: Option<u32>,
    default_track: Option<u64>,
    /// Sequence-scoped clocks the snapshots defined.
    clocks: HashMap<u32, CustomClock>,
    /// Resolved (builtin-clock) time of the last timestamp.
    last_ts: Option<u64>,
}

struct CustomClock {
    incremental: bool,
    /// The clock's value and the builtin clock's at the snapshot.
    at_clock: u64,
    at_builtin: u64,
    /// The clock's value at the last packet on it (incremental clocks).
    last: u64,
}

fn is_builtin(clock: u32) -> bool {
    matches!(clock, proto::BUILTIN_CLOCK_MONOTONIC | proto::BUILTIN_CLOCK_BOOTTIME | proto::BUILTIN_CLOCK_REALTIME)
}

impl SeqState {
    /// Applies what `p` does to the sequence's state before its payload is
    /// read: a clear, new defaults, a clock snapshot.
    fn apply(&mut self, p: &proto::TracePacket, clears: bool) -> Result<(), String> {
        if clears {
            self.event_names.clear();
            self.arg_names.clear();
            self.string_values.clear();
            self.clock = None;
            self.default_track = None;
            self.clocks.clear();
        }
        if let Some(d) = &p.trace_packet_defaults {
            self.clock = d.timestamp_clock_id;
            self.default_track = d.track_event_defaults.as_ref().and_then(|t| t.track_uuid);
        }
        if let Some(Data::ClockSnapshot(cs)) = &p.data {
            if cs.clocks.is_empty() {
                return Err("clock snapshot without clocks".into());
            }
            let anchor = cs.clocks.iter().find(|c| c.clock_id.is_some_and(is_builtin)).and_then(|c| c.timestamp);
            for c in cs.clocks.iter().filter(|c| c.clock_id.is_some_and(|id| (64..=127).contains(&id))) {
                let Some(at_builtin) = anchor else {
                    return Err("clock snapshot defines a sequence clock but no builtin clock to tie it to".into());
                };
                let at_clock = c.timestamp.unwrap_or(0);
                self.clocks.insert(c.clock_id.unwrap_or(0), CustomClock { incremental: c.is_incremental == Some(true), at_clock, at_builtin, last: at_clock });
            }
        }
        Ok(())
    }

    /// The packet's timestamp in the builtin clock, when it has one.
    fn resolve(&mut self, p: &proto::TracePacket) -> Result<Option<u64>, String> {
        let Some(raw) = p.timestamp else { return Ok(None) };
        match p.timestamp_clock_id.or(self.clock) {
            Some(c) if is_builtin(c) => Ok(Some(raw)),
            Some(c) => {
                let Some(cc) = self.clocks.get_mut(&c) else {
                    return Err(format!("timestamp in clock {c}, which no clock snapshot on this sequence defined"));
                };
                let v = if cc.incremental { cc.last.checked_add(raw).ok_or("incremental timestamp overflows")? } else { raw };
                if cc.incremental {
                    cc.last = v;
                }
                let abs = (cc.at_builtin + v).checked_sub(cc.at_clock).ok_or_else(|| format!("timestamp {v} in clock {c} before its snapshot"))?;
                Ok(Some(abs))
            }
            None => Err("timestamp in no clock (no defaults, no timestamp_clock_id)".into()),
        }
    }
}

/// `trace` with every timestamp resolved to the builtin clock (and
/// `timestamp_clock_id` cleared), every track event naming its track
/// (sequence defaults filled in), interned event and annotation names
/// copied into their `name` fields and interned annotation values into
/// `string_value` (iids kept; they are per sequence): what
/// tests read times, tracks and names from. Packets whose timestamp does not
/// resolve keep none; `check` says why.
pub fn flatten(trace: &Trace) -> Trace {
    let mut seqs: HashMap<u32, SeqState> = HashMap::new();
    // A batch that does not inflate stays as it is; `check` says why.
    let mut out = expand(trace).map_or_else(|_| trace.clone(), |(t, _)| t.into_owned());
    for p in &mut out.packet {
        let seq = seqs.entry(p.trusted_packet_sequence_id.unwrap_or(0)).or_default();
        let clears = p.sequence_flags.unwrap_or(0) & proto::SEQ_INCREMENTAL_STATE_CLEARED != 0 || p.incremental_state_cleared == Some(true);
        let _ = seq.apply(p, clears);
        if let Some(i) = &p.interned_data {
            for e in &i.event_names {
                seq.event_names.insert(e.iid.unwrap_or(0), e.name.clone().unwrap_or_default());
            }
            for e in &i.debug_annotation_names {
                seq.arg_names.insert(e.iid.unwrap_or(0), e.name.clone().unwrap_or_default());
            }
            for e in &i.debug_annotation_string_values {
                seq.string_values.insert(e.iid.unwrap_or(0), e.str.clone().unwrap_or_default());
            }
        }
        p.timestamp = seq.resolve(p).ok().flatten();
        p.timestamp_clock_id = None;
        if let Some(Data::TrackEvent(e)) = &mut p.data {
            e.track_uuid = e.track_uuid.or(seq.default_track);
            if let Some(n) = e.name_iid.and_then(|i| seq.event_names.get(&i)) {
                e.name = Some(n.clone());
            }
            for d in &mut e.debug_annotations {
                if let Some(n) = d.name_iid.and_then(|i| seq.arg_names.get(&i)) {
                    d.name = Some(n.clone());
                }
                if let Some(v) = d.string_value_iid.and_then(|i| seq.string_values.get(&i)) {
                    d.string_value = Some(String::from_utf8_lossy(v).into_owned());
                }
            }
        }
    }
    out
}

struct TrackState {
    index: usize,
    descriptor: proto::TrackDescriptor,
    counter: bool,
    /// Begin timestamps of the open slices.
    open: Vec<u64>,
}

/// The longest prefix of `bytes` made of whole `Trace.packet` fields: what a
/// reader of a trace still being written (or cut by a crash) can decode. A
/// compressed batch is one such field: a cut one is left out whole.
pub fn complete_packets(bytes: &[u8]) -> &[u8] {
    let mut at = 0;
    while at < bytes.len() {
        let mut rest = &bytes[at..];
        let before = rest.len();
        let Ok(key) = prost::encoding::decode_varint(&mut rest) else { break };
        let Ok(len) = prost::encoding::decode_varint(&mut rest) else { break };
        let head = before - rest.len();
        if key != ((proto::TRACE_PACKET_FIELD as u64) << 3 | 2) || (rest.len() as u64) < len {
            break;
        }
        at += head + len as usize;
    }
    &bytes[..at]
}

/// Decodes `bytes` (a `Trace`) with hopscope's schema subset, compressed
/// batches replaced by the packets they hold.
pub fn decode(bytes: &[u8]) -> Result<Trace, CheckError> {
    Ok(expand(&Trace::decode(bytes)?)?.0.into_owned())
}

/// Decodes `bytes` (a `Trace`) with hopscope's schema subset and checks it.
pub fn check_bytes(bytes: &[u8]) -> Result<Summary, CheckError> {
    check(&Trace::decode(bytes)?)
}

/// A batch inflates to at most this much (hopscope writes 256 KiB batches;
/// Perfetto asks for compressed packets under 512 KB): a bound on what a
/// corrupt or hostile file can make the checker allocate.
const MAX_INFLATED: usize = 256 << 20;

/// Inflates one `compressed_packets` payload (a zlib stream) into the bytes
/// of a `Trace`.
pub fn inflate(zlib: &[u8]) -> Result<Vec<u8>, String> {
    miniz_oxide::inflate::decompress_to_vec_zlib_with_limit(zlib, MAX_INFLATED).map_err(|e| format!("does not inflate as zlib: {e}"))
}

/// `trace` with every compressed batch replaced by its packets, in place
/// (borrowed when there is none), and the number of batches.
fn expand(trace: &Trace) -> Result<(Cow<'_, Trace>, u64), CheckError> {
    if !trace.packet.iter().any(|p| matches!(p.data, Some(Data::CompressedPackets(_)))) {
        return Ok((Cow::Borrowed(trace), 0));
    }
    let mut out = Trace { packet: Vec::with_capacity(trace.packet.len()) };
    let mut batches = 0;
    for (i, p) in trace.packet.iter().enumerate() {
        let Some(Data::CompressedPackets(z)) = &p.data else {
            out.packet.push(p.clone());
            continue;
        };
        let err = |why: String| CheckError::Compressed { packet: i, why };
        if *p != (proto::TracePacket { data: p.data.clone(), ..Default::default() }) {
            return Err(err("the packet carries other fields too, which trace processor ignores".into()));
        }
        let inner = Trace::decode(&inflate(z).map_err(err)?[..]).map_err(|e| err(format!("inflated, does not decode as a Trace: {e}")))?;
        if inner.packet.iter().any(|q| matches!(q.data, Some(Data::CompressedPackets(_)))) {
            return Err(err("a compressed batch inside a compressed batch".into()));
        }
        out.packet.extend(inner.packet);
        batches += 1;
    }
    Ok((Cow::Owned(out), batches))
}

/// Checks a decoded trace (compressed batches are expanded first); the
/// summary when it passes, every violation otherwise.
pub fn check(trace: &Trace) -> Result<Summary, CheckError> {
    let (trace, batches) = expand(trace)?;
    let trace = &*trace;
    let mut v: Vec<String> = Vec::new();
    let mut seqs: HashMap<u32, SeqState> = HashMap::new();
    let mut tracks: HashMap<u64, TrackState> = HashMap::new();
    let mut summary = Summary { packets: trace.packet.len() as u64, batches, ..Summary::default() };
    // (resolved time, packet, flows started, flows terminated): linked after
    // the pass, in time order, as trace processor links them.
    let mut flow_events: Vec<(u64, usize, Vec<u64>, Vec<u64>)> = Vec::new();
    // What the metadata says was left unlinked on purpose; a trace without
    // its metadata (a live one read before the stop: the metadata is
    // written last) may leave any number.
    let mut declared_unlinked = None;

    for (pi, p) in trace.packet.iter().enumerate() {
        let at = |what: String| format!("packet {pi}: {what}");
        let Some(seq_id) = p.trusted_packet_sequence_id.filter(|s| *s != 0) else {
            v.push(at("no trusted_packet_sequence_id".into()));
            continue;
        };
        let seq = seqs.entry(seq_id).or_default();
        let flags = p.sequence_flags.unwrap_or(0);
        let clears = flags & proto::SEQ_INCREMENTAL_STATE_CLEARED != 0 || p.incremental_state_cleared == Some(true);
        if !seq.started && !clears {
            v.push(at(format!("first packet of sequence {seq_id} does not clear incremental state")));
        }
        if seq.started && !clears && flags & proto::SEQ_NEEDS_INCREMENTAL_STATE == 0 {
            v.push(at("later packet does not set SEQ_NEEDS_INCREMENTAL_STATE".into()));
        }
        seq.started = true;
        if let Err(e) = seq.apply(p, clears) {
            v.push(at(e));
        }
        if let Some(i) = &p.interned_data {
            for e in &i.event_names {
                intern(&mut seq.event_names, e.iid, e.name.clone().unwrap_or_default(), "event name", &mut v, pi);
            }
            for e in &i.debug_annotation_names {
                intern(&mut seq.arg_names, e.iid, e.name.clone().unwrap_or_default(), "annotation name", &mut v, pi);
            }
            for e in &i.debug_annotation_string_values {
                intern(&mut seq.string_values, e.iid, e.str.clone().unwrap_or_default(), "string value", &mut v, pi);
            }
        }
        let resolved = match seq.resolve(p) {
            Ok(ts) => ts,
            Err(e) => {
                v.push(at(e));
                None
            }
        };
        if let Some(ts) = resolved {
            if let Some(last) = seq.last_ts {
                if ts < last {
                    v.push(at(format!("timestamp {ts} before the sequence's previous {last}")));
                }
            }
            seq.last_ts = Some(ts);
            summary.first_ts = Some(summary.first_ts.map_or(ts, |f| f.min(ts)));
            summary.last_ts = Some(summary.last_ts.map_or(ts, |l| l.max(ts)));
        }
        match &p.data {
            Some(Data::ClockSnapshot(_)) => {}
            // Expanded above; nested ones are refused there.
            Some(Data::CompressedPackets(_)) => v.push(at("compressed_packets left after expanding".into())),
            Some(Data::TrackDescriptor(d)) => {
                let Some(uuid) = d.uuid.filter(|u| *u != 0) else {
                    v.push(at("track descriptor without uuid".into()));
                    continue;
                };
                if let Some(parent) = d.parent_uuid {
                    if !tracks.contains_key(&parent) {
                        v.push(at(format!("track {uuid}'s parent {parent} is not described yet")));
                    }
                }
                if let Some(old) = tracks.get(&uuid) {
                    if old.descriptor != *d {
                        v.push(at(format!("track {uuid} described twice, differently")));
                    }
                    continue;
                }
                let (name, kind) = if let Some(pr) = &d.process {
                    (format!("{} (pid {})", pr.process_name.clone().unwrap_or_default(), pr.pid.unwrap_or(0)), "process")
                } else if let Some(th) = &d.thread {
                    let tid = th.tid.unwrap_or(0);
                    (th.thread_name.as_ref().map_or(format!("tid {tid}"), |n| format!("{n} (tid {tid})")), "thread")
                } else if d.counter.is_some() {
                    (d.name.clone().unwrap_or_default(), "counter")
                } else {
                    (d.name.clone().unwrap_or_default(), "track")
                };
                // Thread tracks name their process as parent; Perfetto nests them by pid anyway.
                let parent = d.parent_uuid;
                tracks.insert(uuid, TrackState { index: summary.tracks.len(), descriptor: d.clone(), counter: d.counter.is_some(), open: Vec::new() });
                summary.tracks.push(TrackSummary { uuid, name, parent, kind, rank: d.sibling_order_rank, ..TrackSummary::default() });
            }
            Some(Data::TrackEvent(e)) => {
                let Some(ts) = resolved else {
                    if p.timestamp.is_none() {
                        v.push(at("track event without timestamp".into()));
                    }
                    continue;
                };
                let Some(uuid) = e.track_uuid.or(seq.default_track) else {
                    v.push(at("track event without track_uuid, and no default track on its sequence".into()));
                    continue;
                };
                let Some(track) = tracks.get_mut(&uuid) else {
                    v.push(at(format!("track event on track {uuid} before its descriptor")));
                    continue;
                };
                let name = match (e.name_iid, &e.name) {
                    (Some(iid), _) => match seq.event_names.get(&iid) {
                        Some(n) => Some(n.clone()),
                        None => {
                            v.push(at(format!("event name iid {iid} not interned")));
                            None
                        }
                    },
                    (None, Some(n)) => Some(n.clone()),
                    (None, None) => None,
                };
                for a in &e.debug_annotations {
                    let name = match (a.name_iid, &a.name) {
                        (Some(iid), _) => match seq.arg_names.get(&iid) {
                            Some(n) => Some(n.as_str()),
                            None => {
                                v.push(at(format!("annotation name iid {iid} not interned")));
                                None
                            }
                        },
                        (None, Some(n)) => Some(n.as_str()),
                        (None, None) => {
                            v.push(at("annotation without a name".into()));
                            None
                        }
                    };
                    if name == Some("trace.flows_unlinked") {
                        declared_unlinked = Some(a.uint_value.unwrap_or(0));
                    }
                    if let Some(iid) = a.string_value_iid {
                        if !seq.string_values.contains_key(&iid) {
                            v.push(at(format!("annotation string iid {iid} not interned")));
                        }
                    }
                }
                let ty = e.r#type.and_then(|t| EventType::try_from(t).ok());
                let ts_sum = &mut summary.tracks[track.index];
                match ty {
                    Some(EventType::SliceBegin) | Some(EventType::Instant) if track.counter => {
                        v.push(at(format!("slice event on counter track {uuid}")));
                    }
                    Some(EventType::SliceBegin) => {
                        track.open.push(ts);
                        ts_sum.max_depth = ts_sum.max_depth.max(track.open.len() as u32);
                        *ts_sum.slices.entry(name.unwrap_or_else(|| {
                            v.push(at("slice begin without a name".into()));
                            String::new()
                        })).or_default() += 1;
                        summary.slices += 1;
                    }
                    Some(EventType::SliceEnd) => match track.open.pop() {
                        Some(begin) if begin > ts => v.push(at(format!("slice on track {uuid} ends at {ts} before it began at {begin}"))),
                        Some(_) => {}
                        None => v.push(at(format!("slice end on track {uuid} without an open slice"))),
                    },
                    Some(EventType::Instant) => {
                        *ts_sum.instants.entry(name.unwrap_or_default()).or_default() += 1;
                        summary.instants += 1;
                    }
                    Some(EventType::Counter) => {
                        if !track.counter {
                            v.push(at(format!("counter value on non-counter track {uuid}")));
                        }
                        if e.counter_value.is_none() && e.double_counter_value.is_none() {
                            v.push(at("counter event without a value".into()));
                        }
                        ts_sum.counter_values += 1;
                        summary.counter_values += 1;
                    }
                    _ => v.push(at(format!("track event of unknown type {:?}", e.r#type))),
                }
                if !e.flow_ids.is_empty() || !e.terminating_flow_ids.is_empty() {
                    flow_events.push((ts, pi, e.flow_ids.clone(), e.terminating_flow_ids.clone()));
                }
            }
            None => {
                if p.trace_packet_defaults.is_none() && p.interned_data.is_none() {
                    v.push(at("packet carries nothing".into()));
                }
            }
        }
    }
    let mut open: Vec<_> = tracks.iter().filter(|(_, t)| !t.open.is_empty()).map(|(u, t)| (*u, t.open.len())).collect();
    open.sort();
    for (uuid, n) in open {
        v.push(format!("track {uuid}: {n} slice(s) never end"));
    }
    // Flows in time order (stable: file order at equal times). Naming an open
    // flow again links it to this slice and continues it from here; a flow
    // left open at the end is fine only if it linked something.
    flow_events.sort_by_key(|f| f.0);
    let mut open_flows: HashMap<u64, (usize, bool)> = HashMap::new();
    for (_, pi, starts, ends) in flow_events {
        for id in ends {
            if open_flows.remove(&id).is_some() {
                summary.flows += 1;
            } else {
                v.push(format!("packet {pi}: flow {id} terminates without having started"));
            }
        }
        for id in starts {
            match open_flows.get_mut(&id) {
                Some(f) => {
                    summary.flows += 1;
                    *f = (pi, true);
                }
                None => {
                    open_flows.insert(id, (pi, false));
                }
            }
        }
    }
    let mut flows: Vec<_> = open_flows.into_iter().filter(|(_, (_, linked))| !linked).collect();
    flows.sort();
    summary.flows_unlinked = flows.len() as u64;
    if let Some(declared) = declared_unlinked.filter(|d| *d != summary.flows_unlinked) {
        let n = flows.len();
        for (id, (pi, _)) in flows {
            v.push(format!("flow {id} (from packet {pi}) never terminates ({n} such, the trace declares {declared} in trace.flows_unlinked)"));
        }
        if n == 0 {
            v.push(format!("every flow links, but the trace declares {declared} in trace.flows_unlinked"));
        }
    }
    if v.is_empty() {
        Ok(summary)
    } else {
        Err(CheckError::Violations(v))
    }
}

fn intern<T: PartialEq>(table: &mut HashMap<u64, T>, iid: Option<u64>, value: T, what: &str, v: &mut Vec<String>, pi: usize) {
    let Some(iid) = iid.filter(|i| *i != 0) else {
        v.push(format!("packet {pi}: interned {what} without an iid"));
        return;
    };
    match table.get(&iid) {
        Some(old) if *old != value => v.push(format!("packet {pi}: interned {what} iid {iid} redefined")),
        Some(_) => {}
        None => {
            table.insert(iid, value);
        }
    }
}
