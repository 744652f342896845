//! Finding libcupti from inside the host process.
//!
//! Order: (1) a copy the process already loaded (RTLD_NOLOAD, by path from
//! /proc/self/maps, then by soname): before CUDA 13.2 a process has one CUPTI
//! subscriber, and a second libcupti copy would fight the first; (2) the
//! `HOPSCOPE_CUPTI_LIB` override; (3) the wheel in the host's Python env
//! (`nvidia/cu13/lib/libcupti.so.13`, `nvidia/cuda_cupti/lib/libcupti.so.12`),
//! found from the site-packages directories of libraries already mapped
//! (torch, the CUDA runtime wheel) and `$VIRTUAL_ENV`. The override comes
//! after reuse because reuse is about correctness, and before the wheel
//! search because an explicit choice beats a heuristic.

use cupti_sys::{Cupti, LoadError};
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum LocateError {
    #[error("no usable libcupti (tried: {})", tried.join("; "))]
    NotFound { tried: Vec<String> },
}

/// Paths of libcupti copies mapped into the process.
pub fn mapped_cupti(maps: &str) -> Vec<String> {
    let mut v: Vec<String> = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .filter(|p| p.rsplit('/').next().is_some_and(|f| f.starts_with("libcupti.so")))
        .map(str::to_owned)
        .collect();
    v.dedup();
    v
}

/// Site-packages (or dist-packages) directories of mapped files, in order of appearance.
pub fn site_packages(maps: &str, virtual_env: Option<&Path>) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    for p in maps.lines().filter_map(|l| l.split_whitespace().nth(5)) {
        for seg in ["/site-packages/", "/dist-packages/"] {
            if let Some(i) = p.find(seg) {
                let d = PathBuf::from(&p[..i + seg.len() - 1]);
                if !out.contains(&d) {
                    out.push(d);
                }
            }
        }
    }
    if let Some(venv) = virtual_env {
        if let Ok(rd) = std::fs::read_dir(venv.join("lib")) {
            let mut pys: Vec<PathBuf> = rd
                .filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().starts_with("python"))
                .map(|e| e.path().join("site-packages"))
                .collect();
            pys.sort();
            for d in pys {
                if !out.contains(&d) {
                    out.push(d);
                }
            }
        }
    }
    out
}

/// 12 or 13 when the process mapped that major of the CUDA runtime.
pub fn cudart_major(maps: &str) -> Option<u32> {
    maps.lines().filter_map(|l| l.split_whitespace().nth(5)).find_map(|p| {
        let f = p.rsplit('/').next()?;
        let rest = f.strip_prefix("libcudart.so.")?;
        rest.split('.').next()?.parse().ok()
    })
}

/// Wheel libcupti paths under `dirs`, the runtime's major first.
pub fn wheel_candidates(dirs: &[PathBuf], major: Option<u32>) -> Vec<PathBuf> {
    let cu13 = "nvidia/cu13/lib/libcupti.so.13";
    let cu12 = "nvidia/cuda_cupti/lib/libcupti.so.12";
    let order = if major == Some(12) { [cu12, cu13] } else { [cu13, cu12] };
    let mut v = Vec::new();
    for rel in order {
        for d in dirs {
            v.push(d.join(rel));
        }
    }
    v
}

/// Finds and loads libcupti (see the module doc for the order).
pub fn find(override_path: Option<&Path>) -> Result<Cupti, LocateError> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut tried: Vec<String> = Vec::new();
    let note = |tried: &mut Vec<String>, what: String, e: LoadError| tried.push(format!("{what}: {e}"));
    let mut names = mapped_cupti(&maps);
    names.extend(["libcupti.so.13", "libcupti.so.12", "libcupti.so"].map(String::from));
    for n in names {
        match Cupti::reuse_loaded(&n) {
            Some(Ok(c)) => return Ok(c),
            Some(Err(e)) => note(&mut tried, format!("loaded {n}"), e),
            None => {}
        }
    }
    tried.push("no libcupti already loaded".into());
    if let Some(p) = override_path {
        match Cupti::open(p) {
            Ok(c) => return Ok(c),
            Err(e) => note(&mut tried, format!("HOPSCOPE_CUPTI_LIB {}", p.display()), e),
        }
    }
    let venv = std::env::var_os("VIRTUAL_ENV").map(PathBuf::from);
    let dirs = site_packages(&maps, venv.as_deref());
    let mut any = false;
    for p in wheel_candidates(&dirs, cudart_major(&maps)) {
        if !p.exists() {
            continue;
        }
        any = true;
        match Cupti::open(&p) {
            Ok(c) => return Ok(c),
            Err(e) => note(&mut tried, p.display().to_string(), e),
        }
    }
    if !any {
        tried.push(format!("no libcupti wheel in {} python package dirs", dirs.len()));
    }
    Err(LocateError::NotFound { tried })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
7f0000000000-7f0000001000 r-xp 00000000 08:01 1 /venv/lib/python3.12/site-packages/torch/lib/libtorch_cuda.so
7f0000001000-7f0000002000 r-xp 00000000 08:01 2 /venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13
7f0000002000-7f0000003000 r-xp 00000000 08:01 3 /usr/lib/x86_64-linux-gnu/libcuda.so.575.57.08
7f0000003000-7f0000004000 r-xp 00000000 08:01 4 /usr/lib/python3/dist-packages/numpy/core/_multiarray_umath.so
7f0000004000-7f0000005000 rw-p 00000000 00:00 0 [heap]
7f0000005000-7f0000006000 r-xp 00000000 08:01 5 /opt/nsight/libcupti.so.2025.1.0
";

    #[test]
    fn mapped_cupti_copies_are_found_by_file_name() {
        assert_eq!(mapped_cupti(MAPS), vec!["/opt/nsight/libcupti.so.2025.1.0".to_string()]);
        assert!(mapped_cupti("").is_empty());
    }

    #[test]
    fn python_package_dirs_come_from_mapped_libraries() {
        assert_eq!(
            site_packages(MAPS, None),
            vec![PathBuf::from("/venv/lib/python3.12/site-packages"), PathBuf::from("/usr/lib/python3/dist-packages")]
        );
    }

    #[test]
    fn the_runtime_major_picks_which_wheel_is_tried_first() {
        assert_eq!(cudart_major(MAPS), Some(13));
        let dirs = vec![PathBuf::from("/a")];
        assert_eq!(
            wheel_candidates(&dirs, Some(12)),
            vec![PathBuf::from("/a/nvidia/cuda_cupti/lib/libcupti.so.12"), PathBuf::from("/a/nvidia/cu13/lib/libcupti.so.13")]
        );
        assert_eq!(wheel_candidates(&dirs, Some(13))[0], PathBuf::from("/a/nvidia/cu13/lib/libcupti.so.13"));
    }

    #[test]
    fn nothing_found_lists_what_was_tried() {
        let e = find(Some(Path::new("/nonexistent/libcupti.so"))).err().expect("no cupti here");
        let msg = e.to_string();
        assert!(msg.starts_with("no usable libcupti (tried: "), "{msg}");
        assert!(msg.contains("HOPSCOPE_CUPTI_LIB /nonexistent/libcupti.so: cannot load"), "{msg}");
    }
}
