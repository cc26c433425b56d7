//! Fleet quotas: hierarchical guarantees and ceilings, borrowing, dominant resource
//! fairness, the fair queue order and the choice of reclaim victims. Pure: no I/O, no
//! clock, no async. The coordinator's books (`crates/coordinator`) and every tesserad's
//! quota gate (`crates/daemon`) decide with it (docs/QUOTAS.md says what is built).
//!
//! # The model
//!
//! Any node of the policy's tenant tree (`acme`, `acme/ml`, `acme/ml/vision`,
//! `acme/ml/vision/alice`) may carry a quota. For each resource it names — GPUs of one
//! catalog model in GPU-equivalents (a MIG slice, an MPS percent and a time-sliced replica
//! count as the fraction `metering` computes, floored to a micro-GPU: [`gpu_micro`]), CPU
//! cores, GiB of memory — it sets a **guarantee** (always given when asked), a **ceiling**
//! (never exceeded, borrowed or not) and a **lending limit** (how much of its unused
//! guarantee others may borrow; default all), and a **grace period** between SIGTERM and
//! SIGKILL when its borrowed work is reclaimed (inherited; default 30 s).
//!
//! A grant counts against its tenant and every ancestor. Work within every guarantee on
//! its chain is [`Class::Guaranteed`]; work beyond one runs as [`Class::Borrowed`] on
//! capacity others do not use, and is what [`choose_victims`] stops when an owner asks for
//! its guarantee back. See [`admit`] for the rules, [`fair_order`] for the queue and
//! [`allocate`] for handing freed capacity to waiting requests.
//!
//! # The `quotas` section
//!
//! [`QuotaSpec`] is the policy's `quotas` section: tenant path →
//! quota; unknown fields and duplicate keys are refused.
//!
//! ```json
//! "quotas": {
//!   "acme":    {"gpus": {"H100-80GB": {"guarantee": 16, "ceiling": 16}}},
//!   "acme/ml": {"gpus": {"H100-80GB": {"guarantee": 4, "ceiling": 12, "lending_limit": 2}},
//!               "cpu_cores": {"guarantee": 64, "ceiling": 128},
//!               "memory_gib": {"ceiling": 1024},
//!               "grace_period_s": 60},
//!   "acme/ml/vision/alice": {"gpus": {"H100-80GB": {"ceiling": 2}}}
//! }
//! ```
//!
//! [`QuotaSpec::validate`] checks it against the tenant tree and the catalog and reports
//! the JSON path of what is wrong (`quotas.acme/ml.gpus.H100-80GB.ceiling`).
//!
//! ```
//! use quota::{admit, Class, Decision, QuotaSpec, Resources, Usage};
//!
//! let spec: QuotaSpec = serde_json::from_str(r#"{
//!     "acme/a": {"gpus": {"H100-80GB": {"guarantee": 4}}},
//!     "acme/b": {"gpus": {"H100-80GB": {"guarantee": 4, "ceiling": 12}}}
//! }"#)?;
//! let tree = spec.validate("quotas", |t| ["acme", "acme/a", "acme/b"].contains(&t))?;
//! let fleet = Resources::new().with_gpus("H100-80GB", 16);
//! let mut usage = Usage::new();
//! let four = Resources::new().with_gpus("H100-80GB", 4);
//! assert_eq!(admit(&tree, &fleet, &usage, "acme/b", &four),
//!            Decision::Admit { class: Class::Guaranteed, over: None });
//! usage.add("acme/b", Class::Guaranteed, &four);
//! let more = admit(&tree, &fleet, &usage, "acme/b", &four);
//! assert!(matches!(more, Decision::Admit { class: Class::Borrowed, .. }));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod admit;
mod amount;
pub mod books;
mod drf;
mod preempt;
mod reclaim;
mod shape;
mod spec;
pub mod wire;

#[cfg(test)]
mod proptests;
#[cfg(test)]
mod tests;

pub use admit::{admit, set_aside, withheld, CeilingRefusal, Class, Decision, Held, Usage};
pub use amount::{gpu_micro, Resource, Resources, MIB_PER_GIB, MICRO_PER_GPU, MILLI_PER_CORE};
pub use drf::{dominant_share, fair_order, guarantee_headroom, Waiting};
pub use preempt::{
    may_reclaim_owed_later, owed, owed_at_once, owed_behind, owed_in_order, worth_reclaiming,
};
pub use reclaim::{
    borrowing, borrowing_short, choose_victims, choose_victims_for_placement,
    choose_victims_to_consolidate, first_fit, victim_order, Candidate, Chosen, NoVictims,
    Protected, Room, Running, Victims,
};
pub use shape::{check_shape, layout, own_guarantee, ShapeFinding, ShapeKind, MAX_LAYOUT_STEPS};
pub use spec::{
    chain, is_within, Limit, Limits, Quota, QuotaEntry, QuotaSpec, QuotaTree, SpecError, UniqueMap,
    DEFAULT_GRACE_PERIOD_S, MAX_GRACE_PERIOD_S, MAX_MIN_RUNTIME_S, MAX_OWED_RECLAIM_AFTER_S,
    MAX_REQUEUE_BACKOFF_S, REQUEUE_BACKOFF_DOUBLINGS,
};

/// What [`allocate`] did with a queue.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allocation {
    /// Requests admitted (indices into the queue), in the order they were, with their class.
    pub admitted: Vec<(usize, Class)>,
    /// Requests within guarantee whose capacity is lent out: reclaim `short` for each.
    pub reclaim: Vec<(usize, Resources)>,
    /// Requests that would cross a ceiling: refused, not kept waiting.
    pub refused: Vec<(usize, CeilingRefusal)>,
}

/// Hands capacity to `waiting` requests in [`fair_order`], recomputed after each admission
/// (each one changes the shares), recording each admission in `usage`. A request that does
/// not fit is skipped and the next one tried; it ends when a pass admits nothing. Requests
/// not in the answer still wait.
pub fn allocate(
    tree: &QuotaTree,
    capacity: &Resources,
    usage: &mut Usage,
    waiting: &[Waiting],
) -> Allocation {
    let mut out = Allocation::default();
    let mut open: Vec<bool> = vec![true; waiting.len()];
    loop {
        let order = fair_order(tree, capacity, usage, waiting);
        let mut admitted = false;
        for i in order {
            if !open[i] {
                continue;
            }
            let w = &waiting[i];
            match admit(tree, capacity, usage, &w.tenant, &w.resources) {
                Decision::Admit { class, .. } => {
                    usage.add(&w.tenant, class, &w.resources);
                    out.admitted.push((i, class));
                    open[i] = false;
                    admitted = true;
                    break;
                }
                Decision::Reclaim { short, .. } => {
                    out.reclaim.push((i, short));
                    open[i] = false;
                }
                Decision::Refuse(r) => {
                    out.refused.push((i, r));
                    open[i] = false;
                }
                Decision::Wait { .. } => {}
            }
        }
        if !admitted {
            return out;
        }
    }
}
