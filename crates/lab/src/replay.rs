//! Replay a stream of GPU requests against simulated nodes with the real placement code,
//! to compare placement strategies on a real trace (the Alibaba GPU-sharing trace of
//! 2023, `cluster-trace-gpu-v2023`).
//!
//! Event-driven: arrivals and departures sorted by time (departures first at equal
//! times; a request that lasts zero seconds leaves right after the arrivals of its
//! instant). A request that does not fit when it arrives is rejected, or waits in a queue
//! ([`Queue`]). Best and first-fit place through [`crate::pack`] (whole GPUs, MIG, and
//! with tier-aware [`Fractions`] MPS and time-slicing). Everything is in memory: no file
//! and no backend is touched.
//!
//! See [`MAPPING_DOC`] for how trace rows become requests, and [`Placement`] for the four
//! strategies compared.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use slicer::fnv1a64;
use tessera_api::GpuRequest;

use crate::pack::{
    self, pack_cluster, Allow, Ask, Choice, DemandCounter, GpuUse, PackMix, PackNode, Rules,
    UNITS_PER_GPU,
};
use slicer::catalog::{self, GpuModel, Profile, COMPUTE_SLICES};
use slicer::choose;
use slicer::inventory::{Gpu, Inventory, Majors, MigInstance};
use slicer::layout::DeclaredLayout;
use slicer::place::{better, Strategy};

/// How trace rows become requests; the same text as the documentation of
/// [`map_request`]. `tessera sim` prints it with its results.
pub const MAPPING_DOC: &str = "\
Mapping of Alibaba trace rows to requests:
- num_gpu = 0: CPU-only; skipped and counted as `skipped`.
- num_gpu >= 1 with gpu_milli >= 1000 (or 0), and every num_gpu >= 2: num_gpu whole \
GPUs on one node.
- num_gpu = 1 with 0 < gpu_milli < 1000: the smallest MIG profile of the GPU model whose \
compute fraction (compute slices / 7) is at least gpu_milli / 1000; smallest = fewest \
compute slices, then fewest memory slots; +me profiles are never chosen. On H100-80GB: \
<= 142 -> 1g.10gb, <= 285 -> 2g.20gb, <= 428 -> 3g.40gb, <= 571 -> 4g.40gb, else \
7g.80gb. Compute, not memory, because the trace records the GPU share a task was \
granted (gpu_milli) and not its GPU memory (memory_mib is host memory).
- Times: arrival = creation_time, departure = deletion_time (seconds); pod_phase and \
scheduled_time are ignored (the replay is the scheduler). Files without time columns \
(openb_pod_list_multigpu50.csv) get synthetic times: row i arrives at 120*i s and lasts \
a log-uniform 100 s to 100,000 s drawn from an FNV-1a hash of the pod name.
- Allocation: a MIG request holds its instance's compute slices, a whole GPU 7 slices, \
for its duration (an MPS share of p% 7p/100 slices); capacity is 7 slices per GPU over \
the span from the first arrival to the last departure.";

/// GPUs per simulated node.
pub const GPUS_PER_NODE: u32 = 8;
/// Synthetic inter-arrival time for traces without times, in seconds.
const SYNTHETIC_GAP_S: u64 = 120;

/// One task of a trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceRequest {
    pub name: String,
    pub num_gpu: u32,
    /// Share of one GPU, in thousandths.
    pub gpu_milli: u32,
    /// Seconds.
    pub arrival: u64,
    /// Seconds; never before `arrival`.
    pub departure: u64,
}

/// A request stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Trace {
    /// Where it came from (a file name).
    pub source: String,
    pub requests: Vec<TraceRequest>,
    /// The file had no time columns: arrivals and durations are synthetic.
    pub synthetic_times: bool,
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{source_name}: no `{column}` column in the header")]
    MissingColumn { source_name: String, column: &'static str },
    #[error("{source_name} line {line}: {message}")]
    Row { source_name: String, line: usize, message: String },
}

impl Trace {
    /// Read an Alibaba `openb_pod_list_*.csv` (columns name, cpu_milli, memory_mib,
    /// num_gpu, gpu_milli, gpu_spec, qos, pod_phase, creation_time, deletion_time,
    /// scheduled_time; only name, num_gpu and gpu_milli are required).
    pub fn load_alibaba(path: &Path) -> Result<Trace, TraceError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| TraceError::Io { path: path.to_path_buf(), source })?;
        let name = path
            .file_name()
            .map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned());
        Trace::parse_alibaba(&name, &text)
    }

    /// [`Trace::load_alibaba`] on text.
    pub fn parse_alibaba(source_name: &str, text: &str) -> Result<Trace, TraceError> {
        let mut lines = text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty());
        let header: Vec<&str> =
            lines.next().map(|(_, h)| h.split(',').map(str::trim).collect()).unwrap_or_default();
        let col = |name: &'static str| header.iter().position(|h| *h == name);
        let need = |name: &'static str| {
            col(name).ok_or(TraceError::MissingColumn {
                source_name: source_name.to_string(),
                column: name,
            })
        };
        let (c_name, c_num, c_milli) = (need("name")?, need("num_gpu")?, need("gpu_milli")?);
        let times = match (col("creation_time"), col("deletion_time")) {
            (Some(c), Some(d)) => Some((c, d)),
            _ => None,
        };
        let mut requests = Vec::new();
        for (n, line) in lines {
            let row = |message: String| TraceError::Row {
                source_name: source_name.to_string(),
                line: n + 1,
                message,
            };
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            let field = |i: usize, what: &str| {
                fields.get(i).copied().ok_or_else(|| row(format!("no {what} field")))
            };
            let number = |i: usize, what: &str| -> Result<u64, TraceError> {
                let f = field(i, what)?;
                f.parse::<u64>().map_err(|_| row(format!("{what} `{f}` is not a whole number")))
            };
            let name = field(c_name, "name")?.to_string();
            let num_gpu = u32::try_from(number(c_num, "num_gpu")?)
                .map_err(|_| row("num_gpu is too large".into()))?;
            let gpu_milli = u32::try_from(number(c_milli, "gpu_milli")?)
                .map_err(|_| row("gpu_milli is too large".into()))?;
            let (arrival, departure) = match times {
                Some((c, d)) => {
                    let a = number(c, "creation_time")?;
                    let d = number(d, "deletion_time")?;
                    (a, d.max(a))
                }
                None => {
                    let i = requests.len() as u64;
                    let a = i.saturating_mul(SYNTHETIC_GAP_S);
                    (a, a.saturating_add(synthetic_duration(&name)))
                }
            };
            requests.push(TraceRequest { name, num_gpu, gpu_milli, arrival, departure });
        }
        Ok(Trace { source: source_name.to_string(), requests, synthetic_times: times.is_none() })
    }
}

/// A log-uniform duration between 100 s and 100,000 s, from a hash of the name.
fn synthetic_duration(name: &str) -> u64 {
    let h = fnv1a64(name.as_bytes());
    let u = (h >> 11) as f64 / (1u64 << 53) as f64; // [0, 1)
    10f64.powf(2.0 + 3.0 * u).round() as u64
}

/// What a trace row asks for, on any GPU model: the one reading of `num_gpu` and
/// `gpu_milli` that the replay ([`map_request`], [`MAPPING_DOC`]) and the quota simulator's
/// jobs (`tessera sim --quota-modes`, [`crate::quota_jobs::quota_jobs`]) share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowAsk {
    /// `num_gpu = 0`: no GPU.
    CpuOnly,
    /// This many whole GPUs on one node: `num_gpu >= 2`, or `gpu_milli` 0 or at least 1000.
    Whole(u32),
    /// `num_gpu = 1` with `0 < gpu_milli < 1000`: this share of one GPU, in thousandths.
    Fraction(u32),
}

impl RowAsk {
    pub fn of(num_gpu: u32, gpu_milli: u32) -> RowAsk {
        if num_gpu == 0 {
            RowAsk::CpuOnly
        } else if num_gpu >= 2 || gpu_milli == 0 || gpu_milli >= 1000 {
            RowAsk::Whole(num_gpu)
        } else {
            RowAsk::Fraction(gpu_milli)
        }
    }
}

impl TraceRequest {
    /// What this row asks for ([`RowAsk::of`]).
    pub fn ask(&self) -> RowAsk {
        RowAsk::of(self.num_gpu, self.gpu_milli)
    }
}

/// The owner of the row called `name` among `n` tenants (None: no tenants): number
/// FNV-1a-64(name) mod n, the mapping every replay and simulation of a trace shares (the
/// trace has no tenant column).
pub fn row_owner(name: &str, n: usize) -> Option<usize> {
    let n = u64::try_from(n).ok().filter(|&n| n > 0)?;
    usize::try_from(fnv1a64(name.as_bytes()) % n).ok()
}

/// What a trace row asks for on a given GPU model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mapped {
    /// No GPU: skipped.
    CpuOnly,
    /// One MIG instance of this profile.
    Mig(&'static Profile),
    /// This many whole GPUs on one node.
    Whole(u32),
}

impl Mapped {
    /// A short label for per-kind counts: the profile name, `gpu=N` or `cpu`.
    pub fn label(&self) -> String {
        match self {
            Mapped::CpuOnly => "cpu".into(),
            Mapped::Mig(p) => p.name.to_string(),
            Mapped::Whole(n) => format!("gpu={n}"),
        }
    }

    /// Compute slices this request needs, at least.
    pub fn slices(&self) -> u64 {
        match self {
            Mapped::CpuOnly => 0,
            Mapped::Mig(p) => u64::from(p.compute_slices),
            Mapped::Whole(n) => u64::from(*n) * u64::from(COMPUTE_SLICES),
        }
    }
}

/// Map a trace row to a request on `model`; the rules are [`MAPPING_DOC`].
pub fn map_request(model: &GpuModel, num_gpu: u32, gpu_milli: u32) -> Mapped {
    let gpu_milli = match RowAsk::of(num_gpu, gpu_milli) {
        RowAsk::CpuOnly => return Mapped::CpuOnly,
        RowAsk::Whole(n) => return Mapped::Whole(n),
        RowAsk::Fraction(milli) => milli,
    };
    let need = u64::from(gpu_milli) * u64::from(COMPUTE_SLICES);
    model
        .profiles
        .iter()
        .filter(|p| !p.is_media_extension() && u64::from(p.compute_slices) * 1000 >= need)
        .min_by_key(|p| (p.compute_slices, p.size))
        .map_or(Mapped::Whole(1), Mapped::Mig)
}

/// The placement strategies `tessera sim` compares.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    /// MIG GPUs, instances created on demand where [`Strategy::Best`] puts them (weights:
    /// the demand observed so far in the replay, whole GPUs counted as the 7g profile),
    /// destroyed when released; the lowest node where the request fits ([`crate::pack`]).
    Best,
    /// As `best`, but each instance at the lowest free start slot of the lowest GPU of
    /// the lowest node that has one ([`Strategy::FirstFit`]).
    FirstFit,
    /// Every GPU cut once into the all-balanced layout ([`DeclaredLayout::AllBalanced`])
    /// and never re-cut; a request gets the smallest free instance with at least its
    /// compute slices and memory. Whole-GPU, 4g and 7g requests cannot be served.
    Static,
    /// No MIG: every request takes whole GPUs (a MIG request one whole GPU).
    Whole,
}

impl Placement {
    pub const ALL: [Placement; 4] =
        [Placement::Best, Placement::FirstFit, Placement::Static, Placement::Whole];

    pub fn as_str(&self) -> &'static str {
        match self {
            Placement::Best => "best",
            Placement::FirstFit => "first-fit",
            Placement::Static => "static",
            Placement::Whole => "whole",
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Placement {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Placement::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| format!("`{s}` is not a placement: best, first-fit, static or whole"))
    }
}

/// How fractions (`num_gpu = 1`, `0 < gpu_milli < 1000`) may be served in a replay.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fractions {
    /// Every row is allowed whole GPUs and MIG only: a fraction takes the smallest MIG
    /// profile that covers it (the mapping in [`MAPPING_DOC`]).
    Mig,
    /// Each row's tenant (see [`Tenants`]) decides: MPS and time-slicing where its tier
    /// allows them (`tessera sim --policy`).
    Tiers(Tenants),
}

impl Fractions {
    pub fn label(&self) -> &'static str {
        match self {
            Fractions::Mig => "mig",
            Fractions::Tiers(_) => "tiers",
        }
    }
}

/// One tenant of a replay: what its tier allows and its sharing domain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimTenant {
    /// Where the mapping found it (the tenant path for `tessera sim --policy`).
    pub key: String,
    /// The tenant path.
    pub tenant: String,
    pub allow: Allow,
    /// Its sharing domain (time-slicing shares a GPU only within one).
    pub domain: String,
}

/// The tenants trace rows are mapped to, and the policy's node-wide rules.
///
/// Mapping: the trace has no tenant column, so row `name` belongs to tenant
/// `tenants[fnv1a64(name) % tenants.len()]`, the list in the order given. `tessera sim
/// --policy FILE` lists the leaves of the policy's tenant tree (tenants with no tenant
/// below them: the ones containers run as) sorted by path; what each may use is what
/// `Policy::authorize` answers for `gpu=1`, `mig=1g.10gb`, `mps=1` and `shared` on node
/// `sim-replay`, its domain `Policy::sharing_domain`. Deterministic, and every tenant
/// gets about the same share of rows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Tenants {
    pub tenants: Vec<SimTenant>,
    pub rules: Rules,
}

impl Tenants {
    /// The tenant of the row called `name` (None: no tenants).
    pub fn of(&self, name: &str) -> Option<usize> {
        row_owner(name, self.tenants.len())
    }

    /// The tenants of `examples/policy.json` as `tessera sim --policy` maps them: the
    /// leaves of its tenant tree sorted by path (bob and dave dev, alice and carol
    /// trusted, guest untrusted; untrusted: gpu, mig; trusted: + mps; dev: + shared),
    /// `mps.max_percent` 75, 4 replicas, sharing domain `notebooks` for
    /// `acme/dev/notebooks`, `tenant:PATH` for every other tenant.
    pub fn example() -> Tenants {
        let untrusted = Allow::MIG_ONLY;
        let trusted = Allow { mps: true, ..untrusted };
        let dev = Allow { shared: true, ..trusted };
        let t = |tenant: &str, allow: Allow, domain: Option<&str>| SimTenant {
            key: tenant.into(),
            tenant: tenant.into(),
            allow,
            domain: domain.map_or_else(|| format!("tenant:{tenant}"), str::to_string),
        };
        Tenants {
            tenants: vec![
                t("acme/dev/notebooks/bob", dev, Some("notebooks")),
                t("acme/dev/scratch/dave", dev, None),
                t("acme/trusted/training/alice", trusted, None),
                t("acme/trusted/training/carol", trusted, None),
                t("acme/untrusted/sandbox/guest", untrusted, None),
            ],
            rules: Rules { mps_max_percent: 75, replicas: 4 },
        }
    }
}

/// What happens to a request that does not fit when it arrives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Queue {
    /// Rejected at once.
    Drop,
    /// Waits up to `max_wait_s` seconds; after every departure the waiting requests are
    /// tried in arrival order (a later one that fits goes ahead of an earlier one that
    /// does not). Admitted, it runs its full duration from then; not admitted in time, it
    /// is rejected.
    Wait { max_wait_s: u64 },
}

/// One replay's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayConfig {
    pub nodes: u32,
    pub model: String,
    pub placement: Placement,
    pub fractions: Fractions,
    pub queue: Queue,
}

impl ReplayConfig {
    /// MIG-only fractions, no queue: what `tessera sim` measured before tiers and queues.
    pub fn mig(nodes: u32, model: &str, placement: Placement) -> ReplayConfig {
        ReplayConfig {
            nodes,
            model: model.to_string(),
            placement,
            fractions: Fractions::Mig,
            queue: Queue::Drop,
        }
    }
}

/// Distribution of a per-event quantity.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Dist {
    pub count: u64,
    pub mean: f64,
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
}

impl Dist {
    fn of(mut v: Vec<f64>) -> Dist {
        if v.is_empty() {
            return Dist::default();
        }
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v[((v.len() as f64 * q) as usize).min(v.len() - 1)];
        Dist {
            count: v.len() as u64,
            mean: v.iter().sum::<f64>() / v.len() as f64,
            p50: at(0.5),
            p99: at(0.99),
            max: v[v.len() - 1],
        }
    }
}

/// The outcome of one replay.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplayReport {
    pub trace: String,
    pub placement: Placement,
    /// `mig` or `tiers` ([`Fractions`]).
    pub fractions: String,
    /// The queue's longest wait in seconds; None: drop on arrival.
    pub max_wait_s: Option<u64>,
    pub nodes: u32,
    pub gpus: u32,
    pub model: String,
    /// Rows in the trace.
    pub requests: u64,
    /// CPU-only rows, not replayed.
    pub skipped: u64,
    pub admitted: u64,
    pub rejected: u64,
    /// Compute-slice-seconds held by admitted requests (what they were given: a whole
    /// GPU is 7 slices even for a small request; an MPS share of p% is 7p/100 slices).
    pub slice_seconds_allocated: u64,
    /// 7 slices × GPUs × (last departure − first arrival).
    pub slice_seconds_capacity: u64,
    /// `slice_seconds_allocated / slice_seconds_capacity`.
    pub utilisation: f64,
    /// Compute-slice-seconds every replayed request asked for (mapped profile or whole
    /// GPUs × duration), admitted or not.
    pub slice_seconds_requested: u64,
    /// Compute-slice-seconds admitted requests asked for, by the MIG mapping.
    pub slice_seconds_admitted_demand: u64,
    /// Requested GPU fraction × seconds of every replayed request, in milli-GPU-seconds
    /// (`num_gpu × 1000` for whole GPUs, `gpu_milli` for a fraction).
    pub demand_requested: u64,
    /// The same for admitted requests: the demand actually served.
    pub demand_admitted: u64,
    /// Highest demand running at once, as a fraction of the GPUs (1.0 = every GPU's
    /// whole capacity asked for and served).
    pub demand_peak: f64,
    /// Mean demand running while some request waited (a queue only): the cluster's
    /// allocated demand at contention. None without a queue or without contention.
    pub demand_at_contention: Option<f64>,
    /// Placement decisions made (one per replayed request, plus queue retries).
    pub decisions: u64,
    /// Decisions per second of wall time spent deciding (machine-dependent).
    pub decisions_per_sec: f64,
    pub admitted_by_kind: BTreeMap<String, u64>,
    pub rejected_by_kind: BTreeMap<String, u64>,
    /// How admitted requests were served: `gpu`, `mig`, `mps`, `shared`.
    pub admitted_by_share: BTreeMap<String, u64>,
    /// Rejections while the cluster had at least the request's compute slices free in
    /// total: refused by fragmentation (or by the placement's rules), not by capacity.
    /// What a better placement could at most win back.
    pub rejected_with_free_slices: u64,
    /// At each request that did not fit on arrival (a rejection, or the start of a wait):
    /// the free capacity, none of which could serve it, as a fraction of the cluster.
    pub fragmentation_at_rejection: Dist,
    /// Rows the policy lets use no kind of GPU share for their request.
    pub refused_by_policy: u64,
    /// Requests that waited (a queue only), and their waits in seconds (admitted ones).
    pub queued: u64,
    pub wait_s: Dist,
    pub synthetic_times: bool,
}

/// Why a replay cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplayError {
    #[error("unknown GPU model `{model}`; known: {known}")]
    UnknownModel { model: String, known: String },
    #[error("a replay needs at least one node")]
    NoNodes,
    #[error("a tier-aware replay needs at least one tenant")]
    NoTenants,
}

/// Replay `trace` on `nodes` nodes of [`GPUS_PER_NODE`] GPUs of `model` with `placement`,
/// MIG-only fractions, no queue.
pub fn replay(
    trace: &Trace,
    nodes: u32,
    model: &str,
    placement: Placement,
) -> Result<ReplayReport, ReplayError> {
    replay_with(trace, &ReplayConfig::mig(nodes, model, placement))
}

/// Replay `trace` with `config`.
pub fn replay_with(trace: &Trace, config: &ReplayConfig) -> Result<ReplayReport, ReplayError> {
    replay_observed(trace, config, &mut |_| {})
}

/// What the replay shows an observer after each event (tests check invariants here).
#[derive(Debug)]
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) struct Observation<'a> {
    pub nodes: &'a [Inventory],
    pub held: &'a [BTreeSet<String>],
    /// The packer's view (best and first-fit).
    pub packs: &'a [PackNode],
    /// Capacity units (1/7000 GPU) held right now.
    pub units_held: u64,
    /// Demand (milli-GPU) running right now.
    pub demand_running: u64,
    /// The request just rejected, if the event was a rejection.
    pub rejected: Option<Mapped>,
    pub waiting: usize,
    /// The event's time, in trace seconds.
    pub time: u64,
    /// The requests (trace indices) started by this event.
    pub started: &'a [usize],
}

/// A live grant.
#[derive(Debug)]
enum Grant {
    Mig { node: usize, uuid: String },
    Whole { node: usize, gpus: Vec<String> },
    Pack { node: usize, choice: Choice, ask: Ask, uuid: Option<String> },
}

struct Cluster {
    placement: Placement,
    model: &'static GpuModel,
    nodes: Vec<Inventory>,
    held: Vec<BTreeSet<String>>,
    packs: Vec<PackNode>,
    counter: DemandCounter,
    mix: PackMix,
    /// (node, GPU) → the 7g instance standing for a GPU that serves MPS or time-slicing,
    /// in the inventory mirror.
    mode_instance: BTreeMap<(usize, u32), String>,
    created: u64,
}

/// One request as replayed: its row, mapping and ask.
#[derive(Debug, Clone, Copy)]
struct Req {
    mapped: Mapped,
    ask: Option<Ask>,
    duration: u64,
}

pub(crate) fn replay_observed(
    trace: &Trace,
    config: &ReplayConfig,
    observe: &mut dyn FnMut(Observation<'_>),
) -> Result<ReplayReport, ReplayError> {
    let model = catalog::model(&config.model).ok_or_else(|| ReplayError::UnknownModel {
        model: config.model.clone(),
        known: catalog::model_names().collect::<Vec<_>>().join(", "),
    })?;
    let nodes = config.nodes;
    if nodes == 0 {
        return Err(ReplayError::NoNodes);
    }
    let placement = config.placement;
    let (rules, tenants) = match &config.fractions {
        Fractions::Mig => (Rules::default(), None),
        Fractions::Tiers(t) if t.tenants.is_empty() => return Err(ReplayError::NoTenants),
        Fractions::Tiers(t) => (t.rules, Some(t)),
    };
    let mut domains: BTreeMap<&str, u32> = BTreeMap::new();
    if let Some(t) = tenants {
        for st in &t.tenants {
            let next = domains.len() as u32;
            domains.entry(st.domain.as_str()).or_insert(next);
        }
    }
    let mut cluster = Cluster::new(model, nodes, placement, rules);
    let reqs: Vec<Req> = trace
        .requests
        .iter()
        .map(|r| {
            let mapped = map_request(model, r.num_gpu, r.gpu_milli);
            let shape = match r.ask() {
                RowAsk::CpuOnly => None,
                RowAsk::Whole(n) => Some((n, 1000)),
                RowAsk::Fraction(milli) => Some((1, milli)),
            };
            let ask = shape.map(|(gpus, milli)| {
                let (allow, tenant, domain) = match tenants
                    .and_then(|t| t.of(&r.name).map(|i| (t, i)))
                {
                    Some((t, i)) => {
                        let st = &t.tenants[i];
                        (st.allow, i as u32, domains.get(st.domain.as_str()).copied().unwrap_or(0))
                    }
                    None => (Allow::MIG_ONLY, 0, 0),
                };
                Ask { gpus, milli, allow, tenant, domain }
            });
            Req { mapped, ask, duration: r.departure - r.arrival }
        })
        .collect();

    // Events (time, kind, request): departures (0) before arrivals (1) at the same
    // instant, zero-length requests leave (2) after the arrivals of their instant, waits
    // expire (3) last.
    let mut events: BinaryHeap<Reverse<(u64, u8, usize)>> = BinaryHeap::new();
    let (mut first, mut last_trace) = (u64::MAX, 0u64);
    let (mut requested, mut demand_requested) = (0u64, 0u64);
    for (i, (r, q)) in trace.requests.iter().zip(&reqs).enumerate() {
        let Some(ask) = q.ask else { continue };
        events.push(Reverse((r.arrival, 1, i)));
        first = first.min(r.arrival);
        last_trace = last_trace.max(r.departure);
        requested = requested.saturating_add(q.mapped.slices().saturating_mul(q.duration));
        demand_requested =
            demand_requested.saturating_add(ask.demand_milli().saturating_mul(q.duration));
    }

    let mut live: BTreeMap<usize, (Grant, u64, u64)> = BTreeMap::new();
    let gpus = nodes.saturating_mul(GPUS_PER_NODE);
    let capacity_units = u64::from(gpus) * UNITS_PER_GPU;
    let mut report = ReplayReport {
        trace: trace.source.clone(),
        placement,
        fractions: config.fractions.label().to_string(),
        max_wait_s: match config.queue {
            Queue::Drop => None,
            Queue::Wait { max_wait_s } => Some(max_wait_s),
        },
        nodes,
        gpus,
        model: model.name.to_string(),
        requests: trace.requests.len() as u64,
        skipped: reqs.iter().filter(|q| q.ask.is_none()).count() as u64,
        admitted: 0,
        rejected: 0,
        slice_seconds_allocated: 0,
        slice_seconds_capacity: 0,
        utilisation: 0.0,
        slice_seconds_requested: requested,
        slice_seconds_admitted_demand: 0,
        demand_requested,
        demand_admitted: 0,
        demand_peak: 0.0,
        demand_at_contention: None,
        decisions: 0,
        decisions_per_sec: 0.0,
        admitted_by_kind: BTreeMap::new(),
        rejected_by_kind: BTreeMap::new(),
        admitted_by_share: BTreeMap::new(),
        rejected_with_free_slices: 0,
        fragmentation_at_rejection: Dist::default(),
        refused_by_policy: 0,
        queued: 0,
        wait_s: Dist::default(),
        synthetic_times: trace.synthetic_times,
    };
    let mut st = Running::default();
    let mut frag = Vec::new();
    let mut waits = Vec::new();
    // Waiting requests in arrival order: (arrival, request).
    let mut waiting: BTreeSet<(u64, usize)> = BTreeSet::new();
    let mut deciding = std::time::Duration::ZERO;
    let mut now = first;
    let (mut contended_time, mut contended_demand) = (0u64, 0u128);
    while let Some(Reverse((t, kind, i))) = events.pop() {
        if !waiting.is_empty() {
            contended_time += t - now;
            contended_demand += u128::from(st.demand) * u128::from(t - now);
        }
        now = t;
        let (r, q) = (&trace.requests[i], reqs[i]);
        let mut rejected = None;
        let mut started = Vec::new();
        match kind {
            1 => {
                let Some(ask) = q.ask else { continue };
                let t0 = Instant::now();
                let grant = cluster.admit(q.mapped, &ask, true);
                deciding += t0.elapsed();
                report.decisions += 1;
                if let Some(g) = grant {
                    st.admit(&mut report, &mut live, &mut events, i, &q, &ask, g, t);
                    started.push(i);
                } else {
                    let allowed = cluster.policy_allows(&ask);
                    if !allowed {
                        report.refused_by_policy += 1;
                    }
                    let free = capacity_units - st.units;
                    frag.push(free as f64 / capacity_units as f64);
                    if free >= q.mapped.slices() * 1000 {
                        report.rejected_with_free_slices += 1;
                    }
                    match config.queue {
                        Queue::Wait { max_wait_s } if allowed => {
                            report.queued += 1;
                            waiting.insert((r.arrival, i));
                            events.push(Reverse((t.saturating_add(max_wait_s), 3, i)));
                        }
                        _ => rejected = Some(reject(&mut report, &q)),
                    }
                }
            }
            3 => {
                if waiting.remove(&(r.arrival, i)) {
                    rejected = Some(reject(&mut report, &q));
                }
            }
            _ => {
                if let Some((grant, units, demand)) = live.remove(&i) {
                    cluster.release(grant);
                    st.units -= units;
                    st.demand -= demand;
                    st.last_departure = st.last_departure.max(t);
                }
                // Try the waiting requests, oldest first.
                let mut admitted_now = Vec::new();
                for &(arrival, w) in &waiting {
                    let Some(ask) = reqs[w].ask else { continue };
                    if !cluster.might_fit(&ask) {
                        continue;
                    }
                    let t0 = Instant::now();
                    let grant = cluster.admit(reqs[w].mapped, &ask, false);
                    deciding += t0.elapsed();
                    report.decisions += 1;
                    if let Some(g) = grant {
                        st.admit(&mut report, &mut live, &mut events, w, &reqs[w], &ask, g, t);
                        waits.push((t - arrival) as f64);
                        admitted_now.push((arrival, w));
                    }
                }
                for k in admitted_now {
                    waiting.remove(&k);
                    started.push(k.1);
                }
            }
        }
        observe(Observation {
            nodes: &cluster.nodes,
            held: &cluster.held,
            packs: &cluster.packs,
            units_held: st.units,
            demand_running: st.demand,
            rejected,
            waiting: waiting.len(),
            time: t,
            started: &started,
        });
    }
    let peak = st.peak;
    let last = st.last_departure.max(last_trace);
    let span = if first == u64::MAX { 0 } else { last.saturating_sub(first) };
    report.slice_seconds_allocated = u64::try_from(st.unit_seconds / 1000).unwrap_or(u64::MAX);
    report.slice_seconds_capacity =
        (u64::from(gpus) * u64::from(COMPUTE_SLICES)).saturating_mul(span);
    if report.slice_seconds_capacity > 0 {
        report.utilisation =
            report.slice_seconds_allocated as f64 / report.slice_seconds_capacity as f64;
    }
    report.demand_peak = peak as f64 / (f64::from(gpus) * 1000.0);
    if contended_time > 0 {
        report.demand_at_contention =
            Some(contended_demand as f64 / contended_time as f64 / (f64::from(gpus) * 1000.0));
    }
    report.fragmentation_at_rejection = Dist::of(frag);
    report.wait_s = Dist::of(waits);
    let secs = deciding.as_secs_f64();
    if secs > 0.0 {
        report.decisions_per_sec = report.decisions as f64 / secs;
    }
    Ok(report)
}

/// What is running: capacity units and demand held, the peak, unit-seconds granted.
#[derive(Debug, Default)]
struct Running {
    units: u64,
    demand: u64,
    peak: u64,
    unit_seconds: u128,
    last_departure: u64,
}

impl Running {
    /// Record an admission at `start` and schedule its departure.
    #[allow(clippy::too_many_arguments)]
    fn admit(
        &mut self,
        report: &mut ReplayReport,
        live: &mut BTreeMap<usize, (Grant, u64, u64)>,
        events: &mut BinaryHeap<Reverse<(u64, u8, usize)>>,
        i: usize,
        q: &Req,
        ask: &Ask,
        (grant, units, share): (Grant, u64, &'static str),
        start: u64,
    ) {
        report.admitted += 1;
        *report.admitted_by_kind.entry(q.mapped.label()).or_default() += 1;
        *report.admitted_by_share.entry(share.to_string()).or_default() += 1;
        report.slice_seconds_admitted_demand = report
            .slice_seconds_admitted_demand
            .saturating_add(q.mapped.slices().saturating_mul(q.duration));
        let demand = ask.demand_milli();
        report.demand_admitted =
            report.demand_admitted.saturating_add(demand.saturating_mul(q.duration));
        self.unit_seconds += u128::from(units) * u128::from(q.duration);
        self.units += units;
        self.demand += demand;
        self.peak = self.peak.max(self.demand);
        let end = start.saturating_add(q.duration);
        events.push(Reverse((end, if q.duration > 0 { 0 } else { 2 }, i)));
        live.insert(i, (grant, units, demand));
    }
}

fn reject(report: &mut ReplayReport, q: &Req) -> Mapped {
    report.rejected += 1;
    *report.rejected_by_kind.entry(q.mapped.label()).or_default() += 1;
    q.mapped
}

impl Cluster {
    fn new(model: &'static GpuModel, nodes: u32, placement: Placement, rules: Rules) -> Cluster {
        let balanced = DeclaredLayout::AllBalanced.resolve(model).unwrap_or_default();
        let inventories = (0..nodes)
            .map(|n| Inventory {
                node: format!("replay-{n}"),
                gpus: (0..GPUS_PER_NODE)
                    .map(|g| Gpu {
                        index: g,
                        uuid: format!("GPU-{n}-{g}"),
                        model: model.name.to_string(),
                        minor: g,
                        memory_mib: model.memory_mib,
                        mig_enabled: placement != Placement::Whole,
                        instances: if placement == Placement::Static {
                            let mut v: Vec<MigInstance> = balanced
                                .iter()
                                .map(|(p, s)| {
                                    MigInstance::planned(format!("MIG-{n}-{g}-{s}"), p, *s)
                                })
                                .collect();
                            v.sort_by_key(|i| i.start);
                            v
                        } else {
                            Vec::new()
                        },
                    })
                    .collect(),
                majors: Majors { nvidia: 195, nvidia_uvm: 508, nvidia_caps: Some(509) },
            })
            .collect::<Vec<_>>();
        Cluster {
            placement,
            model,
            held: vec![BTreeSet::new(); inventories.len()],
            nodes: inventories,
            packs: (0..nodes).map(|_| PackNode::new(model, GPUS_PER_NODE, rules)).collect(),
            counter: DemandCounter::default(),
            mix: PackMix::default(),
            mode_instance: BTreeMap::new(),
            created: 0,
        }
    }

    /// Serve a request if it fits: the grant, the capacity units it holds and how it is
    /// served. `arrival`: count it in the demand mix (not again when a queue retries it).
    fn admit(&mut self, m: Mapped, ask: &Ask, arrival: bool) -> Option<(Grant, u64, &'static str)> {
        match (self.placement, m) {
            (_, Mapped::CpuOnly) => None,
            (Placement::Whole, Mapped::Mig(_)) => self.whole_unsliced(1),
            (Placement::Whole, Mapped::Whole(n)) => self.whole_unsliced(n),
            (Placement::Static, Mapped::Mig(p)) => self.static_instance(p),
            (Placement::Static, Mapped::Whole(_)) => None,
            (Placement::Best | Placement::FirstFit, _) => {
                if arrival {
                    self.counter.record(self.model, ask);
                    if self.placement == Placement::Best {
                        self.mix = self.counter.mix();
                    }
                }
                self.packed(ask)
            }
        }
    }

    /// Whether the policy lets `ask` use any kind of share (best and first-fit; static
    /// and whole serve every row alike).
    fn policy_allows(&self, ask: &Ask) -> bool {
        match self.placement {
            Placement::Static | Placement::Whole => true,
            Placement::Best | Placement::FirstFit => {
                let a = ask.allow;
                if ask.is_whole() {
                    a.gpu || a.mig
                } else {
                    a.gpu || a.mig || a.mps || a.shared
                }
            }
        }
    }

    /// A cheap necessary condition for `ask` to fit now (queue retries skip the rest).
    fn might_fit(&self, ask: &Ask) -> bool {
        match self.placement {
            Placement::Static | Placement::Whole => true,
            Placement::Best | Placement::FirstFit => self.packs.iter().any(|n| {
                if ask.is_whole() {
                    n.free_gpus() >= ask.gpus.max(1)
                } else {
                    let need = u64::from(ask.milli) * 7;
                    n.gpus.iter().any(|g| pack::free_units(g) >= need)
                }
            }),
        }
    }

    /// Best and first-fit: the packer's choice, mirrored into the inventories.
    fn packed(&mut self, ask: &Ask) -> Option<(Grant, u64, &'static str)> {
        let strategy =
            if self.placement == Placement::Best { Strategy::Best } else { Strategy::FirstFit };
        let (node, pick) = pack_cluster(&self.packs, ask, strategy, &self.mix)?;
        let choice = pick.choice;
        let units = choice.units(self.model, ask);
        if !self.packs[node].apply(&choice, ask) {
            return None;
        }
        let mut uuid = None;
        match &choice {
            Choice::Whole { gpus } => {
                for g in gpus {
                    self.held[node].insert(format!("GPU-{node}-{g}"));
                }
            }
            Choice::Mig { gpu, profile, start } => {
                let p = self.model.profile(profile)?;
                let u = self.create(node, *gpu, p, *start)?;
                self.held[node].insert(u.clone());
                uuid = Some(u);
            }
            Choice::Mps { gpu, .. } | Choice::Shared { gpu } => {
                if !self.mode_instance.contains_key(&(node, *gpu)) {
                    let full =
                        self.model.profiles.iter().max_by_key(|p| (p.compute_slices, p.size))?;
                    let u = self.create(node, *gpu, full, 0)?;
                    self.held[node].insert(u.clone());
                    self.mode_instance.insert((node, *gpu), u);
                }
            }
        }
        let kind = choice.kind();
        Some((Grant::Pack { node, choice, ask: *ask, uuid }, units, kind))
    }

    /// Whole GPUs of MIG-off nodes, through the daemon's own `choose`.
    fn whole_unsliced(&mut self, n: u32) -> Option<(Grant, u64, &'static str)> {
        let req = GpuRequest::Gpu { count: n };
        for (node, inv) in self.nodes.iter().enumerate() {
            if let Ok(devices) = choose(inv, &self.held[node], &req) {
                let gpus: Vec<String> = devices.into_iter().map(|d| d.uuid.into()).collect();
                self.held[node].extend(gpus.iter().cloned());
                return Some((Grant::Whole { node, gpus }, u64::from(n) * UNITS_PER_GPU, "gpu"));
            }
        }
        None
    }

    /// The smallest free instance of the static layout that holds `p`.
    fn static_instance(&mut self, p: &'static Profile) -> Option<(Grant, u64, &'static str)> {
        // (compute slices, size, node, GPU index, start): smallest instance first.
        type Key = (u8, u8, usize, u32, u8);
        let mut best: Option<(Key, String, u64)> = None;
        for (node, inv) in self.nodes.iter().enumerate() {
            for g in &inv.gpus {
                for i in &g.instances {
                    if self.held[node].contains(&i.uuid) {
                        continue;
                    }
                    let Some(ip) = self.model.profile(&i.profile) else { continue };
                    if ip.compute_slices < p.compute_slices || ip.memory_mib < p.memory_mib {
                        continue;
                    }
                    let key = (ip.compute_slices, ip.size, node, g.index, i.start);
                    if better(&key, best.as_ref().map(|b| &b.0)) {
                        best = Some((key, i.uuid.clone(), u64::from(ip.compute_slices) * 1000));
                    }
                }
            }
        }
        let ((_, _, node, _, _), uuid, units) = best?;
        self.held[node].insert(uuid.clone());
        Some((Grant::Mig { node, uuid }, units, "mig"))
    }

    fn create(
        &mut self,
        node: usize,
        gpu_index: u32,
        p: &'static Profile,
        start: u8,
    ) -> Option<String> {
        self.created += 1;
        let uuid = format!("MIG-r{}", self.created);
        let gpu = self.nodes.get_mut(node)?.gpus.iter_mut().find(|g| g.index == gpu_index)?;
        gpu.instances.push(MigInstance::planned(uuid.clone(), p, start));
        gpu.instances.sort_by_key(|i| i.start);
        Some(uuid)
    }

    fn destroy(&mut self, node: usize, uuid: &str) {
        if let Some(inv) = self.nodes.get_mut(node) {
            for g in &mut inv.gpus {
                g.instances.retain(|i| i.uuid != uuid);
            }
        }
    }

    /// Give a grant back.
    fn release(&mut self, grant: Grant) {
        match grant {
            Grant::Mig { node, uuid } => {
                self.held[node].remove(&uuid);
            }
            Grant::Whole { node, gpus } => {
                for g in &gpus {
                    self.held[node].remove(g);
                }
            }
            Grant::Pack { node, choice, ask, uuid } => {
                self.packs[node].release(&choice, &ask);
                match &choice {
                    Choice::Whole { gpus } => {
                        for g in gpus {
                            self.held[node].remove(&format!("GPU-{node}-{g}"));
                        }
                    }
                    Choice::Mig { .. } => {
                        if let Some(u) = uuid {
                            self.held[node].remove(&u);
                            self.destroy(node, &u);
                        }
                    }
                    Choice::Mps { gpu, .. } | Choice::Shared { gpu } => {
                        let free =
                            matches!(self.packs[node].gpus.get(*gpu as usize), Some(GpuUse::Free));
                        if free {
                            if let Some(u) = self.mode_instance.remove(&(node, *gpu)) {
                                self.held[node].remove(&u);
                                self.destroy(node, &u);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The four placements on the same trace and node count, as a table a person reads,
/// with how much `best` beats the others on admitted requests.
pub fn comparison_table(reports: &[ReplayReport]) -> String {
    let mut out = String::new();
    if let Some(r) = reports.first() {
        out.push_str(&format!(
            "trace {} ({} rows, {} CPU-only skipped{}), {} nodes x {} {} = {} GPUs\n",
            r.trace,
            r.requests,
            r.skipped,
            if r.synthetic_times { ", synthetic times" } else { "" },
            r.nodes,
            GPUS_PER_NODE,
            r.model,
            r.gpus
        ));
    }
    out.push_str(&format!(
        "{:<10} {:>9} {:>9} {:>14} {:>12} {:>12} {:>14}\n",
        "placement", "admitted", "rejected", "(frag.)", "utilisation", "demand met", "decisions/s"
    ));
    for r in reports {
        let met = if r.slice_seconds_requested > 0 {
            r.slice_seconds_admitted_demand as f64 / r.slice_seconds_requested as f64
        } else {
            0.0
        };
        out.push_str(&format!(
            "{:<10} {:>9} {:>9} {:>14} {:>11.1}% {:>11.1}% {:>14.0}\n",
            r.placement.as_str(),
            r.admitted,
            r.rejected,
            r.rejected_with_free_slices,
            r.utilisation * 100.0,
            met * 100.0,
            r.decisions_per_sec
        ));
    }
    if let Some(best) = reports.iter().find(|r| r.placement == Placement::Best) {
        for other in reports.iter().filter(|r| r.placement != Placement::Best) {
            let diff = best.admitted as i64 - other.admitted as i64;
            let pct =
                if other.admitted > 0 { diff as f64 / other.admitted as f64 * 100.0 } else { 0.0 };
            out.push_str(&format!(
                "best vs {}: {:+} admitted ({:+.1}%)\n",
                other.placement, diff, pct
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h100() -> &'static GpuModel {
        catalog::model("H100-80GB").expect("h100")
    }

    #[test]
    fn maps_gpu_milli_to_the_smallest_profile() {
        let m = h100();
        let name = |n, milli| match map_request(m, n, milli) {
            Mapped::Mig(p) => p.name.to_string(),
            other => other.label(),
        };
        assert_eq!(name(0, 0), "cpu");
        assert_eq!(name(1, 50), "1g.10gb");
        assert_eq!(name(1, 142), "1g.10gb");
        assert_eq!(name(1, 143), "2g.20gb");
        assert_eq!(name(1, 285), "2g.20gb");
        assert_eq!(name(1, 286), "3g.40gb");
        assert_eq!(name(1, 428), "3g.40gb");
        assert_eq!(name(1, 429), "4g.40gb");
        assert_eq!(name(1, 571), "4g.40gb");
        assert_eq!(name(1, 572), "7g.80gb");
        assert_eq!(name(1, 999), "7g.80gb");
        assert_eq!(name(1, 1000), "gpu=1");
        assert_eq!(name(8, 1000), "gpu=8");
        assert_eq!(name(2, 500), "gpu=2");
        assert_eq!(name(1, 0), "gpu=1");
        assert!(MAPPING_DOC.contains("<= 142 -> 1g.10gb, <= 285 -> 2g.20gb"));
    }

    #[test]
    fn one_reading_of_a_row_for_the_replay_and_the_quota_simulator() {
        let m = h100();
        for num_gpu in [0, 1, 2, 3, 8] {
            for milli in [0, 1, 142, 500, 999, 1000, 1001, 4000] {
                let ask = RowAsk::of(num_gpu, milli);
                match (ask, map_request(m, num_gpu, milli)) {
                    (RowAsk::CpuOnly, Mapped::CpuOnly) => assert_eq!(num_gpu, 0),
                    (RowAsk::Whole(n), Mapped::Whole(w)) => assert_eq!((n, w), (num_gpu, num_gpu)),
                    (RowAsk::Fraction(f), Mapped::Mig(p)) => {
                        assert_eq!((num_gpu, f), (1, milli));
                        assert!(u64::from(p.compute_slices) * 1000 >= u64::from(f) * 7);
                    }
                    (a, b) => panic!("({num_gpu}, {milli}): {a:?} but the replay maps {b:?}"),
                }
            }
        }
        assert_eq!(row_owner("p1", 0), None);
        assert_eq!(row_owner("a", 3), Some((0xaf63_dc4c_8601_ec8c_u64 % 3) as usize));
        let t = Tenants::example();
        assert_eq!(t.of("p7"), row_owner("p7", t.tenants.len()));
    }

    #[test]
    fn parses_both_trace_shapes() {
        let with_times = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n\
            p0,1,1,1,1000,,LS,Running,10,20,10\np1,1,1,0,0,,LS,Running,5,4,\n";
        let t = Trace::parse_alibaba("a.csv", with_times).expect("parse");
        assert!(!t.synthetic_times);
        assert_eq!(
            t.requests[0],
            TraceRequest {
                name: "p0".into(),
                num_gpu: 1,
                gpu_milli: 1000,
                arrival: 10,
                departure: 20
            }
        );
        assert_eq!(
            (t.requests[1].arrival, t.requests[1].departure),
            (5, 5),
            "never leaves before arriving"
        );
        let no_times = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1,1,1,460\np1,1,1,2,1000\n";
        let t = Trace::parse_alibaba("b.csv", no_times).expect("parse");
        assert!(t.synthetic_times);
        assert_eq!(t.requests[1].arrival, 120);
        for r in &t.requests {
            let d = r.departure - r.arrival;
            assert!((100..=100_000).contains(&d), "{d}");
        }
        assert_eq!(t, Trace::parse_alibaba("b.csv", no_times).expect("parse"), "deterministic");
        let err = Trace::parse_alibaba("c.csv", "name,num_gpu\n").unwrap_err();
        assert!(err.to_string().contains("no `gpu_milli` column"), "{err}");
        let err = Trace::parse_alibaba("d.csv", "name,num_gpu,gpu_milli\np,x,1\n").unwrap_err();
        assert_eq!(err.to_string(), "d.csv line 2: num_gpu `x` is not a whole number");
    }

    #[test]
    fn placements_parse() {
        for p in Placement::ALL {
            assert_eq!(p.as_str().parse::<Placement>(), Ok(p));
            assert_eq!(serde_json::to_string(&p).expect("ser"), format!("\"{p}\""));
        }
        assert!("worst".parse::<Placement>().is_err());
    }
}
