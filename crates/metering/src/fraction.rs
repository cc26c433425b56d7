//! How much of one physical GPU a grant counts as. Pure functions.

use tessera_api::Isolation;

/// Compute slices of a whole MIG-capable GPU (A100/H100/H200: 7).
pub const MIG_SLICES_PER_GPU: u8 = 7;

/// Why a fraction cannot be computed from what was given.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FractionError {
    #[error("a MIG grant needs its compute slice count (1..=7) or a policy weight")]
    MissingMigSlices,
    #[error("MIG compute slices must be 1..=7, got {0}")]
    BadMigSlices(u8),
    #[error("an MPS grant needs its percentage (1..=100) or a policy weight")]
    MissingMpsPercent,
    #[error("MPS percentage must be 1..=100, got {0}")]
    BadMpsPercent(u8),
    #[error("a shared grant needs its replica count (>= 1) or a policy weight")]
    MissingReplicas,
    #[error("shared replicas must be >= 1, got 0")]
    ZeroReplicas,
    #[error("a policy weight must be a finite number in (0, 1], got {0}")]
    BadWeight(f64),
}

/// The fraction of one physical GPU a single granted device counts as:
///
/// - whole GPU: 1 per device (a `gpu=2` grant is two devices, so two intervals of 1);
/// - MIG: compute slices / 7, unless the policy gives a weight;
/// - MPS: percent / 100;
/// - shared (time-sliced): 1 / replicas.
///
/// A policy weight (`weight_override`) wins for every isolation, so an operator can price
/// e.g. an A30's 4-slice MIG layout or a premium replica class.
pub fn try_fraction(
    isolation: Isolation,
    mig_compute_slices: Option<u8>,
    mps_percent: Option<u8>,
    shared_replicas: Option<u32>,
    weight_override: Option<f64>,
) -> Result<f64, FractionError> {
    if let Some(w) = weight_override {
        if !(w.is_finite() && w > 0.0 && w <= 1.0) {
            return Err(FractionError::BadWeight(w));
        }
        return Ok(w);
    }
    match isolation {
        Isolation::Gpu => Ok(1.0),
        Isolation::Mig => match mig_compute_slices {
            None => Err(FractionError::MissingMigSlices),
            Some(s) if s == 0 || s > MIG_SLICES_PER_GPU => Err(FractionError::BadMigSlices(s)),
            Some(s) => Ok(f64::from(s) / f64::from(MIG_SLICES_PER_GPU)),
        },
        Isolation::Mps => match mps_percent {
            None => Err(FractionError::MissingMpsPercent),
            Some(p) if p == 0 || p > 100 => Err(FractionError::BadMpsPercent(p)),
            Some(p) => Ok(f64::from(p) / 100.0),
        },
        Isolation::Shared => match shared_replicas {
            None => Err(FractionError::MissingReplicas),
            Some(0) => Err(FractionError::ZeroReplicas),
            Some(r) => Ok(1.0 / f64::from(r)),
        },
    }
}

/// [`try_fraction`], with every input it cannot use answered by 1.0: a device whose share
/// is unknown is metered as the whole device, the most it could have used. Callers that
/// want to refuse such input use [`try_fraction`].
pub fn fraction(
    isolation: Isolation,
    mig_compute_slices: Option<u8>,
    mps_percent: Option<u8>,
    shared_replicas: Option<u32>,
    weight_override: Option<f64>,
) -> f64 {
    try_fraction(isolation, mig_compute_slices, mps_percent, shared_replicas, weight_override)
        .unwrap_or(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_gpu_counts_one_per_device() {
        assert_eq!(fraction(Isolation::Gpu, None, None, None, None), 1.0);
        // Irrelevant inputs are ignored.
        assert_eq!(fraction(Isolation::Gpu, Some(3), Some(50), Some(4), None), 1.0);
    }

    #[test]
    fn mig_is_compute_slices_over_seven_unless_weighted() {
        assert_eq!(fraction(Isolation::Mig, Some(1), None, None, None), 1.0 / 7.0);
        assert_eq!(fraction(Isolation::Mig, Some(3), None, None, None), 3.0 / 7.0);
        assert_eq!(fraction(Isolation::Mig, Some(7), None, None, None), 1.0);
        assert_eq!(fraction(Isolation::Mig, Some(1), None, None, Some(0.25)), 0.25);
        assert_eq!(fraction(Isolation::Mig, None, None, None, Some(0.5)), 0.5);
        assert_eq!(
            try_fraction(Isolation::Mig, None, None, None, None),
            Err(FractionError::MissingMigSlices)
        );
        assert_eq!(
            try_fraction(Isolation::Mig, Some(8), None, None, None),
            Err(FractionError::BadMigSlices(8))
        );
        assert_eq!(fraction(Isolation::Mig, Some(0), None, None, None), 1.0, "unknown -> whole");
    }

    #[test]
    fn mps_is_percent_over_hundred() {
        assert_eq!(fraction(Isolation::Mps, None, Some(25), None, None), 0.25);
        assert_eq!(fraction(Isolation::Mps, None, Some(100), None, None), 1.0);
        assert_eq!(
            try_fraction(Isolation::Mps, None, Some(0), None, None),
            Err(FractionError::BadMpsPercent(0))
        );
        assert_eq!(
            try_fraction(Isolation::Mps, None, Some(101), None, None),
            Err(FractionError::BadMpsPercent(101))
        );
        assert_eq!(
            try_fraction(Isolation::Mps, None, None, None, None),
            Err(FractionError::MissingMpsPercent)
        );
    }

    #[test]
    fn shared_is_one_over_replicas() {
        assert_eq!(fraction(Isolation::Shared, None, None, Some(4), None), 0.25);
        assert_eq!(fraction(Isolation::Shared, None, None, Some(1), None), 1.0);
        assert_eq!(
            try_fraction(Isolation::Shared, None, None, Some(0), None),
            Err(FractionError::ZeroReplicas)
        );
        assert_eq!(
            try_fraction(Isolation::Shared, None, None, None, None),
            Err(FractionError::MissingReplicas)
        );
    }

    #[test]
    fn weights_must_be_in_zero_one() {
        for w in [0.0, -0.5, 1.5, f64::NAN, f64::INFINITY] {
            assert!(matches!(
                try_fraction(Isolation::Shared, None, None, Some(2), Some(w)),
                Err(FractionError::BadWeight(_))
            ));
            assert_eq!(fraction(Isolation::Shared, None, None, Some(2), Some(w)), 1.0);
        }
        assert_eq!(fraction(Isolation::Gpu, None, None, None, Some(1.0)), 1.0);
    }
}
