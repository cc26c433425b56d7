//! The quota protocol between a node and the coordinator (serde types; `fleet` re-exports
//! them as `fleet::quota_wire`) (docs/QUOTAS.md "The fleet").
//!
//! * `POST /v1/nodes/{node}/quota/admit` ([`AdmitRequest`] → [`AdmitAnswer`]): one GPU
//!   grant asks to count against its tenant's quota paths, fleet-wide. A gang member's call
//!   is held until the whole gang has arrived (or the policy's `gangs.timeout_s`).
//! * `POST /v1/nodes/{node}/quota/release` ([`ReleaseRequest`]): a grant ended (or was
//!   never made after an admission).
//! * `POST /v1/nodes/{node}/quota/resize` ([`ResizeRequest`] → [`AdmitAnswer`], never
//!   `Reclaiming`): a grant's amounts change (`runc update` of its container's CPU or
//!   memory limit). A raise is decided as a new request of the new amounts with the old
//!   ones given back first; a decrease is recorded.
//! * `POST /v1/nodes/{node}/quota/sync` ([`SyncRequest`] → [`SyncAnswer`]): every
//!   [`SYNC_INTERVAL`] the node sends everything it holds (the books follow the nodes:
//!   what a node does not list, after a short grace for admissions still in flight, is
//!   gone) and the leases it holds; the answer renews its leases and names the containers
//!   it must stop for a reclaim.
//! * `GET /v1/quota/status` ([`QuotaStatus`]): the tree, for `tessera quota status`.
//! * `GET /v1/quota/events` ([`QuotaEvent`] list, oldest first): borrows, reclaims,
//!   preemptions, refusals, expired leases, gangs.
//!
//! Amounts travel in the `quota` crate's fixed point: micro-GPUs per catalog model,
//! millicores, MiB.

pub use crate::shape::{ShapeFinding, ShapeKind};
use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How often a node syncs its holdings and leases.
pub const SYNC_INTERVAL: Duration = Duration::from_secs(1);

/// Most holdings one sync may carry (a node holds one per GPU container).
pub const MAX_SYNC_HOLDINGS: usize = 10_000;

/// Resources in the `quota` crate's units.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Amounts {
    /// Catalog model → micro-GPUs (1 GPU = 1,000,000).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub gpus: BTreeMap<String, u64>,
    /// Millicores.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cpu_milli: u64,
    /// MiB.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub memory_mib: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

impl Amounts {
    pub fn to_resources(&self) -> crate::Resources {
        let mut r = crate::Resources::new();
        for (model, micro) in &self.gpus {
            r = r.with(crate::Resource::gpu(model), *micro);
        }
        r.with_cpu_milli(self.cpu_milli).with_memory_mib(self.memory_mib)
    }

    pub fn from_resources(r: &crate::Resources) -> Amounts {
        let mut a = Amounts::default();
        for (res, n) in r.iter() {
            match res {
                crate::Resource::Gpu(model) => {
                    a.gpus.insert(model.clone(), n);
                }
                crate::Resource::Cpu => a.cpu_milli = n,
                crate::Resource::Memory => a.memory_mib = n,
            }
        }
        a
    }

    pub fn is_empty(&self) -> bool {
        self.gpus.values().all(|n| *n == 0) && self.cpu_milli == 0 && self.memory_mib == 0
    }

    /// Whether `r` equals `self.to_resources()`, without building it (a sync compares every
    /// holding it lists with the books' copy).
    pub(crate) fn is_resources(&self, r: &crate::Resources) -> bool {
        // `to_resources` keeps exactly the non-zero amounts, and no `Resources` stores a
        // zero: equal when `r` has as many amounts and each is one of them.
        let wanted = self.gpus.values().filter(|n| **n != 0).count()
            + usize::from(self.cpu_milli != 0)
            + usize::from(self.memory_mib != 0);
        let mut seen = 0usize;
        r.iter().all(|(res, a)| {
            seen += 1;
            match res {
                crate::Resource::Gpu(model) => self.gpus.get(model) == Some(&a),
                crate::Resource::Cpu => self.cpu_milli == a,
                crate::Resource::Memory => self.memory_mib == a,
            }
        }) && seen == wanted
    }
}

/// Whether a grant runs within its tenant's guarantees or on borrowed capacity: the
/// node's grant mark and the protocol share one type.
pub use tessera_api::QuotaClass;

impl From<crate::Class> for QuotaClass {
    fn from(c: crate::Class) -> Self {
        match c {
            crate::Class::Guaranteed => QuotaClass::Guaranteed,
            crate::Class::Borrowed => QuotaClass::Borrowed,
        }
    }
}

impl From<QuotaClass> for crate::Class {
    fn from(c: QuotaClass) -> Self {
        match c {
            QuotaClass::Guaranteed => crate::Class::Guaranteed,
            QuotaClass::Borrowed => crate::Class::Borrowed,
        }
    }
}

/// A container's place in a gang (`tessera.io/gang`, `tessera.io/gang-size`). Gang names
/// are scoped by tenant: two tenants' gangs of one name are two gangs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GangRef {
    pub name: String,
    pub size: u32,
}

/// The most members a gang may have.
pub const MAX_GANG_SIZE: u32 = 1024;

/// `POST /v1/nodes/{node}/quota/admit`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdmitRequest {
    pub container_id: String,
    /// The tenant path the node's policy resolved.
    pub tenant: String,
    pub amounts: Amounts,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gang: Option<GangRef>,
    /// The node could not place the request on its own devices: the capacity there is
    /// held. A request within its tenant's guarantees may then reclaim borrowed work on
    /// this node.
    #[serde(default)]
    pub short_on_node: bool,
    /// `namespace/pod/container` where the container is a pod's, for status and events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<String>,
    /// The container writes a checkpoint when it gets SIGTERM
    /// (`tessera.io/preemption: checkpoint`): a reclaim that stops it loses only its grace
    /// period, so such work is taken before work that would lose more.
    #[serde(default, skip_serializing_if = "is_false")]
    pub checkpoint: bool,
    /// This node holds grants it admitted on its own under its leases that no sync the
    /// coordinator answered has listed yet (it was cut off and has not synced since). The
    /// coordinator then counts the node's whole leases as used: it cannot know how much of
    /// them that work took. Otherwise (the default) the node's own lease absorbs its
    /// guaranteed work.
    #[serde(default, skip_serializing_if = "is_false")]
    pub unsynced_lease_grants: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// The coordinator's answer to an [`AdmitRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "decision", rename_all = "snake_case", deny_unknown_fields)]
pub enum AdmitAnswer {
    /// Counted in the books: the node may grant it.
    Admitted {
        class: QuotaClass,
        /// For borrowed work: the quota path and resource whose guarantee it goes beyond.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        over: Option<String>,
    },
    /// Within the tenant's guarantees, but the capacity is lent out: these containers are
    /// being stopped (SIGTERM, grace, SIGKILL) and what they free is held for the tenant.
    /// The node refuses the create with `message`; a retry after `retry_after_s` is
    /// granted.
    Reclaiming { retry_after_s: u64, victims: Vec<Victim>, message: String },
    /// Not admitted: `message` says why (a ceiling, with its policy path in `rule`; a gang
    /// that did not assemble in time; capacity held for a waiting tenant ahead in the fair
    /// queue).
    Refused {
        message: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rule: Option<String>,
    },
}

/// A container a reclaim stops.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Victim {
    pub node: String,
    pub container_id: String,
    pub tenant: String,
    /// SIGTERM → SIGKILL, from the victim's quota path (`grace_period_s`).
    pub grace_s: u64,
    /// Who reclaimed and why, for the node's event.
    pub reason: String,
    /// What its owner should expect (for the node's event and `tessera status`): a
    /// checkpoint to write within the grace period, and when the work may run again.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub requeue: String,
}

/// `POST /v1/nodes/{node}/quota/release`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseRequest {
    pub container_id: String,
}

/// `POST /v1/nodes/{node}/quota/resize`: the grant of `container_id` counts `amounts` from
/// now on (its container's CPU or memory limit changes: `runc update`, Kubernetes'
/// in-place resize). Answered with [`AdmitAnswer::Admitted`] (with the class the grant
/// runs as from now on) or [`AdmitAnswer::Refused`]; never `Reclaiming` (a resize stops
/// nobody).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResizeRequest {
    pub container_id: String,
    /// The grant's tenant (as recorded; a holding of another tenant is refused).
    pub tenant: String,
    /// Everything the grant counts from now on (its GPUs as before).
    pub amounts: Amounts,
    /// As in [`AdmitRequest::unsynced_lease_grants`].
    #[serde(default, skip_serializing_if = "is_false")]
    pub unsynced_lease_grants: bool,
}

/// One GPU grant a node holds, as the books count it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Holding {
    pub container_id: String,
    pub tenant: String,
    pub amounts: Amounts,
    pub class: QuotaClass,
    /// When the grant was made (ms since the epoch): youngest is reclaimed first.
    pub started_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gang: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<String>,
    /// Admitted by the node alone under its lease while the coordinator was unreachable.
    #[serde(default)]
    pub under_lease: bool,
    /// It writes a checkpoint on SIGTERM (`tessera.io/preemption: checkpoint`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub checkpoint: bool,
}

/// What a node may admit on its own, as guaranteed work of `path`, while it cannot reach
/// the coordinator: its guaranteed holdings under `path` on this node may total up to
/// `amounts`. The coordinator books every lease as used guarantee of `path` until the node
/// returns it, so leases never take a path past its guarantee (nor, guarantees fitting
/// under ceilings, past a ceiling).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Lease {
    pub path: String,
    pub amounts: Amounts,
}

/// `POST /v1/nodes/{node}/quota/sync`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyncRequest {
    /// What the node has: whole GPUs per model (micro-GPUs), CPU, memory.
    pub capacity: Amounts,
    pub holdings: Vec<Holding>,
    /// The leases the node holds now (a coordinator that restarted adopts them).
    pub leases: Vec<Lease>,
    /// Containers the node is stopping for a reclaim (SIGTERM sent, grace running): never
    /// taken again as victims, and a coordinator that took over during their grace period
    /// knows they are on their way out.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stopping: Vec<String>,
    /// The coordinator that answered this node's last sync, and how long ago: a coordinator
    /// that decides sees from it whether another one decides for the same nodes too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_authority: Option<SeenAuthority>,
}

/// Which coordinator decides the fleet's quotas: the one elected through etcd (the others
/// pass quota calls on to it), or a coordinator alone on its own store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Authority {
    /// Its URL as the other coordinators reach it (`--advertise-url`).
    pub url: String,
    /// Its term: the etcd revision its leadership began at, the fencing token of every
    /// write it makes to the books; 0 for a coordinator alone (no election).
    pub term: u64,
    /// Since when it decides (ms since the epoch, its clock).
    pub since_ms: u64,
    /// Which books it keeps: `etcd:ID` (every coordinator on one etcd prefix shares them),
    /// `memory:ID` for a coordinator alone. Two authorities of different books deciding
    /// for one node is split brain.
    #[serde(default)]
    pub scope: String,
}

/// An [`Authority`] as a node last saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SeenAuthority {
    pub url: String,
    pub term: u64,
    #[serde(default)]
    pub scope: String,
    /// How long before this sync the answer naming it came (ms).
    pub age_ms: u64,
}

/// A coordinator taking part in the election of the one that decides quotas.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CoordinatorInfo {
    pub url: String,
    /// Since when it campaigns (ms since the epoch, its clock).
    pub since_ms: u64,
    /// Whether it decides.
    pub leader: bool,
}

/// The answer to a [`SyncRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyncAnswer {
    /// The node's leases from now on (replacing those it held).
    pub leases: Vec<Lease>,
    /// A lease is good for this long after the sync that carried it was *sent* (the node's
    /// clock); the coordinator reuses an unreachable node's leases only after this plus a
    /// margin on its own clock.
    pub lease_ttl_s: u64,
    /// Containers of this node a reclaim stops.
    pub preempt: Vec<Victim>,
    /// The coordinator that decided this answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authority: Option<Authority>,
}

/// One quota path and resource in `GET /v1/quota/status`. Amounts in the resource's fixed
/// point unit (`unit`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PathStatus {
    pub path: String,
    /// `gpus.H100-80GB`, `cpu_cores`, `memory_gib`.
    pub resource: String,
    /// `micro-GPU`, `millicore`, `MiB`.
    pub unit: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guarantee: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ceiling: Option<u64>,
    /// Guaranteed plus borrowed, this path and everything under it.
    pub in_use: u64,
    pub borrowed: u64,
    /// Unused guarantee others hold as borrowed work (at most the lending limit).
    pub lent: u64,
    /// Held by leases on nodes beyond what the nodes use.
    pub leased: u64,
    /// Requests of this path's subtree waiting in the fair queue.
    pub waiting: u64,
    /// The subtree's dominant share of the fleet (DRF), 0..1.
    pub dominant_share: f64,
    /// Work of the subtree lost to preemption since the books started: this resource ×
    /// the seconds its victims had run (for work that checkpoints, its grace period), in
    /// `unit` × seconds.
    #[serde(default)]
    pub lost: u64,
    /// Containers of the subtree preempted in the last hour.
    #[serde(default)]
    pub preemptions_last_hour: u64,
    /// How long the subtree's owed requests (within guarantee counting the tenant's own
    /// requests ahead, [`crate::owed`]) waited from their first ask to admission, over the
    /// last ones kept, ms: the median and the 99th percentile (nearest rank).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_wait_p50_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_wait_p99_ms: Option<u64>,
    /// How long the subtree's requests owed only later (not owed at their first ask: the
    /// tenant's own requests ahead filled its guarantee) waited from when a reclaim
    /// decision first found them owed to admission, over the last ones kept, ms: the median
    /// and the 99th percentile (nearest rank). A request owed later that was admitted
    /// without reaching a reclaim decision (capacity freed first) is not counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owed_later_wait_p50_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owed_later_wait_p99_ms: Option<u64>,
    /// Why the subtree's requests wait (their last answers, up to 3 distinct).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub waiting_why: Vec<String>,
}

/// `GET /v1/quota/status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuotaStatus {
    /// The policy version whose quotas are in force.
    pub policy_version: u64,
    /// The fleet's capacity as the nodes reported it.
    pub capacity: Amounts,
    pub paths: Vec<PathStatus>,
    /// Whether every node known to the store has synced since the coordinator started
    /// (until then admissions are answered 503 and nodes use their leases).
    pub books_ready: bool,
    /// Node → ms since the epoch of its last sync.
    pub nodes: BTreeMap<String, u64>,
    /// Containers being stopped by a reclaim.
    pub preempting: Vec<Victim>,
    /// The coordinator that decides (and answered this status).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authority: Option<Authority>,
    /// Every coordinator in the election (etcd), the one that decides marked.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub coordinators: Vec<CoordinatorInfo>,
    /// The coordinator a follower passed this request on from, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub via: Option<String>,
    /// What an operator should know now: another coordinator deciding for the same nodes
    /// (split brain), a store that does not take the books' writes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    /// What the policy validator says of the quotas on the nodes the books know
    /// ([`crate::check_shape`]): guarantees this fleet's shape cannot honour, and why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shape: Vec<ShapeFinding>,
}

/// What a [`QuotaEvent`] records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum QuotaEventKind {
    /// Work admitted beyond a guarantee (borrowed).
    Borrow,
    /// A reclaim started for a tenant within its guarantee.
    Reclaim,
    /// A container chosen as a reclaim victim.
    Preempt,
    /// A request refused (a ceiling, the fair queue, no capacity, a gang).
    Refuse,
    /// A node silent beyond its lease TTL can admit nothing more under its leases.
    LeaseExpired,
    /// A gang admitted whole.
    GangAdmitted,
    /// A gang that did not assemble within `gangs.timeout_s`: refused, reservation released.
    GangTimeout,
    /// A node left the books: silent past its lease's end, or removed by an operator.
    NodeRemoved,
    /// A grant's amounts changed (its container's CPU or memory limit: `runc update`).
    Resize,
}

impl QuotaEventKind {
    /// The kind as the wire writes it (`lease-expired`).
    pub fn as_str(self) -> &'static str {
        match self {
            QuotaEventKind::Borrow => "borrow",
            QuotaEventKind::Reclaim => "reclaim",
            QuotaEventKind::Preempt => "preempt",
            QuotaEventKind::Refuse => "refuse",
            QuotaEventKind::LeaseExpired => "lease-expired",
            QuotaEventKind::GangAdmitted => "gang-admitted",
            QuotaEventKind::GangTimeout => "gang-timeout",
            QuotaEventKind::NodeRemoved => "node-removed",
            QuotaEventKind::Resize => "resize",
        }
    }
}

/// One quota event (`GET /v1/quota/events`, oldest first): every borrow, reclaim and
/// preemption with its reason, refusals, leases that expired, gangs admitted or timed out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuotaEvent {
    /// When (ms since the epoch, the coordinator's clock).
    pub ts_ms: u64,
    pub kind: QuotaEventKind,
    /// The tenant path concerned (the claimant of a reclaim, the victim's of a preemption).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_id: Option<String>,
    /// Why, in words.
    pub reason: String,
}

/// `DELETE /v1/quota/nodes/{node}` (admin, `tessera quota node-remove`): what left the
/// books with the node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeRemoval {
    pub node: String,
    /// Holdings of its last sync.
    pub holdings: u64,
    /// Admissions it had not listed yet.
    pub pending: u64,
    /// What its holdings held.
    pub held: Amounts,
    /// The quota paths it held leases of.
    pub leases: Vec<String>,
    /// When it last synced (ms since the epoch).
    pub last_sync_ms: u64,
    /// What the operator should know: a node that synced lately is alive, and comes back
    /// at its next sync.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
}
