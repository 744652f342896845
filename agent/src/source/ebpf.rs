//! eBPF source (owned by the eBPF work).
