//! The etcd store, for several coordinators sharing one etcd cluster.
//!
//! Keys (under a prefix, `/tessera` by default):
//!
//! | key | value |
//! |---|---|
//! | `{p}/policy/latest` | the latest version, decimal |
//! | `{p}/policy/rev/{version:020}` | the revision's envelope (JSON); never rewritten |
//! | `{p}/nodes/{node}` | the node's [`NodeRecord`] (JSON) |
//! | `{p}/usage/{node}/{interval id}` | a closed interval (JSON); created once |
//!
//! An append is one transaction: if `latest` still holds the version the pusher saw
//! (or does not exist yet) and the revision key does not exist, put both. Each
//! coordinator keeps an etcd watch on `{p}/policy/rev/` (from the revision it read the
//! latest at, so nothing is missed) and publishes every newer envelope to its long polls;
//! the watch is re-established with backoff when etcd goes away.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, SortOrder, SortTarget, Txn,
    TxnOp, TxnOpResponse, WatchOptions,
};
use tracing::{info, warn};

use super::{check_interval, BoxFut, LatestRx, PolicyStore, Publisher, StoreError};
use crate::signing::SignedPolicy;
use crate::wire::{NodeRecord, UploadOutcome};

/// Bound on every unary etcd call.
const OP_TIMEOUT: Duration = Duration::from_secs(5);

/// The etcd store.
#[derive(Clone)]
pub struct EtcdStore {
    client: Client,
    prefix: String,
    publisher: Publisher,
    _watch: Arc<AbortOnDrop>,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore").field("prefix", &self.prefix).finish_non_exhaustive()
    }
}

/// Stops the background watch when the last clone of the store is dropped.
#[derive(Debug)]
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn etcd_err(e: etcd_client::Error) -> StoreError {
    StoreError::Etcd(e.to_string())
}

async fn bounded<T>(
    what: &str,
    f: impl std::future::Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(OP_TIMEOUT, f).await {
        Ok(r) => r.map_err(etcd_err),
        Err(_) => Err(StoreError::Etcd(format!("{what}: no answer from etcd in {OP_TIMEOUT:?}"))),
    }
}

fn decode<T: serde::de::DeserializeOwned>(what: &str, bytes: &[u8]) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt(format!("{what}: {e}")))
}

fn encode<T: serde::Serialize>(v: &T) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(v).map_err(|e| StoreError::Other(format!("encode: {e}")))
}

#[derive(Debug, Clone)]
struct Keys {
    prefix: String,
}

impl Keys {
    fn latest(&self) -> String {
        format!("{}/policy/latest", self.prefix)
    }
    fn revs(&self) -> String {
        format!("{}/policy/rev/", self.prefix)
    }
    fn rev(&self, version: u64) -> String {
        format!("{}/policy/rev/{version:020}", self.prefix)
    }
    fn nodes(&self) -> String {
        format!("{}/nodes/", self.prefix)
    }
    fn node(&self, node: &str) -> String {
        format!("{}/nodes/{node}", self.prefix)
    }
    fn usage_all(&self) -> String {
        format!("{}/usage/", self.prefix)
    }
    fn usage(&self, node: &str, id: &str) -> String {
        format!("{}/usage/{node}/{id}", self.prefix)
    }
}

impl EtcdStore {
    /// Connect to etcd at `endpoints` (e.g. `http://127.0.0.1:2379`), check that it answers,
    /// read the latest revision and start watching for newer ones. `prefix` roots every
    /// key (`/tessera`; tests use one per test).
    pub async fn connect(endpoints: &[String], prefix: &str) -> Result<EtcdStore, StoreError> {
        let prefix = prefix.trim_end_matches('/').to_string();
        if prefix.is_empty() || !prefix.starts_with('/') {
            return Err(StoreError::Other(format!(
                "etcd key prefix {prefix:?} must start with '/'"
            )));
        }
        let opts = ConnectOptions::new()
            .with_connect_timeout(Duration::from_secs(3))
            .with_keep_alive(Duration::from_secs(5), Duration::from_secs(3))
            .with_keep_alive_while_idle(true);
        let client = bounded("connect", Client::connect(endpoints, Some(opts))).await?;
        let keys = Keys { prefix: prefix.clone() };
        // etcd-client connects lazily: a request proves the cluster answers.
        let (latest, _) = read_latest(&client, &keys).await.map_err(|e| {
            StoreError::Etcd(format!("etcd at {} does not answer: {e}", endpoints.join(",")))
        })?;
        let publisher = Publisher::new();
        if let Some(env) = &latest {
            publisher.publish_if_newer(env);
        }
        let task = tokio::spawn(watch_loop(client.clone(), keys, publisher.clone()));
        info!(endpoints = %endpoints.join(","), prefix = %prefix, latest = ?latest.map(|l| l.version), "etcd store ready");
        Ok(EtcdStore { client, prefix, publisher, _watch: Arc::new(AbortOnDrop(task)) })
    }

    fn keys(&self) -> Keys {
        Keys { prefix: self.prefix.clone() }
    }
}

/// The newest revision and the etcd revision it was read at.
async fn read_latest(
    client: &Client,
    keys: &Keys,
) -> Result<(Option<SignedPolicy>, i64), StoreError> {
    let mut kv = client.kv_client();
    let opts = GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Key, SortOrder::Descend)
        .with_limit(1);
    let resp = bounded("get latest", kv.get(keys.revs(), Some(opts))).await?;
    let at = resp.header().map(|h| h.revision()).unwrap_or(0);
    let latest =
        resp.kvs().first().map(|kv| decode::<SignedPolicy>("revision", kv.value())).transpose()?;
    Ok((latest, at))
}

async fn watch_loop(client: Client, keys: Keys, publisher: Publisher) {
    let mut backoff = Duration::from_millis(100);
    loop {
        match watch_once(&client, &keys, &publisher).await {
            Ok(()) => warn!("etcd watch on {} ended; re-establishing", keys.revs()),
            Err(e) => warn!("etcd watch on {}: {e}; retrying in {backoff:?}", keys.revs()),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

async fn watch_once(client: &Client, keys: &Keys, publisher: &Publisher) -> Result<(), StoreError> {
    let (latest, at) = read_latest(client, keys).await?;
    if let Some(env) = &latest {
        publisher.publish_if_newer(env);
    }
    let mut wc = client.watch_client();
    let opts = WatchOptions::new().with_prefix().with_start_revision(at + 1);
    let mut stream = bounded("watch", wc.watch(keys.revs(), Some(opts))).await?;
    while let Some(msg) = stream.message().await.map_err(etcd_err)? {
        if msg.canceled() {
            return Err(StoreError::Etcd(format!(
                "watch canceled (compacted at {}): {}",
                msg.compact_revision(),
                msg.cancel_reason()
            )));
        }
        for ev in msg.events() {
            if ev.event_type() != EventType::Put {
                continue;
            }
            let Some(kv) = ev.kv() else { continue };
            match decode::<SignedPolicy>("watched revision", kv.value()) {
                Ok(env) => {
                    if publisher.publish_if_newer(&env) {
                        info!(version = env.version, "new policy revision from etcd");
                    }
                }
                Err(e) => warn!("{e}"),
            }
        }
    }
    Ok(())
}

impl PolicyStore for EtcdStore {
    fn kind(&self) -> &'static str {
        "etcd"
    }

    fn append(
        &self,
        expected_latest: Option<u64>,
        rev: SignedPolicy,
    ) -> BoxFut<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let keys = self.keys();
            if expected_latest.is_some_and(|e| e >= rev.version) {
                return Err(StoreError::Conflict {
                    expected: expected_latest,
                    actual: expected_latest,
                });
            }
            let guard = match expected_latest {
                None => Compare::create_revision(keys.latest(), CompareOp::Equal, 0),
                Some(v) => Compare::value(keys.latest(), CompareOp::Equal, v.to_string()),
            };
            let txn = Txn::new()
                .when([guard, Compare::create_revision(keys.rev(rev.version), CompareOp::Equal, 0)])
                .and_then([
                    TxnOp::put(keys.latest(), rev.version.to_string(), None),
                    TxnOp::put(keys.rev(rev.version), encode(&rev)?, None),
                ])
                .or_else([TxnOp::get(keys.latest(), None)]);
            let mut kv = self.client.kv_client();
            let resp = bounded("append", kv.txn(txn)).await?;
            if resp.succeeded() {
                self.publisher.publish_if_newer(&rev);
                return Ok(());
            }
            let actual = resp.op_responses().into_iter().find_map(|r| match r {
                TxnOpResponse::Get(g) => g.kvs().first().and_then(|kv| {
                    std::str::from_utf8(kv.value()).ok().and_then(|s| s.parse::<u64>().ok())
                }),
                _ => None,
            });
            Err(StoreError::Conflict { expected: expected_latest, actual })
        })
    }

    fn latest(&self) -> BoxFut<'_, Result<Option<SignedPolicy>, StoreError>> {
        Box::pin(async move { Ok(read_latest(&self.client, &self.keys()).await?.0) })
    }

    fn get(&self, version: u64) -> BoxFut<'_, Result<Option<SignedPolicy>, StoreError>> {
        Box::pin(async move {
            let mut kv = self.client.kv_client();
            let resp = bounded("get revision", kv.get(self.keys().rev(version), None)).await?;
            resp.kvs().first().map(|kv| decode("revision", kv.value())).transpose()
        })
    }

    fn history(&self) -> BoxFut<'_, Result<Vec<SignedPolicy>, StoreError>> {
        Box::pin(async move {
            let mut kv = self.client.kv_client();
            let opts =
                GetOptions::new().with_prefix().with_sort(SortTarget::Key, SortOrder::Ascend);
            let resp = bounded("history", kv.get(self.keys().revs(), Some(opts))).await?;
            resp.kvs().iter().map(|kv| decode("revision", kv.value())).collect()
        })
    }

    fn subscribe(&self) -> LatestRx {
        self.publisher.subscribe()
    }

    fn put_node(&self, rec: NodeRecord) -> BoxFut<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let mut kv = self.client.kv_client();
            bounded("put node", kv.put(self.keys().node(&rec.node), encode(&rec)?, None)).await?;
            Ok(())
        })
    }

    fn nodes(&self) -> BoxFut<'_, Result<Vec<NodeRecord>, StoreError>> {
        Box::pin(async move {
            let mut kv = self.client.kv_client();
            let opts =
                GetOptions::new().with_prefix().with_sort(SortTarget::Key, SortOrder::Ascend);
            let resp = bounded("nodes", kv.get(self.keys().nodes(), Some(opts))).await?;
            resp.kvs().iter().map(|kv| decode("node record", kv.value())).collect()
        })
    }

    fn insert_usage(
        &self,
        node: String,
        intervals: Vec<metering::ClosedInterval>,
    ) -> BoxFut<'_, Result<UploadOutcome, StoreError>> {
        Box::pin(async move {
            for i in &intervals {
                check_interval(&node, i).map_err(StoreError::Other)?;
            }
            let keys = self.keys();
            let mut out = UploadOutcome::default();
            let mut kv = self.client.kv_client();
            for i in &intervals {
                let key = keys.usage(&node, i.id.as_str());
                let body = encode(i)?;
                let txn = Txn::new()
                    .when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)])
                    .and_then([TxnOp::put(key.clone(), body.clone(), None)])
                    .or_else([TxnOp::get(key, None)]);
                let resp = bounded("insert usage", kv.txn(txn)).await?;
                if resp.succeeded() {
                    out.accepted += 1;
                    continue;
                }
                let same = resp.op_responses().into_iter().any(|r| match r {
                    TxnOpResponse::Get(g) => {
                        g.kvs().first().is_some_and(|kv| kv.value() == body.as_slice())
                    }
                    _ => false,
                });
                if same {
                    out.duplicates += 1;
                } else {
                    out.conflicts.push(i.id.to_string());
                }
            }
            Ok(out)
        })
    }

    fn usage_intervals(
        &self,
        from_ms: u64,
        to_ms: u64,
    ) -> BoxFut<'_, Result<Vec<(String, metering::ClosedInterval)>, StoreError>> {
        Box::pin(async move {
            let mut kv = self.client.kv_client();
            let keys = self.keys();
            let opts =
                GetOptions::new().with_prefix().with_sort(SortTarget::Key, SortOrder::Ascend);
            let resp = bounded("usage", kv.get(keys.usage_all(), Some(opts))).await?;
            let mut out = Vec::new();
            for item in resp.kvs() {
                let key = String::from_utf8_lossy(item.key());
                let node = key
                    .strip_prefix(&keys.usage_all())
                    .and_then(|rest| rest.split('/').next())
                    .ok_or_else(|| StoreError::Corrupt(format!("usage key {key}")))?
                    .to_string();
                let i: metering::ClosedInterval = decode("usage interval", item.value())?;
                let end = super::span_end(&i);
                if i.start_wall_ms < to_ms && (end > from_ms || i.start_wall_ms >= from_ms) {
                    out.push((node, i));
                }
            }
            Ok(out)
        })
    }
}
