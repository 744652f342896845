//! hopscope's eBPF programs and the generated layout of their records.
//!
//! * [`object`]: the compiled `hopscope.bpf.o` (C, CO-RE, built by clang-19 in
//!   `build.rs`), 8-byte aligned for the ELF parser.
//! * [`layout`]: sizes, offsets and constants of every struct and `#define` in
//!   `src/hopscope.h`, measured by the host C compiler, so decoders never carry
//!   hand-copied numbers.
//! * [`PROGRAM_IS_PLACEHOLDER`]: true when clang-19 was missing at build time;
//!   the object is then empty and the agent must refuse to start.

/// Record layout generated from `src/hopscope.h` (see `build.rs`).
pub mod layout {
    include!(concat!(env!("OUT_DIR"), "/layout.rs"));
}

include!(concat!(env!("OUT_DIR"), "/build_info.rs"));

/// Keeps the embedded object 8-byte aligned (ELF headers hold u64 fields).
#[repr(C, align(8))]
struct Aligned<B: ?Sized> {
    bytes: B,
}

static OBJECT: &Aligned<[u8]> = &Aligned { bytes: *include_bytes!(concat!(env!("OUT_DIR"), "/hopscope.bpf.o")) };

/// The eBPF object file (empty when [`PROGRAM_IS_PLACEHOLDER`]).
pub fn object() -> &'static [u8] {
    &OBJECT.bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_is_eight_byte_aligned() {
        assert_eq!(object().as_ptr() as usize % 8, 0);
    }

    #[test]
    fn object_is_an_elf_file_unless_placeholder() {
        if PROGRAM_IS_PLACEHOLDER {
            assert!(object().is_empty(), "placeholder must be empty");
        } else {
            assert_eq!(&object()[..4], b"\x7fELF", "not an ELF object");
        }
    }

    #[test]
    fn layout_matches_the_header_contract() {
        use layout::*;
        assert_eq!(HS_HDR_SIZE, 24);
        assert_eq!(HS_IO_OFF_DATA, HS_IO_SIZE);
        assert!(HS_MAX_CAPTURE.is_power_of_two());
        assert_eq!(HS_STAT_NAMES.len(), 13);
        assert!(HS_STAT_NAMES.iter().all(|(i, _)| *i < HS_STAT_MAX));
    }
}
