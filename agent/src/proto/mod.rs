//! Wire decoders: socket bytes (kernel [`KEvent`]s) → payload-free [`Record`]s.
//!
//! [`WireDecoder`] follows every traced TCP connection as two byte streams (In
//! and Out, seen from the traced process) and decodes HTTP/1.1 on them: requests
//! with keep-alive and pipelining, responses paired FIFO with their requests,
//! chunked / Content-Length / close-delimited bodies, OpenAI SSE streams and
//! non-streaming JSON bodies. The traced process may be the server (requests
//! arrive In) or a client (requests go Out) of a connection; the first start line
//! decides. Unix-domain sockets are reported as [`Record::UnixIo`] (one per
//! syscall, kept for IPC timing) and followed as ZMTP: vLLM V1 engine IPC
//! becomes `EngineRequest` / `EngineAbort` / `EngineOutputs` (`proto/vllm.rs`).
//!
//! Timing: a request starts at the syscall that delivered its first byte (its
//! `tid` is that syscall's thread) and ends at the one that completed head +
//! body; every response record (head, each SSE event, end) is timed by the
//! syscall that carried its last byte. A close-delimited body ends at the
//! syscall that carried its last byte, reported when the close (or `finish`)
//! shows it was the last. Interim 1xx responses (except 101) emit nothing. A
//! request is pushed for pairing when its head is complete, so a server answering
//! early may produce `HttpResponse` before that request's `HttpRequest`.
//!
//! Privacy: only allow-listed headers (never cookies or authorization), the path
//! without its query string or fragment (they may carry keys), `stream`/`model`
//! from request bodies, and ids, sizes, finish reasons and token counts from
//! responses leave the decoder.
//! Prompt and completion text never do, except as [`Record::RawIo`] when
//! `capture_payload` is set.
//!
//! Loss: the probe captures a prefix of each syscall's bytes; the rest is a gap
//! of known size. Gaps in bodies of known framing are skipped by count; gaps in
//! heads desync one stream, which resynchronises at a later syscall boundary when
//! that is unambiguous (the exact rules are in `proto/conn.rs`, SSE events hit by
//! gaps in `proto/sse.rs`). Memory is bounded: `max_conns` connections (least
//! recently used evicted), heads up to `max_head_bytes`, SSE events and JSON
//! bodies up to 1 MiB each, all JSON captures together up to 64 MiB.
//! The decoder never panics on any input. Every loss is counted in
//! [`WireDecoder::counters`].

mod chunked;
mod conn;
mod http;
mod json_ends;
mod openai;
mod sse;
#[cfg(test)]
mod tests;
// --- ZMTP / vLLM engine IPC on unix sockets (proto/zmtp.rs, msgpack.rs, vllm.rs) ---
pub mod msgpack;
mod vllm;
pub mod zmtp;
// --- end ZMTP / vLLM ---

use std::collections::{BTreeMap, HashMap};

use crate::event::{Burst, ConnKey, Dir, Family, KEvent};
use crate::model::Record;
use conn::{Budget, Conn, Ctx};

/// `-EINPROGRESS`: a non-blocking connect that is going ahead.
const EINPROGRESS: i64 = 115;

/// Settings of a [`WireDecoder`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecoderConfig {
    /// Header that carries a chain key (kept on requests); matched case-insensitively.
    pub chain_header: String,
    /// Also emit [`Record::RawIo`] (the captured bytes) for every I/O event.
    pub capture_payload: bool,
    /// Most connections tracked at once; the least recently used is evicted.
    pub max_conns: usize,
    /// Largest HTTP head buffered; a larger one gives up its connection.
    pub max_head_bytes: usize,
}

impl Default for DecoderConfig {
    fn default() -> Self {
        DecoderConfig {
            chain_header: "x-session-id".to_string(),
            capture_payload: false,
            max_conns: 65536,
            max_head_bytes: 64 * 1024,
        }
    }
}

macro_rules! counters {
    ($($(#[doc = $doc:literal])* $name:ident,)*) => {
        /// User-side loss and anomaly counters.
        #[derive(Debug, Default, Clone, PartialEq, Eq)]
        pub(crate) struct Counters {
            $($(#[doc = $doc])* pub $name: u64,)*
        }

        impl Counters {
            pub fn list(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name)),*]
            }
        }
    };
}

counters! {
    /// Bytes not decoded: desynced or given-up streams, failed heads, gaps in heads.
    unparsed_bytes,
    /// A stream lost sync (gap or invalid bytes where a head should be).
    desync,
    /// A desynced stream (or lost chunk framing) picked up again at a syscall boundary.
    resyncs,
    /// Resync candidates refused because pairing would be ambiguous (connection given up).
    resync_unsafe,
    /// Uncaptured bytes where an HTTP head was.
    gap_bytes_in_head,
    /// Uncaptured body bytes skipped by count (framing kept).
    gap_bytes_in_body,
    /// Connections starting with the HTTP/2 preface.
    http2_preface,
    /// Connections starting with a TLS record.
    tls,
    /// Connections (seen from accept/connect) whose first bytes are not HTTP/1.x.
    not_http,
    /// Streams of connections opened before we attached that began mid-message.
    attach_mid_stream,
    /// Reads and writes on sockets of other families than unix and IP
    /// (netlink: the interface lists a server reads as it starts): not decoded.
    io_other_family,
    /// Heads larger than `max_head_bytes` (connection given up).
    head_too_large,
    /// Heads httparse rejected, or messages in the wrong direction.
    head_invalid,
    /// Connections given up (one `Unparsed` record each).
    conns_unparsed,
    /// Connections evicted because `max_conns` were tracked.
    conns_evicted,
    /// Requests whose head or body was not complete at close/eviction/finish.
    requests_incomplete,
    /// Responses whose body was not complete (or whose end was lost).
    responses_incomplete,
    /// Requests that never got a response head before close/eviction/finish.
    responses_missing,
    /// Responses (or requests awaiting their head) cut short by the
    /// connection's close: the client left, or the server dropped it. Not a
    /// loss: the correlator reports such a request as closed early.
    responses_closed_early,
    /// Response heads lost in a gap or unreadable.
    responses_lost,
    /// Responses to requests we could not read (parsed for framing only).
    responses_unmatched,
    /// More than 1024 pipelined requests outstanding (connection given up).
    pending_overflow,
    /// `101 Switching Protocols` or CONNECT tunnels (connection no longer HTTP).
    upgrades,
    /// Chunk sizes that do not fit in 64 bits.
    chunk_size_overflow,
    /// Other invalid chunked framing.
    chunk_invalid,
    /// Chunk framing lost because a chunk-size line fell into a gap.
    chunk_framing_lost,
    /// SSE events whose data is not valid JSON (and not `[DONE]`).
    sse_json_invalid,
    /// SSE events partly lost in a gap, emitted with kind `Other`.
    sse_events_truncated,
    /// SSE events partly lost in a gap whose kind (and usage) their last
    /// bytes told: Responses API events, told by their `type`.
    sse_events_from_ends,
    /// Gaps after which an unknown number (possibly zero) of SSE events was lost.
    sse_events_lost_in_gap,
    /// SSE events over 1 MiB (content dropped, emitted as `Other`).
    sse_event_too_large,
    /// SSE bodies that ended inside an event.
    sse_events_unterminated,
    /// Non-streaming JSON response bodies that did not parse.
    json_body_invalid,
    /// JSON bodies over 1 MiB: read for metadata from their ends only.
    json_body_too_large,
    /// JSON bodies (requests, non-streaming responses) not captured whole (a
    /// syscall longer than its capture, or over 1 MiB): their metadata read
    /// from their first bytes and their last ones.
    json_body_ends,
    /// Of those, bodies whose main field was in neither end: a request's
    /// `model`, a response's `usage` (a larger `--capture-tail-bytes` keeps more).
    json_meta_lost,
    /// JSON bodies not read because all captures together held 64 MiB.
    capture_budget_exceeded,
    /// Captured request bodies that were not a JSON object.
    request_json_invalid,
    /// Bodies with a content-encoding (compressed), not read for metadata.
    body_encoded,
    /// Internal guard: the decoder stopped making progress (a bug; connection given up).
    internal_stall,
    /// Writes on IP sockets whose bytes the kernel did not see leave inside
    /// the call (congestion window, pacing, no `net:net_dev_queue`): their
    /// records are timed at the call's exit instead of the wire departure.
    writes_timed_at_exit,
    /// Unix-socket writes whose thread was switched in after a sleep whose
    /// wake-up was not seen: their hand-over is timed without it (coarser).
    write_wakeups_unseen,
    /// Unix-socket writes whose wake-up and switch-in stamps were out of
    /// order (woken after the switch-in, or switched in after the write):
    /// dropped, not trusted.
    write_wakeups_implausible,
}

/// Decodes socket events into records. Feed events in timestamp order.
pub struct WireDecoder {
    cfg: DecoderConfig,
    chain: String,
    conns: HashMap<ConnKey, Conn>,
    /// LRU order: tick of last use → connection.
    lru: BTreeMap<u64, ConnKey>,
    tick: u64,
    c: Counters,
    budget: Budget,
    /// ZMTP / vLLM engine IPC on unix sockets (proto/vllm.rs).
    ipc: vllm::IpcDecoder,
}

/// Shows sizes and counters only: the buffers may hold payload bytes.
impl std::fmt::Debug for WireDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WireDecoder")
            .field("cfg", &self.cfg)
            .field("conns", &self.conns.len())
            .field("buffered_bytes", &self.buffered_bytes())
            .field("counters", &self.c)
            .finish()
    }
}

impl WireDecoder {
    pub fn new(cfg: DecoderConfig) -> Self {
        let chain = cfg.chain_header.trim().to_ascii_lowercase();
        WireDecoder {
            cfg,
            chain,
            conns: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            c: Counters::default(),
            budget: Budget::default(),
            ipc: vllm::IpcDecoder::default(),
        }
    }

    /// Decodes one kernel event, appending what it produced to `out`.
    pub fn on_event(&mut self, ev: &KEvent, out: &mut Vec<Record>) {
        match ev {
            KEvent::Io(io) => {
                if self.cfg.capture_payload {
                    out.push(Record::RawIo {
                        conn: io.conn,
                        ts_ns: io.ts_ns,
                        enter_ns: io.enter_ns,
                        tid: io.tid,
                        syscall: io.syscall,
                        dir: io.dir,
                        family: io.family,
                        len: io.len,
                        data: io.data.clone(),
                    });
                }
                if io.family == Family::Unix {
                    if io.dir == Dir::Out {
                        match io.burst {
                            Burst::Woken { wake_ns, on_ns } => out.push(Record::WokenWrite {
                                ts_ns: io.ts_ns,
                                tgid: io.conn.tgid,
                                tid: io.tid,
                                wake_ns,
                                on_ns,
                            }),
                            Burst::WakeUnseen => self.c.write_wakeups_unseen += 1,
                            Burst::Implausible => self.c.write_wakeups_implausible += 1,
                            Burst::NoSleep => {}
                        }
                    }
                    out.push(Record::UnixIo {
                        conn: io.conn,
                        ts_ns: io.ts_ns,
                        enter_ns: io.enter_ns,
                        tid: io.tid,
                        dir: io.dir,
                        len: io.len,
                    });
                    // --- ZMTP / vLLM engine IPC: EngineRequest/EngineAbort/EngineOutputs ---
                    self.ipc.on_io(io, out);
                    return;
                }
                if io.family == Family::Unknown {
                    // No HTTP runs there; fed to the HTTP decoder, a netlink
                    // dump read mid-stream was counted as unparsed bytes.
                    self.c.io_other_family += 1;
                    return;
                }
                if io.len == 0 {
                    return;
                }
                self.touch(io.conn, false);
                if let Some(conn) = self.conns.get_mut(&io.conn) {
                    let mut ctx = Ctx {
                        cfg: &self.cfg,
                        chain: &self.chain,
                        c: &mut self.c,
                        budget: &self.budget,
                    };
                    conn.on_io(&mut ctx, io, out);
                }
            }
            KEvent::Conn(ce) => {
                if ce.ret < 0 && ce.ret != -EINPROGRESS {
                    return;
                }
                out.push(Record::ConnOpen {
                    ts_ns: ce.ts_ns,
                    conn: ce.conn,
                    op: ce.op,
                    family: ce.family,
                    local: ce.local.map(|a| a.to_string()),
                    peer: ce.peer.map(|a| a.to_string()),
                });
                // --- ZMTP / vLLM: a new connection under this key starts fresh streams ---
                self.ipc.forget(ce.conn);
                if ce.family != Family::Unix {
                    // A new connection under a key we still track: the old one ended
                    // without us seeing its close.
                    self.forget(ce.conn);
                    self.touch(ce.conn, true);
                }
            }
            KEvent::Close(cl) => {
                // --- ZMTP / vLLM: the connection's streams end ---
                self.ipc.forget(cl.conn);
                if let Some(mut conn) = self.conns.remove(&cl.conn) {
                    self.lru.remove(&conn.tick);
                    let mut ctx = Ctx {
                        cfg: &self.cfg,
                        chain: &self.chain,
                        c: &mut self.c,
                        budget: &self.budget,
                    };
                    conn.flush(&mut ctx, Some(out), true);
                }
                out.push(Record::ConnClose {
                    ts_ns: cl.ts_ns,
                    conn: cl.conn,
                });
            }
            KEvent::Proc(_) | KEvent::Sched(_) => {}
        }
    }

    /// End of the recording: ends close-delimited bodies, counts what is incomplete.
    pub fn finish(&mut self, out: &mut Vec<Record>) {
        let mut keys: Vec<ConnKey> = self.conns.keys().copied().collect();
        keys.sort_unstable();
        for k in keys {
            if let Some(mut conn) = self.conns.remove(&k) {
                let mut ctx = Ctx {
                    cfg: &self.cfg,
                    chain: &self.chain,
                    c: &mut self.c,
                    budget: &self.budget,
                };
                conn.flush(&mut ctx, Some(out), false);
            }
        }
        self.lru.clear();
        // --- ZMTP / vLLM ---
        self.ipc.finish();
    }

    /// Loss and anomaly counters (cumulative), with stable snake_case names.
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        let mut v = self.c.list();
        // --- ZMTP / vLLM: unix_*, zmtp_*, ipc_* ---
        v.extend(self.ipc.counters());
        v
    }

    /// Connections tracked now.
    pub fn tracked_conns(&self) -> usize {
        self.conns.len()
    }

    /// Bytes held in per-connection buffers (heads, SSE events, JSON bodies).
    pub fn buffered_bytes(&self) -> usize {
        self.conns.values().map(Conn::buffered).sum::<usize>() + self.ipc.buffered()
    }

    /// Drops a tracked connection silently, counting what it left unfinished.
    fn forget(&mut self, key: ConnKey) {
        if let Some(mut conn) = self.conns.remove(&key) {
            self.lru.remove(&conn.tick);
            let mut ctx = Ctx {
                cfg: &self.cfg,
                chain: &self.chain,
                c: &mut self.c,
                budget: &self.budget,
            };
            conn.flush(&mut ctx, None, false);
        }
    }

    /// The connection for `key`, created if needed (evicting the least recently
    /// used one at the limit), marked as most recently used.
    fn touch(&mut self, key: ConnKey, opened: bool) {
        self.tick += 1;
        let tick = self.tick;
        match self.conns.get(&key) {
            Some(conn) => {
                self.lru.remove(&conn.tick);
            }
            None => {
                while self.conns.len() >= self.cfg.max_conns.max(1) {
                    let Some((_, old)) = self.lru.pop_first() else {
                        break;
                    };
                    self.forget(old);
                    self.c.conns_evicted += 1;
                }
            }
        }
        self.lru.insert(tick, key);
        self.conns
            .entry(key)
            .or_insert_with(|| Conn::new(key, opened))
            .tick = tick;
    }
}
