//! The coordinator's HTTP server (axum): the routes of policies, nodes, usage and the
//! audit log (parse and authenticate each request, then act on the store), the router
//! with every route (the quota routes are `quota`'s), and the serving loop (plain or TLS).
//! See the crate docs for the routes. Route modules depend on `app` (the state they are
//! handed) and `http` (the plumbing), never on each other: this one mounts `quota`'s.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::rejection::QueryRejection;
use axum::extract::{ConnectInfo, DefaultBodyLimit, Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

use crate::app::App;
pub use crate::app::Coordinator;
use crate::auth::{Principal, Tokens, TokensError};
use crate::http::{json_body, query, Peer};
pub use crate::http::{ApiErr, ApiResult};
use crate::now_ms;
use crate::signing::{self, KeyError, SignedPolicy};
use crate::store::{self, PolicyStore, StoreError, StoreSpec};
use crate::wire::{
    FleetUsage, FleetUsageRequest, NodeRecord, NodeReport, RefusalRecord, RevisionSummary,
};

/// A node not heard from for this long is listed as stale.
pub const STALE_AFTER_MS: u64 = 120_000;
/// A long poll without `timeout_ms` waits this long.
pub const DEFAULT_POLL_MS: u64 = 30_000;
/// The longest a long poll may wait.
pub const MAX_POLL_MS: u64 = 120_000;
/// Largest request body.
const MAX_REQUEST: usize = 8 << 20;
/// Pending connections the listener queues (capped by `net.core.somaxconn`).
const LISTEN_BACKLOG: u32 = 4096;
/// How long `/v1/health` waits for the store.
const HEALTH_STORE_TIMEOUT: Duration = Duration::from_secs(2);
/// Default usage retention: intervals that ended longer ago are deleted.
pub const DEFAULT_USAGE_RETENTION: Duration = Duration::from_secs(400 * 24 * 3600);
/// How often retention runs.
const PRUNE_EVERY: Duration = Duration::from_secs(3600);

/// Why the coordinator could not start.
#[derive(Debug, thiserror::Error)]
pub enum CoordinatorError {
    #[error("signing key: {0}")]
    Key(#[from] KeyError),
    #[error(transparent)]
    Tokens(#[from] TokensError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("listen on {addr}: {source}")]
    Listen { addr: SocketAddr, source: std::io::Error },
    #[error("serving: {0}")]
    Serve(std::io::Error),
    #[error("TLS: {0}")]
    Tls(#[from] crate::tls::TlsError),
}

/// What `tessera-coordinator serve` needs.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    pub listen: SocketAddr,
    pub store: StoreSpec,
    /// Root of every etcd key.
    pub etcd_prefix: String,
    pub signing_key: PathBuf,
    pub tokens: PathBuf,
    /// Serve HTTPS with this certificate (PEM chain) and key (PEM); both or neither.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// Delete usage intervals that ended longer ago than this (checked hourly); `None`:
    /// keep them forever.
    pub usage_retention: Option<Duration>,
    /// etcd: compact the cluster's history, keeping this much of it
    /// ([`store::compaction_loop`]); `None`: never compact (the operator runs etcd's own
    /// auto-compaction). Nothing to do on SQLite.
    pub etcd_compaction: Option<Duration>,
    /// How long a quota lease handed to a node is good for ([`crate::quota_routes`]).
    pub quota_lease_ttl: Duration,
    /// The TTL of the etcd lease by which one coordinator decides the quota books
    /// ([`crate::quota_routes::DEFAULT_LEADER_TTL`]).
    pub quota_leader_ttl: Duration,
    /// This coordinator's URL as the other coordinators reach it (default: from the
    /// listen address, the host name where that is unspecified).
    pub advertise_url: Option<String>,
    /// The CA other coordinators' certificates are checked against when quota calls are
    /// passed on to an `https://` leader.
    pub peer_ca: Option<PathBuf>,
}

impl Coordinator {
    /// The axum router (needs `ConnectInfo<SocketAddr>`: serve it with
    /// `into_make_service_with_connect_info`).
    pub fn router(self: &Arc<Self>) -> Router {
        Router::new()
            .route("/v1/health", get(health))
            .route("/v1/ping", get(ping))
            .route("/v1/policies", post(push).get(history))
            .route("/v1/policies/latest", get(latest))
            .route("/v1/policies/{version}", get(get_revision))
            .route("/v1/nodes", get(nodes))
            .route("/v1/nodes/{node}", get(node))
            .route("/v1/nodes/{node}/report", post(report))
            .route("/v1/nodes/{node}/usage", post(crate::usage::upload))
            .route("/v1/nodes/{node}/usage/head", get(crate::usage::usage_head))
            .route(
                "/v1/nodes/{node}/key",
                get(crate::usage::get_key).put(crate::usage::register_key),
            )
            .route("/v1/usage", get(usage_get).post(usage_post))
            .route("/v1/usage/export", get(crate::usage::export))
            .route("/v1/audit/refusals", get(refusals))
            .route("/v1/nodes/{node}/quota/admit", post(crate::quota_routes::admit))
            .route("/v1/nodes/{node}/quota/release", post(crate::quota_routes::release))
            .route("/v1/nodes/{node}/quota/resize", post(crate::quota_routes::resize))
            .route("/v1/nodes/{node}/quota/sync", post(crate::quota_routes::sync))
            .route("/v1/quota/status", get(crate::quota_routes::status))
            .route("/v1/quota/events", get(crate::quota_routes::events))
            .route(
                "/v1/quota/nodes/{node}",
                axum::routing::delete(crate::quota_routes::remove_node),
            )
            .route("/metrics", get(crate::quota_routes::metrics))
            .layer(DefaultBodyLimit::max(MAX_REQUEST))
            .with_state(self.clone())
    }
}

/// Counts a long poll while it waits.
struct Waiting<'a>(&'a AtomicUsize);

impl<'a> Waiting<'a> {
    fn new(n: &'a AtomicUsize) -> Self {
        n.fetch_add(1, Ordering::Relaxed);
        Waiting(n)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[derive(Debug, Serialize)]
struct Health {
    ok: bool,
    store: &'static str,
    /// Why the store did not answer (then `ok` is false and the status 503).
    #[serde(skip_serializing_if = "Option::is_none")]
    store_error: Option<String>,
    latest_version: Option<u64>,
    watchers: usize,
    key_id: String,
    public_key: String,
}

/// A request any HTTP client can make without credentials: clients send it on each new
/// plain-HTTP connection before any token, so a peer that does not speak plain HTTP (a
/// TLS server behind an `http://` URL) never sees one.
async fn ping() -> &'static str {
    "tessera-coordinator\n"
}

/// Liveness and the store: 503 with `ok: false` and the reason when the store does not
/// answer within 2 s (long polls still answer from memory then; pushes fail).
async fn health(State(app): App) -> Response {
    let store_error = match tokio::time::timeout(HEALTH_STORE_TIMEOUT, app.store.ping()).await {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e.to_string()),
        Err(_) => Some(format!("the store did not answer within {HEALTH_STORE_TIMEOUT:?}")),
    };
    let status =
        if store_error.is_some() { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK };
    let body = Json(Health {
        ok: store_error.is_none(),
        store: app.store.kind(),
        store_error,
        latest_version: app.latest_version(),
        watchers: app.waiting_watchers(),
        key_id: app.signer.key_id().to_string(),
        public_key: signing::encode_verifying_key(&app.signer.verifying_key()),
    });
    (status, body).into_response()
}

/// The recorded author: the admin's name, with the `x-tessera-author` header's claim
/// when it says something else (a header alone proves nothing).
fn author_of(admin: &str, headers: &HeaderMap) -> ApiResult<String> {
    let Some(v) = headers.get("x-tessera-author") else { return Ok(admin.to_string()) };
    let claimed =
        v.to_str().map_err(|_| ApiErr::bad_request("x-tessera-author is not text"))?.trim();
    if claimed.chars().any(char::is_control) || claimed.len() > 200 {
        return Err(ApiErr::bad_request(
            "x-tessera-author must be at most 200 characters, no control characters",
        ));
    }
    if claimed.is_empty() || claimed == admin {
        Ok(admin.to_string())
    } else {
        Ok(format!("{claimed} (via admin {admin})"))
    }
}

async fn push(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Response> {
    let admin = app.require_admin(&headers, peer, "push a policy")?;
    let author = author_of(&admin, &headers)?;
    let (status, summary) = app.push_policy(&body, &author).await?;
    Ok((status, Json(summary)).into_response())
}

async fn history(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
) -> ApiResult<Json<Vec<RevisionSummary>>> {
    app.require_admin(&headers, peer, "read the policy history")?;
    let revs = app.store.history().await.map_err(ApiErr::store)?;
    let key = app.signer.verifying_key();
    Ok(Json(revs.iter().map(|r| RevisionSummary::checked(r, &key)).collect()))
}

async fn get_revision(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    Path(version): Path<String>,
) -> ApiResult<Json<SignedPolicy>> {
    app.require_admin(&headers, peer, "read a policy revision")?;
    let v: u64 = version
        .parse()
        .map_err(|_| ApiErr::bad_request(format!("{version:?} is not a version number")))?;
    match app.store.get(v).await.map_err(ApiErr::store)? {
        Some(env) => Ok(Json(env)),
        None => Err(ApiErr::new(StatusCode::NOT_FOUND, format!("no policy revision {v}"))),
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PollQuery {
    #[serde(default)]
    newer_than: Option<u64>,
    #[serde(default)]
    timeout_ms: Option<u64>,
}

async fn latest(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    q: Result<Query<PollQuery>, QueryRejection>,
) -> ApiResult<Response> {
    let who = app.authenticate(&headers, peer, "watch the policy")?;
    let q = query(q)?;
    if let Principal::Node(n) = &who {
        app.touch(n);
    }
    let newer_than = q.newer_than.unwrap_or(0);
    let wait = Duration::from_millis(q.timeout_ms.unwrap_or(DEFAULT_POLL_MS).min(MAX_POLL_MS));
    let mut rx = app.latest.clone();
    let mut closing = app.closing.subscribe();
    let found = {
        let _counted = Waiting::new(&app.waiting);
        tokio::select! {
            r = rx.wait_for(|l| l.as_ref().is_some_and(|p| p.envelope.version > newer_than)) => {
                r.ok().and_then(|g| g.clone())
            }
            _ = tokio::time::sleep(wait) => None,
            _ = closing.wait_for(|c| *c) => {
                return Err(ApiErr::new(StatusCode::SERVICE_UNAVAILABLE, "coordinator shutting down; poll another"));
            }
        }
    };
    let mut resp = match &found {
        Some(p) => {
            let mut r = Response::new(Body::from(p.json.clone()));
            r.headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
            r
        }
        None => {
            let mut r = Response::new(Body::empty());
            *r.status_mut() = StatusCode::NO_CONTENT;
            r
        }
    };
    let latest = found.as_ref().map(|p| p.envelope.version).or_else(|| app.latest_version());
    if let Some(v) = latest {
        if let Ok(h) = HeaderValue::from_str(&v.to_string()) {
            resp.headers_mut().insert("x-tessera-latest-version", h);
        }
    }
    Ok(resp)
}

fn bounded_text(field: &str, v: &Option<String>) -> ApiResult<()> {
    if v.as_ref().is_some_and(|s| s.len() > 4096) {
        return Err(ApiErr::bad_request(format!("{field} is longer than 4096 bytes")));
    }
    Ok(())
}

async fn report(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    Path(node): Path<String>,
    body: Bytes,
) -> ApiResult<Json<NodeRecord>> {
    app.require_node(&headers, peer, "report node status", &node, false)?;
    let r: NodeReport = json_body(&body, "node report")?;
    for (f, v) in [
        ("last_error", &r.last_error),
        ("last_rejection", &r.last_rejection),
        ("applied_digest", &r.applied_digest),
    ] {
        bounded_text(f, v)?;
    }
    if r.source.len() > 64 || r.health.len() > 64 {
        return Err(ApiErr::bad_request("source and health are at most 64 bytes"));
    }
    let now = now_ms();
    let rec = NodeRecord {
        node: node.clone(),
        applied_version: r.applied_version,
        applied_digest: r.applied_digest,
        source: r.source,
        health: r.health,
        last_error: r.last_error,
        last_rejection: r.last_rejection,
        last_report_ms: Some(now),
        last_contact_ms: Some(now),
        stale: false,
    };
    app.store.put_node(rec.clone()).await.map_err(ApiErr::store)?;
    app.touch(&node);
    Ok(Json(rec))
}

fn finish_record(app: &Coordinator, mut rec: NodeRecord, now: u64) -> NodeRecord {
    rec.last_contact_ms = rec.last_contact_ms.max(app.contact(&rec.node));
    rec.stale = rec.last_contact_ms.is_none_or(|t| now.saturating_sub(t) > STALE_AFTER_MS);
    rec
}

async fn nodes(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
) -> ApiResult<Json<Vec<NodeRecord>>> {
    app.require_admin(&headers, peer, "list nodes")?;
    let mut all: std::collections::BTreeMap<String, NodeRecord> =
        app.tokens.nodes().iter().map(|n| (n.clone(), NodeRecord::unknown(n))).collect();
    for rec in app.store.nodes().await.map_err(ApiErr::store)? {
        all.insert(rec.node.clone(), rec);
    }
    let now = now_ms();
    Ok(Json(all.into_values().map(|r| finish_record(&app, r, now)).collect()))
}

async fn node(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    Path(node): Path<String>,
) -> ApiResult<Json<NodeRecord>> {
    app.require_node(&headers, peer, "read a node record", &node, true)?;
    let rec = app
        .store
        .node(node.clone())
        .await
        .map_err(ApiErr::store)?
        .unwrap_or_else(|| NodeRecord::unknown(&node));
    Ok(Json(finish_record(&app, rec, now_ms())))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct UsageParams {
    from_ms: u64,
    to_ms: u64,
    #[serde(default)]
    by: Option<String>,
    /// Comma-separated node ids.
    #[serde(default)]
    node: Option<String>,
}

async fn usage_get(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    q: Result<Query<UsageParams>, QueryRejection>,
) -> ApiResult<Json<FleetUsage>> {
    app.require_admin(&headers, peer, "read fleet usage")?;
    let p = query(q)?;
    let by = match p.by.as_deref() {
        None => metering::GroupBy::Org,
        Some(s) => {
            s.parse().map_err(|e: metering::LedgerError| ApiErr::bad_request(e.to_string()))?
        }
    };
    let only = p
        .node
        .map(|s| s.split(',').map(|n| n.trim().to_string()).filter(|n| !n.is_empty()).collect());
    let q = metering::UsageQuery::new(p.from_ms, p.to_ms, by, metering::Prices::default());
    Ok(Json(app.fleet_usage(q, only, false).await?))
}

async fn usage_post(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult<Json<FleetUsage>> {
    app.require_admin(&headers, peer, "read fleet usage")?;
    let r: FleetUsageRequest = json_body(&body, "usage query")?;
    Ok(Json(app.fleet_usage(r.query, r.nodes, r.price_with_policy).await?))
}

async fn refusals(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
) -> ApiResult<Json<Vec<RefusalRecord>>> {
    app.require_admin(&headers, peer, "read the refusal log")?;
    Ok(Json(app.refusals()))
}

/// A coordinator serving on a TCP port.
#[derive(Debug)]
pub struct RunningCoordinator {
    addr: SocketAddr,
    tls: bool,
    coordinator: Arc<Coordinator>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl RunningCoordinator {
    /// Bind `listen` (port 0: any free port) and serve `coordinator` on it (plain HTTP).
    pub async fn start(
        listen: SocketAddr,
        coordinator: Arc<Coordinator>,
    ) -> Result<RunningCoordinator, CoordinatorError> {
        RunningCoordinator::start_with(listen, coordinator, None).await
    }

    /// As [`RunningCoordinator::start`], serving HTTPS when `tls` is given.
    pub async fn start_with(
        listen: SocketAddr,
        coordinator: Arc<Coordinator>,
        tls: Option<Arc<rustls::ServerConfig>>,
    ) -> Result<RunningCoordinator, CoordinatorError> {
        // A store that belongs to another fleet's key would serve revisions no node of
        // ours accepts, and ours none of theirs: refuse before serving anything.
        let public = signing::encode_verifying_key(&coordinator.signer.verifying_key());
        coordinator.store.claim_signing_key(public).await?;
        let err = |source| CoordinatorError::Listen { addr: listen, source };
        let socket = if listen.is_ipv4() {
            tokio::net::TcpSocket::new_v4()
        } else {
            tokio::net::TcpSocket::new_v6()
        }
        .map_err(err)?;
        socket.set_reuseaddr(true).map_err(err)?;
        socket.bind(listen).map_err(err)?;
        let listener = socket.listen(LISTEN_BACKLOG).map_err(err)?;
        let addr = listener.local_addr().map_err(err)?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let https = tls.is_some();
        let task = match tls {
            None => {
                let app = coordinator.router().into_make_service_with_connect_info::<SocketAddr>();
                tokio::spawn(async move {
                    axum::serve(listener, app)
                        .with_graceful_shutdown(async move {
                            let _ = stopped.await;
                        })
                        .await
                })
            }
            Some(cfg) => tokio::spawn(serve_tls(listener, coordinator.router(), cfg, stopped)),
        };
        let url = match &coordinator.quota.opts.advertise_url {
            Some(u) => u.clone(),
            None => advertised(addr, https),
        };
        crate::quota_routes::start(&coordinator, url.clone());
        info!(%addr, tls = https, store = coordinator.store.kind(), key_id = %coordinator.signer.key_id(), advertise = %url, "coordinator listening");
        Ok(RunningCoordinator { addr, tls: https, coordinator, stop: Some(stop), task })
    }

    /// Open everything `opts` names and start serving.
    pub async fn from_options(opts: &ServeOptions) -> Result<RunningCoordinator, CoordinatorError> {
        let key = signing::load_signing_key(&opts.signing_key)?;
        let tokens = Tokens::load(&opts.tokens)?;
        let tls = match &opts.tls {
            Some((cert, key)) => Some(crate::tls::server_config(cert, key)?),
            None => None,
        };
        let store = store::open(&opts.store, &opts.etcd_prefix).await?;
        let peer_tls = match &opts.peer_ca {
            Some(ca) => Some(crate::tls::client_config(ca)?),
            None => None,
        };
        let quota = crate::quota_routes::QuotaOptions {
            lease_ttl: opts.quota_lease_ttl,
            leader_ttl: opts.quota_leader_ttl,
            advertise_url: opts.advertise_url.clone(),
            peer_tls,
        };
        let running = RunningCoordinator::start_with(
            opts.listen,
            Coordinator::with_quota(store.clone(), key, tokens, quota),
            tls,
        )
        .await?;
        if let Some(keep) = opts.usage_retention {
            tokio::spawn(prune_loop(store.clone(), keep));
        }
        if let (Some(keep), "etcd") = (opts.etcd_compaction, store.kind()) {
            info!(keep_s = keep.as_secs_f64(), "compacting etcd history older than the retention");
            tokio::spawn(store::compaction_loop(store, keep));
        }
        Ok(running)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`, or `https://ADDR` when serving TLS.
    pub fn url(&self) -> String {
        format!("{}://{}", if self.tls { "https" } else { "http" }, self.addr)
    }

    pub fn coordinator(&self) -> &Arc<Coordinator> {
        &self.coordinator
    }

    /// Stop: end every long poll with 503 (so nodes fail over at once), stop accepting,
    /// finish what is in flight (at most 5 s).
    pub async fn shutdown(mut self) {
        // The quota books go to another coordinator at once, not when the lease runs out.
        crate::quota_routes::stop(&self.coordinator).await;
        self.coordinator.closing.send_replace(true);
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match tokio::time::timeout(Duration::from_secs(5), &mut self.task).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => warn!("coordinator server ended with {e}"),
            Ok(Err(e)) => warn!("coordinator server task: {e}"),
            Err(_) => {
                warn!("coordinator did not stop in 5 s; aborting its connections");
                self.task.abort();
            }
        }
        info!(addr = %self.addr, "coordinator stopped");
    }

    /// Serve until the server fails.
    pub async fn wait(self) -> Result<(), CoordinatorError> {
        match self.task.await {
            Ok(r) => r.map_err(CoordinatorError::Serve),
            Err(e) => Err(CoordinatorError::Serve(std::io::Error::other(e.to_string()))),
        }
    }
}

/// The URL other coordinators reach this one at, from the address it listens on: the host
/// name where the address is unspecified (`0.0.0.0`).
fn advertised(addr: SocketAddr, https: bool) -> String {
    let scheme = if https { "https" } else { "http" };
    if !addr.ip().is_unspecified() {
        return format!("{scheme}://{addr}");
    }
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most `buf.len()` bytes into the buffer it is given,
    // which lives across the call.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let host = if rc == 0 {
        let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        "localhost".to_string()
    };
    format!("{scheme}://{host}:{}", addr.port())
}

/// Usage retention: every hour, delete the intervals that ended more than `keep` ago.
/// Several coordinators on one etcd may all run it (deleting is idempotent).
async fn prune_loop(store: Arc<dyn PolicyStore>, keep: Duration) {
    let mut tick = tokio::time::interval(PRUNE_EVERY);
    loop {
        tick.tick().await;
        let keep_ms = u64::try_from(keep.as_millis()).unwrap_or(u64::MAX);
        let before = now_ms().saturating_sub(keep_ms);
        match store.prune_usage(before).await {
            Ok(0) => {}
            Ok(n) => {
                info!(intervals = n, before_ms = before, "usage retention: deleted old intervals")
            }
            Err(e) => warn!("usage retention: {e}"),
        }
    }
}

/// How long a client may take to finish its TLS handshake.
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The HTTPS server: TLS per connection (a handshake that fails or stalls costs only its
/// own task), then HTTP/1.1 with the peer address where the handlers' `ConnectInfo`
/// expects it. On stop: no new connections, and those open finish what is in flight.
async fn serve_tls(
    listener: tokio::net::TcpListener,
    router: axum::Router,
    cfg: Arc<rustls::ServerConfig>,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) -> std::io::Result<()> {
    let acceptor = tokio_rustls::TlsAcceptor::from(cfg);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    loop {
        let (tcp, peer) = tokio::select! {
            _ = &mut stopped => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of fds and the like: back off instead of spinning.
                    warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        let (acceptor, router, watcher) = (acceptor.clone(), router.clone(), graceful.watcher());
        tokio::spawn(async move {
            let tls = match tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await
            {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    debug!(%peer, "TLS handshake refused: {e}");
                    return;
                }
                Err(_) => {
                    debug!(%peer, "TLS handshake timed out");
                    return;
                }
            };
            let svc = hyper::service::service_fn(
                move |mut req: hyper::Request<hyper::body::Incoming>| {
                    req.extensions_mut().insert(axum::extract::ConnectInfo(peer));
                    tower::ServiceExt::oneshot(router.clone(), req)
                },
            );
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(tls), svc);
            if let Err(e) = watcher.watch(conn).await {
                debug!(%peer, "connection ended: {e}");
            }
        });
    }
    graceful.shutdown().await;
    Ok(())
}

/// `tessera-coordinator serve`: run until SIGTERM or SIGINT.
pub async fn run(opts: ServeOptions) -> Result<(), CoordinatorError> {
    let running = RunningCoordinator::from_options(&opts).await?;
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) =
        (signal(SignalKind::terminate()), signal(SignalKind::interrupt()))
    else {
        return running.wait().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    running.shutdown().await;
    Ok(())
}
