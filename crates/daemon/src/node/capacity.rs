//! What this node can grant now, for the kubelet device plugin: [`Node::capacity`] reads
//! the state under the node lock, and [`snapshot`] (pure) turns it into the plugin's
//! [`Snapshot`] (which `device_plugin::advertise` turns into device lists).

use std::collections::BTreeSet;

use device_plugin::{GpuState, InstanceState, InstanceUse, Offer, Snapshot, Usage};
use policy::Policy;
use slicer::Inventory;
use tessera_api::deviceplugin::PluginAssignment;
use tessera_api::{Allocation, DeviceUuid, GpuRequest};
use tracing::warn;

use super::Node;
use crate::error::CoreError;
use crate::share::DeviceUse;

impl Node {
    /// The node's capacity as the device plugin counts it.
    pub fn capacity(&self) -> Result<Snapshot, CoreError> {
        let allocations = self.allocations()?;
        // Read every 2 s while the plugin runs: the tokens of live kubelet grants are kept
        // ahead of their expiry here (written only when that is due).
        self.tidy_tokens(&allocations);
        let unavailable: BTreeSet<String> = self.lifecycle()?.into_keys().collect();
        let kubelet = self.kubelet_assignments(&allocations).into_iter().map(|(_, a)| a).collect();
        Ok(snapshot(&Inputs {
            inventory: &self.inventory,
            allocations: &allocations,
            unavailable: &unavailable,
            kubelet,
            presented: self.presented.iter().cloned().collect(),
            policy: &self.policy.policy,
            dynamic_mig: self.mig_is_dynamic(),
            topology: &self.topology,
        }))
    }

    /// Whether a `mig=P` grant may cut (and destroy idle) instances here: dynamic MIG is
    /// on and no node pool declares this node's layout.
    pub(super) fn mig_is_dynamic(&self) -> bool {
        self.dynamic_mig && self.policy.policy.mig_layouts(&self.inventory.node).is_empty()
    }
}

/// What [`snapshot`] is made from.
#[derive(Debug)]
pub struct Inputs<'a> {
    pub inventory: &'a Inventory,
    pub allocations: &'a [Allocation],
    /// Devices whose lifecycle is not free (dirty, scrubbing, quarantined).
    pub unavailable: &'a BTreeSet<String>,
    /// The assignments of the live grants made through the device plugin.
    pub kubelet: Vec<PluginAssignment>,
    /// Assignments whose token a create presented (see [`Snapshot::presented`]).
    pub presented: Vec<PluginAssignment>,
    pub policy: &'a Policy,
    pub dynamic_mig: bool,
    /// The GPUs' NUMA nodes, for kubelet's topology manager.
    pub topology: &'a slicer::Topology,
}

/// The plugin's snapshot of the node: every GPU with its use (whole GPUs) or its
/// instances (MIG), what the policy lets anyone here use, kubelet's live assignments.
pub fn snapshot(i: &Inputs<'_>) -> Snapshot {
    let uses = DeviceUse::of(i.allocations);
    let busy = uses.busy();
    let gpus = i
        .inventory
        .gpus
        .iter()
        .filter_map(|g| {
            let Ok(uuid) = DeviceUuid::new(g.uuid.as_str()) else {
                warn!(gpu = %g.uuid, "not advertised to kubelet: not a GPU uuid");
                return None;
            };
            let usage = if uses.exclusive.contains(&g.uuid) {
                Usage::Exclusive
            } else if let Some(shares) = uses.mps.get(&g.uuid) {
                Usage::Mps { percent: shares.iter().map(|s| u32::from(s.percent)).sum() }
            } else if let Some((used, _)) = uses.shared.get(&g.uuid) {
                Usage::Shared { used: *used }
            } else {
                Usage::Free
            };
            let instances = g
                .instances
                .iter()
                .map(|inst| InstanceState {
                    uuid: inst.uuid.clone(),
                    profile: inst.profile.clone(),
                    start: inst.start,
                    size: inst.size,
                    usage: if busy.contains(&inst.uuid) {
                        InstanceUse::Busy
                    } else if i.unavailable.contains(&inst.uuid) {
                        InstanceUse::Blocked
                    } else {
                        InstanceUse::Idle
                    },
                })
                .collect();
            Some(GpuState {
                numa_node: i.topology.numa(&g.uuid),
                uuid,
                model: g.model.clone(),
                blocked: i.unavailable.contains(&g.uuid),
                mig_enabled: g.mig_enabled,
                usage,
                instances,
            })
        })
        .collect();
    Snapshot {
        offer: offer(i.policy, &i.inventory.node),
        replicas: i.policy.shared_replicas(),
        dynamic_mig: i.dynamic_mig,
        gpus,
        kubelet: i.kubelet.clone(),
        presented: i.presented.clone(),
    }
}

/// Which kinds some tenant of the policy may have on node `node` (its tier allows the
/// kind, and no node pool of the node excludes it). A node-wide resource cannot know the
/// asking pod's tenant: a kind some tenants may use is advertised, and a pod of a tenant
/// whose tier refuses it is refused at create (`docs/KUBERNETES.md`, Device plugin).
pub fn offer(policy: &Policy, node: &str) -> Offer {
    let tenants = policy.tenants();
    let may = |req: GpuRequest| tenants.iter().any(|t| policy.authorize(t, &req, node).is_ok());
    Offer {
        gpu: may(GpuRequest::Gpu { count: 1 }),
        mig: may(GpuRequest::Mig { profile: "1g.10gb".into() }),
        mps: may(GpuRequest::Mps { percent: 1 }),
        shared: may(GpuRequest::Shared),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(json: &str) -> Policy {
        Policy::parse(json.as_bytes(), "test").expect("policy")
    }

    #[test]
    fn the_offer_follows_tiers_and_node_pools() {
        let p = policy(
            r#"{"version":1,
                "orgs":{"a":{"trust":"untrusted"},"b":{"trust":"trusted"}},
                "default_tenant":"a",
                "node_pools":{"locked":{"nodes":["locked-*"],"tenants":["a"]}}}"#,
        );
        // Node in no pool: a (untrusted: gpu, mig) and b (trusted: + mps).
        assert_eq!(offer(&p, "n1"), Offer { gpu: true, mig: true, mps: true, shared: false });
        // A pool that admits only the untrusted org: no MPS.
        assert_eq!(
            offer(&p, "locked-1"),
            Offer { gpu: true, mig: true, mps: false, shared: false }
        );
    }

    #[test]
    fn the_snapshot_reads_uses_and_lifecycles() {
        let dir = tempfile::tempdir().expect("tempdir");
        let node = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../examples/nodes/a100-40x4.json");
        let inv = slicer::SimBackend::open(&node, dir.path())
            .and_then(|b| slicer::GpuBackend::inventory(&b))
            .expect("inventory");
        let p = policy(r#"{"version":1,"orgs":{"a":{"trust":"dev"}},"default_tenant":"a"}"#);
        let whole: Vec<&slicer::Gpu> = inv.gpus.iter().filter(|g| !g.mig_enabled).collect();
        let mig = inv.gpus.iter().find(|g| g.mig_enabled).expect("mig gpu");
        let mut a: Allocation = serde_json::from_value(serde_json::json!({
            "container_id": "c1", "tenant": "a", "trust": "dev", "request": "mps=30",
            "isolation": "mps", "devices": [],
            "injection": serde_json::to_value(tessera_api::Injection::default()).expect("json"),
            "state": "running",
            "created_ms": 0,
            "share": {"kind": "mps", "device": whole[0].uuid, "percent": 30}
        }))
        .expect("allocation");
        let mut b = a.clone();
        b.container_id = "c2".parse().expect("valid");
        b.share = None;
        b.devices = vec![slicer::Found::Mig(mig, &mig.instances[0]).granted().expect("uuid")];
        a.devices = vec![slicer::Found::Gpu(whole[0]).granted().expect("uuid")];
        let unavailable: BTreeSet<String> =
            [whole[1].uuid.clone(), mig.instances[1].uuid.clone()].into();
        let s = snapshot(&Inputs {
            inventory: &inv,
            allocations: &[a, b],
            unavailable: &unavailable,
            kubelet: Vec::new(),
            presented: Vec::new(),
            policy: &p,
            dynamic_mig: true,
            topology: &slicer::Topology::default(),
        });
        let by = |u: &str| s.gpus.iter().find(|g| g.uuid.as_str() == u).expect("gpu");
        assert_eq!(by(&whole[0].uuid).usage, Usage::Mps { percent: 30 });
        assert!(by(&whole[1].uuid).blocked && by(&whole[1].uuid).usage == Usage::Free);
        assert_eq!(by(&whole[2].uuid).usage, Usage::Free);
        let m = by(&mig.uuid);
        assert!(m.mig_enabled);
        assert_eq!(
            m.instances.iter().map(|i| i.usage).collect::<Vec<_>>(),
            [InstanceUse::Busy, InstanceUse::Blocked]
        );
        assert_eq!(s.offer, Offer { gpu: true, mig: true, mps: true, shared: true });
        assert_eq!(s.replicas, 4);
    }
}
