//! Pods through containerd's CRI: which pod container asks ([`tessera_api::cri`]), and the
//! rule of the bare `tessera.io/gpu` on a pod. containerd copies a pod's annotations to
//! every container of the pod, so the bare form holds only for a pod with one application
//! container: the first container of a sandbox that asks through it owns it, and any other
//! is refused, naming the per-container form. (The first has its grant already: the runtime
//! cannot know a pod's other containers before they are created.)

use tessera_api::cri::{self, PodContainer, RequestScope, RequestSite, Role, Workload};
use tessera_api::{AllocateRequest, ErrorCode, RequestSource};
use tracing::warn;

use super::Node;
use crate::error::{CoreError, Detail};

impl Node {
    /// The pod container `req` comes from (`None`: not a CRI container, or one whose CRI
    /// annotations are incomplete). Refuses a sandbox, and a second container asking
    /// through the bare pod annotation. Every refusal is recorded as an event.
    pub(super) fn pod_container(
        &mut self,
        req: &AllocateRequest,
    ) -> Result<Option<Workload>, CoreError> {
        let refuse = |node: &mut Node, code: ErrorCode, rule: &str, message: String| {
            let err = CoreError::of(
                code,
                Detail {
                    message,
                    tenant: None,
                    request: Some(req.request.to_string()),
                    rule: Some(rule.to_string()),
                },
            );
            node.record_refusal(&req.container_id, &err);
            err
        };
        let read = PodContainer::from_annotations(&req.annotations);
        if let Ok(Some(pc)) = &read {
            if let Err(e) = self.store.note_workload(&req.container_id, &pc.workload.display_name())
            {
                warn!("cannot note the pod name of {}: {e}", req.container_id);
            }
        }
        // A sandbox never takes a grant, whatever else its annotations say.
        if req.annotations.get(cri::CONTAINER_TYPE).map(String::as_str) == Some(cri::TYPE_SANDBOX) {
            let get = |k: &str| req.annotations.get(k).map_or("?", String::as_str);
            let msg = format!(
                "container {} is the sandbox of pod {}/{}: a pod's sandbox never takes a GPU",
                req.container_id,
                tessera_api::untrusted(get(cri::SANDBOX_NAMESPACE)),
                tessera_api::untrusted(get(cri::SANDBOX_NAME))
            );
            return Err(refuse(self, ErrorCode::BadRequest, "pod", msg));
        }
        // tessera-runtime refuses a config whose CRI annotations are malformed before it
        // asks (fail closed where the request is read). Here they only name the
        // container: a body without a complete set (an earlier wrapper's, a client's own)
        // is served as a container of no pod.
        let pc = match read {
            Ok(Some(pc)) => pc,
            Ok(None) => return Ok(None),
            Err(e) => {
                warn!("container {}: served as no pod's: {e}", req.container_id);
                return Ok(None);
            }
        };
        let Role::Container(name) = pc.role else {
            return Err(CoreError::internal("a sandbox passed the sandbox check"));
        };
        if req.request_source != RequestSource::Annotation {
            return Ok(Some(pc.workload));
        }
        let site = cri::request_site(&req.annotations)
            .map_err(|e| refuse(self, ErrorCode::BadRequest, "pod", e.to_string()))?;
        let RequestSite::Annotation { scope: RequestScope::Pod, key } = site else {
            return Ok(Some(pc.workload));
        };
        // The first container of the pod that asked through the bare form owns it for the
        // pod's life (init containers included): remembered, not read from live grants, so
        // a container that has exited and given its grant back still counts.
        let owner = self
            .store
            .pod_request_owner(&pc.workload.sandbox_id, &name)
            .map_err(super::internal)?;
        if owner != name {
            let msg = format!(
                "`{key}` on pod {pod} applies to a pod with exactly one application container, \
                 but containers `{owner}` and `{name}` both ask through it: annotate each \
                 container that needs a GPU with `{per}` instead",
                pod = pc.workload.pod_name(),
                per = cri::per_container_key("<container-name>"),
            );
            return Err(refuse(self, ErrorCode::Refused, "pod-annotation", msg));
        }
        Ok(Some(pc.workload))
    }
}
