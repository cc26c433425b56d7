//! Red-team round 10 (branch rt-iso6): round 9's fixes (7a6eecb) — a plain `runc run`
//! judged in the `tessera-hook plain-prestart` hook, an exec into a plain container judged
//! on what runc made, the joined-pid-namespace exemption for pods — read as runc 1.1.5 and
//! the kernel carry them out. Run as rounds 6, 8 and 9 run: tesserad on the simulated node,
//! tessera-runtime and tessera-hook as built, real runc and the kernel; each case reads back
//! what the kernel let the spy do.
//!
//! A test that fails here is an attack that got through (or, where its doc says so, a
//! false refusal of a common case).
//!
//! Tried and stopped, with runc 1.1.5: a `createContainer` hook that binds the host's
//! `/proc`, through `create` + `start` (refused at `start`, plain and GPU alike — only `run`
//! lets it through); a `poststart` hook mounting a procfs through `mount -N` into a created
//! plain container (refused at `start`: runc 1.1.5 runs poststart hooks at `create`).
//! Read in the code, not run: a `startContainer` hook (runs after `pivot_root`, with the
//! container's own capabilities: nothing of the host's left to mount); tesserad's
//! per-container report tmpfs reaching a plain container by propagation (made in
//! tesserad's state directory, which no plain container may bind); the exemption through
//! a stopped sandbox's record whose init pid the kernel gives to a GPU container's process
//! (`is_a_plain_containers_pid_namespace` reads `init_process_pid` with no start time; not
//! forced here); a plain container rebinding the host's driver libraries by propagation
//! (`rootfsPropagation: rshared` with a read-only bind of their directory: the engine's
//! host mount, not run).

#![allow(clippy::unwrap_used)]

use std::fs;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use tessera_harness::attack::*;
use tessera_harness::node::*;
use tessera_harness::*;

fn hook(args: &[&str]) -> Value {
    json!({"path": "/bin/sh", "args": args})
}

/// Class: the `plain-prestart` judgement runs before the hooks runc runs after it — a
/// `runc run` of a container without a GPU whose config carries a `createContainer` hook.
///
/// tessera-runtime appends `tessera-hook plain-prestart` to `hooks.prestart` and keeps the
/// config's other hooks (`createContainer` ones too: `spec::tests::hooks_get_only_the_
/// socket_env`). runc 1.1.5 runs, in `prepareRootfs`, the mounts, then (through the parent)
/// `prestart` then `createRuntime` hooks, then — in the container's mount namespace, still
/// before `pivot_root`, with every capability, its working directory the rootfs — the
/// `createContainer` hooks, then `pivot_root`. So whatever a `createContainer` hook (or a
/// `createRuntime` one) mounts is made after the only judgement a `run` gets; with
/// `create` + `start` the same mount is judged (and refused) at `start`. docs/SECURITY.md
/// ("what the kernel made") names "a prestart hook of the engine's that mounts" as what
/// this judgement catches; a hook of the next stages is not caught. Here the hook is
/// `/bin/sh -c 'mount --rbind /proc hostproc'` (a host binary, nothing of the attacker's on
/// the host): the host's procfs as it is before `pivot_root`.
///
/// Seen with runc 1.1.5: the config runc got carries tessera's `tessera-hook plain-prestart`
/// as its (only) prestart hook, and the run went through it; runc ran the createContainer
/// hook (relative `hostproc`: its working directory was
/// the rootfs) and the container's process; the spy, in a pid namespace of its own, read 16
/// bytes of the GPU container's memory through `/hostproc/<pid>/mem` (the host's procfs).
/// (`/hostproc/1/root` itself was refused, EACCES: the host's init holds capabilities the
/// spy lacks.) The run's exit is the script's. The same config through tessera-runtime's
/// `create` + `start` is refused at `start` ("/hostproc is a procfs of a pid namespace that
/// cannot be read ..."): only `run` lets it through. (A `poststart` hook that mounts a
/// procfs through `mount -N` is refused at `start` too: runc 1.1.5 runs poststart hooks at
/// `create`.)
#[test]
fn a_mount_made_by_a_create_container_hook_after_the_plain_prestart_judgement_is_judged() {
    let node = Node::start();
    let pid = victim(&node);
    let script = read_mem(&format!("/hostproc/{pid}"));
    let mut spy = node.bundle("hookspy", "team-dev", None, &["sh", "-c", &script]);
    fs::create_dir_all(spy.rootfs().join("hostproc")).unwrap();
    spy.mutate(|c| {
        c["hooks"]["createContainer"] =
            json!([hook(&["sh", "-c", "mount --rbind /proc hostproc"])]);
    })
    .write();
    let dir = spy.dir().to_string_lossy().into_owned();
    let ran = node.fx.runc(&["run", "--bundle", &dir, "hookspy"], &[]);
    let read = fs::read_to_string(spy.rootfs().join("tmp/read")).unwrap_or_default();
    let config: Value = serde_json::from_slice(&fs::read(spy.config_path()).unwrap()).unwrap();
    let prestart = config["hooks"]["prestart"].clone();
    node.fx.delete_container("hookspy", true);
    node.fx.delete_container("victim", true);
    assert!(
        count(&read) == 0,
        "runc run of a plain container with a createContainer hook that binds the host's /proc \
         (exit {:?}, stderr {:?}; the prestart hooks runc ran: {prestart}): it read {} bytes \
         of the GPU container {pid}'s memory",
        ran.status.code(),
        ran.stderr_str(),
        read.trim()
    );
}

/// Class: the joined-pid-namespace exemption (`confirm::is_a_plain_containers_pid_
/// namespace`) judges the path it is given, not the namespace runc joins.
///
/// The exemption `stat`s the config's `linux.namespaces[pid].path` (following links) and
/// lets it through when that file is the pid namespace of a plain container's init in the
/// same runc root (a pod's sandbox). runc 1.1.5's `nsexec` opens that path again, later,
/// following links. Here the path is a link in a directory the attacker writes
/// (`vol/ns`), pointing at the plain sandbox's `/proc/<pid>/ns/pid` while tessera-runtime
/// checks; the racer (round 6's stand-in) repoints it at the GPU container's
/// `/proc/<pid>/ns/pid` before runc runs. The spy is then a member of the GPU container's
/// pid namespace; runc mounts its `/proc` from inside it, so that procfs shows the spy's
/// own namespace and the start check (`judge_plain_made`: own namespace not the host's,
/// every procfs showing it) passes it.
///
/// Seen with runc 1.1.5 (plain sandbox `sandbox`, GPU container `victim`, spy created and
/// started through tessera-runtime): the start exits 0; the spy's init is in the GPU
/// container's pid namespace (`pid:[…]` the same link as the GPU container's init's, not the
/// sandbox's); its `/proc/1` is the GPU container's `sleep 300` (the sandbox runs
/// `sleep 301`), and it read 16 bytes of its memory through `/proc/1/mem`.
#[test]
fn a_joined_pid_namespace_linked_to_a_sandbox_at_the_check_cannot_be_the_gpu_containers() {
    let node = Node::start();
    let pid = victim(&node);
    // `sleep 301`: told apart from the GPU container's `sleep 300`.
    let mut sandbox = node.bundle("sandbox", "team-dev", None, &["sleep", "301"]);
    sandbox.write();
    create_and_start(&node, &sandbox, "sandbox").expect("the plain sandbox runs");
    let sandbox_pid = node.fx.container_pid("sandbox").expect("the sandbox's pid");
    let script = format!("cat /proc/1/cmdline > /tmp/cmdline; {}; sleep 300", read_mem("/proc/1"));
    let mut spy = node.bundle("nsspy", "team-dev", None, &["sh", "-c", &script]);
    let vol = spy.dir().join("vol");
    fs::create_dir_all(&vol).unwrap();
    let link = vol.join("ns");
    let sandbox_ns = format!("/proc/{sandbox_pid}/ns/pid");
    std::os::unix::fs::symlink(&sandbox_ns, &link).unwrap();
    spy.mutate(|c| {
        for n in c["linux"]["namespaces"].as_array_mut().unwrap() {
            if n["type"] == "pid" {
                n["path"] = json!(link.to_str().unwrap());
            }
        }
    })
    .write();
    let victim_ns = format!("/proc/{pid}/ns/pid");
    let racer = racing_runc(&spy, "create", &[(&link, Path::new(&victim_ns))]);
    let created =
        node.fx.create_container_env(&spy, "nsspy", &[("TESSERA_RUNC", racer.to_str().unwrap())]);
    let started = if created.status.success() {
        Ok(node.fx.start_container("nsspy"))
    } else {
        Err(created.stderr_str())
    };
    std::thread::sleep(Duration::from_secs(3));
    let read = fs::read_to_string(spy.rootfs().join("tmp/read")).unwrap_or_default();
    let cmdline = fs::read_to_string(spy.rootfs().join("tmp/cmdline")).unwrap_or_default();
    let ns = |p: i32| fs::read_link(format!("/proc/{p}/ns/pid")).ok();
    let joined = node.fx.container_pid("nsspy").and_then(ns);
    let (gpu_ns, sandbox_ns) = (ns(pid), ns(sandbox_pid));
    node.fx.delete_container("nsspy", true);
    node.fx.delete_container("sandbox", true);
    node.fx.delete_container("victim", true);
    let start = started.as_ref().map(|o| (o.status.code(), o.stderr_str()));
    assert!(
        count(&read) == 0,
        "a plain container joined the GPU container {pid}'s pid namespace (start {start:?}): \
         its init's namespace {joined:?} (the GPU container's {gpu_ns:?}, the sandbox's \
         {sandbox_ns:?}); its /proc/1 is {:?}, and it read {} bytes of its memory",
        cmdline.replace('\0', " "),
        read.trim()
    );
}

/// Class: as `a_mount_made_by_a_create_container_hook_after_the_plain_prestart_judgement_
/// is_judged`, for a GPU container: tesserad's confirmation of a `runc run` (the prestart
/// hook, before `pivot_root`: the mounts at or below the root, docs/SECURITY.md "what the
/// kernel made") runs before runc's `createContainer` hooks.
///
/// Seen with runc 1.1.5: a GPU container of another tenant (`team-untrusted`,
/// `mig=1g.10gb`, granted: its config carries `tessera.io/allocated` = a MIG uuid) run with
/// `hooks.createContainer` = `/bin/sh -c 'mount --rbind /proc hostproc'` exits 0; it read
/// 16 bytes of the first GPU container's memory through `/hostproc/<pid>/mem`. The same
/// config through `create` + `start` is refused at `start` (tesserad answered 403: "/hostproc
/// is a procfs other than the container's /proc").
#[test]
fn a_gpu_containers_run_is_confirmed_after_its_create_container_hooks_mounts() {
    let node = Node::start();
    let pid = victim(&node);
    let script = read_mem(&format!("/hostproc/{pid}"));
    let mut spy =
        node.bundle("gpuhookspy", "team-untrusted", Some("mig=1g.10gb"), &["sh", "-c", &script]);
    fs::create_dir_all(spy.rootfs().join("hostproc")).unwrap();
    spy.mutate(|c| {
        c["hooks"]["createContainer"] =
            json!([hook(&["sh", "-c", "mount --rbind /proc hostproc"])]);
    })
    .write();
    let dir = spy.dir().to_string_lossy().into_owned();
    let ran = node.fx.runc(&["run", "--bundle", &dir, "gpuhookspy"], &[]);
    let read = fs::read_to_string(spy.rootfs().join("tmp/read")).unwrap_or_default();
    let config: Value = serde_json::from_slice(&fs::read(spy.config_path()).unwrap()).unwrap();
    let granted = config["annotations"][runtime_hook::spec::ALLOCATED_ANNOTATION].clone();
    node.fx.delete_container("gpuhookspy", true);
    node.fx.delete_container("victim", true);
    assert!(
        count(&read) == 0,
        "runc run of a GPU container (granted {granted}) with a createContainer hook that binds \
         the host's /proc (exit {:?}, stderr {:?}): it read {} bytes of the GPU container \
         {pid}'s memory",
        ran.status.code(),
        ran.stderr_str(),
        read.trim()
    );
}

/// Detaches a test's shared tmpfs (and every mount propagated under it) on the way out.
struct SharedMount(std::path::PathBuf);

impl SharedMount {
    fn new(at: &Path) -> SharedMount {
        fs::create_dir_all(at).unwrap();
        let sh = |c: &str| std::process::Command::new("sh").args(["-c", c]).status().unwrap();
        let at_s = at.display();
        assert!(sh(&format!("mount -t tmpfs tessera-vols {at_s} && mount --make-shared {at_s}"))
            .success());
        SharedMount(at.to_path_buf())
    }
}

impl Drop for SharedMount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Class: mounts that reach a plain container after its judgement — propagation. A
/// started plain container's volume receives, through the kernel's mount propagation, a
/// mount another container's `runc create` makes, before that container's own start is
/// judged (and refused).
///
/// `judge_plain_made` (at start, before an exec, in the `run` hook) reads the table as it
/// is then, and — unlike tesserad's confirmation of a GPU container — does not refuse a
/// mount that receives propagation (`master:`/`shared:`), nor does the create refuse
/// `rootfsPropagation: rshared` or a slave bind for a plain container. With runc 1.1.5:
/// - the sink (plain, started through tessera-runtime and judged: its `/v` is an empty
///   directory) binds the volume `vols/V` with runc's default propagation (its namespace
///   `rslave`: `/v` is a slave of the host's peer group);
/// - the source (plain, `linux.rootfsPropagation: rshared`, so its copy of the volume's
///   mount stays in the host's peer group; `rootfsParentMountPrivate` makes only the
///   rootfs's parent mount private) binds `vols/V` at `/v` and a directory of its own at
///   `/v/p`, which the racer (round 6's stand-in) links to the host's `/proc` after the
///   create's checks. runc's bind at `<rootfs>/v/p` propagates to the host's `vols/V/p` and
///   from there to the sink's `/v/p`. The source's start is refused ("what runc made is
///   refused") and it is deleted; the propagated copies stay.
///
/// The volume's mount is a tmpfs this test makes shared: on a systemd node every mount is
/// shared (systemd's default), on this VM none is; it is a mount of its own as a volume on
/// a data disk (or `/var/lib/kubelet` beside containerd's rootfs under `/run`) is.
///
/// Seen with runc 1.1.5: the sink's start passed; the source's create exited 0 and its start
/// was refused ("/v/p is a procfs of a pid namespace that cannot be read ..."); the sink's
/// table then held `0:21 / /v/p ... master:4 - proc` (the host's procfs, received) under
/// `/V /v ... master:1 - tmpfs`, and the sink read 16 bytes of the GPU container's memory
/// through `/v/p/<pid>/mem`.
#[test]
fn a_plain_containers_volume_receives_no_procfs_by_propagation_after_its_judgement() {
    let node = Node::start();
    let pid = victim(&node);
    let vols = node.fx.dir().join("vols");
    let shared = SharedMount::new(&vols);
    fs::create_dir_all(vols.join("V/p")).unwrap();
    let vol = vols.join("V");
    let bind = |src: &Path, dst: &str| {
        json!({"destination": dst, "type": "bind", "source": src.to_str().unwrap(),
               "options": ["rbind"]})
    };
    let script = format!(
        "i=0; while [ ! -e /v/p/{pid}/mem ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done; \
         {}; sleep 300",
        read_mem(&format!("/v/p/{pid}"))
    );
    let mut sink = node.bundle("sink", "team-dev", None, &["sh", "-c", &script]);
    fs::create_dir_all(sink.rootfs().join("v")).unwrap();
    sink.mutate(|c| c["mounts"].as_array_mut().unwrap().push(bind(&vol, "/v"))).write();
    let sink_started = create_and_start(&node, &sink, "sink");
    let mut source = node.bundle("source", "team-dev", None, &["sleep", "300"]);
    let own = source.dir().join("own/p");
    fs::create_dir_all(&own).unwrap();
    fs::create_dir_all(source.rootfs().join("v")).unwrap();
    source
        .mutate(|c| {
            c["linux"]["rootfsPropagation"] = json!("rshared");
            let m = c["mounts"].as_array_mut().unwrap();
            m.push(bind(&vol, "/v"));
            m.push(bind(&own, "/v/p"));
        })
        .write();
    let racer = racing_runc(&source, "create", &[(&own, Path::new("/proc"))]);
    let created = node.fx.create_container_env(
        &source,
        "source",
        &[("TESSERA_RUNC", racer.to_str().unwrap())],
    );
    let source_started = node.fx.start_container("source");
    std::thread::sleep(Duration::from_secs(4));
    let read = fs::read_to_string(sink.rootfs().join("tmp/read")).unwrap_or_default();
    let sink_pid = node.fx.container_pid("sink");
    let table = sink_pid
        .and_then(|p| fs::read_to_string(format!("/proc/{p}/mountinfo")).ok())
        .unwrap_or_default();
    let at_v: Vec<String> =
        table.lines().filter(|l| l.contains(" /v")).map(str::to_string).collect();
    node.fx.delete_container("source", true);
    node.fx.delete_container("sink", true);
    node.fx.delete_container("victim", true);
    drop(shared);
    assert!(
        count(&read) == 0,
        "a plain container (start {sink_started:?}) received the host's procfs by propagation \
         (its table at /v: {at_v:?}; the source's create {:?}, start {:?}) and read {} bytes \
         of the GPU container {pid}'s memory",
        created.status.code(),
        source_started.stderr_str(),
        read.trim()
    );
}

/// Class: a container id runc takes and tessera-runtime does not read as one — every
/// judgement of what runc made keyed by `ContainerId`.
///
/// runc 1.1.5 checks an id against `^[\w+-\.]+$`; in Go's RE2, `+-\.` inside the class is
/// the *range* `+`…`.`, which holds `,` (`runc state a,b`: "container does not exist";
/// `runc state 'a b'`: "invalid container ID format"). `tessera_api::validate_container_id`
/// takes `[A-Za-z0-9_+.-]` only. A plain `create` is passed to runc without the id read as
/// a `ContainerId` (the GPU path reads it after the plain path has returned); at `start`,
/// `confirm::before_start` reads an id that is not a `ContainerId` as "not an id (runc
/// refuses it, and starts nothing)" and returns Ok without judging anything; the exec check
/// (`ContainerId::new(..).ok()`) skips its judgement the same way (read in the code, not
/// run). A `run` is judged (the `plain-prestart` hook keys nothing by `ContainerId`), and a
/// GPU create refuses such an id. So round 9's racer (a
/// volume linked to the host's `/proc` after the create's checks), refused at `start` for
/// `spy`, goes through for `spy,1`.
///
/// Seen with runc 1.1.5: `spy1` is refused at start (the premise, checked first); create
/// (through tessera-runtime, with the racer) and start of `spy,1` exit 0; its table holds the host's procfs (0:21) at `/hostproc`, and it read 16
/// bytes of the GPU container's memory through `/hostproc/<pid>/mem`.
#[test]
fn an_id_with_a_comma_is_judged_at_start_as_any_other() {
    let node = Node::start();
    let pid = victim(&node);
    let attempt = |id: &str| {
        let script = format!("{}; sleep 300", read_mem(&format!("/hostproc/{pid}")));
        let mut spy = node.bundle(id, "team-dev", None, &["sh", "-c", &script]);
        let proc_vol = spy.dir().join("vol/p");
        fs::create_dir_all(&proc_vol).unwrap();
        fs::create_dir_all(spy.rootfs().join("hostproc")).unwrap();
        spy.mutate(|c| {
            c["mounts"].as_array_mut().unwrap().push(json!({"destination": "/hostproc",
                "type": "bind", "source": proc_vol.to_str().unwrap(), "options": ["rbind", "ro"]}));
        })
        .write();
        let racer = racing_runc(&spy, "create", &[(&proc_vol, Path::new("/proc"))]);
        let created =
            node.fx.create_container_env(&spy, id, &[("TESSERA_RUNC", racer.to_str().unwrap())]);
        let started = node.fx.start_container(id);
        std::thread::sleep(Duration::from_secs(2));
        let read = fs::read_to_string(spy.rootfs().join("tmp/read")).unwrap_or_default();
        let table = node
            .fx
            .container_pid(id)
            .and_then(|p| fs::read_to_string(format!("/proc/{p}/mountinfo")).ok())
            .unwrap_or_default();
        let hostproc: Vec<String> =
            table.lines().filter(|l| l.contains(" /hostproc ")).map(str::to_string).collect();
        node.fx.delete_container(id, true);
        let summary = format!(
            "container {id:?} (create exit {:?} {:?}, start exit {:?} {:?}; /hostproc in its \
             table: {hostproc:?})",
            created.status.code(),
            created.stderr_str(),
            started.status.code(),
            started.stderr_str(),
        );
        (started.status.success(), count(&read), summary)
    };
    let (plain_started, _, plain) = attempt("spy1");
    let (started, read, comma) = attempt("spy,1");
    node.fx.delete_container("victim", true);
    assert!(!plain_started, "premise: without the comma the start is refused: {plain}");
    assert!(
        read == 0,
        "{comma} read {read} bytes of the GPU container {pid}'s memory (started: {started})"
    );
}
