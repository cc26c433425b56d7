//! What the family examples share: their arguments and the family they replay.

use std::path::Path;

use lab::replay::Trace;
use lab::tracegen::family;

const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/alibaba-gpu-v2023");

/// `[REQUESTS] [SEED] [MAX_WAIT_S]` (defaults 3000, 1, 3600) and the family: the shared
/// Alibaba lists only with full-size generated traces (1,000 requests or more, as the
/// tables in docs/PERFORMANCE.md), then every generated mix.
pub fn args_and_family() -> Result<(u64, Vec<Trace>), String> {
    let args: Vec<u64> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let n = args.first().copied().unwrap_or(3000) as usize;
    let seed = args.get(1).copied().unwrap_or(1);
    let max_wait_s = args.get(2).copied().unwrap_or(3600);
    let shared = (n >= 1000).then(|| Path::new(DATA));
    Ok((max_wait_s, family(shared, n, seed).map_err(|e| e.to_string())?))
}
