//! Kubernetes through the CRI as kubelet drives it: containerd 1.6's own CRI plugin,
//! started by the test with the runtime handler `tessera setup containerd` writes, real
//! pods through a CRI gRPC client (RunPodSandbox, CreateContainer, StartContainer,
//! UpdateContainerResources, StopContainer, RemoveContainer, StopPodSandbox,
//! RemovePodSandbox), runc under
//! tessera-runtime, tesserad on a simulated 8×H100 node.
//!
//! What is checked is what the enforcing parts did: the config.json containerd handed the
//! runtime (its devices), what the container sees (`/dev`, its environment), and tesserad's
//! grants, events and ledger.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use tessera_harness::cri::*;
use tessera_harness::node::*;
use tessera_harness::*;

/// `tessera setup containerd` on the fixture's own config (the handler's link and its
/// runtime configuration in the fixture's dir), then the runc root the fixture wants for
/// the handler (the only line the setup does not write).
fn setup_handler(config: &Path, dir: &Path) {
    let out = run_cmd(
        Command::new(tessera_cli())
            .args(["setup", "containerd", "--config"])
            .arg(config)
            .arg("--runtime-path")
            .arg(tessera_runtime())
            .arg("--runtime-dir")
            .arg(dir.join("tessera-runtime")),
    );
    out.assert_success("tessera setup containerd");
    assert!(out.stdout_str().contains("handler: tessera"), "{}", out.stdout_str());
    let own = std::fs::read_to_string(dir.join("tessera-runtime/containerd-tessera.toml")).unwrap();
    assert!(own.contains("kubelet = true"), "{own}");
    let text = std::fs::read_to_string(config).unwrap();
    let mut doc: toml_edit::DocumentMut = text.parse().unwrap();
    doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["tessera"]["options"]
        ["Root"] = toml_edit::value(
        Containerd::runtime_root_in(dir, "tessera").to_string_lossy().into_owned(),
    );
    std::fs::write(config, doc.to_string()).unwrap();
}

struct Cluster {
    node: Node,
    ctd: Containerd,
    cri: Cri,
}

fn cluster() -> Cluster {
    cluster_with(setup_handler)
}

/// tesserad, and containerd with the CRI plugin whose config `edit` prepares.
fn cluster_with(edit: impl Fn(&Path, &Path) + Send + Sync + 'static) -> Cluster {
    cluster_on(NodeOptions::default(), edit)
}

/// [`cluster_with`] on a tesserad started with `opts`.
fn cluster_on(opts: NodeOptions, edit: impl Fn(&Path, &Path) + Send + Sync + 'static) -> Cluster {
    let node = Node::start_with(opts);
    let ctd = Containerd::builder()
        .cri()
        .env("TESSERA_SOCKET", &node.socket.display().to_string())
        .env("TESSERA_RUNC", RUNC)
        .env("TESSERA_HOOK", tessera_hook())
        .before_start(edit)
        .start();
    let cri = ctd.cri();
    Cluster { node, ctd, cri }
}

impl Cluster {
    fn pod(&self, name: &str, ns: &str, annotations: &[(&str, &str)]) -> (PodSpec, String) {
        let mut pod = PodSpec::new(name, ns).handler("tessera");
        for (k, v) in annotations {
            pod = pod.annotation(k, v);
        }
        let id =
            self.cri.run_pod_sandbox(&pod).unwrap_or_else(|e| panic!("{e}\n{}", self.ctd.log()));
        (pod, id)
    }

    /// CreateContainer + StartContainer (containerd 1.6 runs the runtime's `create` in
    /// StartContainer), the container sleeping.
    fn start(&self, pod_id: &str, pod: &PodSpec, name: &str) -> Result<String, CriError> {
        let c = ContainerSpec::new(name).command(&["sh", "-c", "sleep 300"]);
        let id = self.cri.create_container(pod_id, pod, &c)?;
        self.cri.start_container(&id).map(|()| id)
    }

    /// The config.json containerd gave the runtime for `id`.
    fn config(&self, id: &str) -> serde_json::Value {
        let p = self
            .ctd
            .dir()
            .join("state/io.containerd.runtime.v2.task/k8s.io")
            .join(id)
            .join("config.json");
        serde_json::from_slice(
            &std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
        )
        .unwrap()
    }

    fn allocations(&self) -> Vec<tessera_api::Allocation> {
        self.node.client().status().unwrap().allocations
    }

    fn teardown(&self, pod_id: &str) {
        for c in self.cri.list_containers(Some(pod_id)).unwrap() {
            self.cri.stop_container(&c.id, 0).unwrap();
            self.cri.remove_container(&c.id).unwrap();
        }
        self.cri.stop_pod_sandbox(pod_id).unwrap();
        self.cri.remove_pod_sandbox(pod_id).unwrap();
    }
}

/// The (major, minor) of every NVIDIA device node in a config (majors 195 and the sim
/// node's uvm/caps majors).
fn nvidia_devices(config: &serde_json::Value) -> BTreeSet<(i64, i64)> {
    config["linux"]["devices"]
        .as_array()
        .map(|d| {
            d.iter()
                .filter(|n| n["path"].as_str().is_some_and(|p| p.starts_with("/dev/nvidia")))
                .map(|n| (n["major"].as_i64().unwrap(), n["minor"].as_i64().unwrap()))
                .collect()
        })
        .unwrap_or_default()
}

fn exec(c: &Cluster, id: &str, script: &str) -> String {
    let out = c.cri.exec_sync(id, &["sh", "-c", script], 10).unwrap();
    assert_eq!(out.exit_code, 0, "{script}: {}", out.stderr);
    out.stdout
}

#[test]
fn a_one_container_pod_gets_exactly_one_mig_instance_and_its_sandbox_none() {
    let c = cluster();
    let (pod, pod_id) = c.pod("trainer", "team-untrusted", &[("tessera.io/gpu", "mig=1g.10gb")]);
    // The sandbox carried the pod annotation (containerd passes it through) and got nothing.
    let sandbox = c.config(&pod_id);
    assert_eq!(sandbox["annotations"]["tessera.io/gpu"], "mig=1g.10gb", "passed through");
    assert_eq!(sandbox["annotations"]["io.kubernetes.cri.container-type"], "sandbox");
    assert!(nvidia_devices(&sandbox).is_empty(), "sandbox got devices: {sandbox}");
    assert!(c.allocations().is_empty(), "a grant for the sandbox");

    let id = c.start(&pod_id, &pod, "main").unwrap_or_else(|e| panic!("{e}"));
    let allocs = c.allocations();
    assert_eq!(allocs.len(), 1, "{allocs:?}");
    let a = &allocs[0];
    assert_eq!(a.container_id, id);
    assert_eq!(a.devices.len(), 1);
    assert!(a.devices[0].uuid.starts_with("MIG-"), "{:?}", a.devices);
    assert_eq!(a.tenant, "acme/untrusted/sandbox/guest");
    let w = a.workload.as_ref().expect("pod names recorded");
    assert_eq!(w.display_name(), "team-untrusted/trainer/main");
    assert_eq!(w.sandbox_id, pod_id);
    // What runc was given, and what the container sees: the instance's devices only.
    let want: BTreeSet<(i64, i64)> =
        a.injection.devices.iter().map(|d| (d.major, d.minor)).collect();
    assert_eq!(nvidia_devices(&c.config(&id)), want);
    assert_eq!(exec(&c, &id, "ls /dev/nvidia-caps | wc -l").trim(), "2");
    assert_eq!(exec(&c, &id, "ls /dev | grep -c '^nvidia[0-9]'").trim(), "1");
    let env = exec(&c, &id, "echo $CUDA_VISIBLE_DEVICES");
    assert_eq!(env.trim(), a.devices[0].uuid, "exec'd processes find their share");

    // The names people know, in status.
    let text = String::from_utf8_lossy(&c.node.cli(&["status"]).stdout).into_owned();
    assert!(text.contains("team-untrusted/trainer/main"), "{text}");

    // StopContainer, RemoveContainer, StopPodSandbox, RemovePodSandbox: the grant is back.
    c.teardown(&pod_id);
    let client = c.node.client();
    assert!(
        wait_for(
            || client.status().map(|s| s.allocations.is_empty()).unwrap_or(false),
            Duration::from_secs(15)
        ),
        "grant not released: {:?}",
        c.allocations()
    );
    // Usage by pod and by container names the pod.
    let out = c.node.cli(&["usage", "--by", "pod", "--from", "-1h", "--json"]);
    out.assert_success("usage by pod");
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let groups: Vec<&str> =
        r["rows"].as_array().unwrap().iter().filter_map(|x| x["group"].as_str()).collect();
    assert_eq!(groups, ["team-untrusted/trainer"], "{r}");
    let out = c.node.cli(&["usage", "--by", "container", "--from", "-1h"]);
    let text = out.stdout_str();
    assert!(text.contains(&format!("{id} (team-untrusted/trainer/main)")), "{text}");
    let out = c.node.cli(&["usage", "--by", "namespace", "--from", "-1h", "--csv"]);
    assert!(out.stdout_str().contains("\nteam-untrusted,"), "{}", out.stdout_str());
    let fp = c.ctd.footprint();
    drop(c);
    assert_no_leftovers(&fp);
}

#[test]
fn per_container_annotations_give_one_grant_per_asking_container_and_none_to_the_rest() {
    let c = cluster();
    let (pod, pod_id) = c.pod(
        "mixed",
        "team-trusted",
        &[("tessera.io/gpu.learner", "gpu=1"), ("tessera.io/gpu.actor", "mig=1g.10gb")],
    );
    let learner = c.start(&pod_id, &pod, "learner").unwrap_or_else(|e| panic!("{e}"));
    let actor = c.start(&pod_id, &pod, "actor").unwrap_or_else(|e| panic!("{e}"));
    let logger = c.start(&pod_id, &pod, "logger").unwrap_or_else(|e| panic!("{e}"));
    // A container whose name the annotation misspells asks for nothing, and its log says
    // so (the runtime's stderr is the container's while runc creates it); the others' do not.
    let lerner = c.start(&pod_id, &pod, "lerner").unwrap_or_else(|e| panic!("{e}"));
    let log = |name: &str| c.cri.container_output(&pod, &ContainerSpec::new(name));
    assert!(
        wait_for(
            || {
                log("lerner").contains("warning: annotation tessera.io/gpu.learner asks for a container named `learner`, and this one is `lerner`")
            },
            Duration::from_secs(5)
        ),
        "{}",
        log("lerner")
    );
    assert!(
        !log("logger").contains("warning") && !log("learner").contains("warning"),
        "{}",
        log("logger")
    );
    let allocs = c.allocations();
    let by_id = |id: &str| allocs.iter().find(|a| a.container_id == id);
    assert!(by_id(&lerner).is_none());
    assert_eq!(allocs.len(), 2, "{allocs:?}");
    assert_eq!(by_id(&learner).unwrap().request.to_string(), "gpu=1");
    assert_eq!(by_id(&actor).unwrap().request.to_string(), "mig=1g.10gb");
    assert!(by_id(&logger).is_none());
    assert!(nvidia_devices(&c.config(&logger)).is_empty(), "the container that asked nothing");
    assert!(nvidia_devices(&c.config(&pod_id)).is_empty(), "the sandbox");
    assert_eq!(exec(&c, &logger, "ls /dev | grep -c nvidia || true").trim(), "0");
    let names: BTreeSet<String> =
        allocs.iter().map(|a| a.workload.as_ref().unwrap().display_name()).collect();
    assert_eq!(
        names,
        ["team-trusted/mixed/actor".to_string(), "team-trusted/mixed/learner".into()].into()
    );
    c.teardown(&pod_id);
    let client = c.node.client();
    assert!(wait_for(
        || client.status().map(|s| s.allocations.is_empty()).unwrap_or(false),
        Duration::from_secs(15)
    ));
}

#[test]
fn a_bare_annotation_on_a_two_container_pod_is_refused_with_the_per_container_form() {
    let c = cluster();
    let (pod, pod_id) = c.pod("two", "team-trusted", &[("tessera.io/gpu", "gpu=1")]);
    c.start(&pod_id, &pod, "first").unwrap_or_else(|e| panic!("{e}"));
    let err = c.start(&pod_id, &pod, "second").expect_err("the second container is refused");
    let msg = err.message();
    assert!(
        msg.contains("exactly one application container")
            && msg.contains("tessera.io/gpu.<container-name>"),
        "{msg}"
    );
    assert_eq!(c.allocations().len(), 1);
    let status = c.node.client().status().unwrap();
    assert!(
        status.events.iter().any(|e| e.kind == "refuse"
            && e.workload.as_deref() == Some("team-trusted/two/second")),
        "{:?}",
        status.events
    );
    c.teardown(&pod_id);
}

#[test]
fn an_untrusted_namespace_asking_mps_is_refused_naming_the_rule() {
    let c = cluster();
    let (pod, pod_id) = c.pod("mps", "team-untrusted", &[("tessera.io/gpu.main", "mps=25")]);
    // containerd 1.6's CreateContainer runs no runtime: the refusal comes from
    // StartContainer (kubelet shows RunContainerError; docs/KUBERNETES.md).
    let spec = ContainerSpec::new("main").command(&["sh", "-c", "sleep 300"]);
    let id = c.cri.create_container(&pod_id, &pod, &spec).expect("CreateContainer");
    let err = c.cri.start_container(&id).expect_err("refused at StartContainer");
    assert!(err.message().contains("tiers.untrusted.allow"), "{err}");
    assert!(c.allocations().is_empty());
    c.teardown(&pod_id);
}

#[test]
fn a_pod_author_cannot_choose_the_tenant_or_the_container_type() {
    // A handler that passes every pod annotation: containerd still writes its own
    // io.kubernetes.cri.* annotations last, so a pod author's copies never count.
    let c = cluster_with(|config, dir| {
        setup_handler(config, dir);
        let text = std::fs::read_to_string(config).unwrap();
        let mut doc: toml_edit::DocumentMut = text.parse().unwrap();
        let mut all = toml_edit::Array::new();
        all.push("*");
        all.push("tessera.io/gpu*");
        all.push("io.kubernetes.cri.*");
        doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["tessera"]
            ["pod_annotations"] = toml_edit::value(all);
        std::fs::write(config, doc.to_string()).unwrap();
    });
    let (pod, pod_id) = c.pod(
        "forger",
        "team-untrusted",
        &[
            ("tessera.io/gpu.main", "gpu=1"),
            ("io.kubernetes.cri.sandbox-namespace", "team-dev"),
            ("io.kubernetes.cri.container-type", "sandbox"),
            ("io.kubernetes.cri.container-name", "other"),
        ],
    );
    let id = c.start(&pod_id, &pod, "main").unwrap_or_else(|e| panic!("{e}"));
    let cfg = c.config(&id);
    assert_eq!(cfg["annotations"]["io.kubernetes.cri.sandbox-namespace"], "team-untrusted");
    assert_eq!(cfg["annotations"]["io.kubernetes.cri.container-type"], "container");
    let allocs = c.allocations();
    assert_eq!(allocs.len(), 1, "{allocs:?}");
    assert_eq!(allocs[0].tenant, "acme/untrusted/sandbox/guest", "the namespace decides");
    assert_eq!(allocs[0].workload.as_ref().unwrap().display_name(), "team-untrusted/forger/main");
    let sandbox = c.config(&pod_id);
    assert_eq!(sandbox["annotations"]["io.kubernetes.cri.container-type"], "sandbox");
    assert_eq!(sandbox["annotations"]["io.kubernetes.cri.sandbox-namespace"], "team-untrusted");
    assert!(nvidia_devices(&sandbox).is_empty(), "sandbox got devices: {sandbox}");
    c.teardown(&pod_id);
}

fn setup_cli(config: &Path, extra: &[&str]) -> std::process::Output {
    let runtime_dir = PathBuf::from(format!("{}.lib", config.display()));
    run_cmd(
        Command::new(tessera_cli())
            .args(["setup", "containerd", "--config"])
            .arg(config)
            .args(["--runtime-path", "/usr/local/bin/tessera-runtime", "--runtime-dir"])
            .arg(&runtime_dir)
            .args(extra),
    )
}

/// `containerd --config FILE config dump`: containerd's own reading of the file.
fn containerd_reads(config: &Path) -> String {
    let out =
        run_cmd(Command::new("containerd").arg("--config").arg(config).args(["config", "dump"]));
    out.assert_success("containerd config dump");
    out.stdout_str()
}

#[test]
fn setup_containerd_edits_the_default_config_and_an_empty_one_once() {
    let dir = short_tempdir();
    let cleanup = Cleanup::new();
    cleanup.track_dir(&dir);
    let default = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/testdata/containerd-1.6-default.toml");
    for (name, original) in [
        ("default.toml", std::fs::read_to_string(&default).unwrap()),
        ("empty.toml", String::new()),
    ] {
        let config = dir.join(name);
        std::fs::write(&config, &original).unwrap();
        let link = dir.join(format!("{name}.lib/containerd-tessera"));
        let link_toml = dir.join(format!("{name}.lib/containerd-tessera.toml"));
        // --dry-run: a diff, and the file untouched; no link, no runtime configuration.
        let out = setup_cli(&config, &["--dry-run"]);
        out.assert_success("dry run");
        assert!(
            out.stdout_str().contains(&format!("+BinaryName = \"{}\"", link.display()))
                && out.stdout_str().contains("+kubelet = true")
                && out.stdout_str().contains("would link"),
            "{}",
            out.stdout_str()
        );
        assert_eq!(std::fs::read_to_string(&config).unwrap(), original);
        assert!(std::fs::symlink_metadata(&link).is_err() && !link_toml.exists());
        // The real run: a backup of the original, the handler written.
        let out = setup_cli(&config, &[]);
        out.assert_success("setup");
        assert!(out.stdout_str().contains("kind: RuntimeClass"), "{}", out.stdout_str());
        // The handler runs a link to tessera-runtime, which reads the configuration beside
        // it: the kubelet engine's, which no other engine reads.
        assert_eq!(
            std::fs::read_link(&link).unwrap(),
            PathBuf::from("/usr/local/bin/tessera-runtime")
        );
        let own = std::fs::read_to_string(&link_toml).unwrap();
        assert!(own.ends_with("kubelet = true\n"), "{own}");
        let backups: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| {
                e.file_name().to_string_lossy().starts_with(&format!("{name}.tessera-backup-"))
            })
            .collect();
        assert_eq!(backups.len(), 1, "one backup of {name}");
        assert_eq!(std::fs::read_to_string(backups[0].path()).unwrap(), original);
        let after = std::fs::read_to_string(&config).unwrap();
        // Everything else kept as written: the original's lines, in order, are a
        // subsequence of the result's.
        let mut rest = after.lines();
        let lost: Vec<&str> =
            original.lines().filter(|l| !rest.by_ref().any(|r| r == *l)).collect();
        assert!(lost.is_empty(), "lines lost or moved: {lost:?}");
        // Twice is once: nothing changes, no new backup.
        let out = setup_cli(&config, &[]);
        out.assert_success("second setup");
        assert!(out.stdout_str().contains("nothing changed"), "{}", out.stdout_str());
        assert_eq!(std::fs::read_to_string(&config).unwrap(), after);
        let out = setup_cli(&config, &["--dry-run"]);
        assert!(out.stdout_str().contains("nothing to change"), "{}", out.stdout_str());
        // containerd reads the result as Tessera means it.
        let dump = containerd_reads(&config);
        let d: toml_edit::DocumentMut = dump.parse().unwrap();
        let rt = &d["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["tessera"];
        assert_eq!(rt["runtime_type"].as_str(), Some("io.containerd.runc.v2"), "{dump}");
        assert_eq!(rt["options"]["BinaryName"].as_str(), Some(link.to_str().unwrap()), "{dump}");
        let pods: Vec<&str> =
            rt["pod_annotations"].as_array().unwrap().iter().filter_map(|v| v.as_str()).collect();
        assert_eq!(pods, ["tessera.io/gpu*"], "{dump}");
        let ctrs: Vec<&str> = rt["container_annotations"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v.as_str())
            .collect();
        assert_eq!(ctrs, ["tessera.io/device-plugin"], "{dump}");
    }
    // Two handlers in the same second: two backups, none over the other.
    let two = dir.join("two.toml");
    std::fs::write(&two, "version = 2\n").unwrap();
    setup_cli(&two, &["--handler", "a"]).assert_success("handler a");
    setup_cli(&two, &["--handler", "b"]).assert_success("handler b");
    let backups: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("two.toml.tessera-backup-"))
        .collect();
    assert_eq!(backups.len(), 2, "{backups:?}");
    let contents: BTreeSet<String> =
        backups.iter().map(|b| std::fs::read_to_string(dir.join(b)).unwrap()).collect();
    assert!(contents.contains("version = 2\n"), "the original survives: {contents:?}");
    // A symlinked config is edited where it points, and stays a link.
    let target = dir.join("real.toml");
    std::fs::write(&target, "version = 2\n").unwrap();
    let link = dir.join("link.toml");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    setup_cli(&link, &[]).assert_success("through a symlink");
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    assert!(std::fs::read_to_string(&target).unwrap().contains("containerd-tessera"));
    // An import that replaces the handler: containerd's own reading disagrees, so the
    // command fails and the original is back.
    let imported = dir.join("imp.d");
    std::fs::create_dir_all(&imported).unwrap();
    std::fs::write(
        imported.join("tessera.toml"),
        "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.tessera]\n  pod_annotations = [\"tessera.io/*\"]\n",
    )
    .unwrap();
    let main = dir.join("imp.toml");
    let original = format!("version = 2\nimports = [\"{}/*.toml\"]\n", imported.display());
    std::fs::write(&main, &original).unwrap();
    let out = setup_cli(&main, &[]);
    out.assert_failure("an import overrides the handler");
    assert!(
        out.stderr_str().contains("reads") && out.stderr_str().contains("was restored"),
        "{}",
        out.stderr_str()
    );
    assert_eq!(std::fs::read_to_string(&main).unwrap(), original);
    // A version 1 file is refused, untouched, with the way out.
    let v1 = dir.join("v1.toml");
    std::fs::write(&v1, "root = \"/var/lib/containerd\"\n").unwrap();
    let out = setup_cli(&v1, &[]);
    out.assert_failure("version 1");
    assert!(out.stderr_str().contains("containerd config migrate"), "{}", out.stderr_str());
    assert_eq!(std::fs::read_to_string(&v1).unwrap(), "root = \"/var/lib/containerd\"\n");
}

/// kubelet's `Allocate` of `ids` of `resource` on the device plugin's socket in `dir`:
/// the annotation it answers.
fn kubelet_allocate(dir: &Path, resource: &str, ids: &[String]) -> String {
    use device_plugin::v1beta1 as api;
    let socket = dir.join(device_plugin::server::socket_name(resource));
    assert!(wait_for(|| socket.exists(), Duration::from_secs(10)), "{}", socket.display());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let channel = device_plugin::server::connect(&socket).await.unwrap();
        let mut client = api::device_plugin_client::DevicePluginClient::new(channel);
        let req = api::AllocateRequest {
            container_requests: vec![api::ContainerAllocateRequest { devices_ids: ids.to_vec() }],
        };
        let resp = client.allocate(req).await.unwrap().into_inner();
        resp.container_responses[0].annotations[tessera_api::deviceplugin::ASSIGNMENT_ANNOTATION]
            .clone()
    })
}

#[test]
fn a_kubelet_assignment_reaches_the_runtime_as_a_container_annotation_and_never_from_the_pod() {
    let files = short_tempdir();
    let dp = files.join("dp");
    std::fs::create_dir_all(&dp).unwrap();
    let c = cluster_on(
        NodeOptions {
            extra_args: vec!["--device-plugin-dir".into(), dp.display().to_string()],
            ..Default::default()
        },
        setup_handler,
    );
    c.node.fx.cleanup().track_dir(&files);
    let gpus = c.node.client().status().unwrap().gpus;
    let target = gpus.iter().rev().find(|g| !g.mig_enabled).expect("a whole GPU").uuid.clone();
    let key = tessera_api::deviceplugin::ASSIGNMENT_ANNOTATION;
    // As kubelet sets it, from the device plugin's Allocate (a token tesserad issued): a
    // container annotation, which the handler's container_annotations pass through, read
    // by tessera-runtime under the handler's own configuration (`kubelet = true`).
    let assignment = kubelet_allocate(&dp, "tessera.io/gpu", std::slice::from_ref(&target));
    assert!(assignment.starts_with(&format!("v2;tessera.io/gpu;{target};")), "{assignment}");
    let (pod, pod_id) = c.pod("assigned", "team-trusted", &[]);
    let spec =
        ContainerSpec::new("main").command(&["sh", "-c", "sleep 300"]).annotation(key, &assignment);
    let id = c.cri.create_container(&pod_id, &pod, &spec).unwrap();
    c.cri.start_container(&id).unwrap_or_else(|e| panic!("{e}"));
    let allocs = c.allocations();
    assert_eq!(allocs.len(), 1, "{allocs:?}");
    assert_eq!(allocs[0].devices[0].uuid, target, "the grant is on kubelet's device");
    // The same annotation in another pod's container (a replay) is refused by tesserad.
    let (pod3, pod3_id) = c.pod("replayed", "team-trusted", &[]);
    let spec =
        ContainerSpec::new("main").command(&["sh", "-c", "sleep 300"]).annotation(key, &assignment);
    let id3 = c.cri.create_container(&pod3_id, &pod3, &spec).unwrap();
    let err = c.cri.start_container(&id3).expect_err("a replayed token");
    assert!(
        err.message().contains("was used by pod container team-trusted/assigned/main"),
        "{err}"
    );
    assert_eq!(c.allocations().len(), 1);
    c.teardown(&pod3_id);
    // The same text as a pod annotation never reaches the runtime: no grant.
    let (pod2, pod2_id) = c.pod("forged", "team-trusted", &[(key, &assignment)]);
    let id2 = c.start(&pod2_id, &pod2, "main").unwrap_or_else(|e| panic!("{e}"));
    assert!(c.config(&id2)["annotations"].get(key).is_none(), "passed through from the pod");
    assert_eq!(c.allocations().len(), 1);
    c.teardown(&pod_id);
    c.teardown(&pod2_id);
}

#[test]
fn an_init_container_owns_the_bare_form_and_the_app_container_is_refused_after_it_exits() {
    // kubelet runs a pod's init container to its end before the app container: both carry
    // the pod's bare annotation, and the first to ask owns it for the pod's life.
    let c = cluster();
    let (pod, pod_id) = c.pod("staged", "team-trusted", &[("tessera.io/gpu", "gpu=1")]);
    let init = ContainerSpec::new("init").command(&["sh", "-c", "echo $CUDA_VISIBLE_DEVICES"]);
    let init_id = c.cri.create_container(&pod_id, &pod, &init).unwrap();
    c.cri.start_container(&init_id).unwrap_or_else(|e| panic!("{e}"));
    c.cri
        .wait_container_state(
            &init_id,
            v1::ContainerState::ContainerExited,
            Duration::from_secs(15),
        )
        .unwrap();
    assert!(c.cri.container_output(&pod, &init).trim().starts_with("GPU-"), "the init had its GPU");
    c.cri.remove_container(&init_id).unwrap();
    let client = c.node.client();
    assert!(wait_for(
        || client.status().map(|s| s.allocations.is_empty()).unwrap_or(false),
        Duration::from_secs(15)
    ));
    let err = c.start(&pod_id, &pod, "main").expect_err("the app container is refused");
    assert!(err.message().contains("containers `init` and `main`"), "{err}");
    c.teardown(&pod_id);
}

#[test]
fn a_pod_mixing_both_forms_is_refused_and_env_requests_are_per_container() {
    let c = cluster();
    let (pod, pod_id) = c.pod(
        "mixed-forms",
        "team-trusted",
        &[("tessera.io/gpu", "gpu=1"), ("tessera.io/gpu.main", "gpu=1")],
    );
    let err = c.start(&pod_id, &pod, "main").expect_err("both forms");
    assert!(err.message().contains("use only the per-container form"), "{err}");
    c.teardown(&pod_id);
    // No annotation: TESSERA_GPU in one container's env asks for that container alone.
    let (pod, pod_id) = c.pod("env", "team-trusted", &[]);
    let asks =
        ContainerSpec::new("asks").command(&["sh", "-c", "sleep 300"]).env("TESSERA_GPU", "gpu=1");
    let asks_id = c.cri.create_container(&pod_id, &pod, &asks).unwrap();
    c.cri.start_container(&asks_id).unwrap_or_else(|e| panic!("{e}"));
    let other = c.start(&pod_id, &pod, "other").unwrap_or_else(|e| panic!("{e}"));
    let allocs = c.allocations();
    assert_eq!(allocs.len(), 1, "{allocs:?}");
    assert_eq!(allocs[0].container_id, asks_id);
    assert!(nvidia_devices(&c.config(&other)).is_empty());
    c.teardown(&pod_id);
}

/// Pod start through the CRI, runc's handler against `tessera` (no GPU, and a MIG
/// instance), for docs/PERFORMANCE.md: `cargo test --release --test kubernetes
/// pod_start_latency -- --ignored --nocapture`. A measurement, not a check: it asserts only
/// that every pod started.
#[test]
#[ignore]
fn pod_start_latency() {
    const PODS: usize = 20;
    let c = cluster();
    let mut rows = Vec::new();
    for (label, handler, annotation) in [
        ("runc handler, no request", "runc", None),
        ("tessera handler, no request", "tessera", None),
        ("tessera handler, mig=1g.10gb", "tessera", Some(("tessera.io/gpu", "mig=1g.10gb"))),
    ] {
        let mut ms = Vec::new();
        for i in 0..PODS {
            let mut pod =
                PodSpec::new(&format!("lat-{handler}-{i}"), "team-untrusted").handler(handler);
            if let Some((k, v)) = annotation {
                pod = pod.annotation(k, v);
            }
            let t = std::time::Instant::now();
            let pod_id = c.cri.run_pod_sandbox(&pod).unwrap();
            let spec = ContainerSpec::new("main").command(&["sh", "-c", "sleep 300"]);
            let id = c.cri.create_container(&pod_id, &pod, &spec).unwrap();
            c.cri.start_container(&id).unwrap();
            ms.push(t.elapsed().as_secs_f64() * 1000.0);
            c.teardown(&pod_id);
        }
        ms.sort_by(f64::total_cmp);
        rows.push((label, ms[PODS / 2], ms[PODS * 9 / 10]));
    }
    for (label, p50, p90) in rows {
        println!("{label:32} p50 {p50:7.1} ms  p90 {p90:7.1} ms  ({PODS} pods)");
    }
}

/// A tesserad under the example policy with `quotas` (the node's own books: no
/// coordinator), and containerd's CRI plugin with the tessera handler in front of it; the
/// policy's directory with them.
fn node_with_quotas(quotas: serde_json::Value) -> (tempfile::TempDir, Node, Containerd) {
    let dir = tempfile::tempdir().unwrap();
    let mut p: serde_json::Value =
        serde_json::from_slice(&std::fs::read(repo("examples/policy.json")).unwrap()).unwrap();
    p["quotas"] = quotas;
    let policy = dir.path().join("policy.json");
    std::fs::write(&policy, serde_json::to_vec(&p).unwrap()).unwrap();
    let node = Node::start_with(NodeOptions { policy, ..NodeOptions::default() });
    let ctd = Containerd::builder()
        .cri()
        .env("TESSERA_SOCKET", &node.socket.display().to_string())
        .env("TESSERA_RUNC", RUNC)
        .env("TESSERA_HOOK", tessera_hook())
        .before_start(setup_handler)
        .start();
    (dir, node, ctd)
}

/// Issue 23 (3): kubelet's in-place resize (CRI `UpdateContainerResources` → containerd 1.6
/// → its shim's `runc update --resources -`) of a GPU container is decided by the
/// container's quotas: past the team's CPU ceiling the CRI call fails with Tessera's
/// message and the kernel's limits stay; within it the resize is applied and counted.
#[test]
fn an_in_place_resize_of_a_gpu_container_is_held_to_its_quotas() {
    let (_dir, node, ctd) = node_with_quotas(serde_json::json!({"acme/untrusted": {
        "cpu_cores": {"guarantee": 1, "ceiling": 1},
        "memory_gib": {"guarantee": 1, "ceiling": 1}
    }}));
    let cri = ctd.cri();
    let pod = PodSpec::new("resize", "team-untrusted")
        .handler("tessera")
        .annotation("tessera.io/gpu", "mig=1g.10gb");
    let pod_id = cri.run_pod_sandbox(&pod).unwrap_or_else(|e| panic!("{e}\n{}", ctd.log()));
    // A Burstable container as kubelet sends it: 0.2 cores, 256 MiB.
    let mut config =
        cri.container_config(&pod, &ContainerSpec::new("main").command(&["sleep", "300"]));
    let resources = |quota: i64, memory: i64| v1::LinuxContainerResources {
        cpu_period: 100_000,
        cpu_quota: quota,
        cpu_shares: 204,
        memory_limit_in_bytes: memory,
        oom_score_adj: 999,
        ..Default::default()
    };
    config.linux.as_mut().unwrap().resources = Some(resources(20_000, 256 << 20));
    let id = cri.create_container_raw(&pod_id, config, cri.sandbox_config(&pod)).unwrap();
    cri.start_container(&id).unwrap_or_else(|e| panic!("{e}\n{}", ctd.log()));
    let grant = || node.client().allocation(&id).unwrap();
    let pid = grant().pid.expect("started");
    let kernel = || {
        let (k, _) =
            tesserad::limits::read_limits(Path::new("/proc"), Path::new("/sys/fs/cgroup"), pid)
                .unwrap();
        (k.cpu_quota, k.memory)
    };
    assert_eq!(kernel(), (Some(20_000), Some(256 << 20)));

    let e = cri
        .update_container_resources(&id, resources(200_000, 512 << 20))
        .expect_err("past the ceiling");
    assert!(e.message().contains("quotas.acme/untrusted.cpu_cores.ceiling"), "{e}");
    assert_eq!(kernel(), (Some(20_000), Some(256 << 20)), "the kernel's limits as they were");

    cri.update_container_resources(&id, resources(50_000, 512 << 20))
        .unwrap_or_else(|e| panic!("within the ceilings: {e}\n{}", ctd.log()));
    assert_eq!(kernel(), (Some(50_000), Some(512 << 20)));
    let m = grant().quota.expect("marked");
    assert_eq!((m.cpu_milli, m.memory_mib), (500, 512));

    cri.stop_container(&id, 0).unwrap();
    cri.remove_container(&id).unwrap();
    cri.stop_pod_sandbox(&pod_id).unwrap();
    cri.remove_pod_sandbox(&pod_id).unwrap();
    let fp = ctd.footprint();
    drop(cri);
    drop(ctd);
    drop(node);
    assert_no_leftovers(&fp);
}

/// A node that ran nvidia-container-toolkit (its runtime containerd's CRI default),
/// configured only by `tessera setup containerd --replace-nvidia`: NVIDIA's handler is
/// gone and every pod, RuntimeClass or not, runs through tessera-runtime, so its GPU
/// request is Tessera's to grant.
#[test]
fn a_node_set_up_from_nvidia_toolkit_runs_every_pod_through_tessera() {
    let c = cluster_with(|config, dir| {
        let nct = dir.join("nvidia-container-runtime");
        std::fs::write(&nct, "#!/bin/sh\nexec runc \"$@\"\n").unwrap();
        run_cmd(Command::new("chmod").arg("755").arg(&nct)).assert_success("chmod");
        let mut doc: toml_edit::DocumentMut =
            std::fs::read_to_string(config).unwrap().parse().unwrap();
        let ctd = &mut doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"];
        ctd["default_runtime_name"] = toml_edit::value("nvidia");
        let mut rt = toml_edit::Table::new();
        rt["runtime_type"] = toml_edit::value("io.containerd.runc.v2");
        let mut opts = toml_edit::Table::new();
        opts["BinaryName"] = toml_edit::value(nct.to_string_lossy().into_owned());
        opts["Root"] = toml_edit::value(
            Containerd::runtime_root_in(dir, "nvidia").to_string_lossy().into_owned(),
        );
        rt["options"] = toml_edit::Item::Table(opts);
        ctd["runtimes"]["nvidia"] = toml_edit::Item::Table(rt);
        std::fs::write(config, doc.to_string()).unwrap();
        let empty = dir.join("no-nvidia-files");
        std::fs::create_dir_all(&empty).unwrap();
        let setup = |extra: &[&str]| {
            run_cmd(
                Command::new(tessera_cli())
                    .args(["setup", "containerd", "--config"])
                    .arg(config)
                    .arg("--runtime-path")
                    .arg(tessera_runtime())
                    .arg("--runtime-dir")
                    .arg(dir.join("tessera-runtime"))
                    .arg("--cdi-dir")
                    .arg(&empty)
                    .arg("--hooks-dir")
                    .arg(&empty)
                    .args(extra),
            )
        };
        let out = setup(&["--dry-run"]);
        out.assert_success("dry run");
        assert!(
            out.stderr_str().contains("default_runtime_name `nvidia`")
                && out.stderr_str().contains("--replace-nvidia"),
            "{}",
            out.stderr_str()
        );
        let out = setup(&["--replace-nvidia"]);
        out.assert_success("setup containerd --replace-nvidia");
        assert!(out.stdout_str().contains("disabled"), "{}", out.stdout_str());
        // The fixture's own runc root for the handler, as setup_handler does.
        let mut doc: toml_edit::DocumentMut =
            std::fs::read_to_string(config).unwrap().parse().unwrap();
        let ctd = &mut doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"];
        assert_eq!(ctd["default_runtime_name"].as_str(), Some("tessera"));
        assert!(ctd["runtimes"].get("nvidia").is_none());
        ctd["runtimes"]["tessera"]["options"]["Root"] = toml_edit::value(
            Containerd::runtime_root_in(dir, "tessera").to_string_lossy().into_owned(),
        );
        std::fs::write(config, doc.to_string()).unwrap();
    });
    // No RuntimeClass: the default handler, Tessera's now.
    let pod = PodSpec::new("plain", "team-untrusted").annotation("tessera.io/gpu", "gpu=1");
    let pod_id = c.cri.run_pod_sandbox(&pod).unwrap_or_else(|e| panic!("{e}\n{}", c.ctd.log()));
    let id = c.start(&pod_id, &pod, "main").unwrap_or_else(|e| panic!("{e}"));
    let allocs = c.allocations();
    assert_eq!(allocs.len(), 1, "{allocs:?}");
    assert_eq!(
        (allocs[0].container_id.as_str(), allocs[0].request.to_string()),
        (id.as_str(), "gpu=1".into())
    );
    // NVIDIA's handler is gone.
    let nvidia = PodSpec::new("nv", "team-untrusted").handler("nvidia");
    let e = c.cri.run_pod_sandbox(&nvidia).expect_err("no nvidia handler");
    assert!(e.to_string().contains("nvidia"), "{e}");
    c.teardown(&pod_id);
    let fp = c.ctd.footprint();
    drop(c);
    assert_no_leftovers(&fp);
}

/// INSTALL's hardening followed halfway, both ways: `tessera setup containerd` runs
/// `tessera doctor`'s check on what it would write and refuses, writing nothing; the
/// message says what to change. With the cure in place it writes.
#[test]
fn setup_containerd_refuses_the_identity_traps() {
    let dir = short_tempdir();
    let cleanup = Cleanup::new();
    cleanup.track_dir(&dir);
    let example: serde_json::Value =
        serde_json::from_slice(&std::fs::read(repo("examples/policy.json")).unwrap()).unwrap();
    let write_policy = |name: &str, edit: &dyn Fn(&mut serde_json::Value)| {
        let mut p = example.clone();
        edit(&mut p);
        let f = dir.join(name);
        std::fs::write(&f, serde_json::to_vec_pretty(&p).unwrap()).unwrap();
        f
    };
    let engine_first = write_policy("engine-first.json", &|p| {
        p["identity"].as_array_mut().unwrap().insert(
            0,
            serde_json::json!({"annotation": "tessera.io/engine", "map": {"docker-alice": "acme/trusted/training/alice"}}),
        );
    });
    let cri_limited = write_policy("cri-limited.json", &|p| {
        p["identity"][0]["engines"] = serde_json::json!(["containerd-k8s"]);
    });
    let config = dir.join("config.toml");
    let runtime_dir = dir.join("rt");
    std::fs::create_dir_all(&runtime_dir).unwrap();
    let handler_toml = runtime_dir.join("containerd-tessera.toml");
    let setup = |policy: &Path| {
        run_cmd(
            Command::new(tessera_cli())
                .args(["setup", "containerd", "--config"])
                .arg(&config)
                .args(["--runtime-path", "/usr/local/bin/tessera-runtime", "--runtime-dir"])
                .arg(&runtime_dir)
                .arg("--policy")
                .arg(policy)
                .arg("--cdi-dir")
                .arg(&dir)
                .arg("--hooks-dir")
                .arg(&dir),
        )
    };
    // The handler names its engine; an engine rule without `engines` reads it first.
    std::fs::write(&config, "version = 2\n").unwrap();
    std::fs::write(&handler_toml, "engine = \"containerd-k8s\"\n").unwrap();
    let out = setup(&engine_first);
    out.assert_failure("an engine rule that refuses every pod");
    let err = out.stderr_str();
    assert!(
        err.contains("does not map `containerd-k8s`")
            && err.contains("\"engines\": [\"docker-alice\"]"),
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(&config).unwrap(), "version = 2\n", "nothing written");
    assert!(std::fs::symlink_metadata(runtime_dir.join("containerd-tessera")).is_err(), "no link");
    // The reverse: the CRI rule limited to an engine the handler does not name.
    std::fs::remove_file(&handler_toml).unwrap();
    let out = setup(&cri_limited);
    out.assert_failure("pods billed to the default tenant");
    assert!(
        out.stderr_str().contains("billed to the default tenant acme/untrusted/sandbox/guest")
            && out.stderr_str().contains("add `engine = \"containerd-k8s\"`"),
        "{}",
        out.stderr_str()
    );
    // The cure: the handler names the engine the rule is limited to.
    std::fs::write(&handler_toml, "engine = \"containerd-k8s\"\n").unwrap();
    let out = setup(&cri_limited);
    out.assert_success("setup with the cure");
    assert!(
        out.stdout_str().contains("doctor: containerd runtime `tessera`"),
        "{}",
        out.stdout_str()
    );
}

/// A pod within its tenant's quota guarantee on a node whose GPUs a borrowing pod holds
/// (the node's own books: no coordinator): `StartContainer`, as kubelet calls it, is held
/// open by tessera-runtime while the node reclaims, and returns with the container
/// started; the borrower's container is stopped. Before, the start failed with "reclaiming
/// …; retry after N s" and kubelet retried on its back-off (docs/QUOTAS.md, The create
/// waits for its reclaim).
#[test]
fn a_pod_within_its_guarantee_starts_once_the_borrower_it_reclaims_from_is_stopped() {
    let (_dir, node, ctd) = node_with_quotas(serde_json::json!({
        "acme/trusted": {"gpus": {"H100-80GB": {"guarantee": 1}}},
        "acme/dev": {"gpus": {"H100-80GB": {"ceiling": 8}}, "grace_period_s": 2}
    }));
    let cri = ctd.cri();
    let main = ContainerSpec::new("main").command(&["sleep", "300"]);
    let run = |name: &str, ns: &str, gpus: &str| {
        let pod = PodSpec::new(name, ns).handler("tessera").annotation("tessera.io/gpu", gpus);
        let pod_id = cri.run_pod_sandbox(&pod).unwrap_or_else(|e| panic!("{e}\n{}", ctd.log()));
        let id = cri.create_container(&pod_id, &pod, &main).unwrap();
        let started = cri.start_container(&id);
        (pod_id, id, started)
    };
    // dev (no guarantee: borrowed) holds every whole GPU of the node (five; three are in
    // MIG mode).
    let (dev_pod, dev, started) = run("borrower", "team-dev", "gpu=5");
    started.unwrap_or_else(|e| panic!("{e}\n{}", ctd.log()));
    // alice asks 1 within acme/trusted's guarantee: one StartContainer, held open, succeeds.
    let (owner_pod, owner, started) = run("owner", "team-trusted", "gpu=1");
    started.unwrap_or_else(|e| panic!("the owner's start failed: {e}\n{}", ctd.log()));
    let grant = node.client().allocation(&owner).unwrap();
    assert_eq!(grant.devices.len(), 1, "{grant:?}");
    assert!(grant.pid.is_some(), "started: {grant:?}");
    cri.wait_container_state(&dev, v1::ContainerState::ContainerExited, Duration::from_secs(15))
        .unwrap_or_else(|e| panic!("the borrower was not stopped: {e}"));
    for (pod_id, id) in [(&owner_pod, &owner), (&dev_pod, &dev)] {
        cri.stop_container(id, 0).unwrap();
        cri.remove_container(id).unwrap();
        cri.stop_pod_sandbox(pod_id).unwrap();
        cri.remove_pod_sandbox(pod_id).unwrap();
    }
    let fp = ctd.footprint();
    drop(cri);
    drop(ctd);
    drop(node);
    assert_no_leftovers(&fp);
}
