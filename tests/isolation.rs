//! Issue 11, class 1 end to end: the wrapper and runc agree on what a config.json says.
//! tesserad on the simulated 8×H100 node, tessera-runtime and real runc. Each test is an
//! instance the hostile corpus found, with variants; what runc wrote (devices.list, the
//! container's /dev, the host directories) is read back, not what Tessera meant to write.

// Integration-test crates: clippy counts their helper functions as non-test code, so
// `allow-unwrap-in-tests` (clippy.toml) does not reach them; a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;

use serde_json::{json, Value};
use tessera_harness::node::*;
use tessera_harness::*;

/// `c MAJOR:MINOR` entries of a devices.list with read or write access, for these majors
/// (a `*` major counts for every major; `a *:* rwm` is returned as (-1, -1)).
fn opened(devices_list: &str, majors: &[i64]) -> BTreeSet<(i64, i64)> {
    devices_list
        .lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let (kind, nums, access) = (it.next()?, it.next()?, it.next()?);
            let (ma, mi) = nums.split_once(':')?;
            let n = |s: &str| if s == "*" { -1 } else { s.parse().unwrap_or(-2) };
            let opens = access.contains('r') || access.contains('w');
            let gpu = kind == "a" || (kind == "c" && (ma == "*" || majors.contains(&n(ma))));
            (opens && gpu).then(|| (n(ma), n(mi)))
        })
        .collect()
}

/// The config as JSON text with `extra` members appended to the top-level object (or, with
/// `inside = Some("linux")`, to that member), so duplicates and order reach runc as written.
fn raw_config(config: &Value, inside: Option<&str>, extra: &str) -> String {
    match inside {
        None => {
            let mut s = serde_json::to_string(config).unwrap();
            assert_eq!(s.pop(), Some('}'));
            format!("{s},{extra}}}")
        }
        Some(key) => {
            let mut top = config.as_object().unwrap().clone();
            let inner = top.remove(key).unwrap();
            let mut s = serde_json::to_string(&inner).unwrap();
            assert_eq!(s.pop(), Some('}'));
            let mut head = serde_json::to_string(&Value::Object(top)).unwrap();
            assert_eq!(head.pop(), Some('}'));
            format!("{head},{:?}:{s},{extra}}}}}", key)
        }
    }
}

const SIM_MAJORS: [i64; 3] = [195, 508, 509];

#[test]
fn wildcard_and_allow_all_device_rules_are_refused_in_an_untrusted_mig_container() {
    let node = Node::start();
    let rules = [
        // Docker's `--device-cgroup-rule 'c *:* rwm'` writes -1 for `*`.
        json!({"allow": true, "type": "c", "major": -1, "minor": -1, "access": "rwm"}),
        json!({"allow": true, "type": "c", "access": "rw"}),
        json!({"allow": true, "type": "c", "major": -1, "minor": 5, "access": "r"}),
        // An allow rule of type `a` is allow-all whatever its numbers; so is an untyped one.
        json!({"allow": true, "type": "a", "major": 195, "minor": 0, "access": "r"}),
        json!({"allow": true, "type": "a", "major": -1, "minor": -1, "access": "rwm"}),
        json!({"allow": true, "major": 195, "minor": 3, "access": "rw"}),
    ];
    for (i, rule) in rules.iter().enumerate() {
        let id = format!("wild{i}");
        let mut b = node.bundle(&id, "team-untrusted", Some("mig=1g.10gb"), &["sleep", "30"]);
        b.mutate(|c| c["linux"]["resources"]["devices"].as_array_mut().unwrap().push(rule.clone()))
            .write();
        let out = node.fx.create_container(&b, &id);
        assert!(!out.status.success(), "{rule}: started with {}", devices_list(&b.cgroups_path()));
        let err = out.stderr_str();
        assert!(
            err.contains("linux.resources.devices[1]"),
            "{rule}: the error names the rule: {err}"
        );
        assert!(node.fx.state(&id).is_none(), "{rule}: runc must not have run");
    }
    assert!(node.client().status().unwrap().allocations.is_empty(), "refused before any grant");

    // Control: the same container without the rule gets exactly its instance.
    let b = node.bundle("ok", "team-untrusted", Some("mig=1g.10gb"), &["sleep", "30"]);
    node.fx.run_detached(&b, "ok");
    let a = node.client().allocation("ok").unwrap();
    let want: BTreeSet<(i64, i64)> =
        a.injection.devices.iter().map(|d| (d.major, d.minor)).collect();
    assert_eq!(opened(&devices_list(&b.cgroups_path()), &SIM_MAJORS), want);
    node.fx.delete_container("ok", true).assert_success("delete");
}

#[test]
fn keys_runc_folds_or_repeats_are_refused_for_every_container() {
    let node = Node::start();
    let grab = json!({"resources": {"devices": [
        {"allow": true, "type": "c", "major": 195, "minor": 3, "access": "rw"}
    ]}});
    // (name, request, where, what): every one of these is read by runc as a field that an
    // exact reading does not see, and would give the container /dev/nvidia3 or drop
    // Tessera's hook.
    let cases: Vec<(&str, Option<&str>, Option<&str>, String)> = vec![
        ("linux-upper", Some("mig=1g.10gb"), None, format!("\"Linux\":{grab}")),
        ("linux-caps", Some("mig=1g.10gb"), None, format!("\"LINUX\":{grab}")),
        (
            "resources-long-s",
            Some("mig=1g.10gb"),
            Some("linux"),
            format!("\"reſources\":{}", grab["resources"]),
        ),
        ("hooks-long-s", Some("mig=1g.10gb"), None, "\"hookſ\":{\"prestart\":[]}".into()),
        ("linux-duplicate", Some("mig=1g.10gb"), None, format!("\"linux\":{grab}")),
        (
            "annotations-duplicate",
            Some("mig=1g.10gb"),
            None,
            "\"annotations\":{\"tessera.io/gpu\":\"gpu=8\"}".into(),
        ),
        // No GPU request at all: the key rules hold for every container.
        ("nogpu-linux-upper", None, None, format!("\"Linux\":{grab}")),
    ];
    for (id, request, inside, extra) in cases {
        let b = node.bundle(id, "team-untrusted", request, &["sleep", "30"]);
        std::fs::write(b.config_path(), raw_config(b.config(), inside, &extra)).unwrap();
        let out = node.fx.create_container(&b, id);
        assert!(!out.status.success(), "{id}: started with {}", devices_list(&b.cgroups_path()));
        let err = out.stderr_str();
        assert!(
            err.contains("runc reads it as") || err.contains("duplicate key"),
            "{id}: the error says why: {err}"
        );
        assert_eq!(err.lines().count(), 1, "{id}: one line: {err}");
        assert!(node.fx.state(id).is_none(), "{id}: runc must not have run");
    }
    assert!(node.client().status().unwrap().allocations.is_empty(), "refused before any grant");
}

#[test]
fn a_folded_root_cannot_bypass_the_hostile_rootfs_check() {
    let node = Node::start();
    let host_dev = node.fx.path("host-dev");
    std::fs::create_dir_all(&host_dev).unwrap();
    for (id, request) in [("root-gpu", Some("mig=1g.10gb")), ("root-nogpu", None)] {
        let b = node.bundle(id, "team-untrusted", request, &["true"]);
        // A second rootfs whose /dev leads to a host directory, named only by `Root`.
        let evil = b.dir().join("evil");
        Rootfs::busybox(&evil);
        std::fs::remove_dir_all(evil.join("dev")).unwrap();
        std::os::unix::fs::symlink(&host_dev, evil.join("dev")).unwrap();
        let mut c = b.config().clone();
        c.as_object_mut().unwrap().remove("root");
        let raw = raw_config(
            &c,
            None,
            &format!("\"Root\":{{\"path\":{:?}}}", evil.display().to_string()),
        );
        std::fs::write(b.config_path(), raw).unwrap();
        let out = node.fx.run_container(&b, id);
        assert!(!out.status.success(), "{id}: ran");
        assert!(out.stderr_str().contains("`Root`"), "{id}: names the key: {}", out.stderr_str());
        assert_eq!(
            std::fs::read_dir(&host_dev).unwrap().count(),
            0,
            "{id}: runc wrote into the host dir"
        );
        let _ = node.fx.delete_container(id, true);
    }
}

#[test]
fn device_numbers_the_kernel_would_read_differently_are_refused() {
    let node = Node::start();
    // mknod keeps 12 bits of a major: 4291 makes a node of major 195. A 64-bit major is
    // narrowed to 32 bits by the cgroup v2 filter (195 again) and refused by cgroup v1.
    let cases = [
        (
            "node-4291",
            json!({"devices": [{"path": "/dev/gpu9", "type": "c", "major": 4291, "minor": 9}]}),
        ),
        (
            "rule-2p32",
            json!({"resources": {"devices": [{"allow": true, "type": "c", "major": 4_294_967_491_i64, "minor": 9, "access": "rw"}]}}),
        ),
        (
            "node-neg",
            json!({"devices": [{"path": "/dev/gpu9", "type": "c", "major": -1, "minor": 9}]}),
        ),
    ];
    for (id, linux_extra) in cases {
        let mut b = node.bundle(id, "team-untrusted", Some("mig=1g.10gb"), &["sleep", "30"]);
        b.mutate(|c| {
            for (k, v) in linux_extra.as_object().unwrap() {
                if k == "resources" {
                    c["linux"]["resources"]["devices"]
                        .as_array_mut()
                        .unwrap()
                        .extend(v["devices"].as_array().unwrap().clone());
                } else {
                    c["linux"][k] = v.clone();
                }
            }
        })
        .write();
        let out = node.fx.create_container(&b, id);
        assert!(!out.status.success(), "{id}: started");
        assert!(
            out.stderr_str().contains("outside the kernel's range"),
            "{id}: {}",
            out.stderr_str()
        );
        assert!(node.fx.state(id).is_none());
    }
    assert!(node.client().status().unwrap().allocations.is_empty());
}

#[test]
fn every_nvidia_major_is_stripped_whatever_the_grant() {
    let node = Node::start();
    // A whole-GPU grant has no capability nodes, but the caps major is still the driver's:
    // a smuggled caps node and its allow rule must not survive (nor uvm, nor 195).
    let mut b = node.bundle("whole", "team-untrusted", Some("gpu=1"), &["sleep", "30"]);
    b.device("/dev/smuggled-cap", 'c', 509, 1)
        .allow_device('c', Some(509), Some(1), "rw")
        .device("/dev/smuggled-uvm", 'c', 508, 0)
        .allow_device('c', Some(508), None, "rw")
        .device("/dev/other-gpu", 'c', 195, 7)
        .allow_device('c', Some(195), Some(7), "rwm")
        .write();
    node.fx.run_detached(&b, "whole");
    let a = node.client().allocation("whole").unwrap();
    let want: BTreeSet<(i64, i64)> =
        a.injection.devices.iter().map(|d| (d.major, d.minor)).collect();
    assert!(want.iter().all(|(ma, _)| *ma != 509), "a whole GPU needs no caps: {want:?}");
    assert_eq!(
        opened(&devices_list(&b.cgroups_path()), &SIM_MAJORS),
        want,
        "only the grant's nodes open"
    );
    let ls = node.fx.exec("whole", &["sh", "-c", "ls /dev"]);
    for smuggled in ["smuggled-cap", "smuggled-uvm", "other-gpu"] {
        assert!(!ls.stdout_str().contains(smuggled), "{smuggled} was created: {}", ls.stdout_str());
    }
    node.fx.delete_container("whole", true).assert_success("delete");
}

/// runc takes `filepath.Join(bundle, root.path)`: `..` is removed lexically (the kernel would
/// resolve it through a missing or linked component), and an empty path is the bundle
/// itself. A root whose `/dev` leads to a host directory must be refused either way.
/// (Found by the attack helper: `nonexistent/../evil` and `"root": {}`.)
#[test]
fn root_paths_are_read_as_runc_joins_them() {
    let node = Node::start();
    let host_dev = node.fx.path("host-dev");
    std::fs::create_dir_all(&host_dev).unwrap();
    let cases: [(&str, Option<&str>, Value); 5] = [
        ("dotdot-gpu", Some("mig=1g.10gb"), json!({"path": "nonexistent/../evil"})),
        ("dotdot-nogpu", None, json!({"path": "nonexistent/../evil"})),
        ("dotdot-image", Some("mig=1g.10gb"), json!({"path": "x/../evil"})),
        ("root-null", Some("mig=1g.10gb"), json!({"path": null})),
        ("root-empty", None, json!({})),
    ];
    for (id, request, root) in cases {
        let mut b = node.bundle(id, "team-untrusted", request, &["true"]);
        // <bundle>/evil and <bundle> itself both have a /dev leading to the host dir.
        let evil = b.dir().join("evil");
        Rootfs::busybox(&evil);
        for dir in [evil.clone(), b.dir().to_path_buf()] {
            let _ = std::fs::remove_dir_all(dir.join("dev"));
            std::os::unix::fs::symlink(&host_dev, dir.join("dev")).unwrap();
        }
        b.mutate(|c| c["root"] = root.clone()).write();
        let out = node.fx.run_container(&b, id);
        let written: Vec<_> =
            std::fs::read_dir(&host_dev).unwrap().map(|e| e.unwrap().file_name()).collect();
        let _ = node.fx.delete_container(id, true);
        assert!(written.is_empty(), "{id}: runc wrote into the host dir: {written:?}");
        assert!(!out.status.success(), "{id}: ran");
        assert!(
            out.stderr_str().contains("root.path"),
            "{id}: names root.path: {}",
            out.stderr_str()
        );
    }
    assert!(node.client().status().unwrap().allocations.is_empty());
}

/// A GPU container that can change its own devices cgroup after runc set it makes the
/// checked rules meaningless: CAP_SYS_ADMIN mounts the hierarchy and writes
/// devices.allow (found by the attack helper), and a writable bind of the host's
/// /sys/fs/cgroup lets it move itself into a parent's cgroup.procs.
#[test]
fn a_gpu_container_that_could_rewrite_its_device_cgroup_is_refused() {
    let node = Node::start();
    let sys_admin = |sets: &[&str]| {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        move |c: &mut Value| {
            let caps =
                json!(["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE", "CAP_SYS_ADMIN"]);
            for set in &sets {
                c["process"]["capabilities"][set] = caps.clone();
            }
        }
    };
    type Edit = Box<dyn Fn(&mut Value)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        ("sysadmin", Box::new(sys_admin(&["bounding", "effective", "permitted"])), "CAP_SYS_ADMIN"),
        ("sysadmin-ambient", Box::new(sys_admin(&["ambient"])), "CAP_SYS_ADMIN"),
        (
            "hostcg-rbind",
            Box::new(|c: &mut Value| {
                c["mounts"].as_array_mut().unwrap().push(json!({"destination": "/hostcg", "type": "bind", "source": "/sys/fs/cgroup", "options": ["rbind", "rw"]}))
            }),
            "an rbind of /sys/fs/cgroup brings",
        ),
        (
            "hostsys-rbind-ro",
            Box::new(|c: &mut Value| {
                c["mounts"].as_array_mut().unwrap().push(json!({"destination": "/hostsys", "type": "bind", "source": "/sys", "options": ["rbind", "ro"]}))
            }),
            "an rbind of /sys brings",
        ),
        (
            "cgroup-rw",
            Box::new(|c: &mut Value| {
                for m in c["mounts"].as_array_mut().unwrap() {
                    if m["type"] == "cgroup" {
                        m["options"] = json!(["nosuid", "noexec", "nodev", "relatime", "rw"]);
                    }
                }
            }),
            "cgroup mount",
        ),
    ];
    for (id, edit, what) in cases {
        let mut b = node.bundle(id, "team-untrusted", Some("mig=1g.10gb"), &["sleep", "30"]);
        let cg = b.cgroups_path();
        // What the container would do with it.
        let script = format!(
            "mkdir -p /mnt/cg && mount -t cgroup -o devices none /mnt/cg && echo 'c 195:* rw' > /mnt/cg{cg}/devices.allow; \
             [ -d /hostcg/devices ] && echo $$ > /hostcg/devices/cgroup.procs; sleep 30"
        );
        b.args(&["sh", "-c", &script]).mutate(|c| edit(c)).write();
        let out = node.fx.create_container(&b, id);
        let mut list = String::new();
        if out.status.success() {
            node.fx.start_container(id).assert_success("start");
            std::thread::sleep(std::time::Duration::from_millis(1500));
            list = devices_list(&cg);
        }
        let _ = node.fx.delete_container(id, true);
        assert!(!out.status.success(), "{id}: accepted; devices.list afterwards:\n{list}");
        assert!(
            out.stderr_str().contains(what)
                && out.stderr_str().contains("rewrite its own device rules"),
            "{id}: {}",
            out.stderr_str()
        );
    }
    // A read-only cgroup mount, and no CAP_SYS_ADMIN, is the default and starts.
    let b = node.bundle("default", "team-untrusted", Some("mig=1g.10gb"), &["sleep", "30"]);
    node.fx.run_detached(&b, "default");
    node.fx.delete_container("default", true).assert_success("delete");
}

/// No grant, no GPU (found by the attack helper): a container that asks for no GPU but lists
/// another tenant's GPU node and an allow rule for it (and for nvidia-uvm) opened it: runc
/// got the config untouched. The wrapper now removes every node and allow rule of the
/// node's NVIDIA majors from such a container (the majors from tesserad's file beside its
/// socket: the daemon is never asked) and refuses a character rule of any major.
#[test]
fn a_container_without_a_request_gets_no_gpu() {
    let node = Node::start();
    let victim = node.bundle("victim", "team-untrusted", Some("gpu=1"), &["sleep", "30"]);
    node.fx.run_detached(&victim, "victim");
    let a = node.client().allocation("victim").unwrap();
    let gpu = a.injection.devices.iter().find(|d| d.major == 195 && d.minor < 255).unwrap().clone();

    let mut b = node.bundle("thief", "team-untrusted", None, &["sleep", "30"]);
    b.device("/dev/stolen", 'c', 195, gpu.minor)
        .allow_device('c', Some(195), Some(gpu.minor), "rw")
        .device("/dev/stolen-uvm", 'c', 508, 0)
        .allow_device('c', Some(508), None, "rw")
        .device("/dev/stolen-cap", 'c', 509, 1)
        .allow_device('c', Some(509), Some(1), "rw")
        .write();
    node.fx.run_detached(&b, "thief");
    let list = devices_list(&b.cgroups_path());
    assert!(opened(&list, &SIM_MAJORS).is_empty(), "the thief opens GPU nodes:\n{list}");
    let ls = node.fx.exec("thief", &["sh", "-c", "ls /dev"]).stdout_str();
    assert!(!ls.contains("stolen"), "smuggled nodes were created: {ls}");
    // Docker's `--device-cgroup-rule 'c *:* rwm'` without a GPU request is refused.
    let mut w = node.bundle("wild", "team-untrusted", None, &["true"]);
    w.allow_device('c', Some(-1), Some(-1), "rwm").write();
    let out = node.fx.create_container(&w, "wild");
    assert!(!out.status.success(), "started with {}", devices_list(&w.cgroups_path()));
    assert!(out.stderr_str().contains("asked for no GPU"), "{}", out.stderr_str());
    // A plain container is left exactly as it was by a create; a run gets one prestart
    // hook, tessera-hook's plain-prestart (what runc made is judged there), and nothing else.
    let plain = node.bundle("plain", "team-untrusted", None, &["true"]);
    let before = std::fs::read(plain.config_path()).unwrap();
    node.fx.create_container(&plain, "plain").assert_success("plain create");
    node.fx.delete_container("plain", true).assert_success("delete");
    assert_eq!(std::fs::read(plain.config_path()).unwrap(), before, "config rewritten");
    node.fx.run_container(&plain, "plain").assert_success("plain run");
    let mut after: serde_json::Value =
        serde_json::from_slice(&std::fs::read(plain.config_path()).unwrap()).unwrap();
    let hooks = after["hooks"]["prestart"].as_array().cloned().unwrap_or_default();
    assert_eq!(hooks.len(), 1, "{hooks:?}");
    assert_eq!(hooks[0]["args"], serde_json::json!(["tessera-hook", "plain-prestart"]));
    after.as_object_mut().unwrap().remove("hooks");
    let before: serde_json::Value = serde_json::from_slice(&before).unwrap();
    assert_eq!(after, before, "a run's config changed beyond its prestart hook");
    for id in ["thief", "victim"] {
        node.fx.delete_container(id, true).assert_success("delete");
    }
}

#[test]
fn nvidia_toolkit_hooks_never_run_in_a_tessera_container() {
    // The NVIDIA toolkit's hooks.d entry (podman, CRI-O) mounts devices and writes the
    // devices cgroup itself, after every check of Tessera's: refused, GPU or not, whatever
    // it is called on this host.
    let node = Node::start();
    let dir = node.fx.path("nvidia-hooks");
    std::fs::create_dir_all(&dir).unwrap();
    let marker = dir.join("ran");
    let toolkit = dir.join("nvidia-container-toolkit");
    std::fs::write(&toolkit, format!("#!/bin/sh\ntouch {}\n", marker.display())).unwrap();
    std::fs::set_permissions(&toolkit, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .unwrap();
    let alias = dir.join("innocent-hook");
    std::os::unix::fs::symlink(&toolkit, &alias).unwrap();
    for (id, hook, request) in [
        ("tk-plain", &toolkit, None),
        ("tk-gpu", &toolkit, Some("gpu=1")),
        ("tk-alias", &alias, None),
    ] {
        let mut b = node.bundle(id, "team-trusted", request, &["true"]);
        let path = hook.to_str().unwrap();
        b.hook("prestart", path, &[path, "prestart"], &[]).write();
        let out = node.fx.run_container(&b, id);
        out.assert_failure("a config with NVIDIA's hook");
        assert!(out.stderr_str().contains("is NVIDIA's"), "{id}: {}", out.stderr_str());
    }
    assert!(!marker.exists(), "the toolkit hook ran");
    assert!(node.client().status().unwrap().allocations.is_empty());
}

#[test]
fn an_engine_annotation_in_a_config_is_refused_with_or_without_a_request() {
    // `tessera.io/engine` is what tessera-runtime's root-owned configuration says, never
    // what a config author writes.
    let node = Node::start();
    for (id, request) in [("eng-plain", None), ("eng-gpu", Some("gpu=1"))] {
        let mut b = node.bundle(id, "team-trusted", request, &["true"]);
        b.annotation("tessera.io/engine", "docker-alice").write();
        let out = node.fx.run_container(&b, id);
        out.assert_failure("a forged engine");
        assert!(out.stderr_str().contains("tessera.io/engine"), "{id}: {}", out.stderr_str());
    }
}
