//! ECC: quarantine a GPU whose uncorrectable error count rose. The counts are read in
//! [`EccProbe::read`], outside the node lock (an NVML query on a GPU in a bad state can take
//! seconds); [`Node::record_ecc`] judges them under it.

use std::sync::Arc;

use slicer::GpuBackend;
use tracing::{info, warn};

use super::{internal, Node};
use crate::error::CoreError;

/// What to read for an ECC check: taken under the node lock, read outside it.
#[derive(Debug)]
pub struct EccProbe {
    backend: Arc<dyn GpuBackend>,
    gpus: Vec<String>,
}

/// The uncorrectable ECC count of each GPU that reported one.
#[derive(Debug, Default)]
pub struct EccReadings(Vec<(String, u64)>);

impl EccProbe {
    /// Ask the backend for every GPU's count (blocking; call without the node lock). A GPU
    /// that cannot tell is skipped, a failed read logged.
    pub fn read(&self) -> EccReadings {
        let mut out = Vec::new();
        for gpu in &self.gpus {
            match self.backend.uncorrectable_ecc_errors(gpu) {
                Ok(Some(n)) => out.push((gpu.clone(), n)),
                Ok(None) => {}
                Err(e) => warn!(gpu = %gpu, "reading ECC errors failed: {e}"),
            }
        }
        EccReadings(out)
    }
}

impl Node {
    /// The GPUs whose ECC counts [`Node::record_ecc`] wants, and the backend to ask.
    pub fn ecc_probe(&self) -> EccProbe {
        EccProbe {
            backend: Arc::clone(&self.backend),
            gpus: self.inventory.gpus.iter().map(|g| g.uuid.clone()).collect(),
        }
    }

    /// [`Node::ecc_probe`], read and recorded in one go (for callers that hold the node
    /// alone: tests, tools). The daemon reads outside its lock.
    pub fn check_ecc(&mut self) -> Result<Vec<String>, CoreError> {
        let readings = self.ecc_probe().read();
        self.record_ecc(readings)
    }

    /// Quarantine every GPU (and its MIG instances) whose uncorrectable ECC count rose since
    /// the last look. The counts seen are kept in the store, so a rise while no tesserad
    /// watched (stopped, crashed, upgraded) is caught at the first look after start. The
    /// very first reading of a GPU is its baseline. A count below the baseline means the
    /// driver reset its volatile counter (driver reload, reboot): it becomes the new
    /// baseline, and is logged. A quarantined device in use stays with its container, and
    /// is not handed out again after it is released. Returns the GPUs quarantined now.
    /// `readings` come from [`EccProbe::read`].
    pub fn record_ecc(&mut self, readings: EccReadings) -> Result<Vec<String>, CoreError> {
        let mut hit = Vec::new();
        let baselines = self.store.ecc_baselines().map_err(internal)?;
        for (uuid, count) in readings.0 {
            // A GPU gone from the inventory since the probe (none today: GPUs are fixed) is
            // skipped; its MIG instances are the current ones.
            let Some(g) = self.inventory.gpus.iter().find(|g| g.uuid == uuid).cloned() else {
                continue;
            };
            match baselines.get(&g.uuid).copied() {
                // The first reading of this GPU: its baseline.
                None => {}
                Some(seen) if count == seen => continue,
                Some(seen) if count < seen => {
                    let detail = format!("{}: uncorrectable ECC counter went from {seen} to {count} (driver reset it): new baseline", g.uuid);
                    info!("{detail}");
                    let _ = self.store.event("ecc", None, &detail);
                }
                Some(seen) => {
                    let life = self.lifecycle()?;
                    let devices = std::iter::once(g.uuid.clone())
                        .chain(g.instances.iter().map(|i| i.uuid.clone()));
                    for uuid in devices {
                        let current = life
                            .get(&uuid)
                            .map(|(st, _)| st.clone())
                            .unwrap_or(scrub::DeviceState::Free);
                        self.set_state(&uuid, &current.on_ecc_error(count), None)?;
                    }
                    let detail = format!(
                        "{}: quarantined: uncorrectable ECC errors rose from {seen} to {count}",
                        g.uuid
                    );
                    warn!("{detail}");
                    let _ = self.store.event("ecc", None, &detail);
                    hit.push(g.uuid.clone());
                }
            }
            // Written after the quarantine is durable: a crash in between finds the rise
            // again at the next start.
            self.store.set_ecc_baseline(&g.uuid, count).map_err(internal)?;
        }
        Ok(hit)
    }
}
