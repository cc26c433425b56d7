//! Red-team round 4: attacks on round 3's fixes (tests/attack_26_29.rs): the interference
//! detector's "who can be named" rule (crates/interference/src/detect.rs), the latency
//! report's tmpfs (crates/daemon/src/report_fs.rs), and the CPU set that follows the GPUs
//! (`topology.pin_cpus`: create in crates/runtime-hook/src/spec.rs `pin_cpuset`, update in
//! crates/daemon/src/limits.rs `check_cpuset`). Run the way round 3 ran: tesserad on a
//! simulated node, tessera-runtime and tessera-hook as built, real runc and the kernel; the
//! simulator's load files stand in for what NVML measures.
//!
//! A test that fails here is an attack that got through (its assertion carries the
//! evidence); it passes once its class is closed. The passing tests record defences that
//! held.

// Integration-test crates: clippy counts helper functions as non-test code, so
// `allow-unwrap-in-tests` (clippy.toml) does not reach them; a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::Duration;

use tessera_harness::node::*;
use tessera_harness::*;

const INTERVAL_MS: u64 = 200;
const CONFIRM: u32 = 2;

fn interference_events(node: &Node) -> Vec<String> {
    node.client()
        .status()
        .unwrap()
        .events
        .into_iter()
        .filter(|e| e.kind == "interference")
        .map(|e| format!("{} {}", e.container_id.unwrap_or_default(), e.detail))
        .collect()
}

fn daemon_threads(node: &Node, device: &str, tenant: &str) -> f64 {
    let dirs = mpsd::layout::ShareDirs::new(&node.state, None, device, tenant).unwrap();
    mps_double::FakeState::read(&dirs.pipe).unwrap().default_active_thread_percentage
}

/// Runs `id` for tenant behind `ns` on an MPS share of `percent`; the MPS daemons it
/// started are added to `daemons`. Returns (init pid, device uuid, tenant).
fn run_share(
    node: &Node,
    daemons: &mut KillOnDrop,
    id: &str,
    ns: &str,
    percent: u32,
    latency: bool,
) -> (i32, String, String) {
    let mut b = node.bundle(id, ns, Some(&format!("mps={percent}")), &["sleep", "300"]);
    if latency {
        b.annotation("tessera.io/class", "latency");
    }
    b.write();
    node.fx.run_detached(&b, id);
    daemons.0.extend(node.client().status().unwrap().mps_shares.iter().filter_map(|s| s.pid));
    let a = node.client().allocation(id).unwrap();
    (a.pid.unwrap(), a.share.unwrap().device, a.tenant.into_string())
}

/// Class: framing through the interference controller, round 3's fix (detect.rs
/// `culprit`, respond.rs `Incident::measured`).
///
/// The fix names a co-tenant only when its measured use of the saturated resource plus
/// the victim's *solo baseline* of it reaches `saturation`, and it uses at least 20%; a stop
/// needs the victim's measured SM use below `min_share` of its baseline. It never asks
/// whether the victim gets *less* of the saturated resource than its baseline: a latency
/// tenant that learns a 75% bandwidth baseline alone, then keeps using exactly 75% while
/// it starves its own kernels (SM 50% -> 5%, its own doing: the device's SM is 10% busy),
/// gets a co-tenant using 21% of the bandwidth and 5% of the SMs — inside its own
/// `mps=25` share — named, its MPS cap cut, the two tenants marked anti-affine and, with
/// `stop_after_samples`, the co-tenant stopped. Nothing measured shows the co-tenant took
/// anything the victim had: the victim's bandwidth is its baseline, the SMs are idle.
#[test]
fn a_victim_that_gets_all_its_baseline_cannot_get_a_co_tenant_inside_its_share_stopped() {
    let files = short_tempdir();
    std::fs::create_dir_all(&files).unwrap();
    let node = start_interference_node(
        &files,
        1,
        CONFIRM,
        INTERVAL_MS,
        serde_json::json!({"stop_after_samples": 4, "stop_grace_s": 1}),
    );
    let mut daemons = KillOnDrop(Vec::new());
    let (bpid, device, btenant) =
        run_share(&node, &mut daemons, "bystander", "team-research", 25, false);
    let (lpid, ldev, _) = run_share(&node, &mut daemons, "liar", "team-dev", 50, true);
    assert_eq!(ldev, device, "MPS packs them on one GPU");
    let cap_before = daemon_threads(&node, &device, &btenant);

    // Baseline, alone: SM 50%, bandwidth 75% (device unsaturated).
    node.set_sim_load(&device, &[(lpid, 0.5, 0.75), (bpid, 0.0, 0.0)]);
    node.wait_telemetry_samples(6, Duration::from_secs(15));
    // The attack: the liar keeps its bandwidth at its baseline and starves its own
    // kernels; the bystander does modest work inside its share.
    node.set_sim_load(&device, &[(lpid, 0.05, 0.75), (bpid, 0.05, 0.21)]);
    node.wait_telemetry_samples(2, Duration::from_secs(15));
    // What was measured in the attack (before any stop).
    let t = node.client().telemetry().unwrap();
    let use_of =
        |id: &str| t.containers.iter().find(|c| c.container_id == id).map(|c| (c.sm, c.mem));
    let (liar_use, by_use) = (use_of("liar"), use_of("bystander"));
    node.wait_telemetry_samples(u64::from(CONFIRM) * 3, Duration::from_secs(15));
    if daemon_threads(&node, &device, &btenant) != cap_before {
        // Throttled: give the policy's stop (4 samples, 1 s grace) its time, to show it.
        wait_for(
            || node.fx.status("bystander").as_deref() != Some("running"),
            Duration::from_secs(6),
        );
    }
    let cap_after = daemon_threads(&node, &device, &btenant);
    let marks = std::fs::read_to_string(node.state.join("interference.json")).unwrap_or_default();
    let state = node.fx.status("bystander");
    for id in ["liar", "bystander"] {
        node.fx.delete_container(id, true);
    }
    assert!(
        cap_after == cap_before
            && state.as_deref() == Some("running")
            && !marks.contains("anti_affine\":[["),
        "a victim that got all of its baseline bandwidth (75%) and starved its own kernels \
         got a co-tenant inside its mps=25 share named: use (SM, bandwidth) liar {liar_use:?}, \
         bystander {by_use:?}; the bystander's MPS cap {cap_before} -> {cap_after}; its \
         container now {state:?}; marks: {marks}"
    );
}

/// Class: an aggressor split across several small containers (one tenant) evades the
/// detector: each is judged alone against `MATERIAL` (20%), never the tenant's sum.
///
/// The victim learns SM 50% / bandwidth 50% alone; then five containers of one other
/// tenant take 18% of the bandwidth each (90% together), the victim's bandwidth falls to
/// 8% and its SM use to 10% (measured, not reported). Nothing is raised.
#[test]
fn an_aggressor_split_across_small_containers_is_still_named() {
    let files = short_tempdir();
    std::fs::create_dir_all(&files).unwrap();
    let node = start_interference_node(&files, 1, CONFIRM, INTERVAL_MS, serde_json::json!({}));
    let mut daemons = KillOnDrop(Vec::new());
    let (vpid, device, _) = run_share(&node, &mut daemons, "victim", "team-dev", 40, true);
    let mut split = Vec::new();
    let mut tenant = String::new();
    for i in 0..5 {
        let id = format!("split-{i}");
        let (pid, dev, t) = run_share(&node, &mut daemons, &id, "team-research", 10, false);
        assert_eq!(dev, device, "one GPU");
        split.push((id, pid));
        tenant = t;
    }
    let cap_before = daemon_threads(&node, &device, &tenant);
    let idle: Vec<(i32, f64, f64)> = split.iter().map(|(_, p)| (*p, 0.0, 0.0)).collect();
    let mut load = vec![(vpid, 0.5, 0.5)];
    load.extend(idle);
    node.set_sim_load(&device, &load);
    node.wait_telemetry_samples(6, Duration::from_secs(15));
    let mut load = vec![(vpid, 0.1, 0.08)];
    load.extend(split.iter().map(|(_, p)| (*p, 0.1, 0.18)));
    node.set_sim_load(&device, &load);
    node.wait_telemetry_samples(u64::from(CONFIRM) * 4, Duration::from_secs(15));
    let t = node.client().telemetry().unwrap();
    let dev = t.devices.iter().find(|d| d.uuid == device).map(|d| (d.sm_active, d.dram_active));
    let events = interference_events(&node);
    let cap_after = daemon_threads(&node, &device, &tenant);
    let marks = std::fs::read_to_string(node.state.join("interference.json")).unwrap_or_default();
    for id in split.iter().map(|(i, _)| i.as_str()).chain(["victim"]) {
        node.fx.delete_container(id, true);
    }
    assert!(
        events.iter().any(|e| e.contains("split-"))
            || cap_after != cap_before
            || marks.contains(&tenant),
        "five containers of one tenant at 18% bandwidth each (device (SM, bandwidth) {dev:?}) \
         starved a latency victim from 50% to 8% bandwidth, 50% to 10% SM, and nothing was \
         raised: their MPS cap {cap_before} -> {cap_after}; marks {marks:?}; events {events:#?}"
    );
}

/// The `/proc/self/mountinfo` lines that mention `dir`.
fn mounts_under(dir: &Path) -> Vec<String> {
    let d = dir.display().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .filter(|l| l.contains(&d))
        .map(str::to_string)
        .collect()
}

/// Held: the report tmpfs from inside and at the end. Inside: 1 MiB written stops at one
/// page (ENOSPC); the file cannot be removed, renamed, replaced by a link, or mounted over
/// (no CAP_SYS_ADMIN); the report still reaches tesserad. At the end: after `delete`, and
/// after tesserad was killed with -9 and the container deleted while it was down, nothing
/// of the reports is mounted on the host once tesserad is back.
#[test]
fn the_report_tmpfs_holds_and_leaves_nothing_mounted() {
    let files = short_tempdir();
    std::fs::create_dir_all(&files).unwrap();
    let mut node = start_interference_node(&files, 1, CONFIRM, INTERVAL_MS, serde_json::json!({}));
    let mut daemons = KillOnDrop(Vec::new());
    run_share(&node, &mut daemons, "rep", "team-dev", 20, true);
    // The second, for the crash below (started now: a deleted share's device is scrubbed).
    run_share(&node, &mut daemons, "rep2", "team-dev", 20, true);
    let sh = |script: &str| {
        let out = node.fx.exec("rep", &["sh", "-c", script]);
        (out.status.success(), format!("{}{}", out.stdout_str(), out.stderr_str()))
    };
    let (_, dd) = sh("dd if=/dev/zero of=\"$TESSERA_LATENCY_FILE\" bs=4096 count=256 2>&1");
    let host = node.state.join("reports").join("rep");
    let size = std::fs::metadata(&host).map(|m| m.len()).unwrap_or(u64::MAX);
    assert!(size <= 4096 && dd.contains("No space left"), "size {size}; dd: {dd}");
    let mut got_through = Vec::new();
    for (what, script) in [
        ("rm", "rm -f \"$TESSERA_LATENCY_FILE\""),
        ("mv", "mv \"$TESSERA_LATENCY_FILE\" \"$TESSERA_LATENCY_FILE.x\""),
        ("ln", "ln -sf /etc/passwd \"$TESSERA_LATENCY_FILE\""),
        ("second file", "touch \"$(dirname \"$TESSERA_LATENCY_FILE\")/second\" && ls -la \"$(dirname \"$TESSERA_LATENCY_FILE\")\""),
        ("mount over", "mount -t tmpfs none \"$(dirname \"$TESSERA_LATENCY_FILE\")\""),
    ] {
        let (ok, said) = sh(script);
        let (still, _) = sh("test -f \"$TESSERA_LATENCY_FILE\" && ! test -L \"$TESSERA_LATENCY_FILE\"");
        if what == "second file" {
            // A second file beside it lands in the image's own /run (its rootfs), not the
            // tmpfs: fine; what matters is the report file stays.
            if !still {
                got_through.push(format!("{what}: the report file went: {said}"));
            }
            continue;
        }
        if ok || !still {
            got_through.push(format!("{what}: exit ok {ok}, file still there {still}: {said}"));
        }
    }
    sh("echo 7 > \"$TESSERA_LATENCY_FILE\"");
    assert_eq!(std::fs::read_to_string(&host).unwrap().trim(), "7", "the report reaches tesserad");
    assert!(got_through.is_empty(), "{got_through:#?}");

    let reports = node.state.join("reports");
    let of = |id: &str| mounts_under(&reports.join(format!("{id} ")));
    assert!(!of("rep").is_empty() && !of("rep2").is_empty(), "{:#?}", mounts_under(&reports));
    // A latency container whose runc create fails after tesserad made its report (a bind
    // of a missing source): its grant and report go with it.
    let mut b = node.bundle("failing", "team-dev", Some("mps=20"), &["sleep", "300"]);
    b.annotation("tessera.io/class", "latency")
        .mutate(|v| {
            v["mounts"].as_array_mut().unwrap().push(serde_json::json!({
                "destination": "/mnt/x", "type": "bind",
                "source": "/nonexistent-atk4-source", "options": ["bind"]}))
        })
        .write();
    let out = node.fx.create_container(&b, "failing");
    let _ = node.fx.delete_container("failing", true);
    assert!(
        !out.status.success()
            && wait_for(|| of("failing").is_empty(), Duration::from_secs(10))
            && node.client().allocation("failing").is_err(),
        "a failed create (exit ok {}) left grant {:?}, mounts {:#?}",
        out.status.success(),
        node.client().allocation("failing").ok().map(|a| a.container_id),
        of("failing")
    );
    node.fx.delete_container("rep", true).assert_success("delete");
    assert!(
        wait_for(|| of("rep").is_empty(), Duration::from_secs(10)),
        "after delete: {:#?}",
        of("rep")
    );
    assert!(!of("rep2").is_empty(), "the other report stays mounted");

    // tesserad killed while a latency container runs; the container deleted while it is
    // down; tesserad back.
    node.daemon.kill9();
    let _ = node.fx.delete_container("rep2", true);
    node.restart();
    let gone = wait_for(
        || mounts_under(&reports).is_empty() && node.client().allocation("rep2").is_err(),
        Duration::from_secs(20),
    );
    assert!(
        gone,
        "after kill -9, delete while down and restart: grant {:?}, mounts {:#?}",
        node.client().allocation("rep2").ok().map(|a| a.container_id),
        mounts_under(&reports)
    );
}

/// A node with two NVLink pairs (GPUs 0-1: CPU 0, NUMA 0; GPUs 2-3: the highest CPU, NUMA
/// 1), `topology.pin_cpus` and `isolate_nvlink_domains` on; returns the highest CPU.
fn start_topology_node(files: &Path) -> (Node, u32) {
    let online = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap();
    let last: u32 = online.trim().rsplit(['-', ',']).next().unwrap().parse().unwrap();
    let node_file = files.join("topo-node.json");
    std::fs::write(
        &node_file,
        format!(
            r#"{{"node": "sim-atk4-topo", "gpus": [
            {{"model": "H100-80GB", "nvlink": [1], "numa_node": 0, "cpus": "0"}},
            {{"model": "H100-80GB", "nvlink": [0], "numa_node": 0, "cpus": "0"}},
            {{"model": "H100-80GB", "nvlink": [3], "numa_node": 1, "cpus": "{last}"}},
            {{"model": "H100-80GB", "nvlink": [2], "numa_node": 1, "cpus": "{last}"}}]}}"#
        ),
    )
    .unwrap();
    let policy = files.join("policy.json");
    write_interference_policy(
        &policy,
        CONFIRM,
        serde_json::json!({}),
        serde_json::json!({"topology": {"pin_cpus": true, "isolate_nvlink_domains": true}}),
    );
    let node = Node::start_with(NodeOptions { policy, node_file, ..Default::default() });
    node.fx.cleanup().track_dir(files);
    (node, last)
}

fn cpus_allowed(node: &Node, id: &str) -> String {
    let out = node.fx.exec(id, &["cat", "/proc/self/status"]);
    out.assert_success("exec");
    out.stdout_str()
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:").map(|v| v.trim().to_string()))
        .unwrap()
}

/// Class: the CPU set that follows the GPUs, at create (spec.rs `pin_cpuset`).
///
/// A config whose own `linux.resources.cpu.cpus` shares nothing with the GPUs' CPUs is
/// kept unchanged ("a pin never leaves a container without a CPU"): a tenant given GPU 0
/// (local CPU 0) that asks for the CPU local to *another* tenant's GPUs 2-3 runs there,
/// pinned wholly off its GPUs; the update check then keeps that set as what it "had".
#[test]
fn a_config_cannot_step_off_its_gpus_cpus_by_asking_for_others_at_create() {
    let files = short_tempdir();
    std::fs::create_dir_all(&files).unwrap();
    let (node, last) = start_topology_node(&files);
    if last == 0 {
        eprintln!("one CPU online: nothing to show here");
        return;
    }
    let mut b = node.bundle("off", "team-untrusted", Some("gpu=1"), &["sleep", "300"]);
    b.mutate(|v| v["linux"]["resources"]["cpu"] = serde_json::json!({"cpus": last.to_string()}))
        .write();
    let out = node.fx.create_container(&b, "off");
    let got = if out.status.success() {
        node.fx.start_container("off").assert_success("start");
        let gpu = node.client().allocation("off").unwrap().devices[0].gpu_index;
        let c = cpus_allowed(&node, "off");
        node.fx.delete_container("off", true);
        Some((gpu, c))
    } else {
        None
    };
    assert!(
        got.as_ref().is_none_or(|(_, c)| c == "0"),
        "a GPU container whose config asked for CPU {last} (local to GPUs 2-3) runs on it: \
         (its GPU index, Cpus_allowed_list) {got:?}; its GPU's CPU is 0"
    );
}

/// Held (and legit updates pass): `runc update` spellings against a grant pinned to CPU 0
/// and memory node 0. Every spelling that would widen the set is refused and leaves
/// `Cpus_allowed_list` at 0; every narrowing or no-op spelling passes.
#[test]
fn cpuset_update_spellings_narrow_never_widen() {
    let files = short_tempdir();
    std::fs::create_dir_all(&files).unwrap();
    let (node, last) = start_topology_node(&files);
    if last == 0 {
        eprintln!("one CPU online: nothing to show here");
        return;
    }
    let mut b = node.bundle("cpus", "team-untrusted", Some("gpu=1"), &["sleep", "300"]);
    b.mutate(|v| v["linux"]["resources"]["cpu"] = serde_json::json!({"cpus": format!("0-{last}")}))
        .write();
    node.fx.run_detached(&b, "cpus");
    assert_eq!(cpus_allowed(&node, "cpus"), "0", "create meets the config with the GPU's CPU");
    let huge = {
        let mut v = vec!["0"; 5000];
        v.push("1");
        v.join(",")
    };
    let json = |i: usize, v: serde_json::Value| {
        let p = files.join(format!("r{i}.json"));
        std::fs::write(&p, v.to_string()).unwrap();
        p.display().to_string()
    };
    let l = last.to_string();
    let wide = format!("0-{last}");
    let widen: Vec<Vec<String>> = vec![
        vec!["--cpuset-cpus".into(), wide.clone()],
        vec!["--cpuset-cpus".into(), l.clone()],
        vec!["--cpuset-cpus".into(), format!("0,{last}")],
        vec!["--cpuset-cpus".into(), format!(" 0-{last}")],
        vec!["--cpuset-cpus".into(), format!("0-{last}\n")],
        vec!["--cpuset-cpus".into(), format!("{last}-{last}")],
        vec!["--cpuset-cpus".into(), "0-N".into()],
        vec!["--cpuset-cpus".into(), format!("0-{last}:1/1")],
        vec!["--cpuset-cpus".into(), "0x3".into()],
        vec!["--cpuset-cpus".into(), huge.replace(",1", &format!(",{last}"))],
        vec!["--cpuset-cpus".into(), "0".into(), "--cpuset-cpus".into(), wide.clone()],
        vec![format!("-cpuset-cpus={wide}")],
        vec!["--cpuset-cpus=0".into(), format!("--cpuset-cpus={wide}")],
        vec!["-r".into(), json(0, serde_json::json!({"cpu": {"cpus": wide, "mems": "0"}}))],
        vec!["-r".into(), json(1, serde_json::json!({"cpu": {"Cpus": wide}}))],
        vec!["-r".into(), json(2, serde_json::json!({"CPU": {"cpus": wide}}))],
        vec![
            "--cpuset-cpus".into(),
            "0".into(),
            "-r".into(),
            json(3, serde_json::json!({"cpu": {"cpus": wide}})),
        ],
    ];
    let narrow: Vec<Vec<String>> = vec![
        vec!["--cpuset-cpus".into(), "0".into()],
        vec!["--cpuset-cpus".into(), "0-0".into()],
        vec!["--cpuset-cpus".into(), "0,0".into()],
        vec!["--cpuset-cpus".into(), " 0".into()],
        vec!["--cpuset-cpus".into(), "00".into()],
        vec!["--cpuset-cpus".into(), wide.clone(), "--cpuset-cpus".into(), "0".into()],
        vec!["--cpuset-mems".into(), "0".into()],
        vec!["--cpuset-cpus=0".into(), "--cpuset-mems=0".into()],
        vec!["-r".into(), json(4, serde_json::json!({"cpu": {"cpus": "0", "mems": "0"}}))],
        vec!["--cpuset-cpus".into(), "".into()],
        vec!["--memory".into(), "512m".into()],
    ];
    let mut bad = Vec::new();
    let run = |a: &[String]| {
        let mut args: Vec<&str> = vec!["update"];
        args.extend(a.iter().map(String::as_str));
        args.push("cpus");
        let up = node.fx.runc(&args, &[]);
        (up.status.success(), up.stderr_str().chars().take(300).collect::<String>())
    };
    for a in &widen {
        let (ok, said) = run(a);
        let now = cpus_allowed(&node, "cpus");
        let shown: String = format!("{a:?}").chars().take(90).collect();
        eprintln!("widen {shown}: exit ok {ok}, CPUs {now}; {}", said.trim());
        if now != "0" {
            bad.push(format!("widened by {shown} (exit ok {ok}): CPUs {now}; {said}"));
            node.fx.runc(&["update", "--cpuset-cpus", "0", "cpus"], &[]);
        }
    }
    for a in &narrow {
        let (ok, said) = run(a);
        let now = cpus_allowed(&node, "cpus");
        eprintln!("narrow {a:.70?}: exit ok {ok}, CPUs {now}");
        if !ok || now != "0" {
            bad.push(format!("legit {a:?} refused or moved the set (ok {ok}, CPUs {now}): {said}"));
        }
    }
    node.fx.delete_container("cpus", true);
    assert!(bad.is_empty(), "{bad:#?}");
}

/// Held: a container (GPU or not) cannot put itself below a running GPU grant's cgroup by
/// spelling the path differently from how tesserad recorded it (`//`, `/./`, `x/..`, a
/// trailing `/`): its processes would count as the grant's in telemetry and metering (and
/// keep its device rules). Each create is refused naming `linux.cgroupsPath`, and nothing
/// is left below the grant's cgroup.
#[test]
fn a_cgroup_path_spelled_otherwise_cannot_nest_below_a_grant() {
    let node = Node::start();
    let b = node.bundle("g", "team-untrusted", Some("gpu=1"), &["sleep", "300"]);
    node.fx.run_detached(&b, "g");
    let grant = b.cgroups_path();
    let parent = node.fx.cgroup_parent();
    let mut got_through = Vec::new();
    for (i, path) in [
        format!("{parent}//g/sub"),
        format!("{parent}/g/./sub/"),
        format!("{parent}/x/../g/sub"),
        format!("{parent}/g/sub/"),
        format!("{parent}/g/"),
    ]
    .into_iter()
    .enumerate()
    {
        let id = format!("n{i}");
        let mut b = node.bundle(&id, "team-dev", None, &["sleep", "300"]);
        b.set_cgroups_path(&path).write();
        node.fx.cleanup().track_cgroup(&format!("{grant}/sub"));
        let out = node.fx.create_container(&b, &id);
        let said = out.stderr_str();
        if out.status.success() || !said.contains("linux.cgroupsPath") {
            got_through.push(format!(
                "{path}: exit ok {}, pid {:?}: {}",
                out.status.success(),
                node.fx.container_pid(&id),
                said.trim()
            ));
        }
        if out.status.success() {
            node.fx.delete_container(&id, true);
        }
    }
    node.fx.delete_container("g", true);
    assert!(got_through.is_empty(), "{got_through:#?}");
}
