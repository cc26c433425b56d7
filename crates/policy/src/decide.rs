//! The pure decisions: which tenant a container belongs to, and whether that tenant may
//! have a request on a node.

use std::collections::BTreeMap;

use tessera_api::GpuRequest;

use crate::{IdentityError, Policy, Refusal, Tenant};

/// Is `prefix` an ancestor-or-self of `path`, segment-wise? (`acme/re` is not a prefix of
/// `acme/research`.)
pub(crate) fn is_path_prefix(prefix: &str, path: &str) -> bool {
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || rest.starts_with('/'),
        None => false,
    }
}

impl Policy {
    /// The tenant a container belongs to, read ONLY from the annotations named by the
    /// policy's identity rules. The first rule whose annotation is present decides; a
    /// present value that the rule does not map is refused (fail closed). With no such
    /// annotation present, `default_tenant` applies, or the container is refused.
    pub fn resolve_identity(
        &self,
        annotations: &BTreeMap<String, String>,
    ) -> Result<Tenant, IdentityError> {
        let engine = annotations.get(crate::ENGINE_ANNOTATION);
        for (i, rule) in self.identity.iter().enumerate() {
            // A rule limited to engines is not read for a container of another (or none).
            if let Some(engines) = &rule.engines {
                if !engine.is_some_and(|e| engines.contains(e)) {
                    continue;
                }
            }
            let Some(value) = annotations.get(&rule.annotation) else { continue };
            let unmapped = || IdentityError::Unmapped {
                annotation: rule.annotation.clone(),
                value: value.clone(),
                rule: format!("identity[{i}].map"),
            };
            // Targets were checked against the tree at parse time; a miss here would be
            // a bug, and it still fails closed.
            return rule.map.get(value).and_then(|path| self.tenant(path)).ok_or_else(unmapped);
        }
        let tried = || self.identity.iter().map(|r| r.annotation.clone()).collect();
        match &self.default_tenant {
            Some(path) => {
                self.tenant(path).ok_or_else(|| IdentityError::NoIdentity { tried: tried() })
            }
            None => Err(IdentityError::NoIdentity { tried: tried() }),
        }
    }

    /// May this tenant have this kind of request on this node?
    ///
    /// The tenant is looked up in this policy by path, and the policy's trust for it is
    /// used (the `trust` field of the argument is not believed: it may come from an older
    /// policy). Checks, in order: the tenant exists; the request's isolation is in its
    /// tier's `allow` list; every node pool containing `node_name` that restricts its
    /// tenants lists an ancestor-or-self of the tenant.
    pub fn authorize(
        &self,
        tenant: &Tenant,
        request: &GpuRequest,
        node_name: &str,
    ) -> Result<(), Refusal> {
        let refuse = |rule: String, message: String| Refusal {
            tenant: tenant.path.to_string(),
            request: request.to_string(),
            rule,
            message,
        };

        let Some(known) = self.tenant(&tenant.path) else {
            return Err(refuse(
                "orgs".to_string(),
                format!(
                    "tenant {} (trust {}) is not in policy version {} (request {request}): \
                     orgs has no such tenant",
                    tenant.path, tenant.trust, self.version
                ),
            ));
        };
        let trust = known.trust;

        let isolation = request.isolation();
        let allow = self.tiers.allow(trust);
        if !allow.contains(&isolation) {
            let rule = format!("tiers.{trust}.allow");
            let permits: Vec<&str> = allow.iter().map(|i| i.as_str()).collect();
            let message = format!(
                "tenant {} (trust {trust}) may not use {isolation} isolation (request \
                 {request}): {rule} permits {}",
                tenant.path,
                permits.join(", ")
            );
            return Err(refuse(rule, message));
        }

        if let GpuRequest::Mps { percent } = request {
            if *percent > self.mps_max_percent {
                let message = format!(
                    "tenant {} (trust {trust}) asked for {percent}% of a device (request {request}): \
                     mps.max_percent allows at most {}%",
                    tenant.path, self.mps_max_percent
                );
                return Err(refuse("mps.max_percent".to_string(), message));
            }
        }

        for pool in &self.node_pools {
            let Some(allowed) = &pool.tenants else { continue };
            if !pool.nodes.iter().any(|p| p.matches(node_name)) {
                continue;
            }
            if allowed.iter().any(|prefix| is_path_prefix(prefix, &tenant.path)) {
                continue;
            }
            let rule = format!("node_pools.{}.tenants", pool.name);
            let permits =
                if allowed.is_empty() { "no tenant".to_string() } else { allowed.join(", ") };
            let message = format!(
                "tenant {} (trust {trust}) may not use node {node_name} (request {request}): \
                 {rule} permits {permits}",
                tenant.path
            );
            return Err(refuse(rule, message));
        }
        Ok(())
    }
}
