//! Issue 13, capacity the scheduler can see: tesserad's kubelet device plugin against a
//! kubelet stand-in that speaks the real protobuf API (k8s.io/kubelet's
//! deviceplugin/v1beta1: a `Registration` server on a temp `kubelet.sock`, `ListAndWatch`,
//! `GetPreferredAllocation` and `Allocate` on the plugin's sockets), a real tesserad on a
//! simulated node (one H100 in MIG mode, three whole) and real runc containers under
//! tessera-runtime.
//!
//! Issue 23, kubelet's word only from kubelet: the containers that carry kubelet's
//! assignment are created as containerd's CRI plugin creates them for kubelet (the
//! runtime configuration `tessera setup containerd` writes beside the handler's link,
//! `kubelet = true`, and containerd's `io.kubernetes.cri.*` annotations); the same
//! annotation written by a plain config author, forged or replayed, is refused.

// Integration-test crates: clippy counts their helper functions as non-test code, so
// `allow-unwrap-in-tests` (clippy.toml) does not reach them; a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use device_plugin::authority::Rewriter;
use device_plugin::server::socket_name;
use device_plugin::v1beta1 as api;
use tessera_api::deviceplugin::ASSIGNMENT_ANNOTATION;
use tessera_harness::node::*;
use tessera_harness::*;
use tokio::runtime::Runtime;
use tokio::sync::watch;

const GPU: &str = "tessera.io/gpu";
const MPS: &str = "tessera.io/mps";
const SHARED: &str = "tessera.io/shared";
const MIG_1G: &str = "tessera.io/mig-1g.10gb";
const MIG_3G: &str = "tessera.io/mig-3g.40gb";
const MIG_4G: &str = "tessera.io/mig-4g.40gb";
const MIG_7G: &str = "tessera.io/mig-7g.80gb";

/// Every resource an H100 node offers under the example policy (all four kinds allowed
/// to some tier; the H100's seven MIG profiles).
const RESOURCES: [&str; 10] = [
    GPU,
    MPS,
    SHARED,
    MIG_1G,
    "tessera.io/mig-1g.10gb-me",
    "tessera.io/mig-1g.20gb",
    "tessera.io/mig-2g.20gb",
    MIG_3G,
    MIG_4G,
    MIG_7G,
];

/// What every kubelet before 1.26 sends as `:authority` to a plugin: the socket's path
/// (grpc-go dialing a bare path; kubernetes#112597 made it `localhost` in 1.26).
const KUBELET_AUTHORITY: &[u8] = b"/var/lib/kubelet/device-plugins/tessera-gpu.sock";

fn as_kubelet_before_1_26(name: &[u8], _: &[u8]) -> Option<Vec<u8>> {
    (name == b":authority").then(|| KUBELET_AUTHORITY.to_vec())
}

/// The stand-in's side of a plugin connection, as a kubelet of 1.20 writes it: the
/// request headers re-encoded with the socket's path as `:authority`.
struct AsOldKubelet {
    inner: tokio::net::UnixStream,
    rewriter: Rewriter,
    sent: usize,
}

impl AsOldKubelet {
    fn drain(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<()>> {
        use tokio::io::AsyncWrite;
        while self.sent < self.rewriter.output().len() {
            let out = &self.rewriter.output()[self.sent..];
            match std::pin::Pin::new(&mut self.inner).poll_write(cx, out) {
                std::task::Poll::Ready(Ok(n)) => self.sent += n,
                std::task::Poll::Ready(Err(e)) => return std::task::Poll::Ready(Err(e)),
                std::task::Poll::Pending => return std::task::Poll::Pending,
            }
        }
        self.rewriter.output().clear();
        self.sent = 0;
        std::task::Poll::Ready(Ok(()))
    }
}

impl tokio::io::AsyncRead for AsOldKubelet {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for AsOldKubelet {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        if self.drain(cx)?.is_pending() {
            return std::task::Poll::Pending;
        }
        self.rewriter.feed(buf)?;
        std::task::Poll::Ready(Ok(buf.len()))
    }
    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.drain(cx)?.is_pending() {
            return std::task::Poll::Pending;
        }
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if self.drain(cx)?.is_pending() {
            return std::task::Poll::Pending;
        }
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A gRPC channel to a plugin socket as kubelet 1.20 opens it (see [`AsOldKubelet`]).
async fn connect_as_kubelet(
    path: &Path,
) -> Result<tonic::transport::Channel, tonic::transport::Error> {
    let p = path.to_path_buf();
    tonic::transport::Endpoint::from_static("http://localhost")
        .connect_timeout(Duration::from_secs(5))
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let p = p.clone();
            async move {
                let inner = tokio::net::UnixStream::connect(p).await?;
                let s = AsOldKubelet {
                    inner,
                    rewriter: Rewriter::new(as_kubelet_before_1_26),
                    sent: 0,
                };
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
            }
        }))
        .await
}

/// kubelet's registration service: records every request.
#[derive(Debug, Clone, Default)]
struct Registrations(Arc<Mutex<Vec<api::RegisterRequest>>>);

#[tonic::async_trait]
impl api::registration_server::Registration for Registrations {
    async fn register(
        &self,
        request: tonic::Request<api::RegisterRequest>,
    ) -> Result<tonic::Response<api::Empty>, tonic::Status> {
        self.0.lock().unwrap().push(request.into_inner());
        Ok(tonic::Response::new(api::Empty {}))
    }
}

/// A kubelet stand-in on `<dir>/kubelet.sock`.
struct Kubelet {
    registrations: Registrations,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Kubelet {
    fn start(rt: &Runtime, dir: &Path) -> Kubelet {
        let sock = dir.join("kubelet.sock");
        let _ = std::fs::remove_file(&sock);
        let listener = {
            let _in = rt.enter();
            tokio::net::UnixListener::bind(&sock).unwrap()
        };
        let registrations = Registrations::default();
        let (stop, mut stopped) = watch::channel(false);
        let service = api::registration_server::RegistrationServer::new(registrations.clone());
        let task = rt.spawn(async move {
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::UnixListenerStream::new(listener),
                    async move {
                        let _ = stopped.wait_for(|s| *s).await;
                    },
                )
                .await
                .unwrap();
        });
        Kubelet { registrations, stop, task }
    }

    /// Resource name -> how many times it registered.
    fn registered(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for r in self.registrations.0.lock().unwrap().iter() {
            *m.entry(r.resource_name.clone()).or_default() += 1;
        }
        m
    }

    fn stop(self, rt: &Runtime) {
        let _ = self.stop.send(true);
        self.task.abort();
        let _ = rt.block_on(self.task);
    }
}

/// The last list each watched resource sent: id -> health.
type Lists = Arc<Mutex<BTreeMap<String, BTreeMap<String, String>>>>;

/// Follows `ListAndWatch` of `resource` as kubelet does, connecting again whenever the
/// stream ends (tesserad restarted, the endpoint was started again).
fn watch_lists(rt: &Runtime, dir: &Path, resource: &str, lists: &Lists) {
    let (sock, resource, lists) =
        (dir.join(socket_name(resource)), resource.to_string(), lists.clone());
    rt.spawn(async move {
        loop {
            if let Ok(channel) = connect_as_kubelet(&sock).await {
                let mut client = api::device_plugin_client::DevicePluginClient::new(channel);
                if let Ok(stream) = client.list_and_watch(api::Empty {}).await {
                    let mut stream = stream.into_inner();
                    while let Ok(Some(msg)) = stream.message().await {
                        let list = msg.devices.into_iter().map(|d| (d.id, d.health)).collect();
                        lists.lock().unwrap().insert(resource.clone(), list);
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
}

/// Healthy ids of `resource` in the last list, or None before the first.
fn healthy(lists: &Lists, resource: &str) -> Option<BTreeSet<String>> {
    lists.lock().unwrap().get(resource).map(|l| {
        l.iter().filter(|(_, h)| h.as_str() == "Healthy").map(|(id, _)| id.clone()).collect()
    })
}

fn listed(lists: &Lists, resource: &str) -> BTreeSet<String> {
    lists.lock().unwrap().get(resource).map(|l| l.keys().cloned().collect()).unwrap_or_default()
}

/// Waits until `cond` holds of the lists; panics with them otherwise. Prints how long
/// it took (the test's phases, for a slow run).
fn wait_lists(lists: &Lists, what: &str, cond: impl Fn(&Lists) -> bool) {
    let t = std::time::Instant::now();
    let seen = wait_for(|| cond(lists), Duration::from_secs(10));
    eprintln!("{what}: {} ms", t.elapsed().as_millis());
    if !seen {
        let summary: BTreeMap<String, (usize, usize)> = lists
            .lock()
            .unwrap()
            .iter()
            .map(|(r, l)| (r.clone(), (l.len(), l.values().filter(|h| *h == "Healthy").count())))
            .collect();
        panic!("{what}: not seen in 10 s; (listed, healthy) per resource: {summary:?}");
    }
}

fn count(lists: &Lists, resource: &str) -> usize {
    healthy(lists, resource).map_or(usize::MAX, |h| h.len())
}

fn plugin(
    rt: &Runtime,
    dir: &Path,
    resource: &str,
) -> api::device_plugin_client::DevicePluginClient<tonic::transport::Channel> {
    let channel = rt.block_on(connect_as_kubelet(&dir.join(socket_name(resource)))).unwrap();
    api::device_plugin_client::DevicePluginClient::new(channel)
}

/// kubelet's `Allocate` for one container: the annotation, or the refusal's message.
fn allocate(rt: &Runtime, dir: &Path, resource: &str, ids: &[String]) -> Result<String, String> {
    let mut c = plugin(rt, dir, resource);
    let req = api::AllocateRequest {
        container_requests: vec![api::ContainerAllocateRequest { devices_ids: ids.to_vec() }],
    };
    match rt.block_on(c.allocate(req)) {
        Ok(resp) => {
            let resp = resp.into_inner();
            assert_eq!(resp.container_responses.len(), 1);
            let r = &resp.container_responses[0];
            assert!(
                r.devices.is_empty()
                    && r.mounts.is_empty()
                    && r.envs.is_empty()
                    && r.cdi_devices.is_empty(),
                "Allocate hands out no devices, mounts or env: tesserad injects at create: {r:?}"
            );
            assert_eq!(r.annotations.len(), 1, "{r:?}");
            Ok(r.annotations[ASSIGNMENT_ANNOTATION].clone())
        }
        Err(status) => {
            assert_eq!(status.code(), tonic::Code::FailedPrecondition, "{status:?}");
            Err(status.message().to_string())
        }
    }
}

/// tessera-runtime as containerd's CRI handler runs it for kubelet: with the runtime
/// configuration `tessera setup containerd` writes beside the handler's link
/// (`kubelet = true`) when `kubelet`, else as any other engine (no configuration file).
fn runtime_as(node: &mut Node, files: &Path, kubelet: bool) {
    let socket = node.socket.display().to_string();
    let mut env = vec![
        ("TESSERA_RUNC", RUNC),
        ("TESSERA_SOCKET", socket.as_str()),
        ("TESSERA_HOOK", tessera_hook()),
    ];
    let config = files.join("containerd-tessera.toml");
    std::fs::write(&config, "kubelet = true\n").unwrap();
    let config = config.display().to_string();
    if kubelet {
        env.push(("TESSERA_RUNTIME_CONFIG", config.as_str()));
    }
    node.fx.set_runtime(tessera_runtime(), &env);
}

/// A bundle of the tenant behind `ns` as containerd's CRI plugin writes it for container
/// `container` of pod `pod` (its own `io.kubernetes.cri.*` annotations), carrying
/// kubelet's `assignment`.
fn pod_bundle(
    node: &Node,
    id: &str,
    ns: &str,
    pod: &str,
    container: &str,
    assignment: &str,
) -> Bundle {
    let mut b = node.bundle(id, ns, None, &["sleep", "300"]);
    b.annotation(ASSIGNMENT_ANNOTATION, assignment)
        .annotation("io.kubernetes.cri.container-type", "container")
        .annotation("io.kubernetes.cri.container-name", container)
        .annotation("io.kubernetes.cri.sandbox-name", pod)
        .annotation("io.kubernetes.cri.sandbox-id", &format!("sandbox-{pod}"))
        .write();
    b
}

fn create_and_start(node: &Node, b: &Bundle, id: &str) -> std::process::Output {
    let out = node.fx.create_container(b, id);
    if out.status.success() {
        node.fx.start_container(id).assert_success("runc start");
    }
    out
}

/// Container `main` of pod `id` of the tenant behind `ns`, carrying kubelet's
/// `assignment`; create's output.
fn create_assigned(node: &Node, id: &str, ns: &str, assignment: &str) -> std::process::Output {
    create_and_start(node, &pod_bundle(node, id, ns, id, "main", assignment), id)
}

/// `v2;<assignment's resource and ids>;<token>`: what Allocate answers.
fn assert_issued(annotation: &str, assignment: &str) {
    let token = annotation
        .strip_prefix(&format!("v2{}", assignment.strip_prefix("v1").unwrap()))
        .and_then(|t| t.strip_prefix(';'))
        .unwrap_or_else(|| panic!("{annotation} is not {assignment} with a token"));
    assert!(
        token.len() == 32
            && token.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()),
        "token {token:?}"
    );
}

fn node_file(dir: &Path) -> PathBuf {
    let p = dir.join("dp-node.json");
    std::fs::write(
        &p,
        r#"{"node": "sim-dp-0", "gpus": [
            {"model": "H100-80GB", "mig": []},
            {"model": "H100-80GB"}, {"model": "H100-80GB"}, {"model": "H100-80GB"}]}"#,
    )
    .unwrap();
    p
}

#[test]
fn kubelet_sees_what_the_node_can_grant_and_grants_land_on_kubelets_devices() {
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let files = short_tempdir();
    let dir = files.join("dp");
    std::fs::create_dir_all(&dir).unwrap();
    let kubelet = Kubelet::start(&rt, &dir);
    let mut node = Node::start_with(NodeOptions {
        node_file: node_file(&files),
        extra_args: vec![
            "--device-plugin-dir".into(),
            dir.display().to_string(),
            "--mps-control".into(),
            fresh_bin("fake-nvidia-cuda-mps-control").into(),
        ],
        ..Default::default()
    });
    node.fx.cleanup().track_dir(&files);
    runtime_as(&mut node, &files, true);
    let gpus: Vec<String> =
        node.client().status().unwrap().gpus.into_iter().map(|g| g.uuid).collect();
    let (g1, g2, g3) = (gpus[1].clone(), gpus[2].clone(), gpus[3].clone());
    let mig_gpu = gpus[0].clone();

    // Registration: every resource, once, with the API version and its own endpoint.
    assert!(
        wait_for(|| kubelet.registered().len() == RESOURCES.len(), Duration::from_secs(10)),
        "registered: {:?}\n{}",
        kubelet.registered(),
        node.daemon.stderr()
    );
    assert_eq!(
        kubelet.registered().keys().map(String::as_str).collect::<BTreeSet<_>>(),
        RESOURCES.into()
    );
    for r in kubelet.registrations.0.lock().unwrap().iter() {
        assert_eq!(r.version, "v1beta1");
        assert_eq!(r.endpoint, socket_name(&r.resource_name));
        assert!(dir.join(&r.endpoint).exists(), "{} is served", r.endpoint);
        let o = r.options.unwrap();
        assert!(o.get_preferred_allocation_available && !o.pre_start_required);
    }

    let lists: Lists = Arc::default();
    for r in [GPU, MPS, SHARED, MIG_1G, MIG_3G, MIG_4G, MIG_7G] {
        watch_lists(&rt, &dir, r, &lists);
    }
    // Before any grant: three whole GPUs, 300 MPS percent, 3 x 4 replicas, every
    // placement of the empty MIG GPU.
    wait_lists(&lists, "the empty node", |l| {
        count(l, GPU) == 3
            && count(l, MPS) == 300
            && count(l, SHARED) == 12
            && count(l, MIG_1G) == 7
            && count(l, MIG_7G) == 1
    });
    assert_eq!(healthy(&lists, GPU).unwrap(), [g1.clone(), g2.clone(), g3.clone()].into());

    // A grant outside kubelet (an annotation request) takes GPU 1: unhealthy, not gone.
    let b = node.bundle("outside", "team-untrusted", Some("gpu=1"), &["sleep", "300"]);
    node.fx.run_detached(&b, "outside");
    assert_eq!(node.client().allocation("outside").unwrap().devices[0].uuid, g1);
    wait_lists(&lists, "GPU 1 taken outside kubelet", |l| {
        count(l, GPU) == 2 && count(l, MPS) == 200 && count(l, SHARED) == 8
    });
    assert!(listed(&lists, GPU).contains(&g1), "listed unhealthy, kubelet's capacity unchanged");

    // kubelet picks GPU 3 (the node alone would have picked GPU 2): Allocate answers the
    // annotation only, and the grant made with it is on GPU 3.
    let ann = allocate(&rt, &dir, GPU, std::slice::from_ref(&g3)).unwrap();
    assert_issued(&ann, &format!("v1;tessera.io/gpu;{g3}"));
    create_assigned(&node, "kube-gpu", "team-untrusted", &ann).assert_success("create kube-gpu");
    let a = node.client().allocation("kube-gpu").unwrap();
    assert_eq!(a.devices.iter().map(|d| d.uuid.as_str()).collect::<Vec<_>>(), [g3.as_str()]);
    wait_lists(&lists, "GPU 3 kubelet's", |l| {
        healthy(l, GPU).is_some_and(|h| h == [g2.clone(), g3.clone()].into())
            && count(l, MPS) == 100
    });

    // What cannot be one grant, or is not free, is refused at Allocate, naming it.
    let e = allocate(&rt, &dir, GPU, std::slice::from_ref(&g1)).unwrap_err();
    assert!(e.contains(&g1) && e.contains("not free"), "{e}");
    let spread = [format!("{g2}:mps:0"), format!("{g3}:mps:1")];
    let e = allocate(&rt, &dir, MPS, &spread).unwrap_err();
    assert!(e.contains("different GPUs"), "{e}");

    // MPS: the preferred 25 percent stay on one GPU; the grant is that GPU's share.
    let available: Vec<String> = healthy(&lists, MPS).unwrap().into_iter().collect();
    let mut c = plugin(&rt, &dir, MPS);
    let pref = rt
        .block_on(c.get_preferred_allocation(api::PreferredAllocationRequest {
            container_requests: vec![api::ContainerPreferredAllocationRequest {
                available_device_i_ds: available,
                must_include_device_i_ds: Vec::new(),
                allocation_size: 25,
            }],
        }))
        .unwrap()
        .into_inner();
    let ids = pref.container_responses[0].device_i_ds.clone();
    assert_eq!(ids.len(), 25);
    assert!(ids.iter().all(|id| id.starts_with(&format!("{g2}:mps:"))), "{ids:?}");
    let ann = allocate(&rt, &dir, MPS, &ids).unwrap();
    assert_issued(&ann, &format!("v1;tessera.io/mps;{}", ids.join(",")));
    create_assigned(&node, "kube-mps", "team-trusted", &ann).assert_success("create kube-mps");
    let mps_daemons: Vec<u32> =
        node.client().status().unwrap().mps_shares.iter().filter_map(|s| s.pid).collect();
    let _stop_mps = KillOnDrop(mps_daemons);
    let a = node.client().allocation("kube-mps").unwrap();
    let share = a.share.unwrap();
    assert_eq!((share.device.as_str(), share.percent), (g2.as_str(), Some(25)));
    wait_lists(&lists, "GPU 2 serving MPS", |l| {
        count(l, GPU) == 1
            && count(l, SHARED) == 0
            && healthy(l, MPS)
                .is_some_and(|h| h.len() == 100 && ids.iter().all(|id| h.contains(id)))
    });
    // The policy still decides: an untrusted tenant gets no MPS, whatever kubelet assigned.
    let more: Vec<String> = (50..60).map(|u| format!("{g2}:mps:{u}")).collect();
    let ann_untrusted = allocate(&rt, &dir, MPS, &more).unwrap();
    let out = create_assigned(&node, "untrusted-mps", "team-untrusted", &ann_untrusted);
    assert!(!out.status.success());
    assert!(out.stderr_str().contains("tiers.untrusted.allow"), "{}", out.stderr_str());

    // MIG: kubelet's placement is cut exactly there; the placements it consumed are
    // withdrawn from every profile.
    let placement = format!("{mig_gpu}:mig:3g.40gb:4");
    let ann = allocate(&rt, &dir, MIG_3G, std::slice::from_ref(&placement)).unwrap();
    create_assigned(&node, "kube-mig", "team-untrusted", &ann).assert_success("create kube-mig");
    let d = node.client().allocation("kube-mig").unwrap().devices[0].clone();
    assert_eq!((d.mig_profile.as_deref(), d.placement), (Some("3g.40gb"), Some((4, 4))));
    wait_lists(&lists, "the 3g.40gb cut at slot 4", |l| {
        listed(l, MIG_7G).is_empty()
            && listed(l, MIG_1G).len() == 4
            && count(l, MIG_4G) == 1
            && healthy(l, MIG_3G).is_some_and(|h| {
                h == [placement.clone(), format!("{mig_gpu}:mig:3g.40gb:0")].into()
            })
    });

    // tesserad restarts (kill -9): every resource registers again, and kubelet's ids are
    // still kubelet's. The lists are forgotten before the kill (nothing changes on the node
    // now, so nothing more comes from the old daemon): what is seen after is the new one's,
    // however early its first list arrives (ListAndWatch sends a list only when it changes).
    lists.lock().unwrap().clear();
    node.crash_and_restart();
    assert!(
        wait_for(|| kubelet.registered().values().all(|n| *n >= 2), Duration::from_secs(10)),
        "registered after the restart: {:?}",
        kubelet.registered()
    );
    wait_lists(&lists, "the lists after the restart", |l| {
        healthy(l, GPU).is_some_and(|h| h == [g3.clone()].into())
            && healthy(l, MPS)
                .is_some_and(|h| h.len() == 100 && ids.iter().all(|id| h.contains(id)))
            && healthy(l, MIG_3G).is_some_and(|h| h.contains(&placement))
    });

    // kubelet restarts: a new kubelet.sock (and its plugin sockets deleted) -> registered
    // again, endpoints back.
    lists.lock().unwrap().clear();
    kubelet.stop(&rt);
    std::fs::remove_file(dir.join(socket_name(GPU))).unwrap();
    let kubelet = Kubelet::start(&rt, &dir);
    assert!(
        wait_for(|| kubelet.registered().len() == RESOURCES.len(), Duration::from_secs(10)),
        "registered with the new kubelet: {:?}",
        kubelet.registered()
    );
    assert!(dir.join(socket_name(GPU)).exists(), "the deleted endpoint is served again");
    wait_lists(&lists, "the lists from the new endpoints", |l| count(l, GPU) == 1);

    // The MPS container goes: its share is given back, GPU 2 is whole again once scrubbed.
    node.fx.kill_container("kube-mps", "KILL").assert_success("kill");
    assert!(wait_for(
        || node.fx.status("kube-mps").as_deref() == Some("stopped"),
        Duration::from_secs(10)
    ));
    node.fx.delete_container("kube-mps", false).assert_success("delete");
    wait_lists(&lists, "GPU 2 free again", |l| {
        healthy(l, GPU).is_some_and(|h| h.contains(&g2)) && count(l, SHARED) == 4
    });
    // A time-slice replica kubelet picks on GPU 2 is that GPU's.
    let ann = allocate(&rt, &dir, SHARED, &[format!("{g2}:shared:1")]).unwrap();
    create_assigned(&node, "kube-shared", "team-dev", &ann).assert_success("create kube-shared");
    let share = node.client().allocation("kube-shared").unwrap().share.unwrap();
    assert_eq!((share.kind, share.device.as_str()), (tessera_api::Isolation::Shared, g2.as_str()));
    wait_lists(&lists, "GPU 2 time-sliced", |l| {
        healthy(l, GPU).is_some_and(|h| h == [g3.clone()].into()) && count(l, SHARED) == 4
    });
    kubelet.stop(&rt);
}

/// Every MIG instance of the node now.
fn instances(node: &Node) -> BTreeSet<String> {
    let s = node.client().status().unwrap();
    s.gpus.iter().flat_map(|g| g.instances.iter().map(|i| i.uuid.clone())).collect()
}

/// Issue 23, item 4: `tessera.io/device-plugin` written by a config author (plain runc,
/// ctr, podman, a dockerd `--annotation`: any engine but kubelet's) pinned a GPU, destroyed
/// idle MIG instances for the cut it named and was recorded as kubelet's. Now refused by
/// tessera-runtime for where it comes from, by tesserad for its token (forged, or replayed
/// by another pod); nothing recorded, nothing destroyed.
#[test]
fn a_kubelet_assignment_written_by_a_config_author_or_replayed_is_refused_and_changes_nothing() {
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let files = short_tempdir();
    let dir = files.join("dp");
    std::fs::create_dir_all(&dir).unwrap();
    // The example 8×H100 node: GPU 0 in MIG mode with idle instances (3g.40gb at 0,
    // 2g.20gb at 4, 1g.10gb at 6).
    let mut node = Node::start_with(NodeOptions {
        extra_args: vec!["--device-plugin-dir".into(), dir.display().to_string()],
        ..Default::default()
    });
    node.fx.cleanup().track_dir(&files);
    // No kubelet yet: said so. No MPS control daemon here (no --mps-control, none on
    // PATH): no MPS endpoint, while the others are served.
    assert!(
        wait_for(|| dir.join(socket_name(GPU)).exists(), Duration::from_secs(10)),
        "{}",
        node.daemon.stderr()
    );
    assert!(
        wait_for(|| node.daemon.stderr().contains("waiting for kubelet"), Duration::from_secs(10)),
        "{}",
        node.daemon.stderr()
    );
    assert!(!dir.join(socket_name(MPS)).exists(), "MPS offered without a control daemon");
    assert!(
        node.daemon.stderr().contains("tessera.io/mps is not advertised"),
        "{}",
        node.daemon.stderr()
    );
    let status = node.client().status().unwrap();
    let mig0 = status.gpus[0].clone();
    assert!(mig0.mig_enabled && mig0.instances.len() == 3, "{mig0:?}");
    let pinned = status.gpus.iter().rev().find(|g| !g.mig_enabled).unwrap().uuid.clone();
    let before = instances(&node);
    let recorded = node.state.join("device-plugin-assignments.json");
    let forged = [
        ("pin", format!("v1;tessera.io/gpu;{pinned}")),
        ("cut", format!("v1;tessera.io/mig-7g.80gb;{}:mig:7g.80gb:0", mig0.uuid)),
        ("pin-token", format!("v2;tessera.io/gpu;{pinned};0123456789abcdef0123456789abcdef")),
    ];

    // Any engine but kubelet's, with or without CRI annotations of the author's own.
    runtime_as(&mut node, &files, false);
    for (id, text) in &forged {
        let mut plain = node.bundle(id, "team-untrusted", None, &["sleep", "300"]);
        plain.annotation(ASSIGNMENT_ANNOTATION, text).write();
        let in_pod = pod_bundle(&node, &format!("{id}-pod"), "team-untrusted", "p", "main", text);
        for (b, cid) in [(&plain, id.to_string()), (&in_pod, format!("{id}-pod"))] {
            let out = node.fx.create_container(b, &cid);
            let err = out.stderr_str();
            assert!(!out.status.success(), "{cid}: a config author's assignment was honoured");
            assert!(
                err.contains("annotation tessera.io/device-plugin is kubelet's")
                    && err.contains("is not the kubelet engine's"),
                "{cid}: {err}"
            );
        }
    }
    // The kubelet engine itself: tesserad wants a token it issued.
    runtime_as(&mut node, &files, true);
    for ((id, text), why) in forged.iter().zip([
        "carries no token",
        "carries no token",
        "was not issued by this node's device plugin",
    ]) {
        let cid = format!("{id}-kubelet");
        let out = create_assigned(&node, &cid, "team-untrusted", text);
        assert!(!out.status.success(), "{cid}: a forged assignment was honoured");
        assert!(out.stderr_str().contains(why), "{cid}: {}", out.stderr_str());
    }
    assert!(node.grants().is_empty(), "{:?}", node.grants());
    assert_eq!(instances(&node), before, "an idle MIG instance was destroyed");
    assert!(!recorded.exists(), "recorded: {:?}", std::fs::read_to_string(&recorded));

    // kubelet's own: Allocate, then the container; the same annotation in another pod (or
    // in the same pod container while the first holds its grant) is a replay.
    assert!(wait_for(|| dir.join(socket_name(GPU)).exists(), Duration::from_secs(10)));
    let ann = allocate(&rt, &dir, GPU, std::slice::from_ref(&pinned)).unwrap();
    create_assigned(&node, "kube-a", "team-untrusted", &ann).assert_success("kubelet's create");
    assert_eq!(node.client().allocation("kube-a").unwrap().devices[0].uuid, pinned);
    for (cid, pod, why) in [
        ("replay", "other-pod", "was used by pod container team-untrusted/kube-a/main"),
        ("kube-a-again", "kube-a", "is held by container kube-a's grant"),
    ] {
        let out = create_and_start(
            &node,
            &pod_bundle(&node, cid, "team-untrusted", pod, "main", &ann),
            cid,
        );
        assert!(!out.status.success(), "{cid}: a replayed token was honoured");
        assert!(out.stderr_str().contains(why), "{cid}: {}", out.stderr_str());
    }
    let text = std::fs::read_to_string(&recorded).unwrap();
    let map: BTreeMap<String, String> = serde_json::from_str(&text).unwrap();
    assert_eq!(map.keys().collect::<Vec<_>>(), ["kube-a"], "{text}");
    assert_eq!(instances(&node), before);
}

/// Queues an XID event on the simulated node, as the driver would report it
/// (`<state>/sim/xid/<name>.json`, written whole: a temp file renamed into place).
fn inject_xid(node: &Node, gpu: &str, xid: u64, gi: Option<u32>) {
    let dir = node.state.join("sim/xid");
    std::fs::create_dir_all(&dir).unwrap();
    let mut ev = serde_json::json!({"gpu_uuid": gpu, "xid": xid});
    if let Some(gi) = gi {
        ev["gi_id"] = gi.into();
        ev["ci_id"] = 0.into();
    }
    let name = format!("{}-{xid}", unique_name());
    let tmp = dir.join(format!("{name}.tmp"));
    std::fs::write(&tmp, ev.to_string()).unwrap();
    std::fs::rename(&tmp, dir.join(format!("{name}.json"))).unwrap();
}

/// Issue 26: an XID on a MIG instance quarantines exactly that instance — kubelet sees it
/// unhealthy, the CDI spec drops the profile only it offered, no grant lands there — and
/// an uncontained one the whole GPU; the holder on it is told.
#[test]
fn an_xid_quarantines_exactly_its_scope_for_kubelet_cdi_and_grants() {
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let files = short_tempdir();
    let (dir, cdi) = (files.join("dp"), files.join("cdi"));
    std::fs::create_dir_all(&dir).unwrap();
    let node_file = files.join("xid-node.json");
    std::fs::write(
        &node_file,
        r#"{"node": "sim-xid-0", "gpus": [
            {"model": "H100-80GB", "mig": [{"profile": "1g.10gb", "start": 0},
                {"profile": "1g.10gb", "start": 1}, {"profile": "3g.40gb", "start": 4}]},
            {"model": "H100-80GB"}, {"model": "H100-80GB"}]}"#,
    )
    .unwrap();
    let _kubelet = Kubelet::start(&rt, &dir);
    let node = Node::start_with(NodeOptions {
        node_file,
        extra_args: vec![
            "--no-dynamic-mig".into(),
            "--device-plugin-dir".into(),
            dir.display().to_string(),
            "--cdi-spec-dir".into(),
            cdi.display().to_string(),
        ],
        ..Default::default()
    });
    node.fx.cleanup().track_dir(&files);
    let st = node.client().status().unwrap();
    let mig_gpu = st.gpus[0].clone();
    let three = mig_gpu.instances.iter().find(|i| i.profile == "3g.40gb").unwrap().clone();
    let lists: Lists = Arc::default();
    for r in [GPU, MIG_1G, MIG_3G] {
        watch_lists(&rt, &dir, r, &lists);
    }
    wait_lists(&lists, "the healthy node", |l| {
        count(l, GPU) == 2 && count(l, MIG_1G) == 2 && count(l, MIG_3G) == 1
    });
    let spec = || std::fs::read_to_string(cdi.join("tessera.yaml")).unwrap_or_default();
    assert!(spec().contains("mig-3g.40gb") && spec().contains("mig-1g.10gb"), "{}", spec());

    // A holder on the MIG GPU (an annotation request: unhealthy to kubelet, not gone).
    let b = node.bundle("held", "team-untrusted", Some("mig=1g.10gb"), &["sleep", "300"]);
    node.fx.run_detached(&b, "held");
    wait_lists(&lists, "the held instance", |l| count(l, MIG_1G) == 1);

    // XID 94 (contained) on the 3g instance: it alone.
    inject_xid(&node, &mig_gpu.uuid, 94, Some(three.gi_id));
    wait_lists(&lists, "the 3g instance quarantined", |l| {
        count(l, MIG_3G) == 0 && listed(l, MIG_3G).contains(&three.uuid)
    });
    assert!(wait_for(|| !spec().contains("mig-3g.40gb"), Duration::from_secs(10)), "{}", spec());
    assert!(spec().contains("mig-1g.10gb"), "the other instances still offer theirs");
    assert_eq!((count(&lists, MIG_1G), count(&lists, GPU)), (1, 2), "nothing else changed");
    let b = node.bundle("on-3g", "team-untrusted", Some("mig=3g.40gb"), &["true"]);
    let out = node.fx.run_container(&b, "on-3g");
    out.assert_failure("a grant on the quarantined instance");
    assert!(out.stderr_str().contains("quarantined"), "{}", out.stderr_str());

    // XID 95 (uncontained) on the GPU: all of it; the holder is told; the others stay.
    inject_xid(&node, &mig_gpu.uuid, 95, None);
    wait_lists(&lists, "the whole MIG GPU quarantined", |l| count(l, MIG_1G) == 0);
    assert!(wait_for(|| !spec().contains("mig-"), Duration::from_secs(10)), "{}", spec());
    assert_eq!(count(&lists, GPU), 2, "the other GPUs stay healthy");
    let st = node.client().status().unwrap();
    assert!(st.gpus[0].instances.iter().all(|i| i.state == tessera_api::DeviceState::Quarantined));
    let told = st.events.iter().any(|e| {
        e.kind == "xid" && e.container_id.as_deref() == Some("held") && e.detail.contains("XID 95")
    });
    assert!(told, "the holder is told: {:?}", st.events);
    assert!(node.fx.status("held").as_deref() == Some("running"), "told, not stopped (policy)");
}

/// The first list kubelet gets for `resource`: id -> the NUMA nodes in its `TopologyInfo`.
fn numa_of(rt: &Runtime, dir: &Path, resource: &str) -> BTreeMap<String, Vec<i64>> {
    let mut c = plugin(rt, dir, resource);
    let mut stream = rt.block_on(c.list_and_watch(api::Empty {})).unwrap().into_inner();
    let first = rt.block_on(stream.message()).unwrap().unwrap();
    first
        .devices
        .into_iter()
        .map(|d| {
            (d.id, d.topology.map(|t| t.nodes.iter().map(|n| n.id).collect()).unwrap_or_default())
        })
        .collect()
}

/// Issue 26, topology: on a node of two NVLink pairs on two NUMA nodes, kubelet sees each
/// GPU's NUMA node; `gpu=2` lands on a pair and says so in the grant; the container's CPU
/// set follows its GPUs (`topology.pin_cpus`); another tenant is kept out of an NVLink
/// domain one tenant holds a GPU of (`topology.isolate_nvlink_domains`).
#[test]
fn gpu_2_lands_on_an_nvlink_pair_kubelet_sees_numa_nodes_and_cpus_follow_the_gpus() {
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let files = short_tempdir();
    let dir = files.join("dp");
    std::fs::create_dir_all(&dir).unwrap();
    // The host's highest online CPU stands for the second NUMA node's CPUs.
    let online = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap();
    let last: u32 = online.trim().rsplit(['-', ',']).next().unwrap().parse().unwrap();
    let node_file = files.join("topo-node.json");
    std::fs::write(
        &node_file,
        format!(
            r#"{{"node": "sim-topo-0", "gpus": [
            {{"model": "H100-80GB", "nvlink": [1], "numa_node": 0, "cpus": "0"}},
            {{"model": "H100-80GB", "nvlink": [0], "numa_node": 0, "cpus": "0"}},
            {{"model": "H100-80GB", "nvlink": [3], "numa_node": 1, "cpus": "{last}"}},
            {{"model": "H100-80GB", "nvlink": [2], "numa_node": 1, "cpus": "{last}"}}]}}"#
        ),
    )
    .unwrap();
    let mut v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(repo("examples/policy.json")).unwrap()).unwrap();
    v["topology"] = serde_json::json!({"pin_cpus": true, "isolate_nvlink_domains": true});
    let policy = files.join("policy.json");
    std::fs::write(&policy, v.to_string()).unwrap();
    let _kubelet = Kubelet::start(&rt, &dir);
    let node = Node::start_with(NodeOptions {
        policy,
        node_file,
        extra_args: vec!["--device-plugin-dir".into(), dir.display().to_string()],
        ..Default::default()
    });
    node.fx.cleanup().track_dir(&files);
    let gpus: Vec<String> =
        node.client().status().unwrap().gpus.into_iter().map(|g| g.uuid).collect();
    assert!(wait_for(|| dir.join(socket_name(GPU)).exists(), Duration::from_secs(10)));
    let numa = numa_of(&rt, &dir, GPU);
    let want: BTreeMap<String, Vec<i64>> =
        gpus.iter().zip([0, 0, 1, 1]).map(|(g, n)| (g.clone(), vec![n])).collect();
    assert_eq!(numa, want, "kubelet's TopologyInfo");
    // (No MPS here: it is advertised only where the MPS control binary exists.)
    assert!(!dir.join(socket_name(MPS)).exists(), "MPS without its control binary");
    let shared = numa_of(&rt, &dir, SHARED);
    assert_eq!(shared[&format!("{}:shared:0", gpus[3])], [1], "every id of a GPU carries it");

    // One GPU, then two: the two land on the whole pair (first-fit would take GPUs 1, 2).
    let b = node.bundle("one", "team-untrusted", Some("gpu=1"), &["sleep", "300"]);
    node.fx.run_detached(&b, "one");
    assert_eq!(node.client().allocation("one").unwrap().devices[0].uuid, gpus[0]);
    let b = node.bundle("two", "team-untrusted", Some("gpu=2"), &["sleep", "300"]);
    node.fx.run_detached(&b, "two");
    let a = node.client().allocation("two").unwrap();
    let got: Vec<&str> = a.devices.iter().map(|d| d.uuid.as_str()).collect();
    assert_eq!(got, [gpus[2].as_str(), gpus[3].as_str()], "an NVLink pair");
    assert_eq!(a.topology.as_deref(), Some("NVLink domain 1, NUMA node 1"), "the grant says so");
    let status = node.fx.exec("two", &["cat", "/proc/self/status"]);
    status.assert_success("exec");
    let cpus = status
        .stdout_str()
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:").map(|v| v.trim().to_string()))
        .unwrap();
    assert_eq!(cpus, last.to_string(), "the CPU set follows the GPUs");

    // Another tenant: GPU 1 is free, but its NVLink domain holds the first tenant's GPU 0.
    let b = node.bundle("three", "team-dev", Some("gpu=1"), &["true"]);
    let out = node.fx.run_container(&b, "three");
    out.assert_failure("kept out of the other tenant's NVLink domain");
    assert!(out.stderr_str().contains("isolate_nvlink_domains"), "{}", out.stderr_str());
}
