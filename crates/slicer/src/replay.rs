//! Replay a stream of GPU requests against simulated nodes with the real placement code,
//! to compare placement strategies on a real trace (the Alibaba GPU-sharing trace of
//! 2023, `cluster-trace-gpu-v2023`).
//!
//! Event-driven: arrivals and departures sorted by time (departures first at equal
//! times; a request that lasts zero seconds leaves right after the arrivals of its
//! instant). A request that does not fit when it arrives is rejected; there is no queue.
//! Everything is in memory: no file and no backend is touched.
//!
//! See [`MAPPING_DOC`] for how trace rows become requests, and [`Placement`] for the four
//! strategies compared.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tessera_api::GpuRequest;

use crate::catalog::{self, GpuModel, Profile, COMPUTE_SLICES};
use crate::choose::choose;
use crate::inventory::{Gpu, Inventory, Majors, MigInstance};
use crate::layout::DeclaredLayout;
use crate::place::{better, place_scored, DemandMix, PlaceDecision, Strategy};

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
for its duration; capacity is 7 slices per GPU over the span from the first arrival to \
the last departure.";

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
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    let u = (h >> 11) as f64 / (1u64 << 53) as f64; // [0, 1)
    10f64.powf(2.0 + 3.0 * u).round() as u64
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
    if num_gpu == 0 {
        return Mapped::CpuOnly;
    }
    if num_gpu >= 2 || gpu_milli == 0 || gpu_milli >= 1000 {
        return Mapped::Whole(num_gpu);
    }
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
    /// destroyed when released; nodes compared by the same loss (then the fuller node).
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

/// The outcome of one replay.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplayReport {
    pub trace: String,
    pub placement: Placement,
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
    /// GPU is 7 slices even for a small request).
    pub slice_seconds_allocated: u64,
    /// 7 slices × GPUs × (last departure − first arrival).
    pub slice_seconds_capacity: u64,
    /// `slice_seconds_allocated / slice_seconds_capacity`.
    pub utilisation: f64,
    /// Compute-slice-seconds every replayed request asked for (mapped profile or whole
    /// GPUs × duration), admitted or not.
    pub slice_seconds_requested: u64,
    /// Compute-slice-seconds admitted requests asked for (less than allocated when a
    /// request got more than it needed).
    pub slice_seconds_admitted_demand: u64,
    /// Placement decisions made (one per replayed request).
    pub decisions: u64,
    /// Decisions per second of wall time spent deciding (machine-dependent).
    pub decisions_per_sec: f64,
    pub admitted_by_kind: BTreeMap<String, u64>,
    pub rejected_by_kind: BTreeMap<String, u64>,
    /// Rejections while the cluster had at least the request's compute slices free in
    /// total: refused by fragmentation (or by the placement's rules), not by capacity.
    /// What a better placement could at most win back.
    pub rejected_with_free_slices: u64,
    pub synthetic_times: bool,
}

/// Why a replay cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplayError {
    #[error("unknown GPU model `{model}`; known: {known}")]
    UnknownModel { model: String, known: String },
    #[error("a replay needs at least one node")]
    NoNodes,
}

/// Replay `trace` on `nodes` nodes of [`GPUS_PER_NODE`] GPUs of `model` with `placement`.
pub fn replay(
    trace: &Trace,
    nodes: u32,
    model: &str,
    placement: Placement,
) -> Result<ReplayReport, ReplayError> {
    replay_observed(trace, nodes, model, placement, &mut |_| {})
}

/// What the replay shows an observer after each event (tests check invariants here).
#[derive(Debug)]
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) struct Observation<'a> {
    pub nodes: &'a [Inventory],
    pub held: &'a [BTreeSet<String>],
    /// Compute slices held right now.
    pub slices_held: u64,
    /// The request just rejected, if the event was a rejection.
    pub rejected: Option<Mapped>,
}

/// A live grant.
#[derive(Debug)]
enum Grant {
    Mig { node: usize, uuid: String, destroy: bool },
    Whole { node: usize, gpus: Vec<String> },
}

struct Cluster {
    placement: Placement,
    model: &'static GpuModel,
    nodes: Vec<Inventory>,
    held: Vec<BTreeSet<String>>,
    counts: BTreeMap<String, u64>,
    whole_profile: &'static str,
    created: u64,
}

pub(crate) fn replay_observed(
    trace: &Trace,
    nodes: u32,
    model_name: &str,
    placement: Placement,
    observe: &mut dyn FnMut(Observation<'_>),
) -> Result<ReplayReport, ReplayError> {
    let model = catalog::model(model_name).ok_or_else(|| ReplayError::UnknownModel {
        model: model_name.to_string(),
        known: catalog::model_names().collect::<Vec<_>>().join(", "),
    })?;
    if nodes == 0 {
        return Err(ReplayError::NoNodes);
    }
    let mut cluster = Cluster::new(model, nodes, placement);
    let mapped: Vec<Mapped> =
        trace.requests.iter().map(|r| map_request(model, r.num_gpu, r.gpu_milli)).collect();

    // (time, kind, request): departures (0) before arrivals (1) at the same instant,
    // zero-length requests leave (2) after the arrivals of their instant.
    let mut events: Vec<(u64, u8, usize)> = Vec::new();
    let (mut first, mut last) = (u64::MAX, 0u64);
    let mut requested = 0u64;
    for (i, (r, m)) in trace.requests.iter().zip(&mapped).enumerate() {
        if *m == Mapped::CpuOnly {
            continue;
        }
        events.push((r.arrival, 1, i));
        events.push((r.departure, if r.departure > r.arrival { 0 } else { 2 }, i));
        first = first.min(r.arrival);
        last = last.max(r.departure);
        requested = requested.saturating_add(m.slices().saturating_mul(r.departure - r.arrival));
    }
    events.sort_unstable();

    let mut live: BTreeMap<usize, Grant> = BTreeMap::new();
    let mut report = ReplayReport {
        trace: trace.source.clone(),
        placement,
        nodes,
        gpus: nodes.saturating_mul(GPUS_PER_NODE),
        model: model.name.to_string(),
        requests: trace.requests.len() as u64,
        skipped: mapped.iter().filter(|m| **m == Mapped::CpuOnly).count() as u64,
        admitted: 0,
        rejected: 0,
        slice_seconds_allocated: 0,
        slice_seconds_capacity: 0,
        utilisation: 0.0,
        slice_seconds_requested: requested,
        slice_seconds_admitted_demand: 0,
        decisions: 0,
        decisions_per_sec: 0.0,
        admitted_by_kind: BTreeMap::new(),
        rejected_by_kind: BTreeMap::new(),
        rejected_with_free_slices: 0,
        synthetic_times: trace.synthetic_times,
    };
    let mut slices_held = 0u64;
    let mut deciding = std::time::Duration::ZERO;
    for (_, kind, i) in events {
        let (r, m) = (&trace.requests[i], mapped[i]);
        let mut rejected = None;
        if kind == 1 {
            let t0 = Instant::now();
            let grant = cluster.admit(m);
            deciding += t0.elapsed();
            report.decisions += 1;
            match grant {
                Some((grant, slices)) => {
                    report.admitted += 1;
                    *report.admitted_by_kind.entry(m.label()).or_default() += 1;
                    let duration = r.departure - r.arrival;
                    report.slice_seconds_allocated =
                        report.slice_seconds_allocated.saturating_add(slices * duration);
                    report.slice_seconds_admitted_demand =
                        report.slice_seconds_admitted_demand.saturating_add(m.slices() * duration);
                    slices_held += slices;
                    live.insert(i, grant);
                }
                None => {
                    report.rejected += 1;
                    *report.rejected_by_kind.entry(m.label()).or_default() += 1;
                    let free = u64::from(report.gpus) * u64::from(COMPUTE_SLICES) - slices_held;
                    if free >= m.slices() {
                        report.rejected_with_free_slices += 1;
                    }
                    rejected = Some(m);
                }
            }
        } else if let Some(grant) = live.remove(&i) {
            slices_held -= cluster.release(grant);
        }
        observe(Observation { nodes: &cluster.nodes, held: &cluster.held, slices_held, rejected });
    }
    let span = last.saturating_sub(first);
    report.slice_seconds_capacity = u64::from(report.gpus)
        * u64::from(COMPUTE_SLICES)
        * if first == u64::MAX { 0 } else { span };
    if report.slice_seconds_capacity > 0 {
        report.utilisation =
            report.slice_seconds_allocated as f64 / report.slice_seconds_capacity as f64;
    }
    let secs = deciding.as_secs_f64();
    if secs > 0.0 {
        report.decisions_per_sec = report.decisions as f64 / secs;
    }
    Ok(report)
}

impl Cluster {
    fn new(model: &'static GpuModel, nodes: u32, placement: Placement) -> Cluster {
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
        let whole_profile = model
            .profiles
            .iter()
            .max_by_key(|p| (p.compute_slices, p.size))
            .map_or("7g", |p| p.name);
        Cluster {
            placement,
            model,
            held: vec![BTreeSet::new(); inventories.len()],
            nodes: inventories,
            counts: BTreeMap::new(),
            whole_profile,
            created: 0,
        }
    }

    /// Serve a request if it fits: the grant and the compute slices it holds.
    fn admit(&mut self, m: Mapped) -> Option<(Grant, u64)> {
        match (self.placement, m) {
            (_, Mapped::CpuOnly) => None,
            (Placement::Whole, Mapped::Mig(_)) => self.whole_unsliced(1),
            (Placement::Whole, Mapped::Whole(n)) => self.whole_unsliced(n),
            (Placement::Static, Mapped::Mig(p)) => self.static_instance(p),
            (Placement::Static, Mapped::Whole(_)) => None,
            (Placement::Best | Placement::FirstFit, Mapped::Whole(n)) => {
                *self.counts.entry(self.whole_profile.to_string()).or_default() += u64::from(n);
                self.whole_empty_mig(n)
            }
            (Placement::Best | Placement::FirstFit, Mapped::Mig(p)) => {
                *self.counts.entry(p.name.to_string()).or_default() += 1;
                self.dynamic(p)
            }
        }
    }

    /// Whole GPUs of MIG-off nodes, through the daemon's own `choose`.
    fn whole_unsliced(&mut self, n: u32) -> Option<(Grant, u64)> {
        let req = GpuRequest::Gpu { count: n };
        for (node, inv) in self.nodes.iter().enumerate() {
            if let Ok(devices) = choose(inv, &self.held[node], &req) {
                let gpus: Vec<String> = devices.into_iter().map(|d| d.uuid).collect();
                self.held[node].extend(gpus.iter().cloned());
                return Some((
                    Grant::Whole { node, gpus },
                    u64::from(n) * u64::from(COMPUTE_SLICES),
                ));
            }
        }
        None
    }

    /// Whole GPUs of MIG nodes: GPUs with no instance, lowest node and index first.
    fn whole_empty_mig(&mut self, n: u32) -> Option<(Grant, u64)> {
        let want = usize::try_from(n).unwrap_or(usize::MAX);
        for (node, inv) in self.nodes.iter().enumerate() {
            let held = &self.held[node];
            let empty: Vec<String> = inv
                .gpus
                .iter()
                .filter(|g| g.instances.is_empty() && !held.contains(&g.uuid))
                .map(|g| g.uuid.clone())
                .take(want)
                .collect();
            if empty.len() == want {
                self.held[node].extend(empty.iter().cloned());
                return Some((
                    Grant::Whole { node, gpus: empty },
                    u64::from(n) * u64::from(COMPUTE_SLICES),
                ));
            }
        }
        None
    }

    /// The smallest free instance of the static layout that holds `p`.
    fn static_instance(&mut self, p: &'static Profile) -> Option<(Grant, u64)> {
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
                        best = Some((key, i.uuid.clone(), u64::from(ip.compute_slices)));
                    }
                }
            }
        }
        let ((_, _, node, _, _), uuid, slices) = best?;
        self.held[node].insert(uuid.clone());
        Some((Grant::Mig { node, uuid, destroy: false }, slices))
    }

    /// An instance placed by the real engine, created on demand.
    fn dynamic(&mut self, p: &'static Profile) -> Option<(Grant, u64)> {
        let strategy =
            if self.placement == Placement::Best { Strategy::Best } else { Strategy::FirstFit };
        let mix = match strategy {
            Strategy::Best => DemandMix::observed(&self.counts),
            Strategy::FirstFit => DemandMix::uniform(self.model),
        };
        let mut chosen: Option<((i64, u32, usize), PlaceDecision)> = None;
        for (node, inv) in self.nodes.iter().enumerate() {
            let Ok(s) = place_scored(inv, &self.held[node], p.name, strategy, &mix) else {
                continue;
            };
            if strategy == Strategy::FirstFit {
                chosen = Some(((0, 0, node), s.decision));
                break;
            }
            let key = (s.loss, s.free_slots, node);
            if better(&key, chosen.as_ref().map(|c| &c.0)) {
                chosen = Some((key, s.decision));
            }
        }
        let ((_, _, node), decision) = chosen?;
        let uuid = match decision {
            PlaceDecision::Reuse { uuid } => uuid,
            PlaceDecision::Create { gpu_index, start } => self.create(node, gpu_index, p, start)?,
            PlaceDecision::Defragment { destroy, gpu_index, start } => {
                for u in &destroy {
                    self.destroy(node, u);
                }
                self.create(node, gpu_index, p, start)?
            }
        };
        self.held[node].insert(uuid.clone());
        Some((Grant::Mig { node, uuid, destroy: true }, u64::from(p.compute_slices)))
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

    /// Give a grant back; the compute slices it held.
    fn release(&mut self, grant: Grant) -> u64 {
        match grant {
            Grant::Mig { node, uuid, destroy } => {
                self.held[node].remove(&uuid);
                let slices = self.nodes[node]
                    .gpus
                    .iter()
                    .flat_map(|g| &g.instances)
                    .find(|i| i.uuid == uuid)
                    .and_then(|i| self.model.profile(&i.profile))
                    .map_or(0, |p| u64::from(p.compute_slices));
                if destroy {
                    self.destroy(node, &uuid);
                }
                slices
            }
            Grant::Whole { node, gpus } => {
                for g in &gpus {
                    self.held[node].remove(g);
                }
                gpus.len() as u64 * u64::from(COMPUTE_SLICES)
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
