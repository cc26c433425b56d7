//! The coordinator's state ([`Coordinator`]), handed to every route: the store, the
//! signing key, the credentials, who was heard from when, the refusal log, the quota books;
//! who is asking (every route's first check) and the actions more than one route takes
//! (pushing a policy, the newest verified revision, fleet usage). Below the route modules
//! (`server`, `quota`), above the plumbing (`http`) and the quota state (`books`).

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use ed25519_dalek::SigningKey;
use tokio::sync::watch;
use tracing::{info, warn};

use crate::auth::{bearer, Principal, Tokens};
use crate::books::QuotaState;
use crate::http::{ApiErr, ApiResult};
use crate::now_ms;
use crate::signing::{self, Signer, Verified};
use crate::store::{self, LatestRx, PolicyStore, StoreError};
use crate::wire::{ErrorBody, FleetUsage, NodeUsage, RefusalRecord, RevisionSummary};

/// Refusals kept for `GET /v1/audit/refusals`.
const REFUSALS_KEPT: usize = 256;

/// What every route handler is handed.
pub(crate) type App = State<Arc<Coordinator>>;

/// The coordinator's state: store, key, credentials, and the watchers' channel.
pub struct Coordinator {
    pub(crate) store: Arc<dyn PolicyStore>,
    pub(crate) latest: LatestRx,
    pub(crate) signer: Signer,
    pub(crate) tokens: Tokens,
    /// Node → last poll or report on this coordinator (not persisted: reports are).
    contacts: Mutex<HashMap<String, u64>>,
    refusals: Mutex<VecDeque<RefusalRecord>>,
    pub(crate) waiting: AtomicUsize,
    pub(crate) closing: watch::Sender<bool>,
    /// Serializes this coordinator's own pushes (the store's CAS handles other coordinators).
    push_lock: tokio::sync::Mutex<()>,
    /// Fleet quotas: the books and what wakes waiting gang members.
    pub(crate) quota: QuotaState,
}

impl std::fmt::Debug for Coordinator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Coordinator")
            .field("store", &self.store.kind())
            .field("key_id", &self.signer.key_id())
            .field("waiting", &self.waiting_watchers())
            .finish_non_exhaustive()
    }
}

impl Coordinator {
    pub fn new(store: Arc<dyn PolicyStore>, key: SigningKey, tokens: Tokens) -> Arc<Coordinator> {
        Coordinator::with_quota_lease_ttl(store, key, tokens, crate::books::DEFAULT_LEASE_TTL)
    }

    /// As [`Coordinator::new`], handing quota leases good for `lease_ttl`.
    pub fn with_quota_lease_ttl(
        store: Arc<dyn PolicyStore>,
        key: SigningKey,
        tokens: Tokens,
        lease_ttl: Duration,
    ) -> Arc<Coordinator> {
        let opts = crate::books::QuotaOptions { lease_ttl, ..Default::default() };
        Coordinator::with_quota(store, key, tokens, opts)
    }

    /// As [`Coordinator::new`], taking part in fleet quotas as `opts` say: on a store that
    /// coordinators share (etcd) the books are kept there and decided by the one the
    /// election makes leader; on SQLite this coordinator decides alone.
    pub fn with_quota(
        store: Arc<dyn PolicyStore>,
        key: SigningKey,
        tokens: Tokens,
        opts: crate::books::QuotaOptions,
    ) -> Arc<Coordinator> {
        let latest = store.subscribe();
        let backend = store.quota_backend();
        let (closing, _) = watch::channel(false);
        Arc::new(Coordinator {
            store,
            latest,
            signer: Signer::new(key),
            tokens,
            contacts: Mutex::new(HashMap::new()),
            refusals: Mutex::new(VecDeque::new()),
            waiting: AtomicUsize::new(0),
            closing,
            push_lock: tokio::sync::Mutex::new(()),
            quota: QuotaState::with(opts, backend),
        })
    }

    /// Long polls waiting right now.
    pub fn waiting_watchers(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// The latest version watchers see.
    pub fn latest_version(&self) -> Option<u64> {
        self.latest.borrow().as_ref().map(|p| p.envelope.version)
    }

    pub fn store(&self) -> &Arc<dyn PolicyStore> {
        &self.store
    }

    pub fn verifying_key(&self) -> ed25519_dalek::VerifyingKey {
        self.signer.verifying_key()
    }

    /// Recent refusals, oldest first.
    pub fn refusals(&self) -> Vec<RefusalRecord> {
        self.refusals.lock().map(|r| r.iter().cloned().collect()).unwrap_or_default()
    }

    /// Refuse a request: logged, kept for `GET /v1/audit/refusals`, answered `status`.
    pub(crate) fn refuse(
        &self,
        who: String,
        action: &str,
        why: String,
        status: StatusCode,
    ) -> ApiErr {
        warn!(who = %who, action = %action, why = %why, status = status.as_u16(), "request refused");
        let rec = RefusalRecord {
            time_ms: now_ms(),
            who: who.clone(),
            action: action.to_string(),
            why: why.clone(),
            status: status.as_u16(),
        };
        if let Ok(mut r) = self.refusals.lock() {
            if r.len() >= REFUSALS_KEPT {
                r.pop_front();
            }
            r.push_back(rec);
        }
        ApiErr::with_body(status, ErrorBody { error: why, path: None, who: Some(who) })
    }

    pub(crate) fn authenticate(
        &self,
        headers: &HeaderMap,
        peer: SocketAddr,
        action: &str,
    ) -> ApiResult<Principal> {
        let Some(value) = headers.get(header::AUTHORIZATION) else {
            return Err(self.refuse(
                format!("anonymous ({peer})"),
                action,
                "missing credentials: send Authorization: Bearer <token>".into(),
                StatusCode::UNAUTHORIZED,
            ));
        };
        let token = value.to_str().ok().and_then(bearer);
        match token.and_then(|t| self.tokens.authenticate(t)) {
            Some(p) => Ok(p),
            None => Err(self.refuse(
                format!("unknown credential ({peer})"),
                action,
                "the bearer token is not one this coordinator knows".into(),
                StatusCode::UNAUTHORIZED,
            )),
        }
    }

    pub(crate) fn require_admin(
        &self,
        headers: &HeaderMap,
        peer: SocketAddr,
        action: &str,
    ) -> ApiResult<String> {
        match self.authenticate(headers, peer, action)? {
            Principal::Admin(name) => Ok(name),
            p @ Principal::Node(_) => Err(self.refuse(
                p.to_string(),
                action,
                format!("{action} needs an admin credential; {p} holds a node credential"),
                StatusCode::FORBIDDEN,
            )),
        }
    }

    /// Only the node itself; admins too when `admin_ok`.
    pub(crate) fn require_node(
        &self,
        headers: &HeaderMap,
        peer: SocketAddr,
        action: &str,
        node: &str,
        admin_ok: bool,
    ) -> ApiResult<Principal> {
        let p = self.authenticate(headers, peer, action)?;
        match &p {
            Principal::Node(n) if n == node => Ok(p),
            Principal::Admin(_) if admin_ok => Ok(p),
            Principal::Node(_) => Err(self.refuse(
                p.to_string(),
                action,
                format!("{p} may act only as itself, not as node {node:?}"),
                StatusCode::FORBIDDEN,
            )),
            Principal::Admin(_) => Err(self.refuse(
                p.to_string(),
                action,
                format!(
                    "{action} needs the credential of node {node:?}; admins cannot act as a node"
                ),
                StatusCode::FORBIDDEN,
            )),
        }
    }

    pub(crate) fn touch(&self, node: &str) {
        if let Ok(mut c) = self.contacts.lock() {
            c.insert(node.to_string(), now_ms());
        }
    }

    pub(crate) fn contact(&self, node: &str) -> Option<u64> {
        self.contacts.lock().ok().and_then(|c| c.get(node).copied())
    }

    /// Every node heard from by this coordinator, with when.
    pub(crate) fn contacts(&self) -> Vec<(String, u64)> {
        self.contacts
            .lock()
            .map(|c| c.iter().map(|(n, t)| (n.clone(), *t)).collect())
            .unwrap_or_default()
    }

    /// Validate, sign and append a pushed policy.
    /// (201 when a revision was added, 200 when it was already the latest.)
    pub async fn push_policy(
        &self,
        bytes: &[u8],
        author: &str,
    ) -> ApiResult<(StatusCode, RevisionSummary)> {
        if bytes.len() > fleet::MAX_POLICY_BYTES {
            return Err(ApiErr::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "the policy is {} bytes; a coordinator accepts at most {} (fleet::MAX_POLICY_BYTES)",
                    bytes.len(),
                    fleet::MAX_POLICY_BYTES
                ),
            ));
        }
        let parsed = policy::Policy::parse(bytes, "pushed policy").map_err(|e| {
            ApiErr::with_body(
                StatusCode::BAD_REQUEST,
                ErrorBody {
                    error: e.to_string(),
                    path: e.json_path().map(str::to_string),
                    who: None,
                },
            )
        })?;
        let bad_version = |e: fleet::VersionError| {
            let status = match e {
                fleet::VersionError::NotNewer { .. } => StatusCode::CONFLICT,
                _ => StatusCode::BAD_REQUEST,
            };
            ApiErr::with_body(
                status,
                ErrorBody { error: e.to_string(), path: Some("version".into()), who: None },
            )
        };
        // The absolute bounds first: no store is asked about a version that cannot be.
        fleet::check_version(parsed.version(), None).or_else(|e| match e {
            fleet::VersionError::TooFar { .. } => Ok(()),
            e => Err(bad_version(e)),
        })?;
        let _serial = self.push_lock.lock().await;
        for _ in 0..5 {
            let latest = self.store.latest().await.map_err(ApiErr::store)?;
            if let Some(l) = &latest {
                if l.version == parsed.version() && l.digest == parsed.digest() {
                    // The same push again (a retry) is done only if the stored revision is
                    // one this coordinator's key signed: a planted one is no success.
                    return match signing::verify(l, &self.signer.verifying_key()) {
                        Ok(_) => Ok((StatusCode::OK, RevisionSummary::from(l))),
                        Err(e) => Err(ApiErr::new(
                            StatusCode::CONFLICT,
                            format!(
                                "the store already holds a revision {} with these bytes, but it does not verify \
                                 against this coordinator's key ({}: {e}); nodes refuse it. Push the policy \
                                 again with \"version\" above {}",
                                l.version,
                                e.kind(),
                                l.version
                            ),
                        )),
                    };
                }
            }
            fleet::check_version(parsed.version(), latest.as_ref().map(|l| l.version))
                .map_err(bad_version)?;
            let env = signing::sign_parsed(self.signer.key(), &parsed, bytes, author, now_ms());
            match self.store.append(latest.as_ref().map(|l| l.version), env.clone()).await {
                Ok(()) => {
                    info!(version = env.version, author = %env.author, digest = %env.digest, "policy pushed");
                    return Ok((StatusCode::CREATED, RevisionSummary::from(&env)));
                }
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(ApiErr::store(e)),
            }
        }
        Err(ApiErr::new(
            StatusCode::CONFLICT,
            "another coordinator kept pushing at the same time; retry",
        ))
    }

    /// The newest revision that verifies against this coordinator's key (what nodes
    /// enforce), and why each newer one was skipped.
    pub(crate) async fn latest_verified(&self) -> ApiResult<(Option<Verified>, Vec<String>)> {
        let key = self.signer.verifying_key();
        let mut skipped = Vec::new();
        let Some(latest) = self.store.latest().await.map_err(ApiErr::store)? else {
            return Ok((None, skipped));
        };
        match signing::verify(&latest, &key) {
            Ok(v) => return Ok((Some(v), skipped)),
            Err(e) => skipped.push(format!("version {}: {}: {e}", latest.version, e.kind())),
        }
        let history = self.store.history().await.map_err(ApiErr::store)?;
        for rev in history.iter().rev().filter(|r| r.version < latest.version) {
            match signing::verify(rev, &key) {
                Ok(v) => return Ok((Some(v), skipped)),
                Err(e) => skipped.push(format!("version {}: {}: {e}", rev.version, e.kind())),
            }
        }
        Ok((None, skipped))
    }

    /// `q` priced with the newest revision that verifies against this coordinator's key
    /// (the policy nodes enforce): its prices, its floors (billed up to `now_ms`), its
    /// billing modes. Also that revision's envelope and version, and why newer ones were
    /// skipped. Without a verified revision nothing is priced.
    pub(crate) async fn priced_query(
        &self,
        mut q: metering::UsageQuery,
        now_ms: u64,
    ) -> ApiResult<(metering::UsageQuery, Option<crate::SignedPolicy>, Option<u64>, Vec<String>)>
    {
        q.validate().map_err(|e| ApiErr::bad_request(e.to_string()))?;
        let (verified, skipped) = self.latest_verified().await?;
        Ok(match verified {
            Some(v) => {
                q.prices = fleet::billing::prices_of(&v.policy);
                q.terms = fleet::billing::terms_of(&v.policy, true, Some(now_ms));
                (q, Some(v.envelope), Some(v.version), skipped)
            }
            None => {
                q.prices = metering::Prices::default();
                q.terms = metering::Terms {
                    bill_floors: true,
                    as_of_ms: Some(now_ms),
                    ..metering::Terms::default()
                };
                (q, None, None, skipped)
            }
        })
    }

    pub(crate) async fn fleet_usage(
        &self,
        q: metering::UsageQuery,
        only: Option<Vec<String>>,
        price_with_policy: bool,
    ) -> ApiResult<FleetUsage> {
        q.validate().map_err(|e| ApiErr::bad_request(e.to_string()))?;
        let (q, priced_with, skipped) = if price_with_policy {
            let (q, _, version, why) = self.priced_query(q, now_ms()).await?;
            for w in &why {
                warn!("fleet usage: not pricing with {w}");
            }
            (q, version, why)
        } else {
            (q, None, Vec::new())
        };
        let rows = self.store.usage_intervals(q.from_ms, q.to_ms).await.map_err(ApiErr::store)?;
        let mut by_node: std::collections::BTreeMap<String, Vec<metering::Span>> =
            Default::default();
        for (node, i) in &rows {
            if only.as_ref().is_none_or(|o| o.contains(node)) {
                by_node.entry(node.clone()).or_default().push(store::span_of(i));
            }
        }
        let all: Vec<metering::Span> = by_node.values().flatten().cloned().collect();
        let report = metering::aggregate(&all, &q)
            .map_err(|e| ApiErr::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
        // Each node's share: its containers' consumption (the floors are the fleet's).
        let node_query = metering::UsageQuery {
            terms: metering::Terms { bill_floors: false, ..q.terms.clone() },
            ..q.clone()
        };
        let mut nodes = Vec::with_capacity(by_node.len());
        for (node, spans) in &by_node {
            let r = metering::aggregate(spans, &node_query)
                .map_err(|e| ApiErr::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
            nodes.push(NodeUsage {
                node: node.clone(),
                gpu_seconds: r.total.gpu_seconds,
                cost: r.total.cost,
                intervals: r.total.intervals,
            });
        }
        Ok(FleetUsage { report, nodes, priced_with, skipped })
    }
}
