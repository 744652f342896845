//! Project tasks: `cargo xtask <task>`.
//!
//! - `setup`: the Python venv (.venv) for the testbed and the test servers, and
//!   tracefs when it is not mounted.
//! - `test`: everything the README promises (unit, privileged eBPF integration,
//!   Python testbed tests). Run as root for the eBPF tests.
//! - `demo [--out DIR]`: testbed + chain client under `hopscope run`, then the report.
//! - `bench [--rounds N] [--secs S] [--baseline BIN]`: overhead and per-program
//!   cost figures, side by side in one run. Every task takes `--help`.
//! - `bench-injection [--records N] [--baseline LIB]`: the CUPTI injection
//!   library's CPU cost per GPU record (through the CUPTI ABI test double).
//! - `fuzz [--seconds N] [TARGET…]`: the decoders' libFuzzer targets (fuzz/), bounded.
//! - `gpu-bundle`: what the GPU check needs on the device, in one folder to carry.

mod bench;
mod bench_correlate;
mod bench_injection;
mod bench_memory;
mod codegen;
mod demo;
mod fuzz;
mod gpu_bundle;

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};

/// A task's `--name value` options and `--flag`s, checked against the names
/// it takes: `--help` prints `usage` and exits; anything else unknown is an
/// error (a mistyped flag must not run a ten-minute benchmark with the
/// defaults).
pub(crate) struct Opts(Vec<(String, String)>);

impl Opts {
    pub(crate) fn parse(args: &[String], usage: &str, names: &[&str]) -> Result<Opts> {
        Self::parse_with_flags(args, usage, names, &[])
    }

    /// [`parse`](Self::parse) with `flags`: names that take no value.
    pub(crate) fn parse_with_flags(args: &[String], usage: &str, names: &[&str], flags: &[&str]) -> Result<Opts> {
        let mut got = Vec::new();
        let mut it = args.iter();
        while let Some(a) = it.next() {
            if a == "--help" || a == "-h" {
                println!("usage: {usage}");
                std::process::exit(0);
            }
            if flags.contains(&a.as_str()) {
                got.push((a.clone(), String::new()));
                continue;
            }
            if !names.contains(&a.as_str()) {
                bail!("unknown argument {a:?}\nusage: {usage}");
            }
            let v = it.next().with_context(|| format!("{a} needs a value\nusage: {usage}"))?;
            got.push((a.clone(), v.clone()));
        }
        Ok(Opts(got))
    }

    /// Whether the flag `name` was given.
    pub(crate) fn flag(&self, name: &str) -> bool {
        self.0.iter().any(|(n, _)| n == name)
    }

    pub(crate) fn get(&self, name: &str) -> Option<&str> {
        self.0.iter().rev().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    /// The option's value parsed, or `default` when it was not given.
    pub(crate) fn num<T: std::str::FromStr>(&self, name: &str, default: T) -> Result<T> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => v.parse().map_err(|_| anyhow::anyhow!("{name} {v:?}: not a number")),
        }
    }
}

pub(crate) fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace").to_owned()
}

pub(crate) fn run(cmd: &mut Command) -> Result<()> {
    let shown = format!("{cmd:?}");
    eprintln!("xtask: $ {shown}");
    let st: ExitStatus = cmd.status().with_context(|| format!("cannot start {shown}"))?;
    if !st.success() {
        bail!("{shown} failed with {st}");
    }
    Ok(())
}

/// A hopscope recorder, stopped with SIGINT (it seals the recording and
/// stops a command it launched) however the task ends: an error or a panic
/// (`eprintln!` into a closed stderr) too must not leave it, or a testbed
/// under it, running.
pub(crate) struct Interrupted(pub(crate) std::process::Child);

impl Interrupted {
    pub(crate) fn stop(&mut self) -> std::io::Result<ExitStatus> {
        if let Some(st) = self.0.try_wait()? {
            return Ok(st);
        }
        let _ = Command::new("kill").arg("-INT").arg(self.0.id().to_string()).status();
        self.0.wait()
    }
}

impl Drop for Interrupted {
    fn drop(&mut self) {
        // A no-op after `stop`: the child is reaped and `try_wait` says so
        // without signalling a pid that may have been reused.
        let _ = self.stop();
    }
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0").unwrap_or(false)
}

/// Python interpreter of the project venv, created and filled on first use; a
/// second run reuses it (requirements are stamped by content).
pub(crate) fn venv_python() -> Result<PathBuf> {
    let root = root();
    let venv = root.join(".venv");
    let py = venv.join("bin/python");
    let req_path = root.join("examples/requirements.txt");
    let req = std::fs::read_to_string(&req_path).with_context(|| format!("reading {}", req_path.display()))?;
    let stamp = venv.join(".hopscope-requirements");
    if py.exists() && std::fs::read_to_string(&stamp).ok().as_deref() == Some(req.as_str()) {
        return Ok(py);
    }
    let base = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    if !py.exists() {
        run(Command::new(&base).args(["-m", "venv"]).arg(&venv)).context("creating the Python venv: is python3-venv installed?")?;
    }
    run(Command::new(&py).args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-r"]).arg(&req_path))
        .context("installing the testbed's Python packages")?;
    std::fs::write(&stamp, req)?;
    Ok(py)
}

pub(crate) fn ensure_tracefs() -> Result<()> {
    if Path::new("/sys/kernel/tracing/events").exists() {
        return Ok(());
    }
    if !is_root() {
        eprintln!("xtask: tracefs is not mounted and we are not root; eBPF tests will skip");
        return Ok(());
    }
    run(Command::new("mount").args(["-t", "tracefs", "nodev", "/sys/kernel/tracing"])).context("mounting tracefs")
}

pub(crate) fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

/// CUPTI headers and the cu12 libcupti from PyPI's wheels, unpacked under
/// target/cupti-headers: the bindings drift test and the real-libcupti loader
/// test use them (they run for real instead of skipping). Fetched once.
fn cupti_wheels(py: &Path) -> Result<()> {
    let dir = root().join("target/cupti-headers");
    if dir.join("nvidia/cu13/include/cupti.h").exists() && dir.join("nvidia/cuda_cupti/lib/libcupti.so.12").exists() {
        return Ok(());
    }
    let wheels = dir.join("wheels");
    run(Command::new(py)
        .args(["-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps", "-d"])
        .arg(&wheels)
        .args(["nvidia-cuda-cupti==13.4.92", "nvidia-cuda-runtime==13.4.92", "nvidia-cuda-crt==13.4.92", "nvidia-cuda-cupti-cu12==12.9.79"]))
    .context("downloading the CUPTI wheels")?;
    let unpack = r#"
import pathlib, sys, zipfile
out = pathlib.Path(sys.argv[1])
for w in (out / "wheels").glob("*.whl"):
    with zipfile.ZipFile(w) as z:
        for n in z.namelist():
            if n.startswith("nvidia/cu13/include/") or n.startswith("nvidia/cuda_cupti/lib/"):
                z.extract(n, out)
"#;
    run(Command::new(py).args(["-c", unpack]).arg(&dir)).context("unpacking the CUPTI wheels")
}

/// clang-19 builds the eBPF programs; without it the agent is built with a
/// placeholder and refuses to record. On a fresh Debian/Ubuntu machine, as
/// root, install the toolchain instead of failing later.
pub(crate) fn ensure_toolchain() -> Result<()> {
    let have = |bin: &str| Command::new(bin).arg("--version").output().is_ok_and(|o| o.status.success());
    if have("clang-19") || std::env::var_os("CLANG").is_some() {
        return Ok(());
    }
    if !is_root() || !have("apt-get") {
        eprintln!("xtask: WARNING: clang-19 not found: install it (apt-get install clang-19 llvm-19 libbpf-dev bpftool); the agent will refuse to record without it");
        return Ok(());
    }
    eprintln!("xtask: installing clang-19, llvm-19, libbpf-dev, bpftool (eBPF toolchain)");
    run(Command::new("apt-get").args(["update", "-qq"]).env("DEBIAN_FRONTEND", "noninteractive"))?;
    run(Command::new("apt-get").args(["install", "-y", "-qq", "clang-19", "llvm-19", "libbpf-dev", "bpftool"]).env("DEBIAN_FRONTEND", "noninteractive"))
        .context("installing the eBPF toolchain")
}

fn setup() -> Result<PathBuf> {
    ensure_toolchain()?;
    ensure_tracefs()?;
    let py = venv_python()?;
    cupti_wheels(&py)?;
    Ok(py)
}

/// vLLM's CPU build, which tests/tests/real_vllm.rs serves and traces
/// (examples/real-vllm/install.sh: ~6 GB, ~2 min the first time, then
/// nothing). Only as root, where that test runs; HOPSCOPE_NO_REAL_VLLM=1
/// leaves it out, and the test then says SKIPPED.
fn real_vllm_venv() -> Result<Option<PathBuf>> {
    if !is_root() {
        return Ok(None);
    }
    if std::env::var_os("HOPSCOPE_NO_REAL_VLLM").is_some_and(|v| v != "0") {
        eprintln!("xtask: WARNING: HOPSCOPE_NO_REAL_VLLM set: the real-vLLM test will report SKIPPED (it never counts as passed)");
        return Ok(None);
    }
    let venv = root().join("target/real-vllm/venv");
    if !venv.join("bin/python").exists() {
        eprintln!("xtask: installing vLLM's CPU build into {} for the real-vLLM test (~6 GB, once; HOPSCOPE_NO_REAL_VLLM=1 skips it)", venv.display());
    }
    run(Command::new("bash").arg(root().join("examples/real-vllm/install.sh")).arg(&venv))
        .context("installing vLLM's CPU build for tests/tests/real_vllm.rs (HOPSCOPE_NO_REAL_VLLM=1 leaves that test out, loudly)")?;
    Ok(Some(venv))
}

fn test(args: &[String]) -> Result<()> {
    let py = setup()?;
    if !is_root() {
        eprintln!("xtask: WARNING: not root: the privileged eBPF integration tests will report SKIPPED (they never count as passed)");
    }
    let vllm = real_vllm_venv()?;
    // Build the binary once; integration tests run it from target/.
    run(cargo().args(["build", "--workspace", "--bins"]))?;
    let mut t = cargo();
    t.args(["test", "--workspace", "--all-targets"]).args(args).env("HOPSCOPE_PYTHON", &py);
    if let Some(v) = &vllm {
        t.env("HOPSCOPE_REAL_VLLM_VENV", v);
    }
    run(&mut t)?;
    run(Command::new(&py).args(["-m", "pytest", "-q", "-rs", "examples/tests"]).current_dir(root()))?;
    if let Some(v) = &vllm {
        torch_tests(v)?;
    }
    eprintln!("xtask: all test suites passed");
    Ok(())
}

/// The testbed's torch model runner (the code path `gpu-check.sh` serves on
/// the GPU), on the CPU with the real-vLLM venv's torch: the test venv has no
/// torch (several GB), so pytest above skips examples/tests/test_torch.py.
fn torch_tests(venv: &Path) -> Result<()> {
    let py = venv.join("bin/python");
    let has_pytest = Command::new(&py).args(["-c", "import pytest"]).stderr(std::process::Stdio::null()).status().is_ok_and(|s| s.success());
    if !has_pytest {
        run(Command::new(&py).args(["-m", "pip", "install", "-q", "--disable-pip-version-check", "pytest~=9.2"]))
            .context("installing pytest into the real-vLLM venv for the torch testbed tests")?;
    }
    eprintln!("xtask: the torch testbed tests, with the real-vLLM venv's torch");
    run(Command::new(&py).args(["-m", "pytest", "-q", "-rs", "examples/tests/test_torch.py"]).current_dir(root()))
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(task) = args.first() else {
        eprintln!("usage: cargo xtask <setup|test|demo|bench|bench-correlator|bench-memory|bench-injection|fuzz|codegen-cupti|gpu-bundle> [args]");
        std::process::exit(2);
    };
    let rest = &args[1..];
    match task.as_str() {
        "setup" => setup().map(|py| eprintln!("xtask: python venv ready: {}", py.display())),
        "test" => test(rest),
        "bench" => bench::run(rest),
        "bench-correlator" => bench_correlate::run(rest),
        "bench-memory" => bench_memory::run(rest),
        "bench-injection" => bench_injection::run(rest),
        "demo" => demo::run_demo(rest),
        "codegen-cupti" => codegen::run(rest),
        "fuzz" => fuzz::run(rest),
        "gpu-bundle" => gpu_bundle::run(rest),
        other => bail!("unknown task {other:?}: expected setup, test, demo, bench, bench-correlator, bench-memory, bench-injection, fuzz, codegen-cupti or gpu-bundle"),
    }
}
