//! The node side: follow the coordinator, verify, apply, remember.
//!
//! ```text
//! loop:
//!   long poll  GET /v1/policies/latest?newer_than=<applied>   (one coordinator URL)
//!   200 → parse envelope → verify against the pinned key → version > applied?
//!         no  → reject: reason into AgentStatus.last_rejection, reported to the coordinator
//!         yes → on_policy(&verified) (the daemon swaps its policy atomically)
//!               → write last-known-good (tmp + fsync + rename + fsync dir) → report
//!   204 → nothing newer; poll again
//!   no answer / 5xx / shutting down → next URL at once; after a full round, back off
//! ```
//!
//! A rejected version is not asked for again for `reject_hold` (the poll asks for
//! versions above it), so a coordinator serving a forged revision cannot make the node
//! spin, and a genuine newer push still arrives at once.
//!
//! Start-up (the daemon's part): `load_last_known_good()` verifies the stored envelope
//! again with the pinned key (a tampered file is an error, never applied), the daemon
//! applies it, records it with [`AgentStatus::started_from`], then spawns [`PolicyAgent::run`].
//! A node that cannot reach any coordinator keeps enforcing what it has.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use ed25519_dalek::VerifyingKey;
use hyper::Method;
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

use crate::http::{self, Endpoint, HttpError};
use crate::now_ms;
use crate::signing::{self, key_id, Signer, Verified};
use crate::wire::{ErrorBody, NodeReport, UploadOutcome, UsageUpload, MAX_UPLOAD_BATCH};
use metering::chain::ChainHead;

/// How the agent follows the coordinator.
#[derive(Clone)]
pub struct AgentConfig {
    /// Coordinators to try in order (`http://HOST:PORT`); the agent fails over between them.
    pub coordinator_urls: Vec<String>,
    pub node_id: String,
    /// The node's bearer token.
    pub token: String,
    /// The coordinator's public key, pinned: nothing else is trusted.
    pub trust_key: VerifyingKey,
    /// Where the last applied envelope is kept.
    pub lkg_path: PathBuf,
    /// How long each long poll waits (default 30 s).
    pub poll_timeout: Duration,
    /// Report status at least this often (default 30 s).
    pub report_every: Duration,
    /// Backoff between full rounds of unreachable coordinators: from `retry_min`
    /// doubling to `retry_max` (defaults 200 ms, 5 s).
    pub retry_min: Duration,
    pub retry_max: Duration,
    /// After refusing a revision, wait this long before polling again (default 1 s) ...
    pub reject_delay: Duration,
    /// ... and ask only for versions above it for this long (default 60 s).
    pub reject_hold: Duration,
    /// How `https://` coordinators are verified ([`crate::tls::client_config`]).
    pub tls: Option<Arc<rustls::ClientConfig>>,
    /// The operator's `--policy-overrides-fleet`: a local policy file is in force and
    /// every fleet revision is refused (kind `local-override`) until the flag is dropped.
    pub local_override: bool,
    /// The node's own key, which signs every usage upload ([`crate::proof`]); without it
    /// usage cannot be uploaded.
    pub node_key: Option<Signer>,
}

impl std::fmt::Debug for AgentConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentConfig")
            .field("coordinator_urls", &self.coordinator_urls)
            .field("node_id", &self.node_id)
            .field("trust_key", &key_id(&self.trust_key))
            .field("lkg_path", &self.lkg_path)
            .finish_non_exhaustive()
    }
}

impl AgentConfig {
    /// A configuration with the default timings.
    pub fn new(
        coordinator_urls: Vec<String>,
        node_id: impl Into<String>,
        token: impl Into<String>,
        trust_key: VerifyingKey,
        lkg_path: impl Into<PathBuf>,
    ) -> Self {
        AgentConfig {
            coordinator_urls,
            node_id: node_id.into(),
            token: token.into(),
            trust_key,
            lkg_path: lkg_path.into(),
            poll_timeout: Duration::from_secs(30),
            report_every: Duration::from_secs(30),
            retry_min: Duration::from_millis(200),
            retry_max: Duration::from_secs(5),
            reject_delay: Duration::from_secs(1),
            reject_hold: Duration::from_secs(60),
            tls: None,
            local_override: false,
            node_key: None,
        }
    }
}

/// Where the policy in force came from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicySource {
    /// No policy yet.
    #[default]
    None,
    /// A local policy file (the daemon's `--policy`).
    File,
    /// The last-known-good copy on disk.
    LastKnownGood,
    /// Received from a coordinator in this run.
    Coordinator,
}

impl PolicySource {
    pub fn as_str(self) -> &'static str {
        match self {
            PolicySource::None => "none",
            PolicySource::File => "file",
            PolicySource::LastKnownGood => "last-known-good",
            PolicySource::Coordinator => "coordinator",
        }
    }
}

/// A revision the node refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rejection {
    /// The version the envelope claimed (0 when it could not be read at all).
    pub version: u64,
    /// `unsigned`, `forged`, `wrong-key`, `tampered`, `older`, `invalid-policy`, ...
    pub kind: String,
    pub reason: String,
    /// The coordinator URL that served it.
    pub coordinator: String,
    pub at_ms: u64,
}

/// What the agent knows; shared with the daemon (status API, metrics).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentStatus {
    pub applied_version: Option<u64>,
    /// The version of the last *signed* revision this node enforced (last-known-good or
    /// received); the agent accepts only signed revisions above it. `None` while an
    /// unsigned bootstrap file (or nothing) is in force: then any signed revision
    /// replaces it, whatever the file's version.
    #[serde(default)]
    pub signed_version: Option<u64>,
    /// Why the source in force is the one in force (`--policy-overrides-fleet`, bootstrap
    /// file until the first signed revision, ...).
    #[serde(default)]
    pub source_reason: Option<String>,
    pub applied_digest: Option<String>,
    /// When the policy in force was applied (by this agent or at start).
    pub applied_at_ms: Option<u64>,
    pub source: PolicySource,
    /// The last problem of any kind (unreachable, refused, rejected, apply failed).
    pub last_error: Option<String>,
    pub last_rejection: Option<Rejection>,
    /// How many revisions were refused since start.
    pub rejections: u64,
    /// `rejections` when the policy in force was applied: a refusal since then is still
    /// open even within the same millisecond as the apply, and one before it is not.
    #[serde(default)]
    pub rejections_at_apply: u64,
    /// The last time a coordinator answered.
    pub last_contact_ms: Option<u64>,
    /// The coordinator URL last used.
    pub coordinator: Option<String>,
    /// Whether the last request to a coordinator got a usable answer.
    pub connected: bool,
    /// The last `on_policy` failure, until a later version applies.
    pub apply_error: Option<String>,
    /// When a poll last came back with nothing newer after an *older* offer: the replay
    /// has stopped, so that refusal no longer degrades health.
    #[serde(default)]
    pub older_cleared_ms: Option<u64>,
}

impl AgentStatus {
    /// The status of a node that starts enforcing `verified` (from last-known-good or
    /// from a file the daemon verified).
    pub fn started_from(verified: &Verified, source: PolicySource) -> Self {
        AgentStatus {
            applied_version: Some(verified.version),
            signed_version: Some(verified.version),
            applied_digest: Some(verified.digest.clone()),
            applied_at_ms: Some(now_ms()),
            source,
            ..AgentStatus::default()
        }
    }

    /// The refusal that is still unresolved: made since the policy in force was applied.
    /// A refusal under `--policy-overrides-fleet` is the operator's choice, not a problem.
    pub fn open_rejection(&self) -> Option<&Rejection> {
        self.last_rejection.as_ref().filter(|r| {
            r.kind != LOCAL_OVERRIDE
                && (self.rejections > self.rejections_at_apply
                    || self.applied_at_ms.is_none_or(|t| r.at_ms > t))
                && !(r.kind == OLDER && self.older_cleared_ms.is_some_and(|t| t >= r.at_ms))
        })
    }

    /// `ok`: connected, enforcing a policy, no apply failure, and no revision refused
    /// since the policy in force was applied. Every refusal counts, an *older* one too: a
    /// coordinator answers a poll only with versions above the one asked for, so an older
    /// offer is an intermediary replaying old answers while the node may fall behind.
    /// Else `degraded`.
    pub fn health(&self) -> &'static str {
        let refused_since_apply = self.open_rejection().is_some();
        if self.connected
            && self.applied_version.is_some()
            && !refused_since_apply
            && self.apply_error.is_none()
        {
            "ok"
        } else {
            "degraded"
        }
    }

    fn report(&self) -> NodeReport {
        NodeReport {
            applied_version: self.applied_version,
            applied_digest: self.applied_digest.clone(),
            source: self.source.as_str().to_string(),
            health: self.health().to_string(),
            last_error: self.last_error.clone().or_else(|| self.apply_error.clone()),
            // Only while unresolved: once a later policy is applied, `tessera nodes` stops
            // showing the old refusal.
            last_rejection: self
                .open_rejection()
                .map(|r| format!("version {} from {}: {}", r.version, r.coordinator, r.reason)),
        }
    }
}

/// The rejection kind of a signed revision at or below the signed version in force.
pub const OLDER: &str = "older";

/// The rejection kind of a fleet revision refused under `--policy-overrides-fleet`.
pub const LOCAL_OVERRIDE: &str = "local-override";

/// Why an agent call failed.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("agent configuration: {0}")]
    Config(String),
    #[error("last-known-good policy {path}: {why}")]
    LastKnownGood { path: PathBuf, why: String },
    #[error(transparent)]
    Http(#[from] HttpError),
    #[error("coordinator {url} refused: {status} {}", error.error)]
    Refused { url: String, status: u16, error: ErrorBody },
    #[error("unexpected answer from {url}: {why}")]
    Protocol { url: String, why: String },
}

/// The node-side policy agent. Cheap to clone (the daemon keeps one for usage uploads
/// while another runs the watch loop).
#[derive(Clone)]
pub struct PolicyAgent {
    cfg: Arc<AgentConfig>,
    endpoints: Arc<Vec<Endpoint>>,
    pool: http::Pool,
}

impl std::fmt::Debug for PolicyAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyAgent").field("cfg", &self.cfg).finish()
    }
}

enum Poll {
    Nothing,
    Offered(Bytes),
}

impl PolicyAgent {
    pub fn new(cfg: AgentConfig) -> Result<PolicyAgent, AgentError> {
        crate::validate_node_id(&cfg.node_id).map_err(AgentError::Config)?;
        if cfg.coordinator_urls.is_empty() {
            return Err(AgentError::Config("no coordinator url".into()));
        }
        let endpoints = cfg
            .coordinator_urls
            .iter()
            .map(|u| Endpoint::parse(u))
            .collect::<Result<Vec<_>, _>>()?;
        if let Some(ep) = endpoints.iter().find(|e| !e.tls && cfg.tls.is_some()) {
            return Err(AgentError::Http(http::plain_with_ca(&ep.url)));
        }
        if let Some(ep) = endpoints.iter().find(|e| e.tls && cfg.tls.is_none()) {
            return Err(AgentError::Config(format!(
                "{} is https:// but no CA is configured to verify it (--coordinator-ca FILE)",
                ep.url
            )));
        }
        let pool = http::Pool::new(cfg.tls.clone());
        Ok(PolicyAgent { cfg: Arc::new(cfg), endpoints: Arc::new(endpoints), pool })
    }

    pub fn config(&self) -> &AgentConfig {
        &self.cfg
    }

    /// The policy kept on disk, verified again against the pinned key. `Ok(None)` when
    /// there is none; an error when the file is there but unreadable, tampered with,
    /// or signed by another key.
    pub fn load_last_known_good(&self) -> Result<Option<Verified>, AgentError> {
        let path = &self.cfg.lkg_path;
        let bytes = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => {
                return Err(AgentError::LastKnownGood { path: path.clone(), why: e.to_string() })
            }
        };
        let env = signing::parse_envelope(&bytes)
            .map_err(|e| AgentError::LastKnownGood { path: path.clone(), why: e.to_string() })?;
        signing::verify(&env, &self.cfg.trust_key)
            .map(Some)
            .map_err(|e| AgentError::LastKnownGood { path: path.clone(), why: e.to_string() })
    }

    /// A fresh node's first policy: ask each coordinator in turn for its latest revision
    /// (a short poll), verify it against the pinned key, and return the first that
    /// verifies with the URL that served it. A coordinator that does not answer, has no
    /// policy, or serves one that does not verify is passed over for the next; the error
    /// lists what each one did.
    pub async fn fetch_first(&self, wait: Duration) -> Result<(Verified, String), Vec<String>> {
        let mut problems = Vec::new();
        for ep in self.endpoints.iter() {
            let r = self.latest(ep, 0, wait).await;
            let body = match r {
                Ok(r) if r.status == 200 => r.body,
                Ok(r) if r.status == 204 => {
                    problems.push(format!("{} has no policy yet", ep.url));
                    continue;
                }
                Ok(r) => {
                    problems.push(refused(ep, r.status, &r.body).to_string());
                    continue;
                }
                Err(e) => {
                    problems.push(format!("{}: {e}", ep.url));
                    continue;
                }
            };
            let verified = signing::parse_envelope(&body)
                .and_then(|env| signing::verify(&env, &self.cfg.trust_key));
            match verified {
                Ok(v) => return Ok((v, ep.url.clone())),
                Err(e) => {
                    warn!(coordinator = %ep.url, kind = e.kind(), "refused the first policy: {e}; trying the next coordinator");
                    problems.push(format!(
                        "the policy served by {} is refused ({}): {e}",
                        ep.url,
                        e.kind()
                    ));
                }
            }
        }
        Err(problems)
    }

    /// Follow the coordinators forever (abort the task to stop). `status.applied_version`
    /// is the version in force when called (see [`AgentStatus::started_from`]).
    pub async fn run<F>(self, mut on_policy: F, status: Arc<Mutex<AgentStatus>>)
    where
        F: FnMut(&Verified) -> Result<(), String> + Send,
    {
        let n = self.endpoints.len();
        let mut idx = 0usize;
        let mut failed_in_round = 0usize;
        let mut backoff = self.cfg.retry_min;
        let mut hold: Option<(u64, Instant)> = None;
        let mut last_report: Option<Instant> = None;
        let mut report_due = true;
        loop {
            let ep = self.endpoints[idx % n].clone();
            if report_due || last_report.is_none_or_elapsed(self.cfg.report_every) {
                let snapshot = lock(&status).clone();
                match self.report_to(&ep, &snapshot).await {
                    Ok(()) => {
                        report_due = false;
                        last_report = Some(Instant::now());
                        // An answered report proves this coordinator is reachable now: a
                        // node that just failed over is connected before its long poll
                        // (up to a poll timeout) returns.
                        mark_connected(&status, &ep.url);
                    }
                    Err(e) => warn!(coordinator = %ep.url, "status report failed: {e}"),
                }
            }
            // The floor is the last *signed* version in force: an unsigned bootstrap file
            // never hides a fleet revision, whatever version it claims.
            let applied = lock(&status).signed_version.unwrap_or(0);
            let held = hold.filter(|(_, until)| Instant::now() < *until).map_or(0, |(v, _)| v);
            match self.poll(&ep, applied.max(held)).await {
                Ok(poll) => {
                    failed_in_round = 0;
                    backoff = self.cfg.retry_min;
                    mark_connected(&status, &ep.url);
                    if matches!(poll, Poll::Nothing) {
                        let mut s = lock(&status);
                        if s.last_rejection.as_ref().is_some_and(|r| r.kind == OLDER) {
                            s.older_cleared_ms = Some(now_ms());
                        }
                    }
                    if let Poll::Offered(body) = poll {
                        match self.consider(&ep, &body, applied, &mut on_policy, &status) {
                            Ok(()) => hold = None,
                            Err(version) => {
                                hold = Some((
                                    version.max(applied),
                                    Instant::now() + self.cfg.reject_hold,
                                ));
                                tokio::time::sleep(self.cfg.reject_delay).await;
                            }
                        }
                        report_due = true;
                    }
                }
                Err(e) => {
                    let msg = format!("coordinator {}: {e}", ep.url);
                    warn!("{msg}");
                    {
                        let mut s = lock(&status);
                        s.connected = false;
                        s.last_error = Some(msg);
                    }
                    report_due = true;
                    idx = (idx + 1) % n;
                    failed_in_round += 1;
                    if failed_in_round >= n {
                        failed_in_round = 0;
                        tokio::time::sleep(backoff).await;
                        backoff = (backoff * 2).min(self.cfg.retry_max);
                    }
                }
            }
        }
    }

    /// Verify and apply an offered envelope. `Err(version)`: refused or failed.
    fn consider<F>(
        &self,
        ep: &Endpoint,
        body: &[u8],
        applied: u64,
        on_policy: &mut F,
        status: &Arc<Mutex<AgentStatus>>,
    ) -> Result<(), u64>
    where
        F: FnMut(&Verified) -> Result<(), String>,
    {
        let reject = |version: u64, kind: &str, reason: String| {
            warn!(coordinator = %ep.url, version, kind, "refused policy revision: {reason}");
            let mut s = lock(status);
            s.rejections += 1;
            s.last_error = Some(format!("refused policy version {version}: {reason}"));
            s.last_rejection = Some(Rejection {
                version,
                kind: kind.to_string(),
                reason,
                coordinator: ep.url.clone(),
                at_ms: now_ms(),
            });
            version
        };
        let env = signing::parse_envelope(body).map_err(|e| reject(0, e.kind(), e.to_string()))?;
        let verified = signing::verify(&env, &self.cfg.trust_key)
            .map_err(|e| reject(env.version, e.kind(), e.to_string()))?;
        if self.cfg.local_override {
            return Err(reject(
                verified.version,
                LOCAL_OVERRIDE,
                format!(
                    "signed version {} not applied: --policy-overrides-fleet keeps the local policy file in force",
                    verified.version
                ),
            ));
        }
        if verified.version <= applied {
            return Err(reject(
                verified.version,
                OLDER,
                format!(
                    "older or equal version: offered {} but signed version {applied} is in force (a \
                     coordinator only offers newer ones: replayed or stale answers?)",
                    verified.version
                ),
            ));
        }
        if let Err(e) = on_policy(&verified) {
            warn!(version = verified.version, "applying the policy failed: {e}");
            let mut s = lock(status);
            s.apply_error = Some(format!("applying version {} failed: {e}", verified.version));
            s.last_error = s.apply_error.clone();
            return Err(verified.version);
        }
        let lkg = write_last_known_good(&self.cfg.lkg_path, &verified);
        let mut s = lock(status);
        s.applied_version = Some(verified.version);
        s.signed_version = Some(verified.version);
        s.source_reason = None;
        s.applied_digest = Some(verified.digest.clone());
        s.applied_at_ms = Some(now_ms());
        s.rejections_at_apply = s.rejections;
        s.source = PolicySource::Coordinator;
        s.apply_error = None;
        s.last_error = None;
        if let Err(e) = lkg {
            warn!("{e}");
            s.last_error = Some(e.to_string());
        }
        info!(version = verified.version, author = %verified.author, coordinator = %ep.url, "policy applied");
        Ok(())
    }

    /// `GET /v1/policies/latest`, long-polled for `wait`: a revision newer than
    /// `newer_than`, or 204 once `wait` has passed without one.
    async fn latest(
        &self,
        ep: &Endpoint,
        newer_than: u64,
        wait: Duration,
    ) -> Result<http::Response, http::HttpError> {
        let timeout_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        let path = format!("/v1/policies/latest?newer_than={newer_than}&timeout_ms={timeout_ms}");
        http::request(
            &self.pool,
            ep,
            Method::GET,
            &path,
            Some(&self.cfg.token),
            &[],
            None,
            wait + Duration::from_secs(10),
        )
        .await
    }

    async fn poll(&self, ep: &Endpoint, newer_than: u64) -> Result<Poll, AgentError> {
        let r = self.latest(ep, newer_than, self.cfg.poll_timeout).await?;
        match r.status {
            200 => Ok(Poll::Offered(r.body)),
            204 => Ok(Poll::Nothing),
            status => Err(refused(ep, status, &r.body)),
        }
    }

    async fn report_to(&self, ep: &Endpoint, status: &AgentStatus) -> Result<(), AgentError> {
        let body =
            serde_json::to_vec(&status.report()).map_err(|e| AgentError::Config(e.to_string()))?;
        let path = format!("/v1/nodes/{}/report", self.cfg.node_id);
        let r = http::request(
            &self.pool,
            ep,
            Method::POST,
            &path,
            Some(&self.cfg.token),
            &[],
            Some(body),
            Duration::from_secs(5),
        )
        .await?;
        if (200..300).contains(&r.status) {
            Ok(())
        } else {
            Err(refused(ep, r.status, &r.body))
        }
    }

    /// Send a status report now (to the first coordinator that answers).
    pub async fn report(&self, status: &AgentStatus) -> Result<(), AgentError> {
        let mut last = None;
        for ep in self.endpoints.iter() {
            match self.report_to(ep, status).await {
                Ok(()) => return Ok(()),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| AgentError::Config("no coordinator url".into())))
    }

    /// Upload consecutive links of ledger `ledger_id`'s chain (closed intervals in chain
    /// order, extending what the coordinator holds), in batches, each signed with the node
    /// key; a batch that gets no answer or a 5xx is retried (up to 4 rounds over every
    /// coordinator). A batch that was stored although its answer was lost comes back as
    /// "replayed": the agent then asks the coordinator for its head and counts what the
    /// head covers as duplicates, sending only the rest. Safe to repeat.
    pub async fn upload_usage(
        &self,
        ledger_id: &str,
        intervals: &[metering::ClosedInterval],
    ) -> Result<UploadOutcome, AgentError> {
        let mut total = UploadOutcome::default();
        let mut rest = intervals;
        while !rest.is_empty() {
            let chunk = &rest[..rest.len().min(MAX_UPLOAD_BATCH)];
            match self.upload_batch(ledger_id, chunk).await {
                Ok(out) => {
                    total.accepted += out.accepted;
                    total.duplicates += out.duplicates;
                    total.conflicts.extend(out.conflicts);
                    rest = &rest[chunk.len()..];
                }
                Err(AgentError::Refused { status: 409, .. }) => {
                    // Stored before (a lost answer, or an earlier run): skip what the
                    // coordinator's head covers, send the rest after it.
                    let head = self.usage_head(ledger_id).await?;
                    let covered = rest
                        .iter()
                        .take_while(|i| i.chain.as_ref().is_some_and(|l| l.seq <= head.seq))
                        .count();
                    let first = rest[0].chain.as_ref().map_or(0, |l| l.seq);
                    if covered == 0 {
                        return Err(AgentError::Protocol {
                            url: self.cfg.coordinator_urls.join(","),
                            why: format!(
                                "the coordinator holds ledger {ledger_id} up to chain seq {} but this upload starts at seq {first}: links before it are missing",
                                head.seq
                            ),
                        });
                    }
                    total.duplicates += covered as u64;
                    rest = &rest[covered..];
                }
                Err(e) => return Err(e),
            }
        }
        Ok(total)
    }

    /// The newest link of `ledger_id` the coordinator holds for this node (seq 0 and the
    /// genesis hash when it holds none).
    pub async fn usage_head(&self, ledger_id: &str) -> Result<ChainHead, AgentError> {
        crate::validate_name("ledger id", ledger_id).map_err(AgentError::Config)?;
        let path = format!("/v1/nodes/{}/usage/head?ledger_id={ledger_id}", self.cfg.node_id);
        let mut last = None;
        for ep in self.endpoints.iter() {
            let r = http::request(
                &self.pool,
                ep,
                Method::GET,
                &path,
                Some(&self.cfg.token),
                &[],
                None,
                Duration::from_secs(10),
            )
            .await;
            match r {
                Ok(r) if r.status == 200 => {
                    return serde_json::from_slice(&r.body).map_err(|e| AgentError::Protocol {
                        url: ep.url.clone(),
                        why: e.to_string(),
                    })
                }
                Ok(r) => last = Some(refused(ep, r.status, &r.body)),
                Err(e) => last = Some(AgentError::Http(e)),
            }
        }
        Err(last.unwrap_or_else(|| AgentError::Config("no coordinator url".into())))
    }

    async fn upload_batch(
        &self,
        ledger_id: &str,
        chunk: &[metering::ClosedInterval],
    ) -> Result<UploadOutcome, AgentError> {
        let signer = self.cfg.node_key.as_ref().ok_or_else(|| {
            AgentError::Config("no node key: usage uploads are signed with the node's key".into())
        })?;
        let segment = crate::proof::sign_segment(signer, &self.cfg.node_id, ledger_id, chunk)
            .map_err(|e| AgentError::Config(e.to_string()))?;
        let body =
            serde_json::to_vec(&UsageUpload { intervals: chunk.to_vec(), segment: Some(segment) })
                .map_err(|e| AgentError::Config(e.to_string()))?;
        let path = format!("/v1/nodes/{}/usage", self.cfg.node_id);
        let mut backoff = self.cfg.retry_min;
        let mut last = None;
        for round in 0..4 {
            if round > 0 {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(self.cfg.retry_max);
            }
            for ep in self.endpoints.iter() {
                let r = http::request(
                    &self.pool,
                    ep,
                    Method::POST,
                    &path,
                    Some(&self.cfg.token),
                    &[],
                    Some(body.clone()),
                    Duration::from_secs(30),
                )
                .await;
                match r {
                    Ok(r) if (200..300).contains(&r.status) => {
                        return serde_json::from_slice(&r.body).map_err(|e| AgentError::Protocol {
                            url: ep.url.clone(),
                            why: e.to_string(),
                        });
                    }
                    Ok(r) if r.status < 500 => return Err(refused(ep, r.status, &r.body)),
                    Ok(r) => {
                        warn!(coordinator = %ep.url, status = r.status, "usage upload failed; retrying");
                        last = Some(refused(ep, r.status, &r.body));
                    }
                    Err(e) => {
                        warn!(coordinator = %ep.url, "usage upload got no answer ({e}); retrying");
                        last = Some(AgentError::Http(e));
                    }
                }
            }
        }
        Err(last.unwrap_or_else(|| AgentError::Config("no coordinator url".into())))
    }
}

fn refused(ep: &Endpoint, status: u16, body: &[u8]) -> AgentError {
    let error = serde_json::from_slice::<ErrorBody>(body).unwrap_or_else(|_| ErrorBody {
        error: String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned(),
        path: None,
        who: None,
    });
    AgentError::Refused { url: ep.url.clone(), status, error }
}

fn mark_connected(status: &Arc<Mutex<AgentStatus>>, url: &str) {
    let mut s = lock(status);
    if !s.connected || s.coordinator.as_deref() != Some(url) {
        info!(coordinator = %url, "coordinator reachable");
    }
    s.connected = true;
    s.last_contact_ms = Some(now_ms());
    s.coordinator = Some(url.to_string());
    if s.last_error.as_deref().is_some_and(|e| e.starts_with("coordinator ")) {
        s.last_error = None;
    }
}

fn lock(status: &Arc<Mutex<AgentStatus>>) -> std::sync::MutexGuard<'_, AgentStatus> {
    // A panic while holding the status lock leaves plain data behind: keep using it.
    status.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

trait ElapsedExt {
    fn is_none_or_elapsed(&self, d: Duration) -> bool;
}

impl ElapsedExt for Option<Instant> {
    fn is_none_or_elapsed(&self, d: Duration) -> bool {
        self.is_none_or(|t| t.elapsed() >= d)
    }
}

/// Keep `verified`'s envelope as last-known-good: write a temporary file, fsync it,
/// rename it over the old one, fsync the directory. A crash leaves the old or the new
/// file, never a torn one.
pub fn write_last_known_good(path: &Path, verified: &Verified) -> Result<(), AgentError> {
    let err = |why: String| AgentError::LastKnownGood { path: path.to_path_buf(), why };
    let json = serde_json::to_vec_pretty(&verified.envelope).map_err(|e| err(e.to_string()))?;
    tessera_api::durable::replace(path, &json, 0o644, tessera_api::durable::Sync::Durable)
        .map_err(|e| err(format!("write: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ed25519_dalek::SigningKey;

    fn verified(version: u64) -> Verified {
        let k = SigningKey::from_bytes(&[3; 32]);
        let bytes = format!(r#"{{"version": {version}, "orgs": {{"acme": {{"trust": "dev"}}}}}}"#);
        let env = signing::sign(&k, bytes.as_bytes(), "alice", 9).unwrap();
        signing::verify(&env, &k.verifying_key()).unwrap()
    }

    fn agent(dir: &Path, key: VerifyingKey) -> PolicyAgent {
        let cfg = AgentConfig::new(
            vec!["http://127.0.0.1:1".into()],
            "node-a",
            "t",
            key,
            dir.join("lkg/policy.json"),
        );
        PolicyAgent::new(cfg).unwrap()
    }

    #[test]
    fn last_known_good_round_trips_and_refuses_tampering() {
        let dir = tempfile::tempdir().unwrap();
        let k = SigningKey::from_bytes(&[3; 32]);
        let a = agent(dir.path(), k.verifying_key());
        assert!(a.load_last_known_good().unwrap().is_none());
        write_last_known_good(&a.config().lkg_path, &verified(4)).unwrap();
        write_last_known_good(&a.config().lkg_path, &verified(5)).unwrap();
        assert_eq!(a.load_last_known_good().unwrap().unwrap().version, 5);
        let leftovers: Vec<_> = std::fs::read_dir(dir.path().join("lkg")).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temporary files left behind");

        // Another key's agent refuses the file.
        let other = agent(dir.path(), SigningKey::from_bytes(&[4; 32]).verifying_key());
        assert!(other.load_last_known_good().unwrap_err().to_string().contains("pinned"));

        // Edit the policy inside the file: refused.
        let path = &a.config().lkg_path;
        let mut env: signing::SignedPolicy =
            serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        use base64::Engine as _;
        env.policy_b64 = base64::engine::general_purpose::STANDARD
            .encode(br#"{"version": 5, "orgs": {"acme": {"trust": "untrusted"}}}"#);
        std::fs::write(path, serde_json::to_vec(&env).unwrap()).unwrap();
        let err = a.load_last_known_good().unwrap_err().to_string();
        assert!(err.contains("tampered"), "{err}");
        std::fs::write(path, b"not json").unwrap();
        assert!(a.load_last_known_good().is_err());
    }

    #[test]
    fn health_reflects_connection_rejections_and_apply_failures() {
        let mut s = AgentStatus::started_from(&verified(3), PolicySource::LastKnownGood);
        assert_eq!(s.health(), "degraded", "not connected yet");
        s.connected = true;
        assert_eq!(s.health(), "ok");
        let t = s.applied_at_ms.unwrap();
        let rejection = |kind: &str, at_ms| Rejection {
            version: 2,
            kind: kind.into(),
            reason: String::new(),
            coordinator: String::new(),
            at_ms,
        };
        s.last_rejection = Some(rejection("older", t + 1));
        assert_eq!(s.health(), "degraded", "an older offer is a replay: the node may fall behind");
        assert!(s.report().last_rejection.is_some());
        s.older_cleared_ms = Some(t + 2);
        assert_eq!(s.health(), "ok", "a later genuine answer: the replay stopped");
        s.last_rejection = Some(rejection("local-override", t + 3));
        assert_eq!(s.health(), "ok", "the operator's override is no problem");
        s.last_rejection = Some(rejection("forged", t + 1));
        assert_eq!(s.health(), "degraded");
        // Within the apply's own millisecond, the order decides: a refusal counted before
        // the apply is resolved by it, one counted after is open.
        let (at_apply, last) = (s.rejections_at_apply, s.last_rejection.clone());
        s.last_rejection = Some(rejection("forged", t));
        assert_eq!(s.health(), "ok", "refused before the apply, in the same millisecond");
        s.rejections = s.rejections_at_apply + 1;
        assert_eq!(s.health(), "degraded", "refused after the apply, in the same millisecond");
        (s.rejections, s.rejections_at_apply, s.last_rejection) = (at_apply, at_apply, last);
        assert!(s.report().last_rejection.is_some_and(|r| r.contains("version 2")));
        s.applied_at_ms = Some(t + 2);
        assert_eq!(s.health(), "ok", "a policy applied since the refusal");
        assert_eq!(s.report().last_rejection, None, "a resolved refusal is not reported");
        s.apply_error = Some("x".into());
        assert_eq!(s.health(), "degraded");
        let r = s.report();
        assert_eq!((r.source.as_str(), r.health.as_str()), ("last-known-good", "degraded"));
    }

    #[test]
    fn config_is_checked() {
        let k = SigningKey::from_bytes(&[3; 32]).verifying_key();
        assert!(PolicyAgent::new(AgentConfig::new(vec![], "n", "t", k, "/x")).is_err());
        assert!(
            PolicyAgent::new(AgentConfig::new(vec!["ftp://x".into()], "n", "t", k, "/x")).is_err()
        );
        assert!(PolicyAgent::new(AgentConfig::new(vec!["http://x:1".into()], "a/b", "t", k, "/x"))
            .is_err());
    }
}
