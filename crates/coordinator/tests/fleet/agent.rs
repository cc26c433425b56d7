//! The node agent against real coordinators and against a lying one.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::routing::{get, post};
use axum::Router;
use base64::Engine as _;
use coordinator::signing::{self, SignedPolicy};
use coordinator::{AgentStatus, PolicyAgent, PolicySource};

use crate::common::*;

const WITHIN: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_applies_pushes_keeps_last_known_good_and_reports() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = start_sqlite(&dir.path().join("c.db")).await;
    let a = admin(&c.url());
    a.push_policy(&policy(1), None).await.expect("push 1");

    let lkg = dir.path().join("node-a/lkg.json");
    let agent = PolicyAgent::new(agent_config(vec![c.url()], "node-a", NODE_A, lkg.clone()))
        .expect("agent");
    let running = RunningAgent::start(agent.clone(), AgentStatus::default());
    running.wait_for("version 1", WITHIN, |s| s.applied_version == Some(1)).await;

    // A push reaches the node within milliseconds, not a poll interval.
    let t0 = std::time::Instant::now();
    a.push_policy(&policy_with(2, "dev"), None).await.expect("push 2");
    running.wait_for("version 2", WITHIN, |s| s.applied_version == Some(2)).await;
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    assert_eq!(*running.applied.lock().expect("lock"), [1, 2]);
    let s = running.status();
    assert_eq!(
        (s.source, s.health(), s.coordinator.as_deref()),
        (PolicySource::Coordinator, "ok", Some(c.url().as_str()))
    );

    // Last-known-good on disk is the signed envelope of version 2.
    let kept = agent.load_last_known_good().expect("lkg").expect("some");
    assert_eq!((kept.version, kept.bytes.clone()), (2, policy_with(2, "dev")));

    // The coordinator hears the node's applied version and health.
    eventually("node-a reported version 2", WITHIN, || {
        let a = a.clone();
        async move {
            a.nodes()
                .await
                .expect("nodes")
                .iter()
                .any(|n| n.node == "node-a" && n.applied_version == Some(2) && n.health == "ok")
        }
    })
    .await;
    drop(running);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_keeps_enforcing_restarts_from_last_known_good_and_catches_up() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("c.db");
    let c = start_sqlite(&db).await;
    let addr = c.addr();
    let url = c.url();
    let a = admin(&url);
    a.push_policy(&policy(1), None).await.expect("push 1");
    let lkg = dir.path().join("lkg.json");
    let cfg = agent_config(vec![url.clone()], "node-a", NODE_A, lkg.clone());
    let running =
        RunningAgent::start(PolicyAgent::new(cfg.clone()).expect("agent"), AgentStatus::default());
    running.wait_for("version 1", WITHIN, |s| s.applied_version == Some(1)).await;

    // The coordinator goes away: the node keeps version 1 and says it is degraded.
    c.shutdown().await;
    running.wait_for("disconnected", WITHIN, |s| !s.connected && s.last_error.is_some()).await;
    let s = running.status();
    assert_eq!((s.applied_version, s.health()), (Some(1), "degraded"));
    assert!(s.last_error.as_deref().expect("error").contains(&url), "{s:?}");

    // The node restarts while the coordinator is down: it starts from last-known-good.
    drop(running);
    let agent = PolicyAgent::new(cfg).expect("agent");
    let kept = agent.load_last_known_good().expect("verified").expect("kept");
    assert_eq!(kept.version, 1);
    let running =
        RunningAgent::start(agent, AgentStatus::started_from(&kept, PolicySource::LastKnownGood));
    tokio::time::sleep(Duration::from_millis(400)).await;
    let s = running.status();
    assert_eq!(
        (s.applied_version, s.source, s.connected),
        (Some(1), PolicySource::LastKnownGood, false)
    );

    // The coordinator returns (same address, same database) with a newer policy pushed
    // while the node could not hear it: the node catches up.
    let c = start_sqlite_on(&db, addr).await;
    admin(&c.url()).push_policy(&policy(2), None).await.expect("push 2");
    running
        .wait_for("caught up to 2", WITHIN, |s| s.applied_version == Some(2) && s.connected)
        .await;
    let s = running.status();
    assert_eq!((s.source, s.health()), (PolicySource::Coordinator, "ok"));
    assert_eq!(
        *running.applied.lock().expect("lock"),
        [2],
        "version 1 came from disk, not re-applied"
    );
    drop(running);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_fails_over_to_the_next_coordinator() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = start_sqlite(&dir.path().join("c.db")).await;
    admin(&c.url()).push_policy(&policy(7), None).await.expect("push");
    let dead = format!("http://{}", free_addr());
    let cfg =
        agent_config(vec![dead.clone(), c.url()], "node-a", NODE_A, dir.path().join("lkg.json"));
    let running =
        RunningAgent::start(PolicyAgent::new(cfg).expect("agent"), AgentStatus::default());
    running
        .wait_for("version 7 via the second url", WITHIN, |s| s.applied_version == Some(7))
        .await;
    assert_eq!(running.status().coordinator.as_deref(), Some(c.url().as_str()));

    // A node whose credential the coordinator does not accept gets nothing.
    let cfg = agent_config(
        vec![c.url()],
        "node-a",
        "wrong-token-0123456789",
        dir.path().join("lkg2.json"),
    );
    let refused =
        RunningAgent::start(PolicyAgent::new(cfg).expect("agent"), AgentStatus::default());
    refused
        .wait_for("refused", WITHIN, |s| s.last_error.as_deref().is_some_and(|e| e.contains("401")))
        .await;
    assert_eq!(refused.applied_version(), None);
    drop((running, refused));
    c.shutdown().await;
}

/// A coordinator that serves whatever envelope the test sets, whatever `newer_than`
/// says, and keeps the node's reports.
#[derive(Clone, Default)]
struct Liar {
    serve: Arc<Mutex<Vec<u8>>>,
    reports: Arc<Mutex<Vec<serde_json::Value>>>,
}

async fn start_liar(liar: Liar) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    async fn latest(State(l): State<Liar>) -> axum::response::Response {
        let body = l.serve.lock().expect("lock").clone();
        axum::response::IntoResponse::into_response(([("content-type", "application/json")], body))
    }
    async fn report(State(l): State<Liar>, body: axum::body::Bytes) -> &'static str {
        if let Ok(v) = serde_json::from_slice(&body) {
            l.reports.lock().expect("lock").push(v);
        }
        "{}"
    }
    let app = Router::new()
        .route("/v1/policies/latest", get(latest))
        .route("/v1/nodes/{node}/report", post(report))
        .with_state(liar);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (addr, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_unsigned_tampered_and_older_policies_are_refused_with_reasons() {
    let dir = tempfile::tempdir().expect("tempdir");
    let liar = Liar::default();
    let (addr, server) = start_liar(liar.clone()).await;
    let set = |bytes: Vec<u8>| *liar.serve.lock().expect("lock") = bytes;
    let json = |env: &SignedPolicy| serde_json::to_vec(env).expect("json");
    let genuine = |v: u64| signing::sign(&key(), &policy(v), "alice", 1).expect("sign");

    set(json(&genuine(3)));
    let cfg =
        agent_config(vec![format!("http://{addr}")], "node-a", NODE_A, dir.path().join("lkg.json"));
    let running =
        RunningAgent::start(PolicyAgent::new(cfg).expect("agent"), AgentStatus::default());
    running.wait_for("genuine version 3", WITHIN, |s| s.applied_version == Some(3)).await;

    let expect_rejection = |kind: &'static str, version: u64| {
        let running = &running;
        async move {
            running
                .wait_for(kind, WITHIN, |s| {
                    s.last_rejection
                        .as_ref()
                        .is_some_and(|r| r.kind == kind && r.version == version)
                })
                .await;
            let s = running.status();
            assert_eq!(
                s.applied_version,
                Some(3),
                "still enforcing version 3 after a {kind} offer"
            );
            s.last_rejection.expect("rejection").reason
        }
    };

    // Signed by another key: refused, whatever key id it claims.
    let mut forged = signing::sign(&evil_key(), &policy(4), "mallory", 2).expect("sign");
    set(json(&forged));
    let why = expect_rejection("wrong-key", 4).await;
    assert!(why.contains("pinned"), "{why}");
    forged.key_id = signing::key_id(&key().verifying_key());
    set(json(&forged));
    let why = expect_rejection("forged", 4).await;
    assert!(why.contains("signature does not verify"), "{why}");
    assert_eq!(running.status().health(), "degraded", "a refused newer version is a problem");

    // Unsigned: an envelope without a signature, and a bare policy.
    let mut unsigned = genuine(5);
    unsigned.signature.clear();
    set(json(&unsigned));
    expect_rejection("unsigned", 5).await;
    set(policy(6));
    let why = expect_rejection("unsigned", 0).await;
    assert!(why.contains("bare policy"), "{why}");

    // Genuine signature, bytes swapped.
    let mut tampered = genuine(7);
    tampered.policy_b64 = base64::engine::general_purpose::STANDARD.encode(policy_with(7, "dev"));
    set(json(&tampered));
    expect_rejection("tampered", 7).await;

    // Genuine but older than what is in force.
    set(json(&genuine(2)));
    let why = expect_rejection("older", 2).await;
    assert!(why.contains("older or equal version"), "{why}");
    assert!(running.status().rejections >= 6);
    assert_eq!(
        *running.applied.lock().expect("lock"),
        [3],
        "nothing but version 3 was ever applied"
    );

    // The reasons reached the coordinator in the node's reports.
    let reports = liar.reports.clone();
    eventually("the last refusal reported", WITHIN, || {
        let last = reports.lock().expect("lock").last().cloned();
        async move {
            last.is_some_and(|r| {
                r["last_rejection"].as_str().is_some_and(|s| s.contains("older or equal"))
            })
        }
    })
    .await;
    let reports = liar.reports.lock().expect("lock").clone();
    for needle in ["pinned", "signature does not verify", "unsigned", "bare policy", "tampered"] {
        assert!(
            reports
                .iter()
                .any(|r| r["last_rejection"].as_str().is_some_and(|s| s.contains(needle))
                    && r["health"] == "degraded"),
            "no degraded report mentions {needle:?}: {reports:#?}"
        );
    }

    // A genuine newer version is still taken at once, and the node reports itself healthy
    // with it. (Read from the report the agent sends right after the apply: this liar keeps
    // serving version 8 whatever the poll asks for, so the agent's next poll refuses it as
    // older — a replay, rightly degraded — and the live status may already say so.)
    set(json(&genuine(8)));
    running.wait_for("version 8", WITHIN, |s| s.applied_version == Some(8)).await;
    eventually("a report of version 8", WITHIN, || {
        let any = liar.reports.lock().expect("lock").iter().any(|r| r["applied_version"] == 8);
        async move { any }
    })
    .await;
    let first_with_8 = liar
        .reports
        .lock()
        .expect("lock")
        .iter()
        .find(|r| r["applied_version"] == 8)
        .cloned()
        .expect("a report of version 8");
    assert_eq!(first_with_8["health"], "ok", "{first_with_8:#}");
    drop(running);
    server.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_apply_is_not_recorded_as_applied() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = start_sqlite(&dir.path().join("c.db")).await;
    admin(&c.url()).push_policy(&policy(1), None).await.expect("push");
    let lkg = dir.path().join("lkg.json");
    let agent = PolicyAgent::new(agent_config(vec![c.url()], "node-a", NODE_A, lkg.clone()))
        .expect("agent");
    let status = Arc::new(Mutex::new(AgentStatus::default()));
    let task = tokio::spawn(agent.clone().run(|_| Err("daemon busy".to_string()), status.clone()));
    eventually("apply error", WITHIN, || {
        let e = status.lock().expect("lock").apply_error.clone();
        async move { e.is_some() }
    })
    .await;
    let s = status.lock().expect("lock").clone();
    assert_eq!((s.applied_version, s.health()), (None, "degraded"));
    assert!(s.apply_error.as_deref().expect("error").contains("daemon busy"));
    assert!(!lkg.exists(), "nothing kept as last-known-good");
    task.abort();
    c.shutdown().await;
}
