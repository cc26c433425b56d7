//! Fleet quotas on the coordinator (docs/QUOTAS.md, "The fleet"): the routes of the quota
//! protocol ([`fleet::quota_wire`]) over the pure [`quota::books::Books`], which the coordinator
//! keeps behind a mutex (never held across an await; [`QuotaState`], in `books.rs`). A
//! route module: it uses the state it is handed (`app`) and the plumbing (`http`), never
//! the other route module (`server`, which mounts these routes).
//!
//! | route | who | what |
//! |---|---|---|
//! | `POST /v1/nodes/{node}/quota/admit` | that node | [`AdmitRequest`] → [`AdmitAnswer`]; a gang member's call is held until the gang is complete or `gangs.timeout_s` passed; 503 while the books are rebuilt after a restart |
//! | `POST /v1/nodes/{node}/quota/release` | that node | [`ReleaseRequest`] → 204 |
//! | `POST /v1/nodes/{node}/quota/resize` | that node | [`ResizeRequest`] → [`AdmitAnswer`] (admitted or refused); 503 while the books are rebuilt |
//! | `POST /v1/nodes/{node}/quota/sync` | that node | [`SyncRequest`] → [`SyncAnswer`] |
//! | `GET /v1/quota/status` | admin | [`QuotaStatus`] |
//! | `GET /v1/quota/events` | admin | [`QuotaEvent`] list, oldest first |
//! | `GET /metrics` | admin | Prometheus text: gauges per quota path and resource, counters |
//!
//! The quotas in force are those of the newest revision that verifies against the
//! coordinator's key (what nodes enforce), parsed once per revision. Without quotas every
//! admission is answered `Admitted` (guaranteed) and still counted, so status stays useful.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{ConnectInfo, Path, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use fleet::quota_wire::{
    AdmitAnswer, AdmitRequest, Amounts, Authority, CoordinatorInfo, Holding, NodeRemoval,
    QuotaStatus, ReleaseRequest, ResizeRequest, SyncRequest, MAX_GANG_SIZE, MAX_SYNC_HOLDINGS,
};
use quota::books::{Books, GangArrival};
use quota::{Resource, MIB_PER_GIB, MICRO_PER_GPU, MILLI_PER_CORE};
use tessera_api::untrusted;
use tracing::{info, warn};

use crate::app::{App, Coordinator};
pub use crate::books::{QuotaOptions, QuotaState, DEFAULT_LEADER_TTL, DEFAULT_LEASE_TTL};
use crate::http::{json_body, ApiErr, ApiResult, Peer};
use crate::leader::{judge_authority, Journal, Judgement, Stored};
use crate::now_ms;
use crate::store::Role;

/// The most GPUs of one model a single grant may ask for.
pub const MAX_GRANT_GPUS: u64 = 1_024;
/// The most GPUs of one model a node may report.
pub const MAX_NODE_GPUS: u64 = 100_000;
/// The most CPU a grant or a node may name, in cores.
pub const MAX_CORES: u64 = 1_000_000;
/// The most memory a grant or a node may name, in GiB.
pub const MAX_MEMORY_GIB: u64 = 1 << 24;
/// The most leases a sync may carry.
pub const MAX_SYNC_LEASES: usize = 10_000;
/// The longest `workload` text.
const MAX_WORKLOAD_BYTES: usize = 512;
/// Extra time a waiting gang member gives the gang's deadline before asking again.
const GANG_POLL_SLACK: Duration = Duration::from_millis(20);

/// The policy in force (`None`: none pushed, or none verifies).
async fn in_force(app: &Coordinator) -> ApiResult<Option<(u64, Arc<policy::Policy>)>> {
    let latest = app.latest_version();
    let mut cache = app.quota.in_force.lock().await;
    if cache.seen != latest || (latest.is_some() && cache.policy.is_none()) {
        let (verified, skipped) = app.latest_verified().await?;
        for s in &skipped {
            warn!("quotas: not using policy {s}");
        }
        cache.policy = verified.map(|v| (v.version, Arc::new(v.policy)));
        cache.seen = latest;
    }
    Ok(cache.policy.clone())
}

fn empty_tree() -> &'static quota::QuotaTree {
    static EMPTY: std::sync::OnceLock<quota::QuotaTree> = std::sync::OnceLock::new();
    EMPTY.get_or_init(quota::QuotaTree::default)
}

fn tree_of(p: &Option<(u64, Arc<policy::Policy>)>) -> &quota::QuotaTree {
    match p {
        Some((_, p)) => p.quotas(),
        None => empty_tree(),
    }
}

/// The nodes the books must hear from before they decide: those heard from within the
/// lease TTL, by this coordinator (since it started) or any (their stored records).
async fn known_nodes(app: &Coordinator) -> ApiResult<Vec<String>> {
    let now = now_ms();
    let ttl_ms = u64::try_from(app.quota.lease_ttl.as_millis()).unwrap_or(u64::MAX);
    let fresh = |t: Option<u64>| t.is_some_and(|t| now.saturating_sub(t) <= ttl_ms);
    let mut known: BTreeSet<String> = BTreeSet::new();
    for rec in app.store().nodes().await.map_err(ApiErr::store)? {
        if fresh(rec.last_contact_ms.max(rec.last_report_ms)) {
            known.insert(rec.node);
        }
    }
    for (node, t) in app.contacts() {
        if fresh(Some(t)) {
            known.insert(node);
        }
    }
    Ok(known.into_iter().collect())
}

/// 503 while the books are rebuilt (every known node has not synced yet).
async fn check_ready(app: &Coordinator) -> ApiResult<()> {
    if app.quota.cell()?.books.is_ready() {
        return Ok(());
    }
    let known = known_nodes(app).await?;
    let mut cell = app.quota.cell()?;
    cell.books
        .ready(known.iter().map(String::as_str), now_ms())
        .map_err(|e| ApiErr::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string()))
}

// --- validation --------------------------------------------------------------------------

fn check_amounts(what: &str, a: &Amounts, max_gpus: u64) -> ApiResult<()> {
    if a.gpus.len() > 16 {
        return Err(ApiErr::bad_request(format!(
            "{what}: {} GPU models; at most 16",
            a.gpus.len()
        )));
    }
    for (model, micro) in &a.gpus {
        if catalog::model(model).is_none() {
            let known: Vec<&str> = catalog::model_names().collect();
            return Err(ApiErr::bad_request(format!(
                "{what}: unknown GPU model {}: expected one of {}",
                untrusted(model).max_chars(64),
                known.join(", ")
            )));
        }
        if *micro > max_gpus.saturating_mul(MICRO_PER_GPU) {
            return Err(ApiErr::bad_request(format!(
                "{what}: {micro} micro-GPUs of {model}; at most {max_gpus} GPUs"
            )));
        }
    }
    if a.cpu_milli > MAX_CORES.saturating_mul(MILLI_PER_CORE) {
        return Err(ApiErr::bad_request(format!(
            "{what}: {} millicores; at most {MAX_CORES} cores",
            a.cpu_milli
        )));
    }
    if a.memory_mib > MAX_MEMORY_GIB.saturating_mul(MIB_PER_GIB) {
        return Err(ApiErr::bad_request(format!(
            "{what}: {} MiB of memory; at most {MAX_MEMORY_GIB} GiB",
            a.memory_mib
        )));
    }
    Ok(())
}

fn check_container(what: &str, id: &str) -> ApiResult<()> {
    tessera_api::validate_container_id(id).map_err(|_| {
        ApiErr::bad_request(format!(
            "{what}: container id {} is not a container id (letters, digits, `_+-.`, at \
             most 1024 bytes, not `.` or `..`)",
            untrusted(id).max_chars(80)
        ))
    })
}

fn check_tenant(
    what: &str,
    tenant: &str,
    policy: &Option<(u64, Arc<policy::Policy>)>,
) -> ApiResult<()> {
    if tessera_api::TenantPath::new(tenant).is_err() {
        return Err(ApiErr::bad_request(format!(
            "{what}: {} is not a tenant path (org[/team[/project[/user]]])",
            untrusted(tenant).max_chars(120)
        )));
    }
    if let Some((version, p)) = policy {
        if p.tenant(tenant).is_none() {
            return Err(ApiErr::bad_request(format!(
                "{what}: no tenant {tenant} in policy version {version} (the policy in force)"
            )));
        }
    }
    Ok(())
}

fn check_workload(what: &str, w: &Option<String>) -> ApiResult<()> {
    if let Some(w) = w {
        if w.len() > MAX_WORKLOAD_BYTES || w.chars().any(char::is_control) {
            return Err(ApiErr::bad_request(format!(
                "{what}: workload must be at most {MAX_WORKLOAD_BYTES} bytes without control \
                 characters"
            )));
        }
    }
    Ok(())
}

fn check_gang_name(what: &str, name: &str) -> ApiResult<()> {
    crate::validate_name("gang name", name).map_err(|e| ApiErr::bad_request(format!("{what}: {e}")))
}

fn check_admit(req: &AdmitRequest, policy: &Option<(u64, Arc<policy::Policy>)>) -> ApiResult<()> {
    let what = "quota admission";
    check_container(what, &req.container_id)?;
    check_tenant(what, &req.tenant, policy)?;
    check_amounts(what, &req.amounts, MAX_GRANT_GPUS)?;
    if req.amounts.is_empty() {
        return Err(ApiErr::bad_request(format!(
            "{what}: container {} asks for nothing",
            req.container_id
        )));
    }
    check_workload(what, &req.workload)?;
    if let Some(g) = &req.gang {
        check_gang_name(what, &g.name)?;
        if !(1..=MAX_GANG_SIZE).contains(&g.size) {
            return Err(ApiErr::bad_request(format!(
                "{what}: gang {} has size {}; expected 1 to {MAX_GANG_SIZE}",
                g.name, g.size
            )));
        }
    }
    Ok(())
}

fn check_holding(i: usize, h: &Holding) -> ApiResult<()> {
    let what = format!("quota sync: holdings[{i}]");
    check_container(&what, &h.container_id)?;
    // A tenant the policy in force no longer names still holds what it holds.
    check_tenant(&what, &h.tenant, &None)?;
    check_amounts(&what, &h.amounts, MAX_GRANT_GPUS)?;
    check_workload(&what, &h.workload)?;
    if let Some(g) = &h.gang {
        check_gang_name(&what, g)?;
    }
    Ok(())
}

fn check_sync(req: &SyncRequest) -> ApiResult<()> {
    if req.holdings.len() > MAX_SYNC_HOLDINGS {
        return Err(ApiErr::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("quota sync: {} holdings; at most {MAX_SYNC_HOLDINGS}", req.holdings.len()),
        ));
    }
    if req.leases.len() > MAX_SYNC_LEASES {
        return Err(ApiErr::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("quota sync: {} leases; at most {MAX_SYNC_LEASES}", req.leases.len()),
        ));
    }
    check_amounts("quota sync: capacity", &req.capacity, MAX_NODE_GPUS)?;
    let mut seen = BTreeSet::new();
    for (i, h) in req.holdings.iter().enumerate() {
        check_holding(i, h)?;
        if !seen.insert(h.container_id.as_str()) {
            return Err(ApiErr::bad_request(format!(
                "quota sync: container {} is listed twice in holdings",
                h.container_id
            )));
        }
    }
    for (i, l) in req.leases.iter().enumerate() {
        let what = format!("quota sync: leases[{i}]");
        check_tenant(&what, &l.path, &None)?;
        check_amounts(&what, &l.amounts, MAX_NODE_GPUS)?;
    }
    if req.stopping.len() > MAX_SYNC_HOLDINGS {
        return Err(ApiErr::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "quota sync: {} containers stopping; at most {MAX_SYNC_HOLDINGS}",
                req.stopping.len()
            ),
        ));
    }
    for (i, c) in req.stopping.iter().enumerate() {
        check_container(&format!("quota sync: stopping[{i}]"), c)?;
    }
    if let Some(a) = &req.last_authority {
        if a.url.len() > MAX_AUTHORITY_BYTES
            || a.scope.len() > MAX_AUTHORITY_BYTES
            || a.url.chars().chain(a.scope.chars()).any(char::is_control)
        {
            return Err(ApiErr::bad_request(format!(
                "quota sync: last_authority's url and scope must be at most {MAX_AUTHORITY_BYTES} bytes without control characters"
            )));
        }
    }
    Ok(())
}

/// The longest URL or scope a node may report of the coordinator that answered it.
const MAX_AUTHORITY_BYTES: usize = 2048;

// --- leadership ---------------------------------------------------------------------------

/// How long a quota call waits for the election (or a takeover) to say who decides before
/// it is answered 503.
pub const DECIDER_WAIT: Duration = Duration::from_secs(2);
/// How long a call passed on to the leader may take (a gang member's: its gang timeout
/// plus this).
const RELAY_TIMEOUT: Duration = Duration::from_secs(10);
/// The header that marks a call passed on by another coordinator (never passed on again).
const RELAYED_BY: &str = "x-tessera-relayed-by";

/// Start taking part in quotas on `url`: alone (a store of one coordinator: this one
/// decides, its books in memory) or in the election on the shared store, following its
/// outcome (taking the books over when elected, dropping them when not).
pub(crate) fn start(app: &Arc<Coordinator>, url: String) {
    let _ = app.quota.url.set(url.clone());
    let Some(backend) = app.quota.backend.clone() else {
        let scope = format!("memory:{}", crate::store::fresh_id(&url));
        app.quota.role.send_replace(app.quota.alone(now_ms(), scope));
        return;
    };
    let me = crate::store::Candidate { url, since_ms: now_ms() };
    let (role, ttl) = (app.quota.role.clone(), app.quota.opts.leader_ttl);
    let campaign = tokio::spawn(async move { backend.campaign(me, ttl, role).await });
    let follow = tokio::spawn(follow_leadership(Arc::downgrade(app)));
    if let Ok(mut tasks) = app.quota.tasks.lock() {
        tasks.extend([campaign, follow]);
    }
}

/// Stop taking part: no more campaigning, and a leadership held is given up at once (its
/// lease revoked), so another coordinator decides without waiting for it to run out.
pub(crate) async fn stop(app: &Arc<Coordinator>) {
    if let Ok(mut tasks) = app.quota.tasks.lock() {
        for t in tasks.drain(..) {
            t.abort();
        }
    }
    let role = app.quota.role.send_replace(Role::Follower { leader: None });
    drop_books(app);
    if let (Role::Leader { fence, .. }, Some(b)) = (role, app.quota.backend.clone()) {
        b.resign(fence).await;
    }
}

/// Follows the election's outcome until the coordinator goes.
async fn follow_leadership(app: std::sync::Weak<Coordinator>) {
    let Some(mut rx) = app.upgrade().map(|a| a.quota.role.subscribe()) else { return };
    loop {
        let role = rx.borrow_and_update().clone();
        let Some(a) = app.upgrade() else { return };
        match role {
            Role::Leader { authority, fence, .. } => take_over(&a, &authority, fence, &rx).await,
            Role::Follower { .. } => drop_books(&a),
            Role::Alone { .. } => {}
        }
        drop(a);
        if rx.changed().await.is_err() {
            return;
        }
    }
}

/// Elected: read the stored books and decide from them (ready at once: they count at least
/// what the nodes may hold). Retried until it works or the leadership ends.
async fn take_over(
    app: &Arc<Coordinator>,
    authority: &Authority,
    fence: crate::store::Fence,
    rx: &tokio::sync::watch::Receiver<Role>,
) {
    let Some(backend) = app.quota.backend.clone() else { return };
    let t0 = std::time::Instant::now();
    let mut backoff = Duration::from_millis(100);
    loop {
        if rx.has_changed().unwrap_or(true) {
            return;
        }
        let loaded = async {
            let state = backend.load_books().await.map_err(|e| e.to_string())?;
            let policy = in_force(app).await.map_err(|e| e.body().error.clone())?;
            Ok::<_, String>((state, policy))
        };
        match loaded.await {
            Ok((state, policy)) => {
                let Ok(mut cell) = app.quota.cell() else { return };
                let current = matches!(&*app.quota.role.borrow(),
                    Role::Leader { authority: a, .. } if a.term == authority.term);
                if !current {
                    return;
                }
                let (nodes, pending, reclaims, waiting, queue_kept) = (
                    state.nodes.len(),
                    state.pending.len(),
                    state.reclaims.len(),
                    state.waiting.len(),
                    state.queue_kept,
                );
                // A store that names no node, admission or reclaim (the first leader of
                // an empty store) has nothing to take over: `restore` rebuilds the books
                // from the nodes' syncs, storing first that they are being rebuilt, so a
                // leader that takes them over before they are ready goes on rebuilding.
                cell.books = Books::restore(
                    app.quota.lease_ttl.as_secs(),
                    now_ms(),
                    state,
                    tree_of(&policy),
                );
                cell.books.set_record_term(authority.term);
                if let Some(h) = cell.history.take() {
                    if !cell.books.keep_history(h) {
                        info!(
                            "another coordinator stored its record since this one last \
                             decided: the stored record goes on"
                        );
                    }
                }
                cell.books.track_changes(true);
                let weak = Arc::downgrade(app);
                cell.journal = Some(Journal::start(backend.clone(), fence.clone(), move |e| {
                    if let Some(app) = weak.upgrade() {
                        step_down(&app, &e.to_string());
                    }
                }));
                app.quota.set_term(&mut cell, Some(authority.term));
                drop(cell);
                app.quota.took_over();
                app.quota.wake();
                info!(
                    term = authority.term,
                    nodes,
                    pending,
                    reclaims,
                    waiting,
                    queue_kept,
                    took_ms = t0.elapsed().as_millis() as u64,
                    "took the quota books over; deciding"
                );
                return;
            }
            Err(e) => {
                warn!("taking the quota books over: {e}; again in {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// Stop deciding at once (a write of the books failed, or a node was answered by a later
/// leader) and give the leadership up, so that a coordinator that can decides.
fn step_down(app: &Arc<Coordinator>, why: &str) {
    let role = app.quota.role();
    let Role::Leader { fence, .. } = role else { return };
    warn!("this coordinator stops deciding quotas: {why}");
    app.quota.warn(
        "stepped-down",
        format!(
            "this coordinator stopped deciding quotas at {}: {}",
            tessera_api::time::format_utc(now_ms()),
            untrusted(why).max_chars(300)
        ),
    );
    app.quota.role.send_replace(Role::Follower { leader: None });
    drop_books(app);
    if let Some(b) = app.quota.backend.clone() {
        tokio::spawn(async move { b.resign(fence).await });
    }
}

/// Not deciding: the books go (the next leader has them in the store).
fn drop_books(app: &Arc<Coordinator>) {
    if let Ok(mut cell) = app.quota.cell() {
        if cell.term.is_some() || cell.journal.is_some() {
            // Its own record goes on if it decides again (the store has the rest).
            cell.history = Some(cell.books.take_history());
            cell.books = Books::new(app.quota.lease_ttl.as_secs(), now_ms());
            app.quota.set_term(&mut cell, None);
            cell.journal = None;
        }
    }
    app.quota.wake();
}

/// Who answers a quota call here.
enum Gate {
    /// This coordinator decides (as `Authority`).
    Decide(Authority),
    /// The coordinator that decides is another: pass the call on to it.
    Relay(Authority),
}

/// Who answers a quota call now: this coordinator when it decides (with its books taken
/// over), else the leader; waits up to [`DECIDER_WAIT`] for an election or a takeover under
/// way, then 503 (nodes fall back on their leases and ask again).
async fn gate(app: &Coordinator, headers: &HeaderMap) -> ApiResult<Gate> {
    let deadline = tokio::time::Instant::now() + DECIDER_WAIT;
    let mut role_rx = app.quota.role.subscribe();
    let mut changed = app.quota.changed.subscribe();
    loop {
        let role = role_rx.borrow_and_update().clone();
        let waiting_for = match role {
            Role::Alone { authority } => return Ok(Gate::Decide(authority)),
            Role::Leader { authority, valid_until, .. } => {
                if crate::store::mono_ms() >= valid_until.load(std::sync::atomic::Ordering::SeqCst)
                {
                    "this coordinator's leadership to be renewed or to end".to_string()
                } else if app.quota.decides_for(authority.term)? {
                    return Ok(Gate::Decide(authority));
                } else {
                    "this coordinator to take the books over".to_string()
                }
            }
            Role::Follower { leader: Some(l) } => {
                if headers.contains_key(RELAYED_BY) {
                    return Err(ApiErr::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!(
                            "this coordinator does not decide quotas ({} does) and does not pass on a call passed on to it; ask again",
                            l.url
                        ),
                    ));
                }
                return Ok(Gate::Relay(l));
            }
            Role::Follower { leader: None } => {
                "an election of the coordinator that decides".to_string()
            }
        };
        tokio::select! {
            r = role_rx.changed() => { if r.is_err() { return Err(unavailable(&waiting_for)); } }
            _ = changed.changed() => {}
            _ = tokio::time::sleep_until(deadline) => return Err(unavailable(&waiting_for)),
        }
    }
}

fn unavailable(waiting_for: &str) -> ApiErr {
    ApiErr::new(
        StatusCode::SERVICE_UNAVAILABLE,
        format!(
            "no coordinator decides quotas now: waiting for {waiting_for} (at most {} s); nodes admit within their leases meanwhile; ask again",
            DECIDER_WAIT.as_secs()
        ),
    )
}

/// The books, checked to be those of `authority`'s leadership (they may have gone since
/// the gate).
fn deciding<'a>(
    app: &'a Coordinator,
    authority: &Authority,
) -> ApiResult<std::sync::MutexGuard<'a, crate::books::Cell>> {
    let cell = app.quota.cell()?;
    if authority.term > 0 && cell.term != Some(authority.term) {
        return Err(ApiErr::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "this coordinator stopped deciding quotas just now; ask again",
        ));
    }
    Ok(cell)
}

/// Waits until the changes a decision made are stored (a leader's journal); 503 when they
/// could not be (the coordinator has stopped deciding: the answer is never given).
async fn stored(s: Option<Stored>) -> ApiResult<()> {
    let Some(s) = s else { return Ok(()) };
    match s.await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(ApiErr::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the quota books could not be stored ({}); this coordinator no longer decides; ask again", untrusted(&e).max_chars(300)),
        )),
        Err(_) => Err(ApiErr::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the quota books' journal stopped; ask again",
        )),
    }
}

/// Who answers a node's or an operator's call: `Ok(authority)` when this coordinator
/// decides ([`gate`]), else `Err` with the leader's answer to the same call passed on
/// ([`relay`]), to be returned as it is.
async fn decide_or_relay(
    app: &Coordinator,
    headers: &HeaderMap,
    method: Method,
    path: &str,
    body: Option<&Bytes>,
    timeout: Duration,
) -> ApiResult<Result<Authority, Response>> {
    match gate(app, headers).await? {
        Gate::Decide(a) => Ok(Ok(a)),
        Gate::Relay(leader) => {
            relay(app, &leader, method, path, headers, body.map(|b| b.to_vec()), timeout)
                .await
                .map(Err)
        }
    }
}

/// Pass a call on to `leader` with the caller's own credential, answering what it answers.
async fn relay(
    app: &Coordinator,
    leader: &Authority,
    method: Method,
    path: &str,
    headers: &HeaderMap,
    body: Option<Vec<u8>>,
    timeout: Duration,
) -> ApiResult<Response> {
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(crate::auth::bearer)
        .ok_or_else(|| ApiErr::new(StatusCode::UNAUTHORIZED, "missing credentials"))?
        .to_string();
    let client = {
        let mut peer = app.quota.peer.lock().map_err(|_| {
            ApiErr::new(StatusCode::INTERNAL_SERVER_ERROR, "the peer client's lock is poisoned")
        })?;
        match &*peer {
            Some((url, c)) if url == &leader.url => c.clone(),
            _ => {
                if leader.url.starts_with("https://") && app.quota.opts.peer_tls.is_none() {
                    return Err(ApiErr::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!(
                            "the coordinator that decides quotas is {}, served over TLS, and this coordinator has no CA to check it with: start it with --peer-ca FILE",
                            leader.url
                        ),
                    ));
                }
                let c = fleet::client::Client::new(&[leader.url.as_str()], "")
                    .map_err(|e| {
                        ApiErr::new(
                            StatusCode::SERVICE_UNAVAILABLE,
                            format!("the leader's URL {}: {e}", leader.url),
                        )
                    })?
                    .with_tls(app.quota.opts.peer_tls.clone());
                *peer = Some((leader.url.clone(), c.clone()));
                c
            }
        }
    };
    let me = app.quota.url.get().cloned().unwrap_or_default();
    let r = client.relay(method, path, &token, &[(RELAYED_BY, me)], body, timeout).await;
    app.quota.counters.relayed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    match r {
        Ok((status, body)) => {
            let mut resp = Response::new(axum::body::Body::from(body));
            *resp.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
            resp.headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
            Ok(resp)
        }
        Err(e) => Err(ApiErr::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "the coordinator that decides quotas, {}, does not answer ({}); ask again",
                leader.url,
                untrusted(&e.to_string()).max_chars(300)
            ),
        )),
    }
}

// --- handlers ----------------------------------------------------------------------------

/// `POST /v1/nodes/{node}/quota/admit`.
pub(crate) async fn admit(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    Path(node): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    app.require_node(&headers, peer, "ask a quota admission", &node, false)?;
    app.touch(&node);
    let req: AdmitRequest = json_body(&body, "quota admission")?;
    let policy = in_force(&app).await?;
    check_admit(&req, &policy)?;
    let timeout_s =
        policy.as_ref().map_or(policy::DEFAULT_GANG_TIMEOUT_S, |(_, p)| p.gang_timeout_s());
    // A gang's member waits at the leader up to the gang's timeout.
    let wait = match req.gang {
        Some(_) => Duration::from_secs(timeout_s) + RELAY_TIMEOUT,
        None => RELAY_TIMEOUT,
    };
    let path = format!("/v1/nodes/{node}/quota/admit");
    let authority =
        match decide_or_relay(&app, &headers, Method::POST, &path, Some(&body), wait).await? {
            Ok(a) => a,
            Err(answer) => return Ok(answer),
        };
    let tree = tree_of(&policy);
    let has_quotas = tree.iter().next().is_some();
    if has_quotas {
        // Books restored from the store are ready at once; books started afresh (alone, or
        // the first leader of an empty store) wait for the known nodes.
        check_ready(&app).await?;
    }
    let Some(gang) = &req.gang else {
        let (answer, changes) = {
            let mut cell = deciding(&app, &authority)?;
            let a = cell.books.admit(tree, &node, &req, now_ms());
            (a, cell.store_changes())
        };
        // A claimant within its guarantee may have released a gang's reservation: its
        // waiting members learn it now.
        app.quota.wake();
        stored(changes).await?;
        log_answer(&node, &req, &answer);
        return Ok(Json(answer).into_response());
    };
    // Subscribed before arriving: a completion after the arrival is never missed.
    let mut changed = app.quota.changed.subscribe();
    let mut closing = app.closing.subscribe();
    let (arrival, changes) = {
        let mut cell = deciding(&app, &authority)?;
        let a = cell.books.gang_arrive(tree, &node, &req, timeout_s, now_ms());
        (a, cell.store_changes())
    };
    let mut deadline_ms = match arrival {
        GangArrival::Answer(a) => {
            app.quota.wake();
            stored(changes).await?;
            log_answer(&node, &req, &a);
            return Ok(Json(a).into_response());
        }
        GangArrival::Wait { deadline_ms } => deadline_ms,
    };
    info!(node = %node, container = %req.container_id, tenant = %req.tenant, gang = %gang.name, size = gang.size, "gang member waits for the rest of its gang");
    loop {
        let wait = Duration::from_millis(deadline_ms.saturating_sub(now_ms())) + GANG_POLL_SLACK;
        tokio::select! {
            r = changed.changed() => {
                if r.is_err() {
                    return Err(ApiErr::new(StatusCode::SERVICE_UNAVAILABLE, "coordinator shutting down; ask again"));
                }
            }
            _ = tokio::time::sleep(wait) => {}
            _ = closing.wait_for(|c| *c) => {
                return Err(ApiErr::new(StatusCode::SERVICE_UNAVAILABLE, "coordinator shutting down; ask again"));
            }
        }
        let now = now_ms();
        let (polled, barrier) = {
            let mut cell = deciding(&app, &authority)?;
            let p = cell.books.gang_poll(&node, &req.container_id, now);
            // The member that completed the gang stored the admissions: what was queued
            // before this answer is stored before it is given.
            let b = match (&p, &cell.journal) {
                (Some(_), Some(j)) => {
                    j.submit(quota::books::state::Changeset { ops: Vec::new(), urgent: true })
                }
                _ => None,
            };
            (p, b)
        };
        if let Some(a) = polled {
            app.quota.wake();
            stored(barrier).await?;
            log_answer(&node, &req, &a);
            return Ok(Json(a).into_response());
        }
        if now > deadline_ms {
            // Not answered past the deadline: the gang restarted under this member (its
            // first try timed out and it came again); wait for the new deadline.
            deadline_ms = now.saturating_add(timeout_s.saturating_mul(1000));
        }
    }
}

fn log_answer(node: &str, req: &AdmitRequest, a: &AdmitAnswer) {
    match a {
        AdmitAnswer::Admitted { class, over } => {
            info!(node = %node, container = %req.container_id, tenant = %req.tenant, class = class.as_str(), over = ?over, "quota admitted")
        }
        AdmitAnswer::Reclaiming { retry_after_s, victims, message } => {
            info!(node = %node, container = %req.container_id, tenant = %req.tenant, retry_after_s, victims = victims.len(), "{message}")
        }
        AdmitAnswer::Refused { message, rule } => {
            info!(node = %node, container = %req.container_id, tenant = %req.tenant, rule = ?rule, "quota refused: {message}")
        }
    }
}

/// `POST /v1/nodes/{node}/quota/resize`: a grant's amounts change (`runc update`).
pub(crate) async fn resize(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    Path(node): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    app.require_node(&headers, peer, "ask a quota resize", &node, false)?;
    app.touch(&node);
    let req: ResizeRequest = json_body(&body, "quota resize")?;
    let what = "quota resize";
    check_container(what, &req.container_id)?;
    // A tenant the policy in force no longer names still holds what it holds.
    check_tenant(what, &req.tenant, &None)?;
    check_amounts(what, &req.amounts, MAX_GRANT_GPUS)?;
    // Decided by the coordinator that decides (issue 28), as an admission is.
    let path = format!("/v1/nodes/{node}/quota/resize");
    let authority =
        match decide_or_relay(&app, &headers, Method::POST, &path, Some(&body), RELAY_TIMEOUT)
            .await?
        {
            Ok(a) => a,
            Err(answer) => return Ok(answer),
        };
    let policy = in_force(&app).await?;
    let tree = tree_of(&policy);
    if tree.iter().next().is_some() {
        check_ready(&app).await?;
    }
    let (answer, changes) = {
        let mut cell = deciding(&app, &authority)?;
        let a = cell.books.resize(tree, &node, &req, now_ms());
        (a, cell.store_changes())
    };
    app.quota.wake();
    // A raise is stored before it is answered (a new leader counts it).
    stored(changes).await?;
    match &answer {
        AdmitAnswer::Admitted { class, .. } => {
            info!(node = %node, container = %req.container_id, tenant = %req.tenant, class = class.as_str(), "quota resize admitted")
        }
        AdmitAnswer::Refused { message, rule } => {
            info!(node = %node, container = %req.container_id, tenant = %req.tenant, rule = ?rule, "quota resize refused: {message}")
        }
        AdmitAnswer::Reclaiming { .. } => {}
    }
    Ok(Json(answer).into_response())
}

/// `POST /v1/nodes/{node}/quota/release`.
pub(crate) async fn release(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    Path(node): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    app.require_node(&headers, peer, "release a quota grant", &node, false)?;
    app.touch(&node);
    let req: ReleaseRequest = json_body(&body, "quota release")?;
    check_container("quota release", &req.container_id)?;
    let path = format!("/v1/nodes/{node}/quota/release");
    let authority =
        match decide_or_relay(&app, &headers, Method::POST, &path, Some(&body), RELAY_TIMEOUT)
            .await?
        {
            Ok(a) => a,
            Err(answer) => return Ok(answer),
        };
    let (found, changes) = {
        let mut cell = deciding(&app, &authority)?;
        let f = cell.books.release(&node, &req.container_id, now_ms());
        (f, cell.store_changes())
    };
    app.quota.wake();
    stored(changes).await?;
    if found {
        info!(node = %node, container = %req.container_id, "quota grant released");
    }
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `POST /v1/nodes/{node}/quota/sync`.
pub(crate) async fn sync(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    Path(node): Path<String>,
    body: Bytes,
) -> ApiResult<Response> {
    app.require_node(&headers, peer, "sync quota holdings", &node, false)?;
    app.touch(&node);
    let req: SyncRequest = json_body(&body, "quota sync")?;
    check_sync(&req)?;
    let path = format!("/v1/nodes/{node}/quota/sync");
    let authority =
        match decide_or_relay(&app, &headers, Method::POST, &path, Some(&body), RELAY_TIMEOUT)
            .await?
        {
            Ok(a) => a,
            Err(answer) => return Ok(answer),
        };
    let policy = in_force(&app).await?;
    let judged = req.last_authority.as_ref().map(|s| (judge_authority(&authority, s), s));
    if let Some((Judgement::Deposed, seen)) = &judged {
        step_down(
            &app,
            &format!(
                "node {node} was answered by a later leader, {} (term {})",
                seen.url, seen.term
            ),
        );
        return Err(ApiErr::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "this coordinator no longer decides quotas; ask again",
        ));
    }
    let (mut answer, changes, ready) = {
        let mut cell = deciding(&app, &authority)?;
        let a = cell.books.sync(tree_of(&policy), &node, &req, now_ms());
        (a, cell.store_changes(), cell.books.is_ready())
    };
    if let Some((Judgement::SplitBrain, seen)) = &judged {
        app.quota.counters.split_brain.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let text = format!(
            "split brain: node {node} was answered {} ms before its last sync by coordinator {} (books {}, term {}), which decides quotas too; this coordinator ({}, books {}) decides for the same nodes: every ceiling and guarantee may be counted twice. Give every coordinator of the fleet the same etcd and --etcd-prefix, or stop the other",
            seen.age_ms,
            untrusted(&seen.url).max_chars(200),
            untrusted(&seen.scope).max_chars(100),
            seen.term,
            authority.url,
            authority.scope
        );
        warn!("{text}");
        app.quota.warn(&format!("split-brain:{}", seen.url), text);
    }
    stored(changes).await?;
    // As a second look at the books would (the answer is not given from books whose
    // lock a panic poisoned meanwhile).
    app.quota.unpoisoned()?;
    // The first syncs after a restart may complete the books (`check_ready` asks again
    // under the lock).
    if !ready {
        let _ = check_ready(&app).await;
    }
    if !answer.preempt.is_empty() {
        info!(node = %node, victims = answer.preempt.len(), "quota sync: the node must stop reclaim victims");
    }
    answer.authority = Some(authority);
    Ok(Json(answer).into_response())
}

/// `DELETE /v1/quota/nodes/{node}` (admin, `tessera quota node-remove`): the node leaves
/// the books at once.
pub(crate) async fn remove_node(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    Path(node): Path<String>,
) -> ApiResult<Response> {
    let admin = app.require_admin(&headers, peer, "remove a node from the quota books")?;
    crate::validate_node_id(&node).map_err(ApiErr::bad_request)?;
    let path = format!("/v1/quota/nodes/{node}");
    let authority =
        match decide_or_relay(&app, &headers, Method::DELETE, &path, None, RELAY_TIMEOUT).await? {
            Ok(a) => a,
            Err(answer) => return Ok(answer),
        };
    let now = now_ms();
    let why = format!("removed by admin {admin} (tessera quota node-remove)");
    let (removed, changes) = {
        let mut cell = deciding(&app, &authority)?;
        let r = cell.books.remove_node(&node, now, &why);
        (r, cell.store_changes())
    };
    app.quota.wake();
    stored(changes).await?;
    let Some(r) = removed else {
        return Err(ApiErr::new(
            StatusCode::NOT_FOUND,
            format!("node {node} is not in the quota books (never synced, or removed already)"),
        ));
    };
    let silent_ms = now.saturating_sub(r.last_sync_ms);
    let warning = (silent_ms < app.quota.lease_ttl.as_millis() as u64).then(|| {
        format!(
            "node {node} synced {} s ago: its lease may still be in force; if it is alive it admits under it while cut off, and its next sync brings it back into the books",
            silent_ms / 1000
        )
    });
    warn!(node = %node, admin = %admin, holdings = r.holdings, pending = r.pending, "node removed from the quota books by an operator");
    let out = NodeRemoval {
        node,
        holdings: r.holdings as u64,
        pending: r.pending as u64,
        held: r.held,
        leases: r.leases,
        last_sync_ms: r.last_sync_ms,
        warning,
    };
    Ok(Json(out).into_response())
}

/// `GET /v1/quota/status`.
pub(crate) async fn status(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
) -> ApiResult<Response> {
    app.require_admin(&headers, peer, "read the quota status")?;
    match gate(&app, &headers).await? {
        Gate::Decide(a) => Ok(Json(status_now(&app, &a).await?).into_response()),
        Gate::Relay(leader) => {
            let r = relay(
                &app,
                &leader,
                Method::GET,
                "/v1/quota/status",
                &headers,
                None,
                RELAY_TIMEOUT,
            )
            .await?;
            if r.status() != StatusCode::OK {
                return Ok(r);
            }
            // Say which coordinator passed it on.
            let bytes =
                axum::body::to_bytes(r.into_body(), MAX_STATUS_BYTES).await.map_err(|e| {
                    ApiErr::new(StatusCode::BAD_GATEWAY, format!("the leader's status: {e}"))
                })?;
            let mut st: QuotaStatus = json_body(&bytes, "the leader's quota status")?;
            st.via = app.quota.url.get().cloned();
            Ok(Json(st).into_response())
        }
    }
}

/// The largest quota status passed on from the leader.
const MAX_STATUS_BYTES: usize = 64 << 20;

async fn status_now(app: &Coordinator, authority: &Authority) -> ApiResult<QuotaStatus> {
    let policy = in_force(app).await?;
    if !app.quota.cell()?.books.is_ready() {
        let _ = check_ready(app).await;
    }
    let version = policy.as_ref().map_or(0, |(v, _)| *v);
    let mut st = deciding(app, authority)?.books.status(tree_of(&policy), version, now_ms());
    st.authority = Some(authority.clone());
    if let Some(b) = &app.quota.backend {
        match tokio::time::timeout(Duration::from_secs(2), b.coordinators()).await {
            Ok(Ok(cs)) => {
                st.coordinators = cs
                    .into_iter()
                    .map(|(c, rev)| CoordinatorInfo {
                        leader: u64::try_from(rev).ok() == Some(authority.term),
                        url: c.url,
                        since_ms: c.since_ms,
                    })
                    .collect();
            }
            Ok(Err(e)) => {
                app.quota.warn("coordinators", format!("the election could not be read: {e}"))
            }
            Err(_) => {
                app.quota.warn("coordinators", "the election could not be read within 2 s".into())
            }
        }
    }
    st.warnings = app.quota.warnings().0;
    Ok(st)
}

/// `GET /v1/quota/events`.
pub(crate) async fn events(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
) -> ApiResult<Response> {
    app.require_admin(&headers, peer, "read the quota events")?;
    match gate(&app, &headers).await? {
        Gate::Decide(a) => Ok(Json(deciding(&app, &a)?.books.events()).into_response()),
        Gate::Relay(leader) => {
            relay(&app, &leader, Method::GET, "/v1/quota/events", &headers, None, RELAY_TIMEOUT)
                .await
        }
    }
}

/// `GET /metrics`: the books' gauges where this coordinator decides; everywhere, its part
/// in the election (leader or not, calls passed on, split brain).
pub(crate) async fn metrics(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
) -> ApiResult<Response> {
    app.require_admin(&headers, peer, "read the metrics")?;
    let role = app.quota.role();
    let mut text = String::new();
    let deciding_now = match &role {
        Role::Alone { authority } => Some(authority.clone()),
        Role::Leader { authority, .. } if app.quota.cell()?.term == Some(authority.term) => {
            Some(authority.clone())
        }
        _ => None,
    };
    if let Some(a) = &deciding_now {
        let st = status_now(&app, a).await?;
        let counters = app.quota.cell()?.books.counters().clone();
        text.push_str(&render_metrics(&st, &counters));
    }
    text.push_str(&render_role_metrics(&app.quota, &role, deciding_now.is_some()));
    let mut resp = text.into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    Ok(resp)
}

/// This coordinator's part in the election, as Prometheus text.
fn render_role_metrics(q: &crate::books::QuotaState, role: &Role, deciding: bool) -> String {
    use std::sync::atomic::Ordering::Relaxed;
    let mut out = String::new();
    let url = escape_label(q.url.get().map_or("", String::as_str));
    let (term, since) = match role.authority() {
        Some(a) if deciding => (a.term, a.since_ms as f64 / 1000.0),
        _ => (0, 0.0),
    };
    for (name, kind, help, value) in [
        ("leader", "gauge", "Whether this coordinator decides the quota books (1) or not (0)", f64::from(u8::from(deciding))),
        ("leader_term", "gauge", "The term (etcd revision) of this coordinator's leadership; 0 when it does not lead or is alone", term as f64),
        ("leader_since_seconds", "gauge", "Since when this coordinator decides (Unix seconds); 0 when it does not", since),
        ("split_brain", "gauge", "Whether a coordinator of other books answered a node this one decides for within the last minute (1)", f64::from(u8::from(q.split_brain_now()))),
        ("split_brain_syncs_total", "counter", "Syncs whose node was last answered by a coordinator of other books", q.counters.split_brain.load(Relaxed) as f64),
        ("relayed_total", "counter", "Quota calls passed on to the coordinator that decides", q.counters.relayed.load(Relaxed) as f64),
        ("takeovers_total", "counter", "Leaderships of the quota books this coordinator took over", q.counters.takeovers.load(Relaxed) as f64),
    ] {
        let _ = writeln!(out, "# HELP tessera_quota_{name} {help}.");
        let _ = writeln!(out, "# TYPE tessera_quota_{name} {kind}");
        let _ = writeln!(out, "tessera_quota_{name}{{coordinator=\"{url}\"}} {value}");
    }
    out
}

// --- Prometheus text ---------------------------------------------------------------------

/// A label value escaped per the Prometheus text format (`\`, `"`, newline).
pub fn escape_label(v: &str) -> String {
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            '\n' => out.push_str("\\n"),
            c => out.push(c),
        }
    }
    out
}

/// An amount in its resource's unit for people and gauges: GPUs, cores, GiB.
fn natural(resource: &str, amount: u64) -> f64 {
    let per = if resource.starts_with("gpus.") {
        MICRO_PER_GPU
    } else if resource == Resource::Cpu.spec_path() {
        MILLI_PER_CORE
    } else {
        MIB_PER_GIB
    };
    amount as f64 / per as f64
}

/// The Prometheus text of the quota gauges and counters.
pub fn render_metrics(st: &QuotaStatus, counters: &quota::books::Counters) -> String {
    type Pick = fn(&fleet::quota_wire::PathStatus) -> Option<f64>;
    let gauges: [(&str, &str, Pick); 14] = [
        ("guarantee", "What the quota path is always given when it asks", |p| {
            p.guarantee.map(|g| natural(&p.resource, g))
        }),
        ("ceiling", "What the quota path never exceeds, guaranteed plus borrowed", |p| {
            p.ceiling.map(|c| natural(&p.resource, c))
        }),
        ("in_use", "Held by the quota path and everything under it (guaranteed + borrowed)", |p| {
            Some(natural(&p.resource, p.in_use))
        }),
        ("borrowed", "Held beyond a guarantee (reclaimable, priced at the burst price)", |p| {
            Some(natural(&p.resource, p.borrowed))
        }),
        ("lent", "The quota path's unused guarantee that other paths hold as borrowed work", |p| {
            Some(natural(&p.resource, p.lent))
        }),
        ("leased", "Held by nodes' leases beyond what the nodes use", |p| {
            Some(natural(&p.resource, p.leased))
        }),
        ("waiting", "Asked by requests of the subtree waiting in the fair queue", |p| {
            Some(natural(&p.resource, p.waiting))
        }),
        ("dominant_share", "The subtree's dominant share of the fleet (DRF), 0 to 1", |p| {
            Some(p.dominant_share)
        }),
        (
            "lost_seconds",
            "Work of the subtree lost to preemption since the coordinator started: the \
             resource times the seconds its victims had run (the grace period for work that \
             checkpoints)",
            |p| Some(natural(&p.resource, p.lost)),
        ),
        ("preemptions_last_hour", "Containers of the subtree preempted in the last hour", |p| {
            Some(p.preemptions_last_hour as f64)
        }),
        (
            "owner_wait_p50_seconds",
            "Median wait of the subtree's owed requests (within guarantee counting the tenant's \
             own requests ahead), first ask to admission",
            |p| p.owner_wait_p50_ms.map(|ms| ms as f64 / 1000.0),
        ),
        (
            "owner_wait_p99_seconds",
            "99th percentile wait of the subtree's owed requests, first ask to admission",
            |p| p.owner_wait_p99_ms.map(|ms| ms as f64 / 1000.0),
        ),
        (
            "owed_later_wait_p50_seconds",
            "Median wait of the subtree's requests owed only later (once their tenant's \
             requests ahead were served), from when a reclaim first found them owed to \
             admission",
            |p| p.owed_later_wait_p50_ms.map(|ms| ms as f64 / 1000.0),
        ),
        (
            "owed_later_wait_p99_seconds",
            "99th percentile wait of the subtree's requests owed only later, from when a \
             reclaim first found them owed to admission",
            |p| p.owed_later_wait_p99_ms.map(|ms| ms as f64 / 1000.0),
        ),
    ];
    let mut out = String::new();
    for (name, help, pick) in gauges {
        let unit = match name {
            "dominant_share" | "preemptions_last_hour" => "",
            n if n.starts_with("owner_wait") || n.starts_with("owed_later") => "",
            "lost_seconds" => " (GPU-seconds for gpus.*, core-seconds, GiB-seconds)",
            _ => " (GPUs for gpus.*, cores for cpu_cores, GiB for memory_gib)",
        };
        let _ = writeln!(out, "# HELP tessera_quota_{name} {help}{unit}.");
        let _ = writeln!(out, "# TYPE tessera_quota_{name} gauge");
        for p in &st.paths {
            if let Some(v) = pick(p) {
                let _ = writeln!(
                    out,
                    "tessera_quota_{name}{{path=\"{}\",resource=\"{}\"}} {v}",
                    escape_label(&p.path),
                    escape_label(&p.resource)
                );
            }
        }
    }
    for (name, help, map) in [
        (
            "reclaims_total",
            "Reclaims started for the quota path (the claimant)",
            &counters.reclaims,
        ),
        (
            "preemptions_total",
            "Containers of the tenant path stopped by reclaims",
            &counters.preemptions,
        ),
    ] {
        let _ = writeln!(out, "# HELP tessera_quota_{name} {help}.");
        let _ = writeln!(out, "# TYPE tessera_quota_{name} counter");
        for (path, n) in map {
            let _ = writeln!(out, "tessera_quota_{name}{{path=\"{}\"}} {n}", escape_label(path));
        }
    }
    let _ = writeln!(out, "# HELP tessera_quota_books_ready Whether every known node has synced since the coordinator started (1) or not (0).");
    let _ = writeln!(out, "# TYPE tessera_quota_books_ready gauge");
    let _ = writeln!(out, "tessera_quota_books_ready {}", u8::from(st.books_ready));
    let _ =
        writeln!(out, "# HELP tessera_quota_preempting Containers being stopped by reclaims now.");
    let _ = writeln!(out, "# TYPE tessera_quota_preempting gauge");
    let _ = writeln!(out, "tessera_quota_preempting {}", st.preempting.len());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape_label(r#"a\b"c"#), r#"a\\b\"c"#);
        assert_eq!(escape_label("x\ny"), "x\\ny");
        assert_eq!(escape_label("acme/ml"), "acme/ml");
    }

    #[test]
    fn metrics_render_gauges_in_natural_units_and_counters() {
        let st = QuotaStatus {
            policy_version: 3,
            capacity: Amounts::default(),
            paths: vec![fleet::quota_wire::PathStatus {
                path: "acme/b".into(),
                resource: "gpus.H100-80GB".into(),
                unit: "micro-GPU".into(),
                guarantee: Some(4 * MICRO_PER_GPU),
                ceiling: None,
                in_use: 2_500_000,
                borrowed: 0,
                lent: 0,
                leased: 1_000_000,
                waiting: 0,
                dominant_share: 0.25,
                lost: 90 * MICRO_PER_GPU,
                preemptions_last_hour: 3,
                owner_wait_p50_ms: Some(1_500),
                owner_wait_p99_ms: Some(32_000),
                owed_later_wait_p50_ms: None,
                owed_later_wait_p99_ms: Some(130_000),
                waiting_why: vec![],
            }],
            books_ready: true,
            nodes: Default::default(),
            preempting: vec![],
            authority: None,
            coordinators: vec![],
            via: None,
            warnings: vec![],
            shape: vec![],
        };
        let mut c = quota::books::Counters::default();
        c.reclaims.insert("acme/a".into(), 2);
        let text = render_metrics(&st, &c);
        for line in [
            "tessera_quota_guarantee{path=\"acme/b\",resource=\"gpus.H100-80GB\"} 4",
            "tessera_quota_in_use{path=\"acme/b\",resource=\"gpus.H100-80GB\"} 2.5",
            "tessera_quota_leased{path=\"acme/b\",resource=\"gpus.H100-80GB\"} 1",
            "tessera_quota_dominant_share{path=\"acme/b\",resource=\"gpus.H100-80GB\"} 0.25",
            "tessera_quota_reclaims_total{path=\"acme/a\"} 2",
            "tessera_quota_lost_seconds{path=\"acme/b\",resource=\"gpus.H100-80GB\"} 90",
            "tessera_quota_preemptions_last_hour{path=\"acme/b\",resource=\"gpus.H100-80GB\"} 3",
            "tessera_quota_owner_wait_p99_seconds{path=\"acme/b\",resource=\"gpus.H100-80GB\"} 32",
            "tessera_quota_owed_later_wait_p99_seconds{path=\"acme/b\",resource=\"gpus.H100-80GB\"} 130",
            "# TYPE tessera_quota_preemptions_total counter",
            "tessera_quota_books_ready 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in:\n{text}");
        }
        assert!(!text.contains("tessera_quota_ceiling{"), "no ceiling set, no sample");
        assert!(
            !text.contains("tessera_quota_owed_later_wait_p50_seconds{"),
            "none kept, no sample"
        );
    }

    /// A leader whose books' lock is poisoned (a panic while a call held it): before
    /// 3837292 the gate read `cell.term` under that lock and every quota call, a sync
    /// naming a later leader included, was answered 500 ("the quota books' lock is
    /// poisoned") with the leadership kept. With the gate reading the term from the atomic
    /// (`decides_for`) the call gets past the gate, the sync judges the node's
    /// `last_authority` a deposition and steps down (role Follower; with etcd it resigns)
    /// and answers 503 instead.
    #[tokio::test]
    async fn rt_sync_poisoned_books_lock_answers_500_and_keeps_the_leadership() {
        use std::sync::atomic::AtomicU64;
        let dir = tempfile::tempdir().unwrap();
        let store = crate::store::SqliteStore::open(&dir.path().join("c.db")).unwrap();
        let tokens = crate::auth::Tokens::parse(
            r#"{"admins": {"alice": "admin-token-0123456789"}, "nodes": {"node-a": "node-a-token-0123456"}}"#,
        )
        .unwrap();
        let app = Coordinator::new(
            Arc::new(store),
            ed25519_dalek::SigningKey::from_bytes(&[7; 32]),
            tokens,
        );
        let authority =
            Authority { url: "http://me:1".into(), term: 5, since_ms: 0, scope: "etcd:X".into() };
        // Elected for term 5, books taken over for it.
        {
            let mut cell = app.quota.cell().unwrap();
            app.quota.set_term(&mut cell, Some(5));
        }
        app.quota.role.send_replace(Role::Leader {
            authority,
            fence: crate::store::Fence { key: "k".into(), revision: 5, lease: 1 },
            valid_until: Arc::new(AtomicU64::new(u64::MAX)),
        });
        // A call panics while it holds the books.
        let a2 = app.clone();
        let _ = std::thread::spawn(move || {
            let _g = a2.quota.cell().unwrap();
            panic!("a call panics holding the books");
        })
        .join();
        assert!(app.quota.cell().is_err(), "the lock is poisoned");
        let req = SyncRequest {
            capacity: Amounts::default(),
            holdings: vec![],
            leases: vec![],
            stopping: vec![],
            last_authority: Some(fleet::quota_wire::SeenAuthority {
                url: "http://other:1".into(),
                term: 9,
                scope: "etcd:X".into(),
                age_ms: 0,
            }),
        };
        let mut headers = HeaderMap::new();
        headers
            .insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer node-a-token-0123456"));
        let r = sync(
            State(app.clone()),
            ConnectInfo("127.0.0.1:1".parse().unwrap()),
            headers,
            Path("node-a".to_string()),
            Bytes::from(serde_json::to_vec(&req).unwrap()),
        )
        .await;
        let status = match &r {
            Ok(resp) => resp.status().as_u16(),
            Err(e) => e.status(),
        };
        let leader = matches!(app.quota.role(), Role::Leader { .. });
        assert!(
            status == 500 && leader,
            "a poisoned books lock: answered {status} ({:?}), still leader: {leader}; before: 500, still leader",
            r.as_ref().err().map(|e| e.body().error.clone())
        );
    }
}
