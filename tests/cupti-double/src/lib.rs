//! cupti-abi-test-double: a TEST DOUBLE of libcupti's C ABI, for CI without
//! a GPU. It implements the subset of the CUPTI API that libhopscope_cupti
//! calls and delivers synthetic activity records through the injection's
//! real buffer callbacks — requested from the "application" thread, completed
//! from the double's own worker thread, partial buffers on
//! `cuptiActivityFlushAll` — so threading, buffering, clock conversion, drop
//! accounting and transport run end to end in a real process.
//!
//! It is a stand-in for the hardware *boundary* (the ABI), never for a GPU:
//! nothing here says anything about real kernels, real timestamps or real
//! CUPTI behaviour beyond what its headers document. GPU verification is
//! scripts/gpu-check.sh.
//!
//! Records are laid out with the C structs of the emulated CUPTI version
//! (bindgen's `CUpti_ActivityKernel9` … `13` etc.), independently of the
//! decoder's documented offsets. Behaviour is set by environment variables:
//!
//! - `CUPTI_ABI_TEST_DOUBLE_VERSION` (28): what `cuptiGetVersion` returns; picks the structs.
//! - `CUPTI_ABI_TEST_DOUBLE_TRUTH`: file that gets one JSON line per emitted record.
//! - `CUPTI_ABI_TEST_DOUBLE_BAD_EVERY` (0): every Nth record gets garbage
//!   timestamps (cycling zero, reversed, far future, far past).
//! - `CUPTI_ABI_TEST_DOUBLE_FAIL_ENABLE` (0): `cuptiActivityEnable` answers
//!   CUPTI_ERROR_NOT_INITIALIZED, as the real cu12 library does without a GPU.
//!
//! Like real CUPTI 12.6u2–13.0, a registered timestamp callback zeroes
//! kernel timestamps on versions 24…130099 (design.md §4), so a library that
//! registers one there loses its kernels visibly.
//!
//! Control API for the host program: [`cupti_abi_test_double_run`],
//! [`cupti_abi_test_double_wait_delivered`]; and, for an application that
//! plays a GPU's work record by record at CLOCK_MONOTONIC times of its own
//! (the testbed's `--cupti-test-double`, examples/testbed/cupti_double.py):
//! [`cupti_abi_test_double_kernel`], [`cupti_abi_test_double_memcpy`],
//! [`cupti_abi_test_double_sync`], [`cupti_abi_test_double_graph`].

#![allow(non_snake_case, clippy::missing_safety_doc)]

use cupti_sys::*;
use std::collections::BTreeSet;
use std::ffi::{c_char, c_int, CStr, CString};
use std::io::Write;
use std::mem::size_of;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

type Request = unsafe extern "C" fn(*mut *mut u8, *mut usize, *mut usize);
type Complete = unsafe extern "C" fn(CUcontext, u32, *mut u8, usize, usize);
type Timestamp = unsafe extern "C" fn() -> u64;

#[derive(Default)]
struct Registry {
    request: Option<Request>,
    complete: Option<Complete>,
    timestamp: Option<Timestamp>,
    kinds: BTreeSet<u32>,
    runtime_apis: Vec<u32>,
    driver_apis: Vec<u32>,
    forbidden: Vec<u32>,
}

static REG: Mutex<Option<Registry>> = Mutex::new(None);

fn reg<R>(f: impl FnOnce(&mut Registry) -> R) -> R {
    let mut g = REG.lock().unwrap_or_else(|e| e.into_inner());
    f(g.get_or_insert_with(Registry::default))
}

fn env_u64(k: &str, d: u64) -> u64 {
    std::env::var(k).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(d)
}

/// Read once: `cuptiActivityGetNextRecord` asks for every record, inside
/// the library's callback, whose CPU time `cargo xtask bench-injection` counts.
fn version() -> u32 {
    static V: OnceLock<u32> = OnceLock::new();
    *V.get_or_init(|| env_u64("CUPTI_ABI_TEST_DOUBLE_VERSION", 28) as u32)
}

/// The struct sizes the emulated version writes (which struct: see `kernel_bytes` etc.).
fn size_of_kind(kind: u32) -> Option<usize> {
    let v = version();
    Some(match kind {
        CUPTI_ACTIVITY_KIND_KERNEL | CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL => match v {
            0..=129_999 => size_of::<CUpti_ActivityKernel9>(),
            130_000..=130_099 => size_of::<CUpti_ActivityKernel10>(),
            130_100..=130_299 => size_of::<CUpti_ActivityKernel11>(),
            130_300..=130_399 => size_of::<CUpti_ActivityKernel12>(),
            _ => size_of::<CUpti_ActivityKernel13>(),
        },
        CUPTI_ACTIVITY_KIND_MEMCPY => match v {
            0..=25 => size_of::<CUpti_ActivityMemcpy5>(),
            26..=130_399 => size_of::<CUpti_ActivityMemcpy6>(),
            _ => size_of::<CUpti_ActivityMemcpy7>(),
        },
        CUPTI_ACTIVITY_KIND_MEMCPY2 => size_of::<CUpti_ActivityMemcpyPtoP4>(),
        CUPTI_ACTIVITY_KIND_MEMSET => match v {
            0..=130_399 => size_of::<CUpti_ActivityMemset4>(),
            _ => size_of::<CUpti_ActivityMemset5>(),
        },
        CUPTI_ACTIVITY_KIND_SYNCHRONIZATION => match v {
            0..=25 => size_of::<CUpti_ActivitySynchronization>(),
            _ => size_of::<CUpti_ActivitySynchronization2>(),
        },
        CUPTI_ACTIVITY_KIND_RUNTIME | CUPTI_ACTIVITY_KIND_DRIVER => size_of::<CUpti_ActivityAPI>(),
        CUPTI_ACTIVITY_KIND_GRAPH_TRACE => match v {
            0..=25 => size_of::<CUpti_ActivityGraphTrace>(),
            _ => size_of::<CUpti_ActivityGraphTrace2>(),
        },
        _ => return None,
    })
}

fn align8(n: usize) -> usize {
    (n + 7) & !7
}

// ------------------------------------------------------------------ the C ABI

#[no_mangle]
pub unsafe extern "C" fn cuptiGetVersion(v: *mut u32) -> CUptiResult {
    if v.is_null() {
        return CUPTI_ERROR_INVALID_PARAMETER;
    }
    // SAFETY: non-null out-pointer from the caller.
    unsafe { *v = version() };
    CUPTI_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuptiGetResultString(r: CUptiResult, s: *mut *const c_char) -> CUptiResult {
    let name: &'static [u8] = match r {
        CUPTI_SUCCESS => b"CUPTI_SUCCESS\0",
        CUPTI_ERROR_NOT_INITIALIZED => b"CUPTI_ERROR_NOT_INITIALIZED\0",
        CUPTI_ERROR_MAX_LIMIT_REACHED => b"CUPTI_ERROR_MAX_LIMIT_REACHED\0",
        CUPTI_ERROR_NOT_SUPPORTED => b"CUPTI_ERROR_NOT_SUPPORTED\0",
        CUPTI_ERROR_INVALID_PARAMETER => b"CUPTI_ERROR_INVALID_PARAMETER\0",
        _ => b"CUPTI_ERROR_UNKNOWN\0",
    };
    if s.is_null() {
        return CUPTI_ERROR_INVALID_PARAMETER;
    }
    // SAFETY: non-null out-pointer; the string is static.
    unsafe { *s = name.as_ptr().cast() };
    CUPTI_SUCCESS
}

fn clock(id: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: writes one timespec.
    unsafe { libc::clock_gettime(id, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A CLOCK_REALTIME reading and the CLOCK_MONOTONIC instant it was taken at.
/// Two plain reads in a row are not that pair when the thread is preempted
/// between them (a busy VM stalls it for milliseconds), and the test would
/// blame the library's calibration for the double's own error: so the reading
/// is bracketed by two MONOTONIC reads and retaken until the bracket is under
/// 20 µs (the best of 64 tries otherwise), the truth being its midpoint.
fn realtime_with_truth() -> (u64, u64) {
    let mut best = (u64::MAX, 0, 0);
    for _ in 0..64 {
        let a = clock(libc::CLOCK_MONOTONIC);
        let r = clock(libc::CLOCK_REALTIME);
        let b = clock(libc::CLOCK_MONOTONIC);
        let gap = b.saturating_sub(a);
        if gap < best.0 {
            best = (gap, r, a + gap / 2);
        }
        if gap < 20_000 {
            break;
        }
    }
    (best.1, best.2)
}

/// CUPTI's clock: the registered callback, else CLOCK_REALTIME (Linux default).
fn cupti_now() -> u64 {
    match reg(|r| r.timestamp) {
        // SAFETY: the library registered this `extern "C" fn() -> u64`.
        Some(f) => unsafe { f() },
        None => clock(libc::CLOCK_REALTIME),
    }
}

#[no_mangle]
pub unsafe extern "C" fn cuptiGetTimestamp(t: *mut u64) -> CUptiResult {
    if t.is_null() {
        return CUPTI_ERROR_INVALID_PARAMETER;
    }
    // SAFETY: non-null out-pointer.
    unsafe { *t = cupti_now() };
    CUPTI_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuptiActivityRegisterCallbacks(req: Option<Request>, comp: Option<Complete>) -> CUptiResult {
    if req.is_none() || comp.is_none() {
        return CUPTI_ERROR_INVALID_PARAMETER;
    }
    reg(|r| {
        r.request = req;
        r.complete = comp;
    });
    start_worker();
    CUPTI_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuptiActivityRegisterTimestampCallback(f: Option<Timestamp>) -> CUptiResult {
    if f.is_none() {
        return CUPTI_ERROR_INVALID_PARAMETER;
    }
    reg(|r| r.timestamp = f);
    CUPTI_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuptiActivityEnable(kind: CUpti_ActivityKind) -> CUptiResult {
    if env_u64("CUPTI_ABI_TEST_DOUBLE_FAIL_ENABLE", 0) == 1 {
        return CUPTI_ERROR_NOT_INITIALIZED;
    }
    reg(|r| {
        // GRAPH_TRACE hides graph nodes: only when the library was asked for launches.
        if kind == CUPTI_ACTIVITY_KIND_KERNEL || (kind == CUPTI_ACTIVITY_KIND_GRAPH_TRACE && std::env::var_os("HOPSCOPE_CUPTI_GRAPHS").is_none()) {
            r.forbidden.push(kind);
        }
        r.kinds.insert(kind);
    });
    CUPTI_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuptiActivityDisable(kind: CUpti_ActivityKind) -> CUptiResult {
    reg(|r| r.kinds.remove(&kind));
    CUPTI_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuptiActivityEnableRuntimeApi(cbid: CUpti_CallbackId, enable: u8) -> CUptiResult {
    reg(|r| {
        r.runtime_apis.retain(|c| *c != cbid);
        if enable != 0 {
            r.runtime_apis.push(cbid);
        }
    });
    CUPTI_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuptiActivityEnableDriverApi(cbid: CUpti_CallbackId, enable: u8) -> CUptiResult {
    reg(|r| {
        r.driver_apis.retain(|c| *c != cbid);
        if enable != 0 {
            r.driver_apis.push(cbid);
        }
    });
    CUPTI_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuptiActivityGetStructSize(kind: CUpti_ActivityKind, v: u32, size: *mut usize) -> CUptiResult {
    // The real API exists from 13.0 and only answers for versions >= 130000.
    if version() < 130_000 || (v != 0 && v < 130_000) {
        return CUPTI_ERROR_NOT_SUPPORTED;
    }
    let Some(n) = size_of_kind(kind) else { return CUPTI_ERROR_INVALID_KIND };
    if size.is_null() {
        return CUPTI_ERROR_INVALID_PARAMETER;
    }
    // SAFETY: non-null out-pointer.
    unsafe { *size = n };
    CUPTI_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuptiActivityGetNextRecord(buffer: *mut u8, valid: usize, record: *mut *mut CUpti_Activity) -> CUptiResult {
    if buffer.is_null() || record.is_null() {
        return CUPTI_ERROR_INVALID_PARAMETER;
    }
    // SAFETY: `record` is a valid in/out pointer; `*record` is null or a
    // record we returned from this same buffer, whose first 4 bytes are its kind.
    unsafe {
        let next = if (*record).is_null() {
            0
        } else {
            let at = (*record) as usize - buffer as usize;
            let kind = std::ptr::read_unaligned((*record) as *const u32);
            at + align8(size_of_kind(kind).unwrap_or(8))
        };
        if next + 4 > valid {
            return CUPTI_ERROR_MAX_LIMIT_REACHED;
        }
        *record = buffer.add(next).cast();
    }
    CUPTI_SUCCESS
}

static DROPPED_SINCE: AtomicU64 = AtomicU64::new(0);

#[no_mangle]
pub unsafe extern "C" fn cuptiActivityGetNumDroppedRecords(_ctx: CUcontext, _stream: u32, dropped: *mut usize) -> CUptiResult {
    if dropped.is_null() {
        return CUPTI_ERROR_INVALID_PARAMETER;
    }
    // Reset on read, as documented.
    // SAFETY: non-null out-pointer.
    unsafe { *dropped = DROPPED_SINCE.swap(0, Ordering::AcqRel) as usize };
    CUPTI_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn cuptiActivityFlushAll(_flag: u32) -> CUptiResult {
    let w = worker();
    // Completed buffers first (waits for the worker), then the partial one,
    // delivered on the calling thread. It counts as pending while in flight,
    // so `wait_delivered` means "the library has seen every record".
    w.wait_idle(Duration::from_secs(10));
    let partial = {
        let mut cur = CUR.lock().unwrap_or_else(|e| e.into_inner());
        if cur.as_ref().is_some_and(|c| c.used > 0) {
            *w.pending.lock().unwrap_or_else(|e| e.into_inner()) += 1;
            cur.take()
        } else {
            None
        }
    };
    if let Some(c) = partial {
        deliver(c, false);
        let mut p = w.pending.lock().unwrap_or_else(|e| e.into_inner());
        *p -= 1;
        w.idle.notify_all();
    }
    CUPTI_SUCCESS
}

// ------------------------------------------------------------------ buffers

struct Cur {
    ptr: usize,
    size: usize,
    used: usize,
    records: u64,
}

static CUR: Mutex<Option<Cur>> = Mutex::new(None);

#[derive(Default)]
struct Stats {
    requests: u64,
    completes: u64,
    max_request_ns: u64,
    max_complete_ns: u64,
    delivered: u64,
    no_buffer: u64,
    /// Wall time in the library's buffer-requested callback (the
    /// application's thread, as with CUPTI), summed.
    request_ns: u64,
    /// CPU time of the calling thread inside the buffer-completed callback,
    /// summed: the library's decoding, checking and encoding
    /// (`cargo xtask bench-injection`). `_worker`: the part on this
    /// double's worker thread (the rest ran on whoever flushed).
    complete_cpu_ns: u64,
    complete_cpu_ns_worker: u64,
}

struct Worker {
    tx: Mutex<mpsc::Sender<Cur>>,
    pending: Mutex<u64>,
    idle: Condvar,
}

static WORKER: OnceLock<Worker> = OnceLock::new();
static STATS: Mutex<Stats> = Mutex::new(Stats {
    requests: 0,
    completes: 0,
    max_request_ns: 0,
    max_complete_ns: 0,
    delivered: 0,
    no_buffer: 0,
    request_ns: 0,
    complete_cpu_ns: 0,
    complete_cpu_ns_worker: 0,
});

/// CPU time of the calling thread, ns.
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; the clock always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn stats<R>(f: impl FnOnce(&mut Stats) -> R) -> R {
    f(&mut STATS.lock().unwrap_or_else(|e| e.into_inner()))
}

impl Worker {
    fn wait_idle(&self, timeout: Duration) -> bool {
        let g = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let (g, _) = self.idle.wait_timeout_while(g, timeout, |p| *p > 0).unwrap_or_else(|e| e.into_inner());
        *g == 0
    }
}

fn start_worker() {
    worker();
}

fn worker() -> &'static Worker {
    WORKER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Cur>();
        std::thread::Builder::new()
            .name("cupti-double-worker".into())
            .spawn(move || {
                while let Ok(c) = rx.recv() {
                    deliver(c, true);
                    let w = worker();
                    let mut p = w.pending.lock().unwrap_or_else(|e| e.into_inner());
                    *p -= 1;
                    w.idle.notify_all();
                }
            })
            .expect("cupti double worker thread");
        Worker { tx: Mutex::new(tx), pending: Mutex::new(0), idle: Condvar::new() }
    })
}

/// Calls the library's buffer-completed callback, timing it (wall and the
/// thread's CPU).
fn deliver(c: Cur, on_worker: bool) {
    let Some(complete) = reg(|r| r.complete) else { return };
    let (t, cpu) = (Instant::now(), thread_cpu_ns());
    // SAFETY: the buffer was handed to us by the library's request callback
    // with `size` bytes; `used` of them hold records.
    unsafe { complete(std::ptr::null_mut(), 0, c.ptr as *mut u8, c.size, c.used) };
    let (ns, cpu) = (t.elapsed().as_nanos() as u64, thread_cpu_ns().saturating_sub(cpu));
    stats(|s| {
        s.completes += 1;
        s.max_complete_ns = s.max_complete_ns.max(ns);
        s.delivered += c.records;
        s.complete_cpu_ns += cpu;
        if on_worker {
            s.complete_cpu_ns_worker += cpu;
        }
    });
}

fn complete_async(c: Cur) {
    let w = worker();
    *w.pending.lock().unwrap_or_else(|e| e.into_inner()) += 1;
    let _ = w.tx.lock().unwrap_or_else(|e| e.into_inner()).send(c);
}

/// Places one record, asking the library for a buffer when needed (on the
/// calling thread, as CUPTI does). False when no buffer was given: the record
/// is dropped and counted for `cuptiActivityGetNumDroppedRecords`.
fn place(rec: &[u8]) -> bool {
    let need = align8(rec.len());
    let mut cur = CUR.lock().unwrap_or_else(|e| e.into_inner());
    if cur.as_ref().is_some_and(|c| c.used + need > c.size) {
        if let Some(full) = cur.take() {
            complete_async(full);
        }
    }
    if cur.is_none() {
        let Some(request) = reg(|r| r.request) else {
            DROPPED_SINCE.fetch_add(1, Ordering::AcqRel);
            stats(|s| s.no_buffer += 1);
            return false;
        };
        let (mut p, mut size, mut max) = (std::ptr::null_mut::<u8>(), 0usize, 0usize);
        let t = Instant::now();
        // SAFETY: valid out-pointers to our locals.
        unsafe { request(&mut p, &mut size, &mut max) };
        let ns = t.elapsed().as_nanos() as u64;
        stats(|s| {
            s.requests += 1;
            s.max_request_ns = s.max_request_ns.max(ns);
            s.request_ns += ns;
        });
        if p.is_null() || size < need || !(p as usize).is_multiple_of(8) {
            DROPPED_SINCE.fetch_add(1, Ordering::AcqRel);
            stats(|s| s.no_buffer += 1);
            return false;
        }
        *cur = Some(Cur { ptr: p as usize, size, used: 0, records: 0 });
    }
    let c = cur.as_mut().expect("a buffer is current");
    // SAFETY: [ptr+used, ptr+used+len) lies inside the `size`-byte buffer
    // the library gave us (checked above), and nothing else writes to it.
    unsafe { std::ptr::copy_nonoverlapping(rec.as_ptr(), (c.ptr + c.used) as *mut u8, rec.len()) };
    c.used += need;
    c.records += 1;
    true
}

// ------------------------------------------------------------------ records

/// Kernel names (one very long, one not UTF-8, one absent) with their
/// JSON form for the truth file, escaped once.
fn names() -> &'static [(Option<CString>, String)] {
    static N: OnceLock<Vec<(Option<CString>, String)>> = OnceLock::new();
    N.get_or_init(|| {
        let raw = vec![
            Some(CString::new("_Z13gemm_bf16_128PKfS0_Pf").unwrap()),
            Some(CString::new("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64, 64, 4>, true>(Flash_fwd_params)").unwrap()),
            Some(CString::new("reshape_and_cache_flash_kernel").unwrap()),
            Some(CString::new("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn").unwrap()),
            Some(CString::new("k".repeat(70_000)).unwrap()),
            Some(CString::new(b"bad\xffname".to_vec()).unwrap()),
            None,
        ];
        raw.into_iter()
            .map(|n| {
                let j = n.as_ref().map(|c| json_str(&String::from_utf8_lossy(c.as_bytes()))).unwrap_or("null".into());
                (n, j)
            })
            .collect()
    })
}

fn bytes_of<T>(v: &T) -> Vec<u8> {
    // SAFETY: T is a plain-data CUPTI record struct (integers, pointers,
    // unions of integers), fully initialised by `zeroed` + field writes.
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), size_of::<T>()) }.to_vec()
}

fn zeroed<T>() -> T {
    // SAFETY: all-zero is a valid value for CUPTI's plain-data record structs.
    unsafe { std::mem::zeroed() }
}

struct KernelFields {
    start: u64,
    end: u64,
    stream: u32,
    corr: u32,
    grid: [i32; 3],
    block: [i32; 3],
    static_smem: i32,
    dyn_smem: i32,
    regs: u16,
    name: *const c_char,
    graph_id: u32,
    graph_node_id: u64,
    grid_id: i64,
}

macro_rules! kernel_as {
    ($t:ty, $f:expr) => {{
        let f = $f;
        let mut r: $t = zeroed();
        r.kind = CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
        r.start = f.start;
        r.end = f.end;
        r.completed = f.end;
        r.deviceId = 0;
        r.contextId = 1;
        r.streamId = f.stream;
        r.gridX = f.grid[0];
        r.gridY = f.grid[1];
        r.gridZ = f.grid[2];
        r.blockX = f.block[0];
        r.blockY = f.block[1];
        r.blockZ = f.block[2];
        r.staticSharedMemory = f.static_smem;
        r.dynamicSharedMemory = f.dyn_smem;
        r.registersPerThread = f.regs;
        r.correlationId = f.corr;
        r.gridId = f.grid_id;
        r.name = f.name;
        r.launchType = 0;
        r.graphNodeId = f.graph_node_id;
        r.graphId = f.graph_id;
        bytes_of(&r)
    }};
}

fn kernel_bytes(f: &KernelFields) -> Vec<u8> {
    match version() {
        0..=129_999 => kernel_as!(CUpti_ActivityKernel9, f),
        130_000..=130_099 => kernel_as!(CUpti_ActivityKernel10, f),
        130_100..=130_299 => kernel_as!(CUpti_ActivityKernel11, f),
        130_300..=130_399 => kernel_as!(CUpti_ActivityKernel12, f),
        _ => kernel_as!(CUpti_ActivityKernel13, f),
    }
}

/// Where copy `i` lands: pinned host memory every other group of eight
/// records, else a CUDA array. The small pinned ones (4–16 KiB) are shaped
/// like vLLM's sampled-ids copy, and the group's stream synchronize (slot 6,
/// same stream, a few µs later) waits for them: the agent finds GPU steps in
/// the double's records as in a real model runner's.
fn dst_kind(i: u64) -> u8 {
    if (i / 8).is_multiple_of(2) {
        2
    } else {
        4
    }
}

/// One copy record's fields, whatever the version's struct.
struct CopyFields {
    copy_kind: u8,
    src_kind: u8,
    dst_kind: u8,
    bytes: u64,
    start: u64,
    end: u64,
    stream: u32,
    corr: u32,
}

macro_rules! memcpy_as {
    ($t:ty, $f:expr) => {{
        let f = $f;
        let mut r: $t = zeroed();
        r.kind = CUPTI_ACTIVITY_KIND_MEMCPY;
        r.copyKind = f.copy_kind;
        r.srcKind = f.src_kind;
        r.dstKind = f.dst_kind;
        r.flags = 1;
        r.bytes = f.bytes;
        r.start = f.start;
        r.end = f.end;
        r.deviceId = 0;
        r.contextId = 1;
        r.streamId = f.stream;
        r.correlationId = f.corr;
        r.runtimeCorrelationId = f.corr + 1_000_000;
        r.graphNodeId = 0;
        r.graphId = 0;
        bytes_of(&r)
    }};
}

fn memcpy_bytes(f: &CopyFields) -> Vec<u8> {
    match version() {
        0..=25 => memcpy_as!(CUpti_ActivityMemcpy5, f),
        26..=130_399 => memcpy_as!(CUpti_ActivityMemcpy6, f),
        _ => memcpy_as!(CUpti_ActivityMemcpy7, f),
    }
}

macro_rules! memset_as {
    ($t:ty, $start:expr, $end:expr, $i:expr) => {{
        let mut r: $t = zeroed();
        r.kind = CUPTI_ACTIVITY_KIND_MEMSET;
        r.value = ($i % 256) as u32;
        r.bytes = 512;
        r.start = $start;
        r.end = $end;
        r.deviceId = 0;
        r.contextId = 1;
        r.streamId = 8;
        r.correlationId = ($i + 1) as u32;
        r.flags = 1;
        r.memoryKind = 4;
        r.graphNodeId = 3 * $i;
        r.graphId = 2;
        bytes_of(&r)
    }};
}

/// One synchronization record's fields, whatever the version's struct.
struct SyncFields {
    sync_type: u32,
    start: u64,
    end: u64,
    stream: u32,
    corr: u32,
    event: u32,
}

macro_rules! sync_as {
    ($t:ty, $f:expr) => {{
        let f = $f;
        let mut r: $t = zeroed();
        r.kind = CUPTI_ACTIVITY_KIND_SYNCHRONIZATION;
        r.type_ = f.sync_type;
        r.start = f.start;
        r.end = f.end;
        r.correlationId = f.corr;
        r.contextId = 1;
        r.streamId = f.stream;
        r.cudaEventId = f.event;
        bytes_of(&r)
    }};
}

fn sync_bytes(f: &SyncFields) -> Vec<u8> {
    match version() {
        0..=25 => sync_as!(CUpti_ActivitySynchronization, f),
        _ => sync_as!(CUpti_ActivitySynchronization2, f),
    }
}

/// A graph launch as GRAPH_TRACE gives it, in the emulated version's layout.
fn graph_bytes(corr: u32, start: u64, end: u64, graph_id: u32, stream: u32) -> Vec<u8> {
    let mut r: CUpti_ActivityGraphTrace2 = zeroed();
    r.kind = CUPTI_ACTIVITY_KIND_GRAPH_TRACE;
    r.correlationId = corr;
    r.start = start;
    r.end = end;
    r.deviceId = 0;
    r.graphId = graph_id;
    r.contextId = 1;
    r.streamId = stream;
    let mut b = bytes_of(&r);
    // GraphTrace (12.4–12.6) is GraphTrace2's first 48 bytes.
    b.truncate(size_of_kind(CUPTI_ACTIVITY_KIND_GRAPH_TRACE).unwrap_or(b.len()));
    b
}

/// What one synthetic record is, for the truth file.
struct Truth {
    line: String,
}

fn json_str(s: &str) -> String {
    let mut o = String::from("\"");
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

static NEXT: AtomicU64 = AtomicU64::new(0);

/// What the library enabled, read once per run.
struct Snap {
    kinds: BTreeSet<u32>,
    apis: Vec<(bool, u32)>,
    timestamp: Option<Timestamp>,
}

fn snap() -> Snap {
    reg(|r| Snap {
        kinds: r.kinds.clone(),
        apis: r.runtime_apis.iter().map(|c| (false, *c)).chain(r.driver_apis.iter().map(|c| (true, *c))).collect(),
        timestamp: r.timestamp,
    })
}

/// Makes record `i`: its bytes (or None when its kind is not enabled) and truth.
fn make(i: u64, bad_every: u64, sn: &Snap) -> Option<(Vec<u8>, Truth)> {
    let kinds = &sn.kinds;
    let ts_cb = sn.timestamp.is_some();
    let slot = i % 8;
    let kind = match slot {
        0..=2 => CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
        3 => CUPTI_ACTIVITY_KIND_MEMCPY,
        4 => CUPTI_ACTIVITY_KIND_MEMCPY2,
        5 => CUPTI_ACTIVITY_KIND_MEMSET,
        6 => CUPTI_ACTIVITY_KIND_SYNCHRONIZATION,
        _ if !sn.apis.is_empty() => CUPTI_ACTIVITY_KIND_RUNTIME,
        _ => return None,
    };
    if kind != CUPTI_ACTIVITY_KIND_RUNTIME && !kinds.contains(&kind) {
        return None;
    }
    // Timestamps: CUPTI's clock for the record, CLOCK_MONOTONIC for the truth.
    let (raw0, mono0) = if let Some(f) = sn.timestamp {
        // SAFETY: the library registered this `extern "C" fn() -> u64`.
        let t = unsafe { f() };
        (t, t)
    } else {
        realtime_with_truth()
    };
    let d = 1_000 + (i % 97) * 10;
    let (mut rs, mut re) = (raw0, raw0 + d);
    let bad = if bad_every > 0 && i % bad_every == bad_every - 1 {
        const DAYS10: u64 = 10 * 86_400 * 1_000_000_000;
        match (i / bad_every) % 4 {
            0 => {
                rs = 0;
                Some("zero")
            }
            1 => {
                re = rs - 1;
                Some("reversed")
            }
            2 => {
                re = rs + DAYS10;
                Some("future")
            }
            _ => {
                rs = rs.saturating_sub(DAYS10).max(1);
                re = rs + d;
                Some("past")
            }
        }
    } else {
        None
    };
    let v = version();
    // The 12.6u2–13.0 bug: a registered timestamp callback zeroes kernel timestamps.
    let zeroed_by_bug = ts_cb && (24..130_100).contains(&v) && kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
    if zeroed_by_bug {
        rs = 0;
        re = 0;
    }
    let corr = (i + 1) as u32;
    let common = format!(
        "\"i\":{i},\"corr\":{corr},\"bad\":{},\"start\":{mono0},\"end\":{},\"raw_start\":{rs},\"raw_end\":{re}",
        match (bad, zeroed_by_bug) {
            (_, true) => "\"zero\"".to_string(),
            (Some(b), _) => format!("\"{b}\""),
            (None, _) => "null".into(),
        },
        mono0 + d
    );
    // With GRAPH_TRACE on, CUPTI gives a graph's launch as one record and none
    // of its nodes' kernels: here, the kernels that would have had a graph id.
    let graph_id = if i.is_multiple_of(5) { 1 + (i % 3) as u32 } else { 0 };
    let (bytes, extra) = match kind {
        CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL if graph_id != 0 && kinds.contains(&CUPTI_ACTIVITY_KIND_GRAPH_TRACE) => {
            let stream = 7 + (i % 3) as u32;
            (graph_bytes(corr, rs, re, graph_id, stream), format!("\"kind\":\"graph\",\"stream\":{stream},\"graph_id\":{graph_id}"))
        }
        CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL => {
            let (n, name) = &names()[(i as usize / 3) % names().len()];
            let f = KernelFields {
                start: rs,
                end: re,
                stream: 7 + (i % 3) as u32,
                corr,
                grid: [(i % 1000) as i32 + 1, 2, 1],
                block: [128, 1, 1],
                static_smem: 256,
                dyn_smem: (i % 4) as i32 * 1024,
                regs: 32 + (i % 64) as u16,
                name: n.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
                graph_id,
                graph_node_id: if i.is_multiple_of(5) { 1000 + i } else { 0 },
                grid_id: i as i64,
            };
            (
                kernel_bytes(&f),
                format!(
                    "\"kind\":\"kernel\",\"stream\":{},\"grid\":[{},{},{}],\"block\":[{},{},{}],\"static_smem\":{},\"dyn_smem\":{},\"regs\":{},\"graph_id\":{},\"graph_node_id\":{},\"grid_id\":{},\"name\":{name}",
                    f.stream, f.grid[0], f.grid[1], f.grid[2], f.block[0], f.block[1], f.block[2], f.static_smem, f.dyn_smem, f.regs, f.graph_id, f.graph_node_id, f.grid_id
                ),
            )
        }
        CUPTI_ACTIVITY_KIND_MEMCPY => (
            memcpy_bytes(&CopyFields {
                copy_kind: 1 + (i % 2) as u8,
                src_kind: 3,
                dst_kind: dst_kind(i),
                bytes: 4096 * (i % 7 + 1),
                start: rs,
                end: re,
                stream: 7,
                corr,
            }),
            format!(
                "\"kind\":\"memcpy\",\"copy_kind\":{},\"dst_kind\":{},\"bytes\":{},\"runtime_corr\":{}",
                1 + i % 2,
                dst_kind(i),
                4096 * (i % 7 + 1),
                corr + 1_000_000
            ),
        ),
        CUPTI_ACTIVITY_KIND_MEMCPY2 => {
            let mut r: CUpti_ActivityMemcpyPtoP4 = zeroed();
            r.kind = CUPTI_ACTIVITY_KIND_MEMCPY2;
            r.copyKind = 10;
            r.srcKind = 4;
            r.dstKind = 4;
            r.bytes = 1 << 20;
            r.start = rs;
            r.end = re;
            r.deviceId = 0;
            r.contextId = 1;
            r.streamId = 9;
            r.srcDeviceId = 0;
            r.srcContextId = 1;
            r.dstDeviceId = 1;
            r.dstContextId = 2;
            r.correlationId = corr;
            (bytes_of(&r), "\"kind\":\"memcpy_peer\",\"bytes\":1048576".to_string())
        }
        CUPTI_ACTIVITY_KIND_MEMSET => (
            match v {
                0..=130_399 => memset_as!(CUpti_ActivityMemset4, rs, re, i),
                _ => memset_as!(CUpti_ActivityMemset5, rs, re, i),
            },
            format!("\"kind\":\"memset\",\"value\":{},\"graph_node_id\":{}", i % 256, 3 * i),
        ),
        CUPTI_ACTIVITY_KIND_SYNCHRONIZATION => (
            sync_bytes(&SyncFields {
                sync_type: 1 + (i % 4) as u32,
                start: rs,
                end: re,
                stream: 7,
                corr,
                event: if i.is_multiple_of(2) { u32::MAX } else { (i % 10) as u32 },
            }),
            format!("\"kind\":\"sync\",\"sync_type\":{}", 1 + i % 4),
        ),
        _ => {
            let (driver, cbid) = sn.apis[(i / 8) as usize % sn.apis.len()];
            let mut r: CUpti_ActivityAPI = zeroed();
            r.kind = if driver { CUPTI_ACTIVITY_KIND_DRIVER } else { CUPTI_ACTIVITY_KIND_RUNTIME };
            r.cbid = cbid;
            r.start = rs;
            r.end = re;
            r.processId = std::process::id();
            // SAFETY: gettid has no preconditions.
            r.threadId = unsafe { libc::gettid() } as u32;
            r.correlationId = corr;
            r.returnValue = 0;
            (bytes_of(&r), format!("\"kind\":\"api\",\"driver\":{driver},\"cbid\":{cbid}"))
        }
    };
    Some((bytes, Truth { line: format!("{{{common},{extra}}}") }))
}

/// Emits `n` synthetic records from the calling thread ("the application")
/// and writes a JSON summary into `out` (NUL-terminated, at most `cap` bytes).
/// Returns the number of records placed in buffers.
#[no_mangle]
pub unsafe extern "C" fn cupti_abi_test_double_run(n: u64, out: *mut c_char, cap: usize) -> i64 {
    let bad_every = env_u64("CUPTI_ABI_TEST_DOUBLE_BAD_EVERY", 0);
    let mut truth = Vec::with_capacity(n as usize);
    let (mut placed, mut skipped) = (0i64, 0u64);
    let t = Instant::now();
    let sn = snap();
    for _ in 0..n {
        let i = NEXT.fetch_add(1, Ordering::AcqRel);
        match make(i, bad_every, &sn) {
            Some((rec, tr)) => {
                if place(&rec) {
                    placed += 1;
                    truth.push(tr.line);
                }
            }
            None => skipped += 1,
        }
    }
    let elapsed = t.elapsed().as_nanos();
    if let Ok(path) = std::env::var("CUPTI_ABI_TEST_DOUBLE_TRUTH") {
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
            for l in &truth {
                let _ = writeln!(f, "{l}");
            }
        }
    }
    let summary = summary(placed, skipped, elapsed);
    if !out.is_null() && cap > 0 {
        let b = summary.as_bytes();
        let k = b.len().min(cap - 1);
        // SAFETY: the caller gives `cap` writable bytes at `out`.
        unsafe {
            std::ptr::copy_nonoverlapping(b.as_ptr().cast::<c_char>(), out, k);
            *out.add(k) = 0;
        }
    }
    placed
}

fn summary(placed: i64, skipped: u64, elapsed_ns: u128) -> String {
    let (kinds, rt, drv, forbidden, ts_cb) =
        reg(|r| (r.kinds.clone(), r.runtime_apis.len(), r.driver_apis.len(), r.forbidden.clone(), r.timestamp.is_some()));
    stats(|s| {
        format!(
            "{{\"placed\":{placed},\"skipped\":{skipped},\"elapsed_ns\":{elapsed_ns},\"requests\":{},\"completes\":{},\"max_request_ns\":{},\"max_complete_ns\":{},\"request_ns\":{},\"complete_cpu_ns\":{},\"complete_cpu_ns_worker\":{},\"delivered\":{},\"no_buffer\":{},\"kinds\":[{}],\"runtime_apis\":{rt},\"driver_apis\":{drv},\"forbidden\":{:?},\"timestamp_callback\":{ts_cb},\"version\":{}}}",
            s.requests,
            s.completes,
            s.max_request_ns,
            s.max_complete_ns,
            s.request_ns,
            s.complete_cpu_ns,
            s.complete_cpu_ns_worker,
            s.delivered,
            s.no_buffer,
            kinds.iter().map(|k| k.to_string()).collect::<Vec<_>>().join(","),
            forbidden,
            version()
        )
    })
}

/// Waits until every placed record has been handed to the library (full
/// buffers by the worker; the partial one needs the library to flush).
/// Returns 1 when done, 0 on timeout.
#[no_mangle]
pub extern "C" fn cupti_abi_test_double_wait_delivered(timeout_ms: u64) -> c_int {
    let deadline = Instant::now() + Duration::from_millis(timeout_ms);
    while Instant::now() < deadline {
        let partial = CUR.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_some_and(|c| c.used > 0);
        let pending = WORKER.get().map_or(0, |w| *w.pending.lock().unwrap_or_else(|e| e.into_inner()));
        if !partial && pending == 0 {
            return 1;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    0
}

// ------------------------------------------------------------------ records one at a time
//
// For an application that plays a GPU's work on the CPU (the testbed's
// `--cupti-test-double`: each engine step's kernels, copies and synchronize
// at the times its CPU work took), one record per call, placed from the
// calling thread as CUPTI does. Times are CLOCK_MONOTONIC ns; the record
// carries them on CUPTI's clock (the library's callback's, else
// CLOCK_REALTIME), so the library's clock conversion runs as with the
// synthetic records. Each call returns 1 (placed), 0 (its kind is not
// enabled, or it is a graph node while GRAPH_TRACE is on: CUPTI would not
// emit it) or -1 (no buffer: dropped and counted, as CUPTI does).

/// CLOCK_MONOTONIC `mono` on the clock records carry.
fn raw_of_mono(mono: u64, sn: &Snap) -> u64 {
    if sn.timestamp.is_some() {
        return mono;
    }
    let (real, real_mono) = realtime_with_truth();
    (real as i128 + mono as i128 - real_mono as i128).max(1) as u64
}

fn next_corr() -> u32 {
    (NEXT.fetch_add(1, Ordering::AcqRel) + 1) as u32
}

fn placed(rec: &[u8]) -> c_int {
    if place(rec) {
        1
    } else {
        -1
    }
}

/// Kernel names live as long as the process, as CUPTI's do (the library
/// keys names by their address).
fn interned(name: &CStr) -> *const c_char {
    static NAMES: Mutex<Vec<&'static CStr>> = Mutex::new(Vec::new());
    let mut v = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(n) = v.iter().find(|n| **n == name) {
        return n.as_ptr();
    }
    let n: &'static CStr = Box::leak(name.to_owned().into_boxed_c_str());
    v.push(n);
    n.as_ptr()
}

/// A kernel named `name` (C string) from `start` to `end`, grid
/// (`grid_x`,1,1), block (128,1,1), on `stream`; `graph_id` ≠ 0 makes it
/// node `graph_node_id` of that graph.
#[no_mangle]
pub unsafe extern "C" fn cupti_abi_test_double_kernel(
    name: *const c_char,
    start: u64,
    end: u64,
    grid_x: u32,
    stream: u32,
    graph_id: u32,
    graph_node_id: u64,
) -> c_int {
    let sn = snap();
    if !sn.kinds.contains(&CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) || graph_id != 0 && sn.kinds.contains(&CUPTI_ACTIVITY_KIND_GRAPH_TRACE) {
        return 0;
    }
    let name = if name.is_null() {
        std::ptr::null()
    } else {
        // SAFETY: the caller passes a NUL-terminated string.
        interned(unsafe { CStr::from_ptr(name) })
    };
    let corr = next_corr();
    let f = KernelFields {
        start: raw_of_mono(start, &sn),
        end: raw_of_mono(end, &sn),
        stream,
        corr,
        grid: [grid_x.min(i32::MAX as u32) as i32, 1, 1],
        block: [128, 1, 1],
        static_smem: 0,
        dyn_smem: 0,
        regs: 32,
        name,
        graph_id,
        graph_node_id: if graph_id == 0 { 0 } else { graph_node_id },
        grid_id: corr as i64,
    };
    placed(&kernel_bytes(&f))
}

/// A copy of `bytes` between pinned host memory and the device:
/// `copy_kind` 1 (host to device) or 2 (device to host).
#[no_mangle]
pub extern "C" fn cupti_abi_test_double_memcpy(copy_kind: u8, bytes: u64, start: u64, end: u64, stream: u32) -> c_int {
    let sn = snap();
    if !sn.kinds.contains(&CUPTI_ACTIVITY_KIND_MEMCPY) {
        return 0;
    }
    const PINNED: u8 = 2;
    const DEVICE: u8 = 3;
    let (src_kind, dst_kind) = if copy_kind == 1 { (PINNED, DEVICE) } else { (DEVICE, PINNED) };
    let f = CopyFields { copy_kind, src_kind, dst_kind, bytes, start: raw_of_mono(start, &sn), end: raw_of_mono(end, &sn), stream, corr: next_corr() };
    placed(&memcpy_bytes(&f))
}

/// The host waiting: `sync_type` 1 (event synchronize), 3 (stream) or 4 (context).
#[no_mangle]
pub extern "C" fn cupti_abi_test_double_sync(sync_type: u32, start: u64, end: u64, stream: u32) -> c_int {
    let sn = snap();
    if !sn.kinds.contains(&CUPTI_ACTIVITY_KIND_SYNCHRONIZATION) {
        return 0;
    }
    let f = SyncFields {
        sync_type,
        start: raw_of_mono(start, &sn),
        end: raw_of_mono(end, &sn),
        stream,
        corr: next_corr(),
        event: if sync_type == 1 { 1 } else { u32::MAX },
    };
    placed(&sync_bytes(&f))
}

/// A launch of graph `graph_id` as GRAPH_TRACE gives it: placed only when
/// that kind is on (then the graph's node kernels are not).
#[no_mangle]
pub extern "C" fn cupti_abi_test_double_graph(graph_id: u32, start: u64, end: u64, stream: u32) -> c_int {
    let sn = snap();
    if !sn.kinds.contains(&CUPTI_ACTIVITY_KIND_GRAPH_TRACE) {
        return 0;
    }
    placed(&graph_bytes(next_corr(), raw_of_mono(start, &sn), raw_of_mono(end, &sn), graph_id, stream))
}
