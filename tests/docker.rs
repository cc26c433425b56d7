//! Docker as its users run it: Debian's dockerd 20.10 with the runtimes `tessera setup
//! docker` writes (no environment on dockerd but PATH, which holds the
//! `nvidia-container-runtime-hook` link `--gpus` needs), an image from `docker import`,
//! tesserad on the simulated H100 node.
//!
//! - `docker run --runtime tessera --gpus 1` gets a grant for the default tenant, which is
//!   given back when the container stops;
//! - a second runtime (`tessera-alice`, its own runtime config naming `engine =
//!   "docker-alice"`) is a second tenant, by the policy's engine identity rule;
//! - `--device` of an NVIDIA node without a request does not reach it (plain runc, the
//!   control, does);
//! - `--gpus` on plain runc fails (the stand-in hook refuses) instead of running GPU-less.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use tessera_harness::docker::{Dockerd, DOCKER_IMAGE};
use tessera_harness::node::{repo, Node, NodeOptions};
use tessera_harness::*;

const DEFAULT_TENANT: &str = "acme/untrusted/sandbox/guest";
const ALICE: &str = "acme/trusted/training/alice";

/// The example policy, plus the identity a shared Docker host needs: the engine rule and
/// a default tenant.
fn policy(dir: &Path) -> std::path::PathBuf {
    let mut p: Value =
        serde_json::from_slice(&std::fs::read(repo("examples/policy.json")).expect("policy"))
            .expect("json");
    p["identity"]
        .as_array_mut()
        .expect("identity")
        .insert(0, json!({"annotation": "tessera.io/engine", "map": {"docker-alice": ALICE}}));
    p["default_tenant"] = json!(DEFAULT_TENANT);
    let f = dir.join("policy.json");
    std::fs::write(&f, serde_json::to_vec_pretty(&p).expect("json")).expect("write policy");
    f
}

fn setup_docker(config: &Path, name: &str, runtime_config: &Path) {
    let out = run_cmd(
        Command::new(tessera_cli())
            .args(["setup", "docker", "--config"])
            .arg(config)
            .args(["--name", name, "--runtime-path", tessera_runtime(), "--runtime-config"])
            .arg(runtime_config),
    );
    out.assert_success("tessera setup docker");
}

#[test]
fn docker_gpus_identity_and_no_grant_no_gpu() {
    let node_dir = tempfile::tempdir().expect("tempdir");
    let node =
        Node::start_with(NodeOptions { policy: policy(node_dir.path()), ..Default::default() });
    let (plain_text, alice_text) =
        (node.runtime_config(None), node.runtime_config(Some("docker-alice")));
    let d = Dockerd::start(|config, dir| {
        let plain = dir.join("runtime.toml");
        let alice = dir.join("runtime-alice.toml");
        std::fs::write(&plain, &plain_text).expect("runtime config");
        std::fs::write(&alice, &alice_text).expect("runtime config");
        setup_docker(config, "tessera", &plain);
        setup_docker(config, "tessera-alice", &alice);
        // Idempotent: a second run changes nothing.
        let again = run_cmd(
            Command::new(tessera_cli())
                .args(["setup", "docker", "--dry-run", "--config"])
                .arg(config)
                .args(["--runtime-path", tessera_runtime(), "--runtime-config"])
                .arg(&plain),
        );
        assert!(again.stdout_str().contains("nothing to change"), "{}", again.stdout_str());
    });

    // --gpus 1: a grant for the default tenant, the share's env in the container.
    let run = d.docker(&[
        "run",
        "-d",
        "--runtime",
        "tessera",
        "--gpus",
        "1",
        DOCKER_IMAGE,
        "sh",
        "-c",
        "env; sleep 60",
    ]);
    run.assert_success("docker run --gpus 1");
    let id = run.stdout_str().trim().to_owned();
    let a = node.grants();
    assert_eq!(a, vec![(id.clone(), DEFAULT_TENANT.to_owned(), "gpu=1".to_owned())], "{}", d.log());
    assert!(
        wait_for(
            || d.docker(&["logs", &id]).stdout_str().contains("CUDA_VISIBLE_DEVICES=GPU-"),
            Duration::from_secs(10)
        ),
        "{}",
        d.docker(&["logs", &id]).stdout_str()
    );
    // Released at stop.
    d.docker(&["stop", "-t", "1", &id]).assert_success("docker stop");
    assert!(wait_for(|| node.grants().is_empty(), Duration::from_secs(10)), "{:?}", node.grants());

    // The second runtime's config names its engine: the policy maps it to alice.
    let run = d.docker(&[
        "run",
        "-d",
        "--runtime",
        "tessera-alice",
        "--gpus",
        "2",
        DOCKER_IMAGE,
        "sleep",
        "60",
    ]);
    run.assert_success("docker run --gpus 2");
    let id = run.stdout_str().trim().to_owned();
    assert_eq!(node.grants(), vec![(id.clone(), ALICE.to_owned(), "gpu=2".to_owned())]);
    d.docker(&["rm", "-f", &id]).assert_success("docker rm -f");
    assert!(wait_for(|| node.grants().is_empty(), Duration::from_secs(10)));
    // Alice's GPUs go to another tenant only once scrubbed.
    let scrubbed = || {
        node.client().status().is_ok_and(|s| {
            s.gpus.iter().all(|g| {
                !matches!(
                    g.state,
                    tessera_api::DeviceState::Dirty | tessera_api::DeviceState::Scrubbing
                )
            })
        })
    };
    assert!(wait_for(scrubbed, Duration::from_secs(30)), "alice's GPUs scrubbed");

    // Particular GPUs: exactly those while free and allowed, else refused with the reason,
    // never other GPUs.
    let status = node.client().status().expect("status");
    let g3 = status.gpus.iter().find(|g| g.index == 3).expect("GPU 3").uuid.clone();
    assert!(status.gpus[0].mig_enabled, "the example node's GPU 0 is in MIG mode");
    let run = d.docker(&[
        "run",
        "-d",
        "--runtime",
        "tessera",
        "--gpus",
        "\"device=3\"",
        DOCKER_IMAGE,
        "sleep",
        "60",
    ]);
    run.assert_success("docker run --gpus device=3");
    let pinned_id = run.stdout_str().trim().to_owned();
    let a = node.client().allocation(&pinned_id).expect("allocation");
    assert_eq!(a.devices.iter().map(|x| x.uuid.as_str()).collect::<Vec<_>>(), [g3.as_str()]);
    for (list, why) in [
        (
            format!("\"device={g3}\""),
            format!("pinned GPU {g3} (tessera.io/gpu): in use by another container"),
        ),
        (format!("\"device={}\"", status.gpus[0].uuid), "the GPU is in MIG mode".to_string()),
        ("\"device=42\"".to_string(), "no GPU 42 on this node".to_string()),
    ] {
        let out = d.docker(&[
            "run",
            "--rm",
            "--runtime",
            "tessera",
            "--gpus",
            &list,
            DOCKER_IMAGE,
            "true",
        ]);
        assert!(!out.status.success(), "{list}");
        assert!(out.stderr_str().contains(&why), "{list}: {}", out.stderr_str());
    }
    d.docker(&["rm", "-f", &pinned_id]).assert_success("docker rm -f");
    assert!(wait_for(|| node.grants().is_empty(), Duration::from_secs(10)));

    // No grant, no GPU: an NVIDIA device node passed with --device does not reach the
    // container through tessera; plain runc (the control) lets it through.
    let dev = d.dir().join("nvidia5");
    let made = run_cmd(Command::new("mknod").arg(&dev).args(["c", "195", "5"]));
    made.assert_success("mknod");
    let device = format!("{}:/dev/nvidia5", dev.display());
    let probe = "ls /dev/nvidia5 2>&1; cat /sys/fs/cgroup/devices/devices.list";
    for (runtime, reaches) in [("runc", true), ("tessera", false)] {
        let out = d.docker(&[
            "run",
            "--rm",
            "--runtime",
            runtime,
            "--device",
            &device,
            DOCKER_IMAGE,
            "sh",
            "-c",
            probe,
        ]);
        out.assert_success(&format!("docker run --device ({runtime})"));
        let text = out.stdout_str();
        let has_node = !text.contains("No such file");
        let has_rule = text.lines().any(|l| l.starts_with("c 195:5 ") || l == "a *:* rwm");
        assert_eq!((has_node, has_rule), (reaches, reaches), "{runtime}:\n{text}");
    }
    assert!(node.grants().is_empty());

    // --gpus on plain runc: dockerd runs the stand-in hook, which refuses.
    let plain =
        d.docker(&["run", "--rm", "--runtime", "runc", "--gpus", "1", DOCKER_IMAGE, "true"]);
    assert!(!plain.status.success(), "{}", plain.stdout_str());
    assert!(plain.stderr_str().contains("--runtime tessera"), "{}", plain.stderr_str());
    drop(d);
    drop(node);
}

/// Issue 23 (3): `docker update` (dockerd → containerd's shim → `tessera-runtime update
/// --resources -`) of a GPU container cannot take it past its team's CPU and memory
/// ceilings: refused with Tessera's message, the kernel's limits as they were; within them
/// applied, and the grant counts the new amounts.
#[test]
fn docker_update_of_a_gpu_container_stays_within_its_quotas() {
    let node_dir = tempfile::tempdir().expect("tempdir");
    let file = policy(node_dir.path());
    let mut p: Value = serde_json::from_slice(&std::fs::read(&file).expect("read")).expect("json");
    p["quotas"] = json!({"acme/untrusted": {
        "cpu_cores": {"guarantee": 1, "ceiling": 1},
        "memory_gib": {"guarantee": 2, "ceiling": 2}
    }});
    std::fs::write(&file, serde_json::to_vec_pretty(&p).expect("json")).expect("write policy");
    let node = Node::start_with(NodeOptions { policy: file, ..Default::default() });
    let text = node.runtime_config(None);
    let d = Dockerd::start(|config, dir| {
        let rc = dir.join("runtime.toml");
        std::fs::write(&rc, &text).expect("runtime config");
        setup_docker(config, "tessera", &rc);
    });
    let run = d.docker(&[
        "run",
        "-d",
        "--runtime",
        "tessera",
        "--gpus",
        "1",
        "--cpus",
        "0.5",
        "--memory",
        "512m",
        DOCKER_IMAGE,
        "sleep",
        "60",
    ]);
    run.assert_success("docker run --gpus 1 --cpus 0.5 --memory 512m");
    let id = run.stdout_str().trim().to_owned();
    let cg = d.container_cgroup(&id);
    let kernel = || {
        let read = |f: &str| {
            std::fs::read_to_string(format!("/sys/fs/cgroup/{f}"))
                .expect("cgroup file")
                .trim()
                .to_string()
        };
        (
            read(&format!("cpu{cg}/cpu.cfs_quota_us")),
            read(&format!("memory{cg}/memory.limit_in_bytes")),
        )
    };
    let limited = ("50000".to_string(), (512u64 << 20).to_string());
    assert_eq!(kernel(), limited);
    let mark = || {
        let s = node.client().status().expect("status");
        let a = s.allocations.iter().find(|a| a.container_id == id).expect("a grant").clone();
        let m = a.quota.expect("marked");
        (m.cpu_milli, m.memory_mib)
    };
    assert_eq!(mark(), (500, 512));

    let up = d.docker(&["update", "--cpus", "2", "--memory", "4g", "--memory-swap", "8g", &id]);
    assert!(!up.status.success(), "docker update past the ceilings was applied:\n{}", d.log());
    assert!(
        up.stderr_str().contains("quotas.acme/untrusted.cpu_cores.ceiling"),
        "{}",
        up.stderr_str()
    );
    assert_eq!(kernel(), limited, "the kernel's limits as they were");
    assert_eq!(mark(), (500, 512));

    let ok = d.docker(&["update", "--cpus", "1", "--memory", "1g", "--memory-swap", "2g", &id]);
    ok.assert_success("docker update within the ceilings");
    assert_eq!(kernel(), ("100000".to_string(), (1u64 << 30).to_string()));
    assert_eq!(mark(), (1000, 1024));
    d.docker(&["rm", "-f", &id]).assert_success("docker rm -f");
    drop(d);
    drop(node);
}

/// `docker run` with `--runtime NAME` (when given) and `args`, foreground, output captured.
fn docker_run(d: &Dockerd, runtime: Option<&str>, args: &[&str]) -> std::process::Output {
    let mut all = vec!["run", "--rm"];
    if let Some(r) = runtime {
        all.extend(["--runtime", r]);
    }
    all.extend(args);
    d.docker(&all)
}

/// A node that ran nvidia-container-toolkit (its runtime dockerd's default), configured
/// only by `tessera setup docker --replace-nvidia`: GPUs come only through Tessera; a
/// policy that would refuse every Docker GPU run is refused by setup; a runtime.toml typo
/// made later shows its sentence in `docker run`'s own output, and fails GPU requests only.
#[test]
fn a_node_set_up_from_nvidia_toolkit_gives_gpus_only_through_tessera() {
    let node_dir = tempfile::tempdir().expect("tempdir");
    let good = policy(node_dir.path());
    let mut p: Value = serde_json::from_slice(&std::fs::read(&good).expect("read")).expect("json");
    p.as_object_mut().expect("object").remove("default_tenant");
    let no_default = node_dir.path().join("no-default.json");
    std::fs::write(&no_default, serde_json::to_vec_pretty(&p).expect("json")).expect("write");
    let node = Node::start_with(NodeOptions { policy: good.clone(), ..Default::default() });
    let plain_text = node.runtime_config(None);
    let empty = node_dir.path().join("empty");
    std::fs::create_dir(&empty).expect("mkdir");
    let typo = std::cell::RefCell::new(std::path::PathBuf::new());
    let d = Dockerd::start(|config, dir| {
        // NVIDIA's container toolkit as it leaves daemon.json: its runtime, the default.
        // (A stand-in that runs runc, as nvidia-container-runtime does after its edits.)
        let nct = dir.join("bin/nvidia-container-runtime");
        std::fs::write(&nct, "#!/bin/sh\nexec runc \"$@\"\n").expect("nct");
        run_cmd(Command::new("chmod").arg("755").arg(&nct)).assert_success("chmod");
        let mut v: Value =
            serde_json::from_slice(&std::fs::read(config).expect("read")).expect("json");
        v["runtimes"] = json!({"nvidia": {"path": nct, "runtimeArgs": []}});
        v["default-runtime"] = json!("nvidia");
        std::fs::write(config, serde_json::to_vec_pretty(&v).expect("json")).expect("write");
        let before = std::fs::read_to_string(config).expect("read");
        let plain = dir.join("runtime.toml");
        std::fs::write(&plain, &plain_text).expect("runtime config");
        let setup = |extra: &[&str], policy: &Path, name: &str, rc: &Path| {
            let mut c = Command::new(tessera_cli());
            c.args(["setup", "docker", "--config"]).arg(config);
            c.args(["--name", name, "--runtime-path", tessera_runtime(), "--runtime-config"]);
            c.arg(rc).arg("--policy").arg(policy).arg("--cdi-dir").arg(&empty);
            c.arg("--hooks-dir").arg(&empty).args(extra);
            run_cmd(&mut c)
        };
        // A policy under which every GPU run here would be refused: not written.
        let out = setup(&["--replace-nvidia"], &no_default, "tessera", &plain);
        out.assert_failure("setup with a trapping policy");
        assert!(
            out.stderr_str().contains("not writing")
                && out.stderr_str().contains("give the policy a `default_tenant`"),
            "{}",
            out.stderr_str()
        );
        assert_eq!(std::fs::read_to_string(config).expect("read"), before, "untouched");
        // Without --replace-nvidia: a warning naming NVIDIA's runtime and default.
        let out = setup(&["--dry-run"], &good, "tessera", &plain);
        out.assert_success("dry run");
        let err = out.stderr_str();
        assert!(
            err.contains("NVIDIA's container toolkit is still configured")
                && err.contains("runtimes.nvidia")
                && err.contains("default-runtime `nvidia`")
                && err.contains("--replace-nvidia"),
            "{err}"
        );
        // With it: NVIDIA's runtime gone, Tessera's the default, and said so.
        let out = setup(&["--replace-nvidia"], &good, "tessera", &plain);
        out.assert_success("setup --replace-nvidia");
        let said = out.stdout_str();
        assert!(
            said.contains("disabled")
                && said.contains("default-runtime `nvidia` (becomes `tessera`"),
            "{said}"
        );
        let v: Value = serde_json::from_slice(&std::fs::read(config).expect("read")).expect("json");
        assert_eq!(v["default-runtime"], json!("tessera"), "{v}");
        assert!(v["runtimes"].get("nvidia").is_none(), "{v}");
        // A second runtime whose configuration gets a typo after setup.
        let t = dir.join("runtime-typo.toml");
        std::fs::write(&t, &plain_text).expect("runtime config");
        setup(&[], &good, "tessera-typo", &t).assert_success("setup tessera-typo");
        std::fs::write(&t, format!("{plain_text}sockt = \"/run/x.sock\"\n")).expect("typo");
        *typo.borrow_mut() = t;
    });

    // The default runtime is Tessera's: --gpus is a grant the policy decides.
    let run = d.docker(&["run", "-d", "--gpus", "1", DOCKER_IMAGE, "sleep", "60"]);
    run.assert_success("docker run --gpus 1 (default runtime)");
    let id = run.stdout_str().trim().to_owned();
    assert_eq!(node.grants(), vec![(id.clone(), DEFAULT_TENANT.to_owned(), "gpu=1".to_owned())]);
    d.docker(&["rm", "-f", &id]).assert_success("docker rm -f");
    assert!(wait_for(|| node.grants().is_empty(), Duration::from_secs(10)));
    // An image's (here -e) NVIDIA_VISIBLE_DEVICES grants nothing, and docker run says so.
    let out = docker_run(&d, None, &["-e", "NVIDIA_VISIBLE_DEVICES=all", DOCKER_IMAGE, "true"]);
    out.assert_success("NVIDIA_VISIBLE_DEVICES alone");
    assert!(
        out.stderr_str().contains(
            "warning: NVIDIA_VISIBLE_DEVICES=all in this container's environment grants nothing"
        ),
        "docker run's own output:\n{}{}",
        out.stdout_str(),
        out.stderr_str()
    );
    assert!(node.grants().is_empty());
    // NVIDIA's runtime is gone.
    let out = docker_run(&d, Some("nvidia"), &["--gpus", "1", DOCKER_IMAGE, "true"]);
    assert!(!out.status.success(), "{}", out.stdout_str());
    assert!(out.stderr_str().contains("nvidia"), "{}", out.stderr_str());

    // The typo: `docker run` itself prints Tessera's sentence; no GPU, no trouble.
    let out = docker_run(&d, Some("tessera-typo"), &["--gpus", "1", DOCKER_IMAGE, "true"]);
    assert!(!out.status.success(), "{}", out.stdout_str());
    let err = out.stderr_str();
    assert!(
        err.contains("GPU request refused: runtime config")
            && err.contains(&format!("{}: unknown key `sockt`", typo.borrow().display())),
        "docker run's own output:\n{err}"
    );
    assert!(!err.contains("unable to retrieve OCI runtime error"), "{err}");
    docker_run(&d, Some("tessera-typo"), &[DOCKER_IMAGE, "true"])
        .assert_success("no GPU request: runs despite the typo");
    assert!(node.grants().is_empty());

    // tessera doctor sees the typo as a trap, and nothing of NVIDIA's.
    let out = run_cmd(
        Command::new(tessera_cli())
            .args(["doctor", "--docker-config"])
            .arg(d.dir().join("daemon.json"))
            .args([
                "--podman-config",
                "/nonexistent/c.conf",
                "--containerd-config",
                "/nonexistent/c.toml",
            ])
            .arg("--policy")
            .arg(&good)
            .arg("--cdi-dir")
            .arg(&empty)
            .arg("--hooks-dir")
            .arg(&empty),
    );
    out.assert_failure("doctor: a trap");
    let report = out.stdout_str();
    assert!(
        report.contains("TRAP    docker runtime `tessera-typo`")
            && report.contains("unknown key `sockt`")
            && report.contains("ok      docker runtime `tessera` (the default)")
            && report.contains("1 trap")
            && !report.contains("nvidia"),
        "{report}"
    );
    drop(d);
    drop(node);
}
