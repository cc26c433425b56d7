//! `allocate`: parse the request, resolve the tenant, authorise, then plan and apply the
//! grant ([`super::grant`]). Idempotent by container id.
//!
//! Under a policy with fleet quotas, the controller splits it in two steps around the
//! coordinator's answer (asked without the node lock): [`Node::prepare_allocate`] (up to
//! the plan, and what to ask) and [`Node::finish_allocate`] (the plan again, on the state
//! of then, made with the quota mark).

use super::assignment::Pick;
use super::{grant, internal, validate_abs_path, Node};
use crate::error::{CoreError, Detail};
use crate::quota_gate;
use tessera_api::deviceplugin::{IssuedAssignment, PluginAssignment, RESOURCE_GPU};
use tessera_api::{
    untrusted, AllocateRequest, Allocation, ErrorCode, GpuRequest, QuotaClass, QuotaMark,
};

/// A request past its checks: who asks, for which pod container, on which assigned devices.
#[derive(Debug)]
pub(crate) struct Checked {
    tenant: policy::Tenant,
    workload: Option<tessera_api::cri::Workload>,
    /// Kubelet's assignment, its token checked.
    assigned: Option<Box<IssuedAssignment>>,
    /// What it declared itself (or its tenant's default).
    class: tessera_api::WorkloadClass,
    /// Its identity across restarts (`interference::workload_key`).
    workload_key: String,
    /// What the interference controller hardened its request to, if it did.
    hardened: Option<tessera_api::GpuRequest>,
    /// The GPUs tessera-runtime pinned (`docker --gpus '"device=…"'`), as uuids.
    pinned: Option<PluginAssignment>,
}

/// What the checks found.
#[derive(Debug)]
pub(crate) enum Resolved {
    /// The container holds this grant already (idempotent by container id).
    Existing(Box<Allocation>),
    /// A new grant to plan.
    New(Box<Checked>),
}

/// Whether grants go through the fleet's quotas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaMode {
    /// Grant as without quotas (no gate: a node without the daemon's quota set-up).
    Off,
    /// Under a policy that sets quotas, ask before granting (a request this node cannot
    /// place asks too: it may reclaim borrowed work here).
    On,
}

/// What [`Node::prepare_allocate`] decided.
#[derive(Debug)]
pub(crate) enum Prepared {
    /// Done: the grant the container holds, or made now (no quota applies).
    Granted(Box<Allocation>),
    /// Quotas apply: ask the fleet, then [`Node::finish_allocate`].
    Ask(Box<QuotaAsk>),
}

/// What a grant asks of the fleet's quotas.
#[derive(Debug)]
pub(crate) struct QuotaAsk {
    pub admit: fleet::quota_wire::AdmitRequest,
    /// The policy's quotas (the node's own books decide with them when no coordinator
    /// is configured).
    pub tree: ::quota::QuotaTree,
    /// The policy's gang timeout, for a gang member's wait.
    pub gang_timeout_s: u64,
    /// The request, for messages.
    pub request: tessera_api::GpuRequest,
    /// The node could not place it: the refusal it gets unless the coordinator reclaims.
    pub no_capacity: Option<CoreError>,
}

/// How the fleet admitted a grant.
#[derive(Debug, Clone)]
pub(crate) enum Admission<'a> {
    /// The coordinator counted it as `class`.
    Fleet { class: QuotaClass, over: Option<String> },
    /// The coordinator is unreachable: this node's lease decides (under the lock, on the
    /// node's holdings of then). `since_ms` and `why`: since when, and why.
    Lease { leases: &'a crate::quota_gate::QuotaGate, since_ms: u64, why: String },
}

impl Node {
    /// Grant (or return the existing grant of) a container's GPU share, as without quotas.
    pub fn allocate(&mut self, req: &AllocateRequest) -> Result<Allocation, CoreError> {
        let checked = match self.check_allocate(req)? {
            Resolved::Existing(a) => return Ok(*a),
            Resolved::New(c) => *c,
        };
        let plan =
            self.plan_checked(req, &checked).inspect_err(|e| self.record_no_capacity(req, e))?;
        self.commit_checked(req, &checked, plan)
    }

    /// Everything [`Node::allocate`] does before the plan: the request checked, the
    /// existing grant found, the tenant resolved and authorised. Refusals are recorded.
    fn check_allocate(&mut self, req: &AllocateRequest) -> Result<Resolved, CoreError> {
        validate_abs_path("runc_root", &req.runc_root)?;
        validate_abs_path("bundle", &req.bundle)?;
        // The container id and the request are typed since the body was read: a malformed
        // one never got this far.
        let request = &req.request;
        // The devices kubelet chose, when the device plugin assigned them (`assignment.rs`).
        let assigned = self.plugin_assignment(req)?;

        if let Some(existing) = self.store.get(&req.container_id).map_err(internal)? {
            // Idempotent by container id: a retried create gets the same grant.
            let a = existing.allocation;
            if a.request == *request && existing.bundle == req.bundle {
                return Ok(Resolved::Existing(Box::new(a)));
            }
            return Err(CoreError::Conflict(Detail {
                message: format!(
                    "container {} already holds a grant for {} from bundle {}; refusing {} from {}",
                    req.container_id,
                    a.request,
                    untrusted(&existing.bundle),
                    request,
                    untrusted(&req.bundle)
                ),
                tenant: Some(a.tenant.into_string()),
                request: Some(request.to_string()),
                rule: None,
            }));
        }

        // Which pod container asks (containerd's own annotations), and the bare form's
        // one-application-container rule.
        let workload = self.pod_container(req)?;

        let tenant = self.policy.policy.resolve_identity(&req.annotations).map_err(|e| {
            let err = CoreError::UnknownTenant(Detail {
                message: e.to_string(),
                tenant: None,
                request: Some(request.to_string()),
                rule: Some("identity".into()),
            });
            self.record_refusal(&req.container_id, &err);
            err
        })?;

        if let Err(refusal) = self.policy.policy.authorize(&tenant, request, &self.inventory.node) {
            let err = CoreError::Refused(Detail {
                message: refusal.to_string(),
                tenant: Some(refusal.tenant.clone()),
                request: Some(refusal.request.clone()),
                rule: Some(refusal.rule.clone()),
            });
            self.record_refusal(&req.container_id, &err);
            return Err(err);
        }
        let class = self.class_of(&tenant.path, &req.annotations).map_err(|mut err| {
            if let Some(d) = err.detail_mut() {
                d.tenant = Some(tenant.path.to_string());
                d.request = Some(request.to_string());
                d.rule = Some("interference.classes".into());
            }
            self.record_refusal(&req.container_id, &err);
            err
        })?;
        let workload_key =
            super::interference::workload_key(workload.as_ref(), req.container_id.as_str());
        let pinned = self.pinned_gpus(req, assigned.is_some())?;
        // Kubelet's or the user's own choice of devices is not second-guessed.
        let hardened = if assigned.is_none() && pinned.is_none() {
            self.hardened_request(&tenant, &workload_key, request)
        } else {
            None
        };
        Ok(Resolved::New(Box::new(Checked {
            tenant,
            workload,
            assigned: assigned.map(Box::new),
            class,
            workload_key,
            hardened,
            pinned,
        })))
    }

    /// The GPUs a `gpu=N` request pins ([`tessera_api::PINNED_ANNOTATION`]: indices or
    /// uuids, N of them), as this node's uuids; `None` without pins. A pin that names no
    /// GPU here, or pins with another request, are refused (400).
    fn pinned_gpus(
        &self,
        req: &AllocateRequest,
        kubelet: bool,
    ) -> Result<Option<PluginAssignment>, CoreError> {
        let Some(raw) = req.annotations.get(tessera_api::PINNED_ANNOTATION) else {
            return Ok(None);
        };
        let bad = |why: String| {
            CoreError::BadRequest(Detail {
                message: format!(
                    "container {}: pinned GPUs `{}`: {why}",
                    req.container_id,
                    untrusted(raw).max_chars(256)
                ),
                tenant: None,
                request: Some(req.request.to_string()),
                rule: Some(tessera_api::PINNED_ANNOTATION.to_string()),
            })
        };
        let GpuRequest::Gpu { count } = req.request else {
            return Err(bad(format!("only a gpu=N request pins GPUs, not {}", req.request)));
        };
        if kubelet {
            return Err(bad("a device-plugin assignment names its devices already".into()));
        }
        let mut uuids = Vec::new();
        for pin in raw.split(',') {
            let gpu = match pin.parse::<u32>() {
                Ok(i) => self.inventory.gpus.iter().find(|g| g.index == i),
                Err(_) => self.inventory.gpus.iter().find(|g| g.uuid == pin),
            };
            let Some(gpu) = gpu else {
                return Err(bad(format!(
                    "no GPU {} on this node (`tessera status` lists them)",
                    untrusted(pin).max_chars(128)
                )));
            };
            uuids.push(gpu.uuid.clone());
        }
        if uuids.len() != count as usize {
            return Err(bad(format!("{} GPUs pinned for gpu={count}", uuids.len())));
        }
        PluginAssignment::new(RESOURCE_GPU, uuids).map(Some).map_err(|e| bad(e.to_string()))
    }

    fn asker<'a>(&self, req: &'a AllocateRequest, c: &'a Checked) -> grant::Asker<'a> {
        grant::Asker {
            req,
            request: &req.request,
            tenant: &c.tenant.path,
            trust: c.tenant.trust,
            workload: c.workload.clone(),
            class: Some(c.class),
            workload_key: Some(c.workload_key.clone()),
        }
    }

    /// The plan of a checked request (on kubelet's devices where it assigned them).
    fn plan_checked(
        &self,
        req: &AllocateRequest,
        c: &Checked,
    ) -> Result<grant::GrantPlan, CoreError> {
        let who = self.asker(req, c);
        match (&c.assigned, &c.pinned) {
            (Some(a), _) => self.plan_assigned(&who, a.assignment(), Pick::Kubelet),
            (None, Some(p)) => self.plan_assigned(&who, p, Pick::Pinned),
            (None, None) => {
                // A hardened victim gets the MIG instance or whole GPU if the node has one
                // free, else what it asked for.
                if let Some(h) = &c.hardened {
                    let hardened = grant::Asker { request: h, ..who.clone() };
                    match self.plan_grant(&hardened) {
                        Err(e) if e.code() == ErrorCode::NoCapacity => {}
                        other => return other,
                    }
                }
                self.plan_grant(&who)
            }
        }
    }

    fn record_no_capacity(&mut self, req: &AllocateRequest, err: &CoreError) {
        if err.code() == ErrorCode::NoCapacity {
            self.record_refusal(&req.container_id, err);
        }
    }

    /// Make a planned grant (recording kubelet's assignment and the use of its token
    /// first, where there is one: checked in this same lock section).
    fn commit_checked(
        &mut self,
        req: &AllocateRequest,
        c: &Checked,
        plan: grant::GrantPlan,
    ) -> Result<Allocation, CoreError> {
        if let Some(a) = &c.assigned {
            self.bind_token(req, a)?;
            self.record_assignment(&req.container_id, a.assignment())?;
        }
        let a = self.apply_grant(plan)?;
        if a.isolation != req.request.isolation() {
            self.hardened_granted(&a, &c.workload_key);
        }
        Ok(a)
    }

    /// The first step of a grant under the fleet's quotas: the checks and the plan. Where
    /// no quota applies (`mode` off, or a policy without quotas), the grant is made here.
    /// Otherwise the answer says what to ask; a request this node cannot place asks with
    /// `short_on_node` (it may reclaim borrowed work here), unless no GPU of this node
    /// could ever serve it.
    pub(crate) fn prepare_allocate(
        &mut self,
        req: &AllocateRequest,
        mode: QuotaMode,
    ) -> Result<Prepared, CoreError> {
        let checked = match self.check_allocate(req)? {
            Resolved::Existing(a) => return Ok(Prepared::Granted(a)),
            Resolved::New(c) => *c,
        };
        if mode == QuotaMode::Off || !self.policy.policy.has_quotas() {
            let plan = self
                .plan_checked(req, &checked)
                .inspect_err(|e| self.record_no_capacity(req, e))?;
            return self
                .commit_checked(req, &checked, plan)
                .map(|a| Prepared::Granted(Box::new(a)));
        }
        match self.plan_checked(req, &checked) {
            Ok(plan) => {
                let admit = self.admit_request(req, &checked, Some(&plan), false)?;
                Ok(Prepared::Ask(Box::new(self.ask_of(req, admit, None))))
            }
            Err(e) if e.code() == ErrorCode::NoCapacity => {
                let admit = match self.admit_request(req, &checked, None, true) {
                    Ok(a) => a,
                    Err(_) => {
                        // Nothing here could serve it: the node's own refusal stands.
                        self.record_no_capacity(req, &e);
                        return Err(e);
                    }
                };
                Ok(Prepared::Ask(Box::new(self.ask_of(req, admit, Some(e)))))
            }
            Err(e) => {
                self.record_no_capacity(req, &e);
                Err(e)
            }
        }
    }

    fn ask_of(
        &self,
        req: &AllocateRequest,
        admit: fleet::quota_wire::AdmitRequest,
        no_capacity: Option<CoreError>,
    ) -> QuotaAsk {
        QuotaAsk {
            admit,
            tree: self.policy.policy.quotas().clone(),
            gang_timeout_s: self.policy.policy.gang_timeout_s(),
            request: req.request.clone(),
            no_capacity,
        }
    }

    /// What to ask the coordinator for `req`: its amounts (on the planned devices, or,
    /// without a plan, on the model this node has most of for it), its gang, its limits.
    /// A malformed gang annotation or limit is refused (and recorded).
    fn admit_request(
        &mut self,
        req: &AllocateRequest,
        c: &Checked,
        plan: Option<&grant::GrantPlan>,
        short_on_node: bool,
    ) -> Result<fleet::quota_wire::AdmitRequest, CoreError> {
        let bad = |node: &mut Node, e: quota_gate::QuotaError, rule: &str| {
            let err = CoreError::BadRequest(Detail {
                message: format!("container {}: {e}", req.container_id),
                tenant: Some(c.tenant.path.to_string()),
                request: Some(req.request.to_string()),
                rule: Some(rule.to_string()),
            });
            node.record_refusal(&req.container_id, &err);
            err
        };
        let gang = quota_gate::gang_of(&req.annotations).map_err(|e| bad(self, e, "gang"))?;
        let checkpoint =
            quota_gate::checkpoints(&req.annotations).map_err(|e| bad(self, e, "preemption"))?;
        let limits =
            quota_gate::checked_limits(req.limits.as_ref()).map_err(|e| bad(self, e, "limits"))?;
        quota_gate::require_limits(self.policy.policy.quotas(), &c.tenant.path, &limits)
            .map_err(|e| bad(self, e, "limits"))?;
        let models: Vec<String> = match plan {
            Some(p) => self.planned_models(p),
            None => {
                let m =
                    quota_gate::likely_model(&self.inventory, &req.request).ok_or_else(|| {
                        CoreError::no_capacity("no GPU of this node serves the request")
                    })?;
                vec![m; quota_gate::device_count(&req.request)]
            }
        };
        let refs: Vec<&str> = models.iter().map(String::as_str).collect();
        let weight = match &req.request {
            tessera_api::GpuRequest::Mig { profile } => self.policy.policy.mig_weight(profile),
            _ => None,
        };
        let gpus = quota_gate::gpu_amounts(
            &req.request,
            &refs,
            self.policy.policy.shared_replicas(),
            weight,
        )
        .map_err(|e| CoreError::internal(e.to_string()))?;
        Ok(fleet::quota_wire::AdmitRequest {
            container_id: req.container_id.to_string(),
            tenant: c.tenant.path.to_string(),
            amounts: quota_gate::amounts(&gpus, &limits),
            gang,
            short_on_node,
            checkpoint,
            workload: c.workload.as_ref().map(|w| w.display_name()),
            // The gate says (it knows what this node admitted alone).
            unsynced_lease_grants: false,
        })
    }

    /// The catalog model of each device a plan holds.
    fn planned_models(&self, plan: &grant::GrantPlan) -> Vec<String> {
        use grant::Acquire;
        match &plan.acquire {
            Acquire::Devices(d) => d.iter().map(|d| d.model.clone()).collect(),
            Acquire::CutMig { gpu_index, .. } => self
                .inventory
                .gpus
                .iter()
                .filter(|g| g.index == *gpu_index)
                .map(|g| g.model.clone())
                .collect(),
            Acquire::Mps { device, .. } | Acquire::Shared { device, .. } => {
                vec![device.model.clone()]
            }
        }
    }

    /// The second step: the checks and the plan again on the state of now, then the grant
    /// with its quota mark. What the coordinator admitted (`asked`) must still be what the
    /// grant counts as (a policy or plan that changed meanwhile is a conflict: ask again).
    /// Under a lease ([`Admission::Lease`]), the lease is checked here, on this node's
    /// holdings of now, so two requests cannot both take its last part.
    pub(crate) fn finish_allocate(
        &mut self,
        req: &AllocateRequest,
        asked: &fleet::quota_wire::AdmitRequest,
        admission: &Admission<'_>,
    ) -> Result<Allocation, CoreError> {
        let checked = match self.check_allocate(req)? {
            Resolved::Existing(a) => return Ok(*a),
            Resolved::New(c) => *c,
        };
        let plan =
            self.plan_checked(req, &checked).inspect_err(|e| self.record_no_capacity(req, e))?;
        if !self.policy.policy.has_quotas() {
            // The policy dropped its quotas meanwhile: a grant as without them.
            return self.commit_checked(req, &checked, plan);
        }
        let now = self.admit_request(req, &checked, Some(&plan), false)?;
        if now.tenant != asked.tenant || now.amounts != asked.amounts || now.gang != asked.gang {
            let err = CoreError::Conflict(Detail {
                message: format!(
                    "container {}: the grant changed while the coordinator admitted it (tenant {} with {:?} \
                     admitted, tenant {} with {:?} now); ask again",
                    req.container_id, asked.tenant, asked.amounts, now.tenant, now.amounts
                ),
                tenant: Some(now.tenant.clone()),
                request: Some(req.request.to_string()),
                rule: Some("quotas".into()),
            });
            self.record_refusal(&req.container_id, &err);
            return Err(err);
        }
        let (class, over, lease_mark) = match admission {
            Admission::Fleet { class, over } => (*class, over.clone(), None),
            Admission::Lease { leases, since_ms, why } => {
                // What it holds, and what it has asked the coordinator for and not settled
                // (the books may count that within this node's lease); marked unsynced
                // before that is read, so an ask missed here says so (docs/QUOTAS.md).
                let mut guaranteed_here = self.guaranteed_here()?;
                let before = leases.lease_grant_begins(req.container_id.as_str());
                guaranteed_here.extend(leases.asked_here(req.container_id.as_str()));
                let tree = self.policy.policy.quotas();
                let request = now.amounts.to_resources();
                let verdict = leases.with_leases(|held| {
                    quota_gate::lease_admits(tree, &now.tenant, &request, held, &guaranteed_here)
                });
                if let Err(why_not) = verdict {
                    leases.lease_grant_abandoned(req.container_id.as_str(), before);
                    let err = CoreError::Refused(Detail {
                        message: format!(
                            "tenant {} asks for {request}: the quota coordinator is unreachable since {} ({}), and \
                             while it is, this node admits only work within guarantees its lease covers: {why_not}",
                            now.tenant,
                            tessera_api::time::format_utc(*since_ms),
                            untrusted(why).max_chars(256),
                        ),
                        tenant: Some(now.tenant.clone()),
                        request: Some(req.request.to_string()),
                        rule: Some("quotas".into()),
                    });
                    self.record_refusal(&req.container_id, &err);
                    return Err(err);
                }
                (QuotaClass::Guaranteed, None, Some((leases, before)))
            }
        };
        let mark = QuotaMark {
            class,
            over,
            under_lease: lease_mark.is_some(),
            gpus: now.amounts.gpus.clone(),
            cpu_milli: now.amounts.cpu_milli,
            memory_mib: now.amounts.memory_mib,
            gang: now.gang.as_ref().map(|g| g.name.clone()),
            checkpoint: now.checkpoint,
        };
        let mut plan = plan;
        plan.quota = Some(Box::new(mark));
        #[cfg(test)]
        if let Some((leases, _)) = lease_mark {
            leases.committing();
        }
        // A grant under the lease stays marked unsynced from its decision on (under the node
        // lock, with the grant: a sync's snapshot is before or after both); undone if the
        // commit fails.
        self.commit_checked(req, &checked, plan).inspect_err(|_| {
            if let Some((leases, before)) = lease_mark {
                leases.lease_grant_abandoned(req.container_id.as_str(), before);
            }
        })
    }

    /// Record a refusal the fleet's quotas decided (the coordinator's, a reclaim's). A
    /// container answered "reclaiming" again within [`super::RECLAIM_EVENT_EVERY`] of the
    /// last one recorded is not recorded again: tessera-runtime asks every 0.5 to 2 s
    /// while its reclaim runs (`quota_wait_s`), and each record is a synced write.
    pub(crate) fn record_quota_refusal(&mut self, container_id: &str, err: &CoreError) {
        let now = std::time::Instant::now();
        let every = super::RECLAIM_EVENT_EVERY;
        self.reclaim_refusals.retain(|_, at| now.duration_since(*at) < every);
        if matches!(err, CoreError::Reclaiming(_)) {
            if self.reclaim_refusals.contains_key(container_id) {
                return;
            }
            self.reclaim_refusals.insert(container_id.to_string(), now);
        } else {
            self.reclaim_refusals.remove(container_id);
        }
        self.record_refusal(container_id, err);
    }
}
