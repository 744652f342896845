//! The bytes `serde_json::to_writer_pretty` gives (two spaces a level,
//! `"key": value`, one array element per line, `[]`/`{}` when empty, its
//! string escaping, its float digits, `null` for non-finite floats), written
//! straight into a buffer: the streamed report's hot objects (requests,
//! chains, the summary) go through here instead of serde's per-field
//! formatter calls, which were a quarter of `hopscope report --json`. The
//! serde derives stay the definition; the tests hold the two to the same
//! bytes.

use serde_json::ser::{CompactFormatter, Formatter as _};

/// A newline and the indent of the deepest level the report reaches (16).
const NL_INDENT: &[u8; 33] = b"\n                                ";

/// A newline and the indent of `level`, written at once.
#[inline]
pub fn newline(b: &mut Vec<u8>, level: usize) {
    let n = 2 * level;
    if n < NL_INDENT.len() {
        // A fixed-size copy cut back to length: no call for a short copy.
        let at = b.len();
        b.extend_from_slice(NL_INDENT);
        b.truncate(at + n + 1);
        return;
    }
    b.push(b'\n');
    b.resize(b.len() + n, b' ');
}

// serde_json's escape table: the byte i is written as `\x` when ESCAPE[i] is
// `x`, as `\u00XX` when it is `u`, as itself when 0.
const UU: u8 = b'u';
const __: u8 = 0;
static ESCAPE: [u8; 256] = {
    let mut t = [__; 256];
    let mut i = 0;
    while i < 0x20 {
        t[i] = UU;
        i += 1;
    }
    t[0x08] = b'b';
    t[0x09] = b't';
    t[0x0a] = b'n';
    t[0x0c] = b'f';
    t[0x0d] = b'r';
    t[b'"' as usize] = b'"';
    t[b'\\' as usize] = b'\\';
    t
};

/// A JSON string, escaped as serde_json escapes it.
pub fn string(b: &mut Vec<u8>, s: &str) {
    let bytes = s.as_bytes();
    b.reserve(bytes.len() + 2);
    b.push(b'"');
    // Most strings need no escape: one pass without early exit (vectorised)
    // finds out, and they go in whole.
    if !bytes.iter().fold(false, |a, &c| a | (c < 0x20) | (c == b'"') | (c == b'\\')) {
        b.extend_from_slice(bytes);
        b.push(b'"');
        return;
    }
    let mut start = 0;
    for (i, &c) in bytes.iter().enumerate() {
        let e = ESCAPE[c as usize];
        if e == 0 {
            continue;
        }
        b.extend_from_slice(&bytes[start..i]);
        start = i + 1;
        if e == UU {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            b.extend_from_slice(&[b'\\', b'u', b'0', b'0', HEX[(c >> 4) as usize], HEX[(c & 0xf) as usize]]);
        } else {
            b.extend_from_slice(&[b'\\', e]);
        }
    }
    b.extend_from_slice(&bytes[start..]);
    b.push(b'"');
}

/// A float as serde_json prints it (its formatter's digits; `null` when not finite).
#[inline]
pub fn float(b: &mut Vec<u8>, v: f64) {
    if !milli(b, v) {
        float_slow(b, v)
    }
}

fn float_slow(b: &mut Vec<u8>, v: f64) {
    if v.is_finite() {
        // Writing to a Vec cannot fail.
        let _ = CompactFormatter.write_f64(b, v);
    } else {
        b.extend_from_slice(b"null");
    }
}

/// "00" to "99".
const PAIRS: &[u8; 200] = b"0001020304050607080910111213141516171819\
2021222324252627282930313233343536373839\
4041424344454647484950515253545556575859\
6061626364656667686970717273747576777879\
8081828384858687888990919293949596979899";

/// Most of the report's floats are milliseconds made of nanoseconds
/// (`ns as f64 / 1e6`). When `v` is exactly that for a whole `ns` of at most
/// 15 digits, `ns / 10^6` written out is the shortest decimal that reads back
/// as `v` (any other of at most 15 digits is further away than the float's
/// spacing), which is what serde_json's formatter prints; between 1e-5 and
/// 1e15 it prints it in fixed notation, as `int.frac` with at least one
/// fraction digit. Writes that, or returns false.
#[inline]
fn milli(b: &mut Vec<u8>, v: f64) -> bool {
    const MAX_NS: f64 = 1e15;
    if !(v >= 1e-5 && v * 1e6 < MAX_NS) {
        return false;
    }
    // Any whole number that passes the check below will do: no libm round.
    let ns = (v * 1e6 + 0.5) as u64;
    if ns as f64 / 1e6 != v {
        return false;
    }
    uint(b, ns / 1_000_000);
    let frac = (ns % 1_000_000) as usize;
    if frac == 0 {
        b.extend_from_slice(b".0");
        return true;
    }
    // Six fraction digits two at a time, then the trailing zeros cut.
    let [p, q, r] = [frac / 10_000, frac / 100 % 100, frac % 100].map(|x| &PAIRS[2 * x..2 * x + 2]);
    let d = [b'.', p[0], p[1], q[0], q[1], r[0], r[1]];
    let keep = 1 + d.iter().rposition(|&c| c != b'0').unwrap_or(0);
    let at = b.len();
    b.extend_from_slice(&d);
    b.truncate(at + keep);
    true
}

pub fn uint(b: &mut Vec<u8>, v: u64) {
    let _ = CompactFormatter.write_u64(b, v);
}

pub fn int(b: &mut Vec<u8>, v: i64) {
    let _ = CompactFormatter.write_i64(b, v);
}

/// One value that knows how to write itself.
pub trait Value {
    fn write(&self, b: &mut Vec<u8>, level: usize);
}

impl Value for f64 {
    fn write(&self, b: &mut Vec<u8>, _: usize) {
        float(b, *self)
    }
}

impl Value for u64 {
    fn write(&self, b: &mut Vec<u8>, _: usize) {
        uint(b, *self)
    }
}

impl Value for u32 {
    fn write(&self, b: &mut Vec<u8>, _: usize) {
        uint(b, u64::from(*self))
    }
}

impl Value for u16 {
    fn write(&self, b: &mut Vec<u8>, _: usize) {
        uint(b, u64::from(*self))
    }
}

impl Value for usize {
    fn write(&self, b: &mut Vec<u8>, _: usize) {
        uint(b, *self as u64)
    }
}

impl Value for i32 {
    fn write(&self, b: &mut Vec<u8>, _: usize) {
        int(b, i64::from(*self))
    }
}

impl Value for i64 {
    fn write(&self, b: &mut Vec<u8>, _: usize) {
        int(b, *self)
    }
}

impl Value for bool {
    fn write(&self, b: &mut Vec<u8>, _: usize) {
        b.extend_from_slice(if *self { b"true" } else { b"false" })
    }
}

impl Value for str {
    fn write(&self, b: &mut Vec<u8>, _: usize) {
        string(b, self)
    }
}

impl Value for std::sync::Arc<str> {
    fn write(&self, b: &mut Vec<u8>, indent: usize) {
        (**self).write(b, indent)
    }
}

impl Value for String {
    fn write(&self, b: &mut Vec<u8>, _: usize) {
        string(b, self)
    }
}

impl<T: Value + ?Sized> Value for &T {
    fn write(&self, b: &mut Vec<u8>, level: usize) {
        (**self).write(b, level)
    }
}

impl<T: Value> Value for Option<T> {
    fn write(&self, b: &mut Vec<u8>, level: usize) {
        match self {
            Some(v) => v.write(b, level),
            None => b.extend_from_slice(b"null"),
        }
    }
}

impl<T: Value> Value for [T] {
    fn write(&self, b: &mut Vec<u8>, level: usize) {
        array(b, level, self.iter())
    }
}

impl<T: Value> Value for Vec<T> {
    fn write(&self, b: &mut Vec<u8>, level: usize) {
        array(b, level, self.iter())
    }
}

impl<T: Value> Value for std::collections::BTreeMap<String, T> {
    fn write(&self, b: &mut Vec<u8>, level: usize) {
        let mut o = Obj::new(b, level);
        for (k, v) in self {
            o.entry(k, v);
        }
        o.end();
    }
}

/// An array whose closing bracket sits at `level`.
pub fn array<T: Value>(b: &mut Vec<u8>, level: usize, items: impl IntoIterator<Item = T>) {
    b.push(b'[');
    let mut any = false;
    for v in items {
        if any {
            b.push(b',');
        }
        any = true;
        newline(b, level + 1);
        v.write(b, level + 1);
    }
    if any {
        newline(b, level);
    }
    b.push(b']');
}

/// An object being written; its closing brace sits at `level`.
pub struct Obj<'b> {
    b: &'b mut Vec<u8>,
    level: usize,
    any: bool,
}

impl<'b> Obj<'b> {
    pub fn new(b: &'b mut Vec<u8>, level: usize) -> Self {
        b.push(b'{');
        Obj { b, level, any: false }
    }

    /// The next key (plain ASCII, as the report's field names are).
    #[inline(always)]
    fn key(&mut self, k: &str) {
        debug_assert!(k.bytes().all(|c| ESCAPE[c as usize] == 0));
        self.b.reserve(2 * self.level + k.len() + 8);
        if self.any {
            self.b.push(b',');
        }
        self.any = true;
        newline(self.b, self.level + 1);
        self.b.push(b'"');
        self.b.extend_from_slice(k.as_bytes());
        self.b.extend_from_slice(b"\": ");
    }

    /// A map's entry: its key escaped.
    pub fn entry<T: Value + ?Sized>(&mut self, k: &str, v: &T) -> &mut Self {
        if self.any {
            self.b.push(b',');
        }
        self.any = true;
        newline(self.b, self.level + 1);
        string(self.b, k);
        self.b.extend_from_slice(b": ");
        v.write(self.b, self.level + 1);
        self
    }

    #[inline(always)]
    pub fn field<T: Value + ?Sized>(&mut self, k: &str, v: &T) -> &mut Self {
        self.key(k);
        v.write(self.b, self.level + 1);
        self
    }

    /// A field holding an array of `items`.
    pub fn array<T: Value>(&mut self, k: &str, items: impl IntoIterator<Item = T>) -> &mut Self {
        self.key(k);
        array(self.b, self.level + 1, items);
        self
    }

    /// [`Obj::array`] of a list that grows with the run: whenever the
    /// buffer holds `chunk` bytes it goes to `out` (and is emptied).
    pub fn array_flushed<T: Value>(&mut self, k: &str, items: &[T], chunk: usize, out: &mut dyn std::io::Write) -> std::io::Result<&mut Self> {
        self.key(k);
        let level = self.level + 1;
        self.b.push(b'[');
        for (i, v) in items.iter().enumerate() {
            if i > 0 {
                self.b.push(b',');
            }
            newline(self.b, level + 1);
            v.write(self.b, level + 1);
            if self.b.len() >= chunk {
                out.write_all(self.b)?;
                self.b.clear();
            }
        }
        if !items.is_empty() {
            newline(self.b, level);
        }
        self.b.push(b']');
        Ok(self)
    }

    /// A field holding an object, written by `f`; `None` writes `null`.
    pub fn object<T>(&mut self, k: &str, v: Option<T>, f: impl FnOnce(&mut Obj, T)) -> &mut Self {
        self.key(k);
        match v {
            Some(v) => {
                let mut o = Obj::new(self.b, self.level + 1);
                f(&mut o, v);
                o.end();
            }
            None => self.b.extend_from_slice(b"null"),
        }
        self
    }

    pub fn end(self) {
        if self.any {
            newline(self.b, self.level);
        }
        self.b.push(b'}');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Serialize)]
    struct Edge {
        s: String,
        o: Option<String>,
        none: Option<String>,
        f: Vec<f64>,
        of: Vec<Option<f64>>,
        empty: Vec<f64>,
        empty_s: Vec<String>,
        n: u64,
        i: i32,
        b: bool,
        inner: Option<Inner>,
        inner_none: Option<Inner>,
        m: std::collections::BTreeMap<String, f64>,
        m_empty: std::collections::BTreeMap<String, f64>,
    }

    #[derive(serde::Serialize)]
    struct Inner {
        x: f64,
        v: Vec<String>,
    }

    fn write_edge(b: &mut Vec<u8>, e: &Edge) {
        let mut o = Obj::new(b, 0);
        o.field("s", &e.s).field("o", &e.o).field("none", &e.none).field("f", &e.f).field("of", &e.of).field("empty", &e.empty).field("empty_s", &e.empty_s);
        o.field("n", &e.n).field("i", &e.i).field("b", &e.b);
        for (k, v) in [("inner", &e.inner), ("inner_none", &e.inner_none)] {
            o.object(k, v.as_ref(), |o, x| {
                o.field("x", &x.x).field("v", &x.v);
            });
        }
        o.field("m", &e.m).field("m_empty", &e.m_empty);
        o.end();
    }

    fn serde_float(v: f64) -> String {
        serde_json::to_string(&v).unwrap()
    }

    fn ours(v: f64) -> String {
        let mut b = Vec::new();
        float(&mut b, v);
        String::from_utf8(b).unwrap()
    }

    #[test]
    fn json_floats_of_whole_nanoseconds_print_as_serde_json_prints_them() {
        let ms = |ns: u64| ns as f64 / 1e6;
        // Every value up to 0.3 s, around each power of ten, near the 1e15 ns
        // cut and the 2^53 limit, and a spread of pseudo-random ones.
        let mut ns: Vec<u64> = (0..300_000).collect();
        for p in 0..=16 {
            let t = 10u64.pow(p);
            ns.extend(t.saturating_sub(3)..t + 3);
        }
        ns.extend((1u64 << 53) - 3..(1u64 << 53) + 3);
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..1_000_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ns.push(x >> (x % 50));
        }
        for &n in &ns {
            let v = ms(n);
            assert_eq!(ours(v), serde_float(v), "{n} ns");
            // The short path takes every whole count it may (1e-5 ms to 1e9 ms).
            assert_eq!(milli(&mut Vec::new(), v), (10..1_000_000_000_000_000).contains(&n), "{n} ns");
            // Neighbours and derived values mostly take the formatter's path.
            for w in [f64::from_bits(v.to_bits() + 1), v / 3.0, v * 1.000_001, -v] {
                assert_eq!(ours(w), serde_float(w), "{w:e}");
            }
        }
    }

    #[test]
    fn json_writer_gives_serde_json_pretty_bytes_on_edge_values() {
        let nasty = "q\"uote\\back/slash\u{0}\u{1}\u{8}\t\n\u{b}\u{c}\r\u{1f}\u{7f} é 日本 🚀 end".to_owned();
        let floats = vec![
            0.0,
            -0.0,
            1.0,
            -1.5,
            0.1,
            1e-7,
            5e-324,
            f64::MIN_POSITIVE,
            1e15,
            1e16,
            1.7976931348623157e308,
            123456789.12345679,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            2.0f64.powi(53),
            1.0 / 3.0,
            22.488,
        ];
        let e = Edge {
            s: nasty.clone(),
            o: Some(String::new()),
            none: None,
            f: floats.clone(),
            of: floats.iter().map(|&x| Some(x)).chain([None]).collect(),
            empty: Vec::new(),
            empty_s: Vec::new(),
            n: u64::MAX,
            i: i32::MIN,
            b: true,
            inner: Some(Inner { x: f64::NAN, v: vec![nasty.clone(), String::new()] }),
            inner_none: None,
            m: [(nasty.clone(), 1.25), ("p99".to_owned(), f64::INFINITY)].into_iter().collect(),
            m_empty: Default::default(),
        };
        let mut b = Vec::new();
        write_edge(&mut b, &e);
        assert_eq!(String::from_utf8(b).unwrap(), serde_json::to_string_pretty(&e).unwrap());
        // Deeper than the indent table, and every float alone.
        let mut b = Vec::new();
        array(&mut b, 40, floats.iter());
        let mut want = Vec::new();
        let mut ser = serde_json::Serializer::pretty(&mut want);
        serde::Serialize::serialize(&floats, &mut ser).unwrap();
        let want = String::from_utf8(want).unwrap().replace('\n', &format!("\n{}", " ".repeat(80)));
        assert_eq!(String::from_utf8(b).unwrap(), want);
        for c in 0u8..=0x7f {
            let s = String::from(c as char);
            let mut b = Vec::new();
            string(&mut b, &s);
            assert_eq!(String::from_utf8(b).unwrap(), serde_json::to_string(&s).unwrap(), "byte {c:#x}");
        }
    }
}
