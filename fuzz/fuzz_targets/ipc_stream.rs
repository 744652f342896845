//! vLLM V1 engine IPC on unix sockets: ZMTP framing → msgpack → engine records.
#![no_main]
use hopscope::event::Family;
use hopscope::model::Record;
use hopscope::proto::{DecoderConfig, WireDecoder};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut dec = WireDecoder::new(DecoderConfig::default());
    let mut out = Vec::new();
    for ev in hopscope_fuzz::events(data, Family::Unix) {
        dec.on_event(&ev, &mut out);
    }
    dec.finish(&mut out);
    assert!(!out.iter().any(|r| matches!(r, Record::RawIo { .. })));
});
