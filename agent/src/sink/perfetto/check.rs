//! The invariant checker every trace hopscope writes must pass, and the
//! structure summary golden tests compare (track names, slice names and
//! counts per track, never bytes).
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
//! - track events carry a timestamp in a known clock, timestamps never go
//!   backwards on a sequence;
//! - slice begins and ends balance per track and nest (an end closes the
//!   innermost open slice, never before it began); counter values go only to
//!   counter tracks and slices never do;
//! - every flow that starts is terminated later, and nothing terminates a
//!   flow that did not start.

use super::proto::{self, Data, EventType, Trace};
use prost::Message;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("trace does not decode: {0}")]
    Decode(#[from] prost::DecodeError),
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
    pub packets: u64,
    pub tracks: Vec<TrackSummary>,
    pub slices: u64,
    pub instants: u64,
    pub counter_values: u64,
    /// Flows that started and terminated.
    pub flows: u64,
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
    clock: Option<u32>,
    last_ts: Option<u64>,
}

struct TrackState {
    index: usize,
    descriptor: proto::TrackDescriptor,
    counter: bool,
    /// Begin timestamps of the open slices.
    open: Vec<u64>,
}

/// Decodes `bytes` (a `Trace`) with hopscope's schema subset.
pub fn decode(bytes: &[u8]) -> Result<Trace, CheckError> {
    Ok(Trace::decode(bytes)?)
}

/// Decodes `bytes` (a `Trace`) with hopscope's schema subset and checks it.
pub fn check_bytes(bytes: &[u8]) -> Result<Summary, CheckError> {
    check(&decode(bytes)?)
}

/// Checks a decoded trace; the summary when it passes, every violation otherwise.
pub fn check(trace: &Trace) -> Result<Summary, CheckError> {
    let mut v: Vec<String> = Vec::new();
    let mut seqs: HashMap<u32, SeqState> = HashMap::new();
    let mut tracks: HashMap<u64, TrackState> = HashMap::new();
    let mut summary = Summary { packets: trace.packet.len() as u64, ..Summary::default() };
    let mut open_flows: HashMap<u64, usize> = HashMap::new();

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
        if clears {
            seq.event_names.clear();
            seq.arg_names.clear();
            seq.string_values.clear();
            seq.clock = None;
        }
        if let Some(d) = &p.trace_packet_defaults {
            seq.clock = d.timestamp_clock_id;
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
        if let Some(ts) = p.timestamp {
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
            Some(Data::ClockSnapshot(cs)) => {
                if cs.clocks.is_empty() {
                    v.push(at("clock snapshot without clocks".into()));
                }
            }
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
                let Some(ts) = p.timestamp else {
                    v.push(at("track event without timestamp".into()));
                    continue;
                };
                let clock = p.timestamp_clock_id.or(seq.clock);
                if !matches!(clock, Some(proto::BUILTIN_CLOCK_MONOTONIC | proto::BUILTIN_CLOCK_BOOTTIME | proto::BUILTIN_CLOCK_REALTIME)) {
                    v.push(at(format!("track event in unknown clock {clock:?}")));
                }
                let Some(uuid) = e.track_uuid else {
                    v.push(at("track event without track_uuid".into()));
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
                    match (a.name_iid, &a.name) {
                        (Some(iid), _) if !seq.arg_names.contains_key(&iid) => v.push(at(format!("annotation name iid {iid} not interned"))),
                        (None, None) => v.push(at("annotation without a name".into())),
                        _ => {}
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
                for id in &e.flow_ids {
                    // Naming an open flow again continues it through this slice.
                    open_flows.insert(*id, pi);
                }
                for id in &e.terminating_flow_ids {
                    if open_flows.remove(id).is_some() {
                        summary.flows += 1;
                    } else {
                        v.push(at(format!("flow {id} terminates without having started")));
                    }
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
    let mut flows: Vec<_> = open_flows.into_iter().collect();
    flows.sort();
    for (id, pi) in flows {
        v.push(format!("flow {id} (from packet {pi}) never terminates"));
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
