//! Issue 5 end to end: nothing one tenant leaves in device memory reaches the next —
//! real runc containers writing into their (simulated) device memory, tesserad scrubbing
//! in a `tessera scrub` child, quarantine, unquarantine, and a crash mid-scrub.

// Integration-test crates: clippy counts their helper functions as non-test code, so
// `allow-unwrap-in-tests` (clippy.toml) does not reach them; a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
use std::time::Duration;

use tessera_api::DeviceState;
use tessera_harness::node::*;
use tessera_harness::*;

/// One MIG instance (1g.10gb) on GPU 0 and one whole GPU: each request has exactly one
/// device it can get, so tenant B gets exactly what tenant A had.
/// A node started on [`single_device_node`], whose scratch dir its fixture removes.
fn start_single() -> Node {
    let o = single_device_node();
    let scratch = o.node_file.parent().map(|p| p.to_path_buf());
    let node = Node::start_with(o);
    if let Some(d) = scratch {
        node.fx.cleanup().track_dir(d);
    }
    node
}

fn single_device_node() -> NodeOptions {
    let dir = short_tempdir();
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("node.json");
    std::fs::write(
        &file,
        r#"{"node": "sim-scrub-0", "gpus": [
            {"model": "H100-80GB", "mig": [{"profile": "1g.10gb", "start": 0}]},
            {"model": "H100-80GB"}]}"#,
    )
    .expect("node file");
    NodeOptions {
        node_file: file,
        extra_args: vec!["--no-dynamic-mig".into()],
        ..Default::default()
    }
}

const WRITE_SECRET: &str = "i=0; while [ $i -lt 4096 ]; do printf 'SECRET-PATTERN-42'; i=$((i+1)); done \
     | head -c 65536 | dd of=/dev/tessera-sim-mem conv=notrunc 2>/dev/null; grep -c SECRET-PATTERN-42 /dev/tessera-sim-mem";
const READ_BACK: &str = "grep -c SECRET-PATTERN-42 /dev/tessera-sim-mem; od -An -tx1 -v /dev/tessera-sim-mem | tr -s ' \\n' '\\n' | sort -u | grep -v '^$'";

fn device_state(node: &Node, uuid: &str) -> Option<DeviceState> {
    let s = node.client().status().ok()?;
    s.gpus.iter().find(|g| g.uuid == uuid).map(|g| g.state).or_else(|| {
        s.gpus.iter().flat_map(|g| &g.instances).find(|i| i.uuid == uuid).map(|i| i.state)
    })
}

fn wait_state(node: &Node, uuid: &str, want: DeviceState) -> bool {
    wait_for(|| device_state(node, uuid) == Some(want), Duration::from_secs(15))
}

/// Tenant A writes a secret across its device memory and exits; returns the device.
fn tenant_a_writes(node: &Node, id: &str, request: &str) -> String {
    let b = node.bundle(id, "team-untrusted", Some(request), &["sh", "-c", WRITE_SECRET]);
    let out = node.fx.run_container(&b, id);
    out.assert_success("tenant A");
    let n: u32 = out.stdout_str().trim().parse().expect("count");
    assert!(n > 0, "A's secret is in its device memory");
    node.client()
        .status()
        .expect("status")
        .events
        .iter()
        .find_map(|e| {
            (e.kind == "grant" && e.container_id.as_deref() == Some(id))
                .then(|| e.detail.rsplit("-> ").next().unwrap_or("").to_string())
        })
        .expect("grant event names the device")
}

/// Tenant B gets the same device and reads what it holds: (pattern lines, distinct bytes).
fn tenant_b_reads(node: &Node, id: &str, request: &str, want_device: &str) -> (u32, Vec<String>) {
    let b = node.bundle(id, "team-dev", Some(request), &["sh", "-c", READ_BACK]);
    let out = node.fx.run_container(&b, id);
    let lines: Vec<String> = out.stdout_str().lines().map(str::to_string).collect();
    let grant = node
        .client()
        .status()
        .expect("status")
        .events
        .into_iter()
        .find(|e| e.kind == "grant" && e.container_id.as_deref() == Some(id));
    let got =
        grant.map(|e| e.detail.rsplit("-> ").next().unwrap_or("").to_string()).unwrap_or_default();
    assert_eq!(got, want_device, "B must get the very device A used:\n{}", out.stderr_str());
    (lines.first().and_then(|l| l.trim().parse().ok()).unwrap_or(u32::MAX), lines[1..].to_vec())
}

#[test]
fn a_secret_left_in_device_memory_never_reaches_the_next_tenant() {
    let node = start_single();
    for (a, b, req) in [("a-mig", "b-mig", "mig=1g.10gb"), ("a-gpu", "b-gpu", "gpu=1")] {
        let device = tenant_a_writes(&node, a, req);
        assert!(
            wait_state(&node, &device, DeviceState::Free),
            "{device} was not scrubbed back to free"
        );
        let (hits, bytes) = tenant_b_reads(&node, b, req, &device);
        assert_eq!(hits, 0, "{req}: tenant B found A's secret");
        assert_eq!(bytes, ["00"], "{req}: B's device memory is all zeros");
        let st = node.client().status().expect("status");
        let scrubs: Vec<_> =
            st.events.iter().filter(|e| e.kind == "scrub" && e.detail.contains(&device)).collect();
        assert!(
            scrubs
                .iter()
                .any(|e| e.detail.contains("free after scrub")
                    && e.detail.contains("0 non-zero words")),
            "{scrubs:?}"
        );
    }
}

fn faults_file(node: &Node) -> PathBuf {
    node.state.join("sim").join("scrub-faults.json")
}

fn inject(node: &Node, device: &str, mode: &str) {
    std::fs::write(faults_file(node), format!(r#"{{"devices": {{"{device}": "{mode}"}}}}"#))
        .expect("faults");
}

fn the_instance(node: &Node) -> String {
    node.client().status().expect("status").gpus[0].instances[0].uuid.clone()
}

#[test]
fn a_failing_scrub_quarantines_until_a_good_scrub() {
    let node = start_single();
    let device = the_instance(&node);
    inject(&node, &device, "leave_nonzero");
    assert_eq!(tenant_a_writes(&node, "a", "mig=1g.10gb"), device);
    assert!(wait_state(&node, &device, DeviceState::Quarantined), "a failed scrub must quarantine");

    // Status says so, and a request only that device could serve fails clearly.
    let text = node.cli(&["status"]).stdout_str();
    assert!(text.contains("quarantined") && text.contains("FAILED"), "{text}");
    let b = node.bundle("b", "team-dev", Some("mig=1g.10gb"), &["true"]);
    let out = node.fx.run_container(&b, "b");
    out.assert_failure("request for a quarantined device");
    assert!(out.stderr_str().contains("quarantined"), "{}", out.stderr_str());

    // Unquarantine re-scrubs: still faulty, still quarantined.
    let out = node.cli(&["device", "unquarantine", &device]);
    out.assert_failure("unquarantine with the fault still there");
    assert_eq!(device_state(&node, &device), Some(DeviceState::Quarantined));
    // Fault gone: the scrub succeeds and the device returns, clean.
    std::fs::remove_file(faults_file(&node)).expect("rm faults");
    let out = node.cli(&["device", "unquarantine", &device]);
    out.assert_success("unquarantine");
    assert_eq!(device_state(&node, &device), Some(DeviceState::Free));
    let (hits, bytes) = tenant_b_reads(&node, "b2", "mig=1g.10gb", &device);
    assert_eq!((hits, bytes), (0, vec!["00".to_string()]));
}

#[test]
fn a_scrub_interrupted_by_a_daemon_crash_resumes_after_restart() {
    let mut node = start_single();
    let device = the_instance(&node);
    inject(&node, &device, "hang");
    assert_eq!(tenant_a_writes(&node, "a", "mig=1g.10gb"), device);
    assert!(wait_state(&node, &device, DeviceState::Scrubbing), "the scrub should be running");
    // Control: A's secret really is in the device memory B will be handed (it is the scrub,
    // not a different file, that makes B's read come back zero).
    let file = node.state.join("sim/mem").join(format!("{device}.bin"));
    let held = std::fs::read(&file).expect("device memory");
    assert!(
        held.windows(17).any(|w| w == b"SECRET-PATTERN-42"),
        "A's secret should be in {}",
        file.display()
    );

    node.daemon.kill9();
    // The hanging scrub child dies with its daemon's machine in real life; here, kill it.
    let mem = node.state.join("sim/mem").display().to_string();
    for (pid, _) in processes_mentioning(&mem) {
        terminate_pid(pid, None, Duration::from_millis(200));
    }
    std::fs::remove_file(faults_file(&node)).expect("rm faults");
    node.restart();
    assert!(wait_state(&node, &device, DeviceState::Free), "the interrupted scrub was not resumed");
    let st = node.client().status().expect("status");
    assert!(st.events.iter().any(|e| e.kind == "scrub"
        && e.detail.contains(&device)
        && e.detail.contains("free after scrub")));
    let (hits, bytes) = tenant_b_reads(&node, "b", "mig=1g.10gb", &device);
    assert_eq!((hits, bytes), (0, vec!["00".to_string()]));
}

/// Issue 12, end to end: tesserad dies (`abort` at the grant-commit failpoint, as a `kill -9`
/// there would) after planning to hand tenant A its own dirty device back unscrubbed
/// (`same_tenant_skip`) and before committing that grant. After the restart there is no half
/// grant, and the device is dirty or scrubbed — never free with A's data in it.
#[test]
fn a_daemon_killed_between_planning_and_committing_a_grant_never_frees_a_dirty_device() {
    if !cfg!(debug_assertions) {
        eprintln!("skipped: TESSERA_FAILPOINT is read by debug builds of tesserad only");
        return;
    }
    let mut o = single_device_node();
    let scratch = o.node_file.parent().expect("scratch").to_path_buf();
    let mut policy: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&o.policy).expect("policy")).expect("json");
    policy["scrub"] = serde_json::json!({"same_tenant_skip": true});
    o.policy = scratch.join("policy.json");
    std::fs::write(&o.policy, serde_json::to_vec(&policy).expect("json")).expect("policy");
    o.env.push(("TESSERA_FAILPOINT".into(), "grant-commit=abort@victim".into()));
    let mut node = Node::start_with(o);
    node.fx.cleanup().track_dir(&scratch);
    let c = node.client();
    let runc_root = node.fx.path("no-runc-root"); // runc never had these containers
    let alloc = |id: &str, request: &str| {
        serde_json::from_value::<tessera_api::AllocateRequest>(serde_json::json!({
            "container_id": id,
            "runc_root": runc_root.display().to_string(),
            "bundle": format!("/bundles/{id}"),
            "request": request,
            "request_source": "annotation",
            "annotations": {NS: "team-untrusted"},
        }))
        .expect("request")
    };

    // The scrub worker is kept busy on the MIG instance (its scrub hangs), so the GPU tenant
    // A leaves stays dirty rather than being scrubbed at once.
    let decoy = the_instance(&node);
    inject(&node, &decoy, "hang");
    c.allocate(&alloc("a-mig", "mig=1g.10gb")).expect("A's instance");
    let gpu = c.allocate(&alloc("a-gpu", "gpu=1")).expect("A's GPU").devices[0].uuid.clone();
    let mem = node.state.join("sim/mem").join(format!("{gpu}.bin"));
    let mut bytes = std::fs::read(&mem).expect("device memory");
    bytes[..17].copy_from_slice(b"SECRET-PATTERN-42");
    std::fs::write(&mem, &bytes).expect("A writes its secret");
    c.release("a-mig").expect("release the instance");
    assert!(wait_state(&node, &decoy, DeviceState::Scrubbing), "the decoy scrub should run");
    c.release("a-gpu").expect("release the GPU");
    assert_eq!(device_state(&node, &gpu), Some(DeviceState::Dirty));

    // A asks again: planned onto its own dirty GPU; tesserad dies before the commit.
    assert!(c.allocate(&alloc("victim", "gpu=1")).is_err(), "the daemon should have died");
    assert!(node.daemon.wait_exit(Duration::from_secs(10)).is_some(), "tesserad still runs");
    let sim_mem = node.state.join("sim/mem").display().to_string();
    for (pid, _) in processes_mentioning(&sim_mem) {
        terminate_pid(pid, None, Duration::from_millis(200));
    }
    std::fs::remove_file(faults_file(&node)).expect("rm faults");
    node.restart();

    assert!(c.allocation("victim").is_err(), "a half grant survived the crash");
    let st = device_state(&node, &gpu);
    assert!(
        matches!(st, Some(DeviceState::Dirty | DeviceState::Scrubbing | DeviceState::Free)),
        "{st:?}"
    );
    // Whatever it is now, it becomes free only through a scrub that wiped A's secret.
    assert!(wait_state(&node, &gpu, DeviceState::Free), "the dirty GPU was never scrubbed");
    let held = std::fs::read(&mem).expect("device memory");
    assert!(!held.windows(17).any(|w| w == b"SECRET-PATTERN-42"), "free with A's secret in it");
    let events = c.status().expect("status").events;
    assert!(
        events.iter().any(|e| e.kind == "scrub"
            && e.detail.contains(gpu.as_str())
            && e.detail.contains("free after scrub")),
        "{events:?}"
    );
}
