//! Placement decision latency on an 8-GPU H100-80GB node at several fill levels.
//!
//! `cargo bench -p slicer --bench placement`. Criterion reports means per fill level;
//! then a manual loop times 10,000 single decisions over every fill level and request
//! profile and prints p50 / p99 / max, failing (exit 1) if p99 is 100 µs or more. The
//! packer's bench (whole GPUs, MIG, MPS and time-slicing scored together, with `place` as
//! its in-run baseline) is the lab crate's: `cargo bench -p lab --bench pack`.

use std::collections::BTreeSet;
use std::hint::black_box;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use criterion::Criterion;
use slicer::catalog;
use slicer::inventory::{Gpu, Inventory, Majors, MigInstance};
use slicer::place::{place, DemandMix, PlaceDecision, Strategy};

const MODEL: &str = "H100-80GB";
const P99_LIMIT: Duration = Duration::from_micros(100);
/// The request mix the fills and the timing loop draw from (the trace's MIG mix, roughly).
const MIX: [&str; 10] = [
    "1g.10gb", "2g.20gb", "2g.20gb", "3g.40gb", "3g.40gb", "4g.40gb", "4g.40gb", "4g.40gb",
    "7g.80gb", "1g.20gb",
];

fn empty_node() -> Inventory {
    let model = catalog::model(MODEL).map_or(0, |m| m.memory_mib);
    Inventory {
        node: "bench".into(),
        gpus: (0..8)
            .map(|i| Gpu {
                index: i,
                uuid: format!("GPU-{i}"),
                model: MODEL.into(),
                minor: i,
                memory_mib: model,
                mig_enabled: true,
                instances: Vec::new(),
            })
            .collect(),
        majors: Majors { nvidia: 195, nvidia_uvm: 508, nvidia_caps: Some(509) },
    }
}

/// A tiny deterministic generator (xorshift64).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn pick<'a>(&mut self, from: &[&'a str]) -> &'a str {
        from[(self.next() % from.len() as u64) as usize]
    }
}

/// A node filled by Best placements until `fill` of its memory slots are used (or
/// nothing more fits); every instance held.
fn filled(fill: f64, seed: u64) -> (Inventory, BTreeSet<String>) {
    let Some(model) = catalog::model(MODEL) else { return (empty_node(), BTreeSet::new()) };
    let mix = DemandMix::uniform(model);
    let mut inv = empty_node();
    let mut held = BTreeSet::new();
    let mut rng = Rng(seed);
    let mut n = 0usize;
    for _ in 0..10_000 {
        let used: u32 = inv.gpus.iter().flat_map(|g| &g.instances).map(|i| u32::from(i.size)).sum();
        if f64::from(used) >= fill * 64.0 {
            break;
        }
        let profile = rng.pick(&MIX);
        let Ok(PlaceDecision::Create { gpu_index, start }) =
            place(&inv, &held, profile, Strategy::Best, &mix)
        else {
            continue;
        };
        let Some(p) = model.profile(profile) else { continue };
        n += 1;
        let uuid = format!("MIG-{n}");
        held.insert(uuid.clone());
        if let Some(g) = inv.gpus.iter_mut().find(|g| g.index == gpu_index) {
            g.instances.push(MigInstance::planned(uuid, p, start));
        }
    }
    (inv, held)
}

/// A full node where only defragmentation helps: even GPUs hold 2g@0 and 3g@4 in use
/// with idle 1g at 2 and 3; odd GPUs seven 1g, those at 0-3 idle, 4-6 in use.
fn defrag_node() -> Inventory {
    let mut inv = empty_node();
    let Some(model) = catalog::model(MODEL) else { return inv };
    for g in &mut inv.gpus {
        let layout: Vec<(&str, u8)> = if g.index % 2 == 0 {
            vec![("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3), ("3g.40gb", 4)]
        } else {
            (0..7).map(|s| ("1g.10gb", s)).collect()
        };
        for (profile, start) in layout {
            let Some(p) = model.profile(profile) else { continue };
            g.instances.push(MigInstance::planned(format!("MIG-{}-{start}", g.index), p, start));
        }
    }
    inv
}

fn defrag_held() -> BTreeSet<String> {
    defrag_node()
        .gpus
        .iter()
        .flat_map(|g| {
            let even = g.index % 2 == 0;
            g.instances
                .iter()
                .filter(move |i| if even { i.profile != "1g.10gb" } else { i.start >= 4 })
                .map(|i| i.uuid.clone())
        })
        .collect()
}

fn scenarios() -> Vec<(String, Inventory, BTreeSet<String>)> {
    let mut out = Vec::new();
    for fill in [0.0, 0.25, 0.5, 0.75, 1.0] {
        let (inv, held) = filled(fill, 0x5eed + (fill * 100.0) as u64);
        out.push((format!("fill{:.0}%", fill * 100.0), inv, held));
    }
    out.push(("full-defrag".into(), defrag_node(), defrag_held()));
    out
}

fn bench(c: &mut Criterion) {
    let Some(model) = catalog::model(MODEL) else { return };
    let mix = DemandMix::uniform(model);
    let mut group = c.benchmark_group("place/8xH100");
    for (name, inv, held) in scenarios() {
        for profile in ["1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"] {
            group.bench_function(format!("{name}/{profile}"), |b| {
                b.iter(|| place(black_box(&inv), black_box(&held), profile, Strategy::Best, &mix))
            });
        }
    }
    group.finish();
}

/// 10,000 single decisions, each timed: random scenario, random profile, both
/// strategies, observed demand mixes.
fn percentiles() -> bool {
    let Some(model) = catalog::model(MODEL) else { return false };
    let scenarios = scenarios();
    let mut counts = std::collections::BTreeMap::new();
    let mut rng = Rng(0xfeed);
    let mut samples = Vec::with_capacity(10_000);
    let mut outcomes = [0usize; 4];
    for i in 0..10_000u64 {
        let (_, inv, held) = &scenarios[(rng.next() % scenarios.len() as u64) as usize];
        let profile = rng.pick(&MIX);
        *counts.entry(profile.to_string()).or_insert(0u64) += 1;
        let mix = if i % 2 == 0 { DemandMix::observed(&counts) } else { DemandMix::uniform(model) };
        let strategy = if i % 4 == 3 { Strategy::FirstFit } else { Strategy::Best };
        let t = Instant::now();
        let d = place(black_box(inv), black_box(held), profile, strategy, &mix);
        samples.push(t.elapsed());
        outcomes[match d {
            Ok(PlaceDecision::Reuse { .. }) => 0,
            Ok(PlaceDecision::Create { .. }) => 1,
            Ok(PlaceDecision::Defragment { .. }) => 2,
            Err(_) => 3,
        }] += 1;
    }
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)];
    let (p50, p99, max) = (at(0.50), at(0.99), at(1.0));
    println!(
        "placement decisions on 8x {MODEL}: n={} p50={:.1} us p99={:.1} us max={:.1} us \
         (reuse {}, create {}, defragment {}, no room {}); p99 limit {} us: {}",
        samples.len(),
        p50.as_secs_f64() * 1e6,
        p99.as_secs_f64() * 1e6,
        max.as_secs_f64() * 1e6,
        outcomes[0],
        outcomes[1],
        outcomes[2],
        outcomes[3],
        P99_LIMIT.as_micros(),
        if p99 < P99_LIMIT { "PASS" } else { "FAIL" }
    );
    p99 < P99_LIMIT
}

fn main() -> ExitCode {
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
    if percentiles() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
