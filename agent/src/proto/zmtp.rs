//! ZMTP 3.x stream decoder for one direction of one connection.
//!
//! Fed with what the probe saw of each syscall — a captured prefix plus a gap
//! of known size — it follows the byte stream (RFC 23/37): the 64-byte greeting
//! (parsed as a stream: libzmq sends 10 + 1 + 53 bytes), commands (`READY` with
//! its properties: `Socket-Type`, `Identity`), and frames (short/long, MORE)
//! assembled into multipart [`Message`]s.
//!
//! Loss:
//! * A gap inside a frame body is skipped by count; the frame keeps its full
//!   `len` and the contiguous `captured` prefix (bytes after the first gap in a
//!   frame are not kept: the prefix is what msgpack can read).
//! * A gap over a frame header (or invalid flags) loses the framing: the partial
//!   message is dropped and the stream waits for a **safe** resync at a later
//!   syscall boundary: a syscall whose captured bytes parse as frames with no
//!   commands, whose every message the caller's `plausible` check accepts (the
//!   vLLM decoder: a known message shape, on the captured prefix), and which
//!   either ends exactly at a message boundary with nothing uncaptured, or ends
//!   inside a message whose captured start is itself plausible, with any gap
//!   inside the frame being read (libzmq starts a large message at a fresh
//!   write). After [`MAX_RESYNC_TRIES`] refused candidates the stream is given up.
//! * A stream that does not start with a greeting (not ZMTP, or we attached
//!   mid-stream) is tried the same way for [`MAX_ATTACH_TRIES`] syscalls.
//!
//! Bounds: a frame keeps at most `max_frame_capture` bytes of its start, and as
//! many of its end as its `tail` when the body is longer or a gap cut it (vLLM's
//! ADD has its fields after the prompt ids there), a message at most
//! `max_frames` frames with bytes (later frames keep only their length). The
//! default frame capture is what the probe can have of a frame's start: libzmq
//! sends a message that starts its 8 KiB batch write with the rest in one
//! write, and the probe keeps 32 KiB of each unix-socket syscall, so an engine
//! output message of a large batch keeps every output the probe saw. The
//! tail keeps 4 KiB (the ADD's fields after its prompt ids are well under
//! that). The decoder never panics and allocates O(limits).

/// Refused resync candidates before a desynced stream is given up.
pub const MAX_RESYNC_TRIES: u32 = 256;
/// Syscalls tried on a stream that did not start with a greeting.
pub const MAX_ATTACH_TRIES: u32 = 16;

/// Per-stream bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes kept per frame (the rest is counted in `len`).
    pub max_frame_capture: usize,
    /// Bytes kept of a frame's end when it was not kept whole ([`Frame::tail`]).
    pub max_tail_capture: usize,
    /// Frames per message that keep their bytes.
    pub max_frames: usize,
}

/// The probe's default unix-socket capture per syscall.
const UNIX_CAPTURE_DEFAULT: usize = hopscope_ebpf::layout::HS_CAPTURE_UNIX_DEFAULT as usize;
/// libzmq's batch: queued messages leave in writes of up to 8 KiB, and a
/// message too large for the batch's rest leaves in one write after it.
pub const ZMQ_BATCH: usize = 8192;
/// The default frame capture: the most of a frame's start the probe can
/// have with no gap, the batch write it starts in and the one write after
/// it (one capture). Kept shorter, a large step's engine output message
/// would drop outputs the probe paid to capture.
pub const FRAME_CAPTURE_DEFAULT: usize = ZMQ_BATCH + UNIX_CAPTURE_DEFAULT;

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_frame_capture: FRAME_CAPTURE_DEFAULT,
            max_tail_capture: 4096,
            max_frames: 8,
        }
    }
}

/// One frame of a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// The contiguous captured prefix of the body (bounded).
    pub captured: Vec<u8>,
    /// Full body size from the frame header.
    pub len: u64,
    /// When the body was not kept whole (a gap cut it, or it is longer than
    /// `max_frame_capture`): the last captured bytes, if they run to the
    /// frame's end with no gap after them (at most `max_tail_capture`).
    pub tail: Option<Tail>,
}

/// Captured bytes at the end of a frame that was not kept whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tail {
    /// Offset of `bytes[0]` in the frame body.
    pub offset: u64,
    pub bytes: Vec<u8>,
}

impl Frame {
    pub fn is_complete(&self) -> bool {
        self.captured.len() as u64 == self.len
    }
}

/// A complete multipart message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The first `max_frames` frames.
    pub frames: Vec<Frame>,
    /// Frames in the message (may exceed `frames.len()`).
    pub num_frames: u32,
    /// Exit time of the syscall that carried the message's last byte.
    pub ts_ns: u64,
    /// Thread of that syscall.
    pub tid: u32,
    /// Exit time of the syscall that carried the message's first byte:
    /// `ts_ns` unless the message spanned syscalls (libzmq writes one
    /// longer than its 8 KiB batch in several).
    pub first_ns: u64,
}

/// Greeting facts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Greeting {
    pub major: u8,
    pub minor: u8,
    /// Mechanism name, NUL padding removed (`NULL`, `PLAIN`, `CURVE`).
    pub mechanism: String,
    pub as_server: bool,
}

/// Counters kept by the stream decoders (summed by the caller).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Stats {
    /// Streams whose first bytes were not a ZMTP greeting (and not adopted
    /// mid-stream since).
    pub not_zmtp: u64,
    /// Greetings parsed.
    pub greetings: u64,
    /// ZMTP < 3 or a mechanism whose traffic is not plain frames (CURVE, GSSAPI).
    pub unsupported: u64,
    /// Framing lost: gap over a frame header, or invalid frame flags/sizes.
    pub desync: u64,
    /// Framing picked up again at a syscall boundary.
    pub resyncs: u64,
    /// Streams without a greeting adopted as ZMTP (attached mid-stream).
    pub attach_mid_stream: u64,
    /// Streams given up (no safe resync).
    pub given_up: u64,
    /// Frames with part of the body uncaptured (skipped by count).
    pub gap_frames: u64,
    /// Body bytes skipped by count.
    pub gap_bytes: u64,
    /// Messages lost: one per desync (at least one is), plus partial messages
    /// at the stream's end.
    pub messages_lost: u64,
    /// Frames past `max_frames` whose bytes were not kept.
    pub frames_dropped: u64,
    /// Commands seen (READY and others).
    pub commands: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Nothing seen yet.
    Start,
    Greeting {
        n: u8,
    },
    /// At (n == 0) or inside a frame header.
    Header {
        n: u8,
    },
    Body {
        remaining: u64,
    },
    /// Framing lost: waiting for a safe resync at a syscall start.
    Lost {
        tries: u32,
        attach: bool,
    },
    /// Given up.
    Dead,
}

/// Decoder for one direction of one ZMTP connection.
#[derive(Debug, Clone)]
pub struct Stream {
    lim: Limits,
    state: State,
    greet: [u8; 64],
    hdr: [u8; 9],
    /// Flags of the frame being read.
    flags: u8,
    /// The frame being read: captured prefix, full length, whether a gap cut it.
    cur: Vec<u8>,
    cur_len: u64,
    cur_cut: bool,
    /// Bytes of the frame being read captured after its last gap.
    seg: Option<Tail>,
    /// Frames of the message being assembled.
    frames: Vec<Frame>,
    num_frames: u32,
    /// The syscall that carried its first byte ([`Message::first_ns`]).
    first_ns: u64,
    greeting: Option<Greeting>,
    socket_type: Option<String>,
    identity: Option<Vec<u8>>,
}

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_CMD: u8 = 0x04;

impl Stream {
    pub fn new(lim: Limits) -> Self {
        Stream {
            lim,
            state: State::Start,
            greet: [0; 64],
            hdr: [0; 9],
            flags: 0,
            cur: Vec::new(),
            cur_len: 0,
            cur_cut: false,
            seg: None,
            frames: Vec::new(),
            num_frames: 0,
            first_ns: 0,
            greeting: None,
            socket_type: None,
            identity: None,
        }
    }

    /// A decoder positioned at a frame boundary (after the handshake).
    pub(crate) fn at_boundary(lim: Limits) -> Self {
        let mut s = Stream::new(lim);
        s.state = State::Header { n: 0 };
        s
    }

    /// The greeting, once seen.
    pub fn greeting(&self) -> Option<&Greeting> {
        self.greeting.as_ref()
    }

    /// `Socket-Type` from the sender's READY (the peer that writes this stream).
    pub fn socket_type(&self) -> Option<&str> {
        self.socket_type.as_deref()
    }

    /// `Identity` from the sender's READY (empty for a ROUTER).
    pub fn identity(&self) -> Option<&[u8]> {
        self.identity.as_deref()
    }

    /// The stream was given up (not ZMTP, unsupported, or no safe resync).
    pub fn is_dead(&self) -> bool {
        self.state == State::Dead
    }

    /// Framing is currently lost (waiting for a resync).
    pub fn is_lost(&self) -> bool {
        matches!(self.state, State::Lost { .. })
    }

    /// Bytes held (the partial frame and message).
    pub fn buffered(&self) -> usize {
        self.cur.len() + self.frames.iter().map(|f| f.captured.len()).sum::<usize>()
    }

    /// Feeds one syscall: its captured prefix `data`, then `gap` uncaptured bytes.
    /// Complete messages are appended to `out`.
    #[allow(clippy::too_many_arguments)]
    pub fn feed(
        &mut self,
        data: &[u8],
        gap: u64,
        ts_ns: u64,
        tid: u32,
        plausible: &dyn Fn(&Message) -> bool,
        st: &mut Stats,
        out: &mut Vec<Message>,
    ) {
        if data.is_empty() && gap == 0 {
            return;
        }
        match self.state {
            State::Dead => return,
            State::Start => {
                if data.first() == Some(&0xff) {
                    self.state = State::Greeting { n: 0 };
                } else {
                    st.not_zmtp += 1;
                    self.state = State::Lost {
                        tries: 0,
                        attach: true,
                    };
                }
            }
            _ => {}
        }
        if let State::Lost { tries, attach } = self.state {
            self.try_resync(data, gap, ts_ns, tid, plausible, st, out, tries, attach);
            return;
        }
        self.run(data, ts_ns, tid, st, out);
        if gap > 0 {
            self.skip_gap(gap, ts_ns, tid, st, out);
        }
    }

    /// End of the stream (close or end of recording): a partial message is lost.
    pub fn finish(&mut self, st: &mut Stats) {
        let partial = match self.state {
            State::Header { n } => n > 0 || !self.frames.is_empty(),
            State::Body { .. } => true,
            _ => false,
        };
        if partial {
            st.messages_lost += 1;
        }
        self.frames.clear();
        self.cur.clear();
        self.seg = None;
        self.num_frames = 0;
    }

    #[allow(clippy::too_many_arguments)]
    fn try_resync(
        &mut self,
        data: &[u8],
        gap: u64,
        ts_ns: u64,
        tid: u32,
        plausible: &dyn Fn(&Message) -> bool,
        st: &mut Stats,
        out: &mut Vec<Message>,
        tries: u32,
        attach: bool,
    ) {
        let mut got = Vec::new();
        let mut adopt = None;
        if !data.is_empty() {
            let mut probe = Stream::at_boundary(self.lim);
            let mut pst = Stats::default();
            probe.run(data, ts_ns, tid, &mut pst, &mut got);
            let clean = pst.commands == 0 && pst.desync == 0 && got.iter().all(plausible);
            let ok = clean
                && match probe.state {
                    // Whole messages, ending exactly at the syscall's end.
                    State::Header { n: 0 } if probe.frames.is_empty() => {
                        gap == 0 && !got.is_empty()
                    }
                    // A message still going on (a large one: libzmq starts it at a
                    // fresh write, the rest follows): its captured start must
                    // already look like a known message, and the gap must not
                    // run past the frame being read.
                    State::Header { n: 0 } => gap == 0 && plausible(&probe.partial()),
                    State::Body { remaining } => gap <= remaining && plausible(&probe.partial()),
                    _ => false,
                };
            if ok {
                adopt = Some(probe);
            }
        }
        if let Some(probe) = adopt {
            if attach {
                // Counted as not ZMTP when it began without a greeting: it is.
                st.not_zmtp = st.not_zmtp.saturating_sub(1);
                st.attach_mid_stream += 1;
            } else {
                st.resyncs += 1;
            }
            self.state = probe.state;
            self.hdr = probe.hdr;
            self.flags = probe.flags;
            self.cur = probe.cur;
            self.cur_len = probe.cur_len;
            self.cur_cut = probe.cur_cut;
            self.seg = probe.seg;
            self.frames = probe.frames;
            self.num_frames = probe.num_frames;
            self.first_ns = probe.first_ns;
            out.append(&mut got);
            if gap > 0 {
                self.skip_gap(gap, ts_ns, tid, st, out);
            }
            return;
        }
        let tries = tries.saturating_add(1);
        let limit = if attach {
            MAX_ATTACH_TRIES
        } else {
            MAX_RESYNC_TRIES
        };
        if tries >= limit {
            if !attach {
                st.given_up += 1;
            }
            self.state = State::Dead;
        } else {
            self.state = State::Lost { tries, attach };
        }
    }

    /// The message being assembled as far as it went (the frame being read
    /// included, with its `len` from the header): for plausibility checks.
    fn partial(&self) -> Message {
        let mut frames = self.frames.clone();
        let mut num_frames = self.num_frames;
        if let State::Body { .. } = self.state {
            if self.flags & FLAG_CMD == 0 && frames.len() < self.lim.max_frames {
                frames.push(Frame {
                    captured: self.cur.clone(),
                    len: self.cur_len,
                    tail: None,
                });
                num_frames = num_frames.saturating_add(1);
            }
        }
        Message {
            frames,
            num_frames,
            ts_ns: 0,
            tid: 0,
            first_ns: self.first_ns,
        }
    }

    /// Loses framing: drops the partial message, waits for a resync.
    fn lose(&mut self, st: &mut Stats) {
        st.desync += 1;
        // At least one message (the partial one, or the one whose header was
        // not captured) is lost; how many more is unknown.
        st.messages_lost += 1;
        self.frames.clear();
        self.cur.clear();
        self.seg = None;
        self.num_frames = 0;
        self.state = State::Lost {
            tries: 0,
            attach: false,
        };
    }

    fn give_up(&mut self) {
        self.frames.clear();
        self.cur.clear();
        self.seg = None;
        self.num_frames = 0;
        self.state = State::Dead;
    }

    fn skip_gap(
        &mut self,
        mut gap: u64,
        ts_ns: u64,
        tid: u32,
        st: &mut Stats,
        out: &mut Vec<Message>,
    ) {
        if let State::Body { remaining } = self.state {
            let skip = remaining.min(gap);
            if !self.cur_cut {
                self.cur_cut = true;
                st.gap_frames += 1;
            }
            // Bytes captured before this gap no longer reach the frame's end.
            self.seg = None;
            st.gap_bytes = st.gap_bytes.saturating_add(skip);
            gap -= skip;
            let remaining = remaining - skip;
            self.state = State::Body { remaining };
            if remaining == 0 {
                self.end_frame(ts_ns, tid, st, out);
            }
        }
        if gap == 0 {
            return;
        }
        match self.state {
            State::Greeting { .. } => {
                st.desync += 1;
                self.give_up();
            }
            State::Header { .. } => self.lose(st),
            _ => {}
        }
    }

    /// Consumes captured bytes.
    fn run(&mut self, data: &[u8], ts_ns: u64, tid: u32, st: &mut Stats, out: &mut Vec<Message>) {
        let mut i = 0usize;
        while i < data.len() {
            match self.state {
                State::Start | State::Lost { .. } | State::Dead => return,
                State::Greeting { n } => {
                    let n = n as usize;
                    let take = (64 - n).min(data.len() - i);
                    self.greet[n..n + take].copy_from_slice(&data[i..i + take]);
                    i += take;
                    let n2 = n + take;
                    self.state = State::Greeting { n: n2 as u8 };
                    // Signature: FF, 8 padding bytes, 7F (bit 0 set); then major >= 3.
                    if n2 >= 10 && (self.greet[0] != 0xff || self.greet[9] & 0x01 == 0) {
                        st.not_zmtp += 1;
                        self.give_up();
                        return;
                    }
                    if n2 >= 11 && self.greet[10] < 3 {
                        st.unsupported += 1;
                        self.give_up();
                        return;
                    }
                    if n2 == 64 {
                        let mech: Vec<u8> = self.greet[12..32]
                            .iter()
                            .copied()
                            .take_while(|&b| b != 0)
                            .collect();
                        let mechanism = String::from_utf8_lossy(&mech).into_owned();
                        st.greetings += 1;
                        if mechanism != "NULL" && mechanism != "PLAIN" {
                            st.unsupported += 1;
                            self.give_up();
                            return;
                        }
                        self.greeting = Some(Greeting {
                            major: self.greet[10],
                            minor: self.greet[11],
                            mechanism,
                            as_server: self.greet[32] != 0,
                        });
                        self.state = State::Header { n: 0 };
                    }
                }
                State::Header { n } => {
                    let n = n as usize;
                    if n == 0 {
                        if self.num_frames == 0 {
                            self.first_ns = ts_ns;
                        }
                        let f = data[i];
                        // Reserved bits must be zero; a command is never multipart.
                        if f & !0x07 != 0 || (f & FLAG_CMD != 0 && f & FLAG_MORE != 0) {
                            self.lose(st);
                            return;
                        }
                        self.flags = f;
                    }
                    let need = if self.flags & FLAG_LONG != 0 { 9 } else { 2 };
                    let take = (need - n).min(data.len() - i);
                    self.hdr[n..n + take].copy_from_slice(&data[i..i + take]);
                    i += take;
                    let n2 = n + take;
                    if n2 < need {
                        self.state = State::Header { n: n2 as u8 };
                        continue;
                    }
                    let size = if need == 9 {
                        let mut b = [0u8; 8];
                        b.copy_from_slice(&self.hdr[1..9]);
                        u64::from_be_bytes(b)
                    } else {
                        self.hdr[1] as u64
                    };
                    if size > i64::MAX as u64 {
                        // libzmq refuses sizes with the top bit set.
                        self.lose(st);
                        return;
                    }
                    self.cur.clear();
                    self.cur_len = size;
                    self.cur_cut = false;
                    self.seg = None;
                    self.state = State::Body { remaining: size };
                    if size == 0 {
                        self.end_frame(ts_ns, tid, st, out);
                    }
                }
                State::Body { remaining } => {
                    let avail = (data.len() - i) as u64;
                    let take = remaining.min(avail) as usize;
                    let keep = if self.cur_cut || !self.keeps_bytes() {
                        0
                    } else {
                        take.min(self.lim.max_frame_capture.saturating_sub(self.cur.len()))
                    };
                    self.cur.extend_from_slice(&data[i..i + keep]);
                    if keep < take && self.keeps_bytes() {
                        // Past the kept prefix (after a gap, or a body longer than
                        // `max_frame_capture`): keep the last `max_tail_capture`
                        // bytes. Without a gap they start with the prefix's own
                        // end, so fields that straddle the prefix's cut are whole.
                        let offset = self.cur_len - remaining + keep as u64;
                        let cur = &self.cur;
                        let cut = self.cur_cut;
                        let max_tail = self.lim.max_tail_capture;
                        let seg = self.seg.get_or_insert_with(|| {
                            if cut {
                                Tail {
                                    offset,
                                    bytes: Vec::new(),
                                }
                            } else {
                                let end = &cur[cur.len().saturating_sub(max_tail)..];
                                Tail {
                                    offset: offset - end.len() as u64,
                                    bytes: end.to_vec(),
                                }
                            }
                        });
                        seg.bytes.extend_from_slice(&data[i + keep..i + take]);
                        let excess = seg.bytes.len().saturating_sub(max_tail);
                        if excess > 0 {
                            seg.bytes.drain(..excess);
                            seg.offset += excess as u64;
                        }
                    }
                    i += take;
                    let remaining = remaining - take as u64;
                    self.state = State::Body { remaining };
                    if remaining == 0 {
                        self.end_frame(ts_ns, tid, st, out);
                    }
                }
            }
        }
    }

    /// Whether the frame being read keeps its bytes (commands always do, bounded).
    fn keeps_bytes(&self) -> bool {
        self.flags & FLAG_CMD != 0 || self.frames.len() < self.lim.max_frames
    }

    fn end_frame(&mut self, ts_ns: u64, tid: u32, st: &mut Stats, out: &mut Vec<Message>) {
        self.state = State::Header { n: 0 };
        let body = std::mem::take(&mut self.cur);
        if self.flags & FLAG_CMD != 0 {
            st.commands += 1;
            self.command(&body);
            return;
        }
        self.num_frames = self.num_frames.saturating_add(1);
        if self.frames.len() < self.lim.max_frames {
            let tail = self.seg.take();
            self.frames.push(Frame {
                captured: body,
                len: self.cur_len,
                tail,
            });
        } else {
            st.frames_dropped += 1;
        }
        if self.flags & FLAG_MORE == 0 {
            out.push(Message {
                frames: std::mem::take(&mut self.frames),
                num_frames: std::mem::replace(&mut self.num_frames, 0),
                ts_ns,
                tid,
                first_ns: self.first_ns,
            });
        }
    }

    /// Reads a command body (as far as captured): READY properties.
    fn command(&mut self, body: &[u8]) {
        let Some((&nlen, rest)) = body.split_first() else {
            return;
        };
        let Some(name) = rest.get(..nlen as usize) else {
            return;
        };
        if name != b"READY" {
            return;
        }
        let mut p = &rest[nlen as usize..];
        // Properties: 1-byte name length, name, 4-byte BE value length, value.
        loop {
            let Some((&kl, r)) = p.split_first() else {
                return;
            };
            let Some(key) = r.get(..kl as usize) else {
                return;
            };
            let r = &r[kl as usize..];
            let Some(vl) = r.get(..4) else {
                return;
            };
            let vl = u32::from_be_bytes([vl[0], vl[1], vl[2], vl[3]]) as usize;
            let Some(val) = r.get(4..4usize.saturating_add(vl)) else {
                return;
            };
            if key.eq_ignore_ascii_case(b"Socket-Type") {
                self.socket_type =
                    Some(String::from_utf8_lossy(&val[..val.len().min(64)]).into_owned());
            } else if key.eq_ignore_ascii_case(b"Identity") {
                self.identity = Some(val[..val.len().min(255)].to_vec());
            }
            p = &r[4 + vl..];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn any(_: &Message) -> bool {
        true
    }

    /// A libzmq-like greeting (padding = identity length + 1, not all zero).
    fn greeting() -> Vec<u8> {
        let mut g = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 0x03, 0x7f, 3, 1];
        let mut mech = b"NULL".to_vec();
        mech.resize(20, 0);
        g.extend_from_slice(&mech);
        g.push(0);
        g.extend_from_slice(&[0; 31]);
        assert_eq!(g.len(), 64);
        g
    }

    fn ready(props: &[(&str, &[u8])]) -> Vec<u8> {
        let mut body = vec![5];
        body.extend_from_slice(b"READY");
        for (k, v) in props {
            body.push(k.len() as u8);
            body.extend_from_slice(k.as_bytes());
            body.extend_from_slice(&(v.len() as u32).to_be_bytes());
            body.extend_from_slice(v);
        }
        let mut f = vec![0x04, body.len() as u8];
        f.extend_from_slice(&body);
        f
    }

    fn frame(body: &[u8], more: bool) -> Vec<u8> {
        let mut f = Vec::new();
        if body.len() < 256 {
            f.push(more as u8);
            f.push(body.len() as u8);
        } else {
            f.push(0x02 | more as u8);
            f.extend_from_slice(&(body.len() as u64).to_be_bytes());
        }
        f.extend_from_slice(body);
        f
    }

    fn feed_all(s: &mut Stream, chunks: &[(&[u8], u64)], st: &mut Stats) -> Vec<Message> {
        let mut out = Vec::new();
        for (i, (d, g)) in chunks.iter().enumerate() {
            s.feed(d, *g, 100 + i as u64, 7, &any, st, &mut out);
        }
        out
    }

    #[test]
    fn greeting_ready_and_multipart_parse_in_any_split() {
        let mut wire = greeting();
        wire.extend(ready(&[("Socket-Type", b"DEALER"), ("Identity", &[0, 0])]));
        wire.extend(frame(&[0x00], true));
        wire.extend(frame(&[0xaa; 300], false));
        wire.extend(frame(b"", false));
        for step in [1usize, 2, 3, 10, 11, 53, 64, wire.len()] {
            let mut s = Stream::new(Limits::default());
            let mut st = Stats::default();
            let chunks: Vec<(&[u8], u64)> = wire.chunks(step).map(|c| (c, 0)).collect();
            let out = feed_all(&mut s, &chunks, &mut st);
            assert_eq!(out.len(), 2, "step {step}");
            assert_eq!(out[0].frames.len(), 2);
            assert_eq!(out[0].frames[0].captured, [0x00]);
            assert_eq!(out[0].frames[1].len, 300);
            assert!(out[0].frames[1].is_complete());
            assert_eq!(
                out[1].frames,
                [Frame {
                    captured: vec![],
                    len: 0,
                    tail: None
                }]
            );
            assert_eq!(s.socket_type(), Some("DEALER"));
            assert_eq!(s.identity(), Some(&[0u8, 0][..]));
            let g = s.greeting().unwrap();
            assert_eq!(
                (g.major, g.minor, g.mechanism.as_str(), g.as_server),
                (3, 1, "NULL", false)
            );
            assert_eq!(st.greetings, 1);
            assert_eq!(st.commands, 1);
            assert_eq!(st.desync, 0);
        }
    }

    #[test]
    fn message_is_timed_by_the_syscall_carrying_its_last_byte() {
        let mut wire = greeting();
        wire.extend(ready(&[("Socket-Type", b"PUSH")]));
        let head = wire.len();
        wire.extend(frame(&[1, 2, 3, 4], false));
        let mut s = Stream::new(Limits::default());
        let mut st = Stats::default();
        let mut out = Vec::new();
        s.feed(&wire[..head + 3], 0, 10, 1, &any, &mut st, &mut out);
        assert!(out.is_empty());
        s.feed(&wire[head + 3..], 0, 20, 2, &any, &mut st, &mut out);
        assert_eq!((out[0].ts_ns, out[0].tid), (20, 2));
    }

    /// libzmq writes a message longer than its 8 KiB batch in several
    /// syscalls: the message says where it began as well as where it ended.
    /// Its multipart frames, the message before it in the same write and a
    /// resync do not move that start.
    #[test]
    fn message_knows_the_syscall_that_carried_its_first_byte() {
        let mut wire = greeting();
        wire.extend(ready(&[("Socket-Type", b"DEALER"), ("Identity", b"")]));
        let head = wire.len();
        wire.extend(frame(&[0x00], true));
        wire.extend(frame(b"small", false));
        let second = wire.len();
        wire.extend(frame(&[0x00], true));
        wire.extend(frame(&[7u8; 12_000], false));
        let mut s = Stream::new(Limits::default());
        let mut st = Stats::default();
        let mut out = Vec::new();
        s.feed(&wire[..head], 0, 5, 1, &any, &mut st, &mut out);
        // One batch: the small message whole and the long one's start; then the rest.
        s.feed(&wire[head..second + 100], 0, 10, 1, &any, &mut st, &mut out);
        s.feed(&wire[second + 100..], 0, 20, 1, &any, &mut st, &mut out);
        let at: Vec<_> = out.iter().map(|m| (m.first_ns, m.ts_ns, m.num_frames)).collect();
        assert_eq!(at, [(10, 10, 2), (10, 20, 2)]);
        // Attached mid-stream: the long message starts at the syscall it was adopted at.
        let mut s = Stream::at_boundary(Limits::default());
        s.state = State::Lost { tries: 0, attach: true };
        let mut out = Vec::new();
        s.feed(&wire[second..second + 100], 0, 30, 1, &any, &mut st, &mut out);
        s.feed(&wire[second + 100..], 0, 40, 1, &any, &mut st, &mut out);
        assert_eq!(out.iter().map(|m| (m.first_ns, m.ts_ns)).collect::<Vec<_>>(), [(30, 40)]);
    }

    #[test]
    fn gap_inside_a_body_is_skipped_by_count() {
        let mut wire = greeting();
        wire.extend(ready(&[("Socket-Type", b"ROUTER"), ("Identity", b"")]));
        wire.extend(frame(&[0x00], true));
        let body: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let start = wire.len();
        wire.extend(frame(&body, false));
        wire.extend(frame(b"next", false));
        // One 4 KiB-captured syscall for the big frame, then a normal one.
        let big_end = start + 9 + body.len();
        let mut s = Stream::new(Limits::default());
        let mut st = Stats::default();
        let cap_end = start + 4096;
        let gap = (big_end - cap_end) as u64;
        let out = feed_all(
            &mut s,
            &[(&wire[..cap_end], gap), (&wire[big_end..], 0)],
            &mut st,
        );
        assert_eq!(out.len(), 2);
        let f = &out[0].frames[1];
        assert_eq!(f.len, 10_000);
        assert_eq!(f.captured, body[..4096 - 9]);
        assert!(!f.is_complete());
        assert_eq!(
            out[0].ts_ns, 100,
            "last byte was in the first syscall's gap"
        );
        assert_eq!(out[1].frames[0].captured, b"next");
        assert_eq!((st.gap_frames, st.gap_bytes, st.desync), (1, gap, 0));
    }

    #[test]
    fn bytes_after_a_gap_inside_the_same_frame_are_not_appended() {
        let mut wire = greeting();
        wire.extend(ready(&[("Socket-Type", b"PUSH")]));
        let start = wire.len();
        wire.extend(frame(&[7u8; 1000], false));
        let mut s = Stream::new(Limits::default());
        let mut st = Stats::default();
        let a = start + 9 + 100;
        let out = feed_all(&mut s, &[(&wire[..a], 100), (&wire[a + 100..], 0)], &mut st);
        assert_eq!(out[0].frames[0].captured.len(), 100);
        assert_eq!(out[0].frames[0].len, 1000);
        // They are kept as the frame's tail (they reach its end).
        let t = out[0].frames[0].tail.as_ref().unwrap();
        assert_eq!((t.offset, t.bytes.len()), (200, 800));
        // A gap after them drops the tail; a long tail keeps its last bytes.
        let mut s = Stream::new(Limits {
            max_frame_capture: 300,
            max_tail_capture: 300,
            max_frames: 8,
        });
        let out = feed_all(
            &mut s,
            &[
                (&wire[..a], 100),
                (&wire[a + 100..a + 200], 50),
                (&wire[a + 250..], 0),
            ],
            &mut st,
        );
        let t = out[0].frames[0].tail.as_ref().unwrap();
        assert_eq!((t.offset, t.bytes.len()), (700, 300));
        assert_eq!(t.bytes, [7u8; 300]);
    }

    #[test]
    fn a_body_longer_than_the_kept_prefix_keeps_its_last_bytes_as_the_tail() {
        let body: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
        let lim = Limits {
            max_frame_capture: 300,
            max_tail_capture: 300,
            max_frames: 8,
        };
        let wire = [frame(&body, false), frame(b"next", false)].concat();
        // Captured whole, in one syscall or split anywhere.
        for split in [wire.len(), 9, 250, 700, 1005] {
            let mut s = Stream::at_boundary(lim);
            let mut st = Stats::default();
            let out = feed_all(&mut s, &[(&wire[..split], 0), (&wire[split..], 0)], &mut st);
            assert_eq!(out.len(), 2, "split {split}");
            let f = &out[0].frames[0];
            assert_eq!((f.captured.as_slice(), f.len), (&body[..300], 1000));
            // The last 300 bytes, not only those past the prefix.
            let t = f.tail.as_ref().unwrap();
            assert_eq!((t.offset, t.bytes.as_slice()), (700, &body[700..]), "split {split}");
            assert_eq!((st.gap_frames, st.desync), (0, 0));
        }
        // A body just over the prefix: the tail overlaps it.
        let wire = frame(&body[..400], false);
        let mut s = Stream::at_boundary(lim);
        let mut st = Stats::default();
        let out = feed_all(&mut s, &[(&wire, 0)], &mut st);
        let t = out[0].frames[0].tail.as_ref().unwrap();
        assert_eq!((t.offset, t.bytes.as_slice()), (100, &body[100..400]));
        // A body that fits has none.
        let out = feed_all(&mut Stream::at_boundary(lim), &[(&frame(&body[..300], false), 0)], &mut st);
        assert_eq!(out[0].frames[0].tail, None);
        // A tail bound under the prefix (the default: 4 KiB of a 40 KiB
        // prefix): the last bytes only, whichever write they came in.
        let short = Limits { max_tail_capture: 100, ..lim };
        let wire = [frame(&body, false), frame(b"next", false)].concat();
        for split in [wire.len(), 9, 250, 700, 950, 1005] {
            let out = feed_all(&mut Stream::at_boundary(short), &[(&wire[..split], 0), (&wire[split..], 0)], &mut st);
            let f = &out[0].frames[0];
            assert_eq!(f.captured.as_slice(), &body[..300]);
            let t = f.tail.as_ref().unwrap();
            assert_eq!((t.offset, t.bytes.as_slice()), (900, &body[900..]), "split {split}");
        }
        let out = feed_all(&mut Stream::at_boundary(short), &[(&frame(&body[..400], false), 0)], &mut st);
        let t = out[0].frames[0].tail.as_ref().unwrap();
        assert_eq!((t.offset, t.bytes.as_slice()), (300, &body[300..400]));
    }

    #[test]
    fn gap_over_a_header_loses_framing_then_resyncs_on_a_whole_message_syscall() {
        let mut wire = greeting();
        wire.extend(ready(&[("Socket-Type", b"PUSH")]));
        let m1 = frame(b"first", false);
        let m2 = frame(b"second", false);
        let m3 = frame(b"third", false);
        let mut st = Stats::default();
        let mut s = Stream::new(Limits::default());
        let mut out = Vec::new();
        s.feed(&wire, 0, 1, 1, &any, &mut st, &mut out);
        // m1 fully + m2 header uncaptured.
        s.feed(&m1, m2.len() as u64, 2, 1, &any, &mut st, &mut out);
        assert!(s.is_lost());
        assert_eq!(st.desync, 1);
        // A syscall ending mid-message whose start is not plausible is refused;
        // then a whole one is accepted.
        let whole = |m: &Message| m.frames.iter().all(Frame::is_complete);
        s.feed(&m3[..3], 0, 3, 1, &whole, &mut st, &mut out);
        assert!(s.is_lost());
        s.feed(&m3, 0, 4, 1, &whole, &mut st, &mut out);
        assert!(!s.is_lost());
        let bodies: Vec<&[u8]> = out.iter().map(|m| &m.frames[0].captured[..]).collect();
        assert_eq!(bodies, [&b"first"[..], b"third"]);
        assert_eq!(st.resyncs, 1);
    }

    #[test]
    fn resync_adopts_a_large_message_starting_a_syscall_when_its_start_is_plausible() {
        let mut wire = greeting();
        wire.extend(ready(&[("Socket-Type", b"ROUTER")]));
        let mut st = Stats::default();
        let mut s = Stream::new(Limits::default());
        let mut out = Vec::new();
        s.feed(&wire, 0, 1, 1, &any, &mut st, &mut out);
        s.feed(&[], 3, 2, 1, &any, &mut st, &mut out);
        assert!(s.is_lost());
        // [type, 10 KB body] written as 8192 bytes (4096 captured) + the rest.
        let mut big = frame(&[0x00], true);
        big.extend(frame(&[0x5a; 10_000], false));
        let looks_like_add = |m: &Message| {
            m.frames.first().is_some_and(|f| f.captured == [0x00]) && m.frames.len() == 2
        };
        // The gap running past the frame being read is refused.
        s.feed(
            &big[..4096],
            20_000,
            3,
            1,
            &looks_like_add,
            &mut st,
            &mut out,
        );
        assert!(s.is_lost());
        s.feed(
            &big[..4096],
            8192 - 4096,
            4,
            1,
            &looks_like_add,
            &mut st,
            &mut out,
        );
        assert!(!s.is_lost());
        s.feed(&big[8192..], 0, 5, 1, &looks_like_add, &mut st, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(
            (
                out[0].ts_ns,
                out[0].frames[1].len,
                out[0].frames[1].captured.len()
            ),
            (5, 10_000, 4096 - 12)
        );
        assert_eq!((st.resyncs, st.gap_frames), (1, 1));
        // A plausible start is still refused when the syscall ends inside a header.
        let mut s = Stream::at_boundary(Limits::default());
        s.state = State::Lost {
            tries: 0,
            attach: false,
        };
        s.feed(&big[..7], 0, 6, 1, &any, &mut st, &mut out);
        assert!(s.is_lost());
    }

    #[test]
    fn resync_refuses_implausible_messages_and_gives_up_after_the_limit() {
        let mut wire = greeting();
        wire.extend(ready(&[("Socket-Type", b"PUSH")]));
        let mut st = Stats::default();
        let mut s = Stream::new(Limits::default());
        let mut out = Vec::new();
        s.feed(&wire, 0, 1, 1, &any, &mut st, &mut out);
        s.feed(&[], 5, 2, 1, &any, &mut st, &mut out);
        assert!(s.is_lost());
        let never = |_: &Message| false;
        for _ in 0..MAX_RESYNC_TRIES {
            s.feed(&frame(b"x", false), 0, 3, 1, &never, &mut st, &mut out);
        }
        assert!(s.is_dead());
        assert_eq!(st.given_up, 1);
        s.feed(&frame(b"x", false), 0, 3, 1, &any, &mut st, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn stream_without_greeting_is_not_zmtp_unless_a_syscall_proves_framing() {
        let mut st = Stats::default();
        let mut s = Stream::new(Limits::default());
        let mut out = Vec::new();
        s.feed(b"GET / HTTP/1.1\r\n\r\n", 0, 1, 1, &any, &mut st, &mut out);
        assert_eq!(st.not_zmtp, 1);
        for _ in 0..MAX_ATTACH_TRIES {
            s.feed(b"\x80\x04garbage", 0, 1, 1, &any, &mut st, &mut out);
        }
        assert!(s.is_dead());
        assert!(out.is_empty());
        // Attached mid-stream: the first syscall is whole messages.
        let mut s = Stream::new(Limits::default());
        let mut w = frame(&[0x00], true);
        w.extend(frame(b"payload", false));
        s.feed(&w, 0, 5, 1, &any, &mut st, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(
            (st.attach_mid_stream, st.not_zmtp),
            (1, 1),
            "adopted: no longer counted as not ZMTP"
        );
    }

    #[test]
    fn old_zmtp_and_curve_are_unsupported() {
        let mut st = Stats::default();
        let mut g = greeting();
        g[10] = 2;
        let mut s = Stream::new(Limits::default());
        feed_all(&mut s, &[(&g, 0)], &mut st);
        assert!(s.is_dead());
        let mut g = greeting();
        g[12..17].copy_from_slice(b"CURVE");
        let mut s = Stream::new(Limits::default());
        feed_all(&mut s, &[(&g, 0)], &mut st);
        assert!(s.is_dead());
        assert_eq!(st.unsupported, 2);
    }

    #[test]
    fn invalid_flags_lose_framing_and_frames_past_the_limit_keep_only_length() {
        let mut wire = greeting();
        wire.extend(ready(&[("Socket-Type", b"PUSH")]));
        for i in 0..12 {
            wire.extend(frame(&[i], i < 11));
        }
        wire.push(0x80);
        let mut st = Stats::default();
        let mut s = Stream::new(Limits::default());
        let out = feed_all(&mut s, &[(&wire, 0)], &mut st);
        assert_eq!(out[0].num_frames, 12);
        assert_eq!(out[0].frames.len(), 8);
        assert_eq!(st.frames_dropped, 4);
        assert_eq!(st.desync, 1);
        assert!(s.is_lost());
    }

    #[test]
    fn garbage_never_panics() {
        let mut x: u64 = 0x1234_5678_9abc_def1;
        for round in 0..3000 {
            let mut s = Stream::new(Limits {
                max_frame_capture: 64,
                max_tail_capture: 64,
                max_frames: 2,
            });
            let mut st = Stats::default();
            let mut out = Vec::new();
            let mut base = if round % 2 == 0 {
                greeting()
            } else {
                Vec::new()
            };
            for _ in 0..(x % 300) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                base.push(if x.is_multiple_of(3) {
                    (x >> 8) as u8 & 0x07
                } else {
                    (x >> 16) as u8
                });
            }
            for c in base.chunks(1 + (x % 17) as usize) {
                s.feed(c, (x >> 20) % 3, 1, 1, &any, &mut st, &mut out);
            }
            s.finish(&mut st);
        }
    }
}
