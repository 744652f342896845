//! Version-aware decoding of CUPTI activity records from bytes.
//!
//! CUPTI writes the newest struct of each kind that *the loaded libcupti*
//! knows (not the one our headers know): Kernel9 (208 B) in 12.4–12.9,
//! Kernel10 (216) in 13.0, Kernel11 (224) in 13.1–13.2, Kernel12 (232) in
//! 13.3, Kernel13 (248) in 13.4; Memcpy5 (88) → Memcpy6 (96, 12.8) → Memcpy7
//! (112, 13.4); Memset4 (88) → Memset5 (104, 13.4); Synchronization (40) →
//! Synchronization2 (56, 12.8); MemcpyPtoP4 (96) and API (40) throughout;
//! GraphTrace (48) → GraphTrace2 (56, 12.8) when a graph's launch is traced
//! as one record (`GRAPH_TRACE`, in place of its nodes' kernel records).
//! New versions only append fields, so we read the common prefix at the
//! offsets below (offsetof in every wheel 12.4.127, 12.5.82, 12.6.80,
//! 12.8.90, 12.9.79, 13.0.85, 13.1.115, 13.2.86, 13.3.75, 13.4.92; the
//! generated structs cross-check them at compile time) and check that each
//! record fits the buffer at the size its version writes
//! ([`StructSizes::for_version`], or `cuptiActivityGetStructSize` on 13.0+).
//! Nothing is transmuted: enum-valued fields stay raw integers.

use crate::bindings::*;
use std::mem::{offset_of, size_of};

/// Field offsets (bytes) in the record structs.
pub mod off {
    /// CUpti_ActivityKernel9…13 (CONCURRENT_KERNEL and KERNEL records).
    pub mod kernel {
        pub const REGISTERS_PER_THREAD: usize = 6; // u16
        pub const START: usize = 16;
        pub const END: usize = 24;
        pub const DEVICE_ID: usize = 40;
        pub const CONTEXT_ID: usize = 44;
        pub const STREAM_ID: usize = 48;
        pub const GRID_X: usize = 52; // i32 x3
        pub const BLOCK_X: usize = 64; // i32 x3
        pub const STATIC_SHARED_MEM: usize = 76; // i32
        pub const DYNAMIC_SHARED_MEM: usize = 80; // i32
        pub const CORRELATION_ID: usize = 92;
        pub const GRID_ID: usize = 96; // i64
        pub const NAME: usize = 104; // const char*
        pub const LAUNCH_TYPE: usize = 136; // u8
        pub const GRAPH_NODE_ID: usize = 144; // u64
        pub const GRAPH_ID: usize = 156; // u32
        /// Bytes we read.
        pub const PREFIX: usize = 160;
    }
    /// CUpti_ActivityMemcpy5…7 (MEMCPY records).
    pub mod memcpy {
        pub const COPY_KIND: usize = 4; // u8
        pub const SRC_KIND: usize = 5; // u8
        pub const DST_KIND: usize = 6; // u8
        pub const FLAGS: usize = 7; // u8
        pub const BYTES: usize = 8;
        pub const START: usize = 16;
        pub const END: usize = 24;
        pub const DEVICE_ID: usize = 32;
        pub const CONTEXT_ID: usize = 36;
        pub const STREAM_ID: usize = 40;
        pub const CORRELATION_ID: usize = 44;
        pub const RUNTIME_CORRELATION_ID: usize = 48;
        pub const GRAPH_NODE_ID: usize = 64;
        pub const GRAPH_ID: usize = 72;
        pub const PREFIX: usize = 76;
    }
    /// CUpti_ActivityMemcpyPtoP4 (MEMCPY2 records).
    pub mod peer {
        pub const COPY_KIND: usize = 4;
        pub const SRC_KIND: usize = 5;
        pub const DST_KIND: usize = 6;
        pub const FLAGS: usize = 7;
        pub const BYTES: usize = 8;
        pub const START: usize = 16;
        pub const END: usize = 24;
        pub const DEVICE_ID: usize = 32;
        pub const CONTEXT_ID: usize = 36;
        pub const STREAM_ID: usize = 40;
        pub const SRC_DEVICE_ID: usize = 44;
        pub const SRC_CONTEXT_ID: usize = 48;
        pub const DST_DEVICE_ID: usize = 52;
        pub const DST_CONTEXT_ID: usize = 56;
        pub const CORRELATION_ID: usize = 60;
        pub const GRAPH_NODE_ID: usize = 72;
        pub const GRAPH_ID: usize = 80;
        pub const PREFIX: usize = 84;
    }
    /// CUpti_ActivityMemset4…5 (MEMSET records).
    pub mod memset {
        pub const VALUE: usize = 4;
        pub const BYTES: usize = 8;
        pub const START: usize = 16;
        pub const END: usize = 24;
        pub const DEVICE_ID: usize = 32;
        pub const CONTEXT_ID: usize = 36;
        pub const STREAM_ID: usize = 40;
        pub const CORRELATION_ID: usize = 44;
        pub const FLAGS: usize = 48; // u16
        pub const MEMORY_KIND: usize = 50; // u16
        pub const GRAPH_NODE_ID: usize = 64;
        pub const GRAPH_ID: usize = 72;
        pub const PREFIX: usize = 76;
    }
    /// CUpti_ActivitySynchronization / Synchronization2.
    pub mod sync {
        pub const TYPE: usize = 4;
        pub const START: usize = 8;
        pub const END: usize = 16;
        pub const CORRELATION_ID: usize = 24;
        pub const CONTEXT_ID: usize = 28;
        pub const STREAM_ID: usize = 32;
        pub const CUDA_EVENT_ID: usize = 36;
        pub const PREFIX: usize = 40;
    }
    /// CUpti_ActivityGraphTrace / GraphTrace2 (GRAPH_TRACE records).
    pub mod graph {
        pub const CORRELATION_ID: usize = 4;
        pub const START: usize = 8;
        pub const END: usize = 16;
        pub const DEVICE_ID: usize = 24;
        pub const GRAPH_ID: usize = 28;
        pub const CONTEXT_ID: usize = 32;
        pub const STREAM_ID: usize = 36;
        pub const PREFIX: usize = 40;
    }
    /// CUpti_ActivityAPI (RUNTIME and DRIVER records).
    pub mod api {
        pub const CBID: usize = 4;
        pub const START: usize = 8;
        pub const END: usize = 16;
        pub const PROCESS_ID: usize = 24;
        pub const THREAD_ID: usize = 28;
        pub const CORRELATION_ID: usize = 32;
        pub const RETURN_VALUE: usize = 36;
        pub const PREFIX: usize = 40;
    }
}

// The documented offsets agree with every generated struct version.
macro_rules! same_offsets {
    ($($ty:ty),+ => $fields:tt) => {
        $( same_offsets!(@one $ty, $fields); )+
    };
    (@one $ty:ty, ($($field:ident = $off:expr),+ $(,)?)) => {
        $( const _: () = assert!(offset_of!($ty, $field) == $off); )+
    };
}
same_offsets!(CUpti_ActivityKernel9, CUpti_ActivityKernel10, CUpti_ActivityKernel11, CUpti_ActivityKernel12, CUpti_ActivityKernel13 => (
    registersPerThread = off::kernel::REGISTERS_PER_THREAD, start = off::kernel::START, end = off::kernel::END,
    deviceId = off::kernel::DEVICE_ID, contextId = off::kernel::CONTEXT_ID, streamId = off::kernel::STREAM_ID,
    gridX = off::kernel::GRID_X, gridY = off::kernel::GRID_X + 4, gridZ = off::kernel::GRID_X + 8,
    blockX = off::kernel::BLOCK_X, blockY = off::kernel::BLOCK_X + 4, blockZ = off::kernel::BLOCK_X + 8,
    staticSharedMemory = off::kernel::STATIC_SHARED_MEM, dynamicSharedMemory = off::kernel::DYNAMIC_SHARED_MEM,
    correlationId = off::kernel::CORRELATION_ID, gridId = off::kernel::GRID_ID, name = off::kernel::NAME,
    launchType = off::kernel::LAUNCH_TYPE, graphNodeId = off::kernel::GRAPH_NODE_ID, graphId = off::kernel::GRAPH_ID));
same_offsets!(CUpti_ActivityMemcpy5, CUpti_ActivityMemcpy6, CUpti_ActivityMemcpy7 => (
    copyKind = off::memcpy::COPY_KIND, srcKind = off::memcpy::SRC_KIND, dstKind = off::memcpy::DST_KIND,
    flags = off::memcpy::FLAGS, bytes = off::memcpy::BYTES, start = off::memcpy::START, end = off::memcpy::END,
    deviceId = off::memcpy::DEVICE_ID, contextId = off::memcpy::CONTEXT_ID, streamId = off::memcpy::STREAM_ID,
    correlationId = off::memcpy::CORRELATION_ID, runtimeCorrelationId = off::memcpy::RUNTIME_CORRELATION_ID,
    graphNodeId = off::memcpy::GRAPH_NODE_ID, graphId = off::memcpy::GRAPH_ID));
same_offsets!(CUpti_ActivityMemcpyPtoP4 => (
    copyKind = off::peer::COPY_KIND, srcKind = off::peer::SRC_KIND, dstKind = off::peer::DST_KIND,
    flags = off::peer::FLAGS, bytes = off::peer::BYTES, start = off::peer::START, end = off::peer::END,
    deviceId = off::peer::DEVICE_ID, contextId = off::peer::CONTEXT_ID, streamId = off::peer::STREAM_ID,
    srcDeviceId = off::peer::SRC_DEVICE_ID, srcContextId = off::peer::SRC_CONTEXT_ID,
    dstDeviceId = off::peer::DST_DEVICE_ID, dstContextId = off::peer::DST_CONTEXT_ID,
    correlationId = off::peer::CORRELATION_ID, graphNodeId = off::peer::GRAPH_NODE_ID, graphId = off::peer::GRAPH_ID));
same_offsets!(CUpti_ActivityMemset4, CUpti_ActivityMemset5 => (
    value = off::memset::VALUE, bytes = off::memset::BYTES, start = off::memset::START, end = off::memset::END,
    deviceId = off::memset::DEVICE_ID, contextId = off::memset::CONTEXT_ID, streamId = off::memset::STREAM_ID,
    correlationId = off::memset::CORRELATION_ID, flags = off::memset::FLAGS, memoryKind = off::memset::MEMORY_KIND,
    graphNodeId = off::memset::GRAPH_NODE_ID, graphId = off::memset::GRAPH_ID));
same_offsets!(CUpti_ActivitySynchronization, CUpti_ActivitySynchronization2 => (
    type_ = off::sync::TYPE, start = off::sync::START, end = off::sync::END,
    correlationId = off::sync::CORRELATION_ID, contextId = off::sync::CONTEXT_ID,
    streamId = off::sync::STREAM_ID, cudaEventId = off::sync::CUDA_EVENT_ID));
same_offsets!(CUpti_ActivityGraphTrace, CUpti_ActivityGraphTrace2 => (
    correlationId = off::graph::CORRELATION_ID, start = off::graph::START, end = off::graph::END,
    deviceId = off::graph::DEVICE_ID, graphId = off::graph::GRAPH_ID, contextId = off::graph::CONTEXT_ID,
    streamId = off::graph::STREAM_ID));
same_offsets!(CUpti_ActivityAPI => (
    cbid = off::api::CBID, start = off::api::START, end = off::api::END, processId = off::api::PROCESS_ID,
    threadId = off::api::THREAD_ID, correlationId = off::api::CORRELATION_ID, returnValue = off::api::RETURN_VALUE));

/// The struct sizes of the records one libcupti writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StructSizes {
    pub kernel: usize,
    pub memcpy: usize,
    pub memcpy_peer: usize,
    pub memset: usize,
    pub sync: usize,
    pub api: usize,
    /// GRAPH_TRACE records (not in the wire hello: only `HOPSCOPE_CUPTI_GRAPHS=launch` asks for them).
    pub graph: usize,
}

const K9: usize = size_of::<CUpti_ActivityKernel9>();
const K10: usize = size_of::<CUpti_ActivityKernel10>();
const K11: usize = size_of::<CUpti_ActivityKernel11>();
const K12: usize = size_of::<CUpti_ActivityKernel12>();
const K13: usize = size_of::<CUpti_ActivityKernel13>();
const MC5: usize = size_of::<CUpti_ActivityMemcpy5>();
const MC6: usize = size_of::<CUpti_ActivityMemcpy6>();
const MC7: usize = size_of::<CUpti_ActivityMemcpy7>();
const P2P4: usize = size_of::<CUpti_ActivityMemcpyPtoP4>();
const MS4: usize = size_of::<CUpti_ActivityMemset4>();
const MS5: usize = size_of::<CUpti_ActivityMemset5>();
const SY1: usize = size_of::<CUpti_ActivitySynchronization>();
const SY2: usize = size_of::<CUpti_ActivitySynchronization2>();
const API: usize = size_of::<CUpti_ActivityAPI>();
const GT1: usize = size_of::<CUpti_ActivityGraphTrace>();
const GT2: usize = size_of::<CUpti_ActivityGraphTrace2>();
// The sizes measured in the wheels (clang -fdump-record-layouts) match the generated structs.
const _: () = assert!(K9 == 208 && K10 == 216 && K11 == 224 && K12 == 232 && K13 == 248);
const _: () = assert!(MC5 == 88 && MC6 == 96 && MC7 == 112 && P2P4 == 96 && MS4 == 88 && MS5 == 104);
const _: () = assert!(SY1 == 40 && SY2 == 56 && API == 40 && GT1 == 48 && GT2 == 56);

/// Oldest supported CUPTI (12.4).
pub const MIN_VERSION: u32 = 22;

impl StructSizes {
    /// The bytes the decoder reads of each kind (also the smallest acceptable size).
    pub const PREFIX: StructSizes = StructSizes {
        kernel: off::kernel::PREFIX,
        memcpy: off::memcpy::PREFIX,
        memcpy_peer: off::peer::PREFIX,
        memset: off::memset::PREFIX,
        sync: off::sync::PREFIX,
        api: off::api::PREFIX,
        graph: off::graph::PREFIX,
    };

    /// What CUPTI `version` (from `cuptiGetVersion`) writes; `None` before
    /// 12.4. Unknown newer versions get the newest known sizes (they only
    /// append; 13.0+ should use `cuptiActivityGetStructSize` first).
    pub fn for_version(version: u32) -> Option<StructSizes> {
        let s = |kernel, memcpy, memset, sync, graph| StructSizes { kernel, memcpy, memcpy_peer: P2P4, memset, sync, api: API, graph };
        Some(match version {
            v if v < MIN_VERSION => return None,
            // 12.4 (22), 12.5 (23), 12.6 (24); 25 was never released.
            22..=25 => s(K9, MC5, MS4, SY1, GT1),
            // 12.8 (26), 12.9 (28) and any later 12.x.
            26..=129_999 => s(K9, MC6, MS4, SY2, GT2),
            130_000..=130_099 => s(K10, MC6, MS4, SY2, GT2),
            130_100..=130_299 => s(K11, MC6, MS4, SY2, GT2),
            130_300..=130_399 => s(K12, MC6, MS4, SY2, GT2),
            _ => s(K13, MC7, MS5, SY2, GT2),
        })
    }

    /// The size for an activity kind we decode, `None` for other kinds.
    pub fn of(&self, kind: CUpti_ActivityKind) -> Option<usize> {
        match kind {
            CUPTI_ACTIVITY_KIND_KERNEL | CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL => Some(self.kernel),
            CUPTI_ACTIVITY_KIND_MEMCPY => Some(self.memcpy),
            CUPTI_ACTIVITY_KIND_MEMCPY2 => Some(self.memcpy_peer),
            CUPTI_ACTIVITY_KIND_MEMSET => Some(self.memset),
            CUPTI_ACTIVITY_KIND_SYNCHRONIZATION => Some(self.sync),
            CUPTI_ACTIVITY_KIND_RUNTIME | CUPTI_ACTIVITY_KIND_DRIVER => Some(self.api),
            CUPTI_ACTIVITY_KIND_GRAPH_TRACE => Some(self.graph),
            _ => None,
        }
    }

    /// Replaces one kind's size (from `cuptiActivityGetStructSize`).
    pub fn set(&mut self, kind: CUpti_ActivityKind, size: usize) {
        match kind {
            CUPTI_ACTIVITY_KIND_KERNEL | CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL => self.kernel = size,
            CUPTI_ACTIVITY_KIND_MEMCPY => self.memcpy = size,
            CUPTI_ACTIVITY_KIND_MEMCPY2 => self.memcpy_peer = size,
            CUPTI_ACTIVITY_KIND_MEMSET => self.memset = size,
            CUPTI_ACTIVITY_KIND_SYNCHRONIZATION => self.sync = size,
            CUPTI_ACTIVITY_KIND_RUNTIME | CUPTI_ACTIVITY_KIND_DRIVER => self.api = size,
            CUPTI_ACTIVITY_KIND_GRAPH_TRACE => self.graph = size,
            _ => {}
        }
    }

    /// Fails when a size is smaller than the prefix we read (the library
    /// would write records we cannot decode safely).
    pub fn check(&self) -> Result<(), RecordError> {
        let p = Self::PREFIX;
        for (kind, have, need) in [
            (CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, self.kernel, p.kernel),
            (CUPTI_ACTIVITY_KIND_MEMCPY, self.memcpy, p.memcpy),
            (CUPTI_ACTIVITY_KIND_MEMCPY2, self.memcpy_peer, p.memcpy_peer),
            (CUPTI_ACTIVITY_KIND_MEMSET, self.memset, p.memset),
            (CUPTI_ACTIVITY_KIND_SYNCHRONIZATION, self.sync, p.sync),
            (CUPTI_ACTIVITY_KIND_RUNTIME, self.api, p.api),
            (CUPTI_ACTIVITY_KIND_GRAPH_TRACE, self.graph, p.graph),
        ] {
            if have < need {
                return Err(RecordError::StructTooSmall { kind, size: have, need });
            }
        }
        Ok(())
    }

    /// (kernel, memcpy, memcpy peer, memset, sync, api) for the wire hello.
    pub fn as_array(&self) -> [u16; 6] {
        let c = |v: usize| v.min(u16::MAX as usize) as u16;
        [c(self.kernel), c(self.memcpy), c(self.memcpy_peer), c(self.memset), c(self.sync), c(self.api)]
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    #[error("record of kind {kind} needs {need} bytes but only {have} remain in the buffer")]
    DoesNotFit { kind: u32, need: usize, have: usize },
    #[error("record of kind {kind} is {size} bytes, smaller than the {need} bytes we read")]
    StructTooSmall { kind: u32, size: usize, need: usize },
    #[error("record of kind {0} is not one we decode")]
    UnknownKind(u32),
    #[error("record shorter than its 4-byte kind ({0} bytes)")]
    NoKind(usize),
}

/// A kernel record (timestamps raw, in CUPTI's clock).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelRecord {
    pub start: u64,
    pub end: u64,
    pub device_id: u32,
    pub context_id: u32,
    pub stream_id: u32,
    pub correlation_id: u32,
    pub grid_id: i64,
    pub grid: [i32; 3],
    pub block: [i32; 3],
    pub static_shared_mem: i32,
    pub dynamic_shared_mem: i32,
    pub registers_per_thread: u16,
    pub launch_type: u8,
    /// `const char*` owned by CUPTI; read it inside the completed callback.
    pub name_ptr: usize,
    pub graph_id: u32,
    pub graph_node_id: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerIds {
    pub src_device_id: u32,
    pub src_context_id: u32,
    pub dst_device_id: u32,
    pub dst_context_id: u32,
}

/// A MEMCPY or (with `peer`) MEMCPY2 record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemcpyRecord {
    pub start: u64,
    pub end: u64,
    pub bytes: u64,
    pub copy_kind: u8,
    pub src_kind: u8,
    pub dst_kind: u8,
    pub flags: u8,
    pub device_id: u32,
    pub context_id: u32,
    pub stream_id: u32,
    pub correlation_id: u32,
    pub runtime_correlation_id: u32,
    pub graph_id: u32,
    pub graph_node_id: u64,
    pub peer: Option<PeerIds>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemsetRecord {
    pub start: u64,
    pub end: u64,
    pub bytes: u64,
    pub value: u32,
    pub device_id: u32,
    pub context_id: u32,
    pub stream_id: u32,
    pub correlation_id: u32,
    pub flags: u16,
    pub memory_kind: u16,
    pub graph_id: u32,
    pub graph_node_id: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SyncRecord {
    pub start: u64,
    pub end: u64,
    pub sync_type: u32,
    pub context_id: u32,
    pub stream_id: u32,
    pub correlation_id: u32,
    pub cuda_event_id: u32,
}

/// A GRAPH_TRACE record: one launch of a CUDA graph, from its first node's
/// start to its last node's end (CUPTI then gives no kernel record per node).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphRecord {
    pub start: u64,
    pub end: u64,
    pub device_id: u32,
    pub context_id: u32,
    pub stream_id: u32,
    pub correlation_id: u32,
    pub graph_id: u32,
}

/// A RUNTIME (`driver == false`) or DRIVER API record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ApiRecord {
    pub driver: bool,
    pub cbid: u32,
    pub start: u64,
    pub end: u64,
    pub process_id: u32,
    pub thread_id: u32,
    pub correlation_id: u32,
    pub return_value: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record {
    Kernel(KernelRecord),
    Memcpy(MemcpyRecord),
    Memset(MemsetRecord),
    Sync(SyncRecord),
    Api(ApiRecord),
    Graph(GraphRecord),
}

impl Record {
    /// (start, end) in CUPTI's clock.
    pub fn span(&self) -> (u64, u64) {
        match self {
            Record::Kernel(r) => (r.start, r.end),
            Record::Memcpy(r) => (r.start, r.end),
            Record::Memset(r) => (r.start, r.end),
            Record::Sync(r) => (r.start, r.end),
            Record::Api(r) => (r.start, r.end),
            Record::Graph(r) => (r.start, r.end),
        }
    }
}

struct B<'a>(&'a [u8]);

impl B<'_> {
    fn u8(&self, at: usize) -> u8 {
        self.0[at]
    }
    fn u16(&self, at: usize) -> u16 {
        u16::from_le_bytes([self.0[at], self.0[at + 1]])
    }
    fn u32(&self, at: usize) -> u32 {
        let mut a = [0u8; 4];
        a.copy_from_slice(&self.0[at..at + 4]);
        u32::from_le_bytes(a)
    }
    fn i32(&self, at: usize) -> i32 {
        self.u32(at) as i32
    }
    fn u64(&self, at: usize) -> u64 {
        let mut a = [0u8; 8];
        a.copy_from_slice(&self.0[at..at + 8]);
        u64::from_le_bytes(a)
    }
}

/// The activity kind at the start of a record.
pub fn kind_of(bytes: &[u8]) -> Result<CUpti_ActivityKind, RecordError> {
    let k = bytes.get(..4).ok_or(RecordError::NoKind(bytes.len()))?;
    Ok(u32::from_le_bytes([k[0], k[1], k[2], k[3]]))
}

/// Decodes the record at the start of `bytes` (which runs to the end of the
/// valid buffer region). The record must fit at its version's size.
pub fn decode(bytes: &[u8], sizes: &StructSizes) -> Result<Record, RecordError> {
    let kind = kind_of(bytes)?;
    let size = sizes.of(kind).ok_or(RecordError::UnknownKind(kind))?;
    let need = size.max(StructSizes::PREFIX.of(kind).unwrap_or(size));
    if bytes.len() < need {
        return Err(RecordError::DoesNotFit { kind, need, have: bytes.len() });
    }
    let b = B(&bytes[..need]);
    Ok(match kind {
        CUPTI_ACTIVITY_KIND_KERNEL | CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL => {
            use off::kernel as o;
            Record::Kernel(KernelRecord {
                start: b.u64(o::START),
                end: b.u64(o::END),
                device_id: b.u32(o::DEVICE_ID),
                context_id: b.u32(o::CONTEXT_ID),
                stream_id: b.u32(o::STREAM_ID),
                correlation_id: b.u32(o::CORRELATION_ID),
                grid_id: b.u64(o::GRID_ID) as i64,
                grid: [b.i32(o::GRID_X), b.i32(o::GRID_X + 4), b.i32(o::GRID_X + 8)],
                block: [b.i32(o::BLOCK_X), b.i32(o::BLOCK_X + 4), b.i32(o::BLOCK_X + 8)],
                static_shared_mem: b.i32(o::STATIC_SHARED_MEM),
                dynamic_shared_mem: b.i32(o::DYNAMIC_SHARED_MEM),
                registers_per_thread: b.u16(o::REGISTERS_PER_THREAD),
                launch_type: b.u8(o::LAUNCH_TYPE),
                name_ptr: b.u64(o::NAME) as usize,
                graph_id: b.u32(o::GRAPH_ID),
                graph_node_id: b.u64(o::GRAPH_NODE_ID),
            })
        }
        CUPTI_ACTIVITY_KIND_MEMCPY => {
            use off::memcpy as o;
            Record::Memcpy(MemcpyRecord {
                start: b.u64(o::START),
                end: b.u64(o::END),
                bytes: b.u64(o::BYTES),
                copy_kind: b.u8(o::COPY_KIND),
                src_kind: b.u8(o::SRC_KIND),
                dst_kind: b.u8(o::DST_KIND),
                flags: b.u8(o::FLAGS),
                device_id: b.u32(o::DEVICE_ID),
                context_id: b.u32(o::CONTEXT_ID),
                stream_id: b.u32(o::STREAM_ID),
                correlation_id: b.u32(o::CORRELATION_ID),
                runtime_correlation_id: b.u32(o::RUNTIME_CORRELATION_ID),
                graph_id: b.u32(o::GRAPH_ID),
                graph_node_id: b.u64(o::GRAPH_NODE_ID),
                peer: None,
            })
        }
        CUPTI_ACTIVITY_KIND_MEMCPY2 => {
            use off::peer as o;
            Record::Memcpy(MemcpyRecord {
                start: b.u64(o::START),
                end: b.u64(o::END),
                bytes: b.u64(o::BYTES),
                copy_kind: b.u8(o::COPY_KIND),
                src_kind: b.u8(o::SRC_KIND),
                dst_kind: b.u8(o::DST_KIND),
                flags: b.u8(o::FLAGS),
                device_id: b.u32(o::DEVICE_ID),
                context_id: b.u32(o::CONTEXT_ID),
                stream_id: b.u32(o::STREAM_ID),
                correlation_id: b.u32(o::CORRELATION_ID),
                runtime_correlation_id: 0,
                graph_id: b.u32(o::GRAPH_ID),
                graph_node_id: b.u64(o::GRAPH_NODE_ID),
                peer: Some(PeerIds {
                    src_device_id: b.u32(o::SRC_DEVICE_ID),
                    src_context_id: b.u32(o::SRC_CONTEXT_ID),
                    dst_device_id: b.u32(o::DST_DEVICE_ID),
                    dst_context_id: b.u32(o::DST_CONTEXT_ID),
                }),
            })
        }
        CUPTI_ACTIVITY_KIND_MEMSET => {
            use off::memset as o;
            Record::Memset(MemsetRecord {
                start: b.u64(o::START),
                end: b.u64(o::END),
                bytes: b.u64(o::BYTES),
                value: b.u32(o::VALUE),
                device_id: b.u32(o::DEVICE_ID),
                context_id: b.u32(o::CONTEXT_ID),
                stream_id: b.u32(o::STREAM_ID),
                correlation_id: b.u32(o::CORRELATION_ID),
                flags: b.u16(o::FLAGS),
                memory_kind: b.u16(o::MEMORY_KIND),
                graph_id: b.u32(o::GRAPH_ID),
                graph_node_id: b.u64(o::GRAPH_NODE_ID),
            })
        }
        CUPTI_ACTIVITY_KIND_SYNCHRONIZATION => {
            use off::sync as o;
            Record::Sync(SyncRecord {
                start: b.u64(o::START),
                end: b.u64(o::END),
                sync_type: b.u32(o::TYPE),
                context_id: b.u32(o::CONTEXT_ID),
                stream_id: b.u32(o::STREAM_ID),
                correlation_id: b.u32(o::CORRELATION_ID),
                cuda_event_id: b.u32(o::CUDA_EVENT_ID),
            })
        }
        CUPTI_ACTIVITY_KIND_RUNTIME | CUPTI_ACTIVITY_KIND_DRIVER => {
            use off::api as o;
            Record::Api(ApiRecord {
                driver: kind == CUPTI_ACTIVITY_KIND_DRIVER,
                cbid: b.u32(o::CBID),
                start: b.u64(o::START),
                end: b.u64(o::END),
                process_id: b.u32(o::PROCESS_ID),
                thread_id: b.u32(o::THREAD_ID),
                correlation_id: b.u32(o::CORRELATION_ID),
                return_value: b.u32(o::RETURN_VALUE),
            })
        }
        CUPTI_ACTIVITY_KIND_GRAPH_TRACE => {
            use off::graph as o;
            Record::Graph(GraphRecord {
                start: b.u64(o::START),
                end: b.u64(o::END),
                device_id: b.u32(o::DEVICE_ID),
                context_id: b.u32(o::CONTEXT_ID),
                stream_id: b.u32(o::STREAM_ID),
                correlation_id: b.u32(o::CORRELATION_ID),
                graph_id: b.u32(o::GRAPH_ID),
            })
        }
        k => return Err(RecordError::UnknownKind(k)),
    })
}

/// Writes records the way CUPTI lays them out (for tests and the CUPTI ABI
/// test double): a zeroed struct of `size` bytes with fields at the offsets above.
pub mod build {
    use super::*;

    fn put(b: &mut [u8], at: usize, v: &[u8]) {
        b[at..at + v.len()].copy_from_slice(v);
    }

    pub fn kernel(size: usize, r: &KernelRecord) -> Vec<u8> {
        use off::kernel as o;
        let mut b = vec![0u8; size];
        put(&mut b, 0, &CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL.to_le_bytes());
        put(&mut b, o::REGISTERS_PER_THREAD, &r.registers_per_thread.to_le_bytes());
        put(&mut b, o::START, &r.start.to_le_bytes());
        put(&mut b, o::END, &r.end.to_le_bytes());
        put(&mut b, o::DEVICE_ID, &r.device_id.to_le_bytes());
        put(&mut b, o::CONTEXT_ID, &r.context_id.to_le_bytes());
        put(&mut b, o::STREAM_ID, &r.stream_id.to_le_bytes());
        for i in 0..3 {
            put(&mut b, o::GRID_X + 4 * i, &r.grid[i].to_le_bytes());
            put(&mut b, o::BLOCK_X + 4 * i, &r.block[i].to_le_bytes());
        }
        put(&mut b, o::STATIC_SHARED_MEM, &r.static_shared_mem.to_le_bytes());
        put(&mut b, o::DYNAMIC_SHARED_MEM, &r.dynamic_shared_mem.to_le_bytes());
        put(&mut b, o::CORRELATION_ID, &r.correlation_id.to_le_bytes());
        put(&mut b, o::GRID_ID, &r.grid_id.to_le_bytes());
        put(&mut b, o::NAME, &(r.name_ptr as u64).to_le_bytes());
        b[o::LAUNCH_TYPE] = r.launch_type;
        put(&mut b, o::GRAPH_NODE_ID, &r.graph_node_id.to_le_bytes());
        put(&mut b, o::GRAPH_ID, &r.graph_id.to_le_bytes());
        b
    }

    /// MEMCPY, or MEMCPY2 when `r.peer` is set (pass the matching size).
    pub fn memcpy(size: usize, r: &MemcpyRecord) -> Vec<u8> {
        let mut b = vec![0u8; size];
        let (kind, corr, node, graph) = match r.peer {
            None => (CUPTI_ACTIVITY_KIND_MEMCPY, off::memcpy::CORRELATION_ID, off::memcpy::GRAPH_NODE_ID, off::memcpy::GRAPH_ID),
            Some(_) => (CUPTI_ACTIVITY_KIND_MEMCPY2, off::peer::CORRELATION_ID, off::peer::GRAPH_NODE_ID, off::peer::GRAPH_ID),
        };
        put(&mut b, 0, &kind.to_le_bytes());
        b[off::memcpy::COPY_KIND] = r.copy_kind;
        b[off::memcpy::SRC_KIND] = r.src_kind;
        b[off::memcpy::DST_KIND] = r.dst_kind;
        b[off::memcpy::FLAGS] = r.flags;
        put(&mut b, off::memcpy::BYTES, &r.bytes.to_le_bytes());
        put(&mut b, off::memcpy::START, &r.start.to_le_bytes());
        put(&mut b, off::memcpy::END, &r.end.to_le_bytes());
        put(&mut b, off::memcpy::DEVICE_ID, &r.device_id.to_le_bytes());
        put(&mut b, off::memcpy::CONTEXT_ID, &r.context_id.to_le_bytes());
        put(&mut b, off::memcpy::STREAM_ID, &r.stream_id.to_le_bytes());
        put(&mut b, corr, &r.correlation_id.to_le_bytes());
        put(&mut b, node, &r.graph_node_id.to_le_bytes());
        put(&mut b, graph, &r.graph_id.to_le_bytes());
        match r.peer {
            None => put(&mut b, off::memcpy::RUNTIME_CORRELATION_ID, &r.runtime_correlation_id.to_le_bytes()),
            Some(p) => {
                put(&mut b, off::peer::SRC_DEVICE_ID, &p.src_device_id.to_le_bytes());
                put(&mut b, off::peer::SRC_CONTEXT_ID, &p.src_context_id.to_le_bytes());
                put(&mut b, off::peer::DST_DEVICE_ID, &p.dst_device_id.to_le_bytes());
                put(&mut b, off::peer::DST_CONTEXT_ID, &p.dst_context_id.to_le_bytes());
            }
        }
        b
    }

    pub fn memset(size: usize, r: &MemsetRecord) -> Vec<u8> {
        use off::memset as o;
        let mut b = vec![0u8; size];
        put(&mut b, 0, &CUPTI_ACTIVITY_KIND_MEMSET.to_le_bytes());
        put(&mut b, o::VALUE, &r.value.to_le_bytes());
        put(&mut b, o::BYTES, &r.bytes.to_le_bytes());
        put(&mut b, o::START, &r.start.to_le_bytes());
        put(&mut b, o::END, &r.end.to_le_bytes());
        put(&mut b, o::DEVICE_ID, &r.device_id.to_le_bytes());
        put(&mut b, o::CONTEXT_ID, &r.context_id.to_le_bytes());
        put(&mut b, o::STREAM_ID, &r.stream_id.to_le_bytes());
        put(&mut b, o::CORRELATION_ID, &r.correlation_id.to_le_bytes());
        put(&mut b, o::FLAGS, &r.flags.to_le_bytes());
        put(&mut b, o::MEMORY_KIND, &r.memory_kind.to_le_bytes());
        put(&mut b, o::GRAPH_NODE_ID, &r.graph_node_id.to_le_bytes());
        put(&mut b, o::GRAPH_ID, &r.graph_id.to_le_bytes());
        b
    }

    pub fn sync(size: usize, r: &SyncRecord) -> Vec<u8> {
        use off::sync as o;
        let mut b = vec![0u8; size];
        put(&mut b, 0, &CUPTI_ACTIVITY_KIND_SYNCHRONIZATION.to_le_bytes());
        put(&mut b, o::TYPE, &r.sync_type.to_le_bytes());
        put(&mut b, o::START, &r.start.to_le_bytes());
        put(&mut b, o::END, &r.end.to_le_bytes());
        put(&mut b, o::CORRELATION_ID, &r.correlation_id.to_le_bytes());
        put(&mut b, o::CONTEXT_ID, &r.context_id.to_le_bytes());
        put(&mut b, o::STREAM_ID, &r.stream_id.to_le_bytes());
        put(&mut b, o::CUDA_EVENT_ID, &r.cuda_event_id.to_le_bytes());
        b
    }

    pub fn api(size: usize, r: &ApiRecord) -> Vec<u8> {
        use off::api as o;
        let mut b = vec![0u8; size];
        let kind = if r.driver { CUPTI_ACTIVITY_KIND_DRIVER } else { CUPTI_ACTIVITY_KIND_RUNTIME };
        put(&mut b, 0, &kind.to_le_bytes());
        put(&mut b, o::CBID, &r.cbid.to_le_bytes());
        put(&mut b, o::START, &r.start.to_le_bytes());
        put(&mut b, o::END, &r.end.to_le_bytes());
        put(&mut b, o::PROCESS_ID, &r.process_id.to_le_bytes());
        put(&mut b, o::THREAD_ID, &r.thread_id.to_le_bytes());
        put(&mut b, o::CORRELATION_ID, &r.correlation_id.to_le_bytes());
        put(&mut b, o::RETURN_VALUE, &r.return_value.to_le_bytes());
        b
    }

    pub fn graph(size: usize, r: &GraphRecord) -> Vec<u8> {
        use off::graph as o;
        let mut b = vec![0u8; size];
        put(&mut b, 0, &CUPTI_ACTIVITY_KIND_GRAPH_TRACE.to_le_bytes());
        put(&mut b, o::CORRELATION_ID, &r.correlation_id.to_le_bytes());
        put(&mut b, o::START, &r.start.to_le_bytes());
        put(&mut b, o::END, &r.end.to_le_bytes());
        put(&mut b, o::DEVICE_ID, &r.device_id.to_le_bytes());
        put(&mut b, o::GRAPH_ID, &r.graph_id.to_le_bytes());
        put(&mut b, o::CONTEXT_ID, &r.context_id.to_le_bytes());
        put(&mut b, o::STREAM_ID, &r.stream_id.to_le_bytes());
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every release we claim, with what `cuptiGetVersion` returns.
    const VERSIONS: &[(&str, u32)] = &[
        ("12.4", 22),
        ("12.5", 23),
        ("12.6", 24),
        ("12.8", 26),
        ("12.9", 28),
        ("13.0", 130001),
        ("13.1", 130101),
        ("13.2", 130202),
        ("13.3", 130301),
        ("13.4", 130401),
    ];

    fn kernel() -> KernelRecord {
        KernelRecord {
            start: 1_000_000_123,
            end: 1_000_050_456,
            device_id: 1,
            context_id: 2,
            stream_id: 7,
            correlation_id: 4242,
            grid_id: -9,
            grid: [108, 2, 1],
            block: [256, 1, 1],
            static_shared_mem: 1024,
            dynamic_shared_mem: 65536,
            registers_per_thread: 168,
            launch_type: 1,
            name_ptr: 0x7f00_dead_beef,
            graph_id: 31,
            graph_node_id: 0x0123_4567_89ab_cdef,
        }
    }

    #[test]
    fn sizes_per_version_match_the_wheel_headers() {
        let table: Vec<(u32, [usize; 6])> = VERSIONS
            .iter()
            .map(|(_, v)| {
                let s = StructSizes::for_version(*v).unwrap();
                (*v, [s.kernel, s.memcpy, s.memcpy_peer, s.memset, s.sync, s.api])
            })
            .collect();
        assert_eq!(
            table,
            vec![
                (22, [208, 88, 96, 88, 40, 40]),
                (23, [208, 88, 96, 88, 40, 40]),
                (24, [208, 88, 96, 88, 40, 40]),
                (26, [208, 96, 96, 88, 56, 40]),
                (28, [208, 96, 96, 88, 56, 40]),
                (130001, [216, 96, 96, 88, 56, 40]),
                (130101, [224, 96, 96, 88, 56, 40]),
                (130202, [224, 96, 96, 88, 56, 40]),
                (130301, [232, 96, 96, 88, 56, 40]),
                (130401, [248, 112, 96, 104, 56, 40]),
            ]
        );
        assert_eq!(StructSizes::for_version(21), None, "12.3 and older are refused");
        assert_eq!(StructSizes::for_version(140000), StructSizes::for_version(130401), "newer: newest known");
        for (_, v) in VERSIONS {
            StructSizes::for_version(*v).unwrap().check().unwrap();
        }
    }

    #[test]
    fn every_kind_decodes_exactly_at_every_version_size() {
        for (name, v) in VERSIONS {
            let s = StructSizes::for_version(*v).unwrap();
            let k = kernel();
            assert_eq!(decode(&build::kernel(s.kernel, &k), &s).unwrap(), Record::Kernel(k), "{name}");

            let m = MemcpyRecord {
                start: 10,
                end: 20,
                bytes: 1 << 33,
                copy_kind: 2,
                src_kind: 4,
                dst_kind: 3,
                flags: 1,
                device_id: 3,
                context_id: 4,
                stream_id: 5,
                correlation_id: 6,
                runtime_correlation_id: 7,
                graph_id: 8,
                graph_node_id: 9,
                peer: None,
            };
            assert_eq!(decode(&build::memcpy(s.memcpy, &m), &s).unwrap(), Record::Memcpy(m), "{name}");
            let p = MemcpyRecord {
                runtime_correlation_id: 0,
                copy_kind: 10,
                peer: Some(PeerIds { src_device_id: 0, src_context_id: 1, dst_device_id: 2, dst_context_id: 3 }),
                ..m
            };
            assert_eq!(decode(&build::memcpy(s.memcpy_peer, &p), &s).unwrap(), Record::Memcpy(p), "{name}");

            let ms = MemsetRecord {
                start: 30,
                end: 31,
                bytes: 4096,
                value: 0xdead_beef,
                device_id: 0,
                context_id: 1,
                stream_id: 2,
                correlation_id: 3,
                flags: 1,
                memory_kind: 4,
                graph_id: 5,
                graph_node_id: 6,
            };
            assert_eq!(decode(&build::memset(s.memset, &ms), &s).unwrap(), Record::Memset(ms), "{name}");

            let sy = SyncRecord {
                start: 40,
                end: 50,
                sync_type: 3,
                context_id: 1,
                stream_id: 7,
                correlation_id: 77,
                cuda_event_id: u32::MAX,
            };
            assert_eq!(decode(&build::sync(s.sync, &sy), &s).unwrap(), Record::Sync(sy), "{name}");

            for driver in [false, true] {
                let a = ApiRecord {
                    driver,
                    cbid: 211,
                    start: 60,
                    end: 61,
                    process_id: 100,
                    thread_id: 101,
                    correlation_id: 102,
                    return_value: 0,
                };
                assert_eq!(decode(&build::api(s.api, &a), &s).unwrap(), Record::Api(a), "{name}");
            }
        }
    }

    /// Bytes laid out by hand at the documented offsets (not via `build`),
    /// as a second opinion on both the builder and the decoder.
    #[test]
    fn a_hand_laid_kernel9_record_decodes_field_by_field() {
        let mut b = [0u8; 208];
        b[0..4].copy_from_slice(&10u32.to_le_bytes()); // CONCURRENT_KERNEL
        b[6..8].copy_from_slice(&32u16.to_le_bytes());
        b[16..24].copy_from_slice(&111u64.to_le_bytes());
        b[24..32].copy_from_slice(&222u64.to_le_bytes());
        b[40..44].copy_from_slice(&3u32.to_le_bytes());
        b[48..52].copy_from_slice(&13u32.to_le_bytes());
        b[52..56].copy_from_slice(&64i32.to_le_bytes());
        b[64..68].copy_from_slice(&128i32.to_le_bytes());
        b[92..96].copy_from_slice(&5150u32.to_le_bytes());
        b[104..112].copy_from_slice(&0x1234u64.to_le_bytes());
        b[144..152].copy_from_slice(&77u64.to_le_bytes());
        b[156..160].copy_from_slice(&9u32.to_le_bytes());
        let Record::Kernel(k) = decode(&b, &StructSizes::for_version(28).unwrap()).unwrap() else { panic!("not a kernel") };
        assert_eq!((k.start, k.end, k.device_id, k.stream_id), (111, 222, 3, 13));
        assert_eq!((k.grid[0], k.block[0], k.registers_per_thread), (64, 128, 32));
        assert_eq!((k.correlation_id, k.name_ptr, k.graph_node_id, k.graph_id), (5150, 0x1234, 77, 9));
    }

    #[test]
    fn a_record_cut_by_the_end_of_the_buffer_is_refused_not_read() {
        let s = StructSizes::for_version(130401).unwrap();
        let full = build::kernel(s.kernel, &kernel());
        for cut in [0, 3, 4, 100, 159, 160, 247] {
            let e = decode(&full[..cut], &s).unwrap_err();
            match cut {
                0 | 3 => assert_eq!(e, RecordError::NoKind(cut)),
                _ => assert_eq!(e, RecordError::DoesNotFit { kind: CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, need: 248, have: cut }),
            }
        }
        // A 12.9 record in a 13.4 library's buffer would be too short; the
        // 12.9 size accepts the same bytes.
        let old = build::kernel(208, &kernel());
        assert!(decode(&old, &s).is_err());
        assert!(decode(&old, &StructSizes::for_version(28).unwrap()).is_ok());
    }

    #[test]
    fn a_graph_launch_record_decodes_at_each_versions_size() {
        let g = GraphRecord { start: 10, end: 90, device_id: 1, context_id: 2, stream_id: 13, correlation_id: 77, graph_id: 5 };
        for (v, size) in [(22, 48), (24, 48), (26, 56), (28, 56), (130001, 56), (130401, 56)] {
            let s = StructSizes::for_version(v).unwrap();
            assert_eq!(s.graph, size, "version {v}");
            let b = build::graph(size, &g);
            assert_eq!(decode(&b, &s), Ok(Record::Graph(g)), "version {v}");
            // Cut short of its version's size: not read.
            assert!(matches!(decode(&b[..size - 1], &s), Err(RecordError::DoesNotFit { kind: 51, .. })));
        }
        assert_eq!(Record::Graph(g).span(), (10, 90));
    }

    #[test]
    fn kinds_we_did_not_ask_for_are_named_not_guessed() {
        let mut b = vec![0u8; 64];
        b[..4].copy_from_slice(&CUPTI_ACTIVITY_KIND_GRAPH_HOST_NODE.to_le_bytes());
        assert_eq!(decode(&b, &StructSizes::for_version(28).unwrap()), Err(RecordError::UnknownKind(CUPTI_ACTIVITY_KIND_GRAPH_HOST_NODE)));
        b[..4].copy_from_slice(&0xffff_fff0u32.to_le_bytes());
        assert_eq!(decode(&b, &StructSizes::for_version(28).unwrap()), Err(RecordError::UnknownKind(0xffff_fff0)));
    }

    #[test]
    fn a_struct_size_below_our_prefix_is_rejected() {
        let mut s = StructSizes::for_version(130401).unwrap();
        s.set(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, 150);
        assert_eq!(
            s.check(),
            Err(RecordError::StructTooSmall { kind: CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, size: 150, need: 160 })
        );
        // A record read with a too-small reported size still needs our prefix.
        let k = build::kernel(248, &kernel());
        assert!(decode(&k[..155], &s).is_err());
    }

    #[test]
    fn random_bytes_never_panic_the_decoder() {
        let mut x: u64 = 88172645463325252;
        let s = StructSizes::for_version(130401).unwrap();
        for _ in 0..50_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let n = (x % 300) as usize;
            let mut b: Vec<u8> = (0..n).map(|i| (x >> (i % 56)) as u8).collect();
            if n >= 4 {
                let kinds = [1u32, 2, 4, 5, 10, 22, 38, 3, 51, 0];
                b[..4].copy_from_slice(&kinds[(x % kinds.len() as u64) as usize].to_le_bytes());
            }
            let _ = decode(&b, &s);
        }
    }
}
