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

/// A tracepoint hopscope records without when the kernel lacks it
/// (the loader's `OPTIONAL_PROGRAMS`): a warning, never a failure.
fn optional_tracepoint(what: &'static str, tp: &str, present: &'static str, missing: &'static str) -> Check {
    if ebpf::tracepoint_exists(tp) {
        check(what, Level::Ok, present)
    } else if ebpf::tracefs_mounted() {
        check(what, Level::Warn, missing)
    } else {
        check(what, Level::Warn, "unknown until tracefs is mounted")
    }
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
    let unreadable = ebpf::tracefs_unreadable();
    out.push(if ebpf::tracefs_mounted() {
        check("tracefs", Level::Ok, "mounted")
    } else if unreadable {
        check("tracefs", Level::Fail, "not readable by this user (root-only): run as uid 0 or add CAP_DAC_READ_SEARCH (docs/deploy.md)")
    } else {
        check("tracefs", Level::Fail, "not mounted: run `mount -t tracefs nodev /sys/kernel/tracing`")
    });
    out.push(optional_tracepoint(
        "wire arrival",
        "sock:sk_data_ready",
        "sock:sk_data_ready present (wire_arrive_ns, read_delay_ms)",
        "sock:sk_data_ready missing (kernel < 6.6): wire_arrive_ns will be null",
    ));
    out.push(optional_tracepoint(
        "wire departure",
        "net:net_dev_queue",
        "net:net_dev_queue present (responses timed when their bytes leave)",
        "net:net_dev_queue missing: responses are timed at their writes' exits",
    ));
    out.push(if ebpf::privileged() {
        check("privileges", Level::Ok, "CAP_BPF + CAP_PERFMON (or CAP_SYS_ADMIN)")
    } else {
        check("privileges", Level::Fail, "run as root or grant CAP_BPF,CAP_PERFMON")
    });
    out.push(match ebpf::agent_pidns() {
        Ok(0) => check("pid namespace", Level::Ok, "the host's: processes are traced by their global pids"),
        Ok(ino) => check(
            "pid namespace",
            Level::Ok,
            format!("a container's (pid:[{ino}]): processes are traced by their pids in it, those outside it cannot be (docs/deploy.md)"),
        ),
        Err(e) => check("pid namespace", Level::Warn, format!("{e}: the eBPF programs cannot tell which pids this agent sees")),
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
    out.extend(gpu_checks());
    out
}

/// Where the injection library looks for libcupti inside the server
/// (agent-cupti/src/locate.rs) after a copy the process already loaded:
/// `HOPSCOPE_CUPTI_LIB`, then the CUDA wheels in its Python env.
const CUPTI_WHEELS: [&str; 2] = ["nvidia/cu13/lib/libcupti.so.13", "nvidia/cuda_cupti/lib/libcupti.so.12"];

/// Python package directories a server on this machine likely runs from:
/// `$VIRTUAL_ENV`, `./.venv`, the system interpreters'.
fn python_package_dirs() -> Vec<std::path::PathBuf> {
    let mut roots: Vec<std::path::PathBuf> = Vec::new();
    if let Some(v) = std::env::var_os("VIRTUAL_ENV") {
        roots.push(Path::new(&v).join("lib"));
    }
    roots.push(Path::new(".venv/lib").to_owned());
    roots.push("/usr/local/lib".into());
    roots.push("/usr/lib".into());
    let mut out = Vec::new();
    for r in roots {
        let Ok(rd) = std::fs::read_dir(&r) else { continue };
        let mut pys: Vec<std::path::PathBuf> = rd.filter_map(|e| e.ok()).filter(|e| e.file_name().to_string_lossy().starts_with("python3")).map(|e| e.path()).collect();
        pys.sort();
        for py in pys {
            for sub in ["site-packages", "dist-packages"] {
                let d = py.join(sub);
                if d.is_dir() && !out.contains(&d) {
                    out.push(d);
                }
            }
        }
    }
    out
}

/// The first CUDA-wheel libcupti under `dirs`.
fn find_cupti_wheel(dirs: &[std::path::PathBuf]) -> Option<std::path::PathBuf> {
    CUPTI_WHEELS.iter().flat_map(|rel| dirs.iter().map(move |d| d.join(rel))).find(|p| p.exists())
}

/// The GPU side: the injection library `run` hands to the server, the
/// libcupti it will find there, and NVML (driver) for `--nvml-period`.
fn gpu_checks() -> Vec<Check> {
    use crate::source::cupti;
    let mut out = Vec::new();
    out.push(match cupti::find_injection_lib(None) {
        Ok(Some(p)) => check("injection", Level::Ok, p.display().to_string()),
        Ok(None) => check(
            "injection",
            Level::Warn,
            format!("{} not next to hopscope: `run` records without GPU kernels; build it (cargo build -p agent-cupti) or set {}", cupti::INJECTION_LIB_NAME, cupti::INJECTION_LIB_ENV),
        ),
        Err(e) => check("injection", Level::Warn, format!("{e}: `run` records without GPU kernels")),
    });
    let env = std::env::var_os("HOPSCOPE_CUPTI_LIB").filter(|v| !v.is_empty());
    let system = find_lib(&["libcupti.so.13", "libcupti.so.12", "libcupti.so"], &["/usr/local/cuda/extras/CUPTI/lib64"]);
    out.push(match (env, find_cupti_wheel(&python_package_dirs())) {
        (Some(p), _) if Path::new(&p).exists() => check("cupti", Level::Ok, format!("HOPSCOPE_CUPTI_LIB={}", Path::new(&p).display())),
        (Some(p), _) => check("cupti", Level::Fail, format!("HOPSCOPE_CUPTI_LIB={} does not exist: point it at a libcupti.so.12/.13", Path::new(&p).display())),
        (None, Some(w)) => check("cupti", Level::Ok, format!("{} (CUDA wheel; the server must run from this Python env)", w.display())),
        (None, None) => match system {
            Some(p) => check("cupti", Level::Warn, format!("only a system copy at {p}: the injection library does not search system paths; start the server with HOPSCOPE_CUPTI_LIB={p}")),
            None => check(
                "cupti",
                Level::Warn,
                "no libcupti found: pip install the CUDA CUPTI wheel matching the server's CUDA (e.g. nvidia-cuda-cupti-cu12) in its env, or set HOPSCOPE_CUPTI_LIB; wire and IPC tracing work without it",
            ),
        },
    });
    let probe = crate::source::nvml::probe(None);
    out.push(match probe.result {
        Ok((driver, devices)) => {
            let names: Vec<&str> = devices.iter().map(|(name, _)| name.as_str()).collect();
            let gpm = devices.iter().filter(|(_, gpm)| *gpm).count();
            let nvlink = match gpm {
                0 => "no NVLink throughput (it needs GPM: Hopper or newer)".to_owned(),
                n if n == devices.len() => "NVLink throughput from GPM".to_owned(),
                n => format!("NVLink throughput from GPM on {n} of them"),
            };
            check("nvml", Level::Ok, format!("driver {driver}, {} GPU(s): {}; {nvlink}", names.len(), names.join(", ")))
        }
        Err(why) => check("nvml", Level::Warn, format!("{}; GPU samples need the NVIDIA driver (or --nvml-period 0 to stop trying)", why.trim_end_matches(": recording without GPU samples"))),
    });
    out
}

pub fn render(checks: &[Check]) -> String {
    let mut s = String::new();
    let w = checks.iter().map(|c| c.what.len()).max().unwrap_or(0);
    for c in checks {
        let tag = match c.level {
            Level::Ok => "ok  ",
            Level::Warn => "warn",
            Level::Fail => "FAIL",
        };
        s.push_str(&format!("{tag}  {:<w$} {}\n", c.what, c.detail));
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
        let text = render(&[check("btf", Level::Ok, "x"), check("tracefs", Level::Fail, "mount it"), check("wire departure", Level::Warn, "y")]);
        assert_eq!(text.lines().count(), 3);
        assert!(text.lines().nth(1).unwrap().starts_with("FAIL  tracefs"));
        // The details start in one column, however long the longest name.
        let cols: Vec<usize> = ["x", "mount it", "y"].iter().zip(text.lines()).map(|(d, l)| l.find(d).unwrap()).collect();
        assert_eq!(cols, [21, 21, 21], "{text}");
    }

    #[test]
    fn doctor_finds_a_cupti_wheel_where_the_injection_library_looks() {
        let root = std::env::temp_dir().join(format!("hopscope-doctor-{}", std::process::id()));
        let site = root.join("site-packages");
        let lib = site.join("nvidia/cuda_cupti/lib");
        std::fs::create_dir_all(&lib).unwrap();
        assert_eq!(find_cupti_wheel(std::slice::from_ref(&site)), None);
        std::fs::write(lib.join("libcupti.so.12"), b"").unwrap();
        assert_eq!(find_cupti_wheel(std::slice::from_ref(&site)), Some(lib.join("libcupti.so.12")));
        // The CUDA 13 wheel wins over 12, as in agent-cupti's search without a runtime hint.
        let lib13 = site.join("nvidia/cu13/lib");
        std::fs::create_dir_all(&lib13).unwrap();
        std::fs::write(lib13.join("libcupti.so.13"), b"").unwrap();
        assert_eq!(find_cupti_wheel(&[site]), Some(lib13.join("libcupti.so.13")));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn doctor_reports_nvml_and_cupti_with_what_to_fix() {
        let checks = gpu_checks();
        let names: Vec<&str> = checks.iter().map(|c| c.what).collect();
        assert_eq!(names, ["injection", "cupti", "nvml"]);
        let nvml = &checks[2];
        // This machine has no NVIDIA driver unless HOPSCOPE_NVML_LIB points at one.
        if std::env::var_os(crate::source::nvml::LIB_ENV).is_none() && !Path::new("/dev/nvidiactl").exists() {
            assert_eq!(nvml.level, Level::Warn);
            assert!(nvml.detail.contains("no NVIDIA driver here") && nvml.detail.contains("--nvml-period 0"), "{}", nvml.detail);
        }
        for c in &checks {
            if c.level != Level::Ok {
                assert!(c.detail.contains("set ") || c.detail.contains("pip install") || c.detail.contains("build it") || c.detail.contains("NVIDIA driver"), "says what to do: {}", c.detail);
            }
        }
    }
}
