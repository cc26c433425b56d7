//! Which guarantees a fleet's shape cannot honour, and why ([`check_shape`]).
//!
//! A policy's guarantees are amounts; the fleet is nodes. Three things the amounts alone
//! do not show, and one the tree alone does, each a [`ShapeFinding`]:
//!
//! - **Over the fleet** ([`ShapeKind::OverFleet`], a promise that cannot be kept): the
//!   outermost guarantees of a resource add up to more than the fleet has. When every
//!   owner asks at once, the last ones wait for work to end, however the work is placed.
//! - **No node for a guarantee's largest pod** ([`ShapeKind::NoNode`], a promise that cannot
//!   be kept): a pod runs on one node, so a path whose own GPU guarantee is `g` expects a
//!   pod of `min(g, G)` GPUs within it to be served, `G` the largest node's GPUs of that
//!   model. That needs a layout in which every guaranteeing path has such an *anchor* on
//!   one node at the same time (the rest of each guarantee may be anywhere). When the
//!   anchors do not fit the nodes (an exact search: bin packing, bounded), a path's
//!   largest pod can find every node short because other paths' guaranteed work sits
//!   there, and no reclaim of borrowed work helps. The finding names each path whose
//!   anchor, made one GPU, lets the others fit (else every anchored path).
//! - **No headroom** ([`ShapeKind::NoHeadroom`], a warning): the guarantees take the whole
//!   fleet's GPUs of a model. Every GPU lent is then someone's guarantee, so borrowed work is
//!   reclaimed whenever its owner asks again, and work that does not checkpoint loses all
//!   it ran. No online rule avoids that loss and serves owners within a bound at once
//!   (`lab::quota_adversary` builds the trace for any rule); checkpointing, unguaranteed
//!   capacity or a `min_runtime_s` trade it away. The same holds for a borrowed job larger
//!   than the unguaranteed GPUs on a fleet with some; ceilings are not compared with the
//!   headroom here. docs/QUOTAS.md, The fleet's shape.
//!
//! - **Unguaranteed** ([`ShapeKind::Unguaranteed`], a warning): paths whose chains
//!   guarantee something but not a resource another quota guarantees (or their chain
//!   bounds by a ceiling alone); their tenants' containers asking for it run borrowed as a
//!   whole (`crate::admit`).
//!
//! Pure: the coordinator calls it with its registered nodes (`GET /v1/quota/status`,
//! `tessera quota status`), the simulator with its fleet.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::amount::{Resource, Resources, MICRO_PER_GPU};
use crate::spec::{chain, QuotaTree};

/// Search steps [`check_shape`] spends on one resource's anchors before it gives up
/// (the answer is then a warning that no layout was found, not a proof).
pub const MAX_LAYOUT_STEPS: u64 = 200_000;

/// What is wrong with a guarantee on this fleet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ShapeKind {
    /// The outermost guarantees of `resource` add up to `guaranteed`, more than the
    /// fleet's `capacity` (the resource's unit).
    OverFleet { guaranteed: u64, capacity: u64 },
    /// No layout gives every guaranteeing path an anchor of `anchor` whole GPUs on one
    /// node (`searched`: false when the search ran out of steps before deciding).
    NoNode { anchor: u64, largest_node: u64, searched: bool },
    /// The guarantees take all `capacity` of the fleet's GPUs of this model.
    NoHeadroom { guaranteed: u64, capacity: u64 },
    /// The finding's paths guarantee something on their chains but not the resource,
    /// which another quota guarantees or their chains bound by a ceiling alone: a
    /// container of their tenants asking for it runs borrowed as a whole (burst-priced,
    /// reclaimable), whatever else it asks within guarantee.
    Unguaranteed,
}

/// One finding of [`check_shape`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShapeFinding {
    /// The quota paths it is about, sorted.
    pub paths: Vec<String>,
    /// The JSON path of the resource in a quota entry (`gpus.H100-80GB`, `cpu_cores`).
    pub resource: String,
    /// True: the promise cannot be kept on this fleet; false: a warning.
    pub cannot: bool,
    #[serde(flatten)]
    pub kind: ShapeKind,
    /// The sentence for people.
    pub message: String,
}

impl fmt::Display for ShapeFinding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// What `path` guarantees of `resource` for itself: its guarantee less its nearest
/// guaranteeing descendants' (what the static layout gives it a home for).
pub fn own_guarantee(tree: &QuotaTree, resource: &Resource, path: &str) -> u64 {
    let Some(mine) = tree.get(path).and_then(|q| q.limits.get(resource)).and_then(|l| l.guarantee)
    else {
        return 0;
    };
    let children: u64 = tree
        .guaranteed_children(path, resource)
        .filter_map(|c| c.limits.get(resource).and_then(|l| l.guarantee))
        .sum();
    mine.saturating_sub(children)
}

/// [`own_guarantee`] of every path that guarantees `resource`, in one pass: each
/// guarantee is taken from its nearest guaranteeing ancestor's (a walk up the path, not a
/// scan of the tree per path).
fn own_guarantees(tree: &QuotaTree, resource: &Resource) -> BTreeMap<String, u64> {
    let guarantee = |p: &str| tree.get(p).and_then(|q| q.limits.get(resource))?.guarantee;
    let mut own: BTreeMap<String, u64> = tree
        .iter()
        .filter_map(|q| Some((q.path.clone(), q.limits.get(resource)?.guarantee?)))
        .collect();
    for q in tree.iter() {
        let Some(g) = guarantee(&q.path) else { continue };
        if let Some(parent) = chain(&q.path).skip(1).find(|p| guarantee(p).is_some()) {
            if let Some(o) = own.get_mut(parent) {
                *o = o.saturating_sub(g);
            }
        }
    }
    own
}

/// The findings for `tree` on a fleet of `nodes` (each node's capacity), every resource a
/// quota guarantees. Empty: some layout of the guarantees honours each (the simulator's
/// homes keep one), and there is headroom. It does not say that placement keeps such a
/// layout: the coordinator places no homes, so guaranteed pods spread over nodes may still
/// leave another path's largest pod no node. CPU and memory get only the over-the-fleet
/// check. Paths whose work asking for a resource runs borrowed as a whole though they
/// guarantee something are named in a warning ([`ShapeKind::Unguaranteed`]).
pub fn check_shape(tree: &QuotaTree, nodes: &[Resources]) -> Vec<ShapeFinding> {
    let mut resources: Vec<&Resource> = tree
        .iter()
        .flat_map(|q| q.limits.iter().filter(|(_, l)| l.guarantee.is_some()).map(|(r, _)| r))
        .collect();
    resources.sort();
    resources.dedup();
    let mut out = Vec::new();
    for resource in resources {
        let guaranteed = |p: &str| {
            tree.get(p).and_then(|q| q.limits.get(resource)).and_then(|l| l.guarantee).is_some()
        };
        // Outermost: no ancestor guarantees this resource.
        let mut roots: Vec<(String, u64)> = tree
            .iter()
            .filter(|q| guaranteed(&q.path) && !chain(&q.path).skip(1).any(guaranteed))
            .filter_map(|q| Some((q.path.clone(), q.limits.get(resource)?.guarantee?)))
            .collect();
        roots.sort();
        let sum: u64 = roots.iter().map(|(_, g)| g).sum();
        let capacity: u64 = nodes.iter().map(|n| n.get(resource)).sum();
        let paths: Vec<String> = roots.iter().map(|(p, _)| p.clone()).collect();
        let spec = resource.spec_path();
        if sum > capacity {
            out.push(ShapeFinding {
                paths: paths.clone(),
                resource: spec.clone(),
                cannot: true,
                kind: ShapeKind::OverFleet { guaranteed: sum, capacity },
                message: format!(
                    "the guarantees of {} add up to {}, more than the fleet's {} ({} node{}): \
                     when every owner asks at once, {} of them wait for work to end",
                    paths.join(", "),
                    resource.show(sum),
                    resource.show(capacity),
                    nodes.len(),
                    if nodes.len() == 1 { "" } else { "s" },
                    resource.show(sum - capacity),
                ),
            });
            continue;
        }
        let Resource::Gpu(model) = resource else { continue };
        if let Some(f) = anchors(tree, resource, model, nodes) {
            out.push(f);
        }
        if sum == capacity && capacity > 0 {
            out.push(ShapeFinding {
                paths,
                resource: spec,
                cannot: false,
                kind: ShapeKind::NoHeadroom { guaranteed: sum, capacity },
                message: format!(
                    "the guarantees take all {} of the fleet: every GPU lent is someone's \
                     guarantee, so borrowed work is reclaimed whenever its owner asks again, \
                     and work that does not checkpoint (tessera.io/preemption: checkpoint) \
                     loses all it ran; leave unguaranteed GPUs, or set min_runtime_s, to \
                     trade that loss for owners' wait",
                    resource.show(capacity),
                ),
            });
        }
    }
    out.extend(unguaranteed(tree));
    out
}

/// The [`ShapeKind::Unguaranteed`] findings, one per resource: the quota paths whose
/// chains guarantee something (so their work may run guaranteed) but not that resource,
/// where `admit` makes a request asking for it borrowed as a whole — some quota guarantees
/// it (nothing of it is set aside for them), or their chain bounds it by a ceiling alone.
/// Paths guaranteeing nothing only borrow by design and are not named. One walk up each
/// path per resource.
fn unguaranteed(tree: &QuotaTree) -> Vec<ShapeFinding> {
    let mut resources: Vec<&Resource> = tree.iter().flat_map(|q| q.limits.keys()).collect();
    resources.sort();
    resources.dedup();
    // Each path's chain, once, for the paths whose chains guarantee something.
    let chains: Vec<(&str, Vec<&crate::spec::Quota>)> = tree
        .iter()
        .map(|q| (q.path.as_str(), tree.chain(&q.path).collect::<Vec<_>>()))
        .filter(|(_, chain)| chain.iter().any(|c| c.limits.values().any(|l| l.guarantee.is_some())))
        .collect();
    let mut out = Vec::new();
    for resource in resources {
        let guarantees =
            |q: &crate::spec::Quota| q.limits.get(resource).is_some_and(|l| l.guarantee.is_some());
        let guaranteeing: Vec<String> =
            tree.iter().filter(|q| guarantees(q)).map(|q| q.path.clone()).collect();
        let paths: Vec<String> = chains
            .iter()
            .filter(|(_, chain)| {
                let bounds = chain.iter().any(|c| c.limits.contains_key(resource));
                !chain.iter().any(|c| guarantees(c)) && (bounds || !guaranteeing.is_empty())
            })
            .map(|(path, _)| path.to_string())
            .collect();
        if paths.is_empty() {
            continue;
        }
        let spec = resource.spec_path();
        let why = if guaranteeing.is_empty() {
            format!("bound {spec} by a ceiling and guarantee none of it")
        } else {
            format!(
                "guarantee no {spec}, which {} guarantee{}",
                some(&guaranteeing),
                if guaranteeing.len() == 1 { "s" } else { "" }
            )
        };
        let limit = match resource {
            Resource::Gpu(_) => "",
            _ => " (and must set a limit of it)",
        };
        out.push(ShapeFinding {
            message: format!(
                "the chains of {} {why}: a container of their tenants asking for {spec} runs \
                 borrowed as a whole{limit}, priced at the burst price and reclaimable, even \
                 where the rest of what it asks is within their guarantees; give those paths \
                 (or a parent of theirs) a {spec} guarantee to have it run guaranteed",
                some(&paths),
            ),
            paths,
            resource: spec,
            cannot: false,
            kind: ShapeKind::Unguaranteed,
        });
    }
    out
}

/// Paths named in a sentence: the first [`NAMED`], then how many more (the finding's
/// `paths` holds them all).
fn some(paths: &[String]) -> String {
    match paths.len().checked_sub(NAMED) {
        Some(more) if more > 0 => format!("{} and {more} more", paths[..NAMED].join(", ")),
        _ => paths.join(", "),
    }
}

/// How many paths a finding's sentence names.
const NAMED: usize = 8;

/// The [`ShapeKind::NoNode`] finding for one GPU model, if any.
fn anchors(
    tree: &QuotaTree,
    resource: &Resource,
    model: &str,
    nodes: &[Resources],
) -> Option<ShapeFinding> {
    let mut bins: Vec<u64> =
        nodes.iter().map(|n| n.get(resource) / MICRO_PER_GPU).filter(|&g| g > 0).collect();
    bins.sort_unstable_by(|a, b| b.cmp(a));
    let largest = bins.first().copied().unwrap_or(0);
    // Each guaranteeing path's anchor: its own whole GPUs, at most a node's.
    let mut want: BTreeMap<String, u64> = BTreeMap::new();
    for (path, own) in own_guarantees(tree, resource) {
        let own = own / MICRO_PER_GPU;
        if own > 0 {
            want.insert(path, own.min(largest.max(1)));
        }
    }
    let items: Vec<u64> = want.values().copied().collect();
    // One budget for the whole resource: the layout, then the culprits.
    let mut budget = MAX_LAYOUT_STEPS;
    match packs_within(&items, &bins, &mut budget) {
        Some(true) => return None,
        Some(false) => {}
        None => {
            let paths: Vec<String> = want.keys().cloned().collect();
            return Some(ShapeFinding {
                resource: resource.spec_path(),
                cannot: false,
                kind: ShapeKind::NoNode { anchor: 0, largest_node: largest, searched: false },
                message: format!(
                    "no layout found within {MAX_LAYOUT_STEPS} steps that gives each of {} \
                     its largest pod of {model} GPUs on one node; the search did not decide",
                    paths.join(", ")
                ),
                paths,
            });
        }
    }
    // Which anchors, made one GPU, let the rest fit: one search per anchor size (anchors
    // of one size are interchangeable), within what is left of the budget; when that runs
    // out, every anchored path is named.
    let mut sizes: Vec<u64> = items.iter().copied().filter(|&a| a > 1).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut freeing: Vec<u64> = Vec::new();
    let mut decided = true;
    for size in sizes {
        let mut less = items.clone();
        if let Some(i) = less.iter().position(|&a| a == size) {
            less[i] = 1;
        }
        match packs_within(&less, &bins, &mut budget) {
            Some(true) => freeing.push(size),
            Some(false) => {}
            None => {
                decided = false;
                break;
            }
        }
    }
    let mut culprits: Vec<(String, u64)> = if decided {
        want.iter().filter(|(_, a)| freeing.contains(a)).map(|(k, &a)| (k.clone(), a)).collect()
    } else {
        Vec::new()
    };
    if culprits.is_empty() {
        culprits = want.iter().map(|(k, &v)| (k.clone(), v)).collect();
    }
    let anchor = culprits.iter().map(|(_, a)| *a).max().unwrap_or(0);
    let named: Vec<String> =
        culprits.iter().map(|(p, a)| format!("{p} (a pod of {a} GPUs)")).collect();
    let sizes: Vec<String> = bins.iter().map(u64::to_string).collect();
    Some(ShapeFinding {
        paths: culprits.into_iter().map(|(p, _)| p).collect(),
        resource: resource.spec_path(),
        cannot: true,
        kind: ShapeKind::NoNode { anchor, largest_node: largest, searched: true },
        message: format!(
            "no layout of the guarantees on these nodes ({} {model} GPUs each) keeps one node \
             free enough for the largest pod within the guarantee of {}: other paths' \
             guaranteed work can fill every node it fits, and reclaiming borrowed work does \
             not help",
            sizes.join(", "),
            named.join(", "),
        ),
    })
}

/// Whether `items` fit in `bins` (bin packing, exact): `None` when the search ran out of
/// [`MAX_LAYOUT_STEPS`]. Bins of equal room are one choice (a fleet of thousands of alike
/// nodes is a handful of room values).
#[cfg(test)]
fn packs(items: &[u64], bins: &[u64]) -> Option<bool> {
    let mut budget = MAX_LAYOUT_STEPS;
    packs_within(items, bins, &mut budget)
}

/// [`packs`] spending at most `budget` steps (what is left of it stays there for the next
/// search).
fn packs_within(items: &[u64], bins: &[u64], budget: &mut u64) -> Option<bool> {
    search(items, bins, budget).map(|found| found.is_some())
}

/// A layout of `items` in `bins`: for each item, in `items`' order, the index of its bin;
/// `None` when there is none or the search ran out of [`MAX_LAYOUT_STEPS`]. The search
/// [`check_shape`] runs, for a caller that keeps the layout (the simulator's homes).
pub fn layout(items: &[u64], bins: &[u64]) -> Option<Vec<usize>> {
    let mut budget = MAX_LAYOUT_STEPS;
    search(items, bins, &mut budget).flatten()
}

/// The exact search: `None` when `budget` ran out, `Some(None)` when no layout exists,
/// else the layout ([`layout`]). Largest item first; bins of equal room are one choice.
/// Depth-first with its own stack: one frame per item, so thousands of anchors cost
/// memory, not the thread's stack.
fn search(items: &[u64], bins: &[u64], budget: &mut u64) -> Option<Option<Vec<usize>>> {
    if items.iter().sum::<u64>() > bins.iter().sum::<u64>() {
        return Some(None);
    }
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by(|&a, &b| items[b].cmp(&items[a]).then(a.cmp(&b)));
    // Each room value with the bins that have it (a stack: the search undoes in order).
    let mut room: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for (i, &b) in bins.iter().enumerate().rev() {
        room.entry(b).or_default().push(i);
    }
    fn take(room: &mut BTreeMap<u64, Vec<usize>>, r: u64) -> usize {
        let list = room.get_mut(&r).expect("a room the search found");
        let bin = list.pop().expect("a bin with that room");
        if list.is_empty() {
            room.remove(&r);
        }
        bin
    }
    // One frame per placed item: the rooms it may take, the next to try, the one it holds.
    struct Frame {
        fits: Vec<u64>,
        next: usize,
        holds: Option<(u64, usize)>,
    }
    let fits = |room: &BTreeMap<u64, Vec<usize>>, size: u64| -> Vec<u64> {
        room.range(size..).map(|(&r, _)| r).collect()
    };
    let mut frames: Vec<Frame> = Vec::with_capacity(items.len());
    loop {
        let depth = frames.len();
        let Some(&item) = order.get(depth) else {
            let mut at = vec![0; items.len()];
            for (f, &item) in frames.iter().zip(&order) {
                at[item] = f.holds.map_or(0, |(_, bin)| bin);
            }
            return Some(Some(at));
        };
        frames.push(Frame { fits: fits(&room, items[item]), next: 0, holds: None });
        // Advance the deepest frame to its next room, popping those with none left.
        loop {
            let size = items[order[frames.len() - 1]];
            let frame = frames.last_mut().expect("a frame");
            if let Some((r, _)) = frame.holds.take() {
                let bin = take(&mut room, r - size);
                room.entry(r).or_default().push(bin);
            }
            if let Some(&r) = frame.fits.get(frame.next) {
                frame.next += 1;
                if *budget == 0 {
                    return None;
                }
                *budget -= 1;
                let bin = take(&mut room, r);
                room.entry(r - size).or_default().push(bin);
                frame.holds = Some((r, bin));
                break;
            }
            frames.pop();
            if frames.is_empty() {
                return Some(None);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::QuotaSpec;

    fn tree(json: &str) -> QuotaTree {
        let spec: QuotaSpec = serde_json::from_str(json).expect("spec");
        spec.validate("quotas", |_| true).expect("valid")
    }

    fn nodes(n: usize, gpus: u64) -> Vec<Resources> {
        vec![Resources::new().with_gpus("H100-80GB", gpus); n]
    }

    const SIM: &str = r#"{
        "acme/training":  {"gpus": {"H100-80GB": {"guarantee": 8, "ceiling": 16}}},
        "acme/inference": {"gpus": {"H100-80GB": {"guarantee": 6, "ceiling": 12}}},
        "acme/research":  {"gpus": {"H100-80GB": {"guarantee": 2, "ceiling": 8}}},
        "acme/explore":   {"gpus": {"H100-80GB": {"ceiling": 8}}}}"#;

    /// Paths whose chains guarantee something but not a resource another quota guarantees
    /// (bounded there by a ceiling or not at all), or bound by a ceiling alone, run a
    /// container asking for it borrowed as a whole (`admit`): the validator names them
    /// and the fix, an ancestor of the guaranteeing path included (its other tenants are
    /// not under it); paths guaranteeing nothing (borrowers by design) are not named.
    #[test]
    fn paths_whose_work_asking_a_resource_runs_borrowed_are_named() {
        let t = tree(
            r#"{"acme/ml": {"gpus": {"H100-80GB": {"guarantee": 4}}},
                "acme/ml/vision": {"memory_gib": {"guarantee": 16}},
                "acme/web": {"gpus": {"H100-80GB": {"guarantee": 1}}},
                "acme/batch": {"gpus": {"H100-80GB": {"guarantee": 1}}, "memory_gib": {"ceiling": 64}},
                "acme/explore": {"gpus": {"H100-80GB": {"ceiling": 8}}, "memory_gib": {"ceiling": 64}}}"#,
        );
        let found = check_shape(&t, &nodes(1, 8));
        let mem: Vec<_> = found.iter().filter(|f| f.kind == ShapeKind::Unguaranteed).collect();
        assert_eq!(mem.len(), 1, "{found:?}");
        assert_eq!(mem[0].resource, "memory_gib");
        assert_eq!(mem[0].paths, ["acme/batch", "acme/ml", "acme/web"], "not explore nor vision");
        assert!(!mem[0].cannot, "a warning");
        assert!(
            mem[0].message.starts_with(
                "the chains of acme/batch, acme/ml, acme/web guarantee no memory_gib, which \
                 acme/ml/vision guarantees: a container of their tenants asking for memory_gib \
                 runs borrowed as a whole (and must set a limit of it)"
            ),
            "{}",
            mem[0].message
        );
        // What admit does with each: borrowed where named, guaranteed under vision.
        let fleet =
            nodes(1, 8)[0].clone().with(Resource::Memory, 1024 * crate::amount::MIB_PER_GIB);
        let asks = Resources::new()
            .with_gpus("H100-80GB", 1)
            .with(Resource::Memory, crate::amount::MIB_PER_GIB);
        let usage = crate::Usage::new();
        for (tenant, class) in [
            ("acme/batch/x", crate::Class::Borrowed),
            ("acme/ml/x", crate::Class::Borrowed),
            ("acme/web/x", crate::Class::Borrowed),
            ("acme/ml/vision/x", crate::Class::Guaranteed),
        ] {
            let d = crate::admit(&t, &fleet, &usage, tenant, &asks);
            assert!(
                matches!(d, crate::Decision::Admit { class: c, .. } if c == class),
                "{tenant}: {d:?}"
            );
        }
        // A ceiling alone, nothing guaranteeing the resource anywhere.
        let c = tree(
            r#"{"acme/a": {"gpus": {"H100-80GB": {"guarantee": 2}}, "cpu_cores": {"ceiling": 8}},
                "acme/b": {"gpus": {"H100-80GB": {"guarantee": 2}}}}"#,
        );
        let f = check_shape(&c, &nodes(1, 8));
        let cpu = f.iter().find(|f| f.kind == ShapeKind::Unguaranteed).expect("a's cores");
        assert_eq!(cpu.paths, ["acme/a"], "b's cores are bounded and guaranteed nowhere");
        assert!(cpu.message.contains("bound cpu_cores by a ceiling and guarantee none of it"));
        // Every path guaranteeing what it bounds, or nothing: nothing to say.
        assert!(check_shape(&tree(SIM), &nodes(4, 8))
            .iter()
            .all(|f| f.kind != ShapeKind::Unguaranteed));
        // Thousands of such paths: all in `paths`, eight in the sentence.
        let mut many = serde_json::Map::new();
        many.insert("acme".into(), serde_json::json!({"gpus": {"H100-80GB": {"guarantee": 8}}}));
        many.insert("acme/a".into(), serde_json::json!({"cpu_cores": {"guarantee": 1}}));
        for i in 0..5000 {
            many.insert(
                format!("acme/t{i}"),
                serde_json::json!({"gpus": {"H100-80GB": {"ceiling": 1}}}),
            );
        }
        let big = tree(&serde_json::Value::Object(many).to_string());
        let f = check_shape(&big, &nodes(1, 8));
        let u = f.iter().find(|f| f.kind == ShapeKind::Unguaranteed).expect("unguaranteed");
        assert_eq!(u.paths.len(), 5001, "acme and its 5,000 teams");
        assert!(u.message.contains(" and 4993 more guarantee no cpu_cores"), "{}", u.message);
    }

    #[test]
    fn the_simulators_policy_fits_two_nodes_exactly_and_four_with_room() {
        let t = tree(SIM);
        let two = check_shape(&t, &nodes(2, 8));
        assert_eq!(two.len(), 1, "{two:?}");
        assert!(!two[0].cannot);
        assert_eq!(
            two[0].kind,
            ShapeKind::NoHeadroom { guaranteed: 16 * MICRO_PER_GPU, capacity: 16 * MICRO_PER_GPU }
        );
        assert_eq!(two[0].paths, ["acme/inference", "acme/research", "acme/training"]);
        assert!(two[0].message.contains("all 16 H100-80GB GPUs"), "{}", two[0].message);
        assert_eq!(check_shape(&t, &nodes(4, 8)), []);
    }

    #[test]
    fn guarantees_over_the_fleet_cannot_all_be_honoured() {
        let t = tree(SIM);
        let f = check_shape(&t, &nodes(1, 8));
        assert_eq!(f.len(), 1, "{f:?}");
        assert!(f[0].cannot);
        assert_eq!(
            f[0].kind,
            ShapeKind::OverFleet { guaranteed: 16 * MICRO_PER_GPU, capacity: 8 * MICRO_PER_GPU }
        );
        assert!(
            f[0].message
                .contains("(1 node): when every owner asks at once, 8 H100-80GB GPUs of them wait"),
            "{}",
            f[0].message
        );
        // CPU too, in its own unit.
        let c = tree(r#"{"acme/a": {"cpu_cores": {"guarantee": 64}}}"#);
        let f = check_shape(&c, &[Resources::new().with_cpu_milli(32_000)]);
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].resource, "cpu_cores");
        assert!(f[0].message.contains("64 CPU cores"), "{}", f[0].message);
    }

    #[test]
    fn a_guarantee_whose_largest_pod_finds_no_node_is_named() {
        // 2 nodes of 8: a 6, a 6 and a 4 add up to 16, but two 6-GPU anchors and a 4-GPU
        // anchor cannot share two nodes of 8 (6+6 > 8, 6+4 > 8).
        let t = tree(
            r#"{"acme/a": {"gpus": {"H100-80GB": {"guarantee": 6}}},
                "acme/b": {"gpus": {"H100-80GB": {"guarantee": 6}}},
                "acme/c": {"gpus": {"H100-80GB": {"guarantee": 4}}}}"#,
        );
        let f = check_shape(&t, &nodes(2, 8));
        let no_node: Vec<&ShapeFinding> =
            f.iter().filter(|f| matches!(f.kind, ShapeKind::NoNode { .. })).collect();
        assert_eq!(no_node.len(), 1, "{f:?}");
        assert!(no_node[0].cannot);
        // Any one of them made a 1-GPU anchor lets the other two fit (6+1 | 6+... no:
        // a=1: 6 | 4+1 fits; b=1 likewise; c=1: 6+1 | 6 fits).
        assert_eq!(no_node[0].paths, ["acme/a", "acme/b", "acme/c"]);
        assert_eq!(
            no_node[0].kind,
            ShapeKind::NoNode { anchor: 6, largest_node: 8, searched: true }
        );
        // On 3 nodes the same guarantees fit, with headroom.
        assert_eq!(check_shape(&t, &nodes(3, 8)), []);
        // A guarantee larger than a node anchors a whole node; the rest may go anywhere.
        let big = tree(r#"{"acme/a": {"gpus": {"H100-80GB": {"guarantee": 12}}}}"#);
        assert_eq!(check_shape(&big, &nodes(2, 8)), []);
    }

    #[test]
    fn a_parents_guarantee_counts_once_and_its_children_anchor_their_own() {
        // acme 16 = the fleet (no headroom); inside it a 5 and a 5 and acme's own 6.
        let t = tree(
            r#"{"acme":   {"gpus": {"H100-80GB": {"guarantee": 16}}},
                "acme/a": {"gpus": {"H100-80GB": {"guarantee": 5}}},
                "acme/b": {"gpus": {"H100-80GB": {"guarantee": 5}}}}"#,
        );
        let f = check_shape(&t, &nodes(2, 8));
        // Anchors 6 (acme's own), 5, 5 on two nodes of 8: no layout.
        assert!(f.iter().any(|f| f.cannot && matches!(f.kind, ShapeKind::NoNode { .. })));
        assert!(f.iter().any(|f| matches!(f.kind, ShapeKind::NoHeadroom { .. })));
        assert_eq!(own_guarantee(&t, &Resource::gpu("H100-80GB"), "acme"), 6 * MICRO_PER_GPU);
        // The one-pass form agrees with own_guarantee on every path, through a level that
        // guarantees nothing (acme/x) and two levels of guarantees.
        let deep = tree(
            r#"{"acme":       {"gpus": {"H100-80GB": {"guarantee": 16}}},
                "acme/x":     {"gpus": {"H100-80GB": {"ceiling": 16}}},
                "acme/x/a":   {"gpus": {"H100-80GB": {"guarantee": 7}}},
                "acme/x/a/b": {"gpus": {"H100-80GB": {"guarantee": 3}}},
                "acme/c":     {"gpus": {"H100-80GB": {"guarantee": 2.5}}},
                "other":      {"gpus": {"H100-80GB": {"guarantee": 4}}}}"#,
        );
        let gpu = Resource::gpu("H100-80GB");
        let all = own_guarantees(&deep, &gpu);
        assert_eq!(all.len(), 5, "{all:?}");
        for (path, own) in &all {
            assert_eq!(*own, own_guarantee(&deep, &gpu, path), "{path}");
        }
        assert_eq!(all["acme"], 6_500_000);
        assert_eq!(all["acme/x/a"], 4 * MICRO_PER_GPU);
    }

    #[test]
    fn the_search_is_exact_and_bounded() {
        assert_eq!(packs(&[5, 4, 4, 3], &[8, 8]), Some(true));
        assert_eq!(packs(&[6, 6, 4], &[8, 8]), Some(false));
        // 7 can sit beside at most 3 in a bin of 10, and 5+4+4 > 10.
        assert_eq!(packs(&[7, 5, 4, 4], &[10, 10]), Some(false));
        // An exact fit: 3+3+2 = 8 and 2+2+2+2 = 8.
        assert_eq!(packs(&[3, 3, 2, 2, 2, 2, 2], &[8, 8]), Some(true));
        // One first fit decreasing misses (4+3 | 3+2+2 leaves a 2 split over both): 4+2+2
        // | 3+3+2.
        assert_eq!(packs(&[2, 2, 2, 3, 3, 4], &[8, 8]), Some(true));
        assert_eq!(packs(&[], &[]), Some(true));
        // The layout it finds, bin by item in the items' order.
        let at = layout(&[2, 2, 2, 3, 3, 4], &[8, 8]).expect("a layout");
        let mut load = [0u64; 2];
        for (item, &bin) in [2u64, 2, 2, 3, 3, 4].iter().zip(&at) {
            load[bin] += item;
        }
        assert_eq!(load, [8, 8], "{at:?}");
        assert_eq!(layout(&[6, 6, 4], &[8, 8]), None);
        assert_eq!(packs(&[1], &[]), Some(false));
        // Many equal bins and items that cannot fit: the step bound answers, never hangs.
        let items = vec![3u64; 40];
        let bins = vec![4u64; 39];
        assert!(matches!(packs(&items, &bins), Some(false) | None));
        // Thousands of alike nodes are a handful of room values: decided at once.
        let fleet = vec![8u64; 6_250];
        let anchors: Vec<u64> = (0..300).map(|i| 1 + i % 8).collect();
        assert_eq!(packs(&anchors, &fleet), Some(true));
    }

    /// A policy of `gs` guarantees (H100-80GB GPUs), one path each.
    fn many(gs: &[u64]) -> QuotaTree {
        let body: Vec<String> = gs
            .iter()
            .enumerate()
            .map(|(i, g)| {
                format!(r#""t/p{i:05}": {{"gpus": {{"H100-80GB": {{"guarantee": {g}}}}}}}"#)
            })
            .collect();
        tree(&format!("{{{}}}", body.join(",")))
    }

    #[test]
    fn thousands_of_guaranteeing_paths_do_not_overflow_the_stack() {
        // 5,000 paths of 1 GPU on 625 nodes of 8: every anchor fits. The search must not
        // recurse once per anchor: a coordinator's worker thread has a bounded stack, and
        // an overflow aborts the process (every `GET /v1/quota/status` would).
        // That it is not quadratic in the paths (it runs under the books' lock at every
        // status) is `cargo bench -p quota --bench shape`'s, against a baseline in the run.
        let t = many(&vec![1; 5_000]);
        let fleet = nodes(625, 8);
        let f = std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn(move || check_shape(&t, &fleet))
            .expect("thread")
            .join()
            .expect("check_shape");
        assert_eq!(f.len(), 1, "{f:?}");
        assert!(matches!(f[0].kind, ShapeKind::NoHeadroom { .. }), "{f:?}");
    }

    #[test]
    fn naming_the_culprits_stays_within_the_step_bound() {
        // 400 paths guaranteeing a whole node on 399 nodes of 8, and 16 paths of 3 on
        // nodes of 7, 5 and 4 (which hold 15 threes): the 8s decide "no" at once, but each
        // 8 made one GPU leaves the 3s to an exhaustive search. The step bound is per
        // resource (docs/QUOTAS.md: at most 200,000 steps), not per path: before, each of
        // the 400 spent its own 200,000 (about 0.13 s each in a debug build).
        let mut gs = vec![8u64; 400];
        gs.extend([3; 16]);
        let t = many(&gs);
        let mut fleet = nodes(399, 8);
        for g in [7u64, 7, 7, 7, 5, 5, 5, 5, 4, 4, 4] {
            fleet.push(Resources::new().with_gpus("H100-80GB", g));
        }
        let start = std::time::Instant::now();
        let f = check_shape(&t, &fleet);
        let took = start.elapsed();
        assert!(took < std::time::Duration::from_secs(5), "check_shape took {took:?}");
        let no_node: Vec<&ShapeFinding> =
            f.iter().filter(|f| matches!(f.kind, ShapeKind::NoNode { .. })).collect();
        assert_eq!(no_node.len(), 1, "{f:?}");
        assert!(no_node[0].cannot);
    }
}
