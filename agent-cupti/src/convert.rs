//! Decoded CUPTI records → validated wire frames, with names interned.

use crate::apis;
use crate::counters::Local;
use cupti_sys::clock::{convert_span, BadTimestamp, Conversion, TimeBounds};
use cupti_sys::record::Record;
use hopscope_gpu_wire as wire;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

/// Names seen by this process: each gets one id (from 1) for the process's
/// life; the sender announces an id on a connection before its first use.
#[derive(Default)]
pub struct NameTable {
    ids: HashMap<Arc<[u8]>, u32>,
    /// Each id's bytes as first seen (before any cut), for [`NameTable::intern_at`].
    raw: Vec<Arc<[u8]>>,
    names: Vec<Arc<str>>,
    /// Where a name last lay → its id. CUPTI shares one name string among
    /// all records of a kernel (cupti_activity.h, `CUpti_ActivityKernel*::name`),
    /// so the address finds the id without hashing the name: hashing a
    /// mangled template name of a kilobyte or more was most of the library's
    /// cost per kernel record (`cargo xtask bench-injection`).
    by_addr: HashMap<usize, u32, BuildHasherDefault<AddrHasher>>,
}

/// Hashes an address with one multiply: SipHash of a usize was a twentieth
/// of the callback's time per kernel record.
#[derive(Default)]
struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn finish(&self) -> u64 {
        // The product's high half is well mixed; fold it into the low bits,
        // which pick the bucket (addresses end in zero bits).
        let h = self.0.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        h ^ (h >> 32)
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_usize(&mut self, n: usize) {
        self.0 = n as u64;
    }
}

/// Addresses remembered at most (a process loading modules without end
/// would otherwise grow the map); past it the map starts again.
const MAX_ADDRS: usize = 1 << 16;

impl NameTable {
    /// [`NameTable::intern`] of `raw`, the bytes at `addr`, by address when
    /// it was seen there before. The bytes are compared all the same: a
    /// string freed with its module may be reused for another name.
    pub fn intern_at(&mut self, addr: usize, raw: &[u8]) -> (u32, bool) {
        if let Some(&id) = self.by_addr.get(&addr) {
            if self.raw.get(id as usize - 1).is_some_and(|r| **r == *raw) {
                return (id, false);
            }
        }
        let got = self.intern(raw);
        if self.by_addr.len() >= MAX_ADDRS {
            self.by_addr.clear();
        }
        self.by_addr.insert(addr, got.0);
        got
    }

    /// The id of `raw` (bytes of a C string, or a static name), and whether it
    /// had to be cut to the wire's string limit when first seen.
    pub fn intern(&mut self, raw: &[u8]) -> (u32, bool) {
        if let Some(id) = self.ids.get(raw) {
            return (*id, false);
        }
        let text = String::from_utf8_lossy(raw);
        let cut = wire::truncate_str(&text, wire::MAX_STR);
        let truncated = cut.len() < text.len();
        self.names.push(Arc::from(cut));
        let id = self.names.len() as u32;
        let raw: Arc<[u8]> = raw.into();
        self.raw.push(Arc::clone(&raw));
        self.ids.insert(raw, id);
        (id, truncated)
    }

    /// The name of `id` (1-based).
    pub fn get(&self, id: u32) -> Option<Arc<str>> {
        self.names.get((id as usize).checked_sub(1)?).cloned()
    }

    #[cfg(test)]
    pub fn len(&self) -> u32 {
        self.names.len() as u32
    }
}

/// Frames from one activity buffer.
#[derive(Debug, Default)]
pub struct Batch {
    pub bytes: Vec<u8>,
    pub records: u64,
    /// Highest name id the frames use (0: none).
    pub max_name_id: u32,
}

/// Where kernel names come from: CUPTI's `const char*` in production, a
/// table in tests. Returns the name's bytes without the NUL.
pub trait NameSource {
    fn kernel_name(&mut self, ptr: usize) -> Option<&[u8]>;
}

/// Appends `rec` to `batch` when its timestamps are sane; counts it otherwise.
pub fn push(
    batch: &mut Batch,
    rec: Record,
    conv: Conversion,
    bounds: TimeBounds,
    names: &mut NameTable,
    src: &mut dyn NameSource,
    counts: &mut Local,
) {
    let (raw_start, raw_end) = rec.span();
    let (start_ns, end_ns) = match convert_span(raw_start, raw_end, conv, bounds) {
        Ok(s) => s,
        Err(e) => {
            match e {
                BadTimestamp::Zero => counts.bad_zero += 1,
                BadTimestamp::Reversed => counts.bad_reversed += 1,
                BadTimestamp::Future => counts.bad_future += 1,
                BadTimestamp::Past => counts.bad_past += 1,
            }
            return;
        }
    };
    let mut intern = |addr: usize, raw: &[u8], counts: &mut Local| {
        let (id, cut) = names.intern_at(addr, raw);
        if cut {
            counts.name_truncated += 1;
        }
        batch.max_name_id = batch.max_name_id.max(id);
        id
    };
    let msg = match rec {
        Record::Kernel(k) => {
            let name_id = match (k.name_ptr != 0).then(|| src.kernel_name(k.name_ptr)).flatten() {
                Some(raw) => intern(k.name_ptr, raw, counts),
                None => 0,
            };
            wire::Message::Kernel(wire::Kernel {
                start_ns,
                end_ns,
                device_id: k.device_id,
                context_id: k.context_id,
                stream_id: k.stream_id,
                correlation_id: k.correlation_id,
                grid_id: k.grid_id,
                grid: k.grid.map(|v| v as u32),
                block: k.block.map(|v| v as u32),
                static_shared_mem: k.static_shared_mem as u32,
                dynamic_shared_mem: k.dynamic_shared_mem as u32,
                registers_per_thread: k.registers_per_thread,
                launch_type: k.launch_type,
                name_id,
                graph_id: k.graph_id,
                graph_node_id: k.graph_node_id,
            })
        }
        Record::Memcpy(m) => wire::Message::Memcpy(wire::Memcpy {
            start_ns,
            end_ns,
            bytes: m.bytes,
            copy_kind: m.copy_kind,
            src_kind: m.src_kind,
            dst_kind: m.dst_kind,
            flags: m.flags,
            device_id: m.device_id,
            context_id: m.context_id,
            stream_id: m.stream_id,
            correlation_id: m.correlation_id,
            runtime_correlation_id: m.runtime_correlation_id,
            graph_id: m.graph_id,
            graph_node_id: m.graph_node_id,
            peer: m.peer.map(|p| wire::Peer {
                src_device_id: p.src_device_id,
                src_context_id: p.src_context_id,
                dst_device_id: p.dst_device_id,
                dst_context_id: p.dst_context_id,
            }),
        }),
        Record::Memset(m) => wire::Message::Memset(wire::Memset {
            start_ns,
            end_ns,
            bytes: m.bytes,
            value: m.value,
            device_id: m.device_id,
            context_id: m.context_id,
            stream_id: m.stream_id,
            correlation_id: m.correlation_id,
            flags: m.flags,
            memory_kind: m.memory_kind,
            graph_id: m.graph_id,
            graph_node_id: m.graph_node_id,
        }),
        Record::Sync(s) => wire::Message::Sync(wire::Sync {
            start_ns,
            end_ns,
            sync_type: s.sync_type,
            context_id: s.context_id,
            stream_id: s.stream_id,
            correlation_id: s.correlation_id,
            cuda_event_id: s.cuda_event_id,
        }),
        Record::Api(a) => {
            let Some(t) = apis::lookup(a.driver, a.cbid) else {
                // Only traced APIs are enabled; anything else is not ours to send.
                counts.unknown_kind += 1;
                return;
            };
            let name_id = intern(t.name.as_ptr() as usize, t.name.as_bytes(), counts);
            wire::Message::Api(wire::Api {
                start_ns,
                end_ns,
                domain: if a.driver { wire::ApiDomain::Driver } else { wire::ApiDomain::Runtime },
                class: t.class,
                cbid: a.cbid,
                name_id,
                process_id: a.process_id,
                thread_id: a.thread_id,
                correlation_id: a.correlation_id,
                return_value: a.return_value,
            })
        }
        // One launch of a whole graph: a kernel message named after the graph,
        // so that steps, GPU time and traces treat it as the kernels it ran.
        Record::Graph(g) => {
            let name = wire::whole_graph_name(g.graph_id);
            let (id, _) = names.intern(name.as_bytes());
            batch.max_name_id = batch.max_name_id.max(id);
            wire::Message::Kernel(wire::Kernel {
                start_ns,
                end_ns,
                device_id: g.device_id,
                context_id: g.context_id,
                stream_id: g.stream_id,
                correlation_id: g.correlation_id,
                grid_id: 0,
                grid: [0; 3],
                block: [0; 3],
                static_shared_mem: 0,
                dynamic_shared_mem: 0,
                registers_per_thread: 0,
                launch_type: 0,
                name_id: id,
                graph_id: g.graph_id,
                graph_node_id: wire::WHOLE_GRAPH,
            })
        }
    };
    msg.encode(&mut batch.bytes);
    batch.records += 1;
    counts.decoded += 1;
}

#[cfg(test)]
mod tests {
    use super::*;
    use cupti_sys::record::{ApiRecord, KernelRecord, SyncRecord};

    struct Fake(Vec<(usize, Vec<u8>)>);
    impl NameSource for Fake {
        fn kernel_name(&mut self, ptr: usize) -> Option<&[u8]> {
            self.0.iter().find(|(p, _)| *p == ptr).map(|(_, n)| n.as_slice())
        }
    }

    fn kernel(start: u64, end: u64, name_ptr: usize) -> Record {
        Record::Kernel(KernelRecord {
            start,
            end,
            device_id: 0,
            context_id: 1,
            stream_id: 7,
            correlation_id: 5,
            grid_id: 1,
            grid: [4, 1, 1],
            block: [128, 1, 1],
            static_shared_mem: 0,
            dynamic_shared_mem: 0,
            registers_per_thread: 32,
            launch_type: 0,
            name_ptr,
            graph_id: 0,
            graph_node_id: 0,
        })
    }

    fn decode_all(b: &Batch) -> Vec<wire::Message> {
        let mut d = wire::FrameDecoder::default();
        d.push(&b.bytes);
        std::iter::from_fn(|| d.next_message()).map(|m| m.unwrap()).collect()
    }

    #[test]
    fn names_are_interned_once_and_lossy_utf8_is_kept_readable() {
        let mut t = NameTable::default();
        assert_eq!(t.intern(b"gemm"), (1, false));
        assert_eq!(t.intern(b"attn\xff"), (2, false));
        assert_eq!(t.intern(b"gemm"), (1, false));
        assert_eq!(&*t.get(2).unwrap(), "attn\u{fffd}");
        assert_eq!(t.get(0), None);
        let long = vec![b'k'; wire::MAX_STR + 10];
        assert_eq!(t.intern(&long), (3, true));
        assert_eq!(t.get(3).unwrap().len(), wire::MAX_STR);
    }

    #[test]
    fn a_name_found_by_its_address_is_still_checked_against_the_bytes_there() {
        let mut t = NameTable::default();
        assert_eq!(t.intern_at(0x10, b"gemm"), (1, false));
        assert_eq!(t.intern_at(0x10, b"gemm"), (1, false), "same address, same name");
        assert_eq!(t.intern_at(0x20, b"gemm"), (1, false), "one name, two addresses: one id");
        assert_eq!(t.intern_at(0x10, b"attn"), (2, false), "an address reused for another name");
        assert_eq!(t.intern_at(0x10, b"attn"), (2, false));
        assert_eq!(t.intern_at(0x20, b"gemm"), (1, false));
        assert_eq!(t.intern(b"attn"), (2, false), "by content as before");
        let long = vec![b'k'; wire::MAX_STR + 10];
        assert_eq!(t.intern_at(0x30, &long), (3, true));
        assert_eq!(t.intern_at(0x30, &long), (3, false), "cut is said once, when first seen");
        for a in 0..MAX_ADDRS + 5 {
            t.intern_at(0x1000 + a, b"gemm");
        }
        assert!(t.by_addr.len() <= MAX_ADDRS, "addresses remembered are bounded");
        assert_eq!(t.len(), 3);
    }

    #[test]
    fn good_records_become_frames_and_bad_timestamps_are_counted_not_sent() {
        let bounds = TimeBounds::new(1_000_000_000_000, 2_000_000_000_000);
        let mut b = Batch::default();
        let mut names = NameTable::default();
        let mut src = Fake(vec![(0x10, b"k_a".to_vec()), (0x20, b"k_b".to_vec())]);
        let mut n = Local::default();
        let t = 1_500_000_000_000;
        for rec in [
            kernel(t, t + 10, 0x10),
            kernel(t + 20, t + 30, 0x20),
            kernel(t + 40, t + 50, 0x10),
            kernel(0, t, 0x10),
            kernel(t + 5, t + 1, 0x10),
            kernel(t, u64::MAX / 2, 0x10),
            kernel(7, 8, 0x10),
            kernel(t, t + 1, 0),
        ] {
            push(&mut b, rec, Conversion::Identity, bounds, &mut names, &mut src, &mut n);
        }
        assert_eq!((n.decoded, n.bad_zero, n.bad_reversed, n.bad_future, n.bad_past), (4, 1, 1, 1, 1));
        assert_eq!((b.records, b.max_name_id, names.len()), (4, 2, 2));
        let ids: Vec<u32> = decode_all(&b)
            .iter()
            .map(|m| match m {
                wire::Message::Kernel(k) => k.name_id,
                m => panic!("unexpected {m:?}"),
            })
            .collect();
        assert_eq!(ids, vec![1, 2, 1, 0], "a null name pointer is name id 0");
    }

    #[test]
    fn a_graph_launch_becomes_one_kernel_named_after_its_graph() {
        let bounds = TimeBounds::new(1_000_000_000_000, 2_000_000_000_000);
        let (mut b, mut names, mut n) = (Batch::default(), NameTable::default(), Local::default());
        let mut src = Fake(vec![(0x10, b"k_a".to_vec())]);
        let t = 1_500_000_000_000;
        let graph = |start, graph_id| {
            Record::Graph(cupti_sys::record::GraphRecord { start, end: start + 500, device_id: 1, context_id: 2, stream_id: 9, correlation_id: 40, graph_id })
        };
        for rec in [kernel(t, t + 10, 0x10), graph(t + 20, 5), graph(t + 600, 5), graph(t + 1200, 6), graph(0, 6)] {
            push(&mut b, rec, Conversion::Identity, bounds, &mut names, &mut src, &mut n);
        }
        assert_eq!((n.decoded, n.bad_zero, b.records, b.max_name_id), (4, 1, 4, 3));
        let got: Vec<(u32, u64, u64, u32, u64, u32)> = decode_all(&b)
            .iter()
            .map(|m| match m {
                wire::Message::Kernel(k) => (k.name_id, k.start_ns, k.end_ns, k.graph_id, k.graph_node_id, k.stream_id),
                m => panic!("unexpected {m:?}"),
            })
            .collect();
        let w = wire::WHOLE_GRAPH;
        assert_eq!(got, [(1, t, t + 10, 0, 0, 7), (2, t + 20, t + 520, 5, w, 9), (2, t + 600, t + 1100, 5, w, 9), (3, t + 1200, t + 1700, 6, w, 9)]);
        assert_eq!((&*names.get(2).unwrap(), &*names.get(3).unwrap()), ("[CUDA graph 5]", "[CUDA graph 6]"));
    }

    #[test]
    fn an_offset_is_applied_to_every_timestamp() {
        let realtime = 1_790_000_000_000_000_000u64;
        let mono = 3_000_000_000_000u64;
        let conv = Conversion::Offset(mono as i64 - realtime as i64);
        let bounds = TimeBounds::new(mono - 1, mono + 1_000);
        let mut b = Batch::default();
        let mut n = Local::default();
        let rec = Record::Sync(SyncRecord {
            start: realtime + 100,
            end: realtime + 900,
            sync_type: 3,
            context_id: 1,
            stream_id: 2,
            correlation_id: 3,
            cuda_event_id: u32::MAX,
        });
        push(&mut b, rec, conv, bounds, &mut NameTable::default(), &mut Fake(vec![]), &mut n);
        let [wire::Message::Sync(s)] = decode_all(&b)[..] else { panic!("one sync") };
        assert_eq!((s.start_ns, s.end_ns), (mono + 100, mono + 900));
    }

    #[test]
    fn api_records_carry_their_class_and_an_interned_name_and_unknown_apis_are_dropped() {
        let bounds = TimeBounds::new(10, 10_000);
        let mut b = Batch::default();
        let mut names = NameTable::default();
        let mut n = Local::default();
        let api = |cbid| {
            Record::Api(ApiRecord {
                driver: true,
                cbid,
                start: 100,
                end: 200,
                process_id: 1,
                thread_id: 2,
                correlation_id: 3,
                return_value: 0,
            })
        };
        push(&mut b, api(cupti_sys::CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel), Conversion::Identity, bounds, &mut names, &mut Fake(vec![]), &mut n);
        push(&mut b, api(cupti_sys::CUPTI_DRIVER_TRACE_CBID_cuMemAlloc_v2), Conversion::Identity, bounds, &mut names, &mut Fake(vec![]), &mut n);
        assert_eq!((n.decoded, n.unknown_kind), (1, 1));
        let [wire::Message::Api(a)] = decode_all(&b)[..] else { panic!("one api") };
        assert_eq!((a.class, a.domain, a.name_id), (wire::ApiClass::KernelLaunch, wire::ApiDomain::Driver, 1));
        assert_eq!(&*names.get(1).unwrap(), "cuLaunchKernel");
    }
}
