//! Live path from kernel events to the recording: a small reorder window (the
//! ring buffer is shared by all CPUs, so neighbours can arrive a few µs out of
//! order), the wire decoders, and the recording writer.
//!
//! GPU records (`source::cupti`) arrive much later than the kernel events of
//! the same moment: CUPTI hands over activity buffers when they fill or are
//! flushed (every 250 ms by default), a record exists only once its activity
//! ended, and the sender batches. The correlator ingests the file in order,
//! so the two streams are merged here rather than written side by side:
//!
//! - GPU records wait in their own heap, ordered by start time;
//! - records decoded from kernel events wait in a FIFO (their decoder order is
//!   kept as is: the correlator relies on it, e.g. a request before its
//!   response);
//! - while a GPU connection is open (and for one window after), both are
//!   released up to `now - GPU_REORDER_WINDOW_NS`, always taking the older
//!   head first;
//! - while a GPU receiver listens but nothing is connected, records are held
//!   `GPU_STANDBY_WINDOW_NS`, so that a process connecting now (its hello is
//!   stamped when the agent reads it, its first activities come later) finds
//!   the file not yet past its first records — the main loop notices a new
//!   connection within one poll;
//! - without a GPU receiver ([`Pipeline::advance_gpu`] never called) nothing
//!   is held back and the pipeline behaves exactly as before.
//!
//! A time-based horizon rather than "latest GPU timestamp - margin": a GPU
//! that goes idle sends nothing, and the kernel-side records must not wait for
//! it forever. A GPU record older than what was already written (longer
//! kernel, slower flush than the window) is still written, out of order, and
//! counted as `gpu_records_late`; consumers that need GPU records in strict
//! order must not assume more (the kernel totals of the report do not).

use crate::event::KEvent;
use crate::model::Record;
use crate::proto::{DecoderConfig, WireDecoder};
use crate::recording::{RecordingError, Writer};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::io::Write;

/// Events are held this long (by their own timestamps) before release, so that
/// the decoders see each connection's syscalls in order.
pub const REORDER_WINDOW_NS: u64 = 20_000_000;

/// While GPU sources are connected, records are held this long (agent clock)
/// so that GPU records, which arrive late, merge in timestamp order: the
/// sender's flush period (250 ms) + its batching and report period + the
/// longest activity we expect to see whole, with room to spare.
pub const GPU_REORDER_WINDOW_NS: u64 = 2_000_000_000;

/// While a GPU receiver listens with nothing connected, records are held
/// this long: more than the main loop's poll period.
pub const GPU_STANDBY_WINDOW_NS: u64 = 250_000_000;

/// Most records held for the GPU merge (memory bound); past it the oldest are
/// written regardless of the horizon.
const MAX_HELD: usize = 1 << 20;

/// A GPU record waiting for the merge, ordered by (start time, arrival).
struct HeldGpu {
    ts: u64,
    seq: u64,
    rec: Record,
}

impl PartialEq for HeldGpu {
    fn eq(&self, o: &Self) -> bool {
        (self.ts, self.seq) == (o.ts, o.seq)
    }
}
impl Eq for HeldGpu {}
impl PartialOrd for HeldGpu {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for HeldGpu {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.ts, self.seq).cmp(&(o.ts, o.seq))
    }
}

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

/// Sees every record the pipeline writes ([`Pipeline::add_tap`]).
pub type Tap = Box<dyn FnMut(&Record)>;

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
    /// GPU records written.
    pub gpu_records: u64,
    /// GPU records older than records already written (written anyway).
    pub gpu_records_late: u64,
}

pub struct Pipeline<W: Write> {
    heap: BinaryHeap<Reverse<Held>>,
    seq: u64,
    max_ts: u64,
    released_ts: u64,
    decoder: WireDecoder,
    writer: Writer<W>,
    /// Live Prometheus metrics fed with every record written (`--metrics`).
    metrics: Option<std::sync::Arc<std::sync::Mutex<crate::sink::metrics::LiveMetrics>>>,
    /// Sees every record written, in file order (`record --perfetto`).
    taps: Vec<Tap>,
    out: Vec<Record>,
    stats: PipelineStats,
    /// Decoded kernel-side records waiting for the GPU merge (decoder order).
    cpu_q: VecDeque<Record>,
    gpu_q: BinaryHeap<Reverse<HeldGpu>>,
    gpu_seq: u64,
    /// Agent time until which records are held for GPU merging (0: never held).
    gpu_hold_until_ns: u64,
    /// A GPU receiver exists ([`Pipeline::advance_gpu`] was called).
    gpu_standby: bool,
    /// What the last clock-driven call allowed out (u64::MAX: no holding).
    horizon: u64,
    /// Newest timestamp written to the file.
    written_ts: u64,
    /// Sampler records (NVML, `push_sample`), in time order.
    sample_q: VecDeque<Record>,
    /// Kernel time every event before which has been released (the tick's
    /// horizon): samples wait for it so they never pass older events still
    /// in the reorder window.
    tick_until: u64,
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
            metrics: None,
            taps: Vec::new(),
            out: Vec::new(),
            stats: PipelineStats::default(),
            cpu_q: VecDeque::new(),
            gpu_q: BinaryHeap::new(),
            gpu_seq: 0,
            gpu_hold_until_ns: 0,
            gpu_standby: false,
            horizon: u64::MAX,
            written_ts: 0,
            sample_q: VecDeque::new(),
            tick_until: 0,
        }
    }

    /// Takes one sampler record (NVML), timestamped when it was taken, in
    /// time order. It is written once the kernel-side events before it have
    /// left the reorder window (and the GPU horizon, when there is one).
    pub fn push_sample(&mut self, rec: Record) {
        self.sample_q.push_back(rec);
    }

    /// Takes one validated GPU record (any order); it is written once the GPU
    /// horizon (see [`Pipeline::advance_gpu`]) passes it.
    pub fn push_gpu(&mut self, rec: Record) {
        self.gpu_seq += 1;
        self.gpu_q.push(Reverse(HeldGpu { ts: rec.ts_ns(), seq: self.gpu_seq, rec }));
    }

    /// Moves the GPU horizon to `now_ns` (CLOCK_MONOTONIC): while `connected`
    /// (any GPU source open) and for one window after, records are written up
    /// to `now_ns - GPU_REORDER_WINDOW_NS`; otherwise up to
    /// `now_ns - GPU_STANDBY_WINDOW_NS`. Call it often (every poll) while a
    /// GPU receiver exists.
    pub fn advance_gpu(&mut self, now_ns: u64, connected: bool) -> Result<(), RecordingError> {
        self.gpu_standby = true;
        if connected {
            self.gpu_hold_until_ns = now_ns.saturating_add(GPU_REORDER_WINDOW_NS);
        }
        self.set_horizon(now_ns);
        self.emit(self.horizon)
    }

    fn set_horizon(&mut self, now_ns: u64) {
        self.horizon = if now_ns < self.gpu_hold_until_ns {
            now_ns.saturating_sub(GPU_REORDER_WINDOW_NS)
        } else if self.gpu_standby {
            now_ns.saturating_sub(GPU_STANDBY_WINDOW_NS)
        } else {
            u64::MAX
        };
    }

    /// Writes queued records with timestamps up to `horizon`, merging the two
    /// queues by timestamp (kernel-side first on ties). A kernel-side record
    /// stays queued while its timestamp is past the horizon, and so does
    /// everything decoded after it.
    /// Past [`MAX_HELD`] queued records, the oldest go out regardless.
    fn emit(&mut self, horizon: u64) -> Result<(), RecordingError> {
        loop {
            let full = self.cpu_q.len() + self.gpu_q.len() + self.sample_q.len() > MAX_HELD;
            let horizon = if full { u64::MAX } else { horizon };
            let cpu = self.cpu_q.front().map(Record::ts_ns).filter(|t| *t <= horizon);
            let gpu = self.gpu_q.peek().map(|Reverse(h)| h.ts).filter(|t| *t <= horizon);
            let released = if full { u64::MAX } else { self.released_ts.max(self.tick_until) };
            let smp = self.sample_q.front().map(Record::ts_ns).filter(|t| *t <= horizon && *t <= released);
            if let Some(t) = smp {
                if cpu.is_none_or(|c| t < c) && gpu.is_none_or(|g| t < g) {
                    let Some(rec) = self.sample_q.pop_front() else { return Ok(()) };
                    self.written_ts = self.written_ts.max(rec.ts_ns());
                    self.writer.push(&rec)?;
                    self.observe(&rec);
                    continue;
                }
            }
            let rec = match (cpu, gpu) {
                (None, None) => return Ok(()),
                (Some(c), Some(g)) if g < c => self.pop_gpu(),
                (Some(_), _) => self.cpu_q.pop_front(),
                (None, Some(_)) => self.pop_gpu(),
            };
            let Some(rec) = rec else { return Ok(()) };
            self.written_ts = self.written_ts.max(rec.ts_ns());
            self.writer.push(&rec)?;
            self.observe(&rec);
        }
    }

    /// Feeds live metrics, when `--metrics` asked for them.
    pub fn set_metrics(&mut self, m: std::sync::Arc<std::sync::Mutex<crate::sink::metrics::LiveMetrics>>) {
        self.metrics = Some(m);
    }

    /// Hands every record written to `tap`, in file (timestamp) order,
    /// across rotations.
    pub fn add_tap(&mut self, tap: Tap) {
        self.taps.push(tap);
    }

    fn observe(&mut self, rec: &Record) {
        for t in &mut self.taps {
            t(rec);
        }
        if let Some(m) = &self.metrics {
            if let Ok(mut m) = m.lock() {
                m.observe(rec);
            }
        }
    }

    fn pop_gpu(&mut self) -> Option<Record> {
        let Reverse(h) = self.gpu_q.pop()?;
        self.stats.gpu_records += 1;
        if h.ts < self.written_ts {
            self.stats.gpu_records_late += 1;
        }
        Some(h.rec)
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
            self.cpu_q.push_back(r);
        }
        self.emit(self.horizon)
    }

    /// Periodic work at `now_ns` (CLOCK_MONOTONIC): releases events that are
    /// older than the window even if no newer event arrived, writes a drop
    /// snapshot, seals the block so a kill loses at most about a second.
    pub fn tick(&mut self, now_ns: u64, kernel: &[(String, u64)]) -> Result<(), RecordingError> {
        let until = now_ns.saturating_sub(REORDER_WINDOW_NS);
        self.release(until)?;
        self.tick_until = self.tick_until.max(until);
        // Stamped at the release horizon, not `now`: every event still held is
        // newer, so the file stays in timestamp order. Queued behind decoded
        // records (the GPU merge may hold them).
        let drops = self.drop_counters(kernel);
        self.cpu_q.push_back(Record::Drops { ts_ns: until.max(self.released_ts), counters: drops });
        self.set_horizon(now_ns);
        self.emit(self.horizon)?;
        self.writer.tick(now_ns)
    }

    /// All loss counters: the kernel's (passed in), the decoders', the pipeline's.
    pub fn drop_counters(&self, kernel: &[(String, u64)]) -> Vec<(String, u64)> {
        let mut v: Vec<(String, u64)> = kernel.to_vec();
        v.extend(self.decoder.counters().into_iter().map(|(k, n)| (k.to_owned(), n)));
        v.push(("events_late".into(), self.stats.events_late));
        v.push(("events_invalid".into(), self.stats.events_invalid));
        if self.stats.gpu_records > 0 || !self.gpu_q.is_empty() {
            v.push(("gpu_records_late".into(), self.stats.gpu_records_late));
        }
        v
    }

    /// Bytes written to the current file so far.
    pub fn bytes_written(&self) -> u64 {
        self.writer.bytes_written()
    }

    /// Rotation: ends the current file with `counters` (the snapshot the
    /// next file's metadata starts from, [`Pipeline::drop_counters`]) and
    /// goes on writing to `next`. Nothing is drained or reset: the records
    /// queued and the decoders' state carry on into `next`, so the files read
    /// one after the other are the stream one file would have held. Returns
    /// the finished file.
    pub fn rotate(&mut self, next: Writer<W>, now_ns: u64, counters: Vec<(String, u64)>) -> Result<W, RecordingError> {
        // Stamped with the newest record written: the next file's records
        // are not older, so the segments read in order stay in time order.
        let mut old = std::mem::replace(&mut self.writer, next);
        old.push(&Record::Drops { ts_ns: self.written_ts, counters })?;
        old.finish(now_ns)
    }

    /// Drains everything, writes the final drop snapshot and seals the file.
    pub fn finish(mut self, now_ns: u64, kernel: &[(String, u64)]) -> Result<(W, PipelineStats), RecordingError> {
        self.release(u64::MAX)?;
        self.tick_until = u64::MAX;
        self.decoder.finish(&mut self.out);
        self.flush_out()?;
        self.emit(u64::MAX)?;
        let drops = self.drop_counters(kernel);
        self.writer.push(&Record::Drops { ts_ns: now_ns.max(self.released_ts).max(self.written_ts), counters: drops })?;
        let stats = self.stats;
        Ok((self.writer.finish(now_ns)?, stats))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::ConnKey;
    use crate::recording::{Meta, Reader, Segment, FORMAT_VERSION};
    use std::path::{Path, PathBuf};

    const MS: u64 = 1_000_000;

    fn meta(segment: Option<Segment>) -> Meta {
        Meta { format_version: FORMAT_VERSION, hopscope_version: "test".into(), start_ns: MS, hostname: "h".into(), segment, ..Meta::default() }
    }

    fn seg(run_start_ns: u64, index: u32, counters: &[(String, u64)]) -> Option<Segment> {
        Some(Segment { run_start_ns, index, counters_before: counters.iter().cloned().collect() })
    }

    fn create(path: &Path, m: &Meta) -> Writer<std::io::BufWriter<std::fs::File>> {
        Writer::new(std::io::BufWriter::new(std::fs::File::create(path).unwrap()), m).unwrap()
    }

    fn read(paths: &[PathBuf]) -> (Vec<Record>, Option<RecordingError>) {
        let l = crate::recording::load_all(paths).unwrap();
        (l.records, l.error)
    }

    fn last_drops(recs: &[Record]) -> Vec<(String, u64)> {
        recs.iter()
            .rev()
            .find_map(|r| match r {
                Record::Drops { counters, .. } => Some(counters.iter().filter(|(k, _)| k == "kernel_ringbuf_full").cloned().collect()),
                _ => None,
            })
            .expect("a drops record")
    }

    /// Feeds 300 records over 3 s (a tick each 10 ms, the kernel's loss
    /// counter growing by one a tick) to two pipelines: one writes
    /// `whole.hop`, the other `run-0001.hop`, rotating to `run-0002.hop` and
    /// `run-0003.hop` at records 100 and 200.
    fn run(dir: &Path) -> (PathBuf, Vec<PathBuf>) {
        run_named(dir, "run", MS)
    }

    fn run_named(dir: &Path, stem: &str, run_start_ns: u64) -> (PathBuf, Vec<PathBuf>) {
        let whole = dir.join(format!("whole-{stem}.hop"));
        let segs: Vec<PathBuf> = (1..=3).map(|i| dir.join(format!("{stem}-{i:04}.hop"))).collect();
        let mut one = Pipeline::new(DecoderConfig::default(), create(&whole, &meta(None)));
        let mut rot = Pipeline::new(DecoderConfig::default(), create(&segs[0], &meta(seg(run_start_ns, 1, &[]))));
        for i in 0..300u64 {
            let ts = MS + i * 10 * MS;
            let kernel = vec![("kernel_ringbuf_full".to_owned(), i)];
            for p in [&mut one, &mut rot] {
                p.push_sample(Record::ConnClose { ts_ns: ts, conn: ConnKey { tgid: 1, fd: 3, ino: i } });
                p.tick(ts + REORDER_WINDOW_NS, &kernel).unwrap();
            }
            if i == 99 || i == 199 {
                let index = (i / 100 + 2) as u32;
                let counters = rot.drop_counters(&kernel);
                let next = create(&segs[index as usize - 1], &meta(seg(run_start_ns, index, &counters)));
                let done = rot.rotate(next, ts + REORDER_WINDOW_NS, counters).unwrap();
                done.into_inner().unwrap();
            }
        }
        let kernel = vec![("kernel_ringbuf_full".to_owned(), 300)];
        one.finish(4 * 1000 * MS, &kernel).unwrap().0.into_inner().unwrap();
        rot.finish(4 * 1000 * MS, &kernel).unwrap().0.into_inner().unwrap();
        (whole, segs)
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("hopscope-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn segments_read_together_are_the_stream_one_file_would_have_held() {
        let dir = scratch("segments");
        let (whole, segs) = run(&dir);
        let (all, err) = read(std::slice::from_ref(&whole));
        assert!(err.is_none(), "{err:?}");
        // Given in any order, read by index.
        let (joined, err) = read(&[segs[2].clone(), segs[0].clone(), segs[1].clone()]);
        assert!(err.is_none(), "{err:?}");
        // Each rotation ends its segment with one more counter snapshot;
        // everything else is the same records in the same order.
        let not_drops = |v: &[Record]| v.iter().filter(|r| !matches!(r, Record::Drops { .. })).cloned().collect::<Vec<_>>();
        assert_eq!(not_drops(&joined), not_drops(&all));
        assert_eq!(not_drops(&all).len(), 300);
        let drops = |v: &[Record]| v.iter().filter(|r| matches!(r, Record::Drops { .. })).count();
        assert_eq!(drops(&joined), drops(&all) + 2);
        assert!(joined.windows(2).all(|w| w[0].ts_ns() <= w[1].ts_ns()), "the joined stream is in time order");
        assert_eq!(last_drops(&joined), last_drops(&all));
        assert_eq!(last_drops(&all), vec![("kernel_ringbuf_full".to_owned(), 300)]);
        // A segment alone, or the newest two (the first deleted by --keep):
        // the counters are those of the files read.
        let (middle, err) = read(&segs[1..2]);
        assert!(err.is_none(), "{err:?}");
        assert_eq!(not_drops(&middle).len(), 100);
        assert_eq!(last_drops(&middle), vec![("kernel_ringbuf_full".to_owned(), 100)], "199 at its end less 99 at its start");
        let (newest, _) = read(&segs[1..]);
        assert_eq!(not_drops(&newest).len(), 200);
        assert_eq!(last_drops(&newest), vec![("kernel_ringbuf_full".to_owned(), 201)]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn files_that_are_not_consecutive_segments_of_one_run_are_refused_with_why() {
        let dir = scratch("segments-refused");
        let (whole, segs) = run(&dir);
        let other = dir.join("other-0002.hop");
        let m = Meta { segment: Some(Segment { run_start_ns: 7, index: 2, ..Segment::default() }), ..meta(None) };
        create(&other, &m).finish(0).unwrap();
        let err = |paths: &[PathBuf]| Reader::open_all(paths).err().expect("refused").to_string();
        let e = err(&[segs[0].clone(), segs[2].clone()]);
        assert!(e.contains("segment 2 of the run") && e.contains("is missing") && e.contains("run-0001.hop"), "{e}");
        let e = err(&[segs[0].clone(), whole.clone()]);
        assert!(e.contains("whole-run.hop is not a segment of a rotated recording"), "{e}");
        let e = err(&[segs[1].clone(), segs[1].clone()]);
        assert!(e.contains("both segment 2"), "{e}");
        let e = err(&[segs[0].clone(), other.clone()]);
        assert!(e.contains("segments of different runs"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn damage_in_a_later_segment_names_that_file_and_keeps_what_precedes_it() {
        let dir = scratch("segments-damaged");
        let (_, segs) = run(&dir);
        let mut bytes = std::fs::read(&segs[1]).unwrap();
        let n = bytes.len();
        bytes.truncate(n - 5);
        std::fs::write(&segs[1], &bytes).unwrap();
        let (recs, err) = read(&segs);
        let e = err.expect("the cut is an error").to_string();
        assert!(e.starts_with(&format!("in {}: recording is truncated at offset", segs[1].display())), "{e}");
        let got = recs.iter().filter(|r| !matches!(r, Record::Drops { .. })).count();
        assert!((100..200).contains(&got), "segment 1 whole and segment 2 up to its cut block: {got}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn diff_takes_two_files_as_given_or_the_segments_of_two_runs_split_where_the_run_changes() {
        use crate::recording::split_before_after;
        let dir = scratch("segments-diff");
        let (whole, a) = run_named(&dir, "a", MS);
        let (_, b) = run_named(&dir, "b", 2 * MS);
        assert_eq!(split_before_after(&[whole.clone(), a[1].clone()]).unwrap(), (vec![whole.clone()], vec![a[1].clone()]));
        let all: Vec<PathBuf> = a.iter().chain(&b).cloned().collect();
        assert_eq!(split_before_after(&all).unwrap(), (a.clone(), b.clone()));
        // The newest two of one run against the whole other.
        let some: Vec<PathBuf> = a[1..].iter().chain(&b).cloned().collect();
        assert_eq!(split_before_after(&some).unwrap(), (a[1..].to_vec(), b.clone()));
        let e = split_before_after(&a).unwrap_err().to_string();
        assert!(e.contains("all 3 files are segments of one run"), "{e}");
        let e = split_before_after(&[whole.clone(), a[0].clone(), b[0].clone()]).unwrap_err().to_string();
        assert!(e.contains("whole-a.hop is not a segment"), "{e}");
        let junk = dir.join("junk.hop");
        std::fs::write(&junk, b"not a recording at all").unwrap();
        let e = split_before_after(&[a[0].clone(), junk.clone(), b[0].clone()]).unwrap_err().to_string();
        assert!(e.starts_with(&format!("in {}: not a hopscope recording", junk.display())), "the file is named: {e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// While a GPU source is connected every record waits ~2 s for the
    /// merge, so a rotation finds many queued: they go to the next segment,
    /// and the joined stream is still the one file's, in order.
    #[test]
    fn records_held_for_the_gpu_merge_at_a_rotation_go_on_into_the_next_segment() {
        let dir = scratch("segments-gpu");
        let whole = dir.join("whole.hop");
        let segs: Vec<PathBuf> = (1..=3).map(|i| dir.join(format!("gpu-{i:04}.hop"))).collect();
        let mut one = Pipeline::new(DecoderConfig::default(), create(&whole, &meta(None)));
        let mut rot = Pipeline::new(DecoderConfig::default(), create(&segs[0], &meta(seg(MS, 1, &[]))));
        for i in 0..600u64 {
            let ts = 10 * MS + i * 10 * MS;
            let now = ts + REORDER_WINDOW_NS;
            let kernel = vec![("kernel_ringbuf_full".to_owned(), 0)];
            for p in [&mut one, &mut rot] {
                p.push_sample(Record::ConnClose { ts_ns: ts, conn: ConnKey { tgid: 1, fd: 3, ino: i } });
                // A GPU record arrives late, stamped before the sample.
                p.push_gpu(Record::ConnClose { ts_ns: ts - 5 * MS, conn: ConnKey { tgid: 2, fd: 3, ino: i } });
                p.advance_gpu(now, true).unwrap();
                p.tick(now, &kernel).unwrap();
            }
            if i == 299 || i == 449 {
                let index = if i == 299 { 2 } else { 3 };
                assert!(rot.cpu_q.len() + rot.gpu_q.len() + rot.sample_q.len() > 100, "records are held at the rotation");
                let counters = rot.drop_counters(&kernel);
                let next = create(&segs[index - 1], &meta(seg(MS, index as u32, &counters)));
                rot.rotate(next, now, counters).unwrap().into_inner().unwrap();
            }
        }
        let kernel = vec![("kernel_ringbuf_full".to_owned(), 0)];
        one.finish(10 * 1000 * MS, &kernel).unwrap().0.into_inner().unwrap();
        rot.finish(10 * 1000 * MS, &kernel).unwrap().0.into_inner().unwrap();
        let not_drops = |v: &[Record]| v.iter().filter(|r| !matches!(r, Record::Drops { .. })).cloned().collect::<Vec<_>>();
        let (all, err) = read(std::slice::from_ref(&whole));
        assert!(err.is_none(), "{err:?}");
        let (joined, err) = read(&segs);
        assert!(err.is_none(), "{err:?}");
        assert_eq!(not_drops(&joined).len(), 1200);
        assert_eq!(not_drops(&joined), not_drops(&all));
        assert!(joined.windows(2).all(|w| w[0].ts_ns() <= w[1].ts_ns()), "in time order across the cuts");
        for s in &segs {
            assert!(!not_drops(&read(std::slice::from_ref(s)).0).is_empty(), "{} holds records", s.display());
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
