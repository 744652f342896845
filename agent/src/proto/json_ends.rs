//! Members of a JSON object read from its two ends when the middle was not
//! captured: the probe keeps a syscall's first bytes and its last ones, so a
//! long body (an openai-python 1.x request: `messages` first, `model` and `stream`
//! after it; a long answer: `usage` last) arrives as a head and a tail with a
//! gap between.
//!
//! Both readers report only members whose key and value lie wholly in their
//! bytes and whose place in the object is certain:
//! - the head is parsed forwards by serde_json from the object's `{`, member by
//!   member, until the first one it cannot finish;
//! - the tail is read backwards from the object's closing `}`: a quote closes
//!   a string when an even number of backslashes precedes it, and the reader
//!   stops where it would need a byte before the tail (a string, number or
//!   escape run that reaches the tail's first byte), so depths and string
//!   boundaries are exact for everything it reports.
//!
//! The tail's values are handed out as raw JSON slices for the caller to
//! parse (so an invalid body yields nothing, never a wrong string).

use serde::de::{Deserializer as _, IgnoredAny, MapAccess, Visitor};
use serde_json::Value;

/// Deepest nesting the tail reader follows; past it, it stops.
const MAX_DEPTH: usize = 64;

/// What holds a member: the containers from the root object (depth 1) down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Object,
    Array,
}

/// The root object's members in `head` (the body's first bytes) whose key is
/// in `keys`, in order, each with its value.
pub(crate) fn head_members(head: &[u8], keys: &[&str]) -> Vec<(String, Value)> {
    struct Top<'k, 'o> {
        keys: &'k [&'k str],
        out: &'o mut Vec<(String, Value)>,
    }
    impl<'de> Visitor<'de> for Top<'_, '_> {
        type Value = ();
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<(), A::Error> {
            // A number at the head's end may be the start of a longer one:
            // kept once the object goes on after it.
            let mut number = None;
            while let Some(k) = m.next_key::<std::borrow::Cow<'de, str>>()? {
                self.out.extend(number.take());
                if self.keys.contains(&k.as_ref()) {
                    let v: Value = m.next_value()?;
                    if v.is_number() {
                        number = Some((k.into_owned(), v));
                    } else {
                        self.out.push((k.into_owned(), v));
                    }
                } else {
                    m.next_value::<IgnoredAny>()?;
                }
            }
            self.out.extend(number);
            Ok(())
        }
    }
    let mut out = Vec::new();
    let mut de = serde_json::Deserializer::from_slice(head);
    // The head ends inside some member: the error there is expected, and
    // every member before it was read whole.
    let _ = (&mut de).deserialize_map(Top { keys, out: &mut out });
    out
}

/// Every member of every object in `tail` (the body's last bytes) that can be
/// placed exactly, nearest the end first: `f(path, key, value)`, `path` the
/// kinds of the containers from the root object down to the one holding the
/// member (`[Object]` for the root's own members), `key` as written (escapes
/// not undone), `value` raw JSON. Nothing if `tail` does not end with `}`.
pub(crate) fn tail_members(tail: &[u8], mut f: impl FnMut(&[Kind], &[u8], &[u8])) {
    let mut r = Rev { w: tail, i: tail.len(), path: Vec::new() };
    r.ws();
    if r.peek() == Some(b'}') {
        let _ = r.object(&mut f);
    }
}

/// The reader stopped: the next byte it needs is before the tail, or the
/// bytes are not JSON.
struct Stop;

struct Rev<'a> {
    w: &'a [u8],
    /// Bytes before `i` are unread.
    i: usize,
    path: Vec<Kind>,
}

impl<'a> Rev<'a> {
    fn peek(&self) -> Option<u8> {
        self.i.checked_sub(1).map(|j| self.w[j])
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i -= 1;
        }
    }

    fn expect(&mut self, b: u8) -> Result<(), Stop> {
        self.ws();
        if self.peek() != Some(b) {
            return Err(Stop);
        }
        self.i -= 1;
        Ok(())
    }

    /// A value ending at the cursor (whitespace skipped): its raw bytes.
    fn value(&mut self, f: &mut impl FnMut(&[Kind], &[u8], &[u8])) -> Result<&'a [u8], Stop> {
        self.ws();
        let end = self.i;
        match self.peek().ok_or(Stop)? {
            b'"' => self.string()?,
            b'}' => self.object(f)?,
            b']' => self.array(f)?,
            b if is_scalar(b) => {
                while self.peek().is_some_and(is_scalar) {
                    self.i -= 1;
                }
                // A number cut by the tail's start would read as a shorter one.
                if self.i == 0 {
                    return Err(Stop);
                }
            }
            _ => return Err(Stop),
        }
        Ok(&self.w[self.i..end])
    }

    /// The string whose closing quote is just before the cursor.
    fn string(&mut self) -> Result<(), Stop> {
        let mut j = self.i - 1;
        loop {
            let q = self.w[..j].iter().rposition(|&b| b == b'"').ok_or(Stop)?;
            let run = self.w[..q].iter().rev().take_while(|&&b| b == b'\\').count();
            // The byte before the run must be in the tail: another backslash
            // before it would change the quote's meaning.
            if run == q {
                return Err(Stop);
            }
            if run % 2 == 0 {
                self.i = q;
                return Ok(());
            }
            j = q;
        }
    }

    /// The object whose `}` is just before the cursor; reports its members.
    fn object(&mut self, f: &mut impl FnMut(&[Kind], &[u8], &[u8])) -> Result<(), Stop> {
        self.enter(Kind::Object)?;
        self.ws();
        if self.peek() == Some(b'{') {
            self.i -= 1;
            self.path.pop();
            return Ok(());
        }
        loop {
            let value = self.value(f)?;
            self.expect(b':')?;
            self.ws();
            if self.peek() != Some(b'"') {
                return Err(Stop);
            }
            let close = self.i - 1;
            self.string()?;
            let key = &self.w[self.i + 1..close];
            self.ws();
            let before = self.peek();
            if !matches!(before, Some(b',' | b'{')) {
                return Err(Stop);
            }
            f(&self.path, key, value);
            self.i -= 1;
            if before == Some(b'{') {
                self.path.pop();
                return Ok(());
            }
        }
    }

    /// The array whose `]` is just before the cursor.
    fn array(&mut self, f: &mut impl FnMut(&[Kind], &[u8], &[u8])) -> Result<(), Stop> {
        self.enter(Kind::Array)?;
        self.ws();
        if self.peek() == Some(b'[') {
            self.i -= 1;
            self.path.pop();
            return Ok(());
        }
        loop {
            self.value(f)?;
            self.ws();
            match self.peek() {
                Some(b',') => self.i -= 1,
                Some(b'[') => {
                    self.i -= 1;
                    self.path.pop();
                    return Ok(());
                }
                _ => return Err(Stop),
            }
        }
    }

    fn enter(&mut self, k: Kind) -> Result<(), Stop> {
        if self.path.len() >= MAX_DEPTH {
            return Err(Stop);
        }
        self.i -= 1;
        self.path.push(k);
        Ok(())
    }
}

/// Bytes of numbers, `true`, `false` and `null`.
fn is_scalar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'+' | b'-')
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tail_top(tail: &[u8]) -> Vec<(String, Value)> {
        let mut out = Vec::new();
        tail_members(tail, |path, k, v| {
            if path == [Kind::Object] {
                out.push((String::from_utf8(k.to_vec()).unwrap(), serde_json::from_slice(v).unwrap()));
            }
        });
        out
    }

    #[test]
    fn an_sdk_requests_model_and_stream_come_from_the_tail_past_a_long_prompt() {
        let body = json!({
            "messages": [{"role": "user", "content": "a \"quoted\" \\ prompt }] ".repeat(200)}],
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "stream": true,
            "stream_options": {"include_usage": true},
            "temperature": 0.7,
        })
        .to_string();
        let b = body.as_bytes();
        let tail = &b[b.len() - 300..];
        let top = tail_top(tail);
        let get = |k: &str| top.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone());
        assert_eq!(get("model"), Some(json!("meta-llama/Llama-3.1-8B-Instruct")));
        assert_eq!(get("stream"), Some(json!(true)));
        assert_eq!(get("temperature"), Some(json!(0.7)));
        // The prompt's members never count as the root's.
        assert!(get("role").is_none() && get("messages").is_none());
        // The head has none of them: `messages` is cut.
        assert!(head_members(&b[..300], &["model", "stream"]).is_empty());
    }

    #[test]
    fn a_head_gives_the_members_before_the_first_it_cannot_finish() {
        let body = br#"{"model": "m\"1", "stream": false, "messages": [{"role": "user", "content": "lo"#;
        let got = head_members(body, &["model", "stream", "messages"]);
        assert_eq!(got, vec![("model".into(), json!("m\"1")), ("stream".into(), json!(false))]);
        assert!(head_members(b"[1, 2", &["model"]).is_empty());
    }

    #[test]
    fn the_tail_reader_stops_where_a_byte_before_the_tail_would_decide() {
        // A string whose opening quote is the tail's first byte may be an
        // escaped quote inside a longer string: not reported.
        assert!(tail_top(br#""m"}"#).is_empty());
        assert!(tail_top(br#"x":"m"}"#).is_empty());
        // A backslash run reaching the tail's start: parity unknown.
        assert!(tail_top(br#"\\"x":1}"#).is_empty());
        // Only members whose place is checked are reported.
        assert_eq!(tail_top(br#"a\\"x":1}"#), vec![]);
        assert_eq!(tail_top(br#", "x":1}"#), vec![("x".into(), json!(1))]);
        // A number at the tail's start may be the end of a longer one.
        assert!(tail_top(br#"5}"#).is_empty());
        // Not an object's end: nothing.
        assert!(tail_top(br#", "x":1]"#).is_empty());
        assert!(tail_top(b"").is_empty());
    }

    #[test]
    fn nested_members_carry_their_path() {
        let body = json!({"id": "c", "choices": [{"message": {"content": "x"}, "finish_reason": "length"}], "usage": {"prompt_tokens": 3}}).to_string();
        let mut seen = Vec::new();
        tail_members(body.as_bytes(), |p, k, _| seen.push((p.to_vec(), String::from_utf8(k.to_vec()).unwrap())));
        let o = Kind::Object;
        assert!(seen.contains(&(vec![o, Kind::Array, o], "finish_reason".into())));
        assert!(seen.contains(&(vec![o, o], "prompt_tokens".into())));
        assert!(seen.contains(&(vec![o], "usage".into())));
        assert!(seen.contains(&(vec![o], "choices".into())));
        // Nearest the end first.
        assert_eq!(seen[0], (vec![o, o], "prompt_tokens".into()));
    }

    /// Random JSON objects cut at every point: whatever either reader
    /// reports for the root is the member the whole parse has.
    #[test]
    fn both_readers_only_ever_report_the_roots_true_members() {
        let mut s: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        fn gen(next: &mut impl FnMut() -> u64, depth: u32) -> Value {
            let pick = next() % if depth > 3 { 4 } else { 6 };
            let strs = ["", "a", "\\", "\"", "\\\"", "}]", "{\"k\":1}", "é", "\\\\\"x"];
            match pick {
                0 => Value::from(next() % 1000),
                1 => json!(-1.5e3),
                2 => Value::from(strs[(next() % strs.len() as u64) as usize].repeat(1 + (next() % 3) as usize)),
                3 => [Value::Null, json!(true), json!(false)][(next() % 3) as usize].clone(),
                4 => Value::Array((0..next() % 4).map(|_| gen(next, depth + 1)).collect()),
                _ => {
                    let keys = ["model", "stream", "k", "\\\"", "usage"];
                    Value::Object((0..next() % 4).map(|_| (keys[(next() % 5) as usize].to_string(), gen(next, depth + 1))).collect())
                }
            }
        }
        let mut reported = 0;
        for _ in 0..400 {
            let keys = ["model", "stream", "k", "\\\"", "usage", "id"];
            let m: serde_json::Map<String, Value> = (0..1 + next() % 6).map(|_| (keys[(next() % 6) as usize].to_string(), gen(&mut next, 1))).collect();
            let whole = Value::Object(m.clone());
            let text = if next() % 2 == 0 { serde_json::to_string(&whole).unwrap() } else { serde_json::to_string_pretty(&whole).unwrap() };
            let b = text.as_bytes();
            let keys: Vec<&str> = m.keys().map(String::as_str).collect();
            for cut in 0..=b.len() {
                for (k, v) in tail_top(&b[cut..]) {
                    let k: String = serde_json::from_str(&format!("\"{k}\"")).unwrap();
                    assert_eq!(m.get(&k), Some(&v), "tail from {cut} of {text}");
                    reported += 1;
                }
                for (k, v) in head_members(&b[..cut], &keys) {
                    assert_eq!(m.get(&k), Some(&v), "head to {cut} of {text}");
                    reported += 1;
                }
            }
        }
        assert!(reported > 20_000, "{reported}");
    }
}
