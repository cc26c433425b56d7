//! The node side of the Tessera fleet: everything a node (`tesserad`) and the CLI need to
//! talk to the fleet coordinator, and nothing of the coordinator itself (no server, no
//! SQLite or etcd store, so no etcd-client, tonic or prost in a node's build).
//!
//! * [`wire`]: the coordinator's JSON bodies ([`NodeReport`], [`NodeRecord`],
//!   [`UsageUpload`], [`FleetUsage`], ...), shared with the `coordinator` crate.
//! * [`signing`]: the signed policy envelope ([`SignedPolicy`]), its canonical message,
//!   signing (the coordinator's side) and verification against a pinned key ([`verify`],
//!   what every node does), key files.
//! * [`client::Client`]: the admin and node HTTP client (failover between URLs, TLS with
//!   [`tls::client_config`]); [`client::blocking`] for the CLI.
//! * [`agent::PolicyAgent`]: long-polls, verifies each envelope against the pinned public
//!   key, refuses unsigned, forged and older versions (the reason goes into
//!   [`agent::AgentStatus`] and to the coordinator), hands the policy to the daemon,
//!   keeps it on disk as last-known-good, reports its applied version and health, fails
//!   over between coordinator URLs, uploads ledger intervals idempotently.
//!
//! The coordinator's routes and semantics are documented in the `coordinator` crate.

pub mod agent;
pub mod billing;
pub mod client;
mod diff;
mod http;
pub mod proof;
pub mod signing;

pub mod tls;
/// The quota protocol's bodies (defined beside the model in the `quota` crate).
pub use quota::wire as quota_wire;
pub mod wire;

pub use agent::{AgentConfig, AgentError, AgentStatus, PolicyAgent, PolicySource};
pub use diff::{diff_labeled, diff_policies};
pub use signing::{verify, SignedPolicy, Verified, VerifyError};
pub use wire::{
    check_version, VersionError, MAX_POLICY_BYTES, MAX_POLICY_VERSION, MAX_VERSION_STEP,
};
pub use wire::{
    ErrorBody, FleetUsage, FleetUsageRequest, NodeRecord, NodeReport, NodeUsage, RefusalRecord,
    RegisterNodeKey, RevisionSummary, UploadOutcome, UsageUpload, MAX_UPLOAD_BATCH,
};

/// Milliseconds since the Unix epoch (0 if the clock is before 1970).
pub use tessera_api::time::now_ms;

/// A node id as it appears in tokens, routes and store keys: 1 to 253 characters of
/// `[A-Za-z0-9._-]`, not starting with `.` or `-`.
pub fn validate_node_id(node: &str) -> Result<(), String> {
    validate_name("node id", node)
}

/// Names that become store keys and URL segments: 1 to 253 characters of
/// `[A-Za-z0-9._-]`, not starting with `.` or `-` (so never `.`, `..` or an option).
pub fn validate_name(what: &str, s: &str) -> Result<(), String> {
    if s.is_empty() || s.len() > 253 {
        return Err(format!("{what} {s:?} must be 1 to 253 characters"));
    }
    if s.starts_with('.') || s.starts_with('-') {
        return Err(format!("{what} {s:?} must not start with '.' or '-'"));
    }
    if let Some(c) =
        s.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "{what} {s:?} contains {c:?}; allowed: letters, digits, '.', '_', '-'"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ids_are_safe_names() {
        for ok in ["node-a", "gpu01.rack3", "N_1"] {
            assert!(validate_node_id(ok).is_ok(), "{ok}");
        }
        for bad in ["", ".", "..", "-x", "a/b", "a b", "é", &"x".repeat(254)] {
            assert!(validate_node_id(bad).is_err(), "{bad:?}");
        }
    }
}
