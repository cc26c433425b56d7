//! Packing a node across whole GPUs, MIG, MPS and time-slicing at once, scored by the
//! fragmentation the choice leaves for the demand the node has seen (FGD, Weng et al.,
//! USENIX ATC 2023). Pure and deterministic.
//!
//! # The model
//!
//! A node is a list of GPUs of one catalog model (MIG mode on), each in one [`GpuUse`]:
//! free (no instance), held whole (a `gpu=N` grant or a 7g instance), cut into MIG
//! instances (an [`Occupancy`]), serving MPS (percent shares summing to at most 100, one
//! percent per tenant per GPU, as `mpsd::pick_mps_device`), or time-sliced for one
//! sharing domain (at most `replicas` containers whose asked fractions sum to at most one
//! GPU: the model never counts oversubscribed demand as served). On a MIG-mode GPU an MPS
//! or time-sliced GPU is one 7g instance serving it, so every mode coexists on one node.
//!
//! Capacity is counted in *units* of 1/7000 GPU ([`UNITS_PER_GPU`]): a MIG compute slice
//! is 1000 units, one MPS percent 70, one milli-GPU 7; every quantity is an integer.
//!
//! # What an [`Ask`] may take
//!
//! - `gpus >= 2`, or a share of 0 or 1000 milli: that many free GPUs of one node.
//! - A fraction (`gpus = 1`, `0 < milli < 1000`), by what its tenant may use
//!   ([`Allow`]): the smallest MIG profile whose compute covers it ([`crate::replay::map_request`]);
//!   an MPS share of `ceil(milli / 10)` percent (at most the policy's `mps.max_percent`);
//!   a time-sliced replica of its sharing domain; a whole GPU when nothing fractional is
//!   allowed. **Packed by what the tenant may use:** when the tenant may use MPS and the
//!   MIG profile would take more than one compute slice beyond the ask, and a GPU already
//!   serving MPS takes the share, only such GPUs are considered (an 850-milli ask gets 85%
//!   of a GPU already serving MPS, not a 7g instance). Untrusted tiers never get MPS or
//!   time-slicing (the policy refuses them, so their [`Allow`] has neither).
//!
//! # Scoring ([`Strategy::Best`])
//!
//! The demand the node has seen is a [`PackMix`]: request *classes* (`k` whole GPUs, or a
//! fraction of a given MIG profile size, representative milli and [`Allow`]) with their
//! counts. The *usable* capacity of a GPU for a class is how much of that class's demand
//! still fits on it (requests that fit × their size): a free GPU serves `floor(100 /
//! pct)` MPS shares, `capacity(Q)` MIG instances of the class's profile, and so on; for
//! `k` whole GPUs the node's free GPUs count in groups of `k`. FGD's fragmentation of a
//! GPU for a class is its free capacity minus what the class can use; its expected
//! fragmentation weighs classes by how often they were seen.
//!
//! **Per asker for MPS and time-slicing.** What an MPS or time-sliced GPU can still take
//! depends on who asks: a tenant holds one percent per MPS GPU, and a time-sliced GPU
//! serves one sharing domain. A class that may use either keeps who asked for it (tenant
//! and sharing domain, the [`MAX_ASKERS`] most frequent; the rest together, as a tenant on
//! no GPU and in no GPU's domain), and its usable capacity is summed per asker: an MPS GPU
//! where that tenant already holds another percent, or a GPU time-sliced for another
//! domain, serves that asker nothing, as [`PackNode::apply`] would refuse it. Counting that
//! room as usable for everyone (as before) let best fill GPUs with shares the waiting
//! tenants could not add to; see docs/PERFORMANCE.md for what the change did.
//!
//! A choice's **loss** ([`Loss`]) is what it removes from the node's usable capacity for
//! the seen demand, counted two ways and compared in this order:
//!
//! 1. `requests`: `Σ_c count(c) × (fit_c(before) − fit_c(after))`, where `fit_c` is how
//!    many requests of class `c` still fit (usable capacity divided by the class's size):
//!    the requests of the seen mix the choice makes unservable. Counting requests, not
//!    units, keeps room for many small requests instead of a few large ones (with the
//!    node rule below, fewer cells of the trace family lose requests to first-fit; see
//!    docs/PERFORMANCE.md for the numbers, and for the cells that still do).
//! 2. `units`: `Σ_c count(c) × (usable_c(before) − usable_c(after))`: FGD's increase of
//!    expected fragmentation plus the capacity the choice takes, so among choices that
//!    take the same capacity (every MIG placement of one profile, every whole-GPU set) it
//!    is exactly FGD's order, and across kinds a share that takes less than a rounded-up
//!    MIG profile is not rewarded for the waste.
//!
//! Best takes the smallest loss; ties: the GPU with the least free capacity (pack partly
//! used GPUs first), then the lowest GPU index, then the kind (MIG, MPS, time-slice,
//! whole), then the lowest start slot. Across nodes: the lowest node where the request
//! fits at all (nodes filled in order keep the later ones empty for whole-node requests;
//! comparing nodes by loss admitted fewer requests on the family, see
//! docs/PERFORMANCE.md), with its best choice.
//!
//! [`Strategy::FirstFit`]: the lowest GPU where the request fits, in the kind order above
//! (MIG at its lowest free start slot); across nodes, the first node with a fit. It
//! applies the same MPS-first rule, so the two differ only in placement.
//!
//! Cost: one decision evaluates every GPU and MIG start slot against every class (at most
//! [`MAX_CLASSES`], and for MPS and time-slicing at most [`MAX_ASKERS`] + 1 askers per
//! class); on 8 GPUs that is a few thousand integer operations.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use slicer::catalog::{GpuModel, Profile, COMPUTE_SLICES};
use slicer::place::{Occupancy, Strategy};

/// Capacity units per GPU: 7 compute slices × 1000.
pub const UNITS_PER_GPU: u64 = 7000;
/// Most classes a [`PackMix`] keeps (the most frequent ones).
pub const MAX_CLASSES: usize = 24;
/// Most (tenant, sharing domain) pairs a class of a [`PackMix`] tells apart (the most
/// frequent ones; the rest are counted together).
pub const MAX_ASKERS: usize = 8;

/// The isolation kinds a tenant may use (its tier's `allow` list, as the policy says).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
#[serde(deny_unknown_fields)]
pub struct Allow {
    pub gpu: bool,
    pub mig: bool,
    pub mps: bool,
    pub shared: bool,
}

impl Allow {
    /// Whole GPUs and MIG: the untrusted tier, and what every fraction got before tiers.
    pub const MIG_ONLY: Allow = Allow { gpu: true, mig: true, mps: false, shared: false };

    /// `gpu,mig,mps,shared` with the kinds present.
    pub fn label(&self) -> String {
        let names =
            [(self.gpu, "gpu"), (self.mig, "mig"), (self.mps, "mps"), (self.shared, "shared")];
        let v: Vec<&str> = names.iter().filter(|(on, _)| *on).map(|(_, n)| *n).collect();
        if v.is_empty() {
            "none".into()
        } else {
            v.join("+")
        }
    }
}

/// One request as the packer sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ask {
    /// GPUs asked for (1 for a fraction).
    pub gpus: u32,
    /// Share of one GPU in thousandths (1000 for whole GPUs).
    pub milli: u32,
    pub allow: Allow,
    /// The tenant (an index into the caller's table): one MPS percent per tenant per GPU.
    pub tenant: u32,
    /// The sharing domain (an index): a time-sliced GPU serves one domain.
    pub domain: u32,
}

impl Ask {
    /// Whether this asks for whole GPUs.
    pub fn is_whole(&self) -> bool {
        self.gpus >= 2 || self.milli == 0 || self.milli >= 1000
    }

    /// GPUs × milli: the demand, in milli-GPU.
    pub fn demand_milli(&self) -> u64 {
        if self.is_whole() {
            u64::from(self.gpus.max(1)) * 1000
        } else {
            u64::from(self.milli)
        }
    }
}

/// Node-wide rules from the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rules {
    /// The largest MPS share (`mps.max_percent`).
    pub mps_max_percent: u8,
    /// Time-sliced containers per GPU (`sharing.replicas`).
    pub replicas: u32,
}

impl Default for Rules {
    fn default() -> Self {
        Rules { mps_max_percent: 100, replicas: 4 }
    }
}

/// One tenant's MPS share on a GPU: tenant, its percent, how many containers hold it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MpsShare {
    pub tenant: u32,
    pub percent: u8,
    pub count: u32,
}

/// How one GPU is used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuUse {
    Free,
    /// Held whole by one grant.
    Whole,
    /// MIG instances, all in use.
    Mig(Occupancy),
    /// An MPS server: booked percent and the shares.
    Mps {
        used: u32,
        shares: Vec<MpsShare>,
    },
    /// Time-sliced for `domain`: `count` containers asking `milli` in total.
    Shared {
        domain: u32,
        count: u32,
        milli: u32,
    },
}

/// What a request gets.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Choice {
    Whole { gpus: Vec<u32> },
    Mig { gpu: u32, profile: String, start: u8 },
    Mps { gpu: u32, percent: u8 },
    Shared { gpu: u32 },
}

impl Choice {
    /// Capacity units the choice takes.
    pub fn units(&self, model: &GpuModel, ask: &Ask) -> u64 {
        match self {
            Choice::Whole { gpus } => gpus.len() as u64 * UNITS_PER_GPU,
            Choice::Mig { profile, .. } => {
                model.profile(profile).map_or(0, |p| u64::from(p.compute_slices) * 1000)
            }
            Choice::Mps { percent, .. } => u64::from(*percent) * 70,
            Choice::Shared { .. } => u64::from(ask.milli) * 7,
        }
    }

    /// A short label: `gpu`, `mig`, `mps`, `shared`.
    pub fn kind(&self) -> &'static str {
        match self {
            Choice::Whole { .. } => "gpu",
            Choice::Mig { .. } => "mig",
            Choice::Mps { .. } => "mps",
            Choice::Shared { .. } => "shared",
        }
    }
}

/// What a choice removes from the node for the seen demand, compared requests first
/// (see the module documentation).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Loss {
    /// Weighted requests of the seen classes that no longer fit.
    pub requests: i64,
    /// Weighted usable capacity units removed.
    pub units: i64,
}

impl std::ops::Add for Loss {
    type Output = Loss;
    fn add(self, o: Loss) -> Loss {
        Loss {
            requests: self.requests.saturating_add(o.requests),
            units: self.units.saturating_add(o.units),
        }
    }
}

impl std::ops::Sub for Loss {
    type Output = Loss;
    fn sub(self, o: Loss) -> Loss {
        Loss {
            requests: self.requests.saturating_sub(o.requests),
            units: self.units.saturating_sub(o.units),
        }
    }
}

/// A choice and its loss (first-fit: zero).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pick {
    pub choice: Choice,
    pub loss: Loss,
}

/// The MPS percent for a fraction: `ceil(milli / 10)`, 1 to 100.
pub fn mps_percent(milli: u32) -> u8 {
    u8::try_from(milli.div_ceil(10).clamp(1, 100)).unwrap_or(100)
}

/// The smallest non-`+me` profile of `model` whose compute covers `milli` (None: more
/// than the largest profile, which does not happen below 1000).
pub fn mig_profile(model: &'static GpuModel, milli: u32) -> Option<(usize, &'static Profile)> {
    let need = u64::from(milli) * u64::from(COMPUTE_SLICES);
    model
        .profiles
        .iter()
        .enumerate()
        .filter(|(_, p)| !p.is_media_extension() && u64::from(p.compute_slices) * 1000 >= need)
        .min_by_key(|(_, p)| (p.compute_slices, p.size))
}

/// A request class of the demand mix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Class {
    Whole(u32),
    Frac { profile: usize, milli: u32, allow: Allow },
}

/// Who asked for a class that may use MPS or time-slicing, and how often: the MPS rule
/// (one percent per tenant per GPU) and the time-slicing rule (one sharing domain per GPU)
/// depend on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Asker {
    /// (tenant, sharing domain); None: the tenants beyond [`MAX_ASKERS`], counted together
    /// as a tenant present on no GPU (and in no GPU's sharing domain).
    who: Option<(u32, u32)>,
    count: u64,
}

/// The demand a node has seen, as weighted classes. Build it with [`DemandCounter`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PackMix {
    classes: Vec<(Class, u64)>,
    /// Per class, aligned with `classes`: its askers when it may use MPS or time-slicing
    /// (their counts sum to the class's), empty otherwise.
    askers: Vec<Vec<Asker>>,
}

impl PackMix {
    /// Number of classes.
    pub fn len(&self) -> usize {
        self.classes.len()
    }

    /// Whether no demand was seen.
    pub fn is_empty(&self) -> bool {
        self.classes.is_empty()
    }
}

/// Counts requests by class; [`DemandCounter::mix`] gives the [`PackMix`].
#[derive(Debug, Clone, Default)]
pub struct DemandCounter {
    whole: BTreeMap<u32, u64>,
    /// (profile index, allow) → (count, sum of milli).
    frac: BTreeMap<(usize, Allow), (u64, u64)>,
    /// (profile index, allow) → (tenant, domain) → count, for kinds that may use MPS or
    /// time-slicing.
    askers: BTreeMap<(usize, Allow), BTreeMap<(u32, u32), u64>>,
}

impl DemandCounter {
    /// Count one request.
    pub fn record(&mut self, model: &'static GpuModel, ask: &Ask) {
        if ask.is_whole() {
            *self.whole.entry(ask.gpus.max(1)).or_default() += 1;
        } else if let Some((pi, _)) = mig_profile(model, ask.milli) {
            let e = self.frac.entry((pi, ask.allow)).or_default();
            e.0 += 1;
            e.1 += u64::from(ask.milli);
            if ask.allow.mps || ask.allow.shared {
                *self
                    .askers
                    .entry((pi, ask.allow))
                    .or_default()
                    .entry((ask.tenant, ask.domain))
                    .or_default() += 1;
            }
        }
    }

    /// The mix: every class with its count; the [`MAX_CLASSES`] most frequent when there
    /// are more (ties: the class order). A class that may use MPS or time-slicing keeps its
    /// [`MAX_ASKERS`] most frequent (tenant, domain) pairs (ties: the lower pair), the rest
    /// counted together.
    pub fn mix(&self) -> PackMix {
        let mut classes: Vec<(Class, u64)> = self
            .whole
            .iter()
            .map(|(&k, &n)| (Class::Whole(k), n))
            .chain(self.frac.iter().map(|(&(profile, allow), &(n, sum))| {
                let milli = u32::try_from(sum / n.max(1)).unwrap_or(999).clamp(1, 999);
                (Class::Frac { profile, milli, allow }, n)
            }))
            .collect();
        if classes.len() > MAX_CLASSES {
            classes.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
            classes.truncate(MAX_CLASSES);
            classes.sort();
        }
        let askers = classes
            .iter()
            .map(|&(c, n)| {
                let Class::Frac { profile, allow, .. } = c else { return Vec::new() };
                let Some(by) = self.askers.get(&(profile, allow)) else { return Vec::new() };
                let mut v: Vec<Asker> =
                    by.iter().map(|(&who, &count)| Asker { who: Some(who), count }).collect();
                v.sort_by(|a, b| b.count.cmp(&a.count).then(a.who.cmp(&b.who)));
                v.truncate(MAX_ASKERS);
                let kept: u64 = v.iter().map(|a| a.count).sum();
                if kept < n {
                    v.push(Asker { who: None, count: n - kept });
                }
                v
            })
            .collect();
        PackMix { classes, askers }
    }
}

/// A node the packer places on.
#[derive(Debug, Clone)]
pub struct PackNode {
    pub model: &'static GpuModel,
    pub rules: Rules,
    pub gpus: Vec<GpuUse>,
}

impl PackNode {
    /// A node of `n` free GPUs of `model`.
    pub fn new(model: &'static GpuModel, n: u32, rules: Rules) -> PackNode {
        PackNode { model, rules, gpus: vec![GpuUse::Free; n as usize] }
    }

    /// Free GPUs.
    pub fn free_gpus(&self) -> u32 {
        self.gpus.iter().filter(|g| matches!(g, GpuUse::Free)).count() as u32
    }

    /// Free capacity units of the node.
    pub fn free_units(&self) -> u64 {
        self.gpus.iter().map(free_units).sum()
    }

    /// Take `choice` for `ask` (a choice from [`pack`] on this node). False when it does
    /// not fit (nothing changed).
    pub fn apply(&mut self, choice: &Choice, ask: &Ask) -> bool {
        if !self.fits(choice, ask) {
            return false;
        }
        match choice {
            Choice::Whole { gpus } => {
                for &g in gpus {
                    self.gpus[g as usize] = GpuUse::Whole;
                }
            }
            Choice::Mig { gpu, profile, start } => {
                let Some((pi, p)) = self.profile(profile) else { return false };
                let g = &mut self.gpus[*gpu as usize];
                let mut occ = match g {
                    GpuUse::Mig(o) => *o,
                    _ => Occupancy::default(),
                };
                occ.add(p, pi, *start);
                *g = GpuUse::Mig(occ);
            }
            Choice::Mps { gpu, percent } => {
                let g = &mut self.gpus[*gpu as usize];
                if matches!(g, GpuUse::Free) {
                    *g = GpuUse::Mps { used: 0, shares: Vec::new() };
                }
                if let GpuUse::Mps { used, shares } = g {
                    *used += u32::from(*percent);
                    match shares.iter_mut().find(|s| s.tenant == ask.tenant) {
                        Some(s) => s.count += 1,
                        None => shares.push(MpsShare {
                            tenant: ask.tenant,
                            percent: *percent,
                            count: 1,
                        }),
                    }
                }
            }
            Choice::Shared { gpu } => {
                let g = &mut self.gpus[*gpu as usize];
                match g {
                    GpuUse::Shared { count, milli, .. } => {
                        *count += 1;
                        *milli += ask.milli;
                    }
                    _ => *g = GpuUse::Shared { domain: ask.domain, count: 1, milli: ask.milli },
                }
            }
        }
        true
    }

    /// Give back what `apply(choice, ask)` took; a GPU left empty becomes free.
    pub fn release(&mut self, choice: &Choice, ask: &Ask) {
        let model = self.model;
        match choice {
            Choice::Whole { gpus } => {
                for &g in gpus {
                    if let Some(slot) = self.gpus.get_mut(g as usize) {
                        *slot = GpuUse::Free;
                    }
                }
            }
            Choice::Mig { gpu, profile, start } => {
                let Some((pi, p)) =
                    model.profiles.iter().enumerate().find(|(_, p)| p.name == profile)
                else {
                    return;
                };
                if let Some(g) = self.gpus.get_mut(*gpu as usize) {
                    if let GpuUse::Mig(occ) = g {
                        occ.remove(p, pi, *start);
                        if occ.is_empty() {
                            *g = GpuUse::Free;
                        }
                    }
                }
            }
            Choice::Mps { gpu, percent } => {
                if let Some(g) = self.gpus.get_mut(*gpu as usize) {
                    if let GpuUse::Mps { used, shares } = g {
                        *used = used.saturating_sub(u32::from(*percent));
                        if let Some(i) = shares.iter().position(|s| s.tenant == ask.tenant) {
                            shares[i].count = shares[i].count.saturating_sub(1);
                            if shares[i].count == 0 {
                                shares.remove(i);
                            }
                        }
                        if shares.is_empty() {
                            *g = GpuUse::Free;
                        }
                    }
                }
            }
            Choice::Shared { gpu } => {
                if let Some(g) = self.gpus.get_mut(*gpu as usize) {
                    if let GpuUse::Shared { count, milli, .. } = g {
                        *count = count.saturating_sub(1);
                        *milli = milli.saturating_sub(ask.milli);
                        if *count == 0 {
                            *g = GpuUse::Free;
                        }
                    }
                }
            }
        }
    }

    fn profile(&self, name: &str) -> Option<(usize, &'static Profile)> {
        self.model.profiles.iter().enumerate().find(|(_, p)| p.name == name)
    }

    /// Whether `choice` fits `ask` on this node now.
    pub fn fits(&self, choice: &Choice, ask: &Ask) -> bool {
        match choice {
            Choice::Whole { gpus } => {
                let mut seen = gpus.clone();
                seen.sort_unstable();
                seen.dedup();
                seen.len() == gpus.len()
                    && gpus.iter().all(|&g| matches!(self.gpus.get(g as usize), Some(GpuUse::Free)))
            }
            Choice::Mig { gpu, profile, start } => {
                let Some((pi, p)) = self.profile(profile) else { return false };
                match self.gpus.get(*gpu as usize) {
                    Some(GpuUse::Free) => Occupancy::default().fits(p, pi, *start),
                    Some(GpuUse::Mig(o)) => o.fits(p, pi, *start),
                    _ => false,
                }
            }
            Choice::Mps { gpu, percent } => {
                mps_fits(self.gpus.get(*gpu as usize), ask.tenant, *percent)
            }
            Choice::Shared { gpu } => {
                shared_fits(self.gpus.get(*gpu as usize), ask, self.rules.replicas)
            }
        }
    }
}

/// Free capacity units of one GPU.
pub(crate) fn free_units(g: &GpuUse) -> u64 {
    match g {
        GpuUse::Free => UNITS_PER_GPU,
        GpuUse::Whole => 0,
        GpuUse::Mig(o) => u64::from(COMPUTE_SLICES.saturating_sub(o.compute_slices())) * 1000,
        GpuUse::Mps { used, .. } => u64::from(100u32.saturating_sub(*used)) * 70,
        GpuUse::Shared { milli, .. } => u64::from(1000u32.saturating_sub(*milli)) * 7,
    }
}

fn mps_fits(g: Option<&GpuUse>, tenant: u32, percent: u8) -> bool {
    match g {
        Some(GpuUse::Free) => true,
        Some(GpuUse::Mps { used, shares }) => {
            used + u32::from(percent) <= 100
                && shares.iter().all(|s| s.tenant != tenant || s.percent == percent)
        }
        _ => false,
    }
}

fn shared_fits(g: Option<&GpuUse>, ask: &Ask, replicas: u32) -> bool {
    match g {
        Some(GpuUse::Free) => replicas > 0,
        Some(GpuUse::Shared { domain, count, milli }) => {
            *domain == ask.domain && *count < replicas && milli + ask.milli <= 1000
        }
        _ => false,
    }
}

/// Requests of a fraction class that fit on a GPU as MIG instances (or as a whole GPU
/// when that is all the class may use): the same for every tenant.
fn mig_fits(node: &PackNode, g: &GpuUse, profile: usize, allow: Allow) -> u64 {
    let mut n = 0u64;
    if allow.mig {
        if let Some(p) = node.model.profiles.get(profile) {
            let cap = match g {
                GpuUse::Free => Occupancy::default().capacity(p, profile),
                GpuUse::Mig(o) => o.capacity(p, profile),
                _ => 0,
            };
            n = u64::from(cap);
        }
    }
    if allow.gpu && !allow.mig && !allow.mps && !allow.shared && matches!(g, GpuUse::Free) {
        n = n.max(1);
    }
    n
}

/// Requests of a fraction class asked by `who` (see [`Asker`]) that fit on a GPU as MPS
/// shares or time-sliced replicas, by the rules `apply` enforces: an MPS GPU where the
/// tenant already holds another percent, or a time-sliced GPU of another sharing domain,
/// serves it nothing.
fn mps_or_shared_fits(
    node: &PackNode,
    g: &GpuUse,
    milli: u32,
    allow: Allow,
    who: Option<(u32, u32)>,
) -> u64 {
    let mut n = 0u64;
    if allow.mps {
        let pct = u32::from(mps_percent(milli));
        if pct <= u32::from(node.rules.mps_max_percent) {
            let left = match g {
                GpuUse::Free => 100,
                GpuUse::Mps { used, shares } => {
                    let other_percent = who.is_some_and(|(t, _)| {
                        shares.iter().any(|s| s.tenant == t && u32::from(s.percent) != pct)
                    });
                    if other_percent {
                        0
                    } else {
                        100u32.saturating_sub(*used)
                    }
                }
                _ => 0,
            };
            n = n.max(u64::from(left / pct));
        }
    }
    if allow.shared {
        let r = node.rules.replicas;
        let (slots, room) = match g {
            GpuUse::Free => (r, 1000),
            GpuUse::Shared { domain, count, milli: m }
                if who.is_some_and(|(_, d)| d == *domain) =>
            {
                (r.saturating_sub(*count), 1000 - m.min(&1000))
            }
            _ => (0, 0),
        };
        n = n.max(u64::from(slots.min(room / milli.max(1))));
    }
    n
}

/// Usable units of the node's free GPUs for `k` whole GPUs.
fn usable_whole(free: u32, k: u32) -> u64 {
    let k = k.max(1);
    u64::from(free / k * k) * UNITS_PER_GPU
}

/// Σ_class weight × (requests that fit, usable units) over fraction classes, for one GPU;
/// a class that may use MPS or time-slicing is counted per asker.
fn gpu_score(node: &PackNode, g: &GpuUse, mix: &PackMix) -> Loss {
    let (mut n, mut s): (u64, u64) = (0, 0);
    for (i, &(c, w)) in mix.classes.iter().enumerate() {
        let Class::Frac { profile, milli, allow } = c else { continue };
        let size = u64::from(milli) * 7;
        let mig = mig_fits(node, g, profile, allow);
        let fit = |who| {
            if allow.mps || allow.shared {
                mig.max(mps_or_shared_fits(node, g, milli, allow, who))
            } else {
                mig
            }
        };
        let fits: u64 = match mix.askers.get(i).map(Vec::as_slice) {
            Some(askers) if !askers.is_empty() => askers
                .iter()
                .fold(0u64, |acc, a| acc.saturating_add(a.count.saturating_mul(fit(a.who)))),
            _ => w.saturating_mul(fit(None)),
        };
        n = n.saturating_add(fits);
        s = s.saturating_add(fits.saturating_mul(size));
    }
    score(n, s)
}

/// The same over whole classes, for a node with `free` free GPUs.
fn whole_score(free: u32, mix: &PackMix) -> Loss {
    let (mut n, mut s): (u64, u64) = (0, 0);
    for &(c, w) in &mix.classes {
        if let Class::Whole(k) = c {
            let usable = usable_whole(free, k);
            n = n.saturating_add(w.saturating_mul(usable / (u64::from(k.max(1)) * UNITS_PER_GPU)));
            s = s.saturating_add(w.saturating_mul(usable));
        }
    }
    score(n, s)
}

fn score(requests: u64, units: u64) -> Loss {
    Loss {
        requests: i64::try_from(requests).unwrap_or(i64::MAX),
        units: i64::try_from(units).unwrap_or(i64::MAX),
    }
}

/// Order of kinds at equal loss (and first-fit's order on one GPU): MIG, MPS,
/// time-slice, whole; MPS first when the MIG profile would be far bigger than the ask.
fn kind_rank(c: &Choice, mps_first: bool) -> u8 {
    match c {
        Choice::Mps { .. } if mps_first => 0,
        Choice::Mig { .. } => 1,
        Choice::Mps { .. } => 2,
        Choice::Shared { .. } => 3,
        Choice::Whole { .. } => 4,
    }
}

/// Whether `ask` may take MPS and its MIG profile would take more than one compute slice
/// beyond it: then MPS comes before MIG.
fn prefers_mps(node: &PackNode, ask: &Ask) -> bool {
    let mps_ok = ask.allow.mps && mps_percent(ask.milli) <= node.rules.mps_max_percent;
    let mig = if ask.allow.mig { mig_profile(node.model, ask.milli) } else { None };
    mps_ok
        && !ask.is_whole()
        && match mig {
            Some((_, p)) => u64::from(p.compute_slices) * 1000 > u64::from(ask.milli) * 7 + 1000,
            None => true,
        }
}

/// Every choice on `node` for `ask`, in first-fit order (GPU, kind, start).
fn candidates(node: &PackNode, ask: &Ask) -> Vec<Choice> {
    let mut out = Vec::new();
    if ask.is_whole() {
        if !ask.allow.gpu && !ask.allow.mig {
            return out;
        }
        let k = ask.gpus.max(1) as usize;
        let free: Vec<u32> = (0..node.gpus.len() as u32)
            .filter(|&i| matches!(node.gpus[i as usize], GpuUse::Free))
            .collect();
        if free.len() >= k {
            // Any k free GPUs score alike on this node: the lowest k.
            out.push(Choice::Whole { gpus: free[..k].to_vec() });
        }
        return out;
    }
    let mig = if ask.allow.mig { mig_profile(node.model, ask.milli) } else { None };
    let pct = mps_percent(ask.milli);
    let mps_ok = ask.allow.mps && pct <= node.rules.mps_max_percent;
    // Packed by what the tenant may use: MPS on a GPU already serving MPS before a MIG
    // profile more than one compute slice bigger than the ask.
    let mps_first = prefers_mps(node, ask);
    if mps_first {
        for (i, g) in node.gpus.iter().enumerate() {
            if matches!(g, GpuUse::Mps { .. }) && mps_fits(Some(g), ask.tenant, pct) {
                out.push(Choice::Mps { gpu: i as u32, percent: pct });
            }
        }
        if !out.is_empty() {
            return out;
        }
    }
    let only_whole = !ask.allow.mig && !ask.allow.mps && !ask.allow.shared && ask.allow.gpu;
    for (i, g) in node.gpus.iter().enumerate() {
        let gpu = i as u32;
        if mps_first && mps_fits(Some(g), ask.tenant, pct) {
            out.push(Choice::Mps { gpu, percent: pct });
        }
        if let Some((pi, p)) = mig {
            let occ = match g {
                GpuUse::Free => Some(Occupancy::default()),
                GpuUse::Mig(o) => Some(*o),
                _ => None,
            };
            if let Some(o) = occ {
                for &s in p.starts {
                    if o.fits(p, pi, s) {
                        out.push(Choice::Mig { gpu, profile: p.name.to_string(), start: s });
                    }
                }
            }
        }
        if mps_ok && !mps_first && mps_fits(Some(g), ask.tenant, pct) {
            out.push(Choice::Mps { gpu, percent: pct });
        }
        if ask.allow.shared && shared_fits(Some(g), ask, node.rules.replicas) {
            out.push(Choice::Shared { gpu });
        }
        if only_whole && matches!(g, GpuUse::Free) {
            out.push(Choice::Whole { gpus: vec![gpu] });
        }
    }
    out
}

/// The loss of `choice` on `node` (see the module documentation): only the GPUs it
/// touches change, so only they are scored again.
fn loss_of(node: &PackNode, choice: &Choice, ask: &Ask, mix: &PackMix) -> Loss {
    let touched = touched(choice);
    let mut trial = PackNode {
        model: node.model,
        rules: node.rules,
        gpus: touched.iter().map(|&g| node.gpus[g as usize].clone()).collect(),
    };
    let mut local = choice.clone();
    relabel(&mut local, &touched);
    trial.apply(&local, ask);
    let mut loss = Loss::default();
    for (g, after) in touched.iter().zip(&trial.gpus) {
        loss = loss + (gpu_score(node, &node.gpus[*g as usize], mix) - gpu_score(node, after, mix));
    }
    let free = node.free_gpus();
    let taken = touched.iter().filter(|&&g| matches!(node.gpus[g as usize], GpuUse::Free)).count();
    let free_after = free - taken as u32 + trial.free_gpus();
    loss + (whole_score(free, mix) - whole_score(free_after, mix))
}

/// The GPUs a choice touches.
fn touched(choice: &Choice) -> Vec<u32> {
    match choice {
        Choice::Whole { gpus } => gpus.clone(),
        Choice::Mig { gpu, .. } | Choice::Mps { gpu, .. } | Choice::Shared { gpu } => vec![*gpu],
    }
}

/// The choice with GPU numbers relative to `touched`.
fn relabel(choice: &mut Choice, touched: &[u32]) {
    let pos = |g: u32| touched.iter().position(|&t| t == g).unwrap_or(0) as u32;
    match choice {
        Choice::Whole { gpus } => {
            for g in gpus.iter_mut() {
                *g = pos(*g);
            }
        }
        Choice::Mig { gpu, .. } | Choice::Mps { gpu, .. } | Choice::Shared { gpu } => {
            *gpu = pos(*gpu)
        }
    }
}

/// Tie-break key within a node: loss, the GPU's free units, GPU, kind, start.
type NodeKey = (Loss, u64, u32, u8, u8);

/// The best choice for `ask` on `node` by `strategy` (None: nothing fits).
pub fn pack(node: &PackNode, ask: &Ask, strategy: Strategy, mix: &PackMix) -> Option<Pick> {
    let cands = candidates(node, ask);
    let mps_first = prefers_mps(node, ask);
    if strategy == Strategy::FirstFit {
        return cands.into_iter().next().map(|choice| Pick { choice, loss: Loss::default() });
    }
    let mut best: Option<(NodeKey, Choice)> = None;
    for c in cands {
        let loss = loss_of(node, &c, ask, mix);
        let first = touched(&c).first().copied().unwrap_or(0);
        let gpu_free = node.gpus.get(first as usize).map_or(0, free_units);
        let start = if let Choice::Mig { start, .. } = c { start } else { 0 };
        let key = (loss, gpu_free, first, kind_rank(&c, mps_first), start);
        if slicer::place::better(&key, best.as_ref().map(|b| &b.0)) {
            best = Some((key, c));
        }
    }
    best.map(|((loss, ..), choice)| Pick { choice, loss })
}

/// The node and choice for `ask` among `nodes`: the lowest node where it fits, with that
/// node's choice by `strategy` (see the module documentation for why Best does not
/// compare nodes by loss).
pub fn pack_cluster(
    nodes: &[PackNode],
    ask: &Ask,
    strategy: Strategy,
    mix: &PackMix,
) -> Option<(usize, Pick)> {
    nodes.iter().enumerate().find_map(|(n, node)| pack(node, ask, strategy, mix).map(|p| (n, p)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use slicer::catalog;

    fn h100() -> &'static GpuModel {
        catalog::model("H100-80GB").expect("h100")
    }

    fn ask(milli: u32, allow: Allow, tenant: u32) -> Ask {
        Ask { gpus: 1, milli, allow, tenant, domain: 0 }
    }

    const TRUSTED: Allow = Allow { gpu: true, mig: true, mps: true, shared: false };

    fn mix_of(asks: &[Ask]) -> PackMix {
        let mut c = DemandCounter::default();
        for a in asks {
            c.record(h100(), a);
        }
        c.mix()
    }

    #[test]
    fn a_fraction_goes_to_a_gpu_already_serving_mps_before_a_far_bigger_profile() {
        let mut node = PackNode::new(h100(), 2, Rules::default());
        let a = ask(100, TRUSTED, 1);
        assert!(node.apply(&Choice::Mps { gpu: 1, percent: 10 }, &a));
        let big = ask(850, TRUSTED, 2);
        let mix = mix_of(&[a, big]);
        for s in [Strategy::Best, Strategy::FirstFit] {
            assert_eq!(
                pack(&node, &big, s, &mix).map(|p| p.choice),
                Some(Choice::Mps { gpu: 1, percent: 85 }),
                "{s:?}"
            );
        }
        // Untrusted: never MPS; a 7g instance on the free GPU.
        let u = ask(850, Allow::MIG_ONLY, 3);
        assert_eq!(
            pack(&node, &u, Strategy::Best, &mix).map(|p| p.choice),
            Some(Choice::Mig { gpu: 0, profile: "7g.80gb".into(), start: 0 })
        );
        // A fraction whose MIG profile is close to the ask (2g = 285 for 250): scored,
        // not forced onto MPS.
        let close = ask(250, TRUSTED, 2);
        assert!(pack(&node, &close, Strategy::Best, &mix).is_some());
        // Same tenant, other percent: not on that GPU (one cap per tenant per GPU).
        let again = ask(850, TRUSTED, 1);
        assert!(!matches!(
            pack(&node, &again, Strategy::Best, &mix).map(|p| p.choice),
            Some(Choice::Mps { gpu: 1, .. })
        ));
    }

    #[test]
    fn mps_and_time_slice_room_counts_per_asker() {
        // GPU 0 serves tenant 2's 30%, GPU 1 tenant 1's 30%: both have 70% left.
        let mut node = PackNode::new(h100(), 2, Rules::default());
        assert!(node.apply(&Choice::Mps { gpu: 0, percent: 30 }, &ask(300, TRUSTED, 2)));
        assert!(node.apply(&Choice::Mps { gpu: 1, percent: 30 }, &ask(300, TRUSTED, 1)));
        // Tenant 1 keeps asking for 25%: it cannot add another percent to GPU 1, so only
        // GPU 0's room serves it, and a newcomer's 40% goes to GPU 1 (a GPU blind to the
        // tenant rule would see two equal GPUs and take GPU 0, the lower).
        let newcomer = ask(400, TRUSTED, 3);
        let mut asks = vec![ask(250, TRUSTED, 1); 5];
        asks.push(newcomer);
        let mix = mix_of(&asks);
        let p = pack(&node, &newcomer, Strategy::Best, &mix).expect("fits");
        assert_eq!(p.choice, Choice::Mps { gpu: 1, percent: 40 });
        assert_eq!(p.loss.requests, 1, "only the newcomer's own class loses a fit");
        assert_eq!(
            pack(&node, &newcomer, Strategy::FirstFit, &mix).map(|p| p.choice),
            Some(Choice::Mps { gpu: 0, percent: 40 })
        );
        // A time-sliced GPU serves its own sharing domain only.
        let dev = Allow { gpu: true, mig: false, mps: false, shared: true };
        let sliced = GpuUse::Shared { domain: 5, count: 1, milli: 300 };
        let in_domain = |d: u32| mix_of(&[Ask { domain: d, ..ask(200, dev, 0) }; 3]);
        assert_eq!(gpu_score(&node, &sliced, &in_domain(5)).requests, 3 * 3, "3 more fit");
        assert_eq!(gpu_score(&node, &sliced, &in_domain(6)), Loss::default());
        assert!(gpu_score(&node, &GpuUse::Free, &in_domain(6)).requests > 0);
        // Beyond MAX_ASKERS pairs, the rest count together: every request still counts.
        let many: Vec<Ask> =
            (0..MAX_ASKERS as u32 + 4).map(|t| Ask { domain: t, ..ask(200, dev, t) }).collect();
        let mix = mix_of(&many);
        assert_eq!(mix.askers[0].len(), MAX_ASKERS + 1);
        assert_eq!(mix.askers[0].iter().map(|a| a.count).sum::<u64>(), many.len() as u64);
    }

    #[test]
    fn best_keeps_free_gpus_for_whole_demand() {
        // gpu0 holds a 3g; whole-GPU demand dominates: a 1g goes next to the 3g.
        let mut node = PackNode::new(h100(), 3, Rules::default());
        let three = ask(400, Allow::MIG_ONLY, 0);
        assert!(node.apply(&Choice::Mig { gpu: 1, profile: "3g.40gb".into(), start: 4 }, &three));
        let whole = Ask { gpus: 1, milli: 1000, allow: Allow::MIG_ONLY, tenant: 0, domain: 0 };
        let small = ask(100, Allow::MIG_ONLY, 0);
        let mix = mix_of(&[whole, whole, whole, small]);
        let p = pack(&node, &small, Strategy::Best, &mix).expect("fits");
        assert!(matches!(p.choice, Choice::Mig { gpu: 1, .. }), "{p:?}");
        assert_eq!(
            pack(&node, &small, Strategy::FirstFit, &mix).map(|p| p.choice),
            Some(Choice::Mig { gpu: 0, profile: "1g.10gb".into(), start: 0 })
        );
        // Whole GPUs: the lowest free ones.
        let two = Ask { gpus: 2, ..whole };
        assert_eq!(
            pack(&node, &two, Strategy::Best, &mix).map(|p| p.choice),
            Some(Choice::Whole { gpus: vec![0, 2] })
        );
        let three_whole = Ask { gpus: 3, ..whole };
        assert_eq!(pack(&node, &three_whole, Strategy::Best, &mix), None);
    }

    #[test]
    fn best_fills_nodes_in_order_and_counts_requests_first() {
        let three = ask(400, Allow::MIG_ONLY, 0);
        let whole = Ask { gpus: 1, milli: 1000, allow: Allow::MIG_ONLY, tenant: 0, domain: 0 };
        let mix = mix_of(&[three, whole, whole]);
        let empty = PackNode::new(h100(), 8, Rules::default());
        let mut used = empty.clone();
        assert!(used.apply(&Choice::Mig { gpu: 0, profile: "3g.40gb".into(), start: 4 }, &three));
        // On the used node the 3g completes GPU 0 and costs no whole GPU: a smaller loss.
        let on_used = pack(&used, &three, Strategy::Best, &mix).expect("fits");
        let on_empty = pack(&empty, &three, Strategy::Best, &mix).expect("fits");
        assert_eq!(on_used.choice, Choice::Mig { gpu: 0, profile: "3g.40gb".into(), start: 0 });
        assert!(on_used.loss < on_empty.loss, "{on_used:?} {on_empty:?}");
        assert_eq!(on_used.loss.requests, 1, "one 3g of one seen fits no more");
        // Nodes are filled in order: the first node where it fits, with its best choice.
        let nodes = [empty.clone(), used.clone()];
        let (n, p) = pack_cluster(&nodes, &three, Strategy::Best, &mix).expect("fits");
        assert_eq!((n, p), (0, on_empty));
        let nodes = [used, empty];
        assert_eq!(pack_cluster(&nodes, &three, Strategy::Best, &mix).map(|x| x.0), Some(0));
        // Requests before units: losses compare lexicographically.
        let a = Loss { requests: 1, units: 9_000_000 };
        assert!(a < Loss { requests: 2, units: 0 });
        assert_eq!(a - a, Loss::default());
    }

    #[test]
    fn apply_and_release_round_trip() {
        let model = h100();
        let mut node = PackNode::new(model, 2, Rules { mps_max_percent: 75, replicas: 2 });
        let dev = Allow { gpu: true, mig: false, mps: false, shared: true };
        let s1 = Ask { domain: 7, ..ask(300, dev, 1) };
        let s2 = Ask { domain: 7, ..ask(600, dev, 2) };
        let other = Ask { domain: 8, ..ask(100, dev, 3) };
        assert!(node.apply(&Choice::Shared { gpu: 0 }, &s1));
        assert!(node.fits(&Choice::Shared { gpu: 0 }, &s2));
        assert!(!node.fits(&Choice::Shared { gpu: 0 }, &other), "one domain per GPU");
        assert!(node.apply(&Choice::Shared { gpu: 0 }, &s2));
        assert!(!node.fits(&Choice::Shared { gpu: 0 }, &s1), "replicas");
        let before = node.free_units();
        assert_eq!(before, UNITS_PER_GPU + 100 * 7);
        // MPS above the policy's max is never offered.
        let big = ask(800, TRUSTED, 4);
        assert!(candidates(&node, &big).iter().all(|c| !matches!(c, Choice::Mps { .. })));
        node.release(&Choice::Shared { gpu: 0 }, &s2);
        node.release(&Choice::Shared { gpu: 0 }, &s1);
        assert_eq!(node.gpus[0], GpuUse::Free);
        let m = Choice::Mig { gpu: 1, profile: "2g.20gb".into(), start: 2 };
        let a = ask(200, Allow::MIG_ONLY, 0);
        assert!(node.apply(&m, &a));
        assert!(!node.apply(&m, &a), "the same slots twice");
        assert_eq!(m.units(model, &a), 2000);
        node.release(&m, &a);
        assert_eq!(node.gpus[1], GpuUse::Free);
        assert_eq!(node.free_units(), 2 * UNITS_PER_GPU);
    }

    #[test]
    fn mixes_and_percent() {
        assert_eq!(mps_percent(1), 1);
        assert_eq!(mps_percent(850), 85);
        assert_eq!(mps_percent(851), 86);
        assert_eq!(mps_percent(999), 100);
        let mut c = DemandCounter::default();
        for m in 1..=200u32 {
            let allow = Allow { shared: m % 2 == 0, ..TRUSTED };
            c.record(h100(), &ask(m * 4, allow, 0));
            c.record(h100(), &Ask { gpus: m % 9 + 1, milli: 1000, ..ask(0, allow, 0) });
        }
        let mix = c.mix();
        assert!(mix.len() <= MAX_CLASSES);
        assert!(!mix.is_empty());
        assert_eq!(mix, c.mix(), "deterministic");
    }
}
