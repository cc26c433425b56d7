//! Metering: intervals opened and resumed, utilisation samples, checkpoints, usage reports.

use std::collections::BTreeMap;
use std::sync::Arc;

use metering::{IntervalStart, LedgerError, UsageQuery, UsageReport};
use slicer::GpuBackend;
use tessera_api::{Allocation, AllocationState, GpuRequest, GrantedDevice, Isolation};
use tracing::warn;

use super::{internal, ledger_err, Node};
use crate::error::CoreError;

impl Node {
    /// After a start: opening the ledger closed every interval left open at its last
    /// checkpoint; open fresh ones for the containers that are still running. Call after
    /// [`Node::reconcile`], so only live containers are metered (a grant whose init exited
    /// stays unmetered while it is held). Returns how many.
    pub fn resume_metering(&mut self) -> Result<usize, CoreError> {
        let mut n = 0;
        for rec in self.store.all().map_err(internal)? {
            // A grant outlives its init while runc keeps the container or a process is
            // left in its cgroup; metering stopped at the init's exit and stays stopped.
            let init_alive = rec.allocation.pid.and_then(|p| self.host.pid_start_time(p));
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
    /// [`Node::utilization_probe`], read and recorded in one go (for callers that hold the
    /// node alone); the daemon reads outside its lock.
    pub fn sample_utilization(&mut self) -> Result<usize, CoreError> {
        let samples = self.utilization_probe()?.read();
        self.record_utilization(samples)
    }

    /// What a utilisation tick reads: each whole GPU with running containers, from when,
    /// and whose processes count for which interval.
    pub fn utilization_probe(&self) -> Result<UtilProbe, CoreError> {
        let mut gpus: BTreeMap<String, UtilGpu> = BTreeMap::new();
        let records = self.store.all().map_err(internal)?;
        for r in records.iter().filter(|r| r.allocation.state == AllocationState::Running) {
            let a = &r.allocation;
            for d in a.devices.iter().filter(|d| d.uuid == d.gpu_uuid) {
                let since = self.util_seen.get(d.gpu_uuid.as_str()).copied().unwrap_or(0);
                let gpu = gpus
                    .entry(d.gpu_uuid.to_string())
                    .or_insert_with(|| UtilGpu { since, users: Vec::new() });
                gpu.users.push(UtilUser {
                    container: a.container_id.to_string(),
                    device: d.uuid.to_string(),
                    pid: a.pid,
                    cgroup: r.cgroup.clone(),
                });
            }
        }
        Ok(UtilProbe { backend: Arc::clone(&self.backend), host: Arc::clone(&self.host), gpus })
    }

    /// Record what [`UtilProbe::read`] found: the newest sample time per GPU, and one
    /// sample per interval still open (a container released meanwhile gets none).
    pub fn record_utilization(&mut self, s: UtilSamples) -> Result<usize, CoreError> {
        for (gpu, newest) in s.newest {
            self.util_seen.insert(gpu, newest);
        }
        if s.batch.is_empty() {
            return Ok(0);
        }
        self.ledger.record_utilization(&s.batch).map_err(ledger_err)
    }

    /// Heartbeat: stamp every open interval, bounding what a crash can lose.
    pub fn checkpoint(&mut self) -> Result<usize, CoreError> {
        self.ledger.checkpoint().map_err(ledger_err)
    }

    /// A usage report over the ledger, billed with the policy in force: its prices, its
    /// billing modes, and (only where the node is its own fleet) its floors, up to now.
    pub fn usage(
        &self,
        from_ms: u64,
        to_ms: u64,
        by: metering::GroupBy,
    ) -> Result<UsageReport, CoreError> {
        let policy = &self.policy.policy;
        let q = UsageQuery {
            from_ms,
            to_ms,
            by,
            prices: ::fleet::billing::prices_of(policy),
            terms: ::fleet::billing::terms_of(policy, !self.in_fleet, Some(crate::now_ms())),
        };
        self.ledger.usage(&q).map_err(|e| match e {
            LedgerError::BadQuery(_) => CoreError::bad_request(e.to_string()),
            other => ledger_err(other),
        })
    }

    /// The ledger's own check of its hash chain ([`metering::Ledger::verify_chain`]).
    pub fn verify_chain(&self) -> Result<metering::ChainReport, CoreError> {
        self.ledger.verify_chain().map_err(ledger_err)
    }

    /// The ledger's id, its chain head, and closed intervals after chain seq `after` (at
    /// most `limit`), for the usage upload.
    pub fn chained_after(
        &self,
        after: u64,
        limit: usize,
    ) -> Result<(metering::ChainHead, Vec<metering::ClosedInterval>), CoreError> {
        let head = self.ledger.chain_head().map_err(ledger_err)?;
        let rows = self.ledger.chained_after(after, limit).map_err(ledger_err)?;
        Ok((head, rows))
    }

    /// Every ledger interval (for metrics).
    pub fn intervals(&self) -> Result<Vec<metering::IntervalRecord>, CoreError> {
        self.ledger.intervals().map_err(ledger_err)
    }

    /// The fraction of a GPU one granted device is charged as.
    pub(super) fn fraction(&self, a: &Allocation, d: &GrantedDevice) -> f64 {
        let slices = d.mig_profile.as_deref().and_then(|p| {
            slicer::model(&d.model).and_then(|m| m.profile(p)).map(|p| p.compute_slices)
        });
        let weight = d.mig_profile.as_deref().and_then(|p| self.policy.policy.mig_weight(p));
        let mps = match a.request {
            GpuRequest::Mps { percent } => Some(percent),
            _ => None,
        };
        let replicas = a.share.as_ref().and_then(|s| s.replicas);
        metering::fraction(a.isolation, slices, mps, replicas, weight)
    }

    pub(super) fn open_intervals(&mut self, a: &Allocation) -> Result<usize, CoreError> {
        for d in &a.devices {
            let start = IntervalStart {
                container_id: a.container_id.to_string(),
                tenant: a.tenant.to_string(),
                node: self.inventory.node.clone(),
                gpu_uuid: d.gpu_uuid.to_string(),
                gpu_model: d.model.clone(),
                device_uuid: d.uuid.to_string(),
                isolation: a.isolation,
                mig_profile: if a.isolation == Isolation::Mig {
                    d.mig_profile.clone()
                } else {
                    None
                },
                fraction: self.fraction(a, d),
                // Borrowed work is metered at the burst price.
                class: crate::quota_gate::ledger_class(a.quota.as_deref()),
                workload: a.workload.clone(),
                // The topology premium: only a grant of several devices in one domain.
                nvlink_domain: a.nvlink_domain.filter(|_| a.devices.len() > 1),
            };
            self.ledger.open_interval(&start).map_err(ledger_err)?;
        }
        Ok(a.devices.len())
    }
}

/// One GPU of a [`UtilProbe`].
#[derive(Debug)]
struct UtilGpu {
    /// NVML's "since" (µs): the newest sample already taken.
    since: u64,
    /// Each running container on it.
    users: Vec<UtilUser>,
}

/// One running container of a [`UtilGpu`]: its interval's device, and what maps processes
/// to it ([`crate::host::Host::container_processes`]).
#[derive(Debug)]
struct UtilUser {
    container: String,
    device: String,
    pid: Option<i32>,
    cgroup: Option<String>,
}

/// What to read for a utilisation tick: taken under the node lock, read outside it.
#[derive(Debug)]
pub struct UtilProbe {
    backend: Arc<dyn GpuBackend>,
    host: Arc<dyn crate::host::Host>,
    gpus: BTreeMap<String, UtilGpu>,
}

/// Samples read by [`UtilProbe::read`], for [`Node::record_utilization`].
#[derive(Debug, Default)]
pub struct UtilSamples {
    newest: Vec<(String, u64)>,
    batch: Vec<(String, String, f64)>,
}

impl UtilProbe {
    /// Ask the backend for each GPU's per-process samples and sum them over each
    /// container's processes (those of its grant's cgroup) (blocking: NVML and /proc; call without the node lock).
    pub fn read(&self) -> UtilSamples {
        let mut out = UtilSamples::default();
        for (gpu, UtilGpu { since, users }) in &self.gpus {
            let samples = match self.backend.process_utilization(gpu, *since) {
                Ok(Some(s)) => s,
                Ok(None) => continue,
                Err(e) => {
                    warn!(gpu = %gpu, "reading per-process utilisation failed: {e}");
                    continue;
                }
            };
            if let Some(newest) = samples.iter().map(|s| s.timestamp_us).max() {
                out.newest.push((gpu.clone(), newest));
            }
            // Several samples of one pid in the period: their mean.
            let mut per_pid: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
            for s in &samples {
                let e = per_pid.entry(s.pid).or_default();
                e.0 += u64::from(s.sm_percent);
                e.1 += 1;
            }
            for u in users {
                if u.pid.is_none() {
                    continue;
                }
                let procs = self.host.container_processes(u.pid, u.cgroup.as_deref());
                let sm: f64 = per_pid
                    .iter()
                    .filter(|(p, _)| procs.contains(p))
                    .map(|(_, (sum, n))| *sum as f64 / *n as f64)
                    .sum();
                out.batch.push((u.container.clone(), u.device.clone(), sm.min(100.0)));
            }
        }
        out
    }
}
