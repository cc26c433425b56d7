//! A policy's prices and billing terms as the metering roll-up takes them: the one
//! conversion every bill uses (a node's `tessera usage`, the coordinator's fleet report,
//! and [`crate::proof::verify_bill`], which recomputes a bill from the signed revision).

use quota::Resource;

/// The policy's `prices`.
pub fn prices_of(p: &policy::Policy) -> metering::Prices {
    metering::Prices {
        per_model: p
            .prices()
            .iter()
            .map(|(m, r)| {
                (
                    m.clone(),
                    metering::Rate {
                        reserved_per_gpu_hour: r.reserved_per_gpu_hour,
                        burst_per_gpu_hour: r.burst_per_gpu_hour,
                        nvlink_premium_per_gpu_hour: r.nvlink_premium_per_gpu_hour,
                    },
                )
            })
            .collect(),
    }
}

/// The policy's GPU guarantees (the floors), `billing` modes and preempted-work rule.
/// `bill_floors`: whether this report bills the floors (the fleet's report, or a node that
/// is its own fleet); `as_of_ms`: floors are billed up to then at most.
pub fn terms_of(p: &policy::Policy, bill_floors: bool, as_of_ms: Option<u64>) -> metering::Terms {
    let mut guarantees: std::collections::BTreeMap<
        String,
        std::collections::BTreeMap<String, u64>,
    > = Default::default();
    for q in p.quotas().iter() {
        for (r, l) in &q.limits {
            if let (Resource::Gpu(model), Some(g)) = (r, l.guarantee) {
                if g > 0 {
                    guarantees.entry(q.path.clone()).or_default().insert(model.clone(), g);
                }
            }
        }
    }
    let b = p.billing();
    let mode = |m: policy::BillingMode| match m {
        policy::BillingMode::Showback => metering::Mode::Showback,
        policy::BillingMode::Chargeback => metering::Mode::Chargeback,
    };
    metering::Terms {
        guarantees,
        bill_floors,
        as_of_ms,
        modes: b.modes.iter().map(|(t, m)| (t.clone(), mode(*m))).collect(),
        default_mode: mode(b.default_mode),
        preempted: match b.preempted {
            policy::PreemptedWork::Bill => metering::Preempted::Bill,
            policy::PreemptedWork::Waive => metering::Preempted::Waive,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guarantees_modes_and_the_premium_come_from_the_policy() {
        let p = policy::Policy::parse(
            br#"{"version": 1, "orgs": {"acme": {"trust": "dev", "teams": {"ml": {}, "web": {}}}},
                "prices": {"H100-80GB": {"reserved_per_gpu_hour": 2, "burst_per_gpu_hour": 3, "nvlink_premium_per_gpu_hour": 0.5}},
                "quotas": {"acme": {"gpus": {"H100-80GB": {"guarantee": 8}}},
                           "acme/ml": {"gpus": {"H100-80GB": {"guarantee": 4}}, "cpu_cores": {"guarantee": 2}},
                           "acme/web": {"gpus": {"H100-80GB": {"ceiling": 2}}}},
                "billing": {"modes": {"acme/ml": "chargeback"}, "preempted": "waive"}}"#,
            "p.json",
        )
        .expect("policy");
        let t = terms_of(&p, true, Some(5));
        assert_eq!(t.guarantees["acme/ml"]["H100-80GB"], 4_000_000);
        assert!(!t.guarantees.contains_key("acme/web"), "a ceiling is no floor");
        assert_eq!(t.own_floors()[&("acme".to_string(), "H100-80GB".to_string())], 4_000_000);
        assert_eq!(t.mode_of("acme/ml/x"), metering::Mode::Chargeback);
        assert_eq!(t.mode_of("acme/web"), metering::Mode::Showback);
        assert_eq!(t.preempted, metering::Preempted::Waive);
        assert_eq!((t.bill_floors, t.as_of_ms), (true, Some(5)));
        assert_eq!(prices_of(&p).per_model["H100-80GB"].nvlink_premium_per_gpu_hour, 0.5);
    }
}
