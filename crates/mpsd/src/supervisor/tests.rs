//! Supervisor logic against an in-memory control seam that records every call and injects
//! failures (start failures, daemons that ignore caps, hung daemons, kills). The same flows
//! against real processes (the test double binary) are in `tests/fake_binary.rs`.

use std::collections::BTreeMap;
use std::sync::Mutex;

use super::*;
use crate::clock::ManualClock;

#[derive(Debug, Clone)]
struct SimDaemon {
    pid: u32,
    alive: bool,
    threads: f64,
    mem_mib: BTreeMap<String, u64>,
    hung: bool,
    /// Server PID -> its caps, taken from the defaults when it started.
    servers: BTreeMap<u32, SimServer>,
}

#[derive(Debug, Clone)]
struct SimServer {
    threads: f64,
    mem_mib: BTreeMap<String, u64>,
}

#[derive(Debug, Default)]
struct SimState {
    daemons: BTreeMap<PathBuf, SimDaemon>,
    next_pid: u32,
    starts: u32,
    fail_starts: u32,
    ignore_caps: bool,
    /// Every call, as `start <pipe>` or `<pipe-leaf> <command>`.
    log: Vec<String>,
}

#[derive(Debug, Default)]
struct SimControl {
    s: Mutex<SimState>,
}

impl SimControl {
    fn st(&self) -> std::sync::MutexGuard<'_, SimState> {
        self.s.lock().expect("sim lock")
    }
    fn kill_by_pid(&self, pid: u32) {
        for d in self.st().daemons.values_mut() {
            if d.pid == pid {
                d.alive = false;
            }
        }
    }
    fn hang(&self, pid: u32) {
        for d in self.st().daemons.values_mut() {
            if d.pid == pid {
                d.hung = true;
            }
        }
    }
    fn starts(&self) -> u32 {
        self.st().starts
    }
    fn live_pids(&self) -> Vec<u32> {
        self.st().daemons.values().filter(|d| d.alive).map(|d| d.pid).collect()
    }
    /// The default caps of the daemon of `pipe`: (threads, MiB of `DEV`).
    fn caps(&self, pipe: &Path) -> (f64, u64) {
        let st = self.st();
        let d = st.daemons.get(pipe).expect("daemon");
        (d.threads, d.mem_mib.get(DEV).copied().unwrap_or(0))
    }
    /// The servers of the daemon of `pipe`, with their (threads, MiB of `DEV`).
    fn servers(&self, pipe: &Path) -> BTreeMap<u32, (f64, u64)> {
        let st = self.st();
        let d = st.daemons.get(pipe).expect("daemon");
        d.servers
            .iter()
            .map(|(p, s)| (*p, (s.threads, s.mem_mib.get(DEV).copied().unwrap_or(0))))
            .collect()
    }
}

impl MpsControl for SimControl {
    fn start_daemon(&self, spec: &DaemonSpec) -> Result<u32, MpsError> {
        let mut st = self.st();
        st.log.push(format!("start {}", spec.device));
        if st.fail_starts > 0 {
            st.fail_starts -= 1;
            return Err(MpsError::DaemonDidNotStart {
                pipe_dir: spec.pipe_dir.clone(),
                detail: "injected".into(),
            });
        }
        if st.daemons.get(&spec.pipe_dir).is_some_and(|d| d.alive) {
            return Err(MpsError::DaemonDidNotStart {
                pipe_dir: spec.pipe_dir.clone(),
                detail: "running".into(),
            });
        }
        st.next_pid += 1;
        st.starts += 1;
        let pid = 1000 + st.next_pid;
        st.daemons.insert(
            spec.pipe_dir.clone(),
            SimDaemon {
                pid,
                alive: true,
                threads: 100.0,
                mem_mib: BTreeMap::new(),
                hung: false,
                servers: BTreeMap::new(),
            },
        );
        Ok(pid)
    }

    fn send(&self, spec: &DaemonSpec, cmd: &Command) -> Result<String, MpsError> {
        let mut st = self.st();
        st.log.push(cmd.render());
        let ignore = st.ignore_caps;
        let new_server = matches!(cmd, Command::StartServer { .. }).then(|| {
            st.next_pid += 1;
            5000 + st.next_pid
        });
        let Some(d) = st.daemons.get_mut(&spec.pipe_dir).filter(|d| d.alive) else {
            return Err(MpsError::NoDaemon { pipe_dir: spec.pipe_dir.clone() });
        };
        if d.hung {
            return Err(MpsError::Timeout {
                command: cmd.render(),
                pipe_dir: spec.pipe_dir.clone(),
                after_ms: 1,
            });
        }
        let shown =
            |mib: u64| if mib >= 1024 { format!("{}G\n", mib / 1024) } else { format!("{mib}M\n") };
        let not_found = |pid: &u32| format!("Server {pid} not found\n");
        Ok(match cmd {
            Command::GetServerList => d.servers.keys().map(|p| format!("{p}\n")).collect(),
            Command::StartServer { .. } => {
                if let Some(pid) = new_server {
                    let server = SimServer { threads: d.threads, mem_mib: d.mem_mib.clone() };
                    d.servers.insert(pid, server);
                }
                String::new()
            }
            Command::ShutdownServer { pid, .. } => match d.servers.remove(pid) {
                Some(_) => String::new(),
                None => not_found(pid),
            },
            Command::GetActiveThreadPercentage { server_pid } => match d.servers.get(server_pid) {
                Some(s) => format!("{:.1}\n", s.threads),
                None => not_found(server_pid),
            },
            Command::SetActiveThreadPercentage { server_pid, percent } => {
                match d.servers.get_mut(server_pid) {
                    Some(s) => {
                        s.threads = f64::from(*percent);
                        String::new()
                    }
                    None => not_found(server_pid),
                }
            }
            Command::GetDevicePinnedMemLimit { server_pid, device } => {
                match d.servers.get(server_pid) {
                    Some(s) => shown(s.mem_mib.get(&device.to_string()).copied().unwrap_or(0)),
                    None => not_found(server_pid),
                }
            }
            Command::SetDevicePinnedMemLimit { server_pid, device, limit } => {
                match d.servers.get_mut(server_pid) {
                    Some(s) => {
                        s.mem_mib.insert(device.to_string(), limit.mib());
                        String::new()
                    }
                    None => not_found(server_pid),
                }
            }
            Command::SetDefaultActiveThreadPercentage(p) if !ignore => {
                d.threads = f64::from(*p);
                String::new()
            }
            Command::SetDefaultDevicePinnedMemLimit { device, limit } if !ignore => {
                d.mem_mib.insert(device.to_string(), limit.mib());
                String::new()
            }
            Command::GetDefaultActiveThreadPercentage => format!("{:.1}\n", d.threads),
            Command::GetDefaultDevicePinnedMemLimit { device } => {
                shown(d.mem_mib.get(&device.to_string()).copied().unwrap_or(0))
            }
            Command::Quit => {
                d.alive = false;
                String::new()
            }
            _ => String::new(),
        })
    }

    fn daemon_pid(&self, spec: &DaemonSpec) -> Option<u32> {
        self.st().daemons.get(&spec.pipe_dir).filter(|d| d.alive).map(|d| d.pid)
    }

    fn kill_daemon(&self, spec: &DaemonSpec, pid: u32) -> Result<(), MpsError> {
        if let Some(d) = self.st().daemons.get_mut(&spec.pipe_dir).filter(|d| d.pid == pid) {
            d.alive = false;
        }
        Ok(())
    }
}

const GIB: u64 = 1 << 30;
const DEV: &str = "GPU-aaaaaaaa-0000-0000-0000-000000000001";
const DEV2: &str = "GPU-bbbbbbbb-0000-0000-0000-000000000002";

struct World {
    _tmp: tempfile::TempDir,
    state: PathBuf,
    sim: Arc<SimControl>,
    clock: Arc<ManualClock>,
    sup: Supervisor,
}

fn config() -> SupervisorConfig {
    SupervisorConfig {
        backoff_base: Duration::from_millis(1000),
        backoff_max: Duration::from_millis(4000),
        max_restarts: 3,
        crash_window: Duration::from_secs(60),
        stop_timeout: Duration::from_millis(200),
        ..SupervisorConfig::default()
    }
}

fn world() -> World {
    let tmp = tempfile::tempdir().expect("tempdir");
    let state = tmp.path().to_path_buf();
    let sim = Arc::new(SimControl::default());
    let clock = Arc::new(ManualClock::new(1_000_000));
    let sup = Supervisor::new(sim.clone(), &state).with_clock(clock.clone()).with_config(config());
    World { _tmp: tmp, state, sim, clock, sup }
}

impl World {
    fn another_supervisor(&self) -> Supervisor {
        Supervisor::new(self.sim.clone(), &self.state)
            .with_clock(self.clock.clone())
            .with_config(config())
    }
}

fn req(device: &str, tenant: &str, holder: &str, percent: u8) -> ShareRequest {
    ShareRequest {
        device: device.into(),
        tenant: tenant.into(),
        holder: holder.into(),
        percent,
        mem_limit_bytes: crate::mps_mem_limit_bytes(80 * GIB, percent),
    }
}

fn pid_of(sup: &Supervisor, tenant: &str) -> Option<u32> {
    sup.shares().into_iter().find(|s| s.tenant == tenant).and_then(|s| s.pid)
}

#[test]
fn caps_are_set_and_read_back_before_the_share_is_handed_out() {
    let w = world();
    let h = w.sup.ensure_share(&req(DEV, "acme/a", "c1", 50)).expect("share");
    let log = w.sim.st().log.clone();
    assert_eq!(
        log,
        vec![
            format!("start {DEV}"),
            "set_default_active_thread_percentage 50".to_string(),
            format!("set_default_device_pinned_mem_limit {DEV} 40G"),
            "get_default_active_thread_percentage".to_string(),
            format!("get_default_device_pinned_mem_limit {DEV}"),
        ]
    );
    assert_eq!(h.percent, 50);
    assert_eq!(h.mem_limit.bytes(), 40 * GIB);
    assert_eq!(h.env(), vec!["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps".to_string()]);
    let m = h.mounts();
    assert_eq!(m.len(), 1);
    assert_eq!(m[0].destination, "/tmp/nvidia-mps");
    assert!(m[0].read_only, "nothing can be planted in the pipe dir from a container");
    assert_eq!(Path::new(&m[0].source), h.pipe_dir.as_path());
    let dev_dir = layout::device_dir_name(DEV).expect("device dir");
    assert!(h.pipe_dir.starts_with(w.state.join("mps").join(dev_dir)));
    let rec = layout::read_record(&h.pipe_dir.parent().expect("root").join("share.json"))
        .expect("read")
        .expect("record");
    assert_eq!(rec.holders, vec!["c1".to_string()]);
    assert_eq!((rec.percent, rec.mem_limit_mib), (50, 40 * 1024));
}

#[test]
fn one_daemon_per_device_and_tenant_and_one_cap_per_tenant() {
    let w = world();
    let a = w.sup.ensure_share(&req(DEV, "acme/a", "c1", 25)).expect("a");
    let b = w.sup.ensure_share(&req(DEV, "acme/b", "c2", 25)).expect("b");
    assert_ne!(a.pid, b.pid);
    assert_ne!(a.pipe_dir, b.pipe_dir);
    // Same tenant, same cap: joins; retried: idempotent.
    let a2 = w.sup.ensure_share(&req(DEV, "acme/a", "c3", 25)).expect("join");
    assert_eq!(a2.pid, a.pid);
    assert_eq!(w.sup.ensure_share(&req(DEV, "acme/a", "c3", 25)).expect("again").pid, a.pid);
    assert_eq!(w.sim.starts(), 2);
    // Same tenant, another cap: refused with the reason.
    let e = w.sup.ensure_share(&req(DEV, "acme/a", "c4", 10)).expect_err("conflict");
    assert!(matches!(e, MpsError::CapConflict { held: 25, asked: 10, .. }), "{e}");
    // 25 + 25 + 25 booked: 30 does not fit, and the message says what is left.
    let e = w.sup.ensure_share(&req(DEV, "acme/c", "c5", 30)).expect_err("no room");
    assert_eq!(e.to_string(), format!("mps=30 for tenant acme/c: device {DEV} has 25% left"));
    let loads = w.sup.device_loads(&[DEV.to_string(), DEV2.to_string()]);
    assert_eq!(loads[0].used(), 75);
    assert_eq!(loads[1].used(), 0);
    assert_eq!(crate::pick_mps_device(&loads, "acme/c", 30), Ok(DEV2.to_string()));
    let joined = w.sup.ensure_share(&req(DEV, "acme/a", "c6", 25));
    assert!(matches!(joined, Ok(ref h) if h.pid == a.pid), "{joined:?}");
    assert!(w.sup.ensure_share(&req(DEV, "acme/a", "c7", 25)).is_err(), "100% booked");
}

#[test]
fn requests_are_checked() {
    let w = world();
    for (r, what) in [
        (req(DEV, "acme/a", "c", 0), "percentage"),
        (req(DEV, "acme/a", "c", 101), "percentage"),
        (req(DEV, "", "c", 10), "tenant"),
        (req(DEV, "acme/a", "", 10), "holder"),
        (req("../etc", "acme/a", "c", 10), "UUID"),
        (ShareRequest { mem_limit_bytes: 1000, ..req(DEV, "acme/a", "c", 10) }, "1 MiB"),
    ] {
        let e = w.sup.ensure_share(&r).expect_err(what);
        assert!(e.to_string().contains(what), "{e}");
    }
    assert_eq!(w.sim.starts(), 0);
}

#[test]
fn a_daemon_that_does_not_take_its_caps_is_stopped_and_nothing_is_handed_out() {
    let w = world();
    w.sim.st().ignore_caps = true;
    let e = w.sup.ensure_share(&req(DEV, "acme/a", "c1", 50)).expect_err("caps");
    assert!(e.to_string().contains("reads 100, not 50"), "{e}");
    assert!(w.sim.live_pids().is_empty(), "the daemon was quit");
    assert!(w.sup.shares().is_empty());
    assert!(
        !w.state.join("mps").join(DEV).join(layout::tenant_slug("acme/a")).exists(),
        "dirs removed"
    );
}

#[test]
fn crashes_restart_with_backoff_then_degrade() {
    let w = world();
    w.sup.ensure_share(&req(DEV, "acme/a", "c1", 40)).expect("a");
    w.sup.ensure_share(&req(DEV, "acme/b", "c2", 20)).expect("b");
    let b_pid = pid_of(&w.sup, "acme/b");
    assert!(w.sup.health_check_all().is_empty(), "healthy daemons make no events");

    // Crash 1: restarted at once, caps set again.
    let p1 = pid_of(&w.sup, "acme/a").expect("pid");
    w.sim.kill_by_pid(p1);
    let ev = w.sup.health_check_all();
    assert!(
        matches!(&ev[0], HealthEvent::Crashed(c) if c.tenant == "acme/a" && c.device == DEV && c.pid == Some(p1)),
        "{ev:?}"
    );
    assert!(
        matches!(&ev[1], HealthEvent::Restarted { old_pid: None, new_pid, .. } if Some(*new_pid) != Some(p1)),
        "{ev:?}"
    );
    assert_eq!(ev.len(), 2);
    assert_eq!(pid_of(&w.sup, "acme/b"), b_pid, "the other tenant's daemon is untouched");
    let log = w.sim.st().log.clone();
    let restart: [String; 5] = [
        format!("start {DEV}"),
        "set_default_active_thread_percentage 40".into(),
        format!("set_default_device_pinned_mem_limit {DEV} 32G"),
        "get_default_active_thread_percentage".into(),
        format!("get_default_device_pinned_mem_limit {DEV}"),
    ];
    assert_eq!(
        log.windows(5).filter(|w| *w == restart).count(),
        2,
        "started and restarted with caps: {log:?}"
    );

    // Crash 2: waits backoff_base.
    w.sim.kill_by_pid(pid_of(&w.sup, "acme/a").expect("pid"));
    let ev = w.sup.health_check_all();
    assert!(matches!(&ev[1], HealthEvent::RestartScheduled { at_ms: 1_001_000, .. }), "{ev:?}");
    assert!(w.sup.health_check_all().is_empty(), "not due yet");
    let e = w.sup.ensure_share(&req(DEV, "acme/a", "c9", 40));
    assert!(matches!(e, Err(MpsError::NotRunning { .. })), "{e:?}");
    w.clock.advance_ms(1000);
    assert!(matches!(&w.sup.health_check_all()[..], [HealthEvent::Restarted { .. }]));

    // Crash 3: twice as long.
    w.sim.kill_by_pid(pid_of(&w.sup, "acme/a").expect("pid"));
    let ev = w.sup.health_check_all();
    assert!(matches!(&ev[1], HealthEvent::RestartScheduled { at_ms: 1_003_000, .. }), "{ev:?}");
    w.clock.advance_ms(2000);
    assert!(matches!(&w.sup.health_check_all()[..], [HealthEvent::Restarted { .. }]));

    // Crash 4 > max_restarts (3) within the window: degraded, never restarted again.
    let starts = w.sim.starts();
    w.sim.kill_by_pid(pid_of(&w.sup, "acme/a").expect("pid"));
    let ev = w.sup.health_check_all();
    assert!(matches!(&ev[1], HealthEvent::Degraded { crashes: 4, .. }), "{ev:?}");
    w.clock.advance_ms(100_000);
    assert!(w.sup.health_check_all().is_empty());
    assert_eq!(w.sim.starts(), starts);
    let st = w.sup.shares().into_iter().find(|s| s.tenant == "acme/a").expect("share");
    assert!(matches!(st.state, ShareState::Degraded { .. }));
    assert_eq!((st.restarts, st.pid), (3, None));
    assert!(matches!(
        w.sup.ensure_share(&req(DEV, "acme/a", "c9", 50)),
        Err(MpsError::Degraded { .. })
    ));
    assert_eq!(w.sup.crashes().len(), 4);
    assert!(w.sup.crashes().iter().all(|c| c.tenant == "acme/a" && c.device == DEV));
    assert_eq!(pid_of(&w.sup, "acme/b"), b_pid);
    // The degraded share goes with its last container.
    assert_eq!(
        w.sup.release(DEV, "acme/a", "c1").expect("release"),
        Release::Stopped { pid: None }
    );
    assert!(
        w.sup.ensure_share(&req(DEV, "acme/a", "c9", 50)).is_ok(),
        "a fresh share after release"
    );
}

#[test]
fn crashes_outside_the_window_do_not_add_up() {
    let w = world();
    w.sup.ensure_share(&req(DEV, "acme/a", "c1", 50)).expect("a");
    for _ in 0..10 {
        w.sim.kill_by_pid(pid_of(&w.sup, "acme/a").expect("pid"));
        let ev = w.sup.health_check_all();
        assert!(
            matches!(&ev[..], [HealthEvent::Crashed(_), HealthEvent::Restarted { .. }]),
            "{ev:?}"
        );
        w.clock.advance_ms(61_000);
    }
}

#[test]
fn a_failed_restart_is_a_crash_too() {
    let w = world();
    w.sup.ensure_share(&req(DEV, "acme/a", "c1", 50)).expect("a");
    w.sim.kill_by_pid(pid_of(&w.sup, "acme/a").expect("pid"));
    w.sim.st().fail_starts = 1;
    let ev = w.sup.health_check_all();
    assert!(
        matches!(&ev[..], [HealthEvent::Crashed(_), HealthEvent::Crashed(c), HealthEvent::RestartScheduled { .. }]
        if c.detail.contains("restart failed")),
        "{ev:?}"
    );
    w.clock.advance_ms(1000);
    assert!(matches!(&w.sup.health_check_all()[..], [HealthEvent::Restarted { .. }]));
}

#[test]
fn a_hung_daemon_is_killed_after_repeated_failed_pings() {
    let w = world();
    w.sup.ensure_share(&req(DEV, "acme/a", "c1", 50)).expect("a");
    let pid = pid_of(&w.sup, "acme/a").expect("pid");
    w.sim.hang(pid);
    assert!(matches!(
        &w.sup.health_check_all()[..],
        [HealthEvent::Unresponsive { failures: 1, .. }]
    ));
    let ev = w.sup.health_check_all();
    assert!(
        matches!(&ev[..], [HealthEvent::Unresponsive { failures: 2, .. }, HealthEvent::Crashed(c), HealthEvent::Restarted { .. }]
        if c.detail.contains("unanswered")),
        "{ev:?}"
    );
    assert!(!w.sim.live_pids().contains(&pid));
}

/// The daemon of a share, as a container reaches it: through the control socket of its
/// pipe dir (the test seam needs only the pipe dir).
fn spec_of(h: &ShareHandle) -> DaemonSpec {
    DaemonSpec {
        device: h.device.clone(),
        pipe_dir: h.pipe_dir.clone(),
        log_dir: h.pipe_dir.with_file_name("log"),
        shm_dir: None,
    }
}

#[test]
fn caps_changed_through_the_control_socket_are_set_back_at_the_next_health_check() {
    let w = world();
    let a = w.sup.ensure_share(&req(DEV, "acme/a", "c1", 25)).expect("a");
    let b = w.sup.ensure_share(&req(DEV, "acme/b", "c2", 50)).expect("b");
    let (spec, dev) = (spec_of(&a), DeviceRef::Uuid(DEV.into()));
    // A container of acme/a raises its own daemon's defaults through the control socket.
    let all = MemLimit::from_mib(80 * 1024).expect("limit");
    w.sim.send(&spec, &Command::SetDefaultActiveThreadPercentage(100)).expect("raise");
    w.sim
        .send(&spec, &Command::SetDefaultDevicePinnedMemLimit { device: dev.clone(), limit: all })
        .expect("raise");
    assert_eq!(w.sim.caps(&a.pipe_dir), (100.0, 80 * 1024));
    let ev = w.sup.health_check_all();
    assert_eq!(w.sim.caps(&a.pipe_dir), (25.0, 20 * 1024), "caps set back: {ev:?}");
    assert_eq!(w.sim.caps(&b.pipe_dir), (50.0, 40 * 1024), "the other tenant untouched");
    assert_eq!(pid_of(&w.sup, "acme/a"), Some(a.pid), "the daemon itself is kept");
    let [HealthEvent::CapDrift { tenant, pid, detail, restored: true, servers_stopped, .. }] =
        &ev[..]
    else {
        panic!("one cap drift expected: {ev:?}");
    };
    assert_eq!((tenant.as_str(), *pid), ("acme/a", a.pid));
    assert_eq!(
        detail,
        "default active thread percentage reads 100, not 25; \
         default device pinned memory limit reads 80G, not 20G"
    );
    assert!(servers_stopped.is_empty());
    assert_eq!(serde_json::to_value(&ev[0]).expect("json")["event"], "cap_drift");
    let drifts = |t: &str| w.sup.shares().into_iter().find(|s| s.tenant == t).map(|s| s.cap_drifts);
    assert_eq!((drifts("acme/a"), drifts("acme/b")), (Some(1), Some(0)));
    assert!(w.sup.health_check_all().is_empty(), "set back once, then quiet");

    // Raised again, then another container joins: it gets the caps back before it is
    // handed the share, and the next health check reports the drift.
    w.sim.send(&spec, &Command::SetDefaultActiveThreadPercentage(90)).expect("raise");
    assert_eq!(w.sup.ensure_share(&req(DEV, "acme/a", "c3", 25)).expect("join").pid, a.pid);
    assert_eq!(w.sim.caps(&a.pipe_dir), (25.0, 20 * 1024));
    let ev = w.sup.health_check_all();
    assert!(
        matches!(&ev[..], [HealthEvent::CapDrift { detail, .. }] if detail.contains("reads 90, not 25")),
        "{ev:?}"
    );
    assert_eq!(drifts("acme/a"), Some(2));
}

#[test]
fn a_server_whose_caps_were_raised_is_shut_down_with_its_clients() {
    let w = world();
    let a = w.sup.ensure_share(&req(DEV, "acme/a", "c1", 25)).expect("a");
    let spec = spec_of(&a);
    let start_server = || {
        let before = w.sim.servers(&a.pipe_dir);
        w.sim.send(&spec, &Command::StartServer { uid: 0 }).expect("start_server");
        let after = w.sim.servers(&a.pipe_dir);
        after.keys().copied().find(|p| !before.contains_key(p)).expect("a new server")
    };
    // The tenant's first client starts a server: it takes the defaults, and is left alone.
    let good = start_server();
    assert!(w.sup.health_check_all().is_empty());
    assert_eq!(w.sim.servers(&a.pipe_dir)[&good], (25.0, 20 * 1024));

    // Raised on the server itself: new clients of it would get 100%.
    w.sim
        .send(&spec, &Command::SetActiveThreadPercentage { server_pid: good, percent: 100 })
        .expect("raise");
    let ev = w.sup.health_check_all();
    let [HealthEvent::CapDrift { detail, restored: true, servers_stopped, .. }] = &ev[..] else {
        panic!("one cap drift expected: {ev:?}");
    };
    assert_eq!(detail, &format!("server {good}: active thread percentage reads 100, not 25"));
    assert_eq!(servers_stopped, &vec![good]);
    assert!(w.sim.servers(&a.pipe_dir).is_empty(), "the server and its clients are gone");

    // The default raised, a server started (with it), the default put back before the check:
    // the server still has 100% and is found by its own caps.
    let fine = start_server();
    w.sim.send(&spec, &Command::SetDefaultActiveThreadPercentage(100)).expect("raise");
    let raised = start_server();
    w.sim.send(&spec, &Command::SetDefaultActiveThreadPercentage(25)).expect("put back");
    let ev = w.sup.health_check_all();
    assert!(
        matches!(&ev[..], [HealthEvent::CapDrift { servers_stopped, .. }] if servers_stopped == &vec![raised]),
        "{ev:?}"
    );
    assert_eq!(w.sim.servers(&a.pipe_dir).keys().copied().collect::<Vec<_>>(), vec![fine]);
    assert_eq!(pid_of(&w.sup, "acme/a"), Some(a.pid));
}

#[test]
fn caps_that_cannot_be_set_again_make_a_crash_and_a_restart() {
    let w = world();
    let a = w.sup.ensure_share(&req(DEV, "acme/a", "c1", 25)).expect("a");
    w.sim.send(&spec_of(&a), &Command::SetDefaultActiveThreadPercentage(100)).expect("raise");
    w.sim.st().ignore_caps = true;
    let ev = w.sup.health_check_all();
    assert!(
        matches!(&ev[..], [HealthEvent::CapDrift { restored: false, .. }, HealthEvent::Crashed(c), ..]
            if c.detail.contains("could not be set again")),
        "{ev:?}"
    );
    assert!(!w.sim.live_pids().contains(&a.pid), "the daemon with raised caps was killed");
    w.sim.st().ignore_caps = false;
    w.clock.advance_ms(10_000);
    let ev = w.sup.health_check_all();
    assert!(matches!(&ev[..], [HealthEvent::Restarted { .. }]), "{ev:?}");
    let h = w.sup.shares().into_iter().next().expect("share");
    assert_eq!(w.sim.caps(&h.pipe_dir), (25.0, 20 * 1024));
}

#[test]
fn the_last_release_stops_the_daemon() {
    let w = world();
    let h = w.sup.ensure_share(&req(DEV, "acme/a", "c1", 20)).expect("a");
    w.sup.ensure_share(&req(DEV, "acme/a", "c2", 20)).expect("a2");
    assert_eq!(w.sup.release(DEV, "acme/a", "c1").expect("r"), Release::StillHeld { remaining: 1 });
    assert_eq!(w.sup.release(DEV, "acme/a", "c1").expect("r"), Release::NotHeld);
    assert_eq!(w.sim.live_pids(), vec![h.pid]);
    assert_eq!(
        w.sup.release(DEV, "acme/a", "c2").expect("r"),
        Release::Stopped { pid: Some(h.pid) }
    );
    assert!(w.sim.live_pids().is_empty());
    assert!(w.sim.st().log.contains(&"quit".to_string()));
    assert!(!h.pipe_dir.exists());
    assert_eq!(w.sup.release(DEV, "acme/a", "c2").expect("r"), Release::NotHeld);
}

#[test]
fn a_new_supervisor_adopts_the_same_daemons() {
    let w = world();
    let a = w.sup.ensure_share(&req(DEV, "acme/a", "c1", 50)).expect("a");
    let b = w.sup.ensure_share(&req(DEV, "acme/b", "c2", 25)).expect("b");
    let starts = w.sim.starts();
    let sup2 = w.another_supervisor();
    let report = sup2.adopt_existing().expect("adopt");
    let mut adopted: Vec<u32> = report.adopted.iter().map(|(_, _, p)| *p).collect();
    adopted.sort_unstable();
    assert_eq!(adopted, vec![a.pid, b.pid]);
    assert!(
        report.events.is_empty() && report.removed.is_empty() && report.problems.is_empty(),
        "{report:?}"
    );
    assert_eq!(w.sim.starts(), starts, "no new daemon");
    assert!(sup2.adopt_existing().expect("again").adopted.is_empty(), "nothing adopted twice");
    // The adopted share knows its holders and caps.
    assert_eq!(sup2.ensure_share(&req(DEV, "acme/a", "c1", 50)).expect("same").pid, a.pid);
    assert!(sup2.ensure_share(&req(DEV, "acme/a", "c1", 40)).is_err());
    assert_eq!(
        sup2.release(DEV, "acme/b", "c2").expect("r"),
        Release::Stopped { pid: Some(b.pid) }
    );
}

#[test]
fn adoption_restarts_dead_held_daemons_removes_unheld_ones_and_keeps_degraded_ones() {
    let w = world();
    let a = w.sup.ensure_share(&req(DEV, "acme/a", "c1", 50)).expect("a");
    let b = w.sup.ensure_share(&req(DEV, "acme/b", "c2", 25)).expect("b");
    let c = w.sup.ensure_share(&req(DEV2, "acme/c", "c3", 25)).expect("c");
    // a dies while no tesserad watches; b's record loses its holders; c is degraded.
    w.sim.kill_by_pid(a.pid);
    let b_root = b.pipe_dir.parent().expect("root").to_path_buf();
    let mut rec = layout::read_record(&b_root.join("share.json")).expect("read").expect("rec");
    rec.holders.clear();
    layout::write_record(&b_root.join("share.json"), &rec).expect("write");
    let c_root = c.pipe_dir.parent().expect("root").to_path_buf();
    let mut rec = layout::read_record(&c_root.join("share.json")).expect("read").expect("rec");
    rec.degraded = Some("crash loop".into());
    layout::write_record(&c_root.join("share.json"), &rec).expect("write");
    // And a directory with a daemon but no record.
    let stray = w.state.join("mps").join(DEV2).join("stray");
    std::fs::create_dir_all(stray.join("pipe")).expect("mkdir");

    let sup2 = w.another_supervisor();
    let report = sup2.adopt_existing().expect("adopt");
    assert!(report.adopted.is_empty(), "{report:?}");
    assert!(
        matches!(&report.events[..], [HealthEvent::Crashed(e), HealthEvent::Restarted { .. }] if e.tenant == "acme/a"),
        "{report:?}"
    );
    assert!(report.removed.contains(&b_root) && report.removed.contains(&stray), "{report:?}");
    assert!(!b_root.exists() && !stray.exists());
    assert!(!w.sim.live_pids().contains(&b.pid), "the unheld daemon was quit");
    let shares = sup2.shares();
    assert_eq!(shares.len(), 2);
    assert!(shares
        .iter()
        .any(|s| s.tenant == "acme/a" && s.state == ShareState::Running && s.pid != Some(a.pid)));
    assert!(shares
        .iter()
        .any(|s| s.tenant == "acme/c" && matches!(s.state, ShareState::Degraded { .. })));
    assert_eq!(sup2.crashes().len(), 1);
}

#[test]
fn adoption_sets_caps_again_when_the_previous_tesserad_died_before_them() {
    let w = world();
    let a = w.sup.ensure_share(&req(DEV, "acme/a", "c1", 50)).expect("a");
    // Reset the daemon's caps as if they had never been set.
    for d in w.sim.st().daemons.values_mut() {
        d.threads = 100.0;
        d.mem_mib.clear();
    }
    let sup2 = w.another_supervisor();
    let report = sup2.adopt_existing().expect("adopt");
    assert_eq!(report.adopted, vec![(DEV.to_string(), "acme/a".to_string(), a.pid)]);
    let log = w.sim.st().log.clone();
    assert!(
        log.ends_with(&[
            "set_default_active_thread_percentage 50".into(),
            format!("set_default_device_pinned_mem_limit {DEV} 40G"),
            "get_default_active_thread_percentage".into(),
            format!("get_default_device_pinned_mem_limit {DEV}"),
        ]),
        "{log:?}"
    );
}

#[test]
fn a_directory_of_another_tenant_is_never_taken_over() {
    let w = world();
    let dirs = ShareDirs::new(&w.state, None, DEV, "acme/a").expect("dirs");
    std::fs::create_dir_all(&dirs.root).expect("mkdir");
    let foreign = ShareRecord {
        device: DEV.into(),
        tenant: "evil/x".into(),
        percent: 10,
        mem_limit_mib: 10,
        holders: vec!["h".into()],
        degraded: None,
        throttle: None,
    };
    layout::write_record(&dirs.record(), &foreign).expect("write");
    let e = w.sup.ensure_share(&req(DEV, "acme/a", "c1", 50)).expect_err("foreign");
    assert!(matches!(e, MpsError::Foreign { .. }), "{e}");
    assert_eq!(w.sim.starts(), 0);
    // Adoption leaves it alone too.
    let report = w.another_supervisor().adopt_existing().expect("adopt");
    assert_eq!(report.problems.len(), 1, "{report:?}");
    assert!(dirs.record().exists());
}

#[test]
fn shutdown_quits_every_daemon() {
    let w = world();
    w.sup.ensure_share(&req(DEV, "acme/a", "c1", 50)).expect("a");
    w.sup.ensure_share(&req(DEV2, "acme/b", "c2", 25)).expect("b");
    let stopped = w.sup.shutdown_all();
    assert_eq!(stopped.len(), 2);
    assert!(w.sim.live_pids().is_empty());
    assert!(w.sup.shares().is_empty());
    assert_eq!(w.sim.st().log.iter().filter(|l| *l == "quit").count(), 2);
}

#[test]
fn backoff_doubles_from_the_second_crash_and_is_capped() {
    let c = config();
    let ms = |n| c.backoff(n).as_millis();
    assert_eq!((ms(1), ms(2), ms(3), ms(4), ms(5), ms(40)), (0, 1000, 2000, 4000, 4000, 4000));
}

#[test]
fn private_shm_is_mounted_into_the_container() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let sim = Arc::new(SimControl::default());
    let cfg = SupervisorConfig { shm_root: Some(tmp.path().join("shm")), ..config() };
    let sup = Supervisor::new(sim.clone(), tmp.path().join("state")).with_config(cfg);
    let h = sup.ensure_share(&req(DEV, "acme/a", "c1", 50)).expect("a");
    let shm = h.shm_dir.clone().expect("shm dir");
    let dev_dir = layout::device_dir_name(DEV).expect("device dir");
    assert!(shm.starts_with(tmp.path().join("shm").join(dev_dir)));
    assert!(h.mounts().iter().any(|m| m.destination == "/dev/shm" && Path::new(&m.source) == shm));
    let spec_shm = sim.st().daemons.keys().next().cloned();
    assert_eq!(spec_shm, Some(h.pipe_dir.clone()));
}

#[test]
fn status_and_events_serialize_for_the_api() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Supervisor>();
    let w = world();
    w.sup.ensure_share(&req(DEV, "acme/a", "c1", 50)).expect("a");
    let st = w.sup.shares();
    let json = serde_json::to_value(&st).expect("json");
    assert_eq!(json[0]["state"], "running");
    assert_eq!(json[0]["percent"], 50);
    let back: Vec<ShareStatus> = serde_json::from_value(json).expect("back");
    assert_eq!(back, st);
    let ev = HealthEvent::Degraded {
        device: DEV.into(),
        tenant: "t".into(),
        crashes: 4,
        reason: "r".into(),
    };
    let json = serde_json::to_value(&ev).expect("json");
    assert_eq!(json["event"], "degraded");
    assert_eq!(serde_json::from_value::<HealthEvent>(json).expect("back"), ev);
    let crash = HealthEvent::Crashed(CrashEvent {
        device: DEV.into(),
        tenant: "t".into(),
        at_ms: 5,
        pid: Some(9),
        detail: "d".into(),
    });
    let json = serde_json::to_value(&crash).expect("json");
    assert_eq!((json["event"].as_str(), json["pid"].as_u64()), (Some("crashed"), Some(9)));
}

/// Issue 26: the interference controller lowers a share's thread cap daemon-side; health
/// checks keep the lowered cap (no drift), its booking stays, and a new supervisor (a
/// tesserad restart) adopts it throttled.
#[test]
fn a_throttled_share_keeps_its_lowered_cap_through_health_checks_and_adoption() {
    let w = world();
    let a = w.sup.ensure_share(&req(DEV, "acme/a", "c1", 75)).expect("a");
    assert_eq!(w.sup.throttle(DEV, "acme/a", 37).expect("throttle"), 75);
    assert_eq!(w.sim.caps(&a.pipe_dir).0, 37.0, "the daemon's default reads the new cap");
    assert!(w.sup.health_check_all().is_empty(), "the lowered cap is no drift");
    let st = w.sup.shares().into_iter().find(|s| s.tenant == "acme/a").expect("share");
    assert_eq!((st.percent, st.threads), (75, 37), "booked 75, running at 37");
    assert_eq!(w.sup.throttle(DEV, "acme/a", 50).expect("no raise"), 37, "never raised");
    assert_eq!(w.sim.caps(&a.pipe_dir).0, 37.0);
    // Raised behind its back: set back to the throttled cap, not the booking.
    w.sim.send(&spec_of(&a), &Command::SetDefaultActiveThreadPercentage(75)).expect("raise");
    let ev = w.sup.health_check_all();
    assert!(
        matches!(&ev[..], [HealthEvent::CapDrift { detail, .. }] if detail.contains("reads 75, not 37")),
        "{ev:?}"
    );
    let again = w.another_supervisor();
    again.adopt_existing().expect("adopt");
    let st = again.shares().into_iter().find(|s| s.tenant == "acme/a").expect("share");
    assert_eq!(st.threads, 37, "adopted throttled");
    assert!(w.sup.throttle(DEV, "acme/none", 10).is_err(), "no such share");
}
