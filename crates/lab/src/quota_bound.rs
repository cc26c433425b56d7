//! An upper bound on the useful GPU-seconds *any* scheduler that keeps the policy's GPU
//! ceilings can reach on a trace, whatever it knows of the future: the proof behind the
//! quota table's [`crate::quota_table::Verdict::Ceilings`] cells.
//!
//! # The bound
//!
//! Work is fluid here (a job may run on a part of a GPU, be split over time, be paused
//! without loss): every real schedule is such a schedule, so a bound on these bounds them
//! all. Work comes in the simulator's units: a job, or a gang (its members' GPUs summed, from
//! the last member's arrival, for the longest member's duration: [`crate::quota_sim`],
//! Input). Take a tenant `t` whose GPU ceiling (the smallest on its chain) is `c`, the
//! horizon `H` and, for each of its units `j` that fits the ceiling (`g_j ≤ c`: one that does
//! not is never started), its work `w_j = g_j · min(d_j, H − a_j)` (GPUs × duration, cut at
//! the horizon). Let `X(s) = Σ_j g_j · clamp(s − a_j, 0, d_j)` be the most work the jobs could
//! have done by `s` had each run from its arrival. For every `s` in the span, the work done
//! by `H` is at most what could be done by `s` plus what the ceiling lets run after it:
//!
//! ```text
//!     U_t ≤ min( Σ_j w_j ,  min_s  X_t(s) + c_t·(H − s) )
//! ```
//!
//! For the fleet of `G` GPUs, the same cut at one `s` for every tenant at once:
//!
//! ```text
//!     U ≤ min_s  Σ_t X_t(s) + min( G·(H − s), Σ_t min( c_t·(H − s), W_t − X_t(s) ) )
//! ```
//!
//! (work after `s` is bounded by the GPUs, by each ceiling and by what is left of each
//! tenant's work; raising any `X_t` by ε raises the first sum by ε and lowers the second
//! by at most ε, so taking each at its most is the bound). Both expressions are piecewise
//! linear in `s` and concave between the breakpoints of the `X_t` (the arrivals and the
//! ends `a_j + d_j`), so their minimum is at a breakpoint or an end of the span: evaluated
//! there exactly, in one sweep, in integers (micro-GPU-seconds: a rate summed from
//! fractions of GPUs in floating point leaves a residue that the span multiplies).
//! [`ceiling_bound`] returns the smaller of the two.
//!
//! It is a bound for restart from zero *and* for checkpointing: it loses nothing to
//! preemption at all. It ignores nodes (a job may straddle them) and CPU and memory, and
//! it ignores parent ceilings (each only lowers it). Where it is below
//! [`crate::quota_table::MIN_RATIO`] of FIFO's useful GPU-seconds, no scheduler that keeps
//! the ceilings keeps that share of FIFO's: FIFO's lead is work beyond a ceiling.

use std::collections::BTreeMap;

use quota::{QuotaTree, Resource, MICRO_PER_GPU};

use crate::quota_sim::{self, Fleet, Job, SimError};

/// One tenant's work, reduced to what the bound reads; micro-GPUs and micro-GPU-seconds.
#[derive(Debug, Default)]
struct TenantWork {
    /// Its ceiling (the smallest on its chain); `None`: unbounded.
    ceiling: Option<i128>,
    /// (time, change of the rate at which `X` grows).
    steps: Vec<(u64, i128)>,
    /// `W_t`: its units' work cut at the horizon.
    work: i128,
}

/// The smallest GPU ceiling of `model` on `tenant`'s chain, micro-GPUs (`None`: none).
fn gpu_ceiling(quotas: &QuotaTree, tenant: &str, model: &str) -> Option<i128> {
    let gpu = Resource::gpu(model);
    quotas
        .chain(tenant)
        .filter_map(|q| q.limits.get(&gpu).and_then(|l| l.ceiling))
        .min()
        .map(i128::from)
}

/// The bound of the module documentation on the useful GPU-seconds of `fleet`'s model that
/// any scheduler keeping `quotas`' GPU ceilings can reach on `jobs` on `fleet`, over
/// `span_s` seconds from the first arrival (of a job, or of a gang's last member: where
/// the simulator's span starts), the jobs taken as the simulator's units
/// ([`quota_sim::unit_work`]; refused as [`quota_sim::run`] refuses them). Exact integer
/// arithmetic in micro-GPU-seconds; the result in GPU-seconds.
pub fn ceiling_bound(
    jobs: &[Job],
    fleet: &Fleet,
    quotas: &QuotaTree,
    span_s: u64,
) -> Result<f64, SimError> {
    let model = fleet.model.as_str();
    let units = quota_sim::unit_work(jobs, fleet)?;
    let Some(start) = units.iter().map(|u| u.arrival_s).min() else { return Ok(0.0) };
    let horizon = start.saturating_add(span_s);
    let mut tenants: BTreeMap<&str, TenantWork> = BTreeMap::new();
    for u in units.iter().filter(|u| u.arrival_s <= horizon) {
        let t = tenants.entry(u.tenant.as_str()).or_insert_with(|| TenantWork {
            ceiling: gpu_ceiling(quotas, &u.tenant, model),
            ..TenantWork::default()
        });
        let g = i128::from(u.micro_gpus);
        let d = u.duration_s.min(horizon - u.arrival_s);
        // Nothing to run, or wider than its ceiling: never started by a scheduler that
        // keeps it.
        if g == 0 || d == 0 || t.ceiling.is_some_and(|c| g > c) {
            continue;
        }
        t.steps.push((u.arrival_s, g));
        t.steps.push((u.arrival_s + d, -g));
        t.work += g * i128::from(d);
    }
    // Every breakpoint; each tenant's X at it.
    let mut times: Vec<u64> = tenants.values().flat_map(|t| t.steps.iter().map(|s| s.0)).collect();
    times.push(start);
    times.push(horizon);
    times.sort_unstable();
    times.dedup();
    let gpus = u64::from(fleet.nodes) * u64::from(fleet.gpus_per_node);
    let fleet = i128::from(gpus) * i128::from(MICRO_PER_GPU);
    let mut per_tenant: Vec<i128> = tenants.values().map(|t| t.work).collect();
    let mut fleet_bound = i128::MAX;
    for t in tenants.values_mut() {
        t.steps.sort_unstable_by_key(|e| e.0);
    }
    // Per tenant: its next step, the rate at which X grows, X.
    let mut sweep: Vec<(usize, i128, i128)> = vec![(0, 0, 0); tenants.len()];
    let mut last = start;
    for &s in &times {
        let rest = i128::from(horizon - s);
        let (mut done, mut after) = (0i128, 0i128);
        for (i, (t, (next, rate, x))) in tenants.values().zip(sweep.iter_mut()).enumerate() {
            *x += *rate * i128::from(s - last);
            while *next < t.steps.len() && t.steps[*next].0 <= s {
                *rate += t.steps[*next].1;
                *next += 1;
            }
            let left = (t.work - *x).max(0);
            let room = t.ceiling.map_or(left, |c| left.min(c * rest));
            per_tenant[i] = per_tenant[i].min(*x + room);
            done += *x;
            after += room;
        }
        fleet_bound = fleet_bound.min(done + after.min(fleet * rest));
        last = s;
    }
    let bound = fleet_bound.min(per_tenant.iter().sum());
    Ok(bound as f64 / MICRO_PER_GPU as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota_sim::{run, Mode};
    use quota::Resources;

    const MODEL: &str = "H100-80GB";

    fn quotas(ceilings: &[(&str, u64)]) -> QuotaTree {
        let mut doc =
            String::from("{\"version\":1,\"orgs\":{\"o\":{\"trust\":\"trusted\",\"teams\":{");
        let teams: Vec<String> = ceilings.iter().map(|(t, _)| format!("\"{t}\":{{}}")).collect();
        doc.push_str(&teams.join(","));
        doc.push_str("}}},\"quotas\":{");
        let qs: Vec<String> = ceilings
            .iter()
            .map(|(t, c)| format!("\"o/{t}\":{{\"gpus\":{{\"{MODEL}\":{{\"ceiling\":{c}}}}}}}"))
            .collect();
        doc.push_str(&qs.join(","));
        doc.push_str("}}");
        policy::Policy::parse(doc.as_bytes(), "test").expect("policy").quotas().clone()
    }

    fn job(id: &str, tenant: &str, at: u64, dur: u64, gpus: u64) -> Job {
        Job {
            id: id.into(),
            tenant: format!("o/{tenant}"),
            arrival_s: at,
            duration_s: dur,
            resources: Resources::new().with_gpus(MODEL, gpus),
            gang: None,
            checkpoints: false,
        }
    }

    /// `n` GPUs of [`MODEL`], in nodes of 8.
    fn gpus(n: u32) -> Fleet {
        Fleet {
            nodes: n / 8,
            gpus_per_node: 8,
            model: MODEL.into(),
            cpu_milli_per_node: None,
            memory_mib_per_node: None,
        }
    }

    #[test]
    fn a_tenant_asking_past_its_ceiling_at_once_is_bounded_by_the_ceiling() {
        // Four jobs of 2 GPUs for 100 s at 0 under a ceiling of 4 GPUs, horizon 100 s: at
        // most 4 GPUs × 100 s, though the fleet has 16 and the work is 800.
        let q = quotas(&[("a", 4)]);
        let jobs: Vec<Job> = (0..4).map(|i| job(&format!("j{i}"), "a", 0, 100, 2)).collect();
        assert_eq!(ceiling_bound(&jobs, &gpus(16), &q, 100).expect("bound"), 400.0);
    }

    #[test]
    fn work_that_arrives_late_is_bounded_by_its_arrival_not_the_span() {
        // One 8-GPU job at 0 for 50 s, one at 50 for 50 s, ceiling 8, horizon 100: 800,
        // reachable; the cut at s = 50 gives 400 + 8 × 50.
        let q = quotas(&[("a", 8)]);
        let jobs = vec![job("x", "a", 0, 50, 8), job("y", "a", 50, 50, 8)];
        assert_eq!(ceiling_bound(&jobs, &gpus(16), &q, 100).expect("bound"), 800.0);
        // The same two asked at 0 with a ceiling of 8: only 8 × 100 again; with the second
        // arriving at 80 it cannot run past the horizon: 400 + 8 × 20.
        let jobs = vec![job("x", "a", 0, 50, 8), job("y", "a", 80, 50, 8)];
        assert_eq!(ceiling_bound(&jobs, &gpus(16), &q, 100).expect("bound"), 560.0);
    }

    #[test]
    fn the_fleet_bounds_tenants_whose_ceilings_together_exceed_it() {
        // Two tenants with ceilings of 8 each on 8 GPUs, each asking 8 for 100 s at 0.
        let q = quotas(&[("a", 8), ("b", 8)]);
        let jobs = vec![job("x", "a", 0, 100, 8), job("y", "b", 0, 100, 8)];
        assert_eq!(ceiling_bound(&jobs, &gpus(8), &q, 100).expect("bound"), 800.0);
        assert_eq!(ceiling_bound(&jobs, &gpus(16), &q, 100).expect("bound"), 1600.0);
    }

    #[test]
    fn the_bound_is_what_fifo_within_the_ceiling_reaches_where_the_ceiling_binds_all_along() {
        // Ten 1-GPU jobs of 100 s at 0 under a ceiling of 4 on one node of 8: FIFO within
        // the ceiling runs 4 at a time to the horizon (100 s) and reaches the bound
        // exactly; FIFO, ignoring the ceiling, runs 8 and passes it.
        let q = quotas(&[("a", 4)]);
        let jobs: Vec<Job> = (0..10).map(|i| job(&format!("j{i}"), "a", 0, 100, 1)).collect();
        let fleet = gpus(8);
        let useful = |mode| {
            let r = run(&jobs, &fleet, &q, mode, None).expect("runs");
            r.gpu_seconds - r.lost_gpu_seconds
        };
        let bound = ceiling_bound(&jobs, &gpus(8), &q, 100).expect("bound");
        assert_eq!(bound, 400.0);
        assert_eq!(useful(Mode::FifoCeilings), bound);
        assert_eq!(useful(Mode::Quotas), bound);
        assert_eq!(useful(Mode::Fifo), 800.0);
    }

    #[test]
    fn no_schedule_of_the_simulator_that_keeps_the_ceilings_passes_it_and_fifo_within_them_often_meets_it(
    ) {
        // 300 small random cases (one node of 8, teams with ceilings of 3 and 4 GPUs and
        // one without, 4-12 jobs of 1-4 GPUs, some fractions, some gangs): FIFO within the
        // ceilings and quotas never pass the bound, and FIFO within the ceilings meets it
        // exactly in many (a bound too low anywhere near them fails here).
        let q = quotas(&[("a", 3), ("b", 4)]);
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = |n: u64| {
            seed = seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (seed >> 33) % n
        };
        let (mut tight, mut cases) = (0, 0);
        for case in 0..300 {
            let n = 4 + next(9);
            let jobs: Vec<Job> = (0..n)
                .map(|i| {
                    let tenant = ["a", "b", "c"][next(3) as usize];
                    let mut j = job(&format!("j{i}"), tenant, next(60), 1 + next(120), 1 + next(4));
                    if next(5) == 0 {
                        j.resources =
                            Resources::new().with(Resource::gpu(MODEL), 100_000 * (1 + next(9)));
                    } else if next(6) == 0 {
                        j.gang = Some(format!("{tenant}-gang"));
                    }
                    j
                })
                .collect();
            let runs = [Mode::FifoCeilings, Mode::Quotas]
                .map(|mode| run(&jobs, &gpus(8), &q, mode, None).expect("runs"));
            let bound = ceiling_bound(&jobs, &gpus(8), &q, runs[0].span_s).expect("bound");
            for r in &runs {
                let useful = r.gpu_seconds - r.lost_gpu_seconds;
                assert!(
                    useful <= bound + 1e-6,
                    "case {case} {:?}: {useful} > {bound}: {jobs:?}",
                    r.mode
                );
            }
            cases += 1;
            tight +=
                usize::from((runs[0].gpu_seconds - runs[0].lost_gpu_seconds - bound).abs() < 1e-6);
        }
        assert!(tight * 5 > cases, "FIFO within the ceilings met the bound in {tight} of {cases}");
    }

    #[test]
    fn a_job_larger_than_its_ceiling_counts_for_nothing() {
        let q = quotas(&[("a", 4)]);
        let jobs = vec![job("x", "a", 0, 100, 8), job("y", "a", 0, 100, 2)];
        assert_eq!(ceiling_bound(&jobs, &gpus(16), &q, 100).expect("bound"), 200.0);
    }

    // --- red team (branch rt-bound): counterexamples -----------------------------------

    fn useful_of(jobs: &[Job], q: &QuotaTree, mode: Mode, h: u64) -> f64 {
        let r = run(jobs, &gpus(8), q, mode, Some(h)).expect("runs");
        r.gpu_seconds - r.lost_gpu_seconds
    }

    #[test]
    fn a_gang_counts_every_members_gpus_for_its_longest_members_duration() {
        // quota_sim runs a gang as one unit "for the longest member's duration" and counts
        // every member's GPUs for all of it (Unit::duration = max, accrue = unit.gpu ×
        // secs). The bound counts each member for its own duration: g · min(d_j, H − a_j).
        // Gang of two 1-GPU members, 100 s and 10 s, ceiling 4, 8 GPUs, horizon 100:
        // FIFO within the ceilings holds 2 GPUs × 100 s = 200 useful; the bound says 110.
        let q = quotas(&[("a", 4)]);
        let mut long = job("m1", "a", 0, 100, 1);
        let mut short = job("m2", "a", 0, 10, 1);
        long.gang = Some("g".into());
        short.gang = Some("g".into());
        let jobs = vec![long, short];
        let bound = ceiling_bound(&jobs, &gpus(8), &q, 100).expect("bound");
        for mode in [Mode::FifoCeilings, Mode::Quotas] {
            let useful = useful_of(&jobs, &q, mode, 100);
            assert!(useful <= bound * (1.0 + 1e-9), "{mode:?}: useful {useful} > bound {bound}");
        }
    }

    #[test]
    fn fractions_leave_no_residue_that_a_long_span_multiplies() {
        // Found by the red team: X integrated with a floating-point rate that adds and
        // subtracts fractions of GPUs (+0.3 +0.6 −0.3 −0.6 leaves −1.1e-16 GPU, not 0),
        // multiplied by the span: over 1e18 s the bound was negative (−21), over 1e13 s
        // 89.9989, below the 90 GPU-seconds FIFO within the ceiling runs.
        let q = quotas(&[("a", 4)]);
        let frac = |id: &str, micro: u64| Job {
            resources: Resources::new().with(Resource::gpu(MODEL), micro),
            ..job(id, "a", 0, 100, 0)
        };
        let jobs = vec![frac("x", 300_000), frac("y", 600_000)];
        for span in [10_000_000_000_000, 1_000_000_000_000_000_000] {
            let bound = ceiling_bound(&jobs, &gpus(8), &q, span).expect("bound");
            assert_eq!(bound, 90.0, "span {span}");
            assert_eq!(useful_of(&jobs, &q, Mode::FifoCeilings, span), 90.0, "span {span}");
        }
    }

    #[test]
    fn quotas_keep_a_parent_ceiling_when_a_reclaim_under_it_finds_room_on_the_node() {
        // The premise that Mode::Quotas keeps the ceilings (found by the red team): org `o`
        // has a ceiling of 4 GPUs, `o/a` a guarantee of 2 under it, `o/b` nothing of its
        // own. b borrows 4 (o full); a asks 2 within its guarantee: admit says Reclaim
        // under `o` (the ceiling is full of b's borrowed work). The simulator took victims
        // by the bins only: the node had 4 GPUs free, every victim was spared as not
        // needed and a started at once, o holding 6 GPUs for 100 s (useful 4,200 GPU-s
        // where the ceiling allows 4 × 1,000). Victims must also cover what the books are
        // short of, as the books take them.
        let doc = format!(
            "{{\"version\":1,\"orgs\":{{\"o\":{{\"trust\":\"trusted\",\"teams\":{{\"a\":{{}},\"b\":{{}}}}}}}},\
             \"quotas\":{{\"o\":{{\"gpus\":{{\"{MODEL}\":{{\"ceiling\":4}}}}}},\
             \"o/a\":{{\"gpus\":{{\"{MODEL}\":{{\"guarantee\":2,\"ceiling\":4}}}}}}}}}}"
        );
        let q = policy::Policy::parse(doc.as_bytes(), "test").expect("policy").quotas().clone();
        let jobs = vec![job("b1", "b", 0, 1000, 4), job("a1", "a", 10, 100, 2)];
        let r = run(&jobs, &gpus(8), &q, Mode::Quotas, Some(1000)).expect("runs");
        let useful = r.gpu_seconds - r.lost_gpu_seconds;
        assert!(useful <= 4.0 * 1000.0, "o's ceiling of 4 GPUs over 1000 s; useful {useful}");
        // As the books do: b's borrowed work under the ceiling is the victim.
        assert_eq!(r.preemptions, 1);
    }
}
