//! Following a fleet coordinator (`tesserad --coordinator URL --trust-key KEY`).
//!
//! * **Start**: the policy to start from is the newer of the `--policy` file and the
//!   last-known-good copy in the state dir (a tie goes to last-known-good, which is
//!   signed). Last-known-good is verified again against the pinned key: a file that does
//!   not verify stops the daemon (fail closed) with the reason and the path. With neither
//!   a file nor a last-known-good copy, the daemon asks the coordinators once and starts
//!   from the signed policy they serve, or refuses to start.
//! * **Follow**: [`coordinator::PolicyAgent`] long-polls, verifies every revision
//!   against the pinned key and refuses unsigned, forged, tampered and older ones (the
//!   reason goes to the log, to `GET /v1/status` and to the coordinator). An accepted
//!   revision is swapped in by the controller (`Action::SetPolicy`) under the node lock,
//!   so every decision uses either the old or
//!   the new policy; allocations already granted keep their grants. The agent then keeps
//!   the signed envelope as last-known-good.
//! * **Usage**: every `usage_every`, the closed ledger intervals not uploaded yet go to
//!   the coordinator in chain order, each batch a segment of the ledger's hash chain
//!   signed with the node's key (`STATE/fleet/node.key`; [`::fleet::proof`]). The
//!   coordinator stores a segment only if it extends the chain it holds: a batch whose
//!   answer was lost and is sent again is refused as a replay and counted once (the
//!   uploader asks for the coordinator's head). The high-water mark (every closed interval
//!   up to this chain seq is uploaded) is kept in the state dir with the ledger's id; after
//!   a start, and after any refusal, the coordinator's head for the ledger decides where
//!   the next upload starts.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ::fleet::signing::{self, Verified};
use ::fleet::{AgentConfig, AgentStatus, PolicyAgent, PolicySource};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use tessera_api::{CoordinatorStatus, PolicyRejection, UsageUploadStatus};
use tracing::{error, info, warn};

use crate::controller::{Action, Controller, Outcome};
use crate::error::CoreError;
use crate::node::ActivePolicy;
use crate::DaemonError;

/// How a node follows its fleet coordinator(s).
#[derive(Clone)]
pub struct CoordinatorConfig {
    /// `http://HOST:PORT` of each coordinator, in failover order.
    pub urls: Vec<String>,
    /// The coordinator's public key: only policies it signed are applied.
    pub trust_key: ed25519_dalek::VerifyingKey,
    /// The name this node reports and uploads usage as; `None`: the node's name. It must
    /// be the node's name (the name its ledger intervals carry).
    pub node_id: Option<String>,
    /// The node's bearer token (a node credential of the coordinator's tokens file).
    pub token: String,
    /// How long each long poll waits.
    pub poll_timeout: Duration,
    /// Report status to the coordinator at least this often.
    pub report_every: Duration,
    /// Longest backoff while no coordinator answers.
    pub retry_max: Duration,
    /// How often closed ledger intervals are uploaded.
    pub usage_every: Duration,
    /// How https:// coordinators are verified (`--coordinator-ca`).
    pub tls: Option<Arc<::fleet::tls::ClientConfig>>,
    /// `--policy-overrides-fleet`: the `--policy` file is in force and fleet revisions are
    /// refused (without it, a node in a fleet enforces only signed revisions once it has one).
    pub policy_overrides_fleet: bool,
    /// How often the node syncs its quota holdings and leases (under a policy with
    /// quotas; default [`::fleet::quota_wire::SYNC_INTERVAL`]).
    pub quota_sync_every: Duration,
    /// The node's own key, which signs its usage uploads (the daemon loads or makes
    /// `STATE/fleet/node.key` at start).
    pub node_key: Option<signing::Signer>,
}

impl std::fmt::Debug for CoordinatorConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CoordinatorConfig")
            .field("urls", &self.urls)
            .field("trust_key", &signing::key_id(&self.trust_key))
            .field("node_id", &self.node_id)
            .field("token", &"<redacted>")
            .field("poll_timeout", &self.poll_timeout)
            .field("report_every", &self.report_every)
            .field("retry_max", &self.retry_max)
            .field("usage_every", &self.usage_every)
            .field("policy_overrides_fleet", &self.policy_overrides_fleet)
            .field("quota_sync_every", &self.quota_sync_every)
            .finish()
    }
}

impl CoordinatorConfig {
    /// Defaults for everything but where, whom to trust, and the credential.
    pub fn new(urls: Vec<String>, trust_key: ed25519_dalek::VerifyingKey, token: String) -> Self {
        CoordinatorConfig {
            urls,
            trust_key,
            node_id: None,
            token,
            poll_timeout: Duration::from_secs(30),
            report_every: Duration::from_secs(30),
            retry_max: Duration::from_secs(5),
            usage_every: Duration::from_secs(60),
            tls: None,
            policy_overrides_fleet: false,
            quota_sync_every: ::fleet::quota_wire::SYNC_INTERVAL,
            node_key: None,
        }
    }
}

/// Where the fleet files live in the state dir.
fn fleet_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("fleet")
}

fn err(msg: impl Into<String>) -> DaemonError {
    DaemonError::Coordinator(msg.into())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Plain status data: a panic elsewhere leaves it usable.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The node's link to its coordinators: the agent, what it knows, the usage uploads.
#[derive(Debug)]
pub struct Fleet {
    agent: PolicyAgent,
    status: Arc<Mutex<AgentStatus>>,
    usage: Arc<Mutex<UsageUploadStatus>>,
    urls: Vec<String>,
    node_id: String,
    trust_key_id: String,
    lkg_path: PathBuf,
    mark_path: PathBuf,
    usage_every: Duration,
    local_override: bool,
    quota_sync_every: Duration,
}

impl Fleet {
    /// Check the configuration against the node's name; nothing is contacted yet.
    pub fn new(
        cfg: &CoordinatorConfig,
        node_name: &str,
        state_dir: &Path,
    ) -> Result<Fleet, DaemonError> {
        let node_id = cfg.node_id.clone().unwrap_or_else(|| node_name.to_string());
        ::fleet::validate_node_id(&node_id).map_err(|e| err(format!("--node-id: {e}")))?;
        if node_id != node_name {
            return Err(err(format!(
                "--node-id {node_id:?} differs from this node's name {node_name:?}: the ledger stamps every \
                 interval with the node's name and the coordinator accepts usage only from the node it \
                 belongs to; leave --node-id out or give the coordinator a token for {node_name:?}"
            )));
        }
        if cfg.token.trim().is_empty() {
            return Err(err("the node token is empty"));
        }
        let dir = fleet_dir(state_dir);
        let lkg_path = dir.join("last-known-good.json");
        let mut agent_cfg = AgentConfig::new(
            cfg.urls.clone(),
            node_id.clone(),
            cfg.token.trim().to_string(),
            cfg.trust_key,
            &lkg_path,
        );
        agent_cfg.poll_timeout = cfg.poll_timeout;
        agent_cfg.report_every = cfg.report_every;
        agent_cfg.retry_max = cfg.retry_max.max(agent_cfg.retry_min);
        agent_cfg.tls = cfg.tls.clone();
        agent_cfg.local_override = cfg.policy_overrides_fleet;
        agent_cfg.node_key = cfg.node_key.clone();
        let agent = PolicyAgent::new(agent_cfg).map_err(|e| err(e.to_string()))?;
        Ok(Fleet {
            agent,
            status: Arc::new(Mutex::new(AgentStatus::default())),
            usage: Arc::new(Mutex::new(UsageUploadStatus::default())),
            urls: cfg.urls.clone(),
            node_id,
            trust_key_id: signing::key_id(&cfg.trust_key),
            lkg_path,
            mark_path: dir.join("usage-uploaded.json"),
            usage_every: cfg.usage_every,
            local_override: cfg.policy_overrides_fleet,
            quota_sync_every: cfg.quota_sync_every.max(Duration::from_millis(10)),
        })
    }

    /// The policy to start from (see the module docs), and the agent's matching status.
    pub async fn initial_policy(&self, file: Option<&Path>) -> Result<ActivePolicy, DaemonError> {
        let from_file = match file {
            Some(p) => Some((p, policy::Policy::load(p)?)),
            None => None,
        };
        let lkg = self.agent.load_last_known_good().map_err(|e| {
            err(format!(
                "{e}. Refusing to start from a policy that does not verify against the pinned key {}; \
                 if the trust key was changed on purpose, remove {} to start from --policy or from the coordinator",
                self.trust_key_id,
                self.lkg_path.display()
            ))
        })?;
        let (active, status) = match (lkg, from_file) {
            (kept, Some((path, p))) if self.local_override => {
                warn!(file_version = p.version(), path = %path.display(),
                      "--policy-overrides-fleet: enforcing the local policy file; fleet revisions are refused until the flag is dropped");
                let (active, mut status) = file_start(path, p);
                status.signed_version = kept.map(|k| k.version);
                status.source_reason = Some(format!(
                    "--policy-overrides-fleet: the operator put the local file {} in force over the fleet",
                    path.display()
                ));
                (active, status)
            }
            (Some(kept), file) => {
                info!(version = kept.version, path = %self.lkg_path.display(), "starting from the last-known-good policy");
                let source = format!("last-known-good:{}", self.lkg_path.display());
                let mut status = AgentStatus::started_from(&kept, PolicySource::LastKnownGood);
                if let Some((path, p)) = file {
                    warn!(file_version = p.version(), last_known_good = kept.version, path = %path.display(),
                          "ignoring the unsigned --policy file: this node follows its fleet and enforces only signed \
                           revisions (pass --policy-overrides-fleet to enforce the file instead)");
                    status.source_reason = Some(format!(
                        "signed last-known-good version {} is in force; the unsigned --policy file {} (version {}) \
                         is ignored on a node that follows a fleet",
                        kept.version,
                        path.display(),
                        p.version()
                    ));
                }
                (ActivePolicy { policy: kept.policy, source }, status)
            }
            (None, Some((path, p))) => {
                let (active, mut status) = file_start(path, p);
                status.source_reason = Some(format!(
                    "bootstrap: the unsigned --policy file {} is in force until the first signed fleet revision \
                     (of any version) replaces it",
                    path.display()
                ));
                (active, status)
            }
            (None, None) => self.fetch_first().await?,
        };
        *lock(&self.status) = status;
        Ok(active)
    }

    /// No file and no last-known-good: ask each coordinator once for its latest policy;
    /// one that serves nothing usable (no answer, no policy, a revision that does not
    /// verify) is passed over for the next.
    async fn fetch_first(&self) -> Result<(ActivePolicy, AgentStatus), DaemonError> {
        match self.agent.fetch_first(Duration::from_secs(2)).await {
            Ok((verified, url)) => {
                ::fleet::agent::write_last_known_good(&self.lkg_path, &verified)
                    .map_err(|e| err(e.to_string()))?;
                info!(version = verified.version, coordinator = %url, "starting from the coordinator's policy");
                let mut status = AgentStatus::started_from(&verified, PolicySource::Coordinator);
                status.coordinator = Some(url.clone());
                status.connected = true;
                status.last_contact_ms = Some(::fleet::now_ms());
                let active =
                    ActivePolicy { policy: verified.policy, source: format!("coordinator:{url}") };
                Ok((active, status))
            }
            Err(problems) => Err(err(format!(
                "no policy to start from: no --policy file, no last-known-good policy at {}, and no coordinator served one ({})",
                self.lkg_path.display(),
                problems.join("; ")
            ))),
        }
    }

    /// Follow the coordinators until aborted; every accepted revision is handed to the
    /// controller ([`Action::SetPolicy`]), which swaps it in under the node lock.
    pub fn spawn_agent(&self, ctl: Arc<Controller>) -> tokio::task::JoinHandle<()> {
        let status = self.status.clone();
        let on_policy = {
            let status = status.clone();
            move |v: &Verified| -> Result<(), String> {
                let url = lock(&status).coordinator.clone().unwrap_or_else(|| "unknown".into());
                let active =
                    ActivePolicy { policy: v.policy.clone(), source: format!("coordinator:{url}") };
                let apply = || -> Result<(), String> {
                    ctl.apply(Action::SetPolicy(Box::new(active)))
                        .map(drop)
                        .map_err(|e| e.message())
                };
                // The node lock may be held across a SQLite commit: leave the async
                // worker free while waiting for it.
                let multi_thread = tokio::runtime::Handle::try_current().is_ok_and(|h| {
                    h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread
                });
                if multi_thread {
                    tokio::task::block_in_place(apply)?;
                } else {
                    apply()?;
                }
                info!(version = v.version, digest = %v.digest, coordinator = %url, "new decisions use policy version {}", v.version);
                Ok(())
            }
        };
        let agent = self.agent.clone();
        let (urls, node_id) = (self.urls.clone(), self.node_id.clone());
        tokio::spawn(async move {
            // The agent marks itself connected when its first long poll returns, up to a
            // poll timeout from now; ask once right away so a fresh node's status is true.
            probe(&urls, &node_id, &agent.config().token, agent.config().tls.clone(), &status)
                .await;
            agent.run(on_policy, status).await;
        })
    }

    /// The quota protocol's link to the coordinators: their URLs (in failover order), this
    /// node's id, token and TLS.
    pub fn quota_link(&self) -> Result<crate::quota_gate::Link, DaemonError> {
        let cfg = self.agent.config();
        let client = ::fleet::client::Client::new(&self.urls, &cfg.token)
            .map_err(|e| err(format!("quota link: {e}")))?
            .with_tls(cfg.tls.clone());
        Ok(crate::quota_gate::Link::new(client, self.node_id.clone()))
    }

    /// How often the quota sync runs.
    pub fn quota_sync_every(&self) -> Duration {
        self.quota_sync_every
    }

    /// What `GET /v1/status` shows under `policy.coordinator`.
    pub fn snapshot(&self) -> CoordinatorStatus {
        let s = lock(&self.status).clone();
        CoordinatorStatus {
            urls: self.urls.clone(),
            node_id: self.node_id.clone(),
            trust_key_id: self.trust_key_id.clone(),
            health: s.health().to_string(),
            connected: s.connected,
            current: s.coordinator.clone(),
            applied_version: s.applied_version,
            applied_at_ms: s.applied_at_ms,
            last_contact_ms: s.last_contact_ms,
            last_error: s.last_error.clone().or_else(|| s.apply_error.clone()),
            last_rejection: s.last_rejection.as_ref().map(|r| PolicyRejection {
                version: r.version,
                kind: r.kind.clone(),
                reason: r.reason.clone(),
                coordinator: r.coordinator.clone(),
                at_ms: r.at_ms,
            }),
            rejections: s.rejections,
            last_known_good: self.lkg_path.display().to_string(),
            source_reason: s.source_reason.clone(),
            usage: Some(lock(&self.usage).clone()),
        }
    }

    /// The usage uploader (not started).
    pub fn uploader(&self, ctl: Arc<Controller>) -> Uploader {
        let mark = match load_mark(&self.mark_path) {
            Ok(m) => m,
            Err(e) => {
                warn!(
                    "{e}; uploading every closed interval again (the coordinator counts each once)"
                );
                Mark::default()
            }
        };
        lock(&self.usage).uploaded_through_seq = mark.uploaded_through_seq;
        Uploader {
            agent: self.agent.clone(),
            ctl,
            path: self.mark_path.clone(),
            mark,
            synced: false,
            status: self.usage.clone(),
        }
    }

    /// Upload every `usage_every` until aborted.
    pub fn spawn_usage(
        &self,
        uploader: Arc<tokio::sync::Mutex<Uploader>>,
    ) -> tokio::task::JoinHandle<()> {
        let every = self.usage_every;
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                uploader.lock().await.tick().await;
            }
        })
    }

    /// The API router with `GET /v1/status` showing the coordinator's state too; every
    /// other route is `inner`'s.
    pub fn router(self: &Arc<Self>, ctl: Arc<Controller>, inner: Router) -> Router {
        Router::new()
            .route("/v1/status", get(status_route))
            .route("/v1/usage/verify", get(verify_route))
            .with_state((self.clone(), ctl))
            .fallback_service(inner)
    }
}

/// One authenticated request to each coordinator in turn until one answers: the node's
/// own record (`GET /v1/nodes/{node}`, allowed to the node's credential).
async fn probe(
    urls: &[String],
    node_id: &str,
    token: &str,
    tls: Option<Arc<::fleet::tls::ClientConfig>>,
    status: &Mutex<AgentStatus>,
) {
    for url in urls {
        let Ok(client) = ::fleet::client::Client::new(&[url], token) else { continue };
        let client = client.with_tls(tls.clone());
        match client.with_timeout(Duration::from_secs(5)).node(node_id).await {
            Ok(_) => {
                let mut s = lock(status);
                s.connected = true;
                s.last_contact_ms = Some(::fleet::now_ms());
                s.coordinator = Some(url.clone());
                s.last_error = None;
                info!(coordinator = %url, "coordinator reachable");
                return;
            }
            Err(e) => {
                warn!(coordinator = %url, "coordinator: {e}");
                lock(status).last_error = Some(format!("coordinator {url}: {e}"));
            }
        }
    }
}

fn file_start(path: &Path, p: policy::Policy) -> (ActivePolicy, AgentStatus) {
    info!(version = p.version(), path = %path.display(), "starting from the --policy file");
    let status = AgentStatus {
        applied_version: Some(p.version()),
        applied_digest: Some(p.digest()),
        applied_at_ms: Some(::fleet::now_ms()),
        source: PolicySource::File,
        ..AgentStatus::default()
    };
    (ActivePolicy { policy: p, source: format!("file:{}", path.display()) }, status)
}

async fn status_route(State((fleet, ctl)): State<(Arc<Fleet>, Arc<Controller>)>) -> Response {
    match ctl.run(Action::Status).await {
        Ok(Outcome::Status(mut s)) => {
            s.policy.coordinator = Some(fleet.snapshot());
            (StatusCode::OK, Json(s)).into_response()
        }
        Ok(_) => crate::server::error_response(CoreError::internal("tesserad: unexpected outcome")),
        Err(e) => crate::server::error_response(e),
    }
}

/// `GET /v1/usage/verify` on a fleet node: the ledger's own chain check, then its chain
/// against the coordinator's copy (what the node signed and the coordinator stored): the
/// link the coordinator holds last must be the local link at that seq.
async fn verify_route(State((fleet, ctl)): State<(Arc<Fleet>, Arc<Controller>)>) -> Response {
    let reply = |r: Result<Outcome, CoreError>| match r {
        Ok(o) => (StatusCode::OK, Json(o)).into_response(),
        Err(e) => crate::server::error_response(e),
    };
    let mut report = match ctl.run(Action::VerifyLedger).await {
        Ok(Outcome::ChainReport(r)) => *r,
        other => return reply(other),
    };
    let held = match fleet.agent.usage_head(&report.ledger_id).await {
        Ok(h) => h,
        Err(e) => {
            report.remote = Some(format!("not compared with the coordinator's copy: {e}"));
            return reply(Ok(Outcome::ChainReport(Box::new(report))));
        }
    };
    let problem = |chain_seq, interval: String, why: String| metering::ChainBreak {
        chain_seq,
        interval,
        why,
    };
    if held.seq > report.head.seq {
        report.problems.push(problem(
            report.head.seq + 1,
            "-".into(),
            format!(
                "the coordinator holds this ledger's chain up to seq {}, signed by this node, but the local ledger ends at seq {}: rows were cut off",
                held.seq, report.head.seq
            ),
        ));
    } else if held.seq > 0 {
        match ctl.run(Action::LedgerChain { after: held.seq - 1, limit: 1 }).await {
            Ok(Outcome::Chain { intervals, .. }) => {
                let local =
                    intervals.first().and_then(|i| i.chain.clone().map(|l| (i.id.to_string(), l)));
                match local {
                    Some((_, l)) if l.seq == held.seq && l.hash == held.hash => {}
                    Some((id, l)) => report.problems.push(problem(
                        held.seq,
                        id,
                        format!(
                            "the coordinator holds link {} as {} (signed by this node when uploaded), the local ledger has {}: the local chain was rewritten",
                            held.seq,
                            metering::chain::short(&held.hash),
                            metering::chain::short(&l.hash)
                        ),
                    )),
                    None => report.problems.push(problem(
                        held.seq,
                        "-".into(),
                        "the local ledger has no link at the seq the coordinator holds last".into(),
                    )),
                }
            }
            other => return reply(other),
        }
    }
    report.problems.sort_by_key(|p| if p.chain_seq == 0 { u64::MAX } else { p.chain_seq });
    report.remote = Some(format!(
        "the coordinator holds this ledger up to chain seq {} ({})",
        held.seq,
        metering::chain::short(&held.hash)
    ));
    reply(Ok(Outcome::ChainReport(Box::new(report))))
}

/// The usage high-water mark, kept in the state dir.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Mark {
    /// The ledger file the mark is about (a replaced ledger starts over).
    ledger_id: String,
    /// Every closed interval up to this chain seq is uploaded.
    uploaded_through_seq: u64,
}

fn load_mark(path: &Path) -> Result<Mark, String> {
    Ok(crate::durable::load_json(path, "usage upload mark")?.unwrap_or_default())
}

/// Write the mark durably.
fn store_mark(path: &Path, mark: &Mark) -> Result<(), String> {
    crate::durable::store_json(path, "usage upload mark", mark)
}

/// Intervals read from the ledger per upload round (several signed batches).
const READ_BATCH: usize = 4 * ::fleet::MAX_UPLOAD_BATCH;

/// Uploads closed ledger intervals to the coordinator, in chain order, signed.
#[derive(Debug)]
pub struct Uploader {
    agent: PolicyAgent,
    ctl: Arc<Controller>,
    path: PathBuf,
    mark: Mark,
    /// Whether the mark was checked against the coordinator's head for this ledger (after
    /// a start, a new ledger, or a refusal it is asked again).
    synced: bool,
    status: Arc<Mutex<UsageUploadStatus>>,
}

impl Uploader {
    /// One round: upload what is closed and not uploaded yet. Problems are logged and
    /// shown in the status; the next round tries again.
    pub async fn tick(&mut self) {
        match self.upload().await {
            Ok(()) => lock(&self.status).last_error = None,
            Err(e) => {
                warn!("fleet usage upload: {e}");
                lock(&self.status).last_error = Some(e);
            }
        }
    }

    async fn chain_after(
        &self,
        after: u64,
    ) -> Result<(metering::ChainHead, Vec<metering::ClosedInterval>), String> {
        match self.ctl.run(Action::LedgerChain { after, limit: READ_BATCH }).await {
            Ok(Outcome::Chain { head, intervals }) => Ok((head, intervals)),
            Ok(other) => Err(format!("ledger read: unexpected {other:?}")),
            Err(e) => Err(e.message()),
        }
    }

    async fn upload(&mut self) -> Result<(), String> {
        loop {
            let (head, intervals) = self.chain_after(self.mark.uploaded_through_seq).await?;
            if head.ledger_id != self.mark.ledger_id {
                if !self.mark.ledger_id.is_empty() {
                    info!(old = %self.mark.ledger_id, new = %head.ledger_id, "the ledger file changed: uploading its chain from the start");
                }
                self.mark = Mark { ledger_id: head.ledger_id.clone(), uploaded_through_seq: 0 };
                self.synced = false;
                continue;
            }
            if !self.synced {
                // Where the coordinator's copy of this ledger's chain ends.
                let held = self
                    .agent
                    .usage_head(&head.ledger_id)
                    .await
                    .map_err(|e| format!("asking the coordinator for its chain head: {e}"))?;
                if held.seq > head.seq {
                    return Err(format!(
                        "the coordinator holds ledger {} up to chain seq {} but the local ledger ends at seq {}:                          the ledger file was replaced or cut back (run `tessera usage --verify`)",
                        head.ledger_id, held.seq, head.seq
                    ));
                }
                self.synced = true;
                if held.seq != self.mark.uploaded_through_seq {
                    info!(ledger = %head.ledger_id, local = self.mark.uploaded_through_seq, coordinator = held.seq, "usage upload mark set to the coordinator's chain head");
                    self.set_mark(held.seq);
                    continue;
                }
            }
            lock(&self.status).pending = head.seq.saturating_sub(self.mark.uploaded_through_seq);
            let Some(last) = intervals.last().and_then(|i| i.chain.as_ref()).map(|l| l.seq) else {
                return Ok(());
            };
            match self.agent.upload_usage(&head.ledger_id, &intervals).await {
                Ok(out) => {
                    if !out.conflicts.is_empty() {
                        error!(ids = ?out.conflicts, "the coordinator already holds these interval ids with other content");
                    }
                    let mut s = lock(&self.status);
                    s.accepted += out.accepted;
                    s.duplicates += out.duplicates;
                    s.conflicts += out.conflicts.len() as u64;
                    s.last_upload_ms = Some(::fleet::now_ms());
                    drop(s);
                    if out.accepted > 0 || out.duplicates > 0 {
                        info!(
                            accepted = out.accepted,
                            duplicates = out.duplicates,
                            through = last,
                            "fleet usage uploaded"
                        );
                    }
                    self.set_mark(last);
                }
                Err(e) => {
                    // Refused or unanswered: ask the coordinator's head again next time.
                    self.synced = false;
                    return Err(e.to_string());
                }
            }
        }
    }

    fn set_mark(&mut self, seq: u64) {
        self.mark.uploaded_through_seq = seq;
        lock(&self.status).uploaded_through_seq = seq;
        if let Err(e) = store_mark(&self.path, &self.mark) {
            // Not fatal: after a restart the coordinator's head decides where to start.
            warn!("{e}");
        }
    }
}

/// A reload of the local policy file ([`crate::policy_reload`], which allows it only while
/// the file is the policy in force) against the fleet's view of the policy in force.
impl crate::policy_reload::FleetPolicy for Fleet {
    fn source_reason(&self) -> Option<String> {
        self.snapshot().source_reason
    }
    /// What the node reports: `version` is in force.
    fn note_local_reload(&self, version: u64, digest: &str) {
        let mut s = lock(&self.status);
        s.applied_version = Some(version);
        s.applied_digest = Some(digest.to_string());
        s.applied_at_ms = Some(::fleet::now_ms());
        s.rejections_at_apply = s.rejections;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mark_round_trips_and_a_broken_one_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("fleet/usage-uploaded.json");
        assert_eq!(load_mark(&p).unwrap(), Mark::default());
        let m = Mark { ledger_id: "abc".into(), uploaded_through_seq: 42 };
        store_mark(&p, &m).unwrap();
        assert_eq!(load_mark(&p).unwrap(), m);
        std::fs::write(&p, b"{").unwrap();
        assert!(load_mark(&p).unwrap_err().contains(&p.display().to_string()));
    }

    /// A state dir with a signed last-known-good of `lkg_version` and a `--policy` file of
    /// `file_version`.
    fn node_with(lkg_version: u64, file_version: u64) -> (tempfile::TempDir, CoordinatorConfig) {
        let dir = tempfile::tempdir().unwrap();
        let key = ed25519_dalek::SigningKey::from_bytes(&[9; 32]);
        let doc = |v: u64| format!(r#"{{"version": {v}, "orgs": {{"acme": {{"trust": "dev"}}}}}}"#);
        let env = signing::sign(&key, doc(lkg_version).as_bytes(), "alice", 1).unwrap();
        let verified = signing::verify(&env, &key.verifying_key()).unwrap();
        ::fleet::agent::write_last_known_good(
            &dir.path().join("fleet/last-known-good.json"),
            &verified,
        )
        .unwrap();
        std::fs::write(dir.path().join("policy.json"), doc(file_version)).unwrap();
        let cfg = CoordinatorConfig::new(
            vec!["http://127.0.0.1:1".into()],
            key.verifying_key(),
            "node-token-0123456789".into(),
        );
        (dir, cfg)
    }

    #[tokio::test]
    async fn a_signed_last_known_good_wins_over_a_newer_unsigned_file_unless_overridden() {
        let (dir, mut cfg) = node_with(2, 9);
        let file = dir.path().join("policy.json");
        let fleet = Fleet::new(&cfg, "node-a", dir.path()).unwrap();
        let active = fleet.initial_policy(Some(&file)).await.unwrap();
        assert_eq!(active.policy.version(), 2, "the signed policy, not the file's version 9");
        assert!(active.source.starts_with("last-known-good:"), "{}", active.source);
        let snap = fleet.snapshot();
        let why = snap.source_reason.unwrap();
        assert!(why.contains("ignored") && why.contains("policy.json"), "{why}");
        assert_eq!(lock(&fleet.status).signed_version, Some(2));

        // The operator's flag: the file is in force and fleet revisions are refused.
        cfg.policy_overrides_fleet = true;
        let fleet = Fleet::new(&cfg, "node-a", dir.path()).unwrap();
        let active = fleet.initial_policy(Some(&file)).await.unwrap();
        assert_eq!(active.policy.version(), 9);
        assert!(active.source.starts_with("file:"), "{}", active.source);
        let why = fleet.snapshot().source_reason.unwrap();
        assert!(why.contains("--policy-overrides-fleet"), "{why}");
        assert!(fleet.agent.config().local_override);
    }

    #[tokio::test]
    async fn an_unsigned_bootstrap_file_sets_no_signed_floor() {
        let (dir, cfg) = node_with(1, 7);
        std::fs::remove_file(dir.path().join("fleet/last-known-good.json")).unwrap();
        let fleet = Fleet::new(&cfg, "node-a", dir.path()).unwrap();
        let active = fleet.initial_policy(Some(&dir.path().join("policy.json"))).await.unwrap();
        assert_eq!(active.policy.version(), 7);
        let s = lock(&fleet.status).clone();
        assert_eq!((s.applied_version, s.signed_version), (Some(7), None));
        assert!(s.source_reason.unwrap().contains("bootstrap"));
    }

    #[test]
    fn debug_never_prints_the_token() {
        let key = signing::parse_verifying_key(&"3b".repeat(32), "k");
        // Any valid point will do; fall back to a generated key.
        let key = key.unwrap_or_else(|_| signing::generate_signing_key().unwrap().verifying_key());
        let cfg = CoordinatorConfig::new(
            vec!["http://127.0.0.1:1".into()],
            key,
            "secret-token-0123456789".into(),
        );
        let shown = format!("{cfg:?}");
        assert!(!shown.contains("secret-token"), "{shown}");
    }
}
