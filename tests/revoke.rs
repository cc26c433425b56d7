//! Issue 17: `tessera policy revoke-check` end to end — tesserad on the simulated H100 node,
//! real runc containers through tessera-runtime, and a policy swapped under running grants.

// Integration-test crates: clippy counts their helper functions as non-test code, so
// `allow-unwrap-in-tests` (clippy.toml) does not reach them; a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::Duration;

use tessera_api::ErrorCode;
use tessera_harness::node::*;
use tessera_harness::*;

/// The example policy at `version`, edited, written to `path`.
fn write_policy(path: &Path, version: u64, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(repo("examples/policy.json")).unwrap()).unwrap();
    v["version"] = version.into();
    edit(&mut v);
    std::fs::write(path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
}

/// `tessera policy revoke-check ARGS.. --json`, parsed.
fn check_json(node: &Node, args: &[&str]) -> serde_json::Value {
    let mut all = vec!["policy", "revoke-check", "--json"];
    all.extend_from_slice(args);
    let out = node.cli(&all);
    out.assert_success("tessera policy revoke-check");
    serde_json::from_slice(&out.stdout).unwrap()
}

fn ids(v: &serde_json::Value, field: &str) -> Vec<String> {
    v[field]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["container_id"].as_str().unwrap().to_string())
        .collect()
}

/// A shell loop that says it is ready, then on SIGTERM runs `on_term`.
fn looping(on_term: &str) -> Vec<String> {
    let script = format!("trap '{on_term}' TERM; echo ready; while true; do sleep 0.1; done");
    vec!["sh".into(), "-c".into(), script]
}

#[test]
fn grants_the_new_policy_refuses_are_listed_then_stopped_gracefully_and_released_on_removal() {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.json");
    write_policy(&policy, 1, |_| {});
    let mut node =
        Node::start_with(NodeOptions { policy: policy.clone(), ..NodeOptions::default() });

    // Alice's team is trusted: whole GPUs. One container leaves at SIGTERM, one ignores it.
    // Bob's dev team keeps its whole GPU under both policies.
    let polite = looping("echo got-SIGTERM; exit 0");
    let stubborn = looping("echo ignoring-SIGTERM");
    let keep = looping("echo keep-got-SIGTERM; exit 0");
    for (id, ns, script) in [
        ("polite", "team-trusted", &polite),
        ("stubborn", "team-trusted", &stubborn),
        ("keep", "team-dev", &keep),
    ] {
        let argv: Vec<&str> = script.iter().map(String::as_str).collect();
        let b = node.bundle(id, ns, Some("gpu=1"), &argv);
        node.fx.run_detached(&b, id);
        assert!(
            wait_for(|| node.fx.container_output(id).0.contains("ready"), Duration::from_secs(10)),
            "{id} did not start: {:?}",
            node.fx.container_output(id)
        );
    }

    // The policy in force allows all three.
    let v = check_json(&node, &[]);
    assert_eq!((v["policy_version"].as_u64(), v["checked"].as_u64()), (Some(1), Some(3)), "{v}");
    assert_eq!(ids(&v, "refused"), Vec::<String>::new(), "{v}");

    // Version 2: the trusted tier loses whole GPUs. The daemon restarts on it; the grants
    // live on (their containers run), made under version 1.
    write_policy(&policy, 2, |v| {
        v["tiers"]["trusted"]["allow"] = serde_json::json!(["mig", "mps"])
    });
    node.restart();
    let v = check_json(&node, &[]);
    assert_eq!((v["policy_version"].as_u64(), v["checked"].as_u64()), (Some(2), Some(3)), "{v}");
    assert_eq!(ids(&v, "refused"), ["polite", "stubborn"], "{v}");
    for r in v["refused"].as_array().unwrap() {
        assert_eq!(r["tenant"], "acme/trusted/training/alice", "{r}");
        assert_eq!(r["request"], "gpu=1", "{r}");
        assert_eq!(r["rule"], "tiers.trusted.allow", "{r}");
        assert_eq!(r["state"], "running", "{r}");
        assert!(r["message"].as_str().unwrap().contains("may not use gpu isolation"), "{r}");
    }
    // The table says the same.
    let out = node.cli(&["policy", "revoke-check"]);
    out.assert_success("revoke-check");
    let text = out.stdout_str();
    assert!(text.starts_with("policy v2 "), "{text}");
    assert!(text.contains("refuses 2 of 3 grants"), "{text}");
    assert!(
        text.contains("polite  running pid") && text.contains("stubborn  running pid"),
        "{text}"
    );
    assert!(text.contains("refused by tiers.trusted.allow"), "{text}");
    assert!(!text.contains("keep"), "{text}");

    // A container the policy allows is never stopped: the whole stop is refused.
    let out =
        node.cli(&["policy", "revoke-check", "--stop", "--container", "keep", "--grace", "1"]);
    out.assert_failure("stopping an allowed grant");
    assert!(
        out.stderr_str().contains("policy version 2 allows the grant of container keep"),
        "{}",
        out.stderr_str()
    );
    assert_eq!(node.fx.status("polite").as_deref(), Some("running"), "nothing was stopped");

    // Stop: SIGTERM, and SIGKILL 2 s later for what still runs.
    let t0 = std::time::Instant::now();
    let v = check_json(&node, &["--stop", "--grace", "2"]);
    let took = t0.elapsed();
    assert_eq!(v["grace_s"], 2, "{v}");
    let outcome = |id: &str| {
        v["stopped"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["container_id"] == id)
            .map(|s| s["outcome"].clone())
    };
    assert_eq!(ids(&v, "stopped"), ["polite", "stubborn"], "{v}");
    assert_eq!(outcome("polite"), Some("terminated".into()), "{v}");
    assert_eq!(outcome("stubborn"), Some("killed".into()), "{v}");
    assert!(took >= Duration::from_secs(2) && took < Duration::from_secs(15), "{took:?}");
    // Each saw the SIGTERM; the one that ignored it was killed; the allowed one runs on.
    assert!(node.fx.container_output("polite").0.contains("got-SIGTERM"));
    assert!(
        wait_for(
            || node.fx.container_output("stubborn").0.contains("ignoring-SIGTERM"),
            Duration::from_secs(2)
        ),
        "{:?}",
        node.fx.container_output("stubborn")
    );
    assert_eq!(node.fx.status("polite").as_deref(), Some("stopped"));
    assert_eq!(node.fx.status("stubborn").as_deref(), Some("stopped"));
    assert_eq!(node.fx.status("keep").as_deref(), Some("running"));
    assert!(!node.fx.container_output("keep").0.contains("keep-got-SIGTERM"));

    // Not released while runc has the containers (their device rules live on in runc's
    // cgroup until `delete`): the reconciler keeps them, a few of its ticks later too.
    std::thread::sleep(Duration::from_millis(600));
    let c = node.client();
    for id in ["polite", "stubborn"] {
        assert!(c.allocation(id).is_ok(), "{id} released while runc still has it");
    }
    // Removed as the engine would remove them (delete through tessera-runtime): released.
    for id in ["polite", "stubborn"] {
        node.fx.delete_container(id, false).assert_success("delete");
        let e = c.allocation(id).unwrap_err();
        assert_eq!(e.api_error().map(|e| e.code), Some(ErrorCode::NotFound), "{e}");
    }
    // Nothing is refused any more; every step is an event.
    assert_eq!(ids(&check_json(&node, &[]), "refused"), Vec::<String>::new());
    let status = c.status().unwrap();
    let revoke_events = status.events.iter().filter(|e| e.kind == "revoke").count();
    assert_eq!(revoke_events, 4, "one before and one after each stop: {:?}", status.events);
    node.fx.delete_container("keep", true).assert_success("delete keep");
}

#[test]
fn a_stop_with_nothing_refused_stops_nothing_and_bad_requests_name_what_is_wrong() {
    let node = Node::start();
    let b = node.bundle("ok1", "team-dev", Some("gpu=1"), &["sleep", "300"]);
    node.fx.run_detached(&b, "ok1");
    let v = check_json(&node, &["--stop", "--grace", "0"]);
    assert_eq!(ids(&v, "stopped"), Vec::<String>::new(), "{v}");
    assert_eq!(node.fx.status("ok1").as_deref(), Some("running"));

    let out = node.cli(&["policy", "revoke-check", "--stop", "--container", "ghost"]);
    out.assert_failure("unknown container");
    assert!(out.stderr_str().contains("no grant for container ghost"), "{}", out.stderr_str());
    // The grace period is bounded, by the CLI and by the daemon.
    node.cli(&["policy", "revoke-check", "--stop", "--grace", "301"])
        .assert_failure("grace too long");
    let e = node
        .client()
        .call::<_, serde_json::Value>(
            "POST",
            "/v1/revoke-check/stop",
            Some(&serde_json::json!({"grace_s": 301})),
        )
        .unwrap_err();
    assert_eq!(e.api_error().map(|e| e.code), Some(ErrorCode::BadRequest), "{e}");
    let e = node
        .client()
        .call::<_, serde_json::Value>(
            "POST",
            "/v1/revoke-check/stop",
            Some(&serde_json::json!({"grace": 1})),
        )
        .unwrap_err();
    assert!(e.to_string().contains("grace"), "unknown fields are refused: {e}");
    node.fx.delete_container("ok1", true).assert_success("delete");
}

/// Issue 29 moved the confirmation of a created GPU container from the end of `runc create`
/// to its `start`: a grant stays pending while its container waits, and the stop skips it
/// ("not started"). Its start is a decision made now: a grant the policy in force refuses
/// is not confirmed, the container is undone and its grant given back, and nothing of it
/// runs.
#[test]
fn a_created_container_whose_grant_the_policy_now_refuses_never_starts() {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policy.json");
    write_policy(&policy, 1, |_| {});
    let mut node =
        Node::start_with(NodeOptions { policy: policy.clone(), ..NodeOptions::default() });
    let b = node.bundle("late", "team-trusted", Some("gpu=1"), &["sh", "-c", "echo ran-with-gpu"]);
    node.fx.create_container(&b, "late").assert_success("runc create");
    assert_eq!(node.fx.status("late").as_deref(), Some("created"));

    write_policy(&policy, 2, |v| {
        v["tiers"]["trusted"]["allow"] = serde_json::json!(["mig", "mps"])
    });
    node.restart();
    let v = check_json(&node, &[]);
    assert_eq!(ids(&v, "refused"), ["late"], "{v}");
    assert_eq!(v["refused"][0]["state"], "pending", "{v}");
    let v = check_json(&node, &["--stop", "--grace", "1"]);
    assert_eq!(v["stopped"][0]["outcome"], "skipped", "no process to signal yet: {v}");

    let out = node.fx.start_container("late");
    out.assert_failure("start of a created container whose grant the policy refuses");
    let err = out.stderr_str();
    assert!(err.contains("policy version 2 refuses its grant"), "{err}");
    assert!(err.contains("tiers.trusted.allow"), "{err}");
    assert!(
        !node.fx.container_output("late").0.contains("ran-with-gpu"),
        "the container ran: {:?}",
        node.fx.container_output("late")
    );
    // Undone: runc has no container, and the grant is given back.
    assert_eq!(node.fx.status("late"), None, "the refused container is deleted");
    let e = node.client().allocation("late").unwrap_err();
    assert_eq!(e.api_error().map(|e| e.code), Some(ErrorCode::NotFound), "{e}");
}
