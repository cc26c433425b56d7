//! The CRI harness on its own (plain runc, no Tessera component): containerd's CRI plugin
//! started by the test, images imported without a registry, a pod driven through the CRI
//! gRPC API as kubelet drives it, and nothing left behind. Needs root, runc, containerd,
//! ctr and /bin/busybox, like tests/harness_selftest.rs.

use std::time::Duration;

use tessera_harness::cri::v1::ContainerState;
use tessera_harness::cri::{
    Code, ContainerSpec, PodSpec, BUSYBOX_IMAGE, CONTAINER_TYPE_ANNOTATION,
};
use tessera_harness::*;

#[test]
fn a_two_container_pod_runs_and_is_torn_down_through_the_cri() {
    let ctd = Containerd::builder().cri().start();
    let cri = ctd.cri();

    let v = cri.version().expect("Version");
    assert_eq!(v.runtime_name, "containerd");
    assert_eq!(v.runtime_api_version, "v1");
    let img = cri.image_status(BUSYBOX_IMAGE).expect("ImageStatus").expect("busybox image");
    assert!(img.repo_tags.iter().any(|t| t == BUSYBOX_IMAGE), "{img:?}");

    let pod = PodSpec::new("smoke", "team-a").annotation("example.com/note", "x");
    let pod_id = cri.run_pod_sandbox(&pod).expect("RunPodSandbox");
    let status = cri.pod_sandbox_status(&pod_id).expect("PodSandboxStatus");
    assert_eq!(status.metadata.as_ref().map(|m| m.namespace.as_str()), Some("team-a"));

    let specs: Vec<ContainerSpec> = ["one", "two"]
        .iter()
        .map(|n| ContainerSpec::new(n).command(&["sh", "-c", "echo hi from $NAME; sleep 30"]))
        .map(|c| {
            let name = c.name.clone();
            c.env("NAME", &name)
        })
        .collect();
    let mut ids = Vec::new();
    for c in &specs {
        let id = cri.create_container(&pod_id, &pod, c).expect("CreateContainer");
        cri.start_container(&id).expect("StartContainer");
        ids.push(id);
    }
    for (id, c) in ids.iter().zip(&specs) {
        let st =
            cri.wait_container_state(id, ContainerState::ContainerRunning, Duration::from_secs(5));
        assert_eq!(st.expect("ContainerStatus"), ContainerState::ContainerRunning);
        let want = format!("hi from {}\n", c.name);
        assert!(
            wait_for(|| cri.container_output(&pod, c) == want, Duration::from_secs(5)),
            "log of {}: {:?}",
            c.name,
            cri.container_output(&pod, c)
        );
        // containerd marks its containers: this is what tessera-runtime reads.
        let spec: serde_json::Value = serde_json::from_slice(
            &std::fs::read(
                ctd.dir()
                    .join("state/io.containerd.runtime.v2.task/k8s.io")
                    .join(id)
                    .join("config.json"),
            )
            .expect("bundle config.json"),
        )
        .expect("config.json");
        assert_eq!(spec["annotations"][CONTAINER_TYPE_ANNOTATION], "container");
        assert!(
            spec["linux"]["cgroupsPath"]
                .as_str()
                .unwrap_or_default()
                .starts_with(&cri.pod_cgroup(&pod)),
            "{}",
            spec["linux"]["cgroupsPath"]
        );
    }
    let exec = cri.exec_sync(&ids[0], &["sh", "-c", "echo $NAME; exit 3"], 5).expect("ExecSync");
    assert_eq!((exec.stdout.as_str(), exec.exit_code), ("one\n", 3), "{exec:?}");
    assert_eq!(cri.list_containers(Some(&pod_id)).expect("ListContainers").len(), 2);

    for id in &ids {
        cri.stop_container(id, 0).expect("StopContainer");
        assert_eq!(cri.container_state(id).expect("status"), ContainerState::ContainerExited);
        cri.remove_container(id).expect("RemoveContainer");
    }
    cri.stop_pod_sandbox(&pod_id).expect("StopPodSandbox");
    cri.remove_pod_sandbox(&pod_id).expect("RemovePodSandbox");
    assert!(cri.list_pod_sandboxes().expect("ListPodSandbox").is_empty());
    assert!(cri.list_containers(None).expect("ListContainers").is_empty());

    let fp = ctd.footprint();
    drop(cri);
    drop(ctd);
    assert_no_leftovers(&fp);
}

/// A runtime for the `wrapped` handler: real runc, except that it refuses to create a
/// container whose spec carries `example.com/refuse`, the way tessera-runtime refuses (an
/// error line in runc's `--log` JSON file, which the shim puts into the CRI error).
const WRAPPER: &str = r#"#!/bin/sh
log=""; bundle=""; prev=""
for a in "$@"; do
  case "$prev" in --log) log="$a" ;; --bundle) bundle="$a" ;; esac
  prev="$a"
done
if [ -n "$bundle" ] && grep -q '"example.com/refuse"' "$bundle/config.json"; then
  msg="refused by the test runtime: example.com/refuse is set"
  [ -n "$log" ] && printf '{"level":"error","msg":"%s"}\n' "$msg" >> "$log"
  echo "$msg" >&2
  exit 1
fi
exec runc "$@"
"#;

#[test]
fn a_second_handler_gets_its_annotations_and_root_and_its_refusals_reach_the_caller() {
    let ctd = Containerd::builder()
        .cri()
        .before_start(|_config, dir| {
            let script = dir.join("wrapper-runtime");
            std::fs::write(&script, WRAPPER).expect("write wrapper runtime");
            let mode = std::os::unix::fs::PermissionsExt::from_mode(0o755);
            std::fs::set_permissions(&script, mode).expect("chmod wrapper runtime");
        })
        .extra_config_with(|dir| {
            let handler = "[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.wrapped]";
            format!(
                "{handler}\n  runtime_type = \"io.containerd.runc.v2\"\n  \
                 container_annotations = [\"example.com/*\"]\n\n\
                 [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.wrapped.options]\n  \
                 BinaryName = \"{}\"\n  Root = \"{}\"\n",
                dir.join("wrapper-runtime").display(),
                Containerd::runtime_root_in(dir, "wrapped").display()
            )
        })
        .start();
    let root = Containerd::runtime_root_in(ctd.dir(), "wrapped");
    let fp = ctd.footprint();
    assert!(fp.runc_roots.contains(&root), "{:?} lacks {}", fp.runc_roots, root.display());
    let cri = ctd.cri();

    let pod = PodSpec::new("wrapped", "team-b").handler("wrapped");
    let pod_id = cri.run_pod_sandbox(&pod).expect("RunPodSandbox through the wrapper");
    assert!(runc_container_ids(&root).contains(&pod_id), "sandbox not under {}", root.display());

    let plain = ContainerSpec::new("plain").command(&["sleep", "30"]);
    let id = cri.create_container(&pod_id, &pod, &plain).expect("CreateContainer");
    cri.start_container(&id).expect("StartContainer");
    assert!(runc_container_ids(&root).contains(&id));

    // containerd runs the runtime in StartContainer, not CreateContainer.
    let refused = ContainerSpec::new("refused").annotation("example.com/refuse", "1");
    let id = cri.create_container(&pod_id, &pod, &refused).expect("CreateContainer");
    let err = cri.start_container(&id).expect_err("the wrapper refuses");
    assert!(
        err.message().contains("refused by the test runtime: example.com/refuse is set"),
        "{err}"
    );
    assert_eq!(err.code(), Some(Code::Unknown), "{err}");

    // Dropped with the pod and a container running: the fixture cleans up alone.
    drop(cri);
    drop(ctd);
    assert_no_leftovers(&fp);
}

#[test]
fn every_cri_handler_must_keep_its_runc_root_inside_the_fixture() {
    let dir = std::path::Path::new("/tmp/ts-fixture");
    let section = |name: &str, root: Option<&str>| {
        let p = "plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes";
        let mut s = format!("[{p}.{name}]\n  runtime_type = \"io.containerd.runc.v2\"\n");
        if let Some(r) = root {
            s.push_str(&format!("[{p}.{name}.options]\n  BinaryName = \"x\"\n  Root = \"{r}\"\n"));
        }
        s
    };
    let ok = format!(
        "{}{}",
        section("runc", Some("/tmp/ts-fixture/runc")),
        section("\"tessera\"", Some("/tmp/ts-fixture/runc-tessera"))
    );
    assert_eq!(
        cri_runtime_roots(&ok, dir).expect("both inside"),
        vec![dir.join("runc"), dir.join("runc-tessera")]
    );
    let v3 = "[plugins.\"io.containerd.cri.v1.runtime\".containerd.runtimes.t.options]\n\
              Root = '/tmp/ts-fixture/t'\n";
    assert_eq!(cri_runtime_roots(v3, dir).expect("v3 layout"), vec![dir.join("t")]);

    let missing =
        format!("{}{}", section("runc", Some("/tmp/ts-fixture/runc")), section("tessera", None));
    let err = cri_runtime_roots(&missing, dir).expect_err("no Root");
    assert!(err.contains("\"tessera\" has no options.Root"), "{err}");
    for outside in ["/run/containerd/runc", "/tmp/ts-fixture/../x", "/tmp/ts-fixture-2/r", "rel"] {
        let err = cri_runtime_roots(&section("tessera", Some(outside)), dir).expect_err(outside);
        assert!(err.contains("outside the fixture"), "{outside}: {err}");
    }
}
