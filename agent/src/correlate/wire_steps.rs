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

use super::engine::RollingMedian;

/// Silence between two content writes that separates two steps.
pub const DEFAULT_GAP_NS: u64 = 1_000_000;

/// A burst longer than this is cut: a step's writes take far less, and an
/// unbroken stream of writes (a saturated frontend) would otherwise make one
/// cluster that never ends and holds every request in it.
pub const MAX_CLUSTER_NS: u64 = 500_000_000;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cluster {
    pub start_ns: u64,
    pub end_ns: u64,
    /// (request number, this is the request's first content chunk).
    pub members: Vec<(u64, bool)>,
}

/// What the wire says about one request's steps.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WireSteps {
    pub steps: u32,
    pub interference_ns: u64,
    /// Ids of the requests whose first tokens came in the slowed steps.
    pub interference_from: Vec<super::Name>,
    /// Hashes of `interference_from` (see [`super::engine::name_hash`]).
    pub(crate) interference_hashes: Vec<u64>,
    /// Which of 64 buckets those hashes fall in ([`super::add_interferer`]).
    pub(crate) interference_seen: u64,
    /// The slowed clusters it was charged by, in order, while it is open:
    /// their newcomers become `interference_from` only when the request is
    /// handed out without the IPC's figures (which replace these), so most
    /// requests of a vLLM recording never build the list. Empty after.
    pub(crate) slowed: Vec<std::sync::Arc<Slowed>>,
}

/// A slowed cluster's newcomers: (request number, name hash, name).
#[derive(Debug, Default, PartialEq)]
pub struct Slowed {
    pub(crate) names: Vec<(u64, u64, super::Name)>,
}

impl WireSteps {
    /// Lists the newcomers of the clusters that slowed request `n` (not
    /// itself, each name once, in the order charged).
    pub(crate) fn resolve(&mut self, n: u64) {
        for s in std::mem::take(&mut self.slowed) {
            for (_, h, name) in s.names.iter().filter(|x| x.0 != n) {
                super::add_interferer(&mut self.interference_seen, &mut self.interference_hashes, &mut self.interference_from, *h, name);
            }
        }
    }
}

/// A closed cluster's verdict for its members: each gets a step, and the
/// ones already decoding get `excess_ns` charged to `newcomers`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Closed {
    pub members: Vec<(u64, bool)>,
    pub excess_ns: u64,
    pub newcomers: Vec<u64>,
}

/// Content writes → clusters, as they come (timestamp order). A cluster is
/// judged when it closes: its start's spacing from the previous cluster's
/// start, against the median spacing of recent clusters with nobody's first
/// token in them (causal, as the engine baseline: see
/// [`super::engine::BASELINE_WINDOW`]).
#[derive(Debug, Default)]
pub struct Clusters {
    gap_ns: u64,
    open: Option<Cluster>,
    /// The open cluster's members, once it has many (a saturated frontend).
    members: std::collections::HashSet<u64>,
    last_start: Option<u64>,
    baseline: RollingMedian,
    /// A closed cluster's member list handed back ([`Self::recycle`]): the
    /// next cluster's, so that one does not grow a new one write by write.
    spare: Vec<(u64, bool)>,
    /// Clusters opened so far: the open one's number ([`Self::write_marked`]).
    opened: u64,
}

impl Clusters {
    pub fn new(gap_ns: u64) -> Self {
        Clusters { gap_ns, ..Clusters::default() }
    }

    /// One content write of request `req`; `first`: its first content chunk.
    /// Returns the cluster this write closed, if any.
    pub fn write(&mut self, t: u64, req: u64, first: bool) -> Option<Closed> {
        if let Some(c) = self.open.as_mut() {
            if t.saturating_sub(c.end_ns) <= self.gap_ns && t.saturating_sub(c.start_ns) < MAX_CLUSTER_NS {
                c.end_ns = c.end_ns.max(t);
                let known = if c.members.len() < 32 {
                    c.members.iter().any(|m| m.0 == req)
                } else {
                    if self.members.is_empty() {
                        self.members.extend(c.members.iter().map(|m| m.0));
                    }
                    !self.members.insert(req)
                };
                if !known {
                    c.members.push((req, first));
                }
                return None;
            }
        }
        self.open_with(t, req, first)
    }

    /// Closes the open cluster and opens one with this write: once per
    /// cluster, out of line so that a write joining one stays small.
    #[inline(never)]
    fn open_with(&mut self, t: u64, req: u64, first: bool) -> Option<Closed> {
        let closed = self.close();
        let mut members = std::mem::take(&mut self.spare);
        members.clear();
        members.push((req, first));
        self.open = Some(Cluster { start_ns: t, end_ns: t, members });
        self.opened += 1;
        closed
    }

    /// [`Self::write`] for a caller that keeps, per request, the number of
    /// the cluster it last joined (`joined`: 0 before any; updated): whether
    /// it is a member of the open cluster is then one compare, not a search
    /// of the members (there is one content write per member and cluster).
    /// The same clusters as [`Self::write`]; one [`Clusters`] takes one or
    /// the other.
    #[inline(always)]
    pub fn write_marked(&mut self, t: u64, req: u64, first: bool, joined: &mut u64) -> Option<Closed> {
        if let Some(c) = self.open.as_mut() {
            if t.saturating_sub(c.end_ns) <= self.gap_ns && t.saturating_sub(c.start_ns) < MAX_CLUSTER_NS {
                c.end_ns = c.end_ns.max(t);
                if *joined != self.opened {
                    *joined = self.opened;
                    c.members.push((req, first));
                }
                return None;
            }
        }
        let closed = self.open_with(t, req, first);
        *joined = self.opened;
        closed
    }

    /// Takes back a [`Closed`]'s members once they are applied.
    pub fn recycle(&mut self, members: Vec<(u64, bool)>) {
        if members.capacity() > self.spare.capacity() {
            self.spare = members;
        }
    }

    /// Closes the open cluster if no later write can join it: `horizon_ns`
    /// is a time every record still to come is after.
    pub fn settle(&mut self, horizon_ns: u64) -> Option<Closed> {
        let c = self.open.as_ref()?;
        if c.end_ns.saturating_add(self.gap_ns) < horizon_ns || c.start_ns.saturating_add(MAX_CLUSTER_NS) <= horizon_ns {
            self.close()
        } else {
            None
        }
    }

    /// Closes the open cluster (end of the recording).
    pub fn close(&mut self) -> Option<Closed> {
        let c = self.open.take()?;
        self.members.clear();
        let spacing = self.last_start.map(|s| c.start_ns.saturating_sub(s));
        self.last_start = Some(c.start_ns);
        let newcomers: Vec<u64> = c.members.iter().filter(|m| m.1).map(|m| m.0).collect();
        let mut excess_ns = 0;
        match spacing {
            Some(d) if newcomers.is_empty() => self.baseline.push(d),
            Some(d) => {
                if let Some(m) = self.baseline.median().filter(|&m| d > m) {
                    excess_ns = d - m;
                }
            }
            None => {}
        }
        Some(Closed { members: c.members, excess_ns, newcomers })
    }
}

/// Per request of `requests` (one slice of content write times each), what
/// the clusters say: the all-at-once form of [`Clusters`], for tests and tools.
pub fn attribute(requests: &[&[u64]], gap_ns: u64) -> Vec<WireSteps> {
    let mut writes: Vec<(u64, usize, bool)> = Vec::new();
    for (i, r) in requests.iter().enumerate() {
        for (k, &t) in r.iter().enumerate() {
            writes.push((t, i, k == 0));
        }
    }
    writes.sort_unstable();
    let mut out = vec![WireSteps::default(); requests.len()];
    let mut cs = Clusters::new(gap_ns);
    let mut apply = |c: Closed| {
        for &(i, first) in &c.members {
            let w = &mut out[i as usize];
            w.steps += 1;
            if !first && c.excess_ns > 0 {
                w.interference_ns += c.excess_ns;
                for &n in c.newcomers.iter().filter(|&&n| n != i) {
                    let name: super::Name = format!("r{n}").into();
                    super::add_interferer(&mut w.interference_seen, &mut w.interference_hashes, &mut w.interference_from, super::engine::name_hash(&name), &name);
                }
            }
        }
    };
    for (t, i, first) in writes {
        if let Some(c) = cs.write(t, i as u64, first) {
            apply(c);
        }
    }
    if let Some(c) = cs.close() {
        apply(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: &[u64]) -> Vec<u64> {
        v.iter().map(|m| m * 1_000_000).collect()
    }

    #[test]
    fn bursts_of_writes_become_steps_and_a_late_prefill_step_is_interference() {
        // A decodes every 10 ms; B's first token arrives in a step that took 40 ms.
        let (a, b) = (ms(&[10, 20, 30, 70, 80]), ms(&[70, 80]));
        let w = attribute(&[&a, &b], DEFAULT_GAP_NS);
        assert_eq!(w[0].steps, 5);
        assert_eq!(w[0].interference_ns, 30_000_000, "40 ms step against a 10 ms median");
        assert_eq!(w[0].interference_from, vec![super::super::Name::from("r1")]);
        assert_eq!(w[1].steps, 2);
        assert_eq!(w[1].interference_ns, 0, "its own prefill is not interference");
    }

    #[test]
    fn writes_within_the_gap_merge_and_a_silence_splits() {
        let mut cs = Clusters::new(1_000_000);
        assert_eq!(cs.write(10_000_000, 0, true), None);
        assert_eq!(cs.write(10_000_000, 1, true), None);
        assert_eq!(cs.write(10_500_000, 0, false), None, "within the gap: same cluster");
        let c = cs.write(12_000_000, 0, false).expect("a 1.5 ms silence closes the first cluster");
        assert_eq!(c.members, vec![(0, true), (1, true)]);
        assert_eq!(cs.close().expect("the second cluster").members, vec![(0, false)]);
    }

    #[test]
    fn an_unbroken_stream_of_writes_is_cut_at_the_longest_cluster() {
        let mut cs = Clusters::new(1_000_000);
        let mut closed = 0;
        for k in 0..2_000u64 {
            closed += usize::from(cs.write(k * 500_000, 0, k == 0).is_some());
        }
        assert_eq!(closed, 1, "999.5 ms of writes 0.5 ms apart: one cut at 500 ms");
    }

    #[test]
    fn a_cluster_closes_once_the_horizon_is_past_its_gap() {
        let mut cs = Clusters::new(1_000_000);
        cs.write(5_000_000, 3, true);
        assert_eq!(cs.settle(6_000_000), None, "a write at 6 ms could still join");
        assert_eq!(cs.settle(6_000_001).map(|c| c.members), Some(vec![(3, true)]));
    }

    /// Random write streams (members past the 32 a cluster searches, long
    /// silences, bursts past [`MAX_CLUSTER_NS`]) through both forms.
    #[test]
    fn marked_writes_close_the_clusters_searched_writes_close() {
        let mut next = crate::testutil::xorshift(0x2545_f491_4f6c_dd1d);
        let (mut slowed, mut big) = (0, 0);
        for round in 0..60u64 {
            let (mut searched, mut marked) = (Clusters::new(DEFAULT_GAP_NS), Clusters::new(DEFAULT_GAP_NS));
            let reqs = 1 + (next() % if round % 3 == 0 { 100 } else { 20 }) as usize;
            // Requests come and go: the ones writing are a window that slides.
            let mut joined = vec![0u64; reqs + 100];
            let mut seen = vec![false; reqs + 100];
            // Every fifth round has no silences: its writes run past MAX_CLUSTER_NS.
            let (step, silences) = if round % 5 == 0 { (400_000, false) } else { (150_000, true) };
            let mut t = 1_000_000_000u64;
            let (mut a, mut b) = (Vec::new(), Vec::new());
            for w in 0..3000 {
                let x = next();
                t += if silences && x.is_multiple_of(16) { 1_000_000 + (x >> 40) % 4_000_000 } else { (x >> 20) % step };
                let r = w / 30 + ((x >> 8) % reqs as u64) as usize;
                let first = !std::mem::replace(&mut seen[r], true);
                a.extend(searched.write(t, r as u64, first));
                b.extend(marked.write_marked(t, r as u64, first, &mut joined[r]));
                if x.is_multiple_of(97) {
                    a.extend(searched.settle(t + 2_000_000));
                    b.extend(marked.settle(t + 2_000_000));
                }
            }
            a.extend(searched.close());
            b.extend(marked.close());
            assert!(a.len() > 1, "round {round}: {} clusters", a.len());
            slowed += a.iter().filter(|c| c.excess_ns > 0).count();
            big += a.iter().filter(|c| c.members.len() > 32).count();
            assert_eq!(a, b, "round {round}");
        }
        assert!(slowed > 100 && big > 0, "{slowed} slowed clusters, {big} of more than 32 members");
    }
}
