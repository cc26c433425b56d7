//! docs/INSTALL.md "containerd without Kubernetes", as written there: containerd runs with
//! no Tessera environment at all; `ctr run --runc-binary` names tessera-runtime, which finds
//! tesserad, runc and the hook in its runtime configuration (here `PATH.toml` beside the
//! link it is run as, as the podman section does; on a node `/etc/tessera/runtime.toml`).

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use tessera_harness::node::*;
use tessera_harness::*;

#[test]
fn ctr_runs_a_gpu_container_through_the_runtime_config_with_no_environment() {
    let node = Node::start();
    let dir = short_tempdir();
    let cleanup = Cleanup::new();
    cleanup.track_dir(&dir);
    let link = dir.join("tessera-runtime");
    std::os::unix::fs::symlink(tessera_runtime(), &link).unwrap();
    std::fs::write(dir.join("tessera-runtime.toml"), node.runtime_config(None)).unwrap();
    // No .env(...): containerd, its shims and so tessera-runtime get no TESSERA_* variable.
    let ctd = Containerd::builder().runc_binary(&link).start();
    let rootfs = Rootfs::busybox(ctd.dir().join("rootfs"));
    let out = ctd.ctr_run(
        &rootfs,
        "plain-gpu",
        &["--annotation", &format!("{NS}=team-trusted"), "--env", "TESSERA_GPU=gpu=1"],
        &["sh", "-c", "echo $CUDA_VISIBLE_DEVICES; ls /dev | grep -c '^nvidia[0-9]'"],
    );
    out.assert_success("ctr run with a GPU request");
    let lines: Vec<String> = out.stdout_str().lines().map(|l| l.trim().to_string()).collect();
    assert!(lines.first().is_some_and(|u| u.starts_with("GPU-")), "{lines:?}");
    assert_eq!(lines.get(1).map(String::as_str), Some("1"), "one GPU node: {lines:?}");
    // --rm: the shim's delete went through tessera-runtime, which gave the grant back.
    let c = node.client();
    assert!(wait_for(
        || c.status().map(|s| s.allocations.is_empty()).unwrap_or(false),
        Duration::from_secs(10)
    ));
    // Without the configuration beside it, the same runtime has no daemon to ask: a GPU
    // request fails closed (the default socket is not this test's tesserad).
    std::fs::remove_file(dir.join("tessera-runtime.toml")).unwrap();
    let out = ctd.ctr_run(&rootfs, "no-config", &["--env", "TESSERA_GPU=gpu=1"], &["true"]);
    out.assert_failure("no configuration, no daemon");
}
