//! `record --otlp URL`: the spans of each request sent while recording.
//!
//! The recorder's pipeline hands every record it writes to [`LiveOtlp::push`]
//! (in file order, across rotations), which runs the report's streaming
//! correlator on it: a request's spans are made once it is final (a few
//! seconds after it ends: the correlator's settle time) and are the spans
//! `hopscope export otlp` makes from the recording. A session chain's span
//! goes once the chain has been idle for `chain_idle_ns` of recording time
//! (no hop of it held, its last hop ended that long ago), or at stop.
//!
//! Sending is a thread of its own behind a bounded queue: a slow or absent
//! collector never holds up the recording. What it cannot send is counted
//! ([`Tally`]) and said, and the recording keeps everything.

use super::{send, spans_of, wrap, ChainSpans, Span, BATCH_SPANS};
use crate::correlate::{ChainSource, Config, FxMap, Request};
use crate::model::Record;
use crate::recording::Meta;
use crate::sink::report::{RequestFeed, RequestRef};
use crate::sink::summary::GpuMemIndex;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Spans waiting to be sent, at most: ~0.5 KiB each, so ~16 MiB, about a
/// minute of a busy server's spans behind a collector that stalled.
pub const MAX_QUEUED_SPANS: usize = 8 * BATCH_SPANS;
/// Pending spans go out at least this often (recording time).
const FLUSH_NS: u64 = 1_000_000_000;
/// A message the collector did not take is tried again after 1, 2 and 4 s,
/// then given up (counted): meanwhile the queue holds what comes.
const RETRY_WAITS: [Duration; 3] = [Duration::from_secs(1), Duration::from_secs(2), Duration::from_secs(4)];

/// What the live export did with the spans it made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tally {
    /// Spans made (requests' and chains').
    pub spans: u64,
    /// Requests whose spans were made (finished ones).
    pub requests: u64,
    /// Spans the collector accepted, and in how many messages.
    pub sent: u64,
    pub posts: u64,
    /// Spans dropped because the queue was full (the collector slower than
    /// the server, or unreachable for long).
    pub dropped: u64,
    /// Spans in messages the collector refused or did not answer, retries
    /// included.
    pub failed: u64,
    /// Spans still queued or in flight when the stop deadline passed.
    pub unsent: u64,
    /// Hops that became final after their chain's span was sent (the chain
    /// was idle longer than the idle time between two hops): their chain
    /// span's end and hop count leave them out.
    pub hops_after_chain_span: u64,
}

impl Tally {
    /// The counts made here (`self`: spans, requests, late hops) with the
    /// sending thread's (`delivery`: what became of them).
    fn with_delivery(&self, delivery: Tally) -> Tally {
        Tally { spans: self.spans, requests: self.requests, hops_after_chain_span: self.hops_after_chain_span, ..delivery }
    }

    /// Spans made and not accepted by the collector.
    pub fn lost(&self) -> u64 {
        self.dropped + self.failed + self.unsent
    }
}

#[derive(Default)]
struct Queue {
    msgs: VecDeque<Vec<Span>>,
    queued: usize,
    /// Spans of the message the thread is sending.
    in_flight: usize,
    closing: bool,
    tally: Tally,
    /// The collector's error while sends fail.
    failing: Option<String>,
    /// Spans dropped since the queue last had room.
    dropping: u64,
    notes: Vec<String>,
}

struct Shared {
    q: Mutex<Queue>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        // A panic in the sender thread leaves the queue as it was: usable.
        self.q.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The live exporter: correlator, chain spans, and the sending thread.
pub struct LiveOtlp {
    meta: Meta,
    endpoint: String,
    feed: RequestFeed,
    gpu_mem: GpuMemIndex,
    chains: ChainSpans,
    chain_idle_ns: u64,
    spans: Vec<Span>,
    last_flush_ns: Option<u64>,
    /// Made here, not by the thread.
    made: Tally,
    shared: Arc<Shared>,
    /// Also handed every request as it is handed out (`--metrics`' phase
    /// histograms: one correlator for both).
    hook: Option<RequestHook>,
}

/// What else takes each request the live correlator hands out.
pub type RequestHook = Box<dyn FnMut(&Request, &RequestRef)>;

impl LiveOtlp {
    /// Starts the sending thread. `endpoint` is checked as [`send`] reads it.
    pub fn start(meta: &Meta, cfg: Config, endpoint: &str, chain_idle: Duration) -> Result<Self, super::OtlpError> {
        super::endpoint_parts(endpoint)?;
        let shared = Arc::new(Shared { q: Mutex::new(Queue::default()), cv: Condvar::new() });
        let (t_shared, t_meta, t_endpoint, t_resource) = (Arc::clone(&shared), meta.clone(), endpoint.to_owned(), super::resource(meta));
        std::thread::Builder::new()
            .name("hopscope-otlp".into())
            .spawn(move || sender(&t_shared, &t_resource, &t_meta, &t_endpoint))
            .map_err(|e| super::OtlpError::Connect { endpoint: endpoint.to_owned(), source: e })?;
        Ok(LiveOtlp {
            meta: meta.clone(),
            endpoint: endpoint.to_owned(),
            feed: RequestFeed::new(cfg),
            gpu_mem: GpuMemIndex::default(),
            chains: ChainSpans::default(),
            chain_idle_ns: u64::try_from(chain_idle.as_nanos()).unwrap_or(u64::MAX),
            spans: Vec::new(),
            last_flush_ns: None,
            made: Tally::default(),
            shared,
            hook: None,
        })
    }

    /// Hands every request to `hook` too, as it is handed out.
    pub fn set_request_hook(&mut self, hook: RequestHook) {
        self.hook = Some(hook);
    }

    /// Takes the next record written (file order).
    pub fn push(&mut self, rec: &Record) {
        self.gpu_mem.ingest(rec);
        let LiveOtlp { meta, feed, gpu_mem, chains, spans, made, hook, .. } = self;
        let mut put = |r: &Request, q: &RequestRef| -> Result<(), Infallible> {
            if let Some(h) = hook.as_mut() {
                h(r, q);
            }
            take(meta, chains, spans, made, r, q);
            Ok(())
        };
        let Ok(drained) = feed.push(rec, gpu_mem, &mut put, &mut |_, _| Ok::<(), Infallible>(()));
        if let Some(now) = drained {
            // NVML points for the peaks of requests still to come: a request
            // is handed out at most MAX_OPEN_NS after it arrived.
            self.gpu_mem.forget_before(now.saturating_sub(2 * crate::correlate::MAX_OPEN_NS));
            self.take_idle_chains(now);
            if self.spans.len() >= BATCH_SPANS || self.last_flush_ns.is_none_or(|t| now >= t.saturating_add(FLUSH_NS)) {
                self.flush();
                self.last_flush_ns = Some(now);
            }
        } else if self.spans.len() >= BATCH_SPANS {
            self.flush();
        }
    }

    fn take_idle_chains(&mut self, now: u64) {
        let Some(cutoff) = now.checked_sub(self.chain_idle_ns) else { return };
        let mut held: FxMap<&str, ()> = FxMap::default();
        for (chain, source) in self.feed.correlator().held_chains() {
            if source == ChainSource::Header {
                held.insert(chain, ());
            }
        }
        let before = self.spans.len();
        self.chains.take_idle(&self.meta, cutoff, &held, &mut self.spans);
        self.made.spans += (self.spans.len() - before) as u64;
    }

    /// Queues what is pending; drops it (counted) when the queue is full.
    fn flush(&mut self) {
        if self.spans.is_empty() {
            return;
        }
        let msg = std::mem::take(&mut self.spans);
        let n = msg.len();
        let mut q = self.shared.lock();
        if q.queued + n > MAX_QUEUED_SPANS {
            if q.dropping == 0 {
                let why = q.failing.as_ref().map_or_else(|| "the collector is slower than the server".to_owned(), |e| e.clone());
                q.notes.push(format!("otlp: {MAX_QUEUED_SPANS} spans are waiting to be sent ({why}): dropping new ones until there is room (the recording keeps them)"));
            }
            q.tally.dropped += n as u64;
            q.dropping += n as u64;
            return;
        }
        if q.dropping > 0 {
            let n = std::mem::take(&mut q.dropping);
            q.notes.push(format!("otlp: the queue has room again ({n} spans dropped)"));
        }
        q.queued += n;
        q.msgs.push_back(msg);
        self.shared.cv.notify_all();
    }

    /// Lines for the user since the last call (the collector failing or
    /// answering again, spans dropped).
    pub fn take_notes(&mut self) -> Vec<String> {
        std::mem::take(&mut self.shared.lock().notes)
    }

    /// The counts so far.
    pub fn tally(&self) -> Tally {
        self.made.with_delivery(self.shared.lock().tally)
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Recording stopped: the requests not handed out yet and every chain
    /// left get their spans, and what is queued is sent, within `deadline`
    /// (no retries by then: a collector that is down costs the deadline at
    /// most). What is still queued then is counted as unsent.
    pub fn finish(self, deadline: Duration) -> Tally {
        let LiveOtlp { meta, feed, gpu_mem, mut chains, mut spans, mut made, shared, mut hook, .. } = self;
        let mut put = |r: &Request, q: &RequestRef| -> Result<(), Infallible> {
            if let Some(h) = hook.as_mut() {
                h(r, q);
            }
            take(&meta, &mut chains, &mut spans, &mut made, r, q);
            Ok(())
        };
        let Ok(_) = feed.finish(&gpu_mem, &mut put, &mut |_, _| Ok::<(), Infallible>(()));
        let before = spans.len();
        chains.finish(&meta, &mut spans);
        made.spans += (spans.len() - before) as u64;
        let until = Instant::now() + deadline;
        let mut q = shared.lock();
        // The last messages go in whatever the queue holds: they are bounded
        // by what was open, and the deadline bounds the wait.
        for chunk in spans.chunks(BATCH_SPANS) {
            q.queued += chunk.len();
            q.msgs.push_back(chunk.to_vec());
        }
        q.closing = true;
        shared.cv.notify_all();
        while q.queued + q.in_flight > 0 {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            q = shared.cv.wait_timeout(q, left).map_or_else(|p| p.into_inner().0, |r| r.0);
        }
        q.tally.unsent = (q.queued + q.in_flight) as u64;
        made.with_delivery(q.tally)
    }
}

/// A request handed out: its spans, and its chain's extent.
fn take(meta: &Meta, chains: &mut ChainSpans, spans: &mut Vec<Span>, made: &mut Tally, r: &Request, q: &RequestRef) {
    if r.waited_until_ns().is_none() {
        return;
    }
    let before = spans.len();
    spans_of(meta, r, q, spans);
    made.spans += (spans.len() - before) as u64;
    made.requests += 1;
    // Hop numbers count every hop of the run: a later hop of a chain that
    // is not open had its chain's span sent already.
    if r.chain_source == ChainSource::Header && r.hop > 1 && !chains.is_open(&r.chain) {
        made.hops_after_chain_span += 1;
    } else {
        chains.note(r);
    }
}

/// `error: cause: cause…`, as the user reads it.
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

/// The sending thread: one message at a time, retried a few times while the
/// recorder runs, until the queue is closed and empty.
fn sender(shared: &Shared, resource: &super::Resource, meta: &Meta, endpoint: &str) {
    // A mistyped port is said at once, not when the first request ends.
    if let Err(e) = super::probe(endpoint) {
        let e = with_causes(&e);
        let mut q = shared.lock();
        q.notes.push(format!("otlp: {e}: spans will be sent as requests end, and retried then (the recording keeps them)"));
        q.failing = Some(e);
    }
    loop {
        let msg = {
            let mut q = shared.lock();
            loop {
                if let Some(m) = q.msgs.pop_front() {
                    q.queued -= m.len();
                    q.in_flight = m.len();
                    break m;
                }
                if q.closing {
                    return;
                }
                q = shared.cv.wait(q).unwrap_or_else(|p| p.into_inner());
            }
        };
        let n = msg.len() as u64;
        let req = wrap(resource, meta, msg);
        let mut waits = RETRY_WAITS.iter();
        loop {
            let res = send(endpoint, &req);
            let mut q = shared.lock();
            match res {
                Ok(_) => {
                    q.tally.sent += n;
                    q.tally.posts += 1;
                    if q.failing.take().is_some() {
                        q.notes.push(format!("otlp: {endpoint} takes spans again"));
                    }
                    break;
                }
                Err(e) => {
                    let e = with_causes(&e);
                    if q.failing.is_none() {
                        q.notes.push(format!("otlp: {e}: retrying; spans the queue cannot hold are dropped meanwhile (the recording keeps them)"));
                    }
                    q.failing = Some(e);
                    let wait = if q.closing { None } else { waits.next() };
                    let Some(wait) = wait else {
                        q.tally.failed += n;
                        break;
                    };
                    // Woken early when recording stops: no retries then.
                    let _ = shared.cv.wait_timeout_while(q, *wait, |q| !q.closing);
                }
            }
        }
        let mut q = shared.lock();
        q.in_flight = 0;
        shared.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{collector, fixture};
    use super::super::{build, ExportTraceServiceRequest, Value};
    use super::*;
    use crate::event::ConnKey;
    use crate::model::{HttpRole, SseKind};
    use crate::recording::Reader;
    use prost::Message;

    const MS: u64 = 1_000_000;

    /// A streamed request on its own connection from `t` for `len` ns, hop
    /// of session `chain`.
    fn request(out: &mut Vec<Record>, fd: i32, chain: &str, t: u64, len: u64) {
        let conn = ConnKey { tgid: 7, fd, ino: 1000 + fd as u64 };
        let headers = vec![("x-session-id".into(), chain.to_owned())];
        out.push(Record::HttpRequest { conn, role: HttpRole::Server, seq: 0, start_ns: t, end_ns: t + 10_000, tid: 7, method: "POST".into(), path: "/v1/chat/completions".into(), headers, body_len: 100, stream: Some(true), model: None, ready_ns: Some(t) });
        out.push(Record::HttpResponse { conn, role: HttpRole::Server, seq: 0, ts_ns: t + 20_000, tid: 7, status: 200, headers: vec![("content-type".into(), "text/event-stream".into())] });
        for k in 1..=4 {
            let id = Some(format!("chatcmpl-{fd}"));
            out.push(Record::Sse { conn, seq: 0, ts_ns: t + len * k / 5, kind: SseKind::Content, id, content_bytes: 4, finish_reason: None, usage: None });
        }
        out.push(Record::Sse { conn, seq: 0, ts_ns: t + len - 1, kind: SseKind::Done, id: None, content_bytes: 0, finish_reason: None, usage: None });
        out.push(Record::HttpResponseEnd { conn, seq: 0, ts_ns: t + len, body_len: 500 });
    }

    /// The requests, with the recorder's once-a-second counter records, in
    /// file order up to `end`.
    fn recording(mut recs: Vec<Record>, end: u64) -> Vec<Record> {
        recs.extend((1..=end / 1000 / MS).map(|s| Record::Drops { ts_ns: s * 1000 * MS, counters: Vec::new() }));
        recs.sort_by_key(Record::ts_ns);
        recs
    }

    fn meta() -> Meta {
        let mut m = Reader::open(&fixture()).unwrap().meta().clone();
        (m.start_ns, m.start_unix_ns) = (0, 1_700_000_000_000_000_000);
        m
    }

    fn cfg() -> Config {
        Config { chain_header: "x-session-id".into(), use_ipc: true }
    }

    /// Sends `recs` live to a local collector: what it got per message, and the tally.
    fn live_export(recs: &[Record], idle: Duration) -> (Vec<Vec<Span>>, Tally) {
        let (url, rx) = collector(Vec::new());
        let mut live = LiveOtlp::start(&meta(), cfg(), &url, idle).unwrap();
        for r in recs {
            live.push(r);
        }
        let t = live.finish(Duration::from_secs(10));
        let msgs = rx.join().unwrap().iter().map(|b| ExportTraceServiceRequest::decode(b.as_slice()).unwrap().resource_spans.remove(0).scope_spans.remove(0).spans).collect();
        (msgs, t)
    }

    fn whole_export(recs: &[Record]) -> Vec<Span> {
        let mut c = crate::correlate::Correlator::new(cfg());
        let mut gpu_mem = GpuMemIndex::default();
        for r in recs {
            c.ingest(r);
            gpu_mem.ingest(r);
        }
        build(&meta(), &c.finish(), &gpu_mem).resource_spans.remove(0).scope_spans.remove(0).spans
    }

    /// NVML samples every 100 ms up to `end`: the traced process's GPU memory
    /// is 1 GiB plus 1 MiB per 100 ms elapsed.
    fn gpu_samples(recs: &mut Vec<Record>, end: u64) {
        for k in 0..end / (100 * MS) {
            recs.push(Record::test_gpu_sample(k * 100 * MS, 0, vec![(7, (1 << 30) + k * (1 << 20))]));
        }
    }

    fn int_attr(s: &Span, key: &str) -> Option<i64> {
        match s.attributes.iter().find(|a| a.key == key)?.value.as_ref()?.value.clone() {
            Some(Value::Int(n)) => Some(n),
            other => panic!("{key}: {other:?}"),
        }
    }

    fn hops_attr(s: &Span) -> i64 {
        int_attr(s, "hopscope.chain.hops").expect("hopscope.chain.hops")
    }

    /// Fed the records as the recorder writes them, with chains never idle
    /// long enough, the live export sends exactly `export otlp`'s spans, in
    /// its order, in messages that go out as the recording goes.
    #[test]
    fn live_export_sends_the_offline_exports_spans_while_records_come() {
        // 30 requests, one every 400 ms, hops of 10 sessions.
        let mut recs = Vec::new();
        for i in 0..30u64 {
            request(&mut recs, 10 + i as i32, &format!("s{}", i % 10), 100 * MS + i * 400 * MS, 300 * MS);
        }
        gpu_samples(&mut recs, 15_000 * MS);
        let recs = recording(recs, 15_000 * MS);
        let whole = whole_export(&recs);
        assert_eq!(whole.iter().filter(|s| s.kind == 2).count(), 30);
        // Each request's span says its peak GPU memory: the last sample
        // within it (the memory only grows here).
        for s in whole.iter().filter(|s| s.kind == 2) {
            let end_ns = s.end_time_unix_nano - meta().start_unix_ns;
            let k = end_ns / (100 * MS);
            assert_eq!(int_attr(s, "hopscope.peak_gpu_mem_bytes"), Some(((1 << 30) + k * (1 << 20)) as i64), "{}", s.name);
        }
        let (msgs, t) = live_export(&recs, Duration::from_secs(3600));
        assert_eq!(msgs.concat(), whole);
        assert_eq!((t.spans, t.sent, t.requests, t.lost(), t.hops_after_chain_span), (whole.len() as u64, whole.len() as u64, 30, 0, 0), "{t:?}");
        assert_eq!(t.posts as usize, msgs.len());
        // Requests end all along the 12 s: their spans went out a second or
        // so apart (at most one message a second of recording), not at stop.
        assert!(msgs.len() >= 8, "{} messages", msgs.len());
        assert!(msgs[0].iter().all(|s| s.kind == 2), "the first message holds early requests' spans only");
    }

    /// A session idle past the limit gets its span then, not at stop; a hop
    /// that comes after it keeps that span as parent and is counted; a hop
    /// still running past the limit holds its chain's span back.
    #[test]
    fn a_chain_idle_past_the_limit_gets_its_span_and_later_hops_are_counted() {
        let mut recs = Vec::new();
        // a: two quick hops. b: a hop, then one 12 s later (5 s limit).
        // c: a quick hop, then one running 9 s.
        request(&mut recs, 10, "a", 100 * MS, 300 * MS);
        request(&mut recs, 11, "a", 500 * MS, 300 * MS);
        request(&mut recs, 12, "b", 200 * MS, 300 * MS);
        request(&mut recs, 13, "b", 12_600 * MS, 300 * MS);
        request(&mut recs, 14, "c", 300 * MS, 300 * MS);
        request(&mut recs, 15, "c", 700 * MS, 9_000 * MS);
        let recs = recording(recs, 16_000 * MS);
        let whole = whole_export(&recs);
        let (msgs, t) = live_export(&recs, Duration::from_secs(5));
        let req = |v: &[Span]| v.iter().filter(|s| s.name != "chain").cloned().collect::<Vec<_>>();
        let got = msgs.concat();
        assert_eq!(req(&got), req(&whole), "request spans are export otlp's");
        assert_eq!(t.hops_after_chain_span, 1, "{t:?}");
        let chain = |name: &str| got.iter().find(|s| s.name == "chain" && s.attributes.iter().any(|a| a.key == "hopscope.chain" && a.value == Some(super::super::AnyValue { value: Some(Value::Str(name.into())) }))).unwrap_or_else(|| panic!("no span for chain {name}"));
        assert_eq!(got.iter().filter(|s| s.name == "chain").count(), 3, "one span per chain, never two");
        assert_eq!((hops_attr(chain("a")), hops_attr(chain("b")), hops_attr(chain("c"))), (2, 1, 2));
        // b's late hop sits under the span already sent.
        let b2 = got.iter().find(|s| s.kind == 2 && s.start_time_unix_nano == meta().start_unix_ns + 12_600 * MS).unwrap();
        assert_eq!(b2.parent_span_id, chain("b").span_id);
        // a and b went before their later neighbours ended: not in the last message.
        let last = msgs.last().unwrap();
        for c in ["a", "b"] {
            assert!(!last.contains(chain(c)), "chain {c}'s span went out while recording");
        }
        assert!(last.contains(chain("c")) || msgs[msgs.len() - 2].contains(chain("c")));
        assert_eq!(t.lost(), 0);
    }

    /// No collector: the recorder is never held up, and at stop every span
    /// is counted as lost, within the deadline.
    #[test]
    fn an_absent_collector_costs_the_stop_deadline_and_every_span_is_counted() {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let mut recs = Vec::new();
        for i in 0..20u64 {
            request(&mut recs, 10 + i as i32, &format!("s{}", i % 4), i * 500 * MS, 300 * MS);
        }
        let recs = recording(recs, 12_000 * MS);
        let started = Instant::now();
        let mut live = LiveOtlp::start(&meta(), cfg(), &format!("http://127.0.0.1:{port}"), Duration::from_secs(60)).unwrap();
        for r in &recs {
            live.push(r);
        }
        let fed = started.elapsed();
        // The sender says so as soon as its first message fails.
        let mut notes = Vec::new();
        while notes.is_empty() && started.elapsed() < Duration::from_secs(3) {
            std::thread::sleep(Duration::from_millis(20));
            notes = live.take_notes();
        }
        let t = live.finish(Duration::from_secs(2));
        assert!(fed < Duration::from_secs(2), "feeding took {fed:?}: the sender's retries held the recorder");
        assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
        assert_eq!(t.sent, 0);
        assert!(t.spans >= 20, "{t:?}");
        assert_eq!(t.lost(), t.spans, "{t:?}");
        // Said once, at start (the probe): not again for each failed message.
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(notes[0].contains("cannot reach") && notes[0].contains("Connection refused") && notes[0].contains("retried"), "{notes:?}");
    }

    #[test]
    fn an_endpoint_that_is_not_plain_http_is_refused_at_start() {
        let e = LiveOtlp::start(&meta(), cfg(), "https://collector:4318", Duration::from_secs(60)).err().expect("refused");
        assert!(e.to_string().contains("https is not supported"), "{e}");
    }
}
