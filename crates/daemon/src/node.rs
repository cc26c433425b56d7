//! One node's allocation service: parse → decide (pure `policy` and `slicer` functions)
//! → record durably → answer. Every method runs under the daemon's single lock, so the
//! decide-and-record step is atomic.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use metering::{Ledger, LedgerError};
use policy::Policy;
use slicer::{GpuBackend, Inventory};
use tessera_api::{untrusted, GrantedDevice, PolicyInfo};
use tracing::warn;

use std::sync::Arc;

use crate::error::CoreError;
use crate::host::Host;
use crate::store::{Store, StoreError};

// The node's verbs, one file each; `Node` (here) is the one owner of their state.
mod allocate;
mod assignment;
mod capacity;
mod ecc;
mod faults;
mod grant;
pub mod interference;
mod ledger;
mod mig;
mod mps;
mod pod;
mod quota;
mod reconcile;
mod release;
pub mod revoke;
mod scrubbing;
mod start;
mod status;
mod telemetry;
mod tokens;
mod update;

pub use allocate::QuotaMode;
pub(crate) use allocate::{Admission, Prepared};
pub use assignment::ASSIGNMENTS_FILE;
pub use capacity::{offer, snapshot, Inputs as CapacityInputs};
pub use ecc::{EccProbe, EccReadings};
pub use faults::{FaultProbe, FaultReadings, FaultReport};
pub use grant::{FailAction, GrantFailpoint, InvalidFailpoint};
pub use ledger::{UtilProbe, UtilSamples};
pub use mig::MigReport;
pub use quota::{emptied, DeviceHold, PreemptPlan, EMPTY_WAIT};
pub use reconcile::ReconcileReport;
pub use scrubbing::{ScrubJob, ScrubSetup};
pub use telemetry::{read_report, TelemetryProbe, TelemetryReadings, REPORT_ENV, REPORT_PATH};

/// The ledger's close reason for intervals closed at the container init's exit (the exit
/// watcher, [`crate::exits`], reports it).
pub const EXITED_REASON: &str = "exited";
pub use tokens::{TokenBook, TOKENS_FILE};
pub(crate) use update::{UpdateAdmission, UpdatePlan};
pub use update::{UpdateInFlight, UPDATE_WAIT};

/// The policy in force and where it came from.
#[derive(Debug, Clone)]
pub struct ActivePolicy {
    pub policy: Policy,
    pub source: String,
}

impl ActivePolicy {
    pub fn info(&self) -> PolicyInfo {
        PolicyInfo {
            version: self.policy.version(),
            source: self.source.clone(),
            digest: self.policy.digest(),
            coordinator: None,
        }
    }
}

/// The allocation service of one node.
#[derive(Debug)]
pub struct Node {
    /// Shared so that slow reads (ECC counts, utilisation) run outside the node lock.
    backend: Arc<dyn GpuBackend>,
    inventory: Inventory,
    policy: ActivePolicy,
    store: Store,
    ledger: Ledger,
    mps: Arc<mpsd::Supervisor>,
    host: Arc<dyn Host>,
    pending_grace: Duration,
    /// Create and destroy MIG instances on demand (when the node's pool declares no layout).
    dynamic_mig: bool,
    /// MIG profiles granted since start: the demand mix placement preserves capacity for.
    mig_demand: BTreeMap<String, u64>,
    scrub: ScrubSetup,
    /// Devices whose scrub is running now (by the worker or an unquarantine).
    scrubs_in_flight: std::collections::BTreeSet<String>,
    /// GPU -> the newest utilisation sample timestamp seen (µs), for NVML's "since".
    util_seen: BTreeMap<String, u64>,
    /// Tests only: a fault between a grant's plan and its commit.
    failpoint: Option<GrantFailpoint>,
    /// Devices kept for a fleet-quota reclaim's claimant ([`DeviceHold`]).
    quota_holds: BTreeMap<String, DeviceHold>,
    /// Containers whose quota-marked grants were released, not yet reported to the
    /// coordinator.
    quota_released: Vec<String>,
    /// Where the cgroups of the running grants are listed for tessera-runtime
    /// ([`tessera_api::cgroup::grant_cgroups_path`]; none in tests without a socket).
    grant_cgroups_file: Option<std::path::PathBuf>,
    /// tesserad's socket, beside which the cgroups it starts MPS daemons in are listed
    /// (`tessera_api::cgroup::record_daemon_cgroups`); `None`: not listed.
    daemon_socket: Option<std::path::PathBuf>,
    /// tesserad's own paths (its socket, its state directory) no container may see
    /// ([`Node::keep_private`]); empty: not checked (tests without a socket).
    private_paths: Vec<std::path::PathBuf>,
    /// Reconciler passes completed ([`tessera_api::NodeStatus::reconcile_passes`]).
    reconcile_passes: u64,
    /// runc's roots watched for removed records ([`crate::runc_watch`]); `None` where the
    /// host's records cannot be watched (then the reconciler's pass releases).
    runc_watch: Option<crate::runc_watch::RuncWatch>,
    /// The processes that asked for the grants not yet confirmed ([`crate::requesters`]);
    /// `None` where they cannot be watched (then the pending grace ends such grants).
    requesters: Option<crate::requesters::Requesters>,
    /// Updates of containers' limits admitted and not yet done (`runc update`).
    updates: BTreeMap<tessera_api::ContainerId, UpdateInFlight>,
    /// The node's own key (it signs the usage uploads), as status shows it.
    node_key: Option<tessera_api::NodeKeyInfo>,
    /// Whether the node follows a fleet coordinator: then its reports bill no floors (the
    /// guarantees are the fleet's, billed once in the coordinator's report).
    in_fleet: bool,
    /// The GPUs' NVLink domains and NUMA nodes (read once at start).
    topology: slicer::Topology,
    /// The last telemetry sample (`node/telemetry.rs`).
    telemetry: tessera_api::telemetry::NodeTelemetry,
    /// Interference detection, its open incidents and marks (`node/interference.rs`).
    interference: interference::InterferenceState,
    /// The last device-plugin assignments whose token a create presented (for the
    /// plugin: their reservations hold nothing any more).
    presented: std::collections::VecDeque<tessera_api::deviceplugin::PluginAssignment>,
    /// The devices' lifecycle states as last read from the store, typed, with the store's
    /// [`Store::device_gen`] they were read at: a plan reads them again only after a
    /// device state was written ([`Node::lifecycle`]).
    lifecycles: std::sync::Mutex<Option<(u64, Lifecycles)>>,
    /// Containers whose last quota refusal recorded was "reclaiming", and when: a create
    /// held open while its reclaim runs asks again every 0.5 to 2 s, and only its first
    /// answer in [`RECLAIM_EVENT_EVERY`] is written to the store.
    reclaim_refusals: BTreeMap<String, std::time::Instant>,
}

/// How often a container's repeated "reclaiming" refusals are recorded.
pub const RECLAIM_EVENT_EVERY: Duration = Duration::from_secs(60);

/// How many presented assignments [`Node`] remembers for the device plugin.
const MAX_PRESENTED: usize = 256;

/// Everything a [`Node`] is made of.
#[derive(Debug)]
pub struct NodeParts {
    pub backend: Box<dyn GpuBackend>,
    pub policy: ActivePolicy,
    pub store: Store,
    pub ledger: Ledger,
    pub mps: Arc<mpsd::Supervisor>,
    /// What the daemon reads of the machine ([`LinuxHost`] in production).
    pub host: Arc<dyn Host>,
    pub pending_grace: Duration,
    pub dynamic_mig: bool,
    pub scrub: ScrubSetup,
}

impl Node {
    pub fn new(p: NodeParts) -> Result<Node, CoreError> {
        let inventory = p.backend.inventory().map_err(|e| {
            CoreError::internal(format!(
                "reading the GPU inventory from {}: {e}",
                p.backend.describe()
            ))
        })?;
        let topology = p.backend.topology().unwrap_or_else(|e| {
            warn!(
                "reading the GPU topology from {}: {e}; placing without it",
                p.backend.describe()
            );
            slicer::Topology::default()
        });
        let interference = interference::InterferenceState::load(
            &p.store.path().with_file_name(interference::MARKS_FILE),
        );
        let telemetry = tessera_api::telemetry::NodeTelemetry {
            node: inventory.node.clone(),
            at_ms: 0,
            samples: 0,
            devices: Vec::new(),
            containers: Vec::new(),
            incidents: Vec::new(),
        };
        let node = Node {
            topology,
            telemetry,
            interference,
            backend: Arc::from(p.backend),
            inventory,
            policy: p.policy,
            store: p.store,
            ledger: p.ledger,
            mps: p.mps,
            host: p.host,
            pending_grace: p.pending_grace,
            dynamic_mig: p.dynamic_mig,
            mig_demand: BTreeMap::new(),
            scrub: p.scrub,
            scrubs_in_flight: std::collections::BTreeSet::new(),
            util_seen: BTreeMap::new(),
            failpoint: GrantFailpoint::from_env(),
            quota_holds: BTreeMap::new(),
            quota_released: Vec::new(),
            grant_cgroups_file: None,
            daemon_socket: None,
            private_paths: Vec::new(),
            reconcile_passes: 0,
            runc_watch: None,
            requesters: None,
            updates: BTreeMap::new(),
            node_key: None,
            in_fleet: false,
            presented: std::collections::VecDeque::new(),
            lifecycles: std::sync::Mutex::new(None),
            reclaim_refusals: BTreeMap::new(),
        };
        node.sweep_reports();
        Ok(node)
    }

    /// At startup: the latency report files (and their tmpfs mounts) of containers no
    /// longer recorded go ([`crate::report_fs::sweep`]); a recorded one's stays, in use.
    fn sweep_reports(&self) {
        let dir = self.report_file("x");
        let Some(dir) = dir.parent() else { return };
        let keep: std::collections::BTreeSet<tessera_api::ContainerId> = match self.store.all() {
            Ok(all) => all
                .into_iter()
                .filter(|r| r.allocation.class == Some(tessera_api::WorkloadClass::Latency))
                .map(|r| r.allocation.container_id)
                .collect(),
            Err(e) => {
                warn!("cannot list the grants to sweep the latency reports: {e}");
                return;
            }
        };
        for e in crate::report_fs::sweep(dir, |id| keep.contains(id)) {
            warn!("cannot remove a stale latency report: {e}");
        }
    }

    /// The node's key (shown in status) and whether it follows a fleet coordinator (its
    /// reports then bill no floors).
    pub fn set_identity(&mut self, node_key: Option<tessera_api::NodeKeyInfo>, in_fleet: bool) {
        self.node_key = node_key;
        self.in_fleet = in_fleet;
    }

    /// Tests: arm (or disarm) a fault between a grant's plan and its commit.
    pub fn set_failpoint(&mut self, failpoint: Option<GrantFailpoint>) {
        self.failpoint = failpoint;
    }

    fn scrub_policy(&self) -> scrub::ScrubPolicy {
        let s = self.policy.policy.scrub();
        scrub::ScrubPolicy {
            min_coverage: s.min_coverage,
            timeout: Duration::from_secs(s.timeout_s),
            same_tenant_skip: s.same_tenant_skip,
            max_attempts: s.max_attempts,
        }
    }

    /// Every device that is not plainly free: dirty, scrubbing, quarantined. Parsed from the
    /// store's text once per write of a device state, not on every plan: kept typed in
    /// [`Node::lifecycles`] while [`Store::device_gen`] stays the same.
    fn lifecycle(&self) -> Result<Lifecycles, CoreError> {
        let gen = self.store.device_gen();
        let mut cached = self.lifecycles.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, life)) = cached.as_ref().filter(|(at, _)| *at == gen) {
            return Ok(life.clone());
        }
        let life = self.read_lifecycle()?;
        *cached = Some((gen, life.clone()));
        Ok(life)
    }

    /// [`Node::lifecycle`] read from the store. A stored state that cannot be read is
    /// treated as dirty with unknown history (scrubbed before reuse).
    fn read_lifecycle(&self) -> Result<Lifecycles, CoreError> {
        let mut out = BTreeMap::new();
        for (uuid, (state, last)) in self.store.device_states().map_err(internal)? {
            let st = serde_json::from_str::<scrub::DeviceState>(&state).unwrap_or_else(|e| {
                warn!(device = %uuid, "unreadable device state {state:?}: {e}; treating it as dirty");
                scrub::DeviceState::unknown_history()
            });
            if st != scrub::DeviceState::Free {
                let report = last.and_then(|l| serde_json::from_str(&l).ok());
                out.insert(uuid, (st, report));
            }
        }
        Ok(out)
    }

    /// Devices `tenant` may not be given now: because of their lifecycle, or because a
    /// fleet-quota reclaim keeps them for another tenant.
    fn not_assignable(
        &self,
        life: &Lifecycles,
        tenant: &str,
    ) -> std::collections::BTreeSet<String> {
        let policy = self.scrub_policy();
        let mut out: std::collections::BTreeSet<String> = life
            .iter()
            .filter(|(_, (st, _))| st.can_assign(tenant, &policy).is_err())
            .map(|(u, _)| u.clone())
            .collect();
        out.extend(self.held_for_others(tenant));
        out
    }

    fn set_state(
        &mut self,
        uuid: &str,
        st: &scrub::DeviceState,
        report: Option<&scrub::ScrubReport>,
    ) -> Result<(), CoreError> {
        let json = serde_json::to_string(st).map_err(|e| CoreError::internal(e.to_string()))?;
        let rep = report.map(|r| r.to_json_line());
        self.store.set_device_state(uuid, &json, rep.as_deref()).map_err(internal)
    }

    /// ` — unavailable to this tenant: GPU-x quarantined: …; MIG-y dirty after …`, or "".
    fn unavailable_summary(
        &self,
        life: &Lifecycles,
        blocked: &std::collections::BTreeSet<String>,
    ) -> String {
        let parts: Vec<String> = blocked
            .iter()
            .filter_map(|u| match life.get(u) {
                Some((st, _)) => Some(format!("{u} {}", lifecycle_detail(st))),
                None => self.hold_detail(u).map(|h| format!("{u} {h}")),
            })
            .collect();
        if parts.is_empty() {
            String::new()
        } else {
            format!(" — unavailable to this tenant: {}", parts.join("; "))
        }
    }

    /// Sim only: each granted device's memory file, mounted where a test workload finds it.
    fn sim_memory_mounts(&self, devices: &[GrantedDevice]) -> Vec<tessera_api::BindMount> {
        devices
            .iter()
            .enumerate()
            .filter_map(|(i, d)| {
                let file = self.backend.sim_memory_file(&d.uuid)?;
                let destination = if devices.len() == 1 {
                    SIM_MEM_PATH.to_string()
                } else {
                    format!("{SIM_MEM_PATH}{i}")
                };
                Some(tessera_api::BindMount {
                    source: file.display().to_string(),
                    destination,
                    read_only: false,
                })
            })
            .collect()
    }

    /// What the node reads of the machine and signals through.
    pub fn host(&self) -> Arc<dyn Host> {
        Arc::clone(&self.host)
    }

    /// The GPUs' NVLink domains, NUMA nodes and local CPUs.
    pub fn topology(&self) -> &slicer::Topology {
        &self.topology
    }

    pub fn inventory(&self) -> &Inventory {
        &self.inventory
    }

    pub fn policy(&self) -> &ActivePolicy {
        &self.policy
    }

    /// Replace the policy used for every decision from now on (a fleet coordinator pushed
    /// a new one). Existing allocations keep their grants.
    pub fn set_policy(&mut self, policy: ActivePolicy) {
        self.policy = policy;
    }

    /// The metering ledger (read-only: fleet usage uploads read closed intervals).
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Record a refused grant as an event (the log line is the controller's, which logs
    /// every refused action).
    fn record_refusal(&mut self, container_id: &str, err: &CoreError) {
        if let Err(e) = self.store.event("refuse", Some(container_id), &err.message()) {
            warn!("cannot record refusal: {e}");
        }
    }
}

/// Every device that is not plainly free: its lifecycle state and last scrub report.
type Lifecycles = BTreeMap<String, (scrub::DeviceState, Option<scrub::ScrubReport>)>;

/// Where a simulated device's memory appears in the container.
pub const SIM_MEM_PATH: &str = "/dev/tessera-sim-mem";

fn lifecycle_detail(st: &scrub::DeviceState) -> String {
    let after = |t: &str| if t.is_empty() { "unknown tenants".to_string() } else { t.to_string() };
    match st {
        scrub::DeviceState::Free => "free".into(),
        scrub::DeviceState::Assigned { tenant, container_id } => {
            format!("assigned to {tenant} ({container_id})")
        }
        scrub::DeviceState::Dirty { last_tenant } => {
            format!("dirty after {}: waiting for a scrub", after(last_tenant))
        }
        scrub::DeviceState::Scrubbing { last_tenant, attempt } => {
            format!("scrubbing (attempt {attempt}) after {}", after(last_tenant))
        }
        scrub::DeviceState::Quarantined { reason, .. } => format!("quarantined: {reason}"),
    }
}

fn summary(r: &scrub::ScrubReport) -> tessera_api::ScrubSummary {
    tessera_api::ScrubSummary {
        ok: r.ok,
        bytes_covered: r.bytes_covered,
        bytes_total: r.bytes_total,
        nonzero_words: r.nonzero_words,
        seconds: r.seconds,
        gbps: r.gbps,
        finished_ms: r.finished_unix_s.saturating_mul(1000),
        error: r.error.clone(),
    }
}

fn mps_err(e: mpsd::MpsError) -> CoreError {
    CoreError::Mps(e)
}

fn ledger_err(e: LedgerError) -> CoreError {
    CoreError::Ledger(e)
}

fn internal(e: StoreError) -> CoreError {
    CoreError::Store(e)
}

fn validate_abs_path(field: &str, p: &str) -> Result<(), CoreError> {
    let path = Path::new(p);
    let ok = path.is_absolute()
        && !p.contains('\0')
        && !path.components().any(|c| matches!(c, std::path::Component::ParentDir));
    if ok {
        Ok(())
    } else {
        Err(CoreError::bad_request(format!(
            "{field} `{}` must be an absolute path without `..`",
            untrusted(p)
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_must_be_absolute_and_plain() {
        assert!(validate_abs_path("bundle", "/run/x").is_ok());
        assert!(validate_abs_path("bundle", "run/x").is_err());
        assert!(validate_abs_path("bundle", "/run/../etc").is_err());
    }
}
