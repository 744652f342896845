//! Settings from the environment (the agent sets them for the server's
//! process tree; children inherit them).

use std::path::PathBuf;

/// Which clock path to use for timestamps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClockChoice {
    /// Callback where the CUPTI version is safe, calibration elsewhere.
    Auto,
    Callback,
    Calibrate,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// `HOPSCOPE_GPU_SOCKET`: the agent's unix socket. Unset: stay inactive.
    pub socket: Option<PathBuf>,
    /// `HOPSCOPE_CUPTI_LIB`: libcupti to use when the process has none loaded.
    pub cupti_lib: Option<PathBuf>,
    /// `HOPSCOPE_CUPTI_FLUSH_MS` (250): period of `cuptiActivityFlushAll(0)`.
    pub flush_ms: u64,
    /// `HOPSCOPE_CUPTI_BUFFER_KB` (4096): size of each activity buffer.
    pub buffer_bytes: usize,
    /// `HOPSCOPE_CUPTI_BUFFERS` (16): most buffers out at once (CUPTI drops
    /// records, and counts them, when none is free).
    pub max_buffers: usize,
    /// `HOPSCOPE_GPU_QUEUE_KB` (32768): bound of encoded bytes waiting to be sent.
    pub queue_bytes: usize,
    /// `HOPSCOPE_GPU_RECONNECT_MS` (500): pause between connection attempts.
    pub reconnect_ms: u64,
    /// `HOPSCOPE_GPU_REPORT_MS` (1000): period of counter reports.
    pub report_ms: u64,
    /// `HOPSCOPE_GPU_EXIT_DRAIN_MS` (1000): most time the exit handler waits
    /// for the last records to be written.
    pub exit_drain_ms: u64,
    /// `HOPSCOPE_CUPTI_CLOCK` (auto | callback | calibrate).
    pub clock: ClockChoice,
    /// `HOPSCOPE_CUPTI_API` (1): trace launch/copy/sync/graph-launch API calls.
    pub api: bool,
    /// `HOPSCOPE_CUPTI_KINDS` (all): which activity kinds to enable, a comma list of
    /// `kernel`, `memcpy`, `memcpy2`, `memset`, `sync` (kernel always), for a server where
    /// fewer records cost less.
    pub kinds: Kinds,
    /// `HOPSCOPE_CUPTI_GRAPHS` (node): `node` traces each kernel a CUDA graph runs;
    /// `launch` traces each graph launch as one record (CUPTI's GRAPH_TRACE: far fewer
    /// records and less of CUPTI's own cost, no per-kernel names or grids inside graphs).
    pub graph_launches: bool,
    /// `HOPSCOPE_CUPTI_LOG` (0): one line on success too (failures always print one line).
    pub verbose: bool,
    /// `HOPSCOPE_CUPTI_DUMP_DIR`: also write raw activity buffers there (fixtures).
    pub dump_dir: Option<PathBuf>,
    /// `HOPSCOPE_CUPTI_DUMP_MAX_KB` (1024): cap on dumped bytes per process.
    pub dump_max_bytes: usize,
    /// `HOPSCOPE_CUPTI_FORCE_INIT_FAILURE` (0): make InitializeInjection
    /// return 0, to check what a driver does with a failed injection.
    pub force_init_failure: bool,
}

/// The optional activity kinds (`HOPSCOPE_CUPTI_KINDS`); kernel records are always on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kinds {
    pub memcpy: bool,
    pub memcpy2: bool,
    pub memset: bool,
    pub sync: bool,
}

impl Kinds {
    pub const ALL: Kinds = Kinds { memcpy: true, memcpy2: true, memset: true, sync: true };

    /// Whether `kind` (one of the library's activity kinds) is to be enabled.
    pub fn wants(&self, kind: cupti_sys::CUpti_ActivityKind) -> bool {
        use cupti_sys::*;
        match kind {
            CUPTI_ACTIVITY_KIND_MEMCPY => self.memcpy,
            CUPTI_ACTIVITY_KIND_MEMCPY2 => self.memcpy2,
            CUPTI_ACTIVITY_KIND_MEMSET => self.memset,
            CUPTI_ACTIVITY_KIND_SYNCHRONIZATION => self.sync,
            _ => true,
        }
    }

    fn parse(list: &str) -> Option<Kinds> {
        let mut k = Kinds { memcpy: false, memcpy2: false, memset: false, sync: false };
        for name in list.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            match name {
                "kernel" => {}
                "memcpy" => k.memcpy = true,
                "memcpy2" => k.memcpy2 = true,
                "memset" => k.memset = true,
                "sync" => k.sync = true,
                _ => return None,
            }
        }
        Some(k)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{var}={value:?} is not valid: expected {expected}")]
pub struct ConfigError {
    pub var: &'static str,
    pub value: String,
    pub expected: &'static str,
}

impl Config {
    pub fn from_env() -> Result<Config, ConfigError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        let num = |var: &'static str, default: u64, min: u64, max: u64| -> Result<u64, ConfigError> {
            match get(var) {
                None => Ok(default),
                Some(v) if v.trim().is_empty() => Ok(default),
                Some(v) => match v.trim().parse::<u64>() {
                    Ok(n) if (min..=max).contains(&n) => Ok(n),
                    _ => Err(ConfigError { var, value: v, expected: "a whole number in range" }),
                },
            }
        };
        let flag = |var: &'static str, default: bool| -> Result<bool, ConfigError> {
            match get(var).as_deref().map(str::trim) {
                None | Some("") => Ok(default),
                Some("1" | "true" | "yes" | "on") => Ok(true),
                Some("0" | "false" | "no" | "off") => Ok(false),
                Some(v) => Err(ConfigError { var, value: v.into(), expected: "0 or 1" }),
            }
        };
        let path = |var: &str| get(var).filter(|v| !v.trim().is_empty()).map(PathBuf::from);
        let clock = match get("HOPSCOPE_CUPTI_CLOCK").as_deref().map(str::trim) {
            None | Some("") | Some("auto") => ClockChoice::Auto,
            Some("callback") => ClockChoice::Callback,
            Some("calibrate") => ClockChoice::Calibrate,
            Some(v) => {
                return Err(ConfigError { var: "HOPSCOPE_CUPTI_CLOCK", value: v.into(), expected: "auto, callback or calibrate" })
            }
        };
        let kinds = match get("HOPSCOPE_CUPTI_KINDS") {
            None => Kinds::ALL,
            Some(v) if v.trim().is_empty() => Kinds::ALL,
            Some(v) => Kinds::parse(&v).ok_or(ConfigError {
                var: "HOPSCOPE_CUPTI_KINDS",
                value: v,
                expected: "a comma list of kernel, memcpy, memcpy2, memset, sync",
            })?,
        };
        let graph_launches = match get("HOPSCOPE_CUPTI_GRAPHS").as_deref().map(str::trim) {
            None | Some("") | Some("node") => false,
            Some("launch") => true,
            Some(v) => return Err(ConfigError { var: "HOPSCOPE_CUPTI_GRAPHS", value: v.into(), expected: "node or launch" }),
        };
        Ok(Config {
            socket: path("HOPSCOPE_GPU_SOCKET"),
            cupti_lib: path("HOPSCOPE_CUPTI_LIB"),
            flush_ms: num("HOPSCOPE_CUPTI_FLUSH_MS", 250, 10, 60_000)?,
            buffer_bytes: num("HOPSCOPE_CUPTI_BUFFER_KB", 4096, 64, 65_536)? as usize * 1024,
            max_buffers: num("HOPSCOPE_CUPTI_BUFFERS", 16, 2, 1024)? as usize,
            queue_bytes: num("HOPSCOPE_GPU_QUEUE_KB", 32_768, 64, 4 << 20)? as usize * 1024,
            reconnect_ms: num("HOPSCOPE_GPU_RECONNECT_MS", 500, 10, 600_000)?,
            report_ms: num("HOPSCOPE_GPU_REPORT_MS", 1000, 10, 600_000)?,
            exit_drain_ms: num("HOPSCOPE_GPU_EXIT_DRAIN_MS", 1000, 0, 60_000)?,
            clock,
            api: flag("HOPSCOPE_CUPTI_API", true)?,
            kinds,
            graph_launches,
            verbose: flag("HOPSCOPE_CUPTI_LOG", false)?,
            dump_dir: path("HOPSCOPE_CUPTI_DUMP_DIR"),
            dump_max_bytes: num("HOPSCOPE_CUPTI_DUMP_MAX_KB", 1024, 1, 1 << 20)? as usize * 1024,
            force_init_failure: flag("HOPSCOPE_CUPTI_FORCE_INIT_FAILURE", false)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn cfg(pairs: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Config::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn defaults_are_inactive_with_4_mib_buffers_and_a_250_ms_flush() {
        let c = cfg(&[]).unwrap();
        assert_eq!(c.socket, None);
        assert_eq!((c.buffer_bytes, c.max_buffers, c.flush_ms), (4 << 20, 16, 250));
        assert_eq!((c.clock, c.api, c.verbose, c.force_init_failure), (ClockChoice::Auto, true, false, false));
        assert_eq!(c.kinds, Kinds::ALL);
        assert!(!c.graph_launches, "graphs traced per node unless asked");
    }

    #[test]
    fn values_are_read_and_bad_ones_name_the_variable() {
        let c = cfg(&[("HOPSCOPE_GPU_SOCKET", "/run/h.sock"), ("HOPSCOPE_CUPTI_CLOCK", "calibrate"), ("HOPSCOPE_GPU_QUEUE_KB", "64")]).unwrap();
        assert_eq!(c.socket.as_deref(), Some(std::path::Path::new("/run/h.sock")));
        assert_eq!((c.clock, c.queue_bytes), (ClockChoice::Calibrate, 64 * 1024));
        let e = cfg(&[("HOPSCOPE_CUPTI_FLUSH_MS", "soon")]).unwrap_err();
        assert_eq!(e.to_string(), "HOPSCOPE_CUPTI_FLUSH_MS=\"soon\" is not valid: expected a whole number in range");
        assert!(cfg(&[("HOPSCOPE_CUPTI_BUFFERS", "1")]).is_err(), "at least two buffers");
        assert!(cfg(&[("HOPSCOPE_CUPTI_API", "maybe")]).unwrap_err().to_string().contains("expected 0 or 1"));
        assert!(cfg(&[("HOPSCOPE_CUPTI_KINDS", "kernel,memcopy")]).unwrap_err().to_string().contains("HOPSCOPE_CUPTI_KINDS"));
    }

    #[test]
    fn kinds_name_what_is_enabled_and_kernel_records_stay_on() {
        let k = cfg(&[("HOPSCOPE_CUPTI_KINDS", "kernel")]).unwrap().kinds;
        assert_eq!(k, Kinds { memcpy: false, memcpy2: false, memset: false, sync: false });
        let k = cfg(&[("HOPSCOPE_CUPTI_KINDS", " memcpy , sync")]).unwrap().kinds;
        assert_eq!(k, Kinds { memcpy: true, memcpy2: false, memset: false, sync: true });
        use cupti_sys::*;
        let wanted = [CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMCPY2, CUPTI_ACTIVITY_KIND_MEMSET, CUPTI_ACTIVITY_KIND_SYNCHRONIZATION]
            .map(|kind| k.wants(kind));
        assert_eq!(wanted, [true, true, false, false, true]);
        assert!(cfg(&[("HOPSCOPE_CUPTI_GRAPHS", "launch")]).unwrap().graph_launches);
        assert!(cfg(&[("HOPSCOPE_CUPTI_GRAPHS", "nodes")]).unwrap_err().to_string().contains("node or launch"));
    }
}
