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
//! [`LiveTrace::finish_streamed`] re-reads the recording and streams the
//! request part as requests become final ([`super::stream`]), so finishing
//! holds the open requests, not the recording; [`write_trace_streamed`] is
//! `hopscope trace` on large recordings: both parts from one pass.
//!
//! Request→step flows are drawn ([`super::stream`]: the steps carry flow ids
//! their requests' slices name later), and so are the step→GPU step and GPU
//! step→kernel ones (the GPU work and the engine steps carry ids the GPU
//! steps name: [`super::raw::GpuMarks`]). Not in a live or streamed trace:
//! in recordings without CUPTI step ends, the flows from steps to the
//! kernels that ran in them by time (kernels are written before their step
//! is known); `hopscope trace` on a recording under its size threshold
//! draws them.

use super::raw::RawLayout;
use super::stream::RequestStream;
use super::{end_of, groups, write_requests, Encoding, PerfettoError, TraceInput, TraceStats, TraceWriter};
use crate::correlate::{Analysis, Config, Correlator, DrainClock};
use crate::model::Record;
use crate::recording::{Meta, Reader};
use std::io::{Read, Write};

/// Reads `reader` to its end (or its first unreadable block), feeding the
/// correlator and, with `draw_records`, the record-driven tracks; hands final
/// requests to the request stream as it goes. Returns the correlator's tail
/// and the error that stopped the read, if any.
fn stream_pass<R: Read, W: Write>(t: &mut LiveTrace<W>, reader: &mut Reader<R>, cfg: Config, draw_records: bool, first: Option<Record>) -> Result<(Analysis, Option<String>), PerfettoError> {
    let mut rs = match t.req.take() {
        Some(rs) => rs,
        None => RequestStream::new(&mut t.w, t.t0)?,
    };
    let mut p = Pass { c: Correlator::new(cfg), clock: DrainClock::default(), draw_records };
    if let Some(r) = &first {
        p.feed(t, &mut rs, r)?;
    }
    let read_error = loop {
        match reader.next_ref() {
            Ok(Some(r)) => p.feed(t, &mut rs, r)?,
            Ok(None) => break None,
            Err(e) => break Some(e.to_string()),
        }
    };
    let mut tail = p.c.finish_streaming();
    // Drawn from the records (with their request→step flows): not needed.
    tail.steps = Vec::new();
    t.req = Some(rs);
    Ok((tail, read_error))
}

/// One streamed read: the correlator and its clock (requests are handed
/// out at `report --json`'s cadence).
struct Pass {
    c: Correlator,
    clock: DrainClock,
    draw_records: bool,
}

impl Pass {
    fn feed<W: Write>(&mut self, t: &mut LiveTrace<W>, rs: &mut RequestStream, r: &Record) -> Result<(), PerfettoError> {
        let ts = r.ts_ns();
        if self.draw_records {
            t.push_at(r, ts)?;
        }
        self.c.ingest(r);
        if let Some(now) = self.clock.tick(ts) {
            for q in self.c.drain_final(now) {
                rs.push(&mut t.w, &mut t.raw, q, now)?;
            }
            // Steps are drawn from the records, with their request→step
            // flows (see `stream`): the correlator's are let go.
            drop(self.c.take_steps());
            // GPU steps as the correlator decides them, so that they do not
            // pile up to the recording's end, with their flows to the engine
            // steps their compute matches.
            let (gpu_steps, compute) = self.c.take_gpu_steps();
            if !gpu_steps.is_empty() || !compute.is_empty() {
                t.raw.gpu_steps(&mut t.w, &gpu_steps, &[], &compute)?;
            }
            rs.advance(&mut t.w, &mut t.raw)?;
        }
        Ok(())
    }
}

/// `hopscope trace` in bounded memory: one pass over the recording draws the
/// record-driven tracks as records come and the request part as requests
/// become final. Returns the output, what was drawn and the error that
/// stopped the read early, if any.
pub fn write_trace_streamed<R: Read, W: Write>(out: W, reader: &mut Reader<R>, cfg: Config, enc: Encoding) -> Result<(W, TraceStats, Option<String>), PerfettoError> {
    let meta = reader.meta().clone();
    // The trace starts with the recording, else (no start in its metadata)
    // with its first record, as the whole layout does.
    let (first, first_error) = match reader.next_record() {
        Ok(r) => (r, None),
        Err(e) => (None, Some(e.to_string())),
    };
    let t0 = if meta.start_ns > 0 { meta.start_ns } else { first.as_ref().map_or(0, Record::ts_ns) };
    let mut t = LiveTrace::open(out, &meta, enc, t0, false)?;
    t.raw.keep_step_flows_for(super::raw::STEP_FLOWS_KEEP_NS);
    if let Some(e) = first_error {
        let (out, stats) = t.finish_tail(&meta, Analysis::default(), Some(&e))?;
        return Ok((out, stats, Some(e)));
    }
    let (tail, read_error) = stream_pass(&mut t, reader, cfg, true, first)?;
    let (out, stats) = t.finish_tail(&meta, tail, read_error.as_deref())?;
    Ok((out, stats, read_error))
}

pub struct LiveTrace<W: Write> {
    w: TraceWriter<W>,
    raw: RawLayout,
    t0: u64,
    last_ts: u64,
    req: Option<RequestStream>,
}

impl<W: Write> LiveTrace<W> {
    /// Starts the trace at the recording's start and describes its root
    /// processes. Compressed: each flush writes the batch so far.
    pub fn new(out: W, meta: &Meta) -> Result<Self, PerfettoError> {
        Self::with_encoding(out, meta, Encoding::default())
    }

    /// [`new`](Self::new) with the given encoding.
    pub fn with_encoding(out: W, meta: &Meta, enc: Encoding) -> Result<Self, PerfettoError> {
        Self::open(out, meta, enc, meta.start_ns, true)
    }

    /// Starts the trace at `t0`. `describe_roots`: describe the recording's
    /// root processes now (live: they show at once), else as first used or
    /// at the end, when the records read so far have named them (a process
    /// track's name is fixed when it is declared).
    fn open(out: W, meta: &Meta, enc: Encoding, t0: u64, describe_roots: bool) -> Result<Self, PerfettoError> {
        let mut w = TraceWriter::with_encoding(out, t0, enc)?;
        let mut raw = RawLayout::new(t0, true);
        let m = raw.meta_track(&mut w);
        w.describe(m)?;
        if describe_roots {
            for &pid in &meta.pids {
                let t = raw.process(&mut w, pid);
                w.describe(t)?;
            }
        }
        w.flush()?;
        Ok(LiveTrace { w, raw, t0, last_ts: t0, req: None })
    }

    /// Draws one record (in the pipeline's output order).
    pub fn push(&mut self, rec: &Record) -> Result<(), PerfettoError> {
        self.push_at(rec, rec.ts_ns())
    }

    /// [`push`](Self::push) with the record's [`Record::ts_ns`], which the
    /// caller has (a match over every variant, per record).
    fn push_at(&mut self, rec: &Record, ts: u64) -> Result<(), PerfettoError> {
        self.last_ts = self.last_ts.max(ts);
        if !RawLayout::uses(rec) {
            return Ok(());
        }
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
        // The GPU steps are known only now (the correlator's), on their own sequence.
        self.raw.gpu_steps(&mut self.w, &analysis.gpu_steps, &[], &analysis.step_compute)?;
        // The whole analysis draws no request→step flows: none takes the steps'.
        self.raw.drop_step_flows();
        let g = groups(&mut self.w)?;
        let input = TraceInput { meta, records: &[], analysis, read_error };
        write_requests(&mut self.w, &mut self.raw, &g, input, None, self.t0, t_end, &mut stats)?;
        stats.processes = self.w.processes() as u64;
        let (out, ws) = self.w.finish()?;
        stats.writer = ws;
        Ok((out, stats))
    }

    /// Appends the request-driven part by reading the finished recording
    /// once more, streamed ([`super::stream`]), and closes the trace.
    /// Returns also the error that stopped the read early, if any.
    pub fn finish_streamed<R: Read>(mut self, reader: &mut Reader<R>, cfg: Config) -> Result<(W, TraceStats, Option<String>), PerfettoError> {
        let meta = reader.meta().clone();
        let (tail, read_error) = stream_pass(&mut self, reader, cfg, false, None)?;
        let (out, stats) = self.finish_tail(&meta, tail, read_error.as_deref())?;
        Ok((out, stats, read_error))
    }

    fn finish_tail(mut self, meta: &Meta, mut tail: Analysis, read_error: Option<&str>) -> Result<(W, TraceStats), PerfettoError> {
        let rs = match self.req.take() {
            Some(rs) => rs,
            None => RequestStream::new(&mut self.w, self.t0)?,
        };
        for &pid in &meta.pids {
            let t = self.raw.process(&mut self.w, pid);
            self.w.describe(t)?;
        }
        // The GPU steps the correlator decided at its end (the rest were
        // drawn as they came), on their own sequences.
        self.raw.gpu_steps(&mut self.w, &tail.gpu_steps, &[], &tail.step_compute)?;
        let last_ts = self.last_ts;
        let mut stats = rs.finish(&mut self.w, &mut self.raw, meta, &mut tail, last_ts, read_error)?;
        stats.processes = self.w.processes() as u64;
        let (out, ws) = self.w.finish()?;
        stats.writer = ws;
        Ok((out, stats))
    }
}
