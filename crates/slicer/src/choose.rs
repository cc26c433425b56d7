//! Which devices a request gets: a pure, deterministic function of the inventory, the
//! devices already held and the request.

use std::collections::BTreeSet;

use tessera_api::{GpuRequest, GrantedDevice};

use crate::catalog;
use crate::inventory::{Found, Gpu, Inventory, MigInstance};
use crate::topology::{Placement, Topology};

/// Why nothing on the node fits a request. Every message says what was asked and what
/// is free or held.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoFit {
    #[error("gpu={asked}: only {free} whole GPU(s) free ({whole} not in MIG mode, {held} of them held; {mig} in MIG mode, handed out only by instance)")]
    NotEnoughGpus { asked: u32, free: usize, whole: usize, held: usize, mig: usize },
    #[error("mig={profile}: no GPU on this node offers MIG profile {profile}; offered: {offered}")]
    UnknownProfile { profile: String, offered: String },
    #[error("mig={profile}: no {profile} instance exists on this node (MIG instances: {existing}); the MIG layout would have to change")]
    NoInstance { profile: String, existing: String },
    #[error("mig={profile}: all {count} instances of {profile} on this node are held")]
    AllHeld { profile: String, count: usize },
    /// No free instance, no free placement and no placement that destroying only idle
    /// instances would open (see [`crate::place`](mod@crate::place)).
    #[error("mig={profile}: no room for a {profile} instance, even after destroying idle instances ({detail})")]
    NoRoom { profile: String, detail: String },
    #[error("{request}: MPS / time-sliced sharing is not supported yet")]
    NotSupported { request: String },
    /// The driver reported a device whose UUID is not one (`GPU-…`, `MIG-…`): refused
    /// rather than granted under a name nothing can find it by again.
    #[error("the driver reports a device UUID Tessera does not accept: {0}")]
    BadUuid(#[from] tessera_api::InvalidDeviceUuid),
}

/// Pick devices for a request given who holds what. `held`: uuids (GPU or MIG) currently
/// assigned. Deterministic: whole GPUs by lowest index (without topology), MIG instances by lowest
/// (GPU index, start slot). A GPU in MIG mode is never handed out whole, and a MIG
/// instance is never handed out if its GPU is held whole.
pub fn choose(
    inv: &Inventory,
    held: &BTreeSet<String>,
    req: &GpuRequest,
) -> Result<Vec<GrantedDevice>, NoFit> {
    choose_placed(inv, &Topology::default(), held, req).map(|(d, _)| d)
}

/// [`choose`] on a node whose topology is known: `gpu=N` takes GPUs of one NVLink domain
/// and one NUMA node where it can ([`crate::topology::pick`]), and says where it landed.
pub fn choose_placed(
    inv: &Inventory,
    topo: &Topology,
    held: &BTreeSet<String>,
    req: &GpuRequest,
) -> Result<(Vec<GrantedDevice>, Option<Placement>), NoFit> {
    match req {
        GpuRequest::Gpu { count } => choose_gpus(inv, topo, held, *count),
        GpuRequest::Mig { profile } => choose_mig(inv, held, profile).map(|d| (d, None)),
        GpuRequest::Mps { .. } | GpuRequest::Shared => {
            Err(NoFit::NotSupported { request: req.to_string() })
        }
    }
}

fn sorted_gpus(inv: &Inventory) -> Vec<&Gpu> {
    let mut gpus: Vec<&Gpu> = inv.gpus.iter().collect();
    gpus.sort_by(|a, b| (a.index, &a.uuid).cmp(&(b.index, &b.uuid)));
    gpus
}

fn choose_gpus(
    inv: &Inventory,
    topo: &Topology,
    held: &BTreeSet<String>,
    count: u32,
) -> Result<(Vec<GrantedDevice>, Option<Placement>), NoFit> {
    let gpus = sorted_gpus(inv);
    let whole: Vec<&Gpu> = gpus.iter().copied().filter(|g| !g.mig_enabled).collect();
    let free: Vec<&Gpu> = whole.iter().copied().filter(|g| !held.contains(&g.uuid)).collect();
    let asked = usize::try_from(count).unwrap_or(usize::MAX);
    if count == 0 || free.len() < asked {
        return Err(NoFit::NotEnoughGpus {
            asked: count,
            free: free.len(),
            whole: whole.len(),
            held: whole.len() - free.len(),
            mig: gpus.len() - whole.len(),
        });
    }
    let (picked, placement) = crate::topology::pick(&free, topo, asked);
    let granted = picked.into_iter().map(|g| Found::Gpu(g).granted()).collect::<Result<_, _>>()?;
    Ok((granted, placement))
}

fn choose_mig(
    inv: &Inventory,
    held: &BTreeSet<String>,
    profile: &str,
) -> Result<Vec<GrantedDevice>, NoFit> {
    let gpus = sorted_gpus(inv);
    let mig_gpus: Vec<&Gpu> = gpus.iter().copied().filter(|g| g.mig_enabled).collect();
    let mut offered: Vec<String> = Vec::new();
    for gpu in &gpus {
        let names: Vec<String> = match catalog::model(&gpu.model) {
            Some(m) => m.profile_names().map(str::to_string).collect(),
            // A model the catalog does not know offers at least what the driver shows.
            None => gpu.instances.iter().map(|i| i.profile.clone()).collect(),
        };
        for n in names {
            if !offered.contains(&n) {
                offered.push(n);
            }
        }
    }
    if !offered.iter().any(|p| p == profile) {
        return Err(NoFit::UnknownProfile {
            profile: profile.to_string(),
            offered: if offered.is_empty() { "none".into() } else { offered.join(", ") },
        });
    }
    let mut matching: Vec<(&Gpu, &MigInstance)> = mig_gpus
        .iter()
        .flat_map(|g| g.instances.iter().map(move |i| (*g, i)))
        .filter(|(_, i)| i.profile == profile)
        .collect();
    matching.sort_by(|(ga, a), (gb, b)| {
        (ga.index, a.start, &a.uuid).cmp(&(gb.index, b.start, &b.uuid))
    });
    let pick = matching.iter().find(|(g, i)| !held.contains(&i.uuid) && !held.contains(&g.uuid));
    match pick {
        Some((g, i)) => Ok(vec![Found::Mig(g, i).granted()?]),
        None if matching.is_empty() => {
            let mut existing: Vec<(String, usize)> = Vec::new();
            for i in mig_gpus.iter().flat_map(|g| &g.instances) {
                match existing.iter_mut().find(|(p, _)| *p == i.profile) {
                    Some((_, n)) => *n += 1,
                    None => existing.push((i.profile.clone(), 1)),
                }
            }
            existing.sort();
            let existing = if existing.is_empty() {
                "none".to_string()
            } else {
                existing.iter().map(|(p, n)| format!("{p} x{n}")).collect::<Vec<_>>().join(", ")
            };
            Err(NoFit::NoInstance { profile: profile.to_string(), existing })
        }
        None => Err(NoFit::AllHeld { profile: profile.to_string(), count: matching.len() }),
    }
}
