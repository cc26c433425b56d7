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
    /// Policy file (JSON). Required unless --coordinator is given; with a coordinator it
    /// is the bootstrap policy, used only when it is newer than the last-known-good copy
    /// in the state dir (with neither, the coordinator's latest policy is fetched at start).
    #[arg(long, required_unless_present = "coordinator")]
    policy: Option<PathBuf>,
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
    /// The MPS control binary: an absolute path, or a bare name looked up in PATH (a
    /// relative path with a directory is refused: it runs from `/`).
    #[arg(long, default_value = "nvidia-cuda-mps-control")]
    mps_control: PathBuf,
    /// Never create or destroy MIG instances on demand (only declared layouts change them).
    #[arg(long)]
    no_dynamic_mig: bool,
    /// How often per-process GPU utilisation (where NVML offers it) is sampled, in ms.
    #[arg(long, default_value_t = 5000)]
    util_interval_ms: u64,
    /// How often device and per-container telemetry is read (and interference judged),
    /// in ms.
    #[arg(long, default_value_t = 1000)]
    telemetry_interval_ms: u64,
    /// The binary that scrubs a device in a child process (`tessera scrub`); default:
    /// `tessera` beside this tesserad.
    #[arg(long)]
    scrub_exe: Option<PathBuf>,
    /// How often the scrub worker looks for devices to scrub, in milliseconds.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(10..))]
    scrub_interval_ms: u64,
    /// How often every MPS control daemon is health-checked, in milliseconds.
    #[arg(long, default_value_t = 2000)]
    mps_health_interval_ms: u64,
    /// Serve the kubelet device-plugin API in kubelet's plugin directory (normally
    /// /var/lib/kubelet/device-plugins): kube-scheduler then sees this node's GPUs as
    /// tessera.io/* resources (docs/KUBERNETES.md). Off when not given.
    #[arg(long, value_name = "DIR")]
    device_plugin_dir: Option<PathBuf>,
    /// Keep a CDI spec (kind tessera.io/gpu, one device per request the node and the policy
    /// offer) in DIR/tessera.yaml: written at start and rewritten when the policy or the MIG
    /// layout changes (podman 4.3 reads /etc/cdi and /var/run/cdi). Off when not given.
    #[arg(long, value_name = "DIR")]
    cdi_spec_dir: Option<PathBuf>,
    #[command(flatten)]
    fleet: FleetArgs,
}

/// Following a fleet coordinator (see docs/FLEET.md).
#[derive(Debug, clap::Args)]
struct FleetArgs {
    /// Follow the fleet coordinator(s) at URL[,URL...] (http://HOST:PORT, tried in order):
    /// signed policies, status reports, usage uploads.
    #[arg(long, value_delimiter = ',', requires = "trust_key")]
    coordinator: Vec<String>,
    /// The coordinator's public key (64 hex digits, base64, or a file holding either):
    /// only policies it signed are applied.
    #[arg(long, requires = "coordinator")]
    trust_key: Option<String>,
    /// The name this node reports as (default: the node's name; it must match it).
    #[arg(long, requires = "coordinator")]
    node_id: Option<String>,
    /// A file holding this node's coordinator token (else $TESSERA_NODE_TOKEN).
    #[arg(long, requires = "coordinator")]
    node_token: Option<PathBuf>,
    /// For https:// coordinators: the CA certificate (PEM) that signed their certificates.
    /// Required with https:// URLs; with it, http:// URLs are refused (the node token
    /// would cross the network in clear text).
    #[arg(long, requires = "coordinator")]
    coordinator_ca: Option<PathBuf>,
    /// Enforce the --policy file even though this node follows a fleet: fleet revisions
    /// are refused (and shown as such) until the flag is dropped. Without it, a node that
    /// has a signed policy enforces only signed revisions and ignores --policy.
    #[arg(long, requires_all = ["coordinator", "policy"])]
    policy_overrides_fleet: bool,
    /// How long each long poll of the coordinator waits, in milliseconds.
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(100..=120_000))]
    coordinator_poll_timeout_ms: u64,
    /// Report this node's policy status to the coordinator at least this often, in milliseconds.
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(100..))]
    coordinator_report_interval_ms: u64,
    /// Longest wait between rounds of unreachable coordinators, in milliseconds.
    #[arg(long, default_value_t = 5000, value_parser = clap::value_parser!(u64).range(100..))]
    coordinator_retry_max_ms: u64,
    /// Under a policy with quotas, sync this node's quota holdings and leases with the
    /// coordinator this often, in milliseconds (tests shorten it).
    #[arg(long, default_value_t = fleet::quota_wire::SYNC_INTERVAL.as_millis() as u64, value_parser = clap::value_parser!(u64).range(10..=60_000))]
    quota_sync_interval_ms: u64,
    /// Upload closed ledger intervals to the coordinator this often, in milliseconds.
    #[arg(long, default_value_t = 60_000, value_parser = clap::value_parser!(u64).range(100..))]
    usage_upload_interval_ms: u64,
}

impl FleetArgs {
    fn config(self) -> Result<Option<tesserad::CoordinatorConfig>, String> {
        if self.coordinator.is_empty() {
            return Ok(None);
        }
        let urls: Vec<String> = self
            .coordinator
            .iter()
            .map(|u| u.trim().to_string())
            .filter(|u| !u.is_empty())
            .collect();
        if urls.is_empty() {
            return Err("--coordinator: no URL given".into());
        }
        // Refuse what would send the node token in clear text, or could never connect,
        // before anything starts.
        for u in &urls {
            let lower = u.to_ascii_lowercase();
            if lower.starts_with("https://") && self.coordinator_ca.is_none() {
                return Err(format!(
                    "--coordinator {u} is https:// but no --coordinator-ca FILE says which CA signed its certificate"
                ));
            }
            if lower.starts_with("http://") && self.coordinator_ca.is_some() {
                return Err(format!(
                    "--coordinator {u} is plain http:// while --coordinator-ca is given: the node token would \
                     cross the network in clear text; use https://"
                ));
            }
        }
        let key_arg = self
            .trust_key
            .ok_or("--coordinator needs --trust-key (the coordinator's public key)")?;
        let trust_key = fleet::signing::load_verifying_key(&key_arg)
            .map_err(|e| format!("--trust-key: {e}"))?;
        let token = match self.node_token {
            Some(path) => read_token(&path)?,
            None => match std::env::var("TESSERA_NODE_TOKEN") {
                Ok(t) if !t.trim().is_empty() => t.trim().to_string(),
                _ => {
                    return Err("--coordinator needs the node's token: --node-token FILE or $TESSERA_NODE_TOKEN".into())
                }
            },
        };
        let mut cfg = tesserad::CoordinatorConfig::new(urls, trust_key, token);
        if let Some(ca) = &self.coordinator_ca {
            cfg.tls =
                Some(fleet::tls::client_config(ca).map_err(|e| format!("--coordinator-ca: {e}"))?);
        }
        cfg.node_id = self.node_id;
        cfg.policy_overrides_fleet = self.policy_overrides_fleet;
        cfg.poll_timeout = Duration::from_millis(self.coordinator_poll_timeout_ms);
        cfg.report_every = Duration::from_millis(self.coordinator_report_interval_ms);
        cfg.retry_max = Duration::from_millis(self.coordinator_retry_max_ms);
        cfg.usage_every = Duration::from_millis(self.usage_upload_interval_ms);
        cfg.quota_sync_every = Duration::from_millis(self.quota_sync_interval_ms);
        Ok(Some(cfg))
    }
}

/// Read a token file: one line, surrounding whitespace ignored. Warns when others can read it.
fn read_token(path: &std::path::Path) -> Result<String, String> {
    use std::os::unix::fs::MetadataExt as _;
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--node-token {}: {e}", path.display()))?;
    let token = text.trim();
    if token.is_empty() {
        return Err(format!("--node-token {}: the file is empty", path.display()));
    }
    if token.contains(char::is_whitespace) {
        return Err(format!(
            "--node-token {}: expected one token, found whitespace inside",
            path.display()
        ));
    }
    if std::fs::metadata(path).is_ok_and(|m| m.mode() & 0o077 != 0) {
        tracing::warn!(path = %path.display(), "the node token file is readable by group or others; chmod 600 it");
    }
    Ok(token.to_string())
}

fn main() -> ExitCode {
    tessera_api::init_logging();
    let a = Args::parse();
    let coordinator = match a.fleet.config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("tesserad: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(e) = mpsd::check_binary(&a.mps_control) {
        eprintln!("tesserad: --mps-control {e}");
        return ExitCode::FAILURE;
    }
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
        util_every: Duration::from_millis(a.util_interval_ms.max(100)),
        telemetry_every: Duration::from_millis(a.telemetry_interval_ms.max(100)),
        scrub_every: Duration::from_millis(a.scrub_interval_ms),
        scrub_exe: a.scrub_exe.unwrap_or_else(|| {
            std::env::current_exe()
                .ok()
                .and_then(|p| p.parent().map(|d| d.join("tessera")))
                .unwrap_or_else(|| PathBuf::from("tessera"))
        }),
        host: std::sync::Arc::new(tesserad::LinuxHost),
        coordinator,
        device_plugin_dir: a.device_plugin_dir,
        cdi_spec_dir: a.cdi_spec_dir,
    };
    let rt =
        match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
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
