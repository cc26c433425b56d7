//! slicer: what the node's GPUs are and which share a container gets.
//!
//! - [`catalog`]: GPU models, MIG profiles and placement rules, declared layouts (pure;
//!   the `catalog` crate, re-exported).
//! - [`inventory`]: the node's GPUs and MIG instances, and parsers of the host files they
//!   are resolved from (`/proc/devices`, `mig-minors`).
//! - [`backend`]: the [`GpuBackend`] hardware seam, with [`SimBackend`] (state in files)
//!   and [`NvmlBackend`] (the driver); both create and destroy MIG instances.
//! - `conformance`: one behavioural suite for backends that change MIG layouts; a test
//!   tool, compiled only into slicer's own tests and with the `conformance` feature.
//! - [`choose`](choose()): which devices a request gets (pure, deterministic).
//! - [`place`](mod@place): where a new MIG instance goes, and which idle instances to
//!   destroy when nothing else fits (pure, deterministic).
//! - [`layout`]: declared MIG layouts and the plan that converges to them without
//!   touching instances in use (pure), and its execution on a backend.
//! - [`injection`]: the device nodes and environment a container needs for its devices
//!   (pure).
//! - [`telemetry`]: what the backend measures of devices and processes.
//! - [`topology`]: NVLink domains, NUMA nodes, and the multi-GPU choice that keeps them
//!   together (pure).
//! - [`xid`]: which devices an XID error takes out of service (pure).
//! - [`fnv1a64`]: the stable hash the simulated backend derives its UUIDs with.
//!
//! The research built on these decisions (the trace replay, the packer, the adversary, the
//! trace generators) is the `lab` crate's (`crates/lab`, `tessera sim`); nothing here
//! depends on it.

pub mod backend;
/// The GPU catalog and declared layouts live in the pure `catalog` crate (the policy crate
/// uses it without NVML); re-exported here so `slicer::catalog::...` keeps working.
pub use ::catalog;
mod choose;
#[cfg(any(test, feature = "conformance"))]
pub mod conformance;
pub mod driver;
mod hash;
mod inject;
pub mod inventory;
pub mod layout;
pub mod nvml;
pub mod place;
pub mod sim;
pub mod telemetry;
pub mod topology;
pub mod xid;

pub use backend::{BackendError, GpuBackend, ProcessUtil};
pub use catalog::{model, placement_is_legal, GpuModel, LayoutError, Profile};
pub use choose::{choose, choose_placed, NoFit};
pub use hash::fnv1a64;
pub use inject::{injection, InjectError, DEVICE_MODE};
pub use inventory::{
    parse_mig_minors, parse_proc_devices, Found, Gpu, Inventory, Majors, MigInstance, MigMinors,
    ParseError, ProcDevices,
};
pub use layout::{apply_plan, plan, DeclaredLayout, LayoutPlan};
pub use nvml::NvmlBackend;
pub use place::{place, place_scored, DemandMix, PlaceDecision, Scored, Strategy};
pub use sim::SimBackend;
pub use telemetry::{DeviceTelemetry, ProcessTelemetry};
pub use topology::{GpuTopology, Placement, Topology};
pub use xid::{XidEvent, XidScope};

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_mig;
