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
//! several clients (it read requests on two or more connections), until a part
//! has come from each of them or for at most [`JOIN_WAIT_NS`] of record time,
//! so a single API server's recordings are ingested exactly as before. Readers' copies (`Dir::In`, each API server
//! reads its own) are not joined: they are used only while no engine is traced.

use super::FxMap;
use crate::event::{ConnKey, Dir};
use crate::model::Record;

/// Most apart two messages of one step were built (`EngineCoreOutputs.timestamp`):
/// vLLM builds them in one loop, microseconds apart (3–6 µs in the testbed),
/// but a GC pause or a preemption between two can part them (380 µs once in
/// 32 steps on the 2-core VM); a step, model and scheduling, takes longer
/// (4.8 ms the shortest there). Two real steps that close, one of each
/// client's requests only, would be taken as one.
pub const SAME_STEP_NS: u64 = 1_000_000;
/// How long (record time) a writer's message waits for the rest of its step.
/// The engine's output thread sends them back to back, but a Python thread
/// waits for the GIL: the testbed's second part was written up to 2.9 ms after
/// the first on the 2-core VM. The parts are told by their build times, so a
/// longer wait only delays the step's ingestion (requests are final seconds
/// later, output steps are matched to GPU steps tens of ms later).
pub const JOIN_WAIT_NS: u64 = 10_000_000;
/// Client connections remembered per engine process.
const MAX_CLIENTS: usize = 64;

struct Held {
    rec: Record,
    /// (process, `engine_index`): whose step it is.
    engine: (u32, Option<u64>),
    /// Connections its parts were written on.
    conns: Vec<ConnKey>,
    built_ns: u64,
}

#[derive(Default)]
pub struct StepJoiner {
    /// Per engine process, the connections it read requests on (one per
    /// client; several: its writes may be parts of one step).
    inputs: FxMap<u32, Vec<ConnKey>>,
    held: Vec<Held>,
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
            Record::EngineRequest { conn, dir: Dir::In, .. } => {
                let e = self.inputs.entry(conn.tgid).or_default();
                if !e.contains(conn) && e.len() < MAX_CLIENTS {
                    e.push(*conn);
                }
                Offer::Now
            }
            Record::EngineOutputs { conn, dir: Dir::Out, timestamp_s, engine_index, .. } => {
                let engine = (conn.tgid, *engine_index);
                let clients = self.inputs.get(&conn.tgid).map_or(0, Vec::len);
                let Some(b) = built(*timestamp_s).filter(|_| clients > 1) else {
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
                let part_of = self.held.iter().position(|h| h.engine == engine && !h.conns.contains(conn) && h.built_ns.abs_diff(b) <= SAME_STEP_NS);
                let i = match part_of {
                    Some(i) => {
                        let h = &mut self.held[i];
                        h.conns.push(*conn);
                        merge(&mut h.rec, rec);
                        self.joined += 1;
                        i
                    }
                    None => {
                        self.held.push(Held { rec: rec.clone(), engine, conns: vec![*conn], built_ns: b });
                        self.held.len() - 1
                    }
                };
                // A part from every client: nothing more to wait for.
                if self.held[i].conns.len() >= clients {
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
    outputs.extend(more.iter().cloned());
    *outputs_total = outputs_total.zip(*more_total).map(|(a, b)| a + b);
    finished_requests.extend(more_finished.iter().cloned());
    *truncated |= *more_truncated;
    // The step's output was ready when its first part was built.
    if let (Some(a), Some(b)) = (timestamp_s.as_mut(), more_ts) {
        *a = a.min(*b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::EngineOutput;

    const MS: u64 = 1_000_000;
    const US: u64 = 1_000;

    fn conn(fd: i32) -> ConnKey {
        ConnKey { tgid: 7, fd, ino: 100 + fd as u64 }
    }

    fn add(fd: i32, ts: u64) -> Record {
        Record::EngineRequest {
            conn: conn(fd),
            ts_ns: ts,
            tid: 8,
            dir: Dir::In,
            request_id: format!("r{fd}-{ts}"),
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
            j.due(r.ts_ns(), &mut got);
            if j.offer(r, &mut got) == Offer::Now {
                got.push(r.clone());
            }
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
                add(1, MS),
                add(2, 2 * MS),
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
    }

    #[test]
    fn a_single_api_servers_messages_are_never_held_or_joined() {
        let mut j = StepJoiner::default();
        let recs = [
            add(1, MS),
            add(1, 2 * MS),
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
                add(1, MS),
                add(2, 2 * MS),
                outs(3, 10 * MS, 10 * MS, &["a"]),
                // Another connection but built 1.5 ms later: the next step.
                outs(4, 12 * MS, 11 * MS + 500 * US, &["b"]),
                // Same connection as the held one: the next step.
                outs(4, 12 * MS + 150 * US, 11 * MS + 510 * US, &["c"]),
                // Far later than the wait: released by time, alone.
                outs(3, 30 * MS, 30 * MS - 100 * US, &["d"]),
                add(1, 50 * MS),
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
                add(1, MS),
                add(2, 2 * MS),
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
}
