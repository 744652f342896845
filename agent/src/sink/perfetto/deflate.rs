//! A fast zlib compressor for the writer's batches (`Encoding::level` 1):
//! greedy LZ77 with one probe per position (the last match's distance, else
//! a hash table of 5-byte prefixes) and deflate's fixed Huffman
//! codes, written in one pass (no symbol buffer, no code tables to build:
//! a match's literals wait in the input until it is found).
//! Packets repeat their field layout and most of their values, so matches
//! carry the ratio and dynamic codes add little: against miniz_oxide's level
//! 1 it compresses about three times as fast (570 against 190 MB/s on one
//! core of the dev VM), for 12 % more bytes on the bench's bare kernel
//! slices (12.3 against 10.9 bytes per slice, tests.rs) and 9 % fewer on a
//! synthetic 20 000-request recording's trace (its hash table is 4x
//! miniz's, and the last distance is tried first). Since then: a 5-byte
//! hash in a table 4x as large, 15 % faster and 3 % smaller on a
//! 100 000-request trace (600 → 680 MB/s). Then distance codes from a
//! table and the checksum's lanes counted in 16 bits: 9 % fewer
//! instructions, the same bytes. Then (issue #8) fewer values live in
//! the loop and fewer bounds checks: literals written with their match,
//! or six to a store; the output a slice advanced per store; code tables
//! as statics; the last distance not tried right after a match it ended
//! (it cannot match there) and in a run of literals only at its first
//! position (+0.16 % bytes); longer matches compared as fixed-length
//! arrays; the match's tail hashed only after matches over 8 bytes
//! (+0.14 %). `hopscope trace` of the 20 000-request
//! recording (callgrind): 565 → 433 M instructions in the writer's
//! `write_batch`, 8.10 → 8.12 MB written (+0.3 %); the compressor alone
//! over that trace's 650 batches, 645 → 737 MB/s; `hopscope trace` of the
//! 100 000-request recording, 1.84 → 1.75 s of CPU (best of 7, the VM's
//! other core busy: noisy).
//! Tried and dropped: finding all of a batch's matches before writing any
//! (two loops, 8 % more instructions) and earlier batches' positions kept
//! in the table as guesses (5 % fewer instructions, 20 % slower: their
//! failed comparisons mispredict). The output is a plain zlib stream (RFC 1950 around
//! one fixed-code block of RFC 1951): any inflate reads it, trace
//! processor's included.

/// Hash table slots (positions of the latest occurrence of a 5-byte
/// prefix): as many as a batch has positions. A quarter of that (the
/// table in L1) ran 15 % slower and wrote 3 % more: its collisions cost a
/// failed comparison, a mispredicted branch, more than the cache misses
/// of the larger table.
const HASH_BITS: u32 = 16;
/// Deflate's window.
const WINDOW: usize = 32 * 1024;
const MAX_MATCH: usize = 258;

/// Lengths 3..=258: base of each length symbol (257..=285) and its extra bits.
const LEN_BASE: [u16; 29] = [3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17, 19, 23, 27, 31, 35, 43, 51, 59, 67, 83, 99, 115, 131, 163, 195, 227, 258];
const LEN_EXTRA: [u8; 29] = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 0];

/// The compressor: its hash table, reused across batches.
pub struct FastZlib {
    /// Per hash: the latest position with that prefix, counted from the
    /// first batch's start (`base` + index in its batch), so that the table
    /// need not be cleared per batch: older batches' positions are more
    /// than a window back from any in the current one, as is an empty slot
    /// (u32::MAX: the count starts at a window), which `probe`'s window
    /// check drops with no check of its own. (Taken as guesses, checked
    /// against the current batch's bytes, earlier batches' positions cost
    /// 20 % more time: the failed comparisons' mispredicted branches.)
    head: Box<[u32; 1 << HASH_BITS]>,
    /// The current batch's start in that count: past the previous batch's
    /// end by a window.
    base: u32,
}

/// The fixed codes, built at compile time: statics addressed from the
/// instruction pointer, so that the loop keeps no register (and spills
/// nothing) for them.
struct Codes {
    /// Per literal/length symbol: its fixed code, bit-reversed (deflate sends
    /// Huffman codes most significant bit first into an LSB-first stream),
    /// in bits 0-15, and its length in bits 16-23.
    lit: [u32; 288],
    /// Per match length 3..=258: the total bit count (bits 0-7: a shift
    /// by it takes it as it is) and the length symbol's code with its
    /// extra bits appended (8-31).
    len: [u32; MAX_MATCH + 1],
    /// Per distance - 1 under 256, then per 128 distances (zlib's
    /// `_dist_code` split: codes past 16 start at multiples of 128): the
    /// distance code bit-reversed less the first distance - 1 it codes
    /// shifted past it (bits 0-31: adding (distance - 1) << 5 gives the
    /// code with its extra bits appended), and the code's bit count with
    /// them (32-39). Three quarters of the matches take a distance other
    /// than the last one's (keeping the last one's code saved 0.5 %), and
    /// working the code out from the distance's bits cost 6 % of the
    /// compressor's instructions.
    dist: [u64; 512],
}

const fn reverse(code: u32, bits: u32) -> u32 {
    code.reverse_bits() >> (32 - bits)
}

static CODES: Codes = {
    let mut lit = [0u32; 288];
    let mut s = 0;
    while s < 288 {
        let v = s as u32;
        let (code, bits) = match v {
            0..=143 => (0x30 + v, 8),
            144..=255 => (0x190 + v - 144, 9),
            256..=279 => (v - 256, 7),
            _ => (0xc0 + v - 280, 8),
        };
        lit[s] = reverse(code, bits) | bits << 16;
        s += 1;
    }
    let mut len = [0u32; MAX_MATCH + 1];
    let mut l = 3;
    while l <= MAX_MATCH {
        let mut k = LEN_BASE.len() - 1;
        while LEN_BASE[k] as usize > l {
            k -= 1;
        }
        let (code, bits) = (lit[257 + k] & 0xffff, lit[257 + k] >> 16);
        len[l] = (code | (l as u32 - LEN_BASE[k] as u32) << bits) << 8 | (bits + LEN_EXTRA[k] as u32);
        l += 1;
    }
    let mut dist = [0u64; 512];
    let mut k = 0;
    while k < 512 {
        let dd = if k < 256 { k } else { (k - 256) << 7 } as u32;
        let (sym, extra) = if dd < 4 {
            (dd, 0)
        } else {
            let hb = 31 - dd.leading_zeros();
            (2 * hb + ((dd >> (hb - 1)) & 1), hb - 1)
        };
        let first = if sym < 4 { sym } else { (2 + (sym & 1)) << extra };
        dist[k] = (REV5[sym as usize] as u32).wrapping_sub(first << 5) as u64 | ((5 + extra) as u64) << 32;
        k += 1;
    }
    Codes { lit, len, dist }
};

impl Default for FastZlib {
    fn default() -> Self {
        Self::new()
    }
}

impl FastZlib {
    pub fn new() -> Self {
        // Built on the heap: 256 KiB is a lot for a debug build's stack.
        let head = vec![u32::MAX; 1 << HASH_BITS].into_boxed_slice().try_into().expect("the table's length");
        FastZlib { head, base: WINDOW as u32 }
    }

    /// Appends `input` as one zlib stream to `out`.
    pub fn compress(&mut self, input: &[u8], out: &mut Vec<u8>) {
        let at = out.len();
        let end = self.compress_at(input, out, at);
        out.truncate(end);
    }

    /// Writes `input` as one zlib stream into `buf` from `at` and returns
    /// where it ends. `buf` is grown to the worst case's length when
    /// shorter and never shrunk, and what follows the stream in it is left
    /// as it is: a caller that keeps its buffer's length (the writer's outer
    /// packet) does not have it zeroed again for every batch, as a `Vec`
    /// truncated and resized would be.
    pub fn compress_at(&mut self, input: &[u8], buf: &mut Vec<u8>, at: usize) -> usize {
        // Header, 9 bits at most per literal, the block header and end code,
        // the 8 bytes each store of the bit writer writes, the checksum.
        let need = at + 2 + input.len() + input.len() / 8 + 16 + 4;
        if buf.len() < need {
            // Exact: the writer's memory is its batch and this outer packet.
            buf.reserve_exact(need - buf.len());
            buf.resize(need, 0);
        }
        // CMF: deflate, 32 KiB window; FLG: fastest, no dictionary, check bits.
        buf[at..at + 2].copy_from_slice(&[0x78, 0x01]);
        let mut w = Bits { out: &mut buf[at + 2..need - 4], acc: 0, n: 0 };
        let room = w.out.len();
        // BFINAL = 1, BTYPE = 01 (fixed codes).
        w.put(0b011, 3);
        let n = input.len();
        // Positions must stay below u32::MAX (the empty slot), and the next
        // batch's start a window further.
        if (self.base as usize).saturating_add(n).saturating_add(WINDOW) >= u32::MAX as usize {
            self.head.fill(u32::MAX);
            self.base = WINDOW as u32;
        }
        let (lit, mut w) = lz77(&mut self.head, self.base, input, w);
        // (Saturated, a batch of 4 GiB has the next one clear the table.)
        self.base = (self.base as usize + n + WINDOW).min(u32::MAX as usize) as u32;
        w.literals(&input[lit..]);
        let c = CODES.lit[256];
        w.put(u64::from(c & 0xffff), (c >> 16) as u8);
        let end = at + 2 + room - w.finish();
        buf[end..end + 4].copy_from_slice(&adler32(input).to_be_bytes());
        end + 4
    }
}

/// The greedy LZ77 pass over `input`, written into `w`: returns where the
/// literals not yet written start (those of the last 7 bytes included).
/// Literals wait until a match ends their run and are then written with
/// it, or several per store when more than two ([`Bits::literals`]): the
/// probe loop keeps no writer state in registers, and most positions are
/// literals.
#[inline(never)]
fn lz77<'a>(head: &mut [u32; 1 << HASH_BITS], base: u32, input: &[u8], mut w: Bits<'a>) -> (usize, Bits<'a>) {
    let n = input.len();
    let codes = &CODES;
    let mut i = 0;
    let mut lit = 0;
    // The last match's distance: packets repeat their layout, so after
    // a field that differs the next one often continues the same copy.
    // Tried before the hash table (in the window by construction, and
    // its bytes are recent, so the look-up is cheaper than the table's):
    // 2 % fewer bytes on a synthetic trace, and faster.
    // Never more than the position it is tried at (1 at first: it is
    // tried from the second position on, and then it is a match's
    // distance, at most its position), so that i - rep needs no check.
    let mut rep = 1;
    // Reading 8 bytes at a time needs that many left: positions below
    // `end` have them.
    let end = n.saturating_sub(7);
    let mut capped = false;
    'matches: while i < end {
        // Right after a match the last distance is the one that just
        // stopped matching (unless it stopped at the longest length): only
        // the table is tried there.
        let (mut d, mut x) = if capped { probe::<true>(head, base, input, i, rep) } else { probe::<false>(head, base, input, i, rep) };
        if d == 0 {
            i += 1;
            if i >= end {
                break 'matches;
            }
            (d, x) = probe::<true>(head, base, input, i, rep);
            while d == 0 {
                i += 1;
                if i >= end {
                    break 'matches;
                }
                (d, x) = probe::<false>(head, base, input, i, rep);
            }
        }
        let run = &input[lit..i];
        if run.len() > 2 {
            w.literals(run);
        } else {
            // Two literals and a match fit the accumulator with its 7 bits:
            // one store for all three.
            for &b in run {
                let c = codes.lit[usize::from(b)];
                w.add(u64::from(c & 0xffff), c >> 16);
            }
        }
        rep = d;
        let l;
        (l, capped) = if x != 0 { ((x.trailing_zeros() / 8) as usize, false) } else { long_match(input, i, i - d) };
        let lc = codes.len[l];
        let (dc, db) = dist_code(&codes.dist, d);
        let lb = lc as u8;
        w.put(u64::from(lc >> 8) | (u64::from(dc) << lb), lb + db);
        // The match's last position, so that the next packet's repeat of
        // this one's tail finds it: only after matches over 8 bytes (8 %
        // fewer of the compressor's instructions, for 0.14 % more bytes).
        let e = i + l - 1;
        if l > 8 {
            if let Some(tail) = input.get(e..e + 8) {
                head[hash5(u64::from_le_bytes(tail.try_into().expect("8 bytes")))] = base.wrapping_add(e as u32);
            }
        }
        i += l;
        lit = i;
    }
    (lit, w)
}

/// Looks for a match at `i` (below the loop's end: 8 bytes to read): the
/// last match's distance first when `REP`, then the hash table's latest
/// position with the same 5-byte prefix, which becomes `i`. Returns the
/// distance, 0 for none, and the candidate's first 8 bytes xor ours (a
/// match of 4 or more, and most often its length, from one comparison).
#[inline(always)]
fn probe<const REP: bool>(head: &mut [u32; 1 << HASH_BITS], base: u32, input: &[u8], i: usize, rep: usize) -> (usize, u64) {
    let now = read64(input, i);
    let h = hash5(now);
    if REP {
        let x = read64(input, i - rep) ^ now;
        if x as u32 == 0 {
            head[h] = base.wrapping_add(i as u32);
            return (rep, x);
        }
    }
    // Within the window, so within this batch (see `FastZlib::head`): i - d
    // does not wrap. (Past 4 GiB in one batch, positions wrap, but i is
    // past a window by then.)
    let pos = base.wrapping_add(i as u32);
    let d = pos.wrapping_sub(head[h]) as usize;
    head[h] = pos;
    if d.wrapping_sub(1) < WINDOW {
        let x = read64(input, i - d) ^ now;
        if x as u32 == 0 {
            return (d, x);
        }
    }
    (0, 0)
}

/// The table slot of the 5 bytes at the bottom of `v` (read little-endian
/// at a position). Five, not four: fewer short matches that end a longer
/// copy early, and fewer collisions that cost a failed comparison.
#[inline]
fn hash5(v: u64) -> usize {
    ((v << 24).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - HASH_BITS)) as usize
}

/// The length of a match at `i` from `cand` whose first 8 bytes are
/// known to be equal, and whether it is the longest it can be (deflate's
/// longest or the input's end).
#[inline(always)]
fn long_match(input: &[u8], i: usize, cand: usize) -> (usize, bool) {
    const SPAN: usize = MAX_MATCH + 6;
    if let (Some(a), Some(b)) = (input.get(cand..cand + SPAN), input.get(i..i + SPAN)) {
        // Away from the end: compared as arrays of a fixed length, with
        // no bounds checks per word.
        let (a, b): (&[u8; SPAN], &[u8; SPAN]) = (a.try_into().expect("the span"), b.try_into().expect("the span"));
        let mut l = 8;
        while l + 8 <= SPAN {
            let x = u64::from_le_bytes(a[l..l + 8].try_into().expect("8 bytes")) ^ u64::from_le_bytes(b[l..l + 8].try_into().expect("8 bytes"));
            if x != 0 {
                let l = (l + (x.trailing_zeros() / 8) as usize).min(MAX_MATCH);
                return (l, l == MAX_MATCH);
            }
            l += 8;
        }
        (MAX_MATCH, true)
    } else {
        let max = (input.len() - i).min(MAX_MATCH);
        let l = common(&input[cand..], &input[i..i + max]);
        (l, l == max)
    }
}

/// How many leading bytes `a` and `b` share (sliced to one length by the
/// caller).
#[inline]
fn common(a: &[u8], b: &[u8]) -> usize {
    let mut l = 0;
    for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        let x = u64::from_le_bytes(x.try_into().expect("8 bytes")) ^ u64::from_le_bytes(y.try_into().expect("8 bytes"));
        if x != 0 {
            return l + (x.trailing_zeros() / 8) as usize;
        }
        l += 8;
    }
    let max = a.len().min(b.len());
    while l < max && a[l] == b[l] {
        l += 1;
    }
    l
}

/// A distance's fixed 5-bit code (bit-reversed) with its extra bits
/// appended, and their bit count, from [`FastZlib`]'s `dist` table.
#[inline(always)]
fn dist_code(table: &[u64; 512], d: usize) -> (u32, u8) {
    let dd = (d - 1) as u32;
    // Distances are at most 32 768: dd >> 7 fits a byte (which spares a bounds check).
    let e = table[if dd < 256 { dd as usize } else { 256 + usize::from((dd >> 7) as u8) }];
    ((e as u32).wrapping_add(dd << 5), (e >> 32) as u8)
}

/// [`dist_code`] worked out from the distance's bits (what its table is
/// checked against).
#[cfg(test)]
fn dist_code_of(d: usize) -> (u32, u8) {
    let dd = (d - 1) as u32;
    let (sym, extra, val) = if dd < 4 {
        (dd, 0, 0)
    } else {
        let hb = 31 - dd.leading_zeros();
        let e = hb - 1;
        (2 * hb + ((dd >> e) & 1), e, dd & ((1 << e) - 1))
    };
    (u32::from(REV5[sym as usize]) | (val << 5), 5 + extra as u8)
}

/// The 5-bit distance codes, bit-reversed.
const REV5: [u8; 32] = {
    let mut t = [0u8; 32];
    let mut i = 0;
    while i < 32 {
        t[i] = ((i as u8).reverse_bits()) >> 3;
        i += 1;
    }
    t
};

/// The little-endian word at `i` (the interner's hash and compare read names this way too).
#[inline]
pub(super) fn read32(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"))
}

#[inline]
pub(super) fn read64(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"))
}

/// An LSB-first bit stream into a byte slice, sized up front for the
/// worst case so that every `put` stores the whole accumulator and keeps
/// only the bits of an unfinished byte: no branch on how full it is (which
/// the varying code lengths made unpredictable).
struct Bits<'a> {
    /// What is left of the output: the unfinished byte goes first.
    out: &'a mut [u8],
    acc: u64,
    /// Bits in `acc`: under 8 between stores, under 64 at a store.
    n: u32,
}

impl Bits<'_> {
    /// Up to 32 bits at once (a length, a distance and their extra bits fit).
    #[inline]
    fn put(&mut self, v: u64, bits: u8) {
        self.acc |= v << self.n;
        self.n += u32::from(bits);
        self.store();
    }

    /// Stores the accumulator and keeps the bits of an unfinished byte.
    /// The output is a slice advanced past whole bytes (`& 7` is what `n`
    /// allows, and lets the advance go unchecked): one bounds check per
    /// store, and no position to keep in a register.
    #[inline]
    fn store(&mut self) {
        self.out[..8].copy_from_slice(&self.acc.to_le_bytes());
        let whole = (self.n / 8) & 7;
        self.out = &mut std::mem::take(&mut self.out)[whole as usize..];
        self.acc >>= whole * 8;
        self.n -= whole * 8;
    }

    /// Up to 57 bits into the accumulator, not stored yet: the next put stores them.
    #[inline]
    fn add(&mut self, v: u64, bits: u32) {
        self.acc |= v << self.n;
        self.n += bits;
    }

    /// Literals, six to a store: the accumulator's 7 bits and six 9-bit
    /// codes fit in its 64.
    #[inline]
    fn literals(&mut self, bytes: &[u8]) {
        for run in bytes.chunks(6) {
            for &b in run {
                let c = CODES.lit[usize::from(b)];
                self.add(u64::from(c & 0xffff), c >> 16);
            }
            self.store();
        }
    }

    /// Pads to a byte boundary: how much of the output is left after it.
    fn finish(self) -> usize {
        self.out.len() - self.n.div_ceil(8) as usize
    }
}

/// RFC 1950's checksum, 32 bytes at a time in independent lanes (which
/// the compiler vectorises): per lane the sum of its bytes and the sum of
/// those sums before each chunk, combined per block into the two running
/// sums. About 2.5x the plain eight-byte loop, the checksum being a fifth
/// of the compressor's time before. The lanes count in 16 bits over up to
/// `INNER` chunks (twice the lanes per vector of 32-bit sums: half the
/// instructions again), then add into 32-bit ones.
fn adler32(data: &[u8]) -> u32 {
    const MOD: u64 = 65521;
    const LANES: usize = 32;
    // Chunks per block: a lane's prefix sum reaches 255 * n * (n - 1) / 2,
    // under 2^32 for n = 2048.
    const CHUNKS: usize = 2048;
    // Chunks per 16-bit count: a lane's prefix sum reaches
    // 255 * 22 * 21 / 2 = 58 905, under 2^16.
    const INNER: usize = 22;
    let (mut a, mut b) = (1u64, 0u64);
    for block in data.chunks(LANES * CHUNKS) {
        let whole = block.len() / LANES * LANES;
        let n = (whole / LANES) as u64;
        let mut sum = [0u32; LANES];
        let mut prefix = [0u32; LANES];
        for inner in block[..whole].chunks(LANES * INNER) {
            let m = (inner.len() / LANES) as u32;
            let (mut s16, mut p16) = ([0u16; LANES], [0u16; LANES]);
            for c in inner.chunks_exact(LANES) {
                let c: &[u8; LANES] = c.try_into().expect("exact chunks");
                for i in 0..LANES {
                    p16[i] += s16[i];
                    s16[i] += u16::from(c[i]);
                }
            }
            // The inner chunks each add the lane's sum so far to its prefix.
            for i in 0..LANES {
                prefix[i] += sum[i] * m + u32::from(p16[i]);
                sum[i] += u32::from(s16[i]);
            }
        }
        // b gains, per chunk, LANES times a before it plus each byte
        // weighted by how many of the chunk's sums it is in.
        let (mut sa, mut sp, mut sw) = (0u64, 0u64, 0u64);
        for i in 0..LANES {
            sa += u64::from(sum[i]);
            sp += u64::from(prefix[i]);
            sw += (LANES - i) as u64 * u64::from(sum[i]);
        }
        b += LANES as u64 * (n * a + sp) + sw;
        a += sa;
        for &x in &block[whole..] {
            a += u64::from(x);
            b += a;
        }
        a %= MOD;
        b %= MOD;
    }
    ((b << 16) | a) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::xorshift;

    fn roundtrip(data: &[u8]) -> usize {
        let mut z = FastZlib::new();
        let mut out = Vec::new();
        z.compress(data, &mut out);
        let back = miniz_oxide::inflate::decompress_to_vec_zlib(&out).expect("a valid zlib stream");
        assert_eq!(back, data, "round trip of {} bytes", data.len());
        out.len()
    }


    #[test]
    fn the_distance_table_gives_every_distance_its_code() {
        for d in 1..=WINDOW {
            assert_eq!(dist_code(&CODES.dist, d), dist_code_of(d), "distance {d}");
        }
        // RFC 1951's table at the edges of a few codes: code 4 is 5-6 (one
        // extra bit), code 16 is 257-384 (7), code 29 is 24577-32768 (13).
        for (d, sym, extra, v) in [(5u32, 4u32, 1u8, 0u32), (6, 4, 1, 1), (257, 16, 7, 0), (384, 16, 7, 127), (24_577, 29, 13, 0), (32_768, 29, 13, 8191)] {
            let rev = sym.reverse_bits() >> 27;
            assert_eq!(dist_code(&CODES.dist, d as usize), (rev | v << 5, 5 + extra), "distance {d}");
        }
    }

    #[test]
    fn fast_zlib_streams_inflate_to_their_input() {
        assert_eq!(roundtrip(b""), 2 + 1 + 4 + 1);
        roundtrip(b"a");
        roundtrip(b"abcdefgh");
        roundtrip(&[7u8; 100_000]);
        // Pseudo-random bytes (no matches) and text with repeats at every distance.
        let mut rnd = xorshift(0x1234_5678_9abc_def0);
        let noise: Vec<u8> = (0..70_000)
            .map(|_| rnd() as u8)
            .collect();
        roundtrip(&noise);
        let mut mixed = Vec::new();
        for k in 0..5_000u32 {
            mixed.extend_from_slice(format!("packet {k} track {} name kernel_{}\n", k % 7, k % 13).as_bytes());
            mixed.extend_from_slice(&noise[(k as usize * 37) % 60_000..][..(k % 50) as usize]);
        }
        let z = roundtrip(&mixed);
        let miniz = miniz_oxide::deflate::compress_to_vec_zlib(&mixed, 1).len();
        assert!(z < mixed.len() * 2 / 3 && z < miniz * 3 / 2, "{z} of {} bytes (miniz level 1: {miniz})", mixed.len());
        // Matches across the whole window and of the longest length.
        let mut far = noise[..WINDOW].to_vec();
        far.extend_from_slice(&noise[..WINDOW]);
        far.extend_from_slice(&noise[1..1000]);
        let z = roundtrip(&far);
        assert!(z < WINDOW + WINDOW / 4, "{z} bytes for a repeated window");
    }

    #[test]
    fn every_length_and_mix_of_matches_and_literals_inflates_to_its_input() {
        // Each store of the bit writer's accumulator runs 8 bytes ahead, and
        // the stream ends at any bit: every short length, over text, noise
        // and runs, and a seeded mix of copies from random distances (with
        // changed bytes inside) and fresh bytes, as packets look.
        let mut rnd = xorshift(0x2545_f491_4f6c_dd1d);
        let text: Vec<u8> = b"track_uuid name_iid debug_annotations ".iter().copied().cycle().take(400).collect();
        let noise: Vec<u8> = (0..400).map(|_| rnd() as u8).collect();
        for n in 0..=400 {
            roundtrip(&text[..n]);
            roundtrip(&noise[..n]);
            roundtrip(&vec![0xa5u8; n]);
        }
        for _ in 0..40 {
            let len = (rnd() % 150_000) as usize;
            let mut data: Vec<u8> = Vec::with_capacity(len);
            while data.len() < len {
                let k = rnd();
                if data.len() > 8 && !k.is_multiple_of(3) {
                    let d = 1 + (rnd() as usize) % data.len().min(WINDOW + 100);
                    let l = 3 + (rnd() as usize) % if k.is_multiple_of(5) { 400 } else { 24 };
                    for _ in 0..l {
                        let b = data[data.len() - d];
                        data.push(if rnd().is_multiple_of(97) { b ^ 1 } else { b });
                    }
                } else {
                    for _ in 0..1 + rnd() % 12 {
                        data.push(rnd() as u8);
                    }
                }
            }
            roundtrip(&data);
        }
    }

    #[test]
    fn literal_runs_of_every_length_and_matches_up_to_the_end_inflate_to_their_input() {
        let mut rnd = xorshift(0x0dd_ba11_cafe_f00d);
        let noise: Vec<u8> = (0..2_000).map(|_| rnd() as u8).collect();
        let block = &noise[..40];
        // Runs of 0 to 14 literals between repeats of one block: written with
        // the match (up to two) or six to a store, the last distance tried
        // at the run's first position.
        for run in 0..=14 {
            let mut data = Vec::new();
            for k in 0..50 {
                data.extend_from_slice(block);
                data.extend_from_slice(&noise[100 + k * 15..][..run]);
            }
            let z = roundtrip(&data);
            assert!(z < data.len() / 2 || run > 10, "{z} bytes for {} with runs of {run}", data.len());
        }
        // A match that reaches the input's end at every length up to past
        // the longest (compared word by word near the end, as arrays of a
        // fixed length further from it), and repeats of every length around
        // the longest match, continued by the last distance or not.
        for m in (0..=300).chain([511, 516, 517, 520, 600]) {
            let mut data = noise[..600].to_vec();
            data.extend_from_slice(&noise[..m]);
            roundtrip(&data);
            let mut runs = vec![9u8; m];
            runs.extend_from_slice(&noise[..20]);
            runs.extend(std::iter::repeat_n(9u8, m));
            roundtrip(&runs);
        }
    }

    #[test]
    fn a_reused_compressor_never_refers_to_an_earlier_batch() {
        // The hash table keeps earlier batches' positions: the same bytes
        // again (where a stale position would match at once), shorter and
        // longer batches, and the position count wrapping to a cleared table.
        let mut z = FastZlib::new();
        let packets: Vec<u8> = (0..3_000u32).flat_map(|k| format!("packet {k} track {} ts {}\n", k % 5, k * 37).into_bytes()).collect();
        let check = |z: &mut FastZlib, data: &[u8]| {
            let mut out = vec![0xee; 3];
            z.compress(data, &mut out);
            assert_eq!(&out[..3], &[0xee; 3], "what was in the buffer stays");
            let back = miniz_oxide::inflate::decompress_to_vec_zlib(&out[3..]).expect("a valid zlib stream");
            assert_eq!(back, data, "round trip of {} bytes", data.len());
        };
        for len in [packets.len(), packets.len(), 100, 9, 50_000, 70_000, packets.len()] {
            check(&mut z, &packets[..len.min(packets.len())]);
        }
        // Into a buffer kept at its length (the writer's outer packet), over
        // what earlier streams and anything else left there: only the
        // stream's own bytes are written, the rest stays.
        let mut buf = vec![0xff; 200_000];
        for len in [packets.len(), 9, 70_000, 0, packets.len()] {
            let data = &packets[..len.min(packets.len())];
            let end = z.compress_at(data, &mut buf, 14);
            assert_eq!(buf.len(), 200_000, "a long enough buffer keeps its length");
            assert_eq!(&buf[..14], &[0xff; 14], "what is before the stream stays");
            let back = miniz_oxide::inflate::decompress_to_vec_zlib(&buf[14..end]).expect("a valid zlib stream");
            assert_eq!(back, data, "round trip of {} bytes in a reused buffer", data.len());
        }
        let mut short = vec![0xff; 5];
        let end = z.compress_at(&packets, &mut short, 5);
        assert!(short.len() >= end, "a short buffer grows to hold the stream");
        assert_eq!(miniz_oxide::inflate::decompress_to_vec_zlib(&short[5..end]).expect("a valid zlib stream"), packets);
        // The count near its end: a batch that fits below it (its last
        // position and a window after it just under u32::MAX, the empty
        // slot's value), then one that does not, which clears the table and
        // starts over.
        let n = packets.len() as u32;
        z.base = u32::MAX - n - WINDOW as u32 - 1;
        check(&mut z, &packets);
        assert_eq!(z.base, u32::MAX - 1, "the count reaches its end");
        check(&mut z, &packets);
        assert_eq!(z.base, 2 * WINDOW as u32 + n, "the count restarts once it would reach u32::MAX");
        check(&mut z, &packets);
    }

    #[test]
    fn packet_like_batches_inflate_to_their_input_near_miniz_level_1s_size() {
        // Packets as the writer's batches hold them: one layout repeated with
        // a varying timestamp delta, track, name iid and value, batch after
        // batch through one compressor (its table holding the previous
        // batches' positions), with 4-byte prefixes shared by different
        // 5-byte ones (what the hash must tell apart).
        let mut rnd = xorshift(0x1234_5678_9abc_def1);
        let mut z = FastZlib::new();
        let (mut ours, mut miniz, mut raw) = (0, 0, 0);
        for _ in 0..6 {
            let mut batch = Vec::new();
            while batch.len() < 64 << 10 {
                let k = rnd();
                let delta = 100 + k % 30_000;
                batch.extend_from_slice(&[0x0a, 0x16, 0x5a, 0x0a, 0x48, 0x01, 0x50, (k >> 20) as u8 % 12 + 1, 0x58]);
                batch.push((k >> 28) as u8 % 100 + 1);
                batch.extend_from_slice(&[0x40, (delta as u8) | 0x80, (delta >> 7) as u8 & 0x7f, 0x50, 0x02, 0x68, 0x02]);
                if k.is_multiple_of(3) {
                    batch.extend_from_slice(&[0x22, 0x0b, 0x08, (k >> 40) as u8 % 7 + 1, 0x29]);
                    batch.extend_from_slice(&((k >> 8) as f64 / 1e6).to_le_bytes());
                }
            }
            let mut out = Vec::new();
            z.compress(&batch, &mut out);
            let back = miniz_oxide::inflate::decompress_to_vec_zlib(&out).expect("a valid zlib stream");
            assert_eq!(back, batch, "round trip of a {} byte batch", batch.len());
            ours += out.len();
            miniz += miniz_oxide::deflate::compress_to_vec_zlib(&batch, 1).len();
            raw += batch.len();
        }
        // Random figures are literals, where fixed codes lose to miniz's
        // dynamic ones: 55 % of the input and 12 % over miniz when written.
        assert!(ours < raw * 3 / 5 && ours < miniz * 6 / 5, "{ours} bytes for {raw} (miniz level 1: {miniz})");
    }

    /// RFC 1950's definition, a byte at a time.
    fn adler32_bytewise(data: &[u8]) -> u32 {
        let (mut a, mut b) = (1u64, 0u64);
        for &x in data {
            a = (a + u64::from(x)) % 65521;
            b = (b + a) % 65521;
        }
        (b << 16 | a) as u32
    }

    #[test]
    fn adler32_matches_the_rfc_example_and_the_bytewise_definition() {
        assert_eq!(adler32(b"Wikipedia"), 0x11e6_0398);
        assert_eq!(adler32(b""), 1);
        // All 0xff: the largest lane sums, across several blocks and with a
        // remainder after the last whole chunk.
        for n in [1, 31, 32, 33, 22 * 32 - 1, 22 * 32, 22 * 32 + 1, 23 * 32 + 5, 20_000, 65_536, 65_537, 200_003] {
            let ones = vec![0xffu8; n];
            assert_eq!(adler32(&ones), adler32_bytewise(&ones), "{n} bytes of 0xff");
        }
        let mut rnd = xorshift(0x9e37_79b9_7f4a_7c15);
        let noise: Vec<u8> = (0..150_001)
            .map(|_| (rnd() >> 24) as u8)
            .collect();
        for n in [0, 5, 64, 1000, 65_535, 70_000, 131_072, 150_001] {
            assert_eq!(adler32(&noise[..n]), adler32_bytewise(&noise[..n]), "{n} bytes of noise");
        }
    }
}
