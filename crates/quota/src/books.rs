//! The coordinator's quota books (docs/QUOTAS.md, "The fleet"): what every node holds,
//! what was admitted and not yet seen in a sync, reclaims in progress, the fair queue,
//! gangs assembling, the nodes' leases, and the quota events. Pure: no I/O, no clock (every
//! method takes `now_ms`), no async; the coordinator keeps one [`Books`] behind a mutex and
//! answers the protocol of [`crate::wire`] with it.
//!
//! # What a decision counts
//!
//! The usage a decision sees is every node's holdings (as its last sync listed them), the
//! admissions not yet seen in a sync ([`PENDING_GRACE_MS`]), the capacity held for a
//! claimant while its reclaim runs, the reservations of gangs assembling, and the **lease
//! phantoms**: for each node `n`, quota path `P` with a guarantee of resource `r`, the part
//! of `n`'s lease that `n` does not use, `max(0, lease_n(P, r) − h_n(P, r))` (`h_n`: the
//! guaranteed holdings of `P`'s subtree that `n` listed in its last sync, which is what
//! `n` itself counts under its lease), booked as guaranteed usage of `P`. An admission not
//! yet listed does not shrink the phantom: until `n` lists it, `n` could fill its lease on
//! its own beside it. Phantoms of nested paths are netted (a project's unused lease is
//! also its team's: it is booked once, at the project, and the team books only what its
//! own lease adds beyond its projects'), and they take no physical capacity (the capacity
//! a decision sees grows by them), so a guarantee held by leases can still be lent, as far
//! as the path's lending limit allows: they are booked apart ([`Usage::add_leased`]) and
//! what a lending limit keeps back counts them as unused guarantee ([`crate::withheld`]).
//!
//! A request of node `N` is decided first with `N`'s own phantoms left out (its lease
//! absorbs its guaranteed work); a request found guaranteed is admitted; one found borrowed
//! is decided again with `N`'s phantoms in, so that no ceiling can be crossed even if `N`
//! later loses the coordinator and admits work under its lease. A node that admitted work
//! under its leases and has not synced since says so
//! ([`AdmitRequest::unsynced_lease_grants`]): its phantoms then stay in (the books cannot
//! know how much of its leases that work took).
//!
//! # Leases
//!
//! At each sync (at most every [`LEASE_RECOMPUTE_MS`], and only when anything changed since
//! they were last computed), for each quota path `P` with a guarantee `G` of `r`, node
//! `n`'s lease is `min(h_n + room, max(h_n, share_n))` with `share_n = G · capacity_n(r) /
//! capacity(r)` rounded down to whole units (GPUs, cores, GiB: a share below one unit leases
//! nothing spare, so a fleet of thousands of nodes is not covered in lease dust that books
//! the whole guarantee and admits nothing) and `room = G − Σ_{m≠n} (u_m + max(0, lease_m −
//! h_m)) − u_n` (saturating; `u`: every guaranteed use on the node, its listed holdings,
//! admissions not listed yet, capacity held for a claimant), so that `Σ_n (u_n + max(0,
//! lease_n − h_n)) ≤ G` always, and with it `Σ_n max(g_n, lease_n) ≤ G` for what the nodes
//! really hold; it is also cut so that no ceiling on `P`'s chain would be crossed by the
//! booked usage (phantoms included). A node's lease counts as the larger of what was last
//! issued and what the node last reported holding (an answer may be lost).
//!
//! # Silent nodes
//!
//! A node silent for longer than the lease TTL plus a margin ([`LEASE_MARGIN_MS`], or the
//! TTL where that is shorter) has no lease left to admit anything under: it is presumed dead
//! and leaves the books ([`Books::remove_node`], a `node-removed` event): its holdings, its
//! admissions not listed yet and its leases are no longer counted. An operator can remove a
//! node at once the same way. A node that was only cut off and syncs again comes back as a
//! new one: what it lists is counted again (and can take a path past a ceiling: the books
//! then admit nothing more there until it is under).
//!
//! # Restarts and failover
//!
//! Books that lost their state (a coordinator without a store restarted) adopt the leases
//! each node reports and issue no new lease room until every node known to the coordinator
//! has synced ([`Books::ready`]). Books kept in a store (`books_state.rs`) are taken over by
//! the next coordinator that decides ([`Books::restore`]) and are ready at once, unless they
//! were still being rebuilt when stored: then they go on rebuilding, since the same time.
//!
//! # Cost
//!
//! Every decision and lease computation reads running totals (`books_totals.rs`): nothing
//! walks the fleet's nodes per request.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::Arc;

use tessera_api::untrusted;

use crate::admit::{admit as decide_quota, withheld, Class, Decision, Usage};
use crate::amount::{Resource, Resources, MICRO_PER_GPU};
use crate::drf::{dominant_share, fair_order, guarantee_headroom, Waiting};
use crate::preempt::{may_reclaim_owed_later, owed_at_once, owed_behind, worth_reclaiming};
use crate::reclaim::{
    borrowing_short, choose_victims, choose_victims_for_placement, choose_victims_to_consolidate,
    first_fit, Candidate, NoVictims, Room, Running,
};
use crate::spec::{chain, is_within, QuotaTree};
use crate::wire::{
    AdmitAnswer, AdmitRequest, Amounts, Holding, Lease, PathStatus, QuotaClass, QuotaEvent,
    QuotaEventKind, QuotaStatus, ResizeRequest, SyncAnswer, SyncRequest, Victim,
};

/// How often issue 27's per-tenant memory is swept ([`Books::sweep_asks`]).
const SLOW_SWEEP_MS: u64 = 1_000;

/// How long an admission not yet listed by its node's sync stays booked.
pub const PENDING_GRACE_MS: u64 = 15_000;
/// How long a waiting entry of the fair queue lasts after its last retry, counted from the
/// end of the step that retry is stored to (`state::STORED_TIME_STEP_MS`): 120–150 s.
pub const WAITING_TTL_MS: u64 = 120_000;
/// Requests of one tenant that wait in the fair queue of one node at most (a tenant that
/// asks under ever new container ids keeps no more places than this).
pub const MAX_WAITING_PER_TENANT: usize = 64;
/// Quota events kept (the oldest go first).
pub const EVENTS_KEPT: usize = 1_000;
/// Beyond its lease TTL, how long the books wait for a silent node before its leases go
/// (clock skew and rate between the node and the coordinator).
pub const LEASE_MARGIN_MS: u64 = 10_000;
/// Added to the longest victim grace period in a reclaim's `retry_after_s`.
pub const RETRY_SLACK_S: u64 = 2;
/// How long capacity stays held for a claimant after its retry was due (or after the
/// victims were gone, whichever is later).
pub const HOLD_SLACK_MS: u64 = 30_000;
/// How long a gang's answers are kept for members that ask again.
pub const OUTCOME_KEPT_MS: u64 = 60_000;
/// A node's leases are computed again at most this often (each sync renews them).
pub const LEASE_RECOMPUTE_MS: u64 = 5_000;
/// How long a recalled path's leases stay cut to what each node holds (no spare to admit
/// alone) after the last request that found its guarantee leased to other nodes.
pub const LEASE_RECALL_MS: u64 = 60_000;
/// What a request that found its guarantee leased elsewhere is told to wait: the other
/// nodes' next sync carries the cut lease, the one after reports it (two sync intervals).
pub const LEASE_RECALL_RETRY_S: u64 = 3;
/// A node that synced within this long takes a recall at its next sync; one silent
/// longer may be cut off and using its lease, so its lease is not waited for.
pub const RECALL_LIVE_MS: u64 = 5_000;
/// A node that synced within this long may be promised work a consolidation moves (issue
/// 27); one silent longer may be dead or cut off, however long its lease keeps it in the
/// books.
pub const MOVE_LIVE_MS: u64 = 60_000;

/// A container on a node, `(node, container id)`: what the books hold, wait, answer and
/// resize by.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct NodeContainer(String, String);

/// A gang of a tenant, `(tenant, gang name)`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct TenantGang(String, String);

/// Preempted work of a tenant, `(tenant, claim)` (the claim as in [`ClaimKey`]): what a
/// requeue backoff is kept for.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct TenantClaim(String, String);
/// A reclaim's claim: `(node, tenant, claim)`, the claim being the request's workload
/// (`namespace/pod/container`, the same across kubelet's retries) or else its container id.
/// Each claim has its own reclaim, so the pods of one job reclaim together.
type ClaimKey = (String, String, String);

/// How long preemptions count towards a path's preemptions per hour.
pub const PREEMPTION_WINDOW_MS: u64 = 3_600_000;
/// Owner waits kept per tenant for the status's p50 and p99.
pub const OWNER_WAITS_KEPT: usize = 256;
/// A tenant's record (its costs and counters) and the new events are handed out for
/// storing at most this often ([`Books::take_changes`]): a change of leader loses at most
/// this much of what the status and the events show.
pub const RECORD_STEP_MS: u64 = 5_000;

/// The claim of a request ([`ClaimKey`]'s third part).
fn claim_of(req: &AdmitRequest) -> String {
    req.workload.clone().unwrap_or_else(|| req.container_id.clone())
}

/// The [`ClaimKey`] of `req` asked on `node`.
fn claim_key(node: &str, req: &AdmitRequest) -> ClaimKey {
    (node.to_string(), req.tenant.clone(), claim_of(req))
}

/// How a claim owed, but not at once at its first ask, is owed now, in words, by whether it
/// would be owed at once now ([`Owed::AtOnce`]): since its backlog was served, or behind a
/// larger request of its tenant waiting before it.
fn owed_how(at_once_now: bool) -> &'static str {
    if at_once_now {
        "owed since its backlog was served"
    } else {
        "owed behind a larger request of its tenant waiting before it, not at once"
    }
}

/// Whether `held` (the books' copy of a node's holdings) is what a sync listing `listing`
/// (sorted by container) would make of it: `set_holdings` would change nothing. A listing
/// naming a container twice is never the same (the books' keys are distinct).
fn lists_the_same(held: &BTreeMap<String, Entry>, listing: &[&Holding]) -> bool {
    held.len() == listing.len()
        && held.iter().zip(listing).all(|((c, e), h)| *c == h.container_id && e.is_holding(h))
}

/// The containers a sync lists, sorted: which of them it holds.
struct Listed<'a>(&'a [&'a Holding]);

impl Listed<'_> {
    fn contains(&self, container: &str) -> bool {
        self.0.binary_search_by(|h| h.container_id.as_str().cmp(container)).is_ok()
    }
}

/// One container the books count.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    tenant: String,
    resources: Resources,
    class: Class,
    started_ms: u64,
    gang: Option<String>,
    /// It writes a checkpoint on SIGTERM.
    checkpoint: bool,
    /// Its workload (`namespace/pod/container`), what a requeue backoff is kept for.
    workload: Option<String>,
}

impl Entry {
    /// Whether this is `Entry::of_holding(h)`, without building it.
    fn is_holding(&self, h: &Holding) -> bool {
        self.tenant == h.tenant
            && self.class == Class::from(h.class)
            && self.started_ms == h.started_ms
            && self.gang == h.gang
            && self.checkpoint == h.checkpoint
            && self.workload == h.workload
            && h.amounts.is_resources(&self.resources)
    }

    fn of_holding(h: &Holding) -> Entry {
        Entry {
            tenant: h.tenant.clone(),
            resources: h.amounts.to_resources(),
            class: h.class.into(),
            started_ms: h.started_ms,
            gang: h.gang.clone(),
            checkpoint: h.checkpoint,
            workload: h.workload.clone(),
        }
    }
}

/// What the books know of one node (made by its first sync).
#[derive(Debug, Clone, Default)]
struct NodeBook {
    capacity: Resources,
    holdings: BTreeMap<String, Entry>,
    /// Leases last issued to the node, by quota path.
    issued: BTreeMap<String, Resources>,
    /// Leases the node said it held at its last sync.
    reported: BTreeMap<String, Resources>,
    last_sync_ms: u64,
    /// It synced with these books: false for a node restored from a store
    /// ([`Books::restore`] counts it heard from at the takeover, which it may not have been
    /// for minutes) until its first sync with them.
    heard: bool,
    /// When `issued` was last computed (`None`: adopted, never computed).
    computed_ms: Option<u64>,
    /// The books' generation when `issued` was last computed: unchanged since, the leases
    /// would come out the same.
    computed_gen: u64,
    /// Containers the node is stopping for a reclaim (its last sync said so).
    stopping: BTreeSet<String>,
    /// The issued leases as last handed out for storing ([`Books::take_changes`]).
    durable_issued: BTreeMap<String, Resources>,
    /// What it adds to the totals (`books_totals.rs`).
    agg: totals::NodeAgg,
}

impl NodeBook {
    /// The lease of each path as booked: the larger of issued and reported, per resource.
    fn booked_leases(&self) -> BTreeMap<String, Resources> {
        let mut out = self.issued.clone();
        for (path, r) in &self.reported {
            let slot = out.entry(path.clone()).or_default();
            *slot = max_each(slot, r);
        }
        out
    }
}

/// What a recorded grant carries besides its amounts: its gang, whether it checkpoints,
/// its workload.
#[derive(Debug, Clone, Default)]
struct Meta {
    gang: Option<String>,
    checkpoint: bool,
    workload: Option<String>,
}

impl Meta {
    fn of(req: &AdmitRequest, gang: Option<String>) -> Meta {
        Meta { gang, checkpoint: req.checkpoint, workload: req.workload.clone() }
    }
}

/// A request that may reclaim: who asks what, where.
#[derive(Debug, Clone, Copy)]
struct Claim<'a> {
    node: &'a str,
    tenant: &'a str,
    r: &'a Resources,
    /// What to free.
    short: &'a Resources,
    /// Victims only on this node (`None`: anywhere).
    on: Option<&'a str>,
    /// Victims only charged inside this path (its ceiling is full).
    under: Option<&'a str>,
    /// The fleet has room for it, its node not: work of tenants back within their
    /// guarantees may be taken last ([`choose_victims_for_placement`]). Never where the
    /// fleet is full: such a victim would find no room elsewhere and be owed back at once.
    placement: bool,
    /// A borrowed request its node cannot place: it may only move checkpointing borrowed
    /// work that fits on other nodes ([`choose_victims_to_consolidate`]), and only if the
    /// victims lose no more than it has waited ([`worth_reclaiming`]); it is owed nothing.
    consolidate: bool,
    ask: Ask,
    req: &'a AdmitRequest,
}

/// What [`Books::recall_leases`] answers: the retry it tells the request, and how the
/// request is decided once the live nodes' unused leases are cut.
struct Recall {
    answer: AdmitAnswer,
    then: Decision,
}

/// What [`Books::start_reclaim`] did.
#[derive(Debug)]
enum Reclaimed {
    /// Victims are being stopped: the answer.
    Started(AdmitAnswer),
    /// Nothing was stopped: why, where there is more to say than "no capacity".
    Not(Option<String>),
}

/// A request's first ask: when, and whether it was owed at once then
/// ([`crate::owed_at_once`]: its wait counts as an owner's, and it may reclaim at once).
#[derive(Debug, Clone, Copy)]
struct Ask {
    owed_first: bool,
    asked_ms: u64,
    /// A first ask within [`WAITING_TTL_MS`] of books taken over from a store: the fair
    /// queue is still being relearned (its requests ask again within that time), so
    /// whether the claim is owed cannot be told yet. It preempts nothing and its first ask
    /// is not kept: the first ask after the window is judged against the relearned queue.
    settling: bool,
}

/// How [`Books::owed_judge`] counts the tenant's requests waiting ahead of a claim.
#[derive(Debug, Clone, Copy)]
enum Owed {
    /// Those that would be owed themselves ([`crate::owed_behind`]): whether it is owed.
    Behind,
    /// All of them ([`crate::owed_at_once`]): whether it may reclaim at once.
    AtOnce,
}

/// An admission not yet seen in its node's sync.
#[derive(Debug, Clone)]
struct Pending {
    entry: Entry,
    over: Option<String>,
}

/// A reclaim in progress: victims being stopped, capacity held for the claimant.
#[derive(Debug, Clone)]
struct Reclaim {
    resources: Resources,
    victims: Vec<Victim>,
    started_ms: u64,
    retry_after_s: u64,
    /// When the last victim was gone.
    freed_ms: Option<u64>,
    message: String,
    /// Its victims are another reclaim's, stopping under a full ceiling: it waits for them
    /// (`Books::hold_for_stopping`), they were not chosen for it. They are that reclaim's
    /// to report and to count on their node; here they only say when it may run.
    shared: bool,
    /// A consolidation's hold (issue 27): its claimant was admitted *borrowed*, and its
    /// victims were moved, each to a node with room for it (promised in each victim's
    /// requeue record, `Requeue::moved_to`): the hold counts as the claimant's borrowed
    /// usage and yields to a request within its guarantee that needs the room.
    consolidation: bool,
}

impl Reclaim {
    /// The class its held capacity counts as.
    pub(crate) fn class(&self) -> Class {
        if self.consolidation {
            Class::Borrowed
        } else {
            Class::Guaranteed
        }
    }

    /// The answer to its claimant asking again while it is under way: the same victims,
    /// and when to ask next.
    fn still_reclaiming(&self, now: u64) -> AdmitAnswer {
        let due = self.started_ms.saturating_add(self.retry_after_s.saturating_mul(1000));
        let (left_s, state) = match self.freed_ms {
            None => (due.saturating_sub(now).div_ceil(1000).max(1), "in progress"),
            Some(_) => (RETRY_SLACK_S, "victims gone, their devices not free yet"),
        };
        AdmitAnswer::Reclaiming {
            retry_after_s: left_s,
            victims: self.victims.clone(),
            message: format!(
                "{} ({state}, since {}); retry after {left_s} s",
                self.message,
                tessera_api::time::format_utc(self.started_ms)
            ),
        }
    }

    fn hold_until(&self) -> u64 {
        let due = self.started_ms.saturating_add(self.retry_after_s.saturating_mul(1000));
        due.max(self.freed_ms.unwrap_or(0)).saturating_add(HOLD_SLACK_MS)
    }
}

/// A request refused for capacity, waiting in the fair queue.
#[derive(Debug, Clone)]
struct WaitEntry {
    tenant: String,
    /// Its claim ([`ClaimKey`]'s third part): a claim holding a reclaim is counted in the
    /// usage (the capacity held for it), not again as a request waiting.
    claim: String,
    resources: Resources,
    arrived_ms: u64,
    last_seen_ms: u64,
    /// Why it waits (its last answer), for the status.
    why: String,
    /// It joined the queue while the books relearned it after a takeover
    /// ([`Books::settling`]): its place is the order of the asks again, not of the first.
    relearned: bool,
}

#[derive(Debug, Clone)]
struct GangMember {
    node: String,
    container: String,
    resources: Resources,
    /// Its node's lease may absorb it ([`AdmitRequest::unsynced_lease_grants`] not set).
    absorb: bool,
    checkpoint: bool,
    workload: Option<String>,
}

/// A gang assembling: its whole amount is reserved from the first arrival.
#[derive(Debug, Clone)]
struct Gang {
    size: u32,
    reserved: Resources,
    class: Class,
    first_ms: u64,
    timeout_s: u64,
    members: Vec<GangMember>,
}

impl Gang {
    fn deadline_ms(&self) -> u64 {
        self.first_ms.saturating_add(self.timeout_s.saturating_mul(1000))
    }
}

#[derive(Debug, Clone)]
struct Outcome {
    answer: AdmitAnswer,
    /// The member's tenant and amounts: only the same request gets the answer again.
    tenant: String,
    resources: Resources,
    expires_ms: u64,
}

/// What a gang member's arrival gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GangArrival {
    /// The answer now (the gang is complete, or this member is refused).
    Answer(AdmitAnswer),
    /// Wait for the rest of the gang until `deadline_ms`, then ask [`Books::gang_poll`].
    Wait { deadline_ms: u64 },
}

/// What [`Books::remove_node`] took out of the books.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemovedNode {
    /// Holdings of its last sync.
    pub holdings: usize,
    /// Admissions it had not listed yet.
    pub pending: usize,
    /// What its holdings held.
    pub held: Amounts,
    /// The paths it held leases of.
    pub leases: Vec<String>,
    /// When it last synced (ms since the epoch, the coordinator's clock).
    pub last_sync_ms: u64,
}

/// Counters since the books started, by tenant path.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counters {
    /// Reclaims started, by claimant.
    pub reclaims: BTreeMap<String, u64>,
    /// Containers chosen as reclaim victims, by the victim's tenant.
    pub preemptions: BTreeMap<String, u64>,
}

/// What books recorded and do not store ([`Books::take_history`]).
#[derive(Debug, Clone, Default)]
pub struct History {
    events: VecDeque<QuotaEvent>,
    counters: Counters,
    costs: BTreeMap<String, Cost>,
    /// Each event's number.
    event_seqs: VecDeque<u64>,
    /// The number its next event would have had.
    event_seq: u64,
    /// The mark of the record in the store as these books last knew it.
    record_mark: Option<state::RecordMark>,
}

/// What preemption cost one tenant, and how long its owed requests waited.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Cost {
    /// When its containers were chosen as victims, within [`PREEMPTION_WINDOW_MS`].
    preempted_ms: VecDeque<u64>,
    /// Work lost to preemption: each resource × the seconds the victims had run (for work
    /// that checkpoints, its grace period), in the resource's unit × seconds.
    lost: BTreeMap<Resource, u128>,
    /// The last [`OWNER_WAITS_KEPT`] waits of owed requests, first ask to admission, ms.
    owner_waits: VecDeque<u64>,
    /// The last [`OWNER_WAITS_KEPT`] waits of requests owed only later, from when a reclaim
    /// decision first found them owed to admission, ms.
    owed_later_waits: VecDeque<u64>,
}

/// Work preempted and when it may borrow again.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Requeue {
    preemptions: u32,
    last_ms: u64,
    /// When the requeue backoff ends (work only moved, never preempted: when it is
    /// stopped, its grace over; it takes no backoff).
    until_ms: u64,
    /// Moved by a consolidation (issue 27): the node promised room for it to resume on, and
    /// what it holds. Kept from other consolidations until it is admitted again, or for
    /// [`WAITING_TTL_MS`] after it stopped ([`Requeue::promised`]), however long its
    /// claimant's hold lasts (admitted, given way, expired).
    moved_to: Option<(String, Resources)>,
}

impl Requeue {
    /// Whether it may not borrow again at `now`: preempted (work only moved takes no
    /// backoff: its `until_ms` is when it stops) and its backoff not over.
    fn backs_off(&self, now: u64) -> bool {
        self.preemptions > 0 && now < self.until_ms
    }

    /// The room promised to this moved work at `now`, if it still is.
    fn promised(&self, now: u64) -> Option<&(String, Resources)> {
        self.moved_to.as_ref().filter(|_| now <= self.until_ms.saturating_add(WAITING_TTL_MS))
    }
}

/// The books are not ready: some node known to the coordinator has not synced since the
/// books started.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the coordinator is rebuilding its quota books: {synced} of {known} nodes have synced \
     (waiting for {}); nodes admit within their leases meanwhile",
    missing.join(", ")
)]
pub struct NotReady {
    pub synced: usize,
    pub known: usize,
    /// Up to 10 of the nodes not synced yet.
    pub missing: Vec<String>,
}

/// The books of fleet quotas. See the module documentation.
#[derive(Debug, Clone)]
pub struct Books {
    lease_ttl_s: u64,
    started_ms: u64,
    /// When these books were taken over from a store ([`Books::restore`]).
    restored_ms: Option<u64>,
    nodes: BTreeMap<String, NodeBook>,
    pending: BTreeMap<NodeContainer, Pending>,
    reclaims: BTreeMap<ClaimKey, Reclaim>,
    waiting: BTreeMap<NodeContainer, WaitEntry>,
    /// Preemption's cost and owner waits, by tenant.
    costs: BTreeMap<String, Cost>,
    /// Preempted work by `(tenant, workload or container)`: its requeue backoff.
    requeues: BTreeMap<TenantClaim, Requeue>,
    /// Claims answered something other than admitted, `(node, tenant, claim)` → when they
    /// first asked, whether they were owed then (for the owner waits), and when they last
    /// asked (kept while they still ask: a claim still asking is never asking first).
    first_asks: BTreeMap<ClaimKey, (u64, bool, u64)>,
    /// Claims not owed when they first asked, owed since: since when (a path's
    /// `owed_reclaim_after_s` counts from there), and the last ask that found them owed.
    /// Gone when an ask finds one not owed, or beyond its guarantee; counted again from
    /// zero when it has not been found owed for [`WAITING_TTL_MS`] (it left the queue).
    owed_since: BTreeMap<ClaimKey, (u64, u64)>,
    gangs: BTreeMap<TenantGang, Gang>,
    outcomes: BTreeMap<NodeContainer, Outcome>,
    events: VecDeque<QuotaEvent>,
    ready: bool,
    counters: Counters,
    /// The tree the leases were last computed with (a new one recomputes them all).
    tree: Option<Arc<QuotaTree>>,
    /// Quota paths whose leases are recalled (cut to what each node holds) until then.
    recalled: BTreeMap<String, u64>,
    /// Running totals and indexes (`books_totals.rs`).
    totals: totals::Totals,
    /// Moves with every change the leases depend on.
    generation: u64,
    /// Borrowed holdings, `(node, container)`: the only candidates of a fleet-wide reclaim.
    borrowed_idx: BTreeSet<NodeContainer>,
    /// `(tenant, gang)` → its members' holdings, `(node, container)`.
    gang_idx: BTreeMap<TenantGang, BTreeSet<NodeContainer>>,
    /// Nodes that said they are stopping containers for a reclaim.
    stopping_idx: BTreeSet<String>,
    /// `(last sync, node)`, oldest first: the silent nodes are at the front.
    silence: BTreeSet<(u64, String)>,
    /// Nothing in the waiting queue, the holds, the kept answers or the recalls expires
    /// before this (so `tick` does not walk them on every call).
    next_expiry_ms: u64,
    /// When [`Books::sweep_asks`] is next due.
    slow_sweep_ms: u64,
    /// What changed since [`Books::take_changes`] (`books_state.rs`).
    changes: state::Changes,
    /// Grants resized ([`Books::resize`]) within [`PENDING_GRACE_MS`], with when: a sync
    /// whose snapshot predates the resize lists the old amounts, so until the node lists
    /// the new ones its holding counts the larger of both.
    resized: BTreeMap<NodeContainer, (Entry, u64)>,
    /// The store was last handed out that the books are being rebuilt
    /// ([`state::StateOp::PutRebuilding`]).
    durable_rebuilding: bool,
    /// The fair queue is whole: these books saw every request waiting (new books, books
    /// taken over from a state that kept it, or done relearning it).
    queue_kept: bool,
    /// The store was last handed out that the fair queue it holds is whole
    /// ([`state::StateOp::PutQueueKept`]).
    durable_queue_kept: bool,
    /// Tenants whose record (costs, counters) changed since it was last handed out for
    /// storing (only while changes are tracked).
    record_due: BTreeSet<String>,
    /// When the records and events were last handed out for storing.
    record_stored_ms: u64,
    /// The latest time a call brought ([`Books::tick`]).
    last_now_ms: u64,
    /// Each kept event's number, in step with `events`.
    event_seqs: VecDeque<u64>,
    /// The number of the next event.
    event_seq: u64,
    /// The events changed since they were last handed out for storing.
    events_dirty: bool,
    /// The numbers of the events the store holds, as last handed out.
    durable_events: BTreeSet<u64>,
    /// Every stored event is to be written again (numbered anew at a restore).
    events_rewrite: bool,
    /// The mark of the record in the store, as these books last handed it out or found it.
    record_mark: Option<state::RecordMark>,
    /// This leadership's term, in the marks it writes ([`Books::set_record_term`]).
    record_term: u64,
    /// Hand the record out with every change (tests that compare the store with the books).
    record_forced: bool,
}

fn max_each(a: &Resources, b: &Resources) -> Resources {
    let mut out = a.clone();
    for (r, n) in b.iter() {
        let have = out.get(r);
        if n > have {
            out.add(&Resources::new().with(r.clone(), n - have));
        }
    }
    out
}

fn times(r: &Resources, n: u32) -> Resources {
    r.iter().fold(Resources::new(), |acc, (res, a)| {
        acc.with(res.clone(), a.saturating_mul(u64::from(n)))
    })
}

/// The policy path of a limit: `quotas.acme/b.gpus.H100-80GB.ceiling`.
fn rule(path: &str, resource: &Resource, field: &str) -> String {
    format!("quotas.{path}.{}.{field}", resource.spec_path())
}

fn unit(resource: &Resource) -> &'static str {
    match resource {
        Resource::Gpu(_) => "micro-GPU",
        Resource::Cpu => "millicore",
        Resource::Memory => "MiB",
    }
}

/// The `p`th percentile of sorted `v`, nearest rank.
fn nearest_rank(v: &[u64], p: usize) -> Option<u64> {
    if v.is_empty() {
        return None;
    }
    let rank = (p * v.len()).div_ceil(100).max(1);
    v.get(rank - 1).copied()
}

fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// The refusal of a request (`asked`: tenant, amounts) under the id `key` that the books
/// answered for another request (`tenant`, `resources`); `None` if it is the same one.
fn other_request(
    key: &NodeContainer,
    tenant: &str,
    resources: &Resources,
    asked: (&str, &Resources),
) -> Option<AdmitAnswer> {
    if asked == (tenant, resources) {
        return None;
    }
    Some(AdmitAnswer::Refused {
        message: format!(
            "container {} on node {} already stands for a request of {tenant} for \
             {resources}; a request of {} for {} under the same id is refused: a container id \
             counts once until its grant is released",
            untrusted(&key.1).max_chars(128),
            key.0,
            untrusted(asked.0).max_chars(128),
            asked.1
        ),
        rule: None,
    })
}

/// The refusal of a request under the id `key` that waits as a member of gang `gang`
/// (`(tenant, name)`), other than that member's own request.
fn waits_in_gang(key: &NodeContainer, gang: &TenantGang) -> AdmitAnswer {
    AdmitAnswer::Refused {
        message: format!(
            "container {} on node {} waits in gang {}/{} with another request; a container id \
             counts once until its grant is released",
            untrusted(&key.1).max_chars(128),
            key.0,
            gang.0,
            untrusted(&gang.1)
        ),
        rule: None,
    }
}

/// A capacity on which only the quotas decide `tenant`'s request `r` under `usage`: what
/// is used, what is asked, and what other paths' lending limits keep back from it
/// ([`withheld`]). Without the last, a borrowed request under every ceiling would wait
/// there for capacity, and a lease recall that would let it run was not found (issue 27:
/// `a_lending_limit_elsewhere_does_not_keep_a_borrower_from_a_lease_recall`).
fn quota_view(tree: &QuotaTree, usage: &Usage, tenant: &str, r: &Resources) -> Resources {
    usage.total().total().plus(r).plus(&withheld(tree, usage, tenant))
}

/// Phantoms of one node's leases, netted over nested paths. For each leased path `P` and
/// each resource `P` guarantees, `avail(P) = max(0, lease − g)`: what the node may still
/// admit there on its own. Booked at `P` is `avail(P)` less the `avail` of its nearest
/// leased descendants (never below zero). So within every leased path's subtree the booked
/// phantoms total at least its `avail`, which bounds what the node can add there, and a
/// descendant's part does not depend on its ancestors' (a release elsewhere in the team,
/// which lets the node add more to the project, finds the project's part booked already:
/// phantoms never grow by more than what a release frees).
fn phantoms_of(
    tree: &QuotaTree,
    leases: &BTreeMap<String, Resources>,
    guaranteed: &Usage,
) -> BTreeMap<String, Resources> {
    let guarantees = |p: &str, r: &Resource| {
        tree.get(p).and_then(|q| q.limits.get(r)).is_some_and(|l| l.guarantee.is_some())
    };
    let mut avail: BTreeMap<&str, Resources> = BTreeMap::new();
    for (path, lease) in leases {
        let Some(q) = tree.get(path) else { continue };
        let held = guaranteed.of(path).guaranteed;
        let mut a = Resources::new();
        for (res, limit) in &q.limits {
            if limit.guarantee.is_some() {
                a.add(
                    &Resources::new()
                        .with(res.clone(), lease.get(res).saturating_sub(held.get(res))),
                );
            }
        }
        avail.insert(path.as_str(), a);
    }
    let mut out = BTreeMap::new();
    for (path, a) in &avail {
        let mut booked = Resources::new();
        for (res, amount) in a.iter() {
            let below: u64 = avail
                .iter()
                .filter(|(d, _)| *d != path && is_within(d, path))
                .filter(|(d, _)| {
                    chain(d).skip(1).find(|x| avail.contains_key(x) && guarantees(x, res))
                        == Some(*path)
                })
                .map(|(_, da)| da.get(res))
                .fold(0u64, u64::saturating_add);
            booked.add(&Resources::new().with(res.clone(), amount.saturating_sub(below)));
        }
        if !booked.is_empty() {
            out.insert((*path).to_string(), booked);
        }
    }
    out
}

impl Books {
    /// Empty books, started at `now_ms`; leases issued are good for `lease_ttl_s` after the
    /// sync that carried them.
    pub fn new(lease_ttl_s: u64, now_ms: u64) -> Books {
        Books {
            lease_ttl_s,
            started_ms: now_ms,
            restored_ms: None,
            nodes: BTreeMap::new(),
            pending: BTreeMap::new(),
            reclaims: BTreeMap::new(),
            waiting: BTreeMap::new(),
            costs: BTreeMap::new(),
            requeues: BTreeMap::new(),
            first_asks: BTreeMap::new(),
            owed_since: BTreeMap::new(),
            gangs: BTreeMap::new(),
            outcomes: BTreeMap::new(),
            events: VecDeque::new(),
            ready: false,
            counters: Counters::default(),
            tree: None,
            recalled: BTreeMap::new(),
            totals: totals::Totals::default(),
            generation: 0,
            borrowed_idx: BTreeSet::new(),
            gang_idx: BTreeMap::new(),
            stopping_idx: BTreeSet::new(),
            silence: BTreeSet::new(),
            next_expiry_ms: u64::MAX,
            slow_sweep_ms: 0,
            changes: state::Changes::default(),
            resized: BTreeMap::new(),
            durable_rebuilding: false,
            queue_kept: true,
            durable_queue_kept: false,
            record_due: BTreeSet::new(),
            record_stored_ms: 0,
            last_now_ms: 0,
            event_seqs: VecDeque::new(),
            event_seq: 0,
            events_dirty: false,
            durable_events: BTreeSet::new(),
            events_rewrite: false,
            record_mark: None,
            record_term: 0,
            record_forced: false,
        }
    }

    /// The lease lifetime the books issue.
    pub fn lease_ttl_s(&self) -> u64 {
        self.lease_ttl_s
    }

    /// Whether every node in `known_nodes` (those the coordinator heard from within the
    /// lease TTL) has synced since the books started, or the books are older than the lease
    /// TTL plus [`LEASE_MARGIN_MS`] (every lease issued before they started has expired by
    /// then, so a node that has not synced cannot be admitting under one). Once true it
    /// stays true. Until then admissions must not be decided (nodes use their leases) and
    /// no lease grows.
    pub fn ready<'a>(
        &mut self,
        known_nodes: impl IntoIterator<Item = &'a str>,
        now: u64,
    ) -> Result<(), NotReady> {
        if self.ready {
            return Ok(());
        }
        let known: BTreeSet<&str> = known_nodes.into_iter().collect();
        let missing: Vec<String> =
            known.iter().filter(|n| !self.nodes.contains_key(**n)).map(|n| n.to_string()).collect();
        let limit = self.lease_ttl_s.saturating_mul(1000).saturating_add(self.lease_margin_ms());
        if missing.is_empty() || now.saturating_sub(self.started_ms) > limit {
            self.ready = true;
            return Ok(());
        }
        Err(NotReady {
            synced: known.len() - missing.len(),
            known: known.len(),
            missing: missing.into_iter().take(10).collect(),
        })
    }

    /// Whether [`Books::ready`] has said yes.
    pub fn is_ready(&self) -> bool {
        self.ready
    }

    /// Recent quota events, oldest first.
    pub fn events(&self) -> Vec<QuotaEvent> {
        self.events.iter().cloned().collect()
    }

    /// Reclaims and preemptions since the books started.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// What these books recorded of what they decided: the events, the counters, the work
    /// lost to preemption, preemption times and owner waits (stored at most every
    /// [`RECORD_STEP_MS`]). Taken out (the books keep none) by a coordinator that stops
    /// deciding, so that it keeps its own record if it decides again before another
    /// coordinator has stored one ([`Books::keep_history`]).
    pub fn take_history(&mut self) -> History {
        History {
            events: std::mem::take(&mut self.events),
            counters: std::mem::take(&mut self.counters),
            costs: std::mem::take(&mut self.costs),
            event_seqs: std::mem::take(&mut self.event_seqs),
            event_seq: self.event_seq,
            record_mark: self.record_mark,
        }
    }

    /// Books just taken over (from the store) by the coordinator that recorded `history`
    /// before (it lost the leadership and won it back). Each hand-out of the record writes a
    /// mark (this leadership's term and a count), so the store says whose record it holds:
    /// where its mark is the one `history`'s books last knew (nobody stored a record since
    /// they took the books over or last stored theirs), `history` holds all the store does
    /// and more (what it had not stored yet), and replaces the stored record, to be stored
    /// at the next step. Otherwise another coordinator stored its record since (going on
    /// from this one's as stored) and the stored record stays; this one's last unstored
    /// seconds are lost, as a `kill -9` loses them. Returns whether `history` was kept.
    pub fn keep_history(&mut self, history: History) -> bool {
        if history.record_mark != self.record_mark {
            return false;
        }
        let History { events, counters, costs, event_seqs, event_seq, record_mark: _ } = history;
        let tenants: Vec<String> = [&self.counters.reclaims, &self.counters.preemptions]
            .into_iter()
            .chain([&counters.reclaims, &counters.preemptions])
            .flat_map(|m| m.keys())
            .chain(self.costs.keys())
            .chain(costs.keys())
            .cloned()
            .collect();
        self.record_due.extend(tenants);
        self.events = events;
        self.event_seqs = event_seqs;
        self.event_seq = event_seq;
        self.events_dirty = true;
        self.counters = counters;
        self.costs = costs;
        true
    }

    /// The term of the leadership these books decide for: written in every mark of the
    /// record they store ([`Books::keep_history`]).
    pub fn set_record_term(&mut self, term: u64) {
        self.record_term = term;
    }

    /// Hand the record out with every change, not every [`RECORD_STEP_MS`] (tests that
    /// compare the store with the books after every change).
    #[cfg(test)]
    pub(crate) fn record_every_change(&mut self) {
        self.record_forced = true;
    }

    /// `tenant`'s record (costs, counters) changed: stored at the next [`RECORD_STEP_MS`].
    fn note_record(&mut self, tenant: &str) {
        if self.changes.on && !self.record_due.contains(tenant) {
            self.record_due.insert(tenant.to_string());
        }
    }

    fn event(
        &mut self,
        now: u64,
        kind: QuotaEventKind,
        tenant: Option<&str>,
        node: Option<&str>,
        container: Option<&str>,
        reason: String,
    ) {
        if self.events.len() >= EVENTS_KEPT {
            // A stored one leaves the store with the books.
            if self.events.pop_front().is_some_and(|e| state::stored_kind(e.kind)) {
                self.events_dirty = true;
            }
            self.event_seqs.pop_front();
        }
        self.event_seqs.push_back(self.event_seq);
        self.event_seq = self.event_seq.saturating_add(1);
        self.events_dirty |= state::stored_kind(kind);
        self.events.push_back(QuotaEvent {
            ts_ms: now,
            kind,
            tenant: tenant.map(str::to_string),
            node: node.map(str::to_string),
            container_id: container.map(str::to_string),
            reason,
        });
    }

    /// Refuses `container` of `tenant` on `node` with `message` (the `rule` crossed, if
    /// one is), and says so in the events.
    fn refuse(
        &mut self,
        now: u64,
        tenant: &str,
        node: &str,
        container: &str,
        message: String,
        rule: Option<String>,
    ) -> AdmitAnswer {
        self.event(
            now,
            QuotaEventKind::Refuse,
            Some(tenant),
            Some(node),
            Some(container),
            message.clone(),
        );
        AdmitAnswer::Refused { message, rule }
    }

    /// A new tree makes every node's leases due for computing again (and changes which
    /// paths have guarantees: every node's part of the totals is computed again).
    fn observe_tree(&mut self, tree: &QuotaTree) {
        if self.tree.as_deref() != Some(tree) {
            self.tree = Some(Arc::new(tree.clone()));
            for nb in self.nodes.values_mut() {
                if nb.computed_ms.is_some() {
                    nb.computed_ms = Some(0);
                }
            }
            self.generation = self.generation.wrapping_add(1);
            self.refresh_all();
        }
    }

    /// How long past a node's lease TTL the books wait before it leaves them (clock rate
    /// between the node and the coordinator): [`LEASE_MARGIN_MS`], or the TTL where that is
    /// shorter.
    fn lease_margin_ms(&self) -> u64 {
        LEASE_MARGIN_MS.min(self.lease_ttl_s.saturating_mul(1000))
    }

    /// Expiry: waiting entries, holds, kept gang answers and recalls (when one is due),
    /// nodes silent past their lease's end (they leave the books), gangs past their
    /// deadline. Every entry point calls it.
    pub fn tick(&mut self, now: u64) {
        if now >= self.next_expiry_ms {
            self.sweep(now);
        }
        self.last_now_ms = now;
        if !self.queue_kept && !self.settling(now) {
            // Relearned: every request still waiting has asked again since the takeover.
            self.queue_kept = true;
        }
        if now >= self.slow_sweep_ms {
            self.sweep_asks(now);
        }
        let limit = self.lease_ttl_s.saturating_mul(1000).saturating_add(self.lease_margin_ms());
        while let Some((last, node)) = self.silence.first().cloned() {
            let silent = now.saturating_sub(last);
            if silent <= limit {
                break;
            }
            let why = format!(
                "it has not synced for {} s (lease TTL {} s + {} s margin): its leases have run \
                 out, so it admits nothing on its own any more",
                silent / 1000,
                self.lease_ttl_s,
                self.lease_margin_ms() / 1000
            );
            if self.remove_node(&node, now, &why).is_none() {
                self.silence.remove(&(last, node));
            }
        }
        let due: Vec<TenantGang> = self
            .gangs
            .iter()
            .filter(|(_, g)| now > g.deadline_ms())
            .map(|(k, _)| k.clone())
            .collect();
        for key in due {
            let Some(g) = self.remove_gang(&key) else { continue };
            let message = format!(
                "gang {}/{}: {} of {} members arrived within {} s (gangs.timeout_s); a gang is \
                 admitted whole or not at all, and its reservation is released",
                key.0,
                untrusted(&key.1),
                g.members.len(),
                g.size,
                g.timeout_s
            );
            for m in &g.members {
                self.keep_outcome(
                    NodeContainer(m.node.clone(), m.container.clone()),
                    Outcome {
                        answer: AdmitAnswer::Refused {
                            message: message.clone(),
                            rule: Some("gangs.timeout_s".into()),
                        },
                        tenant: key.0.clone(),
                        resources: m.resources.clone(),
                        expires_ms: now.saturating_add(OUTCOME_KEPT_MS),
                    },
                );
            }
            self.event(now, QuotaEventKind::GangTimeout, Some(&key.0), None, None, message);
        }
    }

    /// Drops what expired: waiting entries, holds, kept answers, recalls; and notes when
    /// the next of them expires.
    fn sweep(&mut self, now: u64) {
        let changes = &mut self.changes;
        self.waiting.retain(|k, w| {
            let keep = now <= state::counted(w.last_seen_ms).saturating_add(WAITING_TTL_MS);
            if !keep {
                changes.waiting(k, false);
            }
            keep
        });
        let gone: Vec<ClaimKey> = self
            .reclaims
            .iter()
            .filter(|(_, r)| now > r.hold_until())
            .map(|(k, _)| k.clone())
            .collect();
        for k in gone {
            self.remove_reclaim(&k);
        }
        self.outcomes.retain(|_, o| now <= o.expires_ms);
        self.resized.retain(|_, (_, at)| now.saturating_sub(*at) <= PENDING_GRACE_MS);
        let recalls = self.recalled.len();
        self.recalled.retain(|_, until| now <= *until);
        if recalls != self.recalled.len() {
            self.generation = self.generation.wrapping_add(1);
        }
        let next = self
            .waiting
            .values()
            .map(|w| state::counted(w.last_seen_ms).saturating_add(WAITING_TTL_MS))
            .chain(self.reclaims.values().map(Reclaim::hold_until))
            .chain(self.outcomes.values().map(|o| o.expires_ms))
            .chain(self.recalled.values().copied())
            .chain(self.resized.values().map(|(_, at)| at.saturating_add(PENDING_GRACE_MS)))
            .min();
        self.next_expiry_ms = next.map_or(u64::MAX, |t| t.saturating_add(1));
    }

    /// Issue 27's per-tenant memory (requeue counts, first asks, preemption times) expires
    /// here, at most once a second (its maps are walked; `tick` runs on every call).
    fn sweep_asks(&mut self, now: u64) {
        self.slow_sweep_ms = now.saturating_add(SLOW_SWEEP_MS);
        // A requeue's count is forgotten once the work has stayed unpreempted for as long
        // as the longest backoff; first asks go with the waiting entries' lifetime.
        let keep = crate::spec::MAX_REQUEUE_BACKOFF_S.saturating_mul(2000);
        let changes = &mut self.changes;
        self.requeues.retain(|k, q| {
            let kept = now <= q.last_ms.saturating_add(keep).max(q.until_ms);
            if !kept {
                changes.requeue(k);
            }
            kept
        });
        self.first_asks.retain(|k, (_, _, last)| {
            let kept = now <= state::counted(*last).saturating_add(WAITING_TTL_MS * 30);
            if !kept {
                changes.ask(k, false);
            }
            kept
        });
        self.owed_since.retain(|k, (_, last)| {
            let kept = now <= state::counted(*last).saturating_add(WAITING_TTL_MS);
            if !kept {
                changes.ask(k, false);
            }
            kept
        });
        let mut aged = Vec::new();
        for (tenant, c) in self.costs.iter_mut() {
            let before = c.preempted_ms.len();
            while c
                .preempted_ms
                .front()
                .is_some_and(|t| now > t.saturating_add(PREEMPTION_WINDOW_MS))
            {
                c.preempted_ms.pop_front();
            }
            if c.preempted_ms.len() != before {
                aged.push(tenant.clone());
            }
        }
        // The stored record follows (an hour on, the store says what the books do).
        for tenant in aged {
            self.note_record(&tenant);
        }
    }

    /// Something new expires at `at`: the next sweep is due then at the latest.
    fn expires_at(&mut self, at: u64) {
        self.next_expiry_ms = self.next_expiry_ms.min(at.saturating_add(1));
    }

    fn keep_outcome(&mut self, key: NodeContainer, o: Outcome) {
        self.expires_at(o.expires_ms);
        self.outcomes.insert(key, o);
    }

    /// The fleet's capacity: what every node reported.
    pub fn capacity(&self) -> Resources {
        self.totals.capacity.clone()
    }

    /// Real usage: holdings, pending admissions, capacity held for claimants, gang
    /// reservations (no lease phantoms).
    fn real_usage(&self) -> Usage {
        self.totals.real.clone()
    }

    /// Guaranteed work on `node` (holdings, pending admissions, capacity held for a
    /// claimant there), by tenant: what a lease on `node` absorbs.
    fn node_guaranteed(&self, node: &str) -> Usage {
        self.nodes.get(node).map(|nb| nb.agg.all.clone()).unwrap_or_default()
    }

    /// Guaranteed holdings `node` listed in its sync, by tenant: what the node itself
    /// counts under its leases. Admissions it has not listed yet (and capacity held for a
    /// claimant there) are not: the node may fill its lease on its own beside them.
    fn node_leased_base(&self, node: &str) -> Usage {
        self.nodes.get(node).map(|nb| nb.agg.base.clone()).unwrap_or_default()
    }

    /// What `node` has free by the books, in the resources its capacity names (and every
    /// GPU model).
    fn node_free(&self, node: &str) -> Resources {
        match self.nodes.get(node) {
            Some(nb) => nb.capacity.minus(&nb.agg.used),
            None => Resources::new(),
        }
    }

    /// `node`'s lease phantoms (under the tree the books last saw: every entry point shows
    /// them the tree first).
    fn phantoms(&self, _tree: &QuotaTree, node: &str) -> BTreeMap<String, Resources> {
        self.nodes.get(node).map(|nb| nb.agg.phantoms.clone()).unwrap_or_default()
    }

    /// The usage a decision sees: real usage plus every node's lease phantoms except
    /// `exclude`'s; and the phantoms' total, which takes no physical capacity.
    fn booked(&self, _tree: &QuotaTree, exclude: Option<&str>) -> (Usage, Resources) {
        let mut u = self.real_usage();
        for (path, r) in &self.totals.phantoms {
            u.add_leased(path, r);
        }
        let mut total = self.totals.phantom_total.clone();
        if let Some(nb) = exclude.and_then(|n| self.nodes.get(n)) {
            for (path, r) in &nb.agg.phantoms {
                u.release_leased(path, r);
                total.sub(r);
            }
        }
        (u, total)
    }

    /// Every node's phantoms booked: what the proptests and the ceilings see.
    pub fn booked_usage(&self, tree: &QuotaTree) -> Usage {
        self.booked(tree, None).0
    }

    /// The two-pass decision of a request from `node` (module docs). `absorb`: `node`'s
    /// own lease may absorb the request (false when the node holds grants admitted under
    /// its leases that the books have not seen: then one pass, every phantom in).
    fn decide(
        &self,
        tree: &QuotaTree,
        node: &str,
        tenant: &str,
        r: &Resources,
        absorb: bool,
    ) -> Decision {
        self.decide_with(tree, node, tenant, r, absorb, &Resources::new())
    }

    /// What the victims of the reclaims under way still hold by the books (listed by their
    /// nodes, not yet gone) on the node their claimant's capacity is held on, in the
    /// resources the nodes' capacity names (on `node` only, with `Some`). That capacity is
    /// spoken for: the hold counts it already, and the rest frees when they stop. Counted
    /// as used too, it made a request decided meanwhile short by as much, and its reclaim
    /// took victims it did not need (issue 27's red team: a 2-GPU claim during another's
    /// grace period took two hours of borrowed work for nothing). Victims on another node
    /// than their claimant's hold are not counted: the hold is not of their capacity (its
    /// own node's may be taken meanwhile by work that node can place), and a victim listed
    /// by two reclaims counts once.
    fn stopping_listed(&self, node: Option<&str>) -> Resources {
        let mut seen: BTreeSet<(&str, &str)> = BTreeSet::new();
        let mut out = Resources::new();
        for ((held_on, _, _), rc) in &self.reclaims {
            if node.is_some_and(|n| n != held_on) {
                continue;
            }
            for (c, r) in self.listed_victims_on(held_on, rc) {
                if seen.insert((held_on.as_str(), c)) {
                    out.add(r);
                }
            }
        }
        out.bounded_by(&self.totals.capacity)
    }

    /// What the victims of reclaims under way that their nodes still list hold within
    /// `path` (each counted once, wherever it runs), and those victims: usage under `path`
    /// that is going.
    fn stopping_under(&self, path: &str) -> (Resources, Vec<Victim>) {
        let mut seen: BTreeSet<(&str, &str)> = BTreeSet::new();
        let mut out = Resources::new();
        let mut victims = Vec::new();
        for rc in self.reclaims.values().filter(|rc| rc.freed_ms.is_none()) {
            for v in rc.victims.iter().filter(|v| is_within(&v.tenant, path)) {
                let Some(e) =
                    self.nodes.get(&v.node).and_then(|nb| nb.holdings.get(&v.container_id))
                else {
                    continue;
                };
                if seen.insert((v.node.as_str(), v.container_id.as_str())) {
                    out.add(&e.resources);
                    victims.push(v.clone());
                }
            }
        }
        (out, victims)
    }

    /// The victims of the reclaims under way, each once: as the reclaim that chose it names
    /// it, else (that reclaim gone, a hold still waiting for it: `Reclaim::shared`) as the
    /// hold does, so that its node is still told to stop it.
    fn reported_victims(&self) -> impl Iterator<Item = &Victim> + '_ {
        let under_way = || self.reclaims.values().filter(|r| r.freed_ms.is_none());
        let chosen = under_way().filter(|r| !r.shared).flat_map(|r| r.victims.iter());
        let waited = under_way().filter(|r| r.shared).flat_map(|r| r.victims.iter());
        let mut seen: BTreeSet<(&str, &str)> = BTreeSet::new();
        chosen
            .chain(waited)
            .filter(move |v| seen.insert((v.node.as_str(), v.container_id.as_str())))
    }

    /// The victims of `rc`, a reclaim under way, on `node` that `node` still lists, and
    /// what each holds (none once its victims are gone).
    fn listed_victims_on<'s>(
        &'s self,
        node: &'s str,
        rc: &'s Reclaim,
    ) -> impl Iterator<Item = (&'s str, &'s Resources)> + 's {
        let nb = self.nodes.get(node).filter(|_| rc.freed_ms.is_none());
        rc.victims.iter().filter(move |v| v.node == node).filter_map(move |v| {
            let e = nb?.holdings.get(&v.container_id)?;
            Some((v.container_id.as_str(), &e.resources))
        })
    }

    /// [`Books::decide`] with `extra` capacity: what a claim's reclaim holds for it while
    /// its victims, gone from the node that asks, are still listed. The victims of other
    /// reclaims under way are not counted as used ([`Books::stopping_listed`]).
    fn decide_with(
        &self,
        tree: &QuotaTree,
        node: &str,
        tenant: &str,
        r: &Resources,
        absorb: bool,
        extra: &Resources,
    ) -> Decision {
        let cap = self.capacity().plus(extra).plus(&self.stopping_listed(None));
        let (own_out, ph) = self.booked(tree, absorb.then_some(node));
        let first = decide_quota(tree, &cap.plus(&ph), &own_out, tenant, r);
        match first {
            Decision::Admit { class: Class::Borrowed, over: why } => {
                let (all, ph) = self.booked(tree, None);
                match decide_quota(tree, &cap.plus(&ph), &all, tenant, r) {
                    // Borrowed either way: named by why it is borrowed with this node's
                    // lease absorbing it, not by the leases booked as use.
                    Decision::Admit { class: Class::Borrowed, over } => {
                        Decision::Admit { class: Class::Borrowed, over: why.or(over) }
                    }
                    d => d,
                }
            }
            d => d,
        }
    }

    /// The answer already given to `(node, container)`, if it was admitted. With `asked`
    /// (the tenant and amounts of a request under that id now): a request that is not the
    /// admitted one is refused, never handed the admission (two creates of one id raced,
    /// or an id reused before its release reached the books).
    fn admitted_answer(
        &self,
        key: &NodeContainer,
        asked: Option<(&str, &Resources)>,
    ) -> Option<AdmitAnswer> {
        let (e, over) = match self.pending.get(key) {
            Some(p) => (&p.entry, p.over.clone()),
            None => (self.nodes.get(&key.0)?.holdings.get(&key.1)?, None),
        };
        if let Some(mismatch) = asked.and_then(|a| other_request(key, &e.tenant, &e.resources, a)) {
            return Some(mismatch);
        }
        Some(AdmitAnswer::Admitted { class: e.class.into(), over })
    }

    #[allow(clippy::too_many_arguments)]
    fn record(
        &mut self,
        node: &str,
        container: &str,
        tenant: &str,
        r: &Resources,
        class: Class,
        over: Option<String>,
        meta: Meta,
        now: u64,
    ) {
        // Moved work admitted again (anywhere): the room promised to it is taken or not
        // needed.
        let moved =
            TenantClaim(tenant.to_string(), meta.workload.clone().unwrap_or(container.to_string()));
        if let Some(q) = self.requeues.get_mut(&moved).filter(|q| q.moved_to.is_some()) {
            q.moved_to = None;
            self.changes.requeue(&moved);
        }
        let key = NodeContainer(node.to_string(), container.to_string());
        self.insert_pending(
            key.clone(),
            Pending {
                entry: Entry {
                    tenant: tenant.to_string(),
                    resources: r.clone(),
                    class,
                    started_ms: now,
                    gang: meta.gang,
                    checkpoint: meta.checkpoint,
                    workload: meta.workload,
                },
                over,
            },
        );
        if self.unwait(&key).is_none() {
            // A retry under another container id (kubelet makes a new one): the tenant's
            // oldest entry of the same request on this node.
            let same = totals::on_node(&self.waiting, node)
                .filter(|(_, w)| w.tenant == tenant && &w.resources == r)
                .min_by_key(|(_, w)| w.arrived_ms)
                .map(|(k, _)| k.clone());
            if let Some(k) = same {
                self.unwait(&k);
            }
        }
    }

    /// Decides one GPU grant that is not a gang member's (gang members go through
    /// [`Books::gang_arrive`]). The caller checked [`Books::ready`] and validated `req`.
    pub fn admit(
        &mut self,
        tree: &QuotaTree,
        node: &str,
        req: &AdmitRequest,
        now: u64,
    ) -> AdmitAnswer {
        self.observe_tree(tree);
        self.tick(now);
        let key = NodeContainer(node.to_string(), req.container_id.clone());
        let r = req.amounts.to_resources();
        let tenant = req.tenant.as_str();
        if let Some(a) = self.admitted_answer(&key, Some((tenant, &r))) {
            return a;
        }
        if let Some((k, _, _)) = self.waiting_member(&key, &r) {
            return waits_in_gang(&key, &k);
        }
        if tree.iter().next().is_none() {
            // No quotas: count it (status stays useful) and never refuse.
            let meta = Meta::of(req, None);
            self.record(node, &req.container_id, tenant, &r, Class::Guaranteed, None, meta, now);
            return AdmitAnswer::Admitted { class: QuotaClass::Guaranteed, over: None };
        }
        let hold = claim_key(node, req);
        if let Some(rc) = self.reclaims.get(&hold) {
            if req.short_on_node {
                // Still short: the victims are stopping, or gone and their devices not
                // free yet (scrubbed first). The capacity stays held; ask again.
                return rc.still_reclaiming(now);
            }
        }
        // Owed at once when it first asked: its wait counts as an owner's, and it may
        // reclaim at once.
        let (asked_ms, owed_first, settling) = match self.first_asks.get(&hold) {
            Some(&(asked_ms, owed_first, _)) => (asked_ms, owed_first, false),
            None if self.settling(now) => (now, false, true),
            None => {
                // One look at the queue for both judgements.
                let (at_once, behind) = {
                    let owed = self.owed_judge(tree, node, req, &r, now);
                    let at_once = owed(Owed::AtOnce);
                    (at_once, !at_once && owed(Owed::Behind))
                };
                // Owed, but only behind a larger request of its tenant: owed from this ask
                // (its wait is an owed-later one, as the simulator counts it).
                if behind && !self.owed_since.contains_key(&hold) {
                    self.owed_since.insert(hold.clone(), (now, now));
                    self.changes.ask(&hold, true);
                }
                (now, at_once, false)
            }
        };
        let ask = Ask { owed_first, asked_ms, settling };
        // Room held for a consolidation (its claimant borrowed) yields to a request within
        // its guarantee that needs it: that request would otherwise preempt running work
        // for room the node has idle.
        if self.takes_held_room(node, tenant, &r, Some(&hold)) {
            let absorb = !req.unsynced_lease_grants;
            if matches!(
                self.decide(tree, node, tenant, &r, absorb),
                Decision::Admit { class: Class::Guaranteed, .. } | Decision::Reclaim { .. }
            ) {
                self.yield_consolidations(node, tenant, &req.container_id, &hold, now);
            }
        }
        let answer = if req.short_on_node || self.takes_held_room(node, tenant, &r, Some(&hold)) {
            self.admit_short(tree, node, req, &r, ask, now)
        } else {
            // The victims are gone: the capacity held is this claim's now (or, if it has
            // none, one held for another claim of its tenant on this node that holds as
            // much), if it is admitted.
            // A consolidation's hold only to a retry of its request (the same amounts): the
            // work moved for it was moved for that request, not for whatever of its tenant
            // fits the room.
            let freed = |k: &ClaimKey, rc: &Reclaim| {
                k.0 == hold.0
                    && k.1 == hold.1
                    && rc.freed_ms.is_some()
                    && r.fits_in(&rc.resources)
                    && (!rc.consolidation || rc.resources == r)
            };
            // The claim's own hold even while its victims are still listed (issue 27): the
            // node places it, so what they held there is free; the hold's resources are
            // then added to the capacity it is decided on (they are still counted as the
            // victims' usage until the node's next sync drops them).
            let key = match self.reclaims.get(&hold) {
                Some(_) => Some(hold.clone()),
                None => totals::claims_on(&self.reclaims, node)
                    .find(|(k, rc)| freed(k, rc))
                    .map(|(k, _)| k.clone()),
            };
            // Through the running totals and the durable state (issue 28).
            let held = key.and_then(|k| self.remove_reclaim(&k).map(|h| (k, h)));
            let extra = match &held {
                Some((_, h)) if h.freed_ms.is_none() => h.resources.clone(),
                _ => Resources::new(),
            };
            // Its own reclaim still under way (victims listed) and the request not
            // admissible even on what it holds: the same victims, never new ones. A
            // ceiling-bound reclaim frees the ceiling only when its victims leave the
            // books at their node's next sync; a node that syncs late must not make the
            // claim take a second victim for one request.
            if let Some((k, h)) = &held {
                let absorb = !req.unsynced_lease_grants;
                if *k == hold
                    && h.freed_ms.is_none()
                    && !matches!(
                        self.decide_with(tree, node, tenant, &r, absorb, &extra),
                        Decision::Admit { .. }
                    )
                {
                    let answer = h.still_reclaiming(now);
                    if let Some((k, h)) = held {
                        self.insert_reclaim(k, h, false);
                    }
                    return answer;
                }
            }
            let answer =
                self.admit_placed(tree, node, req, &r, held.as_ref().map(|_| &extra), ask, now);
            if let Some((k, h)) = held {
                if !matches!(answer, AdmitAnswer::Admitted { .. })
                    && !self.reclaims.contains_key(&k)
                {
                    self.insert_reclaim(k, h, false);
                }
            }
            answer
        };
        self.note_ask(&hold, tenant, &answer, ask, now);
        answer
    }

    /// Whether `req` from `node` is owed now behind its tenant's requests waiting before it
    /// on any node, by either rule, the fair queue looked at once: those that would be owed
    /// in arrival order counted as its guaranteed usage ([`Owed::Behind`],
    /// [`crate::owed_behind`]), or all of them ([`Owed::AtOnce`], [`crate::owed_at_once`]:
    /// whether it may reclaim at once). A request waiting whose claim holds a reclaim is
    /// not counted: the capacity held for it is in the usage. A claim whose own entry was
    /// relearned after a takeover is judged [`Owed::Behind`] for [`Owed::AtOnce`] too: the
    /// relearned queue's order is the order the requests asked again in, not the one they
    /// first asked in.
    fn owed_judge<'s>(
        &'s self,
        tree: &'s QuotaTree,
        node: &str,
        req: &'s AdmitRequest,
        r: &'s Resources,
        now: u64,
    ) -> impl Fn(Owed) -> bool + 's {
        let me = self.own_entry(node, &req.container_id, &req.tenant, r);
        let own = self.waiting.get(&me);
        let since = own.map_or(now, |w| w.arrived_ms);
        let relearned = own.map_or_else(|| self.settling(now), |w| w.relearned);
        let reclaiming = |NodeContainer(n, _): &NodeContainer, w: &WaitEntry| {
            self.reclaims.contains_key(&(n.clone(), w.tenant.clone(), w.claim.clone()))
        };
        let mut earlier: Vec<(u64, &Resources)> = self
            .waiting
            .iter()
            .filter(|(k, w)| **k != me && w.tenant == req.tenant && w.arrived_ms < since)
            .filter(|(k, w)| !reclaiming(k, w))
            .filter(|(_, w)| self.could_ever_run(tree, &w.tenant, &w.resources))
            .map(|(_, w)| (w.arrived_ms, &w.resources))
            .collect();
        earlier.sort_by_key(|&(at, _)| at);
        let earlier: Vec<&Resources> = earlier.into_iter().map(|(_, r)| r).collect();
        let usage = self.real_usage();
        move |how| {
            let ahead = earlier.iter().copied();
            match how {
                Owed::AtOnce if !relearned => owed_at_once(tree, &usage, &req.tenant, r, ahead),
                Owed::AtOnce | Owed::Behind => owed_behind(tree, &usage, &req.tenant, r, ahead),
            }
        }
    }

    /// The fair queue's entry of `container` on `node`: its own, or for a retry under
    /// another container id (kubelet makes a new one) the tenant's oldest entry of the same
    /// request on the node, as [`Books::record`] takes it (that one never asks again).
    fn own_entry(&self, node: &str, container: &str, tenant: &str, r: &Resources) -> NodeContainer {
        let own = NodeContainer(node.to_string(), container.to_string());
        if self.waiting.contains_key(&own) {
            return own;
        }
        totals::on_node(&self.waiting, node)
            .filter(|(_, w)| w.tenant == tenant && &w.resources == r)
            .min_by_key(|(_, w)| w.arrived_ms)
            .map_or(own, |(k, _)| k.clone())
    }

    /// Whether `tenant`'s request `r` could run at all: some node's capacity holds it and,
    /// alone on an idle fleet, it crosses no ceiling. One that could not (re-asked for ever,
    /// as a pod stuck pending is) is no backlog: counted ahead, it would keep its tenant's
    /// later requests from ever being owed. The simulator refuses such a request at arrival.
    fn could_ever_run(&self, tree: &QuotaTree, tenant: &str, r: &Resources) -> bool {
        let fits_a_node =
            self.nodes.values().any(|n| r.bounded_by(&n.capacity).fits_in(&n.capacity));
        fits_a_node
            && !matches!(
                decide_quota(tree, &self.capacity(), &Usage::new(), tenant, r),
                Decision::Refuse(_)
            )
    }

    /// Keeps the owner waits: an owed claim admitted adds its wait (first ask to now); a
    /// claim not admitted is remembered from its first ask.
    fn note_ask(
        &mut self,
        claim: &ClaimKey,
        tenant: &str,
        answer: &AdmitAnswer,
        ask: Ask,
        now: u64,
    ) {
        if matches!(answer, AdmitAnswer::Admitted { .. }) {
            let asked = self.first_asks.remove(claim).is_some();
            // The same claim waiting on other nodes (its pod asked there before): its wait
            // ends here too; a later ask there starts a new one, not one credited with the
            // time it ran.
            let (_, t, c) = claim;
            let changes = &mut self.changes;
            self.first_asks.retain(|k, _| {
                let other = k.1 == *t && k.2 == *c;
                if other {
                    changes.ask(k, false);
                }
                !other
            });
            // Its owed-since there ends too: a later ask there is owed from that ask, not
            // from before it ran. (Urgent: books taken over with it would count the time it
            // ran as time owed.)
            self.owed_since.retain(|k, _| {
                let other = k.0 != claim.0 && k.1 == *t && k.2 == *c;
                if other {
                    changes.ask(k, true);
                }
                !other
            });
            // Room a consolidation holds for it on another node goes (one container runs
            // on one node): counted as its tenant's use and kept from everyone else, it
            // would stay idle until the hold expires.
            let held_elsewhere: Vec<ClaimKey> =
                self.consolidations_elsewhere(&claim.0, t, c).cloned().collect();
            for k in held_elsewhere {
                self.remove_reclaim(&k);
            }
            let owed_since = self.owed_since.remove(claim).map(|(since, _)| since);
            if asked || owed_since.is_some() {
                self.changes.ask(claim, false);
            }
            if ask.owed_first || owed_since.is_some() {
                self.note_record(tenant);
            }
            let cost = self.costs.entry(tenant.to_string()).or_default();
            let (waits, from) = match (ask.owed_first, owed_since) {
                (true, _) => (&mut cost.owner_waits, ask.asked_ms),
                (false, Some(since)) => (&mut cost.owed_later_waits, since),
                (false, None) => return,
            };
            if waits.len() >= OWNER_WAITS_KEPT {
                waits.pop_front();
            }
            waits.push_back(now.saturating_sub(from));
        } else if !ask.settling {
            match self.first_asks.get_mut(claim) {
                Some(first) => {
                    // Its last ask is stored to the step: once it moves a step, lazily.
                    if state::coarse(first.2) != state::coarse(now) {
                        self.changes.ask(claim, false);
                    }
                    first.2 = now;
                }
                None => {
                    self.first_asks.insert(claim.clone(), (ask.asked_ms, ask.owed_first, now));
                    self.changes.ask(claim, true);
                }
            }
        }
    }

    /// Takes `key`'s request out of the fair queue, stored before the answer (books taken
    /// over without it would count it ahead of its tenant's next requests). Only expiry
    /// (`sweep`) is stored lazily: books taken over expire it again from its stored time.
    fn unwait(&mut self, key: &NodeContainer) -> Option<WaitEntry> {
        let gone = self.waiting.remove(key);
        if gone.is_some() {
            self.changes.waiting(key, true);
        }
        gone
    }

    /// Whether the books were taken over from a store less than [`WAITING_TTL_MS`] ago: the
    /// fair queue they did not store is still being relearned from the requests asking
    /// again ([`Ask::settling`]).
    fn settling(&self, now: u64) -> bool {
        self.restored_ms.is_some_and(|r| now < r.saturating_add(WAITING_TTL_MS))
    }

    /// Forgets since when `req`'s claim has been owed where `decision` puts it beyond its
    /// guarantee (borrowed, or at a ceiling): an ask that finds it so finds it not owed,
    /// and its `owed_reclaim_after_s` counts again from zero once it is owed again.
    fn forget_owed(&mut self, node: &str, req: &AdmitRequest, decision: &Decision) {
        if matches!(
            decision,
            Decision::Admit { class: Class::Borrowed, .. }
                | Decision::Wait { class: Class::Borrowed, .. }
                | Decision::Refuse(_)
        ) {
            let key = claim_key(node, req);
            if self.owed_since.remove(&key).is_some() {
                // Urgent: books taken over without it would count the time not owed.
                self.changes.ask(&key, true);
            }
        }
    }

    /// A request the node can place: decided, checked against the fair queue (unless the
    /// capacity was held for it by a reclaim) and recorded.
    #[allow(clippy::too_many_arguments)] // the admission's context, passed on as it is
    fn admit_placed(
        &mut self,
        tree: &QuotaTree,
        node: &str,
        req: &AdmitRequest,
        r: &Resources,
        held: Option<&Resources>,
        ask: Ask,
        now: u64,
    ) -> AdmitAnswer {
        let tenant = req.tenant.as_str();
        let held_for_it = held.is_some();
        let extra = held.cloned().unwrap_or_default();
        let decision = self.decide_with(tree, node, tenant, r, !req.unsynced_lease_grants, &extra);
        if matches!(decision, Decision::Admit { class: Class::Borrowed, .. } | Decision::Refuse(_))
        {
            // Within its guarantees but for other nodes' unused leases: recall them. (Still
            // owed: since when is kept.)
            if let Some(recall) = self.recall_leases(tree, node, req, r, now) {
                return recall.answer;
            }
        }
        self.forget_owed(node, req, &decision);
        match decision {
            Decision::Admit { class, over } => {
                if !held_for_it {
                    let me = &req.container_id;
                    if let Some(refusal) =
                        self.fair_queue_blocks(tree, node, tenant, me, r, now, false)
                    {
                        return self.refuse(now, tenant, node, &req.container_id, refusal, None);
                    }
                }
                let over = over.map(|(p, res)| rule(&p, &res, "guarantee"));
                if class == Class::Borrowed {
                    if let Some(refusal) = self.in_backoff(tree, req, now) {
                        return self.refuse(now, tenant, node, &req.container_id, refusal, None);
                    }
                }
                let meta = Meta::of(req, None);
                self.record(node, &req.container_id, tenant, r, class, over.clone(), meta, now);
                if class == Class::Borrowed {
                    self.event(
                        now,
                        QuotaEventKind::Borrow,
                        Some(tenant),
                        Some(node),
                        Some(&req.container_id),
                        format!(
                            "{} runs borrowed (beyond {}), priced at the burst price and \
                             reclaimable",
                            r,
                            over.as_deref().unwrap_or("its chain's guarantees")
                        ),
                    );
                }
                AdmitAnswer::Admitted { class: class.into(), over }
            }
            Decision::Refuse(c) => self.refuse_ceiling(node, &req.container_id, c, now),
            Decision::Reclaim { short, under } => {
                // Borrowed reservations of gangs still assembling run nothing: they give
                // way first, and the request is decided again without them.
                if self.yield_gangs(tenant, &short, now) {
                    return self.admit_placed(tree, node, req, r, held, ask, now);
                }
                // The node can place it; the fleet's books (or a ceiling on its chain,
                // `under`) are short: reclaim anywhere (under that path).
                let under = under.as_deref();
                let claim = Claim {
                    node,
                    tenant,
                    r,
                    short: &short,
                    on: None,
                    under,
                    placement: false,
                    consolidate: false,
                    ask,
                    req,
                };
                match self.start_reclaim(tree, &claim, now) {
                    Reclaimed::Started(a) => a,
                    Reclaimed::Not(why) => self.queue(tree, node, req, r, None, why, now),
                }
            }
            Decision::Wait { short, .. } => self.queue(tree, node, req, r, Some(&short), None, now),
        }
    }

    /// A refusal if `req`'s work was preempted and its requeue backoff has not ended: it
    /// may not borrow again before then.
    fn in_backoff(&self, tree: &QuotaTree, req: &AdmitRequest, now: u64) -> Option<String> {
        let q = self.requeues.get(&TenantClaim(req.tenant.clone(), claim_of(req)))?;
        if !q.backs_off(now) {
            return None;
        }
        let left_s = (q.until_ms - now).div_ceil(1000);
        let path = tree.chain(&req.tenant).next().map_or("(none)", |q| q.path.as_str());
        Some(format!(
            "{} was preempted {} (last at {}); it may borrow again after its requeue backoff \
             (quotas.{path}.requeue_backoff_s, doubled with each preemption): retry after \
             {left_s} s",
            untrusted(&claim_of(req)).max_chars(128),
            plural(q.preemptions as usize, "time", "times"),
            tessera_api::time::format_utc(q.last_ms)
        ))
    }

    /// A request the node could not place: reclaim borrowed work on that node if the
    /// request is within its tenant's guarantees, else wait in the fair queue.
    fn admit_short(
        &mut self,
        tree: &QuotaTree,
        node: &str,
        req: &AdmitRequest,
        r: &Resources,
        ask: Ask,
        now: u64,
    ) -> AdmitAnswer {
        let tenant = req.tenant.as_str();
        let absorb = !req.unsynced_lease_grants;
        let (usage, _) = self.booked(tree, absorb.then_some(node));
        let view = quota_view(tree, &usage, tenant, r);
        if let Some(recall) = self.recall_leases(tree, node, req, r, now) {
            // Within its guarantee once the live nodes' leases are cut: its reclaim on this
            // node starts now, and the victims' grace period runs while the nodes take the
            // cut (issue 27: a job's pods that a lease elsewhere held back were otherwise
            // told to retry first, and chose their victims a sync and a retry later).
            if matches!(recall.then, Decision::Admit { class: Class::Guaranteed, .. }) {
                if let Reclaimed::Started(a) = self.reclaim_on_node(tree, node, req, r, ask, now) {
                    return a;
                }
            }
            return recall.answer;
        }
        match decide_quota(tree, &view, &usage, tenant, r) {
            Decision::Refuse(c) => return self.refuse_ceiling(node, &req.container_id, c, now),
            Decision::Admit { class: Class::Guaranteed, .. } => {
                match self.reclaim_on_node(tree, node, req, r, ask, now) {
                    Reclaimed::Started(a) => return a,
                    Reclaimed::Not(why) => return self.queue(tree, node, req, r, None, why, now),
                }
            }
            Decision::Reclaim { short, under: Some(under) } => {
                // A ceiling on its chain is full of others' borrowed work, and the node is
                // short too: reclaim here, inside that path, what both need. Victims
                // already stopping under the ceiling (another claim's) give back what they
                // hold there: only the rest of the ceiling's shortfall is its own; none
                // left, the node's shortfall is reclaimed as for any claim within its
                // guarantee.
                let (stopping, _) = self.stopping_under(&under);
                let short = short.minus(&stopping);
                if short.is_empty() {
                    return match self.reclaim_on_node(tree, node, req, r, ask, now) {
                        Reclaimed::Started(a) => a,
                        Reclaimed::Not(why) => self.queue(tree, node, req, r, None, why, now),
                    };
                }
                let mut need = self.node_short(node, r);
                for (res, a) in short.iter() {
                    let more = a.saturating_sub(need.get(res));
                    need.add(&Resources::new().with(res.clone(), more));
                }
                let on = Some(node);
                let under = Some(under.as_str());
                let claim = Claim {
                    node,
                    tenant,
                    r,
                    short: &need,
                    on,
                    under,
                    placement: false,
                    consolidate: false,
                    ask,
                    req,
                };
                match self.start_reclaim(tree, &claim, now) {
                    Reclaimed::Started(a) => return a,
                    Reclaimed::Not(why) => return self.queue(tree, node, req, r, None, why, now),
                }
            }
            other => {
                self.forget_owed(node, req, &other);
                let decision = self.decide(tree, node, tenant, r, absorb);
                if let Decision::Refuse(c) = decision {
                    return self.refuse_ceiling(node, &req.container_id, c, now);
                }
                // Borrowed, and the fleet has room where its node has none: move
                // checkpointing work aside (issue 27's consolidation).
                if matches!(decision, Decision::Admit { class: Class::Borrowed, .. }) {
                    match self.consolidate_on_node(tree, node, req, r, ask, now) {
                        Reclaimed::Started(a) => return a,
                        Reclaimed::Not(why) => {
                            return self.queue(tree, node, req, r, None, why, now)
                        }
                    }
                }
            }
        }
        self.queue(tree, node, req, r, None, None, now)
    }

    /// The reclaim on `node` of a request within its tenant's guarantee that the node
    /// cannot place: what the node lacks for it, taken there. The fleet's own capacity says
    /// whether it has room elsewhere (placement) or is full.
    fn reclaim_on_node(
        &mut self,
        tree: &QuotaTree,
        node: &str,
        req: &AdmitRequest,
        r: &Resources,
        ask: Ask,
        now: u64,
    ) -> Reclaimed {
        let tenant = req.tenant.as_str();
        let short = self.node_short(node, r);
        let absorb = !req.unsynced_lease_grants;
        let placement =
            matches!(self.decide(tree, node, tenant, r, absorb), Decision::Admit { .. });
        let claim = Claim {
            node,
            tenant,
            r,
            short: &short,
            on: Some(node),
            under: None,
            placement,
            consolidate: false,
            ask,
            req,
        };
        self.start_reclaim(tree, &claim, now)
    }

    /// The holds of other tenants' consolidations on `node` give way to `tenant`'s request
    /// within its guarantee (`container`), each with an event; their claimants ask again as
    /// any waiting request does.
    fn yield_consolidations(
        &mut self,
        node: &str,
        tenant: &str,
        container: &str,
        own: &ClaimKey,
        now: u64,
    ) {
        let keys: Vec<ClaimKey> = totals::claims_on(&self.reclaims, node)
            .filter(|(k, rc)| rc.consolidation && *k != own)
            .map(|(k, _)| k.clone())
            .collect();
        for k in keys {
            if self.remove_reclaim(&k).is_some() {
                // Its wait paid for the work it moved: its next ask starts a new one (the
                // victims lose no more than it has waited, counted once).
                if self.first_asks.remove(&k).is_some() {
                    self.changes.ask(&k, true);
                }
                let message = format!(
                    "the room held on node {node} for {}'s consolidation goes to {tenant}'s \
                     request {} within its guarantee; {} asks again as a waiting request",
                    k.1,
                    untrusted(container),
                    k.1
                );
                self.event(now, QuotaEventKind::Reclaim, Some(&k.1), Some(node), None, message);
            }
        }
    }

    /// Consolidation (issue 27): a request admitted borrowed that `node` cannot place,
    /// first in the node's fair queue, moves other tenants' checkpointing borrowed work off
    /// the node where each victim fits on what another node has free
    /// ([`choose_victims_to_consolidate`]) and the victims lose no more than it has waited.
    /// Never for a gang.
    fn consolidate_on_node(
        &mut self,
        tree: &QuotaTree,
        node: &str,
        req: &AdmitRequest,
        r: &Resources,
        ask: Ask,
        now: u64,
    ) -> Reclaimed {
        let tenant = req.tenant.as_str();
        // Not for a gang, nor ahead of the node's fair queue, nor for work stopped or moved
        // lately: it would move back what was moved for it, and one in its requeue backoff
        // could not take the room (its requeue record is what `in_backoff` reads).
        let stopped_lately =
            self.requeues.contains_key(&TenantClaim(tenant.to_string(), claim_of(req)));
        // Nor for a fraction of a GPU: what keeps it out is a device's room, which the
        // books' amounts do not see.
        let whole = r.iter().any(|(x, a)| matches!(x, Resource::Gpu(_)) && a >= MICRO_PER_GPU);
        // Nor while room is being made for the same claim on another node (one container
        // runs on one node: its pod made anew elsewhere waits for that hold to end).
        let elsewhere =
            self.consolidations_elsewhere(node, tenant, &claim_of(req)).next().is_some();
        if req.gang.is_some()
            || !whole
            || stopped_lately
            || elsewhere
            || self.fair_queue_blocks(tree, node, tenant, &req.container_id, r, now, true).is_some()
        {
            return Reclaimed::Not(None);
        }
        // What the node lacks for it, the room promised there to work moved before (until
        // it is admitted again) counted as taken: that room is the moved work's, not its.
        let mut short = self.node_short(node, r);
        let promised = self.promised_room(now).remove(node).unwrap_or_default();
        if !promised.is_empty() {
            if let Some(nb) = self.nodes.get(node) {
                let relevant = r.only(|x| matches!(x, Resource::Gpu(_)) || nb.capacity.get(x) > 0);
                let used = nb.agg.used.minus(&self.stopping_listed(Some(node)));
                let lacks = relevant.minus(&nb.capacity.minus(&used).minus(&promised));
                for (res, a) in lacks.iter() {
                    let more = a.saturating_sub(short.get(res));
                    short.add(&Resources::new().with(res.clone(), more));
                }
            }
        }
        let claim = Claim {
            node,
            tenant,
            r,
            short: &short,
            on: Some(node),
            under: None,
            placement: false,
            consolidate: true,
            ask,
            req,
        };
        self.start_reclaim(tree, &claim, now)
    }

    /// Whether unused leases alone stand between `tenant`'s request `r` from `node` and a
    /// better answer: by what is really used (holdings, pending admissions, held capacity,
    /// gang reservations) it is within its guarantees (admitted, or reclaiming at a full
    /// ceiling), or at least under every ceiling, but once the nodes' unused leases are
    /// booked it is borrowed, or refused at a ceiling.
    /// (The asking node's own lease counts too where the decision counts it: for borrowed
    /// work, and for a node that admitted work under its leases it has not synced yet.)
    fn lease_bound(
        &self,
        tree: &QuotaTree,
        node: &str,
        tenant: &str,
        r: &Resources,
        absorb: bool,
    ) -> bool {
        let real = self.real_usage();
        let view = quota_view(tree, &real, tenant, r);
        let by_use = decide_quota(tree, &view, &real, tenant, r);
        let booked_view = |exclude: Option<&str>| {
            let (booked, _) = self.booked(tree, exclude);
            let view = quota_view(tree, &booked, tenant, r);
            decide_quota(tree, &view, &booked, tenant, r)
        };
        match by_use {
            Decision::Admit { class: Class::Guaranteed, .. } => !matches!(
                booked_view(absorb.then_some(node)),
                Decision::Admit { class: Class::Guaranteed, .. }
            ),
            // Within its guarantees, at a ceiling full of others' borrowed work: it
            // reclaims, unless the leases booked take it past the ceiling (refused).
            Decision::Admit { class: Class::Borrowed, .. } | Decision::Reclaim { .. } => {
                matches!(booked_view(None), Decision::Refuse(_))
            }
            _ => false,
        }
    }

    /// A request that unused leases alone keep from its guarantees or under its ceilings
    /// ([`Books::lease_bound`]): the leases of the guaranteed paths on its chain are
    /// recalled (cut at each live node's next sync to what it holds, for
    /// [`LEASE_RECALL_MS`]) and the request is told to retry once the nodes have taken the
    /// cut. `None` when leases are not what stands in its way, or only silent nodes hold
    /// them. With the answer, how the request is decided once the live nodes' leases are
    /// cut.
    fn recall_leases(
        &mut self,
        tree: &QuotaTree,
        node: &str,
        req: &AdmitRequest,
        r: &Resources,
        now: u64,
    ) -> Option<Recall> {
        let tenant = req.tenant.as_str();
        if !self.lease_bound(tree, node, tenant, r, !req.unsynced_lease_grants) {
            return None;
        }
        // The guaranteed paths on its chain, and those under a ceiling on its chain (their
        // unused leases count against that ceiling: a child's lease keeps its parent's
        // ceiling from lending what the child does not use).
        let guarantees = |q: &crate::Quota| {
            r.iter().any(|(res, _)| q.limits.get(res).is_some_and(|l| l.guarantee.is_some()))
        };
        let ceilings: Vec<&str> = tree
            .chain(tenant)
            .filter(|q| {
                r.iter().any(|(res, _)| q.limits.get(res).is_some_and(|l| l.ceiling.is_some()))
            })
            .map(|q| q.path.as_str())
            .collect();
        let paths: Vec<String> = tree
            .iter()
            .filter(|q| guarantees(q))
            .filter(|q| {
                is_within(tenant, &q.path) || ceilings.iter().any(|c| is_within(&q.path, c))
            })
            .map(|q| q.path.clone())
            .collect();
        // The nodes whose phantom on one of the paths is not empty (the totals' index),
        // those that synced lately.
        let holders: Vec<String> = paths
            .iter()
            .filter_map(|p| self.totals.holders.get(p))
            .flatten()
            .collect::<BTreeSet<&String>>()
            .into_iter()
            .filter(|n| {
                self.nodes
                    .get(n.as_str())
                    .is_some_and(|nb| now.saturating_sub(nb.last_sync_ms) <= RECALL_LIVE_MS)
            })
            .cloned()
            .collect();
        // Only the leases of live nodes can be recalled: with theirs gone and the silent
        // nodes' still booked, would the request be better off? If not, waiting frees
        // nothing and it is decided as it stands (borrowed, or refused at a ceiling).
        let (mut without_live, _) = self.booked(tree, None);
        let own = (!req.unsynced_lease_grants && !holders.iter().any(|h| h == node))
            .then(|| node.to_string());
        for n in holders.iter().chain(own.iter()) {
            for (path, x) in self.phantoms(tree, n) {
                without_live.release_leased(&path, &x);
            }
        }
        let view = quota_view(tree, &without_live, tenant, r);
        let real = self.real_usage();
        let real_view = quota_view(tree, &real, tenant, r);
        let better = |d: &Decision| match d {
            Decision::Admit { class: Class::Guaranteed, .. } => 3,
            Decision::Admit { .. } => 2,
            Decision::Reclaim { .. } => 1,
            _ => 0,
        };
        let best = better(&decide_quota(tree, &real_view, &real, tenant, r));
        let cut = decide_quota(tree, &view, &without_live, tenant, r);
        if holders.is_empty() || better(&cut) < best {
            return None;
        }
        // How it is decided once the cut is taken: a node that admitted under its leases
        // and has not synced since lists that work at its next sync, so the cut of its own
        // lease frees none of what it admitted (its phantoms stay in).
        let then = if req.unsynced_lease_grants && holders.iter().any(|h| h == node) {
            let mut after = without_live.clone();
            for (path, x) in self.phantoms(tree, node) {
                after.add_leased(&path, &x);
            }
            decide_quota(tree, &quota_view(tree, &after, tenant, r), &after, tenant, r)
        } else {
            cut
        };
        for p in &paths {
            self.recalled.insert(p.clone(), now.saturating_add(LEASE_RECALL_MS));
            self.expires_at(now.saturating_add(LEASE_RECALL_MS));
        }
        self.generation = self.generation.wrapping_add(1);
        for n in &holders {
            if let Some(nb) = self.nodes.get_mut(n) {
                nb.computed_ms = None;
            }
        }
        // At fleet size the holders are many: the message names ten.
        let mut named = holders.iter().take(10).cloned().collect::<Vec<_>>().join(", node ");
        if holders.len() > 10 {
            named.push_str(&format!(" and {} more nodes", holders.len() - 10));
        }
        let message = format!(
            "{r} for {} is held back only by unused leases of {} on node {named} (kept for \
             admitting guaranteed work there if a node is cut off from the coordinator); the \
             leases are recalled; retry after {LEASE_RECALL_RETRY_S} s",
            untrusted(tenant),
            paths.join(", "),
        );
        self.event(
            now,
            QuotaEventKind::Reclaim,
            Some(tenant),
            Some(node),
            Some(&req.container_id),
            message.clone(),
        );
        let answer = AdmitAnswer::Reclaiming {
            retry_after_s: LEASE_RECALL_RETRY_S,
            victims: Vec::new(),
            message,
        };
        Some(Recall { answer, then })
    }

    /// Whether `tenant`'s request `r`, which `node` can place, would take devices there held
    /// for another tenant's claim: the node's room now by the books (its capacity less its
    /// holdings, pending admissions, and each other tenant's hold there less what its
    /// victims on the node, still listed, will give it) does not hold it. Such a request is
    /// decided as one its node cannot place: the node does not know which of its free
    /// devices are held (nor does the device plugin's capacity), and admitted, it took the
    /// devices a claimant's victims elsewhere had been stopped for (issue 27's red team: the
    /// claimant then waited for its hold to expire). Room a stopping victim frees later is
    /// not room now: counted so, it let a request onto devices held for a claim whose own
    /// victims had gone, and that claim waited on another claim's victim.
    /// A hold of its own tenant counts as another's where it is a consolidation's for another
    /// request (not `own`, the asking claim, nor a retry of the same amounts): the work moved
    /// for it was moved for that request.
    fn takes_held_room(
        &self,
        node: &str,
        tenant: &str,
        r: &Resources,
        own: Option<&ClaimKey>,
    ) -> bool {
        let Some(nb) = self.nodes.get(node) else { return false };
        let mut holds = Resources::new();
        let mut uncovered = Resources::new();
        let mut others = false;
        for (k @ (_, t, _), rc) in totals::claims_on(&self.reclaims, node) {
            holds.add(&rc.resources);
            if t == tenant && (!rc.consolidation || own == Some(k) || rc.resources == *r) {
                continue;
            }
            others = true;
            // A hold that waits for another reclaim's victims needs its room now: those
            // victims free what that reclaim holds.
            let covered = if rc.shared {
                Resources::new()
            } else {
                self.listed_victims_on(node, rc).fold(Resources::new(), |acc, (_, r)| acc.plus(r))
            };
            uncovered.add(&rc.resources.minus(&covered));
        }
        if !others {
            return false;
        }
        let used = nb.agg.used.minus(&holds).plus(&uncovered);
        let relevant = r.only(|x| matches!(x, Resource::Gpu(_)) || nb.capacity.get(x) > 0);
        !relevant.fits_in(&nb.capacity.minus(&used))
    }

    /// What `node` lacks for `r` by the books once the victims of the reclaims under way
    /// there are gone ([`Books::stopping_listed`]: counted as used beside the holds they
    /// make room for, they made a second claim there take victims it did not need); when
    /// the books see room the node does not (its devices are fragmented), the GPUs of `r`.
    fn node_short(&self, node: &str, r: &Resources) -> Resources {
        let nb = self.nodes.get(node);
        let cap = nb.map(|n| n.capacity.clone()).unwrap_or_default();
        let relevant = r.only(|x| matches!(x, Resource::Gpu(_)) || cap.get(x) > 0);
        let used = nb.map(|n| n.agg.used.minus(&self.stopping_listed(Some(node))));
        let short = relevant.minus(&cap.minus(&used.unwrap_or_default()));
        if !short.is_empty() {
            return short;
        }
        // Room once the stopping victims there are gone, none now: nothing to take, the
        // claim waits for them (issue 27's red team: it took as many GPUs as it asked).
        if !relevant.fits_in(&self.node_free(node)) {
            return Resources::new();
        }
        let gpus = r.only(|x| matches!(x, Resource::Gpu(_)));
        if gpus.is_empty() {
            r.clone()
        } else {
            gpus
        }
    }

    fn refuse_ceiling(
        &mut self,
        node: &str,
        container: &str,
        c: crate::CeilingRefusal,
        now: u64,
    ) -> AdmitAnswer {
        let ceiling = rule(&c.path, &c.resource, "ceiling");
        self.refuse(now, &c.tenant, node, container, c.to_string(), Some(ceiling))
    }

    /// Victims for the claim among borrowed holdings on `claim.on` (every node: `None`) of
    /// tenants outside its subtree, not already being stopped by another reclaim, chosen by
    /// the work they would lose ([`choose_victims`]); a victim in a gang brings every member
    /// of the gang on every node. A claim not owed now ([`crate::owed`]) takes none: it
    /// waits for capacity to free; one owed, but not at once at its first ask (owed only
    /// behind a larger request of its tenant, or only since), goes ahead only if the
    /// victims lose no more than its waiting has cost, or once it has been owed for its path's
    /// `owed_reclaim_after_s` ([`crate::may_reclaim_owed_later`]). Starts the reclaim and
    /// answers it, or says why not.
    fn start_reclaim(&mut self, tree: &QuotaTree, claim: &Claim<'_>, now: u64) -> Reclaimed {
        let Claim { node, tenant: claimant, r, short, on, under, placement, consolidate, ask, req } =
            *claim;
        if short.is_empty() {
            return Reclaimed::Not(None);
        }
        // A consolidation's claimant is owed nothing: work stopping for a reclaim the books
        // lost was stopped for a claim within its guarantee, and is not held for it.
        if !consolidate {
            if let Some(a) = self.await_stopping(tree, node, claimant, req, r, short, on, now) {
                return Reclaimed::Started(a);
            }
        }
        // Owed at once when it first asked, owed behind a larger request of its tenant, or
        // owed since: one that was not (its tenant's backlog ahead filled the guarantee) is
        // owed once that backlog is served and its tenant's guaranteed work has ended. A
        // request not owed now never preempts.
        let key = claim_key(node, req);
        if ask.settling {
            let restored = self.restored_ms.unwrap_or(now);
            let left_s = restored.saturating_add(WAITING_TTL_MS).saturating_sub(now).div_ceil(1000);
            return Reclaimed::Not(Some(format!(
                "the books were taken over {} s ago and relearn the fair queue from the \
                 requests asking again (each within {} s): until then a request first seen \
                 preempts no borrowed work; retry after {} s",
                now.saturating_sub(restored) / 1000,
                WAITING_TTL_MS / 1000,
                left_s.max(1)
            )));
        }
        // Not owed at once at its first ask: whether it is owed now, and how (both rules on
        // one look at the fair queue). A consolidation is owed nothing: it is judged by what
        // its victims lose alone.
        let owed_now = (!ask.owed_first && !consolidate).then(|| {
            let judge = self.owed_judge(tree, node, req, r, now);
            (judge(Owed::Behind), owed_how(judge(Owed::AtOnce)))
        });
        if let Some((false, _)) = owed_now {
            if self.owed_since.remove(&key).is_some() {
                // Urgent: books taken over without it would count the time not owed.
                self.changes.ask(&key, true);
            }
            return Reclaimed::Not(Some(
                "not owed now (its tenant's requests waiting before it fill its guarantee), \
                 so it preempts no borrowed work; it waits in the fair queue for capacity to \
                 free"
                    .to_string(),
            ));
        }
        // Owed now: since when, from the ask that first found it so (counted again from
        // zero where no ask has found it owed for as long as the queue keeps a claim).
        let owed_since_ms = if ask.owed_first || consolidate {
            now
        } else {
            let new = !self.owed_since.contains_key(&key);
            let (since, last) = self.owed_since.entry(key.clone()).or_insert((now, now));
            let restarted = now > state::counted(*last).saturating_add(WAITING_TTL_MS);
            if restarted {
                *since = now;
            }
            let moved = state::coarse(*last) != state::coarse(now);
            *last = now;
            let since = *since;
            if new || restarted {
                self.changes.ask(&key, true);
            } else if moved {
                self.changes.ask(&key, false);
            }
            since
        };
        // Under a full ceiling that victims already stopping under it (another claim's)
        // bring back within reach, only the rest of its shortfall is its own to take. (A
        // claim its node can place: its shortfall is the ceiling's alone; one short on its
        // node deducts them in `admit_short`.) Covered whole, it holds its amount and
        // waits for them, so that a later claim counts what it will take of the room. (Only
        // a claim owed now: one that is not waits in the fair queue, holding nothing.)
        let rest;
        let short = match under.filter(|_| on.is_none()) {
            Some(path) => {
                let (stopping, victims) = self.stopping_under(path);
                rest = short.minus(&stopping);
                if !victims.is_empty() && rest.is_empty() {
                    let why = format!(
                        "already stopping under {path} for another claim; {claimant}, which \
                         asks {r} within its guarantee on node {node}, fits under the ceiling \
                         once it is gone and waits for it"
                    );
                    let victims = victims.into_iter().map(|v| Victim { reason: why.clone(), ..v });
                    let held = self.hold_for_stopping(
                        node,
                        claimant,
                        req,
                        r,
                        victims.collect(),
                        true,
                        now,
                    );
                    return Reclaimed::Started(held);
                }
                &rest
            }
            None => short,
        };
        let stopping: BTreeSet<(&str, &str)> = self
            .reclaims
            .values()
            .filter(|rc| rc.freed_ms.is_none())
            .flat_map(|rc| rc.victims.iter())
            .map(|v| (v.node.as_str(), v.container_id.as_str()))
            .collect();
        // The candidates: on one node, its holdings; fleet-wide, the borrowed holdings and
        // every member of their gangs (the indexes; only borrowed work is ever taken, and a
        // gang with a borrowed member is taken whole). Containers their node is stopping
        // already are not taken again.
        let candidates: Vec<NodeContainer> = match on {
            Some(n) => self
                .nodes
                .get(n)
                .map(|nb| {
                    nb.holdings.keys().map(|c| NodeContainer(n.to_string(), c.clone())).collect()
                })
                .unwrap_or_default(),
            None => {
                let mut set: BTreeSet<NodeContainer> = self.borrowed_idx.clone();
                for k in &self.borrowed_idx {
                    let gang = self.nodes.get(&k.0).and_then(|nb| nb.holdings.get(&k.1));
                    if let Some(e) = gang.filter(|e| e.gang.is_some()) {
                        let gk = TenantGang(e.tenant.clone(), e.gang.clone().unwrap_or_default());
                        set.extend(self.gang_idx.get(&gk).into_iter().flatten().cloned());
                    }
                }
                set.into_iter().collect()
            }
        };
        let mut refs: Vec<NodeContainer> = Vec::new();
        let mut running = Vec::new();
        for NodeContainer(n, c) in candidates {
            let Some(nb) = self.nodes.get(&n) else { continue };
            let Some(e) = nb.holdings.get(&c) else { continue };
            if nb.stopping.contains(&c) {
                continue;
            }
            if stopping.contains(&(n.as_str(), c.as_str()))
                || under.is_some_and(|p| !is_within(&e.tenant, p))
            {
                continue;
            }
            // A workload stopped before (its requeue is remembered) is not moved again.
            let claim = TenantClaim(e.tenant.clone(), e.workload.clone().unwrap_or(c.clone()));
            if consolidate && self.requeues.contains_key(&claim) {
                continue;
            }
            running.push(Running {
                id: format!("{:010}", refs.len()),
                tenant: e.tenant.clone(),
                resources: e.resources.clone(),
                class: e.class,
                started_ms: e.started_ms,
                gang: e.gang.as_ref().map(|g| format!("{}/{g}", e.tenant)),
                checkpoints: e.checkpoint,
            });
            refs.push(NodeContainer(n, c));
        }
        // What runs on: real use less the work being stopped already (whose tenants borrow
        // that much less once it is gone).
        let mut usage = self.real_usage();
        let going = stopping
            .iter()
            .copied()
            .chain(self.stopping_idx.iter().flat_map(|n| {
                self.nodes
                    .get(n)
                    .into_iter()
                    .flat_map(move |nb| nb.stopping.iter().map(move |c| (n.as_str(), c.as_str())))
            }))
            .collect::<BTreeSet<_>>();
        for (n, c) in going {
            if let Some(e) = self.nodes.get(n).and_then(|nb| nb.holdings.get(c)) {
                usage.release(&e.tenant, e.class, &e.resources);
            }
        }
        let capacity = self.capacity();
        // The fleet has room, this node not (placement).
        let chosen = if consolidate {
            // Each victim must fit on what another live node has free.
            // Less the room other consolidations promised the work they moved there, until
            // that work is admitted again (their requeue records: a claimant's hold ends
            // before its victims resume).
            let promised = self.promised_room(now);
            let mut rooms: Vec<Room> = self
                .nodes
                .iter()
                // A node silent for a minute (nodes sync every second or so) is likely dead
                // or cut off, though its lease keeps it in the books: no work is sent to
                // resume there. Nor to one not heard from since the books were taken over
                // (restored, it counts as heard from then, however long it was silent).
                .filter(|(n, nb)| {
                    n.as_str() != node
                        && nb.heard
                        && now.saturating_sub(nb.last_sync_ms) <= MOVE_LIVE_MS
                })
                .map(|(n, nb)| Room {
                    node: n.clone(),
                    capacity: nb.capacity.clone(),
                    free: self
                        .node_free(n)
                        .minus(promised.get(n.as_str()).unwrap_or(&Resources::new())),
                })
                .collect();
            let mut fits = first_fit(&mut rooms);
            // Only work of tenants that borrow (a reclaim's strict rule, each one taken
            // counted as gone): a tenant back within its guarantee keeps its work where it
            // runs, for a borrowed claimant above all.
            let mut after = usage.clone();
            let place = |c: &Candidate| {
                if !borrowing_short(tree, &after, &c.tenant, &c.resources, claimant, r, short) {
                    return None;
                }
                let to = fits(c)?;
                after.release(&c.tenant, Class::Borrowed, &c.resources);
                Some(to)
            };
            choose_victims_to_consolidate(&running, tree, &capacity, claimant, short, now, place)
                .ok_or(NoVictims::Short)
        } else {
            let choose = if placement { choose_victims_for_placement } else { choose_victims };
            choose(&running, &usage, tree, &capacity, claimant, r, short, now)
        };
        let chosen = match chosen {
            Ok(v) => v,
            Err(NoVictims::Short) => return Reclaimed::Not(None),
            Err(NoVictims::Protected { until_ms }) => {
                let left_s = until_ms.saturating_sub(now).div_ceil(1000).max(1);
                return Reclaimed::Not(Some(format!(
                    "the borrowed work it would reclaim is within its minimum run time \
                     (min_runtime_s) for {left_s} s more; retry after {left_s} s"
                )));
            }
        };
        let waited_s = now.saturating_sub(ask.asked_ms) / 1000;
        let owed_for_s = now.saturating_sub(owed_since_ms) / 1000;
        let after_s = tree.owed_reclaim_after_s(claimant);
        let share = dominant_share(r, &capacity);
        let not_yet = |&(_, how): &(bool, &'static str)| {
            (!may_reclaim_owed_later(chosen.cost, waited_s, share, owed_for_s, after_s))
                .then_some(how)
        };
        if let Some(owed) = owed_now.as_ref().and_then(not_yet) {
            let patience = match after_s {
                Some(a) => format!(
                    ", or once owed for {a} s (quotas.{path}.owed_reclaim_after_s): retry \
                     after {left} s",
                    path = tree.chain(claimant).next().map_or(claimant, |q| q.path.as_str()),
                    left = a.saturating_sub(owed_for_s).max(1),
                ),
                None => String::new(),
            };
            return Reclaimed::Not(Some(format!(
                "{owed}, so it reclaims only when the borrowed work would lose no more than it \
                 has waited ({waited_s} s so far){patience}; it waits for capacity to free"
            )));
        }
        if consolidate && !worth_reclaiming(chosen.cost, waited_s, share) {
            return Reclaimed::Not(Some(format!(
                "the checkpointing borrowed work that moving would make room for it on node \
                 {node} would lose more than it has waited ({waited_s} s so far); it waits \
                 for capacity to free"
            )));
        }
        if consolidate && waited_s == 0 {
            // Work that has run nothing yet loses nothing, but at its first ask a claimant
            // has waited nothing: nothing moves for it yet.
            return Reclaimed::Not(Some(format!(
                "it has waited nothing yet for node {node} to make room, so no checkpointing \
                 borrowed work moves for it; it waits for capacity to free"
            )));
        }
        let mut picked: BTreeMap<NodeContainer, String> = BTreeMap::new();
        let mut gangs: BTreeMap<TenantGang, String> = BTreeMap::new();
        let mut moved_to: BTreeMap<NodeContainer, String> = BTreeMap::new();
        for c in &chosen.chosen {
            for id in &c.candidate.ids {
                let Some(k) = id.parse::<usize>().ok().and_then(|i| refs.get(i)) else { continue };
                if let Some(to) = &c.to {
                    moved_to.insert(k.clone(), to.clone());
                }
                if let Some(e) = self.nodes.get(&k.0).and_then(|nb| nb.holdings.get(&k.1)) {
                    if let Some(g) = &e.gang {
                        gangs.insert(TenantGang(e.tenant.clone(), g.clone()), c.why.clone());
                    }
                }
                picked.insert(k.clone(), c.why.clone());
            }
        }
        for (g, why) in &gangs {
            for k in self.gang_idx.get(g).into_iter().flatten() {
                picked.entry(k.clone()).or_insert_with(|| why.clone());
            }
        }
        let owed = match owed_now {
            None => "owed: at once".to_string(),
            Some((_, how)) if worth_reclaiming(chosen.cost, waited_s, share) => {
                format!("{how}, after waiting as long as it loses")
            }
            Some((_, how)) => format!(
                "{how}, for {owed_for_s} s: its path's owed_reclaim_after_s ({} s)",
                after_s.unwrap_or_default()
            ),
        };
        let mut victims = Vec::new();
        let mut tenants: BTreeSet<String> = BTreeSet::new();
        let mut preempted: Vec<(String, Option<String>, String, Resources, u64, bool)> = Vec::new();
        for (NodeContainer(n, c), why) in &picked {
            let Some(e) = self.nodes.get(n).and_then(|nb| nb.holdings.get(c)) else { continue };
            let grace_s = tree.grace_period_s(&e.tenant);
            tenants.insert(e.tenant.clone());
            let ran_s = now.saturating_sub(e.started_ms) / 1000;
            preempted.push((
                e.tenant.clone(),
                e.workload.clone(),
                c.clone(),
                e.resources.clone(),
                if e.checkpoint { ran_s.min(grace_s) } else { ran_s },
                e.checkpoint,
            ));
            victims.push(Victim {
                node: n.clone(),
                container_id: c.clone(),
                tenant: e.tenant.clone(),
                grace_s,
                reason: if consolidate {
                    format!(
                        "moved for {claimant}, which asks {r} borrowed on node {node} and fits \
                         there once it is gone: {} runs {} on borrowed capacity; {why}",
                        e.tenant, e.resources,
                    )
                } else {
                    format!(
                        "reclaimed for {claimant}, which asks {r} within its guarantee on node \
                         {node} ({owed}): {} runs {} on borrowed capacity; {why}",
                        e.tenant, e.resources,
                    )
                },
                requeue: String::new(),
            });
        }
        // What preemption costs each victim's tenant, and when each victim may borrow again.
        for (v, (tenant, workload, container, resources, lost_s, checkpoint)) in
            victims.iter_mut().zip(preempted)
        {
            let cost = self.costs.entry(tenant.clone()).or_default();
            cost.preempted_ms.push_back(now);
            for (res, amount) in resources.iter() {
                let slot = cost.lost.entry(res.clone()).or_default();
                *slot = slot.saturating_add(u128::from(amount) * u128::from(lost_s));
            }
            let key = TenantClaim(tenant.clone(), workload.unwrap_or(container));
            self.changes.requeue(&key);
            let q = self.requeues.entry(key).or_insert(Requeue {
                preemptions: 0,
                last_ms: now,
                until_ms: now,
                moved_to: None,
            });
            if let Some(to) = moved_to.get(&NodeContainer(v.node.clone(), v.container_id.clone())) {
                q.moved_to = Some((to.clone(), resources.clone()));
            }
            // A move is remembered (the work is not moved again) but takes no backoff: it
            // was promised room to resume at once.
            if !consolidate {
                q.preemptions = q.preemptions.saturating_add(1);
            }
            q.last_ms = now;
            let backoff_s =
                if consolidate { 0 } else { tree.requeue_backoff_s(&tenant, q.preemptions) };
            let stopped_ms = now.saturating_add(v.grace_s.saturating_mul(1000));
            q.until_ms = stopped_ms.saturating_add(backoff_s.saturating_mul(1000));
            let path = tree.chain(&tenant).next().map_or("(none)", |q| q.path.as_str());
            let when = if backoff_s == 0 {
                "it may ask again as soon as it is stopped (no requeue backoff)".to_string()
            } else {
                format!(
                    "it may borrow again from {} ({backoff_s} s after it is stopped: \
                     quotas.{path}.requeue_backoff_s, doubled for each of its {} preemptions)",
                    tessera_api::time::format_utc(q.until_ms),
                    q.preemptions
                )
            };
            v.requeue = if checkpoint {
                format!(
                    "checkpointing: SIGTERM now, {} s to write its checkpoint, then it resumes \
                     from it when it runs again; {when}",
                    v.grace_s
                )
            } else {
                format!("no checkpoint: it restarts from zero; {when}")
            };
        }
        let grace = victims.iter().map(|v| v.grace_s).max().unwrap_or(0);
        let retry_after_s = grace.saturating_add(RETRY_SLACK_S);
        let where_ = match on {
            Some(n) => format!("on node {n}"),
            None => {
                let ns: BTreeSet<&str> = victims.iter().map(|v| v.node.as_str()).collect();
                format!("on nodes {}", ns.into_iter().collect::<Vec<_>>().join(", "))
            }
        };
        let message = if consolidate {
            format!(
                "consolidating: moving {} of {} off node {node} (grace {grace} s) to make room \
                 for {claimant}; they resume from their checkpoints on other nodes",
                plural(victims.len(), "checkpointing container", "checkpointing containers"),
                tenants.iter().cloned().collect::<Vec<_>>().join(", ")
            )
        } else {
            format!(
                "reclaiming: stopping {} of {} {where_} (grace {grace} s) to return {claimant} \
                 its guarantee",
                plural(victims.len(), "borrowed container", "borrowed containers"),
                tenants.iter().cloned().collect::<Vec<_>>().join(", ")
            )
        };
        self.insert_reclaim(
            claim_key(node, req),
            Reclaim {
                resources: r.clone(),
                victims: victims.clone(),
                started_ms: now,
                retry_after_s,
                freed_ms: None,
                message: message.clone(),
                shared: false,
                consolidation: consolidate,
            },
            true,
        );
        *self.counters.reclaims.entry(claimant.to_string()).or_default() += 1;
        self.note_record(claimant);
        self.event(
            now,
            QuotaEventKind::Reclaim,
            Some(claimant),
            Some(node),
            Some(&req.container_id),
            message.clone(),
        );
        for v in &victims {
            *self.counters.preemptions.entry(v.tenant.clone()).or_default() += 1;
            // Its record: this count and the cost taken above.
            self.note_record(&v.tenant);
            self.event(
                now,
                QuotaEventKind::Preempt,
                Some(&v.tenant),
                Some(&v.node),
                Some(&v.container_id),
                format!("{} (SIGTERM, SIGKILL after {} s); {}", v.reason, v.grace_s, v.requeue),
            );
        }
        Reclaimed::Started(AdmitAnswer::Reclaiming {
            retry_after_s,
            victims,
            message: format!("{message}; retry after {retry_after_s} s"),
        })
    }

    /// The room promised, per node, to work consolidations moved there and that has not
    /// been admitted again ([`Requeue::promised`]).
    fn promised_room(&self, now: u64) -> BTreeMap<&str, Resources> {
        let mut promised: BTreeMap<&str, Resources> = BTreeMap::new();
        for (n, r) in self.requeues.values().filter_map(|q| q.promised(now)) {
            promised.entry(n.as_str()).or_default().add(r);
        }
        promised
    }

    /// The holds consolidations keep for `tenant`'s `claim` on nodes other than `node`.
    fn consolidations_elsewhere<'a>(
        &'a self,
        node: &'a str,
        tenant: &'a str,
        claim: &'a str,
    ) -> impl Iterator<Item = &'a ClaimKey> + 'a {
        self.reclaims
            .iter()
            .filter(move |((n, t, c), rc)| {
                rc.consolidation && n != node && t == tenant && c == claim
            })
            .map(|(k, _)| k)
    }

    /// A claim whose shortfall the containers its node is stopping already will free (a
    /// reclaim whose books were lost, in a coordinator restarted during the victims' grace
    /// period: their node's sync says they are stopping): the claim waits for them, and no
    /// second victim is taken. `None` when they do not cover it.
    #[allow(clippy::too_many_arguments)]
    fn await_stopping(
        &mut self,
        tree: &QuotaTree,
        node: &str,
        claimant: &str,
        req: &AdmitRequest,
        r: &Resources,
        short: &Resources,
        on: Option<&str>,
        now: u64,
    ) -> Option<AdmitAnswer> {
        let mut freeing = Resources::new();
        let mut victims = Vec::new();
        // Containers stopping for a reclaim these books know (another claim's, issue 27)
        // free nothing for this one: only those of reclaims the books lost count.
        let known: BTreeSet<(&str, &str)> = self
            .reclaims
            .values()
            .flat_map(|rc| rc.victims.iter())
            .map(|v| (v.node.as_str(), v.container_id.as_str()))
            .collect();
        for n in &self.stopping_idx {
            let Some(nb) = self.nodes.get(n).filter(|_| on.is_none_or(|o| o == n)) else {
                continue;
            };
            for c in &nb.stopping {
                let Some(e) = nb.holdings.get(c) else { continue };
                if e.class != Class::Borrowed
                    || is_within(&e.tenant, claimant)
                    || known.contains(&(n.as_str(), c.as_str()))
                {
                    continue;
                }
                freeing.add(&e.resources);
                victims.push(Victim {
                    node: n.clone(),
                    container_id: c.clone(),
                    tenant: e.tenant.clone(),
                    grace_s: tree.grace_period_s(&e.tenant),
                    reason: format!(
                        "already stopping for a reclaim; {claimant}, which asks {r} within its \
                         guarantee on node {node}, waits for it"
                    ),
                    requeue: String::new(),
                });
            }
        }
        if victims.is_empty() || !short.fits_in(&freeing) {
            return None;
        }
        Some(self.hold_for_stopping(node, claimant, req, r, victims, false, now))
    }

    /// Holds `r` on `node` for `claimant`'s claim while `victims`, already stopping, go:
    /// its reclaim, with no other work taken (`shared`: they are another reclaim's, see
    /// [`Reclaim`]). Answers it.
    #[allow(clippy::too_many_arguments)] // the claim, what it waits for, and how
    fn hold_for_stopping(
        &mut self,
        node: &str,
        claimant: &str,
        req: &AdmitRequest,
        r: &Resources,
        victims: Vec<Victim>,
        shared: bool,
        now: u64,
    ) -> AdmitAnswer {
        let claim = claim_of(req);
        let grace = victims.iter().map(|v| v.grace_s).max().unwrap_or(0);
        let retry_after_s = grace.saturating_add(RETRY_SLACK_S);
        let message = format!(
            "reclaiming: waiting for {} of {} already stopping (grace up to {grace} s) to \
             return {claimant} its guarantee; no other work is taken",
            plural(victims.len(), "borrowed container", "borrowed containers"),
            victims
                .iter()
                .map(|v| v.tenant.as_str())
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect::<Vec<_>>()
                .join(", ")
        );
        self.insert_reclaim(
            (node.to_string(), claimant.to_string(), claim),
            Reclaim {
                resources: r.clone(),
                victims: victims.clone(),
                started_ms: now,
                retry_after_s,
                freed_ms: None,
                message: message.clone(),
                shared,
                consolidation: false,
            },
            true,
        );
        self.event(
            now,
            QuotaEventKind::Reclaim,
            Some(claimant),
            Some(node),
            Some(&req.container_id),
            message.clone(),
        );
        AdmitAnswer::Reclaiming {
            retry_after_s,
            victims,
            message: format!("{message}; retry after {retry_after_s} s"),
        }
    }

    /// Releases the borrowed reservations of gangs still assembling, of tenants outside
    /// `claimant`'s subtree, that hold what `short` lacks (youngest first, until it is
    /// covered): their members are refused. A reservation is not running work, so it never
    /// keeps a guarantee from its owner. Whether any was released.
    fn yield_gangs(&mut self, claimant: &str, short: &Resources, now: u64) -> bool {
        let mut candidates: Vec<(u64, TenantGang)> = self
            .gangs
            .iter()
            .filter(|(TenantGang(t, _), g)| g.class == Class::Borrowed && !is_within(t, claimant))
            .filter(|(_, g)| short.iter().any(|(res, _)| g.reserved.get(res) > 0))
            .map(|(k, g)| (g.first_ms, k.clone()))
            .collect();
        candidates.sort_by(|a, b| b.cmp(a));
        let mut left = short.clone();
        let mut any = false;
        for (_, key) in candidates {
            if left.is_empty() {
                break;
            }
            let Some(g) = self.remove_gang(&key) else { continue };
            left.sub(&g.reserved);
            any = true;
            let message = format!(
                "gang {}/{}: its borrowed reservation of {} ({} of {} members arrived) is \
                 released for {claimant}, which asks within its guarantee; a gang is admitted \
                 whole or not at all",
                key.0,
                untrusted(&key.1),
                g.reserved,
                g.members.len(),
                g.size
            );
            for m in &g.members {
                self.keep_outcome(
                    NodeContainer(m.node.clone(), m.container.clone()),
                    Outcome {
                        answer: AdmitAnswer::Refused { message: message.clone(), rule: None },
                        tenant: key.0.clone(),
                        resources: m.resources.clone(),
                        expires_ms: now.saturating_add(OUTCOME_KEPT_MS),
                    },
                );
            }
            self.event(now, QuotaEventKind::Refuse, Some(&key.0), None, None, message);
        }
        any
    }

    /// Refuses for capacity and keeps the request in the fair queue.
    #[allow(clippy::too_many_arguments)] // the admission's context, as `admit_placed` has it
    fn queue(
        &mut self,
        tree: &QuotaTree,
        node: &str,
        req: &AdmitRequest,
        r: &Resources,
        fleet_short: Option<&Resources>,
        why: Option<String>,
        now: u64,
    ) -> AdmitAnswer {
        let key = NodeContainer(node.to_string(), req.container_id.clone());
        let mut what = match fleet_short {
            Some(s) => format!("no capacity in the fleet's books for {r} (short of {s})"),
            None => format!("no capacity on node {node} for {r}"),
        };
        if let Some(why) = why {
            what = format!("{what}; {why}");
        }
        let places =
            totals::on_node(&self.waiting, node).filter(|(_, w)| w.tenant == req.tenant).count();
        if places >= MAX_WAITING_PER_TENANT && !self.waiting.contains_key(&key) {
            let message = format!(
                "{what}: not queued: tenant {} has {places} requests waiting on node {node} \
                 already (at most {MAX_WAITING_PER_TENANT}); retry",
                req.tenant
            );
            return AdmitAnswer::Refused { message, rule: None };
        }
        match self.waiting.get(&key) {
            None => self.changes.waiting(&key, true),
            // Its last ask is stored to the step: once it moves a step, lazily.
            Some(w) if state::coarse(w.last_seen_ms) != state::coarse(now) => {
                self.changes.waiting(&key, false)
            }
            Some(_) => {}
        }
        let relearned = self.settling(now);
        let entry = self.waiting.entry(key).or_insert_with(|| WaitEntry {
            tenant: req.tenant.clone(),
            claim: claim_of(req),
            resources: r.clone(),
            arrived_ms: now,
            last_seen_ms: now,
            why: String::new(),
            relearned,
        });
        entry.last_seen_ms = now;
        entry.why.clone_from(&what);
        self.expires_at(state::counted(now).saturating_add(WAITING_TTL_MS));
        let entry = &self.waiting[&NodeContainer(node.to_string(), req.container_id.clone())];
        let since = entry.arrived_ms;
        let here: Vec<(&NodeContainer, &WaitEntry)> =
            totals::on_node(&self.waiting, node).collect();
        let list: Vec<Waiting> = here
            .iter()
            .map(|(NodeContainer(_, c), w)| Waiting {
                id: c.clone(),
                tenant: w.tenant.clone(),
                resources: w.resources.clone(),
                arrived: w.arrived_ms,
            })
            .collect();
        let order = fair_order(tree, &self.capacity(), &self.real_usage(), &list);
        let position = order
            .iter()
            .position(|&i| list[i].id == req.container_id)
            .map_or(list.len(), |p| p + 1);
        let message = format!(
            "{what}: waiting in the fair queue since {} (position {position} of {}); retry",
            tessera_api::time::format_utc(since),
            list.len()
        );
        self.refuse(now, &req.tenant, node, &req.container_id, message, None)
    }

    /// Whether another request waiting on `node` (another tenant's, or a larger one of
    /// `tenant`'s own: [`fair_order`]) ranks ahead of `tenant`'s `container` and would be
    /// denied by this grant: the message that says so. `making_room`: the grant is a
    /// consolidation's, which makes room on the node by moving work off it; every request
    /// ahead that the node could hold is denied the room made, a larger one too (a smaller
    /// request may take free room a larger one cannot use, not room made for it).
    #[allow(clippy::too_many_arguments)]
    fn fair_queue_blocks(
        &self,
        tree: &QuotaTree,
        node: &str,
        tenant: &str,
        container: &str,
        r: &Resources,
        now: u64,
        making_room: bool,
    ) -> Option<String> {
        let own = self.own_entry(node, container, tenant, r);
        // One that could never run ranks nothing (re-asked for ever, it would win every
        // tie by its age: the simulator refuses it at arrival).
        let others: Vec<(&NodeContainer, &WaitEntry)> = totals::on_node(&self.waiting, node)
            .filter(|(k, _)| **k != own)
            .filter(|(_, w)| now <= state::counted(w.last_seen_ms).saturating_add(WAITING_TTL_MS))
            .filter(|(_, w)| self.could_ever_run(tree, &w.tenant, &w.resources))
            .collect();
        if others.is_empty() {
            return None;
        }
        let mut list: Vec<Waiting> = others
            .iter()
            .map(|(NodeContainer(_, c), w)| Waiting {
                id: c.clone(),
                tenant: w.tenant.clone(),
                resources: w.resources.clone(),
                arrived: w.arrived_ms,
            })
            .collect();
        let me = list.len();
        list.push(Waiting {
            id: String::new(),
            tenant: tenant.to_string(),
            resources: r.clone(),
            arrived: self.waiting.get(&own).map_or(now, |w| w.arrived_ms),
        });
        let cap = self.capacity();
        let usage = self.real_usage();
        let node_cap = self.nodes.get(node).map(|n| n.capacity.clone()).unwrap_or_default();
        let relevant = |x: &Resources| x.bounded_by(&node_cap);
        let free = relevant(&self.node_free(node));
        let after = free.minus(r);
        for i in fair_order(tree, &cap, &usage, &list) {
            if i == me {
                return None;
            }
            let w = &list[i];
            let need = relevant(&w.resources);
            let denied = if making_room {
                need.fits_in(&node_cap)
            } else {
                need.fits_in(&free) || need.fits_in(r)
            };
            if need.fits_in(&after) || !denied {
                continue;
            }
            // Kept only for a request the quotas would let take it (or reclaim for it):
            // one they hold back (a lending limit, a ceiling) could not use it, and its
            // tenant re-asking would keep the node's capacity idle for as long as it likes.
            // The simulator passes over such a head too.
            let decision = self.decide(tree, node, &w.tenant, &w.resources, true);
            if matches!(decision, Decision::Wait { .. } | Decision::Refuse(_)) {
                continue;
            }
            // Nor for borrowed work in its requeue backoff (`in_backoff` refuses it the room
            // wherever it fits): the simulator passes over it too.
            let claim = TenantClaim(w.tenant.clone(), others[i].1.claim.clone());
            let backoff = self.requeues.get(&claim).is_some_and(|q| q.backs_off(now));
            if backoff && matches!(decision, Decision::Admit { class: Class::Borrowed, .. }) {
                continue;
            }
            let (hw, ht) = (
                guarantee_headroom(tree, &cap, &usage, &w.tenant),
                guarantee_headroom(tree, &cap, &usage, tenant),
            );
            let (sw, st) = (
                dominant_share(&usage.of(&w.tenant).total(), &cap),
                dominant_share(&usage.of(tenant).total(), &cap),
            );
            let why = if w.tenant == tenant {
                format!(
                    "it is a larger request of {tenant}'s own (within a tenant's turn its \
                     largest waiting request goes first)"
                )
            } else if hw > ht {
                format!(
                    "it is further below its guarantee ({hw:.2} of the fleet's dominant \
                     resource left, {tenant} {ht:.2})"
                )
            } else if sw < st {
                format!("it holds a lower dominant share ({sw:.2} of the fleet, {tenant} {st:.2})")
            } else {
                format!(
                    "it holds the same dominant share ({sw:.2} of the fleet) and its tenant's \
                     oldest request has waited longer"
                )
            };
            return Some(format!(
                "capacity on node {node} is kept for tenant {}, waiting in the fair queue since \
                 {} for {}: {why}; retry",
                w.tenant,
                tessera_api::time::format_utc(w.arrived),
                w.resources
            ));
        }
        None
    }

    /// A gang member arrives. The first member reserves the whole gang (`size` × its
    /// amounts) or is refused at once; the last one completes it, and then every member is
    /// admitted (each with its class) or, if any would not be, all are refused. The caller
    /// validated `req` (it has a `gang`).
    pub fn gang_arrive(
        &mut self,
        tree: &QuotaTree,
        node: &str,
        req: &AdmitRequest,
        timeout_s: u64,
        now: u64,
    ) -> GangArrival {
        self.observe_tree(tree);
        self.tick(now);
        let key = NodeContainer(node.to_string(), req.container_id.clone());
        let tenant = req.tenant.as_str();
        let r = req.amounts.to_resources();
        if let Some(a) = self.admitted_answer(&key, Some((tenant, &r))) {
            return GangArrival::Answer(a);
        }
        if let Some(o) = self.outcomes.get(&key) {
            let a = other_request(&key, &o.tenant, &o.resources, (tenant, &r));
            return GangArrival::Answer(a.unwrap_or_else(|| o.answer.clone()));
        }
        let Some(g) = &req.gang else {
            return GangArrival::Answer(self.admit(tree, node, req, now));
        };
        let name = format!("{tenant}/{}", untrusted(&g.name));
        let gkey = TenantGang(tenant.to_string(), g.name.clone());
        if let Some((k, deadline_ms, same)) = self.waiting_member(&key, &r) {
            // A retry of a waiting member waits on; another request under its id is refused.
            let size = self.gangs.get(&k).map(|x| x.size);
            return if same && k == gkey && size == Some(g.size) {
                GangArrival::Wait { deadline_ms }
            } else {
                GangArrival::Answer(waits_in_gang(&key, &k))
            };
        }
        let member = GangMember {
            node: node.to_string(),
            container: req.container_id.clone(),
            resources: r.clone(),
            absorb: !req.unsynced_lease_grants,
            checkpoint: req.checkpoint,
            workload: req.workload.clone(),
        };
        if let Some(gang) = self.gangs.get_mut(&gkey) {
            let refused =
                |message: String| GangArrival::Answer(AdmitAnswer::Refused { message, rule: None });
            if gang.size != g.size {
                return refused(format!(
                    "gang {name} has {} members (tessera.io/gang-size of its first member); \
                     container {} says {}: every member must name the same size",
                    gang.size,
                    untrusted(&req.container_id),
                    g.size
                ));
            }
            if gang.members.len() >= gang.size as usize {
                return refused(format!(
                    "gang {name} already has all its {} members; container {} is one too many",
                    gang.size,
                    untrusted(&req.container_id)
                ));
            }
            gang.members.push(member);
            if gang.members.len() < gang.size as usize {
                return GangArrival::Wait { deadline_ms: gang.deadline_ms() };
            }
            self.complete_gang(tree, &gkey, now);
            return match self.outcomes.get(&key) {
                Some(o) => GangArrival::Answer(o.answer.clone()),
                None => GangArrival::Answer(AdmitAnswer::Refused {
                    message: format!("gang {name}: completed without an answer for this member"),
                    rule: None,
                }),
            };
        }
        let whole = times(&r, g.size);
        let class = if tree.iter().next().is_none() {
            Class::Guaranteed
        } else {
            match self.decide(tree, node, tenant, &whole, !req.unsynced_lease_grants) {
                Decision::Admit { class, .. } => class,
                Decision::Refuse(c) => {
                    let message = format!("gang {name} of {} members: {c}", g.size);
                    let ceiling = rule(&c.path, &c.resource, "ceiling");
                    return GangArrival::Answer(self.refuse(
                        now,
                        tenant,
                        node,
                        &req.container_id,
                        message,
                        Some(ceiling),
                    ));
                }
                Decision::Reclaim { short, .. } | Decision::Wait { short, .. } => {
                    let message = format!(
                        "gang {name}: its {} members need {whole}, which the fleet cannot hold \
                         now (short of {short}); a gang is admitted whole or not at all",
                        g.size
                    );
                    return GangArrival::Answer(self.refuse(
                        now,
                        tenant,
                        node,
                        &req.container_id,
                        message,
                        None,
                    ));
                }
            }
        };
        self.insert_gang(
            gkey.clone(),
            Gang {
                size: g.size,
                reserved: whole,
                class,
                first_ms: now,
                timeout_s,
                members: vec![member],
            },
        );
        if g.size <= 1 {
            self.complete_gang(tree, &gkey, now);
            if let Some(o) = self.outcomes.get(&key) {
                return GangArrival::Answer(o.answer.clone());
            }
        }
        GangArrival::Wait { deadline_ms: now.saturating_add(timeout_s.saturating_mul(1000)) }
    }

    /// Every member is here: release the reservation and admit them one by one; if one
    /// would not be admitted, none is.
    fn complete_gang(&mut self, tree: &QuotaTree, gkey: &TenantGang, now: u64) {
        let Some(gang) = self.remove_gang(gkey) else { return };
        let TenantGang(tenant, gname) = gkey;
        let name = format!("{tenant}/{}", untrusted(gname));
        let mut admitted: Vec<(NodeContainer, Class, Option<String>)> = Vec::new();
        let mut failure = None;
        for m in &gang.members {
            // Devices held on its node for another tenant's claim are not its to take
            // ([`Books::takes_held_room`]), as for a request alone.
            if self.takes_held_room(&m.node, tenant, &m.resources, None) {
                failure = Some((
                    m,
                    format!(
                        "its node's free devices are held for another tenant's reclaim \
                         (no room for {})",
                        m.resources
                    ),
                    None,
                ));
                break;
            }
            let d = if tree.iter().next().is_none() {
                Decision::Admit { class: Class::Guaranteed, over: None }
            } else {
                self.decide(tree, &m.node, tenant, &m.resources, m.absorb)
            };
            match d {
                Decision::Admit { class, over } => {
                    let over = over.map(|(p, res)| rule(&p, &res, "guarantee"));
                    self.record(
                        &m.node,
                        &m.container,
                        tenant,
                        &m.resources,
                        class,
                        over.clone(),
                        Meta {
                            gang: Some(gname.clone()),
                            checkpoint: m.checkpoint,
                            workload: m.workload.clone(),
                        },
                        now,
                    );
                    admitted.push((
                        NodeContainer(m.node.clone(), m.container.clone()),
                        class,
                        over,
                    ));
                }
                Decision::Refuse(c) => {
                    failure = Some((m, c.to_string(), Some(rule(&c.path, &c.resource, "ceiling"))));
                    break;
                }
                Decision::Reclaim { short, .. } | Decision::Wait { short, .. } => {
                    failure = Some((
                        m,
                        format!("no capacity for {} (short of {short})", m.resources),
                        None,
                    ));
                    break;
                }
            }
        }
        let expires_ms = now.saturating_add(OUTCOME_KEPT_MS);
        if let Some((m, why, rule)) = failure {
            for (k, _, _) in &admitted {
                self.remove_pending(k);
            }
            let message = format!(
                "gang {name}: all {} members arrived, but member {} on node {} would not be \
                 admitted: {why}; a gang is admitted whole or not at all",
                gang.size,
                untrusted(&m.container),
                m.node
            );
            for m in &gang.members {
                self.keep_outcome(
                    NodeContainer(m.node.clone(), m.container.clone()),
                    Outcome {
                        answer: AdmitAnswer::Refused {
                            message: message.clone(),
                            rule: rule.clone(),
                        },
                        tenant: tenant.clone(),
                        resources: m.resources.clone(),
                        expires_ms,
                    },
                );
            }
            self.event(now, QuotaEventKind::Refuse, Some(tenant), None, None, message);
            return;
        }
        let nodes: BTreeSet<&str> = gang.members.iter().map(|m| m.node.as_str()).collect();
        let borrowed = admitted.iter().filter(|(_, c, _)| *c == Class::Borrowed).count();
        for (m, (k, class, over)) in gang.members.iter().zip(admitted) {
            self.keep_outcome(
                k,
                Outcome {
                    answer: AdmitAnswer::Admitted { class: class.into(), over },
                    tenant: tenant.clone(),
                    resources: m.resources.clone(),
                    expires_ms,
                },
            );
        }
        self.event(
            now,
            QuotaEventKind::GangAdmitted,
            Some(tenant),
            None,
            None,
            format!(
                "gang {name}: all {} members admitted on {} ({} borrowed), {} s after the first \
                 arrived",
                gang.size,
                plural(nodes.len(), "node", "nodes"),
                borrowed,
                now.saturating_sub(gang.first_ms) / 1000
            ),
        );
    }

    /// The gang `key` (`(node, container)`) waits in as a member, its deadline, and
    /// whether the member asked for `r`.
    fn waiting_member(
        &self,
        key: &NodeContainer,
        r: &Resources,
    ) -> Option<(TenantGang, u64, bool)> {
        self.gangs.iter().find_map(|(k, g)| {
            let m = g.members.iter().find(|m| m.node == key.0 && m.container == key.1)?;
            Some((k.clone(), g.deadline_ms(), &m.resources == r))
        })
    }

    /// The answer of a gang member that waits: `None` while its gang assembles.
    pub fn gang_poll(&mut self, node: &str, container: &str, now: u64) -> Option<AdmitAnswer> {
        self.tick(now);
        let key = NodeContainer(node.to_string(), container.to_string());
        if let Some(a) = self.admitted_answer(&key, None) {
            return Some(a);
        }
        if let Some(o) = self.outcomes.get(&key) {
            return Some(o.answer.clone());
        }
        let waiting = self
            .gangs
            .values()
            .any(|g| g.members.iter().any(|m| m.node == node && m.container == container));
        if waiting {
            None
        } else {
            Some(AdmitAnswer::Refused {
                message: format!(
                    "container {} on node {node} no longer waits in a gang (released)",
                    untrusted(container)
                ),
                rule: None,
            })
        }
    }

    /// The grant of `req.container_id` on `node` counts `req.amounts` from now on (its
    /// container's CPU or memory limit changed: `runc update`, Kubernetes' in-place resize).
    ///
    /// A resize that raises any amount is decided as a new request of the new amounts with
    /// the grant's old amounts given back first (the same two-pass decision as
    /// [`Books::admit`], phantoms and ceilings included): admitted with the class that
    /// decision gives (work that grows beyond its guarantee runs borrowed from now on), or
    /// refused at a ceiling naming it, or refused when the fleet has no free capacity for
    /// the raise (a resize never reclaims, never queues). A resize that raises nothing is
    /// recorded at once, with the grant's class unchanged. A grant the books do not hold
    /// yet (admitted under a lease, not synced) is counted from now on as an admission.
    /// The caller checked [`Books::ready`] and validated `req`.
    pub fn resize(
        &mut self,
        tree: &QuotaTree,
        node: &str,
        req: &ResizeRequest,
        now: u64,
    ) -> AdmitAnswer {
        self.observe_tree(tree);
        self.tick(now);
        let key = NodeContainer(node.to_string(), req.container_id.clone());
        let tenant = req.tenant.as_str();
        let new = req.amounts.to_resources();
        let (current, over_now) = match self.pending.get(&key) {
            Some(p) => (Some(p.entry.clone()), p.over.clone()),
            None => (
                self.nodes.get(node).and_then(|nb| nb.holdings.get(&req.container_id)).cloned(),
                None,
            ),
        };
        if let Some(e) = &current {
            if e.tenant != tenant {
                return AdmitAnswer::Refused {
                    message: format!(
                        "container {} on node {node} is a grant of {}, not of {}; its resize is \
                         refused",
                        untrusted(&req.container_id).max_chars(128),
                        e.tenant,
                        untrusted(tenant).max_chars(128)
                    ),
                    rule: None,
                };
            }
        }
        let old = current.as_ref().map(|e| e.resources.clone()).unwrap_or_default();
        let grows = new.iter().any(|(r, n)| n > old.get(r));
        let (class, over) = if !grows || tree.iter().next().is_none() {
            (current.as_ref().map_or(Class::Guaranteed, |e| e.class), over_now)
        } else {
            // Decided without the grant's own amounts: they are given back first.
            let taken = self.take_entry(&key);
            let decision = self.decide(tree, node, tenant, &new, !req.unsynced_lease_grants);
            self.put_entry(&key, taken);
            match decision {
                Decision::Admit { class, over } => {
                    (class, over.map(|(p, res)| rule(&p, &res, "guarantee")))
                }
                Decision::Refuse(c) => return self.refuse_ceiling(node, &req.container_id, c, now),
                Decision::Reclaim { short, .. } | Decision::Wait { short, .. } => {
                    let message = format!(
                        "{} for {} (a resize of container {} from {old}) does not fit: the fleet \
                         is short of {short} (a resize reclaims nothing and does not wait); \
                         retry once capacity is free",
                        new,
                        untrusted(tenant).max_chars(128),
                        untrusted(&req.container_id).max_chars(128),
                    );
                    return self.refuse(now, tenant, node, &req.container_id, message, None);
                }
            }
        };
        let entry = Entry {
            tenant: tenant.to_string(),
            resources: new.clone(),
            class,
            started_ms: current.as_ref().map_or(now, |e| e.started_ms),
            gang: current.as_ref().and_then(|e| e.gang.clone()),
            // A resize keeps what the grant said of itself (issue 27's fields).
            checkpoint: current.as_ref().is_some_and(|e| e.checkpoint),
            workload: current.as_ref().and_then(|e| e.workload.clone()),
        };
        let in_holdings =
            self.nodes.get(node).is_some_and(|nb| nb.holdings.contains_key(&req.container_id));
        // Through the running totals and the durable state (issue 28); stored before it is
        // answered, as an admission is.
        if in_holdings {
            self.put_holding(node, &req.container_id, entry.clone());
        } else {
            self.insert_pending(key.clone(), Pending { entry: entry.clone(), over: over.clone() });
        }
        self.changes.mark_urgent();
        self.expires_at(now.saturating_add(PENDING_GRACE_MS));
        self.resized.insert(key, (entry, now));
        if new != old {
            let was = current.as_ref().map_or(Class::Guaranteed, |e| e.class);
            let class_note = match (was, class) {
                (Class::Guaranteed, Class::Borrowed) => format!(
                    "; it runs borrowed from now on (beyond {}), priced at the burst price and \
                     reclaimable",
                    over.as_deref().unwrap_or("its chain's guarantees")
                ),
                (Class::Borrowed, Class::Guaranteed) => {
                    "; it runs within its guarantees from now on".to_string()
                }
                _ => String::new(),
            };
            self.event(
                now,
                QuotaEventKind::Resize,
                Some(tenant),
                Some(node),
                Some(&req.container_id),
                format!("resized from {old} to {new}{class_note}"),
            );
        }
        AdmitAnswer::Admitted { class: class.into(), over }
    }

    /// Takes the entry of `key` out of the books (pending or held), for a decision
    /// without it; [`Books::put_entry`] puts it back.
    fn take_entry(&mut self, key: &NodeContainer) -> Option<(Entry, Option<Option<String>>)> {
        if let Some(p) = self.remove_pending(key) {
            return Some((p.entry, Some(p.over)));
        }
        let e = self.nodes.get(&key.0)?.holdings.get(&key.1).cloned()?;
        self.remove_holding(&key.0, &key.1);
        Some((e, None))
    }

    fn put_entry(&mut self, key: &NodeContainer, taken: Option<(Entry, Option<Option<String>>)>) {
        match taken {
            None => {}
            Some((entry, Some(over))) => {
                self.insert_pending(key.clone(), Pending { entry, over });
            }
            Some((entry, None)) => self.put_holding(&key.0, &key.1, entry),
        }
    }

    /// After a sync of `node` replaced its holdings: a grant resized within
    /// [`PENDING_GRACE_MS`] counts the larger of what the node listed and what the resize
    /// recorded, until the node lists the resized amounts (its snapshot may predate the
    /// resize). A resized grant the node no longer lists, and has no pending admission, is
    /// gone.
    fn protect_resized(&mut self, node: &str, now: u64) -> bool {
        let keys: Vec<NodeContainer> =
            totals::on_node(&self.resized, node).map(|(k, _)| k.clone()).collect();
        let mut changed = false;
        for key in keys {
            let Some((entry, at)) = self.resized.get(&key).cloned() else { continue };
            let listed = self.nodes.get(node).and_then(|nb| nb.holdings.get(&key.1)).cloned();
            match listed {
                _ if now.saturating_sub(at) > PENDING_GRACE_MS => {
                    self.resized.remove(&key);
                }
                None => {
                    if !self.pending.contains_key(&key) {
                        self.resized.remove(&key);
                    }
                }
                Some(l) if l.resources == entry.resources && l.class == entry.class => {
                    self.resized.remove(&key);
                }
                Some(l) => {
                    let kept =
                        Entry { resources: max_each(&l.resources, &entry.resources), ..entry };
                    self.put_holding(node, &key.1, Entry { started_ms: l.started_ms, ..kept });
                    changed = true;
                }
            }
        }
        changed
    }

    /// A grant ended (or was never made after an admission): it leaves the books at once.
    /// Whether the books held it.
    pub fn release(&mut self, node: &str, container: &str, now: u64) -> bool {
        self.tick(now);
        let key = NodeContainer(node.to_string(), container.to_string());
        let mut found = self.remove_pending(&key).is_some();
        found |= self.remove_holding(node, container);
        self.resized.remove(&key);
        // A gang's kept answer goes too: the id may come back as another container.
        found |= self.outcomes.remove(&key).is_some();
        found |= self.unwait(&key).is_some();
        for g in self.gangs.values_mut() {
            let before = g.members.len();
            g.members.retain(|m| !(m.node == node && m.container == container));
            found |= g.members.len() != before;
        }
        self.update_reclaims(now);
        found
    }

    /// Victims no longer held end their part of a reclaim.
    fn update_reclaims(&mut self, now: u64) {
        let nodes = &self.nodes;
        let pending = &self.pending;
        let mut freed = Vec::new();
        for (k, r) in self.reclaims.iter_mut() {
            if r.freed_ms.is_some() {
                continue;
            }
            let running = r.victims.iter().any(|v| {
                nodes.get(&v.node).is_some_and(|nb| nb.holdings.contains_key(&v.container_id))
                    || pending.contains_key(&NodeContainer(v.node.clone(), v.container_id.clone()))
            });
            if !running {
                r.freed_ms = Some(now);
                freed.push((k.clone(), r.hold_until()));
            }
        }
        for (k, until) in freed {
            self.changes.reclaim(&k, false);
            self.expires_at(until);
        }
    }

    /// Takes `node` out of the books (`why`: for the event): its capacity, holdings, pending
    /// admissions, holds for claimants there, waiting requests, gang members, leases. Its
    /// victims of reclaims elsewhere count as gone. What was removed, or `None` if the books
    /// did not know it. A node that syncs again comes back as a new one.
    pub fn remove_node(&mut self, node: &str, now: u64, why: &str) -> Option<RemovedNode> {
        let nb = self.nodes.remove(node)?;
        self.silence.remove(&(nb.last_sync_ms, node.to_string()));
        self.stopping_idx.remove(node);
        self.totals.capacity.sub(&nb.capacity);
        let mut held = Resources::new();
        for (c, e) in &nb.holdings {
            held.add(&e.resources);
            self.unindex_holding(node, c, e);
        }
        totals::replace_part(&mut self.totals, node, &nb.agg, &totals::NodeAgg::default());
        self.generation = self.generation.wrapping_add(1);
        let keys: Vec<NodeContainer> =
            totals::on_node(&self.pending, node).map(|(k, _)| k.clone()).collect();
        let pending = keys.len();
        for k in keys {
            self.remove_pending(&k);
        }
        let keys: Vec<ClaimKey> =
            totals::claims_on(&self.reclaims, node).map(|(k, _)| k.clone()).collect();
        for k in keys {
            self.remove_reclaim(&k);
        }
        let keys: Vec<NodeContainer> =
            totals::on_node(&self.waiting, node).map(|(k, _)| k.clone()).collect();
        for k in keys {
            self.unwait(&k);
        }
        let keys: Vec<NodeContainer> =
            totals::on_node(&self.outcomes, node).map(|(k, _)| k.clone()).collect();
        for k in keys {
            self.outcomes.remove(&k);
        }
        let keys: Vec<NodeContainer> =
            totals::on_node(&self.resized, node).map(|(k, _)| k.clone()).collect();
        for k in keys {
            self.resized.remove(&k);
        }
        for g in self.gangs.values_mut() {
            g.members.retain(|m| m.node != node);
        }
        self.update_reclaims(now);
        self.changes.node(node);
        let leases: Vec<String> = nb.booked_leases().into_keys().collect();
        let removed = RemovedNode {
            holdings: nb.holdings.len(),
            pending,
            held: Amounts::from_resources(&held),
            leases: leases.clone(),
            last_sync_ms: nb.last_sync_ms,
        };
        self.event(
            now,
            QuotaEventKind::NodeRemoved,
            None,
            Some(node),
            None,
            format!(
                "node {node} leaves the books: {why}. No longer counted: {} ({held}), {} \
                 admission(s) it had not listed yet{}. If it syncs again, what it lists then is \
                 counted again",
                plural(nb.holdings.len(), "holding", "holdings"),
                pending,
                if leases.is_empty() {
                    String::new()
                } else {
                    format!(", and its leases of {}", leases.join(", "))
                }
            ),
        );
        Some(removed)
    }

    /// A node's sync: its holdings replace the books' view of it (admissions younger than
    /// [`PENDING_GRACE_MS`] that it does not list yet stay), its leases are renewed (and
    /// recomputed when anything changed since they were), and the answer names its
    /// containers a reclaim stops. The caller validated `req`. A sync that changes nothing
    /// costs a comparison of what it lists with what the books hold.
    pub fn sync(
        &mut self,
        tree: &QuotaTree,
        node: &str,
        req: &SyncRequest,
        now: u64,
    ) -> SyncAnswer {
        self.observe_tree(tree);
        if let Some(nb) = self.nodes.get_mut(node) {
            // Heard from now: not silent.
            self.silence.remove(&(nb.last_sync_ms, node.to_string()));
            nb.last_sync_ms = now;
            nb.heard = true;
            self.silence.insert((now, node.to_string()));
        }
        self.tick(now);
        let first = !self.nodes.contains_key(node);
        let reported: BTreeMap<String, Resources> = req
            .leases
            .iter()
            .filter(|l| {
                tree.get(&l.path).is_some_and(|q| q.limits.values().any(|x| x.guarantee.is_some()))
            })
            .map(|l| (l.path.clone(), l.amounts.to_resources()))
            .collect();
        let capacity = req.capacity.to_resources();
        let stopping: BTreeSet<String> = req.stopping.iter().cloned().collect();
        if first {
            self.nodes.insert(
                node.to_string(),
                NodeBook {
                    // Adopted: issued before this coordinator's books started.
                    issued: reported.clone(),
                    last_sync_ms: now,
                    heard: true,
                    ..NodeBook::default()
                },
            );
            self.silence.insert((now, node.to_string()));
            // Its record and what it lists are stored before it is answered: a node the
            // books did not hold (every node while they are rebuilt from the syncs, one
            // back after it left them) may hold work no stored record names, and books
            // taken over without it would count less than it holds.
            self.changes.node(node);
            self.changes.mark_urgent();
        }
        let mut changed = first;
        if let Some(nb) = self.nodes.get_mut(node) {
            if nb.capacity != capacity {
                self.totals.capacity.sub(&nb.capacity);
                self.totals.capacity.add(&capacity);
                nb.capacity = capacity;
                self.generation = self.generation.wrapping_add(1);
                changed = true;
            }
            if nb.reported != reported {
                nb.reported = reported;
                changed = true;
            }
            if nb.stopping != stopping {
                if stopping.is_empty() {
                    self.stopping_idx.remove(node);
                } else {
                    self.stopping_idx.insert(node.to_string());
                }
                nb.stopping = stopping;
                changed = true;
            }
        }
        // What it lists, by container: most syncs list what the books hold already, and
        // that is found without building the books' copy of it.
        let mut listing: Vec<&Holding> = req.holdings.iter().collect();
        listing.sort_unstable_by(|a, b| a.container_id.cmp(&b.container_id));
        let same = self.nodes.get(node).is_some_and(|nb| lists_the_same(&nb.holdings, &listing));
        if !same {
            let listed: BTreeMap<String, Entry> = req
                .holdings
                .iter()
                .map(|h| (h.container_id.clone(), Entry::of_holding(h)))
                .collect();
            changed |= self.set_holdings(node, listed);
        }
        let held = Listed(&listing);
        let gone: Vec<NodeContainer> = totals::on_node(&self.pending, node)
            .filter(|(NodeContainer(_, c), p)| {
                held.contains(c.as_str())
                    || now.saturating_sub(p.entry.started_ms) > PENDING_GRACE_MS
            })
            .map(|(k, _)| k.clone())
            .collect();
        for k in gone {
            self.remove_pending(&k);
        }
        let gone: Vec<NodeContainer> = totals::on_node(&self.waiting, node)
            .filter(|(NodeContainer(_, c), _)| held.contains(c.as_str()))
            .map(|(k, _)| k.clone())
            .collect();
        for k in gone {
            self.unwait(&k);
        }
        changed |= self.protect_resized(node, now);
        if changed {
            self.changes.node(node);
            self.refresh_node(node);
        }
        if !self.reclaims.is_empty() {
            self.update_reclaims(now);
        }
        let generation = self.generation;
        let due = self.nodes.get(node).is_some_and(|nb| {
            nb.computed_ms.is_none_or(|t| {
                now.saturating_sub(t) >= LEASE_RECOMPUTE_MS && nb.computed_gen != generation
            })
        });
        if self.ready && (due || first) {
            let issued = self.issue_leases(tree, node);
            let mut grew = false;
            if let Some(nb) = self.nodes.get_mut(node) {
                grew = nb.issued != issued;
                nb.issued = issued;
                nb.computed_ms = Some(now);
            }
            if grew {
                self.changes.node(node);
                self.refresh_node(node);
            }
            if let Some(nb) = self.nodes.get_mut(node) {
                nb.computed_gen = self.generation;
            }
        }
        let leases = self
            .nodes
            .get(node)
            .map(|nb| {
                nb.issued
                    .iter()
                    .map(|(p, r)| Lease { path: p.clone(), amounts: Amounts::from_resources(r) })
                    .collect()
            })
            .unwrap_or_default();
        let preempt = self
            .reported_victims()
            .filter(|v| v.node == node && held.contains(v.container_id.as_str()))
            .cloned()
            .collect();
        SyncAnswer { leases, lease_ttl_s: self.lease_ttl_s, preempt, authority: None }
    }

    /// `node`'s leases by the rule of the module documentation.
    fn issue_leases(&self, tree: &QuotaTree, node: &str) -> BTreeMap<String, Resources> {
        let fleet_cap = self.capacity();
        let node_cap = self.nodes.get(node).map(|n| n.capacity.clone()).unwrap_or_default();
        // g_n: what the node counts under its leases; all_n: every guaranteed use there.
        let g_n = self.node_leased_base(node);
        let all_n = self.node_guaranteed(node);
        // Booked usage without this node's phantoms (only where a ceiling must be checked),
        // and what the other nodes count for: all their guaranteed use plus their leases'
        // unused part (the totals less this node's part).
        let mut base: Option<Usage> = None;
        let none = BTreeMap::new();
        let own = self.nodes.get(node).map_or(&none, |nb| &nb.agg.contrib);
        let mut new: BTreeMap<String, Resources> = BTreeMap::new();
        for q in tree.iter() {
            let mut l = Resources::new();
            for (res, limit) in &q.limits {
                if limit.guarantee.is_some() {
                    l.set(res, g_n.of(&q.path).guaranteed.get(res));
                }
            }
            if q.limits.values().any(|l| l.guarantee.is_some()) {
                new.insert(q.path.clone(), l);
            }
        }
        for q in tree.iter() {
            for (res, limit) in &q.limits {
                let Some(guarantee) = limit.guarantee else { continue };
                let g = g_n.of(&q.path).guaranteed.get(res);
                let fleet = fleet_cap.get(res);
                let share = if fleet == 0 {
                    0
                } else {
                    let s =
                        u128::from(guarantee) * u128::from(node_cap.get(res)) / u128::from(fleet);
                    totals::whole_units(res, u64::try_from(s).unwrap_or(u64::MAX))
                };
                let of = |m: &BTreeMap<String, Resources>| m.get(&q.path).map_or(0, |r| r.get(res));
                // Every guaranteed use the books count anywhere (listed, pending, held for
                // a claimant, reserved for a gang — on a node the books know or not: after a
                // failover a node may be granted before its first sync) plus every other
                // node's unused lease; less this node's part. Not the sum of the known
                // nodes' contributions, which misses what is on no known node.
                let everywhere = self
                    .totals
                    .real
                    .of(&q.path)
                    .guaranteed
                    .get(res)
                    .saturating_add(of(&self.totals.unused));
                let elsewhere = everywhere.saturating_sub(of(own));
                let all = all_n.of(&q.path).guaranteed.get(res);
                let room = guarantee.saturating_sub(elsewhere).saturating_sub(all);
                let mut lease = if self.recalled.contains_key(&q.path) {
                    // Recalled: nothing spare to admit alone (the guarantee is wanted
                    // elsewhere).
                    g
                } else {
                    g.saturating_add(room).min(g.max(share))
                };
                // No ceiling on the chain may be crossed by the booked usage: cut the lease
                // by the excess (each unit of lease books at most one unit anywhere), and to
                // `g` (nothing to lend on its own) if that is not enough.
                let mut tries = 0;
                while lease > g {
                    let base = base.get_or_insert_with(|| self.booked(tree, Some(node)).0);
                    let excess = self.ceiling_excess(tree, base, &new, &g_n, &q.path, res, lease);
                    if excess == 0 {
                        break;
                    }
                    tries += 1;
                    lease = if tries >= 4 { g } else { lease.saturating_sub(excess).max(g) };
                }
                if let Some(t) = new.get_mut(&q.path) {
                    t.set(res, lease);
                }
            }
        }
        new
    }

    /// By how much the booked usage would cross a ceiling on `path`'s chain if `node`'s
    /// lease of `path` were `lease` of `res` (its other leases as in `leases`).
    #[allow(clippy::too_many_arguments)]
    fn ceiling_excess(
        &self,
        tree: &QuotaTree,
        base: &Usage,
        leases: &BTreeMap<String, Resources>,
        g_n: &Usage,
        path: &str,
        res: &Resource,
        lease: u64,
    ) -> u64 {
        let mut trial = leases.clone();
        if let Some(t) = trial.get_mut(path) {
            t.set(res, lease);
        }
        let ph = phantoms_of(tree, &trial, g_n);
        let mut excess = 0u64;
        for cq in tree.chain(path) {
            let Some(c) = cq.limits.get(res).and_then(|l| l.ceiling) else { continue };
            let mine = ph
                .iter()
                .filter(|(p, _)| is_within(p, &cq.path))
                .map(|(_, r)| r.get(res))
                .fold(0u64, u64::saturating_add);
            let booked = base.of(&cq.path).total().get(res).saturating_add(mine);
            excess = excess.max(booked.saturating_sub(c));
        }
        excess
    }

    /// `GET /v1/quota/status`.
    pub fn status(&mut self, tree: &QuotaTree, policy_version: u64, now: u64) -> QuotaStatus {
        self.observe_tree(tree);
        self.tick(now);
        let capacity = self.capacity();
        let real = &self.totals.real;
        let mut paths = Vec::new();
        for q in tree.iter() {
            let held = real.of(&q.path);
            let share = dominant_share(&held.total(), &capacity);
            for (res, limit) in &q.limits {
                let lent = match limit.guarantee {
                    Some(g) => {
                        let unused = g.saturating_sub(held.guaranteed.get(res));
                        let lendable = limit.lending_limit.map_or(unused, |l| unused.min(l));
                        let outside: u64 = real
                            .tenants()
                            .filter(|(t, _)| !is_within(t, &q.path) && !is_within(&q.path, t))
                            .map(|(_, h)| h.borrowed.get(res))
                            .fold(0, u64::saturating_add);
                        lendable.min(outside)
                    }
                    None => 0,
                };
                let leased = if limit.guarantee.is_some() {
                    self.totals.unused.get(&q.path).map_or(0, |r| r.get(res))
                } else {
                    0
                };
                let waiting = self
                    .waiting
                    .values()
                    .filter(|w| is_within(&w.tenant, &q.path))
                    .map(|w| w.resources.get(res))
                    .fold(0, u64::saturating_add);
                let costs: Vec<&Cost> = self
                    .costs
                    .iter()
                    .filter(|(t, _)| is_within(t, &q.path))
                    .map(|(_, c)| c)
                    .collect();
                let lost = costs
                    .iter()
                    .map(|c| c.lost.get(res).copied().unwrap_or(0))
                    .fold(0u128, u128::saturating_add);
                let sorted = |pick: fn(&Cost) -> &VecDeque<u64>| {
                    let mut w: Vec<u64> =
                        costs.iter().flat_map(|c| pick(c).iter().copied()).collect();
                    w.sort_unstable();
                    w
                };
                let waits = sorted(|c| &c.owner_waits);
                let later = sorted(|c| &c.owed_later_waits);
                let mut why: Vec<String> = Vec::new();
                for w in self.waiting.values().filter(|w| is_within(&w.tenant, &q.path)) {
                    if why.len() < 3 && !w.why.is_empty() && !why.contains(&w.why) {
                        why.push(w.why.clone());
                    }
                }
                paths.push(PathStatus {
                    path: q.path.clone(),
                    resource: res.spec_path(),
                    unit: unit(res).to_string(),
                    guarantee: limit.guarantee,
                    ceiling: limit.ceiling,
                    in_use: held.total().get(res),
                    borrowed: held.borrowed.get(res),
                    lent,
                    leased,
                    waiting,
                    dominant_share: share,
                    lost: u64::try_from(lost).unwrap_or(u64::MAX),
                    preemptions_last_hour: costs.iter().map(|c| c.preempted_ms.len() as u64).sum(),
                    owner_wait_p50_ms: nearest_rank(&waits, 50),
                    owner_wait_p99_ms: nearest_rank(&waits, 99),
                    owed_later_wait_p50_ms: nearest_rank(&later, 50),
                    owed_later_wait_p99_ms: nearest_rank(&later, 99),
                    waiting_why: why,
                });
            }
        }
        let preempting = self
            .reported_victims()
            .filter(|v| {
                self.nodes.get(&v.node).is_some_and(|nb| nb.holdings.contains_key(&v.container_id))
            })
            .cloned()
            .collect();
        QuotaStatus {
            policy_version,
            capacity: Amounts::from_resources(&capacity),
            paths,
            books_ready: self.ready,
            nodes: self.nodes.iter().map(|(n, nb)| (n.clone(), nb.last_sync_ms)).collect(),
            preempting,
            authority: None,
            coordinators: Vec::new(),
            via: None,
            warnings: Vec::new(),
            shape: crate::check_shape(
                tree,
                &self.nodes.values().map(|n| n.capacity.clone()).collect::<Vec<_>>(),
            ),
        }
    }
}

#[path = "books_state.rs"]
pub mod state;
#[cfg(test)]
#[path = "books_tests.rs"]
mod tests;
#[path = "books_totals.rs"]
mod totals;
