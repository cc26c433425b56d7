//! The durable ledger: one SQLite file (WAL, `synchronous=FULL`), one row per
//! (container, device) interval, each state change one transaction.
//!
//! # Durability
//!
//! Every `open_interval`, `close_container` and `checkpoint` returns only after its
//! transaction is fsynced to the WAL. A running interval is stamped by `checkpoint`,
//! which the daemon calls every <= 5 s. If the node or the daemon dies, the next
//! [`Ledger::open`] closes every interval still open at its last checkpoint, exactly once
//! (reason [`RECOVERED_REASON`]): a crash loses at most one checkpoint period of
//! GPU-seconds per running interval (<= 10 s allowing for a late heartbeat), and never
//! counts time twice. After a restart the daemon opens fresh intervals for the
//! containers that are still running.
//!
//! # Exclusivity
//!
//! The file is opened with `locking_mode=EXCLUSIVE`: while a `Ledger` is open no other
//! process can read or write it (a second writer would "recover" live intervals), and
//! a second [`Ledger::open`] fails with [`LedgerError::Locked`]. Readers go through the
//! daemon.
//!
//! # The file is append-only
//!
//! SQL triggers refuse any change to a closed row and any delete, so an interval is
//! closed at most once even if the code above had a bug.
//!
//! # The file proves itself
//!
//! Every interval is chained when it closes, in the same transaction ([`crate::chain`]):
//! the `chain` table holds, in close order, each closed row's link (sha256 of the previous
//! link and the row's canonical encoding). [`Ledger::verify_chain`] recomputes every link
//! and names the first row that does not verify: a row edited after it closed, a row or
//! a link deleted, rows reordered. Ledgers of schema 1 are chained (in `seq` order) the
//! first time this build opens them.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rusqlite::config::DbConfig;
use rusqlite::{
    params, Connection, ErrorCode, OpenFlags, OptionalExtension, Row, TransactionBehavior,
};
use sha2::{Digest, Sha256};
use tessera_api::Isolation;

use crate::chain::{short, ChainBreak, ChainHead, ChainLink};
use crate::clock::Clock;
use crate::error::LedgerError;
use crate::interval::{
    duration_ms, Class, ClosedInterval, IntervalEnd, IntervalId, IntervalRecord, IntervalStart,
    Stamp, RECOVERED_REASON,
};
use crate::report::{aggregate, Span, UsageQuery, UsageReport};

/// The schema version this build writes (`PRAGMA user_version`).
pub const SCHEMA_VERSION: i64 = 2;
/// `PRAGMA application_id` of a ledger file: "TSMT".
pub const APPLICATION_ID: i32 = 0x5453_4D54;

const SQLITE_HEADER: &[u8; 16] = b"SQLite format 3\0";

const SCHEMA: &str = r"
CREATE TABLE meta (
    key   TEXT PRIMARY KEY NOT NULL,
    value TEXT NOT NULL
) STRICT;

CREATE TABLE intervals (
    seq           INTEGER PRIMARY KEY AUTOINCREMENT,
    id            TEXT NOT NULL UNIQUE,
    container_id  TEXT NOT NULL,
    tenant        TEXT NOT NULL,
    node          TEXT NOT NULL,
    gpu_uuid      TEXT NOT NULL,
    gpu_model     TEXT NOT NULL,
    device_uuid   TEXT NOT NULL,
    isolation     TEXT NOT NULL,
    mig_profile   TEXT,
    fraction      REAL NOT NULL CHECK (fraction > 0 AND fraction <= 1),
    class         TEXT NOT NULL CHECK (class IN ('guaranteed', 'burst')),
    start_boot    TEXT NOT NULL,
    start_wall_ms INTEGER NOT NULL,
    start_mono_ms INTEGER NOT NULL,
    ckpt_boot     TEXT NOT NULL,
    ckpt_wall_ms  INTEGER NOT NULL,
    ckpt_mono_ms  INTEGER NOT NULL,
    end_boot      TEXT,
    end_wall_ms   INTEGER,
    end_mono_ms   INTEGER,
    duration_ms   INTEGER,
    -- start_wall_ms + duration_ms: where the interval ends on the report's time axis.
    span_end_ms   INTEGER,
    gpu_seconds   REAL,
    close_reason  TEXT,
    -- The Kubernetes pod container (JSON of tessera_api::cri::Workload), where it is one.
    workload      TEXT,
    CHECK ((close_reason IS NULL) = (end_wall_ms IS NULL)),
    CHECK ((close_reason IS NULL) = (span_end_ms IS NULL))
) STRICT;

-- At most one open interval per (container, device): what makes open_interval idempotent.
CREATE UNIQUE INDEX intervals_open_key ON intervals (container_id, device_uuid)
    WHERE close_reason IS NULL;
CREATE INDEX intervals_start ON intervals (start_wall_ms);

CREATE TRIGGER intervals_closed_rows_are_final BEFORE UPDATE ON intervals
    WHEN OLD.close_reason IS NOT NULL
BEGIN
    SELECT RAISE(ABORT, 'metering: interval already closed');
END;

CREATE TRIGGER intervals_append_only BEFORE DELETE ON intervals
BEGIN
    SELECT RAISE(ABORT, 'metering: intervals are never deleted');
END;
";

/// Per-interval utilisation samples, kept beside the intervals (created on open, so older
/// ledgers gain it): one sample per sampler tick per open interval, the SM percent of the
/// whole GPU used by the container's processes (0 when none showed). Rows of closed
/// intervals are final, like the intervals themselves.
const UTILIZATION_SCHEMA: &str = r"
CREATE TABLE IF NOT EXISTS utilization (
    interval_seq INTEGER PRIMARY KEY NOT NULL,
    samples      INTEGER NOT NULL CHECK (samples > 0),
    sm_sum       REAL NOT NULL CHECK (sm_sum >= 0)
) STRICT;

CREATE TRIGGER IF NOT EXISTS utilization_open_only_insert BEFORE INSERT ON utilization
    WHEN (SELECT close_reason FROM intervals WHERE seq = NEW.interval_seq) IS NOT NULL
BEGIN
    SELECT RAISE(ABORT, 'metering: interval already closed');
END;

CREATE TRIGGER IF NOT EXISTS utilization_open_only_update BEFORE UPDATE ON utilization
    WHEN (SELECT close_reason FROM intervals WHERE seq = OLD.interval_seq) IS NOT NULL
BEGIN
    SELECT RAISE(ABORT, 'metering: interval already closed');
END;
";

/// Schema 2: the hash chain (one append-only link per closed interval, in close order), the
/// topology premium's NVLink domain, the preemption mark, utilisation peaks.
const CHAIN_SCHEMA: &str = r"
CREATE TABLE IF NOT EXISTS chain (
    chain_seq    INTEGER PRIMARY KEY NOT NULL,
    interval_seq INTEGER NOT NULL UNIQUE,
    prev_hash    TEXT NOT NULL,
    hash         TEXT NOT NULL
) STRICT;

CREATE TRIGGER IF NOT EXISTS chain_links_are_final BEFORE UPDATE ON chain
BEGIN
    SELECT RAISE(ABORT, 'metering: chain links are never changed');
END;

CREATE TRIGGER IF NOT EXISTS chain_append_only BEFORE DELETE ON chain
BEGIN
    SELECT RAISE(ABORT, 'metering: chain links are never deleted');
END;

CREATE TRIGGER IF NOT EXISTS chain_links_closed_rows BEFORE INSERT ON chain
    WHEN (SELECT close_reason FROM intervals WHERE seq = NEW.interval_seq) IS NULL
BEGIN
    SELECT RAISE(ABORT, 'metering: only closed intervals are chained');
END;
";

/// The SQLite `synchronous` setting of a ledger.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Synchronous {
    /// fsync the WAL on every commit: a committed interval survives a power loss. The
    /// default, and what the daemon uses.
    #[default]
    Full,
    /// fsync only at WAL checkpoints: survives a process crash, may lose the last
    /// commits on power loss. For benchmarks and tests.
    Normal,
}

impl Synchronous {
    fn pragma(self) -> &'static str {
        match self {
            Synchronous::Full => "FULL",
            Synchronous::Normal => "NORMAL",
        }
    }
}

/// Knobs of [`Ledger::open_with`].
#[derive(Debug, Clone, Default)]
pub struct LedgerOptions {
    pub synchronous: Synchronous,
}

/// The GPU-seconds ledger of one node.
pub struct Ledger {
    conn: Connection,
    clock: Arc<dyn Clock>,
    /// Read once at open: the boot cannot change under a running process.
    boot_id: String,
    ledger_id: String,
    path: PathBuf,
    recovered: usize,
}

impl std::fmt::Debug for Ledger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ledger")
            .field("path", &self.path)
            .field("ledger_id", &self.ledger_id)
            .field("boot_id", &self.boot_id)
            .field("clock", &self.clock)
            .field("recovered", &self.recovered)
            .finish_non_exhaustive()
    }
}

impl Ledger {
    /// Opens (or creates) the ledger at `path` with `synchronous=FULL`.
    ///
    /// An existing file is checked first (`PRAGMA quick_check`): a corrupt file is
    /// reported as [`LedgerError::Corrupt`] and left byte-for-byte as found. Then every
    /// interval still open is closed at its last checkpoint ([`Ledger::recovered`] says
    /// how many).
    pub fn open(path: &Path, clock: Arc<dyn Clock>) -> Result<Ledger, LedgerError> {
        Ledger::open_with(path, clock, LedgerOptions::default())
    }

    /// [`Ledger::open`] with options.
    pub fn open_with(
        path: &Path,
        clock: Arc<dyn Clock>,
        opts: LedgerOptions,
    ) -> Result<Ledger, LedgerError> {
        let existed = preflight(path)?;
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = Connection::open_with_flags(path, flags).map_err(|e| classify(path, e))?;
        Ledger::init(conn, path, existed, clock, &opts).map_err(|e| match e {
            LedgerError::Sqlite(e) => classify(path, e),
            other => other,
        })
    }

    /// A ledger in memory: same behaviour, nothing durable. For tests of callers.
    pub fn open_in_memory(clock: Arc<dyn Clock>) -> Result<Ledger, LedgerError> {
        let conn = Connection::open_in_memory()?;
        Ledger::init(conn, Path::new(":memory:"), false, clock, &LedgerOptions::default())
    }

    fn init(
        mut conn: Connection,
        path: &Path,
        existed: bool,
        clock: Arc<dyn Clock>,
        opts: &LedgerOptions,
    ) -> Result<Ledger, LedgerError> {
        conn.busy_timeout(Duration::from_millis(500))?;
        // Before anything touches the file: hold it exclusively from the first read on.
        conn.query_row("PRAGMA locking_mode = EXCLUSIVE", [], |r| r.get::<_, String>(0))?;
        if existed {
            // Until the file has passed its checks, closing the connection must not fold
            // a crash's WAL into it: a refused file stays exactly as found.
            conn.set_db_config(DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, true)?;
            quick_check(&conn, path)?;
        }
        let fresh = check_identity(&conn, path)?;
        if existed {
            conn.set_db_config(DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, false)?;
        }
        // In memory the journal mode stays `memory`; on disk it must become `wal`.
        let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
        if path != Path::new(":memory:") && !mode.eq_ignore_ascii_case("wal") {
            return Err(LedgerError::Io(std::io::Error::other(format!(
                "ledger {}: could not switch to WAL (journal_mode is {mode})",
                path.display()
            ))));
        }
        conn.pragma_update(None, "synchronous", opts.synchronous.pragma())?;
        if fresh {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            tx.execute_batch(SCHEMA)?;
            tx.pragma_update(None, "application_id", APPLICATION_ID)?;
            tx.pragma_update(None, "user_version", SCHEMA_VERSION)?;
            tx.execute(
                "INSERT INTO meta (key, value) VALUES ('ledger_id', ?1), ('created_wall_ms', ?2)",
                params![new_ledger_id(path, clock.as_ref()), clock.wall_ms().to_string()],
            )?;
            tx.commit()?;
        }
        conn.execute_batch(UTILIZATION_SCHEMA)?;
        add_column(&conn, "intervals", "workload", "TEXT")?;
        let ledger_id: String =
            conn.query_row("SELECT value FROM meta WHERE key = 'ledger_id'", [], |r| r.get(0))?;
        migrate_to_chain(&mut conn, &ledger_id)?;
        let boot_id = clock.boot_id();
        let mut ledger =
            Ledger { conn, clock, boot_id, ledger_id, path: path.to_path_buf(), recovered: 0 };
        ledger.recovered = ledger.recover()?;
        Ok(ledger)
    }

    /// How many open intervals this `open` found and closed at their last checkpoint.
    pub fn recovered(&self) -> usize {
        self.recovered
    }

    /// The random id of this ledger file, part of every interval id.
    pub fn ledger_id(&self) -> &str {
        &self.ledger_id
    }

    /// Where the ledger lives (`:memory:` for an in-memory one).
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn now(&self) -> Stamp {
        Stamp {
            boot: self.boot_id.clone(),
            wall_ms: self.clock.wall_ms(),
            mono_ms: self.clock.mono_ms(),
        }
    }

    /// Closes every open interval at its last checkpoint, in one transaction.
    fn recover(&mut self) -> Result<usize, LedgerError> {
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let open = select_records(&tx, "WHERE close_reason IS NULL", [])?;
        for rec in &open {
            close_row(&tx, &self.ledger_id, rec, &rec.checkpoint_stamp(), RECOVERED_REASON)?;
        }
        tx.commit()?;
        Ok(open.len())
    }

    /// Opens the interval of one device held by one container and returns its id.
    ///
    /// Idempotent per (container_id, device_uuid) while the interval is open: opening it
    /// again returns the same id and writes nothing. Opening it again with different
    /// facts (tenant, fraction, class, ...) is a [`LedgerError::Conflict`].
    pub fn open_interval(&mut self, s: &IntervalStart) -> Result<IntervalId, LedgerError> {
        s.validate()?;
        let now = self.now();
        let ledger_id = self.ledger_id.clone();
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let existing = select_records(
            &tx,
            "WHERE container_id = ?1 AND device_uuid = ?2 AND close_reason IS NULL",
            params![s.container_id, s.device_uuid],
        )?;
        if let Some(rec) = existing.into_iter().next() {
            if rec.start != *s {
                return Err(LedgerError::Conflict(format!(
                    "interval {} is open for container {} device {} with different facts \
                     (recorded {:?}, asked {:?})",
                    rec.id, s.container_id, s.device_uuid, rec.start, s
                )));
            }
            return Ok(rec.id);
        }
        let last: Option<i64> = tx.query_row("SELECT MAX(seq) FROM intervals", [], |r| r.get(0))?;
        let seq = last.unwrap_or(0) + 1;
        let id = IntervalId(format!("{}-{}-{}", s.node, ledger_id, seq));
        let (wall, mono) = (to_sql_ms(now.wall_ms)?, to_sql_ms(now.mono_ms)?);
        let workload = s
            .workload
            .as_ref()
            .map(serde_json::to_string)
            .transpose()
            .map_err(|e| LedgerError::BadInterval(format!("workload: {e}")))?;
        tx.prepare_cached(
            "INSERT INTO intervals (seq, id, container_id, tenant, node, gpu_uuid, gpu_model,
                 device_uuid, isolation, mig_profile, fraction, class,
                 start_boot, start_wall_ms, start_mono_ms, ckpt_boot, ckpt_wall_ms, ckpt_mono_ms,
                 workload, nvlink_domain)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?13, ?14, ?15,
                 ?16, ?17)",
        )?
        .execute(params![
            seq,
            id.as_str(),
            s.container_id,
            s.tenant,
            s.node,
            s.gpu_uuid,
            s.gpu_model,
            s.device_uuid,
            s.isolation.as_str(),
            s.mig_profile,
            s.fraction,
            s.class.as_str(),
            now.boot,
            wall,
            mono,
            workload,
            s.nvlink_domain,
        ])?;
        tx.commit()?;
        Ok(id)
    }

    /// Closes every open interval of a container, now, exactly once, and returns them.
    /// A container with nothing open (already closed, or unknown) gives an empty list.
    pub fn close_container(
        &mut self,
        container_id: &str,
        reason: &str,
    ) -> Result<Vec<ClosedInterval>, LedgerError> {
        if reason.trim().is_empty() {
            return Err(LedgerError::BadInterval("a close reason is required".into()));
        }
        let now = self.now();
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let open = select_records(
            &tx,
            "WHERE container_id = ?1 AND close_reason IS NULL",
            params![container_id],
        )?;
        if open.is_empty() {
            return Ok(Vec::new());
        }
        let closed = open
            .iter()
            .map(|rec| close_row(&tx, &self.ledger_id, rec, &now, reason))
            .collect::<Result<Vec<_>, _>>()?;
        tx.commit()?;
        Ok(closed)
    }

    /// The heartbeat: stamps every open interval with now (wall, mono, boot). Returns how
    /// many were stamped. Call it every <= 5 s: what a crash loses is the time since
    /// the last checkpoint.
    pub fn checkpoint(&mut self) -> Result<usize, LedgerError> {
        let now = self.now();
        let n = self
            .conn
            .prepare_cached(
                "UPDATE intervals SET ckpt_boot = ?1, ckpt_wall_ms = ?2, ckpt_mono_ms = ?3
                 WHERE close_reason IS NULL",
            )?
            .execute(params![now.boot, to_sql_ms(now.wall_ms)?, to_sql_ms(now.mono_ms)?])?;
        Ok(n)
    }

    /// Usage in `[q.from_ms, q.to_ms)`, grouped and priced as asked. Intervals are clipped
    /// to the window; open intervals count up to now.
    pub fn usage(&self, q: &UsageQuery) -> Result<UsageReport, LedgerError> {
        q.validate()?;
        let now = self.now();
        let (from, to) = (to_sql_ms(q.from_ms)?, to_sql_ms(q.to_ms)?);
        let recs = select_records(
            &self.conn,
            "WHERE start_wall_ms < ?2
               AND (close_reason IS NULL OR span_end_ms > ?1 OR start_wall_ms >= ?1)",
            params![from, to],
        )?;
        let spans: Vec<Span> = recs
            .into_iter()
            .map(|rec| {
                let (duration, open) = match &rec.end {
                    Some(end) => (end.duration_ms, false),
                    None => (duration_ms(&rec.start_stamp(), &now), true),
                };
                Span::new(
                    rec.start,
                    rec.start_wall_ms,
                    duration,
                    open,
                    rec.utilization.as_ref(),
                    rec.preempted_ms.is_some(),
                )
            })
            .collect();
        aggregate(&spans, q)
    }

    /// One utilisation tick: for each (container, device, SM percent of the whole GPU), add
    /// a sample to its open interval; one transaction for the tick. Returns how many
    /// intervals took a sample (a container without an open interval is skipped).
    pub fn record_utilization(
        &mut self,
        samples: &[(String, String, f64)],
    ) -> Result<usize, LedgerError> {
        let tx = self.conn.transaction()?;
        let mut n = 0;
        for (container, device, sm) in samples {
            if !(sm.is_finite() && *sm >= 0.0) {
                return Err(LedgerError::BadInterval(format!(
                    "utilisation {sm} for {container}/{device} is not a percentage"
                )));
            }
            let seq: Option<i64> = tx
                .query_row(
                    "SELECT seq FROM intervals WHERE container_id = ?1 AND device_uuid = ?2 AND close_reason IS NULL",
                    params![container, device],
                    |r| r.get(0),
                )
                .optional()?;
            if let Some(seq) = seq {
                tx.execute(
                    "INSERT INTO utilization (interval_seq, samples, sm_sum, sm_max) VALUES (?1, 1, ?2, ?2)
                     ON CONFLICT(interval_seq) DO UPDATE SET samples = samples + 1,
                         sm_sum = sm_sum + excluded.sm_sum,
                         sm_max = CASE WHEN sm_max IS NULL THEN NULL ELSE max(sm_max, excluded.sm_sum) END",
                    params![seq, sm],
                )?;
                n += 1;
            }
        }
        tx.commit()?;
        Ok(n)
    }

    /// Marks the open intervals of a container as stopped by a quota reclaim (its work is
    /// then reported as lost to preemption; whether it is billed is the policy's
    /// `billing.preempted`). Returns how many were marked; a container with nothing open
    /// marks nothing. The mark is part of what the chain covers once the interval closes.
    pub fn mark_preempted(&mut self, container_id: &str) -> Result<usize, LedgerError> {
        let now = to_sql_ms(self.clock.wall_ms())?;
        let n = self.conn.execute(
            "UPDATE intervals SET preempted_ms = ?1
             WHERE container_id = ?2 AND close_reason IS NULL AND preempted_ms IS NULL",
            params![now, container_id],
        )?;
        Ok(n)
    }

    /// The newest link of the chain (seq 0 and the genesis hash while nothing is closed).
    pub fn chain_head(&self) -> Result<ChainHead, LedgerError> {
        let head: Option<(i64, String)> = self
            .conn
            .query_row(
                "SELECT chain_seq, hash FROM chain ORDER BY chain_seq DESC LIMIT 1",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?;
        Ok(match head {
            None => ChainHead::empty(&self.ledger_id),
            Some((seq, hash)) => ChainHead {
                ledger_id: self.ledger_id.clone(),
                seq: u64::try_from(seq).unwrap_or(0),
                hash,
            },
        })
    }

    /// Closed intervals with chain seq above `after`, in chain order, at most `limit`, as
    /// stored (links not recomputed: whoever receives them does that).
    pub fn chained_after(
        &self,
        after: u64,
        limit: usize,
    ) -> Result<Vec<ClosedInterval>, LedgerError> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let recs = select_records_ordered(
            &self.conn,
            "WHERE c.chain_seq > ?1",
            "c.chain_seq LIMIT ?2",
            params![to_sql_ms(after)?, limit],
        )?;
        Ok(recs.iter().filter_map(IntervalRecord::closed).collect())
    }

    /// Recomputes every link of the chain from the rows and reports the first row that
    /// does not verify (and up to [`MAX_PROBLEMS`] in all): a link whose row was edited
    /// after it closed, a link or a row deleted, links out of order, a closed row that is
    /// in no link.
    pub fn verify_chain(&self) -> Result<ChainReport, LedgerError> {
        let mut problems = Vec::new();
        let mut note = |p: ChainBreak| {
            if problems.len() < MAX_PROBLEMS {
                problems.push(p);
            }
        };
        let links: Vec<(i64, i64, String, String)> = {
            let mut stmt = self.conn.prepare(
                "SELECT chain_seq, interval_seq, prev_hash, hash FROM chain ORDER BY chain_seq",
            )?;
            let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))?;
            rows.collect::<Result<_, _>>()?
        };
        let records: std::collections::BTreeMap<u64, IntervalRecord> =
            select_records(&self.conn, "", [])?.into_iter().map(|r| (r.seq, r)).collect();
        let (mut expected, mut prev) = (1u64, crate::chain::genesis(&self.ledger_id));
        let mut chained = std::collections::BTreeSet::new();
        for (chain_seq, interval_seq, link_prev, link_hash) in &links {
            let chain_seq = u64::try_from(*chain_seq).unwrap_or(0);
            let interval_seq = u64::try_from(*interval_seq).unwrap_or(0);
            chained.insert(interval_seq);
            let rec = records.get(&interval_seq);
            let id = rec.map_or_else(|| "-".to_string(), |r| r.id.as_str().to_string());
            if chain_seq != expected {
                note(ChainBreak {
                    chain_seq: expected,
                    interval: "-".into(),
                    why: format!(
                        "links {expected} to {} are missing: the chain jumps to {chain_seq} (deleted links)",
                        chain_seq.saturating_sub(1)
                    ),
                });
            }
            if *link_prev != prev {
                note(ChainBreak {
                    chain_seq,
                    interval: id.clone(),
                    why: format!(
                        "it names {} as the previous hash, but the link before it is {}",
                        short(link_prev),
                        short(&prev)
                    ),
                });
            }
            match rec.and_then(|r| r.closed().map(|c| (r, c))) {
                None if rec.is_none() => note(ChainBreak {
                    chain_seq,
                    interval: id.clone(),
                    why: format!(
                        "it names ledger row {interval_seq}, which the file no longer holds (a row was deleted)"
                    ),
                }),
                None => note(ChainBreak {
                    chain_seq,
                    interval: id.clone(),
                    why: "it names a row that is open again (its close was undone)".into(),
                }),
                Some((_, c)) => {
                    let actual = c.expected_hash(link_prev, chain_seq);
                    if actual != *link_hash {
                        note(ChainBreak {
                            chain_seq,
                            interval: id.clone(),
                            why: format!(
                                "the row hashes to {} but its link says {}: it was changed after it closed",
                                short(&actual),
                                short(link_hash)
                            ),
                        });
                    }
                }
            }
            expected = chain_seq + 1;
            prev = link_hash.clone();
        }
        let mut closed_rows = 0u64;
        for r in records.values().filter(|r| r.end.is_some()) {
            closed_rows += 1;
            if !chained.contains(&r.seq) {
                note(ChainBreak {
                    chain_seq: 0,
                    interval: r.id.as_str().to_string(),
                    why: "the row is closed but no link holds it (its link was deleted)".into(),
                });
            }
        }
        problems.sort_by_key(|p| if p.chain_seq == 0 { u64::MAX } else { p.chain_seq });
        let head = self.chain_head()?;
        Ok(ChainReport {
            ledger_id: self.ledger_id.clone(),
            head,
            links: links.len() as u64,
            closed_rows,
            open_rows: records.values().filter(|r| r.end.is_none()).count() as u64,
            problems,
            remote: None,
        })
    }

    /// Every interval, in open order.
    pub fn intervals(&self) -> Result<Vec<IntervalRecord>, LedgerError> {
        select_records(&self.conn, "", [])
    }

    /// The intervals still open, in open order.
    pub fn open_intervals(&self) -> Result<Vec<IntervalRecord>, LedgerError> {
        select_records(&self.conn, "WHERE close_reason IS NULL", [])
    }

    /// Every interval of one container, in open order.
    pub fn container_intervals(
        &self,
        container_id: &str,
    ) -> Result<Vec<IntervalRecord>, LedgerError> {
        select_records(&self.conn, "WHERE container_id = ?1", params![container_id])
    }
}

impl IntervalRecord {
    fn start_stamp(&self) -> Stamp {
        Stamp {
            boot: self.start_boot_id.clone(),
            wall_ms: self.start_wall_ms,
            mono_ms: self.start_mono_ms,
        }
    }

    fn checkpoint_stamp(&self) -> Stamp {
        Stamp {
            boot: self.checkpoint_boot_id.clone(),
            wall_ms: self.checkpoint_wall_ms,
            mono_ms: self.checkpoint_mono_ms,
        }
    }

    /// GPU-seconds accrued as the ledger knows it now: the final figure once closed; while
    /// open, up to the last checkpoint — exactly what recovery would close it at, so a
    /// counter built from this never goes down.
    pub fn accrued_gpu_seconds(&self) -> f64 {
        match &self.end {
            Some(end) => end.gpu_seconds,
            #[allow(clippy::cast_precision_loss)]
            None => {
                duration_ms(&self.start_stamp(), &self.checkpoint_stamp()) as f64 / 1000.0
                    * self.start.fraction
            }
        }
    }
}

/// Closes one open row at `end` and chains it. The `close_reason IS NULL` guard plus the
/// trigger make a second close impossible.
fn close_row(
    conn: &Connection,
    ledger_id: &str,
    rec: &IntervalRecord,
    end: &Stamp,
    reason: &str,
) -> Result<ClosedInterval, LedgerError> {
    let duration = duration_ms(&rec.start_stamp(), end);
    #[allow(clippy::cast_precision_loss)]
    let gpu_seconds = duration as f64 / 1000.0 * rec.start.fraction;
    let span_end = rec.start_wall_ms.saturating_add(duration);
    let n = conn
        .prepare_cached(
            "UPDATE intervals SET end_boot = ?1, end_wall_ms = ?2, end_mono_ms = ?3,
                 duration_ms = ?4, span_end_ms = ?5, gpu_seconds = ?6, close_reason = ?7
             WHERE seq = ?8 AND close_reason IS NULL",
        )?
        .execute(params![
            end.boot,
            to_sql_ms(end.wall_ms)?,
            to_sql_ms(end.mono_ms)?,
            to_sql_ms(duration)?,
            to_sql_ms(span_end)?,
            gpu_seconds,
            reason,
            to_sql_ms(rec.seq)?,
        ])?;
    if n != 1 {
        return Err(LedgerError::Inconsistent(format!(
            "interval {} was not open when closing it",
            rec.id
        )));
    }
    let mut closed = ClosedInterval {
        id: rec.id.clone(),
        start: rec.start.clone(),
        start_wall_ms: rec.start_wall_ms,
        end_wall_ms: end.wall_ms,
        duration_ms: duration,
        gpu_seconds,
        reason: reason.to_string(),
        preempted: rec.preempted_ms.is_some(),
        utilization: rec.utilization.clone(),
        chain: None,
    };
    append_link(conn, ledger_id, rec.seq, &mut closed)?;
    Ok(closed)
}

/// Appends `closed` (ledger row `interval_seq`) to the chain, after its newest link.
fn append_link(
    conn: &Connection,
    ledger_id: &str,
    interval_seq: u64,
    closed: &mut ClosedInterval,
) -> Result<(), LedgerError> {
    let head: Option<(i64, String)> = conn
        .prepare_cached("SELECT chain_seq, hash FROM chain ORDER BY chain_seq DESC LIMIT 1")?
        .query_row([], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?;
    let (seq, prev) = match head {
        Some((s, h)) => (u64::try_from(s).unwrap_or(0) + 1, h),
        None => (1, crate::chain::genesis(ledger_id)),
    };
    let hash = closed.expected_hash(&prev, seq);
    conn.prepare_cached(
        "INSERT INTO chain (chain_seq, interval_seq, prev_hash, hash) VALUES (?1, ?2, ?3, ?4)",
    )?
    .execute(params![to_sql_ms(seq)?, to_sql_ms(interval_seq)?, prev, hash])?;
    closed.chain = Some(ChainLink { seq, prev, hash });
    Ok(())
}

/// Brings a ledger to schema 2 (idempotent): the columns and tables of the chain, the
/// topology premium, preemption and peaks; on a schema-1 ledger, every closed row chained
/// in `seq` order. One transaction.
fn migrate_to_chain(conn: &mut Connection, ledger_id: &str) -> Result<(), LedgerError> {
    add_column(conn, "intervals", "nvlink_domain", "INTEGER")?;
    add_column(conn, "intervals", "preempted_ms", "INTEGER")?;
    add_column(conn, "utilization", "sm_max", "REAL")?;
    let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    tx.execute_batch(CHAIN_SCHEMA)?;
    if version < SCHEMA_VERSION {
        let unchained = select_records(
            &tx,
            "WHERE close_reason IS NOT NULL AND intervals.seq NOT IN (SELECT interval_seq FROM chain)",
            [],
        )?;
        for rec in &unchained {
            if let Some(mut closed) = rec.closed() {
                append_link(&tx, ledger_id, rec.seq, &mut closed)?;
            }
        }
        tx.pragma_update(None, "user_version", SCHEMA_VERSION)?;
    }
    tx.commit()?;
    Ok(())
}

/// The most problems [`Ledger::verify_chain`] lists (the first is what matters).
pub const MAX_PROBLEMS: usize = 20;

/// What [`Ledger::verify_chain`] found.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChainReport {
    pub ledger_id: String,
    /// The newest link as stored.
    pub head: ChainHead,
    pub links: u64,
    pub closed_rows: u64,
    pub open_rows: u64,
    /// In chain order; empty when every link verifies. The first is the first row a bill
    /// cannot rest on.
    pub problems: Vec<ChainBreak>,
    /// What it was compared with beyond the file (a fleet node: the coordinator's copy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote: Option<String>,
}

impl ChainReport {
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }
}

const RECORD_COLUMNS: &str = "intervals.seq, id, container_id, tenant, node, gpu_uuid, gpu_model,
    device_uuid, isolation, mig_profile, fraction, class,
    start_boot, start_wall_ms, start_mono_ms, ckpt_boot, ckpt_wall_ms, ckpt_mono_ms,
    end_boot, end_wall_ms, end_mono_ms, duration_ms, gpu_seconds, close_reason";

fn select_records(
    conn: &Connection,
    filter: &str,
    params: impl rusqlite::Params,
) -> Result<Vec<IntervalRecord>, LedgerError> {
    select_records_ordered(conn, filter, "intervals.seq", params)
}

/// Rows with their utilisation and chain link (`c`), filtered and ordered as given.
fn select_records_ordered(
    conn: &Connection,
    filter: &str,
    order: &str,
    params: impl rusqlite::Params,
) -> Result<Vec<IntervalRecord>, LedgerError> {
    let sql = format!(
        "SELECT {RECORD_COLUMNS}, u.samples, u.sm_sum, intervals.workload,
             intervals.nvlink_domain, intervals.preempted_ms, u.sm_max,
             c.chain_seq, c.prev_hash, c.hash
         FROM intervals
         LEFT JOIN utilization u ON u.interval_seq = intervals.seq
         LEFT JOIN chain c ON c.interval_seq = intervals.seq
         {filter} ORDER BY {order}"
    );
    let mut stmt = conn.prepare_cached(&sql)?;
    let rows = stmt.query_map(params, RawRecord::from_row)?;
    let mut out = Vec::new();
    for raw in rows {
        out.push(raw?.into_record()?);
    }
    Ok(out)
}

/// A row as SQLite gives it, before the text columns are parsed.
struct RawRecord {
    seq: i64,
    id: String,
    container_id: String,
    tenant: String,
    node: String,
    gpu_uuid: String,
    gpu_model: String,
    device_uuid: String,
    isolation: String,
    mig_profile: Option<String>,
    fraction: f64,
    class: String,
    start: (String, i64, i64),
    ckpt: (String, i64, i64),
    end: (Option<String>, Option<i64>, Option<i64>),
    duration_ms: Option<i64>,
    gpu_seconds: Option<f64>,
    close_reason: Option<String>,
    util: (Option<i64>, Option<f64>, Option<f64>),
    workload: Option<String>,
    nvlink_domain: Option<i64>,
    preempted_ms: Option<i64>,
    chain: (Option<i64>, Option<String>, Option<String>),
}

impl RawRecord {
    fn from_row(r: &Row<'_>) -> rusqlite::Result<RawRecord> {
        Ok(RawRecord {
            seq: r.get(0)?,
            id: r.get(1)?,
            container_id: r.get(2)?,
            tenant: r.get(3)?,
            node: r.get(4)?,
            gpu_uuid: r.get(5)?,
            gpu_model: r.get(6)?,
            device_uuid: r.get(7)?,
            isolation: r.get(8)?,
            mig_profile: r.get(9)?,
            fraction: r.get(10)?,
            class: r.get(11)?,
            start: (r.get(12)?, r.get(13)?, r.get(14)?),
            ckpt: (r.get(15)?, r.get(16)?, r.get(17)?),
            end: (r.get(18)?, r.get(19)?, r.get(20)?),
            duration_ms: r.get(21)?,
            gpu_seconds: r.get(22)?,
            close_reason: r.get(23)?,
            util: (r.get(24)?, r.get(25)?, r.get(29)?),
            workload: r.get(26)?,
            nvlink_domain: r.get(27)?,
            preempted_ms: r.get(28)?,
            chain: (r.get(30)?, r.get(31)?, r.get(32)?),
        })
    }

    fn into_record(self) -> Result<IntervalRecord, LedgerError> {
        let id = self.id;
        let bad = |detail: String| LedgerError::BadRow { id: id.clone(), detail };
        let ms = |v: i64, what: &str| {
            u64::try_from(v).map_err(|_| bad(format!("{what} is negative ({v})")))
        };
        let isolation: Isolation =
            self.isolation.parse().map_err(|e| bad(format!("isolation: {e}")))?;
        let class: Class = self.class.parse().map_err(|e| bad(format!("class: {e}")))?;
        let end = match (self.close_reason, self.end, self.duration_ms, self.gpu_seconds) {
            (None, ..) => None,
            (Some(reason), (Some(boot), Some(wall), Some(mono)), Some(d), Some(gs)) => {
                Some(IntervalEnd {
                    boot_id: boot,
                    wall_ms: ms(wall, "end_wall_ms")?,
                    mono_ms: ms(mono, "end_mono_ms")?,
                    duration_ms: ms(d, "duration_ms")?,
                    gpu_seconds: gs,
                    reason,
                })
            }
            (Some(_), ..) => return Err(bad("closed but its end is incomplete".into())),
        };
        let workload = match &self.workload {
            None => None,
            Some(j) => Some(serde_json::from_str(j).map_err(|e| bad(format!("workload: {e}")))?),
        };
        let nvlink_domain = self
            .nvlink_domain
            .map(|d| {
                u32::try_from(d).map_err(|_| bad(format!("nvlink_domain {d} is out of range")))
            })
            .transpose()?;
        let chain = match self.chain {
            (Some(seq), Some(prev), Some(hash)) => {
                Some(ChainLink { seq: ms(seq, "chain_seq")?, prev, hash })
            }
            _ => None,
        };
        Ok(IntervalRecord {
            seq: ms(self.seq, "seq")?,
            start: IntervalStart {
                container_id: self.container_id,
                tenant: self.tenant,
                node: self.node,
                gpu_uuid: self.gpu_uuid,
                gpu_model: self.gpu_model,
                device_uuid: self.device_uuid,
                isolation,
                mig_profile: self.mig_profile,
                fraction: self.fraction,
                class,
                workload,
                nvlink_domain,
            },
            start_boot_id: self.start.0,
            start_wall_ms: ms(self.start.1, "start_wall_ms")?,
            start_mono_ms: ms(self.start.2, "start_mono_ms")?,
            checkpoint_boot_id: self.ckpt.0,
            checkpoint_wall_ms: ms(self.ckpt.1, "ckpt_wall_ms")?,
            checkpoint_mono_ms: ms(self.ckpt.2, "ckpt_mono_ms")?,
            end,
            utilization: match self.util {
                (Some(samples), Some(sum), max) if samples > 0 => {
                    Some(crate::interval::Utilization {
                        samples: ms(samples, "utilization samples")?,
                        #[allow(clippy::cast_precision_loss)]
                        sm_percent_avg: sum / samples as f64,
                        sm_percent_max: max,
                    })
                }
                _ => None,
            },
            preempted_ms: self.preempted_ms.map(|p| ms(p, "preempted_ms")).transpose()?,
            chain,
            id: IntervalId(id),
        })
    }
}

/// Older ledgers lack columns added since (`workload`, `nvlink_domain`, `preempted_ms`,
/// `sm_max`): add them (an added nullable column changes no recorded row; their intervals
/// read as not of a pod, no premium, not preempted, peak unknown).
fn add_column(conn: &Connection, table: &str, column: &str, decl: &str) -> Result<(), LedgerError> {
    let has: bool = conn.query_row(
        &format!("SELECT COUNT(*) > 0 FROM pragma_table_info('{table}') WHERE name = ?1"),
        [column],
        |r| r.get(0),
    )?;
    if !has {
        conn.execute_batch(&format!("ALTER TABLE {table} ADD COLUMN {column} {decl}"))?;
    }
    Ok(())
}

fn to_sql_ms(v: u64) -> Result<i64, LedgerError> {
    i64::try_from(v).map_err(|_| {
        LedgerError::BadInterval(format!("time value {v} is beyond the ledger's range"))
    })
}

/// Looks at the file before SQLite does. Returns whether it already holds data; refuses
/// (untouched) anything that is not a SQLite file.
fn preflight(path: &Path) -> Result<bool, LedgerError> {
    let meta = match fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e.into()),
    };
    if !meta.is_file() {
        return Err(LedgerError::NotALedger {
            path: path.to_path_buf(),
            detail: "not a regular file".into(),
        });
    }
    if meta.len() == 0 {
        return Ok(false);
    }
    let mut header = [0u8; 16];
    let mut f = fs::File::open(path)?;
    let got = read_up_to(&mut f, &mut header)?;
    if got < header.len() || &header != SQLITE_HEADER {
        return Err(LedgerError::Corrupt {
            path: path.to_path_buf(),
            detail: format!(
                "not a SQLite database (the file starts with {:?})",
                String::from_utf8_lossy(&header[..got])
            ),
        });
    }
    Ok(true)
}

fn read_up_to(f: &mut fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

fn quick_check(conn: &Connection, path: &Path) -> Result<(), LedgerError> {
    let mut stmt = conn.prepare("PRAGMA quick_check")?;
    let msgs = stmt.query_map([], |r| r.get::<_, String>(0))?.collect::<Result<Vec<_>, _>>()?;
    if msgs.len() == 1 && msgs[0] == "ok" {
        return Ok(());
    }
    let mut detail = msgs.iter().take(5).cloned().collect::<Vec<_>>().join("; ");
    if msgs.len() > 5 {
        detail.push_str(&format!("; ... ({} problems in all)", msgs.len()));
    }
    Err(LedgerError::Corrupt { path: path.to_path_buf(), detail: format!("quick_check: {detail}") })
}

/// Whether the file is a new, empty database (true) or an existing ledger (false).
fn check_identity(conn: &Connection, path: &Path) -> Result<bool, LedgerError> {
    let app: i32 = conn.query_row("PRAGMA application_id", [], |r| r.get(0))?;
    let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    let objects: i64 = conn.query_row("SELECT COUNT(*) FROM sqlite_schema", [], |r| r.get(0))?;
    if app == 0 && version == 0 && objects == 0 {
        return Ok(true);
    }
    if app != APPLICATION_ID {
        return Err(LedgerError::NotALedger {
            path: path.to_path_buf(),
            detail: format!("application_id is {app:#x}, a ledger has {APPLICATION_ID:#x}"),
        });
    }
    if !(1..=SCHEMA_VERSION).contains(&version) {
        return Err(LedgerError::UnsupportedVersion {
            path: path.to_path_buf(),
            found: version,
            supported: SCHEMA_VERSION,
        });
    }
    let has_id: Option<String> = conn
        .query_row("SELECT value FROM meta WHERE key = 'ledger_id'", [], |r| r.get(0))
        .optional()?;
    if has_id.is_none() {
        return Err(LedgerError::Corrupt {
            path: path.to_path_buf(),
            detail: "the ledger has no ledger_id".into(),
        });
    }
    Ok(false)
}

/// Maps SQLite's "this is not a database / it is damaged" and "someone else holds it"
/// codes to their own variants.
fn classify(path: &Path, e: rusqlite::Error) -> LedgerError {
    match e.sqlite_error_code() {
        Some(ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase) => {
            LedgerError::Corrupt { path: path.to_path_buf(), detail: e.to_string() }
        }
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) => {
            LedgerError::Locked { path: path.to_path_buf(), detail: e.to_string() }
        }
        _ => LedgerError::Sqlite(e),
    }
}

/// 12 hex digits that differ between ledger files: a hash of the path, the time, the
/// process, the boot and an address. Not a secret, only a uniquifier.
fn new_ledger_id(path: &Path, clock: &dyn Clock) -> String {
    let mut h = Sha256::new();
    h.update(path.as_os_str().as_encoded_bytes());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    h.update(nanos.to_le_bytes());
    h.update(clock.wall_ms().to_le_bytes());
    h.update(std::process::id().to_le_bytes());
    h.update(clock.boot_id().as_bytes());
    let local = 0u8;
    h.update((std::ptr::addr_of!(local) as usize).to_le_bytes());
    hex::encode(&h.finalize()[..6])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    fn pragma(l: &Ledger, name: &str) -> String {
        l.conn
            .query_row(&format!("PRAGMA {name}"), [], |r| r.get::<_, rusqlite::types::Value>(0))
            .map(|v| match v {
                rusqlite::types::Value::Integer(i) => i.to_string(),
                rusqlite::types::Value::Text(t) => t,
                other => format!("{other:?}"),
            })
            .expect("pragma")
    }

    #[test]
    fn files_are_wal_exclusive_and_fsynced_as_asked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = Arc::new(ManualClock::new(1, 1));
        let full = Ledger::open(&dir.path().join("full.db"), clock.clone()).expect("open");
        assert_eq!(pragma(&full, "journal_mode"), "wal");
        assert_eq!(pragma(&full, "synchronous"), "2", "FULL");
        assert_eq!(pragma(&full, "locking_mode"), "exclusive");
        assert_eq!(pragma(&full, "application_id"), APPLICATION_ID.to_string());
        assert_eq!(pragma(&full, "user_version"), SCHEMA_VERSION.to_string());
        let normal = Ledger::open_with(
            &dir.path().join("normal.db"),
            clock,
            LedgerOptions { synchronous: Synchronous::Normal },
        )
        .expect("open");
        assert_eq!(pragma(&normal, "synchronous"), "1", "NORMAL");
    }

    #[test]
    fn a_ledger_can_move_between_threads() {
        fn send<T: Send>() {}
        send::<Ledger>();
    }

    #[test]
    fn newer_schemas_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("l.db");
        let clock = Arc::new(ManualClock::new(1, 1));
        drop(Ledger::open(&path, clock.clone()).expect("open"));
        {
            let conn = Connection::open(&path).expect("sqlite");
            conn.pragma_update(None, "user_version", SCHEMA_VERSION + 1).expect("bump");
        }
        assert!(matches!(
            Ledger::open(&path, clock),
            Err(LedgerError::UnsupportedVersion { found, .. }) if found == SCHEMA_VERSION + 1
        ));
    }
}
