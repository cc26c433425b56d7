//! `release`: the API's checked release, the unchecked one for in-process callers, and the
//! one place a grant is dropped (intervals closed, MPS share left, devices marked dirty).

use std::path::Path;

use tessera_api::{untrusted, ContainerId, Isolation, ReleaseRequest};
use tracing::{info, warn};

use super::{internal, ledger_err, Node};
use crate::error::CoreError;
use crate::liveness::CgroupProcs;

impl Node {
    /// Close the container's intervals, then free its devices: in this order a crash in
    /// between leaves a grant whose release is simply retried, never an open interval
    /// for a container that no longer holds anything.
    pub(super) fn drop_allocation(
        &mut self,
        container_id: &str,
        why: &str,
    ) -> Result<bool, CoreError> {
        self.ledger.close_container(container_id, why).map_err(ledger_err)?;
        let Some(rec) = self.store.get(container_id).map_err(internal)? else { return Ok(false) };
        self.forget_requesters(&rec.allocation.container_id);
        let a = &rec.allocation;
        if let Some(s) = a.share.as_ref().filter(|s| s.kind == Isolation::Mps) {
            // The last container of a share stops its control daemon (`quit`).
            if let Err(e) = self.mps.release(&s.device, &a.tenant, container_id) {
                warn!(container = %container_id, "releasing the MPS share failed: {e}");
            }
        }
        // What the container leaves behind is dirty until scrubbed: its own devices, or a
        // shared device once its last container leaves (history unknown: several tenants
        // may have used it, so no tenant skips that scrub).
        let mut left = Vec::new();
        let quarantined: std::collections::BTreeSet<String> = self
            .lifecycle()?
            .into_iter()
            .filter(|(_, (st, _))| matches!(st, scrub::DeviceState::Quarantined { .. }))
            .map(|(u, _)| u)
            .collect();
        match &a.share {
            None => {
                for d in a.devices.iter().filter(|d| !quarantined.contains(d.uuid.as_str())) {
                    let st = scrub::DeviceState::Dirty { last_tenant: a.tenant.to_string() };
                    left.push((d.uuid.to_string(), serde_json::to_string(&st).unwrap_or_default()));
                }
            }
            Some(s) => {
                let others = self.allocations()?.iter().any(|o| {
                    o.container_id != a.container_id
                        && o.share.as_ref().is_some_and(|x| x.device == s.device)
                });
                if !others && !quarantined.contains(&s.device) {
                    let st = scrub::DeviceState::unknown_history();
                    left.push((s.device.clone(), serde_json::to_string(&st).unwrap_or_default()));
                }
            }
        }
        let removed = self.store.remove_leaving(container_id, why, &left).map_err(internal)?;
        if removed && a.class == Some(tessera_api::WorkloadClass::Latency) {
            let report = self.report_file(container_id);
            if let Err(e) = crate::report_fs::remove(&report) {
                warn!(container = %container_id, "removing {}: {e}", report.display());
            }
        }
        if rec.cgroup.is_some() {
            self.write_grant_cgroups();
        }
        if removed && a.quota.is_some() {
            // The coordinator's books learn it from the controller (outside the lock).
            self.quota_released.push(container_id.to_string());
        }
        Ok(removed)
    }

    /// Free a container's devices, unchecked: for callers in this process that know the
    /// container is gone (tests, tools). The API's release is [`Node::release_removed`].
    /// Unknown ids are fine (the hook and the reconciler race).
    pub fn release(&mut self, container_id: &str, why: &str) -> Result<bool, CoreError> {
        // An in-process entry that takes a string: checked here, as the API's edge does.
        tessera_api::validate_container_id(container_id)
            .map_err(|e| CoreError::bad_request(e.to_string()))?;
        let existed = self.drop_allocation(container_id, why)?;
        if existed {
            info!(container = %container_id, why, "released");
        }
        Ok(existed)
    }

    /// The API's release (`DELETE /v1/allocations/{id}`): a caller says container
    /// `container_id` was removed. Only the container the grant was made for can give it
    /// back: a runc root or bundle in `req` other than the recorded ones is refused (a
    /// container of the same id in another root or bundle), and whatever the caller says,
    /// nothing is released while runc still has the container in the recorded root. A
    /// refusal changes nothing, is recorded as a `release-refused` event and answered 409.
    /// Unknown ids are fine (releases race with the reconciler).
    pub fn release_removed(
        &mut self,
        container_id: &ContainerId,
        req: &ReleaseRequest,
    ) -> Result<bool, CoreError> {
        let Some(rec) = self.store.get(container_id).map_err(internal)? else { return Ok(false) };
        let mismatch = |what: &str, asked: &str, recorded: &str| {
            format!(
                "container {container_id}: release asked by the container in {what} {} but the grant belongs to the \
                 container in {what} {}; nothing released",
                untrusted(asked),
                untrusted(recorded)
            )
        };
        let refusal = match (&req.runc_root, &req.bundle) {
            (Some(root), _) if *root != rec.runc_root => Some(mismatch("runc root", root, &rec.runc_root)),
            (_, Some(bundle)) if *bundle != rec.bundle => Some(mismatch("bundle", bundle, &rec.bundle)),
            _ if self.host.runc_state_exists(Path::new(&rec.runc_root), container_id) => Some(format!(
                "container {container_id}: runc still has it in {}; nothing released (a grant is given back once runc \
                 has removed its container)",
                untrusted(&rec.runc_root)
            )),
            // A process left in the grant's cgroup (another container that joined it, a
            // worker of a shared pid namespace) keeps the device rules there: the device
            // stays held until the reconciler sees the cgroup empty.
            _ => rec.cgroup.as_deref().and_then(|cg| {
                cgroup_keeps_the_grant(
                    &format!("container {container_id}: "),
                    cg,
                    &self.host.cgroup_procs(cg),
                )
            }),
        };
        if let Some(message) = refusal {
            // Logged by the controller, with every refused action.
            if let Err(e) = self.store.event("release-refused", Some(container_id), &message) {
                warn!("cannot record a refused release: {e}");
            }
            return Err(CoreError::conflict(message));
        }
        self.release(container_id, "container removed")
    }
}

/// Why a grant whose container runc no longer has stays, if its cgroup `cg` (holding
/// `procs`) keeps it: a process left there keeps the device rules, and a cgroup that
/// cannot be read is not taken for empty. The sentence begins with `lead`.
pub(super) fn cgroup_keeps_the_grant(lead: &str, cg: &str, procs: &CgroupProcs) -> Option<String> {
    match procs {
        CgroupProcs::Count(n) if *n > 0 => Some(format!(
            "{lead}its cgroup {} still holds {n} process(es), which keep its device rules; nothing \
             released (the grant ends once the cgroup is empty)",
            untrusted(cg)
        )),
        CgroupProcs::Unreadable(e) => Some(format!(
            "{lead}cannot tell whether its cgroup {} is empty ({}); nothing released",
            untrusted(cg),
            untrusted(e)
        )),
        _ => None,
    }
}
