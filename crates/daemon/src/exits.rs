//! Metering stops when a container's init process exits, not when its grant is given back.
//!
//! tessera-runtime releases a grant once runc has removed the container: after runc's
//! teardown, tens of milliseconds after the process ended (more on a loaded node), and the
//! reconciler only notices a container that vanished without the wrapper at its next tick.
//! The devices stay held until then, but nothing runs on them, so the ledger should not
//! bill that time. A pidfd (Linux ≥ 5.3) becomes readable the moment its process exits: one
//! task per running container waits on it and closes the container's intervals then. Where
//! no pidfd can be had, the intervals close at release, as before.

use std::io;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tracing::debug;

use tessera_api::ContainerId;

use crate::controller::{Action, Controller, Outcome};
use crate::host::pidfd_open;

/// How often a waiting task checks that its container still holds the grant it watches
/// (a grant released while its process lives on — a test's stand-in pid — ends the wait).
const RECHECK: Duration = Duration::from_secs(60);

/// The ledger's close reason for intervals closed at the process's exit.
pub use crate::node::EXITED_REASON;

/// Watch `container_id`'s init process and close its intervals when it exits.
pub fn spawn(ctl: Arc<Controller>, container_id: ContainerId) {
    tokio::spawn(watch(ctl, container_id));
}

/// A pidfd registered with the reactor, readable once its process has exited.
pub(crate) fn watchable(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: the AsyncFd owns the OwnedFd, so the descriptor stays open and the same for
    // the AsyncFd's whole life, and OwnedFd::as_raw_fd always returns it.
    unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }.map_err(|e| e.into_parts().1)
}

/// The pid (and its start time) to watch for `container_id`, if it is running.
async fn watch_target(
    ctl: &Arc<Controller>,
    container_id: &ContainerId,
) -> Option<(i32, Option<u64>)> {
    match ctl.run(Action::ExitWatchTarget(container_id.clone())).await {
        Ok(Outcome::WatchTarget(t)) => t,
        _ => None,
    }
}

/// Close the intervals of the exited container (a failure is logged by the controller).
async fn exited(ctl: &Arc<Controller>, container_id: ContainerId, pid: i32) {
    let _ = ctl.run(Action::ContainerExited { container_id, pid }).await;
}

async fn watch(ctl: Arc<Controller>, container_id: ContainerId) {
    let Some(target) = watch_target(&ctl, &container_id).await else { return };
    let (pid, start) = target;
    let fd = match pidfd_open(pid) {
        Ok(fd) => fd,
        // Already gone between the prestart and now.
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
            return exited(&ctl, container_id, pid).await
        }
        Err(e) => {
            debug!(container = %container_id, pid, "no pidfd ({e}): metering stops at release");
            return;
        }
    };
    // The pid may name a new process by now: the pidfd is the container's only if the
    // process it opened still has the recorded start time.
    // (Only a host whose pids are this kernel's is watched: see `Host::watches_exits`.)
    if crate::host::Host::pid_start_time(&crate::host::LinuxHost, pid) != start {
        return exited(&ctl, container_id, pid).await;
    }
    let Ok(fd) = watchable(fd) else { return };
    loop {
        match tokio::time::timeout(RECHECK, fd.readable()).await {
            Ok(Ok(_)) => break,
            Ok(Err(e)) => {
                debug!(container = %container_id, pid, "waiting on the pidfd failed ({e}): metering stops at release");
                return;
            }
            Err(_) => {
                if watch_target(&ctl, &container_id).await != Some(target) {
                    return;
                }
            }
        }
    }
    exited(&ctl, container_id, pid).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_pidfd_becomes_readable_when_its_process_exits() {
        let mut child = std::process::Command::new("sleep").arg("0.2").spawn().expect("spawn");
        let fd = watchable(pidfd_open(child.id() as i32).expect("pidfd")).expect("fd");
        let t0 = std::time::Instant::now();
        let _ = tokio::time::timeout(Duration::from_secs(10), fd.readable())
            .await
            .expect("exit seen")
            .expect("ready");
        assert!(
            t0.elapsed() >= Duration::from_millis(150),
            "readable before the exit: {:?}",
            t0.elapsed()
        );
        child.wait().expect("reap");
        assert_eq!(
            pidfd_open(i32::MAX).map(drop).map_err(|e| e.raw_os_error()),
            Err(Some(libc::ESRCH))
        );
    }
}
