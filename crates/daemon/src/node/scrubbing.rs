//! Scrubs: the next device to scrub, a scrub's outcome, an operator's unquarantine. The
//! scrub itself runs in a child process outside the node lock ([`ScrubJob::run`]).

use super::Node;
use crate::error::CoreError;
use tracing::{info, warn};

/// How scrubs are run: a child process, so no CUDA state ever lives in the daemon.
#[derive(Debug, Clone)]
pub struct ScrubSetup {
    /// The binary with the `scrub` subcommand (`tessera`).
    pub exe: std::path::PathBuf,
    /// Simulated hardware: the fault-injection file the sim scrubber reads.
    pub sim_faults: Option<std::path::PathBuf>,
}

/// A scrub to run outside the node lock: [`Node::next_scrub`] or [`Node::unquarantine`]
/// hands it out, [`Node::finish_scrub`] takes the result.
#[derive(Debug)]
pub struct ScrubJob {
    pub device: String,
    pub child: scrub::ScrubChild,
}

impl ScrubJob {
    /// Run the scrub child to its report (blocking; call without holding the node lock).
    pub fn run(&self) -> Result<scrub::ScrubReport, scrub::ScrubError> {
        self.child.run()
    }
}

impl Node {
    /// The next device to scrub, marked scrubbing (durably) before it is handed out, so a
    /// daemon killed mid-scrub resumes it after restart.
    pub fn next_scrub(&mut self) -> Result<Option<ScrubJob>, CoreError> {
        let policy = self.scrub_policy();
        let pick = self
            .lifecycle()?
            .into_iter()
            .find(|(u, (st, _))| st.needs_scrub() && !self.scrubs_in_flight.contains(u));
        let Some((uuid, (st, _))) = pick else { return Ok(None) };
        match st.on_scrub_start(&policy) {
            Ok(next @ scrub::DeviceState::Scrubbing { .. }) => {
                self.set_state(&uuid, &next, None)?;
                Ok(Some(self.scrub_job(&uuid)))
            }
            Ok(other) => {
                // Too many attempts: quarantined without another try.
                warn!(device = %uuid, state = other.name(), "scrub not started");
                let _ = self.store.event("scrub", None, &format!("{uuid}: {}", other.name()));
                self.set_state(&uuid, &other, None)?;
                Ok(None)
            }
            Err(e) => Err(CoreError::internal(format!("device {uuid}: {e}"))),
        }
    }

    pub(super) fn scrub_job(&mut self, uuid: &str) -> ScrubJob {
        self.scrubs_in_flight.insert(uuid.to_string());
        let mut child = scrub::ScrubChild::new(&self.scrub.exe, uuid, self.scrub_policy().timeout);
        if let Some(mem) = self.backend.sim_memory_file(uuid) {
            child = child.sim(&mem, self.scrub.sim_faults.as_deref());
        }
        ScrubJob { device: uuid.to_string(), child }
    }

    /// Record a scrub's outcome: clean and verified → free; anything else → quarantined.
    pub fn finish_scrub(
        &mut self,
        device: &str,
        result: Result<scrub::ScrubReport, scrub::ScrubError>,
    ) -> Result<scrub::DeviceState, CoreError> {
        self.scrubs_in_flight.remove(device);
        let policy = self.scrub_policy();
        let current =
            self.lifecycle()?.remove(device).map(|(st, _)| st).unwrap_or(scrub::DeviceState::Free);
        let (next, report) = match result {
            Ok(report) => (current.on_scrub_result(&report, &policy), Some(report)),
            Err(e) => (current.on_scrub_failed(&e.to_string()), None),
        };
        let next = next.map_err(|e| CoreError::internal(format!("device {device}: {e}")))?;
        self.set_state(device, &next, report.as_ref())?;
        let detail = match &report {
            Some(r) => format!(
                "{device}: {} after scrub ({} of {} bytes, {} non-zero words, {:.3} s, {:.1} GB/s)",
                next.name(),
                r.bytes_covered,
                r.bytes_total,
                r.nonzero_words,
                r.seconds,
                r.gbps
            ),
            None => format!("{device}: {}", serde_json::to_string(&next).unwrap_or_default()),
        };
        if next == scrub::DeviceState::Free {
            info!("{detail}");
        } else {
            warn!("{detail}");
        }
        let _ = self.store.event("scrub", None, &detail);
        Ok(next)
    }

    /// An operator asks for a quarantined device back: it must pass the backend's health
    /// check ([`slicer::GpuBackend::device_health`]), then it is scrubbed again, and returns
    /// to service only if that scrub succeeds.
    pub fn unquarantine(&mut self, device: &str) -> Result<ScrubJob, CoreError> {
        let current = self.lifecycle()?.remove(device).map(|(st, _)| st);
        // A UUID the node has never heard of is unknown, not "free": neither a GPU or MIG
        // instance of the inventory nor a device with a recorded lifecycle.
        let inventory = self.inventory();
        let known = inventory
            .gpus
            .iter()
            .any(|g| g.uuid == device || g.instances.iter().any(|i| i.uuid == device));
        if current.is_none() && !known {
            return Err(CoreError::not_found(format!(
                    "unknown device {}: this node has no GPU or MIG instance with that UUID (see `tessera status`)",
                    tessera_api::untrusted(device).max_chars(128)
                ),
            ));
        }
        let Some(st @ scrub::DeviceState::Quarantined { .. }) = current else {
            return Err(CoreError::conflict(format!(
                "device {device} is not quarantined ({})",
                current.as_ref().map(|s| s.name()).unwrap_or("free")
            )));
        };
        // The health check first: a device the driver still reports unhealthy (rows
        // pending remapping, pages pending retirement, its GPU lost) is not scrubbed back
        // into service.
        match self.backend.device_health(device) {
            Ok(None) => {}
            Ok(Some(why)) => {
                let _ = self.store.event(
                    "scrub",
                    None,
                    &format!("{device}: unquarantine refused: the health check fails: {why}"),
                );
                return Err(CoreError::conflict(format!(
                    "device {device} stays quarantined: the health check fails: {why}"
                )));
            }
            Err(e) => {
                return Err(CoreError::internal(format!(
                    "device {device} stays quarantined: the health check could not run: {e}"
                )))
            }
        }
        let next = st
            .unquarantine_requested()
            .map_err(|e| CoreError::conflict(format!("device {device}: {e}")))?;
        self.set_state(device, &next, None)?;
        let _ = self.store.event(
            "scrub",
            None,
            &format!("{device}: unquarantine requested, re-scrubbing"),
        );
        Ok(self.scrub_job(device))
    }
}
