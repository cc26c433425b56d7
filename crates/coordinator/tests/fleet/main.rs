//! End-to-end tests of the coordinator, the agent and the stores, over loopback TCP
//! (and a real etcd process for the etcd store). One binary, one module per area.

#![allow(clippy::unwrap_used)]

mod agent;
mod common;
mod etcd;
mod server;
mod tls;
mod usage;
