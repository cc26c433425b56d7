//! The HTTP+JSON API on a root-only unix socket. Handlers only parse: each request becomes
//! an [`Action`] that the [`Controller`] applies; every answer that is not 2xx carries an
//! [`ApiError`]. The ids of URL paths are parsed here, once ([`path_container`],
//! [`path_device`]), and the core's [`CoreError`] becomes the wire's [`ApiError`] here,
//! once ([`wire_error`]).

use std::collections::BTreeSet;
use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use axum::extract::rejection::JsonRejection;
use std::collections::BTreeMap;

use axum::extract::{DefaultBodyLimit, Path as UrlPath, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Serialize;
use tessera_api::{
    untrusted, AllocateRequest, ApiError, ContainerId, DeviceUuid, ErrorCode, ReleaseRequest,
    StartRequest, UpdateDone, UpdateRequest, MAX_REQUEST_BYTES, PROTOCOL, PROTOCOL_HEADER,
};
use tokio::net::{UnixListener, UnixStream};
use tracing::warn;

use crate::controller::{Action, Controller, Outcome};
use crate::error::CoreError;

/// An API answer: JSON on success, an [`ApiError`] with its HTTP status otherwise.
#[derive(Debug)]
pub struct Reply<T>(Result<T, ApiError>);

impl<T: Serialize> IntoResponse for Reply<T> {
    fn into_response(self) -> Response {
        match self.0 {
            Ok(v) => (StatusCode::OK, Json(v)).into_response(),
            Err(e) => {
                let status = StatusCode::from_u16(e.code.http_status())
                    .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
                (status, Json(e)).into_response()
            }
        }
    }
}

/// Hand `action` to the controller and answer with its outcome.
async fn act(ctl: &Arc<Controller>, action: Action) -> Response {
    Reply(ctl.run(action).await.map_err(wire_error)).into_response()
}

/// The core's error as the wire's: the one place a [`CoreError`] becomes an [`ApiError`]
/// (its code, and so its HTTP status, from [`CoreError::code`]; its message, tenant,
/// request and rule as they are).
pub fn wire_error(e: CoreError) -> ApiError {
    let code = e.code();
    match e.detail() {
        Some(d) => ApiError {
            code,
            message: d.message.clone(),
            tenant: d.tenant.clone(),
            request: d.request.clone(),
            rule: d.rule.clone(),
        },
        None => ApiError::new(code, e.to_string()),
    }
}

/// The answer to an action that failed, for the routes outside this router (the fleet
/// node's status and usage check: [`crate::follow`]).
pub fn error_response(e: CoreError) -> Response {
    Reply::<()>(Err(wire_error(e))).into_response()
}

fn bad_json(what: &str, rejection: JsonRejection) -> ApiError {
    if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
        return too_large(what);
    }
    // serde names unknown fields and values as sent: shown escaped and bounded.
    let detail = rejection.body_text();
    ApiError::new(
        ErrorCode::BadRequest,
        format!("malformed {what}: {}", untrusted(&detail).max_chars(1024)),
    )
}

fn too_large(what: &str) -> ApiError {
    ApiError::new(
        ErrorCode::BadRequest,
        format!("{what} is too large: tesserad accepts at most {MAX_REQUEST_BYTES} bytes"),
    )
}

/// What a route does with the container id of its URL path, which decides how an id that
/// breaks runc's rule is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PathIdUse {
    /// A read (`GET /v1/allocations/{id}`): no such allocation, 404.
    Read,
    /// A change (start, update and its end, release): a malformed request, 400.
    Change,
}

/// The container id of a URL path, parsed here, once: the controller and the node take
/// the [`ContainerId`] and check it no more.
pub fn path_container(id: String, usage: PathIdUse) -> Result<ContainerId, ApiError> {
    ContainerId::new(id).map_err(|e| match usage {
        PathIdUse::Change => ApiError::new(ErrorCode::BadRequest, e.to_string()),
        PathIdUse::Read => ApiError::new(
            ErrorCode::NotFound,
            format!("no allocation for container {}", untrusted(&e.0)),
        ),
    })
}

/// The device uuid of a URL path, parsed here, once: one that is no uuid names no device
/// of this node (404, as an unknown one).
pub fn path_device(uuid: String) -> Result<DeviceUuid, ApiError> {
    DeviceUuid::new(uuid).map_err(|e| {
        ApiError::new(
            ErrorCode::NotFound,
            format!(
                "unknown device {}: this node has no GPU or MIG instance with that UUID (see `tessera status`)",
                untrusted(&e.0).max_chars(128)
            ),
        )
    })
}

/// The API routes.
pub fn router(ctl: Arc<Controller>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { Json(serde_json::json!({"ok": true})) }))
        .route("/v1/status", get(status))
        .route("/v1/telemetry", get(telemetry))
        .route("/v1/allocations", post(allocate).get(list))
        .route("/v1/allocations/{id}", get(one).delete(release))
        .route("/v1/allocations/{id}/start", post(start))
        .route("/v1/allocations/{id}/update", post(update))
        .route("/v1/allocations/{id}/update/done", post(update_done))
        .route("/v1/usage", get(usage))
        .route("/v1/usage/verify", get(verify_usage))
        .route("/v1/mig/plan", get(mig_plan))
        .route("/v1/mig/converge", post(mig_converge))
        .route("/v1/devices/{uuid}/unquarantine", post(unquarantine))
        .route("/v1/policy/reload", post(policy_reload))
        .route("/v1/revoke-check", get(revoke_check))
        .route("/v1/revoke-check/stop", post(revoke_stop))
        .fallback(|| async {
            Reply::<()>(Err(ApiError::new(ErrorCode::NotFound, "no such endpoint")))
        })
        .layer(DefaultBodyLimit::max(MAX_REQUEST_BYTES))
        .layer(axum::middleware::from_fn(protocol))
        .with_state(ctl)
}

/// Serves only the protocol versions this tesserad accepts ([`tessera_api::protocol`]:
/// its own minor version and the previous one; no header is the version before the header
/// existed), and says in every answer which version answered.
async fn protocol(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let sent = req.headers().get_all(PROTOCOL_HEADER).iter().map(|v| v.as_bytes());
    let mut resp = match PROTOCOL.negotiate(sent) {
        Ok(_) => next.run(req).await,
        Err(e) => {
            warn!("refused an API request: {e}");
            Reply::<()>(Err(ApiError::new(ErrorCode::BadRequest, e.to_string()))).into_response()
        }
    };
    if let Ok(v) = axum::http::HeaderValue::from_str(&PROTOCOL.to_string()) {
        resp.headers_mut().insert(PROTOCOL_HEADER, v);
    }
    resp
}

/// The parameters of `GET /v1/usage`: `from_ms`, `to_ms` (Unix ms, `[from, to)`), `by`.
pub fn parse_usage_query(
    q: &BTreeMap<String, String>,
) -> Result<(u64, u64, metering::GroupBy), ApiError> {
    let bad = |m: String| ApiError::new(ErrorCode::BadRequest, m);
    if let Some(k) = q.keys().find(|k| !["from_ms", "to_ms", "by"].contains(&k.as_str())) {
        return Err(bad(format!(
            "unknown usage parameter `{}`: expected from_ms, to_ms, by",
            untrusted(k)
        )));
    }
    let ms = |k: &str| -> Result<u64, ApiError> {
        let v = q.get(k).ok_or_else(|| bad(format!("`{k}` is required (Unix milliseconds)")))?;
        v.parse::<u64>()
            .map_err(|_| bad(format!("`{k}` must be Unix milliseconds, got `{}`", untrusted(v))))
    };
    let (from, to) = (ms("from_ms")?, ms("to_ms")?);
    let by = q
        .get("by")
        .map(String::as_str)
        .unwrap_or("team")
        .parse::<metering::GroupBy>()
        .map_err(|e| bad(format!("`by`: {e}")))?;
    Ok((from, to, by))
}

async fn usage(
    State(ctl): State<Arc<Controller>>,
    Query(q): Query<BTreeMap<String, String>>,
) -> Response {
    match parse_usage_query(&q) {
        Ok((from_ms, to_ms, by)) => act(&ctl, Action::Usage { from_ms, to_ms, by }).await,
        Err(e) => Reply::<()>(Err(e)).into_response(),
    }
}

/// `GET /v1/usage/verify`: the ledger's hash chain recomputed ([`metering::ChainReport`]).
async fn verify_usage(State(ctl): State<Arc<Controller>>) -> Response {
    act(&ctl, Action::VerifyLedger).await
}

/// The Prometheus endpoint, served on its own TCP address (`--metrics`).
pub fn metrics_router(ctl: Arc<Controller>) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(|State(ctl): State<Arc<Controller>>| async move {
                match ctl.run(Action::Metrics).await {
                    Ok(Outcome::Metrics(text)) => (
                        StatusCode::OK,
                        [(
                            "content-type",
                            "application/openmetrics-text; version=1.0.0; charset=utf-8",
                        )],
                        text,
                    )
                        .into_response(),
                    Ok(_) => {
                        (StatusCode::INTERNAL_SERVER_ERROR, "unexpected outcome").into_response()
                    }
                    Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
                }
            }),
        )
        .with_state(ctl)
}

/// Re-scrub a quarantined device now and answer with its new state and the scrub report.
async fn unquarantine(
    State(ctl): State<Arc<Controller>>,
    UrlPath(uuid): UrlPath<String>,
) -> Response {
    match path_device(uuid) {
        Ok(uuid) => act(&ctl, Action::Unquarantine(uuid)).await,
        Err(e) => Reply::<()>(Err(e)).into_response(),
    }
}

/// Read the `--policy` file again ([`crate::reload`]); the same as `SIGHUP`.
async fn policy_reload(State(ctl): State<Arc<Controller>>) -> Response {
    act(&ctl, Action::ReloadPolicy).await
}

async fn revoke_check(State(ctl): State<Arc<Controller>>) -> Response {
    act(&ctl, Action::RevokeCheck).await
}

/// Stop the refused grants (`{"grace_s": N, "containers": [..]}`, both optional): answers
/// once every signalled init is gone or was sent SIGKILL, up to the grace period and 5 s.
async fn revoke_stop(
    State(ctl): State<Arc<Controller>>,
    body: Result<Json<crate::node::revoke::StopRequest>, JsonRejection>,
) -> Response {
    match body {
        Ok(Json(req)) => act(&ctl, Action::RevokeStop(req)).await,
        Err(r) => Reply::<()>(Err(bad_json("revoke stop request", r))).into_response(),
    }
}

async fn mig_plan(State(ctl): State<Arc<Controller>>) -> Response {
    act(&ctl, Action::MigPlan).await
}

async fn mig_converge(State(ctl): State<Arc<Controller>>) -> Response {
    act(&ctl, Action::MigConverge).await
}

async fn status(State(ctl): State<Arc<Controller>>) -> Response {
    act(&ctl, Action::Status).await
}

async fn telemetry(State(ctl): State<Arc<Controller>>) -> Response {
    act(&ctl, Action::Telemetry).await
}

async fn list(State(ctl): State<Arc<Controller>>) -> Response {
    act(&ctl, Action::Allocations).await
}

async fn one(State(ctl): State<Arc<Controller>>, UrlPath(id): UrlPath<String>) -> Response {
    match path_container(id, PathIdUse::Read) {
        Ok(id) => act(&ctl, Action::Allocation(id)).await,
        Err(e) => Reply::<()>(Err(e)).into_response(),
    }
}

async fn allocate(
    State(ctl): State<Arc<Controller>>,
    peer: Option<axum::Extension<axum::extract::ConnectInfo<Peer>>>,
    body: Result<Json<AllocateRequest>, JsonRejection>,
) -> Response {
    // The requester's pidfd, its own descriptor: the grant keeps it until confirmed.
    let requester = peer.and_then(|p| p.0 .0.pidfd).and_then(|fd| fd.try_clone().ok());
    match body {
        Ok(Json(req)) => act(&ctl, Action::Allocate { req, requester }).await,
        Err(r) => Reply::<()>(Err(bad_json("allocation request", r))).into_response(),
    }
}

async fn start(
    State(ctl): State<Arc<Controller>>,
    UrlPath(container_id): UrlPath<String>,
    body: Result<Json<StartRequest>, JsonRejection>,
) -> Response {
    let req = match body {
        Ok(Json(req)) => req,
        Err(r) => return Reply::<()>(Err(bad_json("start request", r))).into_response(),
    };
    let container_id = match path_container(container_id, PathIdUse::Change) {
        Ok(id) => id,
        Err(e) => return Reply::<()>(Err(e)).into_response(),
    };
    let r = ctl
        .run(Action::Start { container_id: container_id.clone(), req })
        .await
        .map_err(wire_error);
    // Metering stops at the init's exit: its watch starts with the container.
    if r.is_ok() {
        crate::exits::spawn(Arc::clone(&ctl), container_id);
    }
    Reply(r).into_response()
}

/// `POST /v1/allocations/{id}/update`: before `runc update` of a container.
async fn update(
    State(ctl): State<Arc<Controller>>,
    UrlPath(container_id): UrlPath<String>,
    body: Result<Json<UpdateRequest>, JsonRejection>,
) -> Response {
    match body {
        Ok(Json(req)) => match path_container(container_id, PathIdUse::Change) {
            Ok(container_id) => act(&ctl, Action::Update { container_id, req }).await,
            Err(e) => Reply::<()>(Err(e)).into_response(),
        },
        Err(r) => Reply::<()>(Err(bad_json("update request", r))).into_response(),
    }
}

/// `POST /v1/allocations/{id}/update/done`: `runc update` of a container ended.
async fn update_done(
    State(ctl): State<Arc<Controller>>,
    UrlPath(container_id): UrlPath<String>,
    body: Result<Json<UpdateDone>, JsonRejection>,
) -> Response {
    match body {
        Ok(Json(req)) => match path_container(container_id, PathIdUse::Change) {
            Ok(container_id) => act(&ctl, Action::UpdateDone { container_id, req }).await,
            Err(e) => Reply::<()>(Err(e)).into_response(),
        },
        Err(r) => Reply::<()>(Err(bad_json("update done", r))).into_response(),
    }
}

/// `DELETE /v1/allocations/{id}`, with an optional [`ReleaseRequest`] body naming the
/// container that was removed (none from older clients and the poststop hook).
async fn release(
    State(ctl): State<Arc<Controller>>,
    UrlPath(container_id): UrlPath<String>,
    body: Result<axum::body::Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    let body = match body {
        Ok(b) => b,
        Err(r) if r.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            return Reply::<()>(Err(too_large("release request"))).into_response()
        }
        Err(r) => {
            let msg = format!("malformed release request: {}", untrusted(&r.body_text()));
            return Reply::<()>(Err(ApiError::new(ErrorCode::BadRequest, msg))).into_response();
        }
    };
    let req = if body.iter().all(u8::is_ascii_whitespace) {
        ReleaseRequest::default()
    } else {
        match serde_json::from_slice::<ReleaseRequest>(&body) {
            Ok(r) => r,
            Err(e) => {
                let msg = format!(
                    "malformed release request: {}",
                    untrusted(&e.to_string()).max_chars(1024)
                );
                return Reply::<()>(Err(ApiError::new(ErrorCode::BadRequest, msg))).into_response();
            }
        }
    };
    let container_id = match path_container(container_id, PathIdUse::Change) {
        Ok(id) => id,
        Err(e) => return Reply::<()>(Err(e)).into_response(),
    };
    act(&ctl, Action::Release { container_id, req }).await
}

/// A unix listener that serves only peers whose uid is allowed (root by default), on
/// top of the socket file's own 0600 mode: either one alone would keep others out.
#[derive(Debug)]
pub struct PeerCheckedListener {
    inner: UnixListener,
    allowed_uids: BTreeSet<u32>,
}

impl PeerCheckedListener {
    pub fn new(inner: UnixListener, allowed_uids: BTreeSet<u32>) -> Self {
        PeerCheckedListener { inner, allowed_uids }
    }
}

/// Who is on the other end of an API connection: a pidfd of that process, taken when it
/// was accepted ([`crate::requesters::peer_pidfd`]; `None` where the kernel gives none).
/// A grant keeps it to learn when its requester exits ([`crate::requesters`]).
#[derive(Debug, Clone, Default)]
pub struct Peer {
    pub pidfd: Option<Arc<std::os::fd::OwnedFd>>,
}

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, PeerCheckedListener>>
    for Peer
{
    fn connect_info(stream: axum::serve::IncomingStream<'_, PeerCheckedListener>) -> Self {
        stream.remote_addr().clone()
    }
}

impl axum::serve::Listener for PeerCheckedListener {
    type Io = UnixStream;
    type Addr = Peer;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        use std::os::fd::AsRawFd;
        loop {
            match self.inner.accept().await {
                Ok((stream, _)) => match stream.peer_cred() {
                    Ok(cred) if self.allowed_uids.contains(&cred.uid()) => {
                        let pidfd = crate::requesters::peer_pidfd(stream.as_raw_fd(), cred.pid());
                        return (stream, Peer { pidfd: pidfd.map(Arc::new) });
                    }
                    Ok(cred) => {
                        warn!(uid = cred.uid(), pid = ?cred.pid(), "refused API connection: uid not allowed");
                    }
                    Err(e) => warn!("refused API connection: cannot read peer credentials: {e}"),
                },
                Err(e) => {
                    warn!("accept on the API socket failed: {e}");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr().map(|_| Peer::default())
    }
}

/// Errors while preparing the API socket.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    #[error("socket path {0} exists and is not a socket; refusing to remove it")]
    NotASocket(PathBuf),
    #[error("another tesserad is already listening on {0}")]
    InUse(PathBuf),
    #[error("socket {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

/// Bind the API socket: parent directory created 0700 if missing, a stale socket file
/// replaced only if nobody answers on it, the socket itself chmod 0600.
pub fn bind_socket(path: &Path) -> Result<UnixListener, SocketError> {
    let io_err = |source| SocketError::Io { path: path.to_path_buf(), source };
    if let Some(parent) = path.parent() {
        if !parent.as_os_str().is_empty() && !parent.exists() {
            std::fs::create_dir_all(parent).map_err(io_err)?;
            std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o700))
                .map_err(io_err)?;
        }
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(SocketError::InUse(path.to_path_buf()));
            }
            std::fs::remove_file(path).map_err(io_err)?;
        }
        Ok(_) => return Err(SocketError::NotASocket(path.to_path_buf())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err(e)),
    }
    // Bind with a restrictive umask so there is no window in which the socket is open
    // to others, then set the mode explicitly.
    // SAFETY: umask only swaps the process file-mode mask; it cannot fail or touch memory.
    let old = unsafe { libc::umask(0o177) };
    let bound = std::os::unix::net::UnixListener::bind(path);
    // SAFETY: as above, restoring the previous mask.
    unsafe { libc::umask(old) };
    let listener = bound.map_err(io_err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(io_err)?;
    listener.set_nonblocking(true).map_err(io_err)?;
    UnixListener::from_std(listener).map_err(io_err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Detail;

    /// runc's rule, applied once at the edge: a change (start, update, release) with an id
    /// that breaks it is a 400, as the node's own check answered before it moved here; a
    /// read of one is the 404 of an id nothing is recorded for.
    #[test]
    fn path_container_ids_follow_runcs_rules_at_the_edge() {
        for ok in ["abc", "a.b-c_d+e", "0123456789abcdef"] {
            let id = path_container(ok.into(), PathIdUse::Change).expect(ok);
            assert_eq!(id, ok);
        }
        for bad in ["", ".", "..", "../etc", "a/b", "a b", "a\0b", &"x".repeat(1025)] {
            let e = path_container(bad.into(), PathIdUse::Change).unwrap_err();
            assert_eq!(e.code, ErrorCode::BadRequest, "{bad:?}");
            assert!(e.message.contains("is not a valid container id"), "{}", e.message);
            let e = path_container(bad.into(), PathIdUse::Read).unwrap_err();
            assert_eq!(e.code, ErrorCode::NotFound, "{bad:?}");
            assert!(!e.message.contains(['\n', '\0']), "{:?}", e.message);
        }
        let e = path_device("GPU-1/../../x\n".into()).unwrap_err();
        assert_eq!(e.code, ErrorCode::NotFound);
        assert!(e.message.starts_with("unknown device GPU-1/../../x\\n"), "{}", e.message);
    }

    /// The core's error becomes the wire's here, once: each kind with its code (and so its
    /// HTTP status), its message, tenant, request and rule as they were.
    #[test]
    fn core_errors_convert_once_with_their_status() {
        let d = Detail {
            message: "refused: no".into(),
            tenant: Some("acme/ml".into()),
            request: Some("gpu=1".into()),
            rule: Some("tiers.untrusted.allow".into()),
        };
        for (code, status) in [
            (ErrorCode::BadRequest, 400),
            (ErrorCode::UnknownTenant, 403),
            (ErrorCode::Refused, 403),
            (ErrorCode::NotFound, 404),
            (ErrorCode::Conflict, 409),
            (ErrorCode::Internal, 500),
            (ErrorCode::NotSupported, 501),
            (ErrorCode::NoCapacity, 503),
            (ErrorCode::Reclaiming, 503),
        ] {
            let e = wire_error(CoreError::of(code, d.clone()));
            assert_eq!(
                e,
                ApiError {
                    code,
                    message: d.message.clone(),
                    tenant: d.tenant.clone(),
                    request: d.request.clone(),
                    rule: d.rule.clone(),
                }
            );
            let resp = error_response(CoreError::of(code, d.clone()));
            assert_eq!(resp.status().as_u16(), status, "{code:?}");
        }
        // A failure of the store keeps the message it had on the wire.
        let e = wire_error(CoreError::Store(crate::store::StoreError::DeviceClaimed {
            uuid: "GPU-1".into(),
            holder: "c1".into(),
        }));
        assert_eq!(
            e,
            ApiError::new(
                ErrorCode::Internal,
                "tesserad: device GPU-1 is already claimed by container c1"
            )
        );
    }
}
