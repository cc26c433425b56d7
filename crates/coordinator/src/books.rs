//! The coordinator's quota state ([`QuotaState`]): the pure [`quota::books::Books`] behind
//! a mutex (never held across an await), with the leadership they were taken over for and
//! its journal; the outcome of the election; the channel that wakes waiting gang members;
//! the quotas in force; what operators are warned of. Part of the state every route is
//! handed (`app`); the quota routes that read and change it are `quota`'s.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use axum::http::StatusCode;
use fleet::quota_wire::Authority;
use quota::books::Books;
use tokio::sync::watch;

use crate::http::{ApiErr, ApiResult};
use crate::leader::{Journal, Stored};
use crate::now_ms;
use crate::store::{QuotaBackend, Role};

/// How long a lease is good for by default (`--quota-lease-ttl-s`).
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(300);
/// The leader's etcd lease by default (`--quota-leader-ttl-s`): a killed leader is
/// followed after at most this (and etcd's expiry check). etcd grants at least its own
/// minimum, 3/2 of its election timeout (2 s with etcd's defaults).
pub const DEFAULT_LEADER_TTL: Duration = Duration::from_secs(2);
/// How long a warning stays in the status after it was last seen.
pub const WARNING_KEPT_MS: u64 = 60_000;

/// The policy whose quotas are in force, parsed once per revision.
#[derive(Debug)]
pub(crate) struct InForce {
    /// The watch channel's latest version when this was found.
    pub(crate) seen: Option<u64>,
    pub(crate) policy: Option<(u64, Arc<policy::Policy>)>,
}

/// How a coordinator takes part in fleet quotas.
#[derive(Debug, Clone)]
pub struct QuotaOptions {
    /// How long a lease handed to a node is good for.
    pub lease_ttl: Duration,
    /// The TTL of the etcd lease a leader holds its leadership by.
    pub leader_ttl: Duration,
    /// This coordinator's URL as the others reach it (default: from the listen address).
    pub advertise_url: Option<String>,
    /// The CA the other coordinators' certificates are checked against when a quota call
    /// is passed on to an `https://` leader.
    pub peer_tls: Option<Arc<rustls::ClientConfig>>,
}

impl Default for QuotaOptions {
    fn default() -> Self {
        QuotaOptions {
            lease_ttl: DEFAULT_LEASE_TTL,
            leader_ttl: DEFAULT_LEADER_TTL,
            advertise_url: None,
            peer_tls: None,
        }
    }
}

/// The books and what they are kept for.
#[derive(Debug)]
pub(crate) struct Cell {
    pub(crate) books: Books,
    /// The leadership (term) the books were taken over for; `None`: not deciding by an
    /// election (alone), or not taken over (a follower, or a leader still loading).
    pub(crate) term: Option<u64>,
    /// The writer of the books' changes while leading.
    pub(crate) journal: Option<Journal>,
    /// What this coordinator's books recorded and do not store (events, counters, costs),
    /// kept from when it last stopped deciding for when it decides again.
    pub(crate) history: Option<quota::books::History>,
}

impl Cell {
    /// Queue what the books changed since the last call: what to wait for, if anything.
    pub(crate) fn store_changes(&mut self) -> Option<Stored> {
        let journal = self.journal.as_ref()?;
        journal.submit(self.books.take_changes())
    }
}

/// Counters of the coordinator's part in quotas, for `/metrics`.
#[derive(Debug, Default)]
pub(crate) struct QuotaCounters {
    /// Node calls passed on to the leader.
    pub(crate) relayed: AtomicU64,
    /// Syncs whose last answer came from a coordinator of other books.
    pub(crate) split_brain: AtomicU64,
    /// Leaderships taken over.
    pub(crate) takeovers: AtomicU64,
}

/// The coordinator's quota state: the books, the election's outcome, the channel that wakes
/// waiting gang members, the quotas in force, warnings.
#[derive(Debug)]
pub struct QuotaState {
    cell: Mutex<Cell>,
    /// `cell.term` (0: `None`), written with it under the lock ([`QuotaState::set_term`])
    /// and read without it by every call's gate: one lock taken per call, not two.
    term: AtomicU64,
    pub(crate) changed: watch::Sender<u64>,
    pub(crate) in_force: tokio::sync::Mutex<InForce>,
    pub(crate) lease_ttl: Duration,
    pub(crate) opts: QuotaOptions,
    /// The books in a store every coordinator shares, and the election (etcd).
    pub(crate) backend: Option<Arc<dyn QuotaBackend>>,
    pub(crate) role: Arc<watch::Sender<Role>>,
    /// This coordinator's URL, once it listens.
    pub(crate) url: OnceLock<String>,
    /// A client of the leader, for the calls passed on to it (by URL).
    pub(crate) peer: Mutex<Option<(String, fleet::client::Client)>>,
    /// Warning key → (last seen, text).
    warnings: Mutex<BTreeMap<String, (u64, String)>>,
    /// The election and its follower, stopped when the coordinator stops.
    pub(crate) tasks: Mutex<Vec<tokio::task::JoinHandle<()>>>,
    pub(crate) counters: QuotaCounters,
}

fn poisoned() -> ApiErr {
    ApiErr::new(StatusCode::INTERNAL_SERVER_ERROR, "the quota books' lock is poisoned")
}

impl QuotaState {
    /// Empty books issuing leases good for `lease_ttl`, alone (no election).
    pub fn new(lease_ttl: Duration) -> QuotaState {
        QuotaState::with(QuotaOptions { lease_ttl, ..QuotaOptions::default() }, None)
    }

    /// Empty books; with `backend`, the books are kept there and decided by the coordinator
    /// the election makes leader.
    pub(crate) fn with(opts: QuotaOptions, backend: Option<Arc<dyn QuotaBackend>>) -> QuotaState {
        let (changed, _) = watch::channel(0);
        let (role, _) = watch::channel(Role::Follower { leader: None });
        QuotaState {
            cell: Mutex::new(Cell {
                books: Books::new(opts.lease_ttl.as_secs(), now_ms()),
                term: None,
                journal: None,
                history: None,
            }),
            term: AtomicU64::new(0),
            changed,
            in_force: tokio::sync::Mutex::new(InForce { seen: None, policy: None }),
            lease_ttl: opts.lease_ttl,
            opts,
            backend,
            role: Arc::new(role),
            url: OnceLock::new(),
            peer: Mutex::new(None),
            warnings: Mutex::new(BTreeMap::new()),
            tasks: Mutex::new(Vec::new()),
            counters: QuotaCounters::default(),
        }
    }

    /// The lease lifetime handed to nodes.
    pub fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }

    /// The election's outcome now.
    pub fn role(&self) -> Role {
        self.role.borrow().clone()
    }

    pub(crate) fn cell(&self) -> ApiResult<MutexGuard<'_, Cell>> {
        self.cell.lock().map_err(|_| poisoned())
    }

    pub(crate) fn wake(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Note a warning (`key` groups repeats); kept [`WARNING_KEPT_MS`] after it was last
    /// seen.
    pub(crate) fn warn(&self, key: &str, text: String) {
        if let Ok(mut w) = self.warnings.lock() {
            w.insert(key.to_string(), (now_ms(), text));
        }
    }

    /// The warnings of the last minute, and whether one of them is split brain.
    pub(crate) fn warnings(&self) -> (Vec<String>, bool) {
        let now = now_ms();
        let Ok(mut w) = self.warnings.lock() else { return (Vec::new(), false) };
        w.retain(|_, (at, _)| now.saturating_sub(*at) <= WARNING_KEPT_MS);
        let split = w.keys().any(|k| k.starts_with("split-brain"));
        (w.values().map(|(_, t)| t.clone()).collect(), split)
    }

    /// Whether a split-brain warning is current.
    pub(crate) fn split_brain_now(&self) -> bool {
        self.warnings().1
    }

    /// The authority of a coordinator alone (no election), once it listens.
    pub(crate) fn alone(&self, since_ms: u64, scope: String) -> Role {
        Role::Alone {
            authority: Authority {
                url: self.url.get().cloned().unwrap_or_default(),
                term: 0,
                since_ms,
                scope,
            },
        }
    }

    /// The leadership the books were taken over for (`None`: not deciding by an
    /// election): `cell.term`, and the copy the gate reads ([`QuotaState::decides_for`]).
    pub(crate) fn set_term(&self, cell: &mut Cell, term: Option<u64>) {
        cell.term = term;
        self.term.store(term.unwrap_or(0), Ordering::SeqCst);
    }

    /// Whether the books were taken over for leadership `term` (> 0), read without the
    /// books' lock (the call rechecks under it before deciding); an error, as taking the
    /// lock would give, when it is poisoned.
    pub(crate) fn decides_for(&self, term: u64) -> ApiResult<bool> {
        self.unpoisoned()?;
        Ok(term > 0 && self.term.load(Ordering::SeqCst) == term)
    }

    /// The error [`QuotaState::cell`] gives when the books' lock is poisoned (a panic
    /// while it was held), without taking it.
    pub(crate) fn unpoisoned(&self) -> ApiResult<()> {
        if self.cell.is_poisoned() {
            return Err(poisoned());
        }
        Ok(())
    }

    /// Count one takeover.
    pub(crate) fn took_over(&self) {
        self.counters.takeovers.fetch_add(1, Ordering::Relaxed);
    }
}
