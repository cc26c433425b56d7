//! The embedded store: one SQLite file (WAL, synchronous=FULL), one connection behind a
//! mutex, every call on the blocking pool. One coordinator process per file: a second
//! coordinator on the same file would not see the first one's pushes until restarted
//! (use etcd for several coordinators).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};

use super::{
    check_interval, check_revision, span_end, BoxFut, LatestRx, PolicyStore, Publisher, StoreError,
};
use crate::signing::SignedPolicy;
use crate::wire::{NodeRecord, UploadOutcome};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS revisions (
    version  INTEGER PRIMARY KEY,
    envelope TEXT NOT NULL
);
CREATE TRIGGER IF NOT EXISTS revisions_immutable BEFORE UPDATE ON revisions
BEGIN SELECT RAISE(ABORT, 'policy revisions are immutable'); END;
CREATE TRIGGER IF NOT EXISTS revisions_undeletable BEFORE DELETE ON revisions
BEGIN SELECT RAISE(ABORT, 'policy revisions are immutable'); END;
CREATE TABLE IF NOT EXISTS nodes (
    node   TEXT PRIMARY KEY,
    record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS usage (
    node        TEXT NOT NULL,
    interval_id TEXT NOT NULL,
    start_ms    INTEGER NOT NULL,
    end_ms      INTEGER NOT NULL,
    body        TEXT NOT NULL,
    PRIMARY KEY (node, interval_id)
);
CREATE INDEX IF NOT EXISTS usage_by_start ON usage (start_ms);
CREATE INDEX IF NOT EXISTS usage_by_end ON usage (end_ms);
CREATE TABLE IF NOT EXISTS meta (
    name  TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS proof (
    k TEXT PRIMARY KEY,
    v TEXT NOT NULL
);
";

/// The SQLite store.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    conn: Arc<Mutex<Connection>>,
    path: PathBuf,
    publisher: Publisher,
}

fn to_sql(v: u64) -> Result<i64, StoreError> {
    i64::try_from(v)
        .map_err(|_| StoreError::Invalid(format!("{v} is beyond SQLite's integer range")))
}

fn decode<T: serde::de::DeserializeOwned>(what: &str, text: &str) -> Result<T, StoreError> {
    serde_json::from_str(text).map_err(|e| StoreError::Corrupt(format!("{what}: {e}")))
}

fn encode<T: serde::Serialize>(v: &T) -> Result<String, StoreError> {
    serde_json::to_string(v).map_err(|e| StoreError::Other(format!("encode: {e}")))
}

impl SqliteStore {
    /// Open (creating if needed) the database at `path` and publish its latest revision.
    pub fn open(path: &Path) -> Result<SqliteStore, StoreError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| StoreError::Other(format!("create {}: {e}", dir.display())))?;
        }
        let conn = Connection::open(path)?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.execute_batch(SCHEMA)?;
        let latest = latest_in(&conn)?;
        let publisher = Publisher::new();
        if let Some(env) = &latest {
            publisher.publish_if_newer(env);
        }
        Ok(SqliteStore { conn: Arc::new(Mutex::new(conn)), path: path.to_path_buf(), publisher })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    async fn with_conn<T, F>(&self, f: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Connection) -> Result<T, StoreError> + Send + 'static,
    {
        let conn = self.conn.clone();
        tokio::task::spawn_blocking(move || {
            let mut c = conn
                .lock()
                .map_err(|_| StoreError::Other("sqlite connection lock poisoned".into()))?;
            f(&mut c)
        })
        .await
        .map_err(|e| StoreError::Other(format!("sqlite task failed: {e}")))?
    }
}

/// A stored row as a revision: the envelope, or `None` (with a warning) when it is not the
/// revision of its own version (a copy under another key: planted or corrupt, never used).
fn own_revision(version: i64, text: &str) -> Result<Option<SignedPolicy>, StoreError> {
    let env: SignedPolicy = decode("revision", text)?;
    if i64::try_from(env.version).ok() == Some(version) {
        return Ok(Some(env));
    }
    tracing::warn!(
        key = version,
        version = env.version,
        "the revisions table holds under version {version} a revision of version {}: planted or \
         corrupt; not used",
        env.version
    );
    Ok(None)
}

/// The latest revision: the highest row that holds the revision of its own version. A copy
/// of an older revision under a higher key is passed over (before issue 28 it was taken for
/// the latest, and every push then lost its compare-and-set against the real one forever).
fn latest_in(conn: &Connection) -> Result<Option<SignedPolicy>, StoreError> {
    let mut stmt =
        conn.prepare_cached("SELECT version, envelope FROM revisions ORDER BY version DESC")?;
    let mut rows = stmt.query([])?;
    while let Some(row) = rows.next()? {
        let (version, text): (i64, String) = (row.get(0)?, row.get(1)?);
        if let Some(env) = own_revision(version, &text)? {
            return Ok(Some(env));
        }
    }
    Ok(None)
}

impl PolicyStore for SqliteStore {
    fn kind(&self) -> &'static str {
        "sqlite"
    }

    fn append(
        &self,
        expected_latest: Option<u64>,
        rev: SignedPolicy,
    ) -> BoxFut<'_, Result<(), StoreError>> {
        Box::pin(async move {
            let published = rev.clone();
            let body = encode(&rev)?;
            check_revision(&rev, body.len())?;
            self.with_conn(move |conn| {
                let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
                let actual = latest_in(&tx)?.map(|l| l.version);
                if actual != expected_latest || actual.is_some_and(|a| a >= rev.version) {
                    return Err(StoreError::Conflict { expected: expected_latest, actual });
                }
                let occupied: Option<String> = tx
                    .query_row(
                        "SELECT envelope FROM revisions WHERE version = ?1",
                        [to_sql(rev.version)?],
                        |r| r.get(0),
                    )
                    .optional()?;
                if let Some(text) = occupied {
                    let holds = decode::<SignedPolicy>("revision", &text).map(|e| e.version).ok();
                    return Err(StoreError::Occupied { key: rev.version, holds });
                }
                tx.execute(
                    "INSERT INTO revisions (version, envelope) VALUES (?1, ?2)",
                    params![to_sql(rev.version)?, body],
                )?;
                tx.commit()?;
                Ok(())
            })
            .await?;
            self.publisher.publish_if_newer(&published);
            Ok(())
        })
    }

    fn latest(&self) -> BoxFut<'_, Result<Option<SignedPolicy>, StoreError>> {
        Box::pin(self.with_conn(|conn| latest_in(conn)))
    }

    fn get(&self, version: u64) -> BoxFut<'_, Result<Option<SignedPolicy>, StoreError>> {
        Box::pin(self.with_conn(move |conn| {
            let text: Option<String> = conn
                .query_row(
                    "SELECT envelope FROM revisions WHERE version = ?1",
                    [to_sql(version)?],
                    |r| r.get(0),
                )
                .optional()?;
            let Some(text) = text else { return Ok(None) };
            let env: SignedPolicy = decode("revision", &text)?;
            if env.version != version {
                return Err(super::misplaced(version, env.version));
            }
            Ok(Some(env))
        }))
    }

    fn history(&self) -> BoxFut<'_, Result<Vec<SignedPolicy>, StoreError>> {
        Box::pin(self.with_conn(|conn| {
            let mut stmt =
                conn.prepare("SELECT version, envelope FROM revisions ORDER BY version")?;
            let rows = stmt.query_map([], |r| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?)))?;
            let mut out = Vec::new();
            for row in rows {
                let (version, text) = row?;
                out.extend(own_revision(version, &text)?);
            }
            Ok(out)
        }))
    }

    fn subscribe(&self) -> LatestRx {
        self.publisher.subscribe()
    }

    fn put_node(&self, rec: NodeRecord) -> BoxFut<'_, Result<(), StoreError>> {
        Box::pin(self.with_conn(move |conn| {
            let body = super::node_record_json(&rec)?;
            conn.execute(
                "INSERT INTO nodes (node, record) VALUES (?1, ?2)
                 ON CONFLICT (node) DO UPDATE SET record = excluded.record",
                params![rec.node, body],
            )?;
            Ok(())
        }))
    }

    fn node(&self, node: String) -> BoxFut<'_, Result<Option<NodeRecord>, StoreError>> {
        Box::pin(self.with_conn(move |conn| {
            let text: Option<String> = conn
                .query_row("SELECT record FROM nodes WHERE node = ?1", [node], |r| r.get(0))
                .optional()?;
            text.map(|t| decode("node record", &t)).transpose()
        }))
    }

    fn prune_usage(&self, before_ms: u64) -> BoxFut<'_, Result<u64, StoreError>> {
        Box::pin(self.with_conn(move |conn| {
            let n = conn.execute("DELETE FROM usage WHERE end_ms < ?1", [to_sql(before_ms)?])?;
            Ok(n as u64)
        }))
    }

    fn ping(&self) -> BoxFut<'_, Result<(), StoreError>> {
        Box::pin(self.with_conn(|conn| {
            conn.query_row("SELECT 1", [], |_| Ok(()))?;
            Ok(())
        }))
    }

    // SQLite keeps no history of deleted or replaced rows: nothing to compact.
    fn revision(&self) -> BoxFut<'_, Result<Option<i64>, StoreError>> {
        Box::pin(async { Ok(None) })
    }

    fn compact(&self, _revision: i64) -> BoxFut<'_, Result<bool, StoreError>> {
        Box::pin(async { Ok(false) })
    }

    fn claim_signing_key(&self, public_key: String) -> BoxFut<'_, Result<(), StoreError>> {
        Box::pin(self.with_conn(move |conn| {
            let ours = key_id_of_hex(&public_key)?;
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let stored: Option<String> = tx
                .query_row("SELECT value FROM meta WHERE name = 'signing-key'", [], |r| r.get(0))
                .optional()?;
            match stored {
                Some(s) if s.trim() == public_key => return Ok(()),
                Some(s) => {
                    return Err(StoreError::ForeignKey { stored: key_id_of_hex(s.trim())?, ours })
                }
                None => {}
            }
            if let Some(l) = latest_in(&tx)?.filter(|l| !l.key_id.is_empty() && l.key_id != ours) {
                return Err(StoreError::ForeignKey { stored: l.key_id, ours });
            }
            tx.execute("INSERT INTO meta (name, value) VALUES ('signing-key', ?1)", [public_key])?;
            tx.commit()?;
            Ok(())
        }))
    }

    fn nodes(&self) -> BoxFut<'_, Result<Vec<NodeRecord>, StoreError>> {
        Box::pin(self.with_conn(|conn| {
            let mut stmt = conn.prepare("SELECT record FROM nodes ORDER BY node")?;
            let rows = stmt.query_map([], |r| r.get::<_, String>(0))?;
            rows.map(|t| decode("node record", &t?)).collect()
        }))
    }

    fn insert_usage(
        &self,
        node: String,
        intervals: Vec<metering::ClosedInterval>,
    ) -> BoxFut<'_, Result<UploadOutcome, StoreError>> {
        Box::pin(self.with_conn(move |conn| {
            for i in &intervals {
                check_interval(&node, i).map_err(StoreError::Invalid)?;
            }
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let mut out = UploadOutcome::default();
            {
                let mut insert = tx.prepare_cached(
                    "INSERT OR IGNORE INTO usage (node, interval_id, start_ms, end_ms, body)
                     VALUES (?1, ?2, ?3, ?4, ?5)",
                )?;
                let mut existing = tx.prepare_cached(
                    "SELECT body FROM usage WHERE node = ?1 AND interval_id = ?2",
                )?;
                for i in &intervals {
                    let body = encode(i)?;
                    let n = insert.execute(params![
                        node,
                        i.id.as_str(),
                        to_sql(i.start_wall_ms)?,
                        to_sql(span_end(i))?,
                        body
                    ])?;
                    if n == 1 {
                        out.accepted += 1;
                    } else {
                        let stored: String =
                            existing.query_row(params![node, i.id.as_str()], |r| r.get(0))?;
                        if stored == body {
                            out.duplicates += 1;
                        } else {
                            out.conflicts.push(i.id.to_string());
                        }
                    }
                }
            }
            tx.commit()?;
            Ok(out)
        }))
    }

    fn usage_by_ids(
        &self,
        node: String,
        ids: Vec<String>,
    ) -> BoxFut<'_, Result<Vec<metering::ClosedInterval>, StoreError>> {
        Box::pin(self.with_conn(move |conn| {
            let mut stmt =
                conn.prepare_cached("SELECT body FROM usage WHERE node = ?1 AND interval_id = ?2")?;
            let mut out = Vec::with_capacity(ids.len());
            for id in &ids {
                let body: Option<String> =
                    stmt.query_row(params![node, id], |r| r.get(0)).optional()?;
                if let Some(b) = body {
                    out.push(decode("usage interval", &b)?);
                }
            }
            Ok(out)
        }))
    }

    fn proof_get(&self, key: String) -> BoxFut<'_, Result<Option<String>, StoreError>> {
        Box::pin(self.with_conn(move |conn| {
            Ok(conn
                .query_row("SELECT v FROM proof WHERE k = ?1", [key], |r| r.get(0))
                .optional()?)
        }))
    }

    fn proof_cas(
        &self,
        key: String,
        expected: Option<String>,
        value: String,
    ) -> BoxFut<'_, Result<bool, StoreError>> {
        Box::pin(self.with_conn(move |conn| {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let now: Option<String> =
                tx.query_row("SELECT v FROM proof WHERE k = ?1", [&key], |r| r.get(0)).optional()?;
            if now != expected {
                return Ok(false);
            }
            tx.execute(
                "INSERT INTO proof (k, v) VALUES (?1, ?2) ON CONFLICT (k) DO UPDATE SET v = excluded.v",
                params![key, value],
            )?;
            tx.commit()?;
            Ok(true)
        }))
    }

    fn proof_range(
        &self,
        prefix: String,
        from: String,
        limit: usize,
    ) -> BoxFut<'_, Result<Vec<(String, String)>, StoreError>> {
        Box::pin(self.with_conn(move |conn| {
            let start = if from > prefix { from } else { prefix.clone() };
            let mut stmt = conn.prepare_cached(
                "SELECT k, v FROM proof WHERE k >= ?1 AND k < ?2 ORDER BY k LIMIT ?3",
            )?;
            let rows = stmt.query_map(
                params![
                    start,
                    super::prefix_end(&prefix),
                    i64::try_from(limit).unwrap_or(i64::MAX)
                ],
                |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)),
            )?;
            Ok(rows.collect::<Result<_, _>>()?)
        }))
    }

    fn usage_intervals(
        &self,
        from_ms: u64,
        to_ms: u64,
    ) -> BoxFut<'_, Result<Vec<(String, metering::ClosedInterval)>, StoreError>> {
        Box::pin(self.with_conn(move |conn| {
            let (from, to) = (to_sql(from_ms)?, to_sql(to_ms)?);
            let mut stmt = conn.prepare(
                "SELECT node, body FROM usage
                 WHERE start_ms < ?2 AND (end_ms > ?1 OR start_ms >= ?1)
                 ORDER BY node, interval_id",
            )?;
            let rows = stmt.query_map(params![from, to], |r| {
                Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?))
            })?;
            rows.map(|row| {
                let (node, body) = row?;
                Ok((node, decode("usage interval", &body)?))
            })
            .collect()
        }))
    }
}

/// The key id of a hex public key.
fn key_id_of_hex(hex_key: &str) -> Result<String, StoreError> {
    crate::signing::parse_verifying_key(hex_key, "the fleet signing key in the store")
        .map(|k| crate::signing::key_id(&k))
        .map_err(|e| StoreError::Corrupt(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::signing::sign;
    use ed25519_dalek::SigningKey;

    pub(crate) fn rev(version: u64) -> SignedPolicy {
        let bytes =
            format!(r#"{{"version": {version}, "orgs": {{"acme": {{"trust": "trusted"}}}}}}"#);
        sign(&SigningKey::from_bytes(&[7; 32]), bytes.as_bytes(), "alice", 1000 + version).unwrap()
    }

    #[tokio::test]
    async fn appends_with_compare_and_set_and_keeps_history() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.db");
        let store = SqliteStore::open(&path).unwrap();
        let rx = store.subscribe();
        assert!(rx.borrow().is_none());
        assert!(store.latest().await.unwrap().is_none());

        store.append(None, rev(1)).await.unwrap();
        assert_eq!(rx.borrow().as_ref().unwrap().envelope.version, 1);
        // A second writer that saw "no revision" loses.
        let err = store.append(None, rev(2)).await.unwrap_err();
        assert!(matches!(err, StoreError::Conflict { expected: None, actual: Some(1) }), "{err}");
        // An older or equal version never lands, even with the right expectation.
        assert!(matches!(store.append(Some(1), rev(1)).await, Err(StoreError::Conflict { .. })));
        store.append(Some(1), rev(5)).await.unwrap();
        assert!(matches!(store.append(Some(1), rev(6)).await, Err(StoreError::Conflict { .. })));

        let hist: Vec<u64> = store.history().await.unwrap().iter().map(|r| r.version).collect();
        assert_eq!(hist, [1, 5]);
        assert_eq!(store.get(5).await.unwrap().unwrap(), rev(5));
        assert!(store.get(3).await.unwrap().is_none());
        drop(store);

        // Reopened: the latest is published again, and rows cannot be rewritten.
        let store = SqliteStore::open(&path).unwrap();
        assert_eq!(store.subscribe().borrow().as_ref().unwrap().envelope.version, 5);
        assert_eq!(store.latest().await.unwrap().unwrap().version, 5);
        let conn = Connection::open(&path).unwrap();
        assert!(conn.execute("UPDATE revisions SET envelope = 'x'", []).is_err());
        assert!(conn.execute("DELETE FROM revisions", []).is_err());
    }

    #[tokio::test]
    async fn node_records_replace() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(&dir.path().join("c.db")).unwrap();
        let mut r = NodeRecord::unknown("node-b");
        store.put_node(r.clone()).await.unwrap();
        store.put_node(NodeRecord::unknown("node-a")).await.unwrap();
        r.applied_version = Some(3);
        store.put_node(r.clone()).await.unwrap();
        let nodes = store.nodes().await.unwrap();
        assert_eq!(nodes.len(), 2);
        assert_eq!(nodes[0].node, "node-a");
        assert_eq!(nodes[1], r);
    }
}
