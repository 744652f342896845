//! Engine side of the correlator: vLLM V1 IPC records (decoded by
//! `proto::vllm`) → engine requests and steps, joined to HTTP requests, and the
//! phase partition of design.md §3.
//!
//! Clocks: `EngineCoreOutputs.timestamp` and event timestamps are the engine's
//! `time.monotonic()` (CLOCK_MONOTONIC seconds on Linux, vllm-wire.md §3): the
//! same clock as the eBPF timestamps, so they are converted, not mapped.
//! `arrival_time` is wall-clock and is not used for timing.
//!
//! When both ends of the IPC are traced every message is seen twice: written by
//! one process (Dir::Out) and read by the other (Dir::In). Steps and submits are
//! timed by the writer's syscall; the reader's copy is used only when the
//! writer was not traced.

use super::slab::{Slab, SlabKey, NO_KEY};
use super::{ms, Name, Request};
use crate::event::{ConnKey, Dir};
use crate::model::{EngineOutput, PrefillStats, Record};
use std::collections::{BTreeMap, HashMap};

/// vLLM EngineCoreEventType.
const EV_QUEUED: u8 = 1;
const EV_SCHEDULED: u8 = 2;
const EV_PREEMPTED: u8 = 3;

/// A thread that wrote within this long of getting the CPU was woken to write.
/// Off-CPU records keep only sleeps of `--min-offcpu` (1 ms) or more: a
/// thread that slept less since is seen as still in its older burst, so the
/// bound is also how wrong an unseen short sleep can make the wake-up.
const WAKE_TO_WRITE_NS: u64 = 2_000_000;

/// The same when the write itself says which sleep it came after
/// ([`Woke::woken_write`]): no sleep is unseen, and this only bounds a
/// thread woken for something else that stayed on a CPU until a `send()`
/// handed it the write. Long enough for a write delayed by preemptions too
/// short to record or by a vCPU the hypervisor stopped (3.6 ms seen in CI).
const WOKEN_WRITE_MAX_NS: u64 = 10_000_000;

/// Where a request's submit came from (`submit_source` in the report).
pub const SUBMIT_WAKE: &str = "wake";
pub const SUBMIT_ARRIVAL: &str = "arrival_time";
pub const SUBMIT_WRITE: &str = "write";
pub const SUBMIT_READ: &str = "read";
/// `scheduled_source` of a request closed before its engine request output
/// anything or was seen scheduled: its queue runs to the close.
pub const SCHEDULED_CLOSED: &str = "closed";

/// An anchor is trusted this long: the wall clock `arrival_time` is read
/// on may be slewed by NTP (at most 500 ppm: 0.5 ms over a second).
const ANCHOR_MAX_NS: u64 = 1_000_000_000;

/// How many of a writer thread's latest wake-up-timed ADDs place the
/// others: the least delayed of them is taken (see [`Writer::placed`]).
const ANCHORS: usize = 8;

/// What a writer thread's ADDs told: its latest write of ADDs, and its
/// latest ADDs whose hand-over the scheduler showed (their wake-ups) with
/// their `arrival_time`s, which place the hand-overs nothing showed.
#[derive(Debug, Clone, Copy, Default)]
struct Writer {
    write_ns: u64,
    /// The write before `write_ns` ([`Writer::pooled`]'s floor).
    prev_write_ns: u64,
    /// (wake-up, arrival_time), oldest overwritten first; `latest` is the
    /// newest's slot, `anchors` how many slots are filled.
    anchor: [(u64, f64); ANCHORS],
    anchors: usize,
    latest: usize,
}

impl Writer {
    fn anchor(&mut self, wake_ns: u64, arrival_s: f64) {
        self.latest = if self.anchors == 0 { 0 } else { (self.latest + 1) % ANCHORS };
        self.anchor[self.latest] = (wake_ns, arrival_s);
        self.anchors = (self.anchors + 1).min(ANCHORS);
    }

    /// The hand-over of an ADD written at `write_ns` whose own wake-up was
    /// not seen (it left in a write another ADD woke the thread for, or the
    /// thread was already awake — e.g. preempted before it could sleep —
    /// so `send()` woke nobody): an anchor's wake-up plus how much later
    /// the frontend built this request, inside [latest anchor, write]. All
    /// `arrival_time`s come from one clock, so the differences hold though
    /// it is the wall clock.
    ///
    /// Each anchor tells when a request built at a given `arrival_time` is
    /// handed over, give or take how long that anchor's own build-to-send
    /// took. A frontend preempted in between (the 2-core CI VM: 3.2 ms)
    /// only ever lengthens it, so of the anchors within a second the one
    /// that places the ADD earliest — the least delayed — is taken.
    fn placed(&self, write_ns: u64, arrival_s: Option<f64>) -> Option<u64> {
        let a = arrival_s.filter(|a| a.is_finite())?;
        let latest = Some(self.anchor[self.latest]).filter(|_| self.anchors > 0).filter(|&(wake, _)| usable(wake, write_ns))?.0;
        // `as` saturates: a far-past placement lands on the latest anchor.
        Some((self.earliest(write_ns, a)?.round() as u64).clamp(latest, write_ns))
    }

    /// The placement of the least delayed usable anchor (see [`Self::placed`]).
    fn earliest(&self, write_ns: u64, arrival_s: f64) -> Option<f64> {
        let earliest = self.anchor[..self.anchors]
            .iter()
            .filter(|&&(wake, _)| usable(wake, write_ns))
            .filter_map(|&(wake, a0)| anchored_at(wake, a0, arrival_s))
            .fold(f64::INFINITY, f64::min);
        earliest.is_finite().then_some(earliest)
    }

    /// The hand-over of an ADD that its own writer thread has no anchor to
    /// place by, placed by the anchors of every writer thread (this is
    /// their pool): each frontend process stamps `arrival_time` on the
    /// machine's one wall clock, so another process's anchor places it as
    /// well, give or take how much faster that process builds a request.
    /// Never before `floor` (its thread's previous write, which carried what
    /// had been handed over before it) nor after its write.
    fn pooled(&self, write_ns: u64, arrival_s: f64, floor: u64) -> Option<u64> {
        self.earliest(write_ns, arrival_s).map(|e| (e.round() as u64).max(floor).min(write_ns))
    }
}

/// An anchor woken at `wake_ns` may place an ADD written at `write_ns`.
fn usable(wake_ns: u64, write_ns: u64) -> bool {
    write_ns >= wake_ns && write_ns - wake_ns <= ANCHOR_MAX_NS
}

/// Where an anchor (woken at `wake_ns`, built at `anchor_arrival_s`) places
/// the hand-over of a request built at `arrival_s`: as much later (or
/// earlier) as it was built. None when the clock values are not numbers.
fn anchored_at(wake_ns: u64, anchor_arrival_s: f64, arrival_s: f64) -> Option<f64> {
    let d = (arrival_s - anchor_arrival_s) * 1e9;
    d.is_finite().then_some(wake_ns as f64 + d)
}

/// A placed hand-over `t` of an ADD written at `write_ns`, moved out of the
/// frontend thread's off-CPU time ([`Woke::running_at`]: it cannot have
/// called `send()` then) and never after the write.
fn sendable_at(sender: Option<&Woke>, t: u64, write_ns: u64) -> u64 {
    sender.map_or(t, |s| s.running_at(t)).min(write_ns)
}

/// What the scheduler told of the thread that serves process `tgid`'s HTTP
/// requests (taken for the one that calls `send()`), unless that is the
/// writer `tid` itself.
fn sender_of<'a, S: std::hash::BuildHasher>(woke: &'a HashMap<u32, Woke, S>, senders: &HashMap<u32, u32, S>, tgid: u32, tid: u32) -> Option<&'a Woke> {
    senders.get(&tgid).filter(|&&s| s != tid).and_then(|s| woke.get(s))
}

/// An ADD still waiting for an anchor of its writer thread (placed by
/// other threads' anchors meanwhile, if at all).
#[derive(Debug, Clone, Copy)]
struct Unplaced {
    tid: u32,
    tgid: u32,
    req: SlabKey,
    write_ns: u64,
    /// Its thread's previous write ([`Writer::pooled`]'s floor).
    floor_ns: u64,
    arrival_s: f64,
}

/// At most this many ADDs wait for an anchor; older ones keep their write.
const UNPLACED_MAX: usize = 64;

/// What the scheduler and the unix sockets told about one thread lately.
#[derive(Debug, Clone, Copy, Default)]
pub struct Woke {
    /// Latest switch-in.
    pub on_ns: u64,
    /// Switch-in after the thread last slept, and the wake-up that ended the
    /// sleep. Preemptions (switched out while runnable) do not end a burst.
    pub burst_on_ns: u64,
    pub wake_ns: Option<u64>,
    /// Its two latest distinct unix-socket I/O times.
    pub last_io_ns: u64,
    pub prev_io_ns: u64,
    /// The write whose burst the kernel told ([`Self::woken_write`]).
    pub told_write_ns: u64,
    /// Its latest off-CPU intervals (switch-out, switch-in), oldest
    /// overwritten first: when it cannot have run ([`Self::running_at`]).
    pub offs: [(u64, u64); OFFS],
    pub offs_next: usize,
    /// Its latest unix-socket I/Os and what [`Self::woken_for`] said of
    /// each when it happened, oldest overwritten first: a message written
    /// in several syscalls was handed over when the thread woke for the
    /// first ([`Self::woken_for_message`]).
    pub ios: [(u64, Option<u64>); IOS],
    pub ios_next: usize,
}

/// How many of a thread's latest off-CPU intervals [`Woke`] keeps.
const OFFS: usize = 8;

/// How many of a thread's latest unix-socket I/Os [`Woke`] keeps: libzmq
/// writes a long message as its 8 KiB batch and the rest (more writes only
/// when the socket's buffer fills), with other sockets' I/O maybe between.
const IOS: usize = 8;

impl Woke {
    /// An off-CPU interval from `off_ns` ended at `on_ns`; `prev_state` 0 =
    /// it was preempted while runnable (TASK_RUNNING), else it slept. A
    /// sleep on a lock (`HS_TASK_FREEZABLE`: futex, nanosleep) does not end a
    /// burst either, as in the eBPF side's burst (hopscope.bpf.c).
    pub fn switched_in(&mut self, on_ns: u64, off_ns: u64, wake_ns: Option<u64>, prev_state: u32) {
        self.offs[self.offs_next] = (off_ns, on_ns);
        self.offs_next = (self.offs_next + 1) % OFFS;
        self.on_ns = on_ns;
        if prev_state != 0 && prev_state & hopscope_ebpf::layout::HS_TASK_FREEZABLE == 0 {
            self.burst_on_ns = on_ns;
            self.wake_ns = wake_ns;
        }
    }

    /// The kernel's word for the write at `write_ns` (`Record::WokenWrite`):
    /// the thread's latest sleep ended with `wake_ns` and `on_ns`, however
    /// short it was.
    pub fn woken_write(&mut self, write_ns: u64, wake_ns: u64, on_ns: u64) {
        if on_ns >= self.burst_on_ns {
            self.burst_on_ns = on_ns;
            self.wake_ns = Some(wake_ns);
            self.on_ns = self.on_ns.max(on_ns);
        }
        self.told_write_ns = write_ns;
    }

    /// The earliest time from `t` on that the thread may have been running:
    /// `t`, or the end of a kept off-CPU interval `t` falls in.
    pub fn running_at(&self, t: u64) -> u64 {
        self.offs.iter().find(|&&(off, on)| off <= t && t < on).map_or(t, |&(_, on)| on)
    }

    pub fn io(&mut self, ts_ns: u64) {
        if ts_ns != self.last_io_ns {
            self.prev_io_ns = self.last_io_ns;
            self.last_io_ns = ts_ns;
            // Judged now: by a later write of the same message the thread
            // may have done other I/O, been preempted or slept.
            self.ios[self.ios_next] = (ts_ns, self.woken_for(ts_ns));
            self.ios_next = (self.ios_next + 1) % IOS;
        }
    }

    /// [`Self::woken_for`] a message whose first byte left in the write at
    /// `first_ns` and whose last in the one at `write_ns`: the first write's
    /// wake-up, as judged when it happened. None once that write is past
    /// the I/Os kept.
    pub fn woken_for_message(&self, first_ns: u64, write_ns: u64) -> Option<u64> {
        if first_ns >= write_ns {
            return self.woken_for(write_ns);
        }
        self.ios.iter().find(|&&(t, _)| t == first_ns).and_then(|&(_, wake)| wake)
    }

    /// The wake-up that made this thread write at `write_ns`: it got the CPU
    /// shortly before (counting from its latest switch-in: it may have been
    /// preempted on the way), and the write was its first socket I/O since it
    /// woke. A ZMQ I/O thread serves several sockets; one woken to read is not
    /// the hand-over of a later write.
    pub fn woken_for(&self, write_ns: u64) -> Option<u64> {
        let wake = self.wake_ns?;
        let io_before = if self.last_io_ns < write_ns { self.last_io_ns } else { self.prev_io_ns };
        let window = if self.told_write_ns == write_ns { WOKEN_WRITE_MAX_NS } else { WAKE_TO_WRITE_NS };
        (self.on_ns <= write_ns
            && write_ns - self.on_ns <= window
            && wake <= self.burst_on_ns
            && io_before <= self.burst_on_ns)
            .then_some(wake)
    }
}

pub(crate) fn s_to_ns(s: f64) -> Option<u64> {
    (s.is_finite() && s > 0.0 && s < 1e10).then(|| (s * 1e9).round() as u64)
}

/// A step's end: the time the engine built its output, else the write that
/// sent it. A built time after the write is impossible (clock or decode
/// error): then the write, and `true`.
pub(crate) fn step_end(sent_ns: u64, built_ns: Option<u64>) -> (u64, bool) {
    match built_ns {
        Some(b) if b <= sent_ns => (b, false),
        Some(_) => (sent_ns, true),
        None => (sent_ns, false),
    }
}

/// The hash a name is compared by before its bytes are.
pub(crate) fn name_hash(name: &str) -> u64 {
    use std::hash::Hasher;
    let mut h = super::FxHasher::default();
    h.write(name.as_bytes());
    h.finish()
}

/// One engine request as the IPC told it.
#[derive(Debug, Clone, Default)]
pub struct EngineReq {
    pub request_id: String,
    pub external_id: Option<String>,
    /// The syscall that carried the ADD: the frontend's write (else the
    /// engine's read of it).
    pub submit_ns: Option<u64>,
    pub submit_from_writer: bool,
    /// When the frontend handed it to the writer thread, if the scheduler
    /// told (see [`EngineSide::ingest`]): the wake-up before the write
    /// ([`SUBMIT_WAKE`]), or, for an ADD whose send woke nobody, placed
    /// after the writer's latest such wake-up by `arrival_time`
    /// ([`SUBMIT_ARRIVAL`]).
    pub submit_handover: Option<(u64, &'static str)>,
    /// `submit_handover` came from other writer threads' anchors
    /// ([`Writer::pooled`]), not its own.
    handover_pooled: bool,
    pub prompt_tokens: Option<u64>,
    pub queued_ns: Option<u64>,
    pub scheduled_ns: Option<u64>,
    pub preempted_ns: Vec<u64>,
    /// End of the step that produced the first token (writer's syscall).
    pub first_token_ns: Option<u64>,
    /// End of the latest step that carried an output of it: after its
    /// finish, the step that produced its last token (vLLM's
    /// `last_token_ts`).
    pub last_output_ns: Option<u64>,
    /// Number (in output order) of the step that produced the first token.
    pub first_step: Option<usize>,
    /// End of the step before the first-token step, if there was one.
    pub first_step_prev_end_ns: Option<u64>,
    pub steps: u32,
    pub new_tokens: u64,
    /// The write of its HTTP request's first content, once the correlator
    /// saw it ([`EngineSide::first_content`]): outputs that end later are
    /// not counted in `tokens_by_content`.
    pub first_content_ns: Option<u64>,
    /// Tokens of its outputs that ended by `first_content_ns` (all so far
    /// while it is unknown), and the latest such end
    /// ([`EnginePhases::tokens_before_first_content`]).
    pub tokens_by_content: u64,
    pub last_by_content_ns: Option<u64>,
    pub finish_reason: Option<u8>,
    pub finished_ns: Option<u64>,
    pub prefill: Option<PrefillStats>,
    /// The frontend's ABORT of it (the first one): the client went away or
    /// a stop string ended it.
    pub aborted_ns: Option<u64>,
    /// Decode time lost to co-batched prefills, and whose (charged step by step).
    pub interference_ns: u64,
    pub interference_from: Vec<Name>,
    /// The engine that ran it (`EngineCoreOutputs.engine_index`, the
    /// data-parallel rank), from its first output.
    pub engine_index: Option<u64>,
    /// Its structured-output constraint, from the ADD.
    pub structured: Option<StructuredOutput>,
    /// Requests its engine's scheduler took in after it and scheduled
    /// before it ([`EngineSide::passes`]), and the latest such scheduling.
    pub passed_by: u32,
    pub passed_until_ns: Option<u64>,
    /// Its ADD's `priority` (0 unless a [`Record::EnginePriority`] said).
    pub priority: i64,
    /// Its constraint's [`Record::EngineConstraintKey`].
    pub constraint_key: Option<u64>,
    /// When its grammar is known to have been ready: a request asking for
    /// the same constraint was scheduled then ([`EngineSide::passes`]).
    pub grammar_ready_by_ns: Option<u64>,
    /// Hashes of `interference_from`, in the same order: a step's members
    /// are checked against them before any string is compared.
    interference_hashes: Vec<u64>,
    /// Which of 64 buckets those hashes fall in ([`super::add_interferer`]).
    interference_seen: u64,
    /// Latest record that touched it: it may be forgotten once this is past
    /// the horizon and no unsettled HTTP request can claim it.
    pub last_ns: u64,
    /// Its number in first-seen order over the whole recording (what
    /// [`Step::members`] hold).
    pub num: u32,
    /// The attribution's key for the same id, kept for it
    /// ([`EngineSide::attr_hints`]).
    attr_hint: Option<SlabKey>,
    /// [`name_hash`]es of the keys it is indexed under (at most five: see
    /// [`http_keys`]), so that forgetting it hashes none again.
    key_hashes: [u64; 5],
    indexed: u8,
}

/// An engine step that produced outputs (one EngineCoreOutputs message).
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// When the step ended: `EngineCoreOutputs.timestamp` (the engine built
    /// the step's output), else the write that sent it.
    pub end_ns: u64,
    /// The syscall that wrote the output message. vLLM hands the message to a
    /// ZMQ I/O thread, which may write it milliseconds after the step ended
    /// when the engine keeps the CPUs busy: that lag belongs to the output
    /// path, not to compute.
    pub sent_ns: u64,
    /// (engine request number, in first-seen order over the whole recording,
    /// new tokens, first tokens of that request?).
    pub members: Vec<(u32, u64, bool)>,
    /// The engine that ran it: `EngineCoreOutputs.engine_index` (the
    /// data-parallel rank), 0 when the message had none.
    pub engine: u64,
}

/// How many recent pure-decode step durations the interference baseline
/// looks at. The baseline is causal (a step is judged against the steps
/// before it) so that a request's interference is known when its last step
/// is, whatever comes later: that is what lets the correlator hand requests
/// out while the recording is still being read. 1024 steps is 10-50 s of a
/// busy vLLM engine: long enough to be stable, short enough to follow load.
pub const BASELINE_WINDOW: usize = 1024;

/// The median of the last [`BASELINE_WINDOW`] values pushed (upper median,
/// as `sorted[len / 2]`). Pushing moves at most the window (8 KiB); the
/// median is read in O(1).
#[derive(Debug, Default, Clone)]
pub struct RollingMedian {
    recent: std::collections::VecDeque<u64>,
    /// The same values, sorted: the wire-step fallback asks for a median on
    /// most clusters, and selecting it from the window each time was a
    /// twentieth of `report`'s time.
    sorted: Vec<u64>,
}

impl RollingMedian {
    pub fn push(&mut self, v: u64) {
        if self.recent.len() == BASELINE_WINDOW {
            if let Some(old) = self.recent.pop_front() {
                if let Ok(i) = self.sorted.binary_search(&old) {
                    // The value leaving is replaced by the one coming where
                    // that belongs: only the values between them move (a
                    // removal then an insertion moved about the whole window).
                    let at = self.sorted.partition_point(|&x| x < v);
                    if at <= i {
                        self.sorted[at..=i].rotate_right(1);
                        self.sorted[at] = v;
                    } else {
                        self.sorted[i..at].rotate_left(1);
                        self.sorted[at - 1] = v;
                    }
                    self.recent.push_back(v);
                    return;
                }
            }
        }
        self.recent.push_back(v);
        let at = self.sorted.partition_point(|&x| x < v);
        self.sorted.insert(at, v);
    }

    pub fn median(&self) -> Option<u64> {
        self.sorted.get(self.sorted.len() / 2).copied()
    }
}

/// How long after a reader's copy of a step's part the other API servers'
/// parts may be read (each its own process, woken in turn); well under
/// [`super::SETTLE_NS`], for which the copies are held.
const READER_PART_WAIT_NS: u64 = 500_000_000;
const _: () = assert!(READER_PART_WAIT_NS < super::SETTLE_NS);

/// A reader's copy of an output message, held ([`EngineSide::settle`]).
struct HeldIn {
    conn: ConnKey,
    sent_ns: u64,
    built_ns: Option<u64>,
    engine_index: Option<u64>,
    outputs: Vec<EngineOutput>,
    /// It carried its step's scheduler stats (sent to one client a step).
    stats: bool,
}

/// One engine's step clock: when its last step ended, and its recent
/// pure-decode step durations.
#[derive(Default)]
struct EngineClock {
    last_step_end: Option<u64>,
    baseline: RollingMedian,
    /// Its requests seen scheduled, in the order their first output came,
    /// while one not yet seen scheduled may have passed them or been passed
    /// by them ([`EngineSide::passes`]).
    scheduled: std::collections::VecDeque<SeenScheduled>,
    /// Length of `scheduled` at which it is next pruned.
    prune_at: usize,
}

/// A request's QUEUED stamp and first SCHEDULED stamp, as its engine's
/// scheduler told them with its first output.
#[derive(Debug, Clone, Copy)]
struct SeenScheduled {
    queued_ns: u64,
    scheduled_ns: u64,
    priority: i64,
    /// Its [`EngineReq::constraint_key`].
    constraint: Option<u64>,
    key: SlabKey,
}

/// The earlier of a time known so far (if any) and `at`.
fn earliest(known: Option<u64>, at: u64) -> Option<u64> {
    Some(known.map_or(at, |k| k.min(at)))
}

/// The most requests seen scheduled an engine's pass book holds
/// ([`EngineSide::passes`]); past it the oldest go, counted in
/// `scheduler_pass_book_full`. Only a request that waits while this many
/// others are scheduled fills it.
pub const PASS_BOOK_MAX: usize = 1 << 16;

/// Margin between a request's write to the engine (`submit_ns`) and its
/// QUEUED stamp, which the engine takes after it read the request: both
/// are CLOCK_MONOTONIC, so it only covers rounding of the stamp's seconds.
const PASS_BOOK_SLACK_NS: u64 = 1_000_000;

#[derive(Default)]
pub struct EngineSide {
    /// Engine requests not yet claimed or forgotten; their slab keys by id,
    /// and by every key an HTTP request may know them by ([`http_key_of`]).
    /// A slab, not a map by number: each output looks its request up once
    /// by id and then by key, which is an index.
    reqs: Slab<EngineReq>,
    index: super::FxMap<String, SlabKey>,
    /// By [`name_hash`] of the key (compared in full at the claim): no
    /// copy of the key, and mostly one request, held inline.
    by_key: super::FxMap<u64, Nums>,
    next: u32,
    /// Steps built so far and not yet taken.
    steps: Vec<Step>,
    steps_seen: usize,
    /// Per engine (`EngineCoreOutputs.engine_index`: with data parallelism
    /// several engines step on their own clocks, their outputs interleaved
    /// on the frontend's socket): its last step's end and its baseline.
    clocks: Vec<(u64, EngineClock)>,
    /// The reader's copies (In), held only until a writer's copy shows the
    /// engine is traced; used once past the horizon (or at the end) if it
    /// never was.
    held_in: std::collections::VecDeque<HeldIn>,
    /// The first connection a reader's copy came on, and whether others
    /// did (several API servers, each reading its own part of a step).
    reader_conn: Option<ConnKey>,
    several_readers: bool,
    /// The latest `EngineStats` (connection, time): the stats of the output
    /// message read or written at the same connection and time.
    stats_at: Option<(ConnKey, u64)>,
    /// The latest `EngineRequestStart` (connection, time, thread, id's
    /// [`name_hash`], first write): where the written ADD that follows it
    /// began.
    started: Option<(ConnKey, u64, u32, u64, u64)>,
    seen_writer: bool,
    from_reader: bool,
    /// Per writer thread, what its ADDs told ([`Writer`]).
    writers: super::FxMap<u32, Writer>,
    /// Every writer thread's latest anchors ([`Writer::pooled`]).
    pool: Writer,
    /// ADDs written with neither a wake-up nor an earlier anchor of their
    /// thread to place them by (the first of a recording, when the thread's
    /// wake-up was not seen; with several API servers, one whose previous
    /// ADD was over a second before): placed by the anchors that come
    /// after them ([`Self::place_unplaced`]).
    unplaced: Vec<Unplaced>,
    /// [`Self::step`]'s lists, kept for their capacity.
    decoding: Vec<SlabKey>,
    /// The last step's requests, in its order ([`Self::idx_after`]), and the
    /// list the next one fills.
    prev_step: Vec<SlabKey>,
    cur_step: Vec<SlabKey>,
    /// The engine requests the record being ingested named, in its order
    /// (an ADD's one, a writer's step's outputs; none otherwise).
    touched: Vec<SlabKey>,
    newcomers: Vec<(u64, Name)>,
    /// The requests a step showed scheduled for the first time, in its
    /// order ([`Self::passes`]); kept for its capacity.
    newly_scheduled: Vec<SeenScheduled>,
    pub counters: BTreeMap<&'static str, u64>,
}

impl EngineSide {
    /// A message's scheduler stats were decoded (`Record::EngineStats`, just
    /// before its outputs).
    pub fn stats_seen(&mut self, conn: ConnKey, ts_ns: u64) {
        self.stats_at = Some((conn, ts_ns));
    }

    /// The written ADD `request_id` that follows at `ts_ns` began in the
    /// write at `first_ns` (`Record::EngineRequestStart`).
    pub fn request_started(&mut self, conn: ConnKey, ts_ns: u64, tid: u32, request_id: &str, first_ns: u64) {
        self.started = Some((conn, ts_ns, tid, name_hash(request_id), first_ns));
    }

    fn count(&mut self, what: &'static str) {
        *self.counters.entry(what).or_default() += 1;
    }

    /// Indexes the keys of request `i` ([`http_keys`]), or only those of
    /// its external id (`ext_only`: the others are indexed already).
    fn index_keys(&mut self, i: SlabKey, ext_only: bool) {
        let Some(e) = self.reqs.get_mut(i) else { return };
        let keys = if ext_only { ext_keys(e) } else { http_keys(e) };
        let mut hashes = [0; 4];
        let mut n = 0;
        for k in keys {
            hashes[n] = name_hash(k);
            n += 1;
        }
        for &h in &hashes[..n] {
            // A key both ways (`resp_<b>_0` is the engine id's and the
            // external id's): indexed once.
            if e.key_hashes[..usize::from(e.indexed)].contains(&h) {
                continue;
            }
            match self.by_key.entry(h) {
                std::collections::hash_map::Entry::Occupied(mut o) => o.get_mut().insert(i),
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(Nums::One(i));
                }
            }
            // Indexed once without its external id (three keys at most),
            // once with only that (two): five at most.
            e.key_hashes[usize::from(e.indexed)] = h;
            e.indexed += 1;
        }
    }

    /// The request of an output of a step, whose previous step was `prev`
    /// (`at`: where this step has got to in it). A batch keeps its order step
    /// after step: its requests are mostly the previous step's, in the same
    /// order, less the finished ones (new ones join at the end), so the id is
    /// compared with the next one or two of those before it is looked up.
    /// The same request as [`Self::idx`]: a request held under `id` is the
    /// one `index` has for it.
    #[inline]
    fn idx_after(&mut self, prev: &[SlabKey], at: &mut usize, id: &str) -> SlabKey {
        for (q, &k) in prev.iter().enumerate().skip(*at).take(2) {
            if self.reqs.get(k).is_some_and(|e| e.request_id == id) {
                *at = q + 1;
                return k;
            }
        }
        self.idx(id)
    }

    fn idx(&mut self, id: &str) -> SlabKey {
        if let Some(&i) = self.index.get(id) {
            return i;
        }
        let num = self.next;
        self.next += 1;
        let i = self.reqs.insert(EngineReq { request_id: id.to_owned(), num, ..EngineReq::default() });
        self.index.insert(id.to_owned(), i);
        self.index_keys(i, false);
        i
    }

    fn req(&mut self, id: &str) -> &mut EngineReq {
        let i = self.idx(id);
        self.reqs.get_mut(i).expect("idx inserts")
    }

    /// The entry of a request already seen, for an ADD's side records
    /// (structured output, priority, constraint key): they come right after
    /// their ADD's [`Record::EngineRequest`]. One without it (that record
    /// lost) is counted and dropped, never made a request of its own.
    fn seen_req(&mut self, id: &str) -> Option<&mut EngineReq> {
        let r = self.index.get(id).and_then(|&i| self.reqs.get_mut(i));
        if r.is_none() {
            *self.counters.entry("engine_side_records_orphaned").or_default() += 1;
        }
        r
    }

    fn forget(&mut self, i: SlabKey) -> Option<EngineReq> {
        let e = self.reqs.remove(i)?;
        self.index.remove(&e.request_id);
        for &h in &e.key_hashes[..usize::from(e.indexed)] {
            if let std::collections::hash_map::Entry::Occupied(mut o) = self.by_key.entry(h) {
                if o.get_mut().remove(i) {
                    o.remove();
                }
            }
        }
        Some(e)
    }

    /// `woke`: per thread, its last switch-in and the wake-up before it (from
    /// the off-CPU records). ZMQ sends from an I/O thread: the application's
    /// send() wakes it, and on a loaded machine it may wait on the run queue
    /// for milliseconds before it writes. When the writer thread was woken and
    /// wrote shortly after it got the CPU, the wake-up is when the frontend
    /// handed the request over; the run-queue wait is IPC transit (queue).
    ///
    /// `senders`: per frontend process, the thread that serves its HTTP
    /// requests, taken for the one that calls `send()` (vLLM's and the
    /// testbed's asyncio loop). A placed hand-over never falls where the
    /// scheduler shows that thread off its CPU: under load the frontend is
    /// preempted between building a request and sending it, which no anchor
    /// can know.
    pub fn ingest<S: std::hash::BuildHasher>(&mut self, rec: &Record, woke: &HashMap<u32, Woke, S>, senders: &HashMap<u32, u32, S>) {
        self.touched.clear();
        match rec {
            Record::EngineRequest { conn, ts_ns, tid, dir, request_id, external_req_id, prompt_tokens, arrival_time_s, .. } => {
                let ri = self.idx(request_id);
                self.touched.push(ri);
                let writer = *dir == Dir::Out;
                // Its first byte's write, when libzmq wrote it in several.
                let first_ns = match self.started.take() {
                    Some((c, t, th, h, first)) if writer && (c, t, th) == (*conn, *ts_ns, *tid) && h == name_hash(request_id) => first,
                    _ => *ts_ns,
                };
                let r = &self.reqs[ri];
                // The writer's syscall wins; the first copy seen otherwise.
                let (has_submit, from_writer) = (r.submit_ns.is_some(), r.submit_from_writer);
                if !has_submit || (writer && !from_writer) {
                    // ZMQ batches messages: several ADDs can leave in one
                    // write. Only the first was handed over when the thread
                    // woke; the later ones were sent while it waited for a
                    // CPU, which no syscall shows. Those, and ADDs sent to a
                    // thread that was awake, are placed by their
                    // arrival_time after the latest wake-up seen, else keep
                    // the write time.
                    let arrival = arrival_time_s.filter(|a| a.is_finite());
                    let sender = sender_of(woke, senders, conn.tgid, *tid);
                    let mut anchored = None;
                    let (mut pooled, mut floor_ns) = (false, 0);
                    let handover = if !writer {
                        None
                    } else {
                        let w = self.writers.entry(*tid).or_default();
                        // Not the first handed over when an earlier ADD left
                        // in the write this one began in.
                        let wake = if w.write_ns == *ts_ns || w.write_ns == first_ns { None } else { woke.get(tid).and_then(|o| o.woken_for_message(first_ns, *ts_ns)) };
                        if w.write_ns != *ts_ns {
                            (w.prev_write_ns, w.write_ns) = (w.write_ns, *ts_ns);
                        }
                        floor_ns = w.prev_write_ns;
                        match wake {
                            Some(t) => {
                                if let Some(a) = arrival {
                                    w.anchor(t, a);
                                    anchored = Some((t, a));
                                }
                                Some((t, SUBMIT_WAKE))
                            }
                            None => {
                                let own = w.placed(*ts_ns, arrival);
                                pooled = own.is_none();
                                own.or_else(|| arrival.and_then(|a| self.pool.pooled(*ts_ns, a, floor_ns)))
                                    .map(|t| (sendable_at(sender, t, *ts_ns), SUBMIT_ARRIVAL))
                            }
                        }
                    };
                    let r = self.reqs.get_mut(ri).expect("idx inserts");
                    r.submit_handover = handover;
                    r.handover_pooled = pooled && handover.is_some();
                    r.submit_ns = Some(*ts_ns);
                    r.submit_from_writer = writer;
                    match (anchored, arrival) {
                        (Some((t, a)), _) => {
                            self.pool.anchor(t, a);
                            self.place_unplaced(*tid, t, a, woke, senders);
                        }
                        (None, Some(a)) if writer && (handover.is_none() || pooled) => {
                            if self.unplaced.len() == UNPLACED_MAX {
                                self.unplaced.remove(0);
                            }
                            self.unplaced.push(Unplaced { tid: *tid, tgid: conn.tgid, req: ri, write_ns: *ts_ns, floor_ns, arrival_s: a });
                        }
                        _ => {}
                    }
                }
                let r = self.reqs.get_mut(ri).expect("idx inserts");
                r.last_ns = r.last_ns.max(*ts_ns);
                let new_ext = r.external_id.is_none() && external_req_id.is_some();
                if r.external_id.is_none() {
                    r.external_id.clone_from(external_req_id);
                }
                if r.prompt_tokens.is_none() {
                    r.prompt_tokens = *prompt_tokens;
                }
                if new_ext {
                    self.index_keys(ri, true);
                }
            }
            Record::EngineStructuredOutput { ts_ns, request_id, kind, backend, .. } => {
                if let Some(r) = self.seen_req(request_id) {
                    if r.structured.is_none() {
                        r.structured = Some(StructuredOutput::new(kind, backend.as_deref()));
                    }
                    r.last_ns = r.last_ns.max(*ts_ns);
                }
            }
            Record::EnginePriority { ts_ns, request_id, priority, .. } => {
                if let Some(r) = self.seen_req(request_id) {
                    r.priority = *priority;
                    r.last_ns = r.last_ns.max(*ts_ns);
                }
            }
            Record::EngineConstraintKey { ts_ns, request_id, key, .. } => {
                if let Some(r) = self.seen_req(request_id) {
                    r.constraint_key = Some(*key);
                    r.last_ns = r.last_ns.max(*ts_ns);
                }
            }
            Record::EngineAbort { ts_ns, request_ids, .. } => {
                for id in request_ids {
                    let r = self.req(id);
                    r.aborted_ns = r.aborted_ns.or(Some(*ts_ns));
                    r.last_ns = r.last_ns.max(*ts_ns);
                }
            }
            Record::EngineOutputs { conn, ts_ns, dir, timestamp_s, outputs, engine_index, .. } => {
                let built = timestamp_s.and_then(s_to_ns);
                match dir {
                    Dir::Out => {
                        if !self.seen_writer {
                            self.seen_writer = true;
                            self.held_in = Default::default();
                            if self.from_reader {
                                // Read all at once, the reader's copies would
                                // all have been dropped; those already settled
                                // stay steps.
                                self.count("engine_writer_after_reader_steps");
                            }
                        }
                        self.step(*ts_ns, built, *engine_index, outputs);
                        self.touched.extend_from_slice(&self.prev_step);
                    }
                    Dir::In if !self.seen_writer => {
                        match self.reader_conn {
                            None => self.reader_conn = Some(*conn),
                            Some(c) => self.several_readers |= c != *conn,
                        }
                        let stats = self.stats_at == Some((*conn, *ts_ns));
                        self.held_in.push_back(HeldIn { conn: *conn, sent_ns: *ts_ns, built_ns: built, engine_index: *engine_index, outputs: outputs.clone(), stats });
                    }
                    Dir::In => {}
                }
            }
            _ => {}
        }
    }

    /// One step from one EngineCoreOutputs message. Interference is charged
    /// here: a step that carried someone's first token (their prefill) and
    /// took longer than the baseline of recent pure-decode steps cost the
    /// excess to every member already decoding.
    fn step(&mut self, sent_ns: u64, built_ns: Option<u64>, engine_index: Option<u64>, outputs: &[EngineOutput]) {
        let engine = engine_index.unwrap_or(0);
        let (end_ns, impossible) = step_end(sent_ns, built_ns);
        if impossible {
            self.count("engine_timestamp_after_send");
        }
        let idx = self.steps_seen;
        self.steps_seen += 1;
        let k = super::slot(&mut self.clocks, engine);
        let prev_end = self.clocks[k].1.last_step_end;
        let dur = prev_end.map(|p| end_ns.saturating_sub(p));
        self.clocks[k].1.last_step_end = Some(end_ns);
        let mut members = Vec::with_capacity(outputs.len());
        let mut decoding = std::mem::take(&mut self.decoding);
        let mut newcomers = std::mem::take(&mut self.newcomers);
        decoding.clear();
        newcomers.clear();
        let prev = std::mem::take(&mut self.prev_step);
        let mut cur = std::mem::take(&mut self.cur_step);
        cur.clear();
        let mut at = 0;
        for o in outputs {
            let ri = self.idx_after(&prev, &mut at, &o.request_id);
            cur.push(ri);
            let r = self.reqs.get_mut(ri).expect("idx inserts");
            r.last_ns = r.last_ns.max(sent_ns);
            r.steps += 1;
            r.new_tokens += o.new_tokens;
            r.engine_index = r.engine_index.or(engine_index);
            // Its part of a step sent to several API servers, built after
            // the first part: the time its server stamps it with.
            let part = o.events.iter().find(|e| e.kind == super::join::EV_PART_BUILT).and_then(|e| s_to_ns(e.timestamp_s));
            let part = part.filter(|p| !impossible && built_ns.is_some() && (end_ns..=end_ns + super::join::SAME_STEP_NS).contains(p));
            let out_ns = part.unwrap_or(end_ns);
            r.last_output_ns = Some(r.last_output_ns.map_or(out_ns, |l| l.max(out_ns)));
            // Outputs come in time order, so those seen before the first
            // content ended before it; a later one (a step joined late) is
            // told by its end.
            if o.new_tokens > 0 && r.first_content_ns.is_none_or(|c| out_ns <= c) {
                r.tokens_by_content += o.new_tokens;
                r.last_by_content_ns = Some(r.last_by_content_ns.map_or(out_ns, |l| l.max(out_ns)));
            }
            let first = o.new_tokens > 0 && r.first_token_ns.is_none();
            if first {
                r.first_token_ns = Some(out_ns);
                r.first_step = Some(idx);
                r.first_step_prev_end_ns = prev_end;
                let name = http_name(r);
                let h = name_hash(name);
                if !newcomers.iter().any(|(nh, n)| *nh == h && **n == *name) {
                    newcomers.push((h, Name::from(name)));
                }
            } else if r.first_step.is_some_and(|f| f < idx) {
                decoding.push(ri);
            }
            let seen_scheduled = r.scheduled_ns.is_some();
            for ev in &o.events {
                let Some(t) = s_to_ns(ev.timestamp_s) else { continue };
                match ev.kind {
                    EV_QUEUED => r.queued_ns = r.queued_ns.or(Some(t)),
                    EV_SCHEDULED => r.scheduled_ns = Some(r.scheduled_ns.map_or(t, |s| s.min(t))),
                    EV_PREEMPTED => r.preempted_ns.push(t),
                    _ => {}
                }
            }
            if let (false, Some(q), Some(s)) = (seen_scheduled, r.queued_ns, r.scheduled_ns) {
                self.newly_scheduled.push(SeenScheduled { queued_ns: q, scheduled_ns: s, priority: r.priority, constraint: r.constraint_key, key: ri });
            }
            if o.prefill.is_some() && r.prefill.is_none() {
                r.prefill = o.prefill;
            }
            if o.finish_reason.is_some() {
                r.finish_reason = o.finish_reason;
                r.finished_ns = Some(end_ns);
            }
            members.push((r.num, o.new_tokens, first));
        }
        let newly = std::mem::take(&mut self.newly_scheduled);
        for n in &newly {
            self.passes(k, *n);
        }
        self.newly_scheduled = newly;
        self.newly_scheduled.clear();
        match (dur, newcomers.is_empty()) {
            (Some(d), true) => self.clocks[k].1.baseline.push(d),
            (Some(d), false) => {
                if let Some(med) = self.clocks[k].1.baseline.median().filter(|&m| d > m) {
                    for &ri in &decoding {
                        let Some(r) = self.reqs.get_mut(ri) else { continue };
                        r.interference_ns += d - med;
                        for (h, n) in &newcomers {
                            super::add_interferer(&mut r.interference_seen, &mut r.interference_hashes, &mut r.interference_from, *h, n);
                        }
                    }
                }
            }
            (None, _) => {}
        }
        (self.decoding, self.newcomers) = (decoding, newcomers);
        (self.prev_step, self.cur_step) = (cur, prev);
        self.steps.push(Step { end_ns, sent_ns, members, engine });
    }

    /// Who passed whom in engine slot `k`'s queue, as request `n` is seen
    /// scheduled: vLLM's FCFS scheduler takes its waiting queue in order and
    /// schedules a later request before an earlier one only by skipping the
    /// earlier (its grammar not compiled yet, remote KV not loaded, no LoRA
    /// slot, or, chunked prefill off, a prompt over the token budget left),
    /// never for want of room: a full batch or budget stops the pass over
    /// the queue. Each pair is looked at once, when the later of the two is
    /// seen (a long prefill's first output can come after a request it
    /// passed was seen). A passed request already handed out is counted in
    /// `scheduler_passes_after_claim`.
    fn passes(&mut self, k: usize, n: SeenScheduled) {
        let (reqs, clock) = (&mut self.reqs, &mut self.clocks[k].1);
        let (mut by, mut until) = (0u32, None::<u64>);
        let mut ready = None::<u64>;
        let mut late = 0;
        // A request of higher priority (a lower value) goes first by right
        // under `--scheduling-policy priority`: no proof of a skip.
        for o in &clock.scheduled {
            // The same constraint scheduled: its grammar was ready then, and
            // the backend's cache (xgrammar's, per constraint) has it for
            // every request asking for it (ready at once for one queued
            // after).
            if n.constraint.is_some() && o.constraint == n.constraint {
                if o.scheduled_ns <= n.scheduled_ns {
                    ready = earliest(ready, o.scheduled_ns.max(n.queued_ns));
                } else if let Some(e) = reqs.get_mut(o.key) {
                    e.grammar_ready_by_ns = earliest(e.grammar_ready_by_ns, n.scheduled_ns.max(o.queued_ns));
                }
            }
            if o.queued_ns > n.queued_ns && o.scheduled_ns < n.scheduled_ns && o.priority >= n.priority {
                by += 1;
                until = until.max(Some(o.scheduled_ns));
            } else if o.queued_ns < n.queued_ns && o.scheduled_ns > n.scheduled_ns && n.priority >= o.priority {
                match reqs.get_mut(o.key) {
                    Some(e) => {
                        e.passed_by += 1;
                        e.passed_until_ns = e.passed_until_ns.max(Some(n.scheduled_ns));
                    }
                    None => late += 1,
                }
            }
        }
        if let Some(r) = reqs.get_mut(n.key) {
            r.passed_by += by;
            r.passed_until_ns = r.passed_until_ns.max(until);
            if let Some(at) = ready {
                r.grammar_ready_by_ns = earliest(r.grammar_ready_by_ns, at);
            }
        }
        clock.scheduled.push_back(n);
        let mut full = 0;
        // Pruned as it doubles, and whenever it would pass the most it holds.
        if clock.scheduled.len() >= clock.prune_at.clamp(64, PASS_BOOK_MAX + 1) {
            // A request not yet seen scheduled was queued after its write
            // to the engine: none written before `floor` is left to pass
            // or be passed by what was scheduled before it.
            let floor = reqs.iter().filter(|(_, e)| e.scheduled_ns.is_none()).filter_map(|(_, e)| e.submit_ns).min();
            match floor {
                Some(f) => clock.scheduled.retain(|o| o.scheduled_ns.saturating_add(PASS_BOOK_SLACK_NS) >= f),
                None => clock.scheduled.clear(),
            }
            while clock.scheduled.len() > PASS_BOOK_MAX {
                clock.scheduled.pop_front();
                full += 1;
            }
            clock.prune_at = 2 * clock.scheduled.len();
        }
        for (what, n) in [("scheduler_passes_after_claim", late), ("scheduler_pass_book_full", full)] {
            if n > 0 {
                *self.counters.entry(what).or_default() += n;
            }
        }
    }

    /// A new anchor of writer `tid` (wake-up `wake_ns`, `arrival_s`) places
    /// the ADDs it wrote before with nothing to place them by, as
    /// [`Writer::placed`] places later ones: by how much earlier they were
    /// built, the least delayed of the anchors within a second after them
    /// taken, never after their write. Other threads' waiting ADDs it places
    /// as the pool does ([`Writer::pooled`]), until an anchor of their own
    /// comes. Whether the placement falls inside the HTTP request is checked
    /// at the claim.
    fn place_unplaced<S: std::hash::BuildHasher>(&mut self, tid: u32, wake_ns: u64, arrival_s: f64, woke: &HashMap<u32, Woke, S>, senders: &HashMap<u32, u32, S>) {
        let reqs = &mut self.reqs;
        self.unplaced.retain(|u| {
            // Anchors come in time order: none later can be usable either.
            if wake_ns > u.write_ns.saturating_add(ANCHOR_MAX_NS) {
                return false;
            }
            let Some(r) = reqs.get_mut(u.req) else { return false };
            let own = u.tid == tid;
            if !own && r.submit_handover.is_some() && !r.handover_pooled {
                return true;
            }
            if let Some(at) = anchored_at(wake_ns, arrival_s, u.arrival_s) {
                // `as` saturates: a placement before the clock's start is 0.
                let at = at.round() as u64;
                let at = if own { at } else { at.max(u.floor_ns) };
                let at = sendable_at(sender_of(woke, senders, u.tgid, u.tid), at, u.write_ns);
                // Its own thread's first anchor replaces what the pool placed.
                let best = match r.submit_handover {
                    Some((t, _)) if own != r.handover_pooled => t.min(at),
                    _ => at,
                };
                r.submit_handover = Some((best, SUBMIT_ARRIVAL));
                r.handover_pooled = !own;
            }
            true
        });
    }

    /// Reader's copies older than `horizon` become steps when no writer's copy
    /// has been seen: the engine side is not traced, and holding them longer
    /// would hold the recording.
    pub fn settle(&mut self, horizon_ns: u64) {
        if self.seen_writer {
            return;
        }
        while self.held_in.front().is_some_and(|h| h.sent_ns < horizon_ns) {
            let first = if self.several_readers { self.built_first() } else { 0 };
            let mut h = self.held_in.remove(first).expect("in range");
            if !self.from_reader {
                self.from_reader = true;
                self.count("engine_steps_from_reader");
            }
            if self.several_readers {
                self.join_reader_parts(&mut h);
            }
            self.step(h.sent_ns, h.built_ns, h.engine_index, &h.outputs);
        }
    }

    /// Each API server reads its parts in its own time: one may read its
    /// part of a step after another read its part of the next step. An
    /// engine's steps go on in the order it built them: the held copy of the
    /// first one's engine built first, among those read within
    /// [`READER_PART_WAIT_NS`] of it.
    fn built_first(&self) -> usize {
        let Some(f) = self.held_in.front() else { return 0 };
        let Some(mut best) = f.built_ns else { return 0 };
        let mut at = 0;
        for (i, p) in self.held_in.iter().enumerate().skip(1) {
            if p.sent_ns > f.sent_ns.saturating_add(READER_PART_WAIT_NS) {
                break;
            }
            if p.engine_index == f.engine_index && p.built_ns.is_some_and(|b| b < best) {
                (best, at) = (p.built_ns.expect("checked"), i);
            }
        }
        at
    }

    /// vLLM with several API servers sends a step as one message per API
    /// server, each read by its own process ([`super::join`] joins the
    /// engine's writes; with no engine traced only these copies are there).
    /// The parts of `h`'s step are the copies of the same engine read on
    /// other connections, built within [`super::join::SAME_STEP_NS`] of it.
    /// Held copies cover the last [`super::SETTLE_NS`] of the recording:
    /// every part read within [`READER_PART_WAIT_NS`] of `h` is at hand.
    fn join_reader_parts(&mut self, h: &mut HeldIn) {
        let Some(b) = h.built_ns else { return };
        let mut conns = vec![h.conn];
        let mut i = 0;
        while let Some(p) = self.held_in.get(i) {
            if p.sent_ns > h.sent_ns.saturating_add(READER_PART_WAIT_NS) {
                break;
            }
            // Two copies with stats are two steps (`join::SAME_STEP_NS`).
            let part = p.engine_index == h.engine_index
                && !conns.contains(&p.conn)
                && p.built_ns.is_some_and(|pb| pb.abs_diff(b) <= super::join::SAME_STEP_NS)
                && !(h.stats && p.stats);
            if !part {
                i += 1;
                continue;
            }
            let p = self.held_in.remove(i).expect("got it");
            conns.push(p.conn);
            let from = h.outputs.len();
            h.outputs.extend(p.outputs);
            if let (Some(a), Some(pb)) = (h.built_ns, p.built_ns) {
                super::join::mark_parts(&mut h.outputs, from, a as f64 / 1e9, pb as f64 / 1e9);
            }
            h.built_ns = h.built_ns.min(p.built_ns);
            h.stats |= p.stats;
            self.count("engine_reader_outputs_joined");
        }
    }

    /// Steps built since the last call, in output order.
    pub fn take_steps(&mut self) -> Vec<Step> {
        std::mem::take(&mut self.steps)
    }

    /// The engine request for an HTTP request, when it becomes final: every
    /// unclaimed engine request that names it (its id or x-request-id, see
    /// [`http_key_of`]) and was submitted while it was served is claimed by
    /// it; the first one seen carries the partition, the others are counted
    /// as extra (n > 1, several prompts). HTTP requests become final in
    /// arrival order, so each engine request goes to the earliest HTTP
    /// request that fits, as when every request was known.
    pub fn claim(&mut self, r: &Request) -> Option<EnginePhases> {
        let mut hits = self.named_by(r);
        hits.sort_unstable_by_key(|&i| self.reqs[i].num);
        let mut claimed = hits.into_iter().filter_map(|i| self.forget(i));
        let e = claimed.next()?;
        let extra = claimed.count() as u64;
        if extra > 0 {
            *self.counters.entry("engine_requests_extra").or_default() += extra;
        }
        self.count("engine_requests_linked");
        Some(phases_of(e, r))
    }

    /// The unclaimed engine requests that name `r` (its id or x-request-id,
    /// see [`http_key_of`]) and were submitted while it was served.
    fn named_by(&self, r: &Request) -> Vec<SlabKey> {
        let mut hits: Vec<SlabKey> = Vec::new();
        for name in std::iter::once(&r.id).chain(r.x_request_id.as_ref()) {
            for &i in self.by_key.get(&name_hash(name)).map_or(&[][..], Nums::as_slice) {
                let Some(e) = self.reqs.get(i) else { continue };
                // Another key of the same hash.
                if !http_keys(e).into_iter().any(|k| k == name.as_str()) {
                    continue;
                }
                let Some(submit) = e.submit_ns else { continue };
                if r.arrive_ns <= submit && r.done_ns.is_none_or(|d| submit <= d) && !hits.contains(&i) {
                    hits.push(i);
                }
            }
        }
        hits
    }

    /// HTTP request `r` wrote its first content at `ts`: the engine request
    /// [`Self::claim`] will give it (the earliest submitted that names it)
    /// counts its tokens up to then, and no later output
    /// ([`EnginePhases::tokens_before_first_content`]).
    pub fn first_content(&mut self, r: &Request, ts: u64) {
        let Some(i) = self.named_by(r).into_iter().min_by_key(|&i| self.reqs[i].num) else { return };
        if let Some(e) = self.reqs.get_mut(i) {
            e.first_content_ns = e.first_content_ns.or(Some(ts));
        }
    }

    /// The engine request for an HTTP request closed before the server
    /// wrote its id (vLLM's first chunk comes with the first token: a client
    /// that gives up while its request is queued or prefilling has seen no
    /// id), when [`Self::claim`] found none: the one the frontend aborted
    /// within [`ABORT_NEAR_CLOSE_NS`] of the close (it aborts what a client
    /// left), submitted while the request was served and named by no other
    /// HTTP request still held (`named`: a live request knows it by one of
    /// these keys). The earliest submitted wins: requests are handed out in
    /// arrival order and the frontend submits in that order, so clients
    /// that give up together take their engine requests in turn (the order
    /// of their aborts follows the server's event loop, not the closes).
    /// An abort nearer another such request's close by more than
    /// [`ABORT_CLOSE_MARGIN_NS`] is left to it (`nearer(submit, abort)`: a
    /// live request closed unnamed, served at the submit, closed that much
    /// nearer the abort): a client that left before its request reached the
    /// engine has no abort, and must not take that of one who left later.
    /// Also returns the id the server gave it ([`http_name`]: what it would
    /// have written in the first chunk).
    pub fn claim_aborted(&mut self, r: &Request, named: impl Fn(&[&str]) -> bool, nearer: impl Fn(u64, u64) -> bool) -> Option<(EnginePhases, String)> {
        let closed = r.closed_ns?;
        if r.method != "POST" {
            return None;
        }
        let mut best: Option<(u64, u32, SlabKey)> = None;
        // (submit, number): the number breaks ties of one write's ADDs.
        for (i, e) in self.reqs.iter() {
            let (Some(submit), Some(abort)) = (e.submit_ns, e.aborted_ns) else { continue };
            if submit < r.arrive_ns || submit > closed || abort < r.arrive_ns || abort.abs_diff(closed) > ABORT_NEAR_CLOSE_NS {
                continue;
            }
            let rank = (submit, e.num, i);
            if best.is_some_and(|b| (b.0, b.1) <= (rank.0, rank.1)) {
                continue;
            }
            let keys = http_keys(e);
            if named(keys.as_slice()) || nearer(submit, abort) {
                continue;
            }
            best = Some(rank);
        }
        let e = self.forget(best?.2)?;
        self.count("engine_requests_linked_by_abort");
        let name = http_name(&e).to_owned();
        Some((phases_of(e, r), name))
    }
}

/// How far an ABORT may lie from the close of the connection whose request
/// it ended ([`EngineSide::claim_aborted`]): vLLM's frontend aborts as soon
/// as its event loop hears of the disconnect, milliseconds around the
/// server's close. Within [`super::SETTLE_NS`], so that a request is handed
/// out only once any such abort has been read.
pub const ABORT_NEAR_CLOSE_NS: u64 = 1_000_000_000;
const _: () = assert!(ABORT_NEAR_CLOSE_NS < super::SETTLE_NS);

/// How much nearer another closed request's close must lie to an ABORT for
/// the abort to be left to it ([`EngineSide::claim_aborted`]). Clients that
/// give up together (one timeout, closes within this) keep taking their
/// aborts in submit order; vLLM aborts within a millisecond of the close
/// (docs/decisions.md), far inside it.
pub const ABORT_CLOSE_MARGIN_NS: u64 = 50_000_000;

/// The last of `e`'s outputs with tokens that ended by the first content
/// at `ttft`, and the tokens it had produced by then
/// ([`EngineSide::first_content`] marked `e` with that write). At least its
/// first output: the frontend cannot write what the engine has not sent, so
/// a first output timed after the content (the engine's clock mapped a
/// little late) still counts. `None` without a first content or tokens, or
/// when `e` was not marked with this content (no key of the request named
/// it yet).
fn before_first_content(e: &EngineReq, ttft: Option<u64>) -> Option<(u64, u64)> {
    let first = e.first_token_ns?;
    if e.first_content_ns.is_none() || e.first_content_ns != ttft {
        return None;
    }
    Some((e.last_by_content_ns.unwrap_or(first).max(first), e.tokens_by_content.max(1)))
}

/// The phases an engine request gives the HTTP request that claimed it.
fn phases_of(e: EngineReq, r: &Request) -> EnginePhases {
    // The wake-up is the hand-over only if it happened while the HTTP
    // request was being served; an earlier one woke the thread for
    // something else.
    let submit = e.submit_ns.expect("claimed requests have a submit");
    let (submit, submit_source) = match e.submit_handover {
        Some((w, source)) if w >= r.arrive_ns => (w, source),
        _ => (submit, if e.submit_from_writer { SUBMIT_WRITE } else { SUBMIT_READ }),
    };
    let (scheduled_ns, scheduled_source) = match e.scheduled_ns {
        Some(t) => (Some(t), "event"),
        None => match (e.first_step, e.first_step_prev_end_ns) {
            // The step producing the first token started after the one before it ended.
            (Some(_), Some(p)) if p >= submit => (Some(p), "step"),
            (Some(_), _) => (Some(submit), "submit"),
            // Closed before any token and never seen scheduled: it
            // waited in the queue until the client left (a prefill
            // begun unseen is counted as queue: vLLM sends no events
            // for a request that never output).
            (None, _) => match r.closed_early_ns() {
                Some(c) => (Some(c), SCHEDULED_CLOSED),
                None => (None, "submit"),
            },
        },
    };
    let prefill = e.prefill.unwrap_or_default();
    let before_content = before_first_content(&e, r.ttft_ns);
    EnginePhases {
        submit_ns: submit,
        queued_ns: e.queued_ns,
        scheduled_ns,
        first_token_ns: e.first_token_ns,
        last_output_ns: e.last_output_ns,
        steps: e.steps,
        preemptions: e.preempted_ns.len() as u32,
        prompt_tokens: e.prompt_tokens.or(prefill.prompt_tokens),
        cached_tokens: prefill.cached_tokens,
        computed_tokens: prefill.computed_tokens,
        generated_tokens: e.new_tokens,
        tokens_before_first_content: before_content.map(|b| b.1),
        first_content_output_ns: before_content.map(|b| b.0),
        interference_ns: e.interference_ns,
        interference_from: e.interference_from,
        engine_index: e.engine_index,
        structured: e.structured,
        passed_over_by: e.queued_ns.and(e.scheduled_ns).map(|_| e.passed_by),
        passed_over_until_ns: e.passed_until_ns,
        priority: (e.priority != 0).then_some(e.priority),
        grammar_ready_by_ns: e.grammar_ready_by_ns,
        scheduled_source,
        submit_source,
        engine_request_id: e.request_id,
    }
}

impl EngineSide {
    /// Forgets engine requests no HTTP request can claim any more: untouched
    /// since before `horizon_ns`, and submitted before `oldest_unsettled_ns`
    /// (the earliest arrival among HTTP requests not yet final; a claim needs
    /// arrival <= submit). Each is counted once, as at the end.
    pub fn forget_unclaimable(&mut self, horizon_ns: u64, oldest_unsettled_ns: Option<u64>) {
        let gone: Vec<SlabKey> = self
            .reqs
            .iter()
            .filter(|(_, e)| e.last_ns < horizon_ns && e.submit_ns.is_none_or(|s| oldest_unsettled_ns.is_none_or(|o| s < o)))
            .map(|(i, _)| i)
            .collect();
        for i in gone {
            if let Some(e) = self.forget(i) {
                self.count(if e.submit_ns.is_some() { "engine_requests_unlinked" } else { "engine_outputs_without_request" });
            }
        }
    }

    /// Ends a replay of the engine side alone (no HTTP claims): every engine
    /// request in first-seen order (what [`Step::members`] number), the steps
    /// not taken, the counters.
    pub fn finish(mut self) -> (Vec<EngineReq>, Vec<Step>, BTreeMap<&'static str, u64>) {
        self.settle(u64::MAX);
        let mut reqs: Vec<EngineReq> = self.reqs.into_values().collect();
        reqs.sort_unstable_by_key(|r| r.num);
        (reqs, self.steps, self.counters)
    }

    /// Ends the engine side: the reader's copies if the writer was never
    /// traced, then every engine request left unclaimed is counted.
    pub fn close(&mut self) {
        self.settle(u64::MAX);
        let mut left: Vec<(u32, SlabKey)> = self.reqs.iter().map(|(i, e)| (e.num, i)).collect();
        left.sort_unstable();
        for (_, i) in left {
            if let Some(e) = self.forget(i) {
                self.count(if e.submit_ns.is_some() { "engine_requests_unlinked" } else { "engine_outputs_without_request" });
            }
        }
    }

    /// Engine requests held (not yet claimed or forgotten).
    pub fn open_requests(&self) -> usize {
        self.reqs.len()
    }

    /// The attribution's keys ([`super::gpu::Attribution::ingest_hinted`])
    /// for the engine requests the last record [`Self::ingest`] took named,
    /// in its order ([`NO_KEY`] where none is kept yet): the attribution
    /// then neither hashes nor compares their ids again.
    pub(crate) fn attr_hints(&self, out: &mut Vec<SlabKey>) {
        out.extend(self.touched.iter().map(|&i| self.reqs.get(i).and_then(|e| e.attr_hint).unwrap_or(NO_KEY)));
    }

    /// Keeps the keys [`Self::attr_hints`] gave, as the attribution updated them.
    pub(crate) fn set_attr_hints(&mut self, hints: &[SlabKey]) {
        for (&i, &h) in self.touched.iter().zip(hints) {
            if let Some(e) = self.reqs.get_mut(i) {
                e.attr_hint = Some(h);
            }
        }
    }
}

/// The engine id for an SSE/HTTP id per vllm-wire.md §4: exact external id,
/// else `<k>_` parallel-sampling prefix stripped, else `<id>-<8 hex>`, else
/// completions' `cmpl-<base>-<i>`, else the Responses API's `resp_<base>_<i>`.
pub fn http_key_of(engine: &EngineReq) -> Vec<String> {
    http_keys(engine).into_iter().map(str::to_owned).collect()
}

/// [`http_key_of`] borrowed from the request: every key is a part of its
/// external or engine id, so indexing and forgetting one copy nothing.
///
/// Each rule is checked from the end it is about (an id is hashed and
/// indexed twice per request; searching whole ids for separators was ~4 %
/// of a report): `cmpl-<base>-<digits>` from its end, `<digits>_` from the
/// start, `-<8 hex>` at the end.
fn http_keys(engine: &EngineReq) -> Keys<'_> {
    let mut keys = ext_keys(engine);
    let mut id = engine.request_id.as_str();
    // A parallel-sampling prefix: digits, then the first '_'.
    let lead = id.bytes().take_while(u8::is_ascii_digit).count();
    if lead > 0 && id.as_bytes().get(lead) == Some(&b'_') {
        id = &id[lead + 1..];
    }
    keys.push(id);
    // The last '-' with exactly 8 hex digits after it (they hold no '-').
    let b = id.as_bytes();
    if b.len() >= 9 && b[b.len() - 9] == b'-' && b[b.len() - 8..].iter().all(u8::is_ascii_hexdigit) {
        id = &id[..b.len() - 9];
        keys.push(id);
    }
    // Without an external id (vLLM before 0.14), the response's from its turn's.
    if engine.external_id.is_none() {
        if let Some(base) = responses_base(id) {
            keys.push(base);
        }
    }
    keys
}

/// The id its HTTP request shows (what others' `interference_from` name):
/// the external id without a completions prompt's index or a response's
/// turn, else the engine id without its random suffix.
fn http_name(engine: &EngineReq) -> &str {
    let keys = if engine.external_id.is_some() { ext_keys(engine) } else { http_keys(engine) };
    keys.into_iter().next_back().unwrap_or(engine.request_id.as_str())
}

/// The first of [`http_keys`]: those of the external id.
fn ext_keys(engine: &EngineReq) -> Keys<'_> {
    let mut keys = Keys::default();
    if let Some(ext) = &engine.external_id {
        keys.push(ext);
        if ext.starts_with("cmpl-") {
            // The last '-' followed by digits only, at least one.
            let b = ext.as_bytes();
            let digits = b.iter().rev().take_while(|c| c.is_ascii_digit()).count();
            let dash = b.len() - digits;
            if digits > 0 && dash > 0 && b[dash - 1] == b'-' && ext[..dash - 1].starts_with("cmpl-") {
                keys.push(&ext[..dash - 1]);
            }
        } else if let Some(base) = responses_base(ext) {
            keys.push(base);
        }
    }
    keys
}

/// The Responses API sends a response `resp_<base>` to the engine as
/// `resp_<base>_<i>`, one per turn of its built-in tool loop: the
/// response's id, or None.
fn responses_base(id: &str) -> Option<&str> {
    if !id.starts_with("resp_") {
        return None;
    }
    let b = id.as_bytes();
    let digits = b.iter().rev().take_while(|c| c.is_ascii_digit()).count();
    let cut = b.len() - digits;
    (digits > 0 && cut > "resp_".len() + 1 && b[cut - 1] == b'_').then(|| &id[..cut - 1])
}

/// Engine requests (slab keys) under one key hash, in the order indexed:
/// almost always one (a key names one request), so not a vector each.
#[derive(Debug)]
enum Nums {
    One(SlabKey),
    Many(Vec<SlabKey>),
}

impl Nums {
    fn as_slice(&self) -> &[SlabKey] {
        match self {
            Nums::One(i) => std::slice::from_ref(i),
            Nums::Many(v) => v,
        }
    }

    /// Adds `i` unless it is there.
    fn insert(&mut self, i: SlabKey) {
        match self {
            Nums::One(x) if *x == i => {}
            Nums::One(x) => *self = Nums::Many(vec![*x, i]),
            Nums::Many(v) if v.contains(&i) => {}
            Nums::Many(v) => v.push(i),
        }
    }

    /// Removes `i`; true when none is left.
    fn remove(&mut self, i: SlabKey) -> bool {
        match self {
            Nums::One(x) => *x == i,
            Nums::Many(v) => {
                v.retain(|&x| x != i);
                v.is_empty()
            }
        }
    }
}

/// At most four keys, in a fixed array.
#[derive(Default)]
struct Keys<'a> {
    k: [&'a str; 4],
    n: usize,
}

impl<'a> Keys<'a> {
    fn as_slice(&self) -> &[&'a str] {
        &self.k[..self.n]
    }

    fn push(&mut self, key: &'a str) {
        self.k[self.n] = key;
        self.n += 1;
    }
}

impl<'a> IntoIterator for Keys<'a> {
    type Item = &'a str;
    type IntoIter = std::iter::Take<std::array::IntoIter<&'a str, 4>>;
    fn into_iter(self) -> Self::IntoIter {
        self.k.into_iter().take(self.n)
    }
}

/// A request's structured-output constraint ([`Record::EngineStructuredOutput`]):
/// its kind (one of `proto::vllm::STRUCTURED_KINDS`, or `other`) and the
/// backend that compiles it, when named. vLLM's scheduler holds such a
/// request in its waiting queue until its grammar is compiled (and builds
/// the backend on the first one), so it shows in the scheduler's queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StructuredOutput {
    pub kind: &'static str,
    pub backend: Option<Box<str>>,
}

impl StructuredOutput {
    fn new(kind: &str, backend: Option<&str>) -> StructuredOutput {
        let kind = crate::model::STRUCTURED_KINDS.iter().copied().find(|k| *k == kind).unwrap_or(crate::model::STRUCTURED_OTHER);
        StructuredOutput { kind, backend: backend.map(Box::from) }
    }
}

/// Per-request engine attribution written into the [`Request`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EnginePhases {
    pub engine_request_id: String,
    pub submit_ns: u64,
    /// The engine's QUEUED stamp: its scheduler took the request in (sent
    /// only when the engine logs stats, with the request's first output).
    pub queued_ns: Option<u64>,
    pub scheduled_ns: Option<u64>,
    pub first_token_ns: Option<u64>,
    /// End of the step that carried its last output (its part's build time
    /// with several API servers), as `first_token_ns` is its first token's:
    /// vLLM's `last_token_ts`.
    pub last_output_ns: Option<u64>,
    pub steps: u32,
    pub preemptions: u32,
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub computed_tokens: Option<u64>,
    /// Tokens the engine generated for it: the new token ids of its outputs,
    /// which vLLM's `usage.completion_tokens` counts too (a stream asks for
    /// usage only with `stream_options.include_usage`).
    pub generated_tokens: u64,
    /// The tokens the engine had produced for it when its first content
    /// left (outputs ended by `ttft_ns`): 1 when the first token's text went
    /// straight out; more when the server held text back (vLLM's
    /// detokenizer keeps the last `len(longest stop string) − 1` characters
    /// of a request with stop strings, and incomplete UTF-8; a reasoning or
    /// tool-call parser waits for a whole tag) or its output path was
    /// slower than a step. `None` without a first content.
    pub tokens_before_first_content: Option<u64>,
    /// The end of the last of its outputs with tokens that ended by its
    /// first content: [`first_output_held_ms`] runs from the first token to it.
    pub first_content_output_ns: Option<u64>,
    /// Decode time lost to co-batched prefills of other requests (ns), and whose.
    pub interference_ns: u64,
    pub interference_from: Vec<Name>,
    /// The engine that ran it (`EngineCoreOutputs.engine_index`: the
    /// data-parallel rank; 0 with one engine), None without outputs.
    pub engine_index: Option<u64>,
    /// Its structured-output constraint, from the ADD (`None`: it asked for
    /// none, or the IPC was not decoded).
    pub structured: Option<StructuredOutput>,
    /// How many requests its engine's scheduler took in after it and
    /// scheduled before it: each one a step in which the scheduler skipped
    /// it (its grammar, remote KV, a LoRA slot), not one it lacked room in
    /// ([`EngineSide::passes`]). `None` without its QUEUED and SCHEDULED
    /// stamps.
    pub passed_over_by: Option<u32>,
    /// The latest of those schedulings: until then, it was being skipped.
    pub passed_over_until_ns: Option<u64>,
    /// Its ADD's `priority` when not vLLM's default 0 (an
    /// [`Record::EnginePriority`]); `None` for 0 or not read.
    pub priority: Option<i64>,
    /// When its grammar is known to have been ready: the first scheduling of
    /// a request on its engine asking for the same constraint (its QUEUED
    /// stamp when that came before). `None` when none was seen.
    pub grammar_ready_by_ns: Option<u64>,
    /// Where `scheduled_ns` came from: "event" (SCHEDULED) or "step" (previous
    /// step end) or "submit" (no earlier step).
    pub scheduled_source: &'static str,
    /// Where `submit_ns` came from: [`SUBMIT_WAKE`], [`SUBMIT_ARRIVAL`],
    /// [`SUBMIT_WRITE`] (the frontend's write) or [`SUBMIT_READ`] (the
    /// engine's read: the frontend is not traced).
    pub submit_source: &'static str,
}

/// The phase partition of [arrive, done] (ms), from [`marks`]: a mark before
/// its predecessor is clamped (and counted) so the parts always add up to E2E
/// exactly.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Partition {
    pub frontend: Option<f64>,
    pub queue: Option<f64>,
    pub prefill: Option<f64>,
    pub first_output: Option<f64>,
    pub decode: Option<f64>,
    pub clamped: u32,
}

/// The engine-joined marks of a finished request, forced non-decreasing
/// inside [arrive, done]: arrive, submit, scheduled, first token (if the
/// engine produced one), ttft (if streamed), done; plus how many were clamped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Marks {
    pub arrive: u64,
    pub submit: u64,
    pub scheduled: u64,
    pub first_token: Option<u64>,
    pub ttft: Option<u64>,
    pub done: u64,
    pub clamped: u32,
}

/// A request closed before its response ended has its marks up to the close
/// ([`Request::waited_until_ns`]).
pub fn marks(r: &Request) -> Option<Marks> {
    let done = r.waited_until_ns()?;
    let e = r.engine.as_ref()?;
    let mut clamped = 0;
    let mut last = r.arrive_ns;
    let mut mark = |t: u64| {
        let t = if t < last {
            clamped += 1;
            last
        } else {
            t
        };
        let t = if t > done {
            clamped += 1;
            done
        } else {
            t
        };
        last = t;
        t
    };
    let submit = mark(e.submit_ns);
    let scheduled = mark(e.scheduled_ns.unwrap_or(e.submit_ns));
    let first_token = e.first_token_ns.map(&mut mark);
    let ttft = r.ttft_ns.map(&mut mark);
    Some(Marks { arrive: r.arrive_ns, submit, scheduled, first_token, ttft, done, clamped })
}

pub fn partition(r: &Request) -> Partition {
    if r.waited_until_ns().is_none() {
        return Partition::default();
    }
    let Some(m) = marks(r) else {
        // Wire only: decode is observable, the rest is not.
        return Partition { decode: r.decode_ms(), ..Partition::default() };
    };
    let span = |a: u64, b: u64| Some(ms(b - a));
    let mut p = Partition { frontend: span(m.arrive, m.submit), queue: span(m.submit, m.scheduled), ..Partition::default() };
    match (m.first_token, m.ttft) {
        (Some(f), Some(t)) => {
            p.prefill = span(m.scheduled, f);
            p.first_output = span(f, t);
            p.decode = span(t, m.done);
        }
        (Some(f), None) => {
            // Not streamed: the whole output leaves at the end.
            p.prefill = span(m.scheduled, f);
            p.decode = span(f, m.done);
        }
        (None, Some(t)) => {
            p.prefill = span(m.scheduled, t);
            p.decode = span(t, m.done);
        }
        (None, None) => p.prefill = span(m.scheduled, m.done),
    }
    p.clamped = m.clamped;
    p
}

/// The last output's path to the client (ms): from the end of the engine
/// step that carried the request's last output to `done` (detokenising, the
/// output IPC, the final write), as `first_output` is its first token's.
/// Part of decode, unless the first output was also the last (then it spans
/// first_output and decode). `null` for a request that did not end with its
/// response (closed early) or never joined. So `e2e − (frontend + queue +
/// prefill + kv_transfer) − last_output` is the engine's first → last output,
/// which vLLM's `request_decode_time` times.
pub fn last_output_ms(r: &Request) -> Option<f64> {
    let done = r.done_ns?;
    let m = marks(r)?;
    let last = r.engine.as_ref()?.last_output_ns?;
    // Inside [first token, done], as the marks are.
    let last = last.clamp(m.first_token.unwrap_or(m.scheduled), done);
    Some(ms(done - last))
}

/// The part of `first_output` in which the engine went on producing the
/// request's tokens while the client saw no content (ms): from the end of
/// the step that made its first token to the end of the last step with
/// its tokens that ended by the first content
/// ([`EnginePhases::first_content_output_ns`]). 0 when the first token's
/// text went straight out. The server held the text back (vLLM's
/// detokenizer keeps the last `len(longest stop string) − 1` characters of
/// a request with stop strings, and incomplete UTF-8; a reasoning or
/// tool-call parser waits for a whole tag), or its output path was slower
/// than a step (then one step, two tokens). The rest of `first_output` is
/// the content's own way out (the IPC, detokenizing, the write). `null`
/// without a first content or without the IPC.
pub fn first_output_held_ms(r: &Request) -> Option<f64> {
    first_output_held_span(r).map(|(a, b)| ms(b - a))
}

/// [`first_output_held_ms`]'s span, inside the first_output phase's marks.
pub fn first_output_held_span(r: &Request) -> Option<(u64, u64)> {
    let m = marks(r)?;
    let (first, ttft) = (m.first_token?, m.ttft?);
    let last = r.engine.as_ref()?.first_content_output_ns?;
    Some((first, last.clamp(first, ttft)))
}

/// The engine scheduler's own queue (ms): its QUEUED stamp (the engine loop
/// took the request in) to its first SCHEDULED, what vLLM's
/// `request_queue_time` times. The queue phase begins earlier, at the
/// hand-over to the engine: the rest of it is the way in (the IPC, the
/// engine's input thread, and the step the engine loop was running when the
/// request came, which vLLM's figure does not see). `null` without both
/// stamps (the engine logs no stats, or it never output). Inside the queue
/// phase's marks, as they are clamped; with a KV transfer carved out of the
/// queue it may exceed `phases_ms.queue` (the wait for remote KV is the
/// scheduler's).
pub fn scheduler_queue_ms(r: &Request) -> Option<f64> {
    scheduler_queue_span(r).map(|(a, b)| ms(b - a))
}

/// The part of [`scheduler_queue_ms`] in which the scheduler is known to
/// have skipped the request: from its QUEUED stamp to the latest scheduling
/// of a request that passed it ([`EnginePhases::passed_over_by`]); 0 when
/// none did. Null where `scheduler_queue_ms` is, or without the pass count.
pub fn scheduler_passed_over_ms(r: &Request) -> Option<f64> {
    passed_over_ms_in(r.engine.as_ref()?, scheduler_queue_span(r)?)
}

/// [`scheduler_passed_over_ms`] of engine phases `e` whose scheduler's
/// queue is `[a, b]` ([`scheduler_queue_span`]), for a caller that has the
/// span already.
pub fn passed_over_ms_in(e: &EnginePhases, (a, b): (u64, u64)) -> Option<f64> {
    e.passed_over_by?;
    Some(e.passed_over_until_ns.map_or(0.0, |u| ms(u.clamp(a, b) - a)))
}

/// The part of the scheduler's queue `[a, b]` ([`scheduler_queue_span`])
/// in which the scheduler skipped the request: `a` to the latest scheduling
/// of a request that passed it, when one did and after `a` (the span of
/// [`passed_over_ms_in`]; the trace's "passed over" slice, the OTLP
/// `scheduler_passed_over` span).
pub fn passed_over_span(e: &EnginePhases, (a, b): (u64, u64)) -> Option<(u64, u64)> {
    let until = e.passed_over_until_ns.filter(|_| e.passed_over_by.is_some_and(|n| n > 0))?;
    let end = until.min(b);
    (end > a).then_some((a, end))
}

/// When the grammar of a request asking for structured output is known to
/// have been ready, ms after its QUEUED stamp, clamped into its scheduler's
/// queue ([`scheduler_queue_span`]) `[a, b]`: a request asking for the same
/// constraint was scheduled then.
pub fn grammar_ready_ms_in(e: &EnginePhases, (a, b): (u64, u64)) -> Option<f64> {
    Some(ms(e.grammar_ready_by_ns?.clamp(a, b) - a))
}

/// [`scheduler_queue_ms`] as its interval: the QUEUED stamp (clamped into
/// the queue phase's marks) to the scheduled mark.
pub fn scheduler_queue_span(r: &Request) -> Option<(u64, u64)> {
    let m = marks(r)?;
    let e = r.engine.as_ref()?;
    let queued = e.queued_ns?;
    if e.scheduled_source != "event" {
        return None;
    }
    Some((queued.clamp(m.submit, m.scheduled), m.scheduled))
}

#[cfg(test)]
pub(crate) mod tests {
    use crate::correlate::{analyse, Analysis};
    use crate::event::{ConnKey, Dir};
    use crate::model::{EngineEvent, EngineOutput, HttpRole, Record, SseKind};

    const MS: u64 = 1_000_000;
    const IPC: ConnKey = ConnKey { tgid: 2, fd: 9, ino: 99 };

    #[test]
    fn rolling_median_is_the_upper_median_of_the_last_window_of_values() {
        let mut m = super::RollingMedian::default();
        assert_eq!(m.median(), None);
        // Repeats and a window that slides 3 times over: the kept sorted copy
        // must drop exactly the value that leaves.
        let vals: Vec<u64> = (0..3 * super::BASELINE_WINDOW as u64 + 7).map(|i| (i * 7919) % 613 + if i % 5 == 0 { 1000 } else { 0 }).collect();
        for (n, &v) in vals.iter().enumerate() {
            m.push(v);
            let mut w: Vec<u64> = vals[(n + 1).saturating_sub(super::BASELINE_WINDOW)..=n].to_vec();
            w.sort_unstable();
            assert_eq!(m.median(), Some(w[w.len() / 2]), "after {} values", n + 1);
            assert_eq!(m.sorted, w, "the sorted copy is the window's values, after {} values", n + 1);
        }
    }

    fn http(id: &str, fd: i32, at: u64) -> Vec<Record> {
        let conn = ConnKey { tgid: 1, fd, ino: fd as u64 };
        vec![
            Record::HttpRequest {
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
            },
            add(id, at + MS, 1, None),
        ]
    }

    /// The frontend's ADD of `id`, written at `at` by thread `tid`.
    fn add(id: &str, at: u64, tid: u32, arrival_time_s: Option<f64>) -> Record {
        Record::EngineRequest {
            conn: IPC,
            ts_ns: at,
            tid,
            dir: Dir::Out,
            request_id: format!("{id}-0123abcd"),
            external_req_id: Some(id.into()),
            prompt_tokens: Some(100),
            max_tokens: None,
            arrival_time_s,
            traceparent: None,
            data_parallel_rank: None,
            truncated: false,
        }
    }

    fn sse(id: &str, fd: i32, at: u64, kind: SseKind) -> Record {
        Record::Sse { conn: ConnKey { tgid: 1, fd, ino: fd as u64 }, seq: 0, ts_ns: at, kind, id: Some(id.into()), content_bytes: 1, finish_reason: None, usage: None }
    }

    fn end(fd: i32, at: u64) -> Record {
        Record::HttpResponseEnd { conn: ConnKey { tgid: 1, fd, ino: fd as u64 }, seq: 0, ts_ns: at, body_len: 1 }
    }

    fn step(at: u64, outs: &[(&str, bool, Option<u64>)]) -> Record {
        Record::EngineOutputs {
            conn: IPC,
            ts_ns: at + 100_000,
            tid: 3,
            dir: Dir::Out,
            engine_index: Some(0),
            timestamp_s: Some(at as f64 / 1e9),
            outputs: outs
                .iter()
                .map(|(id, _, sched)| EngineOutput {
                    request_id: format!("{id}-0123abcd"),
                    new_tokens: 1,
                    finish_reason: None,
                    events: sched.map(|t| vec![EngineEvent { kind: 2, timestamp_s: t as f64 / 1e9 }]).unwrap_or_default(),
                    prefill: None,
                })
                .collect(),
            outputs_total: Some(outs.len() as u64),
            finished_requests: vec![],
            truncated: false,
        }
    }

    fn close(fd: i32, at: u64) -> Record {
        Record::ConnClose { ts_ns: at, conn: ConnKey { tgid: 1, fd, ino: fd as u64 } }
    }

    /// The frontend's ABORT of `ids` at `at`.
    fn abort(ids: &[&str], at: u64) -> Record {
        Record::EngineAbort { conn: IPC, ts_ns: at, tid: 1, dir: Dir::Out, request_ids: ids.iter().map(|id| format!("{id}-0123abcd")).collect() }
    }

    /// A runs alone; B (fd 6) and C (fd 7) queue behind it and their clients
    /// leave together at 500 ms, before either was scheduled: neither HTTP
    /// request saw its id (vLLM writes it with the first token).
    fn two_clients_leave_while_queued() -> Vec<Record> {
        let mut recs = http("chatcmpl-a", 5, 0);
        recs.push(step(20 * MS, &[("chatcmpl-a", true, Some(2 * MS))]));
        recs.push(sse("chatcmpl-a", 5, 21 * MS, SseKind::Content));
        recs.extend(http("chatcmpl-b", 6, 30 * MS));
        recs.extend(http("chatcmpl-c", 7, 32 * MS));
        recs.push(close(7, 500 * MS));
        recs.push(close(6, 500 * MS + 100_000));
        // The frontend's event loop aborts C first.
        recs.push(abort(&["chatcmpl-c"], 501 * MS));
        recs.push(abort(&["chatcmpl-b"], 502 * MS));
        recs.push(step(600 * MS, &[("chatcmpl-a", false, None)]));
        recs.push(sse("chatcmpl-a", 5, 601 * MS, SseKind::Done));
        recs.push(end(5, 602 * MS));
        recs.sort_by_key(Record::ts_ns);
        recs
    }

    #[test]
    fn clients_that_leave_while_queued_take_their_aborted_engine_requests_in_submit_order() {
        let a = analyse(&two_clients_leave_while_queued());
        let by_fd = |fd: i32| a.requests.iter().find(|r| r.conn.fd == fd).unwrap();
        for (fd, id, arrive) in [(6, "chatcmpl-b", 30 * MS), (7, "chatcmpl-c", 32 * MS)] {
            let r = by_fd(fd);
            // The server never wrote its id: it is named by its engine request's.
            assert_eq!(r.id, id);
            let e = r.engine.as_ref().unwrap_or_else(|| panic!("{id} joined by its abort"));
            assert_eq!(e.engine_request_id, format!("{id}-0123abcd"));
            assert_eq!(e.scheduled_source, super::SCHEDULED_CLOSED);
            let p = super::partition(r);
            let closed = r.closed_ms().unwrap();
            assert_eq!((p.frontend, p.prefill, p.first_output, p.decode), (Some(1.0), Some(0.0), None, None));
            assert_eq!(p.queue, Some(closed - 1.0), "queued from its submit to the close");
            assert_eq!(r.closed_ns.unwrap() - arrive, (closed * 1e6).round() as u64);
        }
        assert!(by_fd(5).engine.is_some() && by_fd(5).closed_ns.is_none());
        for (k, n) in [("engine_requests_linked_by_abort", Some(&2)), ("requests_closed_unfinished", Some(&2)), ("engine_requests_unlinked", None)] {
            assert_eq!(a.drops.get(k), n, "{k}: {:?}", a.drops);
        }
    }

    #[test]
    fn a_first_content_held_back_counts_the_tokens_and_time_the_engine_made_before_it() {
        // A's text goes straight out; B's stream writes its role chunk and
        // empty chunks for the next 4 outputs (a stop string's hold-back),
        // its first content with the 6th; C's content leaves after its 2nd output has
        // ended (the frontend lagged a step). Steps end every 10 ms from 20.
        let mut recs = http("chatcmpl-a", 5, 0);
        recs.extend(http("chatcmpl-b", 6, MS / 2));
        recs.extend(http("chatcmpl-c", 7, MS));
        for k in 0..8u64 {
            let at = (20 + 10 * k) * MS;
            recs.push(step(at, &[("chatcmpl-a", true, Some(5 * MS)), ("chatcmpl-b", true, Some(5 * MS)), ("chatcmpl-c", true, Some(5 * MS))]));
            recs.push(sse("chatcmpl-a", 5, at + MS, SseKind::Content));
            recs.push(sse("chatcmpl-b", 6, at + MS, if k == 0 { SseKind::Role } else if k < 5 { SseKind::Other } else { SseKind::Content }));
            if k > 0 {
                recs.push(sse("chatcmpl-c", 7, at + 8 * MS, SseKind::Content));
            }
        }
        for (fd, at) in [(5, 100 * MS), (6, 100 * MS), (7, 120 * MS)] {
            recs.push(sse("x", fd, at, SseKind::Done));
            recs.push(end(fd, at + 1));
        }
        recs.sort_by_key(Record::ts_ns);
        let a = analyse(&recs);
        let get = |id: &str| a.requests.iter().find(|r| r.id == id).unwrap_or_else(|| panic!("{id}"));
        let figures = |id: &str| {
            let r = get(id);
            (r.engine.as_ref().and_then(|e| e.tokens_before_first_content), super::first_output_held_ms(r), super::partition(r).first_output)
        };
        // A: first token at 20 ms, content at 21: nothing held.
        assert_eq!(figures("chatcmpl-a"), (Some(1), Some(0.0), Some(1.0)));
        // B: outputs at 20…70 before its content at 71: 6 tokens, 50 ms held,
        // then 1 ms of the content's own way out.
        assert_eq!(figures("chatcmpl-b"), (Some(6), Some(50.0), Some(51.0)));
        // C: content at 38 after outputs at 20 and 30: one step behind.
        assert_eq!(figures("chatcmpl-c"), (Some(2), Some(10.0), Some(18.0)));
    }

    #[test]
    fn a_first_content_after_many_outputs_counts_every_one_and_none_after_it() {
        // The frontend holds everything back for 100 outputs (a parser
        // waiting for a whole call); 20 more come after its first content.
        let n = 100u64;
        let mut recs = http("chatcmpl-a", 5, 0);
        for k in 0..n + 20 {
            recs.push(step((20 + k) * MS, &[("chatcmpl-a", true, Some(5 * MS))]));
        }
        recs.push(sse("chatcmpl-a", 5, (20 + n) * MS - MS / 2, SseKind::Content));
        recs.push(sse("chatcmpl-a", 5, (21 + n + 20) * MS, SseKind::Done));
        recs.push(end(5, (22 + n + 20) * MS));
        recs.sort_by_key(Record::ts_ns);
        let a = analyse(&recs);
        let r = &a.requests[0];
        let e = r.engine.as_ref().expect("joined");
        assert_eq!((e.generated_tokens, e.tokens_before_first_content, super::first_output_held_ms(r)), (n + 20, Some(n), Some((n - 1) as f64)));
        assert_eq!(super::partition(r).first_output, Some(n as f64 - 0.5), "the phase stays whole");
    }

    #[test]
    fn an_abort_of_a_request_another_client_still_waits_for_is_not_taken_by_time() {
        // Q's client leaves during tokenization (no ADD of its own); A,
        // submitted meanwhile, is aborted by a stop string while its
        // response is still being written.
        let mut recs = vec![http("chatcmpl-q", 6, 0).remove(0)];
        recs.extend(http("chatcmpl-a", 5, 5 * MS));
        recs.push(step(20 * MS, &[("chatcmpl-a", true, Some(7 * MS))]));
        recs.push(sse("chatcmpl-a", 5, 21 * MS, SseKind::Content));
        recs.push(abort(&["chatcmpl-a"], 48 * MS));
        recs.push(close(6, 49 * MS));
        recs.push(sse("chatcmpl-a", 5, 59 * MS, SseKind::Done));
        recs.push(end(5, 60 * MS));
        recs.sort_by_key(Record::ts_ns);
        let a = analyse(&recs);
        let q = a.requests.iter().find(|r| r.conn.fd == 6).unwrap();
        assert!(q.engine.is_none() && q.closed_ns == Some(49 * MS));
        let ra = a.requests.iter().find(|r| r.id == "chatcmpl-a").unwrap();
        assert_eq!(ra.engine.as_ref().map(|e| e.engine_request_id.as_str()), Some("chatcmpl-a-0123abcd"));
        assert_eq!(a.drops.get("engine_requests_linked_by_abort"), None);
    }

    /// Q's client leaves at 300 ms while its request is still in the
    /// frontend (no ADD: the server never submits it, nor aborts it); B,
    /// submitted meanwhile and queued, is left by its client at 600 ms and
    /// aborted then. Q, handed out first, must not take B's abort, which
    /// lies within a second of Q's close too; clients leaving together
    /// still take theirs in submit order (the test above).
    #[test]
    fn a_client_that_leaves_before_its_request_reaches_the_engine_takes_no_later_leavers_abort() {
        let mut recs = http("chatcmpl-a", 5, 0);
        recs.push(step(20 * MS, &[("chatcmpl-a", true, Some(2 * MS))]));
        recs.push(sse("chatcmpl-a", 5, 21 * MS, SseKind::Content));
        recs.push(http("chatcmpl-q", 6, 30 * MS).remove(0));
        recs.extend(http("chatcmpl-b", 7, 40 * MS));
        recs.push(close(6, 300 * MS));
        recs.push(close(7, 600 * MS));
        recs.push(abort(&["chatcmpl-b"], 600 * MS + 300_000));
        recs.push(step(700 * MS, &[("chatcmpl-a", false, None)]));
        recs.push(sse("chatcmpl-a", 5, 701 * MS, SseKind::Done));
        recs.push(end(5, 702 * MS));
        recs.sort_by_key(Record::ts_ns);
        let a = analyse(&recs);
        let by_fd = |fd: i32| a.requests.iter().find(|r| r.conn.fd == fd).unwrap();
        let q = by_fd(6);
        assert!(q.engine.is_none(), "Q never reached the engine, yet took {:?}", q.engine.as_ref().map(|e| &e.engine_request_id));
        assert!(q.id.starts_with("conn:"), "{}", q.id);
        let b = by_fd(7);
        assert_eq!(b.engine.as_ref().map(|e| e.engine_request_id.as_str()), Some("chatcmpl-b-0123abcd"));
        assert_eq!(b.id, "chatcmpl-b");
        assert_eq!(a.drops.get("engine_requests_linked_by_abort"), Some(&1));
        // Closes 40 ms apart are within the margin: submit order decides, as
        // for clients leaving together (Q, handed out first, takes it).
        let mut recs: Vec<Record> = recs.into_iter().filter(|r| !matches!(r, Record::ConnClose { .. } | Record::EngineAbort { .. })).collect();
        recs.push(close(6, 560 * MS));
        recs.push(close(7, 600 * MS));
        recs.push(abort(&["chatcmpl-b"], 600 * MS + 300_000));
        recs.sort_by_key(Record::ts_ns);
        let a = analyse(&recs);
        assert!(a.requests.iter().find(|r| r.conn.fd == 6).unwrap().engine.is_some(), "within the margin the earlier arrival takes it");
    }

    #[test]
    fn an_abort_far_from_the_close_joins_nothing() {
        let mut recs = http("chatcmpl-q", 6, 0);
        recs.push(close(6, 100 * MS));
        recs.push(abort(&["chatcmpl-q"], 100 * MS + super::ABORT_NEAR_CLOSE_NS + 1));
        let a = analyse(&recs);
        assert!(a.requests[0].engine.is_none());
        assert_eq!(a.drops.get("engine_requests_unlinked"), Some(&1));
        // Its phases: none without the engine, none from the wire (no token).
        assert_eq!(super::partition(&a.requests[0]), super::Partition::default());
    }

    /// A decodes in 10 ms steps; B's prefill lands in A's 4th decode step,
    /// which takes 50 ms. On engine 0 (unsorted).
    fn a_decodes_and_b_prefills_in_its_fourth_step() -> Vec<Record> {
        let mut recs = http("chatcmpl-a", 5, 0);
        recs.push(step(20 * MS, &[("chatcmpl-a", true, Some(2 * MS))]));
        recs.push(sse("chatcmpl-a", 5, 21 * MS, SseKind::Content));
        recs.push(step(30 * MS, &[("chatcmpl-a", false, None)]));
        recs.push(step(40 * MS, &[("chatcmpl-a", false, None)]));
        recs.extend(http("chatcmpl-b", 6, 41 * MS));
        recs.push(step(50 * MS, &[("chatcmpl-a", false, None)]));
        recs.push(step(100 * MS, &[("chatcmpl-a", false, None), ("chatcmpl-b", true, Some(51 * MS))]));
        recs.push(step(110 * MS, &[("chatcmpl-a", false, None), ("chatcmpl-b", false, None)]));
        recs.push(sse("chatcmpl-a", 5, 111 * MS, SseKind::Done));
        recs.push(end(5, 112 * MS));
        recs.push(sse("chatcmpl-b", 6, 112 * MS, SseKind::Content));
        recs.push(end(6, 113 * MS));
        recs
    }

    /// [`a_decodes_and_b_prefills_in_its_fourth_step`]: A loses 40 ms to B.
    #[test]
    fn a_neighbours_prefill_in_a_decode_step_is_charged_as_interference_and_named() {
        let mut recs = a_decodes_and_b_prefills_in_its_fourth_step();
        recs.sort_by_key(Record::ts_ns);
        let a = analyse(&recs);
        let ra = a.requests.iter().find(|r| r.id == "chatcmpl-a").unwrap();
        let ea = ra.engine.as_ref().expect("A joined its engine request");
        assert_eq!(ea.interference_ns, 40 * MS);
        assert_eq!(ea.interference_from, vec![super::Name::from("chatcmpl-b")]);
        assert_eq!(ea.steps, 6);
        assert_eq!(ea.scheduled_source, "event");
        let rb = a.requests.iter().find(|r| r.id == "chatcmpl-b").unwrap();
        assert_eq!(rb.engine.as_ref().unwrap().interference_ns, 0, "B's own first step is prefill, not interference");
        let p = super::partition(ra);
        let sum = [p.frontend, p.queue, p.prefill, p.first_output, p.decode].iter().map(|x| x.unwrap()).sum::<f64>();
        assert!((sum - ra.e2e_ms().unwrap()).abs() < 1e-9, "{p:?}");
        assert_eq!((p.frontend, p.queue, p.prefill), (Some(1.0), Some(1.0), Some(18.0)));
    }

    /// The last output's path runs from the end of the step that carried a
    /// request's last output to its done (with several API servers, from its
    /// own part's build time, as its first token): E2E less it and the phases
    /// up to the first token is the engine's first → last output, vLLM's
    /// `request_decode_time`.
    #[test]
    fn the_last_outputs_path_runs_from_its_step_to_done_and_leaves_the_engines_decode() {
        let mut recs = a_decodes_and_b_prefills_in_its_fourth_step();
        recs.sort_by_key(Record::ts_ns);
        let whole = analyse(&recs);
        let parts = analyse(&read_by_servers(a_decodes_and_b_prefills_in_its_fourth_step(), true, |_| 3 * MS));
        // (request, analysis, last output, engine decode): A's last output
        // in the 110 ms step, [DONE] at 111; B's first token at 100 ms, its
        // last at 110, its response's end at 113 (4 µs later in its part).
        for (id, an, last, decode) in [("chatcmpl-a", &whole, 1.0, 90.0), ("chatcmpl-b", &whole, 3.0, 10.0), ("chatcmpl-a", &parts, 1.0, 90.0), ("chatcmpl-b", &parts, 2.996, 10.0)] {
            let r = an.requests.iter().find(|r| r.id == id).unwrap();
            let got = super::last_output_ms(r).unwrap_or_else(|| panic!("{id}: no last output"));
            assert!((got - last).abs() < 1e-9, "{id}: last output {got} ms, want {last}");
            let p = super::partition(r);
            let before: f64 = [p.frontend, p.queue, p.prefill].iter().map(|x| x.unwrap()).sum();
            let engine_decode = r.e2e_ms().unwrap() - before - got;
            assert!((engine_decode - decode).abs() < 1e-9, "{id}: the engine's first → last output {engine_decode} ms, want {decode}");
        }
        // Without its response's end (a client that left), none.
        let mut cut = a_decodes_and_b_prefills_in_its_fourth_step();
        cut.retain(|r| !matches!(r, Record::Sse { kind: SseKind::Done, .. } | Record::HttpResponseEnd { .. }));
        cut.push(Record::ConnClose { conn: ConnKey { tgid: 1, fd: 5, ino: 5 }, ts_ns: 115 * MS });
        cut.sort_by_key(Record::ts_ns);
        let an = analyse(&cut);
        let a = an.requests.iter().find(|r| r.id == "chatcmpl-a").unwrap();
        assert!(a.closed_early_ns().is_some() && super::last_output_ms(a).is_none(), "{a:?}");
    }

    /// vLLM times the queue from its QUEUED stamp, taken when the engine loop
    /// takes the request in: B, handed over at 42 ms while the engine ran a
    /// step to 50 ms, stamped QUEUED at 50.5 and SCHEDULED at 51, queued
    /// 9 ms of which 0.5 in the scheduler's queue.
    #[test]
    fn the_schedulers_queue_runs_from_the_engines_queued_stamp_and_leaves_the_way_in() {
        let with_queued = |queued_ns: Option<u64>| {
            let mut recs = a_decodes_and_b_prefills_in_its_fourth_step();
            for r in &mut recs {
                if let Record::EngineOutputs { outputs, .. } = r {
                    for o in outputs.iter_mut().filter(|o| o.request_id.starts_with("chatcmpl-b") && !o.events.is_empty()) {
                        if let Some(t) = queued_ns {
                            o.events.insert(0, EngineEvent { kind: 1, timestamp_s: t as f64 / 1e9 });
                        }
                    }
                }
            }
            recs.sort_by_key(Record::ts_ns);
            analyse(&recs)
        };
        // (QUEUED stamp, B's scheduler queue): one before the hand-over is
        // clamped to it, as the marks are.
        for (queued, want) in [(Some(50 * MS + MS / 2), Some(0.5)), (Some(40 * MS), Some(9.0)), (None, None)] {
            let an = with_queued(queued);
            let b = an.requests.iter().find(|r| r.id == "chatcmpl-b").unwrap();
            assert_eq!(super::partition(b).queue, Some(9.0), "the queue phase runs from the hand-over");
            let got = super::scheduler_queue_ms(b);
            assert!(got.zip(want).map_or(got == want, |(g, w)| (g - w).abs() < 1e-6), "QUEUED at {queued:?}: scheduler queue {got:?} ms, want {want:?}");
            let a = an.requests.iter().find(|r| r.id == "chatcmpl-a").unwrap();
            assert_eq!(super::scheduler_queue_ms(a), None, "A was stamped SCHEDULED but never QUEUED");
        }
    }

    /// One request's whole life on fd `fd`: it arrives at `arrive` (its ADD
    /// 1 ms later), is stamped QUEUED at `queued` and SCHEDULED at `sched`,
    /// its first (and last) token comes in the step ending at `first`.
    pub(crate) fn stamped(id: &str, fd: i32, arrive: u64, queued: u64, sched: u64, first: u64) -> Vec<Record> {
        let mut recs = http(id, fd, arrive);
        let mut out = step(first, &[(id, true, Some(sched))]);
        if let Record::EngineOutputs { outputs, .. } = &mut out {
            outputs[0].events.insert(0, EngineEvent { kind: 1, timestamp_s: queued as f64 / 1e9 });
            outputs[0].finish_reason = Some(0);
        }
        recs.push(out);
        recs.push(sse(id, fd, first + MS, SseKind::Content));
        recs.push(sse(id, fd, first + MS + 1000, SseKind::Done));
        recs.push(end(fd, first + 2 * MS));
        recs
    }

    /// J, queued at 2 ms, is skipped until 150 ms (its grammar): P and Q,
    /// queued after it, are scheduled first — Q at 40 ms, its long prefill
    /// outputting only after J's first token, so that pass is found when Q
    /// is seen. B (queued and scheduled before J) and L (queued and
    /// scheduled after it) passed nobody.
    #[test]
    fn requests_queued_later_and_scheduled_earlier_count_as_passing_the_earlier() {
        let mut recs = Vec::new();
        recs.extend(stamped("chatcmpl-b", 4, 0, MS + MS / 2, 3 * MS, 10 * MS));
        recs.extend(stamped("chatcmpl-j", 5, 0, 2 * MS, 150 * MS, 160 * MS));
        recs.extend(stamped("chatcmpl-p", 6, 10 * MS, 12 * MS, 20 * MS, 30 * MS));
        recs.extend(stamped("chatcmpl-q", 7, 20 * MS, 22 * MS, 40 * MS, 200 * MS));
        recs.extend(stamped("chatcmpl-l", 8, 98 * MS, 100 * MS, 170 * MS, 180 * MS));
        recs.sort_by_key(Record::ts_ns);
        let an = analyse(&recs);
        for (id, by, ms) in [("chatcmpl-b", 0, 0.0), ("chatcmpl-j", 2, 38.0), ("chatcmpl-p", 0, 0.0), ("chatcmpl-q", 0, 0.0), ("chatcmpl-l", 0, 0.0)] {
            let r = an.requests.iter().find(|r| r.id == id).unwrap_or_else(|| panic!("{id} reported"));
            let e = r.engine.as_ref().unwrap_or_else(|| panic!("{id} joined"));
            assert_eq!(e.passed_over_by, Some(by), "{id}: requests that went past it");
            let got = super::scheduler_passed_over_ms(r).unwrap_or_else(|| panic!("{id}: stamped"));
            assert!((got - ms).abs() < 1e-6, "{id}: skipped for {got} ms, want {ms}");
        }
        assert_eq!(an.drops.get("scheduler_passes_after_claim"), None, "J was still held when Q was seen");
        // Without QUEUED stamps there is no order to read.
        for r in &mut recs {
            if let Record::EngineOutputs { outputs, .. } = r {
                outputs.iter_mut().for_each(|o| o.events.retain(|e| e.kind != 1));
            }
        }
        let an = analyse(&recs);
        let j = an.requests.iter().find(|r| r.id == "chatcmpl-j").unwrap();
        assert_eq!((j.engine.as_ref().unwrap().passed_over_by, super::scheduler_passed_over_ms(j)), (None, None));
    }

    /// Under `--scheduling-policy priority` a request of higher priority (a
    /// lower value) goes first by right: H's pass of J proves nothing; P's
    /// (the same priority) and L's (a lower one) do.
    #[test]
    fn a_request_of_higher_priority_going_first_is_no_pass() {
        let mut recs = Vec::new();
        recs.extend(stamped("chatcmpl-j", 5, 0, 2 * MS, 150 * MS, 160 * MS));
        recs.extend(stamped("chatcmpl-h", 6, 10 * MS, 12 * MS, 20 * MS, 30 * MS));
        recs.extend(stamped("chatcmpl-p", 7, 20 * MS, 22 * MS, 40 * MS, 45 * MS));
        recs.extend(stamped("chatcmpl-l", 8, 28 * MS, 30 * MS, 50 * MS, 55 * MS));
        for (id, at, priority) in [("chatcmpl-h", 11 * MS, -1), ("chatcmpl-l", 29 * MS, 3)] {
            recs.push(Record::EnginePriority { conn: IPC, ts_ns: at, dir: Dir::Out, request_id: format!("{id}-0123abcd"), priority });
        }
        recs.sort_by_key(Record::ts_ns);
        let an = analyse(&recs);
        let j = an.requests.iter().find(|r| r.id == "chatcmpl-j").unwrap();
        assert_eq!(j.engine.as_ref().unwrap().passed_over_by, Some(2), "P and L, not H");
        assert!((super::scheduler_passed_over_ms(j).unwrap() - 48.0).abs() < 1e-6);
        // Each carries its ADD's priority; the default 0 is no figure.
        let priority = |id: &str| an.requests.iter().find(|r| r.id == id).and_then(|r| r.engine.as_ref()).and_then(|e| e.priority);
        assert_eq!([priority("chatcmpl-h"), priority("chatcmpl-l"), priority("chatcmpl-j")], [Some(-1), Some(3), None]);
        let h = an.requests.iter().find(|r| r.id == "chatcmpl-h").unwrap();
        assert_eq!(crate::sink::report::request_out(h).priority, Some(-1), "the report's");
    }

    /// J and K ask for one constraint, N for another: K, scheduled at 40 ms,
    /// says J's grammar (queued at 5) was ready by then, 35 ms after J was
    /// queued, whichever of the two is seen first (K's first output comes
    /// after J's when its prefill is long); M, queued after K was scheduled,
    /// had it at once; N learns nothing from them, nor K (the first of its
    /// constraint) from the others.
    #[test]
    fn a_request_of_the_same_constraint_scheduled_says_when_the_grammar_was_ready() {
        for k_first in [50 * MS, 300 * MS] {
            let mut recs = Vec::new();
            recs.extend(stamped("chatcmpl-k", 5, 0, 2 * MS, 40 * MS, k_first));
            recs.extend(stamped("chatcmpl-j", 6, 0, 5 * MS, 150 * MS, 160 * MS));
            recs.extend(stamped("chatcmpl-m", 7, 198 * MS, 200 * MS, 201 * MS, 210 * MS));
            recs.extend(stamped("chatcmpl-n", 8, 0, 6 * MS, 170 * MS, 180 * MS));
            for (id, at, key) in [("chatcmpl-k", MS, 7u64), ("chatcmpl-j", MS, 7), ("chatcmpl-m", 199 * MS, 7), ("chatcmpl-n", MS, 8)] {
                recs.push(Record::EngineConstraintKey { conn: IPC, ts_ns: at, dir: Dir::Out, request_id: format!("{id}-0123abcd"), key });
            }
            recs.sort_by_key(Record::ts_ns);
            let an = analyse(&recs);
            let ready = |id: &str| {
                let r = an.requests.iter().find(|r| r.id == id).unwrap_or_else(|| panic!("{id} reported"));
                let e = r.engine.as_ref().unwrap();
                super::grammar_ready_ms_in(e, super::scheduler_queue_span(r).unwrap())
            };
            let near = |got: Option<f64>, want: Option<f64>| got.zip(want).map_or(got == want, |(g, w)| (g - w).abs() < 1e-6);
            for (id, want) in [("chatcmpl-k", None), ("chatcmpl-j", Some(35.0)), ("chatcmpl-m", Some(0.0)), ("chatcmpl-n", None)] {
                assert!(near(ready(id), want), "K's first output at {k_first}: {id} ready at {:?} ms, want {want:?}", ready(id));
            }
            let j = an.requests.iter().find(|r| r.id == "chatcmpl-j").unwrap();
            assert!(near(crate::sink::report::request_out(j).scheduler_grammar_ready_ms, Some(35.0)), "the report's");
        }
    }

    /// A request that waits while 300 others are scheduled past it keeps
    /// every pass though the book is pruned as it grows (the wait holds
    /// what it needs), and the ones scheduled before it came are let go.
    #[test]
    fn a_long_wait_keeps_every_pass_while_the_book_is_pruned() {
        let mut recs = Vec::new();
        // Each on its own: ADD 1 ms after arrival, QUEUED 0.5 ms after it,
        // scheduled 0.1 ms later and done in 0.1 ms more.
        let quick = |id: String, fd: i32, at: u64| stamped(&id, fd, at, at + 1_500_000, at + 1_600_000, at + 1_700_000);
        for i in 0..100u64 {
            recs.extend(quick(format!("chatcmpl-early{i}"), 100 + i as i32, 3 * i * MS));
        }
        recs.extend(stamped("chatcmpl-j", 5, 310 * MS, 311 * MS + MS / 2, 2000 * MS, 2005 * MS));
        for i in 0..300u64 {
            recs.extend(quick(format!("chatcmpl-p{i}"), 1000 + i as i32, 312 * MS + 3 * i * MS));
        }
        recs.sort_by_key(Record::ts_ns);
        let an = analyse(&recs);
        let j = an.requests.iter().find(|r| r.id == "chatcmpl-j").unwrap();
        assert_eq!(j.engine.as_ref().unwrap().passed_over_by, Some(300));
        let got = super::scheduler_passed_over_ms(j).unwrap();
        let want = (312.0 + 3.0 * 299.0 + 1.6) - 311.5;
        assert!((got - want).abs() < 1e-6, "skipped until the last pass: {got} ms, want {want}");
        assert!(an.requests.iter().filter(|r| r.id != "chatcmpl-j").all(|r| r.engine.as_ref().unwrap().passed_over_by == Some(0)));
        assert_eq!(an.drops.get("scheduler_pass_book_full"), None);
    }

    /// The ADD's structured-output record gives its request the kind and
    /// backend; a request without one has none; unknown kinds read `other`.
    #[test]
    fn a_structured_output_record_marks_its_engine_request_only() {
        for (kind, backend, want) in [("json", Some("xgrammar"), "json"), ("lark", None, "other")] {
            let mut recs = a_decodes_and_b_prefills_in_its_fourth_step();
            let at = recs.iter().find_map(|r| match r {
                Record::EngineRequest { ts_ns, request_id, .. } if request_id.starts_with("chatcmpl-b") => Some(*ts_ns),
                _ => None,
            });
            let at = at.expect("B's ADD");
            recs.push(Record::EngineStructuredOutput { conn: IPC, ts_ns: at, dir: Dir::Out, request_id: "chatcmpl-b-0123abcd".into(), kind: kind.into(), backend: backend.map(Into::into) });
            recs.sort_by_key(Record::ts_ns);
            let an = analyse(&recs);
            let engine = |id: &str| an.requests.iter().find(|r| r.id == id).and_then(|r| r.engine.clone()).unwrap_or_else(|| panic!("{id} joined"));
            let b = engine("chatcmpl-b").structured.expect("B asked for structured output");
            assert_eq!((b.kind, b.backend.as_deref()), (want, backend));
            assert_eq!(engine("chatcmpl-a").structured, None, "A asked for none");
        }
    }

    /// An ADD's side records whose request record is gone (lost before the
    /// correlator) make no engine request of their own: counted, dropped.
    #[test]
    fn side_records_without_their_adds_request_record_are_counted_not_made_requests() {
        let mut recs = a_decodes_and_b_prefills_in_its_fourth_step();
        let whole = analyse(&recs);
        recs.retain(|r| !matches!(r, Record::EngineRequest { request_id, .. } if request_id.starts_with("chatcmpl-b")));
        let without = analyse(&recs);
        let at = recs.iter().map(Record::ts_ns).max().unwrap_or(0) / 2;
        let id = || "chatcmpl-b-0123abcd".to_owned();
        recs.push(Record::EngineStructuredOutput { conn: IPC, ts_ns: at, dir: Dir::Out, request_id: id(), kind: "json".into(), backend: None });
        recs.push(Record::EnginePriority { conn: IPC, ts_ns: at, dir: Dir::Out, request_id: id(), priority: 3 });
        recs.push(Record::EngineConstraintKey { conn: IPC, ts_ns: at, dir: Dir::Out, request_id: id(), key: 7 });
        recs.sort_by_key(Record::ts_ns);
        let an = analyse(&recs);
        assert_eq!(an.drops.get("engine_side_records_orphaned"), Some(&3));
        let engines = |a: &Analysis| a.requests.iter().map(|r| r.engine.as_ref().map(|e| (e.structured.clone(), e.priority))).collect::<Vec<_>>();
        assert_eq!(engines(&an), engines(&without), "nothing of them reaches a request");
        assert_eq!(whole.drops.get("engine_side_records_orphaned"), None);
    }

    /// What two API server processes read of `recs`' steps with no engine
    /// traced: B's requests (`chatcmpl-b`) on the second server when `split`
    /// (else all on the first), each part of a step built 4 µs after the one
    /// before; the second server reads `lag(send)` after the send.
    fn read_by_servers(recs: Vec<Record>, split: bool, lag: impl Fn(u64) -> u64) -> Vec<Record> {
        let servers = [ConnKey { tgid: 40, fd: 20, ino: 400 }, ConnKey { tgid: 41, fd: 21, ino: 410 }];
        let mut out = Vec::new();
        for r in recs {
            let Record::EngineOutputs { ts_ns, timestamp_s, outputs, .. } = &r else {
                out.push(r);
                continue;
            };
            let server = |o: &EngineOutput| usize::from(split && o.request_id.starts_with("chatcmpl-b"));
            let mut k = 0;
            for (s, reader) in servers.iter().enumerate() {
                let part: Vec<EngineOutput> = outputs.iter().filter(|o| server(o) == s).cloned().collect();
                if part.is_empty() {
                    continue;
                }
                let mut p = r.clone();
                if let Record::EngineOutputs { conn, dir, ts_ns: t, timestamp_s: b, outputs, outputs_total, .. } = &mut p {
                    let read = if s == 0 { *ts_ns } else { ts_ns + lag(*ts_ns) };
                    (*conn, *dir, *t, *outputs_total) = (*reader, Dir::In, read, Some(part.len() as u64));
                    *b = timestamp_s.map(|t| t + 4e-6 * f64::from(k));
                    *outputs = part;
                }
                out.push(p);
                k += 1;
            }
        }
        out.sort_by_key(Record::ts_ns);
        out
    }

    /// Each request's engine steps and interference in `parts` are those of `whole`.
    fn same_engine_figures(whole: &mut Analysis, parts: &mut Analysis) {
        assert_eq!(parts.steps.len(), whole.steps.len(), "one step per step");
        for a in [&mut *whole, &mut *parts] {
            a.requests.sort_by(|x, y| x.id.cmp(&y.id));
        }
        for (w, p) in whole.requests.iter().zip(&parts.requests) {
            let (we, pe) = (w.engine.as_ref().unwrap(), p.engine.as_ref().unwrap());
            assert_eq!((pe.steps, pe.interference_ns, &pe.interference_from), (we.steps, we.interference_ns, &we.interference_from), "{}", w.id);
        }
    }

    /// No engine traced: only each API server's copies of the outputs. With
    /// two API servers a step whose requests came from both is read as two
    /// messages, one per server process (built µs apart, read ms apart):
    /// they are one step, as when one server reads the whole step.
    #[test]
    fn with_no_engine_traced_the_api_servers_parts_of_a_step_are_one_step() {
        let mut whole = analyse(&read_by_servers(a_decodes_and_b_prefills_in_its_fourth_step(), false, |_| 3 * MS));
        let mut parts = analyse(&read_by_servers(a_decodes_and_b_prefills_in_its_fourth_step(), true, |_| 3 * MS));
        assert_eq!(parts.drops.get("engine_reader_outputs_joined"), Some(&2), "{:?}", parts.drops);
        assert_eq!(whole.drops.get("engine_reader_outputs_joined"), None);
        same_engine_figures(&mut whole, &mut parts);
        let a = parts.requests.iter().find(|r| r.id == "chatcmpl-a").unwrap();
        assert_eq!(a.engine.as_ref().unwrap().interference_ns, 40 * MS, "A still loses 40 ms to B's prefill");
        // B's first token: when its own server's part was built (4 µs after
        // A's), the time vLLM's API server measures its prefill to.
        let first = |an: &Analysis| an.requests.iter().find(|r| r.id == "chatcmpl-b").unwrap().engine.as_ref().unwrap().first_token_ns.unwrap();
        assert_eq!(first(&parts), first(&whole) + 4_000);
    }

    /// Each API server reads in its own time: the second server read its
    /// part of a step with only its request in it (B's prefill, built at
    /// 30 ms) after the first read its part of the next step (40 ms). The
    /// engine's steps still go on in the order it built them.
    #[test]
    fn with_no_engine_traced_a_step_read_after_the_next_ones_part_still_goes_first() {
        let mut recs = http("chatcmpl-a", 5, 0);
        recs.extend(http("chatcmpl-b", 6, 2 * MS));
        recs.push(step(20 * MS, &[("chatcmpl-a", true, Some(2 * MS))]));
        recs.push(sse("chatcmpl-a", 5, 21 * MS, SseKind::Content));
        recs.push(step(30 * MS, &[("chatcmpl-b", true, Some(21 * MS))]));
        recs.push(step(40 * MS, &[("chatcmpl-a", false, None), ("chatcmpl-b", false, None)]));
        recs.push(sse("chatcmpl-a", 5, 41 * MS, SseKind::Content));
        recs.push(sse("chatcmpl-b", 6, 43 * MS, SseKind::Content));
        recs.push(step(50 * MS, &[("chatcmpl-a", false, None), ("chatcmpl-b", false, None)]));
        recs.push(sse("chatcmpl-a", 5, 51 * MS, SseKind::Done));
        recs.push(end(5, 52 * MS));
        recs.push(sse("chatcmpl-b", 6, 54 * MS, SseKind::Done));
        recs.push(end(6, 55 * MS));
        let late = |sent: u64| if sent == 30 * MS + 100_000 { 12 * MS } else { 3 * MS };
        let split = read_by_servers(recs.clone(), true, late);
        let reads: Vec<(u64, u64)> = split
            .iter()
            .filter_map(|r| match r {
                Record::EngineOutputs { ts_ns, timestamp_s: Some(b), .. } => Some(((b * 1e3).round() as u64, *ts_ns)),
                _ => None,
            })
            .collect();
        assert_eq!(reads.iter().map(|r| r.0).collect::<Vec<_>>(), [20, 40, 30, 40, 50, 50], "the case: a step read after the next one's first part");
        let mut whole = analyse(&read_by_servers(recs.clone(), false, late));
        let mut parts = analyse(&split);
        assert_eq!(parts.drops.get("engine_reader_outputs_joined"), Some(&2), "{:?}", parts.drops);
        let ends: Vec<u64> = parts.steps.iter().map(|s| s.end_ns / MS).collect();
        assert_eq!(ends, [20, 30, 40, 50], "steps in build order");
        same_engine_figures(&mut whole, &mut parts);
    }

    /// No engine traced, two API servers: A's step (built at 20 ms) and B's
    /// (built 400 µs later), each of one server's requests only, as a fast
    /// GPU's decode steps can be. Each carries scheduler stats, which vLLM
    /// sends to one client a step: two steps. The second without stats is
    /// a part of the first's step.
    #[test]
    fn with_no_engine_traced_two_copies_that_both_carry_stats_are_two_steps() {
        let run = |second_has_stats: bool| {
            let mut recs = http("chatcmpl-a", 5, 0);
            recs.extend(http("chatcmpl-b", 6, MS));
            recs.push(step(10 * MS, &[("chatcmpl-a", true, Some(2 * MS)), ("chatcmpl-b", true, Some(2 * MS))]));
            recs.push(step(20 * MS, &[("chatcmpl-a", false, None)]));
            recs.push(step(20 * MS + 400_000, &[("chatcmpl-b", false, None)]));
            recs.push(sse("chatcmpl-a", 5, 21 * MS, SseKind::Done));
            recs.push(end(5, 22 * MS));
            recs.push(sse("chatcmpl-b", 6, 22 * MS, SseKind::Done));
            recs.push(end(6, 23 * MS));
            let mut split = Vec::new();
            for r in read_by_servers(recs, true, |_| 3 * MS) {
                // The first server's parts carry their steps' stats, and
                // the second's B-only step its own when `second_has_stats`.
                if let Record::EngineOutputs { conn, ts_ns, timestamp_s: Some(b), .. } = &r {
                    let b_only = (b * 1e6).round() as u64 == 20_400;
                    if conn.tgid == 40 || (b_only && second_has_stats) {
                        split.push(crate::testutil::engine_stats(*conn, *ts_ns));
                    }
                }
                split.push(r);
            }
            analyse(&split)
        };
        let two = run(true);
        let ends: Vec<u64> = two.steps.iter().map(|s| s.end_ns / 100_000).collect();
        assert_eq!(ends, [100, 200, 204], "three steps: {:?}", two.drops);
        assert_eq!(two.drops.get("engine_reader_outputs_joined"), Some(&1), "only the first step's parts: {:?}", two.drops);
        let one = run(false);
        assert_eq!(one.steps.len(), 2, "{:?}", one.drops);
        assert_eq!(one.drops.get("engine_reader_outputs_joined"), Some(&2), "{:?}", one.drops);
    }

    /// [`step`] of data-parallel engine `index` (its own process and socket).
    fn step_of(index: u64, at: u64, outs: &[(&str, bool, Option<u64>)]) -> Record {
        let mut r = step(at, outs);
        if let Record::EngineOutputs { engine_index, conn, .. } = &mut r {
            *engine_index = Some(index);
            conn.tgid += index as u32 * 100;
        }
        r
    }

    /// Data parallelism: engine 0 runs A then B
    /// ([`a_decodes_and_b_prefills_in_its_fourth_step`]);
    /// engine 1 decodes C in 10 ms steps of its own, 5 ms out of phase, with
    /// its outputs interleaved on the same frontend (D, not traced from its
    /// start, decodes there before C). Each engine's steps are
    /// timed from its own previous step: A still loses 40 ms to B, C nothing,
    /// and C's first step is scheduled when engine 1's previous one ended.
    #[test]
    fn data_parallel_engines_steps_are_timed_against_their_own_previous_step() {
        let mut recs = a_decodes_and_b_prefills_in_its_fourth_step();
        recs.extend(http("chatcmpl-c", 7, 0));
        recs.push(step_of(1, 15 * MS, &[("chatcmpl-d", false, None)]));
        recs.push(step_of(1, 25 * MS, &[("chatcmpl-c", true, None)]));
        recs.push(sse("chatcmpl-c", 7, 26 * MS, SseKind::Content));
        for k in 0..9 {
            recs.push(step_of(1, 35 * MS + k * 10 * MS, &[("chatcmpl-c", false, None)]));
        }
        recs.push(sse("chatcmpl-c", 7, 116 * MS, SseKind::Done));
        recs.push(end(7, 117 * MS));
        recs.sort_by_key(Record::ts_ns);
        let a = analyse(&recs);
        let eng = |id: &str| a.requests.iter().find(|r| r.id == id).and_then(|r| r.engine.clone()).unwrap_or_else(|| panic!("{id} joined its engine request"));
        let (ea, ec) = (eng("chatcmpl-a"), eng("chatcmpl-c"));
        assert_eq!((ea.interference_ns, ea.interference_from.clone()), (40 * MS, vec![super::Name::from("chatcmpl-b")]));
        assert_eq!(ea.steps, 6);
        assert_eq!((ec.interference_ns, ec.steps), (0, 10), "engine 0's prefill of B is not C's step");
        assert_eq!((ec.scheduled_ns, ec.scheduled_source), (Some(15 * MS), "step"), "C's first step began when engine 1's step before it ended");
        assert_eq!((ea.engine_index, ec.engine_index), (Some(0), Some(1)));
    }

    /// Each request answered: its first content chunk at `at` on connection
    /// `fd`, `[DONE]` 1 ms later, the response's end 1 ms after that.
    fn answered(recs: &mut Vec<Record>, reqs: &[(&str, i32, u64)]) {
        for &(id, fd, at) in reqs {
            recs.push(sse(id, fd, at, SseKind::Content));
            recs.push(sse(id, fd, at + MS, SseKind::Done));
            recs.push(end(fd, at + 2 * MS));
        }
    }

    /// The records, in time order, through the correlator: by HTTP request
    /// id, its submit and where it came from (panics for one not joined to
    /// its engine request).
    fn submits(mut recs: Vec<Record>) -> impl Fn(&str) -> (u64, &'static str) {
        recs.sort_by_key(Record::ts_ns);
        let by_id: std::collections::HashMap<String, (u64, &'static str)> =
            analyse(&recs).requests.into_iter().filter_map(|r| r.engine.map(|e| (r.id, (e.submit_ns, e.submit_source)))).collect();
        move |id| *by_id.get(id).unwrap_or_else(|| panic!("{id} joined"))
    }

    /// ZMQ's I/O thread (tid 7) is woken by A's send at 1.5 ms but gets a
    /// CPU only at 5 ms; B and D were sent meanwhile and all three leave in
    /// one write at 5.1 ms. A owns the wake-up; B is placed by how much
    /// later its arrival_time is; D has none and keeps the write. E leaves
    /// in a later write the thread was not woken for (it was awake): placed
    /// from A's wake-up too. F comes more than a second after the last
    /// wake-up seen, past what the wall clock is trusted for: the write.
    #[test]
    fn adds_that_share_a_write_are_placed_after_its_wake_up_by_arrival_time() {
        let add = |id: &str, at: u64, arrival_time_s: Option<f64>| add(id, at, 7, arrival_time_s);
        let t0 = 1_796_127_787.051_362_5;
        let mut recs = Vec::new();
        for (id, fd, at) in [("chatcmpl-a", 5, MS), ("chatcmpl-b", 6, MS + MS / 2), ("chatcmpl-d", 8, 2 * MS), ("chatcmpl-e", 9, 30 * MS), ("chatcmpl-f", 10, 1100 * MS)] {
            recs.push(http(id, fd, at).remove(0));
        }
        recs.push(Record::OffCpu { ts_ns: 5 * MS, tgid: 2, tid: 7, off_ns: 0, wake_ns: Some(3 * MS / 2), prev_state: 1 });
        recs.push(Record::UnixIo { conn: IPC, ts_ns: 5 * MS + MS / 10, enter_ns: 5 * MS, tid: 7, dir: Dir::Out, len: 3000 });
        recs.push(add("chatcmpl-a", 5 * MS + MS / 10, Some(t0)));
        recs.push(add("chatcmpl-b", 5 * MS + MS / 10, Some(t0 + 0.0008)));
        recs.push(add("chatcmpl-d", 5 * MS + MS / 10, None));
        recs.push(Record::UnixIo { conn: IPC, ts_ns: 32 * MS, enter_ns: 32 * MS, tid: 7, dir: Dir::Out, len: 1000 });
        recs.push(add("chatcmpl-e", 32 * MS, Some(t0 + 0.03)));
        recs.push(Record::UnixIo { conn: IPC, ts_ns: 1102 * MS, enter_ns: 1102 * MS, tid: 7, dir: Dir::Out, len: 1000 });
        recs.push(add("chatcmpl-f", 1102 * MS, Some(t0 + 1.1)));
        let all = [("chatcmpl-a", true, Some(10 * MS)), ("chatcmpl-b", true, Some(10 * MS)), ("chatcmpl-d", true, Some(10 * MS)), ("chatcmpl-e", true, Some(33 * MS))];
        recs.push(step(40 * MS, &all));
        recs.push(step(1110 * MS, &[("chatcmpl-f", true, Some(1103 * MS))]));
        answered(&mut recs, &[("chatcmpl-a", 5, 41 * MS), ("chatcmpl-b", 6, 41 * MS), ("chatcmpl-d", 8, 41 * MS), ("chatcmpl-e", 9, 41 * MS), ("chatcmpl-f", 10, 1111 * MS)]);
        let got = submits(recs);
        assert_eq!(got("chatcmpl-a"), (3 * MS / 2, super::SUBMIT_WAKE));
        // arrival_time is a float of seconds since 1970: a quarter µs apart.
        let (b, source) = got("chatcmpl-b");
        assert_eq!(source, super::SUBMIT_ARRIVAL);
        assert!(b.abs_diff(3 * MS / 2 + 800_000) < 1_000, "B 0.8 ms after A's wake-up: {b}");
        assert_eq!(got("chatcmpl-d"), (5 * MS + MS / 10, super::SUBMIT_WRITE));
        let (e, source) = got("chatcmpl-e");
        assert_eq!(source, super::SUBMIT_ARRIVAL, "a write the thread was awake for");
        assert!(e.abs_diff(3 * MS / 2 + 30 * MS) < 1_000, "E 30 ms after A's wake-up: {e}");
        assert_eq!(got("chatcmpl-f"), (1102 * MS, super::SUBMIT_WRITE), "over a second after the last wake-up seen: the write");
    }

    /// The recording's first ADD, A, leaves in a write whose wake-up is not
    /// trusted (the I/O thread wrote 3.6 ms after the switch-in hopscope
    /// saw: short preemptions are not recorded, a stopped vCPU shows as
    /// nothing) and nothing earlier places it. B's send wakes the
    /// thread 20 ms later: A is placed from B's wake-up by how much earlier
    /// it was built, not left at its write with the I/O thread's delay in
    /// the frontend. C and D leave while the thread was awake, over a second
    /// after B's wake-up: C, more than a second before the next anchor (E's),
    /// keeps its write; so does D, whom E's wake-up would place before its
    /// HTTP request arrived.
    #[test]
    fn an_add_nothing_before_it_places_is_placed_by_the_next_wake_up() {
        const US: u64 = 1_000;
        let add = |id: &str, at: u64, arrival_time_s: Option<f64>| add(id, at, 7, arrival_time_s);
        let t0 = 1_796_127_787.051_362_5;
        let mut recs = Vec::new();
        for (id, fd, at) in [("chatcmpl-a", 5, MS), ("chatcmpl-b", 6, 20 * MS), ("chatcmpl-c", 8, 1029 * MS), ("chatcmpl-d", 9, 2039 * MS), ("chatcmpl-e", 10, 2040 * MS)] {
            recs.push(http(id, fd, at).remove(0));
        }
        // A: the thread was woken at 1.5 ms, switched in at 1.6 ms, wrote at 5.2 ms.
        recs.push(Record::OffCpu { ts_ns: 1600 * US, tgid: 2, tid: 7, off_ns: 0, wake_ns: Some(1500 * US), prev_state: 1 });
        recs.push(Record::UnixIo { conn: IPC, ts_ns: 5200 * US, enter_ns: 5200 * US, tid: 7, dir: Dir::Out, len: 1000 });
        recs.push(add("chatcmpl-a", 5200 * US, Some(t0)));
        recs.push(Record::OffCpu { ts_ns: 21800 * US, tgid: 2, tid: 7, off_ns: 5300 * US, wake_ns: Some(21500 * US), prev_state: 1 });
        recs.push(Record::UnixIo { conn: IPC, ts_ns: 21900 * US, enter_ns: 21900 * US, tid: 7, dir: Dir::Out, len: 1000 });
        recs.push(add("chatcmpl-b", 21900 * US, Some(t0 + 0.02)));
        // C and D: written while the thread was awake, over a second after B's wake-up.
        recs.push(Record::UnixIo { conn: IPC, ts_ns: 1030 * MS, enter_ns: 1030 * MS, tid: 7, dir: Dir::Out, len: 1000 });
        recs.push(add("chatcmpl-c", 1030 * MS, Some(t0 + 1.0285)));
        recs.push(Record::UnixIo { conn: IPC, ts_ns: 2040 * MS, enter_ns: 2040 * MS, tid: 7, dir: Dir::Out, len: 1000 });
        recs.push(add("chatcmpl-d", 2040 * MS, Some(t0 + 2.0)));
        recs.push(Record::OffCpu { ts_ns: 2041 * MS + 100 * US, tgid: 2, tid: 7, off_ns: 2040 * MS + 100 * US, wake_ns: Some(2041 * MS), prev_state: 1 });
        recs.push(Record::UnixIo { conn: IPC, ts_ns: 2041 * MS + 200 * US, enter_ns: 2041 * MS + 200 * US, tid: 7, dir: Dir::Out, len: 1000 });
        recs.push(add("chatcmpl-e", 2041 * MS + 200 * US, Some(t0 + 2.0395)));
        recs.push(step(40 * MS, &[("chatcmpl-a", true, Some(39 * MS)), ("chatcmpl-b", true, Some(39 * MS))]));
        recs.push(step(1035 * MS, &[("chatcmpl-c", true, Some(1034 * MS))]));
        recs.push(step(2050 * MS, &[("chatcmpl-d", true, Some(2049 * MS)), ("chatcmpl-e", true, Some(2049 * MS))]));
        answered(&mut recs, &[("chatcmpl-a", 5, 41 * MS), ("chatcmpl-b", 6, 41 * MS), ("chatcmpl-c", 8, 2045 * MS), ("chatcmpl-d", 9, 2051 * MS), ("chatcmpl-e", 10, 2051 * MS)]);
        let got = submits(recs);
        let (at, source) = got("chatcmpl-a");
        assert_eq!(source, super::SUBMIT_ARRIVAL, "placed by B's wake-up");
        assert!(at.abs_diff(1500 * US) < 1_000, "A built 20 ms before B, whose send woke the thread at 21.5 ms: {at}");
        assert_eq!(got("chatcmpl-b"), (21500 * US, super::SUBMIT_WAKE));
        assert_eq!(got("chatcmpl-c"), (1030 * MS, super::SUBMIT_WRITE), "the next wake-up is over a second after the write");
        assert_eq!(got("chatcmpl-d"), (2040 * MS, super::SUBMIT_WRITE), "placed before its HTTP request arrived: the write");
        assert_eq!(got("chatcmpl-e"), (2041 * MS, super::SUBMIT_WAKE));
    }

    /// The I/O thread slept 0.4 ms before A's send woke it (too short for an
    /// off-CPU record: the last one seen is a sleep that ended 8 ms earlier),
    /// then wrote 3 ms after its switch-in. The write's own word from the
    /// kernel (`WokenWrite`) gives A's wake-up; without it the stale burst
    /// is too old to trust and A keeps its write. B's write says the thread
    /// woke to read first (its read came after the switch-in): not B's
    /// hand-over, so B is placed from A's anchor instead.
    #[test]
    fn a_write_the_kernel_says_came_after_a_short_sleep_is_timed_from_that_wake_up() {
        const US: u64 = 1_000;
        let run = |told: bool| {
            let add = |id: &str, at: u64, arrival_time_s: Option<f64>| add(id, at, 7, arrival_time_s);
            let t0 = 1_796_127_787.051_362_5;
            let mut recs = Vec::new();
            for (id, fd, at) in [("chatcmpl-a", 5, 9 * MS), ("chatcmpl-b", 6, 19 * MS)] {
                recs.push(http(id, fd, at).remove(0));
            }
            recs.push(Record::OffCpu { ts_ns: 2 * MS, tgid: 2, tid: 7, off_ns: 0, wake_ns: Some(MS), prev_state: 1 });
            recs.push(Record::UnixIo { conn: IPC, ts_ns: 2 * MS + 50 * US, enter_ns: 2 * MS, tid: 7, dir: Dir::In, len: 100 });
            if told {
                recs.push(Record::WokenWrite { ts_ns: 13 * MS, tgid: 2, tid: 7, wake_ns: 9900 * US, on_ns: 10 * MS });
            }
            recs.push(Record::UnixIo { conn: IPC, ts_ns: 13 * MS, enter_ns: 13 * MS, tid: 7, dir: Dir::Out, len: 1000 });
            recs.push(add("chatcmpl-a", 13 * MS, Some(t0)));
            // B: woken at 20 ms, read at 20.2 ms, then wrote B.
            recs.push(Record::UnixIo { conn: IPC, ts_ns: 20200 * US, enter_ns: 20200 * US, tid: 7, dir: Dir::In, len: 100 });
            if told {
                recs.push(Record::WokenWrite { ts_ns: 20300 * US, tgid: 2, tid: 7, wake_ns: 20 * MS, on_ns: 20100 * US });
            }
            recs.push(Record::UnixIo { conn: IPC, ts_ns: 20300 * US, enter_ns: 20300 * US, tid: 7, dir: Dir::Out, len: 1000 });
            recs.push(add("chatcmpl-b", 20300 * US, Some(t0 + 0.0101)));
            recs.push(step(30 * MS, &[("chatcmpl-a", true, Some(29 * MS)), ("chatcmpl-b", true, Some(29 * MS))]));
            answered(&mut recs, &[("chatcmpl-a", 5, 31 * MS), ("chatcmpl-b", 6, 31 * MS)]);
            let got = submits(recs);
            (got("chatcmpl-a"), got("chatcmpl-b"))
        };
        let ((a, a_source), (b, b_source)) = run(true);
        assert_eq!((a, a_source), (9900 * US, super::SUBMIT_WAKE), "the wake-up the write came after");
        assert_eq!(b_source, super::SUBMIT_ARRIVAL, "woken to read: not B's hand-over");
        assert!(b.abs_diff(20 * MS) < 1_000, "B built 10.1 ms after A, placed from A's wake-up: {b}");
        let ((a, a_source), _) = run(false);
        assert_eq!((a, a_source), (13 * MS, super::SUBMIT_WRITE), "without the kernel's word the burst seen is 11 ms old");
    }

    /// libzmq writes an ADD longer than its 8 KiB batch in two syscalls.
    /// B's send woke the I/O thread at 4 ms; the batch at 5.1 ms carried
    /// B's start, the rest left at 5.2 ms. B's hand-over is that wake-up,
    /// though the write that completed it was not the thread's first I/O
    /// since. C began in the batch that also carried D whole: D owns that
    /// wake-up, C is placed by its arrival_time. Without the record of
    /// where B began (recordings before format 4) B is placed by its
    /// arrival_time too.
    #[test]
    fn an_add_written_in_several_syscalls_is_handed_over_when_its_first_write_woke() {
        const US: u64 = 1_000;
        let run = |started: bool| {
            let add = |id: &str, at: u64, arrival_time_s: Option<f64>| add(id, at, 7, arrival_time_s);
            let t0 = 1_796_127_787.051_362_5;
            let mut recs = Vec::new();
            for (id, fd, at) in [("chatcmpl-a", 5, MS), ("chatcmpl-b", 6, 3 * MS), ("chatcmpl-d", 8, 19 * MS), ("chatcmpl-c", 9, 19 * MS)] {
                recs.push(http(id, fd, at).remove(0));
            }
            let write = |recs: &mut Vec<Record>, at: u64, wake_ns: u64, on_ns: u64, len: u64| {
                recs.push(Record::WokenWrite { ts_ns: at, tgid: 2, tid: 7, wake_ns, on_ns });
                recs.push(Record::UnixIo { conn: IPC, ts_ns: at, enter_ns: at - 20 * US, tid: 7, dir: Dir::Out, len });
            };
            let start = |recs: &mut Vec<Record>, id: &str, at: u64, first_ns: u64| {
                if started {
                    recs.push(Record::EngineRequestStart { conn: IPC, ts_ns: at, tid: 7, dir: Dir::Out, request_id: format!("{id}-0123abcd"), first_ns });
                }
            };
            recs.push(Record::OffCpu { ts_ns: 2 * MS, tgid: 2, tid: 7, off_ns: 0, wake_ns: Some(1500 * US), prev_state: 1 });
            write(&mut recs, 2100 * US, 1500 * US, 2 * MS, 1000);
            recs.push(add("chatcmpl-a", 2100 * US, Some(t0)));
            recs.push(Record::OffCpu { ts_ns: 4500 * US, tgid: 2, tid: 7, off_ns: 2200 * US, wake_ns: Some(4 * MS), prev_state: 1 });
            write(&mut recs, 5100 * US, 4 * MS, 4500 * US, 8192);
            write(&mut recs, 5200 * US, 4 * MS, 4500 * US, 40_000);
            start(&mut recs, "chatcmpl-b", 5200 * US, 5100 * US);
            recs.push(add("chatcmpl-b", 5200 * US, Some(t0 + 0.002)));
            recs.push(Record::OffCpu { ts_ns: 20200 * US, tgid: 2, tid: 7, off_ns: 5300 * US, wake_ns: Some(20 * MS), prev_state: 1 });
            write(&mut recs, 20300 * US, 20 * MS, 20200 * US, 8192);
            recs.push(add("chatcmpl-d", 20300 * US, Some(t0 + 0.0185)));
            write(&mut recs, 20400 * US, 20 * MS, 20200 * US, 30_000);
            start(&mut recs, "chatcmpl-c", 20400 * US, 20300 * US);
            recs.push(add("chatcmpl-c", 20400 * US, Some(t0 + 0.0188)));
            let all = [("chatcmpl-a", true, Some(29 * MS)), ("chatcmpl-b", true, Some(29 * MS)), ("chatcmpl-d", true, Some(29 * MS)), ("chatcmpl-c", true, Some(29 * MS))];
            recs.push(step(30 * MS, &all));
            answered(&mut recs, &[("chatcmpl-a", 5, 31 * MS), ("chatcmpl-b", 6, 31 * MS), ("chatcmpl-d", 8, 31 * MS), ("chatcmpl-c", 9, 31 * MS)]);
            let got = submits(recs);
            ["chatcmpl-a", "chatcmpl-b", "chatcmpl-d", "chatcmpl-c"].map(got)
        };
        let [a, b, d, (c, c_source)] = run(true);
        assert_eq!(a, (1500 * US, super::SUBMIT_WAKE));
        assert_eq!(b, (4 * MS, super::SUBMIT_WAKE), "the wake-up its first write came after");
        assert_eq!(d, (20 * MS, super::SUBMIT_WAKE));
        assert_eq!(c_source, super::SUBMIT_ARRIVAL, "not the first handed over in its first write");
        assert!(c.abs_diff(20300 * US) < 1_000, "C built 0.3 ms after D, placed from D's wake-up: {c}");
        let [_, (b, b_source), ..] = run(false);
        assert_eq!(b_source, super::SUBMIT_ARRIVAL, "its completing write was not the thread's first I/O since the wake-up");
        assert!(b.abs_diff(3500 * US) < 1_000, "B built 2 ms after A, placed from A's wake-up: {b}");
    }

    /// B is built 10 ms after A (its arrival_time), so A's anchor places
    /// its hand-over at 12 ms; but the frontend's thread (the one serving
    /// its HTTP requests, tid 3) was preempted from 11.5 ms to 14 ms and
    /// cannot have called send() before 14 ms. Without that off-CPU record
    /// the placement stands.
    #[test]
    fn a_placed_hand_over_never_falls_while_the_frontend_thread_was_off_its_cpu() {
        let run = |preempted: bool| {
            let add = |id: &str, at: u64, arrival_time_s: Option<f64>| add(id, at, 7, arrival_time_s);
            let t0 = 1_796_127_787.051_362_5;
            let mut recs = Vec::new();
            for (id, fd, at) in [("chatcmpl-a", 5, MS), ("chatcmpl-b", 6, 10 * MS)] {
                recs.push(http(id, fd, at).remove(0));
            }
            // The frontend process's own HTTP thread: tid 3 of tgid 2.
            let mut health = http("health", 50, MS / 2).remove(0);
            if let Record::HttpRequest { conn, tid, path, .. } = &mut health {
                (conn.tgid, *tid, *path) = (2, 3, "/health".into());
            }
            recs.push(health);
            recs.push(Record::OffCpu { ts_ns: 2 * MS + MS / 10, tgid: 2, tid: 7, off_ns: 0, wake_ns: Some(2 * MS), prev_state: 1 });
            recs.push(Record::UnixIo { conn: IPC, ts_ns: 2 * MS + MS / 5, enter_ns: 2 * MS + MS / 5, tid: 7, dir: Dir::Out, len: 1000 });
            recs.push(add("chatcmpl-a", 2 * MS + MS / 5, Some(t0)));
            if preempted {
                recs.push(Record::OffCpu { ts_ns: 14 * MS, tgid: 2, tid: 3, off_ns: 11 * MS + MS / 2, wake_ns: None, prev_state: 0 });
            }
            recs.push(Record::UnixIo { conn: IPC, ts_ns: 14 * MS + MS / 2, enter_ns: 14 * MS + MS / 2, tid: 7, dir: Dir::Out, len: 1000 });
            recs.push(add("chatcmpl-b", 14 * MS + MS / 2, Some(t0 + 0.01)));
            recs.push(step(20 * MS, &[("chatcmpl-a", true, Some(19 * MS)), ("chatcmpl-b", true, Some(19 * MS))]));
            answered(&mut recs, &[("chatcmpl-a", 5, 21 * MS), ("chatcmpl-b", 6, 21 * MS)]);
            submits(recs)("chatcmpl-b")
        };
        assert_eq!(run(true), (14 * MS, super::SUBMIT_ARRIVAL), "when the frontend's thread got its CPU back");
        let (b, source) = run(false);
        assert_eq!(source, super::SUBMIT_ARRIVAL);
        assert!(b.abs_diff(12 * MS) < 1_000, "10 ms after A's wake-up: {b}");
    }

    /// The placement never leaves [wake-up, write]: an arrival_time before
    /// the anchor's, far after it or not a number; a write before the
    /// anchor or over a second after it is not placed.
    #[test]
    fn a_placed_hand_over_stays_between_the_wake_up_and_the_write() {
        let mut w = super::Writer::default();
        assert_eq!(w.placed(5 * MS, Some(100.001)), None, "no wake-up seen: nothing to place from");
        w.anchor(MS, 100.0);
        assert_eq!(w.placed(5 * MS, Some(100.002)), Some(3 * MS));
        assert_eq!(w.placed(5 * MS, Some(99.0)), Some(MS), "built before the anchor: its wake-up");
        assert_eq!(w.placed(5 * MS, Some(200.0)), Some(5 * MS), "past the write: the write");
        assert_eq!(w.placed(5 * MS, Some(f64::NAN)), None);
        assert_eq!(w.placed(5 * MS, None), None);
        assert_eq!(w.placed(MS / 2, Some(100.0)), None, "a write before the anchor's wake-up");
        assert_eq!(w.placed(MS + super::ANCHOR_MAX_NS, Some(100.5)), Some(MS + 500 * MS), "a second after: still");
        assert_eq!(w.placed(MS + super::ANCHOR_MAX_NS + 1, Some(100.5)), None, "past a second: not");
    }

    /// A frontend preempted between building a request and sending it hands
    /// it over late: as an anchor that would place the next ADDs late by as
    /// much (CI: 3.2 ms). Of the latest anchors the least delayed places.
    #[test]
    fn a_hand_over_is_placed_by_the_least_delayed_recent_anchor() {
        let mut w = super::Writer::default();
        // Built at 100.000 s, handed over at 1 ms: 1 ms after its arrival_time's instant.
        w.anchor(MS, 100.000);
        // Built at 100.010 s, but its sender lost the CPU for 3 ms: handed over at 14 ms.
        w.anchor(14 * MS, 100.010);
        // Built at 100.017 s and sent without delay (18 ms): placed by the first anchor,
        // not at the second's 14 ms + 7 ms.
        assert_eq!(w.placed(20 * MS, Some(100.017)), Some(18 * MS));
        // Built at 100.011 s: the first anchor says 12 ms, but it left after the
        // latest anchor's hand-over.
        assert_eq!(w.placed(16 * MS, Some(100.011)), Some(14 * MS), "never before the latest anchor");
        // The oldest anchors are let go: eight later ones, each 2 ms late, place by themselves.
        for i in 0..super::ANCHORS as u64 {
            w.anchor((20 + i) * MS + 2 * MS, 100.020 + i as f64 / 1e3);
        }
        let got = w.placed(40 * MS, Some(100.035)).unwrap();
        assert!(got.abs_diff(37 * MS) < 1_000, "the first anchor is gone: 35 ms + 2 ms, got {got}");
        // An anchor over a second old places nothing, though a newer one does.
        let mut w = super::Writer::default();
        w.anchor(MS, 100.0);
        w.anchor(super::ANCHOR_MAX_NS + 10 * MS, 101.0);
        let got = w.placed(super::ANCHOR_MAX_NS + 20 * MS, Some(101.005)).unwrap();
        assert!(got.abs_diff(super::ANCHOR_MAX_NS + 15 * MS) < 1_000, "the second's 5 ms after it, not the first's: {got}");
    }

    /// ZMQ's I/O thread is woken by A's send at 30.144 ms, runs 50 µs, then
    /// waits 4.4 ms on a mutex (a futex: TASK_INTERRUPTIBLE|TASK_FREEZABLE)
    /// and writes A right after that wait (seen in CI). The lock's wake-up is
    /// not the hand-over: A's submit is the first wake-up, as the write's
    /// own word from the kernel says.
    #[test]
    fn a_wait_on_a_lock_between_the_hand_over_and_the_write_does_not_move_the_hand_over() {
        const US: u64 = 1_000;
        let mut recs = vec![http("chatcmpl-a", 5, MS).remove(0)];
        recs.push(Record::OffCpu { ts_ns: 30_169 * US, tgid: 2, tid: 7, off_ns: 5 * MS, wake_ns: Some(30_144 * US), prev_state: 1 });
        recs.push(Record::OffCpu { ts_ns: 34_670 * US, tgid: 2, tid: 7, off_ns: 30_220 * US, wake_ns: Some(34_653 * US), prev_state: 0x2001 });
        recs.push(Record::WokenWrite { ts_ns: 34_720 * US, tgid: 2, tid: 7, wake_ns: 30_144 * US, on_ns: 30_169 * US });
        recs.push(Record::UnixIo { conn: IPC, ts_ns: 34_720 * US, enter_ns: 34_700 * US, tid: 7, dir: Dir::Out, len: 1000 });
        recs.push(add("chatcmpl-a", 34_720 * US, 7, Some(1_796_127_787.0)));
        recs.push(step(50 * MS, &[("chatcmpl-a", true, Some(49 * MS))]));
        answered(&mut recs, &[("chatcmpl-a", 5, 51 * MS)]);
        assert_eq!(submits(recs)("chatcmpl-a"), (30_144 * US, super::SUBMIT_WAKE));
    }

    /// Two API servers, each with its own ZMQ I/O thread (X's tid 7, Y's
    /// tid 8); X's frontend hands a request over 6.5 ms after it stamped
    /// `arrival_time`, Y's 4.5 ms after. Y's thread was awake when B and C
    /// were handed over and wrote them late, with no wake-up or anchor of
    /// its own before them: X's anchor places them (2 ms late, X's delay)
    /// rather than leaving the thread's lag in the frontend, until D's
    /// wake-up gives Y an anchor, which places them exactly. E comes over a
    /// second after Y's last anchor, with none of Y's after it: X's recent
    /// one places it.
    #[test]
    fn an_add_its_own_thread_cannot_place_is_placed_by_the_other_api_servers_anchors() {
        const US: u64 = 1_000;
        let t0 = 1_796_127_787.051_362_5;
        let mut recs = Vec::new();
        for (id, fd, at) in [("chatcmpl-b", 6, MS), ("chatcmpl-a", 5, 2 * MS), ("chatcmpl-c", 8, 20 * MS), ("chatcmpl-d", 9, 40 * MS), ("chatcmpl-e", 10, 1180 * MS), ("chatcmpl-f", 11, 1185 * MS)] {
            recs.push(http(id, fd, at).remove(0));
        }
        let write = |recs: &mut Vec<Record>, id: &str, tid: u32, at: u64, arrival: f64| {
            recs.push(Record::UnixIo { conn: IPC, ts_ns: at, enter_ns: at, tid, dir: Dir::Out, len: 1000 });
            recs.push(add(id, at, tid, Some(t0 + arrival)));
        };
        write(&mut recs, "chatcmpl-b", 8, 9 * MS, 0.0);
        recs.push(Record::OffCpu { ts_ns: 9600 * US, tgid: 2, tid: 7, off_ns: 0, wake_ns: Some(9500 * US), prev_state: 1 });
        write(&mut recs, "chatcmpl-a", 7, 10 * MS, 0.003);
        write(&mut recs, "chatcmpl-c", 8, 30 * MS, 0.020);
        recs.push(Record::OffCpu { ts_ns: 45100 * US, tgid: 2, tid: 8, off_ns: 31 * MS, wake_ns: Some(45 * MS), prev_state: 1 });
        write(&mut recs, "chatcmpl-d", 8, 45200 * US, 0.0405);
        recs.push(Record::OffCpu { ts_ns: 1_195_100 * US, tgid: 2, tid: 7, off_ns: 11 * MS, wake_ns: Some(1195 * MS), prev_state: 1 });
        write(&mut recs, "chatcmpl-f", 7, 1_195_200 * US, 1.1885);
        write(&mut recs, "chatcmpl-e", 8, 1200 * MS, 1.190);
        let first = |ids: &[&'static str], at: u64| ids.iter().map(|&id| (id, true, Some(at))).collect::<Vec<_>>();
        recs.push(step(50 * MS, &first(&["chatcmpl-a", "chatcmpl-b", "chatcmpl-c", "chatcmpl-d"], 49 * MS)));
        recs.push(step(1210 * MS, &first(&["chatcmpl-e", "chatcmpl-f"], 1209 * MS)));
        answered(&mut recs, &[("chatcmpl-a", 5, 51 * MS), ("chatcmpl-b", 6, 51 * MS), ("chatcmpl-c", 8, 51 * MS), ("chatcmpl-d", 9, 51 * MS), ("chatcmpl-e", 10, 1211 * MS), ("chatcmpl-f", 11, 1211 * MS)]);
        let got = submits(recs);
        assert_eq!(got("chatcmpl-a"), (9500 * US, super::SUBMIT_WAKE));
        assert_eq!(got("chatcmpl-d"), (45 * MS, super::SUBMIT_WAKE));
        for (id, want, why) in [("chatcmpl-b", 4500 * US, "placed by X's later anchor, then by Y's own"), ("chatcmpl-c", 24500 * US, "placed by X's earlier anchor, then by Y's own"), ("chatcmpl-e", 1_196_500 * US, "Y's anchor is over a second old: X's")] {
            let (at, source) = got(id);
            assert_eq!(source, super::SUBMIT_ARRIVAL, "{id}: {why}");
            assert!(at.abs_diff(want) < US, "{id}: {why}: want {want}, got {at}");
        }
    }

    #[test]
    fn engine_ids_link_by_external_id_suffix_and_completion_index() {
        let e = |req: &str, ext: Option<&str>| super::EngineReq { request_id: req.into(), external_id: ext.map(Into::into), ..Default::default() };
        assert!(super::http_key_of(&e("chatcmpl-x-0123abcd", None)).contains(&"chatcmpl-x".to_string()));
        assert!(super::http_key_of(&e("1_chatcmpl-x-0123abcd", None)).contains(&"chatcmpl-x".to_string()));
        assert!(super::http_key_of(&e("cmpl-x-0-0123abcd", Some("cmpl-x-0"))).contains(&"cmpl-x".to_string()));
        assert!(!super::http_key_of(&e("chatcmpl-x-zzzz", None)).contains(&"chatcmpl-x".to_string()));
        // The Responses API: turn 0 of resp_x, with and without vLLM 0.14's external id.
        assert!(super::http_key_of(&e("resp_x_0-0123abcd", Some("resp_x_0"))).contains(&"resp_x".to_string()));
        assert!(super::http_key_of(&e("resp_x_2", None)).contains(&"resp_x".to_string()));
        // The name an interferer is given: its HTTP request's id.
        for (req, ext, name) in [
            ("chatcmpl-x-0123abcd", Some("chatcmpl-x"), "chatcmpl-x"),
            ("chatcmpl-x-0123abcd", None, "chatcmpl-x"),
            ("cmpl-x-1-0123abcd", Some("cmpl-x-1"), "cmpl-x"),
            ("resp_x_0-0123abcd", Some("resp_x_0"), "resp_x"),
            ("resp_x_0", None, "resp_x"),
            ("1_chatcmpl-x-0123abcd", Some("chatcmpl-x"), "chatcmpl-x"),
        ] {
            assert_eq!(super::http_name(&e(req, ext)), name, "{req} {ext:?}");
        }
    }

    #[test]
    fn key_lists_hold_each_number_once_and_empty_when_the_last_leaves() {
        let mut n = super::Nums::One(3);
        n.insert(3);
        assert_eq!(n.as_slice(), &[3]);
        n.insert(5);
        n.insert(3);
        n.insert(7);
        assert_eq!(n.as_slice(), &[3, 5, 7], "in the order indexed");
        assert!(!n.remove(5));
        assert!(!n.remove(9), "not there: nothing changes");
        assert_eq!(n.as_slice(), &[3, 7]);
        assert!(!n.remove(3));
        assert!(n.remove(7));
        let mut one = super::Nums::One(4);
        assert!(!one.remove(2));
        assert!(one.remove(4));
    }

    /// The rules as vllm-wire.md §4 words them (split at the separators),
    /// against the scans from the ends, on ids near every rule's edge.
    #[test]
    fn http_keys_scanned_from_the_ends_match_the_rules_split_at_separators() {
        fn by_splitting(req: &str, ext: Option<&str>) -> Vec<String> {
            let mut keys = Vec::new();
            if let Some(ext) = ext {
                keys.push(ext.to_owned());
                if let Some((base, i)) = ext.rsplit_once('-') {
                    if base.starts_with("cmpl-") && !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()) {
                        keys.push(base.to_owned());
                    }
                }
                if !ext.starts_with("cmpl-") {
                    keys.extend(responses(ext));
                }
            }
            let mut id = req;
            if let Some((k, rest)) = id.split_once('_') {
                if !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()) {
                    id = rest;
                }
            }
            keys.push(id.to_owned());
            if let Some((base, suffix)) = id.rsplit_once('-') {
                if suffix.len() == 8 && suffix.bytes().all(|b| b.is_ascii_hexdigit()) {
                    keys.push(base.to_owned());
                    id = base;
                }
            }
            if ext.is_none() {
                keys.extend(responses(id));
            }
            keys
        }
        fn responses(id: &str) -> Option<String> {
            let (base, turn) = id.rsplit_once('_')?;
            (base.starts_with("resp_") && base.len() > "resp_".len() && !turn.is_empty() && turn.bytes().all(|b| b.is_ascii_digit())).then(|| base.to_owned())
        }
        let reqs = [
            "", "-", "_", "1_", "12_x", "_x", "1a_x", "x_1", "0123abcd", "-0123abcd", "x-0123abcd", "x-0123abc", "x-0123abcde", "x-0123abcg",
            "x--0123abcd", "é-0123abcd", "1_é-0123ABCD", "12_34_x-00000000", "chatcmpl-x-0123abcd-0123abcd", "x-0123-abcd",
            "resp_x_0-0123abcd", "resp_x_0", "resp__1", "resp_1", "1_resp_x_12", "resp_x_1a", "resp_x_", "resp_é_3-0123abcd", "resp_x_0-0123abc",
        ];
        let exts = [None, Some(""), Some("cmpl-"), Some("cmpl-5"), Some("cmpl-x-"), Some("cmpl-x-0"), Some("cmpl-x-12a"), Some("cmpl-x-1-2"), Some("cmpl--7"), Some("cmplx-1"), Some("cmpl-é-9"), Some("chatcmpl-x-1"), Some("resp_x_0"), Some("resp_x_"), Some("resp__3"), Some("resp_x_0-1"), Some("resp_1")];
        for req in reqs {
            for ext in exts {
                let e = super::EngineReq { request_id: req.into(), external_id: ext.map(Into::into), ..Default::default() };
                assert_eq!(super::http_key_of(&e), by_splitting(req, ext), "{req:?} {ext:?}");
            }
        }
    }
}
