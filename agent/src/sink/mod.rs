//! Sinks: where analyses go.

pub mod diff;
pub mod json;
pub mod perfetto;
pub mod metrics;
pub mod otlp;
pub mod report;
pub mod summary;
