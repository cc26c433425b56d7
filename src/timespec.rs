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
    tessera_api::time::parse_rfc3339(s).ok_or_else(|| bad(s))
}

fn bad(s: &str) -> String {
    format!(
        "`{s}` is not a time: use now, -2h (also s, m, d), Unix seconds, or 2026-11-21T12:00:00Z"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_api::time::format_utc;

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
