//! End-to-end tests of the coordinator, the agent and the stores, over loopback TCP
//! (and a real etcd process for the etcd store). One binary, one module per area.

// Integration-test crates: clippy counts their helper functions as non-test code, so
// `allow-unwrap-in-tests` (clippy.toml) does not reach them; a panic is the failure report.
#![allow(clippy::unwrap_used)]

mod agent;
mod common;
mod compaction;
mod etcd;
mod hardening;
mod scale;
mod server;
mod tls;
mod usage;
