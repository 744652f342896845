//! HTTP/1.x heads: sniffing the first bytes of a message, finding the end of a
//! head incrementally, parsing it with `httparse`, keeping only allow-listed
//! headers, and deciding how the body is framed (RFC 9112 §6.3).

use crate::model::Header;

/// Most headers one head may carry (`httparse` needs a fixed slice).
const MAX_HEADERS: usize = 128;
/// Longest header value kept in a record (bytes; cut at a char boundary).
const MAX_VALUE: usize = 1024;
/// Longest path kept in a record.
const MAX_PATH: usize = 2048;
/// Longest method token accepted while sniffing.
const MAX_METHOD: usize = 32;

/// Request headers kept (besides the configured chain header).
const REQUEST_ALLOW: &[&str] = &[
    "x-request-id",
    "traceparent",
    "tracestate",
    "content-type",
    "content-length",
    "transfer-encoding",
    "user-agent",
    "host",
    "accept",
];
/// Response headers kept.
const RESPONSE_ALLOW: &[&str] = &[
    "content-type",
    "content-length",
    "transfer-encoding",
    "x-request-id",
];

/// Methods accepted when resynchronising on a syscall boundary (stricter than
/// the first-message sniff, which accepts any token).
const RESYNC_METHODS: &[&[u8]] = &[
    b"GET ",
    b"POST ",
    b"PUT ",
    b"DELETE ",
    b"HEAD ",
    b"OPTIONS ",
    b"PATCH ",
    b"CONNECT ",
    b"TRACE ",
];

const H2_PREFACE_START: &[u8] = b"PRI * HTTP/2";
const STATUS_START: &[u8] = b"HTTP/1.";

/// What the first bytes of a message look like.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Start {
    Request,
    Response,
    /// `PRI * HTTP/2.0` connection preface.
    H2,
    /// A TLS record (handshake byte 0x16, version major 0x03).
    Tls,
    Garbage,
}

/// RFC 9110 `tchar`.
pub(crate) fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Classifies the start of a message; `None` while the bytes are still ambiguous.
pub(crate) fn classify(buf: &[u8]) -> Option<Start> {
    let first = *buf.first()?;
    let n = buf.len().min(H2_PREFACE_START.len());
    if buf[..n] == H2_PREFACE_START[..n] {
        return (n == H2_PREFACE_START.len()).then_some(Start::H2);
    }
    if first == 0x16 {
        return match buf.get(1) {
            None => None,
            Some(0x03) => Some(Start::Tls),
            Some(_) => Some(Start::Garbage),
        };
    }
    let n = buf.len().min(STATUS_START.len());
    if buf[..n] == STATUS_START[..n] {
        return (n == STATUS_START.len()).then_some(Start::Response);
    }
    for (i, &b) in buf.iter().enumerate() {
        if b == b' ' {
            return Some(if i == 0 {
                Start::Garbage
            } else {
                Start::Request
            });
        }
        if !is_tchar(b) || i >= MAX_METHOD {
            return Some(Start::Garbage);
        }
    }
    None
}

/// Strict check used to resynchronise at the start of a syscall's data.
pub(crate) fn resync_candidate(data: &[u8]) -> Option<Start> {
    if data.starts_with(STATUS_START) {
        return Some(Start::Response);
    }
    RESYNC_METHODS
        .iter()
        .any(|m| data.starts_with(m))
        .then_some(Start::Request)
}

/// A head being accumulated. Bounded by the caller (`max_head_bytes`).
#[derive(Debug, Default)]
pub(crate) struct HeadBuf {
    pub buf: Vec<u8>,
    /// End-of-head scanner: 0 in a line, 1 right after LF, 2 after LF CR.
    nl: u8,
    pub saw_newline: bool,
    /// The start line was validated with httparse.
    pub checked: bool,
    pub class: Option<Start>,
    pub start_ns: u64,
    pub start_tid: u32,
    pub start_ready: Option<u64>,
}

impl HeadBuf {
    pub fn begin(&mut self, ts: u64, tid: u32, ready: Option<u64>) {
        self.reset();
        self.start_ns = ts;
        self.start_tid = tid;
        self.start_ready = ready;
    }

    pub fn reset(&mut self) {
        if self.buf.capacity() > 16 * 1024 {
            self.buf = Vec::new();
        } else {
            self.buf.clear();
        }
        self.nl = 0;
        self.saw_newline = false;
        self.checked = false;
        self.class = None;
    }

    /// Scans `data` (the bytes following those already buffered) for the end of
    /// the head (an empty line, CRLF or bare LF). Returns how many bytes of
    /// `data` belong to the head and whether the head is complete.
    pub fn scan(&mut self, data: &[u8]) -> (usize, bool) {
        for (i, &b) in data.iter().enumerate() {
            match b {
                b'\n' => {
                    if self.nl != 0 {
                        self.nl = 0;
                        return (i + 1, true);
                    }
                    self.nl = 1;
                    self.saw_newline = true;
                }
                b'\r' => self.nl = if self.nl == 1 { 2 } else { 0 },
                _ => self.nl = 0,
            }
        }
        (data.len(), false)
    }
}

/// Validates the start line of a partial head (called once the first line ended).
pub(crate) fn first_line_ok(buf: &[u8], class: Start) -> bool {
    let mut hdrs = [httparse::EMPTY_HEADER; MAX_HEADERS];
    match class {
        Start::Request => !matches!(
            httparse::Request::new(&mut hdrs).parse(buf),
            Err(e) if e != httparse::Error::TooManyHeaders
        ),
        Start::Response => !matches!(
            httparse::Response::new(&mut hdrs).parse(buf),
            Err(e) if e != httparse::Error::TooManyHeaders
        ),
        _ => false,
    }
}

/// How a message body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BodyFraming {
    Length(u64),
    Chunked,
    /// Until the connection closes (responses only).
    Close,
}

#[derive(Debug)]
pub(crate) struct ReqHead {
    pub method: String,
    pub path: String,
    pub headers: Vec<Header>,
    pub framing: BodyFraming,
    /// The body may be JSON (content-type says so, or there is none).
    pub json: bool,
}

#[derive(Debug)]
pub(crate) struct RespHead {
    pub status: u16,
    pub headers: Vec<Header>,
    pub framing: BodyFraming,
    pub sse: bool,
    pub json: bool,
    /// A content-encoding other than identity: the body is not readable as is.
    pub encoded: bool,
}

/// Parses a complete request head. Errors are short static reasons.
pub(crate) fn parse_request(buf: &[u8], chain_header: &str) -> Result<ReqHead, &'static str> {
    let mut hdrs = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut hdrs);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err("incomplete http request head"),
        Err(httparse::Error::TooManyHeaders) => {
            return Err("too many headers in http request head")
        }
        Err(_) => return Err("invalid http request head"),
    }
    let method = req.method.unwrap_or_default().to_string();
    let path = sanitize_path(req.path.unwrap_or_default());
    let framing = framing(req.headers, true)?;
    let ctype = header_value(req.headers, "content-type");
    let json = ctype.is_none_or(|v| is_json_type(&v));
    let headers = keep_headers(req.headers, REQUEST_ALLOW, Some(chain_header));
    Ok(ReqHead {
        method,
        path,
        headers,
        framing,
        json,
    })
}

/// Parses a complete response head.
pub(crate) fn parse_response(buf: &[u8]) -> Result<RespHead, &'static str> {
    let mut hdrs = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut hdrs);
    match resp.parse(buf) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err("incomplete http response head"),
        Err(httparse::Error::TooManyHeaders) => {
            return Err("too many headers in http response head")
        }
        Err(_) => return Err("invalid http response head"),
    }
    let status = resp.code.unwrap_or_default();
    let framing = framing(resp.headers, false)?;
    let ctype = header_value(resp.headers, "content-type").unwrap_or_default();
    let sse = media_type(&ctype) == "text/event-stream";
    let json = is_json_type(&ctype);
    let encoded = header_value(resp.headers, "content-encoding")
        .is_some_and(|v| !v.trim().is_empty() && !v.trim().eq_ignore_ascii_case("identity"));
    let headers = keep_headers(resp.headers, RESPONSE_ALLOW, None);
    Ok(RespHead {
        status,
        headers,
        framing,
        sse,
        json,
        encoded,
    })
}

fn media_type(v: &str) -> String {
    v.split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase()
}

fn is_json_type(v: &str) -> bool {
    let m = media_type(v);
    m == "application/json" || m.ends_with("+json")
}

fn header_value(headers: &[httparse::Header<'_>], name: &str) -> Option<String> {
    headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case(name))
        .map(|h| String::from_utf8_lossy(h.value).into_owned())
}

/// Body framing from Transfer-Encoding / Content-Length (RFC 9112 §6.3).
fn framing(headers: &[httparse::Header<'_>], request: bool) -> Result<BodyFraming, &'static str> {
    let mut te_present = false;
    let mut chunked_last = false;
    for h in headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("transfer-encoding"))
    {
        te_present = true;
        let v = String::from_utf8_lossy(h.value);
        if let Some(last) = v.split(',').map(str::trim).rfind(|s| !s.is_empty()) {
            chunked_last = last.eq_ignore_ascii_case("chunked");
        }
    }
    if te_present {
        return match (chunked_last, request) {
            (true, _) => Ok(BodyFraming::Chunked),
            (false, true) => Err("request transfer-encoding without chunked"),
            (false, false) => Ok(BodyFraming::Close),
        };
    }
    let mut len: Option<u64> = None;
    for h in headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case("content-length"))
    {
        for part in h.value.split(|&b| b == b',') {
            let v = parse_decimal(part.trim_ascii()).ok_or("invalid content-length")?;
            if len.is_some_and(|l| l != v) {
                return Err("conflicting content-length");
            }
            len = Some(v);
        }
    }
    Ok(match len {
        Some(v) => BodyFraming::Length(v),
        None if request => BodyFraming::Length(0),
        None => BodyFraming::Close,
    })
}

fn parse_decimal(s: &[u8]) -> Option<u64> {
    if s.is_empty() || s.len() > 20 {
        return None;
    }
    s.iter().try_fold(0u64, |acc, &b| {
        if !b.is_ascii_digit() {
            return None;
        }
        acc.checked_mul(10)?.checked_add(u64::from(b - b'0'))
    })
}

fn keep_headers(
    headers: &[httparse::Header<'_>],
    allow: &[&str],
    extra: Option<&str>,
) -> Vec<Header> {
    headers
        .iter()
        .filter_map(|h| {
            let name = h.name.to_ascii_lowercase();
            let keep =
                allow.contains(&name.as_str()) || extra.is_some_and(|e| !e.is_empty() && e == name);
            keep.then(|| {
                let v = String::from_utf8_lossy(h.value);
                (name, truncate(v.trim(), MAX_VALUE))
            })
        })
        .collect()
}

/// The path without query string or fragment (they may carry credentials), bounded.
fn sanitize_path(p: &str) -> String {
    let end = p.find(['?', '#']).unwrap_or(p.len());
    truncate(&p[..end], MAX_PATH)
}

/// `s` cut to at most `max` bytes at a char boundary.
pub(crate) fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while end > 0 && !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classify_decides_only_when_unambiguous() {
        assert_eq!(classify(b"P"), None);
        assert_eq!(classify(b"PRI * HTTP/2.0\r\n"), Some(Start::H2));
        assert_eq!(classify(b"POST "), Some(Start::Request));
        assert_eq!(classify(b"PRI /x HTTP/1.1"), Some(Start::Request));
        assert_eq!(classify(b"H"), None);
        assert_eq!(classify(b"HEAD "), Some(Start::Request));
        assert_eq!(classify(b"HTTP/1.1 200"), Some(Start::Response));
        assert_eq!(classify(b"\x16"), None);
        assert_eq!(classify(b"\x16\x03\x01"), Some(Start::Tls));
        assert_eq!(classify(b"\x00\x01"), Some(Start::Garbage));
        assert_eq!(classify(b"data: {"), Some(Start::Garbage));
        assert_eq!(classify(&[b'A'; 40]), Some(Start::Garbage));
    }

    #[test]
    fn head_scanner_finds_crlf_and_bare_lf_terminators_across_calls() {
        let mut h = HeadBuf::default();
        assert_eq!(h.scan(b"GET / HTTP/1.1\r\nHost: a\r\n\r"), (26, false));
        assert_eq!(h.scan(b"\nrest"), (1, true));
        let mut h = HeadBuf::default();
        assert_eq!(h.scan(b"GET / HTTP/1.1\nA: b\n\nbody"), (21, true));
    }

    #[test]
    fn request_head_keeps_only_allow_listed_headers_and_strips_query() {
        let head = b"POST /v1/chat/completions?key=SECRET HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer SECRET\r\n\
Cookie: a=SECRET\r\nX-Session-Id: s1\r\nX-Other: y\r\nContent-Type: application/json\r\nContent-Length: 5\r\n\r\n";
        let r = parse_request(head, "x-session-id").unwrap();
        assert_eq!(r.method, "POST");
        assert_eq!(r.path, "/v1/chat/completions");
        assert_eq!(r.framing, BodyFraming::Length(5));
        assert!(r.json);
        let names: Vec<&str> = r.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            ["host", "x-session-id", "content-type", "content-length"]
        );
        assert!(!format!("{r:?}").contains("SECRET"));
    }

    #[test]
    fn framing_rules_follow_rfc9112() {
        let r = parse_request(
            b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\nContent-Length: 3\r\n\r\n",
            "",
        )
        .unwrap();
        assert_eq!(r.framing, BodyFraming::Chunked);
        assert!(parse_request(b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", "").is_err());
        assert!(parse_request(
            b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n",
            ""
        )
        .is_err());
        assert!(parse_request(
            b"POST / HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n",
            ""
        )
        .is_err());
        let r = parse_request(b"GET / HTTP/1.1\r\n\r\n", "").unwrap();
        assert_eq!(r.framing, BodyFraming::Length(0));
        let r = parse_response(b"HTTP/1.0 200 OK\r\n\r\n").unwrap();
        assert_eq!(r.framing, BodyFraming::Close);
        let r = parse_response(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n\r\n",
        )
        .unwrap();
        assert!(r.sse && !r.json);
    }
}
