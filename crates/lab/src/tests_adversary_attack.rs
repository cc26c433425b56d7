//! Attempts to break the adversary: every ordered pair of placements, both fraction
//! modes, drop and queue, and hand-made traces at the edges of the replay (zero-length
//! rows, equal times, huge times, CPU-only rows, policy-refused rows).

use crate::adversary::{punish, AdversaryError, Case};
use crate::pack::{Allow, Rules};
use crate::replay::{
    self, Fractions, Placement, Queue, ReplayConfig, SimTenant, Tenants, Trace, TraceRequest,
};
use crate::tracegen::{generate, Mix, DEFAULT_LOAD_GPUS};

fn config(nodes: u32, placement: Placement, tiers: bool, queue: Queue) -> ReplayConfig {
    let fractions = if tiers { Fractions::Tiers(Tenants::example()) } else { Fractions::Mig };
    with_fractions(nodes, placement, fractions, queue)
}

fn with_fractions(
    nodes: u32,
    placement: Placement,
    fractions: Fractions,
    queue: Queue,
) -> ReplayConfig {
    ReplayConfig { nodes, model: "H100-80GB".into(), placement, fractions, queue }
}

fn row(name: &str, num_gpu: u32, gpu_milli: u32, arrival: u64, departure: u64) -> TraceRequest {
    TraceRequest { name: name.into(), num_gpu, gpu_milli, arrival, departure }
}

fn trace(requests: Vec<TraceRequest>) -> Trace {
    Trace { source: "attack".into(), requests, synthetic_times: false }
}

/// Punish every ordered pair of distinct placements on `t`; returns the outcomes as
/// text lines (`ERROR` in the errors' lines) and panics where a returned trace does not
/// make the placement lose.
fn all_pairs(t: &Trace, nodes: u32, tiers: bool, queue: Queue) -> Vec<String> {
    let fractions = if tiers { Fractions::Tiers(Tenants::example()) } else { Fractions::Mig };
    all_pairs_with(t, nodes, &fractions, queue)
}

fn all_pairs_with(t: &Trace, nodes: u32, fractions: &Fractions, queue: Queue) -> Vec<String> {
    let mut out = Vec::new();
    for ours in Placement::ALL {
        for rival in Placement::ALL {
            if ours == rival {
                continue;
            }
            let cell = format!(
                "{} {nodes} nodes {} {queue:?} {ours} vs {rival}",
                t.source,
                fractions.label()
            );
            match punish(t, &with_fractions(nodes, ours, fractions.clone(), queue), rival) {
                Ok(None) => out.push(format!("{cell}: equal")),
                Ok(Some(p)) => {
                    assert!(
                        p.ours.admitted < p.rival.admitted,
                        "{cell}: {} >= {}",
                        p.ours.admitted,
                        p.rival.admitted
                    );
                    out.push(format!("{cell}: {:?}", p.case));
                }
                Err(e) => out.push(format!("{cell}: ERROR {e}")),
            }
        }
    }
    out
}

#[test]
fn every_pair_of_placements_on_generated_traces() {
    let mut errors = Vec::new();
    let mut n = 0;
    for (mix, seed) in [(Mix::AlibabaLike, 1), (Mix::MultiGpu, 2), (Mix::SmallShares, 3)] {
        let t = generate(mix, 300, seed, DEFAULT_LOAD_GPUS);
        for (nodes, tiers, queue) in [
            (1, false, Queue::Drop),
            (2, true, Queue::Wait { max_wait_s: 600 }),
            (4, false, Queue::Wait { max_wait_s: 0 }),
            (2, true, Queue::Drop),
        ] {
            for line in all_pairs(&t, nodes, tiers, queue) {
                n += 1;
                if line.contains("ERROR") {
                    errors.push(line);
                }
            }
        }
    }
    assert!(errors.is_empty(), "{} of {n}:\n{}", errors.len(), errors.join("\n"));
}

fn errors_of(lines: &[String]) -> Vec<&String> {
    lines.iter().filter(|l| l.contains("ERROR")).collect()
}

/// Regression: static serves no whole GPU, so a flood of whole-node rows made nothing
/// lose against it (every pair `X vs static` in the Flood case was `NotPunished`). The
/// flood against static is every instance of its layout, which it serves on an empty
/// cluster and nothing holding a request can.
#[test]
fn against_static_the_flood_is_its_own_layout() {
    let t = generate(Mix::MultiGpu, 300, 2, DEFAULT_LOAD_GPUS);
    for ours in [Placement::Best, Placement::FirstFit, Placement::Whole] {
        for tiers in [false, true] {
            let p = punish(&t, &config(1, ours, tiers, Queue::Drop), Placement::Static)
                .unwrap_or_else(|e| panic!("{ours} tiers={tiers}: {e}"))
                .expect("static differs from every other placement here");
            assert!(matches!(p.case, Case::Flood { .. }), "{ours}: {:?}", p.case);
            assert!(p.ours.admitted < p.rival.admitted, "{ours} tiers={tiers}");
            let flood: Vec<_> =
                p.trace.requests.iter().filter(|r| r.name.starts_with("adversary-")).collect();
            // 8 GPUs x (2g, 1g, 1g, 3g) per round, all MIG fractions static can serve.
            assert!(!flood.is_empty() && flood.len() % 32 == 0, "{}", flood.len());
            assert!(flood.iter().all(|r| r.num_gpu == 1 && r.gpu_milli < 1000));
        }
    }
}

/// A request only `ours` started that lasts 0 s: it used to end the construction
/// (`NothingHeld`). Held anyway, its own zero-length leave no longer happens, so only
/// `ours`' decisions after that leave may change; the starts are counted on the cut
/// trace, not the original.
#[test]
fn a_zero_length_request_only_ours_started_is_held() {
    let mut rows: Vec<TraceRequest> =
        (0..7).map(|g| row(&format!("whole-{g}"), 1, 1000, 0, 1_000_000)).collect();
    rows.push(row("half-seen", 1, 500, 1, 2));
    rows.push(row("small", 1, 100, 10, 1_000_000));
    rows.push(row("half", 1, 500, 20, 20)); // Lasts 0 s; only best can place it.
    rows.push(row("small-2", 1, 100, 40, 50));
    let t = trace(rows);
    for queue in [Queue::Drop, Queue::Wait { max_wait_s: 5 }] {
        for rival in [Placement::FirstFit, Placement::Whole] {
            let p = punish(&t, &config(1, Placement::Best, false, queue), rival)
                .unwrap_or_else(|e| panic!("{queue:?} vs {rival}: {e}"))
                .expect("they diverge at 20 s");
            assert_eq!(p.divergence_s, 20);
            assert_eq!(p.case, Case::Flood { held: 9, rounds: 2 }, "{queue:?} vs {rival}");
            assert!(p.trace.requests[9].departure > p.trace.requests[9].arrival);
            assert!(p.ours.admitted < p.rival.admitted, "{queue:?} vs {rival}");
        }
        assert!(errors_of(&all_pairs(&t, 1, false, queue)).is_empty(), "{queue:?}");
    }
}

/// Generated traces made hostile: every third row lasts 0 s, and arrivals are rounded
/// to 300 s so many share an instant (ties broken by row index, which dropping rows
/// renumbers), with CPU-only rows in between; queue retries at zero-length leaves.
#[test]
fn zero_length_rows_equal_times_and_cpu_only_rows() {
    let (mut errors, mut punished) = (Vec::new(), 0);
    for (mix, seed) in [(Mix::AlibabaLike, 7), (Mix::Uniform, 8)] {
        let mut t = generate(mix, 200, seed, DEFAULT_LOAD_GPUS);
        for (i, r) in t.requests.iter_mut().enumerate() {
            let d = r.departure - r.arrival;
            r.arrival = r.arrival / 300 * 300;
            r.departure = if i % 3 == 0 { r.arrival } else { r.arrival + d };
            if i % 11 == 0 {
                r.num_gpu = 0;
            }
        }
        t.source = format!("{} hostile", t.source);
        for (nodes, tiers, queue) in
            [(1, false, Queue::Wait { max_wait_s: 300 }), (2, true, Queue::Drop)]
        {
            let lines = all_pairs(&t, nodes, tiers, queue);
            punished += lines.iter().filter(|l| l.contains("Flood") || l.contains("Fewer")).count();
            errors.extend(errors_of(&lines).into_iter().cloned());
        }
    }
    assert!(errors.is_empty(), "{errors:#?}");
    assert!(punished >= 24, "only {punished} pairs differ: the traces lost their spread");
}

fn shifted(t: &Trace, by: u64) -> Trace {
    let mut t = t.clone();
    for r in &mut t.requests {
        r.arrival += by;
        r.departure += by;
    }
    t.source = format!("{} +{by}", t.source);
    t
}

/// Times near u64::MAX / 2 work as any other; a divergence or a wait so late that the
/// trace's times would pass u64::MAX is an error, not an overflow panic (it was one at
/// `x + 1` for a wait of u64::MAX). Waits are kept below ~10^15 s otherwise: the replay
/// itself overflows on a trace spanning more than u64::MAX / (56 x nodes) seconds
/// (`slice_seconds_capacity`), whoever built it.
#[test]
fn huge_times_and_waits_never_overflow() {
    let t = generate(Mix::AlibabaLike, 120, 5, DEFAULT_LOAD_GPUS);
    let half = all_pairs(&shifted(&t, u64::MAX / 2), 1, false, Queue::Wait { max_wait_s: 600 });
    assert!(errors_of(&half).is_empty(), "{:?}", errors_of(&half));
    let span = t.requests.iter().map(|r| r.departure).max().unwrap_or(0);
    let late = shifted(&t, u64::MAX - span - 700);
    let waits = [
        (&late, Queue::Wait { max_wait_s: 600 }),
        (&t, Queue::Wait { max_wait_s: u64::MAX }),
        (&t, Queue::Wait { max_wait_s: 1_000_000_000_000_000 }),
    ];
    for (trace, queue) in waits {
        for ours in Placement::ALL {
            for rival in Placement::ALL.into_iter().filter(|r| *r != ours) {
                match punish(trace, &config(1, ours, false, queue), rival) {
                    Ok(Some(p)) => assert!(p.ours.admitted < p.rival.admitted),
                    Ok(None) | Err(AdversaryError::TimesOverflow { .. }) => {}
                    Err(e) => panic!("{} {queue:?} {ours} vs {rival}: {e}", trace.source),
                }
            }
        }
    }
    // A wait that never ends within u64 times: no construction (the claim needs waits
    // that expire; see the module documentation).
    let endless = punish(
        &t,
        &config(1, Placement::Best, false, Queue::Wait { max_wait_s: u64::MAX }),
        Placement::Whole,
    );
    assert!(matches!(endless, Err(AdversaryError::TimesOverflow { .. })), "{endless:?}");
}

fn tenant(name: &str, allow: Allow) -> SimTenant {
    SimTenant { key: name.into(), tenant: name.into(), allow, domain: format!("tenant:{name}") }
}

/// Tier-aware with tenants that may not use whole GPUs (MPS and time-slicing only) or
/// nothing at all (every row of theirs refused by policy): flood rows come from a
/// tenant the rival serves and `ours` cannot share, whatever their names hash to.
#[test]
fn flood_rows_come_from_a_tenant_that_cannot_dodge_them() {
    let none = Allow { gpu: false, mig: false, mps: false, shared: false };
    let sharing = Allow { gpu: false, mig: false, mps: true, shared: true };
    let tenants = Tenants {
        tenants: vec![
            tenant("a/sharing", sharing),
            tenant("b/refused", none),
            tenant("c/everything", Allow { gpu: true, mig: true, mps: true, shared: true }),
            tenant("d/untrusted", Allow::MIG_ONLY),
        ],
        rules: Rules { mps_max_percent: 75, replicas: 4 },
    };
    let fractions = Fractions::Tiers(tenants);
    let t = generate(Mix::SmallShares, 250, 9, DEFAULT_LOAD_GPUS);
    let c = with_fractions(1, Placement::Best, fractions.clone(), Queue::Drop);
    let refused = replay::replay_with(&t, &c).expect("replay").refused_by_policy;
    assert!(refused > 0, "some rows are refused by policy");
    for (nodes, queue) in [(1, Queue::Drop), (2, Queue::Wait { max_wait_s: 600 })] {
        let lines = all_pairs_with(&t, nodes, &fractions, queue);
        assert!(errors_of(&lines).is_empty(), "{:#?}", errors_of(&lines));
        assert!(lines.iter().any(|l| l.contains("Flood")), "{lines:#?}");
    }
}

/// Where no tenant may use a whole GPU or MIG, the whole-node flood cannot be built:
/// an error naming why, not a trace that fails to punish.
#[test]
fn no_tenant_for_the_flood_is_an_error() {
    let sharing = Allow { gpu: false, mig: false, mps: true, shared: true };
    let fractions = Fractions::Tiers(Tenants {
        tenants: vec![tenant("a/sharing", sharing), tenant("b/sharing", sharing)],
        rules: Rules { mps_max_percent: 75, replicas: 4 },
    });
    let t = generate(Mix::SmallShares, 250, 9, DEFAULT_LOAD_GPUS);
    let mut no_flood = 0;
    for (ours, rival) in
        [(Placement::Best, Placement::FirstFit), (Placement::FirstFit, Placement::Best)]
    {
        match punish(&t, &with_fractions(1, ours, fractions.clone(), Queue::Drop), rival) {
            Ok(Some(p)) => assert!(p.ours.admitted < p.rival.admitted),
            Ok(None) => {}
            Err(AdversaryError::NoFlood { reason, .. }) => {
                assert!(reason.contains("no tenant"), "{reason}");
                no_flood += 1;
            }
            Err(e) => panic!("{ours} vs {rival}: {e}"),
        }
    }
    println!("{no_flood} of 2 directions have no flood tenant");
}
