//! The fleet coordinator's side of the command line: policy push, history and diff,
//! nodes, fleet-wide usage. (Being wired: see crates/coordinator.)

use clap::{Args, Subcommand};

/// Where the coordinator is and who is asking.
#[derive(Debug, Clone, Args)]
pub struct CoordinatorArgs {
    /// The coordinator's URL, e.g. http://127.0.0.1:7400 (several: comma-separated).
    #[arg(long, env = "TESSERA_COORDINATOR")]
    pub coordinator: Option<String>,
    /// The bearer token (an admin token for push, history, nodes and usage).
    #[arg(long, env = "TESSERA_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

/// Policy commands that talk to the coordinator.
#[derive(Debug, Subcommand)]
pub enum PolicyFleetCmd {
    /// Push a policy: validated, versioned, signed, and sent to every node.
    Push {
        file: std::path::PathBuf,
        #[command(flatten)]
        fleet: CoordinatorArgs,
    },
    /// Every stored policy version, newest first.
    History {
        #[command(flatten)]
        fleet: CoordinatorArgs,
    },
    /// What changed between two stored versions.
    Diff {
        a: u64,
        b: u64,
        #[command(flatten)]
        fleet: CoordinatorArgs,
    },
}

pub fn policy(_cmd: PolicyFleetCmd) -> Result<(), String> {
    Err("fleet policy commands are not wired yet".into())
}

pub fn nodes(_args: &CoordinatorArgs) -> Result<(), String> {
    Err("tessera nodes is not wired yet".into())
}

pub fn usage(_args: &CoordinatorArgs, _from_ms: u64, _to_ms: u64, _by: &str, _json: bool, _csv: bool) -> Result<(), String> {
    Err("fleet usage is not wired yet".into())
}
