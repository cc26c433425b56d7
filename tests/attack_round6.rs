//! Red-team round 6 (branch rt-iso2): the round-5 fixes for *every* container (only
//! filesystems of a container's own mounted anew, proc only at /proc, runc spec's
//! readonlyPaths/maskedPaths kept), read as runc 1.1.5 and the kernel carry them out, for a
//! container without a GPU request ("host root is every GPU"). Run as round 5 runs: tesserad
//! on the simulated node, tessera-runtime and tessera-hook as built, real runc and the
//! kernel; every case reads back what the host shows.
//!
//! A test that fails here is an attack that got through.

#![allow(clippy::unwrap_used)]

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};
use tessera_harness::attack::*;
use tessera_harness::node::*;
use tessera_harness::*;

const WITHIN: Duration = Duration::from_secs(15);

fn refused_by_tessera(started: &Result<(), String>) {
    if let Err(e) = started {
        assert!(e.contains("tessera-runtime"), "refused, but not by tessera-runtime: {e}");
    }
}

fn add_caps(c: &mut Value, caps: &[&str]) {
    for set in ["bounding", "effective", "permitted"] {
        let list = c["process"]["capabilities"][set].as_array_mut().unwrap();
        list.extend(caps.iter().map(|s| json!(s)));
    }
}

/// Sets a host file (a sysctl, a sysfs attribute) back to what it was when dropped.
struct Restore(PathBuf, String);

impl Drop for Restore {
    fn drop(&mut self) {
        let _ = fs::write(&self.0, &self.1);
    }
}

/// Runs a plain container (team-dev, no request) whose script writes `new` through `via`
/// (a path inside the container) and checks the host file `host` is unchanged.
fn plain_writes_host_file(
    id: &str,
    host: &Path,
    via: &str,
    prelude: &str,
    edit: impl FnOnce(&mut Value),
) {
    writes_host_file(id, "team-dev", None, host, via, prelude, edit)
}

/// [`plain_writes_host_file`] for any tenant and request.
fn writes_host_file(
    id: &str,
    tenant: &str,
    request: Option<&str>,
    host: &Path,
    via: &str,
    prelude: &str,
    edit: impl FnOnce(&mut Value),
) {
    let node = Node::start();
    let was = fs::read_to_string(host).unwrap().trim().to_string();
    let _restore = Restore(host.to_path_buf(), was.clone());
    let new = was.parse::<u64>().unwrap() + 7;
    let script = format!(
        "{prelude} echo {new} > {via} && touch /tmp/written; touch /tmp/done; exec sleep 300"
    );
    let mut b = node.bundle(id, tenant, request, &["sh", "-c", &script]);
    b.mutate(edit).write();
    let started = create_and_start(&node, &b, id);
    refused_by_tessera(&started);
    if started.is_ok() {
        wait_for(|| b.rootfs().join("tmp/done").exists(), WITHIN);
    }
    let now = fs::read_to_string(host).unwrap().trim().to_string();
    node.fx.delete_container(id, true);
    assert_eq!(
        now,
        was,
        "a container ({tenant}, {request:?}) wrote the host's {} through {via} ({was} -> \
         {now}); create/start: {started:?}",
        host.display()
    );
}

/// Class: proc only at /proc, by a *bind* instead of a mount.
///
/// `check_filesystems` refuses a second `proc` mounted elsewhere than `/proc` for every
/// container, and skips binds ("judged as one elsewhere": only for GPU containers). runc
/// 1.1.5 makes the mounts in order, in the container's mount namespace, and resolves a
/// bind's source there: a bind of `rootfs/proc` (relative: joined to the bundle) after the
/// config's `proc` at `/proc` binds the container's own procfs at `/proc2`, where runc's
/// readonlyPaths (`/proc/sys`, by path) do not reach. `/proc2/sys` is writable: the host's
/// global sysctls (`kernel.core_pattern`), the very thing round 5's fix refused as a second
/// proc mount.
#[test]
fn a_plain_container_cannot_bind_its_own_proc_where_proc_sys_is_writable() {
    plain_writes_host_file(
        "procbind",
        Path::new("/proc/sys/kernel/printk_ratelimit_burst"),
        "/proc2/sys/kernel/printk_ratelimit_burst",
        "",
        |c| {
            c["mounts"].as_array_mut().unwrap().push(json!({
                "destination": "/proc2", "type": "bind", "source": "rootfs/proc",
                "options": ["rbind", "rw"]
            }))
        },
    );
}

/// Class: filesystems "of the container's own": `sysfs`.
///
/// `OWN_INSTANCE_FILESYSTEMS` counts `sysfs` as the container's network namespace's own,
/// and a container without a request may mount it read-write (only a GPU container's must
/// be read-only). A new network namespace changes only `/sys/class/net`; the rest of sysfs
/// is the host's kernel objects: `/sys/bus/pci/devices/<gpu>/remove` and
/// `/sys/bus/pci/drivers/nvidia/unbind` (every tenant's GPU), `/sys/module/*/parameters`,
/// `/sys/kernel/mm`, `/sys/power/state`. Shown on
/// `/sys/kernel/mm/transparent_hugepage/khugepaged/pages_to_scan`, read back on the host.
#[test]
fn a_plain_container_cannot_mount_a_writable_sysfs() {
    plain_writes_host_file(
        "sysfsrw",
        Path::new("/sys/kernel/mm/transparent_hugepage/khugepaged/pages_to_scan"),
        "/sys/kernel/mm/transparent_hugepage/khugepaged/pages_to_scan",
        "",
        |c| {
            for m in c["mounts"].as_array_mut().unwrap() {
                if m["type"] == "sysfs" {
                    m["options"] = json!(["nosuid", "noexec", "nodev", "rw"]);
                }
            }
        },
    );
}

/// Class: the round-5 rules for every container, undone from inside.
///
/// A container without a request may hold any capability (the allow-list is a GPU
/// container's). With `CAP_SYS_ADMIN`, no user namespace of its own and no seccomp profile
/// (all config.json fields), the container mounts what its config may not: here a second
/// `proc` (the host's sysctls writable, as `a_second_proc_is_no_way_to_the_hosts_sysctls`);
/// `mount -t binfmt_misc` or `mount -o remount,rw /proc/sys` likewise.
#[test]
fn a_plain_container_with_cap_sys_admin_cannot_mount_a_second_proc_itself() {
    plain_writes_host_file(
        "sysadmin",
        Path::new("/proc/sys/kernel/printk_ratelimit_burst"),
        "/proc2/sys/kernel/printk_ratelimit_burst",
        "mkdir -p /proc2 && mount -t proc proc /proc2 &&",
        |c| add_caps(c, &["CAP_SYS_ADMIN"]),
    );
}

/// A cgroup of the unified (cgroup2) hierarchy holding `pid`, removed when dropped.
struct UnifiedCgroup(PathBuf);

impl Drop for UnifiedCgroup {
    fn drop(&mut self) {
        // Move anything left back to the root, then remove.
        if let Ok(procs) = fs::read_to_string(self.0.join("cgroup.procs")) {
            let root = self.0.parent().unwrap().join("cgroup.procs");
            for p in procs.lines() {
                let _ = fs::write(&root, p);
            }
        }
        let _ = fs::remove_dir(&self.0);
    }
}

/// Class: filesystems "of the container's own": `cgroup2` without a cgroup namespace.
///
/// `cgroup2` is in `OWN_INSTANCE_FILESYSTEMS` as "of its cgroup namespace", but runc spec's
/// config (and Docker's on cgroup v1) has no cgroup namespace: the kernel mounts the
/// initial namespace's root, the host's whole hierarchy, and a container without a request
/// may mount it read-write. On this hybrid v1 host that is the unified hierarchy, where
/// systemd keeps every service (tesserad.service and the MPS daemons it starts among
/// them): the container writes `cgroup.kill` of tesserad's cgroup (or `cgroup.freeze` of
/// another tenant's container). On a cgroup-v2 host the same mount (type `cgroup2`, or
/// `cgroup`, which runc 1.1.5 mounts as cgroup2 there) is every cgroup of the node, and
/// the container moves itself into a GPU grant's cgroup (its device program).
#[test]
fn a_plain_container_cannot_mount_the_hosts_cgroup2_hierarchy_writable() {
    let unified = Path::new("/sys/fs/cgroup/unified");
    assert!(unified.join("cgroup.procs").exists(), "a hybrid host: {}", unified.display());
    let mut node = Node::start();
    let name = format!("{}-svc", unique_name());
    let svc = UnifiedCgroup(unified.join(&name));
    fs::create_dir(&svc.0).unwrap();
    // tesserad in a cgroup of its own, as systemd puts tesserad.service.
    fs::write(svc.0.join("cgroup.procs"), node.daemon.pid().to_string()).unwrap();
    let script = format!(
        "echo 1 > /cg2/{name}/cgroup.kill && touch /tmp/written; touch /tmp/done; \
         exec sleep 300"
    );
    let mut b = node.bundle("cg2", "team-dev", None, &["sh", "-c", &script]);
    b.mutate(|c| {
        c["mounts"].as_array_mut().unwrap().push(json!({
            "destination": "/cg2", "type": "cgroup2", "source": "cgroup2",
            "options": ["nosuid", "noexec", "nodev", "rw"]
        }))
    })
    .write();
    let started = create_and_start(&node, &b, "cg2");
    refused_by_tessera(&started);
    if started.is_ok() {
        wait_for(|| b.rootfs().join("tmp/done").exists(), WITHIN);
    }
    let written = b.rootfs().join("tmp/written").exists();
    let killed = wait_for(|| !node.daemon.is_running(), Duration::from_secs(2));
    node.fx.delete_container("cg2", true);
    drop(svc);
    assert!(
        !written && !killed,
        "a plain container of team-dev mounted the host's cgroup2 hierarchy writable and \
         wrote cgroup.kill of tesserad's cgroup {name} (tesserad killed: {killed}); \
         create/start: {started:?}"
    );
}

/// Class: links in the rootfs under mount destinations (round 5's fix), the destination
/// spelled as the rootfs's host path.
///
/// runc 1.1.5 takes a `proc`/`sysfs` destination that already starts with the rootfs path
/// as a host path (`if !strings.HasPrefix(dest, rootfs) { dest = filepath.Join(rootfs,
/// dest) }`) and `os.MkdirAll`s it, following the image's links on the host, before it
/// fails to open it inside the rootfs. tessera-runtime's link check walks
/// `rootfs.join(destination)` (`<rootfs>/<rootfs>/x/...`, absent) and finds no link. The
/// image's `/x` points at a host directory; a GPU container and one without a request
/// alike. The directories stay on the host, made by root wherever the image points.
#[test]
fn a_destination_spelled_as_the_rootfs_host_path_makes_nothing_on_the_host() {
    let node = Node::start();
    let mut made_on_host = Vec::new();
    for (id, request) in [("abs-gpu", Some("mig=1g.10gb")), ("abs-plain", None)] {
        let host = short_tempdir();
        let mut b = node.bundle(id, "team-untrusted", request, &["true"]);
        std::os::unix::fs::symlink(&host, b.rootfs().join("x")).unwrap();
        let rootfs = fs::canonicalize(b.rootfs()).unwrap();
        b.mutate(|c| {
            c["mounts"].as_array_mut().unwrap().push(json!({
                "destination": format!("{}/x/made-by-runc/sub", rootfs.display()),
                "type": "sysfs", "source": "sysfs",
                "options": ["nosuid", "noexec", "nodev", "ro"]
            }))
        })
        .write();
        let started = create_and_start(&node, &b, id);
        node.fx.delete_container(id, true);
        let made = host.join("made-by-runc/sub");
        let exists = made.exists();
        let _ = fs::remove_dir_all(&host);
        if exists {
            made_on_host.push(format!(
                "{id}: runc made {} on the host through the image's link /x -> {} \
                 (destination {}/x/made-by-runc/sub); create/start: {started:?}",
                made.display(),
                host.display(),
                rootfs.display()
            ));
        }
    }
    assert!(made_on_host.is_empty(), "{made_on_host:#?}");
}

/// Class: `linux.readonlyPaths` kept by spelling (round 5's `protect_proc`).
///
/// tessera-runtime adds `/proc/sys` unless the list already holds an entry that *normalizes
/// lexically* to it. runc 1.1.5 hands each entry to mount(2) as written and skips one that
/// does not exist (`readonlyPath`: `errors.Is(err, os.ErrNotExist)` returns nil); the
/// kernel walks `..` after the component before it. `/proc/none/../sys` is `/proc/sys` to
/// the check and ENOENT to the kernel: runc skips it, /proc/sys stays writable, and the
/// container writes the host's sysctls (`kernel.core_pattern`). The same spelling keeps
/// `/proc/sysrq-trigger` writable and `/proc/kcore` unmasked. A GPU container (an
/// untrusted MIG share) and one without a request alike.
#[test]
fn a_readonly_path_spelled_through_a_missing_directory_keeps_proc_sys_read_only() {
    for (id, tenant, request) in [
        ("rospell-gpu", "team-untrusted", Some("mig=1g.10gb")),
        ("rospell-plain", "team-dev", None),
    ] {
        writes_host_file(
            id,
            tenant,
            request,
            Path::new("/proc/sys/kernel/printk_ratelimit_burst"),
            "/proc/sys/kernel/printk_ratelimit_burst",
            "",
            |c| {
                c["linux"]["readonlyPaths"] = json!([
                    "/proc/bus",
                    "/proc/fs",
                    "/proc/irq",
                    "/proc/tessera-none/../sys",
                    "/proc/sysrq-trigger"
                ]);
            },
        );
    }
}

/// A cgroup `/<name>` made in every v1 hierarchy but `devices` (and the unified one), with
/// process `pid` moved in: where systemd puts a service on cgroup v1 when no unit of its
/// slice asks for the devices controller (pids, memory and name=systemd are realized; the
/// service stays in the devices hierarchy's `/` or `/system.slice`). Removed when dropped,
/// anything left in it killed.
struct ServiceCgroup(String);

impl ServiceCgroup {
    fn with_process(pid: u32) -> ServiceCgroup {
        let g = ServiceCgroup(format!("/{}-svc", unique_name()));
        for m in cgroup_mounts() {
            let leaf = m.file_name().unwrap().to_string_lossy().into_owned();
            if leaf.split(',').any(|c| c == "devices") || leaf == "unified" {
                continue;
            }
            let dir = m.join(g.0.trim_start_matches('/'));
            fs::create_dir_all(&dir).unwrap();
            for f in ["cpuset.cpus", "cpuset.mems"] {
                if let Ok(v) = fs::read_to_string(m.join(f)) {
                    fs::write(dir.join(f), v.trim()).unwrap();
                }
            }
            fs::write(dir.join("cgroup.procs"), pid.to_string()).unwrap();
        }
        g
    }
}

impl Drop for ServiceCgroup {
    fn drop(&mut self) {
        remove_cgroup_tree(&self.0);
    }
}

/// Class: tesserad's cgroup, read from one hierarchy.
///
/// tessera-runtime reads tesserad's cgroup from the devices line of `/proc/<pid>/cgroup`
/// only, and refuses a container at or above it. runc's cgroupfs driver puts a container
/// at the same path in every hierarchy. On a systemd v1 host `tesserad.service` is in its
/// own pids, memory and name=systemd cgroups while its devices line can stay `/`: a plain
/// container naming the service's path is below tesserad's devices cgroup, so allowed,
/// and runc writes its `pids.max` (here 2) into the pids cgroup tesserad and every tenant's
/// MPS daemons run in: no fork or thread of theirs succeeds (its memory limit likewise
/// brings the OOM killer to them).
#[test]
fn a_plain_container_cannot_set_the_limits_of_tesserads_cgroup_in_another_hierarchy() {
    // Declared first, dropped last: after tesserad has stopped.
    let svc: ServiceCgroup;
    let node = Node::start();
    svc = ServiceCgroup::with_process(node.daemon.pid());
    let pids = Path::new("/sys/fs/cgroup/pids").join(svc.0.trim_start_matches('/'));
    let before = fs::read_to_string(pids.join("pids.max")).unwrap();
    assert!(
        cgroup_procs(&pids).contains(&(node.daemon.pid() as i32)),
        "tesserad in {svc:?}",
        svc = svc.0
    );
    let mut plain = node.bundle("limiter", "team-dev", None, &["sleep", "300"]);
    plain
        .set_cgroups_path(&svc.0)
        .mutate(|c| c["linux"]["resources"]["pids"] = json!({"limit": 2}))
        .write();
    let started = create_and_start(&node, &plain, "limiter");
    let after = fs::read_to_string(pids.join("pids.max")).unwrap();
    node.fx.delete_container("limiter", true);
    let _ = fs::write(pids.join("pids.max"), "max");
    assert!(
        after == before,
        "a plain container of team-dev named tesserad's cgroup {} (tesserad's devices line \
         is another) and runc set the pids.max of tesserad's pids cgroup: {:?} -> {:?}; \
         create/start: {started:?}",
        svc.0,
        before.trim(),
        after.trim()
    );
}

/// A cgroup `/<name>` in every hierarchy holding `pid` (as round 5's `OwnCgroup`).
struct AllCgroup(String);

impl AllCgroup {
    fn with_process(pid: u32) -> AllCgroup {
        let g = AllCgroup(format!("/{}-svc", unique_name()));
        for m in cgroup_mounts() {
            let dir = m.join(g.0.trim_start_matches('/'));
            fs::create_dir_all(&dir).unwrap();
            for f in ["cpuset.cpus", "cpuset.mems"] {
                if let Ok(v) = fs::read_to_string(m.join(f)) {
                    fs::write(dir.join(f), v.trim()).unwrap();
                }
            }
            fs::write(dir.join("cgroup.procs"), pid.to_string()).unwrap();
        }
        g
    }
}

impl Drop for AllCgroup {
    fn drop(&mut self) {
        remove_cgroup_tree(&self.0);
    }
}

/// Class: tesserad's cgroup, read from its live process only.
///
/// `read_daemon_cgroup` answers `None` (nothing to check) once the process whose id is
/// beside the socket is gone: a crash, an upgrade, the seconds before systemd's restart.
/// The MPS daemons tesserad started for every tenant stay in its cgroup
/// (`KillMode=process`), and a plain container naming that cgroup is created there: runc
/// rewrites the devices rules the MPS servers open the GPUs through, and its freezer,
/// limits and `kill --all` reach them.
#[test]
fn a_plain_container_cannot_join_the_mps_daemons_cgroup_while_tesserad_is_down() {
    let svc: AllCgroup;
    let mut node = Node::start_with(NodeOptions {
        extra_args: vec!["--mps-control".into(), fresh_bin("fake-nvidia-cuda-mps-control").into()],
        ..Default::default()
    });
    svc = AllCgroup::with_process(node.daemon.pid());
    let mut daemons = KillOnDrop(Vec::new());
    let b = node.bundle("share", "team-research", Some("mps=25"), &["sleep", "300"]);
    node.fx.run_detached(&b, "share");
    daemons.0.extend(node.client().status().unwrap().mps_shares.iter().filter_map(|s| s.pid));
    assert!(!daemons.0.is_empty(), "the share started an MPS daemon");
    let svc_dir = Path::new("/sys/fs/cgroup/devices").join(svc.0.trim_start_matches('/'));
    let before = fs::read_to_string(svc_dir.join("devices.list")).unwrap();
    node.daemon.kill9();
    std::thread::sleep(Duration::from_millis(300));
    let left = cgroup_procs(&svc_dir);
    let mut plain = node.bundle("intruder", "team-dev", None, &["sleep", "300"]);
    plain.set_cgroups_path(&svc.0).write();
    let started = create_and_start(&node, &plain, "intruder");
    let after = fs::read_to_string(svc_dir.join("devices.list")).unwrap();
    node.fx.delete_container("intruder", true);
    node.fx.delete_container("share", true);
    drop(daemons);
    assert!(
        left.is_empty() || after == before,
        "with tesserad gone, a plain container of team-dev joined the cgroup where \
         team-research's MPS daemons still run (pids {left:?}) and runc rewrote its device \
         rules: before {:?}, after {:?}; create/start: {started:?}",
        before.trim(),
        after.trim()
    );
}

/// Class: processes outside the container's own pid namespace in view, where the kernel
/// lets a process attach to any process of its uid (rt-iso3, round 7; round 8 the bind).
/// A container without a GPU, with `runc spec`'s capabilities only (no CAP_SYS_PTRACE),
/// in the host's pid namespace — or in one of its own with the host's procfs bound
/// read-only — sees a GPU container's processes; ptrace_may_access lets it attach to one of
/// the same uid whose capabilities its own cover: `pidfd_getfd(2)` copies the open GPU
/// descriptors past the devices cgroup, and `/proc/<pid>/mem` (attach mode, as
/// `pidfd_getfd`) reads the process. Such a container runs only where Yama's
/// `ptrace_scope` is 1 or more (this VM's kernel has no Yama: it is refused here; on a
/// Yama ≥ 1 node it runs and the kernel refuses the read).
///
/// Seen without the check: each spy read 16 bytes of the GPU container's memory (and
/// listed its root).
#[test]
fn a_plain_container_seeing_the_hosts_processes_cannot_attach_to_a_gpu_containers_process() {
    let node = Node::start();
    let mut victim = node.bundle("victim", "team-trusted", Some("gpu=1"), &["sleep", "300"]);
    victim.write();
    create_and_start(&node, &victim, "victim").expect("the GPU container runs");
    let pid = node.fx.container_pid("victim").expect("the GPU container's pid");
    type Edit = Box<dyn Fn(&mut Value)>;
    // The GPU container's pid namespace joined by path (`--pid=container:<id>`): not a
    // container without a GPU's, so a view as the host's is (round 9 lets a pod's sandbox's).
    let joined = format!("/proc/{pid}/ns/pid");
    let cases: [(&str, &str, i32, Edit); 3] = [
        (
            "host-pid",
            "/proc",
            pid,
            Box::new(|c| {
                c["linux"]["namespaces"].as_array_mut().unwrap().retain(|n| n["type"] != "pid")
            }),
        ),
        (
            "proc-bind",
            "/hostproc",
            pid,
            Box::new(|c| {
                c["mounts"].as_array_mut().unwrap().push(json!({"destination": "/hostproc",
                    "type": "bind", "source": "/proc", "options": ["rbind", "ro"]}))
            }),
        ),
        (
            "gpu-pid-ns",
            "/proc",
            1,
            Box::new(move |c| {
                for n in c["linux"]["namespaces"].as_array_mut().unwrap() {
                    if n["type"] == "pid" {
                        n["path"] = json!(joined);
                    }
                }
            }),
        ),
    ];
    let mut through = Vec::new();
    for (id, proc_dir, pid, edit) in cases {
        // Attach-mode access, with busybox: the first mapping of the victim, read from its mem.
        let script = format!(
            "a=$(head -n1 {proc_dir}/{pid}/maps | cut -d- -f1); \
             dd if={proc_dir}/{pid}/mem of=/tmp/stolen bs=1 skip=$((0x$a)) count=16 2>/dev/null; \
             wc -c < /tmp/stolen > /tmp/n; mv /tmp/n /tmp/read; exec sleep 300"
        );
        let mut spy = node.bundle(id, "team-dev", None, &["sh", "-c", &script]);
        fs::create_dir_all(spy.rootfs().join("hostproc")).unwrap();
        spy.mutate(edit).write();
        let started = create_and_start(&node, &spy, id);
        refused_by_tessera(&started);
        match &started {
            Ok(()) => {
                wait_for(|| spy.rootfs().join("tmp/read").exists(), WITHIN);
                let read = fs::read_to_string(spy.rootfs().join("tmp/read")).unwrap_or_default();
                if !matches!(read.trim(), "" | "0") {
                    through.push(format!("{id}: read {} bytes", read.trim()));
                }
            }
            Err(e) if !e.contains("kernel.yama.ptrace_scope=1") => {
                through.push(format!("{id}: refused, but not saying why: {e}"))
            }
            Err(_) => {}
        }
        node.fx.delete_container(id, true);
    }
    node.fx.delete_container("victim", true);
    assert!(
        through.is_empty(),
        "a GPU container's memory read from outside its pid namespace: {through:?}"
    );
}

/// Class: the same view, made by runc from what the create's checks did not see (a bind
/// source swapped between tessera-runtime's check and runc's mount: a link in a volume
/// another container writes). Stood in for here by `runc create` run directly, as an engine
/// with another runtime would: tessera-runtime's `start` reads what runc made — the pid
/// namespace of the init, and which pid namespace every procfs in its mount table shows
/// (read through its root, no link followed) — and refuses and deletes it before its
/// process runs. A container runc made as configured (its own `/proc`) starts.
///
/// Seen without the check (the wrapper's `start` passing such a container through): the
/// spy started and read 16 bytes of the GPU container's memory through `/hostproc`.
#[test]
fn a_procfs_runc_made_outside_the_checks_is_refused_at_start() {
    let node = Node::start();
    let mut victim = node.bundle("victim", "team-trusted", Some("gpu=1"), &["sleep", "300"]);
    victim.write();
    create_and_start(&node, &victim, "victim").expect("the GPU container runs");
    let pid = node.fx.container_pid("victim").expect("the GPU container's pid");
    let script = format!(
        "a=$(head -n1 /hostproc/{pid}/maps | cut -d- -f1); \
         dd if=/hostproc/{pid}/mem of=/tmp/stolen bs=1 skip=$((0x$a)) count=16 2>/dev/null; \
         wc -c < /tmp/stolen > /tmp/n; mv /tmp/n /tmp/read; exec sleep 300"
    );
    let runc_create = |b: &Bundle, id: &str| {
        let dir = b.dir().to_string_lossy().into_owned();
        let created = std::process::Command::new(RUNC)
            .arg("--root")
            .arg(node.fx.runc_root())
            .args(["create", "--bundle", &dir, id])
            .stdin(std::process::Stdio::null())
            .stdout(fs::File::create(b.dir().join("out")).unwrap())
            .stderr(fs::File::create(b.dir().join("err")).unwrap())
            .status()
            .unwrap();
        assert!(created.success(), "plain runc create of {id}");
    };
    // As configured: starts through the wrapper's check.
    let mut fine = node.bundle("fine", "team-dev", None, &["sleep", "300"]);
    fine.write();
    runc_create(&fine, "fine");
    node.fx.start_container("fine").assert_success("a container with its own /proc");
    node.fx.delete_container("fine", true);
    // The host's procfs bound in: refused at start, and gone.
    let mut spy = node.bundle("spy", "team-dev", None, &["sh", "-c", &script]);
    fs::create_dir_all(spy.rootfs().join("hostproc")).unwrap();
    spy.mutate(|c| {
        c["mounts"].as_array_mut().unwrap().push(json!({"destination": "/hostproc",
            "type": "bind", "source": "/proc", "options": ["rbind", "ro"]}))
    })
    .write();
    runc_create(&spy, "spy");
    let started = node.fx.start_container("spy");
    let read = if started.status.success() {
        wait_for(|| spy.rootfs().join("tmp/read").exists(), WITHIN);
        fs::read_to_string(spy.rootfs().join("tmp/read")).unwrap_or_default()
    } else {
        String::new()
    };
    let left = node.fx.status("spy");
    node.fx.delete_container("spy", true);
    node.fx.delete_container("victim", true);
    assert!(
        read.trim().is_empty() || read.trim() == "0",
        "a container runc made with the host's procfs read {} bytes of a GPU container's memory",
        read.trim()
    );
    let err = started.stderr_str();
    assert!(
        !started.status.success()
            && err.contains("/hostproc is a procfs of")
            && err.contains("refused before its process runs"),
        "start: {err}"
    );
    assert_eq!(left, None, "the refused container was not deleted");
}

/// Class: the same swap for a GPU container (round 8). Its bind of a volume directory at
/// `/proc` (after its `proc` mount) passes the wrapper's check; a runc wrapper standing
/// for the racer replaces the directory with a link to the host's `/proc` between that
/// check and runc's mount, so runc binds the host's procfs over the container's own. The
/// mount table then holds a procfs at `/proc` only, which the confirmation's "procfs
/// elsewhere than /proc" rule passed; tesserad now reads which pid namespace it shows and
/// refuses the start.
#[test]
fn a_gpu_containers_proc_swapped_for_the_hosts_is_refused_at_start() {
    let node = Node::start();
    let mut b = node.bundle("swapped", "team-untrusted", Some("mig=1g.10gb"), &["sleep", "300"]);
    let vol = b.dir().join("vol/data");
    fs::create_dir_all(&vol).unwrap();
    b.mutate(|c| {
        c["mounts"].as_array_mut().unwrap().push(json!({"destination": "/proc",
            "type": "bind", "source": vol.to_str().unwrap(), "options": ["rbind", "ro"]}))
    })
    .write();
    let racer = racing_runc(&b, "create", &[(&vol, Path::new("/proc"))]);
    let created =
        node.fx.create_container_env(&b, "swapped", &[("TESSERA_RUNC", racer.to_str().unwrap())]);
    let started =
        if created.status.success() { node.fx.start_container("swapped") } else { created };
    let left = node.fx.status("swapped");
    node.fx.delete_container("swapped", true);
    let err = started.stderr_str();
    assert!(!started.status.success(), "a GPU container with the host's procfs at /proc started");
    assert!(err.contains("/proc is a procfs of"), "refused, but not for its procfs: {err}");
    assert_eq!(left, None, "the refused container was not deleted");
}

/// Class: tesserad's own paths in view (round 8, rt-iso4), by a bind source swapped after
/// the create's checks (the racer above stands for a link swapped in a volume another
/// container writes): the create's check saw a plain directory; runc bound tesserad's
/// state directory, where every tenant's MPS pipe directory (and control daemon) is. The
/// start reads the mounts runc made — tesserad's confirmation for a GPU container,
/// tessera-runtime's `start` for one without — and refuses: the entry's filesystem and
/// directory hold the state directory, however the source was spelled.
#[test]
fn a_bind_swapped_for_tesserads_state_is_refused_at_start() {
    let node = Node::start();
    let state = fs::canonicalize(&node.state).unwrap();
    let mut through = Vec::new();
    for (id, tenant, request) in
        [("plainrace", "team-dev", None), ("gpurace", "team-untrusted", Some("mig=1g.10gb"))]
    {
        let mut b =
            node.bundle(id, tenant, request, &["sh", "-c", "ls /x > /tmp/seen; exec sleep 300"]);
        let vol = b.dir().join("vol/data");
        fs::create_dir_all(&vol).unwrap();
        fs::create_dir_all(b.rootfs().join("x")).unwrap();
        b.mutate(|c| {
            c["mounts"].as_array_mut().unwrap().push(json!({"destination": "/x",
                "type": "bind", "source": vol.to_str().unwrap(), "options": ["rbind", "ro"]}))
        })
        .write();
        let racer = racing_runc(&b, "create", &[(&vol, &state)]);
        let created =
            node.fx.create_container_env(&b, id, &[("TESSERA_RUNC", racer.to_str().unwrap())]);
        assert!(
            created.status.success(),
            "{id}: the create saw a plain directory: {}",
            created.stderr_str()
        );
        let started = node.fx.start_container(id);
        let err = started.stderr_str();
        let left = node.fx.status(id);
        node.fx.delete_container(id, true);
        if started.status.success() {
            through.push(format!("{id}: started with tesserad's state directory at /x"));
        } else if !err.contains("tesserad's own") {
            through.push(format!("{id}: refused, but not for tesserad's state: {err}"));
        } else if left.is_some() {
            through.push(format!("{id}: refused but not deleted ({left:?})"));
        }
    }
    assert!(through.is_empty(), "{through:?}");
}
