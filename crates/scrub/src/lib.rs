//! GPU memory scrubbing between tenants.
//!
//! - [`lifecycle`]: the device states (`Free → Assigned → Dirty → Scrubbing → Free`, or
//!   `Quarantined`) and the pure functions deciding every transition.
//! - [`report`]: [`ScrubReport`], the JSON contract between the scrub child and the daemon.
//! - [`Scrubber`]: the seam at the CUDA boundary, with [`SimScrubber`] (device memory is a
//!   file of the simulated backend) and [`CudaScrubber`] (cudarc, run in a child process).
//! - [`child`]: running the scrub child with a timeout, and the `tessera scrub` /
//!   `tessera gpu-bench` entries.
//! - [`ptx`]: the hand-written verify kernels.

pub mod child;
pub mod cuda;
pub mod error;
pub mod lifecycle;
pub mod ptx;
pub mod report;
pub mod sim;

pub use child::{gpu_bench_main, run_scrub_child, scrub_cli_main, ScrubChild};
pub use cuda::{driver_present, CountReport, CudaOptions, CudaScrubber, FillReport, PeakReport};
pub use error::ScrubError;
pub use lifecycle::{
    DeviceEvent, DeviceState, IllegalTransition, NotAssignable, ScrubPolicy, TransitionError,
};
pub use report::{ScrubReport, BACKEND_CUDA, BACKEND_SIM};
pub use sim::{sim_memory_file, FaultInjection, FaultMode, SimScrubber};

/// Scrubs the memory of one device: zero it all, verify it reads back zero, report.
pub trait Scrubber: Send + Sync {
    /// [`BACKEND_CUDA`] or [`BACKEND_SIM`].
    fn backend(&self) -> &'static str;

    /// Scrub `device_uuid`. `Err` when the scrub could not run or finish; a finished
    /// scrub that found non-zero words is an `Ok` report with `ok: false`.
    fn scrub(&self, device_uuid: &str) -> Result<ScrubReport, ScrubError>;

    /// [`Scrubber::scrub`] with an error turned into a failed report.
    fn scrub_to_report(&self, device_uuid: &str) -> ScrubReport {
        self.scrub(device_uuid)
            .unwrap_or_else(|e| ScrubReport::failed(device_uuid, self.backend(), e))
    }
}
