//! `start` (the prestart hook confirms the container's pid and bundle) and the init's exit:
//! what the exit watcher ([`crate::exits`]) watches and what it closes.

use tessera_api::{untrusted, Allocation, AllocationState, ApiError, ErrorCode, StartRequest};
use tracing::info;

use super::{internal, ledger_err, validate_container_id, Node};

impl Node {
    /// The prestart hook confirms the container exists with this pid.
    pub fn start(
        &mut self,
        container_id: &str,
        req: &StartRequest,
    ) -> Result<Allocation, ApiError> {
        validate_container_id(container_id)?;
        let rec = self.store.get(container_id).map_err(internal)?.ok_or_else(|| {
            ApiError::new(
                ErrorCode::NotFound,
                format!("container {container_id} has no GPU allocation on this node; refusing to start it"),
            )
        })?;
        if rec.bundle != req.bundle {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!(
                    "container {container_id}: the hook reports bundle {} but the grant was made for bundle {}",
                    untrusted(&req.bundle),
                    untrusted(&rec.bundle)
                ),
            ));
        }
        if req.pid <= 0 {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                format!("container {container_id}: pid {} is not a process id", req.pid),
            ));
        }
        if rec.allocation.state == AllocationState::Running && rec.allocation.pid == Some(req.pid) {
            return Ok(rec.allocation);
        }
        let start = self.host.pid_start_time(req.pid);
        if start.is_none() {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                format!("container {container_id}: pid {} is not alive", req.pid),
            ));
        }
        // The grant lasts while a process is in this cgroup (runc keeps the container's
        // device rules there). One that cannot be told for sure is refused: the grant
        // could end while a process of the container still runs with the device.
        let cgroup = self.host.container_cgroup(req.pid).map_err(|e| {
            ApiError::new(
                ErrorCode::BadRequest,
                format!("container {container_id}: cannot tell the cgroup of pid {}: {e}; refusing to start it", req.pid),
            )
        })?;
        let rec = self.store.set_running(rec, req.pid, start, Some(cgroup)).map_err(internal)?;
        // Metering starts when the container does. Recorded after the pid, so a crash in
        // between is repaired by resume_metering on restart.
        self.open_intervals(&rec.allocation)?;
        info!(container = %container_id, pid = req.pid, "started");
        Ok(rec.allocation)
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
    pub fn container_exited(&mut self, container_id: &str, pid: i32) -> Result<usize, ApiError> {
        let Some(rec) = self.store.get(container_id).map_err(internal)? else { return Ok(0) };
        if rec.allocation.state != AllocationState::Running || rec.allocation.pid != Some(pid) {
            return Ok(0);
        }
        let closed = self
            .ledger
            .close_container(container_id, crate::exits::EXITED_REASON)
            .map_err(ledger_err)?;
        Ok(closed.len())
    }
}
