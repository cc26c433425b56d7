//! Packer decision latency on an 8-GPU H100-80GB node at several fill levels (moved from
//! slicer's placement bench with the packer).
//!
//! `cargo bench -p lab --bench pack`. Criterion reports means per fill level; then a
//! manual loop times 10,000 single packer decisions (whole GPUs, MIG, MPS and time-slicing
//! scored together) and prints p50 / p99 / max, failing (exit 1) if p99 is 100 µs or more.
//! The in-run baseline is `slicer::place` (MIG only): 10,000 decisions timed the same way
//! on nodes filled to the same levels (`cargo bench -p slicer --bench placement` is its
//! own, fuller bench).

use std::collections::BTreeSet;
use std::hint::black_box;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use criterion::Criterion;
use lab::pack::{pack, Allow, Ask, DemandCounter, PackMix, PackNode, Rules};
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

/// A random request of the tier-aware replay: fractions and whole GPUs, three tiers.
fn random_ask(rng: &mut Rng) -> Ask {
    const TIERS: [Allow; 3] = [
        Allow::MIG_ONLY,
        Allow { gpu: true, mig: true, mps: true, shared: false },
        Allow { gpu: true, mig: true, mps: true, shared: true },
    ];
    let allow = TIERS[(rng.next() % 3) as usize];
    let tenant = (rng.next() % 5) as u32;
    let (gpus, milli) = match rng.next() % 10 {
        0..=5 => (1, 50 + (rng.next() % 900) as u32),
        6..=8 => (1, 1000),
        _ => (1 << (rng.next() % 4), 1000),
    };
    Ask { gpus, milli, allow, tenant, domain: tenant }
}

/// An 8x H100 packer node filled by Best decisions until `fill` of its capacity is
/// taken, and the demand mix seen while filling.
fn pack_filled(fill: f64, seed: u64) -> (PackNode, PackMix) {
    let Some(model) = catalog::model(MODEL) else {
        return (
            PackNode::new(catalog::MODELS.first().expect("a model"), 8, Rules::default()),
            PackMix::default(),
        );
    };
    let mut node = PackNode::new(model, 8, Rules { mps_max_percent: 75, replicas: 4 });
    let mut counter = DemandCounter::default();
    let mut rng = Rng(seed);
    for _ in 0..10_000 {
        let used = 1.0 - node.free_units() as f64 / (8.0 * 7000.0);
        if used >= fill {
            break;
        }
        let ask = random_ask(&mut rng);
        counter.record(model, &ask);
        if let Some(p) = pack(&node, &ask, Strategy::Best, &counter.mix()) {
            node.apply(&p.choice, &ask);
        }
    }
    (node, counter.mix())
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("pack/8xH100");
    for fill in [0.0, 0.5, 0.9] {
        let (node, mix) = pack_filled(fill, 0xbeef);
        let mut rng = Rng(0x1234);
        let asks: Vec<Ask> = (0..64).map(|_| random_ask(&mut rng)).collect();
        group.bench_function(format!("fill{:.0}%/64-asks", fill * 100.0), |b| {
            b.iter(|| {
                for a in &asks {
                    black_box(pack(black_box(&node), a, Strategy::Best, &mix));
                }
            })
        });
    }
    group.finish();
}

/// 10,000 single packer decisions (whole GPUs, MIG, MPS and time-slicing scored
/// together), each timed.
fn pack_percentiles() -> bool {
    let nodes: Vec<(PackNode, PackMix)> = [0.0, 0.25, 0.5, 0.75, 0.9, 1.0]
        .iter()
        .map(|&f| pack_filled(f, 0x5eed + (f * 100.0) as u64))
        .collect();
    let mut rng = Rng(0xfade);
    let mut samples = Vec::with_capacity(10_000);
    let mut fits = 0usize;
    for _ in 0..10_000u64 {
        let (node, mix) = &nodes[(rng.next() % nodes.len() as u64) as usize];
        let ask = random_ask(&mut rng);
        let t = Instant::now();
        let d = pack(black_box(node), black_box(&ask), Strategy::Best, mix);
        samples.push(t.elapsed());
        fits += usize::from(d.is_some());
    }
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)];
    let (p50, p99, max) = (at(0.50), at(0.99), at(1.0));
    println!(
        "pack decisions on 8x {MODEL}: n={} p50={:.1} us p99={:.1} us max={:.1} us (fit {}); \
         p99 limit {} us: {}",
        samples.len(),
        p50.as_secs_f64() * 1e6,
        p99.as_secs_f64() * 1e6,
        max.as_secs_f64() * 1e6,
        fits,
        P99_LIMIT.as_micros(),
        if p99 < P99_LIMIT { "PASS" } else { "FAIL" }
    );
    p99 < P99_LIMIT
}

/// The baseline: 10,000 single `place` decisions (MIG only, best), each timed, on MIG
/// nodes filled to the packer's fill levels, with a uniform demand mix.
fn place_baseline() {
    let Some(model) = catalog::model(MODEL) else { return };
    let mix = DemandMix::uniform(model);
    let nodes: Vec<(Inventory, BTreeSet<String>)> = [0.0, 0.25, 0.5, 0.75, 0.9, 1.0]
        .iter()
        .map(|&f| filled(f, 0x5eed + (f * 100.0) as u64))
        .collect();
    let mut rng = Rng(0xfeed);
    let mut samples = Vec::with_capacity(10_000);
    for _ in 0..10_000u64 {
        let (inv, held) = &nodes[(rng.next() % nodes.len() as u64) as usize];
        let profile = rng.pick(&MIX);
        let t = Instant::now();
        let _ = black_box(place(black_box(inv), black_box(held), profile, Strategy::Best, &mix));
        samples.push(t.elapsed());
    }
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)];
    println!(
        "baseline: place decisions on 8x {MODEL}: n={} p50={:.1} us p99={:.1} us max={:.1} us",
        samples.len(),
        at(0.50).as_secs_f64() * 1e6,
        at(0.99).as_secs_f64() * 1e6,
        at(1.0).as_secs_f64() * 1e6,
    );
}

fn main() -> ExitCode {
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
    place_baseline();
    if pack_percentiles() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
