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
//! - [`pack`](mod@pack): where a request goes on a node across whole GPUs, MIG, MPS and
//!   time-slicing at once, scored by expected fragmentation (FGD; pure, deterministic).
//! - [`replay`](mod@replay): replays a request trace (the Alibaba GPU trace) on simulated nodes with
//!   the real placement code, to compare placement strategies (the CLI's `tessera sim`).
//! - [`tracegen`]: seeded synthetic traces of other request mixes (the replay's family).
//! - [`adversary`]: for any two placements whose starts differ on a trace (with a bounded
//!   wait), a trace on which the first admits fewer requests than the second (why no placement beats
//!   first-fit on every trace without being first-fit).
//! - [`layout`]: declared MIG layouts and the plan that converges to them without
//!   touching instances in use (pure), and its execution on a backend.
//! - [`injection`]: the device nodes and environment a container needs for its devices
//!   (pure).

pub mod adversary;
pub mod backend;
/// The GPU catalog and declared layouts live in the pure `catalog` crate (the policy crate
/// uses it without NVML); re-exported here so `slicer::catalog::...` keeps working.
pub use ::catalog;
mod choose;
#[cfg(any(test, feature = "conformance"))]
pub mod conformance;
pub mod driver;
mod inject;
pub mod inventory;
pub mod layout;
pub mod nvml;
pub mod pack;
pub mod place;
pub mod replay;
pub mod sim;
pub mod tracegen;

pub use backend::{BackendError, GpuBackend, ProcessUtil};
pub use catalog::{model, placement_is_legal, GpuModel, LayoutError, Profile};
pub use choose::{choose, NoFit};
pub use inject::{injection, InjectError, DEVICE_MODE};
pub use inventory::{
    parse_mig_minors, parse_proc_devices, Found, Gpu, Inventory, Majors, MigInstance, MigMinors,
    ParseError, ProcDevices,
};
pub use layout::{apply_plan, plan, DeclaredLayout, LayoutPlan};
pub use nvml::NvmlBackend;
pub use place::{place, place_scored, DemandMix, PlaceDecision, Scored, Strategy};
pub use replay::{
    replay, replay_with, Fractions, Placement, Queue, ReplayConfig, ReplayReport, SimTenant,
    Tenants, Trace, MAPPING_DOC,
};
pub use sim::SimBackend;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_adversary;
#[cfg(test)]
mod tests_adversary_attack;
#[cfg(test)]
mod tests_mig;
