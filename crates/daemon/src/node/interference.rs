//! Interference between co-located tenants, detected and answered (docs/GPU-HEALTH.md).
//!
//! Every telemetry tick, each MPS or time-sliced device whose containers were all measured
//! becomes one `interference::DeviceSample` (each container's SM and memory use, its class,
//! its own latency report) for the detector (pure, with hysteresis); what it finds goes to
//! the responder (pure, the policy's steps). Here the findings and steps become events
//! (`interference`, naming victim, aggressor, device, signal and the evidence) and marks;
//! the throttles and stops are returned to the controller, which carries them out without
//! the node lock and records them ([`Node::record_interference_steps`]).
//!
//! Marks (`<state>/interference.json`, kept across restarts): pairs of tenants kept apart
//! (no later MPS or time-sliced placement puts one on a device where the other holds a
//! share: [`Node::fenced_for`]) and victims whose next start is hardened to a MIG instance
//! or a whole GPU where their tier allows ([`Node::hardened_request`]). Whole GPUs and MIG
//! instances held alone are never sampled, so nothing is done to a tenant on a device of
//! its own.

use std::collections::{BTreeMap, BTreeSet};

use interference::{DeviceSample, Finding, ShareSample, Step};
use serde::{Deserialize, Serialize};
use tessera_api::telemetry::IncidentStatus;
use tessera_api::{Allocation, GpuRequest, Isolation, WorkloadClass};
use tracing::{info, warn};

use super::revoke::{Refused, Target};
use super::{internal, Node};
use crate::error::CoreError;

/// The marks file beside `state.db`.
pub const MARKS_FILE: &str = "interference.json";

/// A victim whose next start is hardened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HardenMark {
    pub tenant: String,
    /// Its pod container (`namespace/pod/container`), else its container id.
    pub workload: String,
    pub device: String,
    pub aggressor_tenant: String,
    pub at_ms: u64,
}

/// What the controller decided to remember.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Marks {
    /// Tenant pairs kept apart (each pair sorted).
    #[serde(default)]
    pub anti_affine: BTreeSet<(String, String)>,
    #[serde(default)]
    pub harden: Vec<HardenMark>,
}

/// The detector, the responder, the open incidents and the marks.
#[derive(Debug, Default)]
pub struct InterferenceState {
    detector: interference::Detector,
    responder: interference::Responder,
    open: BTreeMap<(String, String), IncidentStatus>,
    /// (device, victim, aggressor, signal) -> incidents opened (for /metrics).
    pub opened_total: BTreeMap<(String, String, String, String), u64>,
    pub marks: Marks,
}

impl InterferenceState {
    /// The marks kept in `path` (none when it is absent or unreadable: logged).
    pub fn load(path: &std::path::Path) -> InterferenceState {
        let marks = match crate::durable::load_json::<Marks>(path, "interference marks") {
            Ok(m) => m.unwrap_or_default(),
            Err(e) => {
                warn!("{e}; starting without interference marks");
                Marks::default()
            }
        };
        InterferenceState { marks, ..InterferenceState::default() }
    }
}

/// The identity a container keeps across restarts: its pod container, else its id.
pub fn workload_key(a_workload: Option<&tessera_api::cri::Workload>, container_id: &str) -> String {
    a_workload.map_or_else(|| container_id.to_string(), |w| w.display_name())
}

impl Node {
    fn marks_path(&self) -> std::path::PathBuf {
        self.store.path().with_file_name(MARKS_FILE)
    }

    fn save_marks(&self) {
        if let Err(e) = crate::durable::store_json(
            &self.marks_path(),
            "interference marks",
            &self.interference.marks,
        ) {
            warn!("{e}");
        }
    }

    /// The class of `tenant`'s container asking with `annotations`: its
    /// `tessera.io/class` (exactly `latency` or `batch`, else refused), else the policy's.
    pub(crate) fn class_of(
        &self,
        tenant: &str,
        annotations: &BTreeMap<String, String>,
    ) -> Result<WorkloadClass, CoreError> {
        let declared = match annotations.get(policy::CLASS_ANNOTATION) {
            None => None,
            Some(v) => Some(WorkloadClass::parse(v).ok_or_else(|| {
                CoreError::bad_request(format!(
                    "annotation {}: `{}` is not a class: expected `latency` or `batch`",
                    policy::CLASS_ANNOTATION,
                    tessera_api::untrusted(v).max_chars(64)
                ))
            })?),
        };
        Ok(self.policy.policy.interference().class_of(tenant, declared))
    }

    /// Whole GPUs and shared devices `tenant` may not have now because of where others
    /// run: every GPU of an NVLink domain where another tenant holds a GPU
    /// (`topology.isolate_nvlink_domains`), and every device where a tenant kept apart
    /// from it holds an MPS or time-sliced share (interference anti-affinity).
    pub(crate) fn fenced_for(
        &self,
        tenant: &str,
        _workload: Option<&str>,
    ) -> Result<BTreeSet<String>, CoreError> {
        let mut out = BTreeSet::new();
        let isolate = self.policy.policy.topology().isolate_nvlink_domains;
        let foes: BTreeSet<&str> = self
            .interference
            .marks
            .anti_affine
            .iter()
            .filter_map(|(a, b)| {
                if a == tenant {
                    Some(b.as_str())
                } else if b == tenant {
                    Some(a.as_str())
                } else {
                    None
                }
            })
            .collect();
        if !isolate && foes.is_empty() {
            return Ok(out);
        }
        for a in self.allocations()?.iter().filter(|a| a.tenant != tenant) {
            if isolate {
                for d in &a.devices {
                    let Some(dom) = self.topology.domain(&d.gpu_uuid) else { continue };
                    for m in self.topology.domain_members(dom) {
                        if self.inventory.gpus.iter().any(|g| g.uuid == m && !g.mig_enabled) {
                            out.insert(m.to_string());
                        }
                    }
                }
            }
            if foes.contains(a.tenant.as_str()) {
                if let Some(s) = &a.share {
                    out.insert(s.device.clone());
                }
            }
        }
        Ok(out)
    }

    /// What a victim's start asks for instead of `request` (an MPS or time-sliced share)
    /// once the controller hardened it: the smallest MIG profile of this node whose compute
    /// share covers the request's, else a whole GPU — the first the tenant's tier allows.
    /// `None`: not marked, or the tier allows neither (then the request stands).
    pub(crate) fn hardened_request(
        &self,
        tenant: &policy::Tenant,
        workload: &str,
        request: &GpuRequest,
    ) -> Option<GpuRequest> {
        if !self.policy.policy.interference().harden {
            return None;
        }
        let wanted = match request {
            GpuRequest::Mps { percent } => f64::from(*percent) / 100.0,
            GpuRequest::Shared => 1.0 / f64::from(self.policy.policy.shared_replicas().max(1)),
            _ => return None,
        };
        self.interference
            .marks
            .harden
            .iter()
            .find(|m| m.tenant == tenant.path && m.workload == workload)?;
        let node = &self.inventory.node;
        let mut profiles: Vec<(u8, u8, &str)> = self
            .inventory
            .gpus
            .iter()
            .filter(|g| g.mig_enabled)
            .filter_map(|g| slicer::model(&g.model))
            .flat_map(|m| m.profiles.iter())
            .filter(|p| !p.is_media_extension())
            .filter(|p| f64::from(p.compute_slices) / 7.0 + 1e-9 >= wanted)
            .map(|p| (p.compute_slices, p.size, p.name))
            .collect();
        profiles.sort();
        profiles.dedup();
        profiles
            .into_iter()
            .map(|(_, _, p)| GpuRequest::Mig { profile: p.to_string() })
            .chain(std::iter::once(GpuRequest::Gpu { count: 1 }))
            .find(|r| self.policy.policy.authorize(tenant, r, node).is_ok())
    }

    /// A hardened start was granted: its mark is used up (the next start asks as asked).
    pub(crate) fn hardened_granted(&mut self, a: &Allocation, workload: &str) {
        let before = self.interference.marks.harden.len();
        self.interference
            .marks
            .harden
            .retain(|m| !(m.tenant == a.tenant && m.workload == workload));
        if self.interference.marks.harden.len() != before {
            self.save_marks();
        }
        let detail = format!(
            "step harden: asked {}, granted {} ({}) on {}: its last run was degraded by a co-tenant",
            a.request,
            a.isolation.as_str(),
            a.devices.iter().map(|d| d.mig_profile.clone().unwrap_or_else(|| "whole GPU".into())).collect::<Vec<_>>().join(", "),
            a.devices.iter().map(|d| d.uuid.as_str()).collect::<Vec<_>>().join(", ")
        );
        info!(container = %a.container_id, "{detail}");
        let _ = self.store.event("interference", Some(&a.container_id), &detail);
    }

    /// The open incidents, for telemetry.
    pub(crate) fn open_incidents(&self) -> Vec<IncidentStatus> {
        self.interference.open.values().cloned().collect()
    }

    /// Run the detector over the shared devices of the last telemetry; record findings and
    /// marks; return the throttles and stops for the controller.
    pub(crate) fn detect_interference(
        &mut self,
        allocations: &[Allocation],
    ) -> Result<Vec<Step>, CoreError> {
        let settings = self.policy.policy.interference().clone();
        self.interference.detector.thresholds = interference::Thresholds {
            min_share: settings.min_share,
            saturation: settings.saturation,
            confirm: settings.confirm_samples,
            clear: settings.clear_samples,
        };
        self.interference.responder.settings = interference::Settings {
            throttle_factor_percent: settings.throttle_factor_percent,
            min_percent: settings.min_percent,
            anti_affinity: settings.anti_affinity,
            harden: settings.harden,
            stop_after: settings.stop_after_samples,
            confirm: settings.confirm_samples,
        };
        let mut by_device: BTreeMap<&str, Vec<&Allocation>> = BTreeMap::new();
        for a in allocations.iter().filter(|a| a.state == tessera_api::AllocationState::Running) {
            if let Some(s) =
                a.share.as_ref().filter(|s| matches!(s.kind, Isolation::Mps | Isolation::Shared))
            {
                by_device.entry(s.device.as_str()).or_default().push(a);
            }
        }
        let mut steps = Vec::new();
        for (device, holders) in by_device {
            let Some(dev) = self.telemetry.devices.iter().find(|d| d.uuid == device) else {
                continue;
            };
            let (Some(sm), Some(bw)) = (dev.sm_active, dev.dram_active) else { continue };
            let mut shares = Vec::new();
            for a in &holders {
                let Some(u) = self
                    .telemetry
                    .containers
                    .iter()
                    .find(|c| c.container_id == a.container_id && c.device == device)
                else {
                    continue;
                };
                let (Some(s), Some(m)) = (u.sm, u.mem) else { continue };
                shares.push(ShareSample {
                    id: a.container_id.to_string(),
                    tenant: a.tenant.to_string(),
                    latency: a.class == Some(WorkloadClass::Latency),
                    sm: s,
                    bw: m,
                    latency_ms: u.latency_ms,
                    booked: a
                        .share
                        .as_ref()
                        .and_then(|s| s.percent)
                        .map(|p| f64::from(p.min(100)) / 100.0),
                });
            }
            if shares.len() != holders.len() {
                continue; // not every share measured: no judgement
            }
            let sample = DeviceSample {
                device: device.to_string(),
                at_ms: self.telemetry.at_ms,
                sm,
                bw,
                shares,
            };
            let findings = self.interference.detector.observe(&sample);
            if !settings.enabled {
                // Off: the baselines are still learnt, nothing is judged or done.
                self.interference.detector.forget_alarms();
                self.interference.open.clear();
                continue;
            }
            for f in findings {
                let caps: BTreeMap<String, u8> = self
                    .telemetry
                    .containers
                    .iter()
                    .filter_map(|c| c.mps_threads.map(|t| (c.container_id.clone(), t)))
                    .collect();
                let found = self.interference.responder.steps(&f, |id| caps.get(id).copied());
                self.record_finding(&f, allocations);
                for step in found {
                    match step {
                        Step::AntiAffinity { ref incident } => {
                            let mut pair =
                                [incident.victim_tenant.clone(), incident.aggressor_tenant.clone()];
                            pair.sort();
                            let [a, b] = pair;
                            let detail = format!(
                                "step anti-affinity: tenants {a} and {b} are kept apart from now on (no later MPS or time-sliced placement puts them on one device); {}",
                                incident.evidence()
                            );
                            self.interference.marks.anti_affine.insert((a, b));
                            self.save_marks();
                            self.note_step(&step, &detail, &incident.victim.clone());
                        }
                        Step::Harden { ref incident } => {
                            let victim =
                                allocations.iter().find(|a| a.container_id == incident.victim);
                            let workload = workload_key(
                                victim.and_then(|a| a.workload.as_ref()),
                                &incident.victim,
                            );
                            let mark = HardenMark {
                                tenant: incident.victim_tenant.clone(),
                                workload: workload.clone(),
                                device: incident.device.clone(),
                                aggressor_tenant: incident.aggressor_tenant.clone(),
                                at_ms: crate::now_ms(),
                            };
                            self.interference.marks.harden.retain(|m| {
                                !(m.tenant == mark.tenant && m.workload == mark.workload)
                            });
                            self.interference.marks.harden.push(mark);
                            self.save_marks();
                            let detail = format!(
                                "step harden: the next start of {workload} ({}) asks for a MIG instance or a whole GPU where its tier allows; {}",
                                incident.victim_tenant,
                                incident.evidence()
                            );
                            self.note_step(&step, &detail, &incident.victim.clone());
                        }
                        Step::Throttle { .. } | Step::Stop { .. } => steps.push(step),
                    }
                }
            }
        }
        Ok(steps)
    }

    fn record_finding(&mut self, f: &Finding, allocations: &[Allocation]) {
        match f {
            Finding::Opened(i) => {
                let detail = format!(
                    "opened on {}: {} ({}) degraded by {} ({}) through {}: {}",
                    i.device,
                    i.victim,
                    i.victim_tenant,
                    i.aggressor,
                    i.aggressor_tenant,
                    i.signal.as_str(),
                    i.evidence()
                );
                warn!(victim = %i.victim, aggressor = %i.aggressor, device = %i.device, signal = i.signal.as_str(), "interference {detail}");
                let _ = self.store.event("interference", Some(&i.victim), &detail);
                *self
                    .interference
                    .opened_total
                    .entry((
                        i.device.clone(),
                        i.victim.clone(),
                        i.aggressor.clone(),
                        i.signal.as_str().into(),
                    ))
                    .or_default() += 1;
                self.interference.open.insert(
                    (i.device.clone(), i.victim.clone()),
                    IncidentStatus {
                        device: i.device.clone(),
                        victim: i.victim.clone(),
                        victim_tenant: i.victim_tenant.clone(),
                        aggressor: i.aggressor.clone(),
                        aggressor_tenant: i.aggressor_tenant.clone(),
                        signal: i.signal.as_str().into(),
                        share: i.share,
                        opened_ms: i.at_ms,
                        steps: Vec::new(),
                    },
                );
            }
            Finding::Persists { incident: i, .. } => {
                if let Some(o) =
                    self.interference.open.get_mut(&(i.device.clone(), i.victim.clone()))
                {
                    o.share = i.share;
                    o.aggressor = i.aggressor.clone();
                    o.aggressor_tenant = i.aggressor_tenant.clone();
                }
            }
            Finding::Cleared { device, victim } => {
                let _ = allocations;
                if let Some(o) = self.interference.open.remove(&(device.clone(), victim.clone())) {
                    let detail = format!(
                        "cleared on {device}: {victim} ({}) is back above its threshold (steps taken: {})",
                        o.victim_tenant,
                        if o.steps.is_empty() { "none".into() } else { o.steps.join(", ") }
                    );
                    info!("interference {detail}");
                    let _ = self.store.event("interference", Some(victim), &detail);
                }
            }
        }
    }

    fn note_step(&mut self, step: &Step, detail: &str, container: &str) {
        let i = step.incident();
        if let Some(o) = self.interference.open.get_mut(&(i.device.clone(), i.victim.clone())) {
            let word = match step {
                Step::Throttle { from_percent, to_percent, .. } => {
                    format!("throttle {from_percent}->{to_percent}")
                }
                other => other.name().to_string(),
            };
            o.steps.push(word);
        }
        info!(container, "interference {detail}");
        let _ = self.store.event("interference", Some(container), detail);
    }

    /// Record the throttles the controller carried out (`Ok(before)` or why not), and say
    /// whom a stop step stops (their targets; the stops run on threads of their own).
    pub fn record_interference_steps(
        &mut self,
        done: Vec<(Step, Result<u8, mpsd::MpsError>)>,
    ) -> Result<Vec<Target>, CoreError> {
        let records = self.store.all().map_err(internal)?;
        let mut stop = Vec::new();
        for (step, result) in done {
            let i = step.incident().clone();
            match (&step, result) {
                (Step::Throttle { to_percent, .. }, Ok(before)) => {
                    let detail = format!(
                        "step throttle: the MPS active thread percentage of {} ({}) on {} lowered from {before} to {to_percent}, daemon-side; {}",
                        i.aggressor, i.aggressor_tenant, i.device, i.evidence()
                    );
                    let s = Step::Throttle {
                        incident: i.clone(),
                        from_percent: before,
                        to_percent: *to_percent,
                    };
                    self.note_step(&s, &detail, &i.aggressor);
                }
                (Step::Throttle { .. }, Err(e)) => {
                    let detail = format!(
                        "step throttle of {} ({}) on {} failed: {e}; {}",
                        i.aggressor,
                        i.aggressor_tenant,
                        i.device,
                        i.evidence()
                    );
                    warn!("interference {detail}");
                    let _ = self.store.event("interference", Some(&i.aggressor), &detail);
                }
                (Step::Stop { .. }, _) => {
                    // The aggressor is its tenant: each of its active containers there.
                    let ids: Vec<&String> = if i.aggressors.is_empty() {
                        vec![&i.aggressor]
                    } else {
                        i.aggressors.iter().collect()
                    };
                    for id in ids {
                        let Some(r) = records.iter().find(|r| &r.allocation.container_id == id)
                        else {
                            continue;
                        };
                        let detail = format!(
                            "step stop: {id} ({}) still degrades {} on {} after the earlier steps: SIGTERM, SIGKILL after {} s; {}",
                            i.aggressor_tenant,
                            i.victim,
                            i.device,
                            self.policy.policy.interference().stop_grace_s,
                            i.evidence()
                        );
                        self.note_step(&step, &detail, id);
                        stop.push(Target {
                            refused: Refused::of(
                                &r.allocation,
                                "interference.stop_after_samples".into(),
                                format!("it degrades {} on {}", i.victim, i.device),
                            ),
                            pid_start: r.pid_start,
                        });
                    }
                }
                _ => {}
            }
        }
        Ok(stop)
    }
}
