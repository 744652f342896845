//! Live path from kernel events to the recording: a small reorder window (the
//! ring buffer is shared by all CPUs, so neighbours can arrive a few µs out of
//! order), the wire decoders, and the recording writer.

use crate::event::KEvent;
use crate::model::Record;
use crate::proto::{DecoderConfig, WireDecoder};
use crate::recording::{RecordingError, Writer};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io::Write;

/// Events are held this long (by their own timestamps) before release, so that
/// the decoders see each connection's syscalls in order.
pub const REORDER_WINDOW_NS: u64 = 20_000_000;

struct Held {
    ts: u64,
    seq: u64,
    ev: KEvent,
}

impl PartialEq for Held {
    fn eq(&self, o: &Self) -> bool {
        (self.ts, self.seq) == (o.ts, o.seq)
    }
}
impl Eq for Held {}
impl PartialOrd for Held {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Held {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.ts, self.seq).cmp(&(o.ts, o.seq))
    }
}

/// Counters the pipeline itself keeps (loss is data).
#[derive(Debug, Default, Clone, Copy)]
pub struct PipelineStats {
    pub events: u64,
    /// Events older than what was already released: processed anyway, counted.
    pub events_late: u64,
    /// Ring-buffer samples that failed validation.
    pub events_invalid: u64,
    pub records: u64,
    pub http_requests: u64,
}

pub struct Pipeline<W: Write> {
    heap: BinaryHeap<Reverse<Held>>,
    seq: u64,
    max_ts: u64,
    released_ts: u64,
    decoder: WireDecoder,
    writer: Writer<W>,
    out: Vec<Record>,
    stats: PipelineStats,
}

impl<W: Write> Pipeline<W> {
    pub fn new(decoder_cfg: DecoderConfig, writer: Writer<W>) -> Self {
        Pipeline {
            heap: BinaryHeap::new(),
            seq: 0,
            max_ts: 0,
            released_ts: 0,
            decoder: WireDecoder::new(decoder_cfg),
            writer,
            out: Vec::new(),
            stats: PipelineStats::default(),
        }
    }

    pub fn stats(&self) -> PipelineStats {
        self.stats
    }

    pub fn note_invalid(&mut self) {
        self.stats.events_invalid += 1;
    }

    /// Takes one validated event; releases what has left the reorder window.
    pub fn push(&mut self, ev: KEvent) -> Result<(), RecordingError> {
        self.stats.events += 1;
        let ts = ev.ts_ns();
        if ts < self.released_ts {
            self.stats.events_late += 1;
        }
        self.max_ts = self.max_ts.max(ts);
        self.seq += 1;
        self.heap.push(Reverse(Held { ts, seq: self.seq, ev }));
        self.release(self.max_ts.saturating_sub(REORDER_WINDOW_NS))
    }

    /// Releases every held event with a timestamp at or before `until_ns`.
    fn release(&mut self, until_ns: u64) -> Result<(), RecordingError> {
        while let Some(Reverse(h)) = self.heap.peek() {
            if h.ts > until_ns {
                break;
            }
            let Some(Reverse(h)) = self.heap.pop() else { break };
            self.released_ts = self.released_ts.max(h.ts);
            self.process(h.ev)?;
        }
        Ok(())
    }

    fn process(&mut self, ev: KEvent) -> Result<(), RecordingError> {
        match &ev {
            KEvent::Proc(p) => self.out.push(Record::Proc {
                ts_ns: p.ts_ns,
                tgid: p.tgid,
                op: p.op,
                child_tgid: p.child_tgid,
                exit_code: p.exit_code,
                comm: p.comm.clone(),
            }),
            KEvent::Sched(s) => self.out.push(Record::OffCpu {
                ts_ns: s.ts_ns,
                tgid: s.tgid,
                tid: s.tid,
                off_ns: s.off_ns,
                wake_ns: s.wake_ns,
                prev_state: s.prev_state,
            }),
            KEvent::Io(_) | KEvent::Conn(_) | KEvent::Close(_) => self.decoder.on_event(&ev, &mut self.out),
        }
        self.flush_out()
    }

    fn flush_out(&mut self) -> Result<(), RecordingError> {
        for r in self.out.drain(..) {
            if matches!(r, Record::HttpRequest { .. }) {
                self.stats.http_requests += 1;
            }
            self.stats.records += 1;
            self.writer.push(&r)?;
        }
        Ok(())
    }

    /// Periodic work at `now_ns` (CLOCK_MONOTONIC): releases events that are
    /// older than the window even if no newer event arrived, writes a drop
    /// snapshot, seals the block so a kill loses at most about a second.
    pub fn tick(&mut self, now_ns: u64, kernel: &[(String, u64)]) -> Result<(), RecordingError> {
        let until = now_ns.saturating_sub(REORDER_WINDOW_NS);
        self.release(until)?;
        // Stamped at the release horizon, not `now`: every event still held is
        // newer, so the file stays in timestamp order.
        let drops = self.drop_counters(kernel);
        self.writer.push(&Record::Drops { ts_ns: until.max(self.released_ts), counters: drops })?;
        self.writer.tick(now_ns)
    }

    /// All loss counters: the kernel's (passed in), the decoders', the pipeline's.
    pub fn drop_counters(&self, kernel: &[(String, u64)]) -> Vec<(String, u64)> {
        let mut v: Vec<(String, u64)> = kernel.to_vec();
        v.extend(self.decoder.counters().into_iter().map(|(k, n)| (k.to_owned(), n)));
        v.push(("events_late".into(), self.stats.events_late));
        v.push(("events_invalid".into(), self.stats.events_invalid));
        v
    }

    /// Drains everything, writes the final drop snapshot and seals the file.
    pub fn finish(mut self, now_ns: u64, kernel: &[(String, u64)]) -> Result<(W, PipelineStats), RecordingError> {
        self.release(u64::MAX)?;
        self.decoder.finish(&mut self.out);
        self.flush_out()?;
        let drops = self.drop_counters(kernel);
        self.writer.push(&Record::Drops { ts_ns: now_ns.max(self.released_ts), counters: drops })?;
        let stats = self.stats;
        Ok((self.writer.finish(now_ns)?, stats))
    }
}
