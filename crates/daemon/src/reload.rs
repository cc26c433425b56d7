//! `SIGHUP` reloads the local policy file: the signal source only. What a reload may change
//! and how is [`crate::policy_reload`]'s, applied by the controller
//! ([`Action::ReloadPolicy`], also `POST /v1/policy/reload`).

use std::sync::Arc;

use tracing::info;

use crate::controller::{Action, Controller};

/// Reload on every `SIGHUP` until aborted. A failure is logged by the controller.
/// SIGHUP caught from now on (its default action would end the daemon): call this first
/// thing at start, before the state-dir lock wait, NVML and the fleet's first fetch, so
/// that a `systemctl reload` during start-up is a reload once the daemon runs, never its
/// death (systemd's `Restart=on-failure` does not restart a daemon a SIGHUP ended).
pub fn catch_sighup() -> Result<tokio::signal::unix::Signal, std::io::Error> {
    use tokio::signal::unix::{signal, SignalKind};
    signal(SignalKind::hangup())
}

/// Reloads the policy file at each SIGHUP caught by `hup` ([`catch_sighup`]); one that
/// came during start-up is served once the controller exists.
pub fn spawn_sighup(
    ctl: Arc<Controller>,
    mut hup: tokio::signal::unix::Signal,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        while hup.recv().await.is_some() {
            info!("SIGHUP: reloading the policy file");
            // Logged either way: success here in `reload`, a failure by the controller.
            let _ = ctl.run(Action::ReloadPolicy).await;
        }
    })
}
