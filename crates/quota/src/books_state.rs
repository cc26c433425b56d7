//! The books' durable state (issue 28, docs/QUOTAS.md "Books every coordinator shares"):
//! what a coordinator that takes over the books needs to decide at once without ever
//! counting less than the nodes may hold. Pure: the coordinator writes it to etcd (in
//! transactions fenced by its leadership) and reads it back when it becomes the leader.
//!
//! * Each node the books know: its capacity, the holdings of its last sync that changed
//!   anything, the leases issued to it and those it reported, the containers it is
//!   stopping.
//! * Every admission answered and not yet listed by its node (pending).
//! * Every reclaim in progress: its claimant, the capacity held for it, its victims and
//!   their grace, so that a new leader takes no second victim for the same claim.
//! * While the books are being rebuilt from the nodes' syncs (not ready), since when: books
//!   taken over from such a state go on rebuilding ([`Books::restore`]).
//! * The fair queue (issue 27): each request waiting with its arrival, each claim's first
//!   ask (owed then or not) and since when it has been owed, preempted work's requeue
//!   backoff, and that the stored queue is whole: books taken over from it judge a request
//!   as the books before would have, at once.
//!
//! What is kept is a superset of what the nodes may hold: an admission or a reclaim is
//! written before it is answered; a lease that grows is written before the answer that
//! carries it; a node's first sync (the only account of work no stored record names) and
//! books being rebuilt saying so are written before they are answered; so are a request
//! joining the fair queue, a claim's first ask and its owed-since; everything else (a
//! later sync's holdings, a release, a lease that shrinks, the books becoming ready, a
//! queue entry expiring) may be written later, and until it is the stored state counts
//! more, never less (an entry that expired and is still stored expires again in the books
//! taken over, from the same stored time). The books mark
//! what changed (`Changes`) and [`Books::take_changes`] hands it out as [`StateOp`]s,
//! saying whether the answer must wait for them (`urgent`). Books restored from it
//! ([`Books::restore`]) are ready at once, unless it says its books were being rebuilt.
//!
//! * What the books recorded of what they decided: each tenant's record (work lost to
//!   preemption, preemption times within the hour, owner and owed-later waits, reclaims and
//!   preemptions counted) and the events, handed out at most every
//!   [`super::RECORD_STEP_MS`] (never urgent): a change of leader loses at most that much
//!   of what the status, `/metrics` and the events show.
//!
//! Not kept (rebuilt or lost at a change of leader, never to anyone's loss of a guarantee
//! or crossing of a ceiling): gangs still assembling (their members' long polls end; they
//! ask again), kept gang answers, lease recalls.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::{
    Books, ClaimKey, Cost, Entry, NodeBook, NodeContainer, Pending, Reclaim, Requeue, TenantClaim,
    WaitEntry, EVENTS_KEPT,
};
use crate::amount::{Resource, Resources};
use crate::spec::QuotaTree;
use crate::wire::{Amounts, Holding, Lease, QuotaClass, QuotaEvent, QuotaEventKind, Victim};

/// One node as the durable books keep it. Its holdings are kept one by one
/// ([`StateOp::PutHolding`]): a sync that changes one holding writes one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeState {
    pub capacity: Amounts,
    /// Empty in [`StateOp::PutNode`]; the holdings of the node in [`BooksState`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub holdings: Vec<Holding>,
    /// Leases last issued to the node.
    pub issued: Vec<Lease>,
    /// Leases the node said it held at its last sync.
    pub reported: Vec<Lease>,
    /// Containers it is stopping for a reclaim.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stopping: Vec<String>,
}

/// An admission answered and not yet listed by its node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PendingState {
    pub node: String,
    pub container_id: String,
    pub tenant: String,
    pub amounts: Amounts,
    pub class: QuotaClass,
    pub started_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub over: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gang: Option<String>,
    /// It writes a checkpoint on SIGTERM (issue 27).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub checkpoint: bool,
    /// Its workload (issue 27).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<String>,
}

/// A reclaim in progress: capacity held on `node` for `tenant`, its victims.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReclaimState {
    pub node: String,
    pub tenant: String,
    /// Which claim of the tenant on the node (issue 27: its workload, else its container).
    #[serde(default)]
    pub claim: String,
    pub amounts: Amounts,
    pub victims: Vec<Victim>,
    pub started_ms: u64,
    pub retry_after_s: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub freed_ms: Option<u64>,
    pub message: String,
    /// Its victims are another reclaim's: it waits for them under a full ceiling.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shared: bool,
    /// A consolidation's hold: its claimant borrowed (issue 27).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub consolidation: bool,
    /// Where a consolidation promised its victims room: (node, what each holds). Written
    /// by coordinators before the promise moved to the victims' requeue records
    /// (`RequeueState::moved_to`); read and ignored, never written now.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub moves: Vec<(String, Amounts)>,
}

/// Everything the durable books hold.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BooksState {
    pub nodes: BTreeMap<String, NodeState>,
    pub pending: Vec<PendingState>,
    pub reclaims: Vec<ReclaimState>,
    /// The books that wrote this were still being rebuilt from the nodes' syncs (the first
    /// leader of an empty store, not ready yet), since this time (ms since the epoch, the
    /// coordinator's clock): a node known to the coordinator may hold a lease and work the
    /// state does not name yet, so books taken over from it are not ready either.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebuilding_since_ms: Option<u64>,
    /// The fair queue (issue 27): requests waiting, in the order they arrived.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub waiting: Vec<WaitingState>,
    /// Claims answered something other than admitted: their first ask, since when owed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub asks: Vec<AskState>,
    /// Preempted work's requeue backoff.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub requeues: Vec<RequeueState>,
    /// The books that wrote this kept the fair queue (`waiting`, `asks`, `requeues`) whole:
    /// books taken over from a state without it (written before the queue was kept, or by
    /// books that were still relearning it) relearn the queue ([`Books::restore`]). Books
    /// that keep it write the mark with every batch; a store says it only if nothing was
    /// written after the mark (etcd: no books key of a later revision), so a coordinator of
    /// a version that does not store the queue, deciding in between, leaves it unsaid.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub queue_kept: bool,
    /// Each tenant's record (what preemption cost it, its waits, its counters).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub records: Vec<RecordState>,
    /// The events kept, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub events: Vec<EventState>,
    /// Who stored the record last, and how many times ([`RecordMark`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub record_mark: Option<RecordMark>,
}

/// Written with every hand-out of the record (after its records and events): the term of
/// the leadership whose books wrote it and how many hand-outs of the record its line of
/// books has made. Books that took the store over, or last stored their record, under this
/// mark know that the store holds nothing of the record they do not
/// ([`Books::keep_history`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordMark {
    pub term: u64,
    pub count: u64,
}

/// Work lost to preemption, by resource: in the resource's unit × seconds.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LostState {
    /// Micro-GPU-seconds, by GPU model.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub gpus: BTreeMap<String, u128>,
    /// Millicore-seconds.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cpu_milli: u128,
    /// MiB-seconds.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub memory_mib: u128,
}

fn is_zero(n: &u128) -> bool {
    *n == 0
}

/// What one tenant's record holds: what preemption cost it, how long its owed requests
/// waited, how many reclaims it started and how many of its containers were victims.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordState {
    pub tenant: String,
    /// When its containers were chosen as victims (within the last hour when written).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub preempted_ms: Vec<u64>,
    #[serde(default)]
    pub lost: LostState,
    /// Its owed requests' last waits, ms, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub owner_waits_ms: Vec<u64>,
    /// Its requests owed only later: their last waits while owed, ms, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub owed_later_waits_ms: Vec<u64>,
    /// Reclaims it started as claimant.
    #[serde(default)]
    pub reclaims: u64,
    /// Its containers chosen as victims.
    #[serde(default)]
    pub preemptions: u64,
}

/// One event and its place in the books' sequence of events.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EventState {
    pub seq: u64,
    pub event: QuotaEvent,
}

/// The step the fair queue's last-ask times are stored to (rewritten, lazily, each time one
/// moves a step). The books count a last ask as the end of its step ([`counted`]), so books
/// taken over from the stored times let an entry, a first ask or an owed-since go exactly
/// when the books before would have: each lives up to one step longer than its TTL.
pub const STORED_TIME_STEP_MS: u64 = 30_000;

/// Whether events of `kind` are stored with the record: those that explain it and are
/// rare (reclaims, preemptions, leases run out, gangs timed out, nodes gone). One per
/// admission (borrow, refuse, gang admitted, resize) would cost the store a write per
/// admission: those are the deciding coordinator's memory.
pub fn stored_kind(kind: QuotaEventKind) -> bool {
    matches!(
        kind,
        QuotaEventKind::Reclaim
            | QuotaEventKind::Preempt
            | QuotaEventKind::LeaseExpired
            | QuotaEventKind::GangTimeout
            | QuotaEventKind::NodeRemoved
    )
}

/// `t` to the step it is stored to ([`STORED_TIME_STEP_MS`]).
pub(super) fn coarse(t: u64) -> u64 {
    t - t % STORED_TIME_STEP_MS
}

/// A last ask at `t` as the books count it: the end of its stored step, the same from the
/// books' own time and from the stored one.
pub(super) fn counted(t: u64) -> u64 {
    coarse(t).saturating_add(STORED_TIME_STEP_MS)
}

/// A request waiting in the fair queue: where, whose, for what, since when, last asked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WaitingState {
    pub node: String,
    pub container_id: String,
    pub tenant: String,
    pub claim: String,
    pub amounts: Amounts,
    pub arrived_ms: u64,
    /// Its last ask, to [`STORED_TIME_STEP_MS`]: it leaves the queue the queue's TTL after.
    pub last_seen_ms: u64,
    /// It joined while the books relearned the queue after a takeover: its place is the
    /// order of the asks again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub relearned: bool,
}

/// A claim answered something other than admitted: when it first asked and whether it was
/// owed then (its wait is an owner's), and since when it has been owed if it was not owed
/// at once (its path's `owed_reclaim_after_s` counts from there).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AskState {
    pub node: String,
    pub tenant: String,
    pub claim: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_asked_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub owed_first: bool,
    /// Its last ask, to [`STORED_TIME_STEP_MS`] (the first ask is forgotten an hour after).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_asked_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owed_since_ms: Option<u64>,
    /// The last ask that found it owed, to [`STORED_TIME_STEP_MS`] (owed again from zero
    /// when none has for the queue's TTL).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owed_seen_ms: Option<u64>,
}

/// Work preempted by a reclaim: how often, last when, and when its requeue backoff ends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequeueState {
    pub tenant: String,
    pub claim: String,
    pub preemptions: u32,
    pub last_ms: u64,
    pub until_ms: u64,
    /// Moved by a consolidation: the node promised room for it, and what it holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moved_to: Option<(String, Amounts)>,
}

/// One change to the durable books.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StateOp {
    /// The node's record, without its holdings.
    PutNode {
        node: String,
        state: NodeState,
    },
    /// The node and all its holdings.
    DelNode {
        node: String,
    },
    PutHolding {
        node: String,
        holding: Holding,
    },
    DelHolding {
        node: String,
        container_id: String,
    },
    PutPending(PendingState),
    DelPending {
        node: String,
        container_id: String,
    },
    PutReclaim(ReclaimState),
    DelReclaim {
        node: String,
        tenant: String,
        claim: String,
    },
    /// The books are being rebuilt from the nodes' syncs since `since_ms`
    /// ([`BooksState::rebuilding_since_ms`]).
    PutRebuilding {
        since_ms: u64,
    },
    /// The books are ready: rebuilt.
    DelRebuilding,
    PutWaiting(WaitingState),
    DelWaiting {
        node: String,
        container_id: String,
    },
    PutAsk(AskState),
    DelAsk {
        node: String,
        tenant: String,
        claim: String,
    },
    PutRequeue(RequeueState),
    DelRequeue {
        tenant: String,
        claim: String,
    },
    /// The stored fair queue is whole from here on ([`BooksState::queue_kept`]).
    PutQueueKept,
    PutRecord(RecordState),
    DelRecord {
        tenant: String,
    },
    PutEvent(EventState),
    DelEvent {
        seq: u64,
    },
    /// The record was handed out under this mark ([`BooksState::record_mark`]).
    PutRecordMark(RecordMark),
}

/// What [`Books::take_changes`] hands out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changeset {
    pub ops: Vec<StateOp>,
    /// The answer of the call that made these changes must wait until they are stored: an
    /// admission, a reclaim, a lease grown beyond what is stored, a node removed, books
    /// that are being rebuilt saying so.
    pub urgent: bool,
}

/// What changed since the last [`Books::take_changes`] (only while tracking is on).
#[derive(Debug, Clone, Default)]
pub(super) struct Changes {
    pub(super) on: bool,
    pub(super) nodes: BTreeSet<String>,
    pub(super) holdings: BTreeSet<NodeContainer>,
    pub(super) pending: BTreeSet<NodeContainer>,
    pub(super) reclaims: BTreeSet<ClaimKey>,
    pub(super) waiting: BTreeSet<NodeContainer>,
    pub(super) asks: BTreeSet<ClaimKey>,
    pub(super) requeues: BTreeSet<TenantClaim>,
    pub(super) urgent: bool,
}

impl Changes {
    pub(super) fn node(&mut self, node: &str) {
        if self.on {
            self.nodes.insert(node.to_string());
        }
    }
    pub(super) fn holding(&mut self, key: NodeContainer) {
        if self.on {
            self.holdings.insert(key);
        }
    }
    pub(super) fn pending(&mut self, key: &NodeContainer, urgent: bool) {
        if self.on {
            self.pending.insert(key.clone());
            self.urgent |= urgent;
        }
    }
    /// The call that made the changes answers only once they are stored (a resize).
    pub(super) fn mark_urgent(&mut self) {
        if self.on {
            self.urgent = true;
        }
    }
    pub(super) fn reclaim(&mut self, key: &ClaimKey, urgent: bool) {
        if self.on {
            self.reclaims.insert(key.clone());
            self.urgent |= urgent;
        }
    }
    /// A request joined the fair queue (`urgent`: stored before its answer, so that a
    /// leader taking over knows the order it arrived in) or left it.
    pub(super) fn waiting(&mut self, key: &NodeContainer, urgent: bool) {
        if self.on {
            self.waiting.insert(key.clone());
            self.urgent |= urgent;
        }
    }
    /// A claim's first ask or owed-since changed (`urgent`: a first ask or owed-since
    /// recorded).
    pub(super) fn ask(&mut self, key: &ClaimKey, urgent: bool) {
        if self.on {
            self.asks.insert(key.clone());
            self.urgent |= urgent;
        }
    }
    pub(super) fn requeue(&mut self, key: &TenantClaim) {
        if self.on {
            self.requeues.insert(key.clone());
        }
    }
}

fn leases_of(m: &BTreeMap<String, Resources>) -> Vec<Lease> {
    m.iter().map(|(p, r)| Lease { path: p.clone(), amounts: Amounts::from_resources(r) }).collect()
}

fn leases_from(v: &[Lease]) -> BTreeMap<String, Resources> {
    v.iter().map(|l| (l.path.clone(), l.amounts.to_resources())).collect()
}

fn holding_of(container: &str, e: &Entry) -> Holding {
    Holding {
        container_id: container.to_string(),
        tenant: e.tenant.clone(),
        amounts: Amounts::from_resources(&e.resources),
        class: e.class.into(),
        started_ms: e.started_ms,
        gang: e.gang.clone(),
        workload: e.workload.clone(),
        under_lease: false,
        checkpoint: e.checkpoint,
    }
}

/// Whether `a` holds more than `b` of some resource on some path.
fn grew(a: &BTreeMap<String, Resources>, b: &BTreeMap<String, Resources>) -> bool {
    a.iter().any(|(p, r)| !r.fits_in(&b.get(p).cloned().unwrap_or_default()))
}

impl NodeBook {
    fn state(&self, with_holdings: bool) -> NodeState {
        NodeState {
            capacity: Amounts::from_resources(&self.capacity),
            holdings: if with_holdings {
                self.holdings.iter().map(|(c, e)| holding_of(c, e)).collect()
            } else {
                Vec::new()
            },
            issued: leases_of(&self.issued),
            reported: leases_of(&self.reported),
            stopping: self.stopping.iter().cloned().collect(),
        }
    }
}

impl Pending {
    fn state(&self, key: &NodeContainer) -> PendingState {
        PendingState {
            node: key.0.clone(),
            container_id: key.1.clone(),
            tenant: self.entry.tenant.clone(),
            amounts: Amounts::from_resources(&self.entry.resources),
            class: self.entry.class.into(),
            started_ms: self.entry.started_ms,
            over: self.over.clone(),
            gang: self.entry.gang.clone(),
            checkpoint: self.entry.checkpoint,
            workload: self.entry.workload.clone(),
        }
    }
}

impl WaitEntry {
    fn state(&self, key: &NodeContainer) -> WaitingState {
        WaitingState {
            node: key.0.clone(),
            container_id: key.1.clone(),
            tenant: self.tenant.clone(),
            claim: self.claim.clone(),
            amounts: Amounts::from_resources(&self.resources),
            arrived_ms: self.arrived_ms,
            last_seen_ms: coarse(self.last_seen_ms),
            relearned: self.relearned,
        }
    }
}

impl Requeue {
    fn state(&self, key: &TenantClaim) -> RequeueState {
        RequeueState {
            tenant: key.0.clone(),
            claim: key.1.clone(),
            preemptions: self.preemptions,
            last_ms: self.last_ms,
            until_ms: self.until_ms,
            moved_to: self.moved_to.as_ref().map(|(n, r)| (n.clone(), Amounts::from_resources(r))),
        }
    }
}

impl Reclaim {
    fn state(&self, key: &ClaimKey) -> ReclaimState {
        ReclaimState {
            claim: key.2.clone(),
            node: key.0.clone(),
            tenant: key.1.clone(),
            amounts: Amounts::from_resources(&self.resources),
            victims: self.victims.clone(),
            started_ms: self.started_ms,
            retry_after_s: self.retry_after_s,
            freed_ms: self.freed_ms,
            message: self.message.clone(),
            shared: self.shared,
            consolidation: self.consolidation,
            moves: Vec::new(),
        }
    }
}

impl Books {
    /// Start (or stop) marking what changes for [`Books::take_changes`]. Off by default:
    /// books nobody stores (a node's own, a coordinator without etcd) keep no marks.
    pub fn track_changes(&mut self, on: bool) {
        self.changes = Changes { on, ..Changes::default() };
    }

    /// What changed since the last call, as writes to the durable books, and whether the
    /// answer of the call that changed them must wait for them to be stored.
    pub fn take_changes(&mut self) -> Changeset {
        let c = std::mem::replace(&mut self.changes, Changes { on: true, ..Changes::default() });
        if !c.on {
            self.changes.on = false;
            return Changeset::default();
        }
        let mut out = Changeset { ops: Vec::new(), urgent: c.urgent };
        // Books being rebuilt say so first, before any node they heard from: books taken
        // over from a state that names some nodes must not take it for all of them.
        if self.ready == self.durable_rebuilding {
            self.durable_rebuilding = !self.ready;
            if self.ready {
                out.ops.push(StateOp::DelRebuilding);
            } else {
                out.urgent = true;
                out.ops.push(StateOp::PutRebuilding { since_ms: self.started_ms });
            }
        }
        for node in c.nodes {
            match self.nodes.get_mut(&node) {
                Some(nb) => {
                    out.urgent |= grew(&nb.issued, &nb.durable_issued);
                    nb.durable_issued = nb.issued.clone();
                    out.ops.push(StateOp::PutNode { state: nb.state(false), node });
                }
                None => out.ops.push(StateOp::DelNode { node }),
            }
        }
        for NodeContainer(node, container_id) in c.holdings {
            let held = self.nodes.get(&node).and_then(|nb| nb.holdings.get(&container_id));
            match held {
                Some(e) => {
                    let holding = holding_of(&container_id, e);
                    out.ops.push(StateOp::PutHolding { node, holding });
                }
                // Gone with its node: the node's deletion takes its holdings.
                None if !self.nodes.contains_key(&node) => {}
                None => out.ops.push(StateOp::DelHolding { node, container_id }),
            }
        }
        for key in c.pending {
            match self.pending.get(&key) {
                Some(p) => out.ops.push(StateOp::PutPending(p.state(&key))),
                None => out.ops.push(StateOp::DelPending { node: key.0, container_id: key.1 }),
            }
        }
        for key in c.reclaims {
            match self.reclaims.get(&key) {
                Some(r) => out.ops.push(StateOp::PutReclaim(r.state(&key))),
                None => {
                    out.ops.push(StateOp::DelReclaim { node: key.0, tenant: key.1, claim: key.2 })
                }
            }
        }
        for key in c.waiting {
            match self.waiting.get(&key) {
                Some(w) => out.ops.push(StateOp::PutWaiting(w.state(&key))),
                None => out.ops.push(StateOp::DelWaiting { node: key.0, container_id: key.1 }),
            }
        }
        for key in c.asks {
            match self.ask_state(&key) {
                Some(a) => out.ops.push(StateOp::PutAsk(a)),
                None => out.ops.push(StateOp::DelAsk { node: key.0, tenant: key.1, claim: key.2 }),
            }
        }
        for key in c.requeues {
            match self.requeues.get(&key) {
                Some(q) => out.ops.push(StateOp::PutRequeue(q.state(&key))),
                None => out.ops.push(StateOp::DelRequeue { tenant: key.0, claim: key.1 }),
            }
        }
        self.hand_out_record(&mut out.ops);
        // Last, and with every batch while the queue is whole: the store tells a queue
        // kept whole by the mark's being written with (or after) every other key (etcd:
        // its revision), so books of a version that does not store the queue, deciding
        // in between, leave it marked stale (`BooksState::queue_kept`).
        if self.queue_kept && (!self.durable_queue_kept || !out.ops.is_empty()) {
            self.durable_queue_kept = true;
            out.ops.push(StateOp::PutQueueKept);
        }
        out
    }

    /// The record (each tenant's that changed, the events) with its mark, once a
    /// [`super::RECORD_STEP_MS`] has passed since it was last handed out (by the clock of
    /// the calls, either way: a clock set back does not hold it up), all at once: the
    /// events a call records and the records it changes go out together. Never urgent.
    fn hand_out_record(&mut self, ops: &mut Vec<StateOp>) {
        let due = self.record_forced
            || self.last_now_ms.abs_diff(self.record_stored_ms) >= super::RECORD_STEP_MS;
        if !due || (self.record_due.is_empty() && !self.events_dirty) {
            return;
        }
        self.record_stored_ms = self.last_now_ms;
        for tenant in std::mem::take(&mut self.record_due) {
            match self.record_state(&tenant) {
                Some(r) => ops.push(StateOp::PutRecord(r)),
                None => ops.push(StateOp::DelRecord { tenant }),
            }
        }
        let mut handed = !ops.is_empty();
        if self.events_dirty {
            let kept: BTreeSet<u64> = self.stored_events().map(|(seq, _)| seq).collect();
            let before = ops.len();
            let rewrite = std::mem::take(&mut self.events_rewrite);
            for &seq in &self.durable_events {
                if rewrite || !kept.contains(&seq) {
                    ops.push(StateOp::DelEvent { seq });
                }
            }
            for (seq, event) in self.stored_events() {
                if rewrite || !self.durable_events.contains(&seq) {
                    ops.push(StateOp::PutEvent(EventState { seq, event: event.clone() }));
                }
            }
            self.durable_events = kept;
            self.events_dirty = false;
            handed |= ops.len() > before;
        }
        if !handed {
            return;
        }
        let mark = RecordMark {
            term: self.record_term,
            count: self.record_mark.map_or(0, |m| m.count).saturating_add(1),
        };
        self.record_mark = Some(mark);
        ops.push(StateOp::PutRecordMark(mark));
    }

    /// The events kept that are stored ([`stored_kind`]), with their numbers, oldest first.
    fn stored_events(&self) -> impl Iterator<Item = (u64, &QuotaEvent)> {
        self.event_seqs.iter().copied().zip(&self.events).filter(|(_, e)| stored_kind(e.kind))
    }

    /// `tenant`'s record as stored; `None` when it has none.
    fn record_state(&self, tenant: &str) -> Option<RecordState> {
        let cost = self.costs.get(tenant);
        let mut lost = LostState::default();
        for (res, n) in cost.map(|c| &c.lost).into_iter().flatten() {
            match res {
                Resource::Gpu(model) => {
                    lost.gpus.insert(model.clone(), *n);
                }
                Resource::Cpu => lost.cpu_milli = *n,
                Resource::Memory => lost.memory_mib = *n,
            }
        }
        let r = RecordState {
            tenant: tenant.to_string(),
            preempted_ms: cost
                .map(|c| c.preempted_ms.iter().copied().collect())
                .unwrap_or_default(),
            lost,
            owner_waits_ms: cost
                .map(|c| c.owner_waits.iter().copied().collect())
                .unwrap_or_default(),
            owed_later_waits_ms: cost
                .map(|c| c.owed_later_waits.iter().copied().collect())
                .unwrap_or_default(),
            reclaims: self.counters.reclaims.get(tenant).copied().unwrap_or(0),
            preemptions: self.counters.preemptions.get(tenant).copied().unwrap_or(0),
        };
        let empty = RecordState { tenant: r.tenant.clone(), ..RecordState::default() };
        (r != empty).then_some(r)
    }

    /// A claim's first ask and owed-since, as stored; `None` when it has neither.
    fn ask_state(&self, key: &ClaimKey) -> Option<AskState> {
        let first = self.first_asks.get(key);
        let since = self.owed_since.get(key);
        if first.is_none() && since.is_none() {
            return None;
        }
        Some(AskState {
            node: key.0.clone(),
            tenant: key.1.clone(),
            claim: key.2.clone(),
            first_asked_ms: first.map(|&(at, _, _)| at),
            owed_first: first.is_some_and(|&(_, owed, _)| owed),
            last_asked_ms: first.map(|&(_, _, last)| coarse(last)),
            owed_since_ms: since.map(|&(at, _)| at),
            owed_seen_ms: since.map(|&(_, last)| coarse(last)),
        })
    }

    /// Everything the durable books would hold now (what [`Books::take_changes`] has
    /// handed out, applied to an empty store, comes to this).
    pub fn state(&self) -> BooksState {
        BooksState {
            nodes: self.nodes.iter().map(|(n, nb)| (n.clone(), nb.state(true))).collect(),
            pending: self.pending.iter().map(|(k, p)| p.state(k)).collect(),
            reclaims: self.reclaims.iter().map(|(k, r)| r.state(k)).collect(),
            rebuilding_since_ms: (!self.ready).then_some(self.started_ms),
            waiting: self.waiting.iter().map(|(k, w)| w.state(k)).collect(),
            asks: self
                .first_asks
                .keys()
                .chain(self.owed_since.keys())
                .collect::<BTreeSet<_>>()
                .into_iter()
                .filter_map(|k| self.ask_state(k))
                .collect(),
            requeues: self.requeues.iter().map(|(k, q)| q.state(k)).collect(),
            queue_kept: self.queue_kept,
            records: self
                .costs
                .keys()
                .chain(self.counters.reclaims.keys())
                .chain(self.counters.preemptions.keys())
                .collect::<BTreeSet<_>>()
                .into_iter()
                .filter_map(|t| self.record_state(t))
                .collect(),
            events: self
                .stored_events()
                .map(|(seq, e)| EventState { seq, event: e.clone() })
                .collect(),
            record_mark: self.record_mark,
        }
    }

    /// Books taken over from `state` at `now` by a coordinator that has just become the
    /// one that decides: ready at once (the state counts at least what the nodes may hold),
    /// every node counted as heard from now (its silence starts with these books), every
    /// lease due for computing at its node's next sync. `tree`: the quotas in force.
    ///
    /// A state written by books still being rebuilt ([`BooksState::rebuilding_since_ms`])
    /// names only the nodes that had synced: the books taken over from it are being
    /// rebuilt too, since the same time ([`Books::ready`]: every known node the state does
    /// not name syncs first, or the lease TTL and its margin pass since then).
    ///
    /// A state that names no node, admission or reclaim has nothing to take over: the books
    /// are rebuilt from the nodes' syncs, as new books are.
    ///
    /// The fair queue comes back as it was stored, its last-ask times to the step they are
    /// stored to ([`STORED_TIME_STEP_MS`]), which is all the books before counted of them
    /// ([`counted`]): an entry, a first ask or an owed-since goes when it would have. A state that did not
    /// keep the queue whole ([`BooksState::queue_kept`]) leaves the books to relearn it from
    /// the requests asking again (`Books::settling`).
    pub fn restore(lease_ttl_s: u64, now: u64, state: BooksState, tree: &QuotaTree) -> Books {
        let mut b = Books::new(lease_ttl_s, now);
        // A state that names no node, admission or reclaim: nothing to take over (the
        // first leader of an empty store, or every node gone). The books are rebuilt from
        // the nodes' syncs, as a coordinator alone does (ready once every known node has
        // synced, or at most TTL + 10 s): leases handed out before every node has reported
        // its capacity would give the first to sync the whole guarantee and the others
        // nothing. Nobody can be waiting where no node is: its queue is whole.
        let fresh = state.nodes.is_empty() && state.pending.is_empty() && state.reclaims.is_empty();
        if !state.queue_kept && !fresh {
            b.restored_ms = Some(now);
            b.queue_kept = false;
        }
        b.durable_queue_kept = state.queue_kept;
        for w in state.waiting {
            b.waiting.insert(
                NodeContainer(w.node, w.container_id),
                WaitEntry {
                    tenant: w.tenant,
                    claim: w.claim,
                    resources: w.amounts.to_resources(),
                    arrived_ms: w.arrived_ms,
                    last_seen_ms: w.last_seen_ms,
                    why: "asked before this coordinator took the books over".into(),
                    relearned: w.relearned,
                },
            );
        }
        for a in state.asks {
            let key = (a.node, a.tenant, a.claim);
            if let Some(at) = a.first_asked_ms {
                b.first_asks.insert(key.clone(), (at, a.owed_first, a.last_asked_ms.unwrap_or(at)));
            }
            if let Some(since) = a.owed_since_ms {
                b.owed_since.insert(key, (since, a.owed_seen_ms.unwrap_or(since)));
            }
        }
        for r in state.records {
            let mut lost: BTreeMap<Resource, u128> = BTreeMap::new();
            for (model, n) in r.lost.gpus {
                lost.insert(Resource::Gpu(model), n);
            }
            for (res, n) in
                [(Resource::Cpu, r.lost.cpu_milli), (Resource::Memory, r.lost.memory_mib)]
            {
                if n > 0 {
                    lost.insert(res, n);
                }
            }
            let cost = Cost {
                preempted_ms: r.preempted_ms.into_iter().collect(),
                lost,
                owner_waits: r.owner_waits_ms.into_iter().collect(),
                owed_later_waits: r.owed_later_waits_ms.into_iter().collect(),
            };
            if cost != Cost::default() {
                b.costs.insert(r.tenant.clone(), cost);
            }
            if r.reclaims > 0 {
                b.counters.reclaims.insert(r.tenant.clone(), r.reclaims);
            }
            if r.preemptions > 0 {
                b.counters.preemptions.insert(r.tenant, r.preemptions);
            }
        }
        // The stored events as the store holds them (each number once, in order; whatever
        // it holds beyond the bound, or twice, is deleted at the next hand-out).
        let mut events = state.events;
        b.durable_events = events.iter().map(|e| e.seq).collect();
        events.sort_by_key(|e| e.seq);
        events.dedup_by_key(|e| e.seq);
        let keep_from = events.len().saturating_sub(EVENTS_KEPT);
        let events = events.split_off(keep_from);
        b.events_dirty = b.durable_events.len() != events.len();
        match events.last().map(|e| e.seq.checked_add(1)) {
            None => {}
            Some(Some(next)) => {
                b.event_seqs = events.iter().map(|e| e.seq).collect();
                b.event_seq = next;
            }
            // Numbered up to the end: numbered anew, and every one written again.
            Some(None) => {
                b.event_seqs = (0..events.len() as u64).collect();
                b.event_seq = events.len() as u64;
                b.events_rewrite = true;
                b.events_dirty = true;
            }
        }
        b.events = events.into_iter().map(|e| e.event).collect();
        b.record_mark = state.record_mark;
        for q in state.requeues {
            b.requeues.insert(
                TenantClaim(q.tenant, q.claim),
                Requeue {
                    preemptions: q.preemptions,
                    last_ms: q.last_ms,
                    until_ms: q.until_ms,
                    moved_to: q.moved_to.map(|(n, a)| (n, a.to_resources())),
                },
            );
        }
        match state.rebuilding_since_ms {
            Some(since) => {
                b.started_ms = since;
                b.durable_rebuilding = true;
            }
            None => b.ready = !fresh,
        }
        b.tree = Some(std::sync::Arc::new(tree.clone()));
        for (node, ns) in state.nodes {
            let holdings: BTreeMap<String, Entry> = ns
                .holdings
                .iter()
                .map(|h| (h.container_id.clone(), Entry::of_holding(h)))
                .collect();
            for (c, e) in &holdings {
                b.index_holding(&node, c, e);
            }
            let issued = leases_from(&ns.issued);
            let nb = NodeBook {
                capacity: ns.capacity.to_resources(),
                holdings,
                durable_issued: issued.clone(),
                issued,
                reported: leases_from(&ns.reported),
                last_sync_ms: now,
                computed_ms: None,
                stopping: ns.stopping.into_iter().collect(),
                ..NodeBook::default()
            };
            b.totals.capacity.add(&nb.capacity);
            b.silence.insert((now, node.clone()));
            if !nb.stopping.is_empty() {
                b.stopping_idx.insert(node.clone());
            }
            b.nodes.insert(node, nb);
        }
        for p in state.pending {
            let entry = Entry {
                tenant: p.tenant,
                resources: p.amounts.to_resources(),
                class: p.class.into(),
                started_ms: p.started_ms,
                gang: p.gang,
                checkpoint: p.checkpoint,
                workload: p.workload,
            };
            b.real_add(&entry.tenant, entry.class, &entry.resources);
            b.pending
                .insert(NodeContainer(p.node, p.container_id), Pending { entry, over: p.over });
        }
        for r in state.reclaims {
            let resources = r.amounts.to_resources();
            let class =
                if r.consolidation { crate::Class::Borrowed } else { crate::Class::Guaranteed };
            b.real_add(&r.tenant, class, &resources);
            b.reclaims.insert(
                (r.node, r.tenant, r.claim),
                Reclaim {
                    resources,
                    victims: r.victims,
                    started_ms: r.started_ms,
                    retry_after_s: r.retry_after_s,
                    freed_ms: r.freed_ms,
                    message: r.message,
                    shared: r.shared,
                    consolidation: r.consolidation,
                },
            );
        }
        // Restored queue entries and holds expire from the first sweep on.
        b.next_expiry_ms = 0;
        b.refresh_all();
        b
    }
}
