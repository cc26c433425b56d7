//! Hierarchical admission: may `tenant` have `request` now, and as what.
//!
//! Usage is kept per tenant path in two parts, what was admitted within guarantees and
//! what was borrowed; a path's usage is the sum over itself and everything under it, so
//! every grant counts against every ancestor.
//!
//! For each resource of the request, the quotas on the tenant's chain (itself and its
//! ancestors) that bound it decide, innermost first:
//!
//! 1. **Ceiling**: the path's whole usage (guaranteed + borrowed) plus the request must stay
//!    within every ceiling on the chain, or the request is refused, naming the path and the
//!    resource. A user's ceiling holds whatever its team's guarantee allows, and a
//!    project's borrowing counts against its team's ceiling. A request within its
//!    guarantees never finds a ceiling full of guaranteed work (guarantees fit under
//!    ceilings): where other tenants' borrowed work fills it, the answer is
//!    [`Decision::Reclaim`] from inside the innermost path whose ceiling it would cross.
//! 2. **Guarantee**: the request is *guaranteed* when, for every resource it asks that the
//!    chain bounds, some quota on the chain guarantees that resource and every guarantee on
//!    the chain still holds the path's guaranteed usage plus the request, counting as used
//!    the unused guarantees of that path's other guaranteed children ([`set_aside`]: a
//!    child's guarantee is set aside for it inside its parent's, and only the parent's
//!    remainder is shared by the tenants under no guaranteed child). Otherwise it is
//!    *borrowed* (a tenant with no guarantee at all only ever borrows). Borrowed usage is
//!    never counted against a guarantee.
//! 3. **Capacity**: a guaranteed request takes free capacity, and where borrowed work of
//!    other tenants holds what it needs, the answer is [`Decision::Reclaim`]. A borrowed
//!    request takes free capacity except what other paths' lending limits keep back of
//!    their unused guarantees; otherwise it waits ([`Decision::Wait`]). The capacity bounds
//!    every GPU model (a model it lacks, it has none of) and CPU and memory only where it
//!    names them.

use std::collections::BTreeMap;

use tessera_api::untrusted;

use crate::amount::{Resource, Resources};
use crate::spec::{is_within, QuotaTree};

/// How admitted work counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    /// Within the guarantees of its chain: never reclaimed.
    Guaranteed,
    /// Above a guarantee: runs on capacity lent by others, priced at the burst price, and
    /// may be reclaimed.
    Borrowed,
}

/// What one tenant path holds directly (not counting paths under it).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Held {
    pub guaranteed: Resources,
    pub borrowed: Resources,
}

impl Held {
    /// Guaranteed plus borrowed.
    pub fn total(&self) -> Resources {
        self.guaranteed.plus(&self.borrowed)
    }
}

/// Usage by tenant path, as the fleet's books say. Kept per tenant and, for every path on a
/// tenant's chain, for the path's whole subtree, so that [`Usage::of`] is a lookup (the
/// fleet's books ask it for every quota on a chain of every decision): O(depth) to add or
/// release, O(log paths) to read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Usage {
    by_tenant: BTreeMap<String, Held>,
    /// Path → what it and every path under it hold (every prefix of every tenant).
    subtree: BTreeMap<String, Held>,
    total: Held,
    /// Path → the part of its own guaranteed usage that is guarantee leased to nodes and
    /// unused there ([`Usage::add_leased`]); and the same for its whole subtree.
    leased: BTreeMap<String, Resources>,
    leased_subtree: BTreeMap<String, Resources>,
}

fn add_held(h: &mut Held, class: Class, r: &Resources) {
    match class {
        Class::Guaranteed => h.guaranteed.add(r),
        Class::Borrowed => h.borrowed.add(r),
    }
}

fn sub_held(h: &mut Held, class: Class, r: &Resources) {
    match class {
        Class::Guaranteed => h.guaranteed.sub(r),
        Class::Borrowed => h.borrowed.sub(r),
    }
}

impl Held {
    fn is_empty(&self) -> bool {
        self.guaranteed.is_empty() && self.borrowed.is_empty()
    }
}

impl Usage {
    /// Nothing in use.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records `resources` admitted to `tenant` as `class`.
    pub fn add(&mut self, tenant: &str, class: Class, resources: &Resources) {
        if resources.is_empty() {
            return;
        }
        add_held(self.by_tenant.entry(tenant.to_string()).or_default(), class, resources);
        for p in crate::spec::chain(tenant) {
            add_held(self.subtree.entry(p.to_string()).or_default(), class, resources);
        }
        add_held(&mut self.total, class, resources);
    }

    /// Books `resources` of `path`'s guarantee that nodes hold as leases and do not use
    /// (the coordinator's lease phantoms, `books.rs`): counted as `path`'s guaranteed usage,
    /// so that no guarantee is promised twice and no ceiling crossed whoever fills the
    /// leases, but used by nobody: what a lending limit keeps back of the unused guarantee
    /// ([`withheld`]) reads [`Usage::used_guaranteed`], which leaves it out.
    pub fn add_leased(&mut self, path: &str, resources: &Resources) {
        if resources.is_empty() {
            return;
        }
        self.add(path, Class::Guaranteed, resources);
        self.leased.entry(path.to_string()).or_default().add(resources);
        for p in crate::spec::chain(path) {
            self.leased_subtree.entry(p.to_string()).or_default().add(resources);
        }
    }

    /// Takes back `resources` booked with [`Usage::add_leased`] at `path` (at most what is
    /// booked there).
    pub fn release_leased(&mut self, path: &str, resources: &Resources) {
        let Some(leased) = self.leased.get_mut(path) else { return };
        let gone = resources.at_most(leased);
        leased.sub(&gone);
        if leased.is_empty() {
            self.leased.remove(path);
        }
        for p in crate::spec::chain(path) {
            if let Some(l) = self.leased_subtree.get_mut(p) {
                l.sub(&gone);
                if l.is_empty() {
                    self.leased_subtree.remove(p);
                }
            }
        }
        self.release_held(path, Class::Guaranteed, &gone);
    }

    /// Gives back `resources` that `tenant` held as `class` (at most what it holds; of its
    /// guaranteed usage, never what [`Usage::add_leased`] booked).
    pub fn release(&mut self, tenant: &str, class: Class, resources: &Resources) {
        let mut resources = resources.clone();
        if class == Class::Guaranteed {
            if let (Some(held), Some(leased)) =
                (self.by_tenant.get(tenant), self.leased.get(tenant))
            {
                let real = held.guaranteed.minus(leased);
                resources = resources.at_most(&real);
            }
        }
        self.release_held(tenant, class, &resources);
    }

    fn release_held(&mut self, tenant: &str, class: Class, resources: &Resources) {
        let Some(held) = self.by_tenant.get_mut(tenant) else { return };
        let before = held.clone();
        sub_held(held, class, resources);
        let gone = match class {
            Class::Guaranteed => before.guaranteed.minus(&held.guaranteed),
            Class::Borrowed => before.borrowed.minus(&held.borrowed),
        };
        if held.is_empty() {
            self.by_tenant.remove(tenant);
        }
        for p in crate::spec::chain(tenant) {
            if let Some(h) = self.subtree.get_mut(p) {
                sub_held(h, class, &gone);
                if h.is_empty() {
                    self.subtree.remove(p);
                }
            }
        }
        sub_held(&mut self.total, class, &gone);
    }

    /// What `path` and every path under it hold.
    pub fn of(&self, path: &str) -> Held {
        self.subtree.get(path).cloned().unwrap_or_default()
    }

    /// What `path` and every path under it have booked with [`Usage::add_leased`]: part of
    /// [`Usage::of`]'s guaranteed usage.
    pub fn leased_of(&self, path: &str) -> Resources {
        self.leased_subtree.get(path).cloned().unwrap_or_default()
    }

    /// What `path` and every path under it really use of their guarantees: their guaranteed
    /// usage less what is leased to nodes and unused there.
    pub fn used_guaranteed(&self, path: &str) -> Resources {
        self.of(path).guaranteed.minus(&self.leased_of(path))
    }

    /// What every tenant holds.
    pub fn total(&self) -> Held {
        self.total.clone()
    }

    /// Every tenant path that holds something directly.
    pub fn tenants(&self) -> impl Iterator<Item = (&str, &Held)> {
        self.by_tenant.iter().map(|(t, h)| (t.as_str(), h))
    }
}

/// A request refused because it would cross a ceiling.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "tenant {} asks for {}: that would take quota path {path} to {} of {}, above its ceiling of {} \
     (quotas.{path}.{}.ceiling)",
    untrusted(tenant),
    untrusted(&requested.to_string()),
    resource.show(in_use + requested.get(resource)),
    resource,
    resource.show(*ceiling),
    resource.spec_path()
)]
pub struct CeilingRefusal {
    /// The tenant that asked.
    pub tenant: String,
    /// What it asked for.
    pub requested: Resources,
    /// The quota path whose ceiling would be crossed (the tenant or an ancestor).
    pub path: String,
    /// The resource that would cross it.
    pub resource: Resource,
    /// The ceiling, in the resource's unit.
    pub ceiling: u64,
    /// What the path holds now (guaranteed + borrowed), in the resource's unit.
    pub in_use: u64,
}

/// The answer to one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Admit, counted as `class`. `over` names, for borrowed work, the quota path and
    /// resource whose guarantee it goes beyond (`None` where the chain guarantees nothing).
    Admit { class: Class, over: Option<(String, Resource)> },
    /// Within guarantee, but the capacity is lent out: reclaim at least `short` from other
    /// tenants' borrowed work ([`crate::choose_victims`]), then admit as guaranteed. With
    /// `under`, a ceiling of that path (on the tenant's chain) is full of other tenants'
    /// borrowed work: the victims must be charged inside it.
    Reclaim { short: Resources, under: Option<String> },
    /// Not now: the capacity (or, for borrowed work, the lendable capacity) is short of
    /// `short`. The request joins the fair queue ([`crate::fair_order`]).
    Wait { class: Class, short: Resources },
    /// Never, at today's usage: a ceiling would be crossed.
    Refuse(CeilingRefusal),
}

/// Decides `request` for `tenant` against `tree`, the fleet's `capacity` and its `usage`.
/// Pure: the caller records an admitted request with [`Usage::add`].
pub fn admit(
    tree: &QuotaTree,
    capacity: &Resources,
    usage: &Usage,
    tenant: &str,
    request: &Resources,
) -> Decision {
    let mut guaranteed = true;
    let mut over = None;
    let mut any_guarantee = false;
    // The first ceiling crossed, the innermost path whose ceiling is crossed, and by how
    // much each resource crosses its ceilings at most.
    let mut refusal: Option<CeilingRefusal> = None;
    let mut innermost: Option<(usize, String)> = None;
    let mut excess = Resources::new();
    for (resource, amount) in request.iter() {
        let mut bounded = false;
        let mut guarantee_here = false;
        let mut worst = 0u64;
        for (depth, quota) in tree.chain(tenant).enumerate() {
            let Some(limit) = quota.limits.get(resource) else { continue };
            bounded = true;
            let held = usage.of(&quota.path);
            if let Some(ceiling) = limit.ceiling {
                let in_use = held.total().get(resource);
                if in_use.saturating_add(amount) > ceiling {
                    worst = worst.max(in_use.saturating_add(amount) - ceiling);
                    if innermost.as_ref().is_none_or(|(d, _)| depth < *d) {
                        innermost = Some((depth, quota.path.clone()));
                    }
                    refusal.get_or_insert_with(|| CeilingRefusal {
                        tenant: tenant.to_string(),
                        requested: request.clone(),
                        path: quota.path.clone(),
                        resource: resource.clone(),
                        ceiling,
                        in_use,
                    });
                }
            }
            if let Some(g) = limit.guarantee {
                guarantee_here = true;
                let kept = set_aside(tree, usage, &quota.path, resource, tenant);
                if held.guaranteed.get(resource).saturating_add(kept).saturating_add(amount) > g
                    && over.is_none()
                {
                    over = Some((quota.path.clone(), resource.clone()));
                }
            }
        }
        any_guarantee |= guarantee_here;
        if bounded && !guarantee_here {
            guaranteed = false;
        }
        // Nothing on the chain bounds it, so none of it is set aside for this tenant; where
        // another quota guarantees it, what this tenant takes of it is that quota's, lent
        // (Kueue: no nominal quota, all of it borrowed), and it runs borrowed so that a
        // reclaim can take it back. Named: the nearest quota on the chain (where a
        // guarantee of it would go), else the tenant.
        if !bounded && amount > 0 && tree.guarantor(resource).is_some() {
            guaranteed = false;
            let nearest = tree.chain(tenant).next().map_or(tenant, |q| q.path.as_str());
            over.get_or_insert_with(|| (nearest.to_string(), resource.clone()));
        }
        excess.add(&Resources::new().with(resource.clone(), worst));
    }
    let class = if guaranteed && any_guarantee && over.is_none() {
        Class::Guaranteed
    } else {
        Class::Borrowed
    };
    if let Some(refusal) = refusal {
        // A ceiling would be crossed. Within guarantee, the ceiling is full of other
        // tenants' borrowed work (guarantees fit under ceilings): it is reclaimed from
        // inside the innermost path crossed, with what the fleet is short of besides.
        let Some((_, under)) = innermost.filter(|_| class == Class::Guaranteed) else {
            return Decision::Refuse(refusal);
        };
        let lent = usage
            .tenants()
            .filter(|(t, _)| is_within(t, &under) && !is_within(t, tenant))
            .fold(Resources::new(), |acc, (_, h)| acc.plus(&h.borrowed));
        let fleet = request.bounded_by(capacity);
        let short_fleet = fleet.minus(&capacity.minus(&usage.total().total()));
        let mut short = excess;
        for (r, a) in short_fleet.iter() {
            let more = a.saturating_sub(short.get(r));
            short.add(&Resources::new().with(r.clone(), more));
        }
        return if short.fits_in(&lent) {
            Decision::Reclaim { short, under: Some(under) }
        } else {
            Decision::Refuse(refusal)
        };
    }
    // What the fleet's capacity bounds (CPU and memory only where it names them).
    let request = &request.bounded_by(capacity);
    let free = capacity.minus(&usage.total().total());
    match class {
        Class::Guaranteed => {
            if request.fits_in(&free) {
                return Decision::Admit { class, over: None };
            }
            let lent = usage
                .tenants()
                .filter(|(t, _)| !is_within(t, tenant))
                .fold(Resources::new(), |acc, (_, h)| acc.plus(&h.borrowed));
            let short = request.minus(&free);
            if short.fits_in(&lent) {
                Decision::Reclaim { short, under: None }
            } else {
                Decision::Wait { class, short }
            }
        }
        Class::Borrowed => {
            let lendable = free.minus(&withheld(tree, usage, tenant));
            if request.fits_in(&lendable) {
                Decision::Admit { class, over }
            } else {
                Decision::Wait { class, short: request.minus(&lendable) }
            }
        }
    }
}

/// What `path`'s guarantee of `resource` keeps for its other children (Kueue's nominal
/// quota, the design's tree): for each nearest descendant of `path` that guarantees
/// `resource` and is not on `tenant`'s chain, the part of its guarantee it does not use
/// (its guarantee less its subtree's guaranteed usage, never below zero). A tenant of
/// `path` counts it as used: only `path`'s remainder (its guarantee less its guaranteed
/// children's) is shared by the tenants under no guaranteed child, and a child's
/// guarantee is there for it whoever else asks.
pub fn set_aside(
    tree: &QuotaTree,
    usage: &Usage,
    path: &str,
    resource: &Resource,
    tenant: &str,
) -> u64 {
    tree.guaranteed_children(path, resource)
        .filter(|c| !is_within(tenant, &c.path))
        .map(|c| {
            let g = c.limits.get(resource).and_then(|l| l.guarantee).unwrap_or(0);
            g.saturating_sub(usage.of(&c.path).guaranteed.get(resource))
        })
        .fold(0u64, u64::saturating_add)
}

/// What other paths' lending limits keep back from a borrower in `tenant`: for each
/// resource, over the quotas off `tenant`'s chain that set a lending limit of it (paths
/// under `tenant` included: a lending limit binds every other tenant), each path's unused
/// guarantee beyond its lending limit, or what the lending limits nearest under it keep
/// back if that is more (a project's tighter limit holds inside a team's looser one), at
/// most the path's unused guarantee; summed over the outermost such paths. Unused is what
/// the path does not really use ([`Usage::used_guaranteed`]): its guarantee leased to nodes
/// and unused there is kept back too.
pub fn withheld(tree: &QuotaTree, usage: &Usage, tenant: &str) -> Resources {
    // The nearest path above `path`, off the tenant's chain, that sets a lending limit of
    // `resource` (the chain's paths are above every path off it that they hold).
    let lender_above = |path: &str, resource: &Resource| -> Option<String> {
        crate::spec::chain(path)
            .skip(1)
            .take_while(|p| !is_within(tenant, p))
            .find(|p| {
                tree.get(p)
                    .and_then(|q| q.limits.get(resource))
                    .is_some_and(|l| l.guarantee.is_some() && l.lending_limit.is_some())
            })
            .map(str::to_string)
    };
    let mut lenders: Vec<(&str, &Resource, u64, u64)> = Vec::new();
    for quota in tree.iter().filter(|q| !is_within(tenant, &q.path)) {
        for (resource, limit) in &quota.limits {
            if let (Some(g), Some(lend)) = (limit.guarantee, limit.lending_limit) {
                lenders.push((quota.path.as_str(), resource, g, lend));
            }
        }
    }
    // Deepest first: a path's nearest lenders under it are done before it.
    lenders.sort_by_key(|(p, ..)| std::cmp::Reverse(crate::spec::chain(p).count()));
    let mut below: BTreeMap<(String, Resource), u64> = BTreeMap::new();
    let mut out = Resources::new();
    for (path, resource, g, lend) in lenders {
        // Really unused: guarantee leased to nodes and unused there is still unused, and
        // kept back like the rest (it takes no capacity until a node fills its lease).
        let unused = g.saturating_sub(usage.used_guaranteed(path).get(resource));
        let inner = below.remove(&(path.to_string(), resource.clone())).unwrap_or(0);
        let kept = unused.saturating_sub(lend).max(inner.min(unused));
        match lender_above(path, resource) {
            Some(up) => {
                let slot = below.entry((up, resource.clone())).or_default();
                *slot = slot.saturating_add(kept);
            }
            None => out.add(&Resources::new().with(resource.clone(), kept)),
        }
    }
    out
}
