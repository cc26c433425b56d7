//! The quota books in etcd and the election of the coordinator that decides them (issue 28,
//! docs/QUOTAS.md "Books every coordinator shares").
//!
//! Keys (under the store's prefix):
//!
//! | key | value |
//! |---|---|
//! | `{p}/quota/leader/{lease:016x}` | a [`Candidate`] (JSON), put under the candidate's lease |
//! | `{p}/quota/books/node/{node}` | the node's record: capacity, leases issued and reported, containers it stops ([`NodeState`], holdings empty) |
//! | `{p}/quota/books/holding/{node}/{container}` | one holding of the node's last sync that changed it ([`Holding`]) |
//! | `{p}/quota/books/pending/{node}/{container}` | an admission not yet listed by its node ([`PendingState`]) |
//! | `{p}/quota/books/reclaim/{node}/{tenant}/#{claim in hex}` | a reclaim in progress ([`ReclaimState`]) |
//! | `{p}/quota/books/rebuilding` | present while the books are rebuilt from the nodes' syncs: since when |
//! | `{p}/quota/books/waiting/{node}/{container}` | a request in the fair queue ([`WaitingState`]) |
//! | `{p}/quota/books/ask/{node}/{tenant}/#{claim in hex}` | a claim's first ask and owed-since ([`AskState`]) |
//! | `{p}/quota/books/requeue/{tenant}/#{claim in hex}` | preempted work's requeue backoff ([`RequeueState`]) |
//! | `{p}/quota/books/record/{tenant}` | the tenant's record: work lost to preemption, preemption times, owner and owed-later waits, reclaims and preemptions counted ([`RecordState`]), written at most every 5 s |
//! | `{p}/quota/books/event/{seq:016x}` | one quota event of a kind stored with the record (a reclaim, a preemption, a lease run out, a gang timed out, a node removed: [`EventState`]), written at most every 5 s, deleted when the books no longer keep it |
//! | `{p}/quota/books/record-mark` | who handed the record out last: the leadership's term and a count ([`RecordMark`]), written after the records and events of each hand-out |
//! | `{p}/quota/books/queue-kept` | the stored fair queue is whole, written with every batch of books that keep it: it counts only if no other books key has a later revision ([`BooksState::queue_kept`]) |
//!
//! **Election.** Each coordinator grants itself a lease of the leader TTL, puts its key under
//! it, and keeps it alive (every third of the TTL). The candidate whose key has the oldest
//! create revision leads: it decides, and that revision (with the key) is its fencing
//! token. A follower watches the prefix and looks again at every change. A leader whose lease
//! is lost (a keep-alive unanswered within the TTL, its key deleted, etcd gone) says so at
//! once and campaigns again; one that stops revokes its lease, so the next takes over at
//! once. Until the lease runs out nobody else can lead: a coordinator killed with `kill -9`
//! is followed after at most the TTL (plus etcd's expiry check, every 500 ms).
//!
//! **Fencing.** Every write to the books is a transaction whose condition is that the
//! leader's key still exists with the revision it was created at: a deposed leader's writes
//! fail ([`StoreError::Deposed`]), whatever it believes. A new leader reads the books after
//! its election (a linearizable read): it sees every write of the one before.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, DeleteOptions, EventType, GetOptions, PutOptions, SortOrder,
    SortTarget, Txn, TxnOp, WatchOptions,
};
use fleet::quota_wire::{Authority, Holding};
use quota::books::state::{
    AskState, BooksState, EventState, NodeState, PendingState, ReclaimState, RecordMark,
    RecordState, RequeueState, StateOp, WaitingState,
};
use tokio::sync::watch;
use tracing::{info, warn};

use super::{mono_ms, BoxFut, Candidate, Fence, QuotaBackend, Role, StoreError, MAX_MESSAGE};

/// Operations per books transaction (etcd's default `--max-txn-ops` is 128).
pub const MAX_BOOKS_TXN_OPS: usize = 100;
/// Bytes of values per books transaction (etcd's default `--max-request-bytes` is 1.5 MiB).
pub const MAX_BOOKS_TXN_BYTES: usize = 1 << 20;
/// Keys per range request when the books are read.
pub const BOOKS_PAGE: i64 = 1000;
/// Bound on every unary etcd call of the election and the books.
const OP_TIMEOUT: Duration = Duration::from_secs(5);

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

fn encode<T: serde::Serialize>(v: &T) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(v).map_err(|e| StoreError::Other(format!("encode: {e}")))
}

fn decode<T: serde::de::DeserializeOwned>(what: &str, bytes: &[u8]) -> Result<T, StoreError> {
    serde_json::from_slice(bytes).map_err(|e| StoreError::Corrupt(format!("{what}: {e}")))
}

/// A claim (a workload or container id, which may hold `/`) in hex: no two (tenant, claim)
/// pairs share a key.
fn hex(claim: &str) -> String {
    claim.bytes().map(|b| format!("{b:02x}")).collect()
}

/// The books and the election of one fleet (one prefix) on etcd.
#[derive(Clone)]
pub(crate) struct EtcdQuota {
    client: Client,
    prefix: String,
    scope: Arc<tokio::sync::OnceCell<String>>,
}

impl std::fmt::Debug for EtcdQuota {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdQuota").field("prefix", &self.prefix).finish_non_exhaustive()
    }
}

/// One write to etcd: a put, a delete of one key, or a delete of a key and everything under
/// a prefix (a node and its holdings).
enum Write {
    Put(String, Vec<u8>),
    Delete(String),
    DeleteTree(String, String),
}

impl Write {
    /// The keys it touches: one key, or a key and a prefix.
    fn touches(&self) -> (&str, Option<&str>) {
        match self {
            Write::Put(k, _) | Write::Delete(k) => (k, None),
            Write::DeleteTree(k, p) => (k, Some(p)),
        }
    }

    fn size(&self) -> usize {
        match self {
            Write::Put(k, v) => k.len() + v.len(),
            Write::Delete(k) => k.len(),
            Write::DeleteTree(k, p) => k.len() + p.len(),
        }
    }

    fn op(self) -> Vec<TxnOp> {
        match self {
            Write::Put(k, v) => vec![TxnOp::put(k, v, None)],
            Write::Delete(k) => vec![TxnOp::delete(k, None)],
            Write::DeleteTree(k, p) => {
                vec![
                    TxnOp::delete(k, None),
                    TxnOp::delete(p, Some(DeleteOptions::new().with_prefix())),
                ]
            }
        }
    }
}

impl EtcdQuota {
    pub(crate) fn new(client: Client, prefix: String) -> EtcdQuota {
        EtcdQuota { client, prefix, scope: Arc::new(tokio::sync::OnceCell::new()) }
    }

    fn id_key(&self) -> String {
        format!("{}/quota/id", self.prefix)
    }

    fn leaders(&self) -> String {
        format!("{}/quota/leader/", self.prefix)
    }
    fn books(&self) -> String {
        format!("{}/quota/books/", self.prefix)
    }
    fn node_key(&self, node: &str) -> String {
        format!("{}/quota/books/node/{node}", self.prefix)
    }
    fn holdings_of(&self, node: &str) -> String {
        format!("{}/quota/books/holding/{node}/", self.prefix)
    }
    fn holding_key(&self, node: &str, container: &str) -> String {
        format!("{}/quota/books/holding/{node}/{container}", self.prefix)
    }
    fn pending_key(&self, node: &str, container: &str) -> String {
        format!("{}/quota/books/pending/{node}/{container}", self.prefix)
    }
    /// A reclaim in progress (the claim in hex).
    fn reclaim_key(&self, node: &str, tenant: &str, claim: &str) -> String {
        format!("{}/quota/books/reclaim/{node}/{tenant}/#{}", self.prefix, hex(claim))
    }
    /// Present while the books are being rebuilt from the nodes' syncs: since when.
    fn rebuilding_key(&self) -> String {
        format!("{}/quota/books/rebuilding", self.prefix)
    }
    fn waiting_key(&self, node: &str, container: &str) -> String {
        format!("{}/quota/books/waiting/{node}/{container}", self.prefix)
    }
    /// A claim's first ask (the claim in hex, as for a reclaim).
    fn ask_key(&self, node: &str, tenant: &str, claim: &str) -> String {
        format!("{}/quota/books/ask/{node}/{tenant}/#{}", self.prefix, hex(claim))
    }
    fn requeue_key(&self, tenant: &str, claim: &str) -> String {
        format!("{}/quota/books/requeue/{tenant}/#{}", self.prefix, hex(claim))
    }
    /// Present once the stored fair queue is whole.
    fn queue_kept_key(&self) -> String {
        format!("{}/quota/books/queue-kept", self.prefix)
    }
    fn record_key(&self, tenant: &str) -> String {
        format!("{}/quota/books/record/{tenant}", self.prefix)
    }
    fn event_key(&self, seq: u64) -> String {
        format!("{}/quota/books/event/{seq:016x}", self.prefix)
    }
    fn record_mark_key(&self) -> String {
        format!("{}/quota/books/record-mark", self.prefix)
    }

    fn kv(&self) -> etcd_client::KvClient {
        self.client.kv_client().max_decoding_message_size(MAX_MESSAGE)
    }

    fn write_of(&self, op: StateOp) -> Result<Write, StoreError> {
        Ok(match op {
            StateOp::PutNode { node, state } => Write::Put(self.node_key(&node), encode(&state)?),
            StateOp::DelNode { node } => {
                Write::DeleteTree(self.node_key(&node), self.holdings_of(&node))
            }
            StateOp::PutHolding { node, holding } => {
                Write::Put(self.holding_key(&node, &holding.container_id), encode(&holding)?)
            }
            StateOp::DelHolding { node, container_id } => {
                Write::Delete(self.holding_key(&node, &container_id))
            }
            StateOp::PutPending(p) => {
                Write::Put(self.pending_key(&p.node, &p.container_id), encode(&p)?)
            }
            StateOp::DelPending { node, container_id } => {
                Write::Delete(self.pending_key(&node, &container_id))
            }
            StateOp::PutReclaim(r) => {
                Write::Put(self.reclaim_key(&r.node, &r.tenant, &r.claim), encode(&r)?)
            }
            StateOp::DelReclaim { node, tenant, claim } => {
                Write::Delete(self.reclaim_key(&node, &tenant, &claim))
            }
            StateOp::PutRebuilding { since_ms } => {
                Write::Put(self.rebuilding_key(), encode(&since_ms)?)
            }
            StateOp::DelRebuilding => Write::Delete(self.rebuilding_key()),
            StateOp::PutWaiting(w) => {
                Write::Put(self.waiting_key(&w.node, &w.container_id), encode(&w)?)
            }
            StateOp::DelWaiting { node, container_id } => {
                Write::Delete(self.waiting_key(&node, &container_id))
            }
            StateOp::PutAsk(a) => {
                Write::Put(self.ask_key(&a.node, &a.tenant, &a.claim), encode(&a)?)
            }
            StateOp::DelAsk { node, tenant, claim } => {
                Write::Delete(self.ask_key(&node, &tenant, &claim))
            }
            StateOp::PutRequeue(q) => {
                Write::Put(self.requeue_key(&q.tenant, &q.claim), encode(&q)?)
            }
            StateOp::DelRequeue { tenant, claim } => {
                Write::Delete(self.requeue_key(&tenant, &claim))
            }
            StateOp::PutQueueKept => Write::Put(self.queue_kept_key(), encode(&true)?),
            StateOp::PutRecord(r) => Write::Put(self.record_key(&r.tenant), encode(&r)?),
            StateOp::DelRecord { tenant } => Write::Delete(self.record_key(&tenant)),
            StateOp::PutRecordMark(m) => Write::Put(self.record_mark_key(), encode(&m)?),
            StateOp::PutEvent(e) => Write::Put(self.event_key(e.seq), encode(&e)?),
            StateOp::DelEvent { seq } => Write::Delete(self.event_key(seq)),
        })
    }

    /// One fenced transaction of `writes`.
    async fn commit_txn(&self, fence: &Fence, writes: Vec<Write>) -> Result<(), StoreError> {
        if writes.is_empty() {
            return Ok(());
        }
        let ops: Vec<TxnOp> = writes.into_iter().flat_map(Write::op).collect();
        let txn = Txn::new()
            .when([Compare::create_revision(fence.key.clone(), CompareOp::Equal, fence.revision)])
            .and_then(ops);
        let resp = bounded("write the quota books", self.kv().txn(txn)).await?;
        if resp.succeeded() {
            Ok(())
        } else {
            Err(StoreError::Deposed(format!(
                "its election key {} (revision {}) is gone: its lease ran out or was revoked",
                fence.key, fence.revision
            )))
        }
    }

    /// One campaign: until this leadership (or candidacy) ends.
    async fn campaign_once(
        &self,
        me: &Candidate,
        ttl: Duration,
        role: &watch::Sender<Role>,
        lease_slot: &mut Option<i64>,
    ) -> Result<(), StoreError> {
        let mut leases = self.client.lease_client();
        let ttl_s = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let asked_at = mono_ms();
        let grant = bounded("grant a lease", leases.grant(ttl_s, None)).await?;
        let lease = grant.id();
        *lease_slot = Some(lease);
        // etcd grants at least its own minimum (3/2 of its election timeout).
        let granted_ms = u64::try_from(grant.ttl().max(1)).unwrap_or(1).saturating_mul(1000);
        let valid_until = Arc::new(AtomicU64::new(asked_at.saturating_add(granted_ms)));
        let key = format!("{}{lease:016x}", self.leaders());
        let txn =
            Txn::new().when([Compare::create_revision(key.clone(), CompareOp::Equal, 0)]).and_then(
                [TxnOp::put(key.clone(), encode(me)?, Some(PutOptions::new().with_lease(lease)))],
            );
        let resp = bounded("campaign", self.kv().txn(txn)).await?;
        let revision = resp
            .header()
            .map(|h| h.revision())
            .ok_or_else(|| StoreError::Etcd("campaign: an answer without a header".into()))?;
        let fence = Fence { key: key.clone(), revision, lease };
        let (mut keeper, mut stream) =
            bounded("keep the lease alive", leases.keep_alive(lease)).await?;
        let lost = Arc::new(tokio::sync::Notify::new());
        let keep = {
            let (valid_until, lost) = (valid_until.clone(), lost.clone());
            let every = Duration::from_millis((granted_ms / 3).max(100));
            let wait = Duration::from_millis(granted_ms);
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                loop {
                    tick.tick().await;
                    let sent = mono_ms();
                    if keeper.keep_alive().await.is_err() {
                        break;
                    }
                    match tokio::time::timeout(wait, stream.message()).await {
                        Ok(Ok(Some(r))) if r.ttl() > 0 => {
                            let ms = u64::try_from(r.ttl()).unwrap_or(0).saturating_mul(1000);
                            valid_until.store(sent.saturating_add(ms), Ordering::SeqCst);
                        }
                        _ => break,
                    }
                }
                lost.notify_one();
            })
        };
        struct Abort(tokio::task::JoinHandle<()>);
        impl Drop for Abort {
            fn drop(&mut self) {
                self.0.abort();
            }
        }
        let _keep = Abort(keep);
        let mut leading = false;
        let mut wc = self.client.watch_client().max_decoding_message_size(MAX_MESSAGE);
        loop {
            // The oldest candidate leads.
            let opts = GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Create, SortOrder::Ascend)
                .with_limit(1);
            let resp =
                bounded("read the election", self.kv().get(self.leaders(), Some(opts))).await?;
            let at = resp.header().map(|h| h.revision()).unwrap_or(0);
            let first = resp.kvs().first();
            let first_rev = first.map(|kv| kv.create_revision());
            if first_rev == Some(revision) {
                if !leading {
                    leading = true;
                    let authority = Authority {
                        url: me.url.clone(),
                        term: u64::try_from(revision).unwrap_or(0),
                        since_ms: fleet::now_ms(),
                        scope: self.scope().await?,
                    };
                    info!(url = %me.url, term = revision, "this coordinator decides the quota books");
                    role.send_replace(Role::Leader {
                        authority,
                        fence: fence.clone(),
                        valid_until: valid_until.clone(),
                    });
                }
            } else if first_rev.is_none() || leading {
                // Our own key is gone (or we were leading and are not any more).
                return Err(StoreError::Deposed(format!(
                    "the election key {key} is gone or no longer the oldest"
                )));
            } else if let Some(kv) = first {
                let c: Candidate = decode("election candidate", kv.value())?;
                let leader = Authority {
                    url: c.url,
                    term: u64::try_from(kv.create_revision()).unwrap_or(0),
                    since_ms: c.since_ms,
                    scope: self.scope().await?,
                };
                if role.borrow().authority() != Some(&leader) {
                    info!(leader = %leader.url, term = leader.term, "another coordinator decides the quota books");
                    role.send_replace(Role::Follower { leader: Some(leader) });
                }
            }
            // Wait for a change under the prefix, or for the lease to go.
            let opts = WatchOptions::new().with_prefix().with_start_revision(at + 1);
            let mut events =
                bounded("watch the election", wc.watch(self.leaders(), Some(opts))).await?;
            loop {
                tokio::select! {
                    msg = events.message() => {
                        let msg = msg.map_err(etcd_err)?;
                        let Some(msg) = msg else { break };
                        if msg.canceled() {
                            break;
                        }
                        let ours_gone = msg.events().iter().any(|e| {
                            e.event_type() == EventType::Delete
                                && e.kv().is_some_and(|kv| kv.key() == key.as_bytes())
                        });
                        if ours_gone {
                            return Err(StoreError::Deposed(format!("the election key {key} was deleted")));
                        }
                        if !msg.events().is_empty() {
                            break;
                        }
                    }
                    _ = lost.notified() => {
                        return Err(StoreError::Deposed(format!(
                            "the lease of {key} could not be kept alive"
                        )));
                    }
                }
            }
        }
    }
}

impl QuotaBackend for EtcdQuota {
    fn scope(&self) -> BoxFut<'_, Result<String, StoreError>> {
        Box::pin(async move {
            let id = self
                .scope
                .get_or_try_init(|| async {
                    let mine = super::fresh_id(&self.prefix);
                    let txn = Txn::new()
                        .when([Compare::create_revision(self.id_key(), CompareOp::Equal, 0)])
                        .and_then([TxnOp::put(self.id_key(), mine, None)])
                        .or_else([TxnOp::get(self.id_key(), None)]);
                    bounded("name the quota books", self.kv().txn(txn)).await?;
                    let resp =
                        bounded("name the quota books", self.kv().get(self.id_key(), None)).await?;
                    let id = resp
                        .kvs()
                        .first()
                        .map(|kv| String::from_utf8_lossy(kv.value()).into_owned())
                        .ok_or_else(|| {
                            StoreError::Etcd(format!("{} is not there", self.id_key()))
                        })?;
                    Ok::<String, StoreError>(format!("etcd:{id}"))
                })
                .await?;
            Ok(id.clone())
        })
    }

    fn campaign(
        &self,
        me: Candidate,
        ttl: Duration,
        role: Arc<watch::Sender<Role>>,
    ) -> BoxFut<'_, ()> {
        Box::pin(async move {
            let mut backoff = Duration::from_millis(100);
            loop {
                let mut lease = None;
                let r = self.campaign_once(&me, ttl, &role, &mut lease).await;
                // Whatever ended it: this coordinator decides nothing from now.
                role.send_replace(Role::Follower { leader: None });
                if let Some(id) = lease {
                    let mut leases = self.client.lease_client();
                    let _ = tokio::time::timeout(OP_TIMEOUT, leases.revoke(id)).await;
                }
                match r {
                    Ok(()) => backoff = Duration::from_millis(100),
                    Err(e @ StoreError::Deposed(_)) => {
                        warn!("quota election: {e}; campaigning again");
                        backoff = Duration::from_millis(100);
                        continue;
                    }
                    Err(e) => warn!("quota election: {e}; campaigning again in {backoff:?}"),
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        })
    }

    fn resign(&self, fence: Fence) -> BoxFut<'_, ()> {
        Box::pin(async move {
            let mut leases = self.client.lease_client();
            match tokio::time::timeout(OP_TIMEOUT, leases.revoke(fence.lease)).await {
                Ok(Ok(_)) => info!(key = %fence.key, "resigned the quota books"),
                Ok(Err(e)) => warn!("resigning the quota books: {e}"),
                Err(_) => warn!("resigning the quota books: no answer from etcd in {OP_TIMEOUT:?}"),
            }
        })
    }

    fn load_books(&self) -> BoxFut<'_, Result<BooksState, StoreError>> {
        Box::pin(async move {
            let books = self.books();
            let mut state = BooksState::default();
            let mut holdings: Vec<(String, Holding)> = Vec::new();
            let mut kv = self.kv();
            let mut from = books.clone().into_bytes();
            let end = super::etcd_range_end(&books);
            let mut at: Option<i64> = None;
            // The queue's mark counts only if no other books key was written after it: a
            // coordinator that does not store the queue may have decided since.
            let (mut mark_rev, mut latest_rev) = (None, 0i64);
            loop {
                let mut opts = GetOptions::new().with_range(end.clone()).with_limit(BOOKS_PAGE);
                if let Some(rev) = at {
                    opts = opts.with_revision(rev);
                }
                let resp =
                    bounded("read the quota books", kv.get(from.clone(), Some(opts))).await?;
                if at.is_none() {
                    at = resp.header().map(|h| h.revision());
                }
                for item in resp.kvs() {
                    let key = String::from_utf8_lossy(item.key()).into_owned();
                    let rest = key.strip_prefix(&books).unwrap_or_default();
                    let (kind, name) = rest.split_once('/').unwrap_or((rest, ""));
                    if kind != "queue-kept" {
                        latest_rev = latest_rev.max(item.mod_revision());
                    }
                    match kind {
                        "node" => {
                            let n: NodeState = decode("quota books node", item.value())?;
                            state.nodes.insert(name.to_string(), n);
                        }
                        "holding" => {
                            let node = name.split_once('/').map_or(name, |(n, _)| n);
                            holdings.push((
                                node.to_string(),
                                decode("quota books holding", item.value())?,
                            ));
                        }
                        "pending" => state
                            .pending
                            .push(decode::<PendingState>("quota books pending", item.value())?),
                        "reclaim" => state
                            .reclaims
                            .push(decode::<ReclaimState>("quota books reclaim", item.value())?),
                        "rebuilding" => {
                            state.rebuilding_since_ms =
                                Some(decode("quota books rebuilding", item.value())?);
                        }
                        "waiting" => state
                            .waiting
                            .push(decode::<WaitingState>("quota books waiting", item.value())?),
                        "ask" => {
                            state.asks.push(decode::<AskState>("quota books ask", item.value())?)
                        }
                        "requeue" => state
                            .requeues
                            .push(decode::<RequeueState>("quota books requeue", item.value())?),
                        "record" => state
                            .records
                            .push(decode::<RecordState>("quota books record", item.value())?),
                        "event" => state
                            .events
                            .push(decode::<EventState>("quota books event", item.value())?),
                        "record-mark" => {
                            state.record_mark =
                                Some(decode::<RecordMark>("quota books record-mark", item.value())?)
                        }
                        "queue-kept" => {
                            let kept: bool = decode("quota books queue-kept", item.value())?;
                            mark_rev = kept.then(|| item.mod_revision());
                        }
                        other => warn!(key = %key, "unknown quota books key ({other}); ignored"),
                    }
                }
                match resp.kvs().last() {
                    Some(last) if resp.more() => {
                        from = last.key().to_vec();
                        from.push(0);
                    }
                    _ => break,
                }
            }
            state.queue_kept = mark_rev.is_some_and(|m| m >= latest_rev);
            if mark_rev.is_some() && !state.queue_kept {
                warn!(
                    "the stored fair queue is older than the books (a coordinator that does not \
                     store it decided since): relearned from the requests asking again"
                );
            }
            for (node, h) in holdings {
                // A holding whose node record is gone went with it (a deletion interrupted
                // half-way cannot happen: one transaction deletes both).
                if let Some(n) = state.nodes.get_mut(&node) {
                    n.holdings.push(h);
                }
            }
            Ok(state)
        })
    }

    fn commit_books(&self, fence: Fence, ops: Vec<StateOp>) -> BoxFut<'_, Result<(), StoreError>> {
        Box::pin(async move {
            // The fair queue's mark comes with every batch the journal gathers here: it is
            // written once, in the last transaction (its revision is then the latest; a
            // coordinator gone between two transactions leaves it older, and the next one
            // relearns the queue). Written with each batch, it split every gathered batch
            // into a transaction of its own (a key touched twice), and at 2,000 nodes the
            // journal fell seconds behind the syncs.
            let mark = ops.iter().any(|o| matches!(o, StateOp::PutQueueKept));
            let ops = ops.into_iter().filter(|o| !matches!(o, StateOp::PutQueueKept));
            let ops = ops.chain(mark.then_some(StateOp::PutQueueKept));
            // In order, in as few transactions as the limits allow; a key touched twice
            // (or under a prefix deleted) starts a new transaction, so every transaction
            // is valid to etcd and the order of the changes is kept.
            let mut txn: Vec<Write> = Vec::new();
            let (mut keys, mut trees): (BTreeSet<String>, Vec<String>) = Default::default();
            let (mut n_ops, mut bytes) = (0usize, 0usize);
            for op in ops {
                let w = self.write_of(op)?;
                let (key, tree) = w.touches();
                let clash = keys.contains(key)
                    || trees.iter().any(|t| key.starts_with(t.as_str()))
                    || tree.is_some_and(|t| keys.iter().any(|k| k.starts_with(t)));
                let ops_of = if tree.is_some() { 2 } else { 1 };
                if clash
                    || n_ops + ops_of > MAX_BOOKS_TXN_OPS
                    || bytes + w.size() > MAX_BOOKS_TXN_BYTES
                {
                    self.commit_txn(&fence, std::mem::take(&mut txn)).await?;
                    keys.clear();
                    trees.clear();
                    (n_ops, bytes) = (0, 0);
                }
                let (key, tree) = w.touches();
                keys.insert(key.to_string());
                if let Some(t) = tree {
                    trees.push(t.to_string());
                }
                n_ops += ops_of;
                bytes += w.size();
                txn.push(w);
            }
            self.commit_txn(&fence, txn).await
        })
    }

    fn coordinators(&self) -> BoxFut<'_, Result<Vec<(Candidate, i64)>, StoreError>> {
        Box::pin(async move {
            let opts = GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Create, SortOrder::Ascend)
                .with_limit(1000);
            let resp =
                bounded("read the election", self.kv().get(self.leaders(), Some(opts))).await?;
            resp.kvs()
                .iter()
                .map(|kv| Ok((decode("election candidate", kv.value())?, kv.create_revision())))
                .collect()
        })
    }
}
