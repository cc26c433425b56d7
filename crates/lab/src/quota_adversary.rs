//! Why "serve every request within its guarantee in W seconds" and "keep 95% of FIFO's
//! useful utilisation" exclude each other on a fleet with no unguaranteed GPUs, and on a
//! small one with room to spare when borrowed work needs whole nodes, for *any* admission
//! rule, when work restarts from zero after a preemption.
//!
//! # The claim
//!
//! Take a fleet whose GPUs are all guaranteed to one owner `O` (the [`quota::check_shape`]
//! warning `no_headroom`) and a borrower `B` with no guarantee. Let `W` be the owner-wait
//! bound, met at p99 over *every* request of `O` (at most 1 in 100 of them waits longer;
//! not the simulator's owner p99, which counts only requests within guarantee on arrival,
//! so that one left waiting hides its tenant's later ones: a rule can keep that p99 and
//! far more than the bound, [`tests`]). [`trace`] makes:
//!
//! - `b`: one job of `B` asking the whole fleet at t = 0, lasting `D` seconds;
//! - `o_1 … o_k`: jobs of `O`, each the whole fleet for `δ` seconds, arriving every `P`
//!   seconds from `P` on (`P > W + δ`), while `kP + δ < D`.
//!
//! Each `o_i` is within `O`'s guarantee and needs every GPU, so a rule that starts it within
//! `W` has stopped `b` by `a_i + W`. With at most `⌊k/100⌋` of them late, any one run of `b`
//! spans at most `⌊k/100⌋ + 1` periods plus `W`: it is shorter than `D` once
//! `D > (k/100 + 1)·P + W`, so `b` never finishes, and every run of it but the last is
//! lost (it restarts from zero). Until the horizon (`D`, the trace's end) such a rule's
//! useful GPU-seconds are at most the owners' `k·δ` plus `b`'s last run, so its useful
//! utilisation is at most `δ/P + (k/100 + 1)·P/D + W/D` — about 3.2% for the defaults —
//! whatever it does: lend at once, lend later, never lend (then `b` never runs at all), or
//! know the future. FIFO runs `b` from 0 to `D` (the owners wait behind it): 100%.
//!
//! The proof needs `b` larger than the GPUs nobody guarantees (a fleet with none, the
//! validator's `no_headroom`, is one case): where `b` fits in unguaranteed GPUs, quotas
//! place borrowed work there first and lose nothing; where its tenant's ceiling lets it ask
//! more than those, the same trace traps it on a fleet the validator says nothing about
//! ([`tests`]). It needs restart from zero: `b` checkpointing keeps each run's work. So the
//! two promises conflict where the validator says `no_headroom` and work does not
//! checkpoint — the 2-node cells of `--quota-family` at 0% checkpointing — and also
//! wherever a ceiling lets borrowed work outgrow the unguaranteed GPUs; docs/PERFORMANCE.md,
//! Quotas that pay for themselves.
//!
//! # A narrow owner and borrowed work a node wide
//!
//! Headroom does not end the conflict when borrowed work needs whole nodes. Take `N` nodes
//! of `G` GPUs, an owner `O` with at least one GPU of its guarantee unused, and tenants whose
//! quotas admit `N` jobs of one whole node each at once, at least one of them borrowed (on
//! `examples/quota-sim.json` at 4 nodes: training's 8 within its guarantee, a second 8 of
//! training's, explore's 8 and research's 8, all borrowed). [`narrow_owner_trace`] makes:
//!
//! - `w_1 … w_N`: the node-wide jobs, all at t = 0, each lasting `D` ([`borrower_s`]: the
//!   trace's end);
//! - `o_1 … o_k`: one GPU of `O` for `δ` seconds, arriving every `P` seconds from `P` on.
//!
//! A rule that starts `o_i` within `W` has it on one GPU of some node from `s_i ≤ a_i + W`
//! for `δ`; no node-wide job runs on that node meanwhile, so whatever ran there was stopped
//! and loses its run (restart from zero). Every run lasts `D`, so a run still going at the
//! horizon on node `j` began after `e_j`, the start of the last owner on that node before
//! the horizon (0 where none is), and a run that does not is lost: the node-wide work kept
//! is at most `G·Σ_j (D − e_j)`. At most `⌊k/100⌋` owners are late, so one started on time
//! has an index of at least `m = k − ⌊k/100⌋`: its node's `e_j ≥ m·P` (and `m·P + W + δ <
//! D`), every other node keeps at most `G·D`, and with the owners' own `k·δ`
//! GPU-seconds any such rule keeps at most `(G·((N−1)·D + D − m·P) + k·δ) / (N·G·D)` of the
//! fleet ([`narrow_owner_bound`]): about `(N−1)/N`, 75.4% at 4 nodes with the defaults,
//! whichever node it sends the owners to and whatever it lends. FIFO runs every `w_j` from 0
//! to `D` (the owners wait): 100%. A fleet of `N` nodes keeps at most about `(N−1)/N` of
//! FIFO's useful work on such a trace, so below 20 nodes the two promises conflict without
//! any shortage of headroom: one node's worth must stay ready for owners whose requests are
//! a GPU wide. (Checkpointing work keeps its runs, and with no node-wide borrowed work the
//! owners find a GPU without stopping a node.)
//!
//! # Fractions that take more devices than their guarantee counts
//!
//! The owner bound has a second limit, on a fleet with no headroom, that no preemption
//! rule reaches: guarantees count GPU amounts, but a fraction of a GPU takes a device's room
//! that no other fraction may fill. On 2 nodes of 8, with `A` and `B` each guaranteed 8, `A`
//! running thirteen pods of 0.6 GPU (7.8 GPUs, within its guarantee) holds thirteen devices:
//! two of them do not fit one. Three devices are left, so `B`'s fourth request of one whole
//! GPU, within its guarantee (it holds 3 of 8), fits nowhere until one of `A`'s pods ends,
//! under any rule that keeps `A`'s guarantee (its pods are never stopped) and any placement
//! (each pod is on a device of its own whatever the layout). The simulator counts that time
//! as *blocked* (fitted on no node with every borrowed unit stopped) and reports the owner
//! p99 with and without it; the 2-node cells of `--quota-family` whose owner p99 is over
//! 300 s (small-shares, uniform: fractions) are over only by blocked time
//! (`…fractions_of_a_guarantee_can_hold_more_devices_than_it_counts`).

use quota::{Resources, MICRO_PER_GPU};

use crate::quota_sim::{Fleet, Job};

/// The adversary's knobs ([`trace`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Knobs {
    /// The owner-wait bound `W` the rule keeps (s).
    pub wait_s: u64,
    /// The period `P` of the owner's requests (s); more than `wait_s + owner_s`.
    pub period_s: u64,
    /// `δ`: how long each owner request runs (s).
    pub owner_s: u64,
    /// Owner requests `k`.
    pub rounds: u64,
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs { wait_s: 300, period_s: 3_600, owner_s: 60, rounds: 200 }
    }
}

/// `b`'s duration `D` for `k`: long enough that no run of it within the bound finishes
/// (`D > (k/100 + 1)·P + W`) and that every owner request ends before it (`kP + δ < D`).
pub fn borrower_s(k: &Knobs) -> u64 {
    let late = k.rounds / 100;
    let longest_run = (late + 1) * k.period_s + k.wait_s;
    (k.rounds * k.period_s + k.owner_s).max(longest_run) + k.period_s
}

/// The upper bound on any rule's useful utilisation that keeps the owner-wait bound at
/// p99 on [`trace`]: `(k·δ + longest run of b) / D`, in [0, 1].
pub fn bound(k: &Knobs) -> f64 {
    let d = borrower_s(k) as f64;
    let longest_run = ((k.rounds / 100 + 1) * k.period_s + k.wait_s) as f64;
    ((k.rounds * k.owner_s) as f64 + longest_run) / d
}

/// The jobs: `b` of `borrower`, then the owner's `o_i` of `owner`, each asking all of
/// `fleet`'s GPUs (one gang per node).
pub fn trace(k: &Knobs, fleet: &Fleet, owner: &str, borrower: &str) -> Vec<Job> {
    let node = u64::from(fleet.gpus_per_node) * MICRO_PER_GPU;
    let whole = |id: String, tenant: &str, at: u64, dur: u64, gang: String| -> Vec<Job> {
        (0..fleet.nodes)
            .map(|n| Job {
                gang: (fleet.nodes > 1).then(|| gang.clone()),
                ..gpu_job(&fleet.model, format!("{id}-n{n}"), tenant, (at, dur), node)
            })
            .collect()
    };
    let mut jobs = whole("b".into(), borrower, 0, borrower_s(k), "b".into());
    for i in 1..=k.rounds {
        jobs.extend(whole(format!("o{i}"), owner, i * k.period_s, k.owner_s, format!("o{i}")));
    }
    jobs
}

/// [`narrow_owner_trace`]'s bound on any rule that keeps the owner-wait bound at p99 over
/// every owner request: `(G·((N−1)·D + D − m·P) + k·δ) / (N·G·D)` with `m = k − ⌊k/100⌋`
/// (module documentation), in [0, 1].
pub fn narrow_owner_bound(k: &Knobs, fleet: &Fleet) -> f64 {
    let d = borrower_s(k) as f64;
    let n = f64::from(fleet.nodes);
    let g = f64::from(fleet.gpus_per_node);
    let on_time = (k.rounds - k.rounds / 100) * k.period_s;
    let kept = g * ((n - 1.0) * d + (d - on_time as f64)) + (k.rounds * k.owner_s) as f64;
    (kept / (n * g * d)).clamp(0.0, 1.0)
}

/// The jobs: one node-wide job `w{j}` of `wide[j]` per node at t = 0 lasting
/// [`borrower_s`], then the owner's `o{i}`, one GPU each for `owner_s`, every `period_s`.
pub fn narrow_owner_trace(k: &Knobs, fleet: &Fleet, owner: &str, wide: &[&str]) -> Vec<Job> {
    let whole = u64::from(fleet.gpus_per_node) * MICRO_PER_GPU;
    let model = &fleet.model;
    let mut jobs: Vec<Job> = wide
        .iter()
        .enumerate()
        .map(|(j, tenant)| gpu_job(model, format!("w{j}"), tenant, (0, borrower_s(k)), whole))
        .collect();
    for i in 1..=k.rounds {
        let when = (i * k.period_s, k.owner_s);
        jobs.push(gpu_job(model, format!("o{i}"), owner, when, MICRO_PER_GPU));
    }
    jobs
}

/// One job of `micro` micro-GPUs of `model`, not in a gang, not checkpointing, over
/// `(arrival, duration)` seconds.
fn gpu_job(model: &str, id: String, tenant: &str, (at, dur): (u64, u64), micro: u64) -> Job {
    Job {
        id,
        tenant: tenant.to_string(),
        arrival_s: at,
        duration_s: dur,
        resources: Resources::new().with(quota::Resource::gpu(model), micro),
        gang: None,
        checkpoints: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota_sim::{run, Mode};
    use quota::{check_shape, QuotaSpec, QuotaTree, ShapeKind};

    fn tree(json: &str) -> QuotaTree {
        let spec: QuotaSpec = serde_json::from_str(json).expect("spec");
        spec.validate("quotas", |_| true).expect("valid")
    }

    /// The owner guarantees one node's 8 GPUs; the borrower has none (ceiling 8).
    fn owner_and_borrower() -> QuotaTree {
        tree(
            r#"{"acme/owner":    {"gpus": {"H100-80GB": {"guarantee": 8}}},
                "acme/borrower": {"gpus": {"H100-80GB": {"ceiling": 8}}}}"#,
        )
    }

    fn fleet(nodes: u32) -> Fleet {
        Fleet {
            nodes,
            gpus_per_node: 8,
            model: "H100-80GB".into(),
            cpu_milli_per_node: None,
            memory_mib_per_node: None,
        }
    }

    #[test]
    fn the_bound_is_below_95_percent_and_the_durations_keep_their_promises() {
        let k = Knobs::default();
        let d = borrower_s(&k);
        assert!(d > (k.rounds / 100 + 1) * k.period_s + k.wait_s);
        assert!(d > k.rounds * k.period_s + k.owner_s);
        assert!(k.period_s > k.wait_s + k.owner_s);
        let b = bound(&k);
        assert!(b < 0.05, "bound {b}");
    }

    /// On a fully guaranteed fleet Tessera's quotas keep the owner bound (every owner is
    /// served within b's grace period) and so, as the claim says, lose b's every run: useful
    /// utilisation under the bound, while FIFO gets all of it.
    #[test]
    fn on_a_fully_guaranteed_fleet_keeping_the_owner_bound_costs_all_borrowed_work() {
        let t = owner_and_borrower();
        let f = fleet(1);
        let nodes = vec![Resources::new().with_gpus("H100-80GB", 8)];
        let shape = check_shape(&t, &nodes);
        assert!(
            shape.iter().any(|s| matches!(s.kind, ShapeKind::NoHeadroom { .. })),
            "the validator warns: {shape:?}"
        );
        let k = Knobs::default();
        let jobs = trace(&k, &f, "acme/owner", "acme/borrower");
        let quotas = run(&jobs, &f, &t, Mode::Quotas, None).expect("quotas");
        let fifo = run(&jobs, &f, &t, Mode::Fifo, None).expect("fifo");
        // Quotas keep the owner bound...
        // (over every owner request: the simulator's p99 counts all k only because none
        // is left waiting when the next arrives)
        let p99 = quotas.owner_wait_p99_s.expect("owners");
        assert!(p99 <= k.wait_s, "owner p99 {p99}");
        assert_eq!(quotas.owner_requests, k.rounds);
        // ...so b is preempted once per owner request and never finishes...
        let b = quotas.outcomes.iter().find(|o| o.id == "b-n0").expect("b");
        assert_eq!(u64::from(b.preempted), k.rounds);
        // ...and useful utilisation is within the bound any such rule meets, far below
        // FIFO's, which ran b whole and kept the owners waiting.
        assert!(
            quotas.useful_utilisation <= bound(&k) + 1e-9,
            "quotas {} bound {}",
            quotas.useful_utilisation,
            bound(&k)
        );
        assert!(fifo.useful_utilisation > 0.99, "fifo {}", fifo.useful_utilisation);
        assert!(fifo.owner_wait_p99_s.expect("owners") > k.wait_s);
        assert!(quotas.useful_utilisation < 0.95 * fifo.useful_utilisation);
        // Static partitions never lend: b is refused (no partition of its own), owners
        // served at once, the same shortfall from the other side.
        let stat = run(&jobs, &f, &t, Mode::Static, None).expect("static");
        assert!(stat.useful_utilisation <= bound(&k) + 1e-9, "static {}", stat.useful_utilisation);
    }

    /// The same trace on a fleet with an unguaranteed node for b: quotas lend that node
    /// first, reclaim nothing and keep FIFO's useful utilisation and the owner bound.
    #[test]
    fn with_unguaranteed_gpus_for_the_borrower_nothing_is_lost() {
        let t = owner_and_borrower();
        let f = fleet(2);
        let node = Resources::new().with_gpus("H100-80GB", 8);
        assert_eq!(check_shape(&t, &[node.clone(), node]), []);
        let k = Knobs::default();
        // One node's worth per job: trace() on a 1-node fleet, run on 2 nodes.
        let jobs = trace(&k, &fleet(1), "acme/owner", "acme/borrower");
        let quotas = run(&jobs, &f, &t, Mode::Quotas, None).expect("quotas");
        let fifo = run(&jobs, &f, &t, Mode::Fifo, None).expect("fifo");
        assert_eq!(quotas.preemptions, 0);
        assert!(quotas.useful_utilisation >= 0.95 * fifo.useful_utilisation);
        assert!(quotas.owner_wait_p99_s.expect("owners") <= k.wait_s);
    }

    /// What the proof needs is a borrowed job larger than the GPUs nobody guarantees, not a
    /// fleet with none: on 2 nodes with one guaranteed, the validator sees headroom and
    /// says nothing, yet a borrower asking both nodes (its ceiling lets it) is stopped by
    /// every owner request as on the fully guaranteed fleet, and keeps no more.
    #[test]
    fn a_borrowed_job_larger_than_the_headroom_is_the_same_trap() {
        let t = tree(
            r#"{"acme/owner":    {"gpus": {"H100-80GB": {"guarantee": 8}}},
                "acme/borrower": {"gpus": {"H100-80GB": {"ceiling": 16}}}}"#,
        );
        let node = Resources::new().with_gpus("H100-80GB", 8);
        assert_eq!(check_shape(&t, &[node.clone(), node]), []);
        let k = Knobs::default();
        // b asks both nodes (a gang); each owner request one node, its guarantee.
        let mut jobs: Vec<Job> = trace(&k, &fleet(2), "acme/owner", "acme/borrower")
            .into_iter()
            .filter(|j| j.id.starts_with('b'))
            .collect();
        jobs.extend(
            trace(&k, &fleet(1), "acme/owner", "acme/borrower")
                .into_iter()
                .filter(|j| j.id.starts_with('o')),
        );
        let quotas = run(&jobs, &fleet(2), &t, Mode::Quotas, None).expect("quotas");
        let fifo = run(&jobs, &fleet(2), &t, Mode::Fifo, None).expect("fifo");
        assert_eq!(quotas.owner_requests, k.rounds);
        assert!(quotas.owner_wait_p99_s.expect("owners") <= k.wait_s);
        let b = quotas.outcomes.iter().find(|o| o.id == "b#0").expect("b");
        assert_eq!(u64::from(b.preempted), k.rounds);
        assert!(quotas.useful_utilisation <= bound(&k) + 1e-9, "{}", quotas.useful_utilisation);
        assert!(fifo.useful_utilisation > 0.99, "fifo {}", fifo.useful_utilisation);
    }

    /// The claim's p99 is over *all* of the owner's `k` requests. The simulator's owner
    /// p99 counts a request only if it was within its tenant's guarantee when it arrived,
    /// so one owner request left waiting hides every later one of its tenant. A rule that
    /// holds `b` until the 99th owner request has run, then runs it and leaves the 100th
    /// waiting, keeps the simulator's owner p99 at 0 s while 101 of 200 owner requests
    /// wait for hours, at 16 times [`bound`]; with 2,000 rounds, above 95% of FIFO. The
    /// schedule is FIFO's on the trace with `b` arriving after `o_99` (a 1-second job of
    /// the borrower at 0 keeps the span). So the claim, and the test of Tessera's quotas
    /// above, need every owner request counted (`owner_requests == k`).
    #[test]
    fn the_bound_holds_for_the_p99_over_every_owner_request_not_the_simulators() {
        let t = owner_and_borrower();
        let f = fleet(1);
        let held_b = |k: &Knobs| {
            let d = borrower_s(k);
            let mut jobs = trace(k, &f, "acme/owner", "acme/borrower");
            let b = jobs.iter_mut().find(|j| j.id == "b-n0").expect("b");
            b.arrival_s = 99 * k.period_s + k.owner_s + 1;
            let mut start = b.clone();
            start.id = "start".into();
            start.arrival_s = 0;
            start.duration_s = 1;
            jobs.push(start);
            run(&jobs, &f, &t, Mode::Fifo, Some(d)).expect("fifo")
        };
        let k = Knobs::default();
        let r = held_b(&k);
        // The simulator's owner p99 is kept...
        assert_eq!(r.owner_wait_p99_s, Some(0));
        // ...because it counts 100 of the 200 owner requests (o_101.. arrive while o_100
        // waits), one of them late: the p99 over all 200 is hours.
        assert_eq!(r.owner_requests, 100);
        let late = r.outcomes.iter().filter(|o| o.id.starts_with('o')).filter(|o| {
            let at = o.id[1..].trim_end_matches("-n0").parse::<u64>().expect("round") * k.period_s;
            o.first_start_s.unwrap_or(borrower_s(&k)) - at > k.wait_s
        });
        assert_eq!(late.count(), 101);
        assert!(r.useful_utilisation > 16.0 * bound(&k), "{}", r.useful_utilisation);
        // With more rounds the same schedule keeps both promises as the simulator
        // measures them.
        let long = Knobs { rounds: 2_000, ..k };
        let r = held_b(&long);
        assert_eq!(r.owner_wait_p99_s, Some(0));
        assert!(r.useful_utilisation >= 0.95, "{}", r.useful_utilisation);
    }

    /// The narrow owner (module documentation) on the example policy at 4 nodes, the
    /// fleet of the 4-node cells of `--quota-family`: the validator finds nothing to say,
    /// and still Tessera's quotas, keeping the owner bound over every owner request, keep
    /// no more than [`narrow_owner_bound`] (about 3/4) of a fleet FIFO keeps whole. The
    /// owners land where the youngest borrowed job runs, so one node's job is stopped once
    /// per owner and never finishes; the other three run to the end.
    #[test]
    fn on_four_nodes_with_headroom_a_one_gpu_owner_stops_a_node_wide_borrowed_job() {
        let text = include_str!("../../../examples/quota-sim.json");
        let policy = policy::Policy::parse(text.as_bytes(), "examples/quota-sim.json")
            .expect("the example policy");
        let t = policy.quotas();
        let f = fleet(4);
        let nodes = vec![Resources::new().with_gpus("H100-80GB", 8); 4];
        assert_eq!(check_shape(t, &nodes), [], "the validator sees headroom: 16 of 32");
        let k = Knobs::default();
        let wide = ["acme/training", "acme/training", "acme/explore", "acme/research"];
        let jobs = narrow_owner_trace(&k, &f, "acme/inference", &wide);
        let quotas = run(&jobs, &f, t, Mode::Quotas, None).expect("quotas");
        let fifo = run(&jobs, &f, t, Mode::Fifo, None).expect("fifo");
        let bound = narrow_owner_bound(&k, &f);
        assert!((0.75..0.76).contains(&bound), "bound {bound}");
        // Every owner request counted, and training's first node (within its guarantee).
        assert_eq!(quotas.owner_requests, k.rounds + 1);
        let p99 = quotas.owner_wait_p99_s.expect("owners");
        assert!(p99 <= k.wait_s, "owner p99 {p99}");
        assert!(
            quotas.useful_utilisation <= bound + 1e-9,
            "quotas {} bound {bound}",
            quotas.useful_utilisation
        );
        let stopped: Vec<(&str, u32)> = quotas
            .outcomes
            .iter()
            .filter(|o| o.preempted > 0)
            .map(|o| (o.id.as_str(), o.preempted))
            .collect();
        // Training's second node, the youngest borrowed job after each restart.
        let rounds = u32::try_from(k.rounds).expect("rounds");
        assert_eq!(stopped, [("w1", rounds)], "one node's job takes every owner");
        assert!(fifo.useful_utilisation > 0.99, "fifo {}", fifo.useful_utilisation);
        assert!(quotas.useful_utilisation < 0.95 * fifo.useful_utilisation);
    }

    /// The fractions (module documentation): B's requests past the three free devices wait
    /// for A's guaranteed pods to end, under quotas and under FIFO alike, and the simulator
    /// counts all of that wait as blocked.
    #[test]
    fn fractions_of_a_guarantee_can_hold_more_devices_than_it_counts() {
        let t = tree(
            r#"{"acme/a": {"gpus": {"H100-80GB": {"guarantee": 8}}},
                "acme/b": {"gpus": {"H100-80GB": {"guarantee": 8}}}}"#,
        );
        let f = fleet(2);
        let nodes = vec![Resources::new().with_gpus("H100-80GB", 8); 2];
        let shape = check_shape(&t, &nodes);
        assert!(shape.iter().any(|s| matches!(s.kind, ShapeKind::NoHeadroom { .. })), "{shape:?}");
        let job = |id: String, tenant: &str, at: u64, dur: u64, micro: u64| {
            gpu_job("H100-80GB", id, tenant, (at, dur), micro)
        };
        let day = 86_400;
        let mut jobs: Vec<Job> =
            (0..13).map(|i| job(format!("a{i}"), "acme/a", 0, day, 600_000)).collect();
        // B asks 8 whole GPUs, one an hour: the first three find the free devices.
        jobs.extend((0..8).map(|i| job(format!("b{i}"), "acme/b", 60 + i * 3_600, day, 1_000_000)));
        for mode in [Mode::Quotas, Mode::Fifo] {
            let r = run(&jobs, &f, &t, mode, None).expect("runs");
            let waited: Vec<(&str, u64)> = r
                .outcomes
                .iter()
                .filter(|o| o.id.starts_with('b'))
                .map(|o| (o.id.as_str(), o.first_start_s.unwrap_or(u64::MAX)))
                .collect();
            for (id, start) in &waited[3..] {
                assert!(*start >= day, "{mode:?}: {id} started at {start}, before A's pods ended");
            }
            if mode == Mode::Quotas {
                // All 13 + 8 are within guarantee; 5 of B's wait a day less their arrival.
                assert_eq!(r.owner_requests, 21);
                assert!(r.owner_wait_p99_s.expect("owners") > 300, "{r:?}");
                assert_eq!(r.owners_blocked, 5);
                assert_eq!(r.owner_wait_unblocked_p99_s, Some(0));
            }
        }
    }
}
