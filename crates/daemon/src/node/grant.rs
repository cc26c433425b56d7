//! A grant in two steps: a pure plan from a snapshot (policy, tenant, request, device
//! lifecycles and claims), then one apply that makes the hardware changes and commits the
//! grant with every device-state change it implies in one SQLite transaction.

use std::collections::BTreeSet;

use tessera_api::{
    AllocateRequest, Allocation, AllocationState, ContainerId, GpuRequest, GrantedDevice,
    Injection, Isolation, ShareGrant, TenantPath, Trust,
};
use tracing::{info, warn};

use super::{internal, Lifecycles, Node};
use crate::error::{CoreError, Detail};
use crate::share::{self, DeviceUse};
use crate::store::{Record, StateChange, StoreError};

/// Who asked for what, resolved and authorised.
#[derive(Debug, Clone)]
pub(crate) struct Asker<'a> {
    pub req: &'a AllocateRequest,
    /// What is planned: the request, or what the interference controller hardened it to;
    /// the grant records the request as asked (`req.request`).
    pub request: &'a GpuRequest,
    /// What the container is (its `tessera.io/class`, else the policy's default).
    pub class: Option<tessera_api::WorkloadClass>,
    /// The container's identity across restarts (its pod container, else its id): what
    /// hardening and anti-affinity marks are kept by.
    pub workload_key: Option<String>,
    pub tenant: &'a TenantPath,
    pub trust: Trust,
    /// The pod container it asks for, where it is one.
    pub workload: Option<tessera_api::cri::Workload>,
}

/// What a grant will hold, decided from a snapshot; nothing is changed yet.
#[derive(Debug, Clone)]
pub(crate) enum Acquire {
    /// Devices that exist now, held exclusively (`gpu=N`, `mig=P` from existing instances).
    Devices(Vec<GrantedDevice>),
    /// A MIG instance of `profile` cut at `gpu_index`/`start` (after destroying the idle
    /// instances in `destroy`).
    CutMig { profile: String, gpu_index: u32, start: u8, destroy: Vec<String> },
    /// An MPS share on `device`: the tenant's control daemon started (caps set) in apply.
    Mps { device: GrantedDevice, share: ShareGrant, request: mpsd::ShareRequest },
    /// A time-sliced replica of `device`.
    Shared { device: GrantedDevice, share: ShareGrant },
}

/// A grant decided but not yet made: what it holds, and every device-state change it
/// implies (a dirty device handed back to its own tenant loses its dirty mark — with the
/// grant, never before it). The injection is derived (`slicer::injection`, pure) from the
/// devices once they exist.
#[derive(Debug, Clone)]
pub(crate) struct GrantPlan {
    pub container_id: ContainerId,
    pub tenant: TenantPath,
    pub trust: Trust,
    pub request: GpuRequest,
    pub runc_root: String,
    pub bundle: String,
    pub acquire: Acquire,
    pub states: Vec<StateChange>,
    /// The MIG profile whose demand this grant adds to, once committed.
    pub mig_profile: Option<String>,
    pub workload: Option<tessera_api::cri::Workload>,
    /// How the grant counts against fleet quotas (`None`: no quota applies).
    pub quota: Option<Box<tessera_api::QuotaMark>>,
    /// Where whole GPUs landed in the node's topology (`gpu=N`).
    pub placement: Option<slicer::Placement>,
    /// What the container declared itself (or its tenant's default).
    pub class: Option<tessera_api::WorkloadClass>,
    /// The isolation actually granted, when it is not the request's (a hardened request:
    /// `interference.harden`).
    pub isolation: Isolation,
}

fn injection_for(node: &Node, devices: &[GrantedDevice]) -> Result<Injection, CoreError> {
    slicer::injection(&node.inventory, devices)
        .map_err(|e| CoreError::internal(format!("cannot build the injection: {e}")))
}

/// Devices a tenant may not be given now ([`Node::excluded_for`]).
pub(super) struct Excluded {
    /// Dirty, scrubbing and quarantined devices (and a dirty one of this tenant too,
    /// unless the policy lets it skip the scrub).
    pub blocked: BTreeSet<String>,
    /// Whole GPUs and shared devices kept from it by where others run:
    /// `topology.isolate_nvlink_domains` and the interference controller's anti-affinity
    /// ([`Node::fenced_for`]).
    pub fenced: BTreeSet<String>,
}

impl Node {
    /// Decide a grant from the current snapshot (policy, inventory, claims, lifecycles).
    /// Changes nothing: a refusal is returned for the caller to record.
    pub(crate) fn plan_grant(&self, who: &Asker<'_>) -> Result<GrantPlan, CoreError> {
        let tenant = who.tenant;
        let mut device_use = DeviceUse::of(&self.allocations()?);
        // Dirty, scrubbing and quarantined devices count as taken for this tenant (and a
        // dirty one of this tenant too, unless the policy lets it skip the scrub).
        let life = self.lifecycle()?;
        let Excluded { blocked, fenced } = self.excluded_for(&life, who)?;
        device_use.exclusive.extend(blocked.iter().cloned());
        device_use.exclusive.extend(fenced.iter().cloned());
        let mut mig_profile = None;
        let mut placement = None;
        let acquire = match who.request {
            GpuRequest::Mps { percent } => {
                self.plan_mps(tenant, who, *percent, &device_use, None)?
            }
            GpuRequest::Shared => self.plan_shared(tenant, &device_use, None)?,
            GpuRequest::Mig { profile } if self.mig_is_dynamic() => {
                let mut untouchable = device_use.busy();
                untouchable.extend(life.keys().cloned());
                mig_profile = Some(profile.clone());
                self.plan_mig_dynamic(tenant, profile, &untouchable)?
            }
            request => {
                let unavailable = self.unavailable_summary(&life, &blocked);
                let fence = if fenced.is_empty() {
                    String::new()
                } else {
                    format!(
                        " — kept from this tenant by where others run (topology.isolate_nvlink_domains, interference anti-affinity): {}",
                        fenced.iter().cloned().collect::<Vec<_>>().join(", ")
                    )
                };
                let (devices, placed) = slicer::choose_placed(
                    &self.inventory,
                    &self.topology,
                    &device_use.busy(),
                    request,
                )
                .map_err(|nofit| {
                    CoreError::NoCapacity(Detail {
                        message: format!("tenant {tenant}: {nofit}{unavailable}{fence}"),
                        tenant: Some(tenant.to_string()),
                        request: Some(request.to_string()),
                        rule: None,
                    })
                })?;
                placement = placed;
                Acquire::Devices(devices)
            }
        };
        let mut plan = self.finish_plan(who, &life, acquire, mig_profile)?;
        plan.placement = placement;
        Ok(plan)
    }

    /// What `who` may not be given now, whoever picks the devices — tesserad's placement
    /// ([`Node::plan_grant`]), kubelet's assignment or a user's pin
    /// ([`Node::plan_assigned`]): one check for every path, so no path skips a rule.
    pub(super) fn excluded_for(
        &self,
        life: &Lifecycles,
        who: &Asker<'_>,
    ) -> Result<Excluded, CoreError> {
        Ok(Excluded {
            blocked: self.not_assignable(life, who.tenant),
            fenced: self.fenced_for(who.tenant, who.workload_key.as_deref())?,
        })
    }

    /// The plan of `who`'s grant once what it holds is decided (here, or on the devices
    /// kubelet assigned: `assignment.rs`).
    pub(super) fn finish_plan(
        &self,
        who: &Asker<'_>,
        life: &Lifecycles,
        acquire: Acquire,
        mig_profile: Option<String>,
    ) -> Result<GrantPlan, CoreError> {
        let tenant = who.tenant;
        let states = self.handed_back(life, &acquire)?;
        Ok(GrantPlan {
            container_id: who.req.container_id.clone(),
            tenant: tenant.clone(),
            trust: who.trust,
            request: who.req.request.clone(),
            runc_root: who.req.runc_root.clone(),
            bundle: who.req.bundle.clone(),
            acquire,
            states,
            mig_profile,
            workload: who.workload.clone(),
            quota: None,
            placement: None,
            class: who.class,
            isolation: who.request.isolation(),
        })
    }

    /// A dirty device handed back to its own tenant (policy: `same_tenant_skip`) is the
    /// tenant's again: its dirty mark goes, in the grant's own transaction. The claim (or
    /// share) committed with it holds the device, and its release marks it dirty again.
    fn handed_back(
        &self,
        life: &Lifecycles,
        acquire: &Acquire,
    ) -> Result<Vec<StateChange>, CoreError> {
        let planned: Vec<&str> = match acquire {
            Acquire::Devices(d) => d.iter().map(|d| d.uuid.as_str()).collect(),
            Acquire::Mps { device, .. } | Acquire::Shared { device, .. } => vec![&device.uuid],
            // A fresh instance has no history; the idle ones destroyed for it are free.
            Acquire::CutMig { .. } => Vec::new(),
        };
        let held: Vec<&str> = planned.into_iter().filter(|u| life.contains_key(*u)).collect();
        if held.is_empty() {
            return Ok(Vec::new());
        }
        let stored = self.store.device_states().map_err(internal)?;
        let free = serde_json::to_string(&scrub::DeviceState::Free)
            .map_err(|e| CoreError::internal(e.to_string()))?;
        Ok(held
            .into_iter()
            .map(|u| StateChange {
                uuid: u.to_string(),
                from: stored.get(u).map(|(st, _)| st.clone()),
                to: free.clone(),
            })
            .collect())
    }

    /// A MIG instance of `profile`, cut on demand: reuse a free one, else create one in
    /// the placement that keeps the most future capacity, destroying idle instances only
    /// when that is what makes room.
    fn plan_mig_dynamic(
        &self,
        tenant: &str,
        profile: &str,
        busy: &BTreeSet<String>,
    ) -> Result<Acquire, CoreError> {
        let demand = if self.mig_demand.is_empty() {
            self.inventory
                .gpus
                .iter()
                .find(|g| g.mig_enabled)
                .and_then(|g| slicer::model(&g.model))
                .map(slicer::DemandMix::uniform)
                .unwrap_or_else(|| {
                    slicer::DemandMix::from_weights(std::iter::empty::<(String, f64)>(), 1.0)
                })
        } else {
            slicer::DemandMix::observed(&self.mig_demand)
        };
        let decision =
            slicer::place(&self.inventory, busy, profile, slicer::Strategy::Best, &demand)
                .map_err(|nofit| {
                    CoreError::NoCapacity(Detail {
                        message: format!("tenant {tenant}: {nofit}"),
                        tenant: Some(tenant.to_string()),
                        request: Some(format!("mig={profile}")),
                        rule: None,
                    })
                })?;
        let profile = profile.to_string();
        Ok(match decision {
            slicer::PlaceDecision::Reuse { uuid } => {
                Acquire::Devices(vec![share::granted(&self.inventory, &uuid).ok_or_else(|| {
                    CoreError::internal(format!("instance {uuid} is not in the inventory"))
                })?])
            }
            slicer::PlaceDecision::Create { gpu_index, start } => {
                Acquire::CutMig { profile, gpu_index, start, destroy: Vec::new() }
            }
            slicer::PlaceDecision::Defragment { destroy, gpu_index, start } => {
                debug_assert!(destroy.iter().all(|idle| !busy.contains(idle)));
                Acquire::CutMig { profile, gpu_index, start, destroy }
            }
        })
    }

    /// An MPS share: the most booked device that still fits (so shares pack and whole
    /// devices stay free); on device `only` when given (kubelet's choice).
    pub(super) fn plan_mps(
        &self,
        tenant: &str,
        who: &Asker<'_>,
        percent: u8,
        device_use: &DeviceUse,
        only: Option<&str>,
    ) -> Result<Acquire, CoreError> {
        let mut loads = device_use.mps_loads(&self.inventory);
        loads.retain(|l| only.is_none_or(|u| l.uuid == u));
        let device = mpsd::pick_mps_device(&loads, tenant, percent).map_err(|nofit| {
            CoreError::NoCapacity(Detail {
                message: format!("tenant {tenant}: {nofit}"),
                tenant: Some(tenant.to_string()),
                request: Some(format!("mps={percent}")),
                rule: None,
            })
        })?;
        let granted = self.granted(&device)?;
        let mem = share::memory_bytes(&self.inventory, &device).unwrap_or(0);
        let request = mpsd::ShareRequest {
            device: device.clone(),
            tenant: tenant.to_string(),
            holder: who.req.container_id.to_string(),
            percent,
            mem_limit_bytes: mpsd::mps_mem_limit_bytes(mem, percent),
        };
        let share = ShareGrant {
            kind: Isolation::Mps,
            device,
            percent: Some(percent),
            mem_limit_bytes: Some(request.mem_limit_bytes),
            domain: None,
            replicas: None,
        };
        Ok(Acquire::Mps { device: granted, share, request })
    }

    /// A time-sliced replica: a GPU shared only within the tenant's sharing domain; on
    /// device `only` when given (kubelet's choice).
    pub(super) fn plan_shared(
        &self,
        tenant: &str,
        device_use: &DeviceUse,
        only: Option<&str>,
    ) -> Result<Acquire, CoreError> {
        let replicas = self.policy.policy.shared_replicas();
        let domain = self.policy.policy.sharing_domain(tenant);
        let mut loads = device_use.shared_loads(&self.inventory, replicas);
        loads.retain(|l| only.is_none_or(|u| l.uuid == u));
        let device = mpsd::pick_shared_device(&loads, &domain).map_err(|nofit| {
            CoreError::NoCapacity(Detail {
                message: format!("tenant {tenant}: {nofit}"),
                tenant: Some(tenant.to_string()),
                request: Some("shared".into()),
                rule: Some("sharing".into()),
            })
        })?;
        let granted = self.granted(&device)?;
        let share = ShareGrant {
            kind: Isolation::Shared,
            device,
            percent: None,
            mem_limit_bytes: None,
            domain: Some(domain),
            replicas: Some(replicas),
        };
        Ok(Acquire::Shared { device: granted, share })
    }

    fn granted(&self, device: &str) -> Result<GrantedDevice, CoreError> {
        share::granted(&self.inventory, device).ok_or_else(|| {
            CoreError::internal(format!("device {device} vanished from the inventory"))
        })
    }

    /// Make a planned grant: the hardware changes it needs (a MIG instance cut, an MPS
    /// control daemon started), then one transaction with the grant, its device claims and
    /// its device-state changes. A failed commit (or a crash before it) leaves no grant
    /// and every device state as it was: the MPS share is given back; a MIG instance cut
    /// for it stays on the GPU idle and unclaimed — never used by any container, so clean —
    /// where the next request for its profile reuses it or placement may destroy it.
    pub(crate) fn apply_grant(&mut self, plan: GrantPlan) -> Result<Allocation, CoreError> {
        let cid = plan.container_id.clone();
        let mut cut = None;
        let (devices, mut injection, share) = match plan.acquire {
            Acquire::Devices(devices) => {
                let injection = injection_for(self, &devices)?;
                (devices, injection, None)
            }
            Acquire::CutMig { ref profile, gpu_index, start, ref destroy } => {
                let device = self.cut_mig(&cid, profile, gpu_index, start, destroy)?;
                cut = Some(device.uuid.clone());
                let devices = vec![device];
                let injection = injection_for(self, &devices)?;
                (devices, injection, None)
            }
            Acquire::Mps { device, share, request } => {
                let handle = self.mps.ensure_share(&request);
                self.record_daemon_cgroups();
                let handle = handle.map_err(|e| {
                    let err = CoreError::Internal(Detail {
                        message: format!(
                            "tenant {}: cannot set up the MPS share on {}: {e}",
                            plan.tenant, share.device
                        ),
                        tenant: Some(plan.tenant.to_string()),
                        request: Some(plan.request.to_string()),
                        rule: None,
                    });
                    self.record_refusal(&cid, &err);
                    err
                })?;
                let devices = vec![device];
                let mut injection = injection_for(self, &devices)?;
                injection.mounts.extend(handle.mounts());
                for kv in handle.env() {
                    let key = kv.split('=').next().unwrap_or("").to_string();
                    injection.env.retain(|e| e.split('=').next() != Some(key.as_str()));
                    injection.env.push(kv);
                }
                (devices, injection, Some(share))
            }
            Acquire::Shared { device, share } => {
                let devices = vec![device];
                let injection = injection_for(self, &devices)?;
                (devices, injection, Some(share))
            }
        };
        injection.mounts.extend(self.sim_memory_mounts(&devices));
        injection.mounts.extend(self.backend.driver_mounts());
        if self.policy.policy.topology().pin_cpus {
            injection.cpuset = self.cpuset_of(&devices);
        }
        if plan.class == Some(tessera_api::WorkloadClass::Latency) {
            // Its own latency report (docs/GPU-HEALTH.md, Reporting latency): one file of
            // its own on a one-page tmpfs of its own (`report_fs`: the kernel bounds what
            // it writes), bind-mounted read-write; the daemon reads it without following
            // links.
            let report = self.report_file(&cid);
            crate::report_fs::create(&report).map_err(|e| {
                CoreError::internal(format!("latency report {}: {e}", report.display()))
            })?;
            injection.mounts.push(tessera_api::BindMount {
                source: report.display().to_string(),
                destination: super::REPORT_PATH.into(),
                read_only: false,
            });
            injection.env.retain(|e| !e.starts_with(&format!("{}=", super::REPORT_ENV)));
            injection.env.push(format!("{}={}", super::REPORT_ENV, super::REPORT_PATH));
        }
        let allocation = Allocation {
            container_id: cid.clone(),
            tenant: plan.tenant,
            trust: plan.trust,
            isolation: plan.isolation,
            request: plan.request,
            devices,
            injection,
            state: AllocationState::Pending,
            pid: None,
            created_ms: crate::now_ms(),
            share,
            workload: plan.workload,
            quota: plan.quota,
            // The NVLink domain the placement put a multi-GPU grant in (the ledger prices
            // the topology premium from it; one device never carries it: node/ledger.rs).
            nvlink_domain: plan.placement.as_ref().and_then(|p| p.nvlink_domain),
            topology: plan.placement.as_ref().map(|p| p.note.clone()),
            class: plan.class,
        };
        let record = Record {
            allocation,
            runc_root: plan.runc_root,
            bundle: plan.bundle,
            pid_start: None,
            cgroup: None,
        };
        let committed = GrantFailpoint::hit(self.failpoint.as_ref(), &cid).and_then(|()| {
            self.store.insert_grant(&record, &plan.states).map_err(|e| match e {
                StoreError::DeviceClaimed { .. } | StoreError::StateChanged { .. } => {
                    CoreError::conflict(e.to_string())
                }
                other => internal(other),
            })
        });
        let allocation = record.allocation;
        if let Err(e) = committed {
            // Nothing was recorded: give back the MPS share this grant would have held.
            if let Some(s) = allocation.share.as_ref().filter(|s| s.kind == Isolation::Mps) {
                let _ = self.mps.release(&s.device, &allocation.tenant, &cid);
            }
            if let Some(uuid) = cut {
                let detail = format!("{uuid} left idle: the grant it was cut for failed");
                warn!(container = %cid, "{detail}");
                let _ = self.store.event("mig", Some(&cid), &detail);
            }
            return Err(e);
        }
        if let Some(profile) = plan.mig_profile {
            *self.mig_demand.entry(profile).or_default() += 1;
        }
        if let Some(note) = &allocation.topology {
            let _ = self.store.event(
                "placement",
                Some(&cid),
                &format!("{}: {note}", allocation.request),
            );
        }
        if let Some(mark) = &allocation.quota {
            self.holds_used(&allocation.tenant, &crate::quota_gate::held_devices(&allocation));
            if mark.class == tessera_api::QuotaClass::Borrowed {
                let detail = format!(
                    "borrowed: beyond the guarantee of {} (tenant {}); priced at the burst price and reclaimable",
                    mark.over.as_deref().unwrap_or("its quotas"),
                    allocation.tenant
                );
                if let Err(e) = self.store.event("borrow", Some(&cid), &detail) {
                    warn!("cannot record a borrowed grant: {e}");
                }
            }
        }
        info!(container = %allocation.container_id, tenant = %allocation.tenant, request = %allocation.request,
              devices = ?allocation.devices.iter().map(|d| &d.uuid).collect::<Vec<_>>(),
              quota = allocation.quota.as_ref().map_or("-", |m| m.class.as_str()), "granted");
        Ok(allocation)
    }

    /// The CPUs and memory nodes close to `devices`' GPUs that the host has online
    /// (`topology.pin_cpus`); `None` where the topology or the host cannot say, or they
    /// share none.
    fn cpuset_of(&self, devices: &[GrantedDevice]) -> Option<tessera_api::CpuSet> {
        use tessera_api::cpulist::{intersect, parse_cpulist, render_cpulist};
        let (online, nodes) = self.host.cpu_layout()?;
        let mut cpus = Vec::new();
        let mut mems = Vec::new();
        for d in devices {
            let t = self.topology.of(&d.gpu_uuid)?;
            cpus.extend(parse_cpulist(t.cpus.as_deref()?).ok()?);
            mems.extend(t.numa_node);
        }
        let cpus = intersect(&online, &cpus);
        if cpus.is_empty() {
            return None;
        }
        let mems = intersect(&nodes, &mems);
        Some(tessera_api::CpuSet {
            cpus: render_cpulist(&cpus),
            mems: (!mems.is_empty()).then(|| render_cpulist(&mems)),
        })
    }

    /// Cut a MIG instance of `profile` (destroying the idle `destroy` first) and return it.
    fn cut_mig(
        &mut self,
        container_id: &str,
        profile: &str,
        gpu_index: u32,
        start: u8,
        destroy: &[String],
    ) -> Result<GrantedDevice, CoreError> {
        let backend_err = |what: &str, e: slicer::BackendError| {
            CoreError::internal(format!("{what} for mig={profile}: {e}"))
        };
        let uuid = if destroy.is_empty() {
            let inst = self
                .backend
                .create_instance(gpu_index, profile, start)
                .map_err(|e| backend_err("creating an instance", e))?;
            let _ = self.store.event(
                "mig",
                Some(container_id),
                &format!("created {profile} at GPU {gpu_index} slot {start}: {}", inst.uuid),
            );
            self.refresh_inventory()?;
            inst.uuid
        } else {
            for idle in destroy {
                self.backend
                    .destroy_instance(idle)
                    .map_err(|e| backend_err("destroying an idle instance", e))?;
            }
            let inst = self
                .backend
                .create_instance(gpu_index, profile, start)
                .map_err(|e| backend_err("creating an instance", e));
            let _ = self.store.event(
                "mig",
                Some(container_id),
                &format!(
                    "defragmented GPU {gpu_index}: destroyed idle [{}] to create {profile} at slot {start}",
                    destroy.join(",")
                ),
            );
            self.refresh_inventory()?;
            inst?.uuid
        };
        self.granted(&uuid)
            .map_err(|_| CoreError::internal(format!("instance {uuid} is not in the inventory")))
    }
}

/// What a [`GrantFailpoint`] does when a grant reaches it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailAction {
    /// The grant fails as a failed commit would: an error, nothing recorded.
    Error,
    /// The daemon dies on the spot (`abort`), like a `kill -9` at that instant.
    Abort,
}

/// A fault injected between a grant's plan (and its hardware changes) and its commit, for
/// tests: set with [`super::Node::set_failpoint`], or in a debug build of tesserad from
/// `TESSERA_FAILPOINT` (`grant-commit=error` or `grant-commit=abort`, optionally
/// `@CONTAINER_ID` to hit only that container's grant). A release build ignores the
/// variable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrantFailpoint {
    pub action: FailAction,
    /// Only this container's grant; any grant when `None`.
    pub container_id: Option<String>,
}

/// Why `TESSERA_FAILPOINT` names no failpoint.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{value:?}: {why}")]
pub struct InvalidFailpoint {
    value: String,
    why: String,
}

impl GrantFailpoint {
    pub const ENV: &'static str = "TESSERA_FAILPOINT";

    /// `grant-commit=error|abort[@CONTAINER_ID]`.
    pub fn parse(s: &str) -> Result<GrantFailpoint, InvalidFailpoint> {
        let bad = |why: String| InvalidFailpoint { value: s.to_string(), why };
        let (point, rest) =
            s.split_once('=').ok_or_else(|| bad("expected grant-commit=ACTION".into()))?;
        if point != "grant-commit" {
            return Err(bad(format!("unknown failpoint {point:?} (known: grant-commit)")));
        }
        let (action, container_id) = match rest.split_once('@') {
            Some((a, c)) if !c.is_empty() => (a, Some(c.to_string())),
            Some(_) => return Err(bad("empty container id after '@'".into())),
            None => (rest, None),
        };
        let action = match action {
            "error" => FailAction::Error,
            "abort" => FailAction::Abort,
            other => return Err(bad(format!("unknown action {other:?} (error, abort)"))),
        };
        Ok(GrantFailpoint { action, container_id })
    }

    /// The failpoint `TESSERA_FAILPOINT` names, in a debug build only.
    pub fn from_env() -> Option<GrantFailpoint> {
        if !cfg!(debug_assertions) {
            return None;
        }
        let value = std::env::var(Self::ENV).ok()?;
        match GrantFailpoint::parse(&value) {
            Ok(f) => {
                warn!("failpoint armed: {value}");
                Some(f)
            }
            Err(e) => {
                warn!("{}: {e}; no failpoint armed", Self::ENV);
                None
            }
        }
    }

    /// Fail (or die) if armed for `container_id`.
    pub(crate) fn hit(this: Option<&GrantFailpoint>, container_id: &str) -> Result<(), CoreError> {
        let Some(f) = this else { return Ok(()) };
        if let Some(only) = &f.container_id {
            if only != container_id {
                return Ok(());
            }
        }
        match f.action {
            FailAction::Error => Err(CoreError::internal(format!(
                "container {container_id}: failpoint grant-commit: injected failure"
            ))),
            FailAction::Abort => {
                warn!(container = %container_id, "failpoint grant-commit: aborting");
                std::process::abort()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failpoints_parse() {
        assert_eq!(
            GrantFailpoint::parse("grant-commit=abort@c1"),
            Ok(GrantFailpoint { action: FailAction::Abort, container_id: Some("c1".into()) })
        );
        assert_eq!(
            GrantFailpoint::parse("grant-commit=error"),
            Ok(GrantFailpoint { action: FailAction::Error, container_id: None })
        );
        for bad in ["grant-commit", "other=error", "grant-commit=explode", "grant-commit=error@"] {
            assert!(GrantFailpoint::parse(bad).is_err(), "{bad}");
        }
        assert!(GrantFailpoint::hit(None, "c").is_ok());
        let only = GrantFailpoint::parse("grant-commit=error@c1").expect("parse");
        assert!(GrantFailpoint::hit(Some(&only), "c2").is_ok());
        assert!(GrantFailpoint::hit(Some(&only), "c1").is_err());
    }
}
