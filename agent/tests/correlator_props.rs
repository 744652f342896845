//! Property tests of the correlator (issue 5 "Replay", issue 8 item 1): record
//! streams from the replay fixtures and from a seeded synthetic generator
//! (chains of streamed requests, a simulated continuous-batching engine with
//! chunked prefill and queueing, its IPC seen from one or both ends, one or
//! two API server processes (each step then one message per server, some
//! sent milliseconds apart), scheduler wake-ups) are shuffled, duplicated, dropped, truncated and time-perturbed,
//! and the correlator must
//!   - never panic (nor the report built from its result);
//!   - give every request with all marks a partition that adds up to E2E
//!     within 1e-6 ms, with non-negative phases and marks in order;
//!   - number the hops of every chain 1..n in arrival order;
//!   - keep its loss counters consistent with the stream it was fed;
//!   - give the same analysis for the same stream.
//!
//! Clean synthetic streams must moreover give back exactly what was generated.
//!
//! Seeded (xorshift64*): a failure prints the case's seed;
//! `HOPSCOPE_PROP_SEED=<n>` changes the base seed and `HOPSCOPE_PROP_CASES=<n>`
//! the number of cases per test, to explore further.

use hopscope::correlate::engine::{first_output_held_ms, last_output_ms, marks, partition, scheduler_queue_ms};
use hopscope::correlate::{Analysis, ChainSource, Config, Correlator};
use hopscope::event::{ConnKey, Dir};
use hopscope::model::{EngineEvent, EngineOutput, HttpRole, PrefillStats, Record, SseKind, Usage};
use hopscope::recording::{self, Meta};
use hopscope::sink::report;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::panic::{catch_unwind, AssertUnwindSafe};

const US: u64 = 1_000;
const MS: u64 = 1_000_000;
/// Synthetic streams start at 5000 s of CLOCK_MONOTONIC (engine timestamps in
/// f64 seconds still round-trip to the nanosecond there).
const T0: u64 = 5_000_000_000_000;

// ---------------------------------------------------------------- the RNG

/// xorshift64* (Vigna): small, seeded, good enough to pick test cases.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        // splitmix64 of the seed, so nearby seeds give unrelated streams; never 0.
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Rng((z ^ (z >> 31)) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in lo..hi (hi > lo).
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn chance(&mut self, p: f64) -> bool {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
    fn hex(&mut self, n: usize) -> String {
        (0..n).map(|_| char::from(b"0123456789abcdef"[self.below(16)])).collect()
    }
}

fn base_seed() -> u64 {
    std::env::var("HOPSCOPE_PROP_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x005e_ed0f_40b5)
}

fn cases(default: u64) -> u64 {
    std::env::var("HOPSCOPE_PROP_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(default)
}

/// Runs `case` for `n` seeds; a failure (assertion or panic inside the
/// correlator) names the seed that reproduces it.
fn for_cases(test: &str, n: u64, case: impl Fn(u64)) {
    let base = base_seed();
    for i in 0..n {
        let seed = base ^ (i.wrapping_mul(0xA076_1D64_78BD_642F)) ^ fnv(test);
        if let Err(e) = catch_unwind(AssertUnwindSafe(|| case(seed))) {
            let msg = e.downcast_ref::<String>().cloned().or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
            panic!("{test}: case {i} (seed {seed:#x}) failed: {msg}");
        }
    }
}

fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

// ------------------------------------------------------ synthetic streams

/// What the generator made for one chat request: the oracle for clean streams.
#[derive(Debug, Clone)]
struct Truth {
    id: String,
    x_request_id: Option<String>,
    chain: String,
    source: ChainSource,
    hop: u32,
    arrive: u64,
    /// The hand-over the correlator should find: the writer thread's wake-up
    /// when the scheduler showed one, else the IPC write.
    submit: u64,
    scheduled: u64,
    scheduled_source: &'static str,
    /// The engine's QUEUED stamp, when it sent events (its read of the ADD).
    queued: Option<u64>,
    first_token: u64,
    /// The end of the step that carried its last output (its part's build
    /// time with several API servers).
    last_output: u64,
    /// The ends of every step that carried an output of it (as `last_output`).
    outputs_at: Vec<u64>,
    ttft: u64,
    done: u64,
    steps: u32,
    tokens: u64,
    preemptions: u32,
    /// The scheduler showed the writer thread's wake-up (submit is the wake-up).
    woken: bool,
    /// The ADD left in two writes (submit is the first one's wake-up).
    spanned: bool,
    /// The client gave up while the request was queued: the server closed
    /// the connection here, with no body written (vLLM's first chunk, and
    /// its id, come with the first token), and the frontend aborted the
    /// engine request. Phases: frontend, then queue to the close.
    closed: Option<u64>,
}

struct Synthetic {
    records: Vec<Record>,
    truth: Vec<Truth>,
    /// Output messages the engine sent (steps that produced outputs).
    steps: usize,
    /// Extra wire-only requests (health checks).
    health: usize,
    /// API server processes.
    clients: u32,
    /// Steps whose parts were sent milliseconds apart.
    late_parts: u64,
    /// Each step's first message carried scheduler stats.
    stats: bool,
}

struct Pending {
    truth: Truth,
    conn: ConnKey,
    seq: u32,
    /// When the engine may schedule it (the ADD was read).
    ready: u64,
    engine_id: String,
    max_tokens: u64,
    prefill_chunks: u32,
    prompt: u64,
    cached: u64,
    last_sse: u64,
    events_sent: bool,
    chain: usize,
    /// Outputs still to be written with empty content before the first
    /// content (a stop string's hold-back).
    hold: u32,
}

struct ChainGen {
    key: String,
    source: ChainSource,
    hops: u32,
    next_hop: u32,
    /// The next hop's arrival (None: a hop is in flight, or the chain is done).
    next_arrive: Option<u64>,
    conn: Option<(ConnKey, u32)>,
    trace_id: String,
}

struct Gen {
    rng: Rng,
    /// (time order, emission index) → record: sorted at the end, ties in emission order.
    out: Vec<(u64, usize, Record)>,
    next_fd: i32,
    /// The engine process is traced too (each IPC message seen at both ends).
    engine_traced: bool,
    /// The engine sends QUEUED/SCHEDULED/PREEMPTED events (log stats on).
    events: bool,
    /// Scheduler records for the IPC writer threads (wake-ups).
    wakeups: bool,
    /// Unrelated records (drops snapshots, connection churn, other threads).
    noise: bool,
    drops_seen: u64,
    /// API server processes (vLLM `--api-server-count`): 1, or 2, each with
    /// its own HTTP connections and IPC sockets; chain `c` is served by
    /// `c % clients`, and the engine sends each step as one message per API
    /// server with outputs in it.
    clients: u32,
    /// Draws only two-server streams make, so a one-server stream is the
    /// same as before they existed (seeds keep their cases).
    split: Rng,
    /// When the engine's output thread is free again (it sends in order).
    out_free: u64,
    /// Each API server's latest read of an output message (a socket reads
    /// in the order it was written).
    last_read: [u64; 2],
    /// Steps whose second part was sent milliseconds after the first (the
    /// output thread waited for the GIL).
    late_parts: u64,
    /// The server logs stats (vLLM's default): each step's first message
    /// carries its scheduler stats. Drawn from its own generator, so the
    /// other draws of a seed stay as they were.
    stats: bool,
    /// Draws for clients that give up ([`Truth::closed`]), its own generator
    /// for the same reason.
    quit: Rng,
    /// Which requests' first outputs the frontend holds back.
    hold: Rng,
    /// A client gives up only after the previous one's close and abort:
    /// hopscope joins such a request to its abort by time, earliest submit
    /// first, exact only when no other leaver's ADD falls inside its wait
    /// (docs/decisions.md "Clients that give up").
    quit_free: u64,
}

const TGID: u32 = 100;
const ENGINE_TGID: u32 = 200;
const IPC_IN: ConnKey = ConnKey { tgid: TGID, fd: 3, ino: 77 };
const IPC_OUT: ConnKey = ConnKey { tgid: TGID, fd: 4, ino: 78 };

/// One API server's IPC sockets: (its input, its output, the engine's input
/// from it, the engine's output to it). With one API server, both ends are
/// named as one socket pair, as before two-server streams.
struct Ipc {
    api_in: ConnKey,
    api_out: ConnKey,
    engine_in: ConnKey,
    engine_out: ConnKey,
}

fn ipc(clients: u32, k: u32) -> Ipc {
    if clients == 1 {
        return Ipc { api_in: IPC_IN, api_out: IPC_OUT, engine_in: IPC_IN, engine_out: IPC_OUT };
    }
    let (fd, ino) = (k as i32, u64::from(k));
    Ipc {
        api_in: ConnKey { tgid: TGID + k, fd: 3, ino: 77 + 10 * ino },
        api_out: ConnKey { tgid: TGID + k, fd: 4, ino: 78 + 10 * ino },
        engine_in: ConnKey { tgid: ENGINE_TGID, fd: 30 + fd, ino: 300 + ino },
        engine_out: ConnKey { tgid: ENGINE_TGID, fd: 40 + fd, ino: 400 + ino },
    }
}

impl Gen {
    fn emit(&mut self, r: Record) {
        let n = self.out.len();
        self.out.push((r.ts_ns(), n, r));
    }

    fn conn(&mut self) -> ConnKey {
        self.conn_of(0)
    }

    /// A new HTTP connection of API server `k`.
    fn conn_of(&mut self, k: u32) -> ConnKey {
        self.next_fd += 1;
        ConnKey { tgid: TGID + k, fd: self.next_fd, ino: 10_000 + self.next_fd as u64 }
    }

    fn sse(&mut self, p: &mut Pending, at: u64, kind: SseKind, usage: Option<Usage>, finish: Option<&str>) -> u64 {
        let ts = at.max(p.last_sse + US);
        p.last_sse = ts;
        let bytes = if kind == SseKind::Content { self.rng.range(1, 40) as u32 } else { 0 };
        self.emit(Record::Sse {
            conn: p.conn,
            seq: p.seq,
            ts_ns: ts,
            kind,
            id: Some(p.truth.id.clone()),
            content_bytes: bytes,
            finish_reason: finish.map(str::to_owned),
            usage,
        });
        ts
    }

    /// A wire-only GET /health on its own connection.
    fn health(&mut self, at: u64) {
        let conn = self.conn();
        let end = at + self.rng.range(5 * US, 50 * US);
        self.emit(http_request(conn, 0, at, end, "GET", "/health", vec![], None, Some(false)));
        self.emit(Record::HttpResponse {
            conn,
            role: HttpRole::Server,
            seq: 0,
            ts_ns: end + 100 * US,
            tid: 1,
            status: 200,
            headers: vec![("content-type".into(), "application/json".into())],
        });
        self.emit(Record::HttpResponseEnd { conn, seq: 0, ts_ns: end + 150 * US, body_len: 2 });
    }

    /// Starts hop `h` of chain `c` at `arrive`: HTTP request, response head,
    /// the ADD on the IPC (and the scheduler's view of its writer thread).
    fn start(&mut self, c: usize, ch: &mut ChainGen, arrive: u64) -> Pending {
        let hop = ch.next_hop;
        ch.next_hop += 1;
        let k = c as u32 % self.clients;
        let io = ipc(self.clients, k);
        let (conn, seq) = match ch.source {
            // Connection chains ride one keep-alive connection; the others
            // reuse theirs sometimes.
            ChainSource::Connection => {
                let (k, s) = ch.conn.unwrap();
                ch.conn = Some((k, s + 1));
                (k, s)
            }
            _ if ch.conn.is_some() && self.rng.chance(0.5) => {
                let (k, s) = ch.conn.unwrap();
                ch.conn = Some((k, s + 1));
                (k, s)
            }
            _ => {
                let conn = self.conn_of(k);
                ch.conn = Some((conn, 1));
                (conn, 0)
            }
        };
        let mut headers = Vec::new();
        match ch.source {
            ChainSource::Traceparent => {
                let span = self.rng.hex(16);
                headers.push(("traceparent".into(), format!("00-{}-{span}-01", ch.trace_id)));
                // The header loses to a valid traceparent.
                if self.rng.chance(0.3) {
                    headers.push(("x-session-id".into(), format!("ignored-{c}")));
                }
            }
            ChainSource::Header => headers.push(("x-session-id".into(), ch.key.clone())),
            ChainSource::Connection => {}
        }
        let x_request_id = self.rng.chance(0.3).then(|| format!("xr-{c}-{hop}-{}", self.rng.hex(6)));
        if let Some(x) = &x_request_id {
            headers.push(("x-request-id".into(), x.clone()));
        }
        let id = match &x_request_id {
            Some(x) => format!("chatcmpl-{x}"),
            None => format!("chatcmpl-{}", self.rng.hex(16)),
        };
        let end = arrive + self.rng.range(10 * US, 300 * US);
        let ready = if self.rng.chance(0.7) { Some(arrive - self.rng.range(0, 2 * MS)) } else { None };
        let mut req = http_request(conn, seq, arrive, end, "POST", "/v1/chat/completions", headers, ready, Some(true));
        if let Record::HttpRequest { body_len, .. } = &mut req {
            *body_len = self.rng.range(200, 5000);
        }
        self.emit(req);
        // The frontend hands the ADD to its IPC writer thread (one per chain
        // here, so wake-ups stay unambiguous).
        let tid = 1000 + c as u32;
        let write = end + self.rng.range(200 * US, 4 * MS);
        // A long ADD: libzmq writes its 8 KiB batch, then the rest.
        let first_write = self.rng.chance(0.2).then(|| write - self.rng.range(20 * US, 150 * US));
        let first = first_write.unwrap_or(write);
        let mut submit = write;
        let mut woken = false;
        if self.wakeups && self.rng.chance(0.6) {
            // Slept, woken by the hand-over, got the CPU, wrote.
            let wake = self.rng.range(arrive.max(first - 3 * MS / 2), first - 50 * US);
            let on = self.rng.range(wake + 1, first);
            let off_ns = on - self.rng.range(1, 5 * MS);
            self.emit(Record::OffCpu { ts_ns: on, tgid: TGID + k, tid, off_ns, wake_ns: Some(wake), prev_state: 1 });
            submit = wake;
            woken = true;
        }
        if let Some(at) = first_write {
            self.emit(Record::UnixIo { conn: io.api_in, ts_ns: at, enter_ns: at - 2 * US, tid, dir: Dir::Out, len: 8192 });
        }
        self.emit(Record::UnixIo { conn: io.api_in, ts_ns: write, enter_ns: write - 2 * US, tid, dir: Dir::Out, len: 900 });
        let engine_id = format!("{id}-{}", self.rng.hex(8));
        if let Some(first_ns) = first_write {
            self.emit(Record::EngineRequestStart { conn: io.api_in, ts_ns: write, tid, dir: Dir::Out, request_id: engine_id.clone(), first_ns });
        }
        let prompt = self.rng.range(20, 2000);
        let max_tokens = self.rng.range(1, 9);
        let external = self.rng.chance(0.8).then(|| id.clone());
        let add = |conn: ConnKey, ts_ns: u64, tid: u32, dir: Dir| Record::EngineRequest {
            conn,
            ts_ns,
            tid,
            dir,
            request_id: engine_id.clone(),
            external_req_id: external.clone(),
            prompt_tokens: Some(prompt),
            max_tokens: Some(max_tokens),
            // The generator has no wall clock: an ADD whose wake-up it
            // shows carries a constant one (in a clean stream its wake-up is
            // its hand-over); one without carries none, or another writer's
            // wake-up would place it (`Writer::pooled`) and its truth, the
            // write, would be wrong. Placement by arrival_time is checked in
            // engine.rs's tests and against the testbed's truth
            // (tests/attribution.rs).
            arrival_time_s: woken.then_some(1.7e9),
            traceparent: None,
            data_parallel_rank: None,
            truncated: false,
        };
        self.emit(add(io.api_in, write, tid, Dir::Out));
        let read = write + self.rng.range(5 * US, 300 * US);
        if self.engine_traced {
            self.emit(add(io.engine_in, read, 2, Dir::In));
        }
        let head = write + self.rng.range(10 * US, 200 * US);
        self.emit(Record::HttpResponse {
            conn,
            role: HttpRole::Server,
            seq,
            ts_ns: head,
            tid: 1,
            status: 200,
            headers: vec![("content-type".into(), "text/event-stream; charset=utf-8".into())],
        });
        let cached = self.rng.range(0, prompt) / 16 * 16;
        // A client that gives up while queued (never on a connection chain:
        // its connection is the chain).
        let closed = (ch.source != ChainSource::Connection && arrive > self.quit_free && self.quit.chance(0.15)).then(|| {
            let close = head + self.quit.range(MS, 20 * MS);
            // The frontend aborts when its event loop hears of the
            // disconnect: around the server's close, either side of it.
            let abort = if self.quit.chance(0.3) { close - self.quit.range(0, MS) } else { close + self.quit.range(10 * US, 3 * MS) };
            let abort = abort.max(write + US);
            let aborted = |conn: ConnKey, ts_ns: u64, dir: Dir| Record::EngineAbort { conn, ts_ns, tid, dir, request_ids: vec![engine_id.clone()] };
            self.emit(aborted(io.api_in, abort, Dir::Out));
            if self.engine_traced {
                let read = abort + self.quit.range(5 * US, 300 * US);
                self.emit(aborted(io.engine_in, read, Dir::In));
            }
            self.emit(Record::ConnClose { conn, ts_ns: close });
            self.quit_free = close.max(abort) + MS;
            ch.conn = None;
            close
        });
        let mut p = Pending {
            truth: Truth {
                id,
                x_request_id,
                chain: ch.key.clone(),
                source: ch.source,
                hop,
                arrive,
                submit,
                scheduled: 0,
                scheduled_source: "",
                queued: None,
                first_token: 0,
                last_output: 0,
                outputs_at: Vec::new(),
                ttft: 0,
                done: 0,
                steps: 0,
                tokens: 0,
                preemptions: 0,
                woken,
                spanned: first_write.is_some(),
                closed,
            },
            conn,
            seq,
            ready: read,
            engine_id,
            max_tokens,
            prefill_chunks: self.rng.range(1, 4) as u32,
            prompt,
            cached,
            last_sse: head,
            events_sent: false,
            chain: c,
            hold: if max_tokens > 1 && self.hold.chance(0.3) { self.hold.range(1, max_tokens.min(5)) as u32 } else { 0 },
        };
        if let Some(close) = closed {
            // Never scheduled, no body written.
            (p.truth.scheduled, p.truth.scheduled_source) = (close, "closed");
            return p;
        }
        // Two in three responses name a model (the request never does, as
        // when its body's was lost to the capture); chosen without the rng,
        // so the workloads stay those of the seeds.
        if !(c + hop as usize).is_multiple_of(3) {
            self.emit(Record::ResponseModel { conn, seq, ts_ns: head + US, model: format!("model-{}", c % 2) });
        }
        self.sse(&mut p, head + US, SseKind::Role, None, None);
        p
    }
}

#[allow(clippy::too_many_arguments)]
fn http_request(conn: ConnKey, seq: u32, start: u64, end: u64, method: &str, path: &str, headers: Vec<(String, String)>, ready: Option<u64>, stream: Option<bool>) -> Record {
    Record::HttpRequest {
        conn,
        role: HttpRole::Server,
        seq,
        start_ns: start,
        end_ns: end,
        tid: 1,
        method: method.into(),
        path: path.into(),
        headers,
        body_len: 0,
        stream,
        model: None,
        ready_ns: ready,
    }
}

/// A random workload: 1–4 chains of 1–4 hops with think times, a
/// continuous-batching engine (1–4 running sequences, chunked prefill in 1–3
/// steps, one token per decode step), its IPC and the frontend's SSE.
fn synthetic(seed: u64) -> Synthetic {
    let mut rng = Rng::new(seed);
    let mut split = Rng::new(seed ^ 0x5e17_a91c_0de5);
    let clients = if split.chance(0.35) { 2 } else { 1 };
    let mut g = Gen {
        clients,
        split,
        out_free: 0,
        last_read: [0; 2],
        late_parts: 0,
        stats: Rng::new(seed ^ 0x57a7_5c0d_e001).chance(0.5),
        quit: Rng::new(seed ^ 0x0917_c105_ed00),
        hold: Rng::new(seed ^ 0x401d_bac4_0e55),
        quit_free: 0,
        engine_traced: rng.chance(0.6),
        events: rng.chance(0.6),
        wakeups: rng.chance(0.5),
        noise: rng.chance(0.5),
        rng,
        out: Vec::new(),
        next_fd: 10,
        drops_seen: 0,
    };
    let n_chains = g.rng.range(1, 5) as usize;
    let mut chains: Vec<ChainGen> = (0..n_chains)
        .map(|c| {
            let source = match g.rng.below(3) {
                0 => ChainSource::Traceparent,
                1 => ChainSource::Header,
                _ => ChainSource::Connection,
            };
            let trace_id = g.rng.hex(32);
            let conn = (source == ChainSource::Connection).then(|| (g.conn_of(c as u32 % g.clients), 0));
            let key = match source {
                ChainSource::Traceparent => trace_id.clone(),
                ChainSource::Header => format!("session-{c}-{}", g.rng.hex(4)),
                ChainSource::Connection => {
                    let k = conn.unwrap().0;
                    format!("conn:{}:{}:{}", k.tgid, k.fd, k.ino)
                }
            };
            ChainGen { key, source, hops: g.rng.range(1, 5) as u32, next_hop: 1, next_arrive: Some(T0 + g.rng.range(0, 20 * MS)), conn, trace_id }
        })
        .collect();
    let max_running = g.rng.range(1, 5) as usize;
    let mut health = 0;
    if g.rng.chance(0.5) {
        g.health(T0 - 3 * MS);
        health += 1;
    }

    let mut truth = Vec::new();
    let mut pending: Vec<Pending> = Vec::new(); // submitted, waiting for the engine
    let mut running: Vec<Pending> = Vec::new();
    let mut step_ends: Vec<u64> = Vec::new(); // ends of the steps that produced outputs
    let mut t = T0;
    loop {
        // Hops that arrive by now start (their ADD becomes ready a little later).
        for (c, ch) in chains.iter_mut().enumerate() {
            if let Some(a) = ch.next_arrive.filter(|&a| a <= t) {
                ch.next_arrive = None;
                let p = g.start(c, ch, a);
                match p.truth.closed {
                    Some(close) => {
                        if ch.next_hop <= ch.hops {
                            ch.next_arrive = Some(close + 3 * US + g.quit.range(0, 5 * MS));
                        }
                        truth.push(p.truth);
                    }
                    None => pending.push(p),
                }
            }
        }
        pending.sort_by_key(|p| p.ready);
        // Admit what the engine has read, up to the running limit.
        while running.len() < max_running && pending.first().is_some_and(|p| p.ready <= t) {
            let mut p = pending.remove(0);
            p.truth.scheduled = t;
            running.push(p);
        }
        if running.is_empty() {
            // Idle: jump to the next ADD or arrival.
            let next = pending.iter().map(|p| p.ready).chain(chains.iter().filter_map(|c| c.next_arrive)).min();
            match next {
                Some(n) => {
                    t = t.max(n);
                    continue;
                }
                None => break,
            }
        }
        // One step: prefills cost more than decodes.
        let prefilling = running.iter().filter(|p| p.truth.first_token == 0).count() as u64;
        let dur = g.rng.range(MS, 3 * MS) + prefilling * g.rng.range(MS / 2, 4 * MS);
        let end = t + dur;
        let mut outputs = Vec::new();
        let mut finished = Vec::new();
        let mut got = Vec::new();
        for (i, p) in running.iter_mut().enumerate() {
            if p.truth.first_token == 0 && p.prefill_chunks > 1 {
                p.prefill_chunks -= 1; // a partial prefill chunk: no output
                continue;
            }
            let first = p.truth.first_token == 0;
            if first {
                p.truth.first_token = end;
            }
            p.truth.last_output = end;
            p.truth.outputs_at.push(end);
            let mut events = Vec::new();
            if g.events && !p.events_sent {
                p.events_sent = true;
                events.push(EngineEvent { kind: 1, timestamp_s: p.ready as f64 / 1e9 });
                p.truth.queued = Some(p.ready);
                events.push(EngineEvent { kind: 2, timestamp_s: p.truth.scheduled as f64 / 1e9 });
            }
            if g.events && !first && g.rng.chance(0.05) {
                // A preemption and its re-scheduling: the first SCHEDULED stays.
                events.push(EngineEvent { kind: 3, timestamp_s: (t + 1) as f64 / 1e9 });
                events.push(EngineEvent { kind: 2, timestamp_s: (t + 2) as f64 / 1e9 });
                p.truth.preemptions += 1;
            }
            p.truth.tokens += 1;
            p.truth.steps += 1;
            got.push(i);
            let done = p.truth.tokens >= p.max_tokens;
            if done {
                finished.push(i);
            }
            outputs.push(EngineOutput {
                request_id: p.engine_id.clone(),
                new_tokens: 1,
                finish_reason: done.then_some(1),
                events,
                prefill: (first && g.rng.chance(0.7)).then_some(PrefillStats {
                    prompt_tokens: Some(p.prompt),
                    computed_tokens: Some(p.prompt - p.cached),
                    cached_tokens: Some(p.cached),
                    local_cached_tokens: None,
                    external_cached_tokens: None,
                }),
            });
        }
        if !outputs.is_empty() {
            let sent = end + g.rng.range(10 * US, 800 * US);
            // With stats off, queue ends at the previous output step's end
            // (or the submit, whichever is later — design.md §3).
            for p in running.iter_mut().filter(|p| p.truth.first_token == end && p.truth.scheduled_source.is_empty()) {
                if g.events {
                    p.truth.scheduled_source = "event";
                } else {
                    match step_ends.last() {
                        Some(&prev) if prev >= p.truth.submit => {
                            p.truth.scheduled = prev;
                            p.truth.scheduled_source = "step";
                        }
                        _ => {
                            p.truth.scheduled = p.truth.submit;
                            p.truth.scheduled_source = "submit";
                        }
                    }
                }
            }
            step_ends.push(end);
            let msg = |conn: ConnKey, ts_ns: u64, tid: u32, dir: Dir, built: u64, outputs: Vec<EngineOutput>| Record::EngineOutputs {
                conn,
                ts_ns,
                tid,
                dir,
                engine_index: Some(0),
                timestamp_s: Some(built as f64 / 1e9),
                outputs_total: Some(outputs.len() as u64),
                outputs,
                finished_requests: vec![],
                truncated: false,
            };
            // One message per API server with outputs in the step, built µs
            // apart, sent one after the other by the engine's output thread
            // (sometimes milliseconds apart: it waited for the GIL), each read
            // by its own API server.
            let mut parts: Vec<(u32, Vec<EngineOutput>, Vec<usize>)> = Vec::new();
            for (o, &i) in outputs.into_iter().zip(&got) {
                let k = running[i].chain as u32 % g.clients;
                match parts.iter_mut().find(|p| p.0 == k) {
                    Some(p) => {
                        p.1.push(o);
                        p.2.push(i);
                    }
                    None => parts.push((k, vec![o], vec![i])),
                }
            }
            let mut reads = vec![0; running.len()];
            let (mut built, mut at) = (end, sent.max(g.out_free));
            for (j, (k, outs, idx)) in parts.into_iter().enumerate() {
                if j > 0 {
                    built += g.split.range(2 * US, 60 * US);
                    at += if g.split.chance(0.15) {
                        g.late_parts += 1;
                        g.split.range(MS, 20 * MS)
                    } else {
                        g.split.range(5 * US, 300 * US)
                    };
                }
                let io = ipc(g.clients, k);
                let read = at + if j == 0 { g.rng.range(5 * US, 200 * US) } else { g.split.range(5 * US, 200 * US) };
                let read = read.max(g.last_read[k as usize] + US);
                g.last_read[k as usize] = read;
                // vLLM sends a step's stats to one client only: its first.
                let stats = |conn: ConnKey, ts_ns: u64| Record::EngineStats {
                    conn,
                    ts_ns,
                    engine_index: Some(0),
                    running: Some(running.len() as u64),
                    waiting: Some(0),
                    kv_cache_usage: Some(0.25),
                    step_counter: None,
                    prefix_cache_queries: None,
                    prefix_cache_hits: None,
                };
                if g.engine_traced {
                    if g.stats && j == 0 {
                        g.emit(stats(io.engine_out, at));
                    }
                    g.emit(msg(io.engine_out, at, 3, Dir::Out, built, outs.clone()));
                    g.emit(Record::UnixIo { conn: io.engine_out, ts_ns: at, enter_ns: at - US, tid: 3, dir: Dir::Out, len: 300 });
                }
                if g.stats && j == 0 {
                    g.emit(stats(io.api_out, read));
                }
                g.emit(msg(io.api_out, read, 1, Dir::In, built, outs));
                for i in idx {
                    reads[i] = read;
                    // Its API server stamps its first token with its own
                    // part's build time (vLLM's prefill ends there).
                    if running[i].truth.first_token == end {
                        running[i].truth.first_token = built;
                    }
                    if running[i].truth.last_output == end {
                        running[i].truth.last_output = built;
                    }
                    if let Some(o) = running[i].truth.outputs_at.last_mut().filter(|o| **o == end) {
                        *o = built;
                    }
                }
            }
            g.out_free = at + US;
            // The frontend streams each new token.
            for &i in &got {
                let at = reads[i] + g.rng.range(20 * US, MS);
                // A held output goes out with empty content (vLLM's chat
                // stream while its detokenizer holds text back).
                let held = running[i].truth.ttft == 0 && running[i].hold > 0;
                let ts = g.sse(&mut running[i], at, if held { SseKind::Other } else { SseKind::Content }, None, None);
                let p = &mut running[i];
                if held {
                    p.hold -= 1;
                } else if p.truth.ttft == 0 {
                    p.truth.ttft = ts;
                }
            }
        }
        // Finished requests: last chunks, [DONE], end of response; the
        // chain's next hop after a think time.
        for &i in finished.iter().rev() {
            let mut p = running.remove(i);
            let at = p.last_sse + g.rng.range(5 * US, 100 * US);
            g.sse(&mut p, at, SseKind::Finish, None, Some("length"));
            let usage = Usage { prompt_tokens: Some(p.prompt), completion_tokens: Some(p.truth.tokens), cached_tokens: Some(p.cached) };
            let at = p.last_sse + US;
            g.sse(&mut p, at, SseKind::Usage, Some(usage), None);
            let at = p.last_sse + US;
            p.truth.done = g.sse(&mut p, at, SseKind::Done, None, None);
            g.emit(Record::HttpResponseEnd { conn: p.conn, seq: p.seq, ts_ns: p.truth.done + 2 * US, body_len: 1000 });
            let ch = &mut chains[p.chain];
            if ch.next_hop <= ch.hops {
                ch.next_arrive = Some(p.truth.done + 3 * US + g.rng.range(0, 5 * MS));
            }
            truth.push(p.truth);
        }
        if g.noise {
            noise(&mut g, t, end);
        }
        t = end + g.rng.range(0, 300 * US);
    }
    let mut out = std::mem::take(&mut g.out);
    out.sort_by_key(|(ts, n, _)| (*ts, *n));
    Synthetic { records: out.into_iter().map(|(_, _, r)| r).collect(), truth, steps: step_ends.len(), health, clients: g.clients, late_parts: g.late_parts, stats: g.stats }
}

/// Records that must not change the analysis: drops snapshots (unrelated
/// counters), connection churn, other threads' scheduling, unix I/O, stray
/// client-role HTTP.
fn noise(g: &mut Gen, t: u64, end: u64) {
    if g.rng.chance(0.2) {
        g.drops_seen += g.rng.range(0, 3);
        let c = g.drops_seen;
        let ts_ns = g.rng.range(t, end);
        g.emit(Record::Drops { ts_ns, counters: vec![("kernel_ringbuf_full".into(), c), ("test_noise".into(), c * 2)] });
    }
    if g.rng.chance(0.3) {
        let ts = g.rng.range(t, end);
        let (off_ns, prev_state) = (g.rng.range(1, MS), g.rng.below(2) as u32);
        g.emit(Record::OffCpu { ts_ns: ts, tgid: ENGINE_TGID, tid: 3, off_ns, wake_ns: Some(ts - 1), prev_state });
    }
    if g.rng.chance(0.2) {
        let conn = g.conn();
        let ts = g.rng.range(t, end);
        g.emit(Record::ConnOpen { ts_ns: ts, conn, op: hopscope::event::ConnOp::Accept, family: hopscope::event::Family::Inet, local: None, peer: None });
        g.emit(Record::Unparsed { conn, ts_ns: ts + 1, dir: Dir::In, bytes: 24, reason: "http2_preface".into() });
        g.emit(Record::ConnClose { ts_ns: ts + 2, conn });
    }
    if g.rng.chance(0.1) {
        let conn = g.conn();
        let ts = g.rng.range(t, end);
        let mut r = http_request(conn, 0, ts, ts + US, "GET", "/elsewhere", vec![], None, None);
        if let Record::HttpRequest { role, .. } = &mut r {
            *role = HttpRole::Client;
        }
        g.emit(r);
    }
}

// ------------------------------------------------------------- mutations

/// Adds `d` (signed) to a timestamp, saturating.
fn shift(t: u64, d: i64) -> u64 {
    t.saturating_add_signed(d)
}

/// Moves every time in a record by its own random jitter of up to ±`j` ns;
/// rarely sets one to an extreme (0, far future, NaN seconds).
fn perturb(r: &mut Record, rng: &mut Rng, j: u64) {
    let d = |rng: &mut Rng| -> i64 {
        if rng.chance(0.002) {
            return if rng.chance(0.5) { i64::MIN } else { i64::MAX };
        }
        rng.range(0, 2 * j + 1) as i64 - j as i64
    };
    let secs = |s: f64, rng: &mut Rng| -> f64 {
        if rng.chance(0.002) {
            return [f64::NAN, -1.0, 1e300, 0.0, f64::INFINITY][rng.below(5)];
        }
        s + (rng.range(0, 2 * j + 1) as f64 - j as f64) / 1e9
    };
    match r {
        Record::HttpRequest { start_ns, end_ns, ready_ns, .. } => {
            *start_ns = shift(*start_ns, d(rng));
            *end_ns = shift(*end_ns, d(rng));
            if let Some(x) = ready_ns {
                *x = shift(*x, d(rng));
            }
        }
        Record::OffCpu { ts_ns, wake_ns, off_ns, .. } => {
            *ts_ns = shift(*ts_ns, d(rng));
            *off_ns = shift(*off_ns, d(rng));
            if let Some(x) = wake_ns {
                *x = shift(*x, d(rng));
            }
        }
        Record::UnixIo { ts_ns, enter_ns, .. } => {
            *ts_ns = shift(*ts_ns, d(rng));
            *enter_ns = shift(*enter_ns, d(rng));
        }
        Record::EngineRequestStart { ts_ns, first_ns, .. } => {
            *ts_ns = shift(*ts_ns, d(rng));
            *first_ns = shift(*first_ns, d(rng));
        }
        Record::EngineOutputs { ts_ns, timestamp_s, outputs, .. } => {
            *ts_ns = shift(*ts_ns, d(rng));
            if let Some(s) = timestamp_s {
                *s = secs(*s, rng);
            }
            for o in outputs {
                for e in &mut o.events {
                    e.timestamp_s = secs(e.timestamp_s, rng);
                }
            }
        }
        Record::ConnOpen { ts_ns, .. }
        | Record::ConnClose { ts_ns, .. }
        | Record::HttpResponse { ts_ns, .. }
        | Record::Sse { ts_ns, .. }
        | Record::ResponseBody { ts_ns, .. }
        | Record::HttpResponseEnd { ts_ns, .. }
        | Record::Unparsed { ts_ns, .. }
        | Record::Proc { ts_ns, .. }
        | Record::Drops { ts_ns, .. }
        | Record::RawIo { ts_ns, .. }
        | Record::EngineRequest { ts_ns, .. }
        | Record::EngineAbort { ts_ns, .. } => *ts_ns = shift(*ts_ns, d(rng)),
        // GPU records (and whatever is added later): not generated here.
        #[allow(unreachable_patterns)]
        _ => {}
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mutation {
    /// Every record anywhere.
    Shuffle,
    /// Records moved a few places (a late event, a reordering window).
    LocalShuffle,
    Duplicate,
    Drop,
    /// A prefix only (recording stopped), or a suffix only (attached mid-run).
    Truncate,
    /// Times jittered; the stream then re-sorted or left out of order.
    Perturb,
}

const ALL: [Mutation; 6] = [Mutation::Shuffle, Mutation::LocalShuffle, Mutation::Duplicate, Mutation::Drop, Mutation::Truncate, Mutation::Perturb];

fn mutate(recs: &mut Vec<Record>, m: Mutation, rng: &mut Rng) {
    let n = recs.len();
    if n == 0 {
        return;
    }
    match m {
        Mutation::Shuffle => {
            for i in (1..n).rev() {
                recs.swap(i, rng.below(i + 1));
            }
        }
        Mutation::LocalShuffle => {
            let w = rng.range(2, 12) as usize;
            for _ in 0..rng.range(1, n as u64 + 1) {
                let i = rng.below(n);
                let j = (i + rng.below(w)).min(n - 1);
                recs.swap(i, j);
            }
        }
        Mutation::Duplicate => {
            let p = [0.01, 0.1, 1.0][rng.below(3)];
            let mut out = Vec::with_capacity(n * 2);
            for r in recs.drain(..) {
                let dup = rng.chance(p);
                out.push(r.clone());
                if dup {
                    if rng.chance(0.5) {
                        out.push(r);
                    } else {
                        // Much later (a replayed block).
                        let at = out.len().saturating_sub(rng.below(out.len()));
                        out.insert(at, r);
                    }
                }
            }
            *recs = out;
        }
        Mutation::Drop => {
            let p = [0.01, 0.1, 0.5, 0.9][rng.below(4)];
            recs.retain(|_| !rng.chance(p));
        }
        Mutation::Truncate => {
            let k = rng.below(n + 1);
            if rng.chance(0.5) {
                recs.truncate(k);
            } else {
                recs.drain(..k);
            }
        }
        Mutation::Perturb => {
            let j = [US, 100 * US, 5 * MS, 200 * MS][rng.below(4)];
            for r in recs.iter_mut() {
                perturb(r, rng, j);
            }
            if rng.chance(0.5) {
                recs.sort_by_key(Record::ts_ns);
            }
        }
    }
}

// ------------------------------------------------------------- invariants

fn run(recs: &[Record]) -> Analysis {
    let mut c = Correlator::new(Config::default());
    for r in recs {
        c.ingest(r);
    }
    c.finish()
}

fn server_key(r: &Record) -> Option<(ConnKey, u32)> {
    match r {
        Record::HttpRequest { conn, seq, role: HttpRole::Server, .. } => Some((*conn, *seq)),
        _ => None,
    }
}

fn count(a: &Analysis, k: &str) -> u64 {
    a.drops.get(k).copied().unwrap_or(0)
}

/// Correlates `recs` (twice: it must be deterministic), builds the report, and
/// checks every invariant that holds whatever the stream.
fn check(recs: &[Record], ctx: &str) -> Analysis {
    let a = run(recs);
    assert_eq!(a, run(recs), "{ctx}: the same stream gives the same analysis");
    let rep = report::build("prop.hop", &Meta::default(), &a, None);
    serde_json::to_string(&rep).expect("the report serializes");

    // Requests: one per server request head, whatever became of it.
    assert_eq!(a.requests.len(), recs.iter().filter_map(server_key).count(), "{ctx}");
    assert!(a.requests.windows(2).all(|w| w[0].arrive_ns <= w[1].arrive_ns), "{ctx}: requests in arrival order");

    // The partition.
    for r in &a.requests {
        let p = partition(r);
        let parts = [p.frontend, p.queue, p.prefill, p.first_output, p.decode];
        for x in parts.iter().flatten() {
            assert!(x.is_finite() && *x >= 0.0, "{ctx} {}: negative or non-finite phase {p:?}", r.id);
        }
        // A request whose connection closed first has its phases up to the close.
        let Some(end) = r.waited_until_ns() else {
            assert_eq!(p, Default::default(), "{ctx} {}: an unfinished request has no phases", r.id);
            continue;
        };
        match marks(r) {
            Some(m) => {
                let seq: Vec<u64> = [Some(m.arrive), Some(m.submit), Some(m.scheduled), m.first_token, m.ttft, Some(m.done)].into_iter().flatten().collect();
                assert!(seq.windows(2).all(|w| w[0] <= w[1]), "{ctx} {}: marks out of order {m:?}", r.id);
                assert!(p.frontend.is_some() && p.queue.is_some() && p.prefill.is_some(), "{ctx} {}: {p:?}", r.id);
                assert_eq!(p.first_output.is_some(), m.first_token.is_some() && m.ttft.is_some(), "{ctx} {}: {p:?}", r.id);
                assert_eq!(p.decode.is_some(), m.first_token.is_some() || m.ttft.is_some(), "{ctx} {}: {p:?}", r.id);
                assert_eq!(p.clamped, m.clamped);
                // Exact in nanoseconds: the marks tile [arrive, done].
                let tiles: u64 = seq.windows(2).map(|w| w[1] - w[0]).sum();
                assert_eq!(tiles, end.saturating_sub(r.arrive_ns), "{ctx} {}: {m:?}", r.id);
                // And within 1e-6 ms in the report's float milliseconds (a few
                // ulps more only for absurd spans, from extreme perturbations:
                // an f64 near 9e12 ms cannot hold 1e-6).
                let sum: f64 = parts.iter().flatten().sum();
                let e2e = r.e2e_ms().or(r.closed_ms()).expect("finished or closed");
                let tol = 1e-6_f64.max(e2e * 1e-15);
                assert!((sum - e2e).abs() <= tol, "{ctx} {}: phases {p:?} add to {sum}, e2e {e2e}", r.id);
            }
            None => {
                assert!(r.engine.is_none());
                assert_eq!((p.frontend, p.queue, p.prefill, p.first_output), (None, None, None, None), "{ctx} {}: wire only", r.id);
                assert_eq!(p.decode, r.decode_ms(), "{ctx} {}", r.id);
            }
        }
        if let Some(d) = r.read_delay_ms() {
            assert!(d >= 0.0);
        }
    }

    // Chains: every request in exactly one, hops 1..n in arrival order.
    let mut seen = vec![0u32; a.requests.len()];
    for c in &a.chains {
        assert!(!c.hops.is_empty(), "{ctx}: empty chain {}", c.chain);
        for (n, &i) in c.hops.iter().enumerate() {
            seen[i] += 1;
            let r = &a.requests[i];
            assert_eq!(r.hop, n as u32 + 1, "{ctx}: chain {} hop numbers", c.chain);
            assert_eq!((&r.chain, r.chain_source), (&c.chain, c.source), "{ctx}");
        }
        assert!(c.hops.windows(2).all(|w| a.requests[w[0]].arrive_ns <= a.requests[w[1]].arrive_ns), "{ctx}: chain {} out of arrival order", c.chain);
    }
    assert!(seen.iter().all(|&n| n == 1), "{ctx}: every request in exactly one chain");

    // Loss counters, against a model of the open (connection, seq) table.
    let mut open: HashSet<(ConnKey, u32)> = HashSet::new();
    let mut want: BTreeMap<&str, u64> = BTreeMap::new();
    let mut recorded: BTreeMap<String, u64> = BTreeMap::new();
    // Each request's model: its own, else the first its response named
    // while it was open.
    let mut slot: HashMap<(ConnKey, u32), usize> = HashMap::new();
    let mut models: Vec<(i32, u32, u64, Option<String>)> = Vec::new();
    for r in recs {
        let orphan = match r {
            Record::HttpRequest { conn, seq, role: HttpRole::Server, start_ns, ready_ns, model, .. } => {
                slot.insert((*conn, *seq), models.len());
                models.push((conn.fd, *seq, *start_ns, model.clone()));
                if !open.insert((*conn, *seq)) {
                    *want.entry("requests_duplicated").or_default() += 1;
                }
                if ready_ns.is_some_and(|w| w > *start_ns || start_ns - w > 60_000_000_000) {
                    *want.entry("wire_arrival_implausible").or_default() += 1;
                }
                None
            }
            Record::HttpResponse { conn, seq, role: HttpRole::Server, .. } => (!open.contains(&(*conn, *seq))).then_some("responses_without_request"),
            Record::Sse { conn, seq, .. } => (!open.contains(&(*conn, *seq))).then_some("sse_without_request"),
            Record::ResponseBody { conn, seq, .. } => (!open.contains(&(*conn, *seq))).then_some("bodies_without_request"),
            Record::ResponseModel { conn, seq, model, .. } => match open.contains(&(*conn, *seq)).then(|| &mut models[slot[&(*conn, *seq)]].3) {
                Some(m @ None) => {
                    *m = Some(model.clone());
                    *want.entry("request_model_from_response").or_default() += 1;
                    None
                }
                Some(Some(asked)) if asked != model => Some("response_model_differs"),
                Some(Some(_)) => None,
                None => Some("response_models_without_request"),
            },
            Record::HttpResponseEnd { conn, seq, .. } => (!open.remove(&(*conn, *seq))).then_some("response_ends_without_request"),
            // Requests still open on a closed connection end there.
            Record::ConnClose { conn, .. } => {
                let before = open.len();
                open.retain(|(c, _)| c != conn);
                *want.entry("requests_closed_unfinished").or_default() += (before - open.len()) as u64;
                None
            }
            Record::Drops { counters, .. } => {
                recorded.extend(counters.iter().cloned());
                None
            }
            _ => None,
        };
        if let Some(k) = orphan {
            *want.entry(k).or_default() += 1;
        }
    }
    if !open.is_empty() {
        want.insert("requests_unfinished", open.len() as u64);
    }
    for k in ["requests_duplicated", "wire_arrival_implausible", "responses_without_request", "sse_without_request", "bodies_without_request", "response_ends_without_request", "requests_unfinished", "request_model_from_response", "response_model_differs", "response_models_without_request", "requests_closed_unfinished"] {
        assert_eq!(count(&a, k), want.get(k).copied().unwrap_or(0), "{ctx}: counter {k}");
    }
    let mut got: Vec<(i32, u32, u64, Option<String>)> = a.requests.iter().map(|r| (r.conn.fd, r.seq, r.arrive_ns, r.model.clone())).collect();
    got.sort();
    models.sort();
    assert_eq!(got, models, "{ctx}: each request's model is the first its response named");
    let unended = a.requests.iter().filter(|r| r.response_end_ns.is_none()).count() as u64;
    assert_eq!(
        unended,
        count(&a, "requests_unfinished") + count(&a, "requests_duplicated") + count(&a, "requests_closed_unfinished"),
        "{ctx}: every request without an end is open, displaced or closed"
    );
    // Recorded snapshots: the latest value of each counter wins.
    for (k, v) in &recorded {
        if !k.starts_with("engine_") && !k.starts_with("requests_") {
            assert_eq!(a.drops.get(k), Some(v), "{ctx}: recorded counter {k}");
        }
    }

    // Engine side: every engine request is linked, unlinked, extra, or had no ADD.
    let has_writer = recs.iter().any(|r| matches!(r, Record::EngineOutputs { dir: Dir::Out, .. }));
    let mut ids: BTreeSet<&str> = BTreeSet::new();
    let mut step_msgs = 0u64;
    for r in recs {
        match r {
            Record::EngineRequest { request_id, .. } => {
                ids.insert(request_id);
            }
            Record::EngineAbort { request_ids, .. } => ids.extend(request_ids.iter().map(String::as_str)),
            Record::EngineOutputs { dir, outputs, .. } if *dir == Dir::Out || !has_writer => {
                step_msgs += 1;
                ids.extend(outputs.iter().map(|o| o.request_id.as_str()));
            }
            _ => {}
        }
    }
    let linked = a.requests.iter().filter(|r| r.engine.is_some()).count() as u64;
    assert_eq!(count(&a, "engine_requests_linked") + count(&a, "engine_requests_linked_by_abort"), linked, "{ctx}: joined by id or by abort");
    let accounted = linked + count(&a, "engine_requests_unlinked") + count(&a, "engine_requests_extra") + count(&a, "engine_outputs_without_request");
    assert_eq!(accounted, ids.len() as u64, "{ctx}: engine requests accounted for");
    // A step sent to several API servers is one message each, joined back.
    let joined = count(&a, "engine_outputs_joined") + count(&a, "engine_reader_outputs_joined");
    assert_eq!(a.steps.len() as u64 + joined, step_msgs, "{ctx}: one step per output message (writer's copies when traced) but those joined into their step");
    for s in &a.steps {
        assert!(s.end_ns <= s.sent_ns, "{ctx}: a step ends before its output is sent");
    }
    for r in &a.requests {
        if let Some(e) = &r.engine {
            assert!(!e.interference_from.iter().any(|n| **n == *r.id), "{ctx} {}: no request interferes with itself", r.id);
            assert!(e.steps as usize <= a.steps.len());
        }
    }

    // The recording's span.
    let ts: Vec<u64> = recs.iter().map(Record::ts_ns).filter(|&t| t > 0).collect();
    assert_eq!((a.first_ns, a.last_ns), (ts.iter().min().copied(), ts.iter().max().copied()), "{ctx}");
    a
}

fn fixture_records() -> Vec<(&'static str, Vec<Record>)> {
    ["chain3", "queue2", "tp_chunked", "long_adds", "structured"]
        .into_iter()
        .map(|n| {
            let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(format!("{n}.hop"));
            let loaded = recording::load(&path).expect("fixture opens");
            assert!(loaded.error.is_none());
            (n, loaded.records)
        })
        .collect()
}

/// What a batch of cases exercised, so a test can insist it tested something.
#[derive(Debug, Default)]
struct Seen {
    requests: u64,
    /// Requests with every engine mark (the partition checked against E2E).
    partitioned: u64,
    clamped: u64,
    unfinished: u64,
    orphans: u64,
}

fn mutated_cases(test: &str, n: u64, pick: impl Fn(&mut Rng) -> Vec<Mutation>) -> Seen {
    let fixtures = fixture_records();
    let seen = std::cell::RefCell::new(Seen::default());
    for_cases(test, n, |seed| {
        let mut rng = Rng::new(seed);
        // Two cases in three synthetic, one from a fixture.
        let (name, mut recs) = if rng.below(3) == 0 {
            let (n, r) = &fixtures[rng.below(fixtures.len())];
            (n.to_string(), r.clone())
        } else {
            ("synthetic".to_string(), synthetic(rng.next()).records)
        };
        let ms = pick(&mut rng);
        for &m in &ms {
            mutate(&mut recs, m, &mut rng);
        }
        let a = check(&recs, &format!("{name} {ms:?}"));
        let mut s = seen.borrow_mut();
        s.requests += a.requests.len() as u64;
        for r in &a.requests {
            if let Some(m) = marks(r) {
                s.partitioned += 1;
                s.clamped += u64::from(m.clamped > 0);
            }
        }
        s.unfinished += count(&a, "requests_unfinished");
        s.orphans += count(&a, "sse_without_request") + count(&a, "response_ends_without_request");
    });
    let s = seen.into_inner();
    eprintln!("{test}: {n} cases: {s:?}");
    assert!(s.partitioned > n, "{test}: too few partitions checked: {s:?}");
    s
}

// ------------------------------------------------------------------ tests

#[test]
fn clean_synthetic_streams_give_back_the_generated_phases_chains_and_hops() {
    // What the cases covered: scheduled sources, chain sources, wake-ups,
    // preemptions, reader-only IPC, queueing.
    let covered: std::cell::RefCell<BTreeMap<String, u64>> = Default::default();
    for_cases("clean", cases(400), |seed| {
        let s = synthetic(seed);
        {
            let mut c = covered.borrow_mut();
            for t in &s.truth {
                *c.entry(format!("scheduled:{}", t.scheduled_source)).or_default() += 1;
                *c.entry(format!("chain:{:?}", t.source)).or_default() += 1;
                *c.entry("preempted".into()).or_default() += u64::from(t.preemptions > 0);
                *c.entry("woken".into()).or_default() += u64::from(t.woken);
                *c.entry("woken_spanning_writes".into()).or_default() += u64::from(t.woken && t.spanned);
                *c.entry("queued".into()).or_default() += u64::from(t.scheduled > t.submit + 5 * MS);
                *c.entry("gave_up".into()).or_default() += u64::from(t.closed.is_some());
                // Its first content after two or more outputs.
                *c.entry("held_back".into()).or_default() += u64::from(t.closed.is_none() && t.outputs_at.iter().filter(|&&o| o <= t.ttft).count() > 1);
            }
            *c.entry("named_by_response".into()).or_default() += s.records.iter().filter(|r| matches!(r, Record::ResponseModel { .. })).count() as u64;
            let reader_only = !s.records.iter().any(|r| matches!(r, Record::EngineOutputs { dir: Dir::Out, .. }));
            *c.entry("reader_only".into()).or_default() += u64::from(reader_only);
            if s.clients > 1 {
                *c.entry("two_api_servers".into()).or_default() += 1;
                *c.entry("two_api_servers_reader_only".into()).or_default() += u64::from(reader_only);
                *c.entry("part_sent_ms_late".into()).or_default() += s.late_parts;
                *c.entry("two_api_servers_with_stats".into()).or_default() += u64::from(s.stats);
            }
        }
        let a = check(&s.records, "clean");
        assert_eq!(a.requests.len(), s.truth.len() + s.health, "every request found");
        assert_eq!(a.steps.len(), s.steps, "every output step found");
        assert_eq!(a.drops.get("requests_unfinished"), None);
        let gave_up = s.truth.iter().filter(|t| t.closed.is_some()).count() as u64;
        assert_eq!(count(&a, "engine_requests_linked"), s.truth.len() as u64 - gave_up, "every engine request joined");
        assert_eq!(count(&a, "engine_requests_linked_by_abort"), gave_up, "each client that gave up joined by its abort");
        assert_eq!(count(&a, "requests_closed_unfinished"), gave_up);
        let by_id: HashMap<&str, &hopscope::correlate::Request> = a.requests.iter().map(|r| (r.id.as_str(), r)).collect();
        let chains: BTreeSet<&str> = s.truth.iter().map(|t| t.chain.as_str()).collect();
        assert_eq!(a.chains.len(), chains.len() + s.health, "chains");
        for t in &s.truth {
            let r = by_id.get(t.id.as_str()).unwrap_or_else(|| panic!("{} not found", t.id));
            assert_eq!((&r.chain, r.chain_source, r.hop), (&t.chain, t.source, t.hop), "{}", t.id);
            assert_eq!(r.x_request_id, t.x_request_id);
            let e = r.engine.as_ref().expect("joined");
            assert_eq!(e.scheduled_source, t.scheduled_source, "{}", t.id);
            let m = marks(r).expect("marks");
            let span = |a: u64, b: u64| Some((b - a) as f64 / 1e6);
            if let Some(close) = t.closed {
                // Frontend, then queue to the close; nothing after.
                assert_eq!((r.closed_ns, r.done_ns, e.steps), (Some(close), None, 0), "{}", t.id);
                let got = (m.arrive, m.submit, m.scheduled, m.first_token, m.ttft, m.done, m.clamped);
                assert_eq!(got, (t.arrive, t.submit, close, None, None, close, 0), "{}: marks", t.id);
                let p = partition(r);
                assert_eq!([p.frontend, p.queue, p.prefill, p.first_output, p.decode], [span(t.arrive, t.submit), span(t.submit, close), Some(0.0), None, None], "{}: phases", t.id);
                continue;
            }
            assert_eq!((e.steps, e.preemptions), (t.steps, t.preemptions), "{}", t.id);
            assert_eq!(r.usage.completion_tokens, Some(t.tokens));
            let got = (m.arrive, m.submit, m.scheduled, m.first_token, m.ttft, m.done, m.clamped);
            let want = (t.arrive, t.submit, t.scheduled, Some(t.first_token), Some(t.ttft), t.done, 0);
            assert_eq!(got, want, "{}: marks", t.id);
            let p = partition(r);
            assert_eq!(
                [p.frontend, p.queue, p.prefill, p.first_output, p.decode],
                [span(t.arrive, t.submit), span(t.submit, t.scheduled), span(t.scheduled, t.first_token), span(t.first_token, t.ttft), span(t.ttft, t.done)],
                "{}: phases",
                t.id
            );
            assert_eq!(last_output_ms(r), span(t.last_output, t.done), "{}: last output", t.id);
            // What the engine made by the first content: its outputs that
            // ended by then (held ones, and the next step's when the content
            // left after it ended).
            let before: Vec<u64> = t.outputs_at.iter().copied().filter(|&o| o <= t.ttft).collect();
            assert_eq!(e.tokens_before_first_content, Some(before.len().max(1) as u64), "{}: tokens before the first content", t.id);
            let last = before.iter().copied().max().unwrap_or(t.first_token).max(t.first_token);
            assert_eq!(first_output_held_ms(r), span(t.first_token, last), "{}: held back", t.id);

            assert_eq!(scheduler_queue_ms(r), t.queued.and_then(|q| span(q, t.scheduled)), "{}: scheduler queue", t.id);
        }
    });
    let c = covered.into_inner();
    eprintln!("clean: covered {c:?}");
    for k in ["scheduled:event", "scheduled:step", "scheduled:submit", "chain:Traceparent", "chain:Header", "chain:Connection", "preempted", "queued", "reader_only", "woken", "woken_spanning_writes", "two_api_servers", "two_api_servers_reader_only", "part_sent_ms_late", "two_api_servers_with_stats", "named_by_response", "gave_up", "held_back"] {
        assert!(c.get(k).copied().unwrap_or(0) > 0, "no case covered {k}: {c:?}");
    }
}

#[test]
fn shuffled_streams_never_panic_and_keep_the_partition_exact() {
    let s = mutated_cases("shuffle", cases(300), |rng| vec![if rng.chance(0.5) { Mutation::Shuffle } else { Mutation::LocalShuffle }]);
    assert!(s.orphans > 0 && s.unfinished > 0, "{s:?}");
}

#[test]
fn duplicated_records_are_counted_and_keep_the_partition_exact() {
    let s = mutated_cases("duplicate", cases(300), |_| vec![Mutation::Duplicate]);
    assert!(s.orphans > 0, "{s:?}");
}

#[test]
fn dropped_records_are_counted_and_keep_the_partition_exact() {
    let s = mutated_cases("drop", cases(300), |_| vec![Mutation::Drop]);
    assert!(s.orphans > 0 && s.unfinished > 0, "{s:?}");
}

#[test]
fn truncated_streams_count_unfinished_requests_and_keep_the_partition_exact() {
    let s = mutated_cases("truncate", cases(300), |_| vec![Mutation::Truncate]);
    assert!(s.orphans > 0 && s.unfinished > 0, "{s:?}");
}

#[test]
fn time_perturbed_streams_clamp_marks_and_keep_the_partition_exact() {
    let s = mutated_cases("perturb", cases(300), |_| vec![Mutation::Perturb]);
    assert!(s.clamped > 0, "out-of-order marks were clamped: {s:?}");
}

#[test]
fn streams_damaged_several_ways_at_once_never_panic_and_keep_the_partition_exact() {
    let s = mutated_cases("mixed", cases(600), |rng| (0..rng.range(2, 5)).map(|_| ALL[rng.below(ALL.len())]).collect());
    assert!(s.clamped > 0 && s.orphans > 0 && s.unfinished > 0, "{s:?}");
}

/// Without the engine IPC a fixture falls back to the wire: the same
/// requests, ids, chains, hops, TTFT and E2E, only the engine phases gone.
#[test]
fn fixture_streams_without_the_engine_ipc_keep_their_wire_figures() {
    for (name, recs) in fixture_records() {
        let full = check(&recs, name);
        let wire: Vec<Record> = recs.iter().filter(|r| !matches!(r, Record::EngineRequest { .. } | Record::EngineOutputs { .. } | Record::EngineAbort { .. })).cloned().collect();
        let a = check(&wire, name);
        assert_eq!(a.requests.len(), full.requests.len());
        assert!(a.steps.is_empty());
        for (x, y) in a.requests.iter().zip(&full.requests) {
            assert!(x.engine.is_none());
            assert_eq!((&x.id, &x.chain, x.hop, x.ttft_ns, x.done_ns), (&y.id, &y.chain, y.hop, y.ttft_ns, y.done_ns), "{name}");
            assert_eq!(partition(x).decode, partition(y).decode.map(|_| x.decode_ms().unwrap()), "{name} {}", x.id);
        }
    }
}

/// Without the scheduler records only the hand-over times may move (to the
/// IPC write): the rest of the analysis is unchanged.
#[test]
fn fixture_streams_without_scheduler_records_keep_everything_but_the_submit() {
    for (name, recs) in fixture_records() {
        let full = check(&recs, name);
        let bare: Vec<Record> = recs.iter().filter(|r| !matches!(r, Record::OffCpu { .. } | Record::UnixIo { .. })).cloned().collect();
        let a = check(&bare, name);
        for (x, y) in a.requests.iter().zip(&full.requests) {
            assert_eq!((&x.id, x.hop, x.ttft_ns, x.done_ns), (&y.id, y.hop, y.ttft_ns, y.done_ns), "{name}");
            if let (Some(ex), Some(ey)) = (&x.engine, &y.engine) {
                assert!(ex.submit_ns >= ey.submit_ns, "{name} {}: a wake-up only moves the hand-over earlier", x.id);
                assert_eq!((ex.first_token_ns, ex.steps), (ey.first_token_ns, ey.steps));
            }
        }
    }
}

/// Moves every time in a record by `d` ns (engine seconds too).
fn offset(r: &mut Record, d: u64) {
    let s = d as f64 / 1e9;
    match r {
        Record::HttpRequest { start_ns, end_ns, ready_ns, .. } => {
            *start_ns += d;
            *end_ns += d;
            if let Some(x) = ready_ns {
                *x += d;
            }
        }
        Record::OffCpu { ts_ns, wake_ns, off_ns, .. } => {
            *ts_ns += d;
            *off_ns += d;
            if let Some(x) = wake_ns {
                *x += d;
            }
        }
        Record::UnixIo { ts_ns, enter_ns, .. } => {
            *ts_ns += d;
            *enter_ns += d;
        }
        Record::EngineRequestStart { ts_ns, first_ns, .. } => {
            *ts_ns += d;
            *first_ns += d;
        }
        Record::EngineOutputs { ts_ns, timestamp_s, outputs, .. } => {
            *ts_ns += d;
            if let Some(t) = timestamp_s {
                *t += s;
            }
            for o in outputs {
                for e in &mut o.events {
                    e.timestamp_s += s;
                }
            }
        }
        Record::ConnOpen { ts_ns, .. }
        | Record::ConnClose { ts_ns, .. }
        | Record::HttpResponse { ts_ns, .. }
        | Record::Sse { ts_ns, .. }
        | Record::ResponseBody { ts_ns, .. }
        | Record::HttpResponseEnd { ts_ns, .. }
        | Record::Unparsed { ts_ns, .. }
        | Record::Proc { ts_ns, .. }
        | Record::Drops { ts_ns, .. }
        | Record::RawIo { ts_ns, .. }
        | Record::EngineRequest { ts_ns, .. }
        | Record::EngineAbort { ts_ns, .. } => *ts_ns += d,
        #[allow(unreachable_patterns)]
        _ => {}
    }
}

#[test]
fn requests_handed_out_at_random_horizons_are_exactly_the_all_at_once_ones() {
    // Several synthetic runs a few seconds apart (longer than the settle
    // window), so that requests become final while the stream goes on.
    let early = std::cell::Cell::new(0u64);
    for_cases("streaming", cases(150), |seed| {
        let mut rng = Rng::new(seed);
        let mut recs: Vec<Record> = Vec::new();
        let mut at = 0;
        // A recording sees the engine's side of the IPC throughout or never
        // (switching mid-way is counted, not replayed exactly).
        let writer = |s: &Synthetic| s.records.iter().any(|r| matches!(r, Record::EngineOutputs { dir: Dir::Out, .. }));
        let mut k = 0u64;
        let mut first_writer = None;
        for _ in 0..rng.range(2, 6) {
            let s = loop {
                k += 1;
                let s = synthetic(seed.wrapping_add(k.wrapping_mul(0x9E37_79B9)));
                if *first_writer.get_or_insert(writer(&s)) == writer(&s) {
                    break s;
                }
            };
            for mut r in s.records {
                offset(&mut r, at);
                recs.push(r);
            }
            at += rng.range(1_000, 6_000) * MS;
        }
        recs.sort_by_key(Record::ts_ns);
        let whole = check(&recs, &format!("streaming {seed:#x}"));

        let mut c = Correlator::new(Config::default());
        let (mut got, mut steps) = (Vec::new(), Vec::new());
        let p = [0.001, 0.01, 0.2][rng.below(3)];
        for r in &recs {
            c.ingest(r);
            if rng.chance(p) {
                let out = c.drain_final(r.ts_ns());
                early.set(early.get() + out.len() as u64);
                got.extend(out);
                if rng.chance(0.5) {
                    steps.extend(c.take_steps());
                }
            }
        }
        let tail = c.finish_streaming();
        got.extend(tail.requests);
        steps.extend(tail.steps);
        assert_eq!(got.len(), whole.requests.len());
        for (g, w) in got.iter().zip(&whole.requests) {
            assert_eq!(g, w, "the same request, streamed or not");
        }
        assert_eq!(steps, whole.steps);
        assert_eq!(tail.drops, whole.drops, "the same counters");
        assert_eq!(hopscope::correlate::chains_of(&got), whole.chains, "the same chains and hops");
        for r in &got {
            let p = partition(r);
            if let (Some(e2e), Some(_)) = (r.e2e_ms(), r.engine.as_ref()) {
                let sum: f64 = [p.frontend, p.queue, p.prefill, p.first_output, p.decode].iter().flatten().sum();
                assert!((sum - e2e).abs() <= 1e-6, "{}: phases add up to {sum}, e2e {e2e}", r.id);
            }
        }
    });
    assert!(early.get() > 0, "some requests were handed out before the end");
}

#[test]
fn the_streamed_json_report_of_a_long_recording_equals_the_in_memory_one() {
    for_cases("streamed-json", cases(12), |seed| {
        let mut rng = Rng::new(seed);
        let mut recs: Vec<Record> = Vec::new();
        let (mut at, mut k) = (0, 0u64);
        let writer = |s: &Synthetic| s.records.iter().any(|r| matches!(r, Record::EngineOutputs { dir: Dir::Out, .. }));
        let mut first_writer = None;
        for _ in 0..rng.range(3, 8) {
            let s = loop {
                k += 1;
                let s = synthetic(seed.wrapping_add(k.wrapping_mul(0x9E37_79B9)));
                if *first_writer.get_or_insert(writer(&s)) == writer(&s) {
                    break s;
                }
            };
            for mut r in s.records {
                offset(&mut r, at);
                recs.push(r);
            }
            at += rng.range(3_000, 9_000) * MS;
        }
        recs.sort_by_key(Record::ts_ns);
        let mut w = recording::Writer::new(Vec::new(), &Meta::default()).expect("writer");
        for r in &recs {
            w.push(r).expect("push");
        }
        let bytes = w.finish(recs.last().map_or(0, Record::ts_ns)).expect("finish");
        let mut reader = recording::Reader::new(&bytes[..]).expect("reader");
        let meta = reader.meta().clone();
        let mut got = Vec::new();
        let err = report::write_json(&mut reader, "prop.hop", Config::default(), hopscope::sink::summary::DEFAULT_PERCENTILES, &mut got).expect("streamed report");
        assert_eq!(err, None);
        let want = serde_json::to_string_pretty(&report::build("prop.hop", &meta, &run(&recs), None)).expect("report serializes") + "\n";
        assert_eq!(String::from_utf8(got).expect("utf-8"), want);
    });
}

#[test]
fn damaged_streams_handed_out_at_random_horizons_give_every_request_exactly_once() {
    for_cases("streaming-damaged", cases(150), |seed| {
        let mut rng = Rng::new(seed);
        let mut recs: Vec<Record> = Vec::new();
        let mut at = 0;
        for k in 0..rng.range(2, 5) {
            for mut r in synthetic(seed.wrapping_add(k.wrapping_mul(0x9E37_79B9))).records {
                offset(&mut r, at);
                recs.push(r);
            }
            at += rng.range(1_000, 6_000) * MS;
        }
        recs.sort_by_key(Record::ts_ns);
        for _ in 0..rng.range(1, 3) {
            mutate(&mut recs, ALL[rng.below(ALL.len())], &mut rng);
        }
        let mut c = Correlator::new(Config::default());
        let mut got = Vec::new();
        let mut now = 0;
        for r in &recs {
            c.ingest(r);
            now = now.max(r.ts_ns());
            if rng.chance(0.05) {
                got.extend(c.drain_final(now));
            }
        }
        let tail = c.finish_streaming();
        got.extend(tail.requests);
        assert_eq!(got.len(), recs.iter().filter_map(server_key).count(), "every request handed out once");
        // Hops count up by one per chain in the order they were handed out.
        let mut hops: HashMap<(String, u8), u32> = HashMap::new();
        for r in &got {
            let h = hops.entry((r.chain.clone(), r.chain_source as u8)).or_default();
            *h += 1;
            assert_eq!(r.hop, *h, "chain {} hop numbers", r.chain);
        }
    });
}
