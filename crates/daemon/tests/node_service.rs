//! The node service in-process, against the real simulated backend, real SQLite and the
//! example policy: every decision path, idempotency, exhaustion, reconciliation, restart.

// Integration-test crates: clippy counts their helper functions as non-test code, so
// `allow-unwrap-in-tests` (clippy.toml) does not reach them; a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use tessera_api::{
    AllocateRequest, ErrorCode, Isolation, ReleaseRequest, RequestSource, StartRequest,
};
use tesserad::{store::Store, ActivePolicy, Host, LinuxHost, Node, NodeParts, TreeHost};

const POLICY: &[u8] = include_bytes!("../../../examples/policy.json");

fn repo(p: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(p)
}

fn node_at(state: &Path, grace: Duration) -> Node {
    node_with(state, grace, true)
}

fn node_with(state: &Path, grace: Duration, dynamic_mig: bool) -> Node {
    node_on(state, grace, dynamic_mig, Arc::new(LinuxHost))
}

fn node_on(state: &Path, grace: Duration, dynamic_mig: bool, host: Arc<dyn Host>) -> Node {
    let policy = policy::Policy::parse(POLICY, "examples/policy.json").expect("policy");
    node_under(state, grace, dynamic_mig, host, policy)
}

/// The example policy, but a dirty device may go back to its last tenant unscrubbed.
fn same_tenant_skip_policy() -> policy::Policy {
    let mut v: serde_json::Value = serde_json::from_slice(POLICY).expect("json");
    v["scrub"] = serde_json::json!({"same_tenant_skip": true});
    let bytes = serde_json::to_vec(&v).expect("json");
    policy::Policy::parse(&bytes, "same-tenant-skip.json").expect("policy")
}

fn node_under(
    state: &Path,
    grace: Duration,
    dynamic_mig: bool,
    host: Arc<dyn Host>,
    policy: policy::Policy,
) -> Node {
    let backend =
        slicer::SimBackend::open(&repo("examples/nodes/h100x8.json"), state).expect("sim");
    let store = Store::open(&state.join("state.db")).expect("store");
    let ledger = metering::Ledger::open(&state.join("ledger.db"), Arc::new(metering::SystemClock))
        .expect("ledger");
    // No MPS control binary here: MPS grants fail cleanly (tests/mps.rs runs the real flow).
    let control = mpsd::ProcessControl::new("/nonexistent/nvidia-cuda-mps-control");
    let mps = Arc::new(mpsd::Supervisor::new(Arc::new(control), state.to_path_buf()));
    Node::new(NodeParts {
        backend: Box::new(backend),
        policy: ActivePolicy { policy, source: "test".into() },
        store,
        ledger,
        mps,
        host,
        pending_grace: grace,
        dynamic_mig,
        // No scrub binary here: released devices stay dirty (tests/scrub.rs runs scrubs).
        scrub: tesserad::node::ScrubSetup { exe: "/nonexistent/tessera".into(), sim_faults: None },
    })
    .expect("node")
}

fn req(id: &str, ns: &str, request: &str) -> AllocateRequest {
    req_in(id, ns, request, &format!("/bundles/{id}"))
}

fn req_in(id: &str, ns: &str, request: &str, bundle: &str) -> AllocateRequest {
    let mut annotations = BTreeMap::new();
    annotations.insert("io.kubernetes.cri.sandbox-namespace".to_string(), ns.to_string());
    AllocateRequest {
        container_id: id.parse().expect("a valid container id"),
        runc_root: "/nonexistent/runc-root".into(),
        bundle: bundle.into(),
        request: request.parse().expect("a well-formed request"),
        request_source: RequestSource::Annotation,
        annotations,
        limits: None,
    }
}

/// How many MIG instances of `profile` the node has now.
fn instances_of(node: &Node, profile: &str) -> usize {
    node.inventory().gpus.iter().flat_map(|g| &g.instances).filter(|i| i.profile == profile).count()
}

/// The uuids of every MIG instance the node has now.
fn instance_uuids(node: &Node) -> BTreeSet<String> {
    node.inventory().gpus.iter().flat_map(|g| g.instances.iter().map(|i| i.uuid.clone())).collect()
}

#[test]
fn untrusted_mig_gets_one_instance_with_exactly_its_caps() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut node = node_at(dir.path(), Duration::from_secs(60));
    let a = node.allocate(&req("c1", "team-untrusted", "mig=1g.10gb")).expect("granted");
    assert_eq!(a.tenant, "acme/untrusted/sandbox/guest");
    assert_eq!(a.trust, "untrusted");
    assert_eq!(a.isolation, Isolation::Mig);
    assert_eq!(a.devices.len(), 1);
    let d = &a.devices[0];
    assert!(d.uuid.starts_with("MIG-"), "{}", d.uuid);
    let (gpu, inst) = node
        .inventory()
        .gpus
        .iter()
        .find_map(|g| g.instances.iter().find(|i| i.uuid == d.uuid).map(|i| (g, i)))
        .expect("granted instance is in the inventory");
    assert_eq!(inst.profile, "1g.10gb");
    let caps = node.inventory().majors.nvidia_caps.expect("caps major");
    let uvm = node.inventory().majors.nvidia_uvm;
    let got: BTreeSet<(String, i64, i64)> =
        a.injection.devices.iter().map(|n| (n.path.clone(), n.major, n.minor)).collect();
    let want: BTreeSet<(String, i64, i64)> = [
        ("/dev/nvidiactl".to_string(), 195, 255),
        ("/dev/nvidia-uvm".to_string(), uvm as i64, 0),
        ("/dev/nvidia-uvm-tools".to_string(), uvm as i64, 1),
        (format!("/dev/nvidia{}", gpu.minor), 195, gpu.minor as i64),
        (
            format!("/dev/nvidia-caps/nvidia-cap{}", inst.gi_cap_minor),
            caps as i64,
            inst.gi_cap_minor as i64,
        ),
        (
            format!("/dev/nvidia-caps/nvidia-cap{}", inst.ci_cap_minor),
            caps as i64,
            inst.ci_cap_minor as i64,
        ),
    ]
    .into_iter()
    .collect();
    assert_eq!(got, want);
    assert!(
        a.injection.env.contains(&format!("CUDA_VISIBLE_DEVICES={}", d.uuid)),
        "{:?}",
        a.injection.env
    );
}

#[test]
fn untrusted_mps_and_shared_are_refused_naming_tenant_request_and_rule() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut node = node_at(dir.path(), Duration::from_secs(60));
    for request in ["mps=25", "shared"] {
        let e = node.allocate(&req("c1", "team-untrusted", request)).unwrap_err();
        assert_eq!(e.code(), ErrorCode::Refused, "{e:?}");
        assert_eq!(e.tenant(), Some("acme/untrusted/sandbox/guest"));
        assert_eq!(e.request(), Some(request));
        assert_eq!(e.rule(), Some("tiers.untrusted.allow"));
        assert!(
            e.message().contains("acme/untrusted/sandbox/guest") && e.message().contains(request),
            "{}",
            e.message()
        );
    }
    assert!(node.allocations().expect("list").is_empty(), "a refusal must grant nothing");
}

#[test]
fn an_mps_grant_without_a_control_binary_fails_cleanly_and_grants_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut node = node_at(dir.path(), Duration::from_secs(60));
    let e = node.allocate(&req("c1", "team-trusted", "mps=25")).unwrap_err();
    assert_eq!(e.code(), ErrorCode::Internal, "{e:?}");
    assert!(e.message().contains("MPS share"), "{}", e.message());
    assert!(node.allocations().expect("list").is_empty());
}

#[test]
fn time_sliced_replicas_stay_within_one_sharing_domain() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut node = node_at(dir.path(), Duration::from_secs(60));
    let replicas = 4; // the example policy's default
    let mut gpus = BTreeSet::new();
    for i in 0..replicas {
        let a =
            node.allocate(&req(&format!("s{i}"), "team-dev", "shared")).expect("shared granted");
        let s = a.share.expect("share record");
        assert_eq!(s.replicas, Some(replicas));
        gpus.insert(s.device);
    }
    assert_eq!(gpus.len(), 1, "replicas of one domain pack onto one GPU");
    let gpu = gpus.into_iter().next().expect("gpu");
    let next = node.allocate(&req("s-next", "team-dev", "shared")).expect("fifth goes elsewhere");
    assert_ne!(next.share.expect("share").device, gpu);
    // The time-sliced GPU is neither exclusive nor MPS capacity any more.
    let whole = node.allocate(&req("g", "team-dev", "gpu=3")).expect("three whole GPUs left");
    assert!(whole.devices.iter().all(|d| d.uuid != gpu));
    let status = node.status().expect("status");
    let st = status.gpus.iter().find(|g| g.uuid == gpu).expect("gpu");
    assert_eq!(st.state, tessera_api::DeviceState::Shared);
}

#[test]
fn identity_comes_only_from_trusted_annotations() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut node = node_at(dir.path(), Duration::from_secs(60));
    // An annotation the policy does not name cannot make anyone trusted.
    let mut r = req("c1", "team-untrusted", "mps=25");
    r.annotations.insert("tessera.io/tenant".into(), "acme/trusted/training/alice".into());
    r.annotations.insert("tessera.io/trust".into(), "dev".into());
    let e = node.allocate(&r).unwrap_err();
    assert_eq!(e.tenant(), Some("acme/untrusted/sandbox/guest"));
    // Without the trusted annotation: the policy's default tenant (untrusted), whatever
    // else the config says.
    let mut r = req("c2", "x", "mps=25");
    r.annotations.clear();
    r.annotations.insert("tessera.io/tenant".into(), "acme/trusted/training/alice".into());
    let e = node.allocate(&r).unwrap_err();
    assert_eq!(e.tenant(), Some("acme/untrusted/sandbox/guest"), "{e:?}");
    // A namespace that is not mapped is refused too.
    let e = node.allocate(&req("c3", "team-nobody", "gpu=1")).unwrap_err();
    assert_eq!(e.code(), ErrorCode::UnknownTenant, "{e:?}");
    assert!(e.message().contains("team-nobody"), "{}", e.message());
}

#[test]
fn requests_the_node_cannot_satisfy_fail_clearly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut node = node_at(dir.path(), Duration::from_secs(60));
    let e = node.allocate(&req("c1", "team-trusted", "gpu=8")).unwrap_err();
    assert_eq!(e.code(), ErrorCode::NoCapacity, "{e:?}");
    assert!(e.message().contains("gpu=8"), "{}", e.message());
    let e = node.allocate(&req("c2", "team-trusted", "mig=9g.99gb")).unwrap_err();
    assert_eq!(e.code(), ErrorCode::NoCapacity, "{e:?}");
    assert!(e.message().contains("9g.99gb"), "{}", e.message());
    // A malformed request never reaches the node: the body is refused when it is read.
    let body = serde_json::json!({"container_id": "c3", "runc_root": "/r", "bundle": "/b",
        "request": "gpu=banana", "request_source": "annotation"});
    let e = serde_json::from_value::<AllocateRequest>(body).unwrap_err().to_string();
    assert!(e.contains("bad value `banana` for `gpu`"), "{e}");
}

#[test]
fn grants_are_idempotent_by_container_id() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut node = node_at(dir.path(), Duration::from_secs(60));
    let a = node.allocate(&req("c1", "team-trusted", "gpu=2")).expect("granted");
    let b = node.allocate(&req("c1", "team-trusted", "gpu=2")).expect("same again");
    assert_eq!(a, b);
    let e = node.allocate(&req("c1", "team-trusted", "gpu=1")).unwrap_err();
    assert_eq!(e.code(), ErrorCode::Conflict, "{e:?}");
    assert_eq!(node.allocations().expect("list").len(), 1);
}

#[test]
fn exhaustion_then_release_then_reuse_with_a_static_layout() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut node = node_with(dir.path(), Duration::from_secs(60), false);
    let n = node
        .inventory()
        .gpus
        .iter()
        .flat_map(|g| &g.instances)
        .filter(|i| i.profile == "1g.10gb")
        .count();
    assert!(n >= 2, "example node needs several 1g.10gb instances");
    let mut seen = BTreeSet::new();
    for i in 0..n {
        let a = node.allocate(&req(&format!("c{i}"), "team-dev", "mig=1g.10gb")).expect("granted");
        assert!(seen.insert(a.devices[0].uuid.clone()), "instance granted twice");
    }
    let e = node.allocate(&req("one-more", "team-dev", "mig=1g.10gb")).unwrap_err();
    assert_eq!(e.code(), ErrorCode::NoCapacity);
    assert!(node.release("c0", "test").expect("release"));
    // Released is not free: the instance is dirty until scrubbed and verified.
    let e = node.allocate(&req("one-more", "team-dev", "mig=1g.10gb")).unwrap_err();
    assert_eq!(e.code(), ErrorCode::NoCapacity, "{e:?}");
    scrub_all(&mut node, dir.path());
    node.allocate(&req("one-more", "team-dev", "mig=1g.10gb")).expect("scrubbed instance reused");
}

/// Run every pending scrub in-process with the simulated scrubber (the daemon runs them in
/// a `tessera scrub` child; that path is tested end to end in tests/scrub.rs).
fn scrub_all(node: &mut Node, state: &Path) {
    while let Some(job) = node.next_scrub().expect("next scrub") {
        let mem = state.join("sim/mem").join(format!("{}.bin", job.device));
        let report = scrub::Scrubber::scrub(&scrub::SimScrubber::single_file(&mem), &job.device);
        node.finish_scrub(&job.device, report).expect("finish");
    }
}

#[test]
fn a_dirty_device_never_goes_to_another_tenant_before_a_verified_scrub() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut node = node_with(dir.path(), Duration::from_secs(60), false);
    let whole = node.inventory().gpus.iter().filter(|g| !g.mig_enabled).count();
    for i in 0..whole {
        node.allocate(&req(&format!("a{i}"), "team-trusted", "gpu=1")).expect("whole gpu");
    }
    let a0 = node.allocation("a0").expect("a0").devices[0].uuid.clone();
    node.release("a0", "poststop").expect("release");
    let st = node.status().expect("status");
    let g = st.gpus.iter().find(|g| g.uuid == a0).expect("gpu");
    assert_eq!(g.state, tessera_api::DeviceState::Dirty);
    assert!(
        g.lifecycle.as_ref().is_some_and(|l| l.detail.contains("acme/trusted/training/alice")),
        "{g:?}"
    );
    // Another tenant: refused while dirty.
    let e = node.allocate(&req("b", "team-dev", "gpu=1")).unwrap_err();
    assert_eq!(e.code(), ErrorCode::NoCapacity, "{e:?}");
    // A restart does not launder it.
    drop(node);
    let mut node = node_with(dir.path(), Duration::from_secs(60), false);
    assert!(node.allocate(&req("b", "team-dev", "gpu=1")).is_err());
    // A scrub that leaves data behind quarantines it.
    let job = node.next_scrub().expect("next").expect("a job");
    assert_eq!(job.device, a0);
    let mem = dir.path().join("sim/mem").join(format!("{a0}.bin"));
    let mut bad =
        scrub::Scrubber::scrub(&scrub::SimScrubber::single_file(&mem), &a0).expect("scrub");
    bad.nonzero_words = 3;
    bad.ok = false;
    node.finish_scrub(&a0, Ok(bad)).expect("finish");
    let g = node.status().expect("status").gpus.into_iter().find(|g| g.uuid == a0).expect("gpu");
    assert_eq!(g.state, tessera_api::DeviceState::Quarantined);
    assert!(node.allocate(&req("b", "team-dev", "gpu=1")).is_err());
    // Unquarantine re-scrubs; a good scrub returns it to service, for anyone.
    let job = node.unquarantine(&a0).expect("unquarantine");
    let good = scrub::Scrubber::scrub(&scrub::SimScrubber::single_file(&mem), &a0);
    assert_eq!(node.finish_scrub(&job.device, good).expect("finish"), scrub::DeviceState::Free);
    let b = node.allocate(&req("b", "team-dev", "gpu=1")).expect("clean gpu for another tenant");
    assert_eq!(b.devices[0].uuid, a0);
    assert!(b.injection.mounts.iter().any(
        |m| m.destination == "/dev/tessera-sim-mem" && m.source.ends_with(&format!("{a0}.bin"))
    ));
}

#[test]
fn start_confirms_only_known_containers_from_their_own_bundle() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut node = node_at(dir.path(), Duration::from_secs(60));
    let fx = tessera_harness::Fixture::new();
    let init = fx.fake_container("c1");
    let e = node
        .start(
            &"ghost".parse().expect("valid"),
            &StartRequest { pid: init.pid, bundle: "/bundles/ghost".into(), created: false },
        )
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::NotFound);
    node.allocate(&req_in("c1", "team-trusted", "gpu=1", &init.bundle_str())).expect("granted");
    let e = node
        .start(
            &"c1".parse().expect("valid"),
            &StartRequest { pid: init.pid, bundle: "/elsewhere".into(), created: false },
        )
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::Conflict);
    let a = node
        .start(
            &"c1".parse().expect("valid"),
            &StartRequest { pid: init.pid, bundle: init.bundle_str(), created: false },
        )
        .expect("started");
    assert_eq!(a.pid, Some(init.pid));
    // This process is no container: the host's namespaces, a cgroup of many processes.
    let me = std::process::id() as i32;
    node.allocate(&req("c2", "team-trusted", "gpu=1")).expect("granted");
    let e = node
        .start(
            &"c2".parse().expect("valid"),
            &StartRequest { pid: me, bundle: "/bundles/c2".into(), created: false },
        )
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::Refused, "{e:?}");
    assert!(e.message().contains("the host's mnt and pid namespace"), "{e:?}");
}

/// A host made of files: `/proc/<pid>/{stat,cgroup}` and cgroup v1 `devices/c/<id>`.
struct FakeHost {
    dir: tempfile::TempDir,
}

impl FakeHost {
    fn new() -> Self {
        FakeHost { dir: tempfile::tempdir().expect("tempdir") }
    }
    fn paths(&self) -> Arc<dyn Host> {
        Arc::new(TreeHost {
            proc_root: self.dir.path().join("proc"),
            cgroup_root: self.dir.path().join("cgroup"),
        })
    }
    /// Process `pid` (start time 987654) in the container cgroup of `id`.
    fn process(&self, pid: i32, id: &str) {
        let p = self.dir.path().join("proc").join(pid.to_string());
        std::fs::create_dir_all(&p).expect("mkdir");
        std::fs::write(
            p.join("stat"),
            format!(
                "{pid} (sh) S 1 {pid} {pid} 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10"
            ),
        )
        .expect("stat");
        std::fs::write(p.join("cgroup"), format!("5:devices:/c/{id}\n4:memory:/c/{id}\n0::/\n"))
            .expect("cgroup");
        self.procs(id, &[pid]);
    }
    fn exit(&self, pid: i32) {
        std::fs::remove_dir_all(self.dir.path().join("proc").join(pid.to_string())).expect("rm");
    }
    /// What `cgroup.procs` of `id`'s cgroup lists.
    fn procs(&self, id: &str, pids: &[i32]) {
        let cg = self.dir.path().join("cgroup/devices/c").join(id);
        std::fs::create_dir_all(&cg).expect("mkdir");
        let text: String = pids.iter().map(|p| format!("{p}\n")).collect();
        std::fs::write(cg.join("cgroup.procs"), text).expect("procs");
    }
}

fn released(node: &mut Node) -> BTreeSet<String> {
    node.reconcile().expect("reconcile").released.into_iter().map(|(id, _)| id).collect()
}

#[test]
fn reconciler_frees_what_is_gone_and_keeps_what_lives() {
    let dir = tempfile::tempdir().expect("tempdir");
    let host = FakeHost::new();
    let mut node = node_on(dir.path(), Duration::ZERO, true, host.paths());
    let start = |node: &mut Node, id: &str, pid: i32| {
        host.process(pid, id);
        node.allocate(&req(id, "team-trusted", "gpu=1")).expect("granted");
        node.start(
            &id.parse().expect("valid"),
            &StartRequest { pid, bundle: format!("/bundles/{id}"), created: false },
        )
        .expect("started");
    };
    // Running, init alive: kept.
    start(&mut node, "alive", 100);
    // Running, init exited, its cgroup empty, runc has no record: released.
    start(&mut node, "exited", 101);
    host.exit(101);
    host.procs("exited", &[]);
    // Running, init exited, a worker left in its cgroup (no own pid namespace): kept.
    start(&mut node, "worker", 102);
    host.exit(102);
    host.procs("worker", &[103]);
    // Running, init exited, cgroup empty, but runc still has it (stopped, not deleted): kept.
    let runc_root = dir.path().join("runc");
    std::fs::create_dir_all(runc_root.join("stopped")).expect("mkdir");
    std::fs::write(runc_root.join("stopped/state.json"), "{}").expect("state");
    host.process(104, "stopped");
    let mut r = req("stopped", "team-trusted", "gpu=1");
    r.runc_root = runc_root.display().to_string();
    node.allocate(&r).expect("granted");
    node.start(
        &"stopped".parse().expect("valid"),
        &StartRequest { pid: 104, bundle: "/bundles/stopped".into(), created: false },
    )
    .expect("started");
    host.exit(104);
    host.procs("stopped", &[]);
    // Pending past the grace with no runc state: released.
    node.allocate(&req("never", "team-trusted", "gpu=1")).expect("granted");
    assert_eq!(released(&mut node), ["exited", "never"].into_iter().map(String::from).collect());
    let left: Vec<String> = node
        .allocations()
        .expect("list")
        .into_iter()
        .map(|a| a.container_id.into_string())
        .collect();
    assert_eq!(left, ["alive", "stopped", "worker"]);
    // The worker exits: released. runc deletes the stopped container: released.
    host.procs("worker", &[]);
    std::fs::remove_dir_all(runc_root.join("stopped")).expect("rm");
    assert_eq!(released(&mut node), ["stopped", "worker"].into_iter().map(String::from).collect());
}

#[test]
fn a_start_whose_cgroup_cannot_be_told_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let host = FakeHost::new();
    let mut node = node_on(dir.path(), Duration::from_secs(60), true, host.paths());
    node.allocate(&req("c1", "team-trusted", "gpu=1")).expect("granted");
    // /proc says one cgroup, the cgroup does not list the pid (a forged line).
    host.process(200, "c1");
    host.procs("c1", &[201]);
    let e = node
        .start(
            &"c1".parse().expect("valid"),
            &StartRequest { pid: 200, bundle: "/bundles/c1".into(), created: false },
        )
        .unwrap_err();
    assert_eq!(e.code(), ErrorCode::BadRequest);
    assert!(
        e.message().contains("cannot tell the cgroup") && e.message().contains("is not in"),
        "{}",
        e.message()
    );
    assert_eq!(
        node.allocation("c1").expect("still granted").state,
        tessera_api::AllocationState::Pending
    );
    host.procs("c1", &[200]);
    node.start(
        &"c1".parse().expect("valid"),
        &StartRequest { pid: 200, bundle: "/bundles/c1".into(), created: false },
    )
    .expect("started");
}

#[test]
fn only_the_removed_container_a_grant_was_made_for_can_release_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut node = node_at(dir.path(), Duration::from_secs(60));
    let runc_root = dir.path().join("runc");
    std::fs::create_dir_all(runc_root.join("c1")).expect("mkdir");
    std::fs::write(runc_root.join("c1/state.json"), "{}").expect("state");
    let root = runc_root.display().to_string();
    let mut r = req("c1", "team-trusted", "gpu=1");
    r.runc_root = root.clone();
    let before = node.allocate(&r).expect("granted");
    let ask = |root: &str, bundle: &str| ReleaseRequest {
        runc_root: Some(root.into()),
        bundle: Some(bundle.into()),
    };
    // runc still has it: whoever asks, with the right root and bundle or nothing at all.
    for req in [ask(&root, "/bundles/c1"), ReleaseRequest::default()] {
        let e = node.release_removed(&"c1".parse().expect("valid"), &req).unwrap_err();
        assert_eq!(e.code(), ErrorCode::Conflict, "{e:?}");
        assert!(e.message().contains("runc still has it"), "{}", e.message());
    }
    std::fs::remove_dir_all(runc_root.join("c1")).expect("rm");
    // A container of the same id in another root or bundle: refused, nothing released.
    for req in
        [ask("/run/other", "/bundles/c1"), ask(&root, "/bundles/other"), ask("/run/x\ny", "/b")]
    {
        let e = node.release_removed(&"c1".parse().expect("valid"), &req).unwrap_err();
        assert_eq!(e.code(), ErrorCode::Conflict, "{e:?}");
        assert!(
            e.message().contains("nothing released") && !e.message().contains('\n'),
            "{}",
            e.message()
        );
    }
    assert_eq!(node.allocation("c1").expect("kept"), before);
    let status = node.status().expect("status");
    let refused = status.events.iter().filter(|e| e.kind == "release-refused").count();
    assert_eq!(refused, 5, "{:?}", status.events);
    // Its own root and bundle, or an older client's empty request, once runc removed it.
    assert!(node
        .release_removed(&"c1".parse().expect("valid"), &ask(&root, "/bundles/c1"))
        .expect("released"));
    assert!(!node
        .release_removed(&"c1".parse().expect("valid"), &ReleaseRequest::default())
        .expect("unknown is fine"));
    // An id that breaks runc's rule never reaches the node: it is no `ContainerId`, and the
    // API refuses it at the edge with the 400 the node gave before (`server::tests::
    // path_container_ids_follow_runcs_rules_at_the_edge`, `tests/protocol.rs`).
    assert!("../c1".parse::<tessera_api::ContainerId>().is_err());
}

#[test]
fn random_grant_release_sequences_never_double_assign_and_survive_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let requests = ["gpu=1", "gpu=2", "mig=1g.10gb", "mig=2g.20gb", "mig=3g.40gb"];
    let mut live: Vec<String> = Vec::new();
    let mut node = node_at(dir.path(), Duration::from_secs(60));
    for step in 0..400 {
        if step % 97 == 0 {
            drop(node);
            node = node_at(dir.path(), Duration::from_secs(60)); // restart: state comes back from disk
        }
        if !live.is_empty() && rng.gen_bool(0.45) {
            let id = live.swap_remove(rng.gen_range(0..live.len()));
            assert!(node.release(&id, "test").expect("release"));
        } else {
            let id = format!("c{step}");
            let r = requests[rng.gen_range(0..requests.len())];
            match node.allocate(&req(&id, "team-dev", r)) {
                Ok(_) => live.push(id),
                Err(e) => assert_eq!(e.code(), ErrorCode::NoCapacity, "{e:?}"),
            }
        }
        let all = node.allocations().expect("list");
        let mut seen = BTreeSet::new();
        for a in &all {
            for d in &a.devices {
                assert!(seen.insert(d.uuid.clone()), "device {} held twice at step {step}", d.uuid);
            }
        }
        assert_eq!(all.len(), live.len());
    }
    let status = node.status().expect("status");
    let held_in_status = status
        .gpus
        .iter()
        .map(|g| {
            g.holder.is_some() as usize + g.instances.iter().filter(|i| i.holder.is_some()).count()
        })
        .sum::<usize>();
    let held_in_allocs: usize =
        node.allocations().expect("list").iter().map(|a| a.devices.len()).sum();
    assert_eq!(held_in_status, held_in_allocs);
}

#[test]
fn metering_follows_start_release_and_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fx = tessera_harness::Fixture::new();
    let (mig_init, two_init) = (fx.fake_container("mig"), fx.fake_container("two"));
    {
        let mut node = node_at(dir.path(), Duration::from_secs(60));
        node.allocate(&req_in("mig", "team-untrusted", "mig=3g.40gb", &mig_init.bundle_str()))
            .expect("granted");
        node.allocate(&req_in("two", "team-trusted", "gpu=2", &two_init.bundle_str()))
            .expect("granted");
        assert!(
            node.intervals().expect("intervals").is_empty(),
            "metering starts at start, not at grant"
        );
        for (id, init) in [("mig", &mig_init), ("two", &two_init)] {
            node.start(
                &id.parse().expect("valid"),
                &StartRequest { pid: init.pid, bundle: init.bundle_str(), created: false },
            )
            .expect("start");
        }
        let open = node.intervals().expect("intervals");
        assert_eq!(open.len(), 3, "one interval per device");
        let mig = open.iter().find(|r| r.start.container_id == "mig").expect("mig interval");
        assert!((mig.start.fraction - 3.0 / 7.0).abs() < 1e-12, "3g = 3/7 of a GPU");
        assert_eq!(mig.start.mig_profile.as_deref(), Some("3g.40gb"));
        assert!(open
            .iter()
            .filter(|r| r.start.container_id == "two")
            .all(|r| r.start.fraction == 1.0));
        node.release("two", "poststop").expect("release");
        node.checkpoint().expect("checkpoint");
    }
    // Restart: the ledger closes what was open at its checkpoint; the daemon reopens the
    // still-running container's interval, exactly once.
    let mut node = node_at(dir.path(), Duration::from_secs(60));
    assert_eq!(node.resume_metering().expect("resume"), 1);
    let all = node.intervals().expect("intervals");
    let mig: Vec<_> = all.iter().filter(|r| r.start.container_id == "mig").collect();
    assert_eq!(mig.len(), 2, "closed at the checkpoint + reopened");
    assert_eq!(mig.iter().filter(|r| r.end.is_none()).count(), 1);
    assert!(all.iter().filter(|r| r.start.container_id == "two").all(|r| r.end.is_some()));
    let now = tesserad::now_ms();
    let report = node.usage(now - 3_600_000, now + 1, metering::GroupBy::User).expect("usage");
    assert_eq!(report.total.intervals, 4);
    let e = node.usage(now, now - 1, metering::GroupBy::User).unwrap_err();
    assert_eq!(e.code(), ErrorCode::BadRequest, "{e:?}");
}

#[test]
fn dynamic_mig_creates_instances_and_defragments_only_idle_ones() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut node = node_at(dir.path(), Duration::from_secs(60));
    let before: BTreeSet<String> = instance_uuids(&node);
    // Hold every existing 2g.20gb and every 1g.10gb on GPU 2, so a new 2g can only come
    // from cutting new slices.
    let mut held = BTreeSet::new();
    let existing_2g = instances_of(&node, "2g.20gb");
    for i in 0..existing_2g {
        let a =
            node.allocate(&req(&format!("h{i}"), "team-dev", "mig=2g.20gb")).expect("existing 2g");
        assert!(
            before.contains(a.devices[0].uuid.as_str()),
            "a free instance is reused before anything is cut"
        );
        held.insert(a.devices[0].uuid.to_string());
    }
    let a = node.allocate(&req("new", "team-dev", "mig=2g.20gb")).expect("a 2g is cut on demand");
    let uuid = a.devices[0].uuid.to_string();
    assert!(!before.contains(&uuid), "a fresh instance");
    let inst = node
        .inventory()
        .gpus
        .iter()
        .flat_map(|g| &g.instances)
        .find(|i| i.uuid == uuid)
        .expect("in inventory");
    assert_eq!((inst.profile.as_str(), inst.size), ("2g.20gb", 2));
    // Nothing held was touched.
    let after: BTreeSet<String> = instance_uuids(&node);
    assert!(held.is_subset(&after), "a held instance was destroyed");
    let events = node.status().expect("status").events;
    assert!(events.iter().any(|e| e.kind == "mig"), "{events:?}");
    // The layout stays legal on every GPU.
    for g in node.inventory().gpus.iter().filter(|g| g.mig_enabled) {
        let model = slicer::model(&g.model).expect("model");
        let placements: Vec<(&str, u8)> =
            g.instances.iter().map(|i| (i.profile.as_str(), i.start)).collect();
        slicer::placement_is_legal(model, &placements).expect("legal layout");
    }
    // A restart sees the new instance: hardware state lives in the state dir.
    drop(node);
    let node = node_at(dir.path(), Duration::from_secs(60));
    assert!(node.inventory().gpus.iter().flat_map(|g| &g.instances).any(|i| i.uuid == uuid));
}

#[test]
fn rising_ecc_errors_quarantine_a_gpu_and_its_instances_even_in_use() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut node = node_with(dir.path(), Duration::from_secs(60), false);
    let mig_gpu = node.inventory().gpus.iter().find(|g| g.mig_enabled).expect("mig gpu").clone();
    let a = node
        .allocate(&req("busy", "team-dev", &format!("mig={}", mig_gpu.instances[0].profile)))
        .expect("grant");
    assert_eq!(a.devices[0].gpu_uuid, mig_gpu.uuid);
    let ecc = dir.path().join("sim/ecc");
    std::fs::create_dir_all(&ecc).expect("ecc dir");
    std::fs::write(ecc.join(&mig_gpu.uuid), "3").expect("count");
    assert!(node.check_ecc().expect("baseline").is_empty(), "the first reading is the baseline");
    std::fs::write(ecc.join(&mig_gpu.uuid), "5").expect("count");
    assert_eq!(node.check_ecc().expect("check"), std::slice::from_ref(&mig_gpu.uuid));
    let st = node.status().expect("status");
    let g = st.gpus.iter().find(|g| g.uuid == mig_gpu.uuid).expect("gpu");
    assert!(
        g.instances.iter().all(|i| i.state == tessera_api::DeviceState::Quarantined),
        "{:?}",
        g.instances
    );
    assert!(g.instances[0].lifecycle.as_ref().is_some_and(|l| l.detail.contains("ECC")));
    // The container keeps its instance; released, the instance stays quarantined (not dirty).
    node.release("busy", "poststop").expect("release");
    let st = node.status().expect("status");
    let i = st.gpus.iter().find(|g| g.uuid == mig_gpu.uuid).expect("gpu").instances[0].clone();
    assert_eq!(i.state, tessera_api::DeviceState::Quarantined);
    let e = node.allocate(&req("next", "team-dev", &format!("mig={}", i.profile)));
    assert!(
        e.map(|a| a.devices[0].uuid != i.uuid).unwrap_or(true),
        "a quarantined instance was handed out"
    );
    assert!(node.check_ecc().expect("again").is_empty(), "no new errors: nothing new");
}

#[test]
fn ecc_errors_counted_while_no_daemon_watched_are_caught_at_the_next_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ecc = dir.path().join("sim/ecc");
    let gpu = {
        let mut node = node_with(dir.path(), Duration::from_secs(60), false);
        let gpu = node.inventory().gpus.iter().find(|g| !g.mig_enabled).expect("whole gpu").clone();
        std::fs::create_dir_all(&ecc).expect("ecc dir");
        std::fs::write(ecc.join(&gpu.uuid), "2").expect("count");
        assert!(
            node.check_ecc().expect("baseline").is_empty(),
            "the first reading is the baseline"
        );
        gpu
    };
    // tesserad is gone; the GPU counts two more uncorrectable errors.
    std::fs::write(ecc.join(&gpu.uuid), "4").expect("count");
    let mut node = node_with(dir.path(), Duration::from_secs(60), false);
    assert_eq!(
        node.check_ecc().expect("check"),
        std::slice::from_ref(&gpu.uuid),
        "the rise was missed"
    );
    let st = node.status().expect("status");
    assert_eq!(
        st.gpus.iter().find(|g| g.uuid == gpu.uuid).expect("gpu").state,
        tessera_api::DeviceState::Quarantined
    );
    drop(node);

    // A driver reload resets the volatile counter: a lower count is the new baseline,
    // and only a rise above it counts.
    std::fs::write(ecc.join(&gpu.uuid), "0").expect("count");
    let mut node = node_with(dir.path(), Duration::from_secs(60), false);
    assert!(node.check_ecc().expect("reset").is_empty());
    drop(node);
    std::fs::write(ecc.join(&gpu.uuid), "1").expect("count");
    let mut node = node_with(dir.path(), Duration::from_secs(60), false);
    assert_eq!(node.check_ecc().expect("rise after reset"), std::slice::from_ref(&gpu.uuid));
}

fn device_state(node: &Node, uuid: &str) -> tessera_api::DeviceState {
    let st = node.status().expect("status");
    st.gpus
        .iter()
        .find(|g| g.uuid == uuid)
        .map(|g| g.state)
        .or_else(|| {
            st.gpus.iter().flat_map(|g| &g.instances).find(|i| i.uuid == uuid).map(|i| i.state)
        })
        .expect("device in status")
}

/// Issue 12: a device dirty from tenant A goes back to A without a scrub
/// (`same_tenant_skip`) only together with A's grant — a grant that fails between its plan
/// and its commit leaves the device dirty, never free for the next tenant.
#[test]
fn a_grant_failing_before_its_commit_leaves_a_same_tenant_dirty_device_dirty() {
    use tesserad::node::{FailAction, GrantFailpoint};
    let dir = tempfile::tempdir().expect("tempdir");
    let grace = Duration::from_secs(60);
    let open =
        || node_under(dir.path(), grace, false, Arc::new(LinuxHost), same_tenant_skip_policy());
    let mut node = open();
    let whole = node.inventory().gpus.iter().filter(|g| !g.mig_enabled).count();
    for i in 0..whole {
        node.allocate(&req(&format!("a{i}"), "team-trusted", "gpu=1")).expect("whole gpu");
    }
    let a0 = node.allocation("a0").expect("a0").devices[0].uuid.clone();
    node.release("a0", "container removed").expect("release");
    assert_eq!(device_state(&node, &a0), tessera_api::DeviceState::Dirty);

    // A asks again: the plan hands A its own dirty device; the commit fails.
    node.set_failpoint(Some(GrantFailpoint { action: FailAction::Error, container_id: None }));
    let e = node.allocate(&req("again", "team-trusted", "gpu=1")).unwrap_err();
    assert!(e.message().contains("failpoint"), "{e:?}");
    assert!(node.allocation("again").is_err(), "no half grant");
    assert_eq!(device_state(&node, &a0), tessera_api::DeviceState::Dirty);
    node.set_failpoint(None);
    // Another tenant still cannot have it, now or after a restart.
    let e = node.allocate(&req("b", "team-dev", "gpu=1")).unwrap_err();
    assert_eq!(e.code(), ErrorCode::NoCapacity, "{e:?}");
    drop(node);
    let mut node = open();
    assert_eq!(device_state(&node, &a0), tessera_api::DeviceState::Dirty);
    assert_eq!(
        node.allocate(&req("b", "team-dev", "gpu=1")).unwrap_err().code(),
        ErrorCode::NoCapacity
    );

    // Without the fault A gets it back, and it is dirty again when A leaves.
    let g = node.allocate(&req("again", "team-trusted", "gpu=1")).expect("A's own device");
    assert_eq!(g.devices[0].uuid, a0);
    assert_eq!(device_state(&node, &a0), tessera_api::DeviceState::Assigned);
    node.release("again", "container removed").expect("release");
    assert_eq!(device_state(&node, &a0), tessera_api::DeviceState::Dirty);
    assert_eq!(
        node.allocate(&req("b", "team-dev", "gpu=1")).unwrap_err().code(),
        ErrorCode::NoCapacity
    );
}

/// A MIG instance created for a grant whose commit then fails stays on the GPU, idle and
/// never used (so clean), and the next request for its profile gets it.
#[test]
fn an_instance_created_for_a_failed_grant_is_left_idle_and_reused() {
    use tesserad::node::{FailAction, GrantFailpoint};
    let dir = tempfile::tempdir().expect("tempdir");
    let mut node = node_at(dir.path(), Duration::from_secs(60));
    let before: BTreeSet<String> = instance_uuids(&node);
    // Every existing 2g.20gb held: a new one has to be cut.
    let existing_2g = instances_of(&node, "2g.20gb");
    for i in 0..existing_2g {
        node.allocate(&req(&format!("h{i}"), "team-dev", "mig=2g.20gb")).expect("existing 2g");
    }
    node.set_failpoint(Some(GrantFailpoint {
        action: FailAction::Error,
        container_id: Some("m1".into()),
    }));
    let e = node.allocate(&req("m1", "team-dev", "mig=2g.20gb")).unwrap_err();
    assert!(e.message().contains("failpoint"), "{e:?}");
    assert!(node.allocation("m1").is_err(), "no half grant");
    let created: Vec<String> = instance_uuids(&node).difference(&before).cloned().collect();
    assert_eq!(created.len(), 1, "one instance was cut: {created:?}");
    assert_eq!(device_state(&node, &created[0]), tessera_api::DeviceState::Free);
    let g = node.allocate(&req("m2", "team-dev", "mig=2g.20gb")).expect("grant");
    assert_eq!(g.devices[0].uuid, created[0], "the idle instance is reused");
}

/// `req` as containerd's CRI plugin annotates a container of pod `pod` (sandbox `sandbox`).
fn pod_req(
    id: &str,
    sandbox: &str,
    container: Option<&str>,
    request: &str,
    extra: &[(&str, &str)],
) -> AllocateRequest {
    let mut r = req(id, "team-trusted", request);
    let a = &mut r.annotations;
    let kind = if container.is_some() { "container" } else { "sandbox" };
    a.insert("io.kubernetes.cri.container-type".into(), kind.into());
    a.insert("io.kubernetes.cri.sandbox-id".into(), sandbox.into());
    a.insert("io.kubernetes.cri.sandbox-name".into(), "trainer".into());
    if let Some(c) = container {
        a.insert("io.kubernetes.cri.container-name".into(), c.into());
    }
    for (k, v) in extra {
        a.insert((*k).into(), (*v).into());
    }
    r
}

#[test]
fn a_pod_sandbox_never_gets_a_grant_and_the_refusal_names_the_pod() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut node = node_at(dir.path(), Duration::from_secs(60));
    let e = node
        .allocate(&pod_req("sb1", "sb1", None, "gpu=1", &[("tessera.io/gpu", "gpu=1")]))
        .expect_err("a sandbox is refused");
    assert_eq!(e.code(), ErrorCode::BadRequest);
    assert!(e.message().contains("sandbox of pod team-trusted/trainer"), "{}", e.message());
    assert!(node.allocations().unwrap().is_empty());
    let status = node.status().unwrap();
    let ev = status.events.iter().find(|e| e.kind == "refuse").expect("refusal event");
    assert_eq!(ev.workload.as_deref(), Some("team-trusted/trainer"));
}

#[test]
fn the_bare_pod_annotation_serves_one_container_and_refuses_the_second() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut node = node_at(dir.path(), Duration::from_secs(60));
    let bare = [("tessera.io/gpu", "gpu=1")];
    let a = node.allocate(&pod_req("c-main", "sb1", Some("main"), "gpu=1", &bare)).expect("first");
    let w = a.workload.as_ref().expect("workload recorded");
    assert_eq!(w.display_name(), "team-trusted/trainer/main");
    assert_eq!(w.sandbox_id, "sb1");
    // The same container again (a retried create): the same grant.
    node.allocate(&pod_req("c-main", "sb1", Some("main"), "gpu=1", &bare)).expect("retry");
    let e = node
        .allocate(&pod_req("c-side", "sb1", Some("side"), "gpu=1", &bare))
        .expect_err("second container refused");
    assert_eq!(e.code(), ErrorCode::Refused);
    assert_eq!(e.rule(), Some("pod-annotation"));
    assert!(
        e.message().contains("exactly one application container")
            && e.message().contains("`main` and `side`")
            && e.message().contains("tessera.io/gpu.<container-name>"),
        "{}",
        e.message()
    );
    // The owner's grant gone (an init container that exited): the pod's other containers
    // still may not take the bare form.
    assert!(node.release("c-main", "test").expect("release"));
    let e = node
        .allocate(&pod_req("c-side2", "sb1", Some("side"), "gpu=1", &bare))
        .expect_err("still refused once the first container is gone");
    assert_eq!(e.rule(), Some("pod-annotation"));
    // The owner itself, restarted (a new container id, the same name), may.
    node.allocate(&pod_req("c-main2", "sb1", Some("main"), "gpu=1", &bare)).expect("restart");
    // Another pod (another sandbox) with the bare form is its own pod.
    node.allocate(&pod_req("c-other", "sb2", Some("main"), "gpu=1", &bare)).expect("other pod");
    // Per-container annotations: one grant per asking container of the same pod.
    let per = [("tessera.io/gpu.a", "gpu=1"), ("tessera.io/gpu.b", "gpu=1")];
    node.allocate(&pod_req("c-a", "sb3", Some("a"), "gpu=1", &per)).expect("a");
    node.allocate(&pod_req("c-b", "sb3", Some("b"), "gpu=1", &per)).expect("b");
    let status = node.status().unwrap();
    let holders: BTreeSet<String> =
        status.gpus.iter().filter_map(|g| g.holder.as_ref()?.workload.clone()).collect();
    assert!(
        holders.contains("team-trusted/trainer/a") && holders.contains("team-trusted/trainer/b"),
        "{holders:?}"
    );
    let refused = status.events.iter().find(|e| e.kind == "refuse").expect("event");
    assert_eq!(refused.workload.as_deref(), Some("team-trusted/trainer/side"));
}

#[test]
fn incomplete_cri_annotations_name_no_pod_but_a_sandbox_is_still_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut node = node_at(dir.path(), Duration::from_secs(60));
    // An earlier wrapper's body, or a client's own: served, as a container of no pod (the
    // runtime refuses such a config before it asks; see runtime-hook's request tests).
    let mut r = pod_req("c1", "sb1", Some("main"), "gpu=1", &[("tessera.io/gpu.main", "gpu=1")]);
    r.annotations.insert("io.kubernetes.cri.container-type".into(), "pause".into());
    let a = node.allocate(&r).expect("served");
    assert_eq!(a.workload, None);
    let mut r = pod_req("c2", "sb1", Some("main"), "gpu=1", &[]);
    r.annotations.remove("io.kubernetes.cri.sandbox-id");
    assert_eq!(node.allocate(&r).expect("served").workload, None);
    // A sandbox, complete or not, never.
    let mut r = pod_req("c3", "sb1", None, "gpu=1", &[]);
    r.annotations.remove("io.kubernetes.cri.sandbox-name");
    let e = node.allocate(&r).expect_err("a sandbox is refused");
    assert_eq!(e.code(), ErrorCode::BadRequest);
    assert!(e.message().contains("never takes a GPU"), "{}", e.message());
    assert_eq!(node.allocations().unwrap().len(), 2);
}

/// A pod container's request carrying kubelet's assignment annotation `annotation`.
fn kubelet_req(
    id: &str,
    pod: &str,
    container: &str,
    request: &str,
    annotation: &str,
) -> AllocateRequest {
    let key = tessera_api::deviceplugin::ASSIGNMENT_ANNOTATION;
    let mut r = pod_req(id, &format!("sb-{pod}"), Some(container), request, &[(key, annotation)]);
    r.annotations.insert("io.kubernetes.cri.sandbox-name".into(), pod.into());
    r
}

fn assignments_file(state: &Path) -> String {
    std::fs::read_to_string(state.join(tesserad::node::ASSIGNMENTS_FILE)).unwrap_or_default()
}

fn issue(node: &Node, text: &str) -> String {
    let a: tessera_api::deviceplugin::PluginAssignment = text.parse().expect("assignment");
    let issued = node.issue_assignments(std::slice::from_ref(&a)).expect("issued");
    assert_eq!(issued.len(), 1);
    issued[0].to_string()
}

#[test]
fn a_kubelet_assignment_is_honoured_only_with_a_token_this_node_issued_and_only_for_its_pod() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut node = node_at(dir.path(), Duration::from_secs(60));
    let gpus: Vec<String> =
        node.inventory().gpus.iter().filter(|g| !g.mig_enabled).map(|g| g.uuid.clone()).collect();
    let (g1, g2) = (&gpus[0], &gpus[1]);
    let refused = |node: &mut Node, r: &AllocateRequest, want: &str| {
        let e = node.allocate(r).expect_err(want);
        assert_eq!(e.code(), ErrorCode::BadRequest, "{want}: {e:?}");
        assert_eq!(e.rule(), Some("tessera.io/device-plugin"), "{want}: {e:?}");
        assert!(
            e.message().contains("annotation tessera.io/device-plugin")
                && e.message().contains(want),
            "{want}: {}",
            e.message()
        );
    };
    // Forged: an assignment without a token, and one with a token nobody issued.
    refused(
        &mut node,
        &kubelet_req("f1", "p1", "main", "gpu=1", &format!("v1;tessera.io/gpu;{g1}")),
        "carries no token",
    );
    let forged = format!("v2;tessera.io/gpu;{g1};0123456789abcdef0123456789abcdef");
    refused(
        &mut node,
        &kubelet_req("f2", "p1", "main", "gpu=1", &forged),
        "not issued by this node",
    );
    // A token issued for GPU 1, presented for GPU 2 (or for both).
    let issued = issue(&node, &format!("v1;tessera.io/gpu;{g1}"));
    let token = issued.rsplit(';').next().unwrap().to_string();
    let moved = format!("v2;tessera.io/gpu;{g2};{token}");
    refused(&mut node, &kubelet_req("f3", "p1", "main", "gpu=1", &moved), "was issued for");
    // The genuine one, for a container of no pod: refused.
    let mut plain = req("f4", "team-trusted", "gpu=1");
    plain.annotations.insert("tessera.io/device-plugin".into(), issued.clone());
    refused(&mut node, &plain, "no pod container's CRI annotations");
    assert!(node.allocations().unwrap().is_empty(), "nothing forged was granted");
    assert_eq!(assignments_file(dir.path()), "", "nothing forged was recorded");
    let events = node.status().unwrap().events;
    assert_eq!(events.iter().filter(|e| e.kind == "refuse").count(), 4, "{events:?}");

    // The tokens are root's alone.
    use std::os::unix::fs::PermissionsExt as _;
    let tokens = std::fs::metadata(dir.path().join(tesserad::node::TOKENS_FILE)).unwrap();
    assert_eq!(tokens.permissions().mode() & 0o777, 0o600);
    // The genuine one survives a restart between Allocate and create, and is granted.
    drop(node);
    let mut node = node_at(dir.path(), Duration::from_secs(60));
    let a = node.allocate(&kubelet_req("k1", "p1", "main", "gpu=1", &issued)).expect("genuine");
    assert_eq!(a.devices[0].uuid, *g1);
    assert!(assignments_file(dir.path()).contains("\"k1\""), "{}", assignments_file(dir.path()));
    // Replayed: by another pod, by another container of the pod, by the same pod container
    // while its grant lives.
    refused(
        &mut node,
        &kubelet_req("r1", "p2", "main", "gpu=1", &issued),
        "was used by pod container team-trusted/p1/main",
    );
    refused(
        &mut node,
        &kubelet_req("r2", "p1", "side", "gpu=1", &issued),
        "was used by pod container",
    );
    let e = node.allocate(&kubelet_req("r3", "p1", "main", "gpu=1", &issued)).expect_err("held");
    assert!(e.message().contains("is held by container k1's grant"), "{}", e.message());
    assert!(!assignments_file(dir.path()).contains("\"r"), "{}", assignments_file(dir.path()));
    // A retried create of k1 gets its grant; once it is gone, kubelet's restart of the
    // same pod container (a new id, the same annotation) is served.
    node.allocate(&kubelet_req("k1", "p1", "main", "gpu=1", &issued)).expect("idempotent");
    assert!(node.release("k1", "test").expect("release"));
    let a = node.allocate(&kubelet_req("k2", "p1", "main", "gpu=1", &issued));
    // GPU 1 is dirty after k1 (no scrub binary here): the token passed, the device did not.
    let e = a.expect_err("dirty");
    assert_eq!(e.code(), ErrorCode::NoCapacity, "{e:?}");
    assert!(e.message().contains(g1.as_str()), "{}", e.message());
}

#[test]
fn a_kubelet_placement_never_destroys_an_idle_instance_a_plain_request_would_leave() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut node = node_at(dir.path(), Duration::from_secs(60));
    // GPU 0 holds an idle 3g.40gb at slot 0; idle 1g.10gb instances exist elsewhere.
    let g0 = node.inventory().gpus[0].clone();
    let three = g0.instances.iter().find(|i| i.profile == "3g.40gb" && i.start == 0).unwrap();
    let three = three.uuid.clone();
    let placement = format!("v1;tessera.io/mig-1g.10gb;{}:mig:1g.10gb:0", g0.uuid);
    let issued = issue(&node, &placement);
    let e = node
        .allocate(&kubelet_req("k1", "p1", "main", "mig=1g.10gb", &issued))
        .expect_err("a plain mig=1g.10gb reuses a free instance instead");
    assert_eq!(e.code(), ErrorCode::NoCapacity, "{e:?}");
    assert!(
        e.message().contains(&format!("would destroy idle instance {three}"))
            && e.message().contains("a plain mig=1g.10gb request would reuse free instance"),
        "{}",
        e.message()
    );
    assert!(instance_uuids(&node).contains(&three), "the idle 3g.40gb was destroyed");
    assert_eq!(assignments_file(dir.path()), "");
    // Take every free 1g.10gb and the free slot a plain request would cut one on: now a
    // plain request would destroy idle instances too, and kubelet's placement is cut.
    let mut n = 0;
    while slicer::place(
        node.inventory(),
        &node
            .allocations()
            .unwrap()
            .iter()
            .flat_map(|a| a.devices.iter().map(|d| d.uuid.to_string()))
            .collect(),
        "1g.10gb",
        slicer::Strategy::FirstFit,
        &slicer::DemandMix::from_weights(std::iter::empty::<(String, f64)>(), 1.0),
    )
    .is_ok_and(|d| !matches!(d, slicer::PlaceDecision::Defragment { .. }))
    {
        node.allocate(&req(&format!("h{n}"), "team-dev", "mig=1g.10gb")).expect("plain 1g");
        n += 1;
        assert!(n < 32, "runaway");
    }
    assert!(n >= 10, "{n} plain 1g.10gb grants");
    let a = node.allocate(&kubelet_req("k1", "p1", "main", "mig=1g.10gb", &issued)).expect("cut");
    assert_eq!(a.devices[0].placement, Some((0, 1)));
    assert!(!instance_uuids(&node).contains(&three), "destroyed for it, as a plain request would");
}

/// Issue 26: an XID quarantines exactly what it reached — a contained ECC error (XID 94)
/// the MIG instance it names, an uncontained one (XID 95) the GPU and all its instances,
/// an instance the inventory lacks the whole GPU (fail closed), an application XID
/// nothing — holders are told, no grant lands there, and only a passing health check lets
/// an unquarantine re-scrub it.
#[test]
fn an_xid_quarantines_exactly_what_it_reached() {
    use tessera_api::DeviceState::{Free, Quarantined};
    let dir = tempfile::tempdir().expect("tempdir");
    let mut node = node_with(dir.path(), Duration::from_secs(60), false);
    let gpu = node.inventory().gpus.iter().find(|g| g.mig_enabled).expect("mig gpu").clone();
    let target = gpu.instances[1].clone();
    let held = node.allocate(&req("held", "team-dev", &format!("mig={}", target.profile))).unwrap();
    assert_eq!(held.devices[0].uuid, target.uuid, "the lowest instance of its profile");
    let xid = |xid, gi: Option<u32>| slicer::XidEvent {
        gpu_uuid: gpu.uuid.clone(),
        xid,
        gi_id: gi,
        ci_id: gi.map(|_| 0),
    };

    // An application fault: told, nothing quarantined.
    slicer::sim::inject_xid(dir.path(), &xid(43, Some(target.gi_id))).unwrap();
    assert!(node.check_faults().unwrap().quarantined.is_empty());
    assert_eq!(device_state(&node, &target.uuid), tessera_api::DeviceState::Assigned);

    // XID 94 on the held instance: exactly it.
    slicer::sim::inject_xid(dir.path(), &xid(94, Some(target.gi_id))).unwrap();
    let report = node.check_faults().unwrap();
    assert_eq!(report.quarantined, std::slice::from_ref(&target.uuid));
    assert!(report.stop.is_empty(), "faults.stop_holders is off: told, not stopped");
    for i in &gpu.instances {
        let want = if i.uuid == target.uuid { Quarantined } else { Free };
        assert_eq!(device_state(&node, &i.uuid), want, "{} ({})", i.uuid, i.profile);
    }
    let st = node.status().unwrap();
    let told = st
        .events
        .iter()
        .find(|e| e.kind == "xid" && e.container_id.as_deref() == Some("held"))
        .expect("the holder is told");
    assert!(told.detail.contains("XID 94") && told.detail.contains("quarantined"), "{told:?}");
    // Released, it stays quarantined; a request for its profile lands elsewhere or nowhere.
    node.release("held", "test").unwrap();
    assert_eq!(device_state(&node, &target.uuid), Quarantined);
    if let Ok(a) = node.allocate(&req("next", "team-dev", &format!("mig={}", target.profile))) {
        assert_ne!(a.devices[0].uuid, target.uuid, "a grant landed on a quarantined instance");
    }

    // An instance the node does not have: fail closed, the whole GPU.
    slicer::sim::inject_xid(dir.path(), &xid(94, Some(13))).unwrap();
    let report = node.check_faults().unwrap();
    let whole: BTreeSet<String> = std::iter::once(gpu.uuid.clone())
        .chain(gpu.instances.iter().map(|i| i.uuid.clone()))
        .collect();
    assert_eq!(report.quarantined.iter().cloned().collect::<BTreeSet<_>>(), whole);
    for i in &gpu.instances {
        assert_eq!(device_state(&node, &i.uuid), Quarantined, "{}", i.uuid);
    }

    // The health check gates the unquarantine; a healthy device is re-scrubbed.
    slicer::sim::set_health(dir.path(), &gpu.uuid, Some("rows pending remapping")).unwrap();
    let e = node.unquarantine(&target.uuid).expect_err("unhealthy GPU");
    assert_eq!(e.code(), ErrorCode::Conflict);
    assert!(e.message().contains("rows pending remapping"), "{}", e.message());
    assert_eq!(device_state(&node, &target.uuid), Quarantined);
    slicer::sim::set_health(dir.path(), &gpu.uuid, None).unwrap();
    let job = node.unquarantine(&target.uuid).expect("healthy: re-scrubbed");
    assert_eq!(job.device, target.uuid);
    assert_eq!(device_state(&node, &target.uuid), tessera_api::DeviceState::Scrubbing);
}

/// A node under the test policy with `faults.stop_holders` (a grace of 1 s).
fn node_stopping_holders(dir: &std::path::Path, host: &FakeHost) -> Node {
    let mut v: serde_json::Value = serde_json::from_slice(POLICY).expect("json");
    v["faults"] = serde_json::json!({"stop_holders": true, "grace_s": 1});
    let policy = policy::Policy::parse(&serde_json::to_vec(&v).unwrap(), "faults.json").unwrap();
    node_under(dir, Duration::from_secs(60), false, host.paths(), policy)
}

/// An uncontained XID (95) on whole GPU `gpu` of the simulated node under `dir`.
fn uncontained_xid(dir: &std::path::Path, gpu: &impl std::fmt::Display) {
    let event = slicer::XidEvent { gpu_uuid: gpu.to_string(), xid: 95, gi_id: None, ci_id: None };
    slicer::sim::inject_xid(dir, &event).unwrap();
}

/// Issue 26: XID 95 (uncontained) on a whole GPU takes it; with `faults.stop_holders` its
/// running holder is a stop target.
#[test]
fn an_uncontained_xid_takes_the_whole_gpu_and_the_policy_may_stop_its_holders() {
    let dir = tempfile::tempdir().expect("tempdir");
    let host = FakeHost::new();
    let mut node = node_stopping_holders(dir.path(), &host);
    let a = node.allocate(&req("w", "team-dev", "gpu=1")).unwrap();
    let gpu = a.devices[0].uuid.clone();
    host.process(4242, "w");
    node.start(
        &"w".parse().expect("valid"),
        &StartRequest { pid: 4242, bundle: "/bundles/w".into(), created: false },
    )
    .unwrap();
    uncontained_xid(dir.path(), &gpu);
    let report = node.check_faults().unwrap();
    assert_eq!(report.quarantined, std::slice::from_ref(&gpu));
    assert_eq!(report.grace, Duration::from_secs(1));
    assert_eq!(
        report.stop.iter().map(|t| t.refused.container_id.as_str()).collect::<Vec<_>>(),
        ["w"]
    );
    assert_eq!(report.stop[0].refused.rule, "faults.stop_holders");
    assert_eq!(device_state(&node, &gpu), tessera_api::DeviceState::Quarantined);
}

/// Issue 26: the class annotation is exactly `latency` or `batch`; anything else is
/// refused naming the annotation, its value escaped and cut; a latency container gets its
/// own report file.
#[test]
fn a_hostile_class_annotation_is_refused_and_a_latency_container_gets_its_report_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut node = node_at(dir.path(), Duration::from_secs(60));
    for bad in ["latency\n[fake] granted", "Latency", &"x".repeat(10_000)] {
        let mut r = req("c1", "team-trusted", "gpu=1");
        r.annotations.insert("tessera.io/class".into(), bad.to_string());
        let e = node.allocate(&r).expect_err("refused");
        assert_eq!(e.code(), ErrorCode::BadRequest, "{e:?}");
        assert!(e.message().contains("tessera.io/class"), "{}", e.message());
        assert!(!e.message().contains('\n') && e.message().len() < 400, "{}", e.message());
        assert_eq!(e.rule(), Some("interference.classes"));
    }
    let mut r = req("c1", "team-trusted", "gpu=1");
    r.annotations.insert("tessera.io/class".into(), "latency".into());
    let a = node.allocate(&r).expect("granted");
    assert_eq!(a.class, Some(tessera_api::WorkloadClass::Latency));
    let m = a
        .injection
        .mounts
        .iter()
        .find(|m| m.destination == "/run/tessera/latency_ms")
        .expect("mount");
    assert!(!m.read_only);
    let meta = std::fs::symlink_metadata(&m.source).expect("report file");
    assert!(meta.is_file());
    assert!(a.injection.env.contains(&"TESSERA_LATENCY_FILE=/run/tessera/latency_ms".to_string()));
    node.release("c1", "test").expect("release");
    assert!(!std::path::Path::new(&m.source).exists(), "the report goes with the grant");
    let b = node.allocate(&req("c2", "team-trusted", "gpu=1")).expect("granted");
    assert_eq!(b.class, Some(tessera_api::WorkloadClass::Batch), "undeclared: batch");
    assert!(b.injection.mounts.iter().all(|m| m.destination != "/run/tessera/latency_ms"));
}

/// A pidfd of `child` (what tesserad keeps of the process that asked for a grant).
fn pidfd_of(child: &std::process::Child) -> std::os::fd::OwnedFd {
    use std::os::fd::FromRawFd;
    // SAFETY: pidfd_open(pid, 0) takes two integers and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, child.id() as libc::pid_t, 0) };
    assert!(fd >= 0, "pidfd_open: {}", std::io::Error::last_os_error());
    // SAFETY: the descriptor is new and ours alone.
    unsafe { std::os::fd::OwnedFd::from_raw_fd(fd as i32) }
}

/// Issue 29: a create of an id already granted is answered the same grant, and its
/// requester is watched under a second hold of the node lock. In between, the grant can
/// end (its earlier requester exited with no container): the answer is then refused, not
/// handed out with devices no longer granted to a create tesserad no longer watches.
#[test]
fn a_grant_that_ended_before_its_new_requester_was_watched_is_not_handed_out() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut node = node_at(dir.path(), Duration::from_secs(600));
    node.watch_requesters(tesserad::requesters::Requesters::new().expect("epoll"));
    let first = node.allocate(&req("again", "team-trusted", "gpu=1")).expect("granted");
    let mut gone = std::process::Command::new("true").spawn().expect("true");
    node.watch_requester(&first, pidfd_of(&gone)).expect("the first requester is watched");
    let again = node.allocate(&req("again", "team-trusted", "gpu=1")).expect("the same grant");
    assert_eq!(again.created_ms, first.created_ms);
    // Before the second requester is watched, the first exits, runc having made nothing.
    gone.wait().expect("exits");
    assert_eq!(node.settle_removed().expect("settled"), ["again"]);
    let mut second = std::process::Command::new("sleep").arg("30").spawn().expect("sleep");
    let watched = node.watch_requester(&again, pidfd_of(&second));
    let _ = second.kill();
    let _ = second.wait();
    let e = watched.expect_err("the answer of a grant that ended was handed out");
    assert_eq!(e.code(), ErrorCode::Conflict, "{e:?}");
    assert!(e.message().contains("its grant ended while it was being answered"), "{e:?}");
    assert!(node.allocations().expect("grants").is_empty(), "nothing is granted");
}

/// Issue 29 review: a created container waits for its start with its grant pending. An
/// uncontained XID on its GPU then quarantines the GPU, but `faults.stop_holders` stops
/// only holders with a process; the pending one must not start on the quarantined GPU.
#[test]
fn a_pending_grant_on_a_gpu_quarantined_since_does_not_start_where_holders_are_stopped() {
    let dir = tempfile::tempdir().expect("tempdir");
    let host = FakeHost::new();
    let mut node = node_stopping_holders(dir.path(), &host);
    let a = node.allocate(&req("p", "team-dev", "gpu=1")).unwrap();
    let gpu = a.devices[0].uuid.clone();
    uncontained_xid(dir.path(), &gpu);
    let report = node.check_faults().unwrap();
    assert_eq!(report.quarantined, std::slice::from_ref(&gpu));
    assert!(report.stop.is_empty(), "a pending grant has no process to stop: {:?}", report.stop);
    host.process(4343, "p");
    let e = node
        .start(
            &"p".parse().expect("valid"),
            &StartRequest { pid: 4343, bundle: "/bundles/p".into(), created: true },
        )
        .expect_err("a pending grant started on a quarantined GPU");
    assert_eq!(e.code(), ErrorCode::Refused, "{e:?}");
    assert!(e.message().contains("was quarantined after a fault"), "{e:?}");
    let held = node.allocations().unwrap();
    assert_eq!(held[0].state, tessera_api::AllocationState::Pending, "not started");
}
