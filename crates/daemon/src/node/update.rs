//! `update`: a `runc update` of a GPU container's CPU or memory limits (docs/QUOTAS.md,
//! "Updates"). What was admitted cannot grow by itself: a raise is admitted through the
//! same quota path as a new request, and the books follow what the kernel enforces.
//!
//! tessera-runtime asks before it runs `runc update` ([`Node::plan_update`], then the books
//! without the node lock, then [`Node::begin_update`]) and says when runc is done
//! ([`Node::finish_update`]): the kernel's values are read back and recorded; above what
//! was admitted (an update runc applied otherwise than modelled, a `runc update` run
//! directly meanwhile), the wrapper is told to set the limits of before back. The
//! reconciler ([`Node::check_limits`]) records kernel limits that changed without the
//! wrapper (an event, and the books follow them), and finishes updates whose wrapper
//! never said `done`.

use std::path::Path;
use std::time::{Duration, Instant};

use fleet::quota_wire::{Amounts, ResizeRequest};
use tessera_api::{
    untrusted, AllocationState, ContainerId, ContainerLimits, ErrorCode, KernelLimits, QuotaClass,
    QuotaMark, UpdateAnswer, UpdateDone, UpdateRequest,
};
use tracing::{info, warn};

use super::{internal, ledger_err, Node};
use crate::error::{CoreError, Detail};
use crate::limits;
use crate::quota_gate;
use crate::store::Record;

/// How long an update may wait for its wrapper's `done` before the reconciler finishes it
/// from what the kernel enforces.
pub const UPDATE_WAIT: Duration = Duration::from_secs(60);

/// An update admitted and not yet done.
#[derive(Debug, Clone)]
pub struct UpdateInFlight {
    /// The kernel's limits before the update (what a restore sets back).
    pub before: KernelLimits,
    /// The most the update may leave in force: per resource, the larger of before and
    /// after (runc fails → before; succeeds → after). `None`: unbounded.
    pub allowed: ContainerLimits,
    /// The grant's quota mark before the update (its class comes back if the limits do).
    pub mark_before: Option<QuotaMark>,
    /// What the books were told the grant counts meanwhile.
    pub booked: Option<Amounts>,
    pub since: Instant,
}

/// What [`Node::plan_update`] decided.
#[derive(Debug)]
pub(crate) enum UpdatePlan {
    /// No grant here for that container: the update is runc's business alone.
    NoGrant,
    /// A grant: begin the update, after the books where `step.resize` asks them.
    Step(Box<UpdateStep>),
}

/// Why the kernel's limits on a grant cannot be read.
#[derive(Debug, thiserror::Error)]
enum NoKernelLimits {
    #[error("it has not started")]
    NotStarted,
    #[error("its init (pid {0}) is gone")]
    InitGone(i32),
    /// The cgroup's files (the host's words).
    #[error("{0}")]
    Unreadable(String),
}

/// An update of a granted container, planned under the lock.
#[derive(Debug, Clone)]
pub(crate) struct UpdateStep {
    pub container_id: ContainerId,
    pub tenant: String,
    /// The kernel's limits now.
    pub before: KernelLimits,
    /// What the update makes the limits, counted.
    pub after: ContainerLimits,
    /// The most it may leave in force ([`UpdateInFlight::allowed`]).
    pub allowed: ContainerLimits,
    /// The grant's mark as planned on (a mark that changed meanwhile is a conflict).
    pub mark: Option<QuotaMark>,
    /// The books' question for a raise: the grant's amounts during the update.
    pub resize: Option<ResizeRequest>,
    /// The quotas in force.
    pub tree: ::quota::QuotaTree,
}

/// How the books answered a raise.
#[derive(Debug, Clone)]
pub(crate) enum UpdateAdmission<'a> {
    /// Nothing asked (no raise, or no quotas).
    None,
    /// The books counted the new amounts as `class`.
    Fleet { class: QuotaClass, over: Option<String> },
    /// The coordinator is unreachable: this node's lease decides, as for a new grant.
    Lease { leases: &'a crate::quota_gate::QuotaGate, since_ms: u64, why: String },
}

/// `0.5 cores` / `unlimited`, for events.
fn show_cpu(milli: Option<u64>) -> String {
    milli.map_or("unlimited".into(), |m| ::quota::Resource::Cpu.show(m))
}

fn show_memory(mib: Option<u64>) -> String {
    mib.map_or("unlimited".into(), |m| ::quota::Resource::Memory.show(m))
}

/// `CPU 0.5 → 2 CPU cores, memory 512 → 1024 MiB of memory`.
fn change(from: &ContainerLimits, to: &ContainerLimits) -> String {
    format!(
        "CPU {} → {}, memory {} → {}",
        show_cpu(from.cpu_milli),
        show_cpu(to.cpu_milli),
        show_memory(from.memory_mib),
        show_memory(to.memory_mib)
    )
}

/// Per resource, the larger (`None`, unlimited, is the largest).
fn larger(a: &ContainerLimits, b: &ContainerLimits) -> ContainerLimits {
    let max = |x: Option<u64>, y: Option<u64>| x.zip(y).map(|(x, y)| x.max(y));
    ContainerLimits {
        cpu_milli: max(a.cpu_milli, b.cpu_milli),
        memory_mib: max(a.memory_mib, b.memory_mib),
    }
}

impl Node {
    /// The grant of `container_id` for an update in runc root `runc_root`: `None` when
    /// this node holds none. A grant made for a container of that id in another runc root
    /// is refused (409) rather than taken for "no grant": the same root may be named by
    /// another path (`/var/run/runc` for `/run/runc`), so both are compared canonically.
    fn update_grant(
        &self,
        container_id: &ContainerId,
        runc_root: &str,
    ) -> Result<Option<Record>, CoreError> {
        let Some(rec) = self.store.get(container_id).map_err(internal)? else { return Ok(None) };
        let canon = |p: &str| std::fs::canonicalize(p).unwrap_or_else(|_| Path::new(p).into());
        if rec.runc_root != runc_root && canon(&rec.runc_root) != canon(runc_root) {
            return Err(CoreError::conflict(format!(
                    "container {container_id}: the update names runc root {} but the grant of that id belongs to \
                     the container in runc root {}; refusing the update",
                    untrusted(runc_root),
                    untrusted(&rec.runc_root)
                ),
            ));
        }
        Ok(Some(rec))
    }

    /// The kernel's limits on a running grant's init, its pid checked against the start
    /// time recorded.
    fn kernel_limits(
        &self,
        rec: &Record,
    ) -> Result<(KernelLimits, limits::CgroupVersion), NoKernelLimits> {
        let a = &rec.allocation;
        let pid = match (a.state, a.pid) {
            (AllocationState::Running, Some(pid)) => pid,
            _ => return Err(NoKernelLimits::NotStarted),
        };
        let start = self.host.pid_start_time(pid);
        if start.is_none() || (rec.pid_start.is_some() && start != rec.pid_start) {
            return Err(NoKernelLimits::InitGone(pid));
        }
        self.host.cgroup_limits(pid).map_err(NoKernelLimits::Unreadable)
    }

    /// What a bounded resource counts when the kernel leaves it unlimited: the host's
    /// whole CPU or memory (the most it can use); an unbounded one counts nothing, as at
    /// create.
    pub(super) fn unlimited_counts(&self, tenant: &str, l: &ContainerLimits) -> (u64, u64) {
        let tree = self.policy.policy.quotas();
        let bounded = |r: ::quota::Resource| tree.chain(tenant).any(|q| q.limits.contains_key(&r));
        let host = quota_gate::capacity(&self.inventory);
        let cpu =
            l.cpu_milli.unwrap_or(if bounded(::quota::Resource::Cpu) { host.cpu_milli } else { 0 });
        let mem = l.memory_mib.unwrap_or(if bounded(::quota::Resource::Memory) {
            host.memory_mib
        } else {
            0
        });
        (cpu, mem)
    }

    /// The first step of an update: the grant, the kernel's limits now, what the update
    /// makes them (runc 1.1's rules, [`limits::after_update`]), and whether the books must
    /// admit a raise. Unlimited where a quota on the tenant's chain bounds it is refused as
    /// at create; so is an update runc or the kernel would refuse, or one while another is
    /// in flight.
    pub(crate) fn plan_update(
        &mut self,
        container_id: &ContainerId,
        req: &UpdateRequest,
    ) -> Result<UpdatePlan, CoreError> {
        let Some(rec) = self.update_grant(container_id, &req.runc_root)? else {
            return Ok(UpdatePlan::NoGrant);
        };
        let a = &rec.allocation;
        let refuse = |node: &mut Node, code: ErrorCode, rule: Option<&str>, message: String| {
            let err = CoreError::of(
                code,
                Detail {
                    message,
                    tenant: Some(a.tenant.to_string()),
                    request: Some(a.request.to_string()),
                    rule: rule.map(str::to_string),
                },
            );
            node.record_refusal(container_id, &err);
            err
        };
        if let Some(f) = self.updates.get(container_id).filter(|f| f.since.elapsed() < UPDATE_WAIT)
        {
            let age = f.since.elapsed().as_secs();
            return Err(refuse(
                self,
                ErrorCode::Conflict,
                None,
                format!("another update of its limits is in progress (for {age} s); retry"),
            ));
        }
        // Where the grant pins the CPU set to its GPUs, an update may narrow it only.
        if let Some(pin) = &a.injection.cpuset {
            let recorded = req.recorded.as_ref();
            let checks = [
                (
                    "cpuset-cpus",
                    &req.cpuset_cpus,
                    Some(&pin.cpus),
                    recorded.map(|r| &r.cpuset_cpus),
                ),
                (
                    "cpuset-mems",
                    &req.cpuset_mems,
                    pin.mems.as_ref(),
                    recorded.map(|r| &r.cpuset_mems),
                ),
            ];
            for (what, asked, pinned, had) in checks {
                let (Some(asked), Some(pinned)) = (asked, pinned) else { continue };
                let had = had.map_or("", String::as_str);
                if let Err(why) = limits::check_cpuset(what, asked, pinned, had) {
                    let message = format!("{why} (topology.pin_cpus); refusing the update");
                    return Err(refuse(
                        self,
                        ErrorCode::BadRequest,
                        Some("topology.pin_cpus"),
                        message,
                    ));
                }
            }
        }
        let (before, version) = self.kernel_limits(&rec).map_err(|e| {
            refuse(
                self,
                ErrorCode::Conflict,
                None,
                format!(
                    "cannot read the limits the kernel enforces on it: {e}; refusing the update"
                ),
            )
        })?;
        let after = limits::after_update(version, &before, req)
            .and_then(|l| limits::counted(&l))
            .map_err(|e| {
            refuse(self, ErrorCode::BadRequest, Some("limits"), format!("{e}; refusing the update"))
        })?;
        // What the kernel enforces now, counted (beyond what a quota counts: unlimited).
        let now = limits::counted(&before).unwrap_or_default();
        let allowed = larger(&now, &after);
        let tree = self.policy.policy.quotas().clone();
        let mark = a.quota.as_deref().cloned();
        let mut step = UpdateStep {
            container_id: container_id.clone(),
            tenant: a.tenant.to_string(),
            before,
            after,
            allowed,
            mark: mark.clone(),
            resize: None,
            tree,
        };
        let Some(mark) = mark.filter(|_| self.policy.policy.has_quotas()) else {
            // No quotas count it: nothing to admit.
            return Ok(UpdatePlan::Step(Box::new(step)));
        };
        quota_gate::require_limits(&step.tree, &a.tenant, &after)
            .map_err(|e| refuse(self, ErrorCode::BadRequest, Some("limits"), e.to_string()))?;
        // A raise is what grows beyond both what the books count and what the kernel
        // enforces now (an update that lowers a limit the kernel already held above the
        // books asks nothing; `done` records what is enforced then).
        let (cpu, mem) = self.unlimited_counts(&a.tenant, &after);
        let (now_cpu, now_mem) = self.unlimited_counts(&a.tenant, &now);
        let grows_cpu = cpu > mark.cpu_milli && cpu > now_cpu;
        let grows_mem = mem > mark.memory_mib && mem > now_mem;
        if grows_cpu || grows_mem {
            let amounts = Amounts {
                gpus: mark.gpus.clone(),
                cpu_milli: if grows_cpu { cpu } else { mark.cpu_milli },
                memory_mib: if grows_mem { mem } else { mark.memory_mib },
            };
            step.resize = Some(ResizeRequest {
                container_id: container_id.to_string(),
                tenant: a.tenant.to_string(),
                amounts,
                unsynced_lease_grants: false,
            });
        }
        Ok(UpdatePlan::Step(Box::new(step)))
    }

    /// The second step: under the lock again, the grant as planned on, the raise admitted
    /// (`admission`; under a lease, checked here on this node's holdings of now). The
    /// mark counts the update's amounts from now on (its class as the books decided: work
    /// that grows beyond its guarantee runs borrowed from now on, metered at the burst
    /// price), and the update is in flight until `done`.
    pub(crate) fn begin_update(
        &mut self,
        step: &UpdateStep,
        admission: &UpdateAdmission<'_>,
    ) -> Result<UpdateAnswer, CoreError> {
        let id = &step.container_id;
        let rec = self.store.get(id).map_err(internal)?;
        let Some(rec) = rec.filter(|r| r.allocation.quota.as_deref() == step.mark.as_ref()) else {
            return Err(CoreError::conflict(
                "its grant changed while the update was admitted; retry".to_string(),
            ));
        };
        let mut mark = step.mark.clone();
        let booked = step.resize.as_ref().map(|r| r.amounts.clone());
        if let (Some(m), Some(amounts)) = (mark.as_mut(), &booked) {
            let (class, over, under_lease) = match admission {
                UpdateAdmission::None => (m.class, m.over.clone(), m.under_lease),
                UpdateAdmission::Fleet { class, over } => {
                    let over = if *class == m.class && over.is_none() {
                        m.over.clone()
                    } else {
                        over.clone()
                    };
                    (*class, over, false)
                }
                UpdateAdmission::Lease { leases, since_ms, why } => {
                    let grow = Amounts {
                        gpus: Default::default(),
                        cpu_milli: amounts.cpu_milli.saturating_sub(m.cpu_milli),
                        memory_mib: amounts.memory_mib.saturating_sub(m.memory_mib),
                    }
                    .to_resources();
                    let verdict = if m.class != QuotaClass::Guaranteed {
                        Err("only guaranteed work may grow under a lease (this grant is borrowed)"
                            .to_string())
                    } else {
                        // Marked unsynced before what is in flight is read, as a grant is
                        // (`finish_allocate`); kept once admitted, undone if refused.
                        let mut here = self.guaranteed_here()?;
                        let before = leases.lease_grant_begins(id.as_str());
                        here.extend(leases.asked_here(id.as_str()));
                        let tree = self.policy.policy.quotas();
                        let verdict = leases.with_leases(|held| {
                            quota_gate::lease_admits(tree, &step.tenant, &grow, held, &here)
                        });
                        if verdict.is_err() {
                            leases.lease_grant_abandoned(id.as_str(), before);
                        }
                        verdict
                    };
                    if let Err(why_not) = verdict {
                        let err = CoreError::Refused(Detail {
                            message: format!(
                                "container {id} of tenant {} asks for {grow} more: the quota coordinator is unreachable \
                                 since {} ({}), and while it is, this node admits only work within guarantees its lease \
                                 covers: {why_not}",
                                step.tenant,
                                tessera_api::time::format_utc(*since_ms),
                                untrusted(why).max_chars(256),
                            ),
                            tenant: Some(step.tenant.clone()),
                            request: Some(rec.allocation.request.to_string()),
                            rule: Some("quotas".into()),
                        });
                        self.record_refusal(id, &err);
                        return Err(err);
                    }
                    (QuotaClass::Guaranteed, None, true)
                }
            };
            m.class = class;
            m.over = over;
            m.under_lease = under_lease;
            m.cpu_milli = amounts.cpu_milli;
            m.memory_mib = amounts.memory_mib;
        }
        let now = limits::counted(&step.before).unwrap_or_default();
        let detail = format!(
            "update admitted: {}{}",
            change(&now, &step.after),
            match (&mark, &step.mark) {
                (Some(m), Some(old)) if m.class != old.class => {
                    format!("; it runs {} from now on", m.class.as_str())
                }
                _ => String::new(),
            }
        );
        self.store.set_quota_mark(id, mark.as_ref(), "update", &detail).map_err(internal)?;
        if mark.as_ref().map(|m| m.class) != step.mark.as_ref().map(|m| m.class) {
            self.reopen_intervals(id, "reclassified by an update of its limits")?;
        }
        self.updates.insert(
            id.clone(),
            UpdateInFlight {
                before: step.before,
                allowed: step.allowed,
                mark_before: step.mark.clone(),
                booked,
                since: Instant::now(),
            },
        );
        info!(container = %id, "{detail}");
        Ok(UpdateAnswer {
            grant: true,
            limits: Some(step.after),
            restore: None,
            message: Some(detail),
        })
    }

    /// runc's `update` ended: the kernel's limits are read back. Above what the update may
    /// leave in force (and not after a restore), the answer asks for the limits of before
    /// to be set back. Otherwise they are recorded: the mark counts what the kernel
    /// enforces (its class as before the update if the limits are back where they were),
    /// and the answer's second part is what to tell the books.
    pub(crate) fn finish_update(
        &mut self,
        container_id: &ContainerId,
        req: &UpdateDone,
    ) -> Result<(UpdateAnswer, Option<ResizeRequest>), CoreError> {
        let Some(rec) = self.update_grant(container_id, &req.runc_root)? else {
            self.updates.remove(container_id);
            return Ok((UpdateAnswer::default(), None));
        };
        let outcome =
            if req.runc_succeeded { "runc update succeeded" } else { "runc update failed" };
        self.settle_update(&rec, outcome, req.restored)
    }

    /// Records what the kernel enforces on `rec`'s container after an update (see
    /// [`Node::finish_update`]); `restored`: the limits of before were set back.
    fn settle_update(
        &mut self,
        rec: &Record,
        outcome: &str,
        restored: bool,
    ) -> Result<(UpdateAnswer, Option<ResizeRequest>), CoreError> {
        let id = rec.allocation.container_id.clone();
        let flight = self.updates.get(&id).cloned();
        let (kernel, _) = match self.kernel_limits(rec) {
            Ok(k) => k,
            Err(e) => {
                self.updates.remove(&id);
                let message =
                    format!("{outcome}; cannot read the limits the kernel enforces now: {e}");
                warn!(container = %id, "{message}");
                return Ok((
                    UpdateAnswer { grant: true, message: Some(message), ..UpdateAnswer::default() },
                    None,
                ));
            }
        };
        let now = limits::counted(&kernel).unwrap_or_default();
        let allowed = flight.as_ref().map(|f| f.allowed);
        let above = allowed.is_some_and(|a| limits::exceeds(&now, &a));
        if above && !restored {
            let f = flight.as_ref().map(|f| f.before);
            let detail = format!(
                "after the update ({outcome}) the kernel enforces more than was admitted ({}); asking for the \
                 limits of before to be set back",
                change(&allowed.unwrap_or_default(), &now)
            );
            warn!(container = %id, "{detail}");
            if let Err(e) = self.store.event("limits-above-admitted", Some(&id), &detail) {
                warn!("cannot record an event: {e}");
            }
            return Ok((
                UpdateAnswer { grant: true, limits: Some(now), restore: f, message: Some(detail) },
                None,
            ));
        }
        if above {
            let detail = format!(
                "the limits of before could not be set back: the kernel enforces {}; the books count what it \
                 enforces",
                change(&allowed.unwrap_or_default(), &now)
            );
            warn!(container = %id, "{detail}");
            if let Err(e) = self.store.event("limits-above-admitted", Some(&id), &detail) {
                warn!("cannot record an event: {e}");
            }
        }
        self.updates.remove(&id);
        let mark = rec.allocation.quota.as_deref().cloned();
        let mut to_books = None;
        let mut new_mark = mark.clone();
        if let Some(m) = new_mark.as_mut() {
            let (cpu, mem) = self.unlimited_counts(&rec.allocation.tenant, &now);
            m.cpu_milli = cpu;
            m.memory_mib = mem;
            // Back within what the grant counted before: its class of before.
            if let Some(Some(old)) = flight.as_ref().map(|f| &f.mark_before) {
                if cpu <= old.cpu_milli && mem <= old.memory_mib {
                    m.class = old.class;
                    m.over = old.over.clone();
                    m.under_lease = old.under_lease;
                }
            }
            // The books hear what the grant counts now whenever it differs from what they
            // were told (a raise admitted for the update, or the mark of before).
            let booked = flight.as_ref().and_then(|f| f.booked.clone());
            let counted = quota_gate::mark_amounts(m);
            let before = mark.as_ref().map(quota_gate::mark_amounts);
            if booked.is_some_and(|b| b != counted) || before.is_some_and(|b| b != counted) {
                to_books = Some(ResizeRequest {
                    container_id: id.to_string(),
                    tenant: rec.allocation.tenant.to_string(),
                    amounts: counted,
                    unsynced_lease_grants: false,
                });
            }
        }
        let detail = format!(
            "update done ({outcome}): the kernel enforces CPU {}, memory {}",
            show_cpu(now.cpu_milli),
            show_memory(now.memory_mib)
        );
        if new_mark != mark || flight.is_some() {
            self.store
                .set_quota_mark(&id, new_mark.as_ref(), "update", &detail)
                .map_err(internal)?;
            if new_mark.as_ref().map(|m| m.class) != mark.as_ref().map(|m| m.class) {
                self.reopen_intervals(&id, "reclassified by an update of its limits")?;
            }
        }
        info!(container = %id, "{detail}");
        Ok((
            UpdateAnswer { grant: true, limits: Some(now), restore: None, message: Some(detail) },
            to_books,
        ))
    }

    /// Closes a running grant's ledger intervals and opens new ones with its class of now
    /// (borrowed work is metered at the burst price from the change on).
    fn reopen_intervals(&mut self, container_id: &str, why: &str) -> Result<(), CoreError> {
        let Some(rec) = self.store.get(container_id).map_err(internal)? else { return Ok(()) };
        let closed = self.ledger.close_container(container_id, why).map_err(ledger_err)?;
        if !closed.is_empty() {
            self.open_intervals(&rec.allocation)?;
        }
        Ok(())
    }

    /// The reconciler's look at every running quota-marked grant's limits: an update in
    /// flight longer than [`UPDATE_WAIT`] is finished from what the kernel enforces; a
    /// grant whose kernel limits differ from what its mark counts (a `runc update` run
    /// without tessera-runtime, a cgroup file written directly) gets a `limits` event and
    /// its mark follows the kernel (the next sync tells the books: they follow the node,
    /// nothing to admit). Returns what to tell the books of the updates finished here.
    pub fn check_limits(&mut self) -> Vec<ResizeRequest> {
        let mut to_books = Vec::new();
        if !self.policy.policy.has_quotas() {
            return to_books;
        }
        let records = match self.store.all() {
            Ok(r) => r,
            Err(e) => {
                warn!("cannot read the grants to check their limits: {e}");
                return to_books;
            }
        };
        for rec in records {
            let id = rec.allocation.container_id.clone();
            match self.updates.get(&id).map(|f| f.since.elapsed()) {
                Some(age) if age < UPDATE_WAIT => continue,
                Some(_) => {
                    match self.settle_update(&rec, "its wrapper never said it was done", true) {
                        Ok((_, Some(r))) => to_books.push(r),
                        Ok(_) => {}
                        Err(e) => {
                            warn!(container = %id, "finishing an update failed: {}", e.message())
                        }
                    }
                    continue;
                }
                None => {}
            }
            let Some(mark) = rec.allocation.quota.as_deref() else { continue };
            let Ok((kernel, _)) = self.kernel_limits(&rec) else { continue };
            let now = limits::counted(&kernel).unwrap_or_default();
            let (cpu, mem) = self.unlimited_counts(&rec.allocation.tenant, &now);
            if cpu == mark.cpu_milli && mem == mark.memory_mib {
                continue;
            }
            let booked = ContainerLimits {
                cpu_milli: Some(mark.cpu_milli),
                memory_mib: Some(mark.memory_mib),
            };
            let up = cpu > mark.cpu_milli || mem > mark.memory_mib;
            let detail = format!(
                "the kernel enforces other limits than the books count ({}), changed without tessera-runtime; \
                 the books follow the kernel{}",
                change(&booked, &ContainerLimits { cpu_milli: Some(cpu), memory_mib: Some(mem) }),
                if up { " (a raise nobody admitted)" } else { "" }
            );
            if up {
                warn!(container = %id, tenant = %rec.allocation.tenant, "{detail}");
            }
            let mut m = mark.clone();
            m.cpu_milli = cpu;
            m.memory_mib = mem;
            if let Err(e) = self.store.set_quota_mark(&id, Some(&m), "limits", &detail) {
                warn!(container = %id, "cannot record its limits: {e}");
            }
        }
        to_books
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::{Path, PathBuf};
    use std::sync::Arc;

    use tessera_api::{AllocateRequest, Allocation, RequestSource, StartRequest};

    use super::*;
    use crate::controller::{Action, Controller, Outcome};
    use crate::node::{ActivePolicy, NodeParts};
    use crate::quota_gate::QuotaGate;

    const POLICY: &[u8] = include_bytes!("../../../../examples/policy.json");
    const PID: i32 = 4242;

    fn repo(p: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(p)
    }

    /// The example policy; acme/dev guarantees 1 H100 (ceiling 5), a quarter of a CPU core
    /// (ceiling 4) and 2 GiB (ceiling 8).
    fn node(state: &Path, host: Arc<dyn crate::host::Host>) -> Node {
        let mut v: serde_json::Value = serde_json::from_slice(POLICY).expect("json");
        v["quotas"] = serde_json::json!({
            "acme/dev": {"gpus": {"H100-80GB": {"guarantee": 1, "ceiling": 5}},
                         "cpu_cores": {"guarantee": 0.25, "ceiling": 4},
                         "memory_gib": {"guarantee": 2, "ceiling": 8}},
        });
        let policy = policy::Policy::parse(&serde_json::to_vec(&v).expect("json"), "test.json")
            .expect("policy");
        let backend =
            slicer::SimBackend::open(&repo("examples/nodes/h100x8.json"), state).expect("sim");
        let control = mpsd::ProcessControl::new("/nonexistent/nvidia-cuda-mps-control");
        Node::new(NodeParts {
            backend: Box::new(backend),
            policy: ActivePolicy { policy, source: "test".into() },
            store: crate::store::Store::open(&state.join("state.db")).expect("store"),
            ledger: metering::Ledger::open(
                &state.join("ledger.db"),
                Arc::new(metering::SystemClock),
            )
            .expect("ledger"),
            mps: Arc::new(mpsd::Supervisor::new(Arc::new(control), state.to_path_buf())),
            host,
            pending_grace: Duration::from_secs(60),
            dynamic_mig: false,
            scrub: crate::node::ScrubSetup { exe: "/nonexistent/tessera".into(), sim_faults: None },
        })
        .expect("node")
    }

    /// A machine with one container init (pid 4242) in cgroup `/c/u1` of every v1
    /// hierarchy, limited to `quota` µs per 100 ms and `memory` bytes.
    struct Machine {
        proc_root: PathBuf,
        cgroup_root: PathBuf,
    }

    impl Machine {
        fn new(dir: &Path) -> Machine {
            let m = Machine { proc_root: dir.join("proc"), cgroup_root: dir.join("cgroup") };
            let p = m.proc_root.join(PID.to_string());
            std::fs::create_dir_all(&p).expect("mkdir");
            std::fs::write(
                p.join("stat"),
                format!("{PID} (sh) S 1 {PID} {PID} 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10"),
            )
            .expect("stat");
            std::fs::write(
                p.join("cgroup"),
                "9:memory:/c/u1\n5:devices:/c/u1\n4:cpu:/c/u1\n0::/\n",
            )
            .expect("cgroup");
            for c in ["devices", "cpu", "memory"] {
                let d = m.cgroup_root.join(c).join("c/u1");
                std::fs::create_dir_all(&d).expect("mkdir");
                std::fs::write(d.join("cgroup.procs"), format!("{PID}\n")).expect("procs");
            }
            std::fs::write(m.cpu().join("cpu.cfs_period_us"), "100000\n").expect("period");
            m.set(20_000, 512 << 20);
            m
        }
        fn cpu(&self) -> PathBuf {
            self.cgroup_root.join("cpu/c/u1")
        }
        /// What runc (or anyone writing the files) leaves.
        fn set(&self, quota: i64, memory: u64) {
            std::fs::write(self.cpu().join("cpu.cfs_quota_us"), format!("{quota}\n")).expect("q");
            let mem = self.cgroup_root.join("memory/c/u1/memory.limit_in_bytes");
            std::fs::write(mem, format!("{memory}\n")).expect("m");
        }
        fn host(&self) -> Arc<dyn crate::host::Host> {
            Arc::new(crate::TreeHost {
                proc_root: self.proc_root.clone(),
                cgroup_root: self.cgroup_root.clone(),
            })
        }
    }

    fn update(quota: i64, memory: i64) -> UpdateRequest {
        UpdateRequest {
            runc_root: "/run/tessera-test-runc".into(),
            cpu_quota: quota,
            cpu_period: 0,
            memory_limit: memory,
            ..Default::default()
        }
    }

    fn done(ok: bool, restored: bool) -> UpdateDone {
        UpdateDone { runc_root: "/run/tessera-test-runc".into(), runc_succeeded: ok, restored }
    }

    fn answer(r: Result<Outcome, CoreError>) -> Result<UpdateAnswer, CoreError> {
        r.map(|o| match o {
            Outcome::Update(a) => a,
            other => panic!("{other:?}"),
        })
    }

    fn events(ctl: &Controller, kind: &str) -> Vec<String> {
        ctl.locked(|n| Ok(n.store.recent_events(100).expect("events")))
            .expect("events")
            .into_iter()
            .filter(|e| e.kind == kind)
            .map(|e| e.detail)
            .collect()
    }

    /// A controller with the node's own books on a machine of [`Machine::new`] that has
    /// granted `u1` (a GPU of team-dev, 0.2 cores, 512 MiB) and started it as pid 4242.
    fn u1_granted_and_started() -> (tempfile::TempDir, Machine, Arc<Controller>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let m = Machine::new(dir.path());
        let ctl = Controller::new(node(&dir.path().join("state"), m.host()));
        ctl.set_quota(QuotaGate::new(crate::quota_gate::Authority::local("sim-h100-0"), None));
        let req = AllocateRequest {
            container_id: tessera_api::ContainerId::new("u1").expect("id"),
            runc_root: "/run/tessera-test-runc".into(),
            bundle: "/b/u1".into(),
            request: "gpu=1".parse().expect("request"),
            request_source: RequestSource::Annotation,
            annotations: BTreeMap::from([(
                "io.kubernetes.cri.sandbox-namespace".to_string(),
                "team-dev".to_string(),
            )]),
            limits: Some(ContainerLimits { cpu_milli: Some(200), memory_mib: Some(512) }),
        };
        ctl.apply(Action::Allocate { req, requester: None }).expect("granted");
        let start = StartRequest { pid: PID, bundle: "/b/u1".into(), created: false };
        ctl.apply(Action::Start { container_id: "u1".parse().expect("valid"), req: start })
            .expect("started");
        (dir, m, ctl)
    }

    /// Under a lease, a raise counts what the node has asked the coordinator for and not
    /// settled as held, as a new grant does (docs/QUOTAS.md, Limits): the books may count
    /// that ask within this node's lease.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn under_a_lease_a_raise_counts_the_asks_in_flight_as_held() {
        let (_dir, _machine, ctl) = u1_granted_and_started();
        let tenant = ctl.locked(|n| n.allocation("u1")).expect("grant").tenant.to_string();

        // The coordinator is out of reach; this node's lease of acme/dev covers the GPU, a
        // quarter of a core and 2 GiB. Another container's ask of a tenth of a core waits.
        let gate = QuotaGate::out_of_reach(vec![fleet::quota_wire::Lease {
            path: "acme/dev".into(),
            amounts: Amounts {
                gpus: BTreeMap::from([("H100-80GB".to_string(), quota::MICRO_PER_GPU)]),
                cpu_milli: 250,
                memory_mib: 2048,
            },
        }]);
        let tenth = Amounts { cpu_milli: 100, ..Amounts::default() };
        let in_flight = gate.asking("u2", &tenant, &tenth);

        // 0.24 cores: 0.2 held + 0.04 fits the lease alone, not with the ask in flight.
        let id: ContainerId = "u1".parse().expect("valid");
        let raise = |ctl: &Controller| {
            ctl.locked(|n| {
                let UpdatePlan::Step(step) = n.plan_update(&id, &update(24_000, 0))? else {
                    panic!("a grant")
                };
                let lease = UpdateAdmission::Lease {
                    leases: gate.as_ref(),
                    since_ms: tessera_api::time::now_ms(),
                    why: "connection refused".into(),
                };
                n.begin_update(&step, &lease)
            })
        };
        let e = raise(&ctl).expect_err("the ask in flight holds the rest of the lease");
        assert_eq!((e.code(), e.rule()), (ErrorCode::Refused, Some("quotas")));
        assert!(e.message().contains("the quota coordinator is unreachable"), "{}", e.message());
        let mark = ctl.locked(|n| n.allocation("u1")).expect("grant").quota.expect("marked");
        assert_eq!(mark.cpu_milli, 200, "nothing raised");
        drop(in_flight);
        raise(&ctl).expect("within the lease once the ask is settled");
        let mark = ctl.locked(|n| n.allocation("u1")).expect("grant").quota.expect("marked");
        assert_eq!((mark.cpu_milli, mark.under_lease), (240, true));
    }

    /// The controller with the node's own books: a raise past a ceiling is refused and
    /// changes nothing; within them it is admitted (borrowed beyond the guarantee), and
    /// `done` records what the kernel enforces; more than was admitted is asked back; a
    /// change made without the wrapper is found by the reconciler and recorded.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn an_update_is_admitted_as_a_grant_is_and_the_books_follow_the_kernel() {
        let (_dir, m, ctl) = u1_granted_and_started();
        let mark = || -> QuotaMark {
            let a: Allocation = ctl.locked(|n| n.allocation("u1")).expect("grant");
            *a.quota.expect("marked")
        };
        let ask = |q, mem| {
            answer(ctl.apply(Action::Update {
                container_id: "u1".parse().expect("valid"),
                req: update(q, mem),
            }))
        };
        let say_done = |ok, restored| {
            answer(ctl.apply(Action::UpdateDone {
                container_id: "u1".parse().expect("valid"),
                req: done(ok, restored),
            }))
        };
        assert_eq!(mark().class, QuotaClass::Guaranteed);

        // 16 cores: past the ceiling, refused by its rule; nothing recorded.
        let e = ask(1_600_000, 0).expect_err("past the ceiling");
        assert_eq!(
            (e.code(), e.rule()),
            (ErrorCode::Refused, Some("quotas.acme/dev.cpu_cores.ceiling"))
        );
        assert_eq!((mark().cpu_milli, mark().memory_mib), (200, 512));
        assert!(events(&ctl, "refuse").iter().any(|d| d.contains("cpu_cores.ceiling")));
        // Unlimited memory where a quota bounds it: refused as at create.
        let e = ask(0, -1).expect_err("unlimited");
        assert!(e.message().contains("bounds memory"), "{}", e.message());

        // 0.6 cores, 1 GiB: admitted, borrowed beyond the guarantee of a quarter core. (The
        // fleet's capacity is this host's CPUs: kept under one core here.)
        let a = ask(60_000, 1 << 30).expect("admitted");
        assert_eq!(
            a.limits,
            Some(ContainerLimits { cpu_milli: Some(600), memory_mib: Some(1024) })
        );
        assert_eq!(
            (mark().cpu_milli, mark().memory_mib, mark().class),
            (600, 1024, QuotaClass::Borrowed)
        );
        let e = ask(10_000, 0).expect_err("one update at a time");
        assert_eq!(e.code(), ErrorCode::Conflict);
        m.set(60_000, 1 << 30); // runc did it
        let a = say_done(true, false).expect("done");
        assert_eq!((a.restore, a.limits.and_then(|l| l.cpu_milli)), (None, Some(600)));

        // runc failed: the old values stand and the raise is given back.
        ask(80_000, 0).expect("admitted");
        assert_eq!(mark().cpu_milli, 800);
        say_done(false, false).expect("done");
        assert_eq!((mark().cpu_milli, mark().class), (600, QuotaClass::Borrowed));

        // The kernel holds more than was admitted after the update: asked back; once set
        // back, recorded.
        ask(30_000, 0).expect("a decrease");
        m.set(70_000, 1 << 30);
        let a = say_done(true, false).expect("done");
        let before = a.restore.expect("the limits of before asked back");
        assert_eq!((before.cpu_quota, before.memory), (Some(60_000), Some(1 << 30)));
        assert!(!events(&ctl, "limits-above-admitted").is_empty());
        m.set(60_000, 1 << 30); // the wrapper set them back
        let a = say_done(true, true).expect("done");
        assert_eq!(a.restore, None);
        assert_eq!(mark().cpu_milli, 600);

        // Changed without the wrapper: the reconciler records it, the books follow.
        m.set(50_000, 768 << 20);
        ctl.apply(Action::Reconcile).expect("reconciled");
        assert_eq!((mark().cpu_milli, mark().memory_mib), (500, 768));
        let drift = events(&ctl, "limits");
        assert!(drift.iter().any(|d| d.contains("changed without tessera-runtime")), "{drift:?}");

        // Another container, or this one in another runc root: not this grant.
        let other = answer(ctl.apply(Action::Update {
            container_id: "nope".parse().expect("valid"),
            req: update(1, 0),
        }));
        assert!(!other.expect("no grant").grant);
        let mut elsewhere = update(1, 0);
        elsewhere.runc_root = "/run/other-root".into();
        let e =
            answer(ctl.apply(Action::Update {
                container_id: "u1".parse().expect("valid"),
                req: elsewhere,
            }))
            .expect_err("another root");
        assert_eq!(e.code(), ErrorCode::Conflict);
        assert!(e.message().contains("/run/other-root"), "{}", e.message());
    }
}
