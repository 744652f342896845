//! Least privilege after attaching (docs/reliability.md).
//!
//! Loading and attaching the eBPF programs needs CAP_BPF + CAP_PERFMON (or
//! CAP_SYS_ADMIN) and, as root, much more is there. Once the programs are
//! attached the agent only reads the ring buffer (an mmap it already holds),
//! reads /proc, updates the `targets` map for new pids, reads the stats map,
//! and writes its outputs. [`drop_after_attach`] keeps exactly what that needs
//! and removes everything else from the effective, permitted, inheritable,
//! ambient and bounding sets, so a bug in a decoder of untrusted bytes runs
//! with these rights only.
//!
//! Capabilities are per thread: call it before the agent starts any thread
//! (every later thread inherits the reduced sets). A command started by
//! `hopscope run` is forked before the drop, so it keeps the capabilities
//! hopscope was started with.

/// CAP_CHOWN: the GPU socket is handed to the traced server's owner (`record --pid`).
pub const CAP_CHOWN: u32 = 0;
/// CAP_DAC_OVERRIDE: outputs (`-o`, `--perfetto`) may be in a directory root does not own (`sudo` from a home directory).
pub const CAP_DAC_OVERRIDE: u32 = 1;
/// CAP_SETPCAP: needed to shrink the bounding set, dropped last.
pub const CAP_SETPCAP: u32 = 8;
/// CAP_PERFMON: attaching tracepoints (start only).
pub const CAP_PERFMON: u32 = 38;
/// CAP_BPF: bpf(2) map updates (`add_pid`, new children) and stats reads; kernels
/// before 6.5 check it on every bpf(2) call when unprivileged BPF is disabled.
pub const CAP_BPF: u32 = 39;

/// What the agent keeps after attaching.
pub const KEPT: [u32; 3] = [CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_BPF];

/// [`KEPT`] as a mask (bit n = capability n), the CapEff/CapBnd an agent
/// started as root shows while recording.
pub const KEPT_MASK: u64 = (1 << CAP_CHOWN) | (1 << CAP_DAC_OVERRIDE) | (1 << CAP_BPF);

/// What [`drop_after_attach`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dropped {
    /// Effective = permitted set after the drop.
    pub kept: u64,
    /// Capabilities removed from the bounding set.
    pub bounding_dropped: u32,
    /// The bounding set could not be shrunk (no CAP_SETPCAP: the agent was not
    /// started as root, so exec cannot regain anything either).
    pub bounding_kept: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum PrivilegeError {
    #[error("cannot read the agent's capabilities: {0}")]
    Get(std::io::Error),
    #[error("cannot remove capability {cap} from the bounding set: {source}")]
    Bounding { cap: u32, source: std::io::Error },
    #[error("cannot clear the ambient capabilities: {0}")]
    Ambient(std::io::Error),
    #[error("cannot drop capabilities to {kept:#x}: {source}")]
    Set { kept: u64, source: std::io::Error },
}

/// Names of the capabilities in `mask` that this module knows, for messages.
pub fn names(mask: u64) -> String {
    let known = [(CAP_CHOWN, "CAP_CHOWN"), (CAP_DAC_OVERRIDE, "CAP_DAC_OVERRIDE"), (CAP_SETPCAP, "CAP_SETPCAP"), (CAP_PERFMON, "CAP_PERFMON"), (CAP_BPF, "CAP_BPF")];
    let mut out: Vec<String> = Vec::new();
    for bit in 0..64u32 {
        if mask & (1 << bit) != 0 {
            out.push(known.iter().find(|(c, _)| *c == bit).map_or_else(|| format!("cap{bit}"), |(_, n)| (*n).to_string()));
        }
    }
    out.join(",")
}

/// Drops every capability but [`KEPT`] from the calling thread (see the module
/// docs for when to call it).
pub fn drop_after_attach() -> Result<Dropped, PrivilegeError> {
    let now = crate::sys::capget().map_err(PrivilegeError::Get)?;
    let kept = now.permitted & KEPT_MASK;
    let mut bounding_dropped = 0;
    // The bounding set first: shrinking it needs CAP_SETPCAP, dropped below.
    let bounding_kept = now.effective & (1 << CAP_SETPCAP) == 0;
    if !bounding_kept {
        for cap in 0..=crate::sys::cap_last_cap().min(63) {
            if KEPT_MASK & (1 << cap) != 0 {
                continue;
            }
            match crate::sys::capbset_drop(cap) {
                Ok(()) => bounding_dropped += 1,
                // A capability newer than this kernel: nothing to drop.
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                Err(source) => return Err(PrivilegeError::Bounding { cap, source }),
            }
        }
    }
    match crate::sys::clear_ambient_caps() {
        // Kernels before 4.3 have no ambient set.
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
        Err(e) => return Err(PrivilegeError::Ambient(e)),
    }
    crate::sys::capset(crate::sys::CapSets { effective: kept, permitted: kept, inheritable: 0 })
        .map_err(|source| PrivilegeError::Set { kept, source })?;
    Ok(Dropped { kept, bounding_dropped, bounding_kept })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_lists_known_and_unknown_capabilities_in_order() {
        assert_eq!(names(KEPT_MASK), "CAP_CHOWN,CAP_DAC_OVERRIDE,CAP_BPF");
        assert_eq!(names(1 << 21), "cap21");
        assert_eq!(KEPT_MASK, 0x0000_0080_0000_0003);
    }

    #[test]
    fn dropping_in_a_thread_leaves_only_the_kept_set_there() {
        // A thread of its own: capabilities are per thread, so the test
        // process keeps its own.
        let (before, after) = std::thread::spawn(|| {
            let before = crate::sys::capget().unwrap();
            let d = drop_after_attach().unwrap();
            (before, (d, crate::sys::capget().unwrap()))
        })
        .join()
        .unwrap();
        let (d, sets) = after;
        assert_eq!(d.kept, before.permitted & KEPT_MASK);
        assert_eq!(sets.effective, before.permitted & KEPT_MASK);
        assert_eq!(sets.permitted, before.permitted & KEPT_MASK);
        assert_eq!(sets.inheritable, 0);
        if before.effective & (1 << CAP_SETPCAP) != 0 {
            assert!(!d.bounding_kept);
            assert!(d.bounding_dropped >= 30, "root drops most of the bounding set: {}", d.bounding_dropped);
        }
    }
}
