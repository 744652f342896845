//! The one place the agent calls libc directly (besides the ring-buffer read in
//! `source::ebpf`). Each wrapper is safe to call and documents why.

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
