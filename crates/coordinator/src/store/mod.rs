//! Where revisions, node records and usage intervals live: SQLite ([`SqliteStore`], the
//! embedded default) or etcd ([`EtcdStore`], for several coordinators).
//!
//! Every store also publishes the latest revision on a `tokio::sync::watch` channel
//! ([`PolicyStore::subscribe`]): the SQLite store after its own appends, the etcd store
//! from an etcd watch on its policy prefix (so a push through any coordinator wakes the
//! long polls of all of them).

mod compaction;
mod election;
mod etcd;
mod sqlite;

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::watch;

pub use compaction::{compaction_loop, sample_every, Schedule, DEFAULT_HISTORY_RETENTION};
pub use election::{BOOKS_PAGE, MAX_BOOKS_TXN_BYTES, MAX_BOOKS_TXN_OPS};
pub use etcd::EtcdStore;
pub use sqlite::SqliteStore;

use crate::signing::SignedPolicy;
use crate::wire::{NodeRecord, UploadOutcome};

/// A boxed future, so that stores can be used as `dyn PolicyStore`.
pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Compare-and-set lost: the latest version is not what the caller saw.
    #[error("conflict: expected latest version {expected:?}, the store has {actual:?}")]
    Conflict { expected: Option<u64>, actual: Option<u64> },
    #[error("sqlite: {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("etcd: {0}")]
    Etcd(String),
    #[error("stored data is corrupt: {0}")]
    Corrupt(String),
    /// What was asked of the store is not allowed (a version out of bounds, an
    /// oversized revision or interval): the caller's mistake, answered 400/413.
    #[error("{0}")]
    Invalid(String),
    /// The store belongs to a fleet whose revisions another signing key made.
    #[error(
        "this store holds the revisions of a fleet signed by key {stored}, but this coordinator signs \
         with key {ours}: nodes pinning the fleet's key would refuse everything it signs. Start it with \
         the fleet's signing key, or give it its own store (another --etcd-prefix or SQLite file)"
    )]
    ForeignKey { stored: String, ours: String },
    /// The key of the version being appended already holds a revision of another version
    /// (`holds`; `None`: unreadable): a copy planted or corrupted there.
    #[error(
        "the store already holds, under version {key}, a revision that is not version {key} \
         ({}): planted or corrupt, it is never used, but that key cannot be written. Push the \
         policy again with a \"version\" above {key}",
        holds.map_or_else(|| "unreadable".to_string(), |v| format!("it says version {v}"))
    )]
    Occupied { key: u64, holds: Option<u64> },
    /// A write to the quota books fenced by a leadership this coordinator no longer holds
    /// (its election key is gone: its lease expired or was revoked).
    #[error("this coordinator no longer decides quotas: {0}")]
    Deposed(String),
    #[error("store: {0}")]
    Other(String),
}

/// A revision read under `key` that is the revision of `version`: a copy planted (or
/// corrupted) under another key. Reading it by its key answers this.
pub(crate) fn misplaced(key: u64, version: u64) -> StoreError {
    StoreError::Corrupt(format!(
        "the store's key {key} holds a revision of version {version}, not of version {key}: \
         planted or corrupt; it is never served or used"
    ))
}

/// Largest stored usage interval (its JSON), so that a page of [`PAGE_USAGE`] intervals
/// stays far below the etcd client's message limit ([`MAX_MESSAGE`]).
pub const MAX_INTERVAL_BYTES: usize = 16 << 10;
/// Largest stored node record (its JSON): the report's text fields are bounded to
/// 4096 bytes each, so a record is at most about 13 KB.
pub const MAX_NODE_RECORD_BYTES: usize = 16 << 10;
/// A node record's stored JSON, refused (naming the node) beyond [`MAX_NODE_RECORD_BYTES`]:
/// the one check both stores make before they write.
pub(crate) fn node_record_json(rec: &NodeRecord) -> Result<String, StoreError> {
    let body = serde_json::to_string(rec).map_err(|e| StoreError::Other(format!("encode: {e}")))?;
    if body.len() > MAX_NODE_RECORD_BYTES {
        return Err(StoreError::Invalid(format!(
            "the record of node {} is {} bytes; at most {MAX_NODE_RECORD_BYTES}",
            rec.node,
            body.len()
        )));
    }
    Ok(body)
}

/// Largest stored revision envelope: a [`fleet::MAX_POLICY_BYTES`] policy in base64 plus
/// the envelope's fields.
pub const MAX_ENVELOPE_BYTES: usize = fleet::MAX_POLICY_BYTES / 3 * 4 + 8 + (16 << 10);
/// Keys read per etcd range request: revisions, node records, usage intervals.
pub const PAGE_REVISIONS: i64 = 16;
pub const PAGE_NODES: i64 = 1000;
pub const PAGE_USAGE: i64 = 1000;
/// The etcd client's largest accepted message (etcd-client's default is 4 MiB). Every
/// read is paged so that a page is at most a third of it, whatever the store holds:
/// 16 envelopes (≤ 23 MB), 1000 node records (≤ 16 MB), 1000 intervals (≤ 16 MB).
pub const MAX_MESSAGE: usize = 64 << 20;
const _: () = assert!(PAGE_REVISIONS as usize * MAX_ENVELOPE_BYTES <= MAX_MESSAGE / 2);
const _: () = assert!(PAGE_NODES as usize * MAX_NODE_RECORD_BYTES <= MAX_MESSAGE / 2);
const _: () = assert!(PAGE_USAGE as usize * MAX_INTERVAL_BYTES <= MAX_MESSAGE / 2);

/// Checks a revision before it is stored: a version within [`fleet::MAX_POLICY_VERSION`]
/// and an envelope within [`MAX_ENVELOPE_BYTES`] (both stores, whoever calls them).
pub(crate) fn check_revision(rev: &SignedPolicy, encoded_len: usize) -> Result<(), StoreError> {
    if rev.version == 0 || rev.version > fleet::MAX_POLICY_VERSION {
        return Err(StoreError::Invalid(format!(
            "revision version {} is outside 1..={}",
            rev.version,
            fleet::MAX_POLICY_VERSION
        )));
    }
    if encoded_len > MAX_ENVELOPE_BYTES {
        return Err(StoreError::Invalid(format!(
            "revision {} is {encoded_len} bytes; at most {MAX_ENVELOPE_BYTES} are stored (policies up to {} bytes)",
            rev.version,
            fleet::MAX_POLICY_BYTES
        )));
    }
    Ok(())
}

/// The latest revision as published to watchers: the envelope and its JSON, serialized
/// once for every watcher.
#[derive(Debug)]
pub struct Published {
    pub envelope: SignedPolicy,
    pub json: Bytes,
}

/// What the latest-revision channel carries.
pub type LatestRx = watch::Receiver<Option<Arc<Published>>>;

/// The write side of the latest-revision channel; only ever moves forward.
#[derive(Debug, Clone)]
pub(crate) struct Publisher {
    tx: Arc<watch::Sender<Option<Arc<Published>>>>,
}

impl Publisher {
    pub fn new() -> Self {
        let (tx, _rx) = watch::channel(None);
        Publisher { tx: Arc::new(tx) }
    }

    pub fn subscribe(&self) -> LatestRx {
        self.tx.subscribe()
    }

    pub fn version(&self) -> Option<u64> {
        self.tx.borrow().as_ref().map(|p| p.envelope.version)
    }

    /// Publish `env` if it is newer than what watchers have; true if it was.
    pub fn publish_if_newer(&self, env: &SignedPolicy) -> bool {
        if self.version().is_some_and(|v| v >= env.version) {
            return false;
        }
        let json = match serde_json::to_vec(env) {
            Ok(j) => Bytes::from(j),
            Err(e) => {
                tracing::error!("cannot serialize revision {}: {e}", env.version);
                return false;
            }
        };
        let published = Arc::new(Published { envelope: env.clone(), json });
        self.tx.send_if_modified(|cur| {
            if cur.as_ref().is_some_and(|c| c.envelope.version >= env.version) {
                false
            } else {
                *cur = Some(published);
                true
            }
        })
    }
}

/// Storage for a coordinator.
pub trait PolicyStore: Send + Sync + fmt::Debug {
    /// `sqlite` or `etcd`.
    fn kind(&self) -> &'static str;

    /// Append `rev` if the latest stored version is still `expected_latest` (`None`: no
    /// revision yet); [`StoreError::Conflict`] otherwise. Revisions are immutable.
    fn append(
        &self,
        expected_latest: Option<u64>,
        rev: SignedPolicy,
    ) -> BoxFut<'_, Result<(), StoreError>>;

    /// The newest revision.
    fn latest(&self) -> BoxFut<'_, Result<Option<SignedPolicy>, StoreError>>;

    /// One revision.
    fn get(&self, version: u64) -> BoxFut<'_, Result<Option<SignedPolicy>, StoreError>>;

    /// Every revision, oldest first.
    fn history(&self) -> BoxFut<'_, Result<Vec<SignedPolicy>, StoreError>>;

    /// The latest revision as it changes (newer versions only).
    fn subscribe(&self) -> LatestRx;

    /// Store a node's record (replacing the previous one).
    fn put_node(&self, rec: NodeRecord) -> BoxFut<'_, Result<(), StoreError>>;

    /// Every stored node record, sorted by node (read in pages).
    fn nodes(&self) -> BoxFut<'_, Result<Vec<NodeRecord>, StoreError>>;

    /// One node's record.
    fn node(&self, node: String) -> BoxFut<'_, Result<Option<NodeRecord>, StoreError>>;

    /// Delete the usage intervals that ended before `before_ms` (retention); how many.
    fn prune_usage(&self, before_ms: u64) -> BoxFut<'_, Result<u64, StoreError>>;

    /// A cheap request that proves the store answers (for `/v1/health`).
    fn ping(&self) -> BoxFut<'_, Result<(), StoreError>>;

    /// etcd: the cluster's current revision, the head of its history; `None` for a store
    /// that keeps no history (SQLite), which [`compaction_loop`] then leaves alone.
    fn revision(&self) -> BoxFut<'_, Result<Option<i64>, StoreError>>;

    /// etcd: drop the history before `revision` ([`compaction_loop`]); `Ok(false)` when the
    /// cluster is compacted that far already (by another coordinator).
    fn compact(&self, revision: i64) -> BoxFut<'_, Result<bool, StoreError>>;

    /// Bind the store to the fleet signing key `public_key` (hex) on first use, or check
    /// that it is the key the store is bound to: [`StoreError::ForeignKey`] otherwise. A
    /// store without the binding but with revisions is bound to the key its latest
    /// revision claims.
    fn claim_signing_key(&self, public_key: String) -> BoxFut<'_, Result<(), StoreError>>;

    /// The quota books and the election, on a store that coordinators share (etcd); `None`
    /// on a store of one coordinator (SQLite), whose books live in its memory.
    fn quota_backend(&self) -> Option<Arc<dyn QuotaBackend>> {
        None
    }

    /// Insert intervals of `node`, each at most once by id (insert-or-ignore).
    fn insert_usage(
        &self,
        node: String,
        intervals: Vec<metering::ClosedInterval>,
    ) -> BoxFut<'_, Result<UploadOutcome, StoreError>>;

    /// Every stored interval that touches `[from_ms, to_ms)` (it starts before `to_ms` and
    /// ends after `from_ms`, or starts in the window), with its node, sorted by node and id.
    fn usage_intervals(
        &self,
        from_ms: u64,
        to_ms: u64,
    ) -> BoxFut<'_, Result<Vec<(String, metering::ClosedInterval)>, StoreError>>;

    /// The stored intervals of `node` with these ids, in the order asked (ids not stored
    /// are left out).
    fn usage_by_ids(
        &self,
        node: String,
        ids: Vec<String>,
    ) -> BoxFut<'_, Result<Vec<metering::ClosedInterval>, StoreError>>;

    /// The usage proofs' records (node keys, chain heads, signed segments: see
    /// `crate::usage`): the value at `key`.
    fn proof_get(&self, key: String) -> BoxFut<'_, Result<Option<String>, StoreError>>;

    /// Set `key` to `value` if it holds `expected` now (`None`: absent); `Ok(false)`, and
    /// nothing written, if it does not. Atomic across coordinators.
    fn proof_cas(
        &self,
        key: String,
        expected: Option<String>,
        value: String,
    ) -> BoxFut<'_, Result<bool, StoreError>>;

    /// Up to `limit` records whose key starts with `prefix` and is at least `from`, sorted
    /// by key.
    fn proof_range(
        &self,
        prefix: String,
        from: String,
        limit: usize,
    ) -> BoxFut<'_, Result<Vec<(String, String)>, StoreError>>;
}

/// The end of the key range of every key starting with `prefix`: the smallest string above
/// all of them (`prefix` with its last byte raised; proof keys are ASCII).
pub(crate) fn prefix_end(prefix: &str) -> String {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0x7f {
            end.push(last + 1);
            return String::from_utf8_lossy(&end).into_owned();
        }
    }
    "\u{7f}".to_string()
}

/// Whether a stored interval touches `[from_ms, to_ms)` (the SQLite query's condition).
pub(crate) fn in_window(i: &metering::ClosedInterval, from_ms: u64, to_ms: u64) -> bool {
    i.start_wall_ms < to_ms && (span_end(i) > from_ms || i.start_wall_ms >= from_ms)
}

/// Who decides the fleet's quota books, as the election says (docs/QUOTAS.md, "Books
/// every coordinator shares").
#[derive(Debug, Clone)]
pub enum Role {
    /// Not elected; `leader`: the coordinator that is, when one is.
    Follower { leader: Option<fleet::quota_wire::Authority> },
    /// This coordinator decides: every write to the books is fenced by `fence`, and it
    /// decides only while [`mono_ms`] is below `valid_until` (its etcd lease cannot have run
    /// out before then: every keep-alive answered moves it to when that keep-alive was
    /// sent plus the lease's TTL).
    Leader {
        authority: fleet::quota_wire::Authority,
        fence: Fence,
        valid_until: Arc<std::sync::atomic::AtomicU64>,
    },
    /// Alone on a store without an election (SQLite): decides, nothing to fence.
    Alone { authority: fleet::quota_wire::Authority },
}

impl Role {
    /// The coordinator that decides, when known.
    pub fn authority(&self) -> Option<&fleet::quota_wire::Authority> {
        match self {
            Role::Follower { leader } => leader.as_ref(),
            Role::Leader { authority, .. } | Role::Alone { authority } => Some(authority),
        }
    }
}

/// A leadership's fencing token: the election key and the etcd revision it was created at
/// (a write is made only if that key still exists with that revision).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    pub key: String,
    pub revision: i64,
    pub lease: i64,
}

/// Milliseconds on this process's monotonic clock.
pub fn mono_ms() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let start = START.get_or_init(std::time::Instant::now);
    u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// A coordinator as it campaigns: what the others learn of it from the election key.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Candidate {
    /// Its URL as the other coordinators reach it.
    pub url: String,
    /// When it started campaigning (ms since the epoch).
    pub since_ms: u64,
}

/// The quota books kept in a store that coordinators share, and the election of the one
/// coordinator that decides (etcd; `PolicyStore::quota_backend`).
pub trait QuotaBackend: Send + Sync + fmt::Debug {
    /// Campaign as `me` until the process ends, publishing the outcome on `role`: grant a
    /// lease of `ttl` (etcd's minimum where larger), put the election key under it, keep it
    /// alive; the candidate whose key is oldest leads. When a leadership ends (the lease
    /// lost, etcd gone) `role` says so at once and a new campaign starts.
    fn campaign(
        &self,
        me: Candidate,
        ttl: std::time::Duration,
        role: Arc<tokio::sync::watch::Sender<Role>>,
    ) -> BoxFut<'_, ()>;

    /// Give up a leadership at once (revoke its lease): another coordinator takes over
    /// without waiting for the lease to run out.
    fn resign(&self, fence: Fence) -> BoxFut<'_, ()>;

    /// The stored books, read at one revision.
    fn load_books(&self) -> BoxFut<'_, Result<quota::books::state::BooksState, StoreError>>;

    /// Store `ops` in order, each transaction fenced by `fence`: [`StoreError::Deposed`]
    /// when the leadership is gone.
    fn commit_books(
        &self,
        fence: Fence,
        ops: Vec<quota::books::state::StateOp>,
    ) -> BoxFut<'_, Result<(), StoreError>>;

    /// Every coordinator campaigning now, oldest first (the first one leads).
    fn coordinators(&self) -> BoxFut<'_, Result<Vec<(Candidate, i64)>, StoreError>>;

    /// The books' identity (`etcd:ID`): made once per prefix by the first coordinator that
    /// asks, the same for every coordinator sharing it.
    fn scope(&self) -> BoxFut<'_, Result<String, StoreError>>;
}

/// An identity nobody else has (a coordinator alone: `memory:ID`; a new etcd prefix's
/// books): 128 bits from the clock, the process and `salt`.
pub(crate) fn fresh_id(salt: &str) -> String {
    use sha2::{Digest as _, Sha256};
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let stack = 0u8;
    let digest = Sha256::digest(
        format!("{nanos}/{}/{salt}/{:p}/{}", std::process::id(), &stack, mono_ms()).as_bytes(),
    );
    digest[..16].iter().map(|b| format!("{b:02x}")).collect()
}

/// Which store to open: `sqlite:PATH` or `etcd:URL[,URL...]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreSpec {
    Sqlite(std::path::PathBuf),
    Etcd(Vec<String>),
}

impl FromStr for StoreSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix("sqlite:") {
            if path.is_empty() {
                return Err(
                    "`sqlite:` needs a database path, e.g. sqlite:/var/lib/tessera/coordinator.db"
                        .into(),
                );
            }
            Ok(StoreSpec::Sqlite(path.into()))
        } else if let Some(urls) = s.strip_prefix("etcd:") {
            let urls: Vec<String> = urls
                .split(',')
                .map(str::trim)
                .filter(|u| !u.is_empty())
                .map(String::from)
                .collect();
            if urls.is_empty() {
                return Err(
                    "`etcd:` needs at least one endpoint, e.g. etcd:http://127.0.0.1:2379".into()
                );
            }
            Ok(StoreSpec::Etcd(urls))
        } else {
            Err(format!("unknown store `{s}`: expected sqlite:PATH or etcd:URL[,URL]"))
        }
    }
}

/// Open the store a spec names. `etcd_prefix` roots every etcd key (default `/tessera`).
pub async fn open(spec: &StoreSpec, etcd_prefix: &str) -> Result<Arc<dyn PolicyStore>, StoreError> {
    match spec {
        StoreSpec::Sqlite(path) => Ok(Arc::new(SqliteStore::open(path)?)),
        StoreSpec::Etcd(urls) => Ok(Arc::new(EtcdStore::connect(urls, etcd_prefix).await?)),
    }
}

/// The span the usage roll-up sees of a closed interval (as `metering::Ledger::usage`
/// computes it: start wall time plus the measured duration), with the utilisation the
/// node sampled, its preemption mark and NVLink domain.
pub(crate) fn span_of(i: &metering::ClosedInterval) -> metering::Span {
    metering::Span::of_closed(i)
}

pub(crate) fn span_end(i: &metering::ClosedInterval) -> u64 {
    i.start_wall_ms.saturating_add(i.duration_ms)
}

/// Checks an uploaded interval before it is stored: a safe id, the uploader's own node,
/// a well-formed start.
pub(crate) fn check_interval(node: &str, i: &metering::ClosedInterval) -> Result<(), String> {
    crate::validate_name("interval id", i.id.as_str())?;
    if i.start.node != node {
        return Err(format!(
            "interval {} belongs to node {:?}; a node uploads only its own intervals",
            i.id, i.start.node
        ));
    }
    i.start.validate().map_err(|e| format!("interval {}: {e}", i.id))?;
    if i.end_wall_ms < i.start_wall_ms {
        return Err(format!("interval {} ends before it starts", i.id));
    }
    if !(i.gpu_seconds.is_finite() && i.gpu_seconds >= 0.0) {
        return Err(format!("interval {} has gpu_seconds {}", i.id, i.gpu_seconds));
    }
    if i64::try_from(span_end(i)).is_err() {
        return Err(format!("interval {} ends beyond the representable time range", i.id));
    }
    let size = serde_json::to_vec(i).map(|b| b.len()).unwrap_or(usize::MAX);
    if size > MAX_INTERVAL_BYTES {
        return Err(format!(
            "interval {} is {size} bytes of JSON; at most {MAX_INTERVAL_BYTES}",
            i.id
        ));
    }
    Ok(())
}

/// The end of the etcd key range of every key starting with `prefix` (etcd's convention:
/// the prefix with its last byte below 0xff raised by one), for `etcd` and `election`.
pub(crate) fn etcd_range_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_store_specs() {
        assert_eq!("sqlite:/x/c.db".parse::<StoreSpec>(), Ok(StoreSpec::Sqlite("/x/c.db".into())));
        assert_eq!(
            "etcd:http://a:1, http://b:2".parse::<StoreSpec>(),
            Ok(StoreSpec::Etcd(vec!["http://a:1".into(), "http://b:2".into()]))
        );
        assert!("etcd:".parse::<StoreSpec>().is_err());
        assert!("sqlite:".parse::<StoreSpec>().is_err());
        assert!("mysql:x".parse::<StoreSpec>().is_err());
    }
}
