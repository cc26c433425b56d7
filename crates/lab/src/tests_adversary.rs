//! The adversary's claim checked on the replay: wherever two placements start different
//! requests, a trace built from that one makes either lose to the other.

use crate::adversary::{first_divergence, punish, starts, AdversaryError, Case};
use crate::replay::{
    self, Fractions, Placement, Queue, ReplayConfig, Tenants, Trace, TraceRequest,
};
use crate::tracegen::{family, generate, Mix, DEFAULT_LOAD_GPUS};

fn config(nodes: u32, placement: Placement, tiers: bool, queue: Queue) -> ReplayConfig {
    ReplayConfig {
        nodes,
        model: "H100-80GB".into(),
        placement,
        fractions: if tiers { Fractions::Tiers(Tenants::example()) } else { Fractions::Mig },
        queue,
    }
}

fn row(name: &str, num_gpu: u32, gpu_milli: u32, arrival: u64, departure: u64) -> TraceRequest {
    TraceRequest { name: name.into(), num_gpu, gpu_milli, arrival, departure }
}

fn trace(requests: Vec<TraceRequest>) -> Trace {
    Trace { source: "hand-made".into(), requests, synthetic_times: false }
}

#[test]
fn first_divergence_is_the_earliest_instant_the_starts_differ() {
    assert_eq!(first_divergence(&[Some(1), None, Some(5)], &[Some(1), None, Some(5)]), None);
    // Request 2 starts at 7 in one and at 9 in the other; request 1 at 8 in one only.
    assert_eq!(first_divergence(&[Some(1), Some(8), Some(7)], &[Some(1), None, Some(9)]), Some(7));
    assert_eq!(first_divergence(&[None, Some(4)], &[Some(3), Some(4)]), Some(3));
}

#[test]
fn identical_placements_cannot_be_told_apart() {
    let t = generate(Mix::AlibabaLike, 200, 3, DEFAULT_LOAD_GPUS);
    for queue in [Queue::Drop, Queue::Wait { max_wait_s: 600 }] {
        let c = config(1, Placement::Best, true, queue);
        assert!(punish(&t, &c, Placement::Best).expect("replays").is_none());
    }
}

/// One GPU's worth of MIG on one node, hand-made: best and first-fit place a 1g request
/// differently, then a 4g request fits only beside best's choice, so best starts one
/// request more at that instant (and is ahead on the original trace); the adversary keeps that 4g running and sends a
/// whole-node request, which first-fit admits and best cannot.
#[test]
fn a_request_only_one_placement_started_is_kept_running_while_whole_nodes_arrive() {
    // Fill 7 of the 8 GPUs whole (they never leave), then a 1g (0.1 GPU) and a 4g (0.5).
    let mut rows: Vec<TraceRequest> =
        (0..7).map(|g| row(&format!("whole-{g}"), 1, 1000, 0, 1_000_000)).collect();
    // A 4g seen once (so best knows the demand), then the 1g: first-fit puts it at start
    // slot 0, where the 4g profile must start; best puts it beside.
    rows.push(row("half-seen", 1, 500, 1, 2));
    rows.push(row("small", 1, 100, 10, 1_000_000));
    rows.push(row("half", 1, 500, 20, 30));
    rows.push(row("small-2", 1, 100, 40, 50));
    let t = trace(rows);
    let at = |p| starts(&t, &config(1, p, false, Queue::Drop)).expect("replay");
    let (b, f) = (at(Placement::Best), at(Placement::FirstFit));
    let d = first_divergence(&b, &f).expect("best and first-fit start different requests here");
    let original =
        |p| replay::replay_with(&t, &config(1, p, false, Queue::Drop)).expect("replay").admitted;
    assert!(original(Placement::Best) > original(Placement::FirstFit));
    let p = punish(&t, &config(1, Placement::Best, false, Queue::Drop), Placement::FirstFit)
        .expect("replays")
        .expect("they diverge");
    assert_eq!(p.divergence_s, d);
    assert_eq!(d, 20, "the 4g's arrival");
    assert_eq!(p.case, Case::Flood { held: 9, rounds: 2 });
    assert!(p.ours.admitted < p.rival.admitted, "{} >= {}", p.ours.admitted, p.rival.admitted);
    // The trace keeps every arrival up to the divergence, as it was, and no later one
    // from the original.
    for (i, r) in t.requests.iter().enumerate().filter(|(_, r)| r.arrival <= d) {
        assert_eq!(p.trace.requests[i].arrival, r.arrival, "row {i}");
        assert_eq!(p.trace.requests[i].name, r.name, "row {i}");
    }
    assert!(p.trace.requests.iter().all(|r| r.arrival <= d || r.name.starts_with("adversary-")));
}

/// The claim over the small family (400 requests per mix, the CI family): in every cell
/// where best and first-fit start different requests, there is a trace on which best
/// admits fewer requests than first-fit *and* one on which first-fit admits fewer than
/// best; every such trace agrees with the cell's trace on every start up to the
/// divergence (the decisions the placements made before they differed are kept).
#[test]
fn wherever_best_and_first_fit_differ_each_loses_to_the_other_on_some_trace() {
    let family = family(None, 400, 11).expect("generated traces only");
    let (mut differing, mut fewer, mut flood) = (0, 0, 0);
    for t in &family {
        for nodes in [1u32, 2, 4, 8] {
            for tiers in [false, true] {
                for queue in [Queue::Drop, Queue::Wait { max_wait_s: 3600 }] {
                    let cell = format!("{} {nodes} nodes tiers={tiers} {queue:?}", t.source);
                    for (ours, rival) in [
                        (Placement::Best, Placement::FirstFit),
                        (Placement::FirstFit, Placement::Best),
                    ] {
                        let c = config(nodes, ours, tiers, queue);
                        let Some(p) =
                            punish(t, &c, rival).unwrap_or_else(|e| panic!("{cell}: {e}"))
                        else {
                            continue;
                        };
                        differing += 1;
                        assert!(
                            p.ours.admitted < p.rival.admitted,
                            "{cell}: {ours} {} >= {rival} {}",
                            p.ours.admitted,
                            p.rival.admitted
                        );
                        match p.case {
                            Case::FewerStarted { .. } => fewer += 1,
                            Case::Flood { .. } => flood += 1,
                        }
                        // The decisions up to the divergence are the original's.
                        let before = starts(t, &c).expect("replay");
                        let after = starts(&p.trace, &c).expect("replay");
                        for (i, s) in before.iter().enumerate() {
                            if s.is_some_and(|s| s <= p.divergence_s) {
                                assert_eq!(after[i], *s, "{cell}: row {i}");
                            }
                        }
                    }
                }
            }
        }
    }
    println!("{differing} (cell, direction) pairs differ: {fewer} fewer-started, {flood} flood");
    // Both directions of every differing cell were punished (a cell where best and
    // first-fit start the same requests at the same times counts in neither).
    assert_eq!(differing % 2, 0);
    assert!(differing >= 100, "only {differing} differing pairs: the family lost its spread");
    assert!(fewer > 0 && flood > 0, "fewer {fewer}, flood {flood}: both cases exercised");
}

#[test]
fn a_replay_error_is_reported_not_hidden() {
    let t = trace(vec![row("a", 1, 1000, 0, 10)]);
    let mut c = config(1, Placement::Best, false, Queue::Drop);
    c.model = "no-such-gpu".into();
    assert!(matches!(
        punish(&t, &c, Placement::FirstFit),
        Err(AdversaryError::Replay(replay::ReplayError::UnknownModel { .. }))
    ));
}

#[test]
fn a_trace_too_long_for_the_capacity_counter_saturates_it() {
    // 4e17 s × 56 compute slices passes u64::MAX: the capacity saturates, never panics.
    let t = trace(vec![row("long", 1, 1000, 0, 400_000_000_000_000_000)]);
    let r =
        replay::replay_with(&t, &config(1, Placement::Best, false, Queue::Drop)).expect("replay");
    assert_eq!(r.admitted, 1);
    assert_eq!(r.slice_seconds_capacity, u64::MAX);
}
