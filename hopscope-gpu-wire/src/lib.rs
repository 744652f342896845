//! The wire format between hopscope's CUPTI injection library (one connection
//! per CUDA process: the engine and every TP worker) and the agent.
//!
//! A connection is a unix stream socket carrying frames:
//!
//! ```text
//! frame   = len:u32le  tag:u8  payload[len-1]      (1 <= len <= MAX_FRAME)
//! ```
//!
//! All integers are little-endian; strings are `len:u16le` + UTF-8 bytes. The
//! first frame of every connection is [`Hello`] (magic `HSGW`, wire version,
//! pid); every timestamp is CLOCK_MONOTONIC nanoseconds (the clock of
//! `bpf_ktime_get_ns`), already converted by the sender. Kernel and API names
//! are interned per connection: a [`Name`] frame defines an id before the
//! first record that uses it, and ids stay valid until the connection ends.
//! Loss is data: [`Counters`] carries cumulative per-process counters (see
//! [`Counter`]); the last one before [`Message::Goodbye`] is final.
//!
//! Decoding never panics and never trusts a byte: lengths, tags, enum values,
//! UTF-8 and timestamp order are checked (`TryFrom<&[u8]>` for one frame,
//! [`FrameDecoder`] for a byte stream). A frame with a bad payload is skipped
//! (its length is known); a bad length desynchronises the stream and is fatal
//! ([`WireError::is_fatal`]).
//!
//! Versioning: [`WIRE_VERSION`] is in the hello. A receiver refuses other
//! versions. New message kinds get new tags (an old receiver skips them with
//! [`WireError::UnknownTag`], a non-fatal error); changing a payload layout
//! bumps the version.

use std::fmt;

/// Magic at the start of every [`Hello`] payload.
pub const MAGIC: [u8; 4] = *b"HSGW";
/// Version of this format, carried in the hello.
pub const WIRE_VERSION: u16 = 1;
/// Largest accepted frame body (tag + payload) in bytes.
pub const MAX_FRAME: usize = 1 << 20;
/// Longest string (kernel names can be long C++ template instantiations).
pub const MAX_STR: usize = u16::MAX as usize;
/// Most entries in one [`Counters`] message.
pub const MAX_COUNTERS: usize = 256;

/// Frame tags.
pub mod tag {
    pub const HELLO: u8 = 1;
    pub const DEVICE: u8 = 2;
    pub const NAME: u8 = 3;
    pub const KERNEL: u8 = 4;
    pub const MEMCPY: u8 = 5;
    pub const MEMSET: u8 = 6;
    pub const SYNC: u8 = 7;
    pub const API: u8 = 8;
    pub const COUNTERS: u8 = 9;
    pub const CALIBRATION: u8 = 10;
    pub const GOODBYE: u8 = 11;
}

/// Why bytes were rejected. Messages are lowercase and name the field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WireError {
    /// A frame length below 1 (no room for the tag): the stream is desynchronised.
    FrameTooShort { len: usize },
    /// A frame length above [`MAX_FRAME`]: the stream is desynchronised.
    FrameTooLarge { len: usize },
    /// `TryFrom<&[u8]>` got fewer bytes than the frame header announces.
    Incomplete { need: usize, have: usize },
    /// A payload ended before field `field`.
    Truncated { tag: u8, field: &'static str },
    /// A payload longer than its message.
    TrailingBytes { tag: u8, extra: usize },
    UnknownTag(u8),
    BadMagic,
    UnsupportedVersion(u16),
    BadUtf8 { field: &'static str },
    BadEnum { field: &'static str, value: u32 },
    TooManyCounters(usize),
    /// start is zero or end < start.
    BadTimestamps { tag: u8, start_ns: u64, end_ns: u64 },
    /// A value that cannot occur (e.g. name id 0).
    Invalid { field: &'static str },
}

impl WireError {
    /// True when the stream cannot be resynchronised (drop the connection);
    /// false when only this frame was bad and the next one can be read.
    pub fn is_fatal(&self) -> bool {
        matches!(self, WireError::FrameTooShort { .. } | WireError::FrameTooLarge { .. })
    }
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::FrameTooShort { len } => write!(f, "frame length {len} is too short for a tag"),
            WireError::FrameTooLarge { len } => write!(f, "frame length {len} exceeds the limit of {MAX_FRAME} bytes"),
            WireError::Incomplete { need, have } => write!(f, "incomplete frame: need {need} bytes, have {have}"),
            WireError::Truncated { tag, field } => write!(f, "frame with tag {tag} truncated before field {field}"),
            WireError::TrailingBytes { tag, extra } => write!(f, "frame with tag {tag} has {extra} trailing bytes"),
            WireError::UnknownTag(t) => write!(f, "unknown frame tag {t}"),
            WireError::BadMagic => write!(f, "hello does not start with the hopscope gpu magic"),
            WireError::UnsupportedVersion(v) => write!(f, "unsupported wire version {v} (this build speaks {WIRE_VERSION})"),
            WireError::BadUtf8 { field } => write!(f, "field {field} is not valid utf-8"),
            WireError::BadEnum { field, value } => write!(f, "field {field} has unknown value {value}"),
            WireError::TooManyCounters(n) => write!(f, "{n} counters exceed the limit of {MAX_COUNTERS}"),
            WireError::BadTimestamps { tag, start_ns, end_ns } => {
                write!(f, "frame with tag {tag} has impossible timestamps start={start_ns} end={end_ns}")
            }
            WireError::Invalid { field } => write!(f, "field {field} has an impossible value"),
        }
    }
}

impl std::error::Error for WireError {}

/// How the sender's timestamps became CLOCK_MONOTONIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ClockSource {
    /// CUPTI called our timestamp callback, which returns CLOCK_MONOTONIC ns.
    Callback = 1,
    /// CUPTI's own clock (CLOCK_REALTIME) shifted by a measured offset
    /// (CUPTI 12.6u2–13.0, where the callback zeroes kernel timestamps).
    Calibrated = 2,
}

impl TryFrom<u8> for ClockSource {
    type Error = WireError;
    fn try_from(v: u8) -> Result<Self, WireError> {
        match v {
            1 => Ok(ClockSource::Callback),
            2 => Ok(ClockSource::Calibrated),
            v => Err(WireError::BadEnum { field: "clock", value: v as u32 }),
        }
    }
}

/// Which CUDA API an [`Api`] record comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ApiDomain {
    Runtime = 1,
    Driver = 2,
}

impl TryFrom<u8> for ApiDomain {
    type Error = WireError;
    fn try_from(v: u8) -> Result<Self, WireError> {
        match v {
            1 => Ok(ApiDomain::Runtime),
            2 => Ok(ApiDomain::Driver),
            v => Err(WireError::BadEnum { field: "api domain", value: v as u32 }),
        }
    }
}

/// What an [`Api`] call does (only these are traced).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ApiClass {
    KernelLaunch = 1,
    GraphLaunch = 2,
    Memcpy = 3,
    Memset = 4,
    Sync = 5,
}

impl TryFrom<u8> for ApiClass {
    type Error = WireError;
    fn try_from(v: u8) -> Result<Self, WireError> {
        match v {
            1 => Ok(ApiClass::KernelLaunch),
            2 => Ok(ApiClass::GraphLaunch),
            3 => Ok(ApiClass::Memcpy),
            4 => Ok(ApiClass::Memset),
            5 => Ok(ApiClass::Sync),
            v => Err(WireError::BadEnum { field: "api class", value: v as u32 }),
        }
    }
}

/// Bits of [`Hello::enabled`]: which record kinds the sender enabled.
pub mod enabled {
    pub const KERNEL: u32 = 1 << 0;
    pub const MEMCPY: u32 = 1 << 1;
    pub const MEMCPY_PEER: u32 = 1 << 2;
    pub const MEMSET: u32 = 1 << 3;
    pub const SYNC: u32 = 1 << 4;
    pub const API_RUNTIME: u32 = 1 << 5;
    pub const API_DRIVER: u32 = 1 << 6;
    /// CUDA graphs traced per launch (`HOPSCOPE_CUPTI_GRAPHS=launch`): each
    /// launch one [`super::Kernel`] with `graph_node_id` [`super::WHOLE_GRAPH`].
    pub const GRAPH_LAUNCH: u32 = 1 << 7;
}

/// The `graph_node_id` of a [`Kernel`] that stands for a whole CUDA graph's
/// launch (CUPTI's GRAPH_TRACE record: first node's start to last node's end,
/// named [`whole_graph_name`]), sent in place of its nodes' kernels.
pub const WHOLE_GRAPH: u64 = u64::MAX;

/// The kernel name of a [`WHOLE_GRAPH`] launch: `[CUDA graph <id>]`.
pub fn whole_graph_name(graph_id: u32) -> String {
    format!("[CUDA graph {graph_id}]")
}

/// `name` is one [`whole_graph_name`] made (any id), or the id-less
/// `[CUDA graph]` that stands for them all.
pub fn is_whole_graph_name(name: &str) -> bool {
    name.strip_prefix("[CUDA graph").and_then(|r| r.strip_suffix(']')).is_some_and(|id| id.trim().bytes().all(|b| b.is_ascii_digit()))
}

/// First frame of every connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub pid: u32,
    pub ppid: u32,
    /// `cuptiGetVersion` (12.4=22 … 12.9=28, 13.0=130001, 13.4=130401).
    pub cupti_version: u32,
    pub clock: ClockSource,
    /// Bits from [`enabled`].
    pub enabled: u32,
    /// CLOCK_MONOTONIC when the injection library initialised.
    pub init_mono_ns: u64,
    /// Record struct sizes the sender validated against (kernel, memcpy,
    /// memcpy peer, memset, sync, api), for diagnostics.
    pub struct_sizes: [u16; 6],
    /// Which libcupti was used (path, or soname when reused from the host).
    pub cupti_lib: String,
    /// The process's executable name (comm).
    pub comm: String,
}

/// One CUDA device, as the driver reported it. Sent after the hello once known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    pub ordinal: u32,
    pub cc_major: u32,
    pub cc_minor: u32,
    pub sm_count: u32,
    pub total_mem_bytes: u64,
    /// `cuDriverGetVersion` (e.g. 13000).
    pub driver_version: u32,
    pub name: String,
}

/// Defines a name id for this connection (ids start at 1; 0 means "no name").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Name {
    pub id: u32,
    pub name: String,
}

/// A kernel execution (CUPTI CONCURRENT_KERNEL record; also each kernel node
/// of a CUDA graph launch, with its graph ids).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernel {
    pub start_ns: u64,
    pub end_ns: u64,
    pub device_id: u32,
    pub context_id: u32,
    pub stream_id: u32,
    /// Links to the launching [`Api`] record (or the graph launch's).
    pub correlation_id: u32,
    pub grid_id: i64,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub static_shared_mem: u32,
    pub dynamic_shared_mem: u32,
    pub registers_per_thread: u16,
    /// CUPTI launch type (0 regular, 1 cooperative single, 2 cooperative multi, …).
    pub launch_type: u8,
    /// [`Name`] id of the (mangled) kernel name; 0 when CUPTI gave none.
    pub name_id: u32,
    /// Nonzero when the kernel ran as a node of a CUDA graph.
    pub graph_id: u32,
    pub graph_node_id: u64,
}

/// The peer part of a peer-to-peer copy (CUPTI MEMCPY2 record).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer {
    pub src_device_id: u32,
    pub src_context_id: u32,
    pub dst_device_id: u32,
    pub dst_context_id: u32,
}

/// A memory copy (CUPTI MEMCPY, or MEMCPY2 with `peer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Memcpy {
    pub start_ns: u64,
    pub end_ns: u64,
    pub bytes: u64,
    /// CUpti_ActivityMemcpyKind (1 HtoD, 2 DtoH, …, 8 DtoD, 10 PtoP); raw.
    pub copy_kind: u8,
    /// CUpti_ActivityMemoryKind of source and destination (3 pinned, 2 pageable, 4 device, …); raw.
    pub src_kind: u8,
    pub dst_kind: u8,
    /// CUpti_ActivityFlag bits (bit 0: async); raw.
    pub flags: u8,
    pub device_id: u32,
    pub context_id: u32,
    pub stream_id: u32,
    pub correlation_id: u32,
    /// Runtime correlation id (0 when not recorded; always 0 for peer copies).
    pub runtime_correlation_id: u32,
    pub graph_id: u32,
    pub graph_node_id: u64,
    pub peer: Option<Peer>,
}

/// A memset (CUPTI MEMSET record).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Memset {
    pub start_ns: u64,
    pub end_ns: u64,
    pub bytes: u64,
    pub value: u32,
    pub device_id: u32,
    pub context_id: u32,
    pub stream_id: u32,
    pub correlation_id: u32,
    pub flags: u16,
    pub memory_kind: u16,
    pub graph_id: u32,
    pub graph_node_id: u64,
}

/// A synchronization the host waited on (CUPTI SYNCHRONIZATION record).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sync {
    pub start_ns: u64,
    pub end_ns: u64,
    /// CUpti_ActivitySynchronizationType (1 event sync, 2 stream wait event,
    /// 3 stream sync, 4 context sync); raw.
    pub sync_type: u32,
    pub context_id: u32,
    /// u32::MAX when not applicable.
    pub stream_id: u32,
    pub correlation_id: u32,
    /// u32::MAX when not applicable.
    pub cuda_event_id: u32,
}

/// A host-side CUDA API call (launch, graph launch, copy, memset, sync).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Api {
    pub start_ns: u64,
    pub end_ns: u64,
    pub domain: ApiDomain,
    pub class: ApiClass,
    /// CUPTI callback id in `domain` (cupti_runtime_cbid.h / cupti_driver_cbid.h).
    pub cbid: u32,
    /// [`Name`] id of the API function's name.
    pub name_id: u32,
    pub process_id: u32,
    pub thread_id: u32,
    pub correlation_id: u32,
    pub return_value: u32,
}

/// Cumulative counters of one process (raw ids, so a newer sender's extra
/// counters reach an older agent as numbers; see [`Counter`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Counters {
    pub values: Vec<(u16, u64)>,
}

impl Counters {
    pub fn get(&self, c: Counter) -> Option<u64> {
        self.values.iter().find(|(id, _)| *id == c as u16).map(|(_, v)| *v)
    }
}

/// The counters a sender reports. All are cumulative since the process
/// initialised. `RecordsDecoded = RecordsSent + DroppedQueueFull +
/// DroppedNoAgent + DroppedSendError` once the sender is drained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Counter {
    /// Valid records turned into frames.
    RecordsDecoded = 1,
    /// Records written to the socket in full.
    RecordsSent = 2,
    /// Dropped because the bounded send queue was full (agent slow or stopped).
    DroppedQueueFull = 3,
    /// Dropped because no agent was connected.
    DroppedNoAgent = 4,
    /// Dropped because the connection broke while their batch was written.
    DroppedSendError = 5,
    /// CUPTI's own drops (`cuptiActivityGetNumDroppedRecords`).
    CuptiDropped = 6,
    /// Buffer requests refused because the bounded buffer pool was empty.
    BufferPoolExhausted = 7,
    /// Records dropped for a zero start or end timestamp.
    BadTimestampZero = 8,
    /// Records dropped for end < start.
    BadTimestampReversed = 9,
    /// Records dropped for timestamps after "now" (plus a margin).
    BadTimestampFuture = 10,
    /// Records dropped for timestamps before the library initialised (minus a margin).
    BadTimestampPast = 11,
    /// Records dropped because they did not fit the buffer or the struct size.
    BadRecordSize = 12,
    /// Records of kinds that were not requested (skipped).
    UnknownKind = 13,
    /// Names cut to [`MAX_STR`] bytes.
    NameTruncated = 14,
    /// Successful connections to the agent.
    Connects = 15,
    /// Panics caught in callbacks (the host never sees them).
    CallbackPanics = 16,
    /// CUPTI errors returned while walking buffers.
    CuptiErrors = 17,
}

impl Counter {
    pub const ALL: [Counter; 17] = [
        Counter::RecordsDecoded,
        Counter::RecordsSent,
        Counter::DroppedQueueFull,
        Counter::DroppedNoAgent,
        Counter::DroppedSendError,
        Counter::CuptiDropped,
        Counter::BufferPoolExhausted,
        Counter::BadTimestampZero,
        Counter::BadTimestampReversed,
        Counter::BadTimestampFuture,
        Counter::BadTimestampPast,
        Counter::BadRecordSize,
        Counter::UnknownKind,
        Counter::NameTruncated,
        Counter::Connects,
        Counter::CallbackPanics,
        Counter::CuptiErrors,
    ];

    /// Stable snake_case name for reports.
    pub fn name(self) -> &'static str {
        match self {
            Counter::RecordsDecoded => "records_decoded",
            Counter::RecordsSent => "records_sent",
            Counter::DroppedQueueFull => "dropped_queue_full",
            Counter::DroppedNoAgent => "dropped_no_agent",
            Counter::DroppedSendError => "dropped_send_error",
            Counter::CuptiDropped => "cupti_dropped",
            Counter::BufferPoolExhausted => "buffer_pool_exhausted",
            Counter::BadTimestampZero => "bad_timestamp_zero",
            Counter::BadTimestampReversed => "bad_timestamp_reversed",
            Counter::BadTimestampFuture => "bad_timestamp_future",
            Counter::BadTimestampPast => "bad_timestamp_past",
            Counter::BadRecordSize => "bad_record_size",
            Counter::UnknownKind => "unknown_kind",
            Counter::NameTruncated => "name_truncated",
            Counter::Connects => "connects",
            Counter::CallbackPanics => "callback_panics",
            Counter::CuptiErrors => "cupti_errors",
        }
    }
}

impl TryFrom<u16> for Counter {
    type Error = WireError;
    fn try_from(v: u16) -> Result<Self, WireError> {
        Counter::ALL.iter().copied().find(|c| *c as u16 == v).ok_or(WireError::BadEnum { field: "counter", value: v as u32 })
    }
}

/// The offset the sender applies in [`ClockSource::Calibrated`] mode:
/// `monotonic = cupti + offset_ns`, known to within `error_ns`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Calibration {
    pub offset_ns: i64,
    pub error_ns: u64,
    pub at_mono_ns: u64,
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    Hello(Hello),
    Device(Device),
    Name(Name),
    Kernel(Kernel),
    Memcpy(Memcpy),
    Memset(Memset),
    Sync(Sync),
    Api(Api),
    Counters(Counters),
    Calibration(Calibration),
    /// The sender is exiting; the counters before it are final.
    Goodbye,
}

// ---------------------------------------------------------------- encoding

struct W<'a> {
    out: &'a mut Vec<u8>,
}

impl W<'_> {
    fn u8(&mut self, v: u8) {
        self.out.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    fn i64(&mut self, v: i64) {
        self.out.extend_from_slice(&v.to_le_bytes());
    }
    /// Strings longer than [`MAX_STR`] are cut at a char boundary.
    fn str(&mut self, s: &str) {
        let s = truncate_str(s, MAX_STR);
        self.u16(s.len() as u16);
        self.out.extend_from_slice(s.as_bytes());
    }
}

/// `s` cut to at most `max` bytes on a char boundary.
pub fn truncate_str(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

impl Message {
    pub fn tag(&self) -> u8 {
        match self {
            Message::Hello(_) => tag::HELLO,
            Message::Device(_) => tag::DEVICE,
            Message::Name(_) => tag::NAME,
            Message::Kernel(_) => tag::KERNEL,
            Message::Memcpy(_) => tag::MEMCPY,
            Message::Memset(_) => tag::MEMSET,
            Message::Sync(_) => tag::SYNC,
            Message::Api(_) => tag::API,
            Message::Counters(_) => tag::COUNTERS,
            Message::Calibration(_) => tag::CALIBRATION,
            Message::Goodbye => tag::GOODBYE,
        }
    }

    /// Appends this message as one frame to `out`. Counters beyond
    /// [`MAX_COUNTERS`] are not written.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let at = out.len();
        out.extend_from_slice(&[0, 0, 0, 0]);
        out.push(self.tag());
        let mut w = W { out };
        match self {
            Message::Hello(h) => {
                w.out.extend_from_slice(&MAGIC);
                w.u16(WIRE_VERSION);
                w.u32(h.pid);
                w.u32(h.ppid);
                w.u32(h.cupti_version);
                w.u8(h.clock as u8);
                w.u32(h.enabled);
                w.u64(h.init_mono_ns);
                for s in h.struct_sizes {
                    w.u16(s);
                }
                w.str(&h.cupti_lib);
                w.str(&h.comm);
            }
            Message::Device(d) => {
                w.u32(d.ordinal);
                w.u32(d.cc_major);
                w.u32(d.cc_minor);
                w.u32(d.sm_count);
                w.u64(d.total_mem_bytes);
                w.u32(d.driver_version);
                w.str(&d.name);
            }
            Message::Name(n) => {
                w.u32(n.id);
                w.str(&n.name);
            }
            Message::Kernel(k) => {
                w.u64(k.start_ns);
                w.u64(k.end_ns);
                w.u32(k.device_id);
                w.u32(k.context_id);
                w.u32(k.stream_id);
                w.u32(k.correlation_id);
                w.i64(k.grid_id);
                for g in k.grid {
                    w.u32(g);
                }
                for b in k.block {
                    w.u32(b);
                }
                w.u32(k.static_shared_mem);
                w.u32(k.dynamic_shared_mem);
                w.u16(k.registers_per_thread);
                w.u8(k.launch_type);
                w.u32(k.name_id);
                w.u32(k.graph_id);
                w.u64(k.graph_node_id);
            }
            Message::Memcpy(m) => {
                w.u64(m.start_ns);
                w.u64(m.end_ns);
                w.u64(m.bytes);
                w.u8(m.copy_kind);
                w.u8(m.src_kind);
                w.u8(m.dst_kind);
                w.u8(m.flags);
                w.u32(m.device_id);
                w.u32(m.context_id);
                w.u32(m.stream_id);
                w.u32(m.correlation_id);
                w.u32(m.runtime_correlation_id);
                w.u32(m.graph_id);
                w.u64(m.graph_node_id);
                match m.peer {
                    None => w.u8(0),
                    Some(p) => {
                        w.u8(1);
                        w.u32(p.src_device_id);
                        w.u32(p.src_context_id);
                        w.u32(p.dst_device_id);
                        w.u32(p.dst_context_id);
                    }
                }
            }
            Message::Memset(m) => {
                w.u64(m.start_ns);
                w.u64(m.end_ns);
                w.u64(m.bytes);
                w.u32(m.value);
                w.u32(m.device_id);
                w.u32(m.context_id);
                w.u32(m.stream_id);
                w.u32(m.correlation_id);
                w.u16(m.flags);
                w.u16(m.memory_kind);
                w.u32(m.graph_id);
                w.u64(m.graph_node_id);
            }
            Message::Sync(s) => {
                w.u64(s.start_ns);
                w.u64(s.end_ns);
                w.u32(s.sync_type);
                w.u32(s.context_id);
                w.u32(s.stream_id);
                w.u32(s.correlation_id);
                w.u32(s.cuda_event_id);
            }
            Message::Api(a) => {
                w.u64(a.start_ns);
                w.u64(a.end_ns);
                w.u8(a.domain as u8);
                w.u8(a.class as u8);
                w.u32(a.cbid);
                w.u32(a.name_id);
                w.u32(a.process_id);
                w.u32(a.thread_id);
                w.u32(a.correlation_id);
                w.u32(a.return_value);
            }
            Message::Counters(c) => {
                let n = c.values.len().min(MAX_COUNTERS);
                w.u16(n as u16);
                for (id, v) in &c.values[..n] {
                    w.u16(*id);
                    w.u64(*v);
                }
            }
            Message::Calibration(c) => {
                w.i64(c.offset_ns);
                w.u64(c.error_ns);
                w.u64(c.at_mono_ns);
            }
            Message::Goodbye => {}
        }
        let len = (out.len() - at - 4) as u32;
        out[at..at + 4].copy_from_slice(&len.to_le_bytes());
    }

    /// This message as one frame.
    pub fn to_frame(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(64);
        self.encode(&mut v);
        v
    }
}

// ---------------------------------------------------------------- decoding

struct R<'a> {
    b: &'a [u8],
    tag: u8,
}

impl<'a> R<'a> {
    fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], WireError> {
        if self.b.len() < n {
            return Err(WireError::Truncated { tag: self.tag, field });
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn arr<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], WireError> {
        let s = self.take(N, field)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    fn u8(&mut self, field: &'static str) -> Result<u8, WireError> {
        Ok(self.arr::<1>(field)?[0])
    }
    fn u16(&mut self, field: &'static str) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.arr(field)?))
    }
    fn u32(&mut self, field: &'static str) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.arr(field)?))
    }
    fn u64(&mut self, field: &'static str) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.arr(field)?))
    }
    fn i64(&mut self, field: &'static str) -> Result<i64, WireError> {
        Ok(i64::from_le_bytes(self.arr(field)?))
    }
    fn str(&mut self, field: &'static str) -> Result<String, WireError> {
        let n = self.u16(field)? as usize;
        let s = self.take(n, field)?;
        std::str::from_utf8(s).map(str::to_owned).map_err(|_| WireError::BadUtf8 { field })
    }
    fn end(self) -> Result<(), WireError> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(WireError::TrailingBytes { tag: self.tag, extra: self.b.len() })
        }
    }
}

fn span(tag: u8, start_ns: u64, end_ns: u64) -> Result<(), WireError> {
    if start_ns == 0 || end_ns < start_ns {
        return Err(WireError::BadTimestamps { tag, start_ns, end_ns });
    }
    Ok(())
}

impl Message {
    /// Decodes a frame body: `tag` and its payload (no length prefix).
    pub fn decode_body(tag: u8, payload: &[u8]) -> Result<Message, WireError> {
        let mut r = R { b: payload, tag };
        let m = match tag {
            tag::HELLO => {
                if r.arr::<4>("magic")? != MAGIC {
                    return Err(WireError::BadMagic);
                }
                let v = r.u16("wire_version")?;
                if v != WIRE_VERSION {
                    return Err(WireError::UnsupportedVersion(v));
                }
                let pid = r.u32("pid")?;
                let ppid = r.u32("ppid")?;
                let cupti_version = r.u32("cupti_version")?;
                let clock = ClockSource::try_from(r.u8("clock")?)?;
                let enabled = r.u32("enabled")?;
                let init_mono_ns = r.u64("init_mono_ns")?;
                let mut struct_sizes = [0u16; 6];
                for s in &mut struct_sizes {
                    *s = r.u16("struct_sizes")?;
                }
                let cupti_lib = r.str("cupti_lib")?;
                let comm = r.str("comm")?;
                if pid == 0 {
                    return Err(WireError::Invalid { field: "pid" });
                }
                Message::Hello(Hello { pid, ppid, cupti_version, clock, enabled, init_mono_ns, struct_sizes, cupti_lib, comm })
            }
            tag::DEVICE => Message::Device(Device {
                ordinal: r.u32("ordinal")?,
                cc_major: r.u32("cc_major")?,
                cc_minor: r.u32("cc_minor")?,
                sm_count: r.u32("sm_count")?,
                total_mem_bytes: r.u64("total_mem_bytes")?,
                driver_version: r.u32("driver_version")?,
                name: r.str("name")?,
            }),
            tag::NAME => {
                let id = r.u32("id")?;
                let name = r.str("name")?;
                if id == 0 {
                    return Err(WireError::Invalid { field: "name id" });
                }
                Message::Name(Name { id, name })
            }
            tag::KERNEL => {
                let k = Kernel {
                    start_ns: r.u64("start_ns")?,
                    end_ns: r.u64("end_ns")?,
                    device_id: r.u32("device_id")?,
                    context_id: r.u32("context_id")?,
                    stream_id: r.u32("stream_id")?,
                    correlation_id: r.u32("correlation_id")?,
                    grid_id: r.i64("grid_id")?,
                    grid: [r.u32("grid")?, r.u32("grid")?, r.u32("grid")?],
                    block: [r.u32("block")?, r.u32("block")?, r.u32("block")?],
                    static_shared_mem: r.u32("static_shared_mem")?,
                    dynamic_shared_mem: r.u32("dynamic_shared_mem")?,
                    registers_per_thread: r.u16("registers_per_thread")?,
                    launch_type: r.u8("launch_type")?,
                    name_id: r.u32("name_id")?,
                    graph_id: r.u32("graph_id")?,
                    graph_node_id: r.u64("graph_node_id")?,
                };
                span(tag, k.start_ns, k.end_ns)?;
                Message::Kernel(k)
            }
            tag::MEMCPY => {
                let mut m = Memcpy {
                    start_ns: r.u64("start_ns")?,
                    end_ns: r.u64("end_ns")?,
                    bytes: r.u64("bytes")?,
                    copy_kind: r.u8("copy_kind")?,
                    src_kind: r.u8("src_kind")?,
                    dst_kind: r.u8("dst_kind")?,
                    flags: r.u8("flags")?,
                    device_id: r.u32("device_id")?,
                    context_id: r.u32("context_id")?,
                    stream_id: r.u32("stream_id")?,
                    correlation_id: r.u32("correlation_id")?,
                    runtime_correlation_id: r.u32("runtime_correlation_id")?,
                    graph_id: r.u32("graph_id")?,
                    graph_node_id: r.u64("graph_node_id")?,
                    peer: None,
                };
                m.peer = match r.u8("peer")? {
                    0 => None,
                    1 => Some(Peer {
                        src_device_id: r.u32("src_device_id")?,
                        src_context_id: r.u32("src_context_id")?,
                        dst_device_id: r.u32("dst_device_id")?,
                        dst_context_id: r.u32("dst_context_id")?,
                    }),
                    v => return Err(WireError::BadEnum { field: "peer", value: v as u32 }),
                };
                span(tag, m.start_ns, m.end_ns)?;
                Message::Memcpy(m)
            }
            tag::MEMSET => {
                let m = Memset {
                    start_ns: r.u64("start_ns")?,
                    end_ns: r.u64("end_ns")?,
                    bytes: r.u64("bytes")?,
                    value: r.u32("value")?,
                    device_id: r.u32("device_id")?,
                    context_id: r.u32("context_id")?,
                    stream_id: r.u32("stream_id")?,
                    correlation_id: r.u32("correlation_id")?,
                    flags: r.u16("flags")?,
                    memory_kind: r.u16("memory_kind")?,
                    graph_id: r.u32("graph_id")?,
                    graph_node_id: r.u64("graph_node_id")?,
                };
                span(tag, m.start_ns, m.end_ns)?;
                Message::Memset(m)
            }
            tag::SYNC => {
                let s = Sync {
                    start_ns: r.u64("start_ns")?,
                    end_ns: r.u64("end_ns")?,
                    sync_type: r.u32("sync_type")?,
                    context_id: r.u32("context_id")?,
                    stream_id: r.u32("stream_id")?,
                    correlation_id: r.u32("correlation_id")?,
                    cuda_event_id: r.u32("cuda_event_id")?,
                };
                span(tag, s.start_ns, s.end_ns)?;
                Message::Sync(s)
            }
            tag::API => {
                let a = Api {
                    start_ns: r.u64("start_ns")?,
                    end_ns: r.u64("end_ns")?,
                    domain: ApiDomain::try_from(r.u8("domain")?)?,
                    class: ApiClass::try_from(r.u8("class")?)?,
                    cbid: r.u32("cbid")?,
                    name_id: r.u32("name_id")?,
                    process_id: r.u32("process_id")?,
                    thread_id: r.u32("thread_id")?,
                    correlation_id: r.u32("correlation_id")?,
                    return_value: r.u32("return_value")?,
                };
                span(tag, a.start_ns, a.end_ns)?;
                Message::Api(a)
            }
            tag::COUNTERS => {
                let n = r.u16("count")? as usize;
                if n > MAX_COUNTERS {
                    return Err(WireError::TooManyCounters(n));
                }
                let mut values = Vec::with_capacity(n);
                for _ in 0..n {
                    values.push((r.u16("counter id")?, r.u64("counter value")?));
                }
                Message::Counters(Counters { values })
            }
            tag::CALIBRATION => Message::Calibration(Calibration {
                offset_ns: r.i64("offset_ns")?,
                error_ns: r.u64("error_ns")?,
                at_mono_ns: r.u64("at_mono_ns")?,
            }),
            tag::GOODBYE => Message::Goodbye,
            t => return Err(WireError::UnknownTag(t)),
        };
        r.end()?;
        Ok(m)
    }
}

/// Reads a frame header: `Ok(Some(body_len))` when `buf` holds at least the
/// 4-byte length and it is valid, `Ok(None)` when fewer than 4 bytes.
fn header(buf: &[u8]) -> Result<Option<usize>, WireError> {
    let Some(h) = buf.get(..4) else { return Ok(None) };
    let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
    if len < 1 {
        return Err(WireError::FrameTooShort { len });
    }
    if len > MAX_FRAME {
        return Err(WireError::FrameTooLarge { len });
    }
    Ok(Some(len))
}

/// Exactly one frame (length prefix included), nothing more.
impl TryFrom<&[u8]> for Message {
    type Error = WireError;
    fn try_from(buf: &[u8]) -> Result<Message, WireError> {
        let len = header(buf)?.ok_or(WireError::Incomplete { need: 4, have: buf.len() })?;
        let need = 4 + len;
        if buf.len() < need {
            return Err(WireError::Incomplete { need, have: buf.len() });
        }
        if buf.len() > need {
            return Err(WireError::TrailingBytes { tag: buf[4], extra: buf.len() - need });
        }
        Message::decode_body(buf[4], &buf[5..need])
    }
}

/// A frame split off a byte stream: tag, payload, bytes used (header included).
pub type RawFrame<'a> = (u8, &'a [u8], usize);

/// Splits the first complete frame off `buf`: `Ok(Some((tag, payload, used)))`,
/// `Ok(None)` when more bytes are needed.
pub fn split_frame(buf: &[u8]) -> Result<Option<RawFrame<'_>>, WireError> {
    let Some(len) = header(buf)? else { return Ok(None) };
    if buf.len() < 4 + len {
        return Ok(None);
    }
    Ok(Some((buf[4], &buf[5..4 + len], 4 + len)))
}

/// Incremental decoder for a byte stream (one per connection).
///
/// ```
/// use hopscope_gpu_wire::{FrameDecoder, Message};
/// let mut d = FrameDecoder::default();
/// let frame = Message::Goodbye.to_frame();
/// d.push(&frame[..2]);
/// assert!(d.next_message().is_none());
/// d.push(&frame[2..]);
/// assert_eq!(d.next_message(), Some(Ok(Message::Goodbye)));
/// ```
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    pos: usize,
    fatal: Option<WireError>,
}

impl FrameDecoder {
    pub fn push(&mut self, bytes: &[u8]) {
        if self.pos > 0 && self.pos == self.buf.len() {
            self.buf.clear();
            self.pos = 0;
        } else if self.pos > (1 << 16) && self.pos * 2 > self.buf.len() {
            self.buf.drain(..self.pos);
            self.pos = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// The next frame: `None` when more bytes are needed; `Some(Err)` for a
    /// bad frame (skipped unless [`WireError::is_fatal`], after which every
    /// call returns the same fatal error).
    pub fn next_message(&mut self) -> Option<Result<Message, WireError>> {
        if let Some(e) = &self.fatal {
            return Some(Err(e.clone()));
        }
        match split_frame(&self.buf[self.pos..]) {
            Ok(None) => None,
            Ok(Some((tag, payload, used))) => {
                let m = Message::decode_body(tag, payload);
                self.pos += used;
                Some(m)
            }
            Err(e) => {
                self.fatal = Some(e.clone());
                Some(Err(e))
            }
        }
    }

    /// Bytes received but not yet consumed (a torn frame at EOF is loss).
    pub fn pending(&self) -> usize {
        self.buf.len() - self.pos
    }
}
