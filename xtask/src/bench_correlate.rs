//! `cargo xtask bench-correlator [--requests N]`: the correlator's throughput
//! on one core and the process's peak memory, on a synthetic recording shaped
//! like the testbed's (HTTP + SSE + engine IPC records per request).

use anyhow::Result;
use hopscope::correlate::{Config, Correlator};
use hopscope::event::{ConnKey, Dir};
use hopscope::model::{EngineEvent, EngineOutput, HttpRole, PrefillStats, Record, SseKind, Usage};
use std::time::Instant;

fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Records of `n` requests, 4 in flight at a time, 32 content chunks each;
/// `queued`: the first output carries the engine's QUEUED stamp beside
/// SCHEDULED (vLLM's default, stats logging on), which feeds the pass book.
fn synth(n: u64, queued: bool) -> Vec<Record> {
    let mut out = Vec::with_capacity(n as usize * 44);
    let ipc_out = ConnKey { tgid: 2, fd: 9, ino: 1 };
    for i in 0..n {
        let conn = ConnKey { tgid: 1, fd: 10 + (i % 4) as i32, ino: 100 + (i % 4) };
        let seq = (i / 4) as u32;
        let t = i * 1_000_000;
        let id = format!("chatcmpl-{i:016x}");
        let eid = format!("{id}-0badf00d");
        out.push(Record::HttpRequest {
            conn,
            role: HttpRole::Server,
            seq,
            start_ns: t,
            end_ns: t + 10_000,
            tid: 1,
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            headers: vec![("x-session-id".into(), format!("chain-{}", i % 64))],
            body_len: 4000,
            stream: Some(true),
            model: Some("meta-llama/Llama-3.1-8B-Instruct".into()),
            ready_ns: Some(t),
        });
        out.push(Record::EngineRequest {
            conn: ipc_out,
            ts_ns: t + 20_000,
            tid: 1,
            dir: Dir::Out,
            request_id: eid.clone(),
            external_req_id: Some(id.clone()),
            prompt_tokens: Some(1000),
            max_tokens: Some(32),
            arrival_time_s: None,
            traceparent: None,
            data_parallel_rank: None,
            truncated: false,
        });
        out.push(Record::HttpResponse { conn, role: HttpRole::Server, seq, ts_ns: t + 30_000, tid: 1, status: 200, headers: vec![("content-type".into(), "text/event-stream".into())] });
        for k in 0..32u64 {
            let ts = t + 100_000 + k * 20_000;
            out.push(Record::EngineOutputs {
                conn: ipc_out,
                ts_ns: ts - 5_000,
                tid: 3,
                dir: Dir::Out,
                engine_index: Some(0),
                timestamp_s: Some((ts - 6_000) as f64 / 1e9),
                outputs: vec![EngineOutput {
                    request_id: eid.clone(),
                    new_tokens: 1,
                    finish_reason: (k == 31).then_some(1),
                    events: match (k, queued) {
                        (0, true) => vec![EngineEvent { kind: 1, timestamp_s: (t + 40_000) as f64 / 1e9 }, EngineEvent { kind: 2, timestamp_s: (t + 50_000) as f64 / 1e9 }],
                        (0, false) => vec![EngineEvent { kind: 2, timestamp_s: (t + 50_000) as f64 / 1e9 }],
                        _ => vec![],
                    },
                    prefill: (k == 0).then(|| PrefillStats { prompt_tokens: Some(1000), cached_tokens: Some(900), ..PrefillStats::default() }),
                }],
                outputs_total: Some(1),
                finished_requests: vec![],
                truncated: false,
            });
            out.push(Record::Sse { conn, seq, ts_ns: ts, kind: SseKind::Content, id: Some(id.clone()), content_bytes: 4, finish_reason: None, usage: None });
        }
        let end = t + 800_000;
        let usage = Usage { prompt_tokens: Some(1000), completion_tokens: Some(32), cached_tokens: Some(900) };
        out.push(Record::Sse { conn, seq, ts_ns: end, kind: SseKind::Usage, id: Some(id.clone()), content_bytes: 0, finish_reason: None, usage: Some(usage) });
        out.push(Record::Sse { conn, seq, ts_ns: end + 1, kind: SseKind::Done, id: None, content_bytes: 0, finish_reason: None, usage: None });
        out.push(Record::HttpResponseEnd { conn, seq, ts_ns: end + 2, body_len: 9000 });
    }
    out.sort_by_key(Record::ts_ns);
    out
}

pub fn run(args: &[String]) -> Result<()> {
    if cfg!(debug_assertions) {
        // Figures from a debug build mean nothing: rerun optimised.
        return crate::run(crate::cargo().args(["run", "--quiet", "--release", "-p", "xtask", "--", "bench-correlator"]).args(args));
    }
    let opts = crate::Opts::parse(args, "cargo xtask bench-correlator [--requests N (default 100000)]", &["--requests"])?;
    let n: u64 = opts.num("--requests", 100_000)?;
    let records = synth(n, true);
    let before = peak_rss_mib();
    let (dt, held) = correlate(&records, n)?;
    println!("correlator, one core, synthetic testbed-shaped recording ({n} requests, {} records):", records.len());
    println!("  {:.2} M records/s ({dt:.2} s)   (goal >= 2 M/s)", records.len() as f64 / dt / 1e6);
    println!("  held at most {} requests, {} engine requests (streamed)", held.0, held.1);
    println!("  peak RSS {:.0} MiB (records in memory: {:.0} MiB before correlating)", peak_rss_mib(), before);
    live_otlp(&records, dt)?;
    live_metrics(&records, dt)?;
    // The same without QUEUED stamps (vLLM with stats logging off): what
    // the pass book costs, side by side.
    drop(records);
    let plain = synth(n, false);
    let (dt_plain, _) = correlate(&plain, n)?;
    let (dt_again, _) = correlate(&synth(n, true), n)?;
    println!("the engine's QUEUED stamps (each request through the pass book), same requests:");
    println!(
        "  with {:.2} and {:.2} M records/s, without {:.2} M records/s ({:.2}x the time)",
        plain.len() as f64 / dt / 1e6,
        plain.len() as f64 / dt_again / 1e6,
        plain.len() as f64 / dt_plain / 1e6,
        dt.min(dt_again) / dt_plain
    );
    Ok(())
}

/// Runs `records` through the correlator streamed, as `hopscope report
/// --json` does: final requests handed out every 4096 records, steps
/// dropped. Returns the seconds it took and the most requests held.
fn correlate(records: &[Record], n: u64) -> Result<(f64, (usize, usize))> {
    let t = Instant::now();
    let mut c = Correlator::new(Config::default());
    let (mut out, mut joined, mut held) = (0u64, 0u64, (0usize, 0usize));
    let mut take = |rs: Vec<hopscope::correlate::Request>| {
        out += rs.len() as u64;
        joined += rs.iter().filter(|r| r.engine.is_some()).count() as u64;
    };
    for (i, r) in records.iter().enumerate() {
        c.ingest(r);
        if i % 4096 == 4095 {
            take(c.drain_final(r.ts_ns()));
            c.take_steps();
            // As `report --json` does: per-step figures are spooled, not held.
            c.take_gpu_steps();
            let h = c.held();
            held = (held.0.max(h.0), held.1.max(h.1));
        }
    }
    take(c.finish_streaming().requests);
    let dt = t.elapsed().as_secs_f64();
    anyhow::ensure!(out == n, "every synthetic request handed out: {out} of {n}");
    anyhow::ensure!(joined == n, "every synthetic request joins its engine request: {joined} of {n}");
    Ok((dt, held))
}

/// `record --metrics`'s cost in the recording loop without `--otlp`: every
/// record through the metrics sink (under its lock, as the recorder feeds it)
/// and through the phase histograms' own streaming correlator, side by side
/// with the plain correlator above.
fn live_metrics(records: &[Record], correlator_s: f64) -> Result<()> {
    use hopscope::sink::metrics::{LiveMetrics, LivePhases};
    use std::sync::{Arc, Mutex};
    // The sink alone first (`--metrics` before its phase histograms).
    let alone = Mutex::new(LiveMetrics::new("x-session-id"));
    let t = Instant::now();
    for r in records {
        if let Ok(mut m) = alone.lock() {
            m.observe(r);
        }
    }
    let sink_s = t.elapsed().as_secs_f64();
    let metrics = Arc::new(Mutex::new(LiveMetrics::new("x-session-id")));
    let t = Instant::now();
    let mut phases = LivePhases::new(Config::default(), Arc::clone(&metrics));
    for r in records {
        phases.push(r);
        if let Ok(mut m) = metrics.lock() {
            m.observe(r);
        }
    }
    let pushed = t.elapsed().as_secs_f64();
    phases.finish();
    let page = metrics.lock().map_err(|_| anyhow::anyhow!("metrics lock poisoned"))?.render();
    // Each request's decode observed once, from the correlator's hand-out.
    let decoded: f64 = page
        .lines()
        .filter_map(|l| l.strip_prefix("hopscope_request_decode_time_seconds_count"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    println!("record --metrics in the recording loop (same records: the metrics sink and the phase histograms' correlator):");
    println!("  {:.2} M records/s ({pushed:.2} s; {:.2}x the correlator alone), {decoded} requests' phases observed", records.len() as f64 / pushed / 1e6, pushed / correlator_s);
    println!("  the metrics sink alone: {:.2} M records/s ({sink_s:.2} s); the phase histograms add {:.2} s", records.len() as f64 / sink_s / 1e6, pushed - sink_s);
    anyhow::ensure!(decoded as u64 == records.iter().filter(|r| matches!(r, Record::HttpResponseEnd { .. })).count() as u64, "every request's decode is observed once");
    Ok(())
}

/// `record --otlp`'s cost in the recording loop: the same records through
/// the live exporter (correlator + spans + queueing; the sending thread posts
/// to a local sink that answers 200), side by side with the plain correlator
/// above. The collector is never waited for, so this is what the recorder pays.
fn live_otlp(records: &[Record], correlator_s: f64) -> Result<()> {
    use hopscope::sink::otlp::live::LiveOtlp;
    use std::io::{Read, Write};
    let sink = std::net::TcpListener::bind("127.0.0.1:0")?;
    let url = format!("http://{}", sink.local_addr()?);
    std::thread::spawn(move || {
        for c in sink.incoming() {
            let Ok(mut c) = c else { continue };
            // Reads the message (head, then Content-Length bytes) and accepts it.
            let mut buf = Vec::new();
            let mut chunk = [0u8; 1 << 16];
            let mut want = None;
            while let Ok(n) = c.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                buf.extend_from_slice(&chunk[..n]);
                if want.is_none() {
                    if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                        let len: usize = head.lines().find_map(|l| l.strip_prefix("content-length:")).and_then(|v| v.trim().parse().ok()).unwrap_or(0);
                        want = Some(end + 4 + len);
                    }
                }
                if want.is_some_and(|w| buf.len() >= w) {
                    break;
                }
            }
            let _ = c.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n");
        }
    });
    let meta = hopscope::recording::Meta { start_unix_ns: 1, ..hopscope::recording::Meta::default() };
    let t = Instant::now();
    let mut live = LiveOtlp::start(&meta, Config::default(), &url, std::time::Duration::from_secs(60))?;
    for r in records {
        live.push(r);
    }
    let pushed = t.elapsed().as_secs_f64();
    let tally = live.finish(std::time::Duration::from_secs(60));
    println!("record --otlp in the recording loop (same records, spans queued for a local sink):");
    println!(
        "  {:.2} M records/s ({pushed:.2} s; {:.2}x the correlator alone), {} spans of {} requests made, {} sent in {} messages, {} lost",
        records.len() as f64 / pushed / 1e6,
        pushed / correlator_s,
        tally.spans,
        tally.requests,
        tally.sent,
        tally.posts,
        tally.lost()
    );
    Ok(())
}
