//! The bounded msgpack decoder vLLM's IPC payloads go through.
#![no_main]
use hopscope::proto::msgpack::{self, Value};
use libfuzzer_sys::fuzz_target;

/// Touches every node through the public accessors (they must agree with the
/// decoded shape); returns (all nodes, materialised nodes).
fn walk(v: &Value<'_>, depth: usize) -> (usize, usize) {
    assert!(depth <= msgpack::MAX_DEPTH + 1, "nesting beyond the limit");
    let _ = (v.kind(), v.is_cut(), v.is_nil(), v.as_u64(), v.as_i128(), v.as_f64(), v.as_str(), v.as_bytes());
    if let Value::Skipped(k, b) = v {
        // Its bytes are one whole value of its kind: read alone, they end
        // where it did (the digest of a deep constraint relies on it).
        let alone = msgpack::decode(b);
        assert!(alone.status == msgpack::Status::Complete && alone.consumed == b.len(), "a skipped value's bytes are whole: {b:02x?}");
        assert!(alone.value.kind() == Some(*k), "a skipped value's kind is its bytes' kind");
    }
    let own = usize::from(!matches!(v, Value::Skipped(..) | Value::Truncated(_) | Value::Invalid));
    let (mut all, mut real) = (1, own);
    let mut add = |(a, r): (usize, usize)| {
        all += a;
        real += r;
    };
    if let Some((len, items)) = v.as_array() {
        assert!(items.len() <= len as usize, "more items than declared");
        items.iter().for_each(|x| add(walk(x, depth + 1)));
    }
    if let Some((len, pairs)) = v.as_map() {
        assert!(pairs.len() <= len as usize, "more pairs than declared");
        let _ = v.get("request_id");
        pairs.iter().for_each(|(k, x)| {
            add(walk(k, depth + 1));
            add(walk(x, depth + 1));
        });
    }
    (all, real)
}

fuzz_target!(|data: &[u8]| {
    let _ = msgpack::peek_header(data);
    let d = msgpack::decode(data);
    assert!(d.consumed <= data.len(), "consumed past the input");
    let (all, real) = walk(&d.value, 0);
    // The budget bounds what is materialised; past it, values stay as
    // `Skipped` placeholders (consumers read fields by position), each of
    // which consumed at least one input byte. A cut input adds one
    // `Truncated` marker per open map on the way out, plus the innermost.
    assert!(real <= msgpack::MAX_NODES, "node budget exceeded: {real} materialised");
    assert!(all <= data.len() + msgpack::MAX_DEPTH + 3, "{all} nodes from {} bytes", data.len());
});
