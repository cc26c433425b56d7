//! Usage that proves itself: each node's key, its signature over every upload, the checks a
//! coordinator makes before it stores one, and the verification of a bill from the signed
//! intervals and the signed policy revision that priced it (online or offline).
//!
//! A node's closed ledger intervals form a hash chain ([`metering::chain`]). An upload is a
//! *segment* of that chain: consecutive links after the head the coordinator already holds
//! for that ledger. The node signs, with its own ed25519 key (`STATE/fleet/node.key`, made
//! at first start, mode 0600), the canonical message
//!
//! ```text
//! tessera-usage-v1\n{node}\n{ledger_id}\n{after_seq}\n{after_hash}\n{head_seq}\n{head_hash}
//! ```
//!
//! where `after` is the link the segment extends (seq 0 and the ledger's genesis hash for
//! the first) and `head` its last link. The coordinator pins each node's public key (the
//! operator registers it: `tessera nodes register-key`) and stores an upload only if the
//! signature verifies against the pinned key, the segment starts exactly at the head it
//! holds (anything else is a replay, a reorder or a gap: refused), and every link
//! recomputes from the intervals' content. Each stored segment keeps its signature, so the
//! coordinator's copy can be checked by anyone later ([`verify_bill`]).

use std::collections::BTreeMap;
use std::io::Read as _;
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use ed25519_dalek::{Signature, Signer as _, VerifyingKey};
use metering::chain::{short, verify_segment, ChainBreak, ChainHead};
use metering::ClosedInterval;
use serde::{Deserialize, Serialize};

use crate::signing::{self, key_id, KeyError, SignedPolicy, Signer};

/// The first line of every signed upload: a domain separator (a policy signature can never
/// pass for an upload's) and format version.
pub const USAGE_CONTEXT: &str = "tessera-usage-v1";

/// The format name of a [`BillExport`].
pub const EXPORT_FORMAT: &str = "tessera-bill-v1";

/// A node's signature over one segment of its ledger's chain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignedSegment {
    pub node: String,
    pub ledger_id: String,
    /// The link the segment extends (0 and the genesis hash: the ledger's first).
    pub after_seq: u64,
    pub after_hash: String,
    /// The segment's last link.
    pub head_seq: u64,
    pub head_hash: String,
    /// [`key_id`] of the signing key (informational: the pinned key decides).
    pub key_id: String,
    /// Base64 ed25519 signature over [`segment_message`].
    pub signature: String,
}

/// The exact bytes a node signs for a segment.
pub fn segment_message(
    node: &str,
    ledger_id: &str,
    after: (u64, &str),
    head: (u64, &str),
) -> Vec<u8> {
    format!(
        "{USAGE_CONTEXT}\n{node}\n{ledger_id}\n{}\n{}\n{}\n{}",
        after.0, after.1, head.0, head.1
    )
    .into_bytes()
}

/// Why an upload, a segment or a bill does not verify. Each message names the node, the
/// ledger and the chain position where it can.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProofError {
    #[error("unsigned usage upload from node {node}: every upload carries the node's signature over its chain segment")]
    Unsigned { node: String },
    #[error("no key is registered for node {node}: register its public key first (`tessera nodes register-key {node} KEY`; the node prints it at start and in `tessera status --json`)")]
    NoKey { node: String },
    #[error("node {node}'s segment is signed by key {key_id}, but the key registered for it is {registered}")]
    WrongKey { node: String, key_id: String, registered: String },
    #[error("forged or corrupted: the signature of node {node}'s segment {after}..{head} of ledger {ledger_id} does not verify against its registered key {registered}")]
    BadSignature { node: String, ledger_id: String, after: u64, head: u64, registered: String },
    #[error("malformed usage upload: {0}")]
    Malformed(String),
    /// The segment does not start at the head the coordinator holds.
    #[error("{why}: the coordinator holds node {node}'s ledger {ledger_id} up to chain seq {held_seq} ({}); this upload extends seq {after_seq}", short(held_hash))]
    NotNext {
        node: String,
        ledger_id: String,
        held_seq: u64,
        held_hash: String,
        after_seq: u64,
        why: String,
    },
    #[error("node {node} ledger {ledger_id}: {brk}")]
    Chain { node: String, ledger_id: String, brk: ChainBreak },
}

impl ProofError {
    /// A short machine-readable kind.
    pub fn kind(&self) -> &'static str {
        match self {
            ProofError::Unsigned { .. } => "unsigned",
            ProofError::NoKey { .. } => "no-key",
            ProofError::WrongKey { .. } => "wrong-key",
            ProofError::BadSignature { .. } => "forged",
            ProofError::Malformed(_) => "malformed",
            ProofError::NotNext { .. } => "replayed-or-out-of-order",
            ProofError::Chain { .. } => "broken-chain",
        }
    }
}

/// Sign `intervals` (consecutive links of ledger `ledger_id`, oldest first) as node `node`.
pub fn sign_segment(
    signer: &Signer,
    node: &str,
    ledger_id: &str,
    intervals: &[ClosedInterval],
) -> Result<SignedSegment, ProofError> {
    let (Some(first), Some(last)) = (intervals.first(), intervals.last()) else {
        return Err(ProofError::Malformed("an empty segment".into()));
    };
    let (Some(f), Some(l)) = (&first.chain, &last.chain) else {
        return Err(ProofError::Malformed(format!(
            "interval {} carries no chain link",
            if first.chain.is_none() { &first.id } else { &last.id }
        )));
    };
    let after = (f.seq.saturating_sub(1), f.prev.as_str());
    let head = (l.seq, l.hash.as_str());
    let sig: Signature = signer.key().sign(&segment_message(node, ledger_id, after, head));
    Ok(SignedSegment {
        node: node.to_string(),
        ledger_id: ledger_id.to_string(),
        after_seq: after.0,
        after_hash: after.1.to_string(),
        head_seq: head.0,
        head_hash: head.1.to_string(),
        key_id: signer.key_id().to_string(),
        signature: B64.encode(sig.to_bytes()),
    })
}

/// The signature of `seg` against `key`.
pub fn check_signature(seg: &SignedSegment, key: &VerifyingKey) -> Result<(), ProofError> {
    let registered = key_id(key);
    if !seg.key_id.is_empty() && seg.key_id != registered {
        return Err(ProofError::WrongKey {
            node: seg.node.clone(),
            key_id: seg.key_id.clone(),
            registered,
        });
    }
    let forged = || ProofError::BadSignature {
        node: seg.node.clone(),
        ledger_id: seg.ledger_id.clone(),
        after: seg.after_seq,
        head: seg.head_seq,
        registered: registered.clone(),
    };
    let bytes = B64.decode(seg.signature.trim().as_bytes()).map_err(|_| forged())?;
    let sig = Signature::from_slice(&bytes).map_err(|_| forged())?;
    let msg = segment_message(
        &seg.node,
        &seg.ledger_id,
        (seg.after_seq, &seg.after_hash),
        (seg.head_seq, &seg.head_hash),
    );
    key.verify_strict(&msg, &sig).map_err(|_| forged())
}

/// The links of `intervals` recompute from `seg.after` to `seg.head`, and every interval
/// is node `seg.node`'s, of ledger `seg.ledger_id`.
pub fn check_links(seg: &SignedSegment, intervals: &[ClosedInterval]) -> Result<(), ProofError> {
    let chain_err =
        |brk| ProofError::Chain { node: seg.node.clone(), ledger_id: seg.ledger_id.clone(), brk };
    let prefix = format!("{}-{}-", seg.node, seg.ledger_id);
    for i in intervals {
        if i.start.node != seg.node || !i.id.as_str().starts_with(&prefix) {
            return Err(ProofError::Malformed(format!(
                "interval {} is not node {}'s, of ledger {} (its id must start with {prefix})",
                i.id, seg.node, seg.ledger_id
            )));
        }
    }
    let (seq, hash) =
        verify_segment((seg.after_seq, &seg.after_hash), intervals).map_err(chain_err)?;
    if (seq, hash.as_str()) != (seg.head_seq, seg.head_hash.as_str()) {
        return Err(chain_err(ChainBreak {
            chain_seq: seq,
            interval: intervals.last().map_or_else(|| "-".into(), |i| i.id.to_string()),
            why: format!(
                "the intervals end at seq {seq} ({}) but the signature covers up to seq {} ({})",
                short(&hash),
                seg.head_seq,
                short(&seg.head_hash)
            ),
        }));
    }
    Ok(())
}

/// What a coordinator checks before it stores an upload of node `node`: signed (by the
/// key registered for it), extending exactly the head `held` it holds for that ledger,
/// every link recomputing from the content.
pub fn check_upload(
    node: &str,
    key: Option<&VerifyingKey>,
    held: &ChainHead,
    seg: Option<&SignedSegment>,
    intervals: &[ClosedInterval],
) -> Result<(), ProofError> {
    let Some(seg) = seg else { return Err(ProofError::Unsigned { node: node.to_string() }) };
    if seg.node != node {
        return Err(ProofError::Malformed(format!(
            "the segment is signed as node {:?}, but node {node} uploads it",
            seg.node
        )));
    }
    if seg.ledger_id != held.ledger_id {
        return Err(ProofError::Malformed(format!(
            "the segment is of ledger {:?}, checked against ledger {:?}",
            seg.ledger_id, held.ledger_id
        )));
    }
    let Some(key) = key else { return Err(ProofError::NoKey { node: node.to_string() }) };
    check_signature(seg, key)?;
    if (seg.after_seq, seg.after_hash.as_str()) != (held.seq, held.hash.as_str()) {
        let why = if seg.after_seq < held.seq {
            "replayed or out of order: the segment starts inside what is already stored"
        } else if seg.after_seq > held.seq {
            "out of order: links are missing before this segment"
        } else {
            "the segment does not extend the chain already stored (the node's ledger was rewritten?)"
        };
        return Err(ProofError::NotNext {
            node: node.to_string(),
            ledger_id: seg.ledger_id.clone(),
            held_seq: held.seq,
            held_hash: held.hash.clone(),
            after_seq: seg.after_seq,
            why: why.into(),
        });
    }
    check_links(seg, intervals)
}

/// Where a node keeps its key: `STATE/fleet/node.key`.
pub fn node_key_path(state_dir: &Path) -> std::path::PathBuf {
    state_dir.join("fleet").join("node.key")
}

/// The node's signing key from `path`, made there (mode 0600, in a 0700 directory) when
/// there is none. A key file others may read or write is refused, naming its mode. Returns
/// whether it was made now.
pub fn load_or_create_node_key(path: &Path) -> Result<(Signer, bool), KeyError> {
    let io = |source| KeyError::Io { path: path.display().to_string(), source };
    match std::fs::symlink_metadata(path) {
        Ok(meta) => {
            if !meta.file_type().is_file() {
                return Err(KeyError::Format {
                    what: path.display().to_string(),
                    detail: "is not a regular file (a symlink or a directory)".into(),
                });
            }
            let mode = meta.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(KeyError::Format {
                    what: path.display().to_string(),
                    detail: format!(
                        "the node key is open to others (mode {mode:04o}): `chmod 600` it, and if \
                         anyone else could have read it, remove it and register the new key"
                    ),
                });
            }
            let mut text = String::new();
            std::fs::File::open(path).and_then(|mut f| f.read_to_string(&mut text)).map_err(io)?;
            Ok((
                Signer::new(signing::parse_signing_key(&text, &path.display().to_string())?),
                false,
            ))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir).map_err(io)?;
                std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
                    .map_err(io)?;
            }
            let key = signing::generate_signing_key()?;
            match signing::write_signing_key(path, &key) {
                Ok(()) => Ok((Signer::new(key), true)),
                // Another start made it meanwhile: use that one.
                Err(KeyError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::AlreadyExists =>
                {
                    load_or_create_node_key(path).map(|(s, _)| (s, false))
                }
                Err(e) => Err(e),
            }
        }
        Err(e) => Err(io(e)),
    }
}

/// A node key as pinned at the coordinator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeKeyRecord {
    pub node: String,
    /// The ed25519 public key, 64 hex digits.
    pub public_key: String,
    pub key_id: String,
    pub registered_ms: u64,
    /// The admin who registered it.
    pub registered_by: String,
}

impl NodeKeyRecord {
    pub fn key(&self) -> Result<VerifyingKey, KeyError> {
        signing::parse_verifying_key(&self.public_key, &format!("node {}'s key", self.node))
    }
}

/// One stored segment with its intervals, as a bill export carries it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SegmentProof {
    pub signed: SignedSegment,
    /// Every interval of the segment, in chain order.
    pub intervals: Vec<ClosedInterval>,
}

/// One node's part of a bill export.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeProof {
    pub node: String,
    /// The key registered for it when the export was made (hex): check it against the
    /// one you pinned (`--node-key NODE=KEY`).
    #[serde(default)]
    pub public_key: Option<String>,
    /// Segments holding an interval that touches the window, oldest first per ledger.
    pub segments: Vec<SegmentProof>,
    /// The newest link the coordinator holds, per ledger.
    pub heads: Vec<ChainHead>,
}

/// A bill with everything needed to check it offline: the query (window, prices, terms),
/// the signed policy revision the prices and floors came from, each node's signed chain
/// segments, and the report itself.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BillExport {
    /// [`EXPORT_FORMAT`].
    pub format: String,
    /// When it was made (the floors' as-of time).
    pub made_ms: u64,
    pub query: metering::UsageQuery,
    /// The revision that priced it (`None`: no verified revision; nothing priced).
    #[serde(default)]
    pub policy: Option<SignedPolicy>,
    /// The coordinator's public key (hex), which signed `policy`. Check it against the
    /// fleet's trust key you pinned.
    pub coordinator_key: String,
    pub nodes: Vec<NodeProof>,
    pub report: metering::UsageReport,
}

/// What [`verify_bill`] found.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BillCheck {
    pub nodes: u64,
    pub segments: u64,
    pub intervals: u64,
    /// The policy version that priced the bill.
    pub policy_version: Option<u64>,
    /// Node keys taken from the export itself (not pinned by the checker).
    pub unpinned_nodes: Vec<String>,
    /// In order: the first is the first row the bill cannot rest on. Empty: it verifies.
    pub problems: Vec<String>,
}

impl BillCheck {
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Checks a bill: the policy revision against `trust_key`; the prices and terms of the
/// query against that revision's; every segment's signature against the node's key
/// (`node_keys`, else the one the export names, listed in `unpinned_nodes`); every link
/// from the intervals; and the report, computed again from the verified intervals, against
/// the bill. Problems are listed in that order.
pub fn verify_bill(
    export: &BillExport,
    trust_key: &VerifyingKey,
    node_keys: &BTreeMap<String, VerifyingKey>,
) -> BillCheck {
    let mut check = BillCheck::default();
    let mut problem = |p: String| check.problems.push(p);
    if export.format != EXPORT_FORMAT {
        problem(format!("format {:?} is not {EXPORT_FORMAT}", export.format));
    }
    // The revision, and what it says the prices and terms are.
    let mut expected = export.query.clone();
    match &export.policy {
        Some(env) => match signing::verify(env, trust_key) {
            Ok(v) => {
                check.policy_version = Some(v.version);
                expected.prices = crate::billing::prices_of(&v.policy);
                expected.terms = crate::billing::terms_of(
                    &v.policy,
                    export.query.terms.bill_floors,
                    export.query.terms.as_of_ms,
                );
            }
            Err(e) => problem(format!(
                "the policy revision {} that priced the bill does not verify against the trust key {} ({}): {e}",
                env.version,
                key_id(trust_key),
                e.kind()
            )),
        },
        None => {
            expected.prices = metering::Prices::default();
            expected.terms = metering::Terms {
                bill_floors: export.query.terms.bill_floors,
                as_of_ms: export.query.terms.as_of_ms,
                ..metering::Terms::default()
            };
        }
    }
    if expected.prices != export.query.prices {
        problem("the bill's prices are not the signed policy revision's".into());
    }
    if expected.terms != export.query.terms {
        problem("the bill's terms (guarantees, modes, preempted work) are not the signed policy revision's".into());
    }
    // Every node's segments.
    let mut spans = Vec::new();
    for n in &export.nodes {
        check.nodes += 1;
        let key = match node_keys.get(&n.node) {
            Some(k) => Some(*k),
            None => {
                check.unpinned_nodes.push(n.node.clone());
                n.public_key
                    .as_deref()
                    .and_then(|k| signing::parse_verifying_key(k, "node key").ok())
            }
        };
        for s in &n.segments {
            check.segments += 1;
            let verdict = match key.as_ref() {
                None => Err(ProofError::NoKey { node: n.node.clone() }),
                Some(k) if s.signed.node == n.node => check_signature(&s.signed, k)
                    .and_then(|()| check_links(&s.signed, &s.intervals)),
                Some(_) => Err(ProofError::Malformed(format!(
                    "a segment of node {} is listed under node {}",
                    s.signed.node, n.node
                ))),
            };
            match verdict {
                Ok(()) => {
                    check.intervals += s.intervals.len() as u64;
                    spans.extend(s.intervals.iter().map(metering::Span::of_closed));
                }
                Err(e) => problem(e.to_string()),
            }
        }
    }
    // The bill again, from what verified.
    match metering::aggregate(&spans, &expected) {
        Ok(again) => {
            if let Some(why) = report_difference(&again, &export.report) {
                problem(format!("the bill does not follow from the signed intervals: {why}"));
            }
        }
        Err(e) => problem(format!("the bill cannot be computed again: {e}")),
    }
    check
}

/// The first difference between the recomputed report and the bill, in words.
fn report_difference(
    again: &metering::UsageReport,
    bill: &metering::UsageReport,
) -> Option<String> {
    if again == bill {
        return None;
    }
    for (a, b) in again.rows.iter().zip(&bill.rows) {
        if a != b {
            return Some(format!(
                "group {}: the intervals give {:.6} GPU-seconds costing {:.6}, the bill says {:.6} costing {:.6} ({})",
                a.group,
                a.gpu_seconds,
                a.cost,
                b.gpu_seconds,
                b.cost,
                if a.group == b.group { "same group" } else { "another group" }
            ));
        }
    }
    if again.rows.len() != bill.rows.len() {
        return Some(format!(
            "the intervals give {} groups, the bill has {}",
            again.rows.len(),
            bill.rows.len()
        ));
    }
    Some(format!(
        "totals: the intervals give {:.6} GPU-seconds costing {:.6}, the bill says {:.6} costing {:.6}",
        again.total.gpu_seconds, again.total.cost, bill.total.gpu_seconds, bill.total.cost
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::SigningKey;
    use metering::chain::{genesis, ChainLink};
    use metering::{Class, IntervalId, IntervalStart};
    use tessera_api::Isolation;

    fn signer(n: u8) -> Signer {
        Signer::new(SigningKey::from_bytes(&[n; 32]))
    }

    /// Chained intervals 1..=n of node-a's ledger `abc`.
    fn chain(n: u64) -> Vec<ClosedInterval> {
        let mut prev = genesis("abc");
        (1..=n)
            .map(|k| {
                let mut c = ClosedInterval {
                    id: IntervalId(format!("node-a-abc-{k}")),
                    start: IntervalStart {
                        container_id: format!("c{k}"),
                        tenant: "acme/ml".into(),
                        node: "node-a".into(),
                        gpu_uuid: "GPU-0".into(),
                        gpu_model: "H100-80GB".into(),
                        device_uuid: "GPU-0".into(),
                        isolation: Isolation::Gpu,
                        mig_profile: None,
                        fraction: 1.0,
                        class: Class::Guaranteed,
                        workload: None,
                        nvlink_domain: None,
                    },
                    start_wall_ms: 1_000_000 * k,
                    end_wall_ms: 1_000_000 * k + 3_600_000,
                    duration_ms: 3_600_000,
                    gpu_seconds: 3600.0,
                    reason: "exited".into(),
                    preempted: false,
                    utilization: None,
                    chain: None,
                };
                let hash = c.expected_hash(&prev, k);
                c.chain = Some(ChainLink { seq: k, prev: prev.clone(), hash: hash.clone() });
                prev = hash;
                c
            })
            .collect()
    }

    fn held(rows: &[ClosedInterval]) -> ChainHead {
        match rows.last().and_then(|r| r.chain.as_ref()) {
            Some(l) => ChainHead { ledger_id: "abc".into(), seq: l.seq, hash: l.hash.clone() },
            None => ChainHead::empty("abc"),
        }
    }

    #[test]
    fn a_signed_segment_that_extends_the_chain_is_accepted() {
        let (s, rows) = (signer(1), chain(4));
        let key = s.verifying_key();
        let first = sign_segment(&s, "node-a", "abc", &rows[..2]).expect("sign");
        assert_eq!((first.after_seq, first.head_seq), (0, 2));
        check_upload("node-a", Some(&key), &held(&[]), Some(&first), &rows[..2]).expect("first");
        let next = sign_segment(&s, "node-a", "abc", &rows[2..]).expect("sign");
        check_upload("node-a", Some(&key), &held(&rows[..2]), Some(&next), &rows[2..])
            .expect("next");
    }

    #[test]
    fn forged_replayed_reordered_unsigned_and_edited_uploads_are_refused() {
        let (s, rows) = (signer(1), chain(4));
        let key = s.verifying_key();
        let seg = sign_segment(&s, "node-a", "abc", &rows[..2]).expect("sign");
        let kind = |r: Result<(), ProofError>| r.expect_err("refused").kind();
        // Another node's key, claiming to be node-a.
        let evil = sign_segment(&signer(2), "node-a", "abc", &rows[..2]).expect("sign");
        assert_eq!(
            kind(check_upload("node-a", Some(&key), &held(&[]), Some(&evil), &rows[..2])),
            "wrong-key"
        );
        let forged = SignedSegment { key_id: seg.key_id.clone(), ..evil };
        assert_eq!(
            kind(check_upload("node-a", Some(&key), &held(&[]), Some(&forged), &rows[..2])),
            "forged"
        );
        // No key registered, no signature.
        assert_eq!(
            kind(check_upload("node-a", None, &held(&[]), Some(&seg), &rows[..2])),
            "no-key"
        );
        assert_eq!(
            kind(check_upload("node-a", Some(&key), &held(&[]), None, &rows[..2])),
            "unsigned"
        );
        // The same upload again once stored: a replay.
        let e = check_upload("node-a", Some(&key), &held(&rows[..2]), Some(&seg), &rows[..2])
            .expect_err("replay");
        assert_eq!(e.kind(), "replayed-or-out-of-order");
        assert!(e.to_string().contains("replayed"), "{e}");
        // The later segment before the earlier one: out of order.
        let later = sign_segment(&s, "node-a", "abc", &rows[2..]).expect("sign");
        let e = check_upload("node-a", Some(&key), &held(&[]), Some(&later), &rows[2..])
            .expect_err("reorder");
        assert!(e.to_string().contains("out of order"), "{e}");
        // An interval edited after signing: its link no longer recomputes.
        let mut edited = rows[..2].to_vec();
        edited[1].gpu_seconds /= 2.0;
        let e = check_upload("node-a", Some(&key), &held(&[]), Some(&seg), &edited)
            .expect_err("edited");
        assert_eq!(e.kind(), "broken-chain");
        assert!(e.to_string().contains("node-a-abc-2"), "{e}");
        // The signature covers the head: a segment cut short is refused.
        assert_eq!(
            kind(check_upload("node-a", Some(&key), &held(&[]), Some(&seg), &rows[..1])),
            "broken-chain"
        );
        // Uploaded by another node.
        assert_eq!(
            kind(check_upload("node-b", Some(&key), &held(&[]), Some(&seg), &rows[..2])),
            "malformed"
        );
    }

    #[test]
    fn node_keys_are_made_once_private_and_refused_when_open_to_others() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = node_key_path(dir.path());
        let (a, made) = load_or_create_node_key(&path).expect("made");
        assert!(made);
        let mode = std::fs::metadata(&path).expect("meta").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let (b, made) = load_or_create_node_key(&path).expect("loaded");
        assert!(!made);
        assert_eq!(a.key_id(), b.key_id(), "the same key after a restart");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let e = load_or_create_node_key(&path).expect_err("open to others").to_string();
        assert!(e.contains("0644") && e.contains("chmod 600"), "{e}");
    }
}
