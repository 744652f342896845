//! Incremental `Transfer-Encoding: chunked` decoder (RFC 9112 §7.1) that also
//! survives capture gaps of known size.
//!
//! Bytes are fed as they arrive (any split, down to one byte per call); a gap
//! (bytes the syscall moved but the probe did not capture) is skipped by count
//! with [`ChunkDecoder::skip`]: inside chunk data it only shortens the chunk, the
//! CRLF after the data is assumed, and a chunk-size line falling into the gap
//! loses the framing (`lost`). Sizes are parsed with checked arithmetic, so
//! `ffffffffffffffffffff` is an error, never an overflow.

/// Longest chunk-size line (digits + extensions) accepted.
const MAX_SIZE_LINE: u32 = 4096;
/// Most trailer bytes accepted after the last chunk.
const MAX_TRAILER: u32 = 16 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChunkError {
    /// The chunk size does not fit in 64 bits.
    Overflow,
    /// Not a chunk-size line, missing CRLF after data, over-long lines.
    Invalid,
}

/// What one [`ChunkDecoder::step`] produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Item {
    /// Chunk data at `start..end` of the input; `chunk_end` when it completes a chunk.
    Data {
        start: usize,
        end: usize,
        chunk_end: bool,
    },
    /// The last chunk and the trailers ended: the body is complete.
    End,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum St {
    SizeStart,
    SizeDigits(u64),
    SizeWs(u64),
    SizeExt(u64),
    SizeCr(u64),
    Data(u64),
    DataCr,
    DataLf,
    TrailerLineStart,
    TrailerLine,
    TrailerCr,
    Done,
    Lost,
}

/// What [`ChunkDecoder::skip`] did with a gap.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Skip {
    /// Chunk-data bytes inside the gap (body bytes of unknown content).
    pub data: u64,
    /// A chunk's data ended inside the gap.
    pub chunk_end: bool,
    /// The body ended inside the gap.
    pub end: bool,
    /// Framing lost: a size line (or trailer) fell into the gap.
    pub lost: bool,
    /// Gap bytes not consumed (after the body ended, or once framing was lost).
    pub rest: u64,
}

#[derive(Debug, Clone)]
pub(crate) struct ChunkDecoder {
    st: St,
    line: u32,
}

impl Default for ChunkDecoder {
    fn default() -> Self {
        Self::new()
    }
}

fn hex(b: u8) -> Option<u64> {
    (b as char).to_digit(16).map(u64::from)
}

impl ChunkDecoder {
    pub fn new() -> Self {
        ChunkDecoder {
            st: St::SizeStart,
            line: 0,
        }
    }

    pub fn is_lost(&self) -> bool {
        self.st == St::Lost
    }

    pub fn set_lost(&mut self) {
        self.st = St::Lost;
    }

    /// Restart at a chunk-size line (after [`size_line_ok`] said one starts here).
    pub fn reset(&mut self) {
        *self = Self::new();
    }

    fn size_done(&mut self, v: u64) {
        self.line = 0;
        self.st = if v == 0 {
            St::TrailerLineStart
        } else {
            St::Data(v)
        };
    }

    /// Consumes bytes from `data` until one [`Item`] is produced or `data` is
    /// exhausted. Returns the bytes consumed. After `End`, consumes nothing.
    pub fn step(&mut self, data: &[u8]) -> Result<(usize, Option<Item>), ChunkError> {
        let mut i = 0;
        while i < data.len() {
            if let St::Data(rem) = self.st {
                let avail = (data.len() - i) as u64;
                let n = rem.min(avail);
                let left = rem - n;
                // n <= avail, which is a usize.
                let end = i + n as usize;
                self.st = if left == 0 {
                    St::DataCr
                } else {
                    St::Data(left)
                };
                return Ok((
                    end,
                    Some(Item::Data {
                        start: i,
                        end,
                        chunk_end: left == 0,
                    }),
                ));
            }
            if matches!(self.st, St::Done | St::Lost) {
                return Ok((i, None));
            }
            let b = data[i];
            i += 1;
            self.line = self.line.saturating_add(1);
            let in_size = matches!(
                self.st,
                St::SizeStart | St::SizeDigits(_) | St::SizeWs(_) | St::SizeExt(_) | St::SizeCr(_)
            );
            if in_size && self.line > MAX_SIZE_LINE {
                return Err(ChunkError::Invalid);
            }
            match self.st {
                St::SizeStart => match hex(b) {
                    Some(d) => self.st = St::SizeDigits(d),
                    None => return Err(ChunkError::Invalid),
                },
                St::SizeDigits(v) => match (hex(b), b) {
                    (Some(d), _) => {
                        let v = v
                            .checked_mul(16)
                            .and_then(|v| v.checked_add(d))
                            .ok_or(ChunkError::Overflow)?;
                        self.st = St::SizeDigits(v);
                    }
                    (None, b';') => self.st = St::SizeExt(v),
                    (None, b' ' | b'\t') => self.st = St::SizeWs(v),
                    (None, b'\r') => self.st = St::SizeCr(v),
                    (None, b'\n') => self.size_done(v),
                    _ => return Err(ChunkError::Invalid),
                },
                St::SizeWs(v) => match b {
                    b' ' | b'\t' => {}
                    b';' => self.st = St::SizeExt(v),
                    b'\r' => self.st = St::SizeCr(v),
                    b'\n' => self.size_done(v),
                    _ => return Err(ChunkError::Invalid),
                },
                St::SizeExt(v) => match b {
                    b'\r' => self.st = St::SizeCr(v),
                    b'\n' => self.size_done(v),
                    _ => {}
                },
                St::SizeCr(v) => match b {
                    b'\n' => self.size_done(v),
                    _ => return Err(ChunkError::Invalid),
                },
                St::DataCr => match b {
                    b'\r' => self.st = St::DataLf,
                    b'\n' => {
                        // tolerate a bare LF
                        self.line = 0;
                        self.st = St::SizeStart;
                    }
                    _ => return Err(ChunkError::Invalid),
                },
                St::DataLf => match b {
                    b'\n' => {
                        self.line = 0;
                        self.st = St::SizeStart;
                    }
                    _ => return Err(ChunkError::Invalid),
                },
                St::TrailerLineStart => match b {
                    b'\r' => self.st = St::TrailerCr,
                    b'\n' => {
                        self.st = St::Done;
                        return Ok((i, Some(Item::End)));
                    }
                    _ => self.st = St::TrailerLine,
                },
                St::TrailerLine => {
                    if self.line > MAX_TRAILER {
                        return Err(ChunkError::Invalid);
                    }
                    if b == b'\n' {
                        self.st = St::TrailerLineStart;
                    }
                }
                St::TrailerCr => match b {
                    b'\n' => {
                        self.st = St::Done;
                        return Ok((i, Some(Item::End)));
                    }
                    _ => return Err(ChunkError::Invalid),
                },
                St::Data(_) | St::Done | St::Lost => {}
            }
        }
        Ok((i, None))
    }

    /// Skips a gap of `n` uncaptured bytes.
    pub fn skip(&mut self, mut n: u64) -> Skip {
        let mut s = Skip::default();
        while n > 0 {
            match self.st {
                St::Data(rem) => {
                    let k = rem.min(n);
                    s.data += k;
                    n -= k;
                    if k == rem {
                        self.st = St::DataCr;
                        s.chunk_end = true;
                    } else {
                        self.st = St::Data(rem - k);
                    }
                }
                // The CRLF after chunk data is assumed to be there.
                St::DataCr => {
                    n -= 1;
                    self.st = St::DataLf;
                }
                St::DataLf => {
                    n -= 1;
                    self.line = 0;
                    self.st = St::SizeStart;
                }
                // After `0\r\n`: assume no trailers, i.e. the final CRLF.
                St::TrailerLineStart => {
                    n -= 1;
                    self.st = St::TrailerCr;
                }
                St::TrailerCr => {
                    n -= 1;
                    self.st = St::Done;
                    s.end = true;
                }
                St::Done => break,
                _ => {
                    self.st = St::Lost;
                    s.lost = true;
                    break;
                }
            }
        }
        s.rest = n;
        s
    }
}

/// Whether `data` starts with a complete, valid chunk-size line (used to pick the
/// framing up again at a syscall boundary after it was lost).
pub(crate) fn size_line_ok(data: &[u8]) -> bool {
    let mut d = ChunkDecoder::new();
    let lim = data.len().min(MAX_SIZE_LINE as usize);
    for &b in &data[..lim] {
        match d.step(&[b]) {
            Err(_) => return false,
            Ok(_) => {
                if matches!(d.st, St::Data(_) | St::TrailerLineStart) {
                    return true;
                }
            }
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Decodes everything, returning (data, ended).
    fn decode(dec: &mut ChunkDecoder, input: &[u8]) -> Result<(Vec<u8>, bool, usize), ChunkError> {
        let mut out = Vec::new();
        let mut pos = 0;
        let mut ends = 0;
        while pos < input.len() {
            let (n, item) = dec.step(&input[pos..])?;
            match item {
                Some(Item::Data {
                    start,
                    end,
                    chunk_end,
                }) => {
                    out.extend_from_slice(&input[pos + start..pos + end]);
                    ends += usize::from(chunk_end);
                }
                Some(Item::End) => return Ok((out, true, pos + n)),
                None => {}
            }
            if n == 0 {
                break;
            }
            pos += n;
        }
        let _ = ends;
        Ok((out, false, pos))
    }

    #[test]
    fn decodes_chunks_with_extensions_and_trailers_in_any_split() {
        let body = b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-T: 1\r\n\r\nNEXT";
        for split in 1..body.len() {
            let mut d = ChunkDecoder::new();
            let mut data = Vec::new();
            let mut ended = false;
            let mut consumed = 0;
            for piece in body.chunks(split) {
                if ended {
                    break;
                }
                let (out, e, used) = decode(&mut d, piece).unwrap();
                data.extend(out);
                ended = e;
                consumed += used;
            }
            assert_eq!(data, b"hello world", "split {split}");
            assert!(ended);
            assert_eq!(&body[consumed..], b"NEXT");
        }
    }

    #[test]
    fn chunk_size_overflow_is_an_error_not_a_panic() {
        let mut d = ChunkDecoder::new();
        assert_eq!(
            decode(&mut d, b"ffffffffffffffffff\r\n").unwrap_err(),
            ChunkError::Overflow
        );
        let mut d = ChunkDecoder::new();
        assert!(decode(&mut d, b"ffffffffffffffff\r\n").is_ok());
        let mut d = ChunkDecoder::new();
        assert_eq!(decode(&mut d, b"zz\r\n").unwrap_err(), ChunkError::Invalid);
    }

    #[test]
    fn gap_inside_data_keeps_framing_and_gap_over_size_line_loses_it() {
        let mut d = ChunkDecoder::new();
        decode(&mut d, b"a\r\nabc").unwrap();
        // 7 more data bytes + CRLF in the gap.
        let s = d.skip(9);
        assert_eq!(
            s,
            Skip {
                data: 7,
                chunk_end: true,
                end: false,
                lost: false,
                rest: 0
            }
        );
        let (out, ended, _) = decode(&mut d, b"0\r\n\r\n").unwrap();
        assert!(out.is_empty() && ended);

        let mut d = ChunkDecoder::new();
        decode(&mut d, b"2\r\na").unwrap();
        let s = d.skip(10);
        assert!(s.lost && s.chunk_end);
        assert_eq!(s.data, 1);
        assert_eq!(s.rest, 7);
        assert!(d.is_lost());
    }

    #[test]
    fn size_line_check_for_resync() {
        assert!(size_line_ok(b"1a3\r\ndata: x"));
        assert!(size_line_ok(b"0\r\n\r\n"));
        assert!(!size_line_ok(b"data: {\"a\":1}\n\n"));
        assert!(!size_line_ok(b"1a3"));
        assert!(!size_line_ok(b"ffffffffffffffffffff\r\n"));
    }
}
