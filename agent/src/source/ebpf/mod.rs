//! eBPF source: the kernel side (`agent-ebpf/src/hopscope.bpf.c`) streams socket
//! I/O, off-CPU intervals and process-tree changes of the traced server through
//! one ring buffer; this module loads it ([`EbpfSource`]) and turns each sample
//! into a validated [`crate::event::KEvent`] (`decode`, via `TryFrom<&[u8]>`).
//!
//! Typical use:
//! ```no_run
//! use hopscope::source::ebpf::{EbpfConfig, EbpfSource};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let mut src = EbpfSource::start(EbpfConfig { pids: vec![1234], ..EbpfConfig::default() })?;
//! loop {
//!     src.poll(std::time::Duration::from_millis(100), |ev| match ev {
//!         Ok(ev) => println!("{ev:?}"),
//!         Err(e) => eprintln!("dropped a malformed record: {e}"),
//!     })?;
//! #   break;
//! }
//! println!("{:?}", src.stats());
//! # Ok(()) }
//! ```

mod decode;
mod loader;

pub use decode::DecodeError;
pub use loader::{EbpfConfig, EbpfSource, KernelStats, SourceError, StartupTimes};
pub(crate) use loader::{agent_pidns, privileged, tracefs_mounted, tracefs_unreadable, tracepoint_exists};
