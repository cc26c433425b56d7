//! The runc wrapper `tessera-runtime` and the OCI hook `tessera-hook`.
//!
//! - [`args`]: runc's argv, parsed like runc does ([`parse_runc_args`]).
//! - [`request`]: the GPU request in a config.json ([`find_request`]).
//! - [`limits`]: a GPU container's CPU and memory limits, for the fleet's quotas.
//! - [`canonical`]: config.json as runc reads it (Go's key folding, duplicates, device
//!   numbers): one view on which every decision is made.
//! - [`spec`]: config.json load/save and the injection edits ([`apply_injection`]).
//! - [`runtime`]: the wrapper's flow ([`runtime_main`]).
//! - [`hook`]: the prestart/poststop hook ([`hook_main`]).
//! - [`config`]: the runtime configuration file (`/etc/tessera/runtime.toml`).
//! - [`docker`]: `docker run --gpus` read as a request; the `nvidia-container-runtime-hook`
//!   stand-in.
//! - [`supervise`]: runc as a child, for the verbs after which a grant is given back.
//! - [`confirm`]: a created GPU container confirmed by tesserad before `create` returns,
//!   and `start` refused for one that was not.
//!
//! The binaries in `src/bin/` only call [`runtime_main`] and [`hook_main`] and exit with
//! their code.

pub mod about;
pub mod args;
pub mod canonical;
pub mod config;
pub mod confirm;
pub mod docker;
pub mod exec;
pub mod hook;
pub mod limits;
pub mod mounts;
pub mod request;
pub mod runtime;
pub mod spec;
pub mod supervise;
#[cfg(test)]
mod test_support;
pub mod update;

pub use args::{
    parse_runc_args, ArgsError, Command, CreateArgs, CreateOptions, DeleteArgs, GlobalOptions,
    RuncInvocation, WrapperQuery,
};
pub use hook::{hook_main, HookError, HookState, Phase};
pub use request::{
    check_assignment_source, find_request, EngineSource, FoundRequest, RequestLookupError,
};
pub use runtime::{runtime_main, RuntimeEnv, RuntimeError};
pub use spec::{apply_injection, HookConfig, SpecError};
