//! `allocate`: parse the request, resolve the tenant, authorise, then plan and apply the
//! grant ([`super::grant`]). Idempotent by container id.

use super::{grant, internal, validate_abs_path, Node};
use tessera_api::{untrusted, AllocateRequest, Allocation, ApiError, ErrorCode};

impl Node {
    /// Grant (or return the existing grant of) a container's GPU share.
    pub fn allocate(&mut self, req: &AllocateRequest) -> Result<Allocation, ApiError> {
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
                return Ok(a);
            }
            return Err(ApiError {
                code: ErrorCode::Conflict,
                message: format!(
                    "container {} already holds a grant for {} from bundle {}; refusing {} from {}",
                    req.container_id,
                    a.request,
                    untrusted(&existing.bundle),
                    request,
                    untrusted(&req.bundle)
                ),
                tenant: Some(a.tenant),
                request: Some(request.to_string()),
                rule: None,
            });
        }

        // Which pod container asks (containerd's own annotations), and the bare form's
        // one-application-container rule.
        let workload = self.pod_container(req)?;

        let tenant = self.policy.policy.resolve_identity(&req.annotations).map_err(|e| {
            let err = ApiError {
                code: ErrorCode::UnknownTenant,
                message: e.to_string(),
                tenant: None,
                request: Some(request.to_string()),
                rule: Some("identity".into()),
            };
            self.record_refusal(&req.container_id, &err);
            err
        })?;

        if let Err(refusal) = self.policy.policy.authorize(&tenant, request, &self.inventory.node) {
            let err = ApiError {
                code: ErrorCode::Refused,
                message: refusal.to_string(),
                tenant: Some(refusal.tenant.clone()),
                request: Some(refusal.request.clone()),
                rule: Some(refusal.rule.clone()),
            };
            self.record_refusal(&req.container_id, &err);
            return Err(err);
        }

        let who = grant::Asker {
            req,
            request,
            tenant: &tenant.path,
            trust: tenant.trust.to_string(),
            workload,
        };
        let planned = match &assigned {
            Some(a) => self.plan_assigned(&who, a),
            None => self.plan_grant(&who),
        };
        let plan = planned.inspect_err(|err| {
            if err.code == ErrorCode::NoCapacity {
                self.record_refusal(&req.container_id, err);
            }
        })?;
        if let Some(a) = &assigned {
            self.record_assignment(&req.container_id, a)?;
        }
        self.apply_grant(plan)
    }
}
