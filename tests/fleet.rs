//! Issue 7 end to end, with real processes on loopback: etcd, `tessera-coordinator`
//! (one or two, on one etcd), and tesserad nodes on simulated H100 nodes following them.
//!
//! * a push reaches both nodes; forged, unsigned and older revisions are refused by the
//!   nodes with the reason in their status and logs;
//! * with the coordinator down nodes keep enforcing, a restarted tesserad starts from its
//!   last-known-good copy, and the nodes catch up when the coordinator returns;
//! * two coordinators on one etcd: either can stop and pushes still reach the nodes;
//! * a node credential cannot push;
//! * usage uploads retried after a lost answer count once, and `tessera usage
//!   --coordinator` rolls up the fleet.
//!
//! Forged and unsigned revisions are written straight into etcd (a compromised store:
//! the real coordinator then serves them); the older one is a genuine, correctly signed
//! earlier revision replayed by an in-test proxy between a node and the coordinator (a
//! network attacker). The same proxy loses the answer of a usage upload.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;
use tessera_api::{
    AllocateRequest, Allocation, ApiError, CoordinatorStatus, ErrorCode, NodeStatus, RequestSource,
    StartRequest,
};
use tessera_harness::fleet_fixture::{
    coordinator_bin, http, node_token, tessera, Coordinator, FleetFixture, ADMIN_TOKEN as ADMIN,
    WITHIN,
};
use tessera_harness::node::{free_port, repo, Node, NS};
use tessera_harness::*;

const NODE_A: &str = "sim-h100-a";
const NODE_B: &str = "sim-h100-b";

// ---------------------------------------------------------------------------------------
// The fleet: the harness's fixture (keys, credentials, etcd, coordinators), plus the
// policies and forgeries these tests need
// ---------------------------------------------------------------------------------------

/// The harness's fleet with nodes A and B, and this file's policies.
struct Fleet(FleetFixture);

impl std::ops::Deref for Fleet {
    type Target = FleetFixture;
    fn deref(&self) -> &FleetFixture {
        &self.0
    }
}

impl Fleet {
    /// Coordinator, etcd and keys on loopback; fails (never skips) without etcd.
    fn start() -> Option<Fleet> {
        Some(Fleet(FleetFixture::launch(&[NODE_A, NODE_B])))
    }

    /// A coordinator on `addr` over this fleet's etcd.
    fn coordinator(&self, name: &str, addr: SocketAddr) -> Coordinator {
        self.0.coordinator(name, addr, &[])
    }

    /// A policy file: the example policy at `version`; `untrusted_gpu: false` takes whole
    /// GPUs away from the untrusted tier (MIG only), which decisions show.
    fn policy(&self, version: u64, untrusted_gpu: bool) -> PathBuf {
        let path = self.path(&format!("policy-v{version}-{untrusted_gpu}.json"));
        std::fs::write(&path, policy_bytes(version, untrusted_gpu)).expect("policy file");
        path
    }

    /// Sign `version` with the coordinator's own key (for revisions the coordinator
    /// never served).
    fn sign(&self, version: u64, untrusted_gpu: bool) -> fleet::SignedPolicy {
        let key = fleet::signing::load_signing_key(&self.key_file).expect("signing key");
        fleet::signing::sign(&key, &policy_bytes(version, untrusted_gpu), "alice", fleet::now_ms())
            .expect("sign")
    }

    /// The id of the key nodes pin.
    fn key_id(&self) -> String {
        fleet::signing::key_id(
            &fleet::signing::load_verifying_key(&self.public_key).expect("public key"),
        )
    }

    /// Write `env` into etcd as the latest revision, as someone with write access to the
    /// store (not the coordinator) could.
    fn inject(&self, env: &fleet::SignedPolicy) {
        let json = serde_json::to_vec(env).expect("envelope json");
        etcd_put(&self.etcd_url, &format!("/tessera-test/policy/rev/{:020}", env.version), &json);
        etcd_put(&self.etcd_url, "/tessera-test/policy/latest", env.version.to_string().as_bytes());
    }

    /// A tesserad on a simulated H100 node named `name`, following `coordinators`.
    fn node(&self, name: &str, coordinators: &str) -> Node {
        self.node_with(name, coordinators, &[])
    }

    fn node_with(&self, name: &str, coordinators: &str, extra: &[&str]) -> Node {
        // The bootstrap policy: version 1, untrusted may have whole GPUs.
        self.0.node(name, coordinators, &self.policy(1, true), extra)
    }

    fn push(&self, coordinators: &str, version: u64, untrusted_gpu: bool) {
        self.push_file(coordinators, &self.policy(version, untrusted_gpu), version);
    }
}

fn policy_bytes(version: u64, untrusted_gpu: bool) -> Vec<u8> {
    let mut p: Value = serde_json::from_slice(
        &std::fs::read(repo("examples/policy.json")).expect("example policy"),
    )
    .expect("json");
    p["version"] = Value::from(version);
    if !untrusted_gpu {
        p["tiers"]["untrusted"]["allow"] = serde_json::json!(["mig"]);
    }
    serde_json::to_vec_pretty(&p).expect("policy json")
}

// ---------------------------------------------------------------------------------------
// HTTP by hand (etcd's JSON gateway) and the proxy
// ---------------------------------------------------------------------------------------

fn b64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for c in bytes.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// `etcdctl put` through etcd's JSON gateway.
fn etcd_put(etcd_url: &str, key: &str, value: &[u8]) {
    let body = serde_json::json!({"key": b64(key.as_bytes()), "value": b64(value)}).to_string();
    let answer = http(etcd_url, "POST", "/v3/kv/put", None, Some(body.as_bytes()));
    assert!(answer.as_ref().is_some_and(|(s, _)| *s == 200), "etcd put {key}: {answer:?}");
}

/// What the proxy does besides forwarding.
#[derive(Default)]
struct ProxyState {
    /// Answer every long poll with these bytes instead of asking the coordinator.
    replay: Mutex<Option<Vec<u8>>>,
    /// Forward this many usage uploads, then drop the connection instead of answering.
    lose_usage_answers: AtomicUsize,
    usage_posts: AtomicUsize,
    lost: AtomicUsize,
    stop: AtomicBool,
}

/// A TCP proxy in front of one coordinator (one request per connection).
struct Proxy {
    url: String,
    addr: SocketAddr,
    state: Arc<ProxyState>,
    accept: Option<std::thread::JoinHandle<()>>,
}

impl Proxy {
    fn start(upstream: &str) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind proxy");
        let addr = listener.local_addr().expect("addr");
        let state = Arc::new(ProxyState::default());
        let upstream = upstream.trim_start_matches("http://").to_string();
        let st = state.clone();
        let accept = std::thread::spawn(move || {
            for conn in listener.incoming() {
                if st.stop.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let (st, upstream) = (st.clone(), upstream.clone());
                std::thread::spawn(move || {
                    let _ = proxy_one(conn, &upstream, &st);
                });
            }
        });
        Proxy { url: format!("http://{addr}"), addr, state, accept: Some(accept) }
    }

    fn replay(&self, body: Option<Vec<u8>>) {
        *self.state.replay.lock().expect("lock") = body;
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
    }
}

fn proxy_one(client: TcpStream, upstream: &str, st: &ProxyState) -> std::io::Result<()> {
    client.set_read_timeout(Some(Duration::from_secs(60)))?;
    let mut reader = BufReader::new(client.try_clone()?);
    let mut head = Vec::new();
    let mut content_length = 0usize;
    let mut first = String::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        if first.is_empty() {
            first = line.clone();
            head.push(line);
            continue;
        }
        if line == "\r\n" {
            break;
        }
        let lower = line.to_ascii_lowercase();
        if let Some(v) = lower.strip_prefix("content-length:") {
            content_length = v.trim().parse().unwrap_or(0);
        }
        if !lower.starts_with("connection:") {
            head.push(line);
        }
    }
    let mut body = vec![0u8; content_length];
    reader.read_exact(&mut body)?;
    let mut parts = first.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let mut client = client;
    if method == "GET" && path.starts_with("/v1/policies/latest") {
        if let Some(bytes) = st.replay.lock().expect("lock").clone() {
            write!(client, "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n", bytes.len())?;
            client.write_all(&bytes)?;
            return Ok(());
        }
    }
    let mut up = TcpStream::connect(upstream)?;
    up.set_read_timeout(Some(Duration::from_secs(60)))?;
    for h in &head {
        up.write_all(h.as_bytes())?;
    }
    up.write_all(b"connection: close\r\n\r\n")?;
    up.write_all(&body)?;
    let mut answer = Vec::new();
    up.read_to_end(&mut answer)?;
    if method == "POST" && path.starts_with("/v1/nodes/") && path.ends_with("/usage") {
        st.usage_posts.fetch_add(1, Ordering::SeqCst);
        let lose = st
            .lose_usage_answers
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if lose {
            // The coordinator stored the batch; the node never hears so.
            st.lost.fetch_add(1, Ordering::SeqCst);
            let _ = client.shutdown(std::net::Shutdown::Both);
            return Ok(());
        }
    }
    client.write_all(&answer)
}

// ---------------------------------------------------------------------------------------
// Nodes: status, decisions, the CLI
// ---------------------------------------------------------------------------------------

fn status(node: &Node) -> NodeStatus {
    node.client().status().expect("tesserad status")
}

fn fleet_of(s: &NodeStatus) -> &CoordinatorStatus {
    s.policy.coordinator.as_ref().expect("the status shows the coordinator")
}

/// Wait until the node's status satisfies `f`; on timeout, panic with it and the log.
fn wait_node(node: &Node, what: &str, f: impl Fn(&NodeStatus) -> bool) -> NodeStatus {
    let t0 = Instant::now();
    loop {
        if let Ok(s) = node.client().status() {
            if f(&s) {
                return s;
            }
            if t0.elapsed() > WITHIN {
                panic!(
                    "node {} never reached `{what}`: {:#?}\n{}",
                    s.node,
                    s.policy,
                    node.daemon.stderr()
                );
            }
        } else if t0.elapsed() > WITHIN {
            panic!("node never answered while waiting for `{what}`:\n{}", node.daemon.stderr());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn at_version(node: &Node, version: u64, source: &str) -> NodeStatus {
    // The agent records the version as applied just after the node swapped it in.
    wait_node(node, &format!("policy version {version} from {source}"), |s| {
        s.policy.version == version
            && s.policy.source == source
            && s.policy.coordinator.as_ref().is_some_and(|c| c.applied_version == Some(version))
    })
}

fn alloc_req(id: &str, ns: &str, request: &str) -> AllocateRequest {
    alloc_req_in(id, ns, request, &format!("/b/{id}"))
}

fn alloc_req_in(id: &str, ns: &str, request: &str, bundle: &str) -> AllocateRequest {
    AllocateRequest {
        container_id: id.parse().expect("a valid container id"),
        runc_root: "/nonexistent".into(),
        bundle: bundle.into(),
        request: request.parse().expect("a well-formed request"),
        request_source: RequestSource::Annotation,
        annotations: [(NS.to_string(), ns.to_string())].into_iter().collect(),
        limits: None,
    }
}

/// Ask the node for a grant and give it back: the decision the policy in force makes.
fn decide(node: &Node, id: &str, ns: &str, request: &str) -> Result<Allocation, ApiError> {
    let c = node.client();
    match c.allocate(&alloc_req(id, ns, request)) {
        Ok(a) => {
            c.release(id).expect("release");
            Ok(a)
        }
        Err(e) => Err(e.api_error().cloned().unwrap_or_else(|| panic!("allocate {id}: {e}"))),
    }
}

/// The version-2 rule: the untrusted tier gets MIG only.
fn assert_untrusted_gpu_refused(node: &Node, id: &str) {
    let e =
        decide(node, id, "team-untrusted", "gpu=1").expect_err("whole GPU for the untrusted tier");
    assert_eq!(e.code, ErrorCode::Refused, "{e:?}");
    decide(node, &format!("{id}-t"), "team-trusted", "gpu=1")
        .expect("the trusted tier still gets a GPU");
}

/// A granted, running allocation, and its "container" (a stand-in init: the grant lasts
/// while it lives).
fn hold(node: &Node, id: &str, ns: &str, request: &str) -> (Allocation, FakeContainer) {
    let c = node.client();
    let init = node.fx.fake_container(id);
    c.allocate(&alloc_req_in(id, ns, request, &init.bundle_str())).expect("allocate");
    let a = c
        .start(id, &StartRequest { pid: init.pid, bundle: init.bundle_str(), created: false })
        .expect("start");
    (a, init)
}

fn lkg_source(node: &Node) -> String {
    format!("last-known-good:{}", node.state.join("fleet/last-known-good.json").display())
}

/// Wait until `tessera nodes` shows what `f` wants (reports reach the coordinator
/// shortly after the node's own status changes).
fn wait_nodes_table(fleet: &Fleet, url: &str, what: &str, f: impl Fn(&str) -> bool) -> String {
    let t0 = Instant::now();
    loop {
        let out = fleet.admin(url, &["nodes"]);
        out.assert_success("tessera nodes");
        let table = out.stdout_str();
        if f(&table) {
            return table;
        }
        assert!(t0.elapsed() < WITHIN, "`tessera nodes` never showed {what}:\n{table}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The row of `node` in a `tessera nodes` table, split on whitespace.
fn row<'a>(table: &'a str, node: &str) -> Vec<&'a str> {
    table
        .lines()
        .find(|l| l.starts_with(node))
        .map(|l| l.split_whitespace().collect())
        .unwrap_or_default()
}

// ---------------------------------------------------------------------------------------
// The acceptance tests
// ---------------------------------------------------------------------------------------

#[test]
fn a_push_reaches_both_nodes_and_forged_unsigned_and_older_revisions_are_refused() {
    let Some(fleet) = Fleet::start() else { return };
    let c = fleet.coordinator("coordinator", SocketAddr::from(([127, 0, 0, 1], free_port())));
    // Each node reaches the coordinator through a proxy that can replay old answers.
    let (pa, pb) = (Proxy::start(&c.url), Proxy::start(&c.url));
    let a = fleet.node(NODE_A, &pa.url);
    let b = fleet.node(NODE_B, &pb.url);
    let bootstrap = format!("file:{}", fleet.policy(1, true).display());
    for (n, p) in [(&a, &pa), (&b, &pb)] {
        let s = wait_node(n, "connected on the bootstrap policy", |s| {
            fleet_of(s).connected && s.policy.version == 1
        });
        assert_eq!(s.policy.source, bootstrap);
        assert_eq!(fleet_of(&s).current.as_deref(), Some(p.url.as_str()));
    }
    // Under version 1 the untrusted tier may hold a whole GPU: one does, and keeps it.
    let (held, _held_init) = hold(&a, "held-u", "team-untrusted", "gpu=1");

    // A push reaches both nodes.
    let t0 = Instant::now();
    fleet.push(&c.url, 2, false);
    let sa = at_version(&a, 2, &format!("coordinator:{}", pa.url));
    at_version(&b, 2, &format!("coordinator:{}", pb.url));
    eprintln!("version 2 reached both nodes {:?} after the push command started", t0.elapsed());
    assert_eq!(fleet_of(&sa).health, "ok");
    assert_eq!(fleet_of(&sa).applied_version, Some(2));
    // `tessera status --json` says which version and where it came from.
    let out = a.cli(&["status", "--json"]);
    out.assert_success("tessera status --json");
    let json: Value = serde_json::from_str(&out.stdout_str()).expect("status json");
    assert_eq!(json["policy"]["version"], 2);
    assert_eq!(json["policy"]["source"], format!("coordinator:{}", pa.url));
    assert_eq!(json["policy"]["coordinator"]["health"], "ok");
    // New decisions use version 2; the running allocation keeps its grant.
    for n in [&a, &b] {
        assert_untrusted_gpu_refused(n, "v2-check");
    }
    let still = a.client().allocation("held-u").expect("the grant made under version 1 survives");
    assert_eq!((still.devices, still.state), (held.devices, tessera_api::AllocationState::Running));
    assert!(
        a.state.join("fleet/last-known-good.json").exists(),
        "version 2 kept as last-known-good"
    );

    // Forged: signed by another key that claims the pinned key's id, written into etcd.
    let evil = fleet::signing::parse_signing_key(&"66".repeat(32), "evil key").expect("key");
    let mut forged =
        fleet::signing::sign(&evil, &policy_bytes(3, true), "mallory", fleet::now_ms())
            .expect("sign");
    forged.key_id = fleet.key_id();
    fleet.inject(&forged);
    for n in [&a, &b] {
        let s = wait_node(n, "forged version 3 refused", |s| {
            fleet_of(s)
                .last_rejection
                .as_ref()
                .is_some_and(|r| r.kind == "forged" && r.version == 3)
        });
        assert_eq!(s.policy.version, 2, "still enforcing version 2");
        let f = fleet_of(&s);
        assert_eq!(f.health, "degraded", "a refused newer revision is a problem: {f:?}");
        let r = f.last_rejection.as_ref().expect("rejection");
        assert!(r.reason.contains("signature does not verify"), "{r:?}");
        let text = n.cli(&["status"]).stdout_str();
        assert!(text.contains("refused policy version 3 (forged)"), "{text}");
        let log = n.daemon.stderr();
        assert!(log.contains("refused policy revision") && log.contains("forged"), "{log}");
        assert_untrusted_gpu_refused(n, "forged-check");
    }

    // Unsigned: a genuine revision with its signature stripped.
    let mut unsigned = fleet.sign(4, true);
    unsigned.signature.clear();
    fleet.inject(&unsigned);
    for n in [&a, &b] {
        let s = wait_node(n, "unsigned version 4 refused", |s| {
            fleet_of(s)
                .last_rejection
                .as_ref()
                .is_some_and(|r| r.kind == "unsigned" && r.version == 4)
        });
        assert_eq!(s.policy.version, 2);
        assert!(fleet_of(&s).rejections >= 2);
        assert!(n.daemon.stderr().contains("unsigned policy"), "{}", n.daemon.stderr());
        assert_untrusted_gpu_refused(n, "unsigned-check");
    }

    // The coordinator hears about the refusals too.
    wait_nodes_table(&fleet, &c.url, "both nodes degraded by the unsigned version 4", |t| {
        [NODE_A, NODE_B].iter().all(|n| {
            let line = t.lines().find(|l| l.starts_with(n)).unwrap_or("");
            line.contains("degraded") && line.contains("version 4") && line.contains("unsigned")
        })
    });

    // A genuine newer push is taken at once.
    fleet.push(&c.url, 5, true);
    for (n, p) in [(&a, &pa), (&b, &pb)] {
        let s = at_version(n, 5, &format!("coordinator:{}", p.url));
        wait_node(n, "healthy on version 5", |s| fleet_of(s).health == "ok");
        decide(n, "v5-check", "team-untrusted", "gpu=1")
            .expect("version 5 gives the untrusted tier GPUs again");
        assert_eq!(fleet_of(&s).applied_version, Some(5));
    }

    // Older: the genuine, correctly signed version 2 replayed to both nodes.
    let old = fleet::client::blocking::get(&c.url, ADMIN, 2).expect("version 2");
    let replay = serde_json::to_vec(&old).expect("json");
    pa.replay(Some(replay.clone()));
    pb.replay(Some(replay));
    for n in [&a, &b] {
        let s = wait_node(n, "older version 2 refused", |s| {
            fleet_of(s).last_rejection.as_ref().is_some_and(|r| r.kind == "older" && r.version == 2)
        });
        assert_eq!(s.policy.version, 5, "a replayed older revision changes nothing");
        let r = fleet_of(&s).last_rejection.clone().expect("rejection");
        assert!(r.reason.contains("older or equal version"), "{r:?}");
        assert!(n.daemon.stderr().contains("older or equal version"), "{}", n.daemon.stderr());
        decide(n, "older-check", "team-untrusted", "gpu=1").expect("still version 5");
    }
    pa.replay(None);
    pb.replay(None);

    // The operator's view of the fleet.
    let table = wait_nodes_table(&fleet, &c.url, "both nodes on version 5", |t| {
        [NODE_A, NODE_B].iter().all(|n| row(t, n).get(1..3) == Some(&["5", "coordinator"][..]))
    });
    assert!(table.starts_with("NODE"), "{table}");
    assert!(table.lines().skip(1).all(|l| l.contains("s ago")), "{table}");
    let json = fleet.admin(&c.url, &["nodes", "--json"]);
    json.assert_success("tessera nodes --json");
    let nodes: serde_json::Value = serde_json::from_str(&json.stdout_str()).expect("nodes json");
    let text = nodes.to_string();
    assert!(text.contains(NODE_A) && text.contains(NODE_B), "{text}");
    let history = fleet.admin(&c.url, &["policy", "history"]);
    history.assert_success("tessera policy history");
    let text = history.stdout_str();
    let versions: Vec<String> = text
        .lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
        .map(String::from)
        .collect();
    assert_eq!(versions, ["5", "4", "3", "2"], "{text}");
    assert!(
        text.contains("mallory"),
        "the injected revisions show who claims to have written them: {text}"
    );
    let diff = fleet.admin(&c.url, &["policy", "diff", "2", "5"]);
    diff.assert_success("tessera policy diff");
    let d = diff.stdout_str();
    assert!(d.starts_with("--- version 2\n+++ version 5\n"), "{d}");
    assert!(
        d.contains("-  \"version\": 2")
            && d.contains("+  \"version\": 5")
            && d.contains("+        \"gpu\","),
        "{d}"
    );
    drop((a, b));
}

#[test]
fn without_the_coordinator_nodes_keep_enforcing_restart_from_last_known_good_and_catch_up() {
    let Some(fleet) = Fleet::start() else { return };
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let mut c = fleet.coordinator("coordinator", addr);
    let mut a = fleet.node(NODE_A, &c.url);
    let b = fleet.node(NODE_B, &c.url);
    fleet.push(&c.url, 2, false);
    let from_c = format!("coordinator:{}", c.url);
    at_version(&a, 2, &from_c);
    at_version(&b, 2, &from_c);

    // The coordinator crashes: both nodes keep enforcing version 2 and say they are cut off.
    c.kill9();
    for n in [&a, &b] {
        let s = wait_node(n, "disconnected", |s| !fleet_of(s).connected);
        let f = fleet_of(&s);
        assert_eq!((s.policy.version, f.health.as_str()), (2, "degraded"));
        assert!(f.last_error.as_deref().is_some_and(|e| e.contains(&c.url)), "{f:?}");
        assert_untrusted_gpu_refused(n, "down-check");
    }

    // tesserad restarts while the coordinator is down: it starts from last-known-good,
    // not from its (older, more permissive) bootstrap file.
    a.daemon.terminate(Duration::from_secs(10));
    a.restart();
    let s = status(&a);
    assert_eq!((s.policy.version, s.policy.source.clone()), (2, lkg_source(&a)));
    assert!(!fleet_of(&s).connected);
    assert_untrusted_gpu_refused(&a, "lkg-check");
    assert!(
        a.daemon.stderr().contains("starting from the last-known-good policy"),
        "{}",
        a.daemon.stderr()
    );

    // Version 3 is pushed through another coordinator the nodes do not know (same etcd)...
    let mut other =
        fleet.coordinator("coordinator-other", SocketAddr::from(([127, 0, 0, 1], free_port())));
    fleet.push(&other.url, 3, true);
    other.stop();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(status(&a).policy.version, 2);
    assert_eq!(status(&b).policy.version, 2);

    // ... and when their coordinator returns, both catch up.
    c.restart();
    for n in [&a, &b] {
        at_version(n, 3, &from_c);
        let s = wait_node(n, "healthy", |s| fleet_of(s).health == "ok" && fleet_of(s).connected);
        assert_eq!(fleet_of(&s).applied_version, Some(3));
        decide(n, "caught-up", "team-untrusted", "gpu=1").expect("version 3 is in force");
    }
    drop((a, b));
}

#[test]
fn two_coordinators_on_one_etcd_either_can_stop_and_pushes_still_reach_the_nodes() {
    let Some(fleet) = Fleet::start() else { return };
    let mut c1 =
        fleet.coordinator("coordinator-1", SocketAddr::from(([127, 0, 0, 1], free_port())));
    let mut c2 =
        fleet.coordinator("coordinator-2", SocketAddr::from(([127, 0, 0, 1], free_port())));
    let both = format!("{},{}", c1.url, c2.url);
    let a = fleet.node(NODE_A, &both);
    let b = fleet.node(NODE_B, &both);
    fleet.push(&c1.url, 2, false);
    for n in [&a, &b] {
        at_version(n, 2, &format!("coordinator:{}", c1.url));
    }

    // Coordinator 1 crashes: the nodes move to 2; a push through 2 reaches them (the CLI,
    // given both URLs, fails over too).
    c1.kill9();
    fleet.push(&both, 3, true);
    for n in [&a, &b] {
        at_version(n, 3, &format!("coordinator:{}", c2.url));
    }

    // 1 comes back, 2 stops cleanly: pushes through 1 reach the nodes.
    c1.restart();
    c2.stop();
    fleet.push(&c1.url, 4, false);
    for n in [&a, &b] {
        let s = at_version(n, 4, &format!("coordinator:{}", c1.url));
        assert_eq!(fleet_of(&s).current.as_deref(), Some(c1.url.as_str()));
        assert_untrusted_gpu_refused(n, "v4-check");
    }
    wait_nodes_table(&fleet, &c1.url, "both nodes on version 4 and ok", |t| {
        [NODE_A, NODE_B].iter().all(|n| {
            let r = row(t, n);
            r.get(1) == Some(&"4") && r.get(3) == Some(&"ok")
        })
    });
    drop((a, b));
}

#[test]
fn a_node_credential_cannot_push_or_read_the_fleet() {
    let Some(fleet) = Fleet::start() else { return };
    let c = fleet.coordinator("coordinator", SocketAddr::from(([127, 0, 0, 1], free_port())));
    fleet.push(&c.url, 2, true);
    let file = fleet.policy(3, true);
    let out = tessera(&[
        "policy",
        "push",
        &file.display().to_string(),
        "--coordinator",
        &c.url,
        "--token",
        &node_token(NODE_A),
    ]);
    out.assert_failure("a push with a node token");
    let err = out.stderr_str();
    assert!(
        err.contains("403") && err.contains("admin credential") && err.contains(NODE_A),
        "{err}"
    );
    let out = tessera(&["nodes", "--coordinator", &c.url, "--token", &node_token(NODE_B)]);
    out.assert_failure("tessera nodes with a node token");
    assert!(out.stderr_str().contains("403"), "{}", out.stderr_str());
    let out = tessera(&[
        "policy",
        "push",
        &file.display().to_string(),
        "--coordinator",
        &c.url,
        "--token",
        "not-a-token-0123456789",
    ]);
    out.assert_failure("a push with an unknown token");
    assert!(out.stderr_str().contains("401"), "{}", out.stderr_str());

    // Nothing was stored; the refusals are logged and kept for admins.
    let revs = fleet::client::blocking::history(&c.url, ADMIN).expect("history");
    assert_eq!(revs.iter().map(|r| r.version).collect::<Vec<_>>(), [2]);
    let refusals = fleet::client::blocking::refusals(&c.url, ADMIN).expect("refusals");
    assert!(
        refusals.iter().any(|r| r.who == format!("node:{NODE_A}")
            && r.action == "push a policy"
            && r.status == 403),
        "{refusals:#?}"
    );
    assert!(c.proc.stderr().contains("request refused"), "{}", c.proc.stderr());
}

/// Closed intervals: `n` containers of `ms` each on a whole GPU.
fn run_containers(node: &Node, prefix: &str, n: usize, ms: u64) {
    for i in 0..n {
        let id = format!("{prefix}{i}");
        let (_, init) = hold(node, &id, "team-trusted", "gpu=1");
        std::thread::sleep(Duration::from_millis(ms));
        drop(init); // the container is gone: its release is granted
        node.client().release(&id).expect("release");
    }
}

fn local_usage(node: &Node) -> Value {
    let out = node.cli(&["usage", "--from", "-1h", "--to", "now", "--by", "team", "--json"]);
    out.assert_success("tessera usage");
    serde_json::from_str(&out.stdout_str()).expect("usage json")
}

/// Wait until the ledger's intervals 1..=`seq` (all closed) are uploaded.
fn all_uploaded(node: &Node, seq: u64) -> NodeStatus {
    wait_node(node, &format!("closed intervals up to seq {seq} uploaded"), |s| {
        fleet_of(s).usage.as_ref().is_some_and(|u| {
            u.uploaded_through_seq == seq && u.pending == 0 && u.last_error.is_none()
        })
    })
}

#[test]
fn usage_uploads_retried_after_a_lost_answer_count_once_and_roll_up_across_the_fleet() {
    let Some(fleet) = Fleet::start() else { return };
    let c = fleet.coordinator("coordinator", SocketAddr::from(([127, 0, 0, 1], free_port())));
    fleet.push(&c.url, 2, true);
    // Node A's first usage upload is stored by the coordinator but its answer is lost.
    let proxy = Proxy::start(&c.url);
    proxy.state.lose_usage_answers.store(1, Ordering::SeqCst);
    let mut a = fleet.node(NODE_A, &proxy.url);
    let b = fleet.node(NODE_B, &c.url);
    at_version(&a, 2, &format!("coordinator:{}", proxy.url));
    at_version(&b, 2, &format!("coordinator:{}", c.url));

    run_containers(&a, "a", 3, 300);
    run_containers(&b, "b", 2, 400);
    let sa = all_uploaded(&a, 3);
    all_uploaded(&b, 2);
    assert_eq!(proxy.state.lost.load(Ordering::SeqCst), 1, "one answer was lost");
    assert!(proxy.state.usage_posts.load(Ordering::SeqCst) >= 2, "the batch was sent again");
    let u = fleet_of(&sa).usage.clone().expect("usage status");
    assert!(u.duplicates >= 1, "the retry found the batch already stored: {u:?}");
    assert!(a.daemon.stderr().contains("usage upload got no answer"), "{}", a.daemon.stderr());

    // A restart resends nothing twice (the high-water mark is on disk) and more usage
    // after it is uploaded as well.
    a.daemon.terminate(Duration::from_secs(10));
    a.restart();
    let after_restart = status(&a);
    assert_eq!(
        fleet_of(&after_restart).usage.as_ref().map(|u| u.uploaded_through_seq),
        Some(3),
        "the mark was kept"
    );
    run_containers(&a, "a2-", 2, 300);
    let sa = all_uploaded(&a, 5);
    let u = fleet_of(&sa).usage.clone().expect("usage status");
    assert_eq!(
        (u.accepted, u.duplicates),
        (2, 0),
        "after the restart only the new intervals were sent: {u:?}"
    );

    // Fleet roll-up == the sum of the nodes' own reports, each interval counted once.
    let (la, lb) = (local_usage(&a), local_usage(&b));
    let out =
        fleet.admin(&c.url, &["usage", "--from", "-1h", "--to", "now", "--by", "team", "--json"]);
    out.assert_success("tessera usage --coordinator");
    let f: Value = serde_json::from_str(&out.stdout_str()).expect("fleet usage json");
    let secs = |v: &Value| v["total"]["gpu_seconds"].as_f64().expect("gpu_seconds");
    let intervals = |v: &Value| v["total"]["intervals"].as_u64().expect("intervals");
    assert_eq!(intervals(&la), 5);
    assert_eq!(intervals(&lb), 2);
    assert_eq!(intervals(&f["report"]), 7, "{f:#}");
    assert!(
        (secs(&f["report"]) - (secs(&la) + secs(&lb))).abs() < 1e-6,
        "fleet {f:#}\nA {la:#}\nB {lb:#}"
    );
    let cost = |v: &Value| v["total"]["cost"].as_f64().expect("cost");
    assert!(
        cost(&f["report"]) > 0.0 && (cost(&f["report"]) - (cost(&la) + cost(&lb))).abs() < 1e-9,
        "{f:#}"
    );
    let per_node: Vec<(String, u64)> = f["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .map(|n| {
            (
                n["node"].as_str().expect("node").to_string(),
                n["intervals"].as_u64().expect("intervals"),
            )
        })
        .collect();
    assert_eq!(per_node, [(NODE_A.to_string(), 5), (NODE_B.to_string(), 2)]);
    // The table form says the same.
    let table = fleet.admin(&c.url, &["usage", "--from", "-1h", "--by", "org"]).stdout_str();
    assert!(table.contains("TOTAL") && table.contains(NODE_A) && table.contains(NODE_B), "{table}");
    drop((a, b));
}

#[test]
fn a_node_refuses_a_tampered_last_known_good_and_starts_from_a_good_one_with_no_coordinator() {
    let Some(fleet) = Fleet::start() else { return };
    let dead = format!("http://127.0.0.1:{}", free_port());
    let mut a = fleet.node(NODE_A, &dead);
    let s = status(&a);
    assert_eq!(s.policy.source, format!("file:{}", fleet.policy(1, true).display()));
    assert!(!fleet_of(&s).connected);
    let lkg = a.state.join("fleet/last-known-good.json");

    // A genuine version 7 on disk, unreachable coordinator: tesserad starts from it.
    a.daemon.terminate(Duration::from_secs(10));
    std::fs::create_dir_all(lkg.parent().expect("dir")).expect("mkdir");
    let good = fleet.sign(7, false);
    std::fs::write(&lkg, serde_json::to_vec(&good).expect("json")).expect("write lkg");
    a.restart();
    let s = status(&a);
    assert_eq!((s.policy.version, s.policy.source.clone()), (7, lkg_source(&a)));
    assert_untrusted_gpu_refused(&a, "lkg7");

    // Edited on disk: refused, and the daemon does not start (fail closed).
    a.daemon.terminate(Duration::from_secs(10));
    let mut tampered = good.clone();
    tampered.policy_b64 = b64(&policy_bytes(7, true));
    std::fs::write(&lkg, serde_json::to_vec(&tampered).expect("json")).expect("write lkg");
    a.daemon.restart();
    let exit = a.daemon.wait_exit(WITHIN);
    assert!(exit.is_some_and(|e| !e.success()), "tesserad must refuse a tampered last-known-good");
    let log = a.daemon.stderr();
    assert!(log.contains("tampered") && log.contains(&lkg.display().to_string()), "{log}");

    // Signed by another key: refused too.
    let evil = fleet::signing::parse_signing_key(&"66".repeat(32), "evil key").expect("key");
    let other = fleet::signing::sign(&evil, &policy_bytes(8, true), "mallory", 1).expect("sign");
    std::fs::write(&lkg, serde_json::to_vec(&other).expect("json")).expect("write lkg");
    a.daemon.restart();
    assert!(a.daemon.wait_exit(WITHIN).is_some_and(|e| !e.success()));
    assert!(a.daemon.stderr().contains("pinned"), "{}", a.daemon.stderr());
}

#[test]
fn tesserad_fleet_flags_are_checked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let node = format!("sim:{}", repo("examples/nodes/h100x8.json").display());
    let state = dir.path().join("state").display().to_string();
    let sock = dir.path().join("s.sock").display().to_string();
    // RFC 8032's first test public key.
    let key = "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a";
    let token = dir.path().join("token");
    std::fs::write(&token, "node-token-sim-h100-0-0123456789\n").expect("token");
    let base = ["--node", &node, "--state-dir", &state, "--socket", &sock];
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec![], "--policy"),
        (vec!["--coordinator", "http://127.0.0.1:1"], "--trust-key"),
        (vec!["--trust-key", key], "--coordinator"),
        (vec!["--coordinator", "http://127.0.0.1:1", "--trust-key", "abcd"], "trust-key"),
        (vec!["--coordinator", "http://127.0.0.1:1", "--trust-key", key], "TESSERA_NODE_TOKEN"),
        (
            vec![
                "--coordinator",
                "http://127.0.0.1:1",
                "--trust-key",
                key,
                "--node-token",
                "/nonexistent/token",
            ],
            "/nonexistent/token",
        ),
        (
            vec![
                "--coordinator",
                "http://127.0.0.1:1",
                "--trust-key",
                key,
                "--node-token",
                token.to_str().expect("utf-8"),
                "--node-id",
                "other",
            ],
            "differs from this node's name",
        ),
        (
            vec![
                "--coordinator",
                "http://127.0.0.1:1",
                "--trust-key",
                key,
                "--node-token",
                token.to_str().expect("utf-8"),
            ],
            "no policy to start from",
        ),
        // https:// without a CA, and http:// with one (the token would go out in clear):
        // refused at start, before anything is contacted.
        (
            vec![
                "--coordinator",
                "https://127.0.0.1:1",
                "--trust-key",
                key,
                "--node-token",
                token.to_str().expect("utf-8"),
            ],
            "no --coordinator-ca",
        ),
        (
            vec![
                "--coordinator",
                "https://127.0.0.1:1,http://127.0.0.1:2",
                "--trust-key",
                key,
                "--node-token",
                token.to_str().expect("utf-8"),
                "--coordinator-ca",
                "/nonexistent/ca.pem",
            ],
            "clear text",
        ),
        (
            vec![
                "--coordinator",
                "http://127.0.0.1:1",
                "--trust-key",
                key,
                "--node-token",
                token.to_str().expect("utf-8"),
                "--policy-overrides-fleet",
            ],
            "--policy",
        ),
    ];
    for (extra, needle) in cases {
        let out = run_cmd(
            Command::new(tesserad()).args(base).args(&extra).env_remove("TESSERA_NODE_TOKEN"),
        );
        out.assert_failure(&format!("tesserad {extra:?}"));
        assert!(
            out.stderr_str().contains(needle),
            "{extra:?}: expected {needle:?} in\n{}",
            out.stderr_str()
        );
    }
}

/// A CA and a certificate for 127.0.0.1 signed by it (PEM files in `dir`): (ca, cert, key).
fn test_pki(dir: &std::path::Path) -> (PathBuf, PathBuf, PathBuf) {
    let ca_key = rcgen::KeyPair::generate().expect("key");
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).expect("ca");
    let key = rcgen::KeyPair::generate().expect("key");
    let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])
        .expect("params")
        .signed_by(&key, &ca, &ca_key)
        .expect("cert");
    let paths = (dir.join("ca.pem"), dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&paths.0, ca.pem()).expect("write");
    std::fs::write(&paths.1, cert.pem()).expect("write");
    std::fs::write(&paths.2, key.serialize_pem()).expect("write");
    paths
}

#[test]
fn an_https_coordinator_reaches_nodes_and_admins_that_hold_its_ca() {
    let Some(fleet) = Fleet::start() else { return };
    let (ca, cert, key) = test_pki(fleet.dir.path());
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let args = [
        "serve".to_string(),
        "--listen".into(),
        addr.to_string(),
        "--store".into(),
        format!("sqlite:{}", fleet.path("tls-coordinator.db").display()),
        "--signing-key".into(),
        fleet.key_file.display().to_string(),
        "--tokens".into(),
        fleet.tokens_file.display().to_string(),
        "--tls-cert".into(),
        cert.display().to_string(),
        "--tls-key".into(),
        key.display().to_string(),
    ];
    let proc = ChildProcess::spawn(
        "tls-coordinator",
        coordinator_bin(),
        args,
        [("TESSERA_LOG", "info")],
        &fleet.log_dir(),
    );
    let url = format!("https://{addr}");
    let ca_arg = ca.display().to_string();
    let up = wait_for(
        || fleet.admin(&url, &["policy", "history", "--coordinator-ca", &ca_arg]).status.success(),
        WITHIN,
    );
    assert!(up, "the https coordinator did not come up:\n{}", proc.stderr());

    // The admin CLI pushes over https with the CA, and is refused without it.
    let file = fleet.policy(1, true).display().to_string();
    let out = fleet.admin(&url, &["policy", "push", &file]);
    out.assert_failure("push to https without a CA");
    assert!(out.stderr_str().contains("--coordinator-ca"), "{}", out.stderr_str());
    fleet
        .admin(&url, &["policy", "push", &file, "--coordinator-ca", &ca_arg])
        .assert_success("push over https");

    // A node given the CA (started from its policy file, version 1) follows the
    // coordinator over https: the next push reaches it.
    let node = fleet.node_with(NODE_A, &url, &["--coordinator-ca", &ca_arg]);
    let file2 = fleet.policy(2, false).display().to_string();
    fleet
        .admin(&url, &["policy", "push", &file2, "--coordinator-ca", &ca_arg])
        .assert_success("push v2");
    at_version(&node, 2, &format!("coordinator:{url}"));
    assert!(fleet_of(&status(&node)).connected);
    drop(node);
    drop(proc);
}
