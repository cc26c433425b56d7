//! The answer to an incident, in steps by policy (pure):
//!
//! 1. **throttle**: the aggressor's MPS active thread percentage lowered just enough to
//!    end the saturation ([`throttle_target`]), but in one step never below
//!    `throttle_factor_percent` of what it was, nor below `min_percent` (only an MPS
//!    aggressor has one); again every `confirm` samples the incident persists;
//! 2. **anti-affinity**: the two tenants are kept apart by later placements (when they are
//!    two tenants);
//! 3. **harden**: the victim's next start is granted a MIG instance (or a whole GPU) where
//!    its tier allows;
//! 4. **stop**: the aggressor is stopped (SIGTERM, grace, SIGKILL) once the incident still
//!    holds `stop_after` samples after it opened; never without `stop_after`, and only on
//!    measured evidence: the victim's measured use of the saturated resource below
//!    `min_share` of its baseline in that sample ([`Incident::measured`]; a victim's SM
//!    use or latency report alone never stops anyone), and the aggressor tenant using
//!    more of that resource than it booked of the device ([`Incident::over_booking`]: a
//!    tenant that stays within its booked MPS share is never stopped). Every active
//!    container of the aggressor tenant on the device is stopped.
//!
//! Steps 1-3 are taken when the incident opens. Caps lowered stay lowered when it clears:
//! raising them would bring it back.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::detect::{Finding, Incident};

/// The policy's steps.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    pub throttle_factor_percent: u8,
    pub min_percent: u8,
    pub anti_affinity: bool,
    pub harden: bool,
    pub stop_after: Option<u32>,
    /// How many persisting samples between two throttles.
    pub confirm: u32,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            throttle_factor_percent: 50,
            min_percent: 10,
            anti_affinity: true,
            harden: true,
            stop_after: None,
            confirm: 3,
        }
    }
}

/// One step, with the incident that caused it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "step", rename_all = "kebab-case")]
pub enum Step {
    Throttle { incident: Incident, from_percent: u8, to_percent: u8 },
    AntiAffinity { incident: Incident },
    Harden { incident: Incident },
    Stop { incident: Incident },
}

impl Step {
    pub fn name(&self) -> &'static str {
        match self {
            Step::Throttle { .. } => "throttle",
            Step::AntiAffinity { .. } => "anti-affinity",
            Step::Harden { .. } => "harden",
            Step::Stop { .. } => "stop",
        }
    }

    pub fn incident(&self) -> &Incident {
        match self {
            Step::Throttle { incident, .. }
            | Step::AntiAffinity { incident }
            | Step::Harden { incident }
            | Step::Stop { incident } => incident,
        }
    }
}

/// What the saturated resource's summed use is brought to by a throttle: just under the
/// device, so the victim gets what it asks while the aggressor keeps the rest.
pub const THROTTLE_TARGET_USE: f64 = 0.98;

/// The MPS thread percentage that ends an incident's saturation, from its evidence alone.
/// Every share of a saturated device slows by the same factor (the victim's share `k` of
/// its solo throughput, `contention` assumption 3), so the shares ask `1/k` of the
/// saturated resource and the aggressor `a/k` (`a` its use now); taking `1/k -`
/// [`THROTTLE_TARGET_USE`] off the aggressor's ask means scaling its rate by
/// `f = 1 - (1/k - target) / (a/k)`, and its rate follows its SM cap: the new cap is `f`
/// of the SMs it would use uncontended (`sm/k`, at most its cap now; the aggressor's use
/// is its tenant's, summed over its containers, each of which the cap bounds alone, so
/// per container that is `sm/k/n`). Bounded by
/// `throttle_factor_percent` of `from` (one step lowers that much at most) and
/// `min_percent`; `None` when that would not lower it (or throttling is off).
pub fn throttle_target(incident: &Incident, from: u8, s: &Settings) -> Option<u8> {
    if s.throttle_factor_percent == 0 || from <= s.min_percent {
        return None;
    }
    let k = if incident.share.is_finite() { incident.share.clamp(0.05, 1.0) } else { 1.0 };
    let used = match incident.signal {
        crate::detect::Signal::MemoryBandwidth => incident.aggressor_bw,
        crate::detect::Signal::Sm => incident.aggressor_sm,
    };
    let asks = used / k;
    let f = if asks > 0.0 {
        ((asks - (1.0 / k - THROTTLE_TARGET_USE)) / asks).clamp(0.0, 1.0)
    } else {
        0.0
    };
    let n = incident.aggressors.len().max(1) as f64;
    let solo_sm = (incident.aggressor_sm / k / n * 100.0).min(f64::from(from));
    let target = (solo_sm * f).round();
    let floor = (f64::from(from) * f64::from(s.throttle_factor_percent) / 100.0).ceil();
    let to = target.max(floor).max(f64::from(s.min_percent)).min(100.0) as u8;
    (to < from).then_some(to)
}

/// What was done for each open incident (so a stop is sent once).
#[derive(Debug, Clone, Default)]
pub struct Responder {
    pub settings: Settings,
    stopped: BTreeMap<(String, String), String>,
}

impl Responder {
    pub fn new(settings: Settings) -> Responder {
        Responder { settings, stopped: BTreeMap::new() }
    }

    /// The steps `finding` calls for. `cap_of`: the aggressor's MPS thread percentage now
    /// (`None`: not an MPS share, nothing to throttle).
    pub fn steps(&mut self, finding: &Finding, cap_of: impl Fn(&str) -> Option<u8>) -> Vec<Step> {
        let s = self.settings;
        let throttle = |incident: &Incident| -> Option<Step> {
            let from = cap_of(&incident.aggressor)?;
            let to = throttle_target(incident, from, &s)?;
            Some(Step::Throttle { incident: incident.clone(), from_percent: from, to_percent: to })
        };
        match finding {
            Finding::Opened(incident) => {
                let mut out: Vec<Step> = throttle(incident).into_iter().collect();
                if s.anti_affinity && incident.victim_tenant != incident.aggressor_tenant {
                    out.push(Step::AntiAffinity { incident: incident.clone() });
                }
                if s.harden {
                    out.push(Step::Harden { incident: incident.clone() });
                }
                out
            }
            Finding::Persists { incident, samples } => {
                let mut out = Vec::new();
                if s.confirm > 0 && samples % s.confirm == 0 {
                    out.extend(throttle(incident));
                }
                let key = (incident.device.clone(), incident.victim.clone());
                if s.stop_after.is_some_and(|n| *samples >= n)
                    && incident.measured
                    && incident.over_booking()
                    && self.stopped.get(&key) != Some(&incident.aggressor)
                {
                    self.stopped.insert(key, incident.aggressor.clone());
                    out.push(Step::Stop { incident: incident.clone() });
                }
                out
            }
            Finding::Cleared { device, victim } => {
                self.stopped.remove(&(device.clone(), victim.clone()));
                Vec::new()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::Signal;

    fn incident() -> Incident {
        Incident {
            device: "GPU-0".into(),
            victim: "v".into(),
            victim_tenant: "a/b".into(),
            aggressor: "x".into(),
            aggressor_tenant: "c/d".into(),
            aggressors: vec!["x".into()],
            aggressor_booked: None,
            signal: Signal::MemoryBandwidth,
            share: 0.7,
            from_latency: false,
            measured: true,
            device_sm: 1.0,
            device_bw: 1.0,
            aggressor_sm: 0.7,
            aggressor_bw: 0.7,
            at_ms: 0,
        }
    }

    #[test]
    fn an_incident_throttles_marks_and_hardens_then_stops_only_when_told() {
        let mut r = Responder::new(Settings { stop_after: Some(4), ..Settings::default() });
        let steps = r.steps(&Finding::Opened(incident()), |_| Some(75));
        let names: Vec<&str> = steps.iter().map(Step::name).collect();
        assert_eq!(names, ["throttle", "anti-affinity", "harden"]);
        // Share 0.7, the aggressor at 0.7 of SM and bandwidth: it asks 1.0 of each, the
        // device 1/0.7; 1/0.7 - 0.98 must go: its rate x 0.551, so 41 of its 75.
        assert!(matches!(steps[0], Step::Throttle { from_percent: 75, to_percent: 41, .. }));
        assert!(r
            .steps(&Finding::Persists { incident: incident(), samples: 1 }, |_| Some(41))
            .is_empty());
        let again = r.steps(&Finding::Persists { incident: incident(), samples: 3 }, |_| Some(41));
        assert!(matches!(again[..], [Step::Throttle { to_percent: 23, .. }]), "{again:?}");
        // One step lowers it by `throttle_factor_percent` at most.
        let mut deep = incident();
        deep.share = 0.3;
        let to = throttle_target(&deep, 80, &Settings::default());
        assert_eq!(to, Some(40), "bounded by half");
        // A degradation seen only in the victim's own report stops nobody.
        let mut reported = incident();
        (reported.from_latency, reported.measured) = (true, false);
        assert!(r
            .steps(&Finding::Persists { incident: reported, samples: 4 }, |_| Some(18))
            .is_empty());
        // A tenant within its booking of the saturated resource is never stopped.
        let mut booked = incident();
        booked.aggressor_booked = Some(0.75);
        assert!(!booked.over_booking());
        assert!(r
            .steps(&Finding::Persists { incident: booked, samples: 4 }, |_| Some(18))
            .is_empty());
        let stop = r.steps(&Finding::Persists { incident: incident(), samples: 4 }, |_| Some(18));
        assert_eq!(stop.iter().map(Step::name).collect::<Vec<_>>(), ["stop"]);
        assert!(
            r.steps(&Finding::Persists { incident: incident(), samples: 5 }, |_| Some(18))
                .is_empty(),
            "once"
        );
        // Never below the floor; nothing to throttle on a time-sliced aggressor.
        let mut r = Responder::new(Settings::default());
        assert!(r
            .steps(&Finding::Persists { incident: incident(), samples: 3 }, |_| Some(10))
            .is_empty());
        let steps = r.steps(&Finding::Opened(incident()), |_| None);
        assert_eq!(steps.iter().map(Step::name).collect::<Vec<_>>(), ["anti-affinity", "harden"]);
        let mut same = incident();
        same.aggressor_tenant = same.victim_tenant.clone();
        let steps = r.steps(&Finding::Opened(same), |_| Some(15));
        assert!(matches!(steps[0], Step::Throttle { to_percent: 10, .. }));
        assert!(!steps.iter().any(|s| s.name() == "anti-affinity"), "one tenant: no pair");
    }

    #[test]
    fn the_throttle_ends_the_saturation_in_the_model() {
        use crate::contention::{share_device, Demand, Load};
        // The end-to-end test's case: victim (0.25 SM, 0.5 bandwidth, cap 25), aggressor
        // (1.0, 1.0, cap 75).
        let v = Load { demand: Demand { sm: 0.25, bw: 0.5 }, cap: 0.25 };
        let a = |cap: f64| Load { demand: Demand { sm: 1.0, bw: 1.0 }, cap };
        let before = share_device(&[v, a(0.75)]);
        let mut i = incident();
        i.share = before[0].share_of_solo();
        i.aggressor_sm = before[1].sm;
        i.aggressor_bw = before[1].bw;
        let to = throttle_target(&i, 75, &Settings::default()).expect("lowered");
        assert_eq!(to, 48);
        let after = share_device(&[v, a(f64::from(to) / 100.0)]);
        assert!(after[0].share_of_solo() >= 0.99, "to {to}: {:?}", after[0]);
    }
}
