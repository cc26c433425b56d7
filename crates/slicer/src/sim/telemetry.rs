//! Simulated telemetry: what each process on a simulated device demands, and what it gets
//! from the contention model (`interference::contention`), in files under
//! `<state_dir>/sim/`:
//!
//! - `load/<device uuid>.json`: `[{"pid": 123, "sm": 0.25, "bw": 0.5}, ...]`, the SM and
//!   memory-bandwidth demand of each process on the device (a GPU, or a MIG instance: the
//!   fractions are of the instance), as whatever plays the workload writes it
//!   ([`set_load`]). Absent: nothing runs there.
//! - `mps-caps/<device uuid>.json`: `{"123": 25, ...}`, the MPS active thread percentage
//!   each process runs under. On hardware the MPS server enforces it; here tesserad writes
//!   what its supervisor read back from the control daemon
//!   ([`GpuBackend::model_mps_caps`](crate::GpuBackend::model_mps_caps)), and the model
//!   applies it. A process without an entry has no cap.
//!
//! Power is modelled as `70 W + 630 W x (0.6 SM + 0.4 bandwidth)` with `sw_power_cap` at
//! 690 W and above; clocks are the H100's maxima. Illustrative only: nothing judges them.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use interference::contention::{device_activity, share_device, Achieved, Demand, Load};
use serde::{Deserialize, Serialize};

use crate::backend::BackendError;
use crate::telemetry::{throttle_names, DeviceTelemetry, Source};

/// The most processes one load file may list.
pub const MAX_LOAD_ENTRIES: usize = 1024;

/// One process's demand on a simulated device.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadEntry {
    pub pid: u32,
    /// SM demand, 0..=1 of the device.
    pub sm: f64,
    /// Memory-bandwidth demand, 0..=1 of the device.
    pub bw: f64,
}

fn safe(uuid: &str) -> String {
    uuid.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect()
}

fn load_path(sim_dir: &Path, uuid: &str) -> PathBuf {
    sim_dir.join("load").join(format!("{}.json", safe(uuid)))
}

fn caps_path(sim_dir: &Path, uuid: &str) -> PathBuf {
    sim_dir.join("mps-caps").join(format!("{}.json", safe(uuid)))
}

/// Write the load of device `uuid` on the simulated node in `state_dir` (empty: remove).
pub fn set_load(state_dir: &Path, uuid: &str, load: &[LoadEntry]) -> Result<(), BackendError> {
    let path = load_path(&state_dir.join("sim"), uuid);
    if load.is_empty() {
        return match fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(BackendError::Io { path, source: e })
            }
            _ => Ok(()),
        };
    }
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).map_err(BackendError::io(dir))?;
    }
    let json = serde_json::to_vec(load)
        .map_err(|e| BackendError::Json { path: path.clone(), message: e.to_string() })?;
    super::write_atomic(&path, &json)
}

/// The load of device `uuid`, checked; `None` when it has no load file.
pub(super) fn read_load(
    sim_dir: &Path,
    uuid: &str,
) -> Result<Option<Vec<LoadEntry>>, BackendError> {
    let path = load_path(sim_dir, uuid);
    let bytes = match fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(BackendError::Io { path, source }),
    };
    let bad = |message: String| BackendError::Json { path: path.clone(), message };
    let load: Vec<LoadEntry> = serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
    if load.len() > MAX_LOAD_ENTRIES {
        return Err(bad(format!("{} processes; at most {MAX_LOAD_ENTRIES}", load.len())));
    }
    for (i, l) in load.iter().enumerate() {
        for (what, v) in [("sm", l.sm), ("bw", l.bw)] {
            if !(v.is_finite() && (0.0..=1.0).contains(&v)) {
                return Err(bad(format!("[{i}].{what}: {v} is not a fraction from 0 to 1")));
            }
        }
    }
    Ok(Some(load))
}

/// The caps tesserad mirrored for device `uuid` (pid -> percent).
fn read_caps(sim_dir: &Path, uuid: &str) -> BTreeMap<u32, u8> {
    fs::read(caps_path(sim_dir, uuid))
        .ok()
        .and_then(|b| serde_json::from_slice::<BTreeMap<u32, u8>>(&b).ok())
        .unwrap_or_default()
}

/// Mirror the MPS caps of device `uuid` (see the module docs); written only when changed.
pub(super) fn write_caps(
    sim_dir: &Path,
    uuid: &str,
    caps: &[(u32, u8)],
) -> Result<(), BackendError> {
    let want: BTreeMap<u32, u8> = caps.iter().copied().collect();
    if read_caps(sim_dir, uuid) == want {
        return Ok(());
    }
    let path = caps_path(sim_dir, uuid);
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).map_err(BackendError::io(dir))?;
    }
    let json = serde_json::to_vec(&want)
        .map_err(|e| BackendError::Json { path: path.clone(), message: e.to_string() })?;
    super::write_atomic(&path, &json)
}

/// What each process of device `uuid` gets under the model; `None` without a load file.
pub(super) fn modelled(
    sim_dir: &Path,
    uuid: &str,
) -> Result<Option<Vec<(u32, Achieved)>>, BackendError> {
    let Some(load) = read_load(sim_dir, uuid)? else { return Ok(None) };
    let caps = read_caps(sim_dir, uuid);
    let loads: Vec<Load> = load
        .iter()
        .map(|l| Load {
            demand: Demand { sm: l.sm, bw: l.bw },
            cap: caps.get(&l.pid).map_or(1.0, |p| f64::from(*p.min(&100)) / 100.0),
        })
        .collect();
    Ok(Some(load.iter().map(|l| l.pid).zip(share_device(&loads)).collect()))
}

/// One device's telemetry from the model (zeros without a load).
pub(super) fn device(
    sim_dir: &Path,
    uuid: &str,
    gpu_uuid: &str,
) -> Result<DeviceTelemetry, BackendError> {
    let achieved: Vec<Achieved> =
        modelled(sim_dir, uuid)?.unwrap_or_default().into_iter().map(|(_, a)| a).collect();
    let (sm, bw) = device_activity(&achieved);
    Ok(with_activity(uuid, gpu_uuid, sm, bw))
}

/// A device's telemetry for the given activity (power and clocks modelled from it).
pub(super) fn with_activity(uuid: &str, gpu_uuid: &str, sm: f64, bw: f64) -> DeviceTelemetry {
    let mut t = DeviceTelemetry::empty(uuid, gpu_uuid, Source::Sim);
    t.sm_active = Some(sm);
    t.dram_active = Some(bw);
    if uuid == gpu_uuid {
        let power = 70.0 + 630.0 * (0.6 * sm + 0.4 * bw);
        t.power_watts = Some((power * 10.0).round() / 10.0);
        t.sm_clock_mhz = Some(1980);
        t.mem_clock_mhz = Some(2619);
        t.throttle_mask = if power >= 690.0 { 0x4 } else { 0 };
        t.throttle_reasons = throttle_names(t.throttle_mask);
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GpuBackend;

    #[test]
    fn the_model_divides_a_saturated_device_and_caps_apply() {
        let dir = tempfile::tempdir().expect("tempdir");
        let node = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/nodes/h100x8.json");
        let b = crate::SimBackend::open(&node, dir.path()).expect("open");
        let inv = b.inventory().expect("inventory");
        let gpu = inv.gpus.iter().find(|g| !g.mig_enabled).expect("whole").uuid.clone();
        let t = b.device_telemetry(&gpu).expect("telemetry");
        assert_eq!((t[0].sm_active, t[0].dram_active), (Some(0.0), Some(0.0)), "idle");
        let v = LoadEntry { pid: 10, sm: 0.25, bw: 0.5 };
        let a = LoadEntry { pid: 11, sm: 1.0, bw: 1.0 };
        set_load(dir.path(), &gpu, &[v, a]).expect("load");
        b.model_mps_caps(&gpu, &[(10, 25), (11, 75)]).expect("caps");
        let p = b.process_telemetry(&gpu, 0).expect("processes").expect("some");
        let victim = p.iter().find(|x| x.pid == 10).expect("victim");
        assert!((victim.sm - 0.2).abs() < 1e-9, "0.25 x 0.8: {victim:?}");
        let t = b.device_telemetry(&gpu).expect("telemetry");
        assert!((t[0].dram_active.unwrap_or(0.0) - 1.0).abs() < 1e-9, "{t:?}");
        assert_eq!(t[0].power_watts, Some(624.4), "70 W + 630 W x (0.6 x 0.8 + 0.4 x 1.0)");
        // The aggressor's cap halved (as tesserad mirrors it): the victim gets all it wants.
        b.model_mps_caps(&gpu, &[(10, 25), (11, 37)]).expect("caps");
        let p = b.process_telemetry(&gpu, 0).expect("processes").expect("some");
        assert!((p.iter().find(|x| x.pid == 10).expect("victim").sm - 0.25).abs() < 1e-9);
        // Metering's per-process SM figures follow the model too.
        let u = b.process_utilization(&gpu, 0).expect("util").expect("some");
        assert_eq!(u.iter().find(|x| x.pid == 11).map(|x| x.sm_percent), Some(37));
        std::fs::write(
            dir.path().join("sim/load").join(format!("{gpu}.json")),
            r#"[{"pid": 1, "sm": 2, "bw": 0}]"#,
        )
        .expect("bad");
        let e = b.device_telemetry(&gpu).expect_err("a demand over 1");
        assert!(e.to_string().contains("[0].sm: 2 is not a fraction"), "{e}");
    }
}
