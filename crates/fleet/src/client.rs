//! The admin side of the coordinator's API, for `tessera policy push|history|diff`,
//! `tessera nodes` and `tessera usage --coordinator`.
//!
//! [`Client`] is async; [`blocking`] wraps each call for a synchronous CLI. Given several
//! URLs, a call that gets no HTTP answer from one coordinator tries the next (a retried
//! push of the same bytes is answered with the existing revision, not a second one).

use std::time::Duration;

use hyper::Method;
use serde::de::DeserializeOwned;

use crate::http::{self, Endpoint, HttpError};
use crate::signing::SignedPolicy;
use crate::wire::{
    ErrorBody, FleetUsage, FleetUsageRequest, NodeRecord, RefusalRecord, RevisionSummary,
};

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error(transparent)]
    Http(#[from] HttpError),
    /// The coordinator answered with an error.
    #[error("coordinator answered {status}: {}{}", error.error, at(&error.path))]
    Api { status: u16, error: ErrorBody },
    #[error("unexpected answer from the coordinator: {0}")]
    Protocol(String),
    #[error("{0}")]
    Usage(String),
    /// A revision that does not verify against the key it was checked with.
    #[error("policy version {version} does not verify ({kind}): {why}; not used")]
    Unverified { version: u64, kind: &'static str, why: String },
}

fn at(path: &Option<String>) -> String {
    match path.as_deref() {
        Some("") => " (at the top level)".into(),
        Some(p) => format!(" (at {p})"),
        None => String::new(),
    }
}

impl ClientError {
    /// The HTTP status, when the coordinator answered.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Api { status, .. } => Some(*status),
            _ => None,
        }
    }
}

/// An admin (or node) client of one or more coordinators.
#[derive(Clone)]
pub struct Client {
    endpoints: Vec<Endpoint>,
    pool: http::Pool,
    token: String,
    timeout: Duration,
    /// The endpoint that answered last (shared by clones): calls start there, so a client
    /// that failed over keeps using the coordinator that answers instead of trying the dead
    /// one first every time.
    preferred: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let urls: Vec<&str> = self.endpoints.iter().map(|e| e.url.as_str()).collect();
        f.debug_struct("Client").field("urls", &urls).finish_non_exhaustive()
    }
}

impl Client {
    /// `urls`: one or more `http[s]://HOST:PORT` (a comma-separated string is split).
    /// `https://` needs [`Client::with_tls`].
    pub fn new<S: AsRef<str>>(urls: &[S], token: &str) -> Result<Client, ClientError> {
        let endpoints = urls
            .iter()
            .flat_map(|u| {
                u.as_ref()
                    .split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_string)
                    .collect::<Vec<_>>()
            })
            .map(|u| Endpoint::parse(&u))
            .collect::<Result<Vec<_>, _>>()?;
        if endpoints.is_empty() {
            return Err(ClientError::Usage("no coordinator url given".into()));
        }
        Ok(Client {
            endpoints,
            pool: http::Pool::default(),
            token: token.to_string(),
            timeout: Duration::from_secs(30),
            preferred: Default::default(),
        })
    }

    /// Verify `https://` coordinators against this TLS client configuration
    /// ([`crate::tls::client_config`]). Idle connections made before are dropped.
    pub fn with_tls(mut self, tls: Option<std::sync::Arc<rustls::ClientConfig>>) -> Self {
        self.pool = http::Pool::new(tls);
        self
    }

    /// Bound each request (default 30 s).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    async fn raw(
        &self,
        method: Method,
        path: &str,
        extra: &[(&'static str, String)],
        body: Option<Vec<u8>>,
        timeout: Duration,
    ) -> Result<(u16, bytes::Bytes), ClientError> {
        self.send(method, path, &self.token, extra, body, timeout, false).await
    }

    /// One request to the coordinators, starting with the one that answered last and
    /// moving on to the next when one gives no HTTP answer (or, with `unavailable_moves_on`,
    /// answers 502, 503 or 504: it is stopping, or cannot reach the coordinator that
    /// decides); the last answer or error when none does better.
    #[allow(clippy::too_many_arguments)]
    async fn send(
        &self,
        method: Method,
        path: &str,
        token: &str,
        extra: &[(&'static str, String)],
        body: Option<Vec<u8>>,
        timeout: Duration,
        unavailable_moves_on: bool,
    ) -> Result<(u16, bytes::Bytes), ClientError> {
        use std::sync::atomic::Ordering;
        let n = self.endpoints.len();
        let first = self.preferred.load(Ordering::Relaxed) % n.max(1);
        let mut last = None;
        let mut unavailable = None;
        for i in (0..n).map(|k| (first + k) % n) {
            let ep = &self.endpoints[i];
            match http::request(
                &self.pool,
                ep,
                method.clone(),
                path,
                Some(token),
                extra,
                body.clone(),
                timeout,
            )
            .await
            {
                Ok(r) if unavailable_moves_on && (502..=504).contains(&r.status) => {
                    unavailable = Some((r.status, r.body));
                }
                Ok(r) => {
                    self.preferred.store(i, Ordering::Relaxed);
                    return Ok((r.status, r.body));
                }
                Err(e) => last = Some(e),
            }
        }
        if let Some(answer) = unavailable {
            return Ok(answer);
        }
        Err(last.map_or_else(
            || ClientError::Usage("no coordinator url given".into()),
            ClientError::Http,
        ))
    }

    /// Passes a request on with another caller's bearer `token` (a coordinator handing a
    /// node's quota call to the coordinator that decides): the answer's status and body
    /// whatever the status, or no HTTP answer.
    pub async fn relay(
        &self,
        method: Method,
        path: &str,
        token: &str,
        extra: &[(&'static str, String)],
        body: Option<Vec<u8>>,
        timeout: Duration,
    ) -> Result<(u16, bytes::Bytes), ClientError> {
        self.send(method, path, token, extra, body, timeout, false).await
    }

    async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        extra: &[(&'static str, String)],
        body: Option<Vec<u8>>,
    ) -> Result<T, ClientError> {
        let (status, body) = self.raw(method, path, extra, body, self.timeout).await?;
        if !(200..300).contains(&status) {
            let error = serde_json::from_slice::<ErrorBody>(&body).unwrap_or_else(|_| ErrorBody {
                error: String::from_utf8_lossy(&body[..body.len().min(500)]).into_owned(),
                path: None,
                who: None,
            });
            return Err(ClientError::Api { status, error });
        }
        serde_json::from_slice(&body).map_err(|e| ClientError::Protocol(format!("{path}: {e}")))
    }

    /// Push a policy document. `author` goes in `x-tessera-author` (the coordinator
    /// records it next to the admin credential's name).
    pub async fn push_policy(
        &self,
        bytes: &[u8],
        author: Option<&str>,
    ) -> Result<RevisionSummary, ClientError> {
        let extra: Vec<(&'static str, String)> =
            author.map(|a| vec![("x-tessera-author", a.to_string())]).unwrap_or_default();
        self.call(Method::POST, "/v1/policies", &extra, Some(bytes.to_vec())).await
    }

    /// Long-poll for a revision newer than `newer_than` (node or admin credential):
    /// `None` when nothing newer came within `wait`. The envelope is NOT verified here:
    /// pass it to [`crate::signing::verify`] with the pinned key.
    pub async fn latest(
        &self,
        newer_than: u64,
        wait: Duration,
    ) -> Result<Option<SignedPolicy>, ClientError> {
        let ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        let path = format!("/v1/policies/latest?newer_than={newer_than}&timeout_ms={ms}");
        let (status, body) =
            self.raw(Method::GET, &path, &[], None, wait + Duration::from_secs(10)).await?;
        match status {
            204 => Ok(None),
            200 => crate::signing::parse_envelope(&body)
                .map(Some)
                .map_err(|e| ClientError::Protocol(e.to_string())),
            _ => Err(ClientError::Api {
                status,
                error: serde_json::from_slice(&body).unwrap_or_else(|_| ErrorBody {
                    error: String::from_utf8_lossy(&body[..body.len().min(500)]).into_owned(),
                    path: None,
                    who: None,
                }),
            }),
        }
    }

    /// Every revision, oldest first.
    pub async fn history(&self) -> Result<Vec<RevisionSummary>, ClientError> {
        self.call(Method::GET, "/v1/policies", &[], None).await
    }

    /// One revision's signed envelope.
    pub async fn get(&self, version: u64) -> Result<SignedPolicy, ClientError> {
        self.call(Method::GET, &format!("/v1/policies/{version}"), &[], None).await
    }

    /// One revision, verified against `key` (signature, key id, digest, policy): a
    /// revision that does not verify is an error naming why, never returned.
    pub async fn verified(
        &self,
        version: u64,
        key: &ed25519_dalek::VerifyingKey,
    ) -> Result<crate::Verified, ClientError> {
        let env = self.get(version).await?;
        crate::signing::verify(&env, key).map_err(|e| ClientError::Unverified {
            version,
            kind: e.kind(),
            why: e.to_string(),
        })
    }

    /// The public key the coordinator announces (`/v1/health`).
    pub async fn announced_key(&self) -> Result<ed25519_dalek::VerifyingKey, ClientError> {
        let (_, body) = self.raw(Method::GET, "/v1/health", &[], None, self.timeout).await?;
        let v: serde_json::Value = serde_json::from_slice(&body)
            .map_err(|e| ClientError::Protocol(format!("/v1/health: {e}")))?;
        let text = v["public_key"]
            .as_str()
            .ok_or_else(|| ClientError::Protocol("/v1/health names no public_key".into()))?;
        crate::signing::parse_verifying_key(text, "the coordinator's public key")
            .map_err(|e| ClientError::Protocol(e.to_string()))
    }

    /// One revision's policy text, verified against `key`.
    pub async fn policy_text(
        &self,
        version: u64,
        key: &ed25519_dalek::VerifyingKey,
    ) -> Result<String, ClientError> {
        let v = self.verified(version, key).await?;
        String::from_utf8(v.bytes)
            .map_err(|_| ClientError::Protocol(format!("version {version} is not utf-8")))
    }

    /// A unified diff of revisions `a` and `b` (empty when they are the same), each
    /// verified against `key` first.
    pub async fn diff(
        &self,
        a: u64,
        b: u64,
        key: &ed25519_dalek::VerifyingKey,
    ) -> Result<String, ClientError> {
        let (ta, tb) = (self.policy_text(a, key).await?, self.policy_text(b, key).await?);
        Ok(crate::diff::diff_labeled(&format!("version {a}"), &ta, &format!("version {b}"), &tb))
    }

    /// Every node: applied version, last contact, health.
    pub async fn nodes(&self) -> Result<Vec<NodeRecord>, ClientError> {
        self.call(Method::GET, "/v1/nodes", &[], None).await
    }

    /// One node's record (admins, or the node itself).
    pub async fn node(&self, node: &str) -> Result<NodeRecord, ClientError> {
        crate::validate_node_id(node).map_err(ClientError::Usage)?;
        self.call(Method::GET, &format!("/v1/nodes/{node}"), &[], None).await
    }

    /// Fleet usage in `[from_ms, to_ms)` grouped `by`, optionally for some nodes only.
    pub async fn usage(
        &self,
        from_ms: u64,
        to_ms: u64,
        by: metering::GroupBy,
        nodes: Option<&[String]>,
    ) -> Result<FleetUsage, ClientError> {
        let mut path = format!("/v1/usage?from_ms={from_ms}&to_ms={to_ms}&by={by}");
        if let Some(ns) = nodes {
            for n in ns {
                crate::validate_node_id(n).map_err(ClientError::Usage)?;
            }
            path.push_str(&format!("&node={}", ns.join(",")));
        }
        self.call(Method::GET, &path, &[], None).await
    }

    /// Fleet usage with prices.
    pub async fn usage_query(&self, req: &FleetUsageRequest) -> Result<FleetUsage, ClientError> {
        let body = serde_json::to_vec(req).map_err(|e| ClientError::Protocol(e.to_string()))?;
        self.call(Method::POST, "/v1/usage", &[], Some(body)).await
    }

    /// Pin `node`'s public key (hex or base64) at the coordinator (admin); `replace` to
    /// change a key already pinned.
    pub async fn register_node_key(
        &self,
        node: &str,
        public_key: &str,
        replace: bool,
    ) -> Result<crate::proof::NodeKeyRecord, ClientError> {
        crate::validate_node_id(node).map_err(ClientError::Usage)?;
        let body = serde_json::to_vec(&crate::wire::RegisterNodeKey {
            public_key: public_key.to_string(),
            replace,
        })
        .map_err(|e| ClientError::Protocol(e.to_string()))?;
        self.call(Method::PUT, &format!("/v1/nodes/{node}/key"), &[], Some(body)).await
    }

    /// The key pinned for `node`.
    pub async fn node_key(&self, node: &str) -> Result<crate::proof::NodeKeyRecord, ClientError> {
        crate::validate_node_id(node).map_err(ClientError::Usage)?;
        self.call(Method::GET, &format!("/v1/nodes/{node}/key"), &[], None).await
    }

    /// The newest link of `node`'s ledger `ledger_id` the coordinator holds.
    pub async fn usage_head(
        &self,
        node: &str,
        ledger_id: &str,
    ) -> Result<metering::ChainHead, ClientError> {
        crate::validate_node_id(node).map_err(ClientError::Usage)?;
        crate::validate_name("ledger id", ledger_id).map_err(ClientError::Usage)?;
        let path = format!("/v1/nodes/{node}/usage/head?ledger_id={ledger_id}");
        self.call(Method::GET, &path, &[], None).await
    }

    /// The fleet's bill for `[from_ms, to_ms)` grouped `by`, with the signed segments and
    /// policy revision it rests on ([`crate::proof::verify_bill`] checks it).
    pub async fn usage_export(
        &self,
        from_ms: u64,
        to_ms: u64,
        by: metering::GroupBy,
        nodes: Option<&[String]>,
    ) -> Result<crate::proof::BillExport, ClientError> {
        let mut path = format!("/v1/usage/export?from_ms={from_ms}&to_ms={to_ms}&by={by}");
        if let Some(ns) = nodes {
            for n in ns {
                crate::validate_node_id(n).map_err(ClientError::Usage)?;
            }
            path.push_str(&format!("&node={}", ns.join(",")));
        }
        self.call(Method::GET, &path, &[], None).await
    }

    /// Recent refused requests (who, what, why).
    pub async fn refusals(&self) -> Result<Vec<RefusalRecord>, ClientError> {
        self.call(Method::GET, "/v1/audit/refusals", &[], None).await
    }

    /// The coordinator's health document (no credential needed).
    pub async fn health(&self) -> Result<serde_json::Value, ClientError> {
        self.call(Method::GET, "/v1/health", &[], None).await
    }

    /// The error of a non-2xx answer.
    fn api_error(status: u16, body: &[u8]) -> ClientError {
        let error = serde_json::from_slice::<ErrorBody>(body).unwrap_or_else(|_| ErrorBody {
            error: String::from_utf8_lossy(&body[..body.len().min(500)]).into_owned(),
            path: None,
            who: None,
        });
        ClientError::Api { status, error }
    }

    /// Fleet quotas: ask the coordinator to count one GPU grant of `node` (its node
    /// credential). A gang member's call is held until the gang is complete or the policy's
    /// `gangs.timeout_s` passed: give `timeout` beyond that. While the coordinator rebuilds
    /// its books after a restart it answers 503 (`ClientError::Api { status: 503, .. }`):
    /// the node then decides under its leases.
    pub async fn quota_admit(
        &self,
        node: &str,
        req: &crate::quota_wire::AdmitRequest,
        timeout: Duration,
    ) -> Result<crate::quota_wire::AdmitAnswer, ClientError> {
        crate::validate_node_id(node).map_err(ClientError::Usage)?;
        let path = format!("/v1/nodes/{node}/quota/admit");
        let body = serde_json::to_vec(req).map_err(|e| ClientError::Protocol(e.to_string()))?;
        let (status, body) =
            self.send(Method::POST, &path, &self.token, &[], Some(body), timeout, true).await?;
        if !(200..300).contains(&status) {
            return Err(Client::api_error(status, &body));
        }
        serde_json::from_slice(&body).map_err(|e| ClientError::Protocol(format!("{path}: {e}")))
    }

    /// Fleet quotas: a grant of `node` counts new amounts from now on (`runc update` of its
    /// container's CPU or memory limit): admitted (with its class from now on) or refused.
    /// 503 while the books are rebuilt, as for [`Client::quota_admit`].
    pub async fn quota_resize(
        &self,
        node: &str,
        req: &crate::quota_wire::ResizeRequest,
        timeout: Duration,
    ) -> Result<crate::quota_wire::AdmitAnswer, ClientError> {
        crate::validate_node_id(node).map_err(ClientError::Usage)?;
        let path = format!("/v1/nodes/{node}/quota/resize");
        let body = serde_json::to_vec(req).map_err(|e| ClientError::Protocol(e.to_string()))?;
        // As an admission: a coordinator that cannot reach the one that decides (502/503/504)
        // is passed over for the next.
        let (status, body) =
            self.send(Method::POST, &path, &self.token, &[], Some(body), timeout, true).await?;
        if !(200..300).contains(&status) {
            return Err(Client::api_error(status, &body));
        }
        serde_json::from_slice(&body).map_err(|e| ClientError::Protocol(format!("{path}: {e}")))
    }

    /// Fleet quotas: a grant of `node` ended (or was never made after an admission).
    pub async fn quota_release(
        &self,
        node: &str,
        req: &crate::quota_wire::ReleaseRequest,
    ) -> Result<(), ClientError> {
        crate::validate_node_id(node).map_err(ClientError::Usage)?;
        let path = format!("/v1/nodes/{node}/quota/release");
        let body = serde_json::to_vec(req).map_err(|e| ClientError::Protocol(e.to_string()))?;
        let (status, body) = self
            .send(Method::POST, &path, &self.token, &[], Some(body), self.timeout, true)
            .await?;
        if !(200..300).contains(&status) {
            return Err(Client::api_error(status, &body));
        }
        Ok(())
    }

    /// Fleet quotas: what `node` holds and the leases it has; the answer renews its leases
    /// and names the containers a reclaim stops.
    pub async fn quota_sync(
        &self,
        node: &str,
        req: &crate::quota_wire::SyncRequest,
    ) -> Result<crate::quota_wire::SyncAnswer, ClientError> {
        crate::validate_node_id(node).map_err(ClientError::Usage)?;
        let body = serde_json::to_vec(req).map_err(|e| ClientError::Protocol(e.to_string()))?;
        let path = format!("/v1/nodes/{node}/quota/sync");
        let (status, body) = self
            .send(Method::POST, &path, &self.token, &[], Some(body), self.timeout, true)
            .await?;
        if !(200..300).contains(&status) {
            return Err(Client::api_error(status, &body));
        }
        serde_json::from_slice(&body).map_err(|e| ClientError::Protocol(format!("{path}: {e}")))
    }

    /// Fleet quotas: take `node` out of the books at once (admin): what was removed.
    pub async fn quota_remove_node(
        &self,
        node: &str,
    ) -> Result<crate::quota_wire::NodeRemoval, ClientError> {
        crate::validate_node_id(node).map_err(ClientError::Usage)?;
        self.call(Method::DELETE, &format!("/v1/quota/nodes/{node}"), &[], None).await
    }

    /// Fleet quotas: the tree, the nodes, the reclaims in progress (admin).
    pub async fn quota_status(&self) -> Result<crate::quota_wire::QuotaStatus, ClientError> {
        self.call(Method::GET, "/v1/quota/status", &[], None).await
    }

    /// Fleet quotas: recent borrows, reclaims, preemptions, refusals, oldest first (admin).
    pub async fn quota_events(&self) -> Result<Vec<crate::quota_wire::QuotaEvent>, ClientError> {
        self.call(Method::GET, "/v1/quota/events", &[], None).await
    }
}

/// Synchronous wrappers: each call runs on a private current-thread runtime. Do not call
/// them from inside a tokio runtime.
pub mod blocking {
    use super::*;

    /// Run one client call to completion on a private current-thread runtime.
    pub fn block_on<T>(
        f: impl std::future::Future<Output = Result<T, ClientError>>,
    ) -> Result<T, ClientError> {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| ClientError::Usage(format!("cannot start a runtime: {e}")))?
            .block_on(f)
    }

    pub fn push_policy(
        url: &str,
        token: &str,
        bytes: &[u8],
        author: Option<&str>,
    ) -> Result<RevisionSummary, ClientError> {
        let c = Client::new(&[url], token)?;
        block_on(c.push_policy(bytes, author))
    }

    pub fn history(url: &str, token: &str) -> Result<Vec<RevisionSummary>, ClientError> {
        let c = Client::new(&[url], token)?;
        block_on(c.history())
    }

    pub fn get(url: &str, token: &str, version: u64) -> Result<SignedPolicy, ClientError> {
        let c = Client::new(&[url], token)?;
        block_on(c.get(version))
    }

    pub fn diff(
        url: &str,
        token: &str,
        a: u64,
        b: u64,
        key: &ed25519_dalek::VerifyingKey,
    ) -> Result<String, ClientError> {
        let c = Client::new(&[url], token)?;
        block_on(c.diff(a, b, key))
    }

    pub fn nodes(url: &str, token: &str) -> Result<Vec<NodeRecord>, ClientError> {
        let c = Client::new(&[url], token)?;
        block_on(c.nodes())
    }

    pub fn usage(
        url: &str,
        token: &str,
        from_ms: u64,
        to_ms: u64,
        by: metering::GroupBy,
        nodes: Option<&[String]>,
    ) -> Result<FleetUsage, ClientError> {
        let c = Client::new(&[url], token)?;
        block_on(c.usage(from_ms, to_ms, by, nodes))
    }

    pub fn usage_query(
        url: &str,
        token: &str,
        req: &FleetUsageRequest,
    ) -> Result<FleetUsage, ClientError> {
        let c = Client::new(&[url], token)?;
        block_on(c.usage_query(req))
    }

    pub fn refusals(url: &str, token: &str) -> Result<Vec<RefusalRecord>, ClientError> {
        let c = Client::new(&[url], token)?;
        block_on(c.refusals())
    }

    pub fn quota_status(
        url: &str,
        token: &str,
    ) -> Result<crate::quota_wire::QuotaStatus, ClientError> {
        let c = Client::new(&[url], token)?;
        block_on(c.quota_status())
    }

    pub fn quota_events(
        url: &str,
        token: &str,
    ) -> Result<Vec<crate::quota_wire::QuotaEvent>, ClientError> {
        let c = Client::new(&[url], token)?;
        block_on(c.quota_events())
    }
}

/// Render `tessera nodes` as a table: node, applied version, source, health, last contact.
pub fn render_nodes(nodes: &[NodeRecord], now_ms: u64) -> String {
    let mut out = String::from("NODE\tVERSION\tSOURCE\tHEALTH\tLAST CONTACT\tPROBLEM\n");
    for n in nodes {
        let version = n.applied_version.map_or_else(|| "-".to_string(), |v| v.to_string());
        let contact = n.last_contact_ms.map_or_else(
            || "never".to_string(),
            |t| format!("{}s ago", now_ms.saturating_sub(t) / 1000),
        );
        let health = if n.stale && n.last_contact_ms.is_some() {
            format!("{} (stale)", n.health)
        } else {
            n.health.clone()
        };
        let problem = n.last_rejection.as_deref().or(n.last_error.as_deref()).unwrap_or("");
        out.push_str(&format!(
            "{}\t{version}\t{}\t{health}\t{contact}\t{problem}\n",
            n.node, n.source
        ));
    }
    out
}

/// Render `tessera policy history`.
pub fn render_history(revs: &[RevisionSummary]) -> String {
    let mut out = String::from("VERSION\tCREATED_MS\tAUTHOR\tDIGEST\n");
    for r in revs {
        out.push_str(&format!(
            "{}\t{}\t{}\t{}\n",
            r.version,
            r.created_ms,
            r.author,
            &r.digest[..r.digest.len().min(16)]
        ));
    }
    out
}
