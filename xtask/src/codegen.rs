//! `cargo xtask codegen-cupti [--check] [INCLUDE_DIR]`: regenerates
//! `cupti-sys/src/bindings.rs` with bindgen from the CUPTI headers of PyPI's
//! wheels (or, with `--check`, fails when the committed file differs).
//!
//! It downloads nothing. INCLUDE_DIR must hold `cupti_activity.h`, `cuda.h`
//! and `crt/host_defines.h`; default: `$HOPSCOPE_CUPTI_INCLUDE`, else
//! `target/cupti-headers/nvidia/cu13/include`, which this fills:
//!
//! ```sh
//! pip download --no-deps -d target/cupti-headers/wheels nvidia-cuda-cupti==13.4.92 \
//!     nvidia-cuda-runtime==13.4.92 nvidia-cuda-crt==13.4.92 nvidia-cuda-cupti-cu12==12.9.79
//! for w in target/cupti-headers/wheels/*.whl; do
//!     unzip -qo "$w" 'nvidia/cu13/include/*' 'nvidia/cuda_cupti/lib/*' -d target/cupti-headers 2>/dev/null
//! done
//! ```
//!
//! (The cu12 wheel's `libcupti.so.12` is for the tests that load a real
//! libcupti: cupti-sys's loader test and tests/tests/cupti_double.rs.)
//!
//! Why 13.4 headers for every version: they declare every function we call
//! (including 13.0's `cuptiActivityGetStructSize`) and still carry the 12.x
//! record structs (Kernel9, Memcpy5/6, Synchronization) in
//! `cupti_activity_deprecated.h`; activity kinds and callback ids are
//! append-only across 12.4…13.4 (names removed in 13.0 are not ones we use).
//! The record decoder does not depend on these structs: it reads documented
//! offsets (cupti-sys/src/record.rs); the generated layout assertions
//! cross-check those offsets at compile time.
//!
//! bindgen is an optional dependency (feature `codegen`): without it this task
//! re-runs xtask with the feature in `target/codegen`, so ordinary builds never
//! compile bindgen. Output is deterministic for a given bindgen (Cargo.lock)
//! and libclang (19, `LIBCLANG_PATH=/usr/lib/llvm-19/lib`).

use anyhow::{bail, Result};
use std::path::{Path, PathBuf};

/// The functions the injection library calls (cupti-sys resolves them at load).
#[cfg_attr(not(feature = "codegen"), allow(dead_code))]
const FUNCTIONS: &[&str] = &[
    "cuptiGetVersion",
    "cuptiGetResultString",
    "cuptiGetTimestamp",
    "cuptiActivityRegisterCallbacks",
    "cuptiActivityRegisterTimestampCallback",
    "cuptiActivityEnable",
    "cuptiActivityDisable",
    "cuptiActivityEnableRuntimeApi",
    "cuptiActivityEnableDriverApi",
    "cuptiActivityGetNextRecord",
    "cuptiActivityGetNumDroppedRecords",
    "cuptiActivityFlushAll",
    "cuptiActivityGetStructSize",
];

/// Record structs (for layout cross-checks) and the enums whose values we use.
#[cfg_attr(not(feature = "codegen"), allow(dead_code))]
const TYPES: &[&str] = &[
    "CUptiResult",
    "CUpti_ActivityKind",
    "CUpti_ActivityFlag",
    "CUpti_ActivityMemcpyKind",
    "CUpti_ActivityMemoryKind",
    "CUpti_ActivitySynchronizationType",
    "CUpti_ActivityLaunchType",
    "CUpti_runtime_api_trace_cbid",
    "CUpti_driver_api_trace_cbid",
    "CUpti_ActivityAPI",
    "CUpti_ActivityKernel9",
    "CUpti_ActivityKernel10",
    "CUpti_ActivityKernel11",
    "CUpti_ActivityKernel12",
    "CUpti_ActivityKernel13",
    "CUpti_ActivityMemcpy5",
    "CUpti_ActivityMemcpy6",
    "CUpti_ActivityMemcpy7",
    "CUpti_ActivityMemcpyPtoP4",
    "CUpti_ActivityMemset4",
    "CUpti_ActivityMemset5",
    "CUpti_ActivitySynchronization",
    "CUpti_ActivitySynchronization2",
    "CUpti_ActivityGraphTrace",
    "CUpti_ActivityGraphTrace2",
];

pub const FETCH: &str = "pip download --no-deps -d target/cupti-headers/wheels nvidia-cuda-cupti==13.4.92 nvidia-cuda-runtime==13.4.92 nvidia-cuda-crt==13.4.92 nvidia-cuda-cupti-cu12==12.9.79\n  for w in target/cupti-headers/wheels/*.whl; do unzip -qo \"$w\" 'nvidia/cu13/include/*' 'nvidia/cuda_cupti/lib/*' -d target/cupti-headers 2>/dev/null; done";

#[cfg_attr(not(any(feature = "codegen", test)), allow(dead_code))]
fn bindings_path() -> PathBuf {
    crate::root().join("cupti-sys/src/bindings.rs")
}

/// INCLUDE_DIR when given, else `$HOPSCOPE_CUPTI_INCLUDE`, else the default.
pub fn include_dir(arg: Option<&str>) -> PathBuf {
    if let Some(a) = arg {
        return PathBuf::from(a);
    }
    if let Ok(e) = std::env::var("HOPSCOPE_CUPTI_INCLUDE") {
        return PathBuf::from(e);
    }
    crate::root().join("target/cupti-headers/nvidia/cu13/include")
}

fn has_headers(dir: &Path) -> bool {
    dir.join("cupti_activity.h").exists() && dir.join("cuda.h").exists() && dir.join("crt/host_defines.h").exists()
}

pub fn run(args: &[String]) -> Result<()> {
    let mut check = false;
    let mut dir = None;
    for a in args {
        match a.as_str() {
            "--check" => check = true,
            "--help" | "-h" => {
                println!("usage: cargo xtask codegen-cupti [--check] [INCLUDE_DIR]");
                std::process::exit(0);
            }
            s if s.starts_with('-') => bail!("unknown option {s:?}: usage: cargo xtask codegen-cupti [--check] [INCLUDE_DIR]"),
            s => dir = Some(s),
        }
    }
    let dir = include_dir(dir);
    if !has_headers(&dir) {
        bail!("no cupti headers (cupti_activity.h, cuda.h, crt/host_defines.h) in {}: fetch them with\n  {FETCH}", dir.display());
    }
    generate_or_delegate(&dir, check)
}

/// The `// @generated` first lines: what made the file, for the reader.
#[cfg_attr(not(feature = "codegen"), allow(dead_code))]
fn banner(dir: &Path) -> String {
    let version = std::fs::read_to_string(dir.join("cupti_version.h"))
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.trim().strip_prefix("#define CUPTI_API_VERSION ").map(|v| v.trim().to_owned()))
        })
        .unwrap_or_else(|| "unknown".into());
    format!(
        "// @generated by `cargo xtask codegen-cupti` (xtask/src/codegen.rs) with bindgen and libclang 19\n\
         // from the CUPTI headers of nvidia-cuda-cupti (CUPTI_API_VERSION {version}) plus cuda.h and\n\
         // crt/host_defines.h from nvidia-cuda-runtime / nvidia-cuda-crt. Do not edit: regenerate.\n"
    )
}

#[cfg(feature = "codegen")]
fn generate(dir: &Path) -> Result<String> {
    use anyhow::Context;
    if std::env::var_os("LIBCLANG_PATH").is_none() && Path::new("/usr/lib/llvm-19/lib").exists() {
        // Edition 2021: set_var is safe; xtask is single-threaded here.
        std::env::set_var("LIBCLANG_PATH", "/usr/lib/llvm-19/lib");
    }
    let wrapper = "#include <cuda.h>\n#include <cupti_result.h>\n#include <cupti_version.h>\n#include <cupti_activity.h>\n#include <cupti_runtime_cbid.h>\n#include <cupti_driver_cbid.h>\n";
    let mut b = bindgen::Builder::default()
        .header_contents("hopscope_cupti.h", wrapper)
        .clang_arg(format!("-I{}", dir.display()))
        .clang_arg("--target=x86_64-unknown-linux-gnu")
        .allowlist_var("CUPTI_API_VERSION")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .dynamic_library_name("CuptiLib")
        .dynamic_link_require_all(false)
        .layout_tests(true)
        .generate_comments(false)
        .derive_default(false)
        .formatter(bindgen::Formatter::Prettyplease)
        .raw_line(banner(dir))
        .raw_line("#![allow(non_upper_case_globals, non_camel_case_types, non_snake_case, dead_code, clippy::all)]");
    for f in FUNCTIONS {
        b = b.allowlist_function(format!("^{f}$"));
    }
    for t in TYPES {
        b = b.allowlist_type(format!("^{t}$"));
    }
    let out = b.generate().with_context(|| format!("bindgen failed on the headers in {}", dir.display()))?;
    Ok(out.to_string())
}

#[cfg(feature = "codegen")]
fn generate_or_delegate(dir: &Path, check: bool) -> Result<()> {
    use anyhow::Context;
    let text = generate(dir)?;
    let path = bindings_path();
    if check {
        let cur = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        if cur != text {
            let first = cur.lines().zip(text.lines()).position(|(a, b)| a != b).map(|i| i + 1).unwrap_or(cur.lines().count().min(text.lines().count()) + 1);
            bail!(
                "{} differs from what the generator produces from {} (first difference at line {first}): run `cargo xtask codegen-cupti {}` and commit the result",
                path.display(),
                dir.display(),
                dir.display()
            );
        }
        eprintln!("xtask: {} is up to date with {}", path.display(), dir.display());
    } else {
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("xtask: wrote {}", path.display());
    }
    Ok(())
}

#[cfg(not(feature = "codegen"))]
fn generate_or_delegate(dir: &Path, check: bool) -> Result<()> {
    // Re-run with bindgen compiled in, in its own target dir (no lock contention
    // with a surrounding `cargo test`, and ordinary builds stay bindgen-free).
    let mut c = crate::cargo();
    c.args(["run", "--quiet", "-p", "xtask", "--features", "codegen", "--target-dir"])
        .arg(crate::root().join("target/codegen"))
        .args(["--", "codegen-cupti"]);
    if check {
        c.arg("--check");
    }
    c.arg(dir);
    if std::env::var_os("LIBCLANG_PATH").is_none() && Path::new("/usr/lib/llvm-19/lib").exists() {
        c.env("LIBCLANG_PATH", "/usr/lib/llvm-19/lib");
    }
    crate::run(&mut c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// The drift test: the committed bindings are exactly what the generator
    /// makes from the headers, when the headers are here (see the module doc
    /// for the pip command); otherwise a loud SKIPPED line, never a pass.
    #[test]
    fn committed_cupti_bindings_match_what_the_generator_produces() {
        let dir = include_dir(None);
        if !has_headers(&dir) {
            let _ = writeln!(
                std::io::stderr(),
                "\n!!!!! SKIPPED committed_cupti_bindings_match_what_the_generator_produces: no CUPTI headers in {} \
                 (set HOPSCOPE_CUPTI_INCLUDE or fetch them: {FETCH}): this is NOT a pass !!!!!\n",
                dir.display()
            );
            return;
        }
        generate_or_delegate(&dir, true).unwrap_or_else(|e| panic!("{e:#}"));
    }

    #[test]
    fn the_committed_bindings_name_their_generator() {
        let text = std::fs::read_to_string(bindings_path()).expect("cupti-sys/src/bindings.rs is committed");
        let head = &text[..400.min(text.len())];
        assert!(head.contains("// @generated by `cargo xtask codegen-cupti`"), "{head}");
        for f in FUNCTIONS {
            assert!(text.contains(&format!("pub {f}: Result<")), "{f} missing from the committed bindings");
        }
    }
}
