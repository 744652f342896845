//! GPU source: receives what the CUPTI injection library (`agent-cupti`,
//! `libhopscope_cupti.so`, loaded into every CUDA process of the server through
//! `CUDA_INJECTION64_PATH`) streams over a unix socket, in the
//! `hopscope-gpu-wire` format, and turns it into validated GPU [`Record`]s.
//!
//! ```text
//!  server process (engine, TP worker…) ── connection ──▶ one thread each ──┐ bounded
//!  server process …                    ── connection ──▶ one thread each ──┼─ channel ─▶ GpuReceiver::drain
//!  (SO_PEERCRED checked at accept; frames validated; names resolved)       ┘
//! ```
//!
//! - The socket lives in a private directory (0700, created exclusively
//!   under `$TMPDIR`, else `/run` for root, else `/tmp`); the socket is 0600.
//! - Every connection's peer is checked with SO_PEERCRED: its pid (or an
//!   ancestor) must be in the traced tree ([`GpuReceiver::set_traced`], fed
//!   from the eBPF source's targets), or its uid must be one of the trusted
//!   uids; otherwise it is closed unread and counted (`gpu_conns_rejected`).
//! - One thread per connection. It never makes a server wait: the injection
//!   side never blocks on the socket (it drops and counts instead), so when
//!   the agent falls behind, a full channel only slows this thread's reads.
//! - The first frame must be the hello; a bad frame is counted
//!   (`gpu_frames_invalid`) and skipped, a desynchronised stream (bad length)
//!   or a missing hello ends the connection (`gpu_conns_broken`).
//! - Names are interned per connection by the sender; they are resolved here,
//!   so records carry the name itself.
//! - The sender's own counters (cumulative per process, the last report
//!   wins; summed over processes) are forwarded as `gpu_<counter>`
//!   (`gpu_cupti_dropped`, `gpu_dropped_queue_full`, `gpu_bad_timestamp_zero`, …).
//!
//! Record pids are the peer's pid as SO_PEERCRED reports it, i.e. in the
//! agent's pid namespace, like the eBPF tgids; the pid the process reported
//! itself is kept in [`Record::GpuProcess`]. Timestamps are CLOCK_MONOTONIC
//! nanoseconds as sent: the injection library converts them (timestamp
//! callback, or a calibrated offset announced in `Calibration` frames, which
//! are recorded as [`Record::GpuCalibration`]).

use crate::model::{GpuPeer, Record};
use crate::sys;
use hopscope_gpu_wire as wire;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Environment variable naming the agent's socket (read by the injection library).
pub const SOCKET_ENV: &str = "HOPSCOPE_GPU_SOCKET";
/// The CUDA driver loads this library in every process that initialises CUDA.
pub const INJECTION_ENV: &str = "CUDA_INJECTION64_PATH";
/// How the injection library traces CUDA graphs (`node` or `launch`).
pub const GRAPHS_ENV: &str = "HOPSCOPE_CUPTI_GRAPHS";
/// Where to find the injection library when it is not next to `hopscope`.
pub const INJECTION_LIB_ENV: &str = "HOPSCOPE_CUPTI_INJECTION";
/// File name of the injection library.
pub const INJECTION_LIB_NAME: &str = "libhopscope_cupti.so";

/// Longest path a unix socket address holds (sun_path less the NUL).
const MAX_SOCKET_PATH: usize = 107;
/// Timestamps later than the agent's clock by more than this are impossible.
const FUTURE_MARGIN_NS: u64 = 10_000_000_000;
/// Bytes of interned names kept per connection (the sender interns each
/// name once per process; this only bounds a misbehaving peer).
const MAX_NAME_BYTES: usize = 64 << 20;
/// How often a connection thread looks at the stop flag while idle.
const READ_TICK: Duration = Duration::from_millis(100);
/// Rejection notes kept for the caller to print.
const MAX_NOTES: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("cannot create a private gpu socket directory under {parent}: {source}")]
    Dir { parent: PathBuf, source: io::Error },
    #[error("gpu socket path {path} is too long for a unix socket ({len} bytes, at most {MAX_SOCKET_PATH}): set TMPDIR to a shorter directory")]
    PathTooLong { path: PathBuf, len: usize },
    #[error("cannot listen on the gpu socket {path}: {source}")]
    Bind { path: PathBuf, source: io::Error },
    #[error("cannot set the owner or mode of {path}: {source}")]
    Permissions { path: PathBuf, source: io::Error },
    #[error("cannot start the gpu receiver thread: {0}")]
    Thread(io::Error),
}

/// How the receiver is set up.
#[derive(Debug, Clone)]
pub struct GpuConfig {
    /// Parent of the private socket directory (default: `$TMPDIR`, else
    /// `/run` when root, else `/tmp`).
    pub parent: Option<PathBuf>,
    /// Peers with these uids are accepted even outside the traced tree
    /// (`record --pid`: a server started by hand with the env line).
    pub trusted_uids: Vec<u32>,
    /// A uid other than the agent's that must be able to connect (the traced
    /// server's owner when the agent runs as root): the socket is given to
    /// it and the directory made traversable (0711, still not listable).
    pub socket_owner: Option<u32>,
    /// Connections open at once; more are rejected and counted.
    pub max_conns: usize,
    /// Records in flight between the connection threads and the agent.
    pub queue: usize,
    /// A peer outside the traced set waits this long for the set to catch
    /// up (a fresh fork that connects before the agent's next update)
    /// before it is rejected.
    pub admit_grace: Duration,
}

impl Default for GpuConfig {
    fn default() -> Self {
        GpuConfig { parent: None, trusted_uids: Vec::new(), socket_owner: None, max_conns: 256, queue: 1 << 16, admit_grace: Duration::from_millis(500) }
    }
}

/// Counters kept by the agent side (all cumulative).
#[derive(Debug, Default)]
struct Stats {
    /// Connections accepted (peer credentials checked).
    conns: AtomicU64,
    /// Connections refused: peer outside the traced tree with an untrusted
    /// uid, unreadable credentials, too many connections.
    conns_rejected: AtomicU64,
    /// Connections ended by the agent: no hello first, or a desynchronised stream.
    conns_broken: AtomicU64,
    /// Frames that failed validation (skipped, or fatal).
    frames_invalid: AtomicU64,
    /// Connections that ended in the middle of a frame (that frame is lost).
    frames_torn: AtomicU64,
    /// Records with timestamps after the agent's clock (+10 s): dropped.
    records_implausible: AtomicU64,
    /// Records naming an id that was never defined on their connection.
    names_unknown: AtomicU64,
    /// Name definitions not kept (per-connection name memory exhausted).
    names_dropped: AtomicU64,
    /// Records handed to the agent.
    records: AtomicU64,
}

struct Shared {
    stop: AtomicBool,
    traced: RwLock<HashSet<u32>>,
    trusted_uids: Vec<u32>,
    admit_grace: Duration,
    max_conns: usize,
    open: AtomicUsize,
    /// Connection threads still running.
    live: AtomicUsize,
    stats: Stats,
    /// Last cumulative counters of each process (by peer pid).
    sender: Mutex<BTreeMap<u32, BTreeMap<u16, u64>>>,
    notes: Mutex<Vec<String>>,
}

impl Shared {
    fn note(&self, msg: String) {
        let mut n = self.notes.lock().unwrap_or_else(|e| e.into_inner());
        if n.len() < MAX_NOTES {
            n.push(msg);
        }
    }
}

/// The agent's end of the GPU socket. See the module docs.
pub struct GpuReceiver {
    dir: PathBuf,
    path: PathBuf,
    shared: Arc<Shared>,
    rx: Receiver<Record>,
    acceptor: Option<JoinHandle<()>>,
    /// Between [`GpuReceiver::bind_paused`] and [`GpuReceiver::start_accepting`]:
    /// the listener and the queue's sender, waiting for the acceptor thread.
    paused: Option<(UnixListener, mpsc::SyncSender<Record>)>,
    drained: u64,
}

fn default_parent() -> PathBuf {
    if let Some(t) = std::env::var_os("TMPDIR").filter(|t| !t.is_empty()) {
        return PathBuf::from(t);
    }
    if sys::euid() == 0 && Path::new("/run").is_dir() {
        return PathBuf::from("/run");
    }
    PathBuf::from("/tmp")
}

/// Creates `parent/hopscope-gpu-<pid>-<random>` with mode 0700, failing
/// rather than reusing an existing entry (mkdir is atomic: mkdtemp's guarantee).
fn private_dir(parent: &Path) -> Result<PathBuf, GpuError> {
    use std::hash::{BuildHasher, Hasher};
    let mut last = None;
    for attempt in 0..16u64 {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(sys::monotonic_ns() ^ attempt);
        let dir = parent.join(format!("hopscope-gpu-{}-{:08x}", std::process::id(), h.finish() as u32));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {
                // The umask can only have removed bits; state the mode exactly.
                std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
                    .map_err(|source| GpuError::Permissions { path: dir.clone(), source })?;
                return Ok(dir);
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last = Some(e),
            Err(source) => return Err(GpuError::Dir { parent: parent.to_owned(), source }),
        }
    }
    Err(GpuError::Dir { parent: parent.to_owned(), source: last.unwrap_or_else(|| io::Error::other("no free name")) })
}

impl GpuReceiver {
    /// Creates the private directory and socket and starts accepting.
    pub fn bind(cfg: GpuConfig) -> Result<GpuReceiver, GpuError> {
        let mut g = Self::bind_paused(cfg)?;
        g.start_accepting()?;
        Ok(g)
    }

    /// Starts the acceptor thread of a [`GpuReceiver::bind_paused`] receiver
    /// (no-op when it runs). Peers that connected meanwhile wait in the listen
    /// backlog.
    pub fn start_accepting(&mut self) -> Result<(), GpuError> {
        let Some((listener, tx)) = self.paused.take() else { return Ok(()) };
        let sh = Arc::clone(&self.shared);
        let acceptor = std::thread::Builder::new().name("hopscope-gpu".into()).spawn(move || accept_loop(listener, sh, tx)).map_err(GpuError::Thread)?;
        self.acceptor = Some(acceptor);
        Ok(())
    }

    /// Creates the private directory and socket without starting a thread:
    /// `record` binds before it launches the command (whose environment names
    /// the socket) and drops capabilities, which are per thread, before any
    /// thread starts.
    pub fn bind_paused(cfg: GpuConfig) -> Result<GpuReceiver, GpuError> {
        let parent = cfg.parent.clone().unwrap_or_else(default_parent);
        let dir = private_dir(&parent)?;
        let path = dir.join("gpu.sock");
        let cleanup = |e: GpuError| {
            let _ = std::fs::remove_dir_all(&dir);
            e
        };
        let len = path.as_os_str().len();
        if len > MAX_SOCKET_PATH {
            return Err(cleanup(GpuError::PathTooLong { path, len }));
        }
        let listener = UnixListener::bind(&path).map_err(|source| cleanup(GpuError::Bind { path: path.clone(), source }))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
            .map_err(|source| cleanup(GpuError::Permissions { path: path.clone(), source }))?;
        if let Some(uid) = cfg.socket_owner.filter(|u| *u != sys::euid()) {
            std::os::unix::fs::chown(&path, Some(uid), None).map_err(|source| cleanup(GpuError::Permissions { path: path.clone(), source }))?;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711))
                .map_err(|source| cleanup(GpuError::Permissions { path: dir.clone(), source }))?;
        }
        listener.set_nonblocking(true).map_err(|source| cleanup(GpuError::Bind { path: path.clone(), source }))?;
        let shared = Arc::new(Shared {
            stop: AtomicBool::new(false),
            traced: RwLock::new(HashSet::new()),
            trusted_uids: cfg.trusted_uids.clone(),
            admit_grace: cfg.admit_grace,
            max_conns: cfg.max_conns.max(1),
            open: AtomicUsize::new(0),
            live: AtomicUsize::new(0),
            stats: Stats::default(),
            sender: Mutex::new(BTreeMap::new()),
            notes: Mutex::new(Vec::new()),
        });
        let (tx, rx) = mpsc::sync_channel(cfg.queue.max(1));
        Ok(GpuReceiver { dir, path, shared, rx, acceptor: None, paused: Some((listener, tx)), drained: 0 })
    }

    /// The socket to put in [`SOCKET_ENV`].
    pub fn socket_path(&self) -> &Path {
        &self.path
    }

    /// The processes currently traced (the eBPF source's targets): peers
    /// in this set, or below one of them, are accepted.
    pub fn set_traced(&self, pids: impl IntoIterator<Item = u32>) {
        let mut t = self.shared.traced.write().unwrap_or_else(|e| e.into_inner());
        t.clear();
        t.extend(pids);
    }

    /// Hands every record received so far to `f`, without waiting. Returns how many.
    pub fn drain(&mut self, mut f: impl FnMut(Record)) -> usize {
        let mut n = 0;
        while let Ok(r) = self.rx.try_recv() {
            f(r);
            n += 1;
        }
        self.drained += n as u64;
        n
    }

    /// Whether any connection is open now.
    pub fn connected(&self) -> bool {
        self.shared.open.load(Ordering::Acquire) > 0
    }

    /// Records handed out by [`GpuReceiver::drain`] so far.
    pub fn records(&self) -> u64 {
        self.drained
    }

    /// Waits until no connection is open (the injected processes flushed and
    /// exited) or `timeout` passed, handing records to `f` meanwhile. True
    /// when everything ended in time.
    pub fn wait_idle(&mut self, timeout: Duration, mut f: impl FnMut(Record)) -> bool {
        let deadline = Instant::now() + timeout;
        // Idle = no connection thread for a few accept periods in a row (a
        // peer that just connected may still be in the listen backlog).
        let mut idle_since: Option<Instant> = None;
        loop {
            let got = self.drain(&mut f);
            if got == 0 && self.shared.live.load(Ordering::Acquire) == 0 {
                let since = *idle_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= Duration::from_millis(50) {
                    return true;
                }
            } else {
                idle_since = None;
            }
            if Instant::now() >= deadline {
                return false;
            }
            if let Ok(r) = self.rx.recv_timeout(Duration::from_millis(10)) {
                self.drained += 1;
                idle_since = None;
                f(r);
            }
        }
    }

    /// Why connections were rejected (for the user), since the last call.
    pub fn take_notes(&self) -> Vec<String> {
        std::mem::take(&mut *self.shared.notes.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// The agent side's counters and the senders' (summed over processes,
    /// each process's last cumulative report), all prefixed `gpu_`.
    pub fn counters(&self) -> Vec<(String, u64)> {
        let s = &self.shared.stats;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut v = vec![
            ("gpu_conns".to_owned(), get(&s.conns)),
            ("gpu_conns_rejected".to_owned(), get(&s.conns_rejected)),
            ("gpu_conns_broken".to_owned(), get(&s.conns_broken)),
            ("gpu_frames_invalid".to_owned(), get(&s.frames_invalid)),
            ("gpu_frames_torn".to_owned(), get(&s.frames_torn)),
            ("gpu_records".to_owned(), get(&s.records)),
            ("gpu_records_implausible".to_owned(), get(&s.records_implausible)),
            ("gpu_names_unknown".to_owned(), get(&s.names_unknown)),
            ("gpu_names_dropped".to_owned(), get(&s.names_dropped)),
        ];
        let sender = self.shared.sender.lock().unwrap_or_else(|e| e.into_inner());
        let mut sum: BTreeMap<u16, u64> = BTreeMap::new();
        for per in sender.values() {
            for (id, val) in per {
                *sum.entry(*id).or_default() += val;
            }
        }
        for (id, val) in sum {
            let name = match wire::Counter::try_from(id) {
                Ok(c) => format!("gpu_{}", c.name()),
                Err(_) => format!("gpu_counter_{id}"),
            };
            v.push((name, val));
        }
        v
    }

    /// Stops accepting and reading, hands what is still queued to `f`, and
    /// removes the socket and its directory.
    /// Counters and [`GpuReceiver::records`] stay readable afterwards.
    pub fn shutdown(&mut self, mut f: impl FnMut(Record)) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
        // Connection threads notice the flag within a read tick; one blocked
        // on a full channel is freed by draining.
        let deadline = Instant::now() + READ_TICK * 10;
        while self.shared.live.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
            if self.drain(&mut f) == 0 {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        self.drain(&mut f);
    }
}

impl Drop for GpuReceiver {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
        let _ = std::fs::remove_file(&self.path);
        let _ = std::fs::remove_dir(&self.dir);
    }
}

fn accept_loop(listener: UnixListener, shared: Arc<Shared>, tx: SyncSender<Record>) {
    while !shared.stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((stream, _)) => {
                if shared.open.load(Ordering::Acquire) >= shared.max_conns {
                    shared.stats.conns_rejected.fetch_add(1, Ordering::Relaxed);
                    shared.note(format!("rejected a gpu connection: {} already open", shared.max_conns));
                    continue;
                }
                shared.open.fetch_add(1, Ordering::AcqRel);
                shared.live.fetch_add(1, Ordering::AcqRel);
                let (sh, tx) = (Arc::clone(&shared), tx.clone());
                let spawned = std::thread::Builder::new().name("hopscope-gpu-conn".into()).spawn(move || {
                    serve(stream, &sh, &tx);
                    sh.open.fetch_sub(1, Ordering::AcqRel);
                    sh.live.fetch_sub(1, Ordering::AcqRel);
                });
                if spawned.is_err() {
                    shared.open.fetch_sub(1, Ordering::AcqRel);
                    shared.live.fetch_sub(1, Ordering::AcqRel);
                    shared.stats.conns_rejected.fetch_add(1, Ordering::Relaxed);
                    shared.note("rejected a gpu connection: cannot start a thread for it".into());
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(10)),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            // ECONNABORTED, EMFILE…: nothing to read from; try again shortly.
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// The peer's pid and uid, from the kernel (SO_PEERCRED): what the peer was
/// when it connected, not what it says.
fn peer_cred(s: &UnixStream) -> io::Result<(u32, u32)> {
    let mut cred = libc::ucred { pid: 0, uid: 0, gid: 0 };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: the fd is a connected unix socket owned by `s` for the whole
    // call; `cred` is a writable ucred and `len` holds its exact size, which
    // is what SO_PEERCRED writes (the kernel never writes more than `len`).
    let rc = unsafe { libc::getsockopt(s.as_raw_fd(), libc::SOL_SOCKET, libc::SO_PEERCRED, (&raw mut cred).cast(), &mut len) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    if len as usize != std::mem::size_of::<libc::ucred>() || cred.pid <= 0 {
        return Err(io::Error::other("the kernel returned no peer credentials"));
    }
    Ok((cred.pid as u32, cred.uid))
}

/// Parent pid from /proc/PID/stat (the comm may hold spaces and parentheses).
fn parent_of(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// `pid` or one of its ancestors is traced.
fn in_tree(pid: u32, traced: &HashSet<u32>) -> bool {
    let mut p = pid;
    for _ in 0..64 {
        if traced.contains(&p) {
            return true;
        }
        match parent_of(p) {
            Some(pp) if pp > 1 && pp != p => p = pp,
            _ => return false,
        }
    }
    false
}

/// Whether the peer may deliver records: trusted uid, or in the traced tree
/// (waiting up to the grace for the traced set to catch up).
fn admit(shared: &Shared, pid: u32, uid: u32) -> bool {
    if shared.trusted_uids.contains(&uid) {
        return true;
    }
    let deadline = Instant::now() + shared.admit_grace;
    loop {
        if in_tree(pid, &shared.traced.read().unwrap_or_else(|e| e.into_inner())) {
            return true;
        }
        if Instant::now() >= deadline || shared.stop.load(Ordering::Acquire) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What one connection knows.
struct Conn {
    pid: u32,
    hello: bool,
    names: HashMap<u32, String>,
    name_bytes: usize,
}

enum Flow {
    Continue,
    /// End the connection (counted already).
    Drop,
}

fn serve(mut stream: UnixStream, shared: &Shared, tx: &SyncSender<Record>) {
    let st = &shared.stats;
    let (pid, uid) = match peer_cred(&stream) {
        Ok(c) => c,
        Err(e) => {
            st.conns_rejected.fetch_add(1, Ordering::Relaxed);
            shared.note(format!("rejected a gpu connection: cannot read its credentials: {e}"));
            return;
        }
    };
    if !admit(shared, pid, uid) {
        st.conns_rejected.fetch_add(1, Ordering::Relaxed);
        shared.note(format!("rejected a gpu connection from pid {pid} (uid {uid}): not in the traced process tree"));
        let _ = stream.shutdown(std::net::Shutdown::Both);
        return;
    }
    st.conns.fetch_add(1, Ordering::Relaxed);
    let _ = stream.set_nonblocking(false);
    if stream.set_read_timeout(Some(READ_TICK)).is_err() {
        st.conns_broken.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let mut conn = Conn { pid, hello: false, names: HashMap::new(), name_bytes: 0 };
    let mut dec = wire::FrameDecoder::default();
    let mut buf = vec![0u8; 1 << 16];
    // Ended by the agent (counted where decided), not by EOF or a stop.
    let mut dropped = false;
    'read: loop {
        if shared.stop.load(Ordering::Acquire) {
            break;
        }
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                dec.push(&buf[..n]);
                let now = sys::monotonic_ns();
                while let Some(m) = dec.next_message() {
                    let flow = match m {
                        Ok(m) => handle(shared, &mut conn, m, now, tx),
                        Err(e) => invalid_frame(shared, &conn, &e),
                    };
                    if let Flow::Drop = flow {
                        dropped = true;
                        break 'read;
                    }
                }
            }
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted) => {}
            // ECONNRESET: the process died; what arrived is kept.
            Err(_) => break,
        }
    }
    if !dropped && dec.pending() > 0 {
        // The process died, or its exit drain timed out, mid-frame.
        st.frames_torn.fetch_add(1, Ordering::Relaxed);
    }
}

fn invalid_frame(shared: &Shared, conn: &Conn, e: &wire::WireError) -> Flow {
    let st = &shared.stats;
    st.frames_invalid.fetch_add(1, Ordering::Relaxed);
    if e.is_fatal() || !conn.hello {
        st.conns_broken.fetch_add(1, Ordering::Relaxed);
        shared.note(format!("dropped the gpu connection of pid {}: {e}", conn.pid));
        return Flow::Drop;
    }
    Flow::Continue
}

fn send(shared: &Shared, tx: &SyncSender<Record>, rec: Record) -> Flow {
    match tx.send(rec) {
        Ok(()) => {
            shared.stats.records.fetch_add(1, Ordering::Relaxed);
            Flow::Continue
        }
        // The agent is gone: nothing more to deliver.
        Err(_) => Flow::Drop,
    }
}

impl Conn {
    fn name(&self, shared: &Shared, id: u32) -> String {
        if id == 0 {
            return String::new();
        }
        match self.names.get(&id) {
            Some(n) => n.clone(),
            None => {
                shared.stats.names_unknown.fetch_add(1, Ordering::Relaxed);
                format!("<name {id}>")
            }
        }
    }
}

/// One validated message of an admitted connection.
fn handle(shared: &Shared, conn: &mut Conn, m: wire::Message, now_ns: u64, tx: &SyncSender<Record>) -> Flow {
    use wire::Message as M;
    let st = &shared.stats;
    let pid = conn.pid;
    if !conn.hello {
        let M::Hello(h) = m else {
            st.frames_invalid.fetch_add(1, Ordering::Relaxed);
            st.conns_broken.fetch_add(1, Ordering::Relaxed);
            shared.note(format!("dropped the gpu connection of pid {pid}: the first frame is not a hello"));
            return Flow::Drop;
        };
        conn.hello = true;
        return send(
            shared,
            tx,
            Record::GpuProcess {
                ts_ns: now_ns,
                pid,
                ppid: h.ppid,
                own_pid: h.pid,
                comm: h.comm,
                cupti_version: h.cupti_version,
                clock: h.clock as u8,
                enabled: h.enabled,
                init_ns: h.init_mono_ns,
                cupti_lib: h.cupti_lib,
            },
        );
    }
    let plausible = |start: u64| {
        if start > now_ns.saturating_add(FUTURE_MARGIN_NS) {
            st.records_implausible.fetch_add(1, Ordering::Relaxed);
            false
        } else {
            true
        }
    };
    let rec = match m {
        M::Hello(_) => {
            // A second hello on one connection.
            st.frames_invalid.fetch_add(1, Ordering::Relaxed);
            return Flow::Continue;
        }
        M::Name(n) => {
            let old = conn.names.get(&n.id).map_or(0, String::len);
            if conn.name_bytes - old + n.name.len() > MAX_NAME_BYTES {
                st.names_dropped.fetch_add(1, Ordering::Relaxed);
            } else {
                conn.name_bytes = conn.name_bytes - old + n.name.len();
                conn.names.insert(n.id, n.name);
            }
            return Flow::Continue;
        }
        M::Counters(c) => {
            let mut s = shared.sender.lock().unwrap_or_else(|e| e.into_inner());
            let per = s.entry(pid).or_default();
            for (id, v) in c.values {
                per.insert(id, v);
            }
            return Flow::Continue;
        }
        M::Goodbye => return Flow::Continue,
        M::Device(d) => Record::GpuDevice {
            ts_ns: now_ns,
            pid,
            device: d.ordinal,
            name: d.name,
            cc_major: d.cc_major,
            cc_minor: d.cc_minor,
            sm_count: d.sm_count,
            total_mem_bytes: d.total_mem_bytes,
            driver_version: d.driver_version,
        },
        M::Calibration(c) => Record::GpuCalibration { ts_ns: c.at_mono_ns.max(1), pid, offset_ns: c.offset_ns, error_ns: c.error_ns },
        M::Kernel(k) if plausible(k.start_ns) => Record::GpuKernel {
            ts_ns: k.start_ns,
            end_ns: k.end_ns,
            pid,
            device: k.device_id,
            context: k.context_id,
            stream: k.stream_id,
            correlation_id: k.correlation_id,
            graph_id: k.graph_id,
            graph_node_id: k.graph_node_id,
            name: conn.name(shared, k.name_id),
            grid: k.grid,
            block: k.block,
            static_shared_mem: k.static_shared_mem,
            dynamic_shared_mem: k.dynamic_shared_mem,
            registers_per_thread: k.registers_per_thread,
        },
        M::Memcpy(c) if plausible(c.start_ns) => Record::GpuMemcpy {
            ts_ns: c.start_ns,
            end_ns: c.end_ns,
            pid,
            device: c.device_id,
            context: c.context_id,
            stream: c.stream_id,
            kind: c.copy_kind,
            src_kind: c.src_kind,
            dst_kind: c.dst_kind,
            flags: c.flags,
            bytes: c.bytes,
            correlation_id: c.correlation_id,
            runtime_correlation_id: c.runtime_correlation_id,
            graph_id: c.graph_id,
            graph_node_id: c.graph_node_id,
            peer: c.peer.map(|p| GpuPeer { src_device: p.src_device_id, src_context: p.src_context_id, dst_device: p.dst_device_id, dst_context: p.dst_context_id }),
        },
        M::Memset(s) if plausible(s.start_ns) => Record::GpuMemset {
            ts_ns: s.start_ns,
            end_ns: s.end_ns,
            pid,
            device: s.device_id,
            context: s.context_id,
            stream: s.stream_id,
            bytes: s.bytes,
            value: s.value,
            memory_kind: s.memory_kind,
            flags: s.flags,
            correlation_id: s.correlation_id,
            graph_id: s.graph_id,
            graph_node_id: s.graph_node_id,
        },
        M::Sync(s) if plausible(s.start_ns) => Record::GpuSync {
            ts_ns: s.start_ns,
            end_ns: s.end_ns,
            pid,
            sync_type: s.sync_type,
            context: s.context_id,
            stream: (s.stream_id != u32::MAX).then_some(s.stream_id),
            correlation_id: s.correlation_id,
            cuda_event: (s.cuda_event_id != u32::MAX).then_some(s.cuda_event_id),
        },
        M::Api(a) if plausible(a.start_ns) => Record::GpuApi {
            ts_ns: a.start_ns,
            end_ns: a.end_ns,
            pid,
            tid: a.thread_id,
            domain: a.domain as u8,
            class: a.class as u8,
            cbid: a.cbid,
            name: conn.name(shared, a.name_id),
            correlation_id: a.correlation_id,
            return_value: a.return_value,
        },
        // Implausible: counted by `plausible`.
        M::Kernel(_) | M::Memcpy(_) | M::Memset(_) | M::Sync(_) | M::Api(_) => return Flow::Continue,
    };
    send(shared, tx, rec)
}

/// The injection library to load into `hopscope run`'s command: `explicit`
/// (`--cupti-lib`), else [`INJECTION_LIB_ENV`], else
/// [`INJECTION_LIB_NAME`] next to the running `hopscope`. `Ok(None)` when it
/// was not asked for and is not there; `Err` when the path asked for does not exist.
pub fn find_injection_lib(explicit: Option<&Path>) -> Result<Option<PathBuf>, String> {
    let asked = explicit
        .map(|p| (p.to_owned(), "--cupti-lib"))
        .or_else(|| std::env::var_os(INJECTION_LIB_ENV).filter(|v| !v.is_empty()).map(|v| (PathBuf::from(v), INJECTION_LIB_ENV)));
    if let Some((p, from)) = asked {
        return match std::fs::canonicalize(&p) {
            Ok(abs) if abs.is_file() => Ok(Some(abs)),
            Ok(_) => Err(format!("{} (from {from}) is not a file", p.display())),
            Err(e) => Err(format!("cannot use {} (from {from}): {e}", p.display())),
        };
    }
    let exe = std::env::current_exe().ok().and_then(|e| std::fs::canonicalize(e).ok());
    let dir = exe.as_deref().and_then(Path::parent);
    let candidates = dir.into_iter().flat_map(|d| [d.join(INJECTION_LIB_NAME), d.join("../lib").join(INJECTION_LIB_NAME)]);
    for c in candidates {
        if c.is_file() {
            return Ok(Some(std::fs::canonicalize(&c).unwrap_or(c)));
        }
    }
    Ok(None)
}

/// Sets `gpu: true` in a finished recording's metadata, in place (the
/// metadata is written first, before anyone knows whether a GPU process
/// will connect). The JSON keeps its length: the new text is padded with
/// spaces, which JSON ignores.
pub fn mark_recording_gpu(path: &Path) -> io::Result<()> {
    use std::io::{Seek, SeekFrom, Write};
    let mut f = std::fs::OpenOptions::new().read(true).write(true).open(path)?;
    let mut head = [0u8; 16];
    f.read_exact(&mut head)?;
    if &head[..8] != crate::recording::MAGIC {
        return Err(io::Error::other("not a hopscope recording"));
    }
    let len = u32::from_le_bytes([head[12], head[13], head[14], head[15]]) as usize;
    if len as u64 > u64::from(crate::recording::MAX_BLOCK_BYTES) {
        return Err(io::Error::other(format!("metadata length {len} too large")));
    }
    let mut json = vec![0u8; len];
    f.read_exact(&mut json)?;
    let mut meta: crate::recording::Meta = serde_json::from_slice(&json).map_err(|e| io::Error::other(format!("metadata is not valid json: {e}")))?;
    if meta.gpu {
        return Ok(());
    }
    meta.gpu = true;
    let mut new = serde_json::to_vec(&meta).map_err(io::Error::other)?;
    if new.len() > len {
        return Err(io::Error::other("the updated metadata does not fit in place"));
    }
    new.resize(len, b' ');
    f.seek(SeekFrom::Start(16))?;
    f.write_all(&new)?;
    f.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use wire::Message as M;

    fn hello() -> M {
        M::Hello(wire::Hello {
            pid: std::process::id(),
            ppid: 1,
            cupti_version: 130401,
            clock: wire::ClockSource::Callback,
            enabled: 0x7f,
            init_mono_ns: 5,
            struct_sizes: [248, 112, 96, 104, 56, 40],
            cupti_lib: "libcupti.so.13".into(),
            comm: "test".into(),
        })
    }

    fn kernel(start: u64, name_id: u32, corr: u32) -> M {
        M::Kernel(wire::Kernel {
            start_ns: start,
            end_ns: start + 1_000,
            device_id: 0,
            context_id: 1,
            stream_id: 7,
            correlation_id: corr,
            grid_id: 1,
            grid: [4, 2, 1],
            block: [128, 1, 1],
            static_shared_mem: 0,
            dynamic_shared_mem: 0,
            registers_per_thread: 32,
            launch_type: 0,
            name_id,
            graph_id: 0,
            graph_node_id: 0,
        })
    }

    fn frames(ms: &[M]) -> Vec<u8> {
        let mut v = Vec::new();
        for m in ms {
            m.encode(&mut v);
        }
        v
    }

    fn receiver(traced_self: bool, trusted_self: bool) -> GpuReceiver {
        let cfg = GpuConfig {
            parent: Some(std::env::temp_dir()),
            trusted_uids: if trusted_self { vec![sys::euid()] } else { Vec::new() },
            admit_grace: Duration::from_millis(50),
            ..GpuConfig::default()
        };
        let r = GpuReceiver::bind(cfg).unwrap();
        if traced_self {
            r.set_traced([std::process::id()]);
        }
        r
    }

    fn counter(r: &GpuReceiver, name: &str) -> u64 {
        r.counters().into_iter().find(|(k, _)| k == name).unwrap_or_else(|| panic!("no counter {name}")).1
    }

    /// Waits until the peer side sees EOF (the agent closed the connection).
    fn closed_by_agent(s: &mut UnixStream) -> bool {
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut b = [0u8; 16];
        match s.read(&mut b) {
            Ok(0) => true,
            Err(e) => e.kind() == io::ErrorKind::ConnectionReset,
            Ok(_) => false,
        }
    }

    /// Collects records until `n` arrived (or 5 s).
    fn collect(r: &mut GpuReceiver, n: usize) -> Vec<Record> {
        let mut out = Vec::new();
        let t = Instant::now();
        while out.len() < n && t.elapsed() < Duration::from_secs(5) {
            r.drain(|x| out.push(x));
            std::thread::sleep(Duration::from_millis(5));
        }
        out
    }

    fn wait_counter(r: &GpuReceiver, name: &str, want: u64) {
        let t = Instant::now();
        while counter(r, name) != want && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(counter(r, name), want, "{name}: {:?}", r.counters());
    }

    #[test]
    fn the_socket_is_private_and_goes_away_with_the_receiver() {
        let r = receiver(true, false);
        let path = r.socket_path().to_owned();
        let dir = path.parent().unwrap().to_owned();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&path), 0o600);
        assert!(dir.file_name().unwrap().to_str().unwrap().starts_with("hopscope-gpu-"));
        let r2 = receiver(true, false);
        assert_ne!(r2.socket_path(), path, "each receiver gets its own directory");
        drop(r);
        assert!(!dir.exists(), "the directory is removed");
    }

    #[test]
    fn records_are_decoded_with_their_names_and_bad_frames_are_counted_then_fatal_ones_drop_the_connection() {
        let mut r = receiver(true, false);
        let mut s = UnixStream::connect(r.socket_path()).unwrap();
        let now = sys::monotonic_ns();
        let mut bytes = frames(&[hello(), M::Name(wire::Name { id: 3, name: "gemm".into() }), kernel(now, 3, 1), kernel(now + 5, 9, 2), kernel(now + 6, 0, 3)]);
        // Unknown tag: skipped.
        bytes.extend_from_slice(&[2, 0, 0, 0, 200, 0]);
        // Impossible timestamps: the wire check rejects the frame, skipped.
        let mut bad = kernel(now, 3, 4).to_frame();
        bad[5..13].copy_from_slice(&0u64.to_le_bytes());
        bytes.extend_from_slice(&bad);
        // Far in the future of the agent's clock: dropped, counted.
        bytes.extend_from_slice(&kernel(now + 3_600_000_000_000, 3, 5).to_frame());
        bytes.extend_from_slice(&frames(&[M::Counters(wire::Counters { values: vec![(wire::Counter::CuptiDropped as u16, 4), (wire::Counter::BadTimestampZero as u16, 2)] })]));
        bytes.extend_from_slice(&kernel(now + 7, 3, 6).to_frame());
        // A zero length desynchronises the stream: fatal.
        bytes.extend_from_slice(&[0, 0, 0, 0]);
        bytes.extend_from_slice(&kernel(now + 8, 3, 7).to_frame());
        s.write_all(&bytes).unwrap();
        assert!(closed_by_agent(&mut s), "a fatal frame ends the connection");
        let recs = collect(&mut r, 5);
        assert_eq!(recs.len(), 5, "{recs:#?}");
        let Record::GpuProcess { pid, own_pid, cupti_version, clock, .. } = &recs[0] else { panic!("{:?}", recs[0]) };
        assert_eq!((*pid, *own_pid, *cupti_version, *clock), (std::process::id(), std::process::id(), 130401, 1));
        let kernels: Vec<(u32, &str)> = recs[1..]
            .iter()
            .map(|x| match x {
                Record::GpuKernel { correlation_id, name, pid, grid, ts_ns, end_ns, .. } => {
                    assert_eq!((*pid, *grid, end_ns - ts_ns), (std::process::id(), [4, 2, 1], 1_000));
                    (*correlation_id, name.as_str())
                }
                x => panic!("{x:?}"),
            })
            .collect();
        assert_eq!(kernels, vec![(1, "gemm"), (2, "<name 9>"), (3, ""), (6, "gemm")]);
        wait_counter(&r, "gpu_conns_broken", 1);
        assert_eq!(counter(&r, "gpu_frames_invalid"), 3, "unknown tag, bad timestamps, bad length");
        assert_eq!(counter(&r, "gpu_records_implausible"), 1);
        assert_eq!(counter(&r, "gpu_names_unknown"), 1);
        assert_eq!(counter(&r, "gpu_conns"), 1);
        assert_eq!(counter(&r, "gpu_records"), 5);
        assert_eq!(counter(&r, "gpu_cupti_dropped"), 4);
        assert_eq!(counter(&r, "gpu_bad_timestamp_zero"), 2);
        assert_eq!(counter(&r, "gpu_frames_torn"), 0);
    }

    #[test]
    fn a_connection_must_start_with_a_hello() {
        let mut r = receiver(true, false);
        let mut s = UnixStream::connect(r.socket_path()).unwrap();
        s.write_all(&kernel(sys::monotonic_ns(), 0, 1).to_frame()).unwrap();
        assert!(closed_by_agent(&mut s));
        wait_counter(&r, "gpu_conns_broken", 1);
        assert_eq!(counter(&r, "gpu_frames_invalid"), 1);
        let mut bad_magic = hello().to_frame();
        bad_magic[5] = b'X';
        let mut s = UnixStream::connect(r.socket_path()).unwrap();
        s.write_all(&bad_magic).unwrap();
        assert!(closed_by_agent(&mut s));
        wait_counter(&r, "gpu_conns_broken", 2);
        assert!(collect(&mut r, 1).is_empty());
    }

    #[test]
    fn several_processes_at_once_each_with_its_own_names() {
        let mut r = receiver(true, false);
        let now = sys::monotonic_ns();
        // All connections open before any writes: they are served concurrently.
        let mut conns: Vec<UnixStream> = (0..6).map(|_| UnixStream::connect(r.socket_path()).unwrap()).collect();
        for (i, s) in conns.iter_mut().enumerate() {
            let mut ms = vec![hello(), M::Name(wire::Name { id: 1, name: format!("kernel_of_conn_{i}") })];
            ms.extend((0..100).map(|k| kernel(now + k, 1, (i * 1000 + k as usize) as u32)));
            s.write_all(&frames(&ms)).unwrap();
        }
        let recs = collect(&mut r, 6 * 101);
        assert_eq!(recs.len(), 6 * 101);
        let mut by_name: HashMap<String, Vec<u32>> = HashMap::new();
        for x in &recs {
            if let Record::GpuKernel { name, correlation_id, .. } = x {
                by_name.entry(name.clone()).or_default().push(*correlation_id);
            }
        }
        assert_eq!(by_name.len(), 6);
        for (i, _) in conns.iter().enumerate() {
            let c = &by_name[&format!("kernel_of_conn_{i}")];
            assert_eq!(c.len(), 100);
            assert!(c.iter().all(|c| *c as usize / 1000 == i), "names resolved per connection");
        }
        assert!(r.connected());
        drop(conns);
        assert!(r.wait_idle(Duration::from_secs(5), |_| panic!("nothing more")));
        assert!(!r.connected());
        assert_eq!((counter(&r, "gpu_conns"), counter(&r, "gpu_frames_invalid"), counter(&r, "gpu_frames_torn")), (6, 0, 0));
    }

    #[test]
    fn a_peer_outside_the_traced_tree_is_rejected_and_counted_unless_its_uid_is_trusted() {
        let mut r = receiver(false, false);
        r.set_traced([1_000_000_000]);
        let mut s = UnixStream::connect(r.socket_path()).unwrap();
        s.write_all(&frames(&[hello(), kernel(sys::monotonic_ns(), 0, 1)])).unwrap();
        assert!(closed_by_agent(&mut s), "the agent closes it unread");
        wait_counter(&r, "gpu_conns_rejected", 1);
        assert_eq!(counter(&r, "gpu_conns"), 0);
        assert!(collect(&mut r, 1).is_empty());
        let notes = r.take_notes();
        assert!(notes.len() == 1 && notes[0].contains("not in the traced process tree"), "{notes:?}");

        // Our parent is traced: we are below it.
        r.set_traced([std::os::unix::process::parent_id()]);
        let mut s = UnixStream::connect(r.socket_path()).unwrap();
        s.write_all(&frames(&[hello()])).unwrap();
        assert_eq!(collect(&mut r, 1).len(), 1, "a descendant of a traced process is accepted");

        let mut t = receiver(false, true);
        let mut s = UnixStream::connect(t.socket_path()).unwrap();
        s.write_all(&frames(&[hello()])).unwrap();
        assert_eq!(collect(&mut t, 1).len(), 1, "a trusted uid is accepted");
        assert_eq!(counter(&t, "gpu_conns_rejected"), 0);
    }

    #[test]
    fn sender_counters_are_cumulative_per_process_so_a_reconnect_replaces_them() {
        let mut r = receiver(true, false);
        let c = |v: u64| M::Counters(wire::Counters { values: vec![(wire::Counter::DroppedQueueFull as u16, v), (999, 1)] });
        for v in [3, 8] {
            let mut s = UnixStream::connect(r.socket_path()).unwrap();
            s.write_all(&frames(&[hello(), c(v), M::Goodbye])).unwrap();
            drop(s);
            assert!(r.wait_idle(Duration::from_secs(5), |_| {}));
        }
        assert_eq!(counter(&r, "gpu_dropped_queue_full"), 8, "the last report of a pid wins");
        assert_eq!(counter(&r, "gpu_counter_999"), 1, "a newer sender's counters pass as numbers");
        assert_eq!(r.records(), 2);
    }

    #[test]
    fn a_torn_frame_at_eof_is_counted() {
        let mut r = receiver(true, false);
        let mut s = UnixStream::connect(r.socket_path()).unwrap();
        let mut b = frames(&[hello()]);
        let k = kernel(sys::monotonic_ns(), 0, 1).to_frame();
        b.extend_from_slice(&k[..k.len() - 3]);
        s.write_all(&b).unwrap();
        drop(s);
        assert!(r.wait_idle(Duration::from_secs(5), |_| {}));
        assert_eq!((counter(&r, "gpu_frames_torn"), r.records()), (1, 1));
    }

    #[test]
    fn shutdown_hands_over_what_is_queued() {
        let mut r = receiver(true, false);
        let mut s = UnixStream::connect(r.socket_path()).unwrap();
        let now = sys::monotonic_ns();
        let ms: Vec<M> = std::iter::once(hello()).chain((0..50).map(|k| kernel(now + k, 0, k as u32))).collect();
        s.write_all(&frames(&ms)).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        let dir = r.socket_path().parent().unwrap().to_owned();
        let mut n = 0;
        r.shutdown(|_| n += 1);
        assert_eq!((n, r.records()), (51, 51));
        drop(r);
        assert!(!dir.exists());
    }

    #[test]
    fn gpu_records_merge_into_the_recording_in_timestamp_order() {
        use crate::event::{KEvent, SchedEvent};
        use crate::pipeline::{Pipeline, GPU_REORDER_WINDOW_NS};
        use crate::recording::{Meta, Reader, Writer};
        let meta = Meta { format_version: crate::recording::FORMAT_VERSION, start_ns: 1, ..Meta::default() };
        let mut p = Pipeline::new(Default::default(), Writer::new(Vec::new(), &meta).unwrap());
        let off = |ts: u64| KEvent::Sched(SchedEvent { ts_ns: ts, tgid: 1, tid: 1, off_ns: ts - 1, wake_ns: None, prev_state: 1, cpu: 0 });
        let k = |ts: u64| Record::GpuKernel {
            ts_ns: ts,
            end_ns: ts + 10,
            pid: 1,
            device: 0,
            context: 1,
            stream: 7,
            correlation_id: 0,
            graph_id: 0,
            graph_node_id: 0,
            name: "k".into(),
            grid: [1; 3],
            block: [1; 3],
            static_shared_mem: 0,
            dynamic_shared_mem: 0,
            registers_per_thread: 0,
        };
        const S: u64 = 1_000_000_000;
        let base = 10 * S;
        p.advance_gpu(base, true).unwrap();
        // Kernel-side events up to base+1.5 s; GPU records arrive late and unordered.
        for i in 0..30 {
            p.push(off(base + i * 50_000_000)).unwrap();
        }
        p.advance_gpu(base + 1_500_000_000, true).unwrap();
        for ts in [base + 1_200_000_000, base + 100, base + 700_000_000, base + 1] {
            p.push_gpu(k(ts));
        }
        p.advance_gpu(base + GPU_REORDER_WINDOW_NS + 800_000_000, true).unwrap();
        // Late: older than what is written by now.
        p.push_gpu(k(base + 2));
        p.advance_gpu(base + 3 * GPU_REORDER_WINDOW_NS, false).unwrap();
        let (bytes, stats) = p.finish(base + 4 * GPU_REORDER_WINDOW_NS, &[]).unwrap();
        let mut rd = Reader::new(&bytes[..]).unwrap();
        let mut ts = Vec::new();
        let mut gpu = 0;
        while let Some(r) = rd.next_record().unwrap() {
            if matches!(r, Record::GpuKernel { .. }) {
                gpu += 1;
            }
            if !matches!(r, Record::Drops { .. }) {
                ts.push(r.ts_ns());
            }
        }
        assert_eq!(gpu, 5);
        assert_eq!((stats.gpu_records, stats.gpu_records_late), (5, 1));
        let late = ts.iter().position(|t| *t == base + 2).unwrap();
        let mut without_late = ts.clone();
        without_late.remove(late);
        assert!(without_late.windows(2).all(|w| w[0] <= w[1]), "merged in order: {ts:?}");
    }

    #[test]
    fn without_gpu_connections_only_a_short_standby_window_is_held() {
        use crate::event::{KEvent, SchedEvent};
        use crate::pipeline::Pipeline;
        use crate::recording::{Meta, Writer};
        let meta = Meta { format_version: crate::recording::FORMAT_VERSION, start_ns: 1, ..Meta::default() };
        let mut p = Pipeline::new(Default::default(), Writer::new(Vec::new(), &meta).unwrap());
        for i in 0..10u64 {
            p.push(KEvent::Sched(SchedEvent { ts_ns: 1_000_000_000 + i * 100_000_000, tgid: 1, tid: 1, off_ns: 1, wake_ns: None, prev_state: 1, cpu: 0 })).unwrap();
        }
        p.advance_gpu(2_000_000_000, false).unwrap();
        // Written up to now - 250 ms: a GPU record from before that is late,
        // one after it merges in order.
        p.push_gpu(Record::GpuCalibration { ts_ns: 1_000_000_001, pid: 1, offset_ns: 0, error_ns: 0 });
        p.push_gpu(Record::GpuCalibration { ts_ns: 1_800_000_001, pid: 1, offset_ns: 0, error_ns: 0 });
        p.advance_gpu(2_000_000_000, false).unwrap();
        assert_eq!((p.stats().records, p.stats().gpu_records, p.stats().gpu_records_late), (9, 1, 1));
        let (_, st) = p.finish(3_000_000_000, &[]).unwrap();
        assert_eq!((st.gpu_records, st.gpu_records_late), (2, 1));
    }

    #[test]
    fn the_recording_is_marked_gpu_in_place() {
        use crate::recording::{load, Meta, Writer, FORMAT_VERSION};
        let dir = std::env::temp_dir().join(format!("hopscope-mark-gpu-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("x.hop");
        let meta = Meta { format_version: FORMAT_VERSION, hopscope_version: "t".into(), start_ns: 1, pids: vec![7], command: vec!["a b".into()], ..Meta::default() };
        let mut w = Writer::create(&path, &meta).unwrap();
        w.push(&Record::ConnClose { ts_ns: 5, conn: crate::event::ConnKey { tgid: 7, fd: 3, ino: 1 } }).unwrap();
        w.finish(6).unwrap();
        mark_recording_gpu(&path).unwrap();
        mark_recording_gpu(&path).unwrap();
        let l = load(&path).unwrap();
        assert!(l.meta.gpu && l.error.is_none());
        assert_eq!((l.meta.pids.clone(), l.meta.command.clone(), l.records.len()), (vec![7], vec!["a b".to_string()], 1));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_injection_library_is_found_where_asked_or_next_to_the_binary() {
        let dir = std::env::temp_dir().join(format!("hopscope-find-lib-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let lib = dir.join(INJECTION_LIB_NAME);
        std::fs::write(&lib, b"").unwrap();
        assert_eq!(find_injection_lib(Some(&lib)).unwrap(), Some(std::fs::canonicalize(&lib).unwrap()));
        let e = find_injection_lib(Some(&dir.join("missing.so"))).unwrap_err();
        assert!(e.contains("missing.so") && e.contains("--cupti-lib"), "{e}");
        let e = find_injection_lib(Some(&dir)).unwrap_err();
        assert!(e.contains("not a file"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
