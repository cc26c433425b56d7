//! What the ledger records about one device held by one container.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use tessera_api::cri::Workload;
use tessera_api::Isolation;

use crate::error::LedgerError;

/// The close reason of an interval that was still open when the ledger was reopened:
/// it is closed at its last checkpoint.
pub const RECOVERED_REASON: &str = "recovered at checkpoint after restart";

/// The close reason the daemon uses when the poststop hook releases a container.
pub const POSTSTOP_REASON: &str = "poststop";

/// Most segments a tenant path has: `org/team/project/user`.
pub const MAX_TENANT_SEGMENTS: usize = 4;

/// The price class of a grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Class {
    /// Capacity reserved for the tenant (quota-backed): priced at the reserved rate.
    Guaranteed,
    /// Opportunistic capacity above quota: priced at the burst rate.
    Burst,
}

impl Class {
    pub fn as_str(self) -> &'static str {
        match self {
            Class::Guaranteed => "guaranteed",
            Class::Burst => "burst",
        }
    }
}

impl fmt::Display for Class {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Class {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "guaranteed" => Ok(Class::Guaranteed),
            "burst" => Ok(Class::Burst),
            other => Err(format!("unknown class `{other}`: expected guaranteed or burst")),
        }
    }
}

/// Everything known about a device grant when its interval opens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IntervalStart {
    /// The OCI container id.
    pub container_id: String,
    /// The tenant path, `org/team/project/user` (1 to 4 non-empty segments).
    pub tenant: String,
    /// The node name; part of every interval id.
    pub node: String,
    /// The UUID of the physical GPU.
    pub gpu_uuid: String,
    /// The catalog model name, e.g. `H100-80GB`: what prices are looked up by.
    pub gpu_model: String,
    /// The UUID of what the container holds (`GPU-...`, `MIG-...`; for MPS and shared
    /// grants the GPU's UUID). One open interval per (container, device).
    pub device_uuid: String,
    pub isolation: Isolation,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_profile: Option<String>,
    /// Share of one physical GPU, in (0, 1]: see [`crate::fraction`].
    pub fraction: f64,
    pub class: Class,
    /// The Kubernetes pod container it belongs to, where it is one (usage by namespace and
    /// pod). Display only: who pays is `tenant`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<Workload>,
    /// The NVLink domain every device of the container's multi-GPU grant sits in, as the
    /// placement recorded it in the grant (`None`: a single device, devices in no common
    /// domain, or a node whose topology is unknown). Such intervals carry the policy's
    /// topology premium (`prices.<model>.nvlink_premium_per_gpu_hour`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvlink_domain: Option<u32>,
}

impl IntervalStart {
    /// Checks what the ledger relies on: non-empty ids, a 1-4 segment tenant path, a
    /// fraction in (0, 1].
    pub fn validate(&self) -> Result<(), LedgerError> {
        for (name, v) in [
            ("container_id", &self.container_id),
            ("node", &self.node),
            ("gpu_uuid", &self.gpu_uuid),
            ("gpu_model", &self.gpu_model),
            ("device_uuid", &self.device_uuid),
        ] {
            if v.trim().is_empty() {
                return Err(LedgerError::BadInterval(format!("{name} is empty")));
            }
            if v.chars().any(char::is_control) {
                return Err(LedgerError::BadInterval(format!(
                    "{name} {v:?} contains a control character"
                )));
            }
        }
        validate_tenant(&self.tenant)?;
        if !(self.fraction.is_finite() && self.fraction > 0.0 && self.fraction <= 1.0) {
            return Err(LedgerError::BadInterval(format!(
                "fraction must be in (0, 1], got {} for container {} device {}",
                self.fraction, self.container_id, self.device_uuid
            )));
        }
        if let Some(w) = &self.workload {
            validate_workload(w)?;
        }
        if self.mig_profile.is_some() && self.isolation != Isolation::Mig {
            return Err(LedgerError::BadInterval(format!(
                "mig_profile given for a {} grant",
                self.isolation
            )));
        }
        Ok(())
    }
}

/// Checks a pod container's names as the CRI reading does ([`Workload::validate`]).
fn validate_workload(w: &Workload) -> Result<(), LedgerError> {
    w.validate().map_err(LedgerError::BadInterval)
}

/// Checks a tenant path: 1 to 4 non-empty `/`-separated segments, no whitespace or
/// control characters.
pub fn validate_tenant(tenant: &str) -> Result<(), LedgerError> {
    let segments: Vec<&str> = tenant.split('/').collect();
    if segments.len() > MAX_TENANT_SEGMENTS {
        return Err(LedgerError::BadInterval(format!(
            "tenant {tenant:?} has {} segments; expected 1 to 4 (org/team/project/user)",
            segments.len()
        )));
    }
    if segments.iter().any(|s| s.is_empty()) {
        return Err(LedgerError::BadInterval(format!(
            "tenant {tenant:?} has an empty segment; expected org/team/project/user"
        )));
    }
    if tenant.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(LedgerError::BadInterval(format!(
            "tenant {tenant:?} contains whitespace or a control character"
        )));
    }
    Ok(())
}

/// A ledger interval's id: `<node>-<ledger-id>-<seq>`. `ledger-id` is 12 random hex
/// digits drawn when the ledger file is created and `seq` never repeats within a file,
/// so ids stay unique per node even when a ledger file is replaced; a fleet coordinator
/// can upload by id idempotently.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct IntervalId(pub String);

impl IntervalId {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for IntervalId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// An interval as closed by [`crate::Ledger::close_container`] (or by recovery): what a
/// node uploads, and what its place in the node's hash chain covers
/// ([`ClosedInterval::canonical`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClosedInterval {
    pub id: IntervalId,
    pub start: IntervalStart,
    pub start_wall_ms: u64,
    pub end_wall_ms: u64,
    /// Monotonic end - start when both were read in the same boot, else wall end - start.
    pub duration_ms: u64,
    /// duration in seconds x fraction, unrounded.
    pub gpu_seconds: f64,
    pub reason: String,
    /// A quota reclaim stopped it ([`crate::Ledger::mark_preempted`]): its work is reported
    /// as lost to preemption.
    #[serde(default, skip_serializing_if = "is_false")]
    pub preempted: bool,
    /// What the utilisation sampler saw of it (whole GPUs only; never MIG).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub utilization: Option<Utilization>,
    /// Its link in the node's hash chain (`None`: an interval from before chains, or one
    /// built by hand).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chain: Option<ChainLink>,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// One ledger row, open or closed, with every stored timestamp.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IntervalRecord {
    pub id: IntervalId,
    /// Position in the ledger: strictly increasing in open order, never reused.
    pub seq: u64,
    pub start: IntervalStart,
    pub start_boot_id: String,
    pub start_wall_ms: u64,
    pub start_mono_ms: u64,
    pub checkpoint_boot_id: String,
    pub checkpoint_wall_ms: u64,
    pub checkpoint_mono_ms: u64,
    /// `None` while open.
    pub end: Option<IntervalEnd>,
    /// `None` where no sample was taken (not available, or not sampled yet).
    #[serde(default)]
    pub utilization: Option<Utilization>,
    /// When a quota reclaim chose it as a victim (Unix ms), if one did while it was open.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preempted_ms: Option<u64>,
    /// Its link in the hash chain, once closed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chain: Option<ChainLink>,
}

impl IntervalRecord {
    /// The row as a closed interval (what is chained and uploaded); `None` while open.
    pub fn closed(&self) -> Option<ClosedInterval> {
        let end = self.end.as_ref()?;
        Some(ClosedInterval {
            id: self.id.clone(),
            start: self.start.clone(),
            start_wall_ms: self.start_wall_ms,
            end_wall_ms: end.wall_ms,
            duration_ms: end.duration_ms,
            gpu_seconds: end.gpu_seconds,
            reason: end.reason.clone(),
            preempted: self.preempted_ms.is_some(),
            utilization: self.utilization.clone(),
            chain: self.chain.clone(),
        })
    }
}

/// What the utilisation sampler saw of an interval (where NVML offers it: whole GPUs,
/// including MPS and time-sliced ones; never MIG).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Utilization {
    pub samples: u64,
    /// Mean SM percent of the whole GPU used by the container's processes.
    pub sm_percent_avg: f64,
    /// The highest sample (`None` for samples recorded before peaks were kept).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sm_percent_max: Option<f64>,
}

/// How and when an interval was closed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IntervalEnd {
    pub boot_id: String,
    pub wall_ms: u64,
    pub mono_ms: u64,
    pub duration_ms: u64,
    pub gpu_seconds: f64,
    pub reason: String,
}

/// A reading of the clock: what every stored timestamp is made of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Stamp {
    pub boot: String,
    pub wall_ms: u64,
    pub mono_ms: u64,
}

/// The duration between two stamps: the monotonic delta when both come from the same
/// boot (immune to wall-clock steps), else the wall delta (saturating at 0).
pub(crate) fn duration_ms(start: &Stamp, end: &Stamp) -> u64 {
    if start.boot == end.boot && end.mono_ms >= start.mono_ms {
        end.mono_ms - start.mono_ms
    } else {
        end.wall_ms.saturating_sub(start.wall_ms)
    }
}

/// One interval's place in its ledger's chain (`crate::chain` makes and checks them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChainLink {
    /// 1, 2, 3, ... in close order, without gaps.
    pub seq: u64,
    /// The previous link's hash (the genesis hash for seq 1), lowercase hex.
    pub prev: String,
    /// sha256(prev + "\n" + canonical), lowercase hex.
    pub hash: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stamp(boot: &str, wall_ms: u64, mono_ms: u64) -> Stamp {
        Stamp { boot: boot.to_string(), wall_ms, mono_ms }
    }

    #[test]
    fn durations_prefer_monotonic_time_within_a_boot() {
        // NTP stepped the wall clock back an hour: mono still says 90 s.
        assert_eq!(duration_ms(&stamp("b", 10_000_000, 0), &stamp("b", 6_490_000, 90_000)), 90_000);
        // Different boots: mono readings are unrelated, use the wall delta.
        assert_eq!(duration_ms(&stamp("a", 1_000, 500_000), &stamp("b", 61_000, 10)), 60_000);
        // Wall went backwards across boots: never negative.
        assert_eq!(duration_ms(&stamp("a", 61_000, 0), &stamp("b", 1_000, 0)), 0);
    }

    #[test]
    fn tenants_have_one_to_four_segments() {
        for ok in ["acme", "acme/ml", "acme/ml/vision", "acme/ml/vision/alice"] {
            assert!(validate_tenant(ok).is_ok(), "{ok}");
        }
        for bad in ["", "/acme", "acme/", "a//b", "a/b/c/d/e", "acme/m l", "a\tb"] {
            assert!(validate_tenant(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn class_is_lowercase_on_the_wire() {
        assert_eq!(serde_json::to_string(&Class::Burst).expect("json"), "\"burst\"");
        assert_eq!("guaranteed".parse::<Class>(), Ok(Class::Guaranteed));
        assert!("Burst".parse::<Class>().is_err());
    }
}
