//! The injection: state, CUPTI callbacks, the flush thread and the exit flush.
//!
//! Sequence (CUPTI injection sample; Kineto's CuptiActivityApi):
//! load libcupti → version and record sizes → timestamp callback (before any
//! kind is enabled) → buffer callbacks → threads → enable kinds → atexit.
//! Every callback body runs under `catch_unwind`; a failure disables us, never
//! the host.

use crate::apis;
use crate::config::{ClockChoice, Config};
use crate::convert::{self, Batch, NameSource, NameTable};
use crate::counters::{Counters, Local};
use crate::pool::BufferPool;
use crate::sender::{self, Item};
use cupti_sys::clock::{self as cclock, Conversion, TimeBounds};
use cupti_sys::record::{self, Record, RecordError, StructSizes};
use cupti_sys::*;
use hopscope_gpu_wire::{self as wire, enabled, ClockSource, Counter};
use std::ffi::{c_char, CStr};
use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, SyncSender, TrySendError};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Locate(#[from] crate::locate::LocateError),
    #[error(transparent)]
    Cupti(#[from] CuptiError),
    #[error("cupti version {0} is older than 12.4 (22), which hopscope needs")]
    TooOld(u32),
    #[error("record layout check failed: {0}")]
    Layout(#[from] RecordError),
    #[error("cannot start the {what} thread: {source}")]
    Thread { what: &'static str, source: std::io::Error },
    #[error("HOPSCOPE_CUPTI_FORCE_INIT_FAILURE is set")]
    Forced,
    #[error("already initialised in this process")]
    Again,
}

/// CLOCK_MONOTONIC now, in ns (the clock of bpf_ktime_get_ns).
pub fn mono_now() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec through a valid pointer;
    // CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The timestamp callback CUPTI calls for every timestamp it records.
unsafe extern "C" fn monotonic_timestamp() -> u64 {
    mono_now()
}

/// How CUPTI timestamps become CLOCK_MONOTONIC in this process.
pub struct Clock {
    pub source: ClockSource,
    offset: AtomicI64,
    error: AtomicU64,
    at: AtomicU64,
    generation: AtomicU64,
    last_calibration: Mutex<Option<Instant>>,
}

impl Clock {
    fn new(source: ClockSource) -> Clock {
        Clock {
            source,
            offset: AtomicI64::new(0),
            error: AtomicU64::new(0),
            at: AtomicU64::new(0),
            generation: AtomicU64::new(0),
            last_calibration: Mutex::new(None),
        }
    }

    /// None until the first calibration in calibrated mode.
    pub fn conversion(&self) -> Option<Conversion> {
        match self.source {
            ClockSource::Callback => Some(Conversion::Identity),
            ClockSource::Calibrated if self.generation.load(Ordering::Acquire) == 0 => None,
            ClockSource::Calibrated => Some(Conversion::Offset(self.offset.load(Ordering::Acquire))),
        }
    }

    /// The current calibration and its generation (calibrated mode only).
    pub fn calibration(&self) -> Option<(wire::Calibration, u64)> {
        let generation = self.generation.load(Ordering::Acquire);
        if self.source != ClockSource::Calibrated || generation == 0 {
            return None;
        }
        Some((
            wire::Calibration {
                offset_ns: self.offset.load(Ordering::Acquire),
                error_ns: self.error.load(Ordering::Relaxed),
                at_mono_ns: self.at.load(Ordering::Relaxed),
            },
            generation,
        ))
    }

    /// Measures the offset (min gap of 32 brackets of `cuptiGetTimestamp` by
    /// CLOCK_MONOTONIC reads) unless done less than `min_age` ago.
    pub fn calibrate(&self, cupti: &Cupti, min_age: Duration) {
        if self.source != ClockSource::Calibrated {
            return;
        }
        let mut last = self.last_calibration.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_some_and(|t| t.elapsed() < min_age) {
            return;
        }
        *last = Some(Instant::now());
        let samples: Vec<(u64, u64, u64)> = (0..32)
            .filter_map(|_| {
                let a = mono_now();
                let c = cupti.timestamp().ok()?;
                let b = mono_now();
                Some((a, c, b))
            })
            .collect();
        let Some(cal) = cclock::calibrate(samples) else { return };
        let old = self.offset.load(Ordering::Acquire);
        let first = self.generation.load(Ordering::Acquire) == 0;
        if first || (cal.offset_ns - old).unsigned_abs() > 1_000 {
            self.offset.store(cal.offset_ns, Ordering::Release);
            self.error.store(cal.error_ns, Ordering::Relaxed);
            self.at.store(cal.at_mono_ns, Ordering::Relaxed);
            self.generation.fetch_add(1, Ordering::AcqRel);
        }
    }
}

struct Dump {
    dir: PathBuf,
    written: usize,
    seq: u32,
}

pub struct Injection {
    pub cfg: Config,
    pub cupti: Cupti,
    pub pid: u32,
    pub version: u32,
    pub sizes: StructSizes,
    pub clock: Clock,
    pub init_mono_ns: u64,
    pub pool: BufferPool,
    pub names: Mutex<NameTable>,
    pub counters: Counters,
    pub devices: Mutex<Vec<wire::Device>>,
    pub enabled: AtomicU32,
    pub active: AtomicBool,
    pub connected: AtomicBool,
    pub queued: AtomicUsize,
    tx: SyncSender<Item>,
    flush_stop: Mutex<Option<Sender<()>>>,
    flush_done: Mutex<Option<Receiver<()>>>,
    dump: Mutex<Option<Dump>>,
}

static STATE: OnceLock<Injection> = OnceLock::new();
static STARTED: AtomicBool = AtomicBool::new(false);

fn log(msg: &str) {
    // Never panic on a closed stderr.
    let _ = writeln!(std::io::stderr(), "hopscope-cupti[{}]: {msg}", std::process::id());
}

impl Injection {
    pub fn hello(&self) -> wire::Hello {
        let comm = std::fs::read_to_string("/proc/self/comm").map(|s| s.trim().to_owned()).unwrap_or_default();
        wire::Hello {
            pid: self.pid,
            // SAFETY: getppid has no preconditions and cannot fail.
            ppid: unsafe { libc::getppid() } as u32,
            cupti_version: self.version,
            clock: self.clock.source,
            enabled: self.enabled.load(Ordering::Relaxed),
            init_mono_ns: self.init_mono_ns,
            struct_sizes: self.sizes.as_array(),
            cupti_lib: self.cupti.origin().to_owned(),
            comm,
        }
    }

    /// Hands a batch to the sender without ever waiting.
    fn enqueue(&self, b: Batch) {
        if b.records == 0 {
            return;
        }
        if !self.connected.load(Ordering::Acquire) {
            self.counters.add(Counter::DroppedNoAgent, b.records);
            return;
        }
        let len = b.bytes.len();
        let queued = self.queued.load(Ordering::Acquire);
        // An empty queue always takes one batch, whatever its size.
        if queued > 0 && queued + len > self.cfg.queue_bytes {
            self.counters.add(Counter::DroppedQueueFull, b.records);
            return;
        }
        self.queued.fetch_add(len, Ordering::AcqRel);
        if let Err(e) = self.tx.try_send(Item::Batch(b)) {
            self.queued.fetch_sub(len, Ordering::AcqRel);
            let (counter, item) = match e {
                TrySendError::Full(i) => (Counter::DroppedQueueFull, i),
                TrySendError::Disconnected(i) => (Counter::DroppedNoAgent, i),
            };
            if let Item::Batch(b) = item {
                self.counters.add(counter, b.records);
            }
        }
    }

    /// Walks one completed buffer.
    fn process(&self, buffer: *mut u8, valid: usize) {
        let conv = match self.clock.conversion() {
            Some(c) => c,
            None => {
                self.clock.calibrate(&self.cupti, Duration::ZERO);
                // No calibration possible: raw CLOCK_REALTIME values fail the
                // bounds and are counted as bad timestamps, never sent wrong.
                self.clock.conversion().unwrap_or(Conversion::Offset(0))
            }
        };
        let bounds = TimeBounds::new(self.init_mono_ns, mono_now());
        let mut batch = Batch { bytes: Vec::with_capacity(valid / 2), ..Batch::default() };
        let mut local = Local::default();
        let mut dump_names: Option<Vec<(usize, String)>> =
            self.cfg.dump_dir.is_some().then(Vec::new).filter(|_| self.dump_wanted());
        {
            let mut names = self.names.lock().unwrap_or_else(|e| e.into_inner());
            // SAFETY: `buffer[..valid]` is the buffer CUPTI handed to the
            // completed callback we are in; it stays alive and untouched until
            // we return it to the pool after this walk.
            for rec in unsafe { self.cupti.records(buffer, valid) } {
                let bytes = match rec {
                    Ok(b) => b,
                    Err(_) => {
                        local.cupti_errors += 1;
                        break;
                    }
                };
                match record::decode(bytes, &self.sizes) {
                    Ok(r) => {
                        if let (Some(dn), Record::Kernel(k)) = (dump_names.as_mut(), &r) {
                            if let Some(n) = CuptiNames.kernel_name(k.name_ptr) {
                                dn.push((bytes.as_ptr() as usize - buffer as usize, String::from_utf8_lossy(n).into_owned()));
                            }
                        }
                        convert::push(&mut batch, r, conv, bounds, &mut names, &mut CuptiNames, &mut local)
                    }
                    Err(RecordError::UnknownKind(_)) => local.unknown_kind += 1,
                    Err(_) => local.bad_size += 1,
                }
            }
        }
        local.add_to(&self.counters);
        if let Some(dn) = dump_names {
            self.dump(buffer, valid, &dn);
        }
        self.enqueue(batch);
    }

    fn dump_wanted(&self) -> bool {
        let d = self.dump.lock().unwrap_or_else(|e| e.into_inner());
        d.as_ref().is_some_and(|d| d.written < self.cfg.dump_max_bytes)
    }

    /// Raw activity bytes for decoder fixtures: `<dir>/cupti-v<ver>-pid<pid>-<n>.bin`
    /// plus one JSON line per buffer in `cupti-v<ver>-pid<pid>.jsonl`.
    fn dump(&self, buffer: *mut u8, valid: usize, kernel_names: &[(usize, String)]) {
        let mut g = self.dump.lock().unwrap_or_else(|e| e.into_inner());
        let Some(d) = g.as_mut() else { return };
        let n = valid.min(self.cfg.dump_max_bytes.saturating_sub(d.written));
        if n == 0 {
            return;
        }
        // SAFETY: same buffer as in `process`, still ours until returned.
        let bytes = unsafe { std::slice::from_raw_parts(buffer as *const u8, n) };
        let stem = format!("cupti-v{}-pid{}", self.version, self.pid);
        let file = format!("{stem}-{:03}.bin", d.seq);
        let names: Vec<String> = kernel_names.iter().map(|(o, s)| format!("[{o},{}]", json_str(s))).collect();
        let line = format!(
            "{{\"file\":{},\"bytes\":{n},\"valid\":{valid},\"cupti_version\":{},\"struct_sizes\":{:?},\"clock\":\"{:?}\",\"kernel_names\":[{}]}}\n",
            json_str(&file),
            self.version,
            self.sizes.as_array(),
            self.clock.source,
            names.join(",")
        );
        let ok = std::fs::create_dir_all(&d.dir).is_ok()
            && std::fs::write(d.dir.join(&file), bytes).is_ok()
            && std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(d.dir.join(format!("{stem}.jsonl")))
                .and_then(|mut f| f.write_all(line.as_bytes()))
                .is_ok();
        d.written += n;
        d.seq += 1;
        if !ok {
            d.written = usize::MAX; // stop trying
        }
    }
}

fn json_str(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => o.push_str(&format!("\\u{:04x}", c as u32)),
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

/// Kernel names straight from CUPTI's records.
struct CuptiNames;

impl NameSource for CuptiNames {
    fn kernel_name(&mut self, ptr: usize) -> Option<&[u8]> {
        if ptr == 0 {
            return None;
        }
        // SAFETY: `ptr` is a kernel record's `name`: a NUL-terminated string
        // owned by CUPTI, valid at least for the completed callback we are in
        // (cupti_activity.h, CUpti_ActivityKernel*::name).
        Some(unsafe { CStr::from_ptr(ptr as *const c_char) }.to_bytes())
    }
}

/// CUPTI asks for an empty buffer (from any thread, often the host's).
unsafe extern "C" fn buffer_requested(buffer: *mut *mut u8, size: *mut usize, max_records: *mut usize) {
    let got = catch_unwind(|| {
        let st = STATE.get()?;
        match st.pool.take() {
            Some(p) => Some((p, st.pool.size())),
            None => {
                st.counters.add(Counter::BufferPoolExhausted, 1);
                None
            }
        }
    });
    let (p, n) = match got {
        Ok(Some(x)) => x,
        Ok(None) => (std::ptr::null_mut(), 0),
        Err(_) => {
            if let Some(st) = STATE.get() {
                st.counters.add(Counter::CallbackPanics, 1);
            }
            (std::ptr::null_mut(), 0)
        }
    };
    // SAFETY: CUPTI passes valid out-pointers (null-checked anyway).
    unsafe {
        if !buffer.is_null() {
            *buffer = p;
        }
        if !size.is_null() {
            *size = n;
        }
        if !max_records.is_null() {
            *max_records = 0; // as many as fit
        }
    }
}

/// CUPTI hands back a filled buffer (from its thread, or ours when flushing).
unsafe extern "C" fn buffer_completed(context: CUcontext, stream_id: u32, buffer: *mut u8, _size: usize, valid: usize) {
    let Some(st) = STATE.get() else { return };
    let r = catch_unwind(AssertUnwindSafe(|| {
        if !buffer.is_null() && valid > 0 {
            st.process(buffer, valid);
        }
        // SAFETY: `context` is the value CUPTI passed to this callback.
        if let Ok(n) = unsafe { st.cupti.dropped_records(context, stream_id) } {
            st.counters.add(Counter::CuptiDropped, n as u64);
        }
    }));
    if r.is_err() {
        st.counters.add(Counter::CallbackPanics, 1);
    }
    st.pool.give_back(buffer);
}

/// Periodic `cuptiActivityFlushAll(0)` (FlushPeriod only returns full
/// buffers); recalibration; device probing once CUDA is up.
fn flush_loop(st: &'static Injection, stop: Receiver<()>, done: Sender<()>) {
    let period = Duration::from_millis(st.cfg.flush_ms);
    let mut probes = 0;
    loop {
        st.clock.calibrate(&st.cupti, Duration::from_secs(1));
        match stop.recv_timeout(period) {
            Err(RecvTimeoutError::Timeout) => {}
            _ => break,
        }
        if !st.active.load(Ordering::Acquire) {
            break;
        }
        let _ = catch_unwind(AssertUnwindSafe(|| {
            if st.cupti.flush_all(0).is_err() {
                st.counters.add(Counter::CuptiErrors, 1);
            }
            if probes < 40 && st.devices.lock().map(|d| d.is_empty()).unwrap_or(false) {
                probes += 1;
                if let Some(devs) = crate::device::probe() {
                    *st.devices.lock().unwrap_or_else(|e| e.into_inner()) = devs;
                }
            }
        }));
    }
    let _ = done.send(());
}

/// Exit: stop flushing, force-flush, let the sender write what it has and
/// the final counters, within `exit_drain_ms`.
extern "C" fn at_exit() {
    let _ = catch_unwind(|| {
        let Some(st) = STATE.get() else { return };
        if std::process::id() != st.pid || !st.active.swap(false, Ordering::AcqRel) {
            return; // a forked child, or never started
        }
        let deadline = Instant::now() + Duration::from_millis(st.cfg.exit_drain_ms);
        if let Some(stop) = st.flush_stop.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = stop.send(());
        }
        if let Some(done) = st.flush_done.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = done.recv_timeout(deadline.saturating_duration_since(Instant::now()));
        }
        if st.cupti.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED).is_err() {
            st.counters.add(Counter::CuptiErrors, 1);
        }
        let (ack_tx, ack_rx) = mpsc::sync_channel(1);
        let mut item = Item::Drain(ack_tx);
        loop {
            match st.tx.try_send(item) {
                Ok(()) => break,
                Err(TrySendError::Full(i)) if Instant::now() < deadline => {
                    item = i;
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(_) => return,
            }
        }
        let drained = ack_rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).is_ok();
        if st.cfg.verbose || !drained {
            let c = &st.counters;
            log(&format!(
                "exit: {} records decoded, {} sent, {} dropped (queue full {}, no agent {}, send error {}), cupti dropped {}{}",
                c.get(Counter::RecordsDecoded),
                c.get(Counter::RecordsSent),
                c.get(Counter::DroppedQueueFull) + c.get(Counter::DroppedNoAgent) + c.get(Counter::DroppedSendError),
                c.get(Counter::DroppedQueueFull),
                c.get(Counter::DroppedNoAgent),
                c.get(Counter::DroppedSendError),
                c.get(Counter::CuptiDropped),
                if drained { "" } else { "; the agent did not take the last records in time" }
            ));
        }
    });
}

const KINDS: [(CUpti_ActivityKind, u32, &str); 5] = [
    // Never KERNEL: it serialises kernels. GRAPH_TRACE (it replaces the per-node
    // kernel records of CUDA graphs, design.md §4) only when asked for
    // (HOPSCOPE_CUPTI_GRAPHS=launch).
    (CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, enabled::KERNEL, "concurrent_kernel"),
    (CUPTI_ACTIVITY_KIND_MEMCPY, enabled::MEMCPY, "memcpy"),
    (CUPTI_ACTIVITY_KIND_MEMCPY2, enabled::MEMCPY_PEER, "memcpy2"),
    (CUPTI_ACTIVITY_KIND_MEMSET, enabled::MEMSET, "memset"),
    (CUPTI_ACTIVITY_KIND_SYNCHRONIZATION, enabled::SYNC, "synchronization"),
];

/// What InitializeInjection returns: 1 when tracing (or deliberately
/// inactive), 0 on failure, which is logged in one line.
pub fn initialize() -> i32 {
    match catch_unwind(start) {
        Ok(Ok(())) => 1,
        Ok(Err(InitError::Again)) => 1,
        Ok(Err(e)) => {
            log(&format!("gpu tracing disabled: {e}"));
            0
        }
        Err(_) => {
            log("gpu tracing disabled: internal error during initialisation");
            0
        }
    }
}

fn start() -> Result<(), InitError> {
    if STARTED.swap(true, Ordering::AcqRel) {
        return Err(InitError::Again);
    }
    let cfg = Config::from_env()?;
    if cfg.socket.is_none() {
        if cfg.verbose {
            log("HOPSCOPE_GPU_SOCKET is not set: inactive");
        }
        return Ok(());
    }
    if cfg.force_init_failure {
        return Err(InitError::Forced);
    }
    let init_mono_ns = mono_now();
    let cupti = crate::locate::find(cfg.cupti_lib.as_deref())?;
    let version = cupti.version()?;
    let mut sizes = StructSizes::for_version(version).ok_or(InitError::TooOld(version))?;
    for (kind, _, _) in KINDS.iter().chain([(CUPTI_ACTIVITY_KIND_RUNTIME, 0, ""), (CUPTI_ACTIVITY_KIND_DRIVER, 0, ""), (CUPTI_ACTIVITY_KIND_GRAPH_TRACE, 0, "")].iter()) {
        if let Some(Ok(n)) = cupti.struct_size(*kind) {
            sizes.set(*kind, n);
        }
    }
    sizes.check()?;
    let source = match cfg.clock {
        ClockChoice::Auto if cclock::timestamp_callback_is_safe(version) => ClockSource::Callback,
        ClockChoice::Auto => ClockSource::Calibrated,
        ClockChoice::Callback => ClockSource::Callback,
        ClockChoice::Calibrate => ClockSource::Calibrated,
    };
    let (tx, rx) = mpsc::sync_channel(1024);
    let (stop_tx, stop_rx) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel();
    let dump = cfg.dump_dir.clone().map(|dir| Dump { dir, written: 0, seq: 0 });
    let st = Injection {
        pool: BufferPool::new(cfg.buffer_bytes, cfg.max_buffers),
        cupti,
        pid: std::process::id(),
        version,
        sizes,
        clock: Clock::new(source),
        init_mono_ns,
        names: Mutex::new(NameTable::default()),
        counters: Counters::new(),
        devices: Mutex::new(Vec::new()),
        enabled: AtomicU32::new(0),
        active: AtomicBool::new(false),
        connected: AtomicBool::new(false),
        queued: AtomicUsize::new(0),
        tx,
        flush_stop: Mutex::new(Some(stop_tx)),
        flush_done: Mutex::new(Some(done_rx)),
        dump: Mutex::new(dump),
        cfg,
    };
    let st: &'static Injection = match STATE.set(st) {
        Ok(()) => STATE.get().ok_or(InitError::Again)?,
        Err(_) => return Err(InitError::Again),
    };
    if source == ClockSource::Callback {
        st.cupti.register_timestamp_callback(monotonic_timestamp)?;
    }
    st.cupti.register_callbacks(buffer_requested, buffer_completed)?;

    let mut bits = 0u32;
    let mut skipped = Vec::new();
    for (kind, bit, name) in KINDS.into_iter().filter(|(kind, _, _)| st.cfg.kinds.wants(*kind)) {
        match st.cupti.enable(kind) {
            Ok(()) => bits |= bit,
            // Without kernel records there is nothing to do.
            Err(e) if kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL => return Err(e.into()),
            Err(e) => skipped.push(format!("{name}: {}", e.name)),
        }
    }
    if st.cfg.graph_launches {
        // Where CUPTI refuses it, graphs stay traced per node (the kernel kind is on).
        match st.cupti.enable(CUPTI_ACTIVITY_KIND_GRAPH_TRACE) {
            Ok(()) => bits |= enabled::GRAPH_LAUNCH,
            Err(e) => skipped.push(format!("graph launches (kernels per node instead): {}", e.name)),
        }
    }
    if st.cfg.api && st.cupti.has_api_filters() {
        for a in apis::TRACED {
            let r = if a.driver { st.cupti.enable_driver_api(a.cbid) } else { st.cupti.enable_runtime_api(a.cbid) };
            if let Some(Ok(())) = r {
                bits |= if a.driver { enabled::API_DRIVER } else { enabled::API_RUNTIME };
            }
        }
    } else if st.cfg.api {
        skipped.push("api records: this libcupti has no per-api filter (12.5+)".into());
    }
    st.enabled.store(bits, Ordering::Release);
    st.active.store(true, Ordering::Release);
    let threads = std::thread::Builder::new()
        .name("hopscope-send".into())
        .spawn(move || sender::run(st, rx))
        .map_err(|source| InitError::Thread { what: "sender", source })
        .and_then(|_| {
            std::thread::Builder::new()
                .name("hopscope-flush".into())
                .spawn(move || flush_loop(st, stop_rx, done_tx))
                .map_err(|source| InitError::Thread { what: "flush", source })
        });
    if let Err(e) = threads {
        st.active.store(false, Ordering::Release);
        for (kind, _, _) in KINDS {
            let _ = st.cupti.disable(kind);
        }
        return Err(e);
    }
    // SAFETY: registering a plain `extern "C" fn()` that never unwinds.
    if unsafe { libc::atexit(at_exit) } != 0 {
        log("cannot register the exit flush: the last records of this process may be lost");
    }
    if st.cfg.verbose || !skipped.is_empty() {
        log(&format!(
            "tracing with {} (cupti {version}, clock {:?}, kinds {bits:#x}){}",
            st.cupti.origin(),
            source,
            if skipped.is_empty() { String::new() } else { format!("; skipped {}", skipped.join(", ")) }
        ));
    }
    Ok(())
}
