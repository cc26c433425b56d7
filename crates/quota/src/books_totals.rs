//! The books' running totals (issue 28): what every decision and every lease computation
//! reads, kept up to date as holdings, admissions, holds, reservations and leases change,
//! so that no request walks the fleet. Before, each admission rebuilt the fleet's usage and
//! every node's lease phantoms (O(nodes)), and each sync could recompute every node's
//! leases; at 6,250 nodes the coordinator fell behind its own syncs.
//!
//! * Per node ([`NodeAgg`]): its guaranteed listed holdings (what its leases absorb), all
//!   its guaranteed use (listed, pending, held for a claimant), everything on it (its free
//!   capacity), its lease contribution per guaranteed path (`u_n + unused lease_n`: what
//!   its own lease computation takes out of the fleet's), and what it adds to the fleet's
//!   totals: its lease phantoms and its unused leases (the status' `leased`). A lease's
//!   `elsewhere` is the fleet's guaranteed real use plus its unused leases, less the
//!   node's contribution: guaranteed use on a node the books do not know yet (granted
//!   after a failover, before its first sync) or reserved for a gang counts too. A node's aggregate is
//!   rebuilt from its own entries (O(its holdings)) whenever one of them changes, and its
//!   part of the totals replaced.
//! * Fleet ([`Totals`]): capacity, real usage (holdings, pending, holds, gang
//!   reservations: changed item by item), the sums of the node parts above, and per path
//!   the nodes whose phantom there is not empty (the holders a lease recall cuts).
//! * A generation that moves with every change: a node's leases are computed again only
//!   when it moved since they were last computed (a quiet fleet's syncs cost a comparison).
//!
//! `check_totals` (tests) recomputes all of it from scratch and compares.

use std::collections::{BTreeMap, BTreeSet};

use super::{
    phantoms_of, Books, ClaimKey, Class, Entry, Gang, NodeContainer, Pending, Reclaim, Resource,
    Resources, TenantGang, Usage,
};
use crate::spec::QuotaTree;

/// What one node adds to the books' totals, and what its decisions read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct NodeAgg {
    /// Guaranteed holdings the node listed: what its leases absorb.
    pub(super) base: Usage,
    /// Every guaranteed use on the node: listed, pending, held for a claimant there.
    pub(super) all: Usage,
    /// Everything on the node: listed, pending, held (its free capacity).
    pub(super) used: Resources,
    /// Its lease phantoms (netted over nested paths).
    pub(super) phantoms: BTreeMap<String, Resources>,
    /// Per guaranteed path, the guaranteed resources only: all its guaranteed use there
    /// plus its lease's unused part.
    pub(super) contrib: BTreeMap<String, Resources>,
    /// Per guaranteed path: its lease's unused part (lease − listed guaranteed holdings).
    pub(super) unused: BTreeMap<String, Resources>,
}

/// The fleet's running totals.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Totals {
    pub(super) capacity: Resources,
    /// Holdings, pending admissions, capacity held for claimants, gang reservations.
    pub(super) real: Usage,
    pub(super) phantoms: BTreeMap<String, Resources>,
    pub(super) phantom_total: Resources,
    pub(super) unused: BTreeMap<String, Resources>,
    /// Path → nodes whose phantom at the path is not empty.
    pub(super) holders: BTreeMap<String, BTreeSet<String>>,
}

fn add_map(into: &mut BTreeMap<String, Resources>, from: &BTreeMap<String, Resources>) {
    for (p, r) in from {
        into.entry(p.clone()).or_default().add(r);
    }
}

fn sub_map(into: &mut BTreeMap<String, Resources>, from: &BTreeMap<String, Resources>) {
    for (p, r) in from {
        if let Some(x) = into.get_mut(p) {
            x.sub(r);
            if x.is_empty() {
                into.remove(p);
            }
        }
    }
}

/// A node's derived parts (phantoms, contributions, unused leases) under `tree`.
pub(super) fn derive(
    tree: &QuotaTree,
    leases: &BTreeMap<String, Resources>,
    agg: &NodeAgg,
) -> (BTreeMap<String, Resources>, BTreeMap<String, Resources>, BTreeMap<String, Resources>) {
    let phantoms = phantoms_of(tree, leases, &agg.base);
    let mut contrib = BTreeMap::new();
    let mut unused = BTreeMap::new();
    for q in tree.iter() {
        let (mut c, mut u) = (Resources::new(), Resources::new());
        let (base, all) = (agg.base.of(&q.path).guaranteed, agg.all.of(&q.path).guaranteed);
        for (res, limit) in &q.limits {
            if limit.guarantee.is_none() {
                continue;
            }
            let leased = leases.get(&q.path).map_or(0, |r| r.get(res));
            let spare = leased.saturating_sub(base.get(res));
            u.add(&Resources::new().with(res.clone(), spare));
            c.add(&Resources::new().with(res.clone(), all.get(res).saturating_add(spare)));
        }
        if !c.is_empty() {
            contrib.insert(q.path.clone(), c);
        }
        if !u.is_empty() {
            unused.insert(q.path.clone(), u);
        }
    }
    (phantoms, contrib, unused)
}

impl Books {
    /// Every real use counted (holdings, pending, holds, reservations) changes the
    /// generation: leases computed before it are due again.
    pub(super) fn real_add(&mut self, tenant: &str, class: Class, r: &Resources) {
        self.totals.real.add(tenant, class, r);
        self.generation = self.generation.wrapping_add(1);
    }

    pub(super) fn real_release(&mut self, tenant: &str, class: Class, r: &Resources) {
        self.totals.real.release(tenant, class, r);
        self.generation = self.generation.wrapping_add(1);
    }

    /// Rebuilds `node`'s aggregate from its own entries (holdings, pending admissions and
    /// holds on it) and replaces its part of the totals. A node the books do not know has
    /// no part.
    pub(super) fn refresh_node(&mut self, node: &str) {
        let Some(nb) = self.nodes.get(node) else { return };
        let mut agg = NodeAgg::default();
        for e in nb.holdings.values() {
            agg.used.add(&e.resources);
            if e.class == Class::Guaranteed {
                agg.base.add(&e.tenant, Class::Guaranteed, &e.resources);
                agg.all.add(&e.tenant, Class::Guaranteed, &e.resources);
            }
        }
        for (_, p) in on_node(&self.pending, node) {
            agg.used.add(&p.entry.resources);
            if p.entry.class == Class::Guaranteed {
                agg.all.add(&p.entry.tenant, Class::Guaranteed, &p.entry.resources);
            }
        }
        for ((_, tenant, _), r) in claims_on(&self.reclaims, node) {
            agg.used.add(&r.resources);
            if r.class() == Class::Guaranteed {
                agg.all.add(tenant, Class::Guaranteed, &r.resources);
            }
        }
        let empty = QuotaTree::default();
        let tree = self.tree.clone();
        let tree = tree.as_deref().unwrap_or(&empty);
        let (phantoms, contrib, unused) = derive(tree, &nb.booked_leases(), &agg);
        (agg.phantoms, agg.contrib, agg.unused) = (phantoms, contrib, unused);
        if agg == nb.agg {
            return;
        }
        let Some(nb) = self.nodes.get_mut(node) else { return };
        let old = std::mem::replace(&mut nb.agg, agg);
        replace_part(&mut self.totals, node, &old, &nb.agg);
        self.generation = self.generation.wrapping_add(1);
    }

    /// Every node's part again (a new tree changes which paths have guarantees).
    pub(super) fn refresh_all(&mut self) {
        let nodes: Vec<String> = self.nodes.keys().cloned().collect();
        for n in nodes {
            self.refresh_node(&n);
        }
    }

    /// Records a holding of `node` in the indexes and the totals (not in the node's map).
    pub(super) fn index_holding(&mut self, node: &str, container: &str, e: &Entry) {
        self.real_add(&e.tenant, e.class, &e.resources);
        let key = NodeContainer(node.to_string(), container.to_string());
        self.changes.holding(key.clone());
        if e.class == Class::Borrowed {
            self.borrowed_idx.insert(key.clone());
        }
        if let Some(g) = &e.gang {
            self.gang_idx.entry(TenantGang(e.tenant.clone(), g.clone())).or_default().insert(key);
        }
    }

    /// Takes a holding of `node` out of the indexes and the totals.
    pub(super) fn unindex_holding(&mut self, node: &str, container: &str, e: &Entry) {
        self.real_release(&e.tenant, e.class, &e.resources);
        let key = NodeContainer(node.to_string(), container.to_string());
        self.changes.holding(key.clone());
        self.borrowed_idx.remove(&key);
        if let Some(g) = &e.gang {
            let gk = TenantGang(e.tenant.clone(), g.clone());
            if let Some(set) = self.gang_idx.get_mut(&gk) {
                set.remove(&key);
                if set.is_empty() {
                    self.gang_idx.remove(&gk);
                }
            }
        }
    }

    /// Replaces `node`'s holdings with `listed` (a sync): the totals and indexes follow the
    /// difference. Whether anything changed. The node's part of the totals is refreshed by
    /// the caller.
    pub(super) fn set_holdings(&mut self, node: &str, listed: BTreeMap<String, Entry>) -> bool {
        let Some(nb) = self.nodes.get_mut(node) else { return false };
        if nb.holdings == listed {
            return false;
        }
        let old = std::mem::replace(&mut nb.holdings, listed);
        let new = nb.holdings.clone();
        for (c, e) in &old {
            if new.get(c) != Some(e) {
                self.unindex_holding(node, c, e);
            }
        }
        for (c, e) in &new {
            if old.get(c) != Some(e) {
                self.index_holding(node, c, e);
            }
        }
        true
    }

    /// A holding of `node` ends (a release). Whether the books held it.
    pub(super) fn remove_holding(&mut self, node: &str, container: &str) -> bool {
        let Some(e) = self.nodes.get_mut(node).and_then(|nb| nb.holdings.remove(container)) else {
            return false;
        };
        self.unindex_holding(node, container, &e);
        self.changes.node(node);
        self.refresh_node(node);
        true
    }

    /// `node` holds `entry` as `container` from now on (a resize): the totals, the indexes
    /// and the durable state follow.
    pub(super) fn put_holding(&mut self, node: &str, container: &str, entry: Entry) {
        let Some(nb) = self.nodes.get_mut(node) else { return };
        let old = nb.holdings.insert(container.to_string(), entry.clone());
        if old.as_ref() == Some(&entry) {
            return;
        }
        if let Some(o) = &old {
            self.unindex_holding(node, container, o);
        }
        self.index_holding(node, container, &entry);
        self.changes.node(node);
        self.refresh_node(node);
    }

    /// An admission answered (written before it is answered).
    pub(super) fn insert_pending(&mut self, key: NodeContainer, p: Pending) {
        if let Some(old) = self.pending.remove(&key) {
            self.real_release(&old.entry.tenant, old.entry.class, &old.entry.resources);
        }
        self.real_add(&p.entry.tenant, p.entry.class, &p.entry.resources);
        self.changes.pending(&key, true);
        let node = key.0.clone();
        self.pending.insert(key, p);
        self.refresh_node(&node);
    }

    pub(super) fn remove_pending(&mut self, key: &NodeContainer) -> Option<Pending> {
        let p = self.pending.remove(key)?;
        self.real_release(&p.entry.tenant, p.entry.class, &p.entry.resources);
        self.changes.pending(key, false);
        self.refresh_node(&key.0);
        Some(p)
    }

    /// A reclaim starts (`urgent`: written before it is answered) or is put back.
    pub(super) fn insert_reclaim(&mut self, key: ClaimKey, r: Reclaim, urgent: bool) {
        if let Some(old) = self.reclaims.remove(&key) {
            self.real_release(&key.1, old.class(), &old.resources);
        }
        self.real_add(&key.1, r.class(), &r.resources);
        self.changes.reclaim(&key, urgent);
        self.next_expiry_ms = self.next_expiry_ms.min(r.hold_until().saturating_add(1));
        let node = key.0.clone();
        self.reclaims.insert(key, r);
        self.refresh_node(&node);
    }

    pub(super) fn remove_reclaim(&mut self, key: &ClaimKey) -> Option<Reclaim> {
        let r = self.reclaims.remove(key)?;
        self.real_release(&key.1, r.class(), &r.resources);
        self.changes.reclaim(key, false);
        self.refresh_node(&key.0);
        Some(r)
    }

    /// A gang starts assembling: its whole amount is reserved.
    pub(super) fn insert_gang(&mut self, key: TenantGang, g: Gang) {
        if let Some(old) = self.gangs.remove(&key) {
            self.real_release(&key.0, old.class, &old.reserved);
        }
        self.real_add(&key.0, g.class, &g.reserved);
        self.gangs.insert(key, g);
    }

    pub(super) fn remove_gang(&mut self, key: &TenantGang) -> Option<Gang> {
        let g = self.gangs.remove(key)?;
        self.real_release(&key.0, g.class, &g.reserved);
        Some(g)
    }

    /// From-scratch totals and indexes, compared with the running ones (tests).
    #[cfg(test)]
    pub(super) fn check_totals(&self) -> Result<(), String> {
        let mut real = Usage::new();
        let mut capacity = Resources::new();
        let mut borrowed = BTreeSet::new();
        let mut gangs: BTreeMap<TenantGang, BTreeSet<NodeContainer>> = BTreeMap::new();
        let mut t = Totals::default();
        for (n, nb) in &self.nodes {
            capacity.add(&nb.capacity);
            for (c, e) in &nb.holdings {
                real.add(&e.tenant, e.class, &e.resources);
                let key = NodeContainer(n.clone(), c.clone());
                if e.class == Class::Borrowed {
                    borrowed.insert(key.clone());
                }
                if let Some(g) = &e.gang {
                    gangs.entry(TenantGang(e.tenant.clone(), g.clone())).or_default().insert(key);
                }
            }
        }
        for p in self.pending.values() {
            real.add(&p.entry.tenant, p.entry.class, &p.entry.resources);
        }
        for ((_, tenant, _), r) in &self.reclaims {
            real.add(tenant, r.class(), &r.resources);
        }
        for (TenantGang(tenant, _), g) in &self.gangs {
            real.add(tenant, g.class, &g.reserved);
        }
        let empty = QuotaTree::default();
        let tree = self.tree.as_deref().unwrap_or(&empty);
        for (n, nb) in &self.nodes {
            let mut agg = NodeAgg::default();
            for e in nb.holdings.values() {
                agg.used.add(&e.resources);
                if e.class == Class::Guaranteed {
                    agg.base.add(&e.tenant, e.class, &e.resources);
                    agg.all.add(&e.tenant, e.class, &e.resources);
                }
            }
            for (NodeContainer(pn, _), p) in &self.pending {
                if pn == n {
                    agg.used.add(&p.entry.resources);
                    if p.entry.class == Class::Guaranteed {
                        agg.all.add(&p.entry.tenant, Class::Guaranteed, &p.entry.resources);
                    }
                }
            }
            for ((rn, tenant, _), r) in &self.reclaims {
                if rn == n {
                    agg.used.add(&r.resources);
                    if r.class() == Class::Guaranteed {
                        agg.all.add(tenant, Class::Guaranteed, &r.resources);
                    }
                }
            }
            (agg.phantoms, agg.contrib, agg.unused) = derive(tree, &nb.booked_leases(), &agg);
            if agg != nb.agg {
                return Err(format!("node {n}: running {:?}, from scratch {agg:?}", nb.agg));
            }
            replace_part(&mut t, n, &NodeAgg::default(), &agg);
        }
        t.capacity = capacity;
        t.real = real;
        if t != self.totals {
            return Err(format!("totals: running {:?}, from scratch {t:?}", self.totals));
        }
        if borrowed != self.borrowed_idx {
            return Err(format!("borrowed index {:?} != {borrowed:?}", self.borrowed_idx));
        }
        if gangs != self.gang_idx {
            return Err(format!("gang index {:?} != {gangs:?}", self.gang_idx));
        }
        let stopping: BTreeSet<String> = self
            .nodes
            .iter()
            .filter(|(_, nb)| !nb.stopping.is_empty())
            .map(|(n, _)| n.clone())
            .collect();
        if stopping != self.stopping_idx {
            return Err(format!("stopping index {:?} != {stopping:?}", self.stopping_idx));
        }
        Ok(())
    }
}

/// Takes `old` (a node's part) out of the totals `t` and puts `new` in.
pub(super) fn replace_part(t: &mut Totals, node: &str, old: &NodeAgg, new: &NodeAgg) {
    sub_map(&mut t.phantoms, &old.phantoms);
    add_map(&mut t.phantoms, &new.phantoms);
    for r in old.phantoms.values() {
        t.phantom_total.sub(r);
    }
    for r in new.phantoms.values() {
        t.phantom_total.add(r);
    }
    sub_map(&mut t.unused, &old.unused);
    add_map(&mut t.unused, &new.unused);
    for p in old.phantoms.keys() {
        if let Some(h) = t.holders.get_mut(p) {
            h.remove(node);
            if h.is_empty() {
                t.holders.remove(p);
            }
        }
    }
    for (p, r) in &new.phantoms {
        if !r.is_empty() {
            t.holders.entry(p.clone()).or_default().insert(node.to_string());
        }
    }
}

/// The entries of `map` (keyed `(node, _)`) on `node`.
pub(super) fn on_node<'a, V>(
    map: &'a BTreeMap<NodeContainer, V>,
    node: &'a str,
) -> impl Iterator<Item = (&'a NodeContainer, &'a V)> + 'a {
    map.range(NodeContainer(node.to_string(), String::new())..)
        .take_while(move |(k, _)| k.0 == node)
}

/// The entries of `map` (reclaims, keyed by claim) on `node`.
pub(super) fn claims_on<'a, V>(
    map: &'a BTreeMap<ClaimKey, V>,
    node: &'a str,
) -> impl Iterator<Item = (&'a ClaimKey, &'a V)> + 'a {
    map.range((node.to_string(), String::new(), String::new())..)
        .take_while(move |((n, _, _), _)| n == node)
}

/// Floors `amount` of `res` to whole units (GPUs, cores, GiB): a node's share of a
/// guarantee below one unit is not leased (issue 28; module docs, "Leases").
pub(super) fn whole_units(res: &Resource, amount: u64) -> u64 {
    let unit = match res {
        Resource::Gpu(_) => crate::MICRO_PER_GPU,
        Resource::Cpu => crate::MILLI_PER_CORE,
        Resource::Memory => crate::MIB_PER_GIB,
    };
    amount - amount % unit
}
