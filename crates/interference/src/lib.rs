//! Interference between tenants that share a GPU (MPS or time-slicing), as pure functions.
//!
//! - [`contention`]: the model a simulated node stands in for hardware with — each share's
//!   SM and memory-bandwidth demand, its MPS thread cap, and the throughput each gets when
//!   the device saturates. It is a model: its assumptions are stated there and in
//!   docs/GPU-HEALTH.md, and it is never the only judge of the controller it feeds (the
//!   end-to-end tests drive the real daemon; the simulator in `crates/lab` is a separate
//!   evaluation).
//! - [`detect`]: from per-device samples (each share's achieved SM and bandwidth, a
//!   workload's own latency where it reports one), which latency-sensitive share is
//!   degraded by which co-tenant, with hysteresis; never on a device with one active share.
//! - [`respond`]: the steps an open incident takes, by policy: throttle the aggressor's MPS
//!   thread percentage, keep the pair apart, harden the victim's next start, and as a last
//!   step stop the aggressor.
//!
//! The daemon (`tesserad`, `node/interference.rs`) and the simulator (`lab::contention_sim`)
//! run the same detector and steps.

pub mod contention;
pub mod detect;
pub mod respond;

pub use contention::{share_device, Achieved, Demand, Load};
pub use detect::{Detector, DeviceSample, Finding, Incident, ShareSample, Signal, Thresholds};
pub use respond::{Responder, Settings, Step};
