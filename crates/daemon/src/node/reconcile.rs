//! `reconcile`: release every grant whose container is gone ([`liveness::judge`]).

use std::path::Path;

use tessera_api::{untrusted, AllocationState};
use tracing::{info, warn};

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
            if rec.allocation.state == AllocationState::Pending {
                self.settle_made(&mut rec);
            }
            let facts = self.facts(&rec, pid_start_now, now);
            let a = &rec.allocation;
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

    /// Watch runc's roots for removed records from now on: every root a grant names now,
    /// and each a container is confirmed in later ([`crate::runc_watch`]).
    /// A host whose records are not this machine's (a fixture) is not watched.
    pub fn watch_runc_roots(&mut self, mut watch: crate::runc_watch::RuncWatch) {
        if !self.host.watches_exits() {
            return;
        }
        let roots: std::collections::BTreeSet<String> =
            self.store.all().unwrap_or_default().into_iter().map(|r| r.runc_root).collect();
        for root in roots {
            if let Err(e) = watch.watch(Path::new(&root)) {
                warn!("{e}; its grants are given back by the reconciler's pass");
            }
        }
        self.runc_watch = Some(watch);
    }

    /// A descriptor readable when a watched root changed, for the task that wakes the
    /// controller (`crate::spawn_removals`).
    pub fn runc_watch_readiness(&self) -> Option<std::os::fd::OwnedFd> {
        self.runc_watch.as_ref().and_then(|w| match w.readiness_fd() {
            Ok(fd) => Some(fd),
            Err(e) => {
                warn!("{e}; grants are given back at the next action");
                None
            }
        })
    }

    /// Watch the processes that ask for grants from now on ([`crate::requesters`]). A
    /// host whose pids are not this machine's (a fixture) is not watched.
    pub fn watch_requesters(&mut self, requesters: crate::requesters::Requesters) {
        if !self.host.watches_exits() {
            return;
        }
        self.requesters = Some(requesters);
        // Grants of containers runc created before this tesserad started: that create is
        // over (runc writes the record last), so a delete before any start ends them.
        for mut rec in self.store.all().unwrap_or_default() {
            self.settle_made(&mut rec);
        }
    }

    /// A pending grant whose container runc made (its record exists), with no requester
    /// watched (this tesserad started since it was asked for, or since a create under way
    /// across the restart finished): its create is over, so once runc removes the record
    /// nothing can start with it ([`Requesters::mark_exited`]). Called at the start and at
    /// every reconciler pass.
    ///
    /// [`Requesters::mark_exited`]: crate::requesters::Requesters::mark_exited
    fn settle_made(&mut self, rec: &mut Record) {
        let a = &rec.allocation;
        if a.state != AllocationState::Pending
            || !self.host.runc_state_exists(Path::new(&rec.runc_root), &a.container_id)
        {
            return;
        }
        if let Some(w) = self.requesters.as_mut() {
            w.mark_exited(&a.container_id, a.created_ms);
        }
        self.record_made_cgroup(rec);
    }

    /// A pending grant whose container runc made: the cgroup of the init runc recorded is
    /// kept on the grant. runc wrote the grant's device rules there at create, before any
    /// confirmation; a process of another container that got in (between the wrapper's
    /// check that the cgroup is empty and runc's create) keeps them when the created
    /// container is deleted without ever starting, so the grant is held while a process is
    /// in that cgroup ([`liveness::judge`]), as after a refused start. Listed beside the
    /// socket too, so no other container is created into it. Nothing is recorded where
    /// the init is gone or its pid names another process now.
    fn record_made_cgroup(&mut self, rec: &mut Record) {
        let a = &rec.allocation;
        if a.state != AllocationState::Pending || rec.cgroup.is_some() {
            return;
        }
        let Some((pid, start)) = self.host.runc_init(Path::new(&rec.runc_root), &a.container_id)
        else {
            return;
        };
        if self.host.pid_start_time(pid) != Some(start) {
            return;
        }
        match self.host.container_cgroup(pid) {
            Ok(cg) => match self.store.set_cgroup(&a.container_id, &cg) {
                Ok(()) => {
                    rec.cgroup = Some(cg);
                    self.write_grant_cgroups();
                }
                Err(e) => warn!(container = %a.container_id, "cannot record its cgroup: {e}"),
            },
            Err(e) => warn!(container = %a.container_id, "cannot tell its cgroup: {e}"),
        }
    }

    /// A descriptor readable when a requester exited, for the task that wakes the
    /// controller (`crate::spawn_removals`).
    pub fn requesters_readiness(&self) -> Option<std::os::fd::OwnedFd> {
        self.requesters.as_ref().and_then(|w| match w.readiness_fd() {
            Ok(fd) => Some(fd),
            Err(e) => {
                warn!("{e}; unconfirmed grants are given back at the next action");
                None
            }
        })
    }

    /// Watch `pidfd`, the process that asked for grant `a`, until the grant is confirmed.
    ///
    /// The grant was answered under an earlier hold of the lock: a grant that was already
    /// there (a create of the same id again) may have ended since, once every earlier
    /// requester had exited with no record. The answer would hand the caller devices no
    /// longer granted, for a container tesserad no longer watches: refused (409), the
    /// caller asks again.
    pub fn watch_requester(
        &mut self,
        a: &tessera_api::Allocation,
        pidfd: std::os::fd::OwnedFd,
    ) -> Result<(), CoreError> {
        if a.state != AllocationState::Pending {
            return Ok(());
        }
        let Some(w) = self.requesters.as_mut() else { return Ok(()) };
        let current = self.store.get(&a.container_id).map_err(internal)?;
        if current.is_none_or(|r| r.allocation.created_ms != a.created_ms) {
            return Err(CoreError::conflict(format!(
                "container {}: its grant ended while it was being answered (an earlier create \
                 of the same id exited with no container); nothing granted, ask again",
                a.container_id
            )));
        }
        if let Err(e) = w.watch(&a.container_id, a.created_ms, pidfd) {
            warn!("{e}; the grant is kept for the pending grace if its create fails");
        }
        Ok(())
    }

    /// The grant's requesters are not watched any more (it was confirmed, or ended).
    pub(super) fn forget_requesters(&mut self, id: &tessera_api::ContainerId) {
        if let Some(w) = self.requesters.as_mut() {
            w.forget(id);
        }
    }

    /// What is known of the processes that asked for grant `a`.
    fn requester(&self, a: &tessera_api::Allocation) -> liveness::Requester {
        self.requesters
            .as_ref()
            .map_or(liveness::Requester::Unknown, |w| w.state(&a.container_id, a.created_ms))
    }

    /// The grants whose every requester exited since the last look: released where runc
    /// has no record of the container (its create or run is over and made nothing); where
    /// it has one, its root is watched, so a delete before any start gives the grant back
    /// at once. Returns the released ids.
    fn settle_requesters(&mut self) -> Result<Vec<String>, CoreError> {
        let Some(w) = self.requesters.as_mut() else { return Ok(Vec::new()) };
        let exited = match w.drain() {
            Ok(e) => e,
            Err(e) => {
                warn!("{e}; unconfirmed grants are judged by the reconciler's pass");
                return Ok(Vec::new());
            }
        };
        let now = crate::now_ms();
        let mut released = Vec::new();
        for (id, created_ms) in exited {
            let Some(mut rec) = self.store.get(&id).map_err(internal)? else { continue };
            let a = &rec.allocation;
            if a.created_ms != created_ms || a.state != AllocationState::Pending {
                continue;
            }
            let facts = self.facts(&rec, None, now);
            if facts.runc_state_exists {
                let root = rec.runc_root.clone();
                self.watch_runc_root(&root);
                self.record_made_cgroup(&mut rec);
                continue;
            }
            let grace = self.pending_grace.as_millis() as u64;
            if let Liveness::Gone(why) = liveness::judge(a.state, rec.pid_start, &facts, grace) {
                self.drop_allocation(&a.container_id, &why)?;
                info!(container = %a.container_id, tenant = %a.tenant, %why, "released");
                released.push(a.container_id.to_string());
            }
        }
        Ok(released)
    }

    /// Watch `root` (a container was just confirmed there).
    pub(super) fn watch_runc_root(&mut self, root: &str) {
        let Some(w) = self.runc_watch.as_mut() else { return };
        if let Err(e) = w.watch(Path::new(root)) {
            warn!("{e}; its grants are given back by the reconciler's pass");
        }
    }

    /// The grants whose runc record was removed since the last look, judged now by the
    /// reconciler's rule and released where their container is gone. Returns the released
    /// ids.
    pub fn settle_removed(&mut self) -> Result<Vec<String>, CoreError> {
        let mut released = self.settle_requesters()?;
        released.extend(self.settle_removed_records()?);
        Ok(released)
    }

    /// [`Node::settle_removed`] for runc's records.
    fn settle_removed_records(&mut self) -> Result<Vec<String>, CoreError> {
        let Some(w) = self.runc_watch.as_mut() else { return Ok(Vec::new()) };
        let removed = match w.drain() {
            Ok(r) => r,
            Err(e) => {
                // What was read before the error is lost with it: every grant is judged.
                warn!("{e}; every grant is judged again");
                crate::runc_watch::Removed { entries: Vec::new(), look_at_all: true }
            }
        };
        if removed.look_at_all {
            let report = self.reconcile()?;
            return Ok(report.released.into_iter().map(|(id, _)| id).collect());
        }
        let now = crate::now_ms();
        let mut released = Vec::new();
        let mut failed = false;
        for (root, name) in removed.entries {
            match self.settle_one(&root, &name, now) {
                Ok(Some(id)) => released.push(id),
                Ok(None) => {}
                // One grant that cannot be judged now leaves the rest to be judged: the
                // reconciler's pass below looks at it again, and at everything else.
                Err(e) => {
                    warn!(container = %untrusted(&name), "cannot settle a removal: {}", e.message());
                    failed = true;
                }
            }
        }
        if failed {
            let report = self.reconcile()?;
            released.extend(report.released.into_iter().map(|(id, _)| id));
        }
        Ok(released)
    }

    /// One removed record `name` of `root`: its grant released if its container is gone
    /// (the released id), judged by the reconciler's rule.
    fn settle_one(
        &mut self,
        root: &Path,
        name: &str,
        now: u64,
    ) -> Result<Option<String>, CoreError> {
        let Ok(id) = tessera_api::ContainerId::new(name) else { return Ok(None) };
        let Some(rec) = self.store.get(&id).map_err(internal)? else { return Ok(None) };
        if Path::new(&rec.runc_root) != root {
            return Ok(None); // a container of the same id in another root
        }
        let pid_start_now = rec.allocation.pid.and_then(|p| self.host.pid_start_time(p));
        let facts = self.facts(&rec, pid_start_now, now);
        let a = &rec.allocation;
        let grace = self.pending_grace.as_millis() as u64;
        match liveness::judge(a.state, rec.pid_start, &facts, grace) {
            Liveness::Gone(why) => {
                self.drop_allocation(&a.container_id, &format!("runc removed it: {why}"))?;
                info!(container = %a.container_id, tenant = %a.tenant, %why, "released: runc removed the container");
                return Ok(Some(a.container_id.to_string()));
            }
            // runc removed it, but a process left in its cgroup keeps its device rules:
            // said once, here; the reconciler ends the grant once the cgroup is empty.
            Liveness::Alive if !facts.runc_state_exists => {
                let lead = format!("container {}: runc removed it, but ", a.container_id);
                let held = rec.cgroup.as_deref().and_then(|cg| {
                    super::release::cgroup_keeps_the_grant(&lead, cg, &facts.cgroup)
                });
                if let Some(message) = held {
                    if let Err(e) =
                        self.store.event("release-refused", Some(&a.container_id), &message)
                    {
                        warn!("cannot record a refused release: {e}");
                    }
                }
            }
            Liveness::Alive => {}
        }
        Ok(None)
    }

    /// What the host shows of `rec`'s container now, for [`liveness::judge`] (the init's
    /// start time read by the caller). runc's record is read before the cgroup: a container
    /// removed in between is then seen with its cgroup already emptied by runc.
    fn facts(&self, rec: &Record, pid_start_now: Option<u64>, now: u64) -> Facts {
        let a = &rec.allocation;
        Facts {
            runc_state_exists: self
                .host
                .runc_state_exists(Path::new(&rec.runc_root), &a.container_id),
            pid_start_now,
            cgroup: match &rec.cgroup {
                Some(rel) => self.host.cgroup_procs(rel),
                None => CgroupProcs::NotRecorded,
            },
            age_ms: now.saturating_sub(a.created_ms),
            requester: self.requester(a),
        }
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
