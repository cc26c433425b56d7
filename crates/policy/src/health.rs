//! The policy's node-health sections (issue 26): what a fault does (`faults`), how
//! topology shapes placement (`topology`), and how interference between co-located
//! tenants is detected and answered (`interference`), as built (the raw types are in
//! `raw.rs`, the checks in `validate/health.rs`).

use std::collections::BTreeMap;

use serde::Serialize;

/// `faults`: what an XID fault does beyond the quarantine.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FaultSettings {
    /// XIDs treated as the application's own (nothing quarantined; holders told), on top
    /// of those NVIDIA's catalogue names (`slicer::xid::APPLICATION_XIDS`).
    pub ignore_xids: Vec<u64>,
    /// Stop the containers on a quarantined device (SIGTERM, `grace_s`, SIGKILL), as
    /// revoke does. Off: they are told (an `xid` event naming each) and run on.
    pub stop_holders: bool,
    pub grace_s: u64,
}

impl Default for FaultSettings {
    fn default() -> Self {
        FaultSettings { ignore_xids: Vec::new(), stop_holders: false, grace_s: 30 }
    }
}

/// `topology`: how the node's NVLink and NUMA layout shapes placement.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TopologySettings {
    /// A whole GPU (exclusive, MPS or time-sliced) never goes to a tenant while another
    /// tenant holds a GPU of the same NVLink domain.
    pub isolate_nvlink_domains: bool,
    /// A container's CPU set and memory nodes follow its GPUs' NUMA node (the grant's
    /// injection carries them; tessera-runtime writes them into the config).
    pub pin_cpus: bool,
}

pub use tessera_api::WorkloadClass;

/// The annotation a container declares its class with.
pub const CLASS_ANNOTATION: &str = "tessera.io/class";

/// `interference`: detection thresholds and the steps of the answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct InterferenceSettings {
    /// Detect and answer at all (default on).
    pub enabled: bool,
    /// Tenant path prefix -> the class of its containers that declare none (longest
    /// prefix wins). Unlisted and undeclared: batch.
    pub classes: BTreeMap<String, WorkloadClass>,
    /// A latency container whose throughput falls below this fraction of its solo
    /// throughput is degraded.
    pub min_share: f64,
    /// Device memory bandwidth or SM activity at or above this fraction is saturated.
    pub saturation: f64,
    /// Consecutive degraded samples before an alarm.
    pub confirm_samples: u32,
    /// Consecutive healthy samples before an alarm clears.
    pub clear_samples: u32,
    /// Step 1 lowers the aggressor's MPS active thread percentage just enough to end the
    /// saturation (`interference::respond::throttle_target`), but one step never below
    /// this percent of what it was (0: no throttle step)...
    pub throttle_factor_percent: u8,
    /// ...but never set below this.
    pub min_percent: u8,
    /// Step 2: the pair is kept apart in later placements.
    pub anti_affinity: bool,
    /// Step 3: the victim's next start asks for a MIG instance (or a whole GPU) where its
    /// tier allows.
    pub harden: bool,
    /// Step 4: stop the aggressor if the alarm still holds this many samples after the
    /// throttle. `None`: never.
    pub stop_after_samples: Option<u32>,
    pub stop_grace_s: u64,
}

impl Default for InterferenceSettings {
    fn default() -> Self {
        InterferenceSettings {
            enabled: true,
            classes: BTreeMap::new(),
            min_share: 0.9,
            saturation: 0.9,
            confirm_samples: 3,
            clear_samples: 3,
            throttle_factor_percent: 50,
            min_percent: 10,
            anti_affinity: true,
            harden: true,
            stop_after_samples: None,
            stop_grace_s: 30,
        }
    }
}

impl InterferenceSettings {
    /// The class of a container of `tenant` that declared `declared` (if anything).
    pub fn class_of(&self, tenant: &str, declared: Option<WorkloadClass>) -> WorkloadClass {
        declared.unwrap_or_else(|| {
            self.classes
                .iter()
                .filter(|(prefix, _)| crate::decide::is_path_prefix(prefix, tenant))
                .max_by_key(|(prefix, _)| prefix.len())
                .map(|(_, c)| *c)
                .unwrap_or(WorkloadClass::Batch)
        })
    }
}
