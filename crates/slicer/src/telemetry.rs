//! What the backend measures of a GPU, a MIG instance and the processes on them: the
//! telemetry the daemon maps to containers (per container and tenant), exports with the
//! names dcgm-exporter uses, and judges interference with.
//!
//! NVML's sources, best first: GPM metrics (Hopper and later; per GPU and per MIG instance:
//! SM activity, DRAM bandwidth utilisation, PCIe and NVLink bytes per second), else the
//! utilisation rates (`nvmlDeviceGetUtilizationRates`: the share of time a kernel ran, and
//! the share of time device memory was read or written) and PCIe throughput counters;
//! always power, SM and memory clocks, the clock throttle ("clocks event") reasons and the
//! volatile ECC counts; per process `nvmlDeviceGetProcessUtilization` (SM and memory
//! utilisation; not available under MIG). A simulated node computes the same from its
//! load files with `interference::contention` (`sim/telemetry.rs`).

pub use tessera_api::telemetry::{
    throttle_names, DeviceTelemetry, ProcessTelemetry, Source, THROTTLE_REASONS,
};
