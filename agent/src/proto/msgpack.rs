//! A small, bounded msgpack reader over a possibly truncated byte prefix.
//!
//! The probe captures only a prefix of each syscall, so a msgpack document is
//! often cut: an `EngineCoreRequest` whose prompt ids run past the capture limit
//! still starts with its request id and the *header* of the prompt-id array,
//! which carries the element count. [`decode`] therefore builds a tree of what is
//! present and marks precisely where the input stopped:
//!
//! * a container keeps its **declared** length (`len`) even when fewer items
//!   were present (`items.len() < len`); the item that ran into the end is a
//!   [`Value::Truncated`] naming what its header said (or `None` if the header
//!   itself was cut), and nothing is decoded after it;
//! * a string/bin/ext whose payload is cut is `Truncated(Some(Kind::Str))` etc.
//!   (no partial string is ever returned: a partial id would mislead);
//! * invalid bytes (the never-used marker `0xc1`) stop decoding the same way,
//!   as [`Value::Invalid`].
//!
//! Bounds: containers are materialised to depth [`MAX_DEPTH`] and at most
//! [`MAX_NODES`] nodes per document; deeper or further values are walked
//! (iteratively, no recursion) and reported as [`Value::Skipped`]. The node
//! budget is spent in document order, so once it runs out every later value is
//! skipped: a container holding a skipped node ends with one
//! ([`Value::is_partial`]). Every length is checked against the bytes left
//! before it is trusted, so allocation is O(input). Nothing here panics on any
//! input.

/// Deepest container nesting materialised (the root array is depth 1).
pub const MAX_DEPTH: usize = 16;
/// Most nodes materialised per [`decode`] call (the rest is skipped). Every
/// node takes at least one byte, so a document within the 40 KiB kept of a
/// ZMTP frame ([`crate::proto::zmtp::FRAME_CAPTURE_DEFAULT`]) never reaches
/// it: the budget only bounds larger inputs (custom frame limits, the fuzzers).
pub const MAX_NODES: usize = 40 * 1024;

/// What a header announced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Nil,
    Bool,
    Int,
    Float,
    Str,
    Bin,
    Array,
    Map,
    Ext,
}

/// One decoded msgpack value, borrowing strings and blobs from the input.
#[derive(Debug, Clone, PartialEq)]
pub enum Value<'a> {
    Nil,
    Bool(bool),
    /// Every msgpack integer (u64 and i64 ranges) fits.
    Int(i128),
    /// float32 is widened.
    Float(f64),
    /// Raw bytes of a str (UTF-8 not checked; see [`Value::as_str`]).
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Ext(i8, &'a [u8]),
    /// `items.len() < len` when the input ended (or a bound was hit) inside it.
    Array {
        len: u32,
        items: Vec<Value<'a>>,
    },
    /// Key/value pairs present; a pair cut in the middle has a `Truncated` value.
    Map {
        len: u32,
        entries: Vec<(Value<'a>, Value<'a>)>,
    },
    /// The input ended inside this value; `Some(kind)` when its header was read.
    Truncated(Option<Kind>),
    /// Invalid marker byte here.
    Invalid,
    /// A complete value not materialised (depth or node limit): the kind
    /// its header names, and its whole encoding (walked to its end), for a
    /// reader that needs it only as bytes (a digest).
    Skipped(Kind, &'a [u8]),
}

/// How a [`decode`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// The whole value was present.
    Complete,
    /// The input ended inside the value.
    Truncated,
    /// An invalid marker was met.
    Invalid,
}

/// Result of [`decode`].
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded<'a> {
    pub value: Value<'a>,
    pub status: Status,
    /// Bytes consumed (the value's size when complete).
    pub consumed: usize,
}

impl<'a> Value<'a> {
    pub fn kind(&self) -> Option<Kind> {
        Some(match self {
            Value::Nil => Kind::Nil,
            Value::Bool(_) => Kind::Bool,
            Value::Int(_) => Kind::Int,
            Value::Float(_) => Kind::Float,
            Value::Str(_) => Kind::Str,
            Value::Bin(_) => Kind::Bin,
            Value::Ext(..) => Kind::Ext,
            Value::Array { .. } => Kind::Array,
            Value::Map { .. } => Kind::Map,
            Value::Skipped(k, _) => *k,
            Value::Truncated(_) | Value::Invalid => return None,
        })
    }

    /// True for values the input cut (or spoiled) at or inside this one.
    pub fn is_cut(&self) -> bool {
        self.ends_short(false)
    }

    /// [`Value::is_cut`], or a bound left this value unmaterialised: it is
    /// [`Value::Skipped`], or (for a container) its last item is, recursively,
    /// which is how a value the node budget ran out in ends. Its content cannot
    /// be read whole either way. A container skipped past [`MAX_DEPTH`] in the
    /// middle of another does not make that one partial (all around it is
    /// there); one that ends it does, as the two cases cannot be told apart.
    pub fn is_partial(&self) -> bool {
        self.ends_short(true)
    }

    /// The input (or, with `skipped`, a bound) stopped at or inside this
    /// value: decoding stops there, so only the last item of a container can be.
    fn ends_short(&self, skipped: bool) -> bool {
        match self {
            Value::Truncated(_) | Value::Invalid => true,
            Value::Skipped(..) => skipped,
            Value::Array { len, items } => {
                items.len() < *len as usize || items.last().is_some_and(|v| v.ends_short(skipped))
            }
            Value::Map { len, entries } => {
                entries.len() < *len as usize
                    || entries
                        .last()
                        .is_some_and(|(k, v)| k.ends_short(skipped) || v.ends_short(skipped))
            }
            _ => false,
        }
    }

    pub fn is_nil(&self) -> bool {
        matches!(self, Value::Nil)
    }

    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Value::Int(i) => u64::try_from(*i).ok(),
            _ => None,
        }
    }

    pub fn as_i128(&self) -> Option<i128> {
        match self {
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }

    /// A float (ints are not converted: layouts are told apart by type).
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Float(f) => Some(*f),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&'a str> {
        match self {
            Value::Str(b) => std::str::from_utf8(b).ok(),
            _ => None,
        }
    }

    pub fn as_bytes(&self) -> Option<&'a [u8]> {
        match self {
            Value::Str(b) | Value::Bin(b) => Some(b),
            _ => None,
        }
    }

    /// Declared length and the items present, for arrays.
    pub fn as_array(&self) -> Option<(u32, &[Value<'a>])> {
        match self {
            Value::Array { len, items } => Some((*len, items)),
            _ => None,
        }
    }

    pub fn as_map(&self) -> Option<(u32, &[(Value<'a>, Value<'a>)])> {
        match self {
            Value::Map { len, entries } => Some((*len, entries)),
            _ => None,
        }
    }

    /// The value under a string key of a map (first match), if present.
    pub fn get(&self, key: &str) -> Option<&Value<'a>> {
        let (_, entries) = self.as_map()?;
        entries
            .iter()
            .find(|(k, _)| k.as_bytes() == Some(key.as_bytes()))
            .map(|(_, v)| v)
    }
}

/// A header: what the marker says and how many payload bytes / items follow.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Head {
    Nil,
    Bool(bool),
    Int(i128),
    Float(f64),
    /// Payload of this many bytes follows.
    Str(u32),
    Bin(u32),
    Ext(i8, u32),
    Array(u32),
    Map(u32),
}

impl Head {
    fn kind(self) -> Kind {
        match self {
            Head::Nil => Kind::Nil,
            Head::Bool(_) => Kind::Bool,
            Head::Int(_) => Kind::Int,
            Head::Float(_) => Kind::Float,
            Head::Str(_) => Kind::Str,
            Head::Bin(_) => Kind::Bin,
            Head::Ext(..) => Kind::Ext,
            Head::Array(_) => Kind::Array,
            Head::Map(_) => Kind::Map,
        }
    }
}

enum HeadErr {
    /// Input ended inside the header.
    Short,
    Invalid,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn left(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let s = self.buf.get(self.pos..end)?;
        self.pos = end;
        Some(s)
    }

    fn be<const N: usize>(&mut self) -> Option<[u8; N]> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Some(a)
    }

    /// Reads one header; on `Short` the position is unspecified (decoding stops).
    fn head(&mut self) -> Result<Head, HeadErr> {
        use HeadErr::{Invalid, Short};
        let m = *self.buf.get(self.pos).ok_or(Short)?;
        self.pos += 1;
        let u8_ = |c: &mut Self| c.be::<1>().map(|b| b[0] as u32).ok_or(Short);
        let u16_ = |c: &mut Self| {
            c.be::<2>()
                .map(|b| u16::from_be_bytes(b) as u32)
                .ok_or(Short)
        };
        let u32_ = |c: &mut Self| c.be::<4>().map(u32::from_be_bytes).ok_or(Short);
        Ok(match m {
            0x00..=0x7f => Head::Int(m as i128),
            0x80..=0x8f => Head::Map((m & 0x0f) as u32),
            0x90..=0x9f => Head::Array((m & 0x0f) as u32),
            0xa0..=0xbf => Head::Str((m & 0x1f) as u32),
            0xc0 => Head::Nil,
            0xc1 => return Err(Invalid),
            0xc2 => Head::Bool(false),
            0xc3 => Head::Bool(true),
            0xc4 => Head::Bin(u8_(self)?),
            0xc5 => Head::Bin(u16_(self)?),
            0xc6 => Head::Bin(u32_(self)?),
            0xc7..=0xc9 => {
                let n = match m {
                    0xc7 => u8_(self)?,
                    0xc8 => u16_(self)?,
                    _ => u32_(self)?,
                };
                let t = self.be::<1>().ok_or(Short)?[0] as i8;
                Head::Ext(t, n)
            }
            0xca => Head::Float(f32::from_be_bytes(self.be::<4>().ok_or(Short)?) as f64),
            0xcb => Head::Float(f64::from_be_bytes(self.be::<8>().ok_or(Short)?)),
            0xcc => Head::Int(self.be::<1>().ok_or(Short)?[0] as i128),
            0xcd => Head::Int(u16::from_be_bytes(self.be::<2>().ok_or(Short)?) as i128),
            0xce => Head::Int(u32::from_be_bytes(self.be::<4>().ok_or(Short)?) as i128),
            0xcf => Head::Int(u64::from_be_bytes(self.be::<8>().ok_or(Short)?) as i128),
            0xd0 => Head::Int(self.be::<1>().ok_or(Short)?[0] as i8 as i128),
            0xd1 => Head::Int(i16::from_be_bytes(self.be::<2>().ok_or(Short)?) as i128),
            0xd2 => Head::Int(i32::from_be_bytes(self.be::<4>().ok_or(Short)?) as i128),
            0xd3 => Head::Int(i64::from_be_bytes(self.be::<8>().ok_or(Short)?) as i128),
            0xd4..=0xd8 => {
                let n = 1u32 << (m - 0xd4);
                let t = self.be::<1>().ok_or(Short)?[0] as i8;
                Head::Ext(t, n)
            }
            0xd9 => Head::Str(u8_(self)?),
            0xda => Head::Str(u16_(self)?),
            0xdb => Head::Str(u32_(self)?),
            0xdc => Head::Array(u16_(self)?),
            0xdd => Head::Array(u32_(self)?),
            0xde => Head::Map(u16_(self)?),
            0xdf => Head::Map(u32_(self)?),
            0xe0..=0xff => Head::Int((m as i8) as i128),
        })
    }
}

/// Reads the header of the value at the start of `buf` and, for containers,
/// its declared length: `Some((Kind::Array, 37))`. Scalars report length 0,
/// str/bin/ext their byte length. `None` if the header is cut or invalid.
pub fn peek_header(buf: &[u8]) -> Option<(Kind, u32)> {
    let mut c = Cursor { buf, pos: 0 };
    let h = c.head().ok()?;
    let n = match h {
        Head::Str(n) | Head::Bin(n) | Head::Ext(_, n) | Head::Array(n) | Head::Map(n) => n,
        _ => 0,
    };
    Some((h.kind(), n))
}

/// Decodes the first value of `buf`, which may be a truncated prefix.
pub fn decode(buf: &[u8]) -> Decoded<'_> {
    let mut d = Dec {
        c: Cursor { buf, pos: 0 },
        nodes: 0,
        stop: None,
    };
    let value = d.value(1);
    Decoded {
        value,
        status: d.stop.unwrap_or(Status::Complete),
        consumed: d.c.pos.min(buf.len()),
    }
}

struct Dec<'a> {
    c: Cursor<'a>,
    nodes: usize,
    /// Set once the input ended or went invalid: nothing more is read.
    stop: Option<Status>,
}

impl<'a> Dec<'a> {
    fn value(&mut self, depth: usize) -> Value<'a> {
        let start = self.c.pos;
        let head = match self.c.head() {
            Ok(h) => h,
            Err(HeadErr::Short) => {
                self.stop = Some(Status::Truncated);
                return Value::Truncated(None);
            }
            Err(HeadErr::Invalid) => {
                self.stop = Some(Status::Invalid);
                return Value::Invalid;
            }
        };
        self.nodes = self.nodes.saturating_add(1);
        let limited = self.nodes > MAX_NODES
            || (depth > MAX_DEPTH && matches!(head, Head::Array(_) | Head::Map(_)));
        if limited {
            self.c.pos = start;
            return self.skip();
        }
        match head {
            Head::Nil => Value::Nil,
            Head::Bool(b) => Value::Bool(b),
            Head::Int(i) => Value::Int(i),
            Head::Float(f) => Value::Float(f),
            Head::Str(n) | Head::Bin(n) | Head::Ext(_, n) => match self.c.take(n as usize) {
                Some(b) => match head {
                    Head::Str(_) => Value::Str(b),
                    Head::Bin(_) => Value::Bin(b),
                    Head::Ext(t, _) => Value::Ext(t, b),
                    _ => Value::Invalid,
                },
                None => {
                    self.c.pos = self.c.buf.len();
                    self.stop = Some(Status::Truncated);
                    Value::Truncated(Some(head.kind()))
                }
            },
            Head::Array(len) => {
                // Each item takes at least one byte: reserve no more than is left.
                let mut items = Vec::with_capacity((len as usize).min(self.c.left()).min(64));
                for _ in 0..len {
                    let v = self.value(depth + 1);
                    items.push(v);
                    if self.stop.is_some() {
                        break;
                    }
                }
                Value::Array { len, items }
            }
            Head::Map(len) => {
                let mut entries = Vec::with_capacity((len as usize).min(self.c.left() / 2).min(64));
                for _ in 0..len {
                    let k = self.value(depth + 1);
                    if self.stop.is_some() {
                        entries.push((k, Value::Truncated(None)));
                        break;
                    }
                    let v = self.value(depth + 1);
                    entries.push((k, v));
                    if self.stop.is_some() {
                        break;
                    }
                }
                Value::Map { len, entries }
            }
        }
    }

    /// Walks one complete value without materialising it (no recursion).
    fn skip(&mut self) -> Value<'a> {
        let start = self.c.pos;
        let mut first: Option<Kind> = None;
        let mut pending: u64 = 1;
        while pending > 0 {
            let head = match self.c.head() {
                Ok(h) => h,
                Err(HeadErr::Short) => {
                    self.stop = Some(Status::Truncated);
                    return Value::Truncated(first);
                }
                Err(HeadErr::Invalid) => {
                    self.stop = Some(Status::Invalid);
                    return Value::Invalid;
                }
            };
            first.get_or_insert(head.kind());
            pending -= 1;
            match head {
                Head::Str(n) | Head::Bin(n) | Head::Ext(_, n)
                    if self.c.take(n as usize).is_none() =>
                {
                    self.c.pos = self.c.buf.len();
                    self.stop = Some(Status::Truncated);
                    return Value::Truncated(first);
                }
                Head::Array(n) => pending = pending.saturating_add(n as u64),
                Head::Map(n) => pending = pending.saturating_add(2 * n as u64),
                _ => {}
            }
            // More items pending than bytes left: it cannot complete.
            if pending > self.c.left() as u64 {
                self.c.pos = self.c.buf.len();
                self.stop = Some(Status::Truncated);
                return Value::Truncated(first);
            }
        }
        Value::Skipped(first.unwrap_or(Kind::Nil), &self.c.buf[start..self.c.pos])
    }
}

#[cfg(test)]
pub(crate) mod enc {
    //! A tiny msgpack writer for tests (smallest forms, as msgspec writes).

    #[derive(Debug)]
    pub enum V<'a> {
        Nil,
        B(bool),
        I(i64),
        F(f64),
        S(&'a str),
        A(Vec<V<'a>>),
        M(Vec<(&'a str, V<'a>)>),
        /// An extension (ext 8 form, as msgspec writes a raw view).
        X(i8, &'a [u8]),
    }

    pub fn enc(v: &V, out: &mut Vec<u8>) {
        match v {
            V::Nil => out.push(0xc0),
            V::B(b) => out.push(if *b { 0xc3 } else { 0xc2 }),
            V::I(i) => int(*i, out),
            V::F(f) => {
                out.push(0xcb);
                out.extend_from_slice(&f.to_be_bytes());
            }
            V::S(s) => str_(s, out),
            V::A(items) => {
                len_hdr(items.len(), 0x90, 0xdc, 0xdd, out);
                for i in items {
                    enc(i, out);
                }
            }
            V::M(entries) => {
                len_hdr(entries.len(), 0x80, 0xde, 0xdf, out);
                for (k, v) in entries {
                    str_(k, out);
                    enc(v, out);
                }
            }
            V::X(t, b) => {
                out.push(0xc7);
                out.push(u8::try_from(b.len()).expect("a short ext"));
                out.push(*t as u8);
                out.extend_from_slice(b);
            }
        }
    }

    pub fn to_vec(v: &V) -> Vec<u8> {
        let mut out = Vec::new();
        enc(v, &mut out);
        out
    }

    fn len_hdr(n: usize, fix: u8, m16: u8, m32: u8, out: &mut Vec<u8>) {
        if n < 16 {
            out.push(fix | n as u8);
        } else if n <= u16::MAX as usize {
            out.push(m16);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        } else {
            out.push(m32);
            out.extend_from_slice(&(n as u32).to_be_bytes());
        }
    }

    fn str_(s: &str, out: &mut Vec<u8>) {
        let n = s.len();
        if n < 32 {
            out.push(0xa0 | n as u8);
        } else if n < 256 {
            out.push(0xd9);
            out.push(n as u8);
        } else {
            out.push(0xda);
            out.extend_from_slice(&(n as u16).to_be_bytes());
        }
        out.extend_from_slice(s.as_bytes());
    }

    fn int(i: i64, out: &mut Vec<u8>) {
        if (0..128).contains(&i) {
            out.push(i as u8);
        } else if (-32..0).contains(&i) {
            out.push(i as i8 as u8);
        } else if (0..=u8::MAX as i64).contains(&i) {
            out.extend_from_slice(&[0xcc, i as u8]);
        } else if (0..=u16::MAX as i64).contains(&i) {
            out.push(0xcd);
            out.extend_from_slice(&(i as u16).to_be_bytes());
        } else if (0..=u32::MAX as i64).contains(&i) {
            out.push(0xce);
            out.extend_from_slice(&(i as u32).to_be_bytes());
        } else if i >= 0 {
            out.push(0xcf);
            out.extend_from_slice(&(i as u64).to_be_bytes());
        } else {
            out.push(0xd3);
            out.extend_from_slice(&i.to_be_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::enc::{to_vec, V};
    use super::*;

    #[test]
    fn scalars_of_every_format_decode() {
        let cases: &[(&[u8], Value)] = &[
            (&[0x05], Value::Int(5)),
            (&[0xff], Value::Int(-1)),
            (&[0xe0], Value::Int(-32)),
            (&[0xcc, 0xdc], Value::Int(220)),
            (&[0xcd, 0x23, 0xa5], Value::Int(9125)),
            (&[0xce, 0x00, 0x01, 0xf4, 0x00], Value::Int(128000)),
            (
                &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
                Value::Int(u64::MAX as i128),
            ),
            (&[0xd0, 0x80], Value::Int(-128)),
            (&[0xd1, 0xff, 0x00], Value::Int(-256)),
            (&[0xd2, 0xff, 0xff, 0xff, 0xff], Value::Int(-1)),
            (
                &[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0],
                Value::Int(i64::MIN as i128),
            ),
            (&[0xc0], Value::Nil),
            (&[0xc2], Value::Bool(false)),
            (&[0xc3], Value::Bool(true)),
            (&[0xca, 0x3f, 0x80, 0, 0], Value::Float(1.0)),
            (
                &[0xcb, 0x41, 0xda, 0xc3, 0x2c, 0x0e, 0x60, 0, 0],
                Value::Float(1795993657.5),
            ),
            (&[0xa2, b'h', b'i'], Value::Str(b"hi")),
            (&[0xd9, 0x02, b'h', b'i'], Value::Str(b"hi")),
            (&[0xda, 0, 0x02, b'h', b'i'], Value::Str(b"hi")),
            (&[0xdb, 0, 0, 0, 0x02, b'h', b'i'], Value::Str(b"hi")),
            (&[0xc4, 0x01, 0x07], Value::Bin(&[7])),
            (&[0xc5, 0, 0x01, 0x07], Value::Bin(&[7])),
            (&[0xc6, 0, 0, 0, 0x01, 0x07], Value::Bin(&[7])),
            (&[0xd4, 0x03, 0x09], Value::Ext(3, &[9])),
            (&[0xd5, 0x03, 1, 2], Value::Ext(3, &[1, 2])),
            (&[0xc7, 0x01, 0x05, 0x09], Value::Ext(5, &[9])),
            (&[0xc8, 0, 0x01, 0x05, 0x09], Value::Ext(5, &[9])),
            (&[0xc9, 0, 0, 0, 0x01, 0x05, 0x09], Value::Ext(5, &[9])),
        ];
        for (bytes, want) in cases {
            let d = decode(bytes);
            assert_eq!(&d.value, want, "{bytes:02x?}");
            assert_eq!(d.status, Status::Complete, "{bytes:02x?}");
            assert_eq!(d.consumed, bytes.len(), "{bytes:02x?}");
        }
    }

    #[test]
    fn fixext16_payload_is_sixteen_bytes() {
        let mut b = vec![0xd8, 0x03];
        b.extend_from_slice(&[0xaa; 16]);
        b.push(0xc0);
        let d = decode(&b);
        assert_eq!(d.value, Value::Ext(3, &[0xaa; 16]));
        assert_eq!(d.consumed, 18);
    }

    #[test]
    fn nested_containers_and_map_lookup() {
        let doc = V::A(vec![
            V::S("req-1"),
            V::A((0..40).map(|i| V::I(i * 1000)).collect()),
            V::M(vec![("temperature", V::F(0.7)), ("max_tokens", V::I(64))]),
        ]);
        let b = to_vec(&doc);
        let d = decode(&b);
        assert_eq!(d.status, Status::Complete);
        let (len, items) = d.value.as_array().unwrap();
        assert_eq!(len, 3);
        assert_eq!(items[0].as_str(), Some("req-1"));
        assert_eq!(items[1].as_array().unwrap().0, 40);
        assert_eq!(items[2].get("max_tokens").and_then(Value::as_u64), Some(64));
        assert_eq!(
            items[2].get("temperature").and_then(Value::as_f64),
            Some(0.7)
        );
        assert!(items[2].get("nope").is_none());
        assert!(!d.value.is_cut());
    }

    #[test]
    fn truncated_array_keeps_declared_length_and_earlier_siblings() {
        // [ "abc", [1000 × uint16], "tail" ] cut in the middle of the id array.
        let doc = V::A(vec![
            V::S("abc"),
            V::A((0..1000).map(|_| V::I(300)).collect()),
            V::S("tail"),
        ]);
        let b = to_vec(&doc);
        for cut in [8, 9, 10, 11, 100, 2000] {
            let d = decode(&b[..cut]);
            assert_eq!(d.status, Status::Truncated, "cut {cut}");
            let (len, items) = d.value.as_array().unwrap();
            assert_eq!(len, 3);
            assert_eq!(items[0].as_str(), Some("abc"));
            let (n, ids) = items[1].as_array().unwrap();
            assert_eq!(n, 1000, "count comes from the header (cut {cut})");
            assert!(ids.len() < 1000);
            assert_eq!(items.len(), 2, "nothing after the cut");
            assert!(d.value.is_cut());
        }
        // Cut inside the array header itself (dc 03 e8): the count is unknown.
        let d = decode(&b[..6]);
        let (_, items) = d.value.as_array().unwrap();
        assert_eq!(items[1], Value::Truncated(None));
    }

    #[test]
    fn truncated_string_is_never_returned_partially() {
        let b = to_vec(&V::A(vec![V::S("chatcmpl-abc123def4567890-1a2b3c4d")]));
        let d = decode(&b[..10]);
        assert_eq!(d.status, Status::Truncated);
        assert_eq!(
            d.value.as_array().unwrap().1,
            &[Value::Truncated(Some(Kind::Str))]
        );
        // A cut float is reported as a cut header.
        let d = decode(&[0x91, 0xcb, 0x41, 0xda]);
        assert_eq!(d.value.as_array().unwrap().1, &[Value::Truncated(None)]);
    }

    #[test]
    fn invalid_marker_stops_decoding() {
        let d = decode(&[0x93, 0x01, 0xc1, 0x02]);
        assert_eq!(d.status, Status::Invalid);
        assert_eq!(
            d.value.as_array().unwrap().1,
            &[Value::Int(1), Value::Invalid]
        );
    }

    #[test]
    fn deep_nesting_is_skipped_not_recursed() {
        // 100k nested arrays then a nil: depth limit skips iteratively.
        let mut b = vec![0x91; 100_000];
        b.push(0xc0);
        b.push(0x07);
        let d = decode(&b);
        assert_eq!(d.status, Status::Complete);
        assert_eq!(d.consumed, 100_001);
        let mut v = &d.value;
        let mut depth = 0;
        while let Value::Array { items, .. } = v {
            v = &items[0];
            depth += 1;
        }
        assert_eq!(depth, MAX_DEPTH);
        assert!(matches!(v, Value::Skipped(Kind::Array, b) if b.len() == 100_001 - MAX_DEPTH), "{v:?}");
    }

    #[test]
    fn huge_declared_lengths_do_not_allocate_or_spin() {
        for b in [
            &[0xdd, 0xff, 0xff, 0xff, 0xff][..],
            &[0xdf, 0xff, 0xff, 0xff, 0xff, 0x01],
            &[0xdb, 0xff, 0xff, 0xff, 0xff, b'a'],
            &[0xc9, 0xff, 0xff, 0xff, 0xff, 0x01],
            &[0x91, 0xdd, 0xff, 0xff, 0xff, 0xff, 0x01, 0x02],
        ] {
            let d = decode(b);
            assert_eq!(d.status, Status::Truncated, "{b:02x?}");
        }
        // Skipping (beyond the depth limit) of a huge array stops at once.
        let mut b = vec![0x91; MAX_DEPTH];
        b.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff, 0, 0, 0]);
        assert_eq!(decode(&b).status, Status::Truncated);
    }

    #[test]
    fn node_limit_skips_the_rest_but_keeps_lengths() {
        let n = MAX_NODES + 10_000;
        let doc = V::A((0..n).map(|_| V::I(1)).collect());
        let b = to_vec(&doc);
        let d = decode(&b);
        assert_eq!(d.status, Status::Complete);
        assert_eq!(d.consumed, b.len());
        let (len, items) = d.value.as_array().unwrap();
        assert_eq!(len as usize, n);
        assert_eq!(items.len(), n);
        // The root is node 1: its items 0.. are nodes 2.., the last one
        // materialised is node MAX_NODES.
        assert_eq!(items[MAX_NODES - 2], Value::Int(1));
        assert_eq!(items[MAX_NODES - 1], Value::Skipped(Kind::Int, &[1]));
        assert!(items[MAX_NODES - 1..].iter().all(|v| *v == Value::Skipped(Kind::Int, &[1])));
        assert!(!d.value.is_cut() && d.value.is_partial());
        // Nested: the container the budget ran out in ends partial, and so
        // does every container around it; earlier siblings stay whole.
        // Nodes: root 1, [p ints] 2..=2+p, the map array 3+p, map j 4+p+3j,
        // its key 5+p+3j: p is chosen so the budget ends on map j's key.
        let p = (MAX_NODES - 5) % 3;
        let j = (MAX_NODES - 5 - p) / 3;
        let doc = V::A(vec![
            V::A((0..p).map(|_| V::I(1)).collect()),
            V::A((0..j + 2).map(|_| V::M(vec![("k", V::I(1))])).collect()),
        ]);
        let b = to_vec(&doc);
        let d = decode(&b);
        let (_, items) = d.value.as_array().unwrap();
        assert!(!items[0].is_partial());
        assert!(items[1].is_partial() && d.value.is_partial() && !d.value.is_cut());
        let (_, maps) = items[1].as_array().unwrap();
        assert!(!maps[j - 1].is_partial());
        assert_eq!(maps[j].get("k"), Some(&Value::Skipped(Kind::Int, &[1])));
        assert!(maps[j].is_partial());
        assert_eq!(maps[j + 1], Value::Skipped(Kind::Map, &[0x81, 0xa1, b'k', 1]));
    }

    #[test]
    fn a_document_within_the_kept_frame_never_reaches_the_node_budget() {
        // One byte per node, the densest msgpack there is (positive fixints),
        // as much as the ZMTP decoder keeps of a frame.
        let cap = crate::proto::zmtp::FRAME_CAPTURE_DEFAULT;
        let mut b = vec![0xdd];
        b.extend_from_slice(&((cap - 5) as u32).to_be_bytes());
        b.resize(cap, 0x01);
        let d = decode(&b);
        assert_eq!((d.status, d.consumed), (Status::Complete, cap));
        assert!(!d.value.is_partial());
        assert!(MAX_NODES >= cap, "the node budget must cover the kept frame");
    }

    #[test]
    fn peek_header_reads_counts() {
        assert_eq!(peek_header(&[0xdc, 0x00, 0x25]), Some((Kind::Array, 37)));
        assert_eq!(peek_header(&[0x99]), Some((Kind::Array, 9)));
        assert_eq!(peek_header(&[0x82, 0xa4]), Some((Kind::Map, 2)));
        assert_eq!(peek_header(&[0xdc, 0x00]), None);
        assert_eq!(peek_header(&[]), None);
        assert_eq!(peek_header(&[0xc1]), None);
    }

    #[test]
    fn every_prefix_and_random_garbage_never_panics() {
        let doc = V::A(vec![
            V::S("x"),
            V::M(vec![
                ("a", V::A(vec![V::F(1.5), V::Nil, V::B(true)])),
                ("b", V::I(-70000)),
            ]),
            V::I(1 << 40),
        ]);
        let b = to_vec(&doc);
        for n in 0..=b.len() {
            let d = decode(&b[..n]);
            assert_eq!(d.status == Status::Complete, n == b.len(), "prefix {n}");
            assert!(d.consumed <= n);
        }
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..20_000 {
            let len = (x % 64) as usize;
            let mut buf = Vec::with_capacity(len);
            for _ in 0..len {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                buf.push(x as u8);
            }
            let d = decode(&buf);
            assert!(d.consumed <= buf.len());
        }
    }
}
