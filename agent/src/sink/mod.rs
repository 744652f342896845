//! Sinks: where analyses go.

pub mod report;
