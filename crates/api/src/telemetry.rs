//! Telemetry on the wire: what the backend measures of a GPU, a MIG instance and the
//! processes on them (`slicer::GpuBackend::device_telemetry`, `process_telemetry`), and
//! `GET /v1/telemetry`: the node's devices and who uses what on each now, with the
//! interference incidents open (`tessera top`).

use serde::{Deserialize, Serialize};

/// Where a device's activity numbers come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// GPM metrics (Hopper and later).
    Gpm,
    /// NVML utilisation rates (time-based: a kernel running, memory busy).
    Utilization,
    /// The simulated node's contention model.
    Sim,
}

/// One GPU or MIG instance, now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceTelemetry {
    /// The device (`GPU-...` or `MIG-...`).
    pub uuid: String,
    /// Its physical GPU.
    pub gpu_uuid: String,
    pub source: Source,
    /// SM activity, 0..=1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sm_active: Option<f64>,
    /// Device-memory (DRAM) activity or bandwidth utilisation, 0..=1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dram_active: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pcie_tx_bytes_per_s: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pcie_rx_bytes_per_s: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvlink_tx_bytes_per_s: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvlink_rx_bytes_per_s: Option<u64>,
    /// Board power (GPU only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_watts: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sm_clock_mhz: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_clock_mhz: Option<u32>,
    /// Why the clocks are held below their maximum now (`sw_power_cap`, `hw_slowdown`,
    /// ...; `gpu_idle` is left out), as a bitmask (NVML's) and as names.
    #[serde(default)]
    pub throttle_mask: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub throttle_reasons: Vec<String>,
    /// Volatile ECC counts (GPU only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ecc_corrected: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ecc_uncorrected: Option<u64>,
}

impl DeviceTelemetry {
    /// A device with nothing measured yet.
    pub fn empty(uuid: &str, gpu_uuid: &str, source: Source) -> DeviceTelemetry {
        DeviceTelemetry {
            uuid: uuid.to_string(),
            gpu_uuid: gpu_uuid.to_string(),
            source,
            sm_active: None,
            dram_active: None,
            pcie_tx_bytes_per_s: None,
            pcie_rx_bytes_per_s: None,
            nvlink_tx_bytes_per_s: None,
            nvlink_rx_bytes_per_s: None,
            power_watts: None,
            sm_clock_mhz: None,
            mem_clock_mhz: None,
            throttle_mask: 0,
            throttle_reasons: Vec::new(),
            ecc_corrected: None,
            ecc_uncorrected: None,
        }
    }
}

/// One process on a device, now (fractions of the device).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ProcessTelemetry {
    pub pid: u32,
    /// SM utilisation by this process, 0..=1.
    pub sm: f64,
    /// Memory (controller) utilisation by this process, 0..=1: its bandwidth share.
    pub mem: f64,
}

/// NVML's clock throttle reason bits and their names (`nvmlClocksThrottleReason*`; user
/// defined clocks is the applications clocks bit).
pub const THROTTLE_REASONS: [(u64, &str); 9] = [
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
];

/// The names of the reasons in `mask`, leaving out `gpu_idle` (an idle GPU is not held
/// back); unknown bits as `0x...`.
pub fn throttle_names(mask: u64) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = mask & !0x1;
    for (bit, name) in THROTTLE_REASONS.iter().skip(1) {
        if rest & bit != 0 {
            out.push((*name).to_string());
            rest &= !bit;
        }
    }
    if rest != 0 {
        out.push(format!("{rest:#x}"));
    }
    out
}

/// One container's use of its device now (`GET /v1/telemetry`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ContainerUsage {
    pub container_id: String,
    pub tenant: String,
    /// `namespace/pod/container` of a pod's container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<String>,
    /// The device it holds (or shares).
    pub device: String,
    pub isolation: crate::Isolation,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<crate::WorkloadClass>,
    /// Its processes' SM and memory utilisation (fractions of the device); `None` where
    /// the backend cannot tell (MIG: use the instance's figures).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sm: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem: Option<f64>,
    /// Its MPS active thread percentage now (its booking, or lower once throttled).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mps_threads: Option<u8>,
    /// The latency it reported itself (ms), where it reports one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<f64>,
}

/// An interference incident open now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IncidentStatus {
    pub device: String,
    pub victim: String,
    pub victim_tenant: String,
    pub aggressor: String,
    pub aggressor_tenant: String,
    /// `memory-bandwidth` or `sm`.
    pub signal: String,
    /// The victim's throughput as a fraction of its solo baseline, last seen.
    pub share: f64,
    pub opened_ms: u64,
    /// The steps taken (`throttle 75->37`, `anti-affinity`, `harden`, `stop`).
    #[serde(default)]
    pub steps: Vec<String>,
}

/// `GET /v1/telemetry`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeTelemetry {
    pub node: String,
    /// When the last sample was taken (Unix ms; 0 before the first).
    pub at_ms: u64,
    /// Samples taken since tesserad started: what a caller waits on.
    pub samples: u64,
    #[serde(default)]
    pub devices: Vec<DeviceTelemetry>,
    #[serde(default)]
    pub containers: Vec<ContainerUsage>,
    #[serde(default)]
    pub incidents: Vec<IncidentStatus>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throttle_reasons_are_named_and_idle_is_not_one() {
        assert!(throttle_names(0x1).is_empty());
        assert_eq!(throttle_names(0x4 | 0x40 | 0x1), ["sw_power_cap", "hw_thermal_slowdown"]);
        assert_eq!(throttle_names(0x8000), ["0x8000"]);
    }
}
