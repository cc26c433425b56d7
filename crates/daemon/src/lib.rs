//! `tesserad`, the Tessera node daemon, as a library: the binary only parses flags.
//!
//! Shape: [`server`] parses HTTP into typed [`Action`]s; the one [`Controller`] applies
//! them — and those of the periodic tasks here, the exit watcher ([`exits`]) and the fleet
//! agent ([`fleet`]) — to the [`node::Node`] under its lock. The node decides with the pure
//! functions of `policy` (may this tenant have this?) and `slicer` (which device?), and
//! records the grant in [`store`] before answering; its verbs are files of `node/`;
//! [`liveness`] tells the reconciler which containers are gone.

pub mod cdi;
pub mod controller;
pub mod device_plugin;
mod durable;
pub mod error;
pub mod exits;
pub mod follow;
pub mod host;
pub mod limits;
pub mod liveness;
pub mod metrics;
pub mod node;
pub mod policy_reload;
pub mod quota_gate;
pub mod reload;
pub mod report_fs;
pub mod requesters;
pub mod runc_watch;
pub mod server;
pub mod share;
pub mod store;

use std::collections::BTreeSet;
use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::error::CoreError;
use tracing::{error, info, warn};

pub use controller::{Action, Controller, Outcome};
pub use follow::CoordinatorConfig;
pub use host::{Host, LinuxHost, TreeHost};
pub use node::{ActivePolicy, MigReport, Node, NodeParts, ReconcileReport};

/// Where the GPUs come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeSource {
    /// A simulated node described by a JSON file; its hardware state lives in the state dir.
    Sim(PathBuf),
    /// The real driver through NVML.
    Nvml,
}

impl std::str::FromStr for NodeSource {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "nvml" {
            Ok(NodeSource::Nvml)
        } else if let Some(file) = s.strip_prefix("sim:") {
            if file.is_empty() {
                return Err(
                    "`sim:` needs a node description file, e.g. sim:examples/nodes/h100x8.json"
                        .into(),
                );
            }
            Ok(NodeSource::Sim(PathBuf::from(file)))
        } else {
            Err(format!("unknown node source `{s}`: expected `nvml` or `sim:FILE`"))
        }
    }
}

/// Everything tesserad needs to run.
#[derive(Debug, Clone)]
pub struct Config {
    pub node: NodeSource,
    /// The policy file. Required without a coordinator; with one, it is the bootstrap
    /// policy, used when it is newer than the last-known-good copy (see [`fleet`]).
    pub policy: Option<PathBuf>,
    pub state_dir: PathBuf,
    pub socket: PathBuf,
    pub allowed_uids: BTreeSet<u32>,
    pub reconcile_every: Duration,
    pub pending_grace: Duration,
    /// Ledger heartbeat; a crash loses at most this much metered time per container.
    pub checkpoint_every: Duration,
    /// Where to serve Prometheus metrics over TCP, if anywhere.
    pub metrics: Option<std::net::SocketAddr>,
    /// The MPS control binary (`nvidia-cuda-mps-control`, or the test double).
    pub mps_control: PathBuf,
    /// How often every MPS control daemon is pinged.
    pub mps_health_every: Duration,
    /// Cut MIG instances on demand where no declared layout applies.
    pub dynamic_mig: bool,
    /// The binary whose `scrub` subcommand scrubs a device in a child process (`tessera`).
    pub scrub_exe: PathBuf,
    /// How often the scrub worker looks for devices to scrub.
    pub scrub_every: Duration,
    /// How often per-process GPU utilisation is sampled into the ledger.
    pub util_every: Duration,
    /// How often device and per-container telemetry is read and interference judged.
    pub telemetry_every: Duration,
    /// What the daemon reads of the machine ([`LinuxHost`] in production).
    pub host: std::sync::Arc<dyn Host>,
    /// Follow a fleet coordinator for the policy and upload usage to it.
    pub coordinator: Option<CoordinatorConfig>,
    /// Serve the kubelet device-plugin API in this directory (kubelet's
    /// `/var/lib/kubelet/device-plugins`); off when `None`.
    pub device_plugin_dir: Option<PathBuf>,
    /// Keep a CDI spec of the node's requests in `DIR/tessera.yaml` ([`cdi`]); off when
    /// `None`.
    pub cdi_spec_dir: Option<PathBuf>,
}

/// Why the daemon could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error("state dir {path}: {source}")]
    StateDir { path: PathBuf, source: std::io::Error },
    #[error("state dir {0} is in use by another tesserad")]
    Locked(PathBuf),
    #[error(
        "state dir {} is in use by another tesserad (pid {pid}): one tesserad per state dir \
         (stop it first, or give this one another --state-dir)",
        dir.display()
    )]
    InUse { dir: PathBuf, pid: u32 },
    #[error("policy: {0}")]
    Policy(#[from] policy::PolicyError),
    #[error("no policy: give --policy FILE, or --coordinator with --trust-key")]
    NoPolicy,
    #[error("coordinator: {0}")]
    Coordinator(String),
    #[error("node key: {0}")]
    NodeKey(String),
    #[error("gpu backend: {0}")]
    Backend(String),
    #[error(transparent)]
    Store(#[from] store::StoreError),
    #[error("ledger: {0}")]
    Ledger(#[from] metering::LedgerError),
    #[error("metrics address {addr}: {source}")]
    Metrics { addr: std::net::SocketAddr, source: std::io::Error },
    #[error(transparent)]
    Socket(#[from] server::SocketError),
    #[error("cannot handle SIGHUP: {0}")]
    Signal(std::io::Error),
    #[error("serving the API: {0}")]
    Serve(std::io::Error),
}

/// Milliseconds since the Unix epoch.
pub use tessera_api::time::now_ms;

/// Open the backend named by `source`, keeping simulated hardware state in `state_dir`.
pub fn open_backend(
    source: &NodeSource,
    state_dir: &std::path::Path,
) -> Result<Box<dyn slicer::GpuBackend>, DaemonError> {
    match source {
        NodeSource::Sim(file) => slicer::SimBackend::open(file, state_dir)
            .map(|b| Box::new(b) as Box<dyn slicer::GpuBackend>)
            .map_err(|e| DaemonError::Backend(e.to_string())),
        NodeSource::Nvml => slicer::NvmlBackend::open_default()
            .map(|b| Box::new(b) as Box<dyn slicer::GpuBackend>)
            .map_err(|e| DaemonError::Backend(e.to_string())),
    }
}

/// The pid a live tesserad wrote into the state dir's lock file, if that process runs.
fn lock_holder(lock: &std::path::Path) -> Option<u32> {
    let pid: u32 = std::fs::read_to_string(lock).ok()?.trim().parse().ok()?;
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    (comm.trim() == "tesserad").then_some(pid)
}

/// Creates `path` mode 0600 if absent, or makes it 0600 (SQLite creates its databases
/// with the umask's mode, and its -wal and -shm files with the database's).
fn private_file(path: &std::path::Path) -> std::io::Result<()> {
    std::fs::OpenOptions::new().write(true).create(true).truncate(false).mode(0o600).open(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
}

/// Start the daemon and serve until SIGTERM or SIGINT.
pub async fn run(config: Config) -> Result<(), DaemonError> {
    // Before anything slow: from here on a SIGHUP is a reload, never the daemon's end.
    let hup = reload::catch_sighup().map_err(DaemonError::Signal)?;
    let state_err = |source| DaemonError::StateDir { path: config.state_dir.clone(), source };
    std::fs::create_dir_all(&config.state_dir).map_err(state_err)?;
    // Grants, tenants and usage: root's alone (INSTALL.md: 0700), whoever created the dir.
    std::fs::set_permissions(&config.state_dir, std::fs::Permissions::from_mode(0o700))
        .map_err(state_err)?;
    // One daemon per state dir: the lock is held for the life of the process, and names
    // its holder.
    let lock_path = config.state_dir.join("tesserad.lock");
    let mut lock = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&lock_path)
        .map_err(state_err)?;
    // Wait a little for the lock only while no live tesserad holds it: a predecessor just
    // killed may still have a child between fork and exec holding a copy of its descriptor
    // (a restart races with that). A live holder is said at once.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut said = false;
    while lock.try_lock().is_err() {
        let holder = lock_holder(&lock_path);
        if let Some(pid) = holder.filter(|p| *p != std::process::id()) {
            return Err(DaemonError::InUse { dir: config.state_dir.clone(), pid });
        }
        if !said {
            said = true;
            warn!(
                state_dir = %config.state_dir.display(),
                "the state dir's lock is held by no live tesserad (a child of the last one?): waiting up to 10 s"
            );
        }
        if std::time::Instant::now() >= deadline {
            return Err(DaemonError::Locked(config.state_dir.clone()));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    {
        use std::io::{Seek as _, Write as _};
        let written = lock
            .set_len(0)
            .and_then(|()| lock.seek(std::io::SeekFrom::Start(0)))
            .and_then(|_| writeln!(lock, "{}", std::process::id()));
        written.map_err(state_err)?;
    }
    for db in ["state.db", "ledger.db"] {
        private_file(&config.state_dir.join(db)).map_err(state_err)?;
    }

    let backend = open_backend(&config.node, &config.state_dir)?;
    // The node's own key, made at the first start: it signs the usage this node uploads;
    // the operator pins its public half at the coordinator.
    let key_path = ::fleet::proof::node_key_path(&config.state_dir);
    let (node_key, made) = ::fleet::proof::load_or_create_node_key(&key_path)
        .map_err(|e| DaemonError::NodeKey(e.to_string()))?;
    let public_key = ::fleet::signing::encode_verifying_key(&node_key.verifying_key());
    if made {
        info!(path = %key_path.display(), key_id = %node_key.key_id(), public_key = %public_key,
              "made this node's usage signing key; pin it at the coordinator: tessera nodes register-key NODE {public_key}");
    } else {
        info!(key_id = %node_key.key_id(), public_key = %public_key, "node usage signing key");
    }
    let (active, fleet) = match &config.coordinator {
        None => {
            let path = config.policy.as_ref().ok_or(DaemonError::NoPolicy)?;
            let policy = policy::Policy::load(path)?;
            (ActivePolicy { policy, source: format!("file:{}", path.display()) }, None)
        }
        Some(cc) => {
            let name = backend.inventory().map_err(|e| DaemonError::Backend(e.to_string()))?.node;
            let mut cc = cc.clone();
            cc.node_key = Some(node_key.clone());
            let fleet = follow::Fleet::new(&cc, &name, &config.state_dir)?;
            let active = fleet.initial_policy(config.policy.as_deref()).await?;
            (active, Some(Arc::new(fleet)))
        }
    };
    let store = store::Store::open(&config.state_dir.join("state.db"))?;
    let ledger = metering::Ledger::open(
        &config.state_dir.join("ledger.db"),
        Arc::new(metering::SystemClock),
    )?;
    if ledger.recovered() > 0 {
        info!(
            intervals = ledger.recovered(),
            "closed intervals left open by the last run at their last checkpoint"
        );
    }
    let control = mpsd::ProcessControl::new(config.mps_control.clone());
    let mps = Arc::new(mpsd::Supervisor::new(Arc::new(control), config.state_dir.clone()));
    let mut node = Node::new(NodeParts {
        backend,
        policy: active,
        store,
        ledger,
        mps,
        host: config.host.clone(),
        pending_grace: config.pending_grace,
        dynamic_mig: config.dynamic_mig,
        scrub: node::ScrubSetup {
            exe: config.scrub_exe.clone(),
            sim_faults: matches!(config.node, NodeSource::Sim(_))
                .then(|| config.state_dir.join("sim").join(scrub::SimScrubber::FAULTS_FILE)),
        },
    })
    .map_err(|e| DaemonError::Backend(e.to_string()))?;
    node.set_identity(
        Some(tessera_api::NodeKeyInfo {
            public_key: public_key.clone(),
            key_id: node_key.key_id().to_string(),
        }),
        fleet.is_some(),
    );
    // For the wrapper, which refuses a container in a grant's cgroup without asking.
    node.list_grant_cgroups_in(tessera_api::cgroup::grant_cgroups_path(&config.socket));
    // For the wrapper, which refuses a container in tesserad's cgroup (its MPS daemons' too).
    node.list_daemon_cgroups_beside(config.socket.clone());
    // For the wrapper and the start check: no container sees tesserad's socket or state.
    node.keep_private(&config.socket, &config.state_dir);
    // A grant ends when runc removes its container's record, whoever deleted it.
    match runc_watch::RuncWatch::new() {
        Ok(w) => node.watch_runc_roots(w),
        Err(e) => warn!("{e}; grants are given back by the reconciler's pass"),
    }
    // A grant not yet confirmed ends when its requester exited and runc made nothing.
    match requesters::Requesters::new() {
        Ok(w) => node.watch_requesters(w),
        Err(e) => warn!("{e}; unconfirmed grants are given back after the pending grace"),
    }
    let removals_fd = node.runc_watch_readiness();
    let requesters_fd = node.requesters_readiness();
    info!(node = %node.inventory().node, gpus = node.inventory().gpus.len(),
          policy_version = node.policy().policy.version(), policy_source = %node.policy().source, "tesserad starting");
    let gpu_majors = node.inventory().majors.all();
    let whole_gpus = node.inventory().gpus.iter().filter(|g| !g.mig_enabled).count() as u32;
    let node_name = node.inventory().node.clone();
    // From here on the node is the controller's: everything goes through actions.
    let ctl = controller::Controller::new(node);
    ctl.set_reload(policy_reload::ReloadSetup {
        file: config.policy.clone(),
        fleet: fleet.clone().map(|f| f as Arc<dyn policy_reload::FleetPolicy>),
    });
    // Fleet quotas: grants under a policy with `quotas` are admitted by the coordinator
    // (or, while it is unreachable, within this node's leases).
    // Without a coordinator, the node is its own fleet: books of its own count its grants.
    let authority = match &fleet {
        Some(f) => crate::quota_gate::Authority::Coordinator(f.quota_link()?),
        None => crate::quota_gate::Authority::local(&node_name),
    };
    let quota_gate = crate::quota_gate::QuotaGate::new(authority, Some(&config.state_dir));
    ctl.set_quota(quota_gate.clone());
    // SIGHUP reloads the policy file (caught since start, served before the socket is).
    let sighup = reload::spawn_sighup(ctl.clone(), hup);
    if let Ok(Outcome::Reconciled(r)) = ctl.apply(Action::Reconcile) {
        if !r.released.is_empty() {
            info!(released = r.released.len(), "reconciled after restart")
        }
    }
    if let Ok(Outcome::MpsResumed { adopted, released, restarted }) = ctl.apply(Action::ResumeMps) {
        if (adopted, released, restarted) != (0, 0, 0) {
            info!(adopted, released, restarted, "MPS control daemons taken over")
        }
    }
    // Grants a previous run admitted under its leases: unsynced until a sync is answered
    // (the coordinator counts this node's whole leases as used meanwhile).
    if let Ok(Outcome::QuotaSnapshot(Some(snap))) = ctl.apply(Action::QuotaSnapshot) {
        for h in snap.0.holdings.iter().filter(|h| h.under_lease) {
            quota_gate.note_lease_grant(&h.container_id);
        }
    }
    if let Ok(Outcome::Count(n)) = ctl.apply(Action::ResumeMetering) {
        if n > 0 {
            info!(intervals = n, "metering resumed for running containers")
        }
    }

    let running: Vec<tessera_api::ContainerId> = match ctl.apply(Action::Allocations) {
        Ok(Outcome::Allocations(all)) => all
            .into_iter()
            .filter(|a| a.state == tessera_api::AllocationState::Running)
            .map(|a| a.container_id)
            .collect(),
        _ => Vec::new(),
    };
    // CDI users' device names: written before the socket is bound, then kept current.
    let cdi = config.cdi_spec_dir.clone().map(|dir| {
        if let Err(e) = cdi::write_now(&ctl, &dir) {
            warn!("{e}; retried on the next change");
        }
        cdi::spawn(ctl.clone(), dir)
    });
    let listener = server::bind_socket(&config.socket)?;
    // For the wrapper's no-request path, which never asks the daemon: the driver's majors.
    if let Err(e) = tessera_api::write_gpu_majors(&config.socket, &gpu_majors) {
        warn!("cannot write {}: {e}", tessera_api::gpu_majors_path(&config.socket).display());
    }
    // For `docker --gpus all`: how many GPUs that is, without a round trip.
    if let Err(e) = tessera_api::write_whole_gpus(&config.socket, whole_gpus) {
        warn!("cannot write {}: {e}", tessera_api::whole_gpus_path(&config.socket).display());
    }
    // Containers that ran on through the restart: metering stops at their exit again.
    for id in running {
        exits::spawn(ctl.clone(), id);
    }
    let removals = removals_fd.and_then(|fd| spawn_removals(ctl.clone(), fd));
    let requester_exits = requesters_fd.and_then(|fd| spawn_removals(ctl.clone(), fd));

    // Fleet: follow the coordinator's policy and upload closed ledger intervals. Under a
    // policy with quotas, sync the node's holdings (and leases) with the books that admit
    // its grants.
    let (agent, usage) = match &fleet {
        Some(f) => {
            info!(coordinators = %f.snapshot().urls.join(","), "following the fleet coordinator");
            let uploader = Arc::new(tokio::sync::Mutex::new(f.uploader(ctl.clone())));
            (Some(f.spawn_agent(ctl.clone())), Some((f.spawn_usage(uploader.clone()), uploader)))
        }
        None => (None, None),
    };
    let sync_every =
        fleet.as_ref().map_or(::fleet::quota_wire::SYNC_INTERVAL, |f| f.quota_sync_every());
    let quota_sync = crate::quota_gate::spawn_sync(ctl.clone(), quota_gate.clone(), sync_every);

    // Declared MIG layouts converge as instances fall idle; the ECC counts are read outside
    // the node lock (see `controller`).
    let reconciler = periodic(ctl.clone(), config.reconcile_every, || {
        vec![Action::Reconcile, Action::CheckEcc, Action::CheckFaults, Action::MigConverge]
    });
    let heartbeat = periodic(ctl.clone(), config.checkpoint_every, || vec![Action::Checkpoint]);
    // Scrub worker: one device at a time, in a child process, outside the node lock.
    let scrubber = periodic(ctl.clone(), config.scrub_every, || vec![Action::Scrub]);
    let utilization = periodic(ctl.clone(), config.util_every, || vec![Action::SampleUtilization]);
    // Telemetry per container and the interference controller: the reads outside the lock.
    let telemetry = periodic(ctl.clone(), config.telemetry_every, || vec![Action::SampleTelemetry]);
    // MPS health: pings and cap read-backs run the control binary several times per share,
    // so they run outside the node lock (grants for other devices go on meanwhile).
    let mps_health =
        periodic(ctl.clone(), config.mps_health_every, || vec![Action::MpsHealthCheck]);

    // Capacity kube-scheduler can see: the kubelet device plugin.
    let device_plugin = config
        .device_plugin_dir
        .clone()
        .map(|dir| device_plugin::DevicePlugin::start(ctl.clone(), dir, &config.mps_control));

    let metrics = match config.metrics {
        Some(addr) => {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| DaemonError::Metrics { addr, source })?;
            info!(%addr, "serving metrics");
            let router = server::metrics_router(ctl.clone());
            Some(tokio::spawn(async move {
                if let Err(e) = axum::serve(listener, router).await {
                    error!("metrics server failed: {e}");
                }
            }))
        }
        None => None,
    };

    info!(socket = %config.socket.display(), "serving");
    let served = axum::serve(
        server::PeerCheckedListener::new(listener, config.allowed_uids.clone()),
        match &fleet {
            Some(f) => f.router(ctl.clone(), server::router(ctl.clone())),
            None => server::router(ctl.clone()),
        }
        .into_make_service_with_connect_info::<server::Peer>(),
    )
    .with_graceful_shutdown(shutdown_signal())
    .await;
    reconciler.abort();
    for r in [removals, requester_exits].into_iter().flatten() {
        r.abort();
    }
    sighup.abort();
    heartbeat.abort();
    scrubber.abort();
    utilization.abort();
    telemetry.abort();
    mps_health.abort();
    if let Some(m) = metrics {
        m.abort();
    }
    if let Some(a) = agent {
        a.abort();
    }
    quota_sync.abort();
    if let Some(c) = cdi {
        c.abort();
    }
    if let Some(p) = device_plugin {
        p.stop().await;
    }
    // A clean stop loses no metered time: stamp every open interval one last time.
    // (A failure is logged by the controller.)
    let _ = ctl.apply(Action::Checkpoint);
    let _ = ctl.apply(Action::QuitIdleMps);
    if let Some((task, uploader)) = usage {
        // One last upload of what closed since the last round, bounded: a coordinator
        // that does not answer gets it from the next run.
        task.abort();
        let last = async move { uploader.lock().await.tick().await };
        if tokio::time::timeout(Duration::from_secs(5), last).await.is_err() {
            warn!("final fleet usage upload did not finish in 5 s; the next start sends it");
        }
    }
    let _ = std::fs::remove_file(&config.socket);
    drop(lock);
    info!("tesserad stopped");
    served.map_err(DaemonError::Serve)
}

/// Wake the controller whenever the queue behind `fd` ([`runc_watch::RuncWatch::readiness_fd`],
/// [`requesters::Requesters::readiness_fd`]) becomes readable: the grant is given back at
/// once, not at the next action (then the next container's grant would do the release's
/// work on its way).
fn spawn_removals(
    ctl: Arc<Controller>,
    fd: std::os::fd::OwnedFd,
) -> Option<tokio::task::JoinHandle<()>> {
    let ready = match crate::exits::watchable(fd) {
        Ok(a) => a,
        Err(e) => {
            warn!("cannot wait on runc's roots ({e}): grants are given back at the next action");
            return None;
        }
    };
    Some(tokio::spawn(async move {
        loop {
            let Ok(mut guard) = ready.readable().await else { return };
            // Cleared before the drain: what arrives during it wakes the next round.
            guard.clear_ready();
            let _ = ctl.run(Action::RuncRecordsRemoved).await;
        }
    }))
}

/// Send the `actions` to the controller every `every`, in order, off the async threads;
/// the first that fails ends the round (the controller logs it). A slow round delays the
/// next.
fn periodic(
    ctl: Arc<Controller>,
    every: Duration,
    actions: fn() -> Vec<Action>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let ctl = ctl.clone();
            let round = move || run_round(actions(), |a| ctl.apply(a));
            if let Err(e) = tokio::task::spawn_blocking(round).await {
                error!("periodic task failed: {e}");
            }
        }
    })
}

/// Runs every action of a periodic round, each on its own: one that fails (the controller
/// has logged why) does not keep the next from running — a failing reconcile never pauses
/// the ECC check and its quarantines. Returns how many failed.
fn run_round(
    actions: Vec<Action>,
    mut apply: impl FnMut(Action) -> Result<Outcome, CoreError>,
) -> usize {
    actions.into_iter().map(&mut apply).filter(Result::is_err).count()
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) =
        (signal(SignalKind::terminate()), signal(SignalKind::interrupt()))
    else {
        // Without signal handlers the daemon can still be stopped by SIGKILL; never exit early.
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => {},
        _ = int.recv() => {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 24: the reconcile tick ran `Reconcile`, `CheckEcc`, `MigConverge` with
    /// `try_for_each`, so a failing reconcile skipped the ECC check for that tick.
    #[test]
    fn a_failing_reconcile_still_runs_the_ecc_check() {
        let mut ran = Vec::new();
        let failed =
            run_round(vec![Action::Reconcile, Action::CheckEcc, Action::MigConverge], |a| {
                ran.push(a.name());
                match a {
                    Action::Reconcile => Err(CoreError::internal("the store is locked")),
                    _ => Ok(Outcome::Count(0)),
                }
            });
        assert_eq!(failed, 1);
        assert_eq!(ran, vec!["reconcile", "ECC check", "mig converge"]);
    }
}
