//! `best` against `first-fit` (and static, whole) on the whole trace family: the three
//! Alibaba pod lists and the generated mixes, at 1, 2, 4 and 8 nodes of 8 H100-80GB,
//! with MIG-only and tier-aware fractions, dropping on arrival and with a queue.
//!
//! `cargo run -p lab --release --example family -- [REQUESTS] [SEED] [MAX_WAIT_S]`
//! (defaults 3000, 1, 3600). One line per (trace, nodes, fractions, queue); the columns
//! are admitted requests and admitted demand (GPU-hours) of best and first-fit, and the
//! outcome, exact (the printed figures are rounded): `requests`, `demand` or
//! `requests+demand` where best admits less than first-fit, `better` where it is at least
//! as good on both and strictly better on one, `equal` where both are the same.

use lab::replay::{replay_with, Fractions, Placement, Queue, ReplayConfig, Tenants};

mod common;

fn main() -> Result<(), String> {
    let (max_wait_s, traces) = common::args_and_family()?;
    println!(
        "{:<44} {:>2} {:<5} {:<5} | {:>6} {:>6} {:>7} | {:>9} {:>9} {:>7} | {:>5} {:>5} {:>5} {:>5} | {:<7}",
        "trace", "n", "frac", "queue", "best", "ff", "d adm", "best GPUh", "ff GPUh", "d dem",
        "peakB", "peakF", "contB", "contF", "outcome"
    );
    let (mut cells, mut losses, mut wins) = (0, 0, 0);
    let (mut count_losses, mut demand_losses, mut strict) = (0, 0, 0);
    for t in &traces {
        for nodes in [1u32, 2, 4, 8] {
            for fractions in [Fractions::Mig, Fractions::Tiers(Tenants::example())] {
                for queue in [Queue::Drop, Queue::Wait { max_wait_s }] {
                    let run = |placement| {
                        let c = ReplayConfig {
                            nodes,
                            model: "H100-80GB".into(),
                            placement,
                            fractions: fractions.clone(),
                            queue,
                        };
                        replay_with(t, &c).map_err(|e| e.to_string())
                    };
                    let (b, f) = (run(Placement::Best)?, run(Placement::FirstFit)?);
                    let gh = |d: u64| d as f64 / 1000.0 / 3600.0;
                    cells += 1;
                    if b.admitted < f.admitted || b.demand_admitted < f.demand_admitted {
                        losses += 1;
                    }
                    if b.admitted > f.admitted || b.demand_admitted > f.demand_admitted {
                        wins += 1;
                    }
                    count_losses += usize::from(b.admitted < f.admitted);
                    demand_losses += usize::from(b.demand_admitted < f.demand_admitted);
                    strict += usize::from(
                        b.admitted >= f.admitted
                            && b.demand_admitted >= f.demand_admitted
                            && (b.admitted > f.admitted || b.demand_admitted > f.demand_admitted),
                    );
                    let pct =
                        |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{:.1}", v * 100.0));
                    // Exact, unlike the rounded figures (see the module documentation).
                    let outcome =
                        match (b.admitted < f.admitted, b.demand_admitted < f.demand_admitted) {
                            (true, true) => "requests+demand",
                            (true, false) => "requests",
                            (false, true) => "demand",
                            (false, false)
                                if b.admitted > f.admitted
                                    || b.demand_admitted > f.demand_admitted =>
                            {
                                "better"
                            }
                            (false, false) => "equal",
                        };
                    println!(
                        "{:<44} {:>2} {:<5} {:<5} | {:>6} {:>6} {:>+7} | {:>9.0} {:>9.0} {:>+6.1}% | {:>5.1} {:>5.1} {:>5} {:>5} | {}",
                        t.source,
                        nodes,
                        fractions.label(),
                        if queue == Queue::Drop { "drop" } else { "wait" },
                        b.admitted,
                        f.admitted,
                        b.admitted as i64 - f.admitted as i64,
                        gh(b.demand_admitted),
                        gh(f.demand_admitted),
                        (b.demand_admitted as f64 / f.demand_admitted.max(1) as f64 - 1.0) * 100.0,
                        b.demand_peak * 100.0,
                        f.demand_peak * 100.0,
                        pct(b.demand_at_contention),
                        pct(f.demand_at_contention),
                        outcome,
                    );
                }
            }
        }
    }
    println!(
        "cells {cells}: best loses on admitted or demand in {losses} (admitted {count_losses}, \
         demand {demand_losses}), wins on either in {wins}, strictly better on both in {strict}"
    );
    Ok(())
}
