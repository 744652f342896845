//! Decoding a real CUPTI activity buffer (an H100, CUPTI 13.0.1: tests/fixtures/README.md),
//! record by record, with the sizes `StructSizes::for_version` gives that version.

use cupti_sys::record::{self, Record, StructSizes};
use std::collections::BTreeMap;

const H100_EXACT: &[u8] = include_bytes!("fixtures/cupti-13.0.1-h100-exact.bin");

fn records(buf: &[u8], sizes: &StructSizes) -> Vec<Record> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < buf.len() {
        let kind = record::kind_of(&buf[at..]).unwrap_or_else(|e| panic!("record at {at}: {e}"));
        let size = sizes.of(kind).unwrap_or_else(|| panic!("record at {at}: kind {kind} is not one we enabled"));
        out.push(record::decode(&buf[at..], sizes).unwrap_or_else(|e| panic!("record at {at}: {e}")));
        at += size;
    }
    assert_eq!(at, buf.len(), "the records end where the buffer's valid bytes end");
    out
}

#[test]
fn the_sizes_for_cupti_13_0_1_are_the_ones_cupti_reported_on_the_h100() {
    let s = StructSizes::for_version(130001).expect("13.0.1 is supported");
    assert_eq!(s.as_array(), [216, 96, 96, 88, 56, 40]);
}

#[test]
fn an_h100_buffer_decodes_into_exactly_the_work_the_program_did() {
    let sizes = StructSizes::for_version(130001).unwrap();
    let recs = records(H100_EXACT, &sizes);
    assert_eq!(recs.len(), 109);

    let kernels: Vec<_> = recs.iter().filter_map(|r| if let Record::Kernel(k) = r { Some(*k) } else { None }).collect();
    assert_eq!(kernels.len(), 10 + 5 + 5 + 4 * 3);
    let mut shapes: BTreeMap<([i32; 3], [i32; 3]), usize> = BTreeMap::new();
    for k in &kernels {
        *shapes.entry((k.grid, k.block)).or_default() += 1;
        assert!(k.end > k.start && k.start > 0, "kernel times ordered: {k:?}");
        assert_eq!(k.device_id, 0);
    }
    assert_eq!(shapes[&([4096, 1, 1], [256, 1, 1])], 10, "hs_exact_add: {shapes:?}");
    assert_eq!(shapes[&([17, 3, 1], [128, 2, 1])], 5, "hs_exact_scale: {shapes:?}");

    // The graph's 3 nodes launched 4 times: one graph id, 3 node ids, graph id 0 elsewhere.
    let graph: Vec<_> = kernels.iter().filter(|k| k.graph_id != 0).collect();
    assert_eq!(graph.len(), 12);
    let graph_ids: std::collections::BTreeSet<u32> = graph.iter().map(|k| k.graph_id).collect();
    let nodes: std::collections::BTreeSet<u64> = graph.iter().map(|k| k.graph_node_id).collect();
    assert_eq!((graph_ids.len(), nodes.len()), (1, 3), "{graph_ids:?} {nodes:?}");
    assert!(kernels.iter().filter(|k| k.graph_id == 0).all(|k| k.graph_node_id == 0));

    // The 5 spin kernels (the longest) last ~2 ms each (CUDA events said 2.018-2.019 ms).
    let mut durations: Vec<u64> = kernels.iter().map(|k| k.end - k.start).collect();
    durations.sort_unstable();
    for d in &durations[durations.len() - 5..] {
        assert!((1_900_000..2_100_000).contains(d), "spin kernel {d} ns");
    }

    let copies: Vec<_> = recs.iter().filter_map(|r| if let Record::Memcpy(m) = r { Some(*m) } else { None }).collect();
    assert_eq!(copies.len(), 5);
    assert!(copies.iter().all(|m| m.bytes == 4 << 20 && m.peer.is_none()));
    assert_eq!(copies.iter().filter(|m| m.copy_kind == 1).count(), 3, "HtoD");
    assert_eq!(copies.iter().filter(|m| m.copy_kind == 2).count(), 2, "DtoH");
    let sets: Vec<_> = recs.iter().filter_map(|r| if let Record::Memset(m) = r { Some(*m) } else { None }).collect();
    assert_eq!(sets.len(), 2);
    assert!(sets.iter().all(|m| m.bytes == 4 << 20));
    assert_eq!(recs.iter().filter(|r| matches!(r, Record::Sync(_))).count(), 18);

    // cudarc calls the driver API: every api record is a driver one, and each kernel's
    // correlation id is an api record's.
    let apis: Vec<_> = recs.iter().filter_map(|r| if let Record::Api(a) = r { Some(*a) } else { None }).collect();
    assert_eq!(apis.len(), 52);
    assert!(apis.iter().all(|a| a.driver && a.end >= a.start && a.return_value == 0));
    let api_ids: std::collections::BTreeSet<u32> = apis.iter().map(|a| a.correlation_id).collect();
    assert!(kernels.iter().all(|k| api_ids.contains(&k.correlation_id)), "every kernel has its launch record");
}
