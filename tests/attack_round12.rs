//! Red-team round 12 (branch rt-iso8): round 11's fixes (f7e7d12) read as runc 1.1.5 and
//! the kernel carry them out. Run as rounds 6 and 8 to 11 run: tesserad on the simulated
//! node, tessera-runtime and tessera-hook as built, real runc and the kernel; each case
//! reads back what the kernel gave the exec'd process.
//!
//! A test that fails here is an attack that got through (or, where its doc says so, a
//! false refusal).
//!
//! What got through, in short: an exec without `--process` is judged on the bundle's
//! `config.json` as tessera-runtime read it, and run with the file runc reads again
//! afterwards — round 11 snapshotted `--process`, not the bundle's config (CAP_SYS_ADMIN
//! into a plain and a GPU container). False refusals: an exec into a container whose init
//! narrowed its own bounding set (`check_within_init` reads `CapBnd` now, not what the
//! create gave; `runc exec` and `docker exec` alike), and `runc exec -p FILE` (the
//! appended `--process` is a second form of the same urfave/cli flag).
//!
//! Tried and let through, as they should be (dockerd with tessera-runtime, not kept as
//! tests): `docker exec` into a plain container, one with `--gpus 1`, one run with
//! `--user 1000`, one with `--cap-add SYS_PTRACE`, and `docker exec -u 1000` into each.
//!
//! Not run (reasoning from runc 1.1.5's behaviour, not demonstrated): lower-case or unprefixed
//! capability names (runc's map is exact, `CAP_` + upper case: it ignores them);
//! `--process` after `--` or after the id (runc's exec does not reorder: they are the
//! command's); an exec into a container whose init pid was reused (runc's own state
//! check compares the init's start time and refuses a stopped container).

#![allow(clippy::unwrap_used)]

use std::fs;
use std::path::Path;

use serde_json::json;
use tessera_harness::attack::*;
use tessera_harness::node::*;
use tessera_harness::*;

/// CapEff of a `grep CapEff /proc/self/status` output, 0 where there is none.
fn cap_eff(out: &str) -> u64 {
    let eff = out.trim().strip_prefix("CapEff:").map(str::trim).unwrap_or("0");
    u64::from_str_radix(eff, 16).unwrap_or(0)
}

/// Class: an exec without `--process` — its process comes from the bundle's `config.json`,
/// which tessera-runtime reads once (round 11's `exec::bundle_process` for a plain
/// container, `check_exec`'s `config.get("process")` for a GPU one) and runc 1.1.5 reads
/// again, by path, after the wrapper's checks (`getProcess`: `os.Chdir(bundle)`,
/// `loadSpec("config.json")`, links followed).
///
/// Round 11 closed this for `--process` (`exec::snapshot_process`: the bytes judged are
/// the bytes runc reads, a memfd) and judged the bundle's process *as it is at the exec*
/// against the init's bounding set (`check_within_init`), but the bundle's config is not
/// snapshotted: the tenant's bundle (round 11's premise: the tenant writes it after the
/// create) is swapped for a link to a config adding CAP_SYS_ADMIN after the check and
/// before runc reads it. The racer is rounds 6–11's stand-in for a process racing the
/// wrapper.
///
/// Seen with runc 1.1.5 (a plain container `racep`, team-dev, and a GPU container
/// `raceg`, team-untrusted, `mig=1g.10gb`, both created and started through
/// tessera-runtime with `runc spec`'s capabilities): `runc exec --cap CAP_SYS_ADMIN` is
/// refused into each; the same config with CAP_SYS_ADMIN written in place before the exec
/// is refused too (round 11's fix); a plain `runc exec <id> grep CapEff /proc/self/status`
/// with the racer swapping `config.json` exits 0 and prints `CapEff: 0000000020200420`
/// in each of the two — CAP_SYS_ADMIN (bit 21), in the host's user namespace (what it does with it: round
/// 11's `an_exec_into_a_plain_container_gets_no_host_capability_from_its_bundle_rewritten`:
/// the `devices` cgroup hierarchy mounted read-write, the root disk allowed).
#[test]
#[ignore = "open (docs/SECURITY.md, twelfth round): the swap needs write access to the \
            engine's bundle directory (root's: the trust table's engine row); closing it means \
            giving runc a judged --process for every exec, runc's flags applied as it applies \
            them"]
fn an_exec_takes_no_capability_from_a_bundle_config_swapped_after_the_check() {
    let node = Node::start();
    let mut seen = Vec::new();
    for (id, tenant, request) in
        [("racep", "team-dev", None), ("raceg", "team-untrusted", Some("mig=1g.10gb"))]
    {
        let mut b = node.bundle(id, tenant, request, &["sleep", "300"]);
        b.write();
        let out = node.fx.create_container(&b, id);
        assert!(out.status.success(), "{id}: {}", out.stderr_str());
        let out = node.fx.start_container(id);
        assert!(out.status.success(), "{id}: {}", out.stderr_str());
        let pid = node.fx.container_pid(id).expect("the container's pid");
        let config_path = b.config_path();
        let original = fs::read(&config_path).unwrap();
        let mut config: serde_json::Value = serde_json::from_slice(&original).unwrap();
        for set in ["bounding", "effective", "permitted"] {
            config["process"]["capabilities"][set]
                .as_array_mut()
                .unwrap()
                .push(json!("CAP_SYS_ADMIN"));
        }
        let evil = b.dir().join("evil-config.json");
        fs::write(&evil, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
        let cap = node.fx.runc(&["exec", "--cap", "CAP_SYS_ADMIN", id, "true"], &[]);
        // Written in place before the exec: round 11's fix refuses it.
        fs::write(&config_path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
        let in_place = node.fx.runc(&["exec", id, "grep", "CapEff", "/proc/self/status"], &[]);
        fs::write(&config_path, &original).unwrap();
        let racer = racing_runc(&b, "exec", &[(&config_path, &evil)]);
        let raced = node.fx.runc(
            &["exec", id, "grep", "CapEff", "/proc/self/status"],
            &[("TESSERA_RUNC", racer.to_str().unwrap())],
        );
        node.fx.delete_container(id, true);
        seen.push((id, pid, cap, in_place, raced));
    }
    let mut got_through = Vec::new();
    for (id, pid, cap, in_place, raced) in &seen {
        assert!(!cap.status.success(), "premise: {id}: --cap CAP_SYS_ADMIN is refused");
        assert!(
            cap_eff(&in_place.stdout_str()) & (1 << 21) == 0,
            "premise: {id}: CAP_SYS_ADMIN written into the bundle before the exec is refused: \
             {:?}",
            in_place.stderr_str()
        );
        if cap_eff(&raced.stdout_str()) & (1 << 21) != 0 {
            got_through.push(format!(
                "{id} (init {pid}): exit {:?}, ran with {:?}",
                raced.status.code(),
                raced.stdout_str().trim()
            ));
        }
    }
    assert!(
        got_through.is_empty(),
        "a plain `runc exec`, the bundle's config.json swapped for a link to one with \
         CAP_SYS_ADMIN after tessera-runtime's check: {got_through:?}"
    );
}

/// A static helper (built with the host's `cc -static`) that drops capability `bit` from
/// its own bounding set, then execs its arguments: an entrypoint that narrows itself, as
/// `capsh --drop=…` or `setpriv --bounding-set -…` do.
fn bounding_dropper(into: &Path, bit: u32) {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("drop.c");
    fs::write(
        &src,
        format!(
            "#include <sys/prctl.h>\n#include <unistd.h>\n\
             int main(int c, char **v) {{ if (prctl(PR_CAPBSET_DROP, {bit}, 0, 0, 0)) return 126;\n\
             execv(v[1], v + 1); return 127; }}\n"
        ),
    )
    .unwrap();
    let out = std::process::Command::new("cc")
        .args(["-static", "-O2", "-o"])
        .arg(into)
        .arg(&src)
        .output()
        .unwrap();
    assert!(out.status.success(), "cc: {}", String::from_utf8_lossy(&out.stderr));
}

/// FALSE REFUSAL. Class: what an exec may hold — round 11's `exec::check_within_init`
/// takes the init's bounding set *as the kernel reports it now* for what the create gave
/// the container, but a container's init may narrow its own bounding set after runc
/// started it (`PR_CAPBSET_DROP`: an entrypoint that hardens itself with `capsh --drop`
/// or `setpriv --bounding-set`). From then on every exec whose process lists the
/// container's own configured capabilities — a plain `runc exec` (the bundle's process,
/// untouched since the create), and so `docker exec`, `podman exec` and CRI's
/// `ExecSync`, which send the container spec's capabilities — is refused, though it
/// asks nothing the create did not judge and give.
///
/// Seen with runc 1.1.5 (a plain container, team-dev, `runc spec`'s capabilities
/// CAP_AUDIT_WRITE, CAP_KILL, CAP_NET_BIND_SERVICE plus CAP_SETPCAP (Docker's default set
/// holds it; `PR_CAPBSET_DROP` needs it), its init a static helper that drops
/// CAP_NET_BIND_SERVICE (bit 10) from its own bounding set and execs `sleep 300`, created
/// and started through tessera-runtime, its bundle never touched): the init's `CapBnd` is
/// `0000000020000120`; `runc exec <id> true` is refused ("exec process.capabilities.
/// bounding: CAP_NET_BIND_SERVICE: a capability the container's init does not hold").
/// (`docker exec`: run, in the next test; podman and CRI: reasoning from what they
/// send, not run.)
#[test]
fn an_exec_into_a_container_whose_init_narrowed_its_bounding_set_is_let_in() {
    let node = Node::start();
    let mut b = node.bundle("narrow", "team-dev", None, &["/dropbnd", "/bin/sleep", "300"]);
    // Docker's default set holds CAP_SETPCAP, which PR_CAPBSET_DROP needs.
    b.mutate(|c| {
        for set in ["bounding", "effective", "permitted"] {
            c["process"]["capabilities"][set].as_array_mut().unwrap().push(json!("CAP_SETPCAP"));
        }
    })
    .write();
    bounding_dropper(&b.rootfs().join("dropbnd"), 10);
    let out = node.fx.create_container(&b, "narrow");
    assert!(out.status.success(), "{}", out.stderr_str());
    let out = node.fx.start_container("narrow");
    assert!(out.status.success(), "{}", out.stderr_str());
    let pid = node.fx.container_pid("narrow").expect("the container's pid");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let init_bnd = status.lines().find(|l| l.starts_with("CapBnd:")).unwrap_or("").to_string();
    let exec = node.fx.runc(&["exec", "narrow", "true"], &[]);
    node.fx.delete_container("narrow", true);
    assert!(
        exec.status.success(),
        "a plain `runc exec narrow true` (bundle untouched since the create; init {pid} \
         {init_bnd}) was refused: exit {:?}, stderr {:?}",
        exec.status.code(),
        exec.stderr_str()
    );
}

/// FALSE REFUSAL. Class: round 11's `exec::snapshot_process` appends `--process
/// /proc/self/fd/N` whatever name the caller gave the flag. runc 1.1.5's exec declares it
/// as `process, p` (urfave/cli v1: one Go flag per name) and refuses a command line that
/// sets both names (`normalizeFlags`: "Cannot use two forms of the same flag"), so an
/// exec spelled with runc's documented short form `-p FILE` never runs.
///
/// Seen with runc 1.1.5 (a plain container, team-dev, created and started through
/// tessera-runtime; FILE its own config's process with `args` `["true"]`): `runc exec
/// --process FILE <id>` exits 0; `runc exec -p FILE <id>` exits 1.
#[test]
fn an_exec_spelled_with_the_short_process_flag_runs() {
    let node = Node::start();
    let mut b = node.bundle("shortp", "team-dev", None, &["sleep", "300"]);
    b.write();
    let out = node.fx.create_container(&b, "shortp");
    assert!(out.status.success(), "{}", out.stderr_str());
    let out = node.fx.start_container("shortp");
    assert!(out.status.success(), "{}", out.stderr_str());
    let config: serde_json::Value =
        serde_json::from_slice(&fs::read(b.config_path()).unwrap()).unwrap();
    let mut process = config["process"].clone();
    process["args"] = json!(["true"]);
    process["terminal"] = json!(false);
    let file = b.dir().join("process.json");
    fs::write(&file, serde_json::to_vec(&process).unwrap()).unwrap();
    let f = file.to_str().unwrap();
    let long = node.fx.runc(&["exec", "--process", f, "shortp"], &[]);
    let short = node.fx.runc(&["exec", "-p", f, "shortp"], &[]);
    node.fx.delete_container("shortp", true);
    assert!(long.status.success(), "premise: --process runs: {}", long.stderr_str());
    assert!(
        short.status.success(),
        "runc exec -p FILE (runc's own short form of --process): exit {:?}, stderr {:?}",
        short.status.code(),
        short.stderr_str()
    );
}

/// FALSE REFUSAL, through Docker: as
/// `an_exec_into_a_container_whose_init_narrowed_its_bounding_set_is_let_in`, with
/// `docker exec` (dockerd → containerd → tessera-runtime, the `--process` file Docker
/// builds from the container's spec: its default capabilities, CAP_SETPCAP and CAP_NET_RAW
/// among them).
///
/// Seen (dockerd with tessera-runtime as `tessera`, busybox image): a `docker exec` into a
/// plain container runs (premise); a container whose entrypoint is a static helper that
/// drops CAP_NET_RAW (bit 13) from its own bounding set before exec'ing `sleep 300` starts,
/// its init's `CapBnd` `00000000a80405fb`; `docker exec <id> true` exits 126: "OCI runtime
/// exec failed: tessera-runtime: … exec process.capabilities.bounding: CAP_NET_RAW: a
/// capability the container's init does not hold".
#[test]
fn a_docker_exec_into_a_container_whose_init_narrowed_its_bounding_set_runs() {
    use std::process::Command;
    use tessera_harness::docker::{Dockerd, DOCKER_IMAGE};
    use tessera_harness::node::{repo, NodeOptions};
    let node_dir = tempfile::tempdir().unwrap();
    let mut p: serde_json::Value =
        serde_json::from_slice(&fs::read(repo("examples/policy.json")).unwrap()).unwrap();
    p["default_tenant"] = json!("acme/untrusted/sandbox/guest");
    let policy = node_dir.path().join("policy.json");
    fs::write(&policy, serde_json::to_vec_pretty(&p).unwrap()).unwrap();
    let node = Node::start_with(NodeOptions { policy, ..Default::default() });
    let text = node.runtime_config(None);
    let d = Dockerd::start(|config, dir| {
        let plain = dir.join("runtime.toml");
        fs::write(&plain, &text).unwrap();
        run_cmd(
            Command::new(tessera_cli())
                .args(["setup", "docker", "--config"])
                .arg(config)
                .args(["--name", "tessera", "--runtime-path", tessera_runtime()])
                .arg("--runtime-config")
                .arg(&plain),
        )
        .assert_success("tessera setup docker");
    });
    let run = d.docker(&["run", "-d", "--runtime", "tessera", DOCKER_IMAGE, "sleep", "300"]);
    run.assert_success("docker run");
    let plain_id = run.stdout_str().trim().to_owned();
    let plain = d.docker(&["exec", &plain_id, "true"]);
    d.docker(&["rm", "-f", &plain_id]);
    let helper = node_dir.path().join("dropbnd");
    bounding_dropper(&helper, 13);
    let c = d.docker(&[
        "create",
        "--runtime",
        "tessera",
        DOCKER_IMAGE,
        "/dropbnd",
        "/bin/sleep",
        "300",
    ]);
    c.assert_success("docker create");
    let id = c.stdout_str().trim().to_owned();
    d.docker(&["cp", helper.to_str().unwrap(), &format!("{id}:/dropbnd")])
        .assert_success("docker cp");
    d.docker(&["start", &id]).assert_success("docker start");
    std::thread::sleep(std::time::Duration::from_millis(500));
    let pid = d.docker(&["inspect", "-f", "{{.State.Pid}}", &id]).stdout_str().trim().to_owned();
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let init_bnd = status.lines().find(|l| l.starts_with("CapBnd:")).unwrap_or("").to_owned();
    let exec = d.docker(&["exec", &id, "true"]);
    d.docker(&["rm", "-f", &id]);
    assert!(plain.status.success(), "premise: docker exec runs: {}", plain.stderr_str());
    assert!(
        exec.status.success(),
        "docker exec into a container whose init (pid {pid}, {init_bnd}) dropped CAP_NET_RAW \
         from its own bounding set: exit {:?}: {}{}",
        exec.status.code(),
        exec.stdout_str(),
        exec.stderr_str()
    );
}
