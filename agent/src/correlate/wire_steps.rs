//! Engine steps seen from the wire alone, for servers whose engine IPC
//! hopscope cannot decode (design.md §3, source (c)).
//!
//! An engine step ends by handing every member's new tokens to the frontend,
//! which then writes one SSE event per member in a burst. So content writes
//! cluster in time: a silence longer than `gap_ns` separates two steps. A
//! request's steps are the clusters it wrote in; a cluster that carries
//! someone's *first* token finished that request's prefill, and when it came
//! late for the requests already decoding, the excess over the median
//! spacing of pure-decode clusters is interference, charged to them and
//! naming whose prefill it was.
//!
//! Accuracy (the attribution tests print it): the clusters match the engine's
//! output steps when steps are longer than the frontend's write burst; with
//! very short steps, neighbouring steps merge.

use super::Request;

/// Silence between two content writes that separates two steps.
pub const DEFAULT_GAP_NS: u64 = 1_000_000;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cluster {
    pub start_ns: u64,
    pub end_ns: u64,
    /// (request index, this is the request's first content chunk).
    pub members: Vec<(usize, bool)>,
}

/// Clusters of content writes over all requests, in time order.
pub fn clusters(requests: &[Request], gap_ns: u64) -> Vec<Cluster> {
    let mut writes: Vec<(u64, usize, bool)> = Vec::new();
    for (i, r) in requests.iter().enumerate() {
        for (k, &t) in r.content_ns.iter().enumerate() {
            writes.push((t, i, k == 0));
        }
    }
    writes.sort_unstable();
    let mut out: Vec<Cluster> = Vec::new();
    for (t, i, first) in writes {
        match out.last_mut() {
            Some(c) if t.saturating_sub(c.end_ns) <= gap_ns => {
                c.end_ns = t;
                if !c.members.iter().any(|m| m.0 == i) {
                    c.members.push((i, first));
                }
            }
            _ => out.push(Cluster { start_ns: t, end_ns: t, members: vec![(i, first)] }),
        }
    }
    out
}

/// What the wire says about one request's steps.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WireSteps {
    pub steps: u32,
    pub interference_ns: u64,
    /// Indexes of the requests whose first tokens came in the slowed steps.
    pub interference_from: Vec<usize>,
}

/// Per request (same order as `requests`).
pub fn attribute(requests: &[Request], clusters: &[Cluster]) -> Vec<WireSteps> {
    let mut out = vec![WireSteps::default(); requests.len()];
    let spacing = |k: usize| (k > 0).then(|| clusters[k].start_ns.saturating_sub(clusters[k - 1].start_ns));
    let mut pure: Vec<u64> = (1..clusters.len()).filter(|&k| clusters[k].members.iter().all(|m| !m.1)).filter_map(spacing).collect();
    pure.sort_unstable();
    let median = pure.get(pure.len() / 2).copied();
    for (k, c) in clusters.iter().enumerate() {
        let newcomers: Vec<usize> = c.members.iter().filter(|m| m.1).map(|m| m.0).collect();
        let excess = match (spacing(k), median) {
            (Some(d), Some(m)) if d > m && !newcomers.is_empty() => d - m,
            _ => 0,
        };
        for &(i, first) in &c.members {
            let w = &mut out[i];
            w.steps += 1;
            if !first && excess > 0 {
                w.interference_ns += excess;
                for &n in &newcomers {
                    if n != i && !w.interference_from.contains(&n) {
                        w.interference_from.push(n);
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::correlate::{ChainSource, Request};
    use crate::event::ConnKey;
    use crate::model::Usage;

    fn req(fd: i32, content_ms: &[u64]) -> Request {
        Request {
            conn: ConnKey { tgid: 1, fd, ino: fd as u64 },
            seq: 0,
            id: format!("r{fd}"),
            x_request_id: None,
            traceparent: None,
            chain: String::new(),
            chain_source: ChainSource::Connection,
            hop: 1,
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            status: Some(200),
            arrive_ns: 0,
            wire_arrive_ns: None,
            request_end_ns: 0,
            response_head_ns: None,
            ttft_ns: content_ms.first().map(|m| m * 1_000_000),
            done_ns: None,
            response_end_ns: None,
            content_ns: content_ms.iter().map(|m| m * 1_000_000).collect(),
            request_bytes: 0,
            response_bytes: None,
            streamed: true,
            usage: Usage::default(),
            finish_reason: None,
            engine: None,
            wire_steps: None,
        }
    }

    #[test]
    fn bursts_of_writes_become_steps_and_a_late_prefill_step_is_interference() {
        // A decodes every 10 ms; B's first token arrives in a step that took 40 ms.
        let a = req(5, &[10, 20, 30, 70, 80]);
        let b = req(6, &[70, 80]);
        let reqs = vec![a, b];
        let cs = clusters(&reqs, DEFAULT_GAP_NS);
        assert_eq!(cs.len(), 5);
        assert_eq!(cs[3].members, vec![(0, false), (1, true)]);
        let w = attribute(&reqs, &cs);
        assert_eq!(w[0].steps, 5);
        assert_eq!(w[0].interference_ns, 30_000_000, "40 ms step against a 10 ms median");
        assert_eq!(w[0].interference_from, vec![1]);
        assert_eq!(w[1].steps, 2);
        assert_eq!(w[1].interference_ns, 0, "its own prefill is not interference");
    }

    #[test]
    fn writes_within_the_gap_merge_and_a_silence_splits() {
        let reqs = vec![req(5, &[10, 12]), req(6, &[10])];
        let cs = clusters(&reqs, 1_000_000);
        assert_eq!(cs.len(), 2);
        assert_eq!(cs[0].members.len(), 2);
    }
}
