//! The real backend: the NVIDIA driver through NVML (nvml-wrapper, which loads
//! `libnvidia-ml.so.1` at run time, so this builds everywhere and fails cleanly where
//! there is no driver).
//!
//! It creates and destroys MIG instances only when asked ([`GpuBackend::create_instance`],
//! [`GpuBackend::destroy_instance`], in [`mig`]); it never changes MIG mode and never
//! resets a GPU. [`NvmlBackend::driver_profiles`] and [`compare_with_catalog`] are
//! read-only.
//!
//! nvml-wrapper does not wrap MIG GPU-instance queries, so those go through the raw
//! `nvml-wrapper-sys` functions, taken as the `Result` fields of the loaded library (the
//! method forms panic on a missing symbol) and wrapped once here.

mod faults;
pub mod mig;
mod telemetry;
pub mod topology;

pub use mig::{compare_with_catalog, CatalogComparison, DriverProfile};

use std::fmt::Display;
use std::os::raw::c_uint;
use std::path::{Path, PathBuf};

use nvml_wrapper::error::{nvml_try, NvmlError};
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::{
    nvmlGpuInstanceInfo_t, nvmlGpuInstanceProfileInfo_v2_t, nvmlGpuInstance_t, nvmlReturn_t,
    NvmlLib, NVML_DEVICE_MIG_ENABLE, NVML_GPU_INSTANCE_PROFILE_COUNT,
};

use crate::backend::{cap_minors, read_majors, read_mig_minors, BackendError, GpuBackend};
use crate::catalog;
use crate::inventory::{parse_device_minor, Gpu, Inventory, MigInstance, MigMinors};

/// Where the driver's proc directory normally is.
pub const DEFAULT_PROC_DRIVER_DIR: &str = "/proc/driver/nvidia";
/// Where the kernel lists device majors.
pub const DEFAULT_PROC_DEVICES: &str = "/proc/devices";
/// Where the driver lists MIG capability minors (`<proc driver dir>-caps/mig-minors`).
pub const DEFAULT_MIG_MINORS: &str = "/proc/driver/nvidia-caps/mig-minors";

const MIB: u64 = 1024 * 1024;

/// The NVML backend. Holds the loaded library; every [`GpuBackend::inventory`] call asks
/// the driver afresh.
#[derive(Debug)]
pub struct NvmlBackend {
    /// Leaked at open: the library stays loaded for the life of the process, so the event
    /// set and GPM samples kept here may borrow it for `'static`.
    nvml: &'static Nvml,
    /// The XID event set, created on the first read (`nvml/faults.rs`).
    events: std::sync::Mutex<Option<nvml_wrapper::event::EventSet<'static>>>,
    /// The last GPM sample of each device (`nvml/telemetry.rs`).
    gpm: telemetry::GpmSamples,
    node: String,
    /// The driver's user-space files, found once at start (`ldconfig -p`).
    driver_mounts: Vec<tessera_api::BindMount>,
    proc_driver_dir: PathBuf,
    proc_devices: PathBuf,
    mig_minors: PathBuf,
}

impl NvmlBackend {
    /// Load NVML and talk to the driver. `proc_driver_dir` is normally
    /// `/proc/driver/nvidia`, `proc_devices` `/proc/devices`, `mig_minors`
    /// `/proc/driver/nvidia-caps/mig-minors`. Without a driver this is
    /// [`BackendError::NoDriver`], never a panic.
    pub fn open(
        proc_driver_dir: &Path,
        proc_devices: &Path,
        mig_minors: &Path,
    ) -> Result<Self, BackendError> {
        if !proc_driver_dir.is_dir() {
            return Err(BackendError::NoDriver(format!(
                "{} does not exist: the NVIDIA kernel module is not loaded",
                proc_driver_dir.display()
            )));
        }
        let nvml: &'static Nvml = Box::leak(Box::new(Nvml::init().map_err(init_error)?));
        let bin_dirs: Vec<PathBuf> =
            ["/usr/bin", "/usr/local/bin", "/usr/sbin", "/bin"].iter().map(PathBuf::from).collect();
        let driver_mounts = crate::driver::discover(Path::new("/sbin/ldconfig"), &bin_dirs);
        Ok(NvmlBackend {
            nvml,
            events: std::sync::Mutex::new(None),
            gpm: std::sync::Mutex::new(std::collections::HashMap::new()),
            node: hostname(),
            driver_mounts,
            proc_driver_dir: proc_driver_dir.to_path_buf(),
            proc_devices: proc_devices.to_path_buf(),
            mig_minors: mig_minors.to_path_buf(),
        })
    }

    /// [`NvmlBackend::open`] on the host's usual paths ([`DEFAULT_PROC_DRIVER_DIR`],
    /// [`DEFAULT_PROC_DEVICES`], [`DEFAULT_MIG_MINORS`]).
    pub fn open_default() -> Result<Self, BackendError> {
        Self::open(
            Path::new(DEFAULT_PROC_DRIVER_DIR),
            Path::new(DEFAULT_PROC_DEVICES),
            Path::new(DEFAULT_MIG_MINORS),
        )
    }

    /// Report `node` as the node name instead of the host name.
    pub fn with_node_name(mut self, node: impl Into<String>) -> Self {
        self.node = node.into();
        self
    }

    fn gpu(&self, index: u32, minors: &mut Option<MigMinors>) -> Result<Gpu, BackendError> {
        let dev =
            self.nvml.device_by_index(index).map_err(nvml_err("nvmlDeviceGetHandleByIndex"))?;
        let uuid = dev.uuid().map_err(nvml_err("nvmlDeviceGetUUID"))?;
        let name = dev.name().map_err(nvml_err("nvmlDeviceGetName"))?;
        let memory_mib =
            dev.memory_info().map_err(nvml_err("nvmlDeviceGetMemoryInfo"))?.total / MIB;
        let minor = match dev.minor_number() {
            Ok(m) => m,
            Err(e) => self.minor_from_proc(&dev).map_err(|proc_err| BackendError::Nvml {
                call: "nvmlDeviceGetMinorNumber".into(),
                message: format!("{e}; and from {}: {proc_err}", self.proc_driver_dir.display()),
            })?,
        };
        let mig_enabled = match dev.mig_mode() {
            Ok(mode) => mode.current == NVML_DEVICE_MIG_ENABLE,
            Err(NvmlError::NotSupported) => false,
            Err(e) => return Err(nvml_err("nvmlDeviceGetMigMode")(e)),
        };
        let model = model_from_nvml_name(&name, memory_mib);
        let mut instances = Vec::new();
        if mig_enabled {
            let lib = self.nvml.lib();
            let profiles = gi_profiles(lib, &dev);
            let max = dev.mig_device_count().map_err(nvml_err("nvmlDeviceGetMaxMigDeviceCount"))?;
            for j in 0..max {
                let mig = match dev.mig_device_by_index(j) {
                    Ok(m) => m,
                    Err(NvmlError::NotFound) => continue,
                    Err(e) => return Err(nvml_err("nvmlDeviceGetMigDeviceHandleByIndex")(e)),
                };
                if minors.is_none() {
                    *minors = Some(read_mig_minors(&self.mig_minors)?);
                }
                let Some(minors) = minors.as_ref() else { continue };
                instances.push(mig_instance(
                    lib,
                    &dev,
                    &mig,
                    &model,
                    minor,
                    &profiles,
                    minors,
                    &self.mig_minors,
                )?);
            }
            instances.sort_by_key(|i| (i.start, i.gi_id, i.ci_id));
        }
        Ok(Gpu { index, uuid, model, minor, memory_mib, mig_enabled, instances })
    }

    /// "Device Minor" of `<proc_driver_dir>/gpus/<bus id>/information`.
    fn minor_from_proc(&self, dev: &Device<'_>) -> Result<u32, String> {
        let pci = dev.pci_info().map_err(|e| format!("nvmlDeviceGetPciInfo: {e}"))?;
        let bus = format!("{:04x}:{:02x}:{:02x}.0", pci.domain, pci.bus, pci.device);
        let path = self.proc_driver_dir.join("gpus").join(bus).join("information");
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        parse_device_minor(&text).map_err(|e| format!("{}: {e}", path.display()))
    }
}

impl GpuBackend for NvmlBackend {
    fn describe(&self) -> String {
        "nvml".into()
    }

    fn driver_mounts(&self) -> Vec<tessera_api::BindMount> {
        self.driver_mounts.clone()
    }

    fn xid_events(&self) -> Result<Vec<crate::xid::XidEvent>, BackendError> {
        self.read_xids()
    }

    fn device_health(&self, uuid: &str) -> Result<Option<String>, BackendError> {
        self.health_of(uuid)
    }

    fn topology(&self) -> Result<crate::topology::Topology, BackendError> {
        self.read_topology()
    }

    fn device_telemetry(
        &self,
        gpu_uuid: &str,
    ) -> Result<Vec<crate::telemetry::DeviceTelemetry>, BackendError> {
        self.read_device_telemetry(gpu_uuid)
    }

    fn process_telemetry(
        &self,
        gpu_uuid: &str,
        since_us: u64,
    ) -> Result<Option<Vec<crate::telemetry::ProcessTelemetry>>, BackendError> {
        self.read_process_telemetry(gpu_uuid, since_us)
    }

    fn uncorrectable_ecc_errors(&self, gpu_uuid: &str) -> Result<Option<u64>, BackendError> {
        use nvml_wrapper::enum_wrappers::device::{EccCounter, MemoryError};
        let dev =
            self.nvml.device_by_uuid(gpu_uuid).map_err(nvml_err("nvmlDeviceGetHandleByUUID"))?;
        match dev.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile) {
            Ok(n) => Ok(Some(n)),
            Err(NvmlError::NotSupported) => Ok(None),
            Err(e) => Err(nvml_err("nvmlDeviceGetTotalEccErrors")(e)),
        }
    }

    fn process_utilization(
        &self,
        gpu_uuid: &str,
        since_us: u64,
    ) -> Result<Option<Vec<crate::backend::ProcessUtil>>, BackendError> {
        let dev =
            self.nvml.device_by_uuid(gpu_uuid).map_err(nvml_err("nvmlDeviceGetHandleByUUID"))?;
        // Under MIG, NVML has no per-process accounting: say "not available", not "idle".
        if let Ok(mode) = dev.mig_mode() {
            if mode.current == nvml_wrapper_sys::bindings::NVML_DEVICE_MIG_ENABLE {
                return Ok(None);
            }
        }
        match dev.process_utilization_stats(since_us) {
            Ok(samples) => Ok(Some(
                samples
                    .into_iter()
                    .map(|s| crate::backend::ProcessUtil {
                        pid: s.pid,
                        sm_percent: s.sm_util,
                        timestamp_us: s.timestamp,
                    })
                    .collect(),
            )),
            Err(NvmlError::NotSupported) => Ok(None),
            Err(e) => Err(nvml_err("nvmlDeviceGetProcessUtilization")(e)),
        }
    }

    fn inventory(&self) -> Result<Inventory, BackendError> {
        let majors = read_majors(&self.proc_devices)?;
        let count = self.nvml.device_count().map_err(nvml_err("nvmlDeviceGetCount"))?;
        let mut minors = None;
        let gpus = (0..count).map(|i| self.gpu(i, &mut minors)).collect::<Result<Vec<_>, _>>()?;
        Ok(Inventory { node: self.node.clone(), gpus, majors })
    }

    fn create_instance(
        &self,
        gpu_index: u32,
        profile: &str,
        start: u8,
    ) -> Result<MigInstance, BackendError> {
        self.create_mig(gpu_index, profile, start)
    }

    fn destroy_instance(&self, uuid: &str) -> Result<(), BackendError> {
        self.destroy_mig(uuid)
    }
}

/// The catalog model of a GPU NVML calls `name` with `memory_mib` of memory, or `name`
/// itself when the catalog has no such model.
pub fn model_from_nvml_name(name: &str, memory_mib: u64) -> String {
    let upper = name.to_ascii_uppercase();
    let model = if upper.contains("H200") {
        Some("H200-141GB")
    } else if upper.contains("H100") && memory_mib <= 82 * 1024 {
        // H100 NVL (94 GB) has other profiles: not in the catalog.
        Some("H100-80GB")
    } else if upper.contains("A100") && memory_mib >= 60 * 1024 {
        Some("A100-80GB")
    } else if upper.contains("A100") && memory_mib >= 30 * 1024 {
        Some("A100-40GB")
    } else {
        None
    };
    model.map_or_else(|| name.to_string(), str::to_string)
}

/// What the driver says about one GPU-instance profile id.
#[derive(Debug, Clone)]
struct GiProfile {
    id: u32,
    name: String,
}

fn init_error(e: NvmlError) -> BackendError {
    match e {
        NvmlError::LibloadingError(e) => {
            BackendError::NoDriver(format!("cannot load libnvidia-ml.so.1 ({e}); is the NVIDIA driver installed?"))
        }
        NvmlError::DriverNotLoaded => BackendError::NoDriver("NVML says the NVIDIA kernel driver is not running".into()),
        NvmlError::LibRmVersionMismatch => {
            BackendError::NoDriver("libnvidia-ml and the kernel driver are different versions (reboot or reload the driver)".into())
        }
        NvmlError::FailedToLoadSymbol(s) => BackendError::NoDriver(format!("libnvidia-ml lacks nvmlInit_v2: {s}")),
        other => BackendError::Nvml { call: "nvmlInit_v2".into(), message: other.to_string() },
    }
}

fn nvml_err(call: &'static str) -> impl FnOnce(NvmlError) -> BackendError {
    move |e| BackendError::Nvml { call: call.into(), message: e.to_string() }
}

/// A raw function of the loaded library, or an error naming it.
fn sym<'a, T, E: Display>(
    field: &'a Result<T, E>,
    call: &'static str,
) -> Result<&'a T, BackendError> {
    field.as_ref().map_err(|e| BackendError::Nvml {
        call: call.into(),
        message: format!("symbol missing: {e}"),
    })
}

fn check(code: nvmlReturn_t, call: &'static str) -> Result<(), BackendError> {
    nvml_try(code).map_err(nvml_err(call))
}

/// Every GPU-instance profile the driver offers on `dev`, with the driver's names.
/// Empty if the driver cannot say (older drivers): callers fall back to the catalog.
fn gi_profiles(lib: &NvmlLib, dev: &Device<'_>) -> Vec<GiProfile> {
    let Ok(get) =
        sym(&lib.nvmlDeviceGetGpuInstanceProfileInfoV, "nvmlDeviceGetGpuInstanceProfileInfoV")
    else {
        return Vec::new();
    };
    let size = u32::try_from(std::mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>()).unwrap_or(0);
    let mut out = Vec::new();
    for profile in 0..NVML_GPU_INSTANCE_PROFILE_COUNT {
        // SAFETY: nvmlGpuInstanceProfileInfo_v2_t is a plain C struct of integers and a
        // char array, for which all-zero bytes are a valid value.
        let mut info: nvmlGpuInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
        info.version = size | (2 << 24);
        // SAFETY: the device handle comes from this live Nvml (the library stays loaded
        // while `dev` borrows it) and `info` is a valid, versioned out-parameter.
        let code = unsafe { get(dev.handle(), profile, &mut info) };
        if nvml_try(code).is_err() {
            continue; // this profile is not supported on this GPU
        }
        let raw: Vec<u8> = info.name.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
        let name = String::from_utf8_lossy(&raw);
        let name = name.strip_prefix("MIG ").unwrap_or(&name).trim().to_string();
        if !name.is_empty() {
            out.push(GiProfile { id: info.id, name });
        }
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn mig_instance(
    lib: &NvmlLib,
    parent: &Device<'_>,
    mig: &Device<'_>,
    model: &str,
    gpu_minor: u32,
    profiles: &[GiProfile],
    minors: &MigMinors,
    minors_path: &Path,
) -> Result<MigInstance, BackendError> {
    let uuid = mig.uuid().map_err(nvml_err("nvmlDeviceGetUUID (MIG)"))?;
    let memory_mib =
        mig.memory_info().map_err(nvml_err("nvmlDeviceGetMemoryInfo (MIG)"))?.total / MIB;

    let get_gi_id = sym(&lib.nvmlDeviceGetGpuInstanceId, "nvmlDeviceGetGpuInstanceId")?;
    let mut gi_id: c_uint = 0;
    // SAFETY: `mig` is a live MIG device handle of this Nvml; `gi_id` is a valid out-pointer.
    check(unsafe { get_gi_id(mig.handle(), &mut gi_id) }, "nvmlDeviceGetGpuInstanceId")?;

    let get_ci_id = sym(&lib.nvmlDeviceGetComputeInstanceId, "nvmlDeviceGetComputeInstanceId")?;
    let mut ci_id: c_uint = 0;
    // SAFETY: as above; `ci_id` is a valid out-pointer.
    check(unsafe { get_ci_id(mig.handle(), &mut ci_id) }, "nvmlDeviceGetComputeInstanceId")?;

    let get_gi = sym(&lib.nvmlDeviceGetGpuInstanceById, "nvmlDeviceGetGpuInstanceById")?;
    let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
    // SAFETY: `parent` is a live GPU handle of this Nvml; `gi` is a valid out-pointer. The
    // GPU-instance handle needs no release.
    let code = unsafe { get_gi(parent.handle(), gi_id, &mut gi) };
    check(code, "nvmlDeviceGetGpuInstanceById (needs root)")?;

    let get_info = sym(&lib.nvmlGpuInstanceGetInfo, "nvmlGpuInstanceGetInfo")?;
    // SAFETY: nvmlGpuInstanceInfo_t is a plain C struct (a handle pointer and integers) for
    // which all-zero bytes are a valid value.
    let mut info: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: `gi` was just returned by the driver for a live parent; `info` is a valid
    // out-pointer.
    check(unsafe { get_info(gi, &mut info) }, "nvmlGpuInstanceGetInfo")?;

    let placement = |v: c_uint| {
        u8::try_from(v).map_err(|_| BackendError::Nvml {
            call: "nvmlGpuInstanceGetInfo".into(),
            message: format!("placement {v} of GI {gi_id} is off the memory axis"),
        })
    };
    let start = placement(info.placement.start)?;
    let size = placement(info.placement.size)?;
    let slices = mig.attributes().map(|a| a.gpu_instance_slice_count).unwrap_or(0);
    let profile = profile_name(model, info.profileId, profiles, slices, size, memory_mib);
    let (gi_cap_minor, ci_cap_minor) = cap_minors(minors, minors_path, gpu_minor, gi_id, ci_id)?;
    Ok(MigInstance {
        uuid,
        profile,
        gi_id,
        ci_id,
        start,
        size,
        memory_mib,
        gi_cap_minor,
        ci_cap_minor,
    })
}

/// The profile name of a GPU instance: the driver's own name if it gave one, else the
/// catalog's for this profile id, else the catalog profile with the same compute slices
/// and size, else `<slices>g.<GiB rounded up>gb`.
fn profile_name(
    model: &str,
    profile_id: u32,
    driver: &[GiProfile],
    slices: u32,
    size: u8,
    memory_mib: u64,
) -> String {
    if let Some(p) = driver.iter().find(|p| p.id == profile_id) {
        return p.name.clone();
    }
    if let Some(m) = catalog::model(model) {
        if let Some(p) = m.profile_by_smi_id(profile_id) {
            return p.name.to_string();
        }
        if let Some(p) = m.profiles.iter().find(|p| {
            u32::from(p.compute_slices) == slices && p.size == size && !p.is_media_extension()
        }) {
            return p.name.to_string();
        }
    }
    format!("{slices}g.{}gb", memory_mib.div_ceil(1024))
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is a writable buffer of the length passed; gethostname writes at most
    // that many bytes.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "localhost".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_nvml_names_to_catalog_models() {
        assert_eq!(model_from_nvml_name("NVIDIA H100 80GB HBM3", 81559), "H100-80GB");
        assert_eq!(model_from_nvml_name("NVIDIA H100 PCIe", 81559), "H100-80GB");
        assert_eq!(model_from_nvml_name("NVIDIA H100 NVL", 95830), "NVIDIA H100 NVL");
        assert_eq!(model_from_nvml_name("NVIDIA H200", 143771), "H200-141GB");
        assert_eq!(model_from_nvml_name("NVIDIA A100-SXM4-40GB", 40960), "A100-40GB");
        assert_eq!(model_from_nvml_name("NVIDIA A100-PCIE-40GB", 40536), "A100-40GB");
        assert_eq!(model_from_nvml_name("NVIDIA A100-SXM4-80GB", 81920), "A100-80GB");
        assert_eq!(model_from_nvml_name("NVIDIA A100 80GB PCIe", 81920), "A100-80GB");
        assert_eq!(model_from_nvml_name("Tesla T4", 15360), "Tesla T4");
    }

    #[test]
    fn profile_names_fall_back_to_the_catalog() {
        let driver = [GiProfile { id: 19, name: "1g.10gb".into() }];
        assert_eq!(profile_name("H100-80GB", 19, &driver, 1, 1, 9856), "1g.10gb");
        assert_eq!(profile_name("H100-80GB", 9, &[], 3, 4, 40192), "3g.40gb");
        assert_eq!(profile_name("A100-40GB", 99, &[], 2, 2, 9856), "2g.10gb");
        assert_eq!(profile_name("Tesla X", 99, &[], 2, 2, 9856), "2g.10gb");
    }

    #[test]
    fn open_fails_cleanly_without_a_driver() {
        // The host's real paths: this machine has no NVIDIA driver.
        let err = NvmlBackend::open_default();
        if Path::new(DEFAULT_PROC_DRIVER_DIR).exists() {
            eprintln!("a driver is present; skipping the driverless assertion");
            return;
        }
        let err = err.expect_err("no driver here");
        assert!(matches!(err, BackendError::NoDriver(_)), "{err}");
        assert!(err.to_string().starts_with("no NVIDIA driver: "), "{err}");

        // A proc dir that exists gets as far as loading libnvidia-ml, which fails cleanly.
        let dir = tempfile::tempdir().expect("tempdir");
        let err = NvmlBackend::open(
            dir.path(),
            &dir.path().join("devices"),
            &dir.path().join("mig-minors"),
        )
        .expect_err("no libnvidia-ml here");
        assert!(matches!(err, BackendError::NoDriver(_) | BackendError::Nvml { .. }), "{err}");
    }

    /// Read-only; run where a GPU is lent:
    /// `cargo test -p slicer -- --ignored --nocapture nvml_driver_profiles`.
    #[test]
    #[ignore = "needs an NVIDIA GPU and driver"]
    fn nvml_driver_profiles_against_the_catalog() {
        let backend = NvmlBackend::open_default().expect("open nvml");
        let profiles = backend.driver_profiles().expect("driver profiles");
        println!("{}", serde_json::to_string_pretty(&profiles).expect("json"));
        println!("{}", compare_with_catalog(&profiles));
    }

    /// Issue 26, read-only; run where a GPU is lent:
    /// `cargo test -p slicer -- --ignored --nocapture nvml_telemetry_topology_and_events`.
    /// Two telemetry reads 1 s apart (the second has GPM figures on Hopper), per-process
    /// utilisation, the topology, each device's health, and the XID event set drained for
    /// 2 s (registration is read-only; nothing is injected).
    #[test]
    #[ignore = "needs an NVIDIA GPU and driver"]
    fn nvml_telemetry_topology_and_events() {
        let backend = NvmlBackend::open_default().expect("open nvml");
        let inv = backend.inventory().expect("inventory");
        let topo = backend.topology().expect("topology");
        println!("topology: {}", serde_json::to_string_pretty(&topo).expect("json"));
        for gpu in &inv.gpus {
            let first = backend.device_telemetry(&gpu.uuid).expect("telemetry");
            println!("first read: {}", serde_json::to_string(&first).expect("json"));
        }
        std::thread::sleep(std::time::Duration::from_secs(1));
        for gpu in &inv.gpus {
            let t = backend.device_telemetry(&gpu.uuid).expect("telemetry");
            println!("{}: {}", gpu.uuid, serde_json::to_string_pretty(&t).expect("json"));
            assert!(!t.is_empty() && t[0].uuid == gpu.uuid);
            let p = backend.process_telemetry(&gpu.uuid, 0).expect("processes");
            println!("{} processes: {p:?}", gpu.uuid);
            println!(
                "{} health: {:?}",
                gpu.uuid,
                backend.device_health(&gpu.uuid).expect("health")
            );
            for i in &gpu.instances {
                println!(
                    "{} health: {:?}",
                    i.uuid,
                    backend.device_health(&i.uuid).expect("health")
                );
            }
        }
        let mut events = Vec::new();
        for _ in 0..20 {
            events.extend(backend.xid_events().expect("xid events"));
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        println!("XID events in 2 s: {events:?}");
    }

    /// Run on a machine with a GPU: `cargo test -p slicer -- --ignored --nocapture nvml_prints`.
    #[test]
    #[ignore = "needs an NVIDIA GPU and driver"]
    fn nvml_prints_the_inventory() {
        let backend = NvmlBackend::open_default().expect("open nvml");
        let inv = backend.inventory().expect("inventory");
        println!("{}", serde_json::to_string_pretty(&inv).expect("json"));
        assert!(!inv.gpus.is_empty());
        for gpu in &inv.gpus {
            assert!(gpu.uuid.starts_with("GPU-"), "{}", gpu.uuid);
            for i in &gpu.instances {
                assert!(i.uuid.starts_with("MIG-"), "{}", i.uuid);
            }
        }
    }
}
