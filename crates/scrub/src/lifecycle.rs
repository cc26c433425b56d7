//! Which tenant may have a device, decided by pure functions.
//!
//! `Free` (clean) → `Assigned` (tenant, container) → `Dirty` → `Scrubbing` → `Free`, or
//! → `Quarantined` when a scrub fails, times out, covers too little of the memory, or the
//! device reports uncorrectable ECC errors or an XID fault. Only a verified scrub leads back to `Free`;
//! a quarantined device goes back to service only through an operator's unquarantine,
//! which re-scrubs it. A dirty device may go back to its last tenant without a scrub
//! where the policy allows it (`same_tenant_skip`), never to another tenant.
//!
//! Every function here decides; none acts. The daemon checks a transition first, applies
//! its side effect (spawn the scrub, hand out the device), and persists the new state, so
//! the state survives a restart (`serde`, tagged by `state`). A device found `Scrubbing`
//! after a restart had its scrub interrupted: start it again ([`DeviceState::on_scrub_start`]
//! accepts that and counts the attempt).

use std::cmp::Ordering;
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::report::ScrubReport;

/// The lifecycle state of one device (a GPU or a MIG instance).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case", deny_unknown_fields)]
pub enum DeviceState {
    /// Clean: verified zero since its last tenant, or never used.
    Free,
    /// In use by `tenant` through `container_id`.
    Assigned { tenant: String, container_id: String },
    /// Released by `last_tenant`; its memory may hold that tenant's data. An empty
    /// `last_tenant` means the history is unknown (see [`DeviceState::unknown_history`]).
    Dirty { last_tenant: String },
    /// A scrub is running (or was, when the daemon stopped); `attempt` counts from 1.
    Scrubbing { last_tenant: String, attempt: u32 },
    /// Out of service until an operator unquarantines it and a new scrub succeeds.
    Quarantined { reason: String, last_tenant: Option<String> },
}

/// What the scrub policy allows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScrubPolicy {
    /// Fraction of the device memory (`bytes_covered / bytes_total`) a scrub must cover.
    /// The driver keeps part of the memory for the scrubber's own context (a few hundred
    /// MiB), which a small MIG instance feels most: 0.90 passes a 1g.10gb instance.
    pub min_coverage: f64,
    /// Longest a scrub may take; the daemon kills the scrub child after it, and a report
    /// whose `seconds` exceed it is a failure.
    #[serde(rename = "timeout_s", with = "duration_secs")]
    pub timeout: Duration,
    /// Let a dirty device go back to the tenant that last had it without a scrub.
    pub same_tenant_skip: bool,
    /// Scrub starts (interrupted scrubs restarted after a daemon restart included) before
    /// the device is quarantined instead.
    pub max_attempts: u32,
}

impl Default for ScrubPolicy {
    fn default() -> Self {
        ScrubPolicy {
            min_coverage: 0.90,
            timeout: Duration::from_secs(120),
            same_tenant_skip: false,
            max_attempts: 3,
        }
    }
}

impl ScrubPolicy {
    /// Check the numbers make sense (a config error, not a scrub failure).
    pub fn validate(&self) -> Result<(), String> {
        if !(self.min_coverage > 0.0 && self.min_coverage <= 1.0) {
            return Err(format!("min_coverage {} is not in (0, 1]", self.min_coverage));
        }
        if self.timeout.is_zero() {
            return Err("timeout_s must be more than 0".into());
        }
        if self.max_attempts == 0 {
            return Err("max_attempts must be at least 1".into());
        }
        Ok(())
    }

    /// Whether a scrub report proves the device clean; the reason when it does not.
    /// Fails closed: a NaN or otherwise odd number is a failure.
    pub fn judge(&self, report: &ScrubReport) -> Result<(), String> {
        if let Some(e) = &report.error {
            return Err(format!("scrub failed: {e}"));
        }
        if report.nonzero_words > 0 {
            return Err(format!(
                "verify found {} non-zero words after zeroing",
                report.nonzero_words
            ));
        }
        if !report.ok {
            return Err("the scrubber did not report success".into());
        }
        if report.bytes_total == 0 || report.bytes_covered > report.bytes_total {
            return Err(format!(
                "implausible coverage: {} of {} bytes",
                report.bytes_covered, report.bytes_total
            ));
        }
        let coverage = report.coverage();
        // Written so that a NaN anywhere fails.
        if !matches!(
            coverage.partial_cmp(&self.min_coverage),
            Some(Ordering::Greater | Ordering::Equal)
        ) {
            return Err(format!(
                "scrub covered {} of {} bytes ({:.1}%), below the {:.1}% the policy requires",
                report.bytes_covered,
                report.bytes_total,
                coverage * 100.0,
                self.min_coverage * 100.0
            ));
        }
        let limit = self.timeout.as_secs_f64();
        if !matches!(report.seconds.partial_cmp(&limit), Some(Ordering::Less | Ordering::Equal)) {
            return Err(format!(
                "scrub took {:.1} s, over the {:.1} s limit",
                report.seconds,
                self.timeout.as_secs_f64()
            ));
        }
        Ok(())
    }
}

/// Why a device can't go to a tenant now.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotAssignable {
    #[error("device is assigned to tenant `{tenant}` (container {container_id})")]
    InUse { tenant: String, container_id: String },
    #[error("device is dirty (last tenant `{last_tenant}`) and must be scrubbed first")]
    Dirty { last_tenant: String },
    #[error("device is being scrubbed (attempt {attempt})")]
    Scrubbing { attempt: u32 },
    #[error("device is quarantined: {reason}")]
    Quarantined { reason: String },
    #[error("tenant name must not be empty")]
    EmptyTenant,
}

/// An event that the state it came in does not allow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{event} is not allowed while the device is {from}")]
pub struct IllegalTransition {
    /// [`DeviceState::name`] of the state.
    pub from: &'static str,
    /// The event refused.
    pub event: &'static str,
}

/// Everything that happens to a device, for [`DeviceState::apply`].
#[derive(Debug, Clone, PartialEq)]
pub enum DeviceEvent {
    Assign {
        tenant: String,
        container_id: String,
    },
    Release {
        container_id: String,
    },
    ScrubStart,
    ScrubResult(ScrubReport),
    /// The scrub did not produce a report: the child could not start, crashed, or was
    /// killed on timeout.
    ScrubFailed {
        reason: String,
    },
    /// NVML reports uncorrectable ECC errors on the device.
    EccError {
        uncorrectable: u64,
    },
    /// The driver reported a fault (an XID error) that takes the device out of service.
    Fault {
        reason: String,
    },
    UnquarantineRequested,
}

/// Why [`DeviceState::apply`] refused an event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    #[error(transparent)]
    NotAssignable(#[from] NotAssignable),
    #[error(transparent)]
    Illegal(#[from] IllegalTransition),
}

impl fmt::Display for DeviceState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceState::Free => write!(f, "free"),
            DeviceState::Assigned { tenant, container_id } => {
                write!(f, "assigned to {tenant} ({container_id})")
            }
            DeviceState::Dirty { last_tenant } if last_tenant.is_empty() => {
                write!(f, "dirty (history unknown)")
            }
            DeviceState::Dirty { last_tenant } => write!(f, "dirty (last tenant {last_tenant})"),
            DeviceState::Scrubbing { attempt, .. } => write!(f, "scrubbing (attempt {attempt})"),
            DeviceState::Quarantined { reason, .. } => write!(f, "quarantined: {reason}"),
        }
    }
}

impl DeviceState {
    /// The state of a device whose history is not known (first sight on a real host, or
    /// state lost): dirty, with no tenant that could skip the scrub.
    pub fn unknown_history() -> DeviceState {
        DeviceState::Dirty { last_tenant: String::new() }
    }

    /// A short lowercase name: `free`, `assigned`, `dirty`, `scrubbing`, `quarantined`.
    pub fn name(&self) -> &'static str {
        match self {
            DeviceState::Free => "free",
            DeviceState::Assigned { .. } => "assigned",
            DeviceState::Dirty { .. } => "dirty",
            DeviceState::Scrubbing { .. } => "scrubbing",
            DeviceState::Quarantined { .. } => "quarantined",
        }
    }

    /// The tenant whose data the device may hold (assigned, dirty, scrubbing, or
    /// quarantined after a tenant). `None` when free or unknown.
    pub fn last_tenant(&self) -> Option<&str> {
        match self {
            DeviceState::Free => None,
            DeviceState::Assigned { tenant, .. } => Some(tenant),
            DeviceState::Dirty { last_tenant } | DeviceState::Scrubbing { last_tenant, .. } => {
                Some(last_tenant.as_str()).filter(|t| !t.is_empty())
            }
            DeviceState::Quarantined { last_tenant, .. } => {
                last_tenant.as_deref().filter(|t| !t.is_empty())
            }
        }
    }

    /// Whether the daemon should start a scrub of this device now: dirty, or found
    /// scrubbing (an interrupted scrub) after a restart.
    pub fn needs_scrub(&self) -> bool {
        matches!(self, DeviceState::Dirty { .. } | DeviceState::Scrubbing { .. })
    }

    /// Whether `tenant` may be given this device now.
    pub fn can_assign(&self, tenant: &str, policy: &ScrubPolicy) -> Result<(), NotAssignable> {
        if tenant.is_empty() {
            return Err(NotAssignable::EmptyTenant);
        }
        match self {
            DeviceState::Free => Ok(()),
            DeviceState::Dirty { last_tenant }
                if policy.same_tenant_skip && !last_tenant.is_empty() && last_tenant == tenant =>
            {
                Ok(())
            }
            DeviceState::Dirty { last_tenant } => {
                Err(NotAssignable::Dirty { last_tenant: last_tenant.clone() })
            }
            DeviceState::Assigned { tenant, container_id } => Err(NotAssignable::InUse {
                tenant: tenant.clone(),
                container_id: container_id.clone(),
            }),
            DeviceState::Scrubbing { attempt, .. } => {
                Err(NotAssignable::Scrubbing { attempt: *attempt })
            }
            DeviceState::Quarantined { reason, .. } => {
                Err(NotAssignable::Quarantined { reason: reason.clone() })
            }
        }
    }

    /// Give the device to `tenant` for `container_id`.
    pub fn assign(
        &self,
        tenant: &str,
        container_id: &str,
        policy: &ScrubPolicy,
    ) -> Result<DeviceState, NotAssignable> {
        self.can_assign(tenant, policy)?;
        Ok(DeviceState::Assigned {
            tenant: tenant.to_string(),
            container_id: container_id.to_string(),
        })
    }

    /// The container `container_id` let the device go. Releasing a quarantined device
    /// (quarantined for ECC errors while in use) leaves it quarantined.
    pub fn on_release(&self, container_id: &str) -> Result<DeviceState, IllegalTransition> {
        match self {
            DeviceState::Assigned { tenant, container_id: held } if held == container_id => {
                Ok(DeviceState::Dirty { last_tenant: tenant.clone() })
            }
            DeviceState::Quarantined { .. } => Ok(self.clone()),
            _ => Err(self.illegal("release")),
        }
    }

    /// A scrub starts. From `Dirty`, attempt 1; from `Scrubbing` (an interrupted scrub
    /// being restarted), the next attempt, or quarantine once `max_attempts` is spent.
    pub fn on_scrub_start(&self, policy: &ScrubPolicy) -> Result<DeviceState, IllegalTransition> {
        match self {
            DeviceState::Dirty { last_tenant } => {
                Ok(DeviceState::Scrubbing { last_tenant: last_tenant.clone(), attempt: 1 })
            }
            DeviceState::Scrubbing { last_tenant, attempt } => {
                if *attempt >= policy.max_attempts {
                    Ok(DeviceState::Quarantined {
                        reason: format!("scrub interrupted {attempt} times"),
                        last_tenant: some_tenant(last_tenant),
                    })
                } else {
                    Ok(DeviceState::Scrubbing {
                        last_tenant: last_tenant.clone(),
                        attempt: attempt.saturating_add(1),
                    })
                }
            }
            _ => Err(self.illegal("scrub start")),
        }
    }

    /// A scrub reported: `Free` if the policy judges the report clean, else quarantined.
    pub fn on_scrub_result(
        &self,
        report: &ScrubReport,
        policy: &ScrubPolicy,
    ) -> Result<DeviceState, IllegalTransition> {
        match self {
            DeviceState::Scrubbing { last_tenant, .. } => Ok(match policy.judge(report) {
                Ok(()) => DeviceState::Free,
                Err(reason) => {
                    DeviceState::Quarantined { reason, last_tenant: some_tenant(last_tenant) }
                }
            }),
            _ => Err(self.illegal("scrub result")),
        }
    }

    /// A scrub ended without a report (spawn failure, crash, timeout).
    pub fn on_scrub_failed(&self, reason: &str) -> Result<DeviceState, IllegalTransition> {
        match self {
            DeviceState::Scrubbing { last_tenant, .. } => Ok(DeviceState::Quarantined {
                reason: format!("scrub failed: {reason}"),
                last_tenant: some_tenant(last_tenant),
            }),
            _ => Err(self.illegal("scrub failure")),
        }
    }

    /// Uncorrectable ECC errors: quarantine, from any state. A device in use stays with
    /// its container until released, but no one gets it after.
    pub fn on_ecc_error(&self, uncorrectable: u64) -> DeviceState {
        self.on_fault(format!("{uncorrectable} uncorrectable ECC errors"))
    }

    /// The driver reported a fault on the device (an XID error, or its GPU's): quarantined
    /// in any state, in use or not, keeping whose data it may hold. Only an unquarantine
    /// (a health check and a clean scrub) brings it back.
    pub fn on_fault(&self, reason: String) -> DeviceState {
        match self {
            DeviceState::Quarantined { last_tenant, .. } => {
                DeviceState::Quarantined { reason, last_tenant: last_tenant.clone() }
            }
            other => DeviceState::Quarantined {
                reason,
                last_tenant: other.last_tenant().map(str::to_string),
            },
        }
    }

    /// An operator asked to return a quarantined device to service: scrub it again; only
    /// a clean result frees it.
    pub fn unquarantine_requested(&self) -> Result<DeviceState, IllegalTransition> {
        match self {
            DeviceState::Quarantined { last_tenant, .. } => Ok(DeviceState::Scrubbing {
                last_tenant: last_tenant.clone().unwrap_or_default(),
                attempt: 1,
            }),
            _ => Err(self.illegal("unquarantine")),
        }
    }

    /// Apply any event: the one place the daemon feeds events through.
    pub fn apply(
        &self,
        event: &DeviceEvent,
        policy: &ScrubPolicy,
    ) -> Result<DeviceState, TransitionError> {
        Ok(match event {
            DeviceEvent::Assign { tenant, container_id } => {
                self.assign(tenant, container_id, policy)?
            }
            DeviceEvent::Release { container_id } => self.on_release(container_id)?,
            DeviceEvent::ScrubStart => self.on_scrub_start(policy)?,
            DeviceEvent::ScrubResult(report) => self.on_scrub_result(report, policy)?,
            DeviceEvent::ScrubFailed { reason } => self.on_scrub_failed(reason)?,
            DeviceEvent::EccError { uncorrectable } => self.on_ecc_error(*uncorrectable),
            DeviceEvent::Fault { reason } => self.on_fault(reason.clone()),
            DeviceEvent::UnquarantineRequested => self.unquarantine_requested()?,
        })
    }

    fn illegal(&self, event: &'static str) -> IllegalTransition {
        IllegalTransition { from: self.name(), event }
    }
}

fn some_tenant(t: &str) -> Option<String> {
    Some(t.to_string()).filter(|t| !t.is_empty())
}

mod duration_secs {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let secs = f64::deserialize(d)?;
        Duration::try_from_secs_f64(secs).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;
    use crate::report::BACKEND_SIM;

    fn policy(skip: bool) -> ScrubPolicy {
        ScrubPolicy { same_tenant_skip: skip, ..ScrubPolicy::default() }
    }

    fn clean_report() -> ScrubReport {
        ScrubReport {
            device: "GPU-1".into(),
            backend: BACKEND_SIM.into(),
            ok: true,
            error: None,
            bytes_covered: 1000,
            bytes_total: 1000,
            nonzero_words: 0,
            seconds: 1.0,
            gbps: 1.0,
            zero_seconds: 0.5,
            verify_seconds: 0.5,
            zero_gbps: 1.0,
            verify_gbps: 1.0,
            chunks: 1,
            finished_unix_s: 0,
        }
    }

    #[test]
    fn the_happy_path() {
        let p = policy(false);
        let s = DeviceState::Free.assign("a", "c1", &p).unwrap();
        assert_eq!(s.name(), "assigned");
        let s = s.on_release("c1").unwrap();
        assert_eq!(s, DeviceState::Dirty { last_tenant: "a".into() });
        assert!(s.needs_scrub());
        assert!(matches!(s.can_assign("b", &p), Err(NotAssignable::Dirty { .. })));
        assert!(s.can_assign("a", &p).is_err(), "no skip without the policy");
        let s = s.on_scrub_start(&p).unwrap();
        assert!(matches!(s.can_assign("a", &p), Err(NotAssignable::Scrubbing { attempt: 1 })));
        let s = s.on_scrub_result(&clean_report(), &p).unwrap();
        assert_eq!(s, DeviceState::Free);
        assert!(s.can_assign("b", &p).is_ok());
    }

    #[test]
    fn same_tenant_skip_lets_only_the_last_tenant_back() {
        let p = policy(true);
        let dirty = DeviceState::Dirty { last_tenant: "a".into() };
        assert!(dirty.can_assign("a", &p).is_ok());
        assert!(dirty.can_assign("b", &p).is_err());
        assert!(DeviceState::unknown_history().can_assign("a", &p).is_err());
        assert_eq!(DeviceState::Free.can_assign("", &p), Err(NotAssignable::EmptyTenant));
    }

    #[test]
    fn release_needs_the_holding_container() {
        let s = DeviceState::Assigned { tenant: "a".into(), container_id: "c1".into() };
        let e = s.on_release("c2").unwrap_err();
        assert_eq!(e.to_string(), "release is not allowed while the device is assigned");
        assert!(DeviceState::Free.on_release("c1").is_err());
    }

    #[test]
    fn every_failure_mode_quarantines() {
        let p = policy(false);
        let scrubbing = DeviceState::Scrubbing { last_tenant: "a".into(), attempt: 1 };
        let mut cases = Vec::new();
        let mut r = clean_report();
        r.nonzero_words = 7;
        r.ok = false;
        cases.push((r, "non-zero"));
        let mut r = clean_report();
        r.error = Some("CUDA_ERROR_ILLEGAL_ADDRESS".into());
        r.ok = false;
        cases.push((r, "scrub failed"));
        let mut r = clean_report();
        r.bytes_covered = 500;
        cases.push((r, "below"));
        let mut r = clean_report();
        r.seconds = 1e6;
        cases.push((r, "over the"));
        let mut r = clean_report();
        r.seconds = f64::NAN;
        cases.push((r, "over the"));
        let mut r = clean_report();
        r.bytes_total = 0;
        cases.push((r, "implausible"));
        let mut r = clean_report();
        r.ok = false;
        cases.push((r, "did not report success"));
        for (report, want) in cases {
            match scrubbing.on_scrub_result(&report, &p).unwrap() {
                DeviceState::Quarantined { reason, last_tenant } => {
                    assert!(reason.contains(want), "{reason} lacks {want}");
                    assert_eq!(last_tenant.as_deref(), Some("a"));
                }
                other => panic!("{report:?} gave {other:?}"),
            }
        }
        let q = scrubbing.on_scrub_failed("timed out after 120 s").unwrap();
        assert_eq!(q.name(), "quarantined");
        assert!(matches!(q.can_assign("a", &p), Err(NotAssignable::Quarantined { .. })));
    }

    #[test]
    fn interrupted_scrubs_restart_then_quarantine() {
        let p = ScrubPolicy { max_attempts: 2, ..ScrubPolicy::default() };
        let s = DeviceState::Dirty { last_tenant: "a".into() }.on_scrub_start(&p).unwrap();
        let s = s.on_scrub_start(&p).unwrap();
        assert_eq!(s, DeviceState::Scrubbing { last_tenant: "a".into(), attempt: 2 });
        let s = s.on_scrub_start(&p).unwrap();
        assert_eq!(s.name(), "quarantined");
        assert!(DeviceState::Free.on_scrub_start(&p).is_err());
    }

    #[test]
    fn unquarantine_rescrubs_and_only_success_frees() {
        let p = policy(false);
        let q = DeviceState::Quarantined { reason: "x".into(), last_tenant: Some("a".into()) };
        let s = q.unquarantine_requested().unwrap();
        assert_eq!(s, DeviceState::Scrubbing { last_tenant: "a".into(), attempt: 1 });
        let mut bad = clean_report();
        bad.nonzero_words = 1;
        bad.ok = false;
        assert_eq!(s.on_scrub_result(&bad, &p).unwrap().name(), "quarantined");
        assert_eq!(s.on_scrub_result(&clean_report(), &p).unwrap(), DeviceState::Free);
        assert!(DeviceState::Free.unquarantine_requested().is_err());
    }

    #[test]
    fn ecc_errors_quarantine_from_anywhere_and_release_keeps_it() {
        let s = DeviceState::Assigned { tenant: "a".into(), container_id: "c1".into() };
        let q = s.on_ecc_error(2);
        assert_eq!(
            q,
            DeviceState::Quarantined {
                reason: "2 uncorrectable ECC errors".into(),
                last_tenant: Some("a".into())
            }
        );
        assert_eq!(q.on_release("c1").unwrap(), q);
        assert_eq!(DeviceState::Free.on_ecc_error(1).last_tenant(), None);
    }

    #[test]
    fn serde_form_is_tagged_and_strict() {
        let s = DeviceState::Scrubbing { last_tenant: "a".into(), attempt: 2 };
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(json, r#"{"state":"scrubbing","last_tenant":"a","attempt":2}"#);
        assert_eq!(serde_json::from_str::<DeviceState>(&json).unwrap(), s);
        assert_eq!(serde_json::to_string(&DeviceState::Free).unwrap(), r#"{"state":"free"}"#);
        // Unknown fields are refused in the variants that have fields (serde ignores
        // deny_unknown_fields for a unit variant of an internally tagged enum).
        assert!(serde_json::from_str::<DeviceState>(
            r#"{"state":"dirty","last_tenant":"a","x":1}"#
        )
        .is_err());
        assert!(serde_json::from_str::<DeviceState>(r#"{"state":"clean"}"#).is_err());

        let p = ScrubPolicy::default();
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(
            json,
            r#"{"min_coverage":0.9,"timeout_s":120.0,"same_tenant_skip":false,"max_attempts":3}"#
        );
        assert_eq!(serde_json::from_str::<ScrubPolicy>(&json).unwrap(), p);
        assert!(serde_json::from_str::<ScrubPolicy>(
            r#"{"min_coverage":0.9,"timeout_s":-1,"same_tenant_skip":false,"max_attempts":3}"#
        )
        .is_err());
    }

    #[test]
    fn policy_validation() {
        assert!(ScrubPolicy::default().validate().is_ok());
        for bad in [0.0, 1.5, f64::NAN] {
            let p = ScrubPolicy { min_coverage: bad, ..ScrubPolicy::default() };
            assert!(p.validate().is_err());
        }
        let p = ScrubPolicy { timeout: Duration::ZERO, ..ScrubPolicy::default() };
        assert!(p.validate().is_err());
    }

    // ---- property tests ----

    const TENANTS: [&str; 3] = ["a", "b", "c"];

    fn tenant() -> impl Strategy<Value = String> {
        prop::sample::select(&TENANTS[..]).prop_map(str::to_string)
    }

    /// A tenant or the unknown history.
    fn maybe_tenant() -> impl Strategy<Value = String> {
        prop_oneof![tenant(), Just(String::new())]
    }

    fn container() -> impl Strategy<Value = String> {
        prop::sample::select(&["c1", "c2"][..]).prop_map(str::to_string)
    }

    fn any_state() -> impl Strategy<Value = DeviceState> {
        prop_oneof![
            Just(DeviceState::Free),
            (tenant(), container())
                .prop_map(|(tenant, container_id)| DeviceState::Assigned { tenant, container_id }),
            maybe_tenant().prop_map(|last_tenant| DeviceState::Dirty { last_tenant }),
            (maybe_tenant(), 1u32..5)
                .prop_map(|(last_tenant, attempt)| DeviceState::Scrubbing { last_tenant, attempt }),
            (".{0,8}", prop::option::of(maybe_tenant()))
                .prop_map(|(reason, last_tenant)| DeviceState::Quarantined { reason, last_tenant }),
        ]
    }

    fn any_report() -> impl Strategy<Value = ScrubReport> {
        (
            any::<bool>(),
            prop::option::of(Just("boom".to_string())),
            0u64..=1200,
            prop_oneof![Just(1000u64), Just(0u64), 1u64..2000],
            prop_oneof![Just(0u64), 1u64..10],
            prop_oneof![Just(1.0f64), Just(1e6), Just(f64::NAN), 0.0f64..300.0],
        )
            .prop_map(|(ok, error, covered, total, nonzero, seconds)| ScrubReport {
                ok,
                error,
                bytes_covered: covered,
                bytes_total: total,
                nonzero_words: nonzero,
                seconds,
                ..clean_report()
            })
    }

    fn any_event() -> impl Strategy<Value = DeviceEvent> {
        prop_oneof![
            (tenant(), container())
                .prop_map(|(tenant, container_id)| DeviceEvent::Assign { tenant, container_id }),
            container().prop_map(|container_id| DeviceEvent::Release { container_id }),
            Just(DeviceEvent::ScrubStart),
            any_report().prop_map(DeviceEvent::ScrubResult),
            prop_oneof![Just(clean_report())].prop_map(DeviceEvent::ScrubResult),
            Just(DeviceEvent::ScrubFailed { reason: "killed".into() }),
            (0u64..3).prop_map(|uncorrectable| DeviceEvent::EccError { uncorrectable }),
            Just(DeviceEvent::Fault { reason: "xid 95".into() }),
            Just(DeviceEvent::UnquarantineRequested),
        ]
    }

    fn any_policy() -> impl Strategy<Value = ScrubPolicy> {
        (0.5f64..=1.0, 1u64..400, any::<bool>(), 1u32..4).prop_map(
            |(min_coverage, timeout, same_tenant_skip, max_attempts)| ScrubPolicy {
                min_coverage,
                timeout: Duration::from_secs(timeout),
                same_tenant_skip,
                max_attempts,
            },
        )
    }

    /// The oracle, written apart from `ScrubPolicy::judge`: a verified scrub.
    fn verified(r: &ScrubReport, p: &ScrubPolicy) -> bool {
        r.ok && r.error.is_none()
            && r.nonzero_words == 0
            && r.bytes_total > 0
            && r.bytes_covered <= r.bytes_total
            && r.bytes_covered as f64 >= p.min_coverage * r.bytes_total as f64
            && r.seconds <= p.timeout.as_secs_f64()
    }

    /// Whose data may be on the device, given only its state: `?` for unknown.
    fn owners_of(s: &DeviceState) -> BTreeSet<String> {
        match s {
            DeviceState::Free => BTreeSet::new(),
            other => BTreeSet::from([other.last_tenant().unwrap_or("?").to_string()]),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        /// From any state, through any events: a device is assignable to a tenant only if
        /// every tenant whose data may be on it is that same tenant (and the policy allows
        /// the skip), i.e. a verified scrub happened since another tenant released it.
        #[test]
        fn never_assignable_to_another_tenant_without_a_verified_scrub(
            start in any_state(),
            events in prop::collection::vec(any_event(), 0..40),
            policy in any_policy(),
        ) {
            let mut state = start.clone();
            let mut owners = owners_of(&start);
            for event in &events {
                let before = state.clone();
                let Ok(after) = state.apply(event, &policy) else { continue };
                match event {
                    DeviceEvent::Assign { tenant, .. } => {
                        // Assignment itself must respect the invariant.
                        prop_assert!(owners.iter().all(|o| o == tenant),
                            "{before:?} assigned to {tenant} holding data of {owners:?}");
                        prop_assert!(owners.is_empty() || policy.same_tenant_skip);
                        owners.insert(tenant.clone());
                    }
                    DeviceEvent::ScrubResult(r) if verified(r, &policy) => {
                        prop_assert_eq!(&after, &DeviceState::Free);
                        owners.clear();
                    }
                    DeviceEvent::ScrubResult(_) => {
                        prop_assert_eq!(after.name(), "quarantined");
                    }
                    _ => {}
                }
                if after == DeviceState::Free {
                    prop_assert!(owners.is_empty(), "{before:?} --{event:?}--> free with {owners:?}");
                }
                state = after;
                for t in TENANTS {
                    if state.can_assign(t, &policy).is_ok() {
                        prop_assert!(owners.iter().all(|o| o == t),
                            "{state:?} assignable to {t} holding data of {owners:?}");
                        prop_assert!(owners.is_empty() || policy.same_tenant_skip);
                    }
                }
            }
        }

        /// A quarantined device leaves quarantine only through unquarantine, and reaches
        /// `Free` only by a verified scrub after that.
        #[test]
        fn quarantine_is_left_only_by_unquarantine_and_a_verified_scrub(
            reason in ".{0,8}",
            events in prop::collection::vec(any_event(), 0..40),
            policy in any_policy(),
        ) {
            let mut state = DeviceState::Quarantined { reason, last_tenant: Some("a".into()) };
            for event in &events {
                let Ok(after) = state.apply(event, &policy) else { continue };
                if state.name() == "quarantined" && after.name() != "quarantined" {
                    prop_assert_eq!(event, &DeviceEvent::UnquarantineRequested);
                    prop_assert_eq!(after.name(), "scrubbing");
                }
                if after == DeviceState::Free && state != DeviceState::Free {
                    let verified_scrub =
                        matches!(event, DeviceEvent::ScrubResult(r) if verified(r, &policy));
                    prop_assert!(verified_scrub);
                }
                state = after;
            }
        }

        /// Every state survives the round trip through its persisted form.
        #[test]
        fn states_round_trip_through_json(state in any_state()) {
            let json = serde_json::to_string(&state).unwrap();
            prop_assert_eq!(serde_json::from_str::<DeviceState>(&json).unwrap(), state);
        }
    }
}
