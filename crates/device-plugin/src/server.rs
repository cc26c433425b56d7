//! The plugin as kubelet sees it: one gRPC endpoint per resource name on a unix socket in
//! kubelet's plugin directory (`tessera-gpu.sock`, `tessera-mig-1g.10gb.sock`, …), each
//! registered with kubelet's `Registration` service on `kubelet.sock` and serving the
//! `DevicePlugin` service: `ListAndWatch` streams the resource's list whenever it changes,
//! `Allocate` answers with the assignment annotation only (no device nodes, mounts or
//! environment: tesserad injects devices at create, after policy), `GetPreferredAllocation`
//! keeps a container's MPS percent on one GPU, `PreStartContainer` is not needed.
//!
//! [`Plugin`] holds the state (the last [`Snapshot`], the reservations of `Allocate`s whose
//! grants have not come yet) and publishes the device lists; [`Plugin::serve`] keeps the
//! endpoints up: it starts an endpoint for every resource name, registers each with
//! kubelet, registers again when `kubelet.sock` is re-created (a kubelet restart, which
//! also deletes the plugins' sockets) or when an endpoint's socket vanished, and removes
//! its sockets when it stops.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use tessera_api::deviceplugin::{
    IssuedAssignment, PluginAssignment, ASSIGNMENT_ANNOTATION, RESOURCE_DOMAIN,
};
use tessera_api::untrusted;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::{ReceiverStream, UnixListenerStream};
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use crate::capacity::{self, Advertised, AllocateError, Reservation, Snapshot};
use crate::v1beta1 as api;
use crate::{API_VERSION, KUBELET_SOCKET};

/// How the plugin runs.
#[derive(Debug, Clone)]
pub struct Config {
    /// kubelet's plugin directory (holds `kubelet.sock`).
    pub dir: PathBuf,
    /// How long an `Allocate`'s ids stay reserved while its grant has not come (the pod's
    /// image pull and sandbox come first).
    pub reservation_ttl: Duration,
    /// How often `kubelet.sock` and the endpoints' sockets are looked at.
    pub poll: Duration,
}

impl Config {
    pub fn new(dir: impl Into<PathBuf>) -> Config {
        Config {
            dir: dir.into(),
            reservation_ttl: Duration::from_secs(600),
            poll: Duration::from_millis(500),
        }
    }
}

/// Why the plugin could not do something.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{0} exists and is not a socket: not removing it")]
    NotASocket(PathBuf),
    #[error("connecting to {path}: {source}")]
    Connect { path: PathBuf, source: tonic::transport::Error },
    #[error("registering {resource} with kubelet at {path}: {status}")]
    Register { resource: String, path: PathBuf, status: Box<Status> },
    #[error("registering {resource} with kubelet at {path}: no answer in {timeout:?}")]
    RegisterTimeout { resource: String, path: PathBuf, timeout: Duration },
}

/// Where `Allocate`'s assignments become unforgeable: tesserad records each with a fresh
/// random token, durably, before the answer goes to kubelet, and honours an assignment at
/// create only with a token it issued for exactly those ids. Blocking (called on a
/// blocking thread).
pub trait Issuer: Send + Sync + std::fmt::Debug {
    /// Records `made` (one assignment per container of an `Allocate`), each with its own
    /// new token; all or nothing. The error says why nothing was issued.
    fn issue(&self, made: &[PluginAssignment]) -> Result<Vec<IssuedAssignment>, String>;
}

/// The most released kubelet assignments remembered (see [`capacity::advertise`]'s `prefer`).
const MAX_RECENT: usize = 256;

/// How long a registration may take.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, Default)]
struct State {
    /// None until tesserad sends the first: nothing is advertised before.
    snapshot: Option<Snapshot>,
    /// `Allocate`s whose grants are not in the snapshot yet, with their deadlines.
    reservations: Vec<(Reservation, Instant)>,
    /// Assignments of kubelet grants that were released: kubelet may still count them as
    /// a pod's (its container restarts), so their unit ids are listed healthy first.
    recent: VecDeque<PluginAssignment>,
}

/// The device plugin's state and device lists; see the module documentation.
#[derive(Debug)]
pub struct Plugin {
    config: Config,
    state: Mutex<State>,
    lists: watch::Sender<Arc<Advertised>>,
    issuer: Arc<dyn Issuer>,
}

impl Plugin {
    /// The plugin whose `Allocate` answers carry the tokens `issuer` records.
    pub fn new(config: Config, issuer: Arc<dyn Issuer>) -> Arc<Plugin> {
        let (lists, _) = watch::channel(Arc::new(Advertised::new()));
        Arc::new(Plugin { config, state: Mutex::new(State::default()), lists, issuer })
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // The state is rebuilt from the next snapshot; a panic elsewhere leaves it usable.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The node's capacity now: recompute and publish the lists. Reservations whose grant
    /// the snapshot carries are done; kubelet grants gone since the last snapshot are
    /// remembered as recent.
    pub fn update(&self, snapshot: Snapshot) {
        let mut st = self.state();
        let live: BTreeSet<&String> =
            snapshot.kubelet.iter().flat_map(|a| a.device_ids().iter()).collect();
        st.reservations.retain(|(r, _)| {
            !r.device_ids().iter().any(|id| live.contains(id)) && !snapshot.presented.contains(r)
        });
        st.recent.retain(|r| !r.device_ids().iter().any(|id| live.contains(id)));
        if let Some(old) = st.snapshot.take() {
            for gone in old.kubelet.into_iter().filter(|a| !snapshot.kubelet.contains(a)) {
                st.recent.push_back(gone);
            }
            while st.recent.len() > MAX_RECENT {
                st.recent.pop_front();
            }
        }
        st.snapshot = Some(snapshot);
        self.publish(&mut st);
    }

    /// Drops the reservations that are past their deadline (and republishes if any was).
    pub fn expire(&self) {
        let mut st = self.state();
        let now = Instant::now();
        let before = st.reservations.len();
        st.reservations.retain(|(_, until)| *until > now);
        if st.reservations.len() != before {
            self.publish(&mut st);
        }
    }

    fn publish(&self, st: &mut State) {
        let Some(snapshot) = &st.snapshot else { return };
        let pending: Vec<Reservation> = st.reservations.iter().map(|(r, _)| r.clone()).collect();
        let prefer: BTreeSet<String> =
            st.recent.iter().flat_map(|a| a.device_ids().iter().cloned()).collect();
        let lists = Arc::new(capacity::advertise(snapshot, &pending, &prefer));
        self.lists.send_if_modified(|cur| {
            if **cur == *lists {
                false
            } else {
                *cur = lists;
                true
            }
        });
    }

    /// The lists now.
    pub fn advertised(&self) -> Arc<Advertised> {
        self.lists.borrow().clone()
    }

    /// Every change of the lists.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Advertised>> {
        self.lists.subscribe()
    }

    /// kubelet's `Allocate` for the containers of one pod asking `resource`: each id set
    /// checked ([`capacity::check_allocate`]) and reserved until its grant comes; all or
    /// nothing.
    pub fn allocate(
        &self,
        resource: &str,
        containers: &[Vec<String>],
    ) -> Result<Vec<PluginAssignment>, AllocateError> {
        let mut st = self.state();
        let Some(snapshot) = st.snapshot.clone() else {
            return Err(AllocateError::NotReady { resource: resource.to_string() });
        };
        let until = Instant::now() + self.config.reservation_ttl;
        let mut pending: Vec<Reservation> =
            st.reservations.iter().map(|(r, _)| r.clone()).collect();
        let mut made = Vec::new();
        for ids in containers {
            let a = capacity::check_allocate(&snapshot, &pending, resource, ids)?;
            // Kubelet chose these ids again: its earlier choice holding any of them is over.
            pending.retain(|r| !r.device_ids().iter().any(|id| ids.contains(id)));
            pending.push(a.clone());
            made.push(a);
        }
        st.reservations.retain(|(r, _)| pending.contains(r));
        for a in &made {
            st.reservations.push((a.clone(), until));
        }
        self.publish(&mut st);
        Ok(made)
    }

    /// Drops the reservations of `made` (an `Allocate` whose tokens could not be issued:
    /// kubelet got no answer to hold them with).
    pub fn cancel(&self, made: &[PluginAssignment]) {
        let mut st = self.state();
        let before = st.reservations.len();
        st.reservations.retain(|(r, _)| !made.contains(r));
        if st.reservations.len() != before {
            self.publish(&mut st);
        }
    }

    /// [`Plugin::allocate`], then the tokens from the [`Issuer`]: what `Allocate` answers.
    /// Nothing is answered (and nothing stays reserved) unless every token was recorded.
    pub async fn allocate_issued(
        &self,
        resource: &str,
        containers: &[Vec<String>],
    ) -> Result<Vec<IssuedAssignment>, Status> {
        let made = self.allocate(resource, containers).map_err(|e| {
            warn!(resource, "Allocate refused: {e}");
            Status::failed_precondition(format!(
                "tessera: {}",
                untrusted(&e.to_string()).max_chars(1024)
            ))
        })?;
        let issuer = self.issuer.clone();
        let asked = made.clone();
        let issued = tokio::task::spawn_blocking(move || issuer.issue(&asked))
            .await
            .unwrap_or_else(|e| Err(format!("the token issuer failed: {e}")));
        match issued {
            Ok(issued)
                if issued.len() == made.len()
                    && issued.iter().zip(&made).all(|(i, a)| i.assignment() == a) =>
            {
                Ok(issued)
            }
            Ok(_) => {
                self.cancel(&made);
                Err(Status::internal("tessera: the tokens issued are not the assignments made"))
            }
            Err(e) => {
                self.cancel(&made);
                warn!(resource, "Allocate failed: no token recorded: {e}");
                Err(Status::unavailable(format!(
                    "tessera: cannot record the assignment's token: {}",
                    untrusted(&e).max_chars(1024)
                )))
            }
        }
    }

    /// Keeps the endpoints up until `shutdown` turns true (or its sender goes), then
    /// stops them and removes their sockets.
    pub async fn serve(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let kubelet = self.config.dir.join(KUBELET_SOCKET);
        let mut endpoints: BTreeMap<String, Running> = BTreeMap::new();
        let mut kubelet_id: Option<FileId> = None;
        // Said once while kubelet.sock is absent, again after it was there.
        let mut said_waiting = false;
        let mut lists = self.subscribe();
        let mut tick = tokio::time::interval(self.config.poll);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                r = lists.changed() => if r.is_err() { break },
                r = shutdown.changed() => if r.is_err() || *shutdown.borrow() { break },
            }
            if *shutdown.borrow() {
                break;
            }
            self.expire();
            let now = file_id(&kubelet);
            if now != kubelet_id {
                if now.is_some() {
                    info!(socket = %kubelet.display(), "kubelet is (re)started: registering every resource");
                }
                for ep in endpoints.values_mut() {
                    ep.registered = false;
                }
                kubelet_id = now;
            }
            let resources: Vec<String> = self.advertised().keys().cloned().collect();
            for resource in resources {
                let stale = endpoints.get(&resource).is_none_or(|ep| !ep.socket_is_ours());
                if stale {
                    if let Some(old) = endpoints.remove(&resource) {
                        warn!(resource, socket = %old.socket.display(), "the endpoint's socket is gone: starting it again");
                        old.stop();
                    }
                    match Running::start(self.clone(), &resource) {
                        Ok(ep) => {
                            endpoints.insert(resource.clone(), ep);
                        }
                        Err(e) => {
                            warn!(resource, "cannot start the device-plugin endpoint: {e}");
                            continue;
                        }
                    }
                }
            }
            if kubelet_id.is_none() {
                if !said_waiting {
                    said_waiting = true;
                    info!(
                        socket = %kubelet.display(),
                        "waiting for kubelet: its registration socket is not there yet (is kubelet running, with this plugin directory?)"
                    );
                }
                continue;
            }
            said_waiting = false;
            for (resource, ep) in endpoints.iter_mut().filter(|(_, ep)| !ep.registered) {
                match register(&kubelet, resource, &ep.name).await {
                    Ok(()) => {
                        info!(resource, endpoint = %ep.name, "registered with kubelet");
                        ep.registered = true;
                        ep.failures = 0;
                    }
                    Err(e) => {
                        // Logged on the first failure and then every 20th: kubelet may be
                        // starting, and a poll is short.
                        if ep.failures % 20 == 0 {
                            warn!(resource, "{e}; trying again");
                        }
                        ep.failures += 1;
                    }
                }
            }
        }
        for (_, ep) in std::mem::take(&mut endpoints) {
            ep.stop();
        }
    }
}

/// Which file a path names now: (device, inode, change time), if it exists. The change
/// time tells a file re-created under a reused inode number (a restarted kubelet's new
/// socket often gets the old one's) from the old one.
type FileId = (u64, u64, i64, i64);

fn file_id(path: &Path) -> Option<FileId> {
    std::fs::symlink_metadata(path).ok().map(|m| (m.dev(), m.ino(), m.ctime(), m.ctime_nsec()))
}

/// The socket name of a resource's endpoint: `tessera-gpu.sock` for `tessera.io/gpu`.
pub fn socket_name(resource: &str) -> String {
    let short =
        resource.strip_prefix(RESOURCE_DOMAIN).map_or(resource, |r| r.trim_start_matches('/'));
    format!("tessera-{short}.sock")
}

/// One running endpoint.
#[derive(Debug)]
struct Running {
    name: String,
    socket: PathBuf,
    id: Option<FileId>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
    registered: bool,
    failures: u32,
}

impl Running {
    fn start(plugin: Arc<Plugin>, resource: &str) -> Result<Running, PluginError> {
        let name = socket_name(resource);
        let socket = plugin.config.dir.join(&name);
        let io = |source| PluginError::Io { path: socket.clone(), source };
        match std::fs::symlink_metadata(&socket) {
            Ok(m) if m.file_type().is_socket() => std::fs::remove_file(&socket).map_err(io)?,
            Ok(_) => return Err(PluginError::NotASocket(socket)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(e)),
        }
        let listener = UnixListener::bind(&socket).map_err(io)?;
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
        let id = file_id(&socket);
        let (stop, stopped) = watch::channel(false);
        let service = Service { resource: resource.to_string(), plugin, stopped: stopped.clone() };
        let mut until = stopped;
        let task = tokio::spawn(async move {
            let served = Server::builder()
                .add_service(api::device_plugin_server::DevicePluginServer::new(service))
                // Each connection read through FixAuthority: kubelets before 1.26 send the
                // socket's path as `:authority`, which h2 alone refuses.
                .serve_with_incoming_shutdown(
                    tokio_stream::StreamExt::map(UnixListenerStream::new(listener), |c| {
                        c.map(crate::authority::FixAuthority::new)
                    }),
                    async move {
                        let _ = until.wait_for(|s| *s).await;
                    },
                )
                .await;
            if let Err(e) = served {
                warn!("device-plugin endpoint stopped: {e}");
            }
        });
        Ok(Running { name, socket, id, stop, task, registered: false, failures: 0 })
    }

    /// Whether the socket file is still the one this endpoint bound.
    fn socket_is_ours(&self) -> bool {
        self.id.is_some() && file_id(&self.socket) == self.id
    }

    fn stop(self) {
        let _ = self.stop.send(true);
        self.task.abort();
        if self.socket_is_ours() {
            let _ = std::fs::remove_file(&self.socket);
        }
    }
}

/// A gRPC channel over the unix socket at `path`.
pub async fn connect(path: &Path) -> Result<Channel, PluginError> {
    let p = path.to_path_buf();
    Endpoint::from_static("http://localhost")
        .connect_timeout(REGISTER_TIMEOUT)
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let p = p.clone();
            async move { UnixStream::connect(p).await.map(TokioIo::new) }
        }))
        .await
        .map_err(|source| PluginError::Connect { path: path.to_path_buf(), source })
}

/// Registers the endpoint `endpoint` (a socket name in kubelet's dir) for `resource`.
pub async fn register(kubelet: &Path, resource: &str, endpoint: &str) -> Result<(), PluginError> {
    let call = async {
        let channel = connect(kubelet).await?;
        let mut client = api::registration_client::RegistrationClient::new(channel);
        client
            .register(api::RegisterRequest {
                version: API_VERSION.to_string(),
                endpoint: endpoint.to_string(),
                resource_name: resource.to_string(),
                options: Some(options()),
            })
            .await
            .map(drop)
            .map_err(|status| PluginError::Register {
                resource: resource.to_string(),
                path: kubelet.to_path_buf(),
                status: Box::new(status),
            })
    };
    tokio::time::timeout(REGISTER_TIMEOUT, call).await.unwrap_or_else(|_| {
        Err(PluginError::RegisterTimeout {
            resource: resource.to_string(),
            path: kubelet.to_path_buf(),
            timeout: REGISTER_TIMEOUT,
        })
    })
}

/// What every endpoint tells kubelet: no PreStartContainer, GetPreferredAllocation served.
pub fn options() -> api::DevicePluginOptions {
    api::DevicePluginOptions { pre_start_required: false, get_preferred_allocation_available: true }
}

/// The `DevicePlugin` service of one resource.
#[derive(Debug)]
struct Service {
    resource: String,
    plugin: Arc<Plugin>,
    /// Turns true when the endpoint stops: its `ListAndWatch` streams end.
    stopped: watch::Receiver<bool>,
}

fn to_api(list: &[capacity::Device]) -> api::ListAndWatchResponse {
    api::ListAndWatchResponse {
        devices: list
            .iter()
            .map(|d| api::Device {
                id: d.id.clone(),
                health: d.health().to_string(),
                topology: d
                    .numa
                    .map(|n| api::TopologyInfo { nodes: vec![api::NumaNode { id: i64::from(n) }] }),
            })
            .collect(),
    }
}

#[tonic::async_trait]
impl api::device_plugin_server::DevicePlugin for Service {
    async fn get_device_plugin_options(
        &self,
        _: Request<api::Empty>,
    ) -> Result<Response<api::DevicePluginOptions>, Status> {
        Ok(Response::new(options()))
    }

    type ListAndWatchStream = ReceiverStream<Result<api::ListAndWatchResponse, Status>>;

    async fn list_and_watch(
        &self,
        _: Request<api::Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let (tx, rx) = mpsc::channel(4);
        let mut lists = self.plugin.subscribe();
        let mut stopped = self.stopped.clone();
        let resource = self.resource.clone();
        tokio::spawn(async move {
            let mut last: Option<Vec<capacity::Device>> = None;
            loop {
                let now = lists.borrow_and_update().get(&resource).cloned().unwrap_or_default();
                if last.as_ref() != Some(&now) {
                    if tx.send(Ok(to_api(&now))).await.is_err() {
                        return;
                    }
                    last = Some(now);
                }
                tokio::select! {
                    r = lists.changed() => if r.is_err() { return },
                    _ = stopped.wait_for(|s| *s) => return,
                    _ = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn get_preferred_allocation(
        &self,
        request: Request<api::PreferredAllocationRequest>,
    ) -> Result<Response<api::PreferredAllocationResponse>, Status> {
        let container_responses = request
            .into_inner()
            .container_requests
            .iter()
            .map(|c| api::ContainerPreferredAllocationResponse {
                device_i_ds: capacity::preferred(
                    &self.resource,
                    &c.available_device_i_ds,
                    &c.must_include_device_i_ds,
                    usize::try_from(c.allocation_size).unwrap_or(0),
                ),
            })
            .collect();
        Ok(Response::new(api::PreferredAllocationResponse { container_responses }))
    }

    async fn allocate(
        &self,
        request: Request<api::AllocateRequest>,
    ) -> Result<Response<api::AllocateResponse>, Status> {
        let containers: Vec<Vec<String>> =
            request.into_inner().container_requests.into_iter().map(|c| c.devices_ids).collect();
        let issued = self.plugin.allocate_issued(&self.resource, &containers).await?;
        let container_responses = issued
            .iter()
            .map(|a| {
                // The assignment and the token's first digits only: logs are not where
                // kubelet's tokens should be read from.
                info!(resource = %self.resource, assignment = %a.assignment(), token = %a.token().short(), "Allocate");
                api::ContainerAllocateResponse {
                    annotations: [(ASSIGNMENT_ANNOTATION.to_string(), a.to_string())].into(),
                    ..Default::default()
                }
            })
            .collect();
        Ok(Response::new(api::AllocateResponse { container_responses }))
    }

    async fn pre_start_container(
        &self,
        _: Request<api::PreStartContainerRequest>,
    ) -> Result<Response<api::PreStartContainerResponse>, Status> {
        Ok(Response::new(api::PreStartContainerResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capacity::{GpuState, Offer, Usage};

    #[derive(Debug)]
    struct Tokens;
    impl Issuer for Tokens {
        fn issue(&self, _: &[PluginAssignment]) -> Result<Vec<IssuedAssignment>, String> {
            Err("not used".into())
        }
    }

    fn snapshot(presented: Vec<PluginAssignment>) -> Snapshot {
        let gpu = |u: &str| GpuState {
            uuid: tessera_api::DeviceUuid::new(u).expect("uuid"),
            model: "H100-80GB".into(),
            blocked: false,
            mig_enabled: false,
            usage: Usage::Free,
            instances: Vec::new(),
            numa_node: None,
        };
        Snapshot {
            offer: Offer { gpu: true, mig: false, mps: true, shared: false },
            replicas: 4,
            dynamic_mig: false,
            gpus: vec![gpu("GPU-a"), gpu("GPU-b")],
            kubelet: Vec::new(),
            presented,
        }
    }

    /// Healthy MPS percent: a GPU reserved whole serves none.
    fn healthy(p: &Plugin) -> usize {
        p.advertised()["tessera.io/mps"].iter().filter(|d| d.healthy).count()
    }

    /// A pod refused at create (its token presented, no grant) or deleted after its grant
    /// came and went between two reads: its ids are back at the next read, not after the
    /// reservation's 10 minutes.
    #[test]
    fn a_presented_assignment_holds_its_ids_no_longer() {
        let p = Plugin::new(Config::new("/nonexistent"), Arc::new(Tokens));
        p.update(snapshot(Vec::new()));
        assert_eq!(healthy(&p), 200);
        let made = p.allocate("tessera.io/gpu", &[vec!["GPU-a".to_string()]]).expect("allocate");
        assert_eq!(healthy(&p), 100, "reserved until its grant comes");
        p.update(snapshot(Vec::new()));
        assert_eq!(healthy(&p), 100, "still reserved: no create yet");
        p.update(snapshot(made));
        assert_eq!(healthy(&p), 200, "presented: back at once");
    }
}
