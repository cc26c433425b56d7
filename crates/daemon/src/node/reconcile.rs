//! `reconcile`: release every grant whose container is gone ([`liveness::judge`]).

use std::path::Path;

use tessera_api::{untrusted, AllocationState};
use tracing::warn;

use super::{internal, Node};
use crate::error::CoreError;
use crate::liveness::{self, CgroupProcs, Facts, Liveness};
use crate::store::Record;

/// What one reconciler pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ReconcileReport {
    pub checked: usize,
    pub released: Vec<(String, String)>,
}

impl Node {
    /// Release every allocation whose container is gone ([`liveness::judge`]).
    pub fn reconcile(&mut self) -> Result<ReconcileReport, CoreError> {
        let now = crate::now_ms();
        let mut report = ReconcileReport::default();
        for mut rec in self.store.all().map_err(internal)? {
            report.checked += 1;
            let pid_start_now = rec.allocation.pid.and_then(|p| self.host.pid_start_time(p));
            if rec.cgroup.is_none() && rec.allocation.state == AllocationState::Running {
                self.fill_in_cgroup(&mut rec, pid_start_now);
            }
            let a = &rec.allocation;
            let facts = Facts {
                // Read runc's record before the cgroup: a container removed in between is
                // then seen with its cgroup already emptied by runc.
                runc_state_exists: self
                    .host
                    .runc_state_exists(Path::new(&rec.runc_root), &a.container_id),
                pid_start_now,
                cgroup: match &rec.cgroup {
                    Some(rel) => self.host.cgroup_procs(rel),
                    None => CgroupProcs::NotRecorded,
                },
                age_ms: now.saturating_sub(a.created_ms),
            };
            // While the container's init runs, its cgroup is its own: a process of another
            // pid namespace there (another container that got in, as a race between two
            // creates could let it) has the grant's device rules and is killed.
            if let (AllocationState::Running, Some(pid), Some(cg), true) = (
                a.state,
                a.pid,
                rec.cgroup.as_deref(),
                pid_start_now.is_some() && pid_start_now == rec.pid_start,
            ) {
                for (intruder, start) in self.host.cgroup_intruders(cg, pid) {
                    let killed = self.host.signal(intruder, start, crate::host::Signal::Kill);
                    let detail = format!(
                        "pid {intruder} in the grant's cgroup {} is not the container's (another pid namespace): {}",
                        untrusted(cg),
                        match &killed {
                            Ok(true) => "killed".to_string(),
                            Ok(false) => "gone before it was killed".to_string(),
                            Err(e) => format!("cannot kill it: {e}"),
                        }
                    );
                    warn!(container = %a.container_id, tenant = %a.tenant, "{detail}");
                    if let Err(e) =
                        self.store.event("cgroup-intruder", Some(&a.container_id), &detail)
                    {
                        warn!("cannot record a cgroup intruder: {e}");
                    }
                }
            }
            if let Liveness::Gone(why) = liveness::judge(
                a.state,
                rec.pid_start,
                &facts,
                self.pending_grace.as_millis() as u64,
            ) {
                warn!(container = %a.container_id, tenant = %a.tenant, %why, "reconciler releases");
                self.drop_allocation(&a.container_id, &format!("reconciler: {why}"))?;
                report.released.push((a.container_id.to_string(), why));
            }
        }
        self.reconcile_passes += 1;
        Ok(report)
    }

    /// A running grant recorded without its cgroup (store schema 1) whose init still runs:
    /// its cgroup is read from that process now and kept, so the grant is judged by it.
    pub(super) fn fill_in_cgroup(&mut self, rec: &mut Record, pid_start_now: Option<u64>) {
        let (Some(pid), Some(now)) = (rec.allocation.pid, pid_start_now) else { return };
        if rec.pid_start.is_some_and(|then| then != now) {
            return; // the pid names another process now
        }
        match self.host.container_cgroup(pid) {
            Ok(cg) => match self.store.set_cgroup(&rec.allocation.container_id, &cg) {
                Ok(()) => rec.cgroup = Some(cg),
                Err(e) => {
                    warn!(container = %rec.allocation.container_id, "cannot record its cgroup: {e}")
                }
            },
            Err(e) => {
                warn!(container = %rec.allocation.container_id, "cannot tell its cgroup: {e}")
            }
        }
    }
}
