//! Issue 23, classes 1 and 2 end to end: a mount means to Tessera what it means to runc, and
//! a container's cgroup is its own. tesserad on the simulated 8×H100 node, tessera-runtime,
//! tessera-hook and real runc; what the kernel made (the container's mounts, its cgroup's
//! processes, devices.list) is read back, not what Tessera meant.
//!
//! Every hostile case is tried in full before the test asserts, so a run on code without a
//! defence lists every case that got through (and what the container could then do).

#![allow(clippy::unwrap_used)]

use std::fs;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use tessera_harness::node::*;
use tessera_harness::*;

/// What a GPU container runs to use a writable cgroup view: every `cgroup.procs` it can
/// open for writing under `/cg*` (the root's first) gets its pid, then it sleeps.
const ESCAPE: &str = "for f in /cg*/cgroup.procs /cg*/*/cgroup.procs /cg*/*/*/cgroup.procs; do \
                      [ -f \"$f\" ] && echo $$ > \"$f\" 2>/dev/null && echo \"moved via $f\"; done; \
                      sleep 30";

type Edit = Box<dyn Fn(&mut Value, &Path)>;

fn push_mount(m: Value) -> Edit {
    Box::new(move |c: &mut Value, _| c["mounts"].as_array_mut().unwrap().push(m.clone()))
}

fn bind(dest: &str, source: &str, options: &[&str]) -> Edit {
    push_mount(json!({"destination": dest, "type": "bind", "source": source, "options": options}))
}

/// The hostile mount and namespace spellings: (id, edit, what the refusal says).
fn hostile_cases() -> Vec<(&'static str, Edit, &'static str)> {
    vec![
        // The three instances.
        ("ro-then-rw", bind("/cg", "/sys/fs/cgroup/devices", &["bind", "ro", "rw"]), "writable"),
        (
            "proc-self-root",
            bind("/cg", "/proc/self/root/sys/fs/cgroup/devices", &["bind", "ro", "rw"]),
            "under /proc",
        ),
        (
            "rbind-proc-self-root",
            bind("/cg", "/proc/self/root/sys/fs/cgroup", &["rbind", "ro"]),
            "under /proc",
        ),
        // Derived: links, `..`, parents, submounts, sysfs, fresh filesystems.
        (
            "link-in-rootfs",
            Box::new(|c: &mut Value, bundle: &Path| {
                std::os::unix::fs::symlink("/sys/fs/cgroup", bundle.join("rootfs/cglink")).unwrap();
                c["mounts"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!({"destination": "/cg", "type": "bind",
                    "source": "rootfs/cglink/devices", "options": ["bind", "rw"]}));
            }),
            "the kernel resolves it to /sys/fs/cgroup/devices",
        ),
        ("dotdot", bind("/cg", "/sys/fs/cgroup/../cgroup/devices", &["rbind"]), "writable"),
        ("rbind-parent-ro", bind("/cg", "/sys/fs", &["rbind", "ro"]), "`rro` reaches below"),
        ("sysfs-bind", bind("/hostsys", "/sys", &["bind", "nosuid"]), "another tenant's GPU"),
        (
            "sysfs-rro-only",
            push_mount(json!({"destination": "/sys2", "type": "sysfs", "source": "sysfs",
                              "options": ["nosuid", "rro"]})),
            "sysfs that is writable",
        ),
        (
            "cgroup-ro-then-rw",
            push_mount(json!({"destination": "/cg", "type": "cgroup", "source": "cgroup",
                              "options": ["ro", "nosuid", "rw"]})),
            "a cgroup mount that is writable",
        ),
        (
            "cgroup2",
            push_mount(json!({"destination": "/cg", "type": "cgroup2", "source": "none"})),
            "a cgroup2 mount that is writable",
        ),
        // Later mounts that change an earlier one.
        (
            "remount",
            push_mount(json!({"destination": "/sys/fs/cgroup/devices", "type": "bind",
                              "source": "/sys/fs/cgroup/devices",
                              "options": ["bind", "remount", "rw"]})),
            "`remount`",
        ),
        (
            "bind-of-an-earlier-mount",
            Box::new(|c: &mut Value, _| {
                let m = c["mounts"].as_array_mut().unwrap();
                m.push(json!({"destination": "/a", "type": "bind",
                              "source": "/sys/fs/cgroup/devices", "options": ["bind", "ro"]}));
                // `nosuid` makes runc remount the bind, without `ro`: read-write.
                m.push(json!({"destination": "/cg", "type": "bind", "source": "rootfs/a",
                              "options": ["bind", "nosuid", "rw"]}));
            }),
            "is mounted before it",
        ),
        // Propagation: what the host mounts later would reach the container.
        ("rslave", bind("/cg", "/tmp", &["rbind", "rslave", "ro"]), "slave propagation"),
        (
            "root-rshared",
            Box::new(|c: &mut Value, _| c["linux"]["rootfsPropagation"] = json!("rshared")),
            "linux.rootfsPropagation",
        ),
        // Namespaces: the host's mounts or processes.
        (
            "no-mount-ns",
            Box::new(|c: &mut Value, _| {
                c["linux"]["namespaces"].as_array_mut().unwrap().retain(|n| n["type"] != "mount")
            }),
            "no mount namespace of its own",
        ),
        (
            "mount-ns-of-the-host",
            Box::new(|c: &mut Value, _| {
                for n in c["linux"]["namespaces"].as_array_mut().unwrap() {
                    if n["type"] == "mount" {
                        n["path"] = json!("/proc/1/ns/mnt");
                    }
                }
            }),
            "no mount namespace of its own",
        ),
        (
            "host-pid-ns",
            Box::new(|c: &mut Value, _| {
                c["linux"]["namespaces"].as_array_mut().unwrap().retain(|n| n["type"] != "pid")
            }),
            "no pid namespace of its own",
        ),
        (
            "pid-ns-of-the-host",
            Box::new(|c: &mut Value, _| {
                for n in c["linux"]["namespaces"].as_array_mut().unwrap() {
                    if n["type"] == "pid" {
                        n["path"] = json!("/proc/self/ns/pid");
                    }
                }
            }),
            "no pid namespace of its own",
        ),
    ]
}

#[test]
fn a_writable_cgroup_or_sysfs_view_is_refused_however_a_gpu_config_spells_it() {
    let node = Node::start();
    let mut through = Vec::new();
    for (id, edit, says) in hostile_cases() {
        let mut b = node.bundle(id, "team-untrusted", Some("mig=1g.10gb"), &["sh", "-c", ESCAPE]);
        let dir = b.dir().to_path_buf();
        b.mutate(|c| edit(c, &dir)).write();
        let out = node.fx.create_container(&b, id);
        if out.status.success() {
            // What the container could do with it: the devices its cgroup opens afterwards.
            node.fx.start_container(id).assert_success("start");
            std::thread::sleep(Duration::from_millis(500));
            let list = devices_list(&b.cgroups_path());
            let (out, _) = node.fx.container_output(id);
            through.push(format!(
                "{id}: accepted; the container said {out:?}; its cgroup's devices.list: {list:?}"
            ));
            let _ = node.fx.delete_container(id, true);
            continue;
        }
        let err = out.stderr_str();
        if !(err.contains(says) && err.contains(&format!("container {id}"))) {
            through.push(format!("{id}: refused, but not saying `{says}`: {err}"));
        }
        assert!(err.len() < 4200, "{id}: bounded: {err}");
    }
    assert!(through.is_empty(), "{}", through.join("\n"));
    // Nothing was granted for any of them.
    assert_eq!(node.grants(), vec![]);
    // Docker's and containerd's defaults still start: a read-only cgroup mount and sysfs,
    // and read-only binds of cgroup dirs (rro all the way down).
    let mut b = node.bundle("default", "team-untrusted", Some("mig=1g.10gb"), &["sleep", "30"]);
    b.mutate(|c| {
        c["mounts"].as_array_mut().unwrap().push(json!({"destination": "/cgro", "type": "bind",
            "source": "/sys/fs/cgroup", "options": ["rbind", "rro", "rprivate"]}))
    })
    .write();
    node.fx.run_detached(&b, "default");
    node.fx.delete_container("default", true).assert_success("delete");
}

/// The last word is the kernel's: a mount made after the config was judged — here by a
/// prestart hook the engine runs before Tessera's (a bind of the host's devices cgroup into
/// the rootfs) — is seen in the container's mount table when tesserad confirms the
/// container, and the start is refused there: after `runc create` returned (the wrapper
/// confirms, on the root runc finished) and at the prestart hook of a `runc run`.
#[test]
fn what_runc_and_the_hooks_before_tessera_made_is_judged_before_the_container_runs() {
    let node = Node::start();
    let hook = node.fx.path("mount-hook.sh");
    fs::write(
        &hook,
        "#!/bin/sh\n\
         pid=$(sed -n 's/.*\"pid\":\\([0-9]*\\).*/\\1/p')\n\
         root=$(cat \"$0.root\")\n\
         exec nsenter -t \"$pid\" -m mount --bind /sys/fs/cgroup/devices \"$root/cg\"\n",
    )
    .unwrap();
    fs::set_permissions(&hook, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    for verb in ["create", "run"] {
        let id = format!("late-{verb}");
        let mut b = node.bundle(&id, "team-untrusted", Some("mig=1g.10gb"), &["sh", "-c", ESCAPE]);
        fs::create_dir_all(b.rootfs().join("cg")).unwrap();
        fs::write(node.fx.path("mount-hook.sh.root"), b.rootfs().display().to_string()).unwrap();
        b.hook("prestart", hook.to_str().unwrap(), &["mount-hook"], &[]).write();
        // A created container is confirmed at its start, before runc's.
        let out = match verb {
            "create" => {
                node.fx.create_container(&b, &id).assert_success("create");
                node.fx.start_container(&id)
            }
            _ => node.fx.run_container(&b, &id),
        };
        let accepted = out.status.success();
        let mut list = String::new();
        if accepted {
            std::thread::sleep(Duration::from_millis(500));
            list = devices_list(&b.cgroups_path());
            let _ = node.fx.delete_container(&id, true);
        }
        assert!(!accepted, "{verb}: accepted; devices.list afterwards: {list}");
        let err = out.stderr_str();
        assert!(
            err.contains("its mounts as runc made them: /cg is a writable cgroup hierarchy"),
            "{verb}: {err}"
        );
        // Nothing of it is left: runc has no record, and the grant is given back at once.
        assert!(node.fx.state(&id).is_none(), "{verb}: runc still has {id}");
        assert!(
            wait_for(|| node.grants().is_empty(), Duration::from_secs(10)),
            "{verb}: {:?}",
            node.grants()
        );
    }
    let events = String::from_utf8_lossy(&node.cli(&["status"]).stdout).to_string();
    assert!(events.contains("isolation"), "{events}");
}

/// A process in the cgroup of a GPU grant keeps that grant's device rules: no container is
/// created into one (or below one), whatever it asks for, and a GPU container does not
/// start in a cgroup another container's process is in.
#[test]
fn a_containers_cgroup_is_its_own() {
    let node = Node::start();
    let gpu = node.bundle("owner", "team-untrusted", Some("gpu=1"), &["sleep", "30"]);
    let cg = gpu.cgroups_path();
    node.fx.run_detached(&gpu, "owner");
    let mut through = Vec::new();
    // No request, GPU request; the same cgroup, one below it, the same spelled with `..`.
    let spellings = [
        ("same", cg.clone(), None),
        ("below", format!("{cg}/child"), None),
        ("dotdot", format!("{cg}/x/.."), Some("mig=1g.10gb")),
        ("same-gpu", cg.clone(), Some("gpu=1")),
    ];
    for (id, path, request) in &spellings {
        let mut b = node.bundle(id, "team-untrusted", *request, &["sleep", "30"]);
        b.set_cgroups_path(path).write();
        let out = node.fx.create_container(&b, id);
        if out.status.success() {
            through.push(format!("{id} ({path}): created"));
            let _ = node.fx.delete_container(id, true);
        } else if !out.stderr_str().contains("the cgroup of a running GPU container") {
            through.push(format!("{id}: {}", out.stderr_str()));
        }
    }
    assert!(through.is_empty(), "{}", through.join("\n"));

    // The other way round: a container without a GPU runs in a cgroup; a GPU container
    // asking for the same cgroup is refused before runc makes it. runc would write the
    // GPU's device rules into that cgroup, for the other container's processes (one with
    // CAP_MKNOD makes the node and opens the GPU), and they would stay there after the
    // grant ends: runc's delete cannot remove a cgroup in use. (tesserad's confirmation at
    // the start refuses it too, once the rules are there, and then keeps the grant while a
    // process is in the cgroup: for one that joins between this check and runc's create,
    // `hostile_runtime::a_created_gpu_container_refused_at_its_start_never_runs_and_is_undone`.)
    let plain = node.bundle("plain", "team-untrusted", None, &["sleep", "30"]);
    let shared = plain.cgroups_path();
    node.fx.run_detached(&plain, "plain");
    let before = devices_list(&shared);
    let mut b = node.bundle("joiner", "team-untrusted", Some("gpu=1"), &["sleep", "30"]);
    b.set_cgroups_path(&shared).write();
    let out = node.fx.create_container(&b, "joiner");
    let created = out.status.success();
    if created {
        let _ = node.fx.start_container("joiner");
        let _ = node.fx.delete_container("joiner", true);
    }
    let after = devices_list(&shared);
    assert_eq!(after, before, "the other container's cgroup got the GPU's device rules");
    assert!(!created, "a GPU container was created in a cgroup another container runs in");
    assert!(out.stderr_str().contains("which already holds 1 process(es)"), "{}", out.stderr_str());
    assert!(wait_for(|| node.grants().len() == 1, Duration::from_secs(10)), "{:?}", node.grants());
    for id in ["owner", "plain"] {
        node.fx.delete_container(id, true).assert_success("delete");
    }
}

fn events_of(node: &Node, id: &str, kind: &str) -> Vec<String> {
    node.client()
        .status()
        .unwrap()
        .events
        .into_iter()
        .filter(|e| e.container_id.as_deref() == Some(id) && e.kind == kind)
        .map(|e| e.detail)
        .collect()
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

/// A container runc put into a running GPU container's cgroup anyway (plain runc here,
/// bypassing the wrapper, as a race between two creates could) is killed by the next
/// reconciler pass: a process of another pid namespace has no business there.
#[test]
fn a_process_of_another_container_in_a_grants_cgroup_is_killed() {
    let node = Node::start();
    let owner = node.bundle("owner", "team-untrusted", Some("gpu=1"), &["sleep", "30"]);
    let cg = owner.cgroups_path();
    node.fx.run_detached(&owner, "owner");
    let plain = Fixture::with_runtime(RUNC, &[]);
    let mut b = plain.bundle("intruder");
    b.args(&["sleep", "30"]).set_cgroups_path(&cg).write();
    // Created is enough: runc's init for it is in the cgroup, in its own pid namespace
    // (the reconciler may kill it before a start could run).
    // The reconciler may kill runc's init for it before runc's create even returns (runc
    // then reports the create failed): either way it must not live on in the cgroup.
    let _ = plain.create_container(&b, "intruder");
    assert!(
        wait_for(
            || !events_of(&node, "owner", "cgroup-intruder").is_empty(),
            Duration::from_secs(10)
        ),
        "no cgroup-intruder event"
    );
    let detail = events_of(&node, "owner", "cgroup-intruder").remove(0);
    assert!(detail.contains("killed"), "{detail}");
    let pid: i32 = detail
        .strip_prefix("pid ")
        .and_then(|r| r.split(' ').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no pid in {detail}"));
    assert!(wait_for(|| !pid_alive(pid, None), Duration::from_secs(5)), "intruder alive");
    assert_ne!(plain.status("intruder").as_deref(), Some("running"), "the intruder's runc init");
    assert_ne!(plain.status("intruder").as_deref(), Some("created"), "the intruder's runc init");
    // The owner is untouched.
    assert!(node.client().allocation("owner").is_ok());
    assert!(node.fx.container_pid("owner").is_some(), "the owner still runs");
    let _ = plain.delete_container("intruder", true);
    node.fx.delete_container("owner", true).assert_success("delete");
}

/// The instance: a container in a GPU container's cgroup kept the GPU's device rule
/// after the GPU container was deleted, and the GPU was scrubbed and granted to another
/// tenant meanwhile. A process left in a grant's cgroup (here one runc put there directly
/// after the owner's init exited) now keeps the grant: the release after the owner's
/// delete is refused, and the grant ends only once the cgroup is empty.
#[test]
fn a_grant_outlives_its_container_while_another_process_holds_its_cgroup() {
    let node = Node::start();
    let mut owner = node.bundle("owner", "team-untrusted", Some("gpu=1"), &["true"]);
    let cg = owner.cgroups_path();
    owner.write();
    node.fx.create_container(&owner, "owner").assert_success("create");
    node.fx.start_container("owner").assert_success("start");
    let plain = Fixture::with_runtime(RUNC, &[]);
    let mut b = plain.bundle("intruder");
    b.args(&["sleep", "30"]).set_cgroups_path(&cg).write();
    // The owner's init has exited (its container is stopped, not deleted): no pid
    // namespace to tell an intruder by, and the device rules stay in the cgroup.
    assert!(wait_for(|| node.fx.container_pid("owner").is_none(), Duration::from_secs(10)));
    plain.run_detached(&b, "intruder");
    let _ = node.fx.delete_container("owner", true);
    assert!(
        wait_for(
            || !events_of(&node, "owner", "release-refused").is_empty(),
            Duration::from_secs(10)
        ),
        "the release was not refused"
    );
    let refused = events_of(&node, "owner", "release-refused").remove(0);
    assert!(refused.contains("still holds 1 process(es)"), "{refused}");
    reconcile_passes(&node, 3);
    assert!(node.client().allocation("owner").is_ok(), "the grant ended with the intruder in it");
    plain.delete_container("intruder", true).assert_success("delete intruder");
    assert!(
        wait_for(|| node.client().allocation("owner").is_err(), Duration::from_secs(10)),
        "the grant did not end once its cgroup was empty"
    );
}
