//! Grants on the devices kubelet chose: a container whose annotations carry the device
//! plugin's assignment ([`ASSIGNMENT_ANNOTATION`], written by the plugin's `Allocate`)
//! gets its grant on exactly those devices, or is refused naming the device that is not
//! free, not on this node or not grantable to it. The assignment is honoured only with a
//! token this node's `Allocate` issued for exactly those ids (`tokens.rs`): one a config
//! author wrote, or one replayed by another container, is refused before anything is
//! planned or recorded. The policy decides first, as for every
//! request (identity, tier, node pool: `allocate.rs`); then, instead of choosing devices,
//! the plan takes the assigned ones through the same pure checks as a chosen one
//! (`mpsd::pick_mps_device` and `mpsd::pick_shared_device` over that one device, the
//! catalog's layout rules for a MIG cut). A MIG placement whose cut would destroy idle
//! instances is refused while a plain `mig=<profile>` request would destroy nothing (it
//! would reuse a free instance of the profile, or cut on free slots): kubelet's choice
//! never costs the node an instance a plain request would have left.
//!
//! Which ids kubelet holds is kept beside the state database
//! (`device-plugin-assignments.json`: container id → assignment), written before the
//! grant is applied: an entry whose grant never came is ignored (only live grants count)
//! and dropped at the next write. The device plugin reads it through
//! [`Node::capacity`](super::Node::capacity): kubelet's ids stay healthy in its lists.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use slicer::Found;
use tessera_api::deviceplugin::{
    DeviceId, IssuedAssignment, PluginAssignment, PluginResource, ASSIGNMENT_ANNOTATION,
};
use tessera_api::{AllocateRequest, Allocation};
use tracing::warn;

use super::grant::{Acquire, Asker, GrantPlan};
use super::{internal, Node};
use crate::error::{CoreError, Detail};
use crate::share::{self, DeviceUse};

/// The file of kubelet's assignments, beside `state.db`.
pub const ASSIGNMENTS_FILE: &str = "device-plugin-assignments.json";

/// Whether grant `g` holds what assignment `a` names: its request, and its devices (the
/// GPUs; the instance, or one cut at the placement; the GPU of the MPS share or replica).
pub fn granted_as(a: &PluginAssignment, g: &Allocation) -> bool {
    if a.request().ok().as_ref() != Some(&g.request) {
        return false;
    }
    let ids = a.devices();
    match (a.plugin_resource(), ids.as_slice()) {
        (PluginResource::Gpu, _) => {
            let held: BTreeSet<String> = g.devices.iter().map(|d| d.uuid.to_string()).collect();
            held == ids.iter().map(ToString::to_string).collect()
        }
        (PluginResource::Mig(_), [DeviceId::Instance(u)]) => {
            matches!(g.devices.as_slice(), [d] if d.uuid == u.as_str())
        }
        (PluginResource::Mig(_), [DeviceId::Placement { gpu, profile, start }]) => {
            matches!(g.devices.as_slice(), [d] if d.gpu_uuid == gpu.as_str()
                && d.mig_profile.as_deref() == Some(profile.as_str())
                && d.placement.map(|(s, _)| s) == Some(*start))
        }
        (PluginResource::Mps | PluginResource::Shared, [first, ..]) => {
            g.share.as_ref().is_some_and(|s| first.gpu().is_some_and(|u| s.device == u.as_str()))
        }
        _ => false,
    }
}

/// Who chose the devices of a grant planned on exactly them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pick {
    /// kubelet, through the device plugin's `Allocate` (and its token).
    Kubelet,
    /// The container's author, pinning GPUs (`docker --gpus '"device=…"'`).
    Pinned,
}

impl Node {
    fn assignments_path(&self) -> PathBuf {
        self.store.path().with_file_name(ASSIGNMENTS_FILE)
    }

    /// Container id → assignment text, as recorded (empty when there is no file; an
    /// unreadable file is reported and read as empty: kubelet's ids then count as taken
    /// outside kubelet, which under-advertises and never over-advertises).
    fn recorded_assignments(&self) -> BTreeMap<String, String> {
        let path = self.assignments_path();
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                warn!(path = %path.display(), "unreadable device-plugin assignments: {e}");
                BTreeMap::new()
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(e) => {
                warn!(path = %path.display(), "cannot read the device-plugin assignments: {e}");
                BTreeMap::new()
            }
        }
    }

    /// The assignments of the live grants made through the device plugin: an entry counts
    /// only while its container holds a grant of those very devices (an entry left by a
    /// grant that failed, or by a container id used again, does not).
    pub(super) fn kubelet_assignments(
        &self,
        allocations: &[Allocation],
    ) -> Vec<(String, PluginAssignment)> {
        let live: BTreeMap<&str, &Allocation> =
            allocations.iter().map(|a| (a.container_id.as_str(), a)).collect();
        self.recorded_assignments()
            .into_iter()
            .filter_map(|(cid, text)| {
                let a: PluginAssignment = text.parse().ok()?;
                live.get(cid.as_str()).filter(|g| granted_as(&a, g)).map(|_| (cid, a))
            })
            .collect()
    }

    /// The device-plugin assignment `req` carries, if any, checked: well formed, the same
    /// request as the one asked (tessera-runtime derives the request from it), for a
    /// container that already holds a grant the assignment that grant was made for, and
    /// its token issued here for it and not used by another container
    /// ([`Node::check_token`]). Refusals of the token are recorded as events.
    pub(super) fn plugin_assignment(
        &mut self,
        req: &AllocateRequest,
    ) -> Result<Option<IssuedAssignment>, CoreError> {
        let Some(text) = req.annotations.get(ASSIGNMENT_ANNOTATION) else { return Ok(None) };
        let bad = |message: String| {
            CoreError::BadRequest(Detail {
                message,
                tenant: None,
                request: Some(req.request.to_string()),
                rule: Some(ASSIGNMENT_ANNOTATION.to_string()),
            })
        };
        let issued: IssuedAssignment = match text.parse() {
            Ok(i) => i,
            Err(e) => {
                // A forged one (no token, another version) is worth an event.
                let err = bad(format!(
                    "container {}: annotation {ASSIGNMENT_ANNOTATION}: {e}",
                    req.container_id
                ));
                self.record_refusal(&req.container_id, &err);
                return Err(err);
            }
        };
        let a = issued.assignment().clone();
        let request = a.request().map_err(|e| {
            bad(format!("container {}: annotation {ASSIGNMENT_ANNOTATION}: {e}", req.container_id))
        })?;
        if request != req.request {
            return Err(bad(format!(
                "container {}: the request {} is not what its device-plugin assignment {a} gives ({request})",
                req.container_id, req.request
            )));
        }
        if let Some(existing) = self.store.get(&req.container_id).map_err(internal)? {
            let held = self.kubelet_assignments(std::slice::from_ref(&existing.allocation));
            let made_for = held.into_iter().next().map(|(_, x)| x);
            if made_for.as_ref() != Some(&a) {
                return Err(CoreError::Conflict(Detail {
                    message: format!(
                        "container {} already holds a grant made for {}; refusing device-plugin assignment {a}",
                        req.container_id,
                        made_for.map_or("no device-plugin assignment".to_string(), |x| x.to_string())
                    ),
                    tenant: None,
                    request: Some(req.request.to_string()),
                    rule: Some(ASSIGNMENT_ANNOTATION.to_string()),
                }));
            }
        }
        self.check_token(req, &issued)?;
        Ok(Some(issued))
    }

    /// Records that `container_id`'s grant is made for `a` (before the grant is applied),
    /// dropping the entries of containers that hold no grant.
    pub(super) fn record_assignment(
        &mut self,
        container_id: &str,
        a: &PluginAssignment,
    ) -> Result<(), CoreError> {
        let allocations = self.allocations()?;
        let kept: BTreeSet<String> =
            self.kubelet_assignments(&allocations).into_iter().map(|(cid, _)| cid).collect();
        let mut map = self.recorded_assignments();
        map.retain(|cid, _| kept.contains(cid));
        map.insert(container_id.to_string(), a.to_string());
        let path = self.assignments_path();
        let write = || -> std::io::Result<()> {
            let json = serde_json::to_vec_pretty(&map).map_err(std::io::Error::other)?;
            tessera_api::durable::replace(&path, &json, 0o600, tessera_api::durable::Sync::Durable)
        };
        write().map_err(|e| {
            CoreError::internal(format!(
                "tesserad: recording the device-plugin assignment in {}: {e}",
                path.display()
            ))
        })
    }

    /// Plans a grant on exactly the devices of `a` (see the module documentation), which
    /// `pick` says who chose.
    /// Changes nothing; a refusal names the device.
    pub(super) fn plan_assigned(
        &self,
        who: &Asker<'_>,
        a: &PluginAssignment,
        pick: Pick,
    ) -> Result<GrantPlan, CoreError> {
        let tenant = who.tenant;
        let allocations = self.allocations()?;
        let mut device_use = DeviceUse::of(&allocations);
        let life = self.lifecycle()?;
        // The same exclusions as a plain request's: the device's state, and where others
        // run (an NVLink domain another tenant holds a GPU of, anti-affine co-tenants).
        let super::grant::Excluded { blocked, fenced } = self.excluded_for(&life, who)?;
        device_use.exclusive.extend(blocked.iter().cloned());
        device_use.exclusive.extend(fenced.iter().cloned());
        // What a plain request may not touch (as `plan_grant` counts it).
        let mut untouchable = device_use.busy();
        untouchable.extend(life.keys().cloned());
        let (what, rule) = match pick {
            Pick::Kubelet => ("device-plugin device", ASSIGNMENT_ANNOTATION),
            Pick::Pinned => ("pinned GPU", tessera_api::PINNED_ANNOTATION),
        };
        let refuse = |id: &str, why: String| {
            CoreError::NoCapacity(Detail {
                message: format!("tenant {tenant}: {what} {id} ({}): {why}", a.resource()),
                tenant: Some(tenant.to_string()),
                request: Some(who.request.to_string()),
                rule: Some(rule.to_string()),
            })
        };
        // Ids another live kubelet grant holds (MPS percent and replicas are not devices:
        // only the ids tell them apart).
        let theirs: BTreeSet<String> = self
            .kubelet_assignments(&allocations)
            .into_iter()
            .filter(|(cid, _)| cid != who.req.container_id.as_str())
            .flat_map(|(_, x)| x.device_ids().to_vec())
            .collect();
        if let Some(id) = a.device_ids().iter().find(|id| theirs.contains(*id)) {
            return Err(refuse(
                id,
                "kubelet assigned it to another container that holds it".into(),
            ));
        }
        let in_use = |uuid: &str| -> Option<String> {
            let why = if blocked.contains(uuid) {
                match life.get(uuid) {
                    Some((st, _)) => super::lifecycle_detail(st),
                    None => self.hold_detail(uuid).unwrap_or_else(|| "not available".to_string()),
                }
            } else if fenced.contains(uuid) {
                "kept from this tenant by where others run (topology.isolate_nvlink_domains, \
                 interference anti-affinity)"
                    .to_string()
            } else if device_use.exclusive.contains(uuid) {
                "in use by another container".to_string()
            } else if device_use.mps.contains_key(uuid) {
                "serving MPS shares".to_string()
            } else if device_use.shared.contains_key(uuid) {
                "time-sliced".to_string()
            } else {
                return None;
            };
            Some(why)
        };
        let devices = a.devices();
        let first = devices.first().ok_or_else(|| refuse("-", "no device".into()))?;
        let acquire = match a.plugin_resource() {
            PluginResource::Gpu => {
                let mut granted = Vec::new();
                for d in &devices {
                    let id = d.to_string();
                    match self.inventory.find(&id) {
                        Some(Found::Gpu(g)) if !g.mig_enabled => {}
                        Some(Found::Gpu(_)) => {
                            return Err(refuse(
                                &id,
                                "the GPU is in MIG mode: it is handed out only by instance".into(),
                            ))
                        }
                        _ => return Err(refuse(&id, "no such GPU on this node".into())),
                    }
                    if let Some(why) = in_use(&id) {
                        return Err(refuse(&id, why));
                    }
                    granted.push(self.granted_device(&id)?);
                }
                Acquire::Devices(granted)
            }
            PluginResource::Mig(profile) => {
                let id = first.to_string();
                let instance = match first {
                    DeviceId::Instance(u) => Some(u.to_string()),
                    DeviceId::Placement { gpu, profile: p, start } => {
                        let g = self
                            .inventory
                            .gpus
                            .iter()
                            .find(|g| g.uuid == gpu.as_str() && g.mig_enabled)
                            .ok_or_else(|| {
                                refuse(&id, "no GPU in MIG mode with that uuid on this node".into())
                            })?;
                        match g.instances.iter().find(|i| i.profile == *p && i.start == *start) {
                            Some(i) => Some(i.uuid.clone()),
                            None => {
                                let (destroy, gpu_index) = self
                                    .assigned_cut(g, p, *start, &in_use, &untouchable)
                                    .map_err(|why| refuse(&id, why.to_string()))?;
                                return self.finish_plan(
                                    who,
                                    &life,
                                    Acquire::CutMig {
                                        profile: profile.clone(),
                                        gpu_index,
                                        start: *start,
                                        destroy,
                                    },
                                    Some(profile.clone()),
                                );
                            }
                        }
                    }
                    _ => None,
                };
                let uuid = instance.ok_or_else(|| refuse(&id, "not a MIG device".into()))?;
                match self.inventory.find(&uuid) {
                    Some(Found::Mig(g, i)) if i.profile == profile => {
                        if let Some(why) = in_use(&g.uuid) {
                            return Err(refuse(&id, format!("its GPU {} is {why}", g.uuid)));
                        }
                    }
                    Some(Found::Mig(_, i)) => {
                        return Err(refuse(
                            &id,
                            format!("the instance is a {}, not a {profile}", i.profile),
                        ))
                    }
                    _ => return Err(refuse(&id, "no such MIG instance on this node".into())),
                }
                if let Some(why) = in_use(&uuid) {
                    return Err(refuse(&id, why));
                }
                Acquire::Devices(vec![self.granted_device(&uuid)?])
            }
            PluginResource::Mps => {
                let (id, gpu) =
                    (first.to_string(), first.gpu().map(|g| g.to_string()).unwrap_or_default());
                self.whole_gpu(&gpu).map_err(|why| refuse(&id, why.to_string()))?;
                let percent = match who.request {
                    tessera_api::GpuRequest::Mps { percent } => *percent,
                    other => return Err(refuse(&id, format!("the request is {other}, not mps"))),
                };
                if device_use.exclusive.contains(&gpu) || device_use.shared.contains_key(&gpu) {
                    return Err(refuse(&id, in_use(&gpu).unwrap_or_default()));
                }
                self.plan_mps(tenant, who, percent, &device_use, Some(&gpu))
                    .map_err(|e| refuse(&id, e.message()))?
            }
            PluginResource::Shared => {
                let (id, gpu) =
                    (first.to_string(), first.gpu().map(|g| g.to_string()).unwrap_or_default());
                self.whole_gpu(&gpu).map_err(|why| refuse(&id, why.to_string()))?;
                if device_use.exclusive.contains(&gpu) || device_use.mps.contains_key(&gpu) {
                    return Err(refuse(&id, in_use(&gpu).unwrap_or_default()));
                }
                self.plan_shared(tenant, &device_use, Some(&gpu))
                    .map_err(|e| refuse(&id, e.message()))?
            }
        };
        self.finish_plan(who, &life, acquire, None)
    }

    fn granted_device(&self, uuid: &str) -> Result<tessera_api::GrantedDevice, CoreError> {
        share::granted(&self.inventory, uuid).ok_or_else(|| {
            CoreError::internal(format!("device {uuid} vanished from the inventory"))
        })
    }

    /// `Ok` when `uuid` is a GPU of this node in MIG-off mode.
    fn whole_gpu(&self, uuid: &str) -> Result<(), Unassignable> {
        match self.inventory.find(uuid) {
            Some(Found::Gpu(g)) if !g.mig_enabled => Ok(()),
            Some(Found::Gpu(_)) => Err(Unassignable::MigMode),
            _ => Err(Unassignable::NoSuchGpu),
        }
    }

    /// A cut of `profile` at `start` on `g` for kubelet's placement id: allowed where MIG
    /// is dynamic, when every instance in its slots is idle (they are destroyed for it),
    /// the layout left is legal, and, where it destroys any, a plain `mig=<profile>`
    /// request would have to destroy too ([`plain_would_keep`]; `untouchable`: what a plain
    /// request may not take or destroy). The idle instances to destroy and the GPU index.
    fn assigned_cut(
        &self,
        g: &slicer::Gpu,
        profile: &str,
        start: u8,
        in_use: &dyn Fn(&str) -> Option<String>,
        untouchable: &BTreeSet<String>,
    ) -> Result<(Vec<String>, u32), Unassignable> {
        if !self.mig_is_dynamic() {
            return Err(Unassignable::DeclaredLayout);
        }
        let model =
            slicer::model(&g.model).ok_or_else(|| Unassignable::UnknownModel(g.model.clone()))?;
        let p = model.profile(profile).ok_or_else(|| Unassignable::NoProfile {
            model: model.name.to_string(),
            profile: profile.to_string(),
        })?;
        let end = start.saturating_add(p.size);
        let (overlapping, kept): (Vec<&slicer::MigInstance>, Vec<&slicer::MigInstance>) = g
            .instances
            .iter()
            .partition(|i| i.start < end && start < i.start.saturating_add(i.size));
        for i in &overlapping {
            if let Some(why) = in_use(&i.uuid) {
                return Err(Unassignable::InUse {
                    uuid: i.uuid.clone(),
                    profile: i.profile.clone(),
                    start: i.start,
                    why,
                });
            }
        }
        let mut layout: Vec<(&str, u8)> =
            kept.iter().map(|i| (i.profile.as_str(), i.start)).collect();
        layout.push((p.name, start));
        slicer::catalog::placement_is_legal(model, &layout)?;
        if let (Some(first), Some(plain)) =
            (overlapping.first(), plain_would_keep(&self.inventory, untouchable, profile))
        {
            return Err(Unassignable::WouldDestroy {
                uuid: first.uuid.clone(),
                profile: first.profile.clone(),
                start: first.start,
                wanted: profile.to_string(),
                plain,
            });
        }
        Ok((overlapping.iter().map(|i| i.uuid.clone()).collect(), g.index))
    }
}

/// Why the device kubelet assigned cannot be given as assigned (the reason of a refusal
/// that names the device).
#[derive(Debug, thiserror::Error)]
enum Unassignable {
    #[error("the GPU is in MIG mode")]
    MigMode,
    #[error("no such GPU on this node")]
    NoSuchGpu,
    #[error("MIG layouts are declared for this node: instances are not cut on demand")]
    DeclaredLayout,
    #[error("the catalog does not know GPU model {0}")]
    UnknownModel(String),
    #[error("{model} offers no MIG profile {profile}")]
    NoProfile { model: String, profile: String },
    #[error("instance {uuid} ({profile} at slot {start}) in its slots is {why}")]
    InUse { uuid: String, profile: String, start: u8, why: String },
    #[error(transparent)]
    Layout(#[from] slicer::LayoutError),
    #[error(
        "cutting it would destroy idle instance {uuid} ({profile} at slot {start}), while a plain \
         mig={wanted} request would {plain}: a kubelet placement never destroys an instance a plain \
         request would leave"
    )]
    WouldDestroy { uuid: String, profile: String, start: u8, wanted: String, plain: String },
}

/// What a plain `mig=<profile>` request would do here without destroying any instance
/// (reuse a free instance of the profile, or cut on free slots), in words; `None` when it
/// too would have to destroy idle instances (or cannot be placed at all). `untouchable`:
/// the devices a plain request may not take or destroy.
pub fn plain_would_keep(
    inventory: &slicer::Inventory,
    untouchable: &BTreeSet<String>,
    profile: &str,
) -> Option<String> {
    let any = slicer::DemandMix::from_weights(std::iter::empty::<(String, f64)>(), 1.0);
    match slicer::place(inventory, untouchable, profile, slicer::Strategy::FirstFit, &any) {
        Ok(slicer::PlaceDecision::Reuse { uuid }) => Some(format!("reuse free instance {uuid}")),
        Ok(slicer::PlaceDecision::Create { gpu_index, start }) => {
            Some(format!("cut one on free slots (GPU {gpu_index}, slot {start})"))
        }
        Ok(slicer::PlaceDecision::Defragment { .. }) | Err(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_api::{GrantedDevice, Injection, Isolation, ShareGrant};

    fn device(uuid: &str, gpu: &str, mig: Option<(&str, u8)>) -> GrantedDevice {
        GrantedDevice {
            uuid: uuid.parse().expect("uuid"),
            gpu_uuid: gpu.parse().expect("uuid"),
            gpu_index: 0,
            model: "H100-80GB".into(),
            mig_profile: mig.map(|(p, _)| p.into()),
            placement: mig.map(|(_, s)| (s, 1)),
        }
    }

    fn grant(request: &str, devices: Vec<GrantedDevice>, share: Option<&str>) -> Allocation {
        let request: tessera_api::GpuRequest = request.parse().expect("request");
        Allocation {
            container_id: "c".parse().expect("valid"),
            tenant: "t".parse().expect("valid"),
            trust: "dev".parse().expect("valid"),
            isolation: request.isolation(),
            request,
            devices,
            injection: Injection::default(),
            state: tessera_api::AllocationState::Running,
            pid: None,
            created_ms: 0,
            share: share.map(|d| ShareGrant {
                kind: Isolation::Mps,
                device: d.into(),
                percent: None,
                mem_limit_bytes: None,
                domain: None,
                replicas: None,
            }),
            workload: None,
            quota: None,
            nvlink_domain: None,
            topology: None,
            class: None,
        }
    }

    fn a(text: &str) -> PluginAssignment {
        text.parse().expect("assignment")
    }

    #[test]
    fn an_entry_counts_only_for_the_grant_of_its_devices() {
        let gpus = grant(
            "gpu=2",
            vec![device("GPU-a", "GPU-a", None), device("GPU-b", "GPU-b", None)],
            None,
        );
        assert!(granted_as(&a("v1;tessera.io/gpu;GPU-b,GPU-a"), &gpus));
        assert!(!granted_as(&a("v1;tessera.io/gpu;GPU-a,GPU-c"), &gpus), "other GPUs");
        assert!(!granted_as(&a("v1;tessera.io/gpu;GPU-a"), &gpus), "another request");
        let cut = grant("mig=1g.10gb", vec![device("MIG-1", "GPU-m", Some(("1g.10gb", 3)))], None);
        assert!(granted_as(&a("v1;tessera.io/mig-1g.10gb;GPU-m:mig:1g.10gb:3"), &cut));
        assert!(granted_as(&a("v1;tessera.io/mig-1g.10gb;MIG-1"), &cut));
        assert!(!granted_as(&a("v1;tessera.io/mig-1g.10gb;GPU-m:mig:1g.10gb:4"), &cut));
        assert!(!granted_as(&a("v1;tessera.io/mig-1g.10gb;MIG-2"), &cut));
        let mps = grant("mps=2", vec![device("GPU-a", "GPU-a", None)], Some("GPU-a"));
        assert!(granted_as(&a("v1;tessera.io/mps;GPU-a:mps:7,GPU-a:mps:9"), &mps));
        assert!(!granted_as(&a("v1;tessera.io/mps;GPU-b:mps:7,GPU-b:mps:9"), &mps));
        // A container id used again by a grant made without kubelet: not kubelet's.
        let plain = grant("gpu=1", vec![device("GPU-a", "GPU-a", None)], None);
        assert!(!granted_as(&a("v1;tessera.io/mps;GPU-a:mps:0"), &plain));
    }
}
