//! Issue 28: the quota books shared by every coordinator on one etcd. Three real
//! `tessera-coordinator` processes on a real etcd (short election timeout: leases of 1 s),
//! two nodes played over HTTP, each speaking to other coordinators:
//!
//! * one coordinator decides; the others pass node calls on to it, so a ceiling holds
//!   whichever coordinator each node uses;
//! * `kill -9` of the one that decides during a reclaim's grace period, with admissions
//!   answered and not yet synced: another decides within 2 s, counts those admissions, and
//!   answers the claimant's retry with the same victim (no second one);
//! * a leader deposed by etcd (its lease revoked while it runs) stops deciding;
//! * an operator removes a node at once; a node silent past its lease's end leaves the
//!   books with an event;
//! * a write fenced by a leadership that is gone fails;
//! * a coordinator of other books (a second etcd prefix, a coordinator on SQLite) that
//!   decides for a node the elected one decides for warns of split brain: a log line, a
//!   `warnings` entry of the quota status, `tessera_quota_split_brain 1`.

// Integration-test crates: clippy counts their helper functions as non-test code, so
// `allow-unwrap-in-tests` (clippy.toml) does not reach them; a panic is the failure report.
#![allow(clippy::unwrap_used)]

#[path = "fleet/common.rs"]
mod common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{free_addr, Etcd, ADMIN, NODE_A, NODE_B};
use coordinator::client::{Client, ClientError};
use coordinator::store::{Fence, PolicyStore};
use fleet::quota_wire::{
    AdmitAnswer, AdmitRequest, Amounts, Holding, QuotaClass, QuotaEventKind, QuotaStatus,
    SyncRequest,
};

const H100: &str = "H100-80GB";
const MICRO: u64 = 1_000_000;
const PREFIX: &str = "/ha";

/// A `tessera-coordinator serve` child on etcd; killed (by pid) when dropped.
struct Coord {
    child: Child,
    url: String,
    log: PathBuf,
}

impl Coord {
    fn start(dir: &Path, etcd: &str, addr: SocketAddr) -> Coord {
        let store = [
            "--store".to_string(),
            format!("etcd:{etcd}"),
            "--etcd-prefix".to_string(),
            PREFIX.to_string(),
        ];
        Coord::start_on(dir, &store, addr)
    }

    /// On the store `store` names (`--store …` and its options).
    fn start_on(dir: &Path, store: &[String], addr: SocketAddr) -> Coord {
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
            .args(store)
            .arg("--signing-key")
            .arg(&key)
            .arg("--tokens")
            .arg(&tokens)
            .args(["--usage-retention-days", "0", "--etcd-compaction-retention-s", "0"])
            .args(["--quota-lease-ttl-s", "3", "--quota-leader-ttl-s", "1"])
            .env("TESSERA_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("spawn tessera-coordinator");
        let c = Coord { child, url: format!("http://{addr}"), log };
        let t0 = Instant::now();
        while common::raw_try(&c.url, "/v1/ping") != Some(200) {
            assert!(t0.elapsed() < Duration::from_secs(20), "did not start: {}", c.log_text());
            std::thread::sleep(Duration::from_millis(50));
        }
        c
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Coord {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// acme/a guarantees 4 GPUs; acme/b has a ceiling of 6 and no guarantee (all it runs is
/// borrowed); acme/c has no quota (it only borrows).
fn policy() -> Vec<u8> {
    br#"{"version": 1,
        "orgs": {"acme": {"trust": "trusted", "teams": {"a": {}, "b": {}, "c": {}}}},
        "default_tenant": "acme/a",
        "quotas": {"acme/a": {"gpus": {"H100-80GB": {"guarantee": 4}}},
                   "acme/b": {"gpus": {"H100-80GB": {"ceiling": 6}}, "grace_period_s": 60}}}"#
        .to_vec()
}

fn ask(container: &str, tenant: &str) -> AdmitRequest {
    AdmitRequest {
        container_id: container.into(),
        tenant: tenant.into(),
        amounts: Amounts { gpus: [(H100.to_string(), MICRO)].into(), ..Amounts::default() },
        gang: None,
        short_on_node: false,
        workload: None,
        unsynced_lease_grants: false,
        checkpoint: false,
    }
}

/// A node's side of the protocol: what it holds (granted at once when admitted).
struct Node {
    name: &'static str,
    client: Client,
    holdings: Vec<Holding>,
}

impl Node {
    fn new(urls: &[&str], name: &'static str, token: &str) -> Node {
        Node { name, client: Client::new(urls, token).unwrap(), holdings: vec![] }
    }

    async fn admit(&mut self, req: AdmitRequest) -> Result<AdmitAnswer, ClientError> {
        let a = self.client.quota_admit(self.name, &req, Duration::from_secs(10)).await?;
        if let AdmitAnswer::Admitted { class, .. } = &a {
            self.holdings.push(Holding {
                container_id: req.container_id.clone(),
                tenant: req.tenant.clone(),
                amounts: req.amounts.clone(),
                class: *class,
                started_ms: fleet::now_ms() + self.holdings.len() as u64,
                gang: None,
                workload: None,
                under_lease: false,
                checkpoint: false,
            });
        }
        Ok(a)
    }

    async fn sync(&mut self) -> fleet::quota_wire::SyncAnswer {
        let req = SyncRequest {
            capacity: Amounts {
                gpus: [(H100.to_string(), 8 * MICRO)].into(),
                ..Amounts::default()
            },
            holdings: self.holdings.clone(),
            leases: vec![],
            stopping: vec![],
            last_authority: None,
        };
        self.client.quota_sync(self.name, &req).await.unwrap()
    }
}

fn admitted(a: &AdmitAnswer) -> QuotaClass {
    match a {
        AdmitAnswer::Admitted { class, .. } => *class,
        other => panic!("expected an admission, got {other:?}"),
    }
}

fn ceiling_refused(a: &AdmitAnswer) {
    match a {
        AdmitAnswer::Refused { rule, .. } => {
            assert_eq!(rule.as_deref(), Some("quotas.acme/b.gpus.H100-80GB.ceiling"), "{a:?}")
        }
        other => panic!("expected acme/b's ceiling, got {other:?}"),
    }
}

async fn status(url: &str) -> Option<QuotaStatus> {
    Client::new(&[url], ADMIN).unwrap().quota_status().await.ok()
}

async fn wait_status(url: &str, what: &str, f: impl Fn(&QuotaStatus) -> bool) -> QuotaStatus {
    let t0 = Instant::now();
    loop {
        if let Some(s) = status(url).await {
            if f(&s) {
                return s;
            }
            assert!(t0.elapsed() < Duration::from_secs(20), "never {what}: {s:#?}");
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "no quota status from {url} ({what})");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn in_use(s: &QuotaStatus, path: &str) -> u64 {
    s.paths.iter().find(|p| p.path == path).map_or(0, |p| p.in_use) / MICRO
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_coordinators_decide_as_one_through_kill_deposition_and_removals() {
    let etcd = Etcd::start_with(&["--election-timeout", "500", "--heartbeat-interval", "50"])
        .expect("etcd");
    let dir = tempfile::tempdir().unwrap();
    let mut cs: Vec<Coord> =
        (0..3).map(|_| Coord::start(dir.path(), &etcd.url, free_addr())).collect();
    let urls: Vec<String> = cs.iter().map(|c| c.url.clone()).collect();
    let all: Vec<&str> = urls.iter().map(String::as_str).collect();
    Client::new(&all, ADMIN).unwrap().push_policy(&policy(), None).await.unwrap();

    // One decides, and every coordinator says which.
    let st = wait_status(&urls[0], "a coordinator deciding", |s| {
        s.authority.is_some() && s.coordinators.len() == 3
    })
    .await;
    let leader = st.authority.clone().unwrap();
    let li = urls.iter().position(|u| *u == leader.url).expect("the leader is one of the three");
    let (f1, f2) = ((li + 1) % 3, (li + 2) % 3);
    for u in &urls {
        let s =
            wait_status(u, "the same authority", |s| s.authority.as_ref() == Some(&leader)).await;
        assert_eq!(s.via.is_some(), *u != leader.url, "{u}: {s:#?}");
        assert_eq!(s.coordinators.iter().filter(|c| c.leader).count(), 1);
    }

    // Node A uses the leader first (then f1), node B only f2: split across coordinators.
    let mut a = Node::new(&[urls[li].as_str(), urls[f1].as_str()], "node-a", NODE_A);
    let mut b = Node::new(&[urls[f2].as_str()], "node-b", NODE_B);
    assert_eq!(a.sync().await.authority, Some(leader.clone()));
    assert_eq!(b.sync().await.authority, Some(leader.clone()), "passed on to the leader");

    // acme/b up to its ceiling of 6 from both nodes; a 7th is refused through either.
    for i in 1..=4 {
        admitted(&a.admit(ask(&format!("b{i}"), "acme/b")).await.unwrap());
    }
    for i in 5..=6 {
        admitted(&b.admit(ask(&format!("b{i}"), "acme/b")).await.unwrap());
    }
    ceiling_refused(&a.admit(ask("b7", "acme/b")).await.unwrap());
    ceiling_refused(&b.admit(ask("b8", "acme/b")).await.unwrap());
    // A resize (runc update) goes through the same books: b5 grown to 2 GPUs through the
    // follower node B uses would take acme/b to 7.
    let grow = fleet::quota_wire::ResizeRequest {
        container_id: "b5".into(),
        tenant: "acme/b".into(),
        amounts: Amounts { gpus: [(H100.to_string(), 2 * MICRO)].into(), ..Amounts::default() },
        unsynced_lease_grants: false,
    };
    ceiling_refused(
        &b.client.quota_resize("node-b", &grow, Duration::from_secs(10)).await.unwrap(),
    );
    a.sync().await;
    b.sync().await;

    // Admitted and not synced yet: A's a1 and C's three on node A, which is then full.
    assert_eq!(admitted(&a.admit(ask("a1", "acme/a")).await.unwrap()), QuotaClass::Guaranteed);
    for i in 1..=3 {
        assert_eq!(
            admitted(&a.admit(ask(&format!("c{i}"), "acme/c")).await.unwrap()),
            QuotaClass::Borrowed
        );
    }
    // A's next on node A must reclaim: one borrowed container of acme/b (grace 60 s).
    let mut claim = ask("a3", "acme/a");
    claim.short_on_node = true;
    let victims = match a.admit(claim.clone()).await.unwrap() {
        AdmitAnswer::Reclaiming { victims, .. } => victims,
        other => panic!("expected a reclaim, got {other:?}"),
    };
    assert_eq!(victims.len(), 1, "{victims:?}");
    assert_eq!((victims[0].node.as_str(), victims[0].tenant.as_str()), ("node-a", "acme/b"));

    // kill -9 of the coordinator that decides, during the victim's grace period.
    cs[li].kill9();
    let killed = Instant::now();
    // The first admission after it: node B asks (for work only a coordinator admits,
    // borrowed) until one does.
    let mut tries = 0;
    loop {
        tries += 1;
        match b.admit(ask("c4", "acme/c")).await {
            Ok(AdmitAnswer::Admitted { .. }) => break,
            Ok(other) => panic!("c4: {other:?}"),
            Err(e) => assert!(matches!(e.status(), Some(503) | None), "c4: {e}"),
        }
        assert!(killed.elapsed() < Duration::from_secs(10), "no admission after the kill");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let first_admission = killed.elapsed();
    eprintln!("first admission {first_admission:?} after kill -9 of the leader ({tries} tries)");
    if std::env::var("HA_DEBUG").is_ok() {
        for c in &cs {
            eprintln!(
                "==== {}
{}",
                c.url,
                c.log_text()
            );
        }
    }
    assert!(first_admission <= Duration::from_secs(2), "{first_admission:?}");

    // The new leader counts what the old one admitted and nobody has synced: a1, c1..c3.
    let st = status(&urls[f1]).await.unwrap();
    let new_leader = st.authority.clone().unwrap();
    assert_ne!(new_leader.url, leader.url);
    assert!(new_leader.term > leader.term, "{new_leader:?} after {leader:?}");
    assert_eq!(in_use(&st, "acme/a"), 2, "a1 (never synced), the GPU held for a3: {st:#?}");
    assert_eq!(in_use(&st, "acme/b"), 6);
    // Node A fails over to f1; the ceiling still holds through every coordinator.
    ceiling_refused(&a.admit(ask("b9", "acme/b")).await.unwrap());
    ceiling_refused(&b.admit(ask("b10", "acme/b")).await.unwrap());
    // The claimant's retry finds the same reclaim: the same victim, no second one.
    match a.admit(claim.clone()).await.unwrap() {
        AdmitAnswer::Reclaiming { victims: again, message, .. } => {
            assert_eq!(again, victims);
            assert!(message.contains("in progress"), "{message}");
        }
        other => panic!("expected the same reclaim, got {other:?}"),
    }
    let events = Client::new(&[urls[f1].as_str()], ADMIN).unwrap().quota_events().await.unwrap();
    assert!(
        events.iter().all(|e| e.kind != QuotaEventKind::Preempt),
        "the new leader chose no victim: {events:#?}"
    );
    a.sync().await;
    b.sync().await;

    // etcd deposes the leader while it runs (its lease revoked): it stops deciding, the
    // last coordinator takes over, and the books still hold.
    let mut raw = etcd_client::Client::connect([etcd.url.as_str()], None).await.unwrap();
    let opts = etcd_client::GetOptions::new()
        .with_prefix()
        .with_sort(etcd_client::SortTarget::Create, etcd_client::SortOrder::Ascend)
        .with_limit(1);
    let resp = raw.get(format!("{PREFIX}/quota/leader/"), Some(opts)).await.unwrap();
    let lease = resp.kvs()[0].lease();
    raw.lease_revoke(lease).await.unwrap();
    let deposed = new_leader.url.clone();
    let st = wait_status(&deposed, "another coordinator deciding", |s| {
        s.authority.as_ref().is_some_and(|x| x.term > new_leader.term) && s.via.is_some()
    })
    .await;
    let third = st.authority.clone().unwrap();
    assert_eq!(in_use(&st, "acme/b"), 6);
    assert_eq!(in_use(&st, "acme/a"), 2);
    ceiling_refused(&a.admit(ask("b11", "acme/b")).await.unwrap());
    let c = Client::new(&[deposed.as_str()], ADMIN).unwrap();

    // An operator removes node B at once (through any coordinator).
    let r = c.quota_remove_node("node-b").await.unwrap();
    assert_eq!((r.node.as_str(), r.holdings), ("node-b", 3), "b5, b6, c4: {r:?}");
    assert!(r.warning.is_some_and(|w| w.contains("synced")), "node B synced lately");
    let st = status(&third.url).await.unwrap();
    assert!(!st.nodes.contains_key("node-b"), "{:?}", st.nodes);
    assert_eq!(in_use(&st, "acme/b"), 4);
    let e = c.quota_remove_node("node-b").await.unwrap_err();
    assert_eq!(e.status(), Some(404), "{e}");

    // Node A goes silent: past its lease's end (3 s + 3 s margin) it leaves the books.
    let silent = Instant::now();
    let st = wait_status(&third.url, "node A removed", |s| !s.nodes.contains_key("node-a")).await;
    let took = silent.elapsed();
    assert!(took >= Duration::from_secs(5) && took < Duration::from_secs(12), "{took:?}");
    assert_eq!(in_use(&st, "acme/b"), 0);
    let events = Client::new(&[third.url.as_str()], ADMIN).unwrap().quota_events().await.unwrap();
    let removed: Vec<_> = events.iter().filter(|e| e.kind == QuotaEventKind::NodeRemoved).collect();
    assert_eq!(removed.len(), 2, "{removed:#?}");
    assert!(removed.iter().any(|e| e.reason.contains("removed by admin alice")));
    assert!(removed
        .iter()
        .any(|e| e.node.as_deref() == Some("node-a")
            && e.reason.contains("lease TTL 3 s + 3 s margin")));
    drop(cs);
}

/// Issue 27: the fair queue goes over to the next leader with the books. Two coordinators
/// on etcd; node A full (acme/a's 3 guaranteed, acme/c's 5 borrowed); acme/b's request
/// waits in the fair queue; `kill -9` of the leader. The new leader counts b's request
/// waiting (the stored queue), and acme/a's next request, first seen by it and within
/// acme/a's guarantee, reclaims at once. (Before the queue was stored, the new leader
/// relearned it for 120 s and answered "the books were taken over 0 s ago … retry after
/// 120 s"; a real-process test whose one coordinator lost its etcd lease for a moment under
/// load failed on that.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_leader_keeps_the_fair_queue_and_an_owner_reclaims_at_once() {
    let etcd = Etcd::start_with(&["--election-timeout", "500", "--heartbeat-interval", "50"])
        .expect("etcd");
    let dir = tempfile::tempdir().unwrap();
    let mut cs: Vec<Coord> =
        (0..2).map(|_| Coord::start(dir.path(), &etcd.url, free_addr())).collect();
    let urls: Vec<String> = cs.iter().map(|c| c.url.clone()).collect();
    let all: Vec<&str> = urls.iter().map(String::as_str).collect();
    Client::new(&all, ADMIN).unwrap().push_policy(&policy(), None).await.unwrap();
    let st = wait_status(&urls[0], "a coordinator deciding", |s| {
        s.authority.is_some() && s.coordinators.len() == 2
    })
    .await;
    let leader = st.authority.clone().unwrap();
    let li = urls.iter().position(|u| *u == leader.url).expect("the leader is one of the two");
    let other = urls[1 - li].clone();
    let mut a = Node::new(&[urls[li].as_str(), other.as_str()], "node-a", NODE_A);
    a.sync().await;
    for i in 1..=3 {
        let got = admitted(&a.admit(ask(&format!("a{i}"), "acme/a")).await.unwrap());
        assert_eq!(got, QuotaClass::Guaranteed);
    }
    for i in 1..=5 {
        let got = admitted(&a.admit(ask(&format!("c{i}"), "acme/c")).await.unwrap());
        assert_eq!(got, QuotaClass::Borrowed);
    }
    a.sync().await;
    let mut waits = ask("b1", "acme/b");
    waits.short_on_node = true;
    match a.admit(waits).await.unwrap() {
        AdmitAnswer::Refused { message, .. } => {
            assert!(message.contains("fair queue"), "{message}")
        }
        other => panic!("expected b1 to wait in the fair queue, got {other:?}"),
    }
    let waiting = |s: &QuotaStatus, path: &str| {
        s.paths.iter().find(|p| p.path == path).map_or(0, |p| p.waiting) / MICRO
    };
    assert_eq!(waiting(&status(&urls[li]).await.unwrap(), "acme/b"), 1);

    cs[li].kill9();
    let st = wait_status(&other, "the other coordinator deciding", |s| {
        s.authority.as_ref().is_some_and(|x| x.url == other)
    })
    .await;
    assert_eq!(waiting(&st, "acme/b"), 1, "b1's place in the fair queue is kept: {st:#?}");
    let mut claim = ask("a4", "acme/a");
    claim.short_on_node = true;
    match a.admit(claim).await.unwrap() {
        AdmitAnswer::Reclaiming { victims, .. } => {
            assert_eq!(victims.len(), 1, "{victims:?}");
            assert_eq!(victims[0].tenant, "acme/c", "{victims:?}");
        }
        other => panic!("expected a4 to reclaim at once on the new leader, got {other:?}"),
    }
    drop(cs);
}

/// What the leader recorded goes over to the next one with the books: `kill -9` of the
/// leader once its record of a preemption is stored (at most 5 s after it, while nodes
/// sync), and the next leader's status and events show that preemption. (Before, the
/// record was each leader's memory: `preemptions_last_hour` 0 and no event at the next.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_next_leader_shows_the_record_the_last_one_stored() {
    let etcd = Etcd::start_with(&["--election-timeout", "500", "--heartbeat-interval", "50"])
        .expect("etcd");
    let dir = tempfile::tempdir().unwrap();
    let mut cs: Vec<Coord> =
        (0..2).map(|_| Coord::start(dir.path(), &etcd.url, free_addr())).collect();
    let urls: Vec<String> = cs.iter().map(|c| c.url.clone()).collect();
    let all: Vec<&str> = urls.iter().map(String::as_str).collect();
    Client::new(&all, ADMIN).unwrap().push_policy(&policy(), None).await.unwrap();
    let st = wait_status(&urls[0], "a coordinator deciding", |s| {
        s.authority.is_some() && s.coordinators.len() == 2
    })
    .await;
    let leader = st.authority.clone().unwrap();
    let li = urls.iter().position(|u| *u == leader.url).expect("the leader is one of the two");
    let other = urls[1 - li].clone();
    let mut a = Node::new(&[urls[li].as_str(), other.as_str()], "node-a", NODE_A);
    a.sync().await;
    for i in 1..=3 {
        admitted(&a.admit(ask(&format!("a{i}"), "acme/a")).await.unwrap());
    }
    for i in 1..=5 {
        admitted(&a.admit(ask(&format!("b{i}"), "acme/b")).await.unwrap());
    }
    a.sync().await;
    let mut claim = ask("a4", "acme/a");
    claim.short_on_node = true;
    match a.admit(claim).await.unwrap() {
        AdmitAnswer::Reclaiming { victims, .. } => assert_eq!(victims.len(), 1, "{victims:?}"),
        other => panic!("expected a4 to reclaim, got {other:?}"),
    }
    // Stored within a record step while the node syncs (every call ticks the books).
    let mut raw = etcd_client::Client::connect([etcd.url.as_str()], None).await.unwrap();
    let key = format!("{PREFIX}/quota/books/record/acme/b");
    let t0 = Instant::now();
    loop {
        let resp = raw.get(key.as_str(), None).await.unwrap();
        let stored = resp.kvs().first().map(|kv| String::from_utf8_lossy(kv.value()).into_owned());
        if stored.as_deref().is_some_and(|v| v.contains(r#""preemptions":1"#)) {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "record not stored: {stored:?}");
        a.sync().await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let preempts = |e: &[fleet::quota_wire::QuotaEvent]| {
        e.iter()
            .filter(|e| e.kind == QuotaEventKind::Preempt && e.tenant.as_deref() == Some("acme/b"))
            .count()
    };
    cs[li].kill9();
    let st = wait_status(&other, "the other coordinator deciding", |s| {
        s.authority.as_ref().is_some_and(|x| x.url == other)
    })
    .await;
    let path = |p: &str| st.paths.iter().find(|x| x.path == p).cloned().unwrap();
    assert_eq!(path("acme/b").preemptions_last_hour, 1, "{st:#?}");
    let admin = Client::new(&[other.as_str()], ADMIN).unwrap();
    assert_eq!(preempts(&admin.quota_events().await.unwrap()), 1, "its preempt event is kept");
    drop(cs);
}

/// A write fenced by a leadership that is gone is refused by etcd, and nothing of it is
/// stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_fenced_by_a_leadership_that_is_gone_stores_nothing() {
    let etcd = Etcd::start().expect("etcd");
    let store = coordinator::store::EtcdStore::connect(std::slice::from_ref(&etcd.url), "/fence")
        .await
        .unwrap();
    let books = store.quota_backend().expect("etcd keeps the books");
    let op = quota::books::state::StateOp::DelNode { node: "n1".into() };
    let gone = Fence { key: "/fence/quota/leader/0000000000000001".into(), revision: 7, lease: 1 };
    let e = books.commit_books(gone, vec![op]).await.unwrap_err();
    assert!(matches!(e, coordinator::StoreError::Deposed(_)), "{e}");
    assert!(e.to_string().contains("no longer decides quotas"), "{e}");
    assert_eq!(books.load_books().await.unwrap(), Default::default());
}

/// Books being rebuilt from the nodes' syncs (the first leader of an empty store) say so
/// in etcd, and stop saying so once ready: a leader that takes them over before then reads
/// it and goes on rebuilding them (`quota::books::tests::books_taken_over_while_being_rebuilt_\
/// wait_for_the_nodes_they_have_not_heard_from`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stored_books_say_while_they_are_being_rebuilt() {
    use quota::books::state::StateOp;
    let etcd = Etcd::start().expect("etcd");
    let (books, fence, campaign) = elected(&etcd, "/rebuild").await;
    books
        .commit_books(fence.clone(), vec![StateOp::PutRebuilding { since_ms: 1_000 }])
        .await
        .unwrap();
    let state = books.load_books().await.unwrap();
    assert_eq!(state.rebuilding_since_ms, Some(1_000));
    let tree = quota::QuotaTree::default();
    assert!(!quota::books::Books::restore(30, 2_000, state, &tree).is_ready());
    books.commit_books(fence, vec![StateOp::DelRebuilding]).await.unwrap();
    assert_eq!(books.load_books().await.unwrap(), Default::default());
    campaign.abort();
}

/// A coordinator alone on etcd loses its leadership for a moment (its lease revoked, as a
/// keep-alive unanswered under load does) and wins it back: it takes the stored books over
/// again and keeps its own record of what it decided (the preempt event, the victims'
/// preemptions in the status), and the claimant's retry finds the same reclaim. (Events
/// and counters are not stored: before, a coordinator that took its own books over again
/// started them over, and a real-process test that counted preempt events could fail on a
/// flap.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_that_wins_its_leadership_back_keeps_its_own_record() {
    let etcd = Etcd::start_with(&["--election-timeout", "500", "--heartbeat-interval", "50"])
        .expect("etcd");
    let dir = tempfile::tempdir().unwrap();
    let c = Coord::start(dir.path(), &etcd.url, free_addr());
    Client::new(&[c.url.as_str()], ADMIN).unwrap().push_policy(&policy(), None).await.unwrap();
    let st = wait_status(&c.url, "deciding", |s| s.authority.is_some()).await;
    let first = st.authority.clone().unwrap();
    let mut a = Node::new(&[c.url.as_str()], "node-a", NODE_A);
    a.sync().await;
    for i in 1..=3 {
        admitted(&a.admit(ask(&format!("a{i}"), "acme/a")).await.unwrap());
    }
    for i in 1..=5 {
        admitted(&a.admit(ask(&format!("b{i}"), "acme/b")).await.unwrap());
    }
    a.sync().await;
    let mut claim = ask("a4", "acme/a");
    claim.short_on_node = true;
    let victims = match a.admit(claim.clone()).await.unwrap() {
        AdmitAnswer::Reclaiming { victims, .. } => victims,
        other => panic!("expected a reclaim, got {other:?}"),
    };
    assert_eq!(victims.len(), 1, "{victims:?}");
    let preempts = |e: &[fleet::quota_wire::QuotaEvent]| {
        e.iter().filter(|e| e.kind == QuotaEventKind::Preempt).count()
    };
    let admin = Client::new(&[c.url.as_str()], ADMIN).unwrap();
    assert_eq!(preempts(&admin.quota_events().await.unwrap()), 1);

    let mut raw = etcd_client::Client::connect([etcd.url.as_str()], None).await.unwrap();
    let opts = etcd_client::GetOptions::new().with_prefix();
    let resp = raw.get(format!("{PREFIX}/quota/leader/"), Some(opts)).await.unwrap();
    raw.lease_revoke(resp.kvs()[0].lease()).await.unwrap();
    let st = wait_status(&c.url, "deciding again", |s| {
        s.authority.as_ref().is_some_and(|x| x.term > first.term)
    })
    .await;
    let path = |p: &str| st.paths.iter().find(|x| x.path == p).cloned().unwrap();
    assert_eq!(path("acme/b").preemptions_last_hour, 1, "{st:#?}");
    assert_eq!(preempts(&admin.quota_events().await.unwrap()), 1, "its preempt event is kept");
    match a.admit(claim).await.unwrap() {
        AdmitAnswer::Reclaiming { victims: again, message, .. } => {
            assert_eq!(again, victims);
            assert!(message.contains("in progress"), "{message}");
        }
        other => panic!("expected the same reclaim, got {other:?}"),
    }
    assert_eq!(preempts(&admin.quota_events().await.unwrap()), 1, "no second victim");
}

/// The books of `prefix` on `etcd` and the fence of a leadership of them, won by a
/// campaign (abort it to end).
async fn elected(
    etcd: &Etcd,
    prefix: &str,
) -> (
    std::sync::Arc<dyn coordinator::store::QuotaBackend>,
    coordinator::store::Fence,
    tokio::task::JoinHandle<()>,
) {
    use coordinator::store::{Candidate, Role};
    let store = coordinator::store::EtcdStore::connect(std::slice::from_ref(&etcd.url), prefix)
        .await
        .unwrap();
    let books = store.quota_backend().expect("etcd keeps the books");
    let (role, mut rx) = tokio::sync::watch::channel(Role::Follower { leader: None });
    let me = Candidate { url: "http://127.0.0.1:9".into(), since_ms: 1 };
    let campaign = tokio::spawn({
        let books = books.clone();
        async move {
            let _ = books.campaign(me, Duration::from_secs(2), std::sync::Arc::new(role)).await;
        }
    });
    let fence = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Role::Leader { fence, .. } = &*rx.borrow_and_update() {
                return fence.clone();
            }
            rx.changed().await.expect("the campaign publishes its role");
        }
    })
    .await
    .expect("elected within 10 s");
    (books, fence, campaign)
}

/// The fair queue in etcd (issue 27): waiting requests, first asks, requeue backoffs (of
/// tenants and claims that hold `/`) and the mark that the queue is whole come back as
/// they were written, and go when deleted; the mark counts only while no other books key
/// was written after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stored_fair_queue_comes_back_as_written() {
    use quota::books::state::{AskState, BooksState, RequeueState, StateOp, WaitingState};
    let etcd = Etcd::start().expect("etcd");
    let (books, fence, campaign) = elected(&etcd, "/queue").await;
    let gpu = Amounts { gpus: [(H100.to_string(), MICRO)].into(), ..Amounts::default() };
    let claim = "ns/pod-0/main";
    let state = BooksState {
        waiting: vec![WaitingState {
            node: "node-a".into(),
            container_id: "c/1".into(),
            tenant: "acme/b".into(),
            claim: claim.into(),
            amounts: gpu,
            arrived_ms: 1_000,
            last_seen_ms: 30_000,
            relearned: true,
        }],
        asks: vec![AskState {
            node: "node-a".into(),
            tenant: "acme/b".into(),
            claim: claim.into(),
            first_asked_ms: Some(1_000),
            owed_first: true,
            last_asked_ms: Some(30_000),
            owed_since_ms: Some(2_000),
            owed_seen_ms: Some(30_000),
        }],
        requeues: vec![RequeueState {
            tenant: "acme/b".into(),
            claim: claim.into(),
            preemptions: 2,
            last_ms: 3_000,
            until_ms: 9_000,
            moved_to: None,
        }],
        queue_kept: true,
        ..BooksState::default()
    };
    let puts = vec![
        StateOp::PutWaiting(state.waiting[0].clone()),
        StateOp::PutAsk(state.asks[0].clone()),
        StateOp::PutRequeue(state.requeues[0].clone()),
        StateOp::PutQueueKept,
    ];
    books.commit_books(fence.clone(), puts).await.unwrap();
    assert_eq!(books.load_books().await.unwrap(), state);
    let dels = vec![
        StateOp::DelWaiting { node: "node-a".into(), container_id: "c/1".into() },
        StateOp::DelAsk { node: "node-a".into(), tenant: "acme/b".into(), claim: claim.into() },
        StateOp::DelRequeue { tenant: "acme/b".into(), claim: claim.into() },
    ];
    books.commit_books(fence.clone(), dels).await.unwrap();
    let left = books.load_books().await.unwrap();
    assert_eq!(left, BooksState { queue_kept: true, ..BooksState::default() });
    // A batch without the mark (a coordinator that does not store the queue deciding):
    // the stored queue no longer counts as whole, until the mark is written again.
    let node = quota::books::state::NodeState {
        capacity: Amounts { gpus: [(H100.to_string(), 8 * MICRO)].into(), ..Amounts::default() },
        holdings: vec![],
        issued: vec![],
        reported: vec![],
        stopping: vec![],
    };
    let put_node = StateOp::PutNode { node: "node-a".into(), state: node };
    books.commit_books(fence.clone(), vec![put_node.clone()]).await.unwrap();
    assert!(!books.load_books().await.unwrap().queue_kept, "written after the mark");
    books.commit_books(fence.clone(), vec![put_node.clone(), StateOp::PutQueueKept]).await.unwrap();
    assert!(books.load_books().await.unwrap().queue_kept, "the mark written with the batch");
    // Batches the journal gathers each carry the mark: one transaction still (etcd's
    // revision moves by one), the mark written once, last.
    let mut raw = etcd_client::Client::connect([etcd.url.as_str()], None).await.unwrap();
    let revision = |r: etcd_client::GetResponse| r.header().map(|h| h.revision()).unwrap();
    let before = revision(raw.get("/queue", None).await.unwrap());
    let node_b = match &put_node {
        StateOp::PutNode { state, .. } => {
            StateOp::PutNode { node: "node-b".into(), state: state.clone() }
        }
        _ => unreachable!(),
    };
    let gathered = vec![put_node, StateOp::PutQueueKept, node_b, StateOp::PutQueueKept];
    books.commit_books(fence, gathered).await.unwrap();
    let after = revision(raw.get("/queue", None).await.unwrap());
    assert_eq!(after, before + 1, "one transaction for the gathered batches");
    assert!(books.load_books().await.unwrap().queue_kept);
    campaign.abort();
}

/// Two coordinators that keep different books (one elected on etcd, one alone on SQLite)
/// answering the same node: each, told by the node's sync who answered it last, warns of
/// split brain in its log, its quota status and its metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coordinators_of_different_books_answering_one_node_warn_of_split_brain() {
    let etcd = Etcd::start().expect("etcd");
    let dir = tempfile::tempdir().unwrap();
    let elected = Coord::start(dir.path(), &etcd.url, free_addr());
    let db = dir.path().join("alone.db");
    let store = ["--store".to_string(), format!("sqlite:{}", db.display())];
    let alone = Coord::start_on(dir.path(), &store, free_addr());
    for c in [&elected, &alone] {
        Client::new(&[c.url.as_str()], ADMIN).unwrap().push_policy(&policy(), None).await.unwrap();
    }
    wait_status(&elected.url, "the elected coordinator deciding", |s| {
        s.authority.as_ref().is_some_and(|a| a.term > 0)
    })
    .await;
    let seen = |a: &fleet::quota_wire::Authority| fleet::quota_wire::SeenAuthority {
        url: a.url.clone(),
        term: a.term,
        scope: a.scope.clone(),
        age_ms: 300,
    };
    let sync = |last: Option<fleet::quota_wire::SeenAuthority>| SyncRequest {
        capacity: Amounts { gpus: [(H100.to_string(), 8 * MICRO)].into(), ..Amounts::default() },
        holdings: vec![],
        leases: vec![],
        stopping: vec![],
        last_authority: last,
    };
    let on_elected = Client::new(&[elected.url.as_str()], NODE_A).unwrap();
    let on_alone = Client::new(&[alone.url.as_str()], NODE_A).unwrap();
    let first = on_elected.quota_sync("node-a", &sync(None)).await.unwrap();
    let by_elected = first.authority.expect("the answer names its authority");
    // The node fails over to the coordinator alone, and says who answered it last.
    let second = on_alone.quota_sync("node-a", &sync(Some(seen(&by_elected)))).await.unwrap();
    let by_alone = second.authority.expect("the answer names its authority");
    assert_eq!(by_alone.term, 0, "alone: {by_alone:?}");
    assert_ne!(by_alone.scope, by_elected.scope);
    // And back.
    on_elected.quota_sync("node-a", &sync(Some(seen(&by_alone)))).await.unwrap();
    for (c, other) in [(&alone, &by_elected), (&elected, &by_alone)] {
        let st = status(&c.url).await.unwrap();
        assert!(
            st.warnings.iter().any(|w| w.contains("split brain") && w.contains(&other.url)),
            "{}: {:?}",
            c.url,
            st.warnings
        );
        let (code, metrics) = common::raw(&c.url, "GET", "/metrics", Some(ADMIN), None);
        assert_eq!(code, 200, "{metrics}");
        assert!(
            metrics
                .lines()
                .any(|l| l.starts_with("tessera_quota_split_brain{") && l.ends_with(" 1")),
            "{}: {metrics}",
            c.url
        );
        assert!(c.log_text().contains("split brain"), "{}", c.log_text());
    }
}
