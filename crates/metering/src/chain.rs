//! The ledger's hash chain: every closed interval of one ledger file, in the order they
//! closed, each link the SHA-256 of the previous link's hash and the interval's canonical
//! encoding. Pure functions; the ledger appends a link in the transaction that closes the
//! interval (or recovers it after a crash), so the chain never misses a closed row and
//! survives restarts and `kill -9` with the rows.
//!
//! ```text
//! genesis   = hex(sha256("tessera-ledger-chain-v1\n" + ledger_id))
//! hash(n)   = hex(sha256(hash(n-1) + "\n" + canonical(interval n, n)))      hash(0) = genesis
//! canonical = compact JSON, fixed key order (see [`ClosedInterval::canonical`])
//! ```
//!
//! Anyone holding the intervals (a node's ledger, the coordinator's copy, an export) can
//! recompute every link; an edited, deleted, inserted or reordered row breaks the chain at
//! that row. A chain alone does not stop someone who rewrites every link after the row
//! they edit: that is what the node's signature over each upload and the coordinator's
//! refusal of anything that does not extend the chain it holds are for
//! (`fleet::proof`, docs/CHARGEBACK.md).

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use tessera_api::cri::Workload;

use crate::interval::ClosedInterval;

/// The first line of the genesis input: a domain separator and format version.
pub const CHAIN_CONTEXT: &str = "tessera-ledger-chain-v1";

/// The version field of [`ClosedInterval::canonical`].
pub const CANONICAL_VERSION: u32 = 1;

pub use crate::interval::ChainLink;

/// The newest link of a ledger's chain (seq 0 and the genesis hash: nothing closed yet).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChainHead {
    pub ledger_id: String,
    pub seq: u64,
    pub hash: String,
}

impl ChainHead {
    /// The head of a ledger with nothing chained yet.
    pub fn empty(ledger_id: &str) -> ChainHead {
        ChainHead { ledger_id: ledger_id.to_string(), seq: 0, hash: genesis(ledger_id) }
    }
}

/// The hash a ledger's chain starts from.
pub fn genesis(ledger_id: &str) -> String {
    hex::encode(Sha256::digest(format!("{CHAIN_CONTEXT}\n{ledger_id}").as_bytes()))
}

/// The hash of a link: sha256 over the previous hash, a newline and the canonical bytes.
pub fn link_hash(prev: &str, canonical: &str) -> String {
    let mut h = Sha256::new();
    h.update(prev.as_bytes());
    h.update(b"\n");
    h.update(canonical.as_bytes());
    hex::encode(h.finalize())
}

/// The fields the chain covers, in a fixed order; `None` is written as `null` so every
/// encoding has the same keys.
#[derive(Serialize)]
struct Canonical<'a> {
    v: u32,
    chain_seq: u64,
    id: &'a str,
    container_id: &'a str,
    tenant: &'a str,
    node: &'a str,
    gpu_uuid: &'a str,
    gpu_model: &'a str,
    device_uuid: &'a str,
    isolation: &'a str,
    mig_profile: Option<&'a str>,
    fraction: f64,
    class: &'a str,
    nvlink_domain: Option<u32>,
    workload: Option<&'a Workload>,
    start_wall_ms: u64,
    end_wall_ms: u64,
    duration_ms: u64,
    gpu_seconds: f64,
    reason: &'a str,
    preempted: bool,
    util_samples: u64,
    util_sm_avg: Option<f64>,
    util_sm_max: Option<f64>,
}

impl ClosedInterval {
    /// The exact text the chain hashes for this interval at position `chain_seq`: compact
    /// JSON with the keys `v, chain_seq, id, container_id, tenant, node, gpu_uuid,
    /// gpu_model, device_uuid, isolation, mig_profile, fraction, class, nvlink_domain,
    /// workload, start_wall_ms, end_wall_ms, duration_ms, gpu_seconds, reason, preempted,
    /// util_samples, util_sm_avg, util_sm_max` in that order (numbers in their shortest
    /// round-trip form, absent values `null`). Everything a bill is computed from is in it.
    pub fn canonical(&self, chain_seq: u64) -> String {
        let s = &self.start;
        let c = Canonical {
            v: CANONICAL_VERSION,
            chain_seq,
            id: self.id.as_str(),
            container_id: &s.container_id,
            tenant: &s.tenant,
            node: &s.node,
            gpu_uuid: &s.gpu_uuid,
            gpu_model: &s.gpu_model,
            device_uuid: &s.device_uuid,
            isolation: s.isolation.as_str(),
            mig_profile: s.mig_profile.as_deref(),
            fraction: s.fraction,
            class: s.class.as_str(),
            nvlink_domain: s.nvlink_domain,
            workload: s.workload.as_ref(),
            start_wall_ms: self.start_wall_ms,
            end_wall_ms: self.end_wall_ms,
            duration_ms: self.duration_ms,
            gpu_seconds: self.gpu_seconds,
            reason: &self.reason,
            preempted: self.preempted,
            util_samples: self.utilization.as_ref().map_or(0, |u| u.samples),
            util_sm_avg: self.utilization.as_ref().map(|u| u.sm_percent_avg),
            util_sm_max: self.utilization.as_ref().and_then(|u| u.sm_percent_max),
        };
        // Plain data with string keys: serializing cannot fail.
        serde_json::to_string(&c).unwrap_or_default()
    }

    /// The hash this interval's link must carry, chained after `prev` at `chain_seq`.
    pub fn expected_hash(&self, prev: &str, chain_seq: u64) -> String {
        link_hash(prev, &self.canonical(chain_seq))
    }
}

/// Where a chain stops verifying, and why: the first row a bill cannot rest on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChainBreak {
    /// The chain position where it breaks (0 when the row has none).
    pub chain_seq: u64,
    /// The interval id at that position (`-` when the position holds no interval).
    pub interval: String,
    pub why: String,
}

impl std::fmt::Display for ChainBreak {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "chain seq {} (interval {}): {}", self.chain_seq, self.interval, self.why)
    }
}

/// Checks that `intervals` extend the chain whose newest link is `after` (seq, hash):
/// each carries a link, the links are consecutive, each names the hash before it, and
/// each hash is what the interval's content gives. Returns the new head (seq, hash), or
/// where the chain breaks first.
pub fn verify_segment(
    after: (u64, &str),
    intervals: &[ClosedInterval],
) -> Result<(u64, String), ChainBreak> {
    let (mut seq, mut prev) = (after.0, after.1.to_string());
    for i in intervals {
        let id = i.id.as_str().to_string();
        let Some(link) = &i.chain else {
            return Err(ChainBreak {
                chain_seq: 0,
                interval: id,
                why: "it carries no chain link".into(),
            });
        };
        if link.seq != seq + 1 {
            return Err(ChainBreak {
                chain_seq: link.seq,
                interval: id,
                why: if link.seq <= seq {
                    format!(
                        "out of order or replayed: chain seq {} follows seq {seq}; expected {}",
                        link.seq,
                        seq + 1
                    )
                } else {
                    format!(
                        "chain seq {} follows seq {seq}: {} link(s) missing (a row deleted?)",
                        link.seq,
                        link.seq - seq - 1
                    )
                },
            });
        }
        if link.prev != prev {
            return Err(ChainBreak {
                chain_seq: link.seq,
                interval: id,
                why: format!(
                    "it names {} as the previous hash, but the row before hashes to {prev}",
                    short(&link.prev)
                ),
            });
        }
        let actual = i.expected_hash(&prev, link.seq);
        if actual != link.hash {
            return Err(ChainBreak {
                chain_seq: link.seq,
                interval: id,
                why: format!(
                    "its content hashes to {} but its link says {}: the row was changed after it closed",
                    short(&actual),
                    short(&link.hash)
                ),
            });
        }
        seq = link.seq;
        prev = link.hash.clone();
    }
    Ok((seq, prev))
}

/// The first 16 hex digits, for messages.
pub fn short(hash: &str) -> &str {
    &hash[..hash.len().min(16)]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::interval::{Class, IntervalId, IntervalStart};
    use tessera_api::Isolation;

    fn closed(n: u64) -> ClosedInterval {
        ClosedInterval {
            id: IntervalId(format!("node-a-abc-{n}")),
            start: IntervalStart {
                container_id: format!("c{n}"),
                tenant: "acme/ml".into(),
                node: "node-a".into(),
                gpu_uuid: "GPU-0".into(),
                gpu_model: "H100-80GB".into(),
                device_uuid: "GPU-0".into(),
                isolation: Isolation::Gpu,
                mig_profile: None,
                fraction: 3.0 / 7.0,
                class: Class::Guaranteed,
                workload: None,
                nvlink_domain: None,
            },
            start_wall_ms: 1_000 * n,
            end_wall_ms: 1_000 * n + 500,
            duration_ms: 500,
            gpu_seconds: 0.5 * 3.0 / 7.0,
            reason: "exited".into(),
            preempted: false,
            utilization: None,
            chain: None,
        }
    }

    fn chained(n: u64) -> Vec<ClosedInterval> {
        let mut prev = genesis("abc");
        (1..=n)
            .map(|k| {
                let mut c = closed(k);
                let hash = c.expected_hash(&prev, k);
                c.chain = Some(ChainLink { seq: k, prev: prev.clone(), hash: hash.clone() });
                prev = hash;
                c
            })
            .collect()
    }

    #[test]
    fn the_canonical_encoding_is_fixed_and_covers_every_billed_field() {
        let c = closed(1);
        assert_eq!(
            c.canonical(7),
            r#"{"v":1,"chain_seq":7,"id":"node-a-abc-1","container_id":"c1","tenant":"acme/ml","node":"node-a","gpu_uuid":"GPU-0","gpu_model":"H100-80GB","device_uuid":"GPU-0","isolation":"gpu","mig_profile":null,"fraction":0.42857142857142855,"class":"guaranteed","nvlink_domain":null,"workload":null,"start_wall_ms":1000,"end_wall_ms":1500,"duration_ms":500,"gpu_seconds":0.21428571428571427,"reason":"exited","preempted":false,"util_samples":0,"util_sm_avg":null,"util_sm_max":null}"#
        );
        // Through JSON and back, bit for bit (the coordinator recomputes from an upload).
        let back: ClosedInterval =
            serde_json::from_str(&serde_json::to_string(&c).expect("json")).expect("parse");
        assert_eq!(back.canonical(7), c.canonical(7));
        // Each billed field changes the hash.
        let h = c.expected_hash("p", 1);
        let mut e = c.clone();
        e.gpu_seconds *= 2.0;
        assert_ne!(e.expected_hash("p", 1), h);
        let mut e = c.clone();
        e.start.class = Class::Burst;
        assert_ne!(e.expected_hash("p", 1), h);
        let mut e = c.clone();
        e.start.nvlink_domain = Some(0);
        assert_ne!(e.expected_hash("p", 1), h);
        let mut e = c.clone();
        e.preempted = true;
        assert_ne!(e.expected_hash("p", 1), h);
        assert_ne!(c.expected_hash("p", 2), h, "the position is covered");
        assert_ne!(c.expected_hash("q", 1), h, "the previous hash is covered");
    }

    #[test]
    fn a_chain_verifies_and_names_the_first_row_that_does_not() {
        let rows = chained(5);
        let g = genesis("abc");
        let (seq, head) = verify_segment((0, &g), &rows).expect("verifies");
        assert_eq!((seq, head.as_str()), (5, rows[4].chain.as_ref().expect("link").hash.as_str()));
        // A segment continues from where the previous one ended.
        let (s3, h3) = verify_segment((0, &g), &rows[..3]).expect("first part");
        assert_eq!(verify_segment((s3, &h3), &rows[3..]).expect("rest").0, 5);

        // An edited row.
        let mut edited = rows.clone();
        edited[2].duration_ms += 1;
        let e = verify_segment((0, &g), &edited).expect_err("edited");
        assert_eq!((e.chain_seq, e.interval.as_str()), (3, "node-a-abc-3"));
        assert!(e.why.contains("changed after it closed"), "{e}");
        // A deleted row.
        let mut deleted = rows.clone();
        deleted.remove(1);
        let e = verify_segment((0, &g), &deleted).expect_err("deleted");
        assert_eq!(e.chain_seq, 3);
        assert!(e.why.contains("1 link(s) missing"), "{e}");
        // Reordered, replayed.
        let mut swapped = rows.clone();
        swapped.swap(1, 2);
        assert_eq!(verify_segment((0, &g), &swapped).expect_err("swapped").chain_seq, 3);
        let e = verify_segment((5, &head), &rows[..2]).expect_err("replay");
        assert!(e.why.contains("replayed"), "{e}");
        // Relinked after an edit: the row's own hash is recomputed, the next row's prev is not.
        let mut relinked = rows.clone();
        relinked[2].gpu_seconds = 99.0;
        let prev = relinked[2].chain.as_ref().expect("link").prev.clone();
        let h = relinked[2].expected_hash(&prev, 3);
        relinked[2].chain.as_mut().expect("link").hash = h;
        let e = verify_segment((0, &g), &relinked).expect_err("relinked");
        assert_eq!(e.chain_seq, 4);
        assert!(e.why.contains("previous hash"), "{e}");
        // Another ledger's genesis.
        assert_eq!(verify_segment((0, &genesis("xyz")), &rows).expect_err("genesis").chain_seq, 1);
        // No link at all.
        let mut bare = rows;
        bare[0].chain = None;
        assert!(verify_segment((0, &g), &bare).expect_err("bare").why.contains("no chain link"));
    }
}
