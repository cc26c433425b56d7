//! The coordinator's quota state ([`QuotaState`]): the pure [`quota::books::Books`] behind
//! a mutex (never held across an await), the channel that wakes waiting gang members, and
//! the quotas in force. Part of the state every route is handed (`app`); the quota routes
//! that read and change it are `quota`'s.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::http::StatusCode;
use quota::books::Books;
use tokio::sync::watch;

use crate::http::{ApiErr, ApiResult};
use crate::now_ms;

/// How long a lease is good for by default (`--quota-lease-ttl-s`).
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(300);

/// The policy whose quotas are in force, parsed once per revision.
#[derive(Debug)]
pub(crate) struct InForce {
    /// The watch channel's latest version when this was found.
    pub(crate) seen: Option<u64>,
    pub(crate) policy: Option<(u64, Arc<policy::Policy>)>,
}

/// The coordinator's quota state: the books, the channel that wakes waiting gang members,
/// the quotas in force.
#[derive(Debug)]
pub struct QuotaState {
    books: Mutex<Books>,
    pub(crate) changed: watch::Sender<u64>,
    pub(crate) in_force: tokio::sync::Mutex<InForce>,
    pub(crate) lease_ttl: Duration,
}

impl QuotaState {
    /// Empty books issuing leases good for `lease_ttl`.
    pub fn new(lease_ttl: Duration) -> QuotaState {
        let (changed, _) = watch::channel(0);
        QuotaState {
            books: Mutex::new(Books::new(lease_ttl.as_secs(), now_ms())),
            changed,
            in_force: tokio::sync::Mutex::new(InForce { seen: None, policy: None }),
            lease_ttl,
        }
    }

    /// The lease lifetime handed to nodes.
    pub fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }

    pub(crate) fn books(&self) -> ApiResult<MutexGuard<'_, Books>> {
        self.books.lock().map_err(|_| {
            ApiErr::new(StatusCode::INTERNAL_SERVER_ERROR, "the quota books' lock is poisoned")
        })
    }

    pub(crate) fn wake(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }
}
