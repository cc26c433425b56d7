//! The supervisor and `ProcessControl` against real processes: the test double
//! `fake-nvidia-cuda-mps-control` (it speaks the MPS control protocol; no GPU).
//!
//! The double is this package's binary, so cargo builds it before these tests
//! (`CARGO_BIN_EXE_fake-nvidia-cuda-mps-control`); `$TESSERA_FAKE_MPS_CONTROL` points
//! them at another build of it.
//!
//! Every test kills every process it started (the [`Reaper`] guard, also on panic): each
//! control daemon found under its state dir and each stand-in server they started, after
//! checking that the PID still runs the double.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mps_double::FakeState;
use mpsd::protocol::{self, Command, DeviceRef};
use mpsd::{
    DaemonSpec, HealthEvent, ManualClock, MpsControl, MpsError, ProcessControl, Release,
    ShareHandle, ShareRequest, ShareState, Supervisor, SupervisorConfig,
};

const GIB: u64 = 1 << 30;
const DEV: &str = "GPU-f22fb098-d1b3-3806-2655-ba25f02229c1";
const DEV2: &str = "GPU-3109aaaa-d1b3-3806-2655-ba25f02229c2";
const BINARY_NAME: &str = "fake-nvidia-cuda-mps-control";

fn fake_binary() -> PathBuf {
    match std::env::var_os("TESSERA_FAKE_MPS_CONTROL") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_BIN_EXE_fake-nvidia-cuda-mps-control")),
    }
}

/// Kills, on drop, every process of the double that a test started under its state dir.
struct Reaper {
    dir: tempfile::TempDir,
    extra: std::sync::Mutex<BTreeSet<u32>>,
}

impl Reaper {
    fn new() -> Reaper {
        Reaper { dir: tempfile::tempdir().expect("tempdir"), extra: Default::default() }
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("s")
    }

    fn track(&self, pid: u32) {
        self.extra.lock().expect("lock").insert(pid);
    }

    /// Every PID file and every stand-in server under the temp dir.
    fn pids(&self) -> BTreeSet<u32> {
        let mut pids = self.extra.lock().map(|g| g.clone()).unwrap_or_default();
        let mut stack = vec![self.dir.path().to_path_buf()];
        while let Some(dir) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else { continue };
            for e in entries.flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.file_name().is_some_and(|n| n == "nvidia-cuda-mps-control.pid") {
                    if let Some(pid) =
                        std::fs::read_to_string(&p).ok().and_then(|t| t.trim().parse().ok())
                    {
                        pids.insert(pid);
                    }
                } else if p.file_name().is_some_and(|n| n == "fake-state.json") {
                    if let Some(st) = p.parent().and_then(FakeState::read) {
                        pids.insert(st.pid);
                        pids.extend(st.servers.iter().map(|s| s.pid));
                    }
                }
            }
        }
        pids
    }
}

/// Whether `pid` runs the double (so a recycled PID is never killed).
fn is_fake(pid: u32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| c.split(|b| *b == 0).next().is_some_and(|a0| a0.ends_with(BINARY_NAME.as_bytes())))
        .unwrap_or(false)
}

fn kill9(pid: u32) {
    if let Ok(raw) = i32::try_from(pid) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(raw),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        for pid in self.pids() {
            if is_fake(pid) && alive(pid) {
                kill9(pid);
            }
        }
    }
}

/// Alive and not a zombie.
fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_ascii_whitespace().next())
            .is_some_and(|s| s != "Z" && s != "X"),
        Err(_) => false,
    }
}

fn wait_dead(pid: u32) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(pid) {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

fn req(device: &str, tenant: &str, holder: &str, percent: u8) -> ShareRequest {
    ShareRequest {
        device: device.into(),
        tenant: tenant.into(),
        holder: holder.into(),
        percent,
        mem_limit_bytes: mpsd::mps_mem_limit_bytes(80 * GIB, percent),
    }
}

fn spec_of(h: &ShareHandle) -> DaemonSpec {
    DaemonSpec {
        device: h.device.clone(),
        pipe_dir: h.pipe_dir.clone(),
        log_dir: h.pipe_dir.parent().expect("share root").join("log"),
        shm_dir: h.shm_dir.clone(),
    }
}

fn control() -> Arc<ProcessControl> {
    Arc::new(ProcessControl::new(fake_binary()))
}

fn config() -> SupervisorConfig {
    SupervisorConfig { stop_timeout: Duration::from_secs(5), ..SupervisorConfig::default() }
}

/// The caps as the daemon reports them through the control protocol.
fn caps(ctl: &ProcessControl, h: &ShareHandle) -> (f64, String) {
    let spec = spec_of(h);
    let threads = ctl.send(&spec, &Command::GetDefaultActiveThreadPercentage).expect("get threads");
    let mem = ctl
        .send(
            &spec,
            &Command::GetDefaultDevicePinnedMemLimit { device: DeviceRef::Uuid(h.device.clone()) },
        )
        .expect("get mem");
    (protocol::parse_thread_percentage(&threads).expect("threads answer"), mem.trim().to_string())
}

/// A daemon spec with its pipe and log dirs under `root`.
fn spec_under(root: &std::path::Path) -> DaemonSpec {
    DaemonSpec {
        device: DEV.into(),
        pipe_dir: root.join("pipe"),
        log_dir: root.join("log"),
        shm_dir: None,
    }
}

#[test]
fn two_tenants_get_two_daemons_whose_caps_read_back() {
    let r = Reaper::new();
    let ctl = control();
    let sup = Supervisor::new(ctl.clone(), r.state()).with_config(config());
    let a = sup.ensure_share(&req(DEV, "acme/research/alice", "c1", 50)).expect("a");
    r.track(a.pid);
    let b = sup.ensure_share(&req(DEV, "acme/research/bob", "c2", 25)).expect("b");
    r.track(b.pid);

    assert_ne!(a.pid, b.pid);
    assert_ne!(a.pipe_dir, b.pipe_dir);
    assert!(alive(a.pid) && alive(b.pid) && is_fake(a.pid) && is_fake(b.pid));
    assert_eq!(caps(&ctl, &a), (50.0, "40G".to_string()));
    assert_eq!(caps(&ctl, &b), (25.0, "20G".to_string()));

    // The caps were the first thing each daemon was told, and it serves only its device.
    let st = FakeState::read(&a.pipe_dir).expect("fake state");
    assert_eq!(st.pid, a.pid);
    assert_eq!(st.visible_devices, vec![DEV.to_string()]);
    assert_eq!(
        st.commands[..2],
        [
            "set_default_active_thread_percentage 50".to_string(),
            format!("set_default_device_pinned_mem_limit {DEV} 40G")
        ]
    );
    assert_eq!(st.default_pinned_mem_limit_mib.get(&0), Some(&(40 * 1024)));
    assert!(st.servers.is_empty());

    // Nothing of this process's environment reached the daemon.
    let environ = std::fs::read(format!("/proc/{}/environ", a.pid)).expect("environ");
    for kv in environ.split(|b| *b == 0).filter(|kv| !kv.is_empty()) {
        let key = String::from_utf8_lossy(kv.split(|b| *b == b'=').next().unwrap_or_default())
            .into_owned();
        assert!(
            ["PATH", "CUDA_VISIBLE_DEVICES", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"]
                .contains(&key.as_str()),
            "unexpected {key} in the daemon's environment"
        );
    }

    // A third tenant asking 40% does not fit: told what is left, and sent elsewhere.
    let e = sup.ensure_share(&req(DEV, "acme/research/carol", "c3", 40)).expect_err("no room");
    assert_eq!(
        e.to_string(),
        format!("mps=40 for tenant acme/research/carol: device {DEV} has 25% left")
    );
    let loads = sup.device_loads(&[DEV.to_string()]);
    assert_eq!(
        mpsd::pick_mps_device(&loads, "acme/research/carol", 40).expect_err("no fit").to_string(),
        format!("mps=40: {DEV} has 25% left")
    );
    let loads = sup.device_loads(&[DEV.to_string(), DEV2.to_string()]);
    assert_eq!(mpsd::pick_mps_device(&loads, "acme/research/carol", 40), Ok(DEV2.to_string()));

    let stopped = sup.shutdown_all();
    assert_eq!(stopped.len(), 2);
    assert!(wait_dead(a.pid) && wait_dead(b.pid));
}

#[test]
fn a_killed_daemon_is_restarted_and_the_other_tenants_is_untouched() {
    let r = Reaper::new();
    let ctl = control();
    let clock = Arc::new(ManualClock::new(1_000_000));
    let sup = Supervisor::new(ctl.clone(), r.state()).with_clock(clock).with_config(config());
    let a = sup.ensure_share(&req(DEV, "acme/a", "c1", 50)).expect("a");
    r.track(a.pid);
    let b = sup.ensure_share(&req(DEV, "acme/b", "c2", 25)).expect("b");
    r.track(b.pid);
    assert!(sup.health_check_all().is_empty());

    kill9(a.pid);
    assert!(wait_dead(a.pid));
    let events = sup.health_check_all();
    let [HealthEvent::Crashed(crash), HealthEvent::Restarted { new_pid, .. }] = &events[..] else {
        panic!("expected a crash and a restart, got {events:?}");
    };
    r.track(*new_pid);
    assert_eq!(
        (crash.device.as_str(), crash.tenant.as_str(), crash.pid),
        (DEV, "acme/a", Some(a.pid))
    );
    assert!(crash.detail.contains(&format!("pid {} is gone", a.pid)), "{}", crash.detail);
    assert_ne!(*new_pid, a.pid);
    assert!(alive(*new_pid) && is_fake(*new_pid));
    assert_eq!(sup.crashes(), vec![crash.clone()]);

    // The new daemon got its caps again; the other daemon is the same process.
    let status = sup.shares();
    let a_now = status.iter().find(|s| s.tenant == "acme/a").expect("a");
    let b_now = status.iter().find(|s| s.tenant == "acme/b").expect("b");
    assert_eq!(
        (a_now.pid, a_now.restarts, &a_now.state),
        (Some(*new_pid), 1, &ShareState::Running)
    );
    assert_eq!(b_now.pid, Some(b.pid));
    assert!(alive(b.pid));
    let a_new = ShareHandle { pid: *new_pid, ..a.clone() };
    assert_eq!(caps(&ctl, &a_new), (50.0, "40G".to_string()));
    assert_eq!(caps(&ctl, &b), (25.0, "20G".to_string()));
    assert_eq!(FakeState::read(&b.pipe_dir).expect("b state").pid, b.pid);

    sup.shutdown_all();
    assert!(wait_dead(*new_pid) && wait_dead(b.pid));
}

#[test]
fn a_crash_loop_marks_the_share_degraded_and_stops_restarting() {
    let r = Reaper::new();
    // The double dies 1.5 s after it is ready: long enough to take its caps, then a loop.
    let ctl =
        Arc::new(ProcessControl::new(fake_binary()).with_env(mps_double::CRASH_AFTER_ENV, "1500"));
    let clock = Arc::new(ManualClock::new(1_000_000));
    let cfg = SupervisorConfig {
        max_restarts: 2,
        backoff_base: Duration::from_millis(100),
        backoff_max: Duration::from_millis(400),
        ..config()
    };
    let sup = Supervisor::new(ctl.clone(), r.state()).with_clock(clock.clone()).with_config(cfg);
    let a = sup.ensure_share(&req(DEV, "acme/a", "c1", 50)).expect("a");
    r.track(a.pid);
    let spec = spec_of(&a);

    let mut all = Vec::new();
    for _ in 0..20 {
        // Wait for the current daemon to crash.
        let deadline = Instant::now() + Duration::from_secs(10);
        while let Some(pid) = ctl.daemon_pid(&spec) {
            r.track(pid);
            assert!(Instant::now() < deadline, "the crash hook did not fire");
            std::thread::sleep(Duration::from_millis(20));
        }
        clock.advance_ms(500);
        let events = sup.health_check_all();
        for e in &events {
            if let HealthEvent::Restarted { new_pid, .. } = e {
                r.track(*new_pid);
            }
        }
        all.extend(events);
        if all.iter().any(|e| matches!(e, HealthEvent::Degraded { .. })) {
            break;
        }
    }
    let crashes = all.iter().filter(|e| matches!(e, HealthEvent::Crashed(_))).count();
    let restarts = all.iter().filter(|e| matches!(e, HealthEvent::Restarted { .. })).count();
    assert!(matches!(all.last(), Some(HealthEvent::Degraded { crashes: 3, .. })), "{all:?}");
    assert_eq!(crashes, 3, "{all:?}");
    assert!(restarts <= 2, "{all:?}");
    let log = std::fs::read_to_string(spec.log_dir.join("control.log")).expect("control.log");
    assert!(log.contains("FAKE_MPS_CRASH_AFTER_MS=1500"), "{log}");
    assert!(
        sup.crashes().iter().any(|c| c.detail.contains("FAKE_MPS_CRASH_AFTER_MS")),
        "{:?}",
        sup.crashes()
    );

    // Degraded: no more restarts, no new containers.
    clock.advance_ms(3_600_000);
    assert!(sup.health_check_all().is_empty());
    assert_eq!(ctl.daemon_pid(&spec), None);
    let e = sup.ensure_share(&req(DEV, "acme/a", "c2", 50)).expect_err("degraded");
    assert!(matches!(e, MpsError::Degraded { .. }), "{e}");
    let st = sup.shares();
    assert!(matches!(st[0].state, ShareState::Degraded { .. }), "{st:?}");
    assert_eq!(sup.release(DEV, "acme/a", "c1").expect("release"), Release::Stopped { pid: None });
}

#[test]
fn a_new_supervisor_adopts_the_running_daemons_with_their_pids() {
    let r = Reaper::new();
    let ctl = control();
    let (a, b) = {
        let sup = Supervisor::new(ctl.clone(), r.state()).with_config(config());
        let a = sup.ensure_share(&req(DEV, "acme/a", "c1", 50)).expect("a");
        r.track(a.pid);
        let b = sup.ensure_share(&req(DEV, "acme/b", "c2", 25)).expect("b");
        r.track(b.pid);
        (a, b)
        // The supervisor goes away as a crashed or restarted tesserad would: nothing stopped.
    };
    let sup = Supervisor::new(ctl.clone(), r.state()).with_config(config());
    let report = sup.adopt_existing().expect("adopt");
    let adopted: BTreeSet<u32> = report.adopted.iter().map(|(_, _, p)| *p).collect();
    assert_eq!(adopted, BTreeSet::from([a.pid, b.pid]));
    assert!(
        report.events.is_empty() && report.removed.is_empty() && report.problems.is_empty(),
        "{report:?}"
    );
    // Same processes, no second daemon on either pipe dir.
    assert_eq!(FakeState::read(&a.pipe_dir).expect("a").pid, a.pid);
    assert_eq!(FakeState::read(&b.pipe_dir).expect("b").pid, b.pid);
    let pid_files: Vec<u32> = r.pids().into_iter().filter(|p| alive(*p)).collect();
    assert_eq!(pid_files.len(), 2, "{pid_files:?}");
    assert!(!FakeState::read(&a.pipe_dir)
        .expect("a")
        .commands
        .iter()
        .skip(2)
        .any(|c| c.starts_with("set_")));
    // Joining after adoption reuses the daemon.
    assert_eq!(sup.ensure_share(&req(DEV, "acme/a", "c1", 50)).expect("same holder").pid, a.pid);
    let e = sup.ensure_share(&req(DEV, "acme/a", "c3", 25)).expect_err("cap");
    assert!(e.to_string().contains("holds an MPS share of 50%"), "{e}");
    assert!(sup.adopt_existing().expect("again").adopted.is_empty());

    sup.shutdown_all();
    assert!(wait_dead(a.pid) && wait_dead(b.pid));
}

#[test]
fn shutdown_all_leaves_no_process_behind() {
    let r = Reaper::new();
    let ctl = control();
    let sup = Supervisor::new(ctl.clone(), r.state()).with_config(config());
    let a = sup.ensure_share(&req(DEV, "acme/a", "c1", 50)).expect("a");
    r.track(a.pid);
    let b = sup.ensure_share(&req(DEV2, "acme/b", "c2", 25)).expect("b");
    r.track(b.pid);
    // A server, as the first client of the tenant would start.
    let spec = spec_of(&a);
    assert_eq!(ctl.send(&spec, &Command::StartServer { uid: 0 }).expect("start_server"), "");
    let servers =
        protocol::parse_pid_list(&ctl.send(&spec, &Command::GetServerList).expect("list"))
            .expect("pids");
    assert_eq!(servers.len(), 1);
    r.track(servers[0]);
    assert!(alive(servers[0]));

    let stopped = sup.shutdown_all();
    assert_eq!(stopped.len(), 2);
    for pid in [a.pid, b.pid, servers[0]] {
        assert!(wait_dead(pid), "pid {pid} outlived shutdown_all");
    }
    assert!(!a.pipe_dir.exists() && !b.pipe_dir.exists());
}

#[test]
fn the_last_release_quits_the_daemon() {
    let r = Reaper::new();
    let ctl = control();
    let sup = Supervisor::new(ctl.clone(), r.state()).with_config(config());
    let a = sup.ensure_share(&req(DEV, "acme/a", "c1", 30)).expect("a");
    r.track(a.pid);
    assert_eq!(sup.ensure_share(&req(DEV, "acme/a", "c2", 30)).expect("a2").pid, a.pid);
    assert_eq!(
        sup.release(DEV, "acme/a", "c1").expect("release"),
        Release::StillHeld { remaining: 1 }
    );
    assert!(alive(a.pid));
    assert_eq!(
        sup.release(DEV, "acme/a", "c2").expect("release"),
        Release::Stopped { pid: Some(a.pid) }
    );
    assert!(wait_dead(a.pid));
    assert!(!a.pipe_dir.exists());
}

#[test]
fn the_double_speaks_the_protocol() {
    let r = Reaper::new();
    let ctl = control();
    let root = r.dir.path().join("p");
    let spec = spec_under(&root);
    // No daemon yet.
    assert!(matches!(ctl.send(&spec, &Command::GetServerList), Err(MpsError::NoDaemon { .. })));
    assert_eq!(ctl.daemon_pid(&spec), None);

    let pid = ctl.start_daemon(&spec).expect("start");
    r.track(pid);
    assert_eq!(ctl.daemon_pid(&spec), Some(pid));
    assert!(spec.pipe_dir.join("control").exists());
    // ProcessControl refuses a second daemon, and so does the double itself.
    assert!(ctl.start_daemon(&spec).expect_err("second").to_string().contains("already serves it"));
    let out = std::process::Command::new(fake_binary())
        .arg("-d")
        .env("CUDA_MPS_PIPE_DIRECTORY", &spec.pipe_dir)
        .env("CUDA_MPS_LOG_DIRECTORY", &spec.log_dir)
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains(mps_double::ALREADY_RUNNING));

    // Defaults of a fresh daemon: full threads, no memory limit.
    assert_eq!(
        ctl.send(&spec, &Command::GetDefaultActiveThreadPercentage).expect("get"),
        "100.0\n"
    );
    let dev0 = DeviceRef::Ordinal(0);
    assert_eq!(
        ctl.send(&spec, &Command::GetDefaultDevicePinnedMemLimit { device: dev0.clone() })
            .expect("get"),
        "0M\n"
    );
    // Limits are shown as the driver shows them; UUID and ordinal name the same device.
    let limit = mpsd::MemLimit::from_mib(1044).expect("limit");
    ctl.send(
        &spec,
        &Command::SetDefaultDevicePinnedMemLimit { device: DeviceRef::Uuid(DEV.into()), limit },
    )
    .expect("set");
    assert_eq!(
        ctl.send(&spec, &Command::GetDefaultDevicePinnedMemLimit { device: dev0 }).expect("get"),
        "1G\n"
    );
    assert!(ctl
        .send(&spec, &Command::GetDefaultDevicePinnedMemLimit { device: DeviceRef::Ordinal(3) })
        .expect("get")
        .starts_with("Invalid device"));

    // Servers: real processes that take the defaults in force when they start.
    ctl.send(&spec, &Command::SetDefaultActiveThreadPercentage(30)).expect("set");
    ctl.send(&spec, &Command::StartServer { uid: 1000 }).expect("start_server");
    let servers =
        protocol::parse_pid_list(&ctl.send(&spec, &Command::GetServerList).expect("list"))
            .expect("pids");
    let [server] = servers[..] else { panic!("one server expected: {servers:?}") };
    r.track(server);
    assert!(alive(server));
    let atp =
        ctl.send(&spec, &Command::GetActiveThreadPercentage { server_pid: server }).expect("get");
    assert_eq!(protocol::parse_thread_percentage(&atp), Ok(30.0));
    assert_eq!(
        ctl.send(&spec, &Command::GetClientList { server_pid: server }).expect("clients"),
        ""
    );
    assert!(protocol::parse_pid_list(
        &ctl.send(&spec, &Command::GetClientList { server_pid: 1 }).expect("x")
    )
    .is_err());
    ctl.send(&spec, &Command::ShutdownServer { pid: server, force: false })
        .expect("shutdown_server");
    assert!(wait_dead(server));
    assert_eq!(ctl.send(&spec, &Command::GetServerList).expect("list"), "");

    // Garbage in, an error answer out, which no parser takes for a value.
    let out = run_client(&spec, "get_server_list 12\n");
    assert!(out.starts_with("Invalid command"), "{out}");
    assert!(protocol::parse_pid_list(&out).is_err());

    // quit: the daemon ends and cleans up after itself.
    ctl.send(&spec, &Command::Quit).expect("quit");
    assert!(wait_dead(pid));
    assert!(!spec.pipe_dir.join("nvidia-cuda-mps-control.pid").exists());
    assert!(!spec.pipe_dir.join("control").exists());
    assert_eq!(ctl.daemon_pid(&spec), None);
    let log = std::fs::read_to_string(spec.log_dir.join("control.log")).expect("log");
    assert!(log.contains("Cmd:set_default_active_thread_percentage 30"), "{log}");
}

fn run_client(spec: &DaemonSpec, input: &str) -> String {
    use std::io::Write;
    let mut child = std::process::Command::new(fake_binary())
        .env_clear()
        .env("CUDA_MPS_PIPE_DIRECTORY", &spec.pipe_dir)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("client");
    child.stdin.take().expect("stdin").write_all(input.as_bytes()).expect("write");
    let out = child.wait_with_output().expect("wait");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_recycled_pid_in_a_pid_file_is_not_a_daemon() {
    let r = Reaper::new();
    let ctl = control();
    let pipe = r.dir.path().join("pipe");
    std::fs::create_dir_all(&pipe).expect("mkdir");
    let spec = DaemonSpec {
        device: DEV.into(),
        pipe_dir: pipe.clone(),
        log_dir: r.dir.path().join("log"),
        shm_dir: None,
    };
    // This test process: alive, but not the control binary.
    std::fs::write(pipe.join("nvidia-cuda-mps-control.pid"), std::process::id().to_string())
        .expect("write");
    assert_eq!(ctl.daemon_pid(&spec), None);
    // And kill_daemon refuses to touch it.
    ctl.kill_daemon(&spec, std::process::id()).expect("no-op");
    // start_daemon clears the stale file and starts a real one.
    let pid = ctl.start_daemon(&spec).expect("start");
    r.track(pid);
    assert_ne!(pid, std::process::id());
    ctl.send(&spec, &Command::Quit).expect("quit");
    assert!(wait_dead(pid));
}

#[test]
fn with_private_shm_the_daemon_sees_the_shares_shm_dir_as_dev_shm() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: a private /dev/shm needs root (mount namespaces)");
        return;
    }
    let r = Reaper::new();
    let ctl = control();
    let cfg = SupervisorConfig { shm_root: Some(r.dir.path().join("shm")), ..config() };
    let sup = Supervisor::new(ctl.clone(), r.state()).with_config(cfg);
    let a = match sup.ensure_share(&req(DEV, "acme/a", "c1", 50)) {
        Ok(a) => a,
        Err(e) if e.to_string().contains("Operation not permitted") => {
            eprintln!("skipped: no mount namespaces here: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    r.track(a.pid);
    let shm = a.shm_dir.clone().expect("shm dir");
    std::fs::write(shm.join("marker"), "x").expect("marker");
    // /proc/PID/root resolves paths in the daemon's own mount namespace.
    assert!(Path::new(&format!("/proc/{}/root/dev/shm/marker", a.pid)).exists());
    assert!(!Path::new("/dev/shm/marker").exists(), "the host's /dev/shm is untouched");
    assert!(a.mounts().iter().any(|m| m.destination == "/dev/shm" && Path::new(&m.source) == shm));
    sup.shutdown_all();
    assert!(wait_dead(a.pid));
    assert!(!shm.exists());
}

#[test]
fn a_cap_raised_through_the_control_socket_is_restored_at_the_next_health_check() {
    let r = Reaper::new();
    let ctl = control();
    let sup = Supervisor::new(ctl.clone(), r.state()).with_config(config());
    let a = sup.ensure_share(&req(DEV, "acme/a", "c1", 25)).expect("a");
    r.track(a.pid);
    let spec = spec_of(&a);
    // What a container can do: run a control client against the pipe dir it has mounted.
    let out = run_client(
        &spec,
        &format!(
            "set_default_active_thread_percentage 100\nset_default_device_pinned_mem_limit {DEV} 80G\n"
        ),
    );
    assert_eq!(out, "");
    assert_eq!(caps(&ctl, &a), (100.0, "80G".to_string()), "the double took the raise");
    let events = sup.health_check_all();
    assert_eq!(caps(&ctl, &a), (25.0, "20G".to_string()), "caps set back: {events:?}");
    assert_eq!(FakeState::read(&a.pipe_dir).expect("state").pid, a.pid, "same daemon");
    assert!(
        matches!(&events[..], [HealthEvent::CapDrift { restored: true, detail, .. }]
            if detail.contains("thread percentage reads 100, not 25") && detail.contains("reads 80G, not 20G")),
        "{events:?}"
    );
    assert_eq!(sup.shares()[0].cap_drifts, 1);

    // A server of the share (started by a client) raised on its own: shut down with its
    // clients; the defaults stay right.
    assert_eq!(run_client(&spec, "start_server -uid 0\n"), "");
    let servers =
        protocol::parse_pid_list(&ctl.send(&spec, &Command::GetServerList).expect("list"))
            .expect("pids");
    let [server] = servers[..] else { panic!("one server expected: {servers:?}") };
    r.track(server);
    assert!(sup.health_check_all().is_empty(), "a server with the share's caps is left alone");
    assert_eq!(run_client(&spec, &format!("set_active_thread_percentage {server} 100\n")), "");
    let events = sup.health_check_all();
    assert!(
        matches!(&events[..], [HealthEvent::CapDrift { servers_stopped, .. }] if servers_stopped == &vec![server]),
        "{events:?}"
    );
    assert!(wait_dead(server), "the server with raised caps still runs");
    assert_eq!(caps(&ctl, &a), (25.0, "20G".to_string()));
    sup.shutdown_all();
    assert!(wait_dead(a.pid));
}

#[test]
fn the_double_never_writes_through_a_symlink_planted_in_its_pipe_dir() {
    use std::os::unix::fs::symlink;
    let r = Reaper::new();
    let ctl = control();
    let root = r.dir.path().join("p");
    let spec = spec_under(&root);
    // A host file a container must never reach, and links to it where the double writes.
    let outside = r.dir.path().join("outside");
    std::fs::write(&outside, "precious\n").expect("outside");
    let unchanged = || std::fs::read_to_string(&outside).expect("outside still readable");

    // Before start: a planted PID file link. The double refuses to start.
    std::fs::create_dir_all(&spec.pipe_dir).expect("pipe dir");
    let pid_link = spec.pipe_dir.join("nvidia-cuda-mps-control.pid");
    symlink(&outside, &pid_link).expect("plant");
    let out = std::process::Command::new(fake_binary())
        .arg("-d")
        .env_clear()
        .env("CUDA_MPS_PIPE_DIRECTORY", &spec.pipe_dir)
        .env("CUDA_MPS_LOG_DIRECTORY", &spec.log_dir)
        .output()
        .expect("run");
    if let Ok(text) = std::fs::read_to_string(&pid_link) {
        if let Ok(pid) = text.trim().parse::<u32>() {
            r.track(pid);
        }
    }
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(unchanged(), "precious\n", "written through the planted PID file link: {stderr}");
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("symbolic link"), "{stderr}");
    std::fs::remove_file(&pid_link).expect("unplant");

    // While it runs: links where it keeps its state (and its temp file).
    let pid = ctl.start_daemon(&spec).expect("start");
    r.track(pid);
    for name in ["fake-state.json", "fake-state.json.tmp"] {
        let p = spec.pipe_dir.join(name);
        let _ = std::fs::remove_file(&p);
        symlink(&outside, &p).expect("plant");
    }
    ctl.send(&spec, &Command::SetDefaultActiveThreadPercentage(30)).expect("a mutating command");
    ctl.send(&spec, &Command::GetServerList).expect("still serves");
    assert_eq!(unchanged(), "precious\n", "written through a planted state link");
    let log = std::fs::read_to_string(spec.log_dir.join("control.log")).expect("control.log");
    assert!(log.contains("symbolic link"), "the refusal is logged: {log}");
    ctl.send(&spec, &Command::Quit).expect("quit");
    assert!(wait_dead(pid));
    assert_eq!(unchanged(), "precious\n");
}
