//! CUPTI timestamps → CLOCK_MONOTONIC, and their validation.
//!
//! CUPTI stamps records with CLOCK_REALTIME ns by default (cupti_activity.h,
//! `cuptiActivityRegisterTimestampCallback`). hopscope's CPU side uses
//! CLOCK_MONOTONIC (`bpf_ktime_get_ns`), so we register a timestamp callback
//! returning CLOCK_MONOTONIC — except on CUPTI 12.6 update 2 through 13.0,
//! where a registered callback zeroes kernel timestamps (design.md §4). There
//! we leave CUPTI's clock alone and add an offset measured with
//! `cuptiGetTimestamp` between two CLOCK_MONOTONIC reads (the sample with the
//! smallest gap wins; its half-gap bounds the error).

/// Whether the timestamp callback can be trusted on this CUPTI version.
/// `cuptiGetVersion` says 24 for every 12.6 update, so all of 12.6 is treated
/// as affected; 12.8 (26) and 12.9 (28) and 13.0 (130000…130099) are affected;
/// 12.4 (22), 12.5 (23) and 13.1+ are not.
pub fn timestamp_callback_is_safe(version: u32) -> bool {
    !(24..130_100).contains(&version)
}

/// Why a record's timestamps were rejected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadTimestamp {
    /// start or end is 0 (parcagpu#23: garbage after ~25 M graph records).
    Zero,
    /// end < start.
    Reversed,
    /// Before the injection library initialised (minus a margin).
    Past,
    /// After "now" (plus a margin): records arrive after they complete.
    Future,
}

/// The window a valid CLOCK_MONOTONIC timestamp falls in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimeBounds {
    pub min_ns: u64,
    pub max_ns: u64,
}

impl TimeBounds {
    /// Margin around [init, now]: covers calibration error and clock reads
    /// racing the record's completion, while catching garbage by orders of magnitude.
    pub const MARGIN_NS: u64 = 10_000_000_000;

    pub fn new(init_mono_ns: u64, now_mono_ns: u64) -> TimeBounds {
        TimeBounds { min_ns: init_mono_ns.saturating_sub(Self::MARGIN_NS), max_ns: now_mono_ns.saturating_add(Self::MARGIN_NS) }
    }
}

/// How raw CUPTI timestamps become CLOCK_MONOTONIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Conversion {
    /// Already CLOCK_MONOTONIC (our callback).
    Identity,
    /// `monotonic = raw + offset_ns`.
    Offset(i64),
}

/// Converts and validates one (start, end) pair. Zero is checked on the raw
/// values (a zero stays garbage whatever the offset).
pub fn convert_span(raw_start: u64, raw_end: u64, conv: Conversion, bounds: TimeBounds) -> Result<(u64, u64), BadTimestamp> {
    if raw_start == 0 || raw_end == 0 {
        return Err(BadTimestamp::Zero);
    }
    if raw_end < raw_start {
        return Err(BadTimestamp::Reversed);
    }
    let (start, end) = match conv {
        Conversion::Identity => (raw_start, raw_end),
        Conversion::Offset(off) => {
            let s = raw_start as i128 + off as i128;
            let e = raw_end as i128 + off as i128;
            if s <= 0 {
                return Err(BadTimestamp::Past);
            }
            if e > u64::MAX as i128 {
                return Err(BadTimestamp::Future);
            }
            (s as u64, e as u64)
        }
    };
    if start < bounds.min_ns {
        return Err(BadTimestamp::Past);
    }
    if end > bounds.max_ns {
        return Err(BadTimestamp::Future);
    }
    Ok((start, end))
}

/// A measured offset from CUPTI's clock to CLOCK_MONOTONIC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Calibration {
    pub offset_ns: i64,
    /// Half the bracketing gap of the best sample.
    pub error_ns: u64,
    /// CLOCK_MONOTONIC at the best sample.
    pub at_mono_ns: u64,
}

/// Picks the sample `(mono_before, cupti, mono_after)` with the smallest gap;
/// `None` when no sample is usable (cupti 0 or mono_after < mono_before).
pub fn calibrate(samples: impl IntoIterator<Item = (u64, u64, u64)>) -> Option<Calibration> {
    samples
        .into_iter()
        .filter(|&(a, c, b)| c != 0 && b >= a)
        .min_by_key(|&(a, _, b)| b - a)
        .map(|(a, c, b)| {
            let mid = a as i128 + ((b - a) / 2) as i128;
            Calibration {
                offset_ns: (mid - c as i128).clamp(i64::MIN as i128, i64::MAX as i128) as i64,
                error_ns: (b - a).div_ceil(2),
                at_mono_ns: mid as u64,
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_callback_is_avoided_exactly_from_12_6_through_13_0() {
        let safe: Vec<u32> = [22, 23, 24, 26, 28, 130000, 130001, 130002, 130101, 130202, 130301, 130401]
            .into_iter()
            .filter(|v| timestamp_callback_is_safe(*v))
            .collect();
        assert_eq!(safe, vec![22, 23, 130101, 130202, 130301, 130401]);
    }

    #[test]
    fn garbage_timestamps_are_classified() {
        let b = TimeBounds::new(1_000_000_000_000, 2_000_000_000_000);
        let id = Conversion::Identity;
        assert_eq!(convert_span(0, 5, id, b), Err(BadTimestamp::Zero));
        assert_eq!(convert_span(5, 0, id, b), Err(BadTimestamp::Zero));
        assert_eq!(convert_span(1_500_000_000_100, 1_500_000_000_000, id, b), Err(BadTimestamp::Reversed));
        assert_eq!(convert_span(5, 6, id, b), Err(BadTimestamp::Past));
        assert_eq!(convert_span(1_500_000_000_000, u64::MAX, id, b), Err(BadTimestamp::Future));
        assert_eq!(convert_span(1_500_000_000_000, 1_500_000_000_001, id, b), Ok((1_500_000_000_000, 1_500_000_000_001)));
        // Within the margin of init and now.
        assert!(convert_span(1_000_000_000_000 - 1, 2_000_000_000_000 + 1, id, b).is_ok());
    }

    #[test]
    fn an_offset_moves_realtime_into_monotonic_and_cannot_overflow() {
        let realtime = 1_790_000_000_000_000_000u64; // 2026 in ns since 1970
        let mono = 5_000_000_000_000u64;
        let off = mono as i64 - realtime as i64;
        let b = TimeBounds::new(mono - 1_000_000_000, mono + 1_000_000_000);
        assert_eq!(convert_span(realtime, realtime + 750, Conversion::Offset(off), b), Ok((mono, mono + 750)));
        assert_eq!(convert_span(1, 2, Conversion::Offset(off), b), Err(BadTimestamp::Past));
        assert_eq!(convert_span(u64::MAX - 1, u64::MAX, Conversion::Offset(i64::MAX), b), Err(BadTimestamp::Future));
    }

    #[test]
    fn calibration_takes_the_tightest_sample() {
        let c = calibrate([(100, 1_000_050, 200), (300, 1_000_305, 310), (400, 0, 401), (500, 9, 499)]).unwrap();
        assert_eq!(c, Calibration { offset_ns: 305 - 1_000_305, error_ns: 5, at_mono_ns: 305 });
        assert_eq!(calibrate([]), None);
        assert_eq!(calibrate([(1, 0, 2)]), None);
    }
}
