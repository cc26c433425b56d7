//! Red-team round 9 (branch rt-iso5): the round-8 start checks (f459012) read as runc 1.1.5
//! and the kernel carry them out. A created container without a GPU is judged at
//! tessera-runtime's `start` on what runc made (`confirm::check_plain_created`: no mount of
//! tesserad's own paths, every procfs showing its own pid namespace); a GPU container by
//! tesserad's confirmation (`Node::container_is_its_own`). Run as rounds 6 and 8 run:
//! tesserad on the simulated node, tessera-runtime and tessera-hook as built, real runc and
//! the kernel; a runc wrapper standing for the racer of round 6 (a link swapped in a volume
//! between the create's config checks and runc's mounts); each case reads back what the
//! kernel let the spy do.
//!
//! A test that fails here is an attack that got through (or, where its doc says so, a
//! false refusal of a common case).
//!
//! Tried and stopped, with runc 1.1.5 (racer-swapped sources, start through
//! tessera-runtime, what the init's mountinfo held printed): the host's procfs at `/a/p`
//! hidden under a tmpfs at `/a` (refused at start: `1/ns/pid` cannot be read through the
//! top mount); the container's own `/proc` with `hidepid=2` (read as `hidepid=invisible`)
//! beside the host's at `/hp` (the own one judged fine, the host's refused); a bind onto
//! `/` (runc itself fails: no `/dev` in the bound root). Read in the code, not run:
//! `runc restore` (refused outright by tessera-runtime); an `overlay` with `lowerdir=` a
//! private path (refused at create: not an own-instance filesystem, and a racer cannot
//! change a type); `start` with several ids or `--` spellings (`check_start_args`; runc
//! starts one id); a plain container without a mount namespace (every plain config gets
//! readonly/masked paths, which runc 1.1's validator refuses without one); tesserad's
//! `given` (driver files, the grant's own pipe directory: nothing broader); MPS private
//! shm (`shm_root` is never set by tesserad). Reasoning, not shown: with the stacked layout
//! below, a racer-swapped read-write bind of the host's `/proc/sys` would pass the start
//! check too (host sysctls; not run, it would touch the shared host's
//! `kernel.core_pattern`).

#![allow(clippy::unwrap_used)]

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::json;
use tessera_harness::attack::*;
use tessera_harness::node::*;
use tessera_harness::*;

const WITHIN: Duration = Duration::from_secs(15);

/// Class: the start check skipped — `runc run` of a container without a GPU.
///
/// `check_plain_created` runs only at `runc start` (`before_start`); a plain `runc run`
/// is passed to runc after the create's config checks (`prepare` → `Passthrough`), and no
/// prestart hook or start reads what runc made (the GPU path keeps the hook for `run`; the
/// plain path has nothing). The same swap that round 6's
/// `a_procfs_runc_made_outside_the_checks_is_refused_at_start` and
/// `a_bind_swapped_for_tesserads_state_is_refused_at_start` catch at `start` goes through
/// with `run`: the config binds two volume directories read-only (`/hostproc`, `/x`); the
/// racer links them to the host's `/proc` and to tesserad's state directory after
/// tessera-runtime's checks.
///
/// Seen with runc 1.1.5: `run` exits 0; the spy read 16 bytes of the GPU container's memory
/// through `/hostproc/<pid>/mem`, and listed tesserad's state directory at `/x`.
#[test]
fn a_plain_container_made_by_runc_run_is_judged_on_what_runc_made() {
    let node = Node::start();
    let pid = victim(&node);
    let state = fs::canonicalize(&node.state).unwrap();
    let script = format!("{}; ls /x > /tmp/seen", read_mem(&format!("/hostproc/{pid}")));
    let mut spy = node.bundle("runspy", "team-dev", None, &["sh", "-c", &script]);
    let (proc_vol, state_vol) = (spy.dir().join("vol/p"), spy.dir().join("vol/s"));
    fs::create_dir_all(&proc_vol).unwrap();
    fs::create_dir_all(&state_vol).unwrap();
    fs::create_dir_all(spy.rootfs().join("hostproc")).unwrap();
    fs::create_dir_all(spy.rootfs().join("x")).unwrap();
    spy.mutate(|c| {
        let m = c["mounts"].as_array_mut().unwrap();
        m.push(ro_bind(&proc_vol, "/hostproc"));
        m.push(ro_bind(&state_vol, "/x"));
    })
    .write();
    let racer = racing_runc(&spy, "run", &[(&proc_vol, Path::new("/proc")), (&state_vol, &state)]);
    let dir = spy.dir().to_string_lossy().into_owned();
    let ran = node
        .fx
        .runc(&["run", "--bundle", &dir, "runspy"], &[("TESSERA_RUNC", racer.to_str().unwrap())]);
    let read = fs::read_to_string(spy.rootfs().join("tmp/read")).unwrap_or_default();
    let seen = fs::read_to_string(spy.rootfs().join("tmp/seen")).unwrap_or_default();
    node.fx.delete_container("runspy", true);
    node.fx.delete_container("victim", true);
    let mut through = Vec::new();
    if count(&read) > 0 {
        through.push(format!("read {} bytes of the GPU container {pid}'s memory", read.trim()));
    }
    if !seen.trim().is_empty() {
        through.push(format!("listed tesserad's state directory: {:?}", seen.trim()));
    }
    assert!(
        through.is_empty(),
        "runc run of a plain container (exit {:?}, stderr {:?}): {through:?}",
        ran.status.code(),
        ran.stderr_str()
    );
}

/// Class: the start check skipped — an exec into a created container without a GPU,
/// before its `start`.
///
/// runc 1.1 execs into a container in the `created` state (only `stopped` is refused);
/// tessera-runtime refuses that for a GPU container not yet confirmed
/// (`check_confirmed`), but for a plain one `check_exec` → `check_plain_exec` judges only
/// the exec's capabilities. What runc made is read at `start` only, so a process exec'd
/// between create and start runs in the mount table the start check would refuse. Here
/// the create goes through tessera-runtime with the racer (the config binds volume
/// directories at `/hostproc` and `/x`; runc binds the host's `/proc` and tesserad's state
/// directory), and the exec runs before any start.
///
/// Seen with runc 1.1.5: the exec exits 0, prints 16 (bytes of the GPU container's memory
/// read through `/hostproc/<pid>/mem`) and lists tesserad's state directory; the start
/// afterwards is refused and the container deleted, too late.
#[test]
fn an_exec_into_a_created_plain_container_is_judged_on_what_runc_made() {
    let node = Node::start();
    let pid = victim(&node);
    let state = fs::canonicalize(&node.state).unwrap();
    let mut spy = node.bundle("execspy", "team-dev", None, &["sleep", "300"]);
    let (proc_vol, state_vol) = (spy.dir().join("vol/p"), spy.dir().join("vol/s"));
    fs::create_dir_all(&proc_vol).unwrap();
    fs::create_dir_all(&state_vol).unwrap();
    fs::create_dir_all(spy.rootfs().join("hostproc")).unwrap();
    fs::create_dir_all(spy.rootfs().join("x")).unwrap();
    spy.mutate(|c| {
        let m = c["mounts"].as_array_mut().unwrap();
        m.push(ro_bind(&proc_vol, "/hostproc"));
        m.push(ro_bind(&state_vol, "/x"));
    })
    .write();
    let racer =
        racing_runc(&spy, "create", &[(&proc_vol, Path::new("/proc")), (&state_vol, &state)]);
    let created =
        node.fx.create_container_env(&spy, "execspy", &[("TESSERA_RUNC", racer.to_str().unwrap())]);
    assert!(created.status.success(), "the create saw plain directories: {}", created.stderr_str());
    let script = format!("{}; echo; ls /x", read_mem(&format!("/hostproc/{pid}")));
    let exec = node.fx.exec("execspy", &["sh", "-c", &script]);
    let out = exec.stdout_str();
    let started = node.fx.start_container("execspy");
    node.fx.delete_container("execspy", true);
    node.fx.delete_container("victim", true);
    let first = out.lines().next().unwrap_or("");
    assert!(
        !(exec.status.success() && count(first) > 0),
        "an exec into the created plain container read {first} bytes of the GPU container \
         {pid}'s memory and listed tesserad's state: {:?} (exec stderr {:?}; the start after: \
         {:?})",
        out.lines().skip(1).collect::<Vec<_>>(),
        exec.stderr_str(),
        started.stderr_str()
    );
}

/// Class: a procfs at a mount point the start check cannot open the way it expects —
/// stacked mounts at `/proc`.
///
/// `foreign_procfs` opens each whole procfs by its mount point, through the init's root;
/// where several are stacked on one point the path reaches the top one only. A container
/// whose `/proc` is the host's procfs (a bind) with its own `proc` mounted on top has two
/// whole procfs entries at `/proc`; both are read as the top one, showing the container's
/// own pid namespace, so the host's instance (its device) is counted as the container's
/// own — and then a *part* of the host's procfs (a bind of `/proc/<pid>/mem` and `maps` of
/// a GPU container, roots `/<pid>/mem`, `/<pid>/maps`) passes as "a part of an instance a
/// whole one showed own for". Config: `proc` at `/proc` (the default), a read-only bind of
/// a volume at `/proc`, a second `proc` at `/proc`, read-only binds of two volumes at
/// `/proc/meminfo` and `/proc/cpuinfo` (runc's `checkProcMount` lets binds onto the files
/// lxcfs emulates: under `/proc`, so tesserad's "procfs elsewhere than /proc" rule does not
/// apply either); every check of the create passes (plain directories, proc only at
/// `/proc`); the racer links the volumes to the host's `/proc` (runc's `checkProcMount` lets
/// a procfs source onto `/proc`) and to the victim's `mem` and `maps`.
///
/// Seen with runc 1.1.5: the table holds `/proc` three times (own 0:N, the host's 0:21,
/// own 0:N) and the two parts of 0:21; tessera-runtime's start check (plain spy) and
/// tesserad's confirmation (GPU spy, `mig=1g.10gb`, another tenant) both pass it, and each
/// spy read 16 bytes of the GPU container's memory through `/proc/meminfo`.
#[test]
fn a_hosts_procfs_hidden_under_the_containers_own_lets_no_part_of_it_through() {
    let node = Node::start();
    let pid = victim(&node);
    let mut through = Vec::new();
    for (id, tenant, request) in
        [("stackspy", "team-dev", None), ("stackgpu", "team-untrusted", Some("mig=1g.10gb"))]
    {
        let script = "a=$(head -n1 /proc/cpuinfo | cut -d- -f1); \
             dd if=/proc/meminfo of=/tmp/stolen bs=1 skip=$((0x$a)) count=16 2>/dev/null; \
             wc -c < /tmp/stolen > /tmp/read; touch /tmp/done; exec sleep 300";
        let mut spy = node.bundle(id, tenant, request, &["sh", "-c", script]);
        let vol = |n: &str| spy.dir().join("vol").join(n);
        let (proc_vol, mem_vol, maps_vol) = (vol("p"), vol("mem"), vol("maps"));
        for v in [&proc_vol, &mem_vol, &maps_vol] {
            fs::create_dir_all(v).unwrap();
        }
        spy.mutate(|c| {
            let m = c["mounts"].as_array_mut().unwrap();
            m.push(ro_bind(&proc_vol, "/proc"));
            m.push(json!({"destination": "/proc", "type": "proc", "source": "proc"}));
            m.push(ro_bind(&mem_vol, "/proc/meminfo"));
            m.push(ro_bind(&maps_vol, "/proc/cpuinfo"));
        })
        .write();
        let (mem, maps) =
            (PathBuf::from(format!("/proc/{pid}/mem")), PathBuf::from(format!("/proc/{pid}/maps")));
        let racer = racing_runc(
            &spy,
            "create",
            &[(&proc_vol, Path::new("/proc")), (&mem_vol, &mem), (&maps_vol, &maps)],
        );
        let created =
            node.fx.create_container_env(&spy, id, &[("TESSERA_RUNC", racer.to_str().unwrap())]);
        if !created.status.success() {
            through.push(format!(
                "{id}: the create refused it (test premise): {}",
                created.stderr_str()
            ));
            continue;
        }
        let table = node
            .fx
            .container_pid(id)
            .and_then(|p| fs::read_to_string(format!("/proc/{p}/mountinfo")).ok())
            .unwrap_or_default();
        let started = node.fx.start_container(id);
        if started.status.success() {
            wait_for(|| spy.rootfs().join("tmp/done").exists(), WITHIN);
            let read = fs::read_to_string(spy.rootfs().join("tmp/read")).unwrap_or_default();
            let procs: Vec<&str> = table.lines().filter(|l| l.contains(" - proc ")).collect();
            through.push(format!(
                "{id} ({tenant}, {request:?}): started; read {} bytes of the GPU container {pid}'s \
                 memory through /proc/meminfo; its procfs entries: {procs:?}",
                read.trim()
            ));
        } else {
            eprintln!("{id}: start refused: {}", started.stderr_str());
        }
        node.fx.delete_container(id, true);
    }
    node.fx.delete_container("victim", true);
    assert!(through.is_empty(), "{through:?}");
}

/// Class: tesserad's own paths reached through a mount *inside* its state directory —
/// the latency report of another tenant's GPU container.
///
/// `mountinfo::shows` and `place` judge a path by the filesystem (device) of the deepest
/// mount holding it: "inside the state directory" means "on the state directory's
/// filesystem and below its directory". A latency container's report,
/// `<state>/reports/<id>`, is a mount point of its own there (a bind of the one file of a
/// tmpfs, `report_fs`): placed, it is that tmpfs's `/latency_ms`, which shares no device
/// with the state directory. So a bind of `<state>/reports/<victim>` passes the create's
/// `check_private_binds` and the start's `private_in_view` for a container without a GPU
/// (and for a GPU one: tesserad's `given` is the spy's own grant), though the path is
/// inside tesserad's state directory.
///
/// Seen with runc 1.1.5: the plain spy (team-dev) starts with the bind read-write at `/r`,
/// reads team-trusted's latency container's report and writes `9999` into it; tesserad's
/// telemetry then reports the victim's latency as 9999 ms (the report "decides whether it is
/// hurt": interference incidents and the throttling of its co-tenants).
#[test]
fn a_plain_container_cannot_bind_another_containers_latency_report_in_tesserads_state() {
    let node = Node::start_with(NodeOptions {
        extra_args: vec![
            "--mps-control".into(),
            fresh_bin("fake-nvidia-cuda-mps-control").into(),
            "--mps-health-interval-ms".into(),
            "200".into(),
            "--telemetry-interval-ms".into(),
            "200".into(),
        ],
        ..Default::default()
    });
    let mut victim = node.bundle("victim", "team-trusted", Some("mps=25"), &["sleep", "300"]);
    victim.annotation("tessera.io/class", "latency").write();
    node.fx.run_detached(&victim, "victim");
    let report = fs::canonicalize(&node.state).unwrap().join("reports/victim");
    assert!(report.is_file(), "the victim's report file {}", report.display());
    let script = "cat /r > /tmp/was 2>&1; echo 9999 > /r && touch /tmp/written; \
                  touch /tmp/done; exec sleep 300";
    let mut spy = node.bundle("reportspy", "team-dev", None, &["sh", "-c", script]);
    fs::write(spy.rootfs().join("r"), "").unwrap();
    spy.mutate(|c| {
        c["mounts"].as_array_mut().unwrap().push(json!({"destination": "/r", "type": "bind",
            "source": report.to_str().unwrap(), "options": ["bind"]}))
    })
    .write();
    let started = create_and_start(&node, &spy, "reportspy");
    let mut through = Vec::new();
    if started.is_ok() {
        wait_for(|| spy.rootfs().join("tmp/done").exists(), WITHIN);
        node.wait_telemetry_samples(3, Duration::from_secs(10));
        let seen = node
            .client()
            .telemetry()
            .ok()
            .and_then(|t| t.containers.into_iter().find(|c| c.container_id == "victim"))
            .and_then(|c| c.latency_ms);
        if spy.rootfs().join("tmp/written").exists() {
            through.push(format!(
                "the plain spy started with {} at /r and wrote 9999 into it (host file now {:?}); \
                 tesserad's telemetry reports the victim's latency as {seen:?}",
                report.display(),
                fs::read_to_string(&report).unwrap_or_default().trim()
            ));
        }
    } else {
        refused(&started);
    }
    node.fx.delete_container("reportspy", true);
    node.fx.delete_container("victim", true);
    assert!(through.is_empty(), "{through:?}");
}

fn refused(started: &Result<(), String>) {
    if let Err(e) = started {
        assert!(e.contains("tessera-runtime"), "refused, but not by tessera-runtime: {e}");
    }
}

/// `tessera setup containerd` on the fixture's own config, and the handler's runc root in
/// the fixture (as tests/kubernetes.rs sets it up).
fn setup_handler(config: &Path, dir: &Path) {
    let out = run_cmd(
        std::process::Command::new(tessera_cli())
            .args(["setup", "containerd", "--config"])
            .arg(config)
            .arg("--runtime-path")
            .arg(tessera_runtime())
            .arg("--runtime-dir")
            .arg(dir.join("tessera-runtime")),
    );
    out.assert_success("tessera setup containerd");
    let text = fs::read_to_string(config).unwrap();
    let mut doc: toml_edit::DocumentMut = text.parse().unwrap();
    doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["tessera"]["options"]
        ["Root"] = toml_edit::value(
        Containerd::runtime_root_in(dir, "tessera").to_string_lossy().into_owned(),
    );
    fs::write(config, doc.to_string()).unwrap();
}

/// False refusal: a Kubernetes pod without a GPU with `shareProcessNamespace: true`, on a
/// node without Yama (or `ptrace_scope` 0: RHEL's and Debian's default).
///
/// kubelet asks the pod's pid namespace for every container (`NamespaceMode::Pod`);
/// containerd 1.6 gives each app container's config `{"type": "pid", "path":
/// "/proc/<sandbox init>/ns/pid"}`. `spec::shared_pid_namespace` counts every pid namespace
/// joined by path as a view of processes outside the container's own and refuses it where
/// Yama is below 1 — but this one is the pod's own sandbox's, which holds only the pod's
/// processes; a GPU container is never in such a pod (refused a shared pid namespace), so
/// there is no GPU process in view to attach to. docs/SECURITY.md names
/// `shareProcessNamespace` a limit for GPU pods only; round 8 made it one for every pod on
/// such nodes (log shippers, signal-sending sidecars, debugging sidecars).
///
/// Seen with containerd 1.6 and runc 1.1.5 through the `tessera` handler: the sandbox runs;
/// CreateContainer/StartContainer of the app container fails with tessera-runtime's
/// "kernel.yama.ptrace_scope=1" refusal naming `/proc/<pid>/ns/pid`.
#[test]
fn a_plain_pod_sharing_its_process_namespace_runs_where_yama_is_off() {
    let node = Node::start();
    let ctd = Containerd::builder()
        .cri()
        .env("TESSERA_SOCKET", &node.socket.display().to_string())
        .env("TESSERA_RUNC", RUNC)
        .env("TESSERA_HOOK", tessera_hook())
        .before_start(setup_handler)
        .start();
    let cri = ctd.cri();
    let pod = tessera_harness::cri::PodSpec::new("shared", "team-dev")
        .handler("tessera")
        .share_process_namespace(true);
    let pod_id = cri.run_pod_sandbox(&pod).unwrap_or_else(|e| panic!("{e}\n{}", ctd.log()));
    let spec = tessera_harness::cri::ContainerSpec::new("app").command(&["sh", "-c", "sleep 300"]);
    let started = cri
        .create_container(&pod_id, &pod, &spec)
        .and_then(|id| cri.start_container(&id).map(|()| id));
    let seen = match &started {
        Ok(id) => cri
            .exec_sync(id, &["sh", "-c", "ls /proc | grep -c '^[0-9]'"], 10)
            .map(|o| o.stdout)
            .unwrap_or_default(),
        Err(_) => String::new(),
    };
    for c in cri.list_containers(Some(&pod_id)).unwrap_or_default() {
        let _ = cri.stop_container(&c.id, 0);
        let _ = cri.remove_container(&c.id);
    }
    let _ = cri.stop_pod_sandbox(&pod_id);
    let _ = cri.remove_pod_sandbox(&pod_id);
    assert!(
        started.is_ok(),
        "a plain pod with shareProcessNamespace was refused: {}",
        started.err().map(|e| e.to_string()).unwrap_or_default()
    );
    assert!(!seen.trim().is_empty(), "its app container saw the pod's processes");
}

/// Class: the start check where Yama's `ptrace_scope` is 1 or more (Ubuntu's default) —
/// what runc made is judged for tesserad's paths only; no procfs is.
///
/// `check_plain_created` returns before its pid-namespace and procfs checks where the
/// scope is ≥ 1, on the ground that Yama keeps the container from attaching. But Yama's
/// relational scope lets a tracer holding CAP_SYS_PTRACE (in the target's user namespace:
/// the host's here) attach to any process, and the create's rule "a container that sees
/// processes outside its own pid namespace never holds CAP_SYS_PTRACE" is judged on the
/// config alone: a container with a pid namespace of its own and no procfs bind in its
/// config is created *with* CAP_SYS_PTRACE. The racer's swap then gives it the host's
/// procfs at `/hostproc`, and the start, reading the mounts runc made, lets it through.
///
/// Seen here (runc 1.1.5, create through tessera-runtime with the racer; the start check
/// called as tessera-runtime's `start` calls it, with a `ptrace_scope` file saying 1, since
/// this VM's kernel has no Yama and tessera-runtime reads only the real one): the init's
/// CapBnd holds CAP_SYS_PTRACE, its table holds the host's procfs (0:21) at `/hostproc`,
/// and `check_plain_created` answers Ok. Not seen here: the kernel's answer on a Yama 1
/// node (reasoning: `yama_ptrace_access_check` → `ptracer_exception_found` /
/// `ns_capable(CAP_SYS_PTRACE)`, as `rt_iso4_a_procfs_bind_with_cap_sys_ptrace_is_refused_
/// whatever_yamas_scope` reads it); without Yama the same container is refused at start.
#[test]
fn where_yama_is_on_a_procfs_runc_made_with_cap_sys_ptrace_is_refused_at_start() {
    let node = Node::start();
    let mut spy = node.bundle("yamaspy", "team-dev", None, &["sleep", "300"]);
    let proc_vol = spy.dir().join("vol/p");
    fs::create_dir_all(&proc_vol).unwrap();
    fs::create_dir_all(spy.rootfs().join("hostproc")).unwrap();
    spy.mutate(|c| {
        c["mounts"].as_array_mut().unwrap().push(ro_bind(&proc_vol, "/hostproc"));
        for set in ["bounding", "effective", "permitted"] {
            c["process"]["capabilities"][set].as_array_mut().unwrap().push(json!("CAP_SYS_PTRACE"));
        }
    })
    .write();
    let racer = racing_runc(&spy, "create", &[(&proc_vol, Path::new("/proc"))]);
    let created =
        node.fx.create_container_env(&spy, "yamaspy", &[("TESSERA_RUNC", racer.to_str().unwrap())]);
    assert!(created.status.success(), "create: {}", created.stderr_str());
    let pid = node.fx.container_pid("yamaspy").unwrap();
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let capbnd = status.lines().find(|l| l.starts_with("CapBnd:")).unwrap_or("").to_string();
    let table = fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap_or_default();
    let hostproc: Vec<&str> = table.lines().filter(|l| l.contains(" /hostproc ")).collect();
    let scope = spy.dir().join("ptrace_scope");
    fs::write(&scope, "1\n").unwrap();
    let id = tessera_api::ContainerId::new("yamaspy").unwrap();
    let judged =
        runtime_hook::confirm::check_plain_created(&node.fx.runc_root(), &id, &node.socket, &scope);
    fs::write(&scope, "0\n").unwrap();
    let judged_without =
        runtime_hook::confirm::check_plain_created(&node.fx.runc_root(), &id, &node.socket, &scope);
    node.fx.delete_container("yamaspy", true);
    assert!(judged_without.is_err(), "premise: refused where Yama is 0");
    assert!(
        judged.is_err(),
        "ptrace_scope 1: a created container holding CAP_SYS_PTRACE ({capbnd}) with the host's \
         procfs in its table ({hostproc:?}) passes the start check"
    );
}
