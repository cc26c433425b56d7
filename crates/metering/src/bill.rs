//! The terms a bill is made on (pure): which paths hold a floor, which are charged and
//! which only shown, and whether work lost to preemption is billed. They come from the
//! policy that prices the bill (`fleet::billing::terms_of`); [`crate::aggregate`] applies
//! them.
//!
//! Two prices, as the design asks:
//!
//! - **Floors by reservation.** Every quota path with a GPU guarantee is billed its *own
//!   floor* (its guarantee less the guarantees of its nearest descendants that set one,
//!   which are billed to them) over the whole window, at the model's reserved rate, used
//!   or not. Guaranteed work that runs inside a floor costs nothing more: the floor paid
//!   for it.
//! - **Bursts by consumption.** Borrowed work (class `burst`) is billed its GPU-seconds at
//!   the burst rate; guaranteed work of a tenant with no guarantee of that model on its
//!   chain (a policy without quotas, or a model a quota does not bound) its GPU-seconds at
//!   the reserved rate.
//! - **Topology premium.** Intervals of a multi-GPU grant inside one NVLink domain add the
//!   model's `nvlink_premium_per_gpu_hour` per GPU-hour, whatever their class.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::LedgerError;

/// Whether a path's bill is charged to it or only shown to it.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Report only: the amounts are shown, nobody is charged.
    #[default]
    Showback,
    /// The amounts are the path's charges.
    Chargeback,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Showback => "showback",
            Mode::Chargeback => "chargeback",
        }
    }
}

/// What happens to the cost of work a quota reclaim stopped.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Preempted {
    /// Billed like any other work (shown as `preempted_*` too).
    #[default]
    Bill,
    /// Reported, not billed: its cost is `waived_cost`.
    Waive,
}

impl Preempted {
    pub fn as_str(self) -> &'static str {
        match self {
            Preempted::Bill => "bill",
            Preempted::Waive => "waive",
        }
    }
}

/// The terms of a bill beyond the price list.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Terms {
    /// Each quota path's GPU guarantee per catalog model, in micro-GPUs (1 GPU = 10^6).
    #[serde(default)]
    pub guarantees: BTreeMap<String, BTreeMap<String, u64>>,
    /// Bill the floors. The fleet's report does (and a node that is its own fleet); a node
    /// in a fleet does not (its guarantees are the fleet's, billed once by the coordinator).
    #[serde(default)]
    pub bill_floors: bool,
    /// Floors are billed up to this time at most (when the report was made: no floor is
    /// billed ahead of time). `None`: to the end of the window.
    #[serde(default)]
    pub as_of_ms: Option<u64>,
    /// Billing mode per tenant path; a path without one takes its nearest ancestor's, else
    /// `default_mode`.
    #[serde(default)]
    pub modes: BTreeMap<String, Mode>,
    #[serde(default)]
    pub default_mode: Mode,
    #[serde(default)]
    pub preempted: Preempted,
}

/// `path` and its ancestors, innermost first: `a/b/c`, `a/b`, `a`.
pub(crate) fn chain(path: &str) -> impl Iterator<Item = &str> {
    let mut next = Some(path);
    std::iter::from_fn(move || {
        let here = next?;
        next = here.rfind('/').map(|i| &here[..i]);
        Some(here)
    })
}

/// Whether `path` is `ancestor` or inside it.
fn is_within(path: &str, ancestor: &str) -> bool {
    path == ancestor
        || (path.len() > ancestor.len()
            && path.starts_with(ancestor)
            && path.as_bytes()[ancestor.len()] == b'/')
}

impl Terms {
    /// The mode of `tenant`: its own, else its nearest ancestor's, else the default.
    pub fn mode_of(&self, tenant: &str) -> Mode {
        chain(tenant).find_map(|p| self.modes.get(p).copied()).unwrap_or(self.default_mode)
    }

    /// The innermost path on `tenant`'s chain with a guarantee of `model`: the floor its
    /// guaranteed work runs in (`None`: no floor covers it; it is billed by consumption).
    pub fn floor_of<'a>(&self, tenant: &'a str, model: &str) -> Option<&'a str> {
        chain(tenant)
            .find(|p| self.guarantees.get(*p).and_then(|g| g.get(model)).is_some_and(|g| *g > 0))
    }

    /// Every (path, model) with a guarantee, and its own floor in micro-GPUs: the
    /// guarantee less the guarantees of its nearest descendants that set one of that model
    /// (those are billed to them), never below 0.
    pub fn own_floors(&self) -> BTreeMap<(String, String), u64> {
        let mut out = BTreeMap::new();
        for (path, models) in &self.guarantees {
            for (model, &g) in models.iter().filter(|(_, g)| **g > 0) {
                let has = |p: &str| {
                    self.guarantees.get(p).and_then(|m| m.get(model)).is_some_and(|g| *g > 0)
                };
                let children: u64 = self
                    .guarantees
                    .iter()
                    .filter(|(d, _)| d.as_str() != path && is_within(d, path) && has(d))
                    // Nearest: no guaranteed path strictly between it and `path`.
                    .filter(|(d, _)| chain(d).skip(1).take_while(|e| *e != path).all(|e| !has(e)))
                    .filter_map(|(_, m)| m.get(model))
                    .sum();
                out.insert((path.clone(), model.clone()), g.saturating_sub(children));
            }
        }
        out
    }

    /// Checks the paths named (1 to 4 non-empty segments).
    pub fn validate(&self) -> Result<(), LedgerError> {
        for p in self.guarantees.keys().chain(self.modes.keys()) {
            crate::interval::validate_tenant(p)
                .map_err(|e| LedgerError::BadQuery(format!("terms: {e}")))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn terms(g: &[(&str, u64)]) -> Terms {
        Terms {
            guarantees: g
                .iter()
                .map(|(p, n)| (p.to_string(), [("H100".to_string(), n * 1_000_000)].into()))
                .collect(),
            ..Terms::default()
        }
    }

    #[test]
    fn own_floors_leave_out_what_nearest_guaranteed_children_hold() {
        let t = terms(&[("acme", 16), ("acme/ml", 4), ("acme/ml/cv", 1), ("acme/web/x", 2)]);
        let own: Vec<(String, u64)> =
            t.own_floors().into_iter().map(|((p, _), g)| (p, g / 1_000_000)).collect();
        // acme: 16 - 4 (acme/ml) - 2 (acme/web/x; acme/web sets none); acme/ml/cv counts
        // against acme/ml, not acme.
        assert_eq!(
            own,
            [
                ("acme".into(), 10),
                ("acme/ml".into(), 3),
                ("acme/ml/cv".into(), 1),
                ("acme/web/x".into(), 2)
            ]
        );
        assert_eq!(t.floor_of("acme/ml/cv/alice", "H100"), Some("acme/ml/cv"));
        assert_eq!(t.floor_of("acme/ml/nlp", "H100"), Some("acme/ml"));
        assert_eq!(t.floor_of("acme/web/y", "H100"), Some("acme"));
        assert_eq!(t.floor_of("beta", "H100"), None);
        assert_eq!(t.floor_of("acme/ml", "A100"), None, "no guarantee of that model");
    }

    #[test]
    fn modes_are_inherited_down_the_tree() {
        let t = Terms {
            modes: [
                ("acme".to_string(), Mode::Chargeback),
                ("acme/lab".to_string(), Mode::Showback),
            ]
            .into(),
            ..Terms::default()
        };
        assert_eq!(t.mode_of("acme/ml/x"), Mode::Chargeback);
        assert_eq!(t.mode_of("acme/lab/y/z"), Mode::Showback);
        assert_eq!(t.mode_of("beta"), Mode::Showback, "the default");
        assert_eq!(serde_json::to_string(&Mode::Chargeback).expect("json"), "\"chargeback\"");
    }
}
