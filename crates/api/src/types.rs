//! Wire types of the tesserad HTTP+JSON API. Every request type (a body tesserad reads)
//! denies unknown fields: a typo in a client is an error, never a silently ignored
//! setting. Every response type (a body tesserad sends) ignores unknown fields: a client
//! one minor protocol version older than tesserad (see [`crate::protocol`]) still reads
//! the answers of a daemon that added a field.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ids::{ContainerId, TenantPath, Trust};
use crate::request::{GpuRequest, Isolation};

/// `POST /v1/allocations`: ask for a container's GPU share.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AllocateRequest {
    /// The OCI container id (runc's last positional argument); one that breaks runc's rule
    /// is refused when the body is read.
    pub container_id: ContainerId,
    /// runc's state root (`--root`), so the daemon can tell when the container is gone.
    pub runc_root: String,
    /// The bundle directory, for the operator's eyes only.
    pub bundle: String,
    /// The request, e.g. `mig=1g.10gb` (a string on the wire: see [`GpuRequest`]); a
    /// malformed one is refused when the body is read.
    pub request: GpuRequest,
    /// Where the request was read from.
    pub request_source: RequestSource,
    /// Every OCI annotation of the container. The daemon reads identity only from the
    /// annotations its policy trusts; the rest are ignored.
    /// A key given twice is refused (the identity is read from here: which one would count?).
    #[serde(default, deserialize_with = "unique_keys")]
    pub annotations: BTreeMap<String, String>,
    /// The container's CPU and memory limits from its OCI spec, which a policy with fleet
    /// quotas counts against the tenant's `cpu_cores` and `memory_gib`. Absent from older
    /// clients (and for a container without limits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<ContainerLimits>,
}

/// The annotation that names a container's gang: its members are admitted by the fleet's
/// quotas whole or not at all. A name of 1 to 253 characters of `[A-Za-z0-9._-]`, not
/// starting with `.` or `-`; it needs [`GANG_SIZE_ANNOTATION`].
pub const GANG_ANNOTATION: &str = "tessera.io/gang";
/// The annotation that says how many members a gang ([`GANG_ANNOTATION`]) has.
pub const GANG_SIZE_ANNOTATION: &str = "tessera.io/gang-size";
/// The annotation by which a container says what a quota reclaim should expect of it:
/// [`PREEMPTION_CHECKPOINT`] (it writes a checkpoint when it gets SIGTERM, within its
/// grace period, and resumes from it when it runs again).
pub const PREEMPTION_ANNOTATION: &str = "tessera.io/preemption";
/// The one value of [`PREEMPTION_ANNOTATION`].
pub const PREEMPTION_CHECKPOINT: &str = "checkpoint";

/// A container's resource limits as its OCI spec sets them (`linux.resources`), in the
/// units fleet quotas count: millicores and MiB.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContainerLimits {
    /// `cpu.quota × 1000 / cpu.period`, rounded up; `None`: no CPU limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_milli: Option<u64>,
    /// `memory.limit` in MiB, rounded up; `None`: no memory limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
}

impl ContainerLimits {
    /// The largest CPU limit accepted: a million cores (a quota's largest amount).
    pub const MAX_CPU_MILLI: u64 = 1_000_000_000;
    /// The largest memory limit accepted: a million GiB (a quota's largest amount).
    pub const MAX_MEMORY_MIB: u64 = 1_024_000_000;

    /// Whether both limits are within [`Self::MAX_CPU_MILLI`] and [`Self::MAX_MEMORY_MIB`];
    /// the error names the field and the bound.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(c) = self.cpu_milli.filter(|c| *c > Self::MAX_CPU_MILLI) {
            return Err(format!(
                "limits.cpu_milli {c} is above the largest CPU limit, {} millicores",
                Self::MAX_CPU_MILLI
            ));
        }
        if let Some(m) = self.memory_mib.filter(|m| *m > Self::MAX_MEMORY_MIB) {
            return Err(format!(
                "limits.memory_mib {m} is above the largest memory limit, {} MiB",
                Self::MAX_MEMORY_MIB
            ));
        }
        Ok(())
    }
}

/// Where a GPU request was found in the container's config.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RequestSource {
    Annotation,
    Env,
}

/// `POST /v1/allocations/{id}/start`: the container runc made is confirmed before any of
/// its code runs, by tessera-runtime's `start` of a container `runc create` made (before
/// `runc start`) or by the prestart hook during `runc run`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartRequest {
    /// The container's init pid from runc's state.
    pub pid: i32,
    /// The bundle from runc's state; must match the one the allocation was made for.
    pub bundle: String,
    /// `true`: asked at the start of a container `runc create` made: the init has moved into the
    /// container's root and waits to exec (its mount table is the container's alone);
    /// `false`: asked by the prestart hook, before runc's `pivot_root` (the table still
    /// holds the host's mounts, and the container's are those below its root).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub created: bool,
}

/// The body of `DELETE /v1/allocations/{id}`: which container is giving its grant back.
///
/// The daemon releases only the grant of the container it recorded: a root or bundle
/// given here that differs from the recorded one is refused (a container of the same id
/// elsewhere), and whatever is given, nothing is released while runc still has the
/// container in the recorded root. An empty body (older clients, the poststop hook, which
/// does not know the root) relies on that last check alone.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseRequest {
    /// runc's state root (`--root`) of the container that was removed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runc_root: Option<String>,
    /// Its bundle directory (canonical, as runc records it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bundle: Option<String>,
}

/// `POST /v1/allocations/{id}/update`: tessera-runtime asks before it runs `runc update` on
/// a container. The values are what runc 1.1 will read from the update (its flags, or the
/// `--resources` JSON): `0` leaves a value as it is (runc writes nothing for it), `-1` (any
/// negative quota) is unlimited.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpdateRequest {
    /// runc's state root (`--root`) of the container being updated: a grant made for a
    /// container of that id in another root is not this container's.
    pub runc_root: String,
    /// `--cpu-quota` / `cpu.quota`: µs per period.
    #[serde(default)]
    pub cpu_quota: i64,
    /// `--cpu-period` / `cpu.period`: µs.
    #[serde(default)]
    pub cpu_period: u64,
    /// `--memory` / `memory.limit`: bytes.
    #[serde(default)]
    pub memory_limit: i64,
    /// What runc's record of the container (its `state.json`) holds: runc 1.1 writes the
    /// recorded quota (period) with an update that sets only the period (quota). Absent
    /// where the record cannot be read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recorded: Option<RecordedLimits>,
    /// `--cpuset-cpus` / `cpu.cpus`: the CPU list the update sets (absent or empty:
    /// unchanged).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpuset_cpus: Option<String>,
    /// `--cpuset-mems` / `cpu.mems`: the memory nodes the update sets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpuset_mems: Option<String>,
}

/// The CPU and memory values runc's record of a container holds (`config.cgroups` of its
/// `state.json`: `cpu_quota`, `cpu_period`, `memory`); `0` is "not set".
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordedLimits {
    #[serde(default)]
    pub cpu_quota: i64,
    #[serde(default)]
    pub cpu_period: u64,
    #[serde(default)]
    pub memory: i64,
    /// `cpuset_cpus`: the CPU list runc set (empty: none).
    #[serde(default)]
    pub cpuset_cpus: String,
    /// `cpuset_mems`: the memory nodes runc set (empty: none).
    #[serde(default)]
    pub cpuset_mems: String,
}

/// `POST /v1/allocations/{id}/update/done`: runc's `update` ended (with this outcome).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpdateDone {
    pub runc_root: String,
    /// runc exited 0.
    pub runc_succeeded: bool,
    /// The limits of before were set back as the answer to a first `done` asked
    /// ([`UpdateAnswer::restore`]).
    #[serde(default, skip_serializing_if = "is_false")]
    pub restored: bool,
}

/// The answer to an [`UpdateRequest`] or an [`UpdateDone`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UpdateAnswer {
    /// Whether this node holds a grant for the container (in that runc root). `false`:
    /// the update is runc's business alone.
    pub grant: bool,
    /// The CPU and memory limits the grant counts from now on (to an update: what it will
    /// make them, as admitted; to `done`: what the kernel enforces).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<ContainerLimits>,
    /// To `done`: the kernel enforces more than was admitted; set these limits (those of
    /// before the update) back with `runc update`, then say `done` again with `restored`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore: Option<KernelLimits>,
    /// What happened, for the caller's log.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// A cgroup's CPU and memory limits as the kernel enforces them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KernelLimits {
    /// CFS quota in µs per period; `None`: unlimited.
    pub cpu_quota: Option<u64>,
    /// CFS period in µs.
    pub cpu_period: u64,
    /// Memory limit in bytes; `None`: unlimited.
    pub memory: Option<u64>,
}

/// A device node the container gets, created by runc inside the container's /dev.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DeviceNode {
    /// Absolute path inside the container, e.g. `/dev/nvidia-caps/nvidia-cap12`.
    pub path: String,
    pub major: i64,
    pub minor: i64,
    /// Permission bits, e.g. 0o666.
    pub file_mode: u32,
}

/// A read-only bind mount from the host into the container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BindMount {
    pub source: String,
    pub destination: String,
    pub read_only: bool,
}

/// What the runtime wrapper writes into the OCI spec: exactly these devices (and cgroup
/// rules allowing exactly these), these environment variables, these mounts.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Injection {
    pub devices: Vec<DeviceNode>,
    /// `KEY=VALUE` pairs, e.g. `CUDA_VISIBLE_DEVICES=MIG-...`.
    pub env: Vec<String>,
    pub mounts: Vec<BindMount>,
    /// Every character-device major of the NVIDIA driver on this node (`nvidia-frontend`,
    /// `nvidia-uvm`, `nvidia-caps`, ...): the wrapper removes every other device node and
    /// allow rule of these majors from the config, whatever the grant is.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_majors: Vec<i64>,
    /// The CPUs and memory nodes close to the granted GPUs (`topology.pin_cpus`):
    /// tessera-runtime writes them into `linux.resources.cpu`. Absent: left as configured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpuset: Option<CpuSet>,
}

/// A CPU set and its memory nodes, as Linux CPU lists (`0-15`, `0`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuSet {
    pub cpus: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mems: Option<String>,
}

/// One device a grant covers: a whole GPU or a MIG instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrantedDevice {
    /// The UUID of what the container holds (`GPU-...` or `MIG-...`), checked where the
    /// inventory's UUID becomes a grant (`slicer::Found::granted`) and when a stored grant
    /// is read back.
    pub uuid: crate::DeviceUuid,
    /// The UUID of the physical GPU.
    pub gpu_uuid: crate::DeviceUuid,
    pub gpu_index: u32,
    /// The catalog model name, e.g. `H100-80GB`.
    pub model: String,
    /// For MIG: the profile name, e.g. `1g.10gb`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mig_profile: Option<String>,
    /// For MIG: the placement start slot and size on the 8-slot memory axis.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<(u8, u8)>,
}

/// The lifecycle of one allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AllocationState {
    /// Granted and recorded; the container has not started yet.
    Pending,
    /// The prestart hook confirmed the container's pid.
    Running,
}

/// A granted allocation, as the daemon recorded it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    pub container_id: ContainerId,
    /// The tenant path, `org/team/project/user`.
    pub tenant: TenantPath,
    /// The tenant's trust tier.
    pub trust: Trust,
    /// What was asked (its string form on the wire and in the store, as in protocol 1.0).
    pub request: GpuRequest,
    pub isolation: Isolation,
    pub devices: Vec<GrantedDevice>,
    pub injection: Injection,
    pub state: AllocationState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<i32>,
    /// Unix milliseconds.
    pub created_ms: u64,
    /// For MPS and time-sliced grants: the device is shared, and how.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub share: Option<ShareGrant>,
    /// The Kubernetes pod container it was granted to (from containerd's own CRI
    /// annotations), where it is one: the names status, events and usage show.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<crate::cri::Workload>,
    /// How the grant counts against its tenant's fleet quotas, under a policy that sets
    /// them (absent otherwise, and in grants recorded before quotas existed). Boxed: most
    /// grants have none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quota: Option<Box<QuotaMark>>,
    /// The NVLink domain all the devices of a multi-GPU grant sit in, as the placement
    /// found it (absent: one device, devices in no common domain, or a node whose
    /// topology is unknown). The ledger records it: such grants carry the policy's
    /// topology premium (`prices.<model>.nvlink_premium_per_gpu_hour`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvlink_domain: Option<u32>,
    /// Where a multi-GPU grant sits in the node's topology, in words (`NVLink domain 1,
    /// NUMA node 0`); absent where the node's topology is unknown or the grant is not of
    /// whole GPUs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology: Option<String>,
    /// What the container declared itself (`tessera.io/class`) or its tenant's policy
    /// default: latency-sensitive containers are protected from interference.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<WorkloadClass>,
}

/// What a container says it is, for interference detection (`tessera.io/class`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkloadClass {
    /// Latency-sensitive: protected when a co-tenant degrades it.
    Latency,
    /// Throughput work: never a victim, may be an aggressor.
    Batch,
}

impl WorkloadClass {
    pub fn as_str(self) -> &'static str {
        match self {
            WorkloadClass::Latency => "latency",
            WorkloadClass::Batch => "batch",
        }
    }

    /// The class an annotation value names (exactly `latency` or `batch`).
    pub fn parse(s: &str) -> Option<WorkloadClass> {
        match s {
            "latency" => Some(WorkloadClass::Latency),
            "batch" => Some(WorkloadClass::Batch),
            _ => None,
        }
    }
}

/// Whether a grant runs within its tenant's quota guarantees or on borrowed capacity (the
/// wire form of the fleet's quota protocol: `guaranteed`, `borrowed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QuotaClass {
    /// Within every guarantee on the tenant's chain: never reclaimed.
    Guaranteed,
    /// Beyond a guarantee, on capacity others lend: priced at the burst price, and
    /// stopped (SIGTERM, grace, SIGKILL) when the lender asks for it back.
    Borrowed,
}

impl QuotaClass {
    /// `guaranteed` or `borrowed`.
    pub fn as_str(self) -> &'static str {
        match self {
            QuotaClass::Guaranteed => "guaranteed",
            QuotaClass::Borrowed => "borrowed",
        }
    }
}

/// How one grant counts against its tenant's fleet quotas, and what it counts as.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuotaMark {
    pub class: QuotaClass,
    /// For borrowed work: the quota path and resource whose guarantee it goes beyond.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub over: Option<String>,
    /// Admitted by the node alone, under its lease, while the coordinator was unreachable.
    #[serde(default, skip_serializing_if = "is_false")]
    pub under_lease: bool,
    /// What the grant counts as: catalog model → micro-GPUs (1 GPU = 1,000,000).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub gpus: BTreeMap<String, u64>,
    /// Millicores (from the container's CPU limit).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cpu_milli: u64,
    /// MiB (from the container's memory limit).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub memory_mib: u64,
    /// The gang ([`GANG_ANNOTATION`]) it belongs to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gang: Option<String>,
    /// It writes a checkpoint on SIGTERM ([`PREEMPTION_ANNOTATION`]).
    #[serde(default, skip_serializing_if = "is_false")]
    pub checkpoint: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// How a shared device (MPS or time-sliced) is shared by one allocation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShareGrant {
    /// `mps` or `shared`.
    pub kind: Isolation,
    /// The shared device's UUID.
    pub device: String,
    /// MPS: the thread and memory percentage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub percent: Option<u8>,
    /// MPS: the pinned device memory cap, bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mem_limit_bytes: Option<u64>,
    /// Time-slicing: the sharing domain of the tenant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    /// Time-slicing: replicas of the GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u32>,
}

/// One supervised MPS control daemon in `GET /v1/status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MpsShareStatus {
    pub device: String,
    pub tenant: String,
    pub percent: u8,
    pub mem_limit_bytes: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// `running`, `restarting` or `degraded`, with detail.
    pub state: String,
    pub holders: Vec<String>,
    pub restarts: u32,
    /// Health checks that found the daemon's caps changed (and set them again), since the
    /// share was created or adopted.
    #[serde(default)]
    pub cap_drifts: u32,
}

/// One line of the daemon's audit log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventStatus {
    pub ts_ms: u64,
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_id: Option<String>,
    /// `namespace/pod/container` of a pod's container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<String>,
    pub detail: String,
}

/// Machine-readable reason of an API error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The request itself is malformed.
    BadRequest,
    /// The caller could not be identified as a tenant.
    UnknownTenant,
    /// The policy refuses the request.
    Refused,
    /// The request is allowed but the node has nothing free that fits.
    NoCapacity,
    /// This daemon does not implement that isolation yet.
    NotSupported,
    /// No such allocation.
    NotFound,
    /// The request conflicts with what is recorded (e.g. a different request for an id).
    Conflict,
    /// The daemon failed; nothing was granted.
    Internal,
    /// The request is within its tenant's quota guarantees, but the capacity is lent out:
    /// borrowed work is being stopped to free it, and a retry after the time the message
    /// names is granted. Sent as 503 (Service Unavailable: retry later), as
    /// [`ErrorCode::NoCapacity`] is.
    Reclaiming,
}

impl ErrorCode {
    /// The HTTP status this code is sent with.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::BadRequest => 400,
            ErrorCode::UnknownTenant | ErrorCode::Refused => 403,
            ErrorCode::NotFound => 404,
            ErrorCode::Conflict => 409,
            ErrorCode::NoCapacity | ErrorCode::Reclaiming => 503,
            ErrorCode::NotSupported => 501,
            ErrorCode::Internal => 500,
        }
    }
}

/// The body of every non-2xx answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    pub code: ErrorCode,
    /// A sentence a person can act on: what was asked, by whom, and what refused it.
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<String>,
    /// The policy rule that decided, as a JSON path into the policy (e.g. `tiers.untrusted.allow`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError { code, message: message.into(), tenant: None, request: None, rule: None }
    }
}

/// The state of a device as the daemon tracks it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceState {
    Free,
    Assigned,
    /// Shared by MPS or time-sliced containers (see the allocations for whom).
    Shared,
    /// Released by a tenant and not yet scrubbed: no other tenant gets it.
    Dirty,
    /// Being scrubbed.
    Scrubbing,
    /// A scrub failed (or the device reported errors): out of service until an operator
    /// unquarantines it and a scrub succeeds.
    Quarantined,
    /// A whole GPU in MIG mode: not assignable whole, its instances are.
    MigParent,
}

/// Who holds a device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holder {
    pub container_id: ContainerId,
    pub tenant: TenantPath,
    /// `namespace/pod/container` of a pod's container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<String>,
}

/// The last scrub of a device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScrubSummary {
    pub ok: bool,
    pub bytes_covered: u64,
    pub bytes_total: u64,
    pub nonzero_words: u64,
    pub seconds: f64,
    pub gbps: f64,
    /// Unix milliseconds.
    pub finished_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Why a device is not free, and its last scrub.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Lifecycle {
    /// E.g. `dirty after acme/ml/x/alice`, `quarantined: 12 non-zero words after scrub`.
    pub detail: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scrub: Option<ScrubSummary>,
}

/// One MIG instance in `GET /v1/status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MigInstanceStatus {
    pub uuid: String,
    pub profile: String,
    pub gi_id: u32,
    pub ci_id: u32,
    pub start: u8,
    pub size: u8,
    pub memory_mib: u64,
    pub state: DeviceState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<Holder>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lifecycle: Option<Lifecycle>,
}

/// One GPU in `GET /v1/status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuStatus {
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub minor: u32,
    pub memory_mib: u64,
    pub mig_enabled: bool,
    pub state: DeviceState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<Holder>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lifecycle: Option<Lifecycle>,
    pub instances: Vec<MigInstanceStatus>,
}

/// Which policy the daemon enforces.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyInfo {
    pub version: u64,
    /// Where it came from: `file:PATH` (the `--policy` file), `last-known-good:PATH`
    /// (the signed copy a fleet node keeps on disk) or `coordinator:URL`.
    pub source: String,
    /// sha256 of the policy bytes, hex.
    pub digest: String,
    /// On a node that follows a fleet coordinator: how that is going.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub coordinator: Option<CoordinatorStatus>,
}

/// A fleet node's view of its coordinator(s) (`tesserad --coordinator`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CoordinatorStatus {
    /// The coordinator URLs, in failover order.
    pub urls: Vec<String>,
    /// The name this node reports and uploads usage as.
    pub node_id: String,
    /// Id of the pinned public key: only policies it signed are applied.
    pub trust_key_id: String,
    /// `ok` (connected, enforcing a signed policy, nothing refused since it was applied)
    /// or `degraded`.
    pub health: String,
    /// Whether the last request to a coordinator got a usable answer.
    pub connected: bool,
    /// The coordinator URL last used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current: Option<String>,
    /// The version the agent considers in force.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied_version: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied_at_ms: Option<u64>,
    /// The last time a coordinator answered (Unix ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_contact_ms: Option<u64>,
    /// The last problem of any kind (unreachable, refused, rejected, apply failed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// The last policy revision this node refused, and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_rejection: Option<PolicyRejection>,
    /// Revisions refused since start.
    #[serde(default)]
    pub rejections: u64,
    /// Where the last applied signed policy is kept.
    pub last_known_good: String,
    /// Why the policy source in force is the one in force (a bootstrap file until the
    /// first signed revision, an ignored `--policy` file, `--policy-overrides-fleet`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_reason: Option<String>,
    /// Ledger intervals uploaded for fleet usage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageUploadStatus>,
}

/// A policy revision a node refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyRejection {
    /// The version it claimed (0 when unreadable).
    pub version: u64,
    /// `unsigned`, `forged`, `wrong-key`, `tampered`, `older`, `invalid-policy`, ...
    pub kind: String,
    pub reason: String,
    /// The coordinator URL that served it.
    pub coordinator: String,
    pub at_ms: u64,
}

/// How a fleet node's usage uploads are going.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageUploadStatus {
    /// Every closed ledger interval up to this position of the ledger's hash chain is
    /// uploaded (and the coordinator holds the chain up to here).
    pub uploaded_through_seq: u64,
    /// Closed intervals not uploaded yet.
    pub pending: u64,
    /// Intervals the coordinator stored as new since start.
    pub accepted: u64,
    /// Intervals it already had (retries after a lost answer) since start.
    pub duplicates: u64,
    /// Intervals it already had with other content (the first upload is kept).
    pub conflicts: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_upload_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// `GET /v1/status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeStatus {
    pub node: String,
    /// `sim:<file>` or `nvml`.
    pub backend: String,
    pub policy: PolicyInfo,
    pub gpus: Vec<GpuStatus>,
    pub allocations: Vec<Allocation>,
    #[serde(default)]
    pub mps_shares: Vec<MpsShareStatus>,
    /// The newest audit events, newest first.
    #[serde(default)]
    pub events: Vec<EventStatus>,
    /// Reconciler passes completed since tesserad started: what a caller waits on to know
    /// that the reconciler has looked at the node again.
    #[serde(default)]
    pub reconcile_passes: u64,
    /// Whether MIG instances are cut on demand here (tesserad without `--no-dynamic-mig`
    /// and no layout declared for the node): then every profile of a MIG-mode GPU's model
    /// can be granted, else only the instances already cut. Absent (an older tesserad):
    /// only what is cut.
    #[serde(default)]
    pub mig_cut_on_demand: bool,
    /// The node's own key, which signs its usage uploads (`STATE/fleet/node.key`): what the
    /// operator pins at the coordinator (`tessera nodes register-key NODE PUBLIC_KEY`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_key: Option<NodeKeyInfo>,
}

/// A node's public key, as `tessera status --json` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeKeyInfo {
    /// ed25519, 64 hex digits.
    pub public_key: String,
    /// The first 16 hex digits of its SHA-256.
    pub key_id: String,
}

/// A string map whose keys must be unique: serde_json (like Go) would keep the last of two,
/// silently; a request body is refused instead.
fn unique_keys<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<BTreeMap<String, String>, D::Error> {
    <crate::UniqueMap<String> as Deserialize>::deserialize(d).map(|m| m.0)
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_request_with_an_annotation_key_given_twice_is_refused() {
        let body = r#"{"container_id":"c","runc_root":"/r","bundle":"/b","request":"gpu=1","request_source":"annotation","annotations":{"io.kubernetes.cri.sandbox-namespace":"team-trusted","io.kubernetes.cri.sandbox-namespace":"team-untrusted"}}"#;
        let e = serde_json::from_str::<AllocateRequest>(body).expect_err("refused");
        assert!(
            e.to_string().contains("duplicate key `io.kubernetes.cri.sandbox-namespace`"),
            "{e}"
        );
        let ok = body.replace(r#","io.kubernetes.cri.sandbox-namespace":"team-untrusted""#, "");
        let r: AllocateRequest = serde_json::from_str(&ok).expect("unique keys parse");
        assert_eq!(r.annotations.len(), 1);
    }

    use super::*;
    use serde_json::json;

    fn allocation_json() -> serde_json::Value {
        json!({
            "container_id": "c1", "tenant": "acme/ml/x/alice", "trust": "trusted",
            "request": "mig=1g.10gb", "isolation": "mig",
            "devices": [{"uuid": "MIG-1", "gpu_uuid": "GPU-1", "gpu_index": 0,
                         "model": "H100-80GB", "mig_profile": "1g.10gb", "placement": [0, 1]}],
            "injection": {"devices": [{"path": "/dev/nvidiactl", "major": 195, "minor": 255,
                                       "file_mode": 438}],
                          "env": ["CUDA_VISIBLE_DEVICES=MIG-1"],
                          "mounts": [{"source": "/a", "destination": "/b", "read_only": true}],
                          "gpu_majors": [195]},
            "state": "pending", "created_ms": 1
        })
    }

    /// A field a newer tesserad adds to an answer: an older client reads the rest.
    #[test]
    fn responses_accept_unknown_fields_at_every_level() {
        let plain: Allocation = serde_json::from_value(allocation_json()).expect("allocation");
        let mut v = allocation_json();
        v["added_in_a_later_minor"] = json!({"x": 1});
        v["devices"][0]["numa_node"] = json!(1);
        v["injection"]["cdi_devices"] = json!(["nvidia.com/gpu=0"]);
        v["injection"]["devices"][0]["uid"] = json!(0);
        v["injection"]["mounts"][0]["options"] = json!(["nosuid"]);
        assert_eq!(serde_json::from_value::<Allocation>(v).expect("with extra fields"), plain);

        let e: ApiError = serde_json::from_value(json!({
            "code": "refused", "message": "no", "rule": "tiers.untrusted", "hint": "ask"
        }))
        .expect("error with an extra field");
        assert_eq!(e.rule.as_deref(), Some("tiers.untrusted"));

        let s: NodeStatus = serde_json::from_value(json!({
            "node": "n", "backend": "sim:x", "uptime_s": 3,
            "policy": {"version": 1, "source": "file:p", "digest": "d", "signer": "k"},
            "gpus": [{"index": 0, "uuid": "GPU-1", "model": "H100-80GB", "minor": 0,
                      "memory_mib": 81559, "mig_enabled": false, "state": "free",
                      "instances": [], "temperature_c": 40,
                      "holder": {"container_id": "c", "tenant": "t", "since_ms": 1}}],
            "allocations": [allocation_json()],
            "events": [{"ts_ms": 1, "kind": "grant", "detail": "d", "actor": "x"}]
        }))
        .expect("status with extra fields");
        assert_eq!(s.gpus[0].holder.as_ref().map(|h| h.tenant.as_str()), Some("t"));
    }

    /// Limits are optional (older clients send none), strict (a field of them nobody knows
    /// is refused) and bounded.
    #[test]
    fn container_limits_are_optional_strict_and_bounded() {
        let base = json!({"container_id": "a", "runc_root": "/r", "bundle": "/b", "request": "gpu=1",
                          "request_source": "annotation", "annotations": {}});
        let r: AllocateRequest = serde_json::from_value(base.clone()).expect("no limits");
        assert_eq!(r.limits, None);
        assert!(
            !serde_json::to_string(&r).expect("json").contains("limits"),
            "not sent when absent"
        );
        let mut v = base.clone();
        v["limits"] = json!({"cpu_milli": 1500});
        let r: AllocateRequest = serde_json::from_value(v).expect("limits");
        assert_eq!(r.limits, Some(ContainerLimits { cpu_milli: Some(1500), memory_mib: None }));
        let mut v = base;
        v["limits"] = json!({"cpu_milli": 1, "gpus": 3});
        let e = serde_json::from_value::<AllocateRequest>(v).expect_err("unknown field");
        assert!(e.to_string().contains("unknown field `gpus`"), "{e}");
        let ok = ContainerLimits {
            cpu_milli: Some(ContainerLimits::MAX_CPU_MILLI),
            memory_mib: Some(ContainerLimits::MAX_MEMORY_MIB),
        };
        assert_eq!(ok.validate(), Ok(()));
        let e =
            ContainerLimits { memory_mib: Some(u64::MAX), ..ok }.validate().expect_err("bounded");
        assert!(e.contains("limits.memory_mib"), "{e}");
    }

    /// Grants recorded before quotas read without a mark; a mark round-trips, and its
    /// class is spelled as the fleet's quota protocol spells it.
    #[test]
    fn the_quota_mark_is_optional_and_round_trips() {
        let plain: Allocation = serde_json::from_value(allocation_json()).expect("allocation");
        assert_eq!(plain.quota, None);
        assert!(!serde_json::to_string(&plain).expect("json").contains("quota"));
        let mut v = allocation_json();
        v["quota"] = json!({"class": "borrowed", "over": "quotas.acme.gpus.H100-80GB.guarantee",
                            "gpus": {"H100-80GB": 142_857}, "gang": "g"});
        let a: Allocation = serde_json::from_value(v.clone()).expect("marked");
        let m = a.quota.clone().expect("mark");
        assert_eq!((m.class, m.under_lease, m.cpu_milli), (QuotaClass::Borrowed, false, 0));
        assert_eq!(serde_json::to_value(&a).expect("json")["quota"], v["quota"]);
        assert_eq!(QuotaClass::Guaranteed.as_str(), "guaranteed");
        assert_eq!(ErrorCode::Reclaiming.http_status(), 503);
        assert_eq!(serde_json::to_value(ErrorCode::Reclaiming).expect("json"), json!("reclaiming"));
    }

    /// A field tesserad does not know in a request is an error naming the field, never
    /// silently ignored.
    #[test]
    fn requests_refuse_unknown_fields_by_name() {
        let cases = [
            (
                "allocate",
                json!({"container_id": "a", "runc_root": "/r", "bundle": "/b", "request": "gpu=1",
                       "request_source": "annotation", "annotations": {}, "tenant": "root"}),
                "tenant",
            ),
            ("start", json!({"pid": 1, "bundle": "/b", "privileged": true}), "privileged"),
            ("release", json!({"bundle": "/b", "force": true}), "force"),
        ];
        for (what, body, field) in cases {
            let err = match what {
                "allocate" => serde_json::from_value::<AllocateRequest>(body).map(|_| ()),
                "start" => serde_json::from_value::<StartRequest>(body).map(|_| ()),
                _ => serde_json::from_value::<ReleaseRequest>(body).map(|_| ()),
            }
            .expect_err(what)
            .to_string();
            assert!(err.contains(&format!("unknown field `{field}`")), "{what}: {err}");
        }
    }
}
