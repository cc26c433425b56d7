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
    let (proxy, seen, proxy_task) = lossy_proxy(c.addr(), 1).await;
    let mut cfg = agent_config(
        vec![format!("http://{proxy}")],
        "node-a",
        NODE_A,
        dir.path().join("lkg.json"),
    );
    cfg.retry_min = Duration::from_millis(20);
    let agent = PolicyAgent::new(cfg).expect("agent");

    let batch = vec![
        interval("node-a", "node-a-abc-1", "acme/ml/vision/alice", T0, HOUR, 1.0),
        interval("node-a", "node-a-abc-2", "acme/ml/nlp/bob", T0, HOUR / 2, 0.5),
        interval("node-a", "node-a-abc-3", "beta/x", T0 + HOUR, HOUR, 1.0),
    ];
    let out = agent.upload_usage(&batch).await.expect("upload with a retry");
    assert!(seen.load(Ordering::SeqCst) >= 2, "the first answer was lost and the batch sent again");
    assert_eq!((out.accepted, out.duplicates), (0, 3), "the retry found all three stored: {out:?}");
    // A later deliberate re-upload, and an overlapping batch.
    let out = agent.upload_usage(&batch).await.expect("again");
    assert_eq!((out.accepted, out.duplicates), (0, 3));
    let mut more = batch[2..].to_vec();
    more.push(interval("node-a", "node-a-abc-4", "acme/ml/vision/alice", T0, HOUR, 0.25));
    let out = agent.upload_usage(&more).await.expect("overlap");
    assert_eq!((out.accepted, out.duplicates), (1, 1));

    // Node B uploads its own.
    let agent_b =
        PolicyAgent::new(agent_config(vec![c.url()], "node-b", NODE_B, dir.path().join("b.json")))
            .expect("agent");
    agent_b
        .upload_usage(&[interval("node-b", "node-b-x-1", "acme/ml/vision/carol", T0, HOUR, 1.0)])
        .await
        .expect("b");

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
    // Prices through POST.
    let q = coordinator::FleetUsageRequest {
        query: metering::UsageQuery {
            from_ms: T0,
            to_ms: T0 + 2 * HOUR,
            by: metering::GroupBy::Org,
            prices: metering::Prices {
                per_model: [(
                    "H100-80GB".to_string(),
                    metering::Rate { reserved_per_gpu_hour: 2.0, burst_per_gpu_hour: 4.0 },
                )]
                .into(),
            },
        },
        nodes: None,
        price_with_policy: false,
    };
    let u = admin(&c.url()).usage_query(&q).await.expect("priced");
    assert_eq!(u.report.total.cost, 7.0, "3.5 GPU-hours at 2.0");

    // The same id with other content is kept as first uploaded and reported.
    let mut changed = batch[0].clone();
    changed.duration_ms *= 2;
    let out = agent.upload_usage(&[changed]).await.expect("conflict is not an error");
    assert_eq!(out.conflicts, ["node-a-abc-1"]);
    // Another node's interval is refused outright.
    let err = agent
        .upload_usage(&[interval("node-b", "node-b-y-1", "acme", T0, 1, 1.0)])
        .await
        .expect_err("not its own");
    assert!(err.to_string().contains("only its own intervals"), "{err}");
    proxy_task.abort();
    c.shutdown().await;
}
