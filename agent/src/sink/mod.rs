//! Sinks: where analyses go.

pub mod diff;
pub mod json;
pub mod perfetto;
pub mod metrics;
pub mod otlp;
pub mod report;
pub mod summary;

use std::borrow::Cow;

/// `s` as a text report may print it: control characters (a client's model
/// name, session header or response id may hold an ESC sequence meant for
/// the reader's terminal) written as Rust escapes (`\u{1b}`), the rest as is.
pub(crate) fn printable(s: &str) -> Cow<'_, str> {
    if !s.chars().any(char::is_control) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if c.is_control() {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// [`printable`] `s` in at most `n` characters, the last one `…` when cut.
pub(crate) fn trunc(s: &str, n: usize) -> String {
    let s = printable(s);
    if s.chars().count() <= n {
        s.into_owned()
    } else {
        let mut t: String = s.chars().take(n.saturating_sub(1)).collect();
        t.push('…');
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_cells_escape_control_characters_before_cutting() {
        assert_eq!(printable("llama-8b"), Cow::Borrowed("llama-8b"));
        assert_eq!(printable("a\u{1b}[2Jb\n\t"), "a\\u{1b}[2Jb\\n\\t");
        assert_eq!(trunc("m\u{7}x", 20), "m\\u{7}x");
        assert_eq!(trunc("\u{1b}[31mred", 6), "\\u{1b…");
        assert_eq!(trunc("ünïcode", 4), "ünï…");
        assert_eq!(trunc("short", 5), "short");
    }
}
