//! Shared fixtures: keys, tokens, policies, coordinators on loopback, a real etcd
//! process, a raw HTTP client for requests the typed clients would never send.

#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use coordinator::server::Coordinator;
use coordinator::{AgentConfig, AgentStatus, PolicyAgent, RunningCoordinator, Tokens};
use ed25519_dalek::SigningKey;

pub const ADMIN: &str = "admin-token-alice-0123456789";
pub const NODE_A: &str = "node-token-aaaaaaaaaaaaaaaa";
pub const NODE_B: &str = "node-token-bbbbbbbbbbbbbbbb";

pub fn tokens() -> Tokens {
    Tokens::parse(&format!(
        r#"{{"admins": {{"alice": "{ADMIN}"}}, "nodes": {{"node-a": "{NODE_A}", "node-b": "{NODE_B}"}}}}"#
    ))
    .expect("tokens")
}

pub fn key() -> SigningKey {
    SigningKey::from_bytes(&[42; 32])
}

pub fn evil_key() -> SigningKey {
    SigningKey::from_bytes(&[66; 32])
}

/// A valid policy of `version`; `trust` varies the content.
pub fn policy_with(version: u64, trust: &str) -> Vec<u8> {
    format!(
        r#"{{"version": {version}, "orgs": {{"acme": {{"trust": "{trust}", "teams": {{"ml": {{}}}}}}}}, "default_tenant": "acme/ml"}}"#
    )
    .into_bytes()
}

pub fn policy(version: u64) -> Vec<u8> {
    policy_with(version, "trusted")
}

pub async fn start_sqlite(db: &Path) -> RunningCoordinator {
    start_sqlite_on(db, "127.0.0.1:0".parse().expect("addr")).await
}

pub async fn start_sqlite_on(db: &Path, addr: SocketAddr) -> RunningCoordinator {
    let store = Arc::new(coordinator::store::SqliteStore::open(db).expect("sqlite store"));
    RunningCoordinator::start(addr, Coordinator::new(store, key(), tokens())).await.expect("start")
}

pub async fn start_etcd_coordinator(
    etcd: &Etcd,
    prefix: &str,
    addr: SocketAddr,
) -> RunningCoordinator {
    let store = Arc::new(
        coordinator::store::EtcdStore::connect(std::slice::from_ref(&etcd.url), prefix)
            .await
            .expect("etcd store"),
    );
    RunningCoordinator::start(addr, Coordinator::new(store, key(), tokens())).await.expect("start")
}

pub fn admin(url: &str) -> coordinator::client::Client {
    coordinator::client::Client::new(&[url], ADMIN).expect("client")
}

/// The node's own key (deterministic per node name, as a test fixture).
pub fn node_signer(node: &str) -> coordinator::signing::Signer {
    let b = node.bytes().fold(17u8, |acc, c| acc.wrapping_mul(31).wrapping_add(c));
    coordinator::signing::Signer::new(SigningKey::from_bytes(&[b; 32]))
}

/// Pin node-a's and node-b's keys at the coordinator at `url`, as the operator would.
pub async fn register_keys(url: &str) {
    for node in ["node-a", "node-b"] {
        let public = coordinator::signing::encode_verifying_key(&node_signer(node).verifying_key());
        admin(url).register_node_key(node, &public, false).await.expect("register node key");
    }
}

/// An agent config with test timings (short polls, quick retries) and the node's key.
pub fn agent_config(urls: Vec<String>, node: &str, token: &str, lkg: PathBuf) -> AgentConfig {
    let mut cfg = AgentConfig::new(urls, node, token, key().verifying_key(), lkg);
    cfg.node_key = Some(node_signer(node));
    cfg.poll_timeout = Duration::from_secs(5);
    cfg.report_every = Duration::from_secs(1);
    cfg.retry_min = Duration::from_millis(50);
    cfg.retry_max = Duration::from_millis(300);
    cfg.reject_delay = Duration::from_millis(50);
    cfg.reject_hold = Duration::from_secs(2);
    cfg
}

/// A running agent: what it applied (in order) and its status.
pub struct RunningAgent {
    pub applied: Arc<Mutex<Vec<u64>>>,
    pub status: Arc<Mutex<AgentStatus>>,
    pub task: tokio::task::JoinHandle<()>,
}

impl RunningAgent {
    pub fn start(agent: PolicyAgent, initial: AgentStatus) -> RunningAgent {
        let applied = Arc::new(Mutex::new(Vec::new()));
        let status = Arc::new(Mutex::new(initial));
        let sink = applied.clone();
        let task = tokio::spawn(agent.run(
            move |v| {
                sink.lock().expect("lock").push(v.version);
                Ok(())
            },
            status.clone(),
        ));
        RunningAgent { applied, status, task }
    }

    pub fn status(&self) -> AgentStatus {
        self.status.lock().expect("lock").clone()
    }

    pub fn applied_version(&self) -> Option<u64> {
        self.status().applied_version
    }

    /// Wait until the status satisfies `f` (panics with the status after `within`).
    pub async fn wait_for(
        &self,
        what: &str,
        within: Duration,
        f: impl Fn(&AgentStatus) -> bool,
    ) -> Duration {
        let t0 = Instant::now();
        loop {
            let s = self.status();
            if f(&s) {
                return t0.elapsed();
            }
            if t0.elapsed() > within {
                panic!("agent never reached `{what}` within {within:?}: {s:#?}");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Drop for RunningAgent {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Wait until `f` holds (async condition).
pub async fn eventually<F, Fut>(what: &str, within: Duration, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let t0 = Instant::now();
    while !f().await {
        assert!(t0.elapsed() < within, "never happened within {within:?}: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A free loopback port (bound and released; fine for tests).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

pub fn free_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

/// One raw HTTP/1.1 request (blocking; `Connection: close`), for the auth matrix.
pub fn raw(
    url: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&[u8]>,
) -> (u16, String) {
    let authority = url.trim_start_matches("http://");
    let mut s = TcpStream::connect(authority).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    let body = body.unwrap_or(b"");
    let mut req = format!("{method} {path} HTTP/1.1\r\nhost: {authority}\r\nconnection: close\r\ncontent-length: {}\r\n", body.len());
    if let Some(t) = token {
        req.push_str(&format!("authorization: Bearer {t}\r\n"));
    }
    if !body.is_empty() {
        req.push_str("content-type: application/json\r\n");
    }
    req.push_str("\r\n");
    // Head and body in one write: a server that answers from the head alone (a refused
    // token) may close before reading the body, and its answer is still there to read.
    let mut request = req.into_bytes();
    request.extend_from_slice(body);
    match s.write_all(&request) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        r => r.expect("write request"),
    }
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).expect("read");
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").expect("http answer");
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).expect("status");
    let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        let mut out = String::new();
        let mut r = rest;
        while let Some((size, after)) = r.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 {
                break;
            }
            out.push_str(&after[..n]);
            r = &after[n + 2..];
        }
        out
    } else {
        rest.to_string()
    };
    (status, body)
}

/// [`raw`] off the async runtime.
pub async fn raw_async(
    url: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<Vec<u8>>,
) -> (u16, String) {
    let (url, method, path, token) =
        (url.to_string(), method.to_string(), path.to_string(), token.map(str::to_string));
    tokio::task::spawn_blocking(move || {
        raw(&url, &method, &path, token.as_deref(), body.as_deref())
    })
    .await
    .expect("raw request task")
}

/// A real etcd (Debian's etcd-server) on loopback ports with its own data dir; killed
/// by pid when dropped.
pub struct Etcd {
    child: Option<Child>,
    pub url: String,
    _dir: tempfile::TempDir,
}

impl Etcd {
    /// A real etcd on loopback ports; without etcd installed the test fails (it is never
    /// skipped: a test that passes without running is no test).
    pub fn start() -> Option<Etcd> {
        Etcd::start_with(&[])
    }

    /// [`Etcd::start`] with `extra` arguments (e.g. a shorter `--election-timeout`, which
    /// lowers the shortest lease etcd grants to 3/2 of it).
    pub fn start_with(extra: &[&str]) -> Option<Etcd> {
        let dir = tempfile::tempdir().expect("tempdir");
        let (client, peer) = (free_port(), free_port());
        let url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let log = std::fs::File::create(dir.path().join("etcd.log")).expect("log");
        let child = Command::new("etcd")
            .args(["--name", "t", "--data-dir"])
            .arg(dir.path().join("data"))
            .args(["--listen-client-urls", &url, "--advertise-client-urls", &url])
            .args(["--listen-peer-urls", &peer_url, "--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &format!("t={peer_url}"), "--initial-cluster-state", "new"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("etcd must be installed (Debian etcd-server)");
        let etcd = Etcd { child: Some(child), url, _dir: dir };
        let t0 = Instant::now();
        loop {
            if let Ok(mut s) = TcpStream::connect(("127.0.0.1", client)) {
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let _ =
                    s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
                let mut buf = String::new();
                let _ = s.read_to_string(&mut buf);
                if buf.contains("\"health\":\"true\"") {
                    return Some(etcd);
                }
            }
            assert!(t0.elapsed() < Duration::from_secs(20), "etcd did not become healthy");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A closed interval of `node` for fleet usage tests.
pub fn interval(
    node: &str,
    id: &str,
    tenant: &str,
    start_ms: u64,
    duration_ms: u64,
    fraction: f64,
) -> metering::ClosedInterval {
    metering::ClosedInterval {
        id: metering::IntervalId(id.to_string()),
        start: metering::IntervalStart {
            container_id: format!("c-{id}"),
            tenant: tenant.to_string(),
            node: node.to_string(),
            gpu_uuid: "GPU-0".into(),
            gpu_model: "H100-80GB".into(),
            device_uuid: "GPU-0".into(),
            isolation: tessera_api::Isolation::Gpu,
            mig_profile: None,
            fraction,
            class: metering::Class::Guaranteed,
            workload: None,
            nvlink_domain: None,
        },
        start_wall_ms: start_ms,
        end_wall_ms: start_ms + duration_ms,
        duration_ms,
        gpu_seconds: duration_ms as f64 / 1000.0 * fraction,
        reason: "poststop".into(),
        preempted: false,
        utilization: None,
        chain: None,
    }
}

/// The status of `GET path` without credentials, or `None` when nothing answers.
pub fn raw_try(url: &str, path: &str) -> Option<u16> {
    let authority = url.trim_start_matches("http://");
    let mut s = TcpStream::connect(authority).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nhost: {authority}\r\nconnection: close\r\n\r\n").ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    buf.split(' ').nth(1)?.parse().ok()
}

/// `batch` linked into ledger `ledger`'s chain after `after` (the last interval already
/// chained, or none: from the ledger's genesis), as the node's ledger would have done.
pub fn chained(
    mut batch: Vec<metering::ClosedInterval>,
    ledger: &str,
    after: Option<&metering::ClosedInterval>,
) -> Vec<metering::ClosedInterval> {
    let (mut seq, mut prev) = match after.and_then(|a| a.chain.as_ref()) {
        Some(l) => (l.seq, l.hash.clone()),
        None => (0, metering::chain::genesis(ledger)),
    };
    for i in &mut batch {
        seq += 1;
        let hash = i.expected_hash(&prev, seq);
        i.chain = Some(metering::ChainLink { seq, prev: prev.clone(), hash: hash.clone() });
        prev = hash;
    }
    batch
}
