//! Roll-up invariants over random ledgers: every level's total is the sum of its
//! children and equals the node total; totals match an independent computation;
//! adjacent windows add up to their union.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;

use common::T0;
use metering::{
    Class, GroupBy, IntervalStart, Ledger, ManualClock, Prices, Rate, UsageQuery, UsageReport,
    POSTSTOP_REASON,
};
use proptest::prelude::*;
use tessera_api::Isolation;

#[derive(Debug, Clone)]
struct Gen {
    tenant: String,
    start: u64,
    /// `None`: still open at the end.
    duration: Option<u64>,
    fraction: f64,
    class: Class,
    model: &'static str,
}

fn tenant() -> impl Strategy<Value = String> {
    // Few names per level so groups collide; 1 to 4 segments so short paths occur.
    proptest::collection::vec(prop_oneof!["a", "b", "c"], 1..=4).prop_map(|v| v.join("/"))
}

fn interval() -> impl Strategy<Value = Gen> {
    (
        tenant(),
        0u64..100_000,
        proptest::option::weighted(0.85, 0u64..60_000),
        prop_oneof![Just(1.0), Just(1.0 / 7.0), Just(3.0 / 7.0), Just(0.25), Just(1.0 / 3.0)],
        prop_oneof![Just(Class::Guaranteed), Just(Class::Burst)],
        prop_oneof![Just("H100-80GB"), Just("A100-40GB"), Just("L4")],
    )
        .prop_map(|(tenant, start, duration, fraction, class, model)| Gen {
            tenant,
            start,
            duration,
            fraction,
            class,
            model,
        })
}

fn prices() -> Prices {
    let mut per_model = BTreeMap::new();
    per_model.insert("H100-80GB".into(), Rate::new(3.1, 1.7));
    per_model.insert("A100-40GB".into(), Rate::new(1.3, 0.9));
    Prices { per_model } // L4 left unpriced on purpose
}

/// Replays the generated intervals into a ledger, in time order; returns it with the
/// clock at `T0 + 200_000`.
fn build(gens: &[Gen]) -> (Ledger, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(T0, 0));
    let mut ledger = Ledger::open_in_memory(clock.clone()).expect("ledger");
    // (time, is_close, index): each container has one interval, opened before it closes.
    let mut events: Vec<(u64, bool, usize)> = Vec::new();
    for (i, g) in gens.iter().enumerate() {
        events.push((g.start, false, i));
        if let Some(d) = g.duration {
            events.push((g.start + d, true, i));
        }
    }
    events.sort_by_key(|&(t, close, i)| (t, close, i));
    for (t, close, i) in events {
        clock.set(T0 + t, t);
        let cid = format!("c{i}");
        if close {
            assert_eq!(ledger.close_container(&cid, POSTSTOP_REASON).expect("close").len(), 1);
        } else {
            let g = &gens[i];
            let s = IntervalStart {
                container_id: cid,
                tenant: g.tenant.clone(),
                node: "n".into(),
                gpu_uuid: format!("GPU-{i}"),
                gpu_model: g.model.into(),
                device_uuid: format!("GPU-{i}"),
                isolation: Isolation::Gpu,
                mig_profile: None,
                fraction: g.fraction,
                class: g.class,
                workload: None,
                nvlink_domain: None,
            };
            ledger.open_interval(&s).expect("open");
        }
        if t % 3 == 0 {
            ledger.checkpoint().expect("checkpoint");
        }
    }
    clock.set(T0 + 200_000, 200_000);
    (ledger, clock)
}

fn micros(x: f64) -> i128 {
    (x * 1e6).round() as i128
}

fn prefix(key: &str, depth: usize) -> String {
    key.split('/').take(depth).collect::<Vec<_>>().join("/")
}

fn report(l: &Ledger, from: u64, to: u64, by: GroupBy) -> UsageReport {
    l.usage(&UsageQuery::new(T0 + from, T0 + to, by, prices())).expect("usage")
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn every_level_sums_to_its_parent_and_to_the_node_total(
        gens in proptest::collection::vec(interval(), 0..40),
        a in 0u64..200_000,
        len in 1u64..200_000,
    ) {
        let (ledger, _clock) = build(&gens);
        let (from, to) = (a, a + len);
        let reports: BTreeMap<GroupBy, UsageReport> =
            GroupBy::ALL.into_iter().map(|by| (by, report(&ledger, from, to, by))).collect();
        let total = &reports[&GroupBy::Org].total;

        // Independent expectation from the generated data (now = 200 s).
        let mut want_micro = 0i128;
        let mut want_n = 0u64;
        for g in &gens {
            let end = g.start + g.duration.unwrap_or(200_000 - g.start);
            let overlap = end.min(to).saturating_sub(g.start.max(from));
            let touches = overlap > 0 || (g.start >= from && g.start < to);
            if touches {
                want_n += 1;
                want_micro += (overlap as f64 * g.fraction * 1000.0).round() as i128;
            }
        }
        prop_assert_eq!(micros(total.gpu_seconds), want_micro);
        prop_assert_eq!(total.intervals, want_n);

        for (by, r) in &reports {
            // The same node total whatever the grouping.
            prop_assert_eq!(&r.total, total);
            // Rows sum to the total, exactly (in millionths).
            let sum_gs: i128 = r.rows.iter().map(|x| micros(x.gpu_seconds)).sum();
            let sum_cost: i128 = r.rows.iter().map(|x| micros(x.cost)).sum();
            let sum_n: u64 = r.rows.iter().map(|x| x.intervals).sum();
            prop_assert_eq!(sum_gs, micros(total.gpu_seconds), "{} gpu_seconds", by);
            prop_assert_eq!(sum_cost, micros(total.cost), "{} cost", by);
            prop_assert_eq!(sum_n, total.intervals);
            // The report's own level totals agree.
            for lt in &r.levels {
                prop_assert_eq!(micros(lt.gpu_seconds), micros(total.gpu_seconds));
                prop_assert_eq!(micros(lt.cost), micros(total.cost));
                prop_assert_eq!(lt.intervals, total.intervals);
                prop_assert_eq!(lt.groups as usize, reports[&lt.by].rows.len());
            }
        }

        // Each tenant group is the sum of its children one level down.
        let tenant_levels = [GroupBy::Org, GroupBy::Team, GroupBy::Project, GroupBy::User];
        for (depth, pair) in tenant_levels.windows(2).enumerate() {
            let mut sums: BTreeMap<String, (i128, i128, u64)> = BTreeMap::new();
            for row in &reports[&pair[1]].rows {
                let e = sums.entry(prefix(&row.group, depth + 1)).or_default();
                e.0 += micros(row.gpu_seconds);
                e.1 += micros(row.cost);
                e.2 += row.intervals;
            }
            let parents: BTreeMap<String, (i128, i128, u64)> = reports[&pair[0]]
                .rows
                .iter()
                .map(|r| (r.group.clone(), (micros(r.gpu_seconds), micros(r.cost), r.intervals)))
                .collect();
            prop_assert_eq!(parents, sums, "{} vs {}", pair[0], pair[1]);
        }
        // Containers roll up into users.
        let mut per_user: BTreeMap<String, i128> = BTreeMap::new();
        for row in &reports[&GroupBy::Container].rows {
            let i: usize = row.group[1..].parse().expect("cN");
            *per_user.entry(gens[i].tenant.clone()).or_default() += micros(row.gpu_seconds);
        }
        let users: BTreeMap<String, i128> =
            reports[&GroupBy::User].rows.iter().map(|r| (r.group.clone(), micros(r.gpu_seconds))).collect();
        prop_assert_eq!(users, per_user);
    }

    #[test]
    fn adjacent_windows_add_up_to_their_union(
        gens in proptest::collection::vec(interval(), 0..30),
        a in 0u64..100_000,
        l1 in 1u64..100_000,
        l2 in 1u64..100_000,
    ) {
        let (ledger, _clock) = build(&gens);
        let whole = report(&ledger, a, a + l1 + l2, GroupBy::Team);
        let left = report(&ledger, a, a + l1, GroupBy::Team);
        let right = report(&ledger, a + l1, a + l1 + l2, GroupBy::Team);
        let diff = micros(whole.total.gpu_seconds)
            - micros(left.total.gpu_seconds)
            - micros(right.total.gpu_seconds);
        // Each interval is rounded once per window: at most one millionth apart each.
        prop_assert!(diff.unsigned_abs() <= u128::from(whole.total.intervals), "diff {}", diff);
        prop_assert!(whole.total.intervals <= left.total.intervals + right.total.intervals);
    }
}
