//! HTTP/1.1 + chunked + SSE + OpenAI JSON reassembly on TCP connections.
#![no_main]
use hopscope::event::Family;
use hopscope::model::Record;
use hopscope::proto::{DecoderConfig, WireDecoder};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let cfg = DecoderConfig { max_conns: 3, max_head_bytes: 2048, ..DecoderConfig::default() };
    let mut dec = WireDecoder::new(cfg);
    let mut out = Vec::new();
    for ev in hopscope_fuzz::events(data, Family::Inet) {
        dec.on_event(&ev, &mut out);
        assert!(dec.tracked_conns() <= 3, "the connection limit holds");
    }
    dec.finish(&mut out);
    assert_eq!(dec.tracked_conns(), 0, "finish flushes every connection");
    assert_eq!(dec.buffered_bytes(), 0, "finish frees every buffer");
    // Without --capture-payload no captured bytes may leave the decoder.
    assert!(!out.iter().any(|r| matches!(r, Record::RawIo { .. })));
});
