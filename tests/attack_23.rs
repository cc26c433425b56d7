//! Red-team round on issue 23 (mounts, cgroups, limits, kubelet's word, output), run the
//! way the hostile-input corpus runs: tesserad on the simulated 8×H100 node, tessera-runtime
//! and tessera-hook as built, real runc 1.1 and the kernel. Every case reads back what the
//! kernel did (`/proc/<pid>/cgroup`, the cgroup's limit files, `cpuacct.usage`, whether a
//! GPU node opens) rather than what Tessera meant.
//!
//! How "opens a GPU" is told without a driver: an image may carry device nodes of its own
//! (`/g0`..`/g7`, `c 195:N`, made on the host like any file of a layer; no `CAP_MKNOD`
//! needed). Opening one is refused by the devices cgroup with `EPERM` ("Operation not
//! permitted"); when the cgroup allows it, the open reaches the (absent) driver and fails
//! with `ENXIO` instead — on a real node it would succeed. A GPU container legitimately
//! opens exactly its one granted GPU; a container without a request opens none.
//!
//! A test that fails here is an attack that got through on the code it ran against (the
//! assertion message carries the evidence); each would pass once its class is closed.
//! The passing tests record defences that held.

// Integration-test crates: clippy counts helper functions as non-test code, so
// `allow-unwrap-in-tests` (clippy.toml) does not reach them; a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tessera_harness::node::*;
use tessera_harness::*;

/// Opens every GPU node of the image; prints `OPENED /gN` for each the devices cgroup let
/// through (anything but EPERM).
const OPEN_PROBE: &str = "for d in /g0 /g1 /g2 /g3 /g4 /g5 /g6 /g7; do \
                            e=$( (exec 3<\"$d\") 2>&1 ); \
                            case $e in *'not permitted'*) ;; *) echo \"OPENED $d\";; esac; \
                          done";

/// What a hostile image carries: a node for each of the eight GPUs (`/gN`, `c 195:N`).
fn gpu_nodes_in_image(rootfs: &Path) {
    for n in 0..8 {
        let p = rootfs.join(format!("g{n}"));
        if p.exists() {
            continue;
        }
        run_cmd(Command::new("mknod").arg(&p).args(["c", "195", &n.to_string()]))
            .assert_success("mknod in the image");
    }
}

/// How many GPUs the probe's output says were opened.
fn opened(out: &str) -> usize {
    out.lines().filter(|l| l.starts_with("OPENED ")).count()
}

/// The default capabilities of `runc spec`, plus `extra`.
fn caps_with(extra: &[&str]) -> Value {
    let mut caps = vec!["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE"];
    caps.extend_from_slice(extra);
    json!({"bounding": caps, "effective": caps, "permitted": caps})
}

/// Waits until the container's stdout (as [`Fixture::create_container`] captured it) holds
/// `marker`, and returns it.
fn wait_output(fx: &Fixture, id: &str, marker: &str) -> String {
    let mut out = String::new();
    wait_for(
        || {
            out = fx.container_output(id).0;
            out.contains(marker)
        },
        Duration::from_secs(20),
    );
    out
}

/// The example policy with CPU and memory quotas on `acme/dev` (namespace `team-dev`), as
/// tests/quotas.rs writes it: guarantee a quarter core and 2 GiB, ceiling 1.5 cores and
/// 8 GiB. Where a chain bounds CPU or memory, tesserad checks at prestart that the kernel
/// gives no more than was admitted.
fn node_with_cpu_and_memory_quotas() -> (Fixture, Node) {
    let mut p: Value =
        serde_json::from_slice(&fs::read(repo("examples/policy.json")).unwrap()).unwrap();
    p["quotas"] = json!({
        "acme/dev": {
            "gpus": {"H100-80GB": {"guarantee": 4, "ceiling": 12}},
            "cpu_cores": {"guarantee": 0.25, "ceiling": 1.5},
            "memory_gib": {"guarantee": 2, "ceiling": 8}
        }
    });
    let fx = Fixture::new();
    let file = fx.path("limits-policy.json");
    fs::write(&file, serde_json::to_vec_pretty(&p).unwrap()).unwrap();
    let node = Node::start_with(NodeOptions { policy: file, ..Default::default() });
    (fx, node)
}

/// `(cpu.cfs_quota_us, memory.limit_in_bytes)` of the cgroup `cgroups_path` (v1).
fn kernel_limits(cgroups_path: &str) -> (i64, u64) {
    let rel = cgroups_path.trim_start_matches('/');
    let read = |ctl: &str, f: &str| {
        fs::read_to_string(Path::new(CGROUP_ROOT).join(ctl).join(rel).join(f))
            .unwrap()
            .trim()
            .to_string()
    };
    (
        read("cpu", "cpu.cfs_quota_us").parse().unwrap(),
        read("memory", "memory.limit_in_bytes").parse().unwrap(),
    )
}

/// Host device nodes runc binds into a container with a user namespace (it cannot mknod
/// there): `/dev/nvidia0..7`, `nvidiactl`, `nvidia-uvm`, `nvidia-uvm-tools` of the
/// simulated node. Only the missing ones are made, and those are removed at cleanup.
fn host_gpu_nodes(fx: &Fixture) {
    let mut nodes: Vec<(String, u32, u32)> =
        (0..8).map(|n| (format!("/dev/nvidia{n}"), 195, n)).collect();
    nodes.push(("/dev/nvidiactl".into(), 195, 255));
    nodes.push(("/dev/nvidia-uvm".into(), 508, 0));
    nodes.push(("/dev/nvidia-uvm-tools".into(), 508, 1));
    for (path, major, minor) in nodes {
        if Path::new(&path).exists() {
            continue;
        }
        run_cmd(
            Command::new("mknod")
                .args(["-m", "666", &path, "c"])
                .args([major.to_string(), minor.to_string()]),
        )
        .assert_success("mknod on the host");
        fx.cleanup().track_file(&path);
    }
}

// --- class 1 and 2: exec changes what create decided ----------------------------------------

/// A GPU container is refused at create with `CAP_SYS_ADMIN` (it would mount the devices
/// hierarchy and leave its device cgroup). `runc exec --cap CAP_SYS_ADMIN` — and
/// `exec --process` with those capabilities, which is what `docker exec --privileged`
/// sends — gives the exec'd process exactly that, in the container's namespaces and cgroup:
/// tessera-runtime passes both to runc untouched.
///
/// Seen on the code of this round: `--cap: moved, 5:devices:/, opened 8 GPUs`.
#[test]
fn an_exec_cannot_give_a_gpu_container_what_its_create_was_refused() {
    let node = Node::start();
    let mut b = node.bundle("held", "team-untrusted", Some("gpu=1"), &["sleep", "30"]);
    gpu_nodes_in_image(&b.rootfs());
    b.write();
    node.fx.run_detached(&b, "held");
    // Each variant mounts at a directory of its own (the mount stays in the container).
    let escape = |dir: &str| {
        format!(
            "mkdir -p {dir} && mount -t cgroup -o devices cgroup {dir} && \
             echo $$ > {dir}/cgroup.procs && echo moved; grep devices /proc/self/cgroup; \
             {OPEN_PROBE}"
        )
    };
    // The container's own process opens its one GPU.
    let own = node.fx.exec("held", &["sh", "-c", OPEN_PROBE]);
    assert_eq!(opened(&own.stdout_str()), 1, "baseline: {}", own.stdout_str());

    let mut through = Vec::new();
    let out = node
        .fx
        .runc(&["exec", "--cap", "CAP_SYS_ADMIN", "held", "sh", "-c", &escape("/tmp/m1")], &[]);
    if opened(&out.stdout_str()) > 1 {
        through.push(format!("exec --cap CAP_SYS_ADMIN: {:?}", out.stdout_str()));
    }
    let all = caps_with(&["CAP_SYS_ADMIN", "CAP_SYS_PTRACE", "CAP_NET_ADMIN"]);
    let process = json!({
        "terminal": false, "user": {"uid": 0, "gid": 0}, "cwd": "/",
        "args": ["sh", "-c", escape("/tmp/m2")], "env": [DEFAULT_PATH_ENV],
        "capabilities": all, "noNewPrivileges": false
    });
    let file = node.fx.path("privileged-exec.json");
    fs::write(&file, serde_json::to_vec(&process).unwrap()).unwrap();
    let out = node.fx.runc(&["exec", "--process", file.to_str().unwrap(), "held"], &[]);
    if opened(&out.stdout_str()) > 1 {
        through.push(format!("exec --process (docker exec --privileged): {:?}", out.stdout_str()));
    }
    // Go's flag package (runc's, through urfave/cli) reads a long flag with one dash too:
    // `-cap X` is `--cap X`, `-process=F` is `--process F`.
    let out = node
        .fx
        .runc(&["exec", "-cap", "CAP_SYS_ADMIN", "held", "sh", "-c", &escape("/tmp/m3")], &[]);
    if opened(&out.stdout_str()) > 1 {
        through.push(format!("exec -cap CAP_SYS_ADMIN: {:?}", out.stdout_str()));
    }
    // A `-h` after the id is the exec'd command's (runc's exec does not reorder), not help.
    let out = node.fx.runc(
        &["exec", "--cap", "CAP_SYS_ADMIN", "held", "sh", "-c", &escape("/tmp/m5"), "-h"],
        &[],
    );
    if opened(&out.stdout_str()) > 1 {
        through.push(format!("exec --cap CAP_SYS_ADMIN ID .. -h: {:?}", out.stdout_str()));
    }
    let process = json!({
        "terminal": false, "user": {"uid": 0, "gid": 0}, "cwd": "/",
        "args": ["sh", "-c", escape("/tmp/m4")], "env": [DEFAULT_PATH_ENV],
        "capabilities": caps_with(&["CAP_SYS_ADMIN"]), "noNewPrivileges": false
    });
    fs::write(&file, serde_json::to_vec(&process).unwrap()).unwrap();
    let out = node.fx.runc(&["exec", &format!("-process={}", file.display()), "held"], &[]);
    if opened(&out.stdout_str()) > 1 {
        through.push(format!("exec -process=F: {:?}", out.stdout_str()));
    }
    node.fx.delete_container("held", true).assert_success("delete");
    assert!(
        through.is_empty(),
        "an exec'd process opened other tenants' GPUs:\n{}",
        through.join("\n")
    );
}

/// runc 1.1's `exec --cgroup SUB` checks that the joined path *starts with* the container's
/// cgroup path as a string (`strings.HasPrefix`, libcontainer/container_linux.go), not as a
/// path: a container whose cgroup is `<p>/gpu` reaches `<p>/gpuab` with `--cgroup
/// ../gpuab` (and with `devices:../gpuab`). A container without a request — which the
/// wrapper keeps out of every grant's cgroup at create — so joins a running GPU
/// container's cgroup and opens its GPU; the reconciler kills the intruder only at its next
/// pass (5 s by default), after the open.
///
/// Seen: `exec --cgroup ../gpuab: 5:devices:/tessera-test-…/gpuab, opened 1 GPU` (the
/// victim's).
#[test]
fn an_exec_cannot_join_a_gpu_grants_cgroup_through_runcs_string_prefix_check() {
    let node = Node::start();
    let victim = node.bundle("gpuab", "team-trusted", Some("gpu=1"), &["sleep", "30"]);
    node.fx.run_detached(&victim, "gpuab");
    // The attacker's own container, no request, its cgroup a string prefix of the victim's.
    let mut b = node.bundle("gpu", "team-untrusted", None, &["sleep", "30"]);
    gpu_nodes_in_image(&b.rootfs());
    b.write();
    assert!(victim.cgroups_path().starts_with(&b.cgroups_path()));
    node.fx.run_detached(&b, "gpu");
    let own = node.fx.exec("gpu", &["sh", "-c", OPEN_PROBE]);
    assert_eq!(opened(&own.stdout_str()), 0, "baseline: {}", own.stdout_str());

    let probe = format!("grep devices /proc/self/cgroup; {OPEN_PROBE}");
    let mut through = Vec::new();
    // `-cgroup` is `--cgroup` to Go's flag package.
    for (flag, sub) in
        [("--cgroup", "../gpuab"), ("--cgroup", "devices:../gpuab"), ("-cgroup", "../gpuab")]
    {
        let out = node.fx.runc(&["exec", flag, sub, "gpu", "sh", "-c", &probe], &[]);
        if opened(&out.stdout_str()) > 0 {
            through.push(format!("exec {flag} {sub}: {:?}", out.stdout_str()));
        }
    }
    for id in ["gpu", "gpuab"] {
        node.fx.delete_container(id, true).assert_success("delete");
    }
    assert!(
        through.is_empty(),
        "a container without a request joined a GPU grant's cgroup:\n{}",
        through.join("\n")
    );
}

// --- class 1: what runc made can be changed from inside -------------------------------------

/// `CAP_SYS_ADMIN` is allowed to a GPU container with a user namespace of its own. But the
/// mounts runc makes after creating that namespace (the read-only `cgroup` mount, a
/// read-only bind of a host hierarchy the wrapper accepts) belong to a mount namespace the
/// container's user namespace owns: the kernel lets it remount them read-write
/// (`mount -o remount,bind,rw`; only mounts copied from the host are locked). Whether it
/// can then write the cgroup files is plain DAC, and a mapping that includes host uid 0
/// (`{"containerID": 0, "hostID": 0}`, which nothing refuses) makes the container's root
/// the files' owner. It then moves itself into the host's root devices cgroup (every GPU)
/// and sets its own `cpu.cfs_quota_us` to -1 and memory to 16 GiB, past its team's
/// ceilings; tesserad's prestart checks ran before and saw read-only views and the
/// admitted limits.
///
/// Held (by the kernel): sysfs stays read-only (runc mounts it read-only per superblock,
/// and a new sysfs is refused while the old one is masked). Without host uid 0 in the
/// mapping the remount works and the writes fail (EACCES).
///
/// Seen: `moved 5:devices:/ … opened 8 GPUs; kernel limits (-1, 17179869184) admitted
/// (50000, 536870912)`.
#[test]
fn a_user_namespace_that_maps_host_root_cannot_make_runcs_read_only_cgroup_views_writable() {
    let (_policy, node) = node_with_cpu_and_memory_quotas();
    host_gpu_nodes(&node.fx);
    let script = format!(
        "mount -o remount,bind,rw /cg && echo $$ > /cg/cgroup.procs && echo moved; \
         grep devices /proc/self/cgroup; {OPEN_PROBE}; \
         for c in cpu memory; do mount -o remount,bind,rw /sys/fs/cgroup/$c; done; \
         echo -1 > /sys/fs/cgroup/cpu/cpu.cfs_quota_us && echo cpu-unlimited; \
         echo 17179869184 > /sys/fs/cgroup/memory/memory.limit_in_bytes && echo memory-16g; \
         mount -o remount,bind,rw /sys; \
         (exec 3>>/sys/devices/software/uevent) 2>/dev/null && echo SYSFS-WRITABLE; \
         echo done; sleep 30"
    );
    let mut b = node.bundle("mapped", "team-dev", Some("gpu=1"), &["sh", "-c", &script]);
    gpu_nodes_in_image(&b.rootfs());
    b.mutate(|c| {
        c["linux"]["namespaces"].as_array_mut().unwrap().push(json!({"type": "user"}));
        c["linux"]["uidMappings"] = json!([{"containerID": 0, "hostID": 0, "size": 65536}]);
        c["linux"]["gidMappings"] = json!([{"containerID": 0, "hostID": 0, "size": 65536}]);
        c["process"]["capabilities"] = caps_with(&["CAP_SYS_ADMIN"]);
        c["mounts"].as_array_mut().unwrap().push(json!({"destination": "/cg", "type": "bind",
            "source": "/sys/fs/cgroup/devices", "options": ["rbind", "ro"]}));
        c["linux"]["resources"]["cpu"] = json!({"quota": 50000, "period": 100000});
        c["linux"]["resources"]["memory"] = json!({"limit": 536870912});
    })
    .write();
    let out = node.fx.create_container(&b, "mapped");
    let mut through = Vec::new();
    let mut seen = String::new();
    if out.status.success() {
        node.fx.start_container("mapped").assert_success("start");
        seen = wait_output(&node.fx, "mapped", "done");
        let limits = kernel_limits(&b.cgroups_path());
        if opened(&seen) > 1 {
            through.push(format!("opened {} GPUs: {seen:?}", opened(&seen)));
        }
        if limits != (50000, 536870912) {
            through.push(format!("kernel limits {limits:?}, admitted (50000, 536870912)"));
        }
        node.fx.delete_container("mapped", true).assert_success("delete");
    }
    // Held by the kernel either way.
    assert!(!seen.contains("SYSFS-WRITABLE"), "sysfs became writable: {seen}");
    assert!(
        through.is_empty(),
        "a GPU container remounted runc's read-only cgroup views:\n{}",
        through.join("\n")
    );
}

/// A GPU container must not share the host's pid namespace, because `/proc/<pid>/root` of
/// another container's process leads into that container's mounts (SECURITY.md 1a). Two
/// other spellings of "a procfs that shows processes outside the container" are accepted:
/// - the pid namespace of a container without a request, joined by path (the check
///   compares the namespace with the host's only);
/// - the host's own procfs, brought in by an `rbind` of the host's `/` with `rro` (judged
///   "read-only all the way down"; the prestart reading sees only read-only mounts and no
///   writable cgroup). A magic link in a read-only procfs still leads to the read-write
///   mounts it names.
///
/// Through either, `/proc/<pid>/root` of the helper — a container without a request whose
/// writable bind of the host's devices hierarchy is left to the engine as long as it has no
/// GPU, and whose capabilities are no more than the GPU container's — reaches a writable
/// cgroup: the GPU container writes its pid into the host's root devices cgroup and opens
/// every GPU.
///
/// Seen: `joined-pid-ns: moved, 5:devices:/, opened 8 GPUs` and the same for
/// `rbind-of-host-root-rro`.
#[test]
fn a_gpu_container_cannot_reach_another_containers_mounts_through_a_procfs() {
    let node = Node::start();
    let mut helper = node.bundle("helper", "team-untrusted", None, &["sleep", "30"]);
    helper
        .mutate(|c| {
            c["mounts"].as_array_mut().unwrap().push(json!({"destination": "/cg", "type": "bind",
                "source": "/sys/fs/cgroup/devices", "options": ["rbind", "rw"]}))
        })
        .write();
    // Since the sixth attack round tessera-runtime refuses that bind for every container
    // (SECURITY.md); made by plain runc, as an engine with another runtime would, the helper
    // still stands for "a writable cgroup somewhere on the node" for the checks below.
    let refused = node.fx.create_container(&helper, "helper-refused");
    assert!(
        !refused.status.success() && refused.stderr_str().contains("writable bind"),
        "tessera-runtime let a container bind the host's devices hierarchy writable: {}",
        refused.stderr_str()
    );
    let b = helper.dir().to_string_lossy().into_owned();
    let (out, err) = (
        fs::File::create(helper.dir().join("out")).unwrap(),
        fs::File::create(helper.dir().join("err")).unwrap(),
    );
    let created = std::process::Command::new(RUNC)
        .arg("--root")
        .arg(node.fx.runc_root())
        .args(["create", "--bundle", &b, "helper"])
        .stdin(std::process::Stdio::null())
        .stdout(out)
        .stderr(err)
        .status()
        .unwrap();
    assert!(created.success(), "plain runc create of the helper");
    node.fx.start_container("helper").assert_success("start the helper");
    let helper_pid = node.fx.container_pid("helper").expect("the helper runs");
    let escape = |proc_dir: &str| {
        format!(
            "echo $$ > {proc_dir}/root/cg/cgroup.procs && echo moved; \
             grep devices /proc/self/cgroup; {OPEN_PROBE}; echo done; sleep 30"
        )
    };
    type Edit = Box<dyn Fn(&mut Value)>;
    let cases: Vec<(&str, String, Edit)> = vec![
        (
            "joined-pid-ns",
            escape("/proc/1"),
            Box::new(move |c: &mut Value| {
                for n in c["linux"]["namespaces"].as_array_mut().unwrap() {
                    if n["type"] == "pid" {
                        n["path"] = json!(format!("/proc/{helper_pid}/ns/pid"));
                    }
                }
            }),
        ),
        (
            "rbind-of-host-root-rro",
            escape(&format!("/host/proc/{helper_pid}")),
            Box::new(|c: &mut Value| {
                c["mounts"].as_array_mut().unwrap().push(json!({"destination": "/host",
                    "type": "bind", "source": "/", "options": ["rbind", "rro"]}))
            }),
        ),
    ];
    let mut through = Vec::new();
    for (id, script, edit) in cases {
        let mut b = node.bundle(id, "team-untrusted", Some("mig=1g.10gb"), &["sh", "-c", &script]);
        gpu_nodes_in_image(&b.rootfs());
        fs::create_dir_all(b.rootfs().join("host")).unwrap();
        b.mutate(|c| edit(c)).write();
        let out = node.fx.create_container(&b, id);
        if out.status.success() {
            node.fx.start_container(id).assert_success("start");
            let seen = wait_output(&node.fx, id, "done");
            node.fx.delete_container(id, true).assert_success("delete");
            if opened(&seen) > 1 {
                through.push(format!("{id}: opened {} GPUs: {seen:?}", opened(&seen)));
            }
        }
    }
    node.fx.delete_container("helper", true).assert_success("delete");
    assert!(
        through.is_empty(),
        "a GPU container reached another container's writable cgroup through a procfs:\n{}",
        through.join("\n")
    );
}

/// The file handle of a host directory (`name_to_handle_at`), as `TYPE HEX`: computed on the
/// host, where the path is known.
const HANDLE_OF: &str = "import ctypes, sys
class FH(ctypes.Structure):
    _fields_ = [('n', ctypes.c_uint), ('t', ctypes.c_int), ('h', ctypes.c_ubyte * 128)]
libc = ctypes.CDLL(None, use_errno=True)
fh, mnt = FH(128, 0), ctypes.c_int()
assert libc.name_to_handle_at(-100, sys.argv[1].encode(), ctypes.byref(fh), ctypes.byref(mnt), 0) == 0
print(fh.t, bytes(fh.h[:fh.n]).hex())
";

/// Inside the container: `open_by_handle_at` on the container's own root (a bind of a
/// directory of the host's filesystem) opens the host directory the handle names, outside
/// the container's mount namespace, and a file is created there.
const OPEN_BY_HANDLE: &str = "import ctypes, os, sys
class FH(ctypes.Structure):
    _fields_ = [('n', ctypes.c_uint), ('t', ctypes.c_int), ('h', ctypes.c_ubyte * 128)]
libc = ctypes.CDLL(None, use_errno=True)
h = bytes.fromhex(sys.argv[2])
fh = FH(len(h), int(sys.argv[1]))
ctypes.memmove(fh.h, h, len(h))
fd = libc.open_by_handle_at(os.open('/', os.O_RDONLY), ctypes.byref(fh), os.O_RDONLY | os.O_DIRECTORY)
if fd < 0:
    print('refused, errno', ctypes.get_errno())
else:
    w = os.open('written-from-a-gpu-container', os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
    os.write(w, b'escaped')
    print('WROTE on the host')
";

/// The capability check of a GPU container is a deny-list of one (`CAP_SYS_ADMIN` without a
/// user namespace). `CAP_DAC_READ_SEARCH` is as good as host root: `open_by_handle_at`
/// decodes a handle to any inode of the filesystem the container's root lives on, outside
/// its mount namespace, writable through the read-write rootfs mount ("shocker"). From
/// there everything is reachable (tesserad's state and grant-cgroups list, the runtime's
/// configuration, runc itself). Other capabilities of the same weight pass the same way
/// (`CAP_SYS_MODULE`, `CAP_SYS_RAWIO`: PCI config space of every GPU through I/O ports,
/// `CAP_SYS_TIME`: the clock metering bills by); they are not exercised on this shared
/// machine.
///
/// Seen: `WROTE on the host` (the file exists in the fixture, outside the bundle).
#[test]
fn a_gpu_container_with_cap_dac_read_search_cannot_leave_its_mount_namespace() {
    let node = Node::start();
    let outside = node.fx.path("outside-the-bundle");
    fs::create_dir_all(&outside).unwrap();
    let handle = run_cmd(Command::new("python3").args(["-c", HANDLE_OF]).arg(&outside));
    handle.assert_success("name_to_handle_at on the host");
    let handle = handle.stdout_str();
    let (typ, hex) = handle.trim().split_once(' ').unwrap();
    let script = format!("/usr/bin/python3 /obh.py {typ} {hex} 2>&1; echo done");
    let mut b = node.bundle("obh", "team-untrusted", Some("gpu=1"), &["sh", "-c", &script]);
    fs::write(b.rootfs().join("obh.py"), OPEN_BY_HANDLE).unwrap();
    std::os::unix::fs::symlink("usr/lib", b.rootfs().join("lib")).unwrap();
    std::os::unix::fs::symlink("usr/lib64", b.rootfs().join("lib64")).unwrap();
    b.mutate(|c| {
        c["mounts"].as_array_mut().unwrap().push(json!({"destination": "/usr", "type": "bind",
            "source": "/usr", "options": ["rbind", "ro"]}));
        c["process"]["capabilities"] = caps_with(&["CAP_DAC_READ_SEARCH"]);
    })
    .write();
    let out = node.fx.create_container(&b, "obh");
    let mut seen = String::new();
    if out.status.success() {
        node.fx.start_container("obh").assert_success("start");
        seen = wait_output(&node.fx, "obh", "done");
        node.fx.delete_container("obh", true).assert_success("delete");
    }
    assert!(
        !outside.join("written-from-a-gpu-container").exists(),
        "a GPU container wrote a host file outside its bundle: {seen:?}"
    );
}

// --- class 2: a container's cgroup is its own, from above too -------------------------------

/// The wrapper keeps every container out of a running grant's cgroup and those below it,
/// but not out of those *above* it. runc 1.1 treats a container without a pid namespace
/// of its own (none, or one joined by path) as owning every process of its cgroup tree:
/// when such a create fails, or such a container is deleted or `kill --all`ed, runc freezes
/// the cgroup and SIGKILLs every pid below it (`destroy` → `signalAllProcesses`, which
/// walks the tree). A container without a request created into the parent of another
/// tenant's GPU container's cgroup — runc's device setup fails there (`devices.deny` of a
/// cgroup with children is EINVAL) — kills the GPU container.
///
/// Seen: the victim's runc status `stopped` right after the attacker's create failed.
#[test]
fn no_container_is_created_above_a_running_gpu_grants_cgroup() {
    let node = Node::start();
    let parent = format!("{}/p", node.fx.cgroup_parent());
    let mut victim = node.bundle("victim", "team-trusted", Some("gpu=1"), &["sleep", "30"]);
    victim.set_cgroups_path(&format!("{parent}/victim")).write();
    node.fx.run_detached(&victim, "victim");
    let mut b = node.bundle("above", "team-untrusted", None, &["sleep", "30"]);
    b.set_cgroups_path(&parent)
        .mutate(|c| c["linux"]["namespaces"].as_array_mut().unwrap().retain(|n| n["type"] != "pid"))
        .write();
    let out = node.fx.create_container(&b, "above");
    if out.status.success() {
        let _ = node.fx.delete_container("above", true);
    }
    let status = node.fx.status("victim");
    let _ = node.fx.delete_container("victim", true);
    assert_eq!(
        status.as_deref(),
        Some("running"),
        "another tenant's GPU container after a create above its cgroup (that create: {})",
        out.stderr_str().lines().last().unwrap_or("")
    );
}

/// The CPU a GPU container is admitted with is its CFS quota (cpu.cfs_quota_us over
/// cpu.cfs_period_us, checked again at prestart). CFS bandwidth does not apply to
/// real-time tasks: with `CAP_SYS_NICE` (or an `RLIMIT_RTPRIO` rlimit) and, where the
/// kernel has RT group scheduling as here, `linux.resources.cpu.realtimeRuntime` on a
/// cgroup whose parent has RT time (a top-level `cgroupsPath`, the config's to choose),
/// `SCHED_FIFO` threads run unthrottled: 0.1 core admitted, nearly a whole core per thread
/// used, past the team's 1.5-core ceiling with two threads on a bigger node.
///
/// Seen: `0.76 cores used over 0.43 s, admitted 0.1 (quota 10000 over 100000)`; the same
/// loop under CFS used 0.10.
#[test]
fn real_time_scheduling_gives_a_gpu_container_no_more_cpu_than_admitted() {
    let (_policy, node) = node_with_cpu_and_memory_quotas();
    // A busy loop for 0.6 s, as SCHED_FIFO (the host's chrt, through a read-only /usr).
    let script = "timeout 0.6 /usr/bin/chrt -f 10 /bin/sh -c 'while :; do :; done'; echo done";
    let mut b = node.bundle("rt", "team-dev", Some("gpu=1"), &["sh", "-c", script]);
    let cg = format!("/{}-rt", node.fx.name());
    std::os::unix::fs::symlink("usr/lib", b.rootfs().join("lib")).unwrap();
    std::os::unix::fs::symlink("usr/lib64", b.rootfs().join("lib64")).unwrap();
    b.set_cgroups_path(&cg)
        .mutate(|c| {
            c["mounts"].as_array_mut().unwrap().push(json!({"destination": "/usr", "type": "bind",
                "source": "/usr", "options": ["rbind", "ro"]}));
            c["process"]["capabilities"] = caps_with(&["CAP_SYS_NICE"]);
            c["linux"]["resources"]["cpu"] = json!({"quota": 10000, "period": 100000,
                "realtimeRuntime": 900000, "realtimePeriod": 1000000});
            c["linux"]["resources"]["memory"] = json!({"limit": 536870912});
        })
        .write();
    let out = node.fx.create_container(&b, "rt");
    if !out.status.success() {
        // Refused: nothing ran. Say why, for the record.
        eprintln!("refused: {}", out.stderr_str());
        return;
    }
    let usage = Path::new(CGROUP_ROOT).join("cpuacct").join(cg.trim_start_matches('/'));
    let read = || -> u64 {
        fs::read_to_string(usage.join("cpuacct.usage")).unwrap().trim().parse().unwrap()
    };
    let (u0, t0) = (read(), Instant::now());
    node.fx.start_container("rt").assert_success("start");
    let seen = wait_output(&node.fx, "rt", "done");
    let (used, wall) = ((read() - u0) as f64 / 1e9, t0.elapsed().as_secs_f64());
    node.fx.delete_container("rt", true).assert_success("delete");
    assert!(seen.contains("done"), "{seen}");
    // Admitted 0.1 core: allow twice that over the whole wall time (start-up included).
    assert!(
        used <= 0.2 * wall,
        "{used:.2} s of CPU in {wall:.2} s ({:.2} cores) for a container admitted 0.1 core",
        used / wall
    );
}

/// The same through `update`: a quota-bounded GPU container created with `CAP_SYS_NICE`
/// and no real-time time (SCHED_FIFO is refused there) is given RT time by
/// `tessera-runtime update --cpu-rt-period 1000000 --cpu-rt-runtime 900000`, which the
/// wrapper passes (it counts only the CFS quota and memory; a CFS raise past the ceiling
/// is refused), and then runs unthrottled.
///
/// Seen: `update accepted; cpu.rt_runtime_us 900000; 0.45 s of CPU in 0.50 s`.
#[test]
fn an_update_cannot_give_a_gpu_container_real_time_cpu() {
    let (_policy, node) = node_with_cpu_and_memory_quotas();
    let mut b = node.bundle("rtu", "team-dev", Some("gpu=1"), &["sleep", "30"]);
    let cg = format!("/{}-rtu", node.fx.name());
    std::os::unix::fs::symlink("usr/lib", b.rootfs().join("lib")).unwrap();
    std::os::unix::fs::symlink("usr/lib64", b.rootfs().join("lib64")).unwrap();
    b.set_cgroups_path(&cg)
        .mutate(|c| {
            c["mounts"].as_array_mut().unwrap().push(json!({"destination": "/usr", "type": "bind",
                "source": "/usr", "options": ["rbind", "ro"]}));
            // CAP_SYS_NICE at create is refused now (real_time_scheduling_...): the update
            // is the way left to try, and must be refused on its own.
            c["linux"]["resources"]["cpu"] = json!({"quota": 10000, "period": 100000});
            c["linux"]["resources"]["memory"] = json!({"limit": 536870912});
        })
        .write();
    node.fx.run_detached(&b, "rtu");
    let burn = "timeout 0.5 /usr/bin/chrt -f 10 /bin/sh -c 'while :; do :; done'; echo done";
    let before = node.fx.exec("rtu", &["sh", "-c", burn]);
    let update = node
        .fx
        .runc(&["update", "--cpu-rt-period", "1000000", "--cpu-rt-runtime", "900000", "rtu"], &[]);
    let rel = cg.trim_start_matches('/');
    let rt =
        fs::read_to_string(Path::new(CGROUP_ROOT).join("cpu").join(rel).join("cpu.rt_runtime_us"))
            .unwrap();
    let usage = Path::new(CGROUP_ROOT).join("cpuacct").join(rel).join("cpuacct.usage");
    let read = || -> u64 { fs::read_to_string(&usage).unwrap().trim().parse().unwrap() };
    let (u0, t0) = (read(), Instant::now());
    let after = node.fx.exec("rtu", &["sh", "-c", burn]);
    let (used, wall) = ((read() - u0) as f64 / 1e9, t0.elapsed().as_secs_f64());
    node.fx.delete_container("rtu", true).assert_success("delete");
    // Before any RT time: the kernel refuses SCHED_FIFO in the group.
    assert!(before.stderr_str().contains("chrt"), "before: {before:?}");
    assert!(
        !update.status.success() && rt.trim() == "0",
        "update accepted (exit {:?}); cpu.rt_runtime_us {}; then {used:.2} s of CPU in \
         {wall:.2} s for a container admitted 0.1 core ({})",
        update.status.code(),
        rt.trim(),
        after.stderr_str().trim()
    );
}

// --- defences that held ---------------------------------------------------------------------

/// `--no-pivot` (runc's chroot instead of pivot_root, from which a process with
/// `CAP_SYS_CHROOT` climbs out to the host's root filesystem): runc itself refuses it with
/// the `rprivate` root propagation tessera-runtime gives every GPU container.
#[test]
fn no_pivot_is_refused_for_a_gpu_container() {
    let node = Node::start();
    let mut b = node.bundle("np", "team-untrusted", Some("gpu=1"), &["true"]);
    b.mutate(|c| c["process"]["capabilities"] = caps_with(&["CAP_SYS_CHROOT"])).write();
    let dir = b.dir().to_str().unwrap().to_string();
    let out = node.fx.runc(&["create", "--no-pivot", "--bundle", &dir, "np"], &[]);
    if out.status.success() {
        let _ = node.fx.delete_container("np", true);
    }
    assert!(!out.status.success(), "a GPU container created with --no-pivot");
    assert!(out.stderr_str().contains("not safe without pivot_root"), "{}", out.stderr_str());
    assert!(wait_for(|| node.grants().is_empty(), Duration::from_secs(10)), "{:?}", node.grants());
}

/// Values a config author controls reach `tessera usage --csv` and the daemon's log: a
/// container id that a spreadsheet would run (`-2+3`, `+SUM`: runc's id rule admits them),
/// and a namespace annotation carrying a newline and a forged log line.
#[test]
fn ids_and_annotations_reach_csv_and_logs_escaped() {
    let node = Node::start();
    for id in ["-2+3", "+SUM"] {
        let b = node.bundle(id, "team-untrusted", Some("gpu=1"), &["true"]);
        let dir = b.dir().to_str().unwrap().to_string();
        // `--`: runc's flag parser would take `-2+3` for a flag.
        node.fx.runc(&["run", "--bundle", &dir, "--", id], &[]).assert_success("run");
    }
    let forged = "x\n2026-01-01T00:00:00.000000Z  INFO tesserad: granted container=forged";
    let b = node.bundle("injector", forged, Some("gpu=1"), &["true"]);
    let _ = node.fx.run_container(&b, "injector");
    let csv = node.cli(&["usage", "--by", "container", "--csv"]);
    csv.assert_success("usage --csv");
    let text = csv.stdout_str();
    assert!(text.contains("-2+3"), "{text}");
    for line in text.lines() {
        for cell in line.split(',') {
            assert!(
                !cell.starts_with(['=', '+', '-', '@', '\t', '\r']),
                "a formula cell `{cell}` in {text}"
            );
        }
    }
    let esc = "team\u{1b}]0;owned\u{7}\u{1b}[2J";
    let b = node.bundle("esc", esc, Some("gpu=1"), &["true"]);
    let _ = node.fx.run_container(&b, "esc");
    let status = node.cli(&["status"]).stdout_str();
    assert!(!status.contains('\u{1b}'), "a raw ESC in `tessera status`: {status:?}");
    let log = node.daemon.stderr();
    assert!(!log.contains('\u{1b}'), "a raw ESC in the daemon's log");
    assert!(
        !log.lines().any(|l| l.starts_with("2026-01-01T00:00:00")),
        "a forged log line:\n{log}"
    );
}
