//! Issue 4 end to end: supervised MPS control daemons per (device, tenant) with caps set
//! daemon-side, and time-sliced replicas fenced by sharing domain — real runc containers,
//! tesserad, and the documented-protocol test double `fake-nvidia-cuda-mps-control`
//! (the real binary is not installable here).

// Integration-test crates: clippy counts their helper functions as non-test code, so
// `allow-unwrap-in-tests` (clippy.toml) does not reach them; a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use mpsd::{Command, DaemonSpec, DeviceRef, MpsControl, ProcessControl};
use tessera_api::Allocation;
use tessera_harness::node::*;
use tessera_harness::*;

/// The MPS control test double (built once per run, whichever package holds it).
fn fake() -> &'static str {
    fresh_bin("fake-nvidia-cuda-mps-control")
}

fn mps_node() -> Node {
    Node::start_with(NodeOptions {
        extra_args: vec![
            "--mps-control".into(),
            fake().into(),
            "--mps-health-interval-ms".into(),
            "200".into(),
        ],
        ..Default::default()
    })
}

fn share_pids(node: &Node) -> BTreeMap<String, u32> {
    node.client()
        .status()
        .expect("status")
        .mps_shares
        .into_iter()
        .filter_map(|s| s.pid.map(|p| (s.tenant, p)))
        .collect()
}

fn spec(state: &Path, a: &Allocation) -> DaemonSpec {
    let device = a.share.as_ref().expect("share").device.clone();
    let dirs = mpsd::layout::ShareDirs::new(state, None, &device, &a.tenant).expect("share dirs");
    DaemonSpec { device, pipe_dir: dirs.pipe, log_dir: dirs.log, shm_dir: None }
}

/// (thread percentage, pinned memory limit in bytes) read back through the control protocol.
fn caps(state: &Path, a: &Allocation) -> (f64, u64) {
    let control = ProcessControl::new(PathBuf::from(fake()));
    let s = spec(state, a);
    let pct = control.send(&s, &Command::GetDefaultActiveThreadPercentage).expect("get thread %");
    let mem = control
        .send(
            &s,
            &Command::GetDefaultDevicePinnedMemLimit { device: DeviceRef::Uuid(s.device.clone()) },
        )
        .expect("get mem limit");
    (
        mpsd::protocol::parse_thread_percentage(&pct).expect("thread %"),
        mpsd::protocol::parse_mem_limit(&mem).expect("mem limit").bytes(),
    )
}

#[test]
fn two_tenants_get_their_own_capped_daemons_and_a_third_share_goes_elsewhere() {
    let node = mps_node();
    let mut guard = KillOnDrop(Vec::new());
    let b = node.bundle("alice", "team-trusted", Some("mps=50"), &["sleep", "300"]);
    node.fx.run_detached(&b, "alice");
    let b = node.bundle("carol", "team-research", Some("mps=25"), &["sleep", "300"]);
    node.fx.run_detached(&b, "carol");
    let pids = share_pids(&node);
    guard.0.extend(pids.values());
    let c = node.client();
    let (a, k) = (c.allocation("alice").expect("alice"), c.allocation("carol").expect("carol"));
    let device = a.share.as_ref().expect("share").device.clone();
    assert_eq!(k.share.as_ref().expect("share").device, device, "both shares pack onto one GPU");
    assert_eq!(pids.len(), 2, "one control daemon per tenant: {pids:?}");
    assert_ne!(pids["acme/trusted/training/alice"], pids["acme/trusted/training/carol"]);

    // Caps were set daemon-side; read them back through the control protocol.
    let gpu_bytes = node
        .client()
        .status()
        .expect("status")
        .gpus
        .iter()
        .find(|g| g.uuid == device)
        .expect("gpu")
        .memory_mib
        << 20;
    let (pct, mem) = caps(&node.state, &a);
    assert_eq!(pct, 50.0);
    assert!(
        mem <= gpu_bytes / 2 && mem + (1 << 30) > gpu_bytes / 2,
        "alice mem cap {mem} vs half of {gpu_bytes}"
    );
    let (pct, mem) = caps(&node.state, &k);
    assert_eq!(pct, 25.0);
    assert!(
        mem <= gpu_bytes / 4 && mem + (1 << 30) > gpu_bytes / 4,
        "carol mem cap {mem} vs a quarter of {gpu_bytes}"
    );

    // Inside the container: the tenant's pipe directory and the env that points at it.
    let out =
        node.fx.exec("alice", &["sh", "-c", "echo $CUDA_MPS_PIPE_DIRECTORY; ls /tmp/nvidia-mps"]);
    out.assert_success("exec");
    let text = out.stdout_str();
    assert!(text.starts_with("/tmp/nvidia-mps\n"), "{text}");
    assert!(text.contains("control"), "the control socket is visible: {text}");

    // A third share of 40% does not fit the 25% left there: it goes to another device.
    let b = node.bundle("bob", "team-dev", Some("mps=40"), &["sleep", "300"]);
    node.fx.run_detached(&b, "bob");
    guard.0.extend(share_pids(&node).values());
    let bob = c.allocation("bob").expect("bob");
    assert_ne!(bob.share.as_ref().expect("share").device, device);

    // The policy's cap is enforced before any device is looked at.
    let b = node.bundle("greedy", "team-trusted", Some("mps=80"), &["true"]);
    let out = node.fx.run_container(&b, "greedy");
    out.assert_failure("mps above mps.max_percent");
    assert!(out.stderr_str().contains("mps.max_percent"), "{}", out.stderr_str());

    // The operator sees the shares.
    let status = node.cli(&["status"]).stdout_str();
    assert!(status.contains("mps") && status.contains("50%") && status.contains("25%"), "{status}");

    // The last container of a share stops its daemon.
    let alice_pid = pids["acme/trusted/training/alice"];
    node.fx.delete_container("alice", true).assert_success("delete");
    assert!(
        wait_for(|| !pid_alive(alice_pid as i32, None), Duration::from_secs(10)),
        "alice's daemon still runs"
    );
    assert!(
        pid_alive(pids["acme/trusted/training/carol"] as i32, None),
        "carol's daemon must be untouched"
    );
}

#[test]
fn a_killed_control_daemon_is_restarted_and_the_others_are_untouched() {
    let node = mps_node();
    let mut guard = KillOnDrop(Vec::new());
    for (id, ns, req) in [("alice", "team-trusted", "mps=50"), ("carol", "team-research", "mps=25")]
    {
        let b = node.bundle(id, ns, Some(req), &["sleep", "300"]);
        node.fx.run_detached(&b, id);
    }
    let before = share_pids(&node);
    guard.0.extend(before.values());
    let victim = before["acme/trusted/training/alice"];
    terminate_pid(victim as i32, None, Duration::from_millis(10));
    let restarted = wait_for(
        || share_pids(&node).get("acme/trusted/training/alice").is_some_and(|p| *p != victim),
        Duration::from_secs(15),
    );
    assert!(
        restarted,
        "alice's daemon was not restarted: {:?}",
        node.client().status().map(|s| s.mps_shares)
    );
    let after = share_pids(&node);
    guard.0.extend(after.values());
    assert_eq!(
        after["acme/trusted/training/carol"], before["acme/trusted/training/carol"],
        "carol's daemon untouched"
    );
    // The caps are back before any client could reconnect.
    let a = node.client().allocation("alice").expect("alice");
    assert_eq!(caps(&node.state, &a).0, 50.0);
    // The crash is in status (events, restart count) and in the daemon's log.
    let status = node.client().status().expect("status");
    let share = status
        .mps_shares
        .iter()
        .find(|s| s.tenant == "acme/trusted/training/alice")
        .expect("share");
    assert!(share.restarts >= 1, "{share:?}");
    assert!(
        status
            .events
            .iter()
            .any(|e| e.kind == "mps" && e.detail.contains("crashed") && e.detail.contains("alice")),
        "{:?}",
        status.events
    );
    assert!(node.daemon.stderr().contains("mps supervision"), "{}", node.daemon.stderr());
}

#[test]
fn shared_replicas_stay_in_their_sharing_domain() {
    let node = mps_node();
    let mut devices = BTreeMap::new();
    for (id, ns) in [("nb1", "team-dev"), ("nb2", "team-dev"), ("scratch", "team-scratch")] {
        let b = node.bundle(id, ns, Some("shared"), &["sleep", "300"]);
        node.fx.run_detached(&b, id);
        let a = node.client().allocation(id).expect("grant");
        let s = a.share.expect("share");
        assert_eq!(s.replicas, Some(4));
        devices.insert(id, (s.device, s.domain.unwrap_or_default()));
    }
    assert_eq!(devices["nb1"], devices["nb2"], "one domain packs onto one GPU");
    assert_eq!(devices["nb1"].1, "notebooks");
    assert_ne!(devices["scratch"].0, devices["nb1"].0, "another domain never shares that GPU");
    // Trusted tenants may not time-slice at all; untrusted ones neither (tested elsewhere).
    let b = node.bundle("t", "team-trusted", Some("shared"), &["true"]);
    let out = node.fx.run_container(&b, "t");
    out.assert_failure("trusted shared");
    assert!(out.stderr_str().contains("tiers.trusted.allow"), "{}", out.stderr_str());
}

#[test]
fn tesserad_restarts_adopt_live_control_daemons() {
    let mut node = mps_node();
    let mut guard = KillOnDrop(Vec::new());
    for (id, ns, req) in [("alice", "team-trusted", "mps=50"), ("carol", "team-research", "mps=25")]
    {
        let b = node.bundle(id, ns, Some(req), &["sleep", "300"]);
        node.fx.run_detached(&b, id);
    }
    let before = share_pids(&node);
    guard.0.extend(before.values());
    // This test's control daemons: the fake binary with a pipe directory in our state dir
    // (tests run in parallel, each with daemons of its own).
    let state = node.state.display().to_string();
    let fakes = || {
        processes_mentioning(fake())
            .into_iter()
            .filter(|(pid, _)| {
                std::fs::read(format!("/proc/{pid}/environ"))
                    .map(|env| String::from_utf8_lossy(&env).contains(&state))
                    .unwrap_or(false)
            })
            .count()
    };
    let running = fakes();

    // A clean stop leaves daemons serving live containers running; the next tesserad
    // adopts them. Then the same after kill -9.
    node.daemon.terminate(Duration::from_secs(10));
    node.restart();
    assert_eq!(share_pids(&node), before, "clean restart: same daemons, same pids");
    node.crash_and_restart();
    assert_eq!(share_pids(&node), before, "kill -9 restart: same daemons, same pids");
    assert_eq!(fakes(), running, "no daemon leaked or duplicated");

    // The shares still work after adoption: releasing both stops both daemons.
    node.fx.delete_container("alice", true).assert_success("delete");
    node.fx.delete_container("carol", true).assert_success("delete");
    for pid in before.values() {
        assert!(
            wait_for(|| !pid_alive(*pid as i32, None), Duration::from_secs(10)),
            "daemon {pid} still runs"
        );
    }
    assert!(node.client().status().expect("status").mps_shares.is_empty());
}

/// Issue 11, defect class 3: caps cannot be changed from inside a container. An mps=25
/// container runs a control client (the double's: the only one here; with the host's libc,
/// read-only) against the pipe dir it has mounted and raises its daemon's default thread
/// percentage to 100; within a health tick tesserad reads the caps back, sets them again,
/// records an event and counts the drift in /metrics. The pipe dir is read-only inside the
/// container: clients still connect to its socket, but nothing can be planted in it.
#[test]
fn caps_raised_from_inside_a_container_are_set_back_within_a_health_tick() {
    let port = free_port();
    let node = Node::start_with(NodeOptions {
        extra_args: vec![
            "--mps-control".into(),
            fake().into(),
            "--mps-health-interval-ms".into(),
            "200".into(),
            "--metrics".into(),
            format!("127.0.0.1:{port}"),
        ],
        ..Default::default()
    });
    let mut guard = KillOnDrop(Vec::new());
    let mut b = node.bundle("mallory", "team-research", Some("mps=25"), &["sleep", "300"]);
    let ro_bind = |src: &str, dst: &str| serde_json::json!({"destination": dst, "type": "bind", "source": src, "options": ["rbind", "ro"]});
    b.mutate(|c| {
        let mounts = c["mounts"].as_array_mut().unwrap();
        mounts.push(ro_bind(fake(), "/opt/mps-client"));
        mounts.push(ro_bind("/lib", "/lib"));
        mounts.push(ro_bind("/lib64", "/lib64"));
    })
    .write();
    node.fx.run_detached(&b, "mallory");
    guard.0.extend(share_pids(&node).values());
    let a = node.client().allocation("mallory").expect("mallory");
    let tenant = a.tenant.to_string();
    let device = a.share.as_ref().expect("share").device.clone();
    assert_eq!(caps(&node.state, &a).0, 25.0);
    let pipe = spec(&node.state, &a).pipe_dir;

    // The attack, from inside the container, through the read-only mount.
    let out = node.fx.exec(
        "mallory",
        &["sh", "-c", "echo set_default_active_thread_percentage 100 | /opt/mps-client"],
    );
    out.assert_success("the control client in the container");
    assert!(!out.stdout_str().contains("Cannot find"), "{}", out.stdout_str());
    let sent = mps_double::FakeState::read(&pipe).expect("fake state").commands;
    assert!(sent.iter().any(|c| c == "set_default_active_thread_percentage 100"), "{sent:?}");

    // Within a health tick (200 ms; up to 3 s allowed on a loaded machine): 25 again.
    let attacked = std::time::Instant::now();
    assert!(
        wait_for(|| caps(&node.state, &a).0 == 25.0, Duration::from_secs(3)),
        "caps still raised: {:?}",
        caps(&node.state, &a)
    );
    eprintln!("caps back to 25% {:?} after the attack", attacked.elapsed());
    let status = node.client().status().expect("status");
    assert!(
        status.events.iter().any(|e| e.kind == "mps"
            && e.detail.contains("cap_drift")
            && e.detail.contains(&tenant)
            && e.detail.contains("reads 100")),
        "{:?}",
        status.events
    );
    let metrics = http_get(port, "/metrics");
    let line = format!("tessera_mps_cap_drift_total{{device=\"{device}\",tenant=\"{tenant}\"}} 1");
    assert!(metrics.lines().any(|l| l == line), "no `{line}` in\n{metrics}");

    // Nothing can be planted in the pipe dir from inside.
    for cmd in
        ["touch /tmp/nvidia-mps/planted", "ln -s /etc/hostname /tmp/nvidia-mps/fake-state.json.tmp"]
    {
        let out = node.fx.exec("mallory", &["sh", "-c", cmd]);
        out.assert_failure(cmd);
        assert!(out.stderr_str().contains("Read-only file system"), "{cmd}: {}", out.stderr_str());
    }
    assert!(!pipe.join("planted").exists() && !pipe.join("fake-state.json.tmp").exists());

    let daemon = share_pids(&node)[&tenant];
    node.fx.delete_container("mallory", true).assert_success("delete");
    assert!(
        wait_for(|| !pid_alive(daemon as i32, None), Duration::from_secs(10)),
        "daemon {daemon} still runs"
    );
}

/// tesserad given `--mps-control` as a relative path with a directory in it (which the
/// control processes, run from `/`, would resolve elsewhere) refuses to start, naming the
/// path and what to give instead, and never opens its socket.
#[test]
fn tesserad_refuses_a_relative_mps_control_path_at_start_naming_it() {
    let fx = Fixture::new();
    let socket = fx.socket_path("d.sock");
    let mut child = std::process::Command::new(tesserad())
        .args(["--node", &format!("sim:{}", repo("examples/nodes/h100x8.json").display())])
        .args(["--policy", &repo("examples/policy.json").display().to_string()])
        .args(["--state-dir", &fx.path("state").display().to_string()])
        .args(["--socket", &socket.display().to_string()])
        .args(["--mps-control", "bin/fake-nvidia-cuda-mps-control"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let exited = wait_for(|| matches!(child.try_wait(), Ok(Some(_))), Duration::from_secs(10));
    if !exited {
        let _ = child.kill();
        let _ = child.wait();
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(exited, "tesserad started with a relative --mps-control:\n{stderr}");
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(
            "--mps-control bin/fake-nvidia-cuda-mps-control: a relative path; the MPS control \
             binary runs with `/` as its working directory"
        ) && stderr.contains("give an absolute path"),
        "{stderr}"
    );
    assert!(!socket.exists(), "no socket opened");
}
