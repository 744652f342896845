//! Unit tests: the writer's guarantees, the layout, and the checker catching
//! what it must catch. The official-schema decode lives in
//! tests/tests/perfetto.rs (it needs perfetto_protos, a 220 s build).

use super::check::{self, CheckError, Summary};
use super::proto::{self, ChildOrdering, CounterUnit, Data, Trace};
use super::*;
use crate::correlate::{Analysis, Config, Correlator};
use crate::event::{ConnKey, ProcOp};
use crate::model::{HttpRole, Record, SseKind, Usage};
use crate::recording::Meta;
use prost::Message;

const MS: u64 = 1_000_000;
const T0: u64 = 1_000_000_000_000;

fn conn(fd: i32) -> ConnKey {
    ConnKey { tgid: 4242, fd, ino: 7000 + fd as u64 }
}

/// One streamed exchange: request (read 0.3 ms after it became readable),
/// response head, role chunk, `n` content chunks 2 ms apart from +5 ms, usage,
/// [DONE] and the response end.
fn exchange(c: ConnKey, seq: u32, at: u64, n: u64, session: &str) -> Vec<Record> {
    let sse = |ts, kind, usage| Record::Sse { conn: c, seq, ts_ns: ts, kind, id: Some(format!("chatcmpl-{}-{seq}", c.fd)), content_bytes: 3, finish_reason: None, usage };
    let mut v = vec![Record::HttpRequest {
        conn: c,
        role: HttpRole::Server,
        seq,
        start_ns: at,
        end_ns: at + 10_000,
        tid: c.tgid,
        method: "POST".into(),
        path: "/v1/chat/completions".into(),
        headers: vec![("x-session-id".into(), session.into())],
        body_len: 321,
        stream: Some(true),
        model: None,
        ready_ns: Some(at - 300_000),
    }];
    v.push(Record::HttpResponse { conn: c, role: HttpRole::Server, seq, ts_ns: at + MS, tid: c.tgid, status: 200, headers: vec![("content-type".into(), "text/event-stream".into())] });
    v.push(sse(at + MS + MS / 2, SseKind::Role, None));
    for k in 0..n {
        v.push(sse(at + 5 * MS + k * 2 * MS, SseKind::Content, None));
    }
    let end = at + 5 * MS + n * 2 * MS;
    v.push(sse(end, SseKind::Usage, Some(Usage { prompt_tokens: Some(40), completion_tokens: Some(n), cached_tokens: Some(16) })));
    v.push(sse(end + 100, SseKind::Done, None));
    v.push(Record::HttpResponseEnd { conn: c, seq, ts_ns: end + 200, body_len: 999 });
    v
}

fn meta() -> Meta {
    Meta { format_version: 1, hopscope_version: "test".into(), start_ns: T0 - 10 * MS, pids: vec![4242], chain_header: "x-session-id".into(), ..Meta::default() }
}

fn sorted(mut recs: Vec<Record>) -> Vec<Record> {
    recs.sort_by_key(Record::ts_ns);
    recs
}

fn analyse(records: &[Record]) -> Analysis {
    let mut c = Correlator::new(Config::default());
    for r in records {
        c.ingest(r);
    }
    c.finish()
}

fn trace_of(records: &[Record]) -> (Vec<u8>, TraceStats) {
    let analysis = analyse(records);
    let m = meta();
    write_trace(Vec::new(), TraceInput { meta: &m, records, analysis: &analysis, read_error: None }).expect("trace writes")
}

fn checked(bytes: &[u8]) -> Summary {
    check::check_bytes(bytes).unwrap_or_else(|e| panic!("trace fails the checker: {e}"))
}

fn decode(bytes: &[u8]) -> Trace {
    Trace::decode(bytes).expect("trace decodes")
}

fn events(t: &Trace) -> impl Iterator<Item = (u64, &proto::TrackEvent)> {
    t.packet.iter().filter_map(|p| match &p.data {
        Some(Data::TrackEvent(e)) => Some((p.timestamp.unwrap_or(0), e)),
        _ => None,
    })
}

fn counter_series(t: &Trace, s: &Summary, track: &str) -> Vec<(u64, i64)> {
    let uuid = s.track(track).unwrap_or_else(|| panic!("no track {track}")).uuid;
    events(t).filter(|(_, e)| e.track_uuid == Some(uuid)).map(|(ts, e)| (ts, e.counter_value.expect("integer counter"))).collect()
}

#[test]
fn writer_output_round_trips_and_passes_the_checker() {
    let mut w = TraceWriter::new(Vec::new(), 10).unwrap();
    let g = w.track("group", TrackOpts { child_ordering: Some(ChildOrdering::Explicit), ..TrackOpts::default() });
    let a = w.track("a", TrackOpts { parent: Some(g), rank: Some(1), ..TrackOpts::default() });
    let th = w.thread_track(7, 8, None);
    let c = w.counter_track("c", CounterUnit::Count, TrackOpts::default());
    let f = w.new_flow_id();
    let args = [Arg::str("s", "x"), Arg::interned("i", "y"), Arg::u64("u", 1), Arg::i64("n", -1), Arg::f64("f", 0.5), Arg::bool("b", true)];
    w.begin(10, a, &Event::named("outer").args(&args).flows(&[f])).unwrap();
    w.begin(11, a, &Event::named("inner")).unwrap();
    w.instant(12, a, &Event::named("tick")).unwrap();
    w.end(13, a).unwrap();
    w.end(14, a).unwrap();
    w.begin(14, th, &Event::named("t").terminating_flows(&[f])).unwrap();
    w.end(15, th).unwrap();
    w.counter(15, c, 3).unwrap();
    w.counter_f64(16, c, 2.5).unwrap();
    let (bytes, st) = w.finish().unwrap();
    assert_eq!((st.slices, st.instants, st.counter_values, st.flows), (3, 1, 2, 1));
    assert_eq!(st.bytes, bytes.len() as u64);
    let s = checked(&bytes);
    assert_eq!(s.flows, 1);
    assert_eq!(s.render(), "group [track]\n  a [track] inner×1 outer×1 !tick×1\npid 7 (pid 7) [process]\n  tid 8 [thread] t×1\nc [counter] values×2\n");
    assert_eq!(s.track("a").unwrap().max_depth, 2);
    // The annotations come back with their values.
    let t = decode(&bytes);
    let (_, outer) = events(&t).next().unwrap();
    let d = &outer.debug_annotations;
    assert_eq!(d.len(), 6);
    assert_eq!(d[0].string_value.as_deref(), Some("x"));
    assert!(d[1].string_value_iid.is_some());
    assert_eq!((d[2].uint_value, d[3].int_value, d[4].double_value, d[5].bool_value), (Some(1), Some(-1), Some(0.5), Some(true)));
}

#[test]
fn first_packet_clears_incremental_state_and_makes_monotonic_the_trace_clock() {
    let w = TraceWriter::new(Vec::new(), 123).unwrap();
    let (bytes, _) = w.finish().unwrap();
    let t = decode(&bytes);
    assert_eq!(t.packet.len(), 1);
    let p = &t.packet[0];
    assert_eq!(p.trusted_packet_sequence_id, Some(writer::SEQUENCE_ID));
    assert_eq!(p.sequence_flags, Some(proto::SEQ_INCREMENTAL_STATE_CLEARED));
    assert_eq!(p.first_packet_on_sequence, Some(true));
    assert_eq!(p.trace_packet_defaults.as_ref().and_then(|d| d.timestamp_clock_id), Some(proto::BUILTIN_CLOCK_MONOTONIC));
    let Some(Data::ClockSnapshot(cs)) = &p.data else { panic!("first packet is a clock snapshot: {p:?}") };
    assert_eq!(cs.primary_trace_clock, Some(proto::BUILTIN_CLOCK_MONOTONIC as i32));
    assert_eq!(cs.clocks[0].timestamp, Some(123));
}

#[test]
fn names_and_values_are_interned_once_then_referred_to_by_iid() {
    let mut w = TraceWriter::new(Vec::new(), 0).unwrap();
    let a = w.track("a", TrackOpts::default());
    for i in 0..100 {
        w.begin(i * 10, a, &Event::named("same").args(&[Arg::interned("state", "sleeping")])).unwrap();
        w.end(i * 10 + 5, a).unwrap();
    }
    let (bytes, st) = w.finish().unwrap();
    assert_eq!(st.interned, 3, "one event name, one annotation name, one value");
    let t = decode(&bytes);
    let defs: usize = t.packet.iter().filter_map(|p| p.interned_data.as_ref()).map(|i| i.event_names.len() + i.debug_annotation_names.len() + i.debug_annotation_string_values.len()).sum();
    assert_eq!(defs, 3);
    assert!(events(&t).all(|(_, e)| e.name.is_none()), "names travel as iids only");
    // Every packet after the first depends on the sequence's state.
    assert!(t.packet[1..].iter().all(|p| p.sequence_flags == Some(proto::SEQ_NEEDS_INCREMENTAL_STATE)));
    checked(&bytes);
}

#[test]
fn descriptors_are_written_before_first_use_parents_first_and_only_once() {
    let mut w = TraceWriter::new(Vec::new(), 0).unwrap();
    let g = w.track("g", TrackOpts::default());
    let child = w.track("child", TrackOpts { parent: Some(g), ..TrackOpts::default() });
    let unused = w.track("unused", TrackOpts::default());
    w.instant(1, child, &Event::named("x")).unwrap();
    w.instant(2, child, &Event::named("x")).unwrap();
    let (bytes, st) = w.finish().unwrap();
    let t = decode(&bytes);
    let kinds: Vec<&str> = t.packet.iter().map(|p| match &p.data {
        Some(Data::ClockSnapshot(_)) => "clock",
        Some(Data::TrackDescriptor(d)) if d.uuid == Some(g.uuid()) => "g",
        Some(Data::TrackDescriptor(d)) if d.uuid == Some(child.uuid()) => "child",
        Some(Data::TrackDescriptor(_)) => "other",
        Some(Data::TrackEvent(_)) => "event",
        None => "none",
    }).collect();
    assert_eq!(kinds, ["clock", "g", "child", "event", "event"]);
    assert_eq!(st.track_descriptors, 2, "an unused track ({unused:?}) is never described");
}

#[test]
fn writer_refuses_what_would_make_a_bad_trace() {
    let mut w = TraceWriter::new(Vec::new(), 0).unwrap();
    let a = w.track("a", TrackOpts::default());
    let c = w.counter_track("c", CounterUnit::Count, TrackOpts::default());
    w.instant(100, a, &Event::named("x")).unwrap();
    assert!(matches!(w.instant(99, a, &Event::named("x")), Err(PerfettoError::TimestampRegression { ts: 99, last: 100 })));
    assert!(matches!(w.end(100, a), Err(PerfettoError::UnbalancedEnd { .. })));
    assert!(matches!(w.counter(100, a, 1), Err(PerfettoError::CounterOnSliceTrack { .. })));
    assert!(matches!(w.begin(100, c, &Event::named("x")), Err(PerfettoError::SliceOnCounterTrack { .. })));
    let mut other = TraceWriter::new(Vec::new(), 0).unwrap();
    let foreign = other.track("f", TrackOpts::default());
    let _ = other.track("g", TrackOpts::default());
    let g2 = other.track("h", TrackOpts::default());
    assert!(matches!(w.instant(100, g2, &Event::named("x")), Err(PerfettoError::UnknownTrack(3))));
    let _ = foreign;
    w.begin(100, a, &Event::named("open")).unwrap();
    let err = w.finish().map(|_| ()).unwrap_err();
    assert!(matches!(err, PerfettoError::OpenSlices { open: 1, .. }), "{err}");
    assert!(err.to_string().starts_with("1 slice(s) still open"), "{err}");
}

fn two_chains() -> Vec<Record> {
    let mut recs = Vec::new();
    // Chain "s1": three sequential hops on one keep-alive connection.
    recs.extend(exchange(conn(5), 0, T0, 3, "s1"));
    recs.extend(exchange(conn(5), 1, T0 + 20 * MS, 2, "s1"));
    recs.extend(exchange(conn(5), 2, T0 + 40 * MS, 1, "s1"));
    // Chain "s2": two hops that overlap in time (two connections).
    recs.extend(exchange(conn(6), 0, T0 + 2 * MS, 4, "s2"));
    recs.extend(exchange(conn(7), 0, T0 + 4 * MS, 1, "s2"));
    sorted(recs)
}

#[test]
fn chains_get_one_hop_slice_per_request_and_overlapping_hops_get_a_second_lane() {
    let recs = two_chains();
    let (bytes, st) = trace_of(&recs);
    let s = checked(&bytes);
    assert_eq!((st.requests, st.chains, st.chain_tracks), (5, 2, 3));
    let chains = s.track(names::CHAINS).unwrap();
    let lanes: Vec<(&str, Vec<(&str, u64)>)> =
        s.children(Some(chains.uuid)).map(|t| (t.name.as_str(), t.slices.iter().map(|(k, v)| (k.as_str(), *v)).collect())).collect();
    assert_eq!(lanes, vec![("s1", vec![("hop 1", 1), ("hop 2", 1), ("hop 3", 1)]), ("s2", vec![("hop 1", 1)]), ("s2 (overlap 1)", vec![("hop 2", 1)])]);
    assert_eq!(s.flows, 5, "one flow from every hop to its request");
}

#[test]
fn requests_nest_read_delay_waiting_and_decode_with_an_instant_per_chunk() {
    let recs = sorted(exchange(conn(5), 0, T0, 3, "s1"));
    let (bytes, _) = trace_of(&recs);
    let s = checked(&bytes);
    let r = s.track("chatcmpl-5-0").expect("request track named by id");
    let names: Vec<(&str, u64)> = r.slices.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    assert_eq!(names, vec![("chatcmpl-5-0", 1), ("decode", 1), ("read delay", 1), ("waiting for first token", 1)]);
    assert_eq!(r.instants.get(names::CHUNK), Some(&3));
    assert_eq!(r.max_depth, 2);
    // Phase boundaries are the request's marks.
    let t = decode(&bytes);
    let on: Vec<(u64, i32)> = events(&t).filter(|(_, e)| e.track_uuid == Some(r.uuid)).map(|(ts, e)| (ts, e.r#type.unwrap())).collect();
    let (b, e, i) = (1, 2, 3);
    let end = T0 + 11 * MS + 100; // the [DONE] write
    assert_eq!(
        on,
        vec![
            (T0 - 300_000, b),
            (T0 - 300_000, b),
            (T0, e),
            (T0, b),
            (T0 + 5 * MS, e),
            (T0 + 5 * MS, b),
            (T0 + 5 * MS, i),
            (T0 + 7 * MS, i),
            (T0 + 9 * MS, i),
            (end, e),
            (end, e)
        ]
    );
    // The request slice says what it is.
    let (_, begin) = events(&t).find(|(_, e)| e.track_uuid == Some(r.uuid)).unwrap();
    let arg_names: Vec<String> = begin.debug_annotations.iter().map(|d| iid_name(&t, d.name_iid.unwrap())).collect();
    for want in ["id", "chain", "hop", "status", "method", "path", "prompt_tokens", "completion_tokens", "cached_tokens", "ttft_ms", "e2e_ms", "read_delay_ms"] {
        assert!(arg_names.iter().any(|n| n == want), "{want} missing from {arg_names:?}");
    }
}

fn iid_name(t: &Trace, iid: u64) -> String {
    t.packet
        .iter()
        .filter_map(|p| p.interned_data.as_ref())
        .flat_map(|i| i.debug_annotation_names.iter())
        .find(|n| n.iid == Some(iid))
        .and_then(|n| n.name.clone())
        .expect("interned")
}

#[test]
fn an_unfinished_request_ends_at_the_recording_end_and_says_so() {
    let mut recs = exchange(conn(5), 0, T0, 2, "s1");
    recs.pop(); // no response end
    recs.pop(); // and no [DONE]
    recs.push(Record::Drops { ts_ns: T0 + 50 * MS, counters: vec![("kernel_ringbuf_full".into(), 0)] });
    let (bytes, _) = trace_of(&sorted(recs));
    let s = checked(&bytes);
    let t = decode(&bytes);
    let r = s.track("chatcmpl-5-0").unwrap();
    let last_end = events(&t).filter(|(_, e)| e.track_uuid == Some(r.uuid)).map(|(ts, _)| ts).max().unwrap();
    assert_eq!(last_end, T0 + 50 * MS, "open until the last record");
    let (_, begin) = events(&t).find(|(_, e)| e.track_uuid == Some(r.uuid)).unwrap();
    assert!(begin.debug_annotations.iter().any(|d| iid_name(&t, d.name_iid.unwrap()) == "unfinished" && d.bool_value == Some(true)));
}

#[test]
fn in_flight_counter_rises_and_falls_with_requests() {
    let recs = two_chains();
    let (bytes, _) = trace_of(&recs);
    let s = checked(&bytes);
    let t = decode(&bytes);
    let series = counter_series(&t, &s, names::IN_FLIGHT);
    let values: Vec<i64> = series.iter().map(|(_, v)| *v).collect();
    assert_eq!(values.first(), Some(&0));
    assert_eq!(values.last(), Some(&0));
    assert_eq!(values.iter().max(), Some(&3), "s1 hop 1 and both s2 hops overlap: {series:?}");
    assert!(series.windows(2).all(|w| w[0].1 != w[1].1), "no repeated values: {series:?}");
}

#[test]
fn off_cpu_intervals_nest_the_run_queue_wait_and_overlaps_are_left_out() {
    let mut recs = exchange(conn(5), 0, T0, 1, "s1");
    let off = |on: u64, off: u64, wake: Option<u64>, state: u32| Record::OffCpu { ts_ns: on, tgid: 4242, tid: 4243, off_ns: off, wake_ns: wake, prev_state: state };
    recs.push(off(T0 + 3 * MS, T0 + MS, Some(T0 + 2 * MS), 1));
    recs.push(off(T0 + 5 * MS, T0 + 4 * MS, None, 0));
    recs.push(off(T0 + 6 * MS, T0 + 4 * MS + MS / 2, None, 0)); // overlaps the previous one
    recs.push(off(T0 + 7 * MS, T0 + 8 * MS, None, 0)); // off after on
    recs.push(Record::OffCpu { ts_ns: T0 + 2 * MS, tgid: 4242, tid: 4242, off_ns: T0, wake_ns: None, prev_state: 2 });
    recs.push(Record::Proc { ts_ns: T0 - 5 * MS, tgid: 4242, op: ProcOp::Exec, child_tgid: 4242, exit_code: 0, comm: "vllm-frontend".into() });
    let (bytes, st) = trace_of(&sorted(recs));
    assert_eq!((st.offcpu_slices, st.offcpu_skipped), (3, 2));
    let s = checked(&bytes);
    let worker = s.track("tid 4243").expect("worker thread track");
    assert_eq!(worker.slices.get(names::OFF_CPU), Some(&2));
    assert_eq!(worker.slices.get(names::RUN_QUEUE), Some(&1));
    let main = s.track("vllm-frontend (tid 4242)").expect("main thread named after its process");
    assert_eq!(main.slices.get(names::OFF_CPU), Some(&1));
    let process = s.track("vllm-frontend (pid 4242)").expect("process named from its exec comm");
    assert_eq!(worker.parent, Some(process.uuid));
    let t = decode(&bytes);
    let runq = events(&t).filter(|(_, e)| e.track_uuid == Some(worker.uuid)).flat_map(|(_, e)| e.debug_annotations.iter()).find_map(|d| d.double_value);
    assert_eq!(runq, Some(1.0), "run-queue delay 1 ms");
}

#[test]
fn metadata_lists_every_counter_and_nonzero_loss_counters_get_counter_tracks() {
    let mut recs = exchange(conn(5), 0, T0, 1, "s1");
    recs.push(Record::Drops { ts_ns: T0 + MS, counters: vec![("kernel_ringbuf_full".into(), 2), ("gap_bytes".into(), 0)] });
    recs.push(Record::Drops { ts_ns: T0 + 3 * MS, counters: vec![("kernel_ringbuf_full".into(), 2), ("gap_bytes".into(), 0)] });
    recs.push(Record::Drops { ts_ns: T0 + 4 * MS, counters: vec![("kernel_ringbuf_full".into(), 9), ("gap_bytes".into(), 0), ("kernel_events".into(), 500)] });
    let (bytes, _) = trace_of(&sorted(recs));
    let s = checked(&bytes);
    let t = decode(&bytes);
    let full = counter_series(&t, &s, "drops: kernel_ringbuf_full");
    assert_eq!(full.iter().map(|(_, v)| *v).collect::<Vec<_>>(), vec![0, 2, 9]);
    assert!(s.track("drops: gap_bytes").is_none(), "no track for a counter that stayed 0");
    assert!(s.track("drops: kernel_events").is_none(), "no track for an activity counter");
    let meta = s.track(names::META_TRACK).unwrap();
    assert_eq!(meta.instants.get(names::META_EVENT), Some(&1));
    let (ts, e) = events(&t).find(|(_, e)| e.track_uuid == Some(meta.uuid) && e.r#type == Some(3)).unwrap();
    assert_eq!(ts, meta_start(), "at the start of the recording");
    let arg = |n: &str| e.debug_annotations.iter().find(|d| iid_name(&t, d.name_iid.unwrap()) == n).cloned();
    assert_eq!(arg("drops.gap_bytes").and_then(|d| d.uint_value), Some(0));
    assert_eq!(arg("drops.kernel_ringbuf_full").and_then(|d| d.uint_value), Some(9));
    assert_eq!(arg("drops.kernel_events").and_then(|d| d.uint_value), Some(500));
    assert_eq!(arg("hopscope_version").and_then(|d| d.string_value), Some("test".into()));
    assert_eq!(arg("pids").and_then(|d| d.string_value), Some("4242".into()));
}

fn meta_start() -> u64 {
    meta().start_ns
}

#[test]
fn an_empty_recording_still_gives_a_valid_trace() {
    let analysis = Analysis::default();
    let (bytes, st) = write_trace(Vec::new(), TraceInput { meta: &Meta::default(), records: &[], analysis: &analysis, read_error: Some("truncated") }).unwrap();
    let s = checked(&bytes);
    assert_eq!(st.requests, 0);
    assert_eq!(s.track(names::META_TRACK).unwrap().instants.len(), 1);
}

#[test]
fn the_same_input_gives_the_same_bytes() {
    let recs = two_chains();
    assert_eq!(trace_of(&recs).0, trace_of(&recs).0);
}

// ---- the checker catches what it must ----

fn packet(seq: Option<u32>, flags: u32, ts: Option<u64>, data: Option<Data>) -> proto::TracePacket {
    proto::TracePacket { trusted_packet_sequence_id: seq, sequence_flags: Some(flags), timestamp: ts, data, ..Default::default() }
}

fn first() -> proto::TracePacket {
    let mut p = packet(Some(1), proto::SEQ_INCREMENTAL_STATE_CLEARED, None, None);
    p.trace_packet_defaults = Some(proto::TracePacketDefaults { timestamp_clock_id: Some(proto::BUILTIN_CLOCK_MONOTONIC), track_event_defaults: None });
    p
}

fn desc(uuid: u64, parent: Option<u64>) -> proto::TracePacket {
    packet(Some(1), 2, None, Some(Data::TrackDescriptor(proto::TrackDescriptor { uuid: Some(uuid), parent_uuid: parent, name: Some("t".into()), ..Default::default() })))
}

fn ev(ts: u64, uuid: u64, ty: proto::EventType) -> proto::TracePacket {
    let name = (ty != proto::EventType::SliceEnd).then(|| "n".to_owned());
    packet(Some(1), 2, Some(ts), Some(Data::TrackEvent(proto::TrackEvent { r#type: Some(ty as i32), track_uuid: Some(uuid), name, ..Default::default() })))
}

fn violations(packets: Vec<proto::TracePacket>) -> String {
    match check::check(&Trace { packet: packets }) {
        Ok(_) => panic!("checker accepted a bad trace"),
        Err(CheckError::Violations(v)) => v.join("; "),
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn checker_rejects_missing_sequence_ids_and_uncleared_first_packets() {
    use proto::EventType::Instant;
    assert!(violations(vec![packet(None, 1, None, None)]).contains("no trusted_packet_sequence_id"));
    assert!(violations(vec![desc(1, None)]).contains("does not clear incremental state"));
    let mut later = ev(1, 1, Instant);
    later.sequence_flags = None;
    assert!(violations(vec![first(), desc(1, None), later]).contains("SEQ_NEEDS_INCREMENTAL_STATE"));
}

#[test]
fn checker_rejects_undefined_tracks_parents_and_interned_ids() {
    use proto::EventType::Instant;
    assert!(violations(vec![first(), ev(1, 9, Instant)]).contains("before its descriptor"));
    assert!(violations(vec![first(), desc(2, Some(1))]).contains("parent 1 is not described yet"));
    let mut e = ev(1, 1, Instant);
    if let Some(Data::TrackEvent(te)) = &mut e.data {
        te.name = None;
        te.name_iid = Some(5);
    }
    assert!(violations(vec![first(), desc(1, None), e]).contains("event name iid 5 not interned"));
}

#[test]
fn checker_rejects_unbalanced_slices_backwards_time_and_open_flows() {
    use proto::EventType::{Instant, SliceBegin, SliceEnd};
    assert!(violations(vec![first(), desc(1, None), ev(1, 1, SliceEnd)]).contains("without an open slice"));
    assert!(violations(vec![first(), desc(1, None), ev(1, 1, SliceBegin)]).contains("never end"));
    assert!(violations(vec![first(), desc(1, None), ev(5, 1, Instant), ev(4, 1, Instant)]).contains("before the sequence's previous"));
    let mut f = ev(1, 1, Instant);
    if let Some(Data::TrackEvent(te)) = &mut f.data {
        te.flow_ids = vec![77];
    }
    assert!(violations(vec![first(), desc(1, None), f]).contains("flow 77 (from packet 2) never terminates"));
    let mut t = ev(1, 1, Instant);
    if let Some(Data::TrackEvent(te)) = &mut t.data {
        te.terminating_flow_ids = vec![78];
    }
    assert!(violations(vec![first(), desc(1, None), t]).contains("flow 78 terminates without having started"));
}

/// Bytes per slice and writer throughput, for docs/perfetto.md. Run with
/// `cargo test --release -p hopscope perfetto::tests::bench -- --ignored --nocapture`.
#[test]
#[ignore = "benchmark: prints figures"]
fn bench_bytes_per_slice_and_writer_throughput() {
    const N: u64 = 1_000_000;
    // Raw writer: N slices on 64 tracks with 32 distinct names, no args (the
    // shape of GPU kernel slices), at realistic monotonic timestamps.
    let mut w = TraceWriter::new(std::io::sink(), T0).unwrap();
    let tracks: Vec<TrackId> = (0..64).map(|i| w.track(&format!("stream {i}"), TrackOpts::default())).collect();
    let names: Vec<String> = (0..32).map(|i| format!("kernel_{i}")).collect();
    let start = std::time::Instant::now();
    for i in 0..N {
        let t = tracks[(i % 64) as usize];
        let ts = T0 + i * 1_500;
        w.begin(ts, t, &Event::named(&names[(i % 32) as usize])).unwrap();
        w.end(ts + 1_000, t).unwrap_or_else(|_| unreachable!());
    }
    let el = start.elapsed().as_secs_f64();
    let (_, st) = w.finish().unwrap();
    println!(
        "raw slices: {} slices, {:.1} bytes/slice (begin+end), {:.2} M events/s, {:.0} MB/s",
        st.slices,
        st.bytes as f64 / st.slices as f64,
        st.events() as f64 / el / 1e6,
        st.bytes as f64 / el / 1e6
    );
    // Full layout: 2000 requests × 50 chunks in 500 chains of 4 hops, off-CPU on 8 threads.
    let mut recs = Vec::new();
    for c in 0..500u64 {
        for h in 0..4u64 {
            recs.extend(exchange(conn(c as i32 + 10), h as u32, T0 + c * 3 * MS + h * 120 * MS, 50, &format!("chain-{c}")));
        }
    }
    for i in 0..100_000u64 {
        let on = T0 + i * 20_000 + 15_000;
        recs.push(Record::OffCpu { ts_ns: on, tgid: 4242, tid: 4242 + (i % 8) as u32, off_ns: on - 10_000, wake_ns: Some(on - 2_000), prev_state: 1 });
    }
    let recs = sorted(recs);
    let analysis = analyse(&recs);
    let m = meta();
    let start = std::time::Instant::now();
    let (_, st) = write_trace(std::io::sink(), TraceInput { meta: &m, records: &recs, analysis: &analysis, read_error: None }).unwrap();
    let el = start.elapsed().as_secs_f64();
    println!(
        "layout: {} requests, {} slices, {} instants, {} counter values, {} bytes ({:.1} bytes/event), {:.2} M events/s, {:.0} ms",
        st.requests,
        st.writer.slices,
        st.writer.instants,
        st.writer.counter_values,
        st.writer.bytes,
        st.writer.bytes as f64 / st.writer.events() as f64,
        st.writer.events() as f64 / el / 1e6,
        el * 1e3
    );
}
