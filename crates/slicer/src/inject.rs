//! What a container needs to use its granted devices: device nodes and environment.
//! Pure: the inventory says which minors and majors; nothing here touches the host.

use std::collections::BTreeSet;

use tessera_api::{DeviceNode, GrantedDevice, Injection};

use crate::inventory::{Found, Inventory, NVIDIACTL_MINOR};

/// Mode of every injected device node.
pub const DEVICE_MODE: u32 = 0o666;
/// Lowest cap minor an access capability can have: 1 and 2 are `config` and `monitor`.
const FIRST_ACCESS_CAP_MINOR: u32 = 3;

/// Why an injection cannot be built. Every case fails closed: no partial injection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InjectError {
    #[error("no devices to inject")]
    NoDevices,
    #[error("device {0} is not in the node's inventory")]
    UnknownDevice(String),
    #[error("device {uuid}: granted as GPU {granted} but the inventory has it on GPU {actual}")]
    WrongParent { uuid: String, granted: String, actual: String },
    #[error("GPU {0} is in MIG mode; it is handed out only by MIG instance, never whole")]
    MigParent(String),
    #[error("MIG instance {0} needs capability devices but the driver has no nvidia-caps major")]
    NoCapsMajor(String),
    #[error("MIG instance {uuid}: cap minor {minor} is not an access capability")]
    BadCapMinor { uuid: String, minor: u32 },
    #[error("two device nodes at {0} with different numbers")]
    Conflict(String),
}

/// Everything the container needs for these devices: `/dev/nvidiactl` (195,255),
/// `/dev/nvidia-uvm` (uvm,0), `/dev/nvidia-uvm-tools` (uvm,1), each parent
/// `/dev/nvidia<minor>` (195,minor), and for MIG only that instance's GI and CI caps
/// `/dev/nvidia-caps/nvidia-cap<M>` (caps major, M). Mode 0o666. Env:
/// `CUDA_VISIBLE_DEVICES` and `NVIDIA_VISIBLE_DEVICES` = the granted uuids, comma
/// separated, in grant order. No mounts. Devices sorted and deduplicated.
pub fn injection(inv: &Inventory, devices: &[GrantedDevice]) -> Result<Injection, InjectError> {
    if devices.is_empty() {
        return Err(InjectError::NoDevices);
    }
    let majors = inv.majors;
    let node = |path: String, major: u32, minor: u32| DeviceNode {
        path,
        major: i64::from(major),
        minor: i64::from(minor),
        file_mode: DEVICE_MODE,
    };
    let mut nodes: BTreeSet<DeviceNode> = BTreeSet::new();
    nodes.insert(node("/dev/nvidiactl".into(), majors.nvidia, NVIDIACTL_MINOR));
    nodes.insert(node("/dev/nvidia-uvm".into(), majors.nvidia_uvm, 0));
    nodes.insert(node("/dev/nvidia-uvm-tools".into(), majors.nvidia_uvm, 1));
    let mut uuids: Vec<&str> = Vec::new();
    for dev in devices {
        let found =
            inv.find(&dev.uuid).ok_or_else(|| InjectError::UnknownDevice(dev.uuid.to_string()))?;
        let gpu = match found {
            Found::Gpu(gpu) => gpu,
            Found::Mig(gpu, _) => gpu,
        };
        if gpu.uuid != dev.gpu_uuid {
            return Err(InjectError::WrongParent {
                uuid: dev.uuid.to_string(),
                granted: dev.gpu_uuid.to_string(),
                actual: gpu.uuid.clone(),
            });
        }
        nodes.insert(node(format!("/dev/nvidia{}", gpu.minor), majors.nvidia, gpu.minor));
        match found {
            Found::Gpu(gpu) if gpu.mig_enabled => {
                return Err(InjectError::MigParent(gpu.uuid.clone()))
            }
            Found::Gpu(_) => {}
            Found::Mig(_, inst) => {
                let caps = majors
                    .nvidia_caps
                    .ok_or_else(|| InjectError::NoCapsMajor(inst.uuid.clone()))?;
                for minor in [inst.gi_cap_minor, inst.ci_cap_minor] {
                    if minor < FIRST_ACCESS_CAP_MINOR {
                        return Err(InjectError::BadCapMinor { uuid: inst.uuid.clone(), minor });
                    }
                    nodes.insert(node(format!("/dev/nvidia-caps/nvidia-cap{minor}"), caps, minor));
                }
            }
        }
        if !uuids.contains(&dev.uuid.as_str()) {
            uuids.push(&dev.uuid);
        }
    }
    let nodes: Vec<DeviceNode> = nodes.into_iter().collect();
    if let Some(w) = nodes.windows(2).find(|w| w[0].path == w[1].path) {
        return Err(InjectError::Conflict(w[0].path.clone()));
    }
    let list = uuids.join(",");
    Ok(Injection {
        devices: nodes,
        env: vec![format!("CUDA_VISIBLE_DEVICES={list}"), format!("NVIDIA_VISIBLE_DEVICES={list}")],
        mounts: Vec::new(),
        gpu_majors: majors.all().into_iter().map(i64::from).collect(),
        cpuset: None,
    })
}
