//! The hardware seam: everything Tessera asks of the GPUs goes through [`GpuBackend`].
//! Two implementations: [`crate::NvmlBackend`] (the driver, through NVML) and
//! [`crate::SimBackend`] (a simulated node whose state lives in files, like hardware
//! state outlives a daemon restart).
//!
//! MIG instances are created and destroyed one at a time, at an explicit placement,
//! through [`GpuBackend::create_instance`] and [`GpuBackend::destroy_instance`]. A
//! backend checks legality against what it knows (the simulator: the catalog; NVML: the
//! driver) but knows nothing of tenants: never destroying an instance in use is the
//! caller's rule (see [`crate::place`](mod@crate::place) and [`crate::layout`]), checked before any call.

use std::path::PathBuf;

use crate::catalog::LayoutError;
use crate::inventory::{Inventory, MigInstance, ParseError};

/// The hardware seam. Implementations are cheap to share between threads.
pub trait GpuBackend: Send + Sync + std::fmt::Debug {
    /// Where the hardware picture comes from: `sim:<node file>` or `nvml`.
    fn describe(&self) -> String;

    /// The node's GPUs, MIG instances, device minors and majors, as they are now.
    fn inventory(&self) -> Result<Inventory, BackendError>;

    /// Create a MIG instance of `profile` (a GPU instance at memory slot `start` and one
    /// compute instance spanning it) on GPU `gpu_index`, and return it as the inventory
    /// will list it. The GPU must be in MIG mode and the placement legal next to what is
    /// there. Backends that cannot change MIG layouts answer
    /// [`BackendError::Unsupported`].
    fn create_instance(
        &self,
        gpu_index: u32,
        profile: &str,
        start: u8,
    ) -> Result<MigInstance, BackendError> {
        let _ = (gpu_index, profile, start);
        Err(BackendError::Unsupported(format!("{} cannot create MIG instances", self.describe())))
    }

    /// Destroy the MIG instance `uuid` (its compute instance, then its GPU instance).
    /// The caller must make sure nothing uses it.
    fn destroy_instance(&self, uuid: &str) -> Result<(), BackendError> {
        let _ = uuid;
        Err(BackendError::Unsupported(format!("{} cannot destroy MIG instances", self.describe())))
    }

    /// Per-process SM utilisation on the GPU `gpu_uuid` since `since_us` (CPU timestamp in
    /// microseconds; 0 for everything buffered), as NVML's per-process utilisation gives it.
    /// `Ok(None)`: not available — a GPU in MIG mode (NVML accounting is off under MIG), or
    /// a backend or device without the feature.
    fn process_utilization(
        &self,
        gpu_uuid: &str,
        since_us: u64,
    ) -> Result<Option<Vec<ProcessUtil>>, BackendError> {
        let _ = (gpu_uuid, since_us);
        Ok(None)
    }

    /// Uncorrectable ECC errors the GPU `gpu_uuid` has counted since the driver loaded.
    /// `Ok(None)`: not available (ECC off, or the backend cannot tell).
    fn uncorrectable_ecc_errors(&self, gpu_uuid: &str) -> Result<Option<u64>, BackendError> {
        let _ = gpu_uuid;
        Ok(None)
    }

    /// The node's GPU topology (NVLink domains, NUMA nodes, local CPUs). Empty where the
    /// backend cannot tell.
    fn topology(&self) -> Result<crate::topology::Topology, BackendError> {
        Ok(crate::topology::Topology::default())
    }

    /// What the GPU `gpu_uuid` and each of its MIG instances are doing now (the GPU first).
    /// Backends that cannot tell answer none.
    fn device_telemetry(
        &self,
        gpu_uuid: &str,
    ) -> Result<Vec<crate::telemetry::DeviceTelemetry>, BackendError> {
        let _ = gpu_uuid;
        Ok(Vec::new())
    }

    /// Per-process SM and memory utilisation on the GPU `gpu_uuid` since `since_us`.
    /// `Ok(None)`: not available (a GPU in MIG mode, a backend without it). The default is
    /// [`GpuBackend::process_utilization`] with no memory figure.
    fn process_telemetry(
        &self,
        gpu_uuid: &str,
        since_us: u64,
    ) -> Result<Option<Vec<crate::telemetry::ProcessTelemetry>>, BackendError> {
        Ok(self.process_utilization(gpu_uuid, since_us)?.map(|samples| {
            samples
                .into_iter()
                .map(|s| crate::telemetry::ProcessTelemetry {
                    pid: s.pid,
                    sm: f64::from(s.sm_percent.min(100)) / 100.0,
                    mem: 0.0,
                })
                .collect()
        }))
    }

    /// Simulated hardware only: the MPS active thread percentage each process on device
    /// `uuid` runs under (what the real MPS server enforces itself), for the simulator's
    /// contention model. Real backends ignore it.
    fn model_mps_caps(&self, uuid: &str, caps: &[(u32, u8)]) -> Result<(), BackendError> {
        let _ = (uuid, caps);
        Ok(())
    }

    /// The XID error events the driver reported since the last call, oldest first (drained:
    /// each is returned once). Never blocks. Backends without an event source answer none.
    fn xid_events(&self) -> Result<Vec<crate::xid::XidEvent>, BackendError> {
        Ok(Vec::new())
    }

    /// The health check a quarantined device must pass before it may return to service:
    /// `Ok(None)` when the device (GPU or MIG instance) reads healthy, `Ok(Some(why))` when
    /// it does not (retired pages or row remaps pending, a GPU lost).
    fn device_health(&self, uuid: &str) -> Result<Option<String>, BackendError> {
        let _ = uuid;
        Ok(None)
    }

    /// The host's driver files every GPU container gets (read-only bind mounts); none for
    /// simulated hardware.
    fn driver_mounts(&self) -> Vec<tessera_api::BindMount> {
        Vec::new()
    }

    /// Simulated hardware only: the file that is the device's memory. Real devices have
    /// none (their memory is reached through CUDA).
    fn sim_memory_file(&self, uuid: &str) -> Option<std::path::PathBuf> {
        let _ = uuid;
        None
    }
}

/// One per-process utilisation sample.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessUtil {
    /// Host pid of the process using the GPU.
    pub pid: u32,
    /// SM (compute) utilisation of the whole GPU by this process, percent.
    pub sm_percent: u32,
    /// CPU timestamp of the sample, microseconds.
    pub timestamp_us: u64,
}

/// Why a backend could not answer.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// No NVIDIA driver or no NVML library on this machine.
    #[error("no NVIDIA driver: {0}")]
    NoDriver(String),
    /// An NVML call failed.
    #[error("nvml {call}: {message}")]
    Nvml { call: String, message: String },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {source}")]
    Parse { path: PathBuf, source: ParseError },
    /// A node description or state file is not valid JSON of the expected shape.
    #[error("{path}: {message}")]
    Json { path: PathBuf, message: String },
    /// A node description is well-formed but describes something impossible.
    #[error("{path}: {field}: {message}")]
    Config { path: PathBuf, field: String, message: String },
    /// Persisted hardware state disagrees with the node description.
    #[error("simulated hardware state in {state} does not match {node_file}: {message}; remove {state} to start over")]
    StateMismatch { state: PathBuf, node_file: PathBuf, message: String },
    /// The host's view of the driver is incomplete (e.g. a missing cap minor or major).
    #[error("{0}")]
    Inventory(String),
    /// The backend cannot do this (e.g. change MIG layouts).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// No GPU has this index.
    #[error("no GPU with index {0}")]
    NoSuchGpu(u32),
    /// No MIG instance has this uuid.
    #[error("no MIG instance {0}")]
    NoSuchInstance(String),
    /// The GPU is not in MIG mode (Tessera never changes MIG mode).
    #[error("GPU {gpu_index} is not in MIG mode")]
    MigDisabled { gpu_index: u32 },
    /// The GPU's model is not in the catalog, so its layout cannot be checked here.
    #[error("GPU {gpu_index} is a {model}, which the catalog does not know")]
    UnknownModel { gpu_index: u32, model: String },
    /// The new instance would not be legal next to the GPU's other instances.
    #[error("GPU {gpu_index}: {source}")]
    Layout { gpu_index: u32, source: LayoutError },
    /// The driver offers no such placement for this profile on this GPU.
    #[error("GPU {gpu_index}: the driver offers no {profile} placement at slot {start}; it offers {offered}")]
    IllegalPlacement { gpu_index: u32, profile: String, start: u8, offered: String },
    /// Every GPU-instance id of the GPU is taken.
    #[error("GPU {gpu_index}: no free GPU-instance id")]
    NoFreeGiId { gpu_index: u32 },
}

impl BackendError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> BackendError {
        let path = path.into();
        move |source| BackendError::Io { path, source }
    }
}

/// Read `/proc/devices` (or the simulator's copy) and pick the NVIDIA majors.
pub(crate) fn read_majors(
    path: &std::path::Path,
) -> Result<crate::inventory::Majors, BackendError> {
    let text = std::fs::read_to_string(path).map_err(BackendError::io(path))?;
    let devices = crate::inventory::parse_proc_devices(&text)
        .map_err(|source| BackendError::Parse { path: path.to_path_buf(), source })?;
    devices.majors().map_err(|e| BackendError::Inventory(format!("{}: {e}", path.display())))
}

/// Read a `mig-minors` file.
pub(crate) fn read_mig_minors(
    path: &std::path::Path,
) -> Result<crate::inventory::MigMinors, BackendError> {
    let text = std::fs::read_to_string(path).map_err(BackendError::io(path))?;
    crate::inventory::parse_mig_minors(&text)
        .map_err(|source| BackendError::Parse { path: path.to_path_buf(), source })
}

/// The GI and CI access cap minors of one MIG instance; a missing entry is an error, so
/// an inventory never carries a MIG instance a container could not be given.
pub(crate) fn cap_minors(
    minors: &crate::inventory::MigMinors,
    path: &std::path::Path,
    gpu_minor: u32,
    gi: u32,
    ci: u32,
) -> Result<(u32, u32), BackendError> {
    let missing = |key: String| {
        BackendError::Inventory(format!(
            "{}: no `{key}` entry for a MIG instance that exists",
            path.display()
        ))
    };
    let gi_minor = minors
        .get(gpu_minor, gi, None)
        .ok_or_else(|| missing(format!("gpu{gpu_minor}/gi{gi}/access")))?;
    let ci_minor = minors
        .get(gpu_minor, gi, Some(ci))
        .ok_or_else(|| missing(format!("gpu{gpu_minor}/gi{gi}/ci{ci}/access")))?;
    Ok((gi_minor, ci_minor))
}
