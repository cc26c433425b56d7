//! Who uses which device how: pure bookkeeping over the recorded allocations, feeding the
//! device choices. A device is used exclusively (whole GPU, MIG instance), or shared by
//! MPS containers, or by time-sliced containers — never two of these at once.

use std::collections::{BTreeMap, BTreeSet};

use mpsd::{MpsDeviceLoad, MpsShareLoad, SharedDeviceLoad};
use slicer::{Found, Inventory};
use tessera_api::{Allocation, GrantedDevice, Isolation};

/// How every device is used right now.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct DeviceUse {
    pub exclusive: BTreeSet<String>,
    /// Device -> one booking per MPS container.
    pub mps: BTreeMap<String, Vec<MpsShareLoad>>,
    /// Device -> (containers, their sharing domain).
    pub shared: BTreeMap<String, (u32, String)>,
}

impl DeviceUse {
    pub fn of(allocations: &[Allocation]) -> DeviceUse {
        let mut u = DeviceUse::default();
        for a in allocations {
            match &a.share {
                Some(s) if s.kind == Isolation::Mps => {
                    u.mps.entry(s.device.clone()).or_default().push(MpsShareLoad {
                        tenant: a.tenant.to_string(),
                        percent: s.percent.unwrap_or(100),
                    })
                }
                Some(s) => {
                    let e = u
                        .shared
                        .entry(s.device.clone())
                        .or_insert((0, s.domain.clone().unwrap_or_default()));
                    e.0 += 1;
                }
                None => u.exclusive.extend(a.devices.iter().map(|d| d.uuid.to_string())),
            }
        }
        u
    }

    /// Devices an exclusive request must not get: anything in use in any way.
    pub fn busy(&self) -> BTreeSet<String> {
        let mut b = self.exclusive.clone();
        b.extend(self.mps.keys().cloned());
        b.extend(self.shared.keys().cloned());
        b
    }

    /// MPS candidates: whole GPUs (not in MIG mode) and MIG instances that nobody holds
    /// exclusively and that are not time-sliced, whole GPUs first.
    pub fn mps_loads(&self, inv: &Inventory) -> Vec<MpsDeviceLoad> {
        let whole = inv.gpus.iter().filter(|g| !g.mig_enabled).map(|g| &g.uuid);
        let instances = inv.gpus.iter().flat_map(|g| g.instances.iter().map(|i| &i.uuid));
        whole
            .chain(instances)
            .filter(|u| !self.exclusive.contains(*u) && !self.shared.contains_key(*u))
            .map(|u| MpsDeviceLoad {
                uuid: u.clone(),
                shares: self.mps.get(u).cloned().unwrap_or_default(),
            })
            .collect()
    }

    /// Time-slicing candidates: whole GPUs nobody holds exclusively or through MPS.
    pub fn shared_loads(&self, inv: &Inventory, replicas: u32) -> Vec<SharedDeviceLoad> {
        inv.gpus
            .iter()
            .filter(|g| {
                !g.mig_enabled
                    && !self.exclusive.contains(&g.uuid)
                    && !self.mps.contains_key(&g.uuid)
            })
            .map(|g| {
                let (used, domain) =
                    self.shared.get(&g.uuid).cloned().unwrap_or((0, String::new()));
                SharedDeviceLoad {
                    uuid: g.uuid.clone(),
                    replicas,
                    used,
                    domain: (used > 0).then_some(domain),
                }
            })
            .collect()
    }
}

/// The grant record of one device of the inventory.
pub fn granted(inv: &Inventory, uuid: &str) -> Option<GrantedDevice> {
    inv.find(uuid).and_then(|f| f.granted().ok())
}

/// Memory of a device in bytes (a GPU's, or a MIG instance's).
pub fn memory_bytes(inv: &Inventory, uuid: &str) -> Option<u64> {
    match inv.find(uuid)? {
        Found::Gpu(g) => Some(g.memory_mib * 1024 * 1024),
        Found::Mig(_, i) => Some(i.memory_mib * 1024 * 1024),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_api::{AllocationState, GpuRequest, Injection, ShareGrant};

    fn inv() -> Inventory {
        let dir = tempfile::tempdir().expect("tempdir");
        let node = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../examples/nodes/h100x8.json");
        slicer::SimBackend::open(&node, dir.path())
            .and_then(|b| slicer::GpuBackend::inventory(&b))
            .expect("inventory")
    }

    fn alloc(
        id: &str,
        tenant: &str,
        iso: Isolation,
        device: &str,
        share: Option<ShareGrant>,
    ) -> Allocation {
        Allocation {
            container_id: id.parse().expect("valid"),
            tenant: tenant.parse().expect("valid"),
            trust: "dev".parse().expect("valid"),
            request: GpuRequest::Shared,
            isolation: iso,
            devices: vec![GrantedDevice {
                uuid: device.parse().expect("uuid"),
                gpu_uuid: device.parse().expect("uuid"),
                gpu_index: 0,
                model: "H100-80GB".into(),
                mig_profile: None,
                placement: None,
            }],
            injection: Injection::default(),
            workload: None,
            quota: None,
            topology: None,
            class: None,
            state: AllocationState::Running,
            pid: None,
            created_ms: 0,
            share,
            nvlink_domain: None,
        }
    }

    #[test]
    fn a_device_is_used_one_way_at_a_time() {
        let inv = inv();
        let whole: Vec<String> =
            inv.gpus.iter().filter(|g| !g.mig_enabled).map(|g| g.uuid.clone()).collect();
        let mps = |d: &str, p: u8| {
            Some(ShareGrant {
                kind: Isolation::Mps,
                device: d.into(),
                percent: Some(p),
                mem_limit_bytes: None,
                domain: None,
                replicas: None,
            })
        };
        let ts = |d: &str| {
            Some(ShareGrant {
                kind: Isolation::Shared,
                device: d.into(),
                percent: None,
                mem_limit_bytes: None,
                domain: Some("nb".into()),
                replicas: Some(4),
            })
        };
        let allocs = vec![
            alloc("x", "a", Isolation::Gpu, &whole[0], None),
            alloc("m1", "a", Isolation::Mps, &whole[1], mps(&whole[1], 50)),
            alloc("m2", "b", Isolation::Mps, &whole[1], mps(&whole[1], 25)),
            alloc("s1", "c", Isolation::Shared, &whole[2], ts(&whole[2])),
        ];
        let u = DeviceUse::of(&allocs);
        assert_eq!(
            u.busy(),
            [whole[0].clone(), whole[1].clone(), whole[2].clone()].into_iter().collect()
        );
        let mps_loads = u.mps_loads(&inv);
        assert!(
            mps_loads.iter().all(|l| l.uuid != whole[0] && l.uuid != whole[2]),
            "exclusive and time-sliced GPUs are no MPS candidates"
        );
        let on1 = mps_loads.iter().find(|l| l.uuid == whole[1]).expect("MPS GPU listed");
        assert_eq!(on1.used(), 75);
        let sl = u.shared_loads(&inv, 4);
        assert!(sl.iter().all(|l| l.uuid != whole[0] && l.uuid != whole[1]));
        let s2 = sl.iter().find(|l| l.uuid == whole[2]).expect("shared GPU listed");
        assert_eq!((s2.used, s2.domain.as_deref()), (1, Some("nb")));
        assert!(mps_loads.iter().any(|l| l.uuid.starts_with("MIG-")), "MIG instances can host MPS");
    }

    #[test]
    fn granted_and_memory_describe_gpus_and_instances() {
        let inv = inv();
        let g = inv.gpus.iter().find(|g| g.mig_enabled).expect("mig gpu");
        let i = &g.instances[0];
        let d = granted(&inv, &i.uuid).expect("instance");
        assert_eq!(
            (d.gpu_uuid.as_str(), d.mig_profile.as_deref()),
            (g.uuid.as_str(), Some(i.profile.as_str()))
        );
        assert_eq!(memory_bytes(&inv, &i.uuid), Some(i.memory_mib << 20));
        assert!(granted(&inv, "GPU-nope").is_none());
    }
}
