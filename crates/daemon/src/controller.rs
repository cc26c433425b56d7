//! The one controller (Firecracker's shape: a request becomes a typed [`Action`] that one
//! controller applies). Every caller — the API handlers ([`crate::server`], [`crate::follow`]'s
//! status route), the periodic tasks and the start and stop of the daemon ([`crate::run`]),
//! the exit watcher ([`crate::exits`]) and the fleet agent ([`crate::follow`]) — sends an
//! action; none of them touches the [`Node`] or its lock.
//!
//! The controller alone knows:
//! * **the lock**: the [`Node`] lives in its mutex; every step runs under it, one at a time,
//!   so each decide-and-record step is atomic;
//! * **blocking work**: [`Controller::run`] applies an action on a blocking thread
//!   (SQLite commits, /proc and runc-state reads, backend calls), never on the async workers;
//! * **what runs outside the lock**: the actions with a slow part take what they need under
//!   the lock, do the slow part without it, and record the result under it again —
//!   [`Action::Update`] under a policy with fleet quotas (a raise's admission by the
//!   books),
//!   [`Action::Scrub`] and [`Action::Unquarantine`] (the scrub child process),
//!   [`Action::MpsHealthCheck`] (control-binary pings and cap read-backs, on the
//!   supervisor's own lock), [`Action::CheckEcc`] and [`Action::SampleUtilization`] (NVML
//!   queries that can hang on a GPU in a bad state, and /proc walks), and
//!   [`Action::RevokeStop`] (the grace period between SIGTERM and SIGKILL), and
//!   [`Action::Allocate`] under a policy with fleet quotas (the admission by the
//!   coordinator, or the node's own books: [`crate::quota_gate`]; the stops of a reclaim run on
//!   threads of their own);
//! * **failure logging**: every action that fails is logged here, once: internal failures
//!   as errors, refusals (4xx) as warnings naming the action, container, tenant and rule.
//!   Refusals of grants are also recorded as `refuse` events by the node (durable state).
//!
//! What a caller does after an action stays with the caller (the API starts the exit watch
//! of a container whose [`Action::Start`] succeeded: [`crate::server`]). The controller
//! names no module that calls it: drivers (the API, the exit watcher, the fleet agent,
//! the signal handlers, the device plugin, CDI) sit above it, the node below
//! (`tests/modules.rs`).

use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use metering::UsageReport;
use serde::Serialize;
use tessera_api::{
    untrusted, AllocateRequest, Allocation, ContainerId, DeviceUuid, ErrorCode, NodeStatus,
    ReleaseRequest, StartRequest, UpdateAnswer, UpdateDone, UpdateRequest,
};
use tracing::{debug, error, warn};

use crate::error::{CoreError, Detail};
use crate::node::{ActivePolicy, Admission, MigReport, Node, Prepared, QuotaMode, ReconcileReport};
use crate::quota_gate::{self, QuotaGate, Verdict};

/// Everything that can be asked of a node, by anyone.
#[derive(Debug)]
pub enum Action {
    // The API (`server.rs`).
    /// `POST /v1/allocations`, with a pidfd of the process that asked where the API has
    /// one: watched until the grant is confirmed ([`crate::requesters`]).
    Allocate { req: AllocateRequest, requester: Option<std::os::fd::OwnedFd> },
    /// `POST /v1/allocations/{id}/start` (the prestart hook); then the exit watch starts.
    Start { container_id: ContainerId, req: StartRequest },
    /// `DELETE /v1/allocations/{id}`: the checked release.
    Release { container_id: ContainerId, req: ReleaseRequest },
    /// `POST /v1/allocations/{id}/update`: tessera-runtime asks before `runc update` of a
    /// container's CPU or memory limits; a raise is admitted by the fleet's quotas
    /// (without the lock), as a new grant is.
    Update { container_id: ContainerId, req: UpdateRequest },
    /// `POST /v1/allocations/{id}/update/done`: `runc update` ended; the kernel's limits
    /// are recorded (or the limits of before asked back).
    UpdateDone { container_id: ContainerId, req: UpdateDone },
    /// `GET /v1/allocations/{id}`.
    Allocation(ContainerId),
    /// `GET /v1/allocations`; also the running containers to watch after a start.
    Allocations,
    /// `GET /v1/status`.
    Status,
    /// `GET /v1/usage`.
    Usage { from_ms: u64, to_ms: u64, by: metering::GroupBy },
    /// `GET /metrics`: the status and the ledger, rendered.
    Metrics,
    /// `GET /v1/mig/plan`.
    MigPlan,
    /// `POST /v1/mig/converge`; also every reconcile tick.
    MigConverge,
    /// `POST /v1/devices/{uuid}/unquarantine`: re-scrub (outside the lock), free on success.
    Unquarantine(DeviceUuid),
    /// `GET /v1/revoke-check`: the grants the policy in force would refuse now.
    RevokeCheck,
    /// `POST /v1/policy/reload` (and `SIGHUP`): read the `--policy` file again
    /// ([`crate::policy_reload`]).
    ReloadPolicy,
    /// `POST /v1/revoke-check/stop`: stop them (signals and the grace period outside the
    /// lock); their grants are released as any grant is, once runc removed the container.
    RevokeStop(crate::node::revoke::StopRequest),

    // The periodic tasks (`lib.rs`).
    /// Release the grants of vanished containers (also once at start).
    Reconcile,
    /// Read ECC counts (outside the lock) and quarantine GPUs whose count rose.
    CheckEcc,
    /// Drain XID events (outside the lock), quarantine what each reached, tell and (by
    /// policy) stop the holders.
    CheckFaults,
    /// The ledger heartbeat (also once at a clean stop).
    Checkpoint,
    /// Per-process utilisation (read outside the lock) into the open intervals.
    SampleUtilization,
    /// Scrub every device that needs it, one after the other (each outside the lock).
    Scrub,
    /// Device and per-process telemetry (read outside the lock), mapped to containers; the
    /// interference detector's sample, and its throttles and stops (outside the lock).
    SampleTelemetry,
    /// `GET /v1/telemetry`: the last sample.
    Telemetry,
    /// Ping and check the caps of every MPS control daemon (outside the lock).
    MpsHealthCheck,

    // The start and stop of the daemon (`lib.rs`).
    /// Take over the MPS control daemons of the last run.
    ResumeMps,
    /// Open intervals for containers that ran on through a restart.
    ResumeMetering,
    /// Stop the MPS control daemons without containers.
    QuitIdleMps,

    // The watch of runc's roots (`runc_watch.rs`).
    /// A watched root changed: nothing but the look every action takes first
    /// ([`Controller::apply`]).
    RuncRecordsRemoved,

    // The exit watcher (`exits.rs`).
    /// The pid (and its start time) to watch for a running container.
    ExitWatchTarget(ContainerId),
    /// The container's init exited: close its intervals.
    ContainerExited { container_id: ContainerId, pid: i32 },

    // The fleet agent (`fleet.rs`).
    /// A verified policy revision: every decision from now on uses it.
    SetPolicy(Box<ActivePolicy>),
    /// The ledger's chain head and the closed intervals after chain seq `after` (at most
    /// `limit`), for the usage upload.
    LedgerChain { after: u64, limit: usize },
    /// `GET /v1/usage/verify`: recompute the ledger's hash chain.
    VerifyLedger,

    // The CDI spec (`cdi.rs`).
    /// The node's status and the policy in force, read in one step.
    CdiInputs,

    // The kubelet device plugin (`device_plugin.rs`).
    /// What the node can grant now, as the device plugin counts it.
    Capacity,
    /// `Allocate`'s assignments: record a token for each before kubelet gets them.
    IssueAssignments(Vec<tessera_api::deviceplugin::PluginAssignment>),

    // The fleet-quota sync (`quota.rs`).
    /// The node's capacity and quota-marked grants, for a sync.
    QuotaSnapshot,
    /// Stop the containers a coordinator's reclaim names (this node's borrowed grants
    /// only; signals and grace periods on threads of their own).
    QuotaPreempt(Vec<fleet::quota_wire::Victim>),
}

impl Action {
    /// A short name for logs.
    pub fn name(&self) -> &'static str {
        match self {
            Action::Allocate { .. } => "allocate",
            Action::Start { .. } => "start",
            Action::Release { .. } => "release",
            Action::Update { .. } => "update",
            Action::UpdateDone { .. } => "update done",
            Action::Allocation(_) => "allocation",
            Action::Allocations => "allocations",
            Action::Status => "status",
            Action::CdiInputs => "CDI inputs",
            Action::Usage { .. } => "usage",
            Action::Metrics => "metrics",
            Action::MigPlan => "mig plan",
            Action::MigConverge => "mig converge",
            Action::Unquarantine(_) => "unquarantine",
            Action::RevokeCheck => "revoke check",
            Action::RevokeStop(_) => "revoke stop",
            Action::ReloadPolicy => "policy reload",
            Action::Reconcile => "reconcile",
            Action::CheckEcc => "ECC check",
            Action::CheckFaults => "XID fault check",
            Action::Checkpoint => "ledger checkpoint",
            Action::SampleUtilization => "utilisation sampling",
            Action::Scrub => "scrub",
            Action::SampleTelemetry => "telemetry sampling",
            Action::Telemetry => "telemetry read",
            Action::MpsHealthCheck => "MPS health check",
            Action::ResumeMps => "resuming MPS supervision",
            Action::ResumeMetering => "resuming metering",
            Action::QuitIdleMps => "stopping idle MPS daemons",
            Action::ExitWatchTarget(_) => "exit watch",
            Action::ContainerExited { .. } => "closing the intervals of an exited container",
            Action::RuncRecordsRemoved => "releasing the grants of containers runc removed",
            Action::SetPolicy(_) => "policy update",
            Action::LedgerChain { .. } => "ledger read",
            Action::VerifyLedger => "ledger verification",
            Action::Capacity => "capacity read",
            Action::IssueAssignments(_) => "device-plugin token issue",
            Action::QuotaSnapshot => "quota snapshot",
            Action::QuotaPreempt(_) => "quota preemption",
        }
    }

    /// Whether the action may change what the node can grant (grants, MIG layout, device
    /// lifecycles, policy): the device plugin reads the capacity again after it.
    pub fn may_change_capacity(&self) -> bool {
        matches!(
            self,
            Action::Allocate { .. }
                | Action::Release { .. }
                | Action::MigConverge
                | Action::Unquarantine(_)
                | Action::Reconcile
                | Action::CheckEcc
                | Action::CheckFaults
                | Action::Scrub
                | Action::SetPolicy(_)
                | Action::ReloadPolicy
        )
    }

    /// Whether the grants of containers runc removed are released before this action
    /// ([`Controller::apply`]): every action that answers a caller or decides for one does.
    /// The background ticks need not: the task that wakes on runc's removals
    /// (`crate::spawn_removals`) releases them at once anyway.
    pub fn settles_first(&self) -> bool {
        !matches!(
            self,
            Action::Reconcile
                | Action::CheckEcc
                | Action::CheckFaults
                | Action::Checkpoint
                | Action::SampleUtilization
                | Action::Scrub
                | Action::SampleTelemetry
                | Action::MpsHealthCheck
                | Action::ResumeMps
                | Action::ResumeMetering
                | Action::QuitIdleMps
                | Action::ExitWatchTarget(_)
                | Action::ContainerExited { .. }
                | Action::QuotaSnapshot
                | Action::QuotaPreempt(_)
                | Action::LedgerChain { .. }
        )
    }

    /// The container the action is about, if one.
    pub fn container_id(&self) -> Option<&str> {
        match self {
            Action::Allocate { req, .. } => Some(&req.container_id),
            Action::Start { container_id, .. }
            | Action::Release { container_id, .. }
            | Action::Update { container_id, .. }
            | Action::UpdateDone { container_id, .. }
            | Action::ContainerExited { container_id, .. } => Some(container_id),
            Action::Allocation(id) | Action::ExitWatchTarget(id) => Some(id),
            _ => None,
        }
    }
}

/// What an action produced. The variants the API answers with serialise as that answer's
/// body (untagged); the others are for the daemon's own callers and never sent.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum Outcome {
    /// Boxed: an allocation is the largest answer by far.
    Allocation(Box<Allocation>),
    Allocations(Vec<Allocation>),
    Released {
        released: bool,
    },
    Update(UpdateAnswer),
    Status(Box<NodeStatus>),
    Usage(UsageReport),
    Mig(MigReport),
    Unquarantined(ScrubOutcome),
    RevokeCheck(crate::node::revoke::RevokeCheck),
    RevokeStopped(crate::node::revoke::StopReport),
    PolicyReloaded(crate::policy_reload::ReloadReport),
    #[serde(skip)]
    Reconciled(ReconcileReport),
    /// ECC: the GPUs quarantined now.
    #[serde(skip)]
    Quarantined(Vec<String>),
    /// How many (intervals checkpointed or sampled, devices scrubbed, events recorded,
    /// intervals closed or resumed).
    #[serde(skip)]
    Count(usize),
    #[serde(skip)]
    MpsResumed {
        adopted: usize,
        released: usize,
        restarted: usize,
    },
    /// The Prometheus text.
    #[serde(skip)]
    Metrics(String),
    Telemetry(Box<tessera_api::telemetry::NodeTelemetry>),
    #[serde(skip)]
    WatchTarget(Option<(i32, Option<u64>)>),
    #[serde(skip)]
    /// The ledger's chain head and closed intervals after a chain seq.
    Chain {
        head: metering::ChainHead,
        intervals: Vec<metering::ClosedInterval>,
    },
    ChainReport(Box<metering::ChainReport>),
    #[serde(skip)]
    Capacity(Box<device_plugin::Snapshot>),
    /// The node's status and the policy in force at one instant.
    #[serde(skip)]
    CdiInputs(Box<(NodeStatus, policy::Policy)>),
    /// `Allocate`'s assignments with their recorded tokens.
    #[serde(skip)]
    Issued(Vec<tessera_api::deviceplugin::IssuedAssignment>),
    /// What a fleet-quota sync sends (its leases are added by the gate), and the quotas in
    /// force; `None`: the policy sets no quotas.
    #[serde(skip)]
    QuotaSnapshot(Option<Box<(fleet::quota_wire::SyncRequest, ::quota::QuotaTree, Instant)>>),
    #[serde(skip)]
    Done,
}

/// The answer to an unquarantine: the device's new state and the scrub's report or error.
#[derive(Debug, Serialize)]
pub struct ScrubOutcome {
    pub device: String,
    pub state: scrub::DeviceState,
    pub report: Option<scrub::ScrubReport>,
    pub error: Option<String>,
}

/// The one owner of the node lock; see the module docs.
#[derive(Debug)]
pub struct Controller {
    node: Mutex<Node>,
    /// Held through a whole MPS health round (check, then record). The supervisor restores
    /// caps inside the check, before the node records why: a status read waits for the
    /// round, so it never shows caps restored without the `mps` event that says so. (A
    /// status read waited for the round anyway: it reads the supervisor, whose lock the
    /// check holds.) Lock order: this, then the node.
    mps_round: Mutex<()>,
    /// Counts the actions that may have changed the node's capacity ([`Controller::changes`]).
    changes: tokio::sync::watch::Sender<u64>,
    /// What a policy reload reads ([`Controller::set_reload`]); unset: nothing to reload.
    reload: std::sync::OnceLock<crate::policy_reload::ReloadSetup>,
    /// The fleet-quota gate ([`Controller::set_quota`]); unset: grants as without quotas.
    quota: std::sync::OnceLock<Arc<QuotaGate>>,
    /// This controller, for the threads a reclaim's stops run on.
    me: Weak<Controller>,
    /// One quota admission at a time per tenant (not a gang member's): its plan, the
    /// coordinator's answer and the grant, so that two of a tenant's requests never both
    /// plan the one device a reclaim freed for that tenant and one of them then fails
    /// after it was admitted ([`Controller::admission_turn`]). Lock order: a turn, then
    /// the node.
    admitting: Mutex<std::collections::BTreeMap<String, Arc<Mutex<()>>>>,
}

impl Controller {
    pub fn new(node: Node) -> Arc<Controller> {
        Arc::new_cyclic(|me| Controller {
            node: Mutex::new(node),
            mps_round: Mutex::new(()),
            changes: tokio::sync::watch::channel(0).0,
            reload: std::sync::OnceLock::new(),
            quota: std::sync::OnceLock::new(),
            me: me.clone(),
            admitting: Mutex::new(std::collections::BTreeMap::new()),
        })
    }

    /// Put grants through the fleet's quotas when the policy sets them (once, at start; a
    /// second call is ignored).
    pub fn set_quota(&self, gate: Arc<QuotaGate>) {
        let _ = self.quota.set(gate);
    }

    /// Say which policy file [`Action::ReloadPolicy`] reads (once, at start; a second call
    /// is ignored).
    pub fn set_reload(&self, setup: crate::policy_reload::ReloadSetup) {
        let _ = self.reload.set(setup);
    }

    /// [`Action::ReloadPolicy`], in two steps ([`crate::policy_reload`]): which file, and
    /// whether a reload may change anything, answered under the lock before the file is
    /// read (a fleet node says why a reload changes nothing even when the file is broken);
    /// the file read and validated outside the lock; then the check again and the swap, as
    /// one step (a fleet revision may have come meanwhile). A failure is logged by `apply`.
    fn reload_policy(&self) -> Result<crate::policy_reload::ReloadReport, CoreError> {
        use crate::policy_reload::{file_source, load, log_reloaded, reloadable};
        use crate::policy_reload::{PolicyVersion, ReloadReport};
        let setup = self.reload.get();
        let file =
            self.locked(|n| reloadable(setup, n.policy()).map(std::path::Path::to_path_buf))?;
        let policy = load(&file)?;
        self.locked(|n| {
            reloadable(setup, n.policy())?;
            let before = n.policy();
            let previous =
                PolicyVersion { version: before.policy.version(), digest: before.policy.digest() };
            let current = PolicyVersion { version: policy.version(), digest: policy.digest() };
            let changed = previous.digest != current.digest;
            n.set_policy(crate::node::ActivePolicy { policy, source: file_source(&file) });
            if let Some(fleet) = setup.and_then(|s| s.fleet.as_ref()) {
                fleet.note_local_reload(current.version, &current.digest);
            }
            let report =
                ReloadReport { file: file.display().to_string(), previous, current, changed };
            log_reloaded(&report);
            Ok(report)
        })
    }

    /// Changes whenever an action may have changed what the node can grant (a grant, a
    /// release, a MIG re-cut, a device scrubbed or quarantined, a new policy).
    pub fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Apply `action` on a blocking thread.
    pub async fn run(self: &Arc<Self>, action: Action) -> Result<Outcome, CoreError> {
        let ctl = Arc::clone(self);
        tokio::task::spawn_blocking(move || ctl.apply(action))
            .await
            .unwrap_or_else(|e| Err(CoreError::internal(format!("tesserad: handler failed: {e}"))))
    }

    /// Apply `action` on this thread (blocking: call it from a blocking thread, or where
    /// blocking is fine — the daemon's start and stop, the fleet agent's `block_in_place`).
    /// A failure is logged here.
    pub fn apply(&self, action: Action) -> Result<Outcome, CoreError> {
        // First the grants of containers runc removed since the last look: whatever this
        // action answers or decides counts them as given back (crate::runc_watch).
        if action.settles_first() {
            self.settle_removed();
        }
        let what = action.name();
        let container = action.container_id().map(str::to_owned);
        let may_change = action.may_change_capacity();
        let r = self.dispatch(action);
        if may_change {
            self.report_quota_releases();
        }
        // A round that did nothing (no device scrubbed, none quarantined) changes nothing.
        let idle = matches!(&r, Ok(Outcome::Count(0)))
            || matches!(&r, Ok(Outcome::Quarantined(q)) if q.is_empty())
            || matches!(&r, Ok(Outcome::Reconciled(rep)) if rep.released.is_empty());
        if may_change && r.is_ok() && !idle {
            self.changes.send_modify(|n| *n = n.wrapping_add(1));
        }
        if let Err(e) = &r {
            log_failure(what, container.as_deref(), e);
        }
        r
    }

    /// Release the grants whose runc record was removed ([`Node::settle_removed`]); what
    /// is released is told to the fleet's books and to whoever follows the node's changes.
    fn settle_removed(&self) {
        match self.locked(|n| n.settle_removed()) {
            Ok(released) if !released.is_empty() => {
                self.report_quota_releases();
                self.changes.send_modify(|n| *n = n.wrapping_add(1));
            }
            Ok(_) => {}
            Err(e) => log_failure("releasing the grants of containers runc removed", None, &e),
        }
    }

    /// One step under the node lock.
    pub(crate) fn locked<T>(
        &self,
        f: impl FnOnce(&mut Node) -> Result<T, CoreError>,
    ) -> Result<T, CoreError> {
        let mut node = self
            .node
            .lock()
            .map_err(|_| CoreError::internal("tesserad: node state lock poisoned"))?;
        f(&mut node)
    }

    fn mps_round(&self) -> std::sync::MutexGuard<'_, ()> {
        // Guards no data: a panic elsewhere leaves it usable.
        self.mps_round.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn dispatch(&self, action: Action) -> Result<Outcome, CoreError> {
        use Outcome as O;
        match action {
            Action::Allocate { req, requester } => {
                let a = self.allocate(&req)?;
                if let Some(fd) = requester {
                    self.locked(|n| n.watch_requester(&a, fd))?;
                }
                Ok(O::Allocation(Box::new(a)))
            }
            Action::Start { container_id, req } => {
                self.locked(|n| n.start(&container_id, &req)).map(|a| O::Allocation(Box::new(a)))
            }
            Action::Release { container_id, req } => self
                .locked(|n| n.release_removed(&container_id, &req))
                .map(|released| O::Released { released }),
            Action::Update { container_id, req } => self.update(&container_id, &req).map(O::Update),
            Action::UpdateDone { container_id, req } => {
                let (answer, to_books) = self.locked(|n| n.finish_update(&container_id, &req))?;
                self.tell_books(to_books);
                Ok(O::Update(answer))
            }
            Action::Allocation(id) => {
                self.locked(|n| n.allocation(&id)).map(|a| O::Allocation(Box::new(a)))
            }
            Action::Allocations => self.locked(|n| n.allocations()).map(O::Allocations),
            Action::Status => {
                let _round = self.mps_round();
                self.locked(|n| n.status()).map(|s| O::Status(Box::new(s)))
            }
            Action::CdiInputs => {
                let _round = self.mps_round();
                self.locked(|n| {
                    Ok(O::CdiInputs(Box::new((n.status()?, n.policy().policy.clone()))))
                })
            }
            Action::Usage { from_ms, to_ms, by } => {
                self.locked(|n| n.usage(from_ms, to_ms, by)).map(O::Usage)
            }
            Action::Metrics => {
                let _round = self.mps_round();
                self.locked(|n| {
                    Ok(crate::metrics::render(&n.status()?, &n.intervals()?)
                        + &crate::metrics::render_telemetry(&n.telemetry_metrics()))
                })
                .map(O::Metrics)
            }
            Action::MigPlan => self.locked(|n| n.mig_plan()).map(O::Mig),
            Action::MigConverge => self.locked(|n| n.mig_converge()).map(O::Mig),
            Action::Unquarantine(uuid) => self.unquarantine(&uuid).map(O::Unquarantined),
            Action::RevokeCheck => self.locked(|n| n.revoke_check()).map(O::RevokeCheck),
            Action::RevokeStop(req) => self.revoke_stop(&req).map(O::RevokeStopped),
            Action::ReloadPolicy => self.reload_policy().map(O::PolicyReloaded),
            Action::RuncRecordsRemoved => Ok(O::Count(0)),
            Action::Reconcile => {
                let (report, to_books) = self.locked(|n| Ok((n.reconcile()?, n.check_limits())))?;
                for r in to_books {
                    self.tell_books(Some(r));
                }
                Ok(O::Reconciled(report))
            }
            Action::CheckEcc => {
                let probe = self.locked(|n| Ok(n.ecc_probe()))?;
                let readings = probe.read(); // outside the lock: NVML may hang
                self.locked(|n| n.record_ecc(readings)).map(O::Quarantined)
            }
            Action::CheckFaults => {
                let probe = self.locked(|n| Ok(n.fault_probe()))?;
                let readings = probe.read(); // outside the lock: NVML's event set
                let report = self.locked(|n| n.record_faults(readings))?;
                let quarantined = report.quarantined.clone();
                self.stop_in_background(
                    crate::node::revoke::StopCause::Fault,
                    report.stop,
                    report.grace,
                );
                Ok(O::Quarantined(quarantined))
            }
            Action::Checkpoint => self.locked(|n| n.checkpoint()).map(O::Count),
            Action::SampleUtilization => {
                let probe = self.locked(|n| n.utilization_probe())?;
                let samples = probe.read(); // outside the lock: NVML and /proc
                self.locked(|n| n.record_utilization(samples)).map(O::Count)
            }
            Action::Scrub => self.scrub_pending().map(O::Count),
            Action::SampleTelemetry => self.sample_telemetry().map(O::Count),
            Action::Telemetry => self.locked(|n| Ok(O::Telemetry(Box::new(n.telemetry())))),
            Action::MpsHealthCheck => {
                // The supervisor has its own lock; the node takes it only while holding the
                // node lock, never the other way round.
                let _round = self.mps_round();
                let supervisor = self.locked(|n| Ok(n.mps_supervisor()))?;
                let events = supervisor.health_check_all(); // outside the node lock
                self.locked(|n| Ok(n.record_mps_events(&events))).map(O::Count)
            }
            Action::ResumeMps => {
                self.locked(|n| n.resume_mps()).map(|(adopted, released, restarted)| {
                    O::MpsResumed { adopted, released, restarted }
                })
            }
            Action::ResumeMetering => self.locked(|n| n.resume_metering()).map(O::Count),
            Action::QuitIdleMps => self.locked(|n| {
                n.quit_idle_mps();
                Ok(O::Done)
            }),
            Action::ExitWatchTarget(id) => {
                self.locked(|n| Ok(n.exit_watch_target(&id))).map(O::WatchTarget)
            }
            Action::ContainerExited { container_id, pid } => {
                self.locked(|n| n.container_exited(&container_id, pid)).map(O::Count)
            }
            Action::SetPolicy(policy) => self.locked(|n| {
                n.set_policy(*policy);
                Ok(O::Done)
            }),
            Action::Capacity => self.locked(|n| n.capacity()).map(|c| O::Capacity(Box::new(c))),
            Action::IssueAssignments(made) => {
                self.locked(|n| n.issue_assignments(&made)).map(O::Issued)
            }
            Action::QuotaSnapshot => {
                self.quota_snapshot().map(|r| O::QuotaSnapshot(r.map(Box::new)))
            }
            Action::QuotaPreempt(victims) => self.preempt(&victims, None).map(O::Count),
            Action::LedgerChain { after, limit } => self.locked(|n| {
                let (head, intervals) = n.chained_after(after, limit)?;
                Ok(O::Chain { head, intervals })
            }),
            Action::VerifyLedger => {
                self.locked(|n| n.verify_chain()).map(|r| O::ChainReport(Box::new(r)))
            }
        }
    }

    /// Scrub every device that needs it: each job is taken under the lock, run as a child
    /// process without it, and its outcome recorded under it. Returns how many ran.
    fn scrub_pending(&self) -> Result<usize, CoreError> {
        let mut ran = 0;
        while let Some(job) = self.locked(|n| n.next_scrub())? {
            let result = job.run();
            ran += 1;
            if let Err(e) = self.locked(|n| n.finish_scrub(&job.device, result)) {
                // The next device is still scrubbed.
                log_failure("recording a scrub", Some(&job.device), &e);
            }
        }
        Ok(ran)
    }

    /// One telemetry tick: the probe under the lock, the reads without it, the record (and
    /// the interference detector) under it; then the throttles on the MPS supervisor's own
    /// lock and the stops on threads of their own, each recorded as an event. Returns how
    /// many steps were carried out.
    fn sample_telemetry(&self) -> Result<usize, CoreError> {
        use interference::Step;
        let probe = self.locked(|n| n.telemetry_probe())?;
        let readings = probe.read(); // outside the lock: NVML and /proc
        let steps = self.locked(|n| n.record_telemetry(readings))?;
        if steps.is_empty() {
            return Ok(0);
        }
        let supervisor = self.locked(|n| Ok(n.mps_supervisor()))?;
        let done: Vec<(Step, Result<u8, mpsd::MpsError>)> = steps
            .into_iter()
            .map(|step| {
                let result = match &step {
                    Step::Throttle { incident, to_percent, .. } => supervisor.throttle(
                        &incident.device,
                        &incident.aggressor_tenant,
                        *to_percent,
                    ),
                    _ => Ok(0),
                };
                (step, result)
            })
            .collect();
        let n = done.len();
        let (stop, grace) = self.locked(|n| {
            let grace = Duration::from_secs(n.policy().policy.interference().stop_grace_s);
            Ok((n.record_interference_steps(done)?, grace))
        })?;
        self.stop_in_background(crate::node::revoke::StopCause::Interference, stop, grace);
        Ok(n)
    }

    /// Stop `targets` (SIGTERM, `grace`, SIGKILL) on a thread of their own, recording what
    /// happened as `cause`'s events under the lock when done. Nothing is released here: the
    /// grants go when runc has removed the containers, as every grant does.
    fn stop_in_background(
        &self,
        cause: crate::node::revoke::StopCause,
        targets: Vec<crate::node::revoke::Target>,
        grace: Duration,
    ) {
        if targets.is_empty() {
            return;
        }
        let Some(me) = self.me.upgrade() else { return };
        let Ok(host) = self.locked(|n| Ok(n.host())) else { return };
        let ids: Vec<String> = targets.iter().map(|t| t.refused.container_id.clone()).collect();
        let spawned = std::thread::Builder::new().name("tessera-stop".into()).spawn(move || {
            let stopped = crate::node::revoke::stop(host.as_ref(), targets, grace);
            if let Err(e) = me.locked(|n| {
                n.record_stops(cause, &stopped);
                Ok(())
            }) {
                log_failure("recording a stop", None, &e);
            }
        });
        if let Err(e) = spawned {
            error!("cannot start a thread to stop {ids:?} ({}): {e}", cause.event());
        }
    }

    /// Stop the grants the policy refuses: which ones (recorded as events) under the lock,
    /// the signals and the grace period without it, what happened recorded under it again.
    fn revoke_stop(
        &self,
        req: &crate::node::revoke::StopRequest,
    ) -> Result<crate::node::revoke::StopReport, CoreError> {
        use crate::node::revoke;
        let grace = revoke::grace(req)?;
        let plan = self.locked(|n| n.revoke_targets(req))?;
        let policy_version = plan.policy_version;
        let stopped = revoke::stop(plan.host.as_ref(), plan.targets, grace);
        self.locked(|n| {
            n.record_stops(revoke::StopCause::Revoked, &stopped);
            Ok(())
        })?;
        Ok(revoke::StopReport { policy_version, grace_s: grace.as_secs(), stopped })
    }

    /// A grant, through the fleet's quotas where the policy sets them: the checks and the
    /// plan under the lock, the coordinator's admission without it (a gang member's call
    /// may wait for its gang), the plan again and the grant under it (docs/QUOTAS.md).
    fn allocate(&self, req: &AllocateRequest) -> Result<Allocation, CoreError> {
        let Some(gate) = self.quota.get() else {
            return self.locked(|n| n.allocate(req));
        };
        // A gang member's ask may wait for its gang (its members come in parallel): no turn.
        let turn = match quota_gate::gang_of(&req.annotations) {
            Ok(None) => {
                self.locked(|n| Ok(n.policy().policy.resolve_identity(&req.annotations).ok()))?
            }
            _ => None,
        }
        .map(|tenant| self.admission_turn(&tenant.path));
        let _turn =
            turn.as_ref().map(|t| t.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
        let ask = match self.locked(|n| n.prepare_allocate(req, QuotaMode::On))? {
            Prepared::Granted(a) => return Ok(*a),
            Prepared::Ask(ask) => ask,
        };
        if !gate.has_coordinator() {
            // The node's own books see its holdings as they are before each decision (a
            // reclaim picks its victims among them).
            if let Some((snap, tree, _)) = self.quota_snapshot()? {
                let victims = gate.sync_local(&snap, &tree);
                if !victims.is_empty() {
                    self.preempt(&victims, None)?;
                }
            }
        }
        let cid = req.container_id.as_str();
        let refuse = |err: CoreError| -> Result<Allocation, CoreError> {
            self.locked(|n| {
                n.record_quota_refusal(cid, &err);
                Ok(())
            })?;
            Err(err)
        };
        // The ask counts as in flight (a grant under this node's lease counts it as held)
        // until this call returns: after its grant is made, or not.
        let (verdict, _in_flight) = gate.ask(&ask.admit, &ask.tree, ask.gang_timeout_s);
        match verdict {
            Verdict::Admitted { class, over } => {
                let admitted = Admission::Fleet { class, over };
                let r = self.locked(|n| n.finish_allocate(req, &ask.admit, &admitted));
                // Counted, never granted: the books give it back — unless this node holds
                // a grant of that id after all (a create of the same id that raced this
                // one and won: its grant is the one the books count).
                if r.is_err() && self.locked(|n| Ok(n.allocation(cid).is_err())).unwrap_or(false) {
                    gate.release(cid);
                }
                r
            }
            Verdict::Unreachable { since_ms, why } => match ask.no_capacity {
                // Nothing here to grant, and no coordinator to reclaim for it.
                Some(e) => refuse(e),
                None => {
                    let lease = Admission::Lease { leases: gate, since_ms, why };
                    self.locked(|n| n.finish_allocate(req, &ask.admit, &lease))
                }
            },
            Verdict::Refused { message, rule } => {
                let mut err = quota_gate::refused_error(&ask.admit.tenant, &ask.request, &message, rule);
                if let (Some(here), Some(d)) = (&ask.no_capacity, err.detail_mut()) {
                    // Why this node could not place it, too.
                    d.message = format!("{}; on this node: {here}", d.message);
                }
                refuse(err)
            }
            Verdict::Failed { message } => refuse(CoreError::Internal(Detail {
                message: format!(
                    "tenant {}: the quota coordinator could not admit the grant: {}; nothing granted",
                    ask.admit.tenant,
                    untrusted(&message).max_chars(512)
                ),
                tenant: Some(ask.admit.tenant.clone()),
                request: Some(ask.request.to_string()),
                rule: Some("quotas".into()),
            })),
            Verdict::Reclaiming { retry_after_s, victims, message } => {
                let wait = Duration::from_secs(retry_after_s.min(quota_gate::MAX_RETRY_AFTER_S));
                let until = Instant::now() + wait + quota_gate::HOLD_MARGIN;
                if let Err(e) = self.preempt(&victims, Some((&ask.admit.tenant, until))) {
                    log_failure("quota preemption", Some(cid), &e);
                }
                refuse(CoreError::Reclaiming(Detail {
                    message: untrusted(&message).max_chars(1024).to_string(),
                    tenant: Some(ask.admit.tenant.clone()),
                    request: Some(ask.request.to_string()),
                    rule: Some("quotas".into()),
                }))
            }
        }
    }

    /// The lock that gives `tenant`'s quota admissions their turn on this node (kept while
    /// anyone holds it; others are dropped as a new one is made).
    fn admission_turn(&self, tenant: &str) -> Arc<Mutex<()>> {
        let mut turns = self.admitting.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        turns.retain(|_, t| Arc::strong_count(t) > 1);
        turns.entry(tenant.to_string()).or_default().clone()
    }

    /// An update of a container's limits (`runc update`): planned under the lock, a raise
    /// admitted by the books without it (as a new grant is: the node's own books synced
    /// first, or the coordinator, or this node's lease while it is unreachable), begun
    /// under it again. A raise the books admitted that cannot begin is given back.
    fn update(
        &self,
        container_id: &ContainerId,
        req: &UpdateRequest,
    ) -> Result<UpdateAnswer, CoreError> {
        use crate::node::{UpdateAdmission, UpdatePlan};
        let step = match self.locked(|n| n.plan_update(container_id, req))? {
            UpdatePlan::NoGrant => return Ok(UpdateAnswer::default()),
            UpdatePlan::Step(s) => s,
        };
        let gate = self.quota.get();
        let (Some(resize), Some(gate)) = (&step.resize, gate) else {
            return self.locked(|n| n.begin_update(&step, &UpdateAdmission::None));
        };
        if !gate.has_coordinator() {
            if let Some((snap, tree, _)) = self.quota_snapshot()? {
                let victims = gate.sync_local(&snap, &tree);
                if !victims.is_empty() {
                    self.preempt(&victims, None)?;
                }
            }
        }
        let refuse = |err: CoreError| -> Result<UpdateAnswer, CoreError> {
            self.locked(|n| {
                n.record_quota_refusal(container_id, &err);
                Ok(())
            })?;
            Err(err)
        };
        let grant_request = self.locked(|n| Ok(n.allocation(container_id)?.request))?;
        let (verdict, _in_flight) = gate.resize(resize, &step.tree);
        let admission = match verdict {
            Verdict::Admitted { class, over } => UpdateAdmission::Fleet { class, over },
            Verdict::Unreachable { since_ms, why } => {
                UpdateAdmission::Lease { leases: gate, since_ms, why }
            }
            Verdict::Refused { message, rule } => {
                let mut err = quota_gate::refused_error(&step.tenant, &grant_request, &message, rule);
                if let Some(d) = err.detail_mut() {
                    d.message = format!("update of its limits refused: {}", d.message);
                }
                return refuse(err);
            }
            Verdict::Failed { message } | Verdict::Reclaiming { message, .. } => {
                return refuse(CoreError::Internal(Detail {
                    message: format!(
                        "the quota coordinator could not admit the update of its limits: {}; nothing \
                         changed",
                        untrusted(&message).max_chars(512)
                    ),
                    tenant: Some(step.tenant.clone()),
                    request: Some(grant_request.to_string()),
                    rule: Some("quotas".into()),
                }))
            }
        };
        let r = self.locked(|n| n.begin_update(&step, &admission));
        if r.is_err() {
            if let (UpdateAdmission::Fleet { .. }, Some(mark)) = (&admission, &step.mark) {
                // Counted, never begun: the books count the grant as before.
                gate.resized(
                    fleet::quota_wire::ResizeRequest {
                        amounts: quota_gate::mark_amounts(mark),
                        ..resize.clone()
                    },
                    &step.tree,
                );
            }
        }
        r
    }

    /// Tell the books what a grant counts after an update (best effort; the sync carries
    /// it too).
    fn tell_books(&self, resize: Option<fleet::quota_wire::ResizeRequest>) {
        let (Some(resize), Some(gate)) = (resize, self.quota.get()) else { return };
        if let Ok(tree) = self.locked(|n| Ok(n.policy().policy.quotas().clone())) {
            gate.resized(resize, &tree);
        }
    }

    /// Stop the `victims` of a reclaim that are this node's borrowed grants: which ones
    /// (recorded as `preempt` events, and their devices held for `hold_for`'s tenant until
    /// its time) under the lock; the signals and grace periods on threads of their own
    /// (grouped by grace period), each recording what it did under the lock when done.
    /// Returns how many stops started.
    fn preempt(
        &self,
        victims: &[fleet::quota_wire::Victim],
        hold_for: Option<(&str, Instant)>,
    ) -> Result<usize, CoreError> {
        let Some(gate) = self.quota.get() else { return Ok(0) };
        let node = gate.node();
        // Under the node lock: no two preemptions pick the same container.
        let plan = self.locked(|n| {
            let plan = n.preempt_targets(node, victims, &gate.stopping(), hold_for)?;
            gate.start_stopping(&plan.containers());
            Ok(plan)
        })?;
        let Some(me) = self.me.upgrade() else { return Ok(0) };
        let mut started = 0;
        for (grace, targets) in plan.groups {
            let ids: Vec<String> = targets.iter().map(|t| t.refused.container_id.clone()).collect();
            let (ctl, host, stops) = (me.clone(), plan.host.clone(), gate.clone());
            let cgroups = plan.cgroups.clone();
            let n = targets.len();
            let spawned = std::thread::Builder::new().name("tessera-preempt".into()).spawn({
                let ids = ids.clone();
                move || {
                    let stopped = crate::node::revoke::stop(host.as_ref(), targets, grace);
                    // What no longer runs is given back at once: the claimant is waiting.
                    let empty = crate::node::emptied(
                        host.as_ref(),
                        &stopped,
                        &cgroups,
                        crate::node::EMPTY_WAIT,
                        Duration::from_millis(100),
                    );
                    let released = ctl.locked(|n| {
                        n.record_stops(crate::node::revoke::StopCause::Preempted, &stopped);
                        let released = n.release_preempted(&empty);
                        Ok((released, n.take_quota_released()))
                    });
                    match released {
                        Ok((released, to_books)) => {
                            for id in to_books {
                                stops.release(&id);
                            }
                            if !released.is_empty() {
                                ctl.changes.send_modify(|n| *n = n.wrapping_add(1));
                            }
                        }
                        Err(e) => log_failure("recording a preemption", None, &e),
                    }
                    stops.done_stopping(&ids);
                }
            });
            match spawned {
                Ok(_) => started += n,
                Err(e) => {
                    gate.done_stopping(&ids);
                    error!("cannot start a thread to stop {ids:?} for a quota reclaim: {e}");
                }
            }
        }
        Ok(started)
    }

    /// The node's capacity and quota-marked grants, the quotas in force and when it was
    /// taken (`None`: the policy sets no quotas).
    fn quota_snapshot(
        &self,
    ) -> Result<Option<(fleet::quota_wire::SyncRequest, ::quota::QuotaTree, Instant)>, CoreError>
    {
        self.locked(|n| {
            let taken = Instant::now();
            Ok(n.quota_snapshot()?.map(|r| (r, n.policy().policy.quotas().clone(), taken)))
        })
    }

    /// Tell the books about quota-marked grants released since the last call.
    fn report_quota_releases(&self) {
        let Some(gate) = self.quota.get() else { return };
        if let Ok(released) = self.locked(|n| Ok(n.take_quota_released())) {
            for id in released {
                gate.release(&id);
            }
        }
    }

    /// Re-scrub a quarantined device (the child process outside the lock); it returns to
    /// service only if the scrub succeeds.
    fn unquarantine(&self, uuid: &DeviceUuid) -> Result<ScrubOutcome, CoreError> {
        let job = self.locked(|n| n.unquarantine(uuid))?;
        let result = job.run();
        let report = result.as_ref().ok().cloned();
        let error = result.as_ref().err().map(|e| e.to_string());
        let state = self.locked(|n| n.finish_scrub(&job.device, result))?;
        Ok(ScrubOutcome { device: job.device, state, report, error })
    }
}

/// The one place failed actions are logged.
fn log_failure(what: &str, container: Option<&str>, e: &CoreError) {
    let container = container.unwrap_or("-");
    match e.code() {
        ErrorCode::Internal => error!(container, "{what} failed: {}", e.message()),
        // Reads of unknown ids are routine.
        ErrorCode::NotFound if what == "allocation" => debug!(container, "{what}: {}", e.message()),
        code => {
            warn!(container, ?code, tenant = ?e.tenant(), rule = ?e.rule(), "{what} refused: {}", e.message())
        }
    }
}
