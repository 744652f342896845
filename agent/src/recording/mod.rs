//! The `.hop` recording: payload-free [`Record`]s in time order, streamed to disk
//! in independently compressed, checksummed blocks so that a killed agent loses
//! at most the block it was filling (the writer seals one at least every second).
//!
//! ```text
//! file   := MAGIC(8) version:u32le meta_len:u32le meta(JSON, meta_len) block*
//! block  := BLOCK_MAGIC(4) raw_len:u32le comp_len:u32le crc32(comp):u32le count:u32le comp
//! comp   := lz4 block of raw; raw := (len:u32le postcard(Record))*count
//! ```
//! Readers validate every length and checksum before trusting bytes and name the
//! byte offset of the first problem; everything before it stays readable.

pub mod fast;

use crate::model::Record;
use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

pub const MAGIC: &[u8; 8] = b"HOPSCOPE";
pub const BLOCK_MAGIC: &[u8; 4] = b"HSB1";
/// 1: session 1's records; 2: adds `GpuSample` and `EngineStats`; 3: adds
/// `WokenWrite`; 4: adds `EngineRequestStart`; 5: adds `ResponseModel`; 6: adds
/// `RequestLink`; 7: adds `EngineStructuredOutput`; 8: adds `EnginePriority`;
/// 9: adds `EngineConstraintKey`; 10: adds `NvmlDevice`.
pub const FORMAT_VERSION: u32 = 10;
/// The oldest format this reader still decodes (records are append-only).
pub const MIN_FORMAT_VERSION: u32 = 1;
/// Upper bound for one block's raw and compressed size and for the metadata: a
/// reader never allocates more than this for one length field.
pub const MAX_BLOCK_BYTES: u32 = 64 << 20;
const BLOCK_HEADER_LEN: usize = 20;
/// Seal a block when its raw size passes this, even within the second.
const BLOCK_TARGET_BYTES: usize = 1 << 20;

/// What the recording was made of; written first, as JSON, so it stays
/// readable by people and scripts.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    pub format_version: u32,
    pub hopscope_version: String,
    /// Wall-clock seconds since the Unix epoch when recording started.
    pub created_unix_s: u64,
    /// CLOCK_MONOTONIC ns when recording started.
    pub start_ns: u64,
    /// Unix time (ns) read right after `start_ns`: maps the recording's
    /// monotonic times to wall-clock ones (OTLP export). 0 in older files.
    #[serde(default)]
    pub start_unix_ns: u64,
    /// The root pids asked for (the tree below them is followed).
    pub pids: Vec<u32>,
    /// `hopscope run`: the command launched.
    #[serde(default)]
    pub command: Vec<String>,
    pub kernel: String,
    pub hostname: String,
    pub chain_header: String,
    pub capture_len: u32,
    /// Bytes captured per unix-socket syscall (the engine's IPC;
    /// `capture_len` is TCP's); 0 in files from before it was recorded.
    #[serde(default)]
    pub capture_len_unix: u32,
    /// Last bytes also captured of a unix-socket syscall longer than
    /// `capture_len_unix`; 0 in files from before (prefixes only).
    #[serde(default)]
    pub capture_tail_unix: u32,
    /// Last bytes also captured of any other socket's syscall longer than
    /// `capture_len` (an HTTP body's end); 0 in files from before.
    #[serde(default)]
    pub capture_tail: u32,
    pub capture_payload: bool,
    /// Whether a GPU source contributed to this recording.
    #[serde(default)]
    pub gpu: bool,
    /// Optional kernel tracepoints (`category:name`) the recording was made
    /// without: the kernel lacked them (e.g. sock:sk_data_ready before 6.6,
    /// so no wire arrival). Empty in older files and when none was missing.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub missing_tracepoints: Vec<String>,
    /// Set in each file of a rotated recording (`record --rotate-every` /
    /// `--rotate-mib`): which run and which part of it this file is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub segment: Option<Segment>,
}

/// One file of a rotated recording. Its records carry on exactly where the
/// previous segment's stopped (the agent's decoders are not reset), so a
/// request in flight at a rotation has its start in one file and its end in
/// the next: read together ([`Reader::open_all`]) the segments are the one
/// recording they were cut from.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Segment {
    /// The run's first `start_ns`: with `hostname`, names the run.
    pub run_start_ns: u64,
    /// 1-based, consecutive within a run.
    pub index: u32,
    /// The run's counters (the cumulative `Drops` ones) when this segment
    /// started: what a reader starting here subtracts, so a file's
    /// counters are its own.
    #[serde(default)]
    pub counters_before: std::collections::BTreeMap<String, u64>,
}

/// The segments of one run a reader read: `first` to `last`, consecutive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SegmentsRead {
    pub run_start_ns: u64,
    pub first: u32,
    pub last: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum RecordingError {
    #[error("cannot open recording {path}: {source}")]
    Open { path: PathBuf, source: io::Error },
    #[error("i/o error on recording: {0}")]
    Io(#[from] io::Error),
    #[error("not a hopscope recording (bad magic at offset 0)")]
    BadMagic,
    #[error("recording format version {0} is not supported by this hopscope (supports {MIN_FORMAT_VERSION} to {FORMAT_VERSION}): upgrade hopscope")]
    Version(u32),
    #[error("recording is truncated at offset {offset}: {what}")]
    Truncated { offset: u64, what: &'static str },
    #[error("recording is corrupt at offset {offset}: {what}")]
    Corrupt { offset: u64, what: String },
    /// Several files given that are not consecutive segments of one run.
    #[error("{0}")]
    Segments(String),
    /// A problem in a later file of a segmented read.
    #[error("in {path}: {source}")]
    InSegment { path: PathBuf, source: Box<RecordingError> },
}

/// Streams records into a `.hop` file.
pub struct Writer<W: Write> {
    out: W,
    raw: Vec<u8>,
    count: u32,
    scratch: Vec<u8>,
    /// Timestamp (ns, the caller's clock) of the last seal.
    last_seal_ns: u64,
    records_written: u64,
    bytes_written: u64,
}

impl Writer<io::BufWriter<std::fs::File>> {
    pub fn create(path: &Path, meta: &Meta) -> Result<Self, RecordingError> {
        let file = std::fs::File::create(path).map_err(|source| RecordingError::Open {
            path: path.to_owned(),
            source,
        })?;
        Writer::new(io::BufWriter::new(file), meta)
    }
}

impl<W: Write> Writer<W> {
    pub fn new(mut out: W, meta: &Meta) -> Result<Self, RecordingError> {
        let json = serde_json::to_vec(meta).map_err(io::Error::other)?;
        out.write_all(MAGIC)?;
        out.write_all(&FORMAT_VERSION.to_le_bytes())?;
        out.write_all(&(json.len() as u32).to_le_bytes())?;
        out.write_all(&json)?;
        out.flush()?;
        Ok(Writer {
            out,
            raw: Vec::with_capacity(BLOCK_TARGET_BYTES),
            count: 0,
            scratch: Vec::new(),
            last_seal_ns: meta.start_ns,
            records_written: 0,
            bytes_written: (MAGIC.len() + 8 + json.len()) as u64,
        })
    }

    /// Appends one record; seals the block when it is large or a second old.
    pub fn push(&mut self, rec: &Record) -> Result<(), RecordingError> {
        self.scratch.clear();
        let bytes = postcard::to_extend(rec, std::mem::take(&mut self.scratch))
            .map_err(|e| io::Error::other(format!("encoding record: {e}")))?;
        self.raw.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        self.raw.extend_from_slice(&bytes);
        self.scratch = bytes;
        self.count += 1;
        self.records_written += 1;
        if self.raw.len() >= BLOCK_TARGET_BYTES {
            self.seal(rec.ts_ns())?;
        }
        Ok(())
    }

    /// Seals the open block if it is older than a second at `now_ns`. Call this
    /// periodically so that a killed agent loses at most one second of data.
    pub fn tick(&mut self, now_ns: u64) -> Result<(), RecordingError> {
        if self.count > 0 && now_ns.saturating_sub(self.last_seal_ns) >= 1_000_000_000 {
            self.seal(now_ns)?;
        }
        Ok(())
    }

    /// Writes the open block (if any) and flushes it to the OS.
    pub fn seal(&mut self, now_ns: u64) -> Result<(), RecordingError> {
        self.last_seal_ns = now_ns;
        if self.count == 0 {
            return Ok(());
        }
        let comp = lz4_flex::block::compress(&self.raw);
        let crc = crc32fast::hash(&comp);
        self.out.write_all(BLOCK_MAGIC)?;
        self.out.write_all(&(self.raw.len() as u32).to_le_bytes())?;
        self.out.write_all(&(comp.len() as u32).to_le_bytes())?;
        self.out.write_all(&crc.to_le_bytes())?;
        self.out.write_all(&self.count.to_le_bytes())?;
        self.out.write_all(&comp)?;
        self.out.flush()?;
        self.bytes_written += (BLOCK_HEADER_LEN + comp.len()) as u64;
        self.raw.clear();
        self.count = 0;
        Ok(())
    }

    pub fn records_written(&self) -> u64 {
        self.records_written
    }

    pub fn bytes_written(&self) -> u64 {
        self.bytes_written
    }

    /// Seals the last block and returns the inner writer.
    pub fn finish(mut self, now_ns: u64) -> Result<W, RecordingError> {
        self.seal(now_ns)?;
        Ok(self.out)
    }
}

/// Reads a `.hop` file block by block.
pub struct Reader<R: Read> {
    input: R,
    meta: Meta,
    offset: u64,
    /// The current block, decompressed (`raw[..raw_len]`); records are
    /// decoded from it one at a time, when asked for, into `dec`'s reused
    /// slots. The buffers keep their capacity from block to block.
    comp: Vec<u8>,
    raw: Vec<u8>,
    raw_len: usize,
    /// Where the next record's length prefix is in `raw`, which record of
    /// the block it is, of how many, and the block body's file offset.
    pos: usize,
    index: u32,
    count: u32,
    body_off: u64,
    dec: fast::RecordDecoder,
    done: bool,
    /// A segmented read ([`Reader::open_all`]): the files still to read, in
    /// order, how to open one, the next one's expected index, and the file
    /// being read once past the first (errors name it).
    rest: std::collections::VecDeque<PathBuf>,
    open_next: Option<fn(&Path) -> io::Result<R>>,
    next_index: u32,
    current: Option<PathBuf>,
    /// The first file's `counters_before`, subtracted from every `Drops`
    /// read, and the adjusted record lent out.
    base: std::collections::BTreeMap<String, u64>,
    adjusted: Option<Record>,
}

impl Reader<io::BufReader<std::fs::File>> {
    pub fn open(path: &Path) -> Result<Self, RecordingError> {
        let file = std::fs::File::open(path).map_err(|source| RecordingError::Open {
            path: path.to_owned(),
            source,
        })?;
        Reader::new(io::BufReader::new(file))
    }

    /// One recording, or the segments of one rotated run (any order; read
    /// by index, each after the previous): one stream of records, as if the
    /// run had not been cut. Segments must be consecutive (a missing one
    /// would join requests across a gap); the first given may be any of the
    /// run's (earlier ones deleted by `--keep`), and the counters read are
    /// those of the segments given.
    pub fn open_all(paths: &[PathBuf]) -> Result<Self, RecordingError> {
        let [first, more @ ..] = paths else {
            return Err(RecordingError::Segments("no recording given".into()));
        };
        if more.is_empty() {
            return Reader::open(first);
        }
        let mut segs = Vec::with_capacity(paths.len());
        for p in paths {
            let meta = meta_of(p)?;
            let (Some((run_start_ns, hostname)), Some(g)) = (meta.run(), meta.segment.as_ref()) else {
                return Err(RecordingError::Segments(format!(
                    "{} is not a segment of a rotated recording (record --rotate-every/--rotate-mib): give it alone, or the segments of one run",
                    p.display()
                )));
            };
            segs.push((g.index, run_start_ns, hostname.to_owned(), p.clone()));
        }
        segs.sort_by_key(|s| s.0);
        for w in segs.windows(2) {
            let ((ia, ra, ha, pa), (ib, rb, hb, pb)) = (&w[0], &w[1]);
            if (ra, ha) != (rb, hb) {
                return Err(RecordingError::Segments(format!(
                    "{} and {} are segments of different runs (started at {ra} ns on {ha:?} and {rb} ns on {hb:?}): report each run apart",
                    pa.display(),
                    pb.display()
                )));
            }
            if ia == ib {
                return Err(RecordingError::Segments(format!("{} and {} are both segment {ia} of one run: give each once", pa.display(), pb.display())));
            }
            if ib - ia != 1 {
                return Err(RecordingError::Segments(format!(
                    "segment{} {} of the run (between {} and {}) {} missing: requests would be joined across the gap; report the segments before and after it apart",
                    if ib - ia > 2 { "s" } else { "" },
                    if ib - ia > 2 { format!("{}-{}", ia + 1, ib - 1) } else { (ia + 1).to_string() },
                    pa.display(),
                    pb.display(),
                    if ib - ia > 2 { "are" } else { "is" }
                )));
            }
        }
        let mut r = Reader::open(&segs[0].3)?;
        r.next_index = segs[0].0 + 1;
        r.rest = segs.into_iter().skip(1).map(|s| s.3).collect();
        r.open_next = Some(|p| std::fs::File::open(p).map(io::BufReader::new));
        Ok(r)
    }
}

/// A file's metadata; an error names the file (a failed open already does).
fn meta_of(p: &Path) -> Result<Meta, RecordingError> {
    Reader::open(p).map(|r| r.meta).map_err(|e| match e {
        e @ RecordingError::Open { .. } => e,
        e => RecordingError::InSegment { path: p.to_owned(), source: Box::new(e) },
    })
}

impl Meta {
    /// The rotated run this file is a segment of: its first `start_ns` and
    /// the host; None for a recording that was not rotated.
    pub fn run(&self) -> Option<(u64, &str)> {
        self.segment.as_ref().map(|g| (g.run_start_ns, self.hostname.as_str()))
    }
}

/// Reads exactly `buf.len()` bytes; `Ok(false)` on a clean EOF before the first
/// byte, `Truncated` on EOF in the middle.
fn read_full<R: Read>(r: &mut R, buf: &mut [u8], offset: u64, what: &'static str) -> Result<bool, RecordingError> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(RecordingError::Truncated { offset: offset + got as u64, what }),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(true)
}

fn le32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

impl<R: Read> Reader<R> {
    pub fn new(mut input: R) -> Result<Self, RecordingError> {
        let (meta, offset) = Self::read_header(&mut input)?;
        let base = meta.segment.as_ref().map(|s| s.counters_before.clone()).unwrap_or_default();
        Ok(Reader {
            input,
            meta,
            offset,
            comp: Vec::new(),
            raw: Vec::new(),
            raw_len: 0,
            pos: 0,
            index: 0,
            count: 0,
            body_off: 0,
            dec: fast::RecordDecoder::new(),
            done: false,
            rest: std::collections::VecDeque::new(),
            open_next: None,
            next_index: 0,
            current: None,
            base,
            adjusted: None,
        })
    }

    /// The file header and metadata; the offset of the first block.
    fn read_header(input: &mut R) -> Result<(Meta, u64), RecordingError> {
        let mut head = [0u8; 16];
        if !read_full(input, &mut head, 0, "file header")? {
            return Err(RecordingError::Truncated { offset: 0, what: "empty file" });
        }
        if &head[..8] != MAGIC {
            return Err(RecordingError::BadMagic);
        }
        let version = le32(&head[8..12]);
        // Records are only ever appended, so older files decode as they are.
        if !(MIN_FORMAT_VERSION..=FORMAT_VERSION).contains(&version) {
            return Err(RecordingError::Version(version));
        }
        let meta_len = le32(&head[12..16]);
        if meta_len > MAX_BLOCK_BYTES {
            return Err(RecordingError::Corrupt { offset: 12, what: format!("metadata length {meta_len} too large") });
        }
        let mut json = vec![0u8; meta_len as usize];
        if !read_full(input, &mut json, 16, "metadata")? && meta_len > 0 {
            return Err(RecordingError::Truncated { offset: 16, what: "metadata" });
        }
        let meta: Meta = serde_json::from_slice(&json)
            .map_err(|e| RecordingError::Corrupt { offset: 16, what: format!("metadata is not valid json: {e}") })?;
        Ok((meta, 16 + meta_len as u64))
    }

    /// The file being read when it is not the first of a segmented read.
    fn in_segment(&self, e: RecordingError) -> RecordingError {
        match (&self.current, e) {
            (_, e @ (RecordingError::InSegment { .. } | RecordingError::Open { .. })) => e,
            (Some(path), e) => RecordingError::InSegment { path: path.clone(), source: Box::new(e) },
            (None, e) => e,
        }
    }

    /// Moves on to the next segment of a segmented read; false when none is
    /// left.
    fn next_segment(&mut self) -> Result<bool, RecordingError> {
        let (Some(path), Some(open)) = (self.rest.pop_front(), self.open_next) else {
            return Ok(false);
        };
        let mut input = open(&path).map_err(|source| RecordingError::Open { path: path.clone(), source })?;
        self.current = Some(path);
        let (meta, offset) = Self::read_header(&mut input)?;
        // Checked when the read began; a file changed since is not read as
        // the next part.
        if meta.segment.as_ref().map(|s| s.index) != Some(self.next_index) {
            return Err(self.in_segment(RecordingError::Segments(format!("not segment {} of the run any more (the file changed while it was read)", self.next_index))));
        }
        self.next_index += 1;
        self.input = input;
        self.offset = offset;
        Ok(true)
    }

    pub fn meta(&self) -> &Meta {
        &self.meta
    }

    /// Which segments of a rotated run this reader has read so far (the
    /// first file's, up to the one being read); None for a recording that
    /// was not rotated.
    pub fn segments_read(&self) -> Option<SegmentsRead> {
        let g = self.meta.segment.as_ref()?;
        let last = if self.next_index > g.index { self.next_index - 1 } else { g.index };
        Some(SegmentsRead { run_start_ns: g.run_start_ns, first: g.index, last })
    }

    /// Byte offset of the next unread block.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// The next record, `Ok(None)` at a clean end of file.
    pub fn next_record(&mut self) -> Result<Option<Record>, RecordingError> {
        Ok(self.next_ref()?.cloned())
    }

    /// The next record, lent until the next call: what a reader that only
    /// looks at each record uses. It is decoded over the previous record of
    /// its kind (`fast`), so reading this way does not allocate once the
    /// strings have grown to size.
    pub fn next_ref(&mut self) -> Result<Option<&Record>, RecordingError> {
        if !self.advance()? {
            return Ok(None);
        }
        match self.decode_next() {
            Ok(()) => {}
            Err(e) => {
                self.done = true;
                return Err(self.in_segment(e));
            }
        }
        if !self.base.is_empty() {
            if let Some(Record::Drops { ts_ns, counters }) = self.dec.last() {
                let own = counters
                    .iter()
                    .map(|(k, v)| (k.clone(), v.saturating_sub(self.base.get(k).copied().unwrap_or(0))))
                    .collect();
                self.adjusted = Some(Record::Drops { ts_ns: *ts_ns, counters: own });
                return Ok(self.adjusted.as_ref());
            }
        }
        Ok(self.dec.last())
    }

    /// Whether a record is left, reading the next block if needed.
    fn advance(&mut self) -> Result<bool, RecordingError> {
        loop {
            if self.done {
                return Ok(false);
            }
            if self.index < self.count {
                return Ok(true);
            }
            match self.read_block().and_then(|more| if more { Ok(true) } else { self.next_segment() }) {
                Ok(true) => {}
                Ok(false) => {
                    self.done = true;
                    return Ok(false);
                }
                Err(e) => {
                    self.done = true;
                    return Err(self.in_segment(e));
                }
            }
        }
    }

    /// Decodes record `self.index` of the block at `self.pos`.
    fn decode_next(&mut self) -> Result<(), RecordingError> {
        let (i, count, body_off) = (self.index, self.count, self.body_off);
        let raw = &self.raw[..self.raw_len];
        let Some(len_bytes) = raw.get(self.pos..self.pos + 4) else {
            return Err(RecordingError::Corrupt { offset: body_off, what: format!("record {i} of {count}: length prefix past block end") });
        };
        let len = le32(len_bytes) as usize;
        let start = self.pos + 4;
        let Some(body) = raw.get(start..start.saturating_add(len)) else {
            return Err(RecordingError::Corrupt { offset: body_off, what: format!("record {i} of {count}: body past block end") });
        };
        self.dec.decode(body).map_err(|e| RecordingError::Corrupt { offset: body_off, what: format!("record {i} of {count} does not decode: {e}") })?;
        self.pos = start + len;
        self.index += 1;
        Ok(())
    }

    fn read_block(&mut self) -> Result<bool, RecordingError> {
        let start = self.offset;
        let mut hdr = [0u8; BLOCK_HEADER_LEN];
        if !read_full(&mut self.input, &mut hdr, start, "block header")? {
            return Ok(false);
        }
        if &hdr[..4] != BLOCK_MAGIC {
            return Err(RecordingError::Corrupt { offset: start, what: "bad block magic".into() });
        }
        let raw_len = le32(&hdr[4..8]);
        let comp_len = le32(&hdr[8..12]);
        let crc = le32(&hdr[12..16]);
        let count = le32(&hdr[16..20]);
        if raw_len > MAX_BLOCK_BYTES || comp_len > MAX_BLOCK_BYTES {
            return Err(RecordingError::Corrupt { offset: start, what: format!("block sizes {raw_len}/{comp_len} exceed the limit") });
        }
        let body_off = start + BLOCK_HEADER_LEN as u64;
        // Whatever the buffers held is overwritten: read_full fills `comp`
        // or fails, and the decompressor writes `raw` before it reads back.
        let comp = &mut self.comp;
        comp.resize(comp_len as usize, 0);
        if !read_full(&mut self.input, comp, body_off, "block body")? && comp_len > 0 {
            return Err(RecordingError::Truncated { offset: body_off, what: "block body" });
        }
        if crc32fast::hash(comp) != crc {
            return Err(RecordingError::Corrupt { offset: start, what: "block checksum mismatch".into() });
        }
        // What `lz4_flex::block::decompress` does, into a buffer kept.
        let raw_buf = &mut self.raw;
        raw_buf.resize(raw_len as usize, 0);
        let got = lz4_flex::block::decompress_into(comp, raw_buf)
            .map_err(|e| RecordingError::Corrupt { offset: body_off, what: format!("block does not decompress: {e}") })?;
        if got != raw_len as usize {
            return Err(RecordingError::Corrupt { offset: body_off, what: "block raw length mismatch".into() });
        }
        // The framing of every record is checked before any is handed out:
        // a block whose lengths do not add up gives none of its records.
        // (Records are decoded when asked for; one that does not decode in a
        // block whose checksum and framing hold — a writer bug, not damage —
        // stops reading after the records before it.)
        let raw = &raw_buf[..got];
        let mut pos = 0usize;
        for i in 0..count {
            let Some(len_bytes) = raw.get(pos..pos + 4) else {
                return Err(RecordingError::Corrupt { offset: body_off, what: format!("record {i} of {count}: length prefix past block end") });
            };
            pos += 4;
            let len = le32(len_bytes) as usize;
            if raw.get(pos..pos.saturating_add(len)).is_none() {
                return Err(RecordingError::Corrupt { offset: body_off, what: format!("record {i} of {count}: body past block end") });
            }
            pos += len;
        }
        if pos != raw.len() {
            return Err(RecordingError::Corrupt { offset: body_off, what: "trailing bytes in block".into() });
        }
        self.raw_len = got;
        self.pos = 0;
        self.index = 0;
        self.count = count;
        self.body_off = body_off;
        self.offset = body_off + comp_len as u64;
        Ok(true)
    }
}

/// `diff`'s two sides from its files: two files are BEFORE and AFTER as
/// given; more are the segments of two rotated runs, BEFORE's first (the
/// files up to the first one of another run), AFTER's after. Each side is
/// then read as one ([`Reader::open_all`] checks it is one run's,
/// consecutive).
pub fn split_before_after(paths: &[PathBuf]) -> Result<(Vec<PathBuf>, Vec<PathBuf>), RecordingError> {
    if let [before, after] = paths {
        return Ok((vec![before.clone()], vec![after.clone()]));
    }
    let Some(first) = paths.first() else {
        return Err(RecordingError::Segments("diff needs BEFORE and AFTER".into()));
    };
    let first_meta = meta_of(first)?;
    let Some(before_run) = first_meta.run() else {
        return Err(RecordingError::Segments(format!(
            "{} is not a segment of a rotated recording: with more than two files, diff takes the segments of two runs (before-*.hop after-*.hop)",
            first.display()
        )));
    };
    let mut split = None;
    for (i, p) in paths.iter().enumerate().skip(1) {
        if meta_of(p)?.run() != Some(before_run) {
            split = Some(i);
            break;
        }
    }
    match split {
        Some(i) => Ok((paths[..i].to_vec(), paths[i..].to_vec())),
        None => Err(RecordingError::Segments(format!(
            "all {} files are segments of one run: give BEFORE's segments, then AFTER's (before-*.hop after-*.hop)",
            paths.len()
        ))),
    }
}

/// Everything readable from a recording, and the error that stopped reading
/// early (if any): a damaged tail still gives a partial report.
pub struct Loaded {
    pub meta: Meta,
    pub records: Vec<Record>,
    pub error: Option<RecordingError>,
}

/// Reads a whole recording, keeping what precedes the first problem.
pub fn load(path: &Path) -> Result<Loaded, RecordingError> {
    load_all(&[path.to_owned()])
}

/// [`load`] of one recording or the segments of one run ([`Reader::open_all`]).
pub fn load_all(paths: &[PathBuf]) -> Result<Loaded, RecordingError> {
    let mut reader = Reader::open_all(paths)?;
    let mut records = Vec::new();
    let error = loop {
        match reader.next_record() {
            Ok(Some(r)) => records.push(r),
            Ok(None) => break None,
            Err(e) => break Some(e),
        }
    };
    Ok(Loaded { meta: reader.meta.clone(), records, error })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::ConnKey;

    fn meta() -> Meta {
        Meta { format_version: FORMAT_VERSION, hopscope_version: "test".into(), start_ns: 1, pids: vec![42], ..Meta::default() }
    }

    fn rec(i: u64) -> Record {
        Record::ConnClose { ts_ns: 1_000 + i, conn: ConnKey { tgid: 42, fd: 7, ino: i } }
    }

    fn write(n: u64, seal_every: Option<u64>) -> Vec<u8> {
        let mut w = Writer::new(Vec::new(), &meta()).unwrap();
        for i in 0..n {
            w.push(&rec(i)).unwrap();
            if let Some(k) = seal_every {
                if i % k == k - 1 {
                    w.seal(i).unwrap();
                }
            }
        }
        w.finish(n).unwrap()
    }

    fn read_all(bytes: &[u8]) -> (Vec<Record>, Option<RecordingError>) {
        let mut r = Reader::new(bytes).unwrap();
        let mut out = Vec::new();
        loop {
            match r.next_record() {
                Ok(Some(x)) => out.push(x),
                Ok(None) => return (out, None),
                Err(e) => return (out, Some(e)),
            }
        }
    }

    #[test]
    fn records_round_trip_in_order_with_metadata() {
        let bytes = write(1000, Some(100));
        let r = Reader::new(&bytes[..]).unwrap();
        assert_eq!(r.meta().pids, vec![42]);
        let (recs, err) = read_all(&bytes);
        assert!(err.is_none(), "{err:?}");
        assert_eq!(recs.len(), 1000);
        assert_eq!(recs[999], rec(999));
    }

    /// The unix capture length is in the metadata; a file written before it
    /// was (the committed testbed fixtures) reads it as 0, not an error.
    #[test]
    fn the_unix_capture_length_round_trips_and_older_files_read_it_as_zero() {
        let m = Meta { capture_len: 4096, capture_len_unix: 32768, capture_tail_unix: 4096, capture_tail: 16384, ..meta() };
        let bytes = Writer::new(Vec::new(), &m).unwrap().finish(1).unwrap();
        assert_eq!(Reader::new(&bytes[..]).unwrap().meta(), &m);
        let old = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chain3.hop");
        let r = Reader::open(&old).unwrap();
        assert_eq!((r.meta().capture_len, r.meta().capture_len_unix, r.meta().capture_tail_unix, r.meta().capture_tail), (4096, 0, 0, 0));
    }

    #[test]
    fn truncated_tail_keeps_sealed_blocks_and_names_the_offset() {
        let bytes = write(300, Some(100));
        let cut = &bytes[..bytes.len() - 5];
        let (recs, err) = read_all(cut);
        assert_eq!(recs.len(), 200, "the two complete blocks survive");
        let msg = err.expect("truncation must be reported").to_string();
        assert!(msg.contains("truncated at offset"), "{msg}");
    }

    #[test]
    fn flipped_byte_is_reported_as_corrupt_not_decoded() {
        let mut bytes = write(50, None);
        let n = bytes.len();
        bytes[n - 3] ^= 0xff;
        let (recs, err) = read_all(&bytes);
        assert!(recs.is_empty());
        let msg = err.expect("corruption must be reported").to_string();
        assert!(msg.contains("checksum"), "{msg}");
    }

    #[test]
    fn huge_length_fields_are_rejected_before_allocating() {
        let mut bytes = write(1, None);
        let meta_len = le32(&bytes[12..16]) as usize;
        let blk = 16 + meta_len;
        bytes[blk + 8..blk + 12].copy_from_slice(&u32::MAX.to_le_bytes());
        let (_, err) = read_all(&bytes);
        assert!(err.unwrap().to_string().contains("exceed the limit"));
    }

    #[test]
    fn wrong_magic_and_version_are_clear_errors() {
        assert!(matches!(Reader::new(&b"NOTAHOPFILE....."[..]), Err(RecordingError::BadMagic)));
        let mut bytes = write(1, None);
        bytes[8] = 99;
        assert!(matches!(Reader::new(&bytes[..]), Err(RecordingError::Version(99))));
    }

    #[test]
    fn a_cut_or_invalid_header_names_its_offset() {
        assert!(matches!(Reader::new(&b""[..]), Err(RecordingError::Truncated { offset: 0, what: "empty file" })));
        assert!(matches!(Reader::new(&b"HOPSCOPE\x02\x00"[..]), Err(RecordingError::Truncated { offset: 10, what: "file header" })));
        let bytes = write(1, None);
        let meta_len = le32(&bytes[12..16]) as usize;
        match Reader::new(&bytes[..16 + meta_len / 2]) {
            Err(RecordingError::Truncated { offset, what: "metadata" }) => assert_eq!(offset as usize, 16 + meta_len / 2),
            other => panic!("{:?}", other.err()),
        }
        let mut bad_json = bytes.clone();
        bad_json[16] = b'[';
        let e = Reader::new(&bad_json[..]).err().expect("invalid metadata is an error");
        assert!(matches!(e, RecordingError::Corrupt { offset: 16, .. }), "{e}");
        assert!(e.to_string().contains("metadata is not valid json"), "{e}");
    }

    #[test]
    fn a_block_claiming_more_records_than_it_holds_is_corrupt_and_reading_stops_there() {
        let mut bytes = write(30, Some(10));
        let meta_len = le32(&bytes[12..16]) as usize;
        let first = 16 + meta_len;
        let second = first + BLOCK_HEADER_LEN + le32(&bytes[first + 8..first + 12]) as usize;
        // The count is outside the checksum (which covers the compressed body).
        bytes[second + 16..second + 20].copy_from_slice(&11u32.to_le_bytes());
        let mut r = Reader::new(&bytes[..]).unwrap();
        let mut got = 0;
        let err = loop {
            match r.next_record() {
                Ok(Some(_)) => got += 1,
                Ok(None) => panic!("the bad count must be reported"),
                Err(e) => break e,
            }
        };
        assert_eq!(got, 10, "the first block survives");
        let msg = err.to_string();
        assert!(msg.contains(&format!("corrupt at offset {}", second + BLOCK_HEADER_LEN)) && msg.contains("record 10 of 11"), "{msg}");
        assert!(matches!(r.next_record(), Ok(None)), "nothing is read past the first problem");
        assert_eq!(r.offset() as usize, second, "the offset stays at the damaged block");
    }

    #[test]
    fn lent_records_are_the_moved_ones_and_stop_at_the_same_damaged_block() {
        let mut bytes = write(30, Some(10));
        let meta_len = le32(&bytes[12..16]) as usize;
        let first = 16 + meta_len;
        let second = first + BLOCK_HEADER_LEN + le32(&bytes[first + 8..first + 12]) as usize;
        bytes[second + 16..second + 20].copy_from_slice(&11u32.to_le_bytes());
        let (moved, moved_err) = read_all(&bytes);
        let mut r = Reader::new(&bytes[..]).unwrap();
        let mut lent = Vec::new();
        let lent_err = loop {
            match r.next_ref() {
                Ok(Some(x)) => lent.push(x.clone()),
                Ok(None) => break None,
                Err(e) => break Some(e),
            }
        };
        assert_eq!(lent.len(), 10);
        assert_eq!(lent, moved);
        assert_eq!(lent_err.map(|e| e.to_string()), moved_err.map(|e| e.to_string()));
        assert!(matches!(r.next_ref(), Ok(None)));
        let whole = write(2500, Some(1000));
        assert_eq!(read_all(&whole).0, (0..2500).map(rec).collect::<Vec<_>>(), "blocks of different sizes reuse the buffers");
    }

    #[test]
    fn tick_seals_a_block_once_a_second_has_passed() {
        let mut w = Writer::new(Vec::new(), &meta()).unwrap();
        w.push(&rec(0)).unwrap();
        w.tick(500_000_000).unwrap();
        let before = w.bytes_written();
        w.tick(1_000_000_002).unwrap();
        assert!(w.bytes_written() > before, "a second-old block must be on disk");
    }

    /// Decoding alone, records/s on one core, on the recording named by
    /// HOPSCOPE_BENCH_HOP (e.g. `cargo xtask bench-memory`'s files in
    /// target/bench/): `HOPSCOPE_BENCH_HOP=target/bench/synthetic-20000-g1.hop
    /// cargo test --release -p hopscope --lib recording::tests::bench_decode -- --ignored --nocapture`.
    #[test]
    #[ignore = "benchmark: needs HOPSCOPE_BENCH_HOP"]
    fn bench_decode() {
        let path = std::env::var("HOPSCOPE_BENCH_HOP").expect("set HOPSCOPE_BENCH_HOP to a .hop file");
        for round in 0..3 {
            let t = std::time::Instant::now();
            let mut r = Reader::open(Path::new(&path)).unwrap();
            let mut n = 0u64;
            let mut kinds = [0u64; fast::VARIANTS];
            let mut outputs = [0u64; 2];
            while let Some(rec) = r.next_ref().unwrap() {
                n += 1;
                kinds[fast::variant_index(rec) as usize] += 1;
                if let Record::EngineOutputs { dir, outputs: o, .. } = rec {
                    outputs[*dir as usize] += o.len() as u64;
                }
            }
            if round == 0 {
                eprintln!("records by variant index: {kinds:?}; engine outputs in reader's / writer's copies: {outputs:?}");
            }
            let dt = t.elapsed().as_secs_f64();
            eprintln!("decode round {round}: {n} records in {dt:.3} s = {:.2} M records/s", n as f64 / dt / 1e6);
        }
    }
}
