//! podman as its users run it: Debian's podman 4.3 as root, the runtimes `tessera setup
//! podman` writes into containers.conf (`tessera` made the default), a CDI spec from
//! `tessera cdi generate` in /var/run/cdi, an image from `podman import`, tesserad on the
//! simulated H100 node. No `TESSERA_*` variable reaches podman: each runtime is a link to
//! tessera-runtime whose runtime configuration sits beside it (`<link>.toml`).
//!
//! - `--device tessera.io/gpu=mig-1g.10gb`: a policy-checked grant for the default tenant
//!   (podman sets no identity), its MIG devices and `CUDA_VISIBLE_DEVICES` in the
//!   container and in `podman exec`, given back when the container is removed;
//! - a second runtime whose configuration names `engine = "podman-alice"` is alice;
//! - `--gpus 1` is a no-op in podman 4.3 (silently): no grant, no NVIDIA device;
//! - an untrusted tenant's `mps-50` is refused with the policy's reason, and an annotation a
//!   podman user sets (`io.kubernetes.cri.sandbox-namespace=team-trusted`) changes nothing,
//!   since that identity rule is limited to another engine.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use tessera_harness::node::{repo, Node, NodeOptions};
use tessera_harness::podman::{Podman, PODMAN_IMAGE};
use tessera_harness::*;

const GUEST: &str = "acme/untrusted/sandbox/guest";
const ALICE: &str = "acme/trusted/training/alice";

/// The example policy, with the identity a podman host needs: the CRI rule limited to the
/// Kubernetes engine (podman users can set that annotation), alice's engine mapped, and a
/// default tenant for the rest.
fn policy(dir: &Path) -> PathBuf {
    let mut p: Value =
        serde_json::from_slice(&std::fs::read(repo("examples/policy.json")).expect("policy"))
            .expect("json");
    let identity = p["identity"].as_array_mut().expect("identity");
    identity[0]["engines"] = json!(["containerd-k8s"]);
    identity.insert(0, json!({"annotation": "tessera.io/engine", "map": {"podman-alice": ALICE}}));
    p["default_tenant"] = json!(GUEST);
    let f = dir.join("policy.json");
    std::fs::write(&f, serde_json::to_vec_pretty(&p).expect("json")).expect("write policy");
    f
}

/// A runtime link in the fixture dir, its configuration beside it, and `tessera setup
/// podman` naming it; the one without an engine is podman's default runtime.
fn add_runtime(conf: &Path, dir: &Path, node: &Node, name: &str, engine: Option<&str>) {
    let link = Podman::runtime_link(dir, name);
    std::fs::write(Podman::runtime_config_of(&link), node.runtime_config(engine))
        .expect("runtime config");
    let mut cmd = Command::new(tessera_cli());
    cmd.args(["setup", "podman", "--config"]).arg(conf).args(["--name", name, "--runtime-path"]);
    cmd.arg(&link);
    if engine.is_none() {
        cmd.arg("--set-default");
    }
    run_cmd(&mut cmd).assert_success("tessera setup podman");
}

#[test]
fn podman_cdi_devices_identity_and_gpus_noop() {
    let node_dir = tempfile::tempdir().expect("tempdir");
    let node =
        Node::start_with(NodeOptions { policy: policy(node_dir.path()), ..Default::default() });
    let mut p = Podman::start(|conf, dir| {
        add_runtime(conf, dir, &node, "tessera", None);
        add_runtime(conf, dir, &node, "tessera-alice", Some("podman-alice"));
        let again = run_cmd(
            Command::new(tessera_cli())
                .args(["setup", "podman", "--dry-run", "--config"])
                .arg(conf)
                .args(["--set-default", "--runtime-path"])
                .arg(dir.join("bin/tessera")),
        );
        again.assert_success("tessera setup podman --dry-run");
        assert!(again.stdout_str().contains("nothing to change"), "{}", again.stdout_str());
    });
    let fp = p.footprint();

    // The CDI spec, as `tessera cdi generate` writes it for this node and policy.
    let spec = p.cdi_spec_path();
    let gen = node.cli(&["cdi", "generate", "--output", &spec.to_string_lossy()]);
    gen.assert_success("tessera cdi generate");
    let yaml = std::fs::read_to_string(&spec).expect("spec written");
    for dev in ["\"mig-1g.10gb\"", "\"mps-50\"", "\"gpu\""] {
        assert!(yaml.contains(dev), "{dev} missing:\n{yaml}");
    }

    // (a) A CDI device name: a grant for the default tenant, decided at create.
    let run = p.podman(&[
        "run",
        "-d",
        "--device",
        "tessera.io/gpu=mig-1g.10gb",
        PODMAN_IMAGE,
        "sh",
        "-c",
        "echo CUDA=$CUDA_VISIBLE_DEVICES; sleep 60",
    ]);
    run.assert_success("podman run --device tessera.io/gpu=mig-1g.10gb");
    let id = run.stdout_str().trim().to_owned();
    assert_eq!(node.grants(), vec![(id.clone(), GUEST.to_owned(), "mig=1g.10gb".to_owned())]);
    let a = node.client().allocation(&id).expect("allocation");
    let uuid = a.devices[0].uuid.clone();
    assert!(uuid.starts_with("MIG-"), "{uuid}");
    assert!(
        wait_for(
            || p.podman(&["logs", &id]).stdout_str().contains(&format!("CUDA={uuid}")),
            Duration::from_secs(10)
        ),
        "{}",
        p.podman(&["logs", &id]).stdout_str()
    );
    // Exactly the granted NVIDIA nodes inside, and the share's env in an exec'd process.
    let want: BTreeSet<String> = a.injection.devices.iter().map(|d| d.path.clone()).collect();
    let ls = p.podman(&[
        "exec",
        &id,
        "sh",
        "-c",
        "find /dev -name 'nvidia*' -type c; echo CUDA=$CUDA_VISIBLE_DEVICES",
    ]);
    ls.assert_success("podman exec");
    let out = ls.stdout_str();
    let seen: BTreeSet<String> =
        out.lines().filter(|l| l.starts_with("/dev/")).map(str::to_owned).collect();
    assert_eq!(seen, want, "{out}");
    assert!(out.contains(&format!("CUDA={uuid}")), "{out}");
    let holder = node
        .client()
        .status()
        .expect("status")
        .gpus
        .into_iter()
        .flat_map(|g| g.instances)
        .find(|i| i.uuid == uuid)
        .and_then(|i| i.holder)
        .map(|h| h.container_id.to_string());
    assert_eq!(holder.as_deref(), Some(id.as_str()));
    // Removed: given back.
    p.podman(&["rm", "-f", "-t", "0", &id]).assert_success("podman rm -f");
    assert!(wait_for(|| node.grants().is_empty(), Duration::from_secs(10)), "{:?}", node.grants());

    // The second runtime's configuration names its engine: the policy maps it to alice.
    let run = p.podman(&[
        "run",
        "-d",
        "--runtime",
        "tessera-alice",
        "--device",
        "tessera.io/gpu=gpu",
        PODMAN_IMAGE,
        "sleep",
        "60",
    ]);
    run.assert_success("podman run --runtime tessera-alice");
    let id = run.stdout_str().trim().to_owned();
    assert_eq!(node.grants(), vec![(id.clone(), ALICE.to_owned(), "gpu=1".to_owned())]);
    p.podman(&["rm", "-f", "-t", "0", &id]).assert_success("podman rm -f");
    assert!(wait_for(|| node.grants().is_empty(), Duration::from_secs(10)));

    // (b) --gpus: podman 4.3 accepts it and does nothing (`podman run --help`: "This is a
    // Docker specific option and is a NOOP"): no grant, no NVIDIA node, no CUDA env.
    let run = p.podman(&[
        "run",
        "-d",
        "--gpus",
        "1",
        PODMAN_IMAGE,
        "sh",
        "-c",
        "ls /dev; echo CUDA=$CUDA_VISIBLE_DEVICES; sleep 60",
    ]);
    run.assert_success("podman run --gpus 1");
    let id = run.stdout_str().trim().to_owned();
    assert!(node.grants().is_empty(), "{:?}", node.grants());
    assert!(
        wait_for(
            || p.podman(&["logs", &id]).stdout_str().contains("CUDA="),
            Duration::from_secs(10)
        ),
        "{}",
        p.podman(&["logs", &id]).stdout_str()
    );
    let logs = p.podman(&["logs", &id]).stdout_str();
    assert!(logs.lines().any(|l| l == "CUDA="), "{logs}");
    assert!(!logs.contains("nvidia"), "{logs}");
    p.podman(&["rm", "-f", "-t", "0", &id]).assert_success("podman rm -f");

    // (c) Refused by policy: the default tenant is untrusted (no MPS), and the CRI
    // annotation a podman user sets is not read for this engine.
    let refused = p.podman(&[
        "run",
        "--rm",
        "--annotation",
        "io.kubernetes.cri.sandbox-namespace=team-trusted",
        "--device",
        "tessera.io/gpu=mps-50",
        PODMAN_IMAGE,
        "true",
    ]);
    refused.assert_failure("podman run --device tessera.io/gpu=mps-50");
    let err = refused.stderr_str();
    let reason = format!("tenant {GUEST} (trust untrusted) may not use mps isolation");
    assert!(err.contains(&reason) && err.contains("rule tiers.untrusted.allow"), "{err}");
    assert!(node.grants().is_empty(), "{:?}", node.grants());

    drop(p);
    assert_no_leftovers(&fp);
    assert!(!spec.exists(), "{} left", spec.display());
    drop(node);
}

/// tesserad with `--cdi-spec-dir` writes the spec before it serves, the same devices
/// `tessera cdi generate` writes, and rewrites it when a reloaded policy offers other kinds.
#[test]
fn tesserad_keeps_its_cdi_spec_current() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut p: Value =
        serde_json::from_slice(&std::fs::read(repo("examples/policy.json")).expect("policy"))
            .expect("json");
    let policy = dir.path().join("policy.json");
    std::fs::write(&policy, serde_json::to_vec_pretty(&p).expect("json")).expect("write");
    let spec_dir = dir.path().join("cdi");
    let node = Node::start_with(NodeOptions {
        policy: policy.clone(),
        extra_args: vec!["--cdi-spec-dir".into(), spec_dir.display().to_string()],
        ..Default::default()
    });
    let spec = spec_dir.join("tessera.yaml");
    let first = std::fs::read_to_string(&spec).expect("written before the socket served");
    let devices = |yaml: &str| -> Vec<String> {
        yaml.lines().filter_map(|l| l.trim().strip_prefix("- name: ")).map(str::to_owned).collect()
    };
    assert!(first.contains("policy version 1"), "{first}");
    assert!(devices(&first).contains(&"\"mps-50\"".to_owned()), "{first}");
    let cli = node.cli(&["cdi", "generate", "--output", "-"]);
    cli.assert_success("tessera cdi generate --output -");
    assert_eq!(devices(&first), devices(&cli.stdout_str()));

    // A policy without MPS, reloaded: the spec follows, with no mps-* device.
    for tier in ["trusted", "dev"] {
        p["tiers"][tier]["allow"].as_array_mut().expect("allow").retain(|k| k != "mps");
    }
    p["version"] = json!(2);
    std::fs::write(&policy, serde_json::to_vec_pretty(&p).expect("json")).expect("write");
    node.cli(&["policy", "reload"]).assert_success("tessera policy reload");
    let changed = || std::fs::read_to_string(&spec).unwrap_or_default();
    assert!(
        wait_for(|| changed().contains("policy version 2"), Duration::from_secs(10)),
        "{}",
        changed()
    );
    let second = changed();
    assert!(!second.contains("mps-"), "{second}");
    assert!(devices(&second).contains(&"\"mig-1g.10gb\"".to_owned()), "{second}");
    drop(node);
}

/// A node that ran nvidia-container-toolkit: its CDI spec (`nvidia.com/gpu=all`, here an
/// NVIDIA device node made for the test) reaches a GPU through plain runc, never through
/// Tessera (no grant, no GPU); `tessera setup podman` warns of it, and with
/// `--replace-nvidia` disables it (renamed, the backup being the file itself) and says
/// so; then no runtime resolves it, and `tessera doctor` finds nothing of NVIDIA's.
#[test]
fn nvidias_cdi_spec_is_found_and_disabled_by_setup() {
    let node_dir = tempfile::tempdir().expect("tempdir");
    let node =
        Node::start_with(NodeOptions { policy: policy(node_dir.path()), ..Default::default() });
    let mut p = Podman::start(|conf, dir| add_runtime(conf, dir, &node, "tessera", None));
    // NVIDIA's spec, kept in a directory of the test's and linked into /var/run/cdi (the
    // only place podman 4.3 reads besides /etc/cdi): setup is pointed at that directory,
    // so no spec of this machine's own is touched.
    let nct = p.dir().join("nct-cdi");
    std::fs::create_dir(&nct).expect("mkdir");
    let dev = p.dir().join("nvidia5");
    run_cmd(Command::new("mknod").arg(&dev).args(["c", "195", "5"])).assert_success("mknod");
    let spec = nct.join("nvidia.yaml");
    std::fs::write(
        &spec,
        format!(
            "cdiVersion: \"0.5.0\"\nkind: \"nvidia.com/gpu\"\ndevices:\n  - name: \"all\"\n    containerEdits:\n      \
             deviceNodes:\n        - path: \"/dev/nvidia5\"\n          hostPath: \"{}\"\ncontainerEdits: {{}}\n",
            dev.display()
        ),
    )
    .expect("spec");
    let link = p.cdi_spec_path();
    std::os::unix::fs::symlink(&spec, &link).expect("link the spec");
    let probe = |runtime: &str| {
        p.podman(&[
            "run",
            "--rm",
            "--runtime",
            runtime,
            "--device",
            "nvidia.com/gpu=all",
            PODMAN_IMAGE,
            "sh",
            "-c",
            "ls /dev/nvidia5 2>&1; true",
        ])
    };
    // NVIDIA's device through plain runc; none through Tessera, which grants nothing here.
    let out = probe("runc");
    out.assert_success("runc with NVIDIA's CDI device");
    assert!(!out.stdout_str().contains("No such file"), "{}", out.stdout_str());
    let out = probe("tessera");
    out.assert_success("tessera with NVIDIA's CDI device");
    assert!(out.stdout_str().contains("No such file"), "{}", out.stdout_str());
    assert!(node.grants().is_empty());

    let setup = |extra: &[&str]| {
        let link = Podman::runtime_link(p.dir(), "tessera");
        let mut c = Command::new(tessera_cli());
        c.args(["setup", "podman", "--config"]).arg(p.containers_conf());
        c.arg("--runtime-path").arg(&link).arg("--set-default").arg("--cdi-dir").arg(&nct);
        c.arg("--hooks-dir").arg(&nct).args(extra);
        run_cmd(&mut c)
    };
    let out = setup(&[]);
    out.assert_success("setup podman");
    assert!(
        out.stderr_str().contains(&format!("{} (NVIDIA CDI spec)", spec.display()))
            && out.stderr_str().contains("--replace-nvidia"),
        "{}",
        out.stderr_str()
    );
    assert!(spec.exists(), "warned of, not touched");
    let out = setup(&["--replace-nvidia"]);
    out.assert_success("setup podman --replace-nvidia");
    assert!(
        out.stdout_str().contains(&format!("disabled {} (NVIDIA CDI spec)", spec.display())),
        "{}",
        out.stdout_str()
    );
    assert!(!spec.exists());
    let kept: Vec<_> = std::fs::read_dir(&nct)
        .expect("read")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("nvidia.yaml.tessera-disabled-"))
        .collect();
    assert_eq!(kept.len(), 1, "the spec kept as its own backup");
    let out = probe("runc");
    out.assert_failure("NVIDIA's CDI device after --replace-nvidia");
    let out = run_cmd(
        Command::new(tessera_cli())
            .args(["doctor", "--podman-config"])
            .arg(p.containers_conf())
            .args([
                "--docker-config",
                "/nonexistent/d.json",
                "--containerd-config",
                "/nonexistent/c.toml",
                "--policy",
            ])
            .arg(policy(node_dir.path()))
            .arg("--cdi-dir")
            .arg(&nct)
            .arg("--hooks-dir")
            .arg(&nct),
    );
    out.assert_success("doctor after setup");
    assert!(
        out.stdout_str().contains("ok      podman runtime `tessera` (the default)")
            && !out.stdout_str().contains("NVIDIA"),
        "{}",
        out.stdout_str()
    );
    drop(p);
    drop(node);
}
