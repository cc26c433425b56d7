//! etcd history compaction against a real etcd: a coordinator started with a retention
//! compacts what is older than it, keeps what is newer, and its store and watch work on.

use std::time::{Duration, Instant};

use etcd_client::GetOptions;

use crate::common::*;

/// The value of `key` at etcd revision `rev`, or etcd's error.
async fn value_at(raw: &mut etcd_client::Client, key: &str, rev: i64) -> Result<String, String> {
    let resp = raw
        .get(key, Some(GetOptions::new().with_revision(rev)))
        .await
        .map_err(|e| e.to_string())?;
    Ok(resp
        .kvs()
        .first()
        .map(|kv| String::from_utf8_lossy(kv.value()).into_owned())
        .unwrap_or_default())
}

/// Put `key` = `value`; the etcd revision of that write.
async fn put(raw: &mut etcd_client::Client, key: &str, value: &str) -> i64 {
    raw.put(key, value, None).await.expect("put").header().expect("header").revision()
}

/// A coordinator as `tessera-coordinator serve` starts it, on `etcd`, with `compaction`.
async fn serve(
    etcd: &Etcd,
    dir: &std::path::Path,
    compaction: Option<Duration>,
) -> coordinator::RunningCoordinator {
    let key_file = dir.join("coordinator.key");
    if !key_file.exists() {
        coordinator::signing::write_signing_key(&key_file, &key()).expect("key file");
    }
    let tokens = dir.join("tokens.json");
    std::fs::write(
        &tokens,
        format!(r#"{{"admins": {{"alice": "{ADMIN}"}}, "nodes": {{"node-a": "{NODE_A}"}}}}"#),
    )
    .expect("tokens");
    let opts = coordinator::ServeOptions {
        listen: free_addr(),
        store: coordinator::StoreSpec::Etcd(vec![etcd.url.clone()]),
        etcd_prefix: "/compaction".into(),
        signing_key: key_file,
        tokens,
        tls: None,
        usage_retention: None,
        etcd_compaction: compaction,
        quota_leader_ttl: coordinator::quota_routes::DEFAULT_LEADER_TTL,
        advertise_url: None,
        peer_ca: None,
        quota_lease_ttl: coordinator::quota_routes::DEFAULT_LEASE_TTL,
    };
    coordinator::RunningCoordinator::from_options(&opts).await.expect("coordinator")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_history_older_than_the_retention_is_compacted_and_the_rest_is_kept() {
    let Some(etcd) = Etcd::start() else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let mut raw = etcd_client::Client::connect([etcd.url.as_str()], None).await.expect("etcd");
    // Compaction is cluster-wide: a key outside the fleet's prefix loses its history too.
    let old = put(&mut raw, "/elsewhere/k", "v1").await;
    put(&mut raw, "/elsewhere/k", "v2").await;

    // Off: a coordinator without compaction leaves the history alone.
    let off = serve(&etcd, dir.path(), None).await;
    admin(&off.url()).push_policy(&policy(1), None).await.expect("push 1");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(value_at(&mut raw, "/elsewhere/k", old).await.as_deref(), Ok("v1"));

    // On, keeping 1 s: the old revision goes within about a second and a tenth.
    let keep = Duration::from_secs(1);
    let on = serve(&etcd, dir.path(), Some(keep)).await;
    let t0 = Instant::now();
    let compacted = loop {
        // Writes go on meanwhile (node reports would), each readable at once.
        let now = put(&mut raw, "/elsewhere/k", "new").await;
        assert_eq!(value_at(&mut raw, "/elsewhere/k", now).await.as_deref(), Ok("new"));
        match value_at(&mut raw, "/elsewhere/k", old).await {
            Err(e) if e.contains("compacted") => break t0.elapsed(),
            Ok(v) => assert_eq!(v, "v1"),
            Err(e) => panic!("reading revision {old}: {e}"),
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "revision {old} was never compacted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // (The loop starts a moment before `t0`: allow its first sampling period.)
    assert!(
        compacted >= keep - Duration::from_millis(100),
        "compacted after {compacted:?}, before the retention passed"
    );

    // What is younger than the retention stays readable: a revision written now, read
    // half the retention later.
    let recent = put(&mut raw, "/elsewhere/k", "recent").await;
    tokio::time::sleep(keep / 2).await;
    assert_eq!(value_at(&mut raw, "/elsewhere/k", recent).await.as_deref(), Ok("recent"));

    // The coordinator works on: a push through the other coordinator reaches it through its
    // etcd watch (started before the compaction), and its history answers.
    let url = on.url();
    let mut latest = on.coordinator().store().subscribe();
    admin(&off.url()).push_policy(&policy(2), None).await.expect("push 2");
    tokio::time::timeout(Duration::from_secs(5), async {
        while latest.borrow().as_ref().map(|p| p.envelope.version) != Some(2) {
            latest.changed().await.expect("watch");
        }
    })
    .await
    .expect("version 2, pushed elsewhere after the compaction, seen through the watch");
    let versions: Vec<u64> =
        admin(&url).history().await.expect("history").iter().map(|r| r.version).collect();
    assert_eq!(versions, [1, 2], "revisions are current values: compaction never removes them");
    on.shutdown().await;
    off.shutdown().await;
}
