//! Red-team round 3, on what issues 26 (telemetry, the interference controller, XID
//! quarantine, topology) and 29 (`docker --gpus device=` pins, the whole-GPU count file,
//! runc-log-format errors) added. Run the way `tests/interference.rs`,
//! `tests/device_plugin.rs` and `tests/attack_23.rs` run: tesserad on a simulated node,
//! tessera-runtime and tessera-hook as built, real runc and the kernel; the simulator's
//! load files stand in for what NVML measures (what each process demands of the GPU).
//!
//! The attacker is a tenant on the same node. It controls its own containers' config
//! (annotations, `tessera.io/class`, the Docker `--gpus` hook entry and
//! `NVIDIA_VISIBLE_DEVICES`), what its processes do on the GPU (its own demand, measured),
//! its own latency report file, and which processes it starts (`runc exec`).
//!
//! A test that fails here is an attack that got through on the code it ran against (the
//! assertion message carries the evidence); each would pass once its class is closed. The
//! passing tests record defences that held.

// Integration-test crates: clippy counts helper functions as non-test code, so
// `allow-unwrap-in-tests` (clippy.toml) does not reach them; a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::Duration;

use tessera_harness::node::*;
use tessera_harness::*;

/// Telemetry interval (ms) and the detector's confirm/clear samples of these tests.
const INTERVAL_MS: u64 = 200;
const CONFIRM: u32 = 2;

/// Every `interference` event's `<container> <detail>`.
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

/// A share's MPS default active thread percentage, from the control test double's state.
fn daemon_threads(node: &Node, device: &str, tenant: &str) -> f64 {
    let dirs = mpsd::layout::ShareDirs::new(&node.state, None, device, tenant).unwrap();
    mps_double::FakeState::read(&dirs.pipe).unwrap().default_active_thread_percentage
}

/// Class: victim framing through the interference controller (issue 26, step 2-3).
///
/// A tenant declares itself `latency`, runs alone unsaturated (its baseline, and a
/// reported latency of 1 ms), then saturates the device's memory bandwidth *itself* while
/// reporting 500 ms. A co-tenant of another team sits beside it on the same MPS GPU using
/// 2% of the SMs and 2% of the bandwidth. The detector names as aggressor "the active
/// co-tenant using most of the saturated resource" — of the co-tenants only, however little
/// that is — so the bystander is named, its MPS cap halved and the two tenants marked
/// anti-affine, although the liar uses 95% of the bandwidth and the bystander 2%.
/// SECURITY.md section 7 says a report "cannot by itself get a co-tenant throttled"; it
/// cannot, but saturating the device is also the attacker's to do.
#[test]
fn a_latency_tenant_that_saturates_the_gpu_itself_cannot_frame_a_quiet_co_tenant() {
    framing(true);
}

/// The same without any report: the liar's SM use falls from its baseline 50% to 10%
/// (its own doing: it launches smaller kernels) while it saturates the bandwidth itself;
/// the share read from SM use is below `min_share` and the bystander is named.
#[test]
fn a_tenant_that_starves_its_own_kernels_cannot_frame_a_quiet_co_tenant() {
    framing(false);
}

/// The framing attack; `report`: through latency reports (SM use held), else through the
/// liar's own SM use.
fn framing(report: bool) {
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

    // The bystander (another team's batch work), nearly idle.
    let b = node.bundle("bystander", "team-research", Some("mps=25"), &["sleep", "300"]);
    node.fx.run_detached(&b, "bystander");
    daemons.0.extend(node.client().status().unwrap().mps_shares.iter().filter_map(|s| s.pid));
    let by = node.client().allocation("bystander").unwrap();
    let device = by.share.as_ref().unwrap().device.clone();
    // The liar, latency-sensitive by its own word, on the same GPU.
    let mut b = node.bundle("liar", "team-dev", Some("mps=50"), &["sleep", "300"]);
    b.annotation("tessera.io/class", "latency").write();
    node.fx.run_detached(&b, "liar");
    daemons.0.extend(node.client().status().unwrap().mps_shares.iter().filter_map(|s| s.pid));
    let liar = node.client().allocation("liar").unwrap();
    assert_eq!(liar.share.as_ref().unwrap().device, device, "MPS packs them on one GPU");
    let (lpid, bpid) = (liar.pid.unwrap(), by.pid.unwrap());
    let cap_before = daemon_threads(&node, &device, &by.tenant);

    // Baseline: the liar alone in effect (the bystander idle), nothing saturated, 1 ms.
    node.set_sim_load(&device, &[(lpid, 0.5, 0.5), (bpid, 0.0, 0.0)]);
    if report {
        node.fx
            .exec("liar", &["sh", "-c", "echo 1 > \"$TESSERA_LATENCY_FILE\""])
            .assert_success("report 1 ms");
    }
    node.wait_telemetry_samples(4, Duration::from_secs(15));

    // The attack: the liar saturates the bandwidth itself and reports 500 ms; the
    // bystander wakes up a little (2% SM, 2% bandwidth).
    if report {
        node.set_sim_load(&device, &[(lpid, 0.5, 0.95), (bpid, 0.02, 0.02)]);
        node.fx
            .exec("liar", &["sh", "-c", "echo 500 > \"$TESSERA_LATENCY_FILE\""])
            .assert_success("report 500 ms");
    } else {
        node.set_sim_load(&device, &[(lpid, 0.1, 0.95), (bpid, 0.02, 0.02)]);
    }
    node.wait_telemetry_samples(u64::from(CONFIRM) * 4, Duration::from_secs(15));

    let t = node.client().telemetry().unwrap();
    let use_of = |id: &str| {
        t.containers.iter().find(|c| c.container_id == id).map(|c| (c.sm, c.mem)).unwrap()
    };
    let framed: Vec<String> = interference_events(&node)
        .into_iter()
        .filter(|e| e.contains("degraded by bystander") || e.starts_with("bystander step"))
        .collect();
    if !framed.is_empty() {
        // Framed: give the policy's stop (4 samples on, 1 s grace) its time, to show it.
        let stopped = || node.fx.status("bystander").as_deref() != Some("running");
        wait_for(stopped, Duration::from_secs(5));
    }
    let framed: Vec<String> = interference_events(&node)
        .into_iter()
        .filter(|e| e.contains("degraded by bystander") || e.starts_with("bystander step"))
        .collect();
    let marks = std::fs::read_to_string(node.state.join("interference.json")).unwrap_or_default();
    let cap_after = daemon_threads(&node, &device, &by.tenant);
    let state = node.fx.status("bystander");
    assert!(
        framed.is_empty()
            && cap_after == cap_before
            && !marks.contains("acme/dev")
            && state.as_deref() == Some("running"),
        "a tenant that saturated the GPU itself framed a co-tenant using 2% of it: \
         use (SM, bandwidth) liar {:?}, bystander {:?}; the bystander's MPS cap {cap_before} -> \
         {cap_after}; its container now {state:?} (the policy stops an aggressor after 4 \
         samples); events naming it: {framed:#?}; marks: {marks}",
        use_of("liar"),
        use_of("bystander"),
    );
}

/// Class: GPU use that is nobody's (issue 26, telemetry per container; metering shares the
/// mapping).
///
/// Processes are mapped to containers through each container's *process tree* (its init
/// and descendants, by parent pid). A process started with `runc exec` is not a descendant
/// of the container's init (its parent is the `runc exec` process on the host; detached,
/// it is re-parented to the host's reaper), so its GPU use is attributed to no container:
/// the telemetry shows the container idle, the interference detector sees no active
/// co-tenant (an aggressor hides from the controller), and per-process metering bills
/// nothing for it. The same container's cgroup holds the process all along.
#[test]
fn gpu_use_of_a_process_started_with_exec_is_attributed_to_its_container() {
    let files = short_tempdir();
    std::fs::create_dir_all(&files).unwrap();
    let node = start_interference_node(&files, 1, CONFIRM, INTERVAL_MS, serde_json::json!({}));
    let mut daemons = KillOnDrop(Vec::new());
    let b = node.bundle("hider", "team-research", Some("mps=50"), &["sleep", "300"]);
    node.fx.run_detached(&b, "hider");
    daemons.0.extend(node.client().status().unwrap().mps_shares.iter().filter_map(|s| s.pid));
    let a = node.client().allocation("hider").unwrap();
    let device = a.share.as_ref().unwrap().device.clone();
    let pid_file = files.join("exec.pid");
    let pf = pid_file.display().to_string();
    node.fx
        .runc(&["exec", "-d", "--pid-file", &pf, "hider", "sleep", "300"], &[])
        .assert_success("runc exec -d");
    let worker: i32 = std::fs::read_to_string(&pid_file).unwrap().trim().parse().unwrap();
    node.fx.cleanup().track_pid(worker as u32);
    let cgroup_of = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
            .unwrap()
            .lines()
            .find(|l| l.contains(":memory:") || l.starts_with("0::"))
            .unwrap()
            .to_string()
    };
    assert_eq!(cgroup_of(worker), cgroup_of(a.pid.unwrap()), "the worker is in the grant's cgroup");

    // The worker does all the GPU work; the init sleeps.
    node.set_sim_load(&device, &[(a.pid.unwrap(), 0.0, 0.0), (worker, 0.5, 0.5)]);
    node.wait_telemetry_samples(3, Duration::from_secs(15));
    let t = node.client().telemetry().unwrap();
    let dev = t.devices.iter().find(|d| d.uuid == device).unwrap();
    let c = t.containers.iter().find(|c| c.container_id == "hider").unwrap();
    assert!(
        c.sm.unwrap_or(0.0) >= 0.45,
        "GPU work of an exec'd process in the container's own cgroup is nobody's: the device \
         is {:?} SM active, the container is measured at SM {:?} (its worker, pid {worker}, \
         is not a descendant of its init {})",
        dev.sm_active,
        c.sm,
        a.pid.unwrap()
    );
}

/// Class: the latency report file is a writable window onto tesserad's state filesystem.
///
/// A latency container gets `<state>/reports/<id>` bind-mounted read-write. tesserad reads
/// 64 bytes of it, but nothing bounds what the container writes: the bytes land on the
/// filesystem that holds `state.db` and `ledger.db`, outside the container's rootfs (and so
/// outside any engine's or kubelet's accounting of the container's writable layer). Here
/// 16 MiB; a hostile tenant writes until the disk is full and the node's books stop.
#[test]
fn a_latency_report_file_cannot_grow_tesserads_state_filesystem() {
    let files = short_tempdir();
    std::fs::create_dir_all(&files).unwrap();
    let node = start_interference_node(&files, 1, CONFIRM, INTERVAL_MS, serde_json::json!({}));
    let _daemons = KillOnDrop(Vec::new());
    let mut b = node.bundle("filler", "team-dev", Some("mps=50"), &["sleep", "300"]);
    b.annotation("tessera.io/class", "latency").write();
    node.fx.run_detached(&b, "filler");
    let _daemons = KillOnDrop(
        node.client().status().unwrap().mps_shares.iter().filter_map(|s| s.pid).collect(),
    );
    let out = node.fx.exec(
        "filler",
        &[
            "sh",
            "-c",
            "dd if=/dev/zero of=\"$TESSERA_LATENCY_FILE\" bs=1048576 count=16 2>&1; true",
        ],
    );
    out.assert_success("exec dd");
    let host = node.state.join("reports").join("filler");
    let size = std::fs::metadata(&host).map(|m| m.len()).unwrap_or(0);
    let fs_of = |p: &Path| {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(p).unwrap().dev()
    };
    assert!(
        size <= 4096,
        "a container wrote {size} bytes into {} (on the device of tesserad's state dir: {}); dd said: {}",
        host.display(),
        fs_of(&host) == fs_of(&node.state),
        out.stdout_str().trim()
    );
}

/// A node with two NVLink pairs (GPUs 0-1 and 2-3), `topology.isolate_nvlink_domains` and
/// `pin_cpus` on; `last` is the host's highest online CPU (GPUs 2-3's local CPUs; 0-1 have
/// CPU 0).
fn start_topology_node(files: &Path) -> (Node, u32) {
    let online = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap();
    let last: u32 = online.trim().rsplit(['-', ',']).next().unwrap().parse().unwrap();
    let node_file = files.join("topo-node.json");
    std::fs::write(
        &node_file,
        format!(
            r#"{{"node": "sim-atk3-topo", "gpus": [
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

/// What `docker run --gpus '"device=…"'` writes into config.json: dockerd's NVIDIA prestart
/// hook and `NVIDIA_VISIBLE_DEVICES` (tessera-runtime reads them as a request and removes
/// the hook; the hook binary never runs).
fn docker_gpus(b: &mut Bundle, devices: &str) {
    b.hook("prestart", "/usr/bin/nvidia-container-runtime-hook", &["prestart"], &[])
        .env(&format!("NVIDIA_VISIBLE_DEVICES={devices}"))
        .write();
}

/// Class: a pin (`--gpus '"device=N"'`) decides past the policy's topology fence.
///
/// With `isolate_nvlink_domains`, a plain `gpu=1` of a second tenant is refused on GPU 1
/// while the first tenant holds GPU 0 of the same NVLink pair (tests/device_plugin.rs). The
/// same tenant asking for that GPU by index through dockerd's `--gpus device=1` is granted
/// it: the pinned path (`plan_assigned`) checks busy, lifecycle and MIG mode, but not
/// `fenced_for` (the NVLink fence and the interference controller's anti-affinity).
#[test]
fn a_pinned_gpu_is_kept_out_of_another_tenants_nvlink_domain() {
    let files = short_tempdir();
    std::fs::create_dir_all(&files).unwrap();
    let (node, _) = start_topology_node(&files);
    let gpus: Vec<String> =
        node.client().status().unwrap().gpus.into_iter().map(|g| g.uuid).collect();
    let b = node.bundle("holder", "team-untrusted", Some("gpu=1"), &["sleep", "300"]);
    node.fx.run_detached(&b, "holder");
    assert_eq!(node.client().allocation("holder").unwrap().devices[0].uuid, gpus[0]);

    // The control: a plain request of another tenant is fenced out of the pair.
    let b = node.bundle("plain", "team-dev", Some("gpu=1"), &["true"]);
    let _ = node.fx.run_container(&b, "plain");
    let plain = node.client().allocation("plain").ok().map(|a| a.devices[0].uuid.clone());
    assert_ne!(plain.as_deref(), Some(gpus[1].as_str()), "a plain gpu=1 never lands on GPU 1");

    // The attack: the same tenant pins GPU 1 (and, by uuid, the same GPU).
    for (id, pin) in [("pin-index", "1".to_string()), ("pin-uuid", gpus[1].clone())] {
        let mut b = node.bundle(id, "team-dev", None, &["sleep", "300"]);
        docker_gpus(&mut b, &pin);
        let out = node.fx.create_container(&b, id);
        let got = node.client().allocation(id).ok();
        if out.status.success() {
            node.fx.delete_container(id, true);
        }
        assert!(
            !out.status.success() && got.is_none(),
            "{id}: --gpus device={pin} put tenant team-dev on GPU 1, in the NVLink domain of \
             another tenant's GPU 0, past isolate_nvlink_domains: {:?}",
            got.map(|a| (a.tenant, a.devices.iter().map(|d| d.uuid.clone()).collect::<Vec<_>>()))
        );
    }
}

/// Class: the CPU set that follows the GPUs (`topology.pin_cpus`) is set at create only.
///
/// At create the config's own `linux.resources.cpu.cpus` is met with the GPUs' local CPUs
/// (held: the container gets its GPUs' CPU). An update through tessera-runtime —
/// `runc update --cpuset-cpus` / `--cpuset-mems` (and `docker update --cpuset-cpus`) — is
/// admitted for CPU quota and memory only, so the container moves onto every CPU of the
/// host, those local to another tenant's GPUs included (flag and `-r` JSON spellings).
#[test]
fn the_cpu_set_that_follows_the_gpus_cannot_be_widened_by_an_update() {
    let files = short_tempdir();
    std::fs::create_dir_all(&files).unwrap();
    let (node, last) = start_topology_node(&files);
    if last == 0 {
        eprintln!("one CPU online: no CPU set to widen; nothing to show here");
        return;
    }
    let mut b = node.bundle("cpus", "team-untrusted", Some("gpu=1"), &["sleep", "300"]);
    // The config asks for every CPU itself; create meets it with the GPU's.
    b.mutate(|v| v["linux"]["resources"]["cpu"] = serde_json::json!({"cpus": format!("0-{last}")}))
        .write();
    node.fx.run_detached(&b, "cpus");
    let allowed = || {
        let out = node.fx.exec("cpus", &["cat", "/proc/self/status"]);
        out.assert_success("exec");
        out.stdout_str()
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:").map(|v| v.trim().to_string()))
            .unwrap()
    };
    assert_eq!(allowed(), "0", "at create the CPU set follows the GPU (held)");
    let all = format!("0-{last}");
    let resources = files.join("resources.json");
    std::fs::write(&resources, serde_json::json!({"cpu": {"cpus": all}}).to_string()).unwrap();
    let r = resources.display().to_string();
    let mut widened = Vec::new();
    for args in [
        vec!["update", "--cpuset-cpus", all.as_str(), "cpus"],
        vec!["update", "-r", r.as_str(), "cpus"],
    ] {
        let up = node.fx.runc(&args, &[]);
        let now = allowed();
        if now != "0" {
            widened.push(format!("`{}` (exit {:?}): CPUs {now}", args.join(" "), up.status.code()));
            // Narrowed back for the next spelling (a narrowing is never refused).
            node.fx.runc(&["update", "--cpuset-cpus", "0", "cpus"], &[]).assert_success("narrow");
        }
    }
    assert!(
        widened.is_empty(),
        "updates widened the GPU container's CPU set from its GPUs' CPU 0: {widened:#?}"
    );
}

/// Held: pins that name the same GPU twice (by index, with a space, index and uuid), a GPU
/// another tenant holds, a uuid prefix, a GPU in MIG mode, a GPU quarantined by an XID, or
/// no GPU, are refused with the reason and leave no grant.
#[test]
fn hostile_pins_are_refused_and_leave_no_grant() {
    let node = Node::start();
    let status = node.client().status().unwrap();
    // By uuid: a lone `device=0` is the bytes dockerd writes for `--gpus 1` (INSTALL.md).
    let mig = status.gpus.iter().find(|g| g.mig_enabled).map(|g| g.uuid.clone());
    let b = node.bundle("held", "team-untrusted", Some("gpu=1"), &["sleep", "300"]);
    node.fx.run_detached(&b, "held");
    let held = node.client().allocation("held").unwrap().devices[0].uuid.clone();
    let held_index = status.gpus.iter().find(|g| g.uuid == held).unwrap().index;
    let whole: Vec<u32> =
        status.gpus.iter().filter(|g| !g.mig_enabled && g.uuid != held).map(|g| g.index).collect();
    let (x, y) = (whole[0], whole[1]);
    let mut cases = vec![
        ("p-dup", format!("{y},{y}"), "twice"),
        ("p-dup-ws", format!("{y}, {y}"), "twice"),
        ("p-held", format!("{held_index},{y}"), "another"),
        ("p-held-uuid", held.to_string(), "another"),
        ("p-none", "4095".to_string(), "no GPU"),
        ("p-prefix", held[..12].to_string(), "no GPU"),
        (
            "p-mixed-dup",
            format!("{x},{}", status.gpus.iter().find(|g| g.index == x).unwrap().uuid),
            "twice",
        ),
    ];
    if let Some(m) = mig {
        cases.push(("p-mig", m, "MIG"));
    }
    // A GPU quarantined by an uncontained XID (95), free and otherwise grantable.
    let z = status.gpus.iter().find(|g| !g.mig_enabled && g.index == whole[2]).unwrap();
    let dir = node.state.join("sim/xid");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("q.tmp"),
        serde_json::json!({"gpu_uuid": z.uuid, "xid": 95}).to_string(),
    )
    .unwrap();
    std::fs::rename(dir.join("q.tmp"), dir.join("q.json")).unwrap();
    let quarantined = || {
        node.client()
            .status()
            .unwrap()
            .gpus
            .iter()
            .any(|g| g.uuid == z.uuid && g.state == tessera_api::DeviceState::Quarantined)
    };
    assert!(wait_for(quarantined, Duration::from_secs(10)), "XID 95 quarantined GPU {}", z.index);
    cases.push(("p-quarantined", z.index.to_string(), "quarantined"));
    cases.push(("p-quarantined-uuid", format!("{y},{}", z.uuid), "quarantined"));
    let mut got_through = Vec::new();
    for (id, pin, why) in &cases {
        let mut b = node.bundle(id, "team-dev", None, &["sleep", "300"]);
        docker_gpus(&mut b, pin);
        let out = node.fx.create_container(&b, id);
        let said = out.stderr_str();
        if !said.contains(why) {
            got_through.push(format!("{id} ({pin}): refused without naming `{why}`: {said}"));
        }
        if out.status.success() || node.client().allocation(id).is_ok() {
            got_through.push(format!(
                "{id} ({pin}): {:?}",
                node.client().allocation(id).ok().map(|a| a.devices)
            ));
            node.fx.delete_container(id, true);
        }
    }
    assert!(got_through.is_empty(), "pins granted: {got_through:#?}");
}

/// Puts a hostile value into a bundle's config.
type Put = fn(&mut Bundle, &str);

/// Held: what a config author controls reaches runc's `--log` (where dockerd and containerd
/// read the error) as one well-formed line: a forged pin annotation carrying a newline, a
/// JSON object of its own and terminal escapes is one `error` entry, JSON or logrus text,
/// with no raw control character.
#[test]
fn tenant_values_reach_runcs_log_as_one_escaped_line() {
    let node = Node::start();
    let evil = "1\n{\"level\":\"info\",\"msg\":\"granted\"}\u{1b}[2J\u{7}\r";
    // Where a config author puts it: a forged pin annotation (refused by the wrapper), the
    // class annotation (refused by tesserad, its answer relayed), dockerd's
    // NVIDIA_VISIBLE_DEVICES (refused by the wrapper's parser).
    let sources: [(&str, Put); 3] = [
        ("pin", |b, v| {
            b.annotation("tessera.io/gpu", "gpu=1").annotation(tessera_api::PINNED_ANNOTATION, v);
        }),
        ("class", |b, v| {
            b.annotation("tessera.io/gpu", "gpu=1").annotation("tessera.io/class", v);
        }),
        ("nvd", |b, v| {
            b.hook("prestart", "/usr/bin/nvidia-container-runtime-hook", &["prestart"], &[])
                .env(&format!("NVIDIA_VISIBLE_DEVICES=GPU-{v}"));
        }),
    ];
    for (source, put) in sources {
        for format in ["json", "text"] {
            let id = format!("log-{source}-{format}");
            let log = node.fx.path(&format!("runc-{source}-{format}.log"));
            let mut b = node.bundle(&id, "team-dev", None, &["true"]);
            put(&mut b, evil);
            b.write();
            let dir = b.dir().display().to_string();
            let l = log.display().to_string();
            let out = node
                .fx
                .runc(&["--log", &l, "--log-format", format, "create", "--bundle", &dir, &id], &[]);
            out.assert_failure("a hostile value is refused");
            let text = std::fs::read_to_string(&log).unwrap();
            let lines: Vec<&str> = text.lines().collect();
            assert_eq!(lines.len(), 1, "{id}: one line: {text:?}");
            assert!(
                !text.trim_end_matches('\n').chars().any(|c| c.is_control()),
                "{id}: a control character in runc's log: {text:?}"
            );
            if format == "json" {
                let v: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
                assert_eq!(v["level"], "error", "{text}");
            } else {
                assert!(
                    lines[0].starts_with("time=") && lines[0].contains(" level=error msg=\""),
                    "{text}"
                );
            }
            assert!(
                !out.stderr_str().contains('\u{1b}'),
                "{id}: a raw escape on stderr: {:?}",
                out.stderr_str()
            );
            assert!(node.client().allocation(&id).is_err(), "{id}: no grant");
        }
    }
}

/// Held: the latency report's mount point is resolved by runc inside the rootfs. An image
/// whose `/run` is a link out of its rootfs (`/../../../../../../tmp/<name>`, absolute, and
/// a relative one) gets the report file inside its own rootfs (runc's secure join): its
/// report reaches tesserad's file, and nothing is made on the host at the link's target.
#[test]
fn a_link_in_the_image_cannot_move_the_latency_report_mount_onto_the_host() {
    let files = short_tempdir();
    std::fs::create_dir_all(&files).unwrap();
    let node = start_interference_node(&files, 2, CONFIRM, INTERVAL_MS, serde_json::json!({}));
    let mut daemons = KillOnDrop(Vec::new());
    let name = format!("atk3-escape-{}", unique_name());
    let host = std::path::PathBuf::from("/tmp").join(&name);
    node.fx.cleanup().track_dir(&host);
    for (id, target) in [
        ("link-abs", format!("/../../../../../../../../tmp/{name}")),
        ("link-rel", format!("../../../../../../../../tmp/{name}")),
    ] {
        let mut b = node.bundle(id, "team-dev", Some("mps=10"), &["sleep", "300"]);
        b.annotation("tessera.io/class", "latency").write();
        let run = b.rootfs().join("run");
        let _ = std::fs::remove_dir_all(&run);
        std::os::unix::fs::symlink(&target, &run).unwrap();
        let out = node.fx.create_container(&b, id);
        daemons.0.extend(node.client().status().unwrap().mps_shares.iter().filter_map(|s| s.pid));
        let made = host.exists();
        out.assert_success("create");
        node.fx.start_container(id).assert_success("start");
        node.fx
            .exec(id, &["sh", "-c", "echo 3 > \"$TESSERA_LATENCY_FILE\""])
            .assert_success("the workload reports");
        let got = std::fs::read_to_string(node.state.join("reports").join(id)).unwrap();
        node.fx.delete_container(id, true);
        assert_eq!(got.trim(), "3", "{id}: the report reached tesserad's own file");
        assert!(!made, "{id}: the report mount made {} on the host", host.display());
    }
}
