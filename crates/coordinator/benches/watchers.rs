//! Push-to-applied latency for many long-poll watchers.
//!
//! For each store (sqlite: one coordinator; etcd: two coordinators on a real etcd,
//! pushing through one and watching the other) and each N, N watchers in ONE process
//! (each with its own node token and TCP connection) park a long poll; the bench pushes
//! a policy and records when each watcher has received **and verified** it (ed25519 +
//! digest + policy parse, as a node does). Latency = that moment - the moment the push
//! request was sent, both read in the watchers' process. Several rounds; p50/p99/max over
//! all watchers and rounds.
//!
//! The coordinators run in this (parent) process and the watchers in a child process
//! (this executable again, `TESSERA_BENCH_CHILD=1`): each end of 10,000 connections needs
//! its own descriptor, and where RLIMIT_NOFILE's hard limit is 20,000 and cannot be
//! raised (containers without CAP_SYS_RESOURCE) both ends do not fit in one process.
//! Both processes share the machine's cores.
//!
//! ```text
//! cargo bench -p coordinator --bench watchers
//! TESSERA_BENCH_WATCHERS=1000,10000 TESSERA_BENCH_STORES=sqlite,etcd TESSERA_BENCH_ROUNDS=5 \
//!     cargo bench -p coordinator --bench watchers
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/fleet/common.rs"]
mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use coordinator::client::Client;
use coordinator::server::Coordinator;
use coordinator::{PolicyStore, RunningCoordinator, Tokens};
use tokio::sync::mpsc;

fn raise_nofile(want: u64) -> u64 {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes into the rlimit struct we own; RLIMIT_NOFILE is valid.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return 1024;
    }
    if lim.rlim_cur >= want {
        return lim.rlim_cur;
    }
    let raised = libc::rlimit { rlim_cur: want, rlim_max: lim.rlim_max.max(want) };
    // SAFETY: setrlimit reads the struct we pass; raising the hard limit needs
    // CAP_SYS_RESOURCE and simply fails (EPERM) without it.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
        return want;
    }
    let soft = libc::rlimit { rlim_cur: lim.rlim_max, rlim_max: lim.rlim_max };
    // SAFETY: as above; the soft limit may always be raised up to the hard limit.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &soft) } == 0 {
        return lim.rlim_max;
    }
    lim.rlim_cur
}

fn env_list(name: &str, default: &str) -> Vec<String> {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_string())
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}

fn tokens(n: usize) -> (Tokens, Vec<(String, String)>) {
    let nodes: BTreeMap<String, String> = (0..n)
        .map(|i| (format!("bench-{i:05}"), format!("bench-node-token-{i:05}-xxxxxxxx")))
        .collect();
    let admins = BTreeMap::from([("bench".to_string(), common::ADMIN.to_string())]);
    let list = nodes.clone().into_iter().collect();
    (Tokens::from_maps(admins, nodes).expect("tokens"), list)
}

struct Setup {
    push_to: String,
    watch_url: String,
    servers: Vec<RunningCoordinator>,
    _etcd: Option<common::Etcd>,
    _dir: tempfile::TempDir,
}

async fn setup(store: &str, tokens: &Tokens) -> Option<Setup> {
    let dir = tempfile::tempdir().expect("tempdir");
    let any: SocketAddr = "127.0.0.1:0".parse().expect("addr");
    match store {
        "sqlite" => {
            let s: Arc<dyn PolicyStore> = Arc::new(
                coordinator::store::SqliteStore::open(&dir.path().join("c.db")).expect("sqlite"),
            );
            let c =
                RunningCoordinator::start(any, Coordinator::new(s, common::key(), tokens.clone()))
                    .await
                    .expect("start");
            Some(Setup {
                push_to: c.url(),
                watch_url: c.url(),
                servers: vec![c],
                _etcd: None,
                _dir: dir,
            })
        }
        "etcd" => {
            let etcd = common::Etcd::start()?;
            let mut servers = Vec::new();
            for _ in 0..2 {
                let s: Arc<dyn PolicyStore> = Arc::new(
                    coordinator::store::EtcdStore::connect(
                        std::slice::from_ref(&etcd.url),
                        "/bench",
                    )
                    .await
                    .expect("etcd store"),
                );
                servers.push(
                    RunningCoordinator::start(
                        any,
                        Coordinator::new(s, common::key(), tokens.clone()),
                    )
                    .await
                    .expect("start"),
                );
            }
            Some(Setup {
                push_to: servers[0].url(),
                watch_url: servers[1].url(),
                servers,
                _etcd: Some(etcd),
                _dir: dir,
            })
        }
        other => panic!("unknown store {other}: expected sqlite or etcd"),
    }
}

fn token(i: usize) -> String {
    format!("bench-node-token-{i:05}-xxxxxxxx")
}

/// The parent: coordinator(s) in this process, the watchers in a child process.
async fn bench(store: &str, n: usize, rounds: u64) {
    let (tokens, _) = tokens(n);
    let Some(s) = setup(store, &tokens).await else {
        println!("{store:>6} N={n:>6}: skipped (no etcd)");
        return;
    };
    let admin = Client::new(&[s.push_to.as_str()], common::ADMIN).expect("admin");
    admin.push_policy(&common::policy(1), None).await.expect("push 1");
    let exe = std::env::current_exe().expect("own path");
    let child = tokio::process::Command::new(exe)
        .env("TESSERA_BENCH_CHILD", "1")
        .env("TESSERA_BENCH_PUSH_URL", &s.push_to)
        .env("TESSERA_BENCH_WATCH_URL", &s.watch_url)
        .env("TESSERA_BENCH_N", n.to_string())
        .env("TESSERA_BENCH_ROUNDS", rounds.to_string())
        .env("TESSERA_BENCH_LABEL", store)
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(Duration::from_secs(600), child).await {
        Ok(Ok(out)) => {
            print!("{}", String::from_utf8_lossy(&out.stdout));
            if !out.status.success() {
                println!(
                    "{store:>6} N={n:>6}: watcher process failed ({}): {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
        Ok(Err(e)) => println!("{store:>6} N={n:>6}: cannot run the watcher process: {e}"),
        Err(_) => println!("{store:>6} N={n:>6}: watcher process timed out"),
    }
    for c in s.servers {
        c.shutdown().await;
    }
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} not set"))
}

/// The child: N watchers and the admin that pushes; every timestamp taken here.
async fn watchers(label: &str, push_to: &str, watch_url: &str, n: usize, rounds: u64) {
    let admin = Client::new(&[push_to], common::ADMIN).expect("admin");
    let health = Client::new(&[watch_url], common::ADMIN).expect("health");
    let parked = || async {
        health.health().await.ok().and_then(|h| h["watchers"].as_u64()).unwrap_or(0) as usize
    };
    let wait_parked = |within: Duration| async move {
        let t0 = Instant::now();
        loop {
            let p = parked().await;
            if p >= n {
                return t0.elapsed();
            }
            assert!(t0.elapsed() < within, "only {p} of {n} watchers parked after {within:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let trust = common::key().verifying_key();
    let repoll_delay = Duration::from_millis(
        std::env::var("TESSERA_BENCH_REPOLL_DELAY_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0),
    );
    let verify_each = std::env::var("TESSERA_BENCH_VERIFY").map_or(true, |v| v != "none");
    let (tx, mut rx) = mpsc::unbounded_channel::<(u64, Instant)>();
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let c = Client::new(&[watch_url], &token(i)).expect("client");
        let tx = tx.clone();
        tasks.push(tokio::spawn(async move {
            let mut current = 1u64;
            loop {
                match c.latest(current, Duration::from_secs(120)).await {
                    Ok(Some(env)) => {
                        if verify_each {
                            let v = coordinator::signing::verify(&env, &trust).expect("verifies");
                            assert_eq!(v.version, env.version);
                        }
                        current = env.version;
                        let _ = tx.send((env.version, Instant::now()));
                        if repoll_delay > Duration::ZERO {
                            tokio::time::sleep(repoll_delay).await;
                        }
                    }
                    Ok(None) => {}
                    Err(e) => {
                        eprintln!("watcher: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        }));
    }
    let parked_in = wait_parked(Duration::from_secs(120)).await;

    let mut all = Vec::with_capacity(n * rounds as usize);
    let mut per_round = Vec::new();
    for round in 0..rounds {
        let version = 2 + round;
        if round > 0 {
            wait_parked(Duration::from_secs(120)).await;
        }
        let t0 = Instant::now();
        admin.push_policy(&common::policy(version), None).await.expect("push");
        let acked = t0.elapsed();
        let mut lat = Vec::with_capacity(n);
        while lat.len() < n {
            let (v, at) = tokio::time::timeout(Duration::from_secs(60), rx.recv())
                .await
                .expect("all watchers within 60 s")
                .expect("channel");
            if v == version {
                lat.push(at.duration_since(t0));
            }
        }
        lat.sort();
        per_round.push((
            acked,
            pct(&lat, 0.5),
            pct(&lat, 0.99),
            *lat.last().unwrap_or(&Duration::ZERO),
        ));
        all.extend(lat);
    }
    all.sort();
    println!(
        "{label:>6} N={n:>6}: parked in {:>6} ms | push->applied over {rounds} rounds: p50 {:>7} ms  p99 {:>7} ms  max {:>7} ms",
        ms(parked_in),
        ms(pct(&all, 0.5)),
        ms(pct(&all, 0.99)),
        ms(*all.last().unwrap_or(&Duration::ZERO))
    );
    for (i, (acked, p50, p99, max)) in per_round.iter().enumerate() {
        println!(
            "        round {i}: push acked {:>6} ms, p50 {:>7} ms, p99 {:>7} ms, all {n} updated {:>7} ms",
            ms(*acked),
            ms(*p50),
            ms(*p99),
            ms(*max)
        );
    }
    for t in &tasks {
        t.abort();
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("runtime");
    if std::env::var_os("TESSERA_BENCH_CHILD").is_some() {
        let n: usize = env("TESSERA_BENCH_N").parse().expect("N");
        raise_nofile(n as u64 + 1024);
        let rounds: u64 = env("TESSERA_BENCH_ROUNDS").parse().expect("rounds");
        rt.block_on(watchers(
            &env("TESSERA_BENCH_LABEL"),
            &env("TESSERA_BENCH_PUSH_URL"),
            &env("TESSERA_BENCH_WATCH_URL"),
            n,
            rounds,
        ));
        return;
    }
    // `cargo test --benches` runs this without --bench: keep that quick.
    let quick = !std::env::args().any(|a| a == "--bench");
    let sizes: Vec<usize> = if quick {
        vec![50]
    } else {
        env_list("TESSERA_BENCH_WATCHERS", "1000,10000")
            .iter()
            .map(|s| s.parse().expect("a number"))
            .collect()
    };
    let stores = env_list("TESSERA_BENCH_STORES", "sqlite,etcd");
    let rounds: u64 = std::env::var("TESSERA_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if quick { 1 } else { 3 });
    let want = sizes.iter().max().copied().unwrap_or(0) as u64 + 4096;
    let got = raise_nofile(want);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("watchers bench: {cpus} cpus, RLIMIT_NOFILE {got}, rounds {rounds}; coordinators in this process, watchers in one child process");
    for store in &stores {
        for &n in &sizes {
            if (n as u64) + 256 > got {
                println!("{store:>6} N={n:>6}: skipped (RLIMIT_NOFILE {got} is too low)");
                continue;
            }
            rt.block_on(bench(store, n, rounds));
        }
    }
}
