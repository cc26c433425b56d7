//! The contract between tesserad and its clients (`tessera-runtime`, `tessera-hook`,
//! `tessera`): wire types, the GPU request grammar, and a small blocking HTTP/1.1 client
//! over a unix socket.
//!
//! The client is deliberately tiny and synchronous: `tessera-runtime` sits on the start
//! path of every GPU container, so it must not pay for an async runtime's start-up.

pub mod client;
pub mod request;
pub mod types;

pub use client::{Client, ClientError};
pub use request::{GpuRequest, Isolation, RequestError};
pub use types::*;

use std::path::{Path, PathBuf};

/// runc's record of a container: `<runc_root>/<id>/state.json`.
pub fn runc_state_file(runc_root: &Path, container_id: &str) -> PathBuf {
    runc_root.join(container_id).join("state.json")
}

/// Whether runc still has a record of `container_id` under `runc_root`: the test of "the
/// container is gone" that tesserad's reconciler and tessera-runtime's release share.
pub fn runc_state_exists(runc_root: &Path, container_id: &str) -> bool {
    runc_state_file(runc_root, container_id).is_file()
}

/// Where tesserad listens and where clients look for it unless told otherwise.
pub const DEFAULT_SOCKET: &str = "/run/tessera/tesserad.sock";
/// The OCI annotation that carries a container's GPU request.
pub const REQUEST_ANNOTATION: &str = "tessera.io/gpu";
/// The process environment variable that may carry a GPU request (a request only, never
/// an identity: the image controls its environment).
pub const REQUEST_ENV: &str = "TESSERA_GPU";
