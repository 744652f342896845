//! The injection library → agent wire format (frames on the agent's socket).
#![no_main]
use hopscope_gpu_wire::{FrameDecoder, Message};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first byte picks the read size: frames arrive torn at any boundary.
    let Some((&step, body)) = data.split_first() else { return };
    let step = usize::from(step).max(1);
    let mut dec = FrameDecoder::default();
    let mut fatal = None;
    for chunk in body.chunks(step) {
        dec.push(chunk);
        for _ in 0..10_000 {
            match dec.next_message() {
                None => break,
                Some(Ok(m)) => {
                    assert!(fatal.is_none(), "a message after a fatal error");
                    // What the agent accepted must mean the same when sent again.
                    let frame = m.to_frame();
                    let mut again = FrameDecoder::default();
                    again.push(&frame);
                    assert_eq!(again.next_message(), Some(Ok(m.clone())), "re-encoding changes {m:?}");
                    assert_eq!(again.pending(), 0);
                    let _ = Message::try_from(&frame[..]);
                }
                Some(Err(e)) => {
                    if let Some(f) = &fatal {
                        assert_eq!(f, &e, "a fatal error must stick");
                        break;
                    }
                    if e.is_fatal() {
                        fatal = Some(e);
                    }
                }
            }
        }
    }
    assert!(dec.pending() <= body.len());
});
