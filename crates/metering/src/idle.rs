//! The idle made visible: whole GPUs held far below what they offer, and the smallest MIG
//! instance that would do (pure).
//!
//! For each (container, device) that held a whole GPU in the window with at least
//! [`MIN_SAMPLES`] utilisation samples, the highest sample (SM percent of the whole GPU)
//! times [`HEADROOM`] is what the work needs. If a MIG profile of that GPU model (from the
//! catalog; media-extension profiles left out) smaller than the whole GPU offers that many
//! compute slices — slices / 7 of the SM — the smallest such profile (fewest slices, then
//! least memory) is suggested. Work whose peak needs more than the largest partial
//! profile is not under-driven, whatever its mean. Memory use is not sampled: the
//! suggestion is about SM; check the profile's memory against the job's.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tessera_api::Isolation;

use crate::span::Span;

/// The peak times this is what a suggested instance must offer.
pub const HEADROOM: f64 = 1.25;
/// Fewer samples than this say too little to suggest anything.
pub const MIN_SAMPLES: u64 = 3;

/// One whole GPU held well below what it offers, and what would fit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Suggestion {
    pub container_id: String,
    /// `namespace/pod/container` where it was a pod's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub tenant: String,
    pub device_uuid: String,
    pub gpu_model: String,
    /// Wall seconds it held the GPU in the window.
    pub held_seconds: f64,
    /// GPU-seconds held (a whole GPU: equal to `held_seconds`) and driven (held x mean SM).
    pub held_gpu_seconds: f64,
    pub driven_gpu_seconds: f64,
    pub sm_percent_avg: f64,
    pub sm_percent_peak: f64,
    pub samples: u64,
    /// The MIG profile that fits (`1g.10gb`) and the share of the GPU's SM it offers.
    pub fits: String,
    pub fits_share: f64,
    /// In words: "held a whole H100-80GB at 4.0% SM (peak 6.0%) for 30.0 d: a 1g.10gb
    /// instance (1/7 of the GPU) fits".
    pub message: String,
}

/// "30.0 d", "2.0 h", "5.0 min", "12 s".
pub fn human_duration(secs: f64) -> String {
    if secs >= 86_400.0 {
        format!("{:.1} d", secs / 86_400.0)
    } else if secs >= 3_600.0 {
        format!("{:.1} h", secs / 3_600.0)
    } else if secs >= 60.0 {
        format!("{:.1} min", secs / 60.0)
    } else {
        format!("{secs:.0} s")
    }
}

/// The smallest MIG profile of `model` smaller than the whole GPU whose compute share
/// covers `need_percent` of the SM: (name, compute slices).
pub fn fitting_profile(model: &str, need_percent: f64) -> Option<(&'static str, u8)> {
    let m = catalog::model(model)?;
    let mut profiles: Vec<&catalog::Profile> = m
        .profiles
        .iter()
        .filter(|p| !p.is_media_extension() && p.compute_slices < catalog::COMPUTE_SLICES)
        .collect();
    profiles.sort_by_key(|p| (p.compute_slices, p.memory_mib));
    profiles
        .into_iter()
        .find(|p| {
            f64::from(p.compute_slices) / f64::from(catalog::COMPUTE_SLICES) * 100.0 >= need_percent
        })
        .map(|p| (p.name, p.compute_slices))
}

#[derive(Default)]
struct Held {
    span: Option<Span>,
    held_ms: u64,
    gs: f64,
    driven: f64,
    samples: u64,
    peak: Option<f64>,
    unknown_peak: bool,
}

/// The under-driven whole GPUs of `[from, to)`, sorted by container then device.
pub fn under_driven(spans: &[Span], from: u64, to: u64) -> Vec<Suggestion> {
    let mut held: BTreeMap<(String, String), Held> = BTreeMap::new();
    for s in spans.iter().filter(|s| s.isolation == Isolation::Gpu && s.fraction >= 1.0) {
        let overlap = s.overlap_ms(from, to);
        if overlap == 0 || s.samples == 0 {
            continue;
        }
        let h = held.entry((s.container_id.clone(), s.device_uuid.clone())).or_default();
        #[allow(clippy::cast_precision_loss)]
        let gs = overlap as f64 / 1000.0 * s.fraction;
        h.held_ms += overlap;
        h.gs += gs;
        h.driven += gs * s.used_ratio.unwrap_or(0.0);
        h.samples += s.samples;
        match s.sm_peak {
            Some(p) => h.peak = Some(h.peak.map_or(p, |q: f64| q.max(p))),
            None => h.unknown_peak = true,
        }
        if h.span.is_none() {
            h.span = Some(s.clone());
        }
    }
    let mut out = Vec::new();
    for ((container, device), h) in held {
        let (Some(span), Some(peak)) = (h.span, h.peak) else { continue };
        if h.unknown_peak || h.samples < MIN_SAMPLES || h.gs <= 0.0 {
            continue;
        }
        let Some((profile, slices)) = fitting_profile(&span.gpu_model, peak * HEADROOM) else {
            continue;
        };
        let avg = 100.0 * h.driven / h.gs;
        #[allow(clippy::cast_precision_loss)]
        let held_seconds = h.held_ms as f64 / 1000.0;
        let share = f64::from(slices) / f64::from(catalog::COMPUTE_SLICES);
        out.push(Suggestion {
            message: format!(
                "held a whole {} at {avg:.1}% SM (peak {peak:.1}%) for {}: a {profile} instance ({slices}/{} of the GPU) fits",
                span.gpu_model,
                human_duration(held_seconds),
                catalog::COMPUTE_SLICES
            ),
            name: span.workload.as_ref().map(tessera_api::cri::Workload::display_name),
            container_id: container,
            tenant: span.tenant.clone(),
            device_uuid: device,
            gpu_model: span.gpu_model.clone(),
            held_seconds,
            held_gpu_seconds: h.gs,
            driven_gpu_seconds: h.driven,
            sm_percent_avg: avg,
            sm_percent_peak: peak,
            samples: h.samples,
            fits: profile.to_string(),
            fits_share: share,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_smallest_profile_whose_share_covers_the_peak_with_headroom() {
        assert_eq!(fitting_profile("H100-80GB", 6.0 * HEADROOM), Some(("1g.10gb", 1)));
        // 14.29% is 1g; 20% needs 2g.
        assert_eq!(fitting_profile("H100-80GB", 20.0), Some(("2g.20gb", 2)));
        assert_eq!(fitting_profile("A100-40GB", 40.0), Some(("3g.20gb", 3)));
        assert_eq!(fitting_profile("H100-80GB", 58.0), None, "4g is 57.1%: nothing smaller fits");
        assert_eq!(fitting_profile("T4", 1.0), None, "no MIG on that model");
        assert_eq!(human_duration(30.0 * 86_400.0), "30.0 d");
        assert_eq!(human_duration(12.0), "12 s");
    }
}
