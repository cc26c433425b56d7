//! The contention model: how the shares of one GPU (MPS clients or time-sliced
//! containers) divide it. A model standing in for hardware; its assumptions:
//!
//! 1. Each share has a **demand**: the fraction of the device's SMs (`sm`) and of its
//!    memory bandwidth (`bw`) it uses running alone, unthrottled, at full speed.
//! 2. An MPS **cap** (active thread percentage) limits the SMs a share may occupy: alone,
//!    it progresses at `min(1, cap / sm)` of full speed, and its bandwidth use scales with
//!    its progress (a kernel that runs half as fast fetches half as many bytes per second).
//! 3. MPS and time-slicing partition **neither bandwidth nor** (without caps) **SMs**: when
//!    the shares' summed SM or bandwidth use exceeds the device, every share slows by the
//!    same factor `1 / max(Σ sm·rate, Σ bw·rate)` — bandwidth is handed out in proportion to
//!    demand, so a bandwidth-heavy share takes most of it and a light, latency-sensitive
//!    one loses the same fraction of its throughput as the heavy one.
//! 4. Nothing else interferes (PCIe, NVLink, caches, clocks): the model is about HBM
//!    bandwidth and SMs, the paths the design names first.
//!
//! MIG partitions both, so a MIG instance (and a whole GPU) is one share alone.
//!
//! What this model does not capture (and the hardware would show): latency rising before
//! bandwidth saturates (queueing), cache thrashing, clock throttling under power. The
//! detector does not rely on the model: it reads measured utilisation (and a workload's
//! own latency), whatever produced it.

use serde::{Deserialize, Serialize};

/// What a share would use of the device alone, unthrottled, at full speed (fractions).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Demand {
    /// SMs, 0..=1.
    pub sm: f64,
    /// Memory bandwidth, 0..=1.
    pub bw: f64,
}

/// One share on the device: its demand and its MPS cap (1.0: none).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Load {
    pub demand: Demand,
    /// The MPS active thread fraction, 0..=1.
    pub cap: f64,
}

/// What one share gets.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Achieved {
    /// Progress rate, as a fraction of running alone, unthrottled, at full speed.
    pub rate: f64,
    /// Its rate alone on the device with its cap (what it would get solo).
    pub solo_rate: f64,
    /// SMs and bandwidth it uses (fractions of the device).
    pub sm: f64,
    pub bw: f64,
}

impl Achieved {
    /// Throughput as a fraction of what it would get alone with its cap.
    pub fn share_of_solo(&self) -> f64 {
        if self.solo_rate > 0.0 {
            (self.rate / self.solo_rate).clamp(0.0, 1.0)
        } else {
            1.0
        }
    }
}

fn clamp01(v: f64) -> f64 {
    if v.is_finite() {
        v.clamp(0.0, 1.0)
    } else {
        0.0
    }
}

/// A share's rate alone with its cap (assumption 2).
pub fn solo_rate(load: &Load) -> f64 {
    let sm = clamp01(load.demand.sm);
    let cap = clamp01(load.cap);
    if sm <= 0.0 {
        1.0
    } else {
        (cap / sm).min(1.0)
    }
}

/// How the device divides among `loads` (assumption 3). Same order as `loads`.
pub fn share_device(loads: &[Load]) -> Vec<Achieved> {
    let solo: Vec<f64> = loads.iter().map(solo_rate).collect();
    let sm_use: f64 = loads.iter().zip(&solo).map(|(l, r)| clamp01(l.demand.sm) * r).sum();
    let bw_use: f64 = loads.iter().zip(&solo).map(|(l, r)| clamp01(l.demand.bw) * r).sum();
    let k = 1.0 / sm_use.max(bw_use).max(1.0);
    loads
        .iter()
        .zip(solo)
        .map(|(l, r)| {
            let rate = r * k;
            Achieved {
                rate,
                solo_rate: r,
                sm: clamp01(l.demand.sm) * rate,
                bw: clamp01(l.demand.bw) * rate,
            }
        })
        .collect()
}

/// The device's SM and bandwidth activity (fractions) when `achieved` run on it.
pub fn device_activity(achieved: &[Achieved]) -> (f64, f64) {
    let sm: f64 = achieved.iter().map(|a| a.sm).sum();
    let bw: f64 = achieved.iter().map(|a| a.bw).sum();
    (clamp01(sm), clamp01(bw))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn load(sm: f64, bw: f64, cap: f64) -> Load {
        Load { demand: Demand { sm, bw }, cap }
    }

    #[test]
    fn a_bandwidth_heavy_co_tenant_slows_a_light_one_and_a_cap_gives_it_back() {
        let victim = load(0.25, 0.5, 0.25);
        let solo = share_device(&[victim]);
        assert_eq!(solo[0].share_of_solo(), 1.0);
        let both = share_device(&[victim, load(1.0, 1.0, 0.75)]);
        let v = both[0].share_of_solo();
        assert!((v - 0.8).abs() < 1e-9, "1 / (0.5 + 0.75) = 0.8, got {v}");
        let (_, bw) = device_activity(&both);
        assert!((bw - 1.0).abs() < 1e-9, "saturated");
        // The aggressor's cap halved: 0.5 + 0.375 < 1, nothing saturates.
        let capped = share_device(&[victim, load(1.0, 1.0, 0.375)]);
        assert_eq!(capped[0].share_of_solo(), 1.0);
        assert!((capped[1].rate - 0.375).abs() < 1e-9);
    }

    proptest! {
        /// Whatever the loads: no resource is over-used, nobody beats its solo rate, and
        /// lowering one share's cap never slows another.
        #[test]
        fn the_model_is_conservative_and_monotone(
            loads in proptest::collection::vec((0.0f64..=1.0, 0.0f64..=1.0, 0.01f64..=1.0), 1..6),
            which in 0usize..6,
            lower in 0.0f64..1.0,
        ) {
            let ls: Vec<Load> = loads.iter().map(|(s, b, c)| load(*s, *b, *c)).collect();
            let a = share_device(&ls);
            let sm: f64 = a.iter().map(|x| x.sm).sum();
            let bw: f64 = a.iter().map(|x| x.bw).sum();
            prop_assert!(sm <= 1.0 + 1e-9 && bw <= 1.0 + 1e-9);
            for x in &a {
                prop_assert!(x.rate <= x.solo_rate + 1e-12);
            }
            let i = which % ls.len();
            let mut lowered = ls.clone();
            lowered[i].cap *= lower;
            let b = share_device(&lowered);
            for j in (0..ls.len()).filter(|j| *j != i) {
                prop_assert!(b[j].rate + 1e-12 >= a[j].rate);
            }
        }
    }
}
