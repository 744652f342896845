//! Unit tests: the writer's guarantees, the layout, and the checker catching
//! what it must catch. The official-schema decode lives in
//! tests/tests/perfetto.rs (it needs perfetto_protos, a 220 s build).

use super::check::{self, CheckError, Summary};
use super::proto::{self, ChildOrdering, CounterUnit, Data, Trace};
use super::*;
use crate::correlate::{analyse, Analysis, Config};
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

fn trace_of(records: &[Record]) -> (Vec<u8>, TraceStats) {
    let analysis = analyse(records);
    let m = meta();
    write_trace(Vec::new(), TraceInput { meta: &m, records, analysis: &analysis, read_error: None }).expect("trace writes")
}

fn checked(bytes: &[u8]) -> Summary {
    check::check_bytes(bytes).unwrap_or_else(|e| panic!("trace fails the checker: {e}"))
}

/// The trace with absolute timestamps and every event naming its track
/// (compressed batches expanded).
fn decode(bytes: &[u8]) -> Trace {
    check::flatten(&check::decode(bytes).expect("trace decodes"))
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
    let th = w.thread_track(7, 8, None, false);
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
    assert_eq!(p.trace_packet_defaults.as_ref().and_then(|d| d.timestamp_clock_id), Some(writer::INCREMENTAL_CLOCK_ID));
    let Some(Data::ClockSnapshot(cs)) = &p.data else { panic!("first packet is a clock snapshot: {p:?}") };
    assert_eq!(cs.primary_trace_clock, Some(proto::BUILTIN_CLOCK_MONOTONIC as i32));
    let clocks: Vec<(Option<u32>, Option<u64>, Option<bool>)> = cs.clocks.iter().map(|c| (c.clock_id, c.timestamp, c.is_incremental)).collect();
    assert_eq!(clocks, vec![(Some(proto::BUILTIN_CLOCK_MONOTONIC), Some(123), None), (Some(writer::INCREMENTAL_CLOCK_ID), Some(123), Some(true))]);
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
    let t = check::decode(&bytes).unwrap();
    let defs: usize = t.packet.iter().filter_map(|p| p.interned_data.as_ref()).map(|i| i.event_names.len() + i.debug_annotation_names.len() + i.debug_annotation_string_values.len()).sum();
    assert_eq!(defs, 3);
    assert!(events(&t).all(|(_, e)| e.name.is_none()), "names travel as iids only");
    // Every packet after the first depends on the sequence's state.
    assert!(t.packet[1..].iter().all(|p| p.sequence_flags == Some(proto::SEQ_NEEDS_INCREMENTAL_STATE)));
    checked(&bytes);
}

#[test]
fn a_shared_value_is_sent_once_per_sequence_and_not_kept_in_the_intern_table() {
    let mut w = TraceWriter::new(Vec::new(), 0).unwrap();
    let a = w.track("a", TrackOpts::default());
    let own = w.track("own", TrackOpts { own_sequence: true, ..TrackOpts::default() });
    let lists: Vec<String> = (0..3).map(|i| format!("chatcmpl-{i}-a,chatcmpl-{i}-b")).collect();
    let cells: Vec<writer::Shared> = lists.iter().map(|_| writer::Shared::new()).collect();
    let mut ts = 0;
    // Each list on two events of one sequence (another list's between
    // them, as a request's slice and its decode phase have others'), then
    // two of them on a track of another sequence.
    let order = [(a, 0), (a, 1), (a, 0), (a, 1), (a, 2), (a, 2), (own, 0), (own, 0), (own, 1)];
    for (track, j) in order {
        ts += 10;
        w.begin(ts, track, &Event::named("e").args(&[Arg::shared("from", &lists[j], &cells[j])])).unwrap();
        w.end(ts + 5, track).unwrap();
    }
    let (bytes, _) = w.finish().unwrap();
    checked(&bytes);
    let t = check::decode(&bytes).unwrap();
    let flat = check::flatten(&t);
    let sent: Vec<(Option<u32>, Vec<u8>)> = flat
        .packet
        .iter()
        .filter_map(|p| p.interned_data.as_ref().map(|i| (p.trusted_packet_sequence_id, i)))
        .flat_map(|(seq, i)| i.debug_annotation_string_values.iter().map(move |v| (seq, v.str.clone().unwrap_or_default())))
        .collect();
    // Three lists on one sequence and two on the other: five copies, not nine.
    assert_eq!(sent.len(), 5, "{sent:?}");
    let seqs: HashSet<Option<u32>> = sent.iter().map(|(s, _)| *s).collect();
    assert_eq!(seqs.len(), 2);
    // Every event reads its own list back.
    let read: Vec<String> = events(&flat).filter_map(|(_, e)| e.debug_annotations.first()).map(|d| d.string_value.clone().expect("resolved")).collect();
    let want: Vec<String> = order.iter().map(|&(_, j)| lists[j].clone()).collect();
    assert_eq!(read, want);
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
        Some(Data::CompressedPackets(_)) => "compressed",
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
    // Labelled as the timeline shows them: hop, TTFT and E2E.
    assert_eq!(
        lanes,
        vec![
            ("s1", vec![("hop 1 · TTFT 5.0 ms · E2E 11.0 ms", 1), ("hop 2 · TTFT 5.0 ms · E2E 9.0 ms", 1), ("hop 3 · TTFT 5.0 ms · E2E 7.0 ms", 1)]),
            ("s2", vec![("hop 1 · TTFT 5.0 ms · E2E 13.0 ms", 1)]),
            ("s2 (overlap 1)", vec![("hop 2 · TTFT 5.0 ms · E2E 7.0 ms", 1)])
        ]
    );
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
    let arg_names: Vec<String> = begin.debug_annotations.iter().map(|d| d.name.clone().unwrap()).collect();
    for want in ["id", "chain", "hop", "status", "method", "path", "prompt_tokens", "completion_tokens", "cached_tokens", "ttft_ms", "e2e_ms", "read_delay_ms"] {
        assert!(arg_names.iter().any(|n| n == want), "{want} missing from {arg_names:?}");
    }
}

/// `exchange`'s request without its [DONE] and response end, records until
/// T0 + 50 ms; its connection closed at `close` when given. The trace's
/// summary, the request slice's last end and its args.
fn cut_short(close: Option<u64>) -> (Summary, u64, Vec<proto::DebugAnnotation>) {
    let mut recs = exchange(conn(5), 0, T0, 2, "s1");
    recs.pop(); // no response end
    recs.pop(); // and no [DONE]
    recs.extend(close.map(|ts_ns| Record::ConnClose { ts_ns, conn: conn(5) }));
    recs.push(Record::Drops { ts_ns: T0 + 50 * MS, counters: vec![("kernel_ringbuf_full".into(), 0)] });
    let (bytes, _) = trace_of(&sorted(recs));
    let s = checked(&bytes);
    let t = decode(&bytes);
    let r = s.track("chatcmpl-5-0").unwrap();
    let last_end = events(&t).filter(|(_, e)| e.track_uuid == Some(r.uuid)).map(|(ts, _)| ts).max().unwrap();
    let (_, begin) = events(&t).find(|(_, e)| e.track_uuid == Some(r.uuid)).unwrap();
    let args = begin.debug_annotations.clone();
    (s, last_end, args)
}

#[test]
fn an_unfinished_request_ends_at_the_recording_end_and_says_so() {
    let (_, last_end, args) = cut_short(None);
    assert_eq!(last_end, T0 + 50 * MS, "open until the last record");
    assert!(args.iter().any(|d| d.name.clone().unwrap() == "unfinished" && d.bool_value == Some(true)));
}

#[test]
fn a_request_its_client_left_ends_at_the_close_and_says_so() {
    let (s, last_end, args) = cut_short(Some(T0 + 20 * MS));
    assert_eq!(last_end, T0 + 20 * MS, "drawn to the close, not the recording's end");
    let arg = |n: &str| args.iter().find(|d| d.name.as_deref() == Some(n)).cloned();
    assert!(arg("unfinished").is_none());
    assert!(arg("closed_ms").and_then(|d| d.double_value).is_some_and(|v| v > 0.0), "{args:?}");
    let hop = s.track("s1").expect("the chain's track");
    assert!(hop.slices.keys().any(|k| k.starts_with("hop 1 ") && k.contains("· closed after ")), "{:?}", hop.slices);
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
    let arg = |n: &str| e.debug_annotations.iter().find(|d| d.name.clone().unwrap() == n).cloned();
    assert_eq!(arg("drops.gap_bytes").and_then(|d| d.uint_value), Some(0));
    assert_eq!(arg("drops.kernel_ringbuf_full").and_then(|d| d.uint_value), Some(9));
    assert_eq!(arg("drops.kernel_events").and_then(|d| d.uint_value), Some(500));
    assert_eq!(arg("hopscope_version").and_then(|d| d.string_value), Some("test".into()));
    assert_eq!(arg("pids").and_then(|d| d.string_value), Some("4242".into()));
}

#[test]
fn metadata_names_the_tracepoints_the_recording_lacked_and_only_then() {
    let recs = sorted(exchange(conn(5), 0, T0, 1, "s1"));
    let analysis = analyse(&recs);
    let arg_of = |m: &Meta| {
        let (bytes, _) = write_trace(Vec::new(), TraceInput { meta: m, records: &recs, analysis: &analysis, read_error: None }).unwrap();
        let (s, t) = (checked(&bytes), decode(&bytes));
        let meta = s.track(names::META_TRACK).unwrap();
        let (_, e) = events(&t).find(|(_, e)| e.track_uuid == Some(meta.uuid) && e.r#type == Some(3)).unwrap();
        e.debug_annotations.iter().find(|d| d.name.as_deref() == Some("missing_tracepoints")).and_then(|d| d.string_value.clone())
    };
    let mut m = meta();
    assert_eq!(arg_of(&m), None, "nothing missing, nothing said");
    m.missing_tracepoints = vec!["sock:sk_data_ready".into()];
    assert_eq!(arg_of(&m).as_deref(), Some("sock:sk_data_ready"));
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
    // An open flow: wrong when the trace declares fewer in its metadata,
    // counted when it declares them (or has no metadata yet: a live trace
    // read before its stop).
    let declare = |n: u64| {
        let mut m = ev(0, 1, Instant);
        if let Some(Data::TrackEvent(te)) = &mut m.data {
            te.debug_annotations = vec![proto::DebugAnnotation { name: Some("trace.flows_unlinked".into()), uint_value: Some(n), ..Default::default() }];
        }
        m
    };
    assert!(violations(vec![first(), desc(1, None), declare(0), f.clone()]).contains("flow 77 (from packet 3) never terminates (1 such, the trace declares 0 in trace.flows_unlinked)"));
    assert!(violations(vec![first(), desc(1, None), declare(2), f.clone()]).contains("(1 such, the trace declares 2"));
    assert!(violations(vec![first(), desc(1, None), declare(1)]).contains("every flow links, but the trace declares 1"));
    for packets in [vec![first(), desc(1, None), declare(1), f.clone()], vec![first(), desc(1, None), f]] {
        let s = check::check(&Trace { packet: packets }).expect("declared, or no metadata");
        assert_eq!((s.flows, s.flows_unlinked), (0, 1));
    }
    let mut t = ev(1, 1, Instant);
    if let Some(Data::TrackEvent(te)) = &mut t.data {
        te.terminating_flow_ids = vec![78];
    }
    assert!(violations(vec![first(), desc(1, None), t]).contains("flow 78 terminates without having started"));
}

/// Bytes per slice and writer throughput, for docs/perfetto.md and
/// docs/benchmarks.md. Run with
/// `cargo test --release -p hopscope --lib perfetto::tests::bench -- --ignored --nocapture`.
#[test]
#[ignore = "benchmark: prints figures"]
fn bench_bytes_per_slice_and_writer_throughput() {
    const N: u64 = 1_000_000;
    let report = |what: &str, st: WriterStats, el: f64| {
        println!(
            "{what}: {} slices, {:.1} bytes/slice (begin+end) written, {:.1} uncompressed, {} batches, {:.2} M events/s, {:.0} MB/s in",
            st.slices,
            st.bytes as f64 / st.slices as f64,
            st.raw_bytes as f64 / st.slices as f64,
            st.batches,
            st.events() as f64 / el / 1e6,
            st.raw_bytes as f64 / el / 1e6
        )
    };
    let level = |l: u8| Encoding { level: l, ..Encoding::COMPRESSED };
    // GPU kernel slices as the layout writes them: 8 streams, each on its own
    // sequence, kernels back to back (2-40 us long, 1-3 us apart), 64 names.
    // PERFETTO_BENCH_OUT=FILE keeps the default encoding's trace.
    for (what, enc) in [("plain", Encoding::PLAIN), ("zlib level 1 (default)", Encoding::COMPRESSED), ("zlib level 6 (traced's)", level(6))] {
        let out: Box<dyn std::io::Write> = match std::env::var_os("PERFETTO_BENCH_OUT").filter(|_| enc == Encoding::default()) {
            Some(p) => Box::new(std::io::BufWriter::new(std::fs::File::create(p).unwrap())),
            None => Box::new(std::io::sink()),
        };
        let mut w = TraceWriter::with_encoding(out, T0, enc).unwrap();
        let streams: Vec<TrackId> = (0..8).map(|i| w.track(&format!("GPU 0 stream {i}"), TrackOpts { own_sequence: true, ..TrackOpts::default() })).collect();
        let names: Vec<String> = (0..64).map(|i| format!("void at::native::kernel_{i}<float, 4>(at::TensorIterator&)")).collect();
        let mut at = [T0; 8];
        let start = std::time::Instant::now();
        for i in 0..N {
            let s = (i % 8) as usize;
            // A cheap deterministic spread of durations and gaps.
            let h = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
            let (dur, gap) = (2_000 + h % 38_000, 1_000 + (h >> 8) % 2_000);
            w.begin(at[s], streams[s], &Event::named(&names[(h % 64) as usize])).unwrap();
            w.end(at[s] + dur, streams[s]).unwrap_or_else(|_| unreachable!());
            at[s] += dur + gap;
        }
        let cap = w.buffer_capacity();
        let (_, st) = w.finish().unwrap();
        let el = start.elapsed().as_secs_f64();
        report(&format!("kernel slices (8 streams, own sequences), {what}"), st, el);
        println!("  writer buffers: {cap} bytes");
    }
    // The shape of the previous figure: 64 tracks on the main sequence, 32
    // names, a slice every 1.5 us across all tracks.
    for (what, enc) in [("plain", Encoding::PLAIN), ("zlib level 1 (default)", Encoding::COMPRESSED)] {
        let mut w = TraceWriter::with_encoding(std::io::sink(), T0, enc).unwrap();
        let tracks: Vec<TrackId> = (0..64).map(|i| w.track(&format!("stream {i}"), TrackOpts::default())).collect();
        let names: Vec<String> = (0..32).map(|i| format!("kernel_{i}")).collect();
        let start = std::time::Instant::now();
        for i in 0..N {
            let t = tracks[(i % 64) as usize];
            let ts = T0 + i * 1_500;
            w.begin(ts, t, &Event::named(&names[(i % 32) as usize])).unwrap();
            w.end(ts + 1_000, t).unwrap_or_else(|_| unreachable!());
        }
        let (_, st) = w.finish().unwrap();
        let el = start.elapsed().as_secs_f64();
        report(&format!("raw slices (64 tracks, main sequence), {what}"), st, el);
    }
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
    // Kernel records through the layout (with their args: grid, block,
    // correlation id): 200 k kernels on 4 streams of one process.
    let mut kernels: Vec<Record> = (0..200_000u64)
        .map(|i| {
            let h = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
            let mut k = kernel(T0 + (i / 4) * 12_000, 2_000 + h % 8_000, &format!("void at::native::kernel_{}<float, 4>(at::TensorIterator&)", h % 64));
            if let Record::GpuKernel { stream, correlation_id, grid, .. } = &mut k {
                *stream = (i % 4) as u32;
                *correlation_id = i as u32 + 1_000_000;
                grid[0] = 1 + (h % 16) as u32 * 108;
            }
            k
        })
        .collect();
    kernels.sort_by_key(Record::ts_ns);
    let ka = analyse(&kernels);
    for (what, enc) in [("plain", Encoding::PLAIN), ("zlib level 1 (default)", Encoding::COMPRESSED)] {
        let start = std::time::Instant::now();
        let (_, st) = write_trace_with(std::io::sink(), TraceInput { meta: &m, records: &kernels, analysis: &ka, read_error: None }, enc).unwrap();
        let el = start.elapsed().as_secs_f64();
        println!(
            "layout kernels, {what}: {} kernel slices, {:.1} bytes/kernel slice with args written ({:.1} uncompressed; all packets / slices), {:.2} M events/s",
            st.gpu_slices,
            st.writer.bytes as f64 / st.gpu_slices as f64,
            st.writer.raw_bytes as f64 / st.gpu_slices as f64,
            st.writer.events() as f64 / el / 1e6
        );
    }
    for (what, enc) in [("plain", Encoding::PLAIN), ("zlib level 1 (default)", Encoding::COMPRESSED)] {
        let start = std::time::Instant::now();
        let (_, st) = write_trace_with(std::io::sink(), TraceInput { meta: &m, records: &recs, analysis: &analysis, read_error: None }, enc).unwrap();
        let el = start.elapsed().as_secs_f64();
        println!(
            "layout, {what}: {} requests, {} slices, {} instants, {} counter values, {} bytes ({:.1} bytes/event; {:.1} uncompressed), {:.2} M events/s, {:.0} ms",
            st.requests,
            st.writer.slices,
            st.writer.instants,
            st.writer.counter_values,
            st.writer.bytes,
            st.writer.bytes as f64 / st.writer.events() as f64,
            st.writer.raw_bytes as f64 / st.writer.events() as f64,
            st.writer.events() as f64 / el / 1e6,
            el * 1e3
        );
    }
}

// ---- flows: request phases → engine steps → kernels ----

pub(crate) const ENGINE: u32 = 4300;

/// Engine IPC for one request `id` (the HTTP request `chatcmpl-…`): the ADD
/// at `submit`, then one step per entry of `steps` (built time, new tokens).
fn engine_steps(id: &str, submit: u64, steps: &[(u64, u64)]) -> Vec<Record> {
    use crate::event::Dir;
    use crate::model::EngineOutput;
    let ipc = ConnKey { tgid: 4242, fd: 30, ino: 30 };
    let out = ConnKey { tgid: ENGINE, fd: 31, ino: 31 };
    let mut v = vec![Record::EngineRequest {
        conn: ipc,
        ts_ns: submit,
        tid: 4242,
        dir: Dir::Out,
        request_id: format!("{id}-0123abcd"),
        external_req_id: Some(id.into()),
        prompt_tokens: Some(40),
        max_tokens: None,
        arrival_time_s: None,
        traceparent: None,
        data_parallel_rank: None,
        truncated: false,
    }];
    for (k, &(built, tokens)) in steps.iter().enumerate() {
        let last = k + 1 == steps.len();
        v.push(Record::EngineOutputs {
            conn: out,
            ts_ns: built + 50_000,
            tid: ENGINE,
            dir: Dir::Out,
            engine_index: Some(0),
            timestamp_s: Some(built as f64 / 1e9),
            outputs: vec![EngineOutput { request_id: format!("{id}-0123abcd"), new_tokens: tokens, finish_reason: last.then_some(0), events: vec![], prefill: None }],
            outputs_total: Some(1),
            finished_requests: vec![],
            truncated: false,
        });
    }
    v
}

pub(crate) fn kernel(ts: u64, dur: u64, name: &str) -> Record {
    Record::GpuKernel {
        ts_ns: ts,
        end_ns: ts + dur,
        pid: ENGINE,
        device: 0,
        context: 1,
        stream: 7,
        correlation_id: 1,
        graph_id: 0,
        graph_node_id: 0,
        name: name.into(),
        grid: [1, 1, 1],
        block: [32, 1, 1],
        static_shared_mem: 0,
        dynamic_shared_mem: 0,
        registers_per_thread: 32,
    }
}

/// A request with 12 content chunks; its engine ran a chunked-prefill step
/// (no token) at +2 ms, the first-token step at +4 ms and 12 decode steps
/// 2 ms apart from +6 ms; three kernels ran in every step after the first.
fn served_request() -> (Vec<Record>, Vec<u64>) {
    let mut recs = exchange(conn(5), 0, T0, 12, "s1");
    let mut steps = vec![(T0 + 2 * MS, 0), (T0 + 4 * MS, 1)];
    steps.extend((0..12).map(|k| (T0 + 6 * MS + k * 2 * MS, 1)));
    recs.extend(engine_steps("chatcmpl-5-0", T0 + MS, &steps));
    let ends: Vec<u64> = steps.iter().map(|s| s.0).collect();
    for w in ends.windows(2) {
        for j in 0..3 {
            recs.push(kernel(w[0] + 100_000 + j * 200_000, 50_000, &format!("k{j}")));
        }
    }
    (sorted(recs), ends)
}

/// Per flow id, the names of the events at its two ends, with their `step` arg.
fn flow_ends(t: &Trace) -> HashMap<u64, Vec<(String, Option<u64>)>> {
    let step_arg = |e: &proto::TrackEvent| e.debug_annotations.iter().find(|d| d.name.clone().unwrap() == "step").and_then(|d| d.uint_value);
    let mut out: HashMap<u64, Vec<(String, Option<u64>)>> = HashMap::new();
    for (_, e) in events(t) {
        for id in e.flow_ids.iter().chain(&e.terminating_flow_ids) {
            out.entry(*id).or_default().push((e.name.clone().unwrap(), step_arg(e)));
        }
    }
    out
}

#[test]
fn prefill_and_decode_slices_flow_to_their_steps_and_steps_to_their_first_and_last_kernel() {
    let (recs, _) = served_request();
    let (bytes, st) = trace_of(&recs);
    let s = checked(&bytes);
    // Prefill: the chunked step 0 and the first-token step 1. Decode: steps
    // 2..=13, capped to the first four and the last.
    assert_eq!((st.step_flows, st.flows_capped, st.flows_unmapped), (2 + 5, 7, 0));
    assert_eq!(st.kernel_flows, 13 * 2, "13 steps with kernels, a flow to the first and the last");
    assert_eq!(s.flows, 1 + 7 + 26, "hop→request, request→step, step→kernel");
    let t = decode(&bytes);
    let ends = flow_ends(&t);
    let mut prefill: Vec<u64> = ends.values().filter(|v| v[0].0 == "prefill" || v[1].0 == "prefill").filter_map(|v| v.iter().find_map(|e| e.1)).collect();
    prefill.sort();
    assert_eq!(prefill, vec![0, 1]);
    let mut decode: Vec<u64> = ends.values().filter(|v| v.iter().any(|e| e.0 == "decode")).filter_map(|v| v.iter().find_map(|e| e.1)).collect();
    decode.sort();
    assert_eq!(decode, vec![2, 3, 4, 5, 13]);
    let mut kernels: Vec<(u64, String)> = ends.values().filter(|v| v.iter().any(|e| e.0.starts_with('k'))).map(|v| (v.iter().find_map(|e| e.1).unwrap(), v.iter().find(|e| e.0.starts_with('k')).unwrap().0.clone())).collect();
    kernels.sort();
    assert_eq!(kernels.len(), 26);
    assert_eq!(&kernels[..2], &[(1, "k0".to_owned()), (1, "k2".to_owned())], "step 1's first and last kernel");
    assert!(ends.values().all(|v| v.len() == 2), "every flow has exactly two ends");
}

#[test]
fn kernels_of_other_processes_or_outside_every_step_get_no_flow() {
    let (mut recs, ends) = served_request();
    let mut other = kernel(ends[1] + 100_000, 10_000, "other");
    if let Record::GpuKernel { pid, .. } = &mut other {
        *pid = 9999;
    }
    recs.push(other);
    recs.push(kernel(ends[ends.len() - 1] + 5 * MS, 10_000, "after"));
    let (bytes, st) = trace_of(&sorted(recs));
    checked(&bytes);
    assert_eq!(st.kernel_flows, 26);
    let t = decode(&bytes);
    assert!(flow_ends(&t).values().flatten().all(|e| e.0 != "other" && e.0 != "after"));
}

#[test]
fn engine_requests_not_joined_to_an_http_request_are_counted_not_drawn() {
    let mut recs = exchange(conn(5), 0, T0, 2, "s1");
    recs.extend(engine_steps("chatcmpl-unknown", T0 + MS, &[(T0 + 2 * MS, 1), (T0 + 4 * MS, 1)]));
    let (bytes, st) = trace_of(&sorted(recs));
    checked(&bytes);
    assert_eq!((st.step_flows, st.flows_unmapped), (0, 2));
}

// ---- server counters ----

fn counter_f64_series(t: &Trace, s: &Summary, track: &str) -> Vec<(u64, f64)> {
    let uuid = s.track(track).unwrap_or_else(|| panic!("no track {track}")).uuid;
    events(t).filter(|(_, e)| e.track_uuid == Some(uuid)).map(|(ts, e)| (ts, e.double_counter_value.expect("double counter"))).collect()
}

#[test]
fn running_and_waiting_requests_follow_the_engine_partition() {
    let (recs, _) = served_request();
    let (bytes, _) = trace_of(&recs);
    let s = checked(&bytes);
    let t = decode(&bytes);
    let server = s.track(names::SERVER).expect("a Server group");
    assert_eq!(s.track(names::RUNNING).unwrap().parent, Some(server.uuid));
    let done = T0 + 5 * MS + 12 * 2 * MS + 100; // the [DONE] write
    assert_eq!(counter_series(&t, &s, names::WAITING_REQS), vec![(meta_start(), 0), (T0 + MS, 1), (T0 + 2 * MS, 0)], "submitted at +1 ms, scheduled when step 0 ended");
    assert_eq!(counter_series(&t, &s, names::RUNNING), vec![(meta_start(), 0), (T0 + 2 * MS, 1), (done, 0)]);
}

#[test]
fn output_tokens_per_second_counts_the_tokens_of_the_steps_in_the_last_second() {
    let mut recs = exchange(conn(5), 0, T0, 1, "s1");
    let steps: Vec<(u64, u64)> = (0..5).map(|k| (T0 + k * 400 * MS, 1 + k % 2)).collect();
    recs.extend(engine_steps("chatcmpl-x", T0, &steps));
    let (bytes, _) = trace_of(&sorted(recs));
    let s = checked(&bytes);
    let t = decode(&bytes);
    let series = counter_f64_series(&t, &s, names::TOKENS_PER_S);
    // Tokens 1, 2, 1, 2, 1 at 0, 0.4, 0.8, 1.2, 1.6 s: the window (t-1 s, t].
    let want = [1.0, 3.0, 4.0, 5.0, 4.0];
    assert_eq!(series.len(), 5);
    for ((ts, v), (k, w)) in series.iter().zip(want.iter().enumerate()) {
        assert_eq!(*ts, T0 + k as u64 * 400 * MS);
        assert!((v - w).abs() < 1e-9, "step {k}: {v} tokens/s, want {w}");
    }
}

#[test]
fn kv_cache_usage_and_gpu_memory_utilisation_and_pcie_and_nvlink_throughput_become_counters() {
    let mut recs = exchange(conn(5), 0, T0, 1, "s1");
    let ipc = ConnKey { tgid: ENGINE, fd: 31, ino: 31 };
    for (k, u) in [0.25, 0.5].into_iter().enumerate() {
        let ts = T0 + k as u64 * MS;
        recs.push(Record::EngineStats { conn: ipc, ts_ns: ts, engine_index: Some(0), running: Some(1), waiting: Some(0), kv_cache_usage: Some(u), step_counter: None, prefix_cache_queries: None, prefix_cache_hits: None });
    }
    recs.push(Record::EngineStats { conn: ipc, ts_ns: T0 + 3 * MS, engine_index: Some(0), running: Some(1), waiting: Some(0), kv_cache_usage: None, step_counter: None, prefix_cache_queries: None, prefix_cache_hits: None });
    let gib = 1u64 << 30;
    for (k, (used, mine, sm, nvlink)) in [(gib, gib / 2, Some(70), None), (2 * gib, gib, None, Some(307_200))].into_iter().enumerate() {
        recs.push(Record::GpuSample {
            ts_ns: T0 + k as u64 * 2 * MS,
            device: 0,
            mem_used_bytes: used,
            mem_total_bytes: 80 * gib,
            process_mem: vec![(ENGINE, mine)],
            sm_util_pct: sm,
            mem_util_pct: Some(12 + k as u32),
            pcie_tx_kib_s: Some(1234),
            pcie_rx_kib_s: None,
            nvlink_tx_kib_s: nvlink,
            nvlink_rx_kib_s: nvlink.map(|v| v / 3),
        });
    }
    let (bytes, _) = trace_of(&sorted(recs));
    let s = checked(&bytes);
    let t = decode(&bytes);
    assert_eq!(counter_f64_series(&t, &s, names::KV_CACHE), vec![(T0, 25.0), (T0 + MS, 50.0)], "stats without a KV value add no point");
    let dev = s.track("GPU 0 memory used").unwrap();
    assert_eq!(s.track(names::SERVER).map(|g| g.uuid), dev.parent);
    let series = |uuid: u64| events(&t).filter(|(_, e)| e.track_uuid == Some(uuid)).map(|(ts, e)| (ts, e.counter_value.unwrap())).collect::<Vec<_>>();
    assert_eq!(series(dev.uuid), vec![(T0, gib as i64), (T0 + 2 * MS, 2 * gib as i64)]);
    let process = s.track("pid 4300 (pid 4300)").expect("the engine's process track");
    let mine = s.tracks.iter().find(|tr| tr.parent == Some(process.uuid) && tr.kind == "counter").expect("per-process GPU memory under its process");
    assert_eq!(series(mine.uuid), vec![(T0, gib as i64 / 2), (T0 + 2 * MS, gib as i64)]);
    assert_eq!(counter_series(&t, &s, "GPU 0 SM utilisation %"), vec![(T0, 70)]);
    assert_eq!(counter_series(&t, &s, "GPU 0 memory-controller utilisation %"), vec![(T0, 12), (T0 + 2 * MS, 13)]);
    assert_eq!(counter_series(&t, &s, "GPU 0 PCIe tx KiB/s"), vec![(T0, 1234), (T0 + 2 * MS, 1234)]);
    assert_eq!(counter_series(&t, &s, "GPU 0 NVLink tx KiB/s"), vec![(T0 + 2 * MS, 307_200)], "a sample without the figure adds no point");
    assert_eq!(counter_series(&t, &s, "GPU 0 NVLink rx KiB/s"), vec![(T0 + 2 * MS, 102_400)]);
    assert!(s.track("GPU 0 PCIe rx KiB/s").is_none(), "a figure NVML never gave has no track");
    for name in ["GPU 0 PCIe tx KiB/s", "GPU 0 NVLink rx KiB/s"] {
        assert_eq!(s.track(name).unwrap().parent, dev.parent, "{name} beside the GPU's memory");
    }
}

// ---- compact encoding: delta timestamps, a sequence per busy track ----

#[test]
fn timestamps_are_deltas_on_each_sequence_and_own_sequence_tracks_omit_their_uuid() {
    let mut w = TraceWriter::new(Vec::new(), 1_000_000).unwrap();
    let main = w.track("main", TrackOpts::default());
    let gpu = w.track("gpu", TrackOpts { own_sequence: true, ..TrackOpts::default() });
    w.begin(1_000_500, gpu, &Event::named("k")).unwrap();
    w.instant(1_000_600, main, &Event::named("i")).unwrap();
    w.end(1_000_700, gpu).unwrap();
    w.begin(1_000_800, gpu, &Event::named("k")).unwrap();
    w.end(1_001_000, gpu).unwrap();
    let (bytes, st) = w.finish().unwrap();
    assert_eq!(st.sequences, 2);
    let raw = check::decode(&bytes).unwrap();
    let on = |seq: u32| raw.packet.iter().filter(|p| p.trusted_packet_sequence_id == Some(seq) && matches!(p.data, Some(Data::TrackEvent(_)))).collect::<Vec<_>>();
    let gpu_ts: Vec<u64> = on(2).iter().map(|p| p.timestamp.unwrap()).collect();
    assert_eq!(gpu_ts, vec![0, 200, 100, 200], "deltas from the sequence's start at its first event");
    assert!(on(2).iter().all(|p| matches!(&p.data, Some(Data::TrackEvent(e)) if e.track_uuid.is_none())));
    assert_eq!(on(1).iter().map(|p| p.timestamp.unwrap()).collect::<Vec<_>>(), vec![600]);
    let first2 = raw.packet.iter().find(|p| p.trusted_packet_sequence_id == Some(2)).unwrap();
    assert_eq!(first2.sequence_flags, Some(proto::SEQ_INCREMENTAL_STATE_CLEARED));
    assert_eq!(first2.trace_packet_defaults.as_ref().and_then(|d| d.track_event_defaults.as_ref()).and_then(|d| d.track_uuid), Some(gpu.uuid()));
    // Resolved, every event is where and when it was written.
    let s = checked(&bytes);
    assert_eq!(s.track("gpu").unwrap().slices.get("k"), Some(&2));
    let flat: Vec<(u64, Option<u64>)> = events(&decode(&bytes)).map(|(ts, e)| (ts, e.track_uuid)).collect();
    let (g, m) = (Some(gpu.uuid()), Some(main.uuid()));
    assert_eq!(flat, vec![(1_000_500, g), (1_000_600, m), (1_000_700, g), (1_000_800, g), (1_001_000, g)]);
}

#[test]
fn writer_refuses_backwards_time_per_sequence_but_not_across_sequences() {
    let mut w = TraceWriter::new(Vec::new(), 0).unwrap();
    let a = w.track("a", TrackOpts { own_sequence: true, ..TrackOpts::default() });
    let b = w.track("b", TrackOpts { own_sequence: true, ..TrackOpts::default() });
    w.instant(100, a, &Event::named("x")).unwrap();
    w.instant(50, b, &Event::named("x")).unwrap();
    assert!(matches!(w.instant(99, a, &Event::named("x")), Err(PerfettoError::TimestampRegression { ts: 99, last: 100 })));
    let (bytes, _) = w.finish().unwrap();
    checked(&bytes);
}

#[test]
fn checker_rejects_undefined_sequence_clocks_and_events_without_any_track() {
    use proto::EventType::Instant;
    let mut first64 = first();
    first64.trace_packet_defaults = Some(proto::TracePacketDefaults { timestamp_clock_id: Some(64), track_event_defaults: None });
    assert!(violations(vec![first64.clone(), desc(1, None), ev(1, 1, Instant)]).contains("which no clock snapshot on this sequence defined"));
    let mut no_track = ev(1, 1, Instant);
    if let Some(Data::TrackEvent(te)) = &mut no_track.data {
        te.track_uuid = None;
    }
    assert!(violations(vec![first(), desc(1, None), no_track]).contains("no default track"));
    // A sequence clock with no builtin clock in its snapshot cannot be placed.
    first64.data = Some(Data::ClockSnapshot(proto::ClockSnapshot { clocks: vec![proto::Clock { clock_id: Some(64), timestamp: Some(5), is_incremental: Some(true) }], primary_trace_clock: None }));
    assert!(violations(vec![first64]).contains("no builtin clock"));
}

// ---- live: the record-driven part as records come, requests at the end ----

/// A `Write` whose bytes can be read while the writer still holds it.
#[derive(Clone, Default)]
struct Shared(std::rc::Rc<std::cell::RefCell<Vec<u8>>>);

impl std::io::Write for Shared {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.borrow_mut().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn live_recording() -> Vec<Record> {
    let (mut recs, ends) = served_request();
    recs.extend(two_chains());
    recs.push(Record::OffCpu { ts_ns: T0 + 3 * MS, tgid: 4242, tid: 4243, off_ns: T0 + MS, wake_ns: Some(T0 + 2 * MS), prev_state: 1 });
    recs.push(Record::Drops { ts_ns: T0 + 5 * MS, counters: vec![("kernel_ringbuf_full".into(), 0)] });
    recs.push(Record::Drops { ts_ns: ends[5], counters: vec![("kernel_ringbuf_full".into(), 4)] });
    sorted(recs)
}

#[test]
fn a_live_trace_is_valid_at_every_flush_and_ends_with_the_same_tracks_as_the_offline_one() {
    let recs = live_recording();
    let buf = Shared::default();
    let mut live = live::LiveTrace::new(buf.clone(), &meta()).unwrap();
    let mut seen_at_flush = Vec::new();
    for r in &recs {
        live.push(r).unwrap();
        if matches!(r, Record::Drops { .. }) {
            // What a reader sees now: whole packets, and a valid trace.
            let bytes = buf.0.borrow().clone();
            let s = checked(check::complete_packets(&bytes));
            seen_at_flush.push((s.slices, s.track(names::REQUESTS).is_some()));
        }
    }
    assert_eq!(seen_at_flush.len(), 2);
    assert!(seen_at_flush[1].0 > seen_at_flush[0].0, "the trace grows: {seen_at_flush:?}");
    assert!(seen_at_flush.iter().all(|(_, requests)| !requests), "requests come at the end");
    let analysis = analyse(&recs);
    let (_, st) = live.finish(&meta(), &analysis, None).unwrap();
    let bytes = buf.0.borrow().clone();
    assert_eq!(st.writer.bytes, bytes.len() as u64);
    let live_s = checked(&bytes);
    let (offline, ost) = trace_of(&recs);
    let off_s = checked(&offline);
    let lines = |s: &Summary| {
        let mut v: Vec<String> = s.render().lines().map(str::to_owned).collect();
        v.sort();
        v
    };
    assert_eq!(lines(&live_s), lines(&off_s), "same tracks and slices");
    assert_eq!((st.gpu_slices, st.steps, st.offcpu_slices), (ost.gpu_slices, ost.steps, ost.offcpu_slices));
    assert_eq!(live_s.flows, 6, "live: hop→request flows only");
    assert!(off_s.flows > live_s.flows);
}

#[test]
fn complete_packets_cuts_a_trace_at_its_last_whole_packet() {
    // Plain packets, and compressed batches of ~512 bytes of packets (a cut
    // batch is left out whole).
    for enc in [Encoding::PLAIN, Encoding { batch_bytes: 512, ..Encoding::COMPRESSED }] {
        let (bytes, st) = trace_with(&two_chains(), enc);
        let whole = check::check_bytes(&bytes).unwrap().packets;
        assert_eq!(whole, st.writer.packets);
        for cut in [1, 2, 7, bytes.len() / 2] {
            // Whole packets decode (slices may be left open by the cut).
            let n = check::decode(check::complete_packets(&bytes[..bytes.len() - cut])).unwrap().packet.len() as u64;
            assert!(n < whole && n > 0, "{enc:?} cut {cut}: {n} of {whole} packets");
        }
        assert_eq!(check::complete_packets(&bytes).len(), bytes.len());
    }
}

// ---- compressed_packets ----

fn trace_with(records: &[Record], enc: Encoding) -> (Vec<u8>, TraceStats) {
    let analysis = analyse(records);
    let m = meta();
    write_trace_with(Vec::new(), TraceInput { meta: &m, records, analysis: &analysis, read_error: None }, enc).expect("trace writes")
}

#[test]
fn compressed_traces_hold_exactly_the_packets_of_the_plain_trace() {
    let (recs, _) = served_request();
    let mut recs = recs;
    recs.extend(two_chains());
    let recs = sorted(recs);
    let (plain, pst) = trace_with(&recs, Encoding::PLAIN);
    let (packed, st) = trace_of(&recs);
    let (small, sst) = trace_with(&recs, Encoding { batch_bytes: 300, ..Encoding::COMPRESSED });
    let plain_t = check::decode(&plain).unwrap();
    assert_eq!((pst.writer.batches, pst.writer.bytes, pst.writer.raw_bytes), (0, plain.len() as u64, plain.len() as u64));
    for (bytes, st) in [(&packed, st), (&small, sst)] {
        assert_eq!(check::decode(bytes).unwrap(), plain_t, "same packets in the same order");
        assert_eq!((st.writer.bytes, st.writer.raw_bytes, st.writer.packets), (bytes.len() as u64, plain.len() as u64, pst.writer.packets));
        let s = checked(bytes);
        assert_eq!((s.batches, s.packets), (st.writer.batches, pst.writer.packets));
        assert_eq!(s.render(), checked(&plain).render());
    }
    assert_eq!(st.writer.batches, 1, "a small trace is one batch");
    // Batches of 300 bytes split sequences across batches: their interning,
    // defaults and incremental clocks carry over (the checker resolves them).
    assert!(sst.writer.batches >= plain.len() as u64 / 400, "{} batches for {} bytes", sst.writer.batches, plain.len());
    assert!(packed.len() * 2 < plain.len(), "compressed {} of {} bytes", packed.len(), plain.len());
}

#[test]
fn each_batch_is_one_outer_packet_holding_a_zlib_stream_of_trace_packets() {
    let (bytes, st) = trace_with(&two_chains(), Encoding { batch_bytes: 1024, ..Encoding::COMPRESSED });
    let outer = Trace::decode(&bytes[..]).unwrap();
    assert_eq!(outer.packet.len() as u64, st.writer.batches);
    assert!(st.writer.batches > 1);
    let mut inner = 0;
    for p in &outer.packet {
        let Some(Data::CompressedPackets(z)) = &p.data else { panic!("not a compressed batch: {p:?}") };
        assert_eq!(*p, proto::TracePacket { data: p.data.clone(), ..Default::default() }, "nothing else in the outer packet");
        // RFC 1950 header: deflate with a 32 KiB window, check bits, no dictionary.
        assert_eq!(z[0], 0x78);
        assert_eq!((z[0] as u16 * 256 + z[1] as u16) % 31, 0);
        assert_eq!(z[1] & 0x20, 0);
        let t = Trace::decode(&check::inflate(z).unwrap()[..]).unwrap();
        assert!(!t.packet.is_empty());
        inner += t.packet.len() as u64;
    }
    assert_eq!(inner, st.writer.packets);
}

#[test]
fn flush_writes_the_batch_so_far_and_full_batches_go_out_on_their_own() {
    let buf = Shared::default();
    let mut w = TraceWriter::with_encoding(buf.clone(), 0, Encoding { batch_bytes: 4096, ..Encoding::COMPRESSED }).unwrap();
    let a = w.track("a", TrackOpts::default());
    w.begin(1, a, &Event::named("x")).unwrap();
    w.end(2, a).unwrap();
    assert!(buf.0.borrow().is_empty(), "packets wait in the batch");
    w.flush().unwrap();
    let first = buf.0.borrow().clone();
    let s = checked(&first);
    assert_eq!((s.batches, s.slices), (1, 1));
    w.flush().unwrap();
    assert_eq!(buf.0.borrow().len(), first.len(), "an empty batch writes nothing");
    for i in 0..2000 {
        w.begin(10 + i * 10, a, &Event::named("x")).unwrap();
        w.end(15 + i * 10, a).unwrap();
    }
    let mid = w.stats();
    assert!(mid.batches >= 1 + mid.raw_bytes / 4096 - 1, "{mid:?}");
    // Memory: one batch (its limit plus a packet) and one outer packet.
    assert!(w.buffer_capacity() < 3 * (4096 + 512), "{}", w.buffer_capacity());
    let (_, st) = w.finish().unwrap();
    let bytes = buf.0.borrow().clone();
    assert_eq!(st.bytes, bytes.len() as u64);
    let s = checked(&bytes);
    assert_eq!((s.batches, s.slices), (st.batches, 2001));
    assert!(bytes.starts_with(&first));
}

#[test]
fn checker_refuses_batches_that_do_not_inflate_carry_other_fields_or_nest() {
    let (bytes, _) = trace_of(&two_chains());
    let mut outer = Trace::decode(&bytes[..]).unwrap();
    let why = |t: &Trace| match check::check(t) {
        Err(CheckError::Compressed { packet, why }) => format!("{packet}: {why}"),
        other => panic!("expected a compressed_packets error, got {other:?}"),
    };
    let mut extra = outer.clone();
    extra.packet[0].trusted_packet_sequence_id = Some(1);
    assert!(why(&extra).contains("carries other fields"), "{}", why(&extra));
    let mut corrupt = outer.clone();
    if let Some(Data::CompressedPackets(z)) = &mut corrupt.packet[0].data {
        let n = z.len();
        z[n - 1] ^= 0xff; // the Adler-32 checksum
    }
    assert!(why(&corrupt).contains("does not inflate"), "{}", why(&corrupt));
    assert!(check::decode(&corrupt.encode_to_vec()).is_err());
    // A batch holding a batch: hopscope never writes one.
    let nested = miniz_oxide::deflate::compress_to_vec_zlib(&bytes, 1);
    outer.packet.push(proto::TracePacket { data: Some(Data::CompressedPackets(nested)), ..Default::default() });
    assert!(why(&outer).contains("inside a compressed batch"), "{}", why(&outer));
}

#[test]
fn a_live_trace_skips_and_counts_late_records_instead_of_failing() {
    let buf = Shared::default();
    let mut live = live::LiveTrace::new(buf.clone(), &meta()).unwrap();
    let ipc = ConnKey { tgid: ENGINE, fd: 31, ino: 31 };
    let stats = |ts: u64, u: f64| Record::EngineStats { conn: ipc, ts_ns: ts, engine_index: Some(0), running: None, waiting: None, kv_cache_usage: Some(u), step_counter: None, prefix_cache_queries: None, prefix_cache_hits: None };
    let recs = [
        kernel(T0 + 10 * MS, MS, "a"),
        kernel(T0 + 10 * MS + MS / 2, MS, "late overlap"), // starts inside "a": overlap lane
        kernel(meta_start() - MS, 10, "before the trace"),  // skipped
        stats(T0 + 5 * MS, 0.5),
        stats(T0 + 4 * MS, 0.4), // older than the previous sample: skipped
        Record::OffCpu { ts_ns: T0 + 3 * MS, tgid: 4242, tid: 4242, off_ns: T0 + MS, wake_ns: None, prev_state: 1 },
        Record::OffCpu { ts_ns: T0 + 4 * MS, tgid: 4242, tid: 4242, off_ns: T0 + 2 * MS, wake_ns: None, prev_state: 1 }, // overlaps
    ];
    for r in &recs {
        live.push(r).unwrap();
    }
    let (_, st) = live.finish(&meta(), &Analysis::default(), None).unwrap();
    assert_eq!((st.gpu_slices, st.gpu_skipped, st.counter_values_skipped, st.offcpu_slices, st.offcpu_skipped), (2, 1, 1, 1, 1));
    let s = checked(&buf.0.borrow());
    assert_eq!(s.track("GPU 0 stream 7 (overlap 1)").map(|t| t.slices.len()), Some(1));
}

// ---- GPU attribution: CUPTI step ends, KV transfer, GPU shares ----

#[allow(clippy::too_many_arguments)]
pub(crate) fn gpu_copy(stream: u32, s: u64, e: u64, kind: u8, src: u8, dst: u8, bytes: u64) -> Record {
    Record::GpuMemcpy {
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
    }
}

const RESHAPE: &str = "_ZN4vllm30reshape_and_cache_flash_kernelIN3c108BFloat16ES2_LNS_18Fp8KVCacheDataTypeE0EEEvPKT_S7_PT0_S9_PKllllliiPKfSD_";

/// One streamed request (4 content chunks from +5 ms) served by an engine
/// whose steps (built at +4, +6, +8, +10 ms) each end on the GPU the way
/// vLLM's model runner does (docs/attribution.md): `reshape_and_cache`
/// (one block per new token: 40 for the prefill, then 1) and a gemm on
/// stream 7, the sampled ids copied to pinned memory (64 bytes) and an
/// event synchronize returning 0.3 ms before the step's output is built.
/// Its KV (1 MiB, pinned host → device, stream 9) is onloaded at
/// +1.5–2.5 ms: submitted at +1 ms, stamped QUEUED at +1.2 ms and SCHEDULED
/// at +2 ms, so half of it while queued, half in its prefill.
pub(crate) fn gpu_served_request() -> Vec<Record> {
    use crate::correlate::gpu::{COPY_DTOH, COPY_HTOD, MEM_PINNED};
    use crate::event::Dir;
    use crate::model::{EngineEvent, EngineOutput};
    const DEVICE: u8 = 3;
    let id = "chatcmpl-5-0";
    let mut recs = exchange(conn(5), 0, T0, 4, "s1");
    let mut engine = engine_steps(id, T0 + MS, &[]);
    let out = ConnKey { tgid: ENGINE, fd: 31, ino: 31 };
    for (k, b) in [4, 6, 8, 10].into_iter().map(|m| T0 + m * MS).enumerate() {
        let events = if k == 0 { vec![EngineEvent { kind: 1, timestamp_s: (T0 + 1_200_000) as f64 / 1e9 }, EngineEvent { kind: 2, timestamp_s: (T0 + 2 * MS) as f64 / 1e9 }] } else { vec![] };
        engine.push(Record::EngineOutputs {
            conn: out,
            ts_ns: b + 50_000,
            tid: ENGINE,
            dir: Dir::Out,
            engine_index: Some(0),
            timestamp_s: Some(b as f64 / 1e9),
            outputs: vec![EngineOutput { request_id: format!("{id}-0123abcd"), new_tokens: 1, finish_reason: None, events, prefill: None }],
            outputs_total: Some(1),
            finished_requests: vec![],
            truncated: false,
        });
        let mut reshape = kernel(b - 1_500_000, 500_000, RESHAPE);
        if let Record::GpuKernel { grid, .. } = &mut reshape {
            grid[0] = if k == 0 { 40 } else { 1 };
        }
        recs.extend([
            reshape,
            kernel(b - MS, 500_000, "gemm"),
            gpu_copy(7, b - 450_000, b - 400_000, COPY_DTOH, DEVICE, MEM_PINNED, 64),
            Record::GpuSync { ts_ns: b - 1_400_000, end_ns: b - 300_000, pid: ENGINE, sync_type: 1, context: 1, stream: None, correlation_id: 3, cuda_event: Some(4) },
        ]);
    }
    recs.extend(engine);
    recs.push(gpu_copy(9, T0 + 1_500_000, T0 + 2_500_000, COPY_HTOD, MEM_PINNED, DEVICE, 1 << 20));
    sorted(recs)
}

fn arg_f64(e: &proto::TrackEvent, name: &str) -> Option<f64> {
    e.debug_annotations.iter().find(|d| d.name.as_deref() == Some(name)).and_then(|d| d.double_value)
}

fn slices_named<'a>(t: &'a Trace, name: &'a str) -> impl Iterator<Item = (u64, &'a proto::TrackEvent)> + 'a {
    events(t).filter(move |(_, e)| e.name.as_deref() == Some(name) && e.r#type == Some(proto::EventType::SliceBegin as i32))
}

#[test]
fn kv_transfer_nests_in_queue_and_prefill_and_request_args_carry_the_reports_figures() {
    let recs = gpu_served_request();
    let analysis = analyse(&recs);
    let r = &analysis.requests[0];
    let g = r.gpu.expect("GPU share");
    assert_eq!(g.kv_spans(), &[(T0 + 1_500_000, T0 + 2_500_000)]);
    let m = meta();
    let (bytes, st) = write_trace(Vec::new(), TraceInput { meta: &m, records: &recs, analysis: &analysis, read_error: None }).unwrap();
    let s = checked(&bytes);
    assert_eq!(st.kv_slices, 2, "one part while queued, one in the prefill");
    let track = s.track("chatcmpl-5-0").expect("request track");
    assert_eq!(track.slices.get("kv transfer"), Some(&2));
    assert_eq!(track.max_depth, 3, "request › queue/prefill › kv transfer");
    let t = decode(&bytes);
    let kv: Vec<(u64, f64)> = slices_named(&t, "kv transfer").map(|(ts, e)| (ts, arg_f64(e, "kv_transfer_ms").unwrap())).collect();
    assert_eq!(kv, vec![(T0 + 1_500_000, 0.5), (T0 + 2 * MS, 0.5)]);

    // The report's figures, on the request slice and on each phase slice.
    let out = crate::sink::report::request_out(r);
    assert_eq!(out.phases_ms.kv_transfer, Some(1.0));
    let (_, req) = slices_named(&t, "chatcmpl-5-0").next().unwrap();
    assert_eq!(arg_f64(req, "phases_ms.kv_transfer"), Some(1.0));
    assert_eq!(arg_f64(req, "phases_ms.queue"), Some(0.5), "1 ms queued less the 0.5 ms of KV in it");
    assert_eq!(arg_f64(req, "phases_ms.prefill"), Some(1.5), "2 ms less 0.5 ms of KV");
    assert_eq!(arg_f64(req, "phases_ms.decode"), out.phases_ms.decode);
    assert_eq!(arg_f64(req, "gpu_kv_ms"), Some(1.0), "the copy's GPU time, all its own");
    // Step 0's GPU time: the KV copy and the two kernels back to back
    // (1.5–3.5 ms), then the ids copy (50 µs).
    assert_eq!(arg_f64(req, "gpu_prefill_ms"), Some(2.05));
    assert_eq!(arg_f64(req, "gpu_decode_ms"), Some(3.15), "three 1.05 ms decode steps");
    assert_eq!(arg_f64(req, "gpu_decode_ms"), out.gpu_ms.decode);
    let c = out.compute_ms.as_ref().unwrap();
    assert_eq!((c.prefill, c.decode, c.steps), (Some(2.05), Some(3.15), 4));
    assert_eq!(arg_f64(req, "compute_ms"), Some(c.prefill.unwrap() + c.decode.unwrap()));
    assert_eq!(arg_f64(req, "interference_ms"), out.interference_ms);
    assert!(out.interference_ms.is_some());
    let source = req.debug_annotations.iter().find(|d| d.name.as_deref() == Some("compute_source")).expect("compute_source");
    assert_eq!(source.string_value.as_deref(), Some("cupti"));
    let arg_str = |name: &str| req.debug_annotations.iter().find(|d| d.name.as_deref() == Some(name)).and_then(|d| d.string_value.clone());
    assert!(out.submit_source.is_some() && out.scheduled_source.is_some());
    assert_eq!(arg_str("submit_source").as_deref(), out.submit_source.as_deref(), "the report's submit_source");
    assert_eq!(arg_str("scheduled_source").as_deref(), out.scheduled_source.as_deref(), "the report's scheduled_source");
    // The scheduler's 0.8 ms (QUEUED → SCHEDULED) hold the KV carved out of the queue.
    let near = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() < 1e-6);
    assert!(near(out.scheduler_queue_ms, 0.8), "{:?}", out.scheduler_queue_ms);
    assert_eq!(arg_f64(req, "scheduler_queue_ms"), out.scheduler_queue_ms);
    assert!(out.last_output_ms.is_some());
    assert_eq!(arg_f64(req, "last_output_ms"), out.last_output_ms);
    // What the engine made before the first content: the report's, on the
    // request slice and (the time) on the first-output slice.
    assert!(out.first_output_held_ms.is_some() && out.tokens_before_first_content.is_some());
    assert_eq!(arg_f64(req, "first_output_held_ms"), out.first_output_held_ms);
    let tokens = req.debug_annotations.iter().find(|d| d.name.as_deref() == Some("tokens_before_first_content")).and_then(|d| d.uint_value);
    assert_eq!(tokens, out.tokens_before_first_content);
    let empty = req.debug_annotations.iter().find(|d| d.name.as_deref() == Some("empty_chunks_before_content")).and_then(|d| d.uint_value);
    assert!(out.empty_chunks_before_content.is_some(), "a chat stream");
    assert_eq!(empty, out.empty_chunks_before_content.map(u64::from));
    let (_, fo) = slices_named(&t, "first output").next().unwrap();
    assert_eq!(arg_f64(fo, "first_output_held_ms"), out.first_output_held_ms);
    let (_, q) = slices_named(&t, "queue").next().unwrap();
    assert_eq!(arg_f64(q, "queue_ms"), Some(0.5));
    assert_eq!(arg_f64(q, "scheduler_queue_ms"), out.scheduler_queue_ms);
    let (_, p) = slices_named(&t, "prefill").next().unwrap();
    assert_eq!((arg_f64(p, "prefill_ms"), arg_f64(p, "gpu_prefill_ms")), (Some(1.5), Some(2.05)));
    let (_, d) = slices_named(&t, "decode").next().unwrap();
    assert_eq!((arg_f64(d, "gpu_decode_ms"), arg_f64(d, "interference_ms")), (out.gpu_ms.decode, out.interference_ms));
    assert_eq!(arg_f64(d, "last_output_ms"), out.last_output_ms);
    assert_eq!((arg_str("structured_output"), arg_str("structured_output_backend")), (None, None), "it asked for no structured output");
    // Stamped, and nobody went past it: no pass args.
    assert_eq!((out.scheduler_passed_over_by, out.scheduler_passed_over_ms), (Some(0), Some(0.0)));
    assert_eq!(arg_f64(req, "scheduler_passed_over_ms"), None);
}

/// A request that asked for structured output names the constraint's kind
/// and backend among its slice's args, as the report does.
#[test]
fn a_structured_output_requests_slice_names_its_constraint() {
    use crate::event::Dir;
    let mut recs = gpu_served_request();
    let at = recs.iter().find_map(|r| if let Record::EngineRequest { ts_ns, .. } = r { Some(*ts_ns) } else { None }).expect("the ADD");
    recs.push(Record::EngineStructuredOutput { conn: ConnKey { tgid: 4242, fd: 30, ino: 30 }, ts_ns: at, dir: Dir::Out, request_id: "chatcmpl-5-0-0123abcd".into(), kind: "json".into(), backend: Some("xgrammar".into()) });
    let recs = sorted(recs);
    let analysis = analyse(&recs);
    let out = crate::sink::report::request_out(&analysis.requests[0]);
    assert_eq!((out.structured_output.as_deref(), out.structured_output_backend.as_deref()), (Some("json"), Some("xgrammar")));
    let m = meta();
    let (bytes, _) = write_trace(Vec::new(), TraceInput { meta: &m, records: &recs, analysis: &analysis, read_error: None }).unwrap();
    let t = decode(&bytes);
    let (_, req) = slices_named(&t, "chatcmpl-5-0").next().expect("the request slice");
    let arg_str = |name: &str| req.debug_annotations.iter().find(|d| d.name.as_deref() == Some(name)).and_then(|d| d.string_value.clone());
    assert_eq!((arg_str("structured_output").as_deref(), arg_str("structured_output_backend").as_deref()), (Some("json"), Some("xgrammar")));
}

#[test]
fn gpu_steps_get_a_track_engine_steps_flow_to_them_and_they_flow_to_their_kernels() {
    let recs = gpu_served_request();
    let (bytes, st) = trace_of(&recs);
    let s = checked(&bytes);
    assert_eq!((st.gpu_steps, st.gpu_steps_skipped), (4, 0));
    let track = s.track(names::GPU_STEPS).expect("GPU steps track");
    assert_eq!(track.slices.get(names::GPU_STEP), Some(&4));
    assert_eq!(st.gpu_step_flows, 4, "each engine step to its matched GPU step");
    assert_eq!(st.kernel_flows, 1 + 3 * 2, "each GPU step to its end copy and, after the first, to the first kernel after the previous end copy; not by the time rule");
    let t = decode(&bytes);
    let steps: Vec<(u64, u64, Option<f64>)> = slices_named(&t, names::GPU_STEP)
        .map(|(ts, e)| (ts, e.debug_annotations.iter().find(|d| d.name.as_deref() == Some("tokens")).and_then(|d| d.uint_value).unwrap(), arg_f64(e, "gpu_ms")))
        .collect();
    assert_eq!(steps[0], (T0 + 1_500_000, 40, Some(2.05)), "starts with its KV copy; 40 prefill tokens");
    assert_eq!(steps[1], (T0 + 6 * MS - 1_500_000, 1, Some(1.05)));
    let ends = flow_ends(&t);
    assert!(ends.values().all(|v| v.len() == 2), "every flow has exactly two ends");
    let mut want: Vec<(String, String, Option<u64>)> = Vec::new();
    for k in 0..4u64 {
        if k > 0 {
            want.push((RESHAPE.to_owned(), format!("gpu {k}"), None));
        }
        want.push(("memcpy DtoH".to_owned(), format!("gpu {k}"), None));
        want.push((names::STEP.to_owned(), format!("gpu {k}"), Some(k)));
    }
    want.sort();
    assert_eq!(gpu_step_links(&bytes), want);
    // The live trace draws the same GPU steps and KV slices at its stop.
    let buf = Shared::default();
    let mut live = live::LiveTrace::new(buf.clone(), &meta()).unwrap();
    for r in &recs {
        live.push(r).unwrap();
    }
    let analysis = analyse(&recs);
    let (_, lst) = live.finish(&meta(), &analysis, None).unwrap();
    let ls = checked(&buf.0.borrow());
    assert_eq!((lst.gpu_steps, lst.kv_slices), (4, 2));
    assert_eq!(ls.track(names::GPU_STEPS).unwrap().slices.get(names::GPU_STEP), Some(&4));
    assert_eq!(ls.track("chatcmpl-5-0").unwrap().slices.get("kv transfer"), Some(&2));
    assert_eq!(gpu_step_links(&buf.0.borrow()), want, "and their flows, named at the stop");
    // (Its steps' request→step ids stay unlinked: this finish draws requests from the analysis.)
    assert_eq!((lst.kernel_flows, lst.gpu_step_flows, lst.flows_unlinked), (st.kernel_flows, st.gpu_step_flows, ls.flows_unlinked));
    // Finished by re-reading the recording (`record --perfetto`'s way).
    let buf = Shared::default();
    let mut live = live::LiveTrace::new(buf.clone(), &meta()).unwrap();
    for r in &recs {
        live.push(r).unwrap();
    }
    let file = recording_bytes(&recs);
    let mut reader = crate::recording::Reader::new(&file[..]).unwrap();
    let (_, lst, _) = live.finish_streamed(&mut reader, Config::default()).unwrap();
    assert_eq!(gpu_step_links(&buf.0.borrow()), want);
    assert_eq!((lst.kernel_flows, lst.gpu_step_flows, lst.flows_unlinked, checked(&buf.0.borrow()).flows_unlinked), (st.kernel_flows, st.gpu_step_flows, 0, 0));
}

/// The flows of a trace's GPU steps: (the other slice's name, "gpu N" (the
/// GPU step's `step` arg), the other slice's `step` arg), sorted.
fn gpu_step_links(bytes: &[u8]) -> Vec<(String, String, Option<u64>)> {
    let t = decode(bytes);
    let mut links: Vec<(String, String, Option<u64>)> = flow_ends(&t)
        .values()
        .filter(|v| v.iter().any(|e| e.0 == names::GPU_STEP))
        .map(|v| {
            assert_eq!(v.len(), 2, "a GPU step's flow has two ends: {v:?}");
            let gs = v.iter().find(|e| e.0 == names::GPU_STEP).unwrap();
            let other = v.iter().find(|e| e.0 != names::GPU_STEP).unwrap();
            (other.0.clone(), format!("gpu {}", gs.1.unwrap()), other.1)
        })
        .collect();
    links.sort();
    links
}

/// The streamed trace draws GPU steps as the correlator decides them (a
/// GPU recording's steps would otherwise be held to its end): the same
/// slices, numbers, arguments and flows as the whole layout.
#[test]
fn a_streamed_trace_draws_the_whole_layouts_gpu_steps_with_their_numbers_and_flows() {
    // A later exchange: the pass draws the steps at one of its ticks, not at the end.
    let mut recs = gpu_served_request();
    recs.extend(exchange(conn(9), 0, T0 + 5_000 * MS, 2, "later"));
    let recs = sorted(recs);
    let (offline, ost) = trace_of(&recs);
    let file = recording_bytes(&recs);
    let mut reader = crate::recording::Reader::new(&file[..]).unwrap();
    let (bytes, st, err) = live::write_trace_streamed(Vec::new(), &mut reader, Config::default(), Encoding::default()).unwrap();
    assert_eq!(err, None);
    assert_eq!((st.gpu_steps, st.gpu_steps_skipped), (ost.gpu_steps, 0));
    assert_eq!(st.gpu_steps, 4);
    let args = |bytes: &[u8]| -> Vec<(u64, Vec<(String, String)>)> {
        let t = decode(bytes);
        slices_named(&t, names::GPU_STEP)
            .map(|(ts, e)| (ts, e.debug_annotations.iter().map(|d| (d.name.clone().unwrap_or_default(), format!("{:?}{:?}{:?}", d.uint_value, d.double_value, d.string_value))).collect()))
            .collect()
    };
    let (got, want) = (args(&bytes), args(&offline));
    assert_eq!(got, want);
    let steps: Vec<&str> = got.iter().flat_map(|(_, a)| a.iter().filter(|(n, _)| n == "step").map(|(_, v)| v.as_str())).collect();
    assert_eq!(steps, ["Some(0)NoneNone", "Some(1)NoneNone", "Some(2)NoneNone", "Some(3)NoneNone"]);
    // Engine step → GPU step → first kernel and end copy, as the whole layout draws them.
    let links = gpu_step_links(&bytes);
    assert_eq!(links.len(), 4 + 7);
    assert_eq!(links, gpu_step_links(&offline));
    assert_eq!((st.gpu_step_flows, st.kernel_flows), (ost.gpu_step_flows, ost.kernel_flows));
    assert_eq!((st.flows_unlinked, st.flows_not_streamed), (0, 0), "every id named, nothing left out");
    let s = checked(&bytes);
    assert_eq!((s.flows, s.flows_unlinked), (checked(&offline).flows, 0));
}

/// Streams `recs` through `hopscope trace`'s streamed layout.
fn streamed_trace(recs: &[Record]) -> (Vec<u8>, TraceStats) {
    let file = recording_bytes(recs);
    let mut reader = crate::recording::Reader::new(&file[..]).unwrap();
    let (bytes, st, err) = live::write_trace_streamed(Vec::new(), &mut reader, Config::default(), Encoding::default()).unwrap();
    assert_eq!(err, None);
    (bytes, st)
}

#[test]
fn gpu_step_flows_reach_every_rank_and_streamed_ones_declare_the_ids_of_a_copy_that_ended_no_step() {
    use crate::correlate::gpu::{COPY_DTOH, MEM_PINNED};
    const WORKER: u32 = ENGINE + 1;
    let mut recs = gpu_served_request();
    let on_worker = |mut r: Record| {
        match &mut r {
            Record::GpuKernel { pid, device, .. } | Record::GpuMemcpy { pid, device, .. } => {
                *pid = WORKER;
                *device = 1;
            }
            _ => unreachable!(),
        }
        r
    };
    // A tensor-parallel worker runs each step too, on its own GPU: a
    // kernel, its end copy and the sync that waits for it.
    for b in [4, 6, 8, 10].map(|m| T0 + m * MS) {
        recs.push(on_worker(kernel(b - 1_200_000, 400_000, "allreduce")));
        recs.push(on_worker(gpu_copy(7, b - 440_000, b - 410_000, COPY_DTOH, 3, MEM_PINNED, 64)));
        recs.push(Record::GpuSync { ts_ns: b - 1_300_000, end_ns: b - 320_000, pid: WORKER, sync_type: 1, context: 1, stream: None, correlation_id: 3, cuda_event: Some(5) });
    }
    // Step 2 of the engine: a small pinned copy between its two kernels
    // that no sync waits for. It may have ended a step, so a streamed trace
    // marks it and the gemm after it; no GPU step names them.
    recs.push(gpu_copy(8, T0 + 8 * MS - 1_050_000, T0 + 8 * MS - 1_020_000, COPY_DTOH, 3, MEM_PINNED, 64));
    let recs = sorted(recs);
    let (whole, wst) = trace_of(&recs);
    let (streamed, sst) = streamed_trace(&recs);
    assert_eq!((wst.gpu_steps, sst.gpu_steps), (4, 4));
    let links = gpu_step_links(&whole);
    let per_step = |k: u64| links.iter().filter(|l| l.1 == format!("gpu {k}")).map(|l| l.0.as_str()).collect::<Vec<_>>();
    assert_eq!(per_step(0), ["memcpy DtoH", "memcpy DtoH", "step"], "the first step: each rank's end copy");
    assert_eq!(per_step(2), [RESHAPE, "allreduce", "memcpy DtoH", "memcpy DtoH", "step"], "each rank's first kernel and end copy");
    assert_eq!(links, gpu_step_links(&streamed), "the streamed trace draws the same");
    assert_eq!((sst.kernel_flows, sst.gpu_step_flows), (wst.kernel_flows, wst.gpu_step_flows));
    assert_eq!(wst.kernel_flows, 2 + 3 * 4);
    // The lone copy's id and the gemm's after it: declared, and counted so by the checker.
    assert_eq!((wst.flows_unlinked, sst.flows_unlinked), (0, 2));
    assert_eq!(meta_arg(&streamed, "trace.flows_unlinked"), Some(2));
    assert_eq!(checked(&streamed).flows_unlinked, 2);
    assert_eq!(checked(&streamed).flows, checked(&whole).flows);
}

/// A GPU step of one rank, `pid`, busy all of [start, end], of `engine`.
fn one_rank_gpu_step(engine: Option<u32>, pid: u32, start: u64, end: u64) -> crate::correlate::gpu::GpuStep {
    use crate::correlate::gpu::{GpuStep, RankStep};
    GpuStep {
        engine,
        start_ns: start,
        gpu_end_ns: end - 10,
        end_ns: end,
        gpu_ns: end - start,
        tokens: None,
        ranks: vec![RankStep { pid, device: 0, index: 0, start_ns: start, gpu_end_ns: end - 10, end_ns: end, busy_ns: 0, kernel_ns: 0, kernels: 0, graph_kernels: 0, streams: 1, tokens: None, copies: vec![], by_kernel: vec![] }],
    }
}

#[test]
fn gpu_steps_that_overlap_go_to_a_second_lane() {
    let step = |start: u64, end: u64| one_rank_gpu_step(None, ENGINE, start, end);
    // Async scheduling: step 1 starts before the host's wait for step 0 returned.
    let steps = [step(T0, T0 + 3 * MS), step(T0 + 2 * MS, T0 + 5 * MS), step(T0 + 4 * MS, T0 + 6 * MS)];
    assert_eq!(raw::gpu_step_lanes(&steps, T0 - MS).iter().map(|p| p.map(|x| x.0)).collect::<Vec<_>>(), vec![Some(0), Some(1), Some(0)]);
    let analysis = Analysis { gpu_steps: steps.to_vec(), ..Analysis::default() };
    let m = meta();
    let (bytes, st) = write_trace(Vec::new(), TraceInput { meta: &m, records: &[], analysis: &analysis, read_error: None }).unwrap();
    let s = checked(&bytes);
    assert_eq!((st.gpu_steps, st.gpu_steps_skipped), (3, 0));
    assert_eq!(s.track(names::GPU_STEPS).unwrap().slices.get(names::GPU_STEP), Some(&2));
    assert_eq!(s.track("GPU steps (overlap 1)").unwrap().slices.get(names::GPU_STEP), Some(&1));
}

#[test]
fn each_data_parallel_engines_gpu_steps_get_their_own_tracks_and_none_is_skipped() {
    let step = |engine: u32, start: u64, end: u64| one_rank_gpu_step(Some(engine), engine, start, end);
    // Two engines stepping on their own clocks, 1 ms apart: the correlator
    // hands out engine 200's second step before engine 100's (which started
    // earlier), and engine 200's steps overlap engine 100's.
    let steps = [step(100, T0, T0 + 3 * MS), step(200, T0 + MS, T0 + 4 * MS), step(200, T0 + 4 * MS, T0 + 7 * MS), step(100, T0 + 3 * MS, T0 + 6 * MS)];
    let placed: Vec<Option<u32>> = raw::gpu_step_lanes(&steps, T0 - MS).iter().map(|p| p.map(|x| x.0)).collect();
    assert_eq!(placed, vec![Some(0), Some(raw::GPU_LANES), Some(raw::GPU_LANES), Some(0)]);
    let analysis = Analysis { gpu_steps: steps.to_vec(), ..Analysis::default() };
    let m = meta();
    let (bytes, st) = write_trace(Vec::new(), TraceInput { meta: &m, records: &[], analysis: &analysis, read_error: None }).unwrap();
    let s = checked(&bytes);
    assert_eq!((st.gpu_steps, st.gpu_steps_skipped), (4, 0));
    assert_eq!(s.track(names::GPU_STEPS).unwrap().slices.get(names::GPU_STEP), Some(&2));
    assert_eq!(s.track("GPU steps (engine 200)").unwrap().slices.get(names::GPU_STEP), Some(&2));
    assert!(s.tracks.iter().all(|t| !t.name.contains("overlap")), "no engine's steps overlap its own");
    let mut lanes = raw::GpuStepLanes::default();
    for g in &steps {
        lanes.place(g, T0);
    }
    let names: Vec<String> = [0, 1, raw::GPU_LANES, raw::GPU_LANES + 2].map(|l| lanes.track_name(l)).into();
    assert_eq!(names, ["GPU steps", "GPU steps (overlap 1)", "GPU steps (engine 200)", "GPU steps (engine 200, overlap 2)"]);
}

#[test]
fn a_decode_slowed_by_a_neighbours_prefill_names_it_in_the_decode_and_request_args() {
    use crate::event::Dir;
    use crate::model::EngineOutput;
    // A decodes in 2 ms steps; B's prefill lands in A's step at +20 ms,
    // which takes 10 ms: A loses 8 ms to B.
    let (a, b) = ("chatcmpl-5-0", "chatcmpl-6-0");
    let mut recs = exchange(conn(5), 0, T0, 12, "s1");
    recs.extend(exchange(conn(6), 0, T0 + 9 * MS, 2, "s2"));
    recs.extend(engine_steps(a, T0 + MS, &[]));
    recs.extend(engine_steps(b, T0 + 10 * MS, &[]));
    let out = ConnKey { tgid: ENGINE, fd: 31, ino: 31 };
    let step = |built: u64, members: &[&str]| Record::EngineOutputs {
        conn: out,
        ts_ns: built + 50_000,
        tid: ENGINE,
        dir: Dir::Out,
        engine_index: Some(0),
        timestamp_s: Some(built as f64 / 1e9),
        outputs: members.iter().map(|id| EngineOutput { request_id: format!("{id}-0123abcd"), new_tokens: 1, finish_reason: None, events: vec![], prefill: None }).collect(),
        outputs_total: Some(members.len() as u64),
        finished_requests: vec![],
        truncated: false,
    };
    for m in [4, 6, 8, 10] {
        recs.push(step(T0 + m * MS, &[a]));
    }
    recs.push(step(T0 + 20 * MS, &[a, b]));
    recs.push(step(T0 + 22 * MS, &[a, b]));
    let recs = sorted(recs);
    let analysis = analyse(&recs);
    let ra = analysis.requests.iter().find(|r| r.id == a).unwrap();
    let out = crate::sink::report::request_out(ra);
    assert_eq!(out.interference_ms, Some(8.0));
    assert_eq!(out.interference_from.len(), 1);
    let m = meta();
    let (bytes, _) = write_trace(Vec::new(), TraceInput { meta: &m, records: &recs, analysis: &analysis, read_error: None }).unwrap();
    checked(&bytes);
    let t = decode(&bytes);
    let from = |e: &proto::TrackEvent| e.debug_annotations.iter().find(|d| d.name.as_deref() == Some("interference_from")).and_then(|d| d.string_value.clone());
    let (_, req) = slices_named(&t, a).next().unwrap();
    assert_eq!((arg_f64(req, "interference_ms"), from(req)), (Some(8.0), Some(out.interference_from[0].clone())));
    let decodes: Vec<(Option<f64>, Option<String>)> = slices_named(&t, "decode").map(|(_, e)| (arg_f64(e, "interference_ms"), from(e))).collect();
    // B's chunks were written before its engine first token here, so its
    // decode has no duration and is not drawn: only A's decode slice.
    assert_eq!(decodes, vec![(Some(8.0), Some(out.interference_from[0].clone()))]);
}

/// Data parallelism: two engines (DP ranks 0 and 1, each its own process)
/// step every 2 ms, 1 ms out of phase, their outputs interleaved. Each
/// engine's steps are drawn on a track of their own, timed from that
/// engine's previous step; none is left out.
#[test]
fn each_data_parallel_engines_steps_are_drawn_on_their_own_track_from_its_own_previous_step() {
    let mut recs = exchange(conn(5), 0, T0, 6, "s1");
    recs.extend(exchange(conn(6), 0, T0, 6, "s2"));
    let steps = |from: u64| (0..6).map(|k| (from + k * 2 * MS, 1)).collect::<Vec<_>>();
    recs.extend(engine_steps("chatcmpl-5-0", T0 + MS, &steps(T0 + 4 * MS)));
    for mut r in engine_steps("chatcmpl-6-0", T0 + MS, &steps(T0 + 5 * MS)) {
        if let Record::EngineOutputs { engine_index, conn, .. } = &mut r {
            *engine_index = Some(1);
            conn.tgid = ENGINE + 1;
        }
        recs.push(r);
    }
    let recs = sorted(recs);
    let (whole, wst) = trace_of(&recs);
    let (streamed, sst) = streamed_trace(&recs);
    for (bytes, st) in [(&whole, wst), (&streamed, sst)] {
        assert_eq!((st.steps, st.steps_skipped), (12, 0));
        let s = checked(bytes);
        // The first step of each is an instant (nothing before it); the
        // other five are 2 ms slices.
        for name in [names::STEPS.to_owned(), format!("{} (DP rank 1)", names::STEPS)] {
            assert_eq!(s.track(&name).unwrap_or_else(|| panic!("{name}")).slices.get(names::STEP), Some(&5), "{name}");
        }
        let t = decode(bytes);
        let mut slices: Vec<u64> = slices_named(&t, names::STEP).map(|(ts, _)| ts).collect();
        slices.sort_unstable();
        let want: Vec<u64> = (0..5).flat_map(|k| [T0 + 4 * MS + k * 2 * MS, T0 + 5 * MS + k * 2 * MS]).collect();
        assert_eq!(slices, want, "each slice starts at its own engine's previous step end");
    }
}

/// `records` as a recording file's bytes.
fn recording_bytes(records: &[Record]) -> Vec<u8> {
    let mut w = crate::recording::Writer::new(Vec::new(), &meta()).unwrap();
    for r in records {
        w.push(r).unwrap();
    }
    w.finish(records.last().map_or(T0, Record::ts_ns)).unwrap()
}

fn sorted_lines(s: &Summary) -> Vec<String> {
    let mut v: Vec<String> = s.render().lines().map(str::to_owned).collect();
    v.sort();
    v
}

/// The request→step flows of a trace: (the request's track, its phase
/// slice, the step's `step` arg), sorted.
fn request_step_links(bytes: &[u8]) -> Vec<(String, String, u64)> {
    let s = checked(bytes);
    let t = decode(bytes);
    let track_of: HashMap<u64, String> = s.tracks.iter().map(|t| (t.uuid, t.name.clone())).collect();
    let step_arg = |e: &proto::TrackEvent| e.debug_annotations.iter().find(|d| d.name.as_deref() == Some("step")).and_then(|d| d.uint_value);
    let mut ends: HashMap<u64, Vec<&proto::TrackEvent>> = HashMap::new();
    for (_, e) in events(&t) {
        for id in e.flow_ids.iter().chain(&e.terminating_flow_ids) {
            ends.entry(*id).or_default().push(e);
        }
    }
    let mut links: Vec<(String, String, u64)> = ends
        .values()
        .filter_map(|v| {
            let phase = v.iter().find(|e| matches!(e.name.as_deref(), Some("prefill" | "decode")))?;
            let step = v.iter().find(|e| e.name.as_deref() == Some(names::STEP))?;
            Some((track_of[&phase.track_uuid.unwrap()].clone(), phase.name.clone().unwrap(), step_arg(step).unwrap()))
        })
        .collect();
    links.sort();
    links
}

fn meta_arg(bytes: &[u8], name: &str) -> Option<u64> {
    let t = decode(bytes);
    let ev = events(&t).find(|(_, e)| e.name.as_deref() == Some(names::META_EVENT)).expect("metadata instant").1;
    ev.debug_annotations.iter().find(|d| d.name.as_deref() == Some(name)).and_then(|d| d.uint_value)
}

#[test]
fn a_streamed_trace_draws_the_tracks_slices_and_request_step_flows_of_the_whole_layout() {
    let recs = live_recording();
    let file = recording_bytes(&recs);
    let mut reader = crate::recording::Reader::new(&file[..]).unwrap();
    let (bytes, st, err) = live::write_trace_streamed(Vec::new(), &mut reader, Config::default(), Encoding::default()).unwrap();
    assert_eq!(err, None);
    let s = checked(&bytes);
    let (offline, ost) = trace_of(&recs);
    let off_s = checked(&offline);
    assert_eq!(sorted_lines(&s), sorted_lines(&off_s), "same tracks and slices");
    assert_eq!((st.requests, st.chains, st.chain_tracks), (ost.requests, ost.chains, ost.chain_tracks));
    assert_eq!((st.requests, st.chains, st.chain_tracks), (6, 2, 4));
    assert_eq!((st.gpu_slices, st.steps, st.offcpu_slices, st.kv_slices), (ost.gpu_slices, ost.steps, ost.offcpu_slices, ost.kv_slices));
    // The same request→step arrows, counted alike.
    let links = request_step_links(&bytes);
    assert_eq!(links, request_step_links(&offline));
    assert_eq!(links.len(), 2 + 5, "the served request's prefill to steps 0 and 1, decode to 2..=5 and 13");
    assert_eq!((st.step_flows, st.flows_capped, st.flows_unmapped, st.flows_unlinked), (ost.step_flows, ost.flows_capped, ost.flows_unmapped, 0));
    assert_eq!(s.flows, 6 + 7, "hop→request and request→step flows");
    // No step→kernel flows: the 13 steps that ran kernels are counted, and the metadata says so.
    assert_eq!(ost.kernel_flows, 13 * 2);
    assert_eq!(st.flows_not_streamed, 13);
    assert_eq!(meta_arg(&bytes, "trace.flows_not_streamed"), Some(13));
    assert_eq!(st.requests_late, 0);
}

#[test]
fn a_phase_whose_last_step_ended_nothing_flows_to_its_first_steps_only_in_both_layouts() {
    // The served request's engine side never says it finished (an abort,
    // a recording stopped mid-decode): its last decode step ended nothing,
    // and a streamed trace cannot know it was the last when it writes it.
    let mut recs = live_recording();
    for r in &mut recs {
        if let Record::EngineOutputs { outputs, .. } = r {
            for o in outputs {
                o.finish_reason = None;
            }
        }
    }
    let (whole, wst) = trace_of(&recs);
    let (streamed, sst) = streamed_trace(&recs);
    let links = request_step_links(&whole);
    assert_eq!(links, request_step_links(&streamed));
    assert_eq!(links.len(), 2 + 4, "the prefill's two steps, the decode's first four: no last");
    assert_eq!((wst.step_flows, wst.flows_capped), (sst.step_flows, sst.flows_capped));
    assert_eq!(wst.flows_capped, 8);
    assert_eq!(sst.flows_unlinked, 0);
}

#[test]
fn a_streamed_trace_counts_the_step_flows_no_request_slice_takes() {
    // An engine request joined to no HTTP request, and one whose request
    // has no engine marks for its prefill (so no prefill slice): their
    // steps' flow ids are written and named by no slice; the trace
    // declares them and the checker counts exactly that many.
    let mut recs = live_recording();
    recs.extend(engine_steps("chatcmpl-unknown", T0 + MS, &[(T0 + 3 * MS, 1), (T0 + 5 * MS, 1), (T0 + 7 * MS, 1)]));
    let recs = sorted(recs);
    let file = recording_bytes(&recs);
    let mut reader = crate::recording::Reader::new(&file[..]).unwrap();
    let (bytes, st, _) = live::write_trace_streamed(Vec::new(), &mut reader, Config::default(), Encoding::default()).unwrap();
    let s = checked(&bytes);
    let (offline, ost) = trace_of(&recs);
    assert_eq!(request_step_links(&bytes), request_step_links(&offline));
    // Its 3 steps: prefill (first token) and 2 decode, each with a flow id.
    assert_eq!((st.flows_unmapped, ost.flows_unmapped), (3, 3));
    assert_eq!((st.flows_unlinked, s.flows_unlinked), (3, 3));
    assert_eq!(meta_arg(&bytes, "trace.flows_unlinked"), Some(3));
    assert_eq!(meta_arg(&offline, "trace.flows_unlinked"), Some(0));
}

#[test]
fn a_live_trace_finished_by_rereading_the_recording_matches_the_offline_tracks() {
    let recs = live_recording();
    let file = recording_bytes(&recs);
    let buf = Shared::default();
    let mut live = live::LiveTrace::new(buf.clone(), &meta()).unwrap();
    for r in &recs {
        live.push(r).unwrap();
    }
    let mut reader = crate::recording::Reader::new(&file[..]).unwrap();
    let (_, st, err) = live.finish_streamed(&mut reader, Config::default()).unwrap();
    assert_eq!(err, None);
    let bytes = buf.0.borrow().clone();
    assert_eq!(st.writer.bytes, bytes.len() as u64);
    let s = checked(&bytes);
    let (offline, _) = trace_of(&recs);
    assert_eq!(sorted_lines(&s), sorted_lines(&checked(&offline)), "same tracks and slices");
    assert_eq!((st.requests, st.chains), (6, 2));
    assert_eq!(request_step_links(&bytes), request_step_links(&offline), "the same request→step flows");
    assert_eq!(st.step_flows, 7);
}

#[test]
fn a_streamed_trace_holds_only_the_requests_near_the_watermark_and_retires_their_tracks() {
    // 400 sequential requests, 1.5 s apart, each its own chain: a whole
    // layout holds all of them; the stream a handful.
    let mut recs = Vec::new();
    for i in 0..400u64 {
        recs.extend(exchange(conn(5), i as u32, T0 + i * 1_500 * MS, 3, &format!("s{i}")));
    }
    let recs = sorted(recs);
    let file = recording_bytes(&recs);
    let mut reader = crate::recording::Reader::new(&file[..]).unwrap();
    let mut t = live::LiveTrace::with_encoding(Vec::new(), &meta(), Encoding::default()).unwrap();
    for r in &recs {
        t.push(r).unwrap();
    }
    let (bytes, st, _) = t.finish_streamed(&mut reader, Config::default()).unwrap();
    let s = checked(&bytes);
    assert_eq!((st.requests, st.chains, st.requests_late), (400, 400, 0));
    assert_eq!(s.children(s.track(names::REQUESTS).map(|t| t.uuid)).filter(|t| t.slices.values().sum::<u64>() > 0).count(), 400);
    assert!(st.held_requests_peak <= 4, "held {} requests at once", st.held_requests_peak);
    assert!(st.held_items_peak <= 60, "held {} items at once", st.held_items_peak);
    let (offline, _) = trace_of(&recs);
    assert_eq!(sorted_lines(&s), sorted_lines(&checked(&offline)));
}

#[test]
fn a_retired_track_is_forgotten_by_the_writer_and_one_with_open_slices_is_not() {
    let mut w = TraceWriter::new(Vec::new(), T0).unwrap();
    let a = w.track("a", TrackOpts::default());
    let b = w.track("b", TrackOpts::default());
    w.begin(T0, a, &Event::named_once("req-1")).unwrap();
    w.end(T0 + 1, a).unwrap();
    w.begin(T0 + 1, b, &Event::named("x")).unwrap();
    assert_eq!(w.tracks_held(), 2);
    w.retire(a).unwrap();
    w.retire(b).unwrap();
    assert_eq!(w.tracks_held(), 1, "b has an open slice");
    w.end(T0 + 2, b).unwrap();
    w.retire(b).unwrap();
    assert_eq!(w.tracks_held(), 0);
    let (bytes, _) = w.finish().unwrap();
    let s = checked(&bytes);
    assert_eq!(s.track("a").unwrap().slices.get("req-1"), Some(&1), "a name written once, not interned, still names the slice");
}

#[test]
fn a_streamed_trace_of_a_recording_without_a_start_time_starts_where_the_whole_layout_does() {
    let recs = live_recording();
    let m = Meta { start_ns: 0, ..meta() };
    let mut w = crate::recording::Writer::new(Vec::new(), &m).unwrap();
    for r in &recs {
        w.push(r).unwrap();
    }
    let file = w.finish(recs.last().unwrap().ts_ns()).unwrap();
    let mut reader = crate::recording::Reader::new(&file[..]).unwrap();
    let (bytes, _, _) = live::write_trace_streamed(Vec::new(), &mut reader, Config::default(), Encoding::default()).unwrap();
    let s = checked(&bytes);
    let analysis = analyse(&recs);
    let (offline, _) = write_trace(Vec::new(), TraceInput { meta: &m, records: &recs, analysis: &analysis, read_error: None }).unwrap();
    let off = checked(&offline);
    assert!(off.first_ts.is_some_and(|t| t > T0 - 5 * MS), "{:?}", off.first_ts);
    assert_eq!(s.first_ts, off.first_ts);
    assert_eq!(sorted_lines(&s), sorted_lines(&off));
}

#[test]
fn hop_label_figures_read_as_the_formatter_writes_them() {
    let check = |v: f64| {
        let mut s = String::new();
        super::push_one_decimal(&mut s, v);
        assert_eq!(s, format!("{v:.1}"), "{v:e} (bits {:#x})", v.to_bits());
    };
    // Exact halves of a tenth (0.25, 0.75, 1.25, ...: to even), quarters
    // and eighths around them, whole numbers and the edges of the integer path.
    for k in 0..4_000u32 {
        for d in [4.0, 8.0, 16.0, 20.0, 1.0] {
            check(f64::from(k) / d);
        }
    }
    for v in [0.0, -0.0, 0.05, 0.04999999999999999, 0.95, 9.95, 99.95, 0.15, 0.35, 1e-300, f64::MIN_POSITIVE, 5e-324, 2.5e-10, 123456.75, 1e14, (1u64 << 49) as f64, (1u64 << 49) as f64 - 0.5, 3e15, -1.25, -7.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY, f64::MAX] {
        check(v);
        check(f64::from_bits(v.to_bits().wrapping_add(1)));
        check(f64::from_bits(v.to_bits().wrapping_sub(1)));
    }
    // Seeded random bit patterns over every exponent of the fast path, and
    // millisecond figures as requests have them (ns / 1e6).
    let mut next = crate::testutil::xorshift(0x9e37_79b9_7f4a_7c15);
    for _ in 0..200_000 {
        let r = next();
        let exp = (r >> 52) % 1100;
        check(f64::from_bits(exp << 52 | (next() & ((1 << 52) - 1))));
        check((next() % 10_000_000_000_000) as f64 / 1e6);
    }
}

#[test]
fn hand_encoded_packets_are_the_bytes_prost_writes_for_them() {
    // The writer encodes events, annotations and plain track descriptors
    // by hand; prost re-encoding the decoded trace must give the same bytes
    // (every field known to the schema subset, each in prost's order and
    // with the shortest lengths). Covered: iids past one byte (over 128
    // names), numbers past 2^56 and negative ones, strings around the
    // 124-byte inline limit, an event expected long that is short (ten
    // booleans) and one past 16 KiB, unique names, flows, counters, and
    // descriptors with and without a parent, ordering and negative rank.
    let mut w = TraceWriter::with_encoding(Vec::new(), 5, Encoding::PLAIN).unwrap();
    let g = w.track("group", TrackOpts { child_ordering: Some(ChildOrdering::Explicit), rank: Some(-3), ..TrackOpts::default() });
    let a = w.track("a", TrackOpts { parent: Some(g), rank: Some(1), ..TrackOpts::default() });
    let th = w.thread_track(7, 8, Some("worker"), false);
    let own = w.track("own", TrackOpts { own_sequence: true, ..TrackOpts::default() });
    let c = w.counter_track("c", CounterUnit::Count, TrackOpts::default());
    let names: Vec<String> = (0..150).map(|k| format!("arg_{k}")).collect();
    let text = "x".repeat(200);
    let huge = "w".repeat(20_000);
    let f = w.new_flow_id();
    let mut ts = 10;
    for (k, n) in names.iter().enumerate() {
        let args = [
            Arg::dynamic(n, Value::U64((k as u64) << (k % 64))),
            Arg::u64("max", u64::MAX - k as u64),
            Arg::i64("neg", -(k as i64)),
            Arg::i64("pos", k as i64 * 1_000_000_007),
            Arg::f64("f", k as f64 / 3.0),
            Arg::bool("b", k % 2 == 0),
            Arg::str("s", &text[..(k + 60) % 200]),
            Arg::interned("i", &names[(k * 7) % 150]),
        ];
        w.begin(ts, a, &Event::named(n).args(&args)).unwrap();
        let label = format!("unique {k}");
        let flows = [f + k as u64];
        w.instant(ts, th, &Event::named_once(&label).args(&args[..(k % 8)]).flows(&flows[..k % 2])).unwrap();
        w.instant(ts, own, &Event::named(&names[149 - k]).args(&args[4..]).terminating_flows(&flows[..k % 2])).unwrap();
        w.end(ts + 1, a).unwrap();
        w.counter(ts + 1, c, 1 - k as i64 * 1_000).unwrap();
        ts += 2;
    }
    let bools: Vec<Arg<'_>> = names[..10].iter().map(|n| Arg::dynamic(n, Value::Bool(true))).collect();
    w.instant(ts, a, &Event::named("short").args(&bools)).unwrap();
    w.instant(ts, a, &Event::named("huge").args(&[Arg::str("s", &huge), Arg::str("t", &text[..123]), Arg::str("u", &text[..124])])).unwrap();
    let (bytes, st) = w.finish().unwrap();
    assert_eq!(st.slices, 150);
    let t = Trace::decode(&bytes[..]).expect("trace decodes");
    assert_eq!(t.packet.len() as u64, st.packets);
    let again = t.encode_to_vec();
    assert!(again == bytes, "prost writes {} bytes, the writer {}; first difference at byte {:?}", again.len(), bytes.len(), again.iter().zip(&bytes).position(|(x, y)| x != y));
    checked(&bytes);
}

#[test]
fn decimals_read_as_the_formatter_writes_them() {
    let check = |v: u64| {
        let mut s = String::from("x");
        super::push_decimal(&mut s, v);
        assert_eq!(s, format!("x{v}"));
    };
    for v in 0..100_000 {
        check(v);
    }
    for k in 0..64 {
        check(1 << k);
        check((1 << k) - 1);
    }
    for v in [u64::from(u32::MAX), u64::from(u16::MAX), 10u64.pow(19), u64::MAX - 1, u64::MAX] {
        check(v);
    }
}

#[test]
fn streamed_traces_of_the_testbed_recordings_draw_the_whole_layouts_request_step_flows() {
    // The committed recordings of the real testbed (real sockets, eBPF,
    // the vLLM-shaped engine's IPC): queueing, a 3-hop chain, tensor
    // parallel with chunked prefill, ADDs longer than a ZMQ batch.
    for name in ["queue2", "chain3", "tp_chunked", "long_adds"] {
        let file = std::fs::read(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(format!("{name}.hop"))).expect("fixture");
        let mut reader = crate::recording::Reader::new(&file[..]).unwrap();
        let m = reader.meta().clone();
        let mut records = Vec::new();
        while let Some(r) = reader.next_record().unwrap() {
            records.push(r);
        }
        let analysis = analyse(&records);
        let (whole, wst) = write_trace(Vec::new(), TraceInput { meta: &m, records: &records, analysis: &analysis, read_error: None }).unwrap();
        let mut reader = crate::recording::Reader::new(&file[..]).unwrap();
        let (streamed, sst, err) = live::write_trace_streamed(Vec::new(), &mut reader, Config::default(), Encoding::default()).unwrap();
        assert_eq!(err, None, "{name}");
        let links = request_step_links(&streamed);
        assert!(links.len() as u64 >= wst.requests, "{name}: {} flows for {} requests", links.len(), wst.requests);
        assert_eq!(links, request_step_links(&whole), "{name}");
        assert_eq!((sst.step_flows, sst.flows_capped, sst.flows_unmapped), (wst.step_flows, wst.flows_capped, wst.flows_unmapped), "{name}");
        assert_eq!((sst.flows_unlinked, sst.requests_late), (0, 0), "{name}");
    }
}

/// The engine's QUEUED stamp draws the scheduler's queue inside the queue
/// slice, from the stamp to scheduled, in both layouts; not where a KV copy
/// ran in the queue (its slices nest there).
#[test]
fn the_schedulers_queue_nests_in_the_queue_slice_from_the_engines_queued_stamp() {
    use crate::model::EngineEvent;
    let id = "chatcmpl-5-0";
    let mut engine = engine_steps(id, T0 + MS, &[(T0 + 4 * MS, 1), (T0 + 6 * MS, 1), (T0 + 8 * MS, 1), (T0 + 10 * MS, 1)]);
    if let Some(Record::EngineOutputs { outputs, .. }) = engine.iter_mut().find(|r| matches!(r, Record::EngineOutputs { .. })) {
        outputs[0].events = vec![EngineEvent { kind: 1, timestamp_s: (T0 + 1_300_000) as f64 / 1e9 }, EngineEvent { kind: 2, timestamp_s: (T0 + 2 * MS) as f64 / 1e9 }];
    }
    let mut recs = exchange(conn(5), 0, T0, 4, "s1");
    recs.extend(engine);
    let recs = sorted(recs);
    let analysis = analyse(&recs);
    let near = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() < 1e-6);
    let out = crate::sink::report::request_out(&analysis.requests[0]);
    assert!(near(out.scheduler_queue_ms, 0.7) && near(out.phases_ms.queue, 1.0), "{:?} {:?}", out.scheduler_queue_ms, out.phases_ms.queue);
    let (whole, _) = trace_of(&recs);
    let (streamed, _) = streamed_trace(&recs);
    for bytes in [&whole, &streamed] {
        let s = checked(bytes);
        let track = s.track(id).expect("request track");
        assert_eq!((track.slices.get("scheduler queue"), track.max_depth), (Some(&1), 3), "request › queue › scheduler queue");
        let t = decode(bytes);
        let at: Vec<u64> = slices_named(&t, "scheduler queue").map(|(ts, _)| ts).collect();
        assert_eq!(at, vec![T0 + 1_300_000]);
    }
    assert_eq!(sorted_lines(&checked(&whole)), sorted_lines(&checked(&streamed)));
    // With a KV copy in the queue: its slices, no scheduler's queue.
    let gpu = gpu_served_request();
    let out = crate::sink::report::request_out(&analyse(&gpu).requests[0]);
    assert!(out.scheduler_queue_ms.is_some());
    let s = checked(&trace_of(&gpu).0);
    assert_eq!(s.track(id).unwrap().slices.get("scheduler queue"), None);
}

/// The slices on the track named `track`: (name, begin, end, depth), in
/// the order they end.
fn slices_on(t: &Trace, s: &Summary, track: &str) -> Vec<(String, u64, u64, usize)> {
    let uuid = s.track(track).unwrap_or_else(|| panic!("no track {track}")).uuid;
    let mut open: Vec<(String, u64)> = Vec::new();
    let mut done = Vec::new();
    for (ts, e) in events(t).filter(|(_, e)| e.track_uuid == Some(uuid)) {
        match e.r#type {
            Some(x) if x == proto::EventType::SliceBegin as i32 => open.push((e.name.clone().unwrap_or_default(), ts)),
            Some(x) if x == proto::EventType::SliceEnd as i32 => {
                let (name, begin) = open.pop().expect("an end closes an open slice");
                done.push((name, begin, ts, open.len()));
            }
            _ => {}
        }
    }
    assert!(open.is_empty(), "{track}: slices left open: {open:?}");
    done
}

/// J, queued at 2 ms and skipped while P and Q (queued after it) were
/// scheduled first, the last at 40 ms: its scheduler-queue slice holds a
/// "passed over" slice from its QUEUED stamp to 40 ms, with the report's
/// count and span as args; the requests nobody went past have none. The
/// whole, streamed and live layouts draw the same.
#[test]
fn a_request_later_ones_went_past_draws_the_span_they_did_inside_its_scheduler_queue() {
    use crate::correlate::engine::tests::stamped;
    let mut recs = Vec::new();
    recs.extend(stamped("chatcmpl-b", 4, T0, T0 + MS + MS / 2, T0 + 3 * MS, T0 + 10 * MS));
    recs.extend(stamped("chatcmpl-j", 5, T0, T0 + 2 * MS, T0 + 150 * MS, T0 + 160 * MS));
    recs.extend(stamped("chatcmpl-p", 6, T0 + 10 * MS, T0 + 12 * MS, T0 + 20 * MS, T0 + 30 * MS));
    recs.extend(stamped("chatcmpl-q", 7, T0 + 20 * MS, T0 + 22 * MS, T0 + 40 * MS, T0 + 200 * MS));
    let recs = sorted(recs);
    let analysis = analyse(&recs);
    let j = analysis.requests.iter().find(|r| r.id == "chatcmpl-j").expect("J reported");
    let out = crate::sink::report::request_out(j);
    assert_eq!(out.scheduler_passed_over_by, Some(2));
    assert!(out.scheduler_passed_over_ms.is_some_and(|ms| (ms - 38.0).abs() < 1e-6), "{:?}", out.scheduler_passed_over_ms);
    let (whole, st) = trace_of(&recs);
    let s = checked(&whole);
    let t = decode(&whole);
    let js = slices_on(&t, &s, "chatcmpl-j");
    let depth_of = |name: &str| js.iter().find(|x| x.0 == name).unwrap_or_else(|| panic!("J has a {name} slice: {js:?}")).clone();
    let (_, qb, qe, qd) = depth_of(names::QUEUE);
    let (_, sb, se, sd) = depth_of(names::SCHEDULER_QUEUE);
    let (_, pb, pe, pd) = depth_of(names::PASSED_OVER);
    assert_eq!((pb, pe), (T0 + 2 * MS, T0 + 40 * MS), "QUEUED to Q's scheduling");
    assert_eq!((sb, se), (T0 + 2 * MS, T0 + 150 * MS));
    assert!(qb <= sb && se <= qe, "the scheduler's queue inside the queue");
    assert_eq!((pd, sd), (qd + 2, qd + 1), "nested: queue > scheduler queue > passed over");
    let (_, pass) = slices_named(&t, names::PASSED_OVER).next().unwrap();
    let by = pass.debug_annotations.iter().find(|d| d.name.as_deref() == Some("scheduler_passed_over_by")).and_then(|d| d.uint_value);
    assert_eq!((by, arg_f64(pass, "scheduler_passed_over_ms")), (Some(2), out.scheduler_passed_over_ms));
    assert_eq!(slices_named(&t, names::PASSED_OVER).count(), 1, "B, P and Q were passed by nobody");
    assert_eq!(s.track("chatcmpl-p").unwrap().slices.get(names::SCHEDULER_QUEUE), Some(&1));
    // The streamed layout and the live trace draw J's slices alike.
    let (streamed, _) = streamed_trace(&recs);
    let ss = checked(&streamed);
    assert_eq!(slices_on(&decode(&streamed), &ss, "chatcmpl-j"), js, "streamed");
    assert_eq!(slices_named(&decode(&streamed), names::PASSED_OVER).count(), 1);
    let buf = Shared::default();
    let mut live = live::LiveTrace::new(buf.clone(), &meta()).unwrap();
    for r in &recs {
        live.push(r).unwrap();
    }
    live.finish(&meta(), &analysis, None).unwrap();
    let bytes = buf.0.borrow().clone();
    let ls = checked(&bytes);
    assert_eq!(slices_on(&decode(&bytes), &ls, "chatcmpl-j"), js, "live");
    assert_eq!(st.requests, 4);
}
