//! Ring-buffer sample → [`KEvent`]: lengths and tags are checked before any
//! byte is trusted. Offsets come only from `hopscope_ebpf::layout`, which the
//! build script measures from `hopscope.h`; nothing here is hand-copied.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use hopscope_ebpf::layout::*;

use crate::event::{
    Burst, CloseEvent, ConnEvent, ConnKey, ConnOp, Dir, Family, IoEvent, KEvent, ProcEvent, ProcOp, SchedEvent,
    Syscall,
};

/// Why a ring-buffer sample was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("record too short: {len} bytes, a {what} needs at least {need}")]
    Short { what: &'static str, len: usize, need: usize },
    #[error("record size field says {header} bytes but the sample has {sample}")]
    SizeMismatch { header: u32, sample: usize },
    #[error("{what} has {len} bytes, expected exactly {expected}")]
    WrongLength { what: &'static str, len: usize, expected: usize },
    #[error("unknown record kind {0}")]
    UnknownKind(u8),
    #[error("unknown {field} tag {value}")]
    UnknownTag { field: &'static str, value: u32 },
    #[error("captured length {cap_len} exceeds the maximum capture {max}")]
    CaptureTooLong { cap_len: u32, max: u32 },
    #[error("captured length {cap_len} does not match the {room} data bytes after the header")]
    CaptureMismatch { cap_len: u32, room: usize },
    #[error("captured {cap_len} bytes but the syscall moved only {ret}")]
    CaptureExceedsRet { cap_len: u32, ret: i64 },
    #[error("tail of {tail_len} bytes on a record that may not carry one (at most {max}, no failed copy)")]
    TailInvalid { tail_len: u32, max: u32 },
    #[error("io record with non-positive return value {0}")]
    IoReturn(i64),
    #[error("io record with unknown flag bits {0:#x}")]
    UnknownFlags(u32),
    #[error("io record marks a failed copy but carries {0} bytes")]
    CopyFailedWithData(u32),
    #[error("direction {dir:?} does not match syscall {syscall:?}")]
    DirMismatch { syscall: Syscall, dir: Dir },
}

/// Bounds-checked little readers. Every caller first checks the record length
/// against the struct size from `layout`, so `None` here is unreachable for
/// validated records; it still becomes an error rather than a panic.
struct Rec<'a> {
    b: &'a [u8],
    what: &'static str,
}

impl<'a> Rec<'a> {
    fn new(b: &'a [u8], what: &'static str, need: usize) -> Result<Self, DecodeError> {
        if b.len() < need {
            return Err(DecodeError::Short { what, len: b.len(), need });
        }
        Ok(Rec { b, what })
    }

    /// A fixed-size record: shorter is `Short`, longer is `WrongLength`.
    fn exact(b: &'a [u8], what: &'static str, size: usize) -> Result<Self, DecodeError> {
        let r = Self::new(b, what, size)?;
        if b.len() != size {
            return Err(DecodeError::WrongLength { what, len: b.len(), expected: size });
        }
        Ok(r)
    }

    fn bytes<const N: usize>(&self, off: usize) -> Result<[u8; N], DecodeError> {
        self.b.get(off..off + N).and_then(|s| <[u8; N]>::try_from(s).ok()).ok_or(DecodeError::Short {
            what: self.what,
            len: self.b.len(),
            need: off + N,
        })
    }

    fn u8(&self, off: usize) -> Result<u8, DecodeError> {
        Ok(self.bytes::<1>(off)?[0])
    }
    fn u16(&self, off: usize) -> Result<u16, DecodeError> {
        Ok(u16::from_ne_bytes(self.bytes(off)?))
    }
    fn u32(&self, off: usize) -> Result<u32, DecodeError> {
        Ok(u32::from_ne_bytes(self.bytes(off)?))
    }
    fn i32(&self, off: usize) -> Result<i32, DecodeError> {
        Ok(i32::from_ne_bytes(self.bytes(off)?))
    }
    fn u64(&self, off: usize) -> Result<u64, DecodeError> {
        Ok(u64::from_ne_bytes(self.bytes(off)?))
    }
    fn i64(&self, off: usize) -> Result<i64, DecodeError> {
        Ok(i64::from_ne_bytes(self.bytes(off)?))
    }
}

/// The common header, already validated against the sample length.
struct Hdr {
    ts_ns: u64,
    tgid: u32,
    tid: u32,
}

fn header(b: &[u8]) -> Result<(Hdr, u8), DecodeError> {
    let r = Rec::new(b, "header", HS_HDR_SIZE)?;
    let size = r.u32(HS_HDR_OFF_SIZE)?;
    if size as usize != b.len() {
        return Err(DecodeError::SizeMismatch { header: size, sample: b.len() });
    }
    let hdr = Hdr { ts_ns: r.u64(HS_HDR_OFF_TS_NS)?, tgid: r.u32(HS_HDR_OFF_TGID)?, tid: r.u32(HS_HDR_OFF_TID)? };
    Ok((hdr, r.u8(HS_HDR_OFF_KIND)?))
}

fn syscall_tag(v: u16) -> Result<Syscall, DecodeError> {
    Ok(match u32::from(v) {
        HS_SYS_READ => Syscall::Read,
        HS_SYS_READV => Syscall::Readv,
        HS_SYS_RECVFROM => Syscall::Recvfrom,
        HS_SYS_RECVMSG => Syscall::Recvmsg,
        HS_SYS_WRITE => Syscall::Write,
        HS_SYS_WRITEV => Syscall::Writev,
        HS_SYS_SENDTO => Syscall::Sendto,
        HS_SYS_SENDMSG => Syscall::Sendmsg,
        other => return Err(DecodeError::UnknownTag { field: "syscall", value: other }),
    })
}

fn dir_tag(v: u8) -> Result<Dir, DecodeError> {
    Ok(match u32::from(v) {
        HS_DIR_IN => Dir::In,
        HS_DIR_OUT => Dir::Out,
        other => return Err(DecodeError::UnknownTag { field: "dir", value: other }),
    })
}

/// 0 is "unknown" (the kernel side maps every family it does not name to 0).
fn family_tag(v: u16) -> Result<Family, DecodeError> {
    Ok(match u32::from(v) {
        0 => Family::Unknown,
        HS_AF_UNIX => Family::Unix,
        HS_AF_INET => Family::Inet,
        HS_AF_INET6 => Family::Inet6,
        other => return Err(DecodeError::UnknownTag { field: "family", value: other }),
    })
}

fn syscall_dir(s: Syscall) -> Dir {
    match s {
        Syscall::Read | Syscall::Readv | Syscall::Recvfrom | Syscall::Recvmsg => Dir::In,
        Syscall::Write | Syscall::Writev | Syscall::Sendto | Syscall::Sendmsg => Dir::Out,
    }
}

fn decode_io(b: &[u8], h: Hdr) -> Result<IoEvent, DecodeError> {
    let r = Rec::new(b, "io record", HS_IO_SIZE)?;
    let cap_len = r.u32(HS_IO_OFF_CAP_LEN)?;
    if cap_len > HS_MAX_CAPTURE {
        return Err(DecodeError::CaptureTooLong { cap_len, max: HS_MAX_CAPTURE });
    }
    let tail_len = r.u32(HS_IO_OFF_TAIL_LEN)?;
    if tail_len > HS_MAX_TAIL {
        return Err(DecodeError::TailInvalid { tail_len, max: HS_MAX_TAIL });
    }
    // The prefix, then the tail: the record's data bytes exactly.
    let room = b.len() - HS_IO_OFF_DATA;
    if cap_len as usize + tail_len as usize != room {
        return Err(DecodeError::CaptureMismatch { cap_len: cap_len + tail_len, room });
    }
    let syscall = syscall_tag(r.u16(HS_IO_OFF_SYSCALL)?)?;
    let dir = dir_tag(r.u8(HS_IO_OFF_DIR)?)?;
    if dir != syscall_dir(syscall) {
        return Err(DecodeError::DirMismatch { syscall, dir });
    }
    let family = family_tag(u16::from(r.u8(HS_IO_OFF_FAMILY)?))?;
    let flags = r.u32(HS_IO_OFF_FLAGS)?;
    if flags & !(HS_IO_TRUNCATED | HS_IO_COPY_FAILED) != 0 {
        return Err(DecodeError::UnknownFlags(flags));
    }
    let copy_failed = flags & HS_IO_COPY_FAILED != 0;
    if copy_failed && cap_len != 0 {
        return Err(DecodeError::CopyFailedWithData(cap_len));
    }
    // The probe copies a tail only out of buffers it could read.
    if tail_len != 0 && copy_failed {
        return Err(DecodeError::TailInvalid { tail_len, max: HS_MAX_TAIL });
    }
    let ret = r.i64(HS_IO_OFF_RET)?;
    if ret <= 0 {
        return Err(DecodeError::IoReturn(ret));
    }
    if i64::from(cap_len) + i64::from(tail_len) > ret {
        return Err(DecodeError::CaptureExceedsRet { cap_len: cap_len + tail_len, ret });
    }
    let tail_at = HS_IO_OFF_DATA + cap_len as usize;
    Ok(IoEvent {
        ts_ns: h.ts_ns,
        enter_ns: r.u64(HS_IO_OFF_ENTER_NS)?,
        wire_ns: match r.u64(HS_IO_OFF_WIRE_NS)? {
            0 => None,
            t => Some(t),
        },
        tid: h.tid,
        conn: ConnKey { tgid: h.tgid, fd: r.i32(HS_IO_OFF_FD)?, ino: r.u64(HS_IO_OFF_SOCK_INO)? },
        syscall,
        dir,
        family,
        len: ret as u64,
        data: b[HS_IO_OFF_DATA..tail_at].to_vec(),
        tail: b[tail_at..].to_vec(),
        copy_failed,
        // A wake-up after its switch-in, or a burst after the syscall, is
        // not one this write came in: kept apart (and counted), not trusted.
        burst: match (r.u64(HS_IO_OFF_BURST_WAKE_NS)?, r.u64(HS_IO_OFF_BURST_ON_NS)?) {
            (0, 0) => Burst::NoSleep,
            (_, on) if on > h.ts_ns => Burst::Implausible,
            (0, _) => Burst::WakeUnseen,
            (w, on) if w <= on => Burst::Woken { wake_ns: w, on_ns: on },
            _ => Burst::Implausible,
        },
    })
}

fn sock_addr(family: Family, addr: [u8; 16], port: u16) -> Option<SocketAddr> {
    let ip = match family {
        Family::Inet => IpAddr::V4(Ipv4Addr::new(addr[0], addr[1], addr[2], addr[3])),
        Family::Inet6 => IpAddr::V6(Ipv6Addr::from(addr)),
        Family::Unix | Family::Unknown => return None,
    };
    Some(SocketAddr::new(ip, port))
}

fn decode_conn(b: &[u8], h: Hdr) -> Result<ConnEvent, DecodeError> {
    let r = Rec::exact(b, "conn record", HS_CONN_SIZE)?;
    let op = match u32::from(r.u16(HS_CONN_OFF_OP)?) {
        HS_CONN_ACCEPT => ConnOp::Accept,
        HS_CONN_CONNECT => ConnOp::Connect,
        other => return Err(DecodeError::UnknownTag { field: "conn op", value: other }),
    };
    let family = family_tag(r.u16(HS_CONN_OFF_FAMILY)?)?;
    let ino = r.u64(HS_CONN_OFF_SOCK_INO)?;
    let (local, peer) = if ino == 0 {
        (None, None)
    } else {
        (
            sock_addr(family, r.bytes(HS_CONN_OFF_LOCAL_ADDR)?, r.u16(HS_CONN_OFF_LOCAL_PORT)?),
            sock_addr(family, r.bytes(HS_CONN_OFF_PEER_ADDR)?, r.u16(HS_CONN_OFF_PEER_PORT)?),
        )
    };
    Ok(ConnEvent {
        ts_ns: h.ts_ns,
        enter_ns: r.u64(HS_CONN_OFF_ENTER_NS)?,
        tid: h.tid,
        conn: ConnKey { tgid: h.tgid, fd: r.i32(HS_CONN_OFF_FD)?, ino },
        op,
        family,
        ret: r.i64(HS_CONN_OFF_RET)?,
        local,
        peer,
    })
}

fn decode_close(b: &[u8], h: Hdr) -> Result<CloseEvent, DecodeError> {
    let r = Rec::exact(b, "close record", HS_CLOSE_SIZE)?;
    Ok(CloseEvent {
        ts_ns: h.ts_ns,
        tid: h.tid,
        conn: ConnKey { tgid: h.tgid, fd: r.i32(HS_CLOSE_OFF_FD)?, ino: r.u64(HS_CLOSE_OFF_SOCK_INO)? },
    })
}

fn decode_proc(b: &[u8], h: Hdr) -> Result<ProcEvent, DecodeError> {
    let r = Rec::exact(b, "proc record", HS_PROC_SIZE)?;
    let op = match u32::from(r.u16(HS_PROC_OFF_OP)?) {
        HS_PROC_FORK => ProcOp::Fork,
        HS_PROC_EXEC => ProcOp::Exec,
        HS_PROC_EXIT => ProcOp::Exit,
        other => return Err(DecodeError::UnknownTag { field: "proc op", value: other }),
    };
    let comm: [u8; HS_PROC_SIZEOF_COMM] = r.bytes(HS_PROC_OFF_COMM)?;
    let end = comm.iter().position(|&c| c == 0).unwrap_or(comm.len());
    Ok(ProcEvent {
        ts_ns: h.ts_ns,
        tgid: h.tgid,
        tid: h.tid,
        op,
        child_tgid: r.u32(HS_PROC_OFF_CHILD_TGID)?,
        exit_code: r.i32(HS_PROC_OFF_EXIT_CODE)?,
        comm: String::from_utf8_lossy(&comm[..end]).into_owned(),
    })
}

fn decode_sched(b: &[u8], h: Hdr) -> Result<SchedEvent, DecodeError> {
    let r = Rec::exact(b, "sched record", HS_SCHED_SIZE)?;
    let wake_ns = r.u64(HS_SCHED_OFF_WAKE_NS)?;
    Ok(SchedEvent {
        ts_ns: h.ts_ns,
        tgid: h.tgid,
        tid: h.tid,
        off_ns: r.u64(HS_SCHED_OFF_OFF_NS)?,
        wake_ns: (wake_ns != 0).then_some(wake_ns),
        prev_state: r.u32(HS_SCHED_OFF_PREV_STATE)?,
        cpu: r.u32(HS_SCHED_OFF_CPU)?,
    })
}

impl TryFrom<&[u8]> for KEvent {
    type Error = DecodeError;

    /// Decodes one ring-buffer sample (exactly one record).
    fn try_from(b: &[u8]) -> Result<Self, DecodeError> {
        let (h, kind) = header(b)?;
        Ok(match u32::from(kind) {
            HS_KIND_IO => KEvent::Io(decode_io(b, h)?),
            HS_KIND_CONN => KEvent::Conn(decode_conn(b, h)?),
            HS_KIND_CLOSE => KEvent::Close(decode_close(b, h)?),
            HS_KIND_PROC => KEvent::Proc(decode_proc(b, h)?),
            HS_KIND_SCHED => KEvent::Sched(decode_sched(b, h)?),
            _ => return Err(DecodeError::UnknownKind(kind)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds records the way the kernel lays them out, using the same offsets.
    struct Builder(Vec<u8>);

    impl Builder {
        fn new(size: usize, kind: u32) -> Self {
            let mut b = Builder(vec![0; size]);
            b.u64(HS_HDR_OFF_TS_NS, 1_000);
            b.u32(HS_HDR_OFF_TGID, 42);
            b.u32(HS_HDR_OFF_TID, 43);
            b.u32(HS_HDR_OFF_SIZE, size as u32);
            b.0[HS_HDR_OFF_KIND] = kind as u8;
            b
        }
        fn put(&mut self, off: usize, v: &[u8]) {
            self.0[off..off + v.len()].copy_from_slice(v);
        }
        fn u16(&mut self, off: usize, v: u16) {
            self.put(off, &v.to_ne_bytes());
        }
        fn u32(&mut self, off: usize, v: u32) {
            self.put(off, &v.to_ne_bytes());
        }
        fn u64(&mut self, off: usize, v: u64) {
            self.put(off, &v.to_ne_bytes());
        }
    }

    fn io_record(payload: &[u8], ret: i64, syscall: u32, dir: u32) -> Vec<u8> {
        let size = HS_IO_SIZE + payload.len();
        let mut b = Builder::new(size, HS_KIND_IO);
        b.u64(HS_IO_OFF_ENTER_NS, 900);
        b.u64(HS_IO_OFF_SOCK_INO, 777);
        b.u64(HS_IO_OFF_RET, ret as u64);
        b.u32(HS_IO_OFF_FD, 5);
        b.u32(HS_IO_OFF_CAP_LEN, payload.len() as u32);
        b.u16(HS_IO_OFF_SYSCALL, syscall as u16);
        b.0[HS_IO_OFF_DIR] = dir as u8;
        b.0[HS_IO_OFF_FAMILY] = HS_AF_INET as u8;
        b.put(HS_IO_OFF_DATA, payload);
        b.0
    }

    fn decode(b: &[u8]) -> Result<KEvent, DecodeError> {
        KEvent::try_from(b)
    }

    #[test]
    fn io_record_decodes_payload_and_connection_key() {
        let rec = io_record(b"GET / HTTP/1.1\r\n", 100, HS_SYS_RECVFROM, HS_DIR_IN);
        let KEvent::Io(io) = decode(&rec).unwrap() else { panic!("not an io event") };
        assert_eq!(io.ts_ns, 1_000);
        assert_eq!(io.enter_ns, 900);
        assert_eq!(io.tid, 43);
        assert_eq!(io.conn, ConnKey { tgid: 42, fd: 5, ino: 777 });
        assert_eq!(io.syscall, Syscall::Recvfrom);
        assert_eq!(io.dir, Dir::In);
        assert_eq!(io.family, Family::Inet);
        assert_eq!(io.len, 100);
        assert_eq!(io.data, b"GET / HTTP/1.1\r\n");
        assert_eq!(io.gap(), 100 - 16);
        assert!(!io.copy_failed);
    }

    #[test]
    fn a_writes_burst_is_trusted_only_when_its_wake_up_and_switch_in_precede_the_write() {
        let burst = |wake: u64, on: u64| {
            let mut rec = io_record(b"x", 1, HS_SYS_SENDTO, HS_DIR_OUT);
            rec[HS_IO_OFF_BURST_WAKE_NS..HS_IO_OFF_BURST_WAKE_NS + 8].copy_from_slice(&wake.to_ne_bytes());
            rec[HS_IO_OFF_BURST_ON_NS..HS_IO_OFF_BURST_ON_NS + 8].copy_from_slice(&on.to_ne_bytes());
            let KEvent::Io(io) = decode(&rec).unwrap() else { panic!("not an io event") };
            io.burst
        };
        // The record's ts_ns (the write's exit) is 1000.
        assert_eq!(burst(500, 600), Burst::Woken { wake_ns: 500, on_ns: 600 });
        assert_eq!(burst(600, 1_000), Burst::Woken { wake_ns: 600, on_ns: 1_000 });
        assert_eq!(burst(0, 0), Burst::NoSleep, "not seen");
        assert_eq!(burst(0, 600), Burst::WakeUnseen, "a sleep whose wake-up was not seen");
        assert_eq!(burst(700, 600), Burst::Implausible, "woken after its switch-in");
        assert_eq!(burst(500, 1_001), Burst::Implausible, "a burst that began after the write");
        assert_eq!(burst(0, 1_001), Burst::Implausible, "a switch-in after the write");
    }

    #[test]
    fn record_shorter_than_header_is_rejected() {
        let rec = io_record(b"", 1, HS_SYS_READ, HS_DIR_IN);
        assert!(matches!(decode(&rec[..HS_HDR_SIZE - 1]), Err(DecodeError::Short { what: "header", .. })));
        assert!(matches!(decode(&[]), Err(DecodeError::Short { .. })));
    }

    #[test]
    fn record_shorter_than_its_struct_is_rejected() {
        let mut b = Builder::new(HS_IO_SIZE - 8, HS_KIND_IO);
        b.u32(HS_HDR_OFF_SIZE, (HS_IO_SIZE - 8) as u32);
        assert!(matches!(decode(&b.0), Err(DecodeError::Short { what: "io record", .. })));
        let b = Builder::new(HS_SCHED_SIZE - 1, HS_KIND_SCHED);
        assert!(matches!(decode(&b.0), Err(DecodeError::Short { what: "sched record", .. })));
    }

    #[test]
    fn size_field_that_disagrees_with_the_sample_is_rejected() {
        let mut rec = io_record(b"abc", 3, HS_SYS_WRITE, HS_DIR_OUT);
        rec.push(0);
        assert_eq!(
            decode(&rec),
            Err(DecodeError::SizeMismatch { header: (HS_IO_SIZE + 3) as u32, sample: HS_IO_SIZE + 4 })
        );
    }

    #[test]
    fn unknown_kind_is_rejected() {
        let b = Builder::new(HS_SCHED_SIZE, 99);
        assert_eq!(decode(&b.0), Err(DecodeError::UnknownKind(99)));
    }

    #[test]
    fn unknown_syscall_dir_and_family_tags_are_rejected() {
        let rec = io_record(b"x", 1, 77, HS_DIR_IN);
        assert_eq!(decode(&rec), Err(DecodeError::UnknownTag { field: "syscall", value: 77 }));
        let rec = io_record(b"x", 1, HS_SYS_READ, 9);
        assert_eq!(decode(&rec), Err(DecodeError::UnknownTag { field: "dir", value: 9 }));
        let mut rec = io_record(b"x", 1, HS_SYS_READ, HS_DIR_IN);
        rec[HS_IO_OFF_FAMILY] = 16;
        assert_eq!(decode(&rec), Err(DecodeError::UnknownTag { field: "family", value: 16 }));
    }

    #[test]
    fn direction_that_contradicts_the_syscall_is_rejected() {
        let rec = io_record(b"x", 1, HS_SYS_WRITE, HS_DIR_IN);
        assert_eq!(decode(&rec), Err(DecodeError::DirMismatch { syscall: Syscall::Write, dir: Dir::In }));
    }

    #[test]
    fn cap_len_above_the_maximum_capture_is_rejected() {
        let mut rec = io_record(b"abcd", 10_000, HS_SYS_WRITE, HS_DIR_OUT);
        let huge = HS_MAX_CAPTURE + 1;
        rec[HS_IO_OFF_CAP_LEN..HS_IO_OFF_CAP_LEN + 4].copy_from_slice(&huge.to_ne_bytes());
        assert_eq!(decode(&rec), Err(DecodeError::CaptureTooLong { cap_len: huge, max: HS_MAX_CAPTURE }));
    }

    #[test]
    fn a_capture_of_the_full_maximum_decodes_and_says_what_is_left() {
        assert_eq!(HS_MAX_CAPTURE, 32768);
        let payload: Vec<u8> = (0..HS_MAX_CAPTURE).map(|i| (i % 251) as u8).collect();
        let mut rec = io_record(&payload, 40_000, HS_SYS_WRITE, HS_DIR_OUT);
        rec[HS_IO_OFF_FAMILY] = HS_AF_UNIX as u8;
        let Ok(KEvent::Io(io)) = decode(&rec) else { panic!("{:?}", decode(&rec)) };
        assert_eq!((io.family, io.len, io.data.len(), io.gap()), (Family::Unix, 40_000, 32768, 7232));
        assert_eq!(io.data, payload);
    }

    /// A unix record with `head` then `tail` of a `ret`-byte transfer.
    fn unix_record(head: &[u8], tail: &[u8], ret: i64) -> Vec<u8> {
        let mut rec = io_record(&[head, tail].concat(), ret, HS_SYS_SENDTO, HS_DIR_OUT);
        rec[HS_IO_OFF_FAMILY] = HS_AF_UNIX as u8;
        rec[HS_IO_OFF_CAP_LEN..HS_IO_OFF_CAP_LEN + 4].copy_from_slice(&(head.len() as u32).to_ne_bytes());
        rec[HS_IO_OFF_TAIL_LEN..HS_IO_OFF_TAIL_LEN + 4].copy_from_slice(&(tail.len() as u32).to_ne_bytes());
        rec
    }

    #[test]
    fn a_long_unix_transfer_decodes_its_prefix_its_tail_and_the_gap_between() {
        let rec = unix_record(b"head", b"tail!", 1_000);
        let Ok(KEvent::Io(io)) = decode(&rec) else { panic!("{:?}", decode(&rec)) };
        assert_eq!((io.data.as_slice(), io.tail.as_slice(), io.gap()), (&b"head"[..], &b"tail!"[..], 1_000 - 9));
        // Prefix and tail may meet: nothing in between.
        let Ok(KEvent::Io(io)) = decode(&unix_record(b"ab", b"cd", 4)) else { panic!() };
        assert_eq!((io.data.len(), io.tail.len(), io.gap()), (2, 2, 0));
    }

    #[test]
    fn a_tail_that_is_too_long_overlaps_the_prefix_or_follows_a_failed_copy_is_rejected() {
        let big = vec![7u8; HS_MAX_TAIL as usize + 1];
        assert!(matches!(decode(&unix_record(b"h", &big, 100_000)), Err(DecodeError::TailInvalid { .. })));
        assert_eq!(decode(&unix_record(b"abc", b"de", 4)), Err(DecodeError::CaptureExceedsRet { cap_len: 5, ret: 4 }));
        // TCP transfers carry tails too (an HTTP body's last members)...
        let mut tcp = unix_record(b"abc", b"de", 100);
        tcp[HS_IO_OFF_FAMILY] = HS_AF_INET as u8;
        let Ok(KEvent::Io(io)) = decode(&tcp) else { panic!("{:?}", decode(&tcp)) };
        assert_eq!((io.family, io.tail.as_slice(), io.gap()), (Family::Inet, &b"de"[..], 95));
        // ...and so do vectored ones (hyper's writev of an SSE burst)...
        let mut iov = unix_record(b"abc", b"de", 100);
        iov[HS_IO_OFF_SYSCALL..HS_IO_OFF_SYSCALL + 2].copy_from_slice(&(HS_SYS_SENDMSG as u16).to_ne_bytes());
        let Ok(KEvent::Io(io)) = decode(&iov) else { panic!("{:?}", decode(&iov)) };
        assert_eq!((io.syscall, io.tail.as_slice(), io.gap()), (Syscall::Sendmsg, &b"de"[..], 95));
        // ...but never after a copy that failed (it carries no bytes).
        let mut failed = unix_record(b"", b"de", 100);
        failed[HS_IO_OFF_FLAGS..HS_IO_OFF_FLAGS + 4].copy_from_slice(&HS_IO_COPY_FAILED.to_ne_bytes());
        assert!(matches!(decode(&failed), Err(DecodeError::TailInvalid { tail_len: 2, .. })));
        // The tail's length must account for the record's last bytes.
        let mut rec = unix_record(b"abc", b"de", 100);
        rec[HS_IO_OFF_TAIL_LEN..HS_IO_OFF_TAIL_LEN + 4].copy_from_slice(&3u32.to_ne_bytes());
        assert_eq!(decode(&rec), Err(DecodeError::CaptureMismatch { cap_len: 6, room: 5 }));
    }

    #[test]
    fn cap_len_that_overruns_the_record_is_rejected() {
        let mut rec = io_record(b"abcd", 100, HS_SYS_WRITE, HS_DIR_OUT);
        rec[HS_IO_OFF_CAP_LEN..HS_IO_OFF_CAP_LEN + 4].copy_from_slice(&5u32.to_ne_bytes());
        assert_eq!(decode(&rec), Err(DecodeError::CaptureMismatch { cap_len: 5, room: 4 }));
    }

    #[test]
    fn cap_len_larger_than_bytes_moved_is_rejected() {
        let rec = io_record(b"abcd", 3, HS_SYS_WRITE, HS_DIR_OUT);
        assert_eq!(decode(&rec), Err(DecodeError::CaptureExceedsRet { cap_len: 4, ret: 3 }));
    }

    #[test]
    fn io_with_non_positive_return_is_rejected() {
        let rec = io_record(b"", -11, HS_SYS_READ, HS_DIR_IN);
        assert_eq!(decode(&rec), Err(DecodeError::IoReturn(-11)));
    }

    #[test]
    fn io_flags_decode_truncation_and_copy_failure() {
        let mut rec = io_record(b"ab", 1000, HS_SYS_SENDTO, HS_DIR_OUT);
        rec[HS_IO_OFF_FLAGS..HS_IO_OFF_FLAGS + 4].copy_from_slice(&HS_IO_TRUNCATED.to_ne_bytes());
        let KEvent::Io(io) = decode(&rec).unwrap() else { panic!("not io") };
        assert_eq!(io.gap(), 998);

        let mut rec = io_record(b"", 1000, HS_SYS_SENDTO, HS_DIR_OUT);
        rec[HS_IO_OFF_FLAGS..HS_IO_OFF_FLAGS + 4].copy_from_slice(&HS_IO_COPY_FAILED.to_ne_bytes());
        let KEvent::Io(io) = decode(&rec).unwrap() else { panic!("not io") };
        assert!(io.copy_failed);

        let mut rec = io_record(b"ab", 1000, HS_SYS_SENDTO, HS_DIR_OUT);
        rec[HS_IO_OFF_FLAGS..HS_IO_OFF_FLAGS + 4].copy_from_slice(&HS_IO_COPY_FAILED.to_ne_bytes());
        assert_eq!(decode(&rec), Err(DecodeError::CopyFailedWithData(2)));

        let mut rec = io_record(b"ab", 1000, HS_SYS_SENDTO, HS_DIR_OUT);
        rec[HS_IO_OFF_FLAGS..HS_IO_OFF_FLAGS + 4].copy_from_slice(&0x80u32.to_ne_bytes());
        assert_eq!(decode(&rec), Err(DecodeError::UnknownFlags(0x80)));
    }

    #[test]
    fn conn_record_decodes_ipv4_addresses_and_ports() {
        let mut b = Builder::new(HS_CONN_SIZE, HS_KIND_CONN);
        b.u64(HS_CONN_OFF_SOCK_INO, 555);
        b.u64(HS_CONN_OFF_RET, 7);
        b.u32(HS_CONN_OFF_FD, 7);
        b.u16(HS_CONN_OFF_OP, HS_CONN_ACCEPT as u16);
        b.u16(HS_CONN_OFF_FAMILY, HS_AF_INET as u16);
        b.u16(HS_CONN_OFF_LOCAL_PORT, 8000);
        b.u16(HS_CONN_OFF_PEER_PORT, 51000);
        b.put(HS_CONN_OFF_LOCAL_ADDR, &[127, 0, 0, 1]);
        b.put(HS_CONN_OFF_PEER_ADDR, &[10, 1, 2, 3]);
        let KEvent::Conn(c) = decode(&b.0).unwrap() else { panic!("not conn") };
        assert_eq!(c.op, ConnOp::Accept);
        assert_eq!(c.conn, ConnKey { tgid: 42, fd: 7, ino: 555 });
        assert_eq!(c.local, Some("127.0.0.1:8000".parse().unwrap()));
        assert_eq!(c.peer, Some("10.1.2.3:51000".parse().unwrap()));
        assert_eq!(c.ret, 7);
    }

    #[test]
    fn conn_record_with_unknown_op_is_rejected() {
        let mut b = Builder::new(HS_CONN_SIZE, HS_KIND_CONN);
        b.u16(HS_CONN_OFF_OP, 9);
        assert_eq!(decode(&b.0), Err(DecodeError::UnknownTag { field: "conn op", value: 9 }));
    }

    #[test]
    fn conn_record_of_a_unix_socket_has_no_addresses() {
        let mut b = Builder::new(HS_CONN_SIZE, HS_KIND_CONN);
        b.u64(HS_CONN_OFF_SOCK_INO, 1);
        b.u16(HS_CONN_OFF_OP, HS_CONN_CONNECT as u16);
        b.u16(HS_CONN_OFF_FAMILY, HS_AF_UNIX as u16);
        let KEvent::Conn(c) = decode(&b.0).unwrap() else { panic!("not conn") };
        assert_eq!((c.family, c.local, c.peer), (Family::Unix, None, None));
    }

    #[test]
    fn close_record_decodes() {
        let mut b = Builder::new(HS_CLOSE_SIZE, HS_KIND_CLOSE);
        b.u64(HS_CLOSE_OFF_SOCK_INO, 9);
        b.u32(HS_CLOSE_OFF_FD, 4);
        let ev = decode(&b.0).unwrap();
        assert_eq!(ev, KEvent::Close(CloseEvent { ts_ns: 1_000, tid: 43, conn: ConnKey { tgid: 42, fd: 4, ino: 9 } }));
    }

    #[test]
    fn proc_record_decodes_comm_up_to_the_nul() {
        let mut b = Builder::new(HS_PROC_SIZE, HS_KIND_PROC);
        b.u32(HS_PROC_OFF_CHILD_TGID, 4242);
        b.u16(HS_PROC_OFF_OP, HS_PROC_EXIT as u16);
        b.u32(HS_PROC_OFF_EXIT_CODE, 256);
        b.put(HS_PROC_OFF_COMM, b"python3\0garbage");
        let KEvent::Proc(p) = decode(&b.0).unwrap() else { panic!("not proc") };
        assert_eq!((p.op, p.child_tgid, p.exit_code, p.comm.as_str()), (ProcOp::Exit, 4242, 256, "python3"));
    }

    #[test]
    fn proc_record_with_unknown_op_is_rejected() {
        let mut b = Builder::new(HS_PROC_SIZE, HS_KIND_PROC);
        b.u16(HS_PROC_OFF_OP, 0);
        assert_eq!(decode(&b.0), Err(DecodeError::UnknownTag { field: "proc op", value: 0 }));
    }

    #[test]
    fn sched_record_maps_zero_wake_to_none() {
        let mut b = Builder::new(HS_SCHED_SIZE, HS_KIND_SCHED);
        b.u64(HS_SCHED_OFF_OFF_NS, 500);
        b.u32(HS_SCHED_OFF_PREV_STATE, 1);
        b.u32(HS_SCHED_OFF_CPU, 1);
        let KEvent::Sched(s) = decode(&b.0).unwrap() else { panic!("not sched") };
        assert_eq!((s.off_ns, s.wake_ns, s.prev_state, s.cpu), (500, None, 1, 1));
        b.u64(HS_SCHED_OFF_WAKE_NS, 800);
        let KEvent::Sched(s) = decode(&b.0).unwrap() else { panic!("not sched") };
        assert_eq!(s.wake_ns, Some(800));
    }

    #[test]
    fn fixed_size_record_with_trailing_bytes_is_rejected() {
        let mut b = Builder::new(HS_SCHED_SIZE + 8, HS_KIND_SCHED);
        b.u32(HS_HDR_OFF_SIZE, (HS_SCHED_SIZE + 8) as u32);
        assert_eq!(
            decode(&b.0),
            Err(DecodeError::WrongLength { what: "sched record", len: HS_SCHED_SIZE + 8, expected: HS_SCHED_SIZE })
        );
    }
}
