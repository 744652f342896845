//! Version-aware CUPTI activity record decoding (bytes from a CUPTI buffer).
#![no_main]
use cupti_sys::record::{self, StructSizes};
use libfuzzer_sys::fuzz_target;

/// One version per supported struct layout, plus one before support started.
const VERSIONS: [u32; 8] = [18, 22, 26, 130_000, 130_100, 130_300, 130_400, u32::MAX];

fuzz_target!(|data: &[u8]| {
    let Some((&sel, mut buf)) = data.split_first() else { return };
    let Some(sizes) = StructSizes::for_version(VERSIONS[usize::from(sel) % VERSIONS.len()]) else { return };
    assert!(sizes.check().is_ok(), "every known layout covers the prefix we read");
    // Walk the buffer the way the injection library does: one record after another.
    while !buf.is_empty() {
        let Ok(kind) = record::kind_of(buf) else { break };
        match record::decode(buf, &sizes) {
            Ok(_) => {
                let size = sizes.of(kind).expect("a decoded kind has a size");
                assert!(size <= buf.len(), "decoded a record that does not fit");
                buf = &buf[size..];
            }
            Err(_) => break,
        }
    }
});
