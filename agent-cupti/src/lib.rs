//! hopscope's CUPTI injection library (`libhopscope_cupti.so`).
//!
//! The CUDA driver loads it into every process that initialises CUDA when
//! `CUDA_INJECTION64_PATH` points at it, and calls [`InitializeInjection`]
//! once per process (the engine and each TP worker separately; the variable
//! is inherited by children). It records kernels (including each node of a
//! CUDA graph), copies, memsets, synchronisations and the launch/copy/sync
//! API calls, converts their timestamps to CLOCK_MONOTONIC, and streams them
//! in the `hopscope-gpu-wire` format to the agent's unix socket
//! (`HOPSCOPE_GPU_SOCKET`).
//!
//! Rules it keeps: never block or crash the host (every callback catches
//! panics; the sender is bounded and non-blocking; buffers come from a
//! bounded pool), and loss is data (every drop is a counter the agent
//! receives). Settings: see [`config::Config`]; design notes: docs/gpu.md.

mod apis;
pub mod config;
mod convert;
mod counters;
mod device;
mod inject;
pub mod locate;
mod pool;
mod sender;

pub use inject::mono_now;

/// Called by the CUDA driver (`CUDA_INJECTION64_PATH`) during `cuInit`.
/// Returns 1 when tracing (or deliberately inactive because
/// `HOPSCOPE_GPU_SOCKET` is unset), 0 on failure; never unwinds, never
/// aborts the host. A failure prints one line to stderr saying why.
#[no_mangle]
pub extern "C" fn InitializeInjection() -> std::ffi::c_int {
    inject::initialize()
}
