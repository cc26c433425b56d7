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
//!   latest is refused with 409; versions need not be contiguous, but are bounded
//!   ([`fleet::check_version`]: at most 2^53 - 1 and at most 1,000,000 above the latest,
//!   400 otherwise) so that no push can leave no version for the next.
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
//! * The node side ([`agent::PolicyAgent`], in the `fleet` crate with the wire types, the
//!   envelope's verification and the client, so nodes build without this crate): long-polls, verifies each envelope against
//!   the pinned public key, refuses unsigned, forged and older versions (the reason goes
//!   into [`agent::AgentStatus`] and to the coordinator), hands the policy to the daemon,
//!   keeps it on disk as last-known-good, reports its applied version and health, fails
//!   over between coordinator URLs, uploads ledger intervals idempotently.
//! * Fleet usage: nodes upload closed ledger intervals keyed by (node, interval id), each
//!   upload a segment of the node's hash chain signed with the node's key, stored only if
//!   it verifies against the key the operator pinned and extends the chain held
//!   ([`usage`], [`fleet::proof`]); a retried upload never counts twice. `GET /v1/usage`
//!   rolls them up with [`metering::aggregate`], the same pure function a node's own report
//!   uses; priced, it bills floors, bursts and the topology premium.
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
//! | `POST /v1/nodes/{node}/usage` | that node | a signed [`UsageUpload`] → [`UploadOutcome`] ([`usage`]) |
//! | `GET /v1/nodes/{node}/usage/head?ledger_id=` | admin, that node | the newest chain link stored ([`usage`]) |
//! | `PUT /v1/nodes/{node}/key`, `GET /v1/nodes/{node}/key` | admin (GET: that node too) | pin a node's public key ([`usage`]) |
//! | `GET /v1/usage?from_ms=&to_ms=&by=&node=` | admin | [`FleetUsage`] |
//! | `GET /v1/usage/export?from_ms=&to_ms=&by=&node=` | admin | a bill with its proofs ([`fleet::proof::BillExport`]) |
//! | `POST /v1/usage` | admin | [`FleetUsageRequest`] (with prices) → [`FleetUsage`] |
//! | `GET /v1/audit/refusals` | admin | recent [`RefusalRecord`]s |
//! | `POST /v1/nodes/{node}/quota/admit`, `/quota/release`, `/quota/resize`, `/quota/sync` | that node | fleet quotas ([`quota_routes`]) |
//! | `GET /v1/quota/status`, `GET /v1/quota/events`, `GET /metrics` | admin | quota books, events, Prometheus gauges ([`quota_routes`]) |
//! | `GET /v1/health` | anyone | liveness, the store's (503 when it does not answer), the latest version |
//! | `GET /v1/ping` | anyone | a plain answer; clients send it before any credential on a new plain-HTTP connection |
//!
//! Errors are `{"error": "...", "path": "orgs.acme.trust"?}` ([`ErrorBody`]).
//! HTTP or HTTPS (`--tls-cert`/`--tls-key`: rustls, [`fleet::tls`]); nodes trust one CA
//! file (docs/FLEET.md, TLS).

mod app;
pub mod auth;
mod books;
mod http;
pub mod leader;
pub mod quota_routes;
pub mod server;
pub mod store;
pub mod usage;

// The wire types, the signed envelope, the client, TLS and the node agent live in the
// `fleet` crate (what nodes and the CLI build against); re-exported under their old paths.
pub(crate) use fleet::validate_name;
pub use fleet::{agent, client, signing, tls, wire};
pub use fleet::{now_ms, validate_node_id};

pub use auth::{Principal, Tokens, TokensError};
pub use fleet::{
    diff_labeled, diff_policies, AgentConfig, AgentError, AgentStatus, PolicyAgent, PolicySource,
    SignedPolicy, Verified, VerifyError,
};
pub use fleet::{
    ErrorBody, FleetUsage, FleetUsageRequest, NodeRecord, NodeReport, NodeUsage, RefusalRecord,
    RevisionSummary, UploadOutcome, UsageUpload, MAX_UPLOAD_BATCH,
};
pub use server::{CoordinatorError, RunningCoordinator, ServeOptions};
pub use store::{PolicyStore, StoreError, StoreSpec};
