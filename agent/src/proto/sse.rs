//! Server-sent events over a (de-chunked) response body, with capture gaps.
//!
//! Lines end with CRLF, LF or a lone CR (a CR ends the line at once and a LF
//! right after it is swallowed). `data:` lines are joined with `\n`; comments,
//! `event:`, `id:`, `retry:` and unknown fields are tolerated and ignored. An
//! event is dispatched at the empty line that ends it, timed by the syscall that
//! carried that line's terminator — the event's last byte for CRLF/LF framing.
//! Events without a `data` line (e.g. `: ping` comments) produce nothing.
//!
//! Gaps (bytes moved but not captured) are handled as follows:
//! - The event in progress is *tainted*: its content is unknown. We keep the id
//!   if the captured prefix already held `{"id":"…"`, and stop buffering.
//! - The line in progress continues into unknown bytes, so the first line end
//!   after the gap only realigns the parser; the next empty line ends the
//!   tainted event, which is emitted as [`SseKind::Other`](crate::model::SseKind)
//!   (counted in `sse_events_truncated`).
//! - With chunked framing intact (the chunk-size line was captured), the end of
//!   the chunk that held the gap also ends the tainted event: servers write one
//!   chunk per event (uvicorn/Starlette: one `transport.write` per body message),
//!   so the event is emitted at that syscall, exactly once. A server that puts
//!   several events in one chunk would have those behind the gap merged into one.
//! - Without chunk framing (Content-Length or close-delimited SSE) a gap may hide
//!   any number of whole events: each such gap adds 1 to `sse_events_lost_in_gap`
//!   ("an unknown number, possibly zero, was lost here"). The same counter takes 1
//!   when the chunk framing itself is lost and later picked up again.

use super::openai::{self, ChunkInfo};
use super::Counters;

/// Most bytes one event may buffer (data + current line).
pub(crate) const MAX_EVENT_BYTES: usize = 1 << 20;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SseOut {
    Event {
        ts: u64,
        info: ChunkInfo,
    },
    /// An event over [`MAX_EVENT_BYTES`] ended: content dropped.
    TooLarge {
        ts: u64,
        bytes: u64,
    },
}

#[derive(Debug, Default)]
pub(crate) struct SseParser {
    line: Vec<u8>,
    line_nonempty: bool,
    data: Vec<u8>,
    has_data: bool,
    /// The previous line ended with CR: swallow one LF.
    skip_lf: bool,
    overflow: bool,
    event_bytes: u64,
    tainted: bool,
    /// The current line's beginning was lost in a gap.
    line_unknown: bool,
    partial: openai::PartialHead,
    /// The last bytes of that line (at most [`TAIL_KEEP`]): a cut event's
    /// data ends there ([`openai::classify_tail`]).
    tail: Vec<u8>,
}

/// Most bytes of a cut event's last line kept: the TCP capture's largest tail.
const TAIL_KEEP: usize = 16 * 1024;

fn split_field(line: &[u8]) -> (&[u8], &[u8]) {
    match line.iter().position(|&b| b == b':') {
        Some(i) => {
            let v = &line[i + 1..];
            (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
        }
        None => (line, &[]),
    }
}

impl SseParser {
    /// Bytes buffered (for memory accounting).
    pub fn buffered(&self) -> usize {
        self.line.capacity() + self.data.capacity() + self.tail.capacity()
    }

    pub fn feed(&mut self, mut bytes: &[u8], ts: u64, c: &mut Counters, out: &mut Vec<SseOut>) {
        while let Some((&first, rest)) = bytes.split_first() {
            if self.skip_lf {
                self.skip_lf = false;
                if first == b'\n' {
                    bytes = rest;
                    continue;
                }
            }
            match bytes.iter().position(|&b| b == b'\n' || b == b'\r') {
                None => {
                    self.push_line(bytes);
                    break;
                }
                Some(i) => {
                    self.push_line(&bytes[..i]);
                    self.event_bytes = self.event_bytes.saturating_add(1);
                    self.skip_lf = bytes[i] == b'\r';
                    bytes = &bytes[i + 1..];
                    self.end_line(ts, c, out);
                }
            }
        }
    }

    fn push_line(&mut self, part: &[u8]) {
        if part.is_empty() {
            return;
        }
        self.line_nonempty = true;
        self.event_bytes = self.event_bytes.saturating_add(part.len() as u64);
        if self.line_unknown && self.tainted {
            let keep = part.len().min(TAIL_KEEP);
            let over = (self.tail.len() + keep).saturating_sub(TAIL_KEEP);
            self.tail.drain(..over);
            self.tail.extend_from_slice(&part[part.len() - keep..]);
            return;
        }
        if self.line_unknown || self.tainted || self.overflow {
            return;
        }
        if self
            .line
            .len()
            .saturating_add(part.len())
            .saturating_add(self.data.len())
            > MAX_EVENT_BYTES
        {
            self.set_overflow();
            return;
        }
        self.line.extend_from_slice(part);
    }

    fn set_overflow(&mut self) {
        self.overflow = true;
        self.has_data = true;
        self.line = Vec::new();
        self.data = Vec::new();
    }

    fn end_line(&mut self, ts: u64, c: &mut Counters, out: &mut Vec<SseOut>) {
        if self.line_unknown {
            self.line_unknown = false;
        } else if !self.line_nonempty {
            self.dispatch(ts, c, out);
        } else if !self.tainted && !self.overflow {
            let line = std::mem::take(&mut self.line);
            let (field, value) = split_field(&line);
            if field == b"data" {
                if self
                    .data
                    .len()
                    .saturating_add(value.len())
                    .saturating_add(1)
                    > MAX_EVENT_BYTES
                {
                    self.set_overflow();
                } else {
                    self.data.extend_from_slice(value);
                    self.data.push(b'\n');
                    self.has_data = true;
                }
            }
            if !self.overflow {
                self.line = line;
            }
        }
        self.line.clear();
        self.line_nonempty = false;
    }

    fn dispatch(&mut self, ts: u64, c: &mut Counters, out: &mut Vec<SseOut>) {
        if self.tainted {
            let head = std::mem::take(&mut self.partial);
            let id = head.id.clone();
            let info = match openai::classify_tail(&self.tail, head) {
                Some(info) => {
                    c.sse_events_from_ends += 1;
                    info
                }
                None => {
                    c.sse_events_truncated += 1;
                    ChunkInfo::other(id)
                }
            };
            out.push(SseOut::Event { ts, info });
        } else if self.overflow {
            c.sse_event_too_large += 1;
            out.push(SseOut::TooLarge {
                ts,
                bytes: self.event_bytes,
            });
        } else if self.has_data {
            if self.data.last() == Some(&b'\n') {
                self.data.pop();
            }
            let (info, invalid) = openai::classify_sse(&self.data);
            if invalid {
                c.sse_json_invalid += 1;
            }
            out.push(SseOut::Event { ts, info });
        }
        self.reset_event();
    }

    fn reset_event(&mut self) {
        if self.data.capacity() > 64 * 1024 {
            self.data = Vec::new();
        } else {
            self.data.clear();
        }
        if self.line.capacity() > 64 * 1024 {
            self.line = Vec::new();
        } else {
            self.line.clear();
        }
        self.line_nonempty = false;
        self.has_data = false;
        self.overflow = false;
        self.tainted = false;
        self.line_unknown = false;
        self.partial = openai::PartialHead::default();
        self.event_bytes = 0;
        if self.tail.capacity() > TAIL_KEEP * 2 {
            self.tail = Vec::new();
        } else {
            self.tail.clear();
        }
    }

    /// Uncaptured body bytes at this point. `framed`: chunk framing is intact,
    /// so the end of the current chunk will be known.
    pub fn gap(&mut self, framed: bool, c: &mut Counters) {
        if !self.tainted {
            let src: &[u8] = if !self.data.is_empty() {
                &self.data
            } else {
                match split_field(&self.line) {
                    (b"data", v) => v,
                    _ => &[],
                }
            };
            self.partial = openai::partial_head(src);
        }
        let head = std::mem::take(&mut self.partial);
        self.reset_event();
        self.partial = head;
        self.tainted = true;
        self.line_unknown = true;
        self.skip_lf = false;
        if !framed {
            c.sse_events_lost_in_gap += 1;
        }
    }

    /// A chunk's data ended (chunked framing): ends a tainted event.
    pub fn chunk_end(&mut self, ts: u64, c: &mut Counters, out: &mut Vec<SseOut>) {
        if self.tainted {
            self.dispatch(ts, c, out);
            self.skip_lf = false;
        }
    }

    /// The chunk framing was lost: an unknown amount of body follows.
    pub fn framing_lost(&mut self, c: &mut Counters) {
        self.gap(true, c);
    }

    /// The chunk framing was picked up again at a new chunk: whatever ended in
    /// between is unknown.
    pub fn framing_resumed(&mut self, c: &mut Counters) {
        if self.tainted {
            c.sse_events_lost_in_gap += 1;
        }
        self.reset_event();
        self.skip_lf = false;
    }

    /// The body ended. `clean`: its end is known (not a lost framing), so a
    /// tainted event ended with it at `ts`.
    pub fn finish(&mut self, ts: u64, clean: bool, c: &mut Counters, out: &mut Vec<SseOut>) {
        if self.tainted {
            if clean {
                self.dispatch(ts, c, out);
            } else {
                c.sse_events_lost_in_gap += 1;
            }
        } else if self.has_data || self.overflow || self.line_nonempty {
            c.sse_events_unterminated += 1;
        }
        self.reset_event();
        self.skip_lf = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::SseKind;

    fn feed_all(p: &mut SseParser, parts: &[&[u8]], c: &mut Counters) -> Vec<SseOut> {
        let mut out = Vec::new();
        for (i, part) in parts.iter().enumerate() {
            p.feed(part, i as u64, c, &mut out);
        }
        out
    }

    fn kinds(out: &[SseOut]) -> Vec<(u64, SseKind)> {
        out.iter()
            .map(|o| match o {
                SseOut::Event { ts, info } => (*ts, info.kind),
                SseOut::TooLarge { ts, .. } => (*ts, SseKind::Other),
            })
            .collect()
    }

    #[test]
    fn events_end_at_blank_line_with_lf_crlf_or_cr() {
        let mut c = Counters::default();
        let mut p = SseParser::default();
        let out = feed_all(
            &mut p,
            &[
                b"data: [DONE]\n",
                b"\n",
                b": ping\r\n\r\nevent: x\r\nid: 1\r\ndata: [DO",
                b"NE]\r\n\r\n",
                b"data: [DONE]\r\r",
            ],
            &mut c,
        );
        assert_eq!(
            kinds(&out),
            [(1, SseKind::Done), (3, SseKind::Done), (4, SseKind::Done)]
        );
    }

    #[test]
    fn multi_line_data_is_joined_with_newline() {
        let mut c = Counters::default();
        let mut p = SseParser::default();
        let out = feed_all(&mut p, &[b"data: {\"id\":\ndata: \"a\"}\n\n"], &mut c);
        match &out[..] {
            [SseOut::Event { info, .. }] => assert_eq!(info.id.as_deref(), Some("a")),
            o => panic!("{o:?}"),
        }
    }

    #[test]
    fn tainted_event_ends_at_next_blank_line_and_keeps_id() {
        let mut c = Counters::default();
        let mut p = SseParser::default();
        let mut out = Vec::new();
        p.feed(b"data: {\"id\":\"chatcmpl-7\",\"choi", 1, &mut c, &mut out);
        p.gap(false, &mut c);
        p.feed(b"}]}\n\ndata: [DONE]\n\n", 2, &mut c, &mut out);
        assert_eq!(kinds(&out), [(2, SseKind::Other), (2, SseKind::Done)]);
        match &out[0] {
            SseOut::Event { info, .. } => assert_eq!(info.id.as_deref(), Some("chatcmpl-7")),
            o => panic!("{o:?}"),
        }
        assert_eq!((c.sse_events_truncated, c.sse_events_lost_in_gap), (1, 1));
    }

    #[test]
    fn chunk_end_ends_a_tainted_event() {
        let mut c = Counters::default();
        let mut p = SseParser::default();
        let mut out = Vec::new();
        p.feed(b"data: {\"id\":\"x\"", 1, &mut c, &mut out);
        p.gap(true, &mut c);
        p.chunk_end(1, &mut c, &mut out);
        p.feed(b"data: [DONE]\n\n", 2, &mut c, &mut out);
        assert_eq!(kinds(&out), [(1, SseKind::Other), (2, SseKind::Done)]);
        assert_eq!(c.sse_events_lost_in_gap, 0);
    }

    #[test]
    fn oversized_event_is_dropped_but_reported() {
        let mut c = Counters::default();
        let mut p = SseParser::default();
        let mut out = Vec::new();
        let big = vec![b'a'; 64 * 1024];
        p.feed(b"data: ", 0, &mut c, &mut out);
        for _ in 0..20 {
            p.feed(&big, 1, &mut c, &mut out);
            assert!(p.buffered() <= 2 * MAX_EVENT_BYTES);
        }
        p.feed(b"\n\ndata: [DONE]\n\n", 2, &mut c, &mut out);
        assert!(matches!(out[0], SseOut::TooLarge { ts: 2, .. }));
        assert_eq!(kinds(&out)[1], (2, SseKind::Done));
        assert_eq!(c.sse_event_too_large, 1);
    }
}
