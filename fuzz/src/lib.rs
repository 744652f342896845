//! Shared input shapes for the stream targets.
//!
//! The stream decoders take kernel events, not bytes, so the fuzzer's bytes are
//! cut into events: `(ctl:u8 len:u16le data[len])*`. This keeps syscall
//! boundaries, gaps, closes and reopens under the fuzzer's control (the
//! decoders' resync rules depend on them) while plain byte seeds still work:
//! `cargo xtask fuzz` writes the fixtures in this shape (xtask/src/fuzz.rs
//! `event_seed`, keep the two in step).
//!
//! ctl bit 0: direction (0 In, 1 Out); bits 1–2: 0/1 I/O, 2 close, 3 accept;
//! bit 3: the syscall moved 4096 more bytes than were captured (a gap);
//! bits 4–5: which of four connections; bit 6: the kernel saw the bytes on the
//! wire 5 ns before the exit (a read's arrival, a write's departure); bit 7:
//! 5 ns after it (a stamp the decoder must not trust for a write). A write
//! with bit 6 also says its thread was woken 500 ns before the exit (the
//! kernel's `burst`: `Record::WokenWrite` on unix sockets).

use hopscope::event::{Burst, CloseEvent, ConnEvent, ConnKey, ConnOp, Dir, Family, IoEvent, KEvent, Syscall};

pub fn events(mut data: &[u8], family: Family) -> Vec<KEvent> {
    let mut out = Vec::new();
    let mut ts = 1_000_000u64;
    while let Some((&ctl, rest)) = data.split_first() {
        let len = match rest {
            [a, b, ..] => u16::from_le_bytes([*a, *b]) as usize,
            _ => break,
        };
        let rest = &rest[2..];
        let take = len.min(rest.len());
        let (chunk, tail) = rest.split_at(take);
        data = tail;
        ts += 1_000;
        let conn = ConnKey { tgid: 42, fd: 3 + i32::from((ctl >> 4) & 3), ino: 100 + u64::from((ctl >> 4) & 3) };
        let dir = if ctl & 1 == 0 { Dir::In } else { Dir::Out };
        match (ctl >> 1) & 3 {
            2 => out.push(KEvent::Close(CloseEvent { ts_ns: ts, tid: 43, conn })),
            3 => out.push(KEvent::Conn(ConnEvent {
                ts_ns: ts,
                enter_ns: ts - 10,
                tid: 43,
                conn,
                op: ConnOp::Accept,
                family,
                ret: i64::from(conn.fd),
                local: None,
                peer: None,
            })),
            _ => {
                let gap = if ctl & 8 != 0 { 4096 } else { 0 };
                // A transfer with a gap may carry its end apart (the
                // kernel's tail capture, unix and TCP): the chunk's second half.
                let head = if gap != 0 && ctl & 0x20 != 0 { chunk.len() / 2 } else { chunk.len() };
                // The source never delivers a syscall that moved nothing.
                if chunk.is_empty() && gap == 0 {
                    continue;
                }
                out.push(KEvent::Io(IoEvent {
                    ts_ns: ts,
                    enter_ns: ts - 10,
                    wire_ns: match ctl >> 6 {
                        0 => None,
                        1 => Some(ts - 5),
                        _ => Some(ts + 5),
                    },
                    tid: 43,
                    conn,
                    syscall: if dir == Dir::In { Syscall::Read } else { Syscall::Write },
                    dir,
                    family,
                    len: chunk.len() as u64 + gap,
                    data: chunk[..head].to_vec(),
                    tail: chunk[head..].to_vec(),
                    copy_failed: false,
                    burst: if dir == Dir::Out && ctl & 0x40 != 0 {
                        Burst::Woken { wake_ns: ts - 500, on_ns: ts - 400 }
                    } else {
                        Burst::NoSleep
                    },
                }))
            }
        }
    }
    out
}
