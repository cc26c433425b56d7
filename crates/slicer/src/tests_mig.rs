//! Tests of dynamic MIG: the simulated backend's create/destroy (and the backend
//! conformance suite on it), property tests of the placement engine against brute-force
//! oracles, and declared layouts applied to a backend. (The replay's invariants are the
//! lab crate's tests: `crates/lab/src/tests_replay.rs`.)

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use proptest::prelude::*;

use crate::backend::{BackendError, GpuBackend};
use crate::catalog::{self, placement_is_legal, LayoutError, MODELS};
use crate::choose::NoFit;
use crate::inventory::{parse_mig_minors, Gpu, Inventory, Majors, MigInstance};
use crate::layout::{apply_plan, plan, DeclaredLayout};
use crate::place::{self, place, DemandMix, PlaceDecision};
use crate::sim::SimBackend;

fn example(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/nodes").join(name)
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write");
    p
}

// ---------------------------------------------------------------- simulated backend

#[test]
fn sim_passes_the_backend_conformance_suite() {
    for node in ["h100x8.json", "a100-40x4.json"] {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = if node == "a100-40x4.json" {
            // The example's only MIG GPU is full: give the suite an empty MIG GPU.
            write(
                dir.path(),
                "a100.json",
                r#"{"node": "a100", "gpus": [{"model": "A100-40GB", "mig": [{"profile": "3g.20gb", "start": 0}, {"profile": "3g.20gb", "start": 4}]}, {"model": "A100-40GB", "mig": []}, {"model": "A100-40GB"}]}"#,
            )
        } else {
            example(node)
        };
        let state = dir.path().join("state");
        let open = || SimBackend::open(&file, &state).map(|b| Box::new(b) as Box<dyn GpuBackend>);
        let passed = crate::conformance::run(&open).expect("conformance");
        assert_eq!(passed.len(), 5, "{passed:?}");
        assert!(
            passed[1].contains("an illegal start slot")
                && passed[1].contains("a GPU not in MIG mode"),
            "{passed:?}"
        );
    }
}

#[test]
fn sim_create_and_destroy_change_files_like_hardware() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sim = SimBackend::open(&example("h100x8.json"), dir.path()).expect("open");
    let before = sim.inventory().expect("inventory");
    // gpu2: 2g@0 (gi1), 2g@2 (gi2), 1g@4 (gi3), 1g@5 (gi4): slots 6-7 free.
    let inst = sim.create_instance(2, "1g.20gb", 6).expect("create");
    assert_eq!(
        (inst.profile.as_str(), inst.start, inst.size, inst.gi_id, inst.ci_id),
        ("1g.20gb", 6, 2, 5, 0)
    );
    assert_eq!(
        (inst.gi_cap_minor, inst.ci_cap_minor),
        (3 + 2 * 135 + 5 * 9, 3 + 2 * 135 + 5 * 9 + 1)
    );
    let mem = std::fs::read(sim.memory_file(&inst.uuid)).expect("memory file");
    assert!(mem.len() == 65536 && mem.iter().all(|&b| b == 0));
    let minors = std::fs::read_to_string(sim.mig_minors_path()).expect("mig-minors");
    assert!(parse_mig_minors(&minors).is_ok());
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("sim/node.json")).expect("state"),
    )
    .expect("json");
    assert_eq!(state["generation"], 1);
    // Instances stay listed by start slot.
    let after = sim.inventory().expect("inventory");
    let starts: Vec<u8> = after.gpus[2].instances.iter().map(|i| i.start).collect();
    assert_eq!(starts, [0, 2, 4, 5, 6]);

    // Destroy an original instance: its GI id is free again and goes to the next create,
    // with a fresh uuid.
    let old = before.gpus[2].instances[1].clone();
    sim.destroy_instance(&old.uuid).expect("destroy");
    assert!(!sim.memory_file(&old.uuid).exists());
    let again = sim.create_instance(2, "2g.20gb", 2).expect("re-create");
    assert_eq!(again.gi_id, old.gi_id);
    assert_ne!(again.uuid, old.uuid);
    assert_ne!(again.uuid, inst.uuid);

    // A restart sees everything; no temporary files are left.
    let reopened = SimBackend::open(&example("h100x8.json"), dir.path()).expect("reopen");
    assert_eq!(reopened.inventory().expect("inventory"), sim.inventory().expect("inventory"));
    assert!(std::fs::read_dir(dir.path().join("sim"))
        .expect("dir")
        .all(|e| { !e.expect("entry").file_name().to_string_lossy().ends_with(".tmp") }));
}

#[test]
fn sim_refuses_what_hardware_refuses() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sim = SimBackend::open(&example("h100x8.json"), dir.path()).expect("open");
    let before = sim.inventory().expect("inventory");
    let err = |r: Result<MigInstance, BackendError>| r.expect_err("must be refused");
    assert!(matches!(
        err(sim.create_instance(3, "1g.10gb", 0)),
        BackendError::MigDisabled { gpu_index: 3 }
    ));
    assert!(matches!(err(sim.create_instance(99, "1g.10gb", 0)), BackendError::NoSuchGpu(99)));
    let e = err(sim.create_instance(0, "1g.10gb", 6));
    assert!(
        matches!(e, BackendError::Layout { gpu_index: 0, source: LayoutError::Overlap { .. } }),
        "{e}"
    );
    assert!(
        e.to_string().starts_with("GPU 0: 1g.10gb at slot 6 and 1g.10gb at slot 6 overlap"),
        "{e}"
    );
    let e = err(sim.create_instance(2, "3g.40gb", 2));
    assert!(e.to_string().contains("3g.40gb cannot start at slot 2"), "{e}");
    let e = err(sim.create_instance(2, "4g.20gb", 6));
    assert!(e.to_string().contains("has no MIG profile `4g.20gb`"), "{e}");
    // +me limit and compute slices are the catalog's.
    sim.create_instance(2, "1g.10gb+me", 6).expect("one +me");
    let e = sim.destroy_instance("MIG-nope").expect_err("unknown");
    assert_eq!(e.to_string(), "no MIG instance MIG-nope");
    let after = sim.inventory().expect("inventory");
    assert_eq!(after.gpus[..2], before.gpus[..2], "refusals changed nothing");
}

#[test]
fn sim_concurrent_creates_lose_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = write(
        dir.path(),
        "n.json",
        r#"{"node": "c", "gpus": [{"model": "H100-80GB", "mig": []}]}"#,
    );
    let sim = SimBackend::open(&file, &dir.path().join("state")).expect("open");
    std::thread::scope(|s| {
        for start in 0..7u8 {
            let sim = sim.clone();
            s.spawn(move || sim.create_instance(0, "1g.10gb", start).expect("create"));
        }
    });
    let inv = sim.inventory().expect("inventory");
    let gis: BTreeSet<u32> = inv.gpus[0].instances.iter().map(|i| i.gi_id).collect();
    assert_eq!(gis, (1..=7).collect());
    let uuids: BTreeSet<&str> = inv.gpus[0].instances.iter().map(|i| i.uuid.as_str()).collect();
    assert_eq!(uuids.len(), 7);
}

#[test]
fn sim_state_from_before_dynamic_mig_still_opens() {
    let dir = tempfile::tempdir().expect("tempdir");
    SimBackend::open(&example("h100x8.json"), dir.path()).expect("open");
    let path = dir.path().join("sim/node.json");
    let mut state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).expect("read")).expect("json");
    state.as_object_mut().expect("object").remove("generation");
    std::fs::write(&path, serde_json::to_vec(&state).expect("ser")).expect("write");
    let sim = SimBackend::open(&example("h100x8.json"), dir.path()).expect("reopen");
    sim.create_instance(2, "1g.10gb", 6).expect("create");
}

#[test]
fn nvml_backend_refuses_cleanly_without_a_driver() {
    // The default trait methods answer Unsupported for a backend that cannot change MIG.
    #[derive(Debug)]
    struct ReadOnly;
    impl GpuBackend for ReadOnly {
        fn describe(&self) -> String {
            "read-only".into()
        }
        fn inventory(&self) -> Result<Inventory, BackendError> {
            Err(BackendError::Inventory("none".into()))
        }
    }
    let e = ReadOnly.create_instance(0, "1g.10gb", 0).expect_err("unsupported");
    assert_eq!(e.to_string(), "unsupported: read-only cannot create MIG instances");
    assert!(matches!(ReadOnly.destroy_instance("x"), Err(BackendError::Unsupported(_))));
}

// ---------------------------------------------------------------- declared layouts on a backend

#[test]
fn a_declared_layout_converges_around_instances_in_use() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sim = SimBackend::open(&example("h100x8.json"), dir.path()).expect("open");
    let inv = sim.inventory().expect("inventory");
    // gpu1 has seven 1g; the one at slot 5 is in use.
    let busy = inv.gpus[1].instances[5].uuid.clone();
    let held: BTreeSet<String> = [busy.clone()].into_iter().collect();
    let declared: BTreeMap<String, DeclaredLayout> =
        [("H100-80GB".to_string(), DeclaredLayout::AllBalanced)].into_iter().collect();
    let p = plan(&inv, &held, &declared);
    assert!(p.destroy.iter().all(|d| d.uuid != busy));
    let (done, result) = apply_plan(&sim, &p);
    result.expect("apply");
    assert_eq!(done.destroyed.len(), p.destroy.len());
    assert_eq!(done.created.len(), p.create.len());
    let now = sim.inventory().expect("inventory");
    assert!(now.find(&busy).is_some(), "the instance in use is untouched");
    let again = plan(&now, &held, &declared);
    assert!(again.is_empty(), "only what is blocked remains:\n{again}");
    assert_eq!(again.blocked.len(), 1);
    assert_eq!(again.deferred.len(), 1, "3g@4 waits for the 1g at slot 5:\n{again}");
    // gpu0 was balanced-ish (3g@0, 2g@4, 1g@6): it is now exactly all-balanced.
    let g0: Vec<(&str, u8)> =
        now.gpus[0].instances.iter().map(|i| (i.profile.as_str(), i.start)).collect();
    assert_eq!(g0, [("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3), ("3g.40gb", 4)]);
    // Once released, the rest converges.
    let p = plan(&now, &BTreeSet::new(), &declared);
    let (_, result) = apply_plan(&sim, &p);
    result.expect("apply");
    assert!(plan(&sim.inventory().expect("inventory"), &BTreeSet::new(), &declared).is_converged());
}

// ---------------------------------------------------------------- placement properties

/// One GPU of a generated node: (model index, MIG on?, candidate (profile, start) picks).
type GpuSpec = (usize, bool, Vec<(usize, usize)>);

/// A node of 1 to 3 GPUs.
fn node_spec() -> impl Strategy<Value = Vec<GpuSpec>> {
    prop::collection::vec(
        (
            0..MODELS.len(),
            prop::bool::weighted(0.9),
            prop::collection::vec((0..7usize, 0..7usize), 0..10),
        ),
        1..4,
    )
}

fn build(spec: &[GpuSpec]) -> Inventory {
    let mut gpus = Vec::new();
    for (i, (m, mig, picks)) in spec.iter().enumerate() {
        let model = &MODELS[*m];
        let mut layout: Vec<(&'static str, u8)> = Vec::new();
        if *mig {
            for &(p, s) in picks {
                let prof = &model.profiles[p % model.profiles.len()];
                layout.push((prof.name, prof.starts[s % prof.starts.len()]));
                if placement_is_legal(model, &layout).is_err() {
                    layout.pop();
                }
            }
        }
        let instances = layout
            .iter()
            .enumerate()
            .map(|(k, (name, start))| {
                let p = model.profile(name).expect("catalog");
                MigInstance {
                    gi_id: k as u32 + 1,
                    ..MigInstance::planned(format!("MIG-{i}-{k}"), p, *start)
                }
            })
            .collect();
        gpus.push(Gpu {
            index: i as u32,
            uuid: format!("GPU-{i}"),
            model: model.name.to_string(),
            minor: i as u32,
            memory_mib: model.memory_mib,
            mig_enabled: *mig,
            instances,
        });
    }
    Inventory {
        node: "prop".into(),
        gpus,
        majors: Majors { nvidia: 195, nvidia_uvm: 508, nvidia_caps: Some(509) },
    }
}

fn layout_of(g: &Gpu) -> Vec<(&str, u8)> {
    g.instances.iter().map(|i| (i.profile.as_str(), i.start)).collect()
}

/// What brute force says about a request for `profile`.
#[derive(Debug, PartialEq, Eq)]
enum Oracle {
    Reuse,
    Create,
    /// The fewest idle instances any defragmentation must destroy.
    Defragment(usize),
    NoRoom,
}

fn oracle(inv: &Inventory, held: &BTreeSet<String>, profile: &str) -> Oracle {
    let usable = |g: &&Gpu| g.mig_enabled && !held.contains(&g.uuid);
    if inv
        .gpus
        .iter()
        .filter(usable)
        .flat_map(|g| &g.instances)
        .any(|i| i.profile == profile && !held.contains(&i.uuid))
    {
        return Oracle::Reuse;
    }
    let mut best: Option<usize> = None;
    for g in inv.gpus.iter().filter(usable) {
        let Some(model) = catalog::model(&g.model) else { continue };
        let Some(p) = model.profile(profile) else { continue };
        let n = g.instances.len();
        for subset in 0u32..(1 << n) {
            let removes_held = g
                .instances
                .iter()
                .enumerate()
                .any(|(k, i)| subset & (1 << k) != 0 && held.contains(&i.uuid));
            if removes_held {
                continue;
            }
            let mut layout: Vec<(&str, u8)> = g
                .instances
                .iter()
                .enumerate()
                .filter(|(k, _)| subset & (1 << k) == 0)
                .map(|(_, i)| (i.profile.as_str(), i.start))
                .collect();
            for &s in p.starts {
                layout.push((p.name, s));
                if placement_is_legal(model, &layout).is_ok() {
                    let k = subset.count_ones() as usize;
                    best = Some(best.map_or(k, |b| b.min(k)));
                }
                layout.pop();
            }
        }
    }
    match best {
        Some(0) => Oracle::Create,
        Some(k) => Oracle::Defragment(k),
        None => Oracle::NoRoom,
    }
}

/// Check a decision against the inventory; the number of instances it destroys.
fn check_decision(
    inv: &Inventory,
    held: &BTreeSet<String>,
    profile: &str,
    d: &PlaceDecision,
) -> Result<usize, TestCaseError> {
    match d {
        PlaceDecision::Reuse { uuid } => {
            let Some(crate::Found::Mig(g, i)) = inv.find(uuid) else {
                return Err(TestCaseError::fail(format!("reuse of unknown {uuid}")));
            };
            prop_assert_eq!(&i.profile, profile);
            prop_assert!(!held.contains(uuid) && !held.contains(&g.uuid) && g.mig_enabled);
            Ok(0)
        }
        PlaceDecision::Create { gpu_index, start }
        | PlaceDecision::Defragment { gpu_index, start, .. } => {
            let destroy: &[String] = match d {
                PlaceDecision::Defragment { destroy, .. } => destroy,
                _ => &[],
            };
            let g = inv.gpu(*gpu_index).ok_or_else(|| TestCaseError::fail("no such GPU"))?;
            prop_assert!(g.mig_enabled && !held.contains(&g.uuid));
            let model = catalog::model(&g.model).ok_or_else(|| TestCaseError::fail("model"))?;
            for u in destroy {
                prop_assert!(!held.contains(u), "destroys held {}", u);
                prop_assert!(
                    g.instances.iter().any(|i| &i.uuid == u),
                    "destroys {} not on GPU {}",
                    u,
                    gpu_index
                );
            }
            let mut layout: Vec<(&str, u8)> = g
                .instances
                .iter()
                .filter(|i| !destroy.contains(&i.uuid))
                .map(|i| (i.profile.as_str(), i.start))
                .collect();
            layout.push((profile, *start));
            prop_assert!(placement_is_legal(model, &layout).is_ok(), "illegal result {:?}", layout);
            if let PlaceDecision::Defragment { .. } = d {
                prop_assert!(!destroy.is_empty());
            }
            Ok(destroy.len())
        }
    }
}

fn profile_names() -> Vec<&'static str> {
    let mut v: Vec<&'static str> =
        MODELS.iter().flat_map(|m| m.profiles.iter().map(|p| p.name)).collect();
    v.sort_unstable();
    v.dedup();
    v.push("9g.99gb");
    v
}

fn mix(weights: &[u8]) -> DemandMix {
    let names = profile_names();
    DemandMix::from_weights(
        names.iter().zip(weights.iter().cycle()).map(|(n, w)| (*n, f64::from(*w))),
        1.0,
    )
}

/// Apply a decision to an in-memory inventory, as a backend would; the instance's uuid.
fn apply(inv: &mut Inventory, profile: &str, d: &PlaceDecision, serial: &mut u32) -> String {
    let (gpu_index, start, destroy) = match d {
        PlaceDecision::Reuse { uuid } => return uuid.clone(),
        PlaceDecision::Create { gpu_index, start } => (*gpu_index, *start, Vec::new()),
        PlaceDecision::Defragment { destroy, gpu_index, start } => {
            (*gpu_index, *start, destroy.clone())
        }
    };
    *serial += 1;
    let uuid = format!("MIG-new-{serial}");
    let g = inv.gpus.iter_mut().find(|g| g.index == gpu_index).expect("gpu");
    g.instances.retain(|i| !destroy.contains(&i.uuid));
    let p = catalog::model(&g.model).and_then(|m| m.profile(profile)).expect("profile");
    g.instances.push(MigInstance::planned(uuid.clone(), p, start));
    uuid
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, .. ProptestConfig::default() })]

    /// Soundness and completeness against brute force: a free instance is reused; else a
    /// free legal placement is created; else the fewest idle instances any legal
    /// placement needs are destroyed; a request is refused only if no legal placement
    /// exists even after removing every idle instance.
    #[test]
    fn place_matches_the_brute_force_oracle(
        spec in node_spec(),
        held_bits in prop::collection::vec(any::<bool>(), 32),
        own_profile in prop::bool::weighted(0.8),
        profile_pick in 0usize..64,
        first_fit in any::<bool>(),
        weights in prop::collection::vec(0u8..4, 1..8),
    ) {
        let inv = build(&spec);
        // Mostly a profile the node's first GPU offers; sometimes any name (or none).
        let names = profile_names();
        let own: Vec<&str> = MODELS[spec[0].0].profile_names().collect();
        let profile = if own_profile { own[profile_pick % own.len()] } else { names[profile_pick % names.len()] };
        let mut uuids: Vec<String> = inv.gpus.iter().flat_map(|g| g.instances.iter().map(|i| i.uuid.clone())).collect();
        uuids.extend(inv.gpus.iter().map(|g| g.uuid.clone()).filter(|_| held_bits[31]));
        let held: BTreeSet<String> = uuids.into_iter().zip(held_bits.iter().cycle()).filter(|(_, h)| **h).map(|(u, _)| u).collect();
        let strategy = if first_fit { place::Strategy::FirstFit } else { place::Strategy::Best };
        let got = place(&inv, &held, profile, strategy, &mix(&weights));
        let offered = inv.gpus.iter().any(|g| catalog::model(&g.model).is_some_and(|m| m.profile(profile).is_some()));
        match (oracle(&inv, &held, profile), got) {
            (_, Err(NoFit::UnknownProfile { .. })) => prop_assert!(!offered),
            (Oracle::NoRoom, Err(NoFit::NoRoom { .. })) => prop_assert!(offered),
            (Oracle::Reuse, Ok(d @ PlaceDecision::Reuse { .. })) => { check_decision(&inv, &held, profile, &d)?; }
            (Oracle::Create, Ok(d @ PlaceDecision::Create { .. })) => { check_decision(&inv, &held, profile, &d)?; }
            (Oracle::Defragment(k), Ok(d @ PlaceDecision::Defragment { .. })) => {
                let n = check_decision(&inv, &held, profile, &d)?;
                if strategy == place::Strategy::Best {
                    prop_assert_eq!(n, k, "Best destroys the fewest");
                } else {
                    prop_assert!(n >= k);
                }
            }
            (want, got) => prop_assert!(false, "oracle {:?}, place {:?}", want, got),
        }
        // Deterministic, whatever the order of the inventory.
        let mut shuffled = inv.clone();
        shuffled.gpus.reverse();
        for g in &mut shuffled.gpus { g.instances.reverse(); }
        prop_assert_eq!(place(&inv, &held, profile, strategy, &mix(&weights)), place(&shuffled, &held, profile, strategy, &mix(&weights)));
    }

    /// Random request/release/destroy sequences: every layout stays legal, held instances
    /// are never destroyed, and every request is served iff brute force says it can be.
    #[test]
    fn sequences_keep_layouts_legal(
        models in prop::collection::vec(0..MODELS.len(), 1..4),
        ops in prop::collection::vec((0u8..5, 0usize..64, any::<bool>()), 1..60),
    ) {
        let spec: Vec<GpuSpec> = models.iter().map(|&m| (m, true, Vec::new())).collect();
        let mut inv = build(&spec);
        let mut held: BTreeSet<String> = BTreeSet::new();
        let mut serial = 0;
        let names: Vec<&'static str> = MODELS[models[0]].profile_names().collect();
        for (kind, a, best) in ops {
            let all: Vec<String> = inv.gpus.iter().flat_map(|g| g.instances.iter().map(|i| i.uuid.clone())).collect();
            match kind {
                0..=2 => {
                    let profile = names[a % names.len()];
                    let strategy = if best { place::Strategy::Best } else { place::Strategy::FirstFit };
                    let want = oracle(&inv, &held, profile);
                    match place(&inv, &held, profile, strategy, &DemandMix::uniform(&MODELS[models[0]])) {
                        Ok(d) => {
                            prop_assert!(want != Oracle::NoRoom);
                            check_decision(&inv, &held, profile, &d)?;
                            let uuid = apply(&mut inv, profile, &d, &mut serial);
                            prop_assert!(held.insert(uuid));
                        }
                        Err(e) => prop_assert_eq!(want, Oracle::NoRoom, "{}", e),
                    }
                }
                3 => if !all.is_empty() { held.remove(&all[a % all.len()]); },
                _ => {
                    // The daemon destroys only idle instances.
                    let idle: Vec<&String> = all.iter().filter(|u| !held.contains(*u)).collect();
                    if !idle.is_empty() {
                        let u = idle[a % idle.len()].clone();
                        for g in &mut inv.gpus { g.instances.retain(|i| i.uuid != u); }
                    }
                }
            }
            for g in &inv.gpus {
                let model = catalog::model(&g.model).expect("model");
                prop_assert!(placement_is_legal(model, &layout_of(g)).is_ok(), "{:?}", layout_of(g));
            }
            for u in &held {
                prop_assert!(inv.find(u).is_some(), "held {} was destroyed", u);
            }
        }
    }
}

#[test]
fn place_is_fast_enough_in_debug_too() {
    // A smoke check that nothing is accidentally quadratic; the real number is the
    // criterion bench (release).
    let m = catalog::model("H100-80GB").expect("h100");
    let inv =
        build(&(0..8).map(|_| (2usize, true, vec![(0, 3), (3, 0), (4, 1)])).collect::<Vec<_>>());
    let held: BTreeSet<String> =
        inv.gpus.iter().flat_map(|g| g.instances.iter().map(|i| i.uuid.clone())).collect();
    let t = std::time::Instant::now();
    for _ in 0..1000 {
        let _ = place(&inv, &held, "1g.10gb", place::Strategy::Best, &DemandMix::uniform(m));
    }
    assert!(t.elapsed().as_millis() < 5000);
}
