//! The JSON shapes of the coordinator's HTTP API, shared by the server, the admin
//! client and the node agent.

use serde::{Deserialize, Serialize};

use crate::signing::SignedPolicy;

/// Most intervals one usage upload may carry.
pub const MAX_UPLOAD_BATCH: usize = 1000;

/// The largest policy version a coordinator accepts: 2^53 - 1, the largest integer every
/// JSON reader holds exactly (and far below SQLite's and etcd's integer limits).
pub const MAX_POLICY_VERSION: u64 = (1 << 53) - 1;

/// The most a push may move the version above the latest revision (or above 0 for the
/// first push). Versions only move forward, so an unbounded jump (say to 2^64 - 1) would
/// leave no version for any later push: with this step the channel outlives
/// 9 billion pushes.
pub const MAX_VERSION_STEP: u64 = 1_000_000;

/// The largest policy document a coordinator accepts, in bytes. Its signed envelope
/// (base64, about 1.4 MB) fits in one etcd request under etcd's default
/// `--max-request-bytes` (1.5 MiB).
pub const MAX_POLICY_BYTES: usize = 1 << 20;

/// Whether `version` may follow `latest` (`None`: no revision yet): above it, at most
/// [`MAX_VERSION_STEP`] above it, and at most [`MAX_POLICY_VERSION`]. The error says which
/// bound was crossed and what to use instead.
pub fn check_version(version: u64, latest: Option<u64>) -> Result<(), VersionError> {
    if version == 0 {
        return Err(VersionError::Zero);
    }
    if version > MAX_POLICY_VERSION {
        return Err(VersionError::TooLarge { version });
    }
    let base = latest.unwrap_or(0);
    if latest.is_some_and(|l| version <= l) {
        return Err(VersionError::NotNewer { version, latest: base });
    }
    if version - base > MAX_VERSION_STEP {
        return Err(VersionError::TooFar { version, latest });
    }
    Ok(())
}

/// Why a policy version cannot be pushed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VersionError {
    #[error("version 0 is not a revision: policy versions start at 1")]
    Zero,
    #[error(
        "version {version} is above the largest policy version {MAX_POLICY_VERSION} (2^53 - 1)"
    )]
    TooLarge { version: u64 },
    #[error(
        "older or equal version: the policy says version {version} but the latest revision is \
         {latest}; set \"version\" above {latest}"
    )]
    NotNewer { version: u64, latest: u64 },
    #[error(
        "version {version} jumps more than {MAX_VERSION_STEP} above {}: versions only move forward, \
         so a jump that large could use up the versions left for later pushes; use at most {}",
        latest.map_or_else(|| "0 (no revision yet)".to_string(), |l| format!("the latest revision {l}")),
        latest.unwrap_or(0) + MAX_VERSION_STEP
    )]
    TooFar { version: u64, latest: Option<u64> },
}

/// Every error answer: what went wrong and, for an invalid policy, where.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: String,
    /// The JSON path of the offending value of a pushed policy (empty: the top level).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// For refusals: who was refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub who: Option<String>,
}

/// One revision in the history (the envelope without the policy bytes).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevisionSummary {
    pub version: u64,
    pub author: String,
    pub created_ms: u64,
    pub digest: String,
    /// The key id the envelope claims. Trust it only when `problem` is `None`.
    pub key_id: String,
    /// `None`: the coordinator verified the revision against its own signing key (the key
    /// nodes pin). Otherwise why it does not verify (`forged: ...`, `wrong-key: ...`):
    /// nodes refuse such a revision, and it is never used for pricing or push comparisons.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
}

impl From<&SignedPolicy> for RevisionSummary {
    fn from(s: &SignedPolicy) -> Self {
        RevisionSummary {
            version: s.version,
            author: s.author.clone(),
            created_ms: s.created_ms,
            digest: s.digest.clone(),
            key_id: s.key_id.clone(),
            problem: None,
        }
    }
}

impl RevisionSummary {
    /// The summary of `s` as checked against `key`: `problem` says why it does not verify.
    pub fn checked(s: &SignedPolicy, key: &ed25519_dalek::VerifyingKey) -> Self {
        let mut r = RevisionSummary::from(s);
        if let Err(e) = crate::signing::verify(s, key) {
            r.problem = Some(format!("{}: {e}", e.kind()));
        }
        r
    }
}

/// What a node tells the coordinator about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct NodeReport {
    /// The policy version the node enforces (`None`: none yet).
    pub applied_version: Option<u64>,
    #[serde(default)]
    pub applied_digest: Option<String>,
    /// Where the applied policy came from: `coordinator`, `last-known-good`, `file`, `none`.
    pub source: String,
    /// `ok` or `degraded` (see [`crate::AgentStatus::health`]).
    pub health: String,
    /// The last problem the node saw (unreachable coordinator, apply failure, ...).
    #[serde(default)]
    pub last_error: Option<String>,
    /// The last revision the node refused and why (forged, unsigned, older, ...).
    #[serde(default)]
    pub last_rejection: Option<String>,
}

/// What the coordinator knows about a node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub node: String,
    pub applied_version: Option<u64>,
    #[serde(default)]
    pub applied_digest: Option<String>,
    pub source: String,
    /// What the node reported (`ok`, `degraded`), `unknown` before its first report.
    pub health: String,
    #[serde(default)]
    pub last_error: Option<String>,
    #[serde(default)]
    pub last_rejection: Option<String>,
    /// When the node's last report was stored.
    pub last_report_ms: Option<u64>,
    /// The latest of its last report and (on the answering coordinator) its last poll.
    pub last_contact_ms: Option<u64>,
    /// True when the node has not been heard from in `coordinator::server::STALE_AFTER_MS` (two minutes).
    #[serde(default)]
    pub stale: bool,
}

impl NodeRecord {
    /// A node never heard from: no applied version, health `unknown`, stale.
    pub fn unknown(node: &str) -> Self {
        NodeRecord {
            node: node.to_string(),
            applied_version: None,
            applied_digest: None,
            source: "none".into(),
            health: "unknown".into(),
            last_error: None,
            last_rejection: None,
            last_report_ms: None,
            last_contact_ms: None,
            stale: true,
        }
    }
}

/// A batch of closed ledger intervals from one node: consecutive links of one ledger's
/// chain, and the node's signature over them ([`crate::proof`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageUpload {
    pub intervals: Vec<metering::ClosedInterval>,
    /// The node's signature over the segment; an upload without one is refused.
    #[serde(default)]
    pub segment: Option<crate::proof::SignedSegment>,
}

/// `PUT /v1/nodes/{node}/key`: pin a node's public key (admin).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegisterNodeKey {
    /// The node's ed25519 public key, 64 hex digits or base64.
    pub public_key: String,
    /// Replace a different key already registered (a node whose key was lost or rotated).
    #[serde(default)]
    pub replace: bool,
}

/// What an upload did. A retry of a batch whose answer was lost reports the intervals
/// as duplicates and counts nothing twice.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UploadOutcome {
    /// Newly stored.
    pub accepted: u64,
    /// Already stored with the same content (a retry).
    pub duplicates: u64,
    /// Ids already stored with different content: the first upload is kept.
    #[serde(default)]
    pub conflicts: Vec<String>,
}

/// A fleet usage query with prices (`POST /v1/usage`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FleetUsageRequest {
    pub query: metering::UsageQuery,
    /// Only these nodes (all when absent).
    #[serde(default)]
    pub nodes: Option<Vec<String>>,
    /// Price with the newest revision that verifies against the coordinator's signing key
    /// (the policy nodes enforce) instead of `query.prices`.
    #[serde(default)]
    pub price_with_policy: bool,
}

/// One node's share of a fleet report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeUsage {
    pub node: String,
    pub gpu_seconds: f64,
    pub cost: f64,
    pub intervals: u64,
}

/// Fleet-wide usage: the same report a node makes of its own ledger, over every
/// uploaded interval, plus each node's total.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FleetUsage {
    pub report: metering::UsageReport,
    pub nodes: Vec<NodeUsage>,
    /// With `price_with_policy`: the version whose prices were used (`None`: no verified
    /// revision, so no prices).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priced_with: Option<u64>,
    /// Newer revisions skipped for pricing because they do not verify, and why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<String>,
}

/// A refused request, as kept for `GET /v1/audit/refusals`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RefusalRecord {
    pub time_ms: u64,
    /// `admin:alice`, `node:node-a`, or `anonymous (127.0.0.1:5000)`.
    pub who: String,
    /// `POST /v1/policies`.
    pub action: String,
    pub why: String,
    pub status: u16,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_bounded() {
        assert_eq!(check_version(1, None), Ok(()));
        assert_eq!(check_version(0, None), Err(VersionError::Zero));
        assert_eq!(
            check_version(u64::MAX, Some(3)),
            Err(VersionError::TooLarge { version: u64::MAX })
        );
        assert!(matches!(check_version(3, Some(3)), Err(VersionError::NotNewer { .. })));
        assert_eq!(check_version(MAX_VERSION_STEP, None), Ok(()));
        let e = check_version(MAX_VERSION_STEP + 4, Some(3)).unwrap_err();
        assert!(e.to_string().contains("use at most 1000003"), "{e}");
        assert_eq!(check_version(MAX_POLICY_VERSION, Some(MAX_POLICY_VERSION - 1)), Ok(()));
    }
}
