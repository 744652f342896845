//! Sources: thin adapters that turn bytes from the outside world into validated events.

pub mod cupti;
pub mod ebpf;
pub mod nvml;
