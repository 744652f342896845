//! The recording's in-place record decoder (`recording::fast`) against
//! serde's postcard decoding, on the same bytes: the same record or both an
//! error, record after record through the same reused slots.
//!
//! Input: chunks of `len:u16le bytes`, each one record's postcard bytes.
#![no_main]
use hopscope::model::Record;
use hopscope::recording::fast::RecordDecoder;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut dec = RecordDecoder::new();
    let mut rest = data;
    while rest.len() >= 2 {
        let len = usize::from(u16::from_le_bytes([rest[0], rest[1]])).min(rest.len() - 2);
        let (bytes, tail) = rest[2..].split_at(len);
        rest = tail;
        // Compared re-encoded: the same bits (a NaN is not equal to itself).
        let enc = |r: Option<&Record>| r.map(|r| postcard::to_stdvec(r).expect("a decoded record encodes"));
        let serde = postcard::from_bytes::<Record>(bytes).ok();
        let fast = enc(dec.decode(bytes).ok());
        assert_eq!(fast, enc(serde.as_ref()), "in-place and serde decoding disagree on {bytes:?}");
        assert_eq!(enc(dec.last()), fast, "last() is the record decode gave");
    }
});
