//! `start` (the container runc made is confirmed, by its pid and bundle, before any of its
//! code runs: by tessera-runtime's `start` of a container `runc create` made, or by the prestart hook during
//! `runc run`) and the init's exit: what the exit watcher ([`crate::exits`]) watches and
//! what it closes.

use std::path::Path;

use tessera_api::mountinfo;
use tessera_api::{untrusted, Allocation, AllocationState, ContainerId, StartRequest};
use tracing::info;

use super::{internal, ledger_err, Node};
use crate::error::CoreError;

impl Node {
    /// The container exists with this pid and is isolated as its grant assumes: its grant
    /// runs from now on.
    pub fn start(
        &mut self,
        container_id: &ContainerId,
        req: &StartRequest,
    ) -> Result<Allocation, CoreError> {
        let rec = self.store.get(container_id).map_err(internal)?.ok_or_else(|| {
            CoreError::not_found(format!(
                "container {container_id} has no GPU allocation on this node; refusing to start it"
            ))
        })?;
        if rec.bundle != req.bundle {
            return Err(CoreError::conflict(format!(
                    "container {container_id}: the start names bundle {} but the grant was made for bundle {}",
                    untrusted(&req.bundle),
                    untrusted(&rec.bundle)
                ),
            ));
        }
        if req.pid <= 0 {
            return Err(CoreError::bad_request(format!(
                "container {container_id}: pid {} is not a process id",
                req.pid
            )));
        }
        // Asked again for the same process (a hook runc retried): the answer it had. A
        // confirmation after `runc create` is checked even so, on what runc finished.
        let confirmed =
            rec.allocation.state == AllocationState::Running && rec.allocation.pid == Some(req.pid);
        if confirmed && !req.created {
            return Ok(rec.allocation);
        }
        let start = self.host.pid_start_time(req.pid);
        if start.is_none() {
            return Err(CoreError::bad_request(format!(
                "container {container_id}: pid {} is not alive",
                req.pid
            )));
        }
        // The grant lasts while a process is in this cgroup (runc keeps the container's
        // device rules there). One that cannot be told for sure is refused: the grant
        // could end while a process of the container still runs with the device.
        let cgroup = self.host.container_cgroup(req.pid).map_err(|e| {
            CoreError::bad_request(format!("container {container_id}: cannot tell the cgroup of pid {}: {e}; refusing to start it", req.pid),
            )
        })?;
        // Confirming a grant is a decision made now, under the policy in force: a created
        // container waits for its start (issue 29), and a grant the policy came to refuse
        // meanwhile (which `revoke-check --stop` skips while it is pending: no process to
        // signal) must not start. A grant already confirmed is the stop's to end. Refused,
        // its cgroup is kept on the grant as for any refused start (`refuse_start`).
        if !confirmed {
            if let Some((kind, why)) = self.refusal_now(&rec.allocation)? {
                return Err(self.refuse_start(container_id, &cgroup, kind, &why));
            }
        }
        if let Err(why) = self.container_is_its_own(
            container_id,
            req.pid,
            &cgroup,
            Path::new(&rec.bundle),
            req.created,
            &rec.allocation.injection.mounts,
        ) {
            return Err(self.refuse_start(container_id, &cgroup, "isolation", &why));
        }
        if let Err(why) = self.admitted_limits_hold(&rec, req.pid) {
            return Err(self.refuse_start(container_id, &cgroup, "isolation", &why));
        }
        if confirmed {
            return Ok(rec.allocation);
        }
        let rec = self.store.set_running(rec, req.pid, start, Some(cgroup)).map_err(internal)?;
        self.forget_requesters(container_id);
        self.write_grant_cgroups();
        // runc's root exists now (it holds this container): its removal releases the grant.
        self.watch_runc_root(&rec.runc_root);
        // Metering starts when the container does. Recorded after the pid, so a crash in
        // between is repaired by resume_metering on restart.
        self.open_intervals(&rec.allocation)?;
        info!(container = %container_id, pid = req.pid, "started");
        Ok(rec.allocation)
    }

    /// A start refused for `why`: recorded as an event of `kind` (`isolation`, `revoke`,
    /// `xid`), and the cgroup runc made for the container (`cgroup`, which holds its device
    /// rules: runc wrote them at its create) kept on the grant, so the grant is not given
    /// back while a process is in it — another container's that shares it, say, which the
    /// rules now let open the granted devices ([`crate::liveness::judge`]).
    fn refuse_start(
        &mut self,
        container_id: &ContainerId,
        cgroup: &str,
        kind: &str,
        why: &dyn std::fmt::Display,
    ) -> CoreError {
        let message = format!("container {container_id}: {why}; refusing to start it");
        if let Err(e) = self.store.event(kind, Some(container_id), &message) {
            tracing::warn!("cannot record a refused start ({kind}): {e}");
        }
        if let Err(e) = self.store.set_cgroup(container_id.as_str(), cgroup) {
            tracing::warn!(container = %container_id, "cannot record the refused container's cgroup: {e}");
        }
        CoreError::refused(message)
    }

    /// Why grant `a` may not start now, if it may not, with the kind of event that records
    /// it: where one of its devices was quarantined since it was granted and the policy
    /// stops the holders of a quarantined device (`faults.stop_holders`: a grant not started
    /// has no process to stop, so its start is refused instead), `xid`; where the policy in
    /// force refuses it (the check of `revoke-check`, [`super::revoke::refused`]), `revoke`.
    fn refusal_now(&self, a: &Allocation) -> Result<Option<(&'static str, String)>, CoreError> {
        if self.policy.policy.faults().stop_holders {
            let quarantined = self
                .lifecycle()?
                .into_iter()
                .filter(|(_, (st, _))| matches!(st, scrub::DeviceState::Quarantined { .. }))
                .map(|(u, _)| u)
                .find(|u| {
                    a.devices.iter().any(|d| d.uuid.as_str() == u)
                        || a.share.as_ref().is_some_and(|s| s.device == *u)
                });
            if let Some(device) = quarantined {
                let why = format!(
                    "its device {} was quarantined after a fault (faults.stop_holders)",
                    untrusted(&device)
                );
                return Ok(Some(("xid", why)));
            }
        }
        let node = &self.inventory.node;
        let Some(r) =
            super::revoke::refused(&self.policy.policy, node, std::slice::from_ref(a)).pop()
        else {
            return Ok(None);
        };
        let why = format!(
            "policy version {} refuses its grant ({}: {})",
            self.policy.policy.version(),
            r.rule,
            r.message
        );
        Ok(Some(("revoke", why)))
    }

    /// Whether a GPU container about to start is isolated as its grant assumes, judged on
    /// what the kernel made of its config (runc made every mount and its cgroup before the
    /// prestart hook, and the rest of its root by the time `runc create` returns; nothing of
    /// the container has run yet):
    /// - its mounts hold no writable cgroup hierarchy or sysfs and receive no mounts made
    ///   outside ([`mountinfo::findings`]), every procfs among them shows its own pid
    ///   namespace ([`mountinfo::foreign_procfs`]), and it shares neither the host's mount
    ///   nor its pid namespace;
    /// - its cgroup is its own: it holds the container's init and nothing else, and is
    ///   neither another grant's cgroup nor above or below one (a process that shares it
    ///   keeps its device rules after the grant ends, and its CPU limit is another's).
    fn container_is_its_own(
        &self,
        container_id: &str,
        pid: i32,
        cgroup: &str,
        bundle: &Path,
        created: bool,
        given: &[tessera_api::BindMount],
    ) -> Result<(), NotStartable> {
        let shared = self.host.shared_namespaces(pid).map_err(NotStartable::Host)?;
        if !shared.is_empty() {
            return Err(NotStartable::HostNamespace(shared.join(" and ")));
        }
        let table = self.host.container_mounts(pid, bundle, created).map_err(NotStartable::Host)?;
        if let Some(f) = mountinfo::findings(&table).first() {
            return Err(NotStartable::Mount(f.to_string()));
        }
        // Nothing of tesserad's own but what its grant brought in (an MPS pipe directory).
        if !self.private_paths.is_empty() {
            let host = self.host.host_mounts().map_err(NotStartable::Host)?;
            let place = |p: &Path| {
                let (device, within) = mountinfo::place(&host, p)?;
                Some(mountinfo::Private { device, within, name: p.display().to_string() })
            };
            let private = mountinfo::private_places(&host, &self.private_paths);
            let given: Vec<_> = given
                .iter()
                .filter_map(|m| place(&std::fs::canonicalize(&m.source).ok()?))
                .collect();
            if let Some(f) = mountinfo::private_in_view(&table, &private, &given) {
                return Err(NotStartable::Mount(f.to_string()));
            }
        }
        // Every procfs it holds shows its own pid namespace, whatever the config asked for
        // (a bind of the host's /proc at /proc, a source swapped after the wrapper's check).
        if table.iter().any(|e| e.fstype == "proc") {
            let Some(own) = self.host.pid_namespace(pid) else {
                return Err(NotStartable::Host(format!(
                    "the pid namespace of its init {pid} cannot be read"
                )));
            };
            let shows = |e: &mountinfo::MountEntry| {
                self.host.procfs_shows(pid, bundle, created, &e.mount_point)
            };
            if let Some(f) = mountinfo::foreign_procfs(&table, &own, shows) {
                return Err(NotStartable::Mount(f.to_string()));
            }
        }
        match self.host.cgroup_procs(cgroup) {
            crate::liveness::CgroupProcs::Count(1) => {}
            crate::liveness::CgroupProcs::Count(n) => {
                return Err(NotStartable::CgroupShared {
                    cgroup: cgroup.to_string(),
                    others: n.saturating_sub(1),
                })
            }
            crate::liveness::CgroupProcs::Unreadable(e) => {
                return Err(NotStartable::CgroupUnreadable { cgroup: cgroup.to_string(), why: e })
            }
            crate::liveness::CgroupProcs::NotRecorded => {}
        }
        let within = |a: &str, b: &str| a == b || a.starts_with(&format!("{b}/"));
        for other in self.store.all()? {
            if other.allocation.container_id == container_id {
                continue;
            }
            if let Some(theirs) = other.cgroup.as_deref() {
                if within(cgroup, theirs) || within(theirs, cgroup) {
                    return Err(NotStartable::CgroupNested {
                        cgroup: cgroup.to_string(),
                        theirs: theirs.to_string(),
                    });
                }
            }
        }
        Ok(())
    }

    /// Where the tenant's quota chain bounds CPU or memory, the kernel must not give the
    /// container more than its grant was admitted with: runc has set the cgroup's limits
    /// before the prestart hook, and what the books count is what the config said (a
    /// quota over a period the config leaves to the kernel — one another container set in
    /// a cgroup it left behind — can mean 100 times the CPU). Less is fine: the reconciler
    /// records what the kernel enforces.
    fn admitted_limits_hold(
        &self,
        rec: &crate::store::Record,
        pid: i32,
    ) -> Result<(), NotStartable> {
        let Some(mark) = rec.allocation.quota.as_deref() else { return Ok(()) };
        let tenant = rec.allocation.tenant.as_str();
        let tree = self.policy.policy.quotas();
        let bounded = |r: ::quota::Resource| tree.chain(tenant).any(|q| q.limits.contains_key(&r));
        let (cpu_bounded, memory_bounded) =
            (bounded(::quota::Resource::Cpu), bounded(::quota::Resource::Memory));
        if !cpu_bounded && !memory_bounded {
            return Ok(());
        }
        let (kernel, _) = self.host.cgroup_limits(pid).map_err(NotStartable::LimitsUnreadable)?;
        let now = crate::limits::counted(&kernel).map_err(NotStartable::Uncountable)?;
        let (cpu, memory) = self.unlimited_counts(tenant, &now);
        if cpu_bounded && cpu > mark.cpu_milli {
            return Err(NotStartable::CpuOver {
                cpu,
                quota: kernel.cpu_quota.map_or("unlimited".to_string(), |q| q.to_string()),
                period: kernel.cpu_period,
                admitted: mark.cpu_milli,
            });
        }
        if memory_bounded && memory > mark.memory_mib {
            return Err(NotStartable::MemoryOver { memory, admitted: mark.memory_mib });
        }
        Ok(())
    }
}

/// Why a container may not start with its grant: it is not as isolated as a GPU container
/// must be, or its cgroup gives it more than its grant was admitted with (the reason of the
/// refusal, recorded as an `isolation` event).
#[derive(Debug, thiserror::Error)]
enum NotStartable {
    /// What the host said when asked (its words).
    #[error("{0}")]
    Host(String),
    #[error("it runs in the host's {0} namespace (it would see the host's cgroups)")]
    HostNamespace(String),
    #[error("its mounts as runc made them: {0}")]
    Mount(String),
    #[error(
        "its cgroup {} holds {others} other process(es) of another container; a GPU \
         container's cgroup must be its own",
        untrusted(.cgroup)
    )]
    CgroupShared { cgroup: String, others: usize },
    #[error("cannot read its cgroup {}: {why}", untrusted(.cgroup))]
    CgroupUnreadable { cgroup: String, why: String },
    #[error(
        "its cgroup {} is, or is nested with, the cgroup of another GPU container ({}); a GPU \
         container's cgroup must be its own",
        untrusted(.cgroup),
        untrusted(.theirs)
    )]
    CgroupNested { cgroup: String, theirs: String },
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    #[error("cannot read the limits its cgroup enforces: {0}")]
    LimitsUnreadable(String),
    /// The limits it read do not count (`limits::counted`'s words).
    #[error("{0}")]
    Uncountable(String),
    #[error(
        "its cgroup gives it {cpu} millicores of CPU (cpu.cfs_quota_us {quota} over \
         cpu.cfs_period_us {period}), more than the {admitted} it was admitted with: a period \
         the config leaves to the kernel was set by another container"
    )]
    CpuOver { cpu: u64, quota: String, period: u64, admitted: u64 },
    #[error("its cgroup gives it {memory} MiB of memory, more than the {admitted} MiB it was admitted with")]
    MemoryOver { memory: u64, admitted: u64 },
}

impl Node {
    /// List the cgroups of the running grants in `file` from now on (written at once,
    /// then after every start and release).
    pub fn list_grant_cgroups_in(&mut self, file: std::path::PathBuf) {
        self.grant_cgroups_file = Some(file);
        self.write_grant_cgroups();
    }

    /// List the cgroups tesserad starts MPS daemons in beside `socket` from now on (with its
    /// process id: the wrapper refuses a container there or above).
    pub fn list_daemon_cgroups_beside(&mut self, socket: std::path::PathBuf) {
        if let Err(e) = tessera_api::cgroup::write_daemon_files(&socket) {
            tracing::warn!("cannot write tesserad's process id and cgroups beside its socket: {e}");
        }
        self.daemon_socket = Some(socket);
    }

    /// No container sees tesserad's `socket` or `state_dir` from now on: listed beside
    /// the socket for the wrapper's create check ([`tessera_api::private_paths`]), and
    /// judged again on the mounts runc made at every start ([`Node::container_is_its_own`]).
    /// A failure to write the list is logged (the start check holds without it).
    pub fn keep_private(&mut self, socket: &Path, state_dir: &Path) {
        let state = std::fs::canonicalize(state_dir).unwrap_or_else(|_| state_dir.to_path_buf());
        if let Err(e) = tessera_api::write_private_paths(socket, std::slice::from_ref(&state)) {
            tracing::warn!("cannot list tesserad's own paths beside its socket: {e}");
        }
        self.private_paths = tessera_api::private_paths(socket);
        if !self.private_paths.contains(&state) {
            self.private_paths.push(state);
        }
    }

    /// After an MPS daemon was started: the cgroup it runs in is listed (it stays there
    /// after tesserad is moved or gone). A failure is logged.
    pub(super) fn record_daemon_cgroups(&self) {
        let Some(socket) = &self.daemon_socket else { return };
        if let Err(e) = tessera_api::cgroup::record_daemon_cgroups(socket) {
            tracing::warn!("cannot list tesserad's cgroups beside its socket: {e}");
        }
    }

    /// Writes the list of the running grants' cgroups, if this node keeps one. A failure is
    /// logged: the wrapper then misses the newest grant, and tesserad's prestart check and
    /// the reconciler still stand.
    pub(super) fn write_grant_cgroups(&self) {
        let Some(file) = &self.grant_cgroups_file else { return };
        let cgroups: Vec<String> = match self.store.all() {
            Ok(all) => all.into_iter().filter_map(|r| r.cgroup).collect(),
            Err(e) => {
                tracing::warn!("cannot list the grants' cgroups: {e}");
                return;
            }
        };
        if let Err(e) =
            tessera_api::cgroup::write_grant_cgroups(file, cgroups.iter().map(String::as_str))
        {
            tracing::warn!(file = %file.display(), "cannot list the grants' cgroups: {e}");
        }
    }

    /// What to watch for a running container's exit: its init pid and that process's start
    /// time. `None` when it is not running, or when the host's pids are not this kernel's
    /// processes ([`Host::watches_exits`]: a pidfd names a real process).
    pub fn exit_watch_target(&self, container_id: &str) -> Option<(i32, Option<u64>)> {
        if !self.host.watches_exits() {
            return None;
        }
        let rec = self.store.get(container_id).ok()??;
        match (rec.allocation.state, rec.allocation.pid) {
            (AllocationState::Running, Some(pid)) => Some((pid, rec.pid_start)),
            _ => None,
        }
    }

    /// The container's init process `pid` has exited: its intervals close now. Its devices
    /// stay held until runc has removed the container (release or reconciler); nothing runs
    /// on them any more. A grant that moved on (released, another pid) is left alone.
    pub fn container_exited(&mut self, container_id: &str, pid: i32) -> Result<usize, CoreError> {
        let Some(rec) = self.store.get(container_id).map_err(internal)? else { return Ok(0) };
        if rec.allocation.state != AllocationState::Running || rec.allocation.pid != Some(pid) {
            return Ok(0);
        }
        let closed =
            self.ledger.close_container(container_id, super::EXITED_REASON).map_err(ledger_err)?;
        Ok(closed.len())
    }
}
