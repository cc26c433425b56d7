//! Time, in one place: the wall clock, the `Clock` seam that tests drive by hand, and
//! RFC 3339 in UTC both ways (the proleptic Gregorian calendar by Howard Hinnant's
//! algorithms). The ledger's clock (`metering::Clock`) adds a monotonic reading and a boot
//! id on top; it reads its wall time from here.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

/// Unix milliseconds now (0 before 1970, saturating far in the future).
pub fn now_ms() -> u64 {
    unix_ms(SystemTime::now())
}

/// Unix milliseconds of `t`.
pub fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// A source of Unix milliseconds.
pub trait Clock: Send + Sync + fmt::Debug {
    fn now_ms(&self) -> u64;
}

/// The system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        now_ms()
    }
}

/// A clock that moves only when told to.
#[derive(Debug, Default)]
pub struct ManualClock {
    ms: AtomicU64,
}

impl ManualClock {
    pub fn new(start_ms: u64) -> ManualClock {
        ManualClock { ms: AtomicU64::new(start_ms) }
    }

    pub fn advance_ms(&self, ms: u64) {
        self.ms.fetch_add(ms, Ordering::SeqCst);
    }

    pub fn set_ms(&self, ms: u64) {
        self.ms.store(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.ms.load(Ordering::SeqCst)
    }
}

/// Unix milliseconds as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn format_utc(ms: u64) -> String {
    let (y, m, d, hh, mm, ss) = civil(ms / 1000);
    format!("{y:04}-{m:02}-{d:02}T{hh:02}:{mm:02}:{ss:02}Z")
}

/// `t` as Go's `time.RFC3339Nano` in UTC with all nine digits
/// (`2023-11-14T22:13:20.000000005Z`), as runc's JSON log lines carry it.
pub fn format_rfc3339_nanos(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let (y, m, day, hh, mm, ss) = civil(d.as_secs());
    format!("{y:04}-{m:02}-{day:02}T{hh:02}:{mm:02}:{ss:02}.{:09}Z", d.subsec_nanos())
}

/// Parses RFC 3339 in UTC (`Z` or `+00:00`, optional fraction, of which milliseconds are
/// kept) into Unix milliseconds; `None` for anything else or a date before 1970.
pub fn parse_rfc3339(s: &str) -> Option<u64> {
    let s = s.strip_suffix('Z').or_else(|| s.strip_suffix("+00:00"))?;
    let (date, time) = s.split_once('T')?;
    let mut d = date.splitn(3, '-');
    let (y, mo, da): (i64, u32, u32) =
        (d.next()?.parse().ok()?, d.next()?.parse().ok()?, d.next()?.parse().ok()?);
    let (hms, frac) = match time.split_once('.') {
        Some((a, b)) => (a, Some(b)),
        None => (time, None),
    };
    let mut t = hms.splitn(3, ':');
    let (h, mi, se): (u64, u64, u64) =
        (t.next()?.parse().ok()?, t.next()?.parse().ok()?, t.next()?.parse().ok()?);
    if !(1..=12).contains(&mo)
        || !(1..=days_in_month(y, mo)).contains(&da)
        || h > 23
        || mi > 59
        || se > 60
    {
        return None;
    }
    let ms_frac = match frac {
        Some(f) if !f.is_empty() && f.bytes().all(|b| b.is_ascii_digit()) => {
            let f3: String = f.chars().chain(std::iter::repeat('0')).take(3).collect();
            f3.parse::<u64>().ok()?
        }
        Some(_) => return None,
        None => 0,
    };
    let days = u64::try_from(days_from_civil(y, mo, da)).ok()?;
    Some((days * 86_400 + h * 3600 + mi * 60 + se) * 1000 + ms_frac)
}

fn days_in_month(y: i64, m: u32) -> u32 {
    match m {
        2 if (y % 4 == 0 && y % 100 != 0) || y % 400 == 0 => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// (year, month, day, hour, minute, second) of Unix seconds.
fn civil(secs: u64) -> (i64, u32, u32, u64, u64, u64) {
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, d) = civil_from_days(i64::try_from(days).unwrap_or(i64::MAX / 2));
    (y, m, d, rem / 3600, rem % 3600 / 60, rem % 60)
}

/// The date of a day count since 1970-01-01.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// Days since 1970-01-01 of a date.
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (i64::from(m) + 9) % 12;
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn formats_and_parses_known_instants() {
        assert_eq!(format_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(format_utc(1_763_726_400_000), "2025-11-21T12:00:00Z");
        assert_eq!(parse_rfc3339("2025-11-21T12:00:00Z"), Some(1_763_726_400_000));
        assert_eq!(parse_rfc3339("2024-02-29T00:00:00.5Z"), Some(1_709_164_800_500));
        assert_eq!(parse_rfc3339("2024-02-29T00:00:00+00:00"), Some(1_709_164_800_000));
        for bad in [
            "2023-02-29T00:00:00Z",
            "2024-13-01T00:00:00Z",
            "1969-12-31T23:59:59Z",
            "2024-01-01T00:00:00",
            "2024-01-01T00:00:00.Z",
        ] {
            assert_eq!(parse_rfc3339(bad), None, "{bad}");
        }
        let t = UNIX_EPOCH + Duration::new(1_700_000_000, 5);
        assert_eq!(format_rfc3339_nanos(t), "2023-11-14T22:13:20.000000005Z");
        assert_eq!(
            format_rfc3339_nanos(UNIX_EPOCH + Duration::from_secs(951_782_400)),
            "2000-02-29T00:00:00.000000000Z"
        );
    }

    #[test]
    fn every_day_of_four_centuries_round_trips() {
        // 1970..2370 covers every leap-year rule (400-year cycle).
        for day in 0..146_097_u64 {
            let ms = day * 86_400_000 + 45_296_789;
            assert_eq!(parse_rfc3339(&format_utc(ms)), Some(ms - 789), "day {day}");
        }
    }

    #[test]
    fn the_manual_clock_moves_only_when_told() {
        let c = ManualClock::new(5);
        assert_eq!(c.now_ms(), 5);
        c.advance_ms(10);
        assert_eq!(c.now_ms(), 15);
        c.set_ms(1);
        assert_eq!(c.now_ms(), 1);
        assert!(SystemClock.now_ms() > 1_700_000_000_000);
    }
}
