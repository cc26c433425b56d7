//! Fleet quotas end to end: a real `tessera-coordinator` process on loopback with a SQLite
//! store and a signed policy with quotas, driven over HTTP with node and admin tokens:
//! admissions, syncs and releases, a reclaim, gangs assembling from two nodes and timing
//! out, the 503 while the books are rebuilt after a restart, the metrics.

// Integration-test crates: clippy counts their helper functions as non-test code, so
// `allow-unwrap-in-tests` (clippy.toml) does not reach them; a panic is the failure report.
#![allow(clippy::unwrap_used)]

#[path = "fleet/common.rs"]
mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_addr, raw, raw_async, ADMIN, NODE_A, NODE_B};
use coordinator::client::{Client, ClientError};
use fleet::quota_wire::{
    AdmitAnswer, AdmitRequest, Amounts, GangRef, Holding, QuotaClass, QuotaEventKind,
    ReleaseRequest, SyncRequest, MAX_SYNC_HOLDINGS,
};

const H100: &str = "H100-80GB";
const MICRO: u64 = 1_000_000;

/// A `tessera-coordinator serve` child on loopback; killed (by pid) when dropped.
struct Coord {
    child: Child,
    url: String,
    log: PathBuf,
}

impl Coord {
    fn start(dir: &Path, addr: SocketAddr, lease_ttl_s: u64) -> Coord {
        let key = dir.join("coordinator.key");
        if !key.exists() {
            coordinator::signing::write_signing_key(&key, &common::key()).expect("key file");
        }
        let tokens = dir.join("tokens.json");
        std::fs::write(
            &tokens,
            format!(
                r#"{{"admins": {{"alice": "{ADMIN}"}}, "nodes": {{"node-a": "{NODE_A}", "node-b": "{NODE_B}"}}}}"#
            ),
        )
        .expect("tokens");
        let log = dir.join(format!("coordinator-{}.log", addr.port()));
        let child = Command::new(env!("CARGO_BIN_EXE_tessera-coordinator"))
            .arg("serve")
            .args(["--listen", &addr.to_string()])
            .arg("--store")
            .arg(format!("sqlite:{}", dir.join("fleet.db").display()))
            .arg("--signing-key")
            .arg(&key)
            .arg("--tokens")
            .arg(&tokens)
            .args(["--usage-retention-days", "0"])
            .args(["--quota-lease-ttl-s", &lease_ttl_s.to_string()])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("spawn tessera-coordinator");
        let c = Coord { child, url: format!("http://{addr}"), log };
        let t0 = Instant::now();
        loop {
            if std::net::TcpStream::connect(addr).is_ok()
                && raw(&c.url, "GET", "/v1/ping", None, None).0 == 200
            {
                return c;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "the coordinator did not start: {}",
                c.log_text()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn stop(mut self) {
        self.kill();
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Coord {
    fn drop(&mut self) {
        self.kill();
    }
}

fn policy(version: u64, quotas: &str, gang_timeout_s: u64) -> Vec<u8> {
    format!(
        r#"{{"version": {version},
            "orgs": {{"acme": {{"trust": "trusted", "teams": {{"a": {{}}, "b": {{}}}}}}}},
            "default_tenant": "acme/a",
            "gangs": {{"timeout_s": {gang_timeout_s}}}{quotas}}}"#
    )
    .into_bytes()
}

const AB: &str = r#", "quotas": {"acme/a": {"gpus": {"H100-80GB": {"guarantee": 4}}},
                                  "acme/b": {"gpus": {"H100-80GB": {"guarantee": 4, "ceiling": 12}}}}"#;

fn gpus(n: u64) -> Amounts {
    Amounts { gpus: [(H100.to_string(), n * MICRO)].into(), ..Amounts::default() }
}

fn ask(container: &str, tenant: &str, n: u64) -> AdmitRequest {
    AdmitRequest {
        container_id: container.into(),
        tenant: tenant.into(),
        amounts: gpus(n),
        gang: None,
        short_on_node: false,
        checkpoint: false,
        workload: Some(format!("default/{container}/main")),
        unsynced_lease_grants: false,
    }
}

/// A node's side of the protocol, kept by hand: what it holds, its leases.
struct Node {
    name: &'static str,
    client: Client,
    holdings: Vec<Holding>,
    leases: Vec<fleet::quota_wire::Lease>,
}

impl Node {
    fn new(url: &str, name: &'static str, token: &str) -> Node {
        Node { name, client: Client::new(&[url], token).unwrap(), holdings: vec![], leases: vec![] }
    }

    async fn admit(&mut self, req: AdmitRequest) -> Result<AdmitAnswer, ClientError> {
        let a = self.client.quota_admit(self.name, &req, Duration::from_secs(30)).await?;
        if let AdmitAnswer::Admitted { class, .. } = &a {
            self.holdings.push(Holding {
                container_id: req.container_id.clone(),
                tenant: req.tenant.clone(),
                amounts: req.amounts.clone(),
                class: *class,
                started_ms: fleet::now_ms() + self.holdings.len() as u64,
                gang: req.gang.as_ref().map(|g| g.name.clone()),
                workload: req.workload.clone(),
                under_lease: false,
                checkpoint: req.checkpoint,
            });
        }
        Ok(a)
    }

    async fn sync(&mut self) -> fleet::quota_wire::SyncAnswer {
        let req = SyncRequest {
            capacity: gpus(8),
            holdings: self.holdings.clone(),
            leases: self.leases.clone(),
            stopping: vec![],
            last_authority: None,
        };
        let a = self.client.quota_sync(self.name, &req).await.unwrap();
        self.leases = a.leases.clone();
        a
    }
}

fn class(a: &AdmitAnswer) -> QuotaClass {
    match a {
        AdmitAnswer::Admitted { class, .. } => *class,
        other => panic!("expected an admission, got {other:?}"),
    }
}

fn api_status(e: &ClientError) -> u16 {
    e.status().unwrap_or_else(|| panic!("expected an HTTP answer, got {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admissions_syncs_releases_and_a_reclaim_over_http() {
    let dir = tempfile::tempdir().unwrap();
    let c = Coord::start(dir.path(), free_addr(), 300);
    let admin = Client::new(&[c.url.as_str()], ADMIN).unwrap();
    let mut a = Node::new(&c.url, "node-a", NODE_A);
    let mut b = Node::new(&c.url, "node-b", NODE_B);

    // No quotas in force: admitted, guaranteed, counted.
    admin.push_policy(&policy(1, "", 60), None).await.unwrap();
    assert_eq!(class(&a.admit(ask("free0", "acme/b", 2)).await.unwrap()), QuotaClass::Guaranteed);
    a.client
        .quota_release("node-a", &ReleaseRequest { container_id: "free0".into() })
        .await
        .unwrap();
    a.holdings.clear();

    admin.push_policy(&policy(2, AB, 60), None).await.unwrap();
    a.sync().await;
    b.sync().await;
    a.sync().await;
    b.sync().await;
    let st = admin.quota_status().await.unwrap();
    assert_eq!(st.policy_version, 2);
    assert!(st.books_ready);
    assert_eq!(st.nodes.keys().map(String::as_str).collect::<Vec<_>>(), ["node-a", "node-b"]);
    assert_eq!(st.capacity, gpus(16));

    // B fills node A (8) and 4 of node B: 4 guaranteed, 8 borrowed; the 13th crosses its
    // ceiling.
    // B's 3rd on node A is within its guarantee, which node B's lease holds: the lease is
    // recalled ("retry after 3 s", no victim), and the retry after both nodes synced twice
    // (the cut carried, then reported) is guaranteed.
    let mut recalls = 0;
    for i in 0..12 {
        let req = ask(&format!("b{i}"), "acme/b", 1);
        loop {
            let node = if i < 8 { &mut a } else { &mut b };
            match node.admit(req.clone()).await.unwrap() {
                AdmitAnswer::Reclaiming { victims, message, .. } if victims.is_empty() => {
                    assert!(message.contains("leases are recalled"), "{message}");
                    recalls += 1;
                    assert!(recalls < 5, "the leases were never recalled: {message}");
                    for _ in 0..2 {
                        a.sync().await;
                        b.sync().await;
                    }
                }
                AdmitAnswer::Admitted { .. } => break,
                other => panic!("b{i}: {other:?}"),
            }
        }
        if i < 8 {
            a.sync().await
        } else {
            b.sync().await
        };
    }
    assert_eq!(recalls, 1, "one recall of node B's lease of acme/b");
    let borrowed =
        a.holdings.iter().chain(&b.holdings).filter(|h| h.class == QuotaClass::Borrowed).count();
    assert_eq!(borrowed, 8);
    match b.admit(ask("b-more", "acme/b", 1)).await.unwrap() {
        AdmitAnswer::Refused { message, rule } => {
            assert_eq!(rule.as_deref(), Some("quotas.acme/b.gpus.H100-80GB.ceiling"), "{message}");
        }
        other => panic!("expected the ceiling, got {other:?}"),
    }

    // A asks on node A, full with B: B's youngest borrowed container there is reclaimed.
    let mut short = ask("a0", "acme/a", 1);
    short.short_on_node = true;
    let youngest = a
        .holdings
        .iter()
        .filter(|h| h.class == QuotaClass::Borrowed)
        .max_by_key(|h| h.started_ms)
        .unwrap()
        .container_id
        .clone();
    let AdmitAnswer::Reclaiming { retry_after_s, victims, message } =
        a.admit(short.clone()).await.unwrap()
    else {
        panic!("expected a reclaim")
    };
    assert_eq!(retry_after_s, 32, "{message}");
    assert_eq!(victims.len(), 1);
    assert_eq!(
        (victims[0].node.as_str(), victims[0].container_id.as_str(), victims[0].tenant.as_str()),
        ("node-a", youngest.as_str(), "acme/b")
    );
    assert!(message.starts_with("reclaiming: stopping 1 borrowed container of acme/b on node node-a (grace 30 s) to return acme/a its guarantee"), "{message}");
    let answer = a.sync().await;
    assert_eq!(answer.preempt, victims, "the node is told to stop it");
    assert_eq!(admin.quota_status().await.unwrap().preempting, victims);
    a.holdings.retain(|h| h.container_id != youngest);
    assert!(a.sync().await.preempt.is_empty());
    short.short_on_node = false;
    assert_eq!(class(&a.admit(short).await.unwrap()), QuotaClass::Guaranteed);
    a.sync().await;

    // A release takes the grant out at once.
    a.client.quota_release("node-a", &ReleaseRequest { container_id: "a0".into() }).await.unwrap();
    a.holdings.retain(|h| h.container_id != "a0");
    let st = admin.quota_status().await.unwrap();
    let row = st.paths.iter().find(|p| p.path == "acme/a").unwrap();
    assert_eq!(row.in_use, 0);
    let row = st.paths.iter().find(|p| p.path == "acme/b").unwrap();
    assert_eq!(
        (row.in_use, row.borrowed, row.guarantee, row.ceiling),
        (11 * MICRO, 7 * MICRO, Some(4 * MICRO), Some(12 * MICRO))
    );

    let events = admin.quota_events().await.unwrap();
    for k in [
        QuotaEventKind::Borrow,
        QuotaEventKind::Reclaim,
        QuotaEventKind::Preempt,
        QuotaEventKind::Refuse,
    ] {
        assert!(events.iter().any(|e| e.kind == k), "{k:?} in {events:?}");
    }
    let pre = events.iter().find(|e| e.kind == QuotaEventKind::Preempt).unwrap();
    assert!(
        pre.reason.contains("reclaimed for acme/a") && pre.reason.contains("SIGKILL after 30 s"),
        "{}",
        pre.reason
    );

    // Metrics: gauges per quota path and resource, counters.
    let (code, text) = raw_async(&c.url, "GET", "/metrics", Some(ADMIN), None).await;
    assert_eq!(code, 200, "{text}");
    for line in [
        "tessera_quota_guarantee{path=\"acme/a\",resource=\"gpus.H100-80GB\"} 4",
        "tessera_quota_ceiling{path=\"acme/b\",resource=\"gpus.H100-80GB\"} 12",
        "tessera_quota_in_use{path=\"acme/b\",resource=\"gpus.H100-80GB\"} 11",
        "tessera_quota_borrowed{path=\"acme/b\",resource=\"gpus.H100-80GB\"} 7",
        "tessera_quota_reclaims_total{path=\"acme/a\"} 1",
        "tessera_quota_preemptions_total{path=\"acme/b\"} 1",
        "tessera_quota_books_ready 1",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
    }
    for g in ["lent", "leased", "waiting", "dominant_share"] {
        assert!(text.contains(&format!("# TYPE tessera_quota_{g} gauge")), "{g}");
    }

    // Who may do what.
    let req = serde_json::to_vec(&ask("x", "acme/a", 1)).unwrap();
    assert_eq!(
        raw_async(&c.url, "POST", "/v1/nodes/node-a/quota/admit", Some(NODE_B), Some(req.clone()))
            .await
            .0,
        403
    );
    assert_eq!(
        raw_async(&c.url, "POST", "/v1/nodes/node-a/quota/admit", Some(ADMIN), Some(req.clone()))
            .await
            .0,
        403
    );
    assert_eq!(
        raw_async(&c.url, "POST", "/v1/nodes/node-a/quota/admit", None, Some(req)).await.0,
        401
    );
    assert_eq!(raw_async(&c.url, "GET", "/v1/quota/status", Some(NODE_A), None).await.0, 403);
    assert_eq!(raw_async(&c.url, "GET", "/metrics", Some(NODE_A), None).await.0, 403);
    // What is refused before the books see it.
    let e = a
        .client
        .quota_admit("node-a", &ask("x", "acme/nope", 1), Duration::from_secs(5))
        .await
        .unwrap_err();
    assert_eq!(api_status(&e), 400);
    assert!(e.to_string().contains("no tenant acme/nope in policy version 2"), "{e}");
    let e = a
        .client
        .quota_admit("node-a", &ask("../x", "acme/a", 1), Duration::from_secs(5))
        .await
        .unwrap_err();
    assert!(api_status(&e) == 400 && e.to_string().contains("is not a container id"), "{e}");
    let mut huge = ask("x", "acme/a", 1);
    huge.amounts = gpus(5_000);
    let e = a.client.quota_admit("node-a", &huge, Duration::from_secs(5)).await.unwrap_err();
    assert!(api_status(&e) == 400 && e.to_string().contains("at most 1024 GPUs"), "{e}");
    let mut odd = ask("x", "acme/a", 1);
    odd.amounts.gpus = [("B999".to_string(), MICRO)].into();
    let e = a.client.quota_admit("node-a", &odd, Duration::from_secs(5)).await.unwrap_err();
    assert!(e.to_string().contains("unknown GPU model B999"), "{e}");
    let mut bad_gang = ask("x", "acme/a", 1);
    bad_gang.gang = Some(GangRef { name: "a/b".into(), size: 2 });
    let e = a.client.quota_admit("node-a", &bad_gang, Duration::from_secs(5)).await.unwrap_err();
    assert!(e.to_string().contains("gang name"), "{e}");
    let h = a.holdings[0].clone();
    let too_many = SyncRequest {
        capacity: gpus(8),
        holdings: vec![h; MAX_SYNC_HOLDINGS + 1],
        leases: vec![],
        stopping: vec![],
        last_authority: None,
    };
    let e = a.client.quota_sync("node-a", &too_many).await.unwrap_err();
    assert_eq!(api_status(&e), 413, "{e}");
    let twice = SyncRequest {
        capacity: gpus(8),
        holdings: vec![a.holdings[0].clone(), a.holdings[0].clone()],
        leases: vec![],
        stopping: vec![],
        last_authority: None,
    };
    let e = a.client.quota_sync("node-a", &twice).await.unwrap_err();
    assert!(e.to_string().contains("listed twice"), "{e}");
    c.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gang_of_four_from_two_nodes_assembles_and_a_gang_short_of_members_times_out() {
    let dir = tempfile::tempdir().unwrap();
    let c = Coord::start(dir.path(), free_addr(), 300);
    let admin = Client::new(&[c.url.as_str()], ADMIN).unwrap();
    admin.push_policy(&policy(1, AB, 2), None).await.unwrap();
    let mut a = Node::new(&c.url, "node-a", NODE_A);
    let mut b = Node::new(&c.url, "node-b", NODE_B);
    a.sync().await;
    b.sync().await;

    // Four members, two from each node, each on its own thread: none is answered before
    // the last arrives, then all are admitted.
    let member = |i: usize| {
        let (node, token) =
            if i.is_multiple_of(2) { ("node-a", NODE_A) } else { ("node-b", NODE_B) };
        let url = c.url.clone();
        std::thread::spawn(move || {
            let client = Client::new(&[url.as_str()], token).unwrap();
            let mut req = ask(&format!("m{i}"), "acme/b", 1);
            req.gang = Some(GangRef { name: "train".into(), size: 4 });
            let t0 = Instant::now();
            let a = fleet::client::blocking::block_on(client.quota_admit(
                node,
                &req,
                Duration::from_secs(30),
            ));
            (a, Instant::now(), t0)
        })
    };
    let first: Vec<_> = (0..3).map(member).collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        first.iter().all(|h| !h.is_finished()),
        "no member is answered before the gang is complete"
    );
    let last_sent = Instant::now();
    let last = member(3);
    for h in first.into_iter().chain([last]) {
        let (answer, at, _) = h.join().unwrap();
        let answer = answer.unwrap();
        assert!(matches!(answer, AdmitAnswer::Admitted { .. }), "{answer:?}");
        assert!(at >= last_sent, "answered only once the last member came");
    }

    // A gang of 3 of which 2 arrive: both are refused after gangs.timeout_s (2 s).
    let t0 = Instant::now();
    let waiting: Vec<_> = (0..2)
        .map(|i| {
            let url = c.url.clone();
            std::thread::spawn(move || {
                let client = Client::new(&[url.as_str()], NODE_A).unwrap();
                let mut req = ask(&format!("s{i}"), "acme/a", 1);
                req.gang = Some(GangRef { name: "short".into(), size: 3 });
                fleet::client::blocking::block_on(client.quota_admit(
                    "node-a",
                    &req,
                    Duration::from_secs(30),
                ))
            })
        })
        .collect();
    for h in waiting {
        match h.join().unwrap().unwrap() {
            AdmitAnswer::Refused { message, rule } => {
                assert_eq!(rule.as_deref(), Some("gangs.timeout_s"));
                assert!(
                    message.starts_with(
                        "gang acme/a/short: 2 of 3 members arrived within 2 s (gangs.timeout_s)"
                    ),
                    "{message}"
                );
            }
            other => panic!("expected the gang's timeout, got {other:?}"),
        }
    }
    let took = t0.elapsed();
    assert!(took >= Duration::from_secs(2) && took < Duration::from_secs(10), "{took:?}");
    let st = admin.quota_status().await.unwrap();
    let row = st.paths.iter().find(|p| p.path == "acme/a").unwrap();
    assert_eq!(row.in_use, 0, "the reservation is released");
    let events = admin.quota_events().await.unwrap();
    assert!(events.iter().any(|e| e.kind == QuotaEventKind::GangAdmitted
        && e.reason.starts_with("gang acme/b/train: all 4 members admitted on 2 nodes")));
    assert!(events.iter().any(|e| e.kind == QuotaEventKind::GangTimeout));
    c.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restart_admissions_wait_until_every_known_node_has_synced() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_addr();
    let c = Coord::start(dir.path(), addr, 60);
    let admin = Client::new(&[c.url.as_str()], ADMIN).unwrap();
    admin.push_policy(&policy(1, AB, 60), None).await.unwrap();
    // Both nodes report (their records are in the store) and sync.
    let report = br#"{"applied_version": 1, "source": "coordinator", "health": "ok"}"#.to_vec();
    for (node, token) in [("node-a", NODE_A), ("node-b", NODE_B)] {
        let (code, body) = raw_async(
            &c.url,
            "POST",
            &format!("/v1/nodes/{node}/report"),
            Some(token),
            Some(report.clone()),
        )
        .await;
        assert_eq!(code, 200, "{body}");
    }
    let mut a = Node::new(&c.url, "node-a", NODE_A);
    let mut b = Node::new(&c.url, "node-b", NODE_B);
    a.sync().await;
    b.sync().await;
    a.sync().await;
    b.sync().await;
    assert_eq!(class(&b.admit(ask("b0", "acme/b", 1)).await.unwrap()), QuotaClass::Guaranteed);
    b.sync().await;
    let leases_a = a.leases.clone();
    assert_eq!(leases_a.len(), 2, "{leases_a:?}");

    c.stop();
    let c = Coord::start(dir.path(), addr, 60);
    let admin = Client::new(&[c.url.as_str()], ADMIN).unwrap();
    a.client = Client::new(&[c.url.as_str()], NODE_A).unwrap();
    b.client = Client::new(&[c.url.as_str()], NODE_B).unwrap();
    let answer = a.sync().await;
    assert_eq!(answer.leases, leases_a, "node A's leases are adopted as they were");
    assert_eq!(answer.lease_ttl_s, 60);
    let e = a.admit(ask("a0", "acme/a", 1)).await.unwrap_err();
    assert_eq!(api_status(&e), 503, "{e}");
    assert!(e.to_string().contains("the coordinator is rebuilding its quota books: 1 of 2 nodes have synced (waiting for node-b)"), "{e}");
    let st = admin.quota_status().await.unwrap();
    assert!(!st.books_ready);
    b.sync().await;
    assert_eq!(class(&a.admit(ask("a0", "acme/a", 1)).await.unwrap()), QuotaClass::Guaranteed);
    let st = admin.quota_status().await.unwrap();
    assert!(st.books_ready);
    let row = st.paths.iter().find(|p| p.path == "acme/b").unwrap();
    assert_eq!(row.in_use, MICRO, "rebuilt from node B's sync");
    c.stop();
}
