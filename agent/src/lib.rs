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
    /// A step's scheduler stats decoded from the message at `conn`, `ts_ns`.
    pub fn engine_stats(conn: crate::event::ConnKey, ts_ns: u64) -> crate::model::Record {
        crate::model::Record::EngineStats {
            conn,
            ts_ns,
            engine_index: Some(0),
            running: Some(1),
            waiting: Some(0),
            kv_cache_usage: Some(0.1),
            step_counter: None,
            prefix_cache_queries: None,
            prefix_cache_hits: None,
        }
    }

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
