//! Which borrowed work to stop so a tenant gets its guarantee back, chosen by the work it
//! would lose.
//!
//! A **unit** is one container, or a whole gang (`tessera.io/gang`: stopped whole). A unit
//! is a candidate when some member runs borrowed and every member is charged outside the
//! claimant's subtree. What stopping it loses ([`Candidate::lost_s`]): the seconds it has
//! run, or, for work that writes a checkpoint on SIGTERM (`tessera.io/preemption:
//! checkpoint` on every member), only the grace period it spends writing one (at most what
//! it has run). Its **cost** is that time weighted by its size, the dominant share of the
//! fleet it holds ([`dominant_share`]), so a big unit is dearer to lose than a small one of
//! the same age. A unit younger than its tenant's `min_runtime_s`
//! ([`QuotaTree::min_runtime_s`]) is protected: no reclaim takes it until then.
//!
//! A unit is taken only while its tenant still **borrows** ([`borrowing_short`]) a resource
//! the claimant is short of: some quota on its chain, below the paths it shares with the
//! claimant, uses more of it than it guarantees, or the remainder it shares of a path
//! holding the claimant is used beyond it (the claimant's request counted where the
//! claimant shares it too), or nothing on its chain bounds it and the claimant is
//! guaranteed it (Kueue takes candidates from queues borrowing what the preemptor needs).
//! Work admitted borrowed whose paths have since come back within their guarantees (their
//! guaranteed work ended) is not taken: it would be owed back at once, and its tenant would
//! reclaim in turn (Kueue reclaims only from a ClusterQueue that borrows; KAI only from a
//! queue over its deserved quota).
//!
//! Candidates are taken cheapest first (ties: the tenant whose borrowed work has the
//! largest dominant share, then the youngest unit), only those holding something still
//! short and whose tenant still borrows with the units taken before them gone, until the
//! shortfall is covered; then every taken unit the others already cover for is spared,
//! dearest first, so a reclaim stops no more than the claimant needs.
//!
//! **Consolidation** ([`choose_victims_to_consolidate`], issue 27) moves work rather than
//! reclaiming it: a request admitted *borrowed* that its node cannot place, though the
//! fleet has room, may stop other tenants' borrowed containers on that node that checkpoint
//! on SIGTERM (they lose at most their grace period and resume from the checkpoint), only
//! where each one fits on the room another node has free, so it can run again at once.
//! Gangs are never moved. Whether the move is worth it is the caller's ski-rental test
//! ([`crate::worth_reclaiming`]: the victims lose no more than the request has waited).
//! KAI scheduler's consolidation action moves pods the same way, only where every one of
//! them can be placed again.

use std::collections::BTreeMap;

use crate::admit::{Class, Usage};
use crate::amount::{Resource, Resources};
use crate::drf::dominant_share;
use crate::spec::{is_within, Quota, QuotaTree};

/// One piece of running work, as the books hold it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Running {
    /// The container's id.
    pub id: String,
    /// The tenant path it is charged to.
    pub tenant: String,
    /// What it holds.
    pub resources: Resources,
    /// How it was admitted.
    pub class: Class,
    /// When it started, ms on the clock of the caller's `now_ms`.
    pub started_ms: u64,
    /// Its gang (`tessera.io/gang`), if any: a gang is stopped whole.
    pub gang: Option<String>,
    /// It writes a checkpoint when it gets SIGTERM (`tessera.io/preemption: checkpoint`):
    /// stopping it loses only the grace period it spends writing one.
    pub checkpoints: bool,
}

/// A unit a reclaim could stop, and what stopping it now would lose.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// The ids of its members.
    pub ids: Vec<String>,
    /// The tenant it is charged to.
    pub tenant: String,
    /// What it holds.
    pub resources: Resources,
    /// The part of `resources` its members admitted within guarantee hold (a gang may mix
    /// both classes): a victim leaves its tenant's usage as the classes it runs as.
    pub guaranteed: Resources,
    /// Its gang, if any.
    pub gang: Option<String>,
    /// Seconds of work lost (run time, or the grace period of work that checkpoints).
    pub lost_s: u64,
    /// Every member checkpoints on SIGTERM.
    pub checkpoints: bool,
    /// `lost_s` × the dominant share of the fleet it holds.
    pub cost: f64,
    /// When its youngest member started (ms).
    pub started_ms: u64,
}

/// Borrowed work that a reclaim may not take yet ([`QuotaTree::min_runtime_s`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Protected {
    /// The unit.
    pub candidate: Candidate,
    /// When its minimum run time ends (ms).
    pub until_ms: u64,
}

/// The candidates for a reclaim by `claimant` at `now_ms`, cheapest first, and those its
/// tenants' minimum run time protects (in the order they become free).
pub fn victim_order(
    running: &[Running],
    tree: &QuotaTree,
    capacity: &Resources,
    claimant: &str,
    now_ms: u64,
) -> (Vec<Candidate>, Vec<Protected>) {
    let mut units: BTreeMap<String, Vec<&Running>> = BTreeMap::new();
    for r in running {
        let key = match &r.gang {
            Some(g) => format!("gang {g}"),
            None => format!("container {}", r.id),
        };
        units.entry(key).or_default().push(r);
    }
    let mut borrowed: BTreeMap<&str, Resources> = BTreeMap::new();
    let mut open = Vec::new();
    let mut protected = Vec::new();
    for (key, members) in &units {
        if !members.iter().any(|m| m.class == Class::Borrowed)
            || members.iter().any(|m| is_within(&m.tenant, claimant))
        {
            continue;
        }
        let tenant = members[0].tenant.clone();
        let resources = members.iter().fold(Resources::new(), |acc, m| acc.plus(&m.resources));
        let guaranteed = members
            .iter()
            .filter(|m| m.class == Class::Guaranteed)
            .fold(Resources::new(), |acc, m| acc.plus(&m.resources));
        let started_ms = members.iter().map(|m| m.started_ms).max().unwrap_or(0);
        let ran_s = now_ms.saturating_sub(started_ms) / 1000;
        let checkpoints = members.iter().all(|m| m.checkpoints);
        let lost_s = if checkpoints { ran_s.min(tree.grace_period_s(&tenant)) } else { ran_s };
        borrowed.entry(members[0].tenant.as_str()).or_default().add(&resources);
        let c = Candidate {
            ids: members.iter().map(|m| m.id.clone()).collect(),
            cost: dominant_share(&resources, capacity) * lost_s as f64,
            tenant,
            resources,
            guaranteed,
            gang: members[0].gang.clone(),
            lost_s,
            checkpoints,
            started_ms,
        };
        let min_runtime_s = tree.min_runtime_s(&c.tenant);
        let until_ms = started_ms.saturating_add(min_runtime_s.saturating_mul(1000));
        // Without a minimum run time nothing is protected, even work whose start lies
        // after `now_ms` (a node's clock ahead of the books').
        if min_runtime_s > 0 && now_ms < until_ms {
            protected.push(Protected { candidate: c, until_ms });
        } else {
            open.push((key.clone(), c));
        }
    }
    let share = |t: &str| borrowed.get(t).map_or(0.0, |r| dominant_share(r, capacity));
    open.sort_by(|(ka, a), (kb, b)| {
        a.cost
            .total_cmp(&b.cost)
            .then_with(|| share(&b.tenant).total_cmp(&share(&a.tenant)))
            .then(b.started_ms.cmp(&a.started_ms))
            .then_with(|| ka.cmp(kb))
    });
    protected
        .sort_by(|a, b| a.until_ms.cmp(&b.until_ms).then(a.candidate.ids.cmp(&b.candidate.ids)));
    (open.into_iter().map(|(_, c)| c).collect(), protected)
}

/// A unit chosen as a victim, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Chosen {
    pub candidate: Candidate,
    /// Why this unit, in words (for the preempt event).
    pub why: String,
    /// Consolidation: the node promised room for it.
    pub to: Option<String>,
}

/// What [`choose_victims`] decided.
#[derive(Debug, Clone, PartialEq)]
pub struct Victims {
    /// The units to stop, cheapest first.
    pub chosen: Vec<Chosen>,
    /// Their total cost (dominant-share seconds lost).
    pub cost: f64,
}

/// Why no victims were chosen.
#[derive(Debug, Clone, PartialEq)]
pub enum NoVictims {
    /// All the borrowed work of other tenants together cannot cover the shortfall.
    Short,
    /// It could, but some of what it needs is within its minimum run time until
    /// `until_ms` (the earliest time enough of it is free to take).
    Protected { until_ms: u64 },
}

/// Whether `tenant`'s work of `resources`, counted in `usage`, runs on capacity lent to it
/// as `claimant` sees it, once the claimant holds `claim` (its request, counted as its
/// guaranteed usage): for some resource it holds that the claim asks (every resource of
/// `claim` is judged as one the claimant is short of), every quota on `tenant`'s chain that
/// does not hold `claimant` and guarantees that resource uses more of it than it
/// guarantees, its whole subtree counted, guaranteed or borrowed (guarantee leased to
/// nodes and unused there is not use). A path within its guarantee holds no one else's
/// capacity, whatever its children borrow from each other inside it; a tenant within its
/// own guarantee borrows nothing, whatever its parent holds of others'. Where no such
/// quota guarantees it, the tenant shares the remainder of the innermost path holding the
/// claimant that does (its guarantee less its guaranteed children's): the remainder's
/// tenants together borrow only what they use beyond the remainder, the claimant's `claim`
/// counted among them where the claimant shares it too (is under no guaranteed child of
/// that path). Where the chain bounds the resource but nothing on it guarantees it, any
/// use of it is lent; where nothing on the chain bounds it, all of it is lent if the
/// claimant asks for it under a guarantee of it on its own chain (nothing of it was set
/// aside for `tenant`), and it decides nothing otherwise; where nothing on the chain
/// bounds any of its resources, it is judged by the class it was admitted with.
pub fn borrowing(
    tree: &QuotaTree,
    usage: &Usage,
    tenant: &str,
    resources: &Resources,
    claimant: &str,
    claim: &Resources,
) -> bool {
    borrowing_short(tree, usage, tenant, resources, claimant, claim, claim)
}

/// [`borrowing`] judging only the resources the claimant is `short` of: a tenant that
/// borrows only what the claimant has room for gives up nothing for it (Kueue takes
/// candidates from queues borrowing the resources the preemptor needs; a claimant short
/// of GPUs would otherwise take the GPUs of a tenant within its GPU guarantee for the
/// cores it borrows: `tests::a_claim_takes_no_work_whose_tenant_borrows_only_what_the_claim_is_not_short_of`,
/// `tests::a_gpu_short_claim_asking_a_core_it_is_not_short_of_takes_the_gpu_borrower`).
pub fn borrowing_short(
    tree: &QuotaTree,
    usage: &Usage,
    tenant: &str,
    resources: &Resources,
    claimant: &str,
    claim: &Resources,
    short: &Resources,
) -> bool {
    let used = |path: &str, resource: &Resource| {
        usage.of(path).total().get(resource).saturating_sub(usage.leased_of(path).get(resource))
    };
    // Whether its chain bounds any resource it holds (short or not): one that bounds
    // nothing of it is judged by its class at the end, one that does by what it uses.
    let mut bounded = false;
    for (resource, amount) in resources.iter() {
        if amount == 0 {
            continue;
        }
        let chain_bounds = tree.chain(tenant).any(|q| q.limits.contains_key(resource));
        bounded |= chain_bounds;
        if short.get(resource) == 0 {
            continue;
        }
        let guarantee = |q: &Quota| q.limits.get(resource).and_then(|l| l.guarantee);
        if !chain_bounds {
            // Nothing on its chain bounds it, so none of it is set aside for this tenant
            // (Kueue: no nominal quota, all of it borrowed): where the claimant, short of it,
            // asks for it under a guarantee of it, all of it is lent; otherwise it decides
            // nothing.
            if claim.get(resource) > 0 && tree.chain(claimant).any(|q| guarantee(q).is_some()) {
                return true;
            }
            continue;
        }
        // Its own paths (those not holding the claimant) that guarantee it: it borrows
        // where every one of them uses more than it guarantees.
        let own: Vec<(&str, u64)> = tree
            .chain(tenant)
            .filter(|q| !is_within(claimant, &q.path))
            .filter_map(|q| guarantee(q).map(|g| (q.path.as_str(), g)))
            .collect();
        if !own.is_empty() {
            if own.iter().all(|&(p, g)| used(p, resource) > g) {
                return true;
            }
            continue;
        }
        // None of its own: it shares the remainder of the innermost path holding the
        // claimant that guarantees it, and borrows where the remainder's tenants together
        // use more than the remainder, the claimant's claim counted where it shares it.
        let Some(q) = tree.chain(tenant).find(|q| guarantee(q).is_some()) else {
            // Bounded, guaranteed nowhere on its chain: any use of it is lent.
            return true;
        };
        let children: Vec<_> = tree.guaranteed_children(&q.path, resource).collect();
        let (mut pool, mut remainder) = (used(&q.path, resource), guarantee(q).unwrap_or(0));
        for c in &children {
            pool = pool.saturating_sub(used(&c.path, resource));
            remainder = remainder.saturating_sub(guarantee(c).unwrap_or(0));
        }
        if !children.iter().any(|c| is_within(claimant, &c.path)) {
            pool = pool.saturating_add(claim.get(resource));
        }
        if pool > remainder {
            return true;
        }
    }
    !bounded
}

/// The victims that free at least `short` for `claimant`'s `claim` (its whole request, of
/// which `short` is what the free capacity lacks) at `now_ms` where the fleet (or a
/// ceiling) is short: only work whose tenants still [`borrowing`] once the claimant holds
/// its claim (the module documentation says how they are chosen). `usage` holds all
/// running work (`running` may be only some of it: one node's).
#[allow(clippy::too_many_arguments)]
pub fn choose_victims(
    running: &[Running],
    usage: &Usage,
    tree: &QuotaTree,
    capacity: &Resources,
    claimant: &str,
    claim: &Resources,
    short: &Resources,
    now_ms: u64,
) -> Result<Victims, NoVictims> {
    let (order, protected) = victim_order(running, tree, capacity, claimant, now_ms);
    cover(&order, &protected, usage, tree, (claimant, claim), short, true)
        .map(|taken| victims(&order, taken, short, false))
}

/// [`choose_victims`] where the fleet has room for the claim but not on the node it asks
/// on (`running` is that node's): work whose tenants still borrow if it frees enough, else
/// any borrowed work there, work of tenants back within their guarantees too (they find
/// room elsewhere in the fleet; without it the claim waits for work on that node to end).
#[allow(clippy::too_many_arguments)]
pub fn choose_victims_for_placement(
    running: &[Running],
    usage: &Usage,
    tree: &QuotaTree,
    capacity: &Resources,
    claimant: &str,
    claim: &Resources,
    short: &Resources,
    now_ms: u64,
) -> Result<Victims, NoVictims> {
    let (order, protected) = victim_order(running, tree, capacity, claimant, now_ms);
    let who = (claimant, claim);
    match cover(&order, &protected, usage, tree, who, short, true) {
        Err(NoVictims::Short) => cover(&order, &protected, usage, tree, who, short, false)
            .map(|taken| victims(&order, taken, short, true)),
        other => other.map(|taken| victims(&order, taken, short, false)),
    }
}

/// One node other than the claim's, for [`choose_victims_to_consolidate`]: what it has
/// and what it has free, in the resources its capacity names (and every GPU model).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Room {
    /// The node's name (for the reasons given).
    pub node: String,
    /// Its capacity.
    pub capacity: Resources,
    /// Its free room.
    pub free: Resources,
}

/// Consolidation (module documentation): the units of `running` (the claim's node's) to
/// move so that `short` is freed for `claimant`'s borrowed request at `now_ms`: other
/// tenants' wholly borrowed containers that checkpoint on SIGTERM, not in a gang, past
/// their minimum run time, cheapest first, each taken only if `place_elsewhere` finds it
/// room on another node (it keeps that room taken for the next one, and names the node);
/// then every one the others already cover for is spared, dearest first. `None` when they
/// do not free `short`. [`first_fit`] places by what each node has free.
pub fn choose_victims_to_consolidate(
    running: &[Running],
    tree: &QuotaTree,
    capacity: &Resources,
    claimant: &str,
    short: &Resources,
    now_ms: u64,
    mut place_elsewhere: impl FnMut(&Candidate) -> Option<String>,
) -> Option<Victims> {
    if short.is_empty() {
        return None;
    }
    let (order, _protected) = victim_order(running, tree, capacity, claimant, now_ms);
    let mut left = short.clone();
    let mut taken = Vec::new();
    let mut dest: BTreeMap<usize, String> = BTreeMap::new();
    for (i, c) in order.iter().enumerate() {
        if left.is_empty() {
            break;
        }
        let movable = c.checkpoints && c.gang.is_none() && c.guaranteed.is_empty();
        if !movable || !c.resources.iter().any(|(r, _)| left.get(r) > 0) {
            continue;
        }
        let Some(to) = place_elsewhere(c) else { continue };
        left.sub(&c.resources);
        dest.insert(i, to);
        taken.push(i);
    }
    if !left.is_empty() {
        return None;
    }
    let mut v = victims(&order, taken, short, false);
    for c in &mut v.chosen {
        let i = order.iter().position(|o| o.ids == c.candidate.ids);
        c.to = i.and_then(|i| dest.get(&i)).cloned();
        let to = c.to.as_deref().unwrap_or("another node");
        c.why = format!(
            "moved to make room (consolidation): it checkpoints on SIGTERM, so it loses at \
             most {} s (its grace period, or what it has run), and node {to} has room for it \
             to resume there",
            c.candidate.lost_s
        );
    }
    Some(v)
}

/// [`choose_victims_to_consolidate`]'s placement by what each of `rooms` has free: the
/// first that holds the unit (in the resources its capacity names, and every GPU model),
/// whose free room it then takes.
pub fn first_fit(rooms: &mut [Room]) -> impl FnMut(&Candidate) -> Option<String> + '_ {
    move |c: &Candidate| {
        let room = rooms.iter_mut().find(|n| {
            let need = c.resources.only(|x| matches!(x, Resource::Gpu(_)) || n.capacity.get(x) > 0);
            need.fits_in(&n.free)
        })?;
        let need = c.resources.only(|x| matches!(x, Resource::Gpu(_)) || room.capacity.get(x) > 0);
        room.free.sub(&need);
        Some(room.node.clone())
    }
}

/// The units of `order` taken, cheapest first, until `short` is covered: with `strict`,
/// only while each one's tenant [`borrowing`] as the claimant holding its claim sees it;
/// else any.
fn cover(
    order: &[Candidate],
    protected: &[Protected],
    usage: &Usage,
    tree: &QuotaTree,
    (claimant, claim): (&str, &Resources),
    short: &Resources,
    strict: bool,
) -> Result<Vec<usize>, NoVictims> {
    let useful = |c: &Candidate, left: &Resources| left.iter().any(|(r, _)| c.resources.get(r) > 0);
    let mut left = short.clone();
    let mut after = usage.clone();
    let mut take = |c: &Candidate, left: &mut Resources| {
        let yes = useful(c, left)
            && (!strict
                || borrowing_short(tree, &after, &c.tenant, &c.resources, claimant, claim, short));
        if yes {
            left.sub(&c.resources);
            after.release(&c.tenant, Class::Guaranteed, &c.guaranteed);
            after.release(&c.tenant, Class::Borrowed, &c.resources.minus(&c.guaranteed));
        }
        yes
    };
    let mut taken: Vec<usize> = Vec::new();
    for (i, c) in order.iter().enumerate() {
        if left.is_empty() {
            break;
        }
        if take(c, &mut left) {
            taken.push(i);
        }
    }
    if left.is_empty() {
        return Ok(taken);
    }
    // Would the protected work cover it, and from when?
    for p in protected {
        if take(&p.candidate, &mut left) && left.is_empty() {
            return Err(NoVictims::Protected { until_ms: p.until_ms });
        }
    }
    Err(NoVictims::Short)
}

/// The units `taken` of `order` less those the others already cover for, with why each
/// was chosen (`fallback`: some tenant's work is taken though it no longer borrows).
fn victims(order: &[Candidate], taken: Vec<usize>, short: &Resources, fallback: bool) -> Victims {
    // Spare, dearest first, every unit the others already cover for.
    let mut kept = taken.clone();
    for &i in taken.iter().rev() {
        let rest = kept
            .iter()
            .filter(|&&j| j != i)
            .fold(Resources::new(), |acc, &j| acc.plus(&order[j].resources));
        if short.fits_in(&rest) {
            kept.retain(|&j| j != i);
        }
    }
    let dearer = |c: &Candidate| order.iter().filter(|o| o.cost > c.cost).count();
    let chosen: Vec<Chosen> = kept
        .iter()
        .map(|&i| {
            let c = &order[i];
            let lost = if c.checkpoints {
                format!(
                    "it checkpoints on SIGTERM, so it loses at most its grace period ({} s)",
                    c.lost_s
                )
            } else {
                format!(
                    "it loses {} s of {} it has run (no checkpoint: it restarts from zero)",
                    c.lost_s, c.resources
                )
            };
            let others = match dearer(c) {
                0 => String::new(),
                n => format!("; {n} other borrowed unit(s) would lose more"),
            };
            let gang = c
                .gang
                .as_ref()
                .map(|g| format!(" (gang {}, stopped whole)", tessera_api::untrusted(g)))
                .unwrap_or_default();
            let fallback = if fallback {
                "; no choice of work whose tenants borrow frees enough on this node, so work \
                 of tenants back within their guarantees is taken too (the fleet has room \
                 for it elsewhere)"
            } else {
                ""
            };
            Chosen {
                why: format!("chosen by the work it would lose{gang}: {lost}{others}{fallback}"),
                candidate: c.clone(),
                to: None,
            }
        })
        .collect();
    let cost = chosen.iter().map(|c| c.candidate.cost).sum();
    Victims { chosen, cost }
}
