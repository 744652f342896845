//! Step compute without a GPU source (design.md §3): the on-CPU time of the
//! engine's busy-loop thread between two step ends, from the scheduler's
//! off-CPU records. Pure: no I/O, no clock, no globals.
//!
//! [`OnCpu`] turns `Record::OffCpu` (switched out at `off_ns`, back in at
//! `ts_ns`) into per-thread on-CPU intervals. [`EngineCompute`] takes the
//! engine's step ends (the EngineCoreOutputs messages; the engine process is
//! the one whose socket carried them) and yields per step the on-CPU time of
//! the engine's busy-loop thread in [previous step end, step end]. That
//! thread is the engine process's main thread (vLLM's EngineCoreProc and the
//! testbed run the busy loop there; the thread that writes the outputs is
//! ZMQ's I/O thread, which only forwards them).
//!
//! Limits: the kernel folds off-CPU intervals shorter than `min_offcpu_ns`
//! (1 ms by default) into counters instead of records, so on-CPU time is an
//! upper bound by those short sleeps (`kernel_sched_short_ns` says how much
//! in all); a busy loop that never sleeps that long has no records at all and
//! is on CPU throughout. What no record covers is taken as on CPU once the
//! records for it can no longer come (counted as `oncpu_windows_assumed`). A
//! server whose busy loop is not its engine process's main thread is
//! misread. With a GPU, a host thread spinning in a CUDA synchronize is on
//! CPU too: this figure stands for step compute only without a GPU source.

use std::collections::{BTreeMap, VecDeque};

#[derive(Debug, Clone, Default)]
struct Thread {
    tgid: u32,
    /// Its state is known from here on (its first switch-out).
    known_from: u64,
    /// Last switch-in: on CPU since then, until a later record says otherwise.
    last_in: u64,
    /// On-CPU intervals not yet pruned, in order.
    on: VecDeque<(u64, u64)>,
    /// Intervals before this were pruned.
    pruned_to: u64,
}

/// Per-thread on-CPU intervals from off-CPU records.
#[derive(Debug, Default)]
pub struct OnCpu {
    threads: super::FxMap<u32, Thread>,
    pub counters: BTreeMap<&'static str, u64>,
}

impl OnCpu {
    /// One off-CPU interval: `tid` of `tgid` was off CPU from `off_ns` until `on_ns`.
    pub fn observe(&mut self, on_ns: u64, tgid: u32, tid: u32, off_ns: u64) {
        if off_ns > on_ns {
            *self.counters.entry("oncpu_records_invalid").or_default() += 1;
            return;
        }
        let t = self.threads.entry(tid).or_insert_with(|| Thread { tgid, known_from: off_ns, last_in: off_ns, on: VecDeque::new(), pruned_to: 0 });
        if off_ns < t.last_in {
            // Overlaps what is known (out of order or a reused tid): the
            // overlap cannot be both on and off.
            *self.counters.entry("oncpu_records_overlap").or_default() += 1;
            if on_ns <= t.last_in {
                return;
            }
        } else if off_ns > t.last_in {
            t.on.push_back((t.last_in, off_ns));
        }
        t.tgid = tgid;
        t.last_in = on_ns;
    }

    /// On-CPU ns of `tid` in [a, b]; None when not fully known (before its
    /// first record, after its last switch-in, or pruned).
    pub fn on_cpu_ns(&self, tid: u32, a: u64, b: u64) -> Option<u64> {
        let t = self.threads.get(&tid)?;
        if a < t.known_from || a < t.pruned_to || b > t.last_in || b < a {
            return None;
        }
        Some(overlap(&t.on, a, b))
    }

    /// As [`OnCpu::on_cpu_ns`], but what no record covers counts as on CPU:
    /// before the thread's first switch-out, after its last switch-in, and
    /// all of it for a thread never seen off CPU (the kernel only reports
    /// sleeps of at least `min_offcpu_ns`: a busy loop may have none). The
    /// bool says whether that was needed. None only for pruned times.
    pub fn on_cpu_ns_assuming_running(&self, tid: u32, a: u64, b: u64) -> Option<(u64, bool)> {
        if b < a {
            return None;
        }
        let Some(t) = self.threads.get(&tid) else { return Some((b - a, true)) };
        if a < t.pruned_to {
            return None;
        }
        let before = t.known_from.min(b).saturating_sub(a);
        let after = b.saturating_sub(t.last_in.max(a));
        let known = overlap(&t.on, a.max(t.known_from), b);
        Some((before + known + after, before > 0 || after > 0))
    }

    /// Up to when `tid`'s on-CPU time is known.
    pub fn horizon(&self, tid: u32) -> Option<u64> {
        self.threads.get(&tid).map(|t| t.last_in)
    }

    /// Threads of a process, by tid.
    pub fn threads_of(&self, tgid: u32) -> Vec<u32> {
        let mut v: Vec<u32> = self.threads.iter().filter(|(_, t)| t.tgid == tgid).map(|(&k, _)| k).collect();
        v.sort_unstable();
        v
    }

    /// Forgets intervals that end before `t` (queries before it return None).
    pub fn prune_before(&mut self, t: u64) {
        for th in self.threads.values_mut() {
            while th.on.front().is_some_and(|&(_, e)| e < t) {
                th.on.pop_front();
            }
            th.pruned_to = th.pruned_to.max(t);
        }
    }
}

fn overlap(on: &VecDeque<(u64, u64)>, a: u64, b: u64) -> u64 {
    // Intervals are ordered and disjoint: skip those ending before a.
    let start = on.partition_point(|&(_, e)| e <= a);
    on.range(start..).take_while(|&&(s, _)| s < b).map(|&(s, e)| e.min(b).saturating_sub(s.max(a))).sum()
}

/// A step's end as the engine side times it (`correlate::engine::step_end`):
/// the output's `EngineCoreOutputs.timestamp` when plausible and not after the
/// write that sent it, else the write.
pub fn step_end_of(sent_ns: u64, timestamp_s: Option<f64>) -> u64 {
    super::engine::step_end(sent_ns, timestamp_s.and_then(super::engine::s_to_ns)).0
}

/// On-CPU time of the engine thread in one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepCpu {
    /// The engine process (its output socket's owner).
    pub tgid: u32,
    /// The step's end (as given to [`EngineCompute::step_end`]).
    pub end_ns: u64,
    /// The previous step's end: the window's start.
    pub start_ns: u64,
    /// The busy-loop thread.
    pub tid: u32,
    pub on_cpu_ns: u64,
    /// Part of the window had no record yet and was taken as on CPU (see
    /// [`OnCpu::on_cpu_ns_assuming_running`]).
    pub assumed: bool,
}

/// How long past a window's end its off-CPU records may still arrive (the
/// recording's reorder window, with margin). After that, what no record
/// covers was on CPU: an off-CPU stretch that spans the step end would mean
/// the thread slept through the end of a step it produced.
pub const SETTLE_NS: u64 = 50_000_000;

/// How far before the oldest window still held the threads' intervals are
/// kept (see [`EngineCompute::step_end`]).
pub const PRUNE_LAG_NS: u64 = 1_000_000_000;

#[derive(Debug, Default)]
struct Engine {
    prev_end: Option<u64>,
    /// Windows not yet handed out, in order: (start, end).
    windows: VecDeque<(u64, u64)>,
}

/// Per step, the engine thread's on-CPU time (see the module doc). Feed
/// every record's time with [`EngineCompute::advance`], off-CPU records with
/// [`EngineCompute::off_cpu`] and step ends with [`EngineCompute::step_end`],
/// in recording order; take results with [`EngineCompute::pop`] (in step
/// order per engine), end with [`EngineCompute::finish`]. Memory: the
/// windows of the last [`SETTLE_NS`] and the threads' intervals from
/// [`PRUNE_LAG_NS`] before them.
#[derive(Debug, Default)]
pub struct EngineCompute {
    pub cpu: OnCpu,
    engines: BTreeMap<u32, Engine>,
    pub(crate) ready: VecDeque<StepCpu>,
    /// Ends of the steps whose window could not be had (counted in
    /// `oncpu_windows_unknown`): no figure will come for them.
    unknown: Vec<u64>,
    watermark: u64,
    pruned_at: u64,
    /// The earliest time a held window settles (its end + [`SETTLE_NS`]),
    /// as of the last resolve: `advance` looks at the engines only then.
    due: u64,
    pub counters: BTreeMap<&'static str, u64>,
}

impl EngineCompute {
    pub fn new() -> Self {
        Self::default()
    }

    /// The recording reached `ts_ns`.
    #[inline]
    pub fn advance(&mut self, ts_ns: u64) {
        if ts_ns > self.watermark {
            self.watermark = ts_ns;
            if ts_ns >= self.due {
                self.resolve(false);
            }
        }
    }

    pub fn off_cpu(&mut self, on_ns: u64, tgid: u32, tid: u32, off_ns: u64) {
        self.cpu.observe(on_ns, tgid, tid, off_ns);
        self.advance(on_ns);
        if self.engines.is_empty() && on_ns >= self.pruned_at.saturating_add(100_000_000) {
            // Only windows after the first step end are ever asked for, and
            // that step end (timed by the engine, sent later) is recent.
            self.pruned_at = on_ns;
            self.cpu.prune_before(off_ns.saturating_sub(1_000_000_000));
        }
    }

    /// A step of the engine in process `tgid` ended at `end_ns`. The first
    /// step of each engine has no window (nothing says when it started).
    /// Whether a figure will come for it.
    pub fn step_end(&mut self, tgid: u32, end_ns: u64) -> bool {
        let e = self.engines.entry(tgid).or_default();
        let window = match e.prev_end {
            Some(p) if end_ns >= p => {
                e.windows.push_back((p, end_ns));
                true
            }
            Some(_) => {
                *self.counters.entry("oncpu_steps_out_of_order").or_default() += 1;
                false
            }
            None => {
                *self.counters.entry("oncpu_steps_without_start").or_default() += 1;
                false
            }
        };
        e.prev_end = Some(end_ns.max(e.prev_end.unwrap_or(0)));
        self.resolve(false);
        let oldest = self.engines.values().filter_map(|e| e.windows.front().map(|w| w.0).or(e.prev_end)).min();
        if let Some(t) = oldest {
            // Kept PRUNE_LAG_NS longer: an engine not seen yet (a data
            // parallel rank whose first output comes after another's) opens
            // its first window at a step end that may be older than every
            // window held.
            self.cpu.prune_before(t.saturating_sub(PRUNE_LAG_NS));
        }
        window
    }

    /// The busy-loop thread of an engine process: its main thread. vLLM's
    /// EngineCoreProc runs `run_busy_loop` in the process's main thread, with
    /// the socket I/O in helper threads (and ZMQ's own I/O threads); so does
    /// the testbed's engine.
    pub fn engine_thread(tgid: u32) -> u32 {
        tgid
    }

    fn resolve(&mut self, all: bool) {
        for (&tgid, e) in self.engines.iter_mut() {
            let tid = Self::engine_thread(tgid);
            while let Some(&(a, b)) = e.windows.front() {
                let got = match self.cpu.on_cpu_ns(tid, a, b) {
                    Some(ns) => Some((ns, false)),
                    None if all || b.saturating_add(SETTLE_NS) <= self.watermark => self.cpu.on_cpu_ns_assuming_running(tid, a, b),
                    None => break,
                };
                e.windows.pop_front();
                match got {
                    Some((ns, assumed)) => {
                        if assumed {
                            *self.counters.entry("oncpu_windows_assumed").or_default() += 1;
                        }
                        self.ready.push_back(StepCpu { tgid, end_ns: b, start_ns: a, tid, on_cpu_ns: ns, assumed });
                    }
                    None => {
                        *self.counters.entry("oncpu_windows_unknown").or_default() += 1;
                        self.unknown.push(b);
                    }
                }
            }
        }
        // Windows are only added (step_end) or taken (here) before this.
        self.due = self.engines.values().filter_map(|e| e.windows.front().map(|w| w.1.saturating_add(SETTLE_NS))).min().unwrap_or(u64::MAX);
    }

    /// Whether results wait in [`pop`](Self::pop) or [`take_unknown`](Self::take_unknown).
    pub fn has_ready(&self) -> bool {
        !self.ready.is_empty() || !self.unknown.is_empty()
    }

    /// Results ready so far.
    pub fn pop(&mut self) -> Option<StepCpu> {
        self.ready.pop_front()
    }

    /// Ends of the steps that will have no figure, since the last call.
    pub fn take_unknown(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.unknown)
    }

    /// The recording ended: resolves what is left.
    pub fn finish(&mut self) -> Vec<StepCpu> {
        self.resolve(true);
        for (k, v) in std::mem::take(&mut self.cpu.counters) {
            *self.counters.entry(k).or_default() += v;
        }
        self.ready.drain(..).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const T0: u64 = 5_000_000_000;

    #[test]
    fn oncpu_time_is_the_window_less_the_off_cpu_intervals_and_unknown_outside_the_records() {
        let mut c = OnCpu::default();
        // Off [0,2], [5,6], [9,12] ms: on [2,5], [6,9], then since 12.
        c.observe(T0 + 2 * MS, 1, 11, T0);
        c.observe(T0 + 6 * MS, 1, 11, T0 + 5 * MS);
        c.observe(T0 + 12 * MS, 1, 11, T0 + 9 * MS);
        assert_eq!(c.on_cpu_ns(11, T0, T0 + 12 * MS), Some(6 * MS));
        assert_eq!(c.on_cpu_ns(11, T0 + 4 * MS, T0 + 10 * MS), Some(MS + 3 * MS));
        assert_eq!(c.on_cpu_ns(11, T0 + 10 * MS, T0 + 13 * MS), None, "after its last switch-in: unknown");
        assert_eq!(c.on_cpu_ns_assuming_running(11, T0 + 10 * MS, T0 + 13 * MS), Some((MS, true)));
        assert_eq!(c.on_cpu_ns(11, T0 - MS, T0 + 2 * MS), None, "before its first record: unknown");
        assert_eq!(c.on_cpu_ns(12, T0, T0 + MS), None);
        // An interval overlapping what is known is counted, not believed.
        c.observe(T0 + 11 * MS, 1, 11, T0 + 10 * MS);
        c.observe(T0 + 13 * MS, 1, 11, T0 + 20 * MS);
        assert_eq!(c.counters.get("oncpu_records_overlap"), Some(&1));
        assert_eq!(c.counters.get("oncpu_records_invalid"), Some(&1));
        c.prune_before(T0 + 7 * MS);
        assert_eq!(c.on_cpu_ns(11, T0 + 2 * MS, T0 + 12 * MS), None, "pruned");
        assert_eq!(c.on_cpu_ns(11, T0 + 7 * MS, T0 + 12 * MS), Some(2 * MS));
        assert_eq!(c.threads_of(1), vec![11]);
    }

    /// (switched in, tgid, tid, switched out).
    type Off = (u64, u32, u32, u64);

    /// An engine process 50: its busy loop (tid 50) computes 7 ms per 10 ms
    /// step and sleeps 3 ms (waiting for work, off CPU) before each step end;
    /// ZMQ's I/O thread (51) wakes for 0.5 ms after each step to write the
    /// outputs; the input thread (52) sleeps throughout. The frontend
    /// process 60 has a thread busier than any of them.
    fn engine(steps: u64) -> (Vec<Off>, Vec<u64>) {
        let mut offs = Vec::new();
        let mut ends = Vec::new();
        // Everyone's first record: off from T0 to T0 + 1 ms.
        for tid in [50, 51, 52, 60] {
            offs.push((T0 + MS, if tid == 60 { 60 } else { 50 }, tid, T0));
        }
        for k in 0..steps {
            let s = T0 + MS + k * 10 * MS;
            // Busy loop: on [s, s+7], off [s+7, s+10].
            offs.push((s + 10 * MS, 50, 50, s + 7 * MS));
            ends.push(s + 10 * MS);
            // I/O thread: on [s, s+0.5], off until the next step.
            offs.push((s + 10 * MS, 50, 51, s + MS / 2));
            // The frontend is on CPU 9 of every 10 ms.
            offs.push((s + 10 * MS, 60, 60, s + 9 * MS));
        }
        offs.push((T0 + MS + steps * 10 * MS + MS, 50, 52, T0 + MS));
        offs.sort_unstable();
        (offs, ends)
    }

    #[test]
    fn oncpu_step_compute_is_the_engine_main_threads_time_between_step_ends() {
        let (offs, ends) = engine(40);
        let mut e = EngineCompute::new();
        let mut got = Vec::new();
        // Interleave by time as the recording would; a step end is seen
        // (the output write) just after the thread's records at that instant.
        let mut i = 0;
        for &end in &ends {
            while i < offs.len() && offs[i].0 <= end {
                let (on, tgid, tid, off) = offs[i];
                e.off_cpu(on, tgid, tid, off);
                i += 1;
            }
            e.step_end(50, end);
            while let Some(s) = e.pop() {
                got.push(s);
            }
        }
        assert_eq!(got.len(), 39, "every window is known as soon as its step ends; the first step has none");
        for &(on, tgid, tid, off) in &offs[i..] {
            e.off_cpu(on, tgid, tid, off);
        }
        got.extend(e.finish());
        assert_eq!(EngineCompute::engine_thread(50), 50);
        assert_eq!(got.len(), 39);
        assert!(got.iter().all(|s| s.tid == 50 && s.tgid == 50 && s.on_cpu_ns == 7 * MS && !s.assumed), "{got:?}");
        assert_eq!(got.iter().map(|s| s.end_ns).collect::<Vec<_>>(), ends[1..].to_vec());
        assert_eq!(got[0].start_ns, ends[0]);
        assert_eq!(e.counters.get("oncpu_steps_without_start"), Some(&1));
        assert_eq!(e.counters.get("oncpu_windows_assumed"), None);
    }

    #[test]
    fn oncpu_time_no_record_covers_is_taken_as_on_cpu_once_the_records_cannot_come_and_said_so() {
        let (offs, ends) = engine(5);
        let mut e = EngineCompute::new();
        let mut i = 0;
        for &end in &ends {
            while i < offs.len() && offs[i].0 <= end {
                let (on, tgid, tid, off) = offs[i];
                e.off_cpu(on, tgid, tid, off);
                i += 1;
            }
            e.step_end(50, end);
        }
        // One more step after every record: the busy loop ran since its last switch-in.
        let extra = ends[4] + 10 * MS;
        e.step_end(50, extra);
        let known: Vec<StepCpu> = std::iter::from_fn(|| e.pop()).collect();
        assert_eq!(known.len(), 4);
        assert!(known.iter().all(|s| s.on_cpu_ns == 7 * MS && !s.assumed));
        e.advance(extra + SETTLE_NS - 1);
        assert!(e.pop().is_none(), "its records may still come");
        e.advance(extra + SETTLE_NS);
        let last = e.pop().expect("settled");
        assert_eq!((last.end_ns, last.on_cpu_ns, last.assumed), (extra, 10 * MS, true));
        assert!(e.finish().is_empty());
        assert_eq!(e.counters.get("oncpu_windows_assumed"), Some(&1));
    }

    #[test]
    fn an_engine_whose_first_step_end_comes_after_another_engines_later_ones_gets_its_first_window() {
        // Engine 50 as in `engine`; engine 70 (a second data parallel rank)
        // reports its first step end, 5 ms before engine 50's 7th, only
        // after it, and its second 8 ms later. Its thread was off CPU at the
        // start, for 2 ms in that window and just after it.
        let (mut offs, ends) = engine(10);
        let (e1, e2) = (ends[6] - 5 * MS, ends[6] + 3 * MS);
        offs.extend([(T0 + MS, 70, 70, T0), (e1 + 3 * MS, 70, 70, e1 + MS), (e2 + MS, 70, 70, e2 + MS / 2)]);
        offs.sort_unstable();
        let mut seen: Vec<(u64, u32, u64)> = ends.iter().map(|&t| (t, 50, t)).collect();
        seen.extend([(ends[6] + 1, 70, e1), (e2 + MS, 70, e2)]);
        seen.sort_unstable();
        let mut e = EngineCompute::new();
        let mut got = Vec::new();
        let mut i = 0;
        for &(at, tgid, end) in &seen {
            while i < offs.len() && offs[i].0 <= at {
                let (on, g, tid, off) = offs[i];
                e.off_cpu(on, g, tid, off);
                i += 1;
            }
            e.step_end(tgid, end);
            got.extend(std::iter::from_fn(|| e.pop()));
        }
        got.extend(e.finish());
        let second: Vec<_> = got.iter().filter(|s| s.tgid == 70).map(|s| (s.start_ns, s.end_ns, s.on_cpu_ns, s.assumed)).collect();
        assert_eq!(second, vec![(e1, e2, e2 - e1 - 2 * MS, false)]);
        assert_eq!(got.iter().filter(|s| s.tgid == 50).count(), 9);
        assert_eq!(e.counters.get("oncpu_windows_unknown"), None);
    }

    #[test]
    fn an_engine_thread_never_seen_off_cpu_was_on_cpu_throughout_and_it_is_said() {
        let mut e = EngineCompute::new();
        for k in 0..3 {
            e.step_end(70, T0 + k * MS);
        }
        let got = e.finish();
        assert_eq!(got.iter().map(|s| (s.on_cpu_ns, s.assumed)).collect::<Vec<_>>(), vec![(MS, true), (MS, true)]);
        assert_eq!(e.counters.get("oncpu_windows_assumed"), Some(&2));
    }

    #[test]
    fn assuming_running_fills_only_what_no_record_covers() {
        let mut c = OnCpu::default();
        // First seen going off at 4 ms (on CPU before, as far as anyone
        // knows), back at 6, off 8..9, back at 9, nothing since.
        c.observe(T0 + 6 * MS, 1, 2, T0 + 4 * MS);
        c.observe(T0 + 9 * MS, 1, 2, T0 + 8 * MS);
        assert_eq!(c.on_cpu_ns_assuming_running(2, T0, T0 + 12 * MS), Some((4 * MS + 2 * MS + 3 * MS, true)));
        assert_eq!(c.on_cpu_ns_assuming_running(2, T0 + 5 * MS, T0 + 9 * MS), Some((2 * MS, false)));
        assert_eq!(c.on_cpu_ns(2, T0 + 5 * MS, T0 + 9 * MS), Some(2 * MS));
    }
}
