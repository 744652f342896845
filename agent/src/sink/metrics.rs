//! Live Prometheus metrics while recording (`record --metrics 127.0.0.1:9464`).
//!
//! [`LiveMetrics`] watches the records as they are written and keeps
//! histograms with vLLM's names and buckets under a `hopscope_` prefix
//! (`vllm:time_to_first_token_seconds` → `hopscope_time_to_first_token_seconds`),
//! plus the per-hop-index TTFT vLLM cannot see. [`serve`] answers `GET
//! /metrics` from a thread of its own: in the text exposition format, or in
//! OpenMetrics when the scraper asks for it (Prometheus does), whose
//! histogram buckets carry exemplars naming the trace of the request last
//! observed in them — the trace `--otlp` and `export otlp` send its spans in.
//!
//! The phase histograms (frontend, queue, prefill, decode, KV transfer)
//! need the correlator: [`LiveMetrics::observe_phases`] takes each request
//! as the streaming correlator hands it out, a few seconds after it ended
//! (its settle time) — from `record --otlp`'s correlator when it runs, else
//! from [`LivePhases`]'s own.

use crate::event::ConnKey;
use crate::model::{HttpRole, Record, SseKind};
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::{Arc, Mutex};

/// vLLM's buckets (vllm/v1/metrics/loggers.py), in seconds.
const TTFT_BUCKETS: &[f64] = &[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0];
const ITL_BUCKETS: &[f64] = &[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
const E2E_BUCKETS: &[f64] = &[0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0];

/// The latest observation of a bucket, and whose trace it was.
#[derive(Debug, Clone, Copy)]
struct Exemplar {
    trace_id: [u8; 16],
    value: f64,
    /// CLOCK_MONOTONIC ns of the observation.
    at_ns: u64,
}

#[derive(Debug, Clone)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
    /// Per bucket, `+Inf` last: the latest observation that fell in it
    /// (smallest bound at or above it).
    exemplars: Vec<Option<Exemplar>>,
}

/// Which exposition [`LiveMetrics::render_as`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Prometheus text format 0.0.4 (no exemplars).
    Text,
    /// OpenMetrics 1.0.0, with exemplars; `unix_offset_ns` turns their
    /// monotonic times into Unix ones (none: exemplars without a timestamp).
    OpenMetrics,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram { bounds, counts: vec![0; bounds.len()], sum: 0.0, count: 0, exemplars: vec![None; bounds.len() + 1] }
    }

    fn observe(&mut self, v: f64, trace: Option<([u8; 16], u64)>) {
        // The smallest bound at or above v; buckets are cumulative from there.
        let i = self.bounds.iter().position(|b| v <= *b).unwrap_or(self.bounds.len());
        for c in &mut self.counts[i..] {
            *c += 1;
        }
        self.sum += v;
        self.count += 1;
        if let Some((trace_id, at_ns)) = trace {
            self.exemplars[i] = Some(Exemplar { trace_id, value: v, at_ns });
        }
    }

    fn render(&self, out: &mut String, name: &str, labels: &str, om: Option<Option<i128>>) {
        let sep = if labels.is_empty() { "" } else { "," };
        let exemplar = |out: &mut String, i: usize| {
            let (Some(offset), Some(e)) = (om, self.exemplars[i]) else { return };
            let _ = write!(out, " # {{trace_id=\"");
            for b in e.trace_id {
                let _ = write!(out, "{b:02x}");
            }
            let _ = write!(out, "\"}} {}", e.value);
            if let Some(off) = offset {
                let unix_ns = (e.at_ns as i128 + off).max(0);
                let _ = write!(out, " {}.{:09}", unix_ns / 1_000_000_000, unix_ns % 1_000_000_000);
            }
        };
        for (i, (b, c)) in self.bounds.iter().zip(&self.counts).enumerate() {
            // OpenMetrics writes bounds as floats ("1.0"); 0.0.4 parsers take either.
            if om.is_some() {
                let _ = write!(out, "{name}_bucket{{{labels}{sep}le=\"{b:?}\"}} {c}");
            } else {
                let _ = write!(out, "{name}_bucket{{{labels}{sep}le=\"{b}\"}} {c}");
            }
            exemplar(out, i);
            out.push('\n');
        }
        let _ = write!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {}", self.count);
        exemplar(out, self.bounds.len());
        out.push('\n');
        let braces = if labels.is_empty() { String::new() } else { format!("{{{labels}}}") };
        let _ = writeln!(out, "{name}_sum{braces} {}", self.sum);
        let _ = writeln!(out, "{name}_count{braces} {}", self.count);
    }
}

struct Open {
    /// Its series' model (a [`LiveMetrics::by_model`] key).
    model: String,
    arrive_ns: u64,
    hop: u32,
    ttft_ns: Option<u64>,
    last_content_ns: Option<u64>,
    /// The response's status, not yet counted: it waits, when the request
    /// named no model, for the model its response names (or its end).
    status: Option<u16>,
    chain: String,
    source: crate::correlate::ChainSource,
    /// The trace its spans go to ([`crate::sink::otlp::request_trace_id`]).
    trace_id: [u8; 16],
    /// When its chain's previous hop ended, not yet observed: a
    /// `RequestLink` right behind the request may move it to another chain,
    /// so the time between hops waits for the request's next record.
    between_from: Option<u64>,
}

/// A chain as the live stream sees it: hops so far, and when its latest hop
/// ended if no hop has arrived since.
#[derive(Default)]
struct ChainLive {
    hops: u32,
    last_done_ns: Option<u64>,
}

/// The series vLLM labels with `model_name`: one set per model the
/// requests named.
#[derive(Debug, Clone)]
struct PerModel {
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    /// The phases of requests whose response ended (the report's
    /// `phases_ms`; seconds).
    frontend: Histogram,
    queue: Histogram,
    prefill: Histogram,
    decode: Histogram,
    kv_transfer: Histogram,
    /// The last output's path (`last_output_ms`): inside decode, not a phase.
    last_output: Histogram,
    /// The engine scheduler's own queue (`scheduler_queue_ms`): inside queue,
    /// vLLM's `request_queue_time`.
    scheduler_queue: Histogram,
    /// The part of first_output the engine went on decoding while the text
    /// was held back (`first_output_held_ms`).
    first_output_held: Histogram,
    requests: BTreeMap<u16, u64>,
    /// Requests whose connection closed before their response ended.
    closed: u64,
    /// Requests that asked for structured output, by kind.
    structured: BTreeMap<&'static str, u64>,
    /// Requests later ones went past in the engine's queue
    /// (`scheduler_passed_over_by` > 0).
    passed_over: u64,
    prompt_tokens: u64,
    generation_tokens: u64,
}

impl PerModel {
    fn new() -> Self {
        PerModel {
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            // vLLM's request-latency buckets for the phases it has; the
            // TTFT ones for the milliseconds-scale phases only hopscope has.
            frontend: Histogram::new(TTFT_BUCKETS),
            queue: Histogram::new(E2E_BUCKETS),
            prefill: Histogram::new(E2E_BUCKETS),
            decode: Histogram::new(E2E_BUCKETS),
            kv_transfer: Histogram::new(TTFT_BUCKETS),
            last_output: Histogram::new(TTFT_BUCKETS),
            scheduler_queue: Histogram::new(E2E_BUCKETS),
            first_output_held: Histogram::new(TTFT_BUCKETS),
            requests: BTreeMap::new(),
            closed: 0,
            structured: BTreeMap::new(),
            passed_over: 0,
            prompt_tokens: 0,
            generation_tokens: 0,
        }
    }
}

/// `key`'s series, made when it has none: looked up by `&str`, so the
/// records of a request (every content chunk) copy no name.
fn series<'a>(by_model: &'a mut BTreeMap<String, PerModel>, key: &str) -> &'a mut PerModel {
    if !by_model.contains_key(key) {
        by_model.insert(key.to_owned(), PerModel::new());
    }
    by_model.get_mut(key).expect("inserted above when missing")
}

/// Counts `o`'s response status, once, under its series' model.
fn count_status(by_model: &mut BTreeMap<String, PerModel>, o: &mut Open) {
    if let Some(status) = o.status.take() {
        *series(by_model, &o.model).requests.entry(status).or_default() += 1;
    }
}

/// The phase histograms' feed when `record --otlp` runs no correlator: the
/// report's streaming correlator on the records written, each request it
/// hands out given to [`LiveMetrics::observe_phases`].
pub struct LivePhases {
    feed: crate::sink::report::RequestFeed,
    /// Empty: the phases need no GPU memory peaks.
    gpu_mem: crate::sink::summary::GpuMemIndex,
    metrics: Arc<Mutex<LiveMetrics>>,
}

impl LivePhases {
    pub fn new(cfg: crate::correlate::Config, metrics: Arc<Mutex<LiveMetrics>>) -> Self {
        LivePhases { feed: crate::sink::report::RequestFeed::new(cfg), gpu_mem: Default::default(), metrics }
    }

    /// Takes the next record written (file order).
    pub fn push(&mut self, rec: &Record) {
        let mut put = |r: &crate::correlate::Request, q: &crate::sink::report::RequestRef| {
            observe_phases_in(&self.metrics, r, q);
            Ok::<(), std::convert::Infallible>(())
        };
        let Ok(_) = self.feed.push(rec, &self.gpu_mem, &mut put, &mut |_, _| Ok(()));
    }

    /// The records ended: the requests not handed out yet are.
    pub fn finish(self) {
        let mut put = |r: &crate::correlate::Request, q: &crate::sink::report::RequestRef| {
            observe_phases_in(&self.metrics, r, q);
            Ok::<(), std::convert::Infallible>(())
        };
        let Ok(_) = self.feed.finish(&self.gpu_mem, &mut put, &mut |_, _| Ok(()));
    }
}

/// [`LiveMetrics::observe_phases`] on the metrics the endpoint serves.
pub fn observe_phases_in(metrics: &Mutex<LiveMetrics>, r: &crate::correlate::Request, q: &crate::sink::report::RequestRef) {
    if let Ok(mut m) = metrics.lock() {
        m.observe_phases(r, q);
    }
}

/// A hop of `chain` ended at `ts_ns` (its response's end, or its client
/// left): the chain's next hop is timed from the latest such end.
fn hop_ended(hops: &mut HashMap<String, ChainLive>, chain: &str, ts_ns: u64) {
    if let Some(c) = hops.get_mut(chain) {
        c.last_done_ns = Some(c.last_done_ns.map_or(ts_ns, |d| d.max(ts_ns)));
    }
}

/// Models named past this many share the `model_name="other"` series: the name
/// comes from the clients, so its label's cardinality is bounded here.
const MAX_MODEL_LABELS: usize = 16;

/// Metrics built from the live record stream.
pub struct LiveMetrics {
    open: HashMap<(ConnKey, u32), Open>,
    hops: HashMap<String, ChainLive>,
    chain_header: String,
    /// By the request body's `model` (`""`: none named, no label).
    by_model: BTreeMap<String, PerModel>,
    ttft_by_hop: BTreeMap<u32, Histogram>,
    /// A hop's arrival less the end of its chain's previous hop.
    between_hops: Histogram,
    drops: Vec<(String, u64)>,
    /// Per engine index: the latest `scheduler_stats` and the prefix-cache totals.
    engines: BTreeMap<u64, EngineGauges>,
    /// Per device: the latest NVML sample's figures.
    gpus: BTreeMap<u32, GpuGauges>,
    /// Per device: its model and driver (NVML, once at the start).
    gpu_info: BTreeMap<u32, (String, String)>,
    /// The live span export's counts (`--otlp`), as of the last update.
    otlp: Option<crate::sink::otlp::live::Tally>,
    /// Unix ns less CLOCK_MONOTONIC ns, for exemplar timestamps.
    unix_offset_ns: Option<i128>,
    /// The Responses API's response ids seen, with their chains: a turn
    /// naming one as its `previous_response_id` joins that chain, as the
    /// correlator joins it.
    responses: crate::correlate::ResponseChains,
    /// Requests whose time between hops waits ([`Open::between_from`]),
    /// with their `HttpRequest`'s time (the `RequestLink`'s too).
    unsettled: Vec<((ConnKey, u32), u64)>,
}

#[derive(Debug, Default, Clone, Copy)]
struct EngineGauges {
    running: Option<u64>,
    waiting: Option<u64>,
    kv_cache_usage: Option<f64>,
    prefix_queries: u64,
    prefix_hits: u64,
}

/// One GPU's latest NVML sample: memory used, SM utilisation, and per link
/// ([`GPU_LINKS`]: PCIe, NVLink) its throughput, KiB/s, transmit and receive.
#[derive(Debug, Clone, Copy)]
struct GpuGauges {
    used: u64,
    sm: Option<u32>,
    links: [[Option<u64>; 2]; 2],
}

/// The family and help of each of [`GpuGauges::links`].
const GPU_LINKS: [(&str, &str); 2] = [
    ("hopscope_gpu_pcie_bytes_per_second", "PCIe throughput over NVML's last 20 ms, by direction (NVML)."),
    ("hopscope_gpu_nvlink_bytes_per_second", "NVLink throughput summed over links since the previous sample, by direction (NVML GPM, Hopper and newer)."),
];

/// Hop indexes past this share the last series (bounded label cardinality).
const MAX_HOP_LABEL: u32 = 16;

impl LiveMetrics {
    pub fn new(chain_header: &str) -> Self {
        LiveMetrics {
            open: HashMap::new(),
            hops: HashMap::new(),
            chain_header: chain_header.to_ascii_lowercase(),
            by_model: BTreeMap::new(),
            ttft_by_hop: BTreeMap::new(),
            between_hops: Histogram::new(TTFT_BUCKETS),
            drops: Vec::new(),
            otlp: None,
            engines: BTreeMap::new(),
            gpus: BTreeMap::new(),
            gpu_info: BTreeMap::new(),
            unix_offset_ns: None,
            responses: Default::default(),
            unsettled: Vec::new(),
        }
    }

    /// The recording's clocks (its metadata's `start_ns` and `start_unix_ns`):
    /// exemplars then carry the Unix time of their observation.
    pub fn set_clock(&mut self, start_ns: u64, start_unix_ns: u64) {
        self.unix_offset_ns = (start_unix_ns > 0).then(|| start_unix_ns as i128 - start_ns as i128);
    }

    pub fn observe(&mut self, rec: &Record) {
        // A request's `RequestLink` carries its `HttpRequest`'s time and
        // follows it: anything later settles the chain it is in.
        if !self.unsettled.is_empty() {
            let ts = rec.ts_ns();
            let own = match rec {
                Record::RequestLink { .. } => None,
                Record::Sse { conn, seq, .. }
                | Record::ResponseBody { conn, seq, .. }
                | Record::HttpResponse { conn, seq, .. }
                | Record::HttpResponseEnd { conn, seq, .. }
                | Record::ResponseModel { conn, seq, .. } => Some((*conn, *seq)),
                _ => None,
            };
            let mut i = 0;
            while i < self.unsettled.len() {
                let (key, at) = self.unsettled[i];
                if ts > at || Some(key) == own || matches!(rec, Record::ConnClose { conn, .. } if *conn == key.0) {
                    self.unsettled.swap_remove(i);
                    self.settle(key);
                } else {
                    i += 1;
                }
            }
        }
        match rec {
            Record::RequestLink { conn, seq, previous_response_id, .. } => {
                self.link((*conn, *seq), previous_response_id);
                self.settle((*conn, *seq));
            }
            Record::HttpRequest { conn, role: HttpRole::Server, seq, start_ns, end_ns, headers, model, .. } => {
                let model = self.model_series(model.as_deref());
                let (chain, source) = crate::correlate::chain_key(*conn, headers, &self.chain_header);
                let trace_id = crate::sink::otlp::request_trace_id(&chain, source);
                let c = self.hops.entry(chain.clone()).or_default();
                c.hops += 1;
                // The client's own time before this hop, when the chain's
                // previous hop had ended (hops in flight together have none).
                let between_from = c.last_done_ns.take().filter(|d| *d <= *start_ns);
                if between_from.is_some() {
                    self.unsettled.push(((*conn, *seq), *end_ns));
                }
                self.open.insert((*conn, *seq), Open { model, arrive_ns: *start_ns, hop: c.hops, ttft_ns: None, last_content_ns: None, status: None, chain, source, trace_id, between_from });
                // Bounded: a client that never finishes cannot grow this forever.
                if self.open.len() > 1 << 16 {
                    let oldest = self.open.iter().min_by_key(|(_, o)| o.arrive_ns).map(|(k, _)| *k);
                    if let Some(mut o) = oldest.and_then(|k| self.open.remove(&k)) {
                        count_status(&mut self.by_model, &mut o);
                    }
                }
                if self.hops.len() > 1 << 16 {
                    self.hops.clear();
                }
            }
            Record::Sse { conn, seq, ts_ns, kind, usage, id, .. } => {
                self.remember_response((*conn, *seq), id.as_deref());
                let open = self.open.get_mut(&(*conn, *seq));
                let m = series(&mut self.by_model, open.as_ref().map_or("", |o| o.model.as_str()));
                if let Some(u) = usage {
                    m.prompt_tokens += u.prompt_tokens.unwrap_or(0);
                    m.generation_tokens += u.completion_tokens.unwrap_or(0);
                }
                let Some(o) = open else { return };
                if *kind == SseKind::Content {
                    let ex = Some((o.trace_id, *ts_ns));
                    match o.last_content_ns {
                        Some(last) => m.itl.observe(ts_ns.saturating_sub(last) as f64 / 1e9, ex),
                        None => {
                            let ttft = ts_ns.saturating_sub(o.arrive_ns) as f64 / 1e9;
                            m.ttft.observe(ttft, ex);
                            self.ttft_by_hop.entry(o.hop.min(MAX_HOP_LABEL)).or_insert_with(|| Histogram::new(TTFT_BUCKETS)).observe(ttft, ex);
                            o.ttft_ns = Some(*ts_ns);
                        }
                    }
                    o.last_content_ns = Some(*ts_ns);
                }
            }
            Record::ResponseBody { conn, seq, usage, id, .. } => {
                self.remember_response((*conn, *seq), id.as_deref());
                let Some(u) = usage else { return };
                let m = series(&mut self.by_model, self.open.get(&(*conn, *seq)).map_or("", |o| o.model.as_str()));
                m.prompt_tokens += u.prompt_tokens.unwrap_or(0);
                m.generation_tokens += u.completion_tokens.unwrap_or(0);
            }
            Record::HttpResponse { conn, role: HttpRole::Server, seq, status, .. } => {
                if let Some(o) = self.open.get_mut(&(*conn, *seq)) {
                    o.status = Some(*status);
                    if !o.model.is_empty() {
                        count_status(&mut self.by_model, o);
                    }
                }
            }
            Record::ResponseModel { conn, seq, model, .. } => {
                if !self.open.get(&(*conn, *seq)).is_some_and(|o| o.model.is_empty()) {
                    return;
                }
                let named = self.model_series(Some(model));
                if let Some(o) = self.open.get_mut(&(*conn, *seq)) {
                    o.model = named;
                    count_status(&mut self.by_model, o);
                }
            }
            Record::HttpResponseEnd { conn, seq, ts_ns, .. } => {
                if let Some(mut o) = self.open.remove(&(*conn, *seq)) {
                    count_status(&mut self.by_model, &mut o);
                    series(&mut self.by_model, &o.model).e2e.observe(ts_ns.saturating_sub(o.arrive_ns) as f64 / 1e9, Some((o.trace_id, *ts_ns)));
                    hop_ended(&mut self.hops, &o.chain, *ts_ns);
                }
            }
            // The client left before the response ended (a timeout, a
            // cancelled step): counted, and its chain's hop ends here.
            Record::ConnClose { conn, ts_ns } => {
                let gone: Vec<(ConnKey, u32)> = self.open.keys().filter(|k| k.0 == *conn).copied().collect();
                for k in gone {
                    let Some(mut o) = self.open.remove(&k) else { continue };
                    count_status(&mut self.by_model, &mut o);
                    series(&mut self.by_model, &o.model).closed += 1;
                    hop_ended(&mut self.hops, &o.chain, *ts_ns);
                }
            }
            Record::Drops { counters, .. } => self.drops.clone_from(counters),
            Record::EngineStats { engine_index, running, waiting, kv_cache_usage, prefix_cache_queries, prefix_cache_hits, .. } => {
                // Bounded by the engines of one server (data-parallel ranks).
                if self.engines.len() >= 256 && !self.engines.contains_key(&engine_index.unwrap_or(0)) {
                    return;
                }
                let e = self.engines.entry(engine_index.unwrap_or(0)).or_default();
                // Gauges keep the last value seen; a field this version does not send stays absent.
                e.running = running.or(e.running);
                e.waiting = waiting.or(e.waiting);
                e.kv_cache_usage = kv_cache_usage.or(e.kv_cache_usage);
                // vLLM sends the counts since its previous stats: they add up.
                e.prefix_queries += prefix_cache_queries.unwrap_or(0);
                e.prefix_hits += prefix_cache_hits.unwrap_or(0);
            }
            // Bounded: at most 64 devices get a series.
            Record::GpuSample { device, mem_used_bytes, sm_util_pct, pcie_tx_kib_s, pcie_rx_kib_s, nvlink_tx_kib_s, nvlink_rx_kib_s, .. }
                if self.gpus.len() < 64 || self.gpus.contains_key(device) =>
            {
                let links = [[pcie_tx_kib_s.map(u64::from), pcie_rx_kib_s.map(u64::from)], [*nvlink_tx_kib_s, *nvlink_rx_kib_s]];
                self.gpus.insert(*device, GpuGauges { used: *mem_used_bytes, sm: *sm_util_pct, links });
            }
            Record::NvmlDevice { device, name, driver, .. } if self.gpu_info.len() < 64 || self.gpu_info.contains_key(device) => {
                self.gpu_info.insert(*device, (name.clone(), driver.clone()));
            }
            _ => {}
        }
    }

    /// The time between hops of request `key`, once its chain is settled.
    fn settle(&mut self, key: (ConnKey, u32)) {
        let Some(o) = self.open.get_mut(&key) else { return };
        if let Some(done) = o.between_from.take() {
            self.between_hops.observe(o.arrive_ns.saturating_sub(done) as f64 / 1e9, Some((o.trace_id, o.arrive_ns)));
        }
    }

    /// Request `key`'s response is `id`: a Responses API id is remembered
    /// with the request's chain, for the turns that will name it.
    fn remember_response(&mut self, key: (ConnKey, u32), id: Option<&str>) {
        if let (Some(id), Some(o)) = (id, self.open.get(&key)) {
            self.responses.remember(id, &o.chain, o.source);
        }
    }

    /// Request `key` continues the response `previous`: a turn its
    /// connection alone chained joins that response's chain as its next hop
    /// (the correlator's rule, so the hop labels and exemplars match the
    /// report's and the spans'); its connection's chain gets back its hop.
    fn link(&mut self, key: (ConnKey, u32), previous: &str) {
        let Some((chain, source)) = self.responses.get(previous).cloned() else { return };
        let Some(o) = self.open.get_mut(&key) else { return };
        if o.source != crate::correlate::ChainSource::Connection || o.chain == chain {
            return;
        }
        if let Some(c) = self.hops.get_mut(&o.chain) {
            if c.hops == o.hop {
                c.hops -= 1;
            }
            if c.last_done_ns.is_none() {
                c.last_done_ns = o.between_from.take();
            }
            if c.hops == 0 && c.last_done_ns.is_none() {
                self.hops.remove(&o.chain);
            }
        }
        let c = self.hops.entry(chain.clone()).or_default();
        c.hops += 1;
        o.hop = c.hops;
        o.between_from = c.last_done_ns.take().filter(|d| *d <= o.arrive_ns);
        o.trace_id = crate::sink::otlp::request_trace_id(&chain, source);
        o.chain = chain;
        o.source = source;
    }

    /// A request the correlator handed out, under its model's series: its
    /// phases, when its response ended (the E2E histogram's requests; one its
    /// client left has phases of its wait, not of an E2E), and the tokens no
    /// usage object counted (a stream without `stream_options.include_usage`,
    /// a client that left): the engine's.
    pub fn observe_phases(&mut self, r: &crate::correlate::Request, q: &crate::sink::report::RequestRef) {
        let (prompt, generated) = (q.prompt_tokens.filter(|_| r.usage.prompt_tokens.is_none()), q.completion_tokens.filter(|_| r.usage.completion_tokens.is_none()));
        let p = q.phases_ms;
        let ended = r.done_ns.filter(|_| [p.frontend, p.queue, p.prefill, p.decode, p.kv_transfer].iter().any(Option::is_some));
        if prompt.is_none() && generated.is_none() && ended.is_none() {
            // Nothing to count: no series is made for it.
            return;
        }
        let key = self.model_series(q.model);
        let m = series(&mut self.by_model, &key);
        m.prompt_tokens += prompt.unwrap_or(0);
        m.generation_tokens += generated.unwrap_or(0);
        if let Some(kind) = q.structured_output {
            *m.structured.entry(kind).or_default() += 1;
        }
        m.passed_over += u64::from(q.scheduler_passed_over_by.is_some_and(|n| n > 0));
        let Some(done) = ended else { return };
        let ex = Some((crate::sink::otlp::request_trace_id(&r.chain, r.chain_source), done));
        for (h, v) in [(&mut m.frontend, p.frontend), (&mut m.queue, p.queue), (&mut m.prefill, p.prefill), (&mut m.decode, p.decode), (&mut m.kv_transfer, p.kv_transfer), (&mut m.last_output, q.last_output_ms), (&mut m.scheduler_queue, q.scheduler_queue_ms), (&mut m.first_output_held, q.first_output_held_ms)] {
            if let Some(v) = v {
                h.observe(v / 1e3, ex);
            }
        }
    }

    /// The series key of a request naming `model`: its name while fewer than
    /// [`MAX_MODEL_LABELS`] named models have series, else `other`.
    fn model_series(&mut self, model: Option<&str>) -> String {
        let m = model.unwrap_or("");
        let named = || self.by_model.keys().filter(|k| !k.is_empty() && *k != "other").count();
        if m.is_empty() {
            // Made when something is observed: the response may name it yet.
            return String::new();
        }
        let key = if self.by_model.contains_key(m) || named() < MAX_MODEL_LABELS { m } else { "other" };
        series(&mut self.by_model, key);
        key.to_owned()
    }

    /// The live span export's counts, for the `hopscope_otlp_spans_total` series.
    pub fn set_otlp(&mut self, t: crate::sink::otlp::live::Tally) {
        self.otlp = Some(t);
    }

    /// The text exposition format (version 0.0.4).
    pub fn render(&self) -> String {
        self.render_as(Format::Text)
    }

    /// The text exposition format, or OpenMetrics 1.0.0 with exemplars.
    pub fn render_as(&self, format: Format) -> String {
        let mut s = String::new();
        let om = (format == Format::OpenMetrics).then_some(self.unix_offset_ns);
        // OpenMetrics names a counter's family without the `_total` its samples carry.
        let family = |s: &mut String, name: &str, help: &str, kind: &str| {
            let fam = if om.is_some() && kind == "counter" { name.strip_suffix("_total").unwrap_or(name) } else { name };
            let _ = writeln!(s, "# HELP {fam} {help}\n# TYPE {fam} {kind}");
        };
        let hist = |s: &mut String, name: &str, help: &str, h: &Histogram| {
            family(s, name, help, "histogram");
            h.render(s, name, "", om);
        };
        // vLLM's label; none for requests that named no model.
        let models: Vec<(String, &PerModel)> = self.by_model.iter().map(|(m, v)| (if m.is_empty() { String::new() } else { format!("model_name=\"{}\"", label_value(m)) }, v)).collect();
        let per_model = |s: &mut String, name: &str, help: &str, h: &dyn Fn(&PerModel) -> &Histogram| {
            family(s, name, help, "histogram");
            for (labels, m) in &models {
                h(m).render(s, name, labels, om);
            }
        };
        per_model(&mut s, "hopscope_time_to_first_token_seconds", "Wire TTFT: request's first byte read to the write of its first content chunk.", &|m| &m.ttft);
        per_model(&mut s, "hopscope_inter_token_latency_seconds", "Gaps between consecutive content chunks, as written to the socket.", &|m| &m.itl);
        per_model(&mut s, "hopscope_e2e_request_latency_seconds", "Request's first byte read to the write of its last byte.", &|m| &m.e2e);
        per_model(&mut s, "hopscope_request_frontend_time_seconds", "Arrival to the hand-over to the engine (parsing, tokenization): the frontend phase, engine IPC joined.", &|m| &m.frontend);
        per_model(&mut s, "hopscope_request_queue_time_seconds", "Hand-over to the engine to scheduled: the queue phase (less KV transfer), engine IPC joined.", &|m| &m.queue);
        per_model(&mut s, "hopscope_request_prefill_time_seconds", "Scheduled to the end of the step that made the first token: the prefill phase (less KV transfer), engine IPC joined.", &|m| &m.prefill);
        per_model(&mut s, "hopscope_request_decode_time_seconds", "First content chunk written to the response's end: the decode phase.", &|m| &m.decode);
        per_model(&mut s, "hopscope_request_kv_transfer_time_seconds", "KV-cache copies on the request's path before its first token (CUPTI records).", &|m| &m.kv_transfer);
        per_model(
            &mut s,
            "hopscope_request_last_output_time_seconds",
            "End of the engine step that carried the request's last output to the response's end (detokenising, output IPC, final write): part of decode, engine IPC joined.",
            &|m| &m.last_output,
        );
        per_model(
            &mut s,
            "hopscope_request_scheduler_queue_time_seconds",
            "The engine's QUEUED stamp to its first SCHEDULED (vLLM's request_queue_time): the scheduler's part of the queue phase, the rest being the way into the engine; engine IPC joined, engine stats on.",
            &|m| &m.scheduler_queue,
        );
        per_model(
            &mut s,
            "hopscope_request_first_output_held_time_seconds",
            "End of the step that made the first token to the end of the last step before the first content left: the part of the first output the engine went on decoding while the server held the text back (stop strings, incomplete UTF-8, a parser) or its output path lagged; 0 when the text went straight out. Engine IPC joined, streamed requests.",
            &|m| &m.first_output_held,
        );
        let name = "hopscope_hop_time_to_first_token_seconds";
        family(&mut s, name, "TTFT by hop index within a chain (traceparent, chain header, or connection).", "histogram");
        for (hop, h) in &self.ttft_by_hop {
            let label = if *hop == MAX_HOP_LABEL { format!("{MAX_HOP_LABEL}+") } else { hop.to_string() };
            h.render(&mut s, name, &format!("hop=\"{label}\""), om);
        }
        hist(
            &mut s,
            "hopscope_chain_between_hops_seconds",
            "A chain's time outside the server: a hop's arrival less the end of the chain's previous hop (the agent's own work between calls).",
            &self.between_hops,
        );
        family(&mut s, "hopscope_requests_total", "HTTP requests answered, by status.", "counter");
        for (labels, m) in &models {
            let sep = if labels.is_empty() { "" } else { "," };
            for (status, n) in &m.requests {
                let _ = writeln!(s, "hopscope_requests_total{{{labels}{sep}status=\"{status}\"}} {n}");
            }
        }
        let counter = |s: &mut String, name: &str, help: &str, get: &dyn Fn(&PerModel) -> u64| {
            family(s, name, help, "counter");
            for (labels, m) in &models {
                let braces = if labels.is_empty() { String::new() } else { format!("{{{labels}}}") };
                let _ = writeln!(s, "{name}{braces} {}", get(m));
            }
            // A family with a sample before any request.
            if models.is_empty() {
                let _ = writeln!(s, "{name} 0");
            }
        };
        family(&mut s, "hopscope_requests_structured_output_total", "Requests that asked for structured output (a JSON schema, JSON mode, a required tool call, a regex, choices, a grammar), by the constraint's kind: vLLM's scheduler holds each until its grammar is compiled; engine IPC joined.", "counter");
        for (labels, m) in &models {
            let sep = if labels.is_empty() { "" } else { "," };
            for (kind, n) in &m.structured {
                let _ = writeln!(s, "hopscope_requests_structured_output_total{{{labels}{sep}kind=\"{kind}\"}} {n}");
            }
        }
        counter(&mut s, "hopscope_requests_passed_over_total", "Requests the engine's scheduler is known to have skipped: later requests went past them in its waiting queue (vLLM's FCFS scheduler lets one past only while it skips the earlier: its grammar, remote KV, a LoRA slot), not a full batch; engine IPC with QUEUED stamps joined.", &|m| m.passed_over);
        counter(&mut s, "hopscope_requests_closed_early_total", "HTTP requests whose connection closed before their response ended (the client gave up: a timeout, a cancelled agent step).", &|m| m.closed);
        counter(&mut s, "hopscope_prompt_tokens_total", "Prompt tokens: usage objects, else the engine's count once the request settled.", &|m| m.prompt_tokens);
        counter(&mut s, "hopscope_generation_tokens_total", "Generated tokens: usage objects, else the engine's count once the request settled.", &|m| m.generation_tokens);
        if !self.engines.is_empty() {
            let gauge = |s: &mut String, name: &str, help: &str, kind: &str, get: &dyn Fn(&EngineGauges) -> Option<f64>| {
                family(s, name, help, kind);
                for (i, e) in &self.engines {
                    if let Some(v) = get(e) {
                        let _ = writeln!(s, "{name}{{engine=\"{i}\"}} {v}");
                    }
                }
            };
            gauge(&mut s, "hopscope_num_requests_running", "Requests in the engine's running batch (vLLM scheduler_stats).", "gauge", &|e| e.running.map(|v| v as f64));
            gauge(&mut s, "hopscope_num_requests_waiting", "Requests waiting to be scheduled (vLLM scheduler_stats).", "gauge", &|e| e.waiting.map(|v| v as f64));
            gauge(&mut s, "hopscope_kv_cache_usage_perc", "KV-cache usage, 1 = full (vLLM's kv_cache_usage_perc).", "gauge", &|e| e.kv_cache_usage);
            gauge(&mut s, "hopscope_prefix_cache_queries_total", "Prefix-cache tokens looked up (vLLM scheduler_stats).", "counter", &|e| Some(e.prefix_queries as f64));
            gauge(&mut s, "hopscope_prefix_cache_hits_total", "Prefix-cache tokens hit (vLLM scheduler_stats).", "counter", &|e| Some(e.prefix_hits as f64));
        }
        if !self.gpu_info.is_empty() {
            // DCGM's and node exporters' shape: the labels carry the facts, the value is 1.
            family(&mut s, "hopscope_gpu_info", "The GPU's model and driver (NVML); the value is always 1.", "gauge");
            for (d, (name, driver)) in &self.gpu_info {
                let _ = writeln!(s, "hopscope_gpu_info{{device=\"{d}\",name=\"{}\",driver=\"{}\"}} 1", label_value(name), label_value(driver));
            }
        }
        if !self.gpus.is_empty() {
            family(&mut s, "hopscope_gpu_memory_used_bytes", "Device memory in use, all processes (NVML).", "gauge");
            for (d, g) in &self.gpus {
                let _ = writeln!(s, "hopscope_gpu_memory_used_bytes{{device=\"{d}\"}} {}", g.used);
            }
            family(&mut s, "hopscope_gpu_utilization_perc", "SM utilisation over NVML's last period, percent (NVML).", "gauge");
            for (d, g) in &self.gpus {
                if let Some(u) = g.sm {
                    let _ = writeln!(s, "hopscope_gpu_utilization_perc{{device=\"{d}\"}} {u}");
                }
            }
            // A link NVML gives no figure for on any GPU (no GPM for NVLink before Hopper) has no family.
            for (link, (name, help)) in GPU_LINKS.into_iter().enumerate() {
                if !self.gpus.values().any(|g| g.links[link].iter().any(Option::is_some)) {
                    continue;
                }
                family(&mut s, name, help, "gauge");
                for (d, g) in &self.gpus {
                    for (direction, v) in ["tx", "rx"].into_iter().zip(g.links[link]) {
                        if let Some(kib_s) = v {
                            let _ = writeln!(s, "{name}{{device=\"{d}\",direction=\"{direction}\"}} {}", kib_s.saturating_mul(1024));
                        }
                    }
                }
            }
        }
        family(&mut s, "hopscope_drops_total", "hopscope's loss and anomaly counters (see the report).", "counter");
        for (k, v) in &self.drops {
            if crate::sink::report::is_loss(k) {
                let _ = writeln!(s, "hopscope_drops_total{{counter=\"{k}\"}} {v}");
            }
        }
        if let Some(t) = &self.otlp {
            // A sidecar runs --quiet: what the collector did not take shows here.
            let name = "hopscope_otlp_spans_total";
            family(&mut s, name, "Spans of the live OTLP export (--otlp) by outcome: made, sent (accepted by the collector), dropped (queue full), failed (refused or unanswered after retries).", "counter");
            for (outcome, n) in [("made", t.spans), ("sent", t.sent), ("dropped", t.dropped), ("failed", t.failed)] {
                let _ = writeln!(s, "{name}{{outcome=\"{outcome}\"}} {n}");
            }
            let name = "hopscope_otlp_hops_after_chain_span_total";
            family(&mut s, name, "Hops sent after their session's chain span (idle longer than --otlp-chain-idle).", "counter");
            let _ = writeln!(s, "{name} {}", t.hops_after_chain_span);
        }
        if om.is_some() {
            s.push_str("# EOF\n");
        }
        s
    }
}

/// A label value as both expositions escape it (the model name is the client's).
fn label_value(v: &str) -> String {
    let mut o = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => o.push_str("\\\\"),
            '"' => o.push_str("\\\""),
            '\n' => o.push_str("\\n"),
            c => o.push(c),
        }
    }
    o
}

/// Whether a request's `Accept` header asks for OpenMetrics (Prometheus's does).
fn wants_openmetrics(request: &str) -> bool {
    request.lines().take_while(|l| !l.trim().is_empty()).filter_map(|l| l.split_once(':')).any(|(k, v)| k.trim().eq_ignore_ascii_case("accept") && v.contains("application/openmetrics-text"))
}

/// Binds `addr` and answers `GET /metrics` from a thread; returns the bound
/// address. Listening beyond loopback is allowed but said out loud.
pub fn serve(listener: TcpListener, metrics: Arc<Mutex<LiveMetrics>>) -> std::io::Result<SocketAddr> {
    let bound = listener.local_addr()?;
    std::thread::Builder::new().name("hopscope-metrics".into()).spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut c) = conn else { continue };
            let _ = c.set_read_timeout(Some(std::time::Duration::from_secs(2)));
            let mut buf = [0u8; 2048];
            let n = c.read(&mut buf).unwrap_or(0);
            let req = String::from_utf8_lossy(&buf[..n]);
            let format = if wants_openmetrics(&req) { Format::OpenMetrics } else { Format::Text };
            let (status, body) = if req.starts_with("GET /metrics") {
                ("200 OK", metrics.lock().map(|m| m.render_as(format)).unwrap_or_default())
            } else {
                ("404 Not Found", "try /metrics\n".to_owned())
            };
            let ctype = match format {
                Format::OpenMetrics if status.starts_with("200") => "application/openmetrics-text; version=1.0.0; charset=utf-8",
                _ => "text/plain; version=0.0.4",
            };
            let _ = write!(c, "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
        }
    })?;
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chat request read on connection `fd` at `at`.
    fn chat(fd: i32, seq: u32, at: u64, headers: Vec<(String, String)>) -> Record {
        Record::HttpRequest {
            conn: ConnKey { tgid: 1, fd, ino: fd as u64 },
            role: HttpRole::Server,
            seq,
            start_ns: at,
            end_ns: at + 1,
            tid: 1,
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            headers,
            body_len: 10,
            stream: Some(true),
            model: None,
            ready_ns: None,
        }
    }

    #[test]
    fn histogram_buckets_are_cumulative_and_count_everything() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        for v in [0.05, 0.5, 5.0] {
            h.observe(v, None);
        }
        let mut s = String::new();
        h.render(&mut s, "x", "", None);
        assert!(s.contains("x_bucket{le=\"0.1\"} 1\n"), "{s}");
        assert!(s.contains("x_bucket{le=\"1\"} 2\n"), "{s}");
        assert!(s.contains("x_bucket{le=\"+Inf\"} 3\n"), "{s}");
        assert!(s.contains("x_count 3\n"), "{s}");
    }

    /// The phase histograms of a testbed recording with the engine IPC
    /// (`chain3.hop`), fed as `record --metrics` feeds them: one observation
    /// per ended request and phase the report gives, summing to the report's.
    #[test]
    fn phase_histograms_hold_the_reports_phases_of_each_ended_request() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chain3.hop");
        let bytes = std::fs::read(&path).unwrap();
        let mut reader = crate::recording::Reader::new(&bytes[..]).unwrap();
        let cfg = crate::correlate::Config { chain_header: reader.meta().chain_header.clone(), use_ipc: true };
        let live = Arc::new(Mutex::new(LiveMetrics::new(&cfg.chain_header)));
        let mut phases = LivePhases::new(cfg.clone(), Arc::clone(&live));
        let mut c = crate::correlate::Correlator::new(cfg);
        let mut asked = 0;
        while let Some(r) = reader.next_record().unwrap() {
            phases.push(&r);
            c.ingest(&r);
            // Every other ADD (its frontend's copy) asks for a JSON answer.
            if let Record::EngineRequest { conn, ts_ns, dir: crate::event::Dir::Out, request_id, .. } = &r {
                asked += 1;
                if asked % 2 == 1 {
                    let so = Record::EngineStructuredOutput { conn: *conn, ts_ns: *ts_ns, dir: crate::event::Dir::Out, request_id: request_id.clone(), kind: "json".into(), backend: None };
                    phases.push(&so);
                    c.ingest(&so);
                }
            }
        }
        phases.finish();
        let rep = crate::sink::report::build("chain3.hop", reader.meta(), &c.finish(), None);
        let structured = rep.requests.iter().filter(|q| q.structured_output.as_deref() == Some("json")).count();
        assert!(structured >= 2 && structured < rep.requests.len(), "{structured}");
        let ended: Vec<_> = rep.requests.iter().filter(|q| q.done_ns.is_some() && q.phases_ms.queue.is_some()).collect();
        assert!(ended.len() >= 3, "{}", ended.len());
        let text = live.lock().unwrap().render();
        let count = |fam: &str| -> u64 { text.lines().filter(|l| l.starts_with(&format!("{fam}_count"))).map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap()).sum() };
        let sum = |fam: &str| -> f64 { text.lines().filter(|l| l.starts_with(&format!("{fam}_sum"))).map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap()).sum() };
        let handed = count("hopscope_request_queue_time_seconds") as usize;
        assert_eq!(handed, ended.len());
        let want: f64 = ended.iter().map(|q| q.phases_ms.queue.unwrap() / 1e3).sum();
        assert!((sum("hopscope_request_queue_time_seconds") - want).abs() < 1e-9, "{text}");
        for fam in ["hopscope_request_frontend_time_seconds", "hopscope_request_prefill_time_seconds", "hopscope_request_decode_time_seconds", "hopscope_request_last_output_time_seconds"] {
            assert_eq!(count(fam) as usize, handed, "{fam}");
        }
        let want: f64 = ended.iter().map(|q| q.last_output_ms.unwrap() / 1e3).sum();
        assert!((sum("hopscope_request_last_output_time_seconds") - want).abs() < 1e-9, "{text}");
        // The scheduler's queue of those the engine stamped QUEUED (the testbed logs stats).
        let stamped: Vec<f64> = ended.iter().filter_map(|q| q.scheduler_queue_ms).collect();
        assert_eq!(count("hopscope_request_scheduler_queue_time_seconds") as usize, stamped.len());
        assert!(!stamped.is_empty(), "the testbed sends QUEUED and SCHEDULED stamps");
        assert!((sum("hopscope_request_scheduler_queue_time_seconds") - stamped.iter().sum::<f64>() / 1e3).abs() < 1e-9, "{text}");
        // The held part of first_output, for the streamed ones.
        let held: Vec<f64> = ended.iter().filter_map(|q| q.first_output_held_ms).collect();
        assert!(!held.is_empty() && held.len() <= ended.len());
        assert_eq!(count("hopscope_request_first_output_held_time_seconds") as usize, held.len());
        assert!((sum("hopscope_request_first_output_held_time_seconds") - held.iter().sum::<f64>() / 1e3).abs() < 1e-9, "{text}");
        assert_eq!(count("hopscope_request_kv_transfer_time_seconds"), 0, "no GPU records");
        // One count per request that asked for structured output, under its kind.
        let counted: u64 = text.lines().filter(|l| l.starts_with("hopscope_requests_structured_output_total{") && l.contains("kind=\"json\"")).map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap()).sum();
        assert_eq!(counted as usize, structured, "{text}");
        // The requests later ones went past: none in this FCFS recording,
        // and the family is there with its zero.
        let passed: u64 = text.lines().filter(|l| l.starts_with("hopscope_requests_passed_over_total")).map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap()).sum();
        let want = rep.requests.iter().filter(|q| q.scheduler_passed_over_by.is_some_and(|n| n > 0)).count();
        assert_eq!((passed as usize, want), (0, 0), "{text}");
        assert!(text.contains("# TYPE hopscope_requests_passed_over_total counter"), "{text}");
    }

    /// Streams that never asked for usage (`stream_options.include_usage`
    /// off: the OpenAI SDK's default) still count their tokens: the
    /// engine's, once each request settled. `chain3.hop` with every usage
    /// object taken out gives the totals its usage objects give.
    #[test]
    fn tokens_without_usage_objects_are_counted_from_the_engine() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chain3.hop");
        let bytes = std::fs::read(&path).unwrap();
        let totals = |strip: bool| -> (u64, u64) {
            let mut reader = crate::recording::Reader::new(&bytes[..]).unwrap();
            let cfg = crate::correlate::Config { chain_header: reader.meta().chain_header.clone(), use_ipc: true };
            let live = Arc::new(Mutex::new(LiveMetrics::new(&cfg.chain_header)));
            let mut phases = LivePhases::new(cfg, Arc::clone(&live));
            let mut stripped = 0;
            while let Some(mut r) = reader.next_record().unwrap() {
                if let Record::Sse { usage, .. } | Record::ResponseBody { usage, .. } = &mut r {
                    if strip && usage.take().is_some() {
                        stripped += 1;
                    }
                }
                phases.push(&r);
                live.lock().unwrap().observe(&r);
            }
            phases.finish();
            assert!(!strip || stripped >= 3, "{stripped} usage objects");
            let text = live.lock().unwrap().render();
            let total = |fam: &str| -> u64 { text.lines().filter(|l| l.starts_with(fam)).map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap()).sum() };
            (total("hopscope_prompt_tokens_total"), total("hopscope_generation_tokens_total"))
        };
        let with_usage = totals(false);
        assert!(with_usage.0 > 0 && with_usage.1 > 0, "{with_usage:?}");
        assert_eq!(totals(true), with_usage);
    }

    /// A client that leaves before its response ends: counted as closed
    /// early (its status too, once), no longer held open, and its chain's
    /// next hop is timed from the close.
    #[test]
    fn a_request_closed_before_its_response_ends_is_counted_and_let_go() {
        const MS: u64 = 1_000_000;
        let conn = |fd: i32| ConnKey { tgid: 1, fd, ino: fd as u64 };
        let mut m = LiveMetrics::new("x-session-id");
        let s1 = || vec![("x-session-id".to_owned(), "s1".to_owned())];
        m.observe(&chat(5, 0, 0, s1()));
        m.observe(&Record::HttpResponse { conn: conn(5), role: HttpRole::Server, seq: 0, ts_ns: MS, tid: 1, status: 200, headers: vec![] });
        m.observe(&Record::ConnClose { ts_ns: 400 * MS, conn: conn(5) });
        m.observe(&Record::ConnClose { ts_ns: 401 * MS, conn: conn(9) });
        m.observe(&chat(6, 0, 650 * MS, s1()));
        // Its response's head settles the second hop's chain (no link).
        m.observe(&Record::HttpResponse { conn: conn(6), role: HttpRole::Server, seq: 0, ts_ns: 651 * MS, tid: 1, status: 200, headers: vec![] });
        assert_eq!(m.open.len(), 1, "only the second hop is open");
        let s = m.render();
        assert!(s.contains("hopscope_requests_closed_early_total 1\n"), "{s}");
        assert!(s.contains("hopscope_requests_total{status=\"200\"} 1\n"), "{s}");
        assert!(s.contains("hopscope_e2e_request_latency_seconds_count 0\n"), "no end, no E2E: {s}");
        assert!(s.contains("hopscope_chain_between_hops_seconds_sum 0.25\n"), "{s}");
    }

    /// The client's time between a chain's hops: from a hop's end to the
    /// next hop's arrival; a hop that arrives while the previous one is still
    /// running (a fan-out) adds nothing.
    #[test]
    fn the_time_between_a_chains_hops_is_a_histogram() {
        let req = |fd: i32, at: u64| chat(fd, 0, at, vec![("x-session-id".into(), "s1".into())]);
        let end = |fd: i32, at: u64| Record::HttpResponseEnd { conn: ConnKey { tgid: 1, fd, ino: fd as u64 }, seq: 0, ts_ns: at, body_len: 10 };
        const MS: u64 = 1_000_000;
        let mut m = LiveMetrics::new("x-session-id");
        // A hop's time between is observed once its chain is settled (the
        // record after it: a `RequestLink` may move it), hence hop 4's end.
        for r in [req(5, 0), end(5, 100 * MS), req(6, 350 * MS), req(7, 400 * MS), end(6, 500 * MS), end(7, 600 * MS), req(8, 610 * MS), end(8, 700 * MS)] {
            m.observe(&r);
        }
        let s = m.render();
        assert!(s.contains("# TYPE hopscope_chain_between_hops_seconds histogram"), "{s}");
        // 250 ms before hop 2, none before hop 3 (hop 2 still running), 10 ms before hop 4.
        assert!(s.lines().any(|l| l == "hopscope_chain_between_hops_seconds_count 2"), "{s}");
        assert!(s.lines().any(|l| l == "hopscope_chain_between_hops_seconds_bucket{le=\"0.01\"} 1"), "{s}");
        let sum: f64 = s.lines().find_map(|l| l.strip_prefix("hopscope_chain_between_hops_seconds_sum ")).unwrap().parse().unwrap();
        assert!((sum - 0.26).abs() < 1e-9, "{sum}");
    }

    /// An agent letting the server keep its conversation sends each turn
    /// with the previous response's id over whichever connection is free:
    /// the turn joins that response's chain (hop label, time between hops,
    /// exemplar trace), as the report and the spans have it, and the
    /// connection's own chain does not count it.
    #[test]
    fn a_turn_naming_its_previous_response_is_the_next_hop_of_that_responses_chain() {
        const MS: u64 = 1_000_000;
        let conn = |fd: i32| ConnKey { tgid: 1, fd, ino: fd as u64 };
        let turn = |fd: i32, seq: u32, at: u64| chat(fd, seq, at, vec![]);
        let link = |fd: i32, seq: u32, at: u64, prev: &str| Record::RequestLink { conn: conn(fd), seq, ts_ns: at + 1, previous_response_id: prev.into() };
        let chunk = |fd: i32, seq: u32, at: u64, id: &str| Record::Sse { conn: conn(fd), seq, ts_ns: at, kind: SseKind::Content, id: Some(id.into()), content_bytes: 3, finish_reason: None, usage: None };
        let end = |fd: i32, seq: u32, at: u64| Record::HttpResponseEnd { conn: conn(fd), seq, ts_ns: at, body_len: 10 };
        let mut m = LiveMetrics::new("x-session-id");
        for r in [
            // Agent A: turn 1 and 2 on connection 5, turn 3 on connection 6.
            turn(5, 0, 0),
            chunk(5, 0, 30 * MS, "resp_a1"),
            end(5, 0, 100 * MS),
            turn(5, 1, 200 * MS),
            link(5, 1, 200 * MS, "resp_a1"),
            chunk(5, 1, 230 * MS, "resp_a2"),
            end(5, 1, 300 * MS),
            turn(6, 0, 400 * MS),
            link(6, 0, 400 * MS, "resp_a2"),
            chunk(6, 0, 450 * MS, "resp_a3"),
            end(6, 0, 500 * MS),
            // Agent B's first turn, on connection 6 after A's turn 3; then
            // a turn naming a response the recording never saw.
            turn(6, 1, 600 * MS),
            chunk(6, 1, 640 * MS, "resp_b1"),
            end(6, 1, 700 * MS),
            turn(7, 0, 800 * MS),
            link(7, 0, 800 * MS, "resp_unseen"),
            chunk(7, 0, 810 * MS, "resp_c2"),
            end(7, 0, 900 * MS),
        ] {
            m.observe(&r);
        }
        let om = m.render_as(Format::OpenMetrics);
        let count = |hop: &str| {
            let want = format!("hopscope_hop_time_to_first_token_seconds_count{{hop=\"{hop}\"}} ");
            om.lines().find_map(|l| l.strip_prefix(want.as_str())).map(|n| n.parse::<u64>().unwrap())
        };
        // A1, B1 and the unresolved turn are first hops; A2 second; A3 third.
        assert_eq!((count("1"), count("2"), count("3")), (Some(3), Some(1), Some(1)), "{om}");
        // 100 ms before A2 and before A3; none before B1 (its connection's
        // chain gave A3's hop back to A).
        assert!(om.lines().any(|l| l == "hopscope_chain_between_hops_seconds_count 2"), "{om}");
        let sum: f64 = om.lines().find_map(|l| l.strip_prefix("hopscope_chain_between_hops_seconds_sum ")).unwrap().parse().unwrap();
        assert!((sum - 0.2).abs() < 1e-9, "{sum}");
        // A3's TTFT (50 ms) names agent A's trace: its first connection's chain.
        let (a_chain, a_source) = crate::correlate::chain_key(conn(5), &[], "x-session-id");
        let a_trace: String = crate::sink::otlp::request_trace_id(&a_chain, a_source).iter().map(|b| format!("{b:02x}")).collect();
        let hop3 = om.lines().find(|l| l.starts_with("hopscope_hop_time_to_first_token_seconds_bucket{hop=\"3\",le=\"0.06\"} 1 # ")).unwrap_or_else(|| panic!("no hop 3 exemplar in\n{om}"));
        assert!(hop3.contains(&a_trace), "{hop3} should name {a_trace}");
    }

    /// OpenMetrics (what Prometheus asks for): each histogram bucket names
    /// the trace of the latest request observed in it, the trace its spans
    /// are sent in; counters' families drop `_total`; `# EOF` ends it. The
    /// text format stays as it was, without exemplars.
    #[test]
    fn openmetrics_buckets_carry_the_trace_of_their_latest_request() {
        const MS: u64 = 1_000_000;
        let conn = |fd: i32| ConnKey { tgid: 1, fd, ino: fd as u64 };
        let req = |fd: i32, at: u64, headers: Vec<(String, String)>| chat(fd, 0, at, headers);
        let chunk = |fd: i32, at: u64| Record::Sse { conn: conn(fd), seq: 0, ts_ns: at, kind: SseKind::Content, id: None, content_bytes: 3, finish_reason: None, usage: None };
        let end = |fd: i32, at: u64| Record::HttpResponseEnd { conn: conn(fd), seq: 0, ts_ns: at, body_len: 10 };
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut m = LiveMetrics::new("x-session-id");
        m.set_clock(1_000 * MS, 1_700_000_000_000 * MS);
        for r in [
            req(5, 1_000 * MS, vec![("traceparent".into(), tp.into())]),
            chunk(5, 1_030 * MS),
            chunk(5, 1_050 * MS),
            end(5, 1_060 * MS),
            req(6, 2_000 * MS, vec![("x-session-id".into(), "s1".into())]),
            chunk(6, 2_300 * MS),
            end(6, 2_400 * MS),
        ] {
            m.observe(&r);
        }
        let om = m.render_as(Format::OpenMetrics);
        let hex = |id: [u8; 16]| id.iter().map(|b| format!("{b:02x}")).collect::<String>();
        let caller = "4bf92f3577b34da6a3ce929d0e0e4736";
        let session = hex(crate::sink::otlp::request_trace_id("s1", crate::correlate::ChainSource::Header));
        // TTFT 30 ms falls in le=0.04, with the caller's trace at 1700000000.030 s.
        let want = format!("hopscope_time_to_first_token_seconds_bucket{{le=\"0.04\"}} 1 # {{trace_id=\"{caller}\"}} 0.03 1700000000.030000000");
        assert!(om.lines().any(|l| l == want), "missing {want:?} in\n{om}");
        // TTFT 300 ms (le=0.5) and E2E 400 ms (le=0.5): the session's trace.
        let ttft = format!("hopscope_time_to_first_token_seconds_bucket{{le=\"0.5\"}} 2 # {{trace_id=\"{session}\"}} 0.3 1700000001.300000000");
        assert!(om.lines().any(|l| l == ttft), "missing {ttft:?} in\n{om}");
        assert!(om.lines().any(|l| l.starts_with("hopscope_e2e_request_latency_seconds_bucket{le=\"0.5\"} 2 # {trace_id=\"") && l.contains(&session)), "{om}");
        assert!(om.lines().any(|l| l.starts_with("hopscope_inter_token_latency_seconds_bucket{le=\"0.025\"} 1 # ") && l.contains(caller)), "{om}");
        assert!(om.lines().any(|l| l.starts_with("hopscope_hop_time_to_first_token_seconds_bucket{hop=\"1\",le=\"0.5\"} 2 # ") && l.contains(&session)), "{om}");
        // Buckets nothing fell in carry none.
        assert!(om.lines().any(|l| l == "hopscope_time_to_first_token_seconds_bucket{le=\"0.001\"} 0"), "{om}");
        assert!(om.contains("# TYPE hopscope_requests counter\n") && !om.contains("# TYPE hopscope_requests_total"), "{om}");
        assert!(om.contains("# TYPE hopscope_prompt_tokens counter\n"), "{om}");
        assert!(om.ends_with("# EOF\n"), "{om}");
        let text = m.render();
        assert!(!text.contains(" # {") && !text.contains("# EOF"), "no exemplars in the text format: {text}");
        assert!(text.contains("# TYPE hopscope_requests_total counter\n"), "{text}");
        assert!(text.lines().any(|l| l == "hopscope_time_to_first_token_seconds_bucket{le=\"1\"} 2"), "{text}");
    }

    /// As vLLM's, the latency histograms, request and token counters carry
    /// `model_name`: the request body's model, escaped; none when it named
    /// none; past 16 models the rest share `other`.
    #[test]
    fn latency_series_are_labelled_with_the_requests_model() {
        const MS: u64 = 1_000_000;
        let conn = |fd: i32| ConnKey { tgid: 1, fd, ino: fd as u64 };
        let mut m = LiveMetrics::new("x-session-id");
        let one = |m: &mut LiveMetrics, fd: i32, model: Option<&str>, ttft_ms: u64| {
            let Record::HttpRequest { conn: c, role, seq, start_ns, end_ns, tid, method, path, headers, body_len, stream, ready_ns, .. } = chat(fd, 0, 0, vec![]) else { unreachable!() };
            m.observe(&Record::HttpRequest { conn: c, role, seq, start_ns, end_ns, tid, method, path, headers, body_len, stream, model: model.map(str::to_owned), ready_ns });
            m.observe(&Record::HttpResponse { conn: conn(fd), role: HttpRole::Server, seq: 0, ts_ns: 1, tid: 1, status: 200, headers: vec![] });
            let usage = Some(crate::model::Usage { prompt_tokens: Some(10), completion_tokens: Some(2), cached_tokens: None });
            m.observe(&Record::Sse { conn: conn(fd), seq: 0, ts_ns: ttft_ms * MS, kind: SseKind::Content, id: None, content_bytes: 3, finish_reason: None, usage });
            m.observe(&Record::HttpResponseEnd { conn: conn(fd), seq: 0, ts_ns: (ttft_ms + 1) * MS, body_len: 10 });
        };
        one(&mut m, 5, Some("llama-8b"), 30);
        one(&mut m, 6, Some("llama-8b"), 30);
        one(&mut m, 7, Some("lora/sql \"v2\"\n"), 300);
        one(&mut m, 8, None, 3);
        let s = m.render();
        for line in [
            "hopscope_time_to_first_token_seconds_count{model_name=\"llama-8b\"} 2",
            "hopscope_time_to_first_token_seconds_bucket{model_name=\"llama-8b\",le=\"0.04\"} 2",
            "hopscope_time_to_first_token_seconds_bucket{model_name=\"lora/sql \\\"v2\\\"\\n\",le=\"0.5\"} 1",
            "hopscope_time_to_first_token_seconds_count 1",
            "hopscope_e2e_request_latency_seconds_count{model_name=\"llama-8b\"} 2",
            "hopscope_requests_total{model_name=\"llama-8b\",status=\"200\"} 2",
            "hopscope_requests_total{status=\"200\"} 1",
            "hopscope_prompt_tokens_total{model_name=\"llama-8b\"} 20",
            "hopscope_generation_tokens_total 2",
        ] {
            assert!(s.lines().any(|l| l == line), "missing {line:?} in\n{s}");
        }
        assert_eq!(s.matches("# TYPE hopscope_time_to_first_token_seconds histogram").count(), 1, "one family: {s}");
        // Bounded: 16 named models at most, the rest in `other`.
        for i in 0..40 {
            one(&mut m, 100 + i, Some(&format!("m{i}")), 10);
        }
        let s = m.render();
        let names: std::collections::BTreeSet<&str> = s.lines().filter(|l| l.starts_with("hopscope_e2e_request_latency_seconds_count")).collect();
        assert_eq!(names.len(), 16 + 2, "16 named, the unnamed, other: {names:?}");
        assert!(s.lines().any(|l| l == "hopscope_e2e_request_latency_seconds_count{model_name=\"other\"} 26"), "{s}");
    }

    /// A request whose body's model was lost to the capture is labelled by
    /// the model its response names, every series alike (its status waits
    /// for the name); a request naming one keeps its own.
    #[test]
    fn a_request_without_a_model_takes_the_one_its_response_names() {
        const MS: u64 = 1_000_000;
        let conn = |fd: i32| ConnKey { tgid: 1, fd, ino: fd as u64 };
        let mut m = LiveMetrics::new("x-session-id");
        for (fd, asked, answered) in [(5, None, Some("served")), (6, Some("alias"), Some("served")), (7, None, None)] {
            let Record::HttpRequest { conn: c, role, seq, start_ns, end_ns, tid, method, path, headers, body_len, stream, ready_ns, .. } = chat(fd, 0, 0, vec![]) else { unreachable!() };
            m.observe(&Record::HttpRequest { conn: c, role, seq, start_ns, end_ns, tid, method, path, headers, body_len, stream, model: asked.map(str::to_owned), ready_ns });
            m.observe(&Record::HttpResponse { conn: conn(fd), role: HttpRole::Server, seq: 0, ts_ns: 1, tid: 1, status: 200, headers: vec![] });
            if let Some(name) = answered {
                m.observe(&Record::ResponseModel { conn: conn(fd), seq: 0, ts_ns: 2 * MS, model: name.into() });
            }
            let usage = Some(crate::model::Usage { prompt_tokens: Some(10), completion_tokens: Some(2), cached_tokens: None });
            m.observe(&Record::Sse { conn: conn(fd), seq: 0, ts_ns: 2 * MS, kind: SseKind::Content, id: None, content_bytes: 3, finish_reason: None, usage });
            m.observe(&Record::HttpResponseEnd { conn: conn(fd), seq: 0, ts_ns: 3 * MS, body_len: 10 });
        }
        let s = m.render();
        for line in [
            "hopscope_time_to_first_token_seconds_count{model_name=\"served\"} 1",
            "hopscope_e2e_request_latency_seconds_count{model_name=\"served\"} 1",
            "hopscope_requests_total{model_name=\"served\",status=\"200\"} 1",
            "hopscope_generation_tokens_total{model_name=\"served\"} 2",
            "hopscope_time_to_first_token_seconds_count{model_name=\"alias\"} 1",
            "hopscope_requests_total{model_name=\"alias\",status=\"200\"} 1",
            "hopscope_time_to_first_token_seconds_count 1",
            "hopscope_requests_total{status=\"200\"} 1",
        ] {
            assert!(s.lines().any(|l| l == line), "missing {line}:\n{s}");
        }
        assert_eq!(s.lines().filter(|l| l.starts_with("hopscope_requests_total")).count(), 3, "each status counted once: {s}");
    }

    #[test]
    fn openmetrics_is_served_when_the_scraper_accepts_it() {
        let prometheus = "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1\r\n\r\n";
        assert!(wants_openmetrics(prometheus));
        assert!(!wants_openmetrics("GET /metrics HTTP/1.1\r\nAccept: text/plain\r\n\r\n"));
        assert!(!wants_openmetrics("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"));
        // Only headers count, not a body that mentions it.
        assert!(!wants_openmetrics("GET /metrics HTTP/1.1\r\n\r\naccept: application/openmetrics-text"));
    }

    /// examples/deploy/grafana/hopscope.json asks only for series this
    /// exporter writes, by labels it gives them: a renamed series must not
    /// leave a panel silently empty.
    #[test]
    fn the_grafana_dashboard_queries_only_series_that_exist() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/deploy/grafana/hopscope.json");
        let dash: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        // Every family populated: the requests of a recording with structured
        // output and scheduler passes (the `structured` fixture) as
        // `record --metrics` hands them out, then one of each other record.
        let fixture = std::fs::read(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/structured.hop")).unwrap();
        let mut reader = crate::recording::Reader::new(&fixture[..]).unwrap();
        let cfg = crate::correlate::Config { chain_header: reader.meta().chain_header.clone(), use_ipc: true };
        let live = Arc::new(Mutex::new(LiveMetrics::new(&cfg.chain_header)));
        let mut phases = LivePhases::new(cfg, Arc::clone(&live));
        while let Some(r) = reader.next_record().unwrap() {
            live.lock().unwrap().observe(&r);
            phases.push(&r);
        }
        phases.finish();
        let mut m = live.lock().unwrap();
        let conn = ConnKey { tgid: 1, fd: 5, ino: 5 };
        for (fd_seq, at) in [(0u32, 0u64), (1, 2_000_000_000)] {
            let mut req = chat(5, fd_seq, at, vec![("x-session-id".to_owned(), "s".to_owned())]);
            if let Record::HttpRequest { model, .. } = &mut req {
                *model = Some("m".into());
            }
            m.observe(&req);
            m.observe(&Record::HttpResponse { conn, role: HttpRole::Server, seq: fd_seq, ts_ns: at + 2, tid: 1, status: 200, headers: vec![] });
            for k in 0..2 {
                m.observe(&Record::Sse { conn, seq: fd_seq, ts_ns: at + 10 + k, kind: SseKind::Content, id: None, content_bytes: 1, finish_reason: None, usage: None });
            }
            m.observe(&Record::HttpResponseEnd { conn, seq: fd_seq, ts_ns: at + 20, body_len: 1 });
        }
        m.observe(&Record::EngineStats { conn, ts_ns: 1, engine_index: Some(0), running: Some(1), waiting: Some(0), kv_cache_usage: Some(0.1), step_counter: None, prefix_cache_queries: Some(10), prefix_cache_hits: Some(5) });
        m.observe(&Record::GpuSample { ts_ns: 1, device: 0, mem_used_bytes: 1, mem_total_bytes: 2, process_mem: vec![], sm_util_pct: Some(1), mem_util_pct: None, pcie_tx_kib_s: Some(1), pcie_rx_kib_s: Some(1), nvlink_tx_kib_s: Some(1), nvlink_rx_kib_s: Some(1) });
        let loss = ["kernel_ringbuf_full", "gpu_cupti_dropped", "http_unparsed_bytes"].into_iter().find(|k| crate::sink::report::is_loss(k)).expect("a loss counter name");
        m.observe(&Record::Drops { ts_ns: 1, counters: vec![(loss.to_owned(), 1)] });
        m.set_otlp(crate::sink::otlp::live::Tally::default());
        let text = m.render();
        let series: std::collections::BTreeSet<&str> = text.lines().filter(|l| !l.starts_with('#')).filter_map(|l| l.split(['{', ' ']).next()).collect();
        let mut exprs = Vec::new();
        for p in dash["panels"].as_array().unwrap() {
            for t in p["targets"].as_array().into_iter().flatten() {
                exprs.push(t["expr"].as_str().unwrap().to_owned());
            }
        }
        let ids: std::collections::BTreeSet<u64> = dash["panels"].as_array().unwrap().iter().map(|p| p["id"].as_u64().unwrap()).collect();
        assert_eq!(ids.len(), dash["panels"].as_array().unwrap().len(), "panel ids unique");
        assert!(exprs.len() >= 10, "{exprs:?}");
        for e in &exprs {
            assert_eq!(e.matches('(').count(), e.matches(')').count(), "unbalanced: {e}");
            for name in e.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).filter(|w| w.starts_with("hopscope_")) {
                assert!(series.contains(name), "{e}: no series {name} in\n{text}");
            }
            // Grouping labels other than le are labels the series carry.
            for by in e.split("by (").skip(1) {
                for label in by.split(')').next().unwrap().split(',').map(str::trim).filter(|l| *l != "le") {
                    assert!(text.contains(&format!("{label}=\"")), "{e}: no label {label} in the series");
                }
            }
        }
    }

    /// With `--otlp`, what the collector did not take is a series (a
    /// sidecar runs --quiet); without it, no such family.
    #[test]
    fn the_live_span_exports_outcomes_are_counters() {
        let mut m = LiveMetrics::new("x-session-id");
        assert!(!m.render().contains("hopscope_otlp"), "no --otlp, no series");
        m.set_otlp(crate::sink::otlp::live::Tally { spans: 50, requests: 9, sent: 30, posts: 3, dropped: 12, failed: 8, unsent: 0, hops_after_chain_span: 2 });
        let s = m.render();
        assert!(s.contains("# TYPE hopscope_otlp_spans_total counter"), "{s}");
        for line in ["hopscope_otlp_spans_total{outcome=\"made\"} 50", "hopscope_otlp_spans_total{outcome=\"sent\"} 30", "hopscope_otlp_spans_total{outcome=\"dropped\"} 12", "hopscope_otlp_spans_total{outcome=\"failed\"} 8", "hopscope_otlp_hops_after_chain_span_total 2"] {
            assert!(s.lines().any(|l| l == line), "{line}: {s}");
        }
    }

    #[test]
    fn scheduler_stats_and_nvml_samples_become_vllm_named_gauges() {
        let conn = ConnKey { tgid: 1, fd: 2, ino: 3 };
        let stats = |ts_ns, running, kv, q, h| Record::EngineStats {
            conn,
            ts_ns,
            engine_index: Some(0),
            running: Some(running),
            waiting: Some(4),
            kv_cache_usage: Some(kv),
            step_counter: Some(ts_ns),
            prefix_cache_queries: Some(q),
            prefix_cache_hits: Some(h),
        };
        let mut m = LiveMetrics::new("x-session-id");
        m.observe(&stats(1, 3, 0.25, 100, 40));
        m.observe(&stats(2, 2, 0.5, 50, 10));
        m.observe(&Record::GpuSample {
            ts_ns: 3,
            device: 1,
            mem_used_bytes: 123_456,
            mem_total_bytes: 1 << 30,
            process_mem: vec![],
            sm_util_pct: Some(37),
            mem_util_pct: None,
            pcie_tx_kib_s: Some(1234),
            pcie_rx_kib_s: None,
            nvlink_tx_kib_s: None,
            nvlink_rx_kib_s: Some(307_200),
        });
        m.observe(&Record::NvmlDevice { ts_ns: 1, device: 1, name: "NVIDIA H100 80GB HBM3".into(), driver: "580.159.04".into(), mem_total_bytes: 80 << 30 });
        let s = m.render();
        for line in [
            "# TYPE hopscope_gpu_info gauge",
            "hopscope_gpu_info{device=\"1\",name=\"NVIDIA H100 80GB HBM3\",driver=\"580.159.04\"} 1",
            "# TYPE hopscope_kv_cache_usage_perc gauge",
            "hopscope_kv_cache_usage_perc{engine=\"0\"} 0.5",
            "hopscope_num_requests_running{engine=\"0\"} 2",
            "hopscope_num_requests_waiting{engine=\"0\"} 4",
            "hopscope_prefix_cache_queries_total{engine=\"0\"} 150",
            "hopscope_prefix_cache_hits_total{engine=\"0\"} 50",
            "hopscope_gpu_memory_used_bytes{device=\"1\"} 123456",
            "hopscope_gpu_utilization_perc{device=\"1\"} 37",
            "# TYPE hopscope_gpu_pcie_bytes_per_second gauge",
            "hopscope_gpu_pcie_bytes_per_second{device=\"1\",direction=\"tx\"} 1263616",
            "# TYPE hopscope_gpu_nvlink_bytes_per_second gauge",
            "hopscope_gpu_nvlink_bytes_per_second{device=\"1\",direction=\"rx\"} 314572800",
        ] {
            assert!(s.lines().any(|l| l == line), "missing {line:?} in\n{s}");
        }
        assert!(!s.contains("direction=\"rx\"} 0") && !s.contains("nvlink_bytes_per_second{device=\"1\",direction=\"tx\"}"), "a figure NVML did not give is no series, not 0: {s}");
        let empty = LiveMetrics::new("x").render();
        assert!(!empty.contains("kv_cache") && !empty.contains("gpu_memory") && !empty.contains("gpu_info"), "no series before any value: {empty}");
    }
}
