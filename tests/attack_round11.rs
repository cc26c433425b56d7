//! Red-team round 11 (branch rt-iso7): round 10's fixes (5fada77) read as runc 1.1.5 and
//! the kernel carry them out. Run as rounds 6, 8, 9 and 10 run: tesserad on the simulated
//! node, tessera-runtime and tessera-hook as built, real runc and the kernel; each case
//! reads back what the kernel let the spy do.
//!
//! A test that fails here is an attack that got through (or, where its doc says so, a
//! false refusal of a common case).
//!
//! What got through, in short: a GPU or plain container's `runc exec` is judged on files
//! and labels other than those runc 1.1.5 reads for it — the bundle named by the *last*
//! `bundle=` label (runc's `SearchLabels` takes the first: an annotation named `bundle`),
//! its `config.json` as it is now, a `--process` path read once by each, and a grant label
//! matched by prefix (an annotation *key* `tessera.io/allocated=…` survives the strip).
//!
//! Tried and stopped, with runc 1.1.5: round 10's pid-namespace link race aimed at a GPU
//! container that is created but not started (its cgroup is in `<socket>.grant-cgroups`
//! from its create's confirmation: the spy's start was refused, "runc put it in the pid
//! namespace … of a GPU container's process"); a plain container created with
//! `--no-pivot` (runc's `MS_MOVE` + `chroot`) and CAP_SYS_CHROOT, escaping the chroot by
//! `..` from a nested `chroot` (an exec'd static helper): it landed on the container's own
//! rootfs (mounted over the namespace's `/`; `ls /` the same, `/proc/self/mountinfo`'s root
//! the bundle's rootfs), not the host's tree.

#![allow(clippy::unwrap_used)]

use std::fs;
use std::path::Path;

use serde_json::json;
use tessera_harness::attack::*;
use tessera_harness::node::*;
use tessera_harness::*;

/// Class: which containers count as GPU ones — the grant label is read by prefix, and an
/// annotation *key* may hold `=`.
///
/// tessera-runtime strips the annotations `tessera.io/allocated` and `tessera.io/confirm`
/// from a plain config (`spec::strip_own_annotations`, exact keys), but runc 1.1.5 writes
/// each annotation as the label `key=value` and reads labels back by the first `=`. An
/// annotation named `tessera.io/allocated=GPU-forged` (value `x`) survives the strip and
/// becomes the label `tessera.io/allocated=GPU-forged=x`: runc's own `state` reports the
/// annotation `tessera.io/allocated` = `GPU-forged=x`, and `supervise::label_hint` (a
/// `tessera.io/allocated=` prefix) takes the container for a GPU one. Before an exec,
/// `runtime_main` then skips `confirm::check_plain_created` (`Ok(_) => Ok(())`), and
/// `check_exec`'s GPU path passes it (no `tessera.io/confirm` label, so `check_confirmed`
/// asks nothing; `runc spec`'s capabilities are within the GPU set). The start, which reads
/// `tessera.io/confirm` only, still judges it as plain — so the exec goes in between
/// create and start, as in round 9's `an_exec_into_a_created_plain_container_is_judged_on_
/// what_runc_made` (refused since, for a container without the label). The create goes
/// through tessera-runtime with round 9's racer (the config binds a volume directory at
/// `/hostproc`; runc binds the host's `/proc`).
///
/// Seen with runc 1.1.5: the create exits 0; the config runc got keeps
/// `{"tessera.io/allocated=GPU-forged":"x"}`; runc's record holds the labels
/// `["tessera.io/allocated=GPU-forged=x", "bundle=…"]`; the created init's table holds
/// `… 0:21 / /hostproc ro,relatime - proc proc rw` (the host's procfs); the exec exits 0
/// and prints 16 — bytes of the GPU container's memory read through
/// `/hostproc/<pid>/mem`. The start afterwards is refused ("/hostproc is a procfs of a pid
/// namespace that cannot be read …") and the container deleted, too late.
#[test]
fn an_exec_into_a_created_plain_container_with_a_forged_grant_label_is_judged() {
    let node = Node::start();
    let pid = victim(&node);
    let mut spy = node.bundle("labelspy", "team-dev", None, &["sleep", "300"]);
    let proc_vol = spy.dir().join("vol/p");
    fs::create_dir_all(&proc_vol).unwrap();
    fs::create_dir_all(spy.rootfs().join("hostproc")).unwrap();
    spy.mutate(|c| {
        c["mounts"].as_array_mut().unwrap().push(ro_bind(&proc_vol, "/hostproc"));
        c["annotations"] = json!({"tessera.io/allocated=GPU-forged": "x"});
    })
    .write();
    let racer = racing_runc(&spy, "create", &[(&proc_vol, Path::new("/proc"))]);
    let created = node.fx.create_container_env(
        &spy,
        "labelspy",
        &[("TESSERA_RUNC", racer.to_str().unwrap())],
    );
    let config: serde_json::Value =
        serde_json::from_slice(&fs::read(spy.config_path()).unwrap()).unwrap();
    let annotations = config["annotations"].clone();
    let spy_pid = node.fx.container_pid("labelspy");
    let state = node.fx.state("labelspy");
    let labels = state.as_ref().map(|s| s["annotations"].clone());
    let record = fs::read_to_string(node.fx.runc_root().join("labelspy/state.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .map(|v| v["config"]["labels"].clone());
    let table = spy_pid
        .and_then(|p| fs::read_to_string(format!("/proc/{p}/mountinfo")).ok())
        .unwrap_or_default();
    let hostproc: Vec<String> =
        table.lines().filter(|l| l.contains(" /hostproc ")).map(str::to_string).collect();
    let exec = node.fx.exec("labelspy", &["sh", "-c", &read_mem(&format!("/hostproc/{pid}"))]);
    let out = exec.stdout_str();
    let started = node.fx.start_container("labelspy");
    node.fx.delete_container("labelspy", true);
    node.fx.delete_container("victim", true);
    if !created.status.success() {
        // Stopped at the create since (the forged key holds `=`, refused for every config).
        assert!(created.stderr_str().contains("annotations["), "{}", created.stderr_str());
        return;
    }
    let first = out.lines().next().unwrap_or("");
    assert!(
        !(exec.status.success() && count(first) > 0),
        "an exec into the created plain container (its config's annotations {annotations}; \
         runc's state {labels:?}; its record's labels {record:?}; /hostproc in its table: \
         {hostproc:?}) read {first} bytes of the GPU container {pid}'s memory \
         (exec stderr {:?}; the start after: {:?})",
        exec.stderr_str(),
        started.stderr_str()
    );
}

/// Class: an exec into a GPU container is judged on its bundle's `config.json` as it is
/// *now* — a file the tenant wrote and still writes — not on what runc made.
///
/// `exec::check_exec` refuses capabilities beyond `GPU_CAPABILITIES` (`--cap`, or a
/// `--process` file's) "without a user namespace of its own", and tells whether the
/// container has one from `linux.namespaces` of `<bundle>/config.json` (the bundle named
/// by runc's record). runc 1.1.5 runs the exec in the namespaces it made at create and
/// records (state.json), whatever that file says since. So the tenant of a GPU container,
/// after its create and start went through tessera-runtime and tesserad, appends
/// `{"type":"user"}` to its bundle's `linux.namespaces` and asks
/// `runc exec --cap CAP_SYS_ADMIN`.
///
/// Seen with runc 1.1.5 (GPU container `mine`, team-untrusted, `mig=1g.10gb`, created and
/// started through tessera-runtime): with the bundle as created, the exec is refused
/// ("CAP_SYS_ADMIN without a user namespace of its own"); after the edit, it exits 0; its
/// `CapEff` is `0000000028200420` (CAP_SYS_ADMIN, bit 21, among them), its user namespace
/// is the host's (`/proc/<pid>/ns/user` the same link as the test's own); it mounted the
/// cgroup v1 `devices` hierarchy read-write (no cgroup namespace: the host's root of it,
/// two cgroups at the top), wrote `b 254:0 r` (this VM's root disk, `/dev/vda`) into its
/// own cgroup's `devices.allow`, and `devices.list` then held `b 254:0 r`: the device rules
/// tessera's grant set are the container's to rewrite. (Creating the node to read the disk
/// was not shown: `mknod` made no node under the container's `/dev` here; not pursued.)
#[test]
fn an_exec_adding_cap_sys_admin_to_a_gpu_container_is_refused_whatever_its_bundle_says_now() {
    let node = Node::start();
    let mut mine = node.bundle("mine", "team-untrusted", Some("mig=1g.10gb"), &["sleep", "300"]);
    mine.write();
    let out = node.fx.create_container(&mine, "mine");
    assert!(out.status.success(), "{}", out.stderr_str());
    let out = node.fx.start_container("mine");
    assert!(out.status.success(), "{}", out.stderr_str());
    let pid = node.fx.container_pid("mine").expect("the GPU container's pid");
    // With CAP_SYS_ADMIN: the devices hierarchy mounted read-write (no cgroup namespace:
    // the host's root of it), and a rule added to the container's own cgroup.
    let script = "grep CapEff /proc/self/status; mkdir -p /tmp/cg; \
                  mount -t cgroup -o devices devices /tmp/cg && echo mounted; \
                  own=$(grep ':devices:' /proc/self/cgroup | cut -d: -f3); echo own=$own; \
                  echo 'b 254:0 r' > /tmp/cg$own/devices.allow && echo allowed; \
                  grep '^b 254:0' /tmp/cg$own/devices.list; ls -d /tmp/cg/*/ | wc -l; \
                  umount /tmp/cg";
    let exec = |node: &Node| {
        node.fx.runc(
            &["exec", "--cap", "CAP_SYS_ADMIN", "--cap", "CAP_MKNOD", "mine", "sh", "-c", script],
            &[],
        )
    };
    let before = exec(&node);
    let refused_before = before.stderr_str();
    // The tenant's own bundle, after the create: a user namespace the container never got.
    let config_path = mine.config_path();
    let mut config: serde_json::Value =
        serde_json::from_slice(&fs::read(&config_path).unwrap()).unwrap();
    config["linux"]["namespaces"].as_array_mut().unwrap().push(json!({"type": "user"}));
    fs::write(&config_path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
    let after = exec(&node);
    let userns_now = fs::read_link(format!("/proc/{pid}/ns/user")).ok();
    let userns_host = fs::read_link("/proc/self/ns/user").ok();
    node.fx.delete_container("mine", true);
    assert!(
        !before.status.success()
            && (refused_before.contains("CAP_SYS_ADMIN without a user namespace")
                || refused_before.contains("CAP_SYS_ADMIN: a capability the container was not")),
        "premise: refused with the bundle as created: {refused_before}"
    );
    assert!(
        !after.status.success(),
        "runc exec --cap CAP_SYS_ADMIN into the GPU container {pid} (its user namespace \
         {userns_now:?}, the host's {userns_host:?}) after its bundle's config.json was given a \
         user namespace: exit {:?}, it printed {:?} (stderr {:?})",
        after.status.code(),
        after.stdout_str(),
        after.stderr_str()
    );
}

/// Class: an exec into a container without a GPU — the capabilities runc gives the exec's
/// process come from the bundle's `config.json` as it is at the exec, which no check reads.
///
/// `exec::check_plain_exec` refuses `HOST_CAPABILITIES` (CAP_SYS_ADMIN among them) given
/// by `--cap` or by a `--process` file. Without `--process`, runc 1.1.5's `exec`
/// (`getProcess`) loads `<bundle>/config.json` again — the bundle named by its record's
/// `bundle=` label — and runs the exec with that file's `process` (capabilities
/// included), plus the `--cap`s. The create's checks read that file once, at create; the
/// tenant writes it after. Here: a plain container created and started through
/// tessera-runtime with `runc spec`'s capabilities; then CAP_SYS_ADMIN appended to its
/// bundle's `process.capabilities` bounding, effective and permitted sets; then a plain
/// `runc exec` (no flags).
///
/// Seen with runc 1.1.5: `runc exec --cap CAP_SYS_ADMIN` is refused ("it acts on the host
/// itself"); after the edit, the plain exec exits 0; its `CapEff` is `0000000020200420`
/// (CAP_SYS_ADMIN, bit 21), in the host's user namespace; it mounted the cgroup v1
/// `devices` hierarchy read-write (the host's root of it), wrote `b 254:0 r` (this VM's
/// root disk) into its own cgroup's `devices.allow`, and `devices.list` held it. The same
/// holds for CAP_SYS_PTRACE (`check_plain_exec`'s rule for containers that see outside
/// their pid namespace reads `--cap` and `--process` only) — read in the code, not run.
#[test]
fn an_exec_into_a_plain_container_gets_no_host_capability_from_its_bundle_rewritten() {
    let node = Node::start();
    let mut plain = node.bundle("plainx", "team-dev", None, &["sleep", "300"]);
    plain.write();
    let out = node.fx.create_container(&plain, "plainx");
    assert!(out.status.success(), "{}", out.stderr_str());
    let out = node.fx.start_container("plainx");
    assert!(out.status.success(), "{}", out.stderr_str());
    let pid = node.fx.container_pid("plainx").expect("the container's pid");
    let script = "grep CapEff /proc/self/status; mkdir -p /tmp/cg; \
                  mount -t cgroup -o devices devices /tmp/cg && echo mounted; \
                  own=$(grep ':devices:' /proc/self/cgroup | cut -d: -f3); echo own=$own; \
                  echo 'b 254:0 r' > /tmp/cg$own/devices.allow && echo allowed; \
                  grep '^b 254:0' /tmp/cg$own/devices.list; ls -d /tmp/cg/*/ | wc -l; \
                  umount /tmp/cg";
    let before =
        node.fx.runc(&["exec", "--cap", "CAP_SYS_ADMIN", "plainx", "sh", "-c", script], &[]);
    let config_path = plain.config_path();
    let mut config: serde_json::Value =
        serde_json::from_slice(&fs::read(&config_path).unwrap()).unwrap();
    for set in ["bounding", "effective", "permitted"] {
        config["process"]["capabilities"][set].as_array_mut().unwrap().push(json!("CAP_SYS_ADMIN"));
    }
    fs::write(&config_path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
    let after = node.fx.runc(&["exec", "plainx", "sh", "-c", script], &[]);
    let userns_now = fs::read_link(format!("/proc/{pid}/ns/user")).ok();
    let userns_host = fs::read_link("/proc/self/ns/user").ok();
    node.fx.delete_container("plainx", true);
    let refused_before = before.stderr_str();
    assert!(
        !before.status.success() && refused_before.contains("--cap CAP_SYS_ADMIN"),
        "premise: --cap CAP_SYS_ADMIN is refused: {refused_before}"
    );
    assert!(
        !after.status.success(),
        "runc exec into the plain container {pid} (its user namespace {userns_now:?}, the \
         host's {userns_host:?}) after its bundle's config.json was given CAP_SYS_ADMIN: exit \
         {:?}, it printed {:?} (stderr {:?})",
        after.status.code(),
        after.stdout_str(),
        after.stderr_str()
    );
}

/// Class: the `--process` file of an exec is read twice — by tessera-runtime's check
/// (`exec::read_process`, `O_NOFOLLOW`) and again, by path, by runc.
///
/// tessera-runtime judges the capabilities of the file it read, then hands runc the same
/// *path* (not the bytes it judged). The path is in a directory the tenant writes; the
/// racer (round 6's stand-in for a process racing the wrapper) replaces the file with a
/// link to one that adds CAP_SYS_ADMIN after the check and before runc runs; runc 1.1.5's
/// `getProcess` follows the link.
///
/// Seen with runc 1.1.5 (GPU container `mine`, team-untrusted, `mig=1g.10gb`, created and
/// started through tessera-runtime): `runc exec --process evil.json mine` is refused
/// ("CAP_SYS_ADMIN without a user namespace of its own"); `runc exec --process
/// process.json mine`, swapped by the racer, exits 0: `CapEff` `0000000020200420`
/// (CAP_SYS_ADMIN), the cgroup v1 `devices` hierarchy mounted read-write, `b 254:0 r` (the
/// root disk) written into its own cgroup's `devices.allow` and listed back. (A plain
/// container's `--process` check, `check_plain_exec`, reads it the same way: not run.)
#[test]
fn an_exec_process_file_swapped_after_the_wrappers_read_gives_no_host_capability() {
    let node = Node::start();
    let mut mine = node.bundle("mine", "team-untrusted", Some("mig=1g.10gb"), &["sleep", "300"]);
    mine.write();
    let out = node.fx.create_container(&mine, "mine");
    assert!(out.status.success(), "{}", out.stderr_str());
    let out = node.fx.start_container("mine");
    assert!(out.status.success(), "{}", out.stderr_str());
    let pid = node.fx.container_pid("mine").expect("the GPU container's pid");
    let config: serde_json::Value =
        serde_json::from_slice(&fs::read(mine.config_path()).unwrap()).unwrap();
    let mut process = config["process"].clone();
    process["args"] = json!([
        "sh",
        "-c",
        "grep CapEff /proc/self/status; mkdir -p /tmp/cg; \
        mount -t cgroup -o devices devices /tmp/cg && echo mounted; \
        own=$(grep ':devices:' /proc/self/cgroup | cut -d: -f3); echo own=$own; \
        echo 'b 254:0 r' > /tmp/cg$own/devices.allow && echo allowed; \
        grep '^b 254:0' /tmp/cg$own/devices.list; umount /tmp/cg"
    ]);
    let vol = mine.dir().join("vol");
    fs::create_dir_all(&vol).unwrap();
    let file = vol.join("process.json");
    fs::write(&file, serde_json::to_vec(&process).unwrap()).unwrap();
    for set in ["bounding", "effective", "permitted"] {
        process["capabilities"][set].as_array_mut().unwrap().push(json!("CAP_SYS_ADMIN"));
    }
    let evil = vol.join("evil.json");
    fs::write(&evil, serde_json::to_vec(&process).unwrap()).unwrap();
    let racer = racing_runc(&mine, "exec", &[(&file, &evil)]);
    let f = file.to_str().unwrap();
    let direct = node.fx.runc(&["exec", "--process", evil.to_str().unwrap(), "mine"], &[]);
    let raced = node
        .fx
        .runc(&["exec", "--process", f, "mine"], &[("TESSERA_RUNC", racer.to_str().unwrap())]);
    node.fx.delete_container("mine", true);
    let refused = direct.stderr_str();
    assert!(
        !direct.status.success()
            && (refused.contains("CAP_SYS_ADMIN without a user namespace")
                || refused.contains("CAP_SYS_ADMIN: a capability the container was not")),
        "premise: the file with CAP_SYS_ADMIN, given directly, is refused: {refused}"
    );
    assert!(
        !raced.status.success(),
        "runc exec --process into the GPU container {pid}, the file swapped for a link to one \
         with CAP_SYS_ADMIN after tessera-runtime read it: exit {:?}, it printed {:?} (stderr \
         {:?})",
        raced.status.code(),
        raced.stdout_str(),
        raced.stderr_str()
    );
}

/// Class: as `an_exec_into_a_created_plain_container_with_a_forged_grant_label_is_judged`
/// (an annotation *key* `tessera.io/allocated=GPU-forged` survives the strip and runc
/// records it as the label `tessera.io/allocated=GPU-forged=x`), for round 9's exec rule:
/// an exec adds no CAP_SYS_PTRACE the container's init does not hold
/// (`check_plain_exec`). With the label, `check_exec` takes the GPU path, whose allow-list
/// holds CAP_SYS_PTRACE. Where Yama is 1 or more a plain container in the host's pid
/// namespace (or with the host's `/proc` bound) is created without CAP_SYS_PTRACE, and
/// this rule is what keeps an exec from adding the capability that passes Yama
/// (reasoning, as rt-iso4's unit test reads it: not run, this kernel has no Yama and
/// such a container is refused at create here).
///
/// Seen with runc 1.1.5 (two plain containers with their own pid namespace, created and
/// started through tessera-runtime, init `CapBnd` `0000000020000420` both): into the
/// unlabelled one, `runc exec --cap CAP_SYS_PTRACE` is refused ("CAP_SYS_PTRACE, which the
/// container was created without"); into the one with the forged label it exits 0 and its
/// process's `CapEff` is `0000000020080420` (CAP_SYS_PTRACE, bit 19, added).
#[test]
fn an_exec_adds_no_cap_sys_ptrace_to_a_plain_container_with_a_forged_grant_label() {
    let node = Node::start();
    let run = |id: &str, forged: bool| {
        let mut b = node.bundle(id, "team-dev", None, &["sleep", "300"]);
        if forged {
            b.mutate(|c| c["annotations"] = json!({"tessera.io/allocated=GPU-forged": "x"}));
        }
        b.write();
        let out = node.fx.create_container(&b, id);
        if forged && !out.status.success() {
            // Stopped at the create since (a key holding `=` is refused for every config).
            assert!(out.stderr_str().contains("annotations["), "{}", out.stderr_str());
            return (String::new(), out);
        }
        assert!(out.status.success(), "{id}: {}", out.stderr_str());
        let out = node.fx.start_container(id);
        assert!(out.status.success(), "{id}: {}", out.stderr_str());
        let pid = node.fx.container_pid(id).unwrap();
        let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let init_bnd = status.lines().find(|l| l.starts_with("CapBnd:")).unwrap_or("").to_string();
        let exec = node.fx.runc(
            &["exec", "--cap", "CAP_SYS_PTRACE", id, "grep", "CapEff", "/proc/self/status"],
            &[],
        );
        node.fx.delete_container(id, true);
        (init_bnd, exec)
    };
    let (bnd_plain, plain) = run("unlabelled", false);
    let (bnd_forged, forged) = run("forged", true);
    let refused = plain.stderr_str();
    assert!(
        !plain.status.success()
            && (refused.contains("CAP_SYS_PTRACE, which the container was")
                || refused.contains("CAP_SYS_PTRACE: a capability the container was not")),
        "premise: refused without the forged label (init {bnd_plain}): {refused}"
    );
    assert!(
        !forged.status.success(),
        "runc exec --cap CAP_SYS_PTRACE into a plain container (init {bnd_forged}) whose \
         record carries a forged `tessera.io/allocated=` label: exit {:?}, the exec's {:?} \
         (stderr {:?})",
        forged.status.code(),
        forged.stdout_str().trim(),
        forged.stderr_str()
    );
}

/// Class: which bundle an exec's process comes from — runc 1.1.5 takes the *first*
/// `bundle=` label of its record, tessera-runtime the last.
///
/// runc records each annotation as a label `key=value` and appends its own
/// `bundle=<dir>` last. Its `exec` (no `--process`) loads `<bundle>/config.json` for the
/// process — capabilities included — with `utils.SearchLabels(labels, "bundle")`, which
/// returns the first match; `supervise::label_hint` (which `check_exec` uses to find the
/// config it judges) takes the last, on the ground that runc reads labels "into a map
/// (the last wins)" — true of `runc state`'s annotations, not of `exec`. An annotation named
/// `bundle` is kept by tessera-runtime (plain and GPU configs alike) and names another
/// bundle directory whose `config.json` (never created, never judged) holds CAP_SYS_ADMIN.
///
/// Seen with runc 1.1.5 (a plain container `lab` and a GPU container `gpulab`,
/// team-untrusted, `mig=1g.10gb`, created and started through tessera-runtime): their
/// records' labels are `["bundle=…/otherb", …, "bundle=…/lab"]` and `[…,
/// "tessera.io/allocated=MIG-…", "tessera.io/confirm=after-create", …,
/// "bundle=…/otherb", "bundle=…/gpulab"]`; `runc exec --cap CAP_SYS_ADMIN` is refused
/// into each ("it acts on the host itself"; "CAP_SYS_ADMIN without a user namespace of its
/// own"); a plain `runc exec <id> grep CapEff /proc/self/status` exits 0 in each, printing
/// `CapEff: 0000000020200420` — CAP_SYS_ADMIN (bit 21), in the host's user namespace (what
/// it does with it: `an_exec_adding_cap_sys_admin_to_a_gpu_container_is_refused_whatever_
/// its_bundle_says_now`). Unlike that test, nothing of the container's own bundle is
/// rewritten after create: the config with the annotation is what the create judged.
#[test]
fn an_exec_takes_its_process_from_the_bundle_tessera_judged() {
    let node = Node::start();
    let mut other = node.bundle("otherb", "team-dev", None, &["sleep", "300"]);
    other
        .mutate(|c| {
            for set in ["bounding", "effective", "permitted"] {
                c["process"]["capabilities"][set]
                    .as_array_mut()
                    .unwrap()
                    .push(json!("CAP_SYS_ADMIN"));
            }
        })
        .write();
    let other_dir = other.dir().to_str().unwrap().to_string();
    let mut seen = Vec::new();
    for (id, tenant, request) in
        [("lab", "team-dev", None), ("gpulab", "team-untrusted", Some("mig=1g.10gb"))]
    {
        let mut b = node.bundle(id, tenant, request, &["sleep", "300"]);
        b.mutate(|c| c["annotations"]["bundle"] = json!(other_dir)).write();
        let out = node.fx.create_container(&b, id);
        if !out.status.success() {
            // Stopped at the create since: an annotation named `bundle` is refused.
            assert!(out.stderr_str().contains("annotations[bundle]"), "{}", out.stderr_str());
            continue;
        }
        let out = node.fx.start_container(id);
        assert!(out.status.success(), "{id}: {}", out.stderr_str());
        let record = fs::read_to_string(node.fx.runc_root().join(id).join("state.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .map(|v| v["config"]["labels"].clone());
        let cap = node.fx.runc(&["exec", "--cap", "CAP_SYS_ADMIN", id, "true"], &[]);
        let exec = node.fx.runc(&["exec", id, "grep", "CapEff", "/proc/self/status"], &[]);
        node.fx.delete_container(id, true);
        seen.push((id, record, cap.stderr_str(), exec.status.code(), exec.stdout_str()));
    }
    for (id, record, cap, code, out) in &seen {
        assert!(!cap.is_empty(), "premise: {id}: --cap CAP_SYS_ADMIN is refused");
        // CAP_SYS_ADMIN is bit 21.
        let eff = out.trim().strip_prefix("CapEff:").map(str::trim).unwrap_or("0");
        let eff = u64::from_str_radix(eff, 16).unwrap_or(0);
        assert!(
            eff & (1 << 21) == 0,
            "{id}: a plain `runc exec` (exit {code:?}) ran with {out:?}: CAP_SYS_ADMIN, from the \
             config.json of the bundle its `bundle` annotation names (its record's labels \
             {record:?}; --cap CAP_SYS_ADMIN was refused: {cap:?})"
        );
    }
}
