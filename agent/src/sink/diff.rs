//! `hopscope diff BEFORE.hop AFTER.hop`: what changed between two recordings,
//! per matched request/hop and in aggregate, explained as phase deltas.
//!
//! Input is two schema-1 reports ([`report::build`](super::report::build)),
//! so every figure is the one `hopscope report` shows. The partition
//! guarantees Σ phases = E2E and frontend+queue+prefill(+kv)+first_output =
//! TTFT, so ΔE2E and ΔTTFT are *sums* of phase deltas; whatever a side could
//! not attribute (a null phase) is shown as `unexplained`, never guessed.
//! The JSON shape is documented in docs/diff.md (schema 1: add, never rename).

use crate::correlate::{ms, percentile};
use crate::sink::json;
use crate::sink::{printable, trunc};
use crate::sink::report::{self, between_hops_ms, KernelOut, Report, RequestOut, RequestRef};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::io::{self, Read, Write};

/// What `write_json` hands its output at a time.
const CHUNK: usize = 1 << 16;

pub const SCHEMA: u32 = 1;

/// The partition's phases in time order. The first five end at the first
/// content chunk: they add up to TTFT.
pub const PHASES: [&str; 6] = ["frontend", "queue", "prefill", "kv_transfer", "first_output", "decode"];
const TTFT_PHASES: usize = 5;

/// A metric that moved less than this (ms) is reported as unchanged.
pub const NOISE_MS: f64 = 0.05;
/// A phase moving in the metric's direction by at least this share of the
/// metric's change gets a cause of its own (the dominant phase always does).
const CAUSE_SHARE: f64 = 0.2;

// ---------------------------------------------------------------- shapes

/// A value on both sides and its change (after - before); `delta` is null
/// unless both sides are known.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Delta {
    pub before: Option<f64>,
    pub after: Option<f64>,
    pub delta: Option<f64>,
}

impl Delta {
    pub fn of(before: Option<f64>, after: Option<f64>) -> Delta {
        Delta { before, after, delta: before.zip(after).map(|(b, a)| a - b) }
    }
}

/// A count on both sides and its change.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CountDelta {
    pub before: Option<u64>,
    pub after: Option<u64>,
    pub delta: Option<i64>,
}

impl CountDelta {
    pub fn of(before: Option<u64>, after: Option<u64>) -> CountDelta {
        CountDelta { before, after, delta: before.zip(after).map(|(b, a)| a as i64 - b as i64) }
    }
    fn as_delta(self) -> Delta {
        Delta::of(self.before.map(|v| v as f64), self.after.map(|v| v as f64))
    }
}

/// Mean, median and p90 of a metric on both sides (over the pairs where both
/// are known); each `delta` is after - before of that statistic.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Stats {
    pub mean: Delta,
    pub p50: Delta,
    pub p90: Delta,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PhaseDeltas {
    pub frontend: Delta,
    pub queue: Delta,
    pub prefill: Delta,
    pub kv_transfer: Delta,
    pub first_output: Delta,
    pub decode: Delta,
}

impl PhaseDeltas {
    /// In [`PHASES`] order.
    pub fn as_array(&self) -> [Delta; 6] {
        [self.frontend, self.queue, self.prefill, self.kv_transfer, self.first_output, self.decode]
    }
    fn from_array(a: [Delta; 6]) -> PhaseDeltas {
        PhaseDeltas { frontend: a[0], queue: a[1], prefill: a[2], kv_transfer: a[3], first_output: a[4], decode: a[5] }
    }
}

/// Token counts: `computed` = prompt - cached (what prefill had to compute).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Tokens<T> {
    pub prompt: T,
    pub cached: T,
    pub computed: T,
    pub completion: T,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct GpuDeltas {
    pub prefill: Delta,
    pub decode: Delta,
    pub kv_transfer: Delta,
}

/// Δdecode split exactly in three: the gaps got longer (`itl_rate_ms` =
/// gaps_before × Δmean ITL), there were more gaps (`token_count_ms` = Δgaps ×
/// mean ITL after), and the stream's end after the last content chunk
/// (`tail_ms`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct DecodeSplit {
    pub itl_rate_ms: f64,
    pub token_count_ms: f64,
    pub tail_ms: f64,
}

/// One phase's part of a metric's change.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Contribution {
    pub phase: &'static str,
    pub delta_ms: f64,
    /// delta_ms / the metric's delta (null when the metric did not move).
    pub share: Option<f64>,
}

/// A named reason for a phase's change, with the evidence.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Cause {
    /// Stable name, e.g. `fewer_cached_tokens` (docs/diff.md lists them).
    pub cause: &'static str,
    pub phase: &'static str,
    pub delta_ms: f64,
    pub detail: String,
}

/// A metric's change as the sum of phase deltas.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Explanation {
    /// `ttft` or `e2e`.
    pub metric: &'static str,
    pub delta_ms: Option<f64>,
    /// delta_ms / before.
    pub relative: Option<f64>,
    /// Phases with a known delta, biggest |delta| first.
    pub contributions: Vec<Contribution>,
    pub sum_of_phases_ms: Option<f64>,
    /// delta_ms - sum_of_phases_ms: what the phases could not account for
    /// (a phase unknown on one side); 0 up to rounding when all are known.
    pub unexplained_ms: Option<f64>,
    /// The phase that moved most in the metric's direction; null when the
    /// metric is unknown or the unexplained part moved more.
    pub dominant_phase: Option<&'static str>,
    pub unchanged: bool,
    /// Dominant phase's cause first.
    pub causes: Vec<Cause>,
    pub summary: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Explain {
    pub ttft: Explanation,
    pub e2e: Explanation,
}

/// One matched request: BEFORE's and AFTER's figures side by side.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Pair {
    /// `chain 1 hop 2` or `POST /v1/chat/completions #3`.
    pub key: String,
    /// `chain` (explicit chains paired, hop index) or `path` (path and prompt size order).
    pub by: &'static str,
    /// 1-based position of BEFORE's chain in its arrival order (chain
    /// matches only; AFTER's is the one that opened with its prompt, else
    /// the one at the same place among those left).
    pub chain_index: Option<usize>,
    pub hop: Option<u32>,
    pub method: String,
    pub path: String,
    pub before_id: String,
    pub after_id: String,
    /// The request bodies' `model` (added 2026-12-04).
    pub before_model: Option<String>,
    pub after_model: Option<String>,
    /// An inference request on both sides (content or token counts): only
    /// these enter the aggregates.
    pub generation: bool,
    pub ttft_ms: Delta,
    pub e2e_ms: Delta,
    pub itl_mean_ms: Delta,
    pub itl_p90_ms: Delta,
    pub phases_ms: PhaseDeltas,
    pub decode_split_ms: Option<DecodeSplit>,
    pub tokens: Tokens<CountDelta>,
    pub steps: CountDelta,
    pub preemptions: CountDelta,
    pub interference_ms: Delta,
    /// The scheduler's part of the queue (`scheduler_queue_ms`; added
    /// 2026-12-05): the queue's delta less it is the way into the engine's.
    pub scheduler_queue_ms: Delta,
    pub gpu_ms: GpuDeltas,
    /// The structured-output constraint's kind on each side (the report's
    /// `structured_output`; added 2026-12-05).
    pub structured_output: KindChange,
    /// The part of the scheduler's queue in which later requests went past
    /// it (the report's `scheduler_passed_over_ms`; added 2026-12-05).
    pub scheduler_passed_over_ms: Delta,
    /// When its grammar was known ready after its QUEUED stamp (the
    /// report's `scheduler_grammar_ready_ms`; added 2026-12-06, session 46).
    pub scheduler_grammar_ready_ms: Delta,
    /// The part of `first_output` the engine went on decoding before the
    /// first content left (the report's `first_output_held_ms`; added
    /// 2026-12-06, session 53).
    pub first_output_held_ms: Delta,
    pub explain: Explain,
}

/// A kind before and after (null: none).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct KindChange {
    pub before: Option<&'static str>,
    pub after: Option<&'static str>,
}

/// Pairs asking for structured output: on each side, and only after
/// (`added`) or only before (`removed`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StructuredShift {
    pub before: usize,
    pub after: usize,
    pub added: usize,
    pub removed: usize,
}

/// Aggregate over a set of generation pairs: per-metric statistics, and the
/// mean of every per-pair delta (so the phase means add up to the mean ΔE2E).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Aggregate {
    /// The hop index, for per-hop aggregates; null overall.
    pub hop: Option<u32>,
    pub requests: usize,
    pub ttft_ms: Stats,
    pub e2e_ms: Stats,
    pub itl_mean_ms: Stats,
    pub itl_p90_ms: Stats,
    pub phases_ms: PhaseDeltas,
    pub decode_split_ms: Option<DecodeSplit>,
    pub tokens: Tokens<Delta>,
    pub steps: Delta,
    pub preemptions: Delta,
    pub interference_ms: Delta,
    /// Mean of the pairs' (added 2026-12-05).
    pub scheduler_queue_ms: Delta,
    /// Every pair with a queue delta has a scheduler's-queue delta: the two
    /// means are over the same pairs (the text shows the split then).
    #[serde(skip)]
    pub scheduler_queue_covers: bool,
    /// How many of these pairs asked for structured output (added 2026-12-05).
    pub structured_output: StructuredShift,
    /// Mean of the pairs' (added 2026-12-05, session 44).
    pub scheduler_passed_over_ms: Delta,
    /// Mean of the pairs' known on both sides (added 2026-12-06, session 46).
    pub scheduler_grammar_ready_ms: Delta,
    /// Mean of the pairs' known on both sides (added 2026-12-06, session 53).
    pub first_output_held_ms: Delta,
    pub gpu_ms: GpuDeltas,
    /// The kernels behind these requests' GPU time (added 2026-12-04): null
    /// unless some pair has kernel lists on both sides.
    pub kernels: Option<RequestKernels>,
    /// The models these pairs' requests named on each side (added
    /// 2026-12-04): null when every pair named the same one on both.
    pub models: Option<ModelsUsed>,
    pub explain: Explain,
}

/// Which models (the request body's `model`) a set of pairs named, when it
/// changed: a model swap is the first thing to know of a regression.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelsUsed {
    /// Pairs whose two requests named different models (or one none).
    pub changed: usize,
    /// Most requests first (then name); `model` null for those that named none.
    pub before: Vec<ModelCount>,
    pub after: Vec<ModelCount>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelCount {
    pub model: Option<String>,
    pub requests: usize,
}

/// GPU time per normalised kernel name, mean per request over a set of
/// pairs, from each request's kernel list (the report's `requests[].kernels`:
/// its top [`KERNELS_PER_REQUEST`](crate::correlate::gpu::KERNELS_PER_REQUEST)
/// kernels, so a kernel below a request's top counts 0 for it).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestKernels {
    /// Pairs whose two requests have kernel lists (the means' divisor).
    pub requests: usize,
    /// Mean per request of the listed kernels' GPU time.
    pub before_gpu_ms: f64,
    pub after_gpu_ms: f64,
    pub delta_gpu_ms: f64,
    /// Biggest |delta_gpu_ms| first (then name), at most [`AGG_KERNELS`].
    pub rows: Vec<RequestKernelRow>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RequestKernelRow {
    /// [`normalize_kernel_name`].
    pub name: String,
    pub before_gpu_ms: f64,
    pub after_gpu_ms: f64,
    pub delta_gpu_ms: f64,
    /// `changed`, `new` (in no BEFORE request's list), `gone` (in no AFTER
    /// request's list) or `same`.
    pub status: &'static str,
}

/// How many kernels an aggregate's `kernels.rows` lists.
pub const AGG_KERNELS: usize = 8;

/// How many of a hop's kernel changes the text names.
const TEXT_HOP_KERNELS: usize = 3;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Unmatched {
    pub id: String,
    pub method: String,
    pub path: String,
    pub chain: Option<String>,
    pub hop: Option<u32>,
    pub prompt_tokens: Option<u64>,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Matching {
    /// `chain` when both recordings have explicit chains (traceparent or
    /// header keys), else `path`.
    pub mode: &'static str,
    pub matched: usize,
    pub by_chain: usize,
    pub by_path: usize,
    /// Chains of BEFORE paired with a chain of AFTER that opened with the
    /// same prompt ([`pair_chains`]); the others by arrival order.
    pub chains_by_opening: usize,
    pub unmatched_before: Vec<Unmatched>,
    pub unmatched_after: Vec<Unmatched>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SideInfo {
    pub path: String,
    pub requests: usize,
    /// Chains with an explicit key (traceparent or header).
    pub chains: usize,
    pub gpu: bool,
    pub read_error: Option<String>,
    pub hopscope_version: String,
    /// The recording's loss counters above 0 (`report::is_loss`): what its
    /// figures may lack. `hopscope report` says what each means.
    pub losses: BTreeMap<String, u64>,
    /// How its injected processes traced CUDA graphs (added 2026-12-06):
    /// "node", "launch" or "mixed"; null with no injected process. Kernels
    /// inside graphs compare only between recordings that both say "node".
    pub gpu_graphs: Option<&'static str>,
}

/// GPU time per normalised kernel name.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KernelDiff {
    pub before_gpu_ms: f64,
    pub after_gpu_ms: f64,
    pub delta_gpu_ms: f64,
    pub before_count: u64,
    pub after_count: u64,
    /// Biggest |delta_gpu_ms| first.
    pub rows: Vec<KernelRow>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KernelRow {
    /// [`normalize_kernel_name`] of every variant.
    pub name: String,
    pub before_count: u64,
    pub after_count: u64,
    pub before_gpu_ms: f64,
    pub after_gpu_ms: f64,
    pub delta_gpu_ms: f64,
    /// Δ split exactly: calls got slower (before_count × Δmean per call) and
    /// there were more calls (Δcount × mean per call after).
    pub per_call_ms: f64,
    pub calls_ms: f64,
    /// delta_gpu_ms / the total delta (null when the total did not move).
    pub share: Option<f64>,
    /// `changed`, `new` (after only), `gone` (before only) or `same`.
    pub status: &'static str,
    /// The raw names merged into this row, sorted.
    pub variants: Vec<String>,
}

/// `hopscope diff --json` (docs/diff.md).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Diff {
    pub schema: u32,
    pub before: SideInfo,
    pub after: SideInfo,
    pub matching: Matching,
    /// One line: the biggest change, its dominant phase and cause.
    pub headline: String,
    pub overall: Aggregate,
    /// Per hop index across chain-matched pairs.
    pub hops: Vec<Aggregate>,
    pub pairs: Vec<Pair>,
    /// Null when neither recording has GPU kernels.
    pub kernels: Option<KernelDiff>,
    /// Whole chains (added 2026-12-01): null unless both sides have explicit
    /// chains.
    pub chains: Option<ChainsDelta>,
}

/// The i-th explicit chain of BEFORE against the i-th of AFTER, over the
/// pairs whose figures are known on both sides: a chain's E2E change split
/// exactly into its hops' (server) time and the time between hops (the
/// client's own work).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChainsDelta {
    /// Chain pairs averaged (both sides with every figure).
    pub chains: usize,
    pub e2e_ms: Delta,
    pub hops_e2e_ms: Delta,
    pub between_hops_ms: Delta,
}

/// Chain-level means over the paired explicit chains ([`pair_chains`]).
fn compare_chains(b: &Side, a: &Side, paired: &[(Option<u32>, Option<u32>)]) -> Option<ChainsDelta> {
    if b.chains.is_empty() || a.chains.is_empty() {
        return None;
    }
    let both: Vec<_> = paired.iter().filter_map(|&(x, y)| Some((b.chains[x? as usize].figures?, a.chains[y? as usize].figures?))).collect();
    let d = |f: fn(&(f64, f64, f64)) -> f64| mean_delta(both.iter().map(|(x, y)| Delta::of(Some(f(x)), Some(f(y)))));
    Some(ChainsDelta { chains: both.len(), e2e_ms: d(|x| x.0), hops_e2e_ms: d(|x| x.1), between_hops_ms: d(|x| x.2) })
}

// ---------------------------------------------------------------- one recording

/// One recording as the diff reads it: per request what matching needs and
/// its figures (a few hundred bytes), the explicit chains, the top kernels.
/// Made from a report ([`Side::of_report`]) or while a recording is read
/// ([`Side::read`]): diffing two long recordings holds neither their
/// analyses nor their reports, and the pairs are made one at a time as they
/// are written.
#[derive(Debug)]
pub struct Side {
    info: SideInfo,
    /// (method, path) of the requests, each once.
    routes: Vec<(Box<str>, Box<str>)>,
    reqs: Vec<Req>,
    /// Explicit chains in the report's order, each its requests in hop order.
    chains: Vec<SideChain>,
    kernels: Vec<KernelOut>,
    /// Normalised kernel names ([`normalize_kernel_name`]) the requests'
    /// kernel lists index, each once.
    kernel_names: Vec<Box<str>>,
    /// Model names the requests index, each once.
    models: Vec<Box<str>>,
}

#[derive(Debug)]
struct Req {
    id: Box<str>,
    route: u32,
    /// The chain key, when explicit (traceparent or header).
    chain: Option<Box<str>>,
    hop: Option<u32>,
    request_bytes: u64,
    arrive_ns: u64,
    view: Packed,
    /// The report's `kernels` of the request (its top
    /// [`KERNELS_PER_REQUEST`](crate::correlate::gpu::KERNELS_PER_REQUEST)),
    /// merged by normalised name: (index into `Side::kernel_names`, GPU ms).
    /// None without GPU records.
    kernels: Option<Box<[(u32, f64)]>>,
    /// Index into `Side::models`; None when the body named none.
    model: Option<u32>,
}

#[derive(Debug)]
struct SideChain {
    members: Vec<u32>,
    /// E2E, its hops' E2E added up and the time between hops, as the
    /// report's chain gives them; None unless all three are known.
    figures: Option<(f64, f64, f64)>,
}

/// An explicit chain while its hops come (requests in report order).
struct ChainAcc {
    name: Box<str>,
    source: u8,
    first_arrive_ns: u64,
    last_done_ns: Option<u64>,
    all_done: bool,
    hops_e2e_ms: Option<f64>,
    /// (hop, request).
    members: Vec<(u32, u32)>,
}

/// A [`Side`] from requests in report order.
#[derive(Default)]
struct SideBuilder {
    route_ix: HashMap<Box<str>, u32>,
    routes: Vec<(Box<str>, Box<str>)>,
    reqs: Vec<Req>,
    chain_ix: HashMap<Box<str>, u32>,
    chains: Vec<ChainAcc>,
    key: String,
    /// Raw kernel name → index into `kernel_names` (normalised once per name).
    raw_kernel_ix: HashMap<Box<str>, u32>,
    kernel_ix: HashMap<Box<str>, u32>,
    kernel_names: Vec<Box<str>>,
    model_ix: HashMap<Box<str>, u32>,
    models: Vec<Box<str>>,
}

/// `name`'s index in `names`, which `ix` maps; added at the end when new.
fn intern(ix: &mut HashMap<Box<str>, u32>, names: &mut Vec<Box<str>>, name: &str) -> u32 {
    if let Some(&i) = ix.get(name) {
        return i;
    }
    let i = names.len() as u32;
    names.push(name.into());
    ix.insert(name.into(), i);
    i
}

/// The order of [`ChainSource`](crate::correlate::ChainSource)'s variants,
/// by which the report orders chains with the same name and first arrival.
fn source_rank(source: &str) -> u8 {
    match source {
        "traceparent" => 0,
        "header" => 1,
        _ => 2,
    }
}

impl SideBuilder {
    /// The next request, in report order.
    fn add(&mut self, q: &RequestOut) {
        let i = self.reqs.len() as u32;
        // Keys are looked up in one reused buffer: no allocation per request.
        self.key.clear();
        let _ = write!(self.key, "{}\0{}", q.method, q.path);
        let route = match self.route_ix.get(self.key.as_str()) {
            Some(&r) => r,
            None => {
                let r = self.routes.len() as u32;
                self.routes.push((q.method.as_str().into(), q.path.as_str().into()));
                self.route_ix.insert(self.key.as_str().into(), r);
                r
            }
        };
        let chain = q.chain.as_deref().filter(|_| explicit(&q.chain_source));
        if let Some(name) = chain {
            let source = source_rank(&q.chain_source);
            self.key.clear();
            let _ = write!(self.key, "{source}{name}");
            let c = match self.chain_ix.get(self.key.as_str()) {
                Some(&c) => c as usize,
                None => {
                    self.chain_ix.insert(self.key.as_str().into(), self.chains.len() as u32);
                    self.chains.push(ChainAcc { name: name.into(), source, first_arrive_ns: q.arrive_ns, last_done_ns: None, all_done: true, hops_e2e_ms: Some(0.0), members: Vec::new() });
                    self.chains.len() - 1
                }
            };
            let c = &mut self.chains[c];
            c.members.push((q.hop.unwrap_or(0), i));
            // A hop its client left ends at the close (the chain went on).
            match q.done_ns.or(q.closed_ns) {
                Some(d) => c.last_done_ns = Some(c.last_done_ns.map_or(d, |l| l.max(d))),
                None => c.all_done = false,
            }
            c.hops_e2e_ms = c.hops_e2e_ms.zip(q.e2e_ms.or(q.closed_ms)).map(|(t, e)| t + e);
        }
        let kernels = q.kernels.as_ref().map(|ks| {
            let mut v: Vec<(u32, f64)> = Vec::with_capacity(ks.len());
            for k in ks {
                let n = self.kernel(&k.name);
                match v.iter_mut().find(|(i, _)| *i == n) {
                    Some(e) => e.1 += k.gpu_ms,
                    None => v.push((n, k.gpu_ms)),
                }
            }
            v.into_boxed_slice()
        });
        let model = q.model.as_deref().map(|m| intern(&mut self.model_ix, &mut self.models, m));
        self.reqs.push(Req {
            id: q.id.as_str().into(),
            route,
            chain: chain.map(Box::from),
            hop: q.hop,
            request_bytes: q.request_bytes,
            arrive_ns: q.arrive_ns,
            view: Packed::of(&view(q)),
            kernels,
            model,
        });
    }

    /// The index of raw kernel name `raw`'s normalised name.
    fn kernel(&mut self, raw: &str) -> u32 {
        if let Some(&i) = self.raw_kernel_ix.get(raw) {
            return i;
        }
        let i = intern(&mut self.kernel_ix, &mut self.kernel_names, &normalize_kernel_name(raw));
        self.raw_kernel_ix.insert(raw.into(), i);
        i
    }

    /// The chains in the report's order (first hop's arrival, then name and
    /// source: `correlate::chains_of`), with the figures `report::build` gives.
    fn finish(self, r: &crate::sink::report::RecordingInfo, kernels: Vec<KernelOut>) -> Side {
        let losses = r.drops.iter().filter(|(k, v)| **v > 0 && report::is_loss(k)).map(|(k, v)| (k.clone(), *v)).collect();
        let mut chains = self.chains;
        chains.sort_by(|x, y| (x.first_arrive_ns, &x.name, x.source).cmp(&(y.first_arrive_ns, &y.name, y.source)));
        let chains: Vec<SideChain> = chains
            .into_iter()
            .map(|mut c| {
                c.members.sort_unstable();
                let e2e_ms = c.last_done_ns.filter(|_| c.all_done).map(|l| ms(l.saturating_sub(c.first_arrive_ns)));
                let figures = (|| Some((e2e_ms?, c.hops_e2e_ms?, between_hops_ms(e2e_ms, c.hops_e2e_ms)?)))();
                SideChain { members: c.members.into_iter().map(|(_, i)| i).collect(), figures }
            })
            .collect();
        Side {
            info: SideInfo {
                path: r.path.clone(),
                requests: self.reqs.len(),
                chains: chains.len(),
                gpu: r.gpu,
                read_error: r.read_error.clone(),
                hopscope_version: r.hopscope_version.clone(),
                losses,
                gpu_graphs: graphs_traced(&r.cupti),
            },
            routes: self.routes,
            reqs: self.reqs,
            chains,
            kernels,
            kernel_names: self.kernel_names,
            models: self.models,
        }
    }
}

/// "node", "launch" or "mixed" over a recording's injected processes.
fn graphs_traced(cupti: &[crate::correlate::CuptiSetup]) -> Option<&'static str> {
    let first = cupti.first()?.graphs;
    Some(if cupti.iter().all(|c| c.graphs == first) { first } else { "mixed" })
}

impl Side {
    /// A report's requests, chains and kernels.
    pub fn of_report(rep: &Report) -> Side {
        let mut b = SideBuilder::default();
        for q in &rep.requests {
            b.add(q);
        }
        b.finish(&rep.recording, rep.kernels.clone())
    }

    /// A recording read through the correlator (as `hopscope report` reads
    /// it), keeping only what the diff needs: memory follows the requests'
    /// count (a few hundred bytes each), not the recording's length. Returns
    /// the error that stopped the read early, if any.
    pub fn read<R: Read>(reader: &mut crate::recording::Reader<R>, path: &str, cfg: crate::correlate::Config) -> io::Result<(Side, Option<String>)> {
        let meta = reader.meta().clone();
        let mut b = SideBuilder::default();
        let mut gpu_mem = crate::sink::summary::GpuMemIndex::default();
        let put = |_: &crate::correlate::Request, q: &RequestRef| -> io::Result<()> {
            b.add(&q.to_out());
            Ok(())
        };
        let (tail, read_error) = report::stream_requests(reader, cfg, &mut gpu_mem, put, |_, _| Ok(()))?;
        // The requests went by; the recording-wide parts (kernels) are left.
        let rep = report::build(path, &meta, &tail, read_error.clone());
        Ok((b.finish(&rep.recording, rep.kernels), read_error))
    }

    fn route(&self, q: &Req) -> (&str, &str) {
        let (m, p) = &self.routes[q.route as usize];
        (m, p)
    }

    fn model(&self, q: &Req) -> Option<&str> {
        q.model.map(|i| &*self.models[i as usize])
    }
}

// ---------------------------------------------------------------- per request

/// One request's figures, as the report gives them.
#[derive(Debug, Clone, Default)]
struct View {
    ttft: Option<f64>,
    e2e: Option<f64>,
    itl_mean: Option<f64>,
    itl_p90: Option<f64>,
    itl_gaps: usize,
    itl_sum: f64,
    phases: [Option<f64>; 6],
    prompt: Option<u64>,
    cached: Option<u64>,
    computed: Option<u64>,
    completion: Option<u64>,
    steps: Option<u64>,
    preemptions: Option<u64>,
    interference: Option<f64>,
    scheduler_queue: Option<f64>,
    /// Its `scheduler_passed_over_ms`.
    passed_over: Option<f64>,
    /// Its `scheduler_grammar_ready_ms`.
    grammar_ready: Option<f64>,
    /// Its `first_output_held_ms`.
    held: Option<f64>,
    gpu: [Option<f64>; 3],
    generation: bool,
    /// Its structured-output constraint ([`structured_code`]).
    structured: u8,
}

/// A structured-output kind as one byte: 0 none, else 1 + its place in
/// [`crate::model::STRUCTURED_KINDS`] (`other` past them).
fn structured_code(kind: Option<&str>) -> u8 {
    use crate::model::STRUCTURED_KINDS;
    kind.map_or(0, |k| 1 + STRUCTURED_KINDS.iter().position(|x| *x == k).unwrap_or(STRUCTURED_KINDS.len()) as u8)
}

/// [`structured_code`]'s kind.
fn structured_name(code: u8) -> Option<&'static str> {
    use crate::model::{STRUCTURED_KINDS, STRUCTURED_OTHER};
    (code > 0).then(|| STRUCTURED_KINDS.get(usize::from(code) - 1).copied().unwrap_or(STRUCTURED_OTHER))
}

fn view(q: &RequestOut) -> View {
    let p = &q.phases_ms;
    let itl_sum: f64 = q.itl_ms.iter().sum();
    View {
        ttft: q.ttft_ms,
        e2e: q.e2e_ms,
        itl_mean: (!q.itl_ms.is_empty()).then(|| itl_sum / q.itl_ms.len() as f64),
        itl_p90: q.itl_p90_ms,
        itl_gaps: q.itl_ms.len(),
        itl_sum,
        // A request its client left has phases of its wait, not of an E2E:
        // they would explain a difference its E2E does not have.
        phases: if q.closed_ns.is_some() { [None; 6] } else { [p.frontend, p.queue, p.prefill, p.kv_transfer, p.first_output, p.decode] },
        prompt: q.prompt_tokens,
        cached: q.cached_tokens,
        computed: q.prompt_tokens.zip(q.cached_tokens).map(|(p, c)| p.saturating_sub(c)),
        completion: q.completion_tokens,
        steps: q.steps,
        preemptions: q.preemptions.map(u64::from),
        interference: q.interference_ms,
        scheduler_queue: if q.closed_ns.is_some() { None } else { q.scheduler_queue_ms },
        passed_over: if q.closed_ns.is_some() { None } else { q.scheduler_passed_over_ms },
        grammar_ready: if q.closed_ns.is_some() { None } else { q.scheduler_grammar_ready_ms },
        held: if q.closed_ns.is_some() { None } else { q.first_output_held_ms },
        gpu: [q.gpu_ms.prefill, q.gpu_ms.decode, q.gpu_ms.kv_transfer],
        generation: q.ttft_ms.is_some() || q.prompt_tokens.is_some() || q.engine_request_id.is_some(),
        structured: structured_code(q.structured_output.as_deref()),
    }
}

/// A [`View`] in half the bytes (a diff holds one per request of both
/// recordings): unknown figures as a NaN no arithmetic makes, unknown
/// counts as bits of `known`, `computed` made again from prompt and cached.
#[derive(Debug, Clone, Copy)]
struct Packed {
    /// ttft, e2e, itl_mean, itl_p90, the phases, interference, the GPU
    /// shares, itl_sum, scheduler_queue, passed_over, grammar_ready, held.
    f: [f64; 19],
    /// prompt, cached, completion, steps.
    n: [u64; 4],
    preemptions: u32,
    itl_gaps: u32,
    /// Which of `n` (bits 0-3) and `preemptions` (bit 4) are known.
    known: u8,
    generation: bool,
    structured: u8,
}

/// The NaN that stands for an unknown figure: arithmetic makes only the
/// canonical quiet NaN, so a computed NaN stays a known value.
const UNKNOWN: u64 = 0x7ff8_0000_dead_beef;

fn pack_f(v: Option<f64>) -> f64 {
    v.unwrap_or(f64::from_bits(UNKNOWN))
}

fn unpack_f(v: f64) -> Option<f64> {
    (v.to_bits() != UNKNOWN).then_some(v)
}

impl Packed {
    fn of(v: &View) -> Packed {
        let mut f = [0.0; 19];
        for (slot, x) in f.iter_mut().zip([v.ttft, v.e2e, v.itl_mean, v.itl_p90].into_iter().chain(v.phases).chain([v.interference]).chain(v.gpu)) {
            *slot = pack_f(x);
        }
        f[14] = v.itl_sum;
        f[15] = pack_f(v.scheduler_queue);
        f[16] = pack_f(v.passed_over);
        f[17] = pack_f(v.grammar_ready);
        f[18] = pack_f(v.held);
        let counts = [v.prompt, v.cached, v.completion, v.steps];
        let mut known = u8::from(v.preemptions.is_some()) << 4;
        for (i, c) in counts.iter().enumerate() {
            known |= u8::from(c.is_some()) << i;
        }
        Packed {
            f,
            n: counts.map(|c| c.unwrap_or(0)),
            // The report's preemptions are a u32.
            preemptions: v.preemptions.map_or(0, |p| p as u32),
            itl_gaps: v.itl_gaps as u32,
            known,
            generation: v.generation,
            structured: v.structured,
        }
    }

    fn count(&self, i: usize) -> Option<u64> {
        (self.known & 1 << i != 0).then_some(self.n[i])
    }

    fn prompt(&self) -> Option<u64> {
        self.count(0)
    }

    fn unpack(&self) -> View {
        let f = |i: usize| unpack_f(self.f[i]);
        let (prompt, cached) = (self.count(0), self.count(1));
        View {
            ttft: f(0),
            e2e: f(1),
            itl_mean: f(2),
            itl_p90: f(3),
            itl_gaps: self.itl_gaps as usize,
            itl_sum: self.f[14],
            phases: std::array::from_fn(|i| f(4 + i)),
            prompt,
            cached,
            computed: prompt.zip(cached).map(|(p, c)| p.saturating_sub(c)),
            completion: self.count(2),
            steps: self.count(3),
            preemptions: (self.known & 1 << 4 != 0).then_some(u64::from(self.preemptions)),
            interference: f(10),
            scheduler_queue: f(15),
            passed_over: f(16),
            grammar_ready: f(17),
            held: f(18),
            gpu: [f(11), f(12), f(13)],
            generation: self.generation,
            structured: self.structured,
        }
    }
}

fn decode_split(b: &View, a: &View, decode: Delta) -> Option<DecodeSplit> {
    let d = decode.delta?;
    if b.itl_gaps == 0 && a.itl_gaps == 0 {
        return None;
    }
    let mean = |v: &View| if v.itl_gaps == 0 { 0.0 } else { v.itl_sum / v.itl_gaps as f64 };
    let (mb, ma) = (mean(b), mean(a));
    let itl_rate_ms = b.itl_gaps as f64 * (ma - mb);
    let token_count_ms = (a.itl_gaps as f64 - b.itl_gaps as f64) * ma;
    Some(DecodeSplit { itl_rate_ms, token_count_ms, tail_ms: d - itl_rate_ms - token_count_ms })
}

/// A matched pair's figures: a [`Pair`] without its names and explanation
/// (what the aggregates add up, made again for each pass over the pairs
/// rather than held for every pair).
#[derive(Debug, Clone, Copy)]
struct Figs {
    generation: bool,
    ttft_ms: Delta,
    e2e_ms: Delta,
    itl_mean_ms: Delta,
    itl_p90_ms: Delta,
    phases_ms: PhaseDeltas,
    decode_split_ms: Option<DecodeSplit>,
    tokens: Tokens<CountDelta>,
    steps: CountDelta,
    preemptions: CountDelta,
    interference_ms: Delta,
    scheduler_queue_ms: Delta,
    scheduler_passed_over_ms: Delta,
    scheduler_grammar_ready_ms: Delta,
    first_output_held_ms: Delta,
    gpu_ms: GpuDeltas,
    /// [`structured_code`] before and after.
    structured: [u8; 2],
}

fn figs(b: &View, a: &View) -> Figs {
    let phases = PhaseDeltas::from_array(std::array::from_fn(|i| Delta::of(b.phases[i], a.phases[i])));
    Figs {
        generation: b.generation && a.generation,
        ttft_ms: Delta::of(b.ttft, a.ttft),
        e2e_ms: Delta::of(b.e2e, a.e2e),
        itl_mean_ms: Delta::of(b.itl_mean, a.itl_mean),
        itl_p90_ms: Delta::of(b.itl_p90, a.itl_p90),
        decode_split_ms: decode_split(b, a, phases.decode),
        phases_ms: phases,
        tokens: Tokens {
            prompt: CountDelta::of(b.prompt, a.prompt),
            cached: CountDelta::of(b.cached, a.cached),
            computed: CountDelta::of(b.computed, a.computed),
            completion: CountDelta::of(b.completion, a.completion),
        },
        steps: CountDelta::of(b.steps, a.steps),
        preemptions: CountDelta::of(b.preemptions, a.preemptions),
        interference_ms: Delta::of(b.interference, a.interference),
        scheduler_queue_ms: Delta::of(b.scheduler_queue, a.scheduler_queue),
        scheduler_passed_over_ms: Delta::of(b.passed_over, a.passed_over),
        scheduler_grammar_ready_ms: Delta::of(b.grammar_ready, a.grammar_ready),
        first_output_held_ms: Delta::of(b.held, a.held),
        gpu_ms: GpuDeltas { prefill: Delta::of(b.gpu[0], a.gpu[0]), decode: Delta::of(b.gpu[1], a.gpu[1]), kv_transfer: Delta::of(b.gpu[2], a.gpu[2]) },
        structured: [b.structured, a.structured],
    }
}

/// How many of the pairs asked for structured output on each side, and
/// how many only after (`added`) or only before (`removed`).
fn structured_shift(pairs: impl Iterator<Item = [u8; 2]>) -> StructuredShift {
    let mut s = StructuredShift::default();
    for [b, a] in pairs {
        s.before += usize::from(b > 0);
        s.after += usize::from(a > 0);
        s.added += usize::from(b == 0 && a > 0);
        s.removed += usize::from(b > 0 && a == 0);
    }
    s
}

/// The figures of match `m` of BEFORE (`sb`) and AFTER (`sa`).
fn match_figs(m: &Match, sb: &Side, sa: &Side) -> Figs {
    figs(&sb.reqs[m.b as usize].view.unpack(), &sa.reqs[m.a as usize].view.unpack())
}

/// The pair `m` of requests of BEFORE (`sb`) and AFTER (`sa`).
fn pair_of(m: &Match, sb: &Side, sa: &Side) -> Pair {
    let (qb, qa) = (&sb.reqs[m.b as usize], &sa.reqs[m.a as usize]);
    let (method, path) = sa.route(qa);
    let (key, by, chain_index, hop) = match m.chain {
        Some((ci, hop)) => (format!("chain {} hop {hop}", ci + 1), "chain", Some(ci as usize + 1), Some(hop)),
        None => (format!("{method} {} #{}", printable(path), m.n + 1), "path", None, None),
    };
    let x = match_figs(m, sb, sa);
    let ctx = Ctx {
        tokens: Tokens { prompt: x.tokens.prompt.as_delta(), cached: x.tokens.cached.as_delta(), computed: x.tokens.computed.as_delta(), completion: x.tokens.completion.as_delta() },
        preemptions: x.preemptions.as_delta().delta,
        interference: x.interference_ms.delta,
        scheduler_queue: x.scheduler_queue_ms.delta,
        passed_over: x.scheduler_passed_over_ms.delta,
        split: x.decode_split_ms,
        prefill: x.phases_ms.prefill,
        structured: structured_shift(std::iter::once(x.structured)),
        structured_kind: structured_name(x.structured[1]).or(structured_name(x.structured[0])),
        grammar_ready: x.scheduler_grammar_ready_ms,
        scheduler_queue_after: x.scheduler_queue_ms.after,
        held: x.first_output_held_ms.delta,
    };
    Pair {
        key,
        by,
        chain_index,
        hop,
        method: method.to_owned(),
        path: path.to_owned(),
        before_id: qb.id.to_string(),
        after_id: qa.id.to_string(),
        before_model: sb.model(qb).map(str::to_owned),
        after_model: sa.model(qa).map(str::to_owned),
        generation: x.generation,
        itl_mean_ms: x.itl_mean_ms,
        itl_p90_ms: x.itl_p90_ms,
        decode_split_ms: x.decode_split_ms,
        steps: x.steps,
        preemptions: x.preemptions,
        interference_ms: x.interference_ms,
        scheduler_queue_ms: x.scheduler_queue_ms,
        gpu_ms: x.gpu_ms,
        structured_output: KindChange { before: structured_name(x.structured[0]), after: structured_name(x.structured[1]) },
        scheduler_passed_over_ms: x.scheduler_passed_over_ms,
        scheduler_grammar_ready_ms: x.scheduler_grammar_ready_ms,
        first_output_held_ms: x.first_output_held_ms,
        explain: explain_both(x.ttft_ms, x.e2e_ms, &x.phases_ms, &ctx),
        ttft_ms: x.ttft_ms,
        e2e_ms: x.e2e_ms,
        phases_ms: x.phases_ms,
        tokens: x.tokens,
    }
}

// ---------------------------------------------------------------- explanations

/// What the causes may cite.
struct Ctx {
    tokens: Tokens<Delta>,
    preemptions: Option<f64>,
    interference: Option<f64>,
    scheduler_queue: Option<f64>,
    /// The change in the part of it in which later requests went past.
    passed_over: Option<f64>,
    split: Option<DecodeSplit>,
    prefill: Delta,
    structured: StructuredShift,
    /// The kind a lone pair asked for (after, else before); None for an aggregate.
    structured_kind: Option<&'static str>,
    /// When the grammar was known ready (a lone pair's sides; an
    /// aggregate's means over pairs known on both).
    grammar_ready: Delta,
    /// A lone pair's scheduler's queue after; None for an aggregate.
    scheduler_queue_after: Option<f64>,
    /// The change in the part of `first_output` the engine went on decoding
    /// before the first content left.
    held: Option<f64>,
}

fn explain_both(ttft: Delta, e2e: Delta, phases: &PhaseDeltas, ctx: &Ctx) -> Explain {
    let arr = phases.as_array();
    let named: Vec<(&'static str, Option<f64>)> = PHASES.iter().zip(arr.iter()).map(|(n, d)| (*n, d.delta)).collect();
    Explain { ttft: explain("ttft", ttft, &named[..TTFT_PHASES], ctx), e2e: explain("e2e", e2e, &named, ctx) }
}

fn sign(x: f64) -> f64 {
    if x < 0.0 {
        -1.0
    } else {
        1.0
    }
}

fn explain(metric: &'static str, m: Delta, phases: &[(&'static str, Option<f64>)], ctx: &Ctx) -> Explanation {
    let label = metric.to_ascii_uppercase();
    let known: Vec<(&'static str, f64)> = phases.iter().filter_map(|(n, d)| d.map(|d| (*n, d))).collect();
    let Some(delta) = m.delta else {
        return Explanation {
            metric,
            delta_ms: None,
            relative: None,
            contributions: Vec::new(),
            sum_of_phases_ms: None,
            unexplained_ms: None,
            dominant_phase: None,
            unchanged: false,
            causes: Vec::new(),
            summary: format!("{label} not known on both sides"),
        };
    };
    let sum: Option<f64> = (!known.is_empty()).then(|| known.iter().map(|(_, d)| d).sum());
    let unexplained = delta - sum.unwrap_or(0.0);
    let mut contributions: Vec<Contribution> =
        known.iter().map(|&(phase, d)| Contribution { phase, delta_ms: d, share: (delta != 0.0).then(|| d / delta) }).collect();
    // Biggest first; ties keep time order.
    contributions.sort_by(|x, y| y.delta_ms.abs().total_cmp(&x.delta_ms.abs()));
    let s = sign(delta);
    let dominant = contributions
        .iter()
        .filter(|c| c.delta_ms * s > 0.0)
        .max_by(|x, y| (x.delta_ms * s).total_cmp(&(y.delta_ms * s)))
        .filter(|c| c.delta_ms * s >= unexplained * s || unexplained.abs() < 0.01)
        .map(|c| c.phase);
    let unchanged = delta.abs() < NOISE_MS;
    let mut causes = Vec::new();
    if !unchanged {
        let mut order: Vec<&Contribution> = contributions.iter().filter(|c| c.delta_ms * s > 0.0).collect();
        order.sort_by_key(|c| Some(c.phase) != dominant);
        for c in order {
            if Some(c.phase) == dominant || c.delta_ms * s >= CAUSE_SHARE * delta.abs() {
                causes.push(cause_of(c.phase, c.delta_ms, ctx));
            }
        }
    }
    let relative = m.before.filter(|b| *b > 0.0).map(|b| delta / b);
    let rel = relative.map(|r| format!(" ({:+.1}%)", r * 100.0)).unwrap_or_default();
    let summary = if unchanged {
        format!("{label} unchanged ({delta:+.2} ms)")
    } else {
        match dominant {
            Some(p) => {
                let d = contributions.iter().find(|c| c.phase == p).map_or(0.0, |c| c.delta_ms);
                let share = d / delta * 100.0;
                let mut t = format!("{label} {delta:+.2} ms{rel}: {p} {d:+.2} ms ({share:.0}%)");
                if let Some(c) = causes.first() {
                    let _ = write!(t, "; cause: {}", c.detail);
                }
                t
            }
            None if sum.is_none() => format!("{label} {delta:+.2} ms{rel}: no phases known on both sides"),
            None => format!("{label} {delta:+.2} ms{rel}: mostly unattributed ({unexplained:+.2} ms: a phase is unknown on one side)"),
        }
    };
    Explanation {
        metric,
        delta_ms: Some(delta),
        relative,
        contributions,
        sum_of_phases_ms: sum,
        unexplained_ms: Some(unexplained),
        dominant_phase: dominant,
        unchanged,
        causes,
        summary,
    }
}

/// `+1,234` style token counts (means may be fractional).
fn tok(x: f64) -> String {
    if (x - x.round()).abs() < 0.05 {
        format!("{:+.0}", x)
    } else {
        format!("{x:+.1}")
    }
}

fn cause_of(phase: &'static str, d: f64, ctx: &Ctx) -> Cause {
    let up = d > 0.0;
    let t = &ctx.tokens;
    let (cached, computed, prompt, completion) = (t.cached.delta, t.computed.delta, t.prompt.delta, t.completion.delta);
    let moved = |x: Option<f64>, dir: f64| x.is_some_and(|v| v * dir >= 0.5);
    let dir = if up { 1.0 } else { -1.0 };
    let (cause, detail): (&'static str, String) = match phase {
        "prefill" => {
            if moved(cached, -dir) && moved(computed, dir) {
                let name = if up { "fewer_cached_tokens" } else { "more_cached_tokens" };
                let what = if up { "prefix-cache hits fell" } else { "prefix-cache hits rose" };
                (name, format!("{what}: cached {} ⇒ computed {} prompt tokens ⇒ prefill {d:+.2} ms", tok(cached.unwrap()), tok(computed.unwrap())))
            } else if moved(prompt, dir) && moved(computed, dir) {
                let name = if up { "longer_prompt" } else { "shorter_prompt" };
                (name, format!("prompt {} ⇒ computed {} tokens ⇒ prefill {d:+.2} ms", tok(prompt.unwrap()), tok(computed.unwrap())))
            } else if moved(computed, dir) {
                let name = if up { "more_computed_tokens" } else { "fewer_computed_tokens" };
                (name, format!("computed {} prompt tokens ⇒ prefill {d:+.2} ms", tok(computed.unwrap())))
            } else {
                let name = if up { "slower_prefill" } else { "faster_prefill" };
                let per_token = match (ctx.prefill.before, ctx.prefill.after, t.computed.before, t.computed.after) {
                    (Some(pb), Some(pa), Some(cb), Some(ca)) if cb > 0.0 && ca > 0.0 => {
                        format!(" ({:.3} → {:.3} ms per computed token)", pb / cb, pa / ca)
                    }
                    _ => String::new(),
                };
                let toks = if computed.is_some() { "same computed tokens" } else { "computed tokens unknown" };
                (name, format!("{toks}, prefill {d:+.2} ms{per_token}"))
            }
        }
        "queue" => {
            if up && moved(ctx.preemptions, 1.0) {
                ("preemptions", format!("preemptions {} ⇒ queue {d:+.2} ms", tok(ctx.preemptions.unwrap())))
            } else {
                // The engine's stamps split the queue: the scheduler's part,
                // and before it the way in (the engine busy in a step).
                let st = &ctx.structured;
                let what = |n: usize, one: &str, many: &str| match ctx.structured_kind {
                    Some(k) if st.before + st.after <= 1 => format!("{one} structured output ({k})"),
                    _ if n == 1 => format!("1 of these requests {one} structured output"),
                    _ => format!("{n} of these requests {many} structured output"),
                };
                // Later requests went past them for at least half of the
                // scheduler's change: the scheduler skipped them (vLLM's
                // FCFS scheduler lets none past for want of room).
                let passed = ctx.passed_over.unwrap_or(0.0);
                let skipped = |sq: f64| if sq > 0.0 { passed >= sq / 2.0 } else { passed <= sq / 2.0 && passed < 0.0 };
                match ctx.scheduler_queue {
                    // Most of the change in the scheduler's queue, where vLLM
                    // holds a structured-output request until its grammar is
                    // compiled, and requests that newly ask for one.
                    Some(sq) if up && st.added > 0 && sq >= d / 2.0 => {
                        let why = match (ctx.grammar_ready.after, ctx.scheduler_queue_after) {
                            _ if skipped(sq) => format!("which held it until its grammar was compiled: later requests went past it for {passed:+.2} ms more"),
                            // A request of the same constraint scheduled
                            // says when the grammar was ready at the latest:
                            // a wait mostly after that was for room.
                            (Some(g), Some(total)) if st.added == 1 && total - g >= total / 2.0 => {
                                format!("its grammar was ready within {g:.2} ms; the {:.2} ms after it waited for room: fewer free slots or KV blocks", total - g)
                            }
                            (Some(g), Some(_)) if st.added == 1 => format!("which holds such a request until its grammar is compiled: ready within {g:.2} ms"),
                            _ => "which holds such a request until its grammar is compiled; or fewer free slots".to_owned(),
                        };
                        ("structured_output_added", format!("{}: waited {d:+.2} ms longer to be scheduled, {sq:+.2} ms of it in the scheduler's queue ({why})", what(st.added, "now asks for", "now ask for")))
                    }
                    Some(sq) if !up && st.removed > 0 && sq <= d / 2.0 => ("structured_output_removed", format!("{}: scheduled {:.2} ms sooner, {sq:+.2} ms of it in the scheduler's queue (no grammar to compile)", what(st.removed, "no longer asks for", "no longer ask for"), -d)),
                    Some(sq) if up && sq >= d / 2.0 && skipped(sq) => {
                        // Requests that newly ask took the branch above.
                        let why = match ctx.structured_kind {
                            _ if st.after == 0 => "remote KV not loaded yet, no free LoRA slot, or, chunked prefill off, a prompt over the token budget".to_owned(),
                            Some(k) => {
                                let ready = ctx.grammar_ready.delta.map_or(String::new(), |g| format!("; its grammar known ready {g:+.2} ms later"));
                                format!("for its grammar: it asks for structured output ({k}) on both sides and waits longer for it now — a new or changing schema misses the backend's cache, or a slower backend{ready}")
                            }
                            None => format!("{} of these requests ask for structured output: for their grammars, a new or changing schema missing the backend's cache; else remote KV, a LoRA slot", st.after),
                        };
                        ("scheduler_skipped", format!("waited {d:+.2} ms longer to be scheduled, {sq:+.2} ms of it in the scheduler's queue, where later requests went past it for {passed:+.2} ms more: the scheduler skipped it ({why})"))
                    }
                    Some(sq) if !up && sq <= d / 2.0 && skipped(sq) => ("scheduler_skipped_less", format!("scheduled {:.2} ms sooner, {sq:+.2} ms of it in the scheduler's queue, where later requests went past it for {:.2} ms less: the scheduler skipped it less", -d, -passed)),
                    Some(sq) if up && sq < d / 2.0 => ("slower_engine_intake", format!("{:+.2} ms more before the engine took it in (longer engine steps, a busier input path); the scheduler's queue {sq:+.2} ms", d - sq)),
                    Some(sq) if !up && sq > d / 2.0 => ("faster_engine_intake", format!("{:.2} ms less before the engine took it in; the scheduler's queue {sq:+.2} ms", sq - d)),
                    Some(sq) if up => ("more_queueing", format!("waited {d:+.2} ms longer to be scheduled, {sq:+.2} ms of it in the scheduler's queue (fewer free slots or KV blocks)")),
                    _ if up => ("more_queueing", format!("waited {d:+.2} ms longer to be scheduled (busier engine or fewer free slots)")),
                    Some(sq) => ("less_queueing", format!("scheduled {:.2} ms sooner, {sq:+.2} ms of it in the scheduler's queue", -d)),
                    _ => ("less_queueing", format!("scheduled {:.2} ms sooner", -d)),
                }
            }
        }
        "decode" => decode_cause(d, ctx, completion),
        "frontend" => {
            if up {
                ("slower_frontend", format!("arrival to engine submit {d:+.2} ms (HTTP handling, tokenisation, IPC hand-off)"))
            } else {
                ("faster_frontend", format!("arrival to engine submit {d:+.2} ms"))
            }
        }
        "first_output" => {
            // Most of the change is tokens the engine went on making while
            // the server let no text out: not the output path.
            match ctx.held.filter(|h| h * sign(d) >= 0.5 * d.abs()) {
                Some(h) if up => ("first_content_held_back", format!("first token to its SSE write {d:+.2} ms, {h:+.2} ms of it the engine decoding while the server held the text back (a new or longer stop string, a reasoning or tool-call parser, incomplete UTF-8)")),
                Some(h) => ("first_content_held_less", format!("first token to its SSE write {d:+.2} ms, {h:+.2} ms of it less text held back before the first content")),
                None if up => ("slower_output_path", format!("first token to its SSE write {d:+.2} ms (detokenise, output IPC, stream)")),
                None => ("faster_output_path", format!("first token to its SSE write {d:+.2} ms")),
            }
        }
        _ => {
            if up {
                ("more_kv_transfer", format!("KV-cache transfer {d:+.2} ms"))
            } else {
                ("less_kv_transfer", format!("KV-cache transfer {d:+.2} ms"))
            }
        }
    };
    Cause { cause, phase, delta_ms: d, detail }
}

fn decode_cause(d: f64, ctx: &Ctx, completion: Option<f64>) -> (&'static str, String) {
    let up = d > 0.0;
    let s = sign(d);
    let interference = ctx.interference.filter(|i| i * s > 0.0);
    if let Some(sp) = ctx.split {
        let parts = [("rate", sp.itl_rate_ms), ("count", sp.token_count_ms), ("tail", sp.tail_ms)];
        let (which, v) = parts.iter().copied().max_by(|x, y| (x.1 * s).total_cmp(&(y.1 * s))).unwrap();
        match which {
            "rate" => {
                if let Some(i) = interference.filter(|i| i.abs() >= 0.5 * v.abs()) {
                    let name = if up { "interference" } else { "less_interference" };
                    return (name, format!("co-batched prefills {i:+.2} ms ⇒ inter-token gaps {v:+.2} ms in all ⇒ decode {d:+.2} ms"));
                }
                if up && ctx.preemptions.is_some_and(|p| p >= 0.5) {
                    return ("preemptions", format!("preemptions {} ⇒ decode {d:+.2} ms", tok(ctx.preemptions.unwrap())));
                }
                let name = if up { "slower_decode_steps" } else { "faster_decode_steps" };
                return (name, format!("inter-token gaps {v:+.2} ms in all ⇒ decode {d:+.2} ms"));
            }
            "count" => {
                // More gaps are more tokens only when the token count moved
                // that way: the same tokens in more (fewer) content chunks is
                // the server's streaming — how many tokens one SSE event
                // carries (vLLM merges tokens when its frontend lags).
                if completion.is_some_and(|c| c * s < 0.5) {
                    let name = if up { "more_stream_chunks" } else { "fewer_stream_chunks" };
                    return (name, format!("completion {} tokens in {} content chunks: {v:+.2} ms of streamed gaps ⇒ decode {d:+.2} ms", tok(completion.unwrap()), if up { "more" } else { "fewer" }));
                }
                let name = if up { "more_output_tokens" } else { "fewer_output_tokens" };
                let toks = completion.map(|c| format!("completion {} tokens, ", tok(c))).unwrap_or_default();
                return (name, format!("{toks}{v:+.2} ms of streamed gaps ⇒ decode {d:+.2} ms"));
            }
            _ => {
                let name = if up { "slower_stream_end" } else { "faster_stream_end" };
                return (name, format!("last content chunk to end of response {v:+.2} ms"));
            }
        }
    }
    if completion.is_some_and(|c| c * s >= 0.5) {
        let name = if up { "more_output_tokens" } else { "fewer_output_tokens" };
        return (name, format!("completion {} tokens ⇒ decode {d:+.2} ms", tok(completion.unwrap())));
    }
    if let Some(i) = interference {
        let name = if up { "interference" } else { "less_interference" };
        return (name, format!("co-batched prefills {i:+.2} ms ⇒ decode {d:+.2} ms"));
    }
    let name = if up { "slower_decode_steps" } else { "faster_decode_steps" };
    (name, format!("decode {d:+.2} ms with the same output"))
}

// ---------------------------------------------------------------- aggregates

fn mean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// Mean of each side and of the per-pair deltas, over pairs known on both sides.
fn mean_delta(items: impl Iterator<Item = Delta>) -> Delta {
    let (mut b, mut a, mut d) = (Vec::new(), Vec::new(), Vec::new());
    for x in items {
        if let (Some(xb), Some(xa), Some(xd)) = (x.before, x.after, x.delta) {
            b.push(xb);
            a.push(xa);
            d.push(xd);
        }
    }
    Delta { before: mean(&b), after: mean(&a), delta: mean(&d) }
}

fn stats(items: impl Iterator<Item = Delta>) -> Stats {
    let items: Vec<Delta> = items.filter(|x| x.delta.is_some()).collect();
    let mut b: Vec<f64> = items.iter().filter_map(|x| x.before).collect();
    let mut a: Vec<f64> = items.iter().filter_map(|x| x.after).collect();
    b.sort_by(f64::total_cmp);
    a.sort_by(f64::total_cmp);
    let pct = |p: f64| Delta::of(percentile(&b, p), percentile(&a, p));
    Stats { mean: mean_delta(items.iter().copied()), p50: pct(50.0), p90: pct(90.0) }
}

/// The aggregate of `pairs` (a pass over them per figure: they are made, not held).
fn aggregate<I: Iterator<Item = Figs> + Clone>(hop: Option<u32>, pairs: I, kernels: Option<RequestKernels>, models: Option<ModelsUsed>) -> Aggregate {
    let phases = PhaseDeltas::from_array(std::array::from_fn(|i| mean_delta(pairs.clone().map(|p| p.phases_ms.as_array()[i]))));
    let splits: Vec<DecodeSplit> = pairs.clone().filter_map(|p| p.decode_split_ms).collect();
    let decode_split_ms = (!splits.is_empty()).then(|| {
        let n = splits.len() as f64;
        DecodeSplit {
            itl_rate_ms: splits.iter().map(|s| s.itl_rate_ms).sum::<f64>() / n,
            token_count_ms: splits.iter().map(|s| s.token_count_ms).sum::<f64>() / n,
            tail_ms: splits.iter().map(|s| s.tail_ms).sum::<f64>() / n,
        }
    });
    let tk = |f: fn(&Tokens<CountDelta>) -> CountDelta| mean_delta(pairs.clone().map(|p| f(&p.tokens).as_delta()));
    let tokens = Tokens { prompt: tk(|t| t.prompt), cached: tk(|t| t.cached), computed: tk(|t| t.computed), completion: tk(|t| t.completion) };
    let preemptions = mean_delta(pairs.clone().map(|p| p.preemptions.as_delta()));
    let interference_ms = mean_delta(pairs.clone().map(|p| p.interference_ms));
    let scheduler_queue_ms = mean_delta(pairs.clone().map(|p| p.scheduler_queue_ms));
    let scheduler_queue_covers = pairs.clone().all(|p| p.phases_ms.queue.delta.is_none() || p.scheduler_queue_ms.delta.is_some());
    let ttft_ms = stats(pairs.clone().map(|p| p.ttft_ms));
    let e2e_ms = stats(pairs.clone().map(|p| p.e2e_ms));
    let structured_output = structured_shift(pairs.clone().map(|p| p.structured));
    let scheduler_passed_over_ms = mean_delta(pairs.clone().map(|p| p.scheduler_passed_over_ms));
    let scheduler_grammar_ready_ms = mean_delta(pairs.clone().map(|p| p.scheduler_grammar_ready_ms));
    let first_output_held_ms = mean_delta(pairs.clone().map(|p| p.first_output_held_ms));
    let ctx = Ctx {
        tokens,
        preemptions: preemptions.delta,
        interference: interference_ms.delta,
        scheduler_queue: scheduler_queue_ms.delta,
        passed_over: scheduler_passed_over_ms.delta,
        split: decode_split_ms,
        prefill: phases.prefill,
        structured: structured_output,
        structured_kind: None,
        grammar_ready: scheduler_grammar_ready_ms,
        scheduler_queue_after: None,
        held: first_output_held_ms.delta,
    };
    Aggregate {
        hop,
        requests: pairs.clone().count(),
        explain: explain_both(ttft_ms.mean, e2e_ms.mean, &phases, &ctx),
        ttft_ms,
        e2e_ms,
        itl_mean_ms: stats(pairs.clone().map(|p| p.itl_mean_ms)),
        itl_p90_ms: stats(pairs.clone().map(|p| p.itl_p90_ms)),
        phases_ms: phases,
        decode_split_ms,
        tokens,
        steps: mean_delta(pairs.clone().map(|p| p.steps.as_delta())),
        preemptions,
        interference_ms,
        scheduler_queue_ms,
        scheduler_queue_covers,
        structured_output,
        scheduler_passed_over_ms,
        scheduler_grammar_ready_ms,
        first_output_held_ms,
        gpu_ms: GpuDeltas {
            prefill: mean_delta(pairs.clone().map(|p| p.gpu_ms.prefill)),
            decode: mean_delta(pairs.clone().map(|p| p.gpu_ms.decode)),
            kv_transfer: mean_delta(pairs.map(|p| p.gpu_ms.kv_transfer)),
        },
        kernels,
        models,
    }
}

/// The models `pairs` named on each side; None when every pair named the
/// same one on both.
fn request_models<'m>(pairs: impl Iterator<Item = &'m Match>, b: &Side, a: &Side) -> Option<ModelsUsed> {
    let mut counts: [BTreeMap<Option<&str>, usize>; 2] = [BTreeMap::new(), BTreeMap::new()];
    let mut changed = 0;
    for m in pairs {
        let (mb, ma) = (b.model(&b.reqs[m.b as usize]), a.model(&a.reqs[m.a as usize]));
        changed += usize::from(mb != ma);
        *counts[0].entry(mb).or_default() += 1;
        *counts[1].entry(ma).or_default() += 1;
    }
    if changed == 0 {
        return None;
    }
    let list = |c: &BTreeMap<Option<&str>, usize>| {
        let mut v: Vec<ModelCount> = c.iter().map(|(m, n)| ModelCount { model: m.map(str::to_owned), requests: *n }).collect();
        v.sort_by(|x, y| y.requests.cmp(&x.requests).then_with(|| x.model.cmp(&y.model)));
        v
    };
    Some(ModelsUsed { changed, before: list(&counts[0]), after: list(&counts[1]) })
}

/// The kernels of `pairs` (matches of BEFORE `b` and AFTER `a`), mean per
/// request over the pairs whose two requests have kernel lists.
fn request_kernels<'m>(pairs: impl Iterator<Item = &'m Match>, b: &Side, a: &Side) -> Option<RequestKernels> {
    // Per name: GPU ms on each side, and whether any request of the side lists it.
    // A BTreeMap: the sums are added in one order, whatever the process.
    let mut acc: BTreeMap<&str, ([f64; 2], [bool; 2])> = BTreeMap::new();
    let mut n = 0usize;
    for m in pairs {
        let (Some(kb), Some(ka)) = (&b.reqs[m.b as usize].kernels, &a.reqs[m.a as usize].kernels) else { continue };
        n += 1;
        for (k, side, list) in [(0, b, kb), (1, a, ka)] {
            for &(i, gpu_ms) in list.iter() {
                let e = acc.entry(&side.kernel_names[i as usize]).or_default();
                e.0[k] += gpu_ms;
                e.1[k] = true;
            }
        }
    }
    if n == 0 {
        return None;
    }
    let per = |x: f64| x / n as f64;
    let (tb, ta) = acc.values().fold((0.0, 0.0), |(tb, ta), (ms, _)| (tb + ms[0], ta + ms[1]));
    let mut rows: Vec<RequestKernelRow> = acc
        .into_iter()
        .map(|(name, (ms, seen))| {
            let (before_gpu_ms, after_gpu_ms) = (per(ms[0]), per(ms[1]));
            let delta_gpu_ms = after_gpu_ms - before_gpu_ms;
            let status = match seen {
                [false, _] => "new",
                [_, false] => "gone",
                _ if delta_gpu_ms == 0.0 => "same",
                _ => "changed",
            };
            RequestKernelRow { name: name.to_owned(), before_gpu_ms, after_gpu_ms, delta_gpu_ms, status }
        })
        .collect();
    rows.sort_by(|x, y| y.delta_gpu_ms.abs().total_cmp(&x.delta_gpu_ms.abs()).then_with(|| x.name.cmp(&y.name)));
    rows.truncate(AGG_KERNELS);
    Some(RequestKernels { requests: n, before_gpu_ms: per(tb), after_gpu_ms: per(ta), delta_gpu_ms: per(ta) - per(tb), rows })
}

// ---------------------------------------------------------------- matching

fn explicit(source: &str) -> bool {
    source == "traceparent" || source == "header"
}

/// A matched pair of requests: indexes into BEFORE's and AFTER's requests;
/// the chain position and hop (0-based chain, 1-based hop) for chain
/// matches, else the pair's number within its method and path.
#[derive(Debug, Clone, Copy)]
struct Match {
    b: u32,
    a: u32,
    chain: Option<(u32, u32)>,
    n: u32,
}

/// A request left unmatched, and why; made into an [`Unmatched`] only as
/// it is written (a diff of a short recording against a long one has
/// nearly every request of the long one here).
#[derive(Debug, Clone, Copy)]
struct Miss {
    i: u32,
    why: Why,
}

#[derive(Debug, Clone, Copy)]
enum Why {
    /// The other side has no chain at this position (0-based).
    NoChain(u32),
    /// The other side's chain at this position has no such hop.
    NoHop(u32, u32),
    /// The other side has only this many requests of the method and path.
    Route(u32),
}

/// `m` of side `s`; `other` names the other side (`BEFORE` or `AFTER`).
fn unmatched(s: &Side, m: &Miss, other: &str) -> Unmatched {
    let q = &s.reqs[m.i as usize];
    let (method, path) = s.route(q);
    let reason = match m.why {
        Why::NoChain(ci) => format!("{other} has no chain {}", ci + 1),
        Why::NoHop(ci, hop) => format!("{other}'s chain {} has no hop {hop}", ci + 1),
        Why::Route(n) => format!("{other} has only {n} {method} {} (nearest prompt sizes paired)", printable(path)),
    };
    Unmatched {
        id: q.id.to_string(),
        method: method.to_owned(),
        path: path.to_owned(),
        chain: q.chain.as_deref().map(str::to_owned),
        hop: q.hop,
        prompt_tokens: q.view.prompt(),
        reason,
    }
}

/// The chain of AFTER each explicit chain of BEFORE is compared with: the
/// first one not yet paired (in arrival order) that opened with the same
/// prompt — its first hop's prompt tokens, else its request bytes: a rerun
/// of the same agents, whichever started first — then the rest in arrival
/// order. (BEFORE's, AFTER's) chain indexes, in BEFORE's arrival order, then
/// AFTER's chains left over; and how many were paired by their opening.
fn pair_chains(b: &Side, a: &Side) -> ChainPairs {
    let opening = |s: &Side, c: &SideChain| {
        c.members.first().map(|&i| {
            let q = &s.reqs[i as usize];
            q.view.prompt().map_or((false, q.request_bytes), |t| (true, t))
        })
    };
    let mut by_opening: HashMap<(bool, u64), std::collections::VecDeque<u32>> = HashMap::new();
    for (j, c) in a.chains.iter().enumerate() {
        if let Some(k) = opening(a, c) {
            by_opening.entry(k).or_default().push_back(j as u32);
        }
    }
    let mut taken = vec![false; a.chains.len()];
    let mut partner: Vec<Option<u32>> = b
        .chains
        .iter()
        .map(|c| {
            let j = opening(b, c).and_then(|k| by_opening.get_mut(&k)?.pop_front())?;
            taken[j as usize] = true;
            Some(j)
        })
        .collect();
    let by_opening = partner.iter().flatten().count();
    let mut rest = (0..a.chains.len() as u32).filter(|j| !taken[*j as usize]);
    for p in partner.iter_mut().filter(|p| p.is_none()) {
        *p = rest.next();
    }
    let mut pairs: Vec<(Option<u32>, Option<u32>)> = partner.into_iter().enumerate().map(|(i, p)| (Some(i as u32), p)).collect();
    pairs.extend(rest.map(|j| (None, Some(j))));
    ChainPairs { pairs, by_opening }
}

/// [`pair_chains`]: (BEFORE's, AFTER's) chain indexes, and how many of
/// BEFORE's were paired by their opening prompt.
struct ChainPairs {
    pairs: Vec<(Option<u32>, Option<u32>)>,
    by_opening: usize,
}

/// Explicit chains paired by [`pair_chains`], hop by hop, when both sides
/// have explicit chains; every other request by (method, path), in
/// prompt-size order (prompt tokens, then request bytes, then arrival).
/// The matches, BEFORE's and AFTER's unmatched requests, and the
/// [`Matching`] without its lists.
fn match_requests(b: &Side, a: &Side, chains: &ChainPairs) -> (Vec<Match>, [Vec<Miss>; 2], Matching) {
    let chain_mode = !b.chains.is_empty() && !a.chains.is_empty();
    let mut used_b = vec![false; b.reqs.len()];
    let mut used_a = vec![false; a.reqs.len()];
    let mut pairs = Vec::new();
    let (mut un_b, mut un_a) = (Vec::new(), Vec::new());
    fn members(s: &Side, x: Option<u32>) -> &[u32] {
        x.map_or(&[], |x| &s.chains[x as usize].members)
    }
    if chain_mode {
        for (ci, &(xb, xa)) in chains.pairs.iter().enumerate() {
            let (hb, ha) = (members(b, xb), members(a, xa));
            for j in 0..hb.len().max(ha.len()) {
                let hop = j as u32 + 1;
                match (hb.get(j), ha.get(j)) {
                    (Some(&ib), Some(&ia)) => {
                        used_b[ib as usize] = true;
                        used_a[ia as usize] = true;
                        pairs.push(Match { b: ib, a: ia, chain: Some((ci as u32, hop)), n: 0 });
                    }
                    (Some(&ib), None) => {
                        used_b[ib as usize] = true;
                        un_b.push(Miss { i: ib, why: if ha.is_empty() { Why::NoChain(ci as u32) } else { Why::NoHop(ci as u32, hop) } });
                    }
                    (None, Some(&ia)) => {
                        used_a[ia as usize] = true;
                        un_a.push(Miss { i: ia, why: if hb.is_empty() { Why::NoChain(ci as u32) } else { Why::NoHop(ci as u32, hop) } });
                    }
                    (None, None) => {}
                }
            }
        }
    }
    let by_chain = pairs.len();
    // The rest: by method and path, in prompt-size order.
    let (gb, ga) = (by_route(b, &used_b), by_route(a, &used_a));
    let mut keys: Vec<&(&str, &str)> = gb.keys().chain(ga.keys()).collect();
    keys.sort();
    keys.dedup();
    for k in keys {
        let (vb, va) = (gb.get(k).map_or(&[][..], Vec::as_slice), ga.get(k).map_or(&[][..], Vec::as_slice));
        let size = |s: &Side, i: u32| {
            let q = &s.reqs[i as usize];
            q.view.prompt().unwrap_or(q.request_bytes) as f64
        };
        let sb: Vec<f64> = vb.iter().map(|&i| size(b, i)).collect();
        let sa: Vec<f64> = va.iter().map(|&i| size(a, i)).collect();
        let (mut hit_b, mut hit_a) = (vec![false; vb.len()], vec![false; va.len()]);
        for (n, (jb, ja)) in align(&sb, &sa).into_iter().enumerate() {
            hit_b[jb] = true;
            hit_a[ja] = true;
            pairs.push(Match { b: vb[jb], a: va[ja], chain: None, n: n as u32 });
        }
        for (j, _) in hit_b.iter().enumerate().filter(|(_, h)| !**h) {
            un_b.push(Miss { i: vb[j], why: Why::Route(va.len() as u32) });
        }
        for (j, _) in hit_a.iter().enumerate().filter(|(_, h)| !**h) {
            un_a.push(Miss { i: va[j], why: Why::Route(vb.len() as u32) });
        }
    }
    let matching = Matching {
        mode: if chain_mode { "chain" } else { "path" },
        matched: pairs.len(),
        by_chain,
        by_path: pairs.len() - by_chain,
        // 0 unless both sides have explicit chains.
        chains_by_opening: chains.by_opening,
        unmatched_before: Vec::new(),
        unmatched_after: Vec::new(),
    };
    (pairs, [un_b, un_a], matching)
}

/// The requests not `used`, by method and path, each group in prompt-size
/// order (prompt tokens, then request bytes, then arrival).
fn by_route<'s>(s: &'s Side, used: &[bool]) -> BTreeMap<(&'s str, &'s str), Vec<u32>> {
    let mut g: BTreeMap<(&str, &str), Vec<u32>> = BTreeMap::new();
    for (i, q) in s.reqs.iter().enumerate().filter(|(i, _)| !used[*i]) {
        g.entry(s.route(q)).or_default().push(i as u32);
    }
    for v in g.values_mut() {
        v.sort_by_key(|&i| {
            let q = &s.reqs[i as usize];
            let prompt = q.view.prompt();
            (prompt.is_none(), prompt.unwrap_or(0), q.request_bytes, q.arrive_ns)
        });
    }
    g
}

/// Order-preserving pairing of two size-sorted lists: equal lengths pair in
/// order; otherwise the longer list's extras are the ones whose skipping
/// leaves the smallest total size difference (dynamic programming over the
/// skips; plain order pairing when that would be too large). Returns (index
/// in `b`, index in `a`) pairs.
fn align(b: &[f64], a: &[f64]) -> Vec<(usize, usize)> {
    let swap = b.len() > a.len();
    let (short, long) = if swap { (a, b) } else { (b, a) };
    let (n, skips) = (short.len(), long.len() - short.len());
    let mut out: Vec<(usize, usize)> = Vec::with_capacity(n);
    if skips == 0 || n == 0 || n.saturating_mul(skips + 1) > 4_000_000 {
        out.extend((0..n).map(|i| (i, i)));
    } else {
        // cost[i][j]: the first i of `short` paired with the first i + j of `long`.
        let w = skips + 1;
        let mut cost = vec![f64::INFINITY; (n + 1) * w];
        let mut took = vec![false; (n + 1) * w];
        cost[..w].fill(0.0);
        for i in 1..=n {
            for j in 0..w {
                let pair = cost[(i - 1) * w + j] + (short[i - 1] - long[i - 1 + j]).abs();
                let skip = if j > 0 { cost[i * w + j - 1] } else { f64::INFINITY };
                if pair <= skip {
                    cost[i * w + j] = pair;
                    took[i * w + j] = true;
                } else {
                    cost[i * w + j] = skip;
                }
            }
        }
        let (mut i, mut j) = (n, skips);
        while i > 0 {
            if took[i * w + j] {
                out.push((i - 1, i - 1 + j));
                i -= 1;
            } else {
                j -= 1;
            }
        }
        out.reverse();
    }
    if swap {
        out.iter().map(|&(s, l)| (l, s)).collect()
    } else {
        out
    }
}

// ---------------------------------------------------------------- the diff

/// Two recordings compared: everything of the [`Diff`] but its pairs and
/// unmatched requests, which are made as they are written
/// ([`Compared::write_json`], [`Compared::render_text`]) or all at once
/// ([`Compared::into_diff`]).
pub struct Compared<'s> {
    /// The diff, `pairs` and the unmatched lists empty.
    head: Diff,
    before: &'s Side,
    after: &'s Side,
    matches: Vec<Match>,
    /// BEFORE's and AFTER's unmatched requests.
    misses: [Vec<Miss>; 2],
}

/// Compares two recordings: BEFORE and AFTER.
pub fn compare_sides<'s>(before: &'s Side, after: &'s Side) -> Compared<'s> {
    let paired = pair_chains(before, after);
    let (matches, misses, matching) = match_requests(before, after, &paired);
    let fig = |m: &Match| match_figs(m, before, after);
    let generation = |m: &&Match| before.reqs[m.b as usize].view.generation && after.reqs[m.a as usize].view.generation;
    let overall = aggregate(
        None,
        matches.iter().map(fig).filter(|x| x.generation),
        request_kernels(matches.iter().filter(generation), before, after),
        request_models(matches.iter().filter(generation), before, after),
    );
    let mut by_hop: BTreeMap<u32, Vec<Match>> = BTreeMap::new();
    for m in &matches {
        if let Some((_, hop)) = m.chain.filter(|_| generation(&m)) {
            by_hop.entry(hop).or_default().push(*m);
        }
    }
    let hops: Vec<Aggregate> = by_hop.iter().map(|(h, v)| aggregate(Some(*h), v.iter().map(fig), request_kernels(v.iter(), before, after), request_models(v.iter(), before, after))).collect();
    let kernels = compare_kernels(&before.kernels, &after.kernels);
    let headline = headline(&overall, &hops, &matching, [misses[0].len(), misses[1].len()], kernels.as_ref());
    let chains = compare_chains(before, after, &paired.pairs);
    let head = Diff { schema: SCHEMA, before: before.info.clone(), after: after.info.clone(), matching, headline, overall, hops, pairs: Vec::new(), kernels, chains };
    Compared { head, before, after, matches, misses }
}

/// Compares two reports: BEFORE and AFTER.
pub fn compare(before: &Report, after: &Report) -> Diff {
    let (b, a) = (Side::of_report(before), Side::of_report(after));
    compare_sides(&b, &a).into_diff()
}

/// `"name": ` at `level` after the `{` (the first member) or the `,` before it.
fn key(b: &mut Vec<u8>, open: u8, level: usize, name: &str) {
    b.push(open);
    json::newline(b, level);
    b.push(b'"');
    b.extend_from_slice(name.as_bytes());
    b.extend_from_slice(b"\": ");
}

fn member<T: Serialize + ?Sized>(b: &mut Vec<u8>, open: u8, level: usize, name: &str, v: &T) -> io::Result<()> {
    key(b, open, level, name);
    report::serde_nested(b, level, v)
}

/// A JSON array whose elements are at `level`, made and written one at a
/// time (what is buffered goes to `out` in [`CHUNK`] pieces).
fn array<T: Serialize, W: Write>(b: &mut Vec<u8>, out: &mut W, level: usize, items: impl Iterator<Item = T>) -> io::Result<()> {
    let mut any = false;
    for x in items {
        b.push(if any { b',' } else { b'[' });
        any = true;
        json::newline(b, level);
        report::serde_nested(b, level, &x)?;
        if b.len() >= CHUNK {
            out.write_all(b)?;
            b.clear();
        }
    }
    if any {
        json::newline(b, level - 1);
        b.push(b']');
    } else {
        b.extend_from_slice(b"[]");
    }
    Ok(())
}

impl Compared<'_> {
    fn pair(&self, m: &Match) -> Pair {
        pair_of(m, self.before, self.after)
    }

    /// Side `k`'s (0: BEFORE, 1: AFTER) unmatched requests, made one at a time.
    fn unmatched(&self, k: usize) -> impl Iterator<Item = Unmatched> + '_ {
        let (side, other) = if k == 0 { (self.before, "AFTER") } else { (self.after, "BEFORE") };
        self.misses[k].iter().map(move |m| unmatched(side, m, other))
    }

    /// The whole diff, every pair and unmatched request made.
    pub fn into_diff(self) -> Diff {
        let pairs = self.matches.iter().map(|m| self.pair(m)).collect();
        let (unmatched_before, unmatched_after) = (self.unmatched(0).collect(), self.unmatched(1).collect());
        let matching = Matching { unmatched_before, unmatched_after, ..self.head.matching };
        Diff { pairs, matching, ..self.head }
    }

    /// `hopscope diff --json`: the bytes of [`Diff`] serialized pretty
    /// (without a final newline), each pair and unmatched request made as it
    /// is written.
    pub fn write_json<W: Write>(&self, out: W) -> io::Result<()> {
        let mut out = io::BufWriter::with_capacity(CHUNK, out);
        let (d, m) = (&self.head, &self.head.matching);
        let mut b: Vec<u8> = Vec::with_capacity(CHUNK + 4096);
        let b = &mut b;
        member(b, b'{', 1, "schema", &d.schema)?;
        member(b, b',', 1, "before", &d.before)?;
        member(b, b',', 1, "after", &d.after)?;
        key(b, b',', 1, "matching");
        member(b, b'{', 2, "mode", &m.mode)?;
        member(b, b',', 2, "matched", &m.matched)?;
        member(b, b',', 2, "by_chain", &m.by_chain)?;
        member(b, b',', 2, "by_path", &m.by_path)?;
        member(b, b',', 2, "chains_by_opening", &m.chains_by_opening)?;
        key(b, b',', 2, "unmatched_before");
        array(b, &mut out, 3, self.unmatched(0))?;
        key(b, b',', 2, "unmatched_after");
        array(b, &mut out, 3, self.unmatched(1))?;
        json::newline(b, 1);
        b.push(b'}');
        member(b, b',', 1, "headline", &d.headline)?;
        member(b, b',', 1, "overall", &d.overall)?;
        member(b, b',', 1, "hops", &d.hops)?;
        key(b, b',', 1, "pairs");
        array(b, &mut out, 2, self.matches.iter().map(|m| self.pair(m)))?;
        member(b, b',', 1, "kernels", &d.kernels)?;
        member(b, b',', 1, "chains", &d.chains)?;
        b.extend_from_slice(b"\n}");
        out.write_all(b)?;
        out.flush()
    }

    /// The text `hopscope diff` prints: the same as [`render_text`] of
    /// [`Compared::into_diff`], making only the pairs and unmatched
    /// requests it lists.
    pub fn render_text(&self) -> String {
        let gen: Vec<(u32, f64)> = self
            .matches
            .iter()
            .enumerate()
            .filter_map(|(i, m)| {
                let x = match_figs(m, self.before, self.after);
                x.generation.then(|| (i as u32, x.e2e_ms.delta.unwrap_or(0.0).abs()))
            })
            .collect();
        let n_gen = gen.len();
        let shown: Vec<Pair> = text_pairs(gen, |x| x.1).iter().map(|&(i, _)| self.pair(&self.matches[i as usize])).collect();
        let unmatched = [UnmatchedText::of(self.unmatched(0)), UnmatchedText::of(self.unmatched(1))];
        render(&self.head, &shown.iter().collect::<Vec<_>>(), n_gen, self.matches.len() - n_gen, &unmatched)
    }
}

/// What the text shows of one side's unmatched requests: how many, how
/// many per method and path, and the first [`TEXT_UNMATCHED`].
struct UnmatchedText {
    count: usize,
    by_route: BTreeMap<String, usize>,
    first: Vec<Unmatched>,
}

/// How many unmatched requests of each side the text lists.
const TEXT_UNMATCHED: usize = 10;

impl UnmatchedText {
    fn of(all: impl Iterator<Item = Unmatched>) -> UnmatchedText {
        let mut t = UnmatchedText { count: 0, by_route: BTreeMap::new(), first: Vec::new() };
        for u in all {
            t.count += 1;
            *t.by_route.entry(format!("{} {}", u.method, u.path)).or_default() += 1;
            if t.first.len() < TEXT_UNMATCHED {
                t.first.push(u);
            }
        }
        t
    }
}

/// `1-3`, `2, 4` (consecutive runs collapsed).
fn ranges(v: &[u32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < v.len() {
        let mut j = i;
        while j + 1 < v.len() && v[j + 1] == v[j] + 1 {
            j += 1;
        }
        out.push(if j > i { format!("{}-{}", v[i], v[j]) } else { v[i].to_string() });
        i = j + 1;
    }
    out.join(", ")
}

/// The one line: TTFT when it carries at least half of the E2E change, else
/// E2E; the hops where it concentrates; dominant phase and cause.
/// `unmatched`: how many requests of BEFORE and of AFTER are unmatched.
fn headline(overall: &Aggregate, hops: &[Aggregate], m: &Matching, unmatched: [usize; 2], kernels: Option<&KernelDiff>) -> String {
    if overall.requests == 0 {
        return format!("no inference requests matched ({} matched in all, {} unmatched before, {} after)", m.matched, unmatched[0], unmatched[1]);
    }
    let (t, e) = (&overall.explain.ttft, &overall.explain.e2e);
    let use_ttft = match (t.delta_ms, e.delta_ms) {
        (Some(dt), Some(de)) => dt.abs() >= 0.5 * de.abs(),
        (Some(_), None) => true,
        _ => false,
    };
    let x = if use_ttft { t } else { e };
    let mut line = format!("mean over {} request{}", overall.requests, if overall.requests == 1 { "" } else { "s" });
    if let Some(d) = x.delta_ms.filter(|_| !x.unchanged && hops.len() > 1) {
        let per: Vec<(u32, f64)> = hops
            .iter()
            .filter_map(|h| {
                let ex = if use_ttft { &h.explain.ttft } else { &h.explain.e2e };
                Some((h.hop?, ex.delta_ms?))
            })
            .collect();
        let max = per.iter().map(|(_, v)| v * sign(d)).fold(0.0, f64::max);
        let hot: Vec<u32> = per.iter().filter(|(_, v)| v * sign(d) >= 0.25 * max && v * sign(d) > 0.0).map(|(h, _)| *h).collect();
        if !hot.is_empty() && hot.len() < per.len() {
            let _ = write!(line, ", mostly hop{} {}", if hot.len() == 1 { "" } else { "s" }, ranges(&hot));
        }
    }
    let _ = write!(line, ": {}", x.summary);
    if let Some(k) = kernels.and_then(|k| k.rows.first().filter(|r| r.delta_gpu_ms.abs() >= NOISE_MS).map(|r| (k, r))) {
        let _ = write!(line, "; GPU {:+.2} ms, most in {} ({:+.2} ms)", k.0.delta_gpu_ms, printable(&k.1.name), k.1.delta_gpu_ms);
        if k.1.name == GRAPH_LAUNCHES {
            line.push_str(" (CUDA graphs traced per launch: record with `--gpu-graphs node` to see the kernels inside)");
        }
    }
    if let Some(m) = &overall.models {
        let _ = write!(line, "; model changed in {} of {} pairs ({} → {})", m.changed, overall.requests, model_list(&m.before), model_list(&m.after));
    }
    line
}

/// `a ×3, b ×1` (at most three names, then how many more).
fn model_list(v: &[ModelCount]) -> String {
    let mut out: Vec<String> = v.iter().take(3).map(|m| format!("{} ×{}", m.model.as_deref().map_or_else(|| "none named".into(), printable), m.requests)).collect();
    if v.len() > 3 {
        out.push(format!("{} more", v.len() - 3));
    }
    out.join(", ")
}

// ---------------------------------------------------------------- kernels

/// GPU time by normalised kernel name; None when neither side has kernels.
/// Takes the report's `kernels` lists (name, count, gpu_ms).
pub fn compare_kernels(before: &[KernelOut], after: &[KernelOut]) -> Option<KernelDiff> {
    if before.is_empty() && after.is_empty() {
        return None;
    }
    #[derive(Default)]
    struct Acc {
        bc: u64,
        ac: u64,
        bms: f64,
        ams: f64,
        variants: Vec<String>,
    }
    let mut rows: BTreeMap<String, Acc> = BTreeMap::new();
    for (k, after_side) in before.iter().map(|k| (k, false)).chain(after.iter().map(|k| (k, true))) {
        let acc = rows.entry(normalize_kernel_name(&k.name)).or_default();
        if after_side {
            acc.ac += k.count;
            acc.ams += k.gpu_ms;
        } else {
            acc.bc += k.count;
            acc.bms += k.gpu_ms;
        }
        if !acc.variants.contains(&k.name) {
            acc.variants.push(k.name.clone());
        }
    }
    let before_gpu_ms: f64 = before.iter().map(|k| k.gpu_ms).sum();
    let after_gpu_ms: f64 = after.iter().map(|k| k.gpu_ms).sum();
    let total = after_gpu_ms - before_gpu_ms;
    let mut rows: Vec<KernelRow> = rows
        .into_iter()
        .map(|(name, mut acc)| {
            acc.variants.sort();
            let per = |ms: f64, n: u64| if n == 0 { 0.0 } else { ms / n as f64 };
            let (mb, ma) = (per(acc.bms, acc.bc), per(acc.ams, acc.ac));
            let delta = acc.ams - acc.bms;
            let per_call_ms = acc.bc as f64 * (ma - mb);
            let status = match (acc.bc > 0 || acc.bms > 0.0, acc.ac > 0 || acc.ams > 0.0) {
                (false, true) => "new",
                (true, false) => "gone",
                _ if acc.bc == acc.ac && delta.abs() < 1e-9 => "same",
                _ => "changed",
            };
            KernelRow {
                name,
                before_count: acc.bc,
                after_count: acc.ac,
                before_gpu_ms: acc.bms,
                after_gpu_ms: acc.ams,
                delta_gpu_ms: delta,
                per_call_ms,
                calls_ms: delta - per_call_ms,
                share: (total.abs() > 1e-12).then(|| delta / total),
                status,
                variants: acc.variants,
            }
        })
        .collect();
    rows.sort_by(|x, y| y.delta_gpu_ms.abs().total_cmp(&x.delta_gpu_ms.abs()).then_with(|| y.after_gpu_ms.total_cmp(&x.after_gpu_ms)).then_with(|| x.name.cmp(&y.name)));
    Some(KernelDiff {
        before_gpu_ms,
        after_gpu_ms,
        delta_gpu_ms: total,
        before_count: before.iter().map(|k| k.count).sum(),
        after_count: after.iter().map(|k| k.count).sum(),
        rows,
    })
}

/// Removes every balanced `open…close` group outside the others (nested
/// groups go with their parent), e.g. template arguments and parameter lists.
fn strip_groups(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut depth = 0usize;
    for c in s.chars() {
        match c {
            '<' | '(' | '[' | '{' => depth += 1,
            '>' | ')' | ']' | '}' if depth > 0 => depth -= 1,
            _ if depth == 0 => out.push(c),
            _ => {}
        }
    }
    out
}

/// The first top-level template argument of `name<…>`, if any.
fn first_template_arg(s: &str) -> Option<&str> {
    let open = s.find('<')?;
    let mut depth = 0usize;
    for (i, c) in s[open..].char_indices() {
        match c {
            '<' | '(' | '[' | '{' => depth += 1,
            '>' | ')' | ']' | '}' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return Some(&s[open + 1..open + i]);
                }
            }
            ',' if depth == 1 => return Some(&s[open + 1..open + i]),
            _ => {}
        }
    }
    None
}

/// Generic launch wrappers whose identity is their first template argument
/// (`cutlass::Kernel2<gemm…>`, `flash::device_kernel<flash::enable_sm90_or_later<FlashAttnFwdSm90<…>>>`).
fn is_wrapper(name: &str) -> bool {
    let last = name.rsplit("::").next().unwrap_or(name);
    last == "device_kernel"
        || last.starts_with("enable_sm")
        || last.strip_prefix("Kernel").is_some_and(|r| r.bytes().all(|b| b.is_ascii_digit()))
}

/// A token of `_`-separated name parts that encodes a configuration, not an identity.
fn is_config_token(t: &str) -> bool {
    if t.is_empty() {
        return true;
    }
    let b = t.as_bytes();
    // Numeric suffixes (`triton_poi_fused_add_0`).
    if b.iter().all(u8::is_ascii_digit) {
        return true;
    }
    // Tile/cluster shapes: `128x64`, `64x4`, `tilesize128x128x64`, `warpgroupsize1x1x1`, `5x`.
    let letters = b.iter().take_while(|c| c.is_ascii_alphabetic()).count();
    let dims = &t[letters..];
    if !dims.is_empty() && dims.as_bytes()[0].is_ascii_digit() && dims.contains('x') && dims.bytes().all(|c| c.is_ascii_digit() || c == b'x') {
        return true;
    }
    // Load width, pipeline stages, alignment, split-k: `ldg8`, `stages`, `stage3`, `align8`, `splitk4`.
    const KNOBS: &[&str] = &["ldg", "stage", "stages", "nstage", "align", "splitk", "swizzle", "unroll"];
    let (word, digits) = t.split_at(letters);
    if KNOBS.contains(&word) && !digits.is_empty() && digits.bytes().all(|c| c.is_ascii_digit()) {
        return true;
    }
    if t == "stages" || t == "f2f" {
        return true;
    }
    // Hashes: 8+ hex digits with both digits and letters (not dtype runs like `bf16bf16`).
    if t.len() >= 8
        && b.iter().all(u8::is_ascii_hexdigit)
        && b.iter().any(u8::is_ascii_digit)
        && b.iter().any(u8::is_ascii_alphabetic)
        && !["f16", "f32", "f64"].iter().any(|d| t.contains(d))
    {
        return true;
    }
    // Triton argument signatures: `0d1d2d3de4de`.
    is_triton_signature(t)
}

fn is_triton_signature(t: &str) -> bool {
    let b = t.as_bytes();
    let (mut i, mut groups) = (0, 0);
    while i < b.len() {
        let start = i;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        if i == start || i >= b.len() || b[i] != b'd' {
            return false;
        }
        i += 1;
        if i < b.len() && b[i] == b'e' {
            i += 1;
        }
        groups += 1;
    }
    groups >= 2
}

fn normalize_component(c: &str) -> String {
    let lead = c.len() - c.trim_start_matches('_').len();
    let kept: Vec<&str> = c[lead..].split('_').filter(|t| !is_config_token(t)).collect();
    if kept.is_empty() {
        return c.to_owned();
    }
    format!("{}{}", &c[..lead], kept.join("_"))
}

/// Outer name of an Itanium-mangled symbol (`_ZN4vllm30reshape_and_cache_flash_kernelI…`
/// → `vllm::reshape_and_cache_flash_kernel`), descending into the first
/// template argument of launch wrappers. None if it is not one.
fn demangle_outer(s: &str) -> Option<String> {
    fn source_name(s: &str) -> Option<(&str, &str)> {
        let digits = s.bytes().take_while(u8::is_ascii_digit).count();
        let n: usize = s[..digits].parse().ok()?;
        let rest = &s[digits..];
        (n > 0 && rest.len() >= n && rest.is_char_boundary(n)).then(|| (&rest[..n], &rest[n..]))
    }
    fn name(s: &str) -> Option<(Vec<String>, &str)> {
        let mut parts = Vec::new();
        if let Some(mut rest) = s.strip_prefix('N') {
            // CV-qualifiers of member functions.
            rest = rest.trim_start_matches(['K', 'V', 'r']);
            if let Some(r) = rest.strip_prefix("St") {
                parts.push("std".to_owned());
                rest = r;
            }
            while let Some((p, r)) = source_name(rest) {
                parts.push(p.to_owned());
                rest = r;
                if rest.starts_with('I') {
                    // Template args of an inner component: skip this nested
                    // name's tail rather than parse the args.
                    return Some((parts, rest));
                }
            }
            Some((parts, rest.strip_prefix('E').unwrap_or(rest)))
        } else {
            let s = s.strip_prefix("St").map_or(s, |r| {
                parts.push("std".to_owned());
                r
            });
            let (p, r) = source_name(s)?;
            parts.push(p.to_owned());
            Some((parts, r))
        }
    }
    let body = s.strip_prefix("_Z")?;
    let (parts, rest) = name(body)?;
    let joined = parts.join("::");
    if is_wrapper(&joined) {
        if let Some((inner, _)) = rest.strip_prefix('I').and_then(name) {
            let inner = inner.join("::");
            return Some(if is_wrapper(&inner) { demangle_outer(&format!("_Z{}", &rest[1..])).unwrap_or(inner) } else { inner });
        }
    }
    Some(joined)
}

/// One name per kernel, whatever its template arguments, parameter list,
/// tile configuration or numeric suffix: `void flash_fwd_kernel<Flash_fwd_kernel_traits<…>, true>(Flash_fwd_params)`
/// → `flash_fwd_kernel`; `ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn`
/// → `ampere_bf16_s16816gemm_bf16_tn`; `triton_poi_fused_add_0` → `triton_poi_fused_add`.
/// Namespaces stay. Generic launch wrappers (`cutlass::Kernel2<G>`,
/// `flash::device_kernel<…>`) are named by what they launch. CUDA graphs
/// traced per launch (`[CUDA graph N]`) are one row, [`GRAPH_LAUNCHES`]. Idempotent.
pub fn normalize_kernel_name(name: &str) -> String {
    let s = name.trim();
    // A graph's id is its process's creation count: two runs (or two
    // processes) number the same graph differently, so launches compare as one.
    if hopscope_gpu_wire::is_whole_graph_name(s) {
        return GRAPH_LAUNCHES.to_owned();
    }
    if let Some(d) = demangle_outer(s) {
        return normalize_kernel_name(&d);
    }
    let s = s.replace("(anonymous namespace)::", "").replace("{anonymous}::", "");
    let s = s.strip_prefix("void ").unwrap_or(&s).trim_start();
    let outer = strip_groups(s);
    let outer = outer.trim().trim_start_matches("void ").trim();
    // `name` is the last whitespace-separated word (drops return types and
    // trailing qualifiers such as ` const`, ` [clone .kd]`).
    let outer = outer.split_whitespace().rfind(|w| *w != "const" && *w != "volatile").unwrap_or(outer);
    if is_wrapper(outer) {
        if let Some(arg) = first_template_arg(s) {
            let inner = normalize_kernel_name(arg);
            if !inner.is_empty() && !inner.bytes().all(|b| b.is_ascii_digit()) {
                return inner;
            }
        }
    }
    let parts: Vec<String> = outer.split("::").map(str::to_owned).collect();
    let Some((last, ns)) = parts.split_last() else { return outer.to_owned() };
    let mut out = ns.join("::");
    if !out.is_empty() {
        out.push_str("::");
    }
    out.push_str(&normalize_component(last));
    let out = out.trim_end_matches('_');
    // A name that is all brackets (`[…]`) has nothing left to normalise.
    if out.is_empty() { s.to_owned() } else { out.to_owned() }
}

/// The row of CUDA graphs traced per launch (`[CUDA graph N]`, any N).
pub const GRAPH_LAUNCHES: &str = "[CUDA graph]";

// ---------------------------------------------------------------- text

fn f(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{x:.2}"))
}

fn fd(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{x:+.2}"))
}

fn ft(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), tok)
}


/// Pairs shown one by one in the text (the JSON has them all).
const TEXT_PAIRS: usize = 30;

/// The inference pairs the text lists: all of `gen` when they are at most
/// [`TEXT_PAIRS`], else the [`TEXT_PAIRS`] with the biggest |ΔE2E| (ties
/// in their order). One rule for the whole diff and the streamed one.
fn text_pairs<T>(mut gen: Vec<T>, abs_e2e: impl Fn(&T) -> f64) -> Vec<T> {
    if gen.len() > TEXT_PAIRS {
        gen.sort_by(|x, y| abs_e2e(y).total_cmp(&abs_e2e(x)));
        gen.truncate(TEXT_PAIRS);
    }
    gen
}

/// The human diff: headline, what changed (biggest first), per hop, per
/// request, GPU kernels when present, what did not match.
pub fn render_text(d: &Diff) -> String {
    let gen: Vec<&Pair> = d.pairs.iter().filter(|p| p.generation).collect();
    let n_gen = gen.len();
    let shown = text_pairs(gen, |p| p.e2e_ms.delta.unwrap_or(0.0).abs());
    let m = &d.matching;
    let unmatched = [UnmatchedText::of(m.unmatched_before.iter().cloned()), UnmatchedText::of(m.unmatched_after.iter().cloned())];
    render(d, &shown, n_gen, d.pairs.len() - n_gen, &unmatched)
}

/// The text of `d` but its pairs: `shown` are the pairs listed (the
/// [`TEXT_PAIRS`] biggest |ΔE2E| of the `gen` inference pairs), `other` the
/// matched requests without inference, `unmatched` BEFORE's and AFTER's
/// unmatched requests.
fn render(d: &Diff, shown: &[&Pair], gen: usize, other: usize, unmatched: &[UnmatchedText; 2]) -> String {
    let mut s = String::new();
    let side = |x: &SideInfo| format!("{} ({} requests, {} chains)", x.path, x.requests, x.chains);
    let _ = writeln!(s, "before  {}", side(&d.before));
    let _ = writeln!(s, "after   {}", side(&d.after));
    for (w, x) in [("BEFORE", &d.before), ("AFTER", &d.after)] {
        if let Some(e) = &x.read_error {
            let _ = writeln!(s, "WARNING: {w} ends early: {e} (the diff covers what precedes it)");
        }
        if !x.losses.is_empty() {
            let l: Vec<String> = x.losses.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let _ = writeln!(s, "WARNING: {w} lost data its figures may lack: {} (`hopscope report {}` says what each means and what to do)", l.join(" "), x.path);
        }
    }
    if let (Some(b), Some(a)) = (d.before.gpu_graphs, d.after.gpu_graphs) {
        if b != a {
            let per = |m: &str| if m == "mixed" { "per node in some processes and per launch in others".to_owned() } else { format!("per {m}") };
            let _ = writeln!(s, "WARNING: BEFORE traced CUDA graphs {}, AFTER {}: GPU time inside graphs compares, their kernels do not (record both with the same `--gpu-graphs`)", per(b), per(a));
        }
    }
    let m = &d.matching;
    let _ = writeln!(
        s,
        "matched {} requests ({} by chain{} {} by path and prompt size); unmatched: {} before, {} after",
        m.matched,
        m.by_chain,
        match m.chains_by_opening {
            0 => " position,".to_owned(),
            1 => ": 1 chain paired by its first prompt, any other by position;".to_owned(),
            k => format!(": {k} chains paired by their first prompt, any other by position;"),
        },
        m.by_path,
        unmatched[0].count,
        unmatched[1].count
    );
    let _ = writeln!(s, "\n{}", d.headline);

    let o = &d.overall;
    if o.requests > 0 {
        let _ = writeln!(s, "\noverall ({} inference requests)        before     after     delta", o.requests);
        for (name, st) in [("ttft_ms", &o.ttft_ms), ("e2e_ms", &o.e2e_ms), ("itl_mean_ms", &o.itl_mean_ms), ("itl_p90_ms", &o.itl_p90_ms)] {
            for (stat, x) in [("mean", st.mean), ("p50", st.p50), ("p90", st.p90)] {
                let _ = writeln!(s, "  {:<12} {:<4}               {:>9} {:>9} {:>9}", name, stat, f(x.before), f(x.after), fd(x.delta));
            }
        }
        let _ = writeln!(s, "\nwhat changed (mean per request, biggest first)");
        let _ = writeln!(s, "  {:<14} {:>9} {:>9} {:>9} {:>8} {:>8}", "phase", "before", "after", "delta", "of ΔTTFT", "of ΔE2E");
        let ph = o.phases_ms.as_array();
        let share = |ex: &Explanation, p: &str| ex.contributions.iter().find(|c| c.phase == p).and_then(|c| c.share).map_or("-".into(), |x| format!("{:.0}%", x * 100.0));
        for c in &o.explain.e2e.contributions {
            let i = PHASES.iter().position(|p| *p == c.phase).unwrap_or(0);
            let _ = writeln!(
                s,
                "  {:<14} {:>9} {:>9} {:>9} {:>8} {:>8}",
                c.phase,
                f(ph[i].before),
                f(ph[i].after),
                fd(ph[i].delta),
                if i < TTFT_PHASES { share(&o.explain.ttft, c.phase) } else { "-".into() },
                share(&o.explain.e2e, c.phase)
            );
            // The queue's part in the engine scheduler's own queue (the rest:
            // before the engine took the requests in).
            let sq = &o.scheduler_queue_ms;
            if c.phase == "queue" && o.scheduler_queue_covers && sq.delta.is_some() {
                let _ = writeln!(s, "  {:<14} {:>9} {:>9} {:>9} {:>8} {:>8}", "  in scheduler", f(sq.before), f(sq.after), fd(sq.delta), "-", "-");
            }
        }
        for ex in [&o.explain.ttft, &o.explain.e2e] {
            let _ = writeln!(s, "  Σ phases {:+.3} ms = Δ{} {} ms (unexplained {})", ex.sum_of_phases_ms.unwrap_or(0.0), ex.metric.to_ascii_uppercase(), fd(ex.delta_ms), fd(ex.unexplained_ms));
        }
        if let Some(sp) = o.decode_split_ms {
            let _ = writeln!(s, "  decode = gaps longer {:+.2} + more gaps {:+.2} + stream end {:+.2} ms", sp.itl_rate_ms, sp.token_count_ms, sp.tail_ms);
        }
        let t = &o.tokens;
        let _ = writeln!(
            s,
            "  tokens (mean): prompt {}, cached {}, computed {}, completion {}; steps {}, preemptions {}, interference {} ms",
            ft(t.prompt.delta),
            ft(t.cached.delta),
            ft(t.computed.delta),
            ft(t.completion.delta),
            ft(o.steps.delta),
            ft(o.preemptions.delta),
            fd(o.interference_ms.delta)
        );
        for ex in [&o.explain.ttft, &o.explain.e2e] {
            for c in &ex.causes {
                let _ = writeln!(s, "  cause ({}, {}): {} — {}", ex.metric, c.phase, c.cause, c.detail);
            }
        }
    }

    if let Some(c) = d.chains.as_ref().filter(|c| c.chains > 0) {
        let _ = writeln!(
            s,
            "\nchains ({} matched by {}, means): E2E {} → {} ms ({}) = hops {} ms + between hops (the client's own time) {} ms",
            c.chains,
            if d.matching.chains_by_opening == 0 { "position" } else { "first prompt, else position" },
            f(c.e2e_ms.before),
            f(c.e2e_ms.after),
            fd(c.e2e_ms.delta),
            fd(c.hops_e2e_ms.delta),
            fd(c.between_hops_ms.delta)
        );
    }

    if !d.hops.is_empty() {
        let _ = writeln!(s, "\nper hop (chain-matched, means)");
        let _ = writeln!(
            s,
            "  {:>3} {:>3} {:>9} {:>9} {:>8} {:>8} {:>7} {:>7} {:>8} {:>7} {:>7} {:>8} {:>7} {:>7} {:>7}  dominant (ttft) / cause",
            "hop", "n", "ttft_bef", "ttft_aft", "Δttft", "Δe2e", "Δfront", "Δqueue", "Δprefill", "Δ1st", "Δdecode", "Δitl_avg", "Δcached", "Δcomp", "Δout"
        );
        for h in &d.hops {
            let p = &h.phases_ms;
            let ex = &h.explain.ttft;
            let why = match (ex.dominant_phase, ex.causes.first()) {
                _ if ex.unchanged => "unchanged".to_owned(),
                (Some(dp), Some(c)) => format!("{dp} / {}", c.cause),
                (Some(dp), None) => dp.to_owned(),
                _ => "-".to_owned(),
            };
            let _ = writeln!(
                s,
                "  {:>3} {:>3} {:>9} {:>9} {:>8} {:>8} {:>7} {:>7} {:>8} {:>7} {:>7} {:>8} {:>7} {:>7} {:>7}  {}",
                h.hop.unwrap_or(0),
                h.requests,
                f(h.ttft_ms.mean.before),
                f(h.ttft_ms.mean.after),
                fd(h.ttft_ms.mean.delta),
                fd(h.e2e_ms.mean.delta),
                fd(p.frontend.delta),
                fd(p.queue.delta),
                fd(p.prefill.delta),
                fd(p.first_output.delta),
                fd(p.decode.delta),
                fd(h.itl_mean_ms.mean.delta),
                ft(h.tokens.cached.delta),
                ft(h.tokens.computed.delta),
                ft(h.tokens.completion.delta),
                why
            );
        }
    }

    let hop_kernels: Vec<(u32, &RequestKernels)> = d.hops.iter().filter_map(|h| Some((h.hop?, h.kernels.as_ref()?))).collect();
    if !hop_kernels.is_empty() {
        let _ = writeln!(s, "\nper hop GPU kernels (means per request of each request's top {} kernels, normalised names)", crate::correlate::gpu::KERNELS_PER_REQUEST);
        let _ = writeln!(s, "  {:>3} {:>3} {:>9} {:>9} {:>9}  biggest changes (ms)", "hop", "n", "gpu_bef", "gpu_aft", "Δgpu");
        for (hop, k) in hop_kernels {
            let moved: Vec<String> = k.rows.iter().filter(|r| r.delta_gpu_ms.abs() >= NOISE_MS).take(TEXT_HOP_KERNELS).map(|r| format!("{} {:+.3}", trunc(&r.name, 48), r.delta_gpu_ms)).collect();
            let _ = writeln!(
                s,
                "  {:>3} {:>3} {:>9.3} {:>9.3} {:>+9.3}  {}",
                hop,
                k.requests,
                k.before_gpu_ms,
                k.after_gpu_ms,
                k.delta_gpu_ms,
                if moved.is_empty() { format!("none moved {NOISE_MS} ms or more") } else { moved.join(", ") }
            );
        }
    }

    let hop_models: Vec<(u32, &ModelsUsed)> = d.hops.iter().filter_map(|h| Some((h.hop?, h.models.as_ref()?))).collect();
    if !hop_models.is_empty() {
        let _ = writeln!(s, "\nper hop models (where a pair's two requests named different ones)");
        for (hop, m) in hop_models {
            let _ = writeln!(s, "  hop {hop}: {} of its pairs: {} → {}", m.changed, model_list(&m.before), model_list(&m.after));
        }
    }

    if gen > 0 {
        let note = if gen > TEXT_PAIRS {
            format!(", the {TEXT_PAIRS} biggest |ΔE2E| of {gen}")
        } else {
            String::new()
        };
        let _ = writeln!(s, "\nper request{note}");
        let _ = writeln!(
            s,
            "  {:<30} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>7} {:>7}  summary",
            "pair", "ttft_bef", "ttft_aft", "Δttft", "Δe2e", "Δprefill", "Δdecode", "Δcached", "Δout"
        );
        for p in shown {
            let _ = writeln!(
                s,
                "  {:<30} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>7} {:>7}  {}",
                trunc(&p.key, 30),
                f(p.ttft_ms.before),
                f(p.ttft_ms.after),
                fd(p.ttft_ms.delta),
                fd(p.e2e_ms.delta),
                fd(p.phases_ms.prefill.delta),
                fd(p.phases_ms.decode.delta),
                p.tokens.cached.delta.map_or("-".into(), |x| format!("{x:+}")),
                p.tokens.completion.delta.map_or("-".into(), |x| format!("{x:+}")),
                p.explain.ttft.summary
            );
        }
    }
    if other > 0 {
        let _ = writeln!(s, "  (+{other} other matched requests without inference, e.g. health checks: in --json)");
    }

    if let Some(k) = &d.kernels {
        let _ = writeln!(
            s,
            "\nGPU kernels (normalised names): {:.2} → {:.2} ms ({:+.2} ms), {} → {} launches",
            k.before_gpu_ms, k.after_gpu_ms, k.delta_gpu_ms, k.before_count, k.after_count
        );
        let _ = writeln!(s, "  {:<48} {:>8} {:>8} {:>10} {:>10} {:>9} {:>9} {:>9} {:>6}  status", "kernel", "n_bef", "n_aft", "ms_bef", "ms_aft", "Δms", "per_call", "calls", "share");
        for r in k.rows.iter().take(20) {
            let _ = writeln!(
                s,
                "  {:<48} {:>8} {:>8} {:>10.3} {:>10.3} {:>+9.3} {:>+9.3} {:>+9.3} {:>6}  {}{}",
                trunc(&r.name, 48),
                r.before_count,
                r.after_count,
                r.before_gpu_ms,
                r.after_gpu_ms,
                r.delta_gpu_ms,
                r.per_call_ms,
                r.calls_ms,
                r.share.map_or("-".into(), |x| format!("{:.0}%", x * 100.0)),
                r.status,
                if r.variants.len() > 1 { format!(" ({} variants)", r.variants.len()) } else { String::new() }
            );
        }
        if k.rows.len() > 20 {
            let _ = writeln!(s, "  … {} more in --json", k.rows.len() - 20);
        }
    }

    for (w, v) in [("BEFORE", &unmatched[0]), ("AFTER", &unmatched[1])] {
        if v.count == 0 {
            continue;
        }
        let list: Vec<String> = v.by_route.iter().map(|(k, n)| format!("{k} ×{n}")).collect();
        let _ = writeln!(s, "\nunmatched in {w}: {}", list.join(", "));
        for u in &v.first {
            let _ = writeln!(s, "  {:<34} {}", trunc(&u.id, 34), u.reason);
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::correlate::engine::EnginePhases;
    use crate::correlate::{Analysis, Chain, ChainSource, Request};
    use crate::event::ConnKey;
    use crate::model::Usage;
    use crate::recording::Meta;
    use crate::sink::report;

    const MS: u64 = 1_000_000;

    /// Phase lengths of a synthetic request (whole ms so everything adds up exactly).
    #[derive(Clone, Copy)]
    struct Shape {
        frontend: u64,
        queue: u64,
        prefill: u64,
        first_output: u64,
        /// Content chunks after the first, `itl` ms apart; then `tail` ms to done.
        gaps: u64,
        itl: u64,
        tail: u64,
        prompt: u64,
        cached: u64,
        completion: u64,
        /// The engine's QUEUED stamp this many ms into the queue (the way
        /// in); none sent when None.
        intake: Option<u64>,
        /// Its structured-output kind.
        structured: Option<&'static str>,
        /// A later request went past it this many ms after its QUEUED stamp.
        passed: Option<u64>,
        /// Its grammar known ready this many ms after its QUEUED stamp.
        ready: Option<u64>,
        /// Of `first_output`, ms the engine went on decoding before the
        /// first content (a token a ms).
        held: u64,
    }

    const BASE: Shape = Shape { frontend: 2, queue: 1, prefill: 10, first_output: 1, gaps: 4, itl: 5, tail: 1, prompt: 400, cached: 0, completion: 5, intake: None, structured: None, passed: None, ready: None, held: 0 };

    fn request(i: usize, at: u64, chain: &str, source: ChainSource, s: Shape) -> Request {
        let submit = at + s.frontend * MS;
        let scheduled = submit + s.queue * MS;
        let first_token = scheduled + s.prefill * MS;
        let ttft = first_token + s.first_output * MS;
        let content_ns: Vec<u64> = (0..=s.gaps).map(|k| ttft + k * s.itl * MS).collect();
        let done = content_ns.last().unwrap() + s.tail * MS;
        Request {
            conn: ConnKey { tgid: 1, fd: 10 + i as i32, ino: i as u64 },
            seq: 0,
            id: format!("chatcmpl-{chain}-{i}"),
            x_request_id: None,
            traceparent: None,
            chain: chain.to_owned(),
            chain_source: source,
            hop: 0,
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            model: Some("m".into()),
            status: Some(200),
            arrive_ns: at,
            wire_arrive_ns: None,
            request_end_ns: at,
            response_head_ns: Some(at),
            ttft_ns: Some(ttft),
            done_ns: Some(done),
            response_end_ns: Some(done),
            closed_ns: None,
            content_ns,
            request_bytes: 100 + s.prompt,
            response_bytes: Some(1000),
            streamed: true,
            usage: Usage { prompt_tokens: Some(s.prompt), completion_tokens: Some(s.completion), cached_tokens: Some(s.cached) },
            finish_reason: Some("length".into()),
            engine: Some(EnginePhases {
                engine_request_id: format!("chatcmpl-{chain}-{i}-0123abcd"),
                submit_ns: submit,
                queued_ns: s.intake.map(|x| submit + x * MS),
                scheduled_ns: Some(scheduled),
                first_token_ns: Some(first_token),
                last_output_ns: None,
                steps: s.completion as u32,
                preemptions: 0,
                prompt_tokens: Some(s.prompt),
                cached_tokens: Some(s.cached),
                computed_tokens: Some(s.prompt - s.cached),
                generated_tokens: s.completion,
                tokens_before_first_content: Some(1 + s.held),
                first_content_output_ns: Some(first_token + s.held * MS),
                interference_ns: 0,
                interference_from: vec![],
                engine_index: Some(0),
                structured: s.structured.map(|kind| crate::correlate::engine::StructuredOutput { kind, backend: Some("xgrammar".into()) }),
                passed_over_by: s.intake.map(|_| u32::from(s.passed.is_some())),
                passed_over_until_ns: s.intake.zip(s.passed).map(|(x, p)| submit + (x + p) * MS),
                priority: None,
                grammar_ready_by_ns: s.intake.zip(s.ready).map(|(x, g)| submit + (x + g) * MS),
                scheduled_source: "event",
                submit_source: "wake",
            }),
            wire_steps: None,
            gpu: None,
            compute: None,
            kernels: None,
            previous_response_id: None,
            id_from_response: true,
            empty_chunks_before_content: 0,
        }
    }

    /// Requests grouped into chains the way the correlator does (hop = arrival order).
    fn analysis(mut requests: Vec<Request>) -> Analysis {
        requests.sort_by_key(|r| r.arrive_ns);
        let mut chains: Vec<Chain> = Vec::new();
        for (i, r) in requests.iter().enumerate() {
            match chains.iter_mut().find(|c| c.chain == r.chain) {
                Some(c) => c.hops.push(i),
                None => chains.push(Chain { chain: r.chain.clone(), source: r.chain_source, hops: vec![i] }),
            }
        }
        for c in &chains {
            for (n, &i) in c.hops.iter().enumerate() {
                requests[i].hop = n as u32 + 1;
            }
        }
        Analysis { requests, chains, ..Analysis::default() }
    }

    fn rep(name: &str, a: &Analysis) -> Report {
        let meta = Meta {
            format_version: 1,
            hopscope_version: "test".into(),
            created_unix_s: 0,
            start_ns: 0,
            start_unix_ns: 0,
            pids: vec![1],
            command: vec![],
            kernel: "test".into(),
            hostname: "test".into(),
            chain_header: "x-session-id".into(),
            capture_len: 4096,
            capture_len_unix: 32768,
            capture_tail_unix: 4096,
            capture_tail: 16384,
            capture_payload: false,
            gpu: false,
            missing_tracepoints: vec![],
            segment: None,
        };
        report::build(name, &meta, a, None)
    }

    /// A 3-hop chain; `hop` gives each hop's shape.
    fn chain(name: &str, start: u64, hop: impl Fn(u32) -> Shape) -> Vec<Request> {
        (1..=3).map(|h| request(h as usize, start + u64::from(h) * 1000 * MS, name, ChainSource::Header, hop(h))).collect()
    }

    /// BEFORE: the prefix cache serves all but 100 tokens of hops 2-3. AFTER:
    /// nothing is cached, so prefill computes everything (0.05 ms per token).
    fn cache_lost() -> Diff {
        let before = chain("s-before", 0, |h| if h == 1 { BASE } else { Shape { prompt: 400 * u64::from(h), cached: 400 * u64::from(h) - 100, prefill: 5, ..BASE } });
        let after = chain("s-after", 0, |h| if h == 1 { BASE } else { Shape { prompt: 400 * u64::from(h), cached: 0, prefill: 20 * u64::from(h), ..BASE } });
        compare(&rep("before.hop", &analysis(before)), &rep("after.hop", &analysis(after)))
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    /// The agent took longer between its calls, the server was as fast: the
    /// chains' E2E change is all between hops, none in the hops.
    #[test]
    fn a_chains_change_splits_into_its_hops_and_the_clients_time_between_them() {
        let spaced = |name: &str, gap_ms: u64| -> Vec<Request> { (1..=3u64).map(|h| request(h as usize, h * gap_ms * MS, name, ChainSource::Header, BASE)).collect() };
        let d = compare(&rep("b", &analysis(spaced("s-b", 1000))), &rep("a", &analysis(spaced("s-a", 1500))));
        let c = d.chains.as_ref().expect("both sides have explicit chains");
        assert_eq!(c.chains, 1);
        assert!(close(c.e2e_ms.delta.unwrap(), 1000.0) && close(c.hops_e2e_ms.delta.unwrap(), 0.0) && close(c.between_hops_ms.delta.unwrap(), 1000.0), "{c:?}");
        assert!(close(c.e2e_ms.delta.unwrap(), c.hops_e2e_ms.delta.unwrap() + c.between_hops_ms.delta.unwrap()));
        let text = render_text(&d);
        assert!(text.contains("chains (1 matched by first prompt, else position, means): E2E 2035.00 → 3035.00 ms (+1000.00) = hops +0.00 ms + between hops (the client's own time) +1000.00 ms"), "{text}");
        // Without explicit chains there is nothing to say about chains.
        let conn = |i| request(i, i as u64 * 100 * MS, &format!("conn:{i}"), ChainSource::Connection, BASE);
        assert_eq!(compare(&rep("b", &analysis(vec![conn(1)])), &rep("a", &analysis(vec![conn(2)]))).chains, None);
    }

    /// A side that lost data says so in the text and the JSON; activity
    /// and zeros are not losses.
    #[test]
    fn a_recording_that_lost_data_is_named_with_its_losses() {
        let before = rep("before.hop", &analysis(chain("s-b", 0, |_| BASE)));
        let mut after = rep("after.hop", &analysis(chain("s-a", 0, |_| BASE)));
        after.recording.drops = [("kernel_ringbuf_full", 12), ("kernel_events", 900), ("sse_without_request", 0), ("kernel_truncated", 3)].map(|(k, v)| (k.to_owned(), v)).into();
        let d = compare(&before, &after);
        assert!(d.before.losses.is_empty());
        assert_eq!(d.after.losses, [("kernel_ringbuf_full".to_owned(), 12)].into());
        let text = render_text(&d);
        assert!(text.contains("WARNING: AFTER lost data its figures may lack: kernel_ringbuf_full=12 (`hopscope report after.hop`"), "{text}");
        assert!(!text.contains("WARNING: BEFORE"), "{text}");
        let v = serde_json::to_value(&d).expect("json");
        assert_eq!(v["after"]["losses"], serde_json::json!({ "kernel_ringbuf_full": 12 }));
        assert_eq!(v["before"]["losses"], serde_json::json!({}));
    }

    #[test]
    fn chains_with_explicit_keys_match_by_position_and_hop_even_when_keys_differ() {
        let d = cache_lost();
        assert_eq!(d.matching.mode, "chain");
        assert_eq!((d.matching.matched, d.matching.by_chain, d.matching.by_path), (3, 3, 0));
        let keys: Vec<&str> = d.pairs.iter().map(|p| p.key.as_str()).collect();
        assert_eq!(keys, ["chain 1 hop 1", "chain 1 hop 2", "chain 1 hop 3"]);
        assert_eq!(d.pairs[1].before_id, "chatcmpl-s-before-2");
        assert_eq!(d.pairs[1].after_id, "chatcmpl-s-after-2");
        assert!(d.matching.unmatched_before.is_empty() && d.matching.unmatched_after.is_empty());
    }

    /// A rerun of the same two agents that started the other way round: each
    /// chain is compared with the one that opened with its prompt, not with
    /// the one that came at its place; agents whose first prompts changed
    /// pair by arrival, as before.
    #[test]
    fn chains_that_opened_with_the_same_prompt_pair_whichever_started_first() {
        let agent = |name: &str, start: u64, prompt: u64, prefill: u64| chain(name, start, move |h| Shape { prompt: prompt + 100 * u64::from(h), prefill, ..BASE });
        let side = |first: (&str, u64, u64), second: (&str, u64, u64)| {
            let mut v = agent(first.0, 0, first.1, first.2);
            v.extend(agent(second.0, 300 * MS, second.1, second.2));
            v
        };
        // BEFORE: the short-prompt agent first; AFTER: the long one first,
        // and every prefill of the short one 30 ms slower.
        let before = side(("short-b", 400, 10), ("long-b", 2000, 10));
        let after = side(("long-a", 2000, 10), ("short-a", 400, 40));
        let d = compare(&rep("before.hop", &analysis(before)), &rep("after.hop", &analysis(after)));
        assert_eq!((d.matching.by_chain, d.matching.chains_by_opening), (6, 2), "{:?}", d.matching);
        for p in &d.pairs {
            let (b, a) = (p.before_id.trim_start_matches("chatcmpl-"), p.after_id.trim_start_matches("chatcmpl-"));
            assert_eq!(b.split('-').next(), a.split('-').next(), "{} with {}", p.before_id, p.after_id);
            assert!(close(p.phases_ms.prefill.delta.unwrap(), if b.starts_with("short") { 30.0 } else { 0.0 }), "{p:?}");
        }
        assert!(d.pairs.iter().take(3).all(|p| p.key.starts_with("chain 1 ") && p.before_id.contains("short")), "chain 1 is BEFORE's first: {:?}", d.pairs);
        assert!(render_text(&d).contains("matched 6 requests (6 by chain: 2 chains paired by their first prompt, any other by position; 0 by path and prompt size)"), "{}", render_text(&d));
        let c = d.chains.as_ref().expect("chains");
        assert_eq!(c.chains, 2);
        // Prompts that changed (a longer system prompt after): no chain
        // opens as one before did; by arrival, as ever.
        let after = side(("long-a", 2050, 10), ("short-a", 450, 40));
        let d = compare(&rep("before.hop", &analysis(side(("short-b", 400, 10), ("long-b", 2000, 10)))), &rep("after.hop", &analysis(after)));
        assert_eq!((d.matching.by_chain, d.matching.chains_by_opening), (6, 0));
        assert!(d.pairs[0].before_id.contains("short") && d.pairs[0].after_id.contains("long"), "{:?}", d.pairs[0]);
        assert!(render_text(&d).contains("(6 by chain position, 0 by path"), "{}", render_text(&d));
    }

    #[test]
    fn lost_prefix_cache_names_prefill_and_fewer_cached_tokens_for_the_later_hops() {
        let d = cache_lost();
        let h1 = &d.hops[0];
        assert!(h1.explain.ttft.unchanged, "hop 1 is the same: {}", h1.explain.ttft.summary);
        assert!(h1.explain.ttft.causes.is_empty());
        for (h, want) in [(&d.hops[1], 35.0), (&d.hops[2], 55.0)] {
            let ex = &h.explain.ttft;
            assert_eq!(ex.delta_ms, Some(want), "hop {:?}", h.hop);
            assert_eq!(ex.dominant_phase, Some("prefill"));
            assert_eq!(ex.causes[0].cause, "fewer_cached_tokens", "{:?}", ex.causes);
            assert!(close(ex.contributions[0].share.unwrap(), 1.0));
            assert!(ex.summary.contains("cached -"), "{}", ex.summary);
        }
        assert_eq!(d.hops[1].tokens.cached.delta, Some(-700.0));
        assert_eq!(d.hops[1].tokens.computed.delta, Some(700.0));
        assert!(d.headline.contains("prefill") && d.headline.contains("prefix-cache hits fell"), "{}", d.headline);
        assert!(d.headline.starts_with("mean over 3 requests, mostly hops 2-3: TTFT +30.00 ms"), "{}", d.headline);
    }

    #[test]
    fn phase_deltas_add_up_to_the_e2e_and_ttft_deltas_per_pair_per_hop_and_overall() {
        let d = cache_lost();
        let check = |p: &PhaseDeltas, ttft: Option<f64>, e2e: Option<f64>, what: &str| {
            let a = p.as_array();
            let all: f64 = a.iter().filter_map(|x| x.delta).sum();
            let pre: f64 = a[..TTFT_PHASES].iter().filter_map(|x| x.delta).sum();
            assert!(close(all, e2e.unwrap()), "{what}: Σ {all} vs ΔE2E {e2e:?}");
            assert!(close(pre, ttft.unwrap()), "{what}: Σ {pre} vs ΔTTFT {ttft:?}");
        };
        for p in &d.pairs {
            check(&p.phases_ms, p.ttft_ms.delta, p.e2e_ms.delta, &p.key);
            assert!(p.explain.e2e.unexplained_ms.unwrap().abs() < 1e-9);
        }
        for h in d.hops.iter().chain([&d.overall]) {
            check(&h.phases_ms, h.ttft_ms.mean.delta, h.e2e_ms.mean.delta, &format!("{:?}", h.hop));
        }
        assert!(close(d.overall.e2e_ms.mean.delta.unwrap(), (35.0 + 55.0) / 3.0));
        assert_eq!(d.pairs[2].phases_ms.kv_transfer.delta, None, "kv_transfer unknown stays null");
    }

    /// A hop whose client left after `after`'s queue grew: no E2E, so its
    /// phases (of the wait) explain nothing; the other hops' still add up.
    #[test]
    fn a_hop_closed_early_brings_no_phases_to_the_diff() {
        let before = chain("a", 0, |_| BASE);
        let mut after = chain("b", 0, |_| Shape { queue: BASE.queue + 30, ..BASE });
        let r = &mut after[1];
        r.closed_ns = Some(r.arrive_ns + 20 * MS);
        (r.done_ns, r.response_end_ns, r.ttft_ns) = (None, None, None);
        r.content_ns.clear();
        let d = compare(&rep("b", &analysis(before)), &rep("a", &analysis(after)));
        let closed = &d.pairs[1];
        assert_eq!(closed.e2e_ms.delta, None);
        assert!(closed.phases_ms.as_array().iter().all(|x| x.delta.is_none()), "{:?}", closed.phases_ms);
        for p in [&d.pairs[0], &d.pairs[2]] {
            let all: f64 = p.phases_ms.as_array().iter().filter_map(|x| x.delta).sum();
            assert!(close(all, p.e2e_ms.delta.unwrap()), "{}: Σ {all}", p.key);
        }
    }

    #[test]
    fn overall_percentiles_compare_each_side_s_own_percentile() {
        let d = cache_lost();
        // TTFT before: 14, 9, 9; after: 14, 44, 64.
        assert_eq!(d.overall.ttft_ms.p50, Delta { before: Some(9.0), after: Some(44.0), delta: Some(35.0) });
        assert!(close(d.overall.ttft_ms.p90.after.unwrap(), 60.0));
        assert!(close(d.overall.ttft_ms.mean.before.unwrap(), 32.0 / 3.0));
    }

    #[test]
    fn slower_inter_token_gaps_are_a_decode_cause_split_exactly() {
        let before = chain("a", 0, |_| BASE);
        let after = chain("b", 0, |_| Shape { itl: 8, ..BASE });
        let d = compare(&rep("b", &analysis(before)), &rep("a", &analysis(after)));
        let p = &d.pairs[0];
        assert_eq!(p.itl_mean_ms.delta, Some(3.0));
        let sp = p.decode_split_ms.unwrap();
        assert!(close(sp.itl_rate_ms, 12.0) && close(sp.token_count_ms, 0.0) && close(sp.tail_ms, 0.0));
        let e2e = &p.explain.e2e;
        assert_eq!(e2e.dominant_phase, Some("decode"));
        assert_eq!(e2e.causes[0].cause, "slower_decode_steps");
        assert!(p.explain.ttft.unchanged);
        assert!(d.headline.contains("E2E +12.00 ms"), "E2E, not TTFT, leads when TTFT did not move: {}", d.headline);
    }

    #[test]
    fn more_output_tokens_are_told_apart_from_slower_steps() {
        let before = chain("a", 0, |_| BASE);
        let after = chain("b", 0, |_| Shape { gaps: 9, completion: 10, ..BASE });
        let d = compare(&rep("b", &analysis(before)), &rep("a", &analysis(after)));
        let sp = d.pairs[0].decode_split_ms.unwrap();
        assert!(close(sp.token_count_ms, 25.0) && close(sp.itl_rate_ms, 0.0));
        assert_eq!(d.pairs[0].explain.e2e.causes[0].cause, "more_output_tokens");
        assert_eq!(d.pairs[0].tokens.completion.delta, Some(5));
    }

    #[test]
    fn the_same_tokens_in_more_chunks_is_the_streaming_not_more_output() {
        let before = chain("a", 0, |_| BASE);
        let after = chain("b", 0, |_| Shape { gaps: 9, ..BASE });
        let d = compare(&rep("b", &analysis(before)), &rep("a", &analysis(after)));
        let p = &d.pairs[0];
        assert_eq!(p.tokens.completion.delta, Some(0));
        assert!(close(p.decode_split_ms.unwrap().token_count_ms, 25.0));
        let c = &p.explain.e2e.causes[0];
        assert_eq!(c.cause, "more_stream_chunks");
        assert!(c.detail.starts_with("completion +0 tokens in more content chunks"), "{}", c.detail);
        // And the other way round: fewer chunks for the same tokens.
        let d = compare(&rep("a", &analysis(chain("a", 0, |_| Shape { gaps: 9, ..BASE }))), &rep("b", &analysis(chain("b", 0, |_| BASE))));
        assert_eq!(d.pairs[0].explain.e2e.causes[0].cause, "fewer_stream_chunks");
    }

    #[test]
    fn queueing_and_a_faster_phase_are_both_visible_and_still_add_up() {
        let before = chain("a", 0, |_| BASE);
        let after = chain("b", 0, |_| Shape { queue: 21, frontend: 1, ..BASE });
        let d = compare(&rep("b", &analysis(before)), &rep("a", &analysis(after)));
        let ex = &d.overall.explain.ttft;
        assert_eq!(ex.delta_ms, Some(19.0));
        assert_eq!(ex.dominant_phase, Some("queue"));
        assert_eq!(ex.causes[0].cause, "more_queueing");
        assert_eq!(ex.contributions[0].phase, "queue");
        assert_eq!(ex.contributions[1].phase, "frontend");
        assert!(close(ex.contributions[1].delta_ms, -1.0));
    }

    /// A longer first output that the engine spent decoding while the server
    /// held the text back (a new stop string, a parser) is told as that, not
    /// as a slower output path; the other way round, less held back.
    #[test]
    fn a_first_output_grown_by_text_held_back_is_told_apart_from_a_slower_output_path() {
        let one = |b: Shape, a: Shape| compare(&rep("b", &analysis(chain("b", 0, move |_| b))), &rep("a", &analysis(chain("a", 0, move |_| a))));
        let held = Shape { first_output: 41, held: 40, ..BASE };
        let d = one(BASE, held);
        let c = &d.pairs[0].explain.ttft.causes[0];
        assert_eq!((c.cause, c.detail.as_str()), ("first_content_held_back", "first token to its SSE write +40.00 ms, +40.00 ms of it the engine decoding while the server held the text back (a new or longer stop string, a reasoning or tool-call parser, incomplete UTF-8)"));
        assert_eq!(d.pairs[0].first_output_held_ms, Delta { before: Some(0.0), after: Some(40.0), delta: Some(40.0) });
        assert_eq!(d.overall.first_output_held_ms.delta, Some(40.0));
        assert_eq!(d.overall.explain.ttft.causes[0].cause, "first_content_held_back");
        // The same growth with nothing held: the output path.
        let d = one(BASE, Shape { first_output: 41, ..BASE });
        assert_eq!(d.pairs[0].explain.ttft.causes[0].cause, "slower_output_path");
        // Held for less than half of it: still the output path.
        let d = one(BASE, Shape { first_output: 41, held: 15, ..BASE });
        assert_eq!(d.pairs[0].explain.ttft.causes[0].cause, "slower_output_path");
        let d = one(held, BASE);
        let c = &d.pairs[0].explain.ttft.causes[0];
        assert_eq!((c.cause, c.detail.as_str()), ("first_content_held_less", "first token to its SSE write -40.00 ms, -40.00 ms of it less text held back before the first content"));
    }

    /// A longer queue spent in the scheduler's queue by requests that now ask
    /// for structured output is their grammar's; the other way round, no
    /// grammar to compile. Requests that asked on both sides, or a wait
    /// before the engine took them in, keep the other causes.
    #[test]
    fn a_queue_grown_in_the_schedulers_queue_by_a_new_structured_output_is_its_grammar() {
        let base = Shape { intake: Some(0), ..BASE };
        let json = Shape { queue: 41, structured: Some("json"), ..base };
        // One chain per shape: its first hop that shape, the others the base.
        let diff = |b: Vec<Shape>, a: Vec<Shape>| {
            let mk = |name: &str, v: Vec<Shape>| {
                let reqs = v.into_iter().enumerate().flat_map(|(k, s)| chain(&format!("{name}{k}"), k as u64 * 10_000 * MS, move |h| if h == 1 { s } else { base })).collect();
                analysis(reqs)
            };
            compare(&rep("b", &mk("b", b)), &rep("a", &mk("a", a)))
        };
        let d = diff(vec![base], vec![json]);
        let c = &d.pairs[0].explain.ttft.causes[0];
        assert_eq!((c.cause, c.detail.as_str()), ("structured_output_added", "now asks for structured output (json): waited +40.00 ms longer to be scheduled, +40.00 ms of it in the scheduler's queue (which holds such a request until its grammar is compiled; or fewer free slots)"));
        assert_eq!(d.pairs[0].structured_output, KindChange { before: None, after: Some("json") });
        let c = &d.overall.explain.ttft.causes[0];
        assert_eq!((c.cause, c.detail.as_str()), ("structured_output_added", "1 of these requests now asks for structured output: waited +13.33 ms longer to be scheduled, +13.33 ms of it in the scheduler's queue (which holds such a request until its grammar is compiled; or fewer free slots)"));
        assert_eq!(d.overall.structured_output, StructuredShift { before: 0, after: 1, added: 1, removed: 0 });
        let hop1 = d.hops.iter().find(|h| h.hop == Some(1)).expect("hop 1's aggregate");
        assert_eq!(hop1.explain.ttft.causes[0].cause, "structured_output_added");
        // Two of three chains' first hops: the mean moved by their waits.
        let d = diff(vec![base, base, base], vec![json, json, base]);
        assert_eq!(d.overall.explain.ttft.causes[0].cause, "structured_output_added");
        assert!(d.overall.explain.ttft.causes[0].detail.starts_with("2 of these requests now ask for structured output:"), "{}", d.overall.explain.ttft.causes[0].detail);
        // The other way round.
        let d = diff(vec![json], vec![base]);
        let c = &d.pairs[0].explain.ttft.causes[0];
        assert_eq!((c.cause, c.detail.as_str()), ("structured_output_removed", "no longer asks for structured output (json): scheduled 40.00 ms sooner, -40.00 ms of it in the scheduler's queue (no grammar to compile)"));
        // Asked on both sides: the scheduler's queue, no new grammar to name.
        let d = diff(vec![Shape { structured: Some("json"), ..base }], vec![json]);
        assert_eq!(d.pairs[0].explain.ttft.causes[0].cause, "more_queueing");
        // Newly structured, but the wait was before the engine took it in.
        let d = diff(vec![base], vec![Shape { intake: Some(40), ..json }]);
        assert_eq!(d.pairs[0].explain.ttft.causes[0].cause, "slower_engine_intake");
        // Newly structured, and later requests went past it for 30 of its
        // 40 ms: its grammar, no free-slot alternative.
        let d = diff(vec![base], vec![Shape { passed: Some(30), ..json }]);
        let c = &d.pairs[0].explain.ttft.causes[0];
        assert_eq!((c.cause, c.detail.as_str()), ("structured_output_added", "now asks for structured output (json): waited +40.00 ms longer to be scheduled, +40.00 ms of it in the scheduler's queue (which held it until its grammar was compiled: later requests went past it for +30.00 ms more)"));
        assert_eq!(d.pairs[0].scheduler_passed_over_ms.delta, Some(30.0));
        // Nobody went past, but a request of its constraint was scheduled
        // 5 ms into its 41: the 36 after it were for room.
        let d = diff(vec![base], vec![Shape { ready: Some(5), ..json }]);
        let c = &d.pairs[0].explain.ttft.causes[0];
        assert_eq!((c.cause, c.detail.as_str()), ("structured_output_added", "now asks for structured output (json): waited +40.00 ms longer to be scheduled, +40.00 ms of it in the scheduler's queue (its grammar was ready within 5.00 ms; the 36.00 ms after it waited for room: fewer free slots or KV blocks)"));
        assert_eq!(d.pairs[0].scheduler_grammar_ready_ms, Delta { before: None, after: Some(5.0), delta: None });
        // Ready late in the wait: the grammar's, as far as is known.
        let d = diff(vec![base], vec![Shape { ready: Some(30), ..json }]);
        let c = &d.pairs[0].explain.ttft.causes[0];
        assert!(c.detail.ends_with("(which holds such a request until its grammar is compiled: ready within 30.00 ms)"), "{}", c.detail);
        // Asked on both sides, skipped longer, its grammar known ready later.
        let d = diff(vec![Shape { structured: Some("json"), passed: Some(0), ready: Some(0), ..base }], vec![Shape { passed: Some(35), ready: Some(38), ..json }]);
        let c = &d.pairs[0].explain.ttft.causes[0];
        assert_eq!(c.cause, "scheduler_skipped");
        assert!(c.detail.ends_with("or a slower backend; its grammar known ready +38.00 ms later)"), "{}", c.detail);
        assert_eq!(d.overall.scheduler_grammar_ready_ms.delta, Some(38.0));
    }

    /// Requests that ask for the same kind on both sides and now wait longer
    /// while later ones go past them were skipped: their grammar (a schema
    /// the backend had not compiled). Without a constraint, the other
    /// reasons vLLM skips for; passed for less than half of the change, or
    /// not at all, the free-slot reading stays; and the other way round.
    #[test]
    fn a_queue_grown_while_later_requests_went_past_is_the_schedulers_skipping() {
        let base = Shape { intake: Some(0), ..BASE };
        let cause = |b: Shape, a: Shape| {
            let d = compare(&rep("b", &analysis(chain("a", 0, |_| b))), &rep("a", &analysis(chain("b", 0, |_| a))));
            let c = d.pairs[0].explain.ttft.causes[0].clone();
            (c.cause, c.detail)
        };
        let json = Shape { structured: Some("json"), ..base };
        let (c, detail) = cause(json, Shape { queue: 41, passed: Some(35), ..json });
        assert_eq!(c, "scheduler_skipped");
        assert_eq!(detail, "waited +40.00 ms longer to be scheduled, +40.00 ms of it in the scheduler's queue, where later requests went past it for +35.00 ms more: the scheduler skipped it (for its grammar: it asks for structured output (json) on both sides and waits longer for it now — a new or changing schema misses the backend's cache, or a slower backend)");
        let (c, detail) = cause(base, Shape { queue: 41, passed: Some(35), ..base });
        assert_eq!(c, "scheduler_skipped");
        assert!(detail.ends_with("the scheduler skipped it (remote KV not loaded yet, no free LoRA slot, or, chunked prefill off, a prompt over the token budget)"), "{detail}");
        assert_eq!(cause(json, Shape { queue: 41, passed: Some(10), ..json }).0, "more_queueing", "passed for a quarter of it");
        assert_eq!(cause(json, Shape { queue: 41, ..json }).0, "more_queueing", "nobody went past");
        let (c, detail) = cause(Shape { queue: 41, passed: Some(35), ..json }, json);
        assert_eq!((c, detail.as_str()), ("scheduler_skipped_less", "scheduled 40.00 ms sooner, -40.00 ms of it in the scheduler's queue, where later requests went past it for 35.00 ms less: the scheduler skipped it less"));
    }

    /// With the engine's QUEUED stamps a longer queue is told apart: spent
    /// before the engine took the request in (a step in its way) or in the
    /// scheduler's queue (no free slot); and a shorter one likewise.
    #[test]
    fn a_longer_queue_is_the_engines_intake_or_the_schedulers_queue_as_its_stamps_say() {
        let base = Shape { intake: Some(0), ..BASE };
        let cause = |b: Shape, a: Shape| {
            let d = compare(&rep("b", &analysis(chain("a", 0, |_| b))), &rep("a", &analysis(chain("b", 0, |_| a))));
            let c = d.overall.explain.ttft.causes[0].clone();
            (c.cause, c.detail, d.overall.scheduler_queue_ms.delta, d.pairs[0].scheduler_queue_ms.delta)
        };
        // 20 ms more, 19 of them before the QUEUED stamp.
        let (c, detail, overall, pair) = cause(base, Shape { queue: 21, intake: Some(19), ..BASE });
        assert_eq!((c, overall, pair), ("slower_engine_intake", Some(1.0), Some(1.0)), "{detail}");
        assert_eq!(detail, "+19.00 ms more before the engine took it in (longer engine steps, a busier input path); the scheduler's queue +1.00 ms");
        // 20 ms more, all in the scheduler's queue.
        let (c, detail, ..) = cause(base, Shape { queue: 21, ..base });
        assert_eq!(c, "more_queueing");
        assert_eq!(detail, "waited +20.00 ms longer to be scheduled, +20.00 ms of it in the scheduler's queue (fewer free slots or KV blocks)");
        // And back: the intake's 19 ms gone.
        let (c, detail, ..) = cause(Shape { queue: 21, intake: Some(19), ..BASE }, base);
        assert_eq!(c, "faster_engine_intake");
        assert_eq!(detail, "19.00 ms less before the engine took it in; the scheduler's queue -1.00 ms");
        let (c, detail, ..) = cause(Shape { queue: 21, ..base }, base);
        assert_eq!((c, detail.as_str()), ("less_queueing", "scheduled 20.00 ms sooner, -20.00 ms of it in the scheduler's queue"));
        // Stamps on one side only: no split.
        let (c, _, overall, _) = cause(BASE, Shape { queue: 21, intake: Some(19), ..BASE });
        assert_eq!((c, overall), ("more_queueing", None));
        // The text shows the scheduler's part under the queue's row.
        let d = compare(&rep("b", &analysis(chain("a", 0, |_| base))), &rep("a", &analysis(chain("b", 0, |_| Shape { queue: 21, intake: Some(19), ..BASE }))));
        let t = render_text(&d);
        let rows: Vec<&str> = t.split("what changed").nth(1).unwrap().lines().collect();
        let at = rows.iter().position(|l| l.trim_start().starts_with("queue ")).unwrap_or_else(|| panic!("{t}"));
        let sub: Vec<&str> = rows[at + 1].split_whitespace().collect();
        assert_eq!(sub, ["in", "scheduler", "1.00", "2.00", "+1.00", "-", "-"], "{t}");
        let d = compare(&rep("b", &analysis(chain("a", 0, |_| BASE))), &rep("a", &analysis(chain("b", 0, |_| Shape { queue: 21, intake: Some(19), ..BASE }))));
        assert!(!render_text(&d).contains("in scheduler"), "no stamps before: no split");
    }

    #[test]
    fn same_prefill_tokens_but_slower_prefill_is_slower_prefill_not_a_cache_effect() {
        let before = chain("a", 0, |_| BASE);
        let after = chain("b", 0, |_| Shape { prefill: 30, ..BASE });
        let d = compare(&rep("b", &analysis(before)), &rep("a", &analysis(after)));
        let c = &d.overall.explain.ttft.causes[0];
        assert_eq!(c.cause, "slower_prefill");
        assert!(c.detail.contains("0.025 → 0.075 ms per computed token"), "{}", c.detail);
    }

    #[test]
    fn without_explicit_chains_requests_match_by_path_and_prompt_size_and_extras_are_unmatched() {
        let conn = |i, at, prompt| request(i, at, &format!("conn:{i}"), ChainSource::Connection, Shape { prompt, ..BASE });
        // Arrival order differs between the runs; prompt sizes pair them.
        let before = vec![conn(1, 0, 300), conn(2, 100 * MS, 100), conn(3, 200 * MS, 200)];
        let after = vec![conn(4, 0, 100), conn(5, 100 * MS, 300)];
        let mut health = request(6, 50 * MS, "conn:6", ChainSource::Connection, BASE);
        health.method = "GET".into();
        health.path = "/health".into();
        let mut after = analysis(after);
        after.requests.push(health);
        let d = compare(&rep("b", &analysis(before)), &rep("a", &after));
        assert_eq!(d.matching.mode, "path");
        let got: Vec<(&str, &str, &str)> = d.pairs.iter().map(|p| (p.key.as_str(), p.before_id.as_str(), p.after_id.as_str())).collect();
        assert_eq!(got, [("POST /v1/chat/completions #1", "chatcmpl-conn:2-2", "chatcmpl-conn:4-4"), ("POST /v1/chat/completions #2", "chatcmpl-conn:1-1", "chatcmpl-conn:5-5")]);
        assert_eq!(d.matching.unmatched_before.len(), 1);
        assert_eq!(d.matching.unmatched_before[0].id, "chatcmpl-conn:3-3", "the 200-token prompt has no counterpart");
        assert_eq!(d.matching.unmatched_after.len(), 1);
        assert_eq!(d.matching.unmatched_after[0].path, "/health");
        assert!(d.hops.is_empty());
        let text = render_text(&d);
        assert!(text.contains("unmatched in AFTER: GET /health ×1"), "{text}");
    }

    #[test]
    fn size_alignment_skips_the_extras_that_fit_worst_on_either_side() {
        assert_eq!(align(&[1.0, 2.0, 3.0], &[1.0, 2.0, 3.0]), [(0, 0), (1, 1), (2, 2)]);
        assert_eq!(align(&[100.0, 200.0, 300.0], &[100.0, 300.0]), [(0, 0), (2, 1)]);
        assert_eq!(align(&[50.0], &[10.0, 20.0, 48.0, 90.0]), [(0, 2)]);
        assert_eq!(align(&[], &[1.0]), []);
    }

    #[test]
    fn extra_hops_and_chains_are_reported_unmatched_on_their_side() {
        let before = chain("a", 0, |_| BASE);
        let mut after = chain("b", 0, |_| BASE);
        after.pop();
        after.extend(chain("c", 10_000 * MS, |_| BASE));
        let d = compare(&rep("b", &analysis(before)), &rep("a", &analysis(after)));
        assert_eq!(d.matching.by_chain, 2);
        assert_eq!(d.matching.unmatched_before.len(), 1);
        assert_eq!(d.matching.unmatched_before[0].reason, "AFTER's chain 1 has no hop 3");
        assert_eq!(d.matching.unmatched_after.len(), 3);
        assert!(d.matching.unmatched_after.iter().all(|u| u.reason == "BEFORE has no chain 2"));
    }

    #[test]
    fn a_wire_only_side_leaves_the_rest_unexplained_instead_of_guessing() {
        let before = chain("a", 0, |_| BASE);
        let mut after = chain("b", 0, |_| Shape { prefill: 30, ..BASE });
        for r in &mut after {
            r.engine = None;
        }
        let d = compare(&rep("b", &analysis(before)), &rep("a", &analysis(after)));
        let ex = &d.pairs[0].explain.ttft;
        assert_eq!(ex.sum_of_phases_ms, None);
        assert_eq!(ex.dominant_phase, None);
        assert!(ex.summary.contains("no phases known"), "{}", ex.summary);
        let e2e = &d.pairs[0].explain.e2e;
        assert_eq!(e2e.contributions.len(), 1, "only decode is known on the wire");
        assert!(close(e2e.unexplained_ms.unwrap(), 20.0));
        assert_eq!(e2e.dominant_phase, None);
    }

    #[test]
    fn json_has_the_documented_top_level_keys_and_kernels_is_null_without_gpu() {
        let v = serde_json::to_value(cache_lost()).unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        for k in ["schema", "before", "after", "matching", "headline", "overall", "hops", "pairs", "kernels"] {
            assert!(keys.contains(&k), "{k} missing from {keys:?}");
        }
        assert_eq!(v["schema"], 1);
        assert!(v["kernels"].is_null());
        assert!(v["overall"]["kernels"].is_null() && v["hops"].as_array().unwrap().iter().all(|h| h["kernels"].is_null()), "{}", v["hops"]);
        assert_eq!(v["hops"][1]["explain"]["ttft"]["dominant_phase"], "prefill");
        assert_eq!(v["pairs"][1]["tokens"]["cached"]["delta"], -700);
        assert!(v["pairs"][0]["phases_ms"]["kv_transfer"]["delta"].is_null());
    }

    #[test]
    fn the_text_leads_with_the_headline_and_lists_biggest_phase_first() {
        let d = cache_lost();
        let t = render_text(&d);
        assert!(t.contains(&d.headline));
        let changed = t.split("what changed").nth(1).unwrap();
        let first_row = changed.lines().nth(2).unwrap();
        assert!(first_row.trim_start().starts_with("prefill"), "{changed}");
        assert!(t.contains("fewer_cached_tokens"));
        assert!(!t.contains("GPU kernels"), "no kernel section without kernels");
    }

    // ------------------------------------------------------------ kernels

    fn k(name: &str, count: u64, gpu_ms: f64) -> KernelOut {
        KernelOut { name: name.into(), count, gpu_ms }
    }

    #[test]
    fn kernel_names_lose_templates_parameters_configs_and_suffixes() {
        let cases = [
            (
                "void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64, 64, 4, false, false, cutlass::half_t, Flash_kernel_traits<128, 64, 64, 4, cutlass::half_t> >, true, false, false, false, true, true, false>(Flash_fwd_params)",
                "flash_fwd_kernel",
            ),
            ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn", "ampere_bf16_s16816gemm_bf16_tn"),
            ("ampere_bf16_s16816gemm_bf16_256x128_ldg8_f2f_stages_64x3_tn", "ampere_bf16_s16816gemm_bf16_tn"),
            (
                "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
                "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_execute_segment_k_off_kernel_cublas",
            ),
            (
                "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__6x_cublas",
                "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_execute_segment_k_off_kernel_cublas",
            ),
            (
                "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, (vllm::Fp8KVCacheDataType)0>(__nv_bfloat16 const*, __nv_bfloat16 const*, __nv_bfloat16*, __nv_bfloat16*, long const*, long, long, long, long, int, int, int, float const*, float const*)",
                "vllm::reshape_and_cache_flash_kernel",
            ),
            ("triton_poi_fused_add_0", "triton_poi_fused_add"),
            ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_12", "triton_red_fused_to_copy_add_mean_mul_pow_rsqrt"),
            ("_fwd_kernel_0d1d2d3de4de5de", "_fwd_kernel"),
            ("fused_moe_kernel_5f3a9c2b1e", "fused_moe_kernel"),
            (
                "void at::native::(anonymous namespace)::distribution_elementwise_grid_stride_kernel<float, 4, at::native::templates::cuda::normal_and_transform<float, float>(at::TensorIteratorBase&, at::CUDAGeneratorImpl*)::{lambda(curandStatePhilox4_32_10*)#2}>(long, at::PhiloxCudaState, float)",
                "at::native::distribution_elementwise_grid_stride_kernel",
            ),
            (
                "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8>(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x2_tn_align8::Params)",
                "cutlass_wmma_tensorop_bf16_s161616gemm_bf16_tn",
            ),
            (
                "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, cute::tuple<cute::C<128>, cute::C<128>, cute::C<128> >, 128, cutlass::bfloat16_t, float, cutlass::arch::Sm90, true, false>, flash::CollectiveEpilogueFwd<cute::tuple<cute::C<128>, cute::C<128>, cute::C<128> >, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, cutlass::bfloat16_t, cutlass::arch::Sm90, 256, true, false, false, false>, flash::VarlenDynamicPersistentTileScheduler<128, 256, 128, false, true, true> > > >(flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<…> >::Params)",
                "flash::FlashAttnFwdSm90",
            ),
            ("_ZN4vllm30reshape_and_cache_flash_kernelI13__nv_bfloat16S1_LNS_18Fp8KVCacheDataTypeE0EEvPKT_S6_PT0_S8_PKlliiiiiPKfSE_", "vllm::reshape_and_cache_flash_kernel"),
            ("_Z16flash_fwd_kernelI23Flash_fwd_kernel_traitsILi128ELi64ELi64ELi4ELb0ELb0EN7cutlass6half_tEEEv16Flash_fwd_params", "flash_fwd_kernel"),
            ("_ZN7cutlass7Kernel2I66cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8EEvNT_6ParamsE", "cutlass_tensorop_bf16_s16816gemm_relu_bf16_tn"),
            ("void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false, false, cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<__nv_bfloat16 const>, cublasGemvTensorStridedBatched<__nv_bfloat16 const>, cublasGemvTensorStridedBatched<__nv_bfloat16>, float> >(cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<__nv_bfloat16 const>, cublasGemvTensorStridedBatched<__nv_bfloat16 const>, cublasGemvTensorStridedBatched<__nv_bfloat16>, float>, float, float)", "gemv2T_kernel_val"),
            ("memcpy32_post", "memcpy32_post"),
            ("[CUDA graph 5]", "[CUDA graph]"),
            ("[CUDA graph 123456]", "[CUDA graph]"),
            ("[CUDA graph]", "[CUDA graph]"),
            ("[unnamed kernel]", "[unnamed kernel]"),
        ];
        for (raw, want) in cases {
            let got = normalize_kernel_name(raw);
            assert_eq!(got, want, "{raw}");
            assert_eq!(normalize_kernel_name(&got), got, "idempotent on {got}");
        }
    }

    #[test]
    fn kernel_variants_merge_into_one_row_and_rows_lead_with_the_biggest_change() {
        let before = [
            k("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64, 64, 4, false, false, cutlass::half_t>, true>(Flash_fwd_params)", 10, 20.0),
            k("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn", 100, 50.0),
            k("triton_poi_fused_add_0", 40, 4.0),
        ];
        let after = [
            k("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64, 64, 4, false, false, cutlass::half_t>, true>(Flash_fwd_params)", 6, 15.0),
            k("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 8, false, false, cutlass::half_t>, false>(Flash_fwd_params)", 4, 45.0),
            k("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x4_tn", 100, 50.0),
            k("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, (vllm::Fp8KVCacheDataType)0>(long)", 10, 1.0),
        ];
        let kd = compare_kernels(&before, &after).expect("kernels present");
        assert!(close(kd.before_gpu_ms, 74.0) && close(kd.after_gpu_ms, 111.0) && close(kd.delta_gpu_ms, 37.0));
        let first = &kd.rows[0];
        assert_eq!(first.name, "flash_fwd_kernel");
        assert_eq!((first.before_count, first.after_count), (10, 10));
        assert!(close(first.delta_gpu_ms, 40.0) && close(first.per_call_ms, 40.0) && close(first.calls_ms, 0.0));
        assert_eq!(first.variants.len(), 2);
        assert_eq!(first.status, "changed");
        let by = |n: &str| kd.rows.iter().find(|r| r.name == n).unwrap();
        assert_eq!(by("triton_poi_fused_add").status, "gone");
        assert_eq!(by("vllm::reshape_and_cache_flash_kernel").status, "new");
        assert_eq!(by("ampere_bf16_s16816gemm_bf16_tn").status, "same");
        let sum: f64 = kd.rows.iter().map(|r| r.delta_gpu_ms).sum();
        assert!(close(sum, kd.delta_gpu_ms), "rows add up to the total");
        assert!(compare_kernels(&[], &[]).is_none());
    }

    #[test]
    fn the_kernel_section_appears_in_the_diff_and_text_only_when_kernels_exist() {
        let before = analysis(chain("a", 0, |_| BASE));
        let after = analysis(chain("b", 0, |_| BASE));
        let (mut rb, mut ra) = (rep("b", &before), rep("a", &after));
        rb.kernels = vec![k("triton_poi_fused_add_0", 4, 1.0)];
        ra.kernels = vec![k("triton_poi_fused_add_1", 8, 3.0)];
        let d = compare(&rb, &ra);
        let kd = d.kernels.as_ref().unwrap();
        assert_eq!(kd.rows.len(), 1);
        assert!(close(kd.rows[0].per_call_ms, 0.5) && close(kd.rows[0].calls_ms, 1.5));
        let t = render_text(&d);
        assert!(t.contains("GPU kernels (normalised names)") && t.contains("triton_poi_fused_add"), "{t}");
        assert!(d.headline.contains("GPU +2.00 ms, most in triton_poi_fused_add"), "{}", d.headline);
    }

    #[test]
    fn graphs_traced_per_launch_compare_as_one_row_whatever_their_ids_and_a_change_of_graph_tracing_is_a_warning() {
        let before = analysis(chain("a", 0, |_| BASE));
        let after = analysis(chain("b", 0, |_| BASE));
        let (mut rb, mut ra) = (rep("b", &before), rep("a", &after));
        let setup = |graphs, pids: Vec<u32>| crate::correlate::CuptiSetup { cupti_version: 130001, clock: "calibrated".into(), graphs, traced: vec!["kernel"], cupti_lib: "libcupti.so.13".into(), pids };
        // Each run numbers its graphs in creation order: the same graph is 3 in one, 7 in the other.
        rb.kernels = vec![k("[CUDA graph 3]", 100, 20.0), k("[CUDA graph 4]", 10, 1.0)];
        ra.kernels = vec![k("[CUDA graph 7]", 100, 26.0), k("[CUDA graph 8]", 10, 1.0)];
        rb.recording.cupti = vec![setup("launch", vec![10, 11])];
        ra.recording.cupti = vec![setup("launch", vec![20]), setup("launch", vec![21])];
        let d = compare(&rb, &ra);
        let kd = d.kernels.as_ref().unwrap();
        assert_eq!(kd.rows.len(), 1, "{:?}", kd.rows);
        let row = &kd.rows[0];
        assert_eq!((row.name.as_str(), row.before_count, row.after_count, row.status), (GRAPH_LAUNCHES, 110, 110, "changed"));
        assert!(close(row.delta_gpu_ms, 6.0) && close(row.per_call_ms, 6.0), "{row:?}");
        assert_eq!(row.variants.len(), 4);
        assert!(d.headline.contains("most in [CUDA graph] (+6.00 ms) (CUDA graphs traced per launch: record with `--gpu-graphs node`"), "{}", d.headline);
        assert_eq!((d.before.gpu_graphs, d.after.gpu_graphs), (Some("launch"), Some("launch")));
        assert!(!render_text(&d).contains("WARNING"), "{}", render_text(&d));
        let v = serde_json::to_value(&d).unwrap();
        assert_eq!(v["after"]["gpu_graphs"], "launch");

        // AFTER traced one process per node: its graphs' kernels are new, and the text says why.
        ra.recording.cupti = vec![setup("launch", vec![20]), setup("node", vec![21])];
        ra.kernels = vec![k("[CUDA graph 7]", 50, 13.0), k("triton_poi_fused_add_0", 800, 12.0)];
        let d = compare(&rb, &ra);
        assert_eq!(d.after.gpu_graphs, Some("mixed"));
        let t = render_text(&d);
        assert!(t.contains("WARNING: BEFORE traced CUDA graphs per launch, AFTER per node in some processes and per launch in others: GPU time inside graphs compares, their kernels do not"), "{t}");
        rb.recording.cupti.clear();
        assert!(!render_text(&compare(&rb, &ra)).contains("traced CUDA graphs"), "no warning when one side has no injected process");
    }

    /// A request's kernel list: (raw name, GPU ms).
    fn with_kernels(mut r: Request, ks: &[(&str, f64)]) -> Request {
        r.kernels = Some(ks.iter().map(|&(name, ms)| crate::correlate::gpu::KernelShare { name: name.into(), gpu_ns: (ms * MS as f64) as u64 }).collect());
        r
    }

    /// Two chains a side, hop 2 slower on the GPU in AFTER: its flash
    /// attention (two template variants in one request, merged) took 3 ms
    /// more and an add kernel is gone; hop 3 gained a GEMM. The hops say
    /// which kernels moved, per request, and those that did not stay quiet.
    fn kernels_moved() -> (Side, Side) {
        let side = |after: bool| {
            let mut reqs = Vec::new();
            for c in 0..2u64 {
                for (h, mut r) in chain(&format!("s-{after}-{c}"), c * 5000 * MS, |_| BASE).into_iter().enumerate() {
                    let hop = h + 1;
                    let ks: Vec<(&str, f64)> = match (after, hop) {
                        (false, 2) => vec![("void flash_fwd_kernel<Traits<128, 64>, true>(Flash_fwd_params)", 2.0), ("triton_poi_fused_add_0", 1.0)],
                        (true, 2) => vec![("void flash_fwd_kernel<Traits<128, 64>, true>(Flash_fwd_params)", 3.0), ("void flash_fwd_kernel<Traits<64, 64>, true>(Flash_fwd_params)", 2.0)],
                        (true, 3) => vec![("void flash_fwd_kernel<Traits<128, 64>, true>(Flash_fwd_params)", 2.0), ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas", 0.5)],
                        _ => vec![("void flash_fwd_kernel<Traits<128, 64>, true>(Flash_fwd_params)", 2.0)],
                    };
                    // The second chain's last hop has no kernel list in AFTER (no GPU records for it).
                    r = if after && c == 1 && hop == 3 { r } else { with_kernels(r, &ks) };
                    reqs.push(r);
                }
            }
            Side::of_report(&rep(if after { "a" } else { "b" }, &analysis(reqs)))
        };
        (side(false), side(true))
    }

    #[test]
    fn each_hop_names_the_kernels_whose_gpu_time_per_request_moved() {
        let (b, a) = kernels_moved();
        let d = compare_sides(&b, &a).into_diff();
        assert_eq!(d.hops.len(), 3);
        let hk = |h: usize| d.hops[h].kernels.as_ref().unwrap();
        let row = |h: usize, name: &str| hk(h).rows.iter().find(|r| r.name == name).unwrap_or_else(|| panic!("{name} not in hop {}: {:?}", h + 1, hk(h).rows)).clone();
        // Hop 1: nothing moved.
        assert_eq!(hk(0).requests, 2);
        assert!(hk(0).rows.iter().all(|r| r.status == "same" && r.delta_gpu_ms == 0.0), "{:?}", hk(0).rows);
        // Hop 2: the two variants are one row, +3 ms per request; the add is gone.
        let flash = row(1, "flash_fwd_kernel");
        assert!(close(flash.before_gpu_ms, 2.0) && close(flash.after_gpu_ms, 5.0) && flash.status == "changed", "{flash:?}");
        assert_eq!(hk(1).rows[0].name, "flash_fwd_kernel", "biggest change first: {:?}", hk(1).rows);
        let add = row(1, "triton_poi_fused_add");
        assert!(close(add.delta_gpu_ms, -1.0) && add.status == "gone", "{add:?}");
        assert!(close(hk(1).before_gpu_ms, 3.0) && close(hk(1).after_gpu_ms, 5.0) && close(hk(1).delta_gpu_ms, 2.0), "{:?}", hk(1));
        // Hop 3: only the pair whose two requests list kernels counts.
        assert_eq!(hk(2).requests, 1);
        let gemm = row(2, "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_cublas");
        assert!(close(gemm.after_gpu_ms, 0.5) && gemm.status == "new", "{gemm:?}");
        // Overall: every inference pair with lists on both sides.
        let o = d.overall.kernels.as_ref().unwrap();
        assert_eq!(o.requests, 5);
        assert!(close(o.delta_gpu_ms, (2.0 * 2.0 + 0.5) / 5.0), "{o:?}");
        let t = render_text(&d);
        assert!(t.contains("per hop GPU kernels"), "{t}");
        let hop_line = |hop: &str| t.lines().skip_while(|l| !l.starts_with("per hop GPU kernels")).find(|l| l.trim_start().starts_with(hop)).unwrap_or_else(|| panic!("{t}"));
        let hop2 = hop_line("2 ");
        assert!(hop2.contains("flash_fwd_kernel +3.000, triton_poi_fused_add -1.000"), "{hop2}");
        let hop1 = hop_line("1 ");
        assert!(hop1.contains("none moved"), "{hop1}");
        assert_streamed_equals_whole(&b, &a);
    }

    /// A model swapped on one hop: that hop and the overall aggregate say
    /// which models each side named, the headline and the text say so, the
    /// pairs carry both names; hops whose model stayed have none.
    #[test]
    fn a_hop_whose_model_changed_is_named_with_both_models() {
        let side = |after: bool| {
            let mut reqs = Vec::new();
            for c in 0..2u64 {
                for (h, mut r) in chain(&format!("s-{after}-{c}"), c * 5000 * MS, |_| BASE).into_iter().enumerate() {
                    r.model = match (after, h + 1, c) {
                        (true, 2, 0) => Some("qwen-7b".into()),
                        // The second chain's second hop named none after.
                        (true, 2, _) => None,
                        _ => Some("llama-8b".into()),
                    };
                    reqs.push(r);
                }
            }
            Side::of_report(&rep(if after { "a" } else { "b" }, &analysis(reqs)))
        };
        let (b, a) = (side(false), side(true));
        let d = compare_sides(&b, &a).into_diff();
        assert_eq!(d.hops.len(), 3);
        assert!(d.hops[0].models.is_none() && d.hops[2].models.is_none(), "unchanged hops: {:?}", d.hops.iter().map(|h| &h.models).collect::<Vec<_>>());
        let count = |m: Option<&str>, n| ModelCount { model: m.map(str::to_owned), requests: n };
        let hop2 = d.hops[1].models.as_ref().unwrap();
        assert_eq!(hop2, &ModelsUsed { changed: 2, before: vec![count(Some("llama-8b"), 2)], after: vec![count(None, 1), count(Some("qwen-7b"), 1)] });
        let o = d.overall.models.as_ref().unwrap();
        assert_eq!((o.changed, o.before.clone()), (2, vec![count(Some("llama-8b"), 6)]));
        assert_eq!(o.after, vec![count(Some("llama-8b"), 4), count(None, 1), count(Some("qwen-7b"), 1)]);
        assert!(d.headline.ends_with("; model changed in 2 of 6 pairs (llama-8b ×6 → llama-8b ×4, none named ×1, qwen-7b ×1)"), "{}", d.headline);
        let t = render_text(&d);
        assert!(t.contains("per hop models") && t.contains("  hop 2: 2 of its pairs: llama-8b ×2 → none named ×1, qwen-7b ×1"), "{t}");
        let p = d.pairs.iter().find(|p| p.hop == Some(2) && p.after_model.is_some()).unwrap();
        assert_eq!((p.before_model.as_deref(), p.after_model.as_deref()), (Some("llama-8b"), Some("qwen-7b")));
        // Same models on both sides: nothing said.
        let same = compare_sides(&b, &b).into_diff();
        assert!(same.overall.models.is_none() && !same.headline.contains("model") && !render_text(&same).contains("per hop models"));
        assert_streamed_equals_whole(&b, &a);
    }

    /// What `hopscope diff` writes, pair by pair, against the whole diff
    /// serialized at once: the same JSON bytes and the same text.
    fn assert_streamed_equals_whole(b: &Side, a: &Side) {
        let mut json = Vec::new();
        compare_sides(b, a).write_json(&mut json).unwrap();
        let text = compare_sides(b, a).render_text();
        let whole = compare_sides(b, a).into_diff();
        let want = serde_json::to_string_pretty(&whole).unwrap();
        assert_eq!(String::from_utf8(json).unwrap(), want);
        assert_eq!(text, render_text(&whole));
    }

    /// More inference pairs than the text lists, chain and path matches,
    /// requests without inference, unmatched ones on both sides, and no
    /// pairs at all.
    #[test]
    fn the_streamed_diff_writes_the_whole_diffs_json_and_text() {
        let mut before: Vec<Request> = (0..12).flat_map(|c| chain(&format!("s-b{c:02}"), c * 5000 * MS, |h| Shape { prefill: 10 + u64::from(h), ..BASE })).collect();
        let mut after: Vec<Request> = (0..11).flat_map(|c| chain(&format!("s-a{c:02}"), c * 5000 * MS, |h| Shape { prefill: 10 + u64::from(h) * (c % 4), gaps: 3 + c % 3, ..BASE })).collect();
        for (i, side) in [&mut before, &mut after].into_iter().enumerate() {
            let mut health = request(900 + i, 1, "conn:900", ChainSource::Connection, BASE);
            health.method = "GET".into();
            health.path = "/health".into();
            health.ttft_ns = None;
            health.engine = None;
            health.usage = Usage::default();
            side.push(health);
            side.push(request(950 + i, 2, &format!("conn:95{i}"), ChainSource::Connection, Shape { prompt: 100 + 50 * i as u64, ..BASE }));
        }
        let mut models = request(960, 3, "conn:960", ChainSource::Connection, BASE);
        models.method = "GET".into();
        models.path = "/v1/models".into();
        after.push(models);
        let (b, a) = (Side::of_report(&rep("b", &analysis(before))), Side::of_report(&rep("a", &analysis(after))));
        let d = compare_sides(&b, &a).into_diff();
        assert!(d.matching.unmatched_after.iter().any(|u| u.path == "/v1/models" && u.reason == "BEFORE has only 0 GET /v1/models (nearest prompt sizes paired)"), "{:?}", d.matching.unmatched_after);
        assert!(d.pairs.iter().filter(|p| p.generation).count() > TEXT_PAIRS, "{} pairs", d.pairs.len());
        assert!(d.pairs.iter().any(|p| !p.generation) && d.matching.by_path > 0 && !d.matching.unmatched_before.is_empty());
        assert_streamed_equals_whole(&b, &a);
        let none = Side::of_report(&rep("none", &Analysis::default()));
        assert_streamed_equals_whole(&b, &none);
        assert_streamed_equals_whole(&none, &none);
    }

    fn fixture(name: &str) -> std::path::PathBuf {
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(format!("{name}.hop"))
    }

    /// A recording read the way `hopscope diff` reads it keeps what the
    /// recording's whole report holds: the diffs of the committed testbed
    /// recordings are the same either way.
    #[test]
    fn a_recording_read_while_streamed_diffs_like_its_whole_report() {
        let side = |name: &str| {
            let path = fixture(name);
            let mut reader = crate::recording::Reader::open(&path).unwrap();
            let cfg = crate::correlate::Config { chain_header: reader.meta().chain_header.clone(), use_ipc: true };
            let (streamed, err) = Side::read(&mut reader, name, cfg.clone()).unwrap();
            assert_eq!(err, None);
            let loaded = crate::recording::load(&path).unwrap();
            let mut c = crate::correlate::Correlator::new(cfg);
            for r in &loaded.records {
                c.ingest(r);
            }
            let whole = Side::of_report(&report::build(name, &loaded.meta, &c.finish(), None));
            (streamed, whole)
        };
        let sides: Vec<(Side, Side)> = ["chain3", "queue2", "tp_chunked"].into_iter().map(side).collect();
        for (bs, bw) in &sides {
            assert!(bs.info.requests > 0 && bs.info.requests == bw.info.requests);
            for (as_, aw) in &sides {
                let (s, w) = (compare_sides(bs, as_), compare_sides(bw, aw));
                let (mut js, mut jw) = (Vec::new(), Vec::new());
                s.write_json(&mut js).unwrap();
                w.write_json(&mut jw).unwrap();
                assert_eq!(String::from_utf8(js).unwrap(), String::from_utf8(jw).unwrap(), "{} vs {}", bs.info.path, as_.info.path);
                assert_eq!(s.render_text(), w.render_text());
            }
        }
        // chain3 has explicit chains: with itself every hop pairs by chain.
        let d = compare_sides(&sides[0].0, &sides[0].0).into_diff();
        assert_eq!(d.matching.mode, "chain");
        assert!(d.matching.by_chain > 0 && d.matching.unmatched_before.is_empty(), "{:?}", d.matching);
    }

    /// The packed figures come back as they went in: unknown stays unknown,
    /// a computed NaN and the extremes stay values.
    #[test]
    fn a_packed_view_unpacks_to_the_same_figures() {
        let nan = f64::NAN;
        let v = View {
            ttft: Some(nan),
            e2e: None,
            itl_mean: Some(f64::INFINITY),
            itl_p90: Some(-0.0),
            itl_gaps: 7,
            itl_sum: 12.5,
            phases: [Some(1.0), None, Some(f64::MIN_POSITIVE), None, Some(3.0), Some(1e300)],
            prompt: Some(u64::MAX),
            cached: Some(0),
            computed: Some(u64::MAX),
            completion: None,
            steps: Some(3),
            preemptions: Some(u64::from(u32::MAX)),
            interference: None,
            scheduler_queue: Some(0.25),
            passed_over: Some(0.125),
            grammar_ready: Some(0.0625),
            held: Some(-1.5),
            gpu: [None, Some(2.0), None],
            generation: true,
            structured: 7,
        };
        let u = Packed::of(&v).unpack();
        assert!(u.ttft.is_some_and(f64::is_nan), "{:?}", u.ttft);
        let bits = |x: &View| -> Vec<Option<u64>> { [x.ttft, x.e2e, x.itl_mean, x.itl_p90, x.interference, x.scheduler_queue, x.passed_over, x.grammar_ready, x.held].into_iter().chain(x.phases).chain(x.gpu).map(|o| o.map(f64::to_bits)).collect() };
        assert_eq!(bits(&u)[1..], bits(&v)[1..]);
        assert_eq!((u.prompt, u.cached, u.computed, u.completion, u.steps, u.preemptions), (v.prompt, v.cached, v.computed, v.completion, v.steps, v.preemptions));
        assert_eq!((u.itl_gaps, u.itl_sum.to_bits(), u.generation, u.structured), (v.itl_gaps, v.itl_sum.to_bits(), v.generation, v.structured));
        let none = Packed::of(&View::default()).unpack();
        assert!(none.ttft.is_none() && none.prompt.is_none() && none.preemptions.is_none() && none.phases.iter().all(Option::is_none));
        assert!(std::mem::size_of::<Packed>() <= std::mem::size_of::<View>() / 2, "{} bytes", std::mem::size_of::<Packed>());
    }
}
