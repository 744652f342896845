//! Sinks: where analyses go.

pub mod perfetto;
pub mod report;
