//! Where a share lives under the state dir:
//!
//! ```text
//! <state>/mps/<device dir>/<tenant slug>/share.json   what the share is (device, tenant, caps, holders)
//! <state>/mps/<device dir>/<tenant slug>/pipe/        CUDA_MPS_PIPE_DIRECTORY (bind-mounted read-only into containers)
//! <state>/mps/<device dir>/<tenant slug>/log/         CUDA_MPS_LOG_DIRECTORY (never mounted)
//! <shm root>/<device dir>/<tenant slug>/               /dev/shm of the daemon, its servers and its
//!                                                      clients (only when a shm root is configured)
//! ```
//!
//! MPS clients and servers share memory through `/dev/shm`, so a containerised client must
//! see the same `/dev/shm` as the server it talks to. With a shm root (a directory on a
//! tmpfs, e.g. `/dev/shm/tessera-mps`), each share gets its own directory there: the
//! daemon runs in a private mount namespace with it bound on `/dev/shm`, and containers
//! get it mounted on `/dev/shm`; tenants never see the host's `/dev/shm` or each other's.
//!
//! The device dir is the first 12 characters of the device UUID (`/` of old-style MIG
//! UUIDs written as `_`) plus 8 hex digits of its SHA-256, e.g. `GPU-2d34c7cd-1f0e9a3b`. The tenant slug is short and injective in practice: a
//! readable prefix of the tenant path plus 12 hex digits of its SHA-256; `share.json`
//! names the full tenant, and a directory whose record names another tenant is refused,
//! so even a hash collision fails closed. The control socket `<pipe>/control` must fit a
//! unix socket address (107 bytes), which bounds how long the state dir may be.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::MpsError;

/// The directory under the state dir that holds every share.
pub const MPS_DIR: &str = "mps";
/// The share record file name.
pub const SHARE_FILE: &str = "share.json";
/// Where the pipe directory appears inside a container: the CUDA default, so clients find
/// it even without `CUDA_MPS_PIPE_DIRECTORY`.
pub const CONTAINER_PIPE_DIR: &str = "/tmp/nvidia-mps";
/// The control socket's name in a pipe directory.
pub const CONTROL_SOCKET: &str = "control";
/// The PID file the control daemon writes into its pipe directory.
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// Longest path a unix socket address holds (sun_path is 108 bytes with the NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// Check a device UUID and return its directory name.
pub fn device_dir_name(device: &str) -> Result<String, MpsError> {
    let ok = (device.starts_with("GPU-") || device.starts_with("MIG-"))
        && device.len() <= 96
        && device.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'/')
        && !device.ends_with('/');
    if !ok {
        return Err(MpsError::Invalid(format!(
            "device `{}` is not a GPU-... or MIG-... UUID",
            crate::protocol::sanitize(device, 100)
        )));
    }
    // The prefix and first UUID group stay readable; 8 hex digits of the SHA-256 of the
    // whole UUID keep distinct devices apart. The full UUID is in share.json (adoption
    // checks it), and a short name leaves the control socket room under sun_path's 107
    // bytes: a full UUID alone would take 40 of them.
    let readable: String = device.replace('/', "_").chars().take(12).collect();
    let digest = Sha256::digest(device.as_bytes());
    let hex: String = digest.iter().take(4).map(|b| format!("{b:02x}")).collect();
    Ok(format!("{readable}-{hex}"))
}

/// The directory name for a tenant path such as `acme/research/vision/alice`.
pub fn tenant_slug(tenant: &str) -> String {
    let mut readable = String::new();
    let mut dash = false;
    for c in tenant.chars() {
        if readable.len() >= 16 {
            break;
        }
        if c.is_ascii_alphanumeric() {
            readable.push(c.to_ascii_lowercase());
            dash = false;
        } else if !dash && !readable.is_empty() {
            readable.push('-');
            dash = true;
        }
    }
    let readable = readable.trim_end_matches('-');
    let digest = Sha256::digest(tenant.as_bytes());
    let hex: String = digest.iter().take(6).map(|b| format!("{b:02x}")).collect();
    if readable.is_empty() {
        format!("t-{hex}")
    } else {
        format!("{readable}-{hex}")
    }
}

/// Check a tenant path.
pub fn check_tenant(tenant: &str) -> Result<(), MpsError> {
    if tenant.is_empty() || tenant.len() > 512 || tenant.chars().any(char::is_control) {
        return Err(MpsError::Invalid(format!(
            "tenant `{}` is empty, too long or has control characters",
            crate::protocol::sanitize(tenant, 100)
        )));
    }
    Ok(())
}

/// The directories of one share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareDirs {
    pub root: PathBuf,
    pub pipe: PathBuf,
    pub log: PathBuf,
    pub shm: Option<PathBuf>,
}

impl ShareDirs {
    /// The dirs of (device, tenant) under `state_dir`; refuses a state dir so long that the
    /// control socket path would not fit a socket address.
    pub fn new(
        state_dir: &Path,
        shm_root: Option<&Path>,
        device: &str,
        tenant: &str,
    ) -> Result<ShareDirs, MpsError> {
        check_tenant(tenant)?;
        let (device_dir, slug) = (device_dir_name(device)?, tenant_slug(tenant));
        let root = state_dir.join(MPS_DIR).join(&device_dir).join(&slug);
        let shm = shm_root.map(|r| r.join(&device_dir).join(&slug));
        let dirs = ShareDirs { pipe: root.join("pipe"), log: root.join("log"), root, shm };
        let socket = dirs.pipe.join(CONTROL_SOCKET);
        if socket.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(MpsError::Invalid(format!(
                "the MPS control socket {} would be {} bytes, over the {MAX_SOCKET_PATH} a unix socket \
                 address holds; use a shorter state dir",
                socket.display(),
                socket.as_os_str().len()
            )));
        }
        Ok(dirs)
    }

    pub fn record(&self) -> PathBuf {
        self.root.join(SHARE_FILE)
    }
}

/// `share.json`: what a share is, so a restarted tesserad can adopt its daemon.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShareRecord {
    pub device: String,
    pub tenant: String,
    pub percent: u8,
    pub mem_limit_mib: u64,
    /// Container ids holding the share.
    pub holders: Vec<String>,
    /// Set when the share stopped restarting after a crash loop.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub degraded: Option<String>,
    /// The active thread percentage the interference controller lowered the share's caps
    /// to (below `percent`, which stays its booking); absent: `percent`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub throttle: Option<u8>,
}

/// Read a share record; None if there is none.
pub fn read_record(path: &Path) -> Result<Option<ShareRecord>, MpsError> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| {
            MpsError::io(path, std::io::Error::new(std::io::ErrorKind::InvalidData, e))
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(MpsError::io(path, e)),
    }
}

/// Write a share record atomically (temp file, fsync, rename).
pub fn write_record(path: &Path, record: &ShareRecord) -> Result<(), MpsError> {
    let bytes = serde_json::to_vec_pretty(record)
        .map_err(|e| MpsError::io(path, std::io::Error::new(std::io::ErrorKind::InvalidData, e)))?;
    tessera_api::durable::replace(path, &bytes, 0o644, tessera_api::durable::Sync::Durable)
        .map_err(|e| MpsError::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slugs_are_short_readable_and_distinct() {
        let a = tenant_slug("acme/research/vision/alice");
        assert!(a.starts_with("acme-research-vi"), "{a}");
        assert!(a.len() <= 16 + 1 + 12, "{a}");
        assert_ne!(a, tenant_slug("acme/research/vision/alicf"));
        assert_ne!(tenant_slug("a/b"), tenant_slug("a-b"));
        assert!(tenant_slug("///").starts_with("t-"));
        assert!(tenant_slug("../../etc").bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'));
    }

    #[test]
    fn device_names_are_checked() {
        let a = device_dir_name("GPU-2d34c7cd-6c78-3770-a3e5-ca62b17ea346").expect("uuid");
        assert!(a.starts_with("GPU-2d34c7cd-") && a.len() == 21, "{a}");
        let b = device_dir_name("GPU-2d34c7cd-6c78-3770-a3e5-ca62b17ea347").expect("uuid");
        assert_ne!(a, b, "devices that share a prefix get distinct dirs");
        assert!(device_dir_name("MIG-GPU-aa/1/0").expect("old mig").starts_with("MIG-GPU-aa_1"));
        for bad in ["", "aa", "GPU-../x", "GPU-a b", "../GPU-a", "GPU-a/", "GPU-\u{0}"] {
            assert!(device_dir_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn long_state_dirs_are_refused_before_the_socket_fails() {
        let long = PathBuf::from(format!("/{}", "s".repeat(60)));
        let e = ShareDirs::new(&long, None, "GPU-f22fb098-d1b3-3806-2655-ba25f02229c1", "acme/x")
            .expect_err("too long");
        assert!(e.to_string().contains("use a shorter state dir"), "{e}");
        let ok = ShareDirs::new(
            Path::new("/var/lib/tessera"),
            Some(Path::new("/dev/shm/t")),
            "GPU-f22fb098-d1b3-3806-2655-ba25f02229c1",
            "acme/x",
        )
        .expect("fits");
        assert_eq!(ok.pipe.parent(), Some(ok.root.as_path()));
        assert_eq!(ok.shm.as_deref().and_then(Path::file_name), ok.root.file_name());
    }

    #[test]
    fn tenants_are_checked() {
        assert!(check_tenant("").is_err());
        assert!(check_tenant("a\nb").is_err());
        assert!(check_tenant("acme/team").is_ok());
    }
}
