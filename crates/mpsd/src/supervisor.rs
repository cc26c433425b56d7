//! Supervised MPS shares: one control daemon per (device, tenant).
//!
//! A share is one tenant's control daemon on one device (a whole GPU or a MIG instance),
//! with its own pipe and log directories (see [`crate::layout`]). Its caps, the default
//! active thread percentage and the default device pinned-memory limit, are set
//! daemon-side and read back through the control protocol before
//! [`Supervisor::ensure_share`] returns, so before any container of the tenant can
//! connect. Clients can only lower them.
//!
//! Caps per tenant and device: a daemon has one per-client cap, so a tenant has one cap per
//! device. The containers of a tenant that ask the same `mps=PCT` on a device join its
//! daemon, each booking PCT% of the device; a different PCT is refused here
//! ([`MpsError::CapConflict`]) and [`crate::pick_mps_device`] sends it to another device.
//! The sum of bookings on a device never exceeds 100% ([`MpsError::NoRoom`]).
//!
//! Note what MPS caps are: per client process. A container running two CUDA processes can
//! use its cap twice; the booking assumes one CUDA process per container.
//!
//! Supervision ([`Supervisor::health_check_all`], to be called periodically): a daemon
//! whose process is gone, or that stops answering `get_server_list`, is a crash, recorded
//! with its device and tenant ([`CrashEvent`]). The first crash in the window restarts it
//! at once; each further crash waits twice as long (from [`SupervisorConfig::backoff_base`]
//! up to `backoff_max`); more than [`SupervisorConfig::max_restarts`] crashes within
//! [`SupervisorConfig::crash_window`] marks the share [`ShareState::Degraded`]: no more
//! restarts and no new containers, until its containers are gone and it is released.
//! A restarted daemon gets its caps set and read back again (a daemon forgets them).
//!
//! Caps are also read back on every health check, because a container can change them: its
//! CUDA clients reach the daemon through the `control` socket of the pipe dir, and any
//! process that can connect there can send control commands. A default cap, or a cap of one
//! of the daemon's servers, that reads other than what the share was given is set again
//! (defaults through [`Supervisor::configure`], read back), each server whose own caps
//! drifted is shut down with `-f` (its clients keep the caps they connected with, so they
//! go; the next client gets a server with the right caps), and the drift is reported
//! ([`HealthEvent::CapDrift`], [`ShareStatus::cap_drifts`]). Caps that cannot be set again
//! make it a crash (killed, restarted with its caps). The window is one health check;
//! a cap raised and put back between two checks is not seen.
//!
//! Lifecycle: [`Supervisor::release`] stops the daemon with `quit` when its last holder
//! (container) goes; [`Supervisor::adopt_existing`], at tesserad start, takes over the
//! daemons a previous tesserad left running (same PIDs, no second daemon), restarts those
//! whose containers are still recorded but whose daemon died meanwhile, and removes what
//! nobody holds; [`Supervisor::shutdown_all`] quits every daemon and forgets every share:
//! for draining a node, not for a tesserad restart (live containers would lose MPS).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tessera_api::BindMount;
use tracing::{error, info, warn};

use crate::clock::{Clock, SystemClock};
use crate::control::{DaemonSpec, MpsControl};
use crate::layout::{self, ShareDirs, ShareRecord, CONTAINER_PIPE_DIR};
use crate::protocol::{self, Command, DeviceRef, MemLimit};
use crate::pure::{MpsDeviceLoad, MpsShareLoad};
use crate::MpsError;

/// Restart, crash-loop and shutdown tuning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SupervisorConfig {
    /// The wait before the second restart within the window; doubles after each crash.
    pub backoff_base: Duration,
    pub backoff_max: Duration,
    /// Restarts allowed within `crash_window`; one crash more marks the share degraded.
    pub max_restarts: u32,
    pub crash_window: Duration,
    /// Consecutive failed health pings of a live daemon before it is killed and restarted.
    pub max_ping_failures: u32,
    /// How long a daemon told to `quit` may take to exit before it is killed.
    pub stop_timeout: Duration,
    /// How many crash records are kept in memory (oldest dropped first).
    pub max_crash_records: usize,
    /// Where per-share `/dev/shm` directories live (a directory on a tmpfs, e.g.
    /// `/dev/shm/tessera-mps`). None: no private `/dev/shm` (the test double needs none;
    /// real MPS clients in containers do, so set it with the real control binary).
    pub shm_root: Option<PathBuf>,
}

impl Default for SupervisorConfig {
    fn default() -> Self {
        SupervisorConfig {
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(60),
            max_restarts: 5,
            crash_window: Duration::from_secs(600),
            max_ping_failures: 2,
            stop_timeout: Duration::from_secs(5),
            max_crash_records: 256,
            shm_root: None,
        }
    }
}

impl SupervisorConfig {
    /// The wait before restarting after the `n`-th crash within the window (n >= 1).
    pub fn backoff(&self, n: u32) -> Duration {
        if n <= 1 {
            return Duration::ZERO;
        }
        let factor = 1u32.checked_shl(n - 2).unwrap_or(u32::MAX);
        self.backoff_base.checked_mul(factor).unwrap_or(self.backoff_max).min(self.backoff_max)
    }
}

/// A container's request for an MPS share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareRequest {
    /// The device UUID (`GPU-...` or `MIG-...`).
    pub device: String,
    /// The tenant path.
    pub tenant: String,
    /// The container id holding the share.
    pub holder: String,
    /// 1..=100: the thread percentage, and the share of device memory `mem_limit_bytes` is.
    pub percent: u8,
    /// The per-client pinned-memory cap (see [`crate::mps_mem_limit_bytes`]); rounded down
    /// to whole MiB.
    pub mem_limit_bytes: u64,
}

/// The lifecycle of a share.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum ShareState {
    /// The daemon runs with its caps.
    Running,
    /// The daemon is gone; it is restarted at `at_ms` (Unix ms) or later.
    Restarting { at_ms: u64 },
    /// Crash loop: not restarted, no new containers.
    Degraded { reason: String },
}

impl ShareState {
    /// Whether another container may join the share.
    pub fn can_join(&self) -> bool {
        matches!(self, ShareState::Running)
    }

    /// Whether the daemon may be restarted at `now_ms`.
    pub fn can_restart(&self, now_ms: u64) -> bool {
        matches!(self, ShareState::Restarting { at_ms } if now_ms >= *at_ms)
    }

    /// Whether the supervisor still watches the daemon.
    pub fn is_supervised(&self) -> bool {
        !matches!(self, ShareState::Degraded { .. })
    }

    fn describe(&self) -> String {
        match self {
            ShareState::Running => "running".into(),
            ShareState::Restarting { at_ms } => format!("restarting at {at_ms}"),
            ShareState::Degraded { reason } => format!("degraded: {reason}"),
        }
    }
}

/// What a container gets for its share.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShareHandle {
    pub device: String,
    pub tenant: String,
    /// The control daemon's PID.
    pub pid: u32,
    pub percent: u8,
    pub mem_limit: MemLimit,
    /// Host path of the pipe directory.
    pub pipe_dir: PathBuf,
    /// Host path of the share's `/dev/shm`, when private shm is configured.
    pub shm_dir: Option<PathBuf>,
}

impl ShareHandle {
    /// The mounts the container gets: the pipe dir at `/tmp/nvidia-mps`, read-only (clients
    /// connect to the sockets in it, which a read-only mount allows; nothing can be created,
    /// renamed or planted there from inside) and, with private shm, the share's shm dir at
    /// `/dev/shm`.
    pub fn mounts(&self) -> Vec<BindMount> {
        let mut m = vec![BindMount {
            source: self.pipe_dir.display().to_string(),
            destination: CONTAINER_PIPE_DIR.into(),
            read_only: true,
        }];
        if let Some(shm) = &self.shm_dir {
            m.push(BindMount {
                source: shm.display().to_string(),
                destination: "/dev/shm".into(),
                read_only: false,
            });
        }
        m
    }

    /// The environment the container gets (device nodes and `CUDA_VISIBLE_DEVICES` come from
    /// the device's own injection).
    pub fn env(&self) -> Vec<String> {
        vec![format!("CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIR}")]
    }
}

/// One share, for `GET /v1/status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShareStatus {
    pub device: String,
    pub tenant: String,
    pub percent: u8,
    pub mem_limit_bytes: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    #[serde(flatten)]
    pub state: ShareState,
    pub holders: Vec<String>,
    /// Restarts since the share was created or adopted.
    pub restarts: u32,
    pub crashes_in_window: u32,
    /// Health checks since the share was created or adopted that found its caps changed
    /// (and set them again).
    #[serde(default)]
    pub cap_drifts: u32,
    pub pipe_dir: PathBuf,
    /// The active thread percentage its caps are set to (`percent`, or lower once
    /// throttled).
    #[serde(default)]
    pub threads: u8,
}

/// A control daemon that died or hung, with whose it was.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CrashEvent {
    pub device: String,
    pub tenant: String,
    /// Unix ms.
    pub at_ms: u64,
    /// The daemon's PID, when known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// What was seen, with the tail of the daemon's log.
    pub detail: String,
}

/// Something supervision did or saw.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum HealthEvent {
    Crashed(CrashEvent),
    /// A live daemon did not answer a health ping (`failures` in a row).
    Unresponsive {
        device: String,
        tenant: String,
        pid: u32,
        failures: u32,
        detail: String,
    },
    Restarted {
        device: String,
        tenant: String,
        old_pid: Option<u32>,
        new_pid: u32,
    },
    RestartScheduled {
        device: String,
        tenant: String,
        at_ms: u64,
    },
    Degraded {
        device: String,
        tenant: String,
        crashes: u32,
        reason: String,
    },
    /// The caps read back at a health check were not the share's (someone with access to
    /// the control socket changed them): set again (`restored`), and the servers whose own
    /// caps had changed shut down with their clients.
    CapDrift {
        device: String,
        tenant: String,
        pid: u32,
        /// What read otherwise, e.g. `default active thread percentage reads 100, not 25`.
        detail: String,
        restored: bool,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        servers_stopped: Vec<u32>,
    },
}

/// What [`Supervisor::release`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Release {
    /// The last holder left: the daemon was told to quit and the share removed.
    Stopped { pid: Option<u32> },
    /// Other containers still hold the share.
    StillHeld { remaining: usize },
    /// The holder held no such share (already released).
    NotHeld,
}

/// What [`Supervisor::adopt_existing`] found.
#[derive(Debug, Default)]
pub struct AdoptReport {
    /// (device, tenant, pid) of each live daemon taken over.
    pub adopted: Vec<(String, String, u32)>,
    /// Crashes found (daemons that died while no tesserad watched) and restarts made.
    pub events: Vec<HealthEvent>,
    /// Share directories removed: no holder, or no record.
    pub removed: Vec<PathBuf>,
    /// Directories left alone because they could not be understood.
    pub problems: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    device: String,
    tenant: String,
}

#[derive(Debug)]
struct Share {
    dirs: ShareDirs,
    spec: DaemonSpec,
    percent: u8,
    mem: MemLimit,
    holders: BTreeSet<String>,
    pid: Option<u32>,
    state: ShareState,
    crash_times: VecDeque<u64>,
    restarts: u32,
    ping_failures: u32,
    cap_drifts: u32,
    /// Lowered thread cap ([`Supervisor::throttle`]); `None`: `percent`.
    throttle: Option<u8>,
}

impl Share {
    fn new(dirs: ShareDirs, device: &str, percent: u8, mem: MemLimit) -> Share {
        let spec = DaemonSpec {
            device: device.to_string(),
            pipe_dir: dirs.pipe.clone(),
            log_dir: dirs.log.clone(),
            shm_dir: dirs.shm.clone(),
        };
        Share {
            dirs,
            spec,
            percent,
            mem,
            holders: BTreeSet::new(),
            pid: None,
            state: ShareState::Running,
            crash_times: VecDeque::new(),
            restarts: 0,
            ping_failures: 0,
            cap_drifts: 0,
            throttle: None,
        }
    }

    fn record(&self, key: &Key) -> ShareRecord {
        ShareRecord {
            device: key.device.clone(),
            tenant: key.tenant.clone(),
            percent: self.percent,
            mem_limit_mib: self.mem.mib(),
            holders: self.holders.iter().cloned().collect(),
            degraded: match &self.state {
                ShareState::Degraded { reason } => Some(reason.clone()),
                _ => None,
            },
            throttle: self.throttle,
        }
    }

    /// The active thread percentage its caps are set to: its booking, or lower when the
    /// interference controller throttled it ([`Supervisor::throttle`]).
    fn threads(&self) -> u8 {
        self.throttle.unwrap_or(self.percent).min(self.percent)
    }

    fn handle(&self, key: &Key, pid: u32) -> ShareHandle {
        ShareHandle {
            device: key.device.clone(),
            tenant: key.tenant.clone(),
            pid,
            percent: self.percent,
            mem_limit: self.mem,
            pipe_dir: self.dirs.pipe.clone(),
            shm_dir: self.dirs.shm.clone(),
        }
    }

    /// Bookings on the device: one `percent` per holder.
    fn booked(&self) -> u32 {
        u32::from(self.percent) * u32::try_from(self.holders.len()).unwrap_or(u32::MAX)
    }
}

/// What a health check's read-back found off.
#[derive(Debug, Default)]
struct Drift {
    details: Vec<String>,
    /// Servers whose own caps are off.
    servers: Vec<u32>,
}

#[derive(Debug, Default)]
struct Inner {
    shares: BTreeMap<Key, Share>,
    crashes: VecDeque<CrashEvent>,
    /// Events of checks made outside [`Supervisor::health_check_all`] (a container joining
    /// a share), handed out by the next one.
    pending: Vec<HealthEvent>,
}

/// Supervises the MPS control daemons of one node.
#[derive(Debug)]
pub struct Supervisor {
    control: Arc<dyn MpsControl>,
    state_dir: PathBuf,
    clock: Arc<dyn Clock>,
    config: SupervisorConfig,
    inner: Mutex<Inner>,
}

impl Supervisor {
    /// Supervise through `control`, keeping shares under `<state_dir>/mps`.
    pub fn new(control: Arc<dyn MpsControl>, state_dir: impl Into<PathBuf>) -> Supervisor {
        Supervisor {
            control,
            state_dir: state_dir.into(),
            clock: Arc::new(SystemClock),
            config: SupervisorConfig::default(),
            inner: Mutex::new(Inner::default()),
        }
    }

    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    pub fn with_config(mut self, config: SupervisorConfig) -> Self {
        self.config = config;
        self
    }

    pub fn config(&self) -> &SupervisorConfig {
        &self.config
    }

    /// The share state is rewritten on disk after every change, so a panic elsewhere
    /// leaves nothing half-done that the next caller could not carry on from.
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn dirs(&self, device: &str, tenant: &str) -> Result<ShareDirs, MpsError> {
        ShareDirs::new(&self.state_dir, self.config.shm_root.as_deref(), device, tenant)
    }

    /// Give `req.holder` its share of `req.device`: start the tenant's control daemon on
    /// that device if there is none, with its caps set and read back, or join the running
    /// one. Idempotent per holder.
    pub fn ensure_share(&self, req: &ShareRequest) -> Result<ShareHandle, MpsError> {
        if !(1..=100).contains(&req.percent) {
            return Err(MpsError::Invalid(format!(
                "mps={} is not a percentage from 1 to 100",
                req.percent
            )));
        }
        if req.holder.is_empty()
            || req.holder.len() > 256
            || req.holder.chars().any(char::is_control)
        {
            return Err(MpsError::Invalid(format!(
                "holder `{}` is not a container id",
                protocol::sanitize(&req.holder, 80)
            )));
        }
        let mem = MemLimit::from_bytes_floor(req.mem_limit_bytes).ok_or_else(|| {
            MpsError::Invalid(format!(
                "a pinned-memory cap of {} bytes is under 1 MiB",
                req.mem_limit_bytes
            ))
        })?;
        let dirs = self.dirs(&req.device, &req.tenant)?;
        let key = Key { device: req.device.clone(), tenant: req.tenant.clone() };
        let mut guard = self.lock();
        let inner = &mut *guard;

        if let Some(share) = inner.shares.get(&key) {
            if let ShareState::Degraded { reason } = &share.state {
                return Err(MpsError::Degraded {
                    device: key.device,
                    tenant: key.tenant,
                    reason: reason.clone(),
                });
            }
            if share.percent != req.percent || share.mem != mem {
                return Err(MpsError::CapConflict {
                    device: key.device,
                    tenant: key.tenant,
                    held: share.percent,
                    asked: req.percent,
                });
            }
            if !share.holders.contains(&req.holder) {
                check_room(inner, &key, req.percent)?;
            }
            // A container is about to rely on this daemon: make sure it is there, with its
            // caps. What that finds is reported by the next health_check_all.
            let mut seen = Vec::new();
            self.check_one(inner, &key, &mut seen);
            inner.pending.extend(seen);
            let Some(share) = inner.shares.get_mut(&key) else {
                return Err(MpsError::NotRunning {
                    device: key.device,
                    tenant: key.tenant,
                    state: "gone".into(),
                });
            };
            let (true, Some(pid)) = (share.state.can_join(), share.pid) else {
                return Err(MpsError::NotRunning {
                    device: key.device,
                    tenant: key.tenant,
                    state: share.state.describe(),
                });
            };
            if share.holders.insert(req.holder.clone()) {
                layout::write_record(&share.dirs.record(), &share.record(&key))?;
                info!(device = %key.device, tenant = %key.tenant, holder = %req.holder, pid, "joined mps share");
            }
            return Ok(share.handle(&key, pid));
        }

        check_room(inner, &key, req.percent)?;
        match layout::read_record(&dirs.record())? {
            Some(r) if r.device != key.device || r.tenant != key.tenant => {
                return Err(MpsError::Foreign {
                    path: dirs.root.clone(),
                    found: format!("tenant {} on {}", r.tenant, r.device),
                    expected: format!("tenant {} on {}", key.tenant, key.device),
                });
            }
            _ => {}
        }
        let mut share = Share::new(dirs, &key.device, req.percent, mem);
        share.holders.insert(req.holder.clone());
        // A daemon nobody supervises (left by a crash before its record was written, or
        // never adopted) has unknown caps: it goes before ours starts.
        if let Some(stray) = self.control.daemon_pid(&share.spec) {
            warn!(device = %key.device, tenant = %key.tenant, pid = stray, "stopping an unsupervised mps control daemon");
            self.stop_daemon(&share.spec, stray);
        }
        std::fs::create_dir_all(&share.dirs.root).map_err(|e| MpsError::io(&share.dirs.root, e))?;
        // The record goes first: if tesserad dies before it answers, the next one finds the
        // daemon and its holder, and checks its caps again.
        layout::write_record(&share.dirs.record(), &share.record(&key))?;
        match self.start_and_configure(&key, &share) {
            Ok(pid) => {
                share.pid = Some(pid);
                info!(device = %key.device, tenant = %key.tenant, holder = %req.holder, pid,
                      percent = req.percent, mem_limit = %mem, "started mps control daemon");
                let handle = share.handle(&key, pid);
                inner.shares.insert(key, share);
                Ok(handle)
            }
            Err(e) => {
                remove_share_dirs(&share.dirs);
                Err(e)
            }
        }
    }

    /// `holder` no longer holds its share of `device`; the last holder's release stops the
    /// daemon (`quit`) and removes the share's directories. Idempotent.
    pub fn release(&self, device: &str, tenant: &str, holder: &str) -> Result<Release, MpsError> {
        let key = Key { device: device.to_string(), tenant: tenant.to_string() };
        let mut inner = self.lock();
        let Some(share) = inner.shares.get_mut(&key) else { return Ok(Release::NotHeld) };
        if !share.holders.remove(holder) {
            return Ok(Release::NotHeld);
        }
        if !share.holders.is_empty() {
            layout::write_record(&share.dirs.record(), &share.record(&key))?;
            return Ok(Release::StillHeld { remaining: share.holders.len() });
        }
        let Some(share) = inner.shares.remove(&key) else { return Ok(Release::NotHeld) };
        if let Some(pid) = share.pid {
            self.stop_daemon(&share.spec, pid);
        }
        info!(device, tenant, pid = ?share.pid, "stopped mps control daemon: its last container is gone");
        remove_share_dirs(&share.dirs);
        Ok(Release::Stopped { pid: share.pid })
    }

    /// Check every supervised daemon; restart the dead ones that are due; report what
    /// happened. Call it periodically.
    pub fn health_check_all(&self) -> Vec<HealthEvent> {
        let mut inner = self.lock();
        let keys: Vec<Key> = inner.shares.keys().cloned().collect();
        let mut events = std::mem::take(&mut inner.pending);
        for key in keys {
            self.check_one(&mut inner, &key, &mut events);
        }
        events
    }

    /// Check one share; restart it if due (at most once per call).
    fn check_one(&self, inner: &mut Inner, key: &Key, events: &mut Vec<HealthEvent>) {
        let now = self.clock.now_ms();
        let Inner { shares, crashes, .. } = inner;
        let Some(share) = shares.get_mut(key) else { return };
        if let (ShareState::Running, Some(pid)) = (&share.state, share.pid) {
            if self.control.daemon_pid(&share.spec) == Some(pid) {
                let checked =
                    self.ping(&share.spec).and_then(|servers| self.cap_drift(key, share, &servers));
                match checked {
                    Ok(drift) => {
                        share.ping_failures = 0;
                        if !drift.details.is_empty() {
                            self.restore_caps(key, share, pid, &drift, crashes, now, events);
                        }
                    }
                    Err(e) => {
                        share.ping_failures += 1;
                        warn!(device = %key.device, tenant = %key.tenant, pid, failures = share.ping_failures,
                              "mps control daemon did not answer: {e}");
                        events.push(HealthEvent::Unresponsive {
                            device: key.device.clone(),
                            tenant: key.tenant.clone(),
                            pid,
                            failures: share.ping_failures,
                            detail: e.to_string(),
                        });
                        if share.ping_failures >= self.config.max_ping_failures {
                            let _ = self.control.kill_daemon(&share.spec, pid);
                            let detail = format!(
                                "killed after {} unanswered health checks: {e}",
                                share.ping_failures
                            );
                            self.crashed(key, share, crashes, detail, now, events);
                        }
                    }
                }
            } else {
                // The process is gone (or its PID now belongs to something else). A daemon
                // whose PID file vanished but whose process lives is killed first, so the
                // restart never leaves two daemons on one pipe dir.
                let _ = self.control.kill_daemon(&share.spec, pid);
                let detail = format!("control daemon pid {pid} is gone");
                self.crashed(key, share, crashes, detail, now, events);
            }
        }
        if share.state.can_restart(now) {
            let old_pid = share.pid.take();
            match self.start_and_configure(key, share) {
                Ok(new_pid) => {
                    share.pid = Some(new_pid);
                    share.state = ShareState::Running;
                    share.restarts += 1;
                    share.ping_failures = 0;
                    info!(device = %key.device, tenant = %key.tenant, new_pid, restarts = share.restarts,
                          "restarted mps control daemon");
                    events.push(HealthEvent::Restarted {
                        device: key.device.clone(),
                        tenant: key.tenant.clone(),
                        old_pid,
                        new_pid,
                    });
                }
                Err(e) => {
                    if let Some(pid) = self.control.daemon_pid(&share.spec) {
                        let _ = self.control.kill_daemon(&share.spec, pid);
                    }
                    self.crashed(key, share, crashes, format!("restart failed: {e}"), now, events);
                }
            }
        }
    }

    /// Record a crash of `share` and decide: restart (now or later) or degrade.
    fn crashed(
        &self,
        key: &Key,
        share: &mut Share,
        crashes: &mut VecDeque<CrashEvent>,
        detail: String,
        now: u64,
        events: &mut Vec<HealthEvent>,
    ) {
        let tail = log_tail(&share.dirs.log.join("control.log"));
        let detail =
            if tail.is_empty() { detail } else { format!("{detail}; control.log ends: {tail}") };
        let event = CrashEvent {
            device: key.device.clone(),
            tenant: key.tenant.clone(),
            at_ms: now,
            pid: share.pid.take(),
            detail,
        };
        warn!(device = %event.device, tenant = %event.tenant, pid = ?event.pid, "mps control daemon crashed: {}", event.detail);
        crashes.push_back(event.clone());
        while crashes.len() > self.config.max_crash_records {
            crashes.pop_front();
        }
        events.push(HealthEvent::Crashed(event));
        share.ping_failures = 0;
        share.crash_times.push_back(now);
        let window = u64::try_from(self.config.crash_window.as_millis()).unwrap_or(u64::MAX);
        while share.crash_times.front().is_some_and(|t| now.saturating_sub(*t) > window) {
            share.crash_times.pop_front();
        }
        let n = u32::try_from(share.crash_times.len()).unwrap_or(u32::MAX);
        if n > self.config.max_restarts {
            let reason = format!("{n} crashes within {} s", self.config.crash_window.as_secs());
            error!(device = %key.device, tenant = %key.tenant, "mps share degraded, no more restarts: {reason}");
            share.state = ShareState::Degraded { reason: reason.clone() };
            if let Err(e) = layout::write_record(&share.dirs.record(), &share.record(key)) {
                error!(device = %key.device, tenant = %key.tenant, "cannot record the degraded share: {e}");
            }
            events.push(HealthEvent::Degraded {
                device: key.device.clone(),
                tenant: key.tenant.clone(),
                crashes: n,
                reason,
            });
        } else {
            let delay = u64::try_from(self.config.backoff(n).as_millis()).unwrap_or(u64::MAX);
            let at_ms = now.saturating_add(delay);
            share.state = ShareState::Restarting { at_ms };
            if delay > 0 {
                events.push(HealthEvent::RestartScheduled {
                    device: key.device.clone(),
                    tenant: key.tenant.clone(),
                    at_ms,
                });
            }
        }
    }

    /// Take over the control daemons a previous tesserad left under the state dir. Call it
    /// once at start, before any allocation; calling it again adopts nothing twice.
    pub fn adopt_existing(&self) -> Result<AdoptReport, MpsError> {
        let mut report = AdoptReport::default();
        let root = self.state_dir.join(layout::MPS_DIR);
        let mut inner = self.lock();
        for share_dir in share_dirs(&root)? {
            let record = match layout::read_record(&share_dir.join(layout::SHARE_FILE)) {
                Ok(r) => r,
                Err(e) => {
                    report.problems.push(format!("{}: {e}; left alone", share_dir.display()));
                    continue;
                }
            };
            let Some(record) = record else {
                // No record: a share that never finished starting. Its daemon, if any, has
                // unknown caps and no holder.
                let pipe = share_dir.join("pipe");
                let spec = DaemonSpec {
                    device: String::new(),
                    pipe_dir: pipe,
                    log_dir: share_dir.join("log"),
                    shm_dir: None,
                };
                if let Some(pid) = self.control.daemon_pid(&spec) {
                    self.stop_daemon(&spec, pid);
                }
                if std::fs::remove_dir_all(&share_dir).is_ok() {
                    report.removed.push(share_dir);
                }
                continue;
            };
            let dirs = match self.dirs(&record.device, &record.tenant) {
                Ok(d) if d.root == share_dir => d,
                Ok(d) => {
                    report.problems.push(format!(
                        "{}: its record names tenant {} on {}, whose share lives in {}; left alone",
                        share_dir.display(),
                        record.tenant,
                        record.device,
                        d.root.display()
                    ));
                    continue;
                }
                Err(e) => {
                    report.problems.push(format!("{}: {e}; left alone", share_dir.display()));
                    continue;
                }
            };
            let key = Key { device: record.device.clone(), tenant: record.tenant.clone() };
            if inner.shares.contains_key(&key) {
                continue;
            }
            let Some(mem) = MemLimit::from_mib(record.mem_limit_mib)
                .filter(|_| (1..=100).contains(&record.percent))
            else {
                report.problems.push(format!(
                    "{}: its record has no valid caps; left alone",
                    share_dir.display()
                ));
                continue;
            };
            let mut share = Share::new(dirs, &key.device, record.percent, mem);
            share.holders = record.holders.iter().cloned().collect();
            share.throttle = record.throttle.filter(|t| (1..record.percent).contains(t));
            let live = self.control.daemon_pid(&share.spec);
            if let Some(reason) = record.degraded {
                share.pid = live;
                share.state = ShareState::Degraded { reason };
                inner.shares.insert(key, share);
                continue;
            }
            if share.holders.is_empty() {
                if let Some(pid) = live {
                    self.stop_daemon(&share.spec, pid);
                }
                remove_share_dirs(&share.dirs);
                report.removed.push(share.dirs.root.clone());
                continue;
            }
            match live {
                Some(pid) => {
                    share.pid = Some(pid);
                    // The previous tesserad may have died between start and caps: check them,
                    // and set them again if they are not what the record says.
                    if let Err(e) = self.verify_caps(&key, &share) {
                        warn!(device = %key.device, tenant = %key.tenant, pid, "adopted daemon's caps are off ({e}); setting them again");
                        if let Err(e) = self.configure(&key, &share) {
                            let _ = self.control.kill_daemon(&share.spec, pid);
                            let mut events = Vec::new();
                            let Inner { crashes, .. } = &mut *inner;
                            self.crashed(
                                &key,
                                &mut share,
                                crashes,
                                format!("adopted with wrong caps: {e}"),
                                self.clock.now_ms(),
                                &mut events,
                            );
                            report.events.extend(events);
                            inner.shares.insert(key.clone(), share);
                            let mut events = Vec::new();
                            self.check_one(&mut inner, &key, &mut events);
                            report.events.extend(events);
                            continue;
                        }
                    }
                    info!(device = %key.device, tenant = %key.tenant, pid, holders = share.holders.len(), "adopted mps control daemon");
                    report.adopted.push((key.device.clone(), key.tenant.clone(), pid));
                    inner.shares.insert(key, share);
                }
                None => {
                    let mut events = Vec::new();
                    {
                        let Inner { crashes, .. } = &mut *inner;
                        let detail =
                            "control daemon gone while no tesserad supervised it".to_string();
                        self.crashed(
                            &key,
                            &mut share,
                            crashes,
                            detail,
                            self.clock.now_ms(),
                            &mut events,
                        );
                    }
                    inner.shares.insert(key.clone(), share);
                    self.check_one(&mut inner, &key, &mut events);
                    report.events.extend(events);
                }
            }
        }
        Ok(report)
    }

    /// Quit every control daemon and forget every share (node drain). Returns the shares
    /// stopped, (device, tenant, pid).
    pub fn shutdown_all(&self) -> Vec<(String, String, Option<u32>)> {
        let mut inner = self.lock();
        let mut stopped = Vec::new();
        for (key, share) in std::mem::take(&mut inner.shares) {
            if let Some(pid) = share.pid.or_else(|| self.control.daemon_pid(&share.spec)) {
                self.stop_daemon(&share.spec, pid);
            }
            remove_share_dirs(&share.dirs);
            info!(device = %key.device, tenant = %key.tenant, pid = ?share.pid, "stopped mps control daemon at shutdown");
            stopped.push((key.device, key.tenant, share.pid));
        }
        stopped
    }

    /// Every share, ordered by device then tenant.
    pub fn shares(&self) -> Vec<ShareStatus> {
        let inner = self.lock();
        inner
            .shares
            .iter()
            .map(|(k, s)| ShareStatus {
                device: k.device.clone(),
                tenant: k.tenant.clone(),
                percent: s.percent,
                mem_limit_bytes: s.mem.bytes(),
                pid: s.pid,
                state: s.state.clone(),
                holders: s.holders.iter().cloned().collect(),
                restarts: s.restarts,
                crashes_in_window: u32::try_from(s.crash_times.len()).unwrap_or(u32::MAX),
                cap_drifts: s.cap_drifts,
                pipe_dir: s.dirs.pipe.clone(),
                threads: s.threads(),
            })
            .collect()
    }

    /// Lower the active thread percentage of `tenant`'s share of `device` to `percent`
    /// (the interference controller's throttle): the daemon's default and every running
    /// server's, each read back. Its booking (`percent` of the grant) is unchanged, and
    /// health checks keep the lowered caps from now on (a restart sets them again). On
    /// NVIDIA's MPS a server's percentage applies to clients that connect afterwards; a
    /// client already connected keeps the cap it connected with. Returns the percentage
    /// before.
    pub fn throttle(&self, device: &str, tenant: &str, percent: u8) -> Result<u8, MpsError> {
        let key = Key { device: device.to_string(), tenant: tenant.to_string() };
        let mut inner = self.lock();
        let Some(share) = inner.shares.get_mut(&key) else {
            return Err(MpsError::NotRunning {
                device: key.device,
                tenant: key.tenant,
                state: "no such share".into(),
            });
        };
        if !(1..=100).contains(&percent) {
            return Err(MpsError::Invalid(format!("a thread percentage of {percent}")));
        }
        let before = share.threads();
        if percent >= before {
            return Ok(before);
        }
        share.throttle = Some(percent);
        let send = self
            .control
            .send(&share.spec, &Command::SetDefaultActiveThreadPercentage(percent))
            .and_then(|_| self.ping(&share.spec))
            .and_then(|servers| {
                for server_pid in servers {
                    self.control.send(
                        &share.spec,
                        &Command::SetActiveThreadPercentage { server_pid, percent },
                    )?;
                }
                self.verify_caps(&key, share)
            });
        if let Err(e) = send {
            // The health check sets the lowered caps again (or restarts the daemon with them).
            warn!(device, tenant, percent, "throttling the mps share did not read back: {e}");
        }
        layout::write_record(&share.dirs.record(), &share.record(&key))?;
        info!(device, tenant, before, percent, "mps share throttled");
        Ok(before)
    }

    /// The crashes recorded since start (the latest [`SupervisorConfig::max_crash_records`]).
    pub fn crashes(&self) -> Vec<CrashEvent> {
        self.lock().crashes.iter().cloned().collect()
    }

    /// The bookings on each of `devices`, in that order, for [`crate::pick_mps_device`].
    pub fn device_loads(&self, devices: &[String]) -> Vec<MpsDeviceLoad> {
        let inner = self.lock();
        devices
            .iter()
            .map(|uuid| MpsDeviceLoad {
                uuid: uuid.clone(),
                shares: inner
                    .shares
                    .iter()
                    .filter(|(k, _)| &k.device == uuid)
                    .flat_map(|(k, s)| {
                        s.holders
                            .iter()
                            .map(|_| MpsShareLoad { tenant: k.tenant.clone(), percent: s.percent })
                    })
                    .collect(),
            })
            .collect()
    }

    /// `get_server_list`: the daemon answers, with its servers.
    fn ping(&self, spec: &DaemonSpec) -> Result<Vec<u32>, MpsError> {
        let cmd = Command::GetServerList;
        let answer = self.control.send(spec, &cmd)?;
        protocol::parse_pid_list(&answer).map_err(|source| MpsError::BadAnswer {
            command: cmd.render(),
            pipe_dir: spec.pipe_dir.clone(),
            source,
        })
    }

    /// Start the share's daemon and set its caps; a daemon that does not take them is
    /// stopped again.
    fn start_and_configure(&self, key: &Key, share: &Share) -> Result<u32, MpsError> {
        let pid = self.control.start_daemon(&share.spec)?;
        if let Err(e) = self.configure(key, share) {
            self.stop_daemon(&share.spec, pid);
            return Err(e);
        }
        Ok(pid)
    }

    /// Set the daemon-side caps, then read them back.
    fn configure(&self, key: &Key, share: &Share) -> Result<(), MpsError> {
        let device = DeviceRef::Uuid(key.device.clone());
        self.control
            .send(&share.spec, &Command::SetDefaultActiveThreadPercentage(share.threads()))?;
        self.control.send(
            &share.spec,
            &Command::SetDefaultDevicePinnedMemLimit { device, limit: share.mem },
        )?;
        self.verify_caps(key, share)
    }

    /// Read the caps back through the control protocol and compare.
    fn verify_caps(&self, key: &Key, share: &Share) -> Result<(), MpsError> {
        let off = self.default_caps_off(key, share)?;
        if off.is_empty() {
            return Ok(());
        }
        Err(MpsError::CapsNotApplied {
            device: key.device.clone(),
            tenant: key.tenant.clone(),
            detail: off.join("; "),
        })
    }

    /// The daemon's default caps that read otherwise than the share's, described; an answer
    /// that cannot be read is an error.
    fn default_caps_off(&self, key: &Key, share: &Share) -> Result<Vec<String>, MpsError> {
        let answer_err = |cmd: &Command, source| MpsError::BadAnswer {
            command: cmd.render(),
            pipe_dir: share.spec.pipe_dir.clone(),
            source,
        };
        let mut off = Vec::new();
        let cmd = Command::GetDefaultActiveThreadPercentage;
        let threads = protocol::parse_thread_percentage(&self.control.send(&share.spec, &cmd)?)
            .map_err(|e| answer_err(&cmd, e))?;
        if !protocol::thread_percentage_matches(share.threads(), threads) {
            off.push(format!(
                "default active thread percentage reads {threads}, not {}",
                share.threads()
            ));
        }
        let cmd =
            Command::GetDefaultDevicePinnedMemLimit { device: DeviceRef::Uuid(key.device.clone()) };
        let mem = protocol::parse_mem_limit(&self.control.send(&share.spec, &cmd)?)
            .map_err(|e| answer_err(&cmd, e))?;
        if !share.mem.readback_matches(mem) {
            off.push(format!("default device pinned memory limit reads {mem}, not {}", share.mem));
        }
        Ok(off)
    }

    /// Read back the default caps and those of each of `servers` (the daemon's, as just
    /// listed). A server answer that fails or does not parse (the server exited since the
    /// list) is skipped; a default that cannot be read is an error, as an unanswered ping is.
    fn cap_drift(&self, key: &Key, share: &Share, servers: &[u32]) -> Result<Drift, MpsError> {
        let mut drift = Drift { details: self.default_caps_off(key, share)?, servers: Vec::new() };
        let device = DeviceRef::Uuid(key.device.clone());
        let ask = |cmd: &Command| match self.control.send(&share.spec, cmd) {
            Ok(answer) => Ok(answer),
            Err(MpsError::CommandFailed { .. }) => Ok(String::new()),
            Err(e) => Err(e),
        };
        for &server_pid in servers {
            let mut off = Vec::new();
            let answer = ask(&Command::GetActiveThreadPercentage { server_pid })?;
            if let Ok(threads) = protocol::parse_thread_percentage(&answer) {
                if !protocol::thread_percentage_matches(share.threads(), threads) {
                    off.push(format!(
                        "server {server_pid}: active thread percentage reads {threads}, not {}",
                        share.threads()
                    ));
                }
            }
            let cmd = Command::GetDevicePinnedMemLimit { server_pid, device: device.clone() };
            if let Ok(mem) = protocol::parse_mem_limit(&ask(&cmd)?) {
                if !share.mem.readback_matches(mem) {
                    off.push(format!(
                        "server {server_pid}: device pinned memory limit reads {mem}, not {}",
                        share.mem
                    ));
                }
            }
            if !off.is_empty() {
                drift.details.extend(off);
                drift.servers.push(server_pid);
            }
        }
        Ok(drift)
    }

    /// Caps drifted: set the defaults again (and read them back), shut down every server
    /// whose own caps drifted, with its clients (they keep the caps they connected with),
    /// record it. Caps that cannot be set again: kill the daemon, a crash (the restart sets
    /// them).
    #[allow(clippy::too_many_arguments)]
    fn restore_caps(
        &self,
        key: &Key,
        share: &mut Share,
        pid: u32,
        drift: &Drift,
        crashes: &mut VecDeque<CrashEvent>,
        now: u64,
        events: &mut Vec<HealthEvent>,
    ) {
        let detail = drift.details.join("; ");
        let restored = self.configure(key, share);
        let mut servers_stopped = Vec::new();
        for &server in &drift.servers {
            let stop = Command::ShutdownServer { pid: server, force: true };
            match self.control.send(&share.spec, &stop) {
                Ok(_) => servers_stopped.push(server),
                Err(e) => {
                    warn!(device = %key.device, tenant = %key.tenant, server, "cannot shut down an mps server with drifted caps: {e}")
                }
            }
        }
        share.cap_drifts = share.cap_drifts.saturating_add(1);
        warn!(device = %key.device, tenant = %key.tenant, pid, restored = restored.is_ok(), ?servers_stopped,
              "mps caps changed behind the supervisor's back: {detail}");
        events.push(HealthEvent::CapDrift {
            device: key.device.clone(),
            tenant: key.tenant.clone(),
            pid,
            detail,
            restored: restored.is_ok(),
            servers_stopped,
        });
        if let Err(e) = restored {
            let _ = self.control.kill_daemon(&share.spec, pid);
            let detail = format!("killed: its caps drifted and could not be set again: {e}");
            self.crashed(key, share, crashes, detail, now, events);
        }
    }

    /// `quit`, wait for the daemon to exit, SIGKILL it if it does not.
    fn stop_daemon(&self, spec: &DaemonSpec, pid: u32) {
        if let Err(e) = self.control.send(spec, &Command::Quit) {
            warn!(pipe_dir = %spec.pipe_dir.display(), pid, "quit failed: {e}");
        }
        let deadline = Instant::now() + self.config.stop_timeout;
        while self.control.daemon_pid(spec) == Some(pid) {
            if Instant::now() >= deadline {
                warn!(pipe_dir = %spec.pipe_dir.display(), pid, "control daemon ignored quit; killing it");
                if let Err(e) = self.control.kill_daemon(spec, pid) {
                    error!(pipe_dir = %spec.pipe_dir.display(), pid, "cannot kill the control daemon: {e}");
                }
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// Refuse a booking of `percent` more on `key.device` that would exceed 100%.
fn check_room(inner: &Inner, key: &Key, percent: u8) -> Result<(), MpsError> {
    let on_device = inner.shares.iter().filter(|(k, _)| k.device == key.device);
    let booked: u32 = on_device.map(|(_, s)| s.booked()).sum();
    if booked + u32::from(percent) > 100 {
        return Err(MpsError::NoRoom(format!(
            "mps={percent} for tenant {}: device {} has {}% left",
            key.tenant,
            key.device,
            100u32.saturating_sub(booked)
        )));
    }
    Ok(())
}

/// The `<state>/mps/<device>/<tenant>` directories.
fn share_dirs(root: &Path) -> Result<Vec<PathBuf>, MpsError> {
    let list = |dir: &Path| -> Result<Vec<PathBuf>, MpsError> {
        match std::fs::read_dir(dir) {
            Ok(entries) => {
                let mut v: Vec<PathBuf> = entries
                    .filter_map(Result::ok)
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path())
                    .collect();
                v.sort();
                Ok(v)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(MpsError::io(dir, e)),
        }
    };
    let mut out = Vec::new();
    for device in list(root)? {
        out.extend(list(&device)?);
    }
    Ok(out)
}

fn remove_share_dirs(dirs: &ShareDirs) {
    for dir in std::iter::once(&dirs.root).chain(dirs.shm.as_ref()) {
        if let Err(e) = std::fs::remove_dir_all(dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                warn!(dir = %dir.display(), "cannot remove an mps share directory: {e}");
            }
        }
    }
}

/// The last three lines of a log, sanitized, for crash records.
fn log_tail(path: &Path) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(path) else { return String::new() };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(2048)));
    let mut buf = Vec::new();
    let _ = f.read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = lines[lines.len().saturating_sub(3)..].join(" | ");
    protocol::sanitize(&tail, 400)
}

#[cfg(test)]
mod tests;
