//! Why "never admits fewer than first-fit on any trace" and "sometimes admits more" exclude
//! each other, and the trace that shows it for any two placements.
//!
//! # The claim
//!
//! Let `P` and `R` be placements of the replay ([`crate::replay`]): deterministic and online,
//! so each decision depends only on the arrivals and departures seen so far, never on a
//! request's duration; and let the queue's wait be bounded (drop, or a finite
//! `max_wait_s`). If on some trace `P` starts a different set of requests than `R`
//! at some instant, then there is a trace on which `P` admits **fewer** requests than `R`.
//! Taking `R` = first-fit: a placement that never admits fewer requests than first-fit on
//! any trace starts exactly what first-fit starts, when first-fit starts it, on every trace,
//! so it is never strictly better either. The same holds with the roles swapped (first-fit
//! loses to `best` somewhere). "At least as good on every trace of a family, strictly
//! better on most" is therefore a property of the family, never of a placement alone.
//!
//! The bound on the wait is needed: with a wait that never expires, every request that
//! fits an empty node is eventually started (the retries at the last departures find the
//! cluster empty), so two placements that can serve the same requests admit the same
//! number on every trace. In u64 seconds, [`punish`] needs
//! `t* + (rounds + 2) × (max_wait + 2)` to fit and answers
//! [`AdversaryError::TimesOverflow`] otherwise (a wait of `u64::MAX` always).
//!
//! # The construction ([`punish`])
//!
//! Let `t*` be the first instant at which the two start different sets of requests, `S_P`
//! and `S_R` the sets started at `t*`. Up to `t*` both saw the same arrivals and
//! departures and started the same requests (maybe on other GPUs), so a trace that agrees
//! with the original on every arrival up to `t*` and on every departure up to `t*` gets
//! the same decisions up to and at `t*`, whatever it does later. (Within an instant the
//! replay orders departures, arrivals, zero-length leaves, then expired waits, ties by row
//! index; dropping later rows keeps the kept rows' order. A duration is read only when
//! its request starts, so changing the duration of a request not started by `t*`
//! changes nothing up to `t*`.) The new trace:
//!
//! 1. drops every arrival after `t*`;
//! 2. makes every request that is still running after `t*` (in either replay) depart at
//!    `X = t* + max_wait + 1`, and every request that arrived by `t*` and started in
//!    neither replay by then depart no earlier than `X` should it start: until then
//!    nothing departs, so nothing starts, and every waiting request expires (drop:
//!    `max_wait` = 0). Now `P` has admitted `common + |S_P|` and `R` `common + |S_R|`;
//! 3. if `|S_P| < |S_R|`, that is the trace: `P` admits fewer. Otherwise one request `j`
//!    that `P` started at `t*` and `R` did not (there is one: the sets differ) is kept
//!    running long after `X` (the placement never knew its duration; one that lasts
//!    more than 0 s if any). If `j` lasted 0 s, its zero-length leave at `t*` no longer
//!    happens: `R` never started `j`, so its decisions are unchanged, and `P`'s decisions
//!    at `t*` before that leave are too, but the queue retries after it may differ, so
//!    `|S_P|` and `|S_R|` are counted on a replay of the cut trace (steps 1 and 2, `j`
//!    kept), never taken from the original. At `X`, `R`'s cluster is empty and `P`'s
//!    holds `j` on one node. Then come `k = |S_P| − |S_R| + 1` rounds of requests that
//!    fill every node of the empty cluster, each lasting longer than the queue's wait:
//!    one request per node for all 8 GPUs of a node, or, against `static` (which serves
//!    no whole GPU), every instance of its layout (a 3g, a 2g and two 1g per GPU: all 7
//!    compute slices). `R` admits every one; `P` cannot, because `j` holds part of one
//!    GPU (a MIG instance, whole GPUs, or a GPU in MPS or time-slicing mode), and every
//!    grant of a round's request takes at least its compute slices: one request of each
//!    round finds no room and is rejected (or expires waiting). `P` ends at least
//!    `k − (|S_P| − |S_R|) = 1` request behind.
//!
//! Tier-aware replays: the rounds' rows are named so that they map to one tenant that
//! makes step 3 hold: allowed whole GPUs or MIG where `R` packs whole-node rows, allowed
//! neither MPS nor time-slicing where `P` packs the layout's fractions (those could
//! share a GPU below their compute). Where the policy has no such tenant the
//! construction stops with [`AdversaryError::NoFlood`]; the claim is not shown there.
//!
//! [`punish`] builds that trace, replays it with both placements and returns it only when
//! `P` really admits fewer (an error otherwise), so every use checks the claim on the
//! replay itself.

use crate::pack::Allow;
use crate::replay::{self, Fractions, Mapped, Placement, Queue, ReplayConfig, ReplayError};
use crate::replay::{ReplayReport, Tenants, Trace, TraceRequest, GPUS_PER_NODE};
use slicer::catalog::COMPUTE_SLICES;
use slicer::layout::DeclaredLayout;

/// Why no punishing trace was returned.
#[derive(Debug, thiserror::Error)]
pub enum AdversaryError {
    #[error("replaying the trace: {0}")]
    Replay(#[from] ReplayError),
    /// The construction ran but its trace did not make the placement lose (a bug in the
    /// construction or a placement that is not online; never seen on the family).
    #[error(
        "the trace built against {ours} diverging from {rival} at {divergence_s} s did not \
         make it lose: {ours} admitted {ours_admitted}, {rival} {rival_admitted}"
    )]
    NotPunished {
        ours: Placement,
        rival: Placement,
        divergence_s: u64,
        ours_admitted: u64,
        rival_admitted: u64,
    },
    /// `ours` started at least as many requests as the rival at the divergence but none
    /// the rival did not: impossible where the two started different sets (a bug).
    #[error("at {divergence_s} s {ours} started no request the rival did not")]
    NothingHeld { ours: Placement, divergence_s: u64 },
    /// The punishing trace's times would pass `u64::MAX` (a divergence or a queue wait
    /// too close to it); the construction needs `divergence + (rounds + 2) × (max_wait +
    /// 2)` seconds to fit.
    #[error(
        "the trace diverging at {divergence_s} s with a {max_wait_s} s wait needs times \
         past u64::MAX"
    )]
    TimesOverflow { divergence_s: u64, max_wait_s: u64 },
    /// No flood round can be built for this pair (tier-aware: no tenant is allowed the
    /// rows; or the static layout does not resolve on the model).
    #[error("no flood round against {rival} for {ours}: {reason}")]
    NoFlood { ours: Placement, rival: Placement, reason: &'static str },
    /// No flood row name mapped to the flood's tenant in 100,000 tries.
    #[error("no flood row name maps to tenant {tenant}")]
    NoName { tenant: usize },
}

/// How the punishing trace makes `ours` lose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Case {
    /// At the divergence `ours` started fewer requests than the rival; the trace ends
    /// there.
    FewerStarted { ours: usize, rival: usize },
    /// `ours` started at least as many; request `held` (an index of the original trace)
    /// is kept running while `rounds` rounds that fill every node arrive.
    Flood { held: usize, rounds: u64 },
}

/// A trace on which `ours` admits fewer requests than `rival`.
#[derive(Debug, Clone)]
pub struct Punishment {
    pub trace: Trace,
    /// The first instant at which the two started different requests on the original.
    pub divergence_s: u64,
    pub case: Case,
    /// The replays of `trace`.
    pub ours: ReplayReport,
    pub rival: ReplayReport,
}

/// When each request of `trace` starts under `config` (None: never, or a CPU-only row).
pub fn starts(trace: &Trace, config: &ReplayConfig) -> Result<Vec<Option<u64>>, ReplayError> {
    let mut at = vec![None; trace.requests.len()];
    replay::replay_observed(trace, config, &mut |o| {
        for &i in o.started {
            at[i] = Some(o.time);
        }
    })?;
    Ok(at)
}

/// The first instant at which `a` and `b` start different sets of requests, or None
/// where they start the same requests at the same times.
pub fn first_divergence(a: &[Option<u64>], b: &[Option<u64>]) -> Option<u64> {
    a.iter()
        .zip(b)
        .filter(|(x, y)| x != y)
        .filter_map(|(x, y)| match (x, y) {
            (Some(x), Some(y)) => Some((*x).min(*y)),
            (Some(t), None) | (None, Some(t)) => Some(*t),
            (None, None) => None,
        })
        .min()
}

/// A trace built from `trace` on which `config.placement` admits fewer requests than
/// `rival` with the same nodes, fractions and queue (see the module documentation), or
/// None where the two start the same requests at the same times on `trace`.
pub fn punish(
    trace: &Trace,
    config: &ReplayConfig,
    rival: Placement,
) -> Result<Option<Punishment>, AdversaryError> {
    let ours = config.placement;
    let rival_config = ReplayConfig { placement: rival, ..config.clone() };
    let ours_at = starts(trace, config)?;
    let rival_at = starts(trace, &rival_config)?;
    let Some(t) = first_divergence(&ours_at, &rival_at) else { return Ok(None) };
    let max_wait = match config.queue {
        Queue::Drop => 0,
        Queue::Wait { max_wait_s } => max_wait_s,
    };
    let overflow = || AdversaryError::TimesOverflow { divergence_s: t, max_wait_s: max_wait };
    let x = t.checked_add(max_wait).and_then(|v| v.checked_add(1)).ok_or_else(overflow)?;
    let started_at_t = |at: &[Option<u64>]| at.iter().filter(|s| **s == Some(t)).count();
    // The request kept running: one only `ours` started at `t`, one that lasts if any.
    let held = if started_at_t(&ours_at) < started_at_t(&rival_at) {
        None
    } else {
        let only_ours: Vec<usize> = (0..trace.requests.len())
            .filter(|&i| ours_at[i] == Some(t) && rival_at[i] != Some(t))
            .collect();
        let lasts = |i: &usize| trace.requests[*i].departure > trace.requests[*i].arrival;
        let held = only_ours.iter().copied().find(lasts).or(only_ours.first().copied());
        Some(held.ok_or(AdversaryError::NothingHeld { ours, divergence_s: t })?)
    };

    // Up to `t`, as it was; then nothing starts until `x`, where everything departs but
    // the held request.
    let (mut requests, held_row) = truncated(trace, t, x, &ours_at, &rival_at, held);
    let cut = Trace {
        source: trace.source.clone(),
        requests: requests.clone(),
        synthetic_times: trace.synthetic_times,
    };
    let n_ours = started_at_t(&starts(&cut, config)?);
    let n_rival = started_at_t(&starts(&cut, &rival_config)?);
    let case = match held {
        Some(held) if n_ours >= n_rival => {
            Case::Flood { held, rounds: (n_ours - n_rival) as u64 + 1 }
        }
        _ => Case::FewerStarted { ours: n_ours, rival: n_rival },
    };

    if let (Case::Flood { rounds, .. }, Some(row)) = (&case, held_row) {
        // Rounds that fill every node, each outlasting the queue's wait, then the held
        // request departs.
        let round_len = max_wait.checked_add(1).ok_or_else(overflow)?;
        let flood_end = round_len
            .checked_add(1)
            .and_then(|gap| gap.checked_mul(*rounds))
            .and_then(|v| v.checked_add(x))
            .and_then(|v| v.checked_add(1))
            .ok_or_else(overflow)?;
        let held_end = flood_end.checked_add(round_len).ok_or_else(overflow)?;
        let r = &mut requests[row];
        r.departure = r.arrival + (held_end - t);
        let flood = Flood::against(config, rival)?;
        for k in 0..*rounds {
            let arrival = x + 1 + k * (round_len + 1);
            requests.extend(flood.round(k, arrival, arrival + round_len)?);
        }
    }
    let punishing = Trace {
        source: format!("{} (punishing {ours} against {rival})", trace.source),
        requests,
        synthetic_times: trace.synthetic_times,
    };
    let ours_report = replay::replay_with(&punishing, config)?;
    let theirs = replay::replay_with(&punishing, &rival_config)?;
    if ours_report.admitted >= theirs.admitted {
        return Err(AdversaryError::NotPunished {
            ours,
            rival,
            divergence_s: t,
            ours_admitted: ours_report.admitted,
            rival_admitted: theirs.admitted,
        });
    }
    Ok(Some(Punishment {
        trace: punishing,
        divergence_s: t,
        case,
        ours: ours_report,
        rival: theirs,
    }))
}

/// The rows of `trace` that arrive by `t`: every request started by `t` (in either
/// replay) and still running after it departs at `x`, every request started by neither
/// departs no earlier than `x` should it start, and `held` (started at `t` by `ours`)
/// departs at `x` for now. Also the row index of `held` in the result.
fn truncated(
    trace: &Trace,
    t: u64,
    x: u64,
    ours_at: &[Option<u64>],
    rival_at: &[Option<u64>],
    held: Option<usize>,
) -> (Vec<TraceRequest>, Option<usize>) {
    let mut requests = Vec::new();
    let mut held_row = None;
    for (i, r) in trace.requests.iter().enumerate() {
        if r.arrival > t {
            continue;
        }
        let mut r = r.clone();
        // Its start by `t` in whichever replay started it (both started it at the same
        // instant if before `t`); one started later is waiting at `t` and never starts.
        let start = [ours_at[i], rival_at[i]].into_iter().flatten().filter(|s| *s <= t).min();
        let d = r.departure - r.arrival;
        match start {
            _ if Some(i) == held => {
                held_row = Some(requests.len());
                r.departure = r.arrival + (x - t);
            }
            Some(s) if d > 0 && s.saturating_add(d) > t => r.departure = r.arrival + (x - s),
            Some(_) => {}
            // Its duration was never used by `t`: if it starts at `t` after all (a queue
            // retry that differs once `held` no longer leaves), it leaves at `x` or later.
            None => r.departure = x,
        }
        requests.push(r);
    }
    (requests, held_row)
}

/// The rows of one flood round: what fills every node of an empty cluster under the
/// rival, from a tenant that cannot make `ours` serve them in less than their compute.
struct Flood {
    /// Rows per node: (num_gpu, gpu_milli).
    per_node: Vec<(u32, u32)>,
    nodes: u32,
    /// The tenant every row must map to (tier-aware replays), and the tenants.
    tenant: Option<(usize, Tenants)>,
}

impl Flood {
    /// Whole nodes (8 GPUs each); against `static`, which serves no whole GPU, every
    /// instance of its layout (all 7 compute slices of every GPU).
    fn against(config: &ReplayConfig, rival: Placement) -> Result<Flood, AdversaryError> {
        let ours = config.placement;
        let no_flood = |reason: &'static str| AdversaryError::NoFlood { ours, rival, reason };
        let packs = |p: Placement| matches!(p, Placement::Best | Placement::FirstFit);
        let against_static = rival == Placement::Static;
        let per_node: Vec<(u32, u32)> = if against_static {
            let model = slicer::catalog::model(&config.model)
                .ok_or_else(|| no_flood("unknown GPU model"))?;
            let layout = DeclaredLayout::AllBalanced
                .resolve(model)
                .map_err(|_| no_flood("the static layout does not resolve"))?;
            let mut per_gpu = Vec::new();
            for (p, _) in layout {
                let milli = u32::from(p.compute_slices) * 1000 / u32::from(COMPUTE_SLICES);
                match replay::map_request(model, 1, milli) {
                    Mapped::Mig(q)
                        if q.compute_slices == p.compute_slices && q.memory_mib <= p.memory_mib =>
                    {
                        per_gpu.push((1, milli))
                    }
                    _ => return Err(no_flood("a static instance maps to no row")),
                }
            }
            (0..GPUS_PER_NODE).flat_map(|_| per_gpu.clone()).collect()
        } else {
            vec![(GPUS_PER_NODE, 1000)]
        };
        // The layout's fractions: MIG or whole GPUs only, never less than the profile's
        // compute slices. Whole nodes: allowed at all.
        let allowed = |a: &Allow| if against_static { !a.mps && !a.shared } else { a.gpu || a.mig };
        // Whole-node rows must be allowed where the rival packs; fraction rows must not
        // be shared or MPS where `ours` packs. Static and whole ignore tenants.
        let constrained = if against_static { packs(ours) } else { packs(rival) };
        let tenant = match &config.fractions {
            Fractions::Tiers(tenants) if constrained => {
                let i = tenants
                    .tenants
                    .iter()
                    .position(|st| allowed(&st.allow))
                    .ok_or_else(|| no_flood("no tenant is allowed the flood's rows"))?;
                Some((i, tenants.clone()))
            }
            _ => None,
        };
        Ok(Flood { per_node, nodes: config.nodes, tenant })
    }

    /// Round `k`'s rows, all arriving at `arrival` and departing at `departure`.
    fn round(
        &self,
        k: u64,
        arrival: u64,
        departure: u64,
    ) -> Result<Vec<TraceRequest>, AdversaryError> {
        let mut rows = Vec::new();
        for node in 0..self.nodes {
            for (n, &(num_gpu, gpu_milli)) in self.per_node.iter().enumerate() {
                let base = format!("adversary-round-{k}-node-{node}-{n}");
                let name = match &self.tenant {
                    None => base,
                    // The first salted name the tenant mapping gives the flood's tenant.
                    Some((want, tenants)) => (0..MAX_SALT)
                        .map(|salt| format!("{base}-{salt}"))
                        .find(|name| tenants.of(name) == Some(*want))
                        .ok_or(AdversaryError::NoName { tenant: *want })?,
                };
                rows.push(TraceRequest { name, num_gpu, gpu_milli, arrival, departure });
            }
        }
        Ok(rows)
    }
}

/// Names tried per flood row for the flood's tenant (each maps to it with probability
/// 1 / tenants).
const MAX_SALT: u32 = 100_000;
