//! The one place the agent calls libc directly (besides the ring-buffer read in
//! `source::ebpf`). Each wrapper is safe to call and documents why.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// CLOCK_MONOTONIC in nanoseconds: the clock of `bpf_ktime_get_ns()` and of
/// Python's `time.monotonic()`, so every source shares one timeline.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    debug_assert_eq!(rc, 0);
    (ts.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(ts.tv_nsec as u64)
}

/// Effective user id.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Sends `sig` to `pid`; Err carries errno.
pub fn kill(pid: u32, sig: i32) -> std::io::Result<()> {
    let pid = i32::try_from(pid).map_err(|_| std::io::Error::from_raw_os_error(libc::ESRCH))?;
    // SAFETY: kill takes plain integers; a bad pid or signal is reported through errno.
    if unsafe { libc::kill(pid, sig) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// SIGINT and SIGTERM set `stop`; `by_terminal` says whether the latest
/// came from a terminal (its Ctrl-C: the kernel signals the terminal's whole
/// foreground process group) rather than from a process (kill(2): this one
/// alone).
pub fn on_stop_signals(stop: &Arc<AtomicBool>, by_terminal: &Arc<AtomicBool>) -> std::io::Result<()> {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        let (stop, by_terminal) = (Arc::clone(stop), Arc::clone(by_terminal));
        // SAFETY: the action only stores to two atomics (async-signal-safe)
        // after reading the siginfo the kernel passed it.
        unsafe {
            signal_hook_registry::register_sigaction(sig, move |info: &libc::siginfo_t| {
                by_terminal.store(info.si_code == libc::SI_KERNEL, Ordering::SeqCst);
                stop.store(true, Ordering::SeqCst);
            })
        }?;
    }
    Ok(())
}

/// Whether process `pid` is in this process's process group (a terminal's
/// signal to the group reached it too).
pub fn in_my_process_group(pid: u32) -> bool {
    let Ok(pid) = i32::try_from(pid) else { return false };
    // SAFETY: getpgid takes a plain pid (an unknown one gives -1) and
    // getpgrp has no preconditions.
    let (theirs, mine) = unsafe { (libc::getpgid(pid), libc::getpgrp()) };
    theirs > 0 && theirs == mine
}

/// Kernel release (`uname -r`), read from procfs.
pub fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").map(|s| s.trim().to_owned()).unwrap_or_default()
}

pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_owned()).unwrap_or_default()
}

/// The state letter of a process from /proc/PID/stat (R, S, T, Z…), if it exists.
pub fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The comm field may contain spaces and parentheses: the state follows the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().next()?.chars().next()
}

/// The calling thread's capability sets (effective, permitted, inheritable)
/// as 64-bit masks (bit n = capability n).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapSets {
    pub effective: u64,
    pub permitted: u64,
    pub inheritable: u64,
}

/// `_LINUX_CAPABILITY_VERSION_3`: two 32-bit words per set.
const CAP_VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// capget(2) for the calling thread.
pub fn capget() -> std::io::Result<CapSets> {
    let mut hdr = CapHeader { version: CAP_VERSION_3, pid: 0 };
    let mut data = [CapData::default(); 2];
    // SAFETY: version 3 makes the kernel read one header and write exactly two
    // CapData structs; both point to live, writable, correctly laid out memory.
    let rc = unsafe { libc::syscall(libc::SYS_capget, &raw mut hdr, data.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let join = |lo: u32, hi: u32| u64::from(lo) | (u64::from(hi) << 32);
    Ok(CapSets {
        effective: join(data[0].effective, data[1].effective),
        permitted: join(data[0].permitted, data[1].permitted),
        inheritable: join(data[0].inheritable, data[1].inheritable),
    })
}

/// capset(2) for the calling thread (only that thread: call it before other
/// threads exist for it to cover the process).
pub fn capset(sets: CapSets) -> std::io::Result<()> {
    let hdr = CapHeader { version: CAP_VERSION_3, pid: 0 };
    let split = |v: u64| (v as u32, (v >> 32) as u32);
    let (e0, e1) = split(sets.effective);
    let (p0, p1) = split(sets.permitted);
    let (i0, i1) = split(sets.inheritable);
    let data = [CapData { effective: e0, permitted: p0, inheritable: i0 }, CapData { effective: e1, permitted: p1, inheritable: i1 }];
    // SAFETY: the kernel reads one header and two CapData structs, all live
    // and laid out as `struct __user_cap_header_struct` / `__user_cap_data_struct`.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &raw const hdr, data.as_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Removes capability `cap` from the calling thread's bounding set
/// (needs CAP_SETPCAP in the effective set).
pub fn capbset_drop(cap: u32) -> std::io::Result<()> {
    // SAFETY: prctl with integer arguments only; errors come back through errno.
    let rc = unsafe { libc::prctl(libc::PR_CAPBSET_DROP, libc::c_ulong::from(cap), 0 as libc::c_ulong, 0 as libc::c_ulong, 0 as libc::c_ulong) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Clears the calling thread's ambient capability set.
pub fn clear_ambient_caps() -> std::io::Result<()> {
    // SAFETY: prctl with integer arguments only; errors come back through errno.
    let rc = unsafe { libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong, 0 as libc::c_ulong, 0 as libc::c_ulong, 0 as libc::c_ulong) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The highest capability number this kernel knows.
pub fn cap_last_cap() -> u32 {
    std::fs::read_to_string("/proc/sys/kernel/cap_last_cap").ok().and_then(|s| s.trim().parse().ok()).unwrap_or(40)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monotonic_clock_advances() {
        let a = monotonic_ns();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let b = monotonic_ns();
        assert!(b >= a + 2_000_000, "{a} -> {b}");
    }

    #[test]
    fn a_stopped_child_reads_as_t_and_a_missing_pid_has_no_state() {
        let mut child = std::process::Command::new("sleep").arg("5").spawn().unwrap();
        kill(child.id(), libc::SIGSTOP).unwrap();
        let mut state = None;
        for _ in 0..500 {
            state = proc_state(child.id());
            if state == Some('T') {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(state, Some('T'));
        assert_eq!(proc_state(u32::MAX - 1), None);
    }
}
