//! One node's allocation service: parse → decide (pure `policy` and `slicer` functions)
//! → record durably → answer. Every method runs under the daemon's single lock, so the
//! decide-and-record step is atomic.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use metering::{Class, IntervalStart, Ledger, LedgerError, UsageQuery, UsageReport};
use policy::Policy;
use slicer::{GpuBackend, Inventory};
use tessera_api::{
    untrusted, AllocateRequest, Allocation, AllocationState, ApiError, DeviceState, ErrorCode,
    EventStatus, GpuRequest, GpuStatus, GrantedDevice, Holder, Isolation, MigInstanceStatus,
    MpsShareStatus, NodeStatus, PolicyInfo, ReleaseRequest, ShareGrant, StartRequest,
};
use tracing::{info, warn};

use std::sync::Arc;

use crate::liveness::{self, CgroupProcs, Facts, Liveness};
use crate::share::DeviceUse;
use crate::store::{Record, Store, StoreError};

mod grant;
pub use grant::{FailAction, GrantFailpoint};

/// Host locations the daemon reads, injectable for tests.
#[derive(Debug, Clone)]
pub struct HostPaths {
    /// Normally `/proc`.
    pub proc_root: PathBuf,
    /// Where the cgroup hierarchies are mounted: normally `/sys/fs/cgroup` (v1: one
    /// directory per hierarchy, e.g. `devices/`; v2: the unified tree itself).
    pub cgroup_root: PathBuf,
}

impl Default for HostPaths {
    fn default() -> Self {
        HostPaths {
            proc_root: PathBuf::from("/proc"),
            cgroup_root: PathBuf::from("/sys/fs/cgroup"),
        }
    }
}

/// The policy in force and where it came from.
#[derive(Debug, Clone)]
pub struct ActivePolicy {
    pub policy: Policy,
    pub source: String,
}

impl ActivePolicy {
    pub fn info(&self) -> PolicyInfo {
        PolicyInfo {
            version: self.policy.version(),
            source: self.source.clone(),
            digest: self.policy.digest(),
            coordinator: None,
        }
    }
}

/// The allocation service of one node.
#[derive(Debug)]
pub struct Node {
    backend: Box<dyn GpuBackend>,
    inventory: Inventory,
    policy: ActivePolicy,
    store: Store,
    ledger: Ledger,
    mps: Arc<mpsd::Supervisor>,
    host: HostPaths,
    pending_grace: Duration,
    /// Create and destroy MIG instances on demand (when the node's pool declares no layout).
    dynamic_mig: bool,
    /// MIG profiles granted since start: the demand mix placement preserves capacity for.
    mig_demand: BTreeMap<String, u64>,
    scrub: ScrubSetup,
    /// Devices whose scrub is running now (by the worker or an unquarantine).
    scrubs_in_flight: std::collections::BTreeSet<String>,
    /// GPU -> the newest utilisation sample timestamp seen (µs), for NVML's "since".
    util_seen: BTreeMap<String, u64>,
    /// Tests only: a fault between a grant's plan and its commit.
    failpoint: Option<GrantFailpoint>,
}

/// How scrubs are run: a child process, so no CUDA state ever lives in the daemon.
#[derive(Debug, Clone)]
pub struct ScrubSetup {
    /// The binary with the `scrub` subcommand (`tessera`).
    pub exe: std::path::PathBuf,
    /// Simulated hardware: the fault-injection file the sim scrubber reads.
    pub sim_faults: Option<std::path::PathBuf>,
}

/// A scrub to run outside the node lock: [`Node::next_scrub`] or [`Node::unquarantine`]
/// hands it out, [`Node::finish_scrub`] takes the result.
#[derive(Debug)]
pub struct ScrubJob {
    pub device: String,
    pub child: scrub::ScrubChild,
}

impl ScrubJob {
    /// Run the scrub child to its report (blocking; call without holding the node lock).
    pub fn run(&self) -> Result<scrub::ScrubReport, scrub::ScrubError> {
        self.child.run()
    }
}

/// What a MIG plan or convergence reports.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MigReport {
    /// The plan, as computed before acting.
    pub plan: slicer::LayoutPlan,
    /// The plan as a person reads it.
    pub text: String,
    pub destroyed: Vec<String>,
    pub created: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Everything a [`Node`] is made of.
#[derive(Debug)]
pub struct NodeParts {
    pub backend: Box<dyn GpuBackend>,
    pub policy: ActivePolicy,
    pub store: Store,
    pub ledger: Ledger,
    pub mps: Arc<mpsd::Supervisor>,
    pub host: HostPaths,
    pub pending_grace: Duration,
    pub dynamic_mig: bool,
    pub scrub: ScrubSetup,
}

/// What one reconciler pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ReconcileReport {
    pub checked: usize,
    pub released: Vec<(String, String)>,
}

impl Node {
    pub fn new(p: NodeParts) -> Result<Node, String> {
        let inventory = p
            .backend
            .inventory()
            .map_err(|e| format!("reading the GPU inventory from {}: {e}", p.backend.describe()))?;
        Ok(Node {
            backend: p.backend,
            inventory,
            policy: p.policy,
            store: p.store,
            ledger: p.ledger,
            mps: p.mps,
            host: p.host,
            pending_grace: p.pending_grace,
            dynamic_mig: p.dynamic_mig,
            mig_demand: BTreeMap::new(),
            scrub: p.scrub,
            scrubs_in_flight: std::collections::BTreeSet::new(),
            util_seen: BTreeMap::new(),
            failpoint: GrantFailpoint::from_env(),
        })
    }

    /// Tests: arm (or disarm) a fault between a grant's plan and its commit.
    pub fn set_failpoint(&mut self, failpoint: Option<GrantFailpoint>) {
        self.failpoint = failpoint;
    }

    fn scrub_policy(&self) -> scrub::ScrubPolicy {
        let s = self.policy.policy.scrub();
        scrub::ScrubPolicy {
            min_coverage: s.min_coverage,
            timeout: Duration::from_secs(s.timeout_s),
            same_tenant_skip: s.same_tenant_skip,
            max_attempts: s.max_attempts,
        }
    }

    /// Every device that is not plainly free: dirty, scrubbing, quarantined. A stored state
    /// that cannot be read is treated as dirty with unknown history (scrubbed before reuse).
    fn lifecycle(&self) -> Result<Lifecycles, ApiError> {
        let mut out = BTreeMap::new();
        for (uuid, (state, last)) in self.store.device_states().map_err(internal)? {
            let st = serde_json::from_str::<scrub::DeviceState>(&state).unwrap_or_else(|e| {
                warn!(device = %uuid, "unreadable device state {state:?}: {e}; treating it as dirty");
                scrub::DeviceState::unknown_history()
            });
            if st != scrub::DeviceState::Free {
                let report = last.and_then(|l| serde_json::from_str(&l).ok());
                out.insert(uuid, (st, report));
            }
        }
        Ok(out)
    }

    /// Devices `tenant` may not be given now because of their lifecycle.
    fn not_assignable(
        &self,
        life: &Lifecycles,
        tenant: &str,
    ) -> std::collections::BTreeSet<String> {
        let policy = self.scrub_policy();
        life.iter()
            .filter(|(_, (st, _))| st.can_assign(tenant, &policy).is_err())
            .map(|(u, _)| u.clone())
            .collect()
    }

    fn set_state(
        &mut self,
        uuid: &str,
        st: &scrub::DeviceState,
        report: Option<&scrub::ScrubReport>,
    ) -> Result<(), ApiError> {
        let json = serde_json::to_string(st)
            .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
        let rep = report.map(|r| r.to_json_line());
        self.store.set_device_state(uuid, &json, rep.as_deref()).map_err(internal)
    }

    /// The next device to scrub, marked scrubbing (durably) before it is handed out, so a
    /// daemon killed mid-scrub resumes it after restart.
    pub fn next_scrub(&mut self) -> Result<Option<ScrubJob>, ApiError> {
        let policy = self.scrub_policy();
        let pick = self
            .lifecycle()?
            .into_iter()
            .find(|(u, (st, _))| st.needs_scrub() && !self.scrubs_in_flight.contains(u));
        let Some((uuid, (st, _))) = pick else { return Ok(None) };
        match st.on_scrub_start(&policy) {
            Ok(next @ scrub::DeviceState::Scrubbing { .. }) => {
                self.set_state(&uuid, &next, None)?;
                Ok(Some(self.scrub_job(&uuid)))
            }
            Ok(other) => {
                // Too many attempts: quarantined without another try.
                warn!(device = %uuid, state = other.name(), "scrub not started");
                let _ = self.store.event("scrub", None, &format!("{uuid}: {}", other.name()));
                self.set_state(&uuid, &other, None)?;
                Ok(None)
            }
            Err(e) => Err(ApiError::new(ErrorCode::Internal, format!("device {uuid}: {e}"))),
        }
    }

    fn scrub_job(&mut self, uuid: &str) -> ScrubJob {
        self.scrubs_in_flight.insert(uuid.to_string());
        let mut child = scrub::ScrubChild::new(&self.scrub.exe, uuid, self.scrub_policy().timeout);
        if let Some(mem) = self.backend.sim_memory_file(uuid) {
            child = child.sim(&mem, self.scrub.sim_faults.as_deref());
        }
        ScrubJob { device: uuid.to_string(), child }
    }

    /// Record a scrub's outcome: clean and verified → free; anything else → quarantined.
    pub fn finish_scrub(
        &mut self,
        device: &str,
        result: Result<scrub::ScrubReport, scrub::ScrubError>,
    ) -> Result<scrub::DeviceState, ApiError> {
        self.scrubs_in_flight.remove(device);
        let policy = self.scrub_policy();
        let current =
            self.lifecycle()?.remove(device).map(|(st, _)| st).unwrap_or(scrub::DeviceState::Free);
        let (next, report) = match result {
            Ok(report) => (current.on_scrub_result(&report, &policy), Some(report)),
            Err(e) => (current.on_scrub_failed(&e.to_string()), None),
        };
        let next =
            next.map_err(|e| ApiError::new(ErrorCode::Internal, format!("device {device}: {e}")))?;
        self.set_state(device, &next, report.as_ref())?;
        let detail = match &report {
            Some(r) => format!(
                "{device}: {} after scrub ({} of {} bytes, {} non-zero words, {:.3} s, {:.1} GB/s)",
                next.name(),
                r.bytes_covered,
                r.bytes_total,
                r.nonzero_words,
                r.seconds,
                r.gbps
            ),
            None => format!("{device}: {}", serde_json::to_string(&next).unwrap_or_default()),
        };
        if next == scrub::DeviceState::Free {
            info!("{detail}");
        } else {
            warn!("{detail}");
        }
        let _ = self.store.event("scrub", None, &detail);
        Ok(next)
    }

    /// An operator asks for a quarantined device back: it is scrubbed again, and returns to
    /// service only if that scrub succeeds.
    pub fn unquarantine(&mut self, device: &str) -> Result<ScrubJob, ApiError> {
        let current = self.lifecycle()?.remove(device).map(|(st, _)| st);
        let Some(st @ scrub::DeviceState::Quarantined { .. }) = current else {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!(
                    "device {device} is not quarantined ({})",
                    current.as_ref().map(|s| s.name()).unwrap_or("free")
                ),
            ));
        };
        let next = st
            .unquarantine_requested()
            .map_err(|e| ApiError::new(ErrorCode::Conflict, format!("device {device}: {e}")))?;
        self.set_state(device, &next, None)?;
        let _ = self.store.event(
            "scrub",
            None,
            &format!("{device}: unquarantine requested, re-scrubbing"),
        );
        Ok(self.scrub_job(device))
    }

    /// ` — unavailable to this tenant: GPU-x quarantined: …; MIG-y dirty after …`, or "".
    fn unavailable_summary(
        life: &Lifecycles,
        blocked: &std::collections::BTreeSet<String>,
    ) -> String {
        let parts: Vec<String> = blocked
            .iter()
            .filter_map(|u| life.get(u).map(|(st, _)| format!("{u} {}", lifecycle_detail(st))))
            .collect();
        if parts.is_empty() {
            String::new()
        } else {
            format!(" — unavailable to this tenant: {}", parts.join("; "))
        }
    }

    /// Sim only: each granted device's memory file, mounted where a test workload finds it.
    fn sim_memory_mounts(&self, devices: &[GrantedDevice]) -> Vec<tessera_api::BindMount> {
        devices
            .iter()
            .enumerate()
            .filter_map(|(i, d)| {
                let file = self.backend.sim_memory_file(&d.uuid)?;
                let destination = if devices.len() == 1 {
                    SIM_MEM_PATH.to_string()
                } else {
                    format!("{SIM_MEM_PATH}{i}")
                };
                Some(tessera_api::BindMount {
                    source: file.display().to_string(),
                    destination,
                    read_only: false,
                })
            })
            .collect()
    }

    /// Re-read the inventory after the backend changed it (MIG instances created or
    /// destroyed).
    fn refresh_inventory(&mut self) -> Result<(), ApiError> {
        self.inventory = self.backend.inventory().map_err(|e| {
            ApiError::new(ErrorCode::Internal, format!("re-reading the GPU inventory: {e}"))
        })?;
        Ok(())
    }

    /// Devices that MIG planning must never destroy or move: everything in use.
    fn untouchable(&self) -> Result<std::collections::BTreeSet<String>, ApiError> {
        let mut busy = DeviceUse::of(&self.allocations()?).busy();
        busy.extend(self.lifecycle()?.into_keys()); // dirty memory is never destroyed or re-cut
        Ok(busy)
    }

    /// The difference between the node's MIG layout and the one its pool declares.
    pub fn mig_plan(&self) -> Result<MigReport, ApiError> {
        let layouts = self.policy.policy.mig_layouts(&self.inventory.node);
        let (plan, text) = if layouts.is_empty() {
            // Nothing declared: nothing to plan (and no need to read what is in use).
            let text = format!("no node pool declares a MIG layout for {}: the layout is dynamic (instances are created on demand)\n", self.inventory.node);
            (slicer::LayoutPlan::default(), text)
        } else {
            let plan = slicer::plan(&self.inventory, &self.untouchable()?, &layouts);
            let text = plan.to_string();
            (plan, text)
        };
        Ok(MigReport { plan, text, destroyed: Vec::new(), created: Vec::new(), error: None })
    }

    /// Converge on the declared layout: destroy and create only the difference, never
    /// touching an instance in use (those are reported as blocked).
    pub fn mig_converge(&mut self) -> Result<MigReport, ApiError> {
        let mut report = self.mig_plan()?;
        if report.plan.is_empty() {
            return Ok(report);
        }
        let (applied, result) = slicer::apply_plan(self.backend.as_ref(), &report.plan);
        report.destroyed = applied.destroyed;
        report.created = applied.created.iter().map(|i| i.uuid.clone()).collect();
        report.error = result.err().map(|e| e.to_string());
        let detail = format!(
            "converge: destroyed [{}], created [{}]{}",
            report.destroyed.join(","),
            report.created.join(","),
            report.error.as_deref().map(|e| format!(", stopped: {e}")).unwrap_or_default()
        );
        info!("{detail}");
        let _ = self.store.event("mig", None, &detail);
        self.refresh_inventory()?;
        Ok(report)
    }

    /// After a start: take over the MPS control daemons that outlived the last tesserad,
    /// then make the supervisor's holders agree with the recorded grants — a holder with no
    /// grant is released, a grant whose daemon is gone gets its daemon back (caps set
    /// before any client connects again). Returns (adopted, released, restarted).
    pub fn resume_mps(&mut self) -> Result<(usize, usize, usize), ApiError> {
        let report = self.mps.adopt_existing().map_err(mps_err)?;
        for e in &report.events {
            self.record_mps_event(e);
        }
        let allocs = self.allocations()?;
        let granted: std::collections::BTreeSet<(String, String)> = allocs
            .iter()
            .filter_map(|a| {
                a.share
                    .as_ref()
                    .filter(|s| s.kind == Isolation::Mps)
                    .map(|s| (s.device.clone(), a.container_id.clone()))
            })
            .collect();
        let mut released = 0;
        for sh in self.mps.shares() {
            for holder in &sh.holders {
                if !granted.contains(&(sh.device.clone(), holder.clone())) {
                    self.mps.release(&sh.device, &sh.tenant, holder).map_err(mps_err)?;
                    released += 1;
                }
            }
        }
        let mut restarted = 0;
        let live: std::collections::BTreeSet<(String, String)> = self
            .mps
            .shares()
            .into_iter()
            .flat_map(|sh| sh.holders.into_iter().map(move |h| (sh.device.clone(), h)))
            .collect();
        for a in
            allocs.iter().filter(|a| a.share.as_ref().is_some_and(|s| s.kind == Isolation::Mps))
        {
            let Some(s) = &a.share else { continue };
            if !live.contains(&(s.device.clone(), a.container_id.clone())) {
                self.mps.ensure_share(&self.share_request(a, s)).map_err(mps_err)?;
                restarted += 1;
            }
        }
        Ok((report.adopted.len(), released, restarted))
    }

    /// Ping every MPS control daemon; restart the dead with backoff, record every crash.
    /// The MPS supervisor, for health checks run outside the node lock (it has its own
    /// lock; the node takes it only while holding the node lock, never the other way round).
    pub fn mps_supervisor(&self) -> Arc<mpsd::Supervisor> {
        Arc::clone(&self.mps)
    }

    /// Records what a health check found; returns how many events.
    pub fn record_mps_events(&mut self, events: &[mpsd::HealthEvent]) -> usize {
        for e in events {
            self.record_mps_event(e);
        }
        events.len()
    }

    fn record_mps_event(&mut self, e: &mpsd::HealthEvent) {
        let detail = serde_json::to_string(e).unwrap_or_else(|_| format!("{e:?}"));
        warn!(event = %detail, "mps supervision");
        if let Err(err) = self.store.event("mps", None, &detail) {
            warn!("cannot record an MPS event: {err}");
        }
    }

    fn share_request(&self, a: &Allocation, s: &ShareGrant) -> mpsd::ShareRequest {
        mpsd::ShareRequest {
            device: s.device.clone(),
            tenant: a.tenant.clone(),
            holder: a.container_id.clone(),
            percent: s.percent.unwrap_or(100),
            mem_limit_bytes: s.mem_limit_bytes.unwrap_or(0),
        }
    }

    /// Stop the MPS control daemons with no container (on a clean stop). Daemons that
    /// serve live containers keep running — stopping them would kill tenant work — and
    /// are adopted by the next tesserad.
    pub fn quit_idle_mps(&mut self) {
        for sh in self.mps.shares() {
            if sh.holders.is_empty() {
                let _ = self.mps.release(&sh.device, &sh.tenant, "");
            }
        }
    }

    /// After a start: opening the ledger closed every interval left open at its last
    /// checkpoint; open fresh ones for the containers that are still running. Call after
    /// [`Node::reconcile`], so only live containers are metered (a grant whose init exited
    /// stays unmetered while it is held). Returns how many.
    pub fn resume_metering(&mut self) -> Result<usize, ApiError> {
        let mut n = 0;
        for rec in self.store.all().map_err(internal)? {
            // A grant outlives its init while runc keeps the container or a process is
            // left in its cgroup; metering stopped at the init's exit and stays stopped.
            let init_alive =
                rec.allocation.pid.and_then(|p| liveness::pid_start_time(&self.host.proc_root, p));
            let init_alive =
                init_alive.is_some_and(|now| rec.pid_start.is_none() || rec.pid_start == Some(now));
            if rec.allocation.state == AllocationState::Running && init_alive {
                n += self.open_intervals(&rec.allocation)?;
            }
        }
        Ok(n)
    }

    /// One utilisation tick: for every running container on a whole GPU (exclusive, MPS or
    /// time-sliced) whose backend reports per-process utilisation, the SM percent its
    /// processes used (0 if none showed) goes into its open ledger interval. Devices where
    /// it is not available (MIG instances, a backend without it) get no sample at all, so
    /// reports tell "not measured" from "idle". Returns how many intervals took a sample.
    pub fn sample_utilization(&mut self) -> Result<usize, ApiError> {
        let running: Vec<Allocation> = self
            .allocations()?
            .into_iter()
            .filter(|a| a.state == AllocationState::Running)
            .collect();
        let mut by_gpu: BTreeMap<String, Vec<(&Allocation, &GrantedDevice)>> = BTreeMap::new();
        for a in &running {
            for d in a.devices.iter().filter(|d| d.uuid == d.gpu_uuid) {
                by_gpu.entry(d.gpu_uuid.clone()).or_default().push((a, d));
            }
        }
        let mut batch = Vec::new();
        for (gpu, users) in by_gpu {
            let since = self.util_seen.get(&gpu).copied().unwrap_or(0);
            let samples = match self.backend.process_utilization(&gpu, since) {
                Ok(Some(s)) => s,
                Ok(None) => continue,
                Err(e) => {
                    warn!(gpu = %gpu, "reading per-process utilisation failed: {e}");
                    continue;
                }
            };
            if let Some(newest) = samples.iter().map(|s| s.timestamp_us).max() {
                self.util_seen.insert(gpu.clone(), newest);
            }
            // Several samples of one pid in the period: their mean.
            let mut per_pid: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
            for s in &samples {
                let e = per_pid.entry(s.pid).or_default();
                e.0 += u64::from(s.sm_percent);
                e.1 += 1;
            }
            for (a, d) in users {
                let Some(pid) = a.pid else { continue };
                let tree = liveness::process_tree(&self.host.proc_root, pid);
                let sm: f64 = per_pid
                    .iter()
                    .filter(|(p, _)| tree.contains(p))
                    .map(|(_, (sum, n))| *sum as f64 / *n as f64)
                    .sum();
                batch.push((a.container_id.clone(), d.uuid.clone(), sm.min(100.0)));
            }
        }
        if batch.is_empty() {
            return Ok(0);
        }
        self.ledger.record_utilization(&batch).map_err(ledger_err)
    }

    /// Quarantine every GPU (and its MIG instances) whose uncorrectable ECC count rose since
    /// the last look. The counts seen are kept in the store, so a rise while no tesserad
    /// watched (stopped, crashed, upgraded) is caught at the first look after start. The
    /// very first reading of a GPU is its baseline. A count below the baseline means the
    /// driver reset its volatile counter (driver reload, reboot): it becomes the new
    /// baseline, and is logged. A quarantined device in use stays with its container, and
    /// is not handed out again after it is released. Returns the GPUs quarantined now.
    pub fn check_ecc(&mut self) -> Result<Vec<String>, ApiError> {
        let mut hit = Vec::new();
        let baselines = self.store.ecc_baselines().map_err(internal)?;
        for g in self.inventory.gpus.clone() {
            let count = match self.backend.uncorrectable_ecc_errors(&g.uuid) {
                Ok(Some(n)) => n,
                Ok(None) => continue,
                Err(e) => {
                    warn!(gpu = %g.uuid, "reading ECC errors failed: {e}");
                    continue;
                }
            };
            match baselines.get(&g.uuid).copied() {
                // The first reading of this GPU: its baseline.
                None => {}
                Some(seen) if count == seen => continue,
                Some(seen) if count < seen => {
                    let detail = format!("{}: uncorrectable ECC counter went from {seen} to {count} (driver reset it): new baseline", g.uuid);
                    info!("{detail}");
                    let _ = self.store.event("ecc", None, &detail);
                }
                Some(seen) => {
                    let life = self.lifecycle()?;
                    let devices = std::iter::once(g.uuid.clone())
                        .chain(g.instances.iter().map(|i| i.uuid.clone()));
                    for uuid in devices {
                        let current = life
                            .get(&uuid)
                            .map(|(st, _)| st.clone())
                            .unwrap_or(scrub::DeviceState::Free);
                        self.set_state(&uuid, &current.on_ecc_error(count), None)?;
                    }
                    let detail = format!(
                        "{}: quarantined: uncorrectable ECC errors rose from {seen} to {count}",
                        g.uuid
                    );
                    warn!("{detail}");
                    let _ = self.store.event("ecc", None, &detail);
                    hit.push(g.uuid.clone());
                }
            }
            // Written after the quarantine is durable: a crash in between finds the rise
            // again at the next start.
            self.store.set_ecc_baseline(&g.uuid, count).map_err(internal)?;
        }
        Ok(hit)
    }

    /// Heartbeat: stamp every open interval, bounding what a crash can lose.
    pub fn checkpoint(&mut self) -> Result<usize, ApiError> {
        self.ledger.checkpoint().map_err(ledger_err)
    }

    /// A usage report over the ledger, priced with the policy in force.
    pub fn usage(
        &self,
        from_ms: u64,
        to_ms: u64,
        by: metering::GroupBy,
    ) -> Result<UsageReport, ApiError> {
        let prices = metering::Prices {
            per_model: self
                .policy
                .policy
                .prices()
                .iter()
                .map(|(m, p)| {
                    (
                        m.clone(),
                        metering::Rate {
                            reserved_per_gpu_hour: p.reserved_per_gpu_hour,
                            burst_per_gpu_hour: p.burst_per_gpu_hour,
                        },
                    )
                })
                .collect(),
        };
        self.ledger.usage(&UsageQuery { from_ms, to_ms, by, prices }).map_err(|e| match e {
            LedgerError::BadQuery(_) => ApiError::new(ErrorCode::BadRequest, e.to_string()),
            other => ledger_err(other),
        })
    }

    /// Every ledger interval (for metrics).
    pub fn intervals(&self) -> Result<Vec<metering::IntervalRecord>, ApiError> {
        self.ledger.intervals().map_err(ledger_err)
    }

    /// The fraction of a GPU one granted device is charged as.
    fn fraction(&self, a: &Allocation, d: &GrantedDevice) -> f64 {
        let slices = d.mig_profile.as_deref().and_then(|p| {
            slicer::model(&d.model).and_then(|m| m.profile(p)).map(|p| p.compute_slices)
        });
        let weight = d.mig_profile.as_deref().and_then(|p| self.policy.policy.mig_weight(p));
        let mps = match a.request.parse::<GpuRequest>() {
            Ok(GpuRequest::Mps { percent }) => Some(percent),
            _ => None,
        };
        let replicas = a.share.as_ref().and_then(|s| s.replicas);
        metering::fraction(a.isolation, slices, mps, replicas, weight)
    }

    fn open_intervals(&mut self, a: &Allocation) -> Result<usize, ApiError> {
        for d in &a.devices {
            let start = IntervalStart {
                container_id: a.container_id.clone(),
                tenant: a.tenant.clone(),
                node: self.inventory.node.clone(),
                gpu_uuid: d.gpu_uuid.clone(),
                gpu_model: d.model.clone(),
                device_uuid: d.uuid.clone(),
                isolation: a.isolation,
                mig_profile: if a.isolation == Isolation::Mig {
                    d.mig_profile.clone()
                } else {
                    None
                },
                fraction: self.fraction(a, d),
                class: Class::Guaranteed,
            };
            self.ledger.open_interval(&start).map_err(ledger_err)?;
        }
        Ok(a.devices.len())
    }

    /// Close the container's intervals, then free its devices: in this order a crash in
    /// between leaves a grant whose release is simply retried, never an open interval
    /// for a container that no longer holds anything.
    fn drop_allocation(&mut self, container_id: &str, why: &str) -> Result<bool, ApiError> {
        self.ledger.close_container(container_id, why).map_err(ledger_err)?;
        let Some(rec) = self.store.get(container_id).map_err(internal)? else { return Ok(false) };
        let a = &rec.allocation;
        if let Some(s) = a.share.as_ref().filter(|s| s.kind == Isolation::Mps) {
            // The last container of a share stops its control daemon (`quit`).
            if let Err(e) = self.mps.release(&s.device, &a.tenant, container_id) {
                warn!(container = %container_id, "releasing the MPS share failed: {e}");
            }
        }
        // What the container leaves behind is dirty until scrubbed: its own devices, or a
        // shared device once its last container leaves (history unknown: several tenants
        // may have used it, so no tenant skips that scrub).
        let mut left = Vec::new();
        let quarantined: std::collections::BTreeSet<String> = self
            .lifecycle()?
            .into_iter()
            .filter(|(_, (st, _))| matches!(st, scrub::DeviceState::Quarantined { .. }))
            .map(|(u, _)| u)
            .collect();
        match &a.share {
            None => {
                for d in a.devices.iter().filter(|d| !quarantined.contains(&d.uuid)) {
                    let st = scrub::DeviceState::Dirty { last_tenant: a.tenant.clone() };
                    left.push((d.uuid.clone(), serde_json::to_string(&st).unwrap_or_default()));
                }
            }
            Some(s) => {
                let others = self.allocations()?.iter().any(|o| {
                    o.container_id != a.container_id
                        && o.share.as_ref().is_some_and(|x| x.device == s.device)
                });
                if !others && !quarantined.contains(&s.device) {
                    let st = scrub::DeviceState::unknown_history();
                    left.push((s.device.clone(), serde_json::to_string(&st).unwrap_or_default()));
                }
            }
        }
        self.store.remove_leaving(container_id, why, &left).map_err(internal)
    }

    pub fn inventory(&self) -> &Inventory {
        &self.inventory
    }

    pub fn policy(&self) -> &ActivePolicy {
        &self.policy
    }

    /// Replace the policy used for every decision from now on (a fleet coordinator pushed
    /// a new one). Existing allocations keep their grants.
    pub fn set_policy(&mut self, policy: ActivePolicy) {
        self.policy = policy;
    }

    /// The metering ledger (read-only: fleet usage uploads read closed intervals).
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Grant (or return the existing grant of) a container's GPU share.
    pub fn allocate(&mut self, req: &AllocateRequest) -> Result<Allocation, ApiError> {
        validate_container_id(&req.container_id)?;
        validate_abs_path("runc_root", &req.runc_root)?;
        validate_abs_path("bundle", &req.bundle)?;
        let request: GpuRequest = req.request.parse().map_err(|e: tessera_api::RequestError| {
            ApiError::new(ErrorCode::BadRequest, e.to_string())
        })?;

        if let Some(existing) = self.store.get(&req.container_id).map_err(internal)? {
            // Idempotent by container id: a retried create gets the same grant.
            let a = existing.allocation;
            if a.request == request.to_string() && existing.bundle == req.bundle {
                return Ok(a);
            }
            return Err(ApiError {
                code: ErrorCode::Conflict,
                message: format!(
                    "container {} already holds a grant for {} from bundle {}; refusing {} from {}",
                    req.container_id,
                    a.request,
                    untrusted(&existing.bundle),
                    request,
                    untrusted(&req.bundle)
                ),
                tenant: Some(a.tenant),
                request: Some(request.to_string()),
                rule: None,
            });
        }

        let tenant = self.policy.policy.resolve_identity(&req.annotations).map_err(|e| {
            let err = ApiError {
                code: ErrorCode::UnknownTenant,
                message: e.to_string(),
                tenant: None,
                request: Some(request.to_string()),
                rule: Some("identity".into()),
            };
            self.log_refusal(&req.container_id, &err);
            err
        })?;

        if let Err(refusal) = self.policy.policy.authorize(&tenant, &request, &self.inventory.node)
        {
            let err = ApiError {
                code: ErrorCode::Refused,
                message: refusal.to_string(),
                tenant: Some(refusal.tenant.clone()),
                request: Some(refusal.request.clone()),
                rule: Some(refusal.rule.clone()),
            };
            self.log_refusal(&req.container_id, &err);
            return Err(err);
        }

        let who = grant::Asker {
            req,
            request: &request,
            tenant: &tenant.path,
            trust: tenant.trust.to_string(),
        };
        let plan = self.plan_grant(&who).inspect_err(|err| {
            if err.code == ErrorCode::NoCapacity {
                self.log_refusal(&req.container_id, err);
            }
        })?;
        self.apply_grant(plan)
    }

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
        let start = liveness::pid_start_time(&self.host.proc_root, req.pid);
        if start.is_none() {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                format!("container {container_id}: pid {} is not alive", req.pid),
            ));
        }
        // The grant lasts while a process is in this cgroup (runc keeps the container's
        // device rules there). One that cannot be told for sure is refused: the grant
        // could end while a process of the container still runs with the device.
        let cgroup = liveness::container_cgroup(&self.host.proc_root, &self.host.cgroup_root, req.pid).map_err(|e| {
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
    /// time. `None` when it is not running, or when the host's /proc is not the real one
    /// (a pidfd names a real process).
    pub fn exit_watch_target(&self, container_id: &str) -> Option<(i32, Option<u64>)> {
        if self.host.proc_root != std::path::Path::new("/proc") {
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

    /// Free a container's devices, unchecked: for callers in this process that know the
    /// container is gone (tests, tools). The API's release is [`Node::release_removed`].
    /// Unknown ids are fine (the hook and the reconciler race).
    pub fn release(&mut self, container_id: &str, why: &str) -> Result<bool, ApiError> {
        validate_container_id(container_id)?;
        let existed = self.drop_allocation(container_id, why)?;
        if existed {
            info!(container = %container_id, why, "released");
        }
        Ok(existed)
    }

    /// The API's release (`DELETE /v1/allocations/{id}`): a caller says container
    /// `container_id` was removed. Only the container the grant was made for can give it
    /// back: a runc root or bundle in `req` other than the recorded ones is refused (a
    /// container of the same id in another root or bundle), and whatever the caller says,
    /// nothing is released while runc still has the container in the recorded root. A
    /// refusal changes nothing, is recorded as a `release-refused` event and answered 409.
    /// Unknown ids are fine (releases race with the reconciler).
    pub fn release_removed(
        &mut self,
        container_id: &str,
        req: &ReleaseRequest,
    ) -> Result<bool, ApiError> {
        validate_container_id(container_id)?;
        let Some(rec) = self.store.get(container_id).map_err(internal)? else { return Ok(false) };
        let mismatch = |what: &str, asked: &str, recorded: &str| {
            format!(
                "container {container_id}: release asked by the container in {what} {} but the grant belongs to the \
                 container in {what} {}; nothing released",
                untrusted(asked),
                untrusted(recorded)
            )
        };
        let refusal = match (&req.runc_root, &req.bundle) {
            (Some(root), _) if *root != rec.runc_root => Some(mismatch("runc root", root, &rec.runc_root)),
            (_, Some(bundle)) if *bundle != rec.bundle => Some(mismatch("bundle", bundle, &rec.bundle)),
            _ if liveness::runc_state_exists(Path::new(&rec.runc_root), container_id) => Some(format!(
                "container {container_id}: runc still has it in {}; nothing released (a grant is given back once runc \
                 has removed its container)",
                untrusted(&rec.runc_root)
            )),
            _ => None,
        };
        if let Some(message) = refusal {
            warn!(container = %container_id, "{message}");
            if let Err(e) = self.store.event("release-refused", Some(container_id), &message) {
                warn!("cannot record a refused release: {e}");
            }
            return Err(ApiError::new(ErrorCode::Conflict, message));
        }
        self.release(container_id, "container removed")
    }

    pub fn allocation(&self, container_id: &str) -> Result<Allocation, ApiError> {
        self.store.get(container_id).map_err(internal)?.map(|r| r.allocation).ok_or_else(|| {
            ApiError::new(
                ErrorCode::NotFound,
                format!("no allocation for container {}", untrusted(container_id)),
            )
        })
    }

    pub fn allocations(&self) -> Result<Vec<Allocation>, ApiError> {
        Ok(self.store.all().map_err(internal)?.into_iter().map(|r| r.allocation).collect())
    }

    /// Release every allocation whose container is gone ([`liveness::judge`]).
    pub fn reconcile(&mut self) -> Result<ReconcileReport, ApiError> {
        let now = crate::now_ms();
        let mut report = ReconcileReport::default();
        for mut rec in self.store.all().map_err(internal)? {
            report.checked += 1;
            let pid_start_now =
                rec.allocation.pid.and_then(|p| liveness::pid_start_time(&self.host.proc_root, p));
            if rec.cgroup.is_none() && rec.allocation.state == AllocationState::Running {
                self.fill_in_cgroup(&mut rec, pid_start_now);
            }
            let a = &rec.allocation;
            let facts = Facts {
                // Read runc's record before the cgroup: a container removed in between is
                // then seen with its cgroup already emptied by runc.
                runc_state_exists: liveness::runc_state_exists(
                    Path::new(&rec.runc_root),
                    &a.container_id,
                ),
                pid_start_now,
                cgroup: match &rec.cgroup {
                    Some(rel) => liveness::cgroup_procs(&self.host.cgroup_root, rel),
                    None => CgroupProcs::NotRecorded,
                },
                age_ms: now.saturating_sub(a.created_ms),
            };
            if let Liveness::Gone(why) = liveness::judge(
                a.state,
                rec.pid_start,
                &facts,
                self.pending_grace.as_millis() as u64,
            ) {
                warn!(container = %a.container_id, tenant = %a.tenant, %why, "reconciler releases");
                self.drop_allocation(&a.container_id, &format!("reconciler: {why}"))?;
                report.released.push((a.container_id.clone(), why));
            }
        }
        Ok(report)
    }

    /// A running grant recorded without its cgroup (store schema 1) whose init still runs:
    /// its cgroup is read from that process now and kept, so the grant is judged by it.
    fn fill_in_cgroup(&mut self, rec: &mut Record, pid_start_now: Option<u64>) {
        let (Some(pid), Some(now)) = (rec.allocation.pid, pid_start_now) else { return };
        if rec.pid_start.is_some_and(|then| then != now) {
            return; // the pid names another process now
        }
        match liveness::container_cgroup(&self.host.proc_root, &self.host.cgroup_root, pid) {
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

    /// Everything a person needs to see: devices, their layout, who holds what.
    pub fn status(&self) -> Result<NodeStatus, ApiError> {
        let allocations = self.allocations()?;
        let mut holders: BTreeMap<&str, Holder> = BTreeMap::new();
        let shared: std::collections::BTreeSet<&str> = allocations
            .iter()
            .filter_map(|a| a.share.as_ref().map(|s| s.device.as_str()))
            .collect();
        for a in allocations.iter().filter(|a| a.share.is_none()) {
            for d in &a.devices {
                holders.insert(
                    &d.uuid,
                    Holder { container_id: a.container_id.clone(), tenant: a.tenant.clone() },
                );
            }
        }
        let lifecycle = self.lifecycle()?;
        let life = |uuid: &str| -> Option<tessera_api::Lifecycle> {
            let (st, report) = lifecycle.get(uuid)?;
            Some(tessera_api::Lifecycle {
                detail: lifecycle_detail(st),
                last_scrub: report.as_ref().map(summary),
            })
        };
        let state_of = |uuid: &str, holder: &Option<Holder>| {
            if let Some((st, _)) = lifecycle.get(uuid) {
                match st {
                    scrub::DeviceState::Scrubbing { .. } => return DeviceState::Scrubbing,
                    scrub::DeviceState::Quarantined { .. } => return DeviceState::Quarantined,
                    _ if holder.is_none() => return DeviceState::Dirty,
                    _ => {}
                }
            }
            if holder.is_some() {
                DeviceState::Assigned
            } else if shared.contains(uuid) {
                DeviceState::Shared
            } else {
                DeviceState::Free
            }
        };
        let gpus = self
            .inventory
            .gpus
            .iter()
            .map(|g| {
                let holder = holders.get(g.uuid.as_str()).cloned();
                let instances = g
                    .instances
                    .iter()
                    .map(|i| {
                        let holder = holders.get(i.uuid.as_str()).cloned();
                        MigInstanceStatus {
                            uuid: i.uuid.clone(),
                            profile: i.profile.clone(),
                            gi_id: i.gi_id,
                            ci_id: i.ci_id,
                            start: i.start,
                            size: i.size,
                            memory_mib: i.memory_mib,
                            state: state_of(&i.uuid, &holder),
                            holder,
                            lifecycle: life(&i.uuid),
                        }
                    })
                    .collect();
                GpuStatus {
                    index: g.index,
                    uuid: g.uuid.clone(),
                    model: g.model.clone(),
                    minor: g.minor,
                    memory_mib: g.memory_mib,
                    mig_enabled: g.mig_enabled,
                    state: if g.mig_enabled {
                        DeviceState::MigParent
                    } else {
                        state_of(&g.uuid, &holder)
                    },
                    holder,
                    lifecycle: life(&g.uuid),
                    instances,
                }
            })
            .collect();
        let mps_shares = self
            .mps
            .shares()
            .into_iter()
            .map(|sh| MpsShareStatus {
                device: sh.device,
                tenant: sh.tenant,
                percent: sh.percent,
                mem_limit_bytes: sh.mem_limit_bytes,
                pid: sh.pid,
                state: serde_json::to_value(&sh.state)
                    .ok()
                    .and_then(|v| v.get("state").and_then(|s| s.as_str()).map(str::to_string))
                    .unwrap_or_else(|| format!("{:?}", sh.state).to_lowercase()),
                holders: sh.holders,
                restarts: sh.restarts,
                cap_drifts: sh.cap_drifts,
            })
            .collect();
        let events = self
            .store
            .recent_events(20)
            .map_err(internal)?
            .into_iter()
            .map(|(ts_ms, kind, container_id, detail)| EventStatus {
                ts_ms,
                kind,
                container_id,
                detail,
            })
            .collect();
        Ok(NodeStatus {
            node: self.inventory.node.clone(),
            backend: self.backend.describe(),
            policy: self.policy.info(),
            gpus,
            allocations,
            mps_shares,
            events,
        })
    }

    fn log_refusal(&mut self, container_id: &str, err: &ApiError) {
        warn!(container = %container_id, code = ?err.code, rule = ?err.rule, "{}", err.message);
        if let Err(e) = self.store.event("refuse", Some(container_id), &err.message) {
            warn!("cannot record refusal: {e}");
        }
    }
}

/// Every device that is not plainly free: its lifecycle state and last scrub report.
type Lifecycles = BTreeMap<String, (scrub::DeviceState, Option<scrub::ScrubReport>)>;

/// Where a simulated device's memory appears in the container.
pub const SIM_MEM_PATH: &str = "/dev/tessera-sim-mem";

fn lifecycle_detail(st: &scrub::DeviceState) -> String {
    let after = |t: &str| if t.is_empty() { "unknown tenants".to_string() } else { t.to_string() };
    match st {
        scrub::DeviceState::Free => "free".into(),
        scrub::DeviceState::Assigned { tenant, container_id } => {
            format!("assigned to {tenant} ({container_id})")
        }
        scrub::DeviceState::Dirty { last_tenant } => {
            format!("dirty after {}: waiting for a scrub", after(last_tenant))
        }
        scrub::DeviceState::Scrubbing { last_tenant, attempt } => {
            format!("scrubbing (attempt {attempt}) after {}", after(last_tenant))
        }
        scrub::DeviceState::Quarantined { reason, .. } => format!("quarantined: {reason}"),
    }
}

fn summary(r: &scrub::ScrubReport) -> tessera_api::ScrubSummary {
    tessera_api::ScrubSummary {
        ok: r.ok,
        bytes_covered: r.bytes_covered,
        bytes_total: r.bytes_total,
        nonzero_words: r.nonzero_words,
        seconds: r.seconds,
        gbps: r.gbps,
        finished_ms: r.finished_unix_s.saturating_mul(1000),
        error: r.error.clone(),
    }
}

fn mps_err(e: mpsd::MpsError) -> ApiError {
    ApiError::new(ErrorCode::Internal, format!("tesserad mps: {e}"))
}

fn ledger_err(e: LedgerError) -> ApiError {
    ApiError::new(ErrorCode::Internal, format!("tesserad ledger: {e}"))
}

fn internal(e: StoreError) -> ApiError {
    ApiError::new(ErrorCode::Internal, format!("tesserad: {e}"))
}

/// runc's rule for container ids ([`tessera_api::validate_container_id`]), as a 400.
pub fn validate_container_id(id: &str) -> Result<(), ApiError> {
    tessera_api::validate_container_id(id)
        .map_err(|e| ApiError::new(ErrorCode::BadRequest, e.to_string()))
}

fn validate_abs_path(field: &str, p: &str) -> Result<(), ApiError> {
    let path = Path::new(p);
    let ok = path.is_absolute()
        && !p.contains('\0')
        && !path.components().any(|c| matches!(c, std::path::Component::ParentDir));
    if ok {
        Ok(())
    } else {
        Err(ApiError::new(
            ErrorCode::BadRequest,
            format!("{field} `{}` must be an absolute path without `..`", untrusted(p)),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn container_ids_follow_runcs_rules() {
        for ok in ["abc", "a.b-c_d+e", "0123456789abcdef"] {
            assert!(validate_container_id(ok).is_ok(), "{ok}");
        }
        for bad in ["", ".", "..", "../etc", "a/b", "a b", "a\0b", &"x".repeat(1025)] {
            let e = validate_container_id(bad).unwrap_err();
            assert_eq!(e.code, ErrorCode::BadRequest);
        }
    }

    #[test]
    fn paths_must_be_absolute_and_plain() {
        assert!(validate_abs_path("bundle", "/run/x").is_ok());
        assert!(validate_abs_path("bundle", "run/x").is_err());
        assert!(validate_abs_path("bundle", "/run/../etc").is_err());
    }
}
