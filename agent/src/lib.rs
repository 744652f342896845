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
