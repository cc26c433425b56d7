//! The etcd store, for several coordinators sharing one etcd cluster.
//!
//! Keys (under a prefix, `/tessera` by default):
//!
//! | key | value |
//! |---|---|
//! | `{p}/fleet/signing-key` | the fleet's public key (hex): a coordinator with another key refuses to start |
//! | `{p}/policy/latest` | the latest version, decimal |
//! | `{p}/policy/rev/{version:020}` | the revision's envelope (JSON); never rewritten |
//! | `{p}/nodes/{node}` | the node's [`NodeRecord`] (JSON) |
//! | `{p}/usage-id/{node}/{interval id}` | the interval's `usage-end` key; created once (one id, one interval) |
//! | `{p}/usage-end/{end ms:020}/{node}/{interval id}` | the closed interval (JSON) |
//! | `{p}/proof/{key}` | the usage proofs' records: node keys, chain heads, signed segments (`crate::usage`) |
//!
//! Every read of many keys is paged ([`super::PAGE_REVISIONS`], [`super::PAGE_NODES`],
//! [`super::PAGE_USAGE`] keys per request, all pages at one etcd revision) and every value
//! is bounded, so no answer comes near the client's message limit ([`super::MAX_MESSAGE`])
//! however large the fleet grows. Usage is keyed by the time an interval ends, so a usage
//! query reads only the intervals that end at or after the window's start, and retention
//! ([`PolicyStore::prune_usage`]) deletes whole ranges of old ones.
//!
//! An append is one transaction: if `latest` still holds the version the pusher saw
//! (or does not exist yet) and the revision key does not exist, put both. Each
//! coordinator keeps an etcd watch on `{p}/policy/rev/` (from the revision it read the
//! latest at, so nothing is missed) and publishes every newer envelope to its long polls;
//! the watch is re-established with backoff when etcd goes away (or its start revision was
//! compacted away, [`super::compaction`]).

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, KvClient, SortOrder,
    SortTarget, Txn, TxnOp, TxnOpResponse, WatchOptions,
};
use tracing::{info, warn};

use super::{
    check_interval, check_revision, in_window, span_end, BoxFut, LatestRx, PolicyStore, Publisher,
    StoreError, MAX_MESSAGE, PAGE_NODES, PAGE_REVISIONS, PAGE_USAGE,
};
use crate::signing::SignedPolicy;
use crate::wire::{NodeRecord, UploadOutcome};

/// Bound on every unary etcd call.
const OP_TIMEOUT: Duration = Duration::from_secs(5);
/// Intervals inserted per transaction (two puts each; etcd's default `--max-txn-ops` is 128).
const USAGE_TXN: usize = 50;

/// The etcd store.
#[derive(Clone)]
pub struct EtcdStore {
    client: Client,
    prefix: String,
    publisher: Publisher,
    quota: Arc<super::election::EtcdQuota>,
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
    fn signing_key(&self) -> String {
        format!("{}/fleet/signing-key", self.prefix)
    }
    fn usage_id(&self, node: &str, id: &str) -> String {
        format!("{}/usage-id/{node}/{id}", self.prefix)
    }
    fn usage_ends(&self) -> String {
        format!("{}/usage-end/", self.prefix)
    }
    fn usage_end_from(&self, end_ms: u64) -> String {
        format!("{}/usage-end/{end_ms:020}/", self.prefix)
    }
    fn usage_end(&self, end_ms: u64, node: &str, id: &str) -> String {
        format!("{}/usage-end/{end_ms:020}/{node}/{id}", self.prefix)
    }
    fn proof(&self, key: &str) -> String {
        format!("{}/proof/{key}", self.prefix)
    }
}

/// Read every key in `[start, end)` in pages of `page` keys, all at the etcd revision of
/// the first page, handing each to `f` in key order.
async fn range_paged(
    kv: &mut KvClient,
    what: &str,
    start: Vec<u8>,
    end: Vec<u8>,
    page: i64,
    mut f: impl FnMut(&[u8], &[u8]) -> Result<(), StoreError>,
) -> Result<(), StoreError> {
    let mut from = start;
    let mut at: Option<i64> = None;
    loop {
        let mut opts = GetOptions::new()
            .with_range(end.clone())
            .with_limit(page)
            .with_sort(SortTarget::Key, SortOrder::Ascend);
        if let Some(rev) = at {
            opts = opts.with_revision(rev);
        }
        let resp = bounded(what, kv.get(from.clone(), Some(opts))).await?;
        if at.is_none() {
            at = resp.header().map(|h| h.revision());
        }
        for item in resp.kvs() {
            f(item.key(), item.value())?;
        }
        match resp.kvs().last() {
            Some(last) if resp.more() => {
                from = last.key().to_vec();
                from.push(0);
            }
            _ => return Ok(()),
        }
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
        // Pages are bounded far below this (see the module docs); the default 4 MiB would
        // be the only limit a growing fleet could meet.
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
        let quota = Arc::new(super::election::EtcdQuota::new(client.clone(), prefix.clone()));
        Ok(EtcdStore { client, prefix, publisher, quota, _watch: Arc::new(AbortOnDrop(task)) })
    }

    fn keys(&self) -> Keys {
        Keys { prefix: self.prefix.clone() }
    }

    fn kv(&self) -> KvClient {
        kv_of(&self.client)
    }
}

fn kv_of(client: &Client) -> KvClient {
    client.kv_client().max_decoding_message_size(MAX_MESSAGE)
}

/// The version a revision key names (`{p}/policy/rev/{version:020}`).
fn version_of_key(keys: &Keys, key: &[u8]) -> Option<u64> {
    std::str::from_utf8(key).ok()?.strip_prefix(&keys.revs())?.parse().ok()
}

/// A revision read under `key`: the envelope, or `None` (with a warning) when it is not
/// the revision of the version its key names (a copy under another key: planted or
/// corrupt, never used).
fn own_revision(keys: &Keys, key: &[u8], value: &[u8]) -> Result<Option<SignedPolicy>, StoreError> {
    let env: SignedPolicy = decode("revision", value)?;
    let named = version_of_key(keys, key);
    if named == Some(env.version) {
        return Ok(Some(env));
    }
    warn!(
        key = %String::from_utf8_lossy(key),
        version = env.version,
        "an etcd revision key holds a revision of another version: planted or corrupt; not used"
    );
    Ok(None)
}

/// The newest revision and the etcd revision it was read at: the revision `policy/latest`
/// names (every append moves both in one transaction), so a copy of an older revision put
/// under a higher key is never taken for the latest (before issue 28 it was, and every push
/// then lost its compare-and-set on `policy/latest` forever). A store without the pointer
/// (none was ever appended through it) is read by its highest key that holds its own
/// revision.
async fn read_latest(
    client: &Client,
    keys: &Keys,
) -> Result<(Option<SignedPolicy>, i64), StoreError> {
    let mut kv = kv_of(client);
    let resp = bounded("get latest", kv.get(keys.latest(), None)).await?;
    let at = resp.header().map(|h| h.revision()).unwrap_or(0);
    if let Some(pointer) = resp.kvs().first() {
        let version: u64 = std::str::from_utf8(pointer.value())
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .ok_or_else(|| StoreError::Corrupt(format!("{} is not a version", keys.latest())))?;
        let opts = GetOptions::new().with_revision(at);
        let resp = bounded("get latest", kv.get(keys.rev(version), Some(opts))).await?;
        let Some(item) = resp.kvs().first() else {
            return Err(StoreError::Corrupt(format!(
                "{} names version {version}, which the store does not hold",
                keys.latest()
            )));
        };
        return match own_revision(keys, item.key(), item.value())? {
            Some(env) => Ok((Some(env), at)),
            None => Err(super::misplaced(
                version,
                decode::<SignedPolicy>("revision", item.value())?.version,
            )),
        };
    }
    let mut latest = None;
    range_paged(
        &mut kv,
        "get latest",
        keys.revs().into_bytes(),
        super::etcd_range_end(&keys.revs()),
        PAGE_REVISIONS,
        |k, v| {
            if let Some(env) = own_revision(keys, k, v)? {
                latest = Some(env);
            }
            Ok(())
        },
    )
    .await?;
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
    let mut wc = client.watch_client().max_decoding_message_size(MAX_MESSAGE);
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
            match own_revision(keys, kv.key(), kv.value()) {
                Ok(Some(env)) => {
                    if publisher.publish_if_newer(&env) {
                        info!(version = env.version, "new policy revision from etcd");
                    }
                }
                Ok(None) => {}
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

    fn quota_backend(&self) -> Option<Arc<dyn super::QuotaBackend>> {
        Some(self.quota.clone())
    }

    fn append(
        &self,
        expected_latest: Option<u64>,
        rev: SignedPolicy,
    ) -> BoxFut<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let keys = self.keys();
            let body = encode(&rev)?;
            check_revision(&rev, body.len())?;
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
                    TxnOp::put(keys.rev(rev.version), body, None),
                ])
                .or_else([
                    TxnOp::get(keys.latest(), None),
                    TxnOp::get(keys.rev(rev.version), None),
                ]);
            let mut kv = self.kv();
            let resp = bounded("append", kv.txn(txn)).await?;
            if resp.succeeded() {
                self.publisher.publish_if_newer(&rev);
                return Ok(());
            }
            let mut gets = resp.op_responses().into_iter().filter_map(|r| match r {
                TxnOpResponse::Get(g) => Some(g),
                _ => None,
            });
            let actual = gets.next().and_then(|g| {
                g.kvs().first().and_then(|kv| {
                    std::str::from_utf8(kv.value()).ok().and_then(|s| s.parse::<u64>().ok())
                })
            });
            if actual == expected_latest {
                // The pointer is as the pusher saw it: the version's key is taken.
                if let Some(held) = gets.next().and_then(|g| g.kvs().first().cloned()) {
                    let holds =
                        decode::<SignedPolicy>("revision", held.value()).ok().map(|e| e.version);
                    return Err(StoreError::Occupied { key: rev.version, holds });
                }
            }
            Err(StoreError::Conflict { expected: expected_latest, actual })
        })
    }

    fn latest(&self) -> BoxFut<'_, Result<Option<SignedPolicy>, StoreError>> {
        Box::pin(async move { Ok(read_latest(&self.client, &self.keys()).await?.0) })
    }

    fn get(&self, version: u64) -> BoxFut<'_, Result<Option<SignedPolicy>, StoreError>> {
        Box::pin(async move {
            let mut kv = self.kv();
            let resp = bounded("get revision", kv.get(self.keys().rev(version), None)).await?;
            let Some(item) = resp.kvs().first() else { return Ok(None) };
            let env: SignedPolicy = decode("revision", item.value())?;
            if env.version != version {
                return Err(super::misplaced(version, env.version));
            }
            Ok(Some(env))
        })
    }

    fn history(&self) -> BoxFut<'_, Result<Vec<SignedPolicy>, StoreError>> {
        Box::pin(async move {
            let keys = self.keys();
            let revs = keys.revs();
            let mut out = Vec::new();
            range_paged(
                &mut self.kv(),
                "history",
                revs.clone().into_bytes(),
                super::etcd_range_end(&revs),
                PAGE_REVISIONS,
                |k, v| {
                    out.extend(own_revision(&keys, k, v)?);
                    Ok(())
                },
            )
            .await?;
            Ok(out)
        })
    }

    fn subscribe(&self) -> LatestRx {
        self.publisher.subscribe()
    }

    fn put_node(&self, rec: NodeRecord) -> BoxFut<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let body = super::node_record_json(&rec)?.into_bytes();
            let mut kv = self.kv();
            bounded("put node", kv.put(self.keys().node(&rec.node), body, None)).await?;
            Ok(())
        })
    }

    fn nodes(&self) -> BoxFut<'_, Result<Vec<NodeRecord>, StoreError>> {
        Box::pin(async move {
            let nodes = self.keys().nodes();
            let mut out = Vec::new();
            range_paged(
                &mut self.kv(),
                "nodes",
                nodes.clone().into_bytes(),
                super::etcd_range_end(&nodes),
                PAGE_NODES,
                |_, v| {
                    out.push(decode("node record", v)?);
                    Ok(())
                },
            )
            .await?;
            Ok(out)
        })
    }

    fn node(&self, node: String) -> BoxFut<'_, Result<Option<NodeRecord>, StoreError>> {
        Box::pin(async move {
            let mut kv = self.kv();
            let resp = bounded("get node", kv.get(self.keys().node(&node), None)).await?;
            resp.kvs().first().map(|kv| decode("node record", kv.value())).transpose()
        })
    }

    fn insert_usage(
        &self,
        node: String,
        intervals: Vec<metering::ClosedInterval>,
    ) -> BoxFut<'_, Result<UploadOutcome, StoreError>> {
        Box::pin(async move {
            for i in &intervals {
                check_interval(&node, i).map_err(StoreError::Invalid)?;
            }
            let keys = self.keys();
            let mut out = UploadOutcome::default();
            let mut kv = self.kv();
            for chunk in intervals.chunks(USAGE_TXN) {
                // The common case, new intervals: one transaction for the whole chunk.
                let mut guards = Vec::with_capacity(chunk.len());
                let mut puts = Vec::with_capacity(chunk.len() * 2);
                for i in chunk {
                    let id_key = keys.usage_id(&node, i.id.as_str());
                    let end_key = keys.usage_end(span_end(i), &node, i.id.as_str());
                    guards.push(Compare::create_revision(id_key.clone(), CompareOp::Equal, 0));
                    puts.push(TxnOp::put(id_key, end_key.clone(), None));
                    puts.push(TxnOp::put(end_key, encode(i)?, None));
                }
                let resp =
                    bounded("insert usage", kv.txn(Txn::new().when(guards).and_then(puts))).await?;
                if resp.succeeded() {
                    out.accepted += chunk.len() as u64;
                    continue;
                }
                // Some are stored already (a retried upload): one at a time.
                for i in chunk {
                    self.insert_one(&mut kv, &keys, &node, i, &mut out).await?;
                }
            }
            Ok(out)
        })
    }

    fn usage_by_ids(
        &self,
        node: String,
        ids: Vec<String>,
    ) -> BoxFut<'_, Result<Vec<metering::ClosedInterval>, StoreError>> {
        Box::pin(async move {
            let keys = self.keys();
            let mut kv = self.kv();
            let mut out = Vec::with_capacity(ids.len());
            for id in &ids {
                let at = bounded("read usage id", kv.get(keys.usage_id(&node, id), None)).await?;
                let Some(end_key) = at.kvs().first().map(|kv| kv.value().to_vec()) else {
                    continue;
                };
                let resp = bounded("read usage", kv.get(end_key, None)).await?;
                if let Some(item) = resp.kvs().first() {
                    out.push(decode("usage interval", item.value())?);
                }
            }
            Ok(out)
        })
    }

    fn proof_get(&self, key: String) -> BoxFut<'_, Result<Option<String>, StoreError>> {
        Box::pin(async move {
            let mut kv = self.kv();
            let resp = bounded("read a usage proof", kv.get(self.keys().proof(&key), None)).await?;
            Ok(resp.kvs().first().map(|kv| String::from_utf8_lossy(kv.value()).into_owned()))
        })
    }

    fn proof_cas(
        &self,
        key: String,
        expected: Option<String>,
        value: String,
    ) -> BoxFut<'_, Result<bool, StoreError>> {
        Box::pin(async move {
            let full = self.keys().proof(&key);
            let guard = match expected {
                None => Compare::create_revision(full.clone(), CompareOp::Equal, 0),
                Some(v) => Compare::value(full.clone(), CompareOp::Equal, v),
            };
            let txn = Txn::new().when([guard]).and_then([TxnOp::put(full, value, None)]);
            let resp = bounded("write a usage proof", self.kv().txn(txn)).await?;
            Ok(resp.succeeded())
        })
    }

    fn proof_range(
        &self,
        prefix: String,
        from: String,
        limit: usize,
    ) -> BoxFut<'_, Result<Vec<(String, String)>, StoreError>> {
        Box::pin(async move {
            let keys = self.keys();
            let start = if from > prefix { from } else { prefix.clone() };
            let root = keys.proof("");
            let opts = GetOptions::new()
                .with_range(keys.proof(&super::prefix_end(&prefix)))
                .with_limit(i64::try_from(limit).unwrap_or(i64::MAX))
                .with_sort(SortTarget::Key, SortOrder::Ascend);
            let resp =
                bounded("read usage proofs", self.kv().get(keys.proof(&start), Some(opts))).await?;
            Ok(resp
                .kvs()
                .iter()
                .map(|kv| {
                    let k = String::from_utf8_lossy(kv.key());
                    (
                        k.strip_prefix(&root).unwrap_or(&k).to_string(),
                        String::from_utf8_lossy(kv.value()).into_owned(),
                    )
                })
                .collect())
        })
    }

    fn usage_intervals(
        &self,
        from_ms: u64,
        to_ms: u64,
    ) -> BoxFut<'_, Result<Vec<(String, metering::ClosedInterval)>, StoreError>> {
        Box::pin(async move {
            let keys = self.keys();
            let ends = keys.usage_ends();
            let mut out = Vec::new();
            // Intervals that end before the window cannot touch it: start at `from_ms`.
            range_paged(
                &mut self.kv(),
                "usage",
                keys.usage_end_from(from_ms).into_bytes(),
                super::etcd_range_end(&ends),
                PAGE_USAGE,
                |k, v| {
                    let key = String::from_utf8_lossy(k);
                    let node = key
                        .strip_prefix(&ends)
                        .and_then(|rest| rest.split('/').nth(1))
                        .ok_or_else(|| StoreError::Corrupt(format!("usage key {key}")))?
                        .to_string();
                    let i: metering::ClosedInterval = decode("usage interval", v)?;
                    if in_window(&i, from_ms, to_ms) {
                        out.push((node, i));
                    }
                    Ok(())
                },
            )
            .await?;
            out.sort_by(|(na, a), (nb, b)| (na, &a.id.0).cmp(&(nb, &b.id.0)));
            Ok(out)
        })
    }

    fn prune_usage(&self, before_ms: u64) -> BoxFut<'_, Result<u64, StoreError>> {
        Box::pin(async move {
            let keys = self.keys();
            let ends = keys.usage_ends();
            let mut kv = self.kv();
            let mut pruned = 0u64;
            loop {
                // One page of the oldest intervals at a time: their id keys and themselves.
                let opts = GetOptions::new()
                    .with_range(keys.usage_end_from(before_ms).into_bytes())
                    .with_limit(PAGE_USAGE)
                    .with_keys_only();
                let resp = bounded("prune usage", kv.get(ends.clone(), Some(opts))).await?;
                if resp.kvs().is_empty() {
                    return Ok(pruned);
                }
                let mut dels = Vec::new();
                for item in resp.kvs() {
                    let key = String::from_utf8_lossy(item.key()).into_owned();
                    let mut parts = key.strip_prefix(&ends).unwrap_or_default().splitn(3, '/');
                    let (_end, node, id) = (parts.next(), parts.next(), parts.next());
                    if let (Some(node), Some(id)) = (node, id) {
                        dels.push(TxnOp::delete(keys.usage_id(node, id), None));
                    }
                    dels.push(TxnOp::delete(key, None));
                }
                for ops in dels.chunks(100) {
                    bounded("prune usage", kv.txn(Txn::new().and_then(ops.to_vec()))).await?;
                }
                pruned += resp.kvs().len() as u64;
            }
        })
    }

    fn ping(&self) -> BoxFut<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let mut kv = self.kv();
            bounded("ping", kv.get(self.keys().latest(), None)).await?;
            Ok(())
        })
    }

    fn revision(&self) -> BoxFut<'_, Result<Option<i64>, StoreError>> {
        Box::pin(async move {
            let mut kv = self.kv();
            let opts = GetOptions::new().with_count_only();
            let resp =
                bounded("read the revision", kv.get(self.keys().latest(), Some(opts))).await?;
            let header = resp
                .header()
                .ok_or_else(|| StoreError::Etcd("an answer without a header".into()))?;
            Ok(Some(header.revision()))
        })
    }

    fn compact(&self, revision: i64) -> BoxFut<'_, Result<bool, StoreError>> {
        Box::pin(async move {
            let mut kv = self.kv();
            match tokio::time::timeout(OP_TIMEOUT, kv.compact(revision, None)).await {
                Ok(Ok(_)) => Ok(true),
                // etcd's ErrCompacted: another coordinator got there first.
                Ok(Err(e)) if e.to_string().contains("required revision has been compacted") => {
                    Ok(false)
                }
                Ok(Err(e)) => Err(etcd_err(e)),
                Err(_) => Err(StoreError::Etcd(format!(
                    "compact to revision {revision}: no answer from etcd in {OP_TIMEOUT:?}"
                ))),
            }
        })
    }

    fn claim_signing_key(&self, public_key: String) -> BoxFut<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let keys = self.keys();
            let mut kv = self.kv();
            let ours = key_id_of_hex(&public_key)?;
            let resp = bounded("read the fleet key", kv.get(keys.signing_key(), None)).await?;
            if let Some(stored) = resp.kvs().first() {
                let stored = String::from_utf8_lossy(stored.value()).trim().to_string();
                if stored != public_key {
                    return Err(StoreError::ForeignKey { stored: key_id_of_hex(&stored)?, ours });
                }
                return Ok(());
            }
            // Not bound yet: a store with revisions belongs to the key its latest claims.
            let (latest, _) = read_latest(&self.client, &keys).await?;
            if let Some(l) = latest.filter(|l| !l.key_id.is_empty() && l.key_id != ours) {
                return Err(StoreError::ForeignKey { stored: l.key_id, ours });
            }
            let txn = Txn::new()
                .when([Compare::create_revision(keys.signing_key(), CompareOp::Equal, 0)])
                .and_then([TxnOp::put(keys.signing_key(), public_key.clone(), None)])
                .or_else([TxnOp::get(keys.signing_key(), None)]);
            let resp = bounded("bind the fleet key", kv.txn(txn)).await?;
            if resp.succeeded() {
                info!(prefix = %self.prefix, key_id = %ours, "etcd prefix bound to this fleet signing key");
                return Ok(());
            }
            // Another coordinator bound it meanwhile.
            let stored = resp.op_responses().into_iter().find_map(|r| match r {
                TxnOpResponse::Get(g) => {
                    g.kvs().first().map(|kv| String::from_utf8_lossy(kv.value()).trim().to_string())
                }
                _ => None,
            });
            match stored {
                Some(s) if s == public_key => Ok(()),
                Some(s) => Err(StoreError::ForeignKey { stored: key_id_of_hex(&s)?, ours }),
                None => Err(StoreError::Etcd("binding the fleet key: no answer".into())),
            }
        })
    }
}

/// The key id of a hex public key.
fn key_id_of_hex(hex_key: &str) -> Result<String, StoreError> {
    crate::signing::parse_verifying_key(hex_key, "the fleet signing key in the store")
        .map(|k| crate::signing::key_id(&k))
        .map_err(|e| StoreError::Corrupt(e.to_string()))
}

impl EtcdStore {
    /// Insert one interval unless its id is stored; a stored one is a duplicate when its
    /// content is the same, else a conflict (the first upload is kept).
    async fn insert_one(
        &self,
        kv: &mut KvClient,
        keys: &Keys,
        node: &str,
        i: &metering::ClosedInterval,
        out: &mut UploadOutcome,
    ) -> Result<(), StoreError> {
        let id_key = keys.usage_id(node, i.id.as_str());
        let end_key = keys.usage_end(span_end(i), node, i.id.as_str());
        let body = encode(i)?;
        let txn = Txn::new()
            .when([Compare::create_revision(id_key.clone(), CompareOp::Equal, 0)])
            .and_then([
                TxnOp::put(id_key.clone(), end_key.clone(), None),
                TxnOp::put(end_key, body.clone(), None),
            ])
            .or_else([TxnOp::get(id_key, None)]);
        let resp = bounded("insert usage", kv.txn(txn)).await?;
        if resp.succeeded() {
            out.accepted += 1;
            return Ok(());
        }
        let stored_at = resp.op_responses().into_iter().find_map(|r| match r {
            TxnOpResponse::Get(g) => g.kvs().first().map(|kv| kv.value().to_vec()),
            _ => None,
        });
        let same = match stored_at {
            Some(at) => {
                let resp = bounded("read usage", kv.get(at, None)).await?;
                resp.kvs().first().is_some_and(|kv| kv.value() == body.as_slice())
            }
            None => false,
        };
        if same {
            out.duplicates += 1;
        } else {
            out.conflicts.push(i.id.to_string());
        }
        Ok(())
    }
}
