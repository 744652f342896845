//! The trace writer's own zlib compressor (`sink/perfetto/deflate.rs`): any
//! bytes, compressed in two batches by one reused compressor, inflate back
//! exactly with an independent inflater (miniz_oxide's).
#![no_main]
use hopscope::sink::perfetto::deflate::FastZlib;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut z = FastZlib::new();
    let cut = data.first().map_or(0, |&b| usize::from(b) * data.len() / 256);
    for part in [&data[..cut], &data[cut..]] {
        let mut out = Vec::new();
        z.compress(part, &mut out);
        let back = miniz_oxide::inflate::decompress_to_vec_zlib(&out).expect("the compressor writes valid zlib");
        assert_eq!(back, part, "round trip of {} bytes", part.len());
    }
});
