//! The detector: which latency-sensitive share a co-tenant degrades, with hysteresis.
//!
//! Per device sample, for each latency-sensitive share `V` of an MPS or time-sliced
//! device:
//!
//! * **Baseline.** While `V` is the only active share of the device (others idle or
//!   absent), or the device is not saturated (every share gets what it asks), its achieved
//!   SM use (and its own latency, where it reports one) is its solo baseline (a moving
//!   average). A share that never ran uncontended has none and raises nothing:
//!   interference is a regression that follows a co-tenant's arrival.
//! * **Degraded** when, with a baseline, its throughput share — its SM use over the
//!   baseline, or, where it reports its latency, baseline latency over latency now — is
//!   below `min_share`, and a saturated resource (memory bandwidth, then SM activity, at or
//!   above `saturation`) is **what it lost to its co-tenants**, judged on measured use
//!   alone: the victim's own measured use of that resource is below `min_share` of its
//!   solo baseline of it (a victim that still gets its baseline of the saturated resource
//!   lost nothing to anyone, whatever its SM use or its report say), the co-tenants'
//!   summed use of it is at least what the victim's baseline leaves free (`saturation`
//!   less its solo use), and the **aggressor** — the co-tenant *tenant* using most of it
//!   on the device, its containers summed (five small containers of one tenant are one
//!   aggressor) — uses at least [`MATERIAL`] of the device. What the victim does itself
//!   (saturating the device with its own work, starving its own kernels, reporting a high
//!   latency) decides whether it is hurt, never who is to blame. One active share alone
//!   never raises anything. The aggressor tenant's booking (its MPS shares' percentages
//!   summed) travels with the incident: a tenant whose use of the saturated resource
//!   stays within it is never stopped ([`Incident::over_booking`]).
//! * **Hysteresis**: `confirm` degraded samples in a row open an incident; `clear` healthy
//!   samples in a row close it.
//!
//! Whole GPUs and MIG instances held alone are not given to the detector (nothing shares
//! them; MIG partitions bandwidth).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The detector's thresholds (the policy's `interference` section).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Thresholds {
    pub min_share: f64,
    pub saturation: f64,
    pub confirm: u32,
    pub clear: u32,
}

impl Default for Thresholds {
    fn default() -> Self {
        Thresholds { min_share: 0.9, saturation: 0.9, confirm: 3, clear: 3 }
    }
}

/// Below this SM + bandwidth use a share counts as idle.
pub const ACTIVE: f64 = 0.02;
/// The least use of the saturated resource (a fraction of the device, measured) that makes
/// a co-tenant an aggressor: below it a co-tenant cannot be what starves a victim, however
/// the victim behaves (docs/GPU-HEALTH.md, "Who can be named").
pub const MATERIAL: f64 = 0.2;
/// Weight of a new solo sample in the baseline.
const BASELINE_ALPHA: f64 = 0.3;

/// One share in a sample.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShareSample {
    /// The container.
    pub id: String,
    pub tenant: String,
    /// Latency-sensitive (a potential victim).
    pub latency: bool,
    /// Its achieved SM and memory-bandwidth use, fractions of the device.
    pub sm: f64,
    pub bw: f64,
    /// Its own latency (ms), where the workload reports one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<f64>,
    /// The fraction of the device it booked (an MPS share's percentage over 100); `None`
    /// where nothing is booked (time-slicing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub booked: Option<f64>,
}

impl ShareSample {
    fn active(&self) -> bool {
        self.sm + self.bw > ACTIVE
    }
}

/// One device at one instant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceSample {
    pub device: String,
    pub at_ms: u64,
    /// The device's SM and memory-bandwidth activity (fractions).
    pub sm: f64,
    pub bw: f64,
    pub shares: Vec<ShareSample>,
}

/// Which resource saturated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Signal {
    MemoryBandwidth,
    Sm,
}

impl Signal {
    pub fn as_str(self) -> &'static str {
        match self {
            Signal::MemoryBandwidth => "memory-bandwidth",
            Signal::Sm => "sm",
        }
    }
}

/// An interference: who degrades whom, where, through what, and the evidence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Incident {
    pub device: String,
    pub victim: String,
    pub victim_tenant: String,
    /// The aggressor tenant's container using most of the saturated resource.
    pub aggressor: String,
    pub aggressor_tenant: String,
    /// Every active container of the aggressor tenant on the device (the one named first):
    /// the aggressor is the tenant, its use summed over them.
    #[serde(default)]
    pub aggressors: Vec<String>,
    /// The aggressor tenant's booked fraction of the device, its containers summed
    /// (`None`: nothing booked, time-slicing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aggressor_booked: Option<f64>,
    pub signal: Signal,
    /// The victim's throughput as a fraction of its solo baseline.
    pub share: f64,
    /// Whether `share` comes from the victim's own latency reports.
    pub from_latency: bool,
    /// Whether the victim's measured use of the saturated resource (not its SM use, not its
    /// report: what it gets of the resource it lost) is below `min_share` of its baseline
    /// of it. The detector names nobody without it; a stop checks it again.
    #[serde(default)]
    pub measured: bool,
    /// The device's activity and the aggressor tenant's use, its containers summed
    /// (fractions).
    pub device_sm: f64,
    pub device_bw: f64,
    pub aggressor_sm: f64,
    pub aggressor_bw: f64,
    pub at_ms: u64,
}

impl Incident {
    /// The aggressor tenant's measured use of the saturated resource (summed).
    pub fn aggressor_use(&self) -> f64 {
        match self.signal {
            Signal::MemoryBandwidth => self.aggressor_bw,
            Signal::Sm => self.aggressor_sm,
        }
    }

    /// Whether the aggressor tenant uses more of the saturated resource than it booked of
    /// the device (always, where it booked nothing): a tenant within its booking is never
    /// stopped.
    pub fn over_booking(&self) -> bool {
        self.aggressor_booked.is_none_or(|b| self.aggressor_use() > b)
    }

    /// The evidence, in words (events, logs).
    pub fn evidence(&self) -> String {
        let (together, verb) = match self.aggressors.len() {
            n if n > 1 => (format!(" and {} more of its tenant's containers there", n - 1), "use"),
            _ => (String::new(), "uses"),
        };
        let booked = match self.aggressor_booked {
            Some(b) => format!(" (booked {:.0}%)", b * 100.0),
            None => String::new(),
        };
        format!(
            "victim {} ({}) at {:.0}% of its solo throughput{}; device {} {} saturated (SM {:.0}%, memory bandwidth {:.0}%); aggressor {} ({}){together} {verb} SM {:.0}%, memory bandwidth {:.0}%{booked}",
            self.victim,
            self.victim_tenant,
            self.share * 100.0,
            if self.from_latency { " (its own latency reports)" } else { "" },
            self.device,
            self.signal.as_str(),
            self.device_sm * 100.0,
            self.device_bw * 100.0,
            self.aggressor,
            self.aggressor_tenant,
            self.aggressor_sm * 100.0,
            self.aggressor_bw * 100.0
        )
    }
}

/// What a sample changed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "finding", rename_all = "snake_case")]
pub enum Finding {
    /// `confirm` degraded samples in a row: an incident opens.
    Opened(Incident),
    /// Still degraded, `samples` degraded samples since it opened.
    Persists { incident: Incident, samples: u32 },
    /// `clear` healthy samples in a row (or the victim left): it closes.
    Cleared { device: String, victim: String },
}

#[derive(Debug, Clone, Default)]
struct Watch {
    baseline_sm: Option<f64>,
    baseline_bw: Option<f64>,
    baseline_latency: Option<f64>,
    degraded: u32,
    healthy: u32,
    open: bool,
    since_open: u32,
}

/// The detector's memory: per device and latency-sensitive share.
#[derive(Debug, Clone, Default)]
pub struct Detector {
    pub thresholds: Thresholds,
    watches: BTreeMap<(String, String), Watch>,
}

impl Detector {
    pub fn new(thresholds: Thresholds) -> Detector {
        Detector { thresholds, watches: BTreeMap::new() }
    }

    /// Forget every streak and open incident but keep the solo baselines: while the
    /// controller is off the detector still learns what each share gets alone, so that,
    /// switched on, it judges contention that began while it was off.
    pub fn forget_alarms(&mut self) {
        for w in self.watches.values_mut() {
            w.degraded = 0;
            w.healthy = 0;
            w.open = false;
            w.since_open = 0;
        }
    }

    /// The incidents open now, by (device, victim).
    pub fn open(&self) -> impl Iterator<Item = (&str, &str)> {
        self.watches.iter().filter(|(_, w)| w.open).map(|((d, v), _)| (d.as_str(), v.as_str()))
    }

    /// Take one sample of one device; what changed.
    pub fn observe(&mut self, s: &DeviceSample) -> Vec<Finding> {
        let t = self.thresholds;
        let mut out = Vec::new();
        // Shares that left the device: their watches go (an open incident closes).
        let gone: Vec<(String, String)> = self
            .watches
            .keys()
            .filter(|(d, v)| *d == s.device && !s.shares.iter().any(|x| &x.id == v))
            .cloned()
            .collect();
        for key in gone {
            if self.watches.remove(&key).is_some_and(|w| w.open) {
                out.push(Finding::Cleared { device: key.0, victim: key.1 });
            }
        }
        let active: Vec<&ShareSample> = s.shares.iter().filter(|x| x.active()).collect();
        for v in s.shares.iter().filter(|x| x.latency) {
            let key = (s.device.clone(), v.id.clone());
            let w = self.watches.entry(key.clone()).or_default();
            let others: Vec<&&ShareSample> = active.iter().filter(|x| x.id != v.id).collect();
            let uncontended = s.bw < t.saturation && s.sm < t.saturation;
            if others.is_empty() || uncontended {
                // Alone (or with idle co-tenants), or on a device nothing saturates: what it
                // gets is what it asks, its solo baseline.
                if v.active() {
                    w.baseline_sm = Some(ewma(w.baseline_sm, v.sm));
                    w.baseline_bw = Some(ewma(w.baseline_bw, v.bw));
                    if let Some(l) = v.latency_ms.filter(|l| l.is_finite() && *l > 0.0) {
                        w.baseline_latency = Some(ewma(w.baseline_latency, l));
                    }
                }
                healthy(w, t, &key, &mut out);
                continue;
            }
            let by_sm = w.baseline_sm.filter(|b| *b > 0.0).map(|b| v.sm / b);
            let share = match (v.latency_ms, w.baseline_latency) {
                (Some(now), Some(base)) if now.is_finite() && now > 0.0 => Some((base / now, true)),
                _ => by_sm.map(|m| (m, false)),
            };
            let degraded = match share {
                Some((share, from_latency)) if share < t.min_share => {
                    culprit(s, v, w, t).map(|c| Incident {
                        device: s.device.clone(),
                        victim: v.id.clone(),
                        victim_tenant: v.tenant.clone(),
                        aggressor: c.ids[0].to_string(),
                        aggressor_tenant: c.tenant.to_string(),
                        aggressors: c.ids.iter().map(|x| x.to_string()).collect(),
                        aggressor_booked: c.booked,
                        signal: c.signal,
                        share: share.clamp(0.0, 1.0),
                        from_latency,
                        measured: true,
                        device_sm: s.sm,
                        device_bw: s.bw,
                        aggressor_sm: c.sm,
                        aggressor_bw: c.bw,
                        at_ms: s.at_ms,
                    })
                }
                _ => None,
            };
            match degraded {
                Some(incident) => {
                    w.healthy = 0;
                    w.degraded = w.degraded.saturating_add(1);
                    if w.open {
                        w.since_open = w.since_open.saturating_add(1);
                        out.push(Finding::Persists { incident, samples: w.since_open });
                    } else if w.degraded >= t.confirm {
                        w.open = true;
                        w.since_open = 0;
                        out.push(Finding::Opened(incident));
                    }
                }
                None => healthy(w, t, &key, &mut out),
            }
        }
        out
    }
}

/// The aggressor: a co-tenant tenant, its active containers on the device summed.
struct Culprit<'a> {
    signal: Signal,
    tenant: &'a str,
    /// Its active containers, the one using most of the saturated resource first.
    ids: Vec<&'a str>,
    sm: f64,
    bw: f64,
    booked: Option<f64>,
}

/// The saturated resource the victim lost and the co-tenant tenant that took it, judged on
/// measured use: the device saturated on it; the victim's own measured use of it below
/// `min_share` of its solo baseline of it (it got less of it than it gets alone); the
/// co-tenants' summed use at least what that baseline leaves free (so the victim's own
/// excess cannot make it); and the tenant using most of it (its containers summed) using
/// at least [`MATERIAL`]. Bandwidth is judged first.
fn culprit<'a>(
    s: &'a DeviceSample,
    v: &ShareSample,
    w: &Watch,
    t: Thresholds,
) -> Option<Culprit<'a>> {
    let others = || s.shares.iter().filter(|x| x.id != v.id && x.active());
    [
        (
            Signal::MemoryBandwidth,
            s.bw,
            w.baseline_bw,
            (|x: &ShareSample| x.bw) as fn(&ShareSample) -> f64,
        ),
        (Signal::Sm, s.sm, w.baseline_sm, |x: &ShareSample| x.sm),
    ]
    .into_iter()
    .find_map(|(signal, device, baseline, use_of)| {
        if device < t.saturation {
            return None;
        }
        let baseline = baseline.filter(|b| *b > 0.0)?;
        if use_of(v) >= t.min_share * baseline {
            return None; // it still gets its baseline of it: nobody took any
        }
        let theirs: f64 = others().map(use_of).sum();
        if theirs + baseline < t.saturation {
            return None;
        }
        let mut tenants: BTreeMap<&str, Vec<&ShareSample>> = BTreeMap::new();
        for x in others() {
            tenants.entry(x.tenant.as_str()).or_default().push(x);
        }
        let total = |xs: &[&ShareSample]| xs.iter().map(|x| use_of(x)).sum::<f64>();
        let (tenant, mut xs) = tenants
            .into_iter()
            .max_by(|(ta, a), (tb, b)| total(a).total_cmp(&total(b)).then(tb.cmp(ta)))?;
        if total(&xs) < MATERIAL {
            return None;
        }
        xs.sort_by(|a, b| use_of(b).total_cmp(&use_of(a)).then(a.id.cmp(&b.id)));
        Some(Culprit {
            signal,
            tenant,
            ids: xs.iter().map(|x| x.id.as_str()).collect(),
            sm: xs.iter().map(|x| x.sm).sum(),
            bw: xs.iter().map(|x| x.bw).sum(),
            booked: xs.iter().map(|x| x.booked).sum::<Option<f64>>(),
        })
    })
}

fn ewma(old: Option<f64>, new: f64) -> f64 {
    match old {
        None => new,
        Some(o) => o + BASELINE_ALPHA * (new - o),
    }
}

fn healthy(w: &mut Watch, t: Thresholds, key: &(String, String), out: &mut Vec<Finding>) {
    w.degraded = 0;
    w.healthy = w.healthy.saturating_add(1);
    if w.open && w.healthy >= t.clear {
        w.open = false;
        w.since_open = 0;
        out.push(Finding::Cleared { device: key.0.clone(), victim: key.1.clone() });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn share(id: &str, latency: bool, sm: f64, bw: f64) -> ShareSample {
        ShareSample {
            id: id.into(),
            tenant: format!("t/{id}"),
            latency,
            sm,
            bw,
            latency_ms: None,
            booked: None,
        }
    }

    fn sample(at: u64, sm: f64, bw: f64, shares: Vec<ShareSample>) -> DeviceSample {
        DeviceSample { device: "GPU-0".into(), at_ms: at, sm, bw, shares }
    }

    #[test]
    fn an_arriving_bandwidth_hog_opens_an_incident_after_confirm_and_it_clears_after_clear() {
        let mut d = Detector::new(Thresholds::default());
        for i in 0..3 {
            assert!(d.observe(&sample(i, 0.25, 0.5, vec![share("v", true, 0.25, 0.5)])).is_empty());
        }
        let hog = |at| {
            sample(at, 0.8, 1.0, vec![share("v", true, 0.2, 0.4), share("a", false, 0.6, 0.6)])
        };
        assert!(d.observe(&hog(3)).is_empty());
        assert!(d.observe(&hog(4)).is_empty());
        let f = d.observe(&hog(5));
        let Some(Finding::Opened(i)) = f.first() else { panic!("{f:?}") };
        assert_eq!((i.victim.as_str(), i.aggressor.as_str()), ("v", "a"));
        assert_eq!(i.signal, Signal::MemoryBandwidth);
        assert!((i.share - 0.8).abs() < 1e-9, "{}", i.share);
        assert!(i.evidence().contains("at 80% of its solo throughput"), "{}", i.evidence());
        assert!(matches!(d.observe(&hog(6))[0], Finding::Persists { samples: 1, .. }));
        let calm = |at| {
            sample(at, 0.5, 0.7, vec![share("v", true, 0.25, 0.5), share("a", false, 0.25, 0.2)])
        };
        assert!(d.observe(&calm(7)).is_empty());
        assert!(d.observe(&calm(8)).is_empty());
        assert!(matches!(d.observe(&calm(9))[0], Finding::Cleared { .. }));
    }

    #[test]
    fn a_solo_gpu_under_full_load_raises_nothing() {
        let mut d = Detector::new(Thresholds::default());
        for i in 0..20 {
            let load = if i < 5 { 0.3 } else { 1.0 };
            let s = sample(
                i,
                load,
                load,
                vec![share("v", true, load, load), share("idle", false, 0.0, 0.0)],
            );
            assert!(d.observe(&s).is_empty(), "sample {i}");
        }
    }

    #[test]
    fn no_baseline_no_alarm_and_unsaturated_is_not_interference() {
        let mut d = Detector::new(Thresholds::default());
        // The victim never ran alone.
        for i in 0..10 {
            let s =
                sample(i, 1.0, 1.0, vec![share("v", true, 0.1, 0.1), share("a", false, 0.9, 0.9)]);
            assert!(d.observe(&s).is_empty());
        }
        let mut d = Detector::new(Thresholds::default());
        d.observe(&sample(0, 0.5, 0.5, vec![share("v", true, 0.5, 0.5)]));
        for i in 1..10 {
            // Slower, but nothing saturates: its own phase change, not a neighbour.
            let s =
                sample(i, 0.5, 0.5, vec![share("v", true, 0.2, 0.2), share("a", false, 0.3, 0.3)]);
            assert!(d.observe(&s).is_empty());
        }
    }

    #[test]
    fn reported_latency_is_used_when_present() {
        let mut d = Detector::new(Thresholds { confirm: 1, ..Thresholds::default() });
        let mut v = share("v", true, 0.3, 0.3);
        v.latency_ms = Some(10.0);
        d.observe(&sample(0, 0.3, 0.3, vec![v.clone()]));
        // SM use unchanged, its requests take twice as long: with its bandwidth held, that is
        // nobody's doing.
        v.latency_ms = Some(20.0);
        let held =
            d.observe(&sample(1, 0.95, 0.95, vec![v.clone(), share("a", false, 0.65, 0.65)]));
        assert!(held.is_empty(), "{held:?}");
        // Its bandwidth falls below `min_share` of its baseline: the report says how hurt.
        v.bw = 0.2;
        let f = d.observe(&sample(2, 0.95, 0.95, vec![v, share("a", false, 0.65, 0.75)]));
        let Some(Finding::Opened(i)) = f.first() else { panic!("{f:?}") };
        assert!(i.from_latency && (i.share - 0.5).abs() < 1e-9, "{i:?}");
    }

    /// Victim framing: a latency share that saturates the device itself (or starves its
    /// own kernels, or reports a high latency) never names a co-tenant whose measured use
    /// could not have taken what it needs; the same co-tenant using a material part of
    /// what the victim's baseline leaves free is named.
    #[test]
    fn a_victim_cannot_frame_a_quiet_co_tenant() {
        let liar = |sm, bw, l| {
            let mut v = share("v", true, sm, bw);
            v.latency_ms = Some(l);
            v
        };
        for (sm, l) in [(0.5, 500.0), (0.1, 1.0)] {
            let mut d = Detector::new(Thresholds { confirm: 1, ..Thresholds::default() });
            let base = sample(0, 0.5, 0.5, vec![liar(0.5, 0.5, 1.0), share("b", false, 0.0, 0.0)]);
            assert!(d.observe(&base).is_empty());
            for i in 1..10 {
                // It saturates the bandwidth itself; the bystander uses 2%.
                let s = sample(
                    i,
                    sm + 0.02,
                    0.97,
                    vec![liar(sm, 0.95, l), share("b", false, 0.02, 0.02)],
                );
                assert!(d.observe(&s).is_empty(), "{sm} {l}: sample {i}");
            }
        }
        // A baseline learnt saturating the device alone does not lower the bar below
        // `MATERIAL`.
        let mut d = Detector::new(Thresholds { confirm: 1, ..Thresholds::default() });
        d.observe(&sample(0, 0.5, 0.95, vec![liar(0.5, 0.95, 1.0)]));
        let s = sample(1, 0.6, 1.0, vec![liar(0.1, 0.85, 500.0), share("b", false, 0.1, 0.15)]);
        assert!(d.observe(&s).is_empty());
        // What the co-tenant really takes (the victim's bandwidth below `min_share` of its
        // baseline) opens it.
        let s = sample(2, 0.6, 1.0, vec![liar(0.5, 0.7, 500.0), share("b", false, 0.1, 0.3)]);
        let f = d.observe(&s);
        let Some(Finding::Opened(i)) = f.first() else { panic!("{f:?}") };
        assert_eq!((i.aggressor.as_str(), i.from_latency, i.measured), ("b", true, true));
    }

    /// Round 4 (tests/attack_round4.rs): a victim that still gets all of its baseline
    /// bandwidth and starves its own kernels names nobody, though the device's bandwidth
    /// is saturated and a co-tenant uses a material part of it.
    #[test]
    fn a_victim_that_gets_its_baseline_of_the_saturated_resource_names_nobody() {
        let mut d = Detector::new(Thresholds { confirm: 1, ..Thresholds::default() });
        d.observe(&sample(
            0,
            0.5,
            0.75,
            vec![share("v", true, 0.5, 0.75), share("b", false, 0.0, 0.0)],
        ));
        for i in 1..10 {
            let s = sample(
                i,
                0.1,
                0.96,
                vec![share("v", true, 0.05, 0.75), share("b", false, 0.05, 0.21)],
            );
            assert!(d.observe(&s).is_empty(), "sample {i}");
        }
    }

    /// An aggressor split across containers of one tenant is one aggressor: their use is
    /// summed before [`MATERIAL`]; containers of different tenants are not summed.
    #[test]
    fn one_tenants_containers_are_summed() {
        let split = |tenant: &str, n: usize| -> Vec<ShareSample> {
            (0..n)
                .map(|i| ShareSample {
                    tenant: tenant.into(),
                    booked: Some(0.1),
                    ..share(&format!("{tenant}-{i}"), false, 0.1, 0.18)
                })
                .collect()
        };
        let run = |others: Vec<ShareSample>| {
            let mut d = Detector::new(Thresholds { confirm: 1, ..Thresholds::default() });
            d.observe(&sample(0, 0.5, 0.5, vec![share("v", true, 0.5, 0.5)]));
            let mut shares = vec![share("v", true, 0.1, 0.08)];
            shares.extend(others);
            d.observe(&sample(1, 0.6, 0.98, shares))
        };
        let f = run(split("r", 5));
        let Some(Finding::Opened(i)) = f.first() else { panic!("{f:?}") };
        assert_eq!((i.aggressor_tenant.as_str(), i.aggressors.len()), ("r", 5), "{i:?}");
        assert!((i.aggressor_bw - 0.9).abs() < 1e-9 && i.aggressor_booked == Some(0.5), "{i:?}");
        assert!(i.over_booking() && i.evidence().contains("aggressor r-0 (r) and 4 more of its tenant's containers there use SM 50%, memory bandwidth 90% (booked 50%)"), "{}", i.evidence());
        // Five tenants at 18% each: none is material alone (the documented limit).
        let five: Vec<ShareSample> = (0..5).flat_map(|k| split(&format!("t{k}"), 1)).collect();
        assert!(run(five).is_empty());
    }
}
