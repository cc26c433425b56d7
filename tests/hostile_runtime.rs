//! Issue 11 ("Isolation that holds under attack"), classes 2 and 4 of the hostile corpus,
//! end to end with real runc: a grant ends only when its own container is gone, a refused
//! create gives its grant back at once, and untrusted text reaches errors escaped and
//! bounded.

// Integration-test crates: clippy counts their helper functions as non-test code, so
// `allow-unwrap-in-tests` (clippy.toml) does not reach them; a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::json;
use tessera_harness::node::*;
use tessera_harness::*;

/// The slowest reconciler: whatever is released here, the reconciler did not do it.
fn no_reconciler() -> NodeOptions {
    NodeOptions {
        reconcile_interval_ms: 600_000,
        pending_grace_ms: 600_000,
        ..NodeOptions::default()
    }
}

/// `tessera-runtime --root ROOT ARGS..` with the fixture's runtime environment; the
/// command's stdio (and a created container's) goes to files, so a container left running
/// never holds a pipe of the test.
fn wrapper_in(node: &Node, root: &Path, args: &[&str]) -> Output {
    let rt = node.fx.runtime();
    let tag = format!("wrapper-{}", unique_name());
    let (out, err) = (
        node.fx.log_dir().join(format!("{tag}.out")),
        node.fx.log_dir().join(format!("{tag}.err")),
    );
    let mut cmd = Command::new(&rt.bin);
    cmd.arg("--root").arg(root).args(args);
    cmd.envs(rt.env.iter().map(|(k, v)| (k, v)));
    cmd.stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap());
    let mut child = cmd.spawn().unwrap();
    let status = wait_child(&mut child, CMD_TIMEOUT).unwrap().expect("wrapper timed out");
    Output {
        status,
        stdout: std::fs::read(&out).unwrap_or_default(),
        stderr: std::fs::read(&err).unwrap_or_default(),
    }
}

/// A second runc root inside the fixture, cleaned up with it.
fn other_root(node: &Node) -> PathBuf {
    let root = node.fx.path("other-root");
    std::fs::create_dir_all(&root).unwrap();
    node.fx.cleanup().track_runc_root(&root);
    root
}

fn events_of(node: &Node, id: &str) -> Vec<(String, String)> {
    node.client()
        .status()
        .unwrap()
        .events
        .into_iter()
        .filter(|e| e.container_id.as_deref() == Some(id))
        .map(|e| (e.kind, e.detail))
        .collect()
}

fn json_request(
    node: &Node,
    method: &str,
    path: &str,
    body: Option<serde_json::Value>,
) -> (u16, String) {
    let body = body.map(|b| b.to_string());
    let r = node.client().raw(method, path, body.as_deref().map(str::as_bytes)).unwrap();
    (r.status, String::from_utf8_lossy(&r.body).into_owned())
}

// ---------------------------------------------------------------------------------------
// Class 2 (a): only the container a grant belongs to can end it
// ---------------------------------------------------------------------------------------

#[test]
fn a_container_of_the_same_id_in_another_runc_root_cannot_release_a_running_grant() {
    let node = Node::start_with(no_reconciler());
    let c = node.client();
    let b = node.bundle("victim", "team-trusted", Some("gpu=1"), &["sleep", "300"]);
    node.fx.run_detached(&b, "victim");
    let before = c.allocation("victim").expect("grant");

    // Another root tesserad watches (a GPU container was confirmed there)...
    let root = other_root(&node);
    let watched = node.bundle("watched", "team-trusted", Some("gpu=1"), &["sleep", "300"]);
    let wd = watched.dir().to_string_lossy().into_owned();
    wrapper_in(&node, &root, &["create", "--bundle", &wd, "watched"])
        .assert_success("a GPU container in the other root");
    // ...and in it a container of the same id: no GPU request, the wrapper's label forged.
    let mut evil = node.fx.bundle("evil");
    evil.args(&["sleep", "300"])
        .annotation("tessera.io/allocated", &before.devices[0].uuid)
        .write();
    node.fx.cleanup().track_cgroup(&evil.cgroups_path());
    let bd = evil.dir().to_string_lossy().into_owned();
    wrapper_in(&node, &root, &["create", "--bundle", &bd, "victim"])
        .assert_success("create in the other root");
    for id in ["victim", "watched"] {
        let out = wrapper_in(&node, &root, &["delete", "-f", id]);
        out.assert_success("delete in the other root");
    }
    assert!(runc_container_ids(&root).is_empty(), "the other root's containers were not deleted");
    // The removal in the watched root was seen: the other root's own grant is given back.
    assert!(c.allocation("watched").is_err(), "the other root's GPU container kept its grant");

    assert_eq!(
        c.allocation("victim").ok().as_ref(),
        Some(&before),
        "the grant of the running container victim was released by deleting another root's container of the same id"
    );
    assert_eq!(node.fx.status("victim").as_deref(), Some("running"));
    // Asked in so many words, with the other root: refused and recorded.
    let other = json!({"runc_root": root.display().to_string()});
    let (status, text) = json_request(&node, "DELETE", "/v1/allocations/victim", Some(other));
    assert_eq!(status, 409, "{text}");
    let refused: Vec<_> =
        events_of(&node, "victim").into_iter().filter(|(k, _)| k == "release-refused").collect();
    assert!(!refused.is_empty(), "no release-refused event: {:?}", events_of(&node, "victim"));
    assert!(refused[0].1.contains(&root.display().to_string()), "{refused:?}");
    node.fx.delete_container("victim", true).assert_success("delete victim");
    assert!(c.allocation("victim").is_err(), "the victim's own delete must release its grant");
}

#[test]
fn the_daemon_refuses_a_release_while_runc_still_has_the_container() {
    let node = Node::start_with(no_reconciler());
    let b = node.bundle("held", "team-trusted", Some("gpu=1"), &["sleep", "300"]);
    node.fx.run_detached(&b, "held");
    let before = node.client().allocation("held").expect("grant");
    let root = node.fx.runc_root().display().to_string();
    let bundle = std::fs::canonicalize(b.dir()).unwrap().display().to_string();

    // Whatever a caller sends, even the recorded root and bundle, or nothing at all (an
    // older client), the container is still in runc's state: nothing is released.
    for body in [None, Some(json!({"runc_root": root, "bundle": bundle}))] {
        let (status, text) = json_request(&node, "DELETE", "/v1/allocations/held", body.clone());
        assert_eq!(status, 409, "release with {body:?} answered {status}: {text}");
        assert!(text.contains("still has") && text.contains(&root), "{text}");
        assert_eq!(
            node.client().allocation("held").ok().as_ref(),
            Some(&before),
            "released with {body:?}"
        );
    }
    assert!(events_of(&node, "held").iter().any(|(k, _)| k == "release-refused"));
}

#[test]
fn a_release_naming_another_root_or_bundle_is_refused_and_recorded() {
    let node = Node::start_with(no_reconciler());
    let b = node.bundle("gone", "team-trusted", Some("gpu=1"), &["sleep", "300"]);
    node.fx.run_detached(&b, "gone");
    let root = node.fx.runc_root().display().to_string();
    let bundle = std::fs::canonicalize(b.dir()).unwrap().display().to_string();
    for body in [
        json!({"runc_root": "/tmp/elsewhere", "bundle": bundle}),
        json!({"runc_root": root, "bundle": "/tmp/other-bundle"}),
    ] {
        let (status, text) =
            json_request(&node, "DELETE", "/v1/allocations/gone", Some(body.clone()));
        assert_eq!(status, 409, "release with {body} answered {status}: {text}");
        assert!(node.client().allocation("gone").is_ok(), "released by a caller naming {body}");
    }
    let refused =
        events_of(&node, "gone").into_iter().filter(|(k, _)| k == "release-refused").count();
    assert_eq!(refused, 2, "{:?}", events_of(&node, "gone"));
    // Deleted with plain runc in its own root: given back.
    let out = run_cmd(Command::new(RUNC).args(["--root", &root, "delete", "-f", "gone"]));
    out.assert_success("runc delete");
    assert!(node.client().allocation("gone").is_err());
    // A release of a grant that is gone is no error.
    let (status, text) = json_request(
        &node,
        "DELETE",
        "/v1/allocations/gone",
        Some(json!({"runc_root": root, "bundle": bundle})),
    );
    assert_eq!(status, 200, "{text}");
}

#[test]
fn a_forged_label_on_a_plain_container_releases_nothing_and_its_delete_needs_no_daemon() {
    let mut node = Node::start_with(no_reconciler());
    let c = node.client();
    let b = node.bundle("gpu", "team-trusted", Some("gpu=1"), &["sleep", "300"]);
    node.fx.run_detached(&b, "gpu");
    let before = c.allocation("gpu").expect("grant");

    let mut plain = node.fx.bundle("plain");
    plain
        .args(&["sleep", "300"])
        .annotation("tessera.io/allocated", &before.devices[0].uuid)
        .write();
    node.fx.run_detached(&plain, "plain");
    node.fx.delete_container("plain", true).assert_success("delete of a labelled plain container");
    assert_eq!(c.allocation("gpu").ok().as_ref(), Some(&before));

    // With tesserad down the same delete still works (a warning at most).
    node.fx.run_detached(&plain, "plain2");
    node.daemon.kill9();
    let out = node.fx.delete_container("plain2", true);
    out.assert_success("delete of a labelled plain container while tesserad is down");
    assert!(node.fx.state("plain2").is_none());
}

/// A GPU container that `runc create` made is confirmed by the wrapper's `start`, right
/// before its process runs: until then its grant is pending (tesserad has not seen the
/// container), nothing marks it confirmed, and it takes no exec.
#[test]
fn a_created_gpu_container_is_confirmed_at_its_start() {
    let node = Node::start_with(no_reconciler());
    let c = node.client();
    let b = node.bundle("unconfirmed", "team-trusted", Some("gpu=1"), &["sleep", "300"]);
    node.fx.create_container(&b, "unconfirmed").assert_success("create");
    let marker = node.fx.runc_root().join("unconfirmed").join("tessera-confirmed");
    assert!(!marker.exists(), "confirmed before its start");
    let pending = c.allocation("unconfirmed").expect("granted");
    assert_eq!(pending.state, tessera_api::AllocationState::Pending);
    assert_eq!(pending.pid, None);
    node.fx.start_container("unconfirmed").assert_success("start");
    assert!(marker.is_file(), "a confirmed start leaves its marker");
    let running = c.allocation("unconfirmed").expect("granted");
    assert_eq!(running.state, tessera_api::AllocationState::Running);
    let state = node.fx.state("unconfirmed").expect("runc's");
    assert_eq!(running.pid, state["pid"].as_i64().map(|p| p as i32), "{state}");
    assert_eq!(state["status"], json!("running"), "{state}");
    node.fx.delete_container("unconfirmed", true).assert_success("delete");
}

/// The devices cgroup (v1, as `/proc/<pid>/cgroup` names it) of the init of created
/// container `id`, and its directory under the cgroup mount.
fn devices_cgroup_of(node: &Node, id: &str) -> (String, PathBuf) {
    let state = node.fx.state(id).expect("created");
    let pid = state["pid"].as_i64().expect("init pid");
    let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("init's cgroup");
    let devices = cgroup
        .lines()
        .find_map(|l| l.split_once(":devices:").map(|(_, p)| p.to_string()))
        .expect("a devices cgroup (v1)");
    let dir = Path::new(CGROUP_ROOT).join("devices").join(devices.trim_start_matches('/'));
    (devices, dir)
}

/// A process of the host put into cgroup directory `dir` (tracked for cleanup).
fn intruder_in(node: &Node, dir: &Path) -> std::process::Child {
    let intruder = Command::new("sleep").arg("300").spawn().unwrap();
    node.fx.cleanup().track_pid(intruder.id());
    std::fs::write(dir.join("cgroup.procs"), intruder.id().to_string()).unwrap();
    intruder
}

/// A created GPU container tesserad refuses to confirm at its start (here: a process of
/// the host moved into its cgroup after `runc create`) does not start: the start fails with
/// tesserad's sentence and the container is deleted; its init never left runc's exec
/// fifo. The grant is given back only once no process is left in that cgroup (runc wrote
/// the grant's device rules into it at the create, and the intruder keeps them).
#[test]
fn a_created_gpu_container_refused_at_its_start_never_runs_and_is_undone() {
    let node = Node::start();
    let b =
        node.bundle("spoiled", "team-trusted", Some("gpu=1"), &["sh", "-c", "echo ran; sleep 300"]);
    node.fx.create_container(&b, "spoiled").assert_success("create");
    let (_, dir) = devices_cgroup_of(&node, "spoiled");
    let mut intruder = intruder_in(&node, &dir);
    let out = node.fx.start_container("spoiled");
    let after = node.fx.state("spoiled");
    let held = node.client().allocation("spoiled").is_ok();
    let _ = intruder.kill();
    let _ = intruder.wait();
    assert!(!out.status.success(), "started: {}", out.stderr_str());
    let err = out.stderr_str();
    assert!(err.contains("container spoiled:") && err.contains("refusing to start it"), "{err}");
    assert!(after.is_none(), "the refused container is still runc's: {after:?}");
    assert!(!node.fx.container_output("spoiled").0.contains("ran"), "its process ran");
    assert!(held, "the grant was given back while the intruder held its device rules");
    assert!(
        wait_for(|| node.client().allocation("spoiled").is_err(), Duration::from_secs(10)),
        "the grant outlived the last process in its cgroup"
    );
}

/// A created GPU container deleted before any start (`docker create`, then `docker rm`)
/// whose cgroup another process got into (between the wrapper's check that it is empty
/// and runc's create; here put there by hand): runc wrote the grant's device rules into
/// that cgroup at create, and its delete (which kills only the init of a container with its
/// own pid namespace) cannot remove a cgroup in use, so the rules stay with that process.
/// The grant is held while it is there, and ends once the cgroup is empty.
#[test]
fn a_created_gpu_container_deleted_unstarted_keeps_its_grant_while_its_cgroup_holds_a_process() {
    let node = Node::start();
    let b = node.bundle("unstarted", "team-trusted", Some("gpu=1"), &["sh", "-c", "sleep 300"]);
    node.fx.create_container(&b, "unstarted").assert_success("create");
    let (devices, procs) = devices_cgroup_of(&node, "unstarted");
    // tesserad saw runc's create end (its requester exited with a record): the cgroup is
    // listed beside its socket. Bounded: without the record of it, the delete below tells.
    let list = tessera_api::cgroup::grant_cgroups_path(&node.socket);
    let rel = format!("devices{devices}");
    let _ = wait_for(
        || std::fs::read_to_string(&list).unwrap_or_default().lines().any(|l| l == rel),
        Duration::from_secs(5),
    );
    let mut intruder = intruder_in(&node, &procs);
    // runc itself, as an engine's delete of a created container: it kills the init, cannot
    // remove the cgroup (the intruder is in it) and removes its record.
    let _ = Command::new(RUNC)
        .arg("--root")
        .arg(node.fx.runc_root())
        .args(["delete", "--force", "unstarted"])
        .output()
        .expect("runc");
    let gone = node.fx.state("unstarted").is_none();
    // The first answer after runc's delete counts the removal.
    let held = node.client().allocation("unstarted").is_ok();
    let rules_left = std::fs::read_to_string(procs.join("devices.list")).unwrap_or_default();
    let _ = intruder.kill();
    let _ = intruder.wait();
    assert!(gone, "runc still has the container");
    assert!(
        held,
        "the grant was given back while the intruder keeps its device rules ({})",
        rules_left.trim().replace('\n', ", ")
    );
    assert!(
        wait_for(|| node.client().allocation("unstarted").is_err(), Duration::from_secs(10)),
        "the grant outlived the last process in its cgroup"
    );
}

/// A grant ends when runc removes its container, whoever deleted it, without a word to
/// tesserad and before any other action of tesserad's: every periodic task is slowed past
/// the test, runc itself (not the wrapper) deletes the container, and no request is made
/// until the grant's cgroup has left tesserad's list beside its socket (written at every
/// release). Only the task that wakes on runc's removal can release it. Then the API agrees.
#[test]
fn a_grant_ends_when_runc_removes_its_container_without_a_word_to_tesserad() {
    let slow = |flag: &str, ms: &str| [flag.to_string(), ms.to_string()];
    let extra_args = [
        slow("--scrub-interval-ms", "600000"),
        slow("--checkpoint-interval-ms", "10000"),
        slow("--util-interval-ms", "600000"),
        slow("--telemetry-interval-ms", "600000"),
        slow("--mps-health-interval-ms", "600000"),
    ]
    .concat();
    let node = Node::start_with(NodeOptions { extra_args, ..no_reconciler() });
    let b = node.bundle("watched", "team-trusted", Some("gpu=1"), &["true"]);
    node.fx.create_container(&b, "watched").assert_success("create");
    node.fx.start_container("watched").assert_success("start");
    // The init exited and tesserad closed its interval (the exit watch's action is over):
    // from here on nothing asks tesserad anything.
    let closed = || {
        let out =
            node.cli(&["usage", "--from", "-1h", "--to", "now", "--by", "container", "--json"]);
        let v: serde_json::Value = serde_json::from_str(&out.stdout_str()).unwrap_or_default();
        v["open_intervals"] == json!(0) && v["total"]["gpu_seconds"].as_f64().is_some()
    };
    assert!(wait_for(closed, Duration::from_secs(10)), "the exit was not metered");
    let list = tessera_api::cgroup::grant_cgroups_path(&node.socket);
    let listed = |l: &Path| std::fs::read_to_string(l).unwrap_or_default();
    assert!(!listed(&list).trim().is_empty(), "the stopped grant's cgroup is listed");
    let out = Command::new(RUNC)
        .arg("--root")
        .arg(node.fx.runc_root())
        .args(["delete", "watched"])
        .output()
        .expect("runc");
    out.assert_success("runc delete, not through the wrapper");
    assert!(
        wait_for(|| listed(&list).trim().is_empty(), Duration::from_secs(5)),
        "still listed: {}",
        listed(&list)
    );
    assert!(node.client().allocation("watched").is_err(), "the grant is gone");
}

/// Every answer tesserad gives after runc's delete returned counts the grant as given back:
/// deleted through the wrapper (a plain exec of runc now) and asked at once.
#[test]
fn the_first_answer_after_a_delete_counts_the_grant_as_given_back() {
    let node = Node::start_with(no_reconciler());
    let c = node.client();
    for i in 0..5 {
        let id = format!("quick{i}");
        let b = node.bundle(&id, "team-trusted", Some("gpu=1"), &["sleep", "300"]);
        node.fx.run_detached(&b, &id);
        assert!(c.allocation(&id).is_ok(), "{id}: granted");
        node.fx.delete_container(&id, true).assert_success("delete");
        let e = c.allocation(&id).expect_err("given back by the first answer");
        assert_eq!(e.api_error().map(|e| e.code), Some(tessera_api::ErrorCode::NotFound), "{e}");
    }
}

/// One runc root reached by two paths (a symlink, as /var/run is of /run on most hosts; a
/// bind mount): the kernel has one watch for the directory, and a container confirmed
/// through one spelling must not hide the removals of the containers recorded under the
/// other (the grant would wait for the reconciler's pass).
#[test]
fn a_root_reached_by_two_paths_gives_back_the_grants_of_both() {
    let node = Node::start_with(no_reconciler());
    let c = node.client();
    let root = node.fx.runc_root();
    let b = node.bundle("direct", "team-trusted", Some("gpu=1"), &["sleep", "300"]);
    node.fx.run_detached(&b, "direct");
    let link = node.fx.path("root-link");
    std::os::unix::fs::symlink(&root, &link).unwrap();
    let l = node.bundle("linked", "team-trusted", Some("gpu=1"), &["sleep", "300"]);
    let ld = l.dir().to_string_lossy().into_owned();
    wrapper_in(&node, &link, &["run", "-d", "--bundle", &ld, "linked"])
        .assert_success("run -d through the link");
    assert!(c.allocation("linked").is_ok(), "granted through the link");
    node.fx.delete_container("direct", true).assert_success("delete");
    let direct = c.allocation("direct").map(|a| a.state);
    wrapper_in(&node, &link, &["delete", "-f", "linked"]).assert_success("delete through the link");
    let linked = c.allocation("linked").map(|a| a.state);
    assert!(
        direct.is_err(),
        "the grant of the container recorded under {} is still held: {direct:?}",
        root.display()
    );
    assert!(
        linked.is_err(),
        "the grant of the container recorded under {} is still held: {linked:?}",
        link.display()
    );
}

/// A record renamed away (IN_MOVED_FROM) while its container runs is judged on what the
/// host shows: the init runs and its cgroup holds it, so nothing is released (the
/// removal is seen: a release-refused event); runc's own delete later gives it back.
#[test]
fn a_record_moved_away_from_a_running_container_releases_nothing() {
    let node = Node::start_with(no_reconciler());
    let c = node.client();
    let b = node.bundle("moved", "team-trusted", Some("gpu=1"), &["sleep", "300"]);
    node.fx.run_detached(&b, "moved");
    let before = c.allocation("moved").expect("grant");
    let record = node.fx.runc_root().join("moved");
    let away = node.fx.path("moved-away");
    std::fs::rename(&record, &away).unwrap();
    let refused: Vec<_> =
        events_of(&node, "moved").into_iter().filter(|(k, _)| k == "release-refused").collect();
    let now = c.allocation("moved").ok();
    std::fs::rename(&away, &record).unwrap();
    assert_eq!(now.as_ref(), Some(&before), "released while its container runs");
    assert!(!refused.is_empty(), "the removal was not seen: {:?}", events_of(&node, "moved"));
    assert_eq!(node.fx.status("moved").as_deref(), Some("running"));
    node.fx.delete_container("moved", true).assert_success("delete");
    assert!(c.allocation("moved").is_err(), "runc's delete gives the grant back");
}

/// However `start` is spelled: runc reads `start -- ID` as `start ID` (Go's flag package
/// ends the flags at `--`), so the wrapper confirms the id found there too; arguments
/// naming two ids (runc starts none) never start an unconfirmed one.
#[test]
fn an_unconfirmed_gpu_container_starts_only_confirmed_however_start_is_spelled() {
    let node = Node::start_with(no_reconciler());
    let b = node.bundle("unconf-dd", "team-trusted", Some("gpu=1"), &["sleep", "300"]);
    node.fx.create_container(&b, "unconf-dd").assert_success("create");
    let marker = node.fx.runc_root().join("unconf-dd").join("tessera-confirmed");
    let two = node.fx.runc(&["start", "other", "unconf-dd"], &[]);
    let after_two = node.fx.state("unconf-dd").expect("still runc's");
    let dashed = node.fx.runc(&["start", "--", "unconf-dd"], &[]);
    let state = node.fx.state("unconf-dd").expect("still runc's");
    let grant = node.client().allocation("unconf-dd");
    node.fx.delete_container("unconf-dd", true).assert_success("delete");
    assert!(!two.status.success(), "start X ID: started ({after_two})");
    let err = two.stderr_str();
    assert!(err.contains("container other: its GPU grant is not confirmed"), "{err}");
    assert_eq!(after_two["status"], json!("created"), "{after_two}");
    dashed.assert_success("start -- ID");
    assert_eq!(state["status"], json!("running"), "{state}");
    assert!(marker.exists() || state["status"] == json!("running"));
    let grant = grant.expect("granted");
    assert_eq!(grant.state, tessera_api::AllocationState::Running, "start -- ID confirmed it");
}

/// Nor does a created GPU container take an exec before its start: runc execs into a
/// created container, and the exec'd process would run with the container's devices
/// before tesserad ever saw the container.
#[test]
fn a_never_confirmed_gpu_container_takes_no_exec() {
    let node = Node::start_with(no_reconciler());
    let b = node.bundle("unconf-ex", "team-trusted", Some("gpu=1"), &["sleep", "300"]);
    node.fx.create_container(&b, "unconf-ex").assert_success("create");
    let plain = node.fx.exec("unconf-ex", &["sh", "-c", "echo ran"]);
    let dashed = node.fx.runc(&["exec", "--", "unconf-ex", "sh", "-c", "echo ran"], &[]);
    // Go's flag package reads `-cwd` as `--cwd`: its value is not the container id.
    let go_flag = node.fx.runc(&["exec", "-cwd", "/", "unconf-ex", "sh", "-c", "echo ran"], &[]);
    // A `-h` of the exec'd command (runc's exec does not reorder its arguments) is not runc's.
    let help = node.fx.runc(&["exec", "unconf-ex", "sh", "-c", "echo ran", "-h"], &[]);
    node.fx.delete_container("unconf-ex", true).assert_success("delete");
    for (how, out) in [
        ("exec ID", plain),
        ("exec -- ID", dashed),
        ("exec -cwd / ID", go_flag),
        ("exec ID sh -c .. -h", help),
    ] {
        assert!(
            !out.status.success() && !out.stdout_str().contains("ran"),
            "{how}: ran in a never-confirmed GPU container: {} {}",
            out.stdout_str(),
            out.stderr_str()
        );
        let err = out.stderr_str();
        assert!(err.contains("its GPU grant is not confirmed"), "{how}: {err}");
    }
}

/// The wrapper writes its rewrite back into the bundle: a bundle once created (annotated to
/// be confirmed after `runc create`) and then run (`runc run -d`, confirmed by the prestart
/// hook, no marker) is not taken for a never-confirmed create: its container takes an exec.
#[test]
fn a_gpu_bundle_created_once_then_run_takes_an_exec() {
    let node = Node::start_with(no_reconciler());
    let b = node.bundle("reused", "team-trusted", Some("gpu=1"), &["sleep", "300"]);
    node.fx.create_container(&b, "reused").assert_success("create");
    node.fx.delete_container("reused", true).assert_success("delete");
    // Given back (tesserad's answer after runc's delete): its cgroup is free for the run.
    assert!(node.client().allocation("reused").is_err(), "the create's grant is given back");
    let bd = b.dir().to_string_lossy().into_owned();
    let root = node.fx.runc_root();
    wrapper_in(&node, &root, &["run", "-d", "--bundle", &bd, "reused"]).assert_success("run -d");
    let out = node.fx.exec("reused", &["sh", "-c", "echo ran"]);
    node.fx.delete_container("reused", true).assert_success("delete");
    assert!(
        out.status.success() && out.stdout_str().contains("ran"),
        "exec into a run container: {} {}",
        out.stdout_str(),
        out.stderr_str()
    );
}

/// A created GPU container's grant is pending until its start, and the processes that
/// asked for it are tesserad's memory. Restarted in between, tesserad finds the container
/// made (runc's record): once it is deleted, nothing can start with the grant, and it is
/// given back at once, not after the pending grace (ten minutes here).
#[test]
fn a_created_container_deleted_after_a_restart_gives_its_grant_back_at_once() {
    let mut node = Node::start_with(no_reconciler());
    let b = node.bundle("across", "team-trusted", Some("gpu=1"), &["sleep", "300"]);
    node.fx.create_container(&b, "across").assert_success("create");
    node.restart();
    let c = node.client();
    let pending = c.allocation("across").expect("a created container keeps its grant");
    assert_eq!(pending.state, tessera_api::AllocationState::Pending);
    node.fx.delete_container("across", true).assert_success("delete");
    let gone = wait_for(|| c.allocation("across").is_err(), Duration::from_secs(5));
    assert!(
        gone,
        "the grant of a container deleted after a restart is held: {:?}",
        c.allocation("across")
    );
}

/// A foreground `run` that ended leaves no grant behind, though the wrapper says nothing
/// after it (runc removed the record; tesserad watches the root since the prestart hook).
/// A `run` or `create` runc refused leaves none either: the wrapper exec'd runc, and
/// tesserad, which watched the process that asked (the wrapper, runc by the exec), gives
/// the grant back once it exited and runc has no record — long before the pending grace
/// (ten minutes here). A created container deleted before any start is given back too.
#[test]
fn a_run_that_ended_or_was_refused_leaves_no_grant() {
    let node = Node::start_with(no_reconciler());
    let c = node.client();
    let b = node.bundle("ended", "team-trusted", Some("gpu=1"), &["true"]);
    node.fx.run_container(&b, "ended").assert_success("run");
    assert!(c.allocation("ended").is_err(), "the grant of a run that ended is still held");
    for verb in ["run", "create"] {
        let id = format!("refused-{verb}");
        let mut b = node.bundle(&id, "team-trusted", Some("gpu=1"), &["true"]);
        b.mutate(|c| c["process"]["cwd"] = json!("relative")).write();
        let out = if verb == "run" {
            node.fx.run_container(&b, &id)
        } else {
            node.fx.create_container(&b, &id)
        };
        assert!(!out.status.success(), "runc {verb} took a relative cwd");
        assert!(node.fx.state(&id).is_none(), "runc kept a record of the refused {verb}");
        let held = c.allocation(&id);
        assert!(held.is_err(), "the grant of a refused {verb} is still held: {held:?}");
    }
    let b = node.bundle("never-started", "team-trusted", Some("gpu=1"), &["true"]);
    node.fx.create_container(&b, "never-started").assert_success("create");
    assert!(c.allocation("never-started").is_ok(), "a created container keeps its grant");
    node.fx.delete_container("never-started", true).assert_success("delete");
    let held = c.allocation("never-started");
    assert!(held.is_err(), "the grant of a container deleted before its start: {held:?}");
}

// ---------------------------------------------------------------------------------------
// Class 2 (b): a running grant outlives its init while a process is left in its cgroup
// ---------------------------------------------------------------------------------------

/// A GPU container whose init exits at once, leaving a worker in its cgroup. GPU
/// containers have a pid namespace of their own (issue 23: a shared one, Kubernetes'
/// shareProcessNamespace among them, is refused), whose processes die with its init; what
/// stays is a process put into the cgroup from outside — a worker of another pid
/// namespace the kernel left there, as a shared namespace could (the reconciler kills such
/// an intruder only while the init runs). Returns (init pid, the container's devices
/// cgroup dir, the worker).
fn start_leaving_a_worker(node: &Node, id: &str) -> (i32, PathBuf, std::process::Child) {
    let b = node.bundle(id, "team-trusted", Some("gpu=1"), &["true"]);
    node.fx.create_container(&b, id).assert_success("create");
    node.fx.start_container(id).assert_success("start");
    // The wrapper's start confirmed it: the daemon knows the init's pid now.
    let pid = node.client().allocation(id).expect("grant").pid.expect("start recorded the pid");
    let cg = Path::new(CGROUP_ROOT).join("devices").join(b.cgroups_path().trim_start_matches('/'));
    assert!(wait_for(|| !pid_alive(pid, None), Duration::from_secs(10)), "init did not exit");
    let worker = Command::new("sleep").arg("300").spawn().unwrap();
    node.fx.cleanup().track_pid(worker.id());
    std::fs::write(cg.join("cgroup.procs"), worker.id().to_string()).unwrap();
    assert!(!cgroup_procs(&cg).is_empty(), "no worker left in {}", cg.display());
    (pid, cg, worker)
}

/// Waits until the reconciler has completed `n` more passes.
fn reconcile_passes(node: &Node, n: u64) {
    let start = node.client().status().unwrap().reconcile_passes;
    assert!(
        wait_for(
            || node.client().status().unwrap().reconcile_passes >= start + n,
            Duration::from_secs(10)
        ),
        "the reconciler did not run"
    );
}

#[test]
fn a_worker_left_after_init_exits_keeps_the_grant() {
    let node = Node::start(); // reconciler every 200 ms
    let c = node.client();
    let (_, cg, mut worker) = start_leaving_a_worker(&node, "pod-member");
    let before = c.allocation("pod-member").expect("grant");
    // Reconciler passes with the init gone and the worker running in the cgroup.
    reconcile_passes(&node, 5);
    assert!(!cgroup_procs(&cg).is_empty(), "the worker vanished");
    assert_eq!(
        c.allocation("pod-member").ok().map(|a| a.devices),
        Some(before.devices.clone()),
        "the grant was released while a worker still runs in the container's cgroup"
    );
    // runc removes the container; the worker, of no pid namespace runc kills, stays: the
    // grant stays with it, and is given back by the reconciler once it is gone.
    let root = node.fx.runc_root().display().to_string();
    let _ = run_cmd(Command::new(RUNC).args(["--root", &root, "delete", "-f", "pod-member"]));
    reconcile_passes(&node, 3);
    assert_eq!(
        c.allocation("pod-member").ok().map(|a| a.devices),
        Some(before.devices),
        "the grant was released while a worker still runs in the container's cgroup"
    );
    worker.kill().unwrap();
    worker.wait().unwrap();
    assert!(
        wait_for(|| c.allocation("pod-member").is_err(), Duration::from_secs(10)),
        "not released once the worker was gone"
    );
}

#[test]
fn a_process_left_in_the_cgroup_after_runc_forgot_the_container_keeps_the_grant() {
    let node = Node::start();
    let c = node.client();
    let (_, _cg, mut worker) = start_leaving_a_worker(&node, "forgotten");
    // runc's record goes (as if deleted behind runc's back), the worker stays.
    std::fs::remove_dir_all(node.fx.runc_root().join("forgotten")).unwrap();
    reconcile_passes(&node, 5);
    assert!(
        c.allocation("forgotten").is_ok(),
        "the grant was released while a process is left in the container's cgroup"
    );
    worker.kill().unwrap();
    worker.wait().unwrap();
    assert!(
        wait_for(|| c.allocation("forgotten").is_err(), Duration::from_secs(10)),
        "not released once the cgroup emptied"
    );
}

// ---------------------------------------------------------------------------------------
// Class 4: a refused create gives its grant back at once
// ---------------------------------------------------------------------------------------

#[test]
fn a_create_or_detached_run_that_runc_refuses_gives_the_grant_back_at_once() {
    let node = Node::start_with(no_reconciler());
    let c = node.client();
    for (id, verb) in [("noroot", "create"), ("noroot-d", "run")] {
        let mut b = node.bundle(id, "team-trusted", Some("gpu=1"), &["true"]);
        b.mutate(|c| c["root"]["path"] = json!("/nonexistent/rootfs")).write();
        node.fx.cleanup().track_cgroup(&b.cgroups_path());
        let bd = b.dir().to_string_lossy().into_owned();
        let args: Vec<&str> = if verb == "create" {
            vec!["create", "--bundle", &bd, id]
        } else {
            vec!["run", "-d", "--bundle", &bd, id]
        };
        let out = wrapper_in(&node, &node.fx.runc_root(), &args);
        out.assert_failure("runc refuses a missing rootfs");
        assert!(node.fx.state(id).is_none());
        assert!(c.allocation(id).is_err(), "{verb}: a grant whose create failed is still held");
    }
    // A create of an id that already runs fails too, but that grant is the running
    // container's: it stays.
    let b = node.bundle("twice", "team-trusted", Some("gpu=1"), &["sleep", "300"]);
    node.fx.run_detached(&b, "twice");
    let before = c.allocation("twice").expect("grant");
    node.fx.create_container(&b, "twice").assert_failure("create of an existing id");
    assert_eq!(c.allocation("twice").ok().as_ref(), Some(&before));
}

// ---------------------------------------------------------------------------------------
// Class 4: untrusted text in errors is escaped and bounded; oversized is "too large"
// ---------------------------------------------------------------------------------------

#[test]
fn hostile_request_values_reach_errors_escaped_and_bounded() {
    let node = Node::start_with(no_reconciler());
    let forged = "gpu=1\ntime=\"2026-01-01T00:00:00Z\" level=error msg=\"forged\"\u{1b}[2J\u{0}";
    let huge = format!("mig={}", "x".repeat(100_000));
    for (id, value) in [("nl", forged.to_string()), ("huge", huge)] {
        let mut b = node.fx.bundle(id);
        b.args(&["true"])
            .annotation(NS, "team-trusted")
            .annotation("tessera.io/gpu", &value)
            .write();
        let log = node.fx.path(&format!("{id}.log"));
        let bd = b.dir().to_string_lossy().into_owned();
        let ls = log.display().to_string();
        let out =
            wrapper_in(&node, &node.fx.runc_root(), &["--log", &ls, "create", "--bundle", &bd, id]);
        out.assert_failure("malformed request");
        let err = out.stderr.clone();
        let text = String::from_utf8_lossy(&err);
        assert_eq!(text.lines().count(), 1, "{id}: the error is not one line:\n{text}");
        assert!(
            !err.iter().any(|&b| b == 0x1b || b == 0),
            "{id}: control bytes reach the terminal: {text:?}"
        );
        // One bound for the whole line, whatever its parts did with the value.
        let max = tessera_api::display::MAX_LINE_CHARS + 64;
        assert!(err.len() < max, "{id}: a {} byte error line", err.len());
        let logged = std::fs::read_to_string(&log).unwrap();
        assert_eq!(logged.lines().count(), 1, "{id}: {logged}");
        assert!(logged.len() < max + 200, "{id}: a {} byte log line", logged.len());
    }
    // The daemon, asked directly, answers with the value escaped and bounded too.
    let body = json!({"container_id": "d1", "runc_root": "/r", "bundle": "/b",
                      "request": format!("{}{}", forged, "y".repeat(100_000)), "request_source": "annotation"});
    let (status, text) = json_request(&node, "POST", "/v1/allocations", Some(body));
    assert_eq!(status, 400, "{text}");
    let e: tessera_api::ApiError = serde_json::from_str(&text).unwrap();
    assert!(
        !e.message.contains('\n') && !e.message.contains('\u{1b}') && !e.message.contains('\0'),
        "{:?}",
        e.message
    );
    assert!(e.message.len() < 1024, "{} byte message", e.message.len());
    let body = json!({"container_id": "bad\nid", "runc_root": "/r", "bundle": "/b", "request": "gpu=1", "request_source": "annotation"});
    let (status, text) = json_request(&node, "POST", "/v1/allocations", Some(body));
    assert_eq!(status, 400, "{text}");
    let e: tessera_api::ApiError = serde_json::from_str(&text).unwrap();
    assert!(!e.message.contains('\n'), "{:?}", e.message);
}

#[test]
fn an_oversized_annotation_is_reported_as_too_large_not_as_a_broken_pipe() {
    let node = Node::start_with(no_reconciler());
    let mut b = node.bundle("big", "team-trusted", Some("gpu=1"), &["true"]);
    b.annotation("example.com/blob", &"z".repeat(2 << 20)).write();
    let out = node.fx.run_container(&b, "big");
    out.assert_failure("oversized annotations");
    let err = out.stderr_str();
    assert!(!err.to_lowercase().contains("broken pipe"), "{err}");
    assert!(
        err.contains("too large") && err.contains("1048576") && err.contains("example.com/blob"),
        "{err}"
    );
    assert!(node.client().status().unwrap().allocations.is_empty());
}
