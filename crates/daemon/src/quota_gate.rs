//! Fleet quotas on the node (docs/QUOTAS.md, "The fleet" and "Leases").
//!
//! Under a policy with a `quotas` section, every GPU grant is admitted by the fleet
//! coordinator against its tenant's quota paths before the node makes it
//! (`POST /v1/nodes/{node}/quota/admit`, [`fleet::quota_wire`]). The node:
//!
//! * computes what the grant counts as ([`gpu_amounts`], the container's limits, its gang
//!   from [`gang_of`]) and asks without holding the node lock ([`QuotaGate::ask`]);
//! * grants admitted work with its class recorded in the allocation
//!   ([`tessera_api::QuotaMark`]): borrowed work is shown as such, recorded as a `borrow`
//!   event and metered at the burst price;
//! * on `Reclaiming`, stops the victims on this node (SIGTERM, the victim's grace period,
//!   SIGKILL: [`crate::node::revoke::stop`]) and holds the devices they free for the
//!   claimant until the retry is due; the create is refused with
//!   [`tessera_api::ErrorCode::Reclaiming`] (503) and the coordinator's "retry after" text.
//!   A stopped victim whose cgroup is empty gives its grant back at once (its engine may
//!   delete the stopped container much later; the claimant is waiting);
//! * tells the coordinator when a grant ends (`quota/release`, best effort), and every
//!   [`fleet::quota_wire::SYNC_INTERVAL`] sends what it holds and the leases it has
//!   (`quota/sync`, [`spawn_sync`]), keeps the leases it gets (also on disk, so a restart
//!   while the coordinator is down still has them) and stops the containers the answer
//!   names — only this node's borrowed grants ([`victims_here`]): a coordinator cannot
//!   stop guaranteed work by naming it;
//! * while the coordinator is unreachable (no connection, a timeout, or a 502/503/504),
//!   admits a request on its own only within guarantees this node's lease covers
//!   ([`lease_admits`]); such grants are guaranteed and marked `under_lease`, and until a
//!   sync has listed them the node's admissions say so (`unsynced_lease_grants`).
//!
//! Without a coordinator (`tesserad` without `--coordinator`) the node is its own fleet:
//! [`Authority::Local`] keeps [`quota::books::Books`] with this node as the only node,
//! synced before each decision and every [`fleet::quota_wire::SYNC_INTERVAL`].
//!
//! Pure decisions ([`gang_of`], [`gpu_amounts`], [`lease_admits`],
//! [`victims_here`]) are tested alone; the gate holds the effects (the coordinator
//! round trips, the lease file, the clock).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::{CoreError, Detail};
use ::fleet::quota_wire::{
    AdmitAnswer, AdmitRequest, Amounts, GangRef, Lease, ResizeRequest, Victim, MAX_GANG_SIZE,
};
use quota::books::{Books, GangArrival};
use quota::{QuotaTree, Resources};
use serde::{Deserialize, Serialize};
use tessera_api::{
    untrusted, Allocation, ContainerLimits, GpuRequest, QuotaClass, GANG_ANNOTATION,
    GANG_SIZE_ANNOTATION, PREEMPTION_ANNOTATION, PREEMPTION_CHECKPOINT,
};
use tracing::{debug, info, warn};

/// How long an admission without a gang may take before the coordinator counts as
/// unreachable.
pub const ADMIT_TIMEOUT: Duration = Duration::from_secs(5);
/// What a gang member waits beyond the policy's gang timeout (the coordinator holds its
/// call until the gang is whole or the timeout passes).
pub const GANG_ADMIT_MARGIN: Duration = Duration::from_secs(10);
/// How long a release or a sync may take.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// A failed sync is tried again after this (a coordinator failing over, or the next
/// leader being elected, answers within a second or two).
pub const SYNC_RETRY: Duration = Duration::from_millis(200);
/// Devices freed by a reclaim stay held for the claimant this long after the retry the
/// coordinator named is due.
pub const HOLD_MARGIN: Duration = Duration::from_secs(30);
/// The longest "retry after" of a reclaim that devices are held for.
pub const MAX_RETRY_AFTER_S: u64 = 3_600;
/// The longest lease lifetime taken from a coordinator.
pub const MAX_LEASE_TTL: Duration = Duration::from_secs(24 * 3600);
/// Where the leases are kept, in the state dir.
pub const LEASE_FILE: &str = "fleet/quota-leases.json";

/// Why a grant's quota ask could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuotaError {
    /// One gang annotation without the other.
    #[error(
        "annotation {present} is set but {missing} is not: a gang member names its gang and the \
         gang's size"
    )]
    GangHalf { present: &'static str, missing: &'static str },
    #[error(
        "annotation {GANG_ANNOTATION} `{}` is not a gang name: expected 1 to 253 characters of \
         [A-Za-z0-9._-], not starting with '.' or '-'",
        untrusted(.0).max_chars(64)
    )]
    GangName(String),
    #[error(
        "annotation {GANG_SIZE_ANNOTATION} `{}` is not a gang size: expected a whole number from 1 to \
         {MAX_GANG_SIZE}",
        untrusted(.0).max_chars(32)
    )]
    GangSize(String),
    #[error(
        "annotation {PREEMPTION_ANNOTATION} `{}` is not understood: the one value is \
         `{PREEMPTION_CHECKPOINT}` (the container writes a checkpoint on SIGTERM, within its \
         grace period)",
        untrusted(.0).max_chars(32)
    )]
    Preemption(String),
    /// The container's limits are out of bounds.
    #[error("{0}")]
    Limits(String),
    /// A quota on the tenant's chain bounds CPU or memory and the container sets no limit
    /// of it: it would count as nothing against that quota.
    #[error(
        "quota path {path} bounds {what} (quotas.{path}.{field}): the container must set a \
         {what} limit ({oci}; in Kubernetes, resources.limits.{k8s}) to be counted against it"
    )]
    Unlimited {
        path: String,
        what: &'static str,
        field: &'static str,
        oci: &'static str,
        k8s: &'static str,
    },
    /// Another quota guarantees CPU or memory, nothing on the tenant's chain bounds it, and
    /// the container sets no limit of it: unlimited, what it takes would come out of that
    /// guarantee uncounted.
    #[error(
        "quota path {path} guarantees {what} (quotas.{path}.{field}): the container must set a \
         {what} limit ({oci}; in Kubernetes, resources.limits.{k8s}) so that what it takes is \
         counted (as borrowed: nothing on its tenant's chain bounds {what})"
    )]
    UnlimitedGuaranteed {
        path: String,
        what: &'static str,
        field: &'static str,
        oci: &'static str,
        k8s: &'static str,
    },
    /// What a share of a GPU counts as could not be computed.
    #[error("cannot count {request} on {model} against quotas: its fraction {fraction} is not in [0, 1]")]
    Fraction { request: String, model: String, fraction: String },
}

/// The gang a container belongs to, from its annotations: both [`GANG_ANNOTATION`] (a
/// name by [`fleet::validate_name`]'s rule) and [`GANG_SIZE_ANNOTATION`] (1 to
/// [`MAX_GANG_SIZE`]), or neither.
pub fn gang_of(annotations: &BTreeMap<String, String>) -> Result<Option<GangRef>, QuotaError> {
    let name = annotations.get(GANG_ANNOTATION);
    let size = annotations.get(GANG_SIZE_ANNOTATION);
    let (name, size) = match (name, size) {
        (None, None) => return Ok(None),
        (Some(_), None) => {
            return Err(QuotaError::GangHalf {
                present: GANG_ANNOTATION,
                missing: GANG_SIZE_ANNOTATION,
            })
        }
        (None, Some(_)) => {
            return Err(QuotaError::GangHalf {
                present: GANG_SIZE_ANNOTATION,
                missing: GANG_ANNOTATION,
            })
        }
        (Some(n), Some(s)) => (n, s),
    };
    ::fleet::validate_name("gang", name).map_err(|_| QuotaError::GangName(name.clone()))?;
    let digits = !size.is_empty() && size.len() <= 10 && size.bytes().all(|b| b.is_ascii_digit());
    let n = digits.then(|| size.parse::<u32>().ok()).flatten();
    match n {
        Some(n) if (1..=MAX_GANG_SIZE).contains(&n) => {
            Ok(Some(GangRef { name: name.clone(), size: n }))
        }
        _ => Err(QuotaError::GangSize(size.clone())),
    }
}

/// Whether a container says it writes a checkpoint on SIGTERM: [`PREEMPTION_ANNOTATION`]
/// set to [`PREEMPTION_CHECKPOINT`]; absent: no; any other value is refused, so a typo
/// never silently loses a checkpoint.
pub fn checkpoints(annotations: &BTreeMap<String, String>) -> Result<bool, QuotaError> {
    match annotations.get(PREEMPTION_ANNOTATION) {
        None => Ok(false),
        Some(v) if v == PREEMPTION_CHECKPOINT => Ok(true),
        Some(v) => Err(QuotaError::Preemption(v.clone())),
    }
}

/// What a GPU grant counts as: for each device it holds (`models`, one entry per device:
/// `gpu=N` holds N), the fraction of a GPU metering charges for it without the policy's
/// billing weights (a whole GPU 1, a MIG instance its compute slices / 7 or the policy's
/// `mig_weights` for its profile — what the ledger bills —, `mps=P` P / 100, a time-sliced
/// replica 1 / `replicas`), floored to a micro-GPU ([`quota::gpu_micro`]), summed per
/// catalog model.
pub fn gpu_amounts(
    request: &GpuRequest,
    models: &[&str],
    replicas: u32,
    mig_weight: Option<f64>,
) -> Result<BTreeMap<String, u64>, QuotaError> {
    let mut out: BTreeMap<String, u64> = BTreeMap::new();
    for model in models {
        let (slices, mps, reps) = match request {
            GpuRequest::Gpu { .. } => (None, None, None),
            GpuRequest::Mig { profile } => (
                slicer::model(model).and_then(|m| m.profile(profile)).map(|p| p.compute_slices),
                None,
                None,
            ),
            GpuRequest::Mps { percent } => (None, Some(*percent), None),
            GpuRequest::Shared => (None, None, Some(replicas)),
        };
        // The fraction metering bills, the policy's weight of a MIG profile included.
        let weight = mig_weight.filter(|_| matches!(request, GpuRequest::Mig { .. }));
        let f = metering::fraction(request.isolation(), slices, mps, reps, weight);
        let micro = quota::gpu_micro(f).ok_or_else(|| QuotaError::Fraction {
            request: request.to_string(),
            model: untrusted(model).to_string(),
            fraction: f.to_string(),
        })?;
        let slot = out.entry((*model).to_string()).or_insert(0);
        *slot = slot.saturating_add(micro);
    }
    Ok(out)
}

/// The container limits of a request, checked against their bounds.
pub fn checked_limits(limits: Option<&ContainerLimits>) -> Result<ContainerLimits, QuotaError> {
    let l = limits.copied().unwrap_or_default();
    l.validate().map_err(QuotaError::Limits)?;
    Ok(l)
}

/// Refuses a container without a CPU (memory) limit when a quota on `tenant`'s chain
/// bounds CPU (memory): unlimited, it would count as nothing and slip under the ceiling;
/// and where nothing on the chain bounds it but another quota guarantees it: unlimited, it
/// would take that guarantee's capacity uncounted (`quota::admit` counts a limited one as
/// borrowed, so a reclaim can take it back).
pub fn require_limits(
    tree: &QuotaTree,
    tenant: &str,
    limits: &ContainerLimits,
) -> Result<(), QuotaError> {
    let checks = [
        (
            quota::Resource::Cpu,
            limits.cpu_milli,
            "CPU",
            "cpu_cores",
            "linux.resources.cpu.quota and .period",
            "cpu",
        ),
        (
            quota::Resource::Memory,
            limits.memory_mib,
            "memory",
            "memory_gib",
            "linux.resources.memory.limit",
            "memory",
        ),
    ];
    for (resource, set, what, field, oci, k8s) in checks {
        if set.is_some_and(|n| n > 0) {
            continue;
        }
        if let Some(q) = tree.chain(tenant).find(|q| q.limits.contains_key(&resource)) {
            return Err(QuotaError::Unlimited { path: q.path.clone(), what, field, oci, k8s });
        }
        if let Some(q) = tree.guarantor(&resource) {
            return Err(QuotaError::UnlimitedGuaranteed {
                path: q.path.clone(),
                what,
                field,
                oci,
                k8s,
            });
        }
    }
    Ok(())
}

/// The wire amounts of a grant.
pub fn amounts(gpus: &BTreeMap<String, u64>, limits: &ContainerLimits) -> Amounts {
    Amounts {
        gpus: gpus.iter().filter(|(_, n)| **n > 0).map(|(m, n)| (m.clone(), *n)).collect(),
        cpu_milli: limits.cpu_milli.unwrap_or(0),
        memory_mib: limits.memory_mib.unwrap_or(0),
    }
}

/// What a marked grant counts as.
pub fn mark_amounts(mark: &tessera_api::QuotaMark) -> Amounts {
    Amounts { gpus: mark.gpus.clone(), cpu_milli: mark.cpu_milli, memory_mib: mark.memory_mib }
}

/// The leases a node holds, as [`lease_admits`] sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeldLeases<'a> {
    /// None was ever received (or the last one was lost).
    None,
    /// They expired `ago_s` seconds ago.
    Expired { ago_s: u64 },
    /// In force.
    Valid(&'a [Lease]),
}

/// Whether this node may admit `request` of `tenant` on its own, while the coordinator is
/// unreachable: every quota on the tenant's chain that bounds a requested resource must
/// set a guarantee of it (a ceiling alone can only be checked against the whole fleet's
/// books), this node must hold a lease in force for that quota's path, and the lease must
/// cover this node's guaranteed holdings within the path (`guaranteed_here`: tenant →
/// what it holds as guaranteed work on this node) plus the request. At least one quota must
/// bound what is asked (work no quota guarantees is borrowed, which only the coordinator
/// admits). The error says why not, naming the path and the amounts.
pub fn lease_admits(
    tree: &QuotaTree,
    tenant: &str,
    request: &Resources,
    leases: HeldLeases<'_>,
    guaranteed_here: &[(String, Resources)],
) -> Result<(), String> {
    let leases = match leases {
        HeldLeases::None => return Err("this node holds no lease".into()),
        HeldLeases::Expired { ago_s } => {
            return Err(format!("this node's leases expired {ago_s} s ago"))
        }
        HeldLeases::Valid(l) => l,
    };
    let quoted = tree.chain(tenant).next().is_some();
    let mut bounded = false;
    for (resource, amount) in request.iter() {
        let mut bounds_it = false;
        for q in tree.chain(tenant) {
            let Some(limit) = q.limits.get(resource) else { continue };
            bounds_it = true;
            if limit.guarantee.is_none() {
                return Err(format!(
                    "quota path {} bounds {resource} with a ceiling and no guarantee \
                     (quotas.{}.{}): only the coordinator can check a ceiling",
                    q.path,
                    q.path,
                    resource.spec_path()
                ));
            }
            let Some(lease) = leases.iter().find(|l| l.path == q.path) else {
                return Err(format!(
                    "this node holds no lease for quota path {} ({resource})",
                    q.path
                ));
            };
            let leased = lease.amounts.to_resources().get(resource);
            let here: u64 = guaranteed_here
                .iter()
                .filter(|(t, _)| quota::is_within(t, &q.path))
                .fold(0u64, |acc, (_, r)| acc.saturating_add(r.get(resource)));
            if here.saturating_add(amount) > leased {
                return Err(format!(
                    "quota path {}: this node's lease covers {}, guaranteed work within it holds {} here \
                     (with what this node has asked the coordinator for and not settled), \
                     and the request needs {} more",
                    q.path,
                    resource.show(leased),
                    resource.show(here),
                    resource.show(amount)
                ));
            }
        }
        bounded |= bounds_it;
        if amount > 0 && quoted && !bounds_it {
            // Nothing on the chain bounds it: where another quota guarantees it, what this
            // tenant takes of it is that guarantee's, lent, so the work is borrowed
            // (`quota::admit`), which only the coordinator admits.
            if let Some(q) = tree.guarantor(resource) {
                return Err(format!(
                    "quota path {} guarantees {resource} (quotas.{}.{}) and nothing on tenant \
                     {tenant}'s chain bounds it: such work is borrowed, which only the \
                     coordinator admits",
                    q.path,
                    q.path,
                    resource.spec_path()
                ));
            }
        }
    }
    if !bounded {
        return Err(format!(
            "no quota on tenant {tenant}'s chain guarantees what it asks ({request}): such work is \
             borrowed, which only the coordinator admits"
        ));
    }
    Ok(())
}

/// Why a victim a coordinator named is not stopped here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotStopped {
    /// It names another node.
    OtherNode,
    /// This node holds no grant for it.
    NoGrant,
    /// The grant is not borrowed work (guaranteed, or made without quotas): never stopped
    /// for a reclaim.
    NotBorrowed,
    /// The grant's tenant is not the one the victim names.
    OtherTenant { recorded: String },
    /// A stop of it is already under way.
    AlreadyStopping,
}

/// What [`victims_here`] decided.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct VictimsHere {
    /// Stop these, with their grants.
    pub stop: Vec<(Victim, Allocation)>,
    /// Leave these alone, and why.
    pub skip: Vec<(Victim, NotStopped)>,
}

/// Which of `victims` this node stops: only its own grants (`node`), recorded as
/// borrowed, of the tenant the victim names, and not being stopped already. The others
/// come back with the reason.
pub fn victims_here(
    node: &str,
    victims: &[Victim],
    allocations: &[Allocation],
    stopping: &BTreeSet<String>,
) -> VictimsHere {
    let mut stop = Vec::new();
    let mut skip = Vec::new();
    let mut seen = BTreeSet::new();
    for v in victims {
        let a = allocations.iter().find(|a| a.container_id == v.container_id);
        let why = if v.node != node {
            Some(NotStopped::OtherNode)
        } else if stopping.contains(&v.container_id) || seen.contains(&v.container_id) {
            Some(NotStopped::AlreadyStopping)
        } else {
            match a {
                None => Some(NotStopped::NoGrant),
                Some(a) if a.quota.as_ref().map(|m| m.class) != Some(QuotaClass::Borrowed) => {
                    Some(NotStopped::NotBorrowed)
                }
                Some(a) if a.tenant != v.tenant => {
                    Some(NotStopped::OtherTenant { recorded: a.tenant.to_string() })
                }
                Some(_) => None,
            }
        };
        match (why, a) {
            (None, Some(a)) => {
                seen.insert(v.container_id.clone());
                stop.push((v.clone(), a.clone()));
            }
            (Some(why), _) => skip.push((v.clone(), why)),
            (None, None) => skip.push((v.clone(), NotStopped::NoGrant)),
        }
    }
    VictimsHere { stop, skip }
}

/// The devices a grant holds, as holds name them (a share: its device).
pub fn held_devices(a: &Allocation) -> Vec<String> {
    match &a.share {
        Some(s) => vec![s.device.clone()],
        None => a.devices.iter().map(|d| d.uuid.to_string()).collect(),
    }
}

/// The catalog model a request that cannot be placed here now would most likely get: the
/// model of most of the GPUs that could serve it (`gpu=N`, `mps`, `shared`: GPUs not in
/// MIG mode; `mig=P`: GPUs whose model has profile P), the first by name on a tie. `None`
/// where no GPU of this node could serve it.
pub fn likely_model(inventory: &slicer::Inventory, request: &GpuRequest) -> Option<String> {
    let mut count: BTreeMap<&str, usize> = BTreeMap::new();
    for g in &inventory.gpus {
        let fits = match request {
            GpuRequest::Mig { profile } => {
                slicer::model(&g.model).is_some_and(|m| m.profile(profile).is_some())
            }
            _ => !g.mig_enabled,
        };
        if fits {
            *count.entry(g.model.as_str()).or_default() += 1;
        }
    }
    let best = count.values().copied().max()?;
    count.into_iter().find(|(_, n)| *n == best).map(|(m, _)| m.to_string())
}

/// How many devices a request holds (`gpu=N`: N; else 1).
pub fn device_count(request: &GpuRequest) -> usize {
    match request {
        GpuRequest::Gpu { count } => *count as usize,
        _ => 1,
    }
}

/// The metering class of a marked grant: borrowed work is burst.
pub fn ledger_class(mark: Option<&tessera_api::QuotaMark>) -> metering::Class {
    match mark.map(|m| m.class) {
        Some(QuotaClass::Borrowed) => metering::Class::Burst,
        _ => metering::Class::Guaranteed,
    }
}

// ---------------------------------------------------------------------------------------
// The gate: the coordinator round trips, the leases, the clock.
// ---------------------------------------------------------------------------------------

/// Who keeps the books a node's grants are admitted by.
#[derive(Debug)]
pub enum Authority {
    /// The fleet coordinator(s).
    Coordinator(Link),
    /// No coordinator is configured: this node is its own fleet, with books of its own
    /// ([`quota::books::Books`]) that count only its grants.
    Local { node: String, books: Box<Mutex<Books>> },
}

impl Authority {
    /// This node as its own fleet (`node`: its name).
    pub fn local(node: &str) -> Authority {
        Authority::Local {
            node: node.to_string(),
            books: Box::new(Mutex::new(Books::new(LOCAL_LEASE_TTL_S, tessera_api::time::now_ms()))),
        }
    }
}

/// The lease lifetime of a node's own books (no lease is ever used there: the books are
/// always reachable).
pub const LOCAL_LEASE_TTL_S: u64 = 30;
/// How often a gang member's admission looks whether its gang is whole, in a node's own
/// books.
pub const GANG_POLL: Duration = Duration::from_millis(50);

/// The coordinator(s) of this node, for the quota protocol.
#[derive(Debug, Clone)]
pub struct Link {
    client: ::fleet::client::Client,
    node: String,
}

impl Link {
    /// A link for node `node` through `client` (its URLs, token and TLS).
    pub fn new(client: ::fleet::client::Client, node: String) -> Link {
        Link { client, node }
    }

    /// The node id the link speaks for.
    pub fn node(&self) -> &str {
        &self.node
    }
}

/// What the coordinator said about one grant, as the controller acts on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Counted in the fleet's books.
    Admitted { class: QuotaClass, over: Option<String> },
    /// Borrowed work is being stopped for it; refuse now, a retry is granted.
    Reclaiming { retry_after_s: u64, victims: Vec<Victim>, message: String },
    /// Refused (the coordinator's message; the rule when it names one).
    Refused { message: String, rule: Option<String> },
    /// No answer: the lease decides.
    Unreachable { since_ms: u64, why: String },
    /// The coordinator answered with an error that is not "unavailable".
    Failed { message: String },
}

/// Leases as this node keeps them.
#[derive(Debug, Default)]
struct LeaseBook {
    leases: Vec<Lease>,
    /// When they stop admitting (monotonic); `None`: no lease received.
    expires: Option<Instant>,
    ttl_s: u64,
    /// `sent_ms` of what is on disk.
    written_sent_ms: u64,
    /// Since when (Unix ms) and why the coordinator has not answered; `None`: it did.
    unreachable: Option<(u64, String)>,
    /// The coordinator that decided the last sync answer, and when that answer came.
    authority: Option<(::fleet::quota_wire::Authority, Instant)>,
}

/// The leases as kept on disk: the sync that carried them was sent at `sent_ms` (wall
/// clock); they expire `lease_ttl_s` later.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct LeaseFile {
    leases: Vec<Lease>,
    lease_ttl_s: u64,
    sent_ms: u64,
}

/// The node's side of fleet quotas: who keeps the books (the coordinator, or the node's
/// own), the leases, the stops under way. Created once at start ([`QuotaGate::new`]) and
/// handed to the controller.
#[derive(Debug)]
pub struct QuotaGate {
    authority: Authority,
    handle: tokio::runtime::Handle,
    leases: Mutex<LeaseBook>,
    /// Containers being stopped for a reclaim.
    stopping: Mutex<BTreeSet<String>>,
    lease_path: Option<PathBuf>,
    /// Grants admitted under a lease that no answered sync has listed yet, with when.
    unsynced: Mutex<BTreeMap<String, Instant>>,
    /// Admissions and resizes asked of the coordinator and not yet settled here, by a
    /// sequence number: (container, tenant, amounts asked). The books may count one within
    /// this node's lease (its ask said no lease grant was unsynced), so while it is in
    /// flight a grant under the lease counts it as held ([`QuotaGate::asked_here`]).
    in_flight: Mutex<InFlightAsks>,
    /// Tests: run once while a grant under the lease is being committed (under the node
    /// lock, after its decision), to interleave an ask there.
    #[cfg(test)]
    pub(crate) while_committing: Mutex<Option<fn(&QuotaGate)>>,
}

/// [`QuotaGate`]'s asks in flight.
#[derive(Debug, Default)]
struct InFlightAsks {
    next: u64,
    asks: BTreeMap<u64, (String, String, Resources)>,
}

/// An ask of the coordinator in flight: counted by [`QuotaGate::asked_here`] until dropped
/// (after its answer was acted on: the grant made, or nothing).
#[must_use = "the ask counts as in flight only while this is kept"]
pub struct InFlight<'g> {
    gate: &'g QuotaGate,
    seq: Option<u64>,
}

impl std::fmt::Debug for InFlight<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InFlight").field("seq", &self.seq).finish()
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(seq) = self.seq {
            lock(&self.gate.in_flight).asks.remove(&seq);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Plain data: a panic elsewhere leaves it usable.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl QuotaGate {
    /// A gate for a node whose grants `authority` admits, keeping a coordinator's leases
    /// in `state_dir` (none: in memory only). Reads the leases a previous run kept. Call
    /// from inside the tokio runtime the daemon runs on (the round trips run on it).
    pub fn new(authority: Authority, state_dir: Option<&Path>) -> Arc<QuotaGate> {
        let remote = matches!(authority, Authority::Coordinator(_));
        let lease_path = state_dir.filter(|_| remote).map(|d| d.join(LEASE_FILE));
        let mut book = LeaseBook::default();
        if let Some(p) = &lease_path {
            match load_leases(p) {
                Ok(Some(f)) => {
                    book.expires = restored_expiry(&f, tessera_api::time::now_ms(), Instant::now());
                    if book.expires.is_some() {
                        info!(leases = f.leases.len(), path = %p.display(), "quota leases kept by the last run are in force");
                    }
                    book.ttl_s = f.lease_ttl_s;
                    book.written_sent_ms = f.sent_ms;
                    book.leases = f.leases;
                }
                Ok(None) => {}
                Err(e) => warn!("{e}; starting without quota leases"),
            }
        }
        Arc::new(QuotaGate {
            authority,
            handle: tokio::runtime::Handle::current(),
            leases: Mutex::new(book),
            stopping: Mutex::new(BTreeSet::new()),
            lease_path,
            unsynced: Mutex::new(BTreeMap::new()),
            in_flight: Mutex::new(InFlightAsks::default()),
            #[cfg(test)]
            while_committing: Mutex::new(None),
        })
    }

    /// Whether a coordinator keeps the books (else the node's own do).
    pub fn has_coordinator(&self) -> bool {
        matches!(self.authority, Authority::Coordinator(_))
    }

    /// The node id the books know this node by.
    pub fn node(&self) -> &str {
        match &self.authority {
            Authority::Coordinator(link) => link.node(),
            Authority::Local { node, .. } => node,
        }
    }

    /// A sync of the node's own books (none with a coordinator): the victims they name.
    pub fn sync_local(
        &self,
        req: &::fleet::quota_wire::SyncRequest,
        tree: &QuotaTree,
    ) -> Vec<Victim> {
        let Authority::Local { node, books } = &self.authority else { return Vec::new() };
        let mut b = lock(books);
        let now = tessera_api::time::now_ms();
        let answer = b.sync(tree, node, req, now);
        // Its own books know every node there is once it has synced.
        let _ = b.ready(std::iter::once(node.as_str()), now);
        answer.preempt
    }

    /// Ask the books to admit `req` under `tree` (blocking: call from a blocking thread,
    /// never from an async worker). `gang_timeout_s`: the policy's, for a gang member's
    /// wait.
    ///
    /// Keep the [`InFlight`] until the answer is acted on (the grant made, or not): until
    /// then a grant under this node's lease counts the ask as held.
    pub fn ask(
        &self,
        req: &AdmitRequest,
        tree: &QuotaTree,
        gang_timeout_s: u64,
    ) -> (Verdict, InFlight<'_>) {
        let link = match &self.authority {
            Authority::Coordinator(link) => link,
            Authority::Local { node, books } => {
                let v = verdict(local_admit(books, tree, node, req, gang_timeout_s));
                return (v, InFlight { gate: self, seq: None });
            }
        };
        // Registered before the flag is read ([`QuotaGate::lease_grant_begins`]).
        let in_flight = self.asking(&req.container_id, &req.tenant, &req.amounts);
        let timeout = match &req.gang {
            Some(_) => Duration::from_secs(gang_timeout_s) + GANG_ADMIT_MARGIN,
            None => ADMIT_TIMEOUT,
        };
        // Work this node admitted alone that the coordinator has not seen yet: it counts
        // the node's whole leases as used.
        let req =
            &AdmitRequest { unsynced_lease_grants: self.unsynced_lease_grants(), ..req.clone() };
        let (client, node) = (&link.client, &link.node);
        let r = self.handle.block_on(async move { client.quota_admit(node, req, timeout).await });
        (self.answered(r), in_flight)
    }

    /// Counts an ask of `amounts` for `container_id` of `tenant` as in flight until the
    /// guard is dropped.
    pub fn asking(&self, container_id: &str, tenant: &str, amounts: &Amounts) -> InFlight<'_> {
        let mut f = lock(&self.in_flight);
        let seq = f.next;
        f.next = f.next.wrapping_add(1);
        f.asks.insert(seq, (container_id.to_string(), tenant.to_string(), amounts.to_resources()));
        InFlight { gate: self, seq: Some(seq) }
    }

    /// What this node has asked of the coordinator and not settled, by tenant (any
    /// container but `except`, the one being decided): a grant under the lease counts it
    /// as guaranteed work held here. The books may have counted such an ask within this
    /// node's lease (it said no lease grant was unsynced); a grant under the lease made
    /// while it is in flight, counted without it, would take the lease twice.
    pub fn asked_here(&self, except: &str) -> Vec<(String, Resources)> {
        lock(&self.in_flight)
            .asks
            .values()
            .filter(|(c, _, _)| c != except)
            .map(|(_, t, r)| (t.clone(), r.clone()))
            .collect()
    }

    /// Tell the books a grant ended (or was never made after an admission). To a
    /// coordinator: spawned, best effort (the next sync repairs a miss).
    pub fn release(&self, container_id: &str) {
        let link = match &self.authority {
            Authority::Coordinator(link) => link,
            Authority::Local { node, books } => {
                lock(books).release(node, container_id, tessera_api::time::now_ms());
                return;
            }
        };
        let client = link.client.clone().with_timeout(CALL_TIMEOUT);
        let node = link.node.clone();
        let id = container_id.to_string();
        self.handle.spawn(async move {
            let req = ::fleet::quota_wire::ReleaseRequest { container_id: id.clone() };
            if let Err(e) = client.quota_release(&node, &req).await {
                debug!(container = %id, "quota release not delivered ({e}); the next sync repairs it");
            }
        });
    }

    /// Ask the books to count `req`'s amounts for a grant from now on (a `runc update` of
    /// its container raises its CPU or memory limit; blocking: call from a blocking
    /// thread). Answered as an admission is, never `Reclaiming`.
    /// Keep the [`InFlight`] as [`QuotaGate::ask`]'s (it counts the new amounts whole,
    /// the grant's old ones too: more than the raise, never less).
    pub fn resize(&self, req: &ResizeRequest, tree: &QuotaTree) -> (Verdict, InFlight<'_>) {
        let link = match &self.authority {
            Authority::Coordinator(link) => link,
            Authority::Local { node, books } => {
                let now = tessera_api::time::now_ms();
                let v = verdict(lock(books).resize(tree, node, req, now));
                return (v, InFlight { gate: self, seq: None });
            }
        };
        // Registered before the flag is read, as an admission's.
        let in_flight = self.asking(&req.container_id, &req.tenant, &req.amounts);
        let req =
            &ResizeRequest { unsynced_lease_grants: self.unsynced_lease_grants(), ..req.clone() };
        let (client, node) = (&link.client, &link.node);
        let r = self
            .handle
            .block_on(async move { client.quota_resize(node, req, ADMIT_TIMEOUT).await });
        (self.answered(r), in_flight)
    }

    /// Tell the books what a grant counts after its update ended (a decrease, or the raise
    /// given back): to a coordinator spawned, best effort (the next sync carries it too).
    pub fn resized(&self, req: ResizeRequest, tree: &QuotaTree) {
        let link = match &self.authority {
            Authority::Coordinator(link) => link,
            Authority::Local { node, books } => {
                lock(books).resize(tree, node, &req, tessera_api::time::now_ms());
                return;
            }
        };
        let client = link.client.clone().with_timeout(CALL_TIMEOUT);
        let node = link.node.clone();
        self.handle.spawn(async move {
            if let Err(e) = client.quota_resize(&node, &req, CALL_TIMEOUT).await {
                debug!(container = %req.container_id, "quota resize not delivered ({e}); the next sync carries it");
            }
        });
    }

    /// The leases as [`lease_admits`] takes them, now.
    pub fn with_leases<T>(&self, f: impl FnOnce(HeldLeases<'_>) -> T) -> T {
        let book = lock(&self.leases);
        let now = Instant::now();
        let held = match book.expires {
            None => HeldLeases::None,
            Some(at) if now >= at => {
                HeldLeases::Expired { ago_s: now.duration_since(at).as_secs() }
            }
            Some(_) => HeldLeases::Valid(&book.leases),
        };
        f(held)
    }

    /// Tests: a gate whose coordinator (`127.0.0.1:9`, nothing listens) the test never
    /// calls, holding `leases` for a minute (call inside the tokio runtime).
    #[cfg(test)]
    pub(crate) fn out_of_reach(leases: Vec<Lease>) -> Arc<QuotaGate> {
        let client =
            ::fleet::client::Client::new(&["http://127.0.0.1:9"], "node-token").expect("client");
        let gate =
            QuotaGate::new(Authority::Coordinator(Link::new(client, "sim-h100-0".into())), None);
        gate.renew(leases, 60, Instant::now(), tessera_api::time::now_ms());
        gate
    }

    /// Tests: the [`QuotaGate::while_committing`] step, once.
    #[cfg(test)]
    pub(crate) fn committing(&self) {
        let hook = lock(&self.while_committing).take();
        if let Some(hook) = hook {
            hook(self);
        }
    }

    /// A grant (or raise) under the lease is about to be decided for `container_id`: marked
    /// unsynced from now, before its decision reads [`QuotaGate::asked_here`] (call under
    /// the node lock). An ask registers before it reads the flag; so an ask the decision
    /// does not see says a lease grant is unsynced (the books do not count it within this
    /// node's lease), and one that said none is counted by the decision. Returns the mark
    /// replaced, for [`QuotaGate::lease_grant_abandoned`].
    pub fn lease_grant_begins(&self, container_id: &str) -> Option<Instant> {
        lock(&self.unsynced).insert(container_id.to_string(), Instant::now())
    }

    /// The grant [`QuotaGate::lease_grant_begins`] marked was not made: its mark undone
    /// (`before`, what it replaced, put back).
    pub fn lease_grant_abandoned(&self, container_id: &str, before: Option<Instant>) {
        let mut unsynced = lock(&self.unsynced);
        match before {
            Some(at) => unsynced.insert(container_id.to_string(), at),
            None => unsynced.remove(container_id),
        };
    }

    /// A grant was admitted under a lease (call under the node lock, with the grant).
    pub fn note_lease_grant(&self, container_id: &str) {
        lock(&self.unsynced).insert(container_id.to_string(), Instant::now());
    }

    /// Whether this node holds grants it admitted under a lease that no answered sync
    /// has listed yet.
    pub fn unsynced_lease_grants(&self) -> bool {
        !lock(&self.unsynced).is_empty()
    }

    /// An answered sync whose snapshot was taken at `taken` listed `listed`: those grants,
    /// and those made before the snapshot that it did not list (released since), are
    /// synced.
    fn synced(&self, taken: Instant, listed: &BTreeSet<&str>) {
        lock(&self.unsynced).retain(|id, at| !listed.contains(id.as_str()) && *at >= taken);
    }

    /// The leases this node holds (for the sync).
    pub fn leases(&self) -> Vec<Lease> {
        let book = lock(&self.leases);
        match book.expires {
            Some(at) if Instant::now() < at => book.leases.clone(),
            _ => Vec::new(),
        }
    }

    /// Take the leases a sync sent at `sent` (monotonic) / `sent_ms` (wall) carried.
    pub fn renew(&self, leases: Vec<Lease>, ttl_s: u64, sent: Instant, sent_ms: u64) {
        let ttl = Duration::from_secs(ttl_s).min(MAX_LEASE_TTL);
        let mut book = lock(&self.leases);
        let changed = book.leases != leases || book.ttl_s != ttl_s;
        book.expires = sent.checked_add(ttl);
        book.leases = leases;
        book.ttl_s = ttl_s;
        // On disk when they change, and often enough that a restart finds them in force.
        let stale = sent_ms.saturating_sub(book.written_sent_ms)
            >= (ttl_s.saturating_mul(1000) / 3).max(1000);
        if changed || stale {
            if let Some(p) = &self.lease_path {
                let f = LeaseFile { leases: book.leases.clone(), lease_ttl_s: ttl_s, sent_ms };
                match store_leases(p, &f) {
                    Ok(()) => book.written_sent_ms = sent_ms,
                    Err(e) => warn!("{e}"),
                }
            }
        }
        drop(book);
        self.reached();
    }

    /// The verdict of a call to the coordinator's books (an admission or a resize), the
    /// link's reachability noted.
    fn answered(&self, r: Result<AdmitAnswer, ::fleet::client::ClientError>) -> Verdict {
        match r {
            Ok(answer) => {
                self.reached();
                verdict(answer)
            }
            Err(e) if unreachable(&e) => {
                let why = e.to_string();
                let since_ms = self.unreached(&why);
                Verdict::Unreachable { since_ms, why }
            }
            Err(e) => {
                self.reached();
                Verdict::Failed { message: e.to_string() }
            }
        }
    }

    /// The coordinator answered.
    pub fn reached(&self) {
        let mut book = lock(&self.leases);
        if let Some((since, _)) = book.unreachable.take() {
            info!(
                since = %tessera_api::time::format_utc(since),
                "the quota coordinator answers again"
            );
        }
    }

    /// The coordinator did not answer (`why`): since when it has not.
    pub fn unreached(&self, why: &str) -> u64 {
        let mut book = lock(&self.leases);
        match &book.unreachable {
            Some((since, _)) => *since,
            None => {
                let now = tessera_api::time::now_ms();
                warn!("the quota coordinator is unreachable ({why}); admitting only work within the leased guarantees");
                book.unreachable = Some((now, why.to_string()));
                now
            }
        }
    }

    /// Mark `ids` as being stopped; returns those that were not already.
    pub fn start_stopping(&self, ids: &[String]) -> Vec<String> {
        let mut s = lock(&self.stopping);
        ids.iter().filter(|id| s.insert((*id).clone())).cloned().collect()
    }

    /// The containers being stopped now.
    pub fn stopping(&self) -> BTreeSet<String> {
        lock(&self.stopping).clone()
    }

    /// Their stops ended.
    pub fn done_stopping(&self, ids: &[String]) {
        let mut s = lock(&self.stopping);
        for id in ids {
            s.remove(id);
        }
    }

    /// One sync: `req` (without leases: they are added here) to the coordinator, whose
    /// answer's leases are kept, or to the node's own books (under `tree`). Returns the
    /// victims the answer names.
    pub async fn sync(
        &self,
        mut req: ::fleet::quota_wire::SyncRequest,
        tree: &QuotaTree,
        taken: Instant,
    ) -> Result<Vec<Victim>, String> {
        let link = match &self.authority {
            Authority::Coordinator(link) => link,
            Authority::Local { .. } => return Ok(self.sync_local(&req, tree)),
        };
        req.leases = self.leases();
        req.last_authority = lock(&self.leases).authority.as_ref().map(|(a, at)| {
            ::fleet::quota_wire::SeenAuthority {
                url: a.url.clone(),
                term: a.term,
                scope: a.scope.clone(),
                age_ms: u64::try_from(at.elapsed().as_millis()).unwrap_or(u64::MAX),
            }
        });
        // Victims being stopped (grace running): a coordinator that took over meanwhile
        // must not take another victim for the same claim.
        let stopping = self.stopping();
        req.stopping = req
            .holdings
            .iter()
            .map(|h| &h.container_id)
            .filter(|c| stopping.contains(*c))
            .cloned()
            .collect();
        if req.holdings.len() > ::fleet::quota_wire::MAX_SYNC_HOLDINGS {
            warn!(
                holdings = req.holdings.len(),
                "more quota holdings than one sync carries; the youngest are left out"
            );
            req.holdings.sort_by_key(|h| h.started_ms);
            req.holdings.truncate(::fleet::quota_wire::MAX_SYNC_HOLDINGS);
        }
        let client = link.client.clone().with_timeout(CALL_TIMEOUT);
        let sent = Instant::now();
        let sent_ms = tessera_api::time::now_ms();
        match client.quota_sync(&link.node, &req).await {
            Ok(answer) => {
                let listed: BTreeSet<&str> =
                    req.holdings.iter().map(|h| h.container_id.as_str()).collect();
                self.synced(taken, &listed);
                if let Some(a) = answer.authority {
                    let mut book = lock(&self.leases);
                    if book.authority.as_ref().is_none_or(|(b, _)| *b != a) {
                        info!(coordinator = %a.url, term = a.term, "quota books decided by this coordinator now");
                    }
                    book.authority = Some((a, Instant::now()));
                }
                self.renew(answer.leases, answer.lease_ttl_s, sent, sent_ms);
                Ok(answer.preempt)
            }
            Err(e) => {
                let why = e.to_string();
                if unreachable(&e) {
                    self.unreached(&why);
                }
                Err(why)
            }
        }
    }
}

/// The controller's view of an answer.
fn verdict(answer: AdmitAnswer) -> Verdict {
    match answer {
        AdmitAnswer::Admitted { class, over } => Verdict::Admitted { class, over },
        AdmitAnswer::Reclaiming { retry_after_s, victims, message } => {
            Verdict::Reclaiming { retry_after_s, victims, message }
        }
        AdmitAnswer::Refused { message, rule } => Verdict::Refused { message, rule },
    }
}

/// An admission by a node's own books: at once, or, for a gang member, once its gang is
/// whole (the books' lock is not held while it waits).
fn local_admit(
    books: &Mutex<Books>,
    tree: &QuotaTree,
    node: &str,
    req: &AdmitRequest,
    gang_timeout_s: u64,
) -> AdmitAnswer {
    let now = tessera_api::time::now_ms;
    let arrival = {
        let mut b = lock(books);
        if req.gang.is_none() {
            return b.admit(tree, node, req, now());
        }
        b.gang_arrive(tree, node, req, gang_timeout_s, now())
    };
    let deadline_ms = match arrival {
        GangArrival::Answer(a) => return a,
        GangArrival::Wait { deadline_ms } => deadline_ms,
    };
    loop {
        std::thread::sleep(GANG_POLL);
        let t = now();
        if let Some(a) = lock(books).gang_poll(node, &req.container_id, t) {
            return a;
        }
        // The books time the gang out at its deadline; this bounds the wait regardless.
        if t > deadline_ms.saturating_add(GANG_ADMIT_MARGIN.as_millis() as u64) {
            lock(books).release(node, &req.container_id, t);
            return AdmitAnswer::Refused {
                message: format!(
                    "gang {} did not assemble within {gang_timeout_s} s",
                    req.gang.as_ref().map_or("?", |g| g.name.as_str())
                ),
                rule: Some("gangs.timeout_s".into()),
            };
        }
    }
}

/// Whether a client error means "no usable coordinator now": no connection, no answer in
/// time, or an answer of 502, 503 or 504.
fn unreachable(e: &::fleet::client::ClientError) -> bool {
    match e {
        ::fleet::client::ClientError::Http(_) => true,
        other => matches!(other.status(), Some(502..=504)),
    }
}

/// When leases kept on disk stop admitting, counted on the monotonic clock from `now`:
/// `None` if they already expired, or if the wall clock is before the sync that carried
/// them was sent (a clock set back: trusted no longer).
fn restored_expiry(f: &LeaseFile, now_ms: u64, now: Instant) -> Option<Instant> {
    let ttl_ms = f.lease_ttl_s.min(MAX_LEASE_TTL.as_secs()).saturating_mul(1000);
    let end_ms = f.sent_ms.checked_add(ttl_ms)?;
    if now_ms < f.sent_ms || now_ms >= end_ms {
        return None;
    }
    now.checked_add(Duration::from_millis(end_ms - now_ms))
}

fn load_leases(path: &Path) -> Result<Option<LeaseFile>, String> {
    crate::durable::load_json(path, "quota leases")
}

/// Write the leases durably.
fn store_leases(path: &Path, f: &LeaseFile) -> Result<(), String> {
    crate::durable::store_json(path, "quota leases", f)
}

/// The node's capacity as a sync reports it: every GPU of the inventory as one whole GPU
/// of its model, and the host's CPUs and memory.
pub fn capacity(inventory: &slicer::Inventory) -> Amounts {
    let mut gpus: BTreeMap<String, u64> = BTreeMap::new();
    for g in &inventory.gpus {
        let slot = gpus.entry(g.model.clone()).or_insert(0);
        *slot = slot.saturating_add(quota::MICRO_PER_GPU);
    }
    let (cpu_milli, memory_mib) = host_cpu_memory();
    Amounts { gpus, cpu_milli, memory_mib }
}

/// This host's online CPUs (millicores) and physical memory (MiB); 0 where unknown.
fn host_cpu_memory() -> (u64, u64) {
    // SAFETY: sysconf reads a system value; it takes an integer and touches no memory of ours.
    let cpus = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    // SAFETY: as above.
    let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
    // SAFETY: as above.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let cpu_milli = u64::try_from(cpus).unwrap_or(0).saturating_mul(quota::MILLI_PER_CORE);
    let bytes = u64::try_from(pages).unwrap_or(0).saturating_mul(u64::try_from(page).unwrap_or(0));
    (cpu_milli, bytes >> 20)
}

/// Run the sync loop until aborted: every `every`, under a policy with quotas, the node's
/// holdings and capacity ([`crate::Action::QuotaSnapshot`]) and its leases go to the
/// coordinator; the containers its answer names are stopped
/// ([`crate::Action::QuotaPreempt`]).
pub fn spawn_sync(
    ctl: Arc<crate::Controller>,
    gate: Arc<QuotaGate>,
    every: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut next = tokio::time::Instant::now();
        let mut failing = false;
        loop {
            tokio::time::sleep_until(next).await;
            next = tokio::time::Instant::now() + every;
            let (req, tree, taken) = match ctl.run(crate::Action::QuotaSnapshot).await {
                Ok(crate::Outcome::QuotaSnapshot(Some(snap))) => *snap,
                // No quotas in the policy: nothing to sync.
                Ok(_) => continue,
                // The controller logged it.
                Err(_) => continue,
            };
            match gate.sync(req, &tree, taken).await {
                Ok(victims) => {
                    failing = false;
                    if !victims.is_empty() {
                        let _ = ctl.run(crate::Action::QuotaPreempt(victims)).await;
                    }
                }
                Err(e) => {
                    // Failing over: the next coordinator (or the next leader, elected within
                    // seconds) is asked again soon, not a whole interval later.
                    next = tokio::time::Instant::now() + every.min(SYNC_RETRY);
                    if !failing {
                        failing = true;
                        warn!("quota sync failed: {e}; retried every {:?}", every.min(SYNC_RETRY));
                    } else {
                        debug!("quota sync failed: {e}");
                    }
                }
            }
        }
    })
}

/// The refusal of an admission the coordinator refused.
pub fn refused_error(
    tenant: &str,
    request: &GpuRequest,
    message: &str,
    rule: Option<String>,
) -> CoreError {
    CoreError::Refused(Detail {
        message: format!("{}", untrusted(message).max_chars(1024)),
        tenant: Some(tenant.to_string()),
        request: Some(request.to_string()),
        rule: Some(
            rule.map_or_else(|| "quotas".to_string(), |r| untrusted(&r).max_chars(256).to_string()),
        ),
    })
}

#[cfg(test)]
mod tests;
