//! The daemon's durable memory: allocations and the devices they claim, in SQLite.
//!
//! Every grant is committed (WAL, `synchronous=FULL`) before the daemon answers, so a
//! `kill -9` at any point either loses an unanswered request or keeps a complete grant.
//! A device can be claimed by at most one allocation: `device_claims.uuid` is the
//! primary key, so even a logic bug cannot assign a device twice.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use rusqlite::{params, Connection, OptionalExtension};
use tessera_api::{Allocation, AllocationState};

/// Errors of the allocation store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("state database {path}: {source}")]
    Open { path: PathBuf, source: rusqlite::Error },
    #[error("state database {path} is corrupt ({detail}); it was left untouched, move it aside to start afresh")]
    Corrupt { path: PathBuf, detail: String },
    #[error("state database {path} has schema version {found}, this tesserad knows {expected}")]
    Schema { path: PathBuf, found: i64, expected: i64 },
    #[error("state database: {0}")]
    Sql(#[from] rusqlite::Error),
    #[error("state database holds an unreadable row for container {container_id}: {detail}")]
    BadRow { container_id: String, detail: String },
    #[error("device {uuid} is already claimed by container {holder}")]
    DeviceClaimed { uuid: String, holder: String },
    #[error("device {uuid} changed state since the grant was planned (planned from {expected:?}, now {found:?})")]
    StateChanged { uuid: String, expected: Option<String>, found: Option<String> },
}

/// A device-state change committed with a grant: `uuid`'s lifecycle state (JSON of
/// `scrub::DeviceState`) goes from `from` (as read when the grant was planned; `None`: no
/// row) to `to`. The commit refuses the whole grant if the row no longer reads `from`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateChange {
    pub uuid: String,
    pub from: Option<String>,
    pub to: String,
}

/// An allocation as stored, with the bookkeeping the API does not show.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub allocation: Allocation,
    pub runc_root: String,
    pub bundle: String,
    /// Start time of `pid` in clock ticks since boot (field 22 of /proc/PID/stat), to tell
    /// a live container from a recycled pid.
    pub pid_start: Option<u64>,
    /// The container's cgroup, relative to the cgroup mount root (`devices/<path>` on
    /// cgroup v1, `<path>` on v2), read at prestart: the grant lasts while a process is in
    /// it. `None` before the prestart, and for grants recorded by a tesserad of schema 1.
    pub cgroup: Option<String>,
}

/// Schema 2 added `allocations.cgroup`; a schema-1 file is migrated when opened.
const SCHEMA_VERSION: i64 = 2;

/// The SQLite-backed store. Not `Sync`: the daemon serialises access behind one mutex,
/// which is also what makes each decide-and-record step atomic.
#[derive(Debug)]
pub struct Store {
    conn: Connection,
    path: PathBuf,
    /// Counts the writes of device states ([`Store::device_gen`]).
    device_gen: u64,
}

impl Store {
    /// Open (or create) the store at `path`, verifying its integrity first.
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        let existed = path.exists();
        let open_err = |source| StoreError::Open { path: path.to_path_buf(), source };
        let conn = Connection::open(path).map_err(open_err)?;
        if existed {
            // quick_check reads every page; a torn or overwritten file fails here and the
            // daemon refuses to start rather than "repairing" (and losing) its grants.
            let detail: Result<String, rusqlite::Error> =
                conn.query_row("PRAGMA quick_check", [], |r| r.get(0));
            match detail {
                Ok(ok) if ok == "ok" => {}
                Ok(detail) => return Err(StoreError::Corrupt { path: path.to_path_buf(), detail }),
                Err(e) => {
                    return Err(StoreError::Corrupt {
                        path: path.to_path_buf(),
                        detail: e.to_string(),
                    })
                }
            }
        }
        conn.execute_batch(
            "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL; PRAGMA foreign_keys=ON;
             PRAGMA busy_timeout=5000;",
        )
        .map_err(open_err)?;
        // Room for every statement the store prepares (rusqlite keeps 16 by default; the
        // grant, start and release paths alone use a dozen).
        conn.set_prepared_statement_cache_capacity(64);
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
             CREATE TABLE IF NOT EXISTS allocations(
                 container_id TEXT PRIMARY KEY,
                 body TEXT NOT NULL,
                 runc_root TEXT NOT NULL,
                 bundle TEXT NOT NULL,
                 state TEXT NOT NULL,
                 pid INTEGER,
                 pid_start INTEGER,
                 created_ms INTEGER NOT NULL,
                 cgroup TEXT);
             CREATE TABLE IF NOT EXISTS device_claims(
                 uuid TEXT PRIMARY KEY,
                 container_id TEXT NOT NULL REFERENCES allocations(container_id) ON DELETE CASCADE);
             CREATE TABLE IF NOT EXISTS device_states(
                 uuid TEXT PRIMARY KEY,
                 state TEXT NOT NULL,
                 last_scrub TEXT,
                 updated_ms INTEGER NOT NULL);
             CREATE TABLE IF NOT EXISTS ecc_baselines(
                 uuid TEXT PRIMARY KEY,
                 count INTEGER NOT NULL,
                 updated_ms INTEGER NOT NULL);
             CREATE TABLE IF NOT EXISTS events(
                 id INTEGER PRIMARY KEY AUTOINCREMENT,
                 ts_ms INTEGER NOT NULL,
                 kind TEXT NOT NULL,
                 container_id TEXT,
                 detail TEXT NOT NULL);
             CREATE TABLE IF NOT EXISTS workloads(
                 container_id TEXT PRIMARY KEY,
                 name TEXT NOT NULL,
                 ts_ms INTEGER NOT NULL);
             CREATE TABLE IF NOT EXISTS pod_request_owners(
                 sandbox_id TEXT PRIMARY KEY,
                 container TEXT NOT NULL,
                 ts_ms INTEGER NOT NULL);
             CREATE INDEX IF NOT EXISTS workloads_ts ON workloads(ts_ms);
             CREATE INDEX IF NOT EXISTS pod_request_owners_ts ON pod_request_owners(ts_ms);",
        )
        .map_err(open_err)?;
        let found: Option<String> = conn
            .query_row("SELECT value FROM meta WHERE key='schema'", [], |r| r.get(0))
            .optional()
            .map_err(open_err)?;
        match found {
            None => {
                conn.execute(
                    "INSERT INTO meta(key, value) VALUES('schema', ?1)",
                    [SCHEMA_VERSION.to_string()],
                )
                .map_err(open_err)?;
            }
            Some(v) => {
                let found = v.parse::<i64>().unwrap_or(-1);
                match found {
                    SCHEMA_VERSION => {}
                    1 => migrate_1_to_2(&conn).map_err(open_err)?,
                    _ => {
                        return Err(StoreError::Schema {
                            path: path.to_path_buf(),
                            found,
                            expected: SCHEMA_VERSION,
                        })
                    }
                }
            }
        }
        Ok(Store { conn, path: path.to_path_buf(), device_gen: 0 })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Record a grant and claim its devices in one transaction.
    pub fn insert(&mut self, rec: &Record) -> Result<(), StoreError> {
        self.insert_grant(rec, &[])
    }

    /// Record a grant, claim its devices and make the device-state changes it implies (a
    /// dirty device going back to its own tenant) in one transaction: all of it or none.
    pub fn insert_grant(&mut self, rec: &Record, states: &[StateChange]) -> Result<(), StoreError> {
        self.device_gen += u64::from(!states.is_empty());
        let a = &rec.allocation;
        let body = serde_json::to_string(a).map_err(|e| StoreError::BadRow {
            container_id: a.container_id.to_string(),
            detail: e.to_string(),
        })?;
        let tx = self.conn.transaction()?;
        tx.prepare_cached(INSERT_ALLOCATION)?.execute(params![
            a.container_id.as_str(),
            body,
            rec.runc_root,
            rec.bundle,
            state_str(a.state),
            a.pid,
            rec.pid_start.map(|v| v as i64),
            a.created_ms as i64
        ])?;
        // Shared grants (MPS, time-slicing) claim nothing exclusively: many containers use
        // one device, and the node service keeps shared and exclusive use apart.
        for d in a.devices.iter().filter(|_| a.share.is_none()) {
            let holder: Option<String> = tx
                .prepare_cached("SELECT container_id FROM device_claims WHERE uuid=?1")?
                .query_row([d.uuid.as_str()], |r| r.get(0))
                .optional()?;
            if let Some(holder) = holder {
                return Err(StoreError::DeviceClaimed { uuid: d.uuid.to_string(), holder });
            }
            tx.prepare_cached("INSERT INTO device_claims(uuid, container_id) VALUES(?1, ?2)")?
                .execute(params![d.uuid.as_str(), a.container_id.as_str()])?;
        }
        for c in states {
            let found: Option<String> = tx
                .prepare_cached("SELECT state FROM device_states WHERE uuid=?1")?
                .query_row([&c.uuid], |r| r.get(0))
                .optional()?;
            if found != c.from {
                return Err(StoreError::StateChanged {
                    uuid: c.uuid.clone(),
                    expected: c.from.clone(),
                    found,
                });
            }
            tx.prepare_cached(UPSERT_DEVICE_STATE)?.execute(params![
                c.uuid,
                c.to,
                crate::now_ms() as i64
            ])?;
        }
        insert_event(
            &tx,
            "grant",
            Some(&a.container_id),
            &format!("{} {} -> {}", a.tenant, a.request, uuids(a)),
        )?;
        tx.commit()?;
        Ok(())
    }

    /// Run `f` with `synchronous=NORMAL`: its commit survives a crash of this process
    /// (`kill -9`) but may roll back on power loss. Only for changes the reconciler repairs
    /// on its own: a lost start leaves a grant it judges by runc's state, a lost release
    /// leaves a grant whose container it finds gone. Grants are always `FULL`.
    fn relaxed<T>(
        &mut self,
        f: impl FnOnce(&mut Self) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        // Cached statements: parsed once, not on every start and release (issue 29).
        self.conn.prepare_cached("PRAGMA synchronous=NORMAL")?.execute([])?;
        let r = f(self);
        let restored =
            self.conn.prepare_cached("PRAGMA synchronous=FULL").and_then(|mut st| st.execute([]));
        let v = r?;
        restored?;
        Ok(v)
    }

    /// Mark an allocation (as just read) running with its container's pid and cgroup;
    /// returns the record as now stored.
    pub fn set_running(
        &mut self,
        rec: Record,
        pid: i32,
        pid_start: Option<u64>,
        cgroup: Option<String>,
    ) -> Result<Record, StoreError> {
        self.relaxed(|s| s.set_running_inner(rec, pid, pid_start, cgroup))
    }

    fn set_running_inner(
        &mut self,
        mut rec: Record,
        pid: i32,
        pid_start: Option<u64>,
        cgroup: Option<String>,
    ) -> Result<Record, StoreError> {
        let container_id = rec.allocation.container_id.to_string();
        rec.allocation.state = AllocationState::Running;
        rec.allocation.pid = Some(pid);
        rec.pid_start = pid_start;
        rec.cgroup = cgroup;
        let body = serde_json::to_string(&rec.allocation).map_err(|e| StoreError::BadRow {
            container_id: container_id.clone(),
            detail: e.to_string(),
        })?;
        let tx = self.conn.transaction()?;
        tx.prepare_cached(SET_RUNNING)?.execute(params![
            container_id,
            body,
            state_str(AllocationState::Running),
            pid,
            pid_start.map(|v| v as i64),
            rec.cgroup
        ])?;
        let detail = match &rec.cgroup {
            Some(cg) => format!("pid {pid}, cgroup {cg}"),
            None => format!("pid {pid}"),
        };
        insert_event(&tx, "start", Some(&container_id), &detail)?;
        tx.commit()?;
        Ok(rec)
    }

    /// Record what a grant counts against its tenant's quotas from now on (its CPU or
    /// memory limit changed: `runc update`), with an event of `kind` saying so, in one
    /// transaction (durable). Returns whether the grant exists.
    pub fn set_quota_mark(
        &mut self,
        container_id: &str,
        mark: Option<&tessera_api::QuotaMark>,
        kind: &str,
        detail: &str,
    ) -> Result<bool, StoreError> {
        let Some(mut rec) = self.get(container_id)? else { return Ok(false) };
        rec.allocation.quota = mark.cloned().map(Box::new);
        let body = serde_json::to_string(&rec.allocation).map_err(|e| StoreError::BadRow {
            container_id: container_id.to_string(),
            detail: e.to_string(),
        })?;
        let tx = self.conn.transaction()?;
        tx.execute(
            "UPDATE allocations SET body=?2 WHERE container_id=?1",
            params![container_id, body],
        )?;
        insert_event(&tx, kind, Some(container_id), detail)?;
        tx.commit()?;
        Ok(true)
    }

    /// Record the cgroup of a running grant recorded without one (schema 1), found from its
    /// still-live init process. Durable.
    pub fn set_cgroup(&mut self, container_id: &str, cgroup: &str) -> Result<(), StoreError> {
        self.conn.execute(
            "UPDATE allocations SET cgroup=?2 WHERE container_id=?1 AND cgroup IS NULL",
            params![container_id, cgroup],
        )?;
        Ok(())
    }

    /// Remove an allocation and free its devices. Returns whether it existed.
    pub fn remove(&mut self, container_id: &str, why: &str) -> Result<bool, StoreError> {
        self.relaxed(|s| s.remove_inner(container_id, why, &[]))
    }

    /// Remove an allocation and, in the same transaction, mark the devices it leaves behind
    /// (dirty until scrubbed). Relaxed like [`Store::remove`]: the two changes commit or
    /// vanish together, and a release lost to power failure leaves the grant in place —
    /// held, never clean-looking — until the reconciler finds its container gone and
    /// releases it again, dirty.
    pub fn remove_leaving(
        &mut self,
        container_id: &str,
        why: &str,
        states: &[(String, String)],
    ) -> Result<bool, StoreError> {
        self.relaxed(|s| s.remove_inner(container_id, why, states))
    }

    fn remove_inner(
        &mut self,
        container_id: &str,
        why: &str,
        states: &[(String, String)],
    ) -> Result<bool, StoreError> {
        self.device_gen += u64::from(!states.is_empty());
        let tx = self.conn.transaction()?;
        for (uuid, state) in states {
            tx.prepare_cached(UPSERT_DEVICE_STATE)?.execute(params![
                uuid,
                state,
                crate::now_ms() as i64
            ])?;
        }
        let n = tx
            .prepare_cached("DELETE FROM allocations WHERE container_id=?1")?
            .execute([container_id])?;
        if n > 0 {
            insert_event(&tx, "release", Some(container_id), why)?;
        }
        tx.commit()?;
        Ok(n > 0)
    }

    pub fn get(&self, container_id: &str) -> Result<Option<Record>, StoreError> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT container_id, body, runc_root, bundle, pid_start, cgroup FROM allocations WHERE container_id=?1",
        )?;
        let row = stmt.query_row([container_id], row_tuple).optional()?;
        row.map(decode).transpose()
    }

    /// Every allocation, ordered by container id.
    pub fn all(&self) -> Result<Vec<Record>, StoreError> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT container_id, body, runc_root, bundle, pid_start, cgroup FROM allocations ORDER BY container_id",
        )?;
        let rows = stmt.query_map([], row_tuple)?.collect::<Result<Vec<_>, _>>()?;
        rows.into_iter().map(decode).collect()
    }

    /// Every claimed device uuid.
    pub fn claimed(&self) -> Result<BTreeSet<String>, StoreError> {
        let mut stmt = self.conn.prepare_cached("SELECT uuid FROM device_claims")?;
        let rows =
            stmt.query_map([], |r| r.get::<_, String>(0))?.collect::<Result<BTreeSet<_>, _>>()?;
        Ok(rows)
    }

    /// Set a device's lifecycle state (JSON of `scrub::DeviceState`), and its last scrub
    /// report when given. Durable.
    pub fn set_device_state(
        &mut self,
        uuid: &str,
        state: &str,
        last_scrub: Option<&str>,
    ) -> Result<(), StoreError> {
        self.device_gen += 1;
        self.conn.execute(
            "INSERT INTO device_states(uuid, state, last_scrub, updated_ms) VALUES(?1, ?2, ?3, ?4)
             ON CONFLICT(uuid) DO UPDATE SET state=excluded.state,
                 last_scrub=COALESCE(excluded.last_scrub, device_states.last_scrub), updated_ms=excluded.updated_ms",
            params![uuid, state, last_scrub, crate::now_ms() as i64],
        )?;
        Ok(())
    }

    /// Changes whenever a device state may have been written (counted before the write,
    /// whether it commits or not): what was read of [`Store::device_states`] at one value
    /// is what they are while it stays the same (this process alone writes the store).
    pub fn device_gen(&self) -> u64 {
        self.device_gen
    }

    /// Every device with a recorded lifecycle state: uuid -> (state JSON, last scrub JSON).
    pub fn device_states(&self) -> Result<BTreeMap<String, (String, Option<String>)>, StoreError> {
        let mut stmt =
            self.conn.prepare_cached("SELECT uuid, state, last_scrub FROM device_states")?;
        let rows = stmt
            .query_map([], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    (r.get::<_, String>(1)?, r.get::<_, Option<String>>(2)?),
                ))
            })?
            .collect::<Result<BTreeMap<_, _>, _>>()?;
        Ok(rows)
    }

    /// The uncorrectable-ECC count last seen per GPU (survives restarts, so errors counted
    /// while no tesserad watched are still noticed).
    pub fn ecc_baselines(&self) -> Result<BTreeMap<String, u64>, StoreError> {
        let mut stmt = self.conn.prepare_cached("SELECT uuid, count FROM ecc_baselines")?;
        let rows = stmt
            .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?.max(0) as u64)))?
            .collect::<Result<BTreeMap<_, _>, _>>()?;
        Ok(rows)
    }

    /// Record the uncorrectable-ECC count now seen on a GPU. Durable.
    pub fn set_ecc_baseline(&mut self, uuid: &str, count: u64) -> Result<(), StoreError> {
        self.conn.execute(
            "INSERT INTO ecc_baselines(uuid, count, updated_ms) VALUES(?1, ?2, ?3)
             ON CONFLICT(uuid) DO UPDATE SET count=excluded.count, updated_ms=excluded.updated_ms",
            params![uuid, count.min(i64::MAX as u64) as i64, crate::now_ms() as i64],
        )?;
        Ok(())
    }

    /// Append to the audit log (refusals, reconciler actions).
    pub fn event(
        &mut self,
        kind: &str,
        container_id: Option<&str>,
        detail: &str,
    ) -> Result<(), StoreError> {
        insert_event(&self.conn, kind, container_id, detail)?;
        Ok(())
    }

    /// The newest `limit` events, newest first, each with the name of its container's pod
    /// container where one was noted ([`Store::note_workload`]).
    pub fn recent_events(&self, limit: u32) -> Result<Vec<Event>, StoreError> {
        let mut stmt = self.conn.prepare_cached(
            "SELECT e.ts_ms, e.kind, e.container_id, w.name, e.detail FROM events e
             LEFT JOIN workloads w ON w.container_id = e.container_id
             ORDER BY e.id DESC LIMIT ?1",
        )?;
        let rows = stmt
            .query_map([limit], |r| {
                Ok(Event {
                    ts_ms: r.get::<_, i64>(0)? as u64,
                    kind: r.get(1)?,
                    container_id: r.get(2)?,
                    workload: r.get(3)?,
                    detail: r.get(4)?,
                })
            })?
            .collect::<Result<Vec<_>, _>>()?;
        Ok(rows)
    }

    /// The container of sandbox `sandbox_id` that the pod-wide request annotation belongs
    /// to: the first that asked through it (recorded now when none has). The newest
    /// [`MAX_WORKLOAD_NAMES`] pods are remembered.
    pub fn pod_request_owner(
        &mut self,
        sandbox_id: &str,
        container: &str,
    ) -> Result<String, StoreError> {
        self.conn.execute(
            "INSERT INTO pod_request_owners(sandbox_id, container, ts_ms) VALUES(?1, ?2, ?3)
             ON CONFLICT(sandbox_id) DO NOTHING",
            params![sandbox_id, container, crate::now_ms() as i64],
        )?;
        self.keep_newest("pod_request_owners", "sandbox_id")?;
        Ok(self.conn.query_row(
            "SELECT container FROM pod_request_owners WHERE sandbox_id = ?1",
            [sandbox_id],
            |r| r.get(0),
        )?)
    }

    /// Keeps the newest [`MAX_WORKLOAD_NAMES`] rows of one of the name tables (by `ts_ms`,
    /// which each has an index on, so this walks the index, never sorts the table).
    fn keep_newest(&mut self, table: &'static str, key: &'static str) -> Result<(), StoreError> {
        self.conn.execute(
            &format!(
                "DELETE FROM {table} WHERE {key} IN
                     (SELECT {key} FROM {table} ORDER BY ts_ms DESC LIMIT -1 OFFSET ?1)"
            ),
            [MAX_WORKLOAD_NAMES],
        )?;
        Ok(())
    }

    /// Remembers the `namespace/pod/container` name of a container that asked for a GPU,
    /// so its events keep a name people know after its grant is gone. The newest
    /// [`MAX_WORKLOAD_NAMES`] are kept.
    pub fn note_workload(&mut self, container_id: &str, name: &str) -> Result<(), StoreError> {
        self.conn.execute(
            "INSERT INTO workloads(container_id, name, ts_ms) VALUES(?1, ?2, ?3)
             ON CONFLICT(container_id) DO UPDATE SET name = excluded.name, ts_ms = excluded.ts_ms",
            params![container_id, name, crate::now_ms() as i64],
        )?;
        self.keep_newest("workloads", "container_id")?;
        Ok(())
    }
}

type RowTuple = (String, String, String, String, Option<i64>, Option<String>);

/// One audit event: (ts_ms, kind, container_id, detail).
/// One line of the audit log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub ts_ms: u64,
    pub kind: String,
    pub container_id: Option<String>,
    /// `namespace/pod/container`, where the container was a pod's.
    pub workload: Option<String>,
    pub detail: String,
}

/// How many container names [`Store::note_workload`] keeps.
pub const MAX_WORKLOAD_NAMES: i64 = 10_000;

fn row_tuple(r: &rusqlite::Row<'_>) -> rusqlite::Result<RowTuple> {
    Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?))
}

fn decode(
    (container_id, body, runc_root, bundle, pid_start, cgroup): RowTuple,
) -> Result<Record, StoreError> {
    let allocation: Allocation = serde_json::from_str(&body).map_err(|e| StoreError::BadRow {
        container_id: container_id.clone(),
        detail: e.to_string(),
    })?;
    Ok(Record { allocation, runc_root, bundle, pid_start: pid_start.map(|v| v as u64), cgroup })
}

/// Schema 1 → 2: `allocations` gains `cgroup` (NULL for the grants already there: the
/// reconciler fills it in from a live init process, else judges them without it). One
/// transaction: a crash leaves either schema.
fn migrate_1_to_2(conn: &Connection) -> rusqlite::Result<()> {
    let tx = conn.unchecked_transaction()?;
    tx.execute_batch(
        "ALTER TABLE allocations ADD COLUMN cgroup TEXT;
         UPDATE meta SET value='2' WHERE key='schema';",
    )?;
    tx.commit()
}

// The statements of a grant, a start and a release, prepared once per connection
// (`prepare_cached`), not parsed again on every container (issue 29).
const INSERT_ALLOCATION: &str = "INSERT INTO allocations(container_id, body, runc_root, bundle, state, pid, pid_start, created_ms)
     VALUES(?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)";
const UPSERT_DEVICE_STATE: &str =
    "INSERT INTO device_states(uuid, state, updated_ms) VALUES(?1, ?2, ?3)
     ON CONFLICT(uuid) DO UPDATE SET state=excluded.state, updated_ms=excluded.updated_ms";
const SET_RUNNING: &str =
    "UPDATE allocations SET body=?2, state=?3, pid=?4, pid_start=?5, cgroup=?6 WHERE container_id=?1";

fn insert_event(
    conn: &Connection,
    kind: &str,
    container_id: Option<&str>,
    detail: &str,
) -> rusqlite::Result<()> {
    conn.prepare_cached(
        "INSERT INTO events(ts_ms, kind, container_id, detail) VALUES(?1, ?2, ?3, ?4)",
    )?
    .execute(params![crate::now_ms() as i64, kind, container_id, detail])?;
    Ok(())
}

fn state_str(s: AllocationState) -> &'static str {
    match s {
        AllocationState::Pending => "pending",
        AllocationState::Running => "running",
    }
}

fn uuids(a: &Allocation) -> String {
    a.devices.iter().map(|d| d.uuid.as_str()).collect::<Vec<_>>().join(",")
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_api::{GpuRequest, GrantedDevice, Injection, Isolation};

    fn rec(id: &str, uuids: &[&str]) -> Record {
        Record {
            allocation: Allocation {
                container_id: id.parse().expect("valid"),
                tenant: "acme/t/p/u".parse().expect("valid"),
                trust: "trusted".parse().expect("valid"),
                request: GpuRequest::Gpu { count: 1 },
                isolation: Isolation::Gpu,
                devices: uuids
                    .iter()
                    .map(|u| GrantedDevice {
                        uuid: u.parse().expect("uuid"),
                        gpu_uuid: u.parse().expect("uuid"),
                        gpu_index: 0,
                        model: "H100-80GB".into(),
                        mig_profile: None,
                        placement: None,
                    })
                    .collect(),
                injection: Injection::default(),
                state: AllocationState::Pending,
                pid: None,
                created_ms: 1,
                share: None,
                workload: None,
                quota: None,
                nvlink_domain: None,
                topology: None,
                class: None,
            },
            runc_root: "/run/runc".into(),
            bundle: "/b".into(),
            pid_start: None,
            cgroup: None,
        }
    }

    /// `relaxed` runs its change with `synchronous=NORMAL` every time, not only the first,
    /// and grants are `FULL` after each: the two `PRAGMA`s are cached statements
    /// (`prepare_cached`), and SQLite applies a `PRAGMA synchronous` when it runs one again.
    #[test]
    fn every_relaxed_change_is_normal_and_grants_stay_full() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut s = Store::open(&dir.path().join("state.db")).expect("open");
        let level = |s: &Store| -> i64 {
            s.conn.query_row("PRAGMA synchronous", [], |r| r.get(0)).expect("pragma")
        };
        assert_eq!(level(&s), 2, "FULL after open");
        for round in 1..=3 {
            let inside = s.relaxed(|s| Ok(level(s))).expect("relaxed");
            assert_eq!(inside, 1, "round {round}: the relaxed change ran with NORMAL");
            assert_eq!(level(&s), 2, "round {round}: FULL again after it");
        }
    }

    #[test]
    fn grants_survive_reopen_and_release_frees_devices() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.db");
        {
            let mut s = Store::open(&path).expect("open");
            s.insert(&rec("a", &["GPU-1", "GPU-2"])).expect("insert");
            let rec = s.get("a").expect("get").expect("present");
            s.set_running(rec, 42, Some(7), Some("devices/k8s/a".into())).expect("running");
        }
        let mut s = Store::open(&path).expect("reopen");
        let got = s.get("a").expect("get").expect("present");
        assert_eq!(got.allocation.state, AllocationState::Running);
        assert_eq!(got.allocation.pid, Some(42));
        assert_eq!(got.pid_start, Some(7));
        assert_eq!(got.cgroup.as_deref(), Some("devices/k8s/a"));
        assert_eq!(
            s.claimed().expect("claimed"),
            ["GPU-1".to_string(), "GPU-2".to_string()].into()
        );
        assert!(s.remove("a", "test").expect("remove"));
        assert!(!s.remove("a", "test").expect("remove again"));
        assert!(s.claimed().expect("claimed").is_empty());
        let kinds: Vec<String> =
            s.recent_events(10).expect("events").into_iter().map(|e| e.kind).collect();
        assert_eq!(kinds, ["release", "start", "grant"]);
    }

    #[test]
    fn a_device_cannot_be_claimed_twice_and_the_failed_grant_leaves_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut s = Store::open(&dir.path().join("state.db")).expect("open");
        s.insert(&rec("a", &["GPU-1"])).expect("insert");
        let err = s.insert(&rec("b", &["GPU-2", "GPU-1"])).unwrap_err();
        assert!(
            matches!(err, StoreError::DeviceClaimed { ref holder, .. } if holder == "a"),
            "{err}"
        );
        assert!(s.get("b").expect("get").is_none());
        assert_eq!(s.claimed().expect("claimed"), ["GPU-1".to_string()].into());
    }

    #[test]
    fn a_grant_and_its_device_states_commit_together_or_not_at_all() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut s = Store::open(&dir.path().join("state.db")).expect("open");
        let dirty = r#"{"dirty":{"last_tenant":"acme/t/p/u"}}"#;
        s.set_device_state("GPU-1", dirty, None).expect("dirty");
        s.insert(&rec("other", &["GPU-2"])).expect("insert");
        let back = |from: &str| StateChange {
            uuid: "GPU-1".into(),
            from: Some(from.into()),
            to: r#""free""#.into(),
        };
        // The claim fails (GPU-2 is held): the state change goes with it.
        let err = s.insert_grant(&rec("a", &["GPU-1", "GPU-2"]), &[back(dirty)]).unwrap_err();
        assert!(matches!(err, StoreError::DeviceClaimed { .. }), "{err}");
        // The state is not what the plan read: nothing is granted.
        let err = s.insert_grant(&rec("a", &["GPU-1"]), &[back(r#""free""#)]).unwrap_err();
        assert!(matches!(err, StoreError::StateChanged { .. }), "{err}");
        assert!(s.get("a").expect("get").is_none());
        assert_eq!(s.device_states().expect("states")["GPU-1"].0, dirty);
        assert_eq!(s.claimed().expect("claimed"), ["GPU-2".to_string()].into());
        // As planned: both.
        s.insert_grant(&rec("a", &["GPU-1"]), &[back(dirty)]).expect("grant");
        assert!(s.get("a").expect("get").is_some());
        assert_eq!(s.device_states().expect("states")["GPU-1"].0, r#""free""#);
    }

    /// The node keeps the device states typed while `device_gen` stays (`Node::lifecycle`):
    /// every write of a device state moves it, a failed one too; reads and grants without a
    /// state change do not.
    #[test]
    fn every_write_of_a_device_state_moves_the_device_generation() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut s = Store::open(&dir.path().join("state.db")).expect("open");
        let dirty = r#"{"dirty":{"last_tenant":"acme/t/p/u"}}"#;
        let g0 = s.device_gen();
        s.set_device_state("GPU-1", dirty, None).expect("dirty");
        let g1 = s.device_gen();
        assert_ne!(g1, g0, "set_device_state");
        s.insert(&rec("other", &["GPU-2"])).expect("insert");
        let _ = s.device_states().expect("states");
        assert_eq!(s.device_gen(), g1, "a grant without state changes, a read");
        let back =
            StateChange { uuid: "GPU-1".into(), from: Some(dirty.into()), to: r#""free""#.into() };
        let stale = StateChange { from: Some(r#""free""#.into()), ..back.clone() };
        s.insert_grant(&rec("a", &["GPU-1"]), &[stale]).unwrap_err();
        let g2 = s.device_gen();
        assert_ne!(g2, g1, "a refused state change counts too");
        s.insert_grant(&rec("a", &["GPU-1"]), &[back]).expect("grant");
        let g3 = s.device_gen();
        assert_ne!(g3, g2, "insert_grant");
        s.remove_leaving("a", "test", &[("GPU-1".into(), dirty.into())]).expect("release");
        assert_ne!(s.device_gen(), g3, "remove_leaving");
    }

    #[test]
    fn a_corrupt_database_is_reported_and_left_untouched() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.db");
        {
            let mut s = Store::open(&path).expect("open");
            for i in 0..50 {
                s.insert(&rec(&format!("c{i}"), &[&format!("GPU-{i}")])).expect("insert");
            }
        }
        // Checkpoint happened on close; scribble over the middle of the file.
        let mut bytes = std::fs::read(&path).expect("read");
        assert!(bytes.len() > 8192, "db is {} bytes", bytes.len());
        for b in &mut bytes[4096..8192] {
            *b = 0xA5;
        }
        std::fs::write(&path, &bytes).expect("write");
        let err = Store::open(&path).unwrap_err();
        assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
        assert!(err.to_string().contains("left untouched"), "{err}");
        assert_eq!(std::fs::read(&path).expect("read"), bytes, "the corrupt file was modified");
    }

    #[test]
    fn grants_commit_with_full_sync_after_relaxed_changes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut s = Store::open(&dir.path().join("state.db")).expect("open");
        s.insert(&rec("a", &["GPU-1"])).expect("insert");
        let rec = s.get("a").expect("get").expect("present");
        s.set_running(rec, 1, None, None).expect("running");
        s.remove("a", "test").expect("remove");
        let sync: i64 = s.conn.query_row("PRAGMA synchronous", [], |r| r.get(0)).expect("pragma");
        assert_eq!(sync, 2, "synchronous must be back to FULL (2) for the next grant");
    }

    #[test]
    fn a_schema_1_file_is_migrated_and_keeps_its_grants() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.db");
        let body = serde_json::to_string(&rec("old", &["GPU-1"]).allocation).expect("json");
        {
            // Exactly what a schema-1 tesserad created.
            let c = Connection::open(&path).expect("open");
            c.execute_batch(
                "CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT NOT NULL);
                 CREATE TABLE allocations(container_id TEXT PRIMARY KEY, body TEXT NOT NULL,
                     runc_root TEXT NOT NULL, bundle TEXT NOT NULL, state TEXT NOT NULL, pid INTEGER,
                     pid_start INTEGER, created_ms INTEGER NOT NULL);
                 CREATE TABLE device_claims(uuid TEXT PRIMARY KEY,
                     container_id TEXT NOT NULL REFERENCES allocations(container_id) ON DELETE CASCADE);
                 CREATE TABLE events(id INTEGER PRIMARY KEY AUTOINCREMENT, ts_ms INTEGER NOT NULL,
                     kind TEXT NOT NULL, container_id TEXT, detail TEXT NOT NULL);
                 INSERT INTO meta VALUES('schema', '1');",
            )
            .expect("schema 1");
            c.execute(
                "INSERT INTO allocations VALUES('old', ?1, '/run/runc', '/b', 'running', 42, 7, 1)",
                [&body],
            )
            .expect("row");
            c.execute("INSERT INTO device_claims VALUES('GPU-1', 'old')", []).expect("claim");
        }
        let mut s = Store::open(&path).expect("migrated");
        let got = s.get("old").expect("get").expect("kept");
        assert_eq!(
            (got.pid_start, got.cgroup.as_deref(), got.allocation.devices.len()),
            (Some(7), None, 1)
        );
        assert_eq!(s.claimed().expect("claimed"), ["GPU-1".to_string()].into());
        s.set_cgroup("old", "devices/x").expect("backfill");
        s.set_cgroup("old", "devices/other").expect("only once");
        assert_eq!(s.get("old").expect("get").expect("kept").cgroup.as_deref(), Some("devices/x"));
        drop(s);
        // Reopening a migrated file is a no-op; the schema says 2.
        let s = Store::open(&path).expect("reopen");
        let v: String = s
            .conn
            .query_row("SELECT value FROM meta WHERE key='schema'", [], |r| r.get(0))
            .expect("meta");
        assert_eq!(v, "2");
        assert_eq!(s.get("old").expect("get").expect("kept").cgroup.as_deref(), Some("devices/x"));
        // A newer schema is refused, untouched.
        s.conn.execute("UPDATE meta SET value='3' WHERE key='schema'", []).expect("bump");
        drop(s);
        assert!(matches!(
            Store::open(&path),
            Err(StoreError::Schema { found: 3, expected: 2, .. })
        ));
    }

    /// A row written while `Allocation::request` was a string (the body exactly as that
    /// tesserad stored it) loads with the request typed, and is written back byte for byte.
    /// A row whose request no longer parses is a `BadRow` naming it, not a panic.
    #[test]
    fn rows_stored_with_a_string_request_still_load() {
        const OLD: &str = r#"{"container_id":"old","tenant":"acme/ml/x/alice","trust":"trusted","request":"mig=1g.10gb","isolation":"mig","devices":[{"uuid":"MIG-1","gpu_uuid":"GPU-1","gpu_index":0,"model":"H100-80GB","mig_profile":"1g.10gb","placement":[0,1]}],"injection":{"devices":[],"env":["CUDA_VISIBLE_DEVICES=MIG-1"],"mounts":[]},"state":"running","pid":42,"created_ms":1}"#;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.db");
        let s = Store::open(&path).expect("open");
        let insert = |id: &str, body: &str| {
            s.conn
                .execute(
                    "INSERT INTO allocations(container_id, body, runc_root, bundle, state, pid,
                         created_ms) VALUES(?1, ?2, '/run/runc', '/b', 'running', 42, 1)",
                    [id, body],
                )
                .expect("row");
        };
        insert("old", OLD);
        let got = s.get("old").expect("get").expect("kept").allocation;
        assert_eq!(got.request, GpuRequest::Mig { profile: "1g.10gb".into() });
        assert_eq!(serde_json::to_string(&got).expect("json"), OLD);

        insert("bad", &OLD.replace("mig=1g.10gb\"", "mig=huge\""));
        match s.get("bad") {
            Err(StoreError::BadRow { container_id, detail }) => {
                assert_eq!(container_id, "bad");
                assert!(detail.contains("bad value `huge` for `mig`"), "{detail}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_garbage_file_is_not_overwritten() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("state.db");
        std::fs::write(&path, b"this is not a database, but it is someone's data").expect("write");
        let err = Store::open(&path).unwrap_err();
        assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
        assert_eq!(
            std::fs::read(&path).expect("read"),
            b"this is not a database, but it is someone's data"
        );
    }

    #[test]
    fn the_name_tables_keep_the_newest_rows_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut s = Store::open(&dir.path().join("s.db")).expect("open");
        {
            let tx = s.conn.transaction().expect("tx");
            for i in 0..MAX_WORKLOAD_NAMES + 5 {
                tx.execute(
                    "INSERT INTO workloads(container_id, name, ts_ms) VALUES(?1, 'ns/p/c', ?2)",
                    params![format!("c{i}"), i],
                )
                .expect("insert");
            }
            tx.commit().expect("commit");
        }
        s.note_workload("newest", "ns/p/n").expect("note");
        let count: i64 =
            s.conn.query_row("SELECT COUNT(*) FROM workloads", [], |r| r.get(0)).expect("count");
        assert_eq!(count, MAX_WORKLOAD_NAMES);
        let oldest_left: i64 =
            s.conn.query_row("SELECT MIN(ts_ms) FROM workloads", [], |r| r.get(0)).expect("min");
        assert_eq!(oldest_left, 6, "the six oldest went");
        assert_eq!(s.pod_request_owner("sb", "a").expect("owner"), "a");
        assert_eq!(s.pod_request_owner("sb", "b").expect("owner"), "a", "the first stays");
    }
}
