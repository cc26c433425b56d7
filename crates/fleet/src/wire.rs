//! The JSON shapes of the coordinator's HTTP API, shared by the server, the admin
//! client and the node agent.

use serde::{Deserialize, Serialize};

use crate::signing::SignedPolicy;

/// Most intervals one usage upload may carry.
pub const MAX_UPLOAD_BATCH: usize = 1000;

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
    pub key_id: String,
}

impl From<&SignedPolicy> for RevisionSummary {
    fn from(s: &SignedPolicy) -> Self {
        RevisionSummary {
            version: s.version,
            author: s.author.clone(),
            created_ms: s.created_ms,
            digest: s.digest.clone(),
            key_id: s.key_id.clone(),
        }
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

/// A batch of closed ledger intervals from one node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageUpload {
    pub intervals: Vec<metering::ClosedInterval>,
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
