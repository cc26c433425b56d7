//! One behavioural suite for every [`GpuBackend`] that changes MIG layouts: create,
//! list, destroy, persistence across a reopen (a daemon restart), illegal placements
//! rejected, uuids never reused. CI runs it against [`crate::SimBackend`]; it runs
//! unchanged against [`crate::NvmlBackend`] on a machine whose GPU may be re-cut (never
//! on a lent machine: it creates and destroys instances).
//!
//! The suite needs one GPU in MIG mode whose catalog model is known and that has room for
//! a 1-slice instance; it leaves the layout as it found it (unless a check fails midway).

use std::collections::BTreeSet;

use crate::backend::{BackendError, GpuBackend};
use crate::catalog::{self, placement_is_legal};
use crate::inventory::{Gpu, Inventory, MigInstance};

/// Opens the backend under test; called again to simulate a daemon restart.
pub type Open<'a> = &'a dyn Fn() -> Result<Box<dyn GpuBackend>, BackendError>;

/// A failed check: what was expected and what happened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("backend conformance: {0}")]
pub struct Failure(pub String);

fn fail<T>(msg: impl Into<String>) -> Result<T, Failure> {
    Err(Failure(msg.into()))
}

fn ok<T>(r: Result<T, BackendError>, what: &str) -> Result<T, Failure> {
    r.map_err(|e| Failure(format!("{what}: {e}")))
}

fn all_uuids(inv: &Inventory) -> BTreeSet<String> {
    inv.gpus.iter().flat_map(|g| g.instances.iter().map(|i| i.uuid.clone())).collect()
}

fn gpu_of(inv: &Inventory, index: u32) -> Result<&Gpu, Failure> {
    inv.gpu(index).ok_or_else(|| Failure(format!("GPU {index} vanished from the inventory")))
}

/// Run the suite; on success, the checks that passed, one line each.
pub fn run(open: Open<'_>) -> Result<Vec<String>, Failure> {
    let mut passed = Vec::new();
    let backend = ok(open(), "open")?;
    let initial = ok(backend.inventory(), "inventory")?;

    // A MIG GPU of a catalog model with a free 1-slice placement.
    let mut target = None;
    for g in initial.gpus.iter().filter(|g| g.mig_enabled) {
        let Some(model) = catalog::model(&g.model) else { continue };
        let Some(one) = model
            .profiles
            .iter()
            .find(|p| p.compute_slices == 1 && p.size == 1 && !p.is_media_extension())
        else {
            continue;
        };
        let layout: Vec<(&str, u8)> =
            g.instances.iter().map(|i| (i.profile.as_str(), i.start)).collect();
        let free = one.starts.iter().copied().find(|&s| {
            let mut l = layout.clone();
            l.push((one.name, s));
            placement_is_legal(model, &l).is_ok()
        });
        if let Some(start) = free {
            target = Some((g.index, model, one, start));
            break;
        }
    }
    let Some((gpu, model, one, start)) = target else {
        return fail("no MIG GPU of a known model with room for a 1-slice instance");
    };

    // Create, and the inventory lists exactly the new instance in addition.
    let created = ok(backend.create_instance(gpu, one.name, start), "create")?;
    if (created.profile.as_str(), created.start, created.size) != (one.name, start, one.size) {
        return fail(format!(
            "created {}@{} size {}, asked for {}@{start} size {}",
            created.profile, created.start, created.size, one.name, one.size
        ));
    }
    if all_uuids(&initial).contains(&created.uuid) {
        return fail(format!("new instance reuses the uuid {} of an existing one", created.uuid));
    }
    let after = ok(backend.inventory(), "inventory after create")?;
    let listed: Vec<&MigInstance> =
        gpu_of(&after, gpu)?.instances.iter().filter(|i| i.uuid == created.uuid).collect();
    if listed != [&created] {
        return fail(format!("inventory lists {listed:?} for the created {created:?}"));
    }
    let mut expected = all_uuids(&initial);
    expected.insert(created.uuid.clone());
    if all_uuids(&after) != expected {
        return fail("create changed other instances");
    }
    passed.push(format!("create {}@{start} on GPU {gpu} and list it", one.name));

    // Illegal requests are refused and change nothing.
    let mut illegal: Vec<(u32, String, u8, &str)> = vec![
        (gpu, one.name.to_string(), start, "an overlapping placement"),
        (gpu, "9g.999gb".to_string(), 0, "an unknown profile"),
        (u32::MAX, one.name.to_string(), 0, "an unknown GPU"),
    ];
    if let Some(p) = model.profiles.iter().find(|p| p.starts.len() < 7) {
        if let Some(bad) = (0..8u8).find(|s| !p.starts.contains(s)) {
            illegal.push((gpu, p.name.to_string(), bad, "an illegal start slot"));
        }
    }
    if let Some(off) = after.gpus.iter().find(|g| !g.mig_enabled) {
        illegal.push((off.index, one.name.to_string(), 0, "a GPU not in MIG mode"));
    }
    for (g, p, s, what) in &illegal {
        if let Ok(i) = backend.create_instance(*g, p, *s) {
            let _ = backend.destroy_instance(&i.uuid);
            return fail(format!("created {p}@{s} on GPU {g}: {what} must be refused"));
        }
    }
    if ok(backend.inventory(), "inventory")? != after {
        return fail("a refused create changed the inventory");
    }
    passed.push(format!("refuse {}", illegal.iter().map(|i| i.3).collect::<Vec<_>>().join(", ")));

    // A restart sees the change.
    drop(backend);
    let backend = ok(open(), "reopen")?;
    if ok(backend.inventory(), "inventory after reopen")? != after {
        return fail("the created instance did not survive a reopen");
    }
    passed.push("a reopen sees the created instance".into());

    // Destroy, and destroying again is an error.
    ok(backend.destroy_instance(&created.uuid), "destroy")?;
    let gone = ok(backend.inventory(), "inventory after destroy")?;
    if gone != initial {
        return fail(
            "after destroying the created instance the inventory differs from the initial one",
        );
    }
    if backend.destroy_instance(&created.uuid).is_ok() {
        return fail("destroying a destroyed instance succeeded");
    }
    passed.push("destroy it; a second destroy is refused".into());

    // Re-create at the same placement: a fresh uuid.
    let again = ok(backend.create_instance(gpu, one.name, start), "re-create")?;
    if again.uuid == created.uuid {
        return fail(format!("re-created instance got the old uuid {}", again.uuid));
    }
    drop(backend);
    let backend = ok(open(), "reopen")?;
    ok(backend.destroy_instance(&again.uuid), "destroy after reopen")?;
    if ok(backend.inventory(), "final inventory")? != initial {
        return fail("the final inventory differs from the initial one");
    }
    passed.push("re-create at the same placement gets a fresh uuid; destroy after a reopen".into());
    Ok(passed)
}
