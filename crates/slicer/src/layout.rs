//! Declared MIG layouts and the plan that converges a node to them without touching
//! anything in use.
//!
//! A node pool's policy may declare, per GPU model, a [`DeclaredLayout`]. [`plan`]
//! compares each MIG GPU's instances with its model's declared layout and answers only
//! the difference: idle instances that are not in the layout are destroyed, missing
//! instances are created, instances in use that are not in the layout are **blocked**
//! (left alone and reported), and creations that cannot happen next to a blocked
//! instance are **deferred** (reported with the reason). Re-planning after the blocked
//! instances are released converges the rest. Unlike mig-parted, nothing is cleared.
//!
//! Execution order ([`apply_plan`]): every destroy first, then creations GPU by GPU with
//! the biggest instances first (the driver can refuse a 3g created after smaller ones).
//! Smaller instances that stay (kept or blocked) may already precede a 3g; if the driver
//! then refuses it, [`apply_plan`] stops with the driver's error and a later plan retries.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use crate::backend::{BackendError, GpuBackend};
pub use crate::catalog::layout::{DeclaredLayout, ParseLayoutError};
use crate::catalog::{self, placement_is_legal, Profile};
use crate::inventory::{Inventory, MigInstance};
use crate::place::slot_mask;

/// An instance the plan leaves as it is (it is in the declared layout).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Kept {
    pub gpu_index: u32,
    pub uuid: String,
    pub profile: String,
    pub start: u8,
}

/// An idle instance the plan destroys (it is not in the declared layout).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PlannedDestroy {
    pub gpu_index: u32,
    pub uuid: String,
    pub profile: String,
    pub start: u8,
}

/// An instance the plan creates.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PlannedCreate {
    pub gpu_index: u32,
    pub profile: String,
    pub start: u8,
}

/// An instance that is not in the declared layout but is in use, so it stays for now.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Blocked {
    pub gpu_index: u32,
    pub uuid: String,
    pub profile: String,
    pub start: u8,
    pub reason: String,
}

/// A declared instance that cannot be created yet, and why (usually: it overlaps a
/// blocked instance).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Deferred {
    pub gpu_index: u32,
    pub profile: String,
    pub start: u8,
    pub reason: String,
}

/// A GPU the plan does not touch, and why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Skipped {
    pub gpu_index: u32,
    pub model: String,
    pub reason: String,
}

/// What converging a node to its declared layouts takes. See [`plan`].
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct LayoutPlan {
    /// Per GPU with a declared layout: `(gpu index, model, layout)`.
    pub declared: Vec<(u32, String, String)>,
    pub keep: Vec<Kept>,
    /// Idle instances to destroy; run before any creation.
    pub destroy: Vec<PlannedDestroy>,
    /// Instances to create, in execution order (GPU by GPU, biggest first).
    pub create: Vec<PlannedCreate>,
    pub blocked: Vec<Blocked>,
    pub deferred: Vec<Deferred>,
    pub skipped: Vec<Skipped>,
}

impl LayoutPlan {
    /// Nothing to create or destroy now.
    pub fn is_empty(&self) -> bool {
        self.create.is_empty() && self.destroy.is_empty()
    }

    /// Every GPU with a declared layout has exactly that layout.
    pub fn is_converged(&self) -> bool {
        self.is_empty() && self.blocked.is_empty() && self.deferred.is_empty()
    }
}

/// The reason recorded for an instance in use.
pub const HELD_REASON: &str = "in use (assigned, dirty or being scrubbed)";

/// Plan the difference between each MIG GPU's instances and the layout its model
/// declares in `declared` (model name → layout; GPUs of other models are left alone).
/// `held`: every uuid in use (assigned, dirty, scrubbing, quarantined); those are never
/// destroyed. Pure and deterministic.
pub fn plan(
    inv: &Inventory,
    held: &BTreeSet<String>,
    declared: &BTreeMap<String, DeclaredLayout>,
) -> LayoutPlan {
    let mut out = LayoutPlan::default();
    let mut gpus: Vec<_> = inv.gpus.iter().collect();
    gpus.sort_by(|a, b| (a.index, &a.uuid).cmp(&(b.index, &b.uuid)));
    for gpu in gpus {
        let Some(layout) = declared.get(&gpu.model) else { continue };
        let skip =
            |reason: String| Skipped { gpu_index: gpu.index, model: gpu.model.clone(), reason };
        let Some(model) = catalog::model(&gpu.model) else {
            out.skipped.push(skip("the catalog does not know this model".into()));
            continue;
        };
        if !gpu.mig_enabled {
            out.skipped.push(skip("MIG mode is off (tessera never changes MIG mode)".into()));
            continue;
        }
        if held.contains(&gpu.uuid) {
            out.skipped.push(skip("the GPU is held whole".into()));
            continue;
        }
        let target = match layout.resolve(model) {
            Ok(t) => t,
            Err(e) => {
                out.skipped.push(skip(format!("declared layout `{layout}` is not legal: {e}")));
                continue;
            }
        };
        out.declared.push((gpu.index, gpu.model.clone(), layout.to_string()));
        let mut wanted: Vec<Option<(&'static Profile, u8)>> =
            target.into_iter().map(Some).collect();
        // What stays on the GPU (kept or blocked) as (profile name, start).
        let mut staying: Vec<(String, u8)> = Vec::new();
        let mut blocked_here: Vec<&MigInstance> = Vec::new();
        let mut insts: Vec<&MigInstance> = gpu.instances.iter().collect();
        insts.sort_by(|a, b| (a.start, &a.uuid).cmp(&(b.start, &b.uuid)));
        for inst in insts {
            let matched = wanted
                .iter_mut()
                .find(|w| w.is_some_and(|(p, s)| p.name == inst.profile && s == inst.start));
            if let Some(slot) = matched {
                *slot = None;
                staying.push((inst.profile.clone(), inst.start));
                out.keep.push(Kept {
                    gpu_index: gpu.index,
                    uuid: inst.uuid.clone(),
                    profile: inst.profile.clone(),
                    start: inst.start,
                });
            } else if held.contains(&inst.uuid) {
                staying.push((inst.profile.clone(), inst.start));
                blocked_here.push(inst);
                out.blocked.push(Blocked {
                    gpu_index: gpu.index,
                    uuid: inst.uuid.clone(),
                    profile: inst.profile.clone(),
                    start: inst.start,
                    reason: format!("not in the declared layout but {HELD_REASON}"),
                });
            } else {
                out.destroy.push(PlannedDestroy {
                    gpu_index: gpu.index,
                    uuid: inst.uuid.clone(),
                    profile: inst.profile.clone(),
                    start: inst.start,
                });
            }
        }
        for (p, start) in wanted.into_iter().flatten() {
            let mut trial: Vec<(&str, u8)> =
                staying.iter().map(|(n, s)| (n.as_str(), *s)).collect();
            trial.push((p.name, start));
            match placement_is_legal(model, &trial) {
                Ok(()) => {
                    staying.push((p.name.to_string(), start));
                    out.create.push(PlannedCreate {
                        gpu_index: gpu.index,
                        profile: p.name.to_string(),
                        start,
                    });
                }
                Err(e) => {
                    let want = slot_mask(start, p.size);
                    let overlapping: Vec<String> = blocked_here
                        .iter()
                        .filter(|b| slot_mask(b.start, b.size) & want != 0)
                        .map(|b| format!("{}@{} {}", b.profile, b.start, b.uuid))
                        .collect();
                    let reason = if overlapping.is_empty() {
                        format!("waits for instances in use: {e}")
                    } else {
                        format!("overlaps {}, which is in use", overlapping.join(" and "))
                    };
                    out.deferred.push(Deferred {
                        gpu_index: gpu.index,
                        profile: p.name.to_string(),
                        start,
                        reason,
                    });
                }
            }
        }
    }
    out
}

impl fmt::Display for LayoutPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut indices: BTreeSet<u32> = BTreeSet::new();
        indices.extend(self.declared.iter().map(|d| d.0));
        indices.extend(self.skipped.iter().map(|s| s.gpu_index));
        if indices.is_empty() {
            return writeln!(f, "no GPU on this node has a declared MIG layout");
        }
        for gpu in indices {
            if let Some(s) = self.skipped.iter().find(|s| s.gpu_index == gpu) {
                writeln!(f, "GPU {gpu} ({}): left alone: {}", s.model, s.reason)?;
                continue;
            }
            let Some((_, model, layout)) = self.declared.iter().find(|d| d.0 == gpu) else {
                continue;
            };
            writeln!(f, "GPU {gpu} ({model}), declared {layout}:")?;
            let mut lines: Vec<(u8, String)> = Vec::new();
            for k in self.keep.iter().filter(|k| k.gpu_index == gpu) {
                lines.push((
                    k.start,
                    format!("  keep      {:<12} @{}  {}", k.profile, k.start, k.uuid),
                ));
            }
            for d in self.destroy.iter().filter(|d| d.gpu_index == gpu) {
                lines.push((
                    d.start,
                    format!("  destroy   {:<12} @{}  {} (idle)", d.profile, d.start, d.uuid),
                ));
            }
            for b in self.blocked.iter().filter(|b| b.gpu_index == gpu) {
                lines.push((
                    b.start,
                    format!("  blocked   {:<12} @{}  {}: {}", b.profile, b.start, b.uuid, b.reason),
                ));
            }
            lines.sort_by_key(|(s, _)| *s);
            for (_, l) in lines {
                writeln!(f, "{l}")?;
            }
            for (n, c) in self.create.iter().filter(|c| c.gpu_index == gpu).enumerate() {
                writeln!(f, "  create    {:<12} @{}  (step {})", c.profile, c.start, n + 1)?;
            }
            for d in self.deferred.iter().filter(|d| d.gpu_index == gpu) {
                writeln!(f, "  deferred  {:<12} @{}  {}", d.profile, d.start, d.reason)?;
            }
        }
        write!(
            f,
            "{} to destroy, {} to create, {} blocked (in use), {} deferred",
            self.destroy.len(),
            self.create.len(),
            self.blocked.len(),
            self.deferred.len()
        )?;
        if self.is_converged() {
            write!(f, "; the node has its declared layout")?;
        } else if self.is_empty() {
            write!(f, "; nothing can change until the blocked instances are released")?;
        }
        writeln!(f)
    }
}

/// What [`apply_plan`] did before it finished or failed.
#[derive(Debug, Default)]
pub struct Applied {
    pub destroyed: Vec<String>,
    pub created: Vec<MigInstance>,
}

/// Carry out a plan on a backend: every destroy, then every create, in the plan's order;
/// stops at the first failure. The caller must hold its allocation lock across
/// [`plan`] and this call, so nothing planned as idle is handed out in between.
pub fn apply_plan(
    backend: &dyn GpuBackend,
    plan: &LayoutPlan,
) -> (Applied, Result<(), BackendError>) {
    let mut done = Applied::default();
    for d in &plan.destroy {
        if let Err(e) = backend.destroy_instance(&d.uuid) {
            return (done, Err(e));
        }
        done.destroyed.push(d.uuid.clone());
    }
    for c in &plan.create {
        match backend.create_instance(c.gpu_index, &c.profile, c.start) {
            Ok(inst) => done.created.push(inst),
            Err(e) => return (done, Err(e)),
        }
    }
    (done, Ok(()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::{Gpu, Majors};

    use crate::place::tests::inst;

    fn node(gpus: Vec<Option<Vec<MigInstance>>>) -> Inventory {
        Inventory {
            node: "t".into(),
            gpus: gpus
                .into_iter()
                .enumerate()
                .map(|(i, mig)| Gpu {
                    index: i as u32,
                    uuid: format!("GPU-{i}"),
                    model: "H100-80GB".into(),
                    minor: i as u32,
                    memory_mib: 81559,
                    mig_enabled: mig.is_some(),
                    instances: mig.unwrap_or_default(),
                })
                .collect(),
            majors: Majors { nvidia: 195, nvidia_uvm: 508, nvidia_caps: Some(509) },
        }
    }

    fn declare(l: DeclaredLayout) -> BTreeMap<String, DeclaredLayout> {
        [("H100-80GB".to_string(), l)].into_iter().collect()
    }

    #[test]
    fn plan_is_only_the_difference() {
        // gpu0: already balanced except one 1g at 2 missing; gpu1: seven idle 1g.
        let inv = node(vec![
            Some(vec![inst("a", "2g.20gb", 0), inst("b", "1g.10gb", 3), inst("c", "3g.40gb", 4)]),
            Some((0..7).map(|s| inst(&format!("o{s}"), "1g.10gb", s)).collect()),
            None,
        ]);
        let p = plan(&inv, &BTreeSet::new(), &declare(DeclaredLayout::AllBalanced));
        assert_eq!(p.keep.len(), 3 + 2, "gpu1 keeps 1g@2 and 1g@3");
        assert_eq!(
            p.destroy.iter().map(|d| d.uuid.as_str()).collect::<Vec<_>>(),
            ["o0", "o1", "o4", "o5", "o6"]
        );
        let creates: Vec<(u32, &str, u8)> =
            p.create.iter().map(|c| (c.gpu_index, c.profile.as_str(), c.start)).collect();
        assert_eq!(creates, [(0, "1g.10gb", 2), (1, "3g.40gb", 4), (1, "2g.20gb", 0)]);
        assert!(p.blocked.is_empty() && p.deferred.is_empty());
        assert_eq!(p.skipped.len(), 1);
        let text = p.to_string();
        assert!(text.contains("GPU 2 (H100-80GB): left alone: MIG mode is off"), "{text}");
        assert!(
            text.contains("5 to destroy, 3 to create, 0 blocked (in use), 0 deferred"),
            "{text}"
        );
    }

    #[test]
    fn held_instances_block_and_defer() {
        let inv = node(vec![Some(vec![inst("x", "1g.10gb", 5), inst("y", "1g.10gb", 0)])]);
        let held: BTreeSet<String> = ["x".to_string()].into_iter().collect();
        let p = plan(&inv, &held, &declare(DeclaredLayout::AllBalanced));
        assert_eq!(p.blocked.len(), 1);
        assert_eq!(p.blocked[0].uuid, "x");
        assert_eq!(p.destroy.iter().map(|d| d.uuid.as_str()).collect::<Vec<_>>(), ["y"]);
        // 3g@4 overlaps x: deferred. The rest is created.
        assert_eq!(p.deferred.len(), 1);
        assert!(p.deferred[0].reason.contains("overlaps 1g.10gb@5 x, which is in use"));
        let creates: Vec<(&str, u8)> =
            p.create.iter().map(|c| (c.profile.as_str(), c.start)).collect();
        assert_eq!(creates, [("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3)]);
        let text = p.to_string();
        assert!(
            text.contains("blocked   1g.10gb      @5  x: not in the declared layout but in use"),
            "{text}"
        );
        assert!(text.contains("deferred  3g.40gb      @4  overlaps"), "{text}");
        assert!(!p.is_converged());

        // Once everything is in place, the plan is empty and says so.
        let done = node(vec![Some(vec![
            inst("a", "2g.20gb", 0),
            inst("b", "1g.10gb", 2),
            inst("c", "1g.10gb", 3),
            inst("d", "3g.40gb", 4),
        ])]);
        let p = plan(&done, &held, &declare(DeclaredLayout::AllBalanced));
        assert!(p.is_converged(), "{p}");
        assert!(p.to_string().contains("the node has its declared layout"));
    }

    #[test]
    fn a_held_instance_in_the_layout_is_kept() {
        let inv = node(vec![Some(vec![inst("x", "1g.10gb", 3)])]);
        let held: BTreeSet<String> = ["x".to_string()].into_iter().collect();
        let p = plan(&inv, &held, &declare(DeclaredLayout::All1g));
        assert_eq!(p.keep.len(), 1);
        assert_eq!(p.create.len(), 6);
        assert!(p.blocked.is_empty());
    }
}
