//! hopscope: per-request latency attribution for LLM inference servers.
//!
//! Layout follows the data: `source` (adapters: kernel bytes → validated events),
//! `proto` (wire decoders: socket bytes → payload-free records), `pipeline`
//! (reorder + decode + record, live), `recording` (the `.hop` file), `correlate`
//! (pure: records → requests, chains), `sink` (report, …). `sys` is the one
//! chokepoint for direct libc calls.

pub mod correlate;
pub mod doctor;
pub mod event;
pub mod model;
pub mod pipeline;
pub mod privilege;
pub mod proto;
pub mod recording;
pub mod sink;
pub mod source;
pub mod sys;

/// What the unit tests share.
#[cfg(test)]
pub(crate) mod testutil {
    /// A seeded xorshift64 stream: the tests' random inputs are the same every run.
    pub fn xorshift(mut x: u64) -> impl FnMut() -> u64 {
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        }
    }
}
