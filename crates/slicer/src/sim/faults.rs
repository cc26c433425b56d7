//! Simulated faults: XID events and device health, in files under `<state_dir>/sim/`.
//!
//! - `xid/<seq>.json`: one pending XID event each (`{"gpu_uuid", "xid", "gi_id"?,
//!   "ci_id"?}`, [`XidEvent`]), written by [`inject_xid`] (a temp file renamed into
//!   place) and consumed by [`GpuBackend::xid_events`](crate::GpuBackend::xid_events) in
//!   name order, as NVML's event set hands each event out once. A file that is not a
//!   valid event is renamed `<name>.bad` and reported as an error, never silently dropped.
//! - `health/<uuid>`: present when the device (GPU or MIG instance) reads unhealthy; its
//!   text is the reason ([`set_health`]). Absent: healthy.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::backend::BackendError;
use crate::xid::XidEvent;

/// The most events one drain returns (the rest wait for the next).
pub const MAX_EVENTS_PER_READ: usize = 256;
/// The longest health reason kept.
const MAX_REASON_BYTES: usize = 512;

fn xid_dir(sim_dir: &Path) -> PathBuf {
    sim_dir.join("xid")
}

fn health_file(sim_dir: &Path, uuid: &str) -> PathBuf {
    let safe: String =
        uuid.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect();
    sim_dir.join("health").join(safe)
}

/// Queue an XID event on the simulated node whose state lives in `state_dir` (what the
/// driver would report); the daemon's next fault check reads it.
pub fn inject_xid(state_dir: &Path, event: &XidEvent) -> Result<PathBuf, BackendError> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let dir = xid_dir(&state_dir.join("sim"));
    fs::create_dir_all(&dir).map_err(BackendError::io(&dir))?;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let name =
        format!("{now:020}-{}-{:06}.json", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
    let path = dir.join(name);
    let json = serde_json::to_vec(event)
        .map_err(|e| BackendError::Json { path: path.clone(), message: e.to_string() })?;
    super::write_atomic(&path, &json)?;
    Ok(path)
}

/// Mark the simulated device `uuid` unhealthy (`Some(reason)`) or healthy (`None`).
pub fn set_health(state_dir: &Path, uuid: &str, reason: Option<&str>) -> Result<(), BackendError> {
    let path = health_file(&state_dir.join("sim"), uuid);
    match reason {
        Some(r) => {
            if let Some(parent) = path.parent() {
                fs::create_dir_all(parent).map_err(BackendError::io(parent))?;
            }
            super::write_atomic(&path, r.as_bytes())
        }
        None => match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(BackendError::Io { path, source: e }),
        },
    }
}

/// Take the pending events of `sim_dir`, oldest first.
pub(super) fn drain_xids(sim_dir: &Path) -> Result<Vec<XidEvent>, BackendError> {
    let dir = xid_dir(sim_dir);
    let entries = match fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(BackendError::Io { path: dir, source }),
    };
    let mut names: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    names.sort();
    let mut out = Vec::new();
    for path in names.into_iter().take(MAX_EVENTS_PER_READ) {
        let read = fs::read(&path).map_err(BackendError::io(&path)).and_then(|bytes| {
            serde_json::from_slice::<XidEvent>(&bytes)
                .map_err(|e| BackendError::Json { path: path.clone(), message: e.to_string() })
        });
        match read {
            Ok(ev) => {
                fs::remove_file(&path).map_err(BackendError::io(&path))?;
                out.push(ev);
            }
            Err(e) => {
                // Kept for whoever wrote it, out of the queue: one bad file must not stop
                // every later event.
                let _ = fs::rename(&path, path.with_extension("bad"));
                return if out.is_empty() { Err(e) } else { Ok(out) };
            }
        }
    }
    Ok(out)
}

/// The health of a simulated device: `Some(reason)` while its health file exists.
pub(super) fn health(sim_dir: &Path, uuid: &str) -> Result<Option<String>, BackendError> {
    let path = health_file(sim_dir, uuid);
    match fs::read(&path) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes[..bytes.len().min(MAX_REASON_BYTES)]);
            let reason = tessera_api::untrusted(text.trim()).max_chars(MAX_REASON_BYTES);
            Ok(Some(reason.to_string()).filter(|r| !r.is_empty()).or(Some("unhealthy".into())))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(BackendError::Io { path, source }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GpuBackend;

    #[test]
    fn injected_xids_are_handed_out_once_in_order_and_bad_ones_reported() {
        let dir = tempfile::tempdir().expect("tempdir");
        let node = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/nodes/h100x8.json");
        let b = crate::SimBackend::open(&node, dir.path()).expect("open");
        assert_eq!(b.xid_events().expect("none"), vec![]);
        let ev = |xid| XidEvent { gpu_uuid: "GPU-a".into(), xid, gi_id: Some(1), ci_id: None };
        for xid in [94, 95, 43] {
            inject_xid(dir.path(), &ev(xid)).expect("inject");
        }
        let got: Vec<u64> = b.xid_events().expect("events").iter().map(|e| e.xid).collect();
        assert_eq!(got, [94, 95, 43]);
        assert!(b.xid_events().expect("drained").is_empty(), "each event once");
        std::fs::write(dir.path().join("sim/xid/000-bad.json"), b"{\"gpu\": 1}").expect("bad");
        inject_xid(dir.path(), &ev(48)).expect("inject");
        let e = b.xid_events().expect_err("a bad event is an error");
        assert!(e.to_string().contains("000-bad.json"), "{e}");
        assert!(dir.path().join("sim/xid/000-bad.bad").exists(), "kept aside");
        assert_eq!(b.xid_events().expect("the rest").len(), 1, "later events still come");
    }

    #[test]
    fn health_follows_the_file_and_an_instance_its_gpu() {
        let dir = tempfile::tempdir().expect("tempdir");
        let node = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/nodes/h100x8.json");
        let b = crate::SimBackend::open(&node, dir.path()).expect("open");
        let inv = b.inventory().expect("inventory");
        let gpu = inv.gpus.iter().find(|g| g.mig_enabled).expect("mig gpu");
        let inst = &gpu.instances[0].uuid;
        assert_eq!(b.device_health(inst).expect("health"), None);
        set_health(dir.path(), &gpu.uuid, Some("rows pending remapping\n")).expect("set");
        let why = b.device_health(inst).expect("health").expect("unhealthy");
        assert!(why.contains(&gpu.uuid) && why.contains("rows pending remapping"), "{why}");
        set_health(dir.path(), &gpu.uuid, None).expect("clear");
        assert_eq!(b.device_health(inst).expect("health"), None);
    }
}
