//! Why "never admits fewer than first-fit on any trace" and "sometimes admits more" exclude
//! each other, and the trace that shows it for any two placements.
//!
//! # The claim
//!
//! Let `P` and `R` be placements of the replay ([`crate::replay`]): deterministic and online,
//! so each decision depends only on the arrivals and departures seen so far, never on a
//! request's duration. If on some trace `P` starts a different set of requests than `R`
//! at some instant, then there is a trace on which `P` admits **fewer** requests than `R`.
//! Taking `R` = first-fit: a placement that never admits fewer requests than first-fit on
//! any trace starts exactly what first-fit starts, when first-fit starts it, on every trace,
//! so it is never strictly better either. The same holds with the roles swapped (first-fit
//! loses to `best` somewhere). "At least as good on every trace of a family, strictly
//! better on most" is therefore a property of the family, never of a placement alone.
//!
//! # The construction ([`punish`])
//!
//! Let `t*` be the first instant at which the two start different sets of requests, `S_P`
//! and `S_R` the sets started at `t*`. Up to `t*` both saw the same arrivals and
//! departures and started the same requests (maybe on other GPUs), so a trace that agrees
//! with the original on every arrival up to `t*` and on every departure up to `t*` gets
//! the same decisions up to and at `t*`, whatever it does later. The new trace:
//!
//! 1. drops every arrival after `t*`;
//! 2. makes every request that is still running after `t*` (in either replay) depart at
//!    `X = t* + max_wait + 1`: until then nothing departs, so nothing starts, and every
//!    waiting request expires (drop: `max_wait` = 0). Now `P` has admitted
//!    `common + |S_P|` and `R` `common + |S_R|`;
//! 3. if `|S_P| < |S_R|`, that is the trace: `P` admits fewer. Otherwise one request `j`
//!    that `P` started and `R` did not is kept running long after `X` (the placement never
//!    knew its duration). At `X`, `R`'s cluster is empty and `P`'s holds `j` on one node.
//!    Then come `k = |S_P| − |S_R| + 1` rounds, each of one request per node for all 8 GPUs
//!    of a node, lasting longer than the queue's wait: `R` admits every one; `P` has room
//!    on every node but `j`'s (`j` holds part of one of its GPUs), so one request of each
//!    round finds no node and is rejected (or expires waiting). `P` ends
//!    `k − (|S_P| − |S_R|) = 1` request behind.
//!
//! [`punish`] builds that trace, replays it with both placements and returns it only when
//! `P` really admits fewer (an error otherwise), so every use checks the claim on the
//! replay itself.

use crate::replay::{self, Placement, Queue, ReplayConfig, ReplayError, ReplayReport, Trace};
use crate::replay::{TraceRequest, GPUS_PER_NODE};

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
    /// Every request `ours` started alone at the divergence lasts zero seconds, so none
    /// can be kept running; the construction does not cover that.
    #[error("at {divergence_s} s every request only {ours} started lasts 0 s")]
    NothingHeld { ours: Placement, divergence_s: u64 },
}

/// How the punishing trace makes `ours` lose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Case {
    /// At the divergence `ours` started fewer requests than the rival; the trace ends
    /// there.
    FewerStarted { ours: usize, rival: usize },
    /// `ours` started at least as many; request `held` (a trace index) is kept running
    /// while `rounds` rounds of whole-node requests arrive.
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
    let rival_config = ReplayConfig { placement: rival, ..config.clone() };
    let ours_at = starts(trace, config)?;
    let rival_at = starts(trace, &rival_config)?;
    let Some(t) = first_divergence(&ours_at, &rival_at) else { return Ok(None) };
    let max_wait = match config.queue {
        Queue::Drop => 0,
        Queue::Wait { max_wait_s } => max_wait_s,
    };
    let duration = |r: &TraceRequest| r.departure - r.arrival;
    let only_ours: Vec<usize> = (0..trace.requests.len())
        .filter(|&i| ours_at[i] == Some(t) && rival_at[i] != Some(t))
        .collect();
    let (n_ours, n_rival) = (
        ours_at.iter().filter(|s| **s == Some(t)).count(),
        rival_at.iter().filter(|s| **s == Some(t)).count(),
    );
    let x = t.saturating_add(max_wait).saturating_add(1);
    let case = if n_ours < n_rival {
        Case::FewerStarted { ours: n_ours, rival: n_rival }
    } else {
        let held = only_ours
            .iter()
            .copied()
            .find(|&i| duration(&trace.requests[i]) > 0)
            .ok_or(AdversaryError::NothingHeld { ours: config.placement, divergence_s: t })?;
        Case::Flood { held, rounds: (n_ours - n_rival) as u64 + 1 }
    };

    // Rounds of whole-node requests, each outlasting the queue's wait.
    let round_len = max_wait + 1;
    let (rounds, held) = match case {
        Case::Flood { held, rounds } => (rounds, Some(held)),
        Case::FewerStarted { .. } => (0, None),
    };
    let flood_end = x + 1 + rounds * (round_len + 1);
    let mut requests = Vec::new();
    for (i, r) in trace.requests.iter().enumerate() {
        if r.arrival > t {
            continue;
        }
        let mut r = r.clone();
        // Its start by `t` in whichever replay started it (both started it at the same
        // instant if before `t`); one started later is waiting at `t` and never starts.
        let start = [ours_at[i], rival_at[i]].into_iter().flatten().filter(|s| *s <= t).min();
        if let Some(s) = start {
            let d = duration(&r);
            if Some(i) == held {
                r.departure = r.arrival + (flood_end + max_wait + 1 - s);
            } else if d > 0 && s + d > t {
                r.departure = r.arrival + (x - s);
            }
        }
        requests.push(r);
    }
    for k in 0..rounds {
        let arrival = x + 1 + k * (round_len + 1);
        for node in 0..config.nodes {
            requests.push(TraceRequest {
                name: format!("adversary-round-{k}-node-{node}"),
                num_gpu: GPUS_PER_NODE,
                gpu_milli: 1000,
                arrival,
                departure: arrival + round_len,
            });
        }
    }
    let punishing = Trace {
        source: format!("{} (punishing {} against {rival})", trace.source, config.placement),
        requests,
        synthetic_times: trace.synthetic_times,
    };
    let ours = replay::replay_with(&punishing, config)?;
    let theirs = replay::replay_with(&punishing, &rival_config)?;
    if ours.admitted >= theirs.admitted {
        return Err(AdversaryError::NotPunished {
            ours: config.placement,
            rival,
            divergence_s: t,
            ours_admitted: ours.admitted,
            rival_admitted: theirs.admitted,
        });
    }
    Ok(Some(Punishment { trace: punishing, divergence_s: t, case, ours, rival: theirs }))
}
