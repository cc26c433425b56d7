//! One node's allocation service: parse → decide (pure `policy` and `slicer` functions)
//! → record durably → answer. Every method runs under the daemon's single lock, so the
//! decide-and-record step is atomic.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use metering::{Class, IntervalStart, Ledger, LedgerError, UsageQuery, UsageReport};
use policy::Policy;
use slicer::{GpuBackend, Inventory};
use tessera_api::{
    AllocateRequest, Allocation, AllocationState, ApiError, DeviceState, ErrorCode, GpuRequest, GpuStatus,
    GrantedDevice, Holder, Isolation, MigInstanceStatus, NodeStatus, PolicyInfo, StartRequest,
};
use tracing::{info, warn};

use crate::liveness::{self, Facts, Liveness};
use crate::store::{Record, Store, StoreError};

/// Host locations the daemon reads, injectable for tests.
#[derive(Debug, Clone)]
pub struct HostPaths {
    /// Normally `/proc`.
    pub proc_root: PathBuf,
}

impl Default for HostPaths {
    fn default() -> Self {
        HostPaths { proc_root: PathBuf::from("/proc") }
    }
}

/// The policy in force and where it came from.
#[derive(Debug, Clone)]
pub struct ActivePolicy {
    pub policy: Policy,
    pub source: String,
}

impl ActivePolicy {
    pub fn info(&self) -> PolicyInfo {
        PolicyInfo { version: self.policy.version(), source: self.source.clone(), digest: self.policy.digest() }
    }
}

/// The allocation service of one node.
#[derive(Debug)]
pub struct Node {
    backend: Box<dyn GpuBackend>,
    inventory: Inventory,
    policy: ActivePolicy,
    store: Store,
    ledger: Ledger,
    host: HostPaths,
    pending_grace: Duration,
}

/// What one reconciler pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ReconcileReport {
    pub checked: usize,
    pub released: Vec<(String, String)>,
}

impl Node {
    pub fn new(
        backend: Box<dyn GpuBackend>,
        policy: ActivePolicy,
        store: Store,
        ledger: Ledger,
        host: HostPaths,
        pending_grace: Duration,
    ) -> Result<Node, String> {
        let inventory = backend.inventory().map_err(|e| format!("reading the GPU inventory from {}: {e}", backend.describe()))?;
        Ok(Node { backend, inventory, policy, store, ledger, host, pending_grace })
    }

    /// After a start: opening the ledger closed every interval left open at its last
    /// checkpoint; open fresh ones for the containers that are still running. Call after
    /// [`Node::reconcile`], so only live containers are metered. Returns how many.
    pub fn resume_metering(&mut self) -> Result<usize, ApiError> {
        let mut n = 0;
        for rec in self.store.all().map_err(internal)? {
            if rec.allocation.state == AllocationState::Running {
                n += self.open_intervals(&rec.allocation)?;
            }
        }
        Ok(n)
    }

    /// Heartbeat: stamp every open interval, bounding what a crash can lose.
    pub fn checkpoint(&mut self) -> Result<usize, ApiError> {
        self.ledger.checkpoint().map_err(ledger_err)
    }

    /// A usage report over the ledger, priced with the policy in force.
    pub fn usage(&self, from_ms: u64, to_ms: u64, by: metering::GroupBy) -> Result<UsageReport, ApiError> {
        let prices = metering::Prices {
            per_model: self
                .policy
                .policy
                .prices()
                .iter()
                .map(|(m, p)| {
                    (m.clone(), metering::Rate {
                        reserved_per_gpu_hour: p.reserved_per_gpu_hour,
                        burst_per_gpu_hour: p.burst_per_gpu_hour,
                    })
                })
                .collect(),
        };
        self.ledger.usage(&UsageQuery { from_ms, to_ms, by, prices }).map_err(|e| match e {
            LedgerError::BadQuery(_) => ApiError::new(ErrorCode::BadRequest, e.to_string()),
            other => ledger_err(other),
        })
    }

    /// Every ledger interval (for metrics).
    pub fn intervals(&self) -> Result<Vec<metering::IntervalRecord>, ApiError> {
        self.ledger.intervals().map_err(ledger_err)
    }

    /// The fraction of a GPU one granted device is charged as.
    fn fraction(&self, a: &Allocation, d: &GrantedDevice) -> f64 {
        let slices = d.mig_profile.as_deref().and_then(|p| {
            slicer::model(&d.model).and_then(|m| m.profile(p)).map(|p| p.compute_slices)
        });
        let weight = d.mig_profile.as_deref().and_then(|p| self.policy.policy.mig_weight(p));
        let mps = match a.request.parse::<GpuRequest>() {
            Ok(GpuRequest::Mps { percent }) => Some(percent),
            _ => None,
        };
        metering::fraction(a.isolation, slices, mps, None, weight)
    }

    fn open_intervals(&mut self, a: &Allocation) -> Result<usize, ApiError> {
        for d in &a.devices {
            let start = IntervalStart {
                container_id: a.container_id.clone(),
                tenant: a.tenant.clone(),
                node: self.inventory.node.clone(),
                gpu_uuid: d.gpu_uuid.clone(),
                gpu_model: d.model.clone(),
                device_uuid: d.uuid.clone(),
                isolation: a.isolation,
                mig_profile: if a.isolation == Isolation::Mig { d.mig_profile.clone() } else { None },
                fraction: self.fraction(a, d),
                class: Class::Guaranteed,
            };
            self.ledger.open_interval(&start).map_err(ledger_err)?;
        }
        Ok(a.devices.len())
    }

    /// Close the container's intervals, then free its devices: in this order a crash in
    /// between leaves a grant whose release is simply retried, never an open interval
    /// for a container that no longer holds anything.
    fn drop_allocation(&mut self, container_id: &str, why: &str) -> Result<bool, ApiError> {
        self.ledger.close_container(container_id, why).map_err(ledger_err)?;
        self.store.remove(container_id, why).map_err(internal)
    }

    pub fn inventory(&self) -> &Inventory {
        &self.inventory
    }

    pub fn policy(&self) -> &ActivePolicy {
        &self.policy
    }

    /// Grant (or return the existing grant of) a container's GPU share.
    pub fn allocate(&mut self, req: &AllocateRequest) -> Result<Allocation, ApiError> {
        validate_container_id(&req.container_id)?;
        validate_abs_path("runc_root", &req.runc_root)?;
        validate_abs_path("bundle", &req.bundle)?;
        let request: GpuRequest = req.request.parse().map_err(|e: tessera_api::RequestError| {
            ApiError::new(ErrorCode::BadRequest, e.to_string())
        })?;

        if let Some(existing) = self.store.get(&req.container_id).map_err(internal)? {
            // Idempotent by container id: a retried create gets the same grant.
            let a = existing.allocation;
            if a.request == request.to_string() && existing.bundle == req.bundle {
                return Ok(a);
            }
            return Err(ApiError {
                code: ErrorCode::Conflict,
                message: format!(
                    "container {} already holds a grant for {} from bundle {}; refusing {} from {}",
                    req.container_id, a.request, existing.bundle, request, req.bundle
                ),
                tenant: Some(a.tenant),
                request: Some(request.to_string()),
                rule: None,
            });
        }

        let tenant = self.policy.policy.resolve_identity(&req.annotations).map_err(|e| {
            let err = ApiError {
                code: ErrorCode::UnknownTenant,
                message: e.to_string(),
                tenant: None,
                request: Some(request.to_string()),
                rule: Some("identity".into()),
            };
            self.log_refusal(&req.container_id, &err);
            err
        })?;

        if let Err(refusal) = self.policy.policy.authorize(&tenant, &request, &self.inventory.node) {
            let err = ApiError {
                code: ErrorCode::Refused,
                message: refusal.to_string(),
                tenant: Some(refusal.tenant.clone()),
                request: Some(refusal.request.clone()),
                rule: Some(refusal.rule.clone()),
            };
            self.log_refusal(&req.container_id, &err);
            return Err(err);
        }

        let held = self.store.claimed().map_err(internal)?;
        let devices = slicer::choose(&self.inventory, &held, &request).map_err(|nofit| {
            let code = if matches!(nofit, slicer::NoFit::NotSupported { .. }) {
                ErrorCode::NotSupported
            } else {
                ErrorCode::NoCapacity
            };
            let err = ApiError {
                code,
                message: format!("tenant {}: {nofit}", tenant.path),
                tenant: Some(tenant.path.clone()),
                request: Some(request.to_string()),
                rule: None,
            };
            self.log_refusal(&req.container_id, &err);
            err
        })?;
        let injection = slicer::injection(&self.inventory, &devices).map_err(|e| {
            ApiError::new(ErrorCode::Internal, format!("cannot build the injection: {e}"))
        })?;

        let allocation = Allocation {
            container_id: req.container_id.clone(),
            tenant: tenant.path.clone(),
            trust: tenant.trust.to_string(),
            request: request.to_string(),
            isolation: request.isolation(),
            devices,
            injection,
            state: AllocationState::Pending,
            pid: None,
            created_ms: crate::now_ms(),
        };
        let record = Record {
            allocation: allocation.clone(),
            runc_root: req.runc_root.clone(),
            bundle: req.bundle.clone(),
            pid_start: None,
        };
        self.store.insert(&record).map_err(|e| match e {
            StoreError::DeviceClaimed { .. } => ApiError::new(ErrorCode::Conflict, e.to_string()),
            other => internal(other),
        })?;
        info!(container = %allocation.container_id, tenant = %allocation.tenant, request = %allocation.request,
              devices = ?allocation.devices.iter().map(|d| &d.uuid).collect::<Vec<_>>(), "granted");
        Ok(allocation)
    }

    /// The prestart hook confirms the container exists with this pid.
    pub fn start(&mut self, container_id: &str, req: &StartRequest) -> Result<Allocation, ApiError> {
        validate_container_id(container_id)?;
        let rec = self.store.get(container_id).map_err(internal)?.ok_or_else(|| {
            ApiError::new(
                ErrorCode::NotFound,
                format!("container {container_id} has no GPU allocation on this node; refusing to start it"),
            )
        })?;
        if rec.bundle != req.bundle {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!(
                    "container {container_id}: the hook reports bundle {} but the grant was made for bundle {}",
                    req.bundle, rec.bundle
                ),
            ));
        }
        if req.pid <= 0 {
            return Err(ApiError::new(ErrorCode::BadRequest, format!("container {container_id}: pid {} is not a process id", req.pid)));
        }
        if rec.allocation.state == AllocationState::Running && rec.allocation.pid == Some(req.pid) {
            return Ok(rec.allocation);
        }
        let start = liveness::pid_start_time(&self.host.proc_root, req.pid);
        if start.is_none() {
            return Err(ApiError::new(ErrorCode::BadRequest, format!("container {container_id}: pid {} is not alive", req.pid)));
        }
        self.store.set_running(container_id, req.pid, start).map_err(internal)?;
        let rec = self.store.get(container_id).map_err(internal)?.ok_or_else(|| {
            ApiError::new(ErrorCode::Internal, format!("container {container_id}: allocation vanished"))
        })?;
        // Metering starts when the container does. Recorded after the pid, so a crash in
        // between is repaired by resume_metering on restart.
        self.open_intervals(&rec.allocation)?;
        info!(container = %container_id, pid = req.pid, "started");
        Ok(rec.allocation)
    }

    /// Free a container's devices. Unknown ids are fine (the hook and the reconciler race).
    pub fn release(&mut self, container_id: &str, why: &str) -> Result<bool, ApiError> {
        validate_container_id(container_id)?;
        let existed = self.drop_allocation(container_id, why)?;
        if existed {
            info!(container = %container_id, why, "released");
        }
        Ok(existed)
    }

    pub fn allocation(&self, container_id: &str) -> Result<Allocation, ApiError> {
        self.store
            .get(container_id)
            .map_err(internal)?
            .map(|r| r.allocation)
            .ok_or_else(|| ApiError::new(ErrorCode::NotFound, format!("no allocation for container {container_id}")))
    }

    pub fn allocations(&self) -> Result<Vec<Allocation>, ApiError> {
        Ok(self.store.all().map_err(internal)?.into_iter().map(|r| r.allocation).collect())
    }

    /// Release every allocation whose container is gone.
    pub fn reconcile(&mut self) -> Result<ReconcileReport, ApiError> {
        let now = crate::now_ms();
        let mut report = ReconcileReport::default();
        for rec in self.store.all().map_err(internal)? {
            report.checked += 1;
            let a = &rec.allocation;
            let facts = Facts {
                runc_state_exists: liveness::runc_state_exists(Path::new(&rec.runc_root), &a.container_id),
                pid_start_now: a.pid.and_then(|p| liveness::pid_start_time(&self.host.proc_root, p)),
                age_ms: now.saturating_sub(a.created_ms),
            };
            if let Liveness::Gone(why) =
                liveness::judge(a.state, rec.pid_start, &facts, self.pending_grace.as_millis() as u64)
            {
                warn!(container = %a.container_id, tenant = %a.tenant, %why, "reconciler releases");
                self.drop_allocation(&a.container_id, &format!("reconciler: {why}"))?;
                report.released.push((a.container_id.clone(), why));
            }
        }
        Ok(report)
    }

    /// Everything a person needs to see: devices, their layout, who holds what.
    pub fn status(&self) -> Result<NodeStatus, ApiError> {
        let allocations = self.allocations()?;
        let mut holders: BTreeMap<&str, Holder> = BTreeMap::new();
        for a in &allocations {
            for d in &a.devices {
                holders.insert(&d.uuid, Holder { container_id: a.container_id.clone(), tenant: a.tenant.clone() });
            }
        }
        let state_of = |holder: &Option<Holder>| if holder.is_some() { DeviceState::Assigned } else { DeviceState::Free };
        let gpus = self
            .inventory
            .gpus
            .iter()
            .map(|g| {
                let holder = holders.get(g.uuid.as_str()).cloned();
                let instances = g
                    .instances
                    .iter()
                    .map(|i| {
                        let holder = holders.get(i.uuid.as_str()).cloned();
                        MigInstanceStatus {
                            uuid: i.uuid.clone(),
                            profile: i.profile.clone(),
                            gi_id: i.gi_id,
                            ci_id: i.ci_id,
                            start: i.start,
                            size: i.size,
                            memory_mib: i.memory_mib,
                            state: state_of(&holder),
                            holder,
                        }
                    })
                    .collect();
                GpuStatus {
                    index: g.index,
                    uuid: g.uuid.clone(),
                    model: g.model.clone(),
                    minor: g.minor,
                    memory_mib: g.memory_mib,
                    mig_enabled: g.mig_enabled,
                    state: if g.mig_enabled { DeviceState::MigParent } else { state_of(&holder) },
                    holder,
                    instances,
                }
            })
            .collect();
        Ok(NodeStatus {
            node: self.inventory.node.clone(),
            backend: self.backend.describe(),
            policy: self.policy.info(),
            gpus,
            allocations,
        })
    }

    fn log_refusal(&mut self, container_id: &str, err: &ApiError) {
        warn!(container = %container_id, code = ?err.code, rule = ?err.rule, "{}", err.message);
        if let Err(e) = self.store.event("refuse", Some(container_id), &err.message) {
            warn!("cannot record refusal: {e}");
        }
    }
}

fn ledger_err(e: LedgerError) -> ApiError {
    ApiError::new(ErrorCode::Internal, format!("tesserad ledger: {e}"))
}

fn internal(e: StoreError) -> ApiError {
    ApiError::new(ErrorCode::Internal, format!("tesserad: {e}"))
}

/// runc accepts ids matching `^[\w+\-.]+$`; so do we, and nothing longer than 1024 bytes.
pub fn validate_container_id(id: &str) -> Result<(), ApiError> {
    let ok = !id.is_empty()
        && id.len() <= 1024
        && id != "."
        && id != ".."
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"_+-.".contains(&b));
    if ok {
        Ok(())
    } else {
        let shown: String = id.chars().take(80).collect();
        Err(ApiError::new(
            ErrorCode::BadRequest,
            format!("container_id {shown:?} is not a valid container id (expected 1 to 1024 of [A-Za-z0-9_+-.])"),
        ))
    }
}

fn validate_abs_path(field: &str, p: &str) -> Result<(), ApiError> {
    let path = Path::new(p);
    let ok = path.is_absolute()
        && !p.contains('\0')
        && !path.components().any(|c| matches!(c, std::path::Component::ParentDir));
    if ok {
        Ok(())
    } else {
        Err(ApiError::new(ErrorCode::BadRequest, format!("{field} {p:?} must be an absolute path without `..`")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn container_ids_follow_runcs_rules() {
        for ok in ["abc", "a.b-c_d+e", "0123456789abcdef"] {
            assert!(validate_container_id(ok).is_ok(), "{ok}");
        }
        for bad in ["", ".", "..", "../etc", "a/b", "a b", "a\0b", &"x".repeat(1025)] {
            let e = validate_container_id(bad).unwrap_err();
            assert_eq!(e.code, ErrorCode::BadRequest);
        }
    }

    #[test]
    fn paths_must_be_absolute_and_plain() {
        assert!(validate_abs_path("bundle", "/run/x").is_ok());
        assert!(validate_abs_path("bundle", "run/x").is_err());
        assert!(validate_abs_path("bundle", "/run/../etc").is_err());
    }
}
