//! nvml-test-double: a TEST DOUBLE of libnvidia-ml's C ABI, for CI without a
//! GPU. It implements only the functions hopscope's NVML sampler
//! (`agent/src/source/nvml.rs`, through nvml-wrapper) calls, and answers them
//! with scripted values, so the sampler's thread, period, pid filtering,
//! recording and report path run end to end in the real binary
//! (`hopscope record --nvml-lib …` or `HOPSCOPE_NVML_LIB`).
//!
//! It is a stand-in for the driver *boundary* (the ABI, with the C struct
//! layouts of nvml.h), never for a GPU: nothing here says anything about real
//! memory, utilisation or throughput figures. The real NVML path is checked by
//! scripts/gpu-check.sh on a GPU machine.
//!
//! `NVML_TEST_DOUBLE_SCRIPT` names a text file (without it, `nvmlInit_v2`
//! answers NVML_ERROR_DRIVER_NOT_LOADED). One directive per line, `#` starts
//! a comment:
//!
//! ```text
//! driver 555.42.02
//! device total=150000000000 used=1000000 used_step=4096 sm=37 mem=12 pcie_tx=1234 pcie_rx=5678
//! device total=80000000000 used=5 pcie=unsupported
//! device total=80000000000 used=5 nvlink_tx=300 nvlink_rx=100
//! proc 0 4242 1000000 4096     # device, pid, bytes on the first read, added per read
//! ```
//!
//! Memory values grow by their step on every read of that device (the Nth
//! `nvmlDeviceGetMemoryInfo_v2` answers `used + N * used_step`, the Nth
//! process list `bytes + N * step`), so a test can tell samples apart and
//! recompute each one.
//!
//! GPM (Hopper's GPU performance monitoring, where NVML gives NVLink
//! throughput summed over links): a device with `nvlink_tx`/`nvlink_rx` (MiB/s)
//! supports it, one without does not (`nvmlGpmQueryDeviceSupport` says so, as
//! on GPUs before Hopper). `nvmlGpmMetricsGet` answers `rate × (n2 − n1)` for
//! samples that were the device's n1-th and n2-th `nvmlGpmSampleGet`, so only
//! consecutive samples in order give the scripted rate; samples of two
//! devices, a sample never filled, or samples out of order are
//! `NVML_ERROR_INVALID_ARGUMENT`. Samples still allocated at `nvmlShutdown`
//! are printed to stderr (a leak). `gpm_fail_after=N`: the device's
//! `nvmlGpmSampleGet` answers `NVML_ERROR_IN_USE` after its first N samples
//! (as when another profiler holds the counters). `gpm_unit=B/sec`: the unit
//! the metrics name (nvml.h's `MiB/sec` without it).

#![allow(non_snake_case)]

use std::ffi::{c_char, c_uint, c_void};
use std::sync::{Mutex, OnceLock};

type NvmlReturn = c_uint;
const SUCCESS: NvmlReturn = 0;
const ERROR_UNINITIALIZED: NvmlReturn = 1;
const ERROR_INVALID_ARGUMENT: NvmlReturn = 2;
const ERROR_NOT_SUPPORTED: NvmlReturn = 3;
const ERROR_INSUFFICIENT_SIZE: NvmlReturn = 7;
const ERROR_DRIVER_NOT_LOADED: NvmlReturn = 9;
const ERROR_IN_USE: NvmlReturn = 19;
const ERROR_ARGUMENT_VERSION_MISMATCH: NvmlReturn = 25;

/// nvml.h `nvmlMemory_v2_t`.
#[repr(C)]
pub struct Memory2 {
    version: c_uint,
    total: u64,
    reserved: u64,
    free: u64,
    used: u64,
}

/// nvml.h `nvmlProcessInfo_t` (the v2 struct, which the `_v3` call fills).
#[repr(C)]
pub struct ProcessInfo {
    pid: c_uint,
    used_gpu_memory: u64,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

/// nvml.h `nvmlUtilization_t`.
#[repr(C)]
pub struct Utilization {
    gpu: c_uint,
    memory: c_uint,
}

#[derive(Debug, Default, Clone)]
struct Device {
    total: u64,
    used: u64,
    used_step: u64,
    sm: Option<u32>,
    mem: Option<u32>,
    pcie: Option<(u32, u32)>,
    /// NVLink throughput through GPM, MiB/s (tx, rx); `None`: no GPM.
    nvlink: Option<(f64, f64)>,
    gpm_samples_taken: u64,
    gpm_fail_after: Option<u64>,
    /// The unit `nvmlGpmMetricsGet` names (`gpm_unit=`; default nvml.h's "MiB/sec").
    gpm_unit: Option<&'static std::ffi::CStr>,
    /// (pid, first bytes, step)
    procs: Vec<(u32, u64, u64)>,
    mem_reads: u64,
    proc_reads: u64,
}

#[derive(Debug, Default)]
struct State {
    driver: String,
    devices: Vec<Device>,
    initialised: bool,
}

fn state() -> &'static Mutex<State> {
    static S: OnceLock<Mutex<State>> = OnceLock::new();
    S.get_or_init(|| Mutex::new(State::default()))
}

fn parse(text: &str) -> Result<State, String> {
    let mut st = State { driver: "0.0.test-double".into(), ..State::default() };
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        let mut words = line.split_whitespace();
        let Some(kind) = words.next() else { continue };
        let bad = |what: &str| format!("line {}: {what}: {line:?}", n + 1);
        match kind {
            "driver" => st.driver = words.next().ok_or_else(|| bad("driver needs a version"))?.to_owned(),
            "device" => {
                let mut d = Device { sm: Some(0), mem: Some(0), pcie: Some((0, 0)), ..Device::default() };
                let (mut tx, mut rx) = (0, 0);
                for w in words {
                    let (k, v) = w.split_once('=').ok_or_else(|| bad("expected key=value"))?;
                    if (k, v) == ("pcie", "unsupported") {
                        d.pcie = None;
                        continue;
                    }
                    if k == "gpm_unit" {
                        // Leaked once per script: the pointer NVML hands out must outlive the call.
                        let unit = std::ffi::CString::new(v).map_err(|_| bad("a unit without NUL"))?;
                        d.gpm_unit = Some(Box::leak(unit.into_boxed_c_str()));
                        continue;
                    }
                    if let ("nvlink_tx" | "nvlink_rx", Ok(rate)) = (k, v.parse::<f64>()) {
                        let (tx, rx) = d.nvlink.get_or_insert((0.0, 0.0));
                        *if k == "nvlink_tx" { tx } else { rx } = rate;
                        continue;
                    }
                    let x: u64 = v.parse().map_err(|_| bad("expected a number"))?;
                    match k {
                        "total" => d.total = x,
                        "used" => d.used = x,
                        "used_step" => d.used_step = x,
                        "sm" => d.sm = Some(x as u32),
                        "mem" => d.mem = Some(x as u32),
                        "pcie_tx" => tx = x as u32,
                        "pcie_rx" => rx = x as u32,
                        "gpm_fail_after" => d.gpm_fail_after = Some(x),
                        _ => return Err(bad("unknown key")),
                    }
                }
                if d.pcie.is_some() {
                    d.pcie = Some((tx, rx));
                }
                st.devices.push(d);
            }
            "proc" => {
                let v: Vec<u64> = words.map(|w| w.parse::<u64>().map_err(|_| bad("expected numbers"))).collect::<Result<_, _>>()?;
                let [dev, pid, bytes, step] = v[..] else { return Err(bad("proc DEVICE PID BYTES STEP")) };
                let d = st.devices.get_mut(dev as usize).ok_or_else(|| bad("no such device (declare it first)"))?;
                d.procs.push((pid as u32, bytes, step));
            }
            _ => return Err(bad("unknown directive")),
        }
    }
    Ok(st)
}

fn with_device<T>(dev: *mut c_void, f: impl FnOnce(&mut Device) -> T) -> Result<T, NvmlReturn> {
    let mut st = state().lock().unwrap_or_else(|e| e.into_inner());
    if !st.initialised {
        return Err(ERROR_UNINITIALIZED);
    }
    let i = (dev as usize).checked_sub(1).ok_or(ERROR_INVALID_ARGUMENT)?;
    st.devices.get_mut(i).map(f).ok_or(ERROR_INVALID_ARGUMENT)
}

fn write_str(s: &str, buf: *mut c_char, len: c_uint) -> NvmlReturn {
    if buf.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    let b = s.as_bytes();
    if b.len() + 1 > len as usize {
        return ERROR_INSUFFICIENT_SIZE;
    }
    // SAFETY: the caller gave `len` writable bytes at `buf`; we write b.len() + 1 <= len.
    unsafe {
        std::ptr::copy_nonoverlapping(b.as_ptr(), buf.cast::<u8>(), b.len());
        *buf.add(b.len()) = 0;
    }
    SUCCESS
}

#[no_mangle]
pub extern "C" fn nvmlInit_v2() -> NvmlReturn {
    let Some(path) = std::env::var_os("NVML_TEST_DOUBLE_SCRIPT") else { return ERROR_DRIVER_NOT_LOADED };
    let parsed = std::fs::read_to_string(&path).map_err(|e| e.to_string()).and_then(|t| parse(&t));
    match parsed {
        Ok(mut st) => {
            st.initialised = true;
            *state().lock().unwrap_or_else(|e| e.into_inner()) = st;
            SUCCESS
        }
        Err(e) => {
            eprintln!("nvml-test-double: bad script {}: {e}", path.to_string_lossy());
            ERROR_DRIVER_NOT_LOADED
        }
    }
}

#[no_mangle]
pub extern "C" fn nvmlShutdown() -> NvmlReturn {
    state().lock().unwrap_or_else(|e| e.into_inner()).initialised = false;
    let live = GPM_SAMPLES_LIVE.load(std::sync::atomic::Ordering::Relaxed);
    if live != 0 {
        eprintln!("nvml-test-double: {live} GPM sample(s) not freed at nvmlShutdown");
    }
    SUCCESS
}

#[no_mangle]
pub extern "C" fn nvmlSystemGetDriverVersion(buf: *mut c_char, len: c_uint) -> NvmlReturn {
    let st = state().lock().unwrap_or_else(|e| e.into_inner());
    if !st.initialised {
        return ERROR_UNINITIALIZED;
    }
    write_str(&st.driver, buf, len)
}

/// # Safety
/// `count` must be null or point to a writable `unsigned int`.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> NvmlReturn {
    let st = state().lock().unwrap_or_else(|e| e.into_inner());
    if !st.initialised {
        return ERROR_UNINITIALIZED;
    }
    if count.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: non-null, writable per the contract above.
    unsafe { *count = st.devices.len() as c_uint };
    SUCCESS
}

/// # Safety
/// `dev` must be null or point to a writable `nvmlDevice_t`.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(index: c_uint, dev: *mut *mut c_void) -> NvmlReturn {
    let st = state().lock().unwrap_or_else(|e| e.into_inner());
    if !st.initialised {
        return ERROR_UNINITIALIZED;
    }
    if dev.is_null() || index as usize >= st.devices.len() {
        return ERROR_INVALID_ARGUMENT;
    }
    // Handles are index + 1: opaque to the caller, never dereferenced here.
    // SAFETY: non-null, writable per the contract above.
    unsafe { *dev = (index as usize + 1) as *mut c_void };
    SUCCESS
}

#[no_mangle]
pub extern "C" fn nvmlDeviceGetName(dev: *mut c_void, buf: *mut c_char, len: c_uint) -> NvmlReturn {
    match with_device(dev, |_| ()) {
        Ok(()) => write_str("NVML test double (not a GPU)", buf, len),
        Err(e) => e,
    }
}

/// # Safety
/// `mem` must be null or point to a writable `nvmlMemory_v2_t`.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(dev: *mut c_void, mem: *mut Memory2) -> NvmlReturn {
    if mem.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    let r = with_device(dev, |d| {
        let used = d.used + d.mem_reads * d.used_step;
        d.mem_reads += 1;
        (d.total, used)
    });
    match r {
        Ok((total, used)) => {
            // SAFETY: non-null, writable per the contract above.
            let m = unsafe { &mut *mem };
            m.total = total;
            m.used = used;
            m.reserved = 0;
            m.free = total.saturating_sub(used);
            SUCCESS
        }
        Err(e) => e,
    }
}

/// # Safety
/// `count` must point to a writable `unsigned int`; `infos` must be null or
/// hold `*count` writable `nvmlProcessInfo_t`.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(dev: *mut c_void, count: *mut c_uint, infos: *mut ProcessInfo) -> NvmlReturn {
    if count.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: non-null, readable per the contract above.
    let room = unsafe { *count } as usize;
    let r = with_device(dev, |d| {
        let n = d.procs.len();
        if infos.is_null() || room < n {
            // A size query, as nvml.h documents: count only, no read counted.
            return (n, None);
        }
        let k = d.proc_reads;
        d.proc_reads += 1;
        let v: Vec<(u32, u64)> = d.procs.iter().map(|&(pid, bytes, step)| (pid, bytes + k * step)).collect();
        (n, Some((k, v)))
    });
    match r {
        Err(e) => e,
        Ok((n, None)) => {
            // SAFETY: non-null, writable per the contract above.
            unsafe { *count = n as c_uint };
            if n == 0 { SUCCESS } else { ERROR_INSUFFICIENT_SIZE }
        }
        Ok((n, Some((_, v)))) => {
            for (i, (pid, bytes)) in v.into_iter().enumerate() {
                // SAFETY: i < n <= room, and `infos` holds `room` writable entries.
                unsafe { *infos.add(i) = ProcessInfo { pid, used_gpu_memory: bytes, gpu_instance_id: u32::MAX, compute_instance_id: u32::MAX } };
            }
            // SAFETY: non-null, writable per the contract above.
            unsafe { *count = n as c_uint };
            SUCCESS
        }
    }
}

/// # Safety
/// `u` must be null or point to a writable `nvmlUtilization_t`.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(dev: *mut c_void, u: *mut Utilization) -> NvmlReturn {
    if u.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    match with_device(dev, |d| d.sm.zip(d.mem)) {
        Ok(Some((gpu, memory))) => {
            // SAFETY: non-null, writable per the contract above.
            unsafe { *u = Utilization { gpu, memory } };
            SUCCESS
        }
        Ok(None) => ERROR_NOT_SUPPORTED,
        Err(e) => e,
    }
}

/// # Safety
/// `value` must be null or point to a writable `unsigned int`.
#[no_mangle]
pub unsafe extern "C" fn nvmlDeviceGetPcieThroughput(dev: *mut c_void, counter: c_uint, value: *mut c_uint) -> NvmlReturn {
    if value.is_null() || counter > 1 {
        return ERROR_INVALID_ARGUMENT;
    }
    match with_device(dev, |d| d.pcie) {
        Ok(Some((tx, rx))) => {
            // SAFETY: non-null, writable per the contract above.
            unsafe { *value = if counter == 0 { tx } else { rx } };
            SUCCESS
        }
        Ok(None) => ERROR_NOT_SUPPORTED,
        Err(e) => e,
    }
}

/// nvml.h `nvmlGpmSupport_t`.
#[repr(C)]
pub struct GpmSupport {
    version: c_uint,
    is_supported_device: c_uint,
}

/// nvml.h `NVML_GPM_SUPPORT_VERSION` and `NVML_GPM_METRICS_GET_VERSION`.
const GPM_SUPPORT_VERSION: c_uint = 1;
const GPM_METRICS_GET_VERSION: c_uint = 1;
/// nvml.h `NVML_GPM_METRIC_MAX`: the length of `nvmlGpmMetricsGet_t.metrics`
/// (98 in older headers; a caller asks for at most that many).
const GPM_METRIC_MAX: usize = 210;
/// nvml.h `NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC` / `_TX_PER_SEC` (MiB/s).
const GPM_NVLINK_TOTAL_RX: c_uint = 60;
const GPM_NVLINK_TOTAL_TX: c_uint = 61;

/// What a `nvmlGpmSample_t` points to here: which device's how-manieth
/// `nvmlGpmSampleGet` filled it, if any did.
pub struct GpmSample {
    filled: Option<(usize, u64)>,
}

/// GPM samples allocated and not freed yet.
static GPM_SAMPLES_LIVE: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);

/// nvml.h `nvmlGpmMetric_t`'s `metricInfo`.
#[repr(C)]
pub struct GpmMetricInfo {
    short_name: *const c_char,
    long_name: *const c_char,
    unit: *const c_char,
}

/// nvml.h `nvmlGpmMetric_t`.
#[repr(C)]
pub struct GpmMetric {
    metric_id: c_uint,
    nvml_return: NvmlReturn,
    value: f64,
    info: GpmMetricInfo,
}

/// nvml.h `nvmlGpmMetricsGet_t`.
#[repr(C)]
pub struct GpmMetricsGet {
    version: c_uint,
    num_metrics: c_uint,
    sample1: *mut GpmSample,
    sample2: *mut GpmSample,
    metrics: [GpmMetric; GPM_METRIC_MAX],
}

/// # Safety
/// `support` must be null or point to a writable `nvmlGpmSupport_t`.
#[no_mangle]
pub unsafe extern "C" fn nvmlGpmQueryDeviceSupport(dev: *mut c_void, support: *mut GpmSupport) -> NvmlReturn {
    if support.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: non-null, readable and writable per the contract above.
    let support = unsafe { &mut *support };
    if support.version != GPM_SUPPORT_VERSION {
        return ERROR_ARGUMENT_VERSION_MISMATCH;
    }
    match with_device(dev, |d| d.nvlink.is_some()) {
        Ok(yes) => {
            support.is_supported_device = yes as c_uint;
            SUCCESS
        }
        Err(e) => e,
    }
}

/// # Safety
/// `sample` must be null or point to a writable `nvmlGpmSample_t`.
#[no_mangle]
pub unsafe extern "C" fn nvmlGpmSampleAlloc(sample: *mut *mut GpmSample) -> NvmlReturn {
    if sample.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    if !state().lock().unwrap_or_else(|e| e.into_inner()).initialised {
        return ERROR_UNINITIALIZED;
    }
    GPM_SAMPLES_LIVE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    // SAFETY: non-null, writable per the contract above.
    unsafe { *sample = Box::into_raw(Box::new(GpmSample { filled: None })) };
    SUCCESS
}

/// # Safety
/// `sample` must be null or a sample from `nvmlGpmSampleAlloc`, not freed yet.
#[no_mangle]
pub unsafe extern "C" fn nvmlGpmSampleFree(sample: *mut GpmSample) -> NvmlReturn {
    if sample.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    GPM_SAMPLES_LIVE.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    // SAFETY: allocated by Box::into_raw in nvmlGpmSampleAlloc and freed once, per the contract.
    drop(unsafe { Box::from_raw(sample) });
    SUCCESS
}

/// # Safety
/// `sample` must be null or a sample from `nvmlGpmSampleAlloc`, not freed yet.
#[no_mangle]
pub unsafe extern "C" fn nvmlGpmSampleGet(dev: *mut c_void, sample: *mut GpmSample) -> NvmlReturn {
    if sample.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    let r = with_device(dev, |d| {
        d.nvlink?;
        if d.gpm_fail_after.is_some_and(|n| d.gpm_samples_taken >= n) {
            return Some(Err(ERROR_IN_USE));
        }
        d.gpm_samples_taken += 1;
        Some(Ok(d.gpm_samples_taken))
    });
    match r {
        Ok(Some(Err(e))) => e,
        Ok(Some(Ok(n))) => {
            // SAFETY: a live sample per the contract above; with_device checked `dev`.
            unsafe { (*sample).filled = Some((dev as usize, n)) };
            SUCCESS
        }
        Ok(None) => ERROR_NOT_SUPPORTED,
        Err(e) => e,
    }
}

/// # Safety
/// `req` must be null or point to a writable `nvmlGpmMetricsGet_t` whose
/// samples come from `nvmlGpmSampleAlloc` and are not freed yet.
#[no_mangle]
pub unsafe extern "C" fn nvmlGpmMetricsGet(req: *mut GpmMetricsGet) -> NvmlReturn {
    if req.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: non-null, readable and writable per the contract above.
    let req = unsafe { &mut *req };
    if req.version != GPM_METRICS_GET_VERSION {
        return ERROR_ARGUMENT_VERSION_MISMATCH;
    }
    let n = req.num_metrics as usize;
    if n == 0 || n > GPM_METRIC_MAX || req.sample1.is_null() || req.sample2.is_null() {
        return ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: non-null live samples per the contract above.
    let (s1, s2) = unsafe { ((*req.sample1).filled, (*req.sample2).filled) };
    let (Some((dev1, n1)), Some((dev2, n2))) = (s1, s2) else { return ERROR_INVALID_ARGUMENT };
    if dev1 != dev2 || n2 <= n1 {
        return ERROR_INVALID_ARGUMENT;
    }
    let (rates, unit) = match with_device(dev1 as *mut c_void, |d| d.nvlink.map(|r| (r, d.gpm_unit.unwrap_or(c"MiB/sec")))) {
        Ok(Some(r)) => r,
        Ok(None) => return ERROR_NOT_SUPPORTED,
        Err(e) => return e,
    };
    let intervals = (n2 - n1) as f64;
    for m in &mut req.metrics[..n] {
        let (value, name, ret) = match m.metric_id {
            GPM_NVLINK_TOTAL_RX => (rates.1 * intervals, c"nvlink_total_rx", SUCCESS),
            GPM_NVLINK_TOTAL_TX => (rates.0 * intervals, c"nvlink_total_tx", SUCCESS),
            _ => (0.0, c"", ERROR_NOT_SUPPORTED),
        };
        m.nvml_return = ret;
        m.value = value;
        let unit = if ret == SUCCESS { unit.as_ptr() } else { std::ptr::null() };
        m.info = GpmMetricInfo { short_name: name.as_ptr(), long_name: name.as_ptr(), unit };
    }
    SUCCESS
}
