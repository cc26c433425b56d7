//! A blocking CRI (`runtime.v1`) client that drives containerd's CRI plugin the way kubelet
//! does, for end-to-end tests: pods with host networking (no CNI), a cgroup parent under
//! the fixture's tracked cgroup, logs in the fixture's temp dir, and the sandbox config
//! passed again with every CreateContainer.
//!
//! ```ignore
//! let ctd = Containerd::builder().cri().start();   // CRI on, images imported
//! let cri = ctd.cri();
//! let pod = PodSpec::new("p1", "default");
//! let pod_id = cri.run_pod_sandbox(&pod)?;
//! let c = ContainerSpec::new("app").command(&["sh", "-c", "echo hi; sleep 30"]);
//! let id = cri.create_container(&pod_id, &pod, &c)?;
//! cri.start_container(&id)?;
//! cri.stop_container(&id, 0)?;
//! cri.remove_container(&id)?;
//! cri.stop_pod_sandbox(&pod_id)?;
//! cri.remove_pod_sandbox(&pod_id)?;
//! ```
//!
//! Every call blocks on a private current-thread tokio runtime, so do not call it from
//! inside an async runtime. A failed call is a [`CriError`] that keeps the gRPC status
//! message: a runtime's refusal (e.g. tessera-runtime's) is inside it.

mod image;

use std::collections::HashMap;
use std::fs;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tonic::transport::{Channel, Endpoint};

pub use image::{image_archive, write_image_archive, BUSYBOX_IMAGE, PAUSE_IMAGE};
/// gRPC status codes ([`CriError::code`]).
pub use tonic::Code;

/// The generated `runtime.v1` types and clients (tonic-prost-build; see
/// `tests/cri_codegen.rs` for how to regenerate). Not formatted by rustfmt (included).
#[allow(
    clippy::all,
    clippy::pedantic,
    missing_debug_implementations,
    rust_2018_idioms,
    unused_qualifications
)]
pub mod v1 {
    include!("runtime.v1.rs");
}

use v1::image_service_client::ImageServiceClient;
use v1::runtime_service_client::RuntimeServiceClient;

/// The CRI annotation containerd sets on every container it creates: `sandbox` for the
/// pod's pause container, `container` for an application container.
pub const CONTAINER_TYPE_ANNOTATION: &str = "io.kubernetes.cri.container-type";
/// The containerd namespace the CRI plugin keeps its containers and images in.
pub const CRI_NAMESPACE: &str = "k8s.io";
/// How long one CRI call may take before [`CriError::Timeout`].
pub const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// What went wrong in a CRI call.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CriError {
    /// The socket did not accept a gRPC connection.
    #[error("cri: cannot connect to {socket}: {message}")]
    Connect { socket: PathBuf, message: String },
    /// The runtime answered with an error status; `message` is its text verbatim
    /// (containerd wraps the OCI runtime's stderr into it).
    #[error("cri {call}: {code:?}: {message}")]
    Status { call: &'static str, code: tonic::Code, message: String },
    /// No answer within the call timeout.
    #[error("cri {call}: no answer within {after:?}")]
    Timeout { call: &'static str, after: Duration },
    /// The request was refused before it was sent, or the answer lacked a field.
    #[error("cri {call}: {message}")]
    Invalid { call: &'static str, message: String },
}

impl CriError {
    /// The message: the runtime's text for [`CriError::Status`], ours otherwise.
    pub fn message(&self) -> &str {
        match self {
            CriError::Connect { message, .. }
            | CriError::Status { message, .. }
            | CriError::Invalid { message, .. } => message,
            CriError::Timeout { .. } => "timed out",
        }
    }
    /// The gRPC status code, for [`CriError::Status`].
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            CriError::Status { code, .. } => Some(*code),
            _ => None,
        }
    }
}

static NEXT_UID: AtomicU64 = AtomicU64::new(0);

/// A pod as kubelet describes it to RunPodSandbox (and again to every CreateContainer).
/// Build with [`PodSpec::new`]; the same value must be given to
/// [`Cri::run_pod_sandbox`] and [`Cri::create_container`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodSpec {
    pub name: String,
    pub namespace: String,
    /// Unique per pod (set by [`PodSpec::new`]).
    pub uid: String,
    pub attempt: u32,
    /// Pod labels; kubelet's `io.kubernetes.pod.{name,namespace,uid}` are added.
    pub labels: Vec<(String, String)>,
    /// Pod annotations (what `metadata.annotations` holds).
    pub annotations: Vec<(String, String)>,
    /// The RuntimeClass handler (`""`: containerd's `default_runtime_name`).
    pub runtime_handler: String,
    /// The pod cgroup. None: `<fixture cgroup parent>/pod<uid>`, as kubelet's cgroupfs
    /// driver names pod cgroups. A given one must lie below the fixture's parent (it is
    /// the cgroup the cleanup removes).
    pub cgroup_parent: Option<String>,
    /// Sandbox `privileged` (kubelet sets it when any container of the pod is privileged;
    /// containerd refuses a privileged container in an unprivileged sandbox).
    pub privileged: bool,
    /// `shareProcessNamespace: true`: one pid namespace per pod (the sandbox's), which
    /// kubelet asks as `NamespaceMode::Pod` for the sandbox and every container.
    pub share_process_namespace: bool,
}

impl PodSpec {
    /// A pod with a fresh uid, no labels or annotations, the default handler.
    pub fn new(name: &str, namespace: &str) -> PodSpec {
        let n = NEXT_UID.fetch_add(1, Ordering::SeqCst);
        PodSpec {
            name: name.to_owned(),
            namespace: namespace.to_owned(),
            uid: format!("{:08x}-0000-4000-8000-{:012x}", std::process::id(), n),
            attempt: 0,
            labels: Vec::new(),
            annotations: Vec::new(),
            runtime_handler: String::new(),
            cgroup_parent: None,
            privileged: false,
            share_process_namespace: false,
        }
    }
    /// Adds a pod annotation.
    pub fn annotation(mut self, key: &str, value: &str) -> PodSpec {
        self.annotations.push((key.to_owned(), value.to_owned()));
        self
    }
    /// Adds a pod label.
    pub fn label(mut self, key: &str, value: &str) -> PodSpec {
        self.labels.push((key.to_owned(), value.to_owned()));
        self
    }
    /// Sets the runtime handler (a RuntimeClass's `handler`).
    pub fn handler(mut self, handler: &str) -> PodSpec {
        self.runtime_handler = handler.to_owned();
        self
    }
    /// Sets the pod cgroup (below the fixture's cgroup parent).
    pub fn cgroup_parent(mut self, parent: &str) -> PodSpec {
        self.cgroup_parent = Some(parent.to_owned());
        self
    }
    /// Sets sandbox `privileged`.
    pub fn privileged(mut self, privileged: bool) -> PodSpec {
        self.privileged = privileged;
        self
    }
    /// Sets `shareProcessNamespace`.
    pub fn share_process_namespace(mut self, share: bool) -> PodSpec {
        self.share_process_namespace = share;
        self
    }
}

/// A container as kubelet describes it to CreateContainer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerSpec {
    pub name: String,
    /// Image reference (default [`BUSYBOX_IMAGE`]).
    pub image: String,
    /// Replaces the image entrypoint (`command:` in a pod spec).
    pub command: Vec<String>,
    /// Replaces the image cmd (`args:`).
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub labels: Vec<(String, String)>,
    /// Container annotations (kubelet passes its own here; a pod author's pod
    /// annotations go on the [`PodSpec`]).
    pub annotations: Vec<(String, String)>,
    pub attempt: u32,
    pub working_dir: String,
    /// `securityContext.privileged` (needs [`PodSpec::privileged`]).
    pub privileged: bool,
}

impl ContainerSpec {
    /// A container of [`BUSYBOX_IMAGE`] running the image's default (`sh`).
    pub fn new(name: &str) -> ContainerSpec {
        ContainerSpec {
            name: name.to_owned(),
            image: BUSYBOX_IMAGE.to_owned(),
            command: Vec::new(),
            args: Vec::new(),
            env: Vec::new(),
            labels: Vec::new(),
            annotations: Vec::new(),
            attempt: 0,
            working_dir: String::new(),
            privileged: false,
        }
    }
    pub fn image(mut self, image: &str) -> ContainerSpec {
        self.image = image.to_owned();
        self
    }
    pub fn command(mut self, command: &[&str]) -> ContainerSpec {
        self.command = command.iter().map(|s| s.to_string()).collect();
        self
    }
    pub fn args(mut self, args: &[&str]) -> ContainerSpec {
        self.args = args.iter().map(|s| s.to_string()).collect();
        self
    }
    pub fn env(mut self, key: &str, value: &str) -> ContainerSpec {
        self.env.push((key.to_owned(), value.to_owned()));
        self
    }
    pub fn annotation(mut self, key: &str, value: &str) -> ContainerSpec {
        self.annotations.push((key.to_owned(), value.to_owned()));
        self
    }
    pub fn label(mut self, key: &str, value: &str) -> ContainerSpec {
        self.labels.push((key.to_owned(), value.to_owned()));
        self
    }
    pub fn privileged(mut self, privileged: bool) -> ContainerSpec {
        self.privileged = privileged;
        self
    }
}

/// Output of [`Cri::exec_sync`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    pub stdout: String,
    pub stderr: String,
    pub exit_code: i32,
}

fn map(kv: &[(String, String)]) -> HashMap<String, String> {
    kv.iter().cloned().collect()
}

/// kubelet's default masked paths (`securitycontext.DefaultProcMaskedPaths`).
const MASKED_PATHS: &[&str] = &[
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
];
/// kubelet's default read-only paths (`securitycontext.DefaultProcReadonlyPaths`).
const READONLY_PATHS: &[&str] =
    &["/proc/asound", "/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"];

/// Host network (no CNI), a pid namespace per container (per pod with
/// `shareProcessNamespace`), one IPC namespace per pod: what kubelet asks for a
/// `hostNetwork: true` pod.
fn namespace_options(pod: &PodSpec) -> v1::NamespaceOption {
    let pid = if pod.share_process_namespace {
        v1::NamespaceMode::Pod
    } else {
        v1::NamespaceMode::Container
    };
    v1::NamespaceOption {
        network: v1::NamespaceMode::Node as i32,
        pid: pid as i32,
        ipc: v1::NamespaceMode::Pod as i32,
        ..Default::default()
    }
}

fn unconfined() -> Option<v1::SecurityProfile> {
    Some(v1::SecurityProfile {
        profile_type: v1::security_profile::ProfileType::Unconfined as i32,
        localhost_ref: String::new(),
    })
}

/// A connected CRI client. Made by [`crate::Containerd::cri`] (or [`Cri::connect`]).
#[derive(Debug)]
pub struct Cri {
    rt: tokio::runtime::Runtime,
    runtime: RuntimeServiceClient<Channel>,
    images: ImageServiceClient<Channel>,
    socket: PathBuf,
    log_root: PathBuf,
    cgroup_parent: String,
    timeout: Duration,
}

impl Cri {
    /// Connects to the CRI socket `socket`. Pod log directories go below `log_root`; pod
    /// cgroups below `cgroup_parent` (e.g. `/tessera-test-<pid>-<n>`).
    pub fn connect(socket: &Path, log_root: &Path, cgroup_parent: &str) -> Result<Cri, CriError> {
        let connect_err =
            |message: String| CriError::Connect { socket: socket.to_path_buf(), message };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| connect_err(format!("tokio runtime: {e}")))?;
        let uri = format!("unix://{}", socket.display());
        let endpoint = Endpoint::from_shared(uri).map_err(|e| connect_err(e.to_string()))?;
        let channel = rt
            .block_on(async {
                tokio::time::timeout(Duration::from_secs(10), endpoint.connect()).await
            })
            .map_err(|_| connect_err("no connection within 10s".into()))?
            .map_err(|e| connect_err(format!("{e:?}")))?;
        Ok(Cri {
            rt,
            runtime: RuntimeServiceClient::new(channel.clone()),
            images: ImageServiceClient::new(channel),
            socket: socket.to_path_buf(),
            log_root: log_root.to_path_buf(),
            cgroup_parent: cgroup_parent.to_owned(),
            timeout: CALL_TIMEOUT,
        })
    }

    /// The socket this client talks to.
    pub fn socket(&self) -> &Path {
        &self.socket
    }
    /// Changes the per-call timeout (default [`CALL_TIMEOUT`]).
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }
    /// The raw generated runtime client, for calls this wrapper does not cover (run it
    /// with [`Cri::block_on`]).
    pub fn runtime_client(&self) -> RuntimeServiceClient<Channel> {
        self.runtime.clone()
    }
    /// The raw generated image client.
    pub fn image_client(&self) -> ImageServiceClient<Channel> {
        self.images.clone()
    }
    /// Runs a future on this client's runtime.
    pub fn block_on<F: Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    fn call<T, F>(&self, call: &'static str, f: F) -> Result<T, CriError>
    where
        F: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let after = self.timeout;
        match self.rt.block_on(async { tokio::time::timeout(after, f).await }) {
            Err(_) => Err(CriError::Timeout { call, after }),
            Ok(Err(s)) => {
                Err(CriError::Status { call, code: s.code(), message: s.message().to_owned() })
            }
            Ok(Ok(r)) => Ok(r.into_inner()),
        }
    }

    /// `Version`: runtime name, version and CRI API version.
    pub fn version(&self) -> Result<v1::VersionResponse, CriError> {
        let mut c = self.runtime.clone();
        self.call("Version", c.version(v1::VersionRequest { version: "v1".into() }))
    }

    /// The pod's log directory (kubelet: `/var/log/pods/<ns>_<name>_<uid>`), in the
    /// fixture's temp dir.
    pub fn pod_log_dir(&self, pod: &PodSpec) -> PathBuf {
        self.log_root.join(format!("{}_{}_{}", pod.namespace, pod.name, pod.uid))
    }

    /// The pod's cgroup: [`PodSpec::cgroup_parent`] or `<fixture parent>/pod<uid>`.
    pub fn pod_cgroup(&self, pod: &PodSpec) -> String {
        pod.cgroup_parent
            .clone()
            .unwrap_or_else(|| format!("{}/pod{}", self.cgroup_parent, pod.uid))
    }

    /// The `PodSandboxConfig` kubelet would send for `pod` (host network).
    pub fn sandbox_config(&self, pod: &PodSpec) -> v1::PodSandboxConfig {
        let mut labels = map(&pod.labels);
        labels.insert("io.kubernetes.pod.name".into(), pod.name.clone());
        labels.insert("io.kubernetes.pod.namespace".into(), pod.namespace.clone());
        labels.insert("io.kubernetes.pod.uid".into(), pod.uid.clone());
        v1::PodSandboxConfig {
            metadata: Some(v1::PodSandboxMetadata {
                name: pod.name.clone(),
                uid: pod.uid.clone(),
                namespace: pod.namespace.clone(),
                attempt: pod.attempt,
            }),
            hostname: String::new(),
            log_directory: self.pod_log_dir(pod).to_string_lossy().into_owned(),
            dns_config: None,
            port_mappings: Vec::new(),
            labels,
            annotations: map(&pod.annotations),
            linux: Some(v1::LinuxPodSandboxConfig {
                cgroup_parent: self.pod_cgroup(pod),
                security_context: Some(v1::LinuxSandboxSecurityContext {
                    namespace_options: Some(namespace_options(pod)),
                    privileged: pod.privileged,
                    seccomp: unconfined(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            windows: None,
        }
    }

    /// The `ContainerConfig` kubelet would send for `container` of `pod`.
    pub fn container_config(
        &self,
        pod: &PodSpec,
        container: &ContainerSpec,
    ) -> v1::ContainerConfig {
        let mut labels = map(&container.labels);
        labels.insert("io.kubernetes.container.name".into(), container.name.clone());
        labels.insert("io.kubernetes.pod.name".into(), pod.name.clone());
        labels.insert("io.kubernetes.pod.namespace".into(), pod.namespace.clone());
        labels.insert("io.kubernetes.pod.uid".into(), pod.uid.clone());
        let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        v1::ContainerConfig {
            metadata: Some(v1::ContainerMetadata {
                name: container.name.clone(),
                attempt: container.attempt,
            }),
            image: Some(v1::ImageSpec { image: container.image.clone(), ..Default::default() }),
            command: container.command.clone(),
            args: container.args.clone(),
            working_dir: container.working_dir.clone(),
            envs: container
                .env
                .iter()
                .map(|(k, v)| v1::KeyValue { key: k.clone(), value: v.clone() })
                .collect(),
            labels,
            annotations: map(&container.annotations),
            log_path: format!("{}/{}.log", container.name, container.attempt),
            linux: Some(v1::LinuxContainerConfig {
                resources: Some(v1::LinuxContainerResources {
                    // A BestEffort pod's container, as kubelet sets it.
                    cpu_period: 100_000,
                    cpu_shares: 2,
                    oom_score_adj: 1000,
                    ..Default::default()
                }),
                security_context: Some(v1::LinuxContainerSecurityContext {
                    privileged: container.privileged,
                    namespace_options: Some(namespace_options(pod)),
                    masked_paths: if container.privileged { vec![] } else { strings(MASKED_PATHS) },
                    readonly_paths: if container.privileged {
                        vec![]
                    } else {
                        strings(READONLY_PATHS)
                    },
                    seccomp: unconfined(),
                    ..Default::default()
                }),
            }),
            ..Default::default()
        }
    }

    fn check_cgroup(&self, call: &'static str, pod: &PodSpec) -> Result<(), CriError> {
        let cg = self.pod_cgroup(pod);
        let under = cg.strip_prefix(&self.cgroup_parent).is_some_and(|r| r.starts_with('/'));
        if under {
            Ok(())
        } else {
            Err(CriError::Invalid {
                call,
                message: format!(
                    "pod cgroup {cg:?} is not below the fixture's cgroup parent {:?} (the \
                     cleanup would not remove it)",
                    self.cgroup_parent
                ),
            })
        }
    }

    /// `RunPodSandbox` with [`Cri::sandbox_config`] and the pod's handler; returns the
    /// sandbox id.
    pub fn run_pod_sandbox(&self, pod: &PodSpec) -> Result<String, CriError> {
        self.check_cgroup("RunPodSandbox", pod)?;
        let config = self.sandbox_config(pod);
        self.run_pod_sandbox_raw(config, &pod.runtime_handler)
    }

    /// `RunPodSandbox` with a config of the caller's (e.g. [`Cri::sandbox_config`] edited).
    pub fn run_pod_sandbox_raw(
        &self,
        config: v1::PodSandboxConfig,
        runtime_handler: &str,
    ) -> Result<String, CriError> {
        let _ = fs::create_dir_all(&config.log_directory);
        let mut c = self.runtime.clone();
        let req = v1::RunPodSandboxRequest {
            config: Some(config),
            runtime_handler: runtime_handler.to_owned(),
        };
        Ok(self.call("RunPodSandbox", c.run_pod_sandbox(req))?.pod_sandbox_id)
    }

    /// `CreateContainer` in sandbox `pod_id` (made from `pod`), the sandbox config passed
    /// again as kubelet does; returns the container id.
    pub fn create_container(
        &self,
        pod_id: &str,
        pod: &PodSpec,
        container: &ContainerSpec,
    ) -> Result<String, CriError> {
        self.check_cgroup("CreateContainer", pod)?;
        let config = self.container_config(pod, container);
        let sandbox = self.sandbox_config(pod);
        self.create_container_raw(pod_id, config, sandbox)
    }

    /// `CreateContainer` with configs of the caller's.
    pub fn create_container_raw(
        &self,
        pod_id: &str,
        config: v1::ContainerConfig,
        sandbox_config: v1::PodSandboxConfig,
    ) -> Result<String, CriError> {
        let mut c = self.runtime.clone();
        let req = v1::CreateContainerRequest {
            pod_sandbox_id: pod_id.to_owned(),
            config: Some(config),
            sandbox_config: Some(sandbox_config),
        };
        Ok(self.call("CreateContainer", c.create_container(req))?.container_id)
    }

    pub fn start_container(&self, id: &str) -> Result<(), CriError> {
        let mut c = self.runtime.clone();
        let req = v1::StartContainerRequest { container_id: id.to_owned() };
        self.call("StartContainer", c.start_container(req)).map(drop)
    }

    /// `UpdateContainerResources`: kubelet's in-place resize of a container.
    pub fn update_container_resources(
        &self,
        id: &str,
        linux: v1::LinuxContainerResources,
    ) -> Result<(), CriError> {
        let mut c = self.runtime.clone();
        let req = v1::UpdateContainerResourcesRequest {
            container_id: id.to_owned(),
            linux: Some(linux),
            ..Default::default()
        };
        self.call("UpdateContainerResources", c.update_container_resources(req)).map(drop)
    }

    /// `StopContainer`: SIGTERM (the image's stop signal), SIGKILL after `timeout_s`.
    pub fn stop_container(&self, id: &str, timeout_s: i64) -> Result<(), CriError> {
        let mut c = self.runtime.clone();
        let req = v1::StopContainerRequest { container_id: id.to_owned(), timeout: timeout_s };
        self.call("StopContainer", c.stop_container(req)).map(drop)
    }

    pub fn remove_container(&self, id: &str) -> Result<(), CriError> {
        let mut c = self.runtime.clone();
        let req = v1::RemoveContainerRequest { container_id: id.to_owned() };
        self.call("RemoveContainer", c.remove_container(req)).map(drop)
    }

    pub fn stop_pod_sandbox(&self, pod_id: &str) -> Result<(), CriError> {
        let mut c = self.runtime.clone();
        let req = v1::StopPodSandboxRequest { pod_sandbox_id: pod_id.to_owned() };
        self.call("StopPodSandbox", c.stop_pod_sandbox(req)).map(drop)
    }

    pub fn remove_pod_sandbox(&self, pod_id: &str) -> Result<(), CriError> {
        let mut c = self.runtime.clone();
        let req = v1::RemovePodSandboxRequest { pod_sandbox_id: pod_id.to_owned() };
        self.call("RemovePodSandbox", c.remove_pod_sandbox(req)).map(drop)
    }

    /// `ListContainers`, all of them or those of one sandbox.
    pub fn list_containers(&self, pod_id: Option<&str>) -> Result<Vec<v1::Container>, CriError> {
        let mut c = self.runtime.clone();
        let filter = pod_id
            .map(|p| v1::ContainerFilter { pod_sandbox_id: p.to_owned(), ..Default::default() });
        let req = v1::ListContainersRequest { filter };
        Ok(self.call("ListContainers", c.list_containers(req))?.containers)
    }

    pub fn list_pod_sandboxes(&self) -> Result<Vec<v1::PodSandbox>, CriError> {
        let mut c = self.runtime.clone();
        let req = v1::ListPodSandboxRequest { filter: None };
        Ok(self.call("ListPodSandbox", c.list_pod_sandbox(req))?.items)
    }

    pub fn container_status(&self, id: &str) -> Result<v1::ContainerStatus, CriError> {
        let mut c = self.runtime.clone();
        let req = v1::ContainerStatusRequest { container_id: id.to_owned(), verbose: false };
        self.call("ContainerStatus", c.container_status(req))?.status.ok_or(CriError::Invalid {
            call: "ContainerStatus",
            message: format!("no status in the answer for container {id}"),
        })
    }

    pub fn pod_sandbox_status(&self, pod_id: &str) -> Result<v1::PodSandboxStatus, CriError> {
        let mut c = self.runtime.clone();
        let req = v1::PodSandboxStatusRequest { pod_sandbox_id: pod_id.to_owned(), verbose: false };
        self.call("PodSandboxStatus", c.pod_sandbox_status(req))?.status.ok_or(CriError::Invalid {
            call: "PodSandboxStatus",
            message: format!("no status in the answer for sandbox {pod_id}"),
        })
    }

    /// The container's state (`v1::ContainerState` as i32 in the status; this converts).
    pub fn container_state(&self, id: &str) -> Result<v1::ContainerState, CriError> {
        let st = self.container_status(id)?;
        v1::ContainerState::try_from(st.state).map_err(|_| CriError::Invalid {
            call: "ContainerStatus",
            message: format!("unknown container state {} for {id}", st.state),
        })
    }

    /// Polls [`Cri::container_state`] until it is `want` or `timeout` passes; returns
    /// the last state seen.
    pub fn wait_container_state(
        &self,
        id: &str,
        want: v1::ContainerState,
        timeout: Duration,
    ) -> Result<v1::ContainerState, CriError> {
        let deadline = Instant::now() + timeout;
        loop {
            let st = self.container_state(id)?;
            if st == want || Instant::now() >= deadline {
                return Ok(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `ExecSync`: runs `cmd` in a running container, output captured.
    pub fn exec_sync(
        &self,
        id: &str,
        cmd: &[&str],
        timeout_s: i64,
    ) -> Result<ExecOutput, CriError> {
        let mut c = self.runtime.clone();
        let req = v1::ExecSyncRequest {
            container_id: id.to_owned(),
            cmd: cmd.iter().map(|s| s.to_string()).collect(),
            timeout: timeout_s,
        };
        let r = self.call("ExecSync", c.exec_sync(req))?;
        Ok(ExecOutput {
            stdout: String::from_utf8_lossy(&r.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&r.stderr).into_owned(),
            exit_code: r.exit_code,
        })
    }

    /// `ImageStatus`: the image as the CRI plugin sees it, None if it does not know it.
    pub fn image_status(&self, image: &str) -> Result<Option<v1::Image>, CriError> {
        let mut c = self.images.clone();
        let req = v1::ImageStatusRequest {
            image: Some(v1::ImageSpec { image: image.to_owned(), ..Default::default() }),
            verbose: false,
        };
        Ok(self.call("ImageStatus", c.image_status(req))?.image)
    }

    /// The container's log file (CRI format: `<time> <stream> <P|F> <text>` per line).
    pub fn container_log_path(&self, pod: &PodSpec, container: &ContainerSpec) -> PathBuf {
        self.pod_log_dir(pod).join(&container.name).join(format!("{}.log", container.attempt))
    }

    /// What the container wrote so far (stdout and stderr interleaved), the CRI log
    /// prefixes removed.
    pub fn container_output(&self, pod: &PodSpec, container: &ContainerSpec) -> String {
        let raw = fs::read_to_string(self.container_log_path(pod, container)).unwrap_or_default();
        let mut out = String::new();
        for line in raw.lines() {
            // <timestamp> <stream> <tag> <content>; tag P = partial line (no newline).
            let mut parts = line.splitn(4, ' ');
            let (_, _, tag, text) = (parts.next(), parts.next(), parts.next(), parts.next());
            out.push_str(text.unwrap_or_default());
            if tag != Some("P") {
                out.push('\n');
            }
        }
        out
    }
}
