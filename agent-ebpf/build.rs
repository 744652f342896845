//! Builds hopscope's eBPF object and the Rust view of its record layout.
//!
//! 1. `layout.rs`: a tiny C program that includes `src/hopscope.h` is compiled
//!    with the host C compiler (`$CC`, else `cc`) and run; it prints `sizeof`,
//!    `offsetof` and member sizes of every field of every `struct hs_*`, and
//!    every `#define HS_*` constant, as Rust constants. Nothing is hand-copied.
//! 2. `hopscope.bpf.o`: `src/hopscope.bpf.c` compiled by clang-19 (`$CLANG`
//!    overrides; else `clang-19`, then `clang`). The record sizes measured in
//!    step 1 are passed as `-DHS_EXPECT_*_SIZE` and checked by `_Static_assert`
//!    on the BPF side.
//!
//! Without clang (or with `HOPSCOPE_EBPF_PLACEHOLDER=1`) the object is an empty
//! placeholder so `cargo check`/`cargo test` work anywhere; the agent refuses to
//! start with a clear message (`PROGRAM_IS_PLACEHOLDER`). With
//! `HOPSCOPE_REQUIRE_CLANG=1` (CI) a missing clang or a failing compile is an error.

use std::{
    env,
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};

const HEADER: &str = "src/hopscope.h";
const VMLINUX_MIN: &str = "src/vmlinux_min.h";
const PROGRAM: &str = "src/hopscope.bpf.c";

fn main() -> Result<()> {
    for f in [HEADER, VMLINUX_MIN, PROGRAM] {
        println!("cargo:rerun-if-changed={f}");
    }
    for v in ["CLANG", "CC", "HOST_CC", "HOPSCOPE_REQUIRE_CLANG", "HOPSCOPE_EBPF_PLACEHOLDER"] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    let out = PathBuf::from(env::var_os("OUT_DIR").context("OUT_DIR not set")?);
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR not set")?);
    let header_text = fs::read_to_string(manifest.join(HEADER)).context("reading src/hopscope.h")?;

    let layout = header_layout(&header_text)?;
    let sizes = measure_layout(&manifest, &out, &layout)?;
    fs::write(out.join("layout.rs"), &sizes.rust).context("writing layout.rs")?;

    let require = env_flag("HOPSCOPE_REQUIRE_CLANG");
    let object = out.join("hopscope.bpf.o");
    let mut compile_failed = false;
    let placeholder_reason = if env_flag("HOPSCOPE_EBPF_PLACEHOLDER") {
        if require {
            bail!("HOPSCOPE_EBPF_PLACEHOLDER=1 and HOPSCOPE_REQUIRE_CLANG=1 contradict each other");
        }
        Some("built with HOPSCOPE_EBPF_PLACEHOLDER=1".to_string())
    } else {
        match find_clang() {
            None => {
                if require {
                    bail!("clang-19 not found and HOPSCOPE_REQUIRE_CLANG=1: install clang-19 llvm-19 libbpf-dev or set CLANG");
                }
                Some("clang-19 not found at build time".to_string())
            }
            Some(clang) => match compile_bpf(&clang, &manifest, &object, &sizes.expect_defines) {
                Ok(()) => None,
                Err(e) if require => return Err(e),
                Err(e) => {
                    compile_failed = true;
                    Some(format!("the eBPF program failed to compile: {e:#}"))
                }
            },
        }
    };
    if let Some(reason) = &placeholder_reason {
        fs::write(&object, []).context("writing placeholder object")?;
        if compile_failed {
            println!("cargo:warning=eBPF programs are a placeholder: clang failed on src/hopscope.bpf.c (set HOPSCOPE_REQUIRE_CLANG=1 to make this an error)");
            for line in reason.lines().take(20) {
                println!("cargo:warning=  {line}");
            }
        } else {
            println!(
                "cargo:warning=clang-19 not found: eBPF programs are a placeholder; install clang-19 (apt-get install clang-19 llvm-19 libbpf-dev) for a working agent ({reason})"
            );
        }
    }
    let info = format!(
        "/// True when this build carries no eBPF programs (clang-19 was missing or failed).\n\
         pub const PROGRAM_IS_PLACEHOLDER: bool = {};\n\
         /// Why the programs are a placeholder (empty when they are real).\n\
         pub const PLACEHOLDER_REASON: &str = {:?};\n",
        placeholder_reason.is_some(),
        placeholder_reason.as_deref().and_then(|r| r.lines().next()).unwrap_or("")
    );
    fs::write(out.join("build_info.rs"), info).context("writing build_info.rs")?;
    Ok(())
}

fn env_flag(name: &str) -> bool {
    env::var(name).map(|v| v == "1" || v.eq_ignore_ascii_case("true")).unwrap_or(false)
}

/// `$CLANG` if set (and only it), else `clang-19`, else `clang`.
fn find_clang() -> Option<String> {
    let candidates: Vec<String> = match env::var("CLANG") {
        Ok(c) if !c.is_empty() => vec![c],
        _ => vec!["clang-19".into(), "clang".into()],
    };
    candidates
        .into_iter()
        .find(|c| Command::new(c).arg("--version").output().map(|o| o.status.success()).unwrap_or(false))
}

fn compile_bpf(clang: &str, manifest: &Path, object: &Path, defines: &[String]) -> Result<()> {
    let mut cmd = Command::new(clang);
    cmd.args(["-O2", "-g", "-target", "bpf", "-mcpu=v3", "-D__TARGET_ARCH_x86"])
        .arg("-I/usr/include/x86_64-linux-gnu")
        .arg(format!("-I{}", manifest.join("src").display()))
        .args(["-Wall", "-Werror", "-Wno-gnu-variable-sized-type-not-at-end"])
        .args(defines)
        .arg("-c")
        .arg(manifest.join(PROGRAM))
        .arg("-o")
        .arg(object);
    let out = cmd.output().with_context(|| format!("running {clang}"))?;
    if !out.status.success() {
        bail!("{clang} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// What hopscope.h declares: `#define HS_*` names and `struct hs_*` fields.
struct HeaderLayout {
    defines: Vec<String>,
    structs: Vec<(String, Vec<Field>)>,
}

struct Field {
    name: String,
    /// A flexible array member (`data[]`): has an offset but no size.
    flexible: bool,
}

fn strip_comments(src: &str) -> String {
    let mut out = String::with_capacity(src.len());
    let mut rest = src;
    loop {
        let block = rest.find("/*");
        let line = rest.find("//");
        match (block, line) {
            (Some(b), l) if l.is_none_or(|l| b < l) => {
                out.push_str(&rest[..b]);
                match rest[b + 2..].find("*/") {
                    Some(e) => rest = &rest[b + 2 + e + 2..],
                    None => return out,
                }
            }
            (_, Some(l)) => {
                out.push_str(&rest[..l]);
                match rest[l..].find('\n') {
                    Some(e) => rest = &rest[l + e..],
                    None => return out,
                }
            }
            _ => {
                out.push_str(rest);
                return out;
            }
        }
    }
}

fn header_layout(header: &str) -> Result<HeaderLayout> {
    let text = strip_comments(header);
    let mut defines = Vec::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        if words.next() == Some("#define") {
            if let (Some(name), Some(_value)) = (words.next(), words.next()) {
                if name.starts_with("HS_") {
                    defines.push(name.to_string());
                }
            }
        }
    }
    let mut structs = Vec::new();
    let mut rest = text.as_str();
    while let Some(start) = rest.find("struct hs_") {
        let after = &rest[start + "struct ".len()..];
        let name_end = after.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(after.len());
        let name = &after[..name_end];
        let tail = after[name_end..].trim_start();
        if !tail.starts_with('{') {
            rest = &after[name_end..];
            continue; // a use (`struct hs_hdr h;`), not a definition
        }
        let body_end = tail.find("};").with_context(|| format!("unterminated struct {name}"))?;
        let body = &tail[1..body_end];
        let mut fields = Vec::new();
        for decl in body.split(';').map(str::trim).filter(|d| !d.is_empty()) {
            let last = decl.split_whitespace().last().context("empty declaration")?;
            let last = last.trim_start_matches('*');
            let (fname, flexible) = match last.find('[') {
                Some(i) => (&last[..i], last[i..].trim() == "[]"),
                None => (last, false),
            };
            if fname.is_empty() || !fname.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                bail!("cannot parse field declaration `{decl}` in struct {name}");
            }
            fields.push(Field { name: fname.to_string(), flexible });
        }
        structs.push((name.to_string(), fields));
        rest = &tail[body_end + 2..];
    }
    if structs.is_empty() || defines.is_empty() {
        bail!("hopscope.h: found no structs or no HS_ constants");
    }
    Ok(HeaderLayout { defines, structs })
}

struct Measured {
    rust: String,
    /// `-DHS_EXPECT_<STRUCT>_SIZE=<n>` for the BPF compile.
    expect_defines: Vec<String>,
}

/// Compiles and runs the layout probe with the host C compiler.
fn measure_layout(manifest: &Path, out: &Path, layout: &HeaderLayout) -> Result<Measured> {
    let mut c = String::new();
    c.push_str("#include <stdio.h>\n#include <stddef.h>\n#include \"hopscope.h\"\n");
    c.push_str("#define MEMBER_SIZE(t, m) sizeof(((t *)0)->m)\nint main(void) {\n");
    for d in &layout.defines {
        writeln!(c, "  printf(\"pub const {d}: u32 = %llu;\\n\", (unsigned long long)({d}));").unwrap();
    }
    for (s, fields) in &layout.structs {
        let up = s.to_uppercase();
        writeln!(c, "  printf(\"pub const {up}_SIZE: usize = %zu;\\n\", sizeof(struct {s}));").unwrap();
        writeln!(c, "  printf(\"EXPECT {up}_SIZE %zu\\n\", sizeof(struct {s}));").unwrap();
        for f in fields {
            let fu = f.name.to_uppercase();
            writeln!(
                c,
                "  printf(\"pub const {up}_OFF_{fu}: usize = %zu;\\n\", offsetof(struct {s}, {n}));",
                n = f.name
            )
            .unwrap();
            if !f.flexible {
                writeln!(
                    c,
                    "  printf(\"pub const {up}_SIZEOF_{fu}: usize = %zu;\\n\", MEMBER_SIZE(struct {s}, {n}));",
                    n = f.name
                )
                .unwrap();
            }
        }
    }
    c.push_str("  return 0;\n}\n");
    let src = out.join("layout_probe.c");
    let exe = out.join("layout_probe");
    fs::write(&src, c).context("writing layout_probe.c")?;
    let cc = env::var("HOST_CC").or_else(|_| env::var("CC")).unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .arg(format!("-I{}", manifest.join("src").display()))
        .args(["-std=c11", "-Wall", "-Werror", "-o"])
        .arg(&exe)
        .arg(&src)
        .status()
        .with_context(|| format!("running the host C compiler `{cc}` (needed to measure hopscope.h)"))?;
    if !status.success() {
        bail!("the host C compiler `{cc}` failed on the layout probe {}", src.display());
    }
    let output = Command::new(&exe).output().context("running layout_probe")?;
    if !output.status.success() {
        bail!("layout_probe failed");
    }
    let text = String::from_utf8(output.stdout).context("layout_probe output is not utf-8")?;
    let mut rust = String::from(
        "// @generated by agent-ebpf/build.rs from src/hopscope.h (host C compiler). Do not edit.\n\
         // <STRUCT>_SIZE: sizeof; <STRUCT>_OFF_<FIELD>: offsetof; <STRUCT>_SIZEOF_<FIELD>: member size.\n",
    );
    let mut expect_defines = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("EXPECT ") {
            let (name, value) = rest.split_once(' ').context("bad EXPECT line")?;
            let name = name.strip_prefix("HS_").unwrap_or(name);
            expect_defines.push(format!("-DHS_EXPECT_{name}={value}"));
        } else {
            rust.push_str(line);
            rust.push('\n');
        }
    }
    // Counter names, one per HS_STAT_* index (HS_STAT_MAX is the array size).
    let mut stats: Vec<(u32, String)> = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("pub const HS_STAT_") {
            let (name, value) = rest.split_once(": u32 = ").context("bad stat line")?;
            if name == "MAX" {
                continue;
            }
            let value: u32 = value.trim_end_matches(';').parse().context("bad stat value")?;
            stats.push((value, format!("kernel_{}", name.to_lowercase())));
        }
    }
    stats.sort();
    rust.push_str("/// `(HS_STAT_* index, counter name)` for every kernel counter.\n");
    rust.push_str("pub const HS_STAT_NAMES: &[(u32, &str)] = &[\n");
    for (i, n) in &stats {
        writeln!(rust, "    ({i}, {n:?}),").unwrap();
    }
    rust.push_str("];\n");
    Ok(Measured { rust, expect_defines })
}
