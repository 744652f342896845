//! The `hopscope` command line (contract: ../shared/contract.md).

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use hopscope::correlate::{self, Correlator};
use hopscope::pipeline::Pipeline;
use hopscope::proto::DecoderConfig;
use hopscope::recording::{self, Meta, Writer, FORMAT_VERSION};
use hopscope::sink::report;
use hopscope::source::ebpf::{EbpfConfig, EbpfSource};
use hopscope::sys;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `eprintln!` that survives a stderr nobody reads any more: `eprintln!`
/// panics when the write fails, and a recorder whose `2>&1 | head` has
/// exited (or whose terminal went away) must go on recording, and still stop
/// the command it launched (a panic inside that drop aborted instead, and
/// the command ran on untraced).
macro_rules! say {
    ($($arg:tt)*) => {{
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// Decoding a recording allocates a few small strings per record and frees
/// them soon after; glibc's malloc/free and consolidation were ~20 % of
/// `report --json` (docs/benchmarks.md). mimalloc cut the run's CPU by ~30 %.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `--version`: a debug build says so (it is several times slower: a
/// figure measured with one is not the tool's).
const VERSION: &str = if cfg!(debug_assertions) { concat!(env!("CARGO_PKG_VERSION"), " (debug build)") } else { env!("CARGO_PKG_VERSION") };

#[derive(Parser)]
#[command(name = "hopscope", version = VERSION, about = "Where did each hop's latency go? Per-request profiling of LLM inference servers with eBPF (and CUPTI).")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Attach to running processes (and the tree below them) and record until
    /// SIGINT/SIGTERM or --duration. Needs root (CAP_BPF + CAP_PERFMON).
    #[command(group(clap::ArgGroup::new("traced").required(true).multiple(true).args(["pids", "pid_file"])))]
    Record {
        /// Process to trace; repeat for several. Its children are followed.
        #[arg(long = "pid", num_args = 1)]
        pids: Vec<u32>,
        /// A file holding the pid of a process to trace (as a start script
        /// writes it: `echo $$ > FILE` before exec), read again every second:
        /// when the process is restarted and the file names the new one, it is
        /// traced too, so a recorder left running follows a server that
        /// restarts.
        #[arg(long, value_name = "FILE")]
        pid_file: Option<PathBuf>,
        #[command(flatten)]
        opts: RecordOpts,
    },
    /// Launch CMD with the tracing in place from its first syscall, and record
    /// its process tree until it exits (or SIGINT/SIGTERM, --duration: then CMD
    /// is stopped and its way out recorded, at most 10 s).
    Run {
        #[command(flatten)]
        opts: RecordOpts,
        /// Asked to stop (a signal, --duration), how long to record the
        /// command's way out after it was sent SIGTERM (e.g. 30s for a server
        /// that drains long answers); then recording ends and the command gets
        /// SIGTERM again, SIGKILL 5 s later.
        #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "10s")]
        stop_grace: Duration,
        /// The command to launch, after `--`.
        #[arg(last = true, required = true, num_args = 1..)]
        cmd: Vec<String>,
    },
    /// What this machine supports and what to fix (loads the eBPF programs
    /// when privileged, to prove they pass the verifier here).
    Doctor {
        /// Skip the test load of the eBPF programs.
        #[arg(long)]
        no_load: bool,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Send a recording's per-request spans elsewhere.
    Export {
        #[command(subcommand)]
        to: ExportTo,
    },
    /// Per-request and per-chain figures from a recording.
    ///
    /// The text: a line per request; a table per chain, a row per hop (TTFT;
    /// the phases frontend, queue, prefill, kv, 1st_out and decode, which add
    /// up to its E2E; decode time lost to co-batched prefill, and whose when it
    /// was at least a tenth of the E2E; GPU shares with GPU records; ITLs;
    /// tokens), a sum row and the chain's time between hops; the summary in
    /// `vllm bench serve`'s layout; every loss counter.
    Report {
        /// The recording (`record -o` / `run -o`), or the segments of a
        /// rotated one (`run-*.hop`), read as one.
        #[arg(required = true, value_name = "FILE")]
        files: Vec<PathBuf>,
        /// Machine-readable output (schema 1, see docs/report-json.md).
        #[arg(long)]
        json: bool,
        /// Chain key header, when it differs from the one used at record time.
        #[arg(long)]
        chain_header: Option<String>,
        /// Ignore the engine IPC and attribute from the wire alone (what a
        /// server with an unknown IPC gets; for comparing the two).
        #[arg(long)]
        no_ipc: bool,
        /// Percentiles of the summary's TTFT/TPOT/ITL/E2EL distributions, as
        /// `vllm bench serve --metric-percentiles` (default 99).
        #[arg(long, value_name = "P,P,...", value_delimiter = ',', value_parser = hopscope::sink::summary::parse_percentile)]
        percentiles: Option<Vec<f64>>,
    },
    /// Perfetto protobuf trace of a recording: open it in ui.perfetto.dev
    /// (what each track shows: docs/perfetto.md).
    Trace {
        /// The recording (`record -o` / `run -o`), or the segments of a
        /// rotated one (`run-*.hop`), drawn as one.
        #[arg(required = true, value_name = "FILE")]
        files: Vec<PathBuf>,
        /// Trace file to write (default: the (first) FILE with the extension .pftrace).
        #[arg(short = 'o', long = "output")]
        output: Option<PathBuf>,
        /// Write packets uncompressed (for debugging the encoding; by default
        /// they are zlib-compressed in batches, which Perfetto reads natively).
        #[arg(long)]
        no_compress: bool,
        /// `whole`: every record and request in memory (~46× the
        /// recording's size), with every flow;
        /// `streamed`: memory that follows the open requests, every flow
        /// but steps→kernels in recordings without CUPTI step ends;
        /// `auto`: whole up to 4 MiB (HOPSCOPE_TRACE_FULL_MAX_BYTES), else
        /// streamed (docs/perfetto.md).
        #[arg(long, value_enum, default_value_t = TraceLayout::Auto)]
        layout: TraceLayout,
    },
    /// Compare two recordings: per matched hop and overall, TTFT/ITL/E2E
    /// changes as sums of phase deltas, token and GPU kernel deltas
    /// (docs/diff.md).
    Diff {
        /// BEFORE (the baseline), then AFTER (whose changes are explained):
        /// two recordings, or the segments of two rotated runs
        /// (`before-*.hop after-*.hop`: each run's read as one).
        #[arg(required = true, num_args = 2.., value_names = ["BEFORE", "AFTER"])]
        files: Vec<PathBuf>,
        /// Machine-readable output (schema 1, see docs/diff.md).
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum ExportTo {
    /// OTLP/HTTP protobuf: one span per request, a child per phase, joined to
    /// the caller's trace when the request carried `traceparent`.
    Otlp {
        /// The recording (`record -o` / `run -o`), or the segments of a
        /// rotated one (`run-*.hop`), exported as one.
        #[arg(required = true, value_name = "FILE")]
        files: Vec<PathBuf>,
        /// Collector endpoint, e.g. http://127.0.0.1:4318 (/v1/traces is
        /// appended unless it names a path). Default: the standard
        /// $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else
        /// $OTEL_EXPORTER_OTLP_ENDPOINT with /v1/traces appended.
        #[arg(long, value_name = "URL")]
        endpoint: Option<String>,
    },
}

#[derive(Args, Clone)]
struct RecordOpts {
    /// Recording file to write.
    #[arg(short = 'o', long = "output", default_value = "hopscope.hop")]
    output: PathBuf,
    /// Stop after this long (e.g. 30s, 2m, 500ms); default: until SIGINT/SIGTERM.
    /// `run` then sends its command SIGTERM and records until it exits (at most --stop-grace).
    #[arg(long, value_parser = parse_duration)]
    duration: Option<Duration>,
    /// Header that names a chain when requests carry no traceparent.
    #[arg(long, default_value = "x-session-id")]
    chain_header: String,
    /// Also store raw socket payload (prompts and completions!) in the
    /// recording: what each read/write's capture holds (its first
    /// --capture-bytes, or --capture-bytes-unix on unix sockets), with the
    /// syscall's full length beside it; longer transfers are kept cut.
    #[arg(long)]
    capture_payload: bool,
    /// Bytes captured per read/write syscall (at most 4096), except on unix sockets.
    #[arg(long, default_value_t = 4096)]
    capture_bytes: u32,
    /// Bytes captured per read/write syscall on unix sockets, the engine IPC
    /// (at most 32768): libzmq batches messages into writes of up to 8 KiB,
    /// and a capture shorter than a write loses the frames it cuts.
    #[arg(long, default_value_t = hopscope_ebpf::layout::HS_CAPTURE_UNIX_DEFAULT)]
    capture_bytes_unix: u32,
    /// Last bytes also captured of a read/write longer than --capture-bytes
    /// (at most 16384; 0: none), except on unix sockets: an HTTP body's end,
    /// where openai-python 1.x writes `model` and `stream` after the prompt and a
    /// server the `usage` of a long answer.
    #[arg(long, default_value_t = hopscope_ebpf::layout::HS_TAIL_DEFAULT)]
    capture_tail_bytes: u32,
    /// Off-CPU intervals shorter than this are only counted in the kernel.
    #[arg(long, value_parser = parse_duration, default_value = "1ms")]
    min_offcpu: Duration,
    /// Ring buffer size in MiB (power of two).
    #[arg(long, default_value_t = 16)]
    ringbuf_mib: u32,
    /// No live status line.
    #[arg(long, short)]
    quiet: bool,
    /// CUPTI injection library for `run` (default: $HOPSCOPE_CUPTI_INJECTION,
    /// else libhopscope_cupti.so next to hopscope).
    #[arg(long, value_name = "PATH")]
    cupti_lib: Option<PathBuf>,
    /// How CUDA graphs are traced: `node`, each kernel a graph runs (names,
    /// grids, tokens per step); `launch`, each graph launch as one kernel
    /// named `[CUDA graph N]` — far fewer records and less of CUPTI's own
    /// cost for servers that replay graphs (docs/gpu.md).
    #[arg(long, value_enum, default_value_t = GpuGraphs::Node)]
    gpu_graphs: GpuGraphs,
    /// Also write a Perfetto trace, live: threads, GPU streams, engine steps
    /// and counters grow while recording (flushed every second); chains and
    /// requests (with their flows to the steps) are added when it stops.
    /// Without CUPTI step ends, `hopscope trace` on the recording adds the
    /// flows from steps to the kernels that ran in them.
    #[arg(long, value_name = "FILE.pftrace")]
    perfetto: Option<PathBuf>,
    /// Send per-request spans to this OTLP/HTTP endpoint while recording
    /// (e.g. http://127.0.0.1:4318): each request's spans a few seconds
    /// after it ends, the spans `hopscope export otlp` makes from the
    /// recording. A slow or absent collector never holds the recording up:
    /// what it does not take is counted and said.
    #[arg(long, value_name = "URL")]
    otlp: Option<String>,
    /// With --otlp: a session chain's span is sent once no hop of it has run
    /// for this long (or when recording stops); a hop after that is sent
    /// under the same chain span and counted. Raise it for clients that
    /// think longer between hops.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, default_value = "60s", requires = "otlp")]
    otlp_chain_idle: Duration,
    /// Serve live Prometheus metrics at http://ADDR:PORT/metrics (a bare port
    /// binds 127.0.0.1). A scraper that accepts OpenMetrics (Prometheus does)
    /// also gets exemplars: each histogram bucket names the trace of the
    /// latest request in it, the trace its --otlp spans go to.
    #[arg(long, value_name = "ADDR:PORT", value_parser = parse_metrics_addr)]
    metrics: Option<std::net::SocketAddr>,
    /// NVML sampling period for GPU memory (per traced process), utilisation,
    /// PCIe and NVLink throughput (NVLink from GPM: Hopper and newer):
    /// milliseconds, or with a unit (50ms, 1s); 0 turns it off. Without an
    /// NVIDIA driver this is one note, not an error.
    #[arg(long, value_name = "MS", value_parser = parse_period, default_value = "100")]
    nvml_period: Duration,
    /// Start a new file every DURATION (e.g. 1h, 30m): the recording is
    /// written as segments OUTPUT-0001.hop, OUTPUT-0002.hop, …, which
    /// `report`, `trace` and `export otlp` read as one (`report run-*.hop`);
    /// each is also a recording of its own. For a recorder left running.
    #[arg(long, value_name = "DURATION", value_parser = parse_duration)]
    rotate_every: Option<Duration>,
    /// Start a new segment once the current one holds this many MiB.
    #[arg(long, value_name = "MIB")]
    rotate_mib: Option<u64>,
    /// With rotation: keep the newest N segments, deleting older ones, so
    /// the disk used stays bounded.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    keep: Option<u32>,
    /// NVML library to load (default: $HOPSCOPE_NVML_LIB, else libnvidia-ml.so.1).
    #[arg(long, value_name = "PATH", hide = true)]
    nvml_lib: Option<PathBuf>,
}

/// A plain number is milliseconds; otherwise as `parse_duration`.
fn parse_period(s: &str) -> Result<Duration, String> {
    match s.trim().parse::<u64>() {
        Ok(ms) => Ok(Duration::from_millis(ms)),
        Err(_) => parse_duration(s),
    }
}

fn parse_metrics_addr(s: &str) -> Result<std::net::SocketAddr, String> {
    if let Ok(port) = s.parse::<u16>() {
        return Ok(std::net::SocketAddr::from(([127, 0, 0, 1], port)));
    }
    s.parse().map_err(|_| format!("invalid --metrics address {s:?}: expected ADDR:PORT (e.g. 127.0.0.1:9464) or a port"))
}

/// Parses `500ms`, `30s`, `2m`, `1h`, or plain seconds.
fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num.parse().map_err(|_| format!("invalid duration {s:?}: expected e.g. 500ms, 30s, 2m"))?;
    let secs = match unit {
        "ms" => n / 1e3,
        "" | "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("invalid duration unit {unit:?} in {s:?}: use ms, s, m or h")),
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("invalid duration {s:?}"));
    }
    Ok(Duration::from_secs_f64(secs))
}

fn main() {
    let cli = Cli::parse();
    let res = match cli.cmd {
        Cmd::Record { pids, pid_file, opts } => record(pids, pid_file, Vec::new(), RUN_STOP_GRACE, opts),
        Cmd::Run { opts, stop_grace, cmd } => record(Vec::new(), None, cmd, stop_grace, opts),
        Cmd::Report { files, json, chain_header, no_ipc, percentiles } => report_cmd(&files, json, chain_header, no_ipc, percentiles),
        Cmd::Doctor { no_load, json } => doctor_cmd(!no_load, json),
        Cmd::Export { to: ExportTo::Otlp { files, endpoint } } => otlp_endpoint(endpoint).and_then(|e| otlp_cmd(&files, &e)),
        Cmd::Trace { files, output, no_compress, layout } => trace_cmd(&files, output, no_compress, layout),
        Cmd::Diff { files, json } => diff_cmd(&files, json),
    };
    if let Err(e) = res {
        say!("hopscope: {}", one_line(&e));
        std::process::exit(1);
    }
}

/// One clear line: the error and its causes, each said once. Many errors
/// already end with their cause's text (`cannot open recording X: {source}`)
/// and still give it as their source; it is not repeated.
fn one_line(e: &anyhow::Error) -> String {
    let mut msg = e.to_string();
    for cause in e.chain().skip(1) {
        let cause = cause.to_string();
        if !msg.ends_with(&cause) {
            msg.push_str(": ");
            msg.push_str(&cause);
        }
    }
    msg
}

/// How the files read are named in messages: the file, or the first and
/// last of several segments.
fn files_label(files: &[PathBuf]) -> String {
    match files {
        [one] => one.display().to_string(),
        [first, .., last] => format!("{} … {}, {} segments", first.display(), last.display(), files.len()),
        [] => String::new(),
    }
}

/// The files as shell words to paste after a command: consecutive segments
/// `run-0003.hop … run-0005.hop` as `run-{0003..0005}.hop` (bash and zsh
/// expand it, zero padding kept), otherwise each path, quoted where needed.
fn files_args(files: &[PathBuf]) -> String {
    let words: Vec<String> = files.iter().map(|f| shell_word(&f.display().to_string())).collect();
    // (prefix, index digits, index) of a segment's name.
    let seg = |w: &str| -> Option<(String, String, u64)> {
        let (prefix, n) = w.strip_suffix(".hop")?.rsplit_once('-')?;
        let plain = n.len() >= 4 && n.bytes().all(|b| b.is_ascii_digit()) && !prefix.contains(['{', '}', '\'', ',']);
        plain.then(|| (prefix.to_owned(), n.to_owned(), n.parse().unwrap_or(0)))
    };
    let segs: Option<Vec<_>> = words.iter().map(|w| seg(w)).collect();
    if let Some(segs @ [first, .., last]) = segs.as_deref() {
        let one_run = segs.iter().all(|s| s.0 == first.0 && s.1.len() == first.1.len());
        if one_run && segs.windows(2).all(|w| w[1].2 == w[0].2 + 1) {
            return format!("{}-{{{}..{}}}.hop", first.0, first.1, last.1);
        }
    }
    words.join(" ")
}

/// `s` as one shell word: as it is when it has nothing a shell reads, else single-quoted.
fn shell_word(s: &str) -> String {
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"_./,:=+@%-".contains(&b)) {
        return s.to_owned();
    }
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// Opens a recording or the segments of one run, as one stream.
fn open_files(files: &[PathBuf]) -> Result<recording::Reader<std::io::BufReader<std::fs::File>>> {
    recording::Reader::open_all(files).with_context(|| format!("reading {}", files_label(files)))
}

/// `--endpoint`, else the OpenTelemetry exporters' standard variables.
fn otlp_endpoint(given: Option<String>) -> Result<String> {
    let var = |k: &str| std::env::var(k).ok().map(|v| v.trim().to_owned()).filter(|v| !v.is_empty());
    given
        .or_else(|| var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
        .or_else(|| var("OTEL_EXPORTER_OTLP_ENDPOINT").map(|v| format!("{}/v1/traces", v.trim_end_matches('/'))))
        .ok_or_else(|| anyhow::anyhow!("no otlp endpoint: pass --endpoint URL (e.g. http://127.0.0.1:4318) or set OTEL_EXPORTER_OTLP_ENDPOINT"))
}

fn otlp_cmd(files: &[PathBuf], endpoint: &str) -> Result<()> {
    use hopscope::sink::otlp;
    // Streamed, in messages of BATCH_SPANS: memory follows the open requests.
    let mut reader = open_files(files)?;
    let cfg = correlate::Config { chain_header: reader.meta().chain_header.clone(), use_ipc: true };
    let (sent, read_error) = otlp::export_streamed(&mut reader, cfg, endpoint, otlp::BATCH_SPANS).context("exporting spans")?;
    say!("hopscope: exported {} spans ({} requests) to {endpoint} in {} message(s)", sent.spans, sent.requests, sent.posts);
    if let Some(e) = read_error {
        say!("hopscope: warning: {e}; the export covers the readable part");
    }
    Ok(())
}

fn doctor_cmd(load: bool, json: bool) -> Result<()> {
    let checks = hopscope::doctor::run(load);
    let written = if json {
        let v: Vec<serde_json::Value> = checks
            .iter()
            .map(|c| serde_json::json!({"check": c.what, "level": format!("{:?}", c.level).to_lowercase(), "detail": c.detail}))
            .collect();
        writeln!(std::io::stdout(), "{}", serde_json::to_string_pretty(&v)?)
    } else {
        write!(std::io::stdout(), "{}", hopscope::doctor::render(&checks))
    };
    match written {
        // As `report`: a reader that stopped reading wants no more.
        Err(e) if reader_gone(&e) => {}
        r => r.context("writing the checks to stdout")?,
    }
    let failed = checks.iter().filter(|c| c.level == hopscope::doctor::Level::Fail).count();
    if failed > 0 {
        bail!("{failed} check(s) failed: fix the FAIL lines above");
    }
    Ok(())
}

/// What reads our stdout stopped reading (`hopscope report … | head`): the
/// rest is not wanted, which is no error — end quietly, as `cat` would.
fn reader_gone(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::BrokenPipe
}

fn report_cmd(files: &[PathBuf], json: bool, chain_header: Option<String>, no_ipc: bool, percentiles: Option<Vec<f64>>) -> Result<()> {
    use hopscope::sink::summary;
    // Streamed: memory follows the open requests, not the recording's length.
    let mut reader = open_files(files)?;
    let cfg = correlate::Config { chain_header: chain_header.unwrap_or_else(|| reader.meta().chain_header.clone()), use_ipc: !no_ipc };
    let p = percentiles.unwrap_or_else(|| summary::DEFAULT_PERCENTILES.to_vec());
    // Stdout is line-buffered: unwrapped, the report would be a write(2) per few lines.
    let mut out = std::io::BufWriter::with_capacity(1 << 16, std::io::stdout().lock());
    let path = files_label(files);
    // A full disk is most likely TMPDIR's: the report spools there (docs/report-json.md).
    let full = |e: std::io::Error| {
        let hint = if e.kind() == std::io::ErrorKind::StorageFull {
            format!(" (the report spools to {}, about 0.5 KB per request: point TMPDIR at a larger disk, or free space where stdout goes)", std::env::temp_dir().display())
        } else {
            String::new()
        };
        anyhow::anyhow!("writing the report: {e}{hint}")
    };
    let written = if json { report::write_json(&mut reader, &path, cfg, &p, &mut out) } else { report::write_text(&mut reader, &path, cfg, &p, &mut out) };
    let read_error = match written.and_then(|r| out.flush().map(|()| r)) {
        Ok(r) => r,
        Err(e) if reader_gone(&e) => return Ok(()),
        Err(e) => return Err(full(e)),
    };
    if let Some(e) = read_error {
        say!("hopscope: warning: {e}; the report covers the readable part");
    }
    Ok(())
}

fn diff_cmd(files: &[PathBuf], json: bool) -> Result<()> {
    use hopscope::sink::diff;
    let (before, after) = recording::split_before_after(files).context("diff")?;
    // Each recording correlated with its own chain header, exactly as
    // `report` does, and kept as the diff needs it (a few hundred bytes a
    // request): neither side's analysis nor report is held.
    let load = |files: &Vec<PathBuf>| -> Result<(diff::Side, Option<String>)> {
        let mut reader = open_files(files)?;
        let cfg = correlate::Config { chain_header: reader.meta().chain_header.clone(), use_ipc: true };
        // Named as shell words: the diff's warnings paste it after `hopscope report`.
        diff::Side::read(&mut reader, &files_args(files), cfg).with_context(|| format!("reading {}", files_label(files)))
    };
    let (b, b_err) = load(&before)?;
    let (a, a_err) = load(&after)?;
    let d = diff::compare_sides(&b, &a);
    let mut out = std::io::stdout().lock();
    let written = if json { d.write_json(&mut out).and_then(|()| writeln!(out)) } else { out.write_all(d.render_text().as_bytes()) };
    match written {
        Err(e) if reader_gone(&e) => return Ok(()),
        r => r.context("writing the diff")?,
    }
    for (files, e) in [(&before, b_err), (&after, a_err)] {
        if let Some(e) = e {
            say!("hopscope: warning: {}: {e}; the diff covers the readable part", files_label(files));
        }
    }
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum GpuGraphs {
    Node,
    Launch,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum TraceLayout {
    Auto,
    Whole,
    Streamed,
}

fn trace_cmd(files: &[PathBuf], output: Option<PathBuf>, no_compress: bool, layout: TraceLayout) -> Result<()> {
    use hopscope::sink::perfetto;
    let output = output.unwrap_or_else(|| files[0].with_extension("pftrace"));
    let enc = if no_compress { perfetto::Encoding::PLAIN } else { perfetto::Encoding::default() };
    let mut size = 0;
    for file in files {
        size += std::fs::metadata(file).with_context(|| format!("reading {}", file.display()))?.len();
    }
    let full_max = std::env::var("HOPSCOPE_TRACE_FULL_MAX_BYTES").ok().and_then(|v| v.parse().ok()).unwrap_or(perfetto::FULL_LAYOUT_MAX_BYTES);
    match layout {
        TraceLayout::Auto if size > full_max => return trace_streamed(files, &output, enc, StreamedBecause::Size { size, full_max }),
        TraceLayout::Streamed => return trace_streamed(files, &output, enc, StreamedBecause::Asked),
        TraceLayout::Auto | TraceLayout::Whole => {}
    }
    let loaded = recording::load_all(files).with_context(|| format!("reading {}", files_label(files)))?;
    let mut c = Correlator::new(correlate::Config { chain_header: loaded.meta.chain_header.clone(), use_ipc: true });
    for r in &loaded.records {
        c.ingest(r);
    }
    let analysis = c.finish();
    let read_error = loaded.error.as_ref().map(|e| e.to_string());
    let out = std::fs::File::create(&output).with_context(|| format!("creating {}", output.display()))?;
    let input = perfetto::TraceInput { meta: &loaded.meta, records: &loaded.records, analysis: &analysis, read_error: read_error.as_deref() };
    let stats = match perfetto::write_trace_with(std::io::BufWriter::new(out), input, enc) {
        Ok((_, stats)) => stats,
        Err(e) => {
            // A half-written trace would only confuse the UI.
            let _ = std::fs::remove_file(&output);
            return Err(e).with_context(|| format!("writing {}", output.display()));
        }
    };
    if let Some(e) = read_error {
        say!("hopscope: warning: {e}; the trace covers the readable part");
    }
    if stats.offcpu_skipped > 0 {
        say!("hopscope: warning: {} off-cpu interval(s) overlapped or were inverted and were left out", stats.offcpu_skipped);
    }
    print_flow_counts(&stats, false);
    print_trace_written(&output, &stats);
    Ok(())
}

/// A second stop signal this soon after the first is the same request
/// delivered twice (timeout(1) signals its child and its process group); a
/// person asking again is slower.
const SAME_STOP: Duration = Duration::from_millis(500);

/// How long `run` records its command's way out once asked to stop, unless
/// `--stop-grace` says otherwise.
const RUN_STOP_GRACE: Duration = Duration::from_secs(10);

/// Asks `run`'s command to stop, unless the terminal's Ctrl-C that stops
/// hopscope (`by_terminal`) reached it too (in hopscope's process group): a
/// second signal would hurry its shutdown (uvicorn's forces its exit).
fn ask_command_to_stop(c: &std::process::Child, by_terminal: bool, grace: Duration) {
    if by_terminal && sys::in_my_process_group(c.id()) {
        say!("hopscope: stopping: recording until the command (pid {}) exits, as Ctrl-C asked it to (at most {}; Ctrl-C again to stop now)", c.id(), fmt_duration(grace));
    } else {
        let _ = sys::kill(c.id(), libc::SIGTERM);
        say!("hopscope: stopping: sent SIGTERM to the command (pid {}); recording until it exits (at most {}; a second signal stops now)", c.id(), fmt_duration(grace));
    }
}

/// `d` as a person reads it: "10 s", "1.5 s", "500 ms".
fn fmt_duration(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        format!("{} ms", d.as_millis())
    } else {
        format!("{} s", (d.as_secs_f64() * 10.0).round() / 10.0)
    }
}

/// SIGTERM, and SIGKILL if the command is still there 5 s later: `run`
/// never hangs on a command that ignores SIGTERM.
fn stop_command(c: &mut std::process::Child) -> Option<std::process::ExitStatus> {
    let _ = sys::kill(c.id(), libc::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        match c.try_wait() {
            Ok(Some(st)) => return Some(st),
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(_) => break,
        }
    }
    say!("hopscope: the command (pid {}) ignored SIGTERM for 5 s: SIGKILL", c.id());
    let _ = c.kill();
    c.wait().ok()
}

/// The command `run` launched. `run` owns it: however recording ends — an
/// error included — the command does not go on running untraced after
/// hopscope has gone.
struct Launched(Option<std::process::Child>);

impl Drop for Launched {
    fn drop(&mut self) {
        let Some(mut c) = self.0.take() else { return };
        if let Ok(None) = c.try_wait() {
            say!("hopscope: stopping the launched command (pid {}): recording ended with an error", c.id());
            stop_command(&mut c);
        }
    }
}

/// Output files opened before tracing started. One this run brought into
/// being is removed again if recording fails before anything was written to
/// it, so a failed start leaves no empty recording behind. One that was
/// already there (an older recording) is opened without truncating and
/// emptied only when recording starts ([`Created::truncate_old`]), so a
/// failed start (a port in use, a command that cannot be launched) leaves
/// it as it was; `-o /dev/null` and other non-regular files are never
/// truncated.
#[derive(Default)]
struct Created {
    new: Vec<std::path::PathBuf>,
    old: Vec<(std::path::PathBuf, std::fs::File)>,
}

impl Created {
    fn create(&mut self, path: &std::path::Path) -> std::io::Result<std::fs::File> {
        match std::fs::OpenOptions::new().write(true).create_new(true).open(path) {
            Ok(f) => {
                self.new.push(path.to_owned());
                Ok(f)
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let f = std::fs::OpenOptions::new().write(true).open(path)?;
                if f.metadata()?.is_file() {
                    self.old.push((path.to_owned(), f.try_clone()?));
                }
                Ok(f)
            }
            Err(e) => Err(e),
        }
    }

    /// Recording starts: the files that were there are emptied.
    fn truncate_old(&mut self) -> Result<()> {
        self.old.drain(..).try_for_each(|(p, f)| f.set_len(0).with_context(|| format!("cannot empty {} to write it anew", p.display())))
    }
}

impl Drop for Created {
    fn drop(&mut self) {
        for p in &self.new {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// `record --pid-file`: the file, and the pid it named last.
struct PidFile {
    path: PathBuf,
    pid: u32,
    /// The traced pid's exit was said.
    exit_said: bool,
    /// A pid the file named that could not be traced (said once).
    refused: Option<u32>,
}

/// The pid a pid file holds (a decimal number, blanks around it allowed).
fn read_pid_file(path: &std::path::Path) -> Result<u32, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    match text.trim().parse::<u32>() {
        Ok(0) | Err(_) => Err(format!("{:?} is not a pid", text.trim())),
        Ok(pid) => Ok(pid),
    }
}

impl PidFile {
    fn open(path: PathBuf) -> Result<PidFile> {
        let pid = read_pid_file(&path).map_err(|e| anyhow::anyhow!("cannot read a pid from {}: {e} (it must hold the pid of the process to trace, as `echo $$ > FILE` before exec writes it)", path.display()))?;
        Ok(PidFile { path, pid, exit_said: false, refused: None })
    }

    /// Once a second: a new pid in the file is traced (it and its children);
    /// the traced one's exit is said once. Returns what to tell the user.
    fn check(&mut self, source: &mut EbpfSource) -> Option<String> {
        let path = self.path.display();
        match read_pid_file(&self.path) {
            Ok(pid) if pid != self.pid && self.refused != Some(pid) => match source.add_pid(pid) {
                Ok(()) => {
                    let old = std::mem::replace(&mut self.pid, pid);
                    self.exit_said = false;
                    Some(format!("{path} now names pid {pid} (was {old}): tracing it and its children"))
                }
                Err(e) => {
                    self.refused = Some(pid);
                    Some(format!("{path} names pid {pid}, which cannot be traced ({e}); still waiting for the file to name a running process"))
                }
            },
            // Unreadable for a moment (a script rewriting it): next second.
            _ if !self.exit_said && sys::proc_state(self.pid).is_none_or(|st| st == 'Z') => {
                self.exit_said = true;
                Some(format!("traced pid {} exited; waiting for {path} to name its successor", self.pid))
            }
            _ => None,
        }
    }
}

fn record(mut pids: Vec<u32>, pid_file: Option<PathBuf>, cmd: Vec<String>, stop_grace: Duration, opts: RecordOpts) -> Result<()> {
    if opts.capture_bytes == 0 || opts.capture_bytes > 4096 {
        bail!("--capture-bytes must be between 1 and 4096");
    }
    let max_unix = hopscope_ebpf::layout::HS_MAX_CAPTURE;
    if opts.capture_bytes_unix == 0 || opts.capture_bytes_unix > max_unix {
        bail!("--capture-bytes-unix must be between 1 and {max_unix}");
    }
    let max_tail = hopscope_ebpf::layout::HS_MAX_TAIL;
    if opts.capture_tail_bytes > max_tail {
        bail!("--capture-tail-bytes must be at most {max_tail} (0 turns it off)");
    }
    let mib = opts.ringbuf_mib;
    if !mib.is_power_of_two() || mib > 1024 {
        bail!("--ringbuf-mib must be a power of two up to 1024");
    }
    let mut follow = pid_file.map(PidFile::open).transpose()?;
    if let Some(f) = &follow {
        if !pids.contains(&f.pid) {
            pids.push(f.pid);
        }
    }
    let rotating = opts.rotate_every.is_some() || opts.rotate_mib.is_some();
    if opts.rotate_every.is_some_and(|d| d < Duration::from_secs(1)) {
        bail!("--rotate-every must be at least 1s");
    }
    if opts.rotate_mib == Some(0) {
        bail!("--rotate-mib must be at least 1");
    }
    if opts.keep.is_some() && !rotating {
        bail!("--keep counts the segments of a rotated recording: add --rotate-every or --rotate-mib");
    }
    if rotating && opts.perfetto.is_some() {
        bail!("--perfetto writes one trace of one file, not of a rotated recording: leave it out and run `hopscope trace` on the segments");
    }
    if let Some(url) = &opts.otlp {
        hopscope::sink::otlp::endpoint_parts(url)?;
    }
    // With rotation, -o names the run: its files are OUTPUT-0001.hop, ….
    let mut seg = rotating.then(|| Rotation::new(&opts.output, opts.keep));
    let output = seg.as_ref().map_or_else(|| opts.output.clone(), Rotation::path);
    let stop = Arc::new(AtomicBool::new(false));
    let stop_by_terminal = Arc::new(AtomicBool::new(false));
    sys::on_stop_signals(&stop, &stop_by_terminal).context("installing signal handlers")?;

    // GPU: the CUPTI injection library in each CUDA process of the tree
    // streams its records to a private socket (source::cupti, docs/gpu.md).
    // `run` injects it; `record` can only listen for a server started with
    // the env line printed below.
    use hopscope::source::cupti::{self, GpuConfig, GpuReceiver};
    let injection = match cupti::find_injection_lib(opts.cupti_lib.as_deref()) {
        Ok(found) => found,
        Err(e) => bail!("cannot use the CUPTI injection library: {e}"),
    };
    let cfg = EbpfConfig {
        pids: pids.clone(),
        capture_len: opts.capture_bytes,
        capture_len_unix: opts.capture_bytes_unix,
        capture_tail: opts.capture_tail_bytes,
        min_offcpu_ns: opts.min_offcpu.as_nanos() as u64,
        ringbuf_bytes: mib << 20,
        ..EbpfConfig::default()
    };
    let capture_tail_unix = cfg.capture_tail_unix;
    let mut source = EbpfSource::start(cfg).context("cannot start eBPF tracing")?;
    for (tp, what) in source.missing_tracepoints() {
        say!("hopscope: note: this kernel has no {tp} tracepoint: recording without {what}");
    }
    // What can fail for a reason the user can fix (a path, a port in use)
    // fails here, before the command is launched (and while a privileged port
    // can still be bound); after the load, so that an unprivileged user first
    // learns what tracing needs.
    let mut created = Created::default();
    let out_file = created.create(&output).with_context(|| format!("cannot create the recording {}", output.display()))?;
    let perfetto_file = match &opts.perfetto {
        Some(p) => Some(created.create(p).with_context(|| format!("cannot create the trace {}", p.display()))?),
        None => None,
    };
    let metrics_listener = match opts.metrics {
        Some(addr) => Some(std::net::TcpListener::bind(addr).with_context(|| format!("cannot serve metrics on {addr}"))?),
        None => None,
    };
    let mut gpu = if !cmd.is_empty() && injection.is_none() {
        say!(
            "hopscope: note: {} not found next to hopscope (use --cupti-lib PATH or {}): recording without GPU",
            cupti::INJECTION_LIB_NAME,
            cupti::INJECTION_LIB_ENV
        );
        None
    } else {
        let mut gcfg = GpuConfig::default();
        if cmd.is_empty() {
            // A server started by hand is not necessarily below the traced
            // pids: accept our uid and the traced processes' owners, and let
            // the owner (when not us) reach the socket.
            use std::os::unix::fs::MetadataExt;
            gcfg.trusted_uids.push(sys::euid());
            for p in &pids {
                if let Ok(uid) = std::fs::metadata(format!("/proc/{p}")).map(|m| m.uid()) {
                    if !gcfg.trusted_uids.contains(&uid) {
                        gcfg.trusted_uids.push(uid);
                        if sys::euid() == 0 {
                            gcfg.socket_owner = gcfg.socket_owner.or(Some(uid));
                        }
                    }
                }
            }
        }
        // Paused: no thread may start before the capability drop below.
        match GpuReceiver::bind_paused(gcfg) {
            Ok(g) => Some(g),
            Err(e) => {
                say!("hopscope: note: {e}: recording without GPU");
                None
            }
        }
    };
    let graphs_env = (opts.gpu_graphs == GpuGraphs::Launch).then_some((cupti::GRAPHS_ENV, "launch"));
    if let (true, Some(g)) = (cmd.is_empty(), &gpu) {
        let lib = injection.as_ref().map_or_else(|| format!("/path/to/{}", cupti::INJECTION_LIB_NAME), |p| p.display().to_string());
        say!(
            "hopscope: gpu: to record GPU activity too, start the server with {}={lib} {}={}{}",
            cupti::INJECTION_ENV,
            cupti::SOCKET_ENV,
            g.socket_path().display(),
            graphs_env.map_or_else(String::new, |(k, v)| format!(" {k}={v}"))
        );
    }
    // `run`: the command is in the traced set before it execs (pipe handshake).
    let mut child = Launched(None);
    if let Some((prog, args)) = cmd.split_first() {
        let mut c = std::process::Command::new(prog);
        c.args(args);
        if let (Some(lib), Some(g)) = (&injection, &gpu) {
            c.env(cupti::INJECTION_ENV, lib).env(cupti::SOCKET_ENV, g.socket_path());
            if let Some((k, v)) = graphs_env {
                c.env(k, v);
            }
            say!("hopscope: gpu: injecting {} (socket {})", lib.display(), g.socket_path().display());
        }
        let c = source.spawn(c).with_context(|| format!("cannot launch {prog:?}"))?;
        pids.push(c.id());
        child.0 = Some(c);
    }
    // Least privilege: the programs are attached and the command (if any) is
    // launched with the capabilities hopscope was given — tracing must not
    // change what the server may do. Before any thread starts (capabilities
    // are per thread), keep only what recording still needs.
    match hopscope::privilege::drop_after_attach() {
        Ok(d) => say!("hopscope: attached; capabilities now {}", hopscope::privilege::names(d.kept)),
        Err(e) => say!("hopscope: warning: {e}: recording with the capabilities it was started with"),
    }
    if let Some(g) = &mut gpu {
        g.set_traced(source.targets());
        if let Err(e) = g.start_accepting() {
            say!("hopscope: note: {e}: recording without GPU");
            gpu = None;
        }
    }
    // NVML: its own thread; without a driver, one note and no samples.
    use hopscope::source::nvml::{NvmlConfig, NvmlSampler};
    let mut nvml = if opts.nvml_period.is_zero() {
        None
    } else {
        match NvmlSampler::start(NvmlConfig { period: opts.nvml_period, lib: opts.nvml_lib.clone(), traced: source.host_targets() }) {
            Ok(s) => Some(s),
            Err(e) => {
                say!("hopscope: note: cannot start the NVML sampler thread ({e}): recording without GPU samples");
                None
            }
        }
    };
    let start_ns = sys::monotonic_ns();
    let mut meta = Meta {
        format_version: FORMAT_VERSION,
        hopscope_version: env!("CARGO_PKG_VERSION").into(),
        created_unix_s: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        start_ns,
        start_unix_ns: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0),
        pids: pids.clone(),
        command: cmd.clone(),
        kernel: sys::kernel_release(),
        hostname: sys::hostname(),
        chain_header: opts.chain_header.to_ascii_lowercase(),
        capture_len: opts.capture_bytes,
        capture_len_unix: opts.capture_bytes_unix,
        capture_tail_unix,
        capture_tail: opts.capture_tail_bytes,
        capture_payload: opts.capture_payload,
        gpu: false,
        missing_tracepoints: source.missing_tracepoints().iter().map(|(tp, _)| tp.to_string()).collect(),
        segment: seg.as_ref().map(|_| recording::Segment { run_start_ns: start_ns, index: 1, counters_before: Default::default() }),
    };
    created.truncate_old()?;
    let writer = Writer::new(std::io::BufWriter::new(out_file), &meta).with_context(|| format!("writing {}", output.display()))?;
    let dcfg = DecoderConfig { chain_header: meta.chain_header.clone(), capture_payload: opts.capture_payload, ..DecoderConfig::default() };
    let mut pipe = Pipeline::new(dcfg, writer);
    let live_trace = match (&opts.perfetto, perfetto_file) {
        (Some(p), Some(f)) => Some(start_live_trace(p, f, &meta, &mut pipe)?),
        _ => None,
    };
    let live_otlp = match &opts.otlp {
        Some(url) => Some(start_live_otlp(url, opts.otlp_chain_idle, &meta, &mut pipe)?),
        None => None,
    };
    // From here on the files hold what was recorded, whatever happens next.
    created.new.clear();
    let mut live_metrics = None;
    if let Some(listener) = metrics_listener {
        let mut metrics = hopscope::sink::metrics::LiveMetrics::new(&meta.chain_header);
        metrics.set_clock(meta.start_ns, meta.start_unix_ns);
        let live = std::sync::Arc::new(std::sync::Mutex::new(metrics));
        let bound = hopscope::sink::metrics::serve(listener, std::sync::Arc::clone(&live)).context("cannot serve metrics")?;
        live_metrics = Some(std::sync::Arc::clone(&live));
        // The phase histograms take the requests the correlator hands out:
        // `--otlp`'s when it runs one, else one of their own.
        match &live_otlp {
            Some(o) => {
                let m = std::sync::Arc::clone(&live);
                o.borrow_mut().set_request_hook(Box::new(move |r, q| hopscope::sink::metrics::observe_phases_in(&m, r, q)));
            }
            None => {
                let cfg = correlate::Config { chain_header: meta.chain_header.clone(), use_ipc: true };
                let mut phases = hopscope::sink::metrics::LivePhases::new(cfg, std::sync::Arc::clone(&live));
                pipe.add_tap(Box::new(move |r| phases.push(r)));
            }
        }
        pipe.set_metrics(live);
        let scope = if bound.ip().is_loopback() { "" } else { " (NOT loopback: reachable from the network)" };
        say!("hopscope: metrics on http://{bound}/metrics{scope}");
    }
    let what = if cmd.is_empty() { format!("pids {pids:?}") } else { format!("{:?} (pid {})", cmd.join(" "), pids[0]) };
    if let Some(stale) = seg.as_ref().map(Rotation::stale).filter(|v| !v.is_empty()) {
        say!(
            "hopscope: note: {} file(s) from an earlier recording to {} are there ({}{}): this one overwrites those it reaches, and `hopscope report` refuses to read the rest with it; move them away",
            stale.len(),
            opts.output.display(),
            stale[0].display(),
            if stale.len() > 1 { format!(" … {}", stale[stale.len() - 1].display()) } else { String::new() }
        );
    }
    let rotation = seg.as_ref().map(|_| rotation_words(&opts)).unwrap_or_default();
    say!("hopscope: recording {what} to {}{rotation} (Ctrl-C to stop)", output.display());
    let mut seg_started = Instant::now();

    let started = Instant::now();
    let mut last_tick = Instant::now();
    let mut last_events = 0u64;
    let status_tty = std::io::stderr().is_terminal();
    let mut child_status = None;
    let mut last_traced = Instant::now();
    let mut nvml_traced = Instant::now();
    let mut last_followed = Instant::now();
    // When `run` asked its command to stop.
    let mut stopping: Option<Instant> = None;
    loop {
        let mut err = None;
        source
            .poll(Duration::from_millis(100), |ev| match ev {
                Ok(ev) => {
                    if err.is_none() {
                        if let Err(e) = pipe.push(ev) {
                            err = Some(e);
                        }
                    }
                }
                Err(_) => pipe.note_invalid(),
            })
            .context("reading the eBPF ring buffer")?;
        if let Some(e) = err {
            return Err(e).context("writing the recording");
        }
        if let Some(g) = gpu.as_mut() {
            // GPU records go to the pipeline's merge (they arrive late).
            if last_traced.elapsed() >= Duration::from_millis(100) {
                g.set_traced(source.targets());
                last_traced = Instant::now();
            }
            g.drain(|r| pipe.push_gpu(r));
            pipe.advance_gpu(sys::monotonic_ns(), g.connected()).context("writing the recording")?;
            for n in g.take_notes() {
                say!("hopscope: note: {n}");
            }
        }
        if let Some(s) = &nvml {
            if nvml_traced.elapsed() >= Duration::from_millis(100) {
                s.set_traced(source.host_targets());
                nvml_traced = Instant::now();
            }
            s.drain(|r| pipe.push_sample(r));
            for n in s.take_notes() {
                say!("hopscope: note: {n}");
            }
        }
        if last_tick.elapsed() >= Duration::from_secs(1) {
            let kernel = all_counters(&source, gpu.as_ref(), nvml.as_ref());
            pipe.tick(sys::monotonic_ns(), &kernel).context("writing the recording")?;
            if !opts.quiet {
                let st = pipe.stats();
                let drops: u64 = pipe.drop_counters(&kernel).iter().filter(|(k, _)| report::is_loss(k)).map(|(_, v)| v).sum();
                let rate = (st.events - last_events) as f64 / last_tick.elapsed().as_secs_f64();
                let gpu_part = gpu.as_ref().map(|g| format!("  gpu {:>8} records", g.records())).unwrap_or_default();
                let seg_part = seg.as_ref().map(|r| format!("  segment {}", r.index)).unwrap_or_default();
                let otlp_part = live_otlp.as_ref().map(|o| otlp_status(&o.borrow().tally())).unwrap_or_default();
                let line = format!("recording {:>5.0}s  {:>8.0} ev/s  {:>6} requests{gpu_part}  drops {}{seg_part}{otlp_part}", started.elapsed().as_secs_f64(), rate, st.http_requests, drops);
                if status_tty {
                    // Not `eprint!`: a terminal that went away must not stop the recording.
                    let _ = write!(std::io::stderr(), "\r{line}   ");
                } else {
                    say!("{line}");
                }
                last_events = st.events;
            }
            last_tick = Instant::now();
        }
        if let Some(f) = follow.as_mut().filter(|_| last_followed.elapsed() >= Duration::from_secs(1)) {
            if let Some(n) = f.check(&mut source) {
                say!("hopscope: note: {n}");
            }
            // The next segment's header lists it.
            if !meta.pids.contains(&f.pid) {
                meta.pids.push(f.pid);
            }
            last_followed = Instant::now();
        }
        if let Some(o) = &live_otlp {
            for n in o.borrow_mut().take_notes() {
                say!("hopscope: note: {n}");
            }
            if let Some(Ok(mut m)) = live_metrics.as_ref().map(|m| m.lock()) {
                m.set_otlp(o.borrow().tally());
            }
        }
        if let Some(r) = seg.as_mut() {
            let due = opts.rotate_every.is_some_and(|d| seg_started.elapsed() >= d) || opts.rotate_mib.is_some_and(|m| pipe.bytes_written() >= m.saturating_mul(1 << 20));
            if due {
                let gpu_seen = gpu.as_ref().is_some_and(|g| g.records() > 0);
                let counters = pipe.drop_counters(&all_counters(&source, gpu.as_ref(), nvml.as_ref()));
                r.rotate(&mut pipe, &meta, counters, gpu_seen)?;
                seg_started = Instant::now();
            }
        }
        // `run` records its command's way out: asked to stop (or at
        // --duration), it stops the command and records until it exits, so
        // what the server does on the way out — answers still in flight, the
        // injection's last GPU records, flushed at exit — is in the
        // recording. A second signal, or the grace passing, ends it at once.
        // A signal within SAME_STOP of the one that began the stop is that
        // one again: timeout(1), asked to stop, sends the signal to its
        // child and to its process group, so hopscope gets it twice, and
        // stopping at once there lost the command's way out.
        let signalled = stop.swap(false, Ordering::Relaxed) && stopping.is_none_or(|t| t.elapsed() >= SAME_STOP);
        let timed_out = stopping.is_none() && opts.duration.is_some_and(|d| started.elapsed() >= d);
        if signalled || timed_out {
            match child.0.as_ref() {
                Some(c) if stopping.is_none() => {
                    ask_command_to_stop(c, signalled && stop_by_terminal.load(Ordering::SeqCst), stop_grace);
                    stopping = Some(Instant::now());
                }
                _ => break,
            }
        }
        if let (Some(t), Some(c)) = (stopping, child.0.as_ref()) {
            if t.elapsed() >= stop_grace {
                say!("hopscope: note: the command (pid {}) still runs {} after it was asked to stop: recording ends here (a longer --stop-grace records more of its way out)", c.id(), fmt_duration(stop_grace));
                break;
            }
        }
        if let Some(c) = child.0.as_mut() {
            if let Some(st) = c.try_wait().context("waiting for the launched command")? {
                child_status = Some(st);
                // Let its last events reach the ring buffer, then stop.
                std::thread::sleep(Duration::from_millis(50));
                drain(&mut source, &mut pipe)?;
                break;
            }
        }
    }
    if status_tty && !opts.quiet {
        say!();
    }
    let mut gpu_records = None;
    if let Some(g) = gpu.as_mut() {
        // The command's CUDA processes flush at exit; their last records are
        // on the way until their connections end (bounded wait).
        if child_status.is_some() && !g.wait_idle(Duration::from_secs(3), |r| pipe.push_gpu(r)) {
            say!("hopscope: note: a gpu connection was still open 3 s after the command exited; recording what arrived");
        }
        g.shutdown(|r| pipe.push_gpu(r));
        for n in g.take_notes() {
            say!("hopscope: note: {n}");
        }
    }
    if let Some(s) = nvml.as_mut() {
        s.shutdown(|r| pipe.push_sample(r));
        for n in s.take_notes() {
            say!("hopscope: note: {n}");
        }
    }
    // Final drain of whatever the kernel still holds.
    drain(&mut source, &mut pipe)?;
    let kernel = all_counters(&source, gpu.as_ref(), nvml.as_ref());
    if let Some(g) = &gpu {
        gpu_records = Some(g.records());
    }
    let losses: Vec<String> = pipe.drop_counters(&kernel).into_iter().filter(|(k, v)| *v > 0 && report::is_loss(k)).map(|(k, v)| format!("{k}={v}")).collect();
    let (_, stats) = pipe.finish(sys::monotonic_ns(), &kernel).context("finishing the recording")?;
    drop(source);
    // The file just finished: with rotation, the run's last segment.
    let output = seg.as_ref().map_or(output, Rotation::path);
    if gpu_records.is_some_and(|n| n > 0) {
        cupti::mark_recording_gpu(&output).with_context(|| format!("marking {} as holding gpu records", output.display()))?;
    }
    if let Some(mut c) = child.0.take() {
        if child_status.is_none() {
            // `run` owns the command: when recording ends first, stop it too.
            child_status = stop_command(&mut c);
        }
    }
    // What `report` is pointed at: the file, or the run's kept segments.
    let written = seg.as_ref().map_or_else(|| output.display().to_string(), |r| files_label(&r.kept));
    say!(
        "hopscope: wrote {written} ({} events, {} records, {} http requests{}{})",
        stats.events,
        stats.records,
        stats.http_requests,
        gpu_records.map(|n| format!(", {n} gpu records")).unwrap_or_default(),
        child_status.map(|s| format!(", command exited with {s}")).unwrap_or_default()
    );
    if !losses.is_empty() {
        let read = seg.as_ref().map_or_else(|| output.display().to_string(), Rotation::glob);
        say!("hopscope: lost while recording: {} (`hopscope report {read}` says what each means and what to do)", losses.join(" "));
    }
    if let (Some(p), Some(live)) = (&opts.perfetto, live_trace) {
        finish_live_trace(p, &output, live)?;
    }
    if let Some(live) = live_otlp {
        let read = seg.as_ref().map_or_else(|| shell_word(&output.display().to_string()), Rotation::glob);
        finish_live_otlp(live, &read)?;
    }
    Ok(())
}

/// `hopscope trace` on a recording over `full_max` bytes: one streamed pass,
/// memory bounded by the open requests; no step→kernel flows by time (in
/// recordings without CUPTI step ends).
/// The whole trace layout's memory per byte of recording (46× measured on a
/// 20 000-request recording, docs/perfetto.md).
const WHOLE_LAYOUT_BYTES_PER_BYTE: u64 = 46;

/// Why a request part was streamed, for the note on what it left out.
#[derive(Clone, Copy)]
enum StreamedBecause {
    /// `trace --layout auto` on a recording over the threshold.
    Size { size: u64, full_max: u64 },
    /// `trace --layout streamed`.
    Asked,
    /// `record --perfetto`: the live trace's steps were written as they came.
    Live,
}

fn trace_streamed(files: &[PathBuf], output: &std::path::Path, enc: hopscope::sink::perfetto::Encoding, why: StreamedBecause) -> Result<()> {
    use hopscope::sink::perfetto;
    let mut reader = open_files(files)?;
    let cfg = correlate::Config { chain_header: reader.meta().chain_header.clone(), use_ipc: true };
    let out = std::fs::File::create(output).with_context(|| format!("creating {}", output.display()))?;
    let (_, stats, read_error) = match perfetto::live::write_trace_streamed(std::io::BufWriter::new(out), &mut reader, cfg, enc) {
        Ok(r) => r,
        Err(e) => {
            let _ = std::fs::remove_file(output);
            return Err(e).with_context(|| format!("writing {}", output.display()));
        }
    };
    if let Some(e) = read_error {
        say!("hopscope: warning: {e}; the trace covers the readable part");
    }
    print_stream_notes(&stats, why);
    print_trace_written(output, &stats);
    Ok(())
}

/// The line every way of writing a trace ends with.
fn print_trace_written(path: &std::path::Path, stats: &hopscope::sink::perfetto::TraceStats) {
    say!(
        "hopscope: wrote {} ({} requests, {} chains, {} slices, {} instants, {} counter values, {} bytes); open it in https://ui.perfetto.dev",
        path.display(),
        stats.requests,
        stats.chains,
        stats.writer.slices,
        stats.writer.instants,
        stats.writer.counter_values,
        stats.writer.bytes
    );
}

/// What a streamed request part left out.
fn print_stream_notes(stats: &hopscope::sink::perfetto::TraceStats, why: StreamedBecause) {
    if stats.offcpu_skipped > 0 {
        say!("hopscope: warning: {} off-cpu interval(s) overlapped or were inverted and were left out", stats.offcpu_skipped);
    }
    if stats.requests_late > 0 {
        say!("hopscope: warning: {} request(s) arrived after later ones were drawn and were left out (trace.requests_late)", stats.requests_late);
    }
    if stats.flows_not_streamed > 0 {
        let why = match why {
            StreamedBecause::Size { size, full_max } => format!(
                "the recording is over {full_max} bytes, so the trace was streamed; `hopscope trace --layout whole` draws them, holding ~{} MiB (or set HOPSCOPE_TRACE_FULL_MAX_BYTES higher)",
                (size * WHOLE_LAYOUT_BYTES_PER_BYTE).div_ceil(1 << 20)
            ),
            StreamedBecause::Asked => "`--layout streamed` leaves them out; `--layout whole` draws them".to_owned(),
            StreamedBecause::Live => "`hopscope trace --layout whole` on the recording draws them".to_owned(),
        };
        say!("hopscope: flows: {} step(s) drawn without their flows to the kernels that ran in them (no CUPTI step ends to tie kernels to steps as they are drawn; trace.flows_not_streamed): {why}", stats.flows_not_streamed);
    }
    print_flow_counts(stats, true);
}

/// The flows a trace drew and left out. `streamed`: its requests were drawn
/// as they became final (a request not drawn takes no flows).
fn print_flow_counts(stats: &hopscope::sink::perfetto::TraceStats, streamed: bool) {
    if stats.step_flows + stats.gpu_step_flows + stats.kernel_flows + stats.flows_capped + stats.flows_unmapped == 0 {
        return;
    }
    let request = if streamed { "a drawn request" } else { "a request" };
    // A trace without GPU work says nothing of it.
    let gpu = if stats.gpu_step_flows + stats.kernel_flows > 0 { format!(", {} step→GPU step, {} step→kernel", stats.gpu_step_flows, stats.kernel_flows) } else { String::new() };
    say!(
        "hopscope: flows: {} request→step{gpu}; {} left out (past a phase's first {} steps and before its last, or to an undrawn phase), {} step members without {request}",
        stats.step_flows,
        stats.flows_capped,
        hopscope::sink::perfetto::FLOW_HEAD,
        stats.flows_unmapped
    );
}

/// `record --perfetto`: the live trace and the first error writing it.
type LiveTrace = std::rc::Rc<std::cell::RefCell<(Option<hopscope::sink::perfetto::live::LiveTrace<std::io::BufWriter<std::fs::File>>>, Option<hopscope::sink::perfetto::PerfettoError>)>>;

/// Starts the live trace and has the pipeline feed it every record it writes.
fn start_live_trace<W: Write>(path: &std::path::Path, f: std::fs::File, meta: &Meta, pipe: &mut Pipeline<W>) -> Result<LiveTrace> {
    let t = hopscope::sink::perfetto::live::LiveTrace::new(std::io::BufWriter::new(f), meta).with_context(|| format!("writing {}", path.display()))?;
    let cell: LiveTrace = std::rc::Rc::new(std::cell::RefCell::new((Some(t), None)));
    let tap = std::rc::Rc::clone(&cell);
    pipe.add_tap(Box::new(move |r| {
        let mut s = tap.borrow_mut();
        let (t, err) = &mut *s;
        if err.is_none() {
            if let Some(t) = t.as_mut() {
                if let Err(e) = t.push(r) {
                    *err = Some(e);
                }
            }
        }
    }));
    Ok(cell)
}

/// `record --otlp`: the live exporter, fed by the pipeline.
type LiveOtlp = std::rc::Rc<std::cell::RefCell<hopscope::sink::otlp::live::LiveOtlp>>;

/// Starts the live span export and has the pipeline feed it every record it writes.
fn start_live_otlp<W: Write>(url: &str, chain_idle: Duration, meta: &Meta, pipe: &mut Pipeline<W>) -> Result<LiveOtlp> {
    let cfg = correlate::Config { chain_header: meta.chain_header.clone(), use_ipc: true };
    let live = hopscope::sink::otlp::live::LiveOtlp::start(meta, cfg, url, chain_idle).context("cannot start the otlp export")?;
    let cell: LiveOtlp = std::rc::Rc::new(std::cell::RefCell::new(live));
    let tap = std::rc::Rc::clone(&cell);
    pipe.add_tap(Box::new(move |r| tap.borrow_mut().push(r)));
    say!("hopscope: otlp: sending spans to {url} as requests end");
    Ok(cell)
}

/// The status line's part for `--otlp`.
fn otlp_status(t: &hopscope::sink::otlp::live::Tally) -> String {
    let lost = if t.lost() > 0 { format!(" ({} lost)", t.lost()) } else { String::new() };
    format!("  otlp {} spans{lost}", t.sent)
}

/// Recording stopped: the last spans are sent (10 s at most) and what the
/// collector did not take is said; an error when spans were lost, after
/// everything else was written.
fn finish_live_otlp(live: LiveOtlp, read: &str) -> Result<()> {
    let live = std::rc::Rc::try_unwrap(live).map_err(|_| anyhow::anyhow!("the otlp export is still in use (a bug); run `hopscope export otlp {read}`"))?.into_inner();
    let url = live.endpoint().to_owned();
    let t = live.finish(Duration::from_secs(10));
    say!("hopscope: otlp: {} spans of {} requests sent to {url} in {} messages", t.sent, t.requests, t.posts);
    if t.hops_after_chain_span > 0 {
        say!(
            "hopscope: note: otlp: {} hop(s) came after their session's chain span was sent (idle longer than --otlp-chain-idle): they sit under it, its end and hop count leave them out",
            t.hops_after_chain_span
        );
    }
    if t.lost() > 0 {
        bail!(
            "otlp: {} of {} spans did not reach {url} ({} dropped while the queue was full, {} refused or unanswered, {} unsent when recording stopped); the recording has them all: `hopscope export otlp {read} --endpoint {url}` sends them again (with the same span ids)",
            t.lost(),
            t.spans,
            t.dropped,
            t.failed,
            t.unsent
        );
    }
    Ok(())
}

/// Appends the requests (from the finished recording's analysis) to the live trace.
fn finish_live_trace(path: &std::path::Path, recording: &std::path::Path, live: LiveTrace) -> Result<()> {
    let (t, err) = std::rc::Rc::try_unwrap(live).map_err(|_| anyhow::anyhow!("the live trace is still in use (a bug); run `hopscope trace` on the recording"))?.into_inner();
    if let Some(e) = err {
        return Err(e).with_context(|| format!("writing {} (readable up to the failure; `hopscope trace {}` writes it again)", path.display(), recording.display()));
    }
    let Some(t) = t else { return Ok(()) };
    // Streamed: finishing holds the open requests, not the recording.
    let mut reader = recording::Reader::open(recording).with_context(|| format!("reading {}", recording.display()))?;
    let cfg = correlate::Config { chain_header: reader.meta().chain_header.clone(), use_ipc: true };
    let (_, stats, read_error) = t.finish_streamed(&mut reader, cfg).with_context(|| format!("writing {}", path.display()))?;
    if let Some(e) = read_error {
        say!("hopscope: warning: {e}; the trace's requests cover the readable part of {}", recording.display());
    }
    print_stream_notes(&stats, StreamedBecause::Live);
    print_trace_written(path, &stats);
    Ok(())
}

/// Takes whatever the ring buffer holds now, without waiting.
fn drain<W: Write>(source: &mut EbpfSource, pipe: &mut Pipeline<W>) -> Result<()> {
    let mut err = None;
    source.drain(|ev| match ev {
        Ok(ev) => {
            if err.is_none() {
                if let Err(e) = pipe.push(ev) {
                    err = Some(e);
                }
            }
        }
        Err(_) => pipe.note_invalid(),
    });
    match err {
        Some(e) => Err(e).context("writing the recording"),
        None => Ok(()),
    }
}

fn kernel_counters(source: &EbpfSource) -> Vec<(String, u64)> {
    source.stats().iter().map(|(k, v)| (k.to_owned(), v)).collect()
}

/// The counters kept outside the pipeline: the kernel's, the GPU receiver's
/// and the NVML sampler's.
fn all_counters(source: &EbpfSource, gpu: Option<&hopscope::source::cupti::GpuReceiver>, nvml: Option<&hopscope::source::nvml::NvmlSampler>) -> Vec<(String, u64)> {
    let mut kernel = kernel_counters(source);
    if let Some(g) = gpu {
        kernel.extend(g.counters());
    }
    if let Some(s) = nvml {
        kernel.extend(s.counters());
    }
    kernel
}

/// `record --rotate-every/--rotate-mib` in the startup line.
fn rotation_words(opts: &RecordOpts) -> String {
    let mut when = Vec::new();
    if let Some(d) = opts.rotate_every {
        when.push(format!("every {}", humantime_secs(d)));
    }
    if let Some(m) = opts.rotate_mib {
        when.push(format!("at {m} MiB"));
    }
    let keep = opts.keep.map(|n| format!(", keeping the newest {n}")).unwrap_or_default();
    format!(" (a new segment {}{keep})", when.join(" or "))
}

fn humantime_secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s >= 3600.0 && s % 3600.0 == 0.0 {
        format!("{}h", s / 3600.0)
    } else if s >= 60.0 && s % 60.0 == 0.0 {
        format!("{}m", s / 60.0)
    } else {
        format!("{s}s")
    }
}

/// The files of a rotated recording: OUTPUT's stem, a 4-digit index (more
/// digits past 9999), OUTPUT's extension.
struct Rotation {
    base: PathBuf,
    index: u32,
    keep: Option<u32>,
    /// The segments on disk, oldest first (the current one last).
    kept: Vec<PathBuf>,
}

impl Rotation {
    fn new(base: &std::path::Path, keep: Option<u32>) -> Self {
        let mut r = Rotation { base: base.to_owned(), index: 1, keep, kept: Default::default() };
        r.kept.push(r.path());
        r
    }

    /// OUTPUT's stem and extension (with its dot, or empty).
    fn stem_ext(&self) -> (String, String) {
        let stem = self.base.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
        (stem, self.base.extension().map(|e| format!(".{}", e.to_string_lossy())).unwrap_or_default())
    }

    fn path_of(&self, index: u32) -> PathBuf {
        let (stem, ext) = self.stem_ext();
        self.base.with_file_name(format!("{stem}-{index:04}{ext}"))
    }

    /// The current segment.
    fn path(&self) -> PathBuf {
        self.path_of(self.index)
    }

    /// Files already there that look like this run's later segments (an
    /// earlier run's, with the same OUTPUT): this run overwrites those it
    /// reaches, and `report` refuses to mix the rest with its own.
    fn stale(&self) -> Vec<PathBuf> {
        let (stem, ext) = self.stem_ext();
        let dir = self.base.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
        let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
        let mut v: Vec<PathBuf> = entries
            .filter_map(|e| e.ok())
            .filter(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                let digits = name.strip_prefix(&format!("{stem}-")).and_then(|r| r.strip_suffix(ext.as_str()));
                digits.is_some_and(|d| d.len() >= 4 && d.bytes().all(|b| b.is_ascii_digit()) && d.parse::<u32>().is_ok_and(|i| i > 1))
            })
            .map(|e| e.path())
            .collect();
        v.sort();
        v
    }

    /// What a shell expands to the run's segments (`report` checks they
    /// are one run's, consecutive).
    fn glob(&self) -> String {
        let (stem, ext) = self.stem_ext();
        self.base.with_file_name(format!("{stem}-*{ext}")).display().to_string()
    }

    /// Ends the current segment with `counters` and goes on in the next
    /// (the run's metadata, but its own start and place in the run);
    /// deletes the oldest past `keep`.
    fn rotate(&mut self, pipe: &mut Pipeline<std::io::BufWriter<std::fs::File>>, run: &Meta, counters: Vec<(String, u64)>, gpu_seen: bool) -> Result<()> {
        let prev = self.path();
        self.index += 1;
        let path = self.path();
        let now = sys::monotonic_ns();
        let since_epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let meta = Meta {
            start_ns: now,
            start_unix_ns: since_epoch.as_nanos() as u64,
            created_unix_s: since_epoch.as_secs(),
            gpu: gpu_seen,
            segment: Some(recording::Segment { run_start_ns: run.start_ns, index: self.index, counters_before: counters.iter().cloned().collect() }),
            ..run.clone()
        };
        let f = std::fs::File::create(&path).with_context(|| format!("cannot create the next segment {}", path.display()))?;
        let next = Writer::new(std::io::BufWriter::new(f), &meta).with_context(|| format!("writing {}", path.display()))?;
        let done = pipe.rotate(next, now, counters).with_context(|| format!("finishing {}", prev.display()))?;
        done.into_inner().map_err(std::io::IntoInnerError::into_error).with_context(|| format!("finishing {}", prev.display()))?;
        if gpu_seen {
            hopscope::source::cupti::mark_recording_gpu(&prev).with_context(|| format!("marking {} as holding gpu records", prev.display()))?;
        }
        self.kept.push(path.clone());
        let mut removed = Vec::new();
        while self.keep.is_some_and(|k| self.kept.len() > k as usize) {
            let old = self.kept.remove(0);
            match std::fs::remove_file(&old) {
                Ok(()) => removed.push(old.display().to_string()),
                // Not worth stopping the recording for: said, and left.
                Err(e) => say!("hopscope: warning: cannot remove {} (--keep): {e}", old.display()),
            }
        }
        let removed = if removed.is_empty() { String::new() } else { format!("; removed {} (--keep)", removed.join(", ")) };
        say!("hopscope: segment {} done; recording to {}{removed}", prev.display(), path.display());
        Ok(())
    }
}


#[cfg(test)]
mod tests {
    use super::*;

    /// What the diff's warnings paste after `hopscope report`: a run's
    /// consecutive segments as one brace range, anything else word by word.
    #[test]
    fn files_become_shell_words_a_run_of_segments_one_brace_range() {
        let p = |v: &[&str]| v.iter().map(PathBuf::from).collect::<Vec<_>>();
        assert_eq!(files_args(&p(&["/r/before-0003.hop", "/r/before-0004.hop", "/r/before-0005.hop"])), "/r/before-{0003..0005}.hop");
        assert_eq!(files_args(&p(&["run.hop"])), "run.hop");
        // A gap, another run, a name that is not a segment's: listed.
        assert_eq!(files_args(&p(&["a-0001.hop", "a-0003.hop"])), "a-0001.hop a-0003.hop");
        assert_eq!(files_args(&p(&["a-0001.hop", "b-0002.hop"])), "a-0001.hop b-0002.hop");
        assert_eq!(files_args(&p(&["a-9999.hop", "a-10000.hop"])), "a-9999.hop a-10000.hop");
        assert_eq!(files_args(&p(&["my run-0001.hop", "my run-0002.hop"])), "'my run-0001.hop' 'my run-0002.hop'");
        assert_eq!(shell_word("it's.hop"), "'it'\\''s.hop'");
    }

    #[test]
    fn segments_are_named_after_the_output_with_a_zero_padded_index() {
        let r = Rotation::new(std::path::Path::new("/var/lib/hopscope/vllm.hop"), None);
        assert_eq!(r.path(), PathBuf::from("/var/lib/hopscope/vllm-0001.hop"));
        assert_eq!(r.path_of(12_345), PathBuf::from("/var/lib/hopscope/vllm-12345.hop"));
        assert_eq!(r.glob(), "/var/lib/hopscope/vllm-*.hop");
        let bare = Rotation::new(std::path::Path::new("run"), Some(3));
        assert_eq!((bare.path_of(2), bare.glob()), (PathBuf::from("run-0002"), "run-*".to_owned()));
        assert_eq!(files_label(&bare.kept), "run-0001");
    }

    #[test]
    fn an_earlier_runs_later_segments_are_found_and_nothing_else() {
        let dir = std::env::temp_dir().join(format!("hopscope-stale-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["svc-0001.hop", "svc-0002.hop", "svc-0017.hop", "svc-12345.hop", "svc-01.hop", "svc-0003.pftrace", "svc-x003.hop", "other-0002.hop", "svc.hop"] {
            std::fs::write(dir.join(f), b"").unwrap();
        }
        let found = Rotation::new(&dir.join("svc.hop"), None).stale();
        let names: Vec<String> = found.iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
        assert_eq!(names, ["svc-0002.hop", "svc-0017.hop", "svc-12345.hop"]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_startup_line_says_when_segments_are_cut_and_how_many_are_kept() {
        let mut opts = Cli::parse_from(["hopscope", "record", "--pid", "1", "--rotate-every", "1h", "--rotate-mib", "512", "--keep", "48"]);
        let Cmd::Record { opts: ref mut o, .. } = opts.cmd else { panic!("record") };
        assert_eq!(rotation_words(o), " (a new segment every 1h or at 512 MiB, keeping the newest 48)");
        o.rotate_every = Some(Duration::from_secs(90));
        o.rotate_mib = None;
        o.keep = None;
        assert_eq!(rotation_words(o), " (a new segment every 90s)");
    }
}
