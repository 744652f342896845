//! `cargo xtask gpu-bundle`: everything the GPU check (scripts/gpu-check.sh)
//! needs on a device with no Rust toolchain, in one folder to carry —
//! target/gpu-bundle: the agent (real eBPF programs: clang-19 is required),
//! the CUPTI injection library, the exact-kernel program and the cp312
//! wheels the device image lacks (examples/gpu/fetch_wheels.sh). The script
//! finds the folder by itself; docs/gpu.md gives the one call.

use anyhow::{bail, Context, Result};
use std::path::Path;
use std::process::Command;

/// What the device tool carries at most (all carried paths together).
const CARRY_LIMIT: u64 = 64 << 20;

pub fn run(args: &[String]) -> Result<()> {
    crate::Opts::parse(args, "cargo xtask gpu-bundle  (builds target/gpu-bundle for scripts/gpu-check.sh; docs/gpu.md)", &[])?;
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
    let mut put = |from: &Path, to: &Path| -> Result<()> {
        std::fs::copy(from, to).with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
        total += std::fs::metadata(to)?.len();
        Ok(())
    };
    for (from, name) in [
        ("target/release/hopscope", "hopscope"),
        ("target/release/libhopscope_cupti.so", "libhopscope_cupti.so"),
        ("target/gpu-exact/release/hopscope-gpu-exact", "hopscope-gpu-exact"),
    ] {
        put(&root.join(from), &out.join(name))?;
    }
    let mut wheels = 0;
    for e in std::fs::read_dir(root.join(".whl")).context("reading .whl (examples/gpu/fetch_wheels.sh writes it)")? {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "whl") {
            put(&p, &out.join("wheels").join(p.file_name().expect("a file")))?;
            wheels += 1;
        }
    }
    let mib = total as f64 / (1 << 20) as f64;
    println!("gpu-bundle: {} ({mib:.1} MiB: agent, injection library, hopscope-gpu-exact, {wheels} wheels)", out.display());
    if total > CARRY_LIMIT {
        bail!("the bundle is {mib:.1} MiB, over the device tool's 64 MiB carry limit: strip the binaries (e.g. strip --strip-debug) or carry the GPU steps' part alone (docs/gpu.md)");
    }
    println!("gpu-bundle: on a lent device, one call: run(command=\"GPU_CHECK_PACK=1 bash scripts/gpu-check.sh\", carry=[\"target/gpu-bundle\"], timeout_s=400)");
    Ok(())
}
