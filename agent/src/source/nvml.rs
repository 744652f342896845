//! NVML sampling: per-device GPU memory, per-traced-process GPU memory, SM and
//! memory-controller utilisation and PCIe throughput, every `--nvml-period`,
//! as `Record::GpuSample`.
//!
//! NVML is loaded at run time (nvml-wrapper, libloading): a machine without the
//! NVIDIA driver gets one note and records everything else as usual. The
//! sampler runs on its own thread and hands records over a bounded channel
//! that the main loop drains without waiting, so a slow NVML call (they take
//! milliseconds on some drivers) never holds up the pipeline; a full channel
//! drops the sample and counts it.
//!
//! NVLink throughput comes from GPM (GPU performance monitoring, Hopper and
//! newer: the GPUs vLLM runs on here): NVLink bytes per second summed over
//! links between two GPM samples, the previous tick's and this one's. The
//! aggregate NVLink field values would need `scopeId = UINT_MAX`, which
//! nvml-wrapper 0.13's `field_values_for` cannot set (it always asks for link
//! 0), and the older per-link utilisation counters are gone on Hopper; so a
//! GPU without GPM (before Hopper) has none, and the start note says so.
//!
//! Process ids come from NVML in the host's pid namespace. The traced
//! processes are handed over as (pid, host pid) pairs: the same pid in the
//! host's namespace; in a container's, the host pid the eBPF programs noted
//! (`EbpfSource::host_targets`), and a sample names each process by the
//! agent's pid for it (docs/deploy.md).

use crate::model::Record;
use nvml_wrapper::enum_wrappers::device::PcieUtilCounter;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::enums::gpm::GpmMetricId;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::gpm::gpm_metrics_get;
use nvml_wrapper::{Device, GpmSample, Nvml};
use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

/// Environment variable naming the NVML library to load instead of the
/// driver's `libnvidia-ml.so.1` (tests point it at the NVML test double).
pub const LIB_ENV: &str = "HOPSCOPE_NVML_LIB";

/// The driver's NVML: the versioned name exists wherever the driver is
/// installed (the bare `.so` only with development packages).
pub const DEFAULT_LIB: &str = "libnvidia-ml.so.1";

/// Default `--nvml-period`.
pub const DEFAULT_PERIOD: Duration = Duration::from_millis(100);

/// Samples waiting for the main loop; past this they are dropped and counted.
const CHANNEL_CAP: usize = 4096;

#[derive(Debug, Clone)]
pub struct NvmlConfig {
    pub period: Duration,
    /// Library to load; `None`: `$HOPSCOPE_NVML_LIB`, else [`DEFAULT_LIB`].
    pub lib: Option<PathBuf>,
    /// Traced processes from the first sample on, as (pid, host pid)
    /// ([`NvmlSampler::set_traced`] updates them).
    pub traced: Vec<(u32, u32)>,
}

impl Default for NvmlConfig {
    fn default() -> Self {
        NvmlConfig { period: DEFAULT_PERIOD, lib: None, traced: Vec::new() }
    }
}

/// The library `cfg` would load.
pub fn lib_path(cfg_lib: Option<&std::path::Path>) -> PathBuf {
    cfg_lib.map(PathBuf::from).or_else(|| std::env::var_os(LIB_ENV).filter(|v| !v.is_empty()).map(PathBuf::from)).unwrap_or_else(|| PathBuf::from(DEFAULT_LIB))
}

/// Why NVML cannot be used, in words that say what to do.
pub fn explain(lib: &std::path::Path, e: &NvmlError) -> String {
    match e {
        NvmlError::LibloadingError(_) => format!("no NVIDIA driver here ({} cannot be loaded): recording without GPU samples", lib.display()),
        NvmlError::DriverNotLoaded => "the NVIDIA kernel driver is not loaded (nvidia-smi fails too?): recording without GPU samples".into(),
        NvmlError::NoPermission => "NVML says no permission: give hopscope access to /dev/nvidia* (the GPU device nodes): recording without GPU samples".into(),
        NvmlError::FailedToLoadSymbol(s) => format!("{} lacks NVML function {s} (driver too old?): recording without GPU samples", lib.display()),
        other => format!("NVML failed to start ({other}): recording without GPU samples"),
    }
}

/// Facts about NVML on this machine (for `hopscope doctor`).
#[derive(Debug, Clone)]
pub struct Probe {
    pub lib: PathBuf,
    /// Driver version and each device's name and whether it has GPM (NVLink
    /// throughput), or why NVML is unusable.
    pub result: Result<(String, Vec<(String, bool)>), String>,
}

/// Loads NVML, reads the driver version, device names and GPM support, unloads it.
pub fn probe(lib: Option<&std::path::Path>) -> Probe {
    let lib = lib_path(lib);
    let result = init(&lib).map_err(|e| explain(&lib, &e)).and_then(|nvml| {
        let driver = nvml.sys_driver_version().unwrap_or_else(|_| "unknown".into());
        let n = nvml.device_count().map_err(|e| format!("NVML loaded but listing devices failed: {e}"))?;
        let devices = (0..n)
            .map(|i| match nvml.device_by_index(i) {
                Ok(d) => (d.name().unwrap_or_else(|e| format!("<{e}>")), d.gpm_support().unwrap_or(false)),
                Err(e) => (format!("<{e}>"), false),
            })
            .collect();
        Ok((driver, devices))
    });
    Probe { lib, result }
}

fn init(lib: &std::path::Path) -> Result<Nvml, NvmlError> {
    Nvml::builder().lib_path(OsStr::new(lib.as_os_str())).init()
}

#[derive(Default)]
struct Stats {
    samples: AtomicU64,
    sample_errors: AtomicU64,
    field_errors: AtomicU64,
    dropped: AtomicU64,
    devices: AtomicU64,
    process_mem_unavailable: AtomicU64,
}

struct Shared {
    stop: AtomicBool,
    /// Host pid (NVML's) → the agent's pid.
    traced: RwLock<HashMap<u32, u32>>,
    notes: Mutex<Vec<String>>,
    stats: Stats,
}

/// A running sampler.
pub struct NvmlSampler {
    shared: Arc<Shared>,
    rx: Receiver<Record>,
    thread: Option<JoinHandle<()>>,
}

impl NvmlSampler {
    /// Starts the sampling thread. NVML is loaded there; whether it worked
    /// comes back as a note ([`NvmlSampler::take_notes`]), never as an error:
    /// a machine without a GPU records everything else.
    pub fn start(cfg: NvmlConfig) -> std::io::Result<NvmlSampler> {
        let shared = Arc::new(Shared { stop: AtomicBool::new(false), traced: RwLock::new(cfg.traced.iter().map(|&(pid, host)| (host, pid)).collect()), notes: Mutex::new(Vec::new()), stats: Stats::default() });
        let (tx, rx) = sync_channel(CHANNEL_CAP);
        let sh = Arc::clone(&shared);
        let thread = std::thread::Builder::new().name("hopscope-nvml".into()).spawn(move || run(cfg, sh, tx))?;
        Ok(NvmlSampler { shared, rx, thread: Some(thread) })
    }

    /// The processes whose GPU memory is kept (the traced tree), as (pid,
    /// host pid).
    pub fn set_traced(&self, pids: impl IntoIterator<Item = (u32, u32)>) {
        let mut t = self.shared.traced.write().unwrap_or_else(|e| e.into_inner());
        t.clear();
        t.extend(pids.into_iter().map(|(pid, host)| (host, pid)));
    }

    /// Hands every sample taken so far to `f`, without waiting.
    pub fn drain(&self, mut f: impl FnMut(Record)) {
        while let Ok(r) = self.rx.try_recv() {
            f(r);
        }
    }

    pub fn take_notes(&self) -> Vec<String> {
        std::mem::take(&mut *self.shared.notes.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// `nvml_*` counters: samples written (activity), failed samples, fields
    /// that failed (other than "not supported"), samples dropped on a full
    /// channel, traced processes' memory NVML would not give.
    pub fn counters(&self) -> Vec<(String, u64)> {
        let s = &self.shared.stats;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        vec![
            ("nvml_devices".into(), get(&s.devices)),
            ("nvml_samples".into(), get(&s.samples)),
            ("nvml_sample_errors".into(), get(&s.sample_errors)),
            ("nvml_field_errors".into(), get(&s.field_errors)),
            ("nvml_samples_dropped".into(), get(&s.dropped)),
            ("nvml_process_mem_unavailable".into(), get(&s.process_mem_unavailable)),
        ]
    }

    /// Stops the thread and hands over what it still held.
    pub fn shutdown(&mut self, f: impl FnMut(Record)) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.drain(f);
    }
}

impl Drop for NvmlSampler {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn note(sh: &Shared, s: String) {
    sh.notes.lock().unwrap_or_else(|e| e.into_inner()).push(s);
}

fn run(cfg: NvmlConfig, sh: Arc<Shared>, tx: SyncSender<Record>) {
    let lib = lib_path(cfg.lib.as_deref());
    let nvml = match init(&lib) {
        Ok(n) => n,
        Err(e) => return note(&sh, format!("nvml: {}", explain(&lib, &e))),
    };
    let devices: Vec<(u32, Device)> = match nvml.device_count() {
        Ok(n) => (0..n)
            .filter_map(|i| match nvml.device_by_index(i) {
                Ok(d) => Some((i, d)),
                Err(e) => {
                    note(&sh, format!("nvml: device {i} is not usable ({e}): not sampled"));
                    None
                }
            })
            .collect(),
        Err(e) => return note(&sh, format!("nvml: listing GPUs failed ({e}): recording without GPU samples")),
    };
    sh.stats.devices.store(devices.len() as u64, Ordering::Relaxed);
    let driver = nvml.sys_driver_version().unwrap_or_else(|_| "unknown".into());
    // Each device's previous GPM sample: NVLink throughput is measured between two.
    let mut gpm: Vec<Option<Gpm>> = devices.iter().map(|(i, d)| gpm_start(*i, d, &sh).map(|prev| Gpm { prev, failures: 0, unit_checked: false })).collect();
    let with_gpm: Vec<String> = devices.iter().zip(&gpm).filter(|(_, g)| g.is_some()).map(|((i, _), _)| i.to_string()).collect();
    let nvlink = if with_gpm.is_empty() {
        "no NVLink throughput: it comes from GPM, which needs a Hopper or newer GPU".to_owned()
    } else if with_gpm.len() == devices.len() {
        "NVLink throughput from GPM".to_owned()
    } else {
        format!("NVLink throughput from GPM on GPU {} only", with_gpm.join(", "))
    };
    note(&sh, format!("nvml: sampling {} GPU(s) every {} ms (driver {driver}; {nvlink})", devices.len(), cfg.period.as_millis()));
    // The model and driver, for the report of a recording without injected processes too.
    let ts_ns = crate::sys::monotonic_ns();
    for (i, d) in &devices {
        let name = d.name().unwrap_or_else(|e| format!("<{e}>"));
        let mem_total_bytes = d.memory_info().map(|m| m.total).unwrap_or(0);
        if offer(&tx, Record::NvmlDevice { ts_ns, device: *i, name, driver: driver.clone(), mem_total_bytes }, &sh).is_none() {
            return;
        }
    }
    let period_ns = cfg.period.as_nanos() as u64;
    let mut next = crate::sys::monotonic_ns();
    while !sh.stop.load(Ordering::Relaxed) {
        // One timestamp per tick for every device: the report sums devices per instant.
        let ts_ns = crate::sys::monotonic_ns();
        let traced = sh.traced.read().unwrap_or_else(|e| e.into_inner()).clone();
        for ((i, d), gpm) in devices.iter().zip(&mut gpm) {
            match sample(*i, d, ts_ns, &traced, &sh.stats) {
                Some(mut r) => {
                    nvlink_throughput(&nvml, *i, d, gpm, &sh, &mut r);
                    match offer(&tx, r, &sh) {
                        Some(true) => {
                            sh.stats.samples.fetch_add(1, Ordering::Relaxed);
                        }
                        Some(false) => {}
                        None => return,
                    }
                }
                None => {
                    sh.stats.sample_errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        // Fixed-rate ticks; a tick that overran starts the next one at once
        // rather than bunching up to catch up.
        next = next.saturating_add(period_ns).max(crate::sys::monotonic_ns());
        while !sh.stop.load(Ordering::Relaxed) {
            let now = crate::sys::monotonic_ns();
            if now >= next {
                break;
            }
            std::thread::sleep(Duration::from_nanos((next - now).min(20_000_000)));
        }
    }
}

/// Offers `r` to the pipeline without waiting: whether it was taken (a full
/// pipeline drops it, counted with the samples it drops), `None` once the
/// pipeline is gone.
fn offer(tx: &SyncSender<Record>, r: Record, sh: &Shared) -> Option<bool> {
    match tx.try_send(r) {
        Ok(()) => Some(true),
        Err(TrySendError::Full(_)) => {
            sh.stats.dropped.fetch_add(1, Ordering::Relaxed);
            Some(false)
        }
        Err(TrySendError::Disconnected(_)) => None,
    }
}

/// A field NVML may not support on a device: `None` then, counted when it
/// failed for another reason.
fn field<T>(r: Result<T, NvmlError>, stats: &Stats) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(NvmlError::NotSupported) => None,
        Err(_) => {
            stats.field_errors.fetch_add(1, Ordering::Relaxed);
            None
        }
    }
}

/// Device `i`'s first GPM sample, when it has GPM (Hopper and newer); a
/// device that has it but fails to give a sample gets a note.
fn gpm_start<'n>(i: u32, d: &Device<'n>, sh: &Shared) -> Option<GpmSample<'n>> {
    match d.gpm_support() {
        Ok(true) => {}
        // Before Hopper, or a driver older than GPM.
        Ok(false) | Err(NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_)) => return None,
        Err(e) => {
            note(sh, format!("nvml: cannot ask GPU {i} whether it has GPM ({e}): no NVLink throughput from it"));
            return None;
        }
    }
    d.gpm_sample().map_err(|e| note(sh, format!("nvml: GPU {i}'s GPM gives no sample ({e}): no NVLink throughput from it"))).ok()
}

/// GPM calls failing this many ticks in a row (another profiler holding the
/// counters, say) stop NVLink sampling on that GPU, with a note, rather than
/// count an error every tick for the rest of the recording.
const GPM_GIVE_UP: u32 = 10;

/// A GPU's GPM state: the previous tick's sample, how many ticks in a row
/// failed since the last that did not, and whether the unit NVML gives its
/// NVLink figures in was looked at.
struct Gpm<'n> {
    prev: GpmSample<'n>,
    failures: u32,
    unit_checked: bool,
}

/// KiB/s per unit of a GPM rate whose unit NVML names `unit` ("MiB/sec" in
/// nvml.h for the NVLink metrics), `None` for a unit not known here.
fn kib_s_per(unit: &str) -> Option<f64> {
    let per = unit.strip_suffix("/sec").or_else(|| unit.strip_suffix("/s"))?;
    Some(match per {
        "B" => 1.0 / 1024.0,
        "KiB" => 1.0,
        "MiB" => 1024.0,
        "GiB" => 1024.0 * 1024.0,
        _ => return None,
    })
}

/// Sets `r`'s NVLink throughput from the GPM samples of the previous tick
/// and this one (NVML: MiB/s summed over links), and keeps this tick's as
/// the next one's start. Without GPM, `r` keeps its `None`s.
fn nvlink_throughput<'n>(nvml: &'n Nvml, i: u32, d: &Device<'n>, gpm: &mut Option<Gpm<'n>>, sh: &Shared, r: &mut Record) {
    let (Some(g), Record::GpuSample { nvlink_tx_kib_s, nvlink_rx_kib_s, .. }) = (gpm.as_mut(), r) else { return };
    let stats = &sh.stats;
    // A failed sample leaves the previous one the start: the next interval is longer, its rate still right.
    let taken = d.gpm_sample().and_then(|now| {
        let rates = gpm_metrics_get(nvml, &g.prev, &now, &[GpmMetricId::NvlinkTotalTxPerSec, GpmMetricId::NvlinkTotalRxPerSec]);
        g.prev = now;
        rates
    });
    let rates = match taken {
        Ok(rates) => {
            g.failures = 0;
            rates
        }
        Err(e) => {
            g.failures += 1;
            let last = e.to_string();
            field::<()>(Err(e), stats);
            if g.failures >= GPM_GIVE_UP {
                note(sh, format!("nvml: GPU {i}'s GPM failed {GPM_GIVE_UP} times in a row ({last}; another profiler using it?): NVLink throughput from it stops here"));
                *gpm = None;
            }
            return;
        }
    };
    let mut rates = rates.into_iter();
    let mut kib_s = || {
        let m = field(rates.next()?, stats)?;
        // nvml.h documents MiB/s; a unit NVML names otherwise is followed, one it
        // names that is not known here is taken as MiB/s and said once.
        let per = kib_s_per(&m.metric_info.unit);
        if !std::mem::replace(&mut g.unit_checked, true) && per.is_none() {
            note(sh, format!("nvml: GPU {i}'s GPM gives NVLink throughput in {:?}, not a unit known here: taken as MiB/s (nvml.h)", m.metric_info.unit));
        }
        let v = m.value * per.unwrap_or(1024.0);
        if v.is_finite() && v >= 0.0 {
            Some(v.round() as u64)
        } else {
            stats.field_errors.fetch_add(1, Ordering::Relaxed);
            None
        }
    };
    *nvlink_tx_kib_s = kib_s();
    *nvlink_rx_kib_s = kib_s();
}

/// One device's sample; `None` when even its memory could not be read.
fn sample(device: u32, d: &Device, ts_ns: u64, traced: &HashMap<u32, u32>, stats: &Stats) -> Option<Record> {
    let mem = d.memory_info().ok()?;
    let process_mem = field(d.running_compute_processes(), stats)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|p| {
            let pid = *traced.get(&p.pid)?;
            match p.used_gpu_memory {
                UsedGpuMemory::Used(b) => Some((pid, b)),
                // NVML's "not available" (no permission to see it, as in
                // some containers): the process is on the GPU, its memory
                // missing from the traced sum.
                UsedGpuMemory::Unavailable => {
                    stats.process_mem_unavailable.fetch_add(1, Ordering::Relaxed);
                    None
                }
            }
        })
        .collect();
    let util = field(d.utilization_rates(), stats);
    Some(Record::GpuSample {
        ts_ns,
        device,
        mem_used_bytes: mem.used,
        mem_total_bytes: mem.total,
        process_mem,
        sm_util_pct: util.as_ref().map(|u| u.gpu),
        mem_util_pct: util.as_ref().map(|u| u.memory),
        pcie_tx_kib_s: field(d.pcie_throughput(PcieUtilCounter::Send), stats),
        pcie_rx_kib_s: field(d.pcie_throughput(PcieUtilCounter::Receive), stats),
        nvlink_tx_kib_s: None,
        nvlink_rx_kib_s: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvml_absent_library_is_a_note_not_an_error() {
        let p = probe(Some(std::path::Path::new("/nonexistent/libnvidia-ml.so.1")));
        let e = p.result.unwrap_err();
        assert!(e.contains("no NVIDIA driver here") && e.contains("/nonexistent/libnvidia-ml.so.1"), "{e}");
        let mut s = NvmlSampler::start(NvmlConfig { period: Duration::from_millis(10), lib: Some("/nonexistent/libnvidia-ml.so.1".into()), traced: vec![(1, 1)] }).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let mut notes = Vec::new();
        while notes.is_empty() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
            notes = s.take_notes();
        }
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(notes[0].starts_with("nvml: no NVIDIA driver here"), "{notes:?}");
        let mut n = 0;
        s.shutdown(|_| n += 1);
        assert_eq!(n, 0);
        assert_eq!(s.counters().iter().map(|(_, v)| v).sum::<u64>(), 0);
    }

    #[test]
    fn nvml_samples_never_pass_kernel_events_still_in_the_reorder_window() {
        use crate::event::{KEvent, SchedEvent};
        use crate::pipeline::Pipeline;
        use crate::recording::{Meta, Reader, Writer};
        let meta = Meta { format_version: crate::recording::FORMAT_VERSION, start_ns: 1, ..Meta::default() };
        let mut p = Pipeline::new(Default::default(), Writer::new(Vec::new(), &meta).unwrap());
        let off = |ts: u64| KEvent::Sched(SchedEvent { ts_ns: ts, tgid: 1, tid: 1, off_ns: ts - 1, wake_ns: None, prev_state: 1, cpu: 0 });
        let smp = |ts_ns: u64| Record::test_gpu_sample(ts_ns, 0, vec![(1, 5)]);
        const MS: u64 = 1_000_000;
        let base = 10_000 * MS;
        for t in [0, 5, 10] {
            p.push(off(base + t * MS)).unwrap();
        }
        // Taken at +12 ms while the +0…+10 ms events are still held: it waits for them,
        // and for the +15 ms event that arrives after it.
        p.push_sample(smp(base + 12 * MS));
        p.push(off(base + 15 * MS)).unwrap();
        p.tick(base + 100 * MS, &[]).unwrap();
        p.push_sample(smp(base + 200 * MS));
        p.push(off(base + 190 * MS)).unwrap();
        let (bytes, _) = p.finish(base + 1_000 * MS, &[]).unwrap();
        let mut rd = Reader::new(&bytes[..]).unwrap();
        let mut seen = Vec::new();
        while let Some(r) = rd.next_record().unwrap() {
            if !matches!(r, Record::Drops { .. }) {
                seen.push((r.ts_ns() - base) / MS);
            }
        }
        assert_eq!(seen, [0, 5, 10, 12, 15, 190, 200], "samples in time order with the kernel events");
    }

    #[test]
    fn gpm_rates_follow_the_unit_nvml_names() {
        assert_eq!(kib_s_per("MiB/sec"), Some(1024.0), "nvml.h's unit for the NVLink metrics");
        assert_eq!(kib_s_per("MiB/s"), Some(1024.0));
        assert_eq!(kib_s_per("B/sec"), Some(1.0 / 1024.0));
        assert_eq!(kib_s_per("GiB/sec"), Some(1024.0 * 1024.0));
        for unknown in ["", "MB/sec", "%", "MiB"] {
            assert_eq!(kib_s_per(unknown), None, "{unknown:?}");
        }
    }

    #[test]
    fn nvml_lib_path_prefers_the_option_then_the_default() {
        assert_eq!(lib_path(Some(std::path::Path::new("/x/libnvml.so"))), PathBuf::from("/x/libnvml.so"));
        if std::env::var_os(LIB_ENV).is_none() {
            assert_eq!(lib_path(None), PathBuf::from(DEFAULT_LIB));
        }
    }
}
