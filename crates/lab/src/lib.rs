//! lab: Tessera's research on placement and quotas, built on the public decisions of the
//! production crates (`slicer`'s `choose`, `place`, inventory and catalog; `quota`'s
//! admission, fair queue and reclaim) and linked by no node or coordinator package
//! (`tests/deps.rs`). `tessera sim` runs it.
//!
//! - [`pack`](mod@pack): where a request goes on a node across whole GPUs, MIG, MPS and
//!   time-slicing at once, scored by expected fragmentation (FGD; pure, deterministic).
//! - [`replay`](mod@replay): replays a request trace (the Alibaba GPU trace) on simulated
//!   nodes with the real placement code, to compare placement strategies.
//! - [`tracegen`]: seeded synthetic traces of other request mixes (the replay's family).
//! - [`adversary`]: for any two placements whose starts differ on a trace (with a bounded
//!   wait), a trace on which the first admits fewer requests than the second (why no
//!   placement beats first-fit on every trace without being first-fit).
//! - [`quota_sim`]: the fleet under static partitions, one FIFO queue with backfill and
//!   Tessera's quotas side by side (`tessera sim --quota-modes`).
//! - [`quota_adversary`]: the trace on which no admission rule keeps both quota promises
//!   (owners served within a bound, 95% of FIFO's useful utilisation) on a fleet with no
//!   unguaranteed GPUs when work restarts from zero.
//! - [`quota_bound`]: the most useful GPU-seconds any scheduler that keeps the policy's GPU
//!   ceilings could reach on a list of jobs (fluid; the quota table's `ceiling bound`).
//! - [`quota_table`]: FIFO against quotas on every cell of a trace family, each judged
//!   against the quota promises (`tessera sim --quota-family`).
//! - [`contention_sim`]: latency services and bandwidth-heavy batch jobs on MPS GPUs through
//!   the contention model, without and with the interference controller
//!   (`tessera sim --scenario interference`).
//! - [`cli`]: `tessera sim` itself (the `tessera-sim` binary, which `tessera sim` runs).

pub mod adversary;
pub mod cli;
pub mod contention_sim;
pub mod pack;
pub mod quota_adversary;
pub mod quota_bound;
pub mod quota_jobs;
pub mod quota_sim;
pub mod quota_table;
pub mod replay;
pub mod tracegen;

pub use replay::{
    replay, replay_with, Fractions, Placement, Queue, ReplayConfig, ReplayReport, SimTenant,
    Tenants, Trace, MAPPING_DOC,
};

#[cfg(test)]
mod tests_adversary;
#[cfg(test)]
mod tests_adversary_attack;
#[cfg(test)]
mod tests_replay;
