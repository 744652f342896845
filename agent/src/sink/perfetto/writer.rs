//! A streaming Perfetto TrackEvent writer: one packet at a time, straight to a
//! [`Write`], with bounded memory (one packet buffer, the intern tables and the
//! track table; never the trace).
//!
//! What it guarantees, so that callers cannot produce a trace the UI
//! half-reads (`check` verifies every one of these on the decoded output):
//! - every packet carries its sequence's `trusted_packet_sequence_id`: the
//!   main sequence ([`SEQUENCE_ID`]) and one more per track declared with
//!   [`TrackOpts::own_sequence`] (GPU streams: their events then omit the
//!   track, `TrackEventDefaults.track_uuid` names it);
//! - the first packet of each sequence clears its incremental state
//!   (`SEQ_INCREMENTAL_STATE_CLEARED`), sets `TracePacketDefaults`
//!   (timestamps are on the sequence's incremental clock) and a
//!   `ClockSnapshot` that ties that clock to CLOCK_MONOTONIC, the trace's
//!   primary clock; every later packet says `SEQ_NEEDS_INCREMENTAL_STATE`;
//! - timestamps are deltas from the sequence's previous timestamp
//!   ([`INCREMENTAL_CLOCK_ID`], `is_incremental`): 2–3 bytes instead of 8;
//! - event names, debug-annotation names and interned string values are sent
//!   once per sequence, in the packet that first uses them (`interned_data`),
//!   then by iid;
//! - a track's descriptor (and its parents', parents first) is written before
//!   the first event on it;
//! - timestamps never go backwards on a sequence;
//! - slice ends match begins on every track, and counters go only to counter
//!   tracks.
//!
//! Track uuids are small sequential numbers (1, 2, …): they are repeated in
//! every event of the main sequence, and a one-byte varint keeps slices
//! small. They are unique within one file; merging with another producer's
//! trace would need an offset.
//!
//! By default ([`Encoding`]) the packets are not written one by one but
//! batched and zlib-compressed into one outer packet's `compressed_packets`
//! per batch (and at every [`flush`](TraceWriter::flush)), as `traced` does
//! with `compression_type: COMPRESSION_TYPE_DEFLATE`. The inner packets are
//! exactly the packets an uncompressed trace has, in the same order: trace
//! processor inflates each batch and parses its packets in its place, with
//! the sequences' incremental state carried across batches.

use super::deflate::{read32, read64, FastZlib};
use super::proto::{self, ChildOrdering, CounterUnit, EventType};
use miniz_oxide::deflate::core::{compress_to_output, create_comp_flags_from_zip_params, CompressorOxide, TDEFLFlush, TDEFLStatus};
use prost::Message;
use std::io::{self, Write};

/// The main sequence's id (0 is invalid in Perfetto); tracks on their own
/// sequence get 2, 3, … in declaration order.
pub const SEQUENCE_ID: u32 = 1;

/// The sequence-scoped clock every sequence's timestamps are on (Perfetto's
/// user-defined clock ids are 64–127, scoped to one sequence): incremental,
/// so each packet's timestamp is the delta from the sequence's previous one.
pub const INCREMENTAL_CLOCK_ID: u32 = 64;

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
    #[error("compressing a batch of trace packets stopped ({0}); write the trace uncompressed (hopscope trace --no-compress)")]
    Compress(String),
}

/// How the writer puts packets into its output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Encoding {
    /// Batch packets into zlib-compressed `compressed_packets`; `false`
    /// writes every packet as it comes (for reading the bytes by eye).
    pub compress: bool,
    /// A batch is compressed and written once it holds this many bytes of
    /// packets (or at the next flush). Perfetto asks for compressed packets
    /// under 512 KB; level 1 grows incompressible data by at most 12.5 %
    /// (fixed codes: 9 bits for some bytes), miniz_oxide by ~0.1 %, so
    /// batches up to a few hundred KiB are safe.
    pub batch_bytes: usize,
    /// zlib level, 1 (fastest) to 9; `traced` uses 6. Level 1 is hopscope's
    /// own one-pass compressor ([`super::deflate`]), 2–9 miniz_oxide's levels.
    pub level: u8,
}

impl Encoding {
    /// Every packet written as it comes, no compression.
    pub const PLAIN: Encoding = Encoding { compress: false, batch_bytes: 0, level: 0 };
    /// What traces are written with unless asked otherwise. Level 1, not
    /// traced's 6: on kernel slices 12.3 instead of 8.5 bytes per slice, at
    /// 8.5 instead of 1.5 M events/s (the bench in tests.rs). 256 KiB
    /// batches (288 KiB compressed at worst, under Perfetto's 512 KB): each
    /// batch starts with nothing to match, and a quarter as many such
    /// starts as 64 KiB batches made the 20 000-request trace 4 % smaller
    /// and its writing 1 % cheaper; the writer's buffers stay ~0.6 MiB
    /// plus the compressor's ~260 KiB.
    pub const COMPRESSED: Encoding = Encoding { compress: true, batch_bytes: 256 << 10, level: 1 };
}

impl Default for Encoding {
    fn default() -> Self {
        Encoding::COMPRESSED
    }
}

/// A declared track: its uuid, and where the writer keeps it (every event
/// looks its track up: an index, where a hash look-up by uuid cost more than
/// the rest of an end event's encoding). Cheap to copy; only valid with the
/// writer that made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TrackId {
    uuid: u32,
    slot: u32,
}

impl TrackId {
    pub fn uuid(self) -> u64 {
        u64::from(self.uuid)
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
    /// Write the track's events on a packet sequence of its own, whose
    /// defaults name the track: for tracks with many events (GPU streams),
    /// each event then saves the track uuid.
    pub own_sequence: bool,
}

/// A debug-annotation value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value<'a> {
    /// A string sent inline (ids and other values that rarely repeat).
    Str(&'a str),
    /// A string sent once and then by iid (values that repeat: paths, methods, states).
    Interned(&'a str),
    /// A long string written on a few events and then not again (a
    /// request's `interference_from` ids, on its slice and its decode
    /// phase): sent once as an interned value, its sequence and iid left
    /// in the cell, and then by that iid on the same sequence; kept out of
    /// the intern table, which would grow with the recording. One cell per
    /// string: the caller's ([`Shared::new`]).
    Shared(&'a str, &'a Shared),
    U64(u64),
    I64(i64),
    F64(f64),
    Bool(bool),
}

/// Where a [`Value::Shared`] string was sent: its sequence's id and its
/// iid there (0: not yet).
#[derive(Debug, Default, PartialEq)]
pub struct Shared(std::cell::Cell<(u32, u64)>);

impl Shared {
    pub fn new() -> Self {
        Self::default()
    }
}

/// One debug annotation (shown as the event's "args" in the UI).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Arg<'a> {
    pub name: &'a str,
    pub value: Value<'a>,
    /// `name` is a `'static` string (the constructors by value type take
    /// only those; [`Arg::dynamic`] the others): see [`Interner::get_literal`].
    literal: bool,
}

impl<'a> Arg<'a> {
    pub fn str(name: &'static str, v: &'a str) -> Self {
        Arg { name, value: Value::Str(v), literal: true }
    }
    pub fn interned(name: &'static str, v: &'a str) -> Self {
        Arg { name, value: Value::Interned(v), literal: true }
    }
    pub fn shared(name: &'static str, v: &'a str, cell: &'a Shared) -> Self {
        Arg { name, value: Value::Shared(v, cell), literal: true }
    }
    pub fn u64(name: &'static str, v: u64) -> Self {
        Arg { name, value: Value::U64(v), literal: true }
    }
    pub fn i64(name: &'static str, v: i64) -> Self {
        Arg { name, value: Value::I64(v), literal: true }
    }
    pub fn f64(name: &'static str, v: f64) -> Self {
        Arg { name, value: Value::F64(v), literal: true }
    }
    pub fn bool(name: &'static str, v: bool) -> Self {
        Arg { name, value: Value::Bool(v), literal: true }
    }
    /// An annotation whose name is made at run time (not a `'static` string).
    pub fn dynamic(name: &'a str, value: Value<'a>) -> Self {
        Arg { name, value, literal: false }
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
    /// The name is written as is, not interned: for names used once (a
    /// request's id), which would otherwise stay in the sequence's table.
    pub unique_name: bool,
}

impl<'a> Event<'a> {
    pub fn named(name: &'a str) -> Self {
        Event { name, ..Event::default() }
    }
    /// A name used once (see [`Event::unique_name`]).
    pub fn named_once(name: &'a str) -> Self {
        Event { name, unique_name: true, ..Event::default() }
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
    /// Only an interned name: no annotations, flows or unique name.
    #[inline]
    fn is_bare(&self) -> bool {
        self.args.is_empty() && self.flow_ids.is_empty() && self.terminating_flow_ids.is_empty() && !self.unique_name
    }
}

/// An event name's iid on the sequence it was first written on, kept by a
/// caller that writes one name very often (a request's chunk instants: a
/// third of a streamed trace's events), so that the name is not looked up
/// per event (~35 instructions: the memo's hash, its slot, the bytes
/// compared). Only for one name, and one writer; a track on another
/// sequence looks the name up again (and keeps that sequence's iid).
#[derive(Debug, Clone, Copy, Default)]
pub struct NameIid {
    seq: u32,
    /// 0: not known yet.
    iid: u32,
}

/// What the writer has written so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriterStats {
    /// TracePackets written (inside compressed batches when compressing).
    pub packets: u64,
    /// Bytes written to the output: the trace's size.
    pub bytes: u64,
    /// The packets' own bytes (with their `Trace.packet` framing), before
    /// compression: the size the trace has written uncompressed.
    pub raw_bytes: u64,
    /// Compressed outer packets (`compressed_packets`) written.
    pub batches: u64,
    pub track_descriptors: u64,
    pub slices: u64,
    pub instants: u64,
    pub counter_values: u64,
    /// Strings sent in `interned_data` (event names, annotation names, values).
    pub interned: u64,
    pub flows: u64,
    /// Packet sequences started (the main one included).
    pub sequences: u64,
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
    /// Its uuid: a slot reused after a retired track holds another.
    uuid: u32,
    /// Until written: the descriptor to write.
    /// Boxed: every event looks its track up, and a small entry keeps the
    /// table in fewer cache lines.
    pending: Option<Box<proto::TrackDescriptor>>,
    /// Index of the sequence its events go on.
    seq: usize,
    parent: Option<TrackId>,
    kind: Kind,
    /// Open slices on the track.
    depth: u32,
    /// For error messages.
    name: Box<str>,
    /// Its events' `track_uuid` field (key and varint, little-endian) and
    /// its length: 0 when its sequence's defaults name the track. Worked
    /// out once, not per event.
    uuid_field: u64,
    uuid_field_len: u8,
}

/// Strings sent once per sequence, then referred to by iid. Looked up for
/// every event name and annotation (dozens of times per request): an
/// open-addressing table whose slots hold the hash, the length and the
/// first [`INLINE`] bytes, so that a look-up of a short name reads one slot
/// and the caller's string (a `HashMap<Box<str>, _>` also read each boxed
/// key, a cache miss, and called `memcmp`). In front of it a memo by the
/// string's address: names are mostly literals, the same address every
/// time, and the memo's hit skips hashing the bytes (about half of a
/// look-up's instructions); the bytes are still compared, so a buffer
/// reused for another string at the same address is never mistaken for it.
#[derive(Default)]
struct Interner {
    /// Power-of-two many, at most half full.
    slots: Vec<Slot>,
    /// Strings longer than [`INLINE`], by iid - 1 (None for short ones).
    long: Vec<Option<Box<str>>>,
    /// Per hash of an address ([`MEMO_BITS`] bits): the address last looked
    /// up there and its slot + 1 (0: none). Cleared when the slots move.
    memo: Vec<(usize, u32)>,
}

/// The address memo's size: 2^9 entries, 8 KiB per table (2^7 left the
/// hot names' addresses colliding, as the code around moved: 50 % more
/// look-ups fell through to the table).
const MEMO_BITS: u32 = 9;

/// Bytes of a string kept in its slot.
const INLINE: usize = 24;

#[derive(Clone, Copy, Default)]
struct Slot {
    hash: u64,
    /// 0: empty.
    iid: u32,
    len: u32,
    head: [u8; INLINE],
}

impl Interner {
    /// The iid of `s`, and whether it is new (must be sent in this packet).
    /// The memo's hit inlined; the rest (hashing, probing, inserting) out of
    /// line, whose saving of registers cost a hit as much again.
    #[inline(always)]
    fn get(&mut self, s: &str) -> (u64, bool) {
        let b = s.as_bytes();
        let (m, hit) = self.memo_slot(b.as_ptr() as usize);
        if let Some(slot) = hit {
            if self.holds(slot, b) {
                return (u64::from(slot.iid), false);
            }
        }
        self.get_slow(s, m)
    }

    /// [`get`](Self::get) for a `'static` string (callers hold that: an
    /// [`Arg`] made by a constructor taking only those): a memo hit at its address
    /// with its length is the string itself, without comparing the bytes.
    /// The memo's entry for that address was made by a look-up of a string
    /// there: no other string lives at a `'static` string's address, so
    /// one of the same length is a `'static` string with the same bytes
    /// (the memo is cleared when the slots move). Annotation names, a
    /// request slice's two dozen: ~13 instructions less a look-up.
    #[inline(always)]
    fn get_literal(&mut self, s: &str) -> (u64, bool) {
        let b = s.as_bytes();
        let (m, hit) = self.memo_slot(b.as_ptr() as usize);
        if let Some(slot) = hit {
            if slot.len as usize == b.len() {
                return (u64::from(slot.iid), false);
            }
        }
        self.get_slow(s, m)
    }

    /// The memo's index for a string at `addr`, and the slot it remembers
    /// for that address (None: another address there, or none yet; the
    /// memo is empty until the first look-up grows the table). The caller
    /// checks the slot still holds its string.
    #[inline(always)]
    fn memo_slot(&self, addr: usize) -> (usize, Option<&Slot>) {
        let m = ((addr as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - MEMO_BITS)) as usize;
        match self.memo.get(m) {
            Some(&(ma, ms)) if ma == addr && ms != 0 => (m, Some(&self.slots[ms as usize - 1])),
            _ => (m, None),
        }
    }

    #[inline(never)]
    fn get_slow(&mut self, s: &str, m: usize) -> (u64, bool) {
        if self.long.len() * 2 >= self.slots.len() {
            self.grow();
        }
        let b = s.as_bytes();
        let addr = b.as_ptr() as usize;
        let h = str_hash(b);
        let mask = self.slots.len() - 1;
        let mut at = (h >> 32) as usize & mask;
        loop {
            let slot = &self.slots[at];
            if slot.iid == 0 {
                break;
            }
            if slot.hash == h && self.holds(slot, b) {
                self.memo[m] = (addr, at as u32 + 1);
                return (u64::from(slot.iid), false);
            }
            at = (at + 1) & mask;
        }
        self.memo[m] = (addr, at as u32 + 1);
        self.long.push((b.len() > INLINE).then(|| s.into()));
        let iid = self.long.len() as u32;
        let mut head = [0u8; INLINE];
        let n = b.len().min(INLINE);
        head[..n].copy_from_slice(&b[..n]);
        self.slots[at] = Slot { hash: h, iid, len: b.len() as u32, head };
        (u64::from(iid), true)
    }

    /// Whether `slot` holds the string `b`.
    #[inline]
    fn holds(&self, slot: &Slot, b: &[u8]) -> bool {
        slot.len as usize == b.len()
            && if b.len() <= INLINE {
                same_bytes(&slot.head[..b.len()], b)
            } else {
                self.long[slot.iid as usize - 1].as_deref().is_some_and(|l| same_bytes(l.as_bytes(), b))
            }
    }

    fn grow(&mut self) {
        self.memo.clear();
        self.memo.resize(1 << MEMO_BITS, (0, 0));
        let n = (self.slots.len() * 2).max(64);
        let mut slots = vec![Slot::default(); n];
        for slot in self.slots.iter().filter(|s| s.iid != 0) {
            let mut at = (slot.hash >> 32) as usize & (n - 1);
            while slots[at].iid != 0 {
                at = (at + 1) & (n - 1);
            }
            slots[at] = *slot;
        }
        self.slots = slots;
    }
}

/// A hash of the bytes and their length: FxHash's step over 8-byte words,
/// the last one read overlapping the one before (as a short string's few
/// bytes are read), so that no byte is handled alone.
#[inline]
fn str_hash(b: &[u8]) -> u64 {
    const K: u64 = 0x51_7c_c1_b7_27_22_0a_95;
    let step = |h: u64, v: u64| (h.rotate_left(5) ^ v).wrapping_mul(K);
    let n = b.len();
    let mut h = (n as u64).wrapping_mul(K);
    if n >= 8 {
        let mut i = 0;
        while i + 8 < n {
            h = step(h, read64(b, i));
            i += 8;
        }
        step(h, read64(b, n - 8))
    } else if n >= 4 {
        step(h, u64::from(read32(b, 0)) | u64::from(read32(b, n - 4)) << 32)
    } else if n > 0 {
        step(h, u64::from(b[0]) | u64::from(b[n / 2]) << 8 | u64::from(b[n - 1]) << 16)
    } else {
        h
    }
}

/// Byte equality read as [`str_hash`] reads (words, the last overlapping),
/// inline: names are short, and a call to `memcmp` costs more.
#[inline]
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    if n >= 8 {
        let mut i = 0;
        while i + 8 < n {
            if read64(a, i) != read64(b, i) {
                return false;
            }
            i += 8;
        }
        read64(a, n - 8) == read64(b, n - 8)
    } else if n >= 4 {
        read32(a, 0) == read32(b, 0) && read32(a, n - 4) == read32(b, n - 4)
    } else {
        a.iter().zip(b).all(|(x, y)| x == y)
    }
}


/// Where [`Value::Shared`] strings' iids start: above any the string
/// value table gives (its count is a `u32`), 5 bytes as a varint.
const SHARED_IIDS: u64 = 1 << 32;

/// One packet sequence: its incremental state.
struct Seq {
    id: u32,
    /// The track its events default to (own-sequence tracks).
    default_track: Option<u64>,
    started: bool,
    event_names: Interner,
    arg_names: Interner,
    string_values: Interner,
    /// The next shared string's iid: from [`SHARED_IIDS`] up, apart from
    /// the intern table's (which count from 1).
    next_shared: u64,
    /// Absolute (CLOCK_MONOTONIC) time of the sequence's last timestamp.
    last_ts: u64,
    /// Its events' packets end with its id and flags: those fields'
    /// bytes (little-endian) and their length, worked out once.
    tail: u64,
    tail_len: usize,
}

impl Seq {
    fn new(id: u32, default_track: Option<u64>) -> Self {
        // trusted_packet_sequence_id (10) and sequence_flags (13): 8 bytes at most.
        let (packed, k) = varint_packed(u64::from(id));
        let tail = 0x68 << (8 * (k + 1)) | u64::from(proto::SEQ_NEEDS_INCREMENTAL_STATE) << (8 * (k + 2)) | packed << 8 | 0x50;
        Seq {
            id,
            default_track,
            started: false,
            event_names: Interner::default(),
            arg_names: Interner::default(),
            string_values: Interner::default(),
            next_shared: SHARED_IIDS,
            last_ts: 0,
            tail,
            tail_len: k + 3,
        }
    }
}

/// Packets waiting to be compressed, and the compressor (reset per batch,
/// so each batch is a zlib stream of its own).
struct Batch {
    packets: Vec<u8>,
    limit: usize,
    zlib: Compressor,
    /// The outer packet being built: framing then the zlib stream.
    outer: Vec<u8>,
}

/// Level 1: [`FastZlib`]; 2–9: miniz_oxide at that level.
enum Compressor {
    Fast(Box<FastZlib>),
    Miniz(Box<CompressorOxide>),
}

/// Room for the outer packet's framing before the zlib stream: two keys of
/// at most 2 bytes and two length varints of at most 5 bytes (< 4 GiB).
const OUTER_HEAD: usize = 14;

/// Streams TracePackets into `out`. Wrap files in a `BufWriter`.
pub struct TraceWriter<W: Write> {
    out: W,
    buf: Vec<u8>,
    /// The interned strings of the event being encoded, reused (see [`Scratch`]).
    scratch: Scratch,
    /// When compressing: the batch being filled.
    batch: Option<Batch>,
    /// Declared tracks by [`TrackId`] slot; retired ones (see
    /// [`TraceWriter::retire`]) are forgotten and their slots reused, so
    /// that a streamed trace's memory follows its open tracks.
    tracks: Vec<Option<TrackDecl>>,
    free_slots: Vec<u32>,
    next_uuid: u32,
    processes: crate::correlate::FxMap<u32, TrackId>,
    threads: crate::correlate::FxMap<(u32, u32), TrackId>,
    seqs: Vec<Seq>,
    /// The sequence tracks declared without `own_sequence` go on.
    default_seq: usize,
    next_flow: u64,
    stats: WriterStats,
}

impl<W: Write> TraceWriter<W> {
    /// Starts the trace: the main sequence's first packet clears incremental
    /// state, sets the packet defaults (timestamps on its incremental clock)
    /// and a clock snapshot at `start_ns` that makes CLOCK_MONOTONIC the
    /// primary trace clock. Compressed ([`Encoding::default`]).
    pub fn new(out: W, start_ns: u64) -> Result<Self, PerfettoError> {
        Self::with_encoding(out, start_ns, Encoding::default())
    }

    /// [`new`](Self::new) with the given encoding.
    pub fn with_encoding(out: W, start_ns: u64, enc: Encoding) -> Result<Self, PerfettoError> {
        let batch = enc.compress.then(|| {
            // Window bits > 0: the zlib wrapper (header and Adler-32), what
            // traced's deflateInit writes and trace processor's inflate
            // expects (it auto-detects zlib or gzip, not raw deflate).
            let level = enc.level.clamp(1, 9);
            let zlib = if level == 1 { Compressor::Fast(Box::default()) } else { Compressor::Miniz(Box::new(CompressorOxide::new(create_comp_flags_from_zip_params(level.into(), 15, 0)))) };
            let limit = enc.batch_bytes.max(1);
            Batch { packets: Vec::with_capacity(limit + 256), limit, zlib, outer: Vec::new() }
        });
        let mut w = TraceWriter {
            out,
            buf: Vec::with_capacity(256),
            scratch: Scratch::default(),
            batch,
            tracks: Vec::new(),
            free_slots: Vec::new(),
            next_uuid: 1,
            processes: Default::default(),
            threads: Default::default(),
            seqs: vec![Seq::new(SEQUENCE_ID, None)],
            default_seq: 0,
            next_flow: 1,
            stats: WriterStats::default(),
        };
        w.start_sequence(0, start_ns)?;
        Ok(w)
    }

    /// The first packet of a sequence: clears its state, sets its defaults and
    /// ties its incremental clock to CLOCK_MONOTONIC at `ts`.
    fn start_sequence(&mut self, seq: usize, ts: u64) -> Result<(), PerfettoError> {
        let s = &mut self.seqs[seq];
        s.started = true;
        s.last_ts = ts;
        let first = proto::TracePacket {
            trusted_packet_sequence_id: Some(s.id),
            sequence_flags: Some(proto::SEQ_INCREMENTAL_STATE_CLEARED),
            first_packet_on_sequence: Some(true),
            trace_packet_defaults: Some(proto::TracePacketDefaults {
                timestamp_clock_id: Some(INCREMENTAL_CLOCK_ID),
                track_event_defaults: s.default_track.map(|t| proto::TrackEventDefaults { track_uuid: Some(t) }),
            }),
            data: Some(proto::Data::ClockSnapshot(proto::ClockSnapshot {
                clocks: vec![
                    proto::Clock { clock_id: Some(proto::BUILTIN_CLOCK_MONOTONIC), timestamp: Some(ts), is_incremental: None },
                    proto::Clock { clock_id: Some(INCREMENTAL_CLOCK_ID), timestamp: Some(ts), is_incremental: Some(true) },
                ],
                primary_trace_clock: Some(proto::BUILTIN_CLOCK_MONOTONIC as i32),
            })),
            ..Default::default()
        };
        self.write_packet(&first)?;
        self.stats.sequences += 1;
        Ok(())
    }

    fn declare(&mut self, mut desc: proto::TrackDescriptor, parent: Option<TrackId>, kind: Kind, name: &str, own_sequence: bool) -> TrackId {
        let uuid = self.next_uuid;
        // Four billion tracks would be a recording of terabytes.
        self.next_uuid = uuid.checked_add(1).expect("fewer than 2^32 tracks in one trace");
        desc.uuid = Some(u64::from(uuid));
        desc.parent_uuid = parent.map(TrackId::uuid);
        let seq = if own_sequence {
            self.seqs.push(Seq::new(SEQUENCE_ID + self.seqs.len() as u32, Some(u64::from(uuid))));
            self.seqs.len() - 1
        } else {
            self.default_seq
        };
        let (uuid_field, uuid_field_len) = match self.seqs[seq].default_track == Some(u64::from(uuid)) {
            true => (0, 0),
            false => {
                let (packed, k) = varint_packed(u64::from(uuid));
                (packed << 8 | 0x58, k as u8 + 1)
            }
        };
        let decl = Some(TrackDecl { uuid, pending: Some(Box::new(desc)), seq, parent, kind, depth: 0, name: name.into(), uuid_field, uuid_field_len });
        let slot = match self.free_slots.pop() {
            Some(k) => {
                self.tracks[k as usize] = decl;
                k
            }
            None => {
                self.tracks.push(decl);
                (self.tracks.len() - 1) as u32
            }
        };
        TrackId { uuid, slot }
    }

    /// The process's track, if declared.
    pub fn known_process(&self, pid: u32) -> Option<TrackId> {
        self.processes.get(&pid).copied()
    }

    /// The thread's track, if declared.
    pub fn known_thread(&self, pid: u32, tid: u32) -> Option<TrackId> {
        self.threads.get(&(pid, tid)).copied()
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
        let t = self.declare(desc, None, Kind::Slices, name, false);
        self.processes.insert(pid, t);
        t
    }

    /// The thread's track, nested in its process (declared as "pid N" if
    /// unknown). Without a name the UI shows "Thread TID". `own_sequence`:
    /// see [`TrackOpts::own_sequence`] (only the first call's counts).
    pub fn thread_track(&mut self, pid: u32, tid: u32, name: Option<&str>, own_sequence: bool) -> TrackId {
        if let Some(&t) = self.threads.get(&(pid, tid)) {
            return t;
        }
        let process = self.process_track(pid, &format!("pid {pid}"));
        let desc = proto::TrackDescriptor {
            thread: Some(proto::ThreadDescriptor { pid: Some(pid as i32), tid: Some(tid as i32), thread_name: name.map(str::to_owned) }),
            ..Default::default()
        };
        let t = self.declare(desc, Some(process), Kind::Slices, &format!("tid {tid}"), own_sequence);
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
        self.declare(desc, opts.parent, Kind::Slices, name, opts.own_sequence)
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
        self.declare(desc, opts.parent, Kind::Counter, name, opts.own_sequence)
    }

    /// Tracks declared from now on without `own_sequence` share a new packet
    /// sequence (it starts at its first event): a part of the trace written
    /// later, from an earlier time, than what is already on the others.
    pub fn use_new_sequence(&mut self) {
        self.seqs.push(Seq::new(SEQUENCE_ID + self.seqs.len() as u32, None));
        self.default_seq = self.seqs.len() - 1;
    }

    /// The sequence tracks declared without `own_sequence` go on now, to
    /// come back to with [`set_sequence`](Self::set_sequence): a streamed
    /// trace declares tracks of two parts alternately.
    pub fn sequence(&self) -> usize {
        self.default_seq
    }

    pub fn set_sequence(&mut self, seq: usize) {
        self.default_seq = seq.min(self.seqs.len() - 1);
    }

    /// Forgets a track that will get no more events (its descriptor is
    /// written, its slices closed): a streamed trace has a track per request
    /// and must not hold them all. Tracks with open slices stay.
    pub fn retire(&mut self, track: TrackId) -> Result<(), PerfettoError> {
        self.ensure_described(track)?;
        if self.decl(track)?.depth == 0 {
            self.tracks[track.slot as usize] = None;
            self.free_slots.push(track.slot);
        }
        Ok(())
    }

    /// Tracks declared and not retired (what the writer holds per track).
    pub fn tracks_held(&self) -> usize {
        self.tracks.len() - self.free_slots.len()
    }

    /// Whether an event on `track` at `ts` would keep its sequence in time
    /// order (callers skip and count what would not).
    pub fn in_order(&self, track: TrackId, ts: u64) -> bool {
        self.decl(track).is_ok_and(|d| {
            let s = &self.seqs[d.seq];
            !s.started || ts >= s.last_ts
        })
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

    /// `n` fresh flow ids, `base..base + n`; returns `base`.
    pub fn new_flow_ids(&mut self, n: u64) -> u64 {
        let base = self.next_flow;
        self.next_flow += n;
        base
    }

    /// Opens a slice on `track` at `ts`.
    pub fn begin(&mut self, ts: u64, track: TrackId, ev: &Event<'_>) -> Result<(), PerfettoError> {
        if ev.is_bare() {
            self.bare_slice_event(ts, track, EventType::SliceBegin, Some(ev.name), 1)?;
        } else {
            self.slice_event(ts, track, EventType::SliceBegin, Some(ev), 1)?;
        }
        self.stats.slices += 1;
        Ok(())
    }

    /// Closes the innermost open slice on `track` at `ts`.
    pub fn end(&mut self, ts: u64, track: TrackId) -> Result<(), PerfettoError> {
        self.bare_slice_event(ts, track, EventType::SliceEnd, None, -1)
    }

    /// A zero-duration event on `track` at `ts`.
    pub fn instant(&mut self, ts: u64, track: TrackId, ev: &Event<'_>) -> Result<(), PerfettoError> {
        if ev.is_bare() {
            self.bare_slice_event(ts, track, EventType::Instant, Some(ev.name), 0)?;
        } else {
            self.slice_event(ts, track, EventType::Instant, Some(ev), 0)?;
        }
        self.stats.instants += 1;
        Ok(())
    }

    /// [`instant`](Self::instant) with only a name, `name` always the same
    /// for `known` (see [`NameIid`]).
    pub fn instant_known(&mut self, ts: u64, track: TrackId, name: &str, known: &mut NameIid) -> Result<(), PerfettoError> {
        self.bare_known(ts, track, name, known)?;
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

    /// Bytes the writer's buffers hold allocated (packet, batch and outer
    /// packet buffers; not the compressor's fixed ~300 KiB): what bounds its
    /// memory besides the intern and track tables.
    pub fn buffer_capacity(&self) -> usize {
        self.buf.capacity() + self.batch.as_ref().map_or(0, |b| b.packets.capacity() + b.outer.capacity())
    }

    /// Process tracks declared so far.
    pub fn processes(&self) -> usize {
        self.processes.len()
    }

    /// Pushes what was written so far to the output, compressing the
    /// current batch however small (a live trace stays readable up to here if
    /// the process dies).
    pub fn flush(&mut self) -> Result<(), PerfettoError> {
        self.write_batch()?;
        self.out.flush()?;
        Ok(())
    }

    /// Checks that every slice was closed, flushes, and returns the output.
    pub fn finish(mut self) -> Result<(W, WriterStats), PerfettoError> {
        let open: u64 = self.tracks.iter().flatten().map(|t| t.depth as u64).sum();
        if open > 0 {
            let t = self.tracks.iter().flatten().filter(|t| t.depth > 0).min_by_key(|t| t.uuid).expect("an open track exists");
            return Err(PerfettoError::OpenSlices { open, uuid: u64::from(t.uuid), name: t.name.to_string() });
        }
        self.write_batch()?;
        self.out.flush()?;
        Ok((self.out, self.stats))
    }

    fn decl(&self, track: TrackId) -> Result<&TrackDecl, PerfettoError> {
        match self.tracks.get(track.slot as usize) {
            Some(Some(d)) if d.uuid == track.uuid => Ok(d),
            _ => Err(PerfettoError::UnknownTrack(track.uuid())),
        }
    }

    fn decl_mut(&mut self, track: TrackId) -> Result<&mut TrackDecl, PerfettoError> {
        decl_mut(&mut self.tracks, track)
    }

    /// A counter value: [`small_event`](Self::small_event) when its
    /// numbers are in range, else field by field.
    fn counter_event(&mut self, ts: u64, track: TrackId, int: Option<i64>, double: Option<f64>) -> Result<(), PerfettoError> {
        let seq = self.prepare(ts, track, Kind::Counter, 0)?;
        // TrackEvent fields in tag order, as prost writes them: type (9),
        // track_uuid (11), counter_value (30), double_counter_value (44).
        if int.is_none_or(|v| (v as u64) < 1 << 56) {
            let mut p = Small::event(EventType::Counter);
            let d = self.decl(track)?;
            p.word(d.uuid_field, usize::from(d.uuid_field_len));
            if let Some(v) = int {
                // Field 30, varint: the two-byte key 0xf0 0x01.
                p.word(0x01f0, 2);
                let (packed, k) = varint_packed(v as u64);
                p.word(packed, k);
            }
            if let Some(v) = double {
                // Field 44, fixed64: the two-byte key 0xe1 0x02.
                p.word(0x02e1, 2);
                p.word(v.to_bits(), 8);
            }
            if let Some(r) = self.small_event(seq, ts, p) {
                r?;
                self.stats.counter_values += 1;
                return Ok(());
            }
        }
        self.counter_fields(seq, ts, track, int, double)?;
        self.stats.counter_values += 1;
        Ok(())
    }

    /// [`counter_event`](Self::counter_event) field by field (any numbers).
    fn counter_fields(&mut self, seq: usize, ts: u64, track: TrackId, int: Option<i64>, double: Option<f64>) -> Result<(), PerfettoError> {
        let d = decl_mut(&mut self.tracks, track)?;
        let (uuid_field, uuid_len) = (d.uuid_field, usize::from(d.uuid_field_len));
        self.scratch.clear();
        let (te, at) = open_event(&mut self.batch, &mut self.buf, false);
        put_varint_field(te, 9, EventType::Counter as u64);
        put_word(te, u128::from(uuid_field), uuid_len);
        if let Some(v) = int {
            put_varint_field(te, 30, v as u64);
        }
        if let Some(v) = double {
            put_key(te, 44, WIRE_FIXED64);
            te.extend_from_slice(&v.to_bits().to_le_bytes());
        }
        self.close_event(seq, ts, at)
    }

    /// Ends a [`Small`] packet (its TrackEvent put together) as
    /// [`close_event`](Self::close_event) ends one without interned
    /// strings, and appends it with one fixed-size copy. None (and nothing
    /// written) for a timestamp delta from 2^49 ns (6.5 days): the
    /// general path writes that one.
    #[inline(always)]
    fn small_event(&mut self, seq: usize, ts: u64, mut p: Small) -> Option<Result<(), PerfettoError>> {
        let s = &mut self.seqs[seq];
        let delta = ts - s.last_ts;
        if delta >= 1 << 49 {
            return None;
        }
        s.last_ts = ts;
        let te_len = p.n - Small::HEAD;
        // timestamp (8), trusted_packet_sequence_id (10), sequence_flags (13).
        p.field(0x40, delta);
        p.word(s.tail, s.tail_len);
        // The packet and TrackEvent lengths: one byte each (under 64 bytes).
        let n = p.n;
        p.b[..4].copy_from_slice(&[0x0a, (n - 2) as u8, 0x5a, te_len as u8]);
        let dst = packet_dst(&mut self.batch, &mut self.buf);
        let from = dst.len();
        // In 16-byte pieces, as many as it takes (two for most): each an
        // inlined copy, where the whole array's went through a call to
        // `Vec::append_elements` and `memcpy` (~40 instructions an event).
        let b = &p.b;
        dst.extend_from_slice(&b[..16]);
        dst.extend_from_slice(&b[16..32]);
        if n > 32 {
            dst.extend_from_slice(&b[32..]);
        }
        dst.truncate(from + n);
        Some(self.packet_written(from))
    }

    /// A slice end, or a begin or instant with only a name the sequence
    /// knows (a chunk; no args, flows or new interned name): its TrackEvent
    /// for [`small_event`](Self::small_event). None when that does not
    /// take it.
    #[inline(always)]
    fn bare_event(&mut self, seq: usize, ts: u64, track: TrackId, ty: EventType, name_iid: Option<u64>) -> Option<Result<(), PerfettoError>> {
        // Declared (prepare found it): its uuid field as worked out then.
        let d = self.tracks.get(track.slot as usize)?.as_ref()?;
        // type (9), name_iid (10), track_uuid (11).
        let mut p = Small::event(ty);
        if let Some(iid) = name_iid {
            p.field(0x50, iid);
        }
        p.word(d.uuid_field, usize::from(d.uuid_field_len));
        self.small_event(seq, ts, p)
    }

    /// `depth`: what the event does to the track's open slices.
    fn slice_event(&mut self, ts: u64, track: TrackId, ty: EventType, ev: Option<&Event<'_>>, depth: i32) -> Result<(), PerfettoError> {
        let seq = self.prepare(ts, track, Kind::Slices, depth)?;
        // The event name is interned before the annotations' strings (each
        // table has its own iids, given in order of first use).
        let name = match ev {
            Some(ev) if !ev.unique_name => Some(self.seqs[seq].event_names.get(ev.name)),
            _ => None,
        };
        self.event_fields(seq, ts, track, ty, ev, name)
    }

    /// A slice end, or a begin or instant with only a name ([`Event::is_bare`]):
    /// most of a trace's events, kept out of [`slice_event`](Self::slice_event)
    /// (whose annotations' registers each call saved and restored).
    #[inline(never)]
    fn bare_slice_event(&mut self, ts: u64, track: TrackId, ty: EventType, name: Option<&str>, depth: i32) -> Result<(), PerfettoError> {
        let seq = self.prepare(ts, track, Kind::Slices, depth)?;
        let iid = name.map(|n| self.seqs[seq].event_names.get(n));
        if iid.is_none_or(|(_, new)| !new) {
            if let Some(r) = self.bare_event(seq, ts, track, ty, iid.map(|(iid, _)| iid)) {
                return r;
            }
        }
        let ev = name.map(Event::named);
        self.event_fields(seq, ts, track, ty, ev.as_ref(), iid)
    }

    /// [`bare_slice_event`](Self::bare_slice_event) for an instant, with
    /// the name's iid as `known` holds it for the track's sequence (else
    /// looked up, and kept).
    #[inline(never)]
    fn bare_known(&mut self, ts: u64, track: TrackId, name: &str, known: &mut NameIid) -> Result<(), PerfettoError> {
        let ty = EventType::Instant;
        let seq = self.prepare(ts, track, Kind::Slices, 0)?;
        let iid = if known.iid != 0 && known.seq as usize == seq {
            (u64::from(known.iid), false)
        } else {
            let got = self.seqs[seq].event_names.get(name);
            // Known from this event on: when new, it is sent with it.
            *known = NameIid { seq: seq as u32, iid: got.0 as u32 };
            got
        };
        if !iid.1 {
            if let Some(r) = self.bare_event(seq, ts, track, ty, Some(iid.0)) {
                return r;
            }
        }
        let ev = Event::named(name);
        self.event_fields(seq, ts, track, ty, Some(&ev), Some(iid))
    }

    /// [`slice_event`](Self::slice_event) field by field: any event.
    /// `name`: the event name's iid and whether it is new on the sequence.
    fn event_fields(&mut self, seq: usize, ts: u64, track: TrackId, ty: EventType, ev: Option<&Event<'_>>, name: Option<(u64, bool)>) -> Result<(), PerfettoError> {
        let d = decl_mut(&mut self.tracks, track)?;
        let (uuid_field, uuid_len) = (d.uuid_field, usize::from(d.uuid_field_len));
        let sc = &mut self.scratch;
        sc.clear();
        let s = &mut self.seqs[seq];
        let (te, at) = open_event(&mut self.batch, &mut self.buf, ev.is_some_and(likely_wide));
        let name_iid = match (ev, name) {
            (Some(ev), Some((iid, new))) => {
                if new {
                    sc.interned += 1;
                    put_interned(&mut sc.event_names, 2, iid, ev.name.as_bytes());
                }
                Some(iid)
            }
            _ => None,
        };
        // TrackEvent fields in tag order, as prost writes them:
        // debug_annotations (4), type (9), name_iid (10), track_uuid (11),
        // name (23), flow_ids (47), terminating_flow_ids (48).
        if let Some(ev) = ev {
            for a in ev.args {
                sc.annotation(te, s, a);
            }
        }
        // Type and name iid (a u32: 8 bytes at most) in one word, the
        // track's uuid field as worked out when it was declared.
        let (mut head, mut n) = (0x48 | (ty as u64) << 8, 2);
        if let Some(iid) = name_iid {
            let (packed, k) = varint_packed(iid);
            head |= 0x50 << 16 | packed << 24;
            n += k + 1;
        }
        put_word(te, u128::from(head), n);
        put_word(te, u128::from(uuid_field), uuid_len);
        if let Some(ev) = ev {
            if ev.unique_name {
                put_bytes_field(te, 23, ev.name.as_bytes());
            }
            for &id in ev.flow_ids {
                put_key(te, 47, WIRE_FIXED64);
                te.extend_from_slice(&id.to_le_bytes());
            }
            for &id in ev.terminating_flow_ids {
                put_key(te, 48, WIRE_FIXED64);
                te.extend_from_slice(&id.to_le_bytes());
            }
            self.stats.flows += ev.flow_ids.len() as u64;
        }
        self.close_event(seq, ts, at)
    }

    /// What every event needs before it is encoded, with one look-up of
    /// its track: the track is of `kind` (a slice end has a slice to close),
    /// `ts` does not go backwards on its sequence (started at `ts` if this is
    /// its first event), its descriptor is written. `depth` is applied to
    /// the track's open slices once nothing but the output can fail.
    /// Returns the sequence.
    #[inline(always)]
    fn prepare(&mut self, ts: u64, track: TrackId, kind: Kind, depth: i32) -> Result<usize, PerfettoError> {
        // The usual event, inlined: a described track of the kind, an end
        // with a slice to close, a started sequence in time order. Anything
        // else (an error, a first event) takes the whole path out of line.
        if let Ok(d) = decl_mut(&mut self.tracks, track) {
            let s = &self.seqs[d.seq];
            let usual = d.kind == kind && !(depth < 0 && d.depth == 0) && s.started && ts >= s.last_ts && d.pending.is_none();
            if usual {
                d.depth = d.depth.saturating_add_signed(depth);
                return Ok(d.seq);
            }
        }
        self.prepare_slow(ts, track, kind, depth)
    }

    #[inline(never)]
    fn prepare_slow(&mut self, ts: u64, track: TrackId, kind: Kind, depth: i32) -> Result<usize, PerfettoError> {
        let d = decl_mut(&mut self.tracks, track)?;
        if depth < 0 && d.depth == 0 && d.kind == Kind::Slices {
            return Err(PerfettoError::UnbalancedEnd { uuid: track.uuid(), name: d.name.to_string() });
        }
        if d.kind != kind {
            let (uuid, name) = (track.uuid(), d.name.to_string());
            return Err(match kind {
                Kind::Slices => PerfettoError::SliceOnCounterTrack { uuid, name },
                Kind::Counter => PerfettoError::CounterOnSliceTrack { uuid, name },
            });
        }
        let seq = d.seq;
        let s = &self.seqs[seq];
        if s.started && ts < s.last_ts {
            return Err(PerfettoError::TimestampRegression { ts, last: s.last_ts });
        }
        // Counter tracks keep depth 0 (an end there is refused above only for slices).
        d.depth = d.depth.saturating_add_signed(depth);
        let (started, pending) = (s.started, d.pending.is_some());
        if !started {
            self.start_sequence(seq, ts)?;
        }
        if pending {
            self.ensure_described(track)?;
        }
        Ok(seq)
    }

    /// Writes the descriptors of `track` and its undescribed ancestors, root first.
    fn ensure_described(&mut self, track: TrackId) -> Result<(), PerfettoError> {
        if self.decl(track)?.pending.is_none() {
            return Ok(());
        }
        let mut chain = vec![track];
        let mut cur = self.decl(track)?.parent;
        while let Some(p) = cur {
            // A retired ancestor was described before it was retired.
            let Ok(d) = self.decl(p) else { break };
            if d.pending.is_none() {
                break;
            }
            chain.push(p);
            cur = d.parent;
        }
        for t in chain.into_iter().rev() {
            let desc = self.decl_mut(t).ok().and_then(|d| d.pending.take()).expect("pending descriptor");
            if desc.process.is_none() && desc.thread.is_none() && desc.counter.is_none() {
                self.write_plain_descriptor(&desc)?;
            } else {
                let packet = proto::TracePacket {
                    trusted_packet_sequence_id: Some(SEQUENCE_ID),
                    sequence_flags: Some(proto::SEQ_NEEDS_INCREMENTAL_STATE),
                    data: Some(proto::Data::TrackDescriptor(*desc)),
                    ..Default::default()
                };
                self.write_packet(&packet)?;
            }
            self.stats.track_descriptors += 1;
        }
        Ok(())
    }

    /// A plain track's descriptor packet (no process, thread or counter
    /// part: a request's or chain's track, a group), encoded as prost
    /// encodes [`write_packet`](Self::write_packet)'s message for it:
    /// fields in tag order (the `data` oneof by its lowest tag, 6: the
    /// descriptor, then sequence id and flags; the descriptor's uuid, name,
    /// parent, ordering, rank). A streamed trace declares a track per
    /// request; building the message and encoding it through prost cost
    /// ~650 instructions more per track.
    fn write_plain_descriptor(&mut self, d: &proto::TrackDescriptor) -> Result<(), PerfettoError> {
        let dst = packet_dst(&mut self.batch, &mut self.buf);
        let from = dst.len();
        let mut body = 0;
        if let Some(v) = d.uuid {
            body += 1 + varint_len(v);
        }
        if let Some(v) = d.parent_uuid {
            body += 1 + varint_len(v);
        }
        if let Some(n) = &d.name {
            body += 1 + varint_len(n.len() as u64) + n.len();
        }
        if let Some(v) = d.child_ordering {
            body += 1 + varint_len(v as u64);
        }
        if let Some(v) = d.sibling_order_rank {
            body += 1 + varint_len(v as u64);
        }
        // Sequence id and flags (one-byte keys), the descriptor's two-byte key (60).
        let packet = 1 + varint_len(u64::from(SEQUENCE_ID)) + 1 + varint_len(u64::from(proto::SEQ_NEEDS_INCREMENTAL_STATE)) + 2 + varint_len(body as u64) + body;
        put_key(dst, proto::TRACE_PACKET_FIELD, WIRE_LEN);
        put_varint(dst, packet as u64);
        put_key(dst, 60, WIRE_LEN);
        put_varint(dst, body as u64);
        if let Some(v) = d.uuid {
            put_varint_field(dst, 1, v);
        }
        if let Some(n) = &d.name {
            put_bytes_field(dst, 2, n.as_bytes());
        }
        if let Some(v) = d.parent_uuid {
            put_varint_field(dst, 5, v);
        }
        // int32 and enum fields: sign-extended to 64 bits, as prost writes them.
        if let Some(v) = d.child_ordering {
            put_varint_field(dst, 11, v as u64);
        }
        if let Some(v) = d.sibling_order_rank {
            put_varint_field(dst, 12, v as u64);
        }
        put_varint_field(dst, 10, u64::from(SEQUENCE_ID));
        put_varint_field(dst, 13, u64::from(proto::SEQ_NEEDS_INCREMENTAL_STATE));
        self.packet_written(from)
    }

    /// Ends the event's packet started by [`open_event`] (its TrackEvent
    /// encoded in place since): the bytes prost writes for `TracePacket {
    /// timestamp, trusted_packet_sequence_id, interned_data, sequence_flags,
    /// data: TrackEvent }` (fields in tag order, the `data` oneof first: its
    /// lowest tag is 6), without building the message.
    /// Inlined into both event paths: a call per event saved.
    #[inline(always)]
    fn close_event(&mut self, seq: usize, ts: u64, at: EventAt) -> Result<(), PerfettoError> {
        let s = &mut self.seqs[seq];
        let delta = ts - s.last_ts;
        s.last_ts = ts;
        let (seq_id, tail, tail_len) = (s.id, s.tail, s.tail_len);
        let sc = &self.scratch;
        self.stats.interned += sc.interned;
        let dst = match &mut self.batch {
            Some(b) => &mut b.packets,
            None => &mut self.buf,
        };
        if at.wide {
            close_len_wide(dst, at.track_event);
        } else {
            close_len(dst, at.track_event);
        }
        // Key and varint in one word when the delta is under 2^49 (a word's
        // 7 bytes of 7 bits), as in the small events.
        if delta < 1 << 49 {
            let (packed, k) = varint_packed(delta);
            put_word(dst, u128::from(packed << 8 | 0x40), k + 1);
        } else {
            put_varint_field(dst, 8, delta);
        }
        if sc.interned > 0 {
            put_varint_field(dst, 10, seq_id as u64);
            put_key(dst, 12, WIRE_LEN);
            put_varint(dst, (sc.event_names.len() + sc.arg_names.len() + sc.values.len()) as u64);
            dst.extend_from_slice(&sc.event_names);
            dst.extend_from_slice(&sc.arg_names);
            dst.extend_from_slice(&sc.values);
            put_varint_field(dst, 13, proto::SEQ_NEEDS_INCREMENTAL_STATE as u64);
        } else {
            // The sequence id and flags, as worked out for the sequence.
            put_word(dst, u128::from(tail), tail_len);
        }
        if at.wide {
            close_len_wide(dst, at.packet);
        } else {
            close_len(dst, at.packet);
        }
        self.packet_written(at.from)
    }

    /// `Trace.packet` (field 1, length-delimited) around one encoded packet:
    /// to the output, or to the batch (compressed once full).
    fn write_packet(&mut self, p: &proto::TracePacket) -> Result<(), PerfettoError> {
        let (dst, from) = match &mut self.batch {
            Some(b) => {
                let from = b.packets.len();
                (&mut b.packets, from)
            }
            None => {
                self.buf.clear();
                (&mut self.buf, 0)
            }
        };
        prost::encoding::encode_key(proto::TRACE_PACKET_FIELD, prost::encoding::WireType::LengthDelimited, dst);
        // A Vec grows as needed: encoding into it cannot run out of room.
        p.encode_length_delimited(dst).map_err(io::Error::other)?;
        self.packet_written(from)
    }

    /// Counts the packet just encoded (from `from` in the batch, or the
    /// packet buffer) and writes it, or the batch once full.
    #[inline(always)]
    fn packet_written(&mut self, from: usize) -> Result<(), PerfettoError> {
        let len = match &self.batch {
            Some(b) => b.packets.len() - from,
            None => self.buf.len(),
        } as u64;
        self.stats.packets += 1;
        self.stats.raw_bytes += len;
        match &self.batch {
            Some(b) if b.packets.len() >= b.limit => self.write_batch()?,
            Some(_) => {}
            None => {
                self.out.write_all(&self.buf)?;
                self.stats.bytes += len;
            }
        }
        Ok(())
    }

    /// Compresses the batch (one zlib stream) into one outer packet,
    /// `Trace.packet { compressed_packets }`, and writes it with one
    /// `write_all` (a reader of a live file sees it whole or cut, never
    /// interleaved). The format is `traced`'s (perfetto
    /// src/tracing/service/zlib_compressor.cc: `deflateInit` at level 6, each
    /// inner packet prefixed by its `Trace.packet` preamble, "the compressed
    /// stream looks like a valid Trace proto"); trace processor
    /// (src/trace_processor/importers/proto/proto_trace_reader.cc,
    /// `ParseCompressedPackets`) inflates it — zlib or gzip header,
    /// util/gzip_utils.cc `inflateInit2(32 + MAX_WBITS)` — and passes each
    /// inner packet to `ParsePacket` in order, the same path as a packet read
    /// inline: sequence state, interning and incremental clocks apply as if
    /// the packets were not compressed.
    fn write_batch(&mut self) -> Result<(), PerfettoError> {
        let Some(b) = &mut self.batch else { return Ok(()) };
        if b.packets.is_empty() {
            return Ok(());
        }
        let end = match &mut b.zlib {
            // Into the outer buffer at its full length: not zeroed per batch.
            Compressor::Fast(z) => z.compress_at(&b.packets, &mut b.outer, OUTER_HEAD),
            Compressor::Miniz(z) => {
                b.outer.clear();
                b.outer.resize(OUTER_HEAD, 0);
                z.reset();
                let outer = &mut b.outer;
                let (status, used) = compress_to_output(z, &b.packets, TDEFLFlush::Finish, |chunk| {
                    outer.extend_from_slice(chunk);
                    true
                });
                if status != TDEFLStatus::Done || used != b.packets.len() {
                    return Err(PerfettoError::Compress(format!("{status:?} after {used} of {} bytes", b.packets.len())));
                }
                b.outer.len()
            }
        };
        let zlen = (end - OUTER_HEAD) as u64;
        let mut head = [0u8; OUTER_HEAD];
        let mut h = &mut head[..];
        let inner_key = (proto::COMPRESSED_PACKETS_FIELD as u64) << 3 | 2;
        let body = prost::encoding::encoded_len_varint(inner_key) + prost::encoding::encoded_len_varint(zlen) + zlen as usize;
        prost::encoding::encode_varint((proto::TRACE_PACKET_FIELD as u64) << 3 | 2, &mut h);
        prost::encoding::encode_varint(body as u64, &mut h);
        prost::encoding::encode_varint(inner_key, &mut h);
        prost::encoding::encode_varint(zlen, &mut h);
        let head_len = OUTER_HEAD - h.len();
        let start = OUTER_HEAD - head_len;
        b.outer[start..OUTER_HEAD].copy_from_slice(&head[..head_len]);
        self.out.write_all(&b.outer[start..end])?;
        self.stats.bytes += (end - start) as u64;
        self.stats.batches += 1;
        b.packets.clear();
        Ok(())
    }
}

/// Where a packet is written: the batch when compressing (appended), else
/// the packet buffer, emptied first.
#[inline]
fn packet_dst<'a>(batch: &'a mut Option<Batch>, buf: &'a mut Vec<u8>) -> &'a mut Vec<u8> {
    match batch {
        Some(b) => &mut b.packets,
        None => {
            buf.clear();
            buf
        }
    }
}

/// The track in its slot (not a retired track's successor there).
#[inline]
fn decl_mut(tracks: &mut [Option<TrackDecl>], track: TrackId) -> Result<&mut TrackDecl, PerfettoError> {
    match tracks.get_mut(track.slot as usize) {
        Some(Some(d)) if d.uuid == track.uuid => Ok(d),
        _ => Err(PerfettoError::UnknownTrack(track.uuid())),
    }
}

const WIRE_VARINT: u32 = 0;
const WIRE_FIXED64: u32 = 1;
const WIRE_LEN: u32 = 2;

#[inline]
fn put_varint(dst: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        dst.push(v as u8 | 0x80);
        v >>= 7;
    }
    dst.push(v as u8);
}

#[inline]
fn put_key(dst: &mut Vec<u8>, tag: u32, wire: u32) {
    put_varint(dst, u64::from(tag << 3 | wire));
}

#[inline]
fn put_varint_field(dst: &mut Vec<u8>, tag: u32, v: u64) {
    put_key(dst, tag, WIRE_VARINT);
    put_varint(dst, v);
}

#[inline]
fn put_bytes_field(dst: &mut Vec<u8>, tag: u32, b: &[u8]) {
    put_key(dst, tag, WIRE_LEN);
    put_varint(dst, b.len() as u64);
    dst.extend_from_slice(b);
}

/// Starts a length-delimited body whose length is not known yet: one byte
/// reserved for it (most bodies are under 128 bytes); returns where the
/// body starts, for [`close_len`].
#[inline]
fn open_len(dst: &mut Vec<u8>) -> usize {
    dst.push(0);
    dst.len()
}

/// Writes the length of the body started at `at`, moving the body up when
/// its length needs more than the one reserved byte. Always inlined (two to
/// four per event: it was called), the rare move kept out of line.
#[inline(always)]
fn close_len(dst: &mut Vec<u8>, at: usize) {
    let len = (dst.len() - at) as u64;
    if len < 0x80 {
        dst[at - 1] = len as u8;
        return;
    }
    close_long(dst, at, len);
}

#[cold]
#[inline(never)]
fn close_long(dst: &mut Vec<u8>, at: usize, len: u64) {
    let n = prost::encoding::encoded_len_varint(len);
    let end = dst.len();
    dst.resize(end + n - 1, 0);
    dst.copy_within(at..end, at + n - 1);
    let mut head = &mut dst[at - 1..at - 1 + n];
    prost::encoding::encode_varint(len, &mut head);
}

/// [`close_len`] for a body with two bytes reserved for its length (one
/// expected to be 128 bytes to 16 KiB long, see [`open_event`]: a request
/// slice was moved up twice, its TrackEvent and then its packet). The body
/// is moved only when its length's varint is not two bytes long: the
/// length is written as the shortest varint, as prost writes it, whatever
/// was reserved.
#[inline(always)]
fn close_len_wide(dst: &mut Vec<u8>, at: usize) {
    let len = dst.len() - at;
    if (0x80..0x4000).contains(&len) {
        dst[at - 2] = len as u8 | 0x80;
        dst[at - 1] = (len >> 7) as u8;
        return;
    }
    close_not_wide(dst, at, len as u64);
}

#[cold]
#[inline(never)]
fn close_not_wide(dst: &mut Vec<u8>, at: usize, len: u64) {
    if len < 0x80 {
        dst.copy_within(at.., at - 1);
        dst.pop();
        dst[at - 2] = len as u8;
        return;
    }
    // Three bytes or more: one reserved byte's worth is moved up as in close_long.
    dst.remove(at - 2);
    close_long(dst, at - 1, len);
}

/// Whether the event's TrackEvent likely takes 128 bytes or more (a
/// request slice's two dozen annotations, a decode phase's id list): a
/// rough count of its annotations' bytes.
#[inline]
fn likely_wide(ev: &Event<'_>) -> bool {
    // A number as a double's 13 bytes; a unique name (a hop's label) and
    // flows count too, and 4 bytes of type and track.
    let mut n = 4 + if ev.unique_name { ev.name.len() + 3 } else { 0 } + 9 * (ev.flow_ids.len() + ev.terminating_flow_ids.len());
    for a in ev.args {
        n += match a.value {
            Value::Str(v) => v.len() + 6,
            _ => 13,
        };
        // Decided: a request slice's two dozen need not all be counted.
        if n >= 128 {
            return true;
        }
    }
    n >= 128
}

/// Where an event's packet being encoded starts: see [`open_event`].
#[derive(Clone, Copy)]
struct EventAt {
    /// Where the packet starts in its buffer (the batch, or the packet buffer).
    from: usize,
    /// The packet's body, and its TrackEvent's (for [`close_len`]).
    packet: usize,
    track_event: usize,
    /// Their lengths have two bytes reserved ([`close_len_wide`]).
    wide: bool,
}

/// Starts an event's packet in the batch (or the emptied packet buffer):
/// the `Trace.packet` key and the packet's `data` field (TrackEvent, tag 11)
/// with their lengths to be filled in. The TrackEvent is then encoded in
/// place (not in a scratch buffer copied over: a copy per event), and
/// [`TraceWriter::close_event`] adds the rest. Inlined: returned through
/// memory, its result was read back as a stalled 16-byte load per event.
/// `wide`: the event is expected to be 128 bytes or more (two bytes
/// reserved for each length, see [`close_len_wide`]).
#[inline(always)]
fn open_event<'a>(batch: &'a mut Option<Batch>, buf: &'a mut Vec<u8>, wide: bool) -> (&'a mut Vec<u8>, EventAt) {
    let dst = match batch {
        Some(b) => &mut b.packets,
        None => {
            buf.clear();
            buf
        }
    };
    let from = dst.len();
    // The `Trace.packet` key (0x0a) and the TrackEvent's (field 11: 0x5a),
    // each with its length's byte or two reserved.
    let (packet, track_event) = if wide {
        dst.extend_from_slice(&[0x0a, 0x80, 0, 0x5a, 0x80, 0]);
        (from + 3, from + 6)
    } else {
        dst.extend_from_slice(&[0x0a, 0, 0x5a, 0]);
        (from + 2, from + 4)
    };
    (dst, EventAt { from, packet, track_event, wide })
}

/// A small event's packet put together in a stack buffer: the
/// `Trace.packet` key and length and the TrackEvent's ([`Small::HEAD`]
/// bytes, filled in last), the TrackEvent, the packet's other fields; then
/// appended to the batch with one fixed-size copy. Each field is one
/// 8-byte store (its key and varint put together in a word). Written
/// field by field into the batch, each byte cost a capacity check and a
/// length update, and each length a reserved byte filled in after: ~100
/// instructions more per slice end, chunk instant or counter value, most
/// of a trace's events (callgrind, 20k-request trace).
struct Small {
    b: [u8; Small::CAP],
    n: usize,
}

impl Small {
    /// Room for the largest: 4 bytes of head, a counter's TrackEvent (type
    /// 2, uuid 6, value 2 + 8), the timestamp (8), sequence id (6) and
    /// flags (2), 38 bytes, and a word's 8 bytes stored past the last.
    const CAP: usize = 48;
    const HEAD: usize = 4;

    /// Starts a TrackEvent with its type (field 9).
    #[inline(always)]
    fn event(ty: EventType) -> Self {
        let mut p = Small { b: [0; Small::CAP], n: Small::HEAD };
        p.word(0x48 | (ty as u64) << 8, 2);
        p
    }

    /// The low `len` bytes of `w` (little-endian), with one 8-byte store.
    #[inline(always)]
    fn word(&mut self, w: u64, len: usize) {
        self.b[self.n..self.n + 8].copy_from_slice(&w.to_le_bytes());
        self.n += len;
    }

    /// A one-byte key and a varint value (under 2^49: the pair fits a word).
    #[inline(always)]
    fn field(&mut self, key: u8, v: u64) {
        let (packed, k) = varint_packed(v);
        self.word(packed << 8 | u64::from(key), k + 1);
    }
}

/// An `interned_data` entry (EventName, DebugAnnotationName or
/// InternedString: iid = 1, the string = 2) in field `tag`.
fn put_interned(dst: &mut Vec<u8>, tag: u32, iid: u64, s: &[u8]) {
    put_key(dst, tag, WIRE_LEN);
    let at = open_len(dst);
    put_varint_field(dst, 1, iid);
    put_bytes_field(dst, 2, s);
    close_len(dst, at);
}

/// One event's `interned_data` entries while its TrackEvent is encoded,
/// per table (the packet lists event names, then annotation names, then
/// string values, after the TrackEvent). Kept across events so that
/// encoding allocates nothing once warm.
#[derive(Default)]
struct Scratch {
    event_names: Vec<u8>,
    arg_names: Vec<u8>,
    values: Vec<u8>,
    /// Strings interned by this event.
    interned: u64,
}

impl Scratch {
    fn clear(&mut self) {
        self.event_names.clear();
        self.arg_names.clear();
        self.values.clear();
        self.interned = 0;
    }

    /// A DebugAnnotation (TrackEvent field 4) into `te`: `name_iid` (1),
    /// then its one value field. Its length is worked out first and
    /// written before the body (no byte reserved and moved up for a long
    /// string), and the usual annotation (a one-byte name iid with a
    /// number, a boolean, an interned value's iid or a short string's
    /// header) is put together in a 16-byte word and appended with one
    /// fixed-size copy: written byte by byte it cost a capacity check and a
    /// length update per byte, about 30 instructions more per annotation (a
    /// request slice has two dozen).
    #[inline(always)]
    fn annotation(&mut self, te: &mut Vec<u8>, s: &mut Seq, a: &Arg<'_>) {
        let (iid, new) = if a.literal { s.arg_names.get_literal(a.name) } else { s.arg_names.get(a.name) };
        if new {
            self.interned += 1;
            put_interned(&mut self.arg_names, 3, iid, a.name.as_bytes());
        }
        if iid < 0x80 {
            // Little-endian from byte 0: 0x22 (field 4, length-delimited),
            // the body's length, 0x08 (name_iid) and the iid, then from byte
            // 4 the value's key and value. Built in integers: a byte array
            // was split into a register and a store per byte.
            let head = 0x22 | 0x08 << 16 | iid << 24;
            let (w, n) = match a.value {
                Value::F64(v) => (u128::from(0x29u64 << 32) | u128::from(v.to_bits()) << 40, 13),
                Value::U64(v) if v < 1 << 56 => {
                    let (packed, k) = varint_packed(v);
                    (u128::from(0x18u64 << 32) | u128::from(packed) << 40, 5 + k)
                }
                Value::I64(v) if (v as u64) < 1 << 56 => {
                    let (packed, k) = varint_packed(v as u64);
                    (u128::from(0x20u64 << 32) | u128::from(packed) << 40, 5 + k)
                }
                Value::Bool(v) => (u128::from(0x10u64 << 32 | u64::from(v) << 40), 6),
                // A short string (an id): its key (0x32) and length, then its bytes.
                Value::Str(v) if v.len() < 0x80 - 4 => {
                    let (len, body) = (v.len() as u64, v.len() as u64 + 4);
                    put_word(te, u128::from(head | body << 8 | 0x32 << 32 | len << 40), 6);
                    te.extend_from_slice(v.as_bytes());
                    return;
                }
                Value::Interned(v) => {
                    let viid = self.value_iid(s, v);
                    // Field 17, varint: the two-byte key 0x88 0x01.
                    let (packed, k) = varint_packed(viid);
                    (u128::from(0x0188u64 << 32) | u128::from(packed) << 48, 6 + k)
                }
                _ => (0, 0),
            };
            if n > 0 {
                put_word(te, w | u128::from(head | (n as u64 - 2) << 8), n);
                return;
            }
        }
        self.annotation_slow(te, s, a, iid);
    }

    /// The iid of an interned annotation value, interned (into this
    /// packet's `interned_data`) when new on the sequence.
    #[inline(always)]
    fn value_iid(&mut self, s: &mut Seq, v: &str) -> u64 {
        let (viid, new) = s.string_values.get(v);
        if new {
            self.send_value(viid, v);
        }
        viid
    }

    /// `v` into this packet's `interned_data` as string value `iid`
    /// (InternedData field 29, `debug_annotation_string_values`).
    fn send_value(&mut self, iid: u64, v: &str) {
        self.interned += 1;
        put_interned(&mut self.values, 29, iid, v.as_bytes());
    }

    /// The iid of a [`Value::Shared`] string: the one in its cell when
    /// sent on this sequence, else a new one, whose string goes into this
    /// packet's `interned_data`.
    fn shared_iid(&mut self, s: &mut Seq, v: &str, cell: &Shared) -> u64 {
        let (seq, iid) = cell.0.get();
        if iid != 0 && seq == s.id {
            return iid;
        }
        let iid = s.next_shared;
        s.next_shared += 1;
        cell.0.set((s.id, iid));
        self.send_value(iid, v);
        iid
    }

    /// [`annotation`](Self::annotation) for the rest: long strings, large
    /// numbers and iids, field by field.
    #[inline(never)]
    fn annotation_slow(&mut self, te: &mut Vec<u8>, s: &mut Seq, a: &Arg<'_>, iid: u64) {
        let viid = match a.value {
            Value::Interned(v) => self.value_iid(s, v),
            Value::Shared(v, cell) => self.shared_iid(s, v, cell),
            _ => 0,
        };
        let value = match a.value {
            Value::Bool(_) => 2,
            Value::U64(v) => 1 + varint_len(v),
            Value::I64(v) => 1 + varint_len(v as u64),
            Value::F64(_) => 9,
            Value::Str(v) => 1 + varint_len(v.len() as u64) + v.len(),
            Value::Interned(_) | Value::Shared(..) => 2 + varint_len(viid),
        };
        put_key(te, 4, WIRE_LEN);
        put_varint(te, (1 + varint_len(iid) + value) as u64);
        put_varint_field(te, 1, iid);
        match a.value {
            Value::Bool(v) => put_varint_field(te, 2, u64::from(v)),
            Value::U64(v) => put_varint_field(te, 3, v),
            Value::I64(v) => put_varint_field(te, 4, v as u64),
            Value::F64(v) => {
                put_key(te, 5, WIRE_FIXED64);
                te.extend_from_slice(&v.to_bits().to_le_bytes());
            }
            Value::Str(v) => put_bytes_field(te, 6, v.as_bytes()),
            Value::Interned(_) | Value::Shared(..) => put_varint_field(te, 17, viid),
        }
    }
}

/// `v` as a varint in the low bytes of a word (little-endian, as written),
/// and its byte count; `v` under 2^56 (8 bytes of 7 bits).
#[inline(always)]
fn varint_packed(mut v: u64) -> (u64, usize) {
    let mut out = 0u64;
    let mut k = 0;
    while v >= 0x80 {
        out |= ((v & 0x7f) | 0x80) << (8 * k);
        v >>= 7;
        k += 1;
    }
    (out | v << (8 * k), k + 1)
}

/// The low `n` bytes of `w` (little-endian), with one fixed-size copy:
/// a field or few put together in a word cost less than written byte by
/// byte (a capacity check and a length update per byte).
#[inline(always)]
fn put_word(dst: &mut Vec<u8>, w: u128, n: usize) {
    let at = dst.len();
    dst.extend_from_slice(&w.to_le_bytes());
    dst.truncate(at + n);
}

/// Bytes of `v` as a varint.
#[inline]
fn varint_len(v: u64) -> usize {
    prost::encoding::encoded_len_varint(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_events_are_the_bytes_written_field_by_field() {
        // The same events into two writers: through the public calls (slice
        // ends, name-only begins and instants, counter values put together
        // in a stack buffer where they fit) and field by field. Covered:
        // uuids and name iids past one byte, uuids past 2^21, own-sequence
        // tracks (no uuid), a sequence id past 2^28, timestamp deltas just
        // under and from 2^49 (field by field from there), names new on the
        // sequence (interned: field by field), negative and huge integers
        // (field by field from 2^56), any double.
        let setup = || {
            let mut w = TraceWriter::with_encoding(Vec::new(), 5, Encoding::PLAIN).expect("writer");
            let mut slices: Vec<TrackId> = (0..140).map(|k| w.track(&format!("t{k}"), TrackOpts::default())).collect();
            let mut counters = vec![w.counter_track("c", CounterUnit::Count, TrackOpts::default())];
            slices.push(w.track("own", TrackOpts { own_sequence: true, ..TrackOpts::default() }));
            counters.push(w.counter_track("own c", CounterUnit::Count, TrackOpts { own_sequence: true, ..TrackOpts::default() }));
            let far = w.track("far seq", TrackOpts { own_sequence: true, ..TrackOpts::default() });
            let seq = w.decl(far).expect("declared").seq;
            let d = w.seqs[seq].default_track;
            w.seqs[seq] = Seq::new((1 << 28) + 3, d);
            slices.push(far);
            w.next_uuid = (1 << 21) - 1;
            slices.extend((0..3).map(|k| w.track(&format!("big {k}"), TrackOpts::default())));
            counters.extend((0..3).map(|k| w.counter_track(&format!("big c{k}"), CounterUnit::Count, TrackOpts::default())));
            (w, slices, counters)
        };
        let (mut fast, slices, counters) = setup();
        let (mut slow, _, _) = setup();
        let names: Vec<String> = (0..300).map(|k| format!("name {k}")).collect();
        let mut next = crate::testutil::xorshift(0x2545_f491_4f6c_dd1d);
        let mut open = vec![0u32; slices.len()];
        let mut ts = 5u64;
        let mut huge_steps = 0;
        for _ in 0..20_000 {
            let r = next();
            ts += match r % 1000 {
                0 if huge_steps < 6 => {
                    huge_steps += 1;
                    [(1 << 49) - 1, 1 << 49, (1 << 56) + (r >> 20)][huge_steps % 3]
                }
                1..=9 => r >> 30,
                _ => r % 5000,
            };
            if r.is_multiple_of(7) {
                let c = counters[(r >> 8) as usize % counters.len()];
                let seq = slow.prepare(ts, c, Kind::Counter, 0).expect("in order");
                if r.is_multiple_of(3) {
                    let v = f64::from_bits(next());
                    fast.counter_f64(ts, c, v).expect("counter");
                    slow.counter_fields(seq, ts, c, None, Some(v)).expect("counter");
                } else {
                    let v = match (r >> 4) % 4 {
                        0 => -((next() % 1000) as i64),
                        1 => next() as i64,
                        _ => (next() % 100_000) as i64,
                    };
                    fast.counter(ts, c, v).expect("counter");
                    slow.counter_fields(seq, ts, c, Some(v), None).expect("counter");
                }
                continue;
            }
            let k = (r >> 12) as usize % slices.len();
            let t = slices[k];
            let name = names[(r >> 24) as usize % names.len()].as_str();
            let (ty, depth) = match (r >> 40) % 3 {
                0 if open[k] > 0 => (EventType::SliceEnd, -1),
                1 => (EventType::SliceBegin, 1),
                _ => (EventType::Instant, 0),
            };
            let seq = slow.prepare(ts, t, Kind::Slices, depth).expect("in order");
            match ty {
                EventType::SliceEnd => {
                    fast.end(ts, t).expect("end");
                    slow.event_fields(seq, ts, t, ty, None, None).expect("end");
                }
                _ => {
                    let ev = Event::named(name);
                    if ty == EventType::SliceBegin {
                        fast.begin(ts, t, &ev).expect("begin");
                    } else {
                        fast.instant(ts, t, &ev).expect("instant");
                    }
                    let iid = slow.seqs[seq].event_names.get(name);
                    slow.event_fields(seq, ts, t, ty, Some(&ev), Some(iid)).expect("event");
                }
            }
            open[k] = open[k].saturating_add_signed(depth);
        }
        assert_eq!(huge_steps, 6);
        for (k, &t) in slices.iter().enumerate() {
            for _ in 0..open[k] {
                let seq = slow.prepare(ts, t, Kind::Slices, -1).expect("in order");
                fast.end(ts, t).expect("end");
                slow.event_fields(seq, ts, t, EventType::SliceEnd, None, None).expect("end");
            }
        }
        let (fa, st) = fast.finish().expect("balanced");
        let (fb, _) = slow.finish().expect("balanced");
        assert!(st.packets > 20_000 && st.counter_values > 2_000, "{st:?}");
        assert!(fa == fb, "{} bytes against {}; first difference at byte {:?}", fa.len(), fb.len(), fa.iter().zip(&fb).position(|(x, y)| x != y));
        let again = proto::Trace::decode(&fa[..]).expect("trace decodes").encode_to_vec();
        assert!(again == fa, "prost writes other bytes: first difference at byte {:?}", again.iter().zip(&fa).position(|(x, y)| x != y));
    }

    #[test]
    fn names_and_annotation_names_known_ahead_give_the_bytes_of_plain_look_ups() {
        // The same events into two writers: one with chunk-like instants by
        // a kept iid (`instant_known`, tracks on two sequences, the name
        // new on each) and annotations named by literals (memo hits without
        // the bytes compared, a literal and its prefix at one address), the
        // other with every name looked up from run-time strings.
        const NAME: &str = "phases_ms.first_output";
        let setup = || {
            let mut w = TraceWriter::with_encoding(Vec::new(), 5, Encoding::PLAIN).expect("writer");
            let main: Vec<TrackId> = (0..3).map(|k| w.track(&format!("t{k}"), TrackOpts::default())).collect();
            let own = w.track("own", TrackOpts { own_sequence: true, ..TrackOpts::default() });
            (w, main, own)
        };
        let (mut known, main, own) = setup();
        let (mut plain, _, _) = setup();
        let mut iid = NameIid::default();
        let mut next = crate::testutil::xorshift(0x51_7c_c1_b7_27_22_0a_95);
        let owned: Vec<String> = [NAME, &NAME[..9], "chunk", "hop", "a"].iter().map(|s| s.to_string()).collect();
        let mut ts = 5;
        for k in 0..5_000u64 {
            let r = next();
            ts += r % 300;
            let t = if r.is_multiple_of(5) { own } else { main[(r >> 8) as usize % main.len()] };
            match (r >> 16) % 3 {
                0 => {
                    known.instant_known(ts, t, "chunk", &mut iid).expect("instant");
                    plain.instant(ts, t, &Event::named(&owned[2])).expect("instant");
                }
                _ => {
                    let lit = [Arg::u64(NAME, k), Arg::f64(&NAME[..9], k as f64), Arg::bool("hop", true), Arg::interned("a", "b")];
                    let dynamic = [
                        Arg::dynamic(&owned[0], Value::U64(k)),
                        Arg::dynamic(&owned[1], Value::F64(k as f64)),
                        Arg::dynamic(&owned[3], Value::Bool(true)),
                        Arg::dynamic(&owned[4], Value::Interned("b")),
                    ];
                    let n = 1 + (r >> 24) as usize % 4;
                    known.instant(ts, t, &Event::named("e").args(&lit[..n])).expect("instant");
                    plain.instant(ts, t, &Event::named("e").args(&dynamic[..n])).expect("instant");
                }
            }
        }
        let (a, sa) = known.finish().expect("closed");
        let (b, _) = plain.finish().expect("closed");
        assert!(sa.instants == 5_000 && sa.interned >= 10, "{sa:?}");
        assert!(a == b, "{} bytes against {}; first difference at byte {:?}", a.len(), b.len(), a.iter().zip(&b).position(|(x, y)| x != y));
    }

    #[test]
    fn the_interner_numbers_strings_in_order_of_first_use_and_tells_near_misses_apart() {
        let mut t = Interner::default();
        // Near misses: a prefix, one byte changed at the end of a word or
        // of the tail, the empty string; enough strings to grow the table.
        let mut words: Vec<String> = vec![String::new(), "a".into(), "ab".into(), "abcdefgh".into(), "abcdefgi".into(), "abcdefghi".into(), "abcdefghj".into()];
        // Around the inline length: equal heads, different tails.
        let long = "x".repeat(INLINE + 9);
        words.extend([long[..INLINE].to_owned(), long[..INLINE + 1].to_owned(), long.clone(), format!("{}y", &long[..INLINE + 8])]);
        words.extend((0..500).map(|k| format!("phases_ms.decode_{k}")));
        // Every length to past the inline bytes, and each with one byte changed at every place.
        for n in 1..=INLINE + 12 {
            let base: String = (0..n).map(|i| char::from(b'a' + (i % 26) as u8)).collect();
            words.push(base.clone());
            for i in 0..n {
                let mut v = base.clone().into_bytes();
                v[i] = b'Z';
                words.push(String::from_utf8(v).expect("ascii"));
            }
        }
        words.sort();
        words.dedup();
        // The comparison itself (the table meets it only on equal hashes).
        for a in &words {
            for b in &words {
                assert_eq!(same_bytes(a.as_bytes(), b.as_bytes()), a == b, "{a:?} against {b:?}");
            }
        }
        for (k, w) in words.iter().enumerate() {
            assert_eq!(t.get(w), (k as u64 + 1, true), "first use of {w:?}");
        }
        for (k, w) in words.iter().enumerate().rev() {
            assert_eq!(t.get(&w.clone()), (k as u64 + 1, false), "second use of {w:?}");
        }
        assert_eq!(t.get("phases_ms.decode_500"), (words.len() as u64 + 1, true));

        // One buffer holding another string at the same address (as a
        // launch shape is written into one stack buffer per kernel), of the
        // same length or not, short or long: told apart by its bytes.
        let mut t = Interner::default();
        let mut buf = [0u8; 40];
        let mut at_buf = |t: &mut Interner, v: &str| {
            buf[..v.len()].copy_from_slice(v.as_bytes());
            t.get(std::str::from_utf8(&buf[..v.len()]).expect("ascii"))
        };
        assert_eq!(at_buf(&mut t, "128x1x1"), (1, true));
        assert_eq!(at_buf(&mut t, "128x1x1"), (1, false));
        assert_eq!(at_buf(&mut t, "256x1x1"), (2, true));
        assert_eq!(at_buf(&mut t, "128x1x1"), (1, false));
        assert_eq!(at_buf(&mut t, "128x1x"), (3, true));
        let long_a = "a".repeat(INLINE + 5);
        let long_b = format!("{}b", "a".repeat(INLINE + 4));
        assert_eq!(at_buf(&mut t, &long_a), (4, true));
        assert_eq!(at_buf(&mut t, &long_b), (5, true));
        assert_eq!(at_buf(&mut t, &long_a), (4, false));
        // The same string at other addresses, and a literal again and again.
        assert_eq!(t.get("256x1x1"), (2, false));
        assert_eq!(t.get(&long_b.clone()), (5, false));
        assert_eq!(t.get("chunk"), (6, true));
        assert_eq!(t.get("chunk"), (6, false));
        // Past the table's growth (its slots move): the memo is not trusted.
        for k in 0..300u64 {
            assert_eq!(t.get(&format!("name {k}")), (7 + k, true));
        }
        assert_eq!(t.get("chunk"), (6, false));
        assert_eq!(at_buf(&mut t, "128x1x1"), (1, false));
    }
}
