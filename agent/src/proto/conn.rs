//! One TCP (or unknown-family) connection: two byte streams, In and Out, each
//! with its own HTTP/1.x parser state, and the FIFO that pairs responses with
//! requests.
//!
//! Each syscall is fed as its captured prefix followed by a gap of known size.
//! The request stream is In when the traced process is the server and Out when it
//! is a client; the role is fixed by the first complete start line seen.
//!
//! Loss handling (every case is counted, see `Counters`):
//! - gap inside a body of known length: skipped by count, no loss of sync;
//! - gap inside chunked data: skipped by count (the CRLF after the data is
//!   assumed); gap over a chunk-size line: the framing is lost and picked up
//!   again at a later syscall that *starts* with a complete, valid chunk-size line
//!   (uvicorn writes one chunk per syscall), or ended by a status line starting a
//!   syscall; `body_len` then counts only the bytes whose framing was known;
//! - gap or junk where a head should be: the stream *desyncs* (one `Unparsed` per
//!   episode) and skips whole syscalls until one starts with a known method + SP
//!   (request stream) or `HTTP/1.` (response stream). A lost request keeps its
//!   place in the FIFO and its seq number (a hole in the seq sequence); its
//!   response is parsed for framing but emits nothing. Resync is accepted only
//!   when pairing stays unambiguous: a request when nothing is outstanding and the
//!   response stream is idle, a response when exactly one request is
//!   outstanding. Otherwise the connection is given up (`resync_unsafe`);
//! - HTTP/2 preface, TLS, non-HTTP first bytes on a connection whose
//!   accept/connect we saw, heads over `max_head_bytes`, upgrades (101, CONNECT):
//!   the connection is given up (one `Unparsed`, later bytes only counted);
//! - a connection we did not see open (attached while it was in use, or its
//!   accept was lost) may be mid-message: both streams start in resync mode and
//!   the first message must start a syscall with a known method or `HTTP/1.`
//!   (bytes skipped before that: one `Unparsed`, `attach_mid_stream`). Once one
//!   stream found a message, the other one, if it has not seen a byte yet, parses
//!   normally. A response whose request we never saw is parsed silently. If the
//!   request stream skipped bytes (the tail of a request) and nothing was written
//!   back since, a silent FIFO slot is reserved for that request's response.
//!
//! `Unparsed.bytes` = the bytes of the triggering syscall from the failure point
//! (plus the head bytes buffered before); bytes skipped afterwards only go to
//! `unparsed_bytes`.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::chunked::{self, ChunkDecoder, ChunkError, Item};
use super::http::{self, BodyFraming, HeadBuf, Start};
use super::openai;
use super::sse::{SseOut, SseParser};
use super::{Counters, DecoderConfig};
use crate::event::{ConnKey, Dir, Family, IoEvent};
use crate::model::{Header, HttpRole, Record, SseKind};

const IN: usize = 0;
const OUT: usize = 1;
/// Requests whose response has not started, per connection.
const MAX_PENDING: usize = 1024;
/// Largest JSON body (request or non-streaming response) read for metadata.
pub(crate) const MAX_JSON_BODY: usize = 1 << 20;

fn didx(d: Dir) -> usize {
    match d {
        Dir::In => IN,
        Dir::Out => OUT,
    }
}

fn dir_of(i: usize) -> Dir {
    if i == IN {
        Dir::In
    } else {
        Dir::Out
    }
}

/// When a syscall's bytes moved: for a write, its wire departure when the
/// kernel saw one inside the call, else the call's exit (what ran between the
/// two, e.g. a preemption by the peer it woke, is not the server's latency);
/// for a read, its exit (the wire arrival travels beside it, `At::ready`).
/// Also whether a write fell back to its exit.
fn stamp(io: &IoEvent) -> (u64, bool) {
    match (io.dir, io.wire_ns) {
        (Dir::Out, Some(w)) if (io.enter_ns..=io.ts_ns).contains(&w) => (w, false),
        (Dir::Out, _) => (io.ts_ns, true),
        (Dir::In, _) => (io.ts_ns, false),
    }
}

fn inc(x: &mut u64, n: u64) {
    *x = x.saturating_add(n);
}

/// Shared, per-decoder state the connection code needs.
pub(crate) struct Ctx<'a> {
    pub cfg: &'a DecoderConfig,
    /// The chain header, lower-cased.
    pub chain: &'a str,
    pub c: &'a mut Counters,
    pub budget: &'a Budget,
}

#[derive(Debug, Clone, Copy)]
struct At {
    ts: u64,
    tid: u32,
    /// When the syscall's data became readable (Dir::In only).
    ready: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Req,
    Resp,
}

/// A request awaiting its response. `seq: None` = a request we know exists but
/// could not read (its response is parsed for framing only).
#[derive(Debug, Clone)]
struct Pending {
    seq: Option<u32>,
    head: bool,
    connect: bool,
    /// The request body's `model`, once the body is complete: its response
    /// names a model in a record only when it says something this does not.
    model: Option<String>,
}

impl Pending {
    const LOST: Pending = Pending {
        seq: None,
        head: false,
        connect: false,
        model: None,
    };
}

/// Bytes held by all body captures of one decoder (shared by its connections).
pub(crate) type Budget = Arc<AtomicUsize>;
/// Most bytes all JSON body captures of one decoder may hold together.
pub(crate) const CAPTURE_BUDGET: usize = 64 << 20;

/// The capture of a body that is JSON (`json`, and not encoded), whole when
/// announced small enough, else its ends only.
fn json_capture(json: bool, framing: BodyFraming, ctx: &mut Ctx<'_>) -> Capture {
    let cap = Capture::new(json, ctx.budget);
    match framing {
        BodyFraming::Length(n) if json && n > MAX_JSON_BODY as u64 => {
            ctx.c.json_body_too_large += 1;
            cap.ends_only()
        }
        _ => cap,
    }
}

/// How much of each end of a body [`Capture`] keeps once it has lost bytes:
/// the kernel's default TCP tail (`HS_TAIL_DEFAULT`), and as much of the start.
const ENDS_KEEP: usize = 16 << 10;

/// A bounded copy of a JSON body, read for its metadata when it ends. Whole
/// while every byte was captured and it stays under [`MAX_JSON_BODY`]; after
/// a gap (or past that size) only its ends: the first [`ENDS_KEEP`] bytes and
/// the last contiguous ones, up to as many, where `json_ends` finds the
/// members it can place. Its bytes count against the decoder's [`Budget`]
/// until it is taken or dropped.
#[derive(Debug, Default)]
struct Capture {
    /// The body's first bytes; `None` when it is not captured (not JSON,
    /// encoded, over the budget).
    buf: Option<Vec<u8>>,
    /// `Some` once a byte was lost: the bytes since the latest gap, the last
    /// [`ENDS_KEEP`] of them.
    tail: Option<Vec<u8>>,
    budget: Option<Budget>,
    /// Bytes counted against the budget.
    held: usize,
}

/// What a [`Capture`] holds when its body ends.
#[derive(Debug)]
enum Body {
    Whole(Vec<u8>),
    Ends { head: Vec<u8>, tail: Vec<u8> },
}

impl Capture {
    fn new(enabled: bool, budget: &Budget) -> Self {
        if enabled {
            Capture {
                buf: Some(Vec::new()),
                tail: None,
                budget: Some(Arc::clone(budget)),
                held: 0,
            }
        } else {
            Capture::default()
        }
    }

    /// A body announced over [`MAX_JSON_BODY`]: only its ends are kept.
    fn ends_only(mut self) -> Self {
        if self.buf.is_some() {
            self.tail = Some(Vec::new());
        }
        self
    }

    fn push(&mut self, b: &[u8], c: &mut Counters) {
        let Some(head) = &mut self.buf else {
            return;
        };
        match &mut self.tail {
            Some(t) => keep_last(t, b),
            None if head.len().saturating_add(b.len()) > MAX_JSON_BODY => {
                c.json_body_too_large += 1;
                let mut t = Vec::new();
                keep_last(&mut t, &head[head.len().saturating_sub(ENDS_KEEP)..]);
                keep_last(&mut t, b);
                head.truncate(ENDS_KEEP);
                head.shrink_to_fit();
                self.tail = Some(t);
            }
            None => head.extend_from_slice(b),
        }
        self.charge(c);
    }

    /// `n > 0` bytes of the body were not captured.
    fn gap(&mut self, c: &mut Counters) {
        let Some(head) = &mut self.buf else {
            return;
        };
        match &mut self.tail {
            Some(t) => t.clear(),
            None => {
                head.truncate(ENDS_KEEP);
                head.shrink_to_fit();
                self.tail = Some(Vec::new());
            }
        }
        self.charge(c);
    }

    /// Brings the budget up to date with what is held; over it, the
    /// capture is given up.
    fn charge(&mut self, c: &mut Counters) {
        let now = self.buf.as_ref().map_or(0, Vec::len) + self.tail.as_ref().map_or(0, Vec::len);
        let Some(budget) = &self.budget else {
            return;
        };
        if now > self.held {
            let more = now - self.held;
            if budget.load(Ordering::Relaxed).saturating_add(more) > CAPTURE_BUDGET {
                self.lose();
                c.capture_budget_exceeded += 1;
                return;
            }
            budget.fetch_add(more, Ordering::Relaxed);
        } else {
            release(budget, self.held - now);
        }
        self.held = now;
    }

    /// The captured body, no longer counted against the budget.
    fn take(&mut self) -> Option<Body> {
        let head = self.buf.take();
        let tail = self.tail.take();
        if let Some(budget) = &self.budget {
            release(budget, self.held);
        }
        self.held = 0;
        Some(match (head?, tail) {
            (head, None) => Body::Whole(head),
            (head, Some(tail)) => Body::Ends { head, tail },
        })
    }

    fn lose(&mut self) {
        drop(self.take());
    }

    fn len(&self) -> usize {
        self.buf.as_ref().map_or(0, Vec::capacity) + self.tail.as_ref().map_or(0, Vec::capacity)
    }
}

fn release(budget: &Budget, n: usize) {
    let _ = budget.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| Some(u.saturating_sub(n)));
}

/// Appends `b` to `t`, keeping its last [`ENDS_KEEP`] bytes.
fn keep_last(t: &mut Vec<u8>, b: &[u8]) {
    let b = &b[b.len().saturating_sub(ENDS_KEEP)..];
    let over = (t.len() + b.len()).saturating_sub(ENDS_KEEP);
    t.drain(..over);
    t.extend_from_slice(b);
}

impl Drop for Capture {
    fn drop(&mut self) {
        self.lose();
    }
}

#[derive(Debug)]
enum ReqFraming {
    Length(u64),
    Chunked(ChunkDecoder),
}

#[derive(Debug)]
struct ReqBody {
    seq: u32,
    start: At,
    method: String,
    path: String,
    headers: Vec<Header>,
    framing: ReqFraming,
    body_len: u64,
    cap: Capture,
}

#[derive(Debug)]
enum RespFraming {
    Length(u64),
    Chunked(ChunkDecoder),
    Close,
}

#[derive(Debug)]
struct RespBody {
    seq: Option<u32>,
    framing: RespFraming,
    body_len: u64,
    /// Time of the syscall that carried the latest body byte.
    last_ts: u64,
    sse: Option<SseParser>,
    cap: Capture,
    /// Its request's `model`; a [`Record::ResponseModel`] is emitted, once,
    /// when the response names another (or the request named none).
    asked: Option<String>,
    /// A [`Record::ResponseModel`] was emitted, or is not needed any more.
    model_named: bool,
}

#[derive(Debug, Default)]
enum St {
    /// Between messages: the next byte (after optional CR/LF) starts a head.
    #[default]
    Idle,
    Head,
    Req(Box<ReqBody>),
    Resp(Box<RespBody>),
    /// Lost sync: skipping whole syscalls until one starts with a message.
    Resync,
}

#[derive(Debug, Default)]
struct Side {
    st: St,
    head: HeadBuf,
    /// Time of the latest syscall with bytes on this side.
    last_ts: u64,
    /// In `Resync`: time of the latest skipped bytes.
    skip_ts: Option<u64>,
    /// An `Unparsed` was emitted for the current episode.
    reported: bool,
    /// Any bytes were seen on this side.
    seen: bool,
}

/// Reason reported when a connection we did not see open starts mid-message.
const MID_STREAM: &str = "no http message boundary (attached mid-stream)";

impl Side {
    /// A connection opened before we attached may be in the middle of a message:
    /// its streams start by looking for a message start at a syscall boundary,
    /// with the strict resync rules (a known method or `HTTP/1.`).
    fn initial(opened: bool) -> Self {
        Side {
            st: if opened { St::Idle } else { St::Resync },
            ..Side::default()
        }
    }
}

/// Why a stream stopped parsing.
#[derive(Debug, Clone, Copy)]
enum Fail {
    /// Give up the whole connection.
    Dead(&'static str),
    /// Skip to a message boundary. `lost_head`: a message whose head we could not
    /// read was on the wire (it takes a FIFO slot / consumes a response).
    Desync {
        reason: &'static str,
        lost_head: bool,
    },
    /// Not at a message boundary on a connection opened before we attached.
    MidStream(&'static str),
}

type StepResult = Result<usize, (Fail, usize)>;

#[derive(Debug)]
pub(crate) struct Conn {
    pub key: ConnKey,
    /// LRU tick of the last event.
    pub tick: u64,
    /// We saw its accept/connect: the first bytes must be a message start.
    opened: bool,
    role: Option<HttpRole>,
    dead: bool,
    next_seq: u32,
    any_request: bool,
    fifo: VecDeque<Pending>,
    sides: [Side; 2],
}

impl Conn {
    pub fn new(key: ConnKey, opened: bool) -> Self {
        Conn {
            key,
            tick: 0,
            opened,
            role: None,
            dead: false,
            next_seq: 0,
            any_request: false,
            fifo: VecDeque::new(),
            sides: [Side::initial(opened), Side::initial(opened)],
        }
    }

    /// Bytes held in buffers (for bounds checks in tests).
    pub fn buffered(&self) -> usize {
        self.sides
            .iter()
            .map(|s| {
                s.head.buf.capacity()
                    + match &s.st {
                        St::Req(b) => b.cap.len(),
                        St::Resp(b) => b.cap.len() + b.sse.as_ref().map_or(0, SseParser::buffered),
                        _ => 0,
                    }
            })
            .sum()
    }

    fn kind(&self, d: usize) -> Option<Kind> {
        match (self.role?, d) {
            (HttpRole::Server, IN) | (HttpRole::Client, OUT) => Some(Kind::Req),
            _ => Some(Kind::Resp),
        }
    }

    fn role(&self) -> HttpRole {
        self.role.unwrap_or(HttpRole::Server)
    }

    /// One syscall's bytes on this connection.
    pub fn on_io(&mut self, ctx: &mut Ctx<'_>, io: &IoEvent, out: &mut Vec<Record>) {
        let cap = io
            .data
            .len()
            .min(usize::try_from(io.len).unwrap_or(usize::MAX));
        let data = io.data.get(..cap).unwrap_or_default();
        // The transfer's last bytes, when captured apart: after the gap.
        let room = usize::try_from(io.len - cap as u64).unwrap_or(usize::MAX);
        let tail = &io.tail[..io.tail.len().min(room)];
        let gap = io.len - cap as u64 - tail.len() as u64;
        if self.dead {
            inc(&mut ctx.c.unparsed_bytes, io.len);
            return;
        }
        let d = didx(io.dir);
        let (ts, at_exit) = stamp(io);
        if at_exit && matches!(io.family, Family::Inet | Family::Inet6) {
            ctx.c.writes_timed_at_exit += 1;
        }
        let at = At {
            ts,
            tid: io.tid,
            ready: match io.dir {
                Dir::In => io.wire_ns,
                Dir::Out => None,
            },
        };
        if !self.feed(ctx, d, data, true, gap + tail.len() as u64, at, out) {
            return;
        }
        if gap > 0 {
            if let Err((f, lost)) = self.on_gap(ctx, d, gap, at, out) {
                self.fail(ctx, d, f, lost, at, out);
                inc(&mut ctx.c.unparsed_bytes, lost);
                if self.dead {
                    inc(&mut ctx.c.unparsed_bytes, tail.len() as u64);
                    return;
                }
            }
        }
        if !self.feed(ctx, d, tail, false, 0, at, out) {
            return;
        }
        self.sides[d].last_ts = at.ts;
        self.sides[d].seen = true;
    }

    /// Steps side `d` through `data`, bytes of one syscall that `after`
    /// more bytes follow; `at_start`: `data` starts the syscall. False when
    /// the connection was given up.
    #[allow(clippy::too_many_arguments)]
    fn feed(&mut self, ctx: &mut Ctx<'_>, d: usize, data: &[u8], at_start: bool, after: u64, at: At, out: &mut Vec<Record>) -> bool {
        let mut pos = 0;
        let mut stalls = 0u32;
        while pos < data.len() {
            let rest = &data[pos..];
            let left = (rest.len() as u64).saturating_add(after);
            let r = self.step(ctx, d, rest, at_start && pos == 0, left, at, out);
            let (n, fail) = match r {
                Ok(n) => (n, None),
                Err((f, n)) => (n, Some(f)),
            };
            let n = n.min(rest.len());
            pos += n;
            if let Some(f) = fail {
                let left = ((data.len() - pos) as u64).saturating_add(after);
                self.fail(ctx, d, f, left, at, out);
                if self.dead {
                    inc(&mut ctx.c.unparsed_bytes, left);
                    return false;
                }
            } else if n == 0 {
                // Every state consumes or changes state; a long run of empty steps
                // would be a bug: give up rather than spin.
                stalls += 1;
                if stalls > 8 {
                    ctx.c.internal_stall += 1;
                    let left = ((data.len() - pos) as u64).saturating_add(after);
                    self.fail(
                        ctx,
                        d,
                        Fail::Dead("decoder made no progress"),
                        left,
                        at,
                        out,
                    );
                    inc(&mut ctx.c.unparsed_bytes, left);
                    return false;
                }
                continue;
            }
            stalls = 0;
        }
        true
    }

    #[allow(clippy::too_many_arguments)]
    fn step(
        &mut self,
        ctx: &mut Ctx<'_>,
        d: usize,
        data: &[u8],
        at_start: bool,
        left: u64,
        at: At,
        out: &mut Vec<Record>,
    ) -> StepResult {
        match std::mem::take(&mut self.sides[d].st) {
            St::Idle => {
                let skip = data
                    .iter()
                    .take_while(|&&b| b == b'\r' || b == b'\n')
                    .count();
                if skip > 0 {
                    return Ok(skip);
                }
                self.sides[d].head.begin(at.ts, at.tid, at.ready);
                self.sides[d].st = St::Head;
                self.step_head(ctx, d, data, at, out)
            }
            St::Head => {
                self.sides[d].st = St::Head;
                self.step_head(ctx, d, data, at, out)
            }
            St::Resync => {
                self.sides[d].st = St::Resync;
                self.step_resync(ctx, d, data, at_start, left, at, out)
            }
            St::Req(b) => self.step_req_body(ctx, d, b, data, at, out),
            St::Resp(b) => self.step_resp_body(ctx, d, b, data, at_start, left, at, out),
        }
    }

    /// The first bytes are not HTTP/1.x: how bad that is depends on what we know.
    fn not_http(&self, ctx: &mut Ctx<'_>, reason: &'static str) -> Fail {
        match (self.role, self.opened) {
            (None, true) => {
                ctx.c.not_http += 1;
                Fail::Dead(reason)
            }
            (None, false) => {
                ctx.c.attach_mid_stream += 1;
                Fail::MidStream(MID_STREAM)
            }
            (Some(_), _) => {
                ctx.c.head_invalid += 1;
                Fail::Desync {
                    reason,
                    lost_head: true,
                }
            }
        }
    }

    fn step_head(
        &mut self,
        ctx: &mut Ctx<'_>,
        d: usize,
        data: &[u8],
        at: At,
        out: &mut Vec<Record>,
    ) -> StepResult {
        let side = &mut self.sides[d];
        let (n, done) = side.head.scan(data);
        if side.head.buf.len().saturating_add(n) > ctx.cfg.max_head_bytes {
            ctx.c.head_too_large += 1;
            return Err((Fail::Dead("http head larger than max_head_bytes"), 0));
        }
        side.head.buf.extend_from_slice(&data[..n]);
        if side.head.class.is_none() {
            side.head.class = http::classify(&side.head.buf);
            if side.head.class.is_none() && done {
                side.head.class = Some(Start::Garbage);
            }
        }
        let Some(class) = side.head.class else {
            return Ok(n);
        };
        let want = match class {
            Start::H2 => {
                ctx.c.http2_preface += 1;
                return Err((Fail::Dead("http/2 connection preface"), n));
            }
            Start::Tls => {
                ctx.c.tls += 1;
                return Err((Fail::Dead("tls record"), n));
            }
            Start::Garbage => return Err((self.not_http(ctx, "not an http/1.x message"), n)),
            Start::Request => Kind::Req,
            Start::Response => Kind::Resp,
        };
        if self.kind(d).is_some_and(|k| k != want) {
            ctx.c.head_invalid += 1;
            return Err((
                Fail::Desync {
                    reason: "http message in unexpected direction",
                    lost_head: true,
                },
                n,
            ));
        }
        let side = &mut self.sides[d];
        if !side.head.checked && (side.head.saw_newline || done) {
            side.head.checked = true;
            if !http::first_line_ok(&side.head.buf, class) {
                return Err((self.not_http(ctx, "invalid http start line"), n));
            }
        }
        if !done {
            return Ok(n);
        }
        // The head is complete: the stream is between messages unless a body follows
        // (`complete_*` then sets the body state).
        side.st = St::Idle;
        let r = match want {
            Kind::Req => self.complete_request(ctx, d, at, out),
            Kind::Resp => self.complete_response(ctx, d, at, out),
        };
        r.map(|()| n).map_err(|f| (f, n))
    }

    fn complete_request(
        &mut self,
        ctx: &mut Ctx<'_>,
        d: usize,
        at: At,
        out: &mut Vec<Record>,
    ) -> Result<(), Fail> {
        let parsed = match http::parse_request(&self.sides[d].head.buf, ctx.chain) {
            Ok(p) => p,
            Err(reason) => return Err(self.not_http(ctx, reason)),
        };
        if self.fifo.len() >= MAX_PENDING {
            ctx.c.pending_overflow += 1;
            return Err(Fail::Dead("too many outstanding requests"));
        }
        if self.role.is_none() {
            self.role = Some(if d == IN {
                HttpRole::Server
            } else {
                HttpRole::Client
            });
        }
        self.settle_other(d);
        let side = &mut self.sides[d];
        let start = At {
            ts: side.head.start_ns,
            tid: side.head.start_tid,
            ready: side.head.start_ready,
        };
        side.head.reset();
        let seq = self.next_seq;
        self.next_seq = seq.saturating_add(1);
        self.any_request = true;
        self.fifo.push_back(Pending {
            seq: Some(seq),
            head: parsed.method == "HEAD",
            connect: parsed.method == "CONNECT",
            model: None,
        });
        let framing = match parsed.framing {
            BodyFraming::Length(0) | BodyFraming::Close => None,
            BodyFraming::Length(n) => Some(ReqFraming::Length(n)),
            BodyFraming::Chunked => Some(ReqFraming::Chunked(ChunkDecoder::new())),
        };
        let body = Box::new(ReqBody {
            seq,
            start,
            method: parsed.method,
            path: parsed.path,
            headers: parsed.headers,
            framing: ReqFraming::Length(0),
            body_len: 0,
            cap: json_capture(parsed.json, parsed.framing, ctx),
        });
        match framing {
            None => self.emit_request(ctx, *body, at.ts, out),
            Some(f) => {
                let mut body = body;
                body.framing = f;
                self.sides[d].st = St::Req(body);
            }
        }
        Ok(())
    }

    fn emit_request(&mut self, ctx: &mut Ctx<'_>, mut b: ReqBody, end_ns: u64, out: &mut Vec<Record>) {
        let meta = match b.cap.take() {
            Some(Body::Whole(body)) if !body.is_empty() => {
                let m = openai::request_meta(&body);
                if m.is_none() {
                    ctx.c.request_json_invalid += 1;
                }
                m
            }
            Some(Body::Ends { head, tail }) => {
                ctx.c.json_body_ends += 1;
                let m = openai::request_meta_parts(&head, &tail);
                if m.model.is_none() {
                    ctx.c.json_meta_lost += 1;
                }
                Some(m)
            }
            _ => None,
        };
        let openai::RequestMeta { stream, model, previous_response_id } = meta.unwrap_or_default();
        if let Some(p) = self.fifo.iter_mut().find(|p| p.seq == Some(b.seq)) {
            p.model.clone_from(&model);
        }
        out.push(Record::HttpRequest {
            conn: self.key,
            role: self.role(),
            seq: b.seq,
            start_ns: b.start.ts,
            end_ns,
            tid: b.start.tid,
            method: b.method,
            path: b.path,
            headers: b.headers,
            body_len: b.body_len,
            stream,
            model,
            ready_ns: b.start.ready,
        });
        if let Some(previous_response_id) = previous_response_id {
            out.push(Record::RequestLink { conn: self.key, seq: b.seq, ts_ns: end_ns, previous_response_id });
        }
    }

    /// Side `d` found a message boundary. If the other side of a connection we did
    /// not see open has seen no bytes yet, its next bytes start a message too
    /// (HTTP/1.1 alternates request and response): stop waiting for a boundary.
    fn settle_other(&mut self, d: usize) {
        let o = &mut self.sides[1 - d];
        if matches!(o.st, St::Resync) && !o.seen && !o.reported {
            o.st = St::Idle;
        }
    }

    /// A request we will not report: let its response be parsed silently.
    fn forget(&mut self, seq: u32) {
        for p in self.fifo.iter_mut().filter(|p| p.seq == Some(seq)) {
            p.seq = None;
        }
    }

    fn step_req_body(
        &mut self,
        ctx: &mut Ctx<'_>,
        d: usize,
        mut b: Box<ReqBody>,
        data: &[u8],
        at: At,
        out: &mut Vec<Record>,
    ) -> StepResult {
        match &mut b.framing {
            ReqFraming::Length(rem) => {
                let n = (*rem).min(data.len() as u64) as usize;
                *rem -= n as u64;
                let done = *rem == 0;
                b.cap.push(&data[..n], ctx.c);
                inc(&mut b.body_len, n as u64);
                if done {
                    self.emit_request(ctx, *b, at.ts, out);
                } else {
                    self.sides[d].st = St::Req(b);
                }
                Ok(n)
            }
            ReqFraming::Chunked(dec) => match dec.step(data) {
                Ok((n, item)) => {
                    match item {
                        Some(Item::Data { start, end, .. }) => {
                            b.cap.push(data.get(start..end).unwrap_or_default(), ctx.c);
                            inc(&mut b.body_len, end.saturating_sub(start) as u64);
                            self.sides[d].st = St::Req(b);
                        }
                        Some(Item::End) => self.emit_request(ctx, *b, at.ts, out),
                        None => self.sides[d].st = St::Req(b),
                    }
                    Ok(n)
                }
                Err(e) => {
                    self.count_chunk_error(ctx, e);
                    ctx.c.requests_incomplete += 1;
                    self.forget(b.seq);
                    inc(&mut ctx.c.unparsed_bytes, data.len() as u64);
                    Err((
                        Fail::Desync {
                            reason: "invalid chunked request body",
                            lost_head: false,
                        },
                        data.len(),
                    ))
                }
            },
        }
    }

    fn count_chunk_error(&self, ctx: &mut Ctx<'_>, e: ChunkError) {
        match e {
            ChunkError::Overflow => ctx.c.chunk_size_overflow += 1,
            ChunkError::Invalid => ctx.c.chunk_invalid += 1,
        }
    }

    fn complete_response(
        &mut self,
        ctx: &mut Ctx<'_>,
        d: usize,
        at: At,
        out: &mut Vec<Record>,
    ) -> Result<(), Fail> {
        let parsed = match http::parse_response(&self.sides[d].head.buf) {
            Ok(p) => p,
            Err(reason) => return Err(self.not_http(ctx, reason)),
        };
        if self.role.is_none() {
            self.role = Some(if d == OUT {
                HttpRole::Server
            } else {
                HttpRole::Client
            });
        }
        self.sides[d].head.reset();
        self.settle_other(d);
        let status = parsed.status;
        if (100..200).contains(&status) && status != 101 {
            // Interim response (100 Continue, 103 Early Hints): the final one follows.
            return Ok(());
        }
        let pending = match self.fifo.pop_front() {
            Some(p) => p,
            // Attached after the request was read: parse it to stay in sync.
            None if !self.any_request => Pending::LOST,
            None => {
                ctx.c.responses_unmatched += 1;
                return Err(Fail::Dead("response without a request"));
            }
        };
        if pending.seq.is_none() {
            ctx.c.responses_unmatched += 1;
        }
        if let Some(seq) = pending.seq {
            out.push(Record::HttpResponse {
                conn: self.key,
                role: self.role(),
                seq,
                ts_ns: at.ts,
                tid: at.tid,
                status,
                headers: parsed.headers,
            });
        }
        let tunnel = status == 101 || (pending.connect && (200..300).contains(&status));
        let no_body = tunnel || pending.head || status == 204 || status == 304;
        let framing = match parsed.framing {
            _ if no_body => None,
            BodyFraming::Length(0) => None,
            BodyFraming::Length(n) => Some(RespFraming::Length(n)),
            BodyFraming::Chunked => Some(RespFraming::Chunked(ChunkDecoder::new())),
            BodyFraming::Close => Some(RespFraming::Close),
        };
        let tracked = pending.seq.is_some();
        if (parsed.sse || parsed.json) && parsed.encoded {
            ctx.c.body_encoded += 1;
        }
        let body = Box::new(RespBody {
            seq: pending.seq,
            framing: RespFraming::Close,
            body_len: 0,
            last_ts: at.ts,
            sse: (tracked && parsed.sse && !parsed.encoded).then(SseParser::default),
            cap: json_capture(tracked && parsed.json && !parsed.sse && !parsed.encoded, parsed.framing, ctx),
            asked: pending.model,
            model_named: false,
        });
        match framing {
            None => {
                self.end_response(ctx, *body, at.ts, true, out);
                if tunnel {
                    ctx.c.upgrades += 1;
                    return Err(Fail::Dead(if status == 101 {
                        "protocol upgrade"
                    } else {
                        "connect tunnel"
                    }));
                }
            }
            Some(f) => {
                let mut body = body;
                body.framing = f;
                self.sides[d].st = St::Resp(body);
            }
        }
        Ok(())
    }

    fn emit_sse(&self, b: &mut RespBody, evs: Vec<SseOut>, d: usize, out: &mut Vec<Record>) {
        let Some(seq) = b.seq else { return };
        for ev in evs {
            match ev {
                SseOut::Event { ts, mut info } => {
                    if let Some(model) = info.model.take() {
                        self.name_model(b, seq, ts, model, out);
                    }
                    out.push(Record::Sse {
                        conn: self.key,
                        seq,
                        ts_ns: ts,
                        kind: info.kind,
                        id: info.id,
                        content_bytes: info.content_bytes,
                        finish_reason: info.finish_reason,
                        usage: info.usage,
                    });
                }
                SseOut::TooLarge { ts, bytes } => {
                    out.push(Record::Unparsed {
                        conn: self.key,
                        ts_ns: ts,
                        dir: dir_of(d),
                        bytes,
                        reason: "sse event larger than 1 MiB".to_string(),
                    });
                    out.push(Record::Sse {
                        conn: self.key,
                        seq,
                        ts_ns: ts,
                        kind: SseKind::Other,
                        id: None,
                        content_bytes: 0,
                        finish_reason: None,
                        usage: None,
                    });
                }
            }
        }
    }

    fn body_data(
        &self,
        ctx: &mut Ctx<'_>,
        d: usize,
        b: &mut RespBody,
        bytes: &[u8],
        at: At,
        out: &mut Vec<Record>,
    ) {
        inc(&mut b.body_len, bytes.len() as u64);
        b.last_ts = at.ts;
        b.cap.push(bytes, ctx.c);
        if let Some(sse) = &mut b.sse {
            let mut evs = Vec::new();
            sse.feed(bytes, at.ts, ctx.c, &mut evs);
            self.emit_sse(b, evs, d, out);
        }
    }

    fn body_gap(&self, ctx: &mut Ctx<'_>, b: &mut RespBody, n: u64, framed: bool, at: At) {
        inc(&mut b.body_len, n);
        inc(&mut ctx.c.gap_bytes_in_body, n);
        b.last_ts = at.ts;
        b.cap.gap(ctx.c);
        if let Some(sse) = &mut b.sse {
            sse.gap(framed, ctx.c);
        }
    }

    fn chunk_end(
        &self,
        ctx: &mut Ctx<'_>,
        d: usize,
        b: &mut RespBody,
        ts: u64,
        out: &mut Vec<Record>,
    ) {
        if let Some(sse) = &mut b.sse {
            let mut evs = Vec::new();
            sse.chunk_end(ts, ctx.c, &mut evs);
            self.emit_sse(b, evs, d, out);
        }
    }

    /// The first model a response names, in a record when its request named
    /// none or another.
    fn name_model(&self, b: &mut RespBody, seq: u32, ts: u64, model: String, out: &mut Vec<Record>) {
        if std::mem::replace(&mut b.model_named, true) || b.asked.as_deref() == Some(model.as_str()) {
            return;
        }
        out.push(Record::ResponseModel { conn: self.key, seq, ts_ns: ts, model });
    }

    /// The response's last byte was seen at `ts` (`clean`), or its end is unknown.
    fn end_response(&self, ctx: &mut Ctx<'_>, b: RespBody, ts: u64, clean: bool, out: &mut Vec<Record>) {
        self.end_response_as(ctx, b, ts, if clean { Ended::Clean } else { Ended::Lost }, out);
    }

    /// [`Self::end_response`], told how the response ended.
    fn end_response_as(&self, ctx: &mut Ctx<'_>, mut b: RespBody, ts: u64, how: Ended, out: &mut Vec<Record>) {
        let clean = how == Ended::Clean;
        let d = match self.role() {
            HttpRole::Server => OUT,
            HttpRole::Client => IN,
        };
        if let Some(sse) = &mut b.sse {
            let mut evs = Vec::new();
            sse.finish(ts, clean, ctx.c, &mut evs);
            self.emit_sse(&mut b, evs, d, out);
        }
        let Some(seq) = b.seq else { return };
        if how == Ended::Closed {
            ctx.c.responses_closed_early += 1;
            return;
        }
        if !clean {
            ctx.c.responses_incomplete += 1;
            return;
        }
        let meta = match b.cap.take() {
            Some(Body::Whole(body)) if !body.is_empty() => {
                let m = openai::response_meta(&body);
                if m.is_none() {
                    ctx.c.json_body_invalid += 1;
                }
                m
            }
            Some(Body::Ends { head, tail }) => {
                ctx.c.json_body_ends += 1;
                let m = openai::response_meta_parts(&head, &tail);
                if m.usage.is_none() {
                    ctx.c.json_meta_lost += 1;
                }
                (m.id.is_some() || m.usage.is_some() || m.finish_reason.is_some() || m.model.is_some()).then_some(m)
            }
            _ => None,
        };
        if let Some(mut m) = meta {
            if let Some(model) = m.model.take() {
                self.name_model(&mut b, seq, ts, model, out);
            }
            out.push(Record::ResponseBody {
                conn: self.key,
                seq,
                ts_ns: ts,
                id: m.id,
                usage: m.usage,
                finish_reason: m.finish_reason,
            });
        }
        out.push(Record::HttpResponseEnd {
            conn: self.key,
            seq,
            ts_ns: ts,
            body_len: b.body_len,
        });
    }

    /// Emits one `Unparsed` per episode on a side.
    fn report(&mut self, d: usize, ts: u64, bytes: u64, reason: &str, out: &mut Vec<Record>) {
        if !self.sides[d].reported {
            self.sides[d].reported = true;
            out.push(Record::Unparsed {
                conn: self.key,
                ts_ns: ts,
                dir: dir_of(d),
                bytes,
                reason: reason.to_string(),
            });
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn step_resp_body(
        &mut self,
        ctx: &mut Ctx<'_>,
        d: usize,
        mut b: Box<RespBody>,
        data: &[u8],
        at_start: bool,
        left: u64,
        at: At,
        out: &mut Vec<Record>,
    ) -> StepResult {
        match &mut b.framing {
            RespFraming::Length(rem) => {
                let n = (*rem).min(data.len() as u64) as usize;
                *rem -= n as u64;
                let done = *rem == 0;
                self.body_data(ctx, d, &mut b, &data[..n], at, out);
                if done {
                    self.end_response(ctx, *b, at.ts, true, out);
                } else {
                    self.sides[d].st = St::Resp(b);
                }
                Ok(n)
            }
            RespFraming::Close => {
                self.body_data(ctx, d, &mut b, data, at, out);
                self.sides[d].st = St::Resp(b);
                Ok(data.len())
            }
            RespFraming::Chunked(dec) if dec.is_lost() => {
                if at_start && data.starts_with(b"HTTP/1.") {
                    // A new response: the previous one ended somewhere we did not see.
                    self.end_response(ctx, *b, at.ts, false, out);
                    if self.fifo.len() > 1 {
                        ctx.c.resync_unsafe += 1;
                        return Err((
                            Fail::Dead("response stream lost; cannot pair responses safely"),
                            0,
                        ));
                    }
                    ctx.c.resyncs += 1;
                    self.sides[d].reported = false;
                    return Ok(0);
                }
                if at_start && chunked::size_line_ok(data) {
                    dec.reset();
                    if let Some(sse) = &mut b.sse {
                        sse.framing_resumed(ctx.c);
                    }
                    ctx.c.resyncs += 1;
                    self.sides[d].reported = false;
                    self.sides[d].st = St::Resp(b);
                    return Ok(0);
                }
                inc(&mut ctx.c.unparsed_bytes, data.len() as u64);
                self.sides[d].st = St::Resp(b);
                Ok(data.len())
            }
            RespFraming::Chunked(dec) => match dec.step(data) {
                Ok((
                    n,
                    Some(Item::Data {
                        start,
                        end,
                        chunk_end,
                    }),
                )) => {
                    self.body_data(
                        ctx,
                        d,
                        &mut b,
                        data.get(start..end).unwrap_or_default(),
                        at,
                        out,
                    );
                    if chunk_end {
                        self.chunk_end(ctx, d, &mut b, at.ts, out);
                    }
                    self.sides[d].st = St::Resp(b);
                    Ok(n)
                }
                Ok((n, Some(Item::End))) => {
                    b.last_ts = at.ts;
                    self.end_response(ctx, *b, at.ts, true, out);
                    Ok(n)
                }
                Ok((n, None)) => {
                    self.sides[d].st = St::Resp(b);
                    Ok(n)
                }
                Err(e) => {
                    self.count_chunk_error(ctx, e);
                    dec.set_lost();
                    if let Some(sse) = &mut b.sse {
                        sse.framing_lost(ctx.c);
                    }
                    let reason = match e {
                        ChunkError::Overflow => "chunk size overflows 64 bits",
                        ChunkError::Invalid => "invalid chunked framing",
                    };
                    self.sides[d].st = St::Resp(b);
                    self.report(d, at.ts, left, reason, out);
                    // The rest of this syscall is not trusted; framing may resume at the
                    // next syscall boundary.
                    inc(&mut ctx.c.unparsed_bytes, data.len() as u64);
                    Ok(data.len())
                }
            },
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn step_resync(
        &mut self,
        ctx: &mut Ctx<'_>,
        d: usize,
        data: &[u8],
        at_start: bool,
        left: u64,
        at: At,
        out: &mut Vec<Record>,
    ) -> StepResult {
        let skip = |s: &mut Self, ctx: &mut Ctx<'_>, out: &mut Vec<Record>| {
            s.skip_mid_stream(ctx, d, at, left, out);
            inc(&mut ctx.c.unparsed_bytes, data.len() as u64);
            s.sides[d].skip_ts = Some(at.ts);
            Ok(data.len())
        };
        if !at_start {
            return skip(self, ctx, out);
        }
        if !self.any_request {
            // Recognisable connection starts, even on a connection we did not see open.
            match http::classify(data.get(..16).unwrap_or(data)) {
                Some(Start::H2) => {
                    ctx.c.http2_preface += 1;
                    return Err((Fail::Dead("http/2 connection preface"), 0));
                }
                Some(Start::Tls) if data.get(2).is_some_and(|&v| v <= 0x04) => {
                    ctx.c.tls += 1;
                    return Err((Fail::Dead("tls record"), 0));
                }
                _ => {}
            }
        }
        let other = 1 - d;
        match (http::resync_candidate(data), self.kind(d)) {
            (Some(Start::Request), Some(Kind::Req) | None) => {
                if self.role.is_some() {
                    if !(self.fifo.is_empty() && matches!(self.sides[other].st, St::Idle)) {
                        ctx.c.resync_unsafe += 1;
                        return Err((
                            Fail::Dead("request stream lost; cannot pair responses safely"),
                            0,
                        ));
                    }
                } else if !self.any_request {
                    // Attached mid-stream: if the bytes we skipped were the tail of a
                    // request and nothing was answered since, its response is still to
                    // come: reserve a silent slot for it.
                    let skipped = self.sides[d].skip_ts;
                    if skipped.is_some_and(|t| self.sides[other].last_ts <= t) {
                        self.fifo.push_back(Pending::LOST);
                    }
                }
            }
            (Some(Start::Response), Some(Kind::Resp) | None) => {
                let ok = self.fifo.len() == 1 || (self.fifo.is_empty() && !self.any_request);
                if !ok {
                    ctx.c.resync_unsafe += 1;
                    return Err((
                        Fail::Dead("response stream lost; cannot pair responses safely"),
                        0,
                    ));
                }
            }
            _ => return skip(self, ctx, out),
        }
        let side = &mut self.sides[d];
        if side.reported {
            ctx.c.resyncs += 1;
        }
        side.st = St::Idle;
        side.reported = false;
        side.skip_ts = None;
        Ok(0)
    }

    /// `n` bytes moved by the syscall but not captured. On failure, also returns
    /// how many of them were not accounted for as body bytes.
    fn on_gap(
        &mut self,
        ctx: &mut Ctx<'_>,
        d: usize,
        n: u64,
        at: At,
        out: &mut Vec<Record>,
    ) -> Result<(), (Fail, u64)> {
        match std::mem::take(&mut self.sides[d].st) {
            st @ (St::Idle | St::Head) => {
                self.sides[d].st = st;
                inc(&mut ctx.c.gap_bytes_in_head, n);
                if self.role.is_none() && !self.any_request {
                    ctx.c.attach_mid_stream += 1;
                    return Err((Fail::MidStream("gap before the first http message"), n));
                }
                Err((
                    Fail::Desync {
                        reason: "gap inside an http head",
                        lost_head: true,
                    },
                    n,
                ))
            }
            St::Resync => {
                self.sides[d].st = St::Resync;
                self.skip_mid_stream(ctx, d, at, n, out);
                self.sides[d].skip_ts = Some(at.ts);
                inc(&mut ctx.c.unparsed_bytes, n);
                Ok(())
            }
            St::Req(mut b) => match &mut b.framing {
                ReqFraming::Length(rem) => {
                    let k = (*rem).min(n);
                    *rem -= k;
                    let done = *rem == 0;
                    inc(&mut b.body_len, k);
                    inc(&mut ctx.c.gap_bytes_in_body, k);
                    b.cap.gap(ctx.c);
                    if done {
                        self.emit_request(ctx, *b, at.ts, out);
                        self.gap_rest(ctx, d, n - k, at, out)
                    } else {
                        self.sides[d].st = St::Req(b);
                        Ok(())
                    }
                }
                ReqFraming::Chunked(dec) => {
                    let s = dec.skip(n);
                    inc(&mut b.body_len, s.data);
                    inc(&mut ctx.c.gap_bytes_in_body, s.data);
                    b.cap.gap(ctx.c);
                    if s.lost {
                        ctx.c.chunk_framing_lost += 1;
                        ctx.c.requests_incomplete += 1;
                        self.forget(b.seq);
                        inc(&mut ctx.c.unparsed_bytes, s.rest);
                        self.sides[d].st = St::Resync;
                        self.sides[d].skip_ts = Some(at.ts);
                        self.report(
                            d,
                            at.ts,
                            s.rest,
                            "gap hid a chunk-size line of a request body",
                            out,
                        );
                        ctx.c.desync += 1;
                        Ok(())
                    } else if s.end {
                        self.emit_request(ctx, *b, at.ts, out);
                        self.gap_rest(ctx, d, s.rest, at, out)
                    } else {
                        self.sides[d].st = St::Req(b);
                        Ok(())
                    }
                }
            },
            St::Resp(mut b) => match &mut b.framing {
                RespFraming::Length(rem) => {
                    let k = (*rem).min(n);
                    *rem -= k;
                    let done = *rem == 0;
                    self.body_gap(ctx, &mut b, k, false, at);
                    if done {
                        self.end_response(ctx, *b, at.ts, true, out);
                        self.gap_rest(ctx, d, n - k, at, out)
                    } else {
                        self.sides[d].st = St::Resp(b);
                        Ok(())
                    }
                }
                RespFraming::Close => {
                    self.body_gap(ctx, &mut b, n, false, at);
                    self.sides[d].st = St::Resp(b);
                    Ok(())
                }
                RespFraming::Chunked(dec) if dec.is_lost() => {
                    inc(&mut ctx.c.unparsed_bytes, n);
                    self.sides[d].st = St::Resp(b);
                    Ok(())
                }
                RespFraming::Chunked(dec) => {
                    let s = dec.skip(n);
                    if s.data > 0 {
                        self.body_gap(ctx, &mut b, s.data, true, at);
                    }
                    if s.chunk_end {
                        self.chunk_end(ctx, d, &mut b, at.ts, out);
                    }
                    if s.lost {
                        ctx.c.chunk_framing_lost += 1;
                        inc(&mut ctx.c.unparsed_bytes, s.rest);
                        if let Some(sse) = &mut b.sse {
                            sse.framing_lost(ctx.c);
                        }
                        self.sides[d].st = St::Resp(b);
                        self.report(d, at.ts, s.rest, "gap hid a chunk-size line", out);
                        Ok(())
                    } else if s.end {
                        self.end_response(ctx, *b, at.ts, true, out);
                        self.gap_rest(ctx, d, s.rest, at, out)
                    } else {
                        self.sides[d].st = St::Resp(b);
                        Ok(())
                    }
                }
            },
        }
    }

    /// Gap bytes left after a message ended inside the gap: they start the next one.
    fn gap_rest(
        &mut self,
        ctx: &mut Ctx<'_>,
        d: usize,
        n: u64,
        at: At,
        out: &mut Vec<Record>,
    ) -> Result<(), (Fail, u64)> {
        if n == 0 {
            return Ok(());
        }
        self.on_gap(ctx, d, n, at, out)
    }

    fn fail(
        &mut self,
        ctx: &mut Ctx<'_>,
        d: usize,
        f: Fail,
        left: u64,
        at: At,
        out: &mut Vec<Record>,
    ) {
        let buffered = self.sides[d].head.buf.len() as u64;
        inc(&mut ctx.c.unparsed_bytes, buffered);
        let bytes = buffered.saturating_add(left);
        match f {
            Fail::Dead(reason) => {
                out.push(Record::Unparsed {
                    conn: self.key,
                    ts_ns: at.ts,
                    dir: dir_of(d),
                    bytes,
                    reason: reason.to_string(),
                });
                ctx.c.conns_unparsed += 1;
                self.flush(ctx, None, false);
                self.dead = true;
                self.sides = [Side::default(), Side::default()];
            }
            Fail::Desync { reason, lost_head } => {
                ctx.c.desync += 1;
                if lost_head {
                    match self.kind(d) {
                        Some(Kind::Req) => {
                            if self.fifo.len() < MAX_PENDING {
                                self.fifo.push_back(Pending::LOST);
                            }
                            self.next_seq = self.next_seq.saturating_add(1);
                            self.any_request = true;
                        }
                        Some(Kind::Resp) => {
                            self.fifo.pop_front();
                            ctx.c.responses_lost += 1;
                        }
                        None => {}
                    }
                }
                self.enter_resync(d, at, bytes, reason, out);
            }
            Fail::MidStream(reason) => self.enter_resync(d, at, bytes, reason, out),
        }
    }

    /// Skipping bytes in `Resync` without a reported episode: that is the start of
    /// a connection we did not see open.
    fn skip_mid_stream(
        &mut self,
        ctx: &mut Ctx<'_>,
        d: usize,
        at: At,
        bytes: u64,
        out: &mut Vec<Record>,
    ) {
        if !self.sides[d].reported {
            ctx.c.attach_mid_stream += 1;
            self.report(d, at.ts, bytes, MID_STREAM, out);
        }
    }

    fn enter_resync(&mut self, d: usize, at: At, bytes: u64, reason: &str, out: &mut Vec<Record>) {
        let side = &mut self.sides[d];
        side.head.reset();
        side.st = St::Resync;
        side.skip_ts = Some(at.ts);
        self.report(d, at.ts, bytes, reason, out);
    }

    /// End of the connection (`out` given: close-delimited bodies end) or of our
    /// interest in it (eviction): count what was left unfinished. `closed`:
    /// the traced process closed it (not the recording's end): a response
    /// left unfinished then was cut short, not lost to us.
    pub fn flush(&mut self, ctx: &mut Ctx<'_>, mut out: Option<&mut Vec<Record>>, closed: bool) {
        // A request whose body never completed was never handed on: its
        // client did not give up on a request the server had.
        let mut unsent = None;
        for d in [IN, OUT] {
            let kind = self.kind(d).or(match self.sides[d].head.class {
                Some(Start::Request) => Some(Kind::Req),
                Some(Start::Response) => Some(Kind::Resp),
                _ => None,
            });
            match std::mem::take(&mut self.sides[d].st) {
                St::Head => match kind {
                    Some(Kind::Req) => ctx.c.requests_incomplete += 1,
                    Some(Kind::Resp) => ctx.c.responses_incomplete += 1,
                    None => {}
                },
                St::Req(b) => {
                    ctx.c.requests_incomplete += 1;
                    unsent = Some(b.seq);
                }
                St::Resp(b) => {
                    let close = matches!(b.framing, RespFraming::Close);
                    let ts = b.last_ts;
                    match out.as_deref_mut() {
                        Some(o) if close => self.end_response(ctx, *b, ts, true, o),
                        Some(o) if closed => self.end_response_as(ctx, *b, ts, Ended::Closed, o),
                        Some(o) => self.end_response(ctx, *b, ts, false, o),
                        None => self.end_response(ctx, *b, ts, false, &mut Vec::new()),
                    }
                }
                St::Idle | St::Resync => {}
            }
            self.sides[d].head.reset();
        }
        if closed {
            let cut = self.fifo.drain(..).filter(|p| p.seq.is_some() && p.seq != unsent).count();
            inc(&mut ctx.c.responses_closed_early, cut as u64);
        } else {
            let missing = self.fifo.drain(..).filter(|p| p.seq.is_some()).count();
            inc(&mut ctx.c.responses_missing, missing as u64);
        }
    }
}

/// How a response ended ([`Conn::end_response_as`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ended {
    /// Its last byte was seen.
    Clean,
    /// Its end is unknown: evicted, framing lost, the recording ended.
    Lost,
    /// The connection closed inside it: cut short, not lost to us.
    Closed,
}
