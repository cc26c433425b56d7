//! A trace's rows as the quota simulator's jobs (`tessera sim --quota-modes` and
//! `--quota-family`, [`crate::quota_table`]): who owns each row and which rows checkpoint.

use crate::quota_sim;
use crate::replay::{self, RowAsk, Trace};

/// The tenants trace rows go to under --quota-modes: the leaves of the tenant tree with a
/// quota on their chain, sorted by path.
pub fn quota_tenants(policy: &policy::Policy) -> Vec<String> {
    let all = policy.tenants();
    let mut leaves: Vec<String> = all
        .iter()
        .filter(|t| !all.iter().any(|o| o.path.starts_with(&format!("{}/", t.path))))
        .filter(|t| policy.quotas().chain(&t.path).next().is_some())
        .map(|t| t.path.to_string())
        .collect();
    leaves.sort();
    leaves
}

/// Whether the job of trace row `name` checkpoints when `fraction` of the jobs do: a hash
/// of the name (FNV-1a-64 of `checkpoint:` and the name) below `fraction` of its range, so
/// the same rows checkpoint in every mode and run, and raising the fraction only adds rows.
pub fn checkpoints(name: &str, fraction: f64) -> bool {
    let h = slicer::fnv1a64(format!("checkpoint:{name}").as_bytes());
    ((h % 1_000_000) as f64) < fraction * 1_000_000.0
}

/// The trace's GPU rows as jobs on `model` (`tessera sim --quota-modes --help` says how), the `checkpoint_fraction`
/// of them (by [`checkpoints`]) checkpointing, and how many rows were skipped (no GPU).
pub fn quota_jobs(
    trace: &Trace,
    tenants: &[String],
    model: &str,
    checkpoint_fraction: f64,
) -> (Vec<quota_sim::Job>, usize) {
    let mut skipped = 0;
    let mut jobs = Vec::with_capacity(trace.requests.len());
    for r in &trace.requests {
        let micro = match r.ask() {
            RowAsk::CpuOnly => None,
            RowAsk::Whole(n) => Some(u64::from(n) * quota::MICRO_PER_GPU),
            RowAsk::Fraction(milli) => Some(u64::from(milli) * (quota::MICRO_PER_GPU / 1000)),
        };
        let (Some(micro), Some(owner)) = (micro, replay::row_owner(&r.name, tenants.len())) else {
            skipped += 1;
            continue;
        };
        jobs.push(quota_sim::Job {
            id: r.name.clone(),
            tenant: tenants[owner].clone(),
            arrival_s: r.arrival,
            duration_s: r.departure.saturating_sub(r.arrival),
            resources: quota::Resources::new().with(quota::Resource::gpu(model), micro),
            gang: None,
            checkpoints: checkpoints(&r.name, checkpoint_fraction),
        });
    }
    (jobs, skipped)
}
