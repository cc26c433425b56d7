//! Telemetry per container: every `--telemetry-interval-ms` the backend is asked what each
//! GPU and MIG instance does and what each process on a whole GPU uses
//! ([`TelemetryProbe::read`], outside the node lock: NVML and /proc); the node maps the
//! processes to containers through each grant's recorded cgroup (every process runc put
//! there, `runc exec` ones included: [`crate::host::Host::container_processes`], which
//! metering uses too) and so to tenants and pods, keeps the result for `GET /v1/telemetry`,
//! `/metrics` and `tessera top`, and hands the shared devices' samples to the interference
//! detector ([`Node::record_telemetry`]).
//!
//! On a simulated node the probe first mirrors each MPS container's thread cap into the
//! simulator (`GpuBackend::model_mps_caps`), which models what the MPS server enforces on
//! hardware.

use std::collections::BTreeMap;
use std::sync::Arc;

use slicer::GpuBackend;
use tessera_api::telemetry::{ContainerUsage, DeviceTelemetry, NodeTelemetry, ProcessTelemetry};
use tessera_api::{Allocation, AllocationState, Isolation};
use tracing::warn;

use super::Node;
use crate::error::CoreError;
use crate::host::Host;

/// The longest a latency report may be (bytes read).
const MAX_REPORT_BYTES: usize = 64;

/// One running container the probe maps processes to.
#[derive(Debug, Clone)]
struct User {
    container_id: String,
    pid: Option<i32>,
    /// Its grant's recorded cgroup (what maps processes to it).
    cgroup: Option<String>,
    /// The device it holds or shares.
    device: String,
    gpu: String,
    /// Its MPS thread cap now, for the simulator's model.
    mps_threads: Option<u8>,
    /// Its latency report file, where it is latency-sensitive.
    report: Option<std::path::PathBuf>,
}

/// What a telemetry tick reads: taken under the node lock, read outside it.
#[derive(Debug)]
pub struct TelemetryProbe {
    backend: Arc<dyn GpuBackend>,
    host: Arc<dyn Host>,
    gpus: Vec<(String, bool)>,
    users: Vec<User>,
}

/// What [`TelemetryProbe::read`] found.
#[derive(Debug, Default)]
pub struct TelemetryReadings {
    at_ms: u64,
    devices: Vec<DeviceTelemetry>,
    /// Container -> (SM, memory) summed over its processes; absent where not measured.
    usage: BTreeMap<String, (f64, f64)>,
    latency: BTreeMap<String, f64>,
}

impl TelemetryProbe {
    /// Read every GPU and the processes of each whole GPU (blocking; without the lock).
    pub fn read(&self) -> TelemetryReadings {
        let mut out = TelemetryReadings { at_ms: crate::now_ms(), ..Default::default() };
        // The simulator's stand-in for MPS enforcement: each container's cap, by pid.
        let mut caps: BTreeMap<&str, Vec<(u32, u8)>> = BTreeMap::new();
        let trees: BTreeMap<&str, std::collections::BTreeSet<u32>> = self
            .users
            .iter()
            .filter(|u| u.pid.is_some())
            .map(|u| {
                (u.container_id.as_str(), self.host.container_processes(u.pid, u.cgroup.as_deref()))
            })
            .collect();
        for u in &self.users {
            if let (Some(t), Some(tree)) = (u.mps_threads, trees.get(u.container_id.as_str())) {
                caps.entry(u.device.as_str()).or_default().extend(tree.iter().map(|p| (*p, t)));
            }
        }
        for (device, c) in &caps {
            if let Err(e) = self.backend.model_mps_caps(device, c) {
                warn!(device = %device, "mirroring MPS caps into the simulator failed: {e}");
            }
        }
        for (gpu, mig) in &self.gpus {
            match self.backend.device_telemetry(gpu) {
                Ok(t) => out.devices.extend(t),
                Err(e) => warn!(gpu = %gpu, "reading device telemetry failed: {e}"),
            }
            if *mig {
                continue;
            }
            let procs: Vec<ProcessTelemetry> = match self.backend.process_telemetry(gpu, 0) {
                Ok(Some(p)) => p,
                Ok(None) => continue,
                Err(e) => {
                    warn!(gpu = %gpu, "reading per-process telemetry failed: {e}");
                    continue;
                }
            };
            for u in self.users.iter().filter(|u| u.gpu == *gpu && u.device == *gpu) {
                let Some(tree) = trees.get(u.container_id.as_str()) else { continue };
                let (sm, mem) = procs
                    .iter()
                    .filter(|p| tree.contains(&p.pid))
                    .fold((0.0, 0.0), |(s, m), p| (s + p.sm, m + p.mem));
                out.usage.insert(u.container_id.clone(), (sm.min(1.0), mem.min(1.0)));
            }
        }
        for u in &self.users {
            if let Some(l) = u.report.as_deref().and_then(read_report) {
                out.latency.insert(u.container_id.clone(), l);
            }
        }
        out
    }
}

/// A container's own latency report: a regular file (never a link, FIFO or device: opened
/// with `O_NOFOLLOW|O_NONBLOCK` and checked), at most [`MAX_REPORT_BYTES`] read, one
/// positive number of milliseconds. Anything else is no report.
pub fn read_report(path: &std::path::Path) -> Option<f64> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    if !f.metadata().ok()?.is_file() {
        return None;
    }
    let mut buf = Vec::with_capacity(MAX_REPORT_BYTES);
    f.take(MAX_REPORT_BYTES as u64).read_to_end(&mut buf).ok()?;
    let text = std::str::from_utf8(&buf).ok()?;
    let v: f64 = text.split_whitespace().next()?.parse().ok()?;
    (v.is_finite() && v > 0.0 && v < 1e7).then_some(v)
}

/// Where a latency-sensitive container's report lives on the host, and where it sees it.
pub const REPORT_PATH: &str = "/run/tessera/latency_ms";
/// The environment variable that tells the workload where to write it.
pub const REPORT_ENV: &str = "TESSERA_LATENCY_FILE";

impl Node {
    /// The host file a latency-sensitive container reports its latency in.
    pub(crate) fn report_file(&self, container_id: &str) -> std::path::PathBuf {
        self.store.path().with_file_name("reports").join(container_id)
    }

    /// What the next telemetry tick reads.
    pub fn telemetry_probe(&self) -> Result<TelemetryProbe, CoreError> {
        let threads: BTreeMap<(String, String), u8> = self
            .mps
            .shares()
            .into_iter()
            .map(|s| ((s.device, s.tenant), if s.threads == 0 { s.percent } else { s.threads }))
            .collect();
        let users = self
            .store
            .all()
            .map_err(super::internal)?
            .into_iter()
            .filter(|r| r.allocation.state == AllocationState::Running)
            .flat_map(|r| self.users_of(&r.allocation, r.cgroup.as_deref(), &threads))
            .collect();
        Ok(TelemetryProbe {
            backend: Arc::clone(&self.backend),
            host: Arc::clone(&self.host),
            gpus: self.inventory.gpus.iter().map(|g| (g.uuid.clone(), g.mig_enabled)).collect(),
            users,
        })
    }

    fn users_of(
        &self,
        a: &Allocation,
        cgroup: Option<&str>,
        threads: &BTreeMap<(String, String), u8>,
    ) -> Vec<User> {
        let report = (a.class == Some(tessera_api::WorkloadClass::Latency))
            .then(|| self.report_file(&a.container_id));
        a.devices
            .iter()
            .map(|d| User {
                container_id: a.container_id.to_string(),
                pid: a.pid,
                cgroup: cgroup.map(str::to_string),
                device: d.uuid.to_string(),
                gpu: d.gpu_uuid.to_string(),
                mps_threads: (a.isolation == Isolation::Mps)
                    .then(|| threads.get(&(d.uuid.to_string(), a.tenant.to_string())).copied())
                    .flatten(),
                report: report.clone(),
            })
            .collect()
    }

    /// Keep what [`TelemetryProbe::read`] found, mapped to containers, and run the
    /// interference detector over the shared devices. Returns the steps to carry out
    /// outside the lock (throttles, stops).
    pub fn record_telemetry(
        &mut self,
        r: TelemetryReadings,
    ) -> Result<Vec<interference::Step>, CoreError> {
        let allocations = self.allocations()?;
        let threads: BTreeMap<(String, String), u8> = self
            .mps
            .shares()
            .into_iter()
            .map(|s| ((s.device, s.tenant), if s.threads == 0 { s.percent } else { s.threads }))
            .collect();
        let mut containers = Vec::new();
        for a in allocations.iter().filter(|a| a.state == AllocationState::Running) {
            for d in &a.devices {
                let usage = r.usage.get(a.container_id.as_str());
                containers.push(ContainerUsage {
                    container_id: a.container_id.to_string(),
                    tenant: a.tenant.to_string(),
                    workload: a.workload.as_ref().map(|w| w.display_name()),
                    device: d.uuid.to_string(),
                    isolation: a.isolation,
                    class: a.class,
                    sm: usage.map(|u| u.0),
                    mem: usage.map(|u| u.1),
                    mps_threads: (a.isolation == Isolation::Mps)
                        .then(|| threads.get(&(d.uuid.to_string(), a.tenant.to_string())).copied())
                        .flatten(),
                    latency_ms: r.latency.get(a.container_id.as_str()).copied(),
                });
            }
        }
        self.telemetry.samples = self.telemetry.samples.saturating_add(1);
        self.telemetry.at_ms = r.at_ms;
        self.telemetry.devices = r.devices;
        self.telemetry.containers = containers;
        let steps = self.detect_interference(&allocations)?;
        self.telemetry.incidents = self.open_incidents();
        Ok(steps)
    }

    /// The last telemetry, as `GET /v1/telemetry` answers it.
    pub fn telemetry(&self) -> NodeTelemetry {
        NodeTelemetry { node: self.inventory.node.clone(), ..self.telemetry.clone() }
    }

    /// What `/metrics` exports of the telemetry.
    pub fn telemetry_metrics(&self) -> crate::metrics::TelemetryMetrics {
        let mut devices = BTreeMap::new();
        for g in &self.inventory.gpus {
            devices.insert(g.uuid.clone(), (g.index, g.model.clone(), None));
            for i in &g.instances {
                devices.insert(
                    i.uuid.clone(),
                    (g.index, g.model.clone(), Some((i.profile.clone(), i.gi_id))),
                );
            }
        }
        let pods = self
            .allocations()
            .unwrap_or_default()
            .into_iter()
            .filter_map(|a| {
                let w = a.workload?;
                Some((
                    a.container_id.into_string(),
                    (w.namespace, w.pod, w.container.unwrap_or_default()),
                ))
            })
            .collect();
        crate::metrics::TelemetryMetrics {
            hostname: self.inventory.node.clone(),
            telemetry: (self.telemetry.samples > 0).then(|| self.telemetry()),
            devices,
            pods,
            incidents: self.interference.opened_total.clone(),
        }
    }

    /// [`Node::telemetry_probe`], read and recorded in one go (callers holding the node
    /// alone); the steps are returned, not carried out.
    pub fn sample_telemetry(&mut self) -> Result<Vec<interference::Step>, CoreError> {
        let r = self.telemetry_probe()?.read();
        self.record_telemetry(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_is_one_number_in_a_regular_file_and_nothing_else() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("r");
        std::fs::write(&f, "12.5\n").expect("write");
        assert_eq!(read_report(&f), Some(12.5));
        for bad in ["", "-1", "nan", "inf", "x", "0"] {
            std::fs::write(&f, bad).expect("write");
            assert_eq!(read_report(&f), None, "{bad:?}");
        }
        std::fs::write(&f, format!("{}7", " ".repeat(80))).expect("write");
        assert_eq!(read_report(&f), None, "only the first 64 bytes are read");
        // A link (to a file the daemon could read) and a FIFO (which would block) are no
        // reports.
        let target = dir.path().join("secret");
        std::fs::write(&target, "42").expect("write");
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&target, &link).expect("symlink");
        assert_eq!(read_report(&link), None);
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).expect("path");
        // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        assert_eq!(read_report(&fifo), None);
    }
}
