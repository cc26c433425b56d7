//! When a request within guarantee may preempt borrowed work, and how long preempted work
//! waits before it borrows again.
//!
//! A request is **owed** when its tenant's guaranteed usage, plus the tenant's own requests
//! waiting ahead of it, plus the request itself fit every guarantee on its chain (the
//! guaranteed children's unused guarantees set aside, [`crate::set_aside`]): what the
//! guarantee promises to serve at once. A request owed when it first asks reclaims at once
//! (its victims' grace period plus seconds). One that was not, but is owed since (its
//! tenant's backlog ahead of it has been served and the tenant's guaranteed work has
//! ended), reclaims only when the victims would lose no more than its waiting has cost
//! ([`worth_reclaiming`]): the ski-rental rule, so such a preemption never destroys more
//! work than the waiting it ends, and the wait is bounded by what the borrowers would lose.
//! A request not owed now (the books find it within guarantee only because its tenant's
//! backlog ahead of it is not counted: the tenant asked for more than its guarantee) never
//! preempts; it waits in the fair queue for capacity to free. (Issue 27: before, the
//! ski-rental rule let those preempt too; such reclaims were 137 of the 144 on the
//! simulator's multi-GPU mix on 4 nodes, their victims often 4- and 8-GPU jobs taken for
//! narrow claims, and the nodes they broke up left GPUs idle.)

use crate::admit::{admit, Class, Decision, Usage};
use crate::amount::Resources;
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
    let mut u = usage.clone();
    for r in earlier {
        if owed_on(tree, &u, tenant, r) {
            u.add(tenant, Class::Guaranteed, r);
        }
    }
    owed_on(tree, &u, tenant, request)
}

/// Whether a reclaim whose victims would lose `victims_cost` (dominant-share seconds,
/// [`crate::Candidate::cost`]) may go ahead for a request owed only since it first asked,
/// which holds `request_share` of the fleet and has waited `waited_s`: only when the
/// victims lose no more than its waiting has cost (`waited_s × request_share`).
pub fn worth_reclaiming(victims_cost: f64, waited_s: u64, request_share: f64) -> bool {
    victims_cost <= waited_s as f64 * request_share
}
