//! mpsd: MPS (CUDA Multi-Process Service) supervision for tesserad, and the placement
//! decisions for `mps=PCT` and `shared` requests.
//!
//! - [`protocol`]: the control commands of `nvidia-cuda-mps-control`, rendered exactly as
//!   the binary reads them, and strict parsers of its answers.
//! - [`control`]: the hardware seam, [`MpsControl`], and its one real implementation
//!   [`ProcessControl`], which runs a control binary: the real `nvidia-cuda-mps-control`
//!   or the test double `fake-nvidia-cuda-mps-control` (crate `mps-double`; same protocol;
//!   pick by path).
//! - [`supervisor`]: one control daemon per (device, tenant) with daemon-side caps set and
//!   read back before any client can connect and again at every health check (set again
//!   when they drifted), restart with backoff, crash records, degraded shares, adoption
//!   after a tesserad restart, shutdown.
//! - [`pure`]: which device takes an MPS share or a time-sliced replica (pure, property
//!   tested).
//! - [`layout`]: where a share lives under the state dir.

pub mod clock;
pub mod control;
pub mod layout;
pub mod protocol;
pub mod pure;
pub mod supervisor;

use std::path::PathBuf;

pub use clock::{Clock, ManualClock, SystemClock};
pub use control::{check_binary, BinaryPathError, DaemonSpec, MpsControl, ProcessControl};
pub use protocol::{Command, DeviceRef, MemLimit, ParseError};
pub use pure::{
    mps_mem_limit_bytes, pick_mps_device, pick_shared_device, MpsDeviceLoad, MpsNoFit,
    MpsShareLoad, SharedDeviceLoad, SharedNoFit,
};
pub use supervisor::{
    AdoptReport, CrashEvent, HealthEvent, Release, ShareHandle, ShareRequest, ShareState,
    ShareStatus, Supervisor, SupervisorConfig,
};

/// Why an MPS operation failed. Messages are lowercase sentences that name the device,
/// tenant or path involved.
#[derive(Debug, thiserror::Error)]
pub enum MpsError {
    #[error("cannot run the MPS control binary {binary}: {source}")]
    Spawn { binary: PathBuf, source: std::io::Error },
    #[error(
        "`{command}` to the MPS control daemon of {pipe_dir} got no answer within {after_ms} ms"
    )]
    Timeout { command: String, pipe_dir: PathBuf, after_ms: u64 },
    #[error("no MPS control daemon serves {pipe_dir}")]
    NoDaemon { pipe_dir: PathBuf },
    #[error("`{command}` to the MPS control daemon of {pipe_dir} failed ({status}): {output}")]
    CommandFailed { command: String, pipe_dir: PathBuf, status: String, output: String },
    #[error("answer to `{command}` from the MPS control daemon of {pipe_dir}: {source}")]
    BadAnswer { command: String, pipe_dir: PathBuf, source: ParseError },
    #[error("the MPS control daemon for {pipe_dir} did not start: {detail}")]
    DaemonDidNotStart { pipe_dir: PathBuf, detail: String },
    #[error("the MPS control daemon of device {device} for tenant {tenant} did not take its caps: {detail}")]
    CapsNotApplied { device: String, tenant: String, detail: String },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("invalid MPS share request: {0}")]
    Invalid(String),
    #[error("{0}")]
    NoRoom(String),
    #[error(
        "tenant {tenant} already holds an MPS share of {held}% on device {device}; a share of {asked}% must go to \
         another device (one cap per tenant per device)"
    )]
    CapConflict { device: String, tenant: String, held: u8, asked: u8 },
    #[error("the MPS share of tenant {tenant} on device {device} is degraded ({reason}); no new containers join it")]
    Degraded { device: String, tenant: String, reason: String },
    #[error("the MPS share of tenant {tenant} on device {device} is not running ({state}); try again later")]
    NotRunning { device: String, tenant: String, state: String },
    #[error("{path} belongs to {found}, not to {expected}; refusing to touch it")]
    Foreign { path: PathBuf, found: String, expected: String },
}

impl MpsError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> MpsError {
        MpsError::Io { path: path.into(), source }
    }
}
