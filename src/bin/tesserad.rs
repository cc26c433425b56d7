//! tesserad: the Tessera node daemon. Flag parsing only; see the `tesserad` crate.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

/// The Tessera node daemon: decides who gets which GPU share, and remembers it.
#[derive(Debug, Parser)]
#[command(name = "tesserad", version)]
struct Args {
    /// GPU source: `nvml` for the real driver, or `sim:FILE` for a simulated node.
    #[arg(long)]
    node: tesserad::NodeSource,
    /// Policy file (JSON).
    #[arg(long)]
    policy: PathBuf,
    /// Directory for durable state (allocations, simulated hardware).
    #[arg(long, default_value = "/var/lib/tessera")]
    state_dir: PathBuf,
    /// API socket path (root-only).
    #[arg(long, env = "TESSERA_SOCKET", default_value = tessera_api::DEFAULT_SOCKET)]
    socket: PathBuf,
    /// Uids allowed to use the API besides the socket mode (repeatable).
    #[arg(long = "allow-uid", default_values_t = [0u32])]
    allow_uid: Vec<u32>,
    /// How often the reconciler looks for containers that are gone, in milliseconds.
    #[arg(long, default_value_t = 5000)]
    reconcile_interval_ms: u64,
    /// How long a granted but never started container keeps its devices, in milliseconds.
    #[arg(long, default_value_t = 60_000)]
    pending_grace_ms: u64,
    /// Ledger heartbeat in milliseconds: a node crash loses at most this much metered
    /// time per running container (at most 10 s is accepted).
    #[arg(long, default_value_t = 5000, value_parser = clap::value_parser!(u64).range(100..=10_000))]
    checkpoint_interval_ms: u64,
    /// Serve Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9400).
    #[arg(long)]
    metrics: Option<std::net::SocketAddr>,
    /// The MPS control binary.
    #[arg(long, default_value = "nvidia-cuda-mps-control")]
    mps_control: PathBuf,
    /// Never create or destroy MIG instances on demand (only declared layouts change them).
    #[arg(long)]
    no_dynamic_mig: bool,
    /// How often every MPS control daemon is health-checked, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    mps_health_interval_ms: u64,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TESSERA_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    let a = Args::parse();
    let config = tesserad::Config {
        node: a.node,
        policy: a.policy,
        state_dir: a.state_dir,
        socket: a.socket,
        allowed_uids: a.allow_uid.into_iter().collect::<BTreeSet<_>>(),
        reconcile_every: Duration::from_millis(a.reconcile_interval_ms.max(100)),
        pending_grace: Duration::from_millis(a.pending_grace_ms),
        checkpoint_every: Duration::from_millis(a.checkpoint_interval_ms),
        metrics: a.metrics,
        mps_control: a.mps_control,
        mps_health_every: Duration::from_millis(a.mps_health_interval_ms.max(100)),
        dynamic_mig: !a.no_dynamic_mig,
        host: tesserad::HostPaths::default(),
    };
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tesserad: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(tesserad::run(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tesserad: {e}");
            ExitCode::FAILURE
        }
    }
}
