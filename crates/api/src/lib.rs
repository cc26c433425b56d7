//! The contract between tesserad and its clients (`tessera-runtime`, `tessera-hook`,
//! `tessera`): wire types, the GPU request grammar, and a small blocking HTTP/1.1 client
//! over a unix socket.
//!
//! The client is deliberately tiny and synchronous: `tessera-runtime` sits on the start
//! path of every GPU container, so it must not pay for an async runtime's start-up.

pub mod cgroup;
pub mod client;
pub mod cpulist;
pub mod cri;
pub mod deviceplugin;
pub mod display;
pub mod durable;
pub mod ids;
pub mod mountinfo;
pub mod procfs;
pub mod protocol;
pub mod request;
pub mod telemetry;
pub mod time;
pub mod unique;

/// Logs of the daemons (tesserad, tessera-coordinator): to stderr, filtered by
/// `TESSERA_LOG` (default `info`), coloured only on a terminal.
#[cfg(feature = "logging")]
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TESSERA_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
}
pub mod types;

pub use client::{Client, ClientError};
pub use display::untrusted;
pub use ids::{
    ContainerId, DeviceUuid, InvalidDeviceUuid, InvalidTenantPath, InvalidTrust, TenantPath, Trust,
};
pub use protocol::{ProtocolError, ProtocolVersion, PROTOCOL, PROTOCOL_HEADER, UNVERSIONED};
pub use request::{GpuRequest, Isolation, RequestError};
pub use types::*;
pub use unique::UniqueMap;

use std::path::{Path, PathBuf};

/// The largest request body tesserad accepts; the client refuses to send more.
pub const MAX_REQUEST_BYTES: usize = 1 << 20;

/// Why a string is not a container id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "container id `{}` is not a valid container id (expected 1 to 1024 of [A-Za-z0-9_+-.], not `.` or `..`)",
    untrusted(.0)
)]
pub struct InvalidContainerId(pub String);

/// runc's rule for container ids (`^[\w+\-.]+$`, not `.` or `..`), and at most 1024 bytes.
/// Check an id with this before it is joined to any path: `../x` would name another
/// directory than the container's.
pub fn validate_container_id(id: &str) -> Result<(), InvalidContainerId> {
    let ok = !id.is_empty()
        && id.len() <= 1024
        && id != "."
        && id != ".."
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"_+-.".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(InvalidContainerId(id.to_string()))
    }
}

/// runc's record of a container: `<runc_root>/<id>/state.json` (a [`ContainerId`] names no
/// other directory than its own).
pub fn runc_state_file(runc_root: &Path, container_id: &ContainerId) -> PathBuf {
    runc_root.join(container_id.as_str()).join("state.json")
}

/// The most of runc's record ([`runc_state_file`]) that is read.
pub const MAX_RUNC_STATE_BYTES: u64 = 16 << 20;

/// The bytes of runc's record of `container_id` under `runc_root`, at most
/// [`MAX_RUNC_STATE_BYTES`] (a larger one is cut there, and fails to parse).
pub fn read_runc_state(runc_root: &Path, container_id: &ContainerId) -> std::io::Result<Vec<u8>> {
    let f = std::fs::File::open(runc_state_file(runc_root, container_id))?;
    let mut buf = Vec::new();
    std::io::Read::read_to_end(&mut std::io::Read::take(f, MAX_RUNC_STATE_BYTES), &mut buf)?;
    Ok(buf)
}

/// Whether runc still has a record of `container_id` under `runc_root`: the test of "the
/// container is gone" that tesserad's reconciler and tessera-runtime's release share.
/// An invalid id is never anything's record (and is not joined to the root).
pub fn runc_state_exists(runc_root: &Path, container_id: &str) -> bool {
    ContainerId::new(container_id).is_ok_and(|id| runc_state_file(runc_root, &id).is_file())
}

/// Where tesserad listens and where clients look for it unless told otherwise.
pub const DEFAULT_SOCKET: &str = "/run/tessera/tesserad.sock";

/// Beside tesserad's socket, the node's NVIDIA character-device majors, one per line:
/// written by tesserad at start, read by the wrapper for containers without a GPU request
/// (which never ask the daemon) to strip GPU devices they were not granted.
pub fn gpu_majors_path(socket: &Path) -> PathBuf {
    let mut s = socket.as_os_str().to_owned();
    s.push(".gpu-majors");
    PathBuf::from(s)
}

/// Writes [`gpu_majors_path`] atomically (a file beside it, then rename), mode 0644.
pub fn write_gpu_majors(socket: &Path, majors: &[u32]) -> std::io::Result<()> {
    let text: String = majors.iter().map(|m| format!("{m}\n")).collect();
    write_beside(&gpu_majors_path(socket), text.as_bytes())
}

/// Replaces `path` with `bytes`, mode 0644, atomically for readers but not fsynced: the
/// files written so (beside tesserad's socket) are derived state that tesserad writes
/// again at start ([`durable::replace`] with [`durable::Sync::Rename`]).
pub fn write_beside(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    durable::replace(path, bytes, 0o644, durable::Sync::Rename)
}

/// The root a container's runc uses: the bundle's `root.path` (joined to the bundle when
/// relative, as runc does), resolved by the kernel. The config is the one tessera-runtime
/// checked and wrote; one that cannot be read is an error. (tesserad's confirmation and
/// `tessera-hook plain-prestart` judge the mounts below it before runc's `pivot_root`.)
pub fn bundle_root(bundle: &Path) -> Result<PathBuf, String> {
    let file = bundle.join("config.json");
    let bytes = std::fs::read(&file).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
    let v: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| format!("cannot read {}: {e}", file.display()))?;
    let root = v
        .pointer("/root/path")
        .and_then(serde_json::Value::as_str)
        .ok_or_else(|| format!("{} has no root.path", file.display()))?;
    let root = bundle.join(root);
    std::fs::canonicalize(&root).map_err(|e| format!("cannot resolve {}: {e}", root.display()))
}

/// Beside tesserad's socket, the directories of tesserad's own besides the socket (its
/// state directory, where every tenant's MPS pipe directories are), one per line: written
/// by tesserad at start, read by the wrapper, which refuses a container that would see
/// any of them ([`private_paths`]).
pub fn private_paths_path(socket: &Path) -> PathBuf {
    let mut s = socket.as_os_str().to_owned();
    s.push(".private");
    PathBuf::from(s)
}

/// Writes [`private_paths_path`] (see [`write_beside`]).
pub fn write_private_paths(socket: &Path, paths: &[PathBuf]) -> std::io::Result<()> {
    let mut text = String::new();
    for p in paths {
        text.push_str(&p.to_string_lossy());
        text.push('\n');
    }
    write_beside(&private_paths_path(socket), text.as_bytes())
}

/// tesserad's own paths, canonical where they exist: its socket (the API answers root as
/// root) and what [`private_paths_path`] lists (nothing more where tesserad never wrote
/// it). Lines that are not absolute paths are skipped.
pub fn private_paths(socket: &Path) -> Vec<PathBuf> {
    let listed = std::fs::read_to_string(private_paths_path(socket)).unwrap_or_default();
    std::iter::once(socket.to_path_buf())
        .chain(listed.lines().map(PathBuf::from).filter(|p| p.is_absolute()))
        .map(|p| std::fs::canonicalize(&p).unwrap_or(p))
        .collect()
}

/// Beside tesserad's socket, how many GPUs of the node are not in MIG mode (what `gpu=N`
/// can have; `docker --gpus all` and the CDI `all` mean that many): written by tesserad at
/// start (MIG mode is set by the operator, and read once per tesserad), read by the
/// wrapper so that `--gpus all` costs no round trip of its own.
pub fn whole_gpus_path(socket: &Path) -> PathBuf {
    let mut s = socket.as_os_str().to_owned();
    s.push(".whole-gpus");
    PathBuf::from(s)
}

/// Writes [`whole_gpus_path`] (see [`write_beside`]).
pub fn write_whole_gpus(socket: &Path, count: u32) -> std::io::Result<()> {
    write_beside(&whole_gpus_path(socket), format!("{count}\n").as_bytes())
}

/// Reads [`whole_gpus_path`]; `None` when absent or not a number (ask tesserad then).
pub fn read_whole_gpus(socket: &Path) -> Option<u32> {
    std::fs::read_to_string(whole_gpus_path(socket)).ok()?.trim().parse().ok()
}

/// Reads [`gpu_majors_path`]: the majors it lists (none when absent or unreadable; lines
/// that are not numbers are skipped).
pub fn read_gpu_majors(socket: &Path) -> Vec<u32> {
    std::fs::read_to_string(gpu_majors_path(socket))
        .map(|t| t.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}

/// The character majors `/proc/devices` names `nvidia*` (none when it cannot be read).
pub fn proc_devices_nvidia_majors(proc_devices: &Path) -> Vec<u32> {
    let Ok(text) = std::fs::read_to_string(proc_devices) else { return Vec::new() };
    let chars = text.split("Block devices:").next().unwrap_or("");
    chars
        .lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let major = it.next()?.parse().ok()?;
            it.next().filter(|n| n.starts_with("nvidia")).map(|_| major)
        })
        .collect()
}
/// The OCI annotation that carries a container's GPU request.
pub const REQUEST_ANNOTATION: &str = "tessera.io/gpu";
/// The GPUs a `gpu=N` request pins (`docker run --gpus '"device=3,GPU-…"'`): GPU indices
/// or uuids, comma-separated, N of them. Set by tessera-runtime only (a config that
/// carries it is refused); tesserad grants exactly those GPUs when they are free and the
/// tenant may have them, or refuses naming the one that is not.
pub const PINNED_ANNOTATION: &str = "tessera.io/gpus-pinned";
/// The process environment variable that may carry a GPU request (a request only, never
/// an identity: the image controls its environment).
pub const REQUEST_ENV: &str = "TESSERA_GPU";

#[cfg(test)]
mod tests {

    #[test]
    fn gpu_majors_are_written_beside_the_socket_and_read_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sock = dir.path().join("d.sock");
        assert!(read_gpu_majors(&sock).is_empty(), "absent: none");
        write_gpu_majors(&sock, &[195, 508, 509]).expect("write");
        assert_eq!(read_gpu_majors(&sock), vec![195, 508, 509]);
        assert_eq!(gpu_majors_path(&sock), dir.path().join("d.sock.gpu-majors"));
        let pd = dir.path().join("devices");
        std::fs::write(&pd, "Character devices:\n  1 mem\n195 nvidia-frontend\n508 nvidia-uvm\n509 nvidia-caps\n\nBlock devices:\n195 nvidia-fake-block\n").expect("write");
        assert_eq!(proc_devices_nvidia_majors(&pd), vec![195, 508, 509]);
    }

    use super::*;

    #[test]
    fn container_ids_follow_runcs_rules() {
        for ok in ["abc", "a.b-c_d+e", "0123456789abcdef", "..a", &"x".repeat(1024)] {
            assert!(validate_container_id(ok).is_ok(), "{ok}");
        }
        for bad in ["", ".", "..", "../etc", "a/b", "a b", "a\0b", "a,b", "é", &"x".repeat(1025)] {
            assert!(validate_container_id(bad).is_err(), "{bad}");
        }
        let msg = validate_container_id("a\nb").unwrap_err().to_string();
        assert!(msg.contains("`a\\nb`") && !msg.contains('\n'), "{msg}");
        assert!(validate_container_id(&"y".repeat(100_000)).unwrap_err().to_string().len() < 500);
    }

    #[test]
    fn an_invalid_id_names_no_runc_record() {
        let d = tempfile::tempdir().expect("tmp");
        std::fs::create_dir_all(d.path().join("root")).expect("mkdir");
        std::fs::create_dir_all(d.path().join("evil")).expect("mkdir");
        std::fs::write(d.path().join("evil/state.json"), "{}").expect("write");
        assert!(!runc_state_exists(&d.path().join("root"), "../evil"));
        assert!(runc_state_exists(d.path(), "evil"));
    }
}
