//! Linux CPU lists (`0-3,8,10-11`): what sysfs says of a GPU's local CPUs and the host's
//! online CPUs, what a simulated node file writes, and what `linux.resources.cpu.cpus`
//! takes (one parser for all of them).

/// Why a CPU list is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{text}` is not a CPU list such as 0-15,32-47: {why}")]
pub struct CpuListError {
    pub text: String,
    pub why: String,
}

/// The largest CPU number accepted in a CPU list.
pub const MAX_CPU: u32 = 8191;

/// The CPUs of a Linux CPU list (`0-3,8,10-11`), ascending without repeats.
pub fn parse_cpulist(text: &str) -> Result<Vec<u32>, CpuListError> {
    let bad = |why: &str| CpuListError {
        text: crate::untrusted(text).max_chars(64).to_string(),
        why: why.to_string(),
    };
    let t = text.trim();
    if t.is_empty() {
        return Err(bad("empty"));
    }
    let mut out = Vec::new();
    for part in t.split(',') {
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a, b),
            None => (part, part),
        };
        let num = |s: &str| -> Result<u32, CpuListError> {
            if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) || s.len() > 5 {
                return Err(bad("expected numbers and ranges separated by commas"));
            }
            s.parse::<u32>().map_err(|_| bad("a number too large"))
        };
        let (lo, hi) = (num(lo)?, num(hi)?);
        if lo > hi || hi > MAX_CPU {
            return Err(bad(&format!("range {lo}-{hi} is empty or past CPU {MAX_CPU}")));
        }
        out.extend(lo..=hi);
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// The canonical text of a CPU list (`0-3,8`).
pub fn render_cpulist(cpus: &[u32]) -> String {
    let mut sorted = cpus.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        let mut end = start;
        while i + 1 < sorted.len() && sorted[i + 1] == end + 1 {
            i += 1;
            end = sorted[i];
        }
        parts.push(if start == end { start.to_string() } else { format!("{start}-{end}") });
        i += 1;
    }
    parts.join(",")
}

/// The CPUs in both lists.
pub fn intersect(a: &[u32], b: &[u32]) -> Vec<u32> {
    a.iter().copied().filter(|c| b.contains(c)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_and_render() {
        assert_eq!(parse_cpulist("0-3,8,10-11\n").unwrap(), [0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(render_cpulist(&[11, 0, 1, 2, 3, 8, 10]), "0-3,8,10-11");
        for bad in ["", "a", "3-1", "0-99999", "1,,2", "-1", "0-"] {
            assert!(parse_cpulist(bad).is_err(), "{bad:?}");
        }
    }
}
