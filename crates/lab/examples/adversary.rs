//! The adversary ([`lab::adversary`]) over the trace family of `examples/family.rs`: for
//! every cell (trace, nodes, fractions, queue) where `best` and `first-fit` start different
//! requests, a trace on which best admits fewer requests than first-fit and one on which
//! first-fit admits fewer than best, each replayed to check it.
//!
//! `cargo run -p lab --release --example adversary -- [REQUESTS] [SEED] [MAX_WAIT_S]`
//! (defaults 3000, 1, 3600). One line per cell: the divergence (seconds into the trace),
//! then per direction the case, the punishing trace's length and both admitted counts.

use lab::adversary::{punish, Case, Punishment};
use lab::replay::{Fractions, Placement, Queue, ReplayConfig, Tenants};

mod common;

fn describe(p: &Punishment) -> String {
    let case = match p.case {
        Case::FewerStarted { ours, rival } => format!("fewer started ({ours} < {rival})"),
        Case::Flood { rounds, .. } => format!("flood of {rounds} round(s)"),
    };
    format!(
        "{case}, {} rows: {} {} < {} {}",
        p.trace.requests.len(),
        p.ours.placement,
        p.ours.admitted,
        p.rival.placement,
        p.rival.admitted
    )
}

fn main() -> Result<(), String> {
    let (max_wait_s, traces) = common::args_and_family()?;
    let (mut cells, mut differing, mut punished) = (0, 0, 0);
    for t in &traces {
        for nodes in [1u32, 2, 4, 8] {
            for fractions in [Fractions::Mig, Fractions::Tiers(Tenants::example())] {
                for queue in [Queue::Drop, Queue::Wait { max_wait_s }] {
                    cells += 1;
                    let config = |placement| ReplayConfig {
                        nodes,
                        model: "H100-80GB".into(),
                        placement,
                        fractions: fractions.clone(),
                        queue,
                    };
                    let b = punish(t, &config(Placement::Best), Placement::FirstFit)
                        .map_err(|e| e.to_string())?;
                    let f = punish(t, &config(Placement::FirstFit), Placement::Best)
                        .map_err(|e| e.to_string())?;
                    let cell = format!(
                        "{:<44} {} {:<5} {:<4}",
                        t.source,
                        nodes,
                        fractions.label(),
                        if queue == Queue::Drop { "drop" } else { "wait" }
                    );
                    match (b, f) {
                        (None, None) => println!("{cell} | same starts"),
                        (Some(b), Some(f)) => {
                            differing += 1;
                            punished += 1;
                            println!(
                                "{cell} | diverge at {} s | {} | {}",
                                b.divergence_s,
                                describe(&b),
                                describe(&f)
                            );
                        }
                        (b, f) => {
                            differing += 1;
                            println!(
                                "{cell} | only one direction: {:?} {:?}",
                                b.is_some(),
                                f.is_some()
                            );
                        }
                    }
                }
            }
        }
    }
    println!(
        "cells {cells}: best and first-fit start different requests in {differing}; \
         in {punished} of them a trace makes best lose and another makes first-fit lose"
    );
    Ok(())
}
