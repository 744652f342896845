//! Scenario tests of the wire decoder, on hand-built syscall streams.

use super::*;
use crate::event::{CloseEvent, ConnEvent, ConnOp, Dir, IoEvent, Syscall};
use crate::model::{HttpRole, SseKind, Usage};

const IN: Dir = Dir::In;
const OUT: Dir = Dir::Out;

fn key(fd: i32) -> ConnKey {
    ConnKey {
        tgid: 4242,
        fd,
        ino: 9000 + fd as u64,
    }
}

fn io_cap(k: ConnKey, dir: Dir, ts: u64, captured: &[u8], len: u64) -> KEvent {
    KEvent::Io(IoEvent {
        ts_ns: ts,
        enter_ns: ts.saturating_sub(1),
        wire_ns: None,
        tid: 7,
        conn: k,
        syscall: if dir == IN {
            Syscall::Recvfrom
        } else {
            Syscall::Sendto
        },
        dir,
        family: Family::Inet,
        len,
        data: captured.to_vec(),
        tail: vec![],
        copy_failed: false,
        burst: Burst::NoSleep,
    })
}

/// A syscall that moved `all`, captured as the kernel does with a tail: its
/// first `cap` bytes and its last `tail` ones.
fn io_ends(k: ConnKey, dir: Dir, ts: u64, all: &[u8], cap: usize, tail: usize) -> KEvent {
    let KEvent::Io(mut e) = io_cap(k, dir, ts, &all[..cap], all.len() as u64) else { unreachable!() };
    e.tail = all[all.len() - tail..].to_vec();
    KEvent::Io(e)
}

fn io(k: ConnKey, dir: Dir, ts: u64, data: &[u8]) -> KEvent {
    io_cap(k, dir, ts, data, data.len() as u64)
}

fn accept(k: ConnKey, ts: u64) -> KEvent {
    KEvent::Conn(ConnEvent {
        ts_ns: ts,
        enter_ns: ts,
        tid: 7,
        conn: k,
        op: ConnOp::Accept,
        family: Family::Inet,
        ret: i64::from(k.fd),
        local: Some("127.0.0.1:8000".parse().unwrap()),
        peer: Some("127.0.0.1:50000".parse().unwrap()),
    })
}

fn close(k: ConnKey, ts: u64) -> KEvent {
    KEvent::Close(CloseEvent {
        ts_ns: ts,
        tid: 7,
        conn: k,
    })
}

fn decoder() -> WireDecoder {
    WireDecoder::new(DecoderConfig::default())
}

fn run(dec: &mut WireDecoder, evs: &[KEvent]) -> Vec<Record> {
    let mut out = Vec::new();
    for e in evs {
        dec.on_event(e, &mut out);
    }
    out
}

fn counter(dec: &WireDecoder, name: &str) -> u64 {
    dec.counters()
        .into_iter()
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no counter {name}"))
}

/// A compact, comparable view of a record; `ts` false leaves times out.
fn show(r: &Record, ts: bool) -> String {
    let t = |v: u64| if ts { format!(" @{v}") } else { String::new() };
    match r {
        Record::ConnOpen { .. } => "open".into(),
        Record::ConnClose { ts_ns, .. } => format!("close{}", t(*ts_ns)),
        Record::HttpRequest {
            role,
            seq,
            start_ns,
            end_ns,
            method,
            path,
            body_len,
            stream,
            model,
            ..
        } => {
            let span = if ts {
                format!(" {start_ns}-{end_ns}")
            } else {
                String::new()
            };
            format!("req#{seq} {role:?} {method} {path}{span} body={body_len} stream={stream:?} model={model:?}")
        }
        Record::HttpResponse {
            seq,
            status,
            ts_ns,
            role,
            ..
        } => format!("resp#{seq} {role:?} {status}{}", t(*ts_ns)),
        Record::Sse {
            seq,
            ts_ns,
            kind,
            id,
            content_bytes,
            finish_reason,
            usage,
            ..
        } => {
            let u = usage.map(|u| {
                format!(
                    " usage={},{},{}",
                    u.prompt_tokens.unwrap_or(0),
                    u.completion_tokens.unwrap_or(0),
                    u.cached_tokens.unwrap_or(0)
                )
            });
            format!(
                "sse#{seq} {kind:?} {} {content_bytes}B fr={}{}{}",
                id.as_deref().unwrap_or("-"),
                finish_reason.as_deref().unwrap_or("-"),
                u.unwrap_or_default(),
                t(*ts_ns)
            )
        }
        Record::ResponseBody {
            seq,
            ts_ns,
            id,
            usage,
            finish_reason,
            ..
        } => format!(
            "body#{seq} {} fr={} usage={:?}{}",
            id.as_deref().unwrap_or("-"),
            finish_reason.as_deref().unwrap_or("-"),
            usage.map(|u| (u.prompt_tokens, u.completion_tokens, u.cached_tokens)),
            t(*ts_ns)
        ),
        Record::HttpResponseEnd {
            seq,
            ts_ns,
            body_len,
            ..
        } => format!("end#{seq} {body_len}B{}", t(*ts_ns)),
        Record::ResponseModel {
            seq, ts_ns, model, ..
        } => format!("model#{seq} {model}{}", t(*ts_ns)),
        Record::Unparsed {
            dir, reason, ts_ns, ..
        } => format!("unparsed {dir:?} {reason}{}", t(*ts_ns)),
        Record::UnixIo { dir, len, .. } => format!("unix {dir:?} {len}"),
        other => format!("{other:?}"),
    }
}

fn shows(rs: &[Record], ts: bool) -> Vec<String> {
    rs.iter().map(|r| show(r, ts)).collect()
}

// ---------------------------------------------------------------------------
// uvicorn-exact traffic

const PROMPT_SECRET: &str = "PROMPT-SECRET-4711";
const COMPLETION_SECRET: &str = "COMPLETION-SECRET-0815";

fn chat_request(extra_headers: &str) -> Vec<u8> {
    let body = format!(
        r#"{{"messages":[{{"role":"user","content":"hello {PROMPT_SECRET}"}}],"model":"m1","stream":true,"stream_options":{{"include_usage":true}}}}"#
    );
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nUser-Agent: chain-client/1\r\nAccept: */*\r\n\
Authorization: Bearer sk-SECRET-1\r\nCookie: session=SECRET-2\r\nx-session-id: chain-1\r\n{extra_headers}\
Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

const SSE_HEAD: &[u8] =
    b"HTTP/1.1 200 OK\r\ndate: Thu, 01 Jan 2026 00:00:00 GMT\r\nserver: uvicorn\r\n\
content-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n";

/// One uvicorn chunk write carrying one SSE event.
fn chunk(json: &str) -> Vec<u8> {
    let data = format!("data: {json}\n\n");
    format!("{:x}\r\n{data}\r\n", data.len()).into_bytes()
}

fn sse_len(json: &str) -> usize {
    format!("data: {json}\n\n").len()
}

/// The SSE event payloads of a vLLM chat stream with the given content pieces.
fn chat_events(id: &str, pieces: &[&str]) -> Vec<String> {
    let mut ev = vec![format!(
        r#"{{"id":"{id}","object":"chat.completion.chunk","created":1767225600,"model":"m1","choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},"logprobs":null,"finish_reason":null}}]}}"#
    )];
    for p in pieces {
        ev.push(format!(
            r#"{{"id":"{id}","object":"chat.completion.chunk","created":1767225600,"model":"m1","choices":[{{"index":0,"delta":{{"content":"{p}"}},"logprobs":null,"finish_reason":null}}]}}"#
        ));
    }
    ev.push(format!(
        r#"{{"id":"{id}","object":"chat.completion.chunk","created":1767225600,"model":"m1","choices":[{{"index":0,"delta":{{"content":""}},"logprobs":null,"finish_reason":"stop","stop_reason":null}}]}}"#
    ));
    ev.push(format!(
        r#"{{"id":"{id}","object":"chat.completion.chunk","created":1767225600,"model":"m1","choices":[],"usage":{{"prompt_tokens":10,"total_tokens":13,"completion_tokens":3,"prompt_tokens_details":{{"cached_tokens":4}}}}}}"#
    ));
    ev.push("[DONE]".to_string());
    ev
}

/// The writes of one streamed exchange, as (direction, bytes), server role.
fn chat_exchange(id: &str, pieces: &[&str]) -> Vec<(Dir, Vec<u8>)> {
    let mut w = vec![(IN, chat_request("")), (OUT, SSE_HEAD.to_vec())];
    for e in chat_events(id, pieces) {
        w.push((OUT, chunk(&e)));
    }
    w.push((OUT, b"0\r\n\r\n".to_vec()));
    w
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    /// One syscall per write.
    AsIs,
    /// One syscall per byte.
    Bytes,
    /// Consecutive writes in the same direction in one syscall.
    Coalesced,
}

/// Turns writes into syscalls; returns the events and, per write, the timestamp
/// of the syscall that carried each of its bytes.
fn deliver(
    k: ConnKey,
    writes: &[(Dir, Vec<u8>)],
    mode: Mode,
    t0: u64,
) -> (Vec<KEvent>, Vec<Vec<u64>>) {
    let mut evs = Vec::new();
    let mut at = Vec::new();
    let mut ts = t0;
    let mut i = 0;
    while i < writes.len() {
        let (dir, _) = writes[i];
        let mut j = i + 1;
        if mode == Mode::Coalesced {
            while j < writes.len() && writes[j].0 == dir {
                j += 1;
            }
        }
        let group = &writes[i..j];
        match mode {
            Mode::Bytes => {
                for (_, b) in group {
                    let mut v = Vec::new();
                    for byte in b {
                        ts += 10;
                        evs.push(io(k, dir, ts, &[*byte]));
                        v.push(ts);
                    }
                    at.push(v);
                }
            }
            Mode::AsIs | Mode::Coalesced => {
                ts += 1000;
                let all: Vec<u8> = group.iter().flat_map(|(_, b)| b.clone()).collect();
                evs.push(io(k, dir, ts, &all));
                for (_, b) in group {
                    at.push(vec![ts; b.len()]);
                }
            }
        }
        i = j;
    }
    (evs, at)
}

/// What one streamed chat exchange must produce, writes starting at `w`.
fn expected_chat(seq: u32, id: &str, pieces: &[&str], w: usize, at: &[Vec<u64>]) -> Vec<String> {
    let last = |i: usize| *at[i].last().unwrap();
    let req = chat_request("");
    let body_len = req.len() - (req.windows(4).position(|x| x == b"\r\n\r\n").unwrap() + 4);
    let events = chat_events(id, pieces);
    let mut v = vec![
        format!(
            "req#{seq} Server POST /v1/chat/completions {}-{} body={body_len} stream=Some(true) model=Some(\"m1\")",
            at[w][0],
            last(w)
        ),
        format!("resp#{seq} Server 200 @{}", last(w + 1)),
    ];
    // The event's last byte is the second '\n', 3 bytes before the chunk's end.
    let ev_ts = |i: usize| {
        let c = &at[w + 2 + i];
        c[c.len() - 3]
    };
    v.push(format!("sse#{seq} Role {id} 0B fr=- @{}", ev_ts(0)));
    for (i, p) in pieces.iter().enumerate() {
        v.push(format!(
            "sse#{seq} Content {id} {}B fr=- @{}",
            p.len(),
            ev_ts(1 + i)
        ));
    }
    let n = pieces.len();
    v.push(format!(
        "sse#{seq} Finish {id} 0B fr=stop @{}",
        ev_ts(n + 1)
    ));
    v.push(format!(
        "sse#{seq} Usage {id} 0B fr=- usage=10,3,4 @{}",
        ev_ts(n + 2)
    ));
    v.push(format!("sse#{seq} Done - 0B fr=- @{}", ev_ts(n + 3)));
    let total: usize = events.iter().map(|e| sse_len(e)).sum();
    v.push(format!(
        "end#{seq} {total}B @{}",
        last(w + 2 + events.len())
    ));
    v
}

type Writes = Vec<(Dir, Vec<u8>)>;
type Specs = Vec<(String, Vec<&'static str>)>;

fn three_exchanges() -> (Writes, Specs) {
    let specs: Vec<(String, Vec<&'static str>)> = vec![
        ("chatcmpl-a1".into(), vec!["Hel", "lo", " world"]),
        ("chatcmpl-b2".into(), vec!["plan", COMPLETION_SECRET]),
        ("chatcmpl-c3".into(), vec!["x", "yz", "done!", "?"]),
    ];
    let writes = specs
        .iter()
        .flat_map(|(id, p)| chat_exchange(id, p))
        .collect();
    (writes, specs)
}

fn check_three_exchanges(mode: Mode) {
    let k = key(11);
    let (writes, specs) = three_exchanges();
    let (evs, at) = deliver(k, &writes, mode, 1_000_000);
    let mut dec = decoder();
    let mut all = run(&mut dec, &[accept(k, 1)]);
    all.extend(run(&mut dec, &evs));
    all.extend(run(&mut dec, &[close(k, 99_000_000)]));
    let mut want = vec!["open".to_string()];
    let mut w = 0;
    for (seq, (id, pieces)) in specs.iter().enumerate() {
        want.extend(expected_chat(seq as u32, id, pieces, w, &at));
        w += 2 + chat_events(id, pieces).len() + 1;
    }
    want.push("close @99000000".to_string());
    assert_eq!(shows(&all, true), want, "mode {mode:?}");
    // Losses and anomalies only: these hand-built writes carry no wire
    // departure, so each is (rightly) counted as timed at its exit.
    let lossy: Vec<_> = dec
        .counters()
        .into_iter()
        .filter(|(n, v)| *v != 0 && crate::sink::report::is_loss(n))
        .collect();
    assert!(lossy.is_empty(), "mode {mode:?}: {lossy:?}");
    assert!(dec.counters().iter().any(|(n, v)| *n == "writes_timed_at_exit" && *v > 0), "mode {mode:?}");
}

#[test]
fn keep_alive_three_streamed_chats_exact_records() {
    check_three_exchanges(Mode::AsIs);
}

#[test]
fn keep_alive_three_streamed_chats_one_byte_per_syscall() {
    check_three_exchanges(Mode::Bytes);
}

#[test]
fn keep_alive_three_streamed_chats_fully_coalesced() {
    check_three_exchanges(Mode::Coalesced);
}

#[test]
fn exact_record_fields_of_a_streamed_chat() {
    let k = key(12);
    let writes = chat_exchange("chatcmpl-q", &["Hi"]);
    let (evs, _) = deliver(k, &writes, Mode::AsIs, 0);
    let mut dec = decoder();
    let out = run(&mut dec, &evs);
    match &out[0] {
        Record::HttpRequest {
            conn,
            role,
            seq,
            start_ns,
            end_ns,
            tid,
            headers,
            ..
        } => {
            assert_eq!(
                (*conn, *role, *seq, *start_ns, *end_ns, *tid),
                (k, HttpRole::Server, 0, 1000, 1000, 7)
            );
            let names: Vec<&str> = headers.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(
                names,
                [
                    "host",
                    "user-agent",
                    "accept",
                    "x-session-id",
                    "content-type",
                    "content-length"
                ]
            );
            assert!(headers.contains(&("x-session-id".into(), "chain-1".into())));
        }
        r => panic!("{r:?}"),
    }
    match &out[1] {
        Record::HttpResponse {
            headers, status, ..
        } => {
            assert_eq!(*status, 200);
            let names: Vec<&str> = headers.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(names, ["content-type", "transfer-encoding"]);
        }
        r => panic!("{r:?}"),
    }
    match &out[3] {
        Record::Sse {
            kind,
            content_bytes,
            id,
            ..
        } => {
            assert_eq!(
                (*kind, *content_bytes, id.as_deref()),
                (SseKind::Content, 2, Some("chatcmpl-q"))
            );
        }
        r => panic!("{r:?}"),
    }
}

#[test]
fn random_splits_give_the_same_records() {
    let k = key(13);
    let (writes, _) = three_exchanges();
    let (evs, _) = deliver(k, &writes, Mode::AsIs, 0);
    let want = shows(&run(&mut decoder(), &evs), false);
    assert_eq!(want.len(), 10 + 9 + 11);
    let mut rng = Lcg(7);
    for round in 0..30 {
        let mut evs = vec![accept(k, 0)];
        let mut ts = 0;
        for (dir, b) in &writes {
            let mut pos = 0;
            while pos < b.len() {
                let n = 1 + rng.below(if round % 2 == 0 { 8 } else { 400 });
                let end = (pos + n).min(b.len());
                ts += 1;
                evs.push(io(k, *dir, ts, &b[pos..end]));
                pos = end;
            }
        }
        let mut dec = decoder();
        assert_eq!(
            shows(&run(&mut dec, &evs), false)[1..],
            want,
            "round {round}"
        );
    }
}

// ---------------------------------------------------------------------------
// requests

#[test]
fn pipelined_requests_in_one_read_are_paired_in_order() {
    let k = key(20);
    let r1 = b"GET /v1/models HTTP/1.1\r\nHost: a\r\n\r\n";
    let body = r#"{"model":"m2","stream":false}"#;
    let r2 = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let r3 = b"GET /health HTTP/1.1\r\nHost: a\r\n\r\n";
    let read = [&r1[..], r2.as_bytes(), &r3[..]].concat();
    let mut dec = decoder();
    let out = run(
        &mut dec,
        &[
            accept(k, 1),
            io(k, IN, 100, &read),
            io(
                k,
                OUT,
                200,
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}",
            ),
            io(
                k,
                OUT,
                300,
                b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",
            ),
        ],
    );
    assert_eq!(
        shows(&out, true),
        [
            "open",
            "req#0 Server GET /v1/models 100-100 body=0 stream=None model=None",
            "req#1 Server POST /v1/completions 100-100 body=29 stream=Some(false) model=Some(\"m2\")",
            "req#2 Server GET /health 100-100 body=0 stream=None model=None",
            "resp#0 Server 200 @200",
            "body#0 - fr=- usage=None @200",
            "end#0 2B @200",
            "resp#1 Server 200 @300",
            "end#1 0B @300",
            "resp#2 Server 204 @300",
            "end#2 0B @300",
        ]
    );
}

#[test]
fn large_body_captured_partly_is_skipped_by_count() {
    let k = key(21);
    let body_len = 100_000usize;
    let head = format!("POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\nContent-Length: {body_len}\r\n\r\n");
    let mut body =
        br#"{"model":"m1","stream":true,"messages":[{"role":"user","content":""#.to_vec();
    body.resize(body_len - 4, b'x');
    body.extend_from_slice(br#""}]}"#);
    let all = [head.as_bytes(), &body].concat();
    let mut dec = decoder();
    // Reads of 65536 with 4096 captured, then the rest, captured likewise.
    let first = 65536usize;
    let out = run(
        &mut dec,
        &[
            accept(k, 1),
            io_cap(k, IN, 100, &all[..4096], first as u64),
            io_cap(
                k,
                IN,
                200,
                &all[first..first + 4096],
                (all.len() - first) as u64,
            ),
            io(k, OUT, 300, b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"),
        ],
    );
    assert_eq!(
        shows(&out, true),
        [
            "open",
            "req#0 Server POST /v1/chat/completions 100-200 body=100000 stream=Some(true) model=Some(\"m1\")",
            "resp#0 Server 200 @300",
            "end#0 0B @300",
        ]
    );
    assert_eq!(counter(&dec, "desync"), 0);
    assert_eq!(
        counter(&dec, "gap_bytes_in_body"),
        (all.len() - 8192) as u64
    );
    // Read from the body's first bytes: its members before the prompt.
    assert_eq!((counter(&dec, "json_body_ends"), counter(&dec, "json_meta_lost")), (1, 0));
}

/// openai-python 1.x writes `messages` first: behind a long prompt, `model` and
/// `stream` are in the last bytes of the read, which the probe captures
/// apart. Requests whose model is in neither end are counted.
#[test]
fn an_sdk_ordered_long_request_keeps_model_and_stream_from_the_reads_tail() {
    let body = |model: &str, tools: usize| {
        let mut b = br#"{"messages":[{"role":"user","content":""#.to_vec();
        b.resize(40_000, b'x');
        b.extend_from_slice(format!(r#""}}],"model":"{model}","max_tokens":16,"stream":true,"tools":[{}]}}"#, "1,".repeat(tools) + "1").as_bytes());
        b
    };
    let req = |body: &[u8]| [format!("POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n", body.len()).as_bytes(), body].concat();
    let (a, b) = (key(30), key(31));
    let near = req(&body("org/model-7b", 0));
    let far = req(&body("org/model-7b", 20_000));
    let mut dec = decoder();
    let out = run(
        &mut dec,
        &[
            accept(a, 1),
            // One read of the whole request: 4 KiB, a gap, the last 16 KiB.
            io_ends(a, IN, 100, &near, 4096, 16384),
            io(a, OUT, 200, b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"),
            accept(b, 2),
            // `tools` longer than the tail: the model is not in it.
            io_ends(b, IN, 300, &far, 4096, 16384),
            io(b, OUT, 400, b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"),
        ],
    );
    let shown = shows(&out, true);
    let reqs: Vec<&String> = shown.iter().filter(|l| l.starts_with("req#0 Server POST")).collect();
    assert_eq!(reqs.len(), 2, "{shown:?}");
    assert!(reqs[0].ends_with(&format!("body={} stream=Some(true) model=Some(\"org/model-7b\")", body("org/model-7b", 0).len())), "{shown:?}");
    assert!(reqs[1].ends_with("stream=None model=None"), "{shown:?}");
    assert_eq!((counter(&dec, "json_body_ends"), counter(&dec, "json_meta_lost")), (2, 1));
    assert_eq!(counter(&dec, "desync"), 0);
}

/// The model a response names is recorded once, before the event that
/// carried it, when its request named none (its body's model lost to the
/// capture) or another; not when it repeats the request's.
#[test]
fn a_response_names_its_model_only_when_its_request_did_not_or_named_another() {
    let long = |model: &str| {
        let mut b = br#"{"messages":[{"role":"user","content":""#.to_vec();
        b.resize(40_000, b'x');
        b.extend_from_slice(format!(r#""}}],"model":"{model}","stream":true,"tools":[{}]}}"#, "1,".repeat(20_000) + "1").as_bytes());
        let head = format!("POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n", b.len());
        [head.as_bytes(), &b].concat()
    };
    let short = |model: &str| {
        let b = format!(r#"{{"model":"{model}","messages":[],"stream":true}}"#);
        format!("POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: {}\r\n\r\n{b}", b.len()).into_bytes()
    };
    let mut dec = decoder();
    let mut evs = Vec::new();
    // Each answers with chat_events' "m1" in every chunk.
    for (fd, req) in [(60, short("m1")), (61, short("alias")), (62, long("m1"))] {
        let k = key(fd);
        let t = fd as u64 * 100;
        evs.push(accept(k, t));
        evs.push(if req.len() > 4096 { io_ends(k, IN, t + 1, &req, 4096, 16384) } else { io(k, IN, t + 1, &req) });
        evs.push(io(k, OUT, t + 2, SSE_HEAD));
        for (i, e) in chat_events(&format!("chatcmpl-{fd}"), &["a", "b"]).iter().enumerate() {
            evs.push(io(k, OUT, t + 3 + i as u64, &chunk(e)));
        }
        evs.push(io(k, OUT, t + 20, b"0\r\n\r\n"));
    }
    let out = run(&mut dec, &evs);
    let named: Vec<(i32, &str, u64)> = out
        .iter()
        .filter_map(|r| match r {
            Record::ResponseModel { conn, seq: 0, model, ts_ns } => Some((conn.fd, model.as_str(), *ts_ns)),
            _ => None,
        })
        .collect();
    // The first chunk's (the role chunk, written at t + 3).
    assert_eq!(named, [(61, "m1", 6103), (62, "m1", 6203)]);
    let at = out.iter().position(|r| matches!(r, Record::ResponseModel { conn, .. } if conn.fd == 62)).unwrap();
    assert!(matches!(&out[at + 1], Record::Sse { kind: SseKind::Role, .. }), "{:?}", &out[at + 1]);
    let lost: Vec<bool> = out.iter().filter_map(|r| match r {
        Record::HttpRequest { model, .. } => Some(model.is_none()),
        _ => None,
    }).collect();
    assert_eq!(lost, [false, false, true], "the long request's model is past both ends");
    assert_eq!(counter(&dec, "json_meta_lost"), 1);
}

/// A Responses API turn sent with `previous_response_id` gets a
/// `RequestLink` right after its request (same connection, sequence and
/// time); one without, or with a null one, none. From a long body's tail too.
#[test]
fn a_request_naming_its_previous_response_is_linked_to_it() {
    let post = |body: String| format!("POST /v1/responses HTTP/1.1\r\nHost: a\r\nContent-Length: {}\r\n\r\n{body}", body.len()).into_bytes();
    let reqs = [
        (80, post(r#"{"input":"SECRET","model":"m","previous_response_id":"resp_1","stream":true}"#.into())),
        (81, post(r#"{"input":"SECRET","model":"m","previous_response_id":null}"#.into())),
        (82, post(format!(r#"{{"input":"{}","model":"m","previous_response_id":"resp_2"}}"#, "S".repeat(30_000)))),
    ];
    let mut dec = decoder();
    let mut evs = Vec::new();
    for (fd, req) in &reqs {
        let k = key(*fd);
        let t = *fd as u64 * 100;
        evs.push(accept(k, t));
        evs.push(if req.len() > 4096 { io_ends(k, IN, t + 1, req, 4096, 16384) } else { io(k, IN, t + 1, req) });
    }
    let out = run(&mut dec, &evs);
    let links: Vec<(i32, &str)> = out
        .iter()
        .filter_map(|r| match r {
            Record::RequestLink { conn, seq: 0, previous_response_id, .. } => Some((conn.fd, previous_response_id.as_str())),
            _ => None,
        })
        .collect();
    assert_eq!(links, [(80, "resp_1"), (82, "resp_2")]);
    for (i, r) in out.iter().enumerate() {
        if let Record::RequestLink { conn, ts_ns, .. } = r {
            assert!(matches!(&out[i - 1], Record::HttpRequest { conn: c, end_ns, .. } if c == conn && end_ns == ts_ns), "{:?}", &out[i - 1]);
        }
    }
    assert!(!format!("{out:?}").contains("SECRET"));
}

/// A `/v1/responses` stream as vLLM writes it (`event:` then `data:`, one
/// uvicorn chunk per event). Its first and last events echo the request's
/// 24 KB instructions and the last the whole 10 KB output too: longer than
/// the 4 KiB capture and its 16 KiB tail, they are told by their last bytes:
/// the stream's opening, then its usage and finish.
#[test]
fn a_responses_api_stream_is_read_with_its_long_events_from_their_ends() {
    let k = key(70);
    let instructions = "i".repeat(24_000);
    let text = "t".repeat(10_000);
    let response = |status: &str, output: &str, usage: &str| format!(r#"{{"id":"resp_abc","created_at":1767225600,"incomplete_details":null,"instructions":"{instructions}","metadata":null,"model":"org/m-8b","object":"response","output":[{output}],"parallel_tool_calls":true,"temperature":1.0,"tool_choice":"auto","tools":[],"top_p":1.0,"status":"{status}","usage":{usage},"user":null}}"#);
    let message = format!(r#"{{"id":"msg_1","content":[{{"annotations":[],"text":"{text}","type":"output_text","logprobs":null}}],"role":"assistant","status":"completed","type":"message"}}"#);
    let usage = r#"{"input_tokens":1500,"input_tokens_details":{"cached_tokens":1024},"output_tokens":3,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":1503}"#;
    let events = [
        ("response.created", format!(r#"{{"response":{},"sequence_number":0,"type":"response.created"}}"#, response("in_progress", "", "null"))),
        ("response.in_progress", r#"{"response":{"id":"resp_abc","status":"in_progress"},"sequence_number":1,"type":"response.in_progress"}"#.to_string()),
        ("response.output_text.delta", r#"{"content_index":0,"delta":"Hel","item_id":"msg_1","logprobs":[],"output_index":0,"sequence_number":2,"type":"response.output_text.delta"}"#.to_string()),
        ("response.output_text.delta", r#"{"content_index":0,"delta":"lo","item_id":"msg_1","logprobs":[],"output_index":0,"sequence_number":3,"type":"response.output_text.delta"}"#.to_string()),
        ("response.completed", format!(r#"{{"response":{},"sequence_number":4,"type":"response.completed"}}"#, response("completed", &message, usage))),
    ];
    let body = r#"{"model":"org/m-8b","input":"hi","stream":true}"#;
    let mut evs = vec![
        accept(k, 1),
        io(k, IN, 2, format!("POST /v1/responses HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).as_bytes()),
        io(k, OUT, 3, SSE_HEAD),
    ];
    for (i, (kind, json)) in events.iter().enumerate() {
        let data = format!("event: {kind}\ndata: {json}\n\n");
        let write = format!("{:x}\r\n{data}\r\n", data.len()).into_bytes();
        // As the probe: the prefix, then at most 16 KiB of the rest.
        evs.push(if write.len() > 4096 { io_ends(k, OUT, 10 + i as u64, &write, 4096, (write.len() - 4096).min(16384)) } else { io(k, OUT, 10 + i as u64, &write) });
    }
    evs.push(io(k, OUT, 20, b"0\r\n\r\n"));
    let mut dec = decoder();
    let out = run(&mut dec, &evs);
    let shown: Vec<String> = shows(&out, true).into_iter().filter(|l| l.starts_with("sse#") || l.starts_with("end#")).collect();
    assert_eq!(
        shown,
        [
            "sse#0 Role resp_abc 0B fr=- @10",
            "sse#0 Other resp_abc 0B fr=- @11",
            "sse#0 Content - 3B fr=- @12",
            "sse#0 Content - 2B fr=- @13",
            "sse#0 Usage resp_abc 0B fr=stop usage=1500,3,1024 @14",
            &format!("end#0 {}B @20", out.iter().find_map(|r| match r { Record::HttpResponseEnd { body_len, .. } => Some(*body_len), _ => None }).unwrap()),
        ]
    );
    assert_eq!((counter(&dec, "sse_events_from_ends"), counter(&dec, "sse_events_truncated"), counter(&dec, "desync")), (2, 0, 0));
}

/// vLLM's Anthropic Messages API stream (`/v1/messages`), as vLLM 0.32.0
/// wrote it (its `data:` lines, one 8-token answer cut at `max_tokens`; one
/// token decoded to no text); `proto::openai`'s tests classify it too.
pub(crate) const MESSAGES_STREAM: [&str; 14] = [
    r#"{"type":"message_start","message":{"id":"chatcmpl-a13fa5d1dff138bd","type":"message","role":"assistant","content":[],"model":"tiny","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":22,"output_tokens":0}}}"#,
    r#"{"type":"content_block_start","content_block":{"type":"text","text":""},"index":0}"#,
    r#"{"type":"content_block_delta","delta":{"type":"text_delta","text":"am"},"index":0}"#,
    r#"{"type":"content_block_delta","delta":{"type":"text_delta","text":"edge"},"index":0}"#,
    r#"{"type":"content_block_delta","delta":{"type":"text_delta","text":" case"},"index":0}"#,
    r#"{"type":"content_block_delta","delta":{"type":"text_delta","text":"block"},"index":0}"#,
    r#"{"type":"content_block_delta","delta":{"type":"text_delta","text":"engin"},"index":0}"#,
    r#"{"type":"content_block_delta","delta":{"type":"text_delta","text":"~"},"index":0}"#,
    r#"{"type":"content_block_delta","delta":{"type":"text_delta","text":""},"index":0}"#,
    r#"{"type":"content_block_delta","delta":{"type":"text_delta","text":" "},"index":0}"#,
    r#"{"type":"content_block_stop","index":0}"#,
    r#"{"type":"ping"}"#,
    r#"{"type":"message_delta","delta":{"stop_reason":"max_tokens","stop_sequence":null},"usage":{"input_tokens":22,"output_tokens":8}}"#,
    r#"{"type":"message_stop"}"#,
];

/// An Anthropic Messages API stream as vLLM writes it (`event:` then
/// `data:`, one uvicorn chunk per event): the message's id (vLLM's chat
/// completion's) from its start, content chunks, usage and stop reason, and
/// the end at `message_stop`.
#[test]
fn an_anthropic_messages_stream_gives_its_id_content_usage_and_end() {
    let k = key(71);
    let body = r#"{"model":"tiny","max_tokens":8,"messages":[{"role":"user","content":"SECRET"}],"stream":true}"#;
    let mut evs = vec![
        accept(k, 1),
        io(k, IN, 2, format!("POST /v1/messages HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).as_bytes()),
        io(k, OUT, 3, SSE_HEAD),
    ];
    for (i, json) in MESSAGES_STREAM.iter().enumerate() {
        let kind = json.split('"').nth(3).unwrap();
        let data = format!("event: {kind}\ndata: {json}\n\n");
        evs.push(io(k, OUT, 10 + i as u64, format!("{:x}\r\n{data}\r\n", data.len()).as_bytes()));
    }
    evs.push(io(k, OUT, 30, b"0\r\n\r\n"));
    let mut dec = decoder();
    let out = run(&mut dec, &evs);
    let shown: Vec<String> = shows(&out, true).into_iter().filter(|l| l.starts_with("sse#") || l.starts_with("req#")).collect();
    let id = "chatcmpl-a13fa5d1dff138bd";
    let content = |b: u32, at: u32| format!("sse#0 Content - {b}B fr=- @{at}");
    assert_eq!(
        shown[1..],
        [
            format!("sse#0 Role {id} 0B fr=- usage=22,0,0 @10"),
            "sse#0 Other - 0B fr=- @11".into(),
            content(2, 12),
            content(4, 13),
            content(5, 14),
            content(5, 15),
            content(5, 16),
            content(1, 17),
            "sse#0 Other - 0B fr=- @18".into(),
            content(1, 19),
            "sse#0 Other - 0B fr=- @20".into(),
            "sse#0 Other - 0B fr=- @21".into(),
            "sse#0 Usage - 0B fr=length usage=22,8,0 @22".into(),
            "sse#0 Done - 0B fr=- @23".into(),
        ],
        "{shown:#?}"
    );
    assert!(shown[0].contains(" POST /v1/messages "), "{shown:?}");
    assert_eq!((counter(&dec, "sse_json_invalid"), counter(&dec, "desync")), (0, 0));
    assert!(!format!("{out:?}").contains("SECRET"));
}

/// vLLM 0.34.0's Rust frontend (hyper) writes a burst of SSE chunks with one
/// writev, each Responses API event's `type` and `sequence_number` first:
/// two 4.3 KiB events (long instructions echoed) in one 8.8 KiB write, which
/// the probe brings as its 4 KiB prefix and its tail. The second's chunk-size
/// line is in the tail: framing kept, both events whole. In a later write
/// too long for both ends, a cut event is told by the type its head names,
/// and what the gap took is counted.
#[test]
fn a_hyper_writev_burst_of_long_responses_events_keeps_its_framing() {
    let k = key(72);
    let instructions = "i".repeat(4_000);
    let event = |kind: &str, seq: u32| {
        let json = format!(r#"{{"type":"{kind}","sequence_number":{seq},"response":{{"id":"resp_f9","object":"response","status":"in_progress","instructions":"{instructions}","model":"tiny","usage":null}}}}"#);
        let data = format!("event: {kind}\ndata: {json}\n\n");
        format!("{:X}\r\n{data}\r\n", data.len()).into_bytes()
    };
    let body = r#"{"model":"tiny","input":"hi","stream":true}"#;
    let head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\ndate: Sun, 06 Dec 2026 07:51:28 GMT\r\n\r\n";
    let burst = [&head[..], &event("response.created", 0), &event("response.in_progress", 1)].concat();
    let delta = br#"{"type":"response.output_text.delta","sequence_number":2,"item_id":"msg_1","output_index":0,"content_index":0,"delta":"Hi","logprobs":[]}"#;
    let delta = format!("event: response.output_text.delta\ndata: {}\n\n", String::from_utf8_lossy(delta));
    // A write longer than 4 KiB + 16 KiB: 6 events, the first cut after its head, the second
    // lost whole, the third cut before its tail.
    let long: Vec<u8> = (3..9).flat_map(|seq| event(if seq == 8 { "response.completed" } else { "response.output_item.done" }, seq)).collect();
    assert!(long.len() > 4096 + 16384 + 4200, "{}", long.len());
    let evs = [
        accept(k, 1),
        io(k, IN, 2, format!("POST /v1/responses HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).as_bytes()),
        io_ends(k, OUT, 10, &burst, 4096, burst.len() - 4096),
        io(k, OUT, 11, format!("{:X}\r\n{delta}\r\n", delta.len()).as_bytes()),
        io_ends(k, OUT, 12, &long, 4096, 16384),
        io(k, OUT, 13, b"0\r\n\r\n"),
    ];
    let mut dec = decoder();
    let out = run(&mut dec, &evs);
    let shown: Vec<String> = shows(&out, true).into_iter().filter(|l| l.starts_with("sse#") || l.starts_with("end#")).collect();
    assert_eq!(
        shown[..4],
        ["sse#0 Role resp_f9 0B fr=- @10", "sse#0 Other resp_f9 0B fr=- @10", "sse#0 Content - 2B fr=- @11", "sse#0 Other resp_f9 0B fr=- @12"],
        "{shown:#?}"
    );
    // The burst lost nothing; the over-long write's loss is counted (what followed its cut
    // first event, framing included), and the body's end is still seen.
    assert!(shown[4].starts_with("end#0 ") && shown.len() == 5, "{shown:#?}");
    let counted = ["chunk_framing_lost", "sse_events_lost_in_gap", "sse_events_from_ends", "sse_events_truncated", "desync"].map(|c| counter(&dec, c));
    assert_eq!(counted, [1, 1, 1, 0, 0]);
}

/// A chunked request body: the gap falls in a chunk's data (skipped by
/// count), and the tail's window holds the de-chunked data, not the framing.
#[test]
fn a_chunked_long_request_reads_its_model_from_the_de_chunked_tail() {
    let k = key(33);
    let mut json = br#"{"messages":[{"role":"user","content":""#.to_vec();
    json.resize(30_000, b'z');
    json.extend_from_slice(br#""}],"model":"chunky","stream":false}"#);
    let (a, b) = json.split_at(20_000);
    let body = [format!("{:x}\r\n", a.len()).as_bytes(), a, b"\r\n", format!("{:x}\r\n", b.len()).as_bytes(), b, b"\r\n0\r\n\r\n"].concat();
    let req = [&b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"[..], &body].concat();
    let mut dec = decoder();
    // The second chunk's size line lies in the tail's 16 KiB: framing kept.
    let out = run(&mut dec, &[accept(k, 1), io_ends(k, IN, 100, &req, 4096, 16384), io(k, OUT, 200, b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")]);
    let shown = shows(&out, true);
    assert!(shown.iter().any(|l| l.starts_with("req#0 ") && l.ends_with(&format!("body={} stream=Some(false) model=Some(\"chunky\")", json.len()))), "{shown:?}");
    assert_eq!((counter(&dec, "json_body_ends"), counter(&dec, "json_meta_lost"), counter(&dec, "chunk_framing_lost")), (1, 0, 0));
}

/// A long non-streaming answer: its `usage` and `finish_reason` come from
/// the write's tail, its id from the head.
#[test]
fn a_long_non_streaming_answer_keeps_its_usage_from_the_writes_tail() {
    let k = key(32);
    let mut body = br#"{"id":"chatcmpl-9","object":"chat.completion","model":"m-long","choices":[{"index":0,"message":{"role":"assistant","content":""#.to_vec();
    body.resize(30_000, b'y');
    body.extend_from_slice(br#""},"finish_reason":"length"}],"usage":{"prompt_tokens":12,"completion_tokens":7000,"prompt_tokens_details":{"cached_tokens":8}}}"#);
    let resp = [format!("HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n", body.len()).as_bytes(), &body[..]].concat();
    let mut dec = decoder();
    let out = run(
        &mut dec,
        &[
            accept(k, 1),
            io(k, IN, 100, b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\ncontent-length: 2\r\n\r\n{}"),
            io_ends(k, OUT, 200, &resp, 4096, 16384),
        ],
    );
    let meta: Vec<_> = out
        .iter()
        .filter_map(|r| match r {
            Record::ResponseBody { id, usage, finish_reason, .. } => Some((id.clone(), *usage, finish_reason.clone())),
            _ => None,
        })
        .collect();
    let usage = Usage { prompt_tokens: Some(12), completion_tokens: Some(7000), cached_tokens: Some(8) };
    assert_eq!(meta, vec![(Some("chatcmpl-9".to_string()), Some(usage), Some("length".to_string()))]);
    // The request named none: the model the head names is recorded.
    assert!(out.iter().any(|r| matches!(r, Record::ResponseModel { model, .. } if model == "m-long")), "{out:?}");
    assert!(out.iter().any(|r| matches!(r, Record::HttpResponseEnd { body_len, .. } if *body_len == body.len() as u64)));
    assert_eq!((counter(&dec, "json_body_ends"), counter(&dec, "json_meta_lost"), counter(&dec, "desync")), (1, 0, 0));
}

#[test]
fn chunked_request_body_is_dechunked_for_metadata() {
    let k = key(22);
    let req = b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n\
b\r\n{\"model\":\"m\r\n11\r\n3\",\"stream\":true}\r\n0\r\n\r\n";
    let mut dec = decoder();
    let out = run(
        &mut dec,
        &[io(k, IN, 5, &req[..60]), io(k, IN, 6, &req[60..])],
    );
    assert_eq!(
        shows(&out, true),
        ["req#0 Server POST /v1/completions 5-6 body=28 stream=Some(true) model=Some(\"m3\")"]
    );
}

#[test]
fn gap_inside_head_desyncs_then_resyncs_at_next_request() {
    let k = key(23);
    let req = chat_request("");
    let mut dec = decoder();
    let out = run(
        &mut dec,
        &[
            accept(k, 1),
            io(k, IN, 50, b"GET /v1/models HTTP/1.1\r\nHost: a\r\n\r\n"),
            io(k, OUT, 60, b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"),
            // Request #1: only 20 bytes of its head captured.
            io_cap(k, IN, 100, &req[..20], req.len() as u64),
            // Its response: parsed for framing, nothing reported.
            io(k, OUT, 200, SSE_HEAD),
            io(k, OUT, 210, &chunk("[DONE]")),
            io(k, OUT, 220, b"0\r\n\r\n"),
            io(k, IN, 300, b"GET /v1/models HTTP/1.1\r\nHost: a\r\n\r\n"),
            io(k, OUT, 400, b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"),
        ],
    );
    assert_eq!(
        shows(&out, true),
        [
            "open",
            "req#0 Server GET /v1/models 50-50 body=0 stream=None model=None",
            "resp#0 Server 200 @60",
            "end#0 0B @60",
            "unparsed In gap inside an http head @100",
            // seq 1 was the lost request.
            "req#2 Server GET /v1/models 300-300 body=0 stream=None model=None",
            "resp#2 Server 200 @400",
            "end#2 0B @400",
        ]
    );
    assert_eq!(counter(&dec, "desync"), 1);
    assert_eq!(counter(&dec, "gap_bytes_in_head"), req.len() as u64 - 20);
    assert_eq!(counter(&dec, "responses_unmatched"), 1);
    assert_eq!(counter(&dec, "resyncs"), 1);
}

#[test]
fn gap_in_the_first_head_of_a_connection_skips_to_the_next_request() {
    let k = key(26);
    let req = chat_request("");
    let mut dec = decoder();
    let out = run(
        &mut dec,
        &[
            accept(k, 1),
            io_cap(k, IN, 100, &req[..20], req.len() as u64),
            io(k, OUT, 200, b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"),
            io(k, IN, 300, b"GET /v1/models HTTP/1.1\r\nHost: a\r\n\r\n"),
            io(k, OUT, 400, b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"),
        ],
    );
    assert_eq!(
        shows(&out, true),
        [
            "open",
            "unparsed In gap before the first http message @100",
            "req#0 Server GET /v1/models 300-300 body=0 stream=None model=None",
            "resp#0 Server 200 @400",
            "end#0 0B @400",
        ]
    );
    assert_eq!(counter(&dec, "responses_unmatched"), 1);
}

#[test]
fn desync_with_outstanding_requests_gives_up_rather_than_mispair() {
    let k = key(24);
    let mut dec = decoder();
    let out = run(
        &mut dec,
        &[
            accept(k, 1),
            io(k, IN, 100, b"GET /a HTTP/1.1\r\n\r\n"),
            io_cap(k, IN, 110, b"GET /b HT", 40),
            // A new request while /a and the lost one are unanswered: ambiguous.
            io(k, IN, 120, b"GET /c HTTP/1.1\r\n\r\n"),
            io(k, OUT, 200, b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"),
        ],
    );
    let s = shows(&out, false);
    assert_eq!(s[1], "req#0 Server GET /a body=0 stream=None model=None");
    assert_eq!(s[2], "unparsed In gap inside an http head");
    assert_eq!(
        s[3],
        "unparsed In request stream lost; cannot pair responses safely"
    );
    assert_eq!(s.len(), 4);
    assert_eq!(counter(&dec, "resync_unsafe"), 1);
}

#[test]
fn copy_failed_event_is_a_gap_of_its_whole_length() {
    let k = key(25);
    let mut dec = decoder();
    let mut ev = io_cap(k, IN, 100, b"", 300);
    if let KEvent::Io(e) = &mut ev {
        e.copy_failed = true;
    }
    let out = run(
        &mut dec,
        &[accept(k, 1), io(k, IN, 50, b"GET / HTTP/1.1\r\n\r\n"), ev],
    );
    assert_eq!(shows(&out, false)[2], "unparsed In gap inside an http head");
    assert_eq!(counter(&dec, "gap_bytes_in_head"), 300);
}

// ---------------------------------------------------------------------------
// connections that are not HTTP/1.x

#[test]
fn http2_preface_gives_one_unparsed_and_other_connections_are_fine() {
    let (a, b) = (key(30), key(31));
    let mut dec = decoder();
    let settings = [0u8, 0, 0, 4, 0, 0, 0, 0, 0];
    let out = run(
        &mut dec,
        &[
            accept(a, 1),
            accept(b, 2),
            io(a, IN, 10, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
            io(a, IN, 11, &settings),
            io(a, OUT, 12, &settings),
            io(b, IN, 13, b"GET /v1/models HTTP/1.1\r\nHost: a\r\n\r\n"),
            io(a, IN, 14, &settings),
            io(b, OUT, 15, b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"),
        ],
    );
    assert_eq!(
        shows(&out, true),
        [
            "open",
            "open",
            "unparsed In http/2 connection preface @10",
            "req#0 Server GET /v1/models 13-13 body=0 stream=None model=None",
            "resp#0 Server 200 @15",
            "end#0 0B @15",
        ]
    );
    assert_eq!(counter(&dec, "http2_preface"), 1);
    assert_eq!(counter(&dec, "unparsed_bytes"), 24 + 27);
    match &out[2] {
        Record::Unparsed { conn, bytes, .. } => assert_eq!((*conn, *bytes), (a, 24)),
        r => panic!("{r:?}"),
    }
}

#[test]
fn tls_and_garbage_connections_are_unparsed_once() {
    let (a, b) = (key(32), key(33));
    let mut dec = decoder();
    let out = run(
        &mut dec,
        &[
            accept(a, 1),
            accept(b, 2),
            io(a, IN, 10, &[0x16, 0x03, 0x01, 0x02, 0x00]),
            io(a, IN, 11, &[1, 2, 3]),
            io(b, IN, 12, b"\x00\x01garbage\xff\xfe"),
            io(b, IN, 13, b"GET / HTTP/1.1\r\n\r\n"),
            io(b, OUT, 14, b"more garbage"),
        ],
    );
    assert_eq!(
        shows(&out, false),
        [
            "open",
            "open",
            "unparsed In tls record",
            "unparsed In not an http/1.x message"
        ]
    );
    assert_eq!((counter(&dec, "tls"), counter(&dec, "not_http")), (1, 1));
}

#[test]
fn header_of_one_megabyte_is_dropped_with_bounded_memory() {
    let k = key(34);
    let mut dec = decoder();
    let max = DecoderConfig::default().max_head_bytes;
    let mut out = run(
        &mut dec,
        &[accept(k, 1), io(k, IN, 2, b"GET / HTTP/1.1\r\nX-Big: ")],
    );
    let piece = vec![b'a'; 16 * 1024];
    for i in 0..64 {
        dec.on_event(&io(k, IN, 10 + i, &piece), &mut out);
        assert!(
            dec.buffered_bytes() <= 2 * max,
            "buffered {}",
            dec.buffered_bytes()
        );
    }
    dec.on_event(&io(k, IN, 100, b"\r\n\r\n"), &mut out);
    assert_eq!(
        shows(&out, false),
        ["open", "unparsed In http head larger than max_head_bytes"]
    );
    assert_eq!(counter(&dec, "head_too_large"), 1);
    assert_eq!(dec.buffered_bytes(), 0);
    assert_eq!(counter(&dec, "unparsed_bytes"), 23 + 64 * 16 * 1024 + 4);
}

#[test]
fn protocol_upgrade_stops_parsing_the_connection() {
    let k = key(35);
    let mut dec = decoder();
    let out = run(
        &mut dec,
        &[
            accept(k, 1),
            io(
                k,
                IN,
                2,
                b"GET /ws HTTP/1.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
            ),
            io(
                k,
                OUT,
                3,
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n\r\n",
            ),
            io(k, IN, 4, &[0x81, 0x85, 1, 2, 3, 4, 5]),
        ],
    );
    assert_eq!(
        shows(&out, false),
        [
            "open",
            "req#0 Server GET /ws body=0 stream=None model=None",
            "resp#0 Server 101",
            "end#0 0B",
            "unparsed Out protocol upgrade",
        ]
    );
}

// ---------------------------------------------------------------------------
// responses

#[test]
fn completions_stream_with_text_chunks() {
    let k = key(40);
    let ev = |text: &str, fr: &str| {
        chunk(&format!(
            r#"{{"id":"cmpl-77","object":"text_completion","created":1,"model":"m1","choices":[{{"index":0,"text":"{text}","logprobs":null,"finish_reason":{fr},"stop_reason":null}}],"usage":null}}"#
        ))
    };
    let body = br#"{"model":"m1","prompt":"Once","stream":true}"#;
    let req = format!("POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n", body.len());
    let mut dec = decoder();
    let out = run(
        &mut dec,
        &[
            io(k, IN, 1, &[req.as_bytes(), body].concat()),
            io(k, OUT, 2, SSE_HEAD),
            io(k, OUT, 3, &ev(" upon", "null")),
            io(k, OUT, 4, &ev(" a time", "null")),
            io(k, OUT, 5, &ev("", "\"length\"")),
            io(
                k,
                OUT,
                6,
                &chunk(
                    r#"{"id":"cmpl-77","object":"text_completion","created":1,"model":"m1","choices":[],"usage":{"prompt_tokens":1,"total_tokens":4,"completion_tokens":3}}"#,
                ),
            ),
            io(k, OUT, 7, &chunk("[DONE]")),
            io(k, OUT, 8, b"0\r\n\r\n"),
        ],
    );
    let s = shows(&out, true);
    assert_eq!(
        &s[2..],
        [
            "sse#0 Content cmpl-77 5B fr=- @3",
            "sse#0 Content cmpl-77 7B fr=- @4",
            "sse#0 Finish cmpl-77 0B fr=length @5",
            "sse#0 Usage cmpl-77 0B fr=- usage=1,3,0 @6",
            "sse#0 Done - 0B fr=- @7",
            &s[7],
        ]
    );
    assert!(s[7].starts_with("end#0 ") && s[7].ends_with("@8"));
}

#[test]
fn non_streaming_json_response_gives_response_body() {
    let k = key(41);
    let json = br#"{"id":"chatcmpl-ns","object":"chat.completion","model":"m1","choices":[{"index":0,"message":{"role":"assistant","content":"COMPLETION-SECRET-0815"},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":5,"total_tokens":17,"prompt_tokens_details":{"cached_tokens":8}}}"#;
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        json.len()
    );
    let mut dec = decoder();
    let out = run(
        &mut dec,
        &[
            io(
                k,
                IN,
                1,
                b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}",
            ),
            io(k, OUT, 2, head.as_bytes()),
            io(k, OUT, 3, &json[..50]),
            io(k, OUT, 4, &json[50..]),
        ],
    );
    assert_eq!(
        shows(&out, true)[1..],
        [
            "resp#0 Server 200 @2".to_string(),
            // The request named no model: the response's is recorded.
            "model#0 m1 @4".to_string(),
            "body#0 chatcmpl-ns fr=stop usage=Some((Some(12), Some(5), Some(8))) @4".to_string(),
            format!("end#0 {}B @4", json.len()),
        ]
    );
    assert!(!format!("{out:?}").contains("SECRET"));
}

#[test]
fn json_response_with_a_gap_gives_no_response_body() {
    let k = key(42);
    let json = br#"{"id":"chatcmpl-ns","choices":[],"usage":{"prompt_tokens":1}}"#;
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        json.len()
    );
    let mut dec = decoder();
    let out = run(
        &mut dec,
        &[
            io(k, IN, 1, b"GET /x HTTP/1.1\r\n\r\n"),
            io_cap(
                k,
                OUT,
                2,
                &[head.as_bytes(), &json[..10]].concat(),
                (head.len() + json.len()) as u64,
            ),
        ],
    );
    assert_eq!(
        shows(&out, false)[1..],
        [
            "resp#0 Server 200".to_string(),
            format!("end#0 {}B", json.len())
        ]
    );
}

#[test]
fn client_role_when_the_traced_process_sends_the_request() {
    let k = key(43);
    let mut dec = decoder();
    let mut evs = vec![KEvent::Conn(ConnEvent {
        ts_ns: 1,
        enter_ns: 0,
        tid: 7,
        conn: k,
        op: ConnOp::Connect,
        family: Family::Inet6,
        ret: -115,
        local: None,
        peer: Some("[::1]:8000".parse().unwrap()),
    })];
    evs.push(io(
        k,
        OUT,
        10,
        &chat_request("traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n"),
    ));
    evs.push(io(k, IN, 20, SSE_HEAD));
    for (i, e) in chat_events("chatcmpl-cl", &["a"]).iter().enumerate() {
        evs.push(io(k, IN, 30 + i as u64, &chunk(e)));
    }
    evs.push(io(k, IN, 90, b"0\r\n\r\n"));
    let out = run(&mut dec, &evs);
    let s = shows(&out, true);
    assert_eq!(s[0], "open");
    assert!(
        s[1].starts_with("req#0 Client POST /v1/chat/completions 10-10"),
        "{}",
        s[1]
    );
    assert_eq!(s[2], "resp#0 Client 200 @20");
    assert_eq!(s[4], "sse#0 Content chatcmpl-cl 1B fr=- @31");
    assert!(s.last().unwrap().ends_with("@90"));
    match (&out[0], &out[1]) {
        (Record::ConnOpen { op, peer, .. }, Record::HttpRequest { role, headers, .. }) => {
            assert_eq!(
                (*op, peer.as_deref()),
                (ConnOp::Connect, Some("[::1]:8000"))
            );
            assert_eq!(*role, HttpRole::Client);
            assert!(headers
                .iter()
                .any(|(n, v)| n == "traceparent" && v.starts_with("00-0af7")));
        }
        r => panic!("{r:?}"),
    }
}

#[test]
fn chunk_size_overflow_is_counted_and_the_next_exchange_resyncs() {
    let k = key(44);
    let mut dec = decoder();
    let out = run(
        &mut dec,
        &[
            accept(k, 1),
            io(k, IN, 2, b"GET /a HTTP/1.1\r\n\r\n"),
            io(k, OUT, 3, SSE_HEAD),
            io(k, OUT, 4, b"ffffffffffffffffffff\r\ndata: [DONE]\n\n\r\n"),
            io(k, OUT, 5, b"0\r\n\r\n"),
            io(k, IN, 6, b"GET /b HTTP/1.1\r\n\r\n"),
            io(k, OUT, 7, b"HTTP/1.1 200 OK\r\ncontent-length: 1\r\n\r\nz"),
        ],
    );
    assert_eq!(
        shows(&out, true),
        [
            "open",
            "req#0 Server GET /a 2-2 body=0 stream=None model=None",
            "resp#0 Server 200 @3",
            "unparsed Out chunk size overflows 64 bits @4",
            // Framing picked up again at the next syscall, which is the terminator.
            "end#0 0B @5",
            "req#1 Server GET /b 6-6 body=0 stream=None model=None",
            "resp#1 Server 200 @7",
            "end#1 1B @7",
        ]
    );
    assert_eq!(counter(&dec, "chunk_size_overflow"), 1);
    assert_eq!(counter(&dec, "resyncs"), 1);
}

#[test]
fn close_delimited_body_ends_at_close_or_finish() {
    let (a, b) = (key(45), key(46));
    let mut dec = decoder();
    let mut out = run(
        &mut dec,
        &[
            io(a, IN, 1, b"GET /a HTTP/1.1\r\n\r\n"),
            io(
                a,
                OUT,
                2,
                b"HTTP/1.0 200 OK\r\ncontent-type: text/plain\r\n\r\nabc",
            ),
            io(a, OUT, 3, b"defg"),
            close(a, 9),
            io(b, IN, 10, b"GET /b HTTP/1.1\r\n\r\n"),
            io(b, OUT, 11, b"HTTP/1.1 200 OK\r\n\r\nxy"),
        ],
    );
    dec.finish(&mut out);
    assert_eq!(
        shows(&out, true),
        [
            "req#0 Server GET /a 1-1 body=0 stream=None model=None",
            "resp#0 Server 200 @2",
            "end#0 7B @3",
            "close @9",
            "req#0 Server GET /b 10-10 body=0 stream=None model=None",
            "resp#0 Server 200 @11",
            "end#0 2B @11",
        ]
    );
}

#[test]
fn head_204_304_and_interim_responses_have_no_body() {
    let k = key(47);
    let mut dec = decoder();
    let out = run(
        &mut dec,
        &[
            io(k, IN, 1, b"HEAD /a HTTP/1.1\r\n\r\nPOST /b HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n"),
            io(k, OUT, 2, b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n"),
            io(k, OUT, 3, b"HTTP/1.1 100 Continue\r\n\r\n"),
            io(k, IN, 4, b"{}"),
            io(k, OUT, 5, b"HTTP/1.1 304 Not Modified\r\n\r\n"),
        ],
    );
    assert_eq!(
        shows(&out, true),
        [
            "req#0 Server HEAD /a 1-1 body=0 stream=None model=None",
            "resp#0 Server 200 @2",
            "end#0 0B @2",
            "req#1 Server POST /b 1-4 body=2 stream=None model=None",
            "resp#1 Server 304 @5",
            "end#1 0B @5",
        ]
    );
}

#[test]
fn attach_mid_stream_skips_to_the_next_message() {
    let k = key(48);
    let mut dec = decoder();
    let out = run(
        &mut dec,
        &[
            // No accept seen: the tail of a response that started before we attached.
            io(
                k,
                OUT,
                1,
                &chunk("{\"id\":\"chatcmpl-old\",\"choices\":[]}"),
            ),
            io(k, OUT, 2, b"0\r\n\r\n"),
            io(k, IN, 3, b"GET /v1/models HTTP/1.1\r\n\r\n"),
            io(k, OUT, 4, b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"),
        ],
    );
    assert_eq!(
        shows(&out, false),
        [
            "unparsed Out no http message boundary (attached mid-stream)",
            "req#0 Server GET /v1/models body=0 stream=None model=None",
            "resp#0 Server 200",
            "end#0 0B",
        ]
    );
    assert_eq!(counter(&dec, "desync"), 0);
}

/// Netlink (an interface list read as a server starts: vLLM, torch and
/// gloo do) is neither unix nor IP: counted, never fed to the HTTP decoder,
/// which took such a dump for a stream attached mid-way and its bytes for
/// unparsed ones.
#[test]
fn sockets_of_other_families_are_counted_and_not_decoded() {
    let k = key(49);
    let mut dec = decoder();
    let netlink = |ts: u64, dir: Dir, data: &[u8]| match io(k, dir, ts, data) {
        KEvent::Io(mut e) => {
            e.family = Family::Unknown;
            KEvent::Io(e)
        }
        other => other,
    };
    let dump = vec![0x5au8; 3000];
    let out = run(&mut dec, &[netlink(1, OUT, &[0x14, 0, 0, 0, 0x12, 0, 3, 3]), netlink(2, IN, &dump), netlink(3, IN, &dump)]);
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(counter(&dec, "io_other_family"), 3);
    for k in ["unparsed_bytes", "attach_mid_stream", "conns_unparsed", "not_http"] {
        assert_eq!(counter(&dec, k), 0, "{k}");
    }
}

#[test]
fn attach_mid_request_leaves_its_response_unreported() {
    let k = key(49);
    let mut dec = decoder();
    let out = run(
        &mut dec,
        &[
            io(k, IN, 1, b"tail of a request body\"}]}"),
            io(
                k,
                OUT,
                2,
                b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nold",
            ),
            io(k, IN, 3, b"GET /new HTTP/1.1\r\n\r\n"),
            io(
                k,
                OUT,
                4,
                b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nnew",
            ),
        ],
    );
    assert_eq!(
        shows(&out, false)[1..],
        [
            "req#0 Server GET /new body=0 stream=None model=None",
            "resp#0 Server 200",
            "end#0 3B"
        ]
    );
}

// ---------------------------------------------------------------------------
// SSE and capture gaps

/// Each chunk write captured only up to `cap` bytes.
fn truncated(writes: &[(Dir, Vec<u8>)], cap: usize, k: ConnKey) -> Vec<KEvent> {
    writes
        .iter()
        .enumerate()
        .map(|(i, (d, b))| {
            io_cap(
                k,
                *d,
                1000 * (i as u64 + 1),
                &b[..b.len().min(cap)],
                b.len() as u64,
            )
        })
        .collect()
}

#[test]
fn truncated_sse_writes_still_give_one_event_each_at_the_right_write() {
    let k = key(50);
    let writes = chat_exchange("chatcmpl-tr", &["one", "two"]);
    let mut dec = decoder();
    // Request and head fit; each chunk keeps only its first 60 bytes.
    let mut evs = vec![
        io(k, IN, 1000, &writes[0].1),
        io(k, OUT, 2000, &writes[1].1),
    ];
    evs.extend(truncated(&writes, 60, k).into_iter().skip(2));
    let out = run(&mut dec, &evs);
    let s = shows(&out, true);
    assert_eq!(
        s[2..],
        [
            "sse#0 Other chatcmpl-tr 0B fr=- @3000",
            "sse#0 Other chatcmpl-tr 0B fr=- @4000",
            "sse#0 Other chatcmpl-tr 0B fr=- @5000",
            "sse#0 Other chatcmpl-tr 0B fr=- @6000",
            "sse#0 Other chatcmpl-tr 0B fr=- @7000",
            "sse#0 Done - 0B fr=- @8000",
            &s[8],
        ]
    );
    assert!(s[8].starts_with("end#0 ") && s[8].ends_with("@9000"));
    assert_eq!(counter(&dec, "sse_events_truncated"), 5);
    assert_eq!(counter(&dec, "sse_events_lost_in_gap"), 0);
    assert_eq!(counter(&dec, "desync"), 0);
}

#[test]
fn coalesced_write_over_capture_limit_loses_framing_then_resumes() {
    let k = key(51);
    let events = chat_events("chatcmpl-co", &["a", "b", "c"]);
    let chunks: Vec<Vec<u8>> = events.iter().map(|e| chunk(e)).collect();
    // Role..usage (6 chunks) in one write; the probe keeps 1.5 chunks of it.
    let big: Vec<u8> = chunks[..6].concat();
    let cap = chunks[0].len() + chunks[1].len() / 2;
    let mut dec = decoder();
    let out = run(
        &mut dec,
        &[
            io(k, IN, 1, b"GET /x HTTP/1.1\r\n\r\n"),
            io(k, OUT, 2, SSE_HEAD),
            io_cap(k, OUT, 3, &big[..cap], big.len() as u64),
            io(k, OUT, 4, &chunks[6]),
            io(k, OUT, 5, b"0\r\n\r\n"),
        ],
    );
    assert_eq!(
        shows(&out, true)[1..],
        [
            "resp#0 Server 200 @2",
            "model#0 m1 @3",
            "sse#0 Role chatcmpl-co 0B fr=- @3",
            "sse#0 Other chatcmpl-co 0B fr=- @3",
            "unparsed Out gap hid a chunk-size line @3",
            "sse#0 Done - 0B fr=- @4",
            &format!(
                "end#0 {}B @5",
                sse_len_of(&chunks[0]) + sse_len_of(&chunks[1]) + sse_len_of(&chunks[6])
            ),
        ]
    );
    assert_eq!(counter(&dec, "chunk_framing_lost"), 1);
    assert_eq!(counter(&dec, "sse_events_lost_in_gap"), 1);
    assert_eq!(counter(&dec, "resyncs"), 1);
}

/// Data length of one chunk (its size line and CRLF removed).
fn sse_len_of(c: &[u8]) -> usize {
    let line = c.windows(2).position(|w| w == b"\r\n").unwrap();
    c.len() - line - 4
}

#[test]
fn sse_over_content_length_with_a_gap_counts_possible_losses() {
    let k = key(52);
    let body = [
        &b"data: {\"id\":\"x1\",\"choices\":[{\"delta\":{\"content\":\"abc\"}}]}\n\n"[..],
        b"data: [DONE]\n\n",
    ]
    .concat();
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let mut dec = decoder();
    let out = run(
        &mut dec,
        &[
            io(k, IN, 1, b"GET /x HTTP/1.1\r\n\r\n"),
            io(k, OUT, 2, head.as_bytes()),
            io_cap(k, OUT, 3, &body[..20], 40),
            io(k, OUT, 4, &body[40..]),
        ],
    );
    assert_eq!(
        shows(&out, true)[2..],
        [
            "sse#0 Other x1 0B fr=- @4".to_string(),
            "sse#0 Done - 0B fr=- @4".to_string(),
            format!("end#0 {}B @4", body.len()),
        ]
    );
    assert_eq!(counter(&dec, "sse_events_lost_in_gap"), 1);
}

#[test]
fn comments_event_and_id_lines_are_tolerated() {
    let k = key(53);
    let body = b": keep-alive\r\n\r\nevent: message\r\nid: 5\r\ndata: {\"id\":\"chatcmpl-z\",\r\ndata: \"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\r\n\r\n";
    let mut dec = decoder();
    let out = run(
        &mut dec,
        &[
            io(k, IN, 1, b"GET /x HTTP/1.1\r\n\r\n"),
            io(
                k,
                OUT,
                2,
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n",
            ),
            io(k, OUT, 3, body),
            close(k, 4),
        ],
    );
    assert_eq!(
        shows(&out, true)[2..],
        [
            "sse#0 Content chatcmpl-z 2B fr=- @3".to_string(),
            format!("end#0 {}B @3", body.len()),
            "close @4".into()
        ]
    );
}

#[test]
fn invalid_sse_json_is_counted_and_reported_as_other() {
    let k = key(54);
    let mut dec = decoder();
    let out = run(
        &mut dec,
        &[
            io(k, IN, 1, b"GET /x HTTP/1.1\r\n\r\n"),
            io(k, OUT, 2, SSE_HEAD),
            io(k, OUT, 3, &chunk("{not json")),
            io(
                k,
                OUT,
                4,
                &chunk("{\"error\":{\"message\":\"overloaded\"}}"),
            ),
        ],
    );
    assert_eq!(
        shows(&out, false)[2..],
        ["sse#0 Other - 0B fr=-", "sse#0 Error - 0B fr=-"]
    );
    assert_eq!(counter(&dec, "sse_json_invalid"), 1);
}

// ---------------------------------------------------------------------------
// other families, privacy, bounds

#[test]
fn unix_socket_io_is_reported_without_payload() {
    let k = key(60);
    let mut dec = decoder();
    let ev = KEvent::Io(IoEvent {
        ts_ns: 5,
        enter_ns: 4,
        wire_ns: None,
        tid: 9,
        conn: k,
        syscall: Syscall::Sendmsg,
        dir: OUT,
        family: Family::Unix,
        len: 100,
        data: b"GET / HTTP/1.1\r\n\r\n".to_vec(),
        tail: vec![],
        copy_failed: false,
        burst: Burst::NoSleep,
    });
    let out = run(&mut dec, &[ev]);
    assert_eq!(
        out,
        [Record::UnixIo {
            conn: k,
            ts_ns: 5,
            enter_ns: 4,
            tid: 9,
            dir: OUT,
            len: 100
        }]
    );
    assert_eq!(dec.tracked_conns(), 0);
}

#[test]
fn a_unix_write_names_its_wake_up_only_when_trusted_and_counts_the_others() {
    let k = key(62);
    let mut dec = decoder();
    let write = |ts: u64, dir: Dir, burst: Burst| {
        KEvent::Io(IoEvent {
            ts_ns: ts,
            enter_ns: ts - 1,
            wire_ns: None,
            tid: 9,
            conn: k,
            syscall: if dir == OUT { Syscall::Sendmsg } else { Syscall::Recvmsg },
            dir,
            family: Family::Unix,
            len: 3,
            data: b"abc".to_vec(),
            tail: vec![],
            copy_failed: false,
            burst,
        })
    };
    let out = run(
        &mut dec,
        &[
            write(100, OUT, Burst::Woken { wake_ns: 40, on_ns: 50 }),
            write(200, OUT, Burst::WakeUnseen),
            write(300, OUT, Burst::Implausible),
            write(400, OUT, Burst::Implausible),
            write(500, OUT, Burst::NoSleep),
            write(600, IN, Burst::Woken { wake_ns: 540, on_ns: 550 }),
        ],
    );
    let woken: Vec<_> = out.iter().filter(|r| matches!(r, Record::WokenWrite { .. })).collect();
    assert_eq!(woken, [&Record::WokenWrite { ts_ns: 100, tgid: 4242, tid: 9, wake_ns: 40, on_ns: 50 }], "reads name none");
    assert_eq!(out.iter().filter(|r| matches!(r, Record::UnixIo { .. })).count(), 6, "every write is still reported");
    assert_eq!(counter(&dec, "write_wakeups_unseen"), 1);
    assert_eq!(counter(&dec, "write_wakeups_implausible"), 2);
}

#[test]
fn secrets_in_prompt_completion_and_auth_never_reach_records() {
    let (writes, _) = three_exchanges();
    for mode in [Mode::AsIs, Mode::Bytes, Mode::Coalesced] {
        let k = key(61);
        let (evs, _) = deliver(k, &writes, mode, 0);
        let mut dec = decoder();
        let mut out = run(&mut dec, &evs);
        out.extend(run(&mut dec, &[close(k, u64::MAX)]));
        let dbg = format!("{out:?}");
        assert!(!dbg.contains("SECRET"), "mode {mode:?}");
        assert!(!dbg.contains("hello"), "mode {mode:?}");
        assert!(!dbg.contains("world"), "mode {mode:?}");
    }
    // Only with capture_payload do bytes leave the decoder, as RawIo.
    let k = key(62);
    let (evs, _) = deliver(k, &writes, Mode::AsIs, 0);
    let mut dec = WireDecoder::new(DecoderConfig {
        capture_payload: true,
        ..DecoderConfig::default()
    });
    let out = run(&mut dec, &evs);
    assert!(out.iter().any(|r| matches!(r, Record::RawIo { data, .. }
        if data.windows(PROMPT_SECRET.len()).any(|w| w == PROMPT_SECRET.as_bytes()))));
    assert!(format!("{out:?}").contains("HttpRequest"));
}

#[test]
fn least_recently_used_connection_is_evicted() {
    let mut dec = WireDecoder::new(DecoderConfig {
        max_conns: 2,
        ..DecoderConfig::default()
    });
    let out = run(
        &mut dec,
        &[
            io(key(70), IN, 1, b"GET /a HT"),
            io(key(71), IN, 2, b"GET /b HT"),
            io(key(70), IN, 3, b"TP/1.1\r\n\r\n"),
            io(key(72), IN, 4, b"GET /c HTTP/1.1\r\n\r\n"),
        ],
    );
    assert_eq!(
        shows(&out, false),
        [
            "req#0 Server GET /a body=0 stream=None model=None",
            "req#0 Server GET /c body=0 stream=None model=None"
        ]
    );
    assert_eq!(counter(&dec, "conns_evicted"), 1);
    assert_eq!(counter(&dec, "requests_incomplete"), 1);
    assert_eq!(dec.tracked_conns(), 2);
}

#[test]
fn close_and_finish_count_incomplete_exchanges() {
    let (a, b) = (key(73), key(74));
    let mut dec = decoder();
    let mut out = run(
        &mut dec,
        &[
            io(
                a,
                IN,
                1,
                b"POST /a HTTP/1.1\r\nContent-Length: 10\r\n\r\n12345",
            ),
            close(a, 2),
            io(b, IN, 3, b"GET /b HTTP/1.1\r\n\r\n"),
            io(b, OUT, 4, SSE_HEAD),
            io(
                b,
                OUT,
                5,
                &chunk("{\"choices\":[{\"delta\":{\"content\":\"x\"}}]}"),
            ),
        ],
    );
    dec.finish(&mut out);
    // a's request never completed: its client gave up on nothing the server had.
    assert_eq!(counter(&dec, "requests_incomplete"), 1);
    assert_eq!(counter(&dec, "responses_missing"), 0);
    assert_eq!(counter(&dec, "responses_incomplete"), 1);
    assert_eq!(counter(&dec, "responses_closed_early"), 0);
    assert_eq!(dec.tracked_conns(), 0);
    assert!(shows(&out, false).contains(&"close".to_string()));
}

#[test]
fn a_close_inside_a_response_or_before_its_head_cuts_it_short_and_is_no_loss() {
    let (a, b, c) = (key(75), key(76), key(77));
    let mut dec = decoder();
    let mut out = run(
        &mut dec,
        &[
            // a: still queued (no head yet) when its client left.
            io(a, IN, 1, b"GET /a HTTP/1.1\r\n\r\n"),
            close(a, 2),
            // b: left in the middle of its stream.
            io(b, IN, 3, b"GET /b HTTP/1.1\r\n\r\n"),
            io(b, OUT, 4, SSE_HEAD),
            io(b, OUT, 5, &chunk("{\"choices\":[{\"delta\":{\"content\":\"x\"}}]}")),
            close(b, 6),
            // c: a request nobody answered before the recording ended.
            io(c, IN, 7, b"GET /c HTTP/1.1\r\n\r\n"),
        ],
    );
    dec.finish(&mut out);
    assert_eq!(counter(&dec, "responses_closed_early"), 2);
    assert_eq!(counter(&dec, "responses_missing"), 1, "c");
    assert_eq!(counter(&dec, "responses_incomplete"), 0);
    // b's content chunk still reached the correlator before its close.
    let shown = shows(&out, true);
    let at = |s: &str| shown.iter().position(|x| x.starts_with(s)).unwrap_or_else(|| panic!("{s} in {shown:?}"));
    assert!(at("sse#0 Content") < at("close @6"), "{shown:?}");
}

#[test]
fn counter_names_are_snake_case_and_unique() {
    let names: Vec<&str> = decoder().counters().into_iter().map(|(n, _)| n).collect();
    for required in [
        "unparsed_bytes",
        "desync",
        "gap_bytes_in_head",
        "http2_preface",
        "head_too_large",
        "conns_evicted",
        "requests_incomplete",
        "sse_json_invalid",
        "sse_events_lost_in_gap",
    ] {
        assert!(names.contains(&required), "{required}");
    }
    let mut sorted = names.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), names.len());
    assert!(names.iter().all(|n| n
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')));
}

// ---------------------------------------------------------------------------
// robustness

/// Small deterministic generator for the fuzz-style tests.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

#[test]
fn random_events_never_panic_and_stay_bounded() {
    let mut rng = Lcg(42);
    let alphabet: &[&[u8]] = &[
        b"GET / HTTP/1.1\r\n",
        b"HTTP/1.1 200 OK\r\n",
        b"transfer-encoding: chunked\r\n",
        b"content-length: 5\r\n",
        b"content-type: text/event-stream\r\n",
        b"\r\n",
        b"ffffffffffffffffffffff\r\n",
        b"5\r\nhello\r\n",
        b"0\r\n\r\n",
        b"data: {\"id\":\"x\",\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\n",
        b"data: [DONE]\n\n",
        b"PRI * HTTP/2.0\r\n\r\n",
        b"\x16\x03\x01",
        b"\x00\xff",
    ];
    let mut dec = WireDecoder::new(DecoderConfig {
        max_conns: 8,
        max_head_bytes: 4096,
        ..DecoderConfig::default()
    });
    let mut out = Vec::new();
    for i in 0..20_000u64 {
        let k = key(rng.below(12) as i32);
        let ev = match rng.below(20) {
            0 => accept(k, i),
            1 => close(k, i),
            _ => {
                let mut data = Vec::new();
                for _ in 0..rng.below(6) {
                    data.extend_from_slice(alphabet[rng.below(alphabet.len())]);
                }
                if rng.below(4) == 0 {
                    let n = rng.below(data.len() + 1);
                    data.truncate(n);
                }
                let gap = if rng.below(5) == 0 {
                    rng.below(10_000) as u64
                } else {
                    0
                };
                let dir = if rng.below(2) == 0 { IN } else { OUT };
                io_cap(k, dir, i, &data, data.len() as u64 + gap)
            }
        };
        dec.on_event(&ev, &mut out);
        assert!(dec.buffered_bytes() <= 8 * 3 * (4096 * 2 + (1 << 21)));
        out.clear();
    }
    // Pathological lengths.
    dec.on_event(
        &io_cap(key(1), IN, 1, b"GET / HTTP/1.1\r\n", u64::MAX),
        &mut out,
    );
    dec.on_event(&io_cap(key(1), IN, 1, b"x", u64::MAX), &mut out);
    dec.on_event(&io_cap(key(2), OUT, 1, b"too long captured", 3), &mut out);
    dec.finish(&mut out);
    assert_eq!(counter(&dec, "internal_stall"), 0);
}

#[test]
fn mutated_uvicorn_streams_never_panic() {
    let (writes, _) = three_exchanges();
    let mut rng = Lcg(9);
    for _ in 0..200 {
        let mut dec = WireDecoder::new(DecoderConfig {
            max_head_bytes: 2048,
            ..DecoderConfig::default()
        });
        let mut out = Vec::new();
        let k = key(80);
        dec.on_event(&accept(k, 0), &mut out);
        for (i, (dir, b)) in writes.iter().enumerate() {
            let mut b = b.clone();
            for _ in 0..rng.below(3) {
                if !b.is_empty() {
                    let p = rng.below(b.len());
                    b[p] = rng.next() as u8;
                }
            }
            let mut pos = 0;
            while pos < b.len() {
                let n = 1 + rng.below(300);
                let end = (pos + n).min(b.len());
                let cap = if rng.below(6) == 0 {
                    rng.below(end - pos)
                } else {
                    end - pos
                };
                dec.on_event(
                    &io_cap(k, *dir, i as u64, &b[pos..pos + cap], (end - pos) as u64),
                    &mut out,
                );
                pos = end;
            }
        }
        dec.finish(&mut out);
        assert_eq!(counter(&dec, "internal_stall"), 0);
    }
}

#[test]
fn http2_and_tls_are_recognised_without_seeing_the_connection_open() {
    let (a, b) = (key(90), key(91));
    let mut dec = decoder();
    let out = run(
        &mut dec,
        &[
            io(a, IN, 1, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
            io(a, IN, 2, b"\x00\x00\x00\x04"),
            io(b, IN, 3, &[0x16, 0x03, 0x01, 0x00, 0xa5, 0x01]),
        ],
    );
    assert_eq!(
        shows(&out, false),
        [
            "unparsed In http/2 connection preface",
            "unparsed In tls record"
        ]
    );
    assert_eq!(
        (counter(&dec, "http2_preface"), counter(&dec, "tls")),
        (1, 1)
    );
    assert_eq!(counter(&dec, "unparsed_bytes"), 24 + 4 + 6);
}

#[test]
fn body_ending_inside_a_gap_then_a_lost_head_is_counted_exactly() {
    let k = key(92);
    let head = b"POST /a HTTP/1.1\r\nContent-Length: 10\r\n\r\n";
    let captured = [&head[..], b"01234"].concat();
    let mut dec = decoder();
    let out = run(
        &mut dec,
        &[
            accept(k, 1),
            io_cap(k, IN, 5, &captured, (head.len() + 10 + 30) as u64),
        ],
    );
    assert_eq!(
        shows(&out, true),
        [
            "open",
            "req#0 Server POST /a 5-5 body=10 stream=None model=None",
            "unparsed In gap inside an http head @5"
        ]
    );
    assert_eq!(counter(&dec, "gap_bytes_in_body"), 5);
    assert_eq!(counter(&dec, "gap_bytes_in_head"), 30);
    assert_eq!(counter(&dec, "unparsed_bytes"), 30);
    assert_eq!(counter(&dec, "desync"), 1);
}

#[test]
fn sse_event_split_across_chunks_is_timed_by_its_last_byte() {
    let k = key(93);
    let ev = "data: {\"id\":\"chatcmpl-s\",\"choices\":[{\"delta\":{\"content\":\"abc\"}}]}\n\n";
    let (p1, p2) = ev.split_at(30);
    let ch = |s: &str| format!("{:x}\r\n{s}\r\n", s.len()).into_bytes();
    let mut dec = decoder();
    let out = run(
        &mut dec,
        &[
            io(k, IN, 1, b"GET /x HTTP/1.1\r\n\r\n"),
            io(k, OUT, 2, SSE_HEAD),
            io(k, OUT, 3, &ch(p1)),
            io(k, OUT, 4, &ch(p2)),
            io(k, OUT, 5, b"0\r\n\r\n"),
        ],
    );
    assert_eq!(
        shows(&out, true)[2..],
        [
            "sse#0 Content chatcmpl-s 3B fr=- @4".to_string(),
            format!("end#0 {}B @5", ev.len())
        ]
    );
}

#[test]
fn json_captures_share_a_global_budget_released_on_close() {
    let mut dec = decoder();
    let body = vec![b' '; 1_000_000];
    let mut out = Vec::new();
    for fd in 0..70 {
        let k = key(100 + fd);
        let head = "POST /v1/chat/completions HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 1000001\r\n\r\n";
        dec.on_event(&accept(k, 1), &mut out);
        dec.on_event(&io(k, IN, 2, head.as_bytes()), &mut out);
        dec.on_event(&io(k, IN, 3, &body), &mut out);
        assert!(dec.budget.load(std::sync::atomic::Ordering::Relaxed) <= conn::CAPTURE_BUDGET);
    }
    assert!(counter(&dec, "capture_budget_exceeded") >= 3);
    for fd in 0..70 {
        dec.on_event(&close(key(100 + fd), 4), &mut out);
    }
    assert_eq!(dec.budget.load(std::sync::atomic::Ordering::Relaxed), 0);
    assert_eq!(counter(&dec, "requests_incomplete"), 70);
}

#[test]
fn decoder_debug_output_shows_no_buffered_payload() {
    let k = key(94);
    let mut dec = decoder();
    run(&mut dec, &[accept(k, 1), io(k, IN, 2, b"POST / HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 99\r\n\r\n{\"SECRET")]);
    run(
        &mut dec,
        &[io(key(95), IN, 3, b"GET /SECRET HTTP/1.1\r\nX-A: SECRET")],
    );
    assert!(dec.buffered_bytes() > 0);
    assert!(!format!("{dec:?}").contains("SECRET"));
}

/// Long randomized soak (run with `--ignored`): structured and random bytes,
/// random splits, gaps, opens, closes, tiny limits.
#[test]
#[ignore]
fn soak_random_traffic() {
    let (writes, _) = three_exchanges();
    let stream: Vec<(Dir, Vec<u8>)> = writes;
    for seed in 0..64u64 {
        let mut rng = Lcg(seed * 7919 + 1);
        let cfg = DecoderConfig {
            max_conns: 1 + rng.below(6),
            max_head_bytes: 64 + rng.below(4096),
            ..DecoderConfig::default()
        };
        let mut dec = WireDecoder::new(cfg);
        let mut out = Vec::new();
        for i in 0..20_000u64 {
            let k = key(rng.below(8) as i32);
            match rng.below(40) {
                0 => dec.on_event(&accept(k, i), &mut out),
                1 => dec.on_event(&close(k, i), &mut out),
                2..=20 => {
                    // A piece of real traffic, possibly mutated, split and truncated.
                    let (dir, b) = &stream[rng.below(stream.len())];
                    let mut b = b.clone();
                    if rng.below(3) == 0 && !b.is_empty() {
                        let p = rng.below(b.len());
                        b[p] = rng.next() as u8;
                    }
                    let start = rng.below(b.len());
                    let end = (start + 1 + rng.below(b.len())).min(b.len());
                    let piece = &b[start..end];
                    let cap = if rng.below(4) == 0 {
                        rng.below(piece.len() + 1)
                    } else {
                        piece.len()
                    };
                    dec.on_event(
                        &io_cap(k, *dir, i, &piece[..cap], piece.len() as u64),
                        &mut out,
                    );
                }
                _ => {
                    let n = rng.below(64);
                    let data: Vec<u8> = (0..n)
                        .map(|_| b"0123456789abcdefHTTP/1.1 \r\n:data{}[]\"GETPOST"[rng.below(44)])
                        .collect();
                    let gap = if rng.below(8) == 0 { rng.next() } else { 0 };
                    let dir = if rng.below(2) == 0 { IN } else { OUT };
                    dec.on_event(
                        &io_cap(k, dir, i, &data, (data.len() as u64).saturating_add(gap)),
                        &mut out,
                    );
                }
            }
            out.clear();
        }
        dec.finish(&mut out);
        assert_eq!(counter(&dec, "internal_stall"), 0, "seed {seed}");
    }
}

#[test]
fn a_writes_records_are_stamped_at_its_wire_departure_when_the_call_saw_one() {
    let k = key(62);
    let (mut evs, _) = deliver(k, &chat_exchange("chatcmpl-w", &["Hi", "there"]), Mode::AsIs, 0);
    // Each write entered 500 ns before its exit. Its departure, after entry:
    // the head's 100 ns, the role chunk's unseen, the first content chunk's an
    // impossible stamp after the exit (kept at the exit), then the others'.
    let departs = [Some(100), None, Some(10_000), Some(50), Some(20), Some(30), Some(40), Some(10)];
    let mut outs = 0;
    let mut want = Vec::new();
    for ev in &mut evs {
        let KEvent::Io(io) = ev else { continue };
        io.enter_ns = io.ts_ns - 500;
        if io.dir == IN {
            io.wire_ns = Some(io.enter_ns);
            continue;
        }
        io.wire_ns = departs[outs].map(|d| io.enter_ns + d);
        want.push(match departs[outs] {
            Some(d) if d <= 500 => io.enter_ns + d,
            _ => io.ts_ns,
        });
        outs += 1;
    }
    assert_eq!(outs, departs.len(), "head, role, 2 content, finish, usage, [DONE], terminator");
    let mut dec = decoder();
    let out = run(&mut dec, &evs);
    let got: Vec<u64> = out
        .iter()
        .filter_map(|r| match r {
            Record::HttpResponse { ts_ns, .. } | Record::Sse { ts_ns, .. } | Record::HttpResponseEnd { ts_ns, .. } => Some(*ts_ns),
            _ => None,
        })
        .collect();
    assert_eq!(got, want);
    assert_eq!(counter(&dec, "writes_timed_at_exit"), 2, "the role chunk's and the first content chunk's");
    // A read's stamp stays its exit: its wire arrival travels beside it.
    match &out[0] {
        Record::HttpRequest { start_ns, ready_ns, .. } => assert_eq!((*start_ns, *ready_ns), (1_000, Some(500))),
        r => panic!("{r:?}"),
    }
}

#[test]
fn request_carries_the_wire_arrival_of_the_read_that_delivered_its_first_byte() {
    let k = key(61);
    let mut dec = decoder();
    let mut out = Vec::new();
    let head = b"GET /health HTTP/1.1\r\nHost: x\r\n";
    let mut first = io_cap(k, IN, 1_000, head, head.len() as u64);
    if let KEvent::Io(io) = &mut first {
        io.wire_ns = Some(400);
    }
    dec.on_event(&first, &mut out);
    // The second read has its own (later) arrival: the request keeps the first's.
    let mut second = io_cap(k, IN, 2_000, b"\r\n", 2);
    if let KEvent::Io(io) = &mut second {
        io.wire_ns = Some(1_900);
    }
    dec.on_event(&second, &mut out);
    let got: Vec<_> = out
        .iter()
        .filter_map(|r| match r {
            Record::HttpRequest { start_ns, end_ns, ready_ns, .. } => Some((*start_ns, *end_ns, *ready_ns)),
            _ => None,
        })
        .collect();
    assert_eq!(got, vec![(1_000, 2_000, Some(400))]);
}
