//! An upper bound on the useful GPU-seconds *any* scheduler that keeps the policy's GPU
//! ceilings can reach on a trace, whatever it knows of the future: the proof behind the
//! quota table's [`crate::quota_table::Verdict::Ceilings`] cells.
//!
//! # The bound
//!
//! Work is fluid here (a job may run on a part of a GPU, be split over time, be paused
//! without loss): every real schedule is such a schedule, so a bound on these bounds them
//! all. Take a tenant `t` whose GPU ceiling (the smallest on its chain) is `c`, the horizon
//! `H` and, for each of its jobs `j` that fits the ceiling (`g_j ≤ c`: one that does not is
//! never started), its work `w_j = g_j · min(d_j, H − a_j)` (GPUs × duration, cut at the
//! horizon). Let `X(s) = Σ_j g_j · clamp(s − a_j, 0, d_j)` be the most work the jobs could
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
//! there exactly, in one sweep. [`ceiling_bound`] returns the smaller of the two.
//!
//! It is a bound for restart from zero *and* for checkpointing: it loses nothing to
//! preemption at all. It ignores nodes (a job may straddle them) and CPU and memory, and
//! it ignores parent ceilings (each only lowers it). Where it is below
//! [`crate::quota_table::MIN_RATIO`] of FIFO's useful GPU-seconds, no scheduler that keeps
//! the ceilings keeps that share of FIFO's: FIFO's lead is work beyond a ceiling.

use std::collections::BTreeMap;

use quota::{QuotaTree, Resource, MICRO_PER_GPU};

use crate::quota_sim::Job;

/// One tenant's jobs, reduced to what the bound reads.
#[derive(Debug, Default)]
struct TenantWork {
    /// GPUs (fractional) of its ceiling; `None`: unbounded.
    ceiling: Option<f64>,
    /// (time, change of the rate at which `X` grows), GPUs.
    steps: Vec<(u64, f64)>,
    /// `W_t`: its jobs' work cut at the horizon, GPU-seconds.
    work: f64,
}

/// The smallest GPU ceiling of `model` on `tenant`'s chain, in GPUs (`None`: none).
fn gpu_ceiling(quotas: &QuotaTree, tenant: &str, model: &str) -> Option<f64> {
    let gpu = Resource::gpu(model);
    quotas
        .chain(tenant)
        .filter_map(|q| q.limits.get(&gpu).and_then(|l| l.ceiling))
        .min()
        .map(|m| m as f64 / MICRO_PER_GPU as f64)
}

/// The bound of the module documentation on the useful GPU-seconds of `model` that any
/// scheduler keeping `quotas`' GPU ceilings can reach on `jobs` with `gpus` GPUs, from the
/// first arrival to `horizon_s`.
pub fn ceiling_bound(
    jobs: &[Job],
    gpus: u64,
    model: &str,
    quotas: &QuotaTree,
    horizon_s: u64,
) -> f64 {
    let gpu = Resource::gpu(model);
    let mut tenants: BTreeMap<&str, TenantWork> = BTreeMap::new();
    let mut start = u64::MAX;
    for j in jobs.iter().filter(|j| j.arrival_s <= horizon_s) {
        start = start.min(j.arrival_s);
        let t = tenants.entry(&j.tenant).or_insert_with(|| TenantWork {
            ceiling: gpu_ceiling(quotas, &j.tenant, model),
            ..TenantWork::default()
        });
        let g = j.resources.get(&gpu) as f64 / MICRO_PER_GPU as f64;
        if g <= 0.0 || t.ceiling.is_some_and(|c| g > c) {
            continue;
        }
        let d = j.duration_s.min(horizon_s - j.arrival_s);
        if d == 0 {
            continue;
        }
        t.steps.push((j.arrival_s, g));
        t.steps.push((j.arrival_s + d, -g));
        t.work += g * d as f64;
    }
    if start == u64::MAX {
        return 0.0;
    }
    // Every breakpoint, each tenant's X at it.
    let mut times: Vec<u64> = tenants.values().flat_map(|t| t.steps.iter().map(|s| s.0)).collect();
    times.push(start);
    times.push(horizon_s);
    times.sort_unstable();
    times.dedup();
    let fleet = gpus as f64;
    let mut per_tenant: Vec<f64> = tenants.values().map(|t| t.work).collect();
    let mut fleet_bound = f64::INFINITY;
    let mut states: Vec<(usize, f64, f64)> = Vec::with_capacity(tenants.len()); // (next step, rate, X)
    let mut sorted: Vec<Vec<(u64, f64)>> = Vec::with_capacity(tenants.len());
    for t in tenants.values() {
        let mut s = t.steps.clone();
        s.sort_by_key(|e| e.0);
        sorted.push(s);
        states.push((0, 0.0, 0.0));
    }
    let mut last = start;
    let works: Vec<(Option<f64>, f64)> = tenants.values().map(|t| (t.ceiling, t.work)).collect();
    for &s in &times {
        let mut done = 0.0;
        let mut after = 0.0;
        for (i, (next, rate, x)) in states.iter_mut().enumerate() {
            *x += *rate * (s - last) as f64;
            while *next < sorted[i].len() && sorted[i][*next].0 <= s {
                *rate += sorted[i][*next].1;
                *next += 1;
            }
            let (ceiling, work) = works[i];
            let left = (work - *x).max(0.0);
            let room = ceiling.map_or(left, |c| left.min(c * (horizon_s - s) as f64));
            per_tenant[i] = per_tenant[i].min(*x + room);
            done += *x;
            after += room;
        }
        fleet_bound = fleet_bound.min(done + after.min(fleet * (horizon_s - s) as f64));
        last = s;
    }
    fleet_bound.min(per_tenant.iter().sum())
}

#[cfg(test)]
mod tests {
    use super::*;
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

    #[test]
    fn a_tenant_asking_past_its_ceiling_at_once_is_bounded_by_the_ceiling() {
        // Four jobs of 2 GPUs for 100 s at 0 under a ceiling of 4 GPUs, horizon 100 s: at
        // most 4 GPUs × 100 s, though the fleet has 16 and the work is 800.
        let q = quotas(&[("a", 4)]);
        let jobs: Vec<Job> = (0..4).map(|i| job(&format!("j{i}"), "a", 0, 100, 2)).collect();
        assert_eq!(ceiling_bound(&jobs, 16, MODEL, &q, 100), 400.0);
    }

    #[test]
    fn work_that_arrives_late_is_bounded_by_its_arrival_not_the_span() {
        // One 8-GPU job at 0 for 50 s, one at 50 for 50 s, ceiling 8, horizon 100: 800,
        // reachable; the cut at s = 50 gives 400 + 8 × 50.
        let q = quotas(&[("a", 8)]);
        let jobs = vec![job("x", "a", 0, 50, 8), job("y", "a", 50, 50, 8)];
        assert_eq!(ceiling_bound(&jobs, 16, MODEL, &q, 100), 800.0);
        // The same two asked at 0 with a ceiling of 8: only 8 × 100 again; with the second
        // arriving at 80 it cannot run past the horizon: 400 + 8 × 20.
        let jobs = vec![job("x", "a", 0, 50, 8), job("y", "a", 80, 50, 8)];
        assert_eq!(ceiling_bound(&jobs, 16, MODEL, &q, 100), 560.0);
    }

    #[test]
    fn the_fleet_bounds_tenants_whose_ceilings_together_exceed_it() {
        // Two tenants with ceilings of 8 each on 8 GPUs, each asking 8 for 100 s at 0.
        let q = quotas(&[("a", 8), ("b", 8)]);
        let jobs = vec![job("x", "a", 0, 100, 8), job("y", "b", 0, 100, 8)];
        assert_eq!(ceiling_bound(&jobs, 8, MODEL, &q, 100), 800.0);
        assert_eq!(ceiling_bound(&jobs, 16, MODEL, &q, 100), 1600.0);
    }

    #[test]
    fn the_bound_is_what_fifo_within_the_ceiling_reaches_where_the_ceiling_binds_all_along() {
        // Ten 1-GPU jobs of 100 s at 0 under a ceiling of 4 on one node of 8: FIFO within
        // the ceiling runs 4 at a time to the horizon (100 s) and reaches the bound
        // exactly; FIFO, ignoring the ceiling, runs 8 and passes it.
        use crate::quota_sim::{run, Fleet, Mode};
        let q = quotas(&[("a", 4)]);
        let jobs: Vec<Job> = (0..10).map(|i| job(&format!("j{i}"), "a", 0, 100, 1)).collect();
        let fleet = Fleet {
            nodes: 1,
            gpus_per_node: 8,
            model: MODEL.into(),
            cpu_milli_per_node: None,
            memory_mib_per_node: None,
        };
        let useful = |mode| {
            let r = run(&jobs, &fleet, &q, mode, None).expect("runs");
            r.gpu_seconds - r.lost_gpu_seconds
        };
        let bound = ceiling_bound(&jobs, 8, MODEL, &q, 100);
        assert_eq!(bound, 400.0);
        assert_eq!(useful(Mode::FifoCeilings), bound);
        assert_eq!(useful(Mode::Quotas), bound);
        assert_eq!(useful(Mode::Fifo), 800.0);
    }

    #[test]
    fn a_job_larger_than_its_ceiling_counts_for_nothing() {
        let q = quotas(&[("a", 4)]);
        let jobs = vec![job("x", "a", 0, 100, 8), job("y", "a", 0, 100, 2)];
        assert_eq!(ceiling_bound(&jobs, 16, MODEL, &q, 100), 200.0);
    }
}
