//! Issue 3 end to end: MIG instances cut live for a request, and declared layouts reached
//! without touching an instance in use — real runc containers, simulated H100.

// Integration-test crates: clippy counts their helper functions as non-test code, so
// `allow-unwrap-in-tests` (clippy.toml) does not reach them; a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use tessera_harness::node::*;
use tessera_harness::*;

/// GPU 0 in MIG mode with 3g.40gb@0 and 1g.10gb@6 (slots 4-5 and 7 free), GPU 1 whole.
fn node_file(fx_dir: &std::path::Path) -> PathBuf {
    let p = fx_dir.join("migtest-node.json");
    std::fs::write(
        &p,
        r#"{"node": "sim-migtest-0", "gpus": [
            {"model": "H100-80GB", "mig": [{"profile": "3g.40gb", "start": 0}, {"profile": "1g.10gb", "start": 6}]},
            {"model": "H100-80GB"}]}"#,
    )
    .expect("node file");
    p
}

/// The example policy, plus a pool declaring `layout` for this node when given.
fn policy_file(path: &std::path::Path, layout: Option<&str>) {
    let mut p: serde_json::Value =
        serde_json::from_slice(&std::fs::read(repo("examples/policy.json")).expect("policy"))
            .expect("json");
    if let Some(l) = layout {
        p["node_pools"]["migtest"] =
            serde_json::json!({"nodes": ["sim-migtest-*"], "mig_layouts": {"H100-80GB": l}});
    }
    std::fs::write(path, serde_json::to_vec_pretty(&p).expect("json")).expect("write policy");
}

fn scratch() -> PathBuf {
    let d = short_tempdir();
    std::fs::create_dir_all(&d).expect("scratch");
    d
}

/// (path, major, minor) of the NVIDIA device nodes a running container sees.
fn nvidia_nodes(fx: &Fixture, id: &str) -> BTreeSet<String> {
    let out = fx.exec(
        id,
        &[
            "sh",
            "-c",
            "for f in /dev/nvidia* /dev/nvidia-caps/*; do [ -c $f ] && stat -c '%n %t:%T' $f; done",
        ],
    );
    out.assert_success("list nodes");
    out.stdout_str().lines().map(str::to_string).collect()
}

#[test]
fn a_missing_profile_is_cut_live_and_neighbours_keep_their_devices() {
    let files = scratch();
    let policy = files.join("policy.json");
    policy_file(&policy, None);
    let node = Node::start_with(NodeOptions {
        policy,
        node_file: node_file(&files),
        ..Default::default()
    });
    node.fx.cleanup().track_dir(&files);
    let mut neighbours = Vec::new();
    for (id, req) in [("big", "mig=3g.40gb"), ("small", "mig=1g.10gb")] {
        let b = node.bundle(id, "team-dev", Some(req), &["sleep", "300"]);
        node.fx.run_detached(&b, id);
        neighbours.push((
            id,
            b.cgroups_path(),
            nvidia_nodes(&node.fx, id),
            devices_list(&b.cgroups_path()),
        ));
    }
    let before: BTreeSet<String> = node.client().status().expect("status").gpus[0]
        .instances
        .iter()
        .map(|i| i.uuid.clone())
        .collect();

    // No 2g.20gb exists; slots 4-5 are free: one is created there, live.
    let b = node.bundle("fresh", "team-dev", Some("mig=2g.20gb"), &["sleep", "300"]);
    node.fx.run_detached(&b, "fresh");
    let a = node.client().allocation("fresh").expect("grant");
    let d = &a.devices[0];
    assert!(!before.contains(d.uuid.as_str()), "a freshly created instance");
    assert_eq!(d.placement, Some((4, 2)), "the only legal 2g placement left");
    let caps =
        nvidia_nodes(&node.fx, "fresh").into_iter().filter(|l| l.contains("nvidia-cap")).count();
    assert_eq!(caps, 2, "the new instance's GI and CI caps");

    // The neighbours kept running with exactly the devices they had.
    for (id, cg, nodes, rules) in &neighbours {
        assert_eq!(node.fx.status(id).as_deref(), Some("running"), "{id}");
        assert_eq!(&nvidia_nodes(&node.fx, id), nodes, "{id}'s /dev changed");
        assert_eq!(&devices_list(cg), rules, "{id}'s device rules changed");
    }
    let status = node.cli(&["status"]).stdout_str();
    assert!(status.contains("2g.20gb*"), "{status}");
}

#[test]
fn plan_and_converge_never_touch_an_assigned_instance() {
    let files = scratch();
    let policy = files.join("policy.json");
    policy_file(&policy, None);
    let mut node = Node::start_with(NodeOptions {
        policy: policy.clone(),
        node_file: node_file(&files),
        ..Default::default()
    });
    node.fx.cleanup().track_dir(&files);
    let b = node.bundle("held", "team-dev", Some("mig=3g.40gb"), &["sleep", "300"]);
    node.fx.run_detached(&b, "held");
    let held = node.client().allocation("held").expect("grant").devices[0].uuid.clone();
    let held_nodes = nvidia_nodes(&node.fx, "held");
    let plan = node.cli(&["mig", "plan"]).stdout_str();
    assert!(plan.contains("dynamic"), "no declared layout yet: {plan}");

    // The pool now declares all-1g: tesserad (restarted on the new policy) converges on
    // its own, around the instance in use.
    node.daemon.terminate(Duration::from_secs(10));
    policy_file(&policy, Some("all-1g"));
    node.restart();
    let c = node.client();
    let converged_around = wait_for(
        || {
            c.status()
                .map(|s| s.gpus[0].instances.iter().filter(|i| i.profile == "1g.10gb").count() == 3)
                .unwrap_or(false)
        },
        Duration::from_secs(10),
    );
    let gpu0 = c.status().expect("status").gpus[0].instances.clone();
    // 1g starts are 0..=6: around the held 3g (slots 0-3) that is slots 4, 5 and 6.
    assert!(converged_around, "1g instances on slots 4-6: {gpu0:?}");
    assert!(
        gpu0.iter().any(|i| i.uuid == held && i.profile == "3g.40gb"),
        "the assigned 3g was touched: {gpu0:?}"
    );
    let plan = node.cli(&["mig", "plan"]).stdout_str();
    assert!(
        plan.contains(held.as_str()) || plan.to_lowercase().contains("in use"),
        "plan reports what it can't change: {plan}"
    );
    assert_eq!(node.fx.status("held").as_deref(), Some("running"));
    assert_eq!(nvidia_nodes(&node.fx, "held"), held_nodes);

    // Once the container is gone, the rest converges.
    node.fx.delete_container("held", true).assert_success("delete");
    let done = wait_for(
        || {
            c.status()
                .map(|s| {
                    s.gpus[0].instances.iter().all(|i| i.profile == "1g.10gb")
                        && s.gpus[0].instances.len() == 7
                })
                .unwrap_or(false)
        },
        Duration::from_secs(10),
    );
    assert!(done, "all-1g not reached: {:?}", c.status().map(|s| s.gpus[0].instances.clone()));
    let out = node.cli(&["mig", "plan", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out.stdout_str()).expect("json");
    assert_eq!(v["plan"]["create"].as_array().map(Vec::len), Some(0), "{v}");
    assert_eq!(v["plan"]["destroy"].as_array().map(Vec::len), Some(0), "{v}");
}

#[test]
fn sim_replays_the_trace_with_every_placement() {
    let trace = repo("data/alibaba-gpu-v2023/openb_pod_list_default.csv");
    if !trace.exists() {
        panic!("the trace is expected beside the checkout at {}", trace.display());
    }
    // `tessera sim` runs the lab's binary beside it (crates/lab, not a root-package bin).
    fresh_bin("tessera-sim");
    let out = run_cmd(
        std::process::Command::new(tessera_cli())
            .args(["sim", "--nodes", "2", "--gpu", "H100-80GB", "--json", "--trace"])
            .arg(&trace),
    );
    out.assert_success("tessera sim");
    let reports: Vec<serde_json::Value> = serde_json::from_str(&out.stdout_str()).expect("json");
    let admitted = |p: &str| {
        reports
            .iter()
            .find(|r| r["placement"] == p)
            .and_then(|r| r["admitted"].as_u64())
            .expect("admitted")
    };
    for r in &reports {
        for k in ["admitted", "rejected", "slice_seconds_allocated", "slice_seconds_capacity"] {
            assert!(r.get(k).is_some(), "{k} missing: {r}");
        }
    }
    assert!(
        admitted("best") > admitted("first-fit"),
        "best {} vs first-fit {}",
        admitted("best"),
        admitted("first-fit")
    );
    assert!(
        admitted("best") > admitted("static"),
        "best {} vs static {}",
        admitted("best"),
        admitted("static")
    );
}

#[test]
fn sim_without_the_lab_binary_beside_tessera_names_where_it_looked() {
    // A link to the CLI in a directory of its own (same file system: the target dir), so
    // no `tessera-sim` is beside it; `tessera sim` must say so, not run anything else.
    let dir = tempfile::tempdir_in(bin_dir()).expect("tempdir in the target dir");
    let cli = dir.path().join("tessera");
    // The file itself: TESSERA_BIN_DIR may hold a symbolic link to it (scripts/test.sh),
    // and a hard link to that would still run the CLI beside its tessera-sim.
    let real = std::fs::canonicalize(tessera_cli()).expect("the CLI's file");
    std::fs::hard_link(&real, &cli)
        .or_else(|_| std::fs::copy(&real, &cli).map(|_| ()))
        .expect("a link to the CLI");
    let out = run_cmd(std::process::Command::new(&cli).args(["sim", "--scenario", "drf"]));
    assert!(!out.status.success(), "tessera sim ran without tessera-sim: {}", out.stdout_str());
    let err = String::from_utf8_lossy(&out.stderr);
    let want = format!("{} not found", dir.path().join("tessera-sim").display());
    assert!(err.contains(&want), "stderr lacks `{want}`: {err}");
    assert!(err.contains("cargo install --path crates/lab"), "no install hint: {err}");
}
