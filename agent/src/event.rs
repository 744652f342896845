//! Validated kernel events: what `source::ebpf` makes of the ring-buffer bytes.
//!
//! These mirror `agent-ebpf/src/hopscope.h` semantically; the byte-level decoding
//! (lengths and tags checked before anything is trusted) lives in
//! `source::ebpf::decode`. Payload bytes are owned here and never leave the agent
//! unless the user asked for `--capture-payload`.

/// Which syscall moved the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Syscall {
    Read,
    Readv,
    Recvfrom,
    Recvmsg,
    Write,
    Writev,
    Sendto,
    Sendmsg,
}

/// Direction seen from the traced process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Dir {
    /// The traced process received the bytes (read, recv…).
    In,
    /// The traced process sent the bytes (write, send…).
    Out,
}

/// Socket address family, as far as the kernel told us.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Family {
    Unix,
    Inet,
    Inet6,
    Unknown,
}

/// Identity of one connection inside one process. The socket inode tells apart
/// two connections that reused the same fd number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct ConnKey {
    pub tgid: u32,
    pub fd: i32,
    pub ino: u64,
}

/// Data moved on a socket by one syscall.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IoEvent {
    /// Syscall exit time (CLOCK_MONOTONIC ns).
    pub ts_ns: u64,
    pub enter_ns: u64,
    /// Dir::In: when the oldest data this call read became readable on the
    /// socket (the wire arrival, before any event-loop delay). Dir::Out: when
    /// the call first handed a packet of the socket to a device (the wire
    /// departure, before the syscall's own tail). None if unseen.
    pub wire_ns: Option<u64>,
    pub tid: u32,
    pub conn: ConnKey,
    pub syscall: Syscall,
    pub dir: Dir,
    pub family: Family,
    /// Bytes the syscall moved (its return value, > 0 for events that reach the decoders).
    pub len: u64,
    /// The captured prefix: `data.len() <= len`. When shorter, the rest is a
    /// gap, then `tail`.
    pub data: Vec<u8>,
    /// The transfer's last bytes when they were captured apart from the
    /// prefix (unix sockets: `hs_io.tail_len`); empty otherwise.
    pub tail: Vec<u8>,
    /// The kernel could not read the user buffer at all.
    pub copy_failed: bool,
    /// Unix-socket writes: the wake-up that ended the calling thread's latest
    /// sleep and its switch-in after it, however short the sleep
    /// (`Record::OffCpu` keeps only the long ones).
    pub burst: Burst,
}

/// What the kernel said about the sleep a unix-socket write came after
/// (`hs_io.burst_wake_ns`, `burst_on_ns`), checked at decode: stamps out of
/// order are kept apart so the wire decoder can count them, never trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Burst {
    /// Not a unix-socket write, or its thread has not slept since the probes attached.
    NoSleep,
    /// The thread's latest sleep ended (it was switched in again) but the
    /// wake-up before it was not seen.
    WakeUnseen,
    /// Woken at `wake_ns`, on its CPU again at `on_ns`; both before the write.
    Woken { wake_ns: u64, on_ns: u64 },
    /// Stamps out of order: woken after its switch-in, or switched in after the write.
    Implausible,
}

impl IoEvent {
    /// Bytes moved that were not captured, between `data` and `tail` (the
    /// decoder must skip them).
    pub fn gap(&self) -> u64 {
        self.len.saturating_sub(self.data.len() as u64 + self.tail.len() as u64)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ConnOp {
    Accept,
    Connect,
}

/// accept/connect returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnEvent {
    pub ts_ns: u64,
    pub enter_ns: u64,
    pub tid: u32,
    pub conn: ConnKey,
    pub op: ConnOp,
    pub family: Family,
    /// Syscall return value (new fd for accept, 0 for connect, or -errno).
    pub ret: i64,
    pub local: Option<std::net::SocketAddr>,
    pub peer: Option<std::net::SocketAddr>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloseEvent {
    pub ts_ns: u64,
    pub tid: u32,
    pub conn: ConnKey,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ProcOp {
    Fork,
    Exec,
    Exit,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcEvent {
    pub ts_ns: u64,
    pub tgid: u32,
    pub tid: u32,
    pub op: ProcOp,
    pub child_tgid: u32,
    pub exit_code: i32,
    pub comm: String,
}

/// One off-CPU interval of a traced thread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedEvent {
    /// Switch-in time.
    pub ts_ns: u64,
    pub tgid: u32,
    pub tid: u32,
    pub off_ns: u64,
    /// Wake-up time, if seen: run-queue delay = ts_ns - wake_ns.
    pub wake_ns: Option<u64>,
    pub prev_state: u32,
    pub cpu: u32,
}

/// Any validated kernel event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KEvent {
    Io(IoEvent),
    Conn(ConnEvent),
    Close(CloseEvent),
    Proc(ProcEvent),
    Sched(SchedEvent),
}

impl KEvent {
    pub fn ts_ns(&self) -> u64 {
        match self {
            KEvent::Io(e) => e.ts_ns,
            KEvent::Conn(e) => e.ts_ns,
            KEvent::Close(e) => e.ts_ns,
            KEvent::Proc(e) => e.ts_ns,
            KEvent::Sched(e) => e.ts_ns,
        }
    }
}
