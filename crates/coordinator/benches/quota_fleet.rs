//! The quota books at fleet size (issue 28): N synthetic nodes syncing every second as
//! tesserad does, plus admissions at a steady rate, against real `tessera-coordinator`
//! processes (the release build `cargo bench` makes) on a real etcd.
//!
//! Each node holds from 0 to 8 GPUs of work from the start (its team's, listed in every
//! sync, as a busy fleet's nodes do: about 4 per node, 25,000 holdings at 6,250 nodes) and
//! syncs once a second at its own phase (spread evenly over the second), reporting the
//! leases its last answer gave it. Admissions come at `TESSERA_BENCH_ADMITS` per second
//! from random nodes (one GPU of the node's team, or borrowed work of a team without
//! guarantee); an admitted container is listed from its node's next sync and released 20 s
//! later. Requests go over `TESSERA_BENCH_CONNECTIONS` keep-alive connections, each
//! request with its own node's token.
//!
//! Measured over `TESSERA_BENCH_SECONDS` after every node has synced once: syncs due and
//! answered (and how late), admission latency from the moment it was due, the longest any
//! node went without a sync answered, the CPU of the coordinator(s), etcd and this load
//! generator (so the generator's own cost is seen), etcd's write transactions per second,
//! the coordinator's memory, and the generator's own lag (how late a 10 ms timer of its
//! runtime fired at worst: a latency measured from when a request was due includes it).
//!
//! `TESSERA_BENCH_FOLLOWERS=2` runs two more coordinators and spreads the nodes over all
//! three (a third each): the followers pass the calls on to the leader.
//! `TESSERA_BENCH_COORDINATOR=PATH` runs another `tessera-coordinator` (an older build, for
//! a baseline).
//!
//! ```text
//! cargo bench -p coordinator --bench quota_fleet
//! TESSERA_BENCH_NODES=100,500,2000,6250 TESSERA_BENCH_SECONDS=60 TESSERA_BENCH_ADMITS=50 \
//!     cargo bench -p coordinator --bench quota_fleet
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/fleet/common.rs"]
mod common;

use std::collections::VecDeque;
use std::io::Write as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fleet::quota_wire::{
    AdmitAnswer, AdmitRequest, Amounts, Holding, Lease, QuotaClass, SyncRequest,
};
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

const H100: &str = "H100-80GB";
const MICRO: u64 = 1_000_000;
const TEAMS: usize = 20;
const ADMIN: &str = "bench-admin-token-0123456789";
/// An admitted container is released this long after it was admitted.
const LIFETIME: Duration = Duration::from_secs(20);

fn env_list(name: &str, default: &str) -> Vec<String> {
    std::env::var(name)
        .unwrap_or_else(|_| default.to_string())
        .split(',')
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn node_name(i: usize) -> String {
    format!("n{i:05}")
}

fn token(i: usize) -> String {
    format!("node-token-{i:05}-0123456789abcdef")
}

/// 20 teams, each guaranteed 2,000 GPUs with a ceiling of 2,500; `acme/spare` has no
/// quota (it only borrows).
fn policy() -> Vec<u8> {
    let teams: Vec<String> = (0..TEAMS).map(|t| format!(r#""t{t:02}": {{}}"#)).collect();
    let quotas: Vec<String> = (0..TEAMS)
        .map(|t| {
            format!(r#""acme/t{t:02}": {{"gpus": {{"H100-80GB": {{"guarantee": 2000, "ceiling": 2500}}}}}}"#)
        })
        .collect();
    format!(
        r#"{{"version": 1, "orgs": {{"acme": {{"trust": "trusted", "teams": {{{}, "spare": {{}}}}}}}},
            "default_tenant": "acme/spare", "quotas": {{{}}}}}"#,
        teams.join(", "),
        quotas.join(", ")
    )
    .into_bytes()
}

/// CPU seconds (user + system) of process `pid` so far.
fn cpu_of(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return 0.0 };
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 of stat (utime, stime) are the 12th and 13th after the name.
    let ticks: u64 = f.get(11).and_then(|s| s.parse().ok()).unwrap_or(0)
        + f.get(12).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0);
    // SAFETY: sysconf reads a system value and touches no memory of ours.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    ticks as f64 / hz
}

/// The resident memory of `pid` in MiB.
fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

fn self_cpu() -> f64 {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage writes a rusage into the buffer we own.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr()) };
    // SAFETY: initialized by getrusage (zeroed before, so valid either way).
    let ru = unsafe { ru.assume_init() };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

/// A `tessera-coordinator serve` child; killed when dropped.
struct Coord {
    child: Child,
    url: String,
}

impl Drop for Coord {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_coordinator(bin: &str, dir: &Path, etcd: &str, prefix: &str, name: &str) -> Coord {
    let addr = common::free_addr();
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
    let child = Command::new(bin)
        .arg("serve")
        .args(["--listen", &addr.to_string()])
        .args(["--store", &format!("etcd:{etcd}"), "--etcd-prefix", prefix])
        .arg("--signing-key")
        .arg(dir.join("key"))
        .arg("--tokens")
        .arg(dir.join("tokens.json"))
        .args(["--usage-retention-days", "0", "--etcd-compaction-retention-s", "0"])
        .env("TESSERA_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn tessera-coordinator");
    let c = Coord { child, url: format!("http://{addr}") };
    let t0 = Instant::now();
    while common::raw_try(&c.url, "/v1/ping") != Some(200) {
        assert!(t0.elapsed() < Duration::from_secs(30), "{name} did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    c
}

/// One request for a connection worker.
struct Req {
    path: String,
    token: String,
    body: Vec<u8>,
    reply: oneshot::Sender<Option<(u16, Vec<u8>)>>,
}

/// One keep-alive HTTP/1.1 connection serving requests from `rx` one after another.
async fn connection(addr: String, rx: Arc<tokio::sync::Mutex<mpsc::Receiver<Req>>>) {
    let mut conn: Option<BufReader<TcpStream>> = None;
    loop {
        let Some(req) = rx.lock().await.recv().await else { return };
        let mut answer = None;
        for _ in 0..2 {
            if conn.is_none() {
                conn = TcpStream::connect(&addr).await.ok().map(|s| {
                    let _ = s.set_nodelay(true);
                    BufReader::new(s)
                });
            }
            let Some(c) = conn.as_mut() else { break };
            match exchange(c, &addr, &req).await {
                Some(a) => {
                    answer = Some(a);
                    break;
                }
                None => conn = None,
            }
        }
        let _ = req.reply.send(answer);
    }
}

async fn exchange(c: &mut BufReader<TcpStream>, host: &str, req: &Req) -> Option<(u16, Vec<u8>)> {
    let head = format!(
        "POST {} HTTP/1.1\r\nhost: {host}\r\nauthorization: Bearer {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        req.path,
        req.token,
        req.body.len()
    );
    let s = c.get_mut();
    s.write_all(head.as_bytes()).await.ok()?;
    s.write_all(&req.body).await.ok()?;
    let mut line = String::new();
    c.read_line(&mut line).await.ok()?;
    let status: u16 = line.split(' ').nth(1)?.parse().ok()?;
    let mut len = 0usize;
    let mut chunked = false;
    loop {
        line.clear();
        c.read_line(&mut line).await.ok()?;
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        let lower = l.to_ascii_lowercase();
        if let Some(v) = lower.strip_prefix("content-length:") {
            len = v.trim().parse().ok()?;
        }
        if lower.starts_with("transfer-encoding:") && lower.contains("chunked") {
            chunked = true;
        }
    }
    let mut body = Vec::new();
    if chunked {
        loop {
            line.clear();
            c.read_line(&mut line).await.ok()?;
            let n = usize::from_str_radix(line.trim(), 16).ok()?;
            let mut chunk = vec![0u8; n + 2];
            c.read_exact(&mut chunk).await.ok()?;
            if n == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..n]);
        }
    } else {
        body.resize(len, 0);
        c.read_exact(&mut body).await.ok()?;
    }
    Some((status, body))
}

/// What the generator knows of one node.
struct NodeState {
    holdings: Vec<Holding>,
    leases: Vec<Lease>,
    /// When its last sync was answered 200 (generator clock).
    last_ok: Option<Instant>,
}

#[derive(Default)]
struct Stats {
    syncs_due: AtomicU64,
    syncs_ok: AtomicU64,
    syncs_failed: AtomicU64,
    syncs_late: AtomicU64,
    sync_lat: Mutex<Vec<Duration>>,
    admits_due: AtomicU64,
    admits_ok: AtomicU64,
    admits_failed: AtomicU64,
    admitted: AtomicU64,
    refused: AtomicU64,
    reclaiming: AtomicU64,
    admit_lat: Mutex<Vec<Duration>>,
    releases: AtomicU64,
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

struct Outcome {
    line: String,
}

#[allow(clippy::too_many_arguments)]
async fn run_one(
    n: usize,
    bin: &str,
    dir: &Path,
    etcd: &common::Etcd,
    etcd_pid: u32,
    followers: usize,
    seconds: u64,
    admits_per_s: u64,
    connections: usize,
) -> Outcome {
    let prefix = format!("/bench-{n}-{}", fleet::now_ms());
    let mut coords = vec![start_coordinator(bin, dir, &etcd.url, &prefix, "leader")];
    let admin = coordinator::client::Client::new(&[coords[0].url.as_str()], ADMIN).unwrap();
    admin.push_policy(&policy(), None).await.unwrap();
    // The first one leads (its election key is the oldest); then the followers.
    let t0 = Instant::now();
    while admin.quota_status().await.map_or(true, |s| s.authority.is_none()) {
        assert!(t0.elapsed() < Duration::from_secs(30), "no leader");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for f in 0..followers {
        coords.push(start_coordinator(bin, dir, &etcd.url, &prefix, &format!("follower-{f}")));
    }
    let pids: Vec<u32> = coords.iter().map(|c| c.child.id()).collect();

    // Connection workers, per coordinator; node i talks to coordinator i % coords.
    let mut queues = Vec::new();
    for c in &coords {
        let (tx, rx) = mpsc::channel::<Req>(100_000);
        let rx = Arc::new(tokio::sync::Mutex::new(rx));
        let addr = c.url.trim_start_matches("http://").to_string();
        for _ in 0..(connections / coords.len()).max(1) {
            tokio::spawn(connection(addr.clone(), rx.clone()));
        }
        queues.push(tx);
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(n as u64);
    let nodes: Arc<Vec<Mutex<NodeState>>> = Arc::new(
        (0..n)
            .map(|i| {
                let team = i % TEAMS;
                let k = rng.gen_range(0..=8u64);
                let holdings = (0..k)
                    .map(|j| Holding {
                        container_id: format!("pre-{i}-{j}"),
                        tenant: format!("acme/t{team:02}"),
                        amounts: Amounts {
                            gpus: [(H100.to_string(), MICRO)].into(),
                            ..Default::default()
                        },
                        class: QuotaClass::Guaranteed,
                        started_ms: 1_000,
                        gang: None,
                        workload: None,
                        under_lease: false,
                        checkpoint: false,
                    })
                    .collect();
                Mutex::new(NodeState { holdings, leases: Vec::new(), last_ok: None })
            })
            .collect(),
    );
    let stats = Arc::new(Stats::default());
    let measuring = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let capacity = Amounts {
        gpus: [(H100.to_string(), 8 * MICRO)].into(),
        cpu_milli: 128_000,
        memory_mib: 1 << 20,
    };

    // Syncs: node i at phase i/n of every second.
    let sync_task = {
        let (nodes, stats, measuring, stop, queues) =
            (nodes.clone(), stats.clone(), measuring.clone(), stop.clone(), queues.clone());
        let capacity = capacity.clone();
        tokio::spawn(async move {
            let start = tokio::time::Instant::now();
            let mut round = 0u64;
            while !stop.load(Ordering::Relaxed) {
                for i in 0..n {
                    let due = start
                        + Duration::from_secs(round)
                        + Duration::from_micros((i as u64 * 1_000_000) / n as u64);
                    tokio::time::sleep_until(due).await;
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let body = {
                        let st = nodes[i].lock().unwrap();
                        serde_json::to_vec(&SyncRequest {
                            capacity: capacity.clone(),
                            holdings: st.holdings.clone(),
                            leases: st.leases.clone(),
                            stopping: vec![],
                            last_authority: None,
                        })
                        .unwrap()
                    };
                    let counted = measuring.load(Ordering::Relaxed);
                    if counted {
                        stats.syncs_due.fetch_add(1, Ordering::Relaxed);
                    }
                    let (reply, rx) = oneshot::channel();
                    let req = Req {
                        path: format!("/v1/nodes/{}/quota/sync", node_name(i)),
                        token: token(i),
                        body,
                        reply,
                    };
                    if queues[i % queues.len()].try_send(req).is_err() {
                        if counted {
                            stats.syncs_failed.fetch_add(1, Ordering::Relaxed);
                        }
                        continue;
                    }
                    let (nodes, stats) = (nodes.clone(), stats.clone());
                    let due_std = due.into_std();
                    tokio::spawn(async move {
                        let answer = rx.await.ok().flatten();
                        let took = due_std.elapsed();
                        match answer {
                            Some((200, body)) => {
                                let a: fleet::quota_wire::SyncAnswer =
                                    serde_json::from_slice(&body).unwrap();
                                let mut st = nodes[i].lock().unwrap();
                                st.leases = a.leases;
                                st.last_ok = Some(Instant::now());
                                if counted {
                                    stats.syncs_ok.fetch_add(1, Ordering::Relaxed);
                                    if took > Duration::from_secs(1) {
                                        stats.syncs_late.fetch_add(1, Ordering::Relaxed);
                                    }
                                    stats.sync_lat.lock().unwrap().push(took);
                                }
                            }
                            _ => {
                                if counted {
                                    stats.syncs_failed.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                        }
                    });
                }
                round += 1;
            }
        })
    };

    // Every node synced once: the books hold the fleet.
    let t0 = Instant::now();
    loop {
        let synced = nodes.iter().filter(|s| s.lock().unwrap().last_ok.is_some()).count();
        if synced == n {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(300), "only {synced} of {n} nodes ever synced");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let warm = t0.elapsed();
    // A few seconds at the steady rate before measuring.
    tokio::time::sleep(Duration::from_secs(3)).await;

    // Admissions and releases.
    let admit_task = {
        let (nodes, stats, measuring, stop, queues) =
            (nodes.clone(), stats.clone(), measuring.clone(), stop.clone(), queues.clone());
        tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(7);
            let every = Duration::from_micros(1_000_000 / admits_per_s.max(1));
            let start = tokio::time::Instant::now();
            let releases: Arc<Mutex<VecDeque<(Instant, usize, String)>>> = Default::default();
            let mut k = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let due = start + every * (k as u32);
                tokio::time::sleep_until(due).await;
                k += 1;
                // Releases due.
                let now = Instant::now();
                let due_releases: Vec<(usize, String)> = {
                    let mut r = releases.lock().unwrap();
                    let mut out = Vec::new();
                    while r.front().is_some_and(|(t, _, _)| *t <= now) {
                        let (_, i, c) = r.pop_front().unwrap();
                        out.push((i, c));
                    }
                    out
                };
                for (i, c) in due_releases {
                    nodes[i].lock().unwrap().holdings.retain(|h| h.container_id != c);
                    let body = format!(r#"{{"container_id": "{c}"}}"#).into_bytes();
                    let (reply, _rx) = oneshot::channel();
                    let req = Req {
                        path: format!("/v1/nodes/{}/quota/release", node_name(i)),
                        token: token(i),
                        body,
                        reply,
                    };
                    let _ = queues[i % queues.len()].try_send(req);
                    stats.releases.fetch_add(1, Ordering::Relaxed);
                }
                let i = rng.gen_range(0..n);
                let tenant = if rng.gen_bool(0.8) {
                    format!("acme/t{:02}", i % TEAMS)
                } else {
                    "acme/spare".to_string()
                };
                let container = format!("c{k}-{i}");
                let req = AdmitRequest {
                    container_id: container.clone(),
                    tenant: tenant.clone(),
                    amounts: Amounts {
                        gpus: [(H100.to_string(), MICRO)].into(),
                        ..Default::default()
                    },
                    gang: None,
                    short_on_node: false,
                    workload: None,
                    unsynced_lease_grants: false,
                    checkpoint: false,
                };
                let counted = measuring.load(Ordering::Relaxed);
                if counted {
                    stats.admits_due.fetch_add(1, Ordering::Relaxed);
                }
                let (reply, rx) = oneshot::channel();
                let r = Req {
                    path: format!("/v1/nodes/{}/quota/admit", node_name(i)),
                    token: token(i),
                    body: serde_json::to_vec(&req).unwrap(),
                    reply,
                };
                if queues[i % queues.len()].try_send(r).is_err() {
                    if counted {
                        stats.admits_failed.fetch_add(1, Ordering::Relaxed);
                    }
                    continue;
                }
                let (nodes, stats, releases) = (nodes.clone(), stats.clone(), releases.clone());
                let due_std = due.into_std();
                tokio::spawn(async move {
                    let answer = rx.await.ok().flatten();
                    let took = due_std.elapsed();
                    let Some((200, body)) = answer else {
                        if counted {
                            stats.admits_failed.fetch_add(1, Ordering::Relaxed);
                        }
                        return;
                    };
                    let a: AdmitAnswer = serde_json::from_slice(&body).unwrap();
                    if counted {
                        stats.admits_ok.fetch_add(1, Ordering::Relaxed);
                        stats.admit_lat.lock().unwrap().push(took);
                    }
                    match a {
                        AdmitAnswer::Admitted { class, .. } => {
                            if counted {
                                stats.admitted.fetch_add(1, Ordering::Relaxed);
                            }
                            nodes[i].lock().unwrap().holdings.push(Holding {
                                container_id: container.clone(),
                                tenant,
                                amounts: Amounts {
                                    gpus: [(H100.to_string(), MICRO)].into(),
                                    ..Default::default()
                                },
                                class,
                                started_ms: fleet::now_ms(),
                                gang: None,
                                workload: None,
                                under_lease: false,
                                checkpoint: false,
                            });
                            releases.lock().unwrap().push_back((
                                Instant::now() + LIFETIME,
                                i,
                                container,
                            ));
                        }
                        AdmitAnswer::Refused { .. } => {
                            if counted {
                                stats.refused.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                        AdmitAnswer::Reclaiming { .. } => {
                            if counted {
                                stats.reclaiming.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                });
            }
        })
    };
    tokio::time::sleep(Duration::from_secs(5)).await;
    // The generator's own lag: a stall of its runtime delays every request it sends.
    let lag_us = Arc::new(AtomicU64::new(0));
    let lag_task = {
        let (lag_us, measuring) = (lag_us.clone(), measuring.clone());
        tokio::spawn(async move {
            loop {
                let t = Instant::now();
                tokio::time::sleep(Duration::from_millis(10)).await;
                let late = t.elapsed().saturating_sub(Duration::from_millis(10));
                if measuring.load(Ordering::Relaxed) {
                    lag_us.fetch_max(
                        u64::try_from(late.as_micros()).unwrap_or(u64::MAX),
                        Ordering::Relaxed,
                    );
                }
            }
        })
    };

    // The window.
    let cpu0: Vec<f64> = pids.iter().map(|p| cpu_of(*p)).collect();
    let (etcd0, gen0) = (cpu_of(etcd_pid), self_cpu());
    let rev0 = etcd_revision(&etcd.url).await;
    let w0 = Instant::now();
    measuring.store(true, Ordering::Relaxed);
    let mut stalest = Duration::ZERO;
    while w0.elapsed() < Duration::from_secs(seconds) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = Instant::now();
        let worst = nodes
            .iter()
            .map(|s| s.lock().unwrap().last_ok.map_or(Duration::MAX, |t| now.duration_since(t)))
            .max()
            .unwrap_or_default();
        stalest = stalest.max(worst);
    }
    measuring.store(false, Ordering::Relaxed);
    let wall = w0.elapsed().as_secs_f64();
    let cpus: Vec<f64> = pids.iter().zip(&cpu0).map(|(p, c0)| (cpu_of(*p) - c0) / wall).collect();
    let etcd_cpu = (cpu_of(etcd_pid) - etcd0) / wall;
    let commits = (etcd_revision(&etcd.url).await - rev0) as f64 / wall;
    let gen_cpu = (self_cpu() - gen0) / wall;
    let rss = rss_mib(pids[0]);
    // Let the answers in flight land before reading the counters.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    sync_task.abort();
    admit_task.abort();
    lag_task.abort();

    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let mut sl = stats.sync_lat.lock().unwrap().clone();
    sl.sort();
    let mut al = stats.admit_lat.lock().unwrap().clone();
    al.sort();
    let coord_cpu: Vec<String> = cpus.iter().map(|c| format!("{c:.2}")).collect();
    let line = format!(
        "| {n} | {} | {}/{} ({} failed, {} later than 1 s) | {} / {} / {} | {}/{} ({} failed; {} admitted, {} refused, {} reclaiming) | {} / {} / {} | {} | {} | {etcd_cpu:.2} | {commits:.0} | {gen_cpu:.2} | {:.1} | {rss:.0} | {:.1} |",
        if followers > 0 { format!("1 + {followers} followers") } else { "1".into() },
        load(&stats.syncs_ok),
        load(&stats.syncs_due),
        load(&stats.syncs_failed),
        load(&stats.syncs_late),
        ms(pct(&sl, 0.5)),
        ms(pct(&sl, 0.99)),
        ms(sl.last().copied().unwrap_or_default()),
        load(&stats.admits_ok),
        load(&stats.admits_due),
        load(&stats.admits_failed),
        load(&stats.admitted),
        load(&stats.refused),
        load(&stats.reclaiming),
        ms(pct(&al, 0.5)),
        ms(pct(&al, 0.99)),
        ms(al.last().copied().unwrap_or_default()),
        if stalest == Duration::MAX { "never".to_string() } else { ms(stalest) },
        coord_cpu.join(" + "),
        lag_us.load(Ordering::Relaxed) as f64 / 1000.0,
        warm.as_secs_f64(),
    );
    drop(coords);
    Outcome { line }
}

fn main() {
    let nodes: Vec<usize> = env_list("TESSERA_BENCH_NODES", "100,500,2000,6250")
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
    let seconds = env_num("TESSERA_BENCH_SECONDS", 60);
    let admits = env_num("TESSERA_BENCH_ADMITS", 50);
    let connections = env_num("TESSERA_BENCH_CONNECTIONS", 64) as usize;
    let followers = env_num("TESSERA_BENCH_FOLLOWERS", 0) as usize;
    let bin = std::env::var("TESSERA_BENCH_COORDINATOR")
        .unwrap_or_else(|_| env!("CARGO_BIN_EXE_tessera-coordinator").to_string());
    let max_n = nodes.iter().copied().max().unwrap_or(0);

    let dir = tempfile::tempdir().unwrap();
    coordinator::signing::write_signing_key(&dir.path().join("key"), &common::key()).unwrap();
    let node_tokens: Vec<String> =
        (0..max_n).map(|i| format!(r#""{}": "{}""#, node_name(i), token(i))).collect();
    let mut f = std::fs::File::create(dir.path().join("tokens.json")).unwrap();
    write!(f, r#"{{"admins": {{"bench": "{ADMIN}"}}, "nodes": {{{}}}}}"#, node_tokens.join(", "))
        .unwrap();
    drop(f);
    let etcd = common::Etcd::start().expect("etcd");
    let etcd_pid = etcd_pid(&etcd.url);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "quota_fleet bench: {cpus} cpus; coordinator {bin}; {admits} admits/s; {seconds} s window; {connections} connections; etcd pid {etcd_pid}"
    );
    println!("| nodes | coordinators | syncs answered / due | sync ms p50 / p99 / max | admits answered / due | admit ms p50 / p99 / max | stalest node ms | coordinator CPU (cores) | etcd CPU | etcd writes/s | generator CPU | generator lag max ms | coordinator RSS MiB | warm-up s |");
    println!("|---:|---|---|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|");
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    for n in nodes {
        let o = rt.block_on(run_one(
            n,
            &bin,
            dir.path(),
            &etcd,
            etcd_pid,
            followers,
            seconds,
            admits,
            connections,
        ));
        println!("{}", o.line);
    }
}

/// etcd's revision now: it moves by one for every committed write transaction (the books'
/// journal's commits, policy and node records), not for lease keep-alives.
async fn etcd_revision(url: &str) -> i64 {
    let mut c = etcd_client::Client::connect([url], None).await.unwrap();
    let r = c.get("/", None).await.unwrap();
    r.header().map_or(0, |h| h.revision())
}

/// The pid of the etcd listening at `url` (the fixture keeps it to itself).
fn etcd_pid(url: &str) -> u32 {
    let port = url.rsplit(':').next().unwrap_or_default();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd);
        if cmd.starts_with("etcd") && cmd.contains(&format!("127.0.0.1:{port}")) {
            return pid;
        }
    }
    0
}
