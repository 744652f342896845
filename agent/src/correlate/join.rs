//! One engine step, one output record.
//!
//! vLLM with several API servers (`--api-server-count`, which defaults to the
//! data-parallel size) gives each its own sockets to every engine, and the
//! engine sends a step's outputs as one `EngineCoreOutputs` per API server
//! whose requests got tokens (`Scheduler::update_from_output` groups them by
//! `client_index`), one after the other on their own connections. Taken one
//! by one they would be as many steps, each timed against the one before:
//! step counts, the trace's step track and the interference baselines (a
//! "step" of a few µs) would all be wrong. The joiner merges them back into
//! one record before the engine side and the GPU attribution see it.
//!
//! The messages of one step were built one after the other (µs apart on the
//! engine's own clock, `timestamp`), the next step's a whole step later. A
//! writer's message is held only when its engine process is known to serve
//! several clients (it read requests on two or more connections), until every
//! client that still has requests on the engine (read, not finished or
//! aborted) has sent its part, or for at most [`JOIN_WAIT_NS`] of record
//! time (a client whose requests all wait in the queue sends none), so a
//! single API server's recordings are ingested exactly as before. Which
//! client a part is for is learned from the requests it carries: each was
//! read on its client's input connection. Readers' copies (`Dir::In`, each API
//! server reads its own) are joined where they are used, only while no engine
//! is traced: `EngineSide::settle`, which holds them for seconds anyway.

use std::hash::{Hash, Hasher};

use super::{FxHasher, FxMap};
use crate::event::{ConnKey, Dir};
use crate::model::{EngineEvent, EngineOutput, Record};

/// Most apart two messages of one step were built (`EngineCoreOutputs.timestamp`):
/// vLLM builds them in one loop, microseconds apart (3–6 µs in the testbed),
/// but a GC pause or a preemption between two can part them (380 µs once in
/// 32 steps on the 2-core VM); a step, model and scheduling, takes longer
/// (4.8 ms the shortest there). Two real steps that close, one of each
/// client's requests only, are told apart by their scheduler stats when
/// the server logs them (vLLM's default): every step sends them to one of
/// its clients only, so two messages that both carry them are two steps.
pub const SAME_STEP_NS: u64 = 1_000_000;
/// How long (record time) a writer's message waits for the rest of its step
/// when a client with requests on the engine sent no part. The engine's
/// output thread sends the parts back to back, but a Python thread waits for
/// the GIL (a 5 ms switch interval) while the busy loop computes: with two API
/// server processes beside the engine on the 2-core VM the second part was
/// written up to 15.3 ms after the first. A step whose clients have all sent
/// their parts goes on at once; only one that misses a part waits this long.
/// Bounded by what a late output step still finds: its engine thread's
/// on-CPU records ([`super::oncpu::SETTLE_NS`]) and its GPU step, which
/// another engine's outputs give up on [`super::gpu::IPC_AFTER_GPU_MAX_NS`] +
/// [`super::gpu::MATCH_WAIT_NS`] after it.
pub const JOIN_WAIT_NS: u64 = 40_000_000;
const _: () = assert!(JOIN_WAIT_NS < super::oncpu::SETTLE_NS);
const _: () = assert!(JOIN_WAIT_NS < super::gpu::IPC_AFTER_GPU_MAX_NS + super::gpu::MATCH_WAIT_NS);
/// Client connections remembered per engine process.
const MAX_CLIENTS: usize = 64;
/// Requests in flight remembered per engine process; past this, new ones
/// are not (their client is then waited for only by the connection count).
const MAX_LIVE: usize = 1 << 20;

struct Held {
    rec: Record,
    /// (process, `engine_index`): whose step it is.
    engine: (u32, Option<u64>),
    /// Connections its parts were written on.
    conns: Vec<ConnKey>,
    built_ns: u64,
    /// One of its parts carried the step's scheduler stats.
    stats: bool,
}

/// What one engine process's clients are: where their requests came in and
/// went out, and which still have requests on it.
#[derive(Default)]
struct Clients {
    /// The connections it read requests on, one per client.
    inputs: Vec<ConnKey>,
    /// Per client (as `inputs`): its requests read and not yet finished.
    live: Vec<u32>,
    /// Those requests, by id hash → client.
    requests: FxMap<u64, u8>,
    /// Output connection → client, learned from the requests its parts carry.
    outputs: Vec<(ConnKey, u8)>,
    /// A request was not remembered (`MAX_LIVE`): a client may have
    /// requests `live` does not count.
    overflowed: bool,
}

fn id_hash(id: &str) -> u64 {
    let mut h = FxHasher::default();
    id.hash(&mut h);
    h.finish()
}

impl Clients {
    fn added(&mut self, conn: ConnKey, id: &str) {
        let c = match self.inputs.iter().position(|x| *x == conn) {
            Some(c) => c,
            None if self.inputs.len() < MAX_CLIENTS => {
                self.inputs.push(conn);
                self.live.push(0);
                self.inputs.len() - 1
            }
            None => return,
        };
        if self.requests.len() >= MAX_LIVE {
            self.overflowed = true;
            return;
        }
        if self.requests.insert(id_hash(id), c as u8).is_none() {
            self.live[c] += 1;
        }
    }

    fn ended(&mut self, id: &str) {
        if let Some(c) = self.requests.remove(&id_hash(id)) {
            self.live[usize::from(c)] -= 1;
        }
    }

    /// A part written on `conn`: learns its client from its first known
    /// request, then forgets the requests it finished.
    fn part(&mut self, conn: ConnKey, outputs: &[EngineOutput], finished: &[String]) {
        if self.inputs.len() > 1 && !self.outputs.iter().any(|o| o.0 == conn) {
            if let Some(&c) = outputs.iter().find_map(|o| self.requests.get(&id_hash(&o.request_id))) {
                self.outputs.push((conn, c));
            }
        }
        for o in outputs.iter().filter(|o| o.finish_reason.is_some()) {
            self.ended(&o.request_id);
        }
        for id in finished {
            self.ended(id);
        }
    }

    /// Whether a step whose parts came on `conns` has them all: one from
    /// every client with requests on the engine. A part of an unknown client
    /// (it carried no request read here) leaves only the count to go by.
    fn complete(&self, conns: &[ConnKey]) -> bool {
        if conns.len() >= self.inputs.len() {
            return true;
        }
        let mut have = 0u64;
        for conn in conns {
            match self.outputs.iter().find(|o| o.0 == *conn) {
                Some(&(_, c)) => have |= 1 << c,
                None => return false,
            }
        }
        !self.overflowed && self.live.iter().enumerate().all(|(c, &n)| n == 0 || have & (1 << c) != 0)
    }
}

#[derive(Default)]
pub struct StepJoiner {
    /// Per engine process, its clients (one per connection it read requests
    /// on; several: its writes may be parts of one step).
    clients: FxMap<u32, Clients>,
    held: Vec<Held>,
    /// The latest `EngineStats` (connection, time): the stats of the output
    /// message at the same connection and time, which comes right after it.
    stats_at: Option<(ConnKey, u64)>,
    /// Messages merged into an earlier one of their step.
    pub joined: u64,
}

/// What [`StepJoiner::offer`] did with a record.
#[derive(Debug, PartialEq, Eq)]
pub enum Offer {
    /// Not held: ingest it now.
    Now,
    /// Held, or merged into the held message of its step (released into
    /// `out` once every client sent its part).
    Held,
}

fn built(timestamp_s: Option<f64>) -> Option<u64> {
    timestamp_s.filter(|t| t.is_finite() && *t > 0.0 && *t < 1e10).map(|t| (t * 1e9).round() as u64)
}

impl StepJoiner {
    pub fn is_holding(&self) -> bool {
        !self.held.is_empty()
    }

    /// Held messages whose wait ended before `ts_ns` (each after its
    /// engine's earlier steps).
    pub fn due(&mut self, ts_ns: u64, out: &mut Vec<Record>) {
        while let Some(i) = self.held.iter().position(|h| h.rec.ts_ns().saturating_add(JOIN_WAIT_NS) < ts_ns) {
            self.release(i, out);
        }
    }

    /// One record in recording order: appends to `out` what to ingest now,
    /// in order (released steps, then `rec` unless it was held).
    pub fn feed(&mut self, rec: &Record, out: &mut Vec<Record>) {
        if self.is_holding() {
            self.due(rec.ts_ns(), out);
        }
        if self.offer(rec, out) == Offer::Now {
            out.push(rec.clone());
        }
    }

    /// Every held message, oldest first (the end of the recording).
    pub fn drain(&mut self, out: &mut Vec<Record>) {
        while !self.held.is_empty() {
            self.release(0, out);
        }
    }

    /// Releases held message `i` after every held message of its engine built
    /// before it: an engine's steps reach the correlator in order.
    fn release(&mut self, i: usize, out: &mut Vec<Record>) {
        let (key, b) = (self.held[i].engine, self.held[i].built_ns);
        let mut go: Vec<Held> = Vec::new();
        let mut j = 0;
        while j < self.held.len() {
            if self.held[j].engine == key && self.held[j].built_ns <= b {
                go.push(self.held.remove(j));
            } else {
                j += 1;
            }
        }
        go.sort_by_key(|h| h.built_ns);
        out.extend(go.into_iter().map(|h| h.rec));
    }

    /// Looks at one record before it is ingested. Held messages it completes
    /// are released into `out` (to be ingested before `rec`, or instead of it
    /// when it was merged into one of them).
    pub fn offer(&mut self, rec: &Record, out: &mut Vec<Record>) -> Offer {
        match rec {
            Record::EngineRequest { conn, dir: Dir::In, request_id, .. } => {
                self.clients.entry(conn.tgid).or_default().added(*conn, request_id);
                Offer::Now
            }
            Record::EngineAbort { conn, dir: Dir::In, request_ids, .. } => {
                if let Some(cl) = self.clients.get_mut(&conn.tgid) {
                    for id in request_ids {
                        cl.ended(id);
                    }
                }
                Offer::Now
            }
            Record::EngineStats { conn, ts_ns, .. } => {
                self.stats_at = Some((*conn, *ts_ns));
                Offer::Now
            }
            Record::EngineOutputs { conn, ts_ns, dir: Dir::Out, timestamp_s, engine_index, outputs, finished_requests, .. } => {
                let engine = (conn.tgid, *engine_index);
                let stats = self.stats_at == Some((*conn, *ts_ns));
                let Some(cl) = self.clients.get_mut(&conn.tgid) else { return Offer::Now };
                cl.part(*conn, outputs, finished_requests);
                let several = cl.inputs.len() > 1;
                let Some(b) = built(*timestamp_s).filter(|_| several) else {
                    // One client (or no build time): never held; what its
                    // engine had held goes first.
                    while let Some(i) = self.held.iter().position(|h| h.engine == engine) {
                        self.release(i, out);
                    }
                    return Offer::Now;
                };
                // Its step's held message: built as close, no part on this
                // connection yet. With libzmq batching writes, the next
                // step's part on one connection may come before this step's
                // on another: several steps of an engine can be held at once.
                // A step's stats go to one client: two parts with stats are
                // two steps, however close they were built.
                let part_of = self.held.iter().position(|h| {
                    h.engine == engine && !h.conns.contains(conn) && h.built_ns.abs_diff(b) <= SAME_STEP_NS && !(h.stats && stats)
                });
                let i = match part_of {
                    Some(i) => {
                        let h = &mut self.held[i];
                        h.conns.push(*conn);
                        h.stats |= stats;
                        merge(&mut h.rec, rec);
                        self.joined += 1;
                        i
                    }
                    None => {
                        self.held.push(Held { rec: rec.clone(), engine, conns: vec![*conn], built_ns: b, stats });
                        self.held.len() - 1
                    }
                };
                if self.clients.get(&conn.tgid).is_some_and(|cl| cl.complete(&self.held[i].conns)) {
                    self.release(i, out);
                }
                Offer::Held
            }
            _ => Offer::Now,
        }
    }
}

/// Appends `part`'s outputs and finished requests to `into` (same step).
fn merge(into: &mut Record, part: &Record) {
    let (
        Record::EngineOutputs { outputs, outputs_total, finished_requests, truncated, timestamp_s, .. },
        Record::EngineOutputs {
            outputs: more,
            outputs_total: more_total,
            finished_requests: more_finished,
            truncated: more_truncated,
            timestamp_s: more_ts,
            ..
        },
    ) = (into, part)
    else {
        return;
    };
    let from = outputs.len();
    outputs.extend(more.iter().cloned());
    *outputs_total = outputs_total.zip(*more_total).map(|(a, b)| a + b);
    finished_requests.extend(more_finished.iter().cloned());
    *truncated |= *more_truncated;
    // The step's output was ready when its first part was built; each
    // output keeps when its own part was, the time its API server stamps
    // its tokens with (vLLM's first-token time, so its prefill), as an
    // event of the joiner's own kind.
    if let (Some(a), Some(b)) = (timestamp_s.as_mut(), more_ts) {
        mark_parts(outputs, from, *a, *b);
        *a = a.min(*b);
    }
}

/// `outputs[from..]`, a part built at `part_s`, joins those before it,
/// built at `held_s` (the earliest of their parts): the outputs of the
/// later-built side are marked with their part's time ([`EV_PART_BUILT`];
/// an output marked already keeps its own).
pub(crate) fn mark_parts(outputs: &mut [EngineOutput], from: usize, held_s: f64, part_s: f64) {
    let (later, t) = if part_s > held_s {
        (&mut outputs[from..], part_s)
    } else if part_s < held_s {
        (&mut outputs[..from], held_s)
    } else {
        return;
    };
    for o in later.iter_mut().filter(|o| !o.events.iter().any(|e| e.kind == EV_PART_BUILT)) {
        o.events.push(EngineEvent { kind: EV_PART_BUILT, timestamp_s: t });
    }
}

/// An output's event kind no vLLM sends (its are 1–3): when the part of a
/// joined step that carried it was built, where later than the step's
/// first part (`EngineCoreOutputs.timestamp` of its own message).
pub const EV_PART_BUILT: u8 = 0xf0;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::EngineOutput;

    const MS: u64 = 1_000_000;
    const US: u64 = 1_000;

    fn conn(fd: i32) -> ConnKey {
        ConnKey { tgid: 7, fd, ino: 100 + fd as u64 }
    }

    /// Request `id` read on client connection `fd`.
    fn add(fd: i32, ts: u64, id: &str) -> Record {
        Record::EngineRequest {
            conn: conn(fd),
            ts_ns: ts,
            tid: 8,
            dir: Dir::In,
            request_id: id.into(),
            external_req_id: None,
            prompt_tokens: Some(4),
            max_tokens: None,
            arrival_time_s: None,
            traceparent: None,
            data_parallel_rank: None,
            truncated: false,
        }
    }

    fn outs(fd: i32, ts: u64, built: u64, ids: &[&str]) -> Record {
        Record::EngineOutputs {
            conn: conn(fd),
            ts_ns: ts,
            tid: 9,
            dir: Dir::Out,
            engine_index: Some(0),
            timestamp_s: Some(built as f64 / 1e9),
            outputs: ids.iter().map(|i| EngineOutput { request_id: (*i).into(), new_tokens: 1, ..EngineOutput::default() }).collect(),
            outputs_total: Some(ids.len() as u64),
            finished_requests: vec![],
            truncated: false,
        }
    }

    /// Feeds records as `Correlator::ingest` does; returns what is ingested, in order.
    fn run(j: &mut StepJoiner, recs: &[Record]) -> Vec<Record> {
        let mut got = Vec::new();
        for r in recs {
            j.feed(r, &mut got);
        }
        j.drain(&mut got);
        got
    }

    /// The ids of each output record ingested, in order: the steps the engine side sees.
    fn steps(got: &[Record]) -> Vec<Vec<String>> {
        got.iter().filter(|r| matches!(r, Record::EngineOutputs { .. })).map(ids).collect()
    }

    fn ids(r: &Record) -> Vec<String> {
        match r {
            Record::EngineOutputs { outputs, .. } => outputs.iter().map(|o| o.request_id.clone()).collect(),
            _ => vec![],
        }
    }

    #[test]
    fn one_steps_messages_to_two_api_servers_become_one_record() {
        let mut j = StepJoiner::default();
        let got = run(
            &mut j,
            &[
                add(1, MS, "a"),
                add(2, 2 * MS, "b"),
                // Step 1: both clients, built 30 µs apart, written 20 µs apart.
                outs(3, 10 * MS, 10 * MS - 100 * US, &["a"]),
                outs(4, 10 * MS + 20 * US, 10 * MS - 70 * US, &["b"]),
                // Step 2: one client only, 5 ms later.
                outs(3, 15 * MS, 15 * MS - 100 * US, &["a"]),
                // Step 3: the other client first.
                outs(4, 20 * MS, 20 * MS - 100 * US, &["b"]),
                outs(3, 20 * MS + 15 * US, 20 * MS - 90 * US, &["a"]),
            ],
        );
        let steps = steps(&got);
        assert_eq!(steps, [vec!["a", "b"], vec!["a"], vec!["b", "a"]]);
        assert_eq!(j.joined, 2);
        let Record::EngineOutputs { ts_ns, outputs_total, timestamp_s, .. } = &got[2] else { panic!("{:?}", got[2]) };
        assert_eq!((*ts_ns, *outputs_total), (10 * MS, Some(2)), "the step's first write, both parts counted");
        assert_eq!(*timestamp_s, Some((10 * MS - 100 * US) as f64 / 1e9), "built when its first part was");
        // Each output of a later-built part keeps its part's time (what its
        // API server stamps its tokens with); the first part's need none.
        let part_built = |r: &Record| -> Vec<Option<u64>> {
            let Record::EngineOutputs { outputs, .. } = r else { panic!("{r:?}") };
            outputs.iter().map(|o| o.events.iter().find(|e| e.kind == EV_PART_BUILT).map(|e| (e.timestamp_s * 1e9).round() as u64)).collect()
        };
        assert_eq!(part_built(&got[2]), [None, Some(10 * MS - 70 * US)]);
        assert_eq!(part_built(&got[4]), [None, Some(20 * MS - 90 * US)]);
    }

    /// A part built before those held (sent after them) marks theirs.
    #[test]
    fn the_outputs_of_the_later_built_side_of_a_join_keep_their_parts_time() {
        let part = |built: u64, id: &str| outs(3, 10 * MS, built, &[id]);
        let mut held = part(10 * MS, "a");
        merge(&mut held, &part(10 * MS + 5 * US, "b"));
        merge(&mut held, &part(10 * MS - 3 * US, "c"));
        let Record::EngineOutputs { outputs, timestamp_s, .. } = &held else { panic!() };
        let marks: Vec<Vec<(u8, u64)>> = outputs.iter().map(|o| o.events.iter().map(|e| (e.kind, (e.timestamp_s * 1e9).round() as u64)).collect()).collect();
        assert_eq!(marks, [vec![(EV_PART_BUILT, 10 * MS)], vec![(EV_PART_BUILT, 10 * MS + 5 * US)], vec![]]);
        assert_eq!(*timestamp_s, Some((10 * MS - 3 * US) as f64 / 1e9));
    }

    #[test]
    fn a_single_api_servers_messages_are_never_held_or_joined() {
        let mut j = StepJoiner::default();
        let recs = [
            add(1, MS, "a"),
            add(1, 2 * MS, "b"),
            outs(3, 10 * MS, 10 * MS - 100 * US, &["a"]),
            // Built 10 µs after on the same connection: a utility reply, not a part.
            outs(3, 10 * MS + 20 * US, 10 * MS - 90 * US, &["b"]),
        ];
        let mut got = Vec::new();
        for r in &recs {
            assert_eq!(j.offer(r, &mut got), Offer::Now);
        }
        assert!(got.is_empty() && !j.is_holding() && j.joined == 0);
    }

    #[test]
    fn messages_built_a_step_apart_or_on_the_same_connection_stay_apart() {
        let mut j = StepJoiner::default();
        let got = run(
            &mut j,
            &[
                add(1, MS, "a"),
                add(2, 2 * MS, "b"),
                outs(3, 10 * MS, 10 * MS, &["a"]),
                // Another connection but built 1.5 ms later: the next step.
                outs(4, 12 * MS, 11 * MS + 500 * US, &["b"]),
                // Same connection as the held one: the next step.
                outs(4, 12 * MS + 150 * US, 11 * MS + 510 * US, &["c"]),
                // Far later than the wait: released by time, alone.
                outs(3, 60 * MS, 60 * MS - 100 * US, &["d"]),
                add(1, 110 * MS, "e"),
            ],
        );
        let steps = steps(&got);
        assert_eq!(steps, [vec!["a"], vec!["b"], vec!["c"], vec!["d"]]);
        assert_eq!(j.joined, 0);
        let order: Vec<u64> = got.iter().map(Record::ts_ns).collect();
        assert!(order.windows(2).all(|w| w[0] <= w[1]), "released in time order: {order:?}");
    }

    /// libzmq batches an engine's writes: its next step's part on one
    /// connection can come before this step's on the other.
    #[test]
    fn parts_of_two_steps_interleaved_by_batched_writes_join_their_own_steps() {
        let mut j = StepJoiner::default();
        let got = run(
            &mut j,
            &[
                add(1, MS, "a"),
                add(2, 2 * MS, "b"),
                outs(3, 20 * MS, 10 * MS, &["a1"]),
                outs(3, 20 * MS, 15 * MS, &["a2"]),
                outs(4, 20 * MS + 10 * US, 10 * MS + 3 * US, &["b1"]),
                outs(4, 20 * MS + 10 * US, 15 * MS + 3 * US, &["b2"]),
            ],
        );
        let steps = steps(&got);
        assert_eq!(steps, [vec!["a1", "b1"], vec!["a2", "b2"]]);
        assert_eq!(j.joined, 2);
    }

    fn finishing(mut rec: Record, id: &str) -> Record {
        if let Record::EngineOutputs { outputs, .. } = &mut rec {
            for o in outputs.iter_mut().filter(|o| o.request_id == id) {
                o.finish_reason = Some(1);
            }
        }
        rec
    }

    fn abort(fd: i32, ts: u64, id: &str) -> Record {
        Record::EngineAbort { conn: conn(fd), ts_ns: ts, tid: 8, dir: Dir::In, request_ids: vec![id.into()] }
    }

    /// Offers `rec` alone; what was released with it (nothing waits for time).
    fn offer_now(j: &mut StepJoiner, rec: &Record) -> Vec<Vec<String>> {
        let mut got = Vec::new();
        if j.offer(rec, &mut got) == Offer::Now {
            got.push(rec.clone());
        }
        steps(&got)
    }

    /// A step is released as soon as every client that still has requests on
    /// the engine sent its part: one whose requests finished or were aborted
    /// is not waited for.
    #[test]
    fn a_step_goes_on_once_every_client_with_requests_in_flight_sent_its_part() {
        let mut j = StepJoiner::default();
        for r in [add(1, MS, "a"), add(2, 2 * MS, "b"), add(2, 3 * MS, "c")] {
            assert!(offer_now(&mut j, &r).is_empty());
        }
        // Both clients have requests: the first part waits for the second.
        assert!(offer_now(&mut j, &outs(3, 10 * MS, 10 * MS, &["a"])).is_empty());
        let step1 = offer_now(&mut j, &finishing(outs(4, 10 * MS + 20 * US, 10 * MS + 4 * US, &["b"]), "b"));
        assert_eq!(step1, [vec!["a", "b"]]);
        // Client 2 still has c (not scheduled yet): a lone part of client 1 waits.
        assert!(offer_now(&mut j, &outs(3, 15 * MS, 15 * MS, &["a"])).is_empty());
        assert!(j.is_holding());
        // c is aborted: client 2 has nothing on the engine. The held step,
        // built before the abort was read, may still get c's part; the next
        // one cannot, and goes on at once, after it.
        assert!(offer_now(&mut j, &abort(2, 16 * MS, "c")).is_empty());
        assert_eq!(offer_now(&mut j, &outs(3, 20 * MS, 20 * MS, &["a"])), [vec!["a"], vec!["a"]], "released at once, in order");
        assert!(!j.is_holding());
        assert_eq!(j.joined, 1);
    }

    /// A Python output thread waits for the GIL between the parts of a step:
    /// the second can be written many milliseconds after the first.
    #[test]
    fn a_part_written_15_ms_after_the_first_still_joins_its_step() {
        let mut j = StepJoiner::default();
        let got = run(
            &mut j,
            &[
                add(1, MS, "a"),
                add(2, 2 * MS, "b"),
                outs(3, 10 * MS, 10 * MS - 100 * US, &["a"]),
                add(1, 12 * MS, "c"),
                outs(4, 25 * MS + 300 * US, 10 * MS - 96 * US, &["b"]),
            ],
        );
        assert_eq!(steps(&got), [vec!["a", "b"]]);
        assert_eq!(j.joined, 1);
    }

    fn stats(fd: i32, ts: u64) -> Record {
        crate::testutil::engine_stats(conn(fd), ts)
    }

    /// vLLM sends a step's scheduler stats to one of its clients: two
    /// messages built 400 µs apart that both carry stats are two steps (a
    /// fast GPU's decode steps, each of one client's requests only); the
    /// same without stats on the second are one step's parts.
    #[test]
    fn two_messages_that_both_carry_scheduler_stats_are_two_steps_however_close() {
        let two_steps = [
            add(1, MS, "a"),
            add(2, 2 * MS, "b"),
            stats(3, 10 * MS),
            outs(3, 10 * MS, 10 * MS - 500 * US, &["a"]),
            stats(4, 10 * MS + 20 * US),
            outs(4, 10 * MS + 20 * US, 10 * MS - 100 * US, &["b"]),
        ];
        let mut j = StepJoiner::default();
        assert_eq!(steps(&run(&mut j, &two_steps)), [vec!["a"], vec!["b"]]);
        assert_eq!(j.joined, 0);
        // The second without its own stats: a part of the first's step.
        let mut j = StepJoiner::default();
        let one_step: Vec<Record> = two_steps.iter().enumerate().filter(|(i, _)| *i != 4).map(|(_, r)| r.clone()).collect();
        assert_eq!(steps(&run(&mut j, &one_step)), [vec!["a", "b"]]);
        assert_eq!(j.joined, 1);
        // Stats on the second part only (the first client's part came later
        // on the wire): still one step.
        let mut j = StepJoiner::default();
        let second: Vec<Record> = two_steps.iter().enumerate().filter(|(i, _)| *i != 2).map(|(_, r)| r.clone()).collect();
        assert_eq!(steps(&run(&mut j, &second)), [vec!["a", "b"]]);
    }

    /// A client whose requests all wait in the queue sends no part: the step
    /// waits for it at most [`JOIN_WAIT_NS`] of record time.
    #[test]
    fn a_step_waits_for_a_client_with_only_queued_requests_no_longer_than_the_wait() {
        let mut j = StepJoiner::default();
        let mut got = Vec::new();
        for r in [add(1, MS, "a"), add(2, 2 * MS, "b")] {
            assert_eq!(j.offer(&r, &mut got), Offer::Now);
        }
        assert_eq!(j.offer(&outs(3, 10 * MS, 10 * MS, &["a"]), &mut got), Offer::Held);
        j.due(10 * MS + JOIN_WAIT_NS, &mut got);
        assert!(got.is_empty(), "still within the wait");
        j.due(10 * MS + JOIN_WAIT_NS + 1, &mut got);
        assert_eq!(steps(&got), [vec!["a"]]);
    }
}
