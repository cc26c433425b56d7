//! The coordinator's HTTP API against a real server on loopback (SQLite store).

use std::time::{Duration, Instant};

use crate::common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn credentials_are_checked_for_every_route_and_refusals_are_recorded() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = start_sqlite(&dir.path().join("c.db")).await;
    let url = c.url();
    let p1 = policy(1);

    // Anonymous and unknown credentials: 401.
    let (s, body) = raw_async(&url, "POST", "/v1/policies", None, Some(p1.clone())).await;
    assert_eq!(s, 401, "{body}");
    let (s, _) =
        raw_async(&url, "POST", "/v1/policies", Some("not-a-known-token-xxxxx"), Some(p1.clone()))
            .await;
    assert_eq!(s, 401);
    let (s, _) =
        raw_async(&url, "GET", "/v1/policies/latest?newer_than=0&timeout_ms=0", None, None).await;
    assert_eq!(s, 401, "watching needs a credential too");

    // A node credential cannot push, and says who was refused and why.
    let (s, body) = raw_async(&url, "POST", "/v1/policies", Some(NODE_A), Some(p1.clone())).await;
    assert_eq!(s, 403, "{body}");
    let err: serde_json::Value = serde_json::from_str(&body).expect("json error");
    assert_eq!(err["who"], "node:node-a");
    assert!(err["error"].as_str().expect("error").contains("admin credential"), "{body}");

    // The admin can.
    let (s, body) = raw_async(&url, "POST", "/v1/policies", Some(ADMIN), Some(p1.clone())).await;
    assert_eq!(s, 201, "{body}");

    // Nodes read no one's data but their own, and act only as themselves.
    for (method, path) in [
        ("GET", "/v1/policies"),
        ("GET", "/v1/policies/1"),
        ("GET", "/v1/nodes"),
        ("GET", "/v1/nodes/node-b"),
        ("GET", "/v1/usage?from_ms=0&to_ms=10"),
        ("GET", "/v1/audit/refusals"),
    ] {
        let (s, body) = raw_async(&url, method, path, Some(NODE_A), None).await;
        assert_eq!(s, 403, "{method} {path}: {body}");
    }
    let report = br#"{"applied_version": 1, "source": "coordinator", "health": "ok"}"#.to_vec();
    let (s, body) =
        raw_async(&url, "POST", "/v1/nodes/node-b/report", Some(NODE_A), Some(report.clone()))
            .await;
    assert_eq!(s, 403, "{body}");
    assert!(body.contains("may act only as itself"), "{body}");
    let (s, _) = raw_async(
        &url,
        "POST",
        "/v1/nodes/node-b/usage",
        Some(NODE_A),
        Some(br#"{"intervals": []}"#.to_vec()),
    )
    .await;
    assert_eq!(s, 403);
    let (s, _) =
        raw_async(&url, "POST", "/v1/nodes/node-a/report", Some(ADMIN), Some(report.clone())).await;
    assert_eq!(s, 403, "admins cannot pose as a node");
    let (s, body) =
        raw_async(&url, "POST", "/v1/nodes/node-a/report", Some(NODE_A), Some(report)).await;
    assert_eq!(s, 200, "{body}");
    let (s, _) = raw_async(&url, "GET", "/v1/nodes/node-a", Some(NODE_A), None).await;
    assert_eq!(s, 200, "a node reads its own record");
    let (s, body) =
        raw_async(&url, "GET", "/v1/policies/latest?newer_than=0&timeout_ms=0", Some(NODE_A), None)
            .await;
    assert_eq!(s, 200, "nodes watch the policy: {body}");

    // Every refusal is on record with who and why.
    let refusals = admin(&url).refusals().await.expect("refusals");
    let push = refusals
        .iter()
        .find(|r| r.who == "node:node-a" && r.action == "push a policy")
        .expect("push refusal");
    assert_eq!(push.status, 403);
    assert!(refusals.iter().any(|r| r.who.starts_with("anonymous (127.0.0.1:") && r.status == 401));
    assert!(refusals.iter().any(|r| r.who.starts_with("unknown credential") && r.status == 401));
    assert!(refusals
        .iter()
        .any(|r| r.who == "node:node-a" && r.why.contains("not as node \"node-b\"")));
    assert!(refusals.iter().any(|r| r.who == "admin:alice" && r.action == "report node status"));
    assert!(refusals.len() >= 12, "{refusals:#?}");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_are_validated_versioned_signed_and_kept() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = start_sqlite(&dir.path().join("c.db")).await;
    let a = admin(&c.url());

    // Path-precise validation errors.
    let bad = br#"{"version": 1, "orgs": {"acme": {"trust": "sorta"}}}"#;
    let err = a.push_policy(bad, None).await.expect_err("invalid");
    assert_eq!(err.status(), Some(400));
    match &err {
        coordinator::client::ClientError::Api { error, .. } => {
            assert_eq!(error.path.as_deref(), Some("orgs.acme.trust"), "{err}");
        }
        other => panic!("{other}"),
    }
    assert!(err.to_string().contains("(at orgs.acme.trust)"), "{err}");

    let r1 = a.push_policy(&policy(1), Some("alice")).await.expect("push 1");
    assert_eq!((r1.version, r1.author.as_str()), (1, "alice"));
    // The same bytes again (a retried push): the same revision, not a new one.
    assert_eq!(a.push_policy(&policy(1), None).await.expect("re-push"), r1);
    // Another document claiming version 1, or an older one: refused.
    let err = a.push_policy(&policy_with(1, "dev"), None).await.expect_err("equal");
    assert_eq!(err.status(), Some(409));
    assert!(err.to_string().contains("older or equal version"), "{err}");
    let r3 = a.push_policy(&policy_with(3, "dev"), Some("bob")).await.expect("push 3");
    assert_eq!(r3.author, "bob (via admin alice)");
    assert_eq!(a.push_policy(&policy(2), None).await.expect_err("older").status(), Some(409));

    let hist: Vec<u64> = a.history().await.expect("history").iter().map(|r| r.version).collect();
    assert_eq!(hist, [1, 3]);
    let env = a.get(3).await.expect("get");
    let v = coordinator::signing::verify(&env, &key().verifying_key())
        .expect("signed by the coordinator key");
    assert_eq!(v.bytes, policy_with(3, "dev"), "the exact bytes pushed");
    assert_eq!(v.policy.digest(), r3.digest);
    assert_eq!(a.get(2).await.expect_err("none").status(), Some(404));
    let d = a.diff(1, 3, &key().verifying_key()).await.expect("diff");
    assert!(
        d.contains("-      \"trust\": \"trusted\"") && d.contains("+      \"trust\": \"dev\""),
        "{d}"
    );
    assert!(d.starts_with("--- version 1\n+++ version 3\n"), "{d}");

    // Restart on the same database: same history, same latest for watchers.
    let url = c.url();
    c.shutdown().await;
    let c = start_sqlite(&dir.path().join("c.db")).await;
    assert_eq!(c.coordinator().latest_version(), Some(3));
    assert_ne!(c.url(), url);
    let hist: Vec<u64> =
        admin(&c.url()).history().await.expect("history").iter().map(|r| r.version).collect();
    assert_eq!(hist, [1, 3]);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_polls_wake_within_milliseconds_of_a_push() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = start_sqlite(&dir.path().join("c.db")).await;
    let url = c.url();
    let a = admin(&url);
    a.push_policy(&policy(1), None).await.expect("push 1");

    // Nothing newer: 204 after the timeout, with the latest version in a header.
    let t0 = Instant::now();
    let (s, _) = raw_async(
        &url,
        "GET",
        "/v1/policies/latest?newer_than=1&timeout_ms=300",
        Some(NODE_A),
        None,
    )
    .await;
    assert_eq!(s, 204);
    assert!(t0.elapsed() >= Duration::from_millis(290), "{:?}", t0.elapsed());

    // Older than the latest: answered at once.
    let (s, body) =
        raw_async(&url, "GET", "/v1/policies/latest?newer_than=0", Some(NODE_B), None).await;
    assert_eq!(s, 200);
    let env: coordinator::SignedPolicy = serde_json::from_str(&body).expect("envelope");
    assert_eq!(env.version, 1);

    // Three parked polls wake right after a push.
    let polls: Vec<_> = (0..3)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move {
                let r = raw_async(
                    &url,
                    "GET",
                    "/v1/policies/latest?newer_than=1&timeout_ms=20000",
                    Some(NODE_A),
                    None,
                )
                .await;
                (r, Instant::now())
            })
        })
        .collect();
    let coord = c.coordinator().clone();
    eventually("3 parked polls", Duration::from_secs(10), || {
        let n = coord.waiting_watchers();
        async move { n == 3 }
    })
    .await;
    let pushed_at = Instant::now();
    a.push_policy(&policy(2), None).await.expect("push 2");
    for p in polls {
        let ((s, body), at) = p.await.expect("poll");
        assert_eq!(s, 200, "{body}");
        assert!(body.contains("\"version\":2"), "{body}");
        let latency = at.duration_since(pushed_at);
        assert!(latency < Duration::from_millis(500), "woke {latency:?} after the push");
    }
    assert_eq!(c.coordinator().waiting_watchers(), 0);

    // Shutting down answers parked polls at once (503) so nodes move on.
    let url2 = url.clone();
    let parked = tokio::spawn(async move {
        raw_async(
            &url2,
            "GET",
            "/v1/policies/latest?newer_than=2&timeout_ms=20000",
            Some(NODE_A),
            None,
        )
        .await
    });
    eventually("1 parked poll", Duration::from_secs(10), || {
        let n = coord.waiting_watchers();
        async move { n == 1 }
    })
    .await;
    let t0 = Instant::now();
    c.shutdown().await;
    let (s, _) = parked.await.expect("parked");
    assert_eq!(s, 503);
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_listing_shows_versions_contact_and_health() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = start_sqlite(&dir.path().join("c.db")).await;
    let url = c.url();
    let report = br#"{"applied_version": 4, "applied_digest": "abc", "source": "coordinator", "health": "degraded",
                      "last_rejection": "version 5 from x: forged"}"#
        .to_vec();
    let (s, body) =
        raw_async(&url, "POST", "/v1/nodes/node-a/report", Some(NODE_A), Some(report)).await;
    assert_eq!(s, 200, "{body}");
    let nodes = admin(&url).nodes().await.expect("nodes");
    assert_eq!(nodes.len(), 2, "{nodes:#?}");
    let a = &nodes[0];
    assert_eq!(
        (a.node.as_str(), a.applied_version, a.health.as_str(), a.stale),
        ("node-a", Some(4), "degraded", false)
    );
    assert!(a.last_contact_ms.is_some());
    assert_eq!(a.last_rejection.as_deref(), Some("version 5 from x: forged"));
    let b = &nodes[1];
    assert_eq!(
        (b.node.as_str(), b.applied_version, b.health.as_str(), b.stale),
        ("node-b", None, "unknown", true)
    );
    let table = coordinator::client::render_nodes(&nodes, coordinator::now_ms());
    assert!(
        table.contains("node-a\t4\tcoordinator\tdegraded\t0s ago\tversion 5 from x: forged"),
        "{table}"
    );
    assert!(table.contains("node-b\t-\tnone\tunknown\tnever"), "{table}");

    // Malformed input is a 400 with a message, not a crash.
    let (s, body) =
        raw_async(&url, "POST", "/v1/nodes/node-a/report", Some(NODE_A), Some(b"{".to_vec())).await;
    assert_eq!(s, 400, "{body}");
    let (s, body) =
        raw_async(&url, "GET", "/v1/policies/latest?newer_than=x", Some(NODE_A), None).await;
    assert_eq!(s, 400, "{body}");
    c.shutdown().await;
}
