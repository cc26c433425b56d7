//! Fleet quotas on the coordinator (docs/QUOTAS.md, "The fleet"): the routes of the quota
//! protocol ([`fleet::quota`]) over the pure [`quota::books::Books`], which the coordinator
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
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use fleet::quota::{
    AdmitAnswer, AdmitRequest, Amounts, Holding, QuotaEvent, QuotaStatus, ReleaseRequest,
    ResizeRequest, SyncAnswer, SyncRequest, MAX_GANG_SIZE, MAX_SYNC_HOLDINGS,
};
use quota::books::GangArrival;
use quota::{Resource, MIB_PER_GIB, MICRO_PER_GPU, MILLI_PER_CORE};
use tessera_api::untrusted;
use tracing::{info, warn};

use crate::app::{App, Coordinator};
pub use crate::books::{QuotaState, DEFAULT_LEASE_TTL};
use crate::http::{json_body, ApiErr, ApiResult, Peer};
use crate::now_ms;

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
    if app.quota.books()?.is_ready() {
        return Ok(());
    }
    let known = known_nodes(app).await?;
    let mut books = app.quota.books()?;
    books
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
    Ok(())
}

// --- handlers ----------------------------------------------------------------------------

/// `POST /v1/nodes/{node}/quota/admit`.
pub(crate) async fn admit(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    Path(node): Path<String>,
    body: Bytes,
) -> ApiResult<Json<AdmitAnswer>> {
    app.require_node(&headers, peer, "ask a quota admission", &node, false)?;
    app.touch(&node);
    let req: AdmitRequest = json_body(&body, "quota admission")?;
    let policy = in_force(&app).await?;
    check_admit(&req, &policy)?;
    let tree = tree_of(&policy);
    let has_quotas = tree.iter().next().is_some();
    if has_quotas {
        check_ready(&app).await?;
    }
    let Some(gang) = &req.gang else {
        let answer = app.quota.books()?.admit(tree, &node, &req, now_ms());
        // A claimant within its guarantee may have released a gang's reservation: its
        // waiting members learn it now.
        app.quota.wake();
        log_answer(&node, &req, &answer);
        return Ok(Json(answer));
    };
    let timeout_s =
        policy.as_ref().map_or(policy::DEFAULT_GANG_TIMEOUT_S, |(_, p)| p.gang_timeout_s());
    // Subscribed before arriving: a completion after the arrival is never missed.
    let mut changed = app.quota.changed.subscribe();
    let mut closing = app.closing.subscribe();
    let arrival = app.quota.books()?.gang_arrive(tree, &node, &req, timeout_s, now_ms());
    let mut deadline_ms = match arrival {
        GangArrival::Answer(a) => {
            app.quota.wake();
            log_answer(&node, &req, &a);
            return Ok(Json(a));
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
        let polled = app.quota.books()?.gang_poll(&node, &req.container_id, now);
        if let Some(a) = polled {
            app.quota.wake();
            log_answer(&node, &req, &a);
            return Ok(Json(a));
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
) -> ApiResult<Json<AdmitAnswer>> {
    app.require_node(&headers, peer, "ask a quota resize", &node, false)?;
    app.touch(&node);
    let req: ResizeRequest = json_body(&body, "quota resize")?;
    let what = "quota resize";
    check_container(what, &req.container_id)?;
    // A tenant the policy in force no longer names still holds what it holds.
    check_tenant(what, &req.tenant, &None)?;
    check_amounts(what, &req.amounts, MAX_GRANT_GPUS)?;
    let policy = in_force(&app).await?;
    let tree = tree_of(&policy);
    if tree.iter().next().is_some() {
        check_ready(&app).await?;
    }
    let answer = app.quota.books()?.resize(tree, &node, &req, now_ms());
    app.quota.wake();
    match &answer {
        AdmitAnswer::Admitted { class, .. } => {
            info!(node = %node, container = %req.container_id, tenant = %req.tenant, class = class.as_str(), "quota resize admitted")
        }
        AdmitAnswer::Refused { message, rule } => {
            info!(node = %node, container = %req.container_id, tenant = %req.tenant, rule = ?rule, "quota resize refused: {message}")
        }
        AdmitAnswer::Reclaiming { .. } => {}
    }
    Ok(Json(answer))
}

/// `POST /v1/nodes/{node}/quota/release`.
pub(crate) async fn release(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    Path(node): Path<String>,
    body: Bytes,
) -> ApiResult<StatusCode> {
    app.require_node(&headers, peer, "release a quota grant", &node, false)?;
    app.touch(&node);
    let req: ReleaseRequest = json_body(&body, "quota release")?;
    check_container("quota release", &req.container_id)?;
    let found = app.quota.books()?.release(&node, &req.container_id, now_ms());
    app.quota.wake();
    if found {
        info!(node = %node, container = %req.container_id, "quota grant released");
    }
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /v1/nodes/{node}/quota/sync`.
pub(crate) async fn sync(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
    Path(node): Path<String>,
    body: Bytes,
) -> ApiResult<Json<SyncAnswer>> {
    app.require_node(&headers, peer, "sync quota holdings", &node, false)?;
    app.touch(&node);
    let req: SyncRequest = json_body(&body, "quota sync")?;
    check_sync(&req)?;
    let policy = in_force(&app).await?;
    let answer = app.quota.books()?.sync(tree_of(&policy), &node, &req, now_ms());
    // The first syncs after a restart may complete the books.
    if !app.quota.books()?.is_ready() {
        let _ = check_ready(&app).await;
    }
    if !answer.preempt.is_empty() {
        info!(node = %node, victims = answer.preempt.len(), "quota sync: the node must stop reclaim victims");
    }
    Ok(Json(answer))
}

/// `GET /v1/quota/status`.
pub(crate) async fn status(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
) -> ApiResult<Json<QuotaStatus>> {
    app.require_admin(&headers, peer, "read the quota status")?;
    Ok(Json(status_now(&app).await?))
}

async fn status_now(app: &Coordinator) -> ApiResult<QuotaStatus> {
    let policy = in_force(app).await?;
    if !app.quota.books()?.is_ready() {
        let _ = check_ready(app).await;
    }
    let version = policy.as_ref().map_or(0, |(v, _)| *v);
    let st = app.quota.books()?.status(tree_of(&policy), version, now_ms());
    Ok(st)
}

/// `GET /v1/quota/events`.
pub(crate) async fn events(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
) -> ApiResult<Json<Vec<QuotaEvent>>> {
    app.require_admin(&headers, peer, "read the quota events")?;
    Ok(Json(app.quota.books()?.events()))
}

/// `GET /metrics`.
pub(crate) async fn metrics(
    State(app): App,
    ConnectInfo(peer): Peer,
    headers: HeaderMap,
) -> ApiResult<Response> {
    app.require_admin(&headers, peer, "read the metrics")?;
    let st = status_now(&app).await?;
    let counters = app.quota.books()?.counters().clone();
    let text = render_metrics(&st, &counters);
    let mut resp = text.into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    Ok(resp)
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
    type Pick = fn(&fleet::quota::PathStatus) -> Option<f64>;
    let gauges: [(&str, &str, Pick); 12] = [
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
    ];
    let mut out = String::new();
    for (name, help, pick) in gauges {
        let unit = match name {
            "dominant_share" | "preemptions_last_hour" => "",
            n if n.starts_with("owner_wait") => "",
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
            paths: vec![fleet::quota::PathStatus {
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
                waiting_why: vec![],
            }],
            books_ready: true,
            nodes: Default::default(),
            preempting: vec![],
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
            "# TYPE tessera_quota_preemptions_total counter",
            "tessera_quota_books_ready 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in:\n{text}");
        }
        assert!(!text.contains("tessera_quota_ceiling{"), "no ceiling set, no sample");
    }
}
