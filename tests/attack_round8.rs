//! Red-team round 8 (branch rt-iso4): the round-8 fix (74c6149) read as runc 1.1.5 and the
//! kernel carry it out. A container without a GPU request that sees processes outside its
//! own pid namespace (`spec::check_process_view`: no pid namespace of its own, one joined by
//! path, or a bind that `mounts::procfs_bind` finds bringing a procfs along) is refused
//! where Yama's `ptrace_scope` is below 1 (this VM's kernel has no Yama: refused here). Run
//! as rounds 5 and 6 run: tesserad on the simulated node, tessera-runtime and tessera-hook as
//! built, real runc and the kernel; each case reads back what the kernel let the spy do.
//!
//! A test that fails here is an attack that got through.
//!
//! Tried and stopped (runc 1.1.5, this VM, no Yama): a plain spy in the host's pid
//! namespace; a plain spy binding `/proc/self/root/proc`, or an image link
//! `lnk -> /proc/self/root/proc` (both resolved on the host to its `/proc`: refused); a GPU
//! spy binding `rootfs/proc/self/root/proc` (refused: an earlier mount's destination); a
//! GPU spy with the host's procfs at `/hostproc` through a path missing at check time
//! (tesserad's start check: a procfs outside `/proc`).

#![allow(clippy::unwrap_used)]

use std::fs;
use std::time::Duration;

use serde_json::{json, Value};
use tessera_harness::attack::*;
use tessera_harness::node::*;
use tessera_harness::*;

const WITHIN: Duration = Duration::from_secs(15);

/// The spy's script: the victim's first mapping, 16 bytes of it read from its `mem` through
/// the procfs at `proc_dir` (attach mode, as `pidfd_getfd`), and what that procfs's pid 1 is
/// called; `/tmp/read` holds the count of bytes read, `/tmp/comm1` the name.
fn spy_script(proc_dir: &str, pid: i32) -> String {
    format!(
        "cat {proc_dir}/1/comm > /tmp/comm1 2>&1; \
         a=$(head -n1 {proc_dir}/{pid}/maps | cut -d- -f1); \
         dd if={proc_dir}/{pid}/mem of=/tmp/stolen bs=1 skip=$((0x$a)) count=16 2>/dev/null; \
         wc -c < /tmp/stolen > /tmp/read; touch /tmp/done; exec sleep 300"
    )
}

/// Starts the GPU container `victim` (team-trusted, `gpu=1`), then the spy (`tenant`,
/// `request`, `edit` applied to its config, `prepare` run on its bundle before it is
/// written) that reads the victim's memory through the procfs at `proc_dir`. Returns what
/// got through (empty: refused, or the kernel refused the read), with what the spy saw.
fn spy_on_gpu_container(
    id: &str,
    tenant: &str,
    request: Option<&str>,
    proc_dir: &str,
    prepare: impl FnOnce(&Bundle),
    edit: impl FnOnce(&mut Value, &Bundle),
) -> Vec<String> {
    let node = Node::start();
    let mut victim = node.bundle("victim", "team-trusted", Some("gpu=1"), &["sleep", "300"]);
    victim.write();
    create_and_start(&node, &victim, "victim").expect("the GPU container runs");
    let pid = node.fx.container_pid("victim").expect("the GPU container's pid");
    let mut spy = node.bundle(id, tenant, request, &["sh", "-c", &spy_script(proc_dir, pid)]);
    prepare(&spy);
    let copy = spy.clone();
    spy.mutate(|c| edit(c, &copy)).write();
    let started = create_and_start(&node, &spy, id);
    let mut through = Vec::new();
    match &started {
        Ok(()) => {
            wait_for(|| spy.rootfs().join("tmp/done").exists(), WITHIN);
            let read = fs::read_to_string(spy.rootfs().join("tmp/read")).unwrap_or_default();
            let comm = fs::read_to_string(spy.rootfs().join("tmp/comm1")).unwrap_or_default();
            let stolen = fs::read(spy.rootfs().join("tmp/stolen")).unwrap_or_default();
            let grant: Vec<_> = node.grants().into_iter().filter(|g| g.0 == id).collect();
            if !matches!(read.trim(), "" | "0") {
                through.push(format!(
                    "{id} (grant: {grant:?}): read {} bytes of the GPU container's memory \
                     ({stolen:02x?}) through {proc_dir}, whose pid 1 is {:?} (the host's: {:?})",
                    read.trim(),
                    comm.trim(),
                    fs::read_to_string("/proc/1/comm").unwrap_or_default().trim()
                ));
            }
        }
        Err(e) => {
            assert!(e.contains("tessera-runtime"), "refused, but not by tessera-runtime: {e}")
        }
    }
    node.fx.delete_container(id, true);
    node.fx.delete_container("victim", true);
    through
}

/// Class: a procfs brought along by a bind the check resolves on the host *before* runc
/// made the container's earlier mounts.
///
/// `mounts::procfs_bind` resolves a bind's source on the host now (`canonical`, lexically
/// where it does not exist yet) and asks the host's mount table whether a procfs holds it.
/// runc 1.1.5 makes the mounts in order, in the container's mount namespace, with its init
/// still rooted at the host's `/`, and resolves a bind's source there. A bind of
/// `rootfs/proc/self/root/proc` after the config's own `proc` at `/proc`: on the host,
/// `rootfs/proc` is an empty directory of the image, `self` is missing, and the path
/// (lexically inside the bundle, on its ext4/overlay) holds no procfs: refused by nothing
/// (round 6's `check_proc_binds` lets read-only binds of the container's own proc be). In
/// runc's init, `rootfs/proc` is the container's procfs, `self` is runc's init, its `root`
/// the host's `/`, and `proc` below it the host's procfs (the mount namespace's copy of
/// it): the spy, in a pid namespace of its own, gets every process of the host at
/// `/hostproc`.
///
/// Seen with runc 1.1.5 on this VM (no Yama): the spy's `/hostproc/1/comm` is the host's
/// pid 1, and it read 16 bytes of the GPU container's memory from `/hostproc/<pid>/mem`.
#[test]
fn a_plain_container_cannot_bind_the_hosts_procfs_through_its_own_procs_self_root() {
    let through = spy_on_gpu_container(
        "selfroot",
        "team-dev",
        None,
        "/hostproc",
        |b| fs::create_dir_all(b.rootfs().join("hostproc")).unwrap(),
        |c, _| {
            c["mounts"].as_array_mut().unwrap().push(json!({"destination": "/hostproc",
                "type": "bind", "source": "rootfs/proc/self/root/proc", "options": ["rbind", "ro"]}))
        },
    );
    assert!(
        through.is_empty(),
        "a container without a GPU read a GPU container's memory: {through:?}"
    );
}

/// Class: a GPU container of another tenant reaching a GPU container's process, through a
/// bind whose source the GPU path's `mounts::check_bind` resolves lexically because it does
/// not exist yet.
///
/// `check_bind` resolves an absolute source with `canonical` and, where that fails (a
/// path that does not exist yet), `clean`s it lexically; a lexical result inside the bundle
/// that meets an earlier mount's destination is refused, one outside it is let be ("a
/// source that is still missing then fails runc's mount"). The spy's image holds
/// `imgdir/l -> /proc/self/fd`; its config binds `rootfs/imgdir` at `/nd` (allowed: the
/// image's own directory), then binds `<bundle>/rootfs/nd/l/../../../../proc` over its
/// `/proc`. On the host now `rootfs/nd` is missing, so the source is cleaned lexically to
/// `<bundle's parent>/proc`: neither under `/proc`, nor in the bundle, nor existing: passed.
/// In runc's init `rootfs/nd` is `imgdir`, `l` the host's `/proc/self/fd` (its root is
/// still the host's `/`), two `..` the host's `/proc`, two more `/`, then `/proc`: the
/// host's procfs. runc 1.1.5 lets a bind onto `/proc` be when its source is a procfs
/// (`checkProcMount`), and tesserad's start check (`mountinfo::findings`) looks for a procfs
/// mounted *outside* `/proc` only. The spy (team-dev, `gpu=1`, a pid namespace of its own)
/// sees every process of the host at `/proc`.
///
/// Seen with runc 1.1.5 on this VM: the spy was granted `gpu=1` (tesserad's grant list),
/// its `/proc/1/comm` is the host's pid 1, and it read 16 bytes of the other tenant's GPU
/// container's memory (its ELF header) from `/proc/<pid>/mem`. The same bind at
/// `/hostproc` instead was refused at start by tesserad ("/hostproc is a procfs other than
/// the container's /proc"): only the destination `/proc` gets past it.
#[test]
fn a_gpu_container_cannot_bind_the_hosts_procfs_over_its_proc_through_a_missing_path() {
    let through = spy_on_gpu_container(
        "gpuspy",
        "team-dev",
        Some("gpu=1"),
        "/proc",
        |b| {
            fs::create_dir_all(b.rootfs().join("imgdir")).unwrap();
            std::os::unix::fs::symlink("/proc/self/fd", b.rootfs().join("imgdir/l")).unwrap();
        },
        |c, b| {
            let source = format!("{}/rootfs/nd/l/../../../../proc", b.dir().display());
            let mounts = c["mounts"].as_array_mut().unwrap();
            mounts.push(json!({"destination": "/nd", "type": "bind", "source": "rootfs/imgdir",
                "options": ["bind", "ro"]}));
            mounts.push(json!({"destination": "/proc", "type": "bind", "source": source,
                "options": ["bind"]}));
        },
    );
    assert!(
        through.is_empty(),
        "a GPU container of another tenant read a GPU container's memory: {through:?}"
    );
}

/// A node whose MPS shares run the control test double (as `tests/mps.rs` runs them).
fn mps_node() -> Node {
    Node::start_with(NodeOptions {
        extra_args: vec![
            "--mps-control".into(),
            fresh_bin("fake-nvidia-cuda-mps-control").into(),
            "--mps-health-interval-ms".into(),
            "200".into(),
        ],
        ..Default::default()
    })
}

/// Starts an `mps=50` container of team-trusted (`victim`), then a spy (`tenant`,
/// `request`) that binds the victim tenant's MPS pipe directory (a host path under
/// tesserad's state directory, from the share's device and tenant) and the control client
/// and sends `get_server_list`, then `quit`, to the victim's control daemon. Returns what
/// got through, with what the spy and the double saw.
fn spy_on_mps_daemon(id: &str, tenant: &str, request: Option<&str>) -> Vec<String> {
    let node = mps_node();
    let victim = node.bundle("victim", "team-trusted", Some("mps=50"), &["sleep", "300"]);
    node.fx.run_detached(&victim, "victim");
    let a = node.client().allocation("victim").expect("the victim's grant");
    let device = a.share.as_ref().expect("an MPS share").device.clone();
    let dirs = mpsd::layout::ShareDirs::new(&node.state, None, &device, &a.tenant).expect("dirs");
    let pipe = dirs.pipe.clone();
    let daemon = mps_double::FakeState::read(&pipe).expect("the victim's daemon").pid;
    let script = "echo get_server_list | /opt/mps-client > /tmp/list 2>&1; \
                  echo quit | /opt/mps-client > /tmp/quit 2>&1; touch /tmp/done; exec sleep 300";
    let mut spy = node.bundle(id, tenant, request, &["sh", "-c", script]);
    let ro = |src: &str, dst: &str| json!({"destination": dst, "type": "bind", "source": src, "options": ["rbind", "ro"]});
    let pipe_src = pipe.display().to_string();
    spy.mutate(|c| {
        let mounts = c["mounts"].as_array_mut().unwrap();
        mounts.push(ro(fresh_bin("fake-nvidia-cuda-mps-control"), "/opt/mps-client"));
        mounts.push(ro("/lib", "/lib"));
        mounts.push(ro("/lib64", "/lib64"));
        // Where a request's own pipe directory would be; the victim tenant's instead.
        mounts.push(ro(&pipe_src, "/tmp/nvidia-mps"));
    })
    .write();
    let started = create_and_start(&node, &spy, id);
    let mut through = Vec::new();
    match &started {
        Ok(()) => {
            wait_for(|| spy.rootfs().join("tmp/done").exists(), WITHIN);
            let list = fs::read_to_string(spy.rootfs().join("tmp/list")).unwrap_or_default();
            let commands =
                mps_double::FakeState::read(&pipe).map(|s| s.commands).unwrap_or_default();
            let gone = wait_for(|| !pid_alive(daemon as i32, None), Duration::from_secs(5));
            let grant: Vec<_> = node.grants().into_iter().filter(|g| g.0 == id).collect();
            if commands.iter().any(|c| c == "quit") || gone {
                through.push(format!(
                    "{id} ({tenant}, grant {grant:?}): the victim tenant's control daemon {daemon} \
                     ({}) got {commands:?} (server list the spy read: {:?}); daemon gone: {gone}",
                    pipe.display(),
                    list.trim()
                ));
            }
        }
        Err(e) => {
            assert!(e.contains("tessera-runtime"), "refused, but not by tessera-runtime: {e}")
        }
    }
    node.fx.delete_container(id, true);
    node.fx.delete_container("victim", true);
    through
}

/// Class: a container without a GPU reaching a GPU container's MPS daemon.
///
/// A container without a GPU request has its binds judged only for proc, sysfs and cgroup
/// views (`mounts::check_proc_binds`, round 8's `procfs_bind`); the MPS pipe directory of
/// each (device, tenant) share is a plain directory under tesserad's state directory, its
/// path known from the device and the tenant. A plain spy (team-dev) binds team-trusted's
/// pipe directory read-only at `/tmp/nvidia-mps` (`connect()` works through a read-only
/// mount, docs/SECURITY.md section 3) and talks to that tenant's control daemon as an
/// admin: `get_server_list`, then `quit` (or `shutdown_server <pid>`, `terminate_client`,
/// `set_active_thread_percentage` of the victim's server).
///
/// Seen with runc 1.1.5 and the control double: the double's command log ends with the
/// spy's `quit`, and the victim tenant's control daemon (its pid from the pipe directory's
/// state) is gone while the victim's `mps=50` container still runs. (docs/SECURITY.md's
/// trust table leaves host mounts to the engine's admission; no check here stops this
/// path, and it is a plain directory under tesserad's state directory, not a view the
/// admission knows to refuse.)
#[test]
fn a_plain_container_cannot_reach_another_tenants_mps_control_daemon() {
    let through = spy_on_mps_daemon("mpsspy", "team-dev", None);
    assert!(through.is_empty(), "another tenant's MPS daemon reached: {through:?}");
}

/// Class: a GPU container of another tenant reaching a GPU container's MPS daemon: the
/// same bind from a GPU container (team-dev, `gpu=1`). `mounts::check_bind` judges a GPU
/// container's binds for procfs, cgroup and sysfs views; another tenant's MPS pipe
/// directory is none of them, and tesserad's start check looks at the same kinds.
///
/// Seen with runc 1.1.5 and the control double: the spy was granted `gpu=1`; the double
/// logged its `quit` and the victim tenant's control daemon is gone.
#[test]
fn a_gpu_container_cannot_reach_another_tenants_mps_control_daemon() {
    let through = spy_on_mps_daemon("gpumpsspy", "team-dev", Some("gpu=1"));
    assert!(through.is_empty(), "another tenant's MPS daemon reached: {through:?}");
}

/// Class: as the test above, a GPU container of another tenant with the host's procfs over
/// its `/proc`, here through a link of its image into an earlier mount's destination.
///
/// `check_bind` refuses a source inside the bundle where an earlier mount of the config
/// lands, comparing paths *lexically* when the source does not exist yet. The spy's image
/// holds `lnk -> proc` (relative: the rootfs's own `proc` directory); its config binds
/// `rootfs/lnk/self/root/proc` over `/proc`, after the config's `proc` mount there. On the
/// host now `rootfs/lnk` leads to the image's empty `proc` directory and `self` is missing:
/// the lexical `<bundle>/rootfs/lnk/self/root/proc` is neither at nor above `rootfs/proc`,
/// so no earlier mount is found and a missing source is let be. In runc's init `lnk` leads
/// to the container's procfs, `self` is runc's init, its `root` the host's `/` (before
/// pivot_root), and `proc` the host's procfs; runc lets a bind onto `/proc` be when its
/// source is a procfs, and tesserad's start check looks for one outside `/proc` only.
///
/// Seen with runc 1.1.5 on this VM: see the assertion's message (the grant, the host's pid
/// 1 in the spy's `/proc`, the bytes read).
#[test]
fn a_gpu_container_cannot_bind_the_hosts_procfs_through_a_link_to_its_own_proc() {
    let through = spy_on_gpu_container(
        "gpulink",
        "team-dev",
        Some("gpu=1"),
        "/proc",
        |b| std::os::unix::fs::symlink("proc", b.rootfs().join("lnk")).unwrap(),
        |c, _| {
            c["mounts"].as_array_mut().unwrap().push(json!({"destination": "/proc",
                "type": "bind", "source": "rootfs/lnk/self/root/proc", "options": ["bind"]}))
        },
    );
    assert!(
        through.is_empty(),
        "a GPU container of another tenant read a GPU container's memory: {through:?}"
    );
}
