//! One eBPF ring-buffer sample → a validated kernel event.
#![no_main]
use hopscope::event::{Burst, KEvent};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(KEvent::Io(io)) = KEvent::try_from(data) {
        assert!(io.data.len() as u64 <= io.len || io.copy_failed, "captured more than the syscall moved");
        assert!(io.data.len() <= data.len());
        if let Burst::Woken { wake_ns: wake, on_ns: on } = io.burst {
            assert!(wake <= on && on <= io.ts_ns, "a burst that is not before its write");
        }
    }
});
