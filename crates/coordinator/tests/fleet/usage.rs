//! Fleet usage: idempotent uploads (also when an answer is lost) and roll-ups.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use coordinator::PolicyAgent;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::common::*;

const HOUR: u64 = 3_600_000;
const T0: u64 = 1_767_225_600_000;

/// A TCP proxy to `upstream` that, for its first `drop_first` connections, lets the
/// request through but throws the answer away and closes: the "lost response" case.
async fn lossy_proxy(
    upstream: SocketAddr,
    drop_first: usize,
) -> (SocketAddr, Arc<AtomicUsize>, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let seen = Arc::new(AtomicUsize::new(0));
    let count = seen.clone();
    let task = tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let n = count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let Ok(mut up) = TcpStream::connect(upstream).await else { return };
                if n < drop_first {
                    // Forward the request, wait for the answer, drop it.
                    let mut buf = vec![0u8; 1 << 20];
                    let (mut cr, mut cw) = client.split();
                    let (mut ur, mut uw) = up.split();
                    let forward = async {
                        loop {
                            match cr.read(&mut buf).await {
                                Ok(0) | Err(_) => break,
                                Ok(k) => {
                                    if uw.write_all(&buf[..k]).await.is_err() {
                                        break;
                                    }
                                }
                            }
                        }
                    };
                    // Relay the answer to the client's credential-less `GET /v1/ping`
                    // (sent first on every new plain connection), then lose the next.
                    let answer = async {
                        let mut relayed = Vec::new();
                        let mut chunk = [0u8; 4096];
                        while !String::from_utf8_lossy(&relayed).contains("tessera-coordinator\n") {
                            match ur.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(k) => {
                                    relayed.extend_from_slice(&chunk[..k]);
                                    if cw.write_all(&chunk[..k]).await.is_err() {
                                        return;
                                    }
                                }
                            }
                        }
                        let _ = ur.read(&mut chunk).await;
                    };
                    tokio::select! {
                        _ = forward => {}
                        _ = answer => {}
                    }
                    let _ = cw.shutdown().await;
                } else {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut up).await;
                }
            });
        }
    });
    (addr, seen, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_retried_after_a_lost_answer_count_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = start_sqlite(&dir.path().join("c.db")).await;
    register_keys(&c.url()).await;
    let (proxy, seen, proxy_task) = lossy_proxy(c.addr(), 1).await;
    let mut cfg = agent_config(
        vec![format!("http://{proxy}")],
        "node-a",
        NODE_A,
        dir.path().join("lkg.json"),
    );
    cfg.retry_min = Duration::from_millis(20);
    let agent = PolicyAgent::new(cfg).expect("agent");

    let batch = chained(
        vec![
            interval("node-a", "node-a-abc-1", "acme/ml/vision/alice", T0, HOUR, 1.0),
            interval("node-a", "node-a-abc-2", "acme/ml/nlp/bob", T0, HOUR / 2, 0.5),
            interval("node-a", "node-a-abc-3", "beta/x", T0 + HOUR, HOUR, 1.0),
        ],
        "abc",
        None,
    );
    let out = agent.upload_usage("abc", &batch).await.expect("upload with a retry");
    assert!(seen.load(Ordering::SeqCst) >= 2, "the first answer was lost and the batch sent again");
    assert_eq!((out.accepted, out.duplicates), (0, 3), "the retry found all three stored: {out:?}");
    // A later deliberate re-upload, and an overlapping batch.
    let out = agent.upload_usage("abc", &batch).await.expect("again");
    assert_eq!((out.accepted, out.duplicates), (0, 3));
    let mut more = batch[2..].to_vec();
    more.extend(chained(
        vec![interval("node-a", "node-a-abc-4", "acme/ml/vision/alice", T0, HOUR, 0.25)],
        "abc",
        batch.last(),
    ));
    let out = agent.upload_usage("abc", &more).await.expect("overlap");
    assert_eq!((out.accepted, out.duplicates), (1, 1));
    let head = admin(&c.url()).usage_head("node-a", "abc").await.expect("head");
    assert_eq!(head.seq, 4);

    // Node B uploads its own.
    let agent_b =
        PolicyAgent::new(agent_config(vec![c.url()], "node-b", NODE_B, dir.path().join("b.json")))
            .expect("agent");
    let b = chained(
        vec![interval("node-b", "node-b-x-1", "acme/ml/vision/carol", T0, HOUR, 1.0)],
        "x",
        None,
    );
    agent_b.upload_usage("x", &b).await.expect("b");

    let u = admin(&c.url())
        .usage(T0, T0 + 2 * HOUR, metering::GroupBy::Team, None)
        .await
        .expect("usage");
    assert_eq!(u.report.total.intervals, 5, "{u:#?}");
    // 3600 + 900 + 3600 + 900 + 3600 GPU-seconds.
    assert_eq!(u.report.total.gpu_seconds, 12_600.0);
    let groups: Vec<(&str, f64)> =
        u.report.rows.iter().map(|r| (r.group.as_str(), r.gpu_seconds)).collect();
    assert_eq!(groups, [("acme/ml", 9_000.0), ("beta/x", 3_600.0)]);
    let nodes: Vec<(&str, f64, u64)> =
        u.nodes.iter().map(|n| (n.node.as_str(), n.gpu_seconds, n.intervals)).collect();
    assert_eq!(nodes, [("node-a", 9_000.0, 4), ("node-b", 3_600.0, 1)]);
    // A window clips intervals; a node filter narrows.
    let u = admin(&c.url())
        .usage(T0, T0 + HOUR, metering::GroupBy::Org, Some(&["node-b".to_string()]))
        .await
        .expect("usage");
    assert_eq!((u.report.total.gpu_seconds, u.report.total.intervals), (3_600.0, 1));
    // Prices through POST (no quotas: guaranteed work by consumption at the reserved rate).
    let q = coordinator::FleetUsageRequest {
        query: metering::UsageQuery::new(
            T0,
            T0 + 2 * HOUR,
            metering::GroupBy::Org,
            metering::Prices {
                per_model: [("H100-80GB".to_string(), metering::Rate::new(2.0, 4.0))].into(),
            },
        ),
        nodes: None,
        price_with_policy: false,
    };
    let u = admin(&c.url()).usage_query(&q).await.expect("priced");
    assert_eq!(u.report.total.cost, 7.0, "3.5 GPU-hours at 2.0");

    // Another node's interval is refused outright.
    let err = agent
        .upload_usage(
            "xyz",
            &chained(vec![interval("node-b", "node-b-y-1", "acme", T0, 1, 1.0)], "xyz", None),
        )
        .await
        .expect_err("not its own");
    assert!(err.to_string().contains("only its own intervals"), "{err}");
    proxy_task.abort();
    c.shutdown().await;
}

/// A raw usage upload of `body` as node-a (its token), answered (status, body).
async fn raw_upload(url: &str, body: &coordinator::UsageUpload) -> (u16, String) {
    let body = serde_json::to_vec(body).expect("json");
    raw_async(url, "POST", "/v1/nodes/node-a/usage", Some(NODE_A), Some(body)).await
}

fn signed(
    signer: &coordinator::signing::Signer,
    intervals: &[metering::ClosedInterval],
) -> coordinator::UsageUpload {
    let segment = fleet::proof::sign_segment(signer, "node-a", "abc", intervals).expect("sign");
    coordinator::UsageUpload { intervals: intervals.to_vec(), segment: Some(segment) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_signed_uploads_that_extend_the_chain_are_stored() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = start_sqlite(&dir.path().join("c.db")).await;
    let url = c.url();
    let rows = chained(
        (1..=4)
            .map(|k| {
                interval("node-a", &format!("node-a-abc-{k}"), "acme/ml", T0 + k * HOUR, HOUR, 1.0)
            })
            .collect(),
        "abc",
        None,
    );
    let own = node_signer("node-a");
    let first = signed(&own, &rows[..2]);

    // No key pinned yet: refused, saying how to pin one.
    let (status, body) = raw_upload(&url, &first).await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("tessera nodes register-key node-a"), "{body}");
    register_keys(&url).await;

    // Unsigned.
    let unsigned = coordinator::UsageUpload { intervals: rows[..2].to_vec(), segment: None };
    let (status, body) = raw_upload(&url, &unsigned).await;
    assert_eq!((status, body.contains("unsigned")), (403, true), "{body}");
    // Forged: node-a's token (stolen), node-b's key.
    let forged = signed(&node_signer("node-b"), &rows[..2]);
    let (status, body) = raw_upload(&url, &forged).await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("wrong-key"), "{body}");
    let mut claims = forged.clone();
    claims.segment.as_mut().expect("seg").key_id = own.key_id().to_string();
    let (status, body) = raw_upload(&url, &claims).await;
    assert_eq!((status, body.contains("forged")), (403, true), "{body}");
    // The later segment first: out of order.
    let later = signed(&own, &rows[2..]);
    let (status, body) = raw_upload(&url, &later).await;
    assert_eq!((status, body.contains("out of order")), (409, true), "{body}");
    // An interval edited after its node signed it.
    let mut edited = first.clone();
    edited.intervals[1].gpu_seconds = 1.0;
    let (status, body) = raw_upload(&url, &edited).await;
    assert_eq!(status, 422, "{body}");
    assert!(body.contains("node-a-abc-2") && body.contains("changed after it closed"), "{body}");

    // Nothing of that was stored.
    let total = |u: coordinator::FleetUsage| (u.report.total.intervals, u.report.total.gpu_seconds);
    let reader = admin(&url);
    let usage = || reader.usage(0, T0 + 10 * HOUR, metering::GroupBy::Org, None);
    assert_eq!(total(usage().await.expect("usage")), (0, 0.0));

    // The genuine upload; then the same bytes again (a replay) are refused, not counted.
    let (status, body) = raw_upload(&url, &first).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = raw_upload(&url, &first).await;
    assert_eq!((status, body.contains("replayed")), (409, true), "{body}");
    let (status, body) = raw_upload(&url, &later).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(total(usage().await.expect("usage")), (4, 4.0 * 3600.0));

    // Every refusal is in the audit log.
    let refusals = admin(&url).refusals().await.expect("refusals");
    let uploads: Vec<&str> = refusals
        .iter()
        .filter(|r| r.action == "upload usage")
        .map(|r| r.why.split(':').next().unwrap_or(""))
        .collect();
    assert_eq!(
        uploads,
        [
            "no-key",
            "unsigned",
            "wrong-key",
            "forged",
            "replayed-or-out-of-order",
            "broken-chain",
            "replayed-or-out-of-order"
        ]
    );

    // Keys: the same again is fine, another needs `replace`.
    let public = coordinator::signing::encode_verifying_key(&own.verifying_key());
    admin(&url).register_node_key("node-a", &public, false).await.expect("same key");
    let other = coordinator::signing::encode_verifying_key(&node_signer("node-z").verifying_key());
    let e = admin(&url).register_node_key("node-a", &other, false).await.expect_err("other key");
    assert_eq!(e.status(), Some(409), "{e}");
    assert!(e.to_string().contains("replace"), "{e}");
    let e = admin(&url).register_node_key("node-a", "not-a-key", false).await.expect_err("bad key");
    assert_eq!(e.status(), Some(400), "{e}");
    let agent =
        PolicyAgent::new(agent_config(vec![url.clone()], "node-a", NODE_A, dir.path().join("l")))
            .expect("agent");
    assert!(agent.usage_head("abc").await.is_ok(), "a node reads its own head");
    let (status, _) = raw_async(
        &url,
        "PUT",
        "/v1/nodes/node-a/key",
        Some(NODE_A),
        Some(br#"{"public_key": "00"}"#.to_vec()),
    )
    .await;
    assert_eq!(status, 403, "a node cannot pin keys");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bill_is_verified_from_the_signed_intervals_and_the_signed_revision() {
    let dir = tempfile::tempdir().expect("tempdir");
    let c = start_sqlite(&dir.path().join("c.db")).await;
    let url = c.url();
    register_keys(&url).await;
    // Prices, a floor of 2 for acme/ml, chargeback.
    let doc = br#"{"version": 1, "orgs": {"acme": {"trust": "trusted", "teams": {"ml": {}}}},
        "default_tenant": "acme/ml",
        "prices": {"H100-80GB": {"reserved_per_gpu_hour": 2.0, "burst_per_gpu_hour": 3.0}},
        "quotas": {"acme/ml": {"gpus": {"H100-80GB": {"guarantee": 2}}}},
        "billing": {"default_mode": "chargeback"}}"#;
    admin(&url).push_policy(doc, None).await.expect("push");
    let mut borrowed = interval("node-a", "node-a-abc-2", "acme/ml", T0, HOUR, 1.0);
    borrowed.start.class = metering::Class::Burst;
    let rows = chained(
        vec![interval("node-a", "node-a-abc-1", "acme/ml", T0, HOUR, 1.0), borrowed],
        "abc",
        None,
    );
    let agent =
        PolicyAgent::new(agent_config(vec![url.clone()], "node-a", NODE_A, dir.path().join("l")))
            .expect("agent");
    agent.upload_usage("abc", &rows).await.expect("upload");

    let export = admin(&url)
        .usage_export(T0, T0 + HOUR, metering::GroupBy::Team, None)
        .await
        .expect("export");
    // The floor: 2 GPUs for the hour at 2.0 = 4.0; the borrowed GPU-hour at 3.0.
    assert_eq!(export.report.total.floor_cost, 4.0);
    assert_eq!(export.report.total.burst_cost, 3.0);
    assert_eq!((export.report.total.cost, export.report.total.chargeback_cost), (7.0, 7.0));
    assert_eq!(export.policy.as_ref().map(|p| p.version), Some(1));
    let pinned: std::collections::BTreeMap<String, ed25519_dalek::VerifyingKey> =
        [("node-a".to_string(), node_signer("node-a").verifying_key())].into();
    let check = fleet::proof::verify_bill(&export, &key().verifying_key(), &pinned);
    assert!(check.ok(), "{check:#?}");
    assert_eq!((check.intervals, check.policy_version), (2, Some(1)));

    // An interval edited in the export: named.
    let mut bad = export.clone();
    bad.nodes[0].segments[0].intervals[1].gpu_seconds = 1.0;
    let check = fleet::proof::verify_bill(&bad, &key().verifying_key(), &pinned);
    assert!(check.problems[0].contains("node-a-abc-2"), "{check:#?}");
    // A bill that says more than its intervals.
    let mut bad = export.clone();
    bad.report.rows[0].cost += 1.0;
    let check = fleet::proof::verify_bill(&bad, &key().verifying_key(), &pinned);
    assert!(check.problems[0].contains("does not follow from the signed intervals"), "{check:#?}");
    // Prices that are not the signed revision's.
    let mut bad = export.clone();
    bad.query.prices.per_model.get_mut("H100-80GB").expect("price").burst_per_gpu_hour = 1.0;
    let check = fleet::proof::verify_bill(&bad, &key().verifying_key(), &pinned);
    assert!(check.problems[0].contains("prices are not the signed policy"), "{check:#?}");
    // Checked against another trust key, or another node key.
    let check = fleet::proof::verify_bill(&export, &evil_key().verifying_key(), &pinned);
    assert!(check.problems[0].contains("does not verify against the trust key"), "{check:#?}");
    let wrong: std::collections::BTreeMap<String, ed25519_dalek::VerifyingKey> =
        [("node-a".to_string(), node_signer("node-b").verifying_key())].into();
    let check = fleet::proof::verify_bill(&export, &key().verifying_key(), &wrong);
    assert!(check.problems[0].contains("node-a"), "{check:#?}");
    c.shutdown().await;
}
