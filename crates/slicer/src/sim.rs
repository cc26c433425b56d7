//! The simulated backend: a node described by a JSON file, whose hardware state lives in
//! files under `<state_dir>/sim/` the way real hardware state outlives a daemon restart.
//!
//! Layout of `<state_dir>/sim/`:
//! - `node.json`: the realised hardware (GPUs, uuids, minors, MIG instances with their GI
//!   ids and placements). Written last on first open, so its presence means "materialised".
//! - `proc-devices`: a `/proc/devices` listing the NVIDIA majors.
//! - `mig-minors`: the driver's cap numbering, `3 + gpu_minor*135 + gi*9 (+1+ci)`.
//! - `mem/<uuid>.bin`: the device memory of each assignable device (each MIG instance on a
//!   MIG GPU, else the GPU), `sim_memory_bytes` long, zero-filled at first.
//!
//! - `load/`, `mps-caps/`: what runs on each device and its MPS caps, for the contention
//!   model ([`set_load`]; `sim/telemetry.rs`).
//! - `xid/`, `health/`: simulated faults ([`inject_xid`], [`set_health`]; `sim/faults.rs`).
//! - `lock`: taken (flock, exclusive) around every change, so concurrent creates and
//!   destroys from threads or processes never lose an update.
//!
//! [`GpuBackend::inventory`] re-reads these files on every call and resolves majors and
//! cap minors with the same parsers the NVML backend uses on the real host files.
//!
//! # MIG changes (hardware semantics)
//!
//! [`GpuBackend::create_instance`] checks the new placement against the catalog next to
//! the GPU's other instances, gives it the lowest free GPU-instance id (as the driver
//! does), compute instance 0 and a fresh uuid (derived from a creation counter kept in the
//! state, so an instance re-created at the same placement with the same GI id still gets
//! a new uuid), creates its zeroed memory file, then persists the state atomically and
//! rewrites `mig-minors`. [`GpuBackend::destroy_instance`] persists the state, then removes
//! the memory file. A crash in between leaves at worst an orphan memory file, never an
//! instance without memory. A daemon restart sees every change.
//!
//! Difference from the driver: real drivers can refuse a 3g instance after smaller ones
//! were created first (create 3g before smaller ones); the simulator accepts any
//! creation order that is legal. [`crate::layout::plan`] orders creations 3g-first for
//! the driver's sake.

mod faults;
mod telemetry;

pub use faults::{inject_xid, set_health, MAX_EVENTS_PER_READ};
pub use telemetry::{set_load, LoadEntry, MAX_LOAD_ENTRIES};

use std::fs::{self, File};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::backend::{cap_minors, read_majors, read_mig_minors, BackendError, GpuBackend};
use crate::catalog::{self, placement_is_legal};
use crate::hash::fnv1a64;
use crate::inventory::{
    render_mig_minors, render_proc_devices, Gpu, Inventory, Majors, MigInstance, CAP_GIS_PER_GPU,
    NVIDIA_MAJOR,
};

/// Device memory per simulated device unless the node file says otherwise.
pub const DEFAULT_SIM_MEMORY_BYTES: u64 = 64 * 1024;
/// Largest simulated device memory: the files are real files on the state disk.
pub const MAX_SIM_MEMORY_BYTES: u64 = 1 << 30;
/// Most GPUs one simulated node may have.
pub const MAX_SIM_GPUS: usize = 64;
const STATE_FORMAT: u32 = 1;

/// A node description file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeFile {
    pub node: String,
    #[serde(default)]
    pub majors: MajorsFile,
    #[serde(default = "default_memory_bytes")]
    pub sim_memory_bytes: u64,
    pub gpus: Vec<GpuFile>,
    /// A directory standing in for the host's driver installation: every file in it whose
    /// name is a driver library soname is treated as listed by `ldconfig`, and its `bin/`
    /// as a place driver utilities are found. Absent: no driver files (device nodes only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub driver_root: Option<PathBuf>,
}

/// The majors of a simulated node. Every field has a default; `"nvidia_caps": null`
/// simulates a driver without capability devices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MajorsFile {
    #[serde(default = "default_nvidia")]
    pub nvidia: u32,
    #[serde(default = "default_uvm")]
    pub nvidia_uvm: u32,
    #[serde(default = "default_caps")]
    pub nvidia_caps: Option<u32>,
}

impl Default for MajorsFile {
    fn default() -> Self {
        MajorsFile {
            nvidia: default_nvidia(),
            nvidia_uvm: default_uvm(),
            nvidia_caps: default_caps(),
        }
    }
}

/// One GPU of a node description. `mig` absent: MIG off (a whole GPU); present (even
/// empty): MIG on with these GPU instances.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuFile {
    pub model: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig: Option<Vec<PlacementFile>>,
    /// The GPUs (by index in `gpus`) this one has an active NVLink to; links count both
    /// ways. Joined GPUs form an NVLink domain.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nvlink: Vec<u32>,
    /// The NUMA node of the GPU's PCI device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub numa_node: Option<u32>,
    /// The CPUs local to it, as a Linux CPU list (`0-15`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<String>,
}

/// One MIG instance of a node description.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlacementFile {
    pub profile: String,
    pub start: u8,
}

fn default_memory_bytes() -> u64 {
    DEFAULT_SIM_MEMORY_BYTES
}
fn default_nvidia() -> u32 {
    NVIDIA_MAJOR
}
fn default_uvm() -> u32 {
    508
}
fn default_caps() -> Option<u32> {
    Some(509)
}

/// The persisted hardware state (`sim/node.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SimState {
    format: u32,
    node: String,
    memory_bytes: u64,
    gpus: Vec<SimGpu>,
    /// MIG instances created since the state was materialised; part of every new
    /// instance's uuid, so uuids are never reused.
    #[serde(default)]
    generation: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SimGpu {
    index: u32,
    uuid: String,
    model: String,
    minor: u32,
    memory_mib: u64,
    mig_enabled: bool,
    instances: Vec<SimInstance>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SimInstance {
    uuid: String,
    profile: String,
    gi_id: u32,
    ci_id: u32,
    start: u8,
    size: u8,
    memory_mib: u64,
}

/// A simulated node. See the module documentation for its files.
#[derive(Debug, Clone)]
pub struct SimBackend {
    node_file: PathBuf,
    sim_dir: PathBuf,
    /// The node file's `driver_root`, resolved against the node file's directory.
    driver_root: Option<PathBuf>,
    /// The node file's NVLink, NUMA and CPU layout, by GPU index.
    layout: Vec<(Option<u32>, Option<u32>, Option<String>)>,
}

impl SimBackend {
    /// Open the simulated node described by `node_file`, keeping its hardware state under
    /// `state_dir/sim/`. The first open materialises the state; later opens use it as it
    /// is (after checking it still belongs to this node description).
    pub fn open(node_file: &Path, state_dir: &Path) -> Result<SimBackend, BackendError> {
        let desc = load_node_file(node_file)?;
        let driver_root = desc.driver_root.as_ref().map(|root| match node_file.parent() {
            Some(dir) if root.is_relative() => dir.join(root),
            _ => root.clone(),
        });
        let links: Vec<(usize, usize)> = desc
            .gpus
            .iter()
            .enumerate()
            .flat_map(|(i, g)| g.nvlink.iter().map(move |&p| (i, p as usize)))
            .collect();
        let domains = crate::topology::domains_from_links(desc.gpus.len(), &links, &[]);
        let layout =
            desc.gpus.iter().zip(domains).map(|(g, d)| (d, g.numa_node, g.cpus.clone())).collect();
        let backend = SimBackend {
            layout,
            node_file: node_file.to_path_buf(),
            sim_dir: state_dir.join("sim"),
            driver_root,
        };
        let state_path = backend.state_path();
        if state_path.exists() {
            let state = backend.read_state()?;
            backend.check_matches(&desc, &state)?;
            backend.check_memory_files(&state)?;
            for path in [backend.proc_devices_path(), backend.mig_minors_path()] {
                if !path.is_file() {
                    return Err(backend.mismatch(format!("{} is missing", path.display())));
                }
            }
        } else {
            backend.materialise(&desc)?;
        }
        Ok(backend)
    }

    /// The node description this backend was opened with.
    pub fn node_file(&self) -> &Path {
        &self.node_file
    }

    /// `<state_dir>/sim`.
    pub fn sim_dir(&self) -> &Path {
        &self.sim_dir
    }

    /// The simulated `/proc/devices`.
    pub fn proc_devices_path(&self) -> PathBuf {
        self.sim_dir.join("proc-devices")
    }

    /// The simulated `/proc/driver/nvidia-caps/mig-minors`.
    pub fn mig_minors_path(&self) -> PathBuf {
        self.sim_dir.join("mig-minors")
    }

    /// The file holding the memory of the device `uuid` (GPU or MIG). Characters other
    /// than ASCII letters, digits and `-` are replaced by `_`, so the path never leaves
    /// the `mem` directory whatever `uuid` holds.
    pub fn memory_file(&self, uuid: &str) -> PathBuf {
        let safe: String = uuid
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' })
            .collect();
        self.sim_dir.join("mem").join(format!("{safe}.bin"))
    }

    fn state_path(&self) -> PathBuf {
        self.sim_dir.join("node.json")
    }

    fn mismatch(&self, message: String) -> BackendError {
        BackendError::StateMismatch {
            state: self.sim_dir.clone(),
            node_file: self.node_file.clone(),
            message,
        }
    }

    fn read_state(&self) -> Result<SimState, BackendError> {
        let path = self.state_path();
        let text = fs::read_to_string(&path).map_err(BackendError::io(&path))?;
        let state: SimState = parse_json(&path, &text)?;
        if state.format != STATE_FORMAT {
            return Err(BackendError::Json {
                path,
                message: format!(
                    "state format {} is not the supported format {STATE_FORMAT}",
                    state.format
                ),
            });
        }
        Ok(state)
    }

    fn check_matches(&self, desc: &NodeFile, state: &SimState) -> Result<(), BackendError> {
        if desc.node != state.node {
            return Err(self.mismatch(format!(
                "node is `{}` in the state but `{}` in the node file",
                state.node, desc.node
            )));
        }
        if desc.gpus.len() != state.gpus.len() {
            return Err(self.mismatch(format!(
                "the state has {} GPUs but the node file describes {}",
                state.gpus.len(),
                desc.gpus.len()
            )));
        }
        for (i, (want, have)) in desc.gpus.iter().zip(&state.gpus).enumerate() {
            if want.model != have.model {
                return Err(self.mismatch(format!(
                    "gpus[{i}] is a {} in the state but a {} in the node file",
                    have.model, want.model
                )));
            }
        }
        Ok(())
    }

    fn check_memory_files(&self, state: &SimState) -> Result<(), BackendError> {
        for uuid in assignable_uuids(state) {
            let path = self.memory_file(uuid);
            let meta = fs::metadata(&path)
                .map_err(|e| self.mismatch(format!("memory file {}: {e}", path.display())))?;
            if meta.len() != state.memory_bytes {
                return Err(self.mismatch(format!(
                    "memory file {} is {} bytes, not {}",
                    path.display(),
                    meta.len(),
                    state.memory_bytes
                )));
            }
        }
        Ok(())
    }

    fn materialise(&self, desc: &NodeFile) -> Result<(), BackendError> {
        let state = realise(desc);
        let mem_dir = self.sim_dir.join("mem");
        fs::create_dir_all(&mem_dir).map_err(BackendError::io(&mem_dir))?;
        let majors = Majors {
            nvidia: desc.majors.nvidia,
            nvidia_uvm: desc.majors.nvidia_uvm,
            nvidia_caps: desc.majors.nvidia_caps,
        };
        write_atomic(&self.proc_devices_path(), render_proc_devices(&majors).as_bytes())?;
        let minors: Vec<u32> = state.gpus.iter().map(|g| g.minor).collect();
        write_atomic(&self.mig_minors_path(), render_mig_minors(&minors).as_bytes())?;
        for uuid in assignable_uuids(&state) {
            create_zeroed(&self.memory_file(uuid), state.memory_bytes)?;
        }
        sync_dir(&mem_dir)?;
        self.write_state(&state)
    }

    fn write_state(&self, state: &SimState) -> Result<(), BackendError> {
        let json = serde_json::to_vec_pretty(state).map_err(|e| BackendError::Json {
            path: self.state_path(),
            message: format!("encode: {e}"),
        })?;
        write_atomic(&self.state_path(), &json)
    }

    /// Rewrite `mig-minors` for the state's GPUs (the driver lists every possible GPU and
    /// compute instance of every GPU, so the content follows the GPUs, not the layout).
    fn write_mig_minors(&self, state: &SimState) -> Result<(), BackendError> {
        let minors: Vec<u32> = state.gpus.iter().map(|g| g.minor).collect();
        write_atomic(&self.mig_minors_path(), render_mig_minors(&minors).as_bytes())
    }

    /// Take the state lock (exclusive flock on `sim/lock`) until the guard drops.
    fn lock(&self) -> Result<StateLock, BackendError> {
        let path = self.sim_dir.join("lock");
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(BackendError::io(&path))?;
        loop {
            use std::os::fd::AsRawFd;
            // SAFETY: flock on a file descriptor `file` owns and keeps open for the call;
            // no memory is passed.
            let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
            if rc == 0 {
                return Ok(StateLock { _file: file });
            }
            let err = std::io::Error::last_os_error();
            if err.kind() != std::io::ErrorKind::Interrupted {
                return Err(BackendError::Io { path, source: err });
            }
        }
    }

    fn instance_of(
        &self,
        minors_gpu: u32,
        inst: &SimInstance,
    ) -> Result<MigInstance, BackendError> {
        let minors_path = self.mig_minors_path();
        let minors = read_mig_minors(&minors_path)?;
        let (gi_cap_minor, ci_cap_minor) =
            cap_minors(&minors, &minors_path, minors_gpu, inst.gi_id, inst.ci_id)?;
        Ok(MigInstance {
            uuid: inst.uuid.clone(),
            profile: inst.profile.clone(),
            gi_id: inst.gi_id,
            ci_id: inst.ci_id,
            start: inst.start,
            size: inst.size,
            memory_mib: inst.memory_mib,
            gi_cap_minor,
            ci_cap_minor,
        })
    }
}

/// The state lock; released when dropped (closing the file releases the flock).
#[derive(Debug)]
struct StateLock {
    _file: File,
}

impl GpuBackend for SimBackend {
    fn describe(&self) -> String {
        format!("sim:{}", self.node_file.display())
    }

    fn sim_memory_file(&self, uuid: &str) -> Option<PathBuf> {
        Some(self.memory_file(uuid))
    }

    /// The node file's `nvlink`, `numa_node` and `cpus` of each GPU.
    fn topology(&self) -> Result<crate::topology::Topology, BackendError> {
        let state = self.read_state()?;
        Ok(crate::topology::Topology {
            gpus: state
                .gpus
                .iter()
                .map(|g| {
                    let (nvlink_domain, numa_node, cpus) =
                        self.layout.get(g.index as usize).cloned().unwrap_or_default();
                    crate::topology::GpuTopology {
                        uuid: g.uuid.clone(),
                        nvlink_domain,
                        numa_node,
                        cpus,
                    }
                })
                .collect(),
        })
    }

    /// The contention model over `<sim>/load/` ([`set_load`]): the GPU (a MIG GPU's
    /// activity is its instances', weighted by their memory slots), then each instance.
    fn device_telemetry(
        &self,
        gpu_uuid: &str,
    ) -> Result<Vec<crate::telemetry::DeviceTelemetry>, BackendError> {
        let state = self.read_state()?;
        let Some(gpu) = state.gpus.iter().find(|g| g.uuid == gpu_uuid) else {
            return Ok(Vec::new());
        };
        if !gpu.mig_enabled {
            let mut t = telemetry::device(&self.sim_dir, &gpu.uuid, &gpu.uuid)?;
            t.ecc_uncorrected = self.uncorrectable_ecc_errors(&gpu.uuid)?;
            t.ecc_corrected = Some(0);
            return Ok(vec![t]);
        }
        let mut instances = Vec::new();
        let (mut sm, mut bw) = (0.0, 0.0);
        for i in &gpu.instances {
            let t = telemetry::device(&self.sim_dir, &i.uuid, &gpu.uuid)?;
            let w = f64::from(i.size) / f64::from(crate::catalog::MEMORY_SLOTS);
            sm += t.sm_active.unwrap_or(0.0) * w;
            bw += t.dram_active.unwrap_or(0.0) * w;
            instances.push(t);
        }
        let mut g = telemetry::with_activity(&gpu.uuid, &gpu.uuid, sm.min(1.0), bw.min(1.0));
        g.ecc_uncorrected = self.uncorrectable_ecc_errors(&gpu.uuid)?;
        g.ecc_corrected = Some(0);
        Ok(std::iter::once(g).chain(instances).collect())
    }

    /// The model's per-process figures (none under MIG, as under NVML); without a load
    /// file, the utilisation feed.
    fn process_telemetry(
        &self,
        gpu_uuid: &str,
        since_us: u64,
    ) -> Result<Option<Vec<crate::telemetry::ProcessTelemetry>>, BackendError> {
        let state = self.read_state()?;
        if state.gpus.iter().any(|g| g.uuid == gpu_uuid && g.mig_enabled) {
            return Ok(None);
        }
        match telemetry::modelled(&self.sim_dir, gpu_uuid)? {
            Some(m) => Ok(Some(
                m.into_iter()
                    .map(|(pid, a)| crate::telemetry::ProcessTelemetry { pid, sm: a.sm, mem: a.bw })
                    .collect(),
            )),
            None => Ok(self.process_utilization(gpu_uuid, since_us)?.map(|samples| {
                samples
                    .into_iter()
                    .map(|s| crate::telemetry::ProcessTelemetry {
                        pid: s.pid,
                        sm: f64::from(s.sm_percent.min(100)) / 100.0,
                        mem: 0.0,
                    })
                    .collect()
            })),
        }
    }

    fn model_mps_caps(&self, uuid: &str, caps: &[(u32, u8)]) -> Result<(), BackendError> {
        telemetry::write_caps(&self.sim_dir, uuid, caps)
    }

    /// Pending events of `<sim>/xid/` ([`inject_xid`]), each handed out once.
    fn xid_events(&self) -> Result<Vec<crate::xid::XidEvent>, BackendError> {
        faults::drain_xids(&self.sim_dir)
    }

    /// `<sim>/health/<uuid>` ([`set_health`]) of the device and, for a MIG instance, of
    /// its GPU.
    fn device_health(&self, uuid: &str) -> Result<Option<String>, BackendError> {
        if let Some(why) = faults::health(&self.sim_dir, uuid)? {
            return Ok(Some(why));
        }
        let state = self.read_state()?;
        match state.gpus.iter().find(|g| g.instances.iter().any(|i| i.uuid == uuid)) {
            Some(gpu) => Ok(faults::health(&self.sim_dir, &gpu.uuid)?
                .map(|why| format!("its GPU {}: {why}", gpu.uuid))),
            None => Ok(None),
        }
    }

    /// The simulated counter: `<sim>/ecc/<gpu uuid>` holds a number (absent: 0).
    fn uncorrectable_ecc_errors(&self, gpu_uuid: &str) -> Result<Option<u64>, BackendError> {
        let path = self.sim_dir.join("ecc").join(gpu_uuid);
        match std::fs::read_to_string(&path) {
            Ok(t) => t.trim().parse::<u64>().map(Some).map_err(|e| BackendError::Json {
                path: path.clone(),
                message: format!("an ECC counter must be a whole number: {e}"),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Some(0)),
            Err(source) => Err(BackendError::Io { path, source }),
        }
    }

    fn driver_mounts(&self) -> Vec<tessera_api::BindMount> {
        let Some(root) = &self.driver_root else { return Vec::new() };
        // What `ldconfig -p` would list for libraries installed in `root`.
        let listed: Vec<(String, PathBuf)> = std::fs::read_dir(root)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str().map(|n| (n.to_string(), e.path())))
            .collect();
        crate::driver::driver_mounts(&listed, &[root.join("bin")])
    }

    /// The simulated GPU's utilisation feed: `<sim>/util/<gpu uuid>.json`, a JSON list of
    /// `{"pid", "sm_percent"}` describing what each process is using *now* (whatever plays
    /// the workload writes it). Each read returns them stamped with the current time, as
    /// NVML reports processes active since the last query; `since_us` is therefore always
    /// older. A GPU in MIG mode has none (as under NVML); so does one without a feed.
    fn process_utilization(
        &self,
        gpu_uuid: &str,
        since_us: u64,
    ) -> Result<Option<Vec<crate::backend::ProcessUtil>>, BackendError> {
        let inv = self.inventory()?;
        if inv.gpus.iter().any(|g| g.uuid == gpu_uuid && g.mig_enabled) {
            return Ok(None);
        }
        let path = self.sim_dir.join("util").join(format!("{gpu_uuid}.json"));
        let now = || {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_micros() as u64)
                .unwrap_or(0)
                .max(since_us + 1)
        };
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            // No feed: what the contention model gives each process, where a load is set.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let Some(m) = telemetry::modelled(&self.sim_dir, gpu_uuid)? else {
                    return Ok(None);
                };
                let at = now();
                return Ok(Some(
                    m.into_iter()
                        .map(|(pid, a)| crate::backend::ProcessUtil {
                            pid,
                            sm_percent: (a.sm * 100.0).round() as u32,
                            timestamp_us: at,
                        })
                        .collect(),
                ));
            }
            Err(source) => return Err(BackendError::Io { path, source }),
        };
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Feed {
            pid: u32,
            sm_percent: u32,
        }
        let feed: Vec<Feed> = serde_json::from_slice(&bytes)
            .map_err(|e| BackendError::Json { path: path.clone(), message: e.to_string() })?;
        let now_us = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0)
            .max(since_us + 1);
        Ok(Some(
            feed.into_iter()
                .map(|f| crate::backend::ProcessUtil {
                    pid: f.pid,
                    sm_percent: f.sm_percent,
                    timestamp_us: now_us,
                })
                .collect(),
        ))
    }

    fn inventory(&self) -> Result<Inventory, BackendError> {
        let state = self.read_state()?;
        let majors = read_majors(&self.proc_devices_path())?;
        let minors_path = self.mig_minors_path();
        let minors = read_mig_minors(&minors_path)?;
        let mut gpus = Vec::with_capacity(state.gpus.len());
        for g in state.gpus {
            let mut instances = Vec::with_capacity(g.instances.len());
            for i in g.instances {
                let (gi_cap_minor, ci_cap_minor) =
                    cap_minors(&minors, &minors_path, g.minor, i.gi_id, i.ci_id)?;
                instances.push(MigInstance {
                    uuid: i.uuid,
                    profile: i.profile,
                    gi_id: i.gi_id,
                    ci_id: i.ci_id,
                    start: i.start,
                    size: i.size,
                    memory_mib: i.memory_mib,
                    gi_cap_minor,
                    ci_cap_minor,
                });
            }
            gpus.push(Gpu {
                index: g.index,
                uuid: g.uuid,
                model: g.model,
                minor: g.minor,
                memory_mib: g.memory_mib,
                mig_enabled: g.mig_enabled,
                instances,
            });
        }
        Ok(Inventory { node: state.node, gpus, majors })
    }

    fn create_instance(
        &self,
        gpu_index: u32,
        profile: &str,
        start: u8,
    ) -> Result<MigInstance, BackendError> {
        let _lock = self.lock()?;
        let mut state = self.read_state()?;
        let generation = state.generation.saturating_add(1);
        state.generation = generation;
        let node = state.node.clone();
        let memory_bytes = state.memory_bytes;
        let gpu = state
            .gpus
            .iter_mut()
            .find(|g| g.index == gpu_index)
            .ok_or(BackendError::NoSuchGpu(gpu_index))?;
        if !gpu.mig_enabled {
            return Err(BackendError::MigDisabled { gpu_index });
        }
        let model = catalog::model(&gpu.model)
            .ok_or_else(|| BackendError::UnknownModel { gpu_index, model: gpu.model.clone() })?;
        let mut layout: Vec<(&str, u8)> =
            gpu.instances.iter().map(|i| (i.profile.as_str(), i.start)).collect();
        layout.push((profile, start));
        placement_is_legal(model, &layout)
            .map_err(|source| BackendError::Layout { gpu_index, source })?;
        let prof = model.profile(profile).ok_or_else(|| BackendError::Layout {
            gpu_index,
            source: catalog::LayoutError::UnknownProfile {
                model: model.name,
                profile: profile.to_string(),
                offered: model.profile_names().collect::<Vec<_>>().join(", "),
            },
        })?;
        // The driver hands out the lowest free GPU-instance id (gi0 is never a MIG
        // instance).
        let gi_id = (1..CAP_GIS_PER_GPU)
            .find(|id| !gpu.instances.iter().any(|i| i.gi_id == *id))
            .ok_or(BackendError::NoFreeGiId { gpu_index })?;
        let ci_id = 0;
        let inst = SimInstance {
            uuid: sim_uuid(
                "MIG",
                &format!("{node}/{gpu_index}/{gi_id}/{ci_id}/created-{generation}"),
            ),
            profile: prof.name.to_string(),
            gi_id,
            ci_id,
            start,
            size: prof.size,
            memory_mib: prof.memory_mib,
        };
        let gpu_minor = gpu.minor;
        gpu.instances.push(inst.clone());
        gpu.instances.sort_by_key(|i| (i.start, i.gi_id));

        let mem = self.memory_file(&inst.uuid);
        create_zeroed(&mem, memory_bytes)?;
        let mem_dir = self.sim_dir.join("mem");
        sync_dir(&mem_dir)?;
        if let Err(e) = self.write_state(&state) {
            let _ = fs::remove_file(&mem);
            return Err(e);
        }
        self.write_mig_minors(&state)?;
        self.instance_of(gpu_minor, &inst)
    }

    fn destroy_instance(&self, uuid: &str) -> Result<(), BackendError> {
        let _lock = self.lock()?;
        let mut state = self.read_state()?;
        let mut found = false;
        for gpu in &mut state.gpus {
            if let Some(pos) = gpu.instances.iter().position(|i| i.uuid == uuid) {
                gpu.instances.remove(pos);
                found = true;
                break;
            }
        }
        if !found {
            return Err(BackendError::NoSuchInstance(uuid.to_string()));
        }
        self.write_state(&state)?;
        self.write_mig_minors(&state)?;
        let mem = self.memory_file(uuid);
        match fs::remove_file(&mem) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(BackendError::Io { path: mem, source: e }),
        }
        sync_dir(&self.sim_dir.join("mem"))
    }
}

/// Read and check a node description file.
pub fn load_node_file(path: &Path) -> Result<NodeFile, BackendError> {
    let text = fs::read_to_string(path).map_err(BackendError::io(path))?;
    let desc: NodeFile = parse_json(path, &text)?;
    validate(path, &desc)?;
    Ok(desc)
}

fn parse_json<T: serde::de::DeserializeOwned>(path: &Path, text: &str) -> Result<T, BackendError> {
    let mut de = serde_json::Deserializer::from_str(text);
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let at = e.path().to_string();
        let inner = e.into_inner();
        let message = if at == "." { inner.to_string() } else { format!("{at}: {inner}") };
        BackendError::Json { path: path.to_path_buf(), message }
    })
}

fn validate(path: &Path, desc: &NodeFile) -> Result<(), BackendError> {
    let bad = |field: String, message: String| BackendError::Config {
        path: path.to_path_buf(),
        field,
        message,
    };
    if desc.node.is_empty()
        || !desc.node.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    {
        return Err(bad(
            "node".into(),
            format!("`{}` is not a node name (letters, digits, `-`, `_`, `.`)", desc.node),
        ));
    }
    if desc.sim_memory_bytes == 0 || desc.sim_memory_bytes > MAX_SIM_MEMORY_BYTES {
        return Err(bad(
            "sim_memory_bytes".into(),
            format!("{} is not between 1 and {MAX_SIM_MEMORY_BYTES}", desc.sim_memory_bytes),
        ));
    }
    let m = desc.majors;
    let mut majors = vec![m.nvidia, m.nvidia_uvm];
    majors.extend(m.nvidia_caps);
    majors.sort_unstable();
    if majors.windows(2).any(|w| w[0] == w[1]) || majors.contains(&0) {
        return Err(bad("majors".into(), "majors must be distinct and non-zero".into()));
    }
    if desc.gpus.is_empty() || desc.gpus.len() > MAX_SIM_GPUS {
        return Err(bad(
            "gpus".into(),
            format!("a node has 1 to {MAX_SIM_GPUS} GPUs, not {}", desc.gpus.len()),
        ));
    }
    for (i, gpu) in desc.gpus.iter().enumerate() {
        let model = catalog::model(&gpu.model).ok_or_else(|| {
            bad(
                format!("gpus[{i}].model"),
                format!(
                    "unknown GPU model `{}`; known: {}",
                    gpu.model,
                    catalog::model_names().collect::<Vec<_>>().join(", ")
                ),
            )
        })?;
        for (j, peer) in gpu.nvlink.iter().enumerate() {
            if *peer as usize >= desc.gpus.len() || *peer as usize == i {
                return Err(bad(
                    format!("gpus[{i}].nvlink[{j}]"),
                    format!(
                        "{peer} is not the index of another GPU of this node (0 to {})",
                        desc.gpus.len() - 1
                    ),
                ));
            }
        }
        if let Some(n) = gpu.numa_node {
            if n > 1023 {
                return Err(bad(
                    format!("gpus[{i}].numa_node"),
                    format!("{n} is not a NUMA node (0 to 1023)"),
                ));
            }
        }
        if let Some(c) = &gpu.cpus {
            crate::topology::parse_cpulist(c)
                .map_err(|e| bad(format!("gpus[{i}].cpus"), e.to_string()))?;
        }
        if let Some(mig) = &gpu.mig {
            let placements: Vec<(&str, u8)> =
                mig.iter().map(|p| (p.profile.as_str(), p.start)).collect();
            placement_is_legal(model, &placements)
                .map_err(|e| bad(format!("gpus[{i}].mig"), e.to_string()))?;
        }
    }
    Ok(())
}

/// The hardware a valid node description realises: uuids, minors, GI ids.
fn realise(desc: &NodeFile) -> SimState {
    let mut gpus = Vec::with_capacity(desc.gpus.len());
    for (i, g) in desc.gpus.iter().enumerate() {
        let index = u32::try_from(i).unwrap_or(u32::MAX);
        // Validated: the model is in the catalog.
        let model = catalog::model(&g.model);
        let mut instances = Vec::new();
        if let (Some(mig), Some(model)) = (&g.mig, model) {
            // Create big instances first (the driver wants 3g before smaller ones), then by
            // start slot; GI ids follow creation order from 1.
            let mut order: Vec<(&PlacementFile, &catalog::Profile)> = mig
                .iter()
                .filter_map(|p| model.profile(&p.profile).map(|prof| (p, prof)))
                .collect();
            order.sort_by_key(|(p, prof)| {
                (std::cmp::Reverse((prof.compute_slices, prof.size)), p.start)
            });
            for (gi, (p, prof)) in (1u32..).zip(order) {
                let ci = 0;
                instances.push(SimInstance {
                    uuid: sim_uuid("MIG", &format!("{}/{index}/{gi}/{ci}", desc.node)),
                    profile: prof.name.to_string(),
                    gi_id: gi,
                    ci_id: ci,
                    start: p.start,
                    size: prof.size,
                    memory_mib: prof.memory_mib,
                });
            }
            instances.sort_by_key(|inst| inst.start);
        }
        gpus.push(SimGpu {
            index,
            uuid: sim_uuid("GPU", &format!("{}/{index}", desc.node)),
            model: g.model.clone(),
            minor: index,
            memory_mib: model.map_or(0, |m| m.memory_mib),
            mig_enabled: g.mig.is_some(),
            instances,
        });
    }
    SimState {
        format: STATE_FORMAT,
        node: desc.node.clone(),
        memory_bytes: desc.sim_memory_bytes,
        gpus,
        generation: 0,
    }
}

/// The uuids of the devices that have memory files: MIG instances on MIG GPUs, else GPUs.
fn assignable_uuids(state: &SimState) -> impl Iterator<Item = &str> {
    state.gpus.iter().flat_map(|g| {
        let whole = (!g.mig_enabled).then_some(g.uuid.as_str());
        whole.into_iter().chain(g.instances.iter().map(|i| i.uuid.as_str()))
    })
}

/// A uuid formatted like the driver's (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`),
/// derived deterministically from `key` (FNV-1a, stable across Rust versions).
fn sim_uuid(prefix: &str, key: &str) -> String {
    let hi = fnv1a64(format!("tessera-sim/{prefix}/hi/{key}").as_bytes());
    let lo = fnv1a64(format!("tessera-sim/{prefix}/lo/{key}").as_bytes());
    let hex = format!("{hi:016x}{lo:016x}");
    format!(
        "{prefix}-{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// Write `bytes` to `path` atomically: a temporary file in the same directory, fsync,
/// rename over `path`, fsync the directory.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), BackendError> {
    tessera_api::durable::replace(path, bytes, 0o644, tessera_api::durable::Sync::Durable)
        .map_err(BackendError::io(path))
}

/// Create `path` as `len` zero bytes, atomically.
fn create_zeroed(path: &Path, len: u64) -> Result<(), BackendError> {
    let tmp = tessera_api::durable::temp_path(path);
    let result = (|| {
        let f = File::create(&tmp).map_err(BackendError::io(&tmp))?;
        f.set_len(len).map_err(BackendError::io(&tmp))?;
        f.sync_all().map_err(BackendError::io(&tmp))?;
        fs::rename(&tmp, path).map_err(BackendError::io(path))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

fn sync_dir(dir: &Path) -> Result<(), BackendError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(BackendError::io(dir))
}

#[cfg(test)]
mod util_tests {
    use super::*;

    #[test]
    fn the_node_file_describes_nvlink_numa_and_cpus() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("node.json");
        let gpu = |peers: &str, numa: u32, cpus: &str| {
            format!(
                r#"{{"model": "H100-80GB", "nvlink": [{peers}], "numa_node": {numa}, "cpus": "{cpus}"}}"#
            )
        };
        let text = format!(
            r#"{{"node": "n", "gpus": [{}, {}, {}, {}, {{"model": "H100-80GB"}}]}}"#,
            gpu("1", 0, "0-15"),
            gpu("", 0, "0-15"),
            gpu("3", 1, "16-31"),
            gpu("2", 1, "16-31")
        );
        std::fs::write(&file, text).unwrap();
        let b = SimBackend::open(&file, &dir.path().join("state")).unwrap();
        let t = b.topology().unwrap();
        let got: Vec<(Option<u32>, Option<u32>)> =
            t.gpus.iter().map(|g| (g.nvlink_domain, g.numa_node)).collect();
        assert_eq!(
            got,
            [
                (Some(0), Some(0)),
                (Some(0), Some(0)),
                (Some(1), Some(1)),
                (Some(1), Some(1)),
                (None, None)
            ],
            "a link counts both ways"
        );
        assert_eq!(t.gpus[2].cpus.as_deref(), Some("16-31"));
        for (bad, field) in [
            (
                r#"{"node": "n", "gpus": [{"model": "H100-80GB", "nvlink": [0]}]}"#,
                "gpus[0].nvlink[0]",
            ),
            (r#"{"node": "n", "gpus": [{"model": "H100-80GB", "cpus": "x"}]}"#, "gpus[0].cpus"),
            (
                r#"{"node": "n", "gpus": [{"model": "H100-80GB", "numa_node": 5000}]}"#,
                "gpus[0].numa_node",
            ),
        ] {
            std::fs::write(&file, bad).unwrap();
            let e = SimBackend::open(&file, &dir.path().join("bad")).unwrap_err().to_string();
            assert!(e.contains(field), "{e}");
        }
    }

    #[test]
    fn the_utilisation_feed_follows_nvml_semantics() {
        let dir = tempfile::tempdir().unwrap();
        let node = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/nodes/h100x8.json");
        let b = SimBackend::open(&node, dir.path()).unwrap();
        let inv = b.inventory().unwrap();
        let whole = inv.gpus.iter().find(|g| !g.mig_enabled).unwrap().uuid.clone();
        let mig = inv.gpus.iter().find(|g| g.mig_enabled).unwrap().uuid.clone();
        assert_eq!(b.process_utilization(&whole, 0).unwrap(), None, "no feed: not available");
        let feed = dir.path().join("sim/util");
        std::fs::create_dir_all(&feed).unwrap();
        std::fs::write(
            feed.join(format!("{whole}.json")),
            r#"[{"pid": 10, "sm_percent": 40}, {"pid": 11, "sm_percent": 5}]"#,
        )
        .unwrap();
        let all = b.process_utilization(&whole, 0).unwrap().unwrap();
        assert_eq!(
            all.iter().map(|s| (s.pid, s.sm_percent)).collect::<Vec<_>>(),
            [(10, 40), (11, 5)]
        );
        let last = all[0].timestamp_us;
        let again = b.process_utilization(&whole, last).unwrap().unwrap();
        assert!(
            again.iter().all(|s| s.timestamp_us > last),
            "every read is newer than the last seen"
        );
        std::fs::write(feed.join(format!("{mig}.json")), r#"[{"pid": 1, "sm_percent": 1}]"#)
            .unwrap();
        assert_eq!(b.process_utilization(&mig, 0).unwrap(), None, "MIG mode: never available");
        std::fs::write(feed.join(format!("{whole}.json")), b"{not json").unwrap();
        assert!(
            b.process_utilization(&whole, 0).is_err(),
            "a malformed feed is an error, not silence"
        );
    }
}
