//! Two coordinators on one real etcd: the same revisions and watches from either, and
//! propagation survives losing either one.

use std::time::Duration;

use coordinator::{AgentStatus, PolicyAgent};

use crate::common::*;

const WITHIN: Duration = Duration::from_secs(15);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_coordinators_on_one_etcd_serve_the_same_policy_and_survive_losing_either() {
    let Some(etcd) = Etcd::start() else { return };
    let (addr_a, addr_b) = (free_addr(), free_addr());
    let a = start_etcd_coordinator(&etcd, "/t1", addr_a).await;
    let b = start_etcd_coordinator(&etcd, "/t1", addr_b).await;
    let (url_a, url_b) = (a.url(), b.url());

    // Push to A; a watcher on B gets it (B's etcd watch wakes its long polls).
    let dir = tempfile::tempdir().expect("tempdir");
    let on_b = RunningAgent::start(
        PolicyAgent::new(agent_config(
            vec![url_b.clone(), url_a.clone()],
            "node-b",
            NODE_B,
            dir.path().join("b.json"),
        ))
        .expect("agent"),
        AgentStatus::default(),
    );
    let on_a = RunningAgent::start(
        PolicyAgent::new(agent_config(
            vec![url_a.clone(), url_b.clone()],
            "node-a",
            NODE_A,
            dir.path().join("a.json"),
        ))
        .expect("agent"),
        AgentStatus::default(),
    );
    on_b.wait_for("polling B", WITHIN, |s| s.connected).await;
    admin(&url_a).push_policy(&policy(1), None).await.expect("push via A");
    let took = on_b.wait_for("version 1 via B", WITHIN, |s| s.applied_version == Some(1)).await;
    on_a.wait_for("version 1 via A", WITHIN, |s| s.applied_version == Some(1)).await;
    assert!(took < Duration::from_secs(2), "propagation through etcd took {took:?}");
    assert_eq!(on_b.status().coordinator.as_deref(), Some(url_b.as_str()));

    // Both serve the same history; a version pushed through one is refused as old by the other.
    assert_eq!(
        admin(&url_b).history().await.expect("history B"),
        admin(&url_a).history().await.expect("history A")
    );
    assert_eq!(
        admin(&url_b).push_policy(&policy_with(1, "dev"), None).await.expect_err("old").status(),
        Some(409)
    );

    // Racing pushes of the same version with different content: exactly one wins.
    let (ca, cb) = (admin(&url_a), admin(&url_b));
    let (pa, pb) = (policy_with(2, "dev"), policy_with(2, "untrusted"));
    let (ra, rb) = tokio::join!(ca.push_policy(&pa, None), cb.push_policy(&pb, None));
    assert!(ra.is_ok() != rb.is_ok(), "one push wins: {ra:?} {rb:?}");
    let loser = ra.err().or(rb.err()).expect("a loser");
    assert_eq!(loser.status(), Some(409), "{loser}");
    on_a.wait_for("version 2", WITHIN, |s| s.applied_version == Some(2)).await;
    on_b.wait_for("version 2", WITHIN, |s| s.applied_version == Some(2)).await;

    // Stop B: its watchers fail over to A, and pushes through A reach everyone.
    b.shutdown().await;
    admin(&url_a).push_policy(&policy(3), None).await.expect("push via A");
    on_b.wait_for("version 3 after failover", WITHIN, |s| s.applied_version == Some(3)).await;
    on_a.wait_for("version 3", WITHIN, |s| s.applied_version == Some(3)).await;
    assert_eq!(on_b.status().coordinator.as_deref(), Some(url_a.as_str()));

    // B comes back, then A stops: pushes through B still reach everyone.
    let b = start_etcd_coordinator(&etcd, "/t1", addr_b).await;
    assert_eq!(b.coordinator().latest_version(), Some(3), "B starts from what etcd holds");
    a.shutdown().await;
    admin(&url_b).push_policy(&policy(4), None).await.expect("push via B");
    on_a.wait_for("version 4 after failover", WITHIN, |s| s.applied_version == Some(4)).await;
    on_b.wait_for("version 4", WITHIN, |s| s.applied_version == Some(4)).await;
    assert_eq!(on_a.status().coordinator.as_deref(), Some(url_b.as_str()));

    // The node registry is shared too.
    eventually("both nodes reported version 4", WITHIN, || {
        let c = admin(&url_b);
        async move {
            let nodes = c.nodes().await.expect("nodes");
            nodes.iter().filter(|n| n.applied_version == Some(4)).count() == 2
        }
    })
    .await;
    let versions: Vec<u64> =
        admin(&url_b).history().await.expect("history").iter().map(|r| r.version).collect();
    assert_eq!(versions, [1, 2, 3, 4]);
    drop((on_a, on_b));
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_usage_uploads_are_idempotent_across_coordinators() {
    let Some(etcd) = Etcd::start() else { return };
    let a = start_etcd_coordinator(&etcd, "/t2", free_addr()).await;
    let b = start_etcd_coordinator(&etcd, "/t2", free_addr()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    register_keys(&a.url()).await;
    let batch = chained(
        vec![
            interval("node-a", "node-a-e-1", "acme/ml", 1_000_000, 60_000, 1.0),
            interval("node-a", "node-a-e-2", "acme/ml", 1_000_000, 60_000, 0.5),
        ],
        "e",
        None,
    );
    let via_a =
        PolicyAgent::new(agent_config(vec![a.url()], "node-a", NODE_A, dir.path().join("1")))
            .expect("agent");
    let via_b =
        PolicyAgent::new(agent_config(vec![b.url()], "node-a", NODE_A, dir.path().join("2")))
            .expect("agent");
    assert_eq!(via_a.upload_usage("e", &batch).await.expect("a").accepted, 2);
    // The key pinned through one coordinator is the fleet's (etcd); the chain head too.
    let again = via_b.upload_usage("e", &batch).await.expect("b");
    assert_eq!((again.accepted, again.duplicates), (0, 2), "a retry through the other coordinator");
    let u =
        admin(&b.url()).usage(0, 10_000_000, metering::GroupBy::Org, None).await.expect("usage");
    assert_eq!((u.report.total.intervals, u.report.total.gpu_seconds), (2, 90.0));

    // Separate prefixes are separate fleets.
    let other = start_etcd_coordinator(&etcd, "/t2-other", free_addr()).await;
    assert_eq!(other.coordinator().latest_version(), None);
    let u = admin(&other.url())
        .usage(0, 10_000_000, metering::GroupBy::Org, None)
        .await
        .expect("usage");
    assert_eq!(u.report.total.intervals, 0);
    for c in [a, b, other] {
        c.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_etcd_is_an_error_at_start() {
    let addr = free_addr();
    let err = coordinator::store::EtcdStore::connect(&[format!("http://{addr}")], "/x")
        .await
        .expect_err("no etcd");
    assert!(err.to_string().contains("does not answer"), "{err}");
}
