//! `hopscope trace` output, decoded with Perfetto's official schema
//! (`perfetto_protos` 0.51.1, generated from Perfetto's own .proto files):
//! proves the field numbers of hopscope's hand-written prost subset, runs the
//! invariant checker and compares the trace's structure with a golden one.
//! Traces are compressed (`compressed_packets`): the outer packets are
//! decoded with the official schema too, and their batches inflated and
//! decoded packet by packet; one test inflates them with zlib itself.
//! Unprivileged except the live tests: no eBPF, synthetic records.

use hopscope::correlate::{Analysis, Config, Correlator};
use hopscope::event::{ConnKey, Dir, ProcOp};
use hopscope::model::{EngineOutput, HttpRole, Record, SseKind, Usage};
use hopscope::recording::{Meta, Writer, FORMAT_VERSION};
use hopscope::sink::perfetto::{check, proto, write_trace, write_trace_with, Encoding, TraceInput};
use hopscope_integration::{fixture, free_port, hopscope_bin, privileged, python, read_jsonl, run_py, scratch, wait_healthy, Recording};
use std::time::Duration;
use perfetto_protos as pp;
use protobuf::{Enum, Message};

const MS: u64 = 1_000_000;
const T0: u64 = 5_000_000_000_000;
const FRONTEND: u32 = 4242;
const ENGINE: u32 = 4300;

fn conn(fd: i32) -> ConnKey {
    ConnKey { tgid: FRONTEND, fd, ino: 9000 + fd as u64 }
}

/// One streamed exchange as the wire decoders record it: request (readable
/// 0.3 ms before it was read), head, role chunk, `n` content chunks 2 ms apart
/// from +5 ms, usage, [DONE], end.
fn exchange(c: ConnKey, seq: u32, at: u64, n: u64, session: &str) -> Vec<Record> {
    let sse = |ts, kind, usage| Record::Sse { conn: c, seq, ts_ns: ts, kind, id: Some(format!("chatcmpl-{}-{seq}", c.fd)), content_bytes: 4, finish_reason: None, usage };
    let mut v = vec![Record::HttpRequest {
        conn: c,
        role: HttpRole::Server,
        seq,
        start_ns: at,
        end_ns: at + 20_000,
        tid: FRONTEND,
        method: "POST".into(),
        path: "/v1/chat/completions".into(),
        headers: vec![("x-session-id".into(), session.into()), ("x-request-id".into(), format!("{session}-{seq}-{}", c.fd))],
        body_len: 2048,
        stream: Some(true),
        model: Some("tiny".into()),
        ready_ns: Some(at - 300_000),
    }];
    v.push(Record::HttpResponse { conn: c, role: HttpRole::Server, seq, ts_ns: at + MS, tid: FRONTEND, status: 200, headers: vec![("content-type".into(), "text/event-stream".into())] });
    v.push(sse(at + MS + MS / 2, SseKind::Role, None));
    for k in 0..n {
        v.push(sse(at + 5 * MS + k * 2 * MS, SseKind::Content, None));
    }
    let end = at + 5 * MS + n * 2 * MS;
    v.push(sse(end, SseKind::Usage, Some(Usage { prompt_tokens: Some(100 * (seq as u64 + 1)), completion_tokens: Some(n), cached_tokens: Some(64 * seq as u64) })));
    v.push(sse(end + 100, SseKind::Done, None));
    v.push(Record::HttpResponseEnd { conn: c, seq, ts_ns: end + 200, body_len: 4096 });
    v
}

fn meta() -> Meta {
    Meta {
        format_version: FORMAT_VERSION,
        hopscope_version: "0.1.0-test".into(),
        created_unix_s: 1_790_000_000,
        start_ns: T0 - 20 * MS,
        start_unix_ns: 0,
        pids: vec![FRONTEND],
        command: vec![],
        kernel: "6.18.0".into(),
        hostname: "testbed".into(),
        chain_header: "x-session-id".into(),
        capture_len: 4096,
        capture_len_unix: 32768,
        capture_tail_unix: 4096,
        capture_tail: 16384,
        capture_payload: false,
        gpu: false,
        missing_tracepoints: vec![],
        segment: None,
    }
}

/// A small chain recording: a 3-hop agent chain on one keep-alive connection,
/// a second chain whose two hops overlap, the engine process forked and
/// exec'd, off-CPU intervals on the frontend's threads, one request still
/// open at the end, and loss counters.
fn small_chain_recording() -> Vec<Record> {
    let mut r = Vec::new();
    r.push(Record::Proc { ts_ns: T0 - 15 * MS, tgid: FRONTEND, op: ProcOp::Exec, child_tgid: FRONTEND, exit_code: 0, comm: "vllm-api".into() });
    r.push(Record::Proc { ts_ns: T0 - 14 * MS, tgid: FRONTEND, op: ProcOp::Fork, child_tgid: ENGINE, exit_code: 0, comm: "vllm-api".into() });
    r.push(Record::Proc { ts_ns: T0 - 13 * MS, tgid: ENGINE, op: ProcOp::Exec, child_tgid: ENGINE, exit_code: 0, comm: "EngineCore".into() });
    r.extend(exchange(conn(5), 0, T0, 3, "plan-write-review"));
    r.extend(exchange(conn(5), 1, T0 + 20 * MS, 4, "plan-write-review"));
    r.extend(exchange(conn(5), 2, T0 + 45 * MS, 2, "plan-write-review"));
    r.extend(exchange(conn(6), 0, T0 + 2 * MS, 5, "fanout"));
    r.extend(exchange(conn(7), 0, T0 + 3 * MS, 1, "fanout"));
    let mut open = exchange(conn(8), 0, T0 + 50 * MS, 3, "late");
    open.truncate(5); // request, head, role, two chunks: never finished
    r.extend(open);
    for (on, off, wake, tid, state) in [
        (T0 + 4 * MS, T0 + 2 * MS, Some(T0 + 3 * MS), FRONTEND, 1),
        (T0 + 9 * MS, T0 + 8 * MS, None, FRONTEND, 0),
        (T0 + 30 * MS, T0 + 21 * MS, Some(T0 + 29 * MS), FRONTEND + 1, 1),
        (T0 + 31 * MS, T0 + 25 * MS, None, ENGINE, 2),
    ] {
        let tgid = if tid == ENGINE { ENGINE } else { FRONTEND };
        r.push(Record::OffCpu { ts_ns: on, tgid, tid, off_ns: off, wake_ns: wake, prev_state: state });
    }
    r.push(Record::Drops { ts_ns: T0 + 10 * MS, counters: vec![("kernel_ringbuf_full".into(), 0), ("unparsed_bytes".into(), 12)] });
    r.push(Record::Drops { ts_ns: T0 + 40 * MS, counters: vec![("kernel_ringbuf_full".into(), 3), ("unparsed_bytes".into(), 12)] });
    r.sort_by_key(Record::ts_ns);
    r
}

fn analyse(records: &[Record]) -> Analysis {
    let mut c = Correlator::new(Config::default());
    for r in records {
        c.ingest(r);
    }
    c.finish()
}

fn trace_bytes(records: &[Record]) -> Vec<u8> {
    let a = analyse(records);
    let m = meta();
    write_trace(Vec::new(), TraceInput { meta: &m, records, analysis: &a, read_error: None }).expect("trace writes").0
}

// ---- the official decode, translated field by field (by name) ----

fn no_unknown(what: &str, f: &protobuf::SpecialFields) {
    let unknown: Vec<u32> = f.unknown_fields().iter().map(|(n, _)| n).collect();
    assert!(unknown.is_empty(), "{what}: field numbers {unknown:?} are not in Perfetto's schema");
}

/// The official decode, compressed batches inflated and their packets
/// decoded in their place (as trace processor reads them).
fn official(bytes: &[u8]) -> proto::Trace {
    let t = pp::trace::Trace::parse_from_bytes(bytes).expect("Perfetto's schema decodes the trace");
    no_unknown("Trace", &t.special_fields);
    let mut out = Vec::with_capacity(t.packet.len());
    for p in &t.packet {
        if !p.has_compressed_packets() {
            out.push(packet(p));
            continue;
        }
        let mut only = pp::trace_packet::TracePacket::new();
        only.set_compressed_packets(p.compressed_packets().to_vec());
        assert_eq!(p, &only, "an outer packet carries compressed_packets only (trace processor ignores the rest)");
        let inner = check::inflate(p.compressed_packets()).expect("a batch inflates");
        let inner = pp::trace::Trace::parse_from_bytes(&inner).expect("Perfetto's schema decodes the packets in a batch");
        no_unknown("Trace in compressed_packets", &inner.special_fields);
        for q in &inner.packet {
            assert!(!q.has_compressed_packets(), "a batch inside a batch");
            out.push(packet(q));
        }
    }
    proto::Trace { packet: out }
}

/// The `compressed_packets` payloads of a trace file, read with Perfetto's schema.
fn batches(bytes: &[u8]) -> Vec<Vec<u8>> {
    let t = pp::trace::Trace::parse_from_bytes(bytes).expect("Perfetto's schema decodes the trace");
    t.packet.iter().filter(|p| p.has_compressed_packets()).map(|p| p.compressed_packets().to_vec()).collect()
}

fn packet(p: &pp::trace_packet::TracePacket) -> proto::TracePacket {
    use pp::trace_packet::trace_packet::{Data, Optional_trusted_packet_sequence_id as Seq};
    no_unknown("TracePacket", &p.special_fields);
    let data = p.data.as_ref().map(|d| match d {
        Data::ClockSnapshot(c) => {
            no_unknown("ClockSnapshot", &c.special_fields);
            proto::Data::ClockSnapshot(proto::ClockSnapshot {
                clocks: c
                    .clocks
                    .iter()
                    .map(|k| {
                        no_unknown("Clock", &k.special_fields);
                        proto::Clock { clock_id: k.clock_id, timestamp: k.timestamp, is_incremental: k.is_incremental }
                    })
                    .collect(),
                primary_trace_clock: c.primary_trace_clock.map(|e| e.value()),
            })
        }
        Data::TrackEvent(e) => proto::Data::TrackEvent(track_event(e)),
        Data::TrackDescriptor(d) => proto::Data::TrackDescriptor(track_descriptor(d)),
        other => panic!("hopscope never writes {other:?}"),
    });
    proto::TracePacket {
        timestamp: p.timestamp,
        timestamp_clock_id: p.timestamp_clock_id,
        trusted_packet_sequence_id: match &p.optional_trusted_packet_sequence_id {
            Some(Seq::TrustedPacketSequenceId(s)) => Some(*s),
            Some(other) => panic!("unknown sequence id member {other:?}"),
            None => None,
        },
        interned_data: p.interned_data.as_ref().map(|i| {
            no_unknown("InternedData", &i.special_fields);
            proto::InternedData {
                event_names: i
                    .event_names
                    .iter()
                    .map(|n| {
                        no_unknown("EventName", &n.special_fields);
                        proto::EventName { iid: n.iid, name: n.name.clone() }
                    })
                    .collect(),
                debug_annotation_names: i
                    .debug_annotation_names
                    .iter()
                    .map(|n| {
                        no_unknown("DebugAnnotationName", &n.special_fields);
                        proto::DebugAnnotationName { iid: n.iid, name: n.name.clone() }
                    })
                    .collect(),
                debug_annotation_string_values: i
                    .debug_annotation_string_values
                    .iter()
                    .map(|s| {
                        no_unknown("InternedString", &s.special_fields);
                        proto::InternedString { iid: s.iid, str: s.str.clone() }
                    })
                    .collect(),
            }
        }),
        sequence_flags: p.sequence_flags,
        incremental_state_cleared: p.incremental_state_cleared,
        trace_packet_defaults: p.trace_packet_defaults.as_ref().map(|d| {
            no_unknown("TracePacketDefaults", &d.special_fields);
            proto::TracePacketDefaults {
                timestamp_clock_id: d.timestamp_clock_id,
                track_event_defaults: d.track_event_defaults.as_ref().map(|t| proto::TrackEventDefaults { track_uuid: t.track_uuid }),
            }
        }),
        previous_packet_dropped: p.previous_packet_dropped,
        first_packet_on_sequence: p.first_packet_on_sequence,
        data,
    }
}

fn track_event(e: &pp::track_event::TrackEvent) -> proto::TrackEvent {
    use pp::track_event::track_event::{Counter_value_field as C, Name_field as N};
    no_unknown("TrackEvent", &e.special_fields);
    proto::TrackEvent {
        r#type: e.type_.map(|t| t.value()),
        track_uuid: e.track_uuid,
        name_iid: match &e.name_field {
            Some(N::NameIid(i)) => Some(*i),
            _ => None,
        },
        name: match &e.name_field {
            Some(N::Name(n)) => Some(n.clone()),
            _ => None,
        },
        counter_value: match &e.counter_value_field {
            Some(C::CounterValue(v)) => Some(*v),
            _ => None,
        },
        double_counter_value: match &e.counter_value_field {
            Some(C::DoubleCounterValue(v)) => Some(*v),
            _ => None,
        },
        debug_annotations: e.debug_annotations.iter().map(annotation).collect(),
        flow_ids: e.flow_ids.clone(),
        terminating_flow_ids: e.terminating_flow_ids.clone(),
    }
}

fn annotation(a: &pp::debug_annotation::DebugAnnotation) -> proto::DebugAnnotation {
    use pp::debug_annotation::debug_annotation::{Name_field as N, Value as V};
    no_unknown("DebugAnnotation", &a.special_fields);
    let mut d = proto::DebugAnnotation::default();
    match &a.name_field {
        Some(N::NameIid(i)) => d.name_iid = Some(*i),
        Some(N::Name(n)) => d.name = Some(n.clone()),
        Some(other) => panic!("hopscope never writes {other:?}"),
        None => {}
    }
    match &a.value {
        Some(V::BoolValue(v)) => d.bool_value = Some(*v),
        Some(V::UintValue(v)) => d.uint_value = Some(*v),
        Some(V::IntValue(v)) => d.int_value = Some(*v),
        Some(V::DoubleValue(v)) => d.double_value = Some(*v),
        Some(V::StringValue(v)) => d.string_value = Some(v.clone()),
        Some(V::StringValueIid(v)) => d.string_value_iid = Some(*v),
        Some(other) => panic!("hopscope never writes {other:?}"),
        None => {}
    }
    d
}

fn track_descriptor(d: &pp::track_descriptor::TrackDescriptor) -> proto::TrackDescriptor {
    use pp::track_descriptor::track_descriptor::Static_or_dynamic_name as N;
    no_unknown("TrackDescriptor", &d.special_fields);
    proto::TrackDescriptor {
        uuid: d.uuid,
        parent_uuid: d.parent_uuid,
        name: match &d.static_or_dynamic_name {
            Some(N::Name(n)) => Some(n.clone()),
            Some(other) => panic!("hopscope never writes {other:?}"),
            None => None,
        },
        process: d.process.as_ref().map(|p| {
            no_unknown("ProcessDescriptor", &p.special_fields);
            proto::ProcessDescriptor { pid: p.pid, cmdline: p.cmdline.clone(), process_name: p.process_name.clone() }
        }),
        thread: d.thread.as_ref().map(|t| {
            no_unknown("ThreadDescriptor", &t.special_fields);
            proto::ThreadDescriptor { pid: t.pid, tid: t.tid, thread_name: t.thread_name.clone() }
        }),
        counter: d.counter.as_ref().map(|c| {
            no_unknown("CounterDescriptor", &c.special_fields);
            proto::CounterDescriptor { unit: c.unit.map(|u| u.value()), unit_name: c.unit_name.clone() }
        }),
        child_ordering: d.child_ordering.map(|o| o.value()),
        sibling_order_rank: d.sibling_order_rank,
    }
}

// ---- tests ----

#[test]
fn perfettos_own_schema_reads_every_field_hopscope_writes_with_the_same_value() {
    let bytes = trace_bytes(&small_chain_recording());
    assert_eq!(batches(&bytes).len(), 1, "compressed: one batch for a small trace");
    let ours = check::decode(&bytes).expect("hopscope's subset decodes its own trace");
    let theirs = official(&bytes);
    assert_eq!(theirs.packet.len(), ours.packet.len());
    for (i, (a, b)) in theirs.packet.iter().zip(&ours.packet).enumerate() {
        assert_eq!(a, b, "packet {i} reads differently through Perfetto's schema");
    }
    // Uncompressed, the file is those packets one after the other.
    let a = analyse(&small_chain_recording());
    let plain = write_trace_with(Vec::new(), TraceInput { meta: &meta(), records: &small_chain_recording(), analysis: &a, read_error: None }, Encoding::PLAIN).unwrap().0;
    assert!(batches(&plain).is_empty());
    assert_eq!(official(&plain), theirs);
    // Enum values the writer uses mean what Perfetto says they mean.
    use pp::track_event::track_event::Type;
    assert_eq!(Type::TYPE_SLICE_BEGIN.value(), proto::EventType::SliceBegin as i32);
    assert_eq!(Type::TYPE_SLICE_END.value(), proto::EventType::SliceEnd as i32);
    assert_eq!(Type::TYPE_INSTANT.value(), proto::EventType::Instant as i32);
    assert_eq!(Type::TYPE_COUNTER.value(), proto::EventType::Counter as i32);
    assert_eq!(pp::builtin_clock::BuiltinClock::BUILTIN_CLOCK_MONOTONIC.value() as u32, proto::BUILTIN_CLOCK_MONOTONIC);
    use pp::trace_packet::trace_packet::SequenceFlags;
    assert_eq!(SequenceFlags::SEQ_INCREMENTAL_STATE_CLEARED.value() as u32, proto::SEQ_INCREMENTAL_STATE_CLEARED);
    assert_eq!(SequenceFlags::SEQ_NEEDS_INCREMENTAL_STATE.value() as u32, proto::SEQ_NEEDS_INCREMENTAL_STATE);
    assert_eq!(pp::track_descriptor::track_descriptor::ChildTracksOrdering::EXPLICIT.value(), proto::ChildOrdering::Explicit as i32);
    assert_eq!(pp::counter_descriptor::counter_descriptor::Unit::UNIT_COUNT.value(), proto::CounterUnit::Count as i32);
    // Every kind of message and value the writer can produce is in this trace.
    let events: Vec<&proto::TrackEvent> = ours.packet.iter().filter_map(|p| match &p.data {
        Some(proto::Data::TrackEvent(e)) => Some(e),
        _ => None,
    }).collect();
    let anns = || events.iter().flat_map(|e| e.debug_annotations.iter());
    assert!(anns().any(|a| a.string_value.is_some()) && anns().any(|a| a.string_value_iid.is_some()));
    assert!(anns().any(|a| a.uint_value.is_some()) && anns().any(|a| a.double_value.is_some()) && anns().any(|a| a.bool_value.is_some()));
    assert!(events.iter().any(|e| !e.flow_ids.is_empty()) && events.iter().any(|e| !e.terminating_flow_ids.is_empty()));
    assert!(events.iter().any(|e| e.counter_value.is_some()));
    let descs = || ours.packet.iter().filter_map(|p| match &p.data {
        Some(proto::Data::TrackDescriptor(d)) => Some(d),
        _ => None,
    });
    assert!(descs().any(|d| d.process.is_some()) && descs().any(|d| d.thread.is_some()) && descs().any(|d| d.counter.is_some()));
    assert!(descs().any(|d| d.child_ordering.is_some()) && descs().any(|d| d.sibling_order_rank.is_some()));
}

// Loss counters are listed in the order they first lost something.
const GOLDEN: &str = "\
hopscope [track] !recording×1
  drops: unparsed_bytes [counter] values×2
  drops: kernel_ringbuf_full [counter] values×2
  drops: requests_unfinished [counter] values×2
vllm-api (pid 4242) [process]
EngineCore (pid 4300) [process]
Chains [track]
  plan-write-review [track] hop 1 · TTFT 5.0 ms · E2E 11.0 ms×1 hop 2 · TTFT 5.0 ms · E2E 13.0 ms×1 hop 3 · TTFT 5.0 ms · E2E 9.0 ms×1
  fanout [track] hop 1 · TTFT 5.0 ms · E2E 15.0 ms×1
  fanout (overlap 1) [track] hop 2 · TTFT 5.0 ms · E2E 7.0 ms×1
  late [track] hop 1 · TTFT 5.0 ms · unfinished×1
Requests [track]
  in-flight requests [counter] values×13
  chatcmpl-5-0 [track] chatcmpl-5-0×1 decode×1 read delay×1 waiting for first token×1 !chunk×3
  chatcmpl-6-0 [track] chatcmpl-6-0×1 decode×1 read delay×1 waiting for first token×1 !chunk×5
  chatcmpl-7-0 [track] chatcmpl-7-0×1 decode×1 read delay×1 waiting for first token×1 !chunk×1
  chatcmpl-5-1 [track] chatcmpl-5-1×1 decode×1 read delay×1 waiting for first token×1 !chunk×4
  chatcmpl-5-2 [track] chatcmpl-5-2×1 decode×1 read delay×1 waiting for first token×1 !chunk×2
  chatcmpl-8-0 [track] chatcmpl-8-0×1 decode×1 read delay×1 waiting for first token×1 !chunk×2
";

#[test]
fn a_small_chain_recording_gives_a_trace_that_passes_the_checker_with_the_golden_structure() {
    let bytes = trace_bytes(&small_chain_recording());
    let s = check::check(&official(&bytes)).unwrap_or_else(|e| panic!("{e}"));
    // Thread tracks are described when first used (mid-trace): check them apart.
    type Thread = (String, Option<u64>, Vec<(String, u64)>);
    let threads: Vec<Thread> = s
        .tracks
        .iter()
        .filter(|t| t.kind == "thread")
        .map(|t| (t.name.clone(), t.parent, t.slices.iter().map(|(k, v)| (k.clone(), *v)).collect()))
        .collect();
    let pid = |name: &str| s.track(name).map(|t| t.uuid);
    assert_eq!(
        threads,
        vec![
            ("vllm-api (tid 4242)".into(), pid("vllm-api (pid 4242)"), vec![("off-cpu".into(), 2), ("run queue".into(), 1)]),
            ("tid 4243".into(), pid("vllm-api (pid 4242)"), vec![("off-cpu".into(), 1), ("run queue".into(), 1)]),
            ("EngineCore (tid 4300)".into(), pid("EngineCore (pid 4300)"), vec![("off-cpu".into(), 1)]),
        ]
    );
    let rendered: String = s.render().lines().filter(|l| !l.contains("(tid ") && !l.trim_start().starts_with("tid ")).map(|l| format!("{l}\n")).collect();
    assert_eq!(rendered, GOLDEN, "structure changed; got:\n{rendered}");
    assert_eq!(s.flows, 6, "a flow from every hop to its request");
    assert_eq!((s.slices, s.instants), (6 + 6 * 4 + 4 + 2, 1 + 3 + 5 + 1 + 4 + 2 + 2));
    assert_eq!(s.first_ts, Some(meta().start_ns), "the trace starts with the recording");
}

#[test]
fn hopscope_trace_turns_a_recording_file_into_a_checked_perfetto_trace() {
    let dir = scratch("perfetto-cli");
    let hop = dir.join("run.hop");
    let mut w = Writer::create(&hop, &meta()).unwrap();
    for r in small_chain_recording() {
        w.push(&r).unwrap();
    }
    w.finish(T0 + 60 * MS).unwrap();
    let out = dir.join("run.pftrace");
    let res = std::process::Command::new(hopscope_bin()).args(["trace", hop.to_str().unwrap(), "-o", out.to_str().unwrap()]).output().unwrap();
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert!(res.status.success(), "{stderr}");
    assert!(stderr.contains("6 requests, 3 chains"), "{stderr}");
    let bytes = std::fs::read(&out).unwrap();
    let s = check::check(&official(&bytes)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(s.track("Chains").map(|t| t.kind), Some("track"));
    assert_eq!(bytes, trace_bytes(&small_chain_recording()), "the CLI writes what the library writes (stale target/debug/hopscope? cargo build -p hopscope)");
    // Without -o the trace lands beside the recording.
    let res = std::process::Command::new(hopscope_bin()).args(["trace", hop.to_str().unwrap()]).output().unwrap();
    assert!(res.status.success());
    assert_eq!(std::fs::read(dir.join("run.pftrace")).unwrap(), bytes);
    // --no-compress: the same packets, one by one.
    let plain = dir.join("plain.pftrace");
    let res = std::process::Command::new(hopscope_bin()).args(["trace", "--no-compress", hop.to_str().unwrap(), "-o", plain.to_str().unwrap()]).output().unwrap();
    assert!(res.status.success(), "{}", String::from_utf8_lossy(&res.stderr));
    let plain = std::fs::read(&plain).unwrap();
    assert!(batches(&plain).is_empty() && !batches(&bytes).is_empty());
    assert_eq!(official(&plain), official(&bytes));
    assert!(bytes.len() * 2 < plain.len(), "compressed {} of {} bytes", bytes.len(), plain.len());
    // Not a recording: one clear line, no trace left behind.
    let bad = dir.join("bad.hop");
    std::fs::write(&bad, b"definitely not a recording").unwrap();
    let res = std::process::Command::new(hopscope_bin()).args(["trace", bad.to_str().unwrap(), "-o", dir.join("bad.pftrace").to_str().unwrap()]).output().unwrap();
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(!res.status.success());
    assert!(err.contains("not a hopscope recording") && err.trim().lines().count() == 1, "{err}");
    assert!(!dir.join("bad.pftrace").exists());
}

/// The small chain recording plus what the engine and the GPU add: engine
/// IPC for chatcmpl-5-0 (its ADD, a step per token), kernels on two streams
/// of the engine inside those steps, KV-cache stats and NVML samples.
fn engine_and_gpu_recording() -> Vec<Record> {
    let mut r = small_chain_recording();
    let id = "chatcmpl-5-0-0123abcd";
    r.push(Record::EngineRequest {
        conn: ConnKey { tgid: FRONTEND, fd: 40, ino: 40 },
        ts_ns: T0 + MS,
        tid: FRONTEND,
        dir: Dir::Out,
        request_id: id.into(),
        external_req_id: Some("chatcmpl-5-0".into()),
        prompt_tokens: Some(100),
        max_tokens: None,
        arrival_time_s: None,
        traceparent: None,
        data_parallel_rank: None,
        truncated: false,
    });
    let ends: Vec<u64> = (0..4).map(|k| T0 + 3 * MS + k * 2 * MS).collect();
    for (k, &end) in ends.iter().enumerate() {
        r.push(Record::EngineOutputs {
            conn: ConnKey { tgid: ENGINE, fd: 41, ino: 41 },
            ts_ns: end + 30_000,
            tid: ENGINE,
            dir: Dir::Out,
            engine_index: Some(0),
            timestamp_s: Some(end as f64 / 1e9),
            outputs: vec![EngineOutput { request_id: id.into(), new_tokens: 1, finish_reason: (k == 3).then_some(0), events: vec![], prefill: None }],
            outputs_total: Some(1),
            finished_requests: vec![],
            truncated: false,
        });
        r.push(Record::EngineStats { conn: ConnKey { tgid: ENGINE, fd: 41, ino: 41 }, ts_ns: end + 30_000, engine_index: Some(0), running: Some(1), waiting: Some(0), kv_cache_usage: Some(0.1 * k as f64), step_counter: Some(k as u64), prefix_cache_queries: None, prefix_cache_hits: None });
        if k > 0 {
            for j in 0..3u64 {
                r.push(Record::GpuKernel {
                    ts_ns: ends[k - 1] + 100_000 + j * 300_000,
                    end_ns: ends[k - 1] + 300_000 + j * 300_000,
                    pid: ENGINE,
                    device: 0,
                    context: 1,
                    stream: 7 + (j % 2) as u32,
                    correlation_id: (k * 10 + j as usize) as u32,
                    graph_id: 0,
                    graph_node_id: 0,
                    name: format!("kernel_{j}"),
                    grid: [108, 1, 1],
                    block: [256, 1, 1],
                    static_shared_mem: 0,
                    dynamic_shared_mem: 0,
                    registers_per_thread: 32,
                });
            }
        }
    }
    r.push(Record::GpuSample {
        ts_ns: T0 + 5 * MS,
        device: 0,
        mem_used_bytes: 40 << 30,
        mem_total_bytes: 80 << 30,
        process_mem: vec![(ENGINE, 38 << 30)],
        sm_util_pct: Some(87),
        mem_util_pct: None,
        pcie_tx_kib_s: None,
        pcie_rx_kib_s: None,
        nvlink_tx_kib_s: None,
        nvlink_rx_kib_s: None,
    });
    r.sort_by_key(Record::ts_ns);
    r
}

#[test]
fn flows_steps_kernels_counters_and_delta_timestamps_read_the_same_through_perfettos_schema() {
    let recs = engine_and_gpu_recording();
    let a = analyse(&recs);
    // Small batches: every sequence's interning, defaults and incremental
    // clock span several batches.
    let bytes = write_trace_with(Vec::new(), TraceInput { meta: &meta(), records: &recs, analysis: &a, read_error: None }, Encoding { batch_bytes: 512, ..Encoding::COMPRESSED }).unwrap().0;
    assert!(batches(&bytes).len() > 5, "{} batches", batches(&bytes).len());
    let ours = check::decode(&bytes).expect("hopscope's subset decodes its own trace");
    let theirs = official(&bytes);
    assert_eq!(theirs, official(&trace_bytes(&recs)), "the same packets whatever the batch size");
    assert_eq!(theirs.packet.len(), ours.packet.len());
    for (i, (a, b)) in theirs.packet.iter().zip(&ours.packet).enumerate() {
        assert_eq!(a, b, "packet {i} reads differently through Perfetto's schema");
    }
    let s = check::check(&theirs).unwrap_or_else(|e| panic!("{e}"));
    // hop→request ×6, prefill→first step, decode→3 steps, each of the 3 steps
    // with kernels → its first and last kernel.
    assert_eq!(s.flows, 6 + 1 + 3 + 3 * 2, "{}", s.render());
    for name in ["Engine steps", "Server", "output tokens/s", "KV-cache usage %", "GPU 0 memory used", "GPU 0 SM utilisation %", "running requests", "waiting requests", "GPU 0 stream 7", "GPU 0 stream 8"] {
        assert!(s.track(name).is_some(), "no {name} track in\n{}", s.render());
    }
    // The compact encoding: sequence-scoped incremental clocks, a sequence
    // per GPU stream whose events omit their track.
    assert!(ours.packet.iter().any(|p| matches!(&p.data, Some(proto::Data::ClockSnapshot(c)) if c.clocks.iter().any(|k| k.clock_id == Some(64) && k.is_incremental == Some(true)))));
    assert!(ours.packet.iter().any(|p| p.trace_packet_defaults.as_ref().is_some_and(|d| d.track_event_defaults.as_ref().is_some_and(|t| t.track_uuid.is_some()))));
    assert!(ours.packet.iter().any(|p| matches!(&p.data, Some(proto::Data::TrackEvent(e)) if e.track_uuid.is_none())));
    assert!(ours.packet.iter().any(|p| matches!(&p.data, Some(proto::Data::TrackEvent(e)) if e.double_counter_value.is_some())));
    assert_eq!(pp::counter_descriptor::counter_descriptor::Unit::UNIT_SIZE_BYTES.value(), proto::CounterUnit::SizeBytes as i32);
    let ids: std::collections::BTreeSet<u32> = ours.packet.iter().filter_map(|p| p.trusted_packet_sequence_id).collect();
    assert!(ids.len() >= 5, "main, requests, steps, two streams, counters: {ids:?}");
}

/// chatcmpl-5-0 served by an engine whose four steps (built at +3, +5, +7,
/// +9 ms) end on the GPU as vLLM's model runner ends them (docs/attribution.md:
/// `reshape_and_cache` with one block per new token, a gemm, the sampled ids
/// copied into pinned memory, an event synchronize), with its KV onloaded
/// (1 MiB pinned host → device) at +1.5–2.5 ms: submitted at +1 ms,
/// scheduled at +2 ms.
fn cupti_steps_recording() -> Vec<Record> {
    use hopscope::correlate::gpu::{COPY_DTOH, COPY_HTOD, MEM_PINNED};
    use hopscope::model::EngineEvent;
    const DEVICE: u8 = 3;
    let mut r = small_chain_recording();
    let id = "chatcmpl-5-0-0123abcd";
    r.push(Record::EngineRequest {
        conn: ConnKey { tgid: FRONTEND, fd: 40, ino: 40 },
        ts_ns: T0 + MS,
        tid: FRONTEND,
        dir: Dir::Out,
        request_id: id.into(),
        external_req_id: Some("chatcmpl-5-0".into()),
        prompt_tokens: Some(100),
        max_tokens: None,
        arrival_time_s: None,
        traceparent: None,
        data_parallel_rank: None,
        truncated: false,
    });
    let copy = |stream: u32, s: u64, e: u64, kind: u8, src: u8, dst: u8, bytes: u64| Record::GpuMemcpy {
        ts_ns: s,
        end_ns: e,
        pid: ENGINE,
        device: 0,
        context: 1,
        stream,
        kind,
        src_kind: src,
        dst_kind: dst,
        flags: 1,
        bytes,
        correlation_id: 2,
        runtime_correlation_id: 0,
        graph_id: 0,
        graph_node_id: 0,
        peer: None,
    };
    let kernel = |s: u64, name: &str, grid_x: u32| Record::GpuKernel {
        ts_ns: s,
        end_ns: s + MS / 2,
        pid: ENGINE,
        device: 0,
        context: 1,
        stream: 7,
        correlation_id: 1,
        graph_id: 0,
        graph_node_id: 0,
        name: name.into(),
        grid: [grid_x, 1, 1],
        block: [128, 1, 1],
        static_shared_mem: 0,
        dynamic_shared_mem: 0,
        registers_per_thread: 32,
    };
    for k in 0..4u64 {
        let b = T0 + 3 * MS + k * 2 * MS;
        let events = if k == 0 { vec![EngineEvent { kind: 2, timestamp_s: (T0 + 2 * MS) as f64 / 1e9 }] } else { vec![] };
        r.push(Record::EngineOutputs {
            conn: ConnKey { tgid: ENGINE, fd: 41, ino: 41 },
            ts_ns: b + 30_000,
            tid: ENGINE,
            dir: Dir::Out,
            engine_index: Some(0),
            timestamp_s: Some(b as f64 / 1e9),
            outputs: vec![EngineOutput { request_id: id.into(), new_tokens: 1, finish_reason: (k == 3).then_some(0), events, prefill: None }],
            outputs_total: Some(1),
            finished_requests: vec![],
            truncated: false,
        });
        r.push(kernel(b - 1_500_000, "vllm::reshape_and_cache_flash_kernel", if k == 0 { 100 } else { 1 }));
        r.push(kernel(b - MS, "gemm", 108));
        r.push(copy(7, b - 450_000, b - 400_000, COPY_DTOH, DEVICE, MEM_PINNED, 64));
        r.push(Record::GpuSync { ts_ns: b - 1_400_000, end_ns: b - 300_000, pid: ENGINE, sync_type: 1, context: 1, stream: None, correlation_id: 3, cuda_event: Some(4) });
    }
    r.push(copy(9, T0 + 1_500_000, T0 + 2_500_000, COPY_HTOD, MEM_PINNED, DEVICE, 1 << 20));
    r.sort_by_key(Record::ts_ns);
    r
}

#[test]
fn gpu_steps_kv_transfer_and_gpu_shares_read_the_same_through_perfettos_schema() {
    let recs = cupti_steps_recording();
    let a = analyse(&recs);
    assert_eq!(a.gpu_steps.len(), 4);
    let bytes = write_trace(Vec::new(), TraceInput { meta: &meta(), records: &recs, analysis: &a, read_error: None }).unwrap().0;
    let ours = check::decode(&bytes).expect("hopscope's subset decodes its own trace");
    let theirs = official(&bytes);
    assert_eq!(theirs.packet.len(), ours.packet.len());
    for (i, (x, y)) in theirs.packet.iter().zip(&ours.packet).enumerate() {
        assert_eq!(x, y, "packet {i} reads differently through Perfetto's schema");
    }
    let s = check::check(&theirs).unwrap_or_else(|e| panic!("{e}"));
    let gpu = s.track("GPU steps").unwrap_or_else(|| panic!("no GPU steps track in\n{}", s.render()));
    assert_eq!(gpu.slices.get("gpu step"), Some(&4));
    let req = s.track("chatcmpl-5-0").unwrap();
    assert_eq!(req.slices.get("kv transfer"), Some(&2), "{}", s.render());
    // hop→request ×6, prefill→first step, decode→3 steps, engine step→GPU
    // step ×4, GPU step→its end copy ×4 and (after the first) the first
    // kernel after the previous end copy ×3.
    assert_eq!(s.flows, 6 + 1 + 3 + 4 + 4 + 3, "{}", s.render());
    let flat = check::flatten(&theirs);
    let named = |name: &'static str| {
        flat.packet
            .iter()
            .filter_map(|p| match &p.data {
                Some(proto::Data::TrackEvent(e)) => Some(e),
                _ => None,
            })
            .flat_map(|e| e.debug_annotations.iter())
            .filter(move |d| d.name.as_deref() == Some(name))
    };
    let ann = |name: &'static str| -> Vec<f64> { named(name).filter_map(|d| d.double_value).collect() };
    assert_eq!(ann("kv_transfer_ms"), vec![0.5, 0.5], "half queued, half in the prefill");
    assert_eq!(ann("phases_ms.kv_transfer"), vec![1.0]);
    assert_eq!(ann("phases_ms.queue"), vec![0.5]);
    assert_eq!(ann("gpu_kv_ms"), vec![1.0]);
    // The first step: the KV copy beside the two kernels (all within
    // 1.5–2.5 ms), then the ids copy: 1.05 ms of GPU time.
    assert_eq!(ann("gpu_prefill_ms"), vec![1.05, 1.05], "request and prefill slice");
    // Which kernels its GPU time was (the report's requests[].kernels): all
    // four steps' kernels are its own, 0.5 ms each.
    let kernels: Vec<&str> = named("kernels").filter_map(|d| d.string_value.as_deref()).collect();
    assert_eq!(kernels, vec!["gemm 2.000 ms; vllm::reshape_and_cache_flash_kernel 2.000 ms"]);
    let rep = hopscope::sink::report::build("x.hop", &meta(), &a, None);
    let k = rep.requests[0].kernels.as_ref().expect("GPU records: a list");
    assert_eq!(k.iter().map(|k| (k.name.as_str(), k.gpu_ms)).collect::<Vec<_>>(), vec![("gemm", 2.0), ("vllm::reshape_and_cache_flash_kernel", 2.0)]);
}

/// The batches are what zlib itself (the C library trace processor links;
/// Python's `zlib` module wraps it) inflates: with the zlib wrapper strictly
/// (window bits 15), and in trace processor's mode (`inflateInit2(32 +
/// MAX_WBITS)`: zlib or gzip header), to the same bytes the checker inflates.
#[test]
fn compressed_batches_inflate_with_zlib_itself_as_trace_processor_inflates_them() {
    use std::io::Write as _;
    let recs = engine_and_gpu_recording();
    let a = analyse(&recs);
    let bytes = write_trace_with(Vec::new(), TraceInput { meta: &meta(), records: &recs, analysis: &a, read_error: None }, Encoding { batch_bytes: 2048, ..Encoding::COMPRESSED }).unwrap().0;
    let zs = batches(&bytes);
    assert!(zs.len() > 2, "{} batches", zs.len());
    const PY: &str = r#"
import struct, sys, zlib
data, out, i = sys.stdin.buffer.read(), sys.stdout.buffer, 0
while i < len(data):
    (n,) = struct.unpack_from("<I", data, i)
    z = data[i + 4 : i + 4 + n]
    i += 4 + n
    strict = zlib.decompress(z, 15)
    d = zlib.decompressobj(32 + 15)
    auto = d.decompress(z) + d.flush()
    assert strict == auto and d.eof and not d.unused_data, "zlib and auto-detect disagree"
    out.write(struct.pack("<I", len(strict)) + strict)
sys.stderr.write(zlib.ZLIB_RUNTIME_VERSION)
"#;
    let mut child = std::process::Command::new(python())
        .args(["-c", PY])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("running python");
    let mut input = Vec::new();
    for z in &zs {
        input.extend_from_slice(&(z.len() as u32).to_le_bytes());
        input.extend_from_slice(z);
    }
    child.stdin.take().unwrap().write_all(&input).unwrap();
    let res = child.wait_with_output().unwrap();
    assert!(res.status.success(), "zlib refused a batch: {}", String::from_utf8_lossy(&res.stderr));
    assert!(!res.stderr.is_empty(), "zlib's version");
    let mut at = 0;
    let mut inflated = Vec::new();
    while at < res.stdout.len() {
        let n = u32::from_le_bytes(res.stdout[at..at + 4].try_into().unwrap()) as usize;
        inflated.push(res.stdout[at + 4..at + 4 + n].to_vec());
        at += 4 + n;
    }
    let ours: Vec<Vec<u8>> = zs.iter().map(|z| check::inflate(z).unwrap()).collect();
    assert_eq!(inflated, ours, "zlib inflates each batch to what the checker reads");
    // Concatenated, the batches are the plain trace's bytes.
    let plain = write_trace_with(Vec::new(), TraceInput { meta: &meta(), records: &recs, analysis: &a, read_error: None }, Encoding::PLAIN).unwrap().0;
    assert_eq!(inflated.concat(), plain);
}

/// `record --perfetto`: the trace grows while recording — read mid-recording
/// it decodes with Perfetto's schema and passes the checker — and ends with
/// every request.
#[test]
fn record_with_perfetto_writes_the_trace_live_and_completes_it_when_recording_stops() {
    let Some(_serial) = privileged("record_with_perfetto_writes_the_trace_live_and_completes_it_when_recording_stops") else { return };
    let dir = scratch("perfetto-live");
    let port = free_port();
    let py = python();
    let server = fixture("sse_server.py");
    let trace = dir.join("live.pftrace");
    let mut rec = Recording::run(&dir.join("run.hop"), &["--perfetto", trace.to_str().unwrap()], &[py.to_str().unwrap(), server.to_str().unwrap(), "--port", &port.to_string()]);
    rec.wait_healthy(port, Duration::from_secs(30));
    let out = dir.join("client.jsonl");
    run_py("sse_client.py", &["--base", &format!("http://127.0.0.1:{port}"), "--out", out.to_str().unwrap(), "--sequential", "3", "--sdk", "raw"]);
    // Records leave the reorder window and the file is flushed every second.
    let mut sizes = Vec::new();
    let mut mid = None;
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(1200));
        let bytes = std::fs::read(&trace).expect("the trace exists while recording");
        let part = check::complete_packets(&bytes).to_vec();
        sizes.push(part.len());
        mid = Some(part);
    }
    let mid = mid.unwrap();
    assert!(batches(&mid).len() >= 2, "compressed, a batch per flush");
    let s = check::check(&official(&mid)).unwrap_or_else(|e| panic!("mid-recording trace: {e}"));
    assert!(s.tracks.iter().any(|t| t.kind == "thread" && t.slices.get("off-cpu").is_some_and(|n| *n > 0)), "off-CPU slices while recording:\n{}", s.render());
    assert!(s.track("Requests").is_none(), "requests are appended when recording stops");
    assert!(sizes[0] > 0 && sizes.windows(2).all(|w| w[0] <= w[1]), "{sizes:?}");
    rec.stop();
    let bytes = std::fs::read(&trace).unwrap();
    assert!(bytes.starts_with(&mid), "the live part is kept as it was written");
    let s = check::check(&official(&bytes)).unwrap_or_else(|e| panic!("{e}"));
    for c in read_jsonl(&out) {
        assert!(s.track(c["id"].as_str().unwrap()).is_some(), "request track for {}", c["id"]);
    }
}

/// A recorder killed with SIGKILL leaves a live trace that is readable up to
/// its last flush: whole packets decode with Perfetto's schema and pass the
/// checker (no open slices), with what was recorded until then.
#[test]
fn a_killed_recorder_leaves_a_readable_trace_up_to_its_last_flush() {
    let Some(_serial) = privileged("a_killed_recorder_leaves_a_readable_trace_up_to_its_last_flush") else { return };
    let dir = scratch("perfetto-killed");
    let port = free_port();
    let mut server = std::process::Command::new(python()).arg(fixture("sse_server.py")).args(["--port", &port.to_string()]).spawn().expect("spawning the server");
    wait_healthy(port, Duration::from_secs(30));
    let trace = dir.join("killed.pftrace");
    let mut rec = Recording::record(&dir.join("run.hop"), &[server.id()], &["--perfetto", trace.to_str().unwrap()]);
    std::thread::sleep(Duration::from_millis(1500));
    let out = dir.join("client.jsonl");
    run_py("sse_client.py", &["--base", &format!("http://127.0.0.1:{port}"), "--out", out.to_str().unwrap(), "--sequential", "2", "--sdk", "raw"]);
    std::thread::sleep(Duration::from_millis(2500));
    rec.child.kill().expect("SIGKILL hopscope");
    rec.child.wait().unwrap();
    let _ = server.kill();
    let _ = server.wait();
    let bytes = std::fs::read(&trace).expect("the live trace exists");
    let part = check::complete_packets(&bytes);
    assert!(part.len() + 4096 >= bytes.len(), "at most a partial buffer is cut: {} of {} bytes", part.len(), bytes.len());
    assert!(!batches(part).is_empty(), "compressed batches");
    let s = check::check(&official(part)).unwrap_or_else(|e| panic!("{e}"));
    assert!(s.tracks.iter().any(|t| t.kind == "thread" && t.slices.get("off-cpu").is_some_and(|n| *n > 0)), "off-CPU slices up to the kill:\n{}", s.render());
    assert!(s.track("Requests").is_none(), "requests are appended only by a recorder that stops");
}

/// `hopscope trace FILE [extra]` with the given threshold override: the
/// trace's bytes and stderr.
fn cli_trace(hop: &std::path::Path, out: &std::path::Path, full_max: Option<&str>, extra: &[&str]) -> (Vec<u8>, String) {
    let mut cmd = std::process::Command::new(hopscope_bin());
    cmd.args(["trace", hop.to_str().unwrap(), "-o", out.to_str().unwrap()]).args(extra);
    match full_max {
        Some(v) => cmd.env("HOPSCOPE_TRACE_FULL_MAX_BYTES", v),
        None => cmd.env_remove("HOPSCOPE_TRACE_FULL_MAX_BYTES"),
    };
    let res = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&res.stderr).into_owned();
    assert!(res.status.success(), "{stderr}");
    (std::fs::read(out).unwrap(), stderr)
}

#[test]
fn hopscope_trace_streams_a_recording_over_its_size_threshold_with_the_same_tracks_and_flows() {
    let dir = scratch("perfetto-streamed");
    // (name, recording, request→step flows, step→GPU step flows, →kernel
    // flows, whether the streamed trace draws the kernel ones: with CUPTI
    // step ends it does; by time (no step ends) only the whole layout can)
    for (name, recs, request_step, gpu_step, kernel, streams_kernels) in [("engine", engine_and_gpu_recording(), 1 + 3, 0, 3 * 2, false), ("cupti", cupti_steps_recording(), 1 + 3, 4, 1 + 3 * 2, true)] {
        let hop = dir.join(format!("{name}.hop"));
        let mut w = Writer::create(&hop, &meta()).unwrap();
        for r in &recs {
            w.push(r).unwrap();
        }
        w.finish(recs.last().unwrap().ts_ns() + MS).unwrap();
        let (full, full_err) = cli_trace(&hop, &dir.join(format!("{name}-full.pftrace")), None, &[]);
        let (streamed, err) = cli_trace(&hop, &dir.join(format!("{name}-streamed.pftrace")), Some("0"), &[]);
        assert!(!full_err.contains("flows_not_streamed"), "{full_err}");
        assert!(full_err.contains(&format!("flows: {request_step} request→step, {gpu_step} step→GPU step, {kernel} step→kernel; 0 left out")), "{full_err}");
        if streams_kernels {
            assert!(!err.contains("flows_not_streamed"), "{name}: {err}");
            assert!(err.contains(&format!("flows: {request_step} request→step, {gpu_step} step→GPU step, {kernel} step→kernel; 0 left out")), "{err}");
        } else {
            assert!(err.contains("without their flows to the kernels that ran in them") && err.contains("trace.flows_not_streamed)") && err.contains("--layout whole") && err.contains("HOPSCOPE_TRACE_FULL_MAX_BYTES"), "{err}");
            assert!(err.contains(&format!("flows: {request_step} request→step; 0 left out")), "{err}");
        }
        // `--layout` overrides the size rule both ways, byte for byte.
        let (whole, whole_err) = cli_trace(&hop, &dir.join(format!("{name}-whole.pftrace")), Some("0"), &["--layout", "whole"]);
        assert!(whole == full && !whole_err.contains("flows_not_streamed"), "{name}: --layout whole over the threshold is the whole layout: {whole_err}");
        let (asked, asked_err) = cli_trace(&hop, &dir.join(format!("{name}-asked.pftrace")), None, &["--layout", "streamed"]);
        assert!(asked == streamed && asked_err.contains("`--layout streamed` leaves them out") != streams_kernels, "{name}: --layout streamed under the threshold streams: {asked_err}");
        assert!(err.contains("6 requests, 3 chains"), "{err}");
        let f = check::check(&official(&full)).unwrap_or_else(|e| panic!("{name} full: {e}"));
        let s = check::check(&official(&streamed)).unwrap_or_else(|e| panic!("{name} streamed: {e}"));
        let lines = |s: &check::Summary| {
            let mut v: Vec<String> = s.render().lines().map(str::to_owned).collect();
            v.sort();
            v
        };
        assert_eq!(lines(&s), lines(&f), "{name}: the same tracks and slices");
        assert_eq!((s.slices, s.instants), (f.slices, f.instants), "{name}");
        assert_eq!(f.flows, 6 + request_step + gpu_step + kernel, "{name}");
        let streamed_flows = 6 + request_step + if streams_kernels { gpu_step + kernel } else { 0 };
        assert_eq!((s.flows, s.flows_unlinked), (streamed_flows, 0), "{name}: hop→request, request→step and, with CUPTI step ends, the GPU steps' flows");
    }
}
