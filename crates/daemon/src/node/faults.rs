//! Faults: XID errors quarantine exactly what they reached. The events are drained from the
//! backend in [`FaultProbe::read`], outside the node lock (NVML's event set); the node
//! judges them under it ([`Node::record_faults`]):
//!
//! * the scope of each event is `slicer::xid::scope` (pure): the application's own XIDs
//!   quarantine nothing; a contained ECC error (XID 94) on a MIG instance that instance;
//!   anything else the GPU, its MIG instances and every share on it. An instance the event
//!   names that the inventory does not have fails closed: the whole GPU;
//! * every device in scope goes `Quarantined` (in use or not, `DeviceState::on_fault`), so
//!   no grant lands there, the device plugin lists it `Unhealthy` and the CDI spec drops
//!   what only it offered; it returns only through `tessera device unquarantine` (a health
//!   check, then a clean scrub);
//! * every holder of a device in scope is told (an `xid` event naming its container) and,
//!   where the policy says `faults.stop_holders`, stopped as revoke stops (SIGTERM, grace,
//!   SIGKILL: the plan is returned, carried out by the controller without the lock).

use std::collections::BTreeSet;
use std::sync::Arc;

use slicer::{GpuBackend, XidEvent, XidScope};
use tessera_api::Allocation;
use tracing::{info, warn};

use super::revoke::{Refused, Target};
use super::{internal, Node};
use crate::error::CoreError;

/// What to drain for a fault check: taken under the node lock, read outside it.
#[derive(Debug)]
pub struct FaultProbe {
    backend: Arc<dyn GpuBackend>,
}

/// The XID events drained, or why the backend could not say.
#[derive(Debug)]
pub struct FaultReadings(Result<Vec<XidEvent>, slicer::BackendError>);

impl FaultReadings {
    /// Readings made of `events` (tests, tools).
    pub fn of(events: Vec<XidEvent>) -> FaultReadings {
        FaultReadings(Ok(events))
    }
}

impl FaultProbe {
    /// Drain the backend's XID events (never blocks long: NVML's wait with a 0 ms timeout).
    pub fn read(&self) -> FaultReadings {
        FaultReadings(self.backend.xid_events())
    }
}

/// What a fault check did.
#[derive(Debug, Default)]
pub struct FaultReport {
    /// Devices quarantined now (GPUs and MIG instances).
    pub quarantined: Vec<String>,
    /// Holders to stop (`faults.stop_holders`), with the grace period.
    pub stop: Vec<Target>,
    pub grace: std::time::Duration,
}

impl Node {
    /// The backend to drain XID events from.
    pub fn fault_probe(&self) -> FaultProbe {
        FaultProbe { backend: Arc::clone(&self.backend) }
    }

    /// [`Node::fault_probe`], read and recorded in one go (callers that hold the node alone).
    pub fn check_faults(&mut self) -> Result<FaultReport, CoreError> {
        let readings = self.fault_probe().read();
        self.record_faults(readings)
    }

    /// Quarantine what each event reached, tell its holders, and say whom to stop (see the
    /// module docs). A backend that could not be read is logged; nothing else changes.
    pub fn record_faults(&mut self, readings: FaultReadings) -> Result<FaultReport, CoreError> {
        let events = match readings.0 {
            Ok(e) => e,
            Err(e) => {
                warn!("reading XID events failed: {e}");
                return Ok(FaultReport::default());
            }
        };
        let mut report = FaultReport {
            grace: std::time::Duration::from_secs(self.policy.policy.faults().grace_s),
            ..FaultReport::default()
        };
        if events.is_empty() {
            return Ok(report);
        }
        let records = self.store.all().map_err(internal)?;
        let mut to_stop: BTreeSet<String> = BTreeSet::new();
        for ev in events {
            let Some(gpu) = self.inventory.gpus.iter().find(|g| g.uuid == ev.gpu_uuid).cloned()
            else {
                let detail = format!(
                    "XID {} ({}) on {}, which is no GPU of this node: ignored",
                    ev.xid,
                    slicer::xid::describe(ev.xid),
                    tessera_api::untrusted(&ev.gpu_uuid).max_chars(80)
                );
                warn!("{detail}");
                let _ = self.store.event("xid", None, &detail);
                continue;
            };
            let scope = slicer::xid::scope(&ev, &self.policy.policy.faults().ignore_xids);
            let instance = match scope {
                XidScope::Instance { gi_id, ci_id } => gpu
                    .instances
                    .iter()
                    .find(|i| i.gi_id == gi_id && ci_id.is_none_or(|ci| i.ci_id == ci))
                    .cloned(),
                _ => None,
            };
            // The devices the fault reached: its instance, or (an instance the inventory
            // does not have fails closed) the GPU and all of it.
            let (scope_word, devices): (&str, Vec<String>) = match (&scope, &instance) {
                (XidScope::Instance { .. }, Some(i)) => ("instance", vec![i.uuid.clone()]),
                (XidScope::Application, _) => {
                    let reached = ev
                        .gi_id
                        .and_then(|gi| gpu.instances.iter().find(|i| i.gi_id == gi))
                        .map(|i| vec![i.uuid.clone()])
                        .unwrap_or_else(|| whole(&gpu));
                    ("application", reached)
                }
                _ => ("gpu", whole(&gpu)),
            };
            let at = match (ev.gi_id, ev.ci_id) {
                (Some(gi), Some(ci)) => format!(" (GPU instance {gi}, compute instance {ci})"),
                (Some(gi), None) => format!(" (GPU instance {gi})"),
                _ => String::new(),
            };
            let what =
                format!("XID {} ({}) on {}{at}", ev.xid, slicer::xid::describe(ev.xid), gpu.uuid);
            if scope == XidScope::Application {
                let detail = format!("{what}: caused by the application; nothing quarantined");
                info!("{detail}");
                let _ = self.store.event("xid", None, &detail);
            } else {
                let life = self.lifecycle()?;
                let reason = format!("{what}: {scope_word} quarantined");
                for uuid in &devices {
                    let current = life
                        .get(uuid)
                        .map(|(st, _)| st.clone())
                        .unwrap_or(scrub::DeviceState::Free);
                    self.set_state(uuid, &current.on_fault(reason.clone()), None)?;
                    if !report.quarantined.contains(uuid) {
                        report.quarantined.push(uuid.clone());
                    }
                }
                let detail = format!("{reason}: {}", devices.join(", "));
                warn!("{detail}");
                let _ = self.store.event("xid", None, &detail);
            }
            // Every holder is told; the policy may stop those on what is now quarantined.
            for r in records.iter().filter(|r| holds_any(&r.allocation, &devices)) {
                let a = &r.allocation;
                let stop = scope != XidScope::Application
                    && self.policy.policy.faults().stop_holders
                    && a.pid.is_some();
                let detail = format!(
                    "{what} reached this container's device{}",
                    if scope == XidScope::Application {
                        ": the application's own fault"
                    } else if stop {
                        ": quarantined; stopping it (faults.stop_holders)"
                    } else {
                        ": quarantined; it runs on, nothing new is granted there"
                    }
                );
                let _ = self.store.event("xid", Some(&a.container_id), &detail);
                if stop && to_stop.insert(a.container_id.to_string()) {
                    report.stop.push(Target {
                        refused: Refused::of(
                            a,
                            "faults.stop_holders".into(),
                            format!("{what}: its device is quarantined"),
                        ),
                        pid_start: r.pid_start,
                    });
                }
            }
        }
        Ok(report)
    }
}

/// The GPU and all its MIG instances.
fn whole(gpu: &slicer::Gpu) -> Vec<String> {
    std::iter::once(gpu.uuid.clone()).chain(gpu.instances.iter().map(|i| i.uuid.clone())).collect()
}

/// Whether grant `a` holds (exclusively, or a share of) any of `devices`.
fn holds_any(a: &Allocation, devices: &[String]) -> bool {
    a.devices.iter().any(|d| devices.iter().any(|x| x == d.uuid.as_str()))
        || a.share.as_ref().is_some_and(|s| devices.contains(&s.device))
}
