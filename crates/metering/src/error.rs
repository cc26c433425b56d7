//! Errors of the metering crate.

use std::path::PathBuf;

/// Why a ledger operation failed. Nothing is half-written on any of these: each write is
/// one SQLite transaction.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// The file exists but is not an intact SQLite database. It was left exactly as found:
    /// an operator must look at it (or move it aside) before a new ledger is started.
    #[error("ledger {path} is corrupt and was left untouched: {detail}")]
    Corrupt { path: PathBuf, detail: String },

    /// The file is an intact SQLite database, but not a Tessera metering ledger.
    #[error("{path} is a SQLite database but not a metering ledger: {detail}")]
    NotALedger { path: PathBuf, detail: String },

    /// The ledger was written by a newer version of this crate.
    #[error("ledger {path} has schema version {found}; this build understands up to {supported}")]
    UnsupportedVersion { path: PathBuf, found: i64, supported: i64 },

    /// Another process holds the ledger open for writing.
    #[error("ledger {path} is held by another process: {detail}")]
    Locked { path: PathBuf, detail: String },

    /// An interval start that cannot be recorded (empty id, bad tenant path, fraction out
    /// of range, ...).
    #[error("bad interval: {0}")]
    BadInterval(String),

    /// An interval is already open for this container and device with different facts.
    #[error("conflict: {0}")]
    Conflict(String),

    /// A usage query that cannot be answered as asked.
    #[error("bad usage query: {0}")]
    BadQuery(String),

    /// A roll-up did not add up. Never expected; reported instead of a wrong bill.
    #[error("usage roll-up is inconsistent: {0}")]
    Inconsistent(String),

    /// A row holds a value this build cannot read.
    #[error("ledger row {id} is unreadable: {detail}")]
    BadRow { id: String, detail: String },

    #[error("reading or writing the ledger file: {0}")]
    Io(#[from] std::io::Error),

    #[error("sqlite: {0}")]
    Sqlite(#[from] rusqlite::Error),
}
