//! The `billing` section: how each path's bill is used (shown or charged) and whether work
//! lost to preemption is billed. Prices are `prices`; floors are the `quotas`' guarantees
//! (docs/CHARGEBACK.md says how a bill is made from them).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Whether a path's bill is charged to it or only shown to it (`billing.default_mode`,
/// `billing.modes.<tenant>`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BillingMode {
    /// Report only.
    #[default]
    Showback,
    /// The bill is the path's charge.
    Chargeback,
}

/// Whether the cost of work a quota reclaim stopped is billed (`billing.preempted`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PreemptedWork {
    /// Billed like any other work (and reported as lost to preemption).
    #[default]
    Bill,
    /// Reported, not billed.
    Waive,
}

/// The validated `billing` section (all defaults when the policy has none).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Billing {
    pub default_mode: BillingMode,
    /// Tenant path -> mode; a path without one takes its nearest ancestor's.
    pub modes: BTreeMap<String, BillingMode>,
    pub preempted: PreemptedWork,
}

impl Billing {
    /// The mode of `tenant`: its own, else its nearest ancestor's, else the default.
    pub fn mode_of(&self, tenant: &str) -> BillingMode {
        let mut path = Some(tenant);
        while let Some(p) = path {
            if let Some(m) = self.modes.get(p) {
                return *m;
            }
            path = p.rfind('/').map(|i| &p[..i]);
        }
        self.default_mode
    }
}
