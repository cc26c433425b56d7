//! The fleet channel's hardening (issue 17): bounded versions, nothing used unverified,
//! a store bound to one signing key, health that says when the store is down, no bearer
//! token in clear text, status that tells the truth about failover and resolved refusals.

use std::sync::Arc;
use std::time::Duration;

use coordinator::server::Coordinator;
use coordinator::store::{PolicyStore, SqliteStore, StoreError};
use coordinator::{signing, AgentStatus, PolicyAgent, RunningCoordinator};

use crate::common::*;

const WITHIN: Duration = Duration::from_secs(15);

/// A policy of `version` pricing H100-80GB at `rate` per GPU-hour.
fn priced(version: u64, rate: f64) -> Vec<u8> {
    format!(
        r#"{{"version": {version}, "orgs": {{"acme": {{"trust": "trusted", "teams": {{"ml": {{}}}}}}}}, "default_tenant": "acme/ml", "prices": {{"H100-80GB": {{"reserved_per_gpu_hour": {rate}}}}}}}"#
    )
    .into_bytes()
}

/// A revision of `bytes` signed by another key that claims the fleet key's id (what an
/// attacker with write access to the store can plant).
fn forged(bytes: &[u8]) -> coordinator::SignedPolicy {
    let mut f = signing::sign(&evil_key(), bytes, "mallory", 5).expect("sign");
    f.key_id = signing::key_id(&key().verifying_key());
    f
}

async fn raw_status(url: &str, method: &str, path: &str, body: Option<Vec<u8>>) -> (u16, String) {
    raw_async(url, method, path, Some(ADMIN), body).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_are_bounded_so_none_can_wedge_the_channel() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = start_sqlite(&dir.path().join("c.db")).await;
    let url = c.url();
    for (v, what) in [
        (u64::MAX, "above the largest policy version"),
        (1 << 63, "above the largest policy version"),
        ((1 << 53) + 1, "above the largest policy version"),
        (1_000_001, "jumps more than 1000000 above 0"),
    ] {
        let (status, body) = raw_status(&url, "POST", "/v1/policies", Some(policy(v))).await;
        assert_eq!(status, 400, "version {v}: {body}");
        assert!(body.contains(what) && body.contains("\"path\":\"version\""), "{v}: {body}");
    }
    admin(&url).push_policy(&policy(7), None).await.expect("a sane first push");
    let (status, body) = raw_status(&url, "POST", "/v1/policies", Some(policy(1_000_008))).await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("use at most 1000007"), "{body}");
    // Nothing above was stored: the next ordinary push works.
    admin(&url).push_policy(&policy(8), None).await.expect("the channel is not wedged");
    assert_eq!(c.coordinator().latest_version(), Some(8));

    // The store refuses such versions too, whoever asks it (a clear error, not a 503).
    let store = c.coordinator().store().clone();
    let huge = signing::sign(&key(), &policy(1 << 63), "alice", 1).expect("sign");
    let e = store.append(Some(8), huge).await.expect_err("2^63 refused by sqlite");
    assert!(matches!(e, StoreError::Invalid(_)), "{e}");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planted_revisions_are_never_used_by_the_coordinator() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = start_sqlite(&dir.path().join("c.db")).await;
    let url = c.url();
    admin(&url).push_policy(&priced(1, 1.0), None).await.expect("push 1");
    // Someone with write access to the store plants version 2 pricing H100 at 999/h.
    let planted = priced(2, 999.0);
    c.coordinator().store().append(Some(1), forged(&planted)).await.expect("plant");
    let up =
        PolicyAgent::new(agent_config(vec![url.clone()], "node-a", NODE_A, dir.path().join("l")))
            .expect("agent");
    register_keys(&url).await;
    let one_hour = chained(
        vec![interval("node-a", "node-a-x-1", "acme/ml", 1_000_000, 3_600_000, 1.0)],
        "x",
        None,
    );
    up.upload_usage("x", &one_hour).await.expect("upload");

    // Fleet usage is priced with the newest revision that verifies: version 1.
    let req = coordinator::FleetUsageRequest {
        query: metering::UsageQuery::new(
            0,
            10_000_000,
            metering::GroupBy::Org,
            metering::Prices::default(),
        ),
        nodes: None,
        price_with_policy: true,
    };
    let u = admin(&url).usage_query(&req).await.expect("usage");
    assert_eq!(u.priced_with, Some(1));
    assert_eq!(u.report.total.cost, 1.0, "one GPU-hour at the genuine 1.0/h");
    assert!(u.skipped.len() == 1 && u.skipped[0].contains("version 2"), "{:?}", u.skipped);

    // Pushing the planted bytes is not "already done": it would burn the version.
    let e = admin(&url).push_policy(&planted, None).await.expect_err("not a success");
    assert_eq!(e.status(), Some(409), "{e}");
    assert!(e.to_string().contains("does not verify"), "{e}");

    // History says which revisions the coordinator's key signed.
    let h = admin(&url).history().await.expect("history");
    assert_eq!(h.len(), 2);
    assert_eq!(h[0].problem, None);
    assert!(h[1].problem.as_deref().is_some_and(|p| p.starts_with("forged")), "{:?}", h[1]);

    // A genuine push above it works, and then prices.
    admin(&url).push_policy(&priced(3, 2.0), None).await.expect("push 3");
    let u = admin(&url).usage_query(&req).await.expect("usage");
    assert_eq!((u.priced_with, u.report.total.cost), (Some(3), 2.0));
    assert!(u.skipped.is_empty());
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_with_another_signing_key_refuses_the_fleets_store() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("c.db");
    let c = start_sqlite(&db).await;
    c.shutdown().await;
    let store = Arc::new(SqliteStore::open(&db).expect("store"));
    let other = Coordinator::new(store, evil_key(), tokens());
    let e = RunningCoordinator::start(free_addr(), other).await.expect_err("another key");
    let text = e.to_string();
    assert!(text.contains("signed by key") && text.contains("Start it with"), "{text}");
    assert!(text.contains(&signing::key_id(&key().verifying_key())), "{text}");

    // A store with revisions but no binding yet belongs to its latest revision's key.
    let db2 = dir.path().join("old.db");
    let old = SqliteStore::open(&db2).expect("store");
    old.append(None, signing::sign(&key(), &policy(1), "alice", 1).expect("sign"))
        .await
        .expect("append");
    let other = Coordinator::new(Arc::new(old), evil_key(), tokens());
    assert!(RunningCoordinator::start(free_addr(), other).await.is_err());

    let Some(etcd) = Etcd::start() else { return };
    let a = start_etcd_coordinator(&etcd, "/k1", free_addr()).await;
    let store = Arc::new(
        coordinator::store::EtcdStore::connect(std::slice::from_ref(&etcd.url), "/k1")
            .await
            .expect("etcd"),
    );
    let e = RunningCoordinator::start(free_addr(), Coordinator::new(store, evil_key(), tokens()))
        .await
        .expect_err("another key on the fleet's etcd prefix");
    assert!(e.to_string().contains("signed by key"), "{e}");
    a.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_says_when_etcd_is_down() {
    let Some(etcd) = Etcd::start() else { return };
    let c = start_etcd_coordinator(&etcd, "/h1", free_addr()).await;
    let (status, body) = raw_async(&c.url(), "GET", "/v1/health", None, None).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"ok\":true"), "{body}");
    drop(etcd);
    let (status, body) = raw_async(&c.url(), "GET", "/v1/health", None, None).await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("\"ok\":false") && body.contains("store_error"), "{body}");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_http_url_never_sends_the_token_to_a_tls_peer() {
    // A peer that records what it receives and answers like a TLS server (an alert).
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let seen = Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
    let sink = seen.clone();
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        for conn in listener.incoming().take(16) {
            let Ok(mut conn) = conn else { continue };
            let _ = conn.set_read_timeout(Some(Duration::from_millis(300)));
            let mut buf = [0u8; 4096];
            if let Ok(n) = conn.read(&mut buf) {
                sink.lock().expect("lock").extend_from_slice(&buf[..n]);
            }
            let _ = conn.write_all(&[0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0x46]);
        }
    });
    let e = admin(&url).nodes().await.expect_err("not plain HTTP");
    assert!(e.to_string().contains("does not answer plain HTTP"), "{e}");
    let agent = PolicyAgent::new(agent_config(vec![url], "node-a", NODE_A, "/nonexistent".into()))
        .expect("agent");
    assert!(agent.upload_usage("t", &[]).await.is_ok(), "nothing to send, nothing sent");
    let one = chained(vec![interval("node-a", "node-a-t-1", "acme/ml", 1, 1, 1.0)], "t", None);
    assert!(agent.upload_usage("t", &one).await.is_err());
    let seen = String::from_utf8_lossy(&seen.lock().expect("lock")).into_owned();
    assert!(seen.contains("GET /v1/ping"), "the probe went out: {seen}");
    assert!(!seen.contains(ADMIN) && !seen.contains(NODE_A), "a token went out in clear: {seen}");

    // With a CA configured, http:// is refused before connecting; https:// needs a CA.
    let ca = rcgen::generate_simple_self_signed(vec!["localhost".into()]).expect("cert");
    let dir = tempfile::tempdir().expect("tempdir");
    let ca_path = dir.path().join("ca.pem");
    std::fs::write(&ca_path, ca.cert.pem()).expect("write");
    let tls = coordinator::tls::client_config(&ca_path).expect("tls");
    let mut cfg = agent_config(vec!["http://127.0.0.1:1".into()], "node-a", NODE_A, "/x".into());
    cfg.tls = Some(tls.clone());
    let e = PolicyAgent::new(cfg).expect_err("http with a CA");
    assert!(e.to_string().contains("clear text"), "{e}");
    let cfg = agent_config(vec!["https://127.0.0.1:1".into()], "node-a", NODE_A, "/x".into());
    let e = PolicyAgent::new(cfg).expect_err("https without a CA");
    assert!(e.to_string().contains("no CA"), "{e}");
    let client = admin("http://127.0.0.1:1").with_tls(Some(tls));
    let e = client.nodes().await.expect_err("http with a CA");
    assert!(e.to_string().contains("clear text"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_failover_is_connected_before_the_next_long_poll_returns() {
    let dir = tempfile::tempdir().expect("tempdir");
    let a = start_sqlite(&dir.path().join("a.db")).await;
    let b = start_sqlite(&dir.path().join("b.db")).await;
    for c in [&a, &b] {
        admin(&c.url()).push_policy(&policy(1), None).await.expect("push");
    }
    let mut cfg =
        agent_config(vec![a.url(), b.url()], "node-a", NODE_A, dir.path().join("lkg.json"));
    cfg.poll_timeout = Duration::from_secs(30);
    cfg.report_every = Duration::from_secs(30);
    let agent = RunningAgent::start(PolicyAgent::new(cfg).expect("agent"), AgentStatus::default());
    agent.wait_for("version 1 from A", WITHIN, |s| s.applied_version == Some(1)).await;
    let b_url = b.url();
    a.shutdown().await;
    // B's long poll runs 30 s; the node is connected to B long before it returns.
    agent
        .wait_for("connected to B", Duration::from_secs(3), |s| {
            s.connected && s.coordinator.as_deref() == Some(b_url.as_str())
        })
        .await;
    assert_eq!(agent.status().health(), "ok");
    drop(agent);
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsigned_bootstrap_file_never_hides_a_fleet_revision() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = start_sqlite(&dir.path().join("c.db")).await;
    admin(&c.url()).push_policy(&policy_with(1, "dev"), None).await.expect("push");
    // The node started from a local file claiming version 5 (unsigned: no signed floor).
    let file = policy::Policy::parse(&policy(5), "file").expect("policy");
    let start = AgentStatus {
        applied_version: Some(5),
        applied_digest: Some(file.digest()),
        applied_at_ms: Some(coordinator::now_ms()),
        source: coordinator::PolicySource::File,
        ..AgentStatus::default()
    };
    let cfg = agent_config(vec![c.url()], "node-a", NODE_A, dir.path().join("lkg.json"));
    let agent = RunningAgent::start(PolicyAgent::new(cfg).expect("agent"), start);
    agent.wait_for("the fleet's version 1", WITHIN, |s| s.applied_version == Some(1)).await;
    let s = agent.status();
    assert_eq!((s.source, s.signed_version), (coordinator::PolicySource::Coordinator, Some(1)));
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_node_tries_the_next_coordinator_after_a_bad_answer() {
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = start_sqlite(&dir.path().join("bad.db")).await;
    bad.coordinator().store().append(None, forged(&policy(3))).await.expect("plant");
    let good = start_sqlite(&dir.path().join("good.db")).await;
    admin(&good.url()).push_policy(&policy(2), None).await.expect("push");
    let agent = PolicyAgent::new(agent_config(
        vec![bad.url(), good.url()],
        "node-a",
        NODE_A,
        dir.path().join("lkg.json"),
    ))
    .expect("agent");
    let (v, url) = agent.fetch_first(Duration::from_millis(200)).await.expect("from the second");
    assert_eq!((v.version, url), (2, good.url()));
    // Neither serves one: the error says what each did.
    let agent = PolicyAgent::new(agent_config(
        vec![bad.url()],
        "node-a",
        NODE_A,
        dir.path().join("lkg.json"),
    ))
    .expect("agent");
    let problems = agent.fetch_first(Duration::from_millis(200)).await.expect_err("none");
    assert!(problems[0].contains("forged"), "{problems:?}");
    for c in [bad, good] {
        c.shutdown().await;
    }
}

/// Issue 28: a genuine revision (signed by the fleet's key) copied under a higher store key
/// — the SQLite row of version 99, etcd's `policy/rev/…099` — used to wedge the channel:
/// the stores took the highest key for the latest revision, the push checked its version
/// against the copy's and compare-and-set against the real latest, lost, and after five
/// tries answered `409: another coordinator kept pushing at the same time; retry` to every
/// push, forever. The latest is now the revision the store's own record of it names (etcd's
/// `policy/latest`; SQLite's highest row whose revision is its own version): pushes work,
/// and the misplaced copy is never served nor used; reading it by its key says what it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_genuine_older_revision_planted_under_a_higher_key_does_not_wedge_pushes() {
    async fn check(url: &str, c: &RunningCoordinator, store: &str) {
        for v in [5, 6] {
            let r = admin(url).push_policy(&policy(v), None).await;
            let r = r.unwrap_or_else(|e| panic!("{store}: push {v} after the plant: {e}"));
            assert_eq!(r.version, v, "{store}");
        }
        assert_eq!(c.coordinator().latest_version(), Some(6), "{store}: watchers see 6");
        let got = admin(url).latest(4, Duration::from_secs(2)).await.expect("poll");
        assert_eq!(got.map(|e| e.version), Some(6), "{store}: a long poll is answered with 6");
        let h: Vec<u64> =
            admin(url).history().await.expect("history").iter().map(|r| r.version).collect();
        assert_eq!(h, vec![1, 2, 3, 5, 6], "{store}: the copy is not in the history");
        let (status, body) = raw_status(url, "GET", "/v1/policies/99", None).await;
        assert_eq!(status, 500, "{store}: {body}");
        assert!(body.contains("key 99") && body.contains("version 1"), "{store}: {body}");
        // The copy's own key cannot be pushed: the answer says why and what to do.
        let e = admin(url).push_policy(&policy(99), None).await.expect_err("key 99 is taken");
        assert_eq!(e.status(), Some(409), "{store}: {e}");
        let text = e.to_string();
        assert!(text.contains("under version 99") && text.contains("above 99"), "{store}: {text}");
        admin(url).push_policy(&policy(100), None).await.expect("a version above the copy");
        assert_eq!(c.coordinator().latest_version(), Some(100), "{store}");
    }
    // SQLite: the copy written as row 99 by someone with the database file.
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("c.db");
    let c = start_sqlite(&db).await;
    let url = c.url();
    for v in 1..=3 {
        admin(&url).push_policy(&policy(v), None).await.expect("push");
    }
    let one = c.coordinator().store().get(1).await.expect("get").expect("revision 1");
    let conn = rusqlite::Connection::open(&db).expect("open");
    conn.execute(
        "INSERT INTO revisions (version, envelope) VALUES (99, ?1)",
        [serde_json::to_string(&one).expect("json")],
    )
    .expect("plant");
    drop(conn);
    check(&url, &c, "sqlite").await;
    c.shutdown().await;

    // etcd: the copy put under `policy/rev/{99:020}`, `policy/latest` untouched.
    let Some(etcd) = Etcd::start() else { return };
    let c = start_etcd_coordinator(&etcd, "/p28", free_addr()).await;
    let url = c.url();
    for v in 1..=3 {
        admin(&url).push_policy(&policy(v), None).await.expect("push");
    }
    let one = c.coordinator().store().get(1).await.expect("get").expect("revision 1");
    let mut raw = etcd_client::Client::connect([etcd.url.as_str()], None).await.expect("etcd");
    raw.put(format!("/p28/policy/rev/{:020}", 99), serde_json::to_vec(&one).expect("json"), None)
        .await
        .expect("plant");
    check(&url, &c, "etcd").await;
    // A coordinator started on the planted store reads the same latest.
    let d = start_etcd_coordinator(&etcd, "/p28", free_addr()).await;
    assert_eq!(d.coordinator().latest_version(), Some(100));
    d.shutdown().await;
    c.shutdown().await;
}
