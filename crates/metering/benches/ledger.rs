//! Durable ledger writes: open+close interval pairs on a temp file, each write one
//! fsynced transaction (`synchronous=FULL`), against `synchronous=NORMAL` as the in-run
//! baseline. Also the heartbeat (`checkpoint` with 64 open intervals) and a usage
//! report over the written ledger.
//!
//! Run: `cargo bench -p metering --bench ledger` (env `LEDGER_BENCH_PAIRS` to change the
//! number of pairs, default 3000; `LEDGER_BENCH_DIR` to put the file elsewhere).

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use metering::{
    Class, GroupBy, IntervalStart, Ledger, LedgerOptions, ManualClock, Prices, Synchronous,
    SystemClock, UsageQuery, POSTSTOP_REASON,
};
use tessera_api::Isolation;

fn start(i: u64, device: u64) -> IntervalStart {
    IntervalStart {
        container_id: format!("bench-{i:08}"),
        tenant: format!("org{}/team{}/proj{}/user{}", i % 3, i % 7, i % 11, i % 13),
        node: "bench-node".into(),
        gpu_uuid: format!("GPU-{device}"),
        gpu_model: "H100-80GB".into(),
        device_uuid: format!("GPU-{device}"),
        isolation: Isolation::Gpu,
        mig_profile: None,
        fraction: 1.0,
        class: Class::Guaranteed,
        workload: None,
        nvlink_domain: None,
    }
}

struct Stats {
    label: String,
    ops: usize,
    elapsed: Duration,
    lat: Vec<Duration>,
}

impl Stats {
    fn per_sec(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64()
    }
    fn pct(&self, p: f64) -> f64 {
        let mut v = self.lat.clone();
        v.sort();
        let idx = ((v.len() as f64 - 1.0) * p).round() as usize;
        v.get(idx).map_or(0.0, |d| d.as_secs_f64() * 1e6)
    }
    fn row(&self) {
        println!(
            "{:<34} {:>8} {:>12.0} {:>10.1} {:>10.1} {:>10.1}",
            self.label,
            self.ops,
            self.per_sec(),
            self.pct(0.50),
            self.pct(0.99),
            self.pct(1.0),
        );
    }
}

/// `pairs` open+close pairs; returns (write stats, pair throughput).
fn writes(dir: &Path, sync: Synchronous, pairs: u64) -> (Stats, f64, Ledger) {
    let path = dir.join(format!("ledger-{sync:?}.db"));
    let mut l =
        Ledger::open_with(&path, Arc::new(SystemClock), LedgerOptions { synchronous: sync })
            .expect("open ledger");
    // Warm up: page cache, prepared statements, WAL file allocation.
    for i in 0..200 {
        l.open_interval(&start(u64::MAX / 2 + i, 0)).expect("open");
        l.close_container(&format!("bench-{:08}", u64::MAX / 2 + i), POSTSTOP_REASON)
            .expect("close");
    }
    let mut lat = Vec::with_capacity(2 * pairs as usize);
    let t0 = Instant::now();
    for i in 0..pairs {
        let t = Instant::now();
        l.open_interval(&start(i, i % 8)).expect("open");
        lat.push(t.elapsed());
        let t = Instant::now();
        let closed = l.close_container(&format!("bench-{i:08}"), POSTSTOP_REASON).expect("close");
        lat.push(t.elapsed());
        assert_eq!(closed.len(), 1);
    }
    let elapsed = t0.elapsed();
    let pairs_per_sec = pairs as f64 / elapsed.as_secs_f64();
    let stats = Stats {
        label: format!(
            "durable write, synchronous={}",
            if sync == Synchronous::Full { "FULL" } else { "NORMAL" }
        ),
        ops: lat.len(),
        elapsed,
        lat,
    };
    (stats, pairs_per_sec, l)
}

/// The heartbeat. Its own ledger with a ManualClock moved 5 s per round, as in the daemon:
/// a checkpoint that changes nothing (same millisecond) is skipped by SQLite and would
/// measure no fsync at all.
fn checkpoints(dir: &Path, open: u64, rounds: usize) -> Stats {
    let clock = Arc::new(ManualClock::new(1_767_225_600_000, 0));
    let mut l = Ledger::open(&dir.join("ledger-checkpoint.db"), clock.clone()).expect("open");
    for i in 0..open {
        l.open_interval(&start(1_000_000_000 + i, i % 8)).expect("open");
    }
    let mut lat = Vec::with_capacity(rounds);
    let t0 = Instant::now();
    for _ in 0..rounds {
        clock.advance(5_000);
        let t = Instant::now();
        let n = l.checkpoint().expect("checkpoint");
        lat.push(t.elapsed());
        assert_eq!(n as u64, open);
    }
    Stats {
        label: format!("checkpoint, {open} open, FULL"),
        ops: rounds,
        elapsed: t0.elapsed(),
        lat,
    }
}

fn reports(l: &Ledger, rounds: usize) -> (Stats, u64) {
    let q = UsageQuery::new(0, i64::MAX as u64, GroupBy::User, Prices::default());
    let mut lat = Vec::with_capacity(rounds);
    let mut n = 0;
    let t0 = Instant::now();
    for _ in 0..rounds {
        let t = Instant::now();
        let r = l.usage(&q).expect("usage");
        lat.push(t.elapsed());
        n = r.total.intervals;
    }
    (Stats { label: String::new(), ops: rounds, elapsed: t0.elapsed(), lat }, n)
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` passes nothing useful either:
    // run a tiny pass when not benchmarking so test runs stay fast.
    let benching = std::env::args().any(|a| a == "--bench");
    let pairs: u64 = std::env::var("LEDGER_BENCH_PAIRS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if benching { 3000 } else { 50 });
    let dir = match std::env::var("LEDGER_BENCH_DIR") {
        Ok(d) => tempfile::tempdir_in(d),
        Err(_) => tempfile::tempdir(),
    }
    .expect("tempdir");

    println!(
        "metering ledger benchmark: {pairs} open+close pairs per mode, file in {}",
        dir.path().display()
    );
    println!("cpus: {}", std::thread::available_parallelism().map_or(0, |n| n.get()));
    println!();
    println!(
        "{:<34} {:>8} {:>12} {:>10} {:>10} {:>10}",
        "what", "ops", "ops/s", "p50 us", "p99 us", "max us"
    );
    let (full, full_pairs, full_ledger) = writes(dir.path(), Synchronous::Full, pairs);
    full.row();
    let (normal, normal_pairs, _normal_ledger) = writes(dir.path(), Synchronous::Normal, pairs);
    normal.row();
    let ckpt = checkpoints(dir.path(), 64, if benching { 500 } else { 10 });
    ckpt.row();
    let (mut rep, n) = reports(&full_ledger, if benching { 20 } else { 2 });
    rep.label = format!("usage report over {n} intervals");
    rep.row();
    println!();
    println!("open+close pairs/s: FULL {full_pairs:.0}, NORMAL {normal_pairs:.0}");
    println!(
        "FULL / NORMAL: throughput {:.3}x, p50 latency {:.2}x, p99 latency {:.2}x",
        full.per_sec() / normal.per_sec(),
        full.pct(0.5) / normal.pct(0.5),
        full.pct(0.99) / normal.pct(0.99),
    );
}
