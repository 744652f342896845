//! Postcard decoding of [`Record`]s into reused slots: the reader's fast path.
//!
//! Serde's derive builds every record afresh: each `String` and `Vec` in it
//! is a new allocation, freed a moment later when the next record comes.
//! Decoding was ~45 % of `hopscope report --json` (docs/benchmarks.md), most
//! of it allocation. [`RecordDecoder`] keeps one record per variant and
//! decodes the next record of that variant over it, field by field, so the
//! strings and vectors keep their capacity: a steady recording decodes
//! without allocating.
//!
//! The wire is exactly postcard's (the on-disk format is frozen): varints
//! for integers (zigzag for signed), little-endian floats, a 0/1 byte for
//! `bool` and `Option`, a varint length before strings and sequences, none
//! before arrays and tuples, a varint variant index before an enum's
//! content. The first record of each variant goes through serde (that is
//! how a slot gets its variant); every later one through [`Dec`]. That both
//! paths agree on every input (the same record, or both an error) is checked
//! by the tests below and by the `record_decode` fuzz target.
//!
//! Drift: every variant and field is named in exhaustive patterns (no `..`),
//! so adding a field or variant does not compile until it is decoded here
//! too; fields are decoded in declaration order (the model's rule: add at
//! the end), which the round-trip tests check with distinct values.

use crate::event::{ConnKey, ConnOp, Dir, Family, ProcOp, Syscall};
use crate::model::{EngineEvent, EngineOutput, GpuPeer, HttpRole, PrefillStats, Record, SseKind, Usage};
use std::num::NonZeroU64;

/// Why a record's bytes do not decode (what postcard's errors say).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("record ends early")]
    Eof,
    #[error("bad varint")]
    BadVarint,
    #[error("bad bool")]
    BadBool,
    #[error("bad option tag")]
    BadOption,
    #[error("string is not utf-8")]
    BadUtf8,
    #[error("unknown {what} variant {index}")]
    BadVariant { what: &'static str, index: u32 },
    #[error("{0}")]
    Serde(String),
}

/// Why a record's bytes do not decode, as the field decoders pass it back:
/// one word (the kind in the low byte, then [`What`], then the variant
/// index in the high half), so that every field's result comes back in
/// registers — [`DecodeError`], with its `Serde` text, is written to memory
/// and read back at every field. It becomes the [`DecodeError`] of the same
/// name where [`RecordDecoder::decode`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Bad(NonZeroU64);

impl Bad {
    const EOF: Bad = Bad::kind(1);
    const VARINT: Bad = Bad::kind(2);
    const BOOL: Bad = Bad::kind(3);
    const OPTION: Bad = Bad::kind(4);
    const UTF8: Bad = Bad::kind(5);
    const VARIANT: u64 = 6;

    const fn kind(k: u64) -> Bad {
        Bad(NonZeroU64::new(k).expect("kinds start at 1"))
    }

    fn variant(what: What, index: u32) -> Bad {
        Bad(Bad::kind(Bad::VARIANT).0 | (what as u64) << 8 | u64::from(index) << 32)
    }
}

/// The enum whose variant index was unknown (its name in [`DecodeError::BadVariant`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum What {
    Dir,
    Family,
    ConnOp,
    ProcOp,
    Syscall,
    HttpRole,
    SseKind,
}

impl What {
    const ALL: [What; 7] = [What::Dir, What::Family, What::ConnOp, What::ProcOp, What::Syscall, What::HttpRole, What::SseKind];

    fn name(self) -> &'static str {
        match self {
            What::Dir => "Dir",
            What::Family => "Family",
            What::ConnOp => "ConnOp",
            What::ProcOp => "ProcOp",
            What::Syscall => "Syscall",
            What::HttpRole => "HttpRole",
            What::SseKind => "SseKind",
        }
    }
}

impl From<Bad> for DecodeError {
    fn from(b: Bad) -> Self {
        let w = b.0.get();
        match b {
            Bad::EOF => DecodeError::Eof,
            Bad::VARINT => DecodeError::BadVarint,
            Bad::BOOL => DecodeError::BadBool,
            Bad::OPTION => DecodeError::BadOption,
            Bad::UTF8 => DecodeError::BadUtf8,
            _ => {
                debug_assert_eq!(w & 0xff, Bad::VARIANT);
                DecodeError::BadVariant { what: What::ALL[(w >> 8 & 0xff) as usize].name(), index: (w >> 32) as u32 }
            }
        }
    }
}

type Result<T> = std::result::Result<T, Bad>;

/// The bytes not decoded yet (a slice that shrinks from the front: one
/// length to check per read, no position beside it).
struct Cur<'a> {
    b: &'a [u8],
}

impl<'a> Cur<'a> {
    fn new(b: &'a [u8]) -> Self {
        Cur { b }
    }

    #[inline(always)]
    fn pop(&mut self) -> Result<u8> {
        let (&v, rest) = self.b.split_first().ok_or(Bad::EOF)?;
        self.b = rest;
        Ok(v)
    }

    #[inline(always)]
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let (s, rest) = self.b.split_at_checked(n).ok_or(Bad::EOF)?;
        self.b = rest;
        Ok(s)
    }

    fn left(&self) -> usize {
        self.b.len()
    }

    /// Postcard's varint for an unsigned type of `BITS` bits: at most
    /// ceil(BITS / 7) bytes, the last of which may only carry the bits left.
    #[inline(always)]
    fn varint<const BITS: u32>(&mut self) -> Result<u64> {
        // Most values (lengths, small counts, enum tags) fit one byte, and any
        // type of 8 bits or more takes every one-byte value.
        match self.b.split_first() {
            Some((&v, rest)) if v < 0x80 => {
                self.b = rest;
                Ok(u64::from(v))
            }
            _ => self.varint_multi::<BITS>(),
        }
    }

    /// [`varint`](Self::varint) past its first byte. Where 8 bytes are left,
    /// they are read as one word: 2- and 3-byte varints (pids, inodes,
    /// sequence numbers) take their bytes from it one by one, and longer
    /// ones of a `u64` (the nanosecond timestamps: 7 bytes) are gathered
    /// from it in three shift-and-mask steps. What is left — near the end
    /// of the record, a `u16` or `u32` past those lengths, a `u64` of 9 or
    /// 10 bytes, every error — is [`varint_bytes`]'s, byte by byte.
    #[inline(always)]
    fn varint_multi<const BITS: u32>(&mut self) -> Result<u64> {
        if let Some(a) = self.b.first_chunk::<8>() {
            let x = u64::from_le_bytes(*a);
            // Any type of 14 bits or more takes every 2-byte value, of 21 every 3-byte one.
            if x & 0x8000 == 0 {
                self.b = &self.b[2..];
                return Ok((x & 0x7f) | (x >> 1 & 0x3f80));
            }
            if BITS >= 21 && x & 0x80_0000 == 0 {
                self.b = &self.b[3..];
                return Ok((x & 0x7f) | (x >> 1 & 0x3f80) | (x >> 2 & 0x1f_c000));
            }
            let stops = !x & 0x8080_8080_8080_8080;
            if BITS == 64 && stops != 0 {
                // The last byte's top bit is the lowest clear one; 8 bytes
                // carry 56 bits, which a u64 takes.
                let top = stops.trailing_zeros();
                self.b = &self.b[(top / 8 + 1) as usize..];
                let v = x & (u64::MAX >> (63 - top)) & 0x7f7f_7f7f_7f7f_7f7f;
                let v = (v & 0x007f_007f_007f_007f) | (v >> 1 & 0x3f80_3f80_3f80_3f80);
                let v = (v & 0x0000_3fff_0000_3fff) | (v >> 2 & 0x0fff_c000_0fff_c000);
                return Ok((v & 0x0fff_ffff) | (v >> 4 & 0x00ff_ffff_f000_0000));
            }
        }
        let (v, n) = varint_bytes::<BITS>(self.b)?;
        self.b = &self.b[n..];
        Ok(v)
    }

    #[inline(always)]
    fn u32(&mut self) -> Result<u32> {
        // At most 5 bytes, the last one ≤ 15: the value fits.
        Ok(self.varint::<32>()? as u32)
    }

    #[inline(always)]
    fn len(&mut self) -> Result<usize> {
        Ok(self.varint::<64>()? as usize)
    }
}

/// A varint of `BITS` bits at the start of `b`, byte by byte: its value
/// and length. Not inlined: [`Cur::varint_multi`] takes nearly every one.
#[inline(never)]
fn varint_bytes<const BITS: u32>(b: &[u8]) -> Result<(u64, usize)> {
    let max_bytes = BITS.div_ceil(7) as usize;
    let last_max: u8 = (1u8 << (BITS % 7)) - 1;
    let mut out = 0u64;
    for i in 0..max_bytes {
        let v = *b.get(i).ok_or(Bad::EOF)?;
        out |= u64::from(v & 0x7f) << (7 * i);
        if v & 0x80 == 0 {
            if i == max_bytes - 1 && v > last_max {
                return Err(Bad::VARINT);
            }
            return Ok((out, i + 1));
        }
    }
    Err(Bad::VARINT)
}

/// Decodes a value over `self`, reusing what it owns.
trait Dec {
    fn dec(&mut self, c: &mut Cur) -> Result<()>;
}

impl Dec for u8 {
    #[inline(always)]
    fn dec(&mut self, c: &mut Cur) -> Result<()> {
        *self = c.pop()?;
        Ok(())
    }
}

impl Dec for u16 {
    #[inline(always)]
    fn dec(&mut self, c: &mut Cur) -> Result<()> {
        *self = c.varint::<16>()? as u16;
        Ok(())
    }
}

impl Dec for u32 {
    #[inline(always)]
    fn dec(&mut self, c: &mut Cur) -> Result<()> {
        *self = c.u32()?;
        Ok(())
    }
}

impl Dec for u64 {
    #[inline(always)]
    fn dec(&mut self, c: &mut Cur) -> Result<()> {
        *self = c.varint::<64>()?;
        Ok(())
    }
}

impl Dec for i32 {
    #[inline(always)]
    fn dec(&mut self, c: &mut Cur) -> Result<()> {
        let n = c.u32()?;
        *self = ((n >> 1) as i32) ^ (-((n & 1) as i32));
        Ok(())
    }
}

impl Dec for i64 {
    #[inline(always)]
    fn dec(&mut self, c: &mut Cur) -> Result<()> {
        let n = c.varint::<64>()?;
        *self = ((n >> 1) as i64) ^ (-((n & 1) as i64));
        Ok(())
    }
}

impl Dec for f64 {
    #[inline(always)]
    fn dec(&mut self, c: &mut Cur) -> Result<()> {
        let b = c.take(8)?;
        *self = f64::from_le_bytes(b.try_into().expect("8 bytes taken"));
        Ok(())
    }
}

impl Dec for bool {
    #[inline(always)]
    fn dec(&mut self, c: &mut Cur) -> Result<()> {
        *self = match c.pop()? {
            0 => false,
            1 => true,
            _ => return Err(Bad::BOOL),
        };
        Ok(())
    }
}

impl Dec for String {
    #[inline(always)]
    fn dec(&mut self, c: &mut Cur) -> Result<()> {
        let n = c.len()?;
        let b = c.take(n)?;
        // The slot's string is often this one again (a header's name, the
        // method, the model, the request id of the other side's copy):
        // then there is nothing to validate or copy.
        if self.as_bytes() != b {
            assign(self, b)?;
        }
        Ok(())
    }
}

/// `s` becomes the UTF-8 text `b`, reusing its buffer.
#[inline(always)]
fn assign(s: &mut String, b: &[u8]) -> Result<()> {
    let t = std::str::from_utf8(b).map_err(|_| Bad::UTF8)?;
    s.clear();
    s.push_str(t);
    Ok(())
}

impl<T: Dec + Default> Dec for Option<T> {
    #[inline(always)]
    fn dec(&mut self, c: &mut Cur) -> Result<()> {
        match c.pop()? {
            0 => *self = None,
            1 => self.get_or_insert_with(T::default).dec(c)?,
            _ => return Err(Bad::OPTION),
        }
        Ok(())
    }
}

impl<T: Dec + Default> Dec for Vec<T> {
    fn dec(&mut self, c: &mut Cur) -> Result<()> {
        let n = c.len()?;
        // Every element takes at least one byte: a length past the bytes
        // left is an error before anything is allocated for it.
        if n > c.left() {
            return Err(Bad::EOF);
        }
        self.truncate(n);
        for i in 0..n {
            if i < self.len() {
                self[i].dec(c)?;
            } else {
                let mut v = T::default();
                v.dec(c)?;
                self.push(v);
            }
        }
        Ok(())
    }
}

impl<A: Dec, B: Dec> Dec for (A, B) {
    #[inline(always)]
    fn dec(&mut self, c: &mut Cur) -> Result<()> {
        self.0.dec(c)?;
        self.1.dec(c)
    }
}

impl Dec for [u32; 3] {
    #[inline(always)]
    fn dec(&mut self, c: &mut Cur) -> Result<()> {
        for v in self.iter_mut() {
            v.dec(c)?;
        }
        Ok(())
    }
}

/// Decodes the named fields of a struct or variant, in the order given
/// (the declaration order).
macro_rules! fields {
    ($c:expr; $($f:expr),* $(,)?) => {{
        $( $f.dec($c)?; )*
        Ok(())
    }};
}

impl Dec for ConnKey {
    #[inline(always)]
    fn dec(&mut self, c: &mut Cur) -> Result<()> {
        let ConnKey { tgid, fd, ino } = self;
        fields!(c; tgid, fd, ino)
    }
}

impl Dec for Usage {
    fn dec(&mut self, c: &mut Cur) -> Result<()> {
        let Usage { prompt_tokens, completion_tokens, cached_tokens } = self;
        fields!(c; prompt_tokens, completion_tokens, cached_tokens)
    }
}

impl Dec for EngineEvent {
    fn dec(&mut self, c: &mut Cur) -> Result<()> {
        let EngineEvent { kind, timestamp_s } = self;
        fields!(c; kind, timestamp_s)
    }
}

impl Dec for PrefillStats {
    fn dec(&mut self, c: &mut Cur) -> Result<()> {
        let PrefillStats { prompt_tokens, computed_tokens, cached_tokens, local_cached_tokens, external_cached_tokens } = self;
        fields!(c; prompt_tokens, computed_tokens, cached_tokens, local_cached_tokens, external_cached_tokens)
    }
}

impl Dec for EngineOutput {
    fn dec(&mut self, c: &mut Cur) -> Result<()> {
        dec_output(self, c, None)
    }
}

/// An [`EngineOutput`] over `o`, its request id through `recent` (see
/// [`OutputsMemo::ids`]) where there is one.
#[inline(always)]
fn dec_output(o: &mut EngineOutput, c: &mut Cur, recent: Option<&mut [String]>) -> Result<()> {
    let EngineOutput { request_id, new_tokens, finish_reason, events, prefill } = o;
    // An engine step's outputs list the batch in the same order step
    // after step: the reused slot mostly holds this very id already, and
    // then there is nothing to validate or copy.
    let n = c.len()?;
    let b = c.take(n)?;
    if request_id.as_bytes() != b {
        match recent {
            Some(recent) => assign_recent(request_id, b, recent)?,
            None => assign(request_id, b)?,
        }
    }
    fields!(c; new_tokens, finish_reason, events, prefill)
}

impl Dec for GpuPeer {
    fn dec(&mut self, c: &mut Cur) -> Result<()> {
        let GpuPeer { src_device, src_context, dst_device, dst_context } = self;
        fields!(c; src_device, src_context, dst_device, dst_context)
    }
}

/// Field-less enums: a varint variant index. `index` is an exhaustive match,
/// so a new variant does not compile until it is listed here (in order).
macro_rules! unit_enum {
    ($t:ident: $($v:ident),+ $(,)?) => {
        impl Dec for $t {
            #[inline(always)]
            fn dec(&mut self, c: &mut Cur) -> Result<()> {
                let i = c.u32()?;
                *self = *<$t as UnitIndex>::ALL.get(i as usize).ok_or_else(|| Bad::variant(What::$t, i))?;
                Ok(())
            }
        }
        impl UnitIndex for $t {
            const ALL: &'static [$t] = &[$($t::$v),+];
            fn index(&self) -> u32 {
                // Exhaustive: a variant missing from the list does not compile.
                match *self {
                    $($t::$v)|+ => {}
                }
                Self::ALL.iter().position(|v| v == self).expect("every variant is listed") as u32
            }
        }
    };
}

/// The variant index serde gives a field-less enum (for the drift tests).
pub trait UnitIndex: Sized + PartialEq + 'static {
    const ALL: &'static [Self];
    fn index(&self) -> u32;
}

unit_enum!(Dir: In, Out);
unit_enum!(Family: Unix, Inet, Inet6, Unknown);
unit_enum!(ConnOp: Accept, Connect);
unit_enum!(ProcOp: Fork, Exec, Exit);
unit_enum!(Syscall: Read, Readv, Recvfrom, Recvmsg, Write, Writev, Sendto, Sendmsg);
unit_enum!(HttpRole: Server, Client);
unit_enum!(SseKind: Role, Content, Finish, Usage, Done, Error, Other);

/// The variant index serde writes for `r` (its declaration order).
pub fn variant_index(r: &Record) -> u32 {
    match r {
        Record::ConnOpen { .. } => 0,
        Record::ConnClose { .. } => 1,
        Record::HttpRequest { .. } => 2,
        Record::HttpResponse { .. } => 3,
        Record::Sse { .. } => 4,
        Record::ResponseBody { .. } => 5,
        Record::HttpResponseEnd { .. } => 6,
        Record::Unparsed { .. } => 7,
        Record::UnixIo { .. } => 8,
        Record::Proc { .. } => 9,
        Record::OffCpu { .. } => 10,
        Record::Drops { .. } => 11,
        Record::RawIo { .. } => 12,
        Record::EngineRequest { .. } => 13,
        Record::EngineAbort { .. } => 14,
        Record::EngineOutputs { .. } => 15,
        Record::GpuProcess { .. } => 16,
        Record::GpuDevice { .. } => 17,
        Record::GpuKernel { .. } => 18,
        Record::GpuMemcpy { .. } => 19,
        Record::GpuMemset { .. } => 20,
        Record::GpuSync { .. } => 21,
        Record::GpuApi { .. } => 22,
        Record::GpuCalibration { .. } => 23,
        Record::GpuSample { .. } => 24,
        Record::EngineStats { .. } => 25,
        Record::WokenWrite { .. } => 26,
        Record::EngineRequestStart { .. } => 27,
        Record::ResponseModel { .. } => 28,
        Record::RequestLink { .. } => 29,
        Record::EngineStructuredOutput { .. } => 30,
        Record::EnginePriority { .. } => 31,
        Record::EngineConstraintKey { .. } => 32,
        Record::NvmlDevice { .. } => 33,
    }
}

/// Variants in the format (one past the last index).
pub const VARIANTS: usize = 34;

/// Decodes `c` (just past the variant index) over `r`, which holds a record
/// of that variant.
fn dec_record(r: &mut Record, c: &mut Cur) -> Result<()> {
    match r {
        Record::ConnOpen { ts_ns, conn, op, family, local, peer } => fields!(c; ts_ns, conn, op, family, local, peer),
        Record::ConnClose { ts_ns, conn } => fields!(c; ts_ns, conn),
        Record::HttpRequest { conn, role, seq, start_ns, end_ns, tid, method, path, headers, body_len, stream, model, ready_ns } => {
            fields!(c; conn, role, seq, start_ns, end_ns, tid, method, path, headers, body_len, stream, model, ready_ns)
        }
        Record::HttpResponse { conn, role, seq, ts_ns, tid, status, headers } => fields!(c; conn, role, seq, ts_ns, tid, status, headers),
        Record::Sse { conn, seq, ts_ns, kind, id, content_bytes, finish_reason, usage } => fields!(c; conn, seq, ts_ns, kind, id, content_bytes, finish_reason, usage),
        Record::ResponseBody { conn, seq, ts_ns, id, usage, finish_reason } => fields!(c; conn, seq, ts_ns, id, usage, finish_reason),
        Record::HttpResponseEnd { conn, seq, ts_ns, body_len } => fields!(c; conn, seq, ts_ns, body_len),
        Record::Unparsed { conn, ts_ns, dir, bytes, reason } => fields!(c; conn, ts_ns, dir, bytes, reason),
        Record::UnixIo { conn, ts_ns, enter_ns, tid, dir, len } => fields!(c; conn, ts_ns, enter_ns, tid, dir, len),
        Record::Proc { ts_ns, tgid, op, child_tgid, exit_code, comm } => fields!(c; ts_ns, tgid, op, child_tgid, exit_code, comm),
        Record::OffCpu { ts_ns, tgid, tid, off_ns, wake_ns, prev_state } => fields!(c; ts_ns, tgid, tid, off_ns, wake_ns, prev_state),
        Record::Drops { ts_ns, counters } => fields!(c; ts_ns, counters),
        Record::RawIo { conn, ts_ns, enter_ns, tid, syscall, dir, family, len, data } => fields!(c; conn, ts_ns, enter_ns, tid, syscall, dir, family, len, data),
        Record::EngineRequest { conn, ts_ns, tid, dir, request_id, external_req_id, prompt_tokens, max_tokens, arrival_time_s, traceparent, data_parallel_rank, truncated } => {
            fields!(c; conn, ts_ns, tid, dir, request_id, external_req_id, prompt_tokens, max_tokens, arrival_time_s, traceparent, data_parallel_rank, truncated)
        }
        Record::EngineAbort { conn, ts_ns, tid, dir, request_ids } => fields!(c; conn, ts_ns, tid, dir, request_ids),
        Record::EngineOutputs { conn, ts_ns, tid, dir, engine_index, timestamp_s, outputs, outputs_total, finished_requests, truncated } => {
            fields!(c; conn, ts_ns, tid, dir, engine_index, timestamp_s, outputs, outputs_total, finished_requests, truncated)
        }
        Record::GpuProcess { ts_ns, pid, ppid, own_pid, comm, cupti_version, clock, enabled, init_ns, cupti_lib } => {
            fields!(c; ts_ns, pid, ppid, own_pid, comm, cupti_version, clock, enabled, init_ns, cupti_lib)
        }
        Record::GpuDevice { ts_ns, pid, device, name, cc_major, cc_minor, sm_count, total_mem_bytes, driver_version } => {
            fields!(c; ts_ns, pid, device, name, cc_major, cc_minor, sm_count, total_mem_bytes, driver_version)
        }
        Record::GpuKernel { ts_ns, end_ns, pid, device, context, stream, correlation_id, graph_id, graph_node_id, name, grid, block, static_shared_mem, dynamic_shared_mem, registers_per_thread } => {
            fields!(c; ts_ns, end_ns, pid, device, context, stream, correlation_id, graph_id, graph_node_id, name, grid, block, static_shared_mem, dynamic_shared_mem, registers_per_thread)
        }
        Record::GpuMemcpy { ts_ns, end_ns, pid, device, context, stream, kind, src_kind, dst_kind, flags, bytes, correlation_id, runtime_correlation_id, graph_id, graph_node_id, peer } => {
            fields!(c; ts_ns, end_ns, pid, device, context, stream, kind, src_kind, dst_kind, flags, bytes, correlation_id, runtime_correlation_id, graph_id, graph_node_id, peer)
        }
        Record::GpuMemset { ts_ns, end_ns, pid, device, context, stream, bytes, value, memory_kind, flags, correlation_id, graph_id, graph_node_id } => {
            fields!(c; ts_ns, end_ns, pid, device, context, stream, bytes, value, memory_kind, flags, correlation_id, graph_id, graph_node_id)
        }
        Record::GpuSync { ts_ns, end_ns, pid, sync_type, context, stream, correlation_id, cuda_event } => fields!(c; ts_ns, end_ns, pid, sync_type, context, stream, correlation_id, cuda_event),
        Record::GpuApi { ts_ns, end_ns, pid, tid, domain, class, cbid, name, correlation_id, return_value } => {
            fields!(c; ts_ns, end_ns, pid, tid, domain, class, cbid, name, correlation_id, return_value)
        }
        Record::GpuCalibration { ts_ns, pid, offset_ns, error_ns } => fields!(c; ts_ns, pid, offset_ns, error_ns),
        Record::GpuSample { ts_ns, device, mem_used_bytes, mem_total_bytes, process_mem, sm_util_pct, mem_util_pct, pcie_tx_kib_s, pcie_rx_kib_s, nvlink_tx_kib_s, nvlink_rx_kib_s } => {
            fields!(c; ts_ns, device, mem_used_bytes, mem_total_bytes, process_mem, sm_util_pct, mem_util_pct, pcie_tx_kib_s, pcie_rx_kib_s, nvlink_tx_kib_s, nvlink_rx_kib_s)
        }
        Record::EngineStats { conn, ts_ns, engine_index, running, waiting, kv_cache_usage, step_counter, prefix_cache_queries, prefix_cache_hits } => {
            fields!(c; conn, ts_ns, engine_index, running, waiting, kv_cache_usage, step_counter, prefix_cache_queries, prefix_cache_hits)
        }
        Record::WokenWrite { ts_ns, tgid, tid, wake_ns, on_ns } => fields!(c; ts_ns, tgid, tid, wake_ns, on_ns),
        Record::EngineRequestStart { conn, ts_ns, tid, dir, request_id, first_ns } => fields!(c; conn, ts_ns, tid, dir, request_id, first_ns),
        Record::ResponseModel { conn, seq, ts_ns, model } => fields!(c; conn, seq, ts_ns, model),
        Record::RequestLink { conn, seq, ts_ns, previous_response_id } => fields!(c; conn, seq, ts_ns, previous_response_id),
        Record::EngineStructuredOutput { conn, ts_ns, dir, request_id, kind, backend } => fields!(c; conn, ts_ns, dir, request_id, kind, backend),
        Record::EnginePriority { conn, ts_ns, dir, request_id, priority } => fields!(c; conn, ts_ns, dir, request_id, priority),
        Record::EngineConstraintKey { conn, ts_ns, dir, request_id, key } => fields!(c; conn, ts_ns, dir, request_id, key),
        Record::NvmlDevice { ts_ns, device, name, driver, mem_total_bytes } => fields!(c; ts_ns, device, name, driver, mem_total_bytes),
    }
}

/// The variant indexes of [`Record::Sse`] and [`Record::EngineOutputs`].
const SSE: u32 = 4;
const ENGINE_OUTPUTS: u32 = 15;

/// SSE slots in [`RecordDecoder::slots`], past [`SSE_SLOTS`], and slots in
/// [`OutputsMemo::ids`] (a power of two).
const RECENT_IDS: usize = 64;

/// Where [`RecordDecoder::slots`]' SSE records with ids start.
const SSE_SLOTS: usize = VARIANTS;

/// What the engine-outputs slot was decoded from, for the next record of
/// that variant to skip what it repeats (see [`dec_engine_outputs`]).
#[derive(Default)]
struct OutputsMemo {
    /// The bytes of the slot's body (its fields after `timestamp_s`);
    /// empty when unknown. Each step's outputs are recorded twice, the
    /// engine's write and the frontend's read of the same message: where
    /// the body's bytes are these, the slot already holds what decoding
    /// them would give, and only the header is decoded. Half the outputs
    /// of a vLLM recording are the reader's copies.
    body: Vec<u8>,
    /// Where in `body` each of the slot's outputs was decoded from (one
    /// per output, in order, while `body` is known).
    spans: Vec<(usize, usize)>,
    /// The spans being made for the record being decoded.
    next_spans: Vec<(usize, usize)>,
    /// Request ids seen lately, as SSE ids are (see [`dec_sse`]): a batch's
    /// members keep their order from step to step only until one finishes
    /// or joins, and the ids found here are copied, not validated again.
    ids: Vec<String>,
}

impl OutputsMemo {
    fn forget(&mut self) {
        self.body.clear();
        self.spans.clear();
    }
}

/// How far past the next unmatched output of the last step an output is
/// looked for (requests that finished in between).
const OUTPUT_LOOKAHEAD: usize = 3;

/// [`dec_record`] of an engine-outputs record over `r` (which holds one),
/// skipping what repeats the last one's bytes (see [`OutputsMemo`]).
///
/// From one step to the next, a batch's outputs are mostly the same
/// requests in the same order, most with the same bytes (one new token,
/// not finished); a request that finished drops out, one that joined is
/// added. So each output is first looked for among the last step's
/// outputs not yet matched, the next few in order: where the record's
/// bytes go on with one's bytes, that output is moved to its place as it
/// is, since decoding reads a prefix of the bytes and stops where they
/// say (the same prefix decodes to the same values and ends at the same
/// place). Only the others are decoded.
fn dec_engine_outputs(r: &mut Record, b: &[u8], memo: &mut OutputsMemo) -> Result<()> {
    let Record::EngineOutputs { conn, ts_ns, tid, dir, engine_index, timestamp_s, outputs, outputs_total, finished_requests, truncated } = r else {
        return dec_record(r, &mut Cur::new(b));
    };
    let c = &mut Cur::new(b);
    fields!(c; conn, ts_ns, tid, dir, engine_index, timestamp_s)?;
    let body = &memo.body;
    if !body.is_empty() && c.b.starts_with(body) {
        return Ok(());
    }
    let start = c.b;
    let at = |c: &Cur| start.len() - c.b.len();
    let n = c.len()?;
    // Every output takes at least one byte: a length past the bytes left
    // is an error before anything is allocated for it.
    if n > c.left() {
        return Err(Bad::EOF);
    }
    // Outputs [i, next) of the slot are ones matched or overwritten
    // already; [next, old) the last step's not yet matched, in order.
    let old = if !body.is_empty() && memo.spans.len() == outputs.len() { outputs.len() } else { 0 };
    let mut next = 0;
    memo.next_spans.clear();
    for i in 0..n {
        let from = at(c);
        let mut hit = None;
        for k in next..old.min(next + OUTPUT_LOOKAHEAD) {
            let (s, e) = memo.spans[k];
            if c.b.starts_with(&body[s..e]) {
                hit = Some((k, e - s));
                break;
            }
        }
        match hit {
            Some((k, len)) => {
                if k != i {
                    // i < k: the two are distinct elements (a swap
                    // through split halves copies no temporary).
                    let (head, tail) = outputs.split_at_mut(k);
                    std::mem::swap(&mut head[i], &mut tail[0]);
                    memo.spans.swap(i, k);
                }
                c.b = &c.b[len..];
                next = k + 1;
            }
            None => {
                if i == outputs.len() {
                    outputs.push(EngineOutput::default());
                }
                dec_output(&mut outputs[i], c, Some(&mut memo.ids))?;
                // Decoded over the last step's next unmatched output: it
                // is gone.
                if i == next {
                    next += 1;
                }
            }
        }
        memo.next_spans.push((from, at(c)));
    }
    outputs.truncate(n);
    fields!(c; outputs_total, finished_requests, truncated)?;
    let len = at(c);
    memo.body.clear();
    memo.body.extend_from_slice(&start[..len]);
    std::mem::swap(&mut memo.spans, &mut memo.next_spans);
    Ok(())
}

/// An SSE record, into the slot its id picks among `slots`' SSE ones (see
/// [`RecordDecoder::slots`]), or into `slots[SSE]` when it has no id
/// (which the caller has filled): the slot it is in.
///
/// Every chunk of a response carries its id, and the responses in flight
/// interleave, so an id is mostly one a slot was decoded with a few chunks
/// before: then the record is decoded over that slot's record with its id
/// as it is, neither validated as UTF-8 again nor copied.
fn dec_sse(slots: &mut [Option<Record>], b: &[u8]) -> Result<usize> {
    let c = &mut Cur::new(b);
    let (mut conn, mut seq, mut ts_ns, mut kind) = (ConnKey { tgid: 0, fd: 0, ino: 0 }, 0u32, 0u64, SseKind::Other);
    fields!(c; conn, seq, ts_ns, kind)?;
    let at = match c.pop()? {
        0 => SSE as usize,
        1 => {
            let n = c.len()?;
            let b = c.take(n)?;
            let at = SSE_SLOTS + recent_slot(b);
            match &mut slots[at] {
                Some(Record::Sse { id: Some(id), .. }) if id.as_bytes() == b => {}
                Some(Record::Sse { id: Some(id), .. }) => assign(id, b)?,
                other => {
                    let id = std::str::from_utf8(b).map_err(|_| Bad::UTF8)?.to_owned();
                    *other = Some(Record::Sse { conn, seq, ts_ns, kind, id: Some(id), content_bytes: 0, finish_reason: None, usage: None });
                }
            }
            at
        }
        _ => return Err(Bad::OPTION),
    };
    let Some(Record::Sse { conn: r_conn, seq: r_seq, ts_ns: r_ts_ns, kind: r_kind, id, content_bytes, finish_reason, usage }) = &mut slots[at] else {
        unreachable!("slots[SSE] holds an SSE record when called, and the others are only ever given one")
    };
    (*r_conn, *r_seq, *r_ts_ns, *r_kind) = (conn, seq, ts_ns, kind);
    if at == SSE as usize {
        *id = None;
    }
    fields!(c; content_bytes, finish_reason, usage)?;
    Ok(at)
}

/// `s` becomes the UTF-8 text `b`, copied from `recent`'s slot for `b`
/// when that holds it (no validation), else validated and left there too.
#[inline(always)]
fn assign_recent(s: &mut String, b: &[u8], recent: &mut [String]) -> Result<()> {
    let slot = &mut recent[recent_slot(b)];
    if slot.as_bytes() == b {
        s.clear();
        s.push_str(slot);
    } else {
        assign(s, b)?;
        slot.clear();
        slot.push_str(s);
    }
    Ok(())
}

/// The slot of an id among [`RECENT_IDS`]: from its length and last
/// 8 bytes (ids of one server differ at the end: counters, random hex).
#[inline]
fn recent_slot(b: &[u8]) -> usize {
    let n = b.len();
    let tail = match n.checked_sub(8) {
        Some(at) => u64::from_le_bytes(b[at..].try_into().expect("8 bytes")),
        None => b.iter().fold(0u64, |a, &x| a << 8 | u64::from(x)),
    };
    ((tail ^ n as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - RECENT_IDS.trailing_zeros())) as usize
}

/// One reusable record per variant; see the module docs.
pub struct RecordDecoder {
    /// One record per variant (by index), then [`RECENT_IDS`] SSE records
    /// with ids, each holding the last one whose id picked it (see
    /// [`dec_sse`]).
    slots: Vec<Option<Record>>,
    last: Option<usize>,
    /// What the engine-outputs slot was decoded from.
    outputs: OutputsMemo,
}

impl Default for RecordDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl RecordDecoder {
    pub fn new() -> Self {
        RecordDecoder { slots: (0..SSE_SLOTS + RECENT_IDS).map(|_| None).collect(), last: None, outputs: OutputsMemo { ids: vec![String::new(); RECENT_IDS], ..OutputsMemo::default() } }
    }

    /// The record the last successful [`decode`](Self::decode) gave.
    pub fn last(&self) -> Option<&Record> {
        self.slots.get(self.last?)?.as_ref()
    }

    /// The record in `bytes` (postcard), lent until the next call. Trailing
    /// bytes are ignored, as `postcard::from_bytes` does.
    pub fn decode(&mut self, bytes: &[u8]) -> std::result::Result<&Record, DecodeError> {
        self.last = None;
        let mut c = Cur::new(bytes);
        let tag = c.u32()?;
        if tag as usize >= VARIANTS {
            return Err(DecodeError::BadVariant { what: "Record", index: tag });
        }
        if tag == SSE && self.slots[SSE as usize].is_some() {
            return match dec_sse(&mut self.slots, c.b) {
                Ok(at) => {
                    self.last = Some(at);
                    Ok(self.slots[at].as_ref().expect("dec_sse filled it"))
                }
                Err(e) => {
                    // As for the other variants: the next SSE record
                    // starts from serde again.
                    self.slots[SSE as usize] = None;
                    Err(e.into())
                }
            };
        }
        let slot = &mut self.slots[tag as usize];
        match slot {
            Some(r) => {
                // Each path has a cursor of its own over the rest: one that
                // no call outside it sees stays in registers.
                let rest = c.b;
                let done = match tag {
                    ENGINE_OUTPUTS => dec_engine_outputs(r, rest, &mut self.outputs),
                    _ => dec_record(r, &mut Cur::new(rest)),
                };
                if let Err(e) = done {
                    // Partly overwritten: the next record of this variant
                    // starts from serde again.
                    *slot = None;
                    if tag == ENGINE_OUTPUTS {
                        self.outputs.forget();
                    }
                    return Err(e.into());
                }
            }
            None => {
                let r: Record = postcard::from_bytes(bytes).map_err(|e| DecodeError::Serde(e.to_string()))?;
                *slot = Some(r);
                if tag == ENGINE_OUTPUTS {
                    self.outputs.forget();
                }
            }
        }
        self.last = Some(tag as usize);
        Ok(slot.as_ref().expect("filled above"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ck(i: u64) -> ConnKey {
        ConnKey { tgid: 1000 + i as u32, fd: -(i as i32) - 3, ino: u64::MAX - i }
    }

    /// One record of every variant, every field distinct from its
    /// neighbours (a field decoded out of order shows as a wrong value), and
    /// `k` varying lengths and options.
    fn samples(k: u64) -> Vec<Record> {
        let s = |p: &str| format!("{p}-{k}-é\u{1F600}");
        let opt = |v: u64| if k.is_multiple_of(2) { Some(v) } else { None };
        let opts = |p: &str| if k.is_multiple_of(3) { None } else { Some(s(p)) };
        let n = (k % 4) as usize;
        let usage = Usage { prompt_tokens: Some(11 + k), completion_tokens: opt(12), cached_tokens: Some(13) };
        vec![
            Record::ConnOpen { ts_ns: 1 + k, conn: ck(k), op: ConnOp::Connect, family: Family::Inet6, local: opts("l"), peer: Some(s("p")) },
            Record::ConnClose { ts_ns: 2 + k, conn: ck(k + 1) },
            Record::HttpRequest {
                conn: ck(k + 2),
                role: HttpRole::Client,
                seq: 3,
                start_ns: 4 << 40,
                end_ns: 5 + k,
                tid: 6,
                method: s("POST"),
                path: s("/v1"),
                headers: (0..n).map(|i| (s(&format!("h{i}")), s("v"))).collect(),
                body_len: 7,
                stream: if k.is_multiple_of(2) { Some(true) } else { None },
                model: opts("m"),
                ready_ns: opt(8),
            },
            Record::HttpResponse { conn: ck(k + 3), role: HttpRole::Server, seq: 9, ts_ns: 10, tid: 11, status: 65535, headers: (0..n + 1).map(|i| (s("x"), s(&i.to_string()))).collect() },
            Record::Sse { conn: ck(k + 4), seq: 12, ts_ns: 13, kind: SseKind::Other, id: opts("id"), content_bytes: u32::MAX, finish_reason: opts("stop"), usage: if k.is_multiple_of(2) { Some(usage) } else { None } },
            Record::ResponseBody { conn: ck(k + 5), seq: 14, ts_ns: 15, id: opts("b"), usage: Some(usage), finish_reason: None },
            Record::HttpResponseEnd { conn: ck(k + 6), seq: 16, ts_ns: 17, body_len: 18 },
            Record::Unparsed { conn: ck(k + 7), ts_ns: 19, dir: Dir::Out, bytes: 20, reason: s("why") },
            Record::UnixIo { conn: ck(k + 8), ts_ns: 21, enter_ns: 22, tid: 23, dir: Dir::In, len: 24 },
            Record::Proc { ts_ns: 25, tgid: 26, op: ProcOp::Exit, child_tgid: 27, exit_code: i32::MIN + k as i32, comm: s("comm") },
            Record::OffCpu { ts_ns: 28, tgid: 29, tid: 30, off_ns: 31, wake_ns: opt(32), prev_state: 33 },
            Record::Drops { ts_ns: 34, counters: (0..n).map(|i| (s("c"), i as u64 * 1000)).collect() },
            Record::RawIo { conn: ck(k + 9), ts_ns: 35, enter_ns: 36, tid: 37, syscall: Syscall::Sendmsg, dir: Dir::Out, family: Family::Unknown, len: 38, data: (0..n * 3).map(|i| i as u8 ^ 0xa5).collect() },
            Record::EngineRequest {
                conn: ck(k + 10),
                ts_ns: 39,
                tid: 40,
                dir: Dir::Out,
                request_id: s("req"),
                external_req_id: opts("ext"),
                prompt_tokens: Some(41),
                max_tokens: opt(42),
                arrival_time_s: Some(43.5 + k as f64),
                traceparent: opts("tp"),
                data_parallel_rank: opt(44),
                truncated: k % 2 == 1,
            },
            Record::EngineAbort { conn: ck(k + 11), ts_ns: 45, tid: 46, dir: Dir::In, request_ids: (0..n).map(|i| s(&i.to_string())).collect() },
            Record::EngineOutputs {
                conn: ck(k + 12),
                ts_ns: 47,
                tid: 48,
                dir: Dir::Out,
                engine_index: opt(49),
                timestamp_s: Some(-0.0),
                outputs: (0..n + (k as usize % 7))
                    .map(|i| EngineOutput {
                        request_id: s(&format!("r{i}")),
                        new_tokens: i as u64,
                        finish_reason: if i.is_multiple_of(2) { Some(i as u8) } else { None },
                        events: (0..i % 3).map(|j| EngineEvent { kind: j as u8, timestamp_s: j as f64 * 0.25 }).collect(),
                        prefill: if i % 2 == 1 { Some(PrefillStats { prompt_tokens: Some(1), computed_tokens: None, cached_tokens: Some(3), local_cached_tokens: opt(4), external_cached_tokens: Some(5) }) } else { None },
                    })
                    .collect(),
                outputs_total: Some(50),
                finished_requests: (0..n).map(|i| s(&format!("f{i}"))).collect(),
                truncated: k.is_multiple_of(2),
            },
            Record::GpuProcess { ts_ns: 51, pid: 52, ppid: 53, own_pid: 54, comm: s("py"), cupti_version: 55, clock: 56, enabled: 57, init_ns: 58, cupti_lib: s("lib") },
            Record::GpuDevice { ts_ns: 59, pid: 60, device: 61, name: s("H200"), cc_major: 62, cc_minor: 63, sm_count: 64, total_mem_bytes: 65, driver_version: 66 },
            Record::GpuKernel {
                ts_ns: 67,
                end_ns: 68,
                pid: 69,
                device: 70,
                context: 71,
                stream: 72,
                correlation_id: 73,
                graph_id: 74,
                graph_node_id: 75,
                name: s("kern"),
                grid: [76, 77, 78 + k as u32],
                block: [79, 80, 81],
                static_shared_mem: 82,
                dynamic_shared_mem: 83,
                registers_per_thread: 84,
            },
            Record::GpuMemcpy {
                ts_ns: 85,
                end_ns: 86,
                pid: 87,
                device: 88,
                context: 89,
                stream: 90,
                kind: 91,
                src_kind: 92,
                dst_kind: 93,
                flags: 94,
                bytes: 95,
                correlation_id: 96,
                runtime_correlation_id: 97,
                graph_id: 98,
                graph_node_id: 99,
                peer: if k.is_multiple_of(2) { Some(GpuPeer { src_device: 100, src_context: 101, dst_device: 102, dst_context: 103 }) } else { None },
            },
            Record::GpuMemset { ts_ns: 104, end_ns: 105, pid: 106, device: 107, context: 108, stream: 109, bytes: 110, value: 111, memory_kind: 112, flags: 113, correlation_id: 114, graph_id: 115, graph_node_id: 116 },
            Record::GpuSync { ts_ns: 117, end_ns: 118, pid: 119, sync_type: 120, context: 121, stream: opt(122).map(|v| v as u32), correlation_id: 123, cuda_event: Some(124) },
            Record::GpuApi { ts_ns: 125, end_ns: 126, pid: 127, tid: 128, domain: 129, class: 130, cbid: 131, name: s("cudaLaunch"), correlation_id: 132, return_value: 133 },
            Record::GpuCalibration { ts_ns: 134, pid: 135, offset_ns: -136 - k as i64, error_ns: 137 },
            Record::GpuSample {
                ts_ns: 138,
                device: 139,
                mem_used_bytes: 140,
                mem_total_bytes: 141,
                process_mem: (0..n).map(|i| (i as u32, 142 + i as u64)).collect(),
                sm_util_pct: Some(143),
                mem_util_pct: opt(144).map(|v| v as u32),
                pcie_tx_kib_s: Some(145),
                pcie_rx_kib_s: None,
                nvlink_tx_kib_s: opt(146),
                nvlink_rx_kib_s: Some(147),
            },
            Record::EngineStats { conn: ck(k + 13), ts_ns: 148, engine_index: opt(149), running: Some(150), waiting: None, kv_cache_usage: Some(0.151), step_counter: opt(152), prefix_cache_queries: Some(153), prefix_cache_hits: Some(154) },
            Record::WokenWrite { ts_ns: 155, tgid: 156, tid: 157, wake_ns: 158, on_ns: 159 },
            Record::EngineRequestStart { conn: ck(k + 14), ts_ns: 160, tid: 161, dir: Dir::In, request_id: s("start"), first_ns: 162 },
            Record::ResponseModel { conn: ck(k + 15), seq: 163, ts_ns: 164, model: s("served") },
            Record::RequestLink { conn: ck(k + 16), seq: 165, ts_ns: 166, previous_response_id: s("resp") },
            Record::EngineStructuredOutput { conn: ck(k + 17), ts_ns: 167, dir: Dir::Out, request_id: s("so"), kind: s("json"), backend: Some(s("xgrammar")) },
            Record::EnginePriority { conn: ck(k + 18), ts_ns: 168, dir: Dir::Out, request_id: s("pri"), priority: -3 },
            Record::EngineConstraintKey { conn: ck(k + 19), ts_ns: 169, dir: Dir::Out, request_id: s("key"), key: u64::MAX - 170 },
            Record::NvmlDevice { ts_ns: 171, device: 172, name: s("NVIDIA H100 80GB HBM3"), driver: s("580.159.04"), mem_total_bytes: 173 },
        ]
    }

    #[test]
    fn samples_cover_every_variant_in_serde_order() {
        let all = samples(0);
        assert_eq!(all.len(), VARIANTS);
        // The decoder's own paths are picked by these indexes.
        assert!(matches!(all[SSE as usize], Record::Sse { .. }));
        assert!(matches!(all[ENGINE_OUTPUTS as usize], Record::EngineOutputs { .. }));
        for (i, r) in all.iter().enumerate() {
            assert_eq!(variant_index(r) as usize, i);
            let bytes = postcard::to_stdvec(r).unwrap();
            let mut c = Cur::new(&bytes);
            assert_eq!(c.u32().unwrap(), i as u32, "serde's index of {r:?}");
        }
    }

    #[test]
    fn field_less_enums_have_serde_indexes() {
        fn check<T: UnitIndex + serde::Serialize + std::fmt::Debug>() {
            for (i, v) in T::ALL.iter().enumerate() {
                assert_eq!(v.index() as usize, i);
                assert_eq!(postcard::to_stdvec(v).unwrap(), vec![i as u8], "{v:?}");
            }
        }
        check::<Dir>();
        check::<Family>();
        check::<ConnOp>();
        check::<ProcOp>();
        check::<Syscall>();
        check::<HttpRole>();
        check::<SseKind>();
    }

    /// Every variant, decoded again and again over its slot with lengths
    /// and options that grow and shrink, equals what serde decodes.
    #[test]
    fn reused_slots_decode_every_variant_exactly_as_serde() {
        let mut d = RecordDecoder::new();
        for k in [0u64, 5, 1, 7, 2, 0, 3, 11, 6] {
            for r in samples(k) {
                let bytes = postcard::to_stdvec(&r).unwrap();
                assert_eq!(d.decode(&bytes).unwrap(), &r);
                assert_eq!(&postcard::from_bytes::<Record>(&bytes).unwrap(), &r);
            }
        }
    }

    /// Every prefix of every sample and single-byte changes of it: the fast
    /// path and serde agree on the record or both fail.
    #[test]
    fn damaged_bytes_give_the_same_answer_as_serde() {
        let mut d = RecordDecoder::new();
        for r in samples(0).into_iter().chain(samples(1)) {
            let good = postcard::to_stdvec(&r).unwrap();
            // Prime the slot so the in-place path is the one tested.
            d.decode(&good).unwrap();
            let mut cases: Vec<Vec<u8>> = (0..good.len()).map(|n| good[..n].to_vec()).collect();
            for i in 1..good.len() {
                for v in [0x00u8, 0x01, 0x02, 0x7f, 0x80, 0xff] {
                    let mut b = good.clone();
                    b[i] = v;
                    cases.push(b);
                }
            }
            for b in cases {
                // Compared re-encoded: the same bits (a NaN is not equal to itself).
                let enc = |r: Option<&Record>| r.map(|r| postcard::to_stdvec(r).unwrap());
                let serde = postcard::from_bytes::<Record>(&b).ok();
                let fast = enc(d.decode(&b).ok());
                assert_eq!(fast, enc(serde.as_ref()), "{b:?}");
                // Back to a clean slot state for the next case.
                d.decode(&good).unwrap();
            }
        }
    }

    /// The reader's copy of a step's outputs (the same body as the writer's)
    /// and steps that differ from the last in one output, one flag, or only
    /// in trailing bytes: each equals what serde decodes, also after a
    /// failed record left the slot empty.
    #[test]
    fn engine_outputs_that_repeat_the_last_body_decode_as_serde_does() {
        let out = |id: &str, n: u64, fin: Option<u8>| EngineOutput { request_id: id.into(), new_tokens: n, finish_reason: fin, ..EngineOutput::default() };
        let step = |dir: Dir, ts: u64, outputs: Vec<EngineOutput>, truncated: bool| Record::EngineOutputs {
            conn: ck(1),
            ts_ns: ts,
            tid: if dir == Dir::Out { 7 } else { 9 },
            dir,
            engine_index: Some(0),
            timestamp_s: Some(ts as f64 / 1e9),
            outputs_total: Some(outputs.len() as u64),
            outputs,
            finished_requests: vec![],
            truncated,
        };
        let a = vec![out("req-a", 1, None), out("req-b", 1, None)];
        let b = vec![out("req-a", 1, None), out("req-b", 1, Some(1))];
        let recs = [
            step(Dir::Out, 10, a.clone(), false),
            step(Dir::In, 11, a.clone(), false),
            step(Dir::Out, 20, b.clone(), false),
            step(Dir::In, 21, b.clone(), false),
            step(Dir::In, 22, b.clone(), true),
            step(Dir::Out, 30, a.clone(), false),
            step(Dir::Out, 40, vec![], false),
            step(Dir::In, 41, vec![], false),
        ];
        let mut d = RecordDecoder::new();
        for r in &recs {
            let bytes = postcard::to_stdvec(r).unwrap();
            assert_eq!(d.decode(&bytes).unwrap(), r);
            // Trailing bytes are ignored, as serde ignores them.
            let mut longer = bytes.clone();
            longer.extend_from_slice(&[1, 2, 3]);
            assert_eq!(d.decode(&longer).unwrap(), r);
        }
        // A record cut in its body fails and empties the slot; the same
        // body then decodes in full, as serde's.
        let good = postcard::to_stdvec(&recs[0]).unwrap();
        d.decode(&good).unwrap();
        assert!(d.decode(&good[..good.len() - 3]).is_err());
        let again = postcard::to_stdvec(&recs[1]).unwrap();
        assert_eq!(d.decode(&again).unwrap(), &recs[1]);
    }

    /// SSE ids of many interleaved responses (more than the recent-id
    /// slots, so slots are shared and replaced), absent and empty ids, and
    /// an id that is not UTF-8: each decodes as serde does.
    #[test]
    fn sse_ids_from_the_recent_slots_decode_as_serde_does() {
        let sse = |id: Option<String>| Record::Sse { conn: ck(2), seq: 1, ts_ns: 5, kind: SseKind::Content, id, content_bytes: 4, finish_reason: None, usage: None };
        let mut d = RecordDecoder::new();
        for round in 0..3u64 {
            for i in 0..200u64 {
                let id = match i % 50 {
                    0 => None,
                    1 => Some(String::new()),
                    2 => Some("é\u{1F600}".to_owned()),
                    _ => Some(format!("chatcmpl-{:016x}", (i * 7 + round) % 130)),
                };
                let r = sse(id);
                let bytes = postcard::to_stdvec(&r).unwrap();
                assert_eq!(d.decode(&bytes).unwrap(), &r);
            }
        }
        // The bytes of a slot's id with one byte made invalid UTF-8.
        let good = postcard::to_stdvec(&sse(Some("chatcmpl-0000000000000001".into()))).unwrap();
        d.decode(&good).unwrap();
        let mut bad = good.clone();
        let last = bad.len() - 4;
        bad[last] = 0xff;
        assert_eq!(d.decode(&bad), Err(DecodeError::BadUtf8));
        assert!(postcard::from_bytes::<Record>(&bad).is_err());
        assert_eq!(d.decode(&good).unwrap(), &sse(Some("chatcmpl-0000000000000001".into())));
    }

    /// The word-at-a-time varint paths against the byte loop, on varints of
    /// every length for each width (valid, overlong, cut short), followed
    /// by 0 to 11 more bytes: the same value and length, or the same error.
    #[test]
    fn varints_read_from_one_word_agree_with_the_byte_loop() {
        fn check<const BITS: u32>(b: &[u8]) {
            let mut c = Cur::new(b);
            let fast = c.varint::<BITS>().map(|v| (v, b.len() - c.b.len()));
            assert_eq!(fast, varint_bytes::<BITS>(b), "{BITS} bits: {b:?}");
        }
        let mut rng = crate::testutil::xorshift(0x005e_ed0f_5a11);
        let mut cases = 0;
        for _ in 0..20_000 {
            let r = rng();
            let len = 1 + (r % 11) as usize;
            let mut b: Vec<u8> = (0..len).map(|_| (rng() as u8) | 0x80).collect();
            // Mostly a proper last byte, sometimes none (a cut or overlong varint).
            if r >> 8 & 7 != 0 {
                b[len - 1] &= 0x7f;
            }
            for _ in 0..(r >> 16) % 12 {
                b.push(rng() as u8);
            }
            check::<16>(&b);
            check::<32>(&b);
            check::<64>(&b);
            cases += 1;
        }
        for v in [0u64, 127, 128, 16_383, 16_384, (1 << 21) - 1, 1 << 21, u64::from(u16::MAX), u64::from(u32::MAX), 1 << 49, (1 << 56) - 1, 1 << 56, u64::MAX] {
            let mut b = postcard::to_stdvec(&v).unwrap();
            b.extend_from_slice(&[0x81; 9]);
            for end in 1..=b.len() {
                check::<16>(&b[..end]);
                check::<32>(&b[..end]);
                check::<64>(&b[..end]);
            }
            let mut c = Cur::new(&b);
            assert_eq!(c.varint::<64>(), Ok(v));
        }
        assert_eq!(cases, 20_000);
    }

    /// Steps of a batch whose members finish (anywhere in it), join
    /// (anywhere), move, change a field or repeat, each recorded twice, and
    /// now and then a damaged copy: every record equals what serde decodes
    /// (or both fail), whichever outputs are matched to the last step's.
    #[test]
    fn engine_output_steps_that_reorder_join_and_finish_decode_as_serde_does() {
        let mut rng = crate::testutil::xorshift(0x0ba7_c4e5);
        let mut d = RecordDecoder::new();
        let mut batch: Vec<EngineOutput> = Vec::new();
        let mut next_id = 0u64;
        let (mut decoded, mut failed) = (0, 0);
        for step in 0..3_000u64 {
            for _ in 0..rng() % 3 {
                if !batch.is_empty() {
                    let at = (rng() % batch.len() as u64) as usize;
                    batch.remove(at);
                }
            }
            for _ in 0..rng() % 3 {
                let at = (rng() % (batch.len() as u64 + 1)) as usize;
                next_id += 1;
                let prefill = rng().is_multiple_of(2).then(|| PrefillStats { prompt_tokens: Some(rng() % 300), computed_tokens: None, cached_tokens: Some(16), local_cached_tokens: None, external_cached_tokens: None });
                let events = (0..rng() % 3).map(|j| EngineEvent { kind: j as u8, timestamp_s: step as f64 }).collect();
                batch.insert(at, EngineOutput { request_id: format!("chatcmpl-{next_id:016x}-{:08x}", rng() as u32), new_tokens: 1, finish_reason: None, events, prefill });
            }
            for o in batch.iter_mut() {
                match rng() % 8 {
                    0 => o.new_tokens = rng() % 300,
                    1 => o.finish_reason = Some((rng() % 5) as u8),
                    2 => {
                        o.events.clear();
                        o.prefill = None;
                    }
                    _ => {}
                }
            }
            if batch.len() > 1 && rng().is_multiple_of(10) {
                let (a, b) = ((rng() % batch.len() as u64) as usize, (rng() % batch.len() as u64) as usize);
                batch.swap(a, b);
            }
            let rec = |dir: Dir, ts: u64| Record::EngineOutputs {
                conn: ck(1),
                ts_ns: ts,
                tid: 7,
                dir,
                engine_index: Some(0),
                timestamp_s: Some(ts as f64),
                outputs: batch.clone(),
                outputs_total: Some(batch.len() as u64),
                finished_requests: vec![],
                truncated: false,
            };
            for (dir, ts) in [(Dir::Out, 2 * step), (Dir::In, 2 * step + 1)] {
                let mut bytes = postcard::to_stdvec(&rec(dir, ts)).unwrap();
                if rng().is_multiple_of(40) {
                    let at = 1 + (rng() % (bytes.len() as u64 - 1)) as usize;
                    match rng() % 3 {
                        0 => bytes.truncate(at),
                        1 => bytes[at] = 0xff,
                        _ => bytes[at] ^= 0x01,
                    }
                }
                let enc = |r: Option<&Record>| r.map(|r| postcard::to_stdvec(r).unwrap());
                let serde = postcard::from_bytes::<Record>(&bytes).ok();
                let fast = enc(d.decode(&bytes).ok());
                assert_eq!(fast, enc(serde.as_ref()), "step {step}: {bytes:?}");
                if fast.is_some() {
                    decoded += 1;
                } else {
                    failed += 1;
                }
            }
        }
        assert!(decoded > 5_000 && failed > 20, "{decoded} decoded, {failed} failed");
    }

    /// An unknown enum index comes back as the error of the same name, the
    /// enum named, from the field decoders' one-word form.
    #[test]
    fn unknown_enum_indexes_name_their_enum() {
        for (i, w) in What::ALL.into_iter().enumerate() {
            assert_eq!(w as usize, i);
            assert_eq!(DecodeError::from(Bad::variant(w, u32::MAX - i as u32)), DecodeError::BadVariant { what: w.name(), index: u32::MAX - i as u32 });
        }
        let sse = Record::Sse { conn: ck(2), seq: 1, ts_ns: 5, kind: SseKind::Content, id: Some("chatcmpl-1".into()), content_bytes: 4, finish_reason: None, usage: None };
        let good = postcard::to_stdvec(&sse).unwrap();
        let mut d = RecordDecoder::new();
        d.decode(&good).unwrap();
        // The kind follows the tag, the connection (3 one- or multi-byte
        // varints), seq and ts.
        let mut bad = good.clone();
        let at = good.len() - (1 + 1 + 1 + 10 + 1 + 1 + 1);
        assert_eq!(bad[at], 1, "the kind's byte: {good:?}");
        bad[at] = 9;
        assert_eq!(d.decode(&bad), Err(DecodeError::BadVariant { what: "SseKind", index: 9 }));
        assert_eq!(d.decode(&good).unwrap(), &sse);
    }

    #[test]
    fn varints_past_their_type_are_errors() {
        let mut c = Cur::new(&[0xff, 0xff, 0xff, 0xff, 0x10]);
        assert_eq!(c.u32(), Err(Bad::VARINT));
        let mut c = Cur::new(&[0xff, 0xff, 0xff, 0xff, 0x0f]);
        assert_eq!(c.u32(), Ok(u32::MAX));
        let mut c = Cur::new(&[0xff; 10]);
        assert_eq!(c.varint::<64>(), Err(Bad::VARINT));
        let mut c = Cur::new(&[0x80]);
        assert_eq!(c.u32(), Err(Bad::EOF));
    }
}
