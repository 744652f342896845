//! Process-wide counters (see `hopscope_gpu_wire::Counter`).

use hopscope_gpu_wire::Counter;
use std::sync::atomic::{AtomicU64, Ordering};

const N: usize = Counter::ALL.len();

pub struct Counters {
    v: [AtomicU64; N],
}

fn index(c: Counter) -> usize {
    c as usize - 1
}

impl Counters {
    pub const fn new() -> Counters {
        Counters { v: [const { AtomicU64::new(0) }; N] }
    }

    pub fn add(&self, c: Counter, n: u64) {
        if n > 0 {
            self.v[index(c)].fetch_add(n, Ordering::Relaxed);
        }
    }

    pub fn get(&self, c: Counter) -> u64 {
        self.v[index(c)].load(Ordering::Relaxed)
    }

    /// Every counter, by wire id.
    pub fn snapshot(&self) -> Vec<(u16, u64)> {
        Counter::ALL.iter().map(|c| (*c as u16, self.get(*c))).collect()
    }
}

impl Default for Counters {
    fn default() -> Self {
        Self::new()
    }
}

/// Counts gathered while walking one buffer, added to [`Counters`] at once.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Local {
    pub decoded: u64,
    pub bad_zero: u64,
    pub bad_reversed: u64,
    pub bad_future: u64,
    pub bad_past: u64,
    pub bad_size: u64,
    pub unknown_kind: u64,
    pub name_truncated: u64,
    pub cupti_errors: u64,
}

impl Local {
    pub fn add_to(&self, c: &Counters) {
        c.add(Counter::RecordsDecoded, self.decoded);
        c.add(Counter::BadTimestampZero, self.bad_zero);
        c.add(Counter::BadTimestampReversed, self.bad_reversed);
        c.add(Counter::BadTimestampFuture, self.bad_future);
        c.add(Counter::BadTimestampPast, self.bad_past);
        c.add(Counter::BadRecordSize, self.bad_size);
        c.add(Counter::UnknownKind, self.unknown_kind);
        c.add(Counter::NameTruncated, self.name_truncated);
        c.add(Counter::CuptiErrors, self.cupti_errors);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_wire_counter_has_a_slot_and_snapshots_in_id_order() {
        let c = Counters::new();
        for (i, k) in Counter::ALL.iter().enumerate() {
            assert_eq!(*k as usize, i + 1, "wire ids are dense from 1");
            c.add(*k, i as u64);
        }
        let s = c.snapshot();
        assert_eq!(s.len(), Counter::ALL.len());
        assert_eq!(s[3], (Counter::DroppedNoAgent as u16, 3));
    }
}
