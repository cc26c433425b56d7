//! Time arguments of the command line: `now`, relative (`-90s`, `-15m`, `-2h`, `-7d`),
//! Unix seconds (`1763726400`), or RFC 3339 in UTC (`2026-11-21T12:00:00Z`, with
//! optional fractional seconds). Everything becomes Unix milliseconds.

/// Parse a time argument relative to `now_ms`.
pub fn parse(s: &str, now_ms: u64) -> Result<u64, String> {
    let s = s.trim();
    if s == "now" {
        return Ok(now_ms);
    }
    if let Some(rel) = s.strip_prefix('-') {
        let (num, unit) =
            rel.split_at(rel.find(|c: char| !c.is_ascii_digit()).unwrap_or(rel.len()));
        let n: u64 = num.parse().map_err(|_| bad(s))?;
        let ms = match unit {
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            _ => return Err(bad(s)),
        };
        return n.checked_mul(ms).and_then(|d| now_ms.checked_sub(d)).ok_or_else(|| bad(s));
    }
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        return s.parse::<u64>().ok().and_then(|v| v.checked_mul(1000)).ok_or_else(|| bad(s));
    }
    rfc3339(s).ok_or_else(|| bad(s))
}

fn bad(s: &str) -> String {
    format!(
        "`{s}` is not a time: use now, -2h (also s, m, d), Unix seconds, or 2026-11-21T12:00:00Z"
    )
}

fn rfc3339(s: &str) -> Option<u64> {
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
    let days = days_from_civil(y, mo, da);
    if days < 0 {
        return None;
    }
    Some((days as u64 * 86_400 + h * 3600 + mi * 60 + se) * 1000 + ms_frac)
}

fn days_in_month(y: i64, m: u32) -> u32 {
    match m {
        2 if (y % 4 == 0 && y % 100 != 0) || y % 400 == 0 => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Unix milliseconds as `YYYY-MM-DDTHH:MM:SSZ`.
pub fn format_utc(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// The date of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = if z >= 0 { z } else { z - 146_096 } / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let mp = (m as i64 + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_form() {
        let now = 1_763_726_400_000;
        assert_eq!(parse("now", now), Ok(now));
        assert_eq!(parse("-2h", now), Ok(now - 7_200_000));
        assert_eq!(parse("-90s", now), Ok(now - 90_000));
        assert_eq!(parse("1763726400", now), Ok(1_763_726_400_000));
        assert_eq!(parse("1970-01-01T00:00:00Z", now), Ok(0));
        assert_eq!(parse("2025-11-21T12:00:00Z", now), Ok(1_763_726_400_000));
        assert_eq!(parse("2024-02-29T00:00:00.5Z", now), Ok(1_709_164_800_500));
    }

    #[test]
    fn formats_round_trip_with_parse() {
        for ms in [0u64, 951_782_400_000, 1_709_164_800_000, 1_763_726_400_000, 4_102_444_799_000] {
            assert_eq!(parse(&format_utc(ms), 0), Ok(ms), "{}", format_utc(ms));
        }
        assert_eq!(format_utc(1_763_726_400_000), "2025-11-21T12:00:00Z");
        assert_eq!(format_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(format_utc(951_782_400_000), "2000-02-29T00:00:00Z");
    }

    #[test]
    fn rejects_what_is_not_a_time() {
        for s in [
            "",
            "yesterday",
            "-5y",
            "2025-13-01T00:00:00Z",
            "2025-02-30T00:00:00Z",
            "2025-11-21T12:00:00",
            "-99999999999999999d",
            "2025-11-21T25:00:00Z",
        ] {
            let e = parse(s, 1_000).unwrap_err();
            assert!(e.contains("not a time"), "{s}: {e}");
        }
    }
}
