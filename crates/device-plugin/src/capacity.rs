//! What the node can grant, as kubelet counts it: pure functions from a [`Snapshot`] of
//! the node to the device list of every resource name ([`advertise`]), the check of the
//! ids kubelet hands to `Allocate` ([`check_allocate`]) and the preferred choice among
//! available ids ([`preferred`]).
//!
//! # The rules
//!
//! Kubelet's arithmetic is: allocatable = devices listed `Healthy`; free = allocatable less
//! the ids it allocated to live pods. So every id kubelet holds stays listed and `Healthy`
//! (else kubelet would count it twice: once as unhealthy, once as allocated), and every
//! other id is `Healthy` exactly when the node could grant it now:
//!
//! * `tessera.io/gpu`: one id per GPU in MIG-off mode (its uuid); `Healthy` when nothing
//!   uses it and its lifecycle lets anyone have it (not dirty, scrubbing or quarantined).
//! * `tessera.io/mps`: 100 ids per GPU in MIG-off mode (`GPU-…:mps:0..99`), one per
//!   percent; as many are `Healthy` (besides kubelet's) as percent is left on the GPU:
//!   100 on a free GPU, 100 less the shares on a GPU serving MPS, none on a GPU held
//!   otherwise.
//! * `tessera.io/shared`: `replicas` ids per GPU in MIG-off mode (`GPU-…:shared:N`), the
//!   same way: all on a free GPU, the replicas left on a time-sliced GPU, none otherwise.
//! * `tessera.io/mig-<profile>`: every MIG instance of the profile (its uuid, or the
//!   placement id kubelet was given for it before it was cut), `Healthy` when idle; and,
//!   where MIG is dynamic, every placement (`GPU-…:mig:<profile>:<start>`) that could be
//!   cut now: its slots hold only idle instances (destroyed for it) and the instances left
//!   plus the new one form a legal layout (`catalog::placement_is_legal`). A placement
//!   whose cut would destroy an idle instance is listed only while a plain `mig=<profile>`
//!   request would destroy one too: while no idle instance of the profile (which a plain
//!   request reuses) and no placement on free slots (where it cuts) is left on the node.
//!   tesserad refuses such a cut at create as well (`assignment.rs`). A placement
//!   that a cut on the GPU has made impossible is withdrawn (not listed), not unhealthy:
//!   it is no device any more.
//!
//! The ids of one GPU overlap: a free GPU is offered whole, as 100 MPS percent and as its
//! replicas at once, and a MIG GPU's placements overlap each other. As soon as one of
//! them is taken (a grant, or an `Allocate` not yet followed by its grant: a
//! [`Reservation`]), the others are withdrawn or turn `Unhealthy`. Devices taken by grants
//! made outside kubelet (an annotation request, a container of another engine) turn
//! `Unhealthy`: kubelet never counted them as allocated.

use std::collections::{BTreeMap, BTreeSet};

use tessera_api::deviceplugin::{
    DeviceId, PluginAssignment, PluginResource, MAX_REPLICAS, RESOURCE_GPU, RESOURCE_MPS,
    RESOURCE_SHARED,
};
use tessera_api::{untrusted, DeviceUuid};

/// kubelet's word for a device that can be allocated.
pub const HEALTHY: &str = "Healthy";
/// kubelet's word for a device that cannot.
pub const UNHEALTHY: &str = "Unhealthy";

/// MPS ids per GPU: one per percent.
pub const MPS_UNITS: u8 = 100;

/// Which kinds of share some tenant may have on this node (the policy's tiers and node
/// pools): a kind nobody may use is not advertised at all.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Offer {
    pub gpu: bool,
    pub mig: bool,
    pub mps: bool,
    pub shared: bool,
}

/// How a GPU in MIG-off mode is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Usage {
    Free,
    /// Held whole by one grant.
    Exclusive,
    /// Serving MPS shares summing to `percent`.
    Mps {
        percent: u32,
    },
    /// Time-sliced by `used` grants.
    Shared {
        used: u32,
    },
}

/// How a MIG instance is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InstanceUse {
    /// Nobody holds it and it is clean: grantable, and destroyable for a cut.
    Idle,
    /// Held (exclusively or through MPS).
    Busy,
    /// Dirty, being scrubbed or quarantined: neither grantable nor destroyable now.
    Blocked,
}

/// One MIG instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceState {
    pub uuid: String,
    pub profile: String,
    pub start: u8,
    pub size: u8,
    pub usage: InstanceUse,
}

/// One GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuState {
    pub uuid: DeviceUuid,
    /// The catalog model (`H100-80GB`); a model the catalog does not know offers no cuts.
    pub model: String,
    /// Nobody new may have this GPU or any part of it now (its lifecycle: dirty,
    /// scrubbing, quarantined).
    pub blocked: bool,
    pub mig_enabled: bool,
    /// MIG off: how the GPU is used.
    pub usage: Usage,
    /// MIG on: its instances.
    pub instances: Vec<InstanceState>,
    /// The NUMA node of its PCI device, where known: every id of the GPU carries it to
    /// kubelet (`TopologyInfo`), for the topology manager.
    pub numa_node: Option<u32>,
}

/// What the node can grant, as the device plugin needs it; built by tesserad under its
/// lock from the inventory, the grants, the device lifecycles and the policy.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub offer: Offer,
    /// Time-slice replicas per GPU (the policy's `sharing.replicas`).
    pub replicas: u32,
    /// MIG instances are cut on demand here (no declared layout applies): placements are
    /// advertised.
    pub dynamic_mig: bool,
    pub gpus: Vec<GpuState>,
    /// The assignments of the live grants made through the plugin: the ids kubelet holds.
    pub kubelet: Vec<PluginAssignment>,
    /// Assignments whose token a container's create has presented since tesserad started
    /// (granted, or refused after the token was verified): their `Allocate` is answered,
    /// so a reservation of them holds nothing any more (a refused or deleted pod's ids are
    /// back in allocatable at once, not after the reservation's 10 minutes).
    pub presented: Vec<PluginAssignment>,
}

/// An `Allocate` whose grant is not made yet: its ids count as taken.
pub type Reservation = PluginAssignment;

/// One advertised device.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Device {
    pub id: String,
    pub healthy: bool,
    /// The NUMA node of its GPU, where known.
    pub numa: Option<u32>,
}

impl Device {
    /// kubelet's health string.
    pub fn health(&self) -> &'static str {
        if self.healthy {
            HEALTHY
        } else {
            UNHEALTHY
        }
    }
}

/// Resource name -> its devices (per GPU in inventory order, units in numeric order).
pub type Advertised = BTreeMap<String, Vec<Device>>;

/// The device list of every resource this node serves (a resource with no device now is
/// listed empty, so its endpoint stays). `pending`: reservations of `Allocate`s whose
/// grants are not in the snapshot yet. `prefer`: unit ids (MPS percent, replicas) to list
/// healthy first among the free ones (see [`units`]); it changes which, never how many.
pub fn advertise(
    snapshot: &Snapshot,
    pending: &[Reservation],
    prefer: &BTreeSet<String>,
) -> Advertised {
    let (gpus, held) = with_reservations(snapshot, pending);
    let offer = snapshot.offer;
    let mut out = Advertised::new();
    let whole: Vec<&GpuState> = gpus.iter().filter(|g| !g.mig_enabled).collect();
    if !whole.is_empty() {
        if offer.gpu {
            let list = whole
                .iter()
                .map(|g| Device {
                    numa: g.numa_node,
                    id: g.uuid.to_string(),
                    healthy: held.contains(g.uuid.as_str())
                        || (g.usage == Usage::Free && !g.blocked),
                })
                .collect();
            out.insert(RESOURCE_GPU.to_string(), list);
        }
        if offer.mps {
            let list = whole
                .iter()
                .flat_map(|g| {
                    let free = match (g.blocked, g.usage) {
                        (true, _) => 0,
                        (false, Usage::Free) => u32::from(MPS_UNITS),
                        (false, Usage::Mps { percent }) => {
                            u32::from(MPS_UNITS).saturating_sub(percent)
                        }
                        (false, _) => 0,
                    };
                    let ids = (0..MPS_UNITS)
                        .map(|unit| DeviceId::MpsUnit { gpu: g.uuid.clone(), unit }.to_string());
                    units(ids, free, &held, prefer, g.numa_node)
                })
                .collect();
            out.insert(RESOURCE_MPS.to_string(), list);
        }
        if offer.shared {
            let replicas = snapshot.replicas.min(MAX_REPLICAS);
            let list = whole
                .iter()
                .flat_map(|g| {
                    let free = match (g.blocked, g.usage) {
                        (true, _) => 0,
                        (false, Usage::Free) => replicas,
                        (false, Usage::Shared { used }) => replicas.saturating_sub(used),
                        (false, _) => 0,
                    };
                    let ids = (0..replicas).map(|replica| {
                        DeviceId::Replica { gpu: g.uuid.clone(), replica }.to_string()
                    });
                    units(ids, free, &held, prefer, g.numa_node)
                })
                .collect();
            out.insert(RESOURCE_SHARED.to_string(), list);
        }
    }
    if offer.mig {
        let plain = served_without_destroying(&gpus, snapshot.dynamic_mig);
        for g in gpus.iter().filter(|g| g.mig_enabled) {
            mig_devices(g, snapshot.dynamic_mig, &held, &plain, &mut out);
        }
    }
    out
}

/// The MIG profiles a plain `mig=<profile>` request would get without destroying anything:
/// an idle instance of the profile (it is reused) or, where MIG is dynamic, a placement
/// whose slots are free (it is cut there), on a GPU anyone may have now.
fn served_without_destroying(gpus: &[GpuState], dynamic: bool) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for g in gpus.iter().filter(|g| g.mig_enabled && !g.blocked) {
        for i in g.instances.iter().filter(|i| i.usage == InstanceUse::Idle) {
            out.insert(i.profile.clone());
        }
        let Some(m) = catalog::model(&g.model).filter(|_| dynamic) else { continue };
        for p in m.profiles {
            if p.starts.iter().any(|&start| {
                cuttable(g, m, p, start) && overlapping(g, p.size, start).next().is_none()
            }) {
                out.insert(p.name.to_string());
            }
        }
    }
    out
}

/// The instances of `g` in the slots of a `size`-slot placement at `start`.
fn overlapping(g: &GpuState, size: u8, start: u8) -> impl Iterator<Item = &InstanceState> {
    let end = start.saturating_add(size);
    g.instances.iter().filter(move |i| i.start < end && start < i.start.saturating_add(i.size))
}

/// Ids of one GPU's units (MPS percent, replicas): kubelet's stay healthy, and `free` of
/// the others: those in `prefer` first (ids kubelet gave a pod whose container has gone
/// and may come back: kubelet still counts them as the pod's), then the lowest.
fn units(
    ids: impl Iterator<Item = String>,
    free: u32,
    held: &BTreeSet<String>,
    prefer: &BTreeSet<String>,
    numa: Option<u32>,
) -> Vec<Device> {
    let mut list: Vec<Device> =
        ids.map(|id| Device { healthy: held.contains(&id), id, numa }).collect();
    let mut left = free;
    for preferred_pass in [true, false] {
        for d in list.iter_mut().filter(|d| !d.healthy) {
            if left > 0 && (!preferred_pass || prefer.contains(&d.id)) {
                d.healthy = true;
                left -= 1;
            }
        }
    }
    list
}

/// The MIG devices of one GPU: its instances, and (dynamic MIG) its cuttable placements;
/// one that destroys idle instances only for a profile not in `plain` (see
/// [`served_without_destroying`]).
fn mig_devices(
    g: &GpuState,
    dynamic: bool,
    held: &BTreeSet<String>,
    plain: &BTreeSet<String>,
    out: &mut Advertised,
) {
    let model = catalog::model(&g.model);
    // Every profile the GPU offers has an endpoint, listed empty when nothing is there.
    if let Some(m) = model {
        for p in m.profiles {
            out.entry(PluginResource::Mig(p.name.to_string()).name()).or_default();
        }
    }
    for i in &g.instances {
        let placement =
            DeviceId::Placement { gpu: g.uuid.clone(), profile: i.profile.clone(), start: i.start }
                .to_string();
        // An instance cut for a placement kubelet holds keeps that id.
        let id = if held.contains(&placement) { placement } else { i.uuid.clone() };
        let healthy = held.contains(&id) || (i.usage == InstanceUse::Idle && !g.blocked);
        out.entry(PluginResource::Mig(i.profile.clone()).name()).or_default().push(Device {
            id,
            healthy,
            numa: g.numa_node,
        });
    }
    let (Some(m), true, false) = (model, dynamic, g.blocked) else { return };
    for p in m.profiles {
        let destroys = |start: u8| overlapping(g, p.size, start).next().is_some();
        // No more placements than instances of the profile can exist on the GPU (a `+me`
        // profile: one, whatever its seven placements), less those it has.
        let have = g.instances.iter().filter(|i| i.profile == p.name).count();
        let mut room = usize::from(p.max_instances).saturating_sub(have);
        for &start in p.starts {
            if room == 0 {
                break;
            }
            if cuttable(g, m, p, start) && !(destroys(start) && plain.contains(p.name)) {
                room -= 1;
                let id =
                    DeviceId::Placement { gpu: g.uuid.clone(), profile: p.name.to_string(), start }
                        .to_string();
                out.entry(PluginResource::Mig(p.name.to_string()).name())
                    .or_default()
                    .push(Device { id, healthy: true, numa: g.numa_node });
            }
        }
    }
}

/// Whether `profile` could be cut at `start` on `g` now, without touching anything but
/// idle instances, and is not there already.
pub fn cuttable(
    g: &GpuState,
    model: &catalog::GpuModel,
    profile: &catalog::Profile,
    start: u8,
) -> bool {
    if g.instances.iter().any(|i| i.profile == profile.name && i.start == start) {
        return false; // listed as the instance itself
    }
    let end = start.saturating_add(profile.size);
    let (overlapping, kept): (Vec<&InstanceState>, Vec<&InstanceState>) =
        g.instances.iter().partition(|i| i.start < end && start < i.start.saturating_add(i.size));
    if overlapping.iter().any(|i| i.usage != InstanceUse::Idle) {
        return false;
    }
    let mut layout: Vec<(&str, u8)> = kept.iter().map(|i| (i.profile.as_str(), i.start)).collect();
    layout.push((profile.name, start));
    catalog::placement_is_legal(model, &layout).is_ok()
}

/// The snapshot's GPUs with the reservations applied as uses, and every id kubelet holds
/// (through live grants or reservations).
fn with_reservations(
    snapshot: &Snapshot,
    pending: &[Reservation],
) -> (Vec<GpuState>, BTreeSet<String>) {
    let mut gpus = snapshot.gpus.clone();
    let mut held: BTreeSet<String> =
        snapshot.kubelet.iter().flat_map(|a| a.device_ids().iter().cloned()).collect();
    // A reservation that shares an id with a live grant is that grant (or was overridden
    // by it): the grant is already counted.
    let live = held.clone();
    for r in pending.iter().filter(|r| !r.device_ids().iter().any(|id| live.contains(id))) {
        held.extend(r.device_ids().iter().cloned());
        for id in r.devices() {
            reserve(&mut gpus, &id);
        }
    }
    (gpus, held)
}

/// Counts one reserved id as a use of its device.
fn reserve(gpus: &mut [GpuState], id: &DeviceId) {
    let gpu_of = |gpus: &mut [GpuState], uuid: &DeviceUuid| -> Option<usize> {
        gpus.iter().position(|g| &g.uuid == uuid)
    };
    match id {
        DeviceId::Gpu(u) => {
            if let Some(i) = gpu_of(gpus, u) {
                if gpus[i].usage == Usage::Free {
                    gpus[i].usage = Usage::Exclusive;
                }
            }
        }
        DeviceId::MpsUnit { gpu, .. } => {
            if let Some(i) = gpu_of(gpus, gpu) {
                gpus[i].usage = match gpus[i].usage {
                    Usage::Free => Usage::Mps { percent: 1 },
                    Usage::Mps { percent } => Usage::Mps { percent: percent + 1 },
                    other => other,
                };
            }
        }
        DeviceId::Replica { gpu, .. } => {
            if let Some(i) = gpu_of(gpus, gpu) {
                gpus[i].usage = match gpus[i].usage {
                    Usage::Free => Usage::Shared { used: 1 },
                    Usage::Shared { used } => Usage::Shared { used: used + 1 },
                    other => other,
                };
            }
        }
        DeviceId::Instance(u) => {
            for inst in gpus.iter_mut().flat_map(|g| g.instances.iter_mut()) {
                if inst.uuid == u.as_str() && inst.usage == InstanceUse::Idle {
                    inst.usage = InstanceUse::Busy;
                }
            }
        }
        DeviceId::Placement { gpu, profile, start } => {
            let Some(i) = gpu_of(gpus, gpu) else { return };
            let g = &mut gpus[i];
            if let Some(inst) =
                g.instances.iter_mut().find(|x| x.profile == *profile && x.start == *start)
            {
                if inst.usage == InstanceUse::Idle {
                    inst.usage = InstanceUse::Busy;
                }
                return;
            }
            let Some(size) =
                catalog::model(&g.model).and_then(|m| m.profile(profile)).map(|p| p.size)
            else {
                return;
            };
            let end = start.saturating_add(size);
            // The idle instances in its slots go when it is cut: they are no devices now.
            g.instances.retain(|x| {
                !(x.start < end && *start < x.start.saturating_add(x.size))
                    || x.usage != InstanceUse::Idle
            });
            g.instances.push(InstanceState {
                uuid: id.to_string(),
                profile: profile.clone(),
                start: *start,
                size,
                usage: InstanceUse::Busy,
            });
        }
    }
}

/// Why kubelet's `Allocate` ids are no grant this node can make.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocateError {
    #[error("{0}")]
    Assignment(#[from] tessera_api::deviceplugin::AssignmentError),
    #[error("{resource} device {} is not one this node advertises", untrusted(.id))]
    Unknown { resource: String, id: String },
    #[error("{resource} device {id} is not free: {why}")]
    NotFree { resource: String, id: String, why: &'static str },
    #[error("tesserad has not read the node's capacity yet: no {resource} device is known")]
    NotReady { resource: String },
}

/// Checks the ids kubelet chose for one container of `resource`: one grant's worth
/// ([`PluginAssignment::request`]: a count the request grammar allows, MPS percent on one
/// GPU), each listed and grantable now (reservations holding any of these ids are
/// kubelet's earlier choices, which it has just overridden, and do not count).
pub fn check_allocate(
    snapshot: &Snapshot,
    pending: &[Reservation],
    resource: &str,
    ids: &[String],
) -> Result<PluginAssignment, AllocateError> {
    let assignment = PluginAssignment::new(resource, ids.to_vec())?;
    assignment.request()?;
    let asked: BTreeSet<&str> = ids.iter().map(String::as_str).collect();
    let others: Vec<Reservation> = pending
        .iter()
        .filter(|r| !r.device_ids().iter().any(|id| asked.contains(id.as_str())))
        .cloned()
        .collect();
    let advertised = advertise(snapshot, &others, &BTreeSet::new());
    let list = advertised.get(resource).map(Vec::as_slice).unwrap_or_default();
    for id in ids {
        match list.iter().find(|d| d.id == *id) {
            None => {
                return Err(AllocateError::Unknown { resource: resource.into(), id: id.clone() })
            }
            Some(d) if !d.healthy => {
                return Err(AllocateError::NotFree {
                    resource: resource.into(),
                    id: id.clone(),
                    why: "it is in use outside kubelet, being scrubbed, or quarantined",
                })
            }
            Some(_) => {}
        }
    }
    Ok(assignment)
}

/// The ids to suggest for one container: `size` of `available`, `must` first. MPS percent
/// stays on one GPU (the fullest GPU that still has room, so whole GPUs stay free); a
/// time-slice replica goes to the fullest GPU with one left; MIG prefers instances that
/// exist to placements that would be cut; otherwise the lowest ids. Fewer than `size` only
/// when fewer are available.
pub fn preferred(
    resource: &str,
    available: &[String],
    must: &[String],
    size: usize,
) -> Vec<String> {
    let mut out: Vec<String> = must.iter().take(size).cloned().collect();
    let mut rest: Vec<&String> = available
        .iter()
        .filter(|a| !out.contains(a))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let by_gpu = |ids: &[&String]| -> BTreeMap<String, Vec<String>> {
        let mut m: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for id in ids {
            let gpu = id.parse::<DeviceId>().ok().and_then(|d| d.gpu().map(|g| g.to_string()));
            m.entry(gpu.unwrap_or_default()).or_default().push((*id).clone());
        }
        m
    };
    let need = size.saturating_sub(out.len());
    if need == 0 {
        return out;
    }
    if resource == RESOURCE_MPS || resource == RESOURCE_SHARED {
        let groups = by_gpu(&rest);
        let must_gpu = out
            .first()
            .and_then(|id| id.parse::<DeviceId>().ok())
            .and_then(|d| d.gpu().map(|g| g.to_string()));
        let pick = match must_gpu {
            Some(g) => groups.get(&g),
            None => groups
                .values()
                .filter(|ids| ids.len() >= need)
                .min_by_key(|ids| ids.len())
                .or_else(|| groups.values().max_by_key(|ids| ids.len())),
        };
        let mut ordered: Vec<String> = pick.cloned().unwrap_or_default();
        sort_units(&mut ordered);
        // Whatever is still missing (no GPU has room): the rest, so the size is right;
        // Allocate then refuses an MPS set spread over GPUs.
        let mut tail: Vec<String> =
            rest.iter().map(|s| (*s).clone()).filter(|s| !ordered.contains(s)).collect();
        sort_units(&mut tail);
        ordered.extend(tail);
        out.extend(ordered.into_iter().take(need));
        return out;
    }
    // MIG: existing instances before placements; GPUs: lowest ids.
    rest.sort_by_key(|id| (id.contains(":mig:"), (*id).clone()));
    out.extend(rest.into_iter().take(need).cloned());
    out
}

/// Unit ids in numeric order within their GPU.
fn sort_units(ids: &mut [String]) {
    ids.sort_by_key(|id| {
        let (gpu, n) = id.rsplit_once(':').unwrap_or((id.as_str(), ""));
        (gpu.to_string(), n.parse::<u32>().unwrap_or(u32::MAX))
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const ALL: Offer = Offer { gpu: true, mig: true, mps: true, shared: true };

    fn uuid(s: &str) -> DeviceUuid {
        DeviceUuid::new(s).expect("uuid")
    }

    fn whole(u: &str, usage: Usage) -> GpuState {
        GpuState {
            uuid: uuid(u),
            model: "H100-80GB".into(),
            blocked: false,
            mig_enabled: false,
            usage,
            instances: Vec::new(),
            numa_node: None,
        }
    }

    fn mig(u: &str, instances: &[(&str, &str, u8, InstanceUse)]) -> GpuState {
        let m = catalog::model("H100-80GB").expect("model");
        GpuState {
            uuid: uuid(u),
            model: m.name.into(),
            blocked: false,
            mig_enabled: true,
            usage: Usage::Free,
            instances: instances
                .iter()
                .map(|(id, p, start, usage)| InstanceState {
                    uuid: (*id).into(),
                    profile: (*p).into(),
                    start: *start,
                    size: m.profile(p).expect("profile").size,
                    usage: *usage,
                })
                .collect(),
            numa_node: None,
        }
    }

    fn snap(gpus: Vec<GpuState>) -> Snapshot {
        Snapshot {
            offer: ALL,
            replicas: 4,
            dynamic_mig: true,
            gpus,
            kubelet: Vec::new(),
            presented: Vec::new(),
        }
    }

    fn assignment(resource: &str, ids: &[&str]) -> PluginAssignment {
        PluginAssignment::new(resource, ids.iter().map(|s| s.to_string()).collect())
            .expect("assignment")
    }

    fn healthy(a: &Advertised, resource: &str) -> Vec<String> {
        a.get(resource)
            .map(|l| l.iter().filter(|d| d.healthy).map(|d| d.id.clone()).collect())
            .unwrap_or_default()
    }

    fn listed(a: &Advertised, resource: &str) -> Vec<String> {
        a.get(resource).map(|l| l.iter().map(|d| d.id.clone()).collect()).unwrap_or_default()
    }

    fn count_on(ids: &[String], gpu: &str) -> usize {
        ids.iter().filter(|i| i.starts_with(&format!("{gpu}:")) || *i == gpu).count()
    }

    const NONE: &BTreeSet<String> = &BTreeSet::new();

    #[test]
    fn every_id_of_a_gpu_carries_its_numa_node() {
        let mut a = whole("GPU-a", Usage::Free);
        a.numa_node = Some(1);
        let mut m = mig("GPU-m", &[("MIG-1", "3g.40gb", 0, InstanceUse::Idle)]);
        m.numa_node = Some(0);
        let adv = advertise(&snap(vec![a, m, whole("GPU-b", Usage::Free)]), &[], NONE);
        let numa =
            |r: &str, id: &str| adv[r].iter().find(|d| d.id == id).map(|d| d.numa).expect("listed");
        assert_eq!(numa(RESOURCE_GPU, "GPU-a"), Some(1));
        assert_eq!(numa(RESOURCE_GPU, "GPU-b"), None, "unknown stays unknown");
        assert_eq!(numa(RESOURCE_MPS, "GPU-a:mps:7"), Some(1));
        assert_eq!(numa(RESOURCE_SHARED, "GPU-a:shared:0"), Some(1));
        assert_eq!(numa("tessera.io/mig-3g.40gb", "MIG-1"), Some(0));
        assert_eq!(numa("tessera.io/mig-1g.10gb", "GPU-m:mig:1g.10gb:4"), Some(0));
    }

    #[test]
    fn a_free_gpu_is_offered_whole_as_mps_percent_and_as_replicas() {
        let a = advertise(
            &snap(vec![whole("GPU-a", Usage::Free), whole("GPU-b", Usage::Free)]),
            &[],
            NONE,
        );
        assert_eq!(healthy(&a, RESOURCE_GPU), ["GPU-a", "GPU-b"]);
        assert_eq!(healthy(&a, RESOURCE_MPS).len(), 200);
        assert_eq!(healthy(&a, RESOURCE_SHARED).len(), 8);
        assert_eq!(listed(&a, RESOURCE_MPS)[..3], ["GPU-a:mps:0", "GPU-a:mps:1", "GPU-a:mps:2"]);
        assert_eq!(listed(&a, RESOURCE_SHARED)[4], "GPU-b:shared:0");
        assert!(a.keys().all(|k| !k.starts_with("tessera.io/mig-")), "no MIG GPU: {a:?}");
    }

    #[test]
    fn what_the_policy_allows_nobody_is_not_advertised() {
        let mut s = snap(vec![whole("GPU-a", Usage::Free), mig("GPU-m", &[])]);
        s.offer = Offer { gpu: true, mig: true, mps: false, shared: false };
        let a = advertise(&s, &[], NONE);
        assert!(a.contains_key(RESOURCE_GPU) && a.contains_key("tessera.io/mig-1g.10gb"));
        assert!(!a.contains_key(RESOURCE_MPS) && !a.contains_key(RESOURCE_SHARED));
        s.offer = Offer::default();
        assert!(advertise(&s, &[], NONE).is_empty());
    }

    #[test]
    fn a_grant_outside_kubelet_turns_the_gpus_ids_unhealthy() {
        let s = snap(vec![whole("GPU-a", Usage::Exclusive), whole("GPU-b", Usage::Free)]);
        let a = advertise(&s, &[], NONE);
        assert_eq!(listed(&a, RESOURCE_GPU), ["GPU-a", "GPU-b"], "still listed");
        assert_eq!(healthy(&a, RESOURCE_GPU), ["GPU-b"]);
        assert_eq!(count_on(&healthy(&a, RESOURCE_MPS), "GPU-a"), 0);
        assert_eq!(count_on(&healthy(&a, RESOURCE_SHARED), "GPU-a"), 0);
        assert_eq!(count_on(&healthy(&a, RESOURCE_MPS), "GPU-b"), 100);
    }

    #[test]
    fn kubelets_own_ids_stay_healthy_and_their_gpu_is_taken_for_the_rest() {
        let mut s = snap(vec![whole("GPU-a", Usage::Exclusive)]);
        s.kubelet = vec![assignment(RESOURCE_GPU, &["GPU-a"])];
        let a = advertise(&s, &[], NONE);
        assert_eq!(healthy(&a, RESOURCE_GPU), ["GPU-a"], "kubelet counts it as allocated");
        assert!(healthy(&a, RESOURCE_MPS).is_empty() && healthy(&a, RESOURCE_SHARED).is_empty());
    }

    #[test]
    fn mps_percent_left_is_what_kubelet_can_allocate() {
        // 25% through kubelet (units 0..24), 10% by an annotation request.
        let mut s = snap(vec![whole("GPU-a", Usage::Mps { percent: 35 })]);
        let units: Vec<String> = (0..25).map(|u| format!("GPU-a:mps:{u}")).collect();
        s.kubelet = vec![PluginAssignment::new(RESOURCE_MPS, units.clone()).expect("assignment")];
        let a = advertise(&s, &[], NONE);
        let h = healthy(&a, RESOURCE_MPS);
        assert!(units.iter().all(|u| h.contains(u)));
        assert_eq!(h.len() - units.len(), 65, "kubelet's free count is the 65% left");
        assert!(healthy(&a, RESOURCE_GPU).is_empty(), "a GPU serving MPS is not whole");
        assert!(healthy(&a, RESOURCE_SHARED).is_empty(), "nor time-sliced");
    }

    #[test]
    fn time_slice_replicas_left() {
        let a = advertise(&snap(vec![whole("GPU-a", Usage::Shared { used: 3 })]), &[], NONE);
        assert_eq!(healthy(&a, RESOURCE_SHARED), ["GPU-a:shared:0"]);
        assert_eq!(listed(&a, RESOURCE_SHARED).len(), 4);
        assert!(healthy(&a, RESOURCE_MPS).is_empty() && healthy(&a, RESOURCE_GPU).is_empty());
    }

    #[test]
    fn a_dirty_or_quarantined_gpu_is_unhealthy_in_every_form() {
        let mut g = whole("GPU-a", Usage::Free);
        g.blocked = true;
        let a = advertise(&snap(vec![g]), &[], NONE);
        for r in [RESOURCE_GPU, RESOURCE_MPS, RESOURCE_SHARED] {
            assert!(!listed(&a, r).is_empty() && healthy(&a, r).is_empty(), "{r}");
        }
    }

    #[test]
    fn an_empty_mig_gpu_offers_every_placement() {
        let a = advertise(&snap(vec![mig("GPU-m", &[])]), &[], NONE);
        let n = |p: &str| listed(&a, &format!("tessera.io/mig-{p}")).len();
        assert_eq!(
            [
                n("1g.10gb"),
                n("1g.10gb-me"),
                n("1g.20gb"),
                n("2g.20gb"),
                n("3g.40gb"),
                n("4g.40gb"),
                n("7g.80gb")
            ],
            // A `+me` profile exists at most once per GPU: one placement, not seven.
            [7, 1, 4, 3, 2, 1, 1]
        );
        assert_eq!(listed(&a, "tessera.io/mig-7g.80gb"), ["GPU-m:mig:7g.80gb:0"]);
        assert!(!a.contains_key(RESOURCE_GPU), "a MIG GPU is never offered whole");
    }

    #[test]
    fn a_cut_withdraws_the_placements_it_consumed() {
        let busy = [("MIG-1", "3g.40gb", 0, InstanceUse::Busy)];
        let a = advertise(&snap(vec![mig("GPU-m", &busy)]), &[], NONE);
        let l = |p: &str| listed(&a, &format!("tessera.io/mig-{p}"));
        assert_eq!(
            l("1g.10gb"),
            ["GPU-m:mig:1g.10gb:4", "GPU-m:mig:1g.10gb:5", "GPU-m:mig:1g.10gb:6"]
        );
        assert_eq!(l("3g.40gb"), ["MIG-1", "GPU-m:mig:3g.40gb:4"]);
        assert!(
            healthy(&a, "tessera.io/mig-3g.40gb") == ["GPU-m:mig:3g.40gb:4"],
            "busy: unhealthy"
        );
        assert!(l("7g.80gb").is_empty() && l("4g.40gb").is_empty(), "withdrawn");
        assert!(a.contains_key("tessera.io/mig-7g.80gb"), "the endpoint stays, listed empty");
    }

    #[test]
    fn idle_instances_are_offered_and_hide_placements_over_them_while_a_plain_request_would_not_destroy(
    ) {
        let idle = [("MIG-1", "3g.40gb", 0, InstanceUse::Idle)];
        let a = advertise(&snap(vec![mig("GPU-m", &idle)]), &[], NONE);
        assert_eq!(healthy(&a, "tessera.io/mig-3g.40gb"), ["MIG-1", "GPU-m:mig:3g.40gb:4"]);
        // 1g.10gb has free slots 4 to 6: the placements over idle MIG-1 are not offered
        // (a plain mig=1g.10gb would cut on a free slot, not destroy MIG-1).
        assert_eq!(
            listed(&a, "tessera.io/mig-1g.10gb"),
            ["GPU-m:mig:1g.10gb:4", "GPU-m:mig:1g.10gb:5", "GPU-m:mig:1g.10gb:6"]
        );
        // 7g.80gb and 4g.40gb have nowhere else: a plain request destroys MIG-1 too.
        assert_eq!(listed(&a, "tessera.io/mig-7g.80gb"), ["GPU-m:mig:7g.80gb:0"]);
        assert_eq!(listed(&a, "tessera.io/mig-4g.40gb"), ["GPU-m:mig:4g.40gb:0"]);
        // A free instance of the profile anywhere (here on a second GPU) is what a plain
        // request reuses: no placement that destroys is offered for it.
        let two = snap(vec![
            mig("GPU-m", &idle),
            mig("GPU-n", &[("MIG-7", "7g.80gb", 0, InstanceUse::Idle)]),
        ]);
        let a = advertise(&two, &[], NONE);
        assert_eq!(listed(&a, "tessera.io/mig-7g.80gb"), ["MIG-7"]);
        let e =
            check_allocate(&two, &[], "tessera.io/mig-7g.80gb", &["GPU-m:mig:7g.80gb:0".into()])
                .unwrap_err();
        assert!(matches!(e, AllocateError::Unknown { .. }), "{e}");
        // Once MIG-7 is taken, destroying is what a plain request does too.
        let mut taken = two.clone();
        taken.gpus[1].instances[0].usage = InstanceUse::Busy;
        let a = advertise(&taken, &[], NONE);
        assert!(listed(&a, "tessera.io/mig-7g.80gb").contains(&"GPU-m:mig:7g.80gb:0".into()));
        // A dirty instance is neither granted nor destroyed.
        let dirty = [("MIG-1", "3g.40gb", 0, InstanceUse::Blocked)];
        let a = advertise(&snap(vec![mig("GPU-m", &dirty)]), &[], NONE);
        assert!(healthy(&a, "tessera.io/mig-3g.40gb") == ["GPU-m:mig:3g.40gb:4"]);
        assert_eq!(listed(&a, "tessera.io/mig-1g.10gb").len(), 3);
    }

    #[test]
    fn a_declared_layout_offers_its_instances_only() {
        let mut s = snap(vec![mig("GPU-m", &[("MIG-1", "3g.40gb", 0, InstanceUse::Idle)])]);
        s.dynamic_mig = false;
        let a = advertise(&s, &[], NONE);
        assert_eq!(listed(&a, "tessera.io/mig-3g.40gb"), ["MIG-1"]);
        assert!(listed(&a, "tessera.io/mig-1g.10gb").is_empty());
    }

    #[test]
    fn an_instance_cut_for_kubelets_placement_keeps_that_id() {
        let mut s = snap(vec![mig("GPU-m", &[("MIG-9", "1g.10gb", 2, InstanceUse::Busy)])]);
        s.kubelet = vec![assignment("tessera.io/mig-1g.10gb", &["GPU-m:mig:1g.10gb:2"])];
        let a = advertise(&s, &[], NONE);
        let l = listed(&a, "tessera.io/mig-1g.10gb");
        assert!(l.contains(&"GPU-m:mig:1g.10gb:2".to_string()) && !l.contains(&"MIG-9".into()));
        assert!(healthy(&a, "tessera.io/mig-1g.10gb").contains(&"GPU-m:mig:1g.10gb:2".into()));
        assert_eq!(l.len(), 7, "six placements left beside it");
    }

    #[test]
    fn a_reservation_takes_its_device_before_the_grant_comes() {
        let s = snap(vec![whole("GPU-a", Usage::Free), mig("GPU-m", &[])]);
        let pending = [
            assignment(RESOURCE_MPS, &["GPU-a:mps:0", "GPU-a:mps:1"]),
            assignment("tessera.io/mig-7g.80gb", &["GPU-m:mig:7g.80gb:0"]),
        ];
        let a = advertise(&s, &pending, NONE);
        assert!(healthy(&a, RESOURCE_GPU).is_empty(), "the GPU serves MPS now");
        assert_eq!(healthy(&a, RESOURCE_MPS).len(), 100, "2 reserved (healthy) + 98 left");
        assert_eq!(healthy(&a, "tessera.io/mig-7g.80gb"), ["GPU-m:mig:7g.80gb:0"]);
        assert!(listed(&a, "tessera.io/mig-1g.10gb").is_empty(), "the 7g takes the GPU");
        // Once the grant carries it, the reservation counts no more (not twice).
        let mut granted = s.clone();
        granted.gpus[0].usage = Usage::Mps { percent: 2 };
        granted.kubelet = vec![pending[0].clone()];
        let b = advertise(&granted, &pending[..1], NONE);
        assert_eq!(healthy(&b, RESOURCE_MPS).len(), 100);
    }

    #[test]
    fn released_kubelet_units_are_listed_healthy_first() {
        let s = snap(vec![whole("GPU-a", Usage::Mps { percent: 90 })]);
        let prefer: BTreeSet<String> = ["GPU-a:mps:50".to_string()].into();
        let a = advertise(&s, &[], &prefer);
        let h = healthy(&a, RESOURCE_MPS);
        assert_eq!(h.len(), 10);
        assert!(h.contains(&"GPU-a:mps:50".to_string()) && !h.contains(&"GPU-a:mps:9".into()));
    }

    #[test]
    fn allocate_takes_one_grants_worth_of_free_ids() {
        let s = snap(vec![whole("GPU-a", Usage::Free), whole("GPU-b", Usage::Exclusive)]);
        let ids = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let ok = check_allocate(&s, &[], RESOURCE_MPS, &ids(&["GPU-a:mps:0", "GPU-a:mps:1"]));
        assert_eq!(ok.expect("free").to_string(), "v1;tessera.io/mps;GPU-a:mps:0,GPU-a:mps:1");
        let spread = check_allocate(&s, &[], RESOURCE_MPS, &ids(&["GPU-a:mps:0", "GPU-b:mps:1"]));
        assert!(matches!(spread, Err(AllocateError::Assignment(_))), "{spread:?}");
        let busy = check_allocate(&s, &[], RESOURCE_GPU, &ids(&["GPU-b"])).unwrap_err();
        assert!(
            matches!(busy, AllocateError::NotFree { .. }) && busy.to_string().contains("GPU-b")
        );
        let unknown = check_allocate(&s, &[], RESOURCE_GPU, &ids(&["GPU-zz"])).unwrap_err();
        assert!(matches!(unknown, AllocateError::Unknown { .. }), "{unknown}");
        // Another reservation of GPU-a's MPS takes GPU-a from the whole-GPU resource...
        let r = [assignment(RESOURCE_MPS, &["GPU-a:mps:5"])];
        assert!(check_allocate(&s, &r, RESOURCE_GPU, &ids(&["GPU-a"])).is_err());
        // ...unless kubelet hands out that very id again: its earlier choice is over.
        assert!(check_allocate(&s, &r, RESOURCE_MPS, &ids(&["GPU-a:mps:5"])).is_ok());
    }

    #[test]
    fn preferred_keeps_mps_percent_on_one_gpu() {
        let avail: Vec<String> = ["GPU-a", "GPU-b"]
            .iter()
            .flat_map(|g| (0..10).map(move |u| format!("{g}:mps:{u}")))
            .chain((10..40).map(|u| format!("GPU-b:mps:{u}")))
            .collect();
        let p = preferred(RESOURCE_MPS, &avail, &[], 8);
        assert_eq!(p.len(), 8);
        assert!(p.iter().all(|id| id.starts_with("GPU-a:")), "the fuller GPU that fits: {p:?}");
        let p = preferred(RESOURCE_MPS, &avail, &[], 20);
        assert!(p.iter().all(|id| id.starts_with("GPU-b:")), "{p:?}");
        let p = preferred(RESOURCE_MPS, &avail, &["GPU-b:mps:3".into()], 3);
        assert_eq!(p, ["GPU-b:mps:3", "GPU-b:mps:0", "GPU-b:mps:1"]);
        let mig = ["GPU-m:mig:1g.10gb:0".to_string(), "MIG-2".into()];
        assert_eq!(preferred("tessera.io/mig-1g.10gb", &mig, &[], 1), ["MIG-2"]);
    }

    proptest! {
        /// Whatever kubelet holds and whatever else is granted, kubelet's free count
        /// (healthy ids it does not hold) is what the GPU has left, and its ids are healthy.
        #[test]
        fn kubelets_free_mps_count_is_the_percent_left(
            kubelet_units in proptest::collection::btree_set(0u8..100, 0..60),
            outside in 0u32..=40,
            prefer in proptest::collection::btree_set(0u8..100, 0..20),
        ) {
            let used = kubelet_units.len() as u32 + outside;
            let mut s = snap(vec![whole("GPU-a", if used == 0 { Usage::Free } else { Usage::Mps { percent: used } })]);
            let held: Vec<String> = kubelet_units.iter().map(|u| format!("GPU-a:mps:{u}")).collect();
            if !held.is_empty() {
                s.kubelet = vec![PluginAssignment::new(RESOURCE_MPS, held.clone()).expect("a")];
            }
            let prefer: BTreeSet<String> = prefer.iter().map(|u| format!("GPU-a:mps:{u}")).collect();
            let a = advertise(&s, &[], &prefer);
            let h = healthy(&a, RESOURCE_MPS);
            prop_assert!(held.iter().all(|id| h.contains(id)));
            prop_assert_eq!(h.len() - held.len(), 100 - used as usize);
            prop_assert_eq!(listed(&a, RESOURCE_MPS).len(), 100);
        }
    }
}
