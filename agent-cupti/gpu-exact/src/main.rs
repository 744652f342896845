//! hopscope-gpu-exact: the exact-kernel GPU check (run by scripts/gpu-check.sh).
//!
//! Under libhopscope_cupti (`CUDA_INJECTION64_PATH`), this program listens on
//! its own HOPSCOPE_GPU_SOCKET, then launches a known set of NVRTC kernels,
//! copies, memsets and a captured CUDA graph, and checks that exactly those
//! arrive: counts, names, grid and block sizes, graph ids, durations within 2 %
//! of CUDA events, and CPU-side launch times (CLOCK_MONOTONIC read around each
//! launch) bracketing the API records within 50 µs. It writes a JSON report
//! to `--out DIR/exact.json` (default `$OUT` or `.`) and exits 0 only when
//! every check passed (2 when there is no GPU).

use cudarc::driver::{sys, CudaContext, LaunchConfig, PushKernelArg};
use hopscope_gpu_wire::{ApiClass, Counter, FrameDecoder, Message};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Read;
use std::os::unix::net::UnixListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const SRC: &str = r#"
extern "C" __global__ void hs_exact_add(float* out, const float* a, const float* b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] + b[i];
}
extern "C" __global__ void hs_exact_scale(float* x, float s, int n) {
    int block = blockIdx.y * gridDim.x + blockIdx.x;
    int i = block * blockDim.x * blockDim.y + threadIdx.y * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}
extern "C" __global__ void hs_exact_spin(unsigned long long cycles, int* sink) {
    long long t0 = clock64();
    while ((unsigned long long)(clock64() - t0) < cycles) {}
    if (threadIdx.x == 0 && blockIdx.x == 0) sink[0] = 1;
}
extern "C" __global__ void hs_exact_graph_a(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] * 0.5f + 1.0f;
}
extern "C" __global__ void hs_exact_graph_b(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = x[i] - 1.0f;
}
"#;

const N: usize = 1 << 20;

fn mono_now() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn json_str(s: &str) -> String {
    let mut o = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => o.push_str(&format!("\\u{:04x}", c as u32)),
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

#[derive(Default)]
struct Checks {
    items: Vec<(String, bool, String)>,
}

impl Checks {
    fn check(&mut self, name: &str, ok: bool, detail: String) {
        println!("{} {name}: {detail}", if ok { "PASS" } else { "FAIL" });
        self.items.push((name.into(), ok, detail));
    }
    fn passed(&self) -> bool {
        !self.items.is_empty() && self.items.iter().all(|(_, ok, _)| *ok)
    }
}

/// What the CPU side did, for comparison.
struct Launch {
    name: &'static str,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    before_ns: u64,
    after_ns: u64,
}

struct Work {
    launches: Vec<Launch>,
    spin_event_ms: Vec<f32>,
    graph_launches: usize,
    device: String,
}

fn run_gpu() -> Result<Work, Box<dyn std::error::Error>> {
    let ctx = CudaContext::new(0)?;
    // One stream, no cross-stream event bookkeeping (keeps captures simple).
    // SAFETY: we use a single stream and synchronise before reading results.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream()?;
    let device = format!("{} (cc {:?})", ctx.name()?, ctx.compute_capability()?);
    let ptx = cudarc::nvrtc::compile_ptx(SRC)?;
    let module = ctx.load_module(ptx)?;
    let add = module.load_function("hs_exact_add")?;
    let scale = module.load_function("hs_exact_scale")?;
    let spin = module.load_function("hs_exact_spin")?;
    let ga = module.load_function("hs_exact_graph_a")?;
    let gb = module.load_function("hs_exact_graph_b")?;

    // SAFETY: uninitialised device memory, written by the copies below before use.
    let (mut a, mut b, mut out, mut sink) = unsafe { (stream.alloc::<f32>(N)?, stream.alloc::<f32>(N)?, stream.alloc::<f32>(N)?, stream.alloc::<i32>(1)?) };
    let host: Vec<f32> = (0..N).map(|i| i as f32).collect();
    // 3 HtoD copies of 4 MiB, 2 memsets of 4 MiB.
    stream.memcpy_htod(&host, &mut a)?;
    stream.memcpy_htod(&host, &mut b)?;
    stream.memcpy_htod(&host, &mut out)?;
    stream.memset_zeros(&mut out)?;
    stream.memset_zeros(&mut b)?;
    stream.synchronize()?;

    let n = N as i32;
    let mut launches = Vec::new();
    let add_cfg = LaunchConfig { grid_dim: ((N / 256) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    for _ in 0..10 {
        let mut l = stream.launch_builder(&add);
        l.arg(&mut out).arg(&a).arg(&b).arg(&n);
        let before_ns = mono_now();
        // SAFETY: the kernel's signature matches these arguments; buffers hold N floats.
        unsafe { l.launch(add_cfg) }?;
        let after_ns = mono_now();
        launches.push(Launch { name: "hs_exact_add", grid: add_cfg.grid_dim, block: add_cfg.block_dim, before_ns, after_ns });
    }
    let scale_cfg = LaunchConfig { grid_dim: (17, 3, 1), block_dim: (128, 2, 1), shared_mem_bytes: 0 };
    for _ in 0..5 {
        let mut l = stream.launch_builder(&scale);
        let s = 1.0001f32;
        l.arg(&mut a).arg(&s).arg(&n);
        let before_ns = mono_now();
        // SAFETY: as above.
        unsafe { l.launch(scale_cfg) }?;
        launches.push(Launch { name: "hs_exact_scale", grid: scale_cfg.grid_dim, block: scale_cfg.block_dim, before_ns, after_ns: mono_now() });
    }
    // ~2 ms spins, each bracketed by CUDA events for the duration check.
    let khz = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)? as u64;
    let cycles: u64 = khz * 2;
    let spin_cfg = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 };
    let mut spin_event_ms = Vec::new();
    for _ in 0..5 {
        let e0 = ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        let e1 = ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        e0.record(&stream)?;
        let mut l = stream.launch_builder(&spin);
        l.arg(&cycles).arg(&mut sink);
        let before_ns = mono_now();
        // SAFETY: as above.
        unsafe { l.launch(spin_cfg) }?;
        launches.push(Launch { name: "hs_exact_spin", grid: spin_cfg.grid_dim, block: spin_cfg.block_dim, before_ns, after_ns: mono_now() });
        e1.record(&stream)?;
        e1.synchronize()?;
        spin_event_ms.push(e0.elapsed_ms(&e1)?);
    }

    // A captured graph: a, b, a; launched 4 times.
    let g_cfg = LaunchConfig { grid_dim: (64, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
    stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    for f in [&ga, &gb, &ga] {
        let mut l = stream.launch_builder(f);
        l.arg(&mut out).arg(&n);
        // SAFETY: as above (recorded into the graph, run by the graph launches).
        unsafe { l.launch(g_cfg) }?;
    }
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0))?.ok_or("capture produced no graph")?;
    for _ in 0..4 {
        graph.launch()?;
    }
    // 2 DtoH copies of 4 MiB.
    let mut back = vec![0f32; N];
    stream.memcpy_dtoh(&out, &mut back)?;
    stream.memcpy_dtoh(&a, &mut back)?;
    stream.synchronize()?;
    ctx.synchronize()?;
    Ok(Work { launches, spin_event_ms, graph_launches: 4, device })
}

/// Activity records among the messages (what the library's `records_sent` counts).
fn records_received(m: &[Message]) -> u64 {
    m.iter().filter(|m| matches!(m, Message::Kernel(_) | Message::Memcpy(_) | Message::Memset(_) | Message::Sync(_) | Message::Api(_))).count() as u64
}

/// Whether the last counters report came after every record received so far.
fn counters_cover_records(m: &[Message]) -> bool {
    let sent = m.iter().rev().find_map(|m| if let Message::Counters(c) = m { c.get(Counter::RecordsSent) } else { None });
    sent.is_some_and(|s| s >= records_received(m))
}

fn main() {
    let out_dir = std::env::args()
        .skip_while(|a| a != "--out")
        .nth(1)
        .or_else(|| std::env::var("OUT").ok())
        .unwrap_or_else(|| ".".into());
    std::fs::create_dir_all(&out_dir).ok();
    let report = std::path::Path::new(&out_dir).join("exact.json");

    // The socket must exist, and the variable be set, before CUDA initialises
    // (InitializeInjection reads it during cuInit).
    let sock = std::env::var("HOPSCOPE_GPU_SOCKET").unwrap_or_else(|_| format!("/tmp/hopscope-exact-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&sock);
    let listener = UnixListener::bind(&sock).expect("binding the test socket");
    std::env::set_var("HOPSCOPE_GPU_SOCKET", &sock);
    let msgs: Arc<Mutex<Vec<Message>>> = Arc::default();
    let m2 = msgs.clone();
    std::thread::spawn(move || {
        while let Ok((mut s, _)) = listener.accept() {
            let mut dec = FrameDecoder::default();
            let mut buf = vec![0u8; 1 << 16];
            while let Ok(n) = s.read(&mut buf) {
                if n == 0 {
                    break;
                }
                dec.push(&buf[..n]);
                while let Some(m) = dec.next_message() {
                    match m {
                        Ok(m) => m2.lock().unwrap().push(m),
                        Err(e) => eprintln!("bad frame: {e}"),
                    }
                }
            }
        }
    });

    // SAFETY: only probes for libcuda with dlopen.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        let _ = std::fs::write(&report, "{\"status\":\"no_gpu\",\"passed\":false}\n");
        eprintln!("no libcuda: nothing to check");
        std::process::exit(2);
    }
    let t0 = Instant::now();
    let work = match run_gpu() {
        Ok(w) => w,
        Err(e) => {
            let _ = std::fs::write(&report, format!("{{\"status\":\"cuda_error\",\"error\":{},\"passed\":false}}\n", json_str(&e.to_string())));
            eprintln!("cuda error: {e}");
            std::process::exit(1);
        }
    };
    let gpu_ms = t0.elapsed().as_millis();

    // Wait for the records (the library flushes every HOPSCOPE_CUPTI_FLUSH_MS).
    // HOPSCOPE_CUPTI_GRAPHS=launch: the graph's launches come as whole-graph kernels, its nodes not at all.
    let launch_mode = std::env::var("HOPSCOPE_CUPTI_GRAPHS").is_ok_and(|v| v.trim() == "launch");
    let expected_kernels = 10 + 5 + 5 + if launch_mode { work.graph_launches } else { 3 * work.graph_launches };
    let deadline = Instant::now() + Duration::from_secs(20);
    let count_ours = |m: &[Message], names: &HashMap<u32, String>| {
        m.iter().filter(|m| matches!(m, Message::Kernel(k) if names.get(&k.name_id).is_some_and(|n| n.starts_with("hs_exact_") || n.starts_with("[CUDA graph ")))).count()
    };
    loop {
        let m = msgs.lock().unwrap().clone();
        let names: HashMap<u32, String> = m.iter().filter_map(|m| if let Message::Name(n) = m { Some((n.id, n.name.clone())) } else { None }).collect();
        if count_ours(&m, &names) >= expected_kernels || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    // Stragglers (api records), then a counters report that covers every record received: the
    // periodic one before the records came would say "no loss" of nothing (seen on an H100 with
    // a run shorter than HOPSCOPE_GPU_REPORT_MS).
    std::thread::sleep(Duration::from_millis(500));
    let deadline = Instant::now() + Duration::from_secs(5);
    while !counters_cover_records(&msgs.lock().unwrap()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let m = msgs.lock().unwrap().clone();
    let names: HashMap<u32, String> = m.iter().filter_map(|m| if let Message::Name(n) = m { Some((n.id, n.name.clone())) } else { None }).collect();
    let mut c = Checks::default();

    let hello = m.iter().find_map(|m| if let Message::Hello(h) = m { Some(h.clone()) } else { None });
    c.check("hello", hello.is_some(), format!("{hello:?}"));
    let devices: Vec<String> = m.iter().filter_map(|m| if let Message::Device(d) = m { Some(format!("{d:?}")) } else { None }).collect();

    // Kernels: exact counts, names, grids.
    let kernels: Vec<&hopscope_gpu_wire::Kernel> = m.iter().filter_map(|m| if let Message::Kernel(k) = m { Some(k) } else { None }).collect();
    let name_of = |k: &hopscope_gpu_wire::Kernel| names.get(&k.name_id).cloned().unwrap_or_default();
    let mut by_name: BTreeMap<String, Vec<&hopscope_gpu_wire::Kernel>> = BTreeMap::new();
    for k in &kernels {
        by_name.entry(name_of(k)).or_default().push(k);
    }
    let counts: BTreeMap<&str, usize> = by_name.iter().map(|(n, v)| (n.as_str(), v.len())).collect();
    let want: BTreeMap<&str, usize> = if launch_mode {
        [("hs_exact_add", 10), ("hs_exact_scale", 5), ("hs_exact_spin", 5)].into()
    } else {
        [("hs_exact_add", 10), ("hs_exact_graph_a", 2 * work.graph_launches), ("hs_exact_graph_b", work.graph_launches), ("hs_exact_scale", 5), ("hs_exact_spin", 5)].into()
    };
    let ours: BTreeMap<&str, usize> = counts.iter().filter(|(n, _)| n.starts_with("hs_exact_")).map(|(n, v)| (*n, *v)).collect();
    c.check("kernel counts and names", ours == want, format!("got {ours:?}, want {want:?}; all kernels seen: {counts:?}"));
    for l in &work.launches {
        let ok = by_name.get(l.name).is_some_and(|v| {
            v.iter().all(|k| (k.grid[0], k.grid[1], k.grid[2]) == l.grid && (k.block[0], k.block[1], k.block[2]) == l.block)
        });
        if !ok {
            c.check(&format!("grid/block of {}", l.name), false, format!("want grid {:?} block {:?}", l.grid, l.block));
        }
    }
    c.check("grid/block sizes", !c.items.iter().any(|(n, ok, _)| n.starts_with("grid/block of") && !ok), "all launches match".into());

    if launch_mode {
        // One whole-graph kernel per launch, named after the one graph, each
        // as long as its three nodes at least (a, b, a: ~µs each).
        let wholes: Vec<_> = kernels.iter().filter(|k| k.graph_node_id == hopscope_gpu_wire::WHOLE_GRAPH).collect();
        let ids: HashSet<u32> = wholes.iter().map(|k| k.graph_id).collect();
        let named = wholes.iter().all(|k| name_of(k) == format!("[CUDA graph {}]", k.graph_id));
        let durations: Vec<u64> = wholes.iter().map(|k| k.end_ns - k.start_ns).collect();
        c.check(
            "cuda graph launch records",
            wholes.len() == work.graph_launches && ids.len() == 1 && !ids.contains(&0) && named && durations.iter().all(|d| *d > 0),
            format!("{} whole-graph kernels (want {}), graph ids {ids:?}, named after their graph: {named}, ns {durations:?}", wholes.len(), work.graph_launches),
        );
    }

    // Graph: per-node records with one graph id, 3 node ids, 3 kernels per launch.
    let graph_k: Vec<_> = kernels.iter().filter(|k| name_of(k).starts_with("hs_exact_graph_")).collect();
    let graph_ids: HashSet<u32> = graph_k.iter().map(|k| k.graph_id).collect();
    let node_ids: HashSet<u64> = graph_k.iter().map(|k| k.graph_node_id).collect();
    let mut per_corr: HashMap<u32, usize> = HashMap::new();
    for k in &graph_k {
        *per_corr.entry(k.correlation_id).or_default() += 1;
    }
    let plain_graph0 = kernels.iter().filter(|k| { let n = name_of(k); n.starts_with("hs_exact_") && !n.starts_with("hs_exact_graph_") }).all(|k| k.graph_id == 0);
    if !launch_mode {
        c.check(
            "cuda graph per-node records",
            graph_ids.len() == 1 && !graph_ids.contains(&0) && node_ids.len() == 3 && per_corr.len() == work.graph_launches && per_corr.values().all(|v| *v == 3) && plain_graph0,
            format!("graph ids {graph_ids:?}, node ids {node_ids:?}, kernels per launch {per_corr:?}, non-graph kernels have graph id 0: {plain_graph0}"),
        );
    }

    // Durations within 2 % of CUDA events (spin kernels, in launch order).
    let mut spins: Vec<_> = by_name.get("hs_exact_spin").cloned().unwrap_or_default();
    spins.sort_by_key(|k| k.start_ns);
    let ratios: Vec<f64> = spins.iter().zip(&work.spin_event_ms).map(|(k, ms)| (k.end_ns - k.start_ns) as f64 / (*ms as f64 * 1e6)).collect();
    c.check(
        "durations vs cuda events (2%)",
        ratios.len() == 5 && ratios.iter().all(|r| (r - 1.0).abs() <= 0.02),
        format!("cupti/event ratios {ratios:?}, event ms {:?}", work.spin_event_ms),
    );

    // Copies and memsets.
    let copies: Vec<(u8, u64)> = m.iter().filter_map(|m| if let Message::Memcpy(x) = m { Some((x.copy_kind, x.bytes)) } else { None }).collect();
    let htod = copies.iter().filter(|(k, b)| *k == 1 && *b == (N * 4) as u64).count();
    let dtoh = copies.iter().filter(|(k, b)| *k == 2 && *b == (N * 4) as u64).count();
    c.check("memcpy records", htod == 3 && dtoh == 2, format!("HtoD 4 MiB: {htod} (want 3), DtoH 4 MiB: {dtoh} (want 2), all: {copies:?}"));
    let sets = m.iter().filter(|m| matches!(m, Message::Memset(s) if s.bytes == (N * 4) as u64)).count();
    c.check("memset records", sets == 2, format!("{sets} memsets of 4 MiB (want 2)"));
    let syncs = m.iter().filter(|m| matches!(m, Message::Sync(_))).count();
    c.check("synchronization records", syncs >= 3, format!("{syncs} (at least 2 stream syncs + 5 event syncs expected)"));

    // CPU alignment: API records of our launches lie within CLOCK_MONOTONIC
    // reads taken around each launch call (±50 µs); kernels start after them.
    let apis: HashMap<u32, &hopscope_gpu_wire::Api> =
        m.iter().filter_map(|m| if let Message::Api(a) = m { Some((a.correlation_id, a)) } else { None }).collect();
    let mut worst_ns: i64 = 0;
    let mut matched = 0;
    let mut bad = Vec::new();
    for name in ["hs_exact_add", "hs_exact_scale", "hs_exact_spin"] {
        let mut ks = by_name.get(name).cloned().unwrap_or_default();
        ks.sort_by_key(|k| k.start_ns);
        let ls: Vec<&Launch> = work.launches.iter().filter(|l| l.name == name).collect();
        for (k, l) in ks.iter().zip(ls) {
            let Some(a) = apis.get(&k.correlation_id) else { continue };
            if a.class != ApiClass::KernelLaunch {
                continue;
            }
            matched += 1;
            let early = l.before_ns as i64 - a.start_ns as i64; // > 0: api starts before our read
            let late = a.end_ns as i64 - l.after_ns as i64;
            let gpu_early = a.start_ns as i64 - k.start_ns as i64;
            let worst = early.max(late).max(gpu_early);
            worst_ns = worst_ns.max(worst);
            if worst > 50_000 {
                bad.push(format!("{name}: api [{}, {}] vs cpu [{}, {}], kernel start {}", a.start_ns, a.end_ns, l.before_ns, l.after_ns, k.start_ns));
            }
        }
    }
    c.check(
        "cpu/gpu clock alignment (50 us)",
        matched == 20 && bad.is_empty(),
        format!("{matched}/20 launches matched to api records; worst excursion {worst_ns} ns; {bad:?}"),
    );

    let counters = m.iter().rev().find_map(|m| if let Message::Counters(c) = m { Some(c.clone()) } else { None }).unwrap_or_default();
    let named: Vec<String> = counters
        .values
        .iter()
        .map(|(id, v)| format!("{}={v}", Counter::try_from(*id).map(|c| c.name()).unwrap_or("unknown")))
        .collect();
    let lost = [Counter::DroppedQueueFull, Counter::DroppedNoAgent, Counter::DroppedSendError, Counter::CuptiDropped, Counter::BadRecordSize, Counter::CallbackPanics]
        .iter()
        .map(|k| counters.get(*k).unwrap_or(0))
        .sum::<u64>();
    let received = records_received(&m);
    let sent = counters.get(Counter::RecordsSent).unwrap_or(0);
    c.check(
        "no loss",
        lost == 0 && sent == received,
        format!("{} (records received {received}, the last counters report says {sent} sent)", named.join(" ")),
    );

    let items: Vec<String> = c
        .items
        .iter()
        .map(|(n, ok, d)| format!("{{\"check\":{},\"ok\":{ok},\"detail\":{}}}", json_str(n), json_str(d)))
        .collect();
    let body = format!(
        "{{\"status\":\"ran\",\"passed\":{},\"device\":{},\"gpu_work_ms\":{gpu_ms},\"hello\":{},\"devices\":{},\"checks\":[\n{}\n]}}\n",
        c.passed(),
        json_str(&work.device),
        json_str(&format!("{hello:?}")),
        json_str(&devices.join("; ")),
        items.join(",\n")
    );
    let _ = std::fs::write(&report, body);
    println!("{} ({} checks) -> {}", if c.passed() { "ALL PASSED" } else { "FAILED" }, c.items.len(), report.display());
    std::process::exit(if c.passed() { 0 } else { 1 });
}
