//! Which borrowed work to stop so a tenant gets its guarantee back.

use std::collections::BTreeMap;

use crate::admit::Class;
use crate::amount::Resources;
use crate::drf::dominant_share;
use crate::spec::is_within;

/// One piece of running work, as the coordinator's books hold it.
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
    /// When it started (any monotonic unit); larger is younger.
    pub started: u64,
    /// Its gang (`tessera.io/gang`), if any: a gang is stopped whole.
    pub gang: Option<String>,
}

/// A unit of preemption: one container, or a whole gang.
#[derive(Debug, Clone)]
struct Unit<'a> {
    members: Vec<&'a Running>,
    tenant: &'a str,
    resources: Resources,
    started: u64,
    key: String,
}

/// The victims that free at least `short` for `claimant`, as ids of running work, or
/// `None` if all the borrowed work of other tenants together cannot.
///
/// Only borrowed work of tenants outside `claimant`'s subtree is taken. A gang with any
/// borrowed member is one unit and is taken whole. Units are taken one at a time: from
/// the tenant whose borrowed work has the largest dominant share of `capacity` (recomputed
/// after each unit), its youngest unit first (a gang's age is its youngest member's); only
/// units that hold something still short are taken, and taking stops as soon as `short`
/// is covered.
pub fn choose_victims(
    running: &[Running],
    capacity: &Resources,
    claimant: &str,
    short: &Resources,
) -> Option<Vec<String>> {
    let mut units: BTreeMap<String, Unit<'_>> = BTreeMap::new();
    for r in running {
        let key = match &r.gang {
            Some(g) => format!("gang {g}"),
            None => format!("container {}", r.id),
        };
        let unit = units.entry(key.clone()).or_insert_with(|| Unit {
            members: Vec::new(),
            tenant: &r.tenant,
            resources: Resources::new(),
            started: 0,
            key,
        });
        unit.members.push(r);
        unit.resources.add(&r.resources);
        unit.started = unit.started.max(r.started);
    }
    let mut candidates: Vec<Unit<'_>> = units
        .into_values()
        .filter(|u| u.members.iter().any(|m| m.class == Class::Borrowed))
        .filter(|u| u.members.iter().all(|m| !is_within(&m.tenant, claimant)))
        .collect();
    // Borrowed work per tenant, for the dominant shares.
    let mut borrowed: BTreeMap<&str, Resources> = BTreeMap::new();
    for u in &candidates {
        borrowed.entry(u.tenant).or_default().add(&u.resources);
    }
    let mut left = short.clone();
    let mut victims = Vec::new();
    while !left.is_empty() {
        let useful = |u: &Unit<'_>| left.iter().any(|(r, _)| u.resources.get(r) > 0);
        let pick = candidates
            .iter()
            .enumerate()
            .filter(|(_, u)| useful(u))
            .max_by(|(_, a), (_, b)| {
                let sa = dominant_share(&borrowed[a.tenant], capacity);
                let sb = dominant_share(&borrowed[b.tenant], capacity);
                sa.total_cmp(&sb)
                    .then_with(|| b.tenant.cmp(a.tenant))
                    .then(a.started.cmp(&b.started))
                    .then_with(|| b.key.cmp(&a.key))
            })
            .map(|(i, _)| i)?;
        let unit = candidates.swap_remove(pick);
        if let Some(b) = borrowed.get_mut(unit.tenant) {
            b.sub(&unit.resources);
        }
        left.sub(&unit.resources);
        victims.extend(unit.members.iter().map(|m| m.id.clone()));
    }
    Some(victims)
}
