//! Red-team round 5: classes of config.json input the earlier rounds did not read, run the
//! way rounds 2-4 ran: tesserad on the simulated 8×H100 node, tessera-runtime and
//! tessera-hook as built, real runc 1.1 and the kernel. Every case reads back what runc and
//! the kernel made (files on the host, the host's binfmt_misc table, devices.list), not what
//! Tessera meant.
//!
//! The classes:
//! - **filesystems mounted anew that are the host's own** (`mounts[].type`): Tessera judges
//!   a GPU container's `cgroup`, `cgroup2`, `sysfs` and `proc` mounts and every bind; any
//!   other type passes. runc mounts whatever type the config names, as the host's root,
//!   before any namespace of the container's limits it: `binfmt_misc` and `devtmpfs` have
//!   one instance for the whole host (the initial user namespace's), so the container's
//!   mount is the host's table and the host's `/dev`, writable.
//! - **device rules of another kind** (`linux.resources.devices`): for a GPU container an
//!   allow rule of type `a` and a `c` rule of any major are refused; `b *:* rwm` is kept.
//! - **links in the rootfs under mount destinations** (`mounts[].destination`): the
//!   hostile-rootfs check reads `/dev` only; runc 1.1.5 makes the directories of a `proc`
//!   or `sysfs` destination with a plain join (CVE-2024-45310's class), through the
//!   image's links, on the host.
//!
//! A test that fails here is an attack that got through (its assertion carries the
//! evidence); it passes once its class is closed.

// Integration-test crates: clippy counts helper functions as non-test code, so
// `allow-unwrap-in-tests` (clippy.toml) does not reach them; a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use tessera_harness::attack::*;
use tessera_harness::node::*;
use tessera_harness::*;

/// How long a container is given to do its part before the test reads the result.
const WITHIN: Duration = Duration::from_secs(15);

/// The major of a device number (glibc's `gnu_dev_major`).
fn dev_major(dev: u64) -> u64 {
    ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff)
}

/// The minor of a device number (glibc's `gnu_dev_minor`).
fn dev_minor(dev: u64) -> u64 {
    (dev & 0xff) | ((dev >> 12) & !0xff)
}

/// A refusal must be tessera-runtime's (a runc that cannot make the mount would hide the
/// attack, not stop it).
fn refused_by_tessera(started: &Result<(), String>) {
    if let Err(e) = started {
        assert!(e.contains("tessera-runtime"), "refused, but not by tessera-runtime: {e}");
    }
}

/// Adds capabilities to every set of the config's process (they stay within
/// `spec::GPU_CAPABILITIES`, so a GPU container may hold them).
fn add_caps(c: &mut Value, caps: &[&str]) {
    for set in ["bounding", "effective", "permitted"] {
        let list = c["process"]["capabilities"][set].as_array_mut().unwrap();
        list.extend(caps.iter().map(|s| json!(s)));
    }
}

/// Removes the binfmt_misc entry `name` from the host's table, whoever left it: the
/// container's mount keeps it only while the container lives, but a host that mounts
/// binfmt_misc itself (systemd does, at /proc/sys/fs/binfmt_misc) keeps it after.
struct BinfmtEntry(String);

impl Drop for BinfmtEntry {
    fn drop(&mut self) {
        let host = Path::new("/proc/sys/fs/binfmt_misc");
        if host.join("register").exists() {
            let _ = fs::write(host.join(&self.0), "-1");
            return;
        }
        let dir = short_tempdir();
        let mounted = Command::new("mount")
            .args(["-t", "binfmt_misc", "binfmt_misc"])
            .arg(&dir)
            .status()
            .is_ok_and(|s| s.success());
        if mounted {
            let _ = fs::write(dir.join(&self.0), "-1");
            let _ = Command::new("umount").arg(&dir).status();
        }
        let _ = fs::remove_dir(&dir);
    }
}

/// Class: filesystems mounted anew that are the host's own; `binfmt_misc`.
///
/// An untrusted MIG container's config mounts `binfmt_misc` (a type Tessera never reads).
/// Without a user namespace of its own (GPU containers have none by default), runc mounts
/// the initial user namespace's instance: the host's table of interpreters. The container
/// registers its own `/bin/sh` with the `F` flag (the kernel opens the file at
/// registration, in the container's root) for an extension; from then on, every process of
/// the host that executes a file of that extension runs the container's binary, as
/// itself: here the test (root on the host) executes a file that is no program at all. A
/// magic of `\x7fELF` instead of an extension takes every ELF exec of the node: root on
/// the host, and every other tenant's container (none has a user namespace) running the
/// attacker's code with its own GPUs.
#[test]
fn a_gpu_container_cannot_register_an_interpreter_the_host_runs() {
    register_interpreter("team-untrusted", Some("mig=1g.10gb"));
}

/// The same through a container without a GPU: host root is every GPU of the node.
#[test]
fn a_plain_container_cannot_register_an_interpreter_the_host_runs() {
    register_interpreter("team-dev", None);
}

fn register_interpreter(tenant: &str, request: Option<&str>) {
    let node = Node::start();
    let tag = format!("rtiso{}", std::process::id());
    let _entry = BinfmtEntry(tag.clone());
    let register = format!(
        "echo ':{tag}:E::{tag}::/bin/sh:F' > /bfm/register && touch /tmp/registered; \
         exec sleep 300"
    );
    let mut b = node.bundle("bfm", tenant, request, &["sh", "-c", &register]);
    b.mutate(|c| {
        c["mounts"].as_array_mut().unwrap().push(json!({
            "destination": "/bfm", "type": "binfmt_misc", "source": "binfmt_misc",
            "options": ["nosuid", "noexec", "nodev"]
        }))
    })
    .write();
    let started = create_and_start(&node, &b, "bfm");
    refused_by_tessera(&started);
    let registered = b.rootfs().join("tmp/registered");
    let ran = if started.is_ok() && wait_for(|| registered.exists(), WITHIN) {
        // Not a program: no `#!`, no ELF header. execve(2) fails with ENOEXEC unless an
        // interpreter of binfmt_misc takes it.
        let dir = short_tempdir();
        let marker = dir.join("marker");
        let probe = dir.join(format!("probe.{tag}"));
        fs::write(
            &probe,
            format!("echo \"uid=$(id -u) exe-inode=$(stat -L -c %i /proc/$$/exe)\" > {}\n", {
                marker.display()
            }),
        )
        .unwrap();
        fs::set_permissions(&probe, fs::Permissions::from_mode(0o755)).unwrap();
        let status = Command::new(&probe).status();
        let ran = fs::read_to_string(&marker).ok();
        let _ = fs::remove_dir_all(&dir);
        let _ = status;
        ran
    } else {
        None
    };
    let busybox = fs::metadata(b.rootfs().join("bin/busybox")).unwrap().ino();
    node.fx.delete_container("bfm", true);
    assert!(
        ran.is_none(),
        "a container's ({tenant}, {request:?}) binfmt_misc registration ran on the host: \
         executing a file of its extension there gave `{}` (the container's /bin/busybox is \
         inode {busybox}); create/start: {started:?}",
        ran.unwrap_or_default().trim()
    );
}

/// Class: filesystems mounted anew that are the host's own; `devtmpfs`.
///
/// An untrusted MIG container's config mounts `devtmpfs` at `/hostdev`. There is one
/// devtmpfs: runc mounts the host's `/dev`, writable. With `CAP_MKNOD` (in the GPU
/// allow-list) and runc's default `c *:* m` rule, the container makes a node for GPU 3
/// (another tenant's) in the host's `/dev`, mode 0666, and could as well remove or
/// replace the host's own `/dev/nvidia*` nodes, which the MPS daemons tesserad starts
/// open by path.
#[test]
fn a_gpu_container_cannot_write_the_hosts_dev() {
    let node = Node::start();
    let name = format!("rtiso-{}-nvidia3", std::process::id());
    let planted = PathBuf::from("/dev").join(&name);
    struct Remove(PathBuf);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = fs::remove_file(&self.0);
        }
    }
    let _remove = Remove(planted.clone());
    let plant = format!(
        "mknod /hostdev/{name} c 195 3 && chmod 666 /hostdev/{name}; touch /tmp/done; \
         exec sleep 300"
    );
    let mut b = node.bundle("devfs", "team-untrusted", Some("mig=1g.10gb"), &["sh", "-c", &plant]);
    b.mutate(|c| {
        add_caps(c, &["CAP_MKNOD"]);
        c["mounts"].as_array_mut().unwrap().push(json!({
            "destination": "/hostdev", "type": "devtmpfs", "source": "devtmpfs",
            "options": ["nosuid", "noexec"]
        }))
    })
    .write();
    let started = create_and_start(&node, &b, "devfs");
    refused_by_tessera(&started);
    let done = b.rootfs().join("tmp/done");
    if started.is_ok() {
        wait_for(|| done.exists(), WITHIN);
    }
    let on_host = fs::symlink_metadata(&planted).ok().map(|m| {
        use std::os::unix::fs::FileTypeExt;
        let rdev = m.rdev();
        (m.file_type().is_char_device(), dev_major(rdev), dev_minor(rdev), m.mode() & 0o777)
    });
    node.fx.delete_container("devfs", true);
    assert!(
        on_host.is_none(),
        "an untrusted MIG container wrote the host's /dev through a devtmpfs mount: {} is \
         (char device, major, minor, mode) {on_host:?}; create/start: {started:?}",
        planted.display()
    );
}

/// Class: device rules of another kind; block devices.
///
/// An untrusted MIG container's config carries Docker's `--device-cgroup-rule 'b *:*
/// rwm'`. Tessera refuses `a` rules (allow-all) and a `c` rule of any major for GPU
/// containers, and keeps this one: runc writes `b *:* rwm`, and with `CAP_MKNOD` (in the
/// GPU allow-list) the container reads and writes every block device of the node — its
/// disks, and so every file on them. Shown on a loop device whose backing file the test
/// reads back.
#[test]
fn a_gpu_container_gets_no_host_block_device() {
    let node = Node::start();
    let dir = short_tempdir();
    let backing = dir.join("disk.img");
    fs::write(&backing, vec![b'.'; 1 << 20]).unwrap();
    let out = Command::new("losetup").arg("--find").arg("--show").arg(&backing).output().unwrap();
    assert!(out.status.success(), "losetup: {}", String::from_utf8_lossy(&out.stderr));
    let loopdev = String::from_utf8(out.stdout).unwrap().trim().to_string();
    struct Detach(String, PathBuf);
    impl Drop for Detach {
        fn drop(&mut self) {
            let _ = Command::new("losetup").arg("-d").arg(&self.0).status();
            let _ = fs::remove_dir_all(&self.1);
        }
    }
    let _detach = Detach(loopdev.clone(), dir.clone());
    let rdev = fs::metadata(&loopdev).unwrap().rdev();
    let (major, minor) = (dev_major(rdev), dev_minor(rdev));
    let write = format!(
        "mknod /tmp/disk b {major} {minor} && printf OWNED | dd of=/tmp/disk conv=notrunc \
         2>/dev/null; sync; touch /tmp/done; exec sleep 300"
    );
    let mut b = node.bundle("blk", "team-untrusted", Some("mig=1g.10gb"), &["sh", "-c", &write]);
    b.mutate(|c| {
        add_caps(c, &["CAP_MKNOD"]);
        c["linux"]["resources"]["devices"]
            .as_array_mut()
            .unwrap()
            .push(json!({"allow": true, "type": "b", "major": -1, "minor": -1, "access": "rwm"}));
    })
    .write();
    let started = create_and_start(&node, &b, "blk");
    refused_by_tessera(&started);
    let done = b.rootfs().join("tmp/done");
    if started.is_ok() {
        wait_for(|| done.exists(), WITHIN);
    }
    let list = if started.is_ok() { devices_list(&b.cgroups_path()) } else { String::new() };
    node.fx.delete_container("blk", true);
    let head = fs::read(&backing).unwrap()[..5].to_vec();
    assert!(
        head != b"OWNED",
        "an untrusted MIG container wrote the host's block device {loopdev} ({major}:{minor}): \
         its backing file now starts {:?}; runc's devices.list: {:?}; create/start: {started:?}",
        String::from_utf8_lossy(&head),
        list.lines().filter(|l| l.starts_with('b')).collect::<Vec<_>>()
    );
}

/// Class: links in the rootfs under mount destinations.
///
/// The image carries `/x`, a link to a host directory; the config mounts `sysfs` (read
/// only, as a GPU container may) at `/x/made-by-runc/sub`. runc 1.1.5 checks only the last
/// component of a `proc`/`sysfs` destination and makes its directories with a plain join
/// (`os.MkdirAll(filepath.Join(rootfs, dest))`), through the link, on the host, before it
/// resolves the destination safely and fails. A GPU container and one without a request
/// alike: tessera-runtime's hostile-rootfs check reads `/dev` only. The container never
/// runs; the directories stay on the host, made by root wherever the image points
/// (`/etc`, a cgroup hierarchy: `mkdir` there makes a cgroup).
#[test]
fn an_images_link_under_a_mount_destination_makes_nothing_on_the_host() {
    let node = Node::start();
    let mut made_on_host = Vec::new();
    for (id, request) in [("mkdir-gpu", Some("mig=1g.10gb")), ("mkdir-plain", None)] {
        let host = short_tempdir();
        let mut b = node.bundle(id, "team-untrusted", request, &["true"]);
        std::os::unix::fs::symlink(&host, b.rootfs().join("x")).unwrap();
        b.mutate(|c| {
            c["mounts"].as_array_mut().unwrap().push(json!({
                "destination": "/x/made-by-runc/sub", "type": "sysfs", "source": "sysfs",
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
                "{id}: runc made {} on the host through the image's link /x -> {}; \
                 create/start: {started:?}",
                made.display(),
                host.display()
            ));
        }
    }
    assert!(made_on_host.is_empty(), "{made_on_host:#?}");
}

/// A cgroup of this test's own in every v1 hierarchy, removed (and anything left in it
/// killed: ours) when dropped.
struct OwnCgroup(String);

impl OwnCgroup {
    /// Makes `/<name>` in every hierarchy (cpuset given its parent's CPUs and memory nodes)
    /// and moves process `pid` into it, as systemd puts a service into its unit's cgroup.
    fn with_process(pid: u32) -> OwnCgroup {
        let g = OwnCgroup(format!("/{}-svc", unique_name()));
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

impl Drop for OwnCgroup {
    fn drop(&mut self) {
        remove_cgroup_tree(&self.0);
    }
}

/// Class: `linux.cgroupsPath` naming the cgroup of the node's own GPU service.
///
/// tesserad runs in a cgroup of its own (systemd's `tesserad.service`), and so do the MPS
/// control daemons and servers it starts for every tenant (their children, kept there by
/// `KillMode=process`). Tessera keeps every container out of a *grant's* cgroup, and a GPU
/// container out of any cgroup that holds a process; a container without a request may
/// name any other. runc 1.1 only warns and joins it: it writes the container's device
/// rules (deny all, its defaults) into the devices cgroup tesserad and every tenant's MPS
/// server open the GPUs through, and its limits, freezer and `kill --all` reach them (a
/// container without a pid namespace of its own SIGKILLs the whole cgroup at `delete`).
/// Here tesserad is put in a cgroup of its own as systemd would; an `mps=25` share of
/// team-research starts its MPS daemon there; then a plain container of team-dev names that
/// cgroup.
#[test]
fn a_plain_container_cannot_join_the_cgroup_of_tesserad_and_its_mps_daemons() {
    // Declared first, dropped last: after tesserad has stopped.
    let svc: OwnCgroup;
    let mut node = Node::start_with(NodeOptions {
        extra_args: vec!["--mps-control".into(), fresh_bin("fake-nvidia-cuda-mps-control").into()],
        ..Default::default()
    });
    svc = OwnCgroup::with_process(node.daemon.pid());
    let mut daemons = KillOnDrop(Vec::new());
    let b = node.bundle("share", "team-research", Some("mps=25"), &["sleep", "300"]);
    node.fx.run_detached(&b, "share");
    daemons.0.extend(node.client().status().unwrap().mps_shares.iter().filter_map(|s| s.pid));
    let svc_dir = Path::new("/sys/fs/cgroup/devices").join(svc.0.trim_start_matches('/'));
    let in_svc = cgroup_procs(&svc_dir);
    assert!(!daemons.0.is_empty(), "the share started an MPS daemon");
    assert!(
        daemons.0.iter().all(|d| in_svc.contains(&(*d as i32))),
        "the MPS daemons {:?} run in tesserad's cgroup {in_svc:?}",
        daemons.0
    );
    let before = fs::read_to_string(svc_dir.join("devices.list")).unwrap();

    let mut plain = node.bundle("intruder", "team-dev", None, &["sleep", "300"]);
    plain.set_cgroups_path(&svc.0).write();
    let started = create_and_start(&node, &plain, "intruder");
    let after = fs::read_to_string(svc_dir.join("devices.list")).unwrap();
    node.fx.delete_container("intruder", true);
    node.fx.delete_container("share", true);
    assert!(node.daemon.is_running(), "tesserad still runs");
    assert!(
        after == before,
        "a plain container of team-dev joined the cgroup of tesserad and of team-research's \
         MPS daemon (pids {in_svc:?}) and runc rewrote its device rules: before {:?}, after \
         {:?} (no GPU opens for them); create/start: {started:?}",
        before.trim(),
        after.trim()
    );
    drop(daemons);
}

/// Sets a sysctl back to what it was when dropped.
struct Sysctl(PathBuf, String);

impl Drop for Sysctl {
    fn drop(&mut self) {
        let _ = fs::write(&self.0, &self.1);
    }
}

/// Class: `linux.readonlyPaths` / `linux.maskedPaths`, which runc applies as written.
///
/// runc makes `/proc/sys` and `/proc/sysrq-trigger` read-only only because the config lists
/// them; Tessera never reads the list. An untrusted MIG container whose config lists
/// nothing (no capability beyond Docker's defaults, no user namespace: a GPU container's
/// normal shape) writes the host's global sysctls as the host's root: here
/// `kernel.printk_ratelimit_burst`, read back on the host; the same write reaches
/// `kernel.core_pattern` (`|/proc/%P/root/payload` runs the container's file as the host's
/// root at its next crash) and `/proc/sysrq-trigger` (reboots the node).
#[test]
fn a_gpu_container_cannot_write_the_hosts_sysctls() {
    write_sysctls("team-untrusted", Some("mig=1g.10gb"), "/proc");
}

/// The same through a container without a GPU (host root is every GPU of the node).
#[test]
fn a_plain_container_cannot_write_the_hosts_sysctls() {
    write_sysctls("team-dev", None, "/proc");
}

/// The same through a second `proc` mounted elsewhere than `/proc` (runc protects
/// `/proc/sys` by path: `/proc2/sys` is writable), the config's own lists left as they are.
#[test]
fn a_second_proc_is_no_way_to_the_hosts_sysctls() {
    write_sysctls("team-untrusted", Some("mig=1g.10gb"), "/proc2");
}

fn write_sysctls(tenant: &str, request: Option<&str>, proc_at: &str) {
    let node = Node::start();
    let path = PathBuf::from("/proc/sys/kernel/printk_ratelimit_burst");
    let was = fs::read_to_string(&path).unwrap().trim().to_string();
    let _restore = Sysctl(path.clone(), was.clone());
    let new = was.parse::<u64>().unwrap() + 7;
    let write = format!(
        "echo {new} > {proc_at}/sys/kernel/printk_ratelimit_burst; \
         cat {proc_at}/sys/kernel/core_pattern > /tmp/cp && \
         cat /tmp/cp > {proc_at}/sys/kernel/core_pattern \
         && echo core_pattern-writable > /tmp/cp-written; touch /tmp/done; exec sleep 300"
    );
    let mut b = node.bundle("sysctl", tenant, request, &["sh", "-c", &write]);
    b.mutate(|c| {
        if proc_at == "/proc" {
            c["linux"]["readonlyPaths"] = json!([]);
            c["linux"]["maskedPaths"] = json!([]);
        } else {
            c["mounts"].as_array_mut().unwrap().push(json!({
                "destination": proc_at, "type": "proc", "source": "proc"
            }));
        }
    })
    .write();
    let started = create_and_start(&node, &b, "sysctl");
    refused_by_tessera(&started);
    if started.is_ok() {
        wait_for(|| b.rootfs().join("tmp/done").exists(), WITHIN);
    }
    let now = fs::read_to_string(&path).unwrap().trim().to_string();
    let core_pattern = b.rootfs().join("tmp/cp-written").exists();
    node.fx.delete_container("sysctl", true);
    assert_eq!(
        now, was,
        "a container ({tenant}, {request:?}, proc at {proc_at}) wrote the host's \
         kernel.printk_ratelimit_burst ({was} -> {now}); kernel.core_pattern writable too: \
         {core_pattern}; create/start: {started:?}"
    );
}
