//! `cargo xtask gpu-bundle`: everything the GPU check (scripts/gpu-check.sh)
//! needs on a device with no Rust toolchain, in one folder to carry —
//! target/gpu-bundle: the agent (real eBPF programs: clang-19 is required),
//! the CUPTI injection library, the exact-kernel program and the cp312
//! wheels the device image lacks (examples/gpu/fetch_wheels.sh). The script
//! finds the folder by itself; docs/gpu.md gives the one call.

use anyhow::{bail, Context, Result};
use std::path::Path;
use std::process::Command;

/// What the device tool sends at most: the working tree (tracked and
/// untracked-not-ignored files) and the carried paths together.
const CARRY_LIMIT: u64 = 64 << 20;

/// Bytes of the working tree the device tool sends beside the carried paths.
fn tree_bytes(root: &Path) -> Result<u64> {
    let out = Command::new("git")
        .args(["ls-files", "-z", "--cached", "--others", "--exclude-standard"])
        .current_dir(root)
        .output()
        .context("listing the working tree (git ls-files)")?;
    if !out.status.success() {
        bail!("git ls-files failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    // A tracked file deleted in the tree is not sent: no size.
    Ok(out.stdout.split(|b| *b == 0).filter(|p| !p.is_empty()).filter_map(|p| std::fs::symlink_metadata(root.join(String::from_utf8_lossy(p).as_ref())).ok()).map(|m| m.len()).sum())
}

pub fn run(args: &[String]) -> Result<()> {
    let opts = crate::Opts::parse_with_flags(
        args,
        "cargo xtask gpu-bundle [--keep-debug]  (builds target/gpu-bundle for scripts/gpu-check.sh; docs/gpu.md; the binaries' debug info is stripped unless --keep-debug)",
        &[],
        &["--keep-debug"],
    )?;
    let keep_debug = opts.flag("--keep-debug");
    let root = crate::root();
    crate::ensure_toolchain()?;
    // A placeholder agent would fail the device's eBPF and testbed steps.
    crate::run(crate::cargo().args(["build", "--release", "-p", "agent-cupti", "-p", "hopscope"]).env("HOPSCOPE_REQUIRE_CLANG", "1"))
        .context("building the agent and the injection library (the agent needs clang-19 for its eBPF programs)")?;
    // Its own workspace (cudarc stays out of the main lock file), built into target/gpu-exact.
    crate::run(crate::cargo().args(["build", "--release"]).current_dir(root.join("agent-cupti/gpu-exact"))).context("building hopscope-gpu-exact")?;
    crate::run(Command::new("bash").arg(root.join("examples/gpu/fetch_wheels.sh")).current_dir(&root)).context("fetching the wheels the device lacks")?;

    let out = root.join("target/gpu-bundle");
    if out.exists() {
        std::fs::remove_dir_all(&out).with_context(|| format!("removing the old {}", out.display()))?;
    }
    std::fs::create_dir_all(out.join("wheels"))?;
    let mut total = 0;
    // `strip`: the release builds' line tables are ~4/5 of their size, and
    // every byte carried counts against the 64 MiB a call sends and its
    // start; symbols stay (a backtrace still names its functions).
    let mut put = |from: &Path, to: &Path, strip: bool| -> Result<()> {
        if strip {
            crate::run(Command::new("strip").arg("--strip-debug").arg("-o").arg(to).arg(from))
                .with_context(|| format!("stripping {} (binutils' strip; --keep-debug copies as is)", from.display()))?;
        } else {
            std::fs::copy(from, to).with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
        }
        total += std::fs::metadata(to)?.len();
        Ok(())
    };
    for (from, name) in [
        ("target/release/hopscope", "hopscope"),
        ("target/release/libhopscope_cupti.so", "libhopscope_cupti.so"),
        ("target/gpu-exact/release/hopscope-gpu-exact", "hopscope-gpu-exact"),
    ] {
        put(&root.join(from), &out.join(name), !keep_debug)?;
    }
    let mut wheels = 0;
    for e in std::fs::read_dir(root.join(".whl")).context("reading .whl (examples/gpu/fetch_wheels.sh writes it)")? {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "whl") {
            put(&p, &out.join("wheels").join(p.file_name().expect("a file")), false)?;
            wheels += 1;
        }
    }
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let tree = tree_bytes(&root)?;
    println!(
        "gpu-bundle: {} ({:.1} MiB: agent, injection library, hopscope-gpu-exact, {wheels} wheels; with the working tree's {:.1} MiB, {:.1} of the 64 MiB a call sends)",
        out.display(),
        mib(total),
        mib(tree),
        mib(total + tree)
    );
    if total + tree > CARRY_LIMIT {
        bail!(
            "the bundle ({:.1} MiB) and the working tree ({:.1} MiB) are over the 64 MiB a device call sends: strip the binaries (e.g. strip --strip-debug) or carry the GPU steps' part alone (docs/gpu.md)",
            mib(total),
            mib(tree)
        );
    }
    // The steps no GPU has run yet (docs/gpu.md "The next lease"); all steps: leave GPU_CHECK_STEPS out.
    println!("gpu-bundle: on a lent device, one call: run(command=\"GPU_CHECK_PACK=1 GPU_CHECK_STEPS='3g 5 7 8 9 10' bash scripts/gpu-check.sh\", carry=[\"target/gpu-bundle\"], timeout_s=400)");
    Ok(())
}
