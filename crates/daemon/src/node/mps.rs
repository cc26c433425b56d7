//! MPS: resuming supervision after a start, recording health events, stopping idle daemons.

use std::sync::Arc;

use super::{mps_err, Node};
use crate::error::CoreError;
use tessera_api::{Allocation, Isolation, ShareGrant};
use tracing::warn;

impl Node {
    /// After a start: take over the MPS control daemons that outlived the last tesserad,
    /// then make the supervisor's holders agree with the recorded grants — a holder with no
    /// grant is released, a grant whose daemon is gone gets its daemon back (caps set
    /// before any client connects again). Returns (adopted, released, restarted).
    pub fn resume_mps(&mut self) -> Result<(usize, usize, usize), CoreError> {
        let report = self.mps.adopt_existing().map_err(mps_err)?;
        for e in &report.events {
            self.record_mps_event(e);
        }
        let allocs = self.allocations()?;
        let granted: std::collections::BTreeSet<(String, String)> = allocs
            .iter()
            .filter_map(|a| {
                a.share
                    .as_ref()
                    .filter(|s| s.kind == Isolation::Mps)
                    .map(|s| (s.device.clone(), a.container_id.to_string()))
            })
            .collect();
        let mut released = 0;
        for sh in self.mps.shares() {
            for holder in &sh.holders {
                if !granted.contains(&(sh.device.clone(), holder.clone())) {
                    self.mps.release(&sh.device, &sh.tenant, holder).map_err(mps_err)?;
                    released += 1;
                }
            }
        }
        let mut restarted = 0;
        let live: std::collections::BTreeSet<(String, String)> = self
            .mps
            .shares()
            .into_iter()
            .flat_map(|sh| sh.holders.into_iter().map(move |h| (sh.device.clone(), h)))
            .collect();
        for a in
            allocs.iter().filter(|a| a.share.as_ref().is_some_and(|s| s.kind == Isolation::Mps))
        {
            let Some(s) = &a.share else { continue };
            if !live.contains(&(s.device.clone(), a.container_id.to_string())) {
                let ensured = self.mps.ensure_share(&self.share_request(a, s));
                self.record_daemon_cgroups();
                ensured.map_err(mps_err)?;
                restarted += 1;
            }
        }
        Ok((report.adopted.len(), released, restarted))
    }

    /// Ping every MPS control daemon; restart the dead with backoff, record every crash.
    /// The MPS supervisor, for health checks run outside the node lock (it has its own
    /// lock; the node takes it only while holding the node lock, never the other way round).
    pub fn mps_supervisor(&self) -> Arc<mpsd::Supervisor> {
        Arc::clone(&self.mps)
    }

    /// Records what a health check found; returns how many events.
    pub fn record_mps_events(&mut self, events: &[mpsd::HealthEvent]) -> usize {
        for e in events {
            self.record_mps_event(e);
        }
        events.len()
    }

    pub(super) fn record_mps_event(&mut self, e: &mpsd::HealthEvent) {
        let detail = serde_json::to_string(e).unwrap_or_else(|_| format!("{e:?}"));
        warn!(event = %detail, "mps supervision");
        if let Err(err) = self.store.event("mps", None, &detail) {
            warn!("cannot record an MPS event: {err}");
        }
    }

    pub(super) fn share_request(&self, a: &Allocation, s: &ShareGrant) -> mpsd::ShareRequest {
        mpsd::ShareRequest {
            device: s.device.clone(),
            tenant: a.tenant.to_string(),
            holder: a.container_id.to_string(),
            percent: s.percent.unwrap_or(100),
            mem_limit_bytes: s.mem_limit_bytes.unwrap_or(0),
        }
    }

    /// Stop the MPS control daemons with no container (on a clean stop). Daemons that
    /// serve live containers keep running — stopping them would kill tenant work — and
    /// are adopted by the next tesserad.
    pub fn quit_idle_mps(&mut self) {
        for sh in self.mps.shares() {
            if sh.holders.is_empty() {
                let _ = self.mps.release(&sh.device, &sh.tenant, "");
            }
        }
    }
}
