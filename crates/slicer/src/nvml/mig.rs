//! MIG changes and driver profile queries through the raw NVML functions.
//!
//! nvml-wrapper wraps none of the GPU/compute-instance calls, and its
//! `possible_placements()` always answers an empty list, so everything here goes through
//! `nvml-wrapper-sys`, taking each function as the `Result` field of the loaded library
//! (a missing symbol is an error, never a panic). Each raw call is wrapped once, in a
//! small function that owns its `unsafe` and maps the return code.
//!
//! Creating an instance: resolve the profile to NVML's profile enum (the catalog's
//! `nvml_id`, or the driver's own profile names for a model the catalog does not know),
//! read the driver's profile info (`nvmlDeviceGetGpuInstanceProfileInfo`) and the
//! placements it allows (`nvmlDeviceGetGpuInstancePossiblePlacements_v2`: the driver, not
//! the catalog, decides what is legal), create the GPU instance at the placement
//! (`nvmlDeviceCreateGpuInstanceWithPlacement`), then one compute instance spanning it
//! (`nvmlGpuInstanceGetComputeInstanceProfileInfo` + `nvmlGpuInstanceCreateComputeInstance`);
//! if the compute instance fails, the GPU instance is destroyed again. Destroying: the
//! compute instance (`nvmlComputeInstanceDestroy`), then the GPU instance
//! (`nvmlGpuInstanceDestroy`) unless other compute instances still live in it.
//!
//! Both need root. The driver refuses a destroy while processes use the instance
//! (`NVML_ERROR_IN_USE`); callers must not try (see [`crate::place`](mod@crate::place)).

use std::fmt;
use std::os::raw::c_uint;

use nvml_wrapper::error::{nvml_try, NvmlError};
use nvml_wrapper::Device;
use nvml_wrapper_sys::bindings::{
    nvmlComputeInstanceInfo_t, nvmlComputeInstanceProfileInfo_t, nvmlComputeInstance_t,
    nvmlGpuInstanceInfo_t, nvmlGpuInstancePlacement_t, nvmlGpuInstanceProfileInfo_t,
    nvmlGpuInstanceProfileInfo_v2_t, nvmlGpuInstance_t, NvmlLib,
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE,
    NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE, NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
    NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE, NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE,
    NVML_COMPUTE_INSTANCE_PROFILE_COUNT, NVML_DEVICE_MIG_ENABLE, NVML_GPU_INSTANCE_PROFILE_COUNT,
};

use super::{check, model_from_nvml_name, nvml_err, sym, NvmlBackend, MIB};
use crate::backend::BackendError;
use crate::catalog::{self, MEMORY_SLOTS};
use crate::inventory::MigInstance;

/// One GPU-instance profile of one GPU, as the driver describes it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DriverProfile {
    pub gpu_index: u32,
    /// Catalog model name, or the driver's name for a model the catalog does not know.
    pub model: String,
    /// NVML's profile enum (`NVML_GPU_INSTANCE_PROFILE_*`) this was asked as.
    pub nvml_id: u32,
    /// The driver's profile id (what `nvidia-smi mig -lgip` shows).
    pub id: u32,
    /// The driver's name without the `MIG ` prefix (e.g. `1g.10gb`); empty when the
    /// driver predates profile names.
    pub name: String,
    pub slice_count: u32,
    /// Most instances of this profile per GPU.
    pub instance_count: u32,
    pub memory_mib: u64,
    /// Allowed placements, `(start, size)` on the memory axis.
    pub placements: Vec<(u32, u32)>,
}

impl NvmlBackend {
    /// Every GPU-instance profile the driver supports on every MIG-capable GPU, with its
    /// possible placements. Read-only (safe on a lent machine). GPUs without MIG support
    /// contribute nothing; on GPUs whose MIG mode is off, drivers may answer nothing too.
    pub fn driver_profiles(&self) -> Result<Vec<DriverProfile>, BackendError> {
        let lib = self.nvml.lib();
        let count = self.nvml.device_count().map_err(nvml_err("nvmlDeviceGetCount"))?;
        let mut out = Vec::new();
        for index in 0..count {
            let dev =
                self.nvml.device_by_index(index).map_err(nvml_err("nvmlDeviceGetHandleByIndex"))?;
            let name = dev.name().map_err(nvml_err("nvmlDeviceGetName"))?;
            let memory =
                dev.memory_info().map_err(nvml_err("nvmlDeviceGetMemoryInfo"))?.total / MIB;
            let model = model_from_nvml_name(&name, memory);
            for nvml_id in 0..NVML_GPU_INSTANCE_PROFILE_COUNT {
                let Ok(info) = gi_profile_info(lib, &dev, nvml_id) else { continue };
                let placements = possible_placements(lib, &dev, info.id)?
                    .into_iter()
                    .map(|p| (p.start, p.size))
                    .collect();
                out.push(DriverProfile {
                    gpu_index: index,
                    model: model.clone(),
                    nvml_id,
                    id: info.id,
                    name: gi_profile_name(lib, &dev, nvml_id).unwrap_or_default(),
                    slice_count: info.sliceCount,
                    instance_count: info.instanceCount,
                    memory_mib: info.memorySizeMB,
                    placements,
                });
            }
        }
        Ok(out)
    }

    pub(super) fn create_mig(
        &self,
        gpu_index: u32,
        profile: &str,
        start: u8,
    ) -> Result<MigInstance, BackendError> {
        let lib = self.nvml.lib();
        let count = self.nvml.device_count().map_err(nvml_err("nvmlDeviceGetCount"))?;
        if gpu_index >= count {
            return Err(BackendError::NoSuchGpu(gpu_index));
        }
        let dev =
            self.nvml.device_by_index(gpu_index).map_err(nvml_err("nvmlDeviceGetHandleByIndex"))?;
        match dev.mig_mode() {
            Ok(m) if m.current == NVML_DEVICE_MIG_ENABLE => {}
            Ok(_) | Err(NvmlError::NotSupported) => {
                return Err(BackendError::MigDisabled { gpu_index })
            }
            Err(e) => return Err(nvml_err("nvmlDeviceGetMigMode")(e)),
        }
        let name = dev.name().map_err(nvml_err("nvmlDeviceGetName"))?;
        let memory = dev.memory_info().map_err(nvml_err("nvmlDeviceGetMemoryInfo"))?.total / MIB;
        let model = model_from_nvml_name(&name, memory);
        let nvml_id = profile_enum(lib, &dev, &model, profile).ok_or_else(|| {
            BackendError::IllegalPlacement {
                gpu_index,
                profile: profile.to_string(),
                start,
                offered: "no such profile on this GPU".into(),
            }
        })?;
        let info = gi_profile_info(lib, &dev, nvml_id)
            .map_err(nvml_err("nvmlDeviceGetGpuInstanceProfileInfo"))?;
        let placements = possible_placements(lib, &dev, info.id)?;
        let Some(placement) = placements.iter().copied().find(|p| p.start == u32::from(start))
        else {
            let offered: Vec<String> =
                placements.iter().map(|p| format!("{}:{}", p.start, p.size)).collect();
            return Err(BackendError::IllegalPlacement {
                gpu_index,
                profile: profile.to_string(),
                start,
                offered: format!("start:size {}", offered.join(", ")),
            });
        };
        let gi = create_gpu_instance(lib, &dev, info.id, &placement)?;
        let ci = match ci_profile_for(lib, gi, info.sliceCount)
            .and_then(|ci_profile| create_compute_instance(lib, gi, ci_profile.id))
        {
            Ok(ci) => ci,
            Err(e) => {
                // Roll back: leave no GPU instance without a compute instance behind.
                let _ = destroy_gpu_instance(lib, gi);
                return Err(e);
            }
        };
        let gi_id = gpu_instance_info(lib, gi)?.id;
        let ci_id = compute_instance_info(lib, ci)?.id;
        let mut minors = None;
        let gpu = self.gpu(gpu_index, &mut minors)?;
        gpu.instances
            .into_iter()
            .find(|i| i.gi_id == gi_id && i.ci_id == ci_id)
            .ok_or_else(|| {
                BackendError::Inventory(format!(
                    "GPU {gpu_index}: created GPU instance {gi_id} / compute instance {ci_id} but the driver does not list its MIG device"
                ))
            })
    }

    pub(super) fn destroy_mig(&self, uuid: &str) -> Result<(), BackendError> {
        let lib = self.nvml.lib();
        let count = self.nvml.device_count().map_err(nvml_err("nvmlDeviceGetCount"))?;
        for index in 0..count {
            let dev =
                self.nvml.device_by_index(index).map_err(nvml_err("nvmlDeviceGetHandleByIndex"))?;
            if !matches!(dev.mig_mode(), Ok(m) if m.current == NVML_DEVICE_MIG_ENABLE) {
                continue;
            }
            let max = dev.mig_device_count().map_err(nvml_err("nvmlDeviceGetMaxMigDeviceCount"))?;
            for j in 0..max {
                let mig = match dev.mig_device_by_index(j) {
                    Ok(m) => m,
                    Err(NvmlError::NotFound) => continue,
                    Err(e) => return Err(nvml_err("nvmlDeviceGetMigDeviceHandleByIndex")(e)),
                };
                if mig.uuid().map_err(nvml_err("nvmlDeviceGetUUID (MIG)"))? != uuid {
                    continue;
                }
                let (gi_id, ci_id) = mig_ids(lib, &mig)?;
                let gi = gpu_instance_by_id(lib, &dev, gi_id)?;
                let ci = compute_instance_by_id(lib, gi, ci_id)?;
                destroy_compute_instance(lib, ci)?;
                return match destroy_gpu_instance(lib, gi) {
                    // Other compute instances live in this GPU instance: it stays.
                    Err(NvmlError::InUse) => Ok(()),
                    other => other.map_err(nvml_err("nvmlGpuInstanceDestroy")),
                };
            }
        }
        Err(BackendError::NoSuchInstance(uuid.to_string()))
    }
}

/// NVML's profile enum for `profile` on this GPU: the catalog's, else the driver's name.
fn profile_enum(lib: &NvmlLib, dev: &Device<'_>, model: &str, profile: &str) -> Option<u32> {
    if let Some(p) = catalog::model(model).and_then(|m| m.profile(profile)) {
        return Some(p.nvml_id);
    }
    (0..NVML_GPU_INSTANCE_PROFILE_COUNT)
        .find(|&id| gi_profile_name(lib, dev, id).is_some_and(|n| n == profile))
}

fn gi_profile_info(
    lib: &NvmlLib,
    dev: &Device<'_>,
    nvml_id: u32,
) -> Result<nvmlGpuInstanceProfileInfo_t, NvmlError> {
    let get = lib
        .nvmlDeviceGetGpuInstanceProfileInfo
        .as_ref()
        .map_err(|e| NvmlError::FailedToLoadSymbol(e.to_string()))?;
    // SAFETY: nvmlGpuInstanceProfileInfo_t is a plain C struct of integers, for which
    // all-zero bytes are a valid value.
    let mut info: nvmlGpuInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: the device handle comes from this live Nvml (the library stays loaded while
    // `dev` borrows it) and `info` is a valid out-parameter of the v1 layout.
    nvml_try(unsafe { get(dev.handle(), nvml_id, &mut info) })?;
    Ok(info)
}

/// The driver's name of a profile (`1g.10gb`), from the v2 profile info; `None` where
/// the driver has no names or no such profile.
fn gi_profile_name(lib: &NvmlLib, dev: &Device<'_>, nvml_id: u32) -> Option<String> {
    let get = lib.nvmlDeviceGetGpuInstanceProfileInfoV.as_ref().ok()?;
    // SAFETY: nvmlGpuInstanceProfileInfo_v2_t is a plain C struct of integers and a char
    // array, for which all-zero bytes are a valid value.
    let mut info: nvmlGpuInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
    let size = u32::try_from(std::mem::size_of::<nvmlGpuInstanceProfileInfo_v2_t>()).unwrap_or(0);
    info.version = size | (2 << 24);
    // SAFETY: as in `gi_profile_info`; `info` is a valid, versioned out-parameter.
    nvml_try(unsafe { get(dev.handle(), nvml_id, &mut info) }).ok()?;
    let raw: Vec<u8> = info.name.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    let name = String::from_utf8_lossy(&raw);
    let name = name.strip_prefix("MIG ").unwrap_or(&name).trim().to_string();
    (!name.is_empty()).then_some(name)
}

/// The placements the driver allows for GPU-instance profile id `profile_id`.
fn possible_placements(
    lib: &NvmlLib,
    dev: &Device<'_>,
    profile_id: u32,
) -> Result<Vec<nvmlGpuInstancePlacement_t>, BackendError> {
    const CALL: &str = "nvmlDeviceGetGpuInstancePossiblePlacements_v2";
    let get = sym(&lib.nvmlDeviceGetGpuInstancePossiblePlacements_v2, CALL)?;
    let mut count: c_uint = 0;
    // SAFETY: a live device handle; a null placements pointer asks only for the count,
    // written to the valid out-pointer `count`.
    check(unsafe { get(dev.handle(), profile_id, std::ptr::null_mut(), &mut count) }, CALL)?;
    // Never trust a count past the axis twice over.
    let cap = usize::try_from(count).unwrap_or(0).min(usize::from(MEMORY_SLOTS) * 2);
    let mut buf = vec![nvmlGpuInstancePlacement_t { start: 0, size: 0 }; cap.max(1)];
    let mut n = c_uint::try_from(buf.len()).unwrap_or(0);
    // SAFETY: `buf` holds `n` placements (at least the `count` the driver just gave),
    // and stays alive and unaliased for the call; `n` is a valid out-pointer.
    check(unsafe { get(dev.handle(), profile_id, buf.as_mut_ptr(), &mut n) }, CALL)?;
    buf.truncate(usize::try_from(n).unwrap_or(0).min(cap));
    Ok(buf)
}

fn create_gpu_instance(
    lib: &NvmlLib,
    dev: &Device<'_>,
    profile_id: u32,
    placement: &nvmlGpuInstancePlacement_t,
) -> Result<nvmlGpuInstance_t, BackendError> {
    const CALL: &str = "nvmlDeviceCreateGpuInstanceWithPlacement";
    let create = sym(&lib.nvmlDeviceCreateGpuInstanceWithPlacement, CALL)?;
    let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
    // SAFETY: a live device handle, a valid placement read for the call, and a valid
    // out-pointer for the new GPU-instance handle.
    check(unsafe { create(dev.handle(), profile_id, placement, &mut gi) }, CALL)?;
    Ok(gi)
}

/// The compute-instance profile spanning a whole GPU instance of `slices` slices.
fn ci_profile_for(
    lib: &NvmlLib,
    gi: nvmlGpuInstance_t,
    slices: u32,
) -> Result<nvmlComputeInstanceProfileInfo_t, BackendError> {
    const CALL: &str = "nvmlGpuInstanceGetComputeInstanceProfileInfo";
    let get = sym(&lib.nvmlGpuInstanceGetComputeInstanceProfileInfo, CALL)?;
    let preferred = match slices {
        1 => Some(NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE),
        2 => Some(NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE),
        3 => Some(NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE),
        4 => Some(NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE),
        7 => Some(NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE),
        _ => None,
    };
    let others = (0..NVML_COMPUTE_INSTANCE_PROFILE_COUNT).filter(|p| Some(*p) != preferred);
    for profile in preferred.into_iter().chain(others) {
        // SAFETY: a plain C struct of integers: all-zero bytes are a valid value.
        let mut info: nvmlComputeInstanceProfileInfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `gi` is a GPU-instance handle the driver gave for a live device; `info`
        // is a valid out-parameter.
        let code =
            unsafe { get(gi, profile, NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, &mut info) };
        if nvml_try(code).is_ok() && info.sliceCount == slices {
            return Ok(info);
        }
    }
    Err(BackendError::Nvml {
        call: CALL.into(),
        message: format!("no compute-instance profile of {slices} slices in this GPU instance"),
    })
}

fn create_compute_instance(
    lib: &NvmlLib,
    gi: nvmlGpuInstance_t,
    ci_profile_id: u32,
) -> Result<nvmlComputeInstance_t, BackendError> {
    const CALL: &str = "nvmlGpuInstanceCreateComputeInstance";
    let create = sym(&lib.nvmlGpuInstanceCreateComputeInstance, CALL)?;
    let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
    // SAFETY: `gi` is a live GPU-instance handle; `ci` is a valid out-pointer.
    check(unsafe { create(gi, ci_profile_id, &mut ci) }, CALL)?;
    Ok(ci)
}

fn gpu_instance_info(
    lib: &NvmlLib,
    gi: nvmlGpuInstance_t,
) -> Result<nvmlGpuInstanceInfo_t, BackendError> {
    const CALL: &str = "nvmlGpuInstanceGetInfo";
    let get = sym(&lib.nvmlGpuInstanceGetInfo, CALL)?;
    // SAFETY: a plain C struct (a handle pointer and integers): all-zero bytes are valid.
    let mut info: nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: `gi` is a live GPU-instance handle; `info` is a valid out-parameter.
    check(unsafe { get(gi, &mut info) }, CALL)?;
    Ok(info)
}

fn compute_instance_info(
    lib: &NvmlLib,
    ci: nvmlComputeInstance_t,
) -> Result<nvmlComputeInstanceInfo_t, BackendError> {
    const CALL: &str = "nvmlComputeInstanceGetInfo_v2";
    let get = sym(&lib.nvmlComputeInstanceGetInfo_v2, CALL)?;
    // SAFETY: a plain C struct (handle pointers and integers): all-zero bytes are valid.
    let mut info: nvmlComputeInstanceInfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: `ci` is a live compute-instance handle; `info` is a valid out-parameter.
    check(unsafe { get(ci, &mut info) }, CALL)?;
    Ok(info)
}

/// The GPU-instance and compute-instance ids of a MIG device.
fn mig_ids(lib: &NvmlLib, mig: &Device<'_>) -> Result<(u32, u32), BackendError> {
    let get_gi = sym(&lib.nvmlDeviceGetGpuInstanceId, "nvmlDeviceGetGpuInstanceId")?;
    let get_ci = sym(&lib.nvmlDeviceGetComputeInstanceId, "nvmlDeviceGetComputeInstanceId")?;
    let (mut gi, mut ci): (c_uint, c_uint) = (0, 0);
    // SAFETY: `mig` is a live MIG device handle of this Nvml; `gi` is a valid out-pointer.
    check(unsafe { get_gi(mig.handle(), &mut gi) }, "nvmlDeviceGetGpuInstanceId")?;
    // SAFETY: as above; `ci` is a valid out-pointer.
    check(unsafe { get_ci(mig.handle(), &mut ci) }, "nvmlDeviceGetComputeInstanceId")?;
    Ok((gi, ci))
}

fn gpu_instance_by_id(
    lib: &NvmlLib,
    dev: &Device<'_>,
    id: u32,
) -> Result<nvmlGpuInstance_t, BackendError> {
    const CALL: &str = "nvmlDeviceGetGpuInstanceById";
    let get = sym(&lib.nvmlDeviceGetGpuInstanceById, CALL)?;
    let mut gi: nvmlGpuInstance_t = std::ptr::null_mut();
    // SAFETY: a live device handle; `gi` is a valid out-pointer. The handle needs no
    // release.
    check(unsafe { get(dev.handle(), id, &mut gi) }, CALL)?;
    Ok(gi)
}

fn compute_instance_by_id(
    lib: &NvmlLib,
    gi: nvmlGpuInstance_t,
    id: u32,
) -> Result<nvmlComputeInstance_t, BackendError> {
    const CALL: &str = "nvmlGpuInstanceGetComputeInstanceById";
    let get = sym(&lib.nvmlGpuInstanceGetComputeInstanceById, CALL)?;
    let mut ci: nvmlComputeInstance_t = std::ptr::null_mut();
    // SAFETY: `gi` is a live GPU-instance handle; `ci` is a valid out-pointer.
    check(unsafe { get(gi, id, &mut ci) }, CALL)?;
    Ok(ci)
}

fn destroy_compute_instance(lib: &NvmlLib, ci: nvmlComputeInstance_t) -> Result<(), BackendError> {
    const CALL: &str = "nvmlComputeInstanceDestroy";
    let destroy = sym(&lib.nvmlComputeInstanceDestroy, CALL)?;
    // SAFETY: `ci` is a live compute-instance handle, not used again after this call.
    check(unsafe { destroy(ci) }, CALL)
}

fn destroy_gpu_instance(lib: &NvmlLib, gi: nvmlGpuInstance_t) -> Result<(), NvmlError> {
    let destroy = lib
        .nvmlGpuInstanceDestroy
        .as_ref()
        .map_err(|e| NvmlError::FailedToLoadSymbol(e.to_string()))?;
    // SAFETY: `gi` is a live GPU-instance handle, not used again after this call.
    nvml_try(unsafe { destroy(gi) })
}

/// How the driver's profiles compare with the catalog, per GPU model.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct CatalogComparison {
    /// One line per profile checked: `ok …` or `DIFFERS …` / `ONLY IN …`.
    pub lines: Vec<String>,
    /// Number of lines that are not `ok`.
    pub differences: usize,
}

impl CatalogComparison {
    pub fn matches(&self) -> bool {
        self.differences == 0
    }
}

impl fmt::Display for CatalogComparison {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for l in &self.lines {
            writeln!(f, "{l}")?;
        }
        if self.lines.is_empty() {
            writeln!(
                f,
                "the driver reported no MIG profiles (no MIG-capable GPU, or MIG mode off)"
            )?;
        }
        write!(f, "{} difference(s) between the driver and the catalog", self.differences)
    }
}

/// Compare what the driver says about its profiles (from
/// [`NvmlBackend::driver_profiles`]) with the catalog: profile ids, slices, instance
/// limits, memory and placements, for the first GPU of each model. Pure: test it with
/// recorded driver answers.
pub fn compare_with_catalog(driver: &[DriverProfile]) -> CatalogComparison {
    let mut out = CatalogComparison::default();
    let mut seen_models: Vec<&str> = Vec::new();
    for d in driver {
        if seen_models.contains(&d.model.as_str()) {
            continue;
        }
        seen_models.push(&d.model);
        let gpu = d.gpu_index;
        let of_gpu: Vec<&DriverProfile> = driver.iter().filter(|p| p.gpu_index == gpu).collect();
        let Some(model) = catalog::model(&d.model) else {
            out.lines.push(format!(
                "GPU {gpu}: {} is not in the catalog; the driver offers {} profiles",
                d.model,
                of_gpu.len()
            ));
            out.differences += 1;
            continue;
        };
        for p in model.profiles {
            let Some(dp) = of_gpu.iter().find(|x| x.nvml_id == p.nvml_id) else {
                out.lines.push(format!("GPU {gpu} {model} {}: ONLY IN CATALOG (the driver does not offer NVML profile {})", p.name, p.nvml_id));
                out.differences += 1;
                continue;
            };
            let mut diffs = Vec::new();
            if !dp.name.is_empty() && dp.name != p.name {
                diffs.push(format!("name {} (catalog {})", dp.name, p.name));
            }
            if dp.id != p.smi_id {
                diffs.push(format!("id {} (catalog {})", dp.id, p.smi_id));
            }
            if dp.slice_count != u32::from(p.compute_slices) {
                diffs.push(format!("slices {} (catalog {})", dp.slice_count, p.compute_slices));
            }
            if dp.instance_count != u32::from(p.max_instances) {
                diffs.push(format!(
                    "max instances {} (catalog {})",
                    dp.instance_count, p.max_instances
                ));
            }
            if dp.memory_mib != p.memory_mib {
                diffs.push(format!("memory {} MiB (catalog {})", dp.memory_mib, p.memory_mib));
            }
            let mut driver_pl: Vec<(u32, u32)> = dp.placements.clone();
            driver_pl.sort_unstable();
            let catalog_pl: Vec<(u32, u32)> =
                p.starts.iter().map(|&s| (u32::from(s), u32::from(p.size))).collect();
            if driver_pl != catalog_pl {
                let show = |v: &[(u32, u32)]| {
                    v.iter().map(|(s, n)| format!("{s}:{n}")).collect::<Vec<_>>().join(",")
                };
                diffs.push(format!(
                    "placements {} (catalog {})",
                    show(&driver_pl),
                    show(&catalog_pl)
                ));
            }
            if diffs.is_empty() {
                out.lines.push(format!("GPU {gpu} {model} {}: ok", p.name));
            } else {
                out.differences += 1;
                out.lines.push(format!(
                    "GPU {gpu} {model} {}: DIFFERS: {}",
                    p.name,
                    diffs.join("; ")
                ));
            }
        }
        for dp in of_gpu.iter().filter(|x| model.profiles.iter().all(|p| p.nvml_id != x.nvml_id)) {
            out.lines.push(format!(
                "GPU {gpu} {model} {}: ONLY IN DRIVER (NVML profile {}, id {}, {} slices, {} MiB)",
                if dp.name.is_empty() { "?" } else { &dp.name },
                dp.nvml_id,
                dp.id,
                dp.slice_count,
                dp.memory_mib
            ));
            out.differences += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recorded_h100() -> Vec<DriverProfile> {
        let m = catalog::model("H100-80GB").expect("h100");
        m.profiles
            .iter()
            .map(|p| DriverProfile {
                gpu_index: 0,
                model: m.name.into(),
                nvml_id: p.nvml_id,
                id: p.smi_id,
                name: p.name.into(),
                slice_count: u32::from(p.compute_slices),
                instance_count: u32::from(p.max_instances),
                memory_mib: p.memory_mib,
                placements: p.starts.iter().map(|&s| (u32::from(s), u32::from(p.size))).collect(),
            })
            .collect()
    }

    /// What `NvmlBackend::driver_profiles` returned on an H100 80GB HBM3, driver
    /// 580.159.04, MIG disabled (2026-11-28, `scripts/gpu-checks.sh` step 02, docs/GPU.md):
    /// the catalog matches it. (Before that run the catalog held the A100-80GB memory
    /// figures for the H100, and this recording showed 7 differences.)
    #[test]
    fn the_catalog_matches_what_an_h100_driver_reported() {
        let recorded: Vec<DriverProfile> =
            serde_json::from_str(include_str!("recorded/h100-80gb-hbm3-driver-580.159.04.json"))
                .expect("the recording parses");
        assert_eq!(recorded.len(), 7);
        let c = compare_with_catalog(&recorded);
        assert!(c.matches(), "{c}");
    }

    #[test]
    fn comparison_of_a_matching_driver_is_clean() {
        let mut d = recorded_h100();
        // A second GPU of the same model is not compared again.
        let mut second = d.clone();
        for p in &mut second {
            p.gpu_index = 1;
            p.memory_mib = 1;
        }
        d.extend(second);
        let c = compare_with_catalog(&d);
        assert!(c.matches(), "{c}");
        assert_eq!(c.lines.len(), 7);
        assert!(c.to_string().ends_with("0 difference(s) between the driver and the catalog"));
    }

    #[test]
    fn comparison_names_every_difference() {
        let mut d = recorded_h100();
        d[0].memory_mib = 10240;
        d[4].placements = vec![(4, 4), (0, 4)]; // order does not matter
        d[3].placements = vec![(0, 2), (2, 2), (4, 2), (6, 2)];
        d.remove(1); // the driver lacks +me
        d.push(DriverProfile {
            gpu_index: 0,
            model: "H100-80GB".into(),
            nvml_id: 10,
            id: 47,
            name: "1g.10gb+gfx".into(),
            slice_count: 1,
            instance_count: 7,
            memory_mib: 9856,
            placements: vec![],
        });
        let c = compare_with_catalog(&d);
        let text = c.to_string();
        assert_eq!(c.differences, 4, "{text}");
        assert!(text.contains("1g.10gb: DIFFERS: memory 10240 MiB (catalog 9984)"), "{text}");
        assert!(text.contains("1g.10gb+me: ONLY IN CATALOG"), "{text}");
        assert!(
            text.contains("2g.20gb: DIFFERS: placements 0:2,2:2,4:2,6:2 (catalog 0:2,2:2,4:2)"),
            "{text}"
        );
        assert!(text.contains("3g.40gb: ok"), "{text}");
        assert!(text.contains("1g.10gb+gfx: ONLY IN DRIVER (NVML profile 10, id 47"), "{text}");
        assert!(compare_with_catalog(&[]).to_string().contains("reported no MIG profiles"));
    }
}
