//! The policy's node-health sections (issue 26): what a fault does (`faults`), how
//! topology shapes placement (`topology`), and how interference between co-located
//! tenants is detected and answered (`interference`). Raw types as written (unknown fields
//! refused), the built settings, and their checks with JSON paths.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::raw::{Object, UniqueMap};
use crate::validate::Problem;

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

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawFaults {
    #[serde(default)]
    pub ignore_xids: Vec<u64>,
    #[serde(default)]
    pub stop_holders: Option<bool>,
    #[serde(default)]
    pub grace_s: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawTopology {
    #[serde(default)]
    pub isolate_nvlink_domains: Option<bool>,
    #[serde(default)]
    pub pin_cpus: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawInterference {
    #[serde(default)]
    pub enabled: Option<bool>,
    #[serde(default)]
    pub classes: UniqueMap<WorkloadClass>,
    #[serde(default)]
    pub min_share: Option<f64>,
    #[serde(default)]
    pub saturation: Option<f64>,
    #[serde(default)]
    pub confirm_samples: Option<u32>,
    #[serde(default)]
    pub clear_samples: Option<u32>,
    #[serde(default)]
    pub throttle_factor_percent: Option<u8>,
    #[serde(default)]
    pub min_percent: Option<u8>,
    #[serde(default)]
    pub anti_affinity: Option<bool>,
    #[serde(default)]
    pub harden: Option<bool>,
    #[serde(default)]
    pub stop_after_samples: Option<u32>,
    #[serde(default)]
    pub stop_grace_s: Option<u64>,
}

fn problem(path: &str, message: String) -> Problem {
    Problem { path: path.to_string(), message }
}

/// The longest grace a fault or interference stop may wait (as revoke's).
const MAX_GRACE_S: u64 = 300;

pub(crate) fn build_faults(raw: Option<&Object<RawFaults>>) -> Result<FaultSettings, Problem> {
    let mut out = FaultSettings::default();
    let Some(raw) = raw else { return Ok(out) };
    for (i, xid) in raw.ignore_xids.iter().enumerate() {
        if *xid == 0 || *xid > 65_535 {
            return Err(problem(
                &format!("faults.ignore_xids[{i}]"),
                format!("expected an XID from 1 to 65535, got {xid}"),
            ));
        }
        if [48u64, 63, 64, 79, 94, 95].contains(xid) {
            return Err(problem(
                &format!("faults.ignore_xids[{i}]"),
                format!("XID {xid} is a hardware fault; it cannot be ignored"),
            ));
        }
    }
    out.ignore_xids = raw.ignore_xids.clone();
    out.ignore_xids.sort_unstable();
    out.ignore_xids.dedup();
    if let Some(s) = raw.stop_holders {
        out.stop_holders = s;
    }
    if let Some(g) = raw.grace_s {
        out.grace_s = grace("faults.grace_s", g)?;
    }
    Ok(out)
}

fn grace(path: &str, g: u64) -> Result<u64, Problem> {
    if g > MAX_GRACE_S {
        return Err(problem(path, format!("expected 0 to {MAX_GRACE_S} seconds, got {g}")));
    }
    Ok(g)
}

pub(crate) fn build_topology(raw: Option<&Object<RawTopology>>) -> TopologySettings {
    let Some(raw) = raw else { return TopologySettings::default() };
    TopologySettings {
        isolate_nvlink_domains: raw.isolate_nvlink_domains.unwrap_or(false),
        pin_cpus: raw.pin_cpus.unwrap_or(false),
    }
}

pub(crate) fn build_interference(
    raw: Option<&Object<RawInterference>>,
    tenant_known: impl Fn(&str) -> bool,
) -> Result<InterferenceSettings, Problem> {
    let mut out = InterferenceSettings::default();
    let Some(raw) = raw else { return Ok(out) };
    if let Some(e) = raw.enabled {
        out.enabled = e;
    }
    for (prefix, class) in &raw.classes.0 {
        let at = format!("interference.classes.{prefix}");
        if !tenant_known(prefix) {
            return Err(problem(&at, format!("`{prefix}` is no tenant of this policy")));
        }
        out.classes.insert(prefix.clone(), *class);
    }
    let fraction = |path: &str, v: Option<f64>, default: f64| -> Result<f64, Problem> {
        match v {
            None => Ok(default),
            Some(f) if f.is_finite() && f > 0.0 && f < 1.0 => Ok(f),
            Some(f) => Err(problem(path, format!("expected a fraction in (0, 1), got {f}"))),
        }
    };
    out.min_share = fraction("interference.min_share", raw.min_share, out.min_share)?;
    out.saturation = fraction("interference.saturation", raw.saturation, out.saturation)?;
    let samples = |path: &str, v: Option<u32>, default: u32| -> Result<u32, Problem> {
        match v {
            None => Ok(default),
            Some(n) if (1..=1000).contains(&n) => Ok(n),
            Some(n) => Err(problem(path, format!("expected 1 to 1000 samples, got {n}"))),
        }
    };
    out.confirm_samples =
        samples("interference.confirm_samples", raw.confirm_samples, out.confirm_samples)?;
    out.clear_samples =
        samples("interference.clear_samples", raw.clear_samples, out.clear_samples)?;
    if raw.stop_after_samples.is_some() {
        out.stop_after_samples =
            Some(samples("interference.stop_after_samples", raw.stop_after_samples, 0)?);
    }
    if let Some(f) = raw.throttle_factor_percent {
        if f >= 100 {
            return Err(problem(
                "interference.throttle_factor_percent",
                format!("expected 0 (no throttle) to 99 percent, got {f}"),
            ));
        }
        out.throttle_factor_percent = f;
    }
    if let Some(m) = raw.min_percent {
        if !(1..=100).contains(&m) {
            return Err(problem(
                "interference.min_percent",
                format!("expected a percentage from 1 to 100, got {m}"),
            ));
        }
        out.min_percent = m;
    }
    if let Some(a) = raw.anti_affinity {
        out.anti_affinity = a;
    }
    if let Some(h) = raw.harden {
        out.harden = h;
    }
    if let Some(g) = raw.stop_grace_s {
        out.stop_grace_s = grace("interference.stop_grace_s", g)?;
    }
    Ok(out)
}
