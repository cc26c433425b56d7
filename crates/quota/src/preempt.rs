//! When a request within guarantee may preempt borrowed work, and how long preempted work
//! waits before it borrows again.
//!
//! A request is **owed** when its tenant's guaranteed usage, plus the tenant's own requests
//! waiting ahead of it, plus the request itself fit every guarantee on its chain (the
//! guaranteed children's unused guarantees set aside, [`crate::set_aside`]): what the
//! guarantee promises to serve at once. Only an owed request reclaims, and at once (its
//! victims' grace period plus seconds). A request the books find within guarantee only
//! because its tenant's backlog ahead of it is not counted (the tenant asked for more than
//! its guarantee, and its own completions feed it) never preempts: it waits in the fair
//! queue for capacity to free. (Issue 27 measured the alternative, letting it preempt once
//! its victims would lose no more than its waiting had cost: those reclaims were 137 of the
//! 144 on the simulator's multi-GPU mix on 4 nodes, their victims often 4- and 8-GPU jobs
//! taken for narrow claims, and the nodes they broke up left GPUs idle.)

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
    // A capacity that holds everything: only the quotas decide. A reclaim can then only be
    // one under a ceiling that others' borrowed work fills: still within its guarantee.
    let view = u.total().total().plus(request);
    matches!(
        admit(tree, &view, &u, tenant, request),
        Decision::Admit { class: Class::Guaranteed, .. } | Decision::Reclaim { .. }
    )
}
