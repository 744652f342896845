//! Wire decoders (owned by the protocol work).
