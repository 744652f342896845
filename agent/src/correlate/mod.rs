//! The correlator: a pure state machine from recorded events to requests and
//! chains. No I/O, no clock, no globals: time comes from the records, which are
//! fed in timestamp order with [`Correlator::ingest`]. The same records always
//! give the same [`Analysis`].

pub mod engine;
pub mod wire_steps;

use crate::event::ConnKey;
use crate::model::{HttpRole, Record, SseKind, Usage};
use std::collections::{BTreeMap, HashMap};

/// How requests are grouped into chains.
#[derive(Debug, Clone)]
pub struct Config {
    /// Header naming the chain when no `traceparent` is present (lower case).
    pub chain_header: String,
    /// Use the engine IPC records. Off: attribute from the wire alone, as for a
    /// server whose IPC hopscope cannot decode (and to measure that fallback).
    pub use_ipc: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config { chain_header: "x-session-id".into(), use_ipc: true }
    }
}

/// Where a request's chain key came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ChainSource {
    Traceparent,
    Header,
    Connection,
}

/// One HTTP request served by a traced process, with everything the wire told.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub conn: ConnKey,
    pub seq: u32,
    pub id: String,
    pub x_request_id: Option<String>,
    pub traceparent: Option<String>,
    pub chain: String,
    pub chain_source: ChainSource,
    pub hop: u32,
    pub method: String,
    pub path: String,
    pub status: Option<u16>,
    pub arrive_ns: u64,
    /// When the first byte became readable in the server's socket (before the
    /// server got around to reading it), if the kernel saw it.
    pub wire_arrive_ns: Option<u64>,
    pub request_end_ns: u64,
    pub response_head_ns: Option<u64>,
    /// Write carrying the last byte of the first content chunk.
    pub ttft_ns: Option<u64>,
    /// The end of the response as the client sees it: the write carrying the
    /// `data: [DONE]` event of a stream (design.md §3: "the final chunk /
    /// [DONE]"), else the write carrying the response's last byte.
    pub done_ns: Option<u64>,
    /// The write carrying the response's last byte (chunked terminator,
    /// Content-Length reached, or close).
    pub response_end_ns: Option<u64>,
    /// Timestamps of every content chunk, in order.
    pub content_ns: Vec<u64>,
    pub request_bytes: u64,
    pub response_bytes: Option<u64>,
    pub streamed: bool,
    pub usage: Usage,
    pub finish_reason: Option<String>,
    /// What the engine IPC said about this request, when it was decoded.
    pub engine: Option<engine::EnginePhases>,
    /// Steps and interference from clusters of SSE writes, when the IPC did
    /// not explain this request.
    pub wire_steps: Option<wire_steps::WireSteps>,
}

impl Request {
    pub fn ttft_ms(&self) -> Option<f64> {
        self.ttft_ns.map(|t| ms(t.saturating_sub(self.arrive_ns)))
    }
    pub fn e2e_ms(&self) -> Option<f64> {
        self.done_ns.map(|t| ms(t.saturating_sub(self.arrive_ns)))
    }
    /// How long the request sat readable in the socket before the server read it.
    pub fn read_delay_ms(&self) -> Option<f64> {
        self.wire_arrive_ns.map(|w| ms(self.arrive_ns - w))
    }
    /// TTFT from the wire arrival: what a client next to the server sees.
    pub fn wire_ttft_ms(&self) -> Option<f64> {
        Some(ms(self.ttft_ns?.saturating_sub(self.wire_arrive_ns?)))
    }
    pub fn wire_e2e_ms(&self) -> Option<f64> {
        Some(ms(self.done_ns?.saturating_sub(self.wire_arrive_ns?)))
    }
    /// Gaps between consecutive content chunks: n chunks give n-1 gaps.
    pub fn itl_ms(&self) -> Vec<f64> {
        self.content_ns.windows(2).map(|w| ms(w[1].saturating_sub(w[0]))).collect()
    }
    /// Decode as the wire sees it: first content chunk to end of response.
    pub fn decode_ms(&self) -> Option<f64> {
        match (self.ttft_ns, self.done_ns) {
            (Some(t), Some(d)) if d >= t => Some(ms(d - t)),
            _ => None,
        }
    }
}

/// A chain of hops (requests sharing a chain key), in arrival order.
#[derive(Debug, Clone, PartialEq)]
pub struct Chain {
    pub chain: String,
    pub source: ChainSource,
    /// Indexes into [`Analysis::requests`].
    pub hops: Vec<usize>,
}

/// The correlator's result.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Analysis {
    pub requests: Vec<Request>,
    pub chains: Vec<Chain>,
    /// Loss counters: the recording's last kernel/decoder snapshot plus the
    /// correlator's own.
    pub drops: BTreeMap<String, u64>,
    pub first_ns: Option<u64>,
    pub last_ns: Option<u64>,
    /// Engine steps that produced outputs, in order (from the IPC).
    pub steps: Vec<engine::Step>,
    /// GPU kernels by name over the whole recording, most GPU time first.
    pub kernels: Vec<KernelStat>,
    /// The GPUs the injected processes reported, by device and model.
    pub gpus: Vec<GpuInfo>,
}

/// One GPU as an injected process described it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct GpuInfo {
    pub device: u32,
    pub name: String,
    pub compute_capability: String,
    pub sm_count: u32,
    pub total_mem_bytes: u64,
    /// `cuDriverGetVersion`, e.g. 13000.
    pub driver_version: u32,
    /// Processes that used it.
    pub pids: Vec<u32>,
}

/// Executions of one kernel name (all processes and devices together).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelStat {
    pub name: String,
    pub count: u64,
    /// Sum of end - start.
    pub gpu_ns: u64,
}

/// Kernel totals by name. Order-independent (GPU records may reach the
/// recording a little out of timestamp order), deterministic output.
#[derive(Debug, Default)]
pub struct KernelTotals {
    by_name: HashMap<String, (u64, u64)>,
}

impl KernelTotals {
    pub fn add(&mut self, name: &str, start_ns: u64, end_ns: u64) {
        let e = match self.by_name.get_mut(name) {
            Some(e) => e,
            None => self.by_name.entry(name.to_owned()).or_default(),
        };
        e.0 += 1;
        e.1 += end_ns.saturating_sub(start_ns);
    }

    /// Most GPU time first; ties by name.
    pub fn finish(self) -> Vec<KernelStat> {
        let mut v: Vec<KernelStat> = self.by_name.into_iter().map(|(name, (count, gpu_ns))| KernelStat { name, count, gpu_ns }).collect();
        v.sort_by(|a, b| b.gpu_ns.cmp(&a.gpu_ns).then_with(|| a.name.cmp(&b.name)));
        v
    }
}

/// Nanoseconds to milliseconds.
pub fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

/// Percentile with linear interpolation between closest ranks (numpy's default),
/// as `vllm bench serve` reports them.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (p / 100.0).clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64))
}

/// The trace-id of a W3C `traceparent` (`00-<32 hex>-<16 hex>-<2 hex>`), if valid.
pub fn trace_id(traceparent: &str) -> Option<&str> {
    let mut parts = traceparent.trim().split('-');
    let version = parts.next()?;
    let id = parts.next()?;
    let parent = parts.next()?;
    parts.next()?;
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    if !hex(version, 2) || !hex(id, 32) || !hex(parent, 16) || id.bytes().all(|b| b == b'0') {
        return None;
    }
    Some(id)
}

pub struct Correlator {
    cfg: Config,
    requests: Vec<Request>,
    open: HashMap<(ConnKey, u32), usize>,
    drops: BTreeMap<String, u64>,
    own: BTreeMap<&'static str, u64>,
    engine: engine::EngineSide,
    /// Per thread: last switch-in, the wake-up before it, latest socket I/O.
    woke: HashMap<u32, engine::Woke>,
    first_ns: Option<u64>,
    last_ns: Option<u64>,
    kernels: KernelTotals,
    gpus: Vec<GpuInfo>,
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
}

fn merge_usage(into: &mut Usage, from: &Usage) {
    into.prompt_tokens = from.prompt_tokens.or(into.prompt_tokens);
    into.completion_tokens = from.completion_tokens.or(into.completion_tokens);
    into.cached_tokens = from.cached_tokens.or(into.cached_tokens);
}

impl Correlator {
    pub fn new(cfg: Config) -> Self {
        Correlator {
            cfg,
            requests: Vec::new(),
            open: HashMap::new(),
            drops: BTreeMap::new(),
            own: BTreeMap::new(),
            engine: engine::EngineSide::default(),
            woke: HashMap::new(),
            first_ns: None,
            last_ns: None,
            kernels: KernelTotals::default(),
            gpus: Vec::new(),
        }
    }

    fn count(&mut self, what: &'static str) {
        *self.own.entry(what).or_default() += 1;
    }

    fn request_mut(&mut self, conn: ConnKey, seq: u32) -> Option<&mut Request> {
        match self.open.get(&(conn, seq)) {
            Some(&i) => self.requests.get_mut(i),
            None => None,
        }
    }

    /// Feeds one record. Records must come in timestamp order (the recording's order).
    pub fn ingest(&mut self, rec: &Record) {
        let ts = rec.ts_ns();
        if ts > 0 {
            self.first_ns = Some(self.first_ns.map_or(ts, |f| f.min(ts)));
            self.last_ns = Some(self.last_ns.map_or(ts, |l| l.max(ts)));
        }
        match rec {
            Record::HttpRequest { conn, role: HttpRole::Server, seq, start_ns, end_ns, method, path, headers, body_len, stream, ready_ns, .. } => {
                // A readable-since older than the read by more than a minute is a
                // stale kernel entry (socket address reuse), not a wait.
                let wire_arrive_ns = match ready_ns {
                    Some(r) if *r <= *start_ns && start_ns - r <= 60_000_000_000 => Some(*r),
                    Some(_) => {
                        self.count("wire_arrival_implausible");
                        None
                    }
                    None => None,
                };
                let x_request_id = header(headers, "x-request-id").map(str::to_owned);
                let traceparent = header(headers, "traceparent").map(str::to_owned);
                let (chain, chain_source) = self.chain_key(*conn, headers);
                let idx = self.requests.len();
                self.requests.push(Request {
                    conn: *conn,
                    seq: *seq,
                    id: String::new(),
                    x_request_id,
                    traceparent,
                    chain,
                    chain_source,
                    hop: 0,
                    method: method.clone(),
                    path: path.clone(),
                    status: None,
                    arrive_ns: *start_ns,
                    wire_arrive_ns,
                    request_end_ns: *end_ns,
                    response_head_ns: None,
                    ttft_ns: None,
                    done_ns: None,
                    response_end_ns: None,
                    content_ns: Vec::new(),
                    request_bytes: *body_len,
                    response_bytes: None,
                    streamed: stream.unwrap_or(false),
                    usage: Usage::default(),
                    finish_reason: None,
                    engine: None,
                    wire_steps: None,
                });
                if self.open.insert((*conn, *seq), idx).is_some() {
                    self.count("requests_duplicated");
                }
            }
            Record::HttpResponse { conn, role: HttpRole::Server, seq, ts_ns, status, headers, .. } => {
                let streamed = header(headers, "content-type").is_some_and(|c| c.starts_with("text/event-stream"));
                match self.request_mut(*conn, *seq) {
                    Some(r) => {
                        r.status = Some(*status);
                        r.response_head_ns = Some(*ts_ns);
                        r.streamed |= streamed;
                    }
                    None => self.count("responses_without_request"),
                }
            }
            Record::Sse { conn, seq, ts_ns, kind, id, finish_reason, usage, .. } => {
                let Some(r) = self.request_mut(*conn, *seq) else {
                    self.count("sse_without_request");
                    return;
                };
                r.streamed = true;
                if r.id.is_empty() {
                    if let Some(id) = id.as_deref().filter(|s| !s.is_empty()) {
                        r.id = id.to_owned();
                    }
                }
                if *kind == SseKind::Done && r.done_ns.is_none() {
                    r.done_ns = Some(*ts_ns);
                }
                if *kind == SseKind::Content {
                    if r.ttft_ns.is_none() {
                        r.ttft_ns = Some(*ts_ns);
                    }
                    r.content_ns.push(*ts_ns);
                }
                if let Some(u) = usage {
                    merge_usage(&mut r.usage, u);
                }
                if finish_reason.is_some() {
                    r.finish_reason.clone_from(finish_reason);
                }
            }
            Record::ResponseBody { conn, seq, id, usage, finish_reason, .. } => {
                let Some(r) = self.request_mut(*conn, *seq) else {
                    self.count("bodies_without_request");
                    return;
                };
                if r.id.is_empty() {
                    if let Some(id) = id.as_deref().filter(|s| !s.is_empty()) {
                        r.id = id.to_owned();
                    }
                }
                if let Some(u) = usage {
                    merge_usage(&mut r.usage, u);
                }
                if finish_reason.is_some() {
                    r.finish_reason.clone_from(finish_reason);
                }
            }
            Record::HttpResponseEnd { conn, seq, ts_ns, body_len } => {
                let key = (*conn, *seq);
                match self.open.remove(&key) {
                    Some(i) => {
                        let r = &mut self.requests[i];
                        r.response_end_ns = Some(*ts_ns);
                        r.done_ns = r.done_ns.or(Some(*ts_ns));
                        r.response_bytes = Some(*body_len);
                    }
                    None => self.count("response_ends_without_request"),
                }
            }
            Record::EngineRequest { .. } | Record::EngineAbort { .. } | Record::EngineOutputs { .. }
                if self.cfg.use_ipc => {
                    self.engine.ingest(rec, &self.woke);
                }
            Record::OffCpu { ts_ns, tid, wake_ns, prev_state, .. } => self.woke.entry(*tid).or_default().switched_in(*ts_ns, *wake_ns, *prev_state),
            Record::UnixIo { ts_ns, tid, .. } => self.woke.entry(*tid).or_default().io(*ts_ns),
            Record::GpuKernel { ts_ns, end_ns, name, .. } => self.kernels.add(name, *ts_ns, *end_ns),
            Record::GpuDevice { pid, device, name, cc_major, cc_minor, sm_count, total_mem_bytes, driver_version, .. } => {
                match self.gpus.iter_mut().find(|g| g.device == *device && g.name == *name) {
                    Some(g) => {
                        if !g.pids.contains(pid) {
                            g.pids.push(*pid);
                        }
                    }
                    None => self.gpus.push(GpuInfo {
                        device: *device,
                        name: name.clone(),
                        compute_capability: format!("{cc_major}.{cc_minor}"),
                        sm_count: *sm_count,
                        total_mem_bytes: *total_mem_bytes,
                        driver_version: *driver_version,
                        pids: vec![*pid],
                    }),
                }
            }
            Record::Drops { counters, .. } => {
                // Cumulative snapshots: the latest wins.
                for (k, v) in counters {
                    self.drops.insert(k.clone(), *v);
                }
            }
            _ => {}
        }
    }

    /// Chain key: the `traceparent` trace-id, else the configured header, else
    /// the client connection.
    fn chain_key(&self, conn: ConnKey, headers: &[(String, String)]) -> (String, ChainSource) {
        if let Some(id) = header(headers, "traceparent").and_then(trace_id) {
            return (id.to_ascii_lowercase(), ChainSource::Traceparent);
        }
        if let Some(v) = header(headers, &self.cfg.chain_header).filter(|v| !v.is_empty()) {
            return (v.to_owned(), ChainSource::Header);
        }
        (format!("conn:{}:{}:{}", conn.tgid, conn.fd, conn.ino), ChainSource::Connection)
    }

    /// Ends the analysis: names requests, orders hops, builds chains.
    pub fn finish(mut self) -> Analysis {
        let unfinished = self.open.len() as u64;
        if unfinished > 0 {
            self.own.insert("requests_unfinished", unfinished);
        }
        // Requests in arrival order; ties broken by connection and sequence for determinism.
        self.requests.sort_by_key(|r| (r.arrive_ns, r.conn, r.seq));
        let mut by_chain: BTreeMap<(String, u8), Vec<usize>> = BTreeMap::new();
        for (i, r) in self.requests.iter_mut().enumerate() {
            if r.id.is_empty() {
                r.id = match &r.x_request_id {
                    Some(x) => x.clone(),
                    None => format!("conn:{}:{}:{}", r.conn.tgid, r.conn.fd, r.seq),
                };
            }
            by_chain.entry((r.chain.clone(), r.chain_source as u8)).or_default().push(i);
        }
        let steps = engine::attach(&mut self.requests, std::mem::take(&mut self.engine), &mut self.own);
        // Requests the IPC did not explain get their steps from the wire.
        let clusters = wire_steps::clusters(&self.requests, wire_steps::DEFAULT_GAP_NS);
        let per = wire_steps::attribute(&self.requests, &clusters);
        for (r, w) in self.requests.iter_mut().zip(per) {
            if r.engine.is_none() && w.steps > 0 {
                r.wire_steps = Some(w);
            }
        }
        let mut chains = Vec::new();
        for ((chain, _), hops) in by_chain {
            for (n, &i) in hops.iter().enumerate() {
                self.requests[i].hop = n as u32 + 1;
            }
            let source = self.requests[hops[0]].chain_source;
            chains.push(Chain { chain, source, hops });
        }
        chains.sort_by_key(|c| (self.requests[c.hops[0]].arrive_ns, c.chain.clone()));
        let mut drops = self.drops;
        for (k, v) in self.own {
            drops.insert(k.to_owned(), v);
        }
        Analysis { requests: self.requests, chains, drops, first_ns: self.first_ns, last_ns: self.last_ns, steps, kernels: self.kernels.finish(), gpus: self.gpus }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::HttpRole;

    fn conn(fd: i32) -> ConnKey {
        ConnKey { tgid: 100, fd, ino: 9000 + fd as u64 }
    }

    fn req(c: ConnKey, seq: u32, at: u64, headers: &[(&str, &str)]) -> Record {
        Record::HttpRequest {
            conn: c,
            role: HttpRole::Server,
            seq,
            start_ns: at,
            end_ns: at + 10_000,
            tid: 100,
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            headers: headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            body_len: 321,
            stream: Some(true),
            model: None,
            ready_ns: at.checked_sub(300_000),
        }
    }

    fn sse(c: ConnKey, seq: u32, at: u64, kind: SseKind, usage: Option<Usage>) -> Record {
        Record::Sse { conn: c, seq, ts_ns: at, kind, id: Some(format!("chatcmpl-{seq}")), content_bytes: 3, finish_reason: None, usage }
    }

    /// One streamed exchange: role, `n` content chunks 2 ms apart, usage, done, end.
    fn exchange(c: ConnKey, seq: u32, at: u64, n: u64, headers: &[(&str, &str)]) -> Vec<Record> {
        let mut v = vec![req(c, seq, at, headers)];
        v.push(Record::HttpResponse {
            conn: c,
            role: HttpRole::Server,
            seq,
            ts_ns: at + 1_000_000,
            tid: 100,
            status: 200,
            headers: vec![("content-type".into(), "text/event-stream; charset=utf-8".into())],
        });
        v.push(sse(c, seq, at + 1_500_000, SseKind::Role, None));
        for k in 0..n {
            v.push(sse(c, seq, at + 5_000_000 + k * 2_000_000, SseKind::Content, None));
        }
        let end = at + 5_000_000 + n * 2_000_000;
        let usage = Usage { prompt_tokens: Some(40), completion_tokens: Some(n), cached_tokens: Some(30) };
        v.push(sse(c, seq, end, SseKind::Usage, Some(usage)));
        v.push(sse(c, seq, end + 100, SseKind::Done, None));
        v.push(Record::HttpResponseEnd { conn: c, seq, ts_ns: end + 200, body_len: 999 });
        v
    }

    fn run(records: &[Record]) -> Analysis {
        let mut c = Correlator::new(Config::default());
        for r in records {
            c.ingest(r);
        }
        c.finish()
    }

    #[test]
    fn streamed_request_gets_wire_ttft_itl_e2e_and_usage() {
        let a = run(&exchange(conn(5), 0, 1_000_000_000, 4, &[]));
        assert_eq!(a.requests.len(), 1);
        let r = &a.requests[0];
        assert_eq!(r.id, "chatcmpl-0");
        assert_eq!(r.status, Some(200));
        assert_eq!(r.ttft_ms(), Some(5.0));
        assert_eq!(r.itl_ms(), vec![2.0, 2.0, 2.0]);
        assert_eq!(r.e2e_ms(), Some(13.0001), "done is the [DONE] write");
        assert_eq!(r.response_end_ns, Some(1_013_000_200));
        assert_eq!(r.usage.completion_tokens, Some(4));
        assert_eq!(r.usage.cached_tokens, Some(30));
        assert_eq!(r.decode_ms().map(|d| (d * 1e4).round() / 1e4), Some(8.0001));
        assert_eq!(r.read_delay_ms(), Some(0.3));
        assert_eq!(r.wire_ttft_ms(), Some(5.3));
    }

    #[test]
    fn chains_group_by_traceparent_then_header_then_connection_in_arrival_order() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let mut recs = Vec::new();
        recs.extend(exchange(conn(5), 0, 1_000_000_000, 2, &[("traceparent", tp), ("x-session-id", "ignored")]));
        recs.extend(exchange(conn(6), 0, 2_000_000_000, 2, &[("x-session-id", "s1")]));
        recs.extend(exchange(conn(7), 0, 3_000_000_000, 2, &[("traceparent", tp)]));
        recs.extend(exchange(conn(6), 1, 4_000_000_000, 2, &[("x-session-id", "s1")]));
        recs.extend(exchange(conn(8), 0, 5_000_000_000, 2, &[]));
        let a = run(&recs);
        assert_eq!(a.chains.len(), 3);
        assert_eq!(a.chains[0].chain, "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(a.chains[0].source, ChainSource::Traceparent);
        assert_eq!(a.chains[1].chain, "s1");
        assert_eq!(a.chains[2].source, ChainSource::Connection);
        let hops: Vec<(u64, u32)> = a.chains[1].hops.iter().map(|&i| (a.requests[i].arrive_ns, a.requests[i].hop)).collect();
        assert_eq!(hops, vec![(2_000_000_000, 1), (4_000_000_000, 2)]);
    }

    #[test]
    fn invalid_traceparent_falls_back_to_the_chain_header() {
        let a = run(&exchange(conn(5), 0, 1, 1, &[("traceparent", "00-zz-xx-01"), ("x-session-id", "abc")]));
        assert_eq!(a.requests[0].chain, "abc");
        assert_eq!(a.requests[0].chain_source, ChainSource::Header);
    }

    #[test]
    fn unfinished_and_orphan_events_are_counted_not_guessed() {
        let mut recs = exchange(conn(5), 0, 1_000, 2, &[]);
        recs.pop(); // no response end
        recs.pop(); // and no [DONE]
        recs.push(sse(conn(9), 3, 99_000_000, SseKind::Content, None));
        let a = run(&recs);
        assert_eq!(a.requests[0].done_ns, None);
        assert_eq!(a.requests[0].e2e_ms(), None);
        assert_eq!(a.drops.get("requests_unfinished"), Some(&1));
        assert_eq!(a.drops.get("sse_without_request"), Some(&1));
    }

    #[test]
    fn request_without_sse_id_is_named_by_x_request_id_else_by_connection() {
        let recs = vec![req(conn(5), 0, 10, &[("x-request-id", "abc-123")]), req(conn(6), 2, 20, &[])];
        let a = run(&recs);
        assert_eq!(a.requests[0].id, "abc-123");
        assert_eq!(a.requests[1].id, "conn:100:6:2");
    }

    #[test]
    fn percentile_matches_numpy_linear_interpolation() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 50.0), Some(2.5));
        assert_eq!(percentile(&v, 90.0), Some(3.7000000000000002));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn drop_snapshots_keep_the_latest_value() {
        let recs = vec![
            Record::Drops { ts_ns: 1, counters: vec![("kernel_ringbuf_full".into(), 3)] },
            Record::Drops { ts_ns: 2, counters: vec![("kernel_ringbuf_full".into(), 7)] },
        ];
        assert_eq!(run(&recs).drops.get("kernel_ringbuf_full"), Some(&7));
    }
}
