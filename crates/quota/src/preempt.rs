//! When a request within guarantee may preempt borrowed work, and how long preempted work
//! waits before it borrows again.
//!
//! A request is **owed** when its tenant's guaranteed usage, plus the tenant's own requests
//! waiting ahead of it, plus the request itself fit every guarantee on its chain (the
//! guaranteed children's unused guarantees set aside, [`crate::set_aside`]): what the
//! guarantee promises to serve. Of the requests waiting ahead only those count that would
//! be owed themselves ([`owed_behind`]). A request owed *at once* when it first asks — with
//! all its tenant's waiting requests ahead counted ([`owed_at_once`]) — reclaims at once
//! (its victims' grace period plus seconds). One owed only behind a larger request of its
//! tenant, or not owed then but owed since (its tenant's backlog ahead of it has been
//! served and the tenant's guaranteed work has ended), reclaims only when the victims would lose no more than its waiting has cost
//! ([`worth_reclaiming`]): the ski-rental rule, so such a preemption never destroys more
//! work than the waiting it ends, and the wait is bounded by what the borrowers would lose.
//! A path may bound that wait: with `owed_reclaim_after_s` it reclaims once it has been owed
//! that long, whatever its victims lose ([`may_reclaim_owed_later`]; 0 is Kueue's reclaim
//! within the cohort, at once).
//! A request not owed now (the books find it within guarantee only because its tenant's
//! backlog ahead of it is not counted: the tenant asked for more than its guarantee) never
//! preempts; it waits in the fair queue for capacity to free. (Issue 27: before, the
//! ski-rental rule let those preempt too; such reclaims were 137 of the 144 on the
//! simulator's multi-GPU mix on 4 nodes, their victims often 4- and 8-GPU jobs taken for
//! narrow claims, and the nodes they broke up left GPUs idle.)

use crate::admit::{admit, Class, Decision, Usage};
use crate::amount::{Resource, Resources};
use crate::spec::QuotaTree;

/// Whether `request` of `tenant` is owed now (module documentation): with `ahead` (the
/// tenant's requests waiting before it) counted as its guaranteed usage, it is guaranteed
/// by every quota on its chain (and crosses no ceiling).
pub fn owed(
    tree: &QuotaTree,
    usage: &Usage,
    tenant: &str,
    request: &Resources,
    ahead: &Resources,
) -> bool {
    let mut u = usage.clone();
    u.add(tenant, Class::Guaranteed, ahead);
    owed_on(tree, &u, tenant, request)
}

/// [`owed`] on `usage` with the backlog already counted in it.
fn owed_on(tree: &QuotaTree, usage: &Usage, tenant: &str, request: &Resources) -> bool {
    // A capacity that holds everything: only the quotas decide. A reclaim can then only be
    // one under a ceiling that others' borrowed work fills: still within its guarantee.
    let view = usage.total().total().plus(request);
    matches!(
        admit(tree, &view, usage, tenant, request),
        Decision::Admit { class: Class::Guaranteed, .. } | Decision::Reclaim { .. }
    )
}

/// Whether `request` is owed behind `earlier`, its tenant's requests waiting before it in
/// arrival order: [`owed`], with only those of `earlier` counted ahead that would be owed
/// themselves in that order (each within the guarantees with the ones counted before it).
/// One that would not (larger than what is left of the guarantee: it would run borrowed)
/// fills none of it, so a tenant's request beyond its guarantee never switches off the
/// guarantee for its smaller ones.
pub fn owed_behind<'r>(
    tree: &QuotaTree,
    usage: &Usage,
    tenant: &str,
    request: &Resources,
    earlier: impl IntoIterator<Item = &'r Resources>,
) -> bool {
    let mut scan = OwedScan::new(tree, usage, tenant);
    for r in earlier {
        scan.next(r);
    }
    scan.owed(request)
}

/// For each of `tenant`'s waiting `requests`, in arrival order, whether it is owed behind
/// the ones before it ([`owed_behind`] of each, in one pass).
pub fn owed_in_order<'r>(
    tree: &QuotaTree,
    usage: &Usage,
    tenant: &str,
    requests: impl IntoIterator<Item = &'r Resources>,
) -> Vec<bool> {
    let mut scan = OwedScan::new(tree, usage, tenant);
    requests.into_iter().map(|r| scan.next(r)).collect()
}

/// Whether `request` may reclaim at once when it first asks: [`owed`] with *every* one of
/// `earlier`, its tenant's requests waiting before it, counted ahead, whatever their sizes.
/// The owner promise (its victims' grace period plus seconds) is for a request that fits the
/// guarantee after all its tenant asked first; one owed only behind a larger request of its
/// tenant that the guarantee cannot hold ([`owed_behind`]) is owed, but reclaims as a request
/// owed later does ([`may_reclaim_owed_later`]). (Issue 27: with the at-once privilege given
/// to every request [`owed_behind`] finds owed, the simulator's requests that reclaim at once
/// stopped borrowed work that had run for months on the fully guaranteed fleets: the shared
/// default list at 2 nodes kept 0.722 of FIFO's useful work, 0.874 with this rule.)
pub fn owed_at_once<'r>(
    tree: &QuotaTree,
    usage: &Usage,
    tenant: &str,
    request: &Resources,
    earlier: impl IntoIterator<Item = &'r Resources>,
) -> bool {
    let ahead = earlier.into_iter().fold(Resources::new(), |a, r| a.plus(r));
    owed(tree, usage, tenant, request, &ahead)
}

/// A tenant's requests looked at in arrival order: each owed one counts as guaranteed
/// usage for those after it. Among requests of the same resources, owed is monotone (a
/// larger one, or the same on more usage, is owed only if the smaller one is: the
/// guarantees and ceilings only bound it more), so a request of the same resources as one
/// found not owed before it, and at least as large, is not owed either, without asking.
/// (Not across resources: one asking only what no quota bounds is never guaranteed, a
/// larger one that also asks GPUs may be.)
struct OwedScan<'a> {
    tree: &'a QuotaTree,
    tenant: &'a str,
    usage: Usage,
    /// The requests found not owed, none covering another: each with the resources it asks.
    not_owed: Vec<(Vec<Resource>, Resources)>,
}

impl<'a> OwedScan<'a> {
    fn new(tree: &'a QuotaTree, usage: &Usage, tenant: &'a str) -> OwedScan<'a> {
        OwedScan { tree, tenant, usage: usage.clone(), not_owed: Vec::new() }
    }

    /// Whether `request` is owed after those seen so far.
    fn owed(&self, request: &Resources) -> bool {
        !self.covered(&kinds(request), request)
            && owed_on(self.tree, &self.usage, self.tenant, request)
    }

    /// Whether a request found not owed asks `request`'s resources and fits in it.
    fn covered(&self, kinds: &[Resource], request: &Resources) -> bool {
        self.not_owed.iter().any(|(k, q)| k == kinds && q.fits_in(request))
    }

    /// [`OwedScan::owed`], and counts `request` as seen.
    fn next(&mut self, request: &Resources) -> bool {
        let kinds = kinds(request);
        if self.covered(&kinds, request) {
            return false;
        }
        let owed = owed_on(self.tree, &self.usage, self.tenant, request);
        if owed {
            self.usage.add(self.tenant, Class::Guaranteed, request);
        } else {
            self.not_owed.retain(|(k, q)| !(*k == kinds && request.fits_in(q)));
            self.not_owed.push((kinds, request.clone()));
        }
        owed
    }
}

/// The resources `r` asks (a non-zero amount of).
fn kinds(r: &Resources) -> Vec<Resource> {
    r.iter().map(|(k, _)| k.clone()).collect()
}

/// Whether a reclaim for a request owed only since it first asked may go ahead: when its
/// victims would lose no more than its waiting has cost ([`worth_reclaiming`]), or, where
/// its path sets `owed_reclaim_after_s` (`after_s`), once it has been owed that long
/// (`owed_for_s`), whatever they lose.
pub fn may_reclaim_owed_later(
    victims_cost: f64,
    waited_s: u64,
    request_share: f64,
    owed_for_s: u64,
    after_s: Option<u64>,
) -> bool {
    after_s.is_some_and(|a| owed_for_s >= a)
        || worth_reclaiming(victims_cost, waited_s, request_share)
}

/// Whether a reclaim whose victims would lose `victims_cost` (dominant-share seconds,
/// [`crate::Candidate::cost`]) may go ahead for a request owed only since it first asked,
/// which holds `request_share` of the fleet and has waited `waited_s`: only when the
/// victims lose no more than its waiting has cost (`waited_s × request_share`).
pub fn worth_reclaiming(victims_cost: f64, waited_s: u64, request_share: f64) -> bool {
    victims_cost <= waited_s as f64 * request_share
}
