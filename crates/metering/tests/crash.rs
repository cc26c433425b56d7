//! Crash test with real process kills: a child process (this test binary, re-executed in
//! "writer" mode) writes open/checkpoint/close events for 1,000 containers into a ledger
//! with `synchronous=FULL`; the parent SIGKILLs it at random points, restarts it (it
//! resumes from where the ledger says it is), and finally checks that every started
//! interval was closed exactly once and the totals reconcile.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::T0;
use metering::{
    Class, GroupBy, IntervalStart, Ledger, ManualClock, Prices, UsageQuery, POSTSTOP_REASON,
    RECOVERED_REASON,
};
use rand::{Rng, SeedableRng};
use tessera_api::Isolation;

const ENV_LEDGER: &str = "METERING_CRASH_LEDGER";
const ENV_JOURNAL: &str = "METERING_CRASH_JOURNAL";
const ENV_EVENTS: &str = "METERING_CRASH_EVENTS";
const ENV_SEED: &str = "METERING_CRASH_SEED";

const EVENTS: u64 = 1_000;
/// Wall/mono milliseconds between container starts; each container lives 5 s, is
/// checkpointed 2 s in.
const STEP_MS: u64 = 10_000;
const CKPT_AT_MS: u64 = 2_000;
const CLOSE_AT_MS: u64 = 5_000;

fn container(i: u64) -> String {
    format!("c{i:04}")
}

fn devices(i: u64) -> u64 {
    if i.is_multiple_of(3) {
        2
    } else {
        1
    }
}

fn interval_start(i: u64, d: u64) -> IntervalStart {
    IntervalStart {
        container_id: container(i),
        tenant: format!("org{}/team{}/p/u{}", i % 2, i % 3, i % 5),
        node: "crash-node".into(),
        gpu_uuid: format!("GPU-{d}"),
        gpu_model: "H100-80GB".into(),
        device_uuid: format!("GPU-{d}"),
        isolation: Isolation::Gpu,
        mig_profile: None,
        fraction: 1.0,
        class: Class::Guaranteed,
        workload: None,
        nvlink_domain: None,
    }
}

/// The writer. Does nothing unless the parent set the environment: run directly by
/// `cargo test` it is an empty, passing test.
#[test]
fn crash_writer_child() {
    let (Ok(ledger), Ok(journal)) = (std::env::var(ENV_LEDGER), std::env::var(ENV_JOURNAL)) else {
        return;
    };
    let events: u64 = std::env::var(ENV_EVENTS).ok().and_then(|v| v.parse().ok()).unwrap_or(EVENTS);
    let mut journal =
        OpenOptions::new().create(true).append(true).open(journal).expect("open journal");
    let mut note = |line: String| {
        // One write(2) per line on an O_APPEND file: a SIGKILL can only cut between lines.
        journal.write_all(format!("{line}\n").as_bytes()).expect("journal");
    };
    let clock = Arc::new(ManualClock::new(T0, 0));
    let mut l = Ledger::open(Path::new(&ledger), clock.clone()).expect("open ledger");
    note(format!("run recovered={}", l.recovered()));
    assert!(l.open_intervals().expect("open").is_empty(), "open() recovers everything");
    // Resume after the last container the ledger has seen (recovered or closed).
    let next = match l.intervals().expect("list").last() {
        Some(r) => r.start.container_id[1..].parse::<u64>().expect("cNNNN") + 1,
        None => 0,
    };
    for i in next..events {
        let base = i * STEP_MS;
        clock.set(T0 + base, base);
        for d in 0..devices(i) {
            let id = l.open_interval(&interval_start(i, d)).expect("open interval");
            note(format!("open {i} {id}"));
        }
        clock.set(T0 + base + CKPT_AT_MS, base + CKPT_AT_MS);
        l.checkpoint().expect("checkpoint");
        note(format!("ckpt {i}"));
        clock.set(T0 + base + CLOSE_AT_MS, base + CLOSE_AT_MS);
        let closed = l.close_container(&container(i), POSTSTOP_REASON).expect("close");
        note(format!("close {i} {}", closed.len()));
    }
    note("done".into());
}

fn spawn_writer(exe: &Path, ledger: &Path, journal: &Path) -> Child {
    Command::new(exe)
        .args(["--exact", "crash_writer_child", "--nocapture", "--test-threads=1"])
        .env(ENV_LEDGER, ledger)
        .env(ENV_JOURNAL, journal)
        .env(ENV_EVENTS, EVENTS.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn writer")
}

fn journal_lines(journal: &Path) -> Vec<String> {
    std::fs::read_to_string(journal).unwrap_or_default().lines().map(str::to_string).collect()
}

fn wait_with_deadline(child: &mut Child, deadline: Duration) -> std::process::ExitStatus {
    let t = Instant::now();
    loop {
        if let Some(st) = child.try_wait().expect("try_wait") {
            return st;
        }
        if t.elapsed() > deadline {
            let _ = child.kill();
            panic!("writer did not finish within {deadline:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn real_kills_never_lose_or_double_count_intervals() {
    if std::env::var(ENV_LEDGER).is_ok() {
        return; // inside a writer child
    }
    let seed: u64 =
        std::env::var(ENV_SEED).ok().and_then(|s| s.parse().ok()).unwrap_or_else(rand::random);
    eprintln!("crash test seed {seed} (set {ENV_SEED} to replay the kill points)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);

    let dir = tempfile::tempdir().expect("tempdir");
    let ledger: PathBuf = dir.path().join("ledger.db");
    let journal: PathBuf = dir.path().join("journal.txt");
    let exe = std::env::current_exe().expect("current_exe");

    const KILLS: usize = 8;
    let mut kills = 0usize;
    let mut finished = false;
    for round in 0..KILLS {
        let before = journal_lines(&journal).len();
        let mut child = spawn_writer(&exe, &ledger, &journal);
        if round % 4 == 3 {
            // Early: while the process starts, opens and recovers the ledger.
            std::thread::sleep(Duration::from_millis(rng.gen_range(0..40)));
        } else {
            // Mid-stream: after a random number of journaled events.
            let target = before + rng.gen_range(1..=300);
            let t = Instant::now();
            while journal_lines(&journal).len() < target && t.elapsed() < Duration::from_secs(60) {
                if child.try_wait().expect("try_wait").is_some() {
                    break;
                }
                std::thread::sleep(Duration::from_micros(500 + rng.gen_range(0..1500)));
            }
        }
        if child.try_wait().expect("try_wait").is_some() {
            finished = true; // ran to the end before the kill
            break;
        }
        child.kill().expect("SIGKILL writer");
        child.wait().expect("reap writer");
        kills += 1;
    }
    if !finished {
        let mut child = spawn_writer(&exe, &ledger, &journal);
        let status = wait_with_deadline(&mut child, Duration::from_secs(300));
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut e, &mut err);
        }
        assert!(status.success(), "final writer run failed: {status}\n{err}");
    }
    let lines = journal_lines(&journal);
    assert_eq!(lines.last().map(String::as_str), Some("done"));
    eprintln!("{kills} kills, {} journal lines", lines.len());
    assert!(kills >= KILLS / 2, "only {kills} kills landed mid-run");

    // What the writers said they did (each line written after the durable commit).
    let mut journaled_ids = BTreeSet::new();
    let mut checkpointed = BTreeSet::new();
    let mut closed = BTreeSet::new();
    let mut recovered_reported = 0usize;
    for line in &lines {
        let parts: Vec<&str> = line.split(' ').collect();
        match parts.as_slice() {
            ["open", _, id] => {
                journaled_ids.insert(id.to_string());
            }
            ["ckpt", i] => {
                checkpointed.insert(i.parse::<u64>().expect("i"));
            }
            ["close", i, _] => {
                closed.insert(i.parse::<u64>().expect("i"));
            }
            ["run", r] => {
                recovered_reported += r["recovered=".len()..].parse::<usize>().expect("n");
            }
            _ => {}
        }
    }

    let clock = Arc::new(ManualClock::new(T0 + EVENTS * STEP_MS, EVENTS * STEP_MS));
    let l = Ledger::open(&ledger, clock).expect("reopen");
    assert_eq!(l.recovered(), 0, "the last writer closed everything");
    let recs = l.intervals().expect("list");

    // Every container was started, each (container, device) at most once, all closed.
    let mut per_container: BTreeMap<u64, Vec<&metering::IntervalRecord>> = BTreeMap::new();
    let mut keys = BTreeSet::new();
    for r in &recs {
        assert!(
            keys.insert((r.start.container_id.clone(), r.start.device_uuid.clone())),
            "twice: {r:?}"
        );
        let i: u64 = r.start.container_id[1..].parse().expect("cNNNN");
        per_container.entry(i).or_default().push(r);
    }
    assert_eq!(per_container.keys().copied().collect::<Vec<_>>(), (0..EVENTS).collect::<Vec<_>>());
    for id in &journaled_ids {
        assert!(recs.iter().any(|r| r.id.as_str() == id), "journaled interval {id} missing");
    }

    let mut recovered_intervals = 0usize;
    let mut recovered_containers = 0usize;
    let mut want_ms = 0u64;
    for (i, rs) in &per_container {
        let base = T0 + i * STEP_MS;
        let mut any_recovered = false;
        for r in rs {
            let end = r.end.as_ref().unwrap_or_else(|| panic!("interval {} still open", r.id));
            assert_eq!(r.start_wall_ms, base);
            match end.reason.as_str() {
                POSTSTOP_REASON => {
                    assert_eq!(end.duration_ms, CLOSE_AT_MS, "{}", r.id);
                    assert_eq!(rs.len() as u64, devices(*i), "closed containers had every device");
                }
                RECOVERED_REASON => {
                    recovered_intervals += 1;
                    any_recovered = true;
                    assert!(!closed.contains(i), "container {i} journaled closed but recovered");
                    // A durable checkpoint that was journaled must be where it recovered.
                    let want = if checkpointed.contains(i) { CKPT_AT_MS } else { end.duration_ms };
                    assert_eq!(end.duration_ms, want, "{}", r.id);
                    assert!(end.duration_ms == 0 || end.duration_ms == CKPT_AT_MS, "{}", r.id);
                    assert_eq!(end.wall_ms, r.checkpoint_wall_ms);
                }
                other => panic!("unexpected close reason {other:?}"),
            }
            want_ms += end.duration_ms;
        }
        if closed.contains(i) {
            assert!(rs.iter().all(|r| r.end.as_ref().is_some_and(|e| e.reason == POSTSTOP_REASON)));
        }
        recovered_containers += usize::from(any_recovered);
    }
    // Only a kill leaves a container to recover, and each recovery is counted once.
    assert!(recovered_containers <= kills, "{recovered_containers} recovered > {kills} kills");
    assert!(recovered_reported <= recovered_intervals);

    // Totals reconcile: the report equals the sum of the closed intervals, at every level.
    let q = |by| UsageQuery::new(T0, T0 + (EVENTS + 1) * STEP_MS, by, Prices::default());
    let want_s = want_ms as f64 / 1000.0;
    for by in GroupBy::ALL {
        let r = l.usage(&q(by)).expect("usage");
        assert_eq!(r.total.gpu_seconds, want_s, "{by}");
        assert_eq!(r.total.intervals, recs.len() as u64);
    }
    let by_container = l.usage(&q(GroupBy::Container)).expect("usage");
    for row in &by_container.rows {
        let i: u64 = row.group[1..].parse().expect("cNNNN");
        let ms: u64 =
            per_container[&i].iter().filter_map(|r| r.end.as_ref()).map(|e| e.duration_ms).sum();
        assert_eq!(row.gpu_seconds, ms as f64 / 1000.0, "{}", row.group);
    }
    eprintln!(
        "{} intervals, {recovered_intervals} recovered ({recovered_containers} containers), {want_s} GPU-s",
        recs.len()
    );
}
