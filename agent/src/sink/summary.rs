//! Run-level figures users compare with other tools: the latency
//! distributions `vllm bench serve` prints (TTFT, TPOT, ITL, E2EL: mean,
//! median, std, chosen percentiles), AgentX's P90 E2E-normalised
//! interactivity, per-chain prefix-cache hit rates, and GPU memory peaks from
//! the NVML samples (`source::nvml`).
//!
//! Definitions follow vLLM's `calculate_metrics` (`vllm/benchmarks/serve.py`,
//! formerly `benchmarks/benchmark_serving.py`):
//! - only successful requests count ("completed");
//! - `tpot = (latency - ttft) / (output_len - 1)`, only for `output_len > 1`;
//! - ITLs of every request are pooled into one list;
//! - percentiles are `np.percentile` (linear interpolation between closest
//!   ranks), median is the 50th, std is the population std (`np.std`);
//! - percentile labels are `P{p}` with `p` printed as an integer when it is one.
//!
//! Two deliberate differences: hopscope times at the server's socket (a
//! client's figures add its network and event loop), and a distribution with
//! no samples is `null` where vLLM prints 0 (`np.mean([] or 0)`): unobserved is
//! not zero. The output token count is the report's `completion_tokens`: the
//! server's `usage.completion_tokens`, else (a stream without
//! `stream_options.include_usage`) the tokens the engine generated for it,
//! the same count (vLLM bench re-tokenises the text or uses the usage);
//! requests with neither are left out of TPOT and interactivity and counted.

use crate::correlate::percentile;
use crate::model::Record;
use crate::sink::json;
use crate::sink::trunc;
use crate::sink::report::{ChainOut, RequestOut};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

/// What `vllm bench serve --metric-percentiles` defaults to.
pub const DEFAULT_PERCENTILES: &[f64] = &[99.0];

/// One latency distribution, in milliseconds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Dist {
    pub n: usize,
    pub mean: f64,
    pub median: f64,
    pub std: f64,
    /// `"p99"` → value (keys as vLLM names them: `p99`, `p99.9`).
    pub percentiles: BTreeMap<String, f64>,
}

/// Prefix-cache hit rate of one chain: cached / prompt tokens over the hops
/// where both are known.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChainHitRate {
    pub chain: String,
    pub cached_tokens: u64,
    pub prompt_tokens: u64,
    pub hit_rate: Option<f64>,
    /// Hops left out because their cached or prompt count is unknown.
    pub hops_unknown: usize,
}

/// One model's completed requests (the request body's `model`): a server
/// with LoRA adapters or several models shows each apart.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelSummary {
    /// `null`: the requests that named none; `other`: past [`MAX_MODELS`].
    pub model: Option<String>,
    pub completed: usize,
    pub total_output_tokens: u64,
    pub ttft_ms: Option<Dist>,
    pub tpot_ms: Option<Dist>,
    pub e2el_ms: Option<Dist>,
}

/// Named models with figures of their own in [`Summary::models`]; the
/// later ones share `other` (the names are the clients').
pub const MAX_MODELS: usize = 16;

/// The models of a run's completed requests, in first-seen order, each
/// figure tagged with its model's slot as it is folded in, so that one
/// pass gives both the run's and each model's distributions.
#[derive(Debug, Default)]
pub struct Models {
    names: Vec<Option<String>>,
    completed: Vec<usize>,
    out_tokens: Vec<u64>,
    /// Slots of the values pushed to the run's TTFT, TPOT and E2EL lists, in order.
    pub ttft: Vec<u8>,
    pub tpot: Vec<u8>,
    pub e2el: Vec<u8>,
}

impl Models {
    /// The slot of a completed request naming `model` (counted in it).
    pub fn slot(&mut self, model: Option<&str>, out_tokens: Option<u64>) -> u8 {
        let at = |names: &[Option<String>], k: Option<&str>| names.iter().position(|n| n.as_deref() == k);
        let named = || self.names.iter().filter(|n| n.as_deref().is_some_and(|m| m != "other")).count();
        let key = match model {
            Some(_) if at(&self.names, model).is_none() && named() >= MAX_MODELS => Some("other"),
            m => m,
        };
        let i = at(&self.names, key).unwrap_or_else(|| {
            self.names.push(key.map(str::to_owned));
            self.completed.push(0);
            self.out_tokens.push(0);
            self.names.len() - 1
        });
        self.completed[i] += 1;
        self.out_tokens[i] += out_tokens.unwrap_or(0);
        i as u8
    }

    /// Each model's figures from the run's lists (the values in the order
    /// their slots were pushed); none when no request named a model.
    pub fn summaries(&self, ttfts: &[f64], tpots: &[f64], e2els: &[f64], percentiles: &[f64]) -> Vec<ModelSummary> {
        if self.names.iter().all(Option::is_none) {
            return Vec::new();
        }
        let of = |xs: &[f64], slots: &[u8], i: usize| -> Option<Dist> {
            dist_of(xs.iter().zip(slots).filter(|(_, s)| usize::from(**s) == i).map(|(x, _)| *x).collect(), percentiles)
        };
        (0..self.names.len())
            .map(|i| ModelSummary {
                model: self.names[i].clone(),
                completed: self.completed[i],
                total_output_tokens: self.out_tokens[i],
                ttft_ms: of(ttfts, &self.ttft, i),
                tpot_ms: of(tpots, &self.tpot, i),
                e2el_ms: of(e2els, &self.e2el, i),
            })
            .collect()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    /// Generation requests with a 2xx status and a known end (vLLM's
    /// "successful"; see [`is_completed`]).
    pub completed: usize,
    /// Requests left out: error status, no status, no end seen, or not a
    /// generation (no first token and no token count: `/health`, …).
    pub not_completed: usize,
    /// Of `not_completed`, those that failed: an error status, no status
    /// or no end seen ([`is_failed`]); the rest are 2xx answers that
    /// generated nothing.
    pub failed: usize,
    /// First arrival to last end of the completed requests, seconds.
    pub duration_s: Option<f64>,
    pub total_input_tokens: u64,
    pub total_output_tokens: u64,
    /// Completed requests without `usage` token counts (out of TPOT,
    /// interactivity and the token totals).
    pub tokens_unknown: usize,
    pub request_throughput: Option<f64>,
    pub output_throughput: Option<f64>,
    pub total_token_throughput: Option<f64>,
    /// The percentiles computed for every distribution.
    pub percentiles: Vec<f64>,
    pub ttft_ms: Option<Dist>,
    pub tpot_ms: Option<Dist>,
    pub itl_ms: Option<Dist>,
    pub e2el_ms: Option<Dist>,
    /// AgentX: 1 / p90(E2E / output tokens), tokens per second.
    pub interactivity_p90_tok_s: Option<f64>,
    pub chains: Vec<ChainHitRate>,
    /// Per model the requests named, first seen first (empty when none
    /// named one).
    pub models: Vec<ModelSummary>,
    /// NVML samples in the recording, and the largest GPU memory of the
    /// traced processes over them (null without samples).
    pub gpu_samples: u64,
    pub peak_gpu_mem_bytes: Option<u64>,
    /// Of `failed`, those whose connection closed before their response
    /// ended: the client gave up (a timeout, a cancelled agent step).
    pub closed_early: usize,
    /// The completed requests that asked for structured output, beside the
    /// others (null when none did).
    pub structured_output: Option<StructuredSummary>,
    /// The completed streams whose first content left tokens after their
    /// first token (added 2026-12-06; null when no request has the count:
    /// it needs the engine IPC).
    pub first_content_held: Option<HeldSummary>,
}

/// What the server held back before the first content, over the completed
/// requests with `tokens_before_first_content`: how many had 2 tokens or
/// more by then, their mean held time, tokens and TTFT, and of them those
/// whose stream sent the held outputs as chunks without text (held, not
/// late: `requests[].empty_chunks_before_content` ≥ 1).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HeldSummary {
    pub requests: usize,
    /// Completed requests with the count (`requests` is of these).
    pub of_requests: usize,
    pub held_ms_mean: Option<f64>,
    pub tokens_mean: Option<f64>,
    pub ttft_ms_mean: Option<f64>,
    pub sent_without_text: usize,
}

/// A mean folded value by value (the summaries' accumulators: the same sums
/// in the same order whether the summary is made in memory or streamed).
#[derive(Debug, Default, Clone, Copy)]
struct Mean {
    sum: f64,
    n: usize,
}

impl Mean {
    fn add(&mut self, v: Option<f64>) {
        if let Some(v) = v {
            self.sum += v;
            self.n += 1;
        }
    }

    fn get(self) -> Option<f64> {
        (self.n > 0).then(|| self.sum / self.n as f64)
    }
}

/// [`HeldSummary`] folded request by request (in-memory and streamed alike).
#[derive(Debug, Default)]
pub struct HeldAcc {
    of: usize,
    held: Mean,
    tokens: Mean,
    ttft: Mean,
    without_text: usize,
}

impl HeldAcc {
    /// One completed request.
    pub fn add(&mut self, tokens: Option<u64>, held_ms: Option<f64>, ttft_ms: Option<f64>, empty_chunks: Option<u32>) {
        let Some(n) = tokens else { return };
        self.of += 1;
        if n < 2 {
            return;
        }
        self.held.add(held_ms);
        self.tokens.add(Some(n as f64));
        self.ttft.add(ttft_ms);
        self.without_text += usize::from(empty_chunks.is_some_and(|k| k > 0));
    }

    pub fn finish(&self) -> Option<HeldSummary> {
        (self.of > 0).then(|| HeldSummary {
            requests: self.tokens.n,
            of_requests: self.of,
            held_ms_mean: self.held.get(),
            tokens_mean: self.tokens.get(),
            ttft_ms_mean: self.ttft.get(),
            sent_without_text: self.without_text,
        })
    }
}

impl json::Value for HeldSummary {
    fn write(&self, b: &mut Vec<u8>, level: usize) {
        let mut o = json::Obj::new(b, level);
        o.field("requests", &self.requests)
            .field("of_requests", &self.of_requests)
            .field("held_ms_mean", &self.held_ms_mean)
            .field("tokens_mean", &self.tokens_mean)
            .field("ttft_ms_mean", &self.ttft_ms_mean)
            .field("sent_without_text", &self.sent_without_text);
        o.end();
    }
}

/// What structured output cost the completed requests that asked for it:
/// how many, by kind, and their mean scheduler's queue (where vLLM holds
/// them for their grammar) and TTFT beside the other completed requests'.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StructuredSummary {
    pub requests: usize,
    /// Per kind asked for, in [`crate::model::STRUCTURED_KINDS`] order (`other` last).
    pub kinds: Vec<KindCount>,
    /// Means over those with the figure (the scheduler's queue needs the
    /// engine's stamps); `others_*` over the other completed requests.
    pub scheduler_queue_ms_mean: Option<f64>,
    pub others_scheduler_queue_ms_mean: Option<f64>,
    pub ttft_ms_mean: Option<f64>,
    pub others_ttft_ms_mean: Option<f64>,
    /// Of `requests`, those the scheduler is known to have skipped (later
    /// requests went past them: `requests[].scheduler_passed_over_by` > 0),
    /// and the mean of their `scheduler_passed_over_ms`.
    pub passed_over_requests: usize,
    pub passed_over_ms_mean: Option<f64>,
    /// Of `requests`, those whose grammar is known to have been ready (a
    /// request of the same constraint was scheduled:
    /// `requests[].scheduler_grammar_ready_ms`), and the mean of their
    /// scheduler's queue after that: what held them once it was not the
    /// grammar (room, the step in progress).
    pub grammar_ready_requests: usize,
    pub after_grammar_ready_ms_mean: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct KindCount {
    pub kind: &'static str,
    pub requests: usize,
}

/// A request's `scheduler_passed_over_ms` only when later requests went past
/// it (`scheduler_passed_over_by` > 0): the proof that it was skipped, which
/// [`StructuredAcc::add`] takes.
pub fn skipped_ms(passed_over_by: Option<u32>, passed_over_ms: Option<f64>) -> Option<f64> {
    passed_over_by.filter(|n| *n > 0).and(passed_over_ms)
}

/// A request's scheduler's queue after its grammar was known ready
/// (`scheduler_grammar_ready_ms`), which [`StructuredAcc::add`] takes.
pub fn after_grammar_ms(scheduler_queue_ms: Option<f64>, grammar_ready_ms: Option<f64>) -> Option<f64> {
    Some((scheduler_queue_ms? - grammar_ready_ms?).max(0.0))
}

/// [`StructuredSummary`] folded request by request (the in-memory and the
/// streamed summary alike, in report order: the same sums, the same bits).
#[derive(Debug, Default)]
pub struct StructuredAcc {
    kinds: [usize; crate::model::STRUCTURED_KINDS.len() + 1],
    /// For the structured requests [0] and the others [1].
    sched: [Mean; 2],
    ttft: [Mean; 2],
    /// The structured requests' passed-over spans.
    passed: Mean,
    /// Their scheduler's queue after the grammar was ready.
    after_ready: Mean,
}

impl StructuredAcc {
    /// One completed request; `passed_over_ms` only when later requests went
    /// past it ([`ReqView::passed_over_ms`]); `after_grammar_ms` when its
    /// grammar is known ready ([`after_grammar_ms`]).
    pub fn add(&mut self, kind: Option<&str>, scheduler_queue_ms: Option<f64>, ttft_ms: Option<f64>, passed_over_ms: Option<f64>, after_grammar_ms: Option<f64>) {
        use crate::model::STRUCTURED_KINDS;
        let side = usize::from(kind.is_none());
        if let Some(k) = kind {
            self.kinds[STRUCTURED_KINDS.iter().position(|x| *x == k).unwrap_or(STRUCTURED_KINDS.len())] += 1;
        }
        // Only the structured requests' spans: their grammar's.
        let passed_over_ms = passed_over_ms.filter(|_| kind.is_some());
        let after_grammar_ms = after_grammar_ms.filter(|_| kind.is_some());
        self.sched[side].add(scheduler_queue_ms);
        self.ttft[side].add(ttft_ms);
        self.passed.add(passed_over_ms);
        self.after_ready.add(after_grammar_ms);
    }

    pub fn finish(&self) -> Option<StructuredSummary> {
        use crate::model::{STRUCTURED_KINDS, STRUCTURED_OTHER};
        let requests: usize = self.kinds.iter().sum();
        if requests == 0 {
            return None;
        }
        let kinds = self.kinds.iter().enumerate().filter(|(_, n)| **n > 0).map(|(i, n)| KindCount { kind: STRUCTURED_KINDS.get(i).copied().unwrap_or(STRUCTURED_OTHER), requests: *n }).collect();
        Some(StructuredSummary {
            requests,
            kinds,
            scheduler_queue_ms_mean: self.sched[0].get(),
            others_scheduler_queue_ms_mean: self.sched[1].get(),
            ttft_ms_mean: self.ttft[0].get(),
            others_ttft_ms_mean: self.ttft[1].get(),
            passed_over_requests: self.passed.n,
            passed_over_ms_mean: self.passed.get(),
            grammar_ready_requests: self.after_ready.n,
            after_grammar_ready_ms_mean: self.after_ready.get(),
        })
    }
}

impl json::Value for StructuredSummary {
    fn write(&self, b: &mut Vec<u8>, level: usize) {
        let mut o = json::Obj::new(b, level);
        o.field("requests", &self.requests)
            .field("kinds", &self.kinds)
            .field("scheduler_queue_ms_mean", &self.scheduler_queue_ms_mean)
            .field("others_scheduler_queue_ms_mean", &self.others_scheduler_queue_ms_mean)
            .field("ttft_ms_mean", &self.ttft_ms_mean)
            .field("others_ttft_ms_mean", &self.others_ttft_ms_mean)
            .field("passed_over_requests", &self.passed_over_requests)
            .field("passed_over_ms_mean", &self.passed_over_ms_mean)
            .field("grammar_ready_requests", &self.grammar_ready_requests)
            .field("after_grammar_ready_ms_mean", &self.after_grammar_ready_ms_mean);
        o.end();
    }
}

impl json::Value for KindCount {
    fn write(&self, b: &mut Vec<u8>, level: usize) {
        let mut o = json::Obj::new(b, level);
        o.field("kind", self.kind).field("requests", &self.requests);
        o.end();
    }
}

/// `np.percentile`'s label: `99` → `p99`, `99.9` → `p99.9`.
pub fn percentile_key(p: f64) -> String {
    if p.fract() == 0.0 {
        format!("p{}", p as i64)
    } else {
        format!("p{p}")
    }
}

/// Parses one percentile of `--percentiles 50,90,99` (0..=100).
pub fn parse_percentile(s: &str) -> Result<f64, String> {
    let part = s.trim();
    let p: f64 = part.parse().map_err(|_| format!("invalid percentile {part:?}: expected numbers like 50,90,99"))?;
    if !(0.0..=100.0).contains(&p) {
        return Err(format!("percentile {p} is outside 0..100"));
    }
    Ok(p)
}

/// Parses `50,90,99` (each in 0..=100).
pub fn parse_percentiles(s: &str) -> Result<Vec<f64>, String> {
    let mut v = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        v.push(parse_percentile(part)?);
    }
    if v.is_empty() {
        return Err("no percentiles given: expected e.g. 50,90,99".into());
    }
    Ok(v)
}

/// Mean, median, population std and the percentiles of `xs`; `None` when empty.
pub fn dist(xs: &[f64], percentiles: &[f64]) -> Option<Dist> {
    dist_of(xs.to_vec(), percentiles)
}

/// `x` as an integer that orders as `f64::total_cmp` orders the floats:
/// sorted and merged as integers, which compare in one instruction.
pub(crate) fn total_key(x: f64) -> u64 {
    let b = x.to_bits();
    // Negative floats order backwards: flip all but the sign for them (what
    // total_cmp does), then the sign so that unsigned order is signed order.
    (b ^ ((((b as i64) >> 63) as u64) >> 1)) ^ (1 << 63)
}

/// Sorts `keys` ascending: an LSD radix sort by bytes for the large
/// distributions (ITLs, one value per request), skipping the bytes every key
/// shares (a distribution's values mostly share their exponent). pdqsort
/// compares ~log2(n) times per key (20 at a million); this reads each key
/// once to count and once per byte that differs: ~5x fewer instructions on
/// the 20 000-request file's summary.
pub(crate) fn sort_keys(keys: &mut Vec<u64>) {
    if keys.len() < 512 {
        keys.sort_unstable();
        return;
    }
    let mut counts = vec![[0usize; 256]; 8];
    for &k in keys.iter() {
        for (d, c) in counts.iter_mut().enumerate() {
            c[(k >> (8 * d)) as u8 as usize] += 1;
        }
    }
    let n = keys.len();
    let mut other = vec![0u64; n];
    for (d, c) in counts.iter_mut().enumerate() {
        // Every key has this byte: the pass would not move anything.
        if c.contains(&n) {
            continue;
        }
        let mut at = 0;
        for x in c.iter_mut() {
            let here = *x;
            *x = at;
            at += here;
        }
        for &k in keys.iter() {
            let b = (k >> (8 * d)) as u8 as usize;
            other[c[b]] = k;
            c[b] += 1;
        }
        std::mem::swap(keys, &mut other);
    }
}

/// The float of a [`total_key`].
pub(crate) fn from_total_key(k: u64) -> f64 {
    let b = k ^ (1 << 63);
    f64::from_bits(b ^ ((((b as i64) >> 63) as u64) >> 1))
}

/// [`dist`] of a vector it may reorder.
pub fn dist_of(s: Vec<f64>, percentiles: &[f64]) -> Option<Dist> {
    if s.is_empty() {
        return None;
    }
    // Values equal under total_cmp are the same bits: unstable is stable
    // here. Sorted as integers in place (same size: the Vec is reused).
    let mut keys: Vec<u64> = s.into_iter().map(total_key).collect();
    sort_keys(&mut keys);
    let s: Vec<f64> = keys.into_iter().map(from_total_key).collect();
    let n = s.len();
    let mean = s.iter().sum::<f64>() / n as f64;
    let var = s.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
    Some(Dist {
        n,
        mean,
        median: percentile(&s, 50.0)?,
        std: var.sqrt(),
        percentiles: percentiles.iter().filter_map(|&p| Some((percentile_key(p), percentile(&s, p)?))).collect(),
    })
}

impl json::Value for Dist {
    fn write(&self, b: &mut Vec<u8>, level: usize) {
        let mut o = json::Obj::new(b, level);
        o.field("n", &self.n).field("mean", &self.mean).field("median", &self.median).field("std", &self.std).field("percentiles", &self.percentiles);
        o.end();
    }
}

impl json::Value for ModelSummary {
    fn write(&self, b: &mut Vec<u8>, level: usize) {
        let mut o = json::Obj::new(b, level);
        o.field("model", &self.model)
            .field("completed", &self.completed)
            .field("total_output_tokens", &self.total_output_tokens)
            .field("ttft_ms", &self.ttft_ms)
            .field("tpot_ms", &self.tpot_ms)
            .field("e2el_ms", &self.e2el_ms);
        o.end();
    }
}

impl json::Value for ChainHitRate {
    fn write(&self, b: &mut Vec<u8>, level: usize) {
        let mut o = json::Obj::new(b, level);
        o.field("chain", &self.chain)
            .field("cached_tokens", &self.cached_tokens)
            .field("prompt_tokens", &self.prompt_tokens)
            .field("hit_rate", &self.hit_rate)
            .field("hops_unknown", &self.hops_unknown);
        o.end();
    }
}

/// The bytes of `to_writer_pretty` (sink::json), for the streamed report.
impl json::Value for Summary {
    fn write(&self, b: &mut Vec<u8>, level: usize) {
        // Never handed on: nothing is written to the sink.
        let _ = self.write_json(b, level, usize::MAX, &mut std::io::sink());
    }
}

impl Summary {
    /// [`json::Value::write`], handing `b` to `out` whenever it holds
    /// `chunk` bytes: the chains' list grows with the run.
    pub fn write_json(&self, b: &mut Vec<u8>, level: usize, chunk: usize, out: &mut dyn std::io::Write) -> std::io::Result<()> {
        let mut o = json::Obj::new(b, level);
        o.field("completed", &self.completed)
            .field("not_completed", &self.not_completed)
            .field("failed", &self.failed)
            .field("duration_s", &self.duration_s)
            .field("total_input_tokens", &self.total_input_tokens)
            .field("total_output_tokens", &self.total_output_tokens)
            .field("tokens_unknown", &self.tokens_unknown)
            .field("request_throughput", &self.request_throughput)
            .field("output_throughput", &self.output_throughput)
            .field("total_token_throughput", &self.total_token_throughput)
            .field("percentiles", &self.percentiles)
            .field("ttft_ms", &self.ttft_ms)
            .field("tpot_ms", &self.tpot_ms)
            .field("itl_ms", &self.itl_ms)
            .field("e2el_ms", &self.e2el_ms)
            .field("interactivity_p90_tok_s", &self.interactivity_p90_tok_s)
            .array_flushed("chains", &self.chains, chunk, out)?
            .field("models", &self.models)
            .field("gpu_samples", &self.gpu_samples)
            .field("peak_gpu_mem_bytes", &self.peak_gpu_mem_bytes)
            .field("closed_early", &self.closed_early)
            .field("structured_output", &self.structured_output)
            .field("first_content_held", &self.first_content_held);
        o.end();
        Ok(())
    }
}

/// vLLM's TPOT of one request, ms: `(e2e - ttft) / (output_tokens - 1)` when
/// more than one token came out.
pub fn tpot_ms(e2e_ms: f64, ttft_ms: f64, output_tokens: u64) -> Option<f64> {
    (output_tokens > 1).then(|| (e2e_ms - ttft_ms) / (output_tokens - 1) as f64)
}

/// The figures of one request the summary needs (a view of [`RequestOut`]).
#[derive(Debug, Clone, Default)]
pub struct ReqView<'a> {
    pub id: &'a str,
    pub status: Option<u16>,
    pub arrive_ns: u64,
    pub done_ns: Option<u64>,
    pub ttft_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
    pub itl_ms: &'a [f64],
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub peak_gpu_mem_bytes: Option<u64>,
    pub model: Option<&'a str>,
    /// Its connection closed before its response ended.
    pub closed: bool,
    pub structured_output: Option<&'a str>,
    pub scheduler_queue_ms: Option<f64>,
    /// Its `scheduler_passed_over_ms`, only when later requests went past it.
    pub passed_over_ms: Option<f64>,
    /// Its scheduler's queue after its grammar was known ready ([`after_grammar_ms`]).
    pub after_grammar_ms: Option<f64>,
    pub tokens_before_first_content: Option<u64>,
    pub first_output_held_ms: Option<f64>,
    pub empty_chunks_before_content: Option<u32>,
}

impl<'a> From<&'a RequestOut> for ReqView<'a> {
    fn from(q: &'a RequestOut) -> Self {
        ReqView {
            id: &q.id,
            status: q.status,
            arrive_ns: q.arrive_ns,
            done_ns: q.done_ns,
            ttft_ms: q.ttft_ms,
            e2e_ms: q.e2e_ms,
            itl_ms: &q.itl_ms,
            prompt_tokens: q.prompt_tokens,
            completion_tokens: q.completion_tokens,
            cached_tokens: q.cached_tokens,
            peak_gpu_mem_bytes: q.peak_gpu_mem_bytes,
            model: q.model.as_deref(),
            closed: q.closed_ns.is_some(),
            structured_output: q.structured_output.as_deref(),
            scheduler_queue_ms: q.scheduler_queue_ms,
            passed_over_ms: skipped_ms(q.scheduler_passed_over_by, q.scheduler_passed_over_ms),
            after_grammar_ms: after_grammar_ms(q.scheduler_queue_ms, q.scheduler_grammar_ready_ms),
            tokens_before_first_content: q.tokens_before_first_content,
            first_output_held_ms: q.first_output_held_ms,
            empty_chunks_before_content: q.empty_chunks_before_content,
        }
    }
}

/// A chain: its key and its hops' request ids, in order.
#[derive(Debug, Clone)]
pub struct ChainView<'a> {
    pub chain: &'a str,
    pub hops: &'a [String],
}

fn completed(q: &ReqView) -> bool {
    is_completed(q.status, q.e2e_ms, q.ttft_ms, q.completion_tokens)
}

/// vLLM bench's "successful request", for a server that also answers other
/// paths: a 2xx with a known end that generated (a first token or a token
/// count); `/health`, `/metrics` and the like are left out, counted apart
/// from the failures ([`is_failed`]).
pub fn is_completed(status: Option<u16>, e2e_ms: Option<f64>, ttft_ms: Option<f64>, completion_tokens: Option<u64>) -> bool {
    !is_failed(status, e2e_ms) && (ttft_ms.is_some() || completion_tokens.is_some())
}

/// A request that did not end well: not a 2xx, no status, or no end seen.
pub fn is_failed(status: Option<u16>, e2e_ms: Option<f64>) -> bool {
    !(status.is_some_and(|s| (200..300).contains(&s)) && e2e_ms.is_some())
}

/// The summary of a report's requests and chains (chains keyed by their
/// connection alone, with one hop, are not chains users asked about and are
/// left out, as in the text report).
pub fn compute(requests: &[RequestOut], chains: &[ChainOut], percentiles: &[f64]) -> Summary {
    let reqs: Vec<ReqView> = requests.iter().map(ReqView::from).collect();
    let chains: Vec<ChainView> = chains.iter().filter(|c| c.hops.len() > 1 || c.source != "connection").map(|c| ChainView { chain: &c.chain, hops: &c.hops }).collect();
    compute_views(&reqs, &chains, percentiles)
}

/// [`compute`] on views.
pub fn compute_views(requests: &[ReqView], chains: &[ChainView], percentiles: &[f64]) -> Summary {
    let done: Vec<&ReqView> = requests.iter().filter(|q| completed(q)).collect();
    let mut ttfts = Vec::new();
    let mut tpots = Vec::new();
    let mut itls = Vec::new();
    let mut e2els = Vec::new();
    let mut per_token_s = Vec::new();
    let (mut total_in, mut total_out, mut tokens_unknown) = (0u64, 0u64, 0usize);
    let mut models = Models::default();
    let mut structured = StructuredAcc::default();
    let mut held = HeldAcc::default();
    for q in &done {
        held.add(q.tokens_before_first_content, q.first_output_held_ms, q.ttft_ms, q.empty_chunks_before_content);
        let e2e = q.e2e_ms.unwrap_or_default();
        structured.add(q.structured_output, q.scheduler_queue_ms, q.ttft_ms, q.passed_over_ms, q.after_grammar_ms);
        let slot = models.slot(q.model, q.completion_tokens);
        e2els.push(e2e);
        models.e2el.push(slot);
        if let Some(t) = q.ttft_ms {
            ttfts.push(t);
            models.ttft.push(slot);
        }
        itls.extend_from_slice(q.itl_ms);
        match (q.prompt_tokens, q.completion_tokens) {
            (Some(i), Some(o)) => {
                total_in += i;
                total_out += o;
            }
            _ => tokens_unknown += 1,
        }
        if let Some(o) = q.completion_tokens {
            if let Some(t) = q.ttft_ms.and_then(|t| tpot_ms(e2e, t, o)) {
                tpots.push(t);
                models.tpot.push(slot);
            }
            if o > 0 {
                per_token_s.push(e2e / 1e3 / o as f64);
            }
        }
    }
    let first = done.iter().map(|q| q.arrive_ns).min();
    let last = done.iter().filter_map(|q| q.done_ns).max();
    let duration_s = match (first, last) {
        (Some(f), Some(l)) if l > f => Some((l - f) as f64 / 1e9),
        _ => None,
    };
    let rate = |x: f64| duration_s.map(|d| x / d);
    per_token_s.sort_by(f64::total_cmp);
    let per_model = models.summaries(&ttfts, &tpots, &e2els, percentiles);
    Summary {
        completed: done.len(),
        not_completed: requests.len() - done.len(),
        failed: requests.iter().filter(|q| is_failed(q.status, q.e2e_ms)).count(),
        closed_early: requests.iter().filter(|q| q.closed && is_failed(q.status, q.e2e_ms)).count(),
        duration_s,
        total_input_tokens: total_in,
        total_output_tokens: total_out,
        tokens_unknown,
        request_throughput: rate(done.len() as f64),
        output_throughput: rate(total_out as f64),
        total_token_throughput: rate((total_in + total_out) as f64),
        percentiles: percentiles.to_vec(),
        ttft_ms: dist(&ttfts, percentiles),
        tpot_ms: dist(&tpots, percentiles),
        itl_ms: dist(&itls, percentiles),
        e2el_ms: dist(&e2els, percentiles),
        interactivity_p90_tok_s: percentile(&per_token_s, 90.0).filter(|p| *p > 0.0).map(|p| 1.0 / p),
        chains: {
            // One lookup for every chain: built per chain it made the summary
            // quadratic in the requests.
            let by_id: HashMap<&str, &ReqView> = if chains.is_empty() { HashMap::new() } else { requests.iter().map(|q| (q.id, q)).collect() };
            chains.iter().map(|c| chain_hit_rate(c, &by_id)).collect()
        },
        models: per_model,
        gpu_samples: 0,
        peak_gpu_mem_bytes: requests.iter().filter_map(|q| q.peak_gpu_mem_bytes).max(),
        structured_output: structured.finish(),
        first_content_held: held.finish(),
    }
}

fn chain_hit_rate(c: &ChainView, by_id: &HashMap<&str, &ReqView>) -> ChainHitRate {
    let (mut cached, mut prompt, mut unknown) = (0u64, 0u64, 0usize);
    for id in c.hops {
        match by_id.get(id.as_str()).and_then(|q| Some((q.cached_tokens?, q.prompt_tokens?))) {
            Some((ca, p)) => {
                cached += ca;
                prompt += p;
            }
            None => unknown += 1,
        }
    }
    ChainHitRate {
        chain: c.chain.to_owned(),
        cached_tokens: cached,
        prompt_tokens: prompt,
        hit_rate: (prompt > 0).then(|| cached as f64 / prompt as f64),
        hops_unknown: unknown,
    }
}

/// How long an NVML sample taken before a request arrived still describes the
/// memory at its arrival (memory is a level; a request shorter than the
/// sampling period would otherwise see no sample at all).
pub const SAMPLE_MAX_AGE_NS: u64 = 1_000_000_000;

/// GPU memory of the traced processes over time, from `Record::GpuSample`:
/// one point per sampling instant, summed over devices and processes.
#[derive(Debug, Default, Clone)]
pub struct GpuMemIndex {
    points: BTreeMap<u64, u64>,
    samples: u64,
}

impl GpuMemIndex {
    pub fn ingest(&mut self, r: &Record) {
        if let Record::GpuSample { ts_ns, process_mem, .. } = r {
            self.samples += 1;
            *self.points.entry(*ts_ns).or_default() += process_mem.iter().map(|(_, b)| b).sum::<u64>();
        }
    }

    pub fn samples(&self) -> u64 {
        self.samples
    }

    /// Forgets the points before `ts_ns` (a live reader's bound: no request
    /// still to come arrived that early), keeping the one in effect then.
    pub fn forget_before(&mut self, ts_ns: u64) {
        let Some((&keep, _)) = self.points.range(..ts_ns).next_back() else { return };
        self.points = self.points.split_off(&keep);
    }

    /// A request's peak ([`GpuMemIndex::peak`] from its arrival to its end,
    /// or at its arrival when it has none); `None` without samples.
    pub fn peak_during(&self, arrive_ns: u64, done_ns: Option<u64>) -> Option<u64> {
        if self.samples == 0 {
            return None;
        }
        self.peak(arrive_ns, done_ns.unwrap_or(arrive_ns))
    }

    /// Largest traced-process GPU memory between `from_ns` and `to_ns`,
    /// counting the level in effect at `from_ns` (the last earlier sample, if
    /// younger than [`SAMPLE_MAX_AGE_NS`]).
    pub fn peak(&self, from_ns: u64, to_ns: u64) -> Option<u64> {
        let inside = self.points.range(from_ns..=to_ns.max(from_ns)).map(|(_, b)| *b).max();
        let before = self.points.range(..from_ns).next_back().filter(|(t, _)| from_ns - **t <= SAMPLE_MAX_AGE_NS).map(|(_, b)| *b);
        inside.max(before)
    }

    /// Fills each request's `peak_gpu_mem_bytes` and the summary's GPU figures.
    pub fn apply(&self, requests: &mut [RequestOut], summary: &mut Summary) {
        if self.samples == 0 {
            return;
        }
        for q in requests.iter_mut() {
            q.peak_gpu_mem_bytes = self.peak_during(q.arrive_ns, q.done_ns);
        }
        summary.gpu_samples = self.samples;
        summary.peak_gpu_mem_bytes = self.points.values().copied().max();
    }
}

fn line(s: &mut String, label: &str, v: impl std::fmt::Display) {
    let _ = writeln!(s, "{:<40} {:<10}", label, v);
}

fn f2(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{x:.2}"))
}

/// The summary in `vllm bench serve`'s layout (50-column banners, `{:<40}`
/// labels, two decimals).
pub fn render_text(sm: &Summary) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "{:=^50}", " Serving Summary (hopscope, server side) ");
    line(&mut s, "Successful requests:", sm.completed);
    line(&mut s, "Failed or unfinished requests:", sm.failed);
    if sm.closed_early > 0 {
        line(&mut s, "  of which the client gave up on:", sm.closed_early);
    }
    line(&mut s, "Other requests (no tokens: /health, …):", sm.not_completed - sm.failed);
    line(&mut s, "Duration (s):", f2(sm.duration_s));
    line(&mut s, "Total input tokens:", sm.total_input_tokens);
    line(&mut s, "Total generated tokens:", sm.total_output_tokens);
    if sm.tokens_unknown > 0 {
        line(&mut s, "Requests without token counts:", sm.tokens_unknown);
    }
    line(&mut s, "Request throughput (req/s):", f2(sm.request_throughput));
    line(&mut s, "Output token throughput (tok/s):", f2(sm.output_throughput));
    line(&mut s, "Total Token throughput (tok/s):", f2(sm.total_token_throughput));
    for (title, short, d) in [
        ("Time to First Token", "TTFT", &sm.ttft_ms),
        ("Time per Output Token (excl. 1st token)", "TPOT", &sm.tpot_ms),
        ("Inter-token Latency", "ITL", &sm.itl_ms),
        ("End-to-end Latency", "E2EL", &sm.e2el_ms),
    ] {
        let _ = writeln!(s, "{:-^50}", title);
        match d {
            None => line(&mut s, &format!("{short} (ms):"), "-"),
            Some(d) => {
                line(&mut s, &format!("Mean {short} (ms):"), format!("{:.2}", d.mean));
                line(&mut s, &format!("Median {short} (ms):"), format!("{:.2}", d.median));
                for p in &sm.percentiles {
                    let k = percentile_key(*p);
                    if let Some(v) = d.percentiles.get(&k) {
                        line(&mut s, &format!("P{} {short} (ms):", &k[1..]), format!("{v:.2}"));
                    }
                }
            }
        }
    }
    let _ = writeln!(s, "{:-^50}", "Interactivity (AgentX)");
    line(&mut s, "P90 E2E-normalised (tok/s):", f2(sm.interactivity_p90_tok_s));
    if !sm.chains.is_empty() {
        let _ = writeln!(s, "{:-^50}", "Prefix cache hit rate per chain");
        for c in &sm.chains {
            let v = c.hit_rate.map_or_else(|| "-".into(), |h| format!("{:.2}%", h * 100.0));
            line(&mut s, &format!("{}:", trunc(&c.chain, 38)), v);
        }
    }
    // Per model only when there is more than one to tell apart.
    if sm.models.len() > 1 {
        let _ = writeln!(s, "{:-^50}", "Per model (median TTFT / E2EL, ms)");
        for m in &sm.models {
            let med = |d: &Option<Dist>| d.as_ref().map_or_else(|| "-".into(), |d| format!("{:.2}", d.median));
            let name = m.model.as_deref().unwrap_or("(none named)");
            line(&mut s, &format!("{} ({} req):", trunc(name, 30), m.completed), format!("{} / {}", med(&m.ttft_ms), med(&m.e2el_ms)));
        }
    }
    if let Some(so) = &sm.structured_output {
        let _ = writeln!(s, "{:-^50}", "Structured output (vs the others)");
        let kinds: Vec<String> = so.kinds.iter().map(|k| format!("{} {}", k.kind, k.requests)).collect();
        line(&mut s, "Requests asking for it:", format!("{} ({})", so.requests, kinds.join(", ")));
        line(&mut s, "Scheduler queue mean, them/others (ms):", format!("{} / {}", f2(so.scheduler_queue_ms_mean), f2(so.others_scheduler_queue_ms_mean)));
        line(&mut s, "TTFT mean, them/others (ms):", format!("{} / {}", f2(so.ttft_ms_mean), f2(so.others_ttft_ms_mean)));
        // Only with proof: later requests went past them.
        if so.passed_over_requests > 0 {
            line(&mut s, "Skipped for their grammar (mean ms):", format!("{} ({})", so.passed_over_requests, f2(so.passed_over_ms_mean)));
        }
        // Only where a request of the same constraint says when it was ready.
        if so.grammar_ready_requests > 0 {
            line(&mut s, "Queued after their grammar (mean ms):", format!("{} ({})", so.grammar_ready_requests, f2(so.after_grammar_ready_ms_mean)));
        }
    }
    if let Some(h) = sm.first_content_held.as_ref().filter(|h| h.requests > 0) {
        let _ = writeln!(s, "{:-^50}", "First content held back (2+ tokens)");
        line(&mut s, "Requests:", format!("{} of {}", h.requests, h.of_requests));
        line(&mut s, "Held mean (ms):", f2(h.held_ms_mean));
        line(&mut s, "Tokens by the first content, mean:", f2(h.tokens_mean));
        line(&mut s, "Their TTFT mean (ms):", f2(h.ttft_ms_mean));
        // Only a chat or completions stream shows it.
        line(&mut s, "Sent as chunks without text:", h.sent_without_text);
    }
    if sm.gpu_samples > 0 {
        let _ = writeln!(s, "{:-^50}", "GPU memory (NVML)");
        line(&mut s, "Samples:", sm.gpu_samples);
        line(&mut s, "Peak traced-process memory (MiB):", sm.peak_gpu_mem_bytes.map_or_else(|| "-".into(), |b| format!("{:.1}", b as f64 / (1u64 << 20) as f64)));
    }
    let _ = writeln!(s, "{}", "=".repeat(50));
    s
}


#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    #[allow(clippy::too_many_arguments)]
    fn req<'a>(id: &'a str, status: u16, arrive_ms: u64, e2e_ms: Option<f64>, ttft_ms: f64, itl: &'a [f64], tokens: (u64, u64), cached: Option<u64>) -> ReqView<'a> {
        ReqView {
            id,
            status: Some(status),
            arrive_ns: arrive_ms * 1_000_000,
            done_ns: e2e_ms.map(|e| arrive_ms * 1_000_000 + (e * 1e6) as u64),
            ttft_ms: Some(ttft_ms),
            e2e_ms,
            itl_ms: itl,
            prompt_tokens: Some(tokens.0),
            completion_tokens: Some(tokens.1),
            cached_tokens: cached,
            peak_gpu_mem_bytes: None,
            model: None,
            closed: false,
            structured_output: None,
            scheduler_queue_ms: None,
            passed_over_ms: None,
            after_grammar_ms: None,
            tokens_before_first_content: None,
            first_output_held_ms: None,
            empty_chunks_before_content: None,
        }
    }

    /// The first contents held back: over the completed requests with a
    /// token count, those with 2 or more, their means, and those whose
    /// stream sent the held outputs without text; null without any count.
    #[test]
    fn first_contents_held_back_are_summed_over_the_completed_requests_with_a_count() {
        let held = |q: ReqView<'static>, tokens: Option<u64>, ms: Option<f64>, empty: Option<u32>| ReqView { tokens_before_first_content: tokens, first_output_held_ms: ms, empty_chunks_before_content: empty, ..q };
        let reqs = [
            held(req("a", 200, 0, Some(100.0), 40.0, &[], (10, 8), None), Some(13), Some(30.0), Some(12)),
            held(req("b", 200, 10, Some(100.0), 20.0, &[], (10, 8), None), Some(5), Some(10.0), Some(0)),
            held(req("c", 200, 20, Some(100.0), 10.0, &[], (10, 8), None), Some(1), Some(0.0), Some(0)),
            held(req("d", 200, 30, Some(100.0), 10.0, &[], (10, 8), None), None, None, None),
            // Not completed: left out.
            held(req("e", 500, 40, Some(100.0), 90.0, &[], (10, 8), None), Some(9), Some(80.0), Some(8)),
        ];
        let sm = compute_views(&reqs, &[], DEFAULT_PERCENTILES);
        let h = sm.first_content_held.as_ref().expect("counts");
        assert_eq!((h.requests, h.of_requests, h.sent_without_text), (2, 3, 1));
        assert_eq!((h.held_ms_mean, h.tokens_mean, h.ttft_ms_mean), (Some(20.0), Some(9.0), Some(30.0)));
        let text = render_text(&sm);
        assert!(text.contains("First content held back (2+ tokens)") && text.contains("2 of 3"), "{text}");
        let none = compute_views(&[reqs[3].clone()], &[], DEFAULT_PERCENTILES);
        assert!(none.first_content_held.is_none() && !render_text(&none).contains("held back"));
    }

    /// Each model's completed requests apart, hand-computed; the text shows
    /// them once there are two; none without a model named.
    #[test]
    fn each_model_named_has_its_own_figures() {
        let named = |q: ReqView<'static>, m: &'static str| ReqView { model: Some(m), ..q };
        let reqs = [
            named(req("a", 200, 1000, Some(500.0), 100.0, &[], (100, 5), None), "x"),
            named(req("b", 200, 1200, Some(800.0), 200.0, &[], (200, 2), None), "x"),
            named(req("c", 200, 1300, Some(100.0), 100.0, &[], (10, 1), None), "lora/y"),
            // Failed: in no model's figures.
            named(req("d", 500, 1100, Some(5.0), 5.0, &[], (10, 0), None), "z"),
            req("e", 200, 1400, Some(40.0), 10.0, &[], (10, 3), None),
        ];
        let s = compute_views(&reqs, &[], &[50.0]);
        let names: Vec<Option<&str>> = s.models.iter().map(|m| m.model.as_deref()).collect();
        assert_eq!(names, [Some("x"), Some("lora/y"), None]);
        let x = &s.models[0];
        assert_eq!((x.completed, x.total_output_tokens), (2, 7));
        close(x.ttft_ms.as_ref().unwrap().median, 150.0);
        close(x.e2el_ms.as_ref().unwrap().median, 650.0);
        // TPOT: (500-100)/4 = 100, (800-200)/1 = 600.
        close(x.tpot_ms.as_ref().unwrap().mean, 350.0);
        let y = &s.models[1];
        assert_eq!((y.completed, y.tpot_ms.is_none()), (1, true), "one token: no TPOT");
        close(y.e2el_ms.as_ref().unwrap().mean, 100.0);
        assert_eq!(s.models[2].completed, 1);
        let text = render_text(&s);
        assert!(text.contains("Per model (median TTFT / E2EL, ms)"), "{text}");
        assert!(text.lines().any(|l| l.starts_with("x (2 req):") && l.ends_with("150.00 / 650.00")), "{text}");
        assert!(text.lines().any(|l| l.starts_with("(none named) (1 req):")), "{text}");
        // No model named anywhere: no per-model figures, no section.
        let plain = example();
        assert!(plain.models.is_empty());
        assert!(!render_text(&plain).contains("Per model"));
    }

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() < 1e-9, "{a} != {b}");
    }

    /// A live reader drops the points no request to come can reach, and
    /// keeps the one in effect at the bound (a request arriving then starts at
    /// that level).
    #[test]
    fn forgetting_old_gpu_memory_points_keeps_the_level_in_effect() {
        let mut g = GpuMemIndex::default();
        for (t, b) in [(100, 5), (200, 9), (300, 7), (400, 6)] {
            g.ingest(&sample(t, 0, vec![(1, b)]));
        }
        g.forget_before(350);
        assert_eq!(g.points.keys().copied().collect::<Vec<_>>(), vec![300, 400]);
        assert_eq!(g.peak(350, 450), Some(7), "the level at 350 counts");
        g.forget_before(50);
        assert_eq!(g.points.len(), 2, "nothing before the first point: nothing forgotten");
    }

    #[test]
    fn the_radix_sort_orders_keys_as_the_comparison_sort_does() {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            x.wrapping_mul(0x2545_F491_4F6C_DD1D)
        };
        // Sizes either side of the cut-over; keys that share their high
        // bytes (a distribution's floats), that differ only there, all
        // equal, full-range, and floats of both signs with NaNs and zeros.
        for n in [0usize, 1, 511, 512, 513, 5000, 70_000] {
            let floats: Vec<u64> = (0..n)
                .map(|i| match i % 7 {
                    0 => total_key(f64::NAN),
                    1 => total_key(-0.0),
                    2 => total_key(0.0),
                    3 => total_key(-((next() % 1000) as f64) / 7.0),
                    _ => total_key((next() % 100_000) as f64 / 1000.0),
                })
                .collect();
            let cases = [
                (0..n).map(|_| 0x4029_0000_0000_0000 | (next() & 0xffff_ffff)).collect::<Vec<u64>>(),
                (0..n).map(|_| next() << 56).collect(),
                vec![7u64; n],
                (0..n).map(|_| next()).collect(),
                floats,
            ];
            for keys in cases {
                let mut want = keys.clone();
                want.sort_unstable();
                let mut got = keys;
                sort_keys(&mut got);
                assert_eq!(got, want, "{n} keys");
            }
        }
    }

    fn example() -> Summary {
        let hops = vec!["a".to_owned(), "b".to_owned(), "c".to_owned()];
        let reqs = [
            req("a", 200, 1000, Some(500.0), 100.0, &[10.0, 20.0, 30.0], (100, 5), Some(50)),
            req("b", 200, 1200, Some(800.0), 200.0, &[40.0], (200, 2), Some(0)),
            req("c", 200, 1300, Some(100.0), 100.0, &[], (10, 1), None),
            req("d", 500, 1100, Some(5.0), 5.0, &[], (10, 0), None),
            req("e", 200, 1400, None, 50.0, &[99.0], (10, 3), None),
            // GET /health: 200, an end, but nothing generated.
            ReqView { id: "h", status: Some(200), arrive_ns: 900_000_000, done_ns: Some(3_000_000_000), e2e_ms: Some(2100.0), ..ReqView::default() },
        ];
        let leaked: &'static [String] = Box::leak(hops.into_boxed_slice());
        compute_views(&reqs, &[ChainView { chain: "s1", hops: leaked }], &[50.0, 90.0, 99.0])
    }

    /// The completed requests that asked for structured output beside the
    /// others, hand-computed; failed ones count in neither; the text shows it
    /// only when some asked.
    #[test]
    fn structured_output_requests_are_summed_apart_from_the_others() {
        let so = |q: ReqView<'static>, kind: Option<&'static str>, sched: Option<f64>| ReqView { structured_output: kind, scheduler_queue_ms: sched, ..q };
        let passed = |q: ReqView<'static>, ms: f64| ReqView { passed_over_ms: Some(ms), ..q };
        let ready = |q: ReqView<'static>, ms: f64| ReqView { after_grammar_ms: Some(ms), ..q };
        let reqs = [
            passed(so(req("a", 200, 1000, Some(500.0), 100.0, &[], (100, 5), None), Some("json"), Some(40.0)), 35.5),
            ready(so(req("b", 200, 1100, Some(500.0), 300.0, &[], (100, 5), None), Some("json"), Some(20.0)), 16.25),
            so(req("c", 200, 1200, Some(500.0), 50.0, &[], (100, 5), None), Some("regex"), None),
            so(req("d", 200, 1300, Some(500.0), 20.0, &[], (100, 5), None), None, Some(1.0)),
            // Passed over without a constraint: not the grammar's.
            passed(so(req("e", 200, 1400, Some(500.0), 30.0, &[], (100, 5), None), None, Some(2.0)), 1.5),
            // Failed: in neither.
            so(req("f", 500, 1500, Some(5.0), 5.0, &[], (10, 0), None), Some("json"), Some(900.0)),
        ];
        let s = compute_views(&reqs, &[], &[50.0]);
        let got = s.structured_output.as_ref().expect("three asked");
        let kinds: Vec<(&str, usize)> = got.kinds.iter().map(|k| (k.kind, k.requests)).collect();
        assert_eq!((got.requests, kinds), (3, vec![("json", 2), ("regex", 1)]));
        assert_eq!((got.scheduler_queue_ms_mean, got.others_scheduler_queue_ms_mean), (Some(30.0), Some(1.5)));
        assert_eq!((got.ttft_ms_mean, got.others_ttft_ms_mean), (Some(150.0), Some(25.0)));
        let text = render_text(&s);
        assert!(text.contains("Requests asking for it:                  3 (json 2, regex 1)"), "{text}");
        assert!(text.contains("Scheduler queue mean, them/others (ms):  30.00 / 1.50"), "{text}");
        assert!(text.contains("TTFT mean, them/others (ms):             150.00 / 25.00"), "{text}");
        assert_eq!((got.passed_over_requests, got.passed_over_ms_mean), (1, Some(35.5)), "only a's: e asked for no grammar");
        assert!(text.contains("Skipped for their grammar (mean ms):     1 (35.50)"), "{text}");
        assert_eq!((got.grammar_ready_requests, got.after_grammar_ready_ms_mean), (1, Some(16.25)), "b's");
        assert!(text.contains("Queued after their grammar (mean ms):    1 (16.25)"), "{text}");
        assert_eq!(super::after_grammar_ms(Some(20.0), Some(3.75)), Some(16.25));
        assert_eq!((super::after_grammar_ms(Some(20.0), None), super::after_grammar_ms(None, Some(1.0))), (None, None));
        let unproven = compute_views(&reqs[1..5], &[], &[50.0]);
        assert_eq!(unproven.structured_output.as_ref().map(|s| (s.passed_over_requests, s.passed_over_ms_mean)), Some((0, None)));
        assert!(!render_text(&unproven).contains("Skipped for their grammar"), "no line without proof");
        let none = compute_views(&reqs[3..5], &[], &[50.0]);
        assert_eq!(none.structured_output, None);
        assert!(!render_text(&none).contains("Structured output"));
    }

    #[test]
    fn summary_follows_vllm_bench_definitions_on_hand_computed_numbers() {
        let s = example();
        // d (HTTP 500), e (no end) and h (nothing generated) are not successful requests.
        assert_eq!((s.completed, s.not_completed, s.failed), (3, 3, 2), "d and e failed, h generated nothing");
        assert_eq!((s.total_input_tokens, s.total_output_tokens), (310, 8));
        close(s.duration_s.unwrap(), 1.0);
        close(s.request_throughput.unwrap(), 3.0);
        close(s.output_throughput.unwrap(), 8.0);
        close(s.total_token_throughput.unwrap(), 318.0);
        // TPOT: a (500-100)/(5-1) = 100, b (800-200)/(2-1) = 600; c has one token.
        let t = s.tpot_ms.as_ref().unwrap();
        assert_eq!(t.n, 2);
        close(t.mean, 350.0);
        close(t.median, 350.0);
        close(t.std, 250.0);
        close(t.percentiles["p99"], 595.0); // 100 + 0.99 * 500
        // TTFT [100, 100, 200].
        let f = s.ttft_ms.as_ref().unwrap();
        close(f.mean, 400.0 / 3.0);
        close(f.median, 100.0);
        close(f.std, (20000.0f64 / 9.0).sqrt());
        close(f.percentiles["p99"], 198.0);
        close(f.percentiles["p90"], 180.0);
        // ITL pooled over requests: [10, 20, 30, 40].
        let i = s.itl_ms.as_ref().unwrap();
        assert_eq!(i.n, 4);
        close(i.mean, 25.0);
        close(i.median, 25.0);
        close(i.percentiles["p90"], 37.0);
        close(i.percentiles["p99"], 39.7);
        // E2EL [100, 500, 800].
        let e = s.e2el_ms.as_ref().unwrap();
        close(e.median, 500.0);
        close(e.percentiles["p99"], 794.0);
        // AgentX: E2E/token = [0.1, 0.4, 0.1] s; p90 = 0.1 + 0.8 * 0.3 = 0.34.
        close(s.interactivity_p90_tok_s.unwrap(), 1.0 / 0.34);
        // Chain: (50 + 0) cached of (100 + 200) prompt; c's cached count is unknown.
        assert_eq!(s.chains.len(), 1);
        assert_eq!((s.chains[0].cached_tokens, s.chains[0].prompt_tokens, s.chains[0].hops_unknown), (50, 300, 1));
        close(s.chains[0].hit_rate.unwrap(), 1.0 / 6.0);
    }

    #[test]
    fn summary_of_nothing_is_null_not_zero() {
        let s = compute_views(&[], &[], DEFAULT_PERCENTILES);
        assert_eq!(s.completed, 0);
        assert!(s.ttft_ms.is_none() && s.tpot_ms.is_none() && s.itl_ms.is_none() && s.e2el_ms.is_none());
        assert!(s.duration_s.is_none() && s.request_throughput.is_none() && s.interactivity_p90_tok_s.is_none());
    }

    #[test]
    fn summary_percentile_labels_and_parsing_match_vllm() {
        assert_eq!(percentile_key(99.0), "p99");
        assert_eq!(percentile_key(99.9), "p99.9");
        assert_eq!(parse_percentiles("50, 90,99.9").unwrap(), vec![50.0, 90.0, 99.9]);
        assert!(parse_percentiles("101").unwrap_err().contains("outside"));
        assert!(parse_percentiles("x").unwrap_err().contains("invalid percentile"));
        assert!(parse_percentiles("").is_err());
        assert_eq!(tpot_ms(500.0, 100.0, 1), None);
        assert_eq!(tpot_ms(500.0, 100.0, 0), None);
        assert_eq!(tpot_ms(500.0, 100.0, 3), Some(200.0));
    }

    #[test]
    fn summary_text_uses_vllm_bench_layout() {
        let t = render_text(&example());
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0].chars().count(), 50);
        assert!(lines[0].starts_with("====") && lines[0].contains("Serving Summary"));
        assert!(lines.contains(&format!("{:<40} {:<10}", "Successful requests:", 3).as_str()));
        // A health check is not a failure.
        assert!(lines.contains(&format!("{:<40} {:<10}", "Failed or unfinished requests:", 2).as_str()), "{t}");
        assert!(lines.contains(&format!("{:<40} {:<10}", "Other requests (no tokens: /health, …):", 1).as_str()), "{t}");
        assert!(lines.contains(&"-----Time per Output Token (excl. 1st token)------"));
        assert!(lines.contains(&format!("{:<40} {:<10}", "Mean TPOT (ms):", "350.00").as_str()));
        assert!(lines.contains(&format!("{:<40} {:<10}", "Median TTFT (ms):", "100.00").as_str()));
        assert!(lines.contains(&format!("{:<40} {:<10}", "P99 ITL (ms):", "39.70").as_str()));
        assert!(lines.contains(&format!("{:<40} {:<10}", "P90 E2EL (ms):", "740.00").as_str()));
        assert!(lines.contains(&format!("{:<40} {:<10}", "s1:", "16.67%").as_str()));
        assert_eq!(*lines.last().unwrap(), "=".repeat(50));
    }

    #[test]
    fn summary_writer_gives_serde_json_pretty_bytes_on_edge_values() {
        use crate::sink::json::Value;
        let pretty = |s: &Summary| {
            let mut b = Vec::new();
            s.write(&mut b, 0);
            String::from_utf8(b).unwrap()
        };
        let full = example();
        let mut odd = compute_views(&[], &[], &[]);
        odd.duration_s = Some(f64::NAN);
        odd.request_throughput = Some(f64::INFINITY);
        odd.peak_gpu_mem_bytes = Some(u64::MAX);
        odd.itl_ms = Some(Dist { n: 0, mean: f64::NAN, median: -0.0, std: 1e300, percentiles: BTreeMap::new() });
        odd.chains = vec![
            ChainHitRate { chain: "a\"b\\c\u{1}\n é 🚀".into(), cached_tokens: 0, prompt_tokens: 0, hit_rate: None, hops_unknown: 3 },
            ChainHitRate { chain: String::new(), cached_tokens: 1, prompt_tokens: 3, hit_rate: Some(1.0 / 3.0), hops_unknown: 0 },
        ];
        for s in [full, odd, compute_views(&[], &[], DEFAULT_PERCENTILES)] {
            let want = serde_json::to_string_pretty(&s).unwrap();
            assert_eq!(pretty(&s), want);
            // Handed on in pieces along the way, the same bytes.
            let (mut b, mut out) = (Vec::new(), Vec::new());
            s.write_json(&mut b, 0, 1, &mut out).unwrap();
            out.extend_from_slice(&b);
            assert_eq!(String::from_utf8(out).unwrap(), want);
        }
    }

    fn sample(ts_ns: u64, device: u32, process_mem: Vec<(u32, u64)>) -> Record {
        Record::test_gpu_sample(ts_ns, device, process_mem)
    }

    #[test]
    fn summary_gpu_peak_sums_devices_per_instant_and_counts_the_level_at_arrival() {
        let mut g = GpuMemIndex::default();
        // One instant, two devices: 600 + 400 traced bytes.
        g.ingest(&sample(S * 9 / 10, 0, vec![(10, 600)]));
        g.ingest(&sample(S * 9 / 10, 1, vec![(10, 300), (11, 100)]));
        g.ingest(&sample(S * 11 / 10, 0, vec![(10, 1500)]));
        g.ingest(&sample(S * 16 / 10, 0, vec![(10, 3000)]));
        assert_eq!(g.samples(), 4);
        assert_eq!(g.peak(S, S * 15 / 10), Some(1500));
        // Shorter than the period: the level at arrival (0.1 s old).
        assert_eq!(g.peak(S, S + 1), Some(1000));
        // The last sample is 1.4 s older than the request: not its level.
        assert_eq!(g.peak(3 * S, 3 * S + 1), None);
        assert_eq!(g.peak(S * 15 / 10, 2 * S), Some(3000));
    }
}
