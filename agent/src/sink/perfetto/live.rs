//! `record --perfetto FILE`: the trace written while recording. The
//! record-driven tracks ([`super::raw`]: threads, GPU streams, engine steps,
//! server and loss counters) grow as the pipeline hands records out, in
//! timestamp order; the request-driven tracks (chains, requests, request
//! counters) are appended when the recording stops and the correlator is
//! done. Memory: the raw layout's per-track state and the writer's tables,
//! never the records. The file is flushed at every loss snapshot (once a
//! second while recording: the compressed batch so far is written as one
//! packet), so a killed recorder leaves a trace readable up to its last
//! second.
//!
//! Not in a live trace: flows from requests to steps and kernels (steps and
//! kernels are written before the requests they served are known);
//! `hopscope trace` on the recording draws them.

use super::raw::RawLayout;
use super::{end_of, groups, write_requests, Encoding, PerfettoError, TraceInput, TraceStats, TraceWriter};
use crate::correlate::Analysis;
use crate::model::Record;
use crate::recording::Meta;
use std::io::Write;

pub struct LiveTrace<W: Write> {
    w: TraceWriter<W>,
    raw: RawLayout,
    t0: u64,
    last_ts: u64,
}

impl<W: Write> LiveTrace<W> {
    /// Starts the trace at the recording's start and describes its root
    /// processes. Compressed: each flush writes the batch so far.
    pub fn new(out: W, meta: &Meta) -> Result<Self, PerfettoError> {
        Self::with_encoding(out, meta, Encoding::default())
    }

    /// [`new`](Self::new) with the given encoding.
    pub fn with_encoding(out: W, meta: &Meta, enc: Encoding) -> Result<Self, PerfettoError> {
        let t0 = meta.start_ns;
        let mut w = TraceWriter::with_encoding(out, t0, enc)?;
        let mut raw = RawLayout::new(t0, true);
        let m = raw.meta_track(&mut w);
        w.describe(m)?;
        for &pid in &meta.pids {
            let t = raw.process(&mut w, pid);
            w.describe(t)?;
        }
        w.flush()?;
        Ok(LiveTrace { w, raw, t0, last_ts: t0 })
    }

    /// Draws one record (in the pipeline's output order).
    pub fn push(&mut self, rec: &Record) -> Result<(), PerfettoError> {
        self.last_ts = self.last_ts.max(rec.ts_ns());
        if let Record::Proc { op: crate::event::ProcOp::Exec, child_tgid, .. } = rec {
            // Named from its exec: shown even if it never does anything traced.
            self.raw.names.note(rec);
            let t = self.raw.process(&mut self.w, *child_tgid);
            self.w.describe(t)?;
        }
        self.raw.push(&mut self.w, rec, None)?;
        if matches!(rec, Record::Drops { .. }) {
            self.w.flush()?;
        }
        Ok(())
    }

    /// Appends the request-driven part from the finished analysis and closes
    /// the trace.
    pub fn finish(mut self, meta: &Meta, analysis: &Analysis, read_error: Option<&str>) -> Result<(W, TraceStats), PerfettoError> {
        let mut stats = TraceStats::default();
        let t_end = end_of(analysis, self.t0, self.last_ts);
        for r in &analysis.requests {
            if r.conn.tgid != 0 {
                let t = self.raw.process(&mut self.w, r.conn.tgid);
                self.w.describe(t)?;
            }
        }
        let g = groups(&mut self.w)?;
        let input = TraceInput { meta, records: &[], analysis, read_error };
        write_requests(&mut self.w, &mut self.raw, &g, input, None, self.t0, t_end, &mut stats)?;
        stats.processes = self.w.processes() as u64;
        let (out, ws) = self.w.finish()?;
        stats.writer = ws;
        Ok((out, stats))
    }
}
