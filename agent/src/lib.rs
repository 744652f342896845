//! hopscope: per-request latency attribution for LLM inference servers.
//!
//! Layout follows the data: `source` (adapters: kernel bytes → validated events),
//! `proto` (wire decoders: socket bytes → payload-free records), `recording`
//! (the `.hop` file), `correlate` (pure: records → requests, chains), `sink`
//! (report, …).

pub mod event;
pub mod model;
pub mod proto;
pub mod source;
