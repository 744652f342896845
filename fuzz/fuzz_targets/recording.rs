//! The `.hop` recording reader.
//!
//! First byte 0: the bytes are the file as is (headers, lengths, checksums).
//! First byte 1: every block's checksum is repaired first, so mutations reach
//! lz4 decompression and the postcard record decoding behind the checksum.
#![no_main]
use hopscope::recording::{Reader, RecordingError, BLOCK_MAGIC};
use libfuzzer_sys::fuzz_target;

fn le32(b: &[u8]) -> usize {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize
}

fn repair_checksums(file: &mut [u8]) {
    if file.len() < 16 {
        return;
    }
    let mut pos = 16usize.saturating_add(le32(&file[12..16]));
    while pos.saturating_add(20) <= file.len() && &file[pos..pos + 4] == BLOCK_MAGIC {
        let comp_len = le32(&file[pos + 8..pos + 12]);
        let body = pos + 20;
        let Some(end) = body.checked_add(comp_len).filter(|&e| e <= file.len()) else { return };
        let crc = crc32fast::hash(&file[body..end]);
        file[pos + 12..pos + 16].copy_from_slice(&crc.to_le_bytes());
        pos = end;
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, file)) = data.split_first() else { return };
    let mut file = file.to_vec();
    if mode & 1 == 1 {
        repair_checksums(&mut file);
    }
    let Ok(mut r) = Reader::new(&file[..]) else { return };
    let mut last = r.offset();
    let mut n = 0u64;
    loop {
        match r.next_record() {
            Ok(Some(_)) => n += 1,
            Ok(None) => break,
            Err(e) => {
                if let RecordingError::Truncated { offset, .. } | RecordingError::Corrupt { offset, .. } = &e {
                    assert!(*offset as usize <= file.len(), "error offset {offset} past the end ({e})");
                }
                assert!(matches!(r.next_record(), Ok(None)), "reading stops at the first error");
                break;
            }
        }
        assert!(r.offset() >= last, "the offset never goes back");
        last = r.offset();
        assert!(n <= file.len() as u64, "more records than bytes");
    }
});
