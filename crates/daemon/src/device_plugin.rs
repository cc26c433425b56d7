//! The seam between tesserad and the kubelet device plugin (`crates/device-plugin`): the
//! plugin's endpoints run on the daemon's runtime, and its device lists follow the node.
//! Whenever an action may have changed what the node can grant
//! ([`Controller::changes`]: a grant, a release, a MIG re-cut, a scrub, a quarantine, a
//! policy), and at least every [`RESYNC`], the node's capacity is read under its lock
//! ([`Action::Capacity`], pure [`crate::node::snapshot`]) and handed to the plugin, which
//! sends kubelet the lists that changed.
//!
//! `Allocate`'s assignments get their tokens from the node ([`Action::IssueAssignments`],
//! recorded durably before kubelet gets the answer: `node/tokens.rs`).
//!
//! Off unless `--device-plugin-dir DIR` is given (see `docs/KUBERNETES.md`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use device_plugin::{Config, Issuer, Plugin};
use tessera_api::deviceplugin::{IssuedAssignment, PluginAssignment};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::{Action, Controller, Outcome};

/// The longest the lists go without a fresh read of the node (a change that no action
/// reported: a MIG cut whose grant failed, a reservation past its deadline).
pub const RESYNC: Duration = Duration::from_secs(2);

/// The running plugin: stop it to remove its sockets.
#[derive(Debug)]
pub struct DevicePlugin {
    plugin: Arc<Plugin>,
    stop: watch::Sender<bool>,
    serve: JoinHandle<()>,
    follow: JoinHandle<()>,
}

impl DevicePlugin {
    /// Starts the plugin in kubelet's plugin directory `dir`. MPS is advertised only where
    /// `mps_control` (tesserad's `--mps-control`) exists: a share needs its daemon.
    pub fn start(ctl: Arc<Controller>, dir: PathBuf, mps_control: &Path) -> DevicePlugin {
        info!(dir = %dir.display(), "serving the kubelet device-plugin API");
        let mps = executable(mps_control);
        if !mps {
            info!(
                control = %mps_control.display(),
                "tessera.io/mps is not advertised: no MPS control daemon here (--mps-control)"
            );
        }
        let issuer = Arc::new(NodeIssuer(ctl.clone()));
        let plugin = Plugin::new(Config::new(dir), issuer);
        let (stop, stopped) = watch::channel(false);
        let follow = tokio::spawn(follow(ctl, plugin.clone(), mps));
        let serve = tokio::spawn(plugin.clone().serve(stopped));
        DevicePlugin { plugin, stop, serve, follow }
    }

    /// The plugin (its lists, for tests and status).
    pub fn plugin(&self) -> &Arc<Plugin> {
        &self.plugin
    }

    /// Stops the endpoints and removes their sockets (waits at most 5 s).
    pub async fn stop(self) {
        self.follow.abort();
        let _ = self.stop.send(true);
        if tokio::time::timeout(Duration::from_secs(5), self.serve).await.is_err() {
            warn!("the device plugin did not stop in 5 s");
        }
    }
}

/// The node issues `Allocate`'s tokens, under its lock.
#[derive(Debug)]
struct NodeIssuer(Arc<Controller>);

impl Issuer for NodeIssuer {
    fn issue(&self, made: &[PluginAssignment]) -> Result<Vec<IssuedAssignment>, String> {
        match self.0.apply(Action::IssueAssignments(made.to_vec())) {
            Ok(Outcome::Issued(issued)) => Ok(issued),
            Ok(_) => Err("tesserad answered something else than tokens".into()),
            Err(e) => Err(e.message()),
        }
    }
}

/// Whether `p` names an executable file: as a path, or a bare name on `PATH`.
fn executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    let is_exe = |f: &Path| {
        std::fs::metadata(f).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if p.components().count() > 1 || p.is_absolute() {
        return is_exe(p);
    }
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|d| is_exe(&d.join(p))))
}

/// Hands the node's capacity to the plugin after every change, and every [`RESYNC`]
/// (without MPS where no control daemon can run).
async fn follow(ctl: Arc<Controller>, plugin: Arc<Plugin>, mps: bool) {
    let mut changes = ctl.changes();
    let mut failing = false;
    loop {
        let c = ctl.clone();
        match tokio::task::spawn_blocking(move || c.apply(Action::Capacity)).await {
            Ok(Ok(Outcome::Capacity(mut snapshot))) => {
                failing = false;
                snapshot.offer.mps &= mps;
                plugin.update(*snapshot);
            }
            // The controller logged the failure; say once that the lists are stale.
            Ok(Err(_)) | Ok(Ok(_)) | Err(_) if !failing => {
                failing = true;
                warn!("cannot read the node's capacity: the device plugin keeps its last lists");
            }
            _ => {}
        }
        tokio::select! {
            r = changes.changed() => if r.is_err() { return },
            _ = tokio::time::sleep(RESYNC) => {}
        }
    }
}
