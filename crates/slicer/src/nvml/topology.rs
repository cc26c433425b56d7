//! The node's GPU topology through NVML and sysfs (read-only).
//!
//! NVLink: for each link of each GPU that NVML says is active, the remote end's PCI
//! address names another GPU of the node (a direct link) or not (an NVSwitch: every GPU
//! wired to a switch is in one domain). NUMA node and local CPUs: the GPU's PCI device in
//! sysfs (`/sys/bus/pci/devices/<domain:bus:device.function>/numa_node`, `local_cpulist`);
//! a `numa_node` of -1 (one node, or the firmware does not say) is none.

use std::path::Path;

use nvml_wrapper::error::NvmlError;
use nvml_wrapper_sys::bindings::NVML_NVLINK_MAX_LINKS;

use super::{nvml_err, NvmlBackend};
use crate::backend::BackendError;
use crate::topology::{domains_from_links, parse_cpulist, render_cpulist, GpuTopology, Topology};

/// Where the PCI devices are in sysfs.
pub const SYSFS_PCI_DEVICES: &str = "/sys/bus/pci/devices";

/// `0000:3b:00.0` from a bus, device and domain (function 0: a GPU's own function).
fn sysfs_name(domain: u32, bus: u32, device: u32) -> String {
    format!("{domain:04x}:{bus:02x}:{device:02x}.0")
}

/// The NUMA node and CPU list of PCI device `name` under `root` (missing files: none).
pub fn pci_locality(root: &Path, name: &str) -> (Option<u32>, Option<String>) {
    let dir = root.join(name);
    let numa = std::fs::read_to_string(dir.join("numa_node"))
        .ok()
        .and_then(|t| t.trim().parse::<i64>().ok())
        .and_then(|n| u32::try_from(n).ok());
    let cpus = std::fs::read_to_string(dir.join("local_cpulist"))
        .ok()
        .and_then(|t| parse_cpulist(&t).ok())
        .filter(|c| !c.is_empty())
        .map(|c| render_cpulist(&c));
    (numa, cpus)
}

impl NvmlBackend {
    pub(super) fn read_topology(&self) -> Result<Topology, BackendError> {
        let count = self.nvml.device_count().map_err(nvml_err("nvmlDeviceGetCount"))?;
        let mut uuids = Vec::new();
        let mut addrs = Vec::new();
        let mut local = Vec::new();
        for index in 0..count {
            let dev =
                self.nvml.device_by_index(index).map_err(nvml_err("nvmlDeviceGetHandleByIndex"))?;
            uuids.push(dev.uuid().map_err(nvml_err("nvmlDeviceGetUUID"))?);
            let pci = dev.pci_info().map_err(nvml_err("nvmlDeviceGetPciInfo"))?;
            let name = sysfs_name(pci.domain, pci.bus, pci.device);
            local.push(pci_locality(Path::new(SYSFS_PCI_DEVICES), &name));
            addrs.push((pci.domain, pci.bus, pci.device));
        }
        let mut links = Vec::new();
        let mut switched = Vec::new();
        for index in 0..count {
            let dev =
                self.nvml.device_by_index(index).map_err(nvml_err("nvmlDeviceGetHandleByIndex"))?;
            for l in 0..NVML_NVLINK_MAX_LINKS {
                let link = dev.link_wrapper_for(l);
                match link.is_active() {
                    Ok(true) => {}
                    Ok(false) => continue,
                    // No NVLink on this GPU, or no more links.
                    Err(NvmlError::NotSupported | NvmlError::InvalidArg) => break,
                    Err(e) => return Err(nvml_err("nvmlDeviceGetNvLinkState")(e)),
                }
                let remote =
                    link.remote_pci_info().map_err(nvml_err("nvmlDeviceGetNvLinkRemotePciInfo"))?;
                let at = (remote.domain, remote.bus, remote.device);
                match addrs.iter().position(|a| *a == at) {
                    Some(peer) => links.push((index as usize, peer)),
                    None => switched.push(index as usize),
                }
            }
        }
        switched.sort_unstable();
        switched.dedup();
        let domains = domains_from_links(uuids.len(), &links, &switched);
        Ok(Topology {
            gpus: uuids
                .into_iter()
                .zip(domains)
                .zip(local)
                .map(|((uuid, nvlink_domain), (numa_node, cpus))| GpuTopology {
                    uuid,
                    nvlink_domain,
                    numa_node,
                    cpus,
                })
                .collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locality_comes_from_the_pci_devices_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let name = sysfs_name(0, 0x3b, 0);
        assert_eq!(name, "0000:3b:00.0");
        std::fs::create_dir_all(dir.path().join(&name)).expect("mkdir");
        std::fs::write(dir.path().join(&name).join("numa_node"), "1\n").expect("numa");
        std::fs::write(dir.path().join(&name).join("local_cpulist"), "16-31,48-63\n")
            .expect("cpus");
        assert_eq!(pci_locality(dir.path(), &name), (Some(1), Some("16-31,48-63".into())));
        std::fs::write(dir.path().join(&name).join("numa_node"), "-1\n").expect("numa");
        assert_eq!(pci_locality(dir.path(), &name).0, None, "-1: no NUMA node");
        assert_eq!(pci_locality(dir.path(), "0000:00:00.0"), (None, None));
    }
}
