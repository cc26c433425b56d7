//! The crate's error type.

use std::path::PathBuf;
use std::time::Duration;

/// Why a scrub (or a benchmark) could not run or finish.
#[derive(Debug, thiserror::Error)]
pub enum ScrubError {
    /// `libcuda` can't be loaded: no NVIDIA driver on this host.
    #[error("no CUDA driver: libcuda could not be loaded")]
    NoDriver,
    /// The driver loaded but shows no device (wrong `CUDA_VISIBLE_DEVICES`, no GPU).
    #[error("no CUDA device visible (CUDA_VISIBLE_DEVICES={visible:?})")]
    NoDevice { visible: Option<String> },
    /// A driver call failed.
    #[error("{call} failed: {code}")]
    Driver { call: &'static str, code: String },
    /// The driver panicked inside cudarc (a symbol missing from an old driver).
    #[error("CUDA driver library unusable: {0}")]
    DriverPanic(String),
    /// Ordinal 0 is not the device that was asked for.
    #[error("device mismatch: asked to scrub {requested} but CUDA ordinal 0 is {found}")]
    WrongDevice { requested: String, found: String },
    /// The driver JIT refused the embedded PTX.
    #[error("loading the scrub kernels failed: {code}: {log}")]
    Jit { code: String, log: String },
    /// Not even the smallest chunk could be allocated.
    #[error("could not allocate any device memory ({free} bytes reported free)")]
    NoMemory { free: u64 },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The simulated memory file is a symlink, a device, a FIFO…
    #[error("{path}: not a regular file ({kind})")]
    NotRegularFile { path: PathBuf, kind: &'static str },
    /// The simulated memory file changed size during the scrub.
    #[error("{path}: size changed during the scrub ({before} -> {after} bytes)")]
    SizeChanged { path: PathBuf, before: u64, after: u64 },
    /// The fault-injection file is malformed (fails the scrub: fail closed).
    #[error("fault injection file {path}: {message}")]
    Faults { path: PathBuf, message: String },
    /// A fault injected on purpose (simulated backend only).
    #[error("injected scrub fault for {device}")]
    Injected { device: String },
    /// The scrub child ran past its time limit and was killed.
    #[error("scrub of {device} timed out after {:.1} s and was killed", timeout.as_secs_f64())]
    Timeout { device: String, timeout: Duration },
    /// The scrub child could not be run, or ended without a usable report.
    #[error("scrub child for {device}: {message}")]
    Child { device: String, message: String },
    /// Bad command-line arguments.
    #[error("{0}")]
    Usage(String),
}

impl ScrubError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> ScrubError {
        let path = path.into();
        move |source| ScrubError::Io { path, source }
    }
}
