//! MIG layouts: the plan towards the declared layout and its convergence.

use tracing::info;

use super::Node;
use crate::error::CoreError;
use crate::share::DeviceUse;

/// What a MIG plan or convergence reports.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MigReport {
    /// The plan, as computed before acting.
    pub plan: slicer::LayoutPlan,
    /// The plan as a person reads it.
    pub text: String,
    pub destroyed: Vec<String>,
    pub created: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Node {
    /// Re-read the inventory after the backend changed it (MIG instances created or
    /// destroyed).
    pub(super) fn refresh_inventory(&mut self) -> Result<(), CoreError> {
        self.inventory = self
            .backend
            .inventory()
            .map_err(|e| CoreError::internal(format!("re-reading the GPU inventory: {e}")))?;
        Ok(())
    }

    /// Devices that MIG planning must never destroy or move: everything in use.
    pub(super) fn untouchable(&self) -> Result<std::collections::BTreeSet<String>, CoreError> {
        let mut busy = DeviceUse::of(&self.allocations()?).busy();
        busy.extend(self.lifecycle()?.into_keys()); // dirty memory is never destroyed or re-cut
        Ok(busy)
    }

    /// The difference between the node's MIG layout and the one its pool declares.
    pub fn mig_plan(&self) -> Result<MigReport, CoreError> {
        let layouts = self.policy.policy.mig_layouts(&self.inventory.node);
        let (plan, text) = if layouts.is_empty() {
            // Nothing declared: nothing to plan (and no need to read what is in use).
            let text = format!("no node pool declares a MIG layout for {}: the layout is dynamic (instances are created on demand)\n", self.inventory.node);
            (slicer::LayoutPlan::default(), text)
        } else {
            let plan = slicer::plan(&self.inventory, &self.untouchable()?, &layouts);
            let text = plan.to_string();
            (plan, text)
        };
        Ok(MigReport { plan, text, destroyed: Vec::new(), created: Vec::new(), error: None })
    }

    /// Converge on the declared layout: destroy and create only the difference, never
    /// touching an instance in use (those are reported as blocked).
    pub fn mig_converge(&mut self) -> Result<MigReport, CoreError> {
        let mut report = self.mig_plan()?;
        if report.plan.is_empty() {
            return Ok(report);
        }
        let (applied, result) = slicer::apply_plan(self.backend.as_ref(), &report.plan);
        report.destroyed = applied.destroyed;
        report.created = applied.created.iter().map(|i| i.uuid.clone()).collect();
        report.error = result.err().map(|e| e.to_string());
        let detail = format!(
            "converge: destroyed [{}], created [{}]{}",
            report.destroyed.join(","),
            report.created.join(","),
            report.error.as_deref().map(|e| format!(", stopped: {e}")).unwrap_or_default()
        );
        info!("{detail}");
        let _ = self.store.event("mig", None, &detail);
        self.refresh_inventory()?;
        Ok(report)
    }
}
