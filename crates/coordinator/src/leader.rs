//! The quota books' leadership on this coordinator (issue 28, docs/QUOTAS.md "Books every
//! coordinator shares"): the journal that stores the leader's changes to the books in
//! fenced transactions ([`Journal`], one writer per leadership, group commit), and the
//! pure judgement of what a node's last authority says about split brain
//! ([`judge_authority`]). The election itself is the store's ([`crate::store::QuotaBackend`]);
//! acting on its outcome (taking the books over, passing calls on to the leader) is the
//! quota routes' (`quota.rs`).

use std::sync::Arc;

use fleet::quota_wire::{Authority, SeenAuthority};
use quota::books::state::{Changeset, StateOp};
use tokio::sync::{mpsc, oneshot};
use tracing::warn;

use crate::store::{Fence, QuotaBackend, StoreError};

/// Changes batched into one commit at most (the store splits them into transactions).
const MAX_BATCH_OPS: usize = 2_000;

struct Batch {
    ops: Vec<StateOp>,
    done: Option<oneshot::Sender<Result<(), String>>>,
}

/// The writer of one leadership's changes to the books: every change is stored in the
/// order it was made (one task, FIFO), in batches (whatever queued while the last commit
/// ran goes in the next), each transaction fenced by the leadership. A commit that fails
/// ends the journal: `failed` is called once (the coordinator then stops deciding) and
/// every later submission fails at once.
#[derive(Debug, Clone)]
pub(crate) struct Journal {
    tx: mpsc::UnboundedSender<Batch>,
}

impl std::fmt::Debug for Batch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batch").field("ops", &self.ops.len()).finish_non_exhaustive()
    }
}

/// What waits for a change to be stored.
pub(crate) type Stored = oneshot::Receiver<Result<(), String>>;

impl Journal {
    /// Start the writer for the leadership `fence` on `backend`.
    pub(crate) fn start(
        backend: Arc<dyn QuotaBackend>,
        fence: Fence,
        failed: impl FnOnce(StoreError) + Send + 'static,
    ) -> Journal {
        let (tx, mut rx) = mpsc::unbounded_channel::<Batch>();
        tokio::spawn(async move {
            let mut failed = Some(failed);
            while let Some(first) = rx.recv().await {
                let mut batches = vec![first];
                let mut n = batches[0].ops.len();
                while n < MAX_BATCH_OPS {
                    match rx.try_recv() {
                        Ok(b) => {
                            n += b.ops.len();
                            batches.push(b);
                        }
                        Err(_) => break,
                    }
                }
                let mut ops = Vec::with_capacity(n);
                let mut waiting = Vec::new();
                for b in batches {
                    ops.extend(b.ops);
                    waiting.extend(b.done);
                }
                let r = backend.commit_books(fence.clone(), ops).await;
                let text = r.as_ref().err().map(ToString::to_string);
                for w in waiting {
                    let _ = w.send(match &text {
                        None => Ok(()),
                        Some(e) => Err(e.clone()),
                    });
                }
                if let Err(e) = r {
                    warn!(
                        "the quota books could not be stored: {e}; this coordinator stops deciding"
                    );
                    if let Some(f) = failed.take() {
                        f(e);
                    }
                    // Whatever is queued fails: its waiters see the channel close.
                    rx.close();
                    while let Ok(b) = rx.try_recv() {
                        if let Some(d) = b.done {
                            let _ = d.send(Err(text.clone().unwrap_or_default()));
                        }
                    }
                    return;
                }
            }
        });
        Journal { tx }
    }

    /// Queue `cs`: `None` when nothing needs waiting for (no change, or none urgent);
    /// else what says when it is stored.
    pub(crate) fn submit(&self, cs: Changeset) -> Option<Stored> {
        if cs.ops.is_empty() && !cs.urgent {
            return None;
        }
        let (done, stored) = if cs.urgent {
            let (tx, rx) = oneshot::channel();
            (Some(tx), Some(rx))
        } else {
            (None, None)
        };
        if let Err(mpsc::error::SendError(b)) = self.tx.send(Batch { ops: cs.ops, done }) {
            if let Some(d) = b.done {
                let _ = d.send(Err("the quota books' journal has stopped".into()));
            }
        }
        stored
    }
}

/// What a node's last authority ([`SeenAuthority`]) says to the coordinator that decides
/// now (`me`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Judgement {
    /// This coordinator, an earlier leader of the same books, or an answer too old to say.
    Fine,
    /// A later leadership of the same books answered the node: this coordinator no longer
    /// leads, whatever it believes; it must stop deciding.
    Deposed,
    /// A coordinator of other books (another store, prefix or cluster; or one alone)
    /// answered the node lately: two coordinators decide for the same node.
    SplitBrain,
}

/// An answer older than this (at the node) says nothing about now.
pub const SPLIT_WINDOW_MS: u64 = 5_000;

/// Judges `seen` (from a node's sync) for `me`, the coordinator that decides now.
pub fn judge_authority(me: &Authority, seen: &SeenAuthority) -> Judgement {
    if seen.age_ms > SPLIT_WINDOW_MS || (seen.url == me.url && seen.term == me.term) {
        return Judgement::Fine;
    }
    if seen.scope != me.scope {
        return if seen.url == me.url { Judgement::Fine } else { Judgement::SplitBrain };
    }
    if seen.term > me.term {
        Judgement::Deposed
    } else {
        Judgement::Fine
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth(url: &str, term: u64) -> Authority {
        Authority { url: url.into(), term, since_ms: 0, scope: "etcd:X".into() }
    }

    fn seen(url: &str, term: u64, age_ms: u64) -> SeenAuthority {
        SeenAuthority { url: url.into(), term, age_ms, scope: String::new() }
    }

    #[test]
    fn a_nodes_last_authority_is_judged_by_books_term_and_age() {
        let me = auth("http://c1", 40);
        let j = |s: &SeenAuthority, scope: &str| {
            judge_authority(&me, &SeenAuthority { scope: scope.into(), ..s.clone() })
        };
        assert_eq!(j(&seen("http://c1", 40, 0), "etcd:X"), Judgement::Fine, "itself");
        assert_eq!(j(&seen("http://c2", 31, 100), "etcd:X"), Judgement::Fine, "the leader before");
        assert_eq!(j(&seen("http://c2", 55, 100), "etcd:X"), Judgement::Deposed, "a later leader");
        assert_eq!(j(&seen("http://c9", 3, 100), "sqlite:Y"), Judgement::SplitBrain);
        assert_eq!(j(&seen("http://c9", 3, 9_000), "sqlite:Y"), Judgement::Fine, "too old");
        assert_eq!(j(&seen("http://c1", 0, 100), "sqlite:old"), Judgement::Fine, "itself before");
    }
}
