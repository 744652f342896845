//! Loads `hopscope.bpf.o`, attaches every program, fills the `targets` map and
//! reads the ring buffer.
//!
//! Order matters for not missing processes: all programs (fork following
//! included) are attached *before* the first pid goes into `targets`; then
//! `/proc` is scanned for descendants until no new one appears. A child forked
//! after its parent entered `targets` is added by the kernel; one forked before
//! is found by the next scan.

use std::{
    collections::{BTreeSet, HashMap},
    fs, io,
    os::fd::{AsRawFd, OwnedFd},
    os::unix::process::CommandExt,
    path::Path,
    process::{Child, Command},
    time::{Duration, Instant},
};

use aya::{
    maps::{Array, HashMap as BpfHashMap, MapData, MapError, PerCpuArray, RingBuf},
    programs::{BtfTracePoint, Program, ProgramError, TracePoint},
    Btf, BtfError, Ebpf, EbpfError, EbpfLoader,
};
use hopscope_ebpf::layout::{
    HS_CAPTURE_DEFAULT, HS_CAPTURE_UNIX_DEFAULT, HS_IO_SIZE, HS_MAX_CAPTURE, HS_MAX_TAIL, HS_STAT_MAX, HS_STAT_NAMES, HS_TAIL_DEFAULT,
    HS_TAIL_UNIX_DEFAULT,
};

use super::decode::DecodeError;
use crate::event::KEvent;

/// Every program in `hopscope.bpf.o` and how it attaches. The loader refuses an
/// object whose program set differs, so a program added to the C side without
/// being wired here fails loudly instead of silently never running.
const SYSCALL_PROGRAMS: &[&str] = &[
    "sys_enter_read",
    "sys_exit_read",
    "sys_enter_readv",
    "sys_exit_readv",
    "sys_enter_recvfrom",
    "sys_exit_recvfrom",
    "sys_enter_recvmsg",
    "sys_exit_recvmsg",
    "sys_enter_write",
    "sys_exit_write",
    "sys_enter_writev",
    "sys_exit_writev",
    "sys_enter_sendto",
    "sys_exit_sendto",
    "sys_enter_sendmsg",
    "sys_exit_sendmsg",
    "sys_enter_accept",
    "sys_exit_accept",
    "sys_enter_accept4",
    "sys_exit_accept4",
    "sys_enter_connect",
    "sys_exit_connect",
    "sys_enter_close",
    "sys_exit_close",
];
/// Classic tracepoints outside `syscalls`: (function, category, tracepoint).
/// sk_data_ready and inet_sock_set_state date from 6.6 and 4.16,
/// net_dev_queue from 3.x.
const SOCK_PROGRAMS: &[(&str, &str, &str)] = &[
    ("sock_sk_data_ready", "sock", "sk_data_ready"),
    ("sock_inet_sock_set_state", "sock", "inet_sock_set_state"),
    ("net_net_dev_queue", "net", "net_dev_queue"),
];
/// Programs whose tracepoint a kernel may lack without tracing being
/// pointless: (function, `category:tracepoint`, what goes without it). On
/// kernels before 6.6 (Ubuntu 22.04's 5.15, RHEL 9's 5.14) there is no
/// sock:sk_data_ready: recording goes on without the wire arrival.
pub const OPTIONAL_PROGRAMS: &[(&str, &str, &str)] = &[
    (
        "sock_sk_data_ready",
        "sock:sk_data_ready",
        "the wire arrival (wire_arrive_ns, read_delay_ms, wire_ttft_ms, wire_e2e_ms stay null; kernel >= 6.6 has it)",
    ),
    (
        "net_net_dev_queue",
        "net:net_dev_queue",
        "the wire departure (responses are timed at their writes' exits, which a preemption inside the call delays)",
    ),
];
/// Test hook: tracepoints (`category:name`, comma-separated) to treat as
/// absent, so the fallback for older kernels runs on a new one.
pub const HIDE_TRACEPOINTS_ENV: &str = "HOPSCOPE_HIDE_TRACEPOINTS";

/// Whether the running kernel has tracepoint `category:name` (tracefs), or
/// HIDE_TRACEPOINTS_ENV says to act as if it had not.
pub(crate) fn tracepoint_exists(full: &str) -> bool {
    if std::env::var(HIDE_TRACEPOINTS_ENV).is_ok_and(|v| v.split(',').any(|h| h.trim() == full)) {
        return false;
    }
    let Some((category, name)) = full.split_once(':') else { return false };
    ["/sys/kernel/tracing/events", "/sys/kernel/debug/tracing/events"]
        .iter()
        .any(|root| Path::new(root).join(category).join(name).is_dir())
}
/// tp_btf programs; the function name is the tracepoint name.
const BTF_PROGRAMS: &[&str] = &[
    "sched_process_fork",
    "sched_process_exec",
    "sched_process_exit",
    "sched_switch",
    "sched_waking",
    "sched_wakeup_new",
];

/// At most this many samples per drain, so a flood cannot starve the caller.
const MAX_DRAIN: usize = 1 << 20;

/// Errors of the eBPF source. Messages say what to do; the cause is attached.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error(
        "this hopscope was built without clang-19, so it has no eBPF programs ({0}): install clang-19 llvm-19 libbpf-dev and rebuild"
    )]
    Placeholder(&'static str),
    #[error("insufficient privileges to load eBPF: run as root or grant CAP_BPF,CAP_PERFMON")]
    NotPrivileged,
    #[error("tracefs not mounted: run `mount -t tracefs nodev /sys/kernel/tracing`")]
    TracefsMissing,
    #[error("tracefs is not readable by this user (it is root-only): run as uid 0 or add CAP_DAC_READ_SEARCH (docs/deploy.md)")]
    TracefsUnreadable,
    #[error("kernel lacks BTF (CONFIG_DEBUG_INFO_BTF): /sys/kernel/btf/vmlinux is missing")]
    NoBtf,
    #[error("pid {0} not found")]
    PidNotFound(u32),
    #[error("invalid ebpf configuration: {0}")]
    InvalidConfig(String),
    #[error("reading kernel BTF failed")]
    Btf(#[source] BtfError),
    #[error("loading the eBPF object failed")]
    Load(#[source] EbpfError),
    #[error("the eBPF object does not match the loader: {0}")]
    ObjectMismatch(String),
    #[error("loading eBPF program {name} failed")]
    ProgramLoad {
        name: String,
        #[source]
        source: ProgramError,
    },
    #[error("attaching eBPF program {name} failed")]
    Attach {
        name: String,
        #[source]
        source: ProgramError,
    },
    #[error("eBPF map {name} failed")]
    Map {
        name: &'static str,
        #[source]
        source: MapError,
    },
    #[error("{what} failed")]
    Io {
        what: String,
        #[source]
        source: io::Error,
    },
}

/// What to trace and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EbpfConfig {
    /// Root processes; their existing and future descendants are traced too.
    /// May be empty (add processes later with `add_pid`/`spawn`).
    pub pids: Vec<u32>,
    /// Payload bytes captured per socket read/write (0..=HS_MAX_CAPTURE),
    /// except on unix sockets.
    pub capture_len: u32,
    /// The same on unix-domain sockets (the engine IPC): larger by default, so
    /// that libzmq's batched writes keep every frame header.
    pub capture_len_unix: u32,
    /// Last bytes (0..=HS_MAX_TAIL) also captured of a unix-socket transfer
    /// longer than `capture_len_unix`: libzmq moves a message over 8 KiB in a
    /// syscall of its own, so this is the message's end (a long ADD's fields
    /// after its prompt ids). 0: the prefix only.
    pub capture_tail_unix: u32,
    /// The same on every other socket (TCP): an HTTP body longer than
    /// `capture_len` keeps its last members (a request's `model` after its
    /// prompt, a response's `usage`). 0: the prefix only.
    pub capture_tail: u32,
    /// Off-CPU intervals shorter than this are only counted in the kernel.
    pub min_offcpu_ns: u64,
    /// Ring-buffer backlog (bytes) past which the kernel wakes the reader;
    /// below it the reader relies on its `poll` timeout (timer drain).
    pub wakeup_bytes: u64,
    /// Ring-buffer size in bytes; rounded up to a power of two >= one page.
    pub ringbuf_bytes: u32,
    /// Turn on kernel-wide BPF run-time statistics (`kernel.bpf_stats_enabled`)
    /// for as long as the source lives, so [`EbpfSource::program_stats`] has
    /// numbers. Costs two clock reads per program run.
    pub enable_bpf_stats: bool,
    /// Fault injection, for tests: the off-CPU slot allocations at a
    /// switch-out and at a first-seen wake-up fail, as one can inside
    /// sched_switch (interrupts off), so that each thread's first sleep takes
    /// the spill path (`kernel_sched_spilled`). Never set in production.
    pub fail_offcpu_alloc: bool,
    /// Fault injection, for tests: every in-flight slot allocation at a
    /// syscall's entry fails, so that each traced syscall takes the spill
    /// path (`kernel_inflight_spilled`). Never set in production.
    pub fail_inflight_alloc: bool,
}

/// Records of the largest capture the ring buffer must hold at least: fewer,
/// and one large unix write at a time fills it before the reader wakes
/// (the default 32 KiB unix capture needs 512 KiB; `--ringbuf-mib` starts at 1).
pub const RING_MIN_RECORDS: u64 = 16;

/// Smallest ring buffer for a largest capture of `capture` bytes: the io
/// record plus the ring's 8-byte record header, 8-byte aligned.
pub fn min_ringbuf_bytes(capture: u32) -> u64 {
    let record = (HS_IO_SIZE as u64 + u64::from(capture) + 8).next_multiple_of(8);
    RING_MIN_RECORDS * record
}

impl Default for EbpfConfig {
    fn default() -> Self {
        EbpfConfig {
            pids: Vec::new(),
            capture_len: HS_CAPTURE_DEFAULT,
            capture_len_unix: HS_CAPTURE_UNIX_DEFAULT,
            capture_tail_unix: HS_TAIL_UNIX_DEFAULT,
            capture_tail: HS_TAIL_DEFAULT,
            min_offcpu_ns: 1_000_000,
            wakeup_bytes: 256 * 1024,
            ringbuf_bytes: 16 * 1024 * 1024,
            enable_bpf_stats: false,
            fail_offcpu_alloc: false,
            fail_inflight_alloc: false,
        }
    }
}

/// Kernel-side counters (HS_STAT_*), summed over CPUs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelStats {
    values: [u64; HS_STAT_MAX as usize],
}

impl KernelStats {
    /// `(name, value)` for every counter, in HS_STAT_* order; names are
    /// `kernel_` + the lowercase HS_STAT_ suffix (`kernel_ringbuf_full`, …).
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        HS_STAT_NAMES.iter().map(|&(i, name)| (name, self.values[i as usize]))
    }

    /// One counter by name (`"kernel_truncated"`); None for an unknown name.
    pub fn get(&self, name: &str) -> Option<u64> {
        self.iter().find(|(n, _)| *n == name).map(|(_, v)| v)
    }

    /// Builds stats from raw per-index sums (tests, replay).
    pub fn from_values(values: [u64; HS_STAT_MAX as usize]) -> Self {
        KernelStats { values }
    }
}

/// Load and attach timings, for the benchmark and `--verbose`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StartupTimes {
    /// ELF parse, BTF relocation, map creation.
    pub object: Duration,
    /// BPF_PROG_LOAD (verifier) of all programs.
    pub verify: Duration,
    /// Attaching all programs.
    pub attach: Duration,
    /// Filling `targets` from the pid list and /proc.
    pub targets: Duration,
}

/// The running eBPF source. Dropping it detaches every program.
pub struct EbpfSource {
    ring: RingBuf<MapData>,
    stats: PerCpuArray<MapData, u64>,
    targets: Targets,
    /// Traced tgid → its tgid in the initial pid namespace; None when the
    /// agent is in that namespace (the two are the same).
    host_tgids: Option<BpfHashMap<MapData, u32, u32>>,
    // Owns the programs and their links; declared after the maps taken from it.
    ebpf: Ebpf,
    _bpf_stats: Option<OwnedFd>,
    times: StartupTimes,
    /// Optional tracepoints this kernel lacks, with what goes without them.
    missing: Vec<(&'static str, &'static str)>,
}

fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> SourceError {
    let what = what.into();
    move |source| SourceError::Io { what, source }
}

/// Effective capabilities allow loading tracing programs.
pub(crate) fn privileged() -> bool {
    const CAP_SYS_ADMIN: u32 = 21;
    const CAP_PERFMON: u32 = 38;
    const CAP_BPF: u32 = 39;
    let Ok(status) = fs::read_to_string("/proc/self/status") else { return false };
    let Some(caps) =
        status.lines().find_map(|l| l.strip_prefix("CapEff:")).and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
    else {
        return false;
    };
    let has = |c: u32| caps & (1u64 << c) != 0;
    has(CAP_SYS_ADMIN) || (has(CAP_BPF) && has(CAP_PERFMON))
}

/// tracefs is root-only (0700): without CAP_DAC_READ_SEARCH a non-root agent
/// holding CAP_BPF + CAP_PERFMON sees it as missing, which is not the fix to suggest.
pub(crate) fn tracefs_unreadable() -> bool {
    ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"]
        .iter()
        .any(|p| std::fs::read_dir(p).is_err_and(|e| e.kind() == std::io::ErrorKind::PermissionDenied))
}

pub(crate) fn tracefs_mounted() -> bool {
    ["/sys/kernel/tracing/events/syscalls", "/sys/kernel/debug/tracing/events/syscalls"]
        .iter()
        .any(|p| Path::new(p).is_dir())
}

/// The inode number of the initial pid namespace (`PROC_PID_INIT_INO`).
const INIT_PIDNS_INO: u64 = 0xEFFF_FFFC;

/// The inode number in a `/proc/PID/ns/pid` link (`pid:[4026531836]`).
fn parse_pidns_link(link: &str) -> Option<u64> {
    link.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
}

/// The agent's pid namespace as the programs' `pidns_ino`: 0 in the initial
/// namespace (global pids, nothing translated), else its inode number, and
/// the programs see every task by its pid in it (a sidecar sharing a pod's
/// process namespace: docs/deploy.md).
pub(crate) fn agent_pidns() -> Result<u32, SourceError> {
    let path = "/proc/self/ns/pid";
    let link = std::fs::read_link(path).map_err(io_err(format!("reading {path} (is /proc mounted?)")))?;
    let link = link.to_string_lossy();
    let ino = parse_pidns_link(&link).ok_or_else(|| SourceError::InvalidConfig(format!("{path} reads {link:?}, not pid:[INODE]")))?;
    if ino == INIT_PIDNS_INO {
        return Ok(0);
    }
    // /proc of another namespace (a pid namespace entered without mounting
    // its own /proc) names processes by pids the programs would not use.
    let own = std::process::id();
    let seen = std::fs::read_link("/proc/self").map(|p| p.to_string_lossy().into_owned()).unwrap_or_else(|e| e.to_string());
    if seen != own.to_string() {
        return Err(SourceError::InvalidConfig(format!(
            "/proc is not this pid namespace's (/proc/self is {seen}, this process is pid {own}): mount its own /proc (`unshare --pid --fork --mount-proc`; a container has its own)"
        )));
    }
    // nsfs inode numbers are 32-bit (ns_common.inum is an unsigned int).
    u32::try_from(ino).map_err(|_| SourceError::InvalidConfig(format!("{path}: inode {ino} does not fit the kernel's 32-bit inum")))
}

fn pid_exists(pid: u32) -> bool {
    pid != 0 && Path::new(&format!("/proc/{pid}/stat")).exists()
}

/// `ppid` from /proc/PID/stat (the comm field may hold spaces and parentheses).
fn parse_ppid(stat: &str) -> Option<u32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let _state = fields.next()?;
    fields.next()?.parse().ok()
}

/// Every live process's parent, from /proc.
fn process_parents() -> Result<HashMap<u32, u32>, SourceError> {
    let mut parents = HashMap::new();
    for entry in fs::read_dir("/proc").map_err(io_err("listing /proc"))? {
        let Ok(entry) = entry else { continue };
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        // Processes come and go during the scan: a vanished one is simply skipped.
        let Ok(stat) = fs::read_to_string(entry.path().join("stat")) else { continue };
        if let Some(ppid) = parse_ppid(&stat) {
            parents.insert(pid, ppid);
        }
    }
    Ok(parents)
}

/// `roots` plus all their descendants that are alive now.
fn descendants(roots: &BTreeSet<u32>, parents: &HashMap<u32, u32>) -> BTreeSet<u32> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for (&pid, &ppid) in parents {
        children.entry(ppid).or_default().push(pid);
    }
    let mut out = roots.clone();
    let mut stack: Vec<u32> = roots.iter().copied().collect();
    while let Some(p) = stack.pop() {
        for &c in children.get(&p).map(Vec::as_slice).unwrap_or(&[]) {
            if out.insert(c) {
                stack.push(c);
            }
        }
    }
    out
}

impl EbpfSource {
    /// Checks the platform, loads and attaches all programs, and starts tracing
    /// `cfg.pids` and their descendants.
    pub fn start(cfg: EbpfConfig) -> Result<EbpfSource, SourceError> {
        if hopscope_ebpf::PROGRAM_IS_PLACEHOLDER {
            return Err(SourceError::Placeholder(hopscope_ebpf::PLACEHOLDER_REASON));
        }
        if !privileged() {
            return Err(SourceError::NotPrivileged);
        }
        if !tracefs_mounted() {
            return Err(if tracefs_unreadable() { SourceError::TracefsUnreadable } else { SourceError::TracefsMissing });
        }
        if !Path::new("/sys/kernel/btf/vmlinux").exists() {
            return Err(SourceError::NoBtf);
        }
        if let Some(&pid) = cfg.pids.iter().find(|&&p| !pid_exists(p)) {
            return Err(SourceError::PidNotFound(pid));
        }
        for (name, len, max) in [
            ("capture_len", cfg.capture_len, HS_MAX_CAPTURE),
            ("capture_len_unix", cfg.capture_len_unix, HS_MAX_CAPTURE),
            ("capture_tail_unix", cfg.capture_tail_unix, HS_MAX_TAIL),
            ("capture_tail", cfg.capture_tail, HS_MAX_TAIL),
        ] {
            if len > max {
                return Err(SourceError::InvalidConfig(format!("{name} {len} exceeds the kernel maximum {max}")));
            }
        }
        let ringbuf_bytes =
            cfg.ringbuf_bytes.max(4096).checked_next_power_of_two().ok_or_else(|| {
                SourceError::InvalidConfig(format!("ringbuf_bytes {} is too large", cfg.ringbuf_bytes))
            })?;
        let least = min_ringbuf_bytes((cfg.capture_len + cfg.capture_tail).max(cfg.capture_len_unix + cfg.capture_tail_unix));
        if u64::from(ringbuf_bytes) < least {
            return Err(SourceError::InvalidConfig(format!(
                "ringbuf_bytes {ringbuf_bytes} holds fewer than {RING_MIN_RECORDS} records of the largest capture: use at least {least} bytes or smaller captures"
            )));
        }
        // One staging area per possible CPU (the program indexes it by CPU).
        let cpus = aya::util::nr_cpus().map_err(|(what, source)| SourceError::Io { what: format!("reading {what}"), source })?;
        let cpus = u32::try_from(cpus).map_err(|_| SourceError::InvalidConfig(format!("{cpus} possible CPUs")))?;
        // RLIMIT_MEMLOCK: kernels >= 5.11 charge BPF memory to the cgroup and
        // ignore it; on older kernels aya raises it and retries on EPERM.

        let mut times = StartupTimes::default();
        let t = Instant::now();
        let btf = Btf::from_sys_fs().map_err(SourceError::Btf)?;
        let self_tgid = std::process::id();
        let pidns_ino = agent_pidns()?;
        let mut ebpf = EbpfLoader::new()
            .btf(Some(&btf))
            .override_global("self_tgid", &self_tgid, true)
            .override_global("pidns_ino", &pidns_ino, true)
            .override_global("capture_len", &cfg.capture_len, true)
            .override_global("capture_len_unix", &cfg.capture_len_unix, true)
            .override_global("capture_tail_unix", &cfg.capture_tail_unix, true)
            .override_global("capture_tail", &cfg.capture_tail, true)
            .override_global("min_offcpu_ns", &cfg.min_offcpu_ns, true)
            .override_global("wakeup_bytes", &cfg.wakeup_bytes, true)
            .override_global("fail_offcpu_alloc", &u8::from(cfg.fail_offcpu_alloc), true)
            .override_global("fail_inflight_alloc", &u8::from(cfg.fail_inflight_alloc), true)
            .map_max_entries("events", ringbuf_bytes)
            .map_max_entries("scratch", cpus)
            // `inflight` and `offcpu` are task storage, which aya creates but
            // has no user-space type for; only the programs use them.
            .allow_unsupported_maps()
            .load(hopscope_ebpf::object())
            .map_err(SourceError::Load)?;
        times.object = t.elapsed();

        let names: BTreeSet<String> = ebpf.programs().map(|(n, _)| n.to_string()).collect();
        let expected: BTreeSet<String> = SYSCALL_PROGRAMS
            .iter()
            .chain(BTF_PROGRAMS)
            .chain(SOCK_PROGRAMS.iter().map(|(f, _, _)| f))
            .map(|s| s.to_string())
            .collect();
        if names != expected {
            return Err(SourceError::ObjectMismatch(format!(
                "unexpected programs {:?}, missing programs {:?}",
                names.difference(&expected).collect::<Vec<_>>(),
                expected.difference(&names).collect::<Vec<_>>()
            )));
        }

        // Optional programs whose tracepoint this kernel lacks are neither
        // loaded nor attached (an unloaded program costs nothing).
        let missing: Vec<&(&str, &str, &str)> = OPTIONAL_PROGRAMS.iter().filter(|(_, tp, _)| !tracepoint_exists(tp)).collect();
        let skipped = |name: &str| missing.iter().any(|(f, _, _)| *f == name);
        let t = Instant::now();
        for (name, prog) in ebpf.programs_mut() {
            if skipped(name) {
                continue;
            }
            let res = match prog {
                Program::TracePoint(p) => p.load(),
                Program::BtfTracePoint(p) => p.load(name, &btf),
                other => {
                    return Err(SourceError::ObjectMismatch(format!(
                        "program {name} has unexpected type {:?}",
                        other.prog_type()
                    )))
                }
            };
            res.map_err(|source| SourceError::ProgramLoad { name: name.to_string(), source })?;
        }
        times.verify = t.elapsed();

        let t = Instant::now();
        for (name, prog) in ebpf.programs_mut() {
            if skipped(name) {
                continue;
            }
            let res = match prog {
                Program::TracePoint(p) => attach_tracepoint(p, name),
                Program::BtfTracePoint(p) => attach_btf(p),
                _ => unreachable!("checked above"),
            };
            res.map_err(|source| SourceError::Attach { name: name.to_string(), source })?;
        }
        times.attach = t.elapsed();

        let take = |ebpf: &mut Ebpf, name: &'static str| {
            ebpf.take_map(name).ok_or_else(|| SourceError::ObjectMismatch(format!("map {name} missing")))
        };
        let ring = RingBuf::try_from(take(&mut ebpf, "events")?)
            .map_err(|source| SourceError::Map { name: "events", source })?;
        let stats = PerCpuArray::try_from(take(&mut ebpf, "stats")?)
            .map_err(|source| SourceError::Map { name: "stats", source })?;
        let targets = Targets {
            map: BpfHashMap::try_from(take(&mut ebpf, "targets")?)
                .map_err(|source| SourceError::Map { name: "targets", source })?,
            gen: Array::try_from(take(&mut ebpf, "target_gen")?)
                .map_err(|source| SourceError::Map { name: "target_gen", source })?,
            user_gen: 0,
        };
        let host_tgids = match pidns_ino {
            0 => None,
            _ => Some(BpfHashMap::try_from(take(&mut ebpf, "host_tgids")?).map_err(|source| SourceError::Map { name: "host_tgids", source })?),
        };

        let bpf_stats = if cfg.enable_bpf_stats {
            Some(aya::sys::enable_stats(aya::sys::Stats::RunTime).map_err(|e| SourceError::Io {
                what: "enabling bpf run-time stats".into(),
                source: io::Error::other(e),
            })?)
        } else {
            None
        };

        let missing = missing.iter().map(|&&(_, tp, what)| (tp, what)).collect();
        let mut src = EbpfSource { ring, stats, targets, host_tgids, ebpf, _bpf_stats: bpf_stats, times, missing };
        let t = Instant::now();
        src.add_tree(cfg.pids.iter().copied().collect())?;
        src.times.targets = t.elapsed();
        Ok(src)
    }

    /// Inserts `roots` and every descendant, rescanning /proc until no new
    /// process appears (a fork racing with the scan is caught by the kernel or
    /// by the next round).
    fn add_tree(&mut self, roots: BTreeSet<u32>) -> Result<(), SourceError> {
        if roots.is_empty() {
            return Ok(());
        }
        // The agent itself may be in the tree (`--pid` of a shell that ran it):
        // it is inserted like any process and skipped by the kernel's
        // `self_tgid` check, the one place that guarantees it is never traced.
        let mut added: BTreeSet<u32> = BTreeSet::new();
        for _round in 0..16 {
            let all = descendants(&roots, &process_parents()?);
            let new: Vec<u32> = all.difference(&added).copied().collect();
            if new.is_empty() {
                break;
            }
            for pid in new {
                self.targets.insert(pid)?;
                added.insert(pid);
            }
        }
        Ok(())
    }

    /// Starts tracing `pid` and its descendants. For a process the agent
    /// launches itself prefer [`EbpfSource::spawn`], which adds the child before
    /// it executes its first instruction.
    pub fn add_pid(&mut self, pid: u32) -> Result<(), SourceError> {
        if !pid_exists(pid) {
            return Err(SourceError::PidNotFound(pid));
        }
        self.add_tree(BTreeSet::from([pid]))
    }

    /// Spawns `cmd` traced from its very first syscall (for `hopscope run`).
    ///
    /// Handshake: between fork and exec the child writes its pid to a pipe and
    /// blocks reading a second pipe; a helper thread reads the pid, inserts it
    /// into `targets`, and only then releases the child, which execs. (A plain
    /// "spawn, then add_pid" would miss the program's startup; a SIGSTOPped
    /// child would deadlock `Command::spawn`, which waits for the exec.) If the
    /// pid cannot be added the child exits before exec and this returns the error.
    /// `cmd` is taken by value: its pre-exec hook refers to this call's pipes.
    pub fn spawn(&mut self, mut cmd: Command) -> Result<Child, SourceError> {
        let (mut pid_rx, pid_tx) = io::pipe().map_err(io_err("creating the spawn handshake pipe"))?;
        let (go_rx, mut go_tx) = io::pipe().map_err(io_err("creating the spawn handshake pipe"))?;
        let (pid_r, pid_w) = (pid_rx.as_raw_fd(), pid_tx.as_raw_fd());
        let (go_r, go_w) = (go_rx.as_raw_fd(), go_tx.as_raw_fd());
        // SAFETY: the closure runs in the forked child before exec, where only
        // async-signal-safe calls are allowed: it calls prctl with integer
        // arguments, and close, getpid, write and read on raw fds that are open in the child (the parent keeps the
        // OwnedFds alive until spawn returns; all four are O_CLOEXEC, so none
        // leaks into the program); it allocates nothing and takes no locks.
        unsafe {
            cmd.pre_exec(move || {
                // Ambient capabilities given to a non-root hopscope are for
                // tracing, not for the server: it execs with what it would have
                // had without hopscope. (Failure only means an old kernel
                // without ambient capabilities, where there is nothing to clear.)
                libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong, 0 as libc::c_ulong, 0 as libc::c_ulong, 0 as libc::c_ulong);
                // Drop the child's copies of the parent's ends, so that the parent
                // closing `go` reads as EOF here instead of blocking forever.
                libc::close(pid_r);
                libc::close(go_w);
                let pid = libc::getpid().to_ne_bytes();
                if libc::write(pid_w, pid.as_ptr().cast(), pid.len()) != pid.len() as isize {
                    return Err(io::Error::last_os_error());
                }
                let mut go = [0u8; 1];
                loop {
                    let n = libc::read(go_r, go.as_mut_ptr().cast(), 1);
                    if n == 1 && go[0] == 1 {
                        return Ok(());
                    }
                    if n == 1 {
                        return Err(io::Error::other("hopscope could not trace the child"));
                    }
                    if n == 0 {
                        return Err(io::Error::other("hopscope could not trace the child"));
                    }
                    if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                        return Err(io::Error::last_os_error());
                    }
                }
            });
        }
        let targets = &mut self.targets;
        std::thread::scope(|s| {
            let helper = s.spawn(move || -> Result<(), SourceError> {
                use std::io::{Read, Write};
                let mut buf = [0u8; 4];
                // EOF here means spawn failed before the child could write.
                if pid_rx.read_exact(&mut buf).is_err() {
                    return Ok(());
                }
                let pid = i32::from_ne_bytes(buf) as u32;
                if let Err(e) = targets.insert(pid) {
                    // Tell the child to abort its exec; spawn then fails.
                    let _ = go_tx.write_all(&[0]);
                    return Err(e);
                }
                go_tx.write_all(&[1]).map_err(io_err("releasing the spawned child"))?;
                Ok(())
            });
            let child = cmd.spawn();
            // Unblock the helper if no child ever wrote its pid.
            drop(pid_tx);
            drop(go_rx);
            let helper = helper.join().unwrap_or_else(|_| {
                Err(SourceError::Io { what: "spawn helper thread".into(), source: io::Error::other("panicked") })
            });
            match (child, helper) {
                (Ok(child), Ok(())) => Ok(child),
                (_, Err(e)) => Err(e),
                (Err(e), Ok(())) => Err(SourceError::Io { what: "spawning the traced command".into(), source: e }),
            }
        })
    }

    /// Waits up to `timeout` for the kernel's wake-up, then drains every
    /// available sample into `f`. Returns how many samples were drained. Call
    /// it in a loop: the timeout is the timer drain that picks up records the
    /// kernel did not wake us for (below `wakeup_bytes`).
    pub fn poll(
        &mut self,
        timeout: Duration,
        mut f: impl FnMut(Result<KEvent, DecodeError>),
    ) -> Result<usize, SourceError> {
        let mut pfd = libc::pollfd { fd: self.ring.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: `pfd` is one valid, writable pollfd and we pass nfds = 1; its
        // fd belongs to `self.ring`, which outlives the call.
        let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
        if rc < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(SourceError::Io { what: "polling the ring buffer".into(), source: e });
            }
        }
        Ok(self.drain(&mut f))
    }

    /// Drains available samples without waiting.
    pub fn drain(&mut self, mut f: impl FnMut(Result<KEvent, DecodeError>)) -> usize {
        let mut n = 0;
        while n < MAX_DRAIN {
            let Some(item) = self.ring.next() else { break };
            f(KEvent::try_from(&*item));
            n += 1;
        }
        n
    }

    /// The kernel counters, summed over CPUs. A counter that cannot be read
    /// (not expected for an in-range per-CPU array index) reads as 0.
    pub fn stats(&self) -> KernelStats {
        let mut values = [0u64; HS_STAT_MAX as usize];
        for (i, v) in values.iter_mut().enumerate() {
            if let Ok(per_cpu) = self.stats.get(&(i as u32), 0) {
                *v = per_cpu.iter().fold(0u64, |a, b| a.wrapping_add(*b));
            }
        }
        KernelStats { values }
    }

    /// `(program, run_cnt, run_time_ns)` for every program, from the kernel's
    /// bpf prog info. The kernel only counts while BPF stats are enabled
    /// (`EbpfConfig::enable_bpf_stats` or `sysctl kernel.bpf_stats_enabled=1`);
    /// otherwise the numbers stay 0.
    pub fn program_stats(&self) -> Vec<(String, u64, u64)> {
        let mut out: Vec<(String, u64, u64)> = self
            .ebpf
            .programs()
            .filter_map(|(name, p)| {
                let info = p.info().ok()?;
                Some((name.to_string(), info.run_count(), info.run_time().as_nanos() as u64))
            })
            .collect();
        out.sort();
        out
    }

    /// Optional tracepoints (`category:name`) this kernel lacks, each with
    /// what the recording goes without (see [`OPTIONAL_PROGRAMS`]).
    pub fn missing_tracepoints(&self) -> &[(&'static str, &'static str)] {
        &self.missing
    }

    /// How long each startup stage took.
    pub fn startup_times(&self) -> StartupTimes {
        self.times
    }

    /// Processes (tgids) currently traced.
    pub fn targets(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.targets.map.keys().filter_map(Result::ok).collect();
        v.sort_unstable();
        v
    }

    /// Traced processes as (tgid, tgid in the initial pid namespace), the
    /// pid NVML names them by. In a container's pid namespace a process is
    /// known once one of its threads has been switched out while traced
    /// (hopscope.bpf.c `host_tgids`); until then it is left out.
    pub fn host_targets(&self) -> Vec<(u32, u32)> {
        let targets = self.targets();
        match &self.host_tgids {
            None => targets.into_iter().map(|t| (t, t)).collect(),
            Some(m) => targets.into_iter().filter_map(|t| Some((t, m.get(&t, 0).ok()?))).collect(),
        }
    }
}

/// The `targets` map and the generation the kernel's per-CPU verdict cache
/// checks (hopscope.bpf.c `tcache`): every insert from user space is
/// followed by a bump of `target_gen[0]`, whose only writer is this.
struct Targets {
    map: BpfHashMap<MapData, u32, u8>,
    gen: Array<MapData, u64>,
    user_gen: u64,
}

impl Targets {
    fn insert(&mut self, pid: u32) -> Result<(), SourceError> {
        self.map.insert(pid, 1, 0).map_err(|source| SourceError::Map { name: "targets", source })?;
        self.user_gen += 1;
        self.gen.set(0, self.user_gen, 0).map_err(|source| SourceError::Map { name: "target_gen", source })
    }
}

fn attach_tracepoint(p: &mut TracePoint, name: &str) -> Result<(), ProgramError> {
    match SOCK_PROGRAMS.iter().find(|(f, _, _)| *f == name) {
        Some((_, category, tp)) => p.attach(category, tp).map(drop),
        None => p.attach("syscalls", name).map(drop),
    }
}

fn attach_btf(p: &mut BtfTracePoint) -> Result<(), ProgramError> {
    p.attach().map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pid_namespace_link_gives_its_inode_and_the_initial_one_is_untranslated() {
        assert_eq!(parse_pidns_link("pid:[4026531836]"), Some(INIT_PIDNS_INO));
        assert_eq!(parse_pidns_link("pid:[4026532291]"), Some(4026532291));
        assert_eq!(parse_pidns_link("net:[4026531840]"), None);
        assert_eq!(parse_pidns_link("pid:[]"), None);
        // This test process: the initial namespace gives 0, any other its inode.
        let own = parse_pidns_link(&std::fs::read_link("/proc/self/ns/pid").unwrap().to_string_lossy()).unwrap();
        assert_eq!(u64::from(agent_pidns().unwrap()), if own == INIT_PIDNS_INO { 0 } else { own });
    }

    #[test]
    fn ppid_is_parsed_after_a_comm_with_spaces_and_parens() {
        assert_eq!(parse_ppid("123 (my (odd) name) S 45 123 123 0"), Some(45));
        assert_eq!(parse_ppid("garbage"), None);
    }

    #[test]
    fn descendants_follow_the_whole_tree_and_nothing_else() {
        let parents = HashMap::from([(2, 1), (3, 2), (4, 3), (5, 1), (6, 99)]);
        let got = descendants(&BTreeSet::from([2]), &parents);
        assert_eq!(got, BTreeSet::from([2, 3, 4]));
    }

    #[test]
    fn kernel_stats_names_cover_every_counter() {
        let mut values = [0u64; HS_STAT_MAX as usize];
        values[hopscope_ebpf::layout::HS_STAT_RINGBUF_FULL as usize] = 7;
        let s = KernelStats::from_values(values);
        assert_eq!(s.get("kernel_ringbuf_full"), Some(7));
        assert_eq!(s.get("kernel_truncated"), Some(0));
        assert_eq!(s.get("no_such_counter"), None);
        let names: Vec<&str> = s.iter().map(|(n, _)| n).collect();
        assert!(names.contains(&"kernel_sched_short_ns"));
        assert!(names.iter().all(|n| n.starts_with("kernel_") && *n == n.to_lowercase()));
    }

    #[test]
    fn default_config_is_within_kernel_limits() {
        let c = EbpfConfig::default();
        assert_eq!((c.capture_len, c.capture_len_unix, c.capture_tail_unix, c.capture_tail), (4096, 32768, 4096, 16384));
        assert!(c.capture_len <= HS_MAX_CAPTURE && c.capture_len_unix <= HS_MAX_CAPTURE);
        assert!(c.capture_tail_unix <= HS_MAX_TAIL && c.capture_tail <= HS_MAX_TAIL);
        assert!(c.ringbuf_bytes.is_power_of_two());
        assert!(u64::from(c.ringbuf_bytes) >= min_ringbuf_bytes(c.capture_len_unix + c.capture_tail_unix));
        assert!(u64::from(c.ringbuf_bytes) >= min_ringbuf_bytes(c.capture_len + c.capture_tail));
    }

    #[test]
    fn the_smallest_ring_holds_sixteen_records_of_the_largest_capture() {
        // 96-byte io header + 32 KiB + the ring's 8-byte header, 16 times.
        assert_eq!(HS_IO_SIZE, 96);
        assert_eq!(min_ringbuf_bytes(32768), 16 * 32872);
        // Records are 8-byte aligned in the ring.
        assert_eq!(min_ringbuf_bytes(1), 16 * 112);
        // `--ringbuf-mib 1`, the CLI's smallest ring, takes the largest
        // capture with the largest tail.
        assert!(min_ringbuf_bytes(HS_MAX_CAPTURE + HS_MAX_TAIL) <= 1 << 20);
    }
}
