//! `hopscope doctor`: what this machine supports and what to fix, one line
//! per check. It loads the real eBPF programs (attached to nothing) when it
//! can, because a verifier or attach failure is what users hit first.

use crate::source::ebpf::{self, EbpfConfig, EbpfSource};
use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    Ok,
    Warn,
    Fail,
}

#[derive(Debug, Clone)]
pub struct Check {
    pub what: &'static str,
    pub level: Level,
    /// What was found, and when not OK, what to do.
    pub detail: String,
}

fn check(what: &'static str, level: Level, detail: impl Into<String>) -> Check {
    Check { what, level, detail: detail.into() }
}

fn kernel_at_least(release: &str, major: u32, minor: u32) -> Option<bool> {
    let mut it = release.split(|c: char| !c.is_ascii_digit());
    let ma: u32 = it.next()?.parse().ok()?;
    let mi: u32 = it.next()?.parse().ok()?;
    Some((ma, mi) >= (major, minor))
}

/// Finds a shared library by name in the usual places and the Python wheels.
fn find_lib(names: &[&str], extra_dirs: &[&str]) -> Option<String> {
    let mut dirs: Vec<String> = ["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/cuda/lib64"].iter().map(|s| s.to_string()).collect();
    dirs.extend(extra_dirs.iter().map(|s| s.to_string()));
    for d in dirs {
        for n in names {
            let p = Path::new(&d).join(n);
            if p.exists() {
                return Some(p.display().to_string());
            }
        }
    }
    None
}

/// Runs every check. `load` also loads and attaches the eBPF programs.
pub fn run(load: bool) -> Vec<Check> {
    let mut out = Vec::new();
    let release = crate::sys::kernel_release();
    match kernel_at_least(&release, 5, 15) {
        Some(true) => out.push(check("kernel", Level::Ok, release.clone())),
        Some(false) => out.push(check("kernel", Level::Fail, format!("{release}: hopscope needs Linux >= 5.15 (ring buffer, BTF tracepoints)"))),
        None => out.push(check("kernel", Level::Warn, format!("cannot parse release {release:?}"))),
    }
    out.push(if Path::new("/sys/kernel/btf/vmlinux").exists() {
        check("btf", Level::Ok, "/sys/kernel/btf/vmlinux")
    } else {
        check("btf", Level::Fail, "kernel lacks BTF (CONFIG_DEBUG_INFO_BTF): use a distribution kernel built with it")
    });
    out.push(if ebpf::tracefs_mounted() {
        check("tracefs", Level::Ok, "mounted")
    } else {
        check("tracefs", Level::Fail, "not mounted: run `mount -t tracefs nodev /sys/kernel/tracing`")
    });
    let sk_ready = ["/sys/kernel/tracing/events/sock/sk_data_ready", "/sys/kernel/debug/tracing/events/sock/sk_data_ready"].iter().any(|p| Path::new(p).exists());
    out.push(if sk_ready {
        check("wire arrival", Level::Ok, "sock:sk_data_ready present (wire_arrive_ns, read_delay_ms)")
    } else if ebpf::tracefs_mounted() {
        check("wire arrival", Level::Warn, "sock:sk_data_ready missing (kernel < 6.6): wire_arrive_ns will be null")
    } else {
        check("wire arrival", Level::Warn, "unknown until tracefs is mounted")
    });
    out.push(if ebpf::privileged() {
        check("privileges", Level::Ok, "CAP_BPF + CAP_PERFMON (or CAP_SYS_ADMIN)")
    } else {
        check("privileges", Level::Fail, "run as root or grant CAP_BPF,CAP_PERFMON")
    });
    out.push(if hopscope_ebpf::PROGRAM_IS_PLACEHOLDER {
        check("ebpf build", Level::Fail, format!("built without clang-19: {}", hopscope_ebpf::PLACEHOLDER_REASON))
    } else {
        check("ebpf build", Level::Ok, "programs compiled with clang")
    });
    if load && ebpf::privileged() && ebpf::tracefs_mounted() && !hopscope_ebpf::PROGRAM_IS_PLACEHOLDER {
        match EbpfSource::start(EbpfConfig { pids: Vec::new(), ..EbpfConfig::default() }) {
            Ok(src) => {
                let t = src.startup_times();
                out.push(check(
                    "ebpf load",
                    Level::Ok,
                    format!("all programs verified and attached ({} ms: verifier {} ms, attach {} ms)", (t.object + t.verify + t.attach).as_millis(), t.verify.as_millis(), t.attach.as_millis()),
                ));
            }
            Err(e) => {
                let mut msg = e.to_string();
                let mut src = std::error::Error::source(&e);
                while let Some(s) = src {
                    msg.push_str(": ");
                    msg.push_str(&s.to_string());
                    src = s.source();
                }
                out.push(check("ebpf load", Level::Fail, msg));
            }
        }
    }
    match find_lib(&["libcupti.so", "libcupti.so.13", "libcupti.so.12"], &[]) {
        Some(p) => out.push(check("cupti", Level::Ok, p)),
        None => out.push(check(
            "cupti",
            Level::Warn,
            "no system libcupti: the injection library looks in the server's Python env (nvidia-cuda-cupti wheel) or HOPSCOPE_CUPTI_LIB",
        )),
    }
    match find_lib(&["libnvidia-ml.so.1", "libnvidia-ml.so"], &[]) {
        Some(p) => out.push(check("nvml", Level::Ok, p)),
        None => out.push(check("nvml", Level::Warn, "no NVIDIA driver (libnvidia-ml): GPU counters unavailable; wire and IPC tracing work without a GPU")),
    }
    out
}

pub fn render(checks: &[Check]) -> String {
    let mut s = String::new();
    for c in checks {
        let tag = match c.level {
            Level::Ok => "ok  ",
            Level::Warn => "warn",
            Level::Fail => "FAIL",
        };
        s.push_str(&format!("{tag}  {:<13} {}\n", c.what, c.detail));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_versions_compare_numerically() {
        assert_eq!(kernel_at_least("6.18.44-fc-v669", 5, 15), Some(true));
        assert_eq!(kernel_at_least("5.4.0-150-generic", 5, 15), Some(false));
        assert_eq!(kernel_at_least("5.15.0", 5, 15), Some(true));
        assert_eq!(kernel_at_least("garbage", 5, 15), None);
    }

    #[test]
    fn render_puts_one_line_per_check_with_its_level() {
        let text = render(&[check("btf", Level::Ok, "x"), check("tracefs", Level::Fail, "mount it")]);
        assert_eq!(text.lines().count(), 2);
        assert!(text.lines().nth(1).unwrap().starts_with("FAIL  tracefs"));
    }
}
