//! GPU side of the correlator (design.md §3, steps source (b), and the GPU
//! share of every phase). Pure: no I/O, no clock, no globals; time comes from
//! the records. See docs/attribution.md for the rules and their limits.
//!
//! * [`GpuSteps`]: fed CUPTI records in the recording's (start-time) order,
//!   yields finished steps. A step ends with a small pinned device→host copy
//!   that a host synchronisation waited for: vLLM's model runner copies the
//!   sampled token ids into a pinned host buffer (non_blocking) and then
//!   synchronises on an event (vllm/v1/worker/gpu_model_runner.py `_to_list`:
//!   `pinned.copy_(…, non_blocking=True); transfer_event.record();
//!   transfer_event.synchronize()`; with async scheduling,
//!   `AsyncGPUModelRunnerOutput` copies with `.to("cpu", non_blocking=True)`
//!   on a side stream and `get_output` synchronises its event later), and so
//!   does the testbed (examples/testbed/model_torch.py). Kernels, copies and memsets
//!   that *start* after the previous step's end copy and no later than this
//!   step's end copy belong to this step, whatever their stream or graph.
//!   Tensor parallelism runs one process per GPU, each with its own step ends:
//!   the per-process steps of one engine step are aligned by time (each
//!   process at most once per step) into one [`GpuStep`].
//! * [`split_by_tokens`], [`member_tokens`]: a step's GPU time split among
//!   its members in proportion to the tokens each contributed, summing
//!   exactly to the whole.
//! * [`Attribution`]: fed every record, matches engine output steps to GPU
//!   steps and accumulates per engine request its GPU time by phase, the KV
//!   copies on its critical path and the compute of its steps (GPU time, or
//!   without a GPU the engine thread's on-CPU time from `oncpu`); the
//!   correlator takes them when the request is final.
//!
//! Data parallelism (several engines, each with its own GPUs, stepping on
//! their own clocks): ranks are aligned only with ranks of the same engine,
//! and an engine's output steps are matched only to its own GPU steps
//! ([`Engines`]: which engine a GPU process serves, learned from the IPC and
//! the injection's hello).

use super::oncpu::{step_end_of, EngineCompute};
use crate::event::Dir;
use crate::model::Record;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

/// CUpti_ActivityMemcpyKind (cupti-sys bindings).
pub const COPY_HTOD: u8 = 1;
pub const COPY_DTOH: u8 = 2;
pub const COPY_DTOD: u8 = 8;
pub const COPY_PTOP: u8 = 10;
/// CUpti_ActivityMemoryKind (cupti-sys bindings: 1 pageable, 2 pinned, 3 device).
pub const MEM_PINNED: u8 = 2;
/// CUpti_ActivitySynchronizationType: the host waits (event, stream, context
/// synchronize). 2 (stream wait event) is a GPU-side wait and ends nothing.
const SYNC_EVENT: u32 = 1;
const SYNC_STREAM: u32 = 3;
const SYNC_CONTEXT: u32 = 4;

/// A step-end copy carries the sampled ids of one step: 4–8 bytes per running
/// request (times the speculative tokens), so a few KiB even at vLLM's largest
/// batches. KV blocks moved by offloading are larger (the testbed's smallest
/// is 32 KiB per tensor) and must not end steps.
pub const STEP_COPY_MAX_BYTES: u64 = 16 * 1024;
/// The host may call the synchronize after the copy already finished: the
/// GPU was ahead, or (vLLM's async scheduling) the host launched the next
/// step before waiting for this one's ids. A sync starting up to this long
/// after the copy's end still counts as waiting for it. It is also how long
/// a step stays undecided.
pub const SYNC_LAG_NS: u64 = 20_000_000;
/// Per-process step ends of one engine step on several ranks lie this close.
/// Ranks meet in collectives every layer, so their step-end copies finish
/// within microseconds of each other; a whole step apart is a different step.
pub const RANK_ALIGN_NS: u64 = 2_000_000;
/// GPU work with no step end this long after it started is not inside a step
/// (warm-up, graph capture, a process that never ends steps): it is counted
/// and let go, so memory stays bounded.
pub const MAX_STEP_NS: u64 = 2_000_000_000;
/// Copies at least this large between host and device (or between devices)
/// are KV transfers; smaller ones are a step's inputs (token ids, positions,
/// block tables of typical batches).
pub const KV_COPY_MIN_BYTES: u64 = 32 * 1024;

/// A copy inside a step other than its end copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuCopy {
    pub pid: u32,
    pub device: u32,
    pub stream: u32,
    pub start_ns: u64,
    pub end_ns: u64,
    /// CUpti_ActivityMemcpyKind, raw.
    pub kind: u8,
    pub bytes: u64,
    /// Peer-to-peer (another device, MEMCPY2).
    pub peer: bool,
    /// The host side is pinned memory (what offloading pools and vLLM's
    /// input buffers use; pageable copies are ad-hoc tensors).
    pub host_pinned: bool,
}

impl GpuCopy {
    /// KV transfer: host (pinned) ↔ device, or device ↔ device across GPUs,
    /// large enough to be KV blocks rather than a step's inputs.
    pub fn is_kv(&self) -> bool {
        let moves = matches!(self.kind, COPY_HTOD | COPY_DTOH) && self.host_pinned || self.kind == COPY_PTOP || (self.kind == COPY_DTOD && self.peer);
        moves && self.bytes >= KV_COPY_MIN_BYTES
    }
}

/// One step as one process (one rank) ran it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankStep {
    pub pid: u32,
    /// Device of the step-end copy.
    pub device: u32,
    /// 0-based, per process.
    pub index: u32,
    /// Earliest start of the step's GPU work (the end copy's start if none).
    pub start_ns: u64,
    /// The step-end copy finished on the GPU.
    pub gpu_end_ns: u64,
    /// The synchronize that waited for it returned: the host knew the step
    /// was done (what the engine's own step end follows).
    pub end_ns: u64,
    /// Time the GPU was busy with the step: the union of its kernels, copies
    /// and memsets over all streams (overlap counted once).
    pub busy_ns: u64,
    /// Sum of kernel durations (overlapping kernels each counted).
    pub kernel_ns: u64,
    pub kernels: u32,
    /// Kernels that ran as CUDA graph nodes (graph_id ≠ 0): vLLM replays
    /// captured graphs for decode batches.
    pub graph_kernels: u32,
    pub streams: u32,
    /// New tokens of the step: `reshape_and_cache*` writes one block per
    /// token (vLLM csrc/cache_kernels.cu: `int num_tokens =
    /// slot_mapping.size(0); … dim3 grid(num_tokens);`, one launch per
    /// layer). None when no such kernel ran (other attention backends, the
    /// testbed).
    pub tokens: Option<u64>,
    /// Host↔device and peer copies other than the end copy.
    pub copies: Vec<GpuCopy>,
    /// Each kernel name's summed durations (ids of [`GpuSteps::names`]), in
    /// the order the names first ran.
    pub by_kernel: Vec<(u32, u64)>,
}

/// One engine step: the same step on every rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuStep {
    /// The engine process it belongs to, when the engine IPC tied its ranks
    /// to one ([`Engines::engine_of`]); None: no engine is known for them.
    pub engine: Option<u32>,
    pub start_ns: u64,
    /// Latest step-end copy over the ranks.
    pub gpu_end_ns: u64,
    /// Latest host synchronize return over the ranks.
    pub end_ns: u64,
    /// The step's GPU time: the longest rank's busy time (ranks run in
    /// parallel; the step is as long as its slowest rank).
    pub gpu_ns: u64,
    pub tokens: Option<u64>,
    pub ranks: Vec<RankStep>,
}

impl GpuStep {
    pub fn kernels(&self) -> u32 {
        self.ranks.iter().map(|r| r.kernels).sum()
    }
    pub fn graph_kernels(&self) -> u32 {
        self.ranks.iter().map(|r| r.graph_kernels).sum()
    }
    pub fn copies(&self) -> impl Iterator<Item = &GpuCopy> {
        self.ranks.iter().flat_map(|r| r.copies.iter())
    }
    /// Each kernel name's durations summed over the ranks (one rank: in its
    /// order; several: by name id).
    pub fn by_kernel(&self) -> Vec<(u32, u64)> {
        if let [one] = &self.ranks[..] {
            return one.by_kernel.clone();
        }
        let mut v: Vec<(u32, u64)> = self.ranks.iter().flat_map(|r| r.by_kernel.iter().copied()).collect();
        merge_by_id(&mut v);
        v
    }
}

/// Sorts `(id, ns)` pairs by id and adds up those of one id.
fn merge_by_id(v: &mut Vec<(u32, u64)>) {
    v.sort_unstable_by_key(|p| p.0);
    v.dedup_by(|b, a| {
        if a.0 == b.0 {
            a.1 += b.1;
            true
        } else {
            false
        }
    });
}

/// Kernel names seen by [`GpuSteps`], one id each (ids index [`KernelNames::get`]),
/// with each name's executions and summed durations: the recording's
/// kernel table. One lookup per kernel record serves both (a mangled name
/// of ~100 bytes hashed and compared: the correlator's separate table was
/// 2 % of `hopscope trace`'s instructions on a CUPTI-shaped recording).
#[derive(Debug, Default)]
pub struct KernelNames {
    ids: super::FxMap<Arc<str>, u32>,
    names: Vec<Arc<str>>,
    /// (executions, summed durations) per id; then the names past the cap.
    totals: Vec<(u64, u64)>,
    other: (u64, u64),
}

/// Names kept at most: past it every new name shares [`OTHER_KERNELS`]
/// (counted, `gpu_kernel_names_capped`). Servers run hundreds.
pub const MAX_KERNEL_NAMES: usize = 1 << 16;
/// The name of kernels past [`MAX_KERNEL_NAMES`].
pub const OTHER_KERNELS: &str = "(other kernels)";

impl KernelNames {
    /// The id of `name`, counting one execution of `dur_ns`; `None` when
    /// the table is full (counted under [`OTHER_KERNELS`]).
    fn intern(&mut self, name: &str, dur_ns: u64) -> Option<u32> {
        let id = match self.ids.get(name) {
            Some(&id) => id,
            None if self.names.len() >= MAX_KERNEL_NAMES => {
                self.other.0 += 1;
                self.other.1 += dur_ns;
                return None;
            }
            None => {
                let id = self.names.len() as u32;
                let name: Arc<str> = Arc::from(name);
                self.names.push(Arc::clone(&name));
                self.totals.push((0, 0));
                self.ids.insert(name, id);
                id
            }
        };
        let t = &mut self.totals[id as usize];
        t.0 += 1;
        t.1 += dur_ns;
        Some(id)
    }

    /// Every name's executions and time, most time first; ties by name.
    pub fn stats(&self) -> Vec<super::KernelStat> {
        let named = self.names.iter().zip(&self.totals).map(|(n, t)| (n.to_string(), *t));
        let other = (self.other.0 > 0).then(|| (OTHER_KERNELS.to_owned(), self.other));
        let mut v: Vec<super::KernelStat> = named.chain(other).map(|(name, (count, gpu_ns))| super::KernelStat { name, count, gpu_ns }).collect();
        v.sort_by(|a, b| b.gpu_ns.cmp(&a.gpu_ns).then_with(|| a.name.cmp(&b.name)));
        v
    }

    /// The name of `id` ([`OTHER_KERNELS`] for the shared id past the cap).
    pub fn get(&self, id: u32) -> Arc<str> {
        self.names.get(id as usize).cloned().unwrap_or_else(|| Arc::from(OTHER_KERNELS))
    }

    /// [`KernelNames::get`], borrowed.
    fn name(&self, id: u32) -> &str {
        self.names.get(id as usize).map_or(OTHER_KERNELS, |n| n)
    }
}

#[derive(Debug, Clone)]
struct Act {
    start: u64,
    end: u64,
    stream: u32,
    what: What,
}

#[derive(Debug, Clone)]
enum What {
    Kernel { graph: bool, reshape_grid: Option<u32>, name: u32 },
    Copy(GpuCopy),
    Memset,
}

#[derive(Debug, Clone, Copy)]
struct Cand {
    start: u64,
    end: u64,
    device: u32,
    stream: u32,
}

#[derive(Debug, Clone, Copy)]
struct Sync {
    start: u64,
    end: u64,
    sync_type: u32,
    stream: Option<u32>,
}

impl Sync {
    fn waits_for(&self, c: &Cand) -> bool {
        let stream_ok = self.sync_type != SYNC_STREAM || self.stream.is_none_or(|s| s == c.stream);
        stream_ok && self.end >= c.end && self.start <= c.end.saturating_add(SYNC_LAG_NS)
    }
}

/// Which engine each GPU process serves, learned from the records: a
/// process that reads engine requests or writes engine outputs is an engine
/// (vLLM's EngineCore, one per data-parallel rank); a GPU process that is
/// not one serves its parent when that is an engine (vLLM's multiprocessing
/// executor spawns one worker per tensor-parallel rank from the engine core;
/// with one rank the engine core runs the model itself). Parents come from
/// the injection's hello ([`Record::GpuProcess`]). While only one engine is
/// known every GPU process serves it (whatever launched them: Ray actors,
/// torchrun workers).
#[derive(Debug, Default, Clone)]
pub struct Engines {
    parents: super::FxMap<u32, u32>,
    /// Few (one per data-parallel rank): a vector.
    engines: Vec<u32>,
}

impl Engines {
    /// Learns from one record (any kind).
    #[inline]
    pub fn learn(&mut self, rec: &Record) {
        let engine = match rec {
            Record::GpuProcess { pid, ppid, .. } => {
                self.parents.insert(*pid, *ppid);
                return;
            }
            Record::EngineRequest { conn, dir: Dir::In, .. } | Record::EngineOutputs { conn, dir: Dir::Out, .. } => conn.tgid,
            _ => return,
        };
        if !self.engines.contains(&engine) {
            self.engines.push(engine);
        }
    }

    /// The engine GPU process `pid` serves, when known.
    pub fn engine_of(&self, pid: u32) -> Option<u32> {
        if let [only] = self.engines[..] {
            return Some(only);
        }
        if self.engines.contains(&pid) {
            return Some(pid);
        }
        self.parents.get(&pid).copied().filter(|p| self.engines.contains(p))
    }

    /// The ranks of one engine step share this: their engine, else (no IPC
    /// decoded) their parent, so tensor-parallel workers still align; 0:
    /// nothing known (every such process aligns with every other).
    fn align_key(&self, pid: u32) -> u32 {
        self.engine_of(pid).or_else(|| self.parents.get(&pid).copied()).unwrap_or(0)
    }
}

#[derive(Debug, Default)]
struct Proc {
    next_index: u32,
    /// The last emitted step's end copy: activity starting at or before it is late.
    boundary: Option<u64>,
    acts: Vec<Act>,
    /// Step-end copy candidates, by end.
    cands: Vec<Cand>,
    syncs: Vec<Sync>,
}

/// Incremental step finder over CUPTI records (see the module doc). Feed every
/// record with [`GpuSteps::push`] in recording order (non-GPU records only move
/// the clock), take finished steps with [`GpuSteps::pop`], end with
/// [`GpuSteps::finish`]. Memory: the GPU records of the steps still open.
#[derive(Debug, Default)]
pub struct GpuSteps {
    procs: BTreeMap<u32, Proc>,
    watermark: u64,
    /// Per-process steps waiting for their ranks.
    pending: Vec<RankStep>,
    ready: VecDeque<GpuStep>,
    /// Processes that have ended at least one step (the ranks).
    ranks: BTreeSet<u32>,
    pruned_at: u64,
    pub engines: Engines,
    /// The kernels' names, for the steps' [`RankStep::by_kernel`].
    pub names: KernelNames,
    pub counters: BTreeMap<&'static str, u64>,
}

/// How often stale open work is looked for.
const PRUNE_EVERY_NS: u64 = 100_000_000;

fn reshape_grid(name: &str, grid: [u32; 3]) -> Option<u32> {
    // Mangled or not, vLLM's kernels are `vllm::reshape_and_cache_kernel` and
    // `vllm::reshape_and_cache_flash_kernel`.
    name.contains("reshape_and_cache").then_some(grid[0])
}

impl GpuSteps {
    pub fn new() -> Self {
        Self::default()
    }

    fn count(&mut self, what: &'static str, n: u64) {
        if n > 0 {
            *self.counters.entry(what).or_default() += n;
        }
    }

    /// Feeds one record (any kind; non-GPU records only advance time, the
    /// IPC's and the injection's hello teach [`Engines`]).
    pub fn push(&mut self, rec: &Record) {
        self.engines.learn(rec);
        self.push_at(rec, rec.ts_ns());
    }

    /// [`Self::push`] of a record whose time the caller has (`rec.ts_ns()`),
    /// and whose engine facts it gave [`Engines::learn`] (only a few kinds
    /// of record have any: not asked of every record). While no GPU work is
    /// held a record that is not GPU work only moves the clock: that is most
    /// records, so it is done here, without a call.
    #[inline(always)]
    pub(crate) fn push_at(&mut self, rec: &Record, ts: u64) {
        if self.procs.is_empty() && self.pending.is_empty() && !matches!(rec, Record::GpuKernel { .. } | Record::GpuMemcpy { .. } | Record::GpuMemset { .. } | Record::GpuSync { .. }) {
            self.watermark = self.watermark.max(ts);
            if self.watermark >= self.pruned_at.saturating_add(PRUNE_EVERY_NS) {
                self.pruned_at = self.watermark;
            }
            return;
        }
        self.push_held(rec, ts);
    }

    fn push_held(&mut self, rec: &Record, ts: u64) {
        self.watermark = self.watermark.max(ts);
        let (pid, act, cand, sync) = match rec {
            Record::GpuKernel { ts_ns, end_ns, pid, stream, graph_id, name, grid, .. } => {
                let name_id = self.names.intern(name, end_ns.saturating_sub(*ts_ns)).unwrap_or_else(|| {
                    *self.counters.entry("gpu_kernel_names_capped").or_default() += 1;
                    u32::MAX
                });
                (*pid, Some(Act { start: *ts_ns, end: *end_ns, stream: *stream, what: What::Kernel { graph: *graph_id != 0, reshape_grid: reshape_grid(name, *grid), name: name_id } }), None, None)
            }
            Record::GpuMemcpy { ts_ns, end_ns, pid, device, stream, kind, src_kind, dst_kind, bytes, peer, .. } => {
                let host_pinned = match *kind {
                    COPY_HTOD => *src_kind == MEM_PINNED,
                    COPY_DTOH => *dst_kind == MEM_PINNED,
                    _ => false,
                };
                let copy = GpuCopy { pid: *pid, device: *device, stream: *stream, start_ns: *ts_ns, end_ns: *end_ns, kind: *kind, bytes: *bytes, peer: peer.is_some(), host_pinned };
                let cand = is_step_copy(*kind, *dst_kind, *bytes).then_some(Cand { start: *ts_ns, end: *end_ns, device: *device, stream: *stream });
                (*pid, Some(Act { start: *ts_ns, end: *end_ns, stream: *stream, what: What::Copy(copy) }), cand, None)
            }
            Record::GpuMemset { ts_ns, end_ns, pid, stream, .. } => (*pid, Some(Act { start: *ts_ns, end: *end_ns, stream: *stream, what: What::Memset }), None, None),
            Record::GpuSync { ts_ns, end_ns, pid, sync_type, stream, .. } if matches!(*sync_type, SYNC_EVENT | SYNC_STREAM | SYNC_CONTEXT) => {
                (*pid, None, None, Some(Sync { start: *ts_ns, end: *end_ns, sync_type: *sync_type, stream: *stream }))
            }
            _ => {
                if self.procs.is_empty() && self.pending.is_empty() {
                    // No GPU work held: nothing a later watermark can decide
                    // (every record of a recording without CUPTI comes here).
                    if self.watermark >= self.pruned_at.saturating_add(PRUNE_EVERY_NS) {
                        self.pruned_at = self.watermark;
                    }
                    return;
                }
                self.advance(false);
                return;
            }
        };
        // The injection already drops zero and reversed timestamps; a record
        // that still has them cannot be placed.
        let (start, end) = match (&act, &sync) {
            (Some(a), _) => (a.start, a.end),
            (None, Some(s)) => (s.start, s.end),
            _ => (0, 0),
        };
        if start == 0 || end < start {
            self.count("gpu_step_records_invalid", 1);
            return;
        }
        let p = self.procs.entry(pid).or_default();
        if let Some(a) = act {
            if p.boundary.is_some_and(|b| a.start <= b) {
                // Its step was already handed out (records out of order).
                *self.counters.entry("gpu_step_records_late").or_default() += 1;
            } else {
                p.acts.push(a);
                if let Some(c) = cand {
                    let at = p.cands.partition_point(|x| x.end <= c.end);
                    p.cands.insert(at, c);
                }
            }
        }
        if let Some(s) = sync {
            p.syncs.push(s);
        }
        self.advance(false);
    }

    /// Decides what the clock allows; `all`: the recording ended.
    fn advance(&mut self, all: bool) {
        let wm = if all { u64::MAX } else { self.watermark };
        let mut done: Vec<RankStep> = Vec::new();
        let mut counts: Vec<(&'static str, u64)> = Vec::new();
        for (&pid, p) in self.procs.iter_mut() {
            while let Some(&c) = p.cands.first() {
                // Every sync that could wait for c has started by c.end + lag.
                if wm < c.end.saturating_add(SYNC_LAG_NS) {
                    break;
                }
                let Some(s) = p.syncs.iter().filter(|s| s.waits_for(&c)).min_by_key(|s| s.end).copied() else {
                    // Not waited for: a copy that does not end a step.
                    p.cands.remove(0);
                    counts.push(("gpu_step_copies_unsynced", 1));
                    continue;
                };
                // Every copy that could have ended before s returned has started.
                if wm < s.end {
                    break;
                }
                if p.cands.get(1).is_some_and(|n| n.end <= s.end) {
                    // The sync waited for a later copy too: that one ends the step.
                    p.cands.remove(0);
                    continue;
                }
                // The sync must have waited for c itself, not for later work
                // queued behind it on its stream (vLLM queues nothing between
                // the ids copy and the wait; a KV offload's sync comes after
                // the offload copies).
                if p.acts.iter().any(|a| a.stream == c.stream && a.start >= c.end && a.end <= s.end && a.start > c.start) {
                    p.cands.remove(0);
                    counts.push(("gpu_step_copies_unsynced", 1));
                    continue;
                }
                p.cands.remove(0);
                let boundary = c.end;
                let (mine, rest): (Vec<Act>, Vec<Act>) = std::mem::take(&mut p.acts).into_iter().partition(|a| a.start <= boundary);
                p.acts = rest;
                p.syncs.retain(|x| x.end > s.end);
                p.boundary = Some(boundary);
                done.push(rank_step(pid, p.next_index, c, s.end, &mine, &mut counts));
                p.next_index += 1;
            }
            // Work no step end can claim any more (looked at every
            // PRUNE_EVERY_NS: a pass is linear in the open work).
            if all || wm >= self.pruned_at.saturating_add(PRUNE_EVERY_NS) {
                let old = if all { u64::MAX } else { wm.saturating_sub(MAX_STEP_NS) };
                if p.cands.first().is_none_or(|c| c.start > old) && p.acts.first().is_some_and(|a| a.start <= old) {
                    let before = p.acts.len();
                    p.acts.retain(|a| a.start > old);
                    counts.push(("gpu_records_outside_steps", (before - p.acts.len()) as u64));
                }
                p.syncs.retain(|s| s.end.saturating_add(MAX_STEP_NS) > wm && !all);
            }
        }
        if wm >= self.pruned_at.saturating_add(PRUNE_EVERY_NS) {
            self.pruned_at = wm;
        }
        for (k, n) in counts {
            self.count(k, n);
        }
        for r in done {
            self.ranks.insert(r.pid);
            let at = self.pending.partition_point(|x| x.gpu_end_ns <= r.gpu_end_ns);
            self.pending.insert(at, r);
        }
        self.align(wm);
    }

    /// Groups per-process steps into engine steps once no rank can still add
    /// to the earliest group. Only ranks of one engine group: engines of
    /// data-parallel ranks step on their own clocks.
    fn align(&mut self, wm: u64) {
        while let Some(first) = self.pending.first() {
            let t0 = first.gpu_end_ns;
            // A rank's step is decided at most lag + its sync after its copy.
            if wm != u64::MAX && wm < t0.saturating_add(RANK_ALIGN_NS + SYNC_LAG_NS + RANK_ALIGN_NS) {
                break;
            }
            let key = self.engines.align_key(first.pid);
            let mut group: Vec<RankStep> = Vec::new();
            let mut i = 0;
            while i < self.pending.len() && self.pending[i].gpu_end_ns <= t0 + RANK_ALIGN_NS {
                let pid = self.pending[i].pid;
                if group.iter().any(|g| g.pid == pid) || self.engines.align_key(pid) != key {
                    i += 1;
                    continue;
                }
                group.push(self.pending.remove(i));
            }
            let ranks = self.ranks.iter().filter(|&&p| self.engines.align_key(p) == key).count();
            let missing = ranks.saturating_sub(group.len()) as u64;
            self.count("gpu_step_ranks_missing", missing);
            let engine = group.first().and_then(|r| self.engines.engine_of(r.pid));
            self.ready.push_back(merge_ranks(engine, group));
        }
    }

    /// Finished steps, in time order.
    pub fn pop(&mut self) -> Option<GpuStep> {
        self.ready.pop_front()
    }

    /// Whether steps wait in [`pop`](Self::pop).
    pub fn has_ready(&self) -> bool {
        !self.ready.is_empty()
    }

    /// The recording ended: decides what is left and returns the remaining
    /// steps; GPU work after the last step end is counted as outside steps.
    pub fn finish(&mut self) -> Vec<GpuStep> {
        self.advance(true);
        self.ready.drain(..).collect()
    }
}

fn rank_step(pid: u32, index: u32, c: Cand, host_end: u64, acts: &[Act], counts: &mut Vec<(&'static str, u64)>) -> RankStep {
    let mut spans: Vec<(u64, u64)> = acts.iter().map(|a| (a.start, a.end)).collect();
    spans.sort_unstable();
    let mut busy = 0u64;
    let mut cur: Option<(u64, u64)> = None;
    for (s, e) in spans {
        cur = match cur {
            Some((cs, ce)) if s <= ce => Some((cs, ce.max(e))),
            Some((cs, ce)) => {
                busy += ce - cs;
                Some((s, e))
            }
            None => Some((s, e)),
        };
    }
    if let Some((cs, ce)) = cur {
        busy += ce - cs;
    }
    let (mut kernel_ns, mut kernels, mut graph_kernels) = (0u64, 0u32, 0u32);
    let mut grids: BTreeMap<u32, u32> = BTreeMap::new();
    let mut copies = Vec::new();
    let mut by_kernel: Vec<(u32, u64)> = Vec::new();
    let mut streams: BTreeSet<u32> = BTreeSet::new();
    for a in acts {
        streams.insert(a.stream);
        match &a.what {
            What::Kernel { graph, reshape_grid, name } => {
                kernels += 1;
                kernel_ns += a.end - a.start;
                // A step runs few distinct kernels, each many times.
                match by_kernel.iter_mut().find(|p| p.0 == *name) {
                    Some(p) => p.1 += a.end - a.start,
                    None => by_kernel.push((*name, a.end - a.start)),
                }
                graph_kernels += u32::from(*graph);
                if let Some(g) = reshape_grid {
                    *grids.entry(*g).or_default() += 1;
                }
            }
            What::Copy(cp) => {
                let is_end = cp.start_ns == c.start && cp.end_ns == c.end && cp.stream == c.stream;
                if !is_end && matches!(cp.kind, COPY_HTOD | COPY_DTOH | COPY_PTOP | COPY_DTOD) {
                    copies.push(*cp);
                }
            }
            What::Memset => {}
        }
    }
    // One launch per layer, all with the same grid; a disagreement means two
    // kinds of launch in one step (e.g. draft and target model): take the most
    // frequent and say so.
    if grids.len() > 1 {
        counts.push(("gpu_step_token_grids_disagree", 1));
    }
    let tokens = grids.iter().max_by_key(|(g, n)| (**n, **g)).map(|(g, _)| u64::from(*g));
    let start_ns = acts.iter().map(|a| a.start).min().unwrap_or(c.start).min(c.start);
    RankStep {
        pid,
        device: c.device,
        index,
        start_ns,
        gpu_end_ns: c.end,
        end_ns: host_end,
        busy_ns: busy,
        kernel_ns,
        kernels,
        graph_kernels,
        streams: streams.len() as u32,
        tokens,
        copies,
        by_kernel,
    }
}

fn merge_ranks(engine: Option<u32>, mut ranks: Vec<RankStep>) -> GpuStep {
    ranks.sort_by_key(|r| r.pid);
    GpuStep {
        engine,
        start_ns: ranks.iter().map(|r| r.start_ns).min().unwrap_or(0),
        gpu_end_ns: ranks.iter().map(|r| r.gpu_end_ns).max().unwrap_or(0),
        end_ns: ranks.iter().map(|r| r.end_ns).max().unwrap_or(0),
        gpu_ns: ranks.iter().map(|r| r.busy_ns).max().unwrap_or(0),
        tokens: ranks.iter().find_map(|r| r.tokens),
        ranks,
    }
}

/// Splits `total` among members in proportion to their tokens, exactly:
/// floors first, then the leftover nanoseconds one each to the largest
/// remainders (ties to the earlier member). Members with no tokens at all
/// share equally.
pub fn split_by_tokens(total: u64, tokens: &[u64]) -> Vec<u64> {
    let mut out = Vec::with_capacity(tokens.len());
    split_many(std::iter::once(total), tokens, &mut out, &mut Vec::new());
    out
}

/// [`split_by_tokens`] of each of `totals` over the same `tokens`, appended
/// to `out` one row of `tokens.len()` after another; `rems` is scratch.
/// Kernel names split a step's time this way without a vector each.
pub fn split_many(totals: impl IntoIterator<Item = u64>, tokens: &[u64], out: &mut Vec<u64>, rems: &mut Vec<(u128, usize)>) {
    if tokens.is_empty() {
        return;
    }
    let sum: u128 = tokens.iter().map(|&t| u128::from(t)).sum();
    // Members with no tokens at all share equally.
    let weight = |t: u64| if sum == 0 { 1 } else { u128::from(t) };
    let sum = if sum == 0 { tokens.len() as u128 } else { sum };
    for total in totals {
        let row = out.len();
        rems.clear();
        for (i, &t) in tokens.iter().enumerate() {
            let x = u128::from(total) * weight(t);
            out.push((x / sum) as u64);
            rems.push((x % sum, i));
        }
        let left = total - out[row..].iter().sum::<u64>();
        match left {
            0 => {}
            // The usual case with two members: the largest remainder, the earlier on a tie.
            1 => {
                let (_, i) = rems.iter().max_by_key(|&&(r, i)| (r, std::cmp::Reverse(i))).expect("tokens is not empty");
                out[row + i] += 1;
            }
            _ => {
                rems.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
                for &(_, i) in rems.iter().take(left as usize) {
                    out[row + i] += 1;
                }
            }
        }
    }
}

/// The engine builds a step's output after the host saw the step end; it may
/// take this long (updating requests, detokenising in-process) before the
/// output's timestamp is taken.
pub const IPC_AFTER_GPU_MAX_NS: u64 = 50_000_000;
/// The engine's clock and CUPTI's (both CLOCK_MONOTONIC) read a few µs apart.
pub const MATCH_SLACK_NS: u64 = 100_000;
/// An output step is matched once the GPU steps ending before it are
/// decided ([`GpuSteps`] holds a step for the sync lag and the rank wait).
pub const MATCH_WAIT_NS: u64 = SYNC_LAG_NS + 3 * RANK_ALIGN_NS + 10_000_000;
/// A reader's copy of an output message (an API server's read) is matched
/// this long after its end, not [`MATCH_WAIT_NS`]: the writer's copy of the
/// same message, when the engine is traced, may come that much later — the
/// joiner holds a writer's message up to [`super::join::JOIN_WAIT_NS`] for
/// its step's other parts — and replaces it (`Attribution::drop_readers_steps`).
pub const READER_MATCH_WAIT_NS: u64 = 500_000_000;
const _: () = assert!(READER_MATCH_WAIT_NS > super::join::JOIN_WAIT_NS + MATCH_WAIT_NS + 100_000_000);
const _: () = assert!(READER_MATCH_WAIT_NS < super::SETTLE_NS);
/// Output-less GPU steps and KV copies wait this long for the request whose
/// first token claims them.
pub const CLAIM_WAIT_NS: u64 = 60_000_000_000;
/// A request's figures nobody took this long after its last record are let go.
pub const UNTAKEN_NS: u64 = super::MAX_OPEN_NS + super::SETTLE_NS;

/// A request's share of one kernel's GPU time: each step it took part in
/// split the kernel's durations (all ranks) among its members as
/// [`GpuShare`] splits the step (docs/attribution.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelShare {
    pub name: Arc<str>,
    pub gpu_ns: u64,
}

/// Kernel names a request lists, most of its GPU time first.
pub const KERNELS_PER_REQUEST: usize = 8;

/// GPU attribution of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GpuShare {
    /// Its share of the GPU time of the steps up to and including the one
    /// that produced its first token (output-less steps of its prefill too).
    pub prefill_ns: u64,
    /// Its share of the GPU time of later steps.
    pub decode_ns: u64,
    /// Its share of the GPU time of KV copies in [submit, first token].
    pub kv_gpu_ns: u64,
    /// Wall time covered by those copies (their union), split at its
    /// scheduling: the part while it queued and the part in its first step.
    /// This is what its critical path spent on KV transfer.
    pub kv_queue_ns: u64,
    pub kv_prefill_ns: u64,
    /// GPU steps it took part in.
    pub steps: u32,
    /// Where those copies ran (the union, clipped to its first token), for
    /// the trace: the first [`KV_SPANS_MAX`], in time order (a fixed array
    /// keeps the share `Copy`; more are counted, `gpu_kv_spans_capped`).
    pub kv_spans: [(u64, u64); KV_SPANS_MAX],
    pub kv_spans_len: u8,
}

/// KV copy intervals kept per request (see [`GpuShare::kv_spans`]).
pub const KV_SPANS_MAX: usize = 4;

impl GpuShare {
    pub fn kv_wall_ns(&self) -> u64 {
        self.kv_queue_ns + self.kv_prefill_ns
    }
    /// The KV copy intervals kept (union, time order).
    pub fn kv_spans(&self) -> &[(u64, u64)] {
        &self.kv_spans[..usize::from(self.kv_spans_len).min(KV_SPANS_MAX)]
    }
}

/// A copy that may end a step (it does when a host synchronisation waited
/// for it): small, device to pinned host memory. The trace marks the same
/// copies (`sink::perfetto::raw::GpuMarks`), so one rule serves both.
pub fn is_step_copy(kind: u8, dst_kind: u8, bytes: u64) -> bool {
    kind == COPY_DTOH && dst_kind == MEM_PINNED && bytes <= STEP_COPY_MAX_BYTES
}

/// Where a step's compute time came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ComputeSource {
    /// The GPU step (CUPTI) matched to the engine step: its GPU time.
    Cupti,
    /// The engine thread's on-CPU time since the previous step end (no GPU source).
    Oncpu,
}

/// Compute of the steps a request took part in, not split: how long the
/// steps that carried it computed (prefill: up to its first token). None
/// when no step of that part has a figure (e.g. the engine's very first
/// step, which has no start without a GPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestCompute {
    pub prefill_ns: Option<u64>,
    pub decode_ns: Option<u64>,
    /// Steps with a figure.
    pub steps: u32,
    pub source: ComputeSource,
}

/// One engine output step's compute, for reports and traces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepCompute {
    pub end_ns: u64,
    pub compute_ns: u64,
    pub source: ComputeSource,
    /// The matched GPU step's `gpu_end_ns` (cupti only): links the engine
    /// step to its GPU step in the trace.
    pub gpu_end_ns: Option<u64>,
}

/// Tokens each member contributed to a step, from (first token?, prefill
/// tokens): 1 per decode member; a member getting its first token
/// contributed its prefill chunk, which is the step's token count (from
/// `reshape_and_cache*`) less one per decode member when known, split among
/// the prefilling members by their prefill tokens; else its prefill tokens.
pub fn member_tokens(step_tokens: Option<u64>, members: &[(bool, u64)]) -> Vec<u64> {
    let decoders = members.iter().filter(|m| !m.0).count() as u64;
    let firsts: Vec<u64> = members.iter().filter(|m| m.0).map(|m| m.1.max(1)).collect();
    let share = match step_tokens {
        Some(t) if t > decoders && !firsts.is_empty() => Some(split_by_tokens(t - decoders, &firsts)),
        _ => None,
    };
    let mut k = 0;
    members
        .iter()
        .map(|m| {
            if !m.0 {
                return 1;
            }
            let v = share.as_ref().map_or(firsts[k], |s| s[k].max(1));
            k += 1;
            v
        })
        .collect()
}

#[derive(Debug, Clone, Default)]
struct Eng {
    submit_ns: Option<u64>,
    prompt_tokens: Option<u64>,
    computed_tokens: Option<u64>,
    scheduled_ns: Option<u64>,
    first_token_ns: Option<u64>,
    share: GpuShare,
    compute: Option<RequestCompute>,
    /// Its share of each kernel name's time (name id → ns), split like `share`.
    kernels: super::FxMap<u32, u64>,
    last_ns: u64,
}

impl Eng {
    fn prefill_tokens(&self) -> u64 {
        self.computed_tokens.or(self.prompt_tokens).unwrap_or(1).max(1)
    }
    /// When it could start waiting for KV: its submit, else its scheduling.
    fn kv_window_start_ns(&self) -> u64 {
        self.submit_ns.or(self.scheduled_ns).unwrap_or(u64::MAX)
    }
    fn add_kernels(&mut self, parts: impl IntoIterator<Item = (u32, u64)>) {
        for (name, ns) in parts {
            if ns > 0 {
                *self.kernels.entry(name).or_default() += ns;
            }
        }
    }
    fn add_compute(&mut self, ns: u64, prefill: bool, source: ComputeSource) {
        let c = self.compute.get_or_insert(RequestCompute { prefill_ns: None, decode_ns: None, steps: 0, source });
        let part = if prefill { &mut c.prefill_ns } else { &mut c.decode_ns };
        *part = Some(part.unwrap_or(0) + ns);
        c.steps += 1;
    }
}

/// An engine output step: its engine (the writer; 0 when only the reader's
/// copy was seen), its end and (request key, first token?).
#[derive(Debug, Clone)]
struct OutStep {
    /// The writer's process; 0 for a reader's copy (no engine known).
    engine: u32,
    end_ns: u64,
    members: Vec<(Key, bool)>,
}

impl OutStep {
    /// When it is matched: once the GPU steps before it are decided, and a
    /// reader's copy once the writer's could no longer replace it.
    fn due_ns(&self) -> u64 {
        self.end_ns.saturating_add(if self.engine == 0 { READER_MATCH_WAIT_NS } else { MATCH_WAIT_NS })
    }
}

/// GPU work waiting for a first token to claim it: an output-less step (or
/// the part of a step no output member accounts for), of engine `key`.
#[derive(Debug, Clone)]
struct Silent {
    key: u32,
    end_ns: u64,
    gpu_ns: u64,
    /// Its kernels' time by name id (the part of a step it stands for).
    kernels: Vec<(u32, u64)>,
}

/// A GPU step's engine as outputs are matched by (0: none known).
fn step_key(g: &GpuStep) -> u32 {
    g.engine.unwrap_or(0)
}

/// An engine request's key in [`Attribution`] (its id is hashed once per
/// output step, not once per use).
type Key = super::slab::SlabKey;

/// vLLM EngineCoreEventType SCHEDULED.
const EV_SCHEDULED: u8 = 2;

/// The GPU side and step compute per engine request, streamed (design.md
/// §3 "every phase also carries its GPU share"; docs/attribution.md):
///
/// * every engine output step (EngineCoreOutputs, the writer's copy) is
///   matched, [`MATCH_WAIT_NS`] after its end, to the latest GPU step of
///   its engine that ended (host side) no later than it and not more than
///   [`IPC_AFTER_GPU_MAX_NS`] before; that GPU step's time is split among
///   the output's members by [`member_tokens`]. With data parallelism each
///   engine has its own GPU steps; an engine whose GPU processes are not
///   known ([`Engines`]) is matched to the steps no engine is known for;
/// * GPU steps no output step matched produced no outputs: partial prefill
///   chunks. The requests whose first token comes in a later output step and
///   that were scheduled before such a step ended claim it, split by their
///   prefill tokens (requests of the same engine only, here and below);
/// * KV copies ([`GpuCopy::is_kv`]) are claimed by the requests whose
///   [submit, first token] holds the copy's start, split equally;
/// * step compute: the matched GPU step's time, else (no GPU records at all)
///   the engine thread's on-CPU time ([`EngineCompute`]).
///
/// Feed every record with [`Attribution::ingest`]; take a request's figures
/// with [`Attribution::take`] (by engine request id) once it is final.
#[derive(Debug, Default)]
pub struct Attribution {
    gpu: GpuSteps,
    cpu: EngineCompute,
    gpu_seen: bool,
    seen_writer: bool,
    watermark: u64,
    /// Engine request id -> key, and each key's figures. A key never finds
    /// another request: a step's members that were taken or forgotten since
    /// are gone.
    ids: super::FxMap<String, Key>,
    eng: super::slab::Slab<Eng>,
    outs: VecDeque<OutStep>,
    /// Decided GPU steps not yet matched, in order (of every engine).
    gsteps: VecDeque<GpuStep>,
    /// Engines that have GPU steps of their own ([`GpuStep::engine`]).
    gpu_engines: Vec<u32>,
    /// Output-less GPU steps waiting for a claim.
    silent: VecDeque<Silent>,
    /// KV copies waiting for a claim, with their step's engine key.
    kv: VecDeque<(u32, GpuCopy)>,
    /// Output steps waiting for their on-CPU figure, by end.
    cpu_wait: BTreeMap<u64, Vec<(Key, bool)>>,
    /// Every GPU step (copies dropped), and every output step's compute:
    /// for the report and the trace.
    steps: Vec<GpuStep>,
    step_compute: Vec<StepCompute>,
    pub counters: BTreeMap<&'static str, u64>,
}

impl Attribution {
    pub fn new() -> Self {
        Self::default()
    }

    /// [`Self::key`] when the caller kept the key this gave for `id` before
    /// (`hint`, [`super::slab::NO_KEY`] at first; updated): a key whose figures are still
    /// held is `id`'s key (keys are never reused, and `ids` moves an id to a
    /// new key only once its old figures are gone), so the id is neither
    /// hashed nor compared.
    #[inline]
    fn key_hinted(&mut self, id: &str, hint: Option<&mut Key>) -> (Key, &mut Eng) {
        let k = match hint {
            Some(h) if self.eng.contains_key(*h) => *h,
            Some(h) => {
                *h = self.key(id).0;
                *h
            }
            None => self.key(id).0,
        };
        (k, self.eng.get_mut(k).expect("held or just inserted"))
    }

    /// The key of engine request `id`, made (with empty figures) when new;
    /// the id is copied only then.
    fn key(&mut self, id: &str) -> (Key, &mut Eng) {
        let k = match self.ids.get_mut(id) {
            Some(k) if self.eng.contains_key(*k) => *k,
            Some(k) => {
                *k = self.eng.insert(Eng::default());
                *k
            }
            None => {
                let k = self.eng.insert(Eng::default());
                self.ids.insert(id.to_owned(), k);
                k
            }
        };
        (k, self.eng.get_mut(k).expect("held or just inserted"))
    }

    fn count(&mut self, what: &'static str, n: u64) {
        if n > 0 {
            *self.counters.entry(what).or_default() += n;
        }
    }

    /// Feeds one record (any kind), in recording order.
    pub fn ingest(&mut self, rec: &Record) {
        self.ingest_hinted(rec, rec.ts_ns(), &mut []);
    }

    /// [`Self::ingest`] of a record at `ts` (its `ts_ns()`) that names no
    /// engine request: most records are neither GPU work nor scheduler
    /// records, and only move the clock, here, without a call.
    #[inline(always)]
    pub(crate) fn tick(&mut self, rec: &Record, ts: u64) {
        match rec {
            Record::GpuKernel { .. } | Record::GpuMemcpy { .. } | Record::GpuMemset { .. } | Record::OffCpu { .. } | Record::GpuProcess { .. } | Record::EngineRequest { .. } | Record::EngineOutputs { .. } => {
                self.ingest_hinted(rec, ts, &mut [])
            }
            _ => {
                self.watermark = self.watermark.max(ts);
                self.gpu.push_at(rec, ts);
                self.after(ts);
            }
        }
    }

    /// [`Self::ingest`] of a record at `ts` (its `ts_ns()`), with the keys
    /// this gave before for the engine requests it names, in its order
    /// (see [`Self::key_hinted`]; empty: none kept), updated.
    pub(crate) fn ingest_hinted(&mut self, rec: &Record, ts: u64, hints: &mut [Key]) {
        self.watermark = self.watermark.max(ts);
        self.gpu.push_at(rec, ts);
        match rec {
            Record::GpuKernel { .. } | Record::GpuMemcpy { .. } | Record::GpuMemset { .. } => self.gpu_seen = true,
            Record::OffCpu { ts_ns, tgid, tid, off_ns, .. } => self.cpu.off_cpu(*ts_ns, *tgid, *tid, *off_ns),
            Record::GpuProcess { .. } => self.gpu.engines.learn(rec),
            Record::EngineRequest { ts_ns, request_id, prompt_tokens, .. } => {
                self.gpu.engines.learn(rec);
                let (_, e) = self.key_hinted(request_id, hints.first_mut());
                e.submit_ns = Some(e.submit_ns.map_or(*ts_ns, |s| s.min(*ts_ns)));
                e.prompt_tokens = e.prompt_tokens.or(*prompt_tokens);
                e.last_ns = ts;
            }
            Record::EngineOutputs { conn, ts_ns, dir, timestamp_s, outputs, .. } => {
                self.gpu.engines.learn(rec);
                // One copy per message: the writer's, or the reader's while
                // the writer is not traced.
                if *dir == Dir::Out {
                    if !self.seen_writer {
                        self.seen_writer = true;
                        self.drop_readers_steps();
                    }
                } else if self.seen_writer {
                    return self.after(ts);
                }
                let end = step_end_of(*ts_ns, *timestamp_s);
                let mut members = Vec::with_capacity(outputs.len());
                for (j, o) in outputs.iter().enumerate() {
                    let (k, e) = self.key_hinted(&o.request_id, hints.get_mut(j));
                    let first = o.new_tokens > 0 && e.first_token_ns.is_none();
                    if first {
                        e.first_token_ns = Some(end);
                    }
                    for ev in o.events.iter().filter(|ev| ev.kind == EV_SCHEDULED) {
                        if ev.timestamp_s.is_finite() && ev.timestamp_s > 0.0 && ev.timestamp_s < 1e10 {
                            let t = (ev.timestamp_s * 1e9).round() as u64;
                            e.scheduled_ns = Some(e.scheduled_ns.map_or(t, |s| s.min(t)));
                        }
                    }
                    if let Some(p) = &o.prefill {
                        e.computed_tokens = e.computed_tokens.or(p.computed_tokens).or_else(|| Some(p.prompt_tokens?.saturating_sub(p.cached_tokens?)));
                        e.prompt_tokens = e.prompt_tokens.or(p.prompt_tokens);
                    }
                    e.last_ns = ts;
                    members.push((k, first));
                }
                if !self.gpu_seen && *dir == Dir::Out && self.cpu.step_end(conn.tgid, end) {
                    self.cpu_wait.insert(end, members.clone());
                }
                let engine = if *dir == Dir::Out { conn.tgid } else { 0 };
                self.outs.push_back(OutStep { engine, end_ns: end, members });
            }
            _ => {}
        }
        self.after(ts);
    }

    /// The writer's copies are the steps from the first one on, as the
    /// engine side has it (`EngineSide`'s held readers' copies): readers'
    /// copies still waiting to be matched go, and the first tokens they
    /// marked are left for the writer's copies to mark. The API server's
    /// copy of the engine's first message may come first: a unix-socket read
    /// can return before the write that fed it, and the joiner holds a
    /// writer's message while its step may have other parts to come (with
    /// several API servers); taken as well, it was a second step of no
    /// engine. Readers' copies wait [`READER_MATCH_WAIT_NS`] for this.
    fn drop_readers_steps(&mut self) {
        let outs = std::mem::take(&mut self.outs);
        for o in outs {
            // A reader's copy has no engine (see `OutStep::engine`).
            if o.engine != 0 {
                self.outs.push_back(o);
                continue;
            }
            for (k, first) in o.members {
                if let Some(e) = self.eng.get_mut(k).filter(|e| first && e.first_token_ns == Some(o.end_ns)) {
                    e.first_token_ns = None;
                }
            }
        }
    }

    #[inline]
    fn after(&mut self, ts: u64) {
        self.cpu.advance(ts);
        // Both below do nothing unless a step is ready or due (most records
        // touch neither: they only move the watermark).
        if self.gpu.has_ready() || self.cpu.has_ready() {
            self.collect();
        }
        if !self.silent.is_empty() || !self.kv.is_empty() || self.outs.front().is_some_and(|o| self.watermark >= o.due_ns()) {
            self.mature(false);
        }
    }

    fn collect(&mut self) {
        while let Some(g) = self.gpu.pop() {
            self.decided(g);
        }
        for end in self.cpu.take_unknown() {
            // Counted once, in oncpu_windows_unknown.
            self.cpu_wait.remove(&end);
        }
        while let Some(c) = self.cpu.pop() {
            if self.gpu_seen {
                continue;
            }
            let Some(members) = self.cpu_wait.remove(&c.end_ns) else { continue };
            self.step_compute.push(StepCompute { end_ns: c.end_ns, compute_ns: c.on_cpu_ns, source: ComputeSource::Oncpu, gpu_end_ns: None });
            for (k, first) in members {
                if let Some(e) = self.eng.get_mut(k) {
                    let prefill = first || e.first_token_ns.is_none_or(|f| c.end_ns < f);
                    e.add_compute(c.on_cpu_ns, prefill, ComputeSource::Oncpu);
                }
            }
        }
    }

    /// A GPU step [`GpuSteps`] decided, in order.
    fn decided(&mut self, g: GpuStep) {
        if let Some(e) = g.engine.filter(|e| !self.gpu_engines.contains(e)) {
            self.gpu_engines.push(e);
        }
        self.gsteps.push_back(g);
    }

    fn mature(&mut self, all: bool) {
        while let Some(o) = self.outs.front() {
            if !all && self.watermark < o.due_ns() {
                break;
            }
            let o = self.outs.pop_front().expect("front checked");
            if o.members.is_empty() {
                // A message with no outputs: scheduler stats, which vLLM
                // (and the testbed) send after every step, one that made no
                // tokens too (a partial prefill chunk), or an engine's
                // report to the data-parallel coordinator. It claims no GPU
                // step: the next output of its engine finds a chunk's step
                // output-less.
                continue;
            }
            let key = if self.gpu_engines.contains(&o.engine) { o.engine } else { 0 };
            let mut mine: Option<GpuStep> = None;
            let mut i = 0;
            while self.gsteps.get(i).is_some_and(|g| g.end_ns <= o.end_ns.saturating_add(MATCH_SLACK_NS)) {
                if step_key(&self.gsteps[i]) != key {
                    // Another engine's: its own outputs match it, unless it
                    // is too old for any output still to come.
                    if o.end_ns.saturating_sub(self.gsteps[i].end_ns) > IPC_AFTER_GPU_MAX_NS + MATCH_WAIT_NS {
                        let g = self.gsteps.remove(i).expect("checked");
                        self.unmatched(g);
                    } else {
                        i += 1;
                    }
                    continue;
                }
                let g = self.gsteps.remove(i).expect("checked");
                if let Some(prev) = mine.replace(g) {
                    self.unmatched(prev);
                }
            }
            if mine.as_ref().is_some_and(|g| o.end_ns.saturating_sub(g.end_ns) > IPC_AFTER_GPU_MAX_NS) {
                let g = mine.take().expect("checked");
                self.unmatched(g);
            }
            self.apply(o, key, mine);
        }
        if all {
            while let Some(g) = self.gsteps.pop_front() {
                self.unmatched(g);
            }
        }
        // What no first token claimed in time.
        if self.silent.is_empty() && self.kv.is_empty() {
            return;
        }
        let old = if all { u64::MAX } else { self.watermark.saturating_sub(CLAIM_WAIT_NS) };
        let before = self.silent.len();
        self.silent.retain(|s| s.end_ns > old);
        let n = (before - self.silent.len()) as u64;
        self.count("gpu_steps_unattributed", n);
        let before = self.kv.len();
        self.kv.retain(|c| c.1.start_ns > old);
        let n = (before - self.kv.len()) as u64;
        self.count("gpu_kv_copies_unattributed", n);
    }

    /// A GPU step no output step is: output-less, its time waits for a claim.
    fn unmatched(&mut self, mut g: GpuStep) {
        let key = step_key(&g);
        self.kv.extend(g.copies().filter(|c| c.is_kv()).map(|c| (key, *c)));
        self.silent.push_back(Silent { key, end_ns: g.end_ns, gpu_ns: g.gpu_ns, kernels: g.by_kernel() });
        for r in &mut g.ranks {
            r.copies = Vec::new();
        }
        self.steps.push(g);
    }

    /// Output step `o`, whose GPU steps are those of engine key `key`, and
    /// the GPU step matched to it.
    fn apply(&mut self, o: OutStep, key: u32, g: Option<GpuStep>) {
        if g.is_none() && self.silent.is_empty() && self.kv.is_empty() {
            // No GPU step, and nothing a first token could claim: what is
            // below would only count (every output step of a recording
            // without CUPTI comes here).
            if self.gpu_seen {
                self.count("gpu_ipc_steps_unmatched", 1);
            }
            return;
        }
        let known: Vec<(Key, bool)> = o.members.into_iter().filter(|m| self.eng.contains_key(m.0)).collect();
        match g {
            Some(mut g) => {
                let w: Vec<(bool, u64)> = known.iter().map(|(k, first)| (*first, self.eng[*k].prefill_tokens())).collect();
                let mut toks = member_tokens(g.tokens, &w);
                // Tokens no output member accounts for are partial prefill
                // chunks of requests with no output yet: that part of the
                // step waits for their first tokens, like an output-less step.
                let members_tokens: u64 = toks.iter().sum();
                let rest = g.tokens.map_or(0, |t| t.saturating_sub(members_tokens));
                if rest > 0 && !known.is_empty() {
                    toks.push(rest);
                }
                let mut shares = split_by_tokens(g.gpu_ns, &toks);
                // Each kernel name's time, split the same way: a row per name
                // (members, then the set-aside part).
                let names = if known.is_empty() { Vec::new() } else { g.by_kernel() };
                let mut parts = Vec::with_capacity(names.len() * toks.len());
                split_many(names.iter().map(|p| p.1), &toks, &mut parts, &mut Vec::new());
                let row = toks.len();
                if rest > 0 && !known.is_empty() {
                    let part = shares.pop().expect("pushed");
                    let kernels = names.iter().enumerate().map(|(j, (name, _))| (*name, parts[j * row + row - 1])).collect();
                    self.silent.push_back(Silent { key, end_ns: g.end_ns, gpu_ns: part, kernels });
                }
                for (i, ((k, first), ns)) in known.iter().zip(shares).enumerate() {
                    let e = self.eng.get_mut(*k).expect("known");
                    e.add_kernels(names.iter().enumerate().map(|(j, (name, _))| (*name, parts[j * row + i])));
                    let prefill = *first || e.first_token_ns.is_none_or(|f| o.end_ns < f);
                    e.share.steps += 1;
                    if prefill {
                        e.share.prefill_ns += ns;
                    } else {
                        e.share.decode_ns += ns;
                    }
                    e.add_compute(g.gpu_ns, prefill, ComputeSource::Cupti);
                }
                if known.is_empty() {
                    self.count("gpu_steps_unattributed", 1);
                }
                self.step_compute.push(StepCompute { end_ns: o.end_ns, compute_ns: g.gpu_ns, source: ComputeSource::Cupti, gpu_end_ns: Some(g.gpu_end_ns) });
                self.kv.extend(g.copies().filter(|c| c.is_kv()).map(|c| (key, *c)));
                for r in &mut g.ranks {
                    r.copies = Vec::new();
                }
                self.steps.push(g);
            }
            None if self.gpu_seen => self.count("gpu_ipc_steps_unmatched", 1),
            None => {}
        }
        // First tokens claim the output-less steps of their prefill and the
        // KV copies on their path.
        let firsts: Vec<Key> = known.iter().filter(|m| m.1).map(|m| m.0).collect();
        if firsts.is_empty() {
            return;
        }
        let mut keep = VecDeque::new();
        while let Some(s) = self.silent.pop_front() {
            let who: Vec<Key> = if s.key != key || s.end_ns > o.end_ns {
                Vec::new()
            } else {
                firsts.iter().copied().filter(|k| self.eng[*k].scheduled_ns.or(self.eng[*k].submit_ns).is_some_and(|t| t <= s.end_ns)).collect()
            };
            if who.is_empty() {
                keep.push_back(s);
                continue;
            }
            let w: Vec<u64> = who.iter().map(|k| self.eng[*k].prefill_tokens()).collect();
            let mut parts = Vec::with_capacity(s.kernels.len() * w.len());
            split_many(s.kernels.iter().map(|p| p.1), &w, &mut parts, &mut Vec::new());
            let row = w.len();
            for (i, (k, ns)) in who.iter().zip(split_by_tokens(s.gpu_ns, &w)).enumerate() {
                let e = self.eng.get_mut(*k).expect("known");
                e.add_kernels(s.kernels.iter().enumerate().map(|(j, (name, _))| (*name, parts[j * row + i])));
                e.share.prefill_ns += ns;
                e.share.steps += 1;
                e.add_compute(s.gpu_ns, true, ComputeSource::Cupti);
            }
        }
        self.silent = keep;
        let mut spans: BTreeMap<Key, Vec<(u64, u64)>> = BTreeMap::new();
        let mut keep = VecDeque::new();
        while let Some((ck, c)) = self.kv.pop_front() {
            let who: Vec<Key> = if ck != key || c.start_ns > o.end_ns {
                Vec::new()
            } else {
                firsts.iter().copied().filter(|k| self.eng[*k].kv_window_start_ns() <= c.start_ns).collect()
            };
            if who.is_empty() {
                keep.push_back((ck, c));
                continue;
            }
            for (k, ns) in who.iter().zip(split_by_tokens(c.end_ns - c.start_ns, &vec![1; who.len()])) {
                self.eng.get_mut(*k).expect("known").share.kv_gpu_ns += ns;
                spans.entry(*k).or_default().push((c.start_ns, c.end_ns.min(o.end_ns)));
            }
        }
        self.kv = keep;
        let mut capped = 0;
        for (k, mut v) in spans {
            let e = self.eng.get_mut(k).expect("known");
            let cut = e.scheduled_ns.or(e.submit_ns).unwrap_or(0);
            for (a, b) in union(&mut v) {
                e.share.kv_queue_ns += b.min(cut).saturating_sub(a);
                e.share.kv_prefill_ns += b.saturating_sub(a.max(cut));
                match e.share.kv_spans.get_mut(usize::from(e.share.kv_spans_len)) {
                    Some(slot) if b > a => {
                        *slot = (a, b);
                        e.share.kv_spans_len += 1;
                    }
                    Some(_) => {}
                    None => capped += 1,
                }
            }
        }
        self.count("gpu_kv_spans_capped", capped);
    }

    /// The figures of an engine request (its id as on the IPC), once it is
    /// final: its GPU share (when a GPU source exists) and the compute of its
    /// steps. Each request's figures are taken once.
    pub fn take(&mut self, engine_request_id: &str) -> (Option<GpuShare>, Option<RequestCompute>, Option<Vec<KernelShare>>) {
        let Some(e) = self.ids.remove(engine_request_id).and_then(|k| self.eng.remove(k)) else { return (None, None, None) };
        let kernels = self.gpu_seen.then(|| {
            let mut v: Vec<(u32, u64)> = e.kernels.into_iter().collect();
            // Most time first; ties by name, so the list is the same every run.
            v.sort_unstable_by(|a, b| b.1.cmp(&a.1).then_with(|| self.gpu.names.name(a.0).cmp(self.gpu.names.name(b.0))));
            v.truncate(KERNELS_PER_REQUEST);
            v.into_iter().map(|(id, gpu_ns)| KernelShare { name: self.gpu.names.get(id), gpu_ns }).collect()
        });
        (self.gpu_seen.then_some(e.share), e.compute, kernels)
    }

    /// Lets go of requests nobody took (not linked to an HTTP request).
    pub fn forget_untaken(&mut self) {
        let old = self.watermark.saturating_sub(UNTAKEN_NS);
        let before = self.eng.len();
        self.eng.retain(|e| e.last_ns > old);
        let n = (before - self.eng.len()) as u64;
        if n > 0 {
            let eng = &self.eng;
            self.ids.retain(|_, k| eng.contains_key(*k));
        }
        self.count("attribution_requests_untaken", n);
    }

    /// The recording's kernels by name ([`KernelNames::stats`]).
    pub fn kernel_stats(&self) -> Vec<super::KernelStat> {
        self.gpu.names.stats()
    }

    /// GPU steps decided so far (copies dropped), and output steps' compute.
    pub fn take_steps(&mut self) -> (Vec<GpuStep>, Vec<StepCompute>) {
        (std::mem::take(&mut self.steps), std::mem::take(&mut self.step_compute))
    }

    /// The recording ended: decides everything left. Requests are still to
    /// be taken; [`Attribution::counters`] holds every counter.
    pub fn finish(&mut self) {
        for g in self.gpu.finish() {
            self.decided(g);
        }
        for c in self.cpu.finish() {
            self.cpu.ready.push_back(c);
        }
        self.collect();
        self.mature(true);
        if !self.gpu_seen {
            let n = self.cpu_wait.len() as u64;
            self.cpu_wait.clear();
            self.count("oncpu_steps_unknown", n);
        }
        for (k, v) in std::mem::take(&mut self.gpu.counters).into_iter().chain(std::mem::take(&mut self.cpu.counters)) {
            *self.counters.entry(k).or_default() += v;
        }
    }

    /// Whether GPU activity was seen.
    pub fn gpu_seen(&self) -> bool {
        self.gpu_seen
    }
}

/// Union of intervals, sorted.
pub fn union(spans: &mut [(u64, u64)]) -> Vec<(u64, u64)> {
    spans.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &(a, b) in spans.iter() {
        match out.last_mut() {
            Some(l) if a <= l.1 => l.1 = l.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

/// Steps per process of a recording, for reports: every record through
/// [`GpuSteps`] at once.
pub fn steps_of(records: &[Record]) -> (Vec<GpuStep>, BTreeMap<&'static str, u64>) {
    let mut g = GpuSteps::new();
    let mut out = Vec::new();
    for r in records {
        g.push(r);
        while let Some(s) = g.pop() {
            out.push(s);
        }
    }
    out.extend(g.finish());
    (out, std::mem::take(&mut g.counters))
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: u64 = 1_000;
    const MS: u64 = 1_000_000;
    const T0: u64 = 10_000_000_000;

    fn kernel(pid: u32, stream: u32, s: u64, e: u64, name: &str, grid_x: u32, graph_id: u32) -> Record {
        Record::GpuKernel {
            ts_ns: s,
            end_ns: e,
            pid,
            device: 0,
            context: 1,
            stream,
            correlation_id: 1,
            graph_id,
            graph_node_id: u64::from(graph_id) * 100,
            name: name.into(),
            grid: [grid_x, 1, 1],
            block: [128, 1, 1],
            static_shared_mem: 0,
            dynamic_shared_mem: 0,
            registers_per_thread: 32,
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn copy(pid: u32, stream: u32, s: u64, e: u64, kind: u8, src: u8, dst: u8, bytes: u64) -> Record {
        Record::GpuMemcpy {
            ts_ns: s,
            end_ns: e,
            pid,
            device: 0,
            context: 1,
            stream,
            kind,
            src_kind: src,
            dst_kind: dst,
            flags: 1,
            bytes,
            correlation_id: 2,
            runtime_correlation_id: 0,
            graph_id: 0,
            graph_node_id: 0,
            peer: None,
        }
    }

    const PAGEABLE: u8 = 1;
    const DEVICE: u8 = 3;

    /// The sampled ids to pinned host memory (vLLM's `_to_list`).
    fn ids_copy(pid: u32, s: u64, e: u64) -> Record {
        copy(pid, 7, s, e, COPY_DTOH, DEVICE, MEM_PINNED, 64)
    }

    fn sync(pid: u32, s: u64, e: u64, sync_type: u32, stream: Option<u32>) -> Record {
        Record::GpuSync { ts_ns: s, end_ns: e, pid, sync_type, context: 1, stream, correlation_id: 3, cuda_event: (sync_type == SYNC_EVENT).then_some(4) }
    }

    const RESHAPE: &str = "_ZN4vllm30reshape_and_cache_flash_kernelIN3c108BFloat16ES2_LNS_18Fp8KVCacheDataTypeE0EEEvPKT_S7_PT0_S9_PKllllliiPKfSD_";

    /// One eager vLLM-like step from `t`: input H2D (pageable, small), two
    /// layers of (reshape_and_cache, gemm) on stream 7, the ids copy, and an
    /// event synchronize the host entered while the GPU was still busy.
    /// Returns the records and (copy end, sync end).
    fn eager_step(pid: u32, t: u64, tokens: u32) -> (Vec<Record>, u64, u64) {
        let mut v = vec![copy(pid, 7, t, t + 5 * US, COPY_HTOD, PAGEABLE, DEVICE, 2048)];
        let mut at = t + 10 * US;
        for _ in 0..2 {
            v.push(kernel(pid, 7, at, at + 20 * US, RESHAPE, tokens, 0));
            v.push(kernel(pid, 7, at + 20 * US, at + 300 * US, "sm90_xmma_gemm_bf16", 132, 0));
            at += 300 * US;
        }
        let (cs, ce) = (at + 5 * US, at + 8 * US);
        v.push(ids_copy(pid, cs, ce));
        // The host reached the sync long before the GPU got there.
        v.push(sync(pid, t + 50 * US, ce + 4 * US, SYNC_EVENT, None));
        v.sort_by_key(Record::ts_ns);
        (v, ce, ce + 4 * US)
    }

    fn run(recs: &[Record]) -> (Vec<GpuStep>, BTreeMap<&'static str, u64>) {
        let mut sorted = recs.to_vec();
        sorted.sort_by_key(Record::ts_ns);
        steps_of(&sorted)
    }

    #[test]
    fn gpu_steps_end_at_the_pinned_ids_copy_a_host_sync_waited_for_and_own_the_work_before_it() {
        let mut recs = Vec::new();
        let mut ends = Vec::new();
        for (k, tokens) in [(0u64, 37u32), (1, 3), (2, 3)] {
            let (v, ce, se) = eager_step(1000, T0 + k * 10 * MS, tokens);
            recs.extend(v);
            ends.push((ce, se));
        }
        let (steps, counters) = run(&recs);
        assert_eq!(steps.len(), 3, "{counters:?}");
        for (k, s) in steps.iter().enumerate() {
            assert_eq!((s.gpu_end_ns, s.end_ns), ends[k]);
            assert_eq!(s.ranks.len(), 1);
            let r = &s.ranks[0];
            assert_eq!((r.pid, r.index, r.kernels, r.graph_kernels, r.streams), (1000, k as u32, 4, 0, 1));
            assert_eq!(r.start_ns, T0 + k as u64 * 10 * MS, "the step's input copy starts it");
            // Input copy 5 µs + kernels 10 µs..610 µs + ids copy 615..618 µs.
            assert_eq!(r.busy_ns, 5 * US + 600 * US + 3 * US);
            assert_eq!(r.kernel_ns, 600 * US);
            assert_eq!(s.gpu_ns, r.busy_ns);
            assert_eq!(r.copies.len(), 1, "the input copy is kept, the end copy is not");
            assert!(!r.copies[0].is_kv(), "2 KiB of inputs is no KV transfer");
        }
        assert_eq!(steps.iter().map(|s| s.tokens).collect::<Vec<_>>(), vec![Some(37), Some(3), Some(3)]);
        assert_eq!(counters.get("gpu_records_outside_steps"), None);
    }

    #[test]
    fn graph_replays_and_a_second_stream_belong_to_the_step_they_ran_in_and_overlap_counts_once() {
        let pid = 7;
        let t = T0;
        let mut recs = vec![
            // Decode step replayed from a CUDA graph (every node carries graph 9).
            kernel(pid, 7, t, t + 100 * US, RESHAPE, 8, 9),
            kernel(pid, 7, t + 100 * US, t + 400 * US, "flash_fwd_splitkv_kernel", 64, 9),
            // A side stream overlapping the graph by 50 µs.
            kernel(pid, 13, t + 350 * US, t + 450 * US, "all_gather_kernel", 4, 0),
            ids_copy(pid, t + 460 * US, t + 462 * US),
            sync(pid, t + 20 * US, t + 470 * US, SYNC_EVENT, None),
        ];
        // Next step's kernel starts right after the copy: not this step's.
        recs.push(kernel(pid, 7, t + 463 * US, t + 500 * US, RESHAPE, 8, 9));
        let (v, _, _) = eager_step(pid, t + 2 * MS, 8);
        recs.extend(v);
        let (steps, counters) = run(&recs);
        assert_eq!(steps.len(), 2, "{counters:?}");
        let r = &steps[0].ranks[0];
        assert_eq!((r.kernels, r.graph_kernels, r.streams), (3, 2, 2));
        assert_eq!(r.busy_ns, 450 * US + 2 * US, "[0, 450] ∪ [460, 462]");
        assert_eq!(r.kernel_ns, 500 * US);
        assert_eq!(steps[0].tokens, Some(8));
        assert_eq!(steps[1].ranks[0].kernels, 5, "the early kernel joins the next step");
    }

    #[test]
    fn a_sync_entered_after_the_copy_finished_still_ends_the_step() {
        let pid = 3;
        let t = T0;
        let recs = vec![
            kernel(pid, 7, t, t + 100 * US, "gemm", 1, 0),
            ids_copy(pid, t + 100 * US, t + 101 * US),
            // The GPU was ahead: the host syncs 300 µs later and returns at once.
            sync(pid, t + 401 * US, t + 402 * US, SYNC_STREAM, Some(7)),
        ];
        let (steps, _) = run(&recs);
        assert_eq!(steps.len(), 1);
        assert_eq!((steps[0].gpu_end_ns, steps[0].end_ns), (t + 101 * US, t + 402 * US));
    }

    #[test]
    fn copies_nobody_waited_for_kv_offloads_and_syncs_on_other_streams_do_not_end_steps() {
        let pid = 4;
        let t = T0;
        let recs = vec![
            kernel(pid, 7, t, t + 100 * US, "gemm", 1, 0),
            // A small pinned D2H copy no sync waits for.
            ids_copy(pid, t + 100 * US, t + 101 * US),
            // A 64 KiB block table from pageable memory: inputs, not KV.
            copy(pid, 7, t + 150 * US, t + 160 * US, COPY_HTOD, PAGEABLE, DEVICE, 64 * 1024),
            // KV offload: a 32 KiB block to pinned memory, then a stream sync (the testbed does this).
            copy(pid, 7, t + 200 * US, t + 230 * US, COPY_DTOH, DEVICE, MEM_PINNED, 32 * 1024),
            sync(pid, t + 200 * US, t + 232 * US, SYNC_STREAM, Some(7)),
            // The ids copy on stream 7, a stream sync of stream 8 (not it), then the event sync.
            ids_copy(pid, t + 20 * MS, t + 20 * MS + 2 * US),
            sync(pid, t + 19 * MS, t + 20 * MS + 3 * US, SYNC_STREAM, Some(8)),
            sync(pid, t + 20 * MS + 10 * US, t + 20 * MS + 12 * US, SYNC_EVENT, None),
            // A stream-wait-event is no host wait.
            ids_copy(pid, t + 40 * MS, t + 40 * MS + 2 * US),
            sync(pid, t + 40 * MS, t + 40 * MS + 5 * US, 2, Some(7)),
        ];
        let (steps, counters) = run(&recs);
        assert_eq!(steps.len(), 1, "{steps:#?}");
        let s = &steps[0];
        assert_eq!((s.gpu_end_ns, s.end_ns), (t + 20 * MS + 2 * US, t + 20 * MS + 12 * US));
        let kv: Vec<&GpuCopy> = s.copies().filter(|c| c.is_kv()).collect();
        assert_eq!(kv.len(), 1);
        assert_eq!(s.copies().count(), 3, "the lone ids copy, the pageable block table and the offload");
        assert_eq!((kv[0].bytes, kv[0].kind), (32 * 1024, COPY_DTOH));
        assert_eq!(counters.get("gpu_step_copies_unsynced"), Some(&2), "the lone copy and the one with only a GPU-side wait");
        assert_eq!(counters.get("gpu_records_outside_steps"), Some(&1), "the last copy, after the last step end");
    }

    #[test]
    fn two_small_copies_before_one_sync_end_the_step_at_the_later_one() {
        let pid = 5;
        let t = T0;
        let recs = vec![
            kernel(pid, 7, t, t + 100 * US, "gemm", 1, 0),
            ids_copy(pid, t + 100 * US, t + 101 * US),
            // Logprobs, also small and pinned.
            ids_copy(pid, t + 102 * US, t + 104 * US),
            sync(pid, t + 10 * US, t + 106 * US, SYNC_EVENT, None),
        ];
        let (steps, counters) = run(&recs);
        assert_eq!(steps.len(), 1);
        assert_eq!(steps[0].gpu_end_ns, t + 104 * US);
        let copies = &steps[0].ranks[0].copies;
        assert_eq!(copies.len(), 1, "the first ids copy stays a copy of the step");
        assert!(!copies[0].is_kv(), "64 bytes of ids are no KV transfer");
        assert_eq!(counters.get("gpu_step_copies_unsynced"), None);
    }

    #[test]
    fn tensor_parallel_ranks_align_into_one_step_and_a_missing_rank_is_counted() {
        let mut recs = Vec::new();
        for k in 0..4u64 {
            let t = T0 + k * 5 * MS;
            let (a, _, _) = eager_step(100, t, 16);
            recs.extend(a);
            if k != 2 {
                // Rank 1 runs 20 µs behind, and its step is 100 µs longer.
                let (mut b, _, _) = eager_step(101, t + 20 * US, 16);
                b.push(kernel(101, 8, t + 700 * US, t + 720 * US, "allreduce", 1, 0));
                recs.extend(b);
            }
        }
        let (steps, counters) = run(&recs);
        assert_eq!(steps.len(), 4, "{counters:?}");
        let ranks: Vec<usize> = steps.iter().map(|s| s.ranks.len()).collect();
        assert_eq!(ranks, vec![2, 2, 1, 2]);
        assert_eq!(steps[0].ranks.iter().map(|r| (r.pid, r.index)).collect::<Vec<_>>(), vec![(100, 0), (101, 0)]);
        assert_eq!(steps[3].ranks.iter().map(|r| (r.pid, r.index)).collect::<Vec<_>>(), vec![(100, 3), (101, 2)]);
        // Rank 1's busy time in a step: its own 608 µs … but its all-reduce
        // kernel starts after its copy ended, so it belongs to its next step.
        assert_eq!(steps[0].gpu_ns, 608 * US);
        assert_eq!(steps[1].ranks[1].kernels, 5, "rank 1's all-reduce of step 0 lands in its step 1");
        assert_eq!(steps[0].end_ns, steps[0].ranks[1].end_ns, "the host end is the later rank's");
        assert_eq!(counters.get("gpu_step_ranks_missing"), Some(&1));
    }

    fn hello(pid: u32, ppid: u32) -> Record {
        Record::GpuProcess { ts_ns: T0 - 100 * MS, pid, ppid, own_pid: pid, comm: "python".into(), cupti_version: 130401, clock: 1, enabled: 0, init_ns: T0 - 200 * MS, cupti_lib: "libcupti.so".into() }
    }

    fn engine_reads_request(engine: u32, at: u64) -> Record {
        Record::EngineRequest {
            conn: ConnKey { tgid: engine, fd: 12, ino: u64::from(engine) },
            ts_ns: at,
            tid: engine,
            dir: Dir::In,
            request_id: format!("r-{engine}"),
            external_req_id: None,
            prompt_tokens: Some(8),
            max_tokens: None,
            arrival_time_s: None,
            traceparent: None,
            data_parallel_rank: None,
            truncated: false,
        }
    }

    #[test]
    fn data_parallel_engines_never_align_into_one_step_and_their_tensor_parallel_workers_do() {
        // vLLM with data parallelism 3 behind one API server (pid 50):
        // engine 100 and engine 200 run their models themselves (TP 1);
        // engine 300 has two TP workers, 301 and 302, spawned from it. The
        // engines step on their own clocks, 0.4–1 ms apart: closer than
        // ranks of one step may be.
        let mut recs = vec![hello(100, 50), hello(200, 50), hello(301, 300), hello(302, 300)];
        recs.extend([100, 200, 300].map(|e| engine_reads_request(e, T0 - MS)));
        for k in 0..3u64 {
            let t = T0 + k * 5 * MS;
            recs.extend(eager_step(100, t, 16).0);
            recs.extend(eager_step(200, t + 400 * US, 24).0);
            recs.extend(eager_step(301, t + MS, 32).0);
            if k != 1 {
                recs.extend(eager_step(302, t + MS + 20 * US, 32).0);
            }
        }
        let (steps, counters) = run(&recs);
        let got: Vec<(Option<u32>, Vec<u32>, Option<u64>)> = steps.iter().map(|s| (s.engine, s.ranks.iter().map(|r| r.pid).collect(), s.tokens)).collect();
        let mut want = Vec::new();
        for k in 0..3 {
            want.push((Some(100), vec![100], Some(16)));
            want.push((Some(200), vec![200], Some(24)));
            want.push((Some(300), if k == 1 { vec![301] } else { vec![301, 302] }, Some(32)));
        }
        assert_eq!(got, want, "{counters:?}");
        assert_eq!(counters.get("gpu_step_ranks_missing"), Some(&1), "only engine 300 lost a rank, once");

        // Without the IPC (no engine known), the workers still align by
        // their parent; the engines' own processes share theirs (the API
        // server) and stay merged: nothing tells them apart.
        recs.retain(|r| !matches!(r, Record::EngineRequest { .. }));
        let (steps, _) = run(&recs);
        assert!(steps.iter().all(|s| s.engine.is_none()));
        let ranks: Vec<Vec<u32>> = steps.iter().map(|s| s.ranks.iter().map(|r| r.pid).collect()).collect();
        assert_eq!(ranks[..2], [vec![100, 200], vec![301, 302]]);
    }

    #[test]
    fn bad_late_and_stray_gpu_records_are_counted_and_never_panic() {
        let pid = 9;
        let t = T0;
        let mut recs = vec![
            kernel(pid, 7, t, t + 100 * US, "gemm", 1, 0),
            kernel(pid, 7, 0, 5, "zero", 1, 0),
            kernel(pid, 7, t + 5 * US, t + 4 * US, "reversed", 1, 0),
            ids_copy(pid, t + 100 * US, t + 101 * US),
            sync(pid, t + 10 * US, t + 102 * US, SYNC_EVENT, None),
        ];
        // Warm-up work of another process that never ends a step.
        for k in 0..10 {
            recs.push(kernel(77, 7, t + k * 3 * MS, t + k * 3 * MS + 10 * US, "warmup", 1, 0));
        }
        let mut sorted = recs.clone();
        sorted.sort_by_key(Record::ts_ns);
        // A record of an already handed-out step (decided at 20.1 ms) arrives late.
        sorted.push(kernel(77, 7, t + 3 * MS, t + 3 * MS + 1, "x", 1, 0));
        sorted.push(kernel(pid, 7, t + 50 * US, t + 60 * US, "late", 1, 0));
        sorted.push(Record::Drops { ts_ns: t + 3 * MAX_STEP_NS, counters: vec![] });
        let (steps, counters) = steps_of(&sorted);
        assert_eq!(steps.len(), 1);
        assert_eq!(steps[0].ranks[0].kernels, 1);
        assert_eq!(counters.get("gpu_step_records_invalid"), Some(&2));
        assert_eq!(counters.get("gpu_step_records_late"), Some(&1));
        assert_eq!(counters.get("gpu_records_outside_steps"), Some(&11), "pid 77's work, let go after {MAX_STEP_NS} ns");

        // Arbitrary streams: no panic, every activity record accounted once.
        let mut next = crate::testutil::xorshift(0x2545_f491_4f6c_dd1d);
        for _ in 0..50 {
            let mut recs = Vec::new();
            let mut now = T0;
            for _ in 0..400 {
                now += next() % (200 * US);
                let d = next() % (300 * US);
                let pid = 1 + (next() % 3) as u32;
                let r = match next() % 6 {
                    0 | 1 => kernel(pid, 7 + (next() % 2) as u32, now, now + d, if next().is_multiple_of(2) { RESHAPE } else { "k" }, (next() % 64) as u32, (next() % 2) as u32),
                    2 => ids_copy(pid, now, now + d),
                    3 => copy(pid, 7, now, now + d, (next() % 11) as u8, (next() % 4) as u8, (next() % 4) as u8, next() % 100_000),
                    _ => sync(pid, now, now + d, (next() % 5) as u32, Some(7)),
                };
                recs.push(r);
            }
            let (steps, counters) = steps_of(&recs);
            let acts = recs.iter().filter(|r| !matches!(r, Record::GpuSync { .. })).count() as u64;
            let in_steps: u64 = steps.iter().flat_map(|s| &s.ranks).map(|r| u64::from(r.kernels)).sum::<u64>()
                + steps.iter().flat_map(|s| &s.ranks).map(|r| r.copies.len() as u64).sum::<u64>();
            let c = |k: &str| counters.get(k).copied().unwrap_or(0);
            assert!(in_steps + c("gpu_records_outside_steps") + c("gpu_step_records_late") <= acts);
            let mut last: BTreeMap<u32, (u32, u64)> = BTreeMap::new();
            for r in steps.iter().flat_map(|s| &s.ranks) {
                if let Some(&(i, e)) = last.get(&r.pid) {
                    assert!(r.index == i + 1 && r.gpu_end_ns >= e, "each process's steps in order");
                }
                assert!(r.start_ns <= r.gpu_end_ns && r.gpu_end_ns <= r.end_ns);
                last.insert(r.pid, (r.index, r.gpu_end_ns));
            }
        }
    }

    #[test]
    fn split_by_tokens_is_proportional_and_adds_up_exactly() {
        assert_eq!(split_by_tokens(1000, &[1, 1, 2]), vec![250, 250, 500]);
        assert_eq!(split_by_tokens(10, &[1, 1, 1]), vec![4, 3, 3], "leftover to the earliest of equal remainders");
        assert_eq!(split_by_tokens(100, &[0, 0]), vec![50, 50], "no tokens: equal shares");
        assert_eq!(split_by_tokens(7, &[]), Vec::<u64>::new());
        let s = split_by_tokens(1_000_003, &[512, 1, 1, 1, 7]);
        assert_eq!(s.iter().sum::<u64>(), 1_000_003);
        // 980 846.62, 1 915.71 ×3, 13 410.00: two leftover ns to the largest remainders.
        assert_eq!(s, vec![980_846, 1_916, 1_916, 1_915, 13_410]);
        // One leftover ns (the fast path) goes where sorting the remainders puts it.
        assert_eq!(split_by_tokens(11, &[1, 1]), vec![6, 5]);
        assert_eq!(split_by_tokens(101, &[1, 3, 3]), vec![15, 43, 43], "14.43, 43.29, 43.29: to the largest remainder");
        // Several totals over the same tokens: each row as split_by_tokens gives it.
        let (mut out, mut rems) = (Vec::new(), Vec::new());
        split_many([1000, 10, 11, 0], &[1, 1, 2], &mut out, &mut rems);
        let rows: Vec<Vec<u64>> = [1000, 10, 11, 0].iter().map(|&t| split_by_tokens(t, &[1, 1, 2])).collect();
        assert_eq!(out, rows.concat());
    }

    #[test]
    fn member_tokens_give_prefills_the_steps_tokens_less_one_per_decoder() {
        // Two decoders and two prefills (300 and 100 prompt tokens) in a 402-token step.
        let m = [(false, 1), (true, 300), (true, 100), (false, 1)];
        assert_eq!(member_tokens(Some(402), &m), vec![1, 300, 100, 1]);
        // A final chunk: the step had 52 tokens, the prompt 300.
        assert_eq!(member_tokens(Some(52), &[(false, 1), (true, 300)]), vec![1, 51]);
        // No kernel count: the prefill tokens themselves.
        assert_eq!(member_tokens(None, &[(false, 1), (true, 300)]), vec![1, 300]);
    }

    use crate::event::ConnKey;
    use crate::model::{EngineEvent, EngineOutput, PrefillStats};

    const IPC: ConnKey = ConnKey { tgid: 2, fd: 9, ino: 99 };

    fn add(at: u64, id: &str, prompt: u64) -> Record {
        add_on(IPC, Dir::Out, at, id, prompt)
    }

    /// `id` submitted on `conn`: the frontend's write (Out) or the engine's read (In).
    fn add_on(conn: ConnKey, dir: Dir, at: u64, id: &str, prompt: u64) -> Record {
        Record::EngineRequest {
            conn,
            ts_ns: at,
            tid: 1,
            dir,
            request_id: id.into(),
            external_req_id: None,
            prompt_tokens: Some(prompt),
            max_tokens: None,
            arrival_time_s: None,
            traceparent: None,
            data_parallel_rank: None,
            truncated: false,
        }
    }

    /// An output message built at `end`, sent 50 µs later; members (id,
    /// scheduled at, computed prompt tokens) get their first token when
    /// `scheduled` is given.
    fn outputs(end: u64, members: &[(&str, Option<(u64, u64)>)]) -> Record {
        outputs_on(IPC, end, members)
    }

    /// [`outputs`] as the engine process `conn.tgid` wrote it.
    fn outputs_on(conn: ConnKey, end: u64, members: &[(&str, Option<(u64, u64)>)]) -> Record {
        Record::EngineOutputs {
            conn,
            ts_ns: end + 50 * US,
            tid: 3,
            dir: Dir::Out,
            engine_index: Some(0),
            timestamp_s: Some(end as f64 / 1e9),
            outputs: members
                .iter()
                .map(|(id, first)| EngineOutput {
                    request_id: (*id).into(),
                    new_tokens: 1,
                    finish_reason: None,
                    events: first.map(|(t, _)| vec![EngineEvent { kind: 2, timestamp_s: t as f64 / 1e9 }]).unwrap_or_default(),
                    prefill: first.map(|(_, c)| PrefillStats { prompt_tokens: Some(c), computed_tokens: Some(c), cached_tokens: Some(0), ..Default::default() }),
                })
                .collect(),
            outputs_total: Some(members.len() as u64),
            finished_requests: vec![],
            truncated: false,
        }
    }

    /// A GPU step of `busy` ns from `start`: one reshape_and_cache kernel
    /// (`tokens` blocks), then the ids copy; the host sync returns 5 µs
    /// after. Host end: start + busy + 5 µs.
    fn gpu_step(pid: u32, start: u64, busy: u64, tokens: u32) -> Vec<Record> {
        let end = start + busy;
        vec![kernel(pid, 7, start, end - 3 * US, RESHAPE, tokens, 0), ids_copy(pid, end - 3 * US, end), sync(pid, start + US, end + 5 * US, SYNC_EVENT, None)]
    }

    fn attribute_all(recs: &mut [Record]) -> Attribution {
        recs.sort_by_key(Record::ts_ns);
        let mut a = Attribution::new();
        for r in recs.iter() {
            a.ingest(r);
        }
        a.finish();
        a
    }

    #[test]
    fn a_requests_kv_copy_intervals_are_kept_for_the_trace_up_to_the_cap_and_the_rest_counted() {
        // A waits from 1 ms; six disjoint 100 µs onloads (two of them
        // touching: one union interval) before its first step at 2–10 ms.
        let mut recs = vec![add(MS, "A", 100)];
        for k in [0, 1, 3, 5, 7, 9] {
            let s = MS + 100 * US + k * 100 * US;
            recs.push(copy(1000, 9, s, s + 100 * US, COPY_HTOD, MEM_PINNED, DEVICE, 1 << 20));
        }
        recs.extend(gpu_step(1000, 2 * MS, 8 * MS, 100));
        recs.push(outputs(10 * MS + 100 * US, &[("A", Some((MS + 50 * US, 100)))]));
        let mut a = attribute_all(&mut recs);
        let (g, _, _) = a.take("A");
        let g = g.expect("share");
        let spans: Vec<(u64, u64)> = [(11, 13), (14, 15), (16, 17), (18, 19)].iter().map(|&(s, e)| (s * 100 * US, e * 100 * US)).collect();
        assert_eq!(g.kv_spans(), &spans[..]);
        assert_eq!(g.kv_wall_ns(), 600 * US, "the figures count every interval, kept or not");
        assert_eq!(a.counters.get("gpu_kv_spans_capped"), Some(&1));
    }

    #[test]
    fn attribution_splits_each_gpu_step_by_tokens_and_puts_kv_copies_on_the_waiting_requests_path() {
        // A: 100-token prompt, prefilled alone in step 0, decodes in 1 and 3.
        // B: 50 tokens, submitted at 12 ms, its KV onloaded at 13–15 ms
        //    (scheduled at 14 ms), first token in step 1.
        // C: a 400-token prompt chunked over step 2 (no outputs) and step 3.
        let mut recs = vec![add(500 * US, "A", 100), add(12 * MS, "B", 50), add(21 * MS, "C", 400)];
        recs.extend(gpu_step(1000, 2 * MS, 8 * MS, 100));
        recs.push(outputs(10 * MS + 100 * US, &[("A", Some((MS, 100)))]));
        recs.push(copy(1000, 7, 13 * MS, 15 * MS, COPY_HTOD, MEM_PINNED, DEVICE, 1 << 20));
        recs.extend(gpu_step(1000, 15 * MS, 5_100_000, 51));
        recs.push(outputs(20 * MS + 200 * US, &[("A", None), ("B", Some((14 * MS, 50)))]));
        recs.extend(gpu_step(1000, 24 * MS, 6 * MS, 256));
        recs.extend(gpu_step(1000, 37 * MS, 3 * MS, 145));
        recs.push(outputs(40 * MS + 100 * US, &[("A", None), ("C", Some((21 * MS, 400)))]));
        let mut a = attribute_all(&mut recs);
        let (steps, compute) = a.take_steps();
        assert_eq!(steps.iter().map(|s| s.gpu_ns).collect::<Vec<_>>(), vec![8 * MS, 7_100_000, 6 * MS, 3 * MS], "step 1 includes B's copy");
        assert_eq!(compute.iter().map(|c| (c.compute_ns, c.source)).collect::<Vec<_>>(), vec![(8 * MS, ComputeSource::Cupti), (7_100_000, ComputeSource::Cupti), (3 * MS, ComputeSource::Cupti)]);
        let (ga, ca, _) = a.take("A");
        let (gb, _, _) = a.take("B");
        let (gc, cc, _) = a.take("C");
        // Step 1: 51 tokens (A 1, B 50) over 7.1 ms; step 3: 145 (A 1, C 144) over 3 ms.
        assert_eq!(ga, Some(GpuShare { prefill_ns: 8 * MS, decode_ns: 139_216 + 20_690, kv_gpu_ns: 0, kv_queue_ns: 0, kv_prefill_ns: 0, steps: 3, ..GpuShare::default() }));
        // B: its copy's 2 ms of GPU time; on its path 1 ms while queued, 1 ms once scheduled.
        assert_eq!(gb, Some(GpuShare { prefill_ns: 6_960_784, decode_ns: 0, kv_gpu_ns: 2 * MS, kv_queue_ns: MS, kv_prefill_ns: MS, steps: 1, kv_spans: [(13 * MS, 15 * MS), (0, 0), (0, 0), (0, 0)], kv_spans_len: 1 }));
        // C: all of the output-less step 2, and 144/145 of step 3.
        assert_eq!(gc, Some(GpuShare { prefill_ns: 6 * MS + 2_979_310, decode_ns: 0, kv_gpu_ns: 0, kv_queue_ns: 0, kv_prefill_ns: 0, steps: 2, ..GpuShare::default() }));
        let total: u64 = [ga, gb, gc].iter().map(|g| g.unwrap().prefill_ns + g.unwrap().decode_ns).sum();
        assert_eq!(total, steps.iter().map(|s| s.gpu_ns).sum::<u64>(), "every GPU ns of every step goes to someone");
        assert_eq!(ca, Some(RequestCompute { prefill_ns: Some(8 * MS), decode_ns: Some(7_100_000 + 3 * MS), steps: 3, source: ComputeSource::Cupti }));
        assert_eq!(cc, Some(RequestCompute { prefill_ns: Some(9 * MS), decode_ns: None, steps: 2, source: ComputeSource::Cupti }));
        assert_eq!(a.take("A"), (None, None, None), "taken once");
        assert!(a.counters.keys().all(|k| !k.contains("unattributed") && !k.contains("unmatched")), "{:?}", a.counters);
    }

    /// Kernel shares by name: a step's kernels on two ranks, split among
    /// its members by tokens as the step's time is.
    #[test]
    fn each_request_lists_its_share_of_each_kernels_time_by_name() {
        let named = |pid: u32, start: u64, parts: &[(&str, u64)], tokens: u32| -> Vec<Record> {
            let mut v = Vec::new();
            let mut t = start;
            for (name, ns) in parts {
                let grid = if *name == RESHAPE { tokens } else { 64 };
                v.push(kernel(pid, 7, t, t + ns, name, grid, 0));
                t += ns;
            }
            v.push(ids_copy(pid, t, t + 3 * US));
            v.push(sync(pid, start + US, t + 8 * US, SYNC_EVENT, None));
            v
        };
        let mut recs = vec![add(500 * US, "A", 100), add(12 * MS, "B", 50)];
        // Step 0: A's prefill alone, on one rank.
        recs.extend(named(1000, 2 * MS, &[("gemm", 4 * MS), ("attn", 2 * MS), (RESHAPE, MS)], 100));
        recs.push(outputs(10 * MS, &[("A", Some((MS, 100)))]));
        // Step 1: A decodes 1 token, B prefills 50, on two ranks (TP).
        recs.extend(named(1000, 15 * MS, &[("gemm", 5_100_000), (RESHAPE, 510_000)], 51));
        recs.extend(named(1001, 15 * MS, &[("gemm", 5_100_000), (RESHAPE, 510_000)], 51));
        recs.push(outputs(22 * MS, &[("A", None), ("B", Some((14 * MS, 50)))]));
        let mut a = attribute_all(&mut recs);
        let (_, _, ka) = a.take("A");
        let (_, _, kb) = a.take("B");
        let list = |k: Option<Vec<KernelShare>>| k.expect("a GPU source").into_iter().map(|k| (k.name.to_string(), k.gpu_ns)).collect::<Vec<_>>();
        // A: all of step 0; 1/51 of step 1's kernels on both ranks.
        assert_eq!(list(ka), vec![("gemm".to_owned(), 4 * MS + 200_000), ("attn".to_owned(), 2 * MS), (RESHAPE.to_owned(), MS + 20_000)]);
        // B: 50/51 of step 1's.
        assert_eq!(list(kb), vec![("gemm".to_owned(), 10 * MS), (RESHAPE.to_owned(), MS)]);
    }

    /// A decodes; C's 400-token prompt is chunked: 100 tokens ride in
    /// step 0 beside A's decode (101 tokens, only A in the outputs), the
    /// other 300 in step 1, where C gets its first token.
    fn chunked_beside_a_decode() -> Vec<Record> {
        let mut recs = vec![add(MS, "A", 10), add(2 * MS, "C", 400)];
        recs.extend(gpu_step(1000, 1_500 * US, MS, 10));
        recs.push(outputs(2_600 * US, &[("A", Some((1_400 * US, 10)))]));
        recs.extend(gpu_step(1000, 3 * MS, 1_010_000, 101));
        recs.push(outputs(4 * MS + 100 * US, &[("A", None)]));
        recs.extend(gpu_step(1000, 5 * MS, 3_010_000, 301));
        recs.push(outputs(8 * MS + 100 * US, &[("A", None), ("C", Some((3 * MS, 400)))]));
        recs
    }

    #[test]
    fn the_kernels_of_an_output_less_chunk_go_to_the_request_whose_first_token_claims_it() {
        let mut a = attribute_all(&mut chunked_beside_a_decode());
        let (steps, _) = a.take_steps();
        let kernel_ns: u64 = steps.iter().flat_map(|s| s.by_kernel()).map(|(_, ns)| ns).sum();
        let (_, _, ka) = a.take("A");
        let (_, _, kc) = a.take("C");
        let (ka, kc) = (ka.unwrap(), kc.unwrap());
        assert_eq!((ka.len(), kc.len()), (1, 1), "one kernel name: {ka:?} {kc:?}");
        // Step 1 (1.01 ms, 101 tokens): A 1/101, C's first chunk 100/101, held until its first token.
        let k1 = 1_010_000 - 3 * US;
        assert!(kc[0].gpu_ns > k1 * 100 / 101, "C has its first chunk's kernels: {kc:?}");
        assert_eq!(ka[0].gpu_ns + kc[0].gpu_ns, kernel_ns, "every kernel ns goes to someone");
    }

    #[test]
    fn tokens_no_output_member_accounts_for_wait_for_the_chunked_prefill_they_belong_to() {
        let mut a = attribute_all(&mut chunked_beside_a_decode());
        let (ga, _, _) = a.take("A");
        let (gc, _, _) = a.take("C");
        // Step 0: A 1/101 of 1.01 ms, C the other 100/101; step 1: A 1/301, C 300/301.
        assert_eq!(ga.map(|g| (g.decode_ns, g.prefill_ns, g.steps)), Some((10_000 + 10_000, MS, 3)));
        assert_eq!(gc.map(|g| (g.prefill_ns, g.decode_ns, g.steps)), Some((1_000_000 + 3_000_000, 0, 2)));
        assert!(!a.counters.contains_key("gpu_steps_unattributed"));
    }

    #[test]
    fn a_stats_only_message_after_a_partial_prefill_chunk_leaves_its_gpu_step_to_the_requests_first_token() {
        // C's 400-token prompt in two chunks; after the first the engine
        // sends only its scheduler stats (no outputs), as vLLM does with
        // stats logging on.
        let mut recs = vec![add(MS, "C", 400)];
        recs.extend(gpu_step(1000, 2 * MS, 3 * MS, 256));
        recs.push(outputs(5 * MS + 100 * US, &[]));
        recs.extend(gpu_step(1000, 6 * MS, 2 * MS, 144));
        // An empty message just before the step's outputs (a report to a
        // data-parallel coordinator) takes nothing from them.
        recs.push(outputs(8 * MS + 60 * US, &[]));
        recs.push(outputs(8 * MS + 100 * US, &[("C", Some((1_500 * US, 400)))]));
        let mut a = attribute_all(&mut recs);
        let (gc, cc, _) = a.take("C");
        assert_eq!(gc.map(|g| (g.prefill_ns, g.steps)), Some((5 * MS, 2)));
        assert_eq!(cc.and_then(|c| c.prefill_ns), Some(5 * MS));
        assert!(a.counters.keys().all(|k| !k.contains("unattributed") && !k.contains("unmatched")), "{:?}", a.counters);
    }

    #[test]
    fn attribution_counts_outputs_without_gpu_steps_and_gpu_work_nobody_claims() {
        let mut recs = vec![add(40 * MS, "A", 10)];
        // A KV-sized copy and a step long before A existed: nobody's.
        recs.push(copy(1000, 7, MS, 2 * MS, COPY_DTOH, DEVICE, MEM_PINNED, 64 * 1024));
        recs.extend(gpu_step(1000, 2 * MS, MS, 4));
        // A's output comes with no GPU step before it (its GPU work went unrecorded).
        recs.push(outputs(60 * MS, &[("A", Some((50 * MS, 10)))]));
        let mut a = attribute_all(&mut recs);
        assert_eq!(a.take("A"), (Some(GpuShare::default()), None, Some(Vec::new())));
        assert_eq!(a.counters.get("gpu_ipc_steps_unmatched"), Some(&1));
        assert_eq!(a.counters.get("gpu_steps_unattributed"), Some(&1));
        assert_eq!(a.counters.get("gpu_kv_copies_unattributed"), Some(&1));
    }

    #[test]
    fn each_data_parallel_engines_requests_get_only_their_own_engines_gpu_steps_and_copies() {
        // Engines 100 and 200 (data parallel, each its own GPU process) step
        // on their own clocks; their step ends lie 0.5–1 ms apart.
        // Engine 200: D prefills alone (d0), then B's 50-token prompt is
        // chunked: 30 tokens in b0 (no outputs), 20 in b2 beside D's decode;
        // b1 is D's decode alone, and its output leaves b0 waiting for a
        // claim before A's first token below.
        // Engine 100: A's KV is onloaded at 1.2–1.8 ms, A prefills in a0
        // (first token at 8.1 ms, after b0 ended) and decodes in a1.
        let (e1, e2) = (ConnKey { tgid: 100, fd: 9, ino: 1 }, ConnKey { tgid: 200, fd: 9, ino: 2 });
        let mut recs = vec![add_on(e2, Dir::In, 200 * US, "D", 10), add_on(e1, Dir::In, MS, "A", 100), add_on(e2, Dir::In, 2 * MS, "B", 50)];
        recs.extend(gpu_step(200, 500 * US, MS, 10));
        recs.push(outputs_on(e2, 1_550 * US, &[("D", Some((300 * US, 10)))]));
        recs.extend(gpu_step(200, 2_500 * US, 2_500 * US, 30));
        recs.extend(gpu_step(200, 5_500 * US, 1_500 * US, 1));
        recs.push(outputs_on(e2, 7_050 * US, &[("D", None)]));
        recs.extend(gpu_step(200, 8 * MS, 2 * MS, 21));
        recs.push(outputs_on(e2, 10_050 * US, &[("D", None), ("B", Some((2_200 * US, 50)))]));
        recs.push(copy(100, 9, 1_200 * US, 1_800 * US, COPY_HTOD, MEM_PINNED, DEVICE, 1 << 20));
        recs.extend(gpu_step(100, 3 * MS, 5 * MS, 100));
        recs.push(outputs_on(e1, 8_100 * US, &[("A", Some((1_500 * US, 100)))]));
        recs.extend(gpu_step(100, 9 * MS, 500 * US, 1));
        recs.push(outputs_on(e1, 9_600 * US, &[("A", None)]));
        let mut a = attribute_all(&mut recs);
        let (steps, compute) = a.take_steps();
        let mut got: Vec<(Option<u32>, u64)> = steps.iter().map(|s| (s.engine, s.gpu_ns)).collect();
        got.sort_unstable();
        assert_eq!(got, vec![(Some(100), 500 * US), (Some(100), 5_600 * US), (Some(200), MS), (Some(200), 1_500 * US), (Some(200), 2 * MS), (Some(200), 2_500 * US)], "a0 holds A's onload; no step merged");
        assert_eq!(compute.len(), 5, "every output step matched its own engine's step: {:?}", a.counters);
        let (ga, _, _) = a.take("A");
        let (gb, cb, _) = a.take("B");
        let (gd, _, _) = a.take("D");
        assert_eq!(ga.map(|g| (g.prefill_ns, g.decode_ns, g.kv_gpu_ns, g.steps)), Some((5_600 * US, 500 * US, 600 * US, 2)), "A claims its engine's onload and none of engine 200's chunk");
        // B: all of b0, and 20/21 of b2; D: d0, b1 and 1/21 of b2.
        assert_eq!(gb.map(|g| (g.prefill_ns, g.decode_ns, g.kv_gpu_ns, g.steps)), Some((2_500 * US + 1_904_762, 0, 0, 2)));
        assert_eq!(gd.map(|g| (g.prefill_ns, g.decode_ns, g.steps)), Some((MS, 1_500 * US + 95_238, 3)));
        assert_eq!(cb, Some(RequestCompute { prefill_ns: Some(4_500 * US), decode_ns: None, steps: 2, source: ComputeSource::Cupti }));
        assert!(a.counters.keys().all(|k| !k.contains("unattributed") && !k.contains("unmatched")), "{:?}", a.counters);
    }

    #[test]
    fn a_readers_copy_of_the_first_output_seen_before_the_writers_is_not_a_step_of_its_own() {
        // The API server's copy of the engine's first output message comes
        // first in the recording, then the engine's own: a unix-socket read
        // can return before the write that fed it, and the joiner holds a
        // writer's message while its step may have other parts to come.
        let (engine, api) = (ConnKey { tgid: 100, fd: 9, ino: 1 }, ConnKey { tgid: 50, fd: 4, ino: 1 });
        let mut recs = vec![add_on(engine, Dir::In, MS, "A", 100)];
        recs.extend(gpu_step(100, 2 * MS, 3 * MS, 100));
        let mut read = outputs_on(api, 5_100 * US, &[("A", Some((1_500 * US, 100)))]);
        if let Record::EngineOutputs { ts_ns, dir, .. } = &mut read {
            (*ts_ns, *dir) = (5_100 * US + 20 * US, Dir::In);
        }
        recs.push(read);
        // The joiner may hold the writer's copy (waiting for its step's other
        // parts) past the GPU match's own wait.
        let mut written = outputs_on(engine, 5_100 * US, &[("A", Some((1_500 * US, 100)))]);
        if let Record::EngineOutputs { ts_ns, .. } = &mut written {
            *ts_ns = 5_100 * US + super::super::join::JOIN_WAIT_NS;
        }
        recs.push(written);
        // Meanwhile the recording goes on (the engine reads another request).
        recs.push(add_on(engine, Dir::In, 44 * MS, "B", 10));
        recs.extend(gpu_step(100, 50 * MS, MS, 1));
        recs.push(outputs_on(engine, 51_100 * US, &[("A", None)]));
        let mut a = attribute_all(&mut recs);
        let (ga, ca, _) = a.take("A");
        assert_eq!(ga.map(|g| (g.prefill_ns, g.decode_ns, g.steps)), Some((3 * MS, MS, 2)));
        assert_eq!(ca.map(|c| (c.prefill_ns, c.decode_ns)), Some((Some(3 * MS), Some(MS))));
        assert!(a.counters.keys().all(|k| !k.contains("unattributed") && !k.contains("unmatched")), "{:?}", a.counters);
    }

    #[test]
    fn without_gpu_records_step_compute_is_the_engine_threads_on_cpu_time() {
        // Engine process 2, main thread 2: 6 ms on CPU, 4 ms off, per 10 ms step.
        let mut recs = vec![add(MS, "A", 10)];
        for k in 0..5u64 {
            let end = 10 * MS + k * 10 * MS;
            recs.push(Record::OffCpu { ts_ns: end, tgid: 2, tid: 2, off_ns: end - 4 * MS, wake_ns: None, prev_state: 1 });
            recs.push(outputs(end, &[("A", (k == 0).then_some((2 * MS, 10)))]));
        }
        let mut a = attribute_all(&mut recs);
        let (steps, compute) = a.take_steps();
        assert!(steps.is_empty());
        assert_eq!(compute.iter().map(|c| (c.end_ns, c.compute_ns, c.source)).collect::<Vec<_>>(), (1..5u64).map(|k| (10 * MS + k * 10 * MS, 6 * MS, ComputeSource::Oncpu)).collect::<Vec<_>>());
        let (g, c, _) = a.take("A");
        assert_eq!(g, None, "no GPU source: no GPU share");
        assert_eq!(c, Some(RequestCompute { prefill_ns: None, decode_ns: Some(24 * MS), steps: 4, source: ComputeSource::Oncpu }), "its prefill step was the engine's first: no figure");
        assert_eq!(a.counters.get("oncpu_steps_without_start"), Some(&1));
    }

    #[test]
    fn a_step_whose_on_cpu_window_is_unknown_is_counted_once_and_not_held() {
        // Engine 2 (thread 2 seen off CPU at 5 ms and until just after 2 s)
        // ends steps at 10 ms and 2 s: its window is known and the threads'
        // intervals before 1 s are let go. Engine 4, its thread seen off CPU
        // at 50 ms, says at 2.001 s that its first step ended at 100 ms,
        // then ends one at 2.01 s: that window's start was let go.
        let b = ConnKey { tgid: 4, fd: 9, ino: 98 };
        let mut late = outputs_on(b, 2_001 * MS, &[("A", None)]);
        if let Record::EngineOutputs { timestamp_s, .. } = &mut late {
            *timestamp_s = Some(0.1);
        }
        let mut recs = vec![
            add(MS, "A", 10),
            Record::OffCpu { ts_ns: 6 * MS, tgid: 2, tid: 2, off_ns: 5 * MS, wake_ns: None, prev_state: 1 },
            Record::OffCpu { ts_ns: 60 * MS, tgid: 4, tid: 4, off_ns: 50 * MS, wake_ns: None, prev_state: 1 },
            outputs(10 * MS, &[("A", Some((2 * MS, 10)))]),
            Record::OffCpu { ts_ns: 2_000 * MS + 20 * US, tgid: 2, tid: 2, off_ns: 1_999 * MS, wake_ns: None, prev_state: 1 },
            outputs(2_000 * MS, &[("A", None)]),
            late,
            outputs_on(b, 2_010 * MS, &[("A", None)]),
        ];
        let mut a = attribute_all(&mut recs);
        let (_, compute) = a.take_steps();
        assert_eq!(compute.iter().map(|c| c.end_ns).collect::<Vec<_>>(), vec![2_000 * MS], "engine 2's window only");
        assert_eq!(a.counters.get("oncpu_windows_unknown"), Some(&1));
        assert_eq!(a.counters.get("oncpu_steps_unknown"), None, "the same step again");
        assert!(a.cpu_wait.is_empty(), "nothing will come for it: not held");
    }

    fn http(fd: i32, at: u64, sse_id: &str, content: &[u64], done: u64) -> Vec<Record> {
        use crate::model::{HttpRole, SseKind};
        let conn = ConnKey { tgid: 1, fd, ino: fd as u64 };
        let mut v = vec![Record::HttpRequest {
            conn,
            role: HttpRole::Server,
            seq: 0,
            start_ns: at,
            end_ns: at,
            tid: 1,
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            headers: vec![],
            body_len: 10,
            stream: Some(true),
            model: None,
            ready_ns: None,
        }];
        let sse = |t: u64, kind: SseKind| Record::Sse { conn, seq: 0, ts_ns: t, kind, id: Some(sse_id.into()), content_bytes: 1, finish_reason: None, usage: None };
        v.extend(content.iter().map(|&t| sse(t, SseKind::Content)));
        v.push(sse(done, SseKind::Done));
        v.push(Record::HttpResponseEnd { conn, seq: 0, ts_ns: done + 100 * US, body_len: 1 });
        v
    }

    /// Requests A (prefill in the first GPU step, decode in the second) and
    /// B (prefill in the second), with a 2 ms KV copy before B's prefill
    /// when `kv_copy`; unsorted.
    fn two_requests(kv_copy: bool) -> Vec<Record> {
        let (a, b) = ("chatcmpl-a-0123abcd", "chatcmpl-b-0123abcd");
        let mut recs = vec![add(500 * US, a, 100), add(12 * MS, b, 50)];
        recs.extend(http(5, 200 * US, "chatcmpl-a", &[10_500 * US, 20_500 * US], 20_700 * US));
        recs.extend(http(6, 11_500 * US, "chatcmpl-b", &[20_600 * US], 21 * MS));
        recs.extend(gpu_step(1000, 2 * MS, 8 * MS, 100));
        recs.push(outputs(10 * MS + 100 * US, &[(a, Some((MS, 100)))]));
        if kv_copy {
            recs.push(copy(1000, 7, 13 * MS, 15 * MS, COPY_HTOD, MEM_PINNED, DEVICE, 1 << 20));
        }
        recs.extend(gpu_step(1000, 15 * MS, 5_100_000, 51));
        recs.push(outputs(20 * MS + 200 * US, &[(a, None), (b, Some((14 * MS, 50)))]));
        recs
    }

    #[test]
    fn the_report_carries_gpu_shares_and_carves_kv_transfer_out_of_queue_and_prefill() {
        let mut recs = two_requests(true);
        recs.sort_by_key(Record::ts_ns);
        let mut c = crate::correlate::Correlator::new(crate::correlate::Config::default());
        for r in &recs {
            c.ingest(r);
        }
        let an = c.finish();
        assert_eq!(an.gpu_steps.len(), 2);
        assert_eq!(an.step_compute.len(), 2);
        let rb = an.requests.iter().find(|r| r.id == "chatcmpl-b").expect("B");
        let q = crate::sink::report::request_out(rb);
        let p = &q.phases_ms;
        assert_eq!(q.gpu_ms.prefill, Some(6.960784));
        assert_eq!((q.gpu_ms.decode, q.gpu_ms.kv_transfer), (Some(0.0), Some(2.0)));
        assert_eq!(q.gpu_steps, Some(1));
        // Queue 12→14 ms less the 1 ms of copy before scheduling; prefill
        // 14→20.2 ms less the 1 ms after.
        let close = |x: Option<f64>, y: f64| (x.unwrap() - y).abs() < 1e-9;
        assert!(close(p.frontend, 0.5) && close(p.queue, 1.0) && close(p.kv_transfer, 2.0) && close(p.prefill, 5.2), "{p:?}");
        let sum: f64 = [p.frontend, p.queue, p.kv_transfer, p.prefill, p.first_output, p.decode].iter().map(|x| x.unwrap()).sum();
        assert!((sum - q.e2e_ms.unwrap()).abs() < 1e-9, "{sum} vs {:?}", q.e2e_ms);
        assert_eq!(q.compute_source.as_deref(), Some("cupti"));
        assert!(q.compute_ms.as_ref().is_some_and(|c| c.prefill == Some(7.1) && c.decode.is_none() && c.steps == 1));
        let ra = an.requests.iter().find(|r| r.id == "chatcmpl-a").expect("A");
        let qa = crate::sink::report::request_out(ra);
        assert_eq!((qa.gpu_ms.prefill, qa.gpu_ms.decode, qa.phases_ms.kv_transfer), (Some(8.0), Some(0.139216), Some(0.0)));
    }

    #[test]
    fn a_streamed_report_takes_gpu_steps_as_they_come_and_prints_what_the_in_memory_one_does() {
        let mut recs = two_requests(false);
        // Output-less steps over 6 s: the report is drained every 250 ms of
        // recording time, so most of them are taken and spooled mid-stream.
        for k in 1..=60u64 {
            recs.extend(gpu_step(1000, k * 100 * MS, 2 * MS, 8));
        }
        recs.sort_by_key(Record::ts_ns);
        let meta = crate::recording::Meta::default();
        let mut w = crate::recording::Writer::new(Vec::new(), &meta).expect("writer");
        for r in &recs {
            w.push(r).expect("push");
        }
        let bytes = w.finish(recs.last().map_or(0, Record::ts_ns)).expect("finish");
        let mut reader = crate::recording::Reader::new(&bytes[..]).expect("reader");
        let mut got = Vec::new();
        let err = crate::sink::report::write_json(&mut reader, "gpu.hop", crate::correlate::Config::default(), crate::sink::summary::DEFAULT_PERCENTILES, &mut got).expect("streamed report");
        assert_eq!(err, None);
        let mut c = crate::correlate::Correlator::new(crate::correlate::Config::default());
        for r in &recs {
            c.ingest(r);
        }
        let an = c.finish();
        assert_eq!(an.gpu_steps.len(), 62);
        let want = serde_json::to_string_pretty(&crate::sink::report::build("gpu.hop", &meta, &an, None)).expect("report serializes") + "\n";
        assert_eq!(String::from_utf8(got).expect("utf-8"), want);
    }

    /// Random engine records (ADDs, output steps over a pool of ids with GPU
    /// steps under them, takes, forgets) through one attribution that looks
    /// every id up and one handed kept keys, as the engine side keeps them
    /// (some lost, as when it forgets a request): the same figures under the
    /// same keys throughout.
    #[test]
    fn hinted_engine_records_give_the_figures_of_looked_up_ones() {
        let dump = |a: &Attribution, id: &str| format!("{:?}", a.ids.get(id).map(|&k| (k, a.eng.get(k))));
        let mut next = crate::testutil::xorshift(0x0dd_b1a5_e5ee_d5ee);
        // Records name a window of 40 ids that slides over 400: ids fall out
        // of use and are forgotten untaken.
        let ids: Vec<String> = (0..400).map(|i| format!("chatcmpl-{i:04}-0123abcd")).collect();
        let pick = |n: u64, x: u64| (n / 20 + x % 40) as usize % 400;
        let (mut a, mut b) = (Attribution::new(), Attribution::new());
        let mut kept: std::collections::HashMap<usize, Key> = std::collections::HashMap::new();
        let (mut t, mut hits, mut taken) = (T0, 0, 0u64);
        for n in 0..6000u64 {
            let x = next();
            t += MS + (x >> 40) % (3 * MS);
            if n % 500 == 499 {
                // Far on: what is not taken by the next forget goes then.
                t += UNTAKEN_NS / 2;
            } else if n.is_multiple_of(500) {
                a.forget_untaken();
                b.forget_untaken();
            }
            let (rec, picked): (Record, Vec<usize>) = match x % 12 {
                0 => {
                    let i = pick(n, x >> 8);
                    (add(t, &ids[i], 100 + (x >> 20) % 400), vec![i])
                }
                1 => {
                    let i = pick(n, x >> 8);
                    let (ga, gb) = (a.take(&ids[i]), b.take(&ids[i]));
                    assert_eq!(ga, gb, "take {} at record {n}", ids[i]);
                    taken += u64::from(ga.0.is_some());
                    continue;
                }
                2 => {
                    kept.remove(&pick(n, x >> 8));
                    continue;
                }
                _ => {
                    for g in gpu_step(7, t, 2 * MS, 8) {
                        a.ingest(&g);
                        b.ingest(&g);
                    }
                    t += 3 * MS;
                    let mut picked: Vec<usize> = Vec::new();
                    for k in 0..1 + (x >> 12) % 8 {
                        let i = pick(n, x >> (16 + 3 * k));
                        if !picked.contains(&i) {
                            picked.push(i);
                        }
                    }
                    let members: Vec<(&str, Option<(u64, u64)>)> = picked.iter().map(|&i| (ids[i].as_str(), ((x >> (i % 60)) & 3 == 0).then_some((t - MS, 50)))).collect();
                    (outputs(t, &members), picked)
                }
            };
            a.ingest(&rec);
            let mut hints: Vec<Key> = picked.iter().map(|i| kept.get(i).copied().unwrap_or(super::super::slab::NO_KEY)).collect();
            let before = hints.clone();
            b.ingest_hinted(&rec, rec.ts_ns(), &mut hints);
            hits += before.iter().zip(&hints).filter(|(o, h)| o == h).count();
            for (&i, &h) in picked.iter().zip(&hints) {
                kept.insert(i, h);
            }
            if n.is_multiple_of(16) {
                for id in &ids[pick(n, 0).saturating_sub(60)..] {
                    assert_eq!(dump(&a, id), dump(&b, id), "{id} after record {n}");
                }
            }
        }
        a.finish();
        b.finish();
        assert_eq!(a.take_steps(), b.take_steps());
        assert_eq!(a.counters, b.counters);
        assert!(hits > 5000 && taken > 100, "{hits} kept keys used, {taken} figures taken");
        assert!(a.counters.get("attribution_requests_untaken").is_some_and(|&n| n > 10), "{:?}", a.counters);
    }
}
