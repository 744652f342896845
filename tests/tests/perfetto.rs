//! `hopscope trace` output, decoded with Perfetto's official schema
//! (`perfetto_protos` 0.51.1, generated from Perfetto's own .proto files):
//! proves the field numbers of hopscope's hand-written prost subset, runs the
//! invariant checker and compares the trace's structure with a golden one.
//! Unprivileged: no eBPF, synthetic records.

use hopscope::correlate::{Analysis, Config, Correlator};
use hopscope::event::{ConnKey, ProcOp};
use hopscope::model::{HttpRole, Record, SseKind, Usage};
use hopscope::recording::{Meta, Writer, FORMAT_VERSION};
use hopscope::sink::perfetto::{check, proto, write_trace, TraceInput};
use hopscope_integration::{hopscope_bin, scratch};
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
        capture_payload: false,
        gpu: false,
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

fn official(bytes: &[u8]) -> proto::Trace {
    let t = pp::trace::Trace::parse_from_bytes(bytes).expect("Perfetto's schema decodes the trace");
    no_unknown("Trace", &t.special_fields);
    proto::Trace { packet: t.packet.iter().map(packet).collect() }
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
    let ours = check::decode(&bytes).expect("hopscope's subset decodes its own trace");
    let theirs = official(&bytes);
    assert_eq!(theirs.packet.len(), ours.packet.len());
    for (i, (a, b)) in theirs.packet.iter().zip(&ours.packet).enumerate() {
        assert_eq!(a, b, "packet {i} reads differently through Perfetto's schema");
    }
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

const GOLDEN: &str = "\
hopscope [track] !recording×1
  drops: kernel_ringbuf_full [counter] values×2
  drops: requests_unfinished [counter] values×2
  drops: unparsed_bytes [counter] values×2
vllm-api (pid 4242) [process]
EngineCore (pid 4300) [process]
Chains [track]
  plan-write-review [track] hop 1×1 hop 2×1 hop 3×1
  fanout [track] hop 1×1
  fanout (overlap 1) [track] hop 2×1
  late [track] hop 1×1
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
    // Not a recording: one clear line, no trace left behind.
    let bad = dir.join("bad.hop");
    std::fs::write(&bad, b"definitely not a recording").unwrap();
    let res = std::process::Command::new(hopscope_bin()).args(["trace", bad.to_str().unwrap(), "-o", dir.join("bad.pftrace").to_str().unwrap()]).output().unwrap();
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(!res.status.success());
    assert!(err.contains("not a hopscope recording") && err.trim().lines().count() == 1, "{err}");
    assert!(!dir.join("bad.pftrace").exists());
}
