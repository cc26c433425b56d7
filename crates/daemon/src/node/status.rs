//! Reads: one allocation, all of them, the node's status.

use std::collections::BTreeMap;

use super::{internal, lifecycle_detail, summary, Node};
use crate::error::CoreError;
use tessera_api::{
    untrusted, Allocation, DeviceState, EventStatus, GpuStatus, Holder, MigInstanceStatus,
    MpsShareStatus, NodeStatus,
};

impl Node {
    pub fn allocation(&self, container_id: &str) -> Result<Allocation, CoreError> {
        self.store.get(container_id).map_err(internal)?.map(|r| r.allocation).ok_or_else(|| {
            CoreError::not_found(format!("no allocation for container {}", untrusted(container_id)))
        })
    }

    pub fn allocations(&self) -> Result<Vec<Allocation>, CoreError> {
        Ok(self.store.all().map_err(internal)?.into_iter().map(|r| r.allocation).collect())
    }

    /// Everything a person needs to see: devices, their layout, who holds what.
    pub fn status(&self) -> Result<NodeStatus, CoreError> {
        let allocations = self.allocations()?;
        let mut holders: BTreeMap<&str, Holder> = BTreeMap::new();
        let shared: std::collections::BTreeSet<&str> = allocations
            .iter()
            .filter_map(|a| a.share.as_ref().map(|s| s.device.as_str()))
            .collect();
        for a in allocations.iter().filter(|a| a.share.is_none()) {
            for d in &a.devices {
                holders.insert(
                    &d.uuid,
                    Holder {
                        container_id: a.container_id.clone(),
                        tenant: a.tenant.clone(),
                        workload: a.workload.as_ref().map(|w| w.display_name()),
                    },
                );
            }
        }
        let lifecycle = self.lifecycle()?;
        let life = |uuid: &str| -> Option<tessera_api::Lifecycle> {
            let (st, report) = lifecycle.get(uuid)?;
            Some(tessera_api::Lifecycle {
                detail: lifecycle_detail(st),
                last_scrub: report.as_ref().map(summary),
            })
        };
        let state_of = |uuid: &str, holder: &Option<Holder>| {
            if let Some((st, _)) = lifecycle.get(uuid) {
                match st {
                    scrub::DeviceState::Scrubbing { .. } => return DeviceState::Scrubbing,
                    scrub::DeviceState::Quarantined { .. } => return DeviceState::Quarantined,
                    _ if holder.is_none() => return DeviceState::Dirty,
                    _ => {}
                }
            }
            if holder.is_some() {
                DeviceState::Assigned
            } else if shared.contains(uuid) {
                DeviceState::Shared
            } else {
                DeviceState::Free
            }
        };
        let gpus = self
            .inventory
            .gpus
            .iter()
            .map(|g| {
                let holder = holders.get(g.uuid.as_str()).cloned();
                let instances = g
                    .instances
                    .iter()
                    .map(|i| {
                        let holder = holders.get(i.uuid.as_str()).cloned();
                        MigInstanceStatus {
                            uuid: i.uuid.clone(),
                            profile: i.profile.clone(),
                            gi_id: i.gi_id,
                            ci_id: i.ci_id,
                            start: i.start,
                            size: i.size,
                            memory_mib: i.memory_mib,
                            state: state_of(&i.uuid, &holder),
                            holder,
                            lifecycle: life(&i.uuid),
                        }
                    })
                    .collect();
                GpuStatus {
                    index: g.index,
                    uuid: g.uuid.clone(),
                    model: g.model.clone(),
                    minor: g.minor,
                    memory_mib: g.memory_mib,
                    mig_enabled: g.mig_enabled,
                    state: if g.mig_enabled {
                        DeviceState::MigParent
                    } else {
                        state_of(&g.uuid, &holder)
                    },
                    holder,
                    lifecycle: life(&g.uuid),
                    instances,
                }
            })
            .collect();
        let mps_shares = self
            .mps
            .shares()
            .into_iter()
            .map(|sh| MpsShareStatus {
                device: sh.device,
                tenant: sh.tenant,
                percent: sh.percent,
                mem_limit_bytes: sh.mem_limit_bytes,
                pid: sh.pid,
                state: serde_json::to_value(&sh.state)
                    .ok()
                    .and_then(|v| v.get("state").and_then(|s| s.as_str()).map(str::to_string))
                    .unwrap_or_else(|| format!("{:?}", sh.state).to_lowercase()),
                holders: sh.holders,
                restarts: sh.restarts,
                cap_drifts: sh.cap_drifts,
            })
            .collect();
        let events = self
            .store
            .recent_events(20)
            .map_err(internal)?
            .into_iter()
            .map(|e| EventStatus {
                ts_ms: e.ts_ms,
                kind: e.kind,
                container_id: e.container_id,
                workload: e.workload,
                detail: e.detail,
            })
            .collect();
        Ok(NodeStatus {
            node: self.inventory.node.clone(),
            backend: self.backend.describe(),
            policy: self.policy.info(),
            gpus,
            allocations,
            mps_shares,
            events,
            reconcile_passes: self.reconcile_passes,
            node_key: self.node_key.clone(),
            mig_cut_on_demand: self.mig_is_dynamic(),
        })
    }
}
