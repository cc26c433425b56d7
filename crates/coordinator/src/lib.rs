//! The Tessera fleet coordinator and the node-side agent that follows it.
//!
//! # What it does
//!
//! * An admin pushes a policy ([`client::Client::push_policy`], `POST /v1/policies`). The
//!   coordinator validates it with [`policy::Policy::parse`] (errors name the JSON path),
//!   checks that the policy's own `version` is greater than the latest stored one, signs
//!   it with its ed25519 key ([`signing::sign`]) and appends it to the store as an
//!   immutable revision with a compare-and-set on the latest version.
//! * **Versions are the admin's**: the coordinator never rewrites a policy's bytes (the
//!   signature covers exactly what the admin wrote, so its digest equals
//!   `Policy::digest()` on every node). A push whose `version` is not greater than the
//!   latest is refused with 409; versions need not be contiguous.
//! * Nodes watch with a long poll, `GET /v1/policies/latest?newer_than=N&timeout_ms=T`:
//!   answered as soon as a version > N exists (200 with the [`SignedPolicy`] envelope),
//!   204 after T. Every waiting poll is parked on one `tokio::sync::watch` channel that
//!   holds the latest envelope already serialized, so a push wakes 10,000 watchers
//!   without touching the store.
//! * Stores ([`store`]): SQLite (embedded default) or etcd (several coordinators on one
//!   etcd serve the same revisions; each one's etcd watch on the policy prefix wakes its
//!   own long polls).
//! * Credentials ([`auth`]): bearer tokens from a JSON file, admins and nodes apart. A
//!   node token can watch the policy and report or upload usage as its own node only;
//!   every refusal is logged (`tracing` warn with who and why) and kept in a ring that
//!   admins read at `GET /v1/audit/refusals`.
//! * The node side ([`agent::PolicyAgent`]): long-polls, verifies each envelope against
//!   the pinned public key, refuses unsigned, forged and older versions (the reason goes
//!   into [`agent::AgentStatus`] and to the coordinator), hands the policy to the daemon,
//!   keeps it on disk as last-known-good, reports its applied version and health, fails
//!   over between coordinator URLs, uploads ledger intervals idempotently.
//! * Fleet usage: nodes upload closed ledger intervals keyed by (node, interval id);
//!   a retried upload never counts twice. `GET /v1/usage` rolls them up with
//!   [`metering::aggregate`], the same pure function a node's own report uses.
//!
//! # HTTP API
//!
//! | route | who | what |
//! |---|---|---|
//! | `POST /v1/policies` | admin | push (body: policy JSON; header `x-tessera-author`) |
//! | `GET /v1/policies` | admin | history: [`RevisionSummary`] list, oldest first |
//! | `GET /v1/policies/{version}` | admin | one [`SignedPolicy`] |
//! | `GET /v1/policies/latest?newer_than=&timeout_ms=` | node, admin | long poll |
//! | `POST /v1/nodes/{node}/report` | that node | [`NodeReport`] |
//! | `GET /v1/nodes` | admin | [`NodeRecord`] list |
//! | `GET /v1/nodes/{node}` | admin, that node | one [`NodeRecord`] |
//! | `POST /v1/nodes/{node}/usage` | that node | [`UsageUpload`] → [`UploadOutcome`] |
//! | `GET /v1/usage?from_ms=&to_ms=&by=&node=` | admin | [`FleetUsage`] |
//! | `POST /v1/usage` | admin | [`FleetUsageRequest`] (with prices) → [`FleetUsage`] |
//! | `GET /v1/audit/refusals` | admin | recent [`RefusalRecord`]s |
//! | `GET /v1/health` | anyone | liveness and the latest version |
//!
//! Errors are `{"error": "...", "path": "orgs.acme.trust"?}` ([`ErrorBody`]).
//! Plain HTTP only: TLS (and mTLS credentials) are not implemented here; run the
//! coordinator behind a TLS-terminating proxy or on a trusted network.

pub mod agent;
pub mod auth;
pub mod client;
mod diff;
mod http;
pub mod server;
pub mod signing;
pub mod store;
pub mod tls;
mod wire;

pub use agent::{AgentConfig, AgentError, AgentStatus, PolicyAgent, PolicySource};
pub use auth::{Principal, Tokens, TokensError};
pub use diff::{diff_labeled, diff_policies};
pub use server::{CoordinatorError, RunningCoordinator, ServeOptions};
pub use signing::{SignedPolicy, Verified, VerifyError};
pub use store::{PolicyStore, StoreError, StoreSpec};
pub use wire::{
    ErrorBody, FleetUsage, FleetUsageRequest, NodeRecord, NodeReport, NodeUsage, RefusalRecord,
    RevisionSummary, UploadOutcome, UsageUpload, MAX_UPLOAD_BATCH,
};

/// Milliseconds since the Unix epoch (0 if the clock is before 1970).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// A node id as it appears in tokens, routes and store keys: 1 to 253 characters of
/// `[A-Za-z0-9._-]`, not starting with `.` or `-`.
pub fn validate_node_id(node: &str) -> Result<(), String> {
    validate_name("node id", node)
}

/// Names that become store keys and URL segments: 1 to 253 characters of
/// `[A-Za-z0-9._-]`, not starting with `.` or `-` (so never `.`, `..` or an option).
pub(crate) fn validate_name(what: &str, s: &str) -> Result<(), String> {
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
