//! Proves the end-to-end harness (the `tessera-harness` crate) against the real runc and
//! containerd, with no Tessera component involved. Needs root, runc, containerd, ctr, /bin/busybox
//! and cgroup v1 with the devices controller.
//!
//! Run: `cargo test --test harness_selftest -- --test-threads=1`

use std::fs;
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use tessera_harness::*;

/// The tokens of the `ls -l` line for `name`, e.g. `["crw-rw-rw-", "1", "root", "root",
/// "1,", "3", ...]`.
fn ls_line<'a>(listing: &'a str, name: &str) -> Vec<&'a str> {
    listing
        .lines()
        .find(|l| l.split_whitespace().last() == Some(name))
        .unwrap_or_else(|| panic!("{name} not in listing:\n{listing}"))
        .split_whitespace()
        .collect()
}

#[test]
fn a_runc_runs_busybox_and_output_is_captured() {
    let t = Instant::now();
    let fx = Fixture::new();
    let mut b = fx.bundle("echo");
    b.args(&["echo", "hi"]).write();
    let out = fx.run_container(&b, "echo");
    out.assert_success("runc run echo");
    assert_eq!(out.stdout_str(), "hi\n");
    assert_eq!(out.stderr_str(), "");

    // env, annotations, a failing command and the busybox rootfs contents.
    let mut b = fx.bundle("env");
    b.args(&["sh", "-c", "echo \"foo=$FOO\"; head -1 /etc/passwd; ls /bin | wc -l; exit 3"])
        .env("FOO=bar")
        .annotation("tessera.test/key", "v")
        .write();
    let cfg: serde_json::Value =
        serde_json::from_slice(&fs::read(b.config_path()).expect("read config")).expect("json");
    assert_eq!(cfg["annotations"]["tessera.test/key"], "v");
    assert_eq!(cfg["linux"]["cgroupsPath"], format!("{}/env", fx.cgroup_parent()));
    let out = fx.run_container(&b, "env");
    assert_eq!(out.status.code(), Some(3), "exit code passes through: {out:?}");
    let lines: Vec<String> = out.stdout_str().lines().map(str::to_owned).collect();
    assert_eq!(lines[0], "foo=bar");
    assert_eq!(lines[1], "root:x:0:0:root:/root:/bin/sh");
    let applets: usize = lines[2].trim().parse().expect("count");
    assert!(applets >= 19, "busybox + applets in /bin, got {applets}");

    // runc run removed its containers; the cleanup removes the cgroup parent it left.
    assert!(runc_container_ids(&fx.runc_root()).is_empty());
    assert!(!cgroup_dirs(&fx.cgroup_parent()).is_empty(), "runc leaves the parent cgroup");
    let fp = fx.footprint();
    drop(fx);
    assert_no_leftovers(&fp);
    eprintln!("a: {:?}", t.elapsed());
}

#[test]
fn b_long_running_container_devices_list_and_cleanup() {
    let t = Instant::now();
    let fx = Fixture::new();
    let mut b = fx.bundle("long");
    b.args(&["sleep", "300"]).write();
    let out = fx.create_container(&b, "long");
    out.assert_success("runc create");
    assert_eq!(fx.status("long").as_deref(), Some("created"));
    fx.start_container("long").assert_success("runc start");
    assert_eq!(fx.status("long").as_deref(), Some("running"));
    let pid = fx.container_pid("long").expect("pid");
    let starttime = proc_starttime(pid);
    assert!(pid_alive(pid, starttime));
    // `runc start` returns once it has told init to go; init then execs the process.
    assert!(
        wait_for(|| proc_cmdline(pid).as_deref() == Some("sleep 300"), Duration::from_secs(10)),
        "init became `sleep 300`: {:?}",
        proc_cmdline(pid)
    );

    // Default device cgroup of runc 1.1: deny all, then its default allow list.
    let list = devices_list(&b.cgroups_path());
    let rules: Vec<&str> = list.lines().collect();
    for want in [
        "c *:* m",
        "b *:* m",
        "c 1:3 rwm",
        "c 1:5 rwm",
        "c 1:7 rwm",
        "c 1:8 rwm",
        "c 1:9 rwm",
        "c 5:0 rwm",
        "c 5:2 rwm",
        "c 136:* rwm",
    ] {
        assert!(rules.contains(&want), "{want:?} missing from devices.list:\n{list}");
    }
    assert!(!rules.contains(&"a *:* rwm"), "container must not have all devices:\n{list}");
    // The host root cgroup is unrestricted; our container's is not.
    assert!(fs::read_to_string("/sys/fs/cgroup/devices/devices.list")
        .expect("root devices.list")
        .contains("a *:* rwm"));

    // exec sees the same container.
    let out = fx.exec("long", &["cat", "/proc/1/cmdline"]);
    out.assert_success("runc exec");
    assert_eq!(out.stdout_str(), "sleep\u{0}300\u{0}");

    // Everything exists now; the guard must remove all of it without help.
    let cg_dirs = cgroup_dirs(&b.cgroups_path());
    assert!(cg_dirs.len() >= 9, "container cgroup in every hierarchy: {cg_dirs:?}");
    assert_eq!(runc_container_ids(&fx.runc_root()), vec!["long".to_owned()]);
    let fp = fx.footprint();
    assert!(fp.cgroups.contains(&fx.cgroup_parent()));
    assert!(!leftovers(&fp).is_empty(), "leftovers() sees the live fixture");
    let runc_root = fx.runc_root();
    drop(fx);

    assert_no_leftovers(&fp);
    assert!(!pid_alive(pid, starttime), "container init {pid} survived cleanup");
    assert!(cg_dirs.iter().all(|d| !d.exists()), "cgroup dirs survived: {cg_dirs:?}");
    assert!(!runc_root.exists(), "runc state survived");
    eprintln!("b: {:?}", t.elapsed());
}

#[test]
fn c_containerd_ctr_run_rootfs_and_teardown() {
    let t = Instant::now();
    let ctd = Containerd::start();
    let containerd_pid = ctd.pid() as i32;
    assert!(pid_alive(containerd_pid, None));
    let out = ctd.ctr(&["version"]);
    out.assert_success("ctr version");
    assert!(out.stdout_str().contains("1.6."), "{}", out.stdout_str());
    let rootfs = Rootfs::busybox(ctd.dir().join("rootfs"));

    // Foreground run: output comes back through ctr.
    let out = ctd.ctr_run(&rootfs, "c1", &["--runc-binary", "runc"], &["echo", "hi"]);
    out.assert_success("ctr run echo");
    assert_eq!(out.stdout_str(), "hi\n");
    assert!(ctd.ctr(&["containers", "ls", "-q"]).stdout_str().trim().is_empty(), "--rm");

    // A detached container with annotation and custom cgroup: left running on purpose,
    // so the teardown has a live task, shim and cgroup to remove.
    let cg = format!("{}/c2", ctd.cgroup_parent());
    let out = ctd.ctr_run(
        &rootfs,
        "c2",
        &["-d", "--runc-binary", "runc", "--annotation", "tessera.test/a=b", "--cgroup", &cg],
        &["sleep", "300"],
    );
    out.assert_success("ctr run -d");
    let spec: serde_json::Value = serde_json::from_slice(
        &fs::read(ctd.bundle_dir("c2").join("config.json")).expect("shim bundle config.json"),
    )
    .expect("json");
    assert_eq!(spec["annotations"]["tessera.test/a"], "b", "annotation reaches the runtime");
    assert_eq!(spec["linux"]["cgroupsPath"], cg.as_str());
    assert!(wait_for(|| devices_list(&cg).contains("c 1:3 rwm"), Duration::from_secs(5)));
    let shims = ctd.shims();
    assert_eq!(shims.len(), 1, "one shim for c2: {shims:?}");
    let tasks = ctd.ctr(&["tasks", "ls"]).stdout_str();
    assert!(tasks.contains("c2") && tasks.contains("RUNNING"), "{tasks}");
    assert_eq!(runc_container_ids(&ctd.runc_root()), vec!["c2".to_owned()]);

    let fp = ctd.footprint();
    assert!(fp.pids.iter().any(|&(p, _)| p == containerd_pid));
    let dir = ctd.dir().to_path_buf();
    drop(ctd);

    assert_no_leftovers(&fp);
    assert!(!pid_alive(containerd_pid, None), "containerd survived");
    for pid in shims {
        assert!(!pid_alive(pid, None), "shim {pid} survived");
    }
    assert!(mounts_under(&dir).is_empty());
    assert!(cgroup_dirs(&cg).is_empty(), "container cgroup survived");
    assert!(processes_mentioning(&dir.to_string_lossy()).is_empty());
    eprintln!("c: {:?}", t.elapsed());
}

#[test]
fn d_runc_creates_device_nodes_and_cgroup_rules_from_spec() {
    let t = Instant::now();
    let fx = Fixture::new();
    let script = "ls -l /dev; \
        echo x > /dev/tessera-test-null && echo null-write-ok; \
        cat /dev/nvidia0 2>&1; true";

    // Allowed device: the node exists with the spec's numbers; opening it reaches the
    // (absent) driver: ENXIO, not the cgroup's EPERM.
    let mut b = fx.bundle("dev");
    b.args(&["sh", "-c", script])
        .device("/dev/tessera-test-null", 'c', 1, 3)
        .device("/dev/nvidia0", 'c', 195, 0)
        .allow_device('c', Some(195), Some(0), "rw")
        .write();
    let out = fx.run_container(&b, "dev");
    out.assert_success("runc run dev");
    let listing = out.stdout_str();
    let null = ls_line(&listing, "tessera-test-null");
    assert!(null[0].starts_with('c'), "char device: {null:?}");
    assert_eq!((null[4], null[5]), ("1,", "3"), "{null:?}");
    assert!(null[0].starts_with("crw-rw-rw-"), "fileMode 0666: {null:?}");
    let nv = ls_line(&listing, "nvidia0");
    assert_eq!((nv[0].chars().next(), nv[4], nv[5]), (Some('c'), "195,", "0"), "{nv:?}");
    assert!(listing.contains("null-write-ok"), "{listing}");
    assert!(listing.contains("No such device or address"), "{listing}");

    // Same node without the allow rule: the device cgroup refuses it.
    let mut b = fx.bundle("denied");
    b.args(&["sh", "-c", script]).device("/dev/nvidia0", 'c', 195, 0).write();
    let out = fx.run_container(&b, "denied");
    out.assert_success("runc run denied");
    let listing = out.stdout_str();
    assert_eq!(ls_line(&listing, "nvidia0")[4], "195,");
    assert!(listing.contains("Operation not permitted"), "{listing}");

    // And the rule is visible in devices.list of a running container.
    let mut b = fx.bundle("rule");
    b.args(&["sleep", "300"])
        .device("/dev/nvidia0", 'c', 195, 0)
        .allow_device('c', Some(195), Some(0), "rw")
        .write();
    fx.run_detached(&b, "rule");
    assert!(devices_list(&b.cgroups_path()).lines().any(|l| l == "c 195:0 rw"));

    let fp = fx.footprint();
    drop(fx);
    assert_no_leftovers(&fp);
    eprintln!("d: {:?}", t.elapsed());
}

#[test]
fn e_child_process_restart_and_pid_tracking() {
    let t = Instant::now();
    let fx = Fixture::new();
    // argv[0] under the fixture dir, so the command line names it (as daemons' do).
    let sleep = fx.path("sleep");
    std::os::unix::fs::symlink(BUSYBOX, &sleep).expect("symlink");

    let mut daemon = fx.spawn("daemon", &sleep, ["300"], [("K", "V")]);
    let first = daemon.pid() as i32;
    assert!(daemon.is_running() && pid_alive(first, None));
    assert!(daemon.kill9().is_some());
    assert!(!pid_alive(first, None));
    daemon.restart();
    let second = daemon.pid() as i32;
    assert_ne!(first, second);
    assert!(daemon.is_running());
    // Right after exec the kernel may not have published argv/environ yet: poll.
    let has_env = || {
        let env = fs::read(format!("/proc/{second}/environ")).unwrap_or_default();
        env.split(|&c| c == 0).any(|kv| kv == b"K=V")
    };
    assert!(wait_for(has_env, Duration::from_secs(2)), "env passes to restarts");

    // A tracked raw child, and an untracked one found by its command line.
    let mut tracked = Command::new(&sleep).arg("301").spawn().expect("spawn");
    fx.cleanup().track_pid(tracked.id());
    let mut stray = Command::new(&sleep).arg("302").spawn().expect("spawn");
    let named = || processes_mentioning(&fx.dir().to_string_lossy()).len() == 3;
    assert!(wait_for(named, Duration::from_secs(2)), "daemon, tracked and stray name the dir");
    // One that names the dir only in its environment (as an MPS control daemon its pipe
    // directory), run from outside it.
    let mut by_env = Command::new(BUSYBOX)
        .args(["sleep", "303"])
        .env("CUDA_MPS_PIPE_DIRECTORY", fx.path("mps/pipe"))
        .spawn()
        .expect("spawn");
    let env_named = || {
        processes_whose_env_mentions(&fx.dir().to_string_lossy()).contains(&(by_env.id() as i32))
    };
    assert!(wait_for(env_named, Duration::from_secs(2)), "its environment names the dir");

    // Sockets: short enough, bindable.
    let sock = fx.socket_path("d.sock");
    let _l = UnixListener::bind(&sock).expect("bind fixture socket");
    let (_keep, s2) = tmp_socket_path();
    assert!(s2.as_os_str().len() < 108);
    UnixListener::bind(&s2).expect("bind tmp socket");

    // A mount left under the fixture dir (as a snapshotter or a bind would leave).
    let mnt = fx.path("mnt");
    fs::create_dir(&mnt).expect("mkdir");
    nix::mount::mount(
        Some("tmpfs"),
        &mnt,
        Some("tmpfs"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .expect("mount tmpfs");
    assert_eq!(mounts_under(fx.dir()), vec![mnt.clone()]);

    let fp = fx.footprint();
    fx.run_cleanup();
    assert!(mounts_under(&mnt).is_empty(), "cleanup unmounted it");
    assert!(tracked.wait().expect("wait").code().is_none(), "killed by a signal");
    assert!(stray.wait().expect("wait").code().is_none(), "killed by a signal");
    assert!(by_env.wait().expect("wait").code().is_none(), "killed by a signal");
    // Killed by the cleanup (its command line names the fixture dir); the exit itself is
    // asynchronous, so wait for it (bounded) rather than sample it once.
    assert!(daemon.wait_exit(Duration::from_secs(5)).is_some(), "daemon named the fixture dir");
    drop(daemon);
    drop(fx);
    assert_no_leftovers(&fp);
    assert!(!Path::new(&sock).exists());
    eprintln!("e: {:?}", t.elapsed());
}

#[test]
fn f_containerd_crash_restart_and_forced_teardown() {
    let t = Instant::now();
    let mut ctd = Containerd::start();
    let rootfs = Rootfs::busybox(ctd.dir().join("rootfs"));
    ctd.ctr_run(&rootfs, "c3", &["-d"], &["sleep", "300"]).assert_success("ctr run -d");
    let shims = ctd.shims();
    assert_eq!(shims.len(), 1, "{shims:?}");

    // A containerd crash leaves shim and container running; a restart reconnects.
    ctd.kill9();
    assert!(pid_alive(shims[0], None), "shim survives a containerd crash");
    ctd.restart();
    let tasks = ctd.ctr(&["tasks", "ls"]).stdout_str();
    assert!(tasks.contains("c3") && tasks.contains("RUNNING"), "{tasks}");

    // Crash again and leave it to the fixture: no ctr, so shims are SIGKILLed, their
    // sockets under /run/containerd/s removed, the container force-deleted with runc.
    ctd.kill9();
    let cg = format!("{}/c3", ctd.cgroup_parent());
    assert!(!cgroup_dirs(&cg).is_empty());
    ctd.stop();
    let fp = ctd.footprint();
    drop(ctd);
    assert!(
        fp.files.iter().any(|f| f.starts_with("/run/containerd/s")),
        "the killed shim's socket was found: {fp:?}"
    );
    assert_no_leftovers(&fp);
    assert!(!pid_alive(shims[0], None));
    eprintln!("f: {:?}", t.elapsed());
}

#[test]
fn g_cleanup_runs_when_a_test_panics() {
    let t = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel();
    let joined = std::thread::spawn(move || {
        let fx = Fixture::new();
        let mut b = fx.bundle("p");
        b.args(&["sleep", "300"]).write();
        let pid = fx.run_detached(&b, "p");
        tx.send((fx.footprint(), pid, proc_starttime(pid))).expect("send");
        panic!("simulated test failure with a running container");
    })
    .join();
    assert!(joined.is_err());
    let (fp, pid, starttime) = rx.recv().expect("footprint");
    assert!(!pid_alive(pid, starttime), "container init survived the unwinding");
    assert_no_leftovers(&fp);
    eprintln!("g: {:?}", t.elapsed());
}
