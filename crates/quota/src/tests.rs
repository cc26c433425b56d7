//! Unit tests: validation with paths, hierarchical admission, DRF, the fair queue and
//! reclaim victims.

use crate::*;

const H100: &str = "H100-80GB";

const TENANTS: &[&str] = &[
    "acme",
    "acme/a",
    "acme/b",
    "acme/ml",
    "acme/ml/vision",
    "acme/ml/vision/alice",
    "acme/ml/vision/bob",
    "acme/ml/speech",
    "org-a",
    "org-b",
    "acme/trusted",
    "acme/trusted/training/alice",
    "acme/dev",
    "acme/dev/notebooks/bob",
    "acme/untrusted",
    "acme/untrusted/sandbox/guest",
];

fn tree(json: &str) -> QuotaTree {
    try_tree(json).unwrap_or_else(|e| panic!("{e}"))
}

fn try_tree(json: &str) -> Result<QuotaTree, SpecError> {
    let spec: QuotaSpec = serde_json::from_str(json).expect("json of the spec's shape");
    spec.validate("quotas", |t| TENANTS.contains(&t))
}

fn gpus(n: u64) -> Resources {
    Resources::new().with_gpus(H100, n)
}

fn invalid(json: &str) -> SpecError {
    try_tree(json).expect_err("invalid")
}

// --- validation ---------------------------------------------------------------------------

#[test]
fn a_valid_spec_becomes_a_tree_with_units_and_inherited_grace() {
    let t = tree(
        r#"{"acme": {"gpus": {"H100-80GB": {"guarantee": 8, "ceiling": 16}},
                     "cpu_cores": {"guarantee": 1.5}, "memory_gib": {"ceiling": 2},
                     "grace_period_s": 90},
            "acme/ml": {"gpus": {"H100-80GB": {"guarantee": 0.5, "lending_limit": 0.25}}},
            "acme/a": {"gpus": {"H100-80GB": {"ceiling": 1}}, "grace_period_s": 5}}"#,
    );
    let acme = t.get("acme").expect("acme");
    assert_eq!(
        acme.limits[&Resource::gpu(H100)],
        Limit { guarantee: Some(8_000_000), ceiling: Some(16_000_000), lending_limit: None }
    );
    assert_eq!(acme.limits[&Resource::Cpu].guarantee, Some(1_500));
    assert_eq!(acme.limits[&Resource::Memory].ceiling, Some(2_048));
    assert_eq!(
        t.get("acme/ml").expect("ml").limits[&Resource::gpu(H100)].lending_limit,
        Some(250_000)
    );
    assert_eq!(t.grace_period_s("acme/ml/vision/alice"), 90, "inherited from acme");
    assert_eq!(t.grace_period_s("acme/a"), 5);
    assert_eq!(t.grace_period_s("org-a"), DEFAULT_GRACE_PERIOD_S);
    assert_eq!(t.owed_reclaim_after_s("acme/ml"), None, "none set: the ski-rental rule only");
    let t2 = tree(
        r#"{"acme": {"gpus": {"H100-80GB": {"guarantee": 8}}, "owed_reclaim_after_s": 120},
            "acme/ml": {"gpus": {"H100-80GB": {"guarantee": 4}}},
            "acme/a": {"gpus": {"H100-80GB": {"guarantee": 1}}, "owed_reclaim_after_s": 0}}"#,
    );
    assert_eq!(t2.owed_reclaim_after_s("acme/ml/vision/alice"), Some(120), "inherited");
    assert_eq!(t2.owed_reclaim_after_s("acme/a"), Some(0));
    let chain: Vec<&str> = t.chain("acme/ml/vision/alice").map(|q| q.path.as_str()).collect();
    assert_eq!(chain, ["acme/ml", "acme"]);
}

#[test]
fn validation_names_the_path_of_each_problem() {
    let cases: &[(&str, &str, &str)] = &[
        (
            r#"{"acme": {"gpus": {"H100-80GB": {"guarantee": 4, "ceiling": 2}}}}"#,
            "quotas.acme.gpus.H100-80GB.ceiling",
            "below the guarantee",
        ),
        (
            r#"{"acme": {"gpus": {"B200": {"guarantee": 4}}}}"#,
            "quotas.acme.gpus.B200",
            "unknown GPU model `B200`: expected one of A100-40GB, A100-80GB, H100-80GB, H200-141GB",
        ),
        (
            r#"{"acme": {"gpus": {"H100-80GB": {"guarantee": 4}}},
                "acme/a": {"gpus": {"H100-80GB": {"guarantee": 3}}},
                "acme/b": {"gpus": {"H100-80GB": {"guarantee": 2}}}}"#,
            "quotas.acme.gpus.H100-80GB.guarantee",
            "the guarantees under acme sum to 5 H100-80GB GPUs (acme/a 3 H100-80GB GPUs, acme/b 2 H100-80GB GPUs), more than its guarantee of 4",
        ),
        (
            // With no guarantee of its own, the parent's ceiling bounds its children's.
            r#"{"acme/ml": {"cpu_cores": {"ceiling": 4}},
                "acme/ml/vision/alice": {"cpu_cores": {"guarantee": 3}},
                "acme/ml/speech": {"cpu_cores": {"guarantee": 2}}}"#,
            "quotas.acme/ml.cpu_cores.ceiling",
            "sum to 5 CPU cores",
        ),
        (
            r#"{"acme/nope": {"gpus": {"H100-80GB": {"guarantee": 1}}}}"#,
            "quotas.acme/nope",
            "no tenant `acme/nope`",
        ),
        (
            r#"{"Acme\n": {"gpus": {"H100-80GB": {"guarantee": 1}}}}"#,
            "quotas.Acme\\n",
            "is not a tenant path",
        ),
        (
            r#"{"acme": {"memory_gib": {"guarantee": -1}}}"#,
            "quotas.acme.memory_gib.guarantee",
            "expected a number from 0 to 1000000, got -1",
        ),
        (r#"{"acme": {"cpu_cores": {}}}"#, "quotas.acme.cpu_cores", "a guarantee, a ceiling or both"),
        (
            r#"{"acme": {"gpus": {"H100-80GB": {"guarantee": 1, "lending_limit": 2}}}}"#,
            "quotas.acme.gpus.H100-80GB.lending_limit",
            "above the guarantee",
        ),
        (
            r#"{"acme": {"gpus": {"H100-80GB": {"ceiling": 1, "lending_limit": 1}}}}"#,
            "quotas.acme.gpus.H100-80GB.lending_limit",
            "needs a guarantee",
        ),
        (
            r#"{"acme": {"grace_period_s": 3601}}"#,
            "quotas.acme.grace_period_s",
            "expected 0 to 3600 seconds",
        ),
        (
            r#"{"acme": {"owed_reclaim_after_s": 86401}}"#,
            "quotas.acme.owed_reclaim_after_s",
            "expected 0 to 86400 seconds, got 86401",
        ),
    ];
    for (json, path, message) in cases {
        let e = invalid(json);
        assert_eq!(&e.path, path, "{json}: {e}");
        assert!(e.message.contains(message), "{json}: {e}");
        assert!(!e.to_string().contains('\n'), "{e}");
    }
}

#[test]
fn nested_guarantees_are_checked_against_the_nearest_guarantee_only() {
    // vision's 2 sits inside ml's 3, which sits inside acme's 3: valid. alice + bob (2)
    // are checked against vision, not also against ml or acme.
    tree(
        r#"{"acme": {"gpus": {"H100-80GB": {"guarantee": 3}}},
            "acme/ml": {"gpus": {"H100-80GB": {"guarantee": 3}}},
            "acme/ml/vision": {"gpus": {"H100-80GB": {"guarantee": 2}}},
            "acme/ml/vision/alice": {"gpus": {"H100-80GB": {"guarantee": 1}}},
            "acme/ml/vision/bob": {"gpus": {"H100-80GB": {"guarantee": 1}}},
            "acme/ml/speech": {"gpus": {"H100-80GB": {"guarantee": 1}}}}"#,
    );
    let e = invalid(
        r#"{"acme/ml": {"gpus": {"H100-80GB": {"guarantee": 3}}},
            "acme/ml/vision": {"gpus": {"H100-80GB": {"guarantee": 2}}},
            "acme/ml/speech": {"gpus": {"H100-80GB": {"guarantee": 1.5}}}}"#,
    );
    assert_eq!(e.path, "quotas.acme/ml.gpus.H100-80GB.guarantee");
}

#[test]
fn the_shape_refuses_unknown_fields_and_duplicate_keys() {
    for json in [
        r#"{"acme": {"gpu": {}}}"#,
        r#"{"acme": {"gpus": {"H100-80GB": {"guarantee": 1, "limit": 2}}}}"#,
        r#"{"acme": {}, "acme": {}}"#,
        r#"{"acme": {"gpus": {"H100-80GB": {"ceiling": 1}, "H100-80GB": {"ceiling": 2}}}}"#,
    ] {
        assert!(serde_json::from_str::<QuotaSpec>(json).is_err(), "{json}");
    }
    let e = serde_json::from_str::<QuotaSpec>(r#"{"acme": {}, "acme": {}}"#).unwrap_err();
    assert!(e.to_string().contains("duplicate key `acme`"), "{e}");
}

// --- admission ----------------------------------------------------------------------------

fn team_ab() -> QuotaTree {
    tree(
        r#"{"acme/a": {"gpus": {"H100-80GB": {"guarantee": 4}}},
            "acme/b": {"gpus": {"H100-80GB": {"guarantee": 4, "ceiling": 12}}}}"#,
    )
}

#[test]
fn the_acceptance_scenario_b_borrows_to_its_ceiling_and_a_reclaims() {
    let t = team_ab();
    let fleet = gpus(16);
    let mut usage = Usage::new();
    let mut running = Vec::new();
    // B fills 12, one GPU at a time: 4 guaranteed, then 8 borrowed.
    for i in 0..12u64 {
        let d = admit(&t, &fleet, &usage, "acme/b", &gpus(1));
        let class = match d {
            Decision::Admit { class, ref over } => {
                if i >= 4 {
                    assert_eq!(over, &Some(("acme/b".into(), Resource::gpu(H100))));
                }
                class
            }
            other => panic!("{i}: {other:?}"),
        };
        assert_eq!(class, if i < 4 { Class::Guaranteed } else { Class::Borrowed }, "{i}");
        usage.add("acme/b", class, &gpus(1));
        running.push(Running {
            id: format!("b{i}"),
            tenant: "acme/b".into(),
            resources: gpus(1),
            class,
            started_ms: i * 1000,
            gang: None,
            checkpoints: false,
        });
    }
    // The 13th crosses B's ceiling, naming the path and the resource.
    match admit(&t, &fleet, &usage, "acme/b", &gpus(1)) {
        Decision::Refuse(r) => {
            assert_eq!(
                (r.path.as_str(), &r.resource, r.in_use),
                ("acme/b", &Resource::gpu(H100), 12_000_000)
            );
            let msg = r.to_string();
            assert!(msg.contains("above its ceiling of 12 H100-80GB GPUs"), "{msg}");
            assert!(msg.contains("quotas.acme/b.gpus.H100-80GB.ceiling"), "{msg}");
        }
        other => panic!("{other:?}"),
    }
    // A asks for its 4: 16 - 12 = 4 are free, so it is admitted at once.
    assert_eq!(
        admit(&t, &fleet, &usage, "acme/a", &gpus(4)),
        Decision::Admit { class: Class::Guaranteed, over: None }
    );
    // With a 12-GPU fleet instead, the capacity is lent out: reclaim 4 from B's youngest.
    let small = gpus(12);
    let short = match admit(&t, &small, &usage, "acme/a", &gpus(4)) {
        Decision::Reclaim { short, .. } => short,
        other => panic!("{other:?}"),
    };
    assert_eq!(short, gpus(4));
    let victims = choose_victims(
        &running,
        &usage_of(&running),
        &t,
        &small,
        "acme/a",
        &short,
        &short,
        100_000,
    )
    .expect("enough borrowed");
    let victims: Vec<String> =
        victims.chosen.iter().flat_map(|c| c.candidate.ids.clone()).collect();
    // The youngest lose the least.
    assert_eq!(victims, ["b11", "b10", "b9", "b8"]);
    for v in &victims {
        let r = running.iter().find(|r| &r.id == v).expect("known");
        usage.release(&r.tenant, r.class, &r.resources);
    }
    assert_eq!(usage.of("acme/b").guaranteed, gpus(4), "B never drops below its guarantee");
    assert_eq!(
        admit(&t, &small, &usage, "acme/a", &gpus(4)),
        Decision::Admit { class: Class::Guaranteed, over: None }
    );
}

#[test]
fn a_childs_guarantee_is_set_aside_inside_its_parents_and_reclaimed_under_a_full_ceiling() {
    // The issue's hierarchy: acme guarantees 12 (ceiling 12), its teams trusted and dev 4
    // each; the guest's team has no quota of its own.
    let t = tree(
        r#"{"acme": {"gpus": {"H100-80GB": {"guarantee": 12, "ceiling": 12}}},
            "acme/trusted": {"gpus": {"H100-80GB": {"guarantee": 4}}},
            "acme/dev": {"gpus": {"H100-80GB": {"guarantee": 4}}}}"#,
    );
    let (fleet, guest) = (gpus(16), "acme/untrusted/sandbox/guest");
    let mut usage = Usage::new();
    // The guest gets acme's remainder (12 - 4 - 4) as guaranteed, the rest borrowed.
    for i in 0..12 {
        let class = match admit(&t, &fleet, &usage, guest, &gpus(1)) {
            Decision::Admit { class, .. } => class,
            other => panic!("{i}: {other:?}"),
        };
        assert_eq!(class, if i < 4 { Class::Guaranteed } else { Class::Borrowed }, "{i}");
        usage.add(guest, class, &gpus(1));
    }
    assert_eq!(set_aside(&t, &usage, "acme", &Resource::gpu(H100), guest), 8_000_000);
    // Owed (it reclaims at once): a request within its guarantee under a ceiling that
    // others' borrowed work fills. (Without it, dev's 2nd waited as "not owed now".)
    let none = Resources::new();
    assert!(crate::owed(&t, &usage, "acme/dev/notebooks/bob", &gpus(2), &none));
    assert!(!crate::owed(&t, &usage, guest, &gpus(1), &none), "the guest only borrows now");
    // Acme is at its ceiling of 12; dev's 2 are within dev's guarantee (acme's keeps 4 for
    // it): guaranteed, by reclaiming 2 of the guest's borrowed GPUs under acme's ceiling.
    assert_eq!(
        admit(&t, &fleet, &usage, "acme/dev/notebooks/bob", &gpus(2)),
        Decision::Reclaim { short: gpus(2), under: Some("acme".into()) }
    );
    usage.release(guest, Class::Borrowed, &gpus(2));
    assert_eq!(
        admit(&t, &fleet, &usage, "acme/dev/notebooks/bob", &gpus(2)),
        Decision::Admit { class: Class::Guaranteed, over: None }
    );
    usage.add("acme/dev/notebooks/bob", Class::Guaranteed, &gpus(2));
    // Alice the same within trusted's 4.
    assert_eq!(
        admit(&t, &fleet, &usage, "acme/trusted/training/alice", &gpus(1)),
        Decision::Reclaim { short: gpus(1), under: Some("acme".into()) }
    );
    // The guest asking more is refused at acme's ceiling: it borrows, it never reclaims.
    assert!(
        matches!(admit(&t, &fleet, &usage, guest, &gpus(1)), Decision::Refuse(r) if r.path == "acme")
    );
    // Dev beyond its own guarantee borrows: at the ceiling, refused, never a reclaim.
    usage.add("acme/dev/notebooks/bob", Class::Guaranteed, &gpus(2));
    assert!(matches!(
        admit(&t, &fleet, &usage, "acme/dev/notebooks/bob", &gpus(1)),
        Decision::Refuse(r) if r.path == "acme"
    ));
    // Without the set-aside the guest's 12 would all have been guaranteed: before this
    // change dev's request was borrowed, or refused at the ceiling.
    assert_eq!(usage.of(guest).guaranteed, gpus(4));
}

#[test]
fn a_user_ceiling_under_a_team_guarantee_holds() {
    let t = tree(
        r#"{"acme/ml": {"gpus": {"H100-80GB": {"guarantee": 4}}},
            "acme/ml/vision/alice": {"gpus": {"H100-80GB": {"ceiling": 2}}}}"#,
    );
    let fleet = gpus(16);
    let mut usage = Usage::new();
    assert_eq!(
        admit(&t, &fleet, &usage, "acme/ml/vision/alice", &gpus(2)),
        Decision::Admit { class: Class::Guaranteed, over: None }
    );
    usage.add("acme/ml/vision/alice", Class::Guaranteed, &gpus(2));
    match admit(&t, &fleet, &usage, "acme/ml/vision/alice", &gpus(1)) {
        Decision::Refuse(r) => assert_eq!(r.path, "acme/ml/vision/alice"),
        other => panic!("the team's guarantee has room, the user's ceiling does not: {other:?}"),
    }
    // bob, under the same team, still gets the rest of the team's guarantee.
    assert_eq!(
        admit(&t, &fleet, &usage, "acme/ml/vision/bob", &gpus(2)),
        Decision::Admit { class: Class::Guaranteed, over: None }
    );
}

#[test]
fn a_projects_borrowing_counts_against_its_teams_ceiling() {
    let t = tree(
        r#"{"acme/ml": {"gpus": {"H100-80GB": {"guarantee": 4, "ceiling": 6}}},
            "acme/ml/vision": {"gpus": {"H100-80GB": {"guarantee": 2, "ceiling": 8}}}}"#,
    );
    let fleet = gpus(16);
    let mut usage = Usage::new();
    usage.add("acme/ml/vision/alice", Class::Guaranteed, &gpus(2));
    // Above vision's guarantee: borrowed, though the team's guarantee has room.
    match admit(&t, &fleet, &usage, "acme/ml/vision/alice", &gpus(3)) {
        Decision::Admit { class: Class::Borrowed, over } => {
            assert_eq!(over, Some(("acme/ml/vision".into(), Resource::gpu(H100))));
        }
        other => panic!("{other:?}"),
    }
    usage.add("acme/ml/vision/alice", Class::Borrowed, &gpus(3));
    usage.add("acme/ml/speech", Class::Guaranteed, &gpus(1));
    // vision holds 5 (ceiling 8) but the team holds 6 = its ceiling.
    match admit(&t, &fleet, &usage, "acme/ml/vision/bob", &gpus(1)) {
        Decision::Refuse(r) => {
            assert_eq!((r.path.as_str(), r.ceiling, r.in_use), ("acme/ml", 6_000_000, 6_000_000));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn borrowed_work_never_counts_against_a_guarantee() {
    let t = team_ab();
    let fleet = gpus(16);
    let mut usage = Usage::new();
    usage.add("acme/b", Class::Borrowed, &gpus(8));
    // Eight borrowed GPUs leave B's whole guarantee for guaranteed work.
    assert_eq!(
        admit(&t, &fleet, &usage, "acme/b", &gpus(4)),
        Decision::Admit { class: Class::Guaranteed, over: None }
    );
}

#[test]
fn a_tenant_without_a_guarantee_only_borrows_and_lending_limits_keep_capacity_back() {
    let t = tree(
        r#"{"acme/a": {"gpus": {"H100-80GB": {"guarantee": 6, "lending_limit": 2}}},
            "acme/b": {"gpus": {"H100-80GB": {"ceiling": 16}}}}"#,
    );
    let fleet = gpus(8);
    let usage = Usage::new();
    // A lends at most 2 of its idle 6: B may borrow the 2 unguaranteed GPUs + 2.
    assert_eq!(withheld(&t, &usage, "acme/b"), gpus(4));
    assert!(matches!(
        admit(&t, &fleet, &usage, "acme/b", &gpus(4)),
        Decision::Admit { class: Class::Borrowed, over: None }
    ));
    assert_eq!(
        admit(&t, &fleet, &usage, "acme/b", &gpus(5)),
        Decision::Wait { class: Class::Borrowed, short: gpus(1) }
    );
    // Unquota'd CPU does not make A's GPU request borrowed.
    let req = gpus(1).with_cpu_milli(4_000);
    assert_eq!(
        admit(&t, &fleet, &usage, "acme/a", &req),
        Decision::Admit { class: Class::Guaranteed, over: None }
    );
}

/// A project's lending limit holds inside a team that sets a looser one (red team of issue
/// 27): acme/ml lends all 8 of its guarantee, but acme/ml/speech lends none of its 6, so a
/// borrower outside acme/ml may have acme/ml's remaining 2 unused and not speech's 6. And
/// where the team's limit is the tighter one, it holds.
#[test]
fn a_projects_lending_limit_holds_inside_a_team_that_lends_more() {
    let t = tree(
        r#"{"acme/ml": {"gpus": {"H100-80GB": {"guarantee": 8, "lending_limit": 8}}},
            "acme/ml/speech": {"gpus": {"H100-80GB": {"guarantee": 6, "lending_limit": 0}}},
            "acme/a": {"gpus": {"H100-80GB": {"ceiling": 16}}}}"#,
    );
    let fleet = gpus(16);
    let mut usage = Usage::new();
    assert_eq!(withheld(&t, &usage, "acme/a"), gpus(6), "speech's 6 are kept back");
    assert_eq!(
        admit(&t, &fleet, &usage, "acme/a", &gpus(11)),
        Decision::Wait { class: Class::Borrowed, short: gpus(1) }
    );
    // Speech using 2 of its 6 keeps back the other 4.
    usage.add("acme/ml/speech", Class::Guaranteed, &gpus(2));
    assert_eq!(withheld(&t, &usage, "acme/a"), gpus(4));
    // A sibling under acme/ml borrows from acme/ml's remainder, never speech's 4.
    assert_eq!(withheld(&t, &usage, "acme/ml/vision"), gpus(4));
    // The team's limit, where it is the tighter one, holds as before.
    let tight = tree(
        r#"{"acme/ml": {"gpus": {"H100-80GB": {"guarantee": 8, "lending_limit": 1}}},
            "acme/ml/speech": {"gpus": {"H100-80GB": {"guarantee": 6, "lending_limit": 6}}},
            "acme/a": {"gpus": {"H100-80GB": {"ceiling": 16}}}}"#,
    );
    assert_eq!(withheld(&tight, &Usage::new(), "acme/a"), gpus(7));
}

/// A lending limit binds every other tenant, the team's own tenants too (docs/QUOTAS.md:
/// kept back from a borrower outside the requester's chain): acme/ml borrowing beyond
/// what it is guaranteed does not take acme/ml/speech's unused guarantee, which speech
/// lends none of.
#[test]
fn a_lending_limit_under_the_borrower_keeps_its_guarantee_back_too() {
    let t = tree(
        r#"{"acme/ml": {"gpus": {"H100-80GB": {"ceiling": 8}}},
            "acme/ml/speech": {"gpus": {"H100-80GB": {"guarantee": 6, "lending_limit": 0}}}}"#,
    );
    let fleet = gpus(8);
    let usage = Usage::new();
    assert_eq!(withheld(&t, &usage, "acme/ml"), gpus(6));
    assert_eq!(
        admit(&t, &fleet, &usage, "acme/ml", &gpus(3)),
        Decision::Wait { class: Class::Borrowed, short: gpus(1) }
    );
    // Speech itself is on its own chain: nothing of its own is kept from it.
    assert_eq!(withheld(&t, &usage, "acme/ml/speech"), gpus(0));
}

/// Guarantee leased to nodes and unused there ([`Usage::add_leased`], the books' lease
/// phantoms) counts as guaranteed usage, but a lending limit keeps it back as unused: a
/// path guaranteeing 6 with lending limit 2, 4 of it leased and 1 really used, withholds
/// 3 (6 − 1 − 2), not 0. Releasing the path's real guaranteed work never releases its
/// leases.
#[test]
fn leased_guarantee_counts_as_guaranteed_usage_and_a_lending_limit_keeps_it_back() {
    let t = tree(
        r#"{"acme/ml": {"gpus": {"H100-80GB": {"guarantee": 6, "lending_limit": 2}}},
            "acme/b": {"gpus": {"H100-80GB": {"ceiling": 16}}}}"#,
    );
    let mut usage = Usage::new();
    usage.add("acme/ml/speech", Class::Guaranteed, &gpus(1));
    usage.add_leased("acme/ml/speech", &gpus(3));
    usage.add_leased("acme/ml", &gpus(1));
    assert_eq!(usage.of("acme/ml").guaranteed, gpus(5), "leases are booked as guaranteed");
    assert_eq!(usage.leased_of("acme/ml"), gpus(4));
    assert_eq!(usage.used_guaranteed("acme/ml"), gpus(1));
    assert_eq!(withheld(&t, &usage, "acme/b"), gpus(3));
    // Within the guarantee by what is booked: 1 more, not 2.
    assert!(matches!(
        admit(&t, &gpus(16), &usage, "acme/ml/vision", &gpus(2)),
        Decision::Admit { class: Class::Borrowed, .. }
    ));
    usage.release("acme/ml/speech", Class::Guaranteed, &gpus(4));
    assert_eq!(usage.leased_of("acme/ml"), gpus(4), "the real work went, not the leases");
    assert_eq!(usage.used_guaranteed("acme/ml"), gpus(0));
    usage.release_leased("acme/ml/speech", &gpus(5));
    usage.release_leased("acme/ml", &gpus(1));
    assert_eq!(usage, Usage::new(), "nothing left booked");
}

#[test]
fn a_guaranteed_request_waits_when_the_capacity_is_held_by_guaranteed_work() {
    let t = team_ab();
    let fleet = gpus(6);
    let mut usage = Usage::new();
    usage.add("acme/b", Class::Guaranteed, &gpus(4));
    usage.add("acme/b", Class::Borrowed, &gpus(1));
    // 1 free, 1 borrowed: 3 short of 4 cannot be reclaimed.
    assert_eq!(
        admit(&t, &fleet, &usage, "acme/a", &gpus(4)),
        Decision::Wait { class: Class::Guaranteed, short: gpus(3) }
    );
    assert_eq!(
        admit(&t, &fleet, &usage, "acme/a", &gpus(2)),
        Decision::Reclaim { short: gpus(1), under: None }
    );
}

#[test]
fn mig_and_mps_fractions_count_as_the_fraction_they_are() {
    let t = tree(r#"{"acme/a": {"gpus": {"H100-80GB": {"guarantee": 1, "ceiling": 1}}}}"#);
    let fleet = gpus(1);
    let mut usage = Usage::new();
    let slice = Resources::new().with(Resource::gpu(H100), gpu_micro(1.0 / 7.0).expect("ok"));
    for i in 0..7 {
        let d = admit(&t, &fleet, &usage, "acme/a", &slice);
        assert_eq!(d, Decision::Admit { class: Class::Guaranteed, over: None }, "slice {i}");
        usage.add("acme/a", Class::Guaranteed, &slice);
    }
    let mps = Resources::new().with(Resource::gpu(H100), gpu_micro(0.25).expect("ok"));
    assert!(matches!(admit(&t, &fleet, &usage, "acme/a", &mps), Decision::Refuse(_)));
}

// --- DRF and the fair queue --------------------------------------------------------------

#[test]
fn drf_the_papers_example_a_gets_three_tasks_and_b_two() {
    // Ghodsi et al. 2011, section 4: 9 CPUs, 18 GB; A's tasks <1 CPU, 4 GB>, B's <3 CPU, 1 GB>.
    let t = QuotaTree::default();
    let fleet = Resources::new().with_cpu_milli(9_000).with_memory_mib(18 * MIB_PER_GIB);
    let a_task = Resources::new().with_cpu_milli(1_000).with_memory_mib(4 * MIB_PER_GIB);
    let b_task = Resources::new().with_cpu_milli(3_000).with_memory_mib(MIB_PER_GIB);
    // Both always asking: more tasks waiting than could ever fit, B's arriving first.
    let waiting: Vec<Waiting> = (0..10u64)
        .flat_map(|i| {
            [
                Waiting {
                    id: format!("b{i}"),
                    tenant: "org-b".into(),
                    resources: b_task.clone(),
                    arrived: 2 * i,
                },
                Waiting {
                    id: format!("a{i}"),
                    tenant: "org-a".into(),
                    resources: a_task.clone(),
                    arrived: 2 * i + 1,
                },
            ]
        })
        .collect();
    let mut usage = Usage::new();
    let out = allocate(&t, &fleet, &mut usage, &waiting);
    let count = |who: &str| out.admitted.iter().filter(|(i, _)| waiting[*i].tenant == who).count();
    assert_eq!((count("org-a"), count("org-b")), (3, 2), "{out:?}");
    // Equal dominant shares: A 12/18 of memory, B 6/9 of CPU.
    let a = dominant_share(&usage.of("org-a").total(), &fleet);
    let b = dominant_share(&usage.of("org-b").total(), &fleet);
    assert!((a - 2.0 / 3.0).abs() < 1e-9 && (b - 2.0 / 3.0).abs() < 1e-9, "{a} {b}");
    // The order of admissions alternates by lowest dominant share.
    let order: Vec<&str> = out.admitted.iter().map(|(i, _)| waiting[*i].id.as_str()).collect();
    assert_eq!(order, ["b0", "a0", "a1", "b1", "a2"]);
    assert!(out.reclaim.is_empty() && out.refused.is_empty());
}

#[test]
fn the_queue_serves_the_tenant_furthest_below_its_guarantee_first() {
    let t = tree(
        r#"{"acme/a": {"gpus": {"H100-80GB": {"guarantee": 4}}},
            "acme/b": {"gpus": {"H100-80GB": {"guarantee": 4}}}}"#,
    );
    let fleet = gpus(16);
    let mut usage = Usage::new();
    usage.add("acme/a", Class::Guaranteed, &gpus(3));
    usage.add("acme/b", Class::Guaranteed, &gpus(1));
    let w = |id: &str, tenant: &str, arrived| Waiting {
        id: id.into(),
        tenant: tenant.into(),
        resources: gpus(1),
        arrived,
    };
    let waiting =
        [w("x", "org-a", 0), w("a1", "acme/a", 1), w("b1", "acme/b", 2), w("b0", "acme/b", 1)];
    // b (3 left) before a (1 left) before org-a (no guarantee); arrival within a tenant.
    assert_eq!(fair_order(&t, &fleet, &usage, &waiting), [3, 2, 1, 0]);
    // Equal headroom: lowest dominant share first.
    usage.add("org-b", Class::Borrowed, &gpus(2));
    let waiting = [w("y", "org-b", 0), w("x", "org-a", 5)];
    assert_eq!(fair_order(&t, &fleet, &usage, &waiting), [1, 0]);
}

/// Within a tenant's turn its largest request first (issue 27: in arrival order a tenant's
/// narrow requests took every GPU freed and its 8-GPU ones never found a node); between
/// tenants the order is the fair one, ties going to the tenant waiting longest.
#[test]
fn within_a_tenants_turn_its_largest_request_goes_first() {
    let t = QuotaTree::default();
    let fleet = gpus(32);
    let mut usage = Usage::new();
    usage.add("org-a", Class::Borrowed, &gpus(4));
    let w = |id: &str, tenant: &str, n: u64, arrived| Waiting {
        id: id.into(),
        tenant: tenant.into(),
        resources: gpus(n),
        arrived,
    };
    let waiting = [
        w("b1", "org-b", 1, 0),
        w("b8", "org-b", 8, 5),
        w("a8", "org-a", 8, 1),
        w("b2", "org-b", 2, 3),
        w("a1", "org-a", 1, 2),
    ];
    // b holds less: all of b's first, largest first; then a's, largest first.
    assert_eq!(fair_order(&t, &fleet, &usage, &waiting), [1, 3, 0, 2, 4]);
    // Equal shares: the tenant whose oldest request waits longest goes first (b's from 0),
    // and a tenant's requests are not interleaved with another's by size.
    usage.add("org-b", Class::Borrowed, &gpus(4));
    assert_eq!(fair_order(&t, &fleet, &usage, &waiting), [1, 3, 0, 2, 4]);
    let waiting = [w("a1", "org-a", 1, 0), w("b8", "org-b", 8, 1)];
    assert_eq!(fair_order(&t, &fleet, &usage, &waiting), [0, 1]);
    // The size is the request's dominant share: 1 GPU of 32 is less than 4 of 64 cores.
    let cpu = Resources::new().with_cpu_milli(4_000);
    let fleet = gpus(32).plus(&Resources::new().with_cpu_milli(64_000));
    let waiting = [
        w("g", "org-c", 1, 0),
        Waiting { id: "c".into(), tenant: "org-c".into(), resources: cpu, arrived: 1 },
    ];
    assert_eq!(fair_order(&t, &fleet, &usage, &waiting), [1, 0]);
}

/// Owed behind the tenant's earlier requests: only those that would be owed in arrival
/// order fill the guarantee; one larger than what is left (it would run borrowed) fills
/// none of it. (Counting every earlier request, a tenant's 5-GPU request on a guarantee of
/// 4 kept its 1-GPU request from ever being owed while it waited.)
#[test]
fn a_request_beyond_the_guarantee_ahead_fills_none_of_it() {
    let t = tree(r#"{"acme/a": {"gpus": {"H100-80GB": {"guarantee": 4}}}}"#);
    let usage = Usage::new();
    let owed_after = |earlier: &[u64]| {
        let earlier: Vec<Resources> = earlier.iter().map(|&n| gpus(n)).collect();
        crate::owed_behind(&t, &usage, "acme/a", &gpus(1), earlier.iter())
    };
    assert!(owed_after(&[]));
    assert!(owed_after(&[5]), "a 5 beyond the guarantee of 4 fills none of it");
    assert!(!owed_after(&[4]), "a 4 fills it");
    assert!(owed_after(&[3, 5]), "3 counted, 5 not: 3 + 1 fits");
    assert!(!owed_after(&[3, 1]));
    assert!(!owed_after(&[2, 3, 2]), "2 and 2 counted (3 does not fit after 2): 2 + 2 + 1");
    // Guaranteed usage counts as before.
    let mut held = Usage::new();
    held.add("acme/a", Class::Guaranteed, &gpus(3));
    assert!(crate::owed_behind(&t, &held, "acme/a", &gpus(1), std::iter::empty()));
    assert!(!crate::owed_behind(&t, &held, "acme/a", &gpus(1), [gpus(1)].iter()));
}

// --- reclaim ------------------------------------------------------------------------------

fn run(id: &str, tenant: &str, n: u64, class: Class, started: u64, gang: Option<&str>) -> Running {
    Running {
        id: id.into(),
        tenant: tenant.into(),
        resources: gpus(n),
        class,
        started_ms: started * 1000,
        gang: gang.map(str::to_string),
        checkpoints: false,
    }
}

/// What `running` uses, each with the class it was admitted with.
pub(crate) fn usage_of(running: &[Running]) -> Usage {
    let mut u = Usage::new();
    for r in running {
        u.add(&r.tenant, r.class, &r.resources);
    }
    u
}

fn ids(v: &Victims) -> Vec<String> {
    v.chosen.iter().flat_map(|c| c.candidate.ids.clone()).collect()
}

/// The team tree with a minimum run time and grace periods set.
fn team_times() -> QuotaTree {
    tree(
        r#"{"acme/a": {"gpus": {"H100-80GB": {"guarantee": 4}}},
            "acme/b": {"gpus": {"H100-80GB": {"guarantee": 1}}, "grace_period_s": 20},
            "acme/ml": {"gpus": {"H100-80GB": {"guarantee": 1}}, "min_runtime_s": 60}}"#,
    )
}

#[test]
fn victims_are_chosen_by_the_work_they_would_lose_never_guaranteed_nor_the_claimants() {
    let (t, fleet) = (team_times(), gpus(16));
    // At t = 1000 s: b1 ran 900 s, b2 500 s, b3 100 s, c1 (ml) 300 s.
    let running = [
        run("g1", "acme/b", 1, Class::Guaranteed, 0, None),
        run("b1", "acme/b", 1, Class::Borrowed, 100, None),
        run("b2", "acme/b", 1, Class::Borrowed, 500, None),
        run("b3", "acme/b", 1, Class::Borrowed, 900, None),
        run("c1", "acme/ml", 1, Class::Borrowed, 700, None),
        run("gml", "acme/ml", 1, Class::Guaranteed, 0, None),
        run("own", "acme/a/x", 1, Class::Borrowed, 990, None),
    ];
    let now = 1_000_000;
    let v = choose_victims(
        &running,
        &usage_of(&running),
        &t,
        &fleet,
        "acme/a",
        &gpus(1),
        &gpus(1),
        now,
    )
    .expect("victims");
    assert_eq!(ids(&v), ["b3"], "the least work lost");
    assert!(v.chosen[0].why.contains("it loses 100 s"), "{}", v.chosen[0].why);
    assert!(v.chosen[0].why.contains("3 other borrowed unit(s) would lose more"), "{v:?}");
    let v = choose_victims(
        &running,
        &usage_of(&running),
        &t,
        &fleet,
        "acme/a",
        &gpus(4),
        &gpus(4),
        now,
    )
    .expect("victims");
    assert_eq!(ids(&v), ["b3", "c1", "b2", "b1"], "cheapest first, across tenants");
    assert_eq!(
        choose_victims(
            &running,
            &usage_of(&running),
            &t,
            &fleet,
            "acme/a",
            &gpus(5),
            &gpus(5),
            now
        ),
        Err(NoVictims::Short),
        "never the guaranteed g1 nor the claimant's own work"
    );
    // Work holding none of what is short is never taken.
    let cpu_only = [Running {
        resources: Resources::new().with_cpu_milli(1_000),
        ..run("cpu", "acme/b", 0, Class::Borrowed, 99, None)
    }];
    assert_eq!(
        choose_victims(
            &cpu_only,
            &usage_of(&cpu_only),
            &t,
            &fleet,
            "acme/a",
            &gpus(1),
            &gpus(1),
            now
        ),
        Err(NoVictims::Short)
    );
}

#[test]
fn work_that_checkpoints_loses_only_its_grace_period_and_goes_first() {
    let (t, fleet) = (team_times(), gpus(16));
    let mut long = run("ckpt", "acme/b", 1, Class::Borrowed, 0, None);
    long.checkpoints = true;
    let running = [long, run("young", "acme/b", 1, Class::Borrowed, 950, None)];
    // ckpt ran 1000 s but loses only b's grace of 20 s; young would lose 50 s.
    let v = choose_victims(
        &running,
        &usage_of(&running),
        &t,
        &fleet,
        "acme/a",
        &gpus(1),
        &gpus(1),
        1_000_000,
    )
    .expect("victims");
    assert_eq!(ids(&v), ["ckpt"]);
    assert_eq!(v.chosen[0].candidate.lost_s, 20);
    assert!(v.chosen[0].why.contains("checkpoints on SIGTERM"), "{}", v.chosen[0].why);
}

#[test]
fn a_reclaim_takes_only_what_the_claimant_needs() {
    let (t, fleet) = (team_times(), gpus(16));
    // Cheapest first takes the three 1-GPU units (3 GPUs), then the 2-GPU one covers 4;
    // two of the small ones are then not needed: 2 + 1 covers 3 ... spared dearest first.
    let running = [
        run("s1", "acme/b", 1, Class::Borrowed, 990, None),
        run("s2", "acme/b", 1, Class::Borrowed, 980, None),
        run("big", "acme/b", 2, Class::Borrowed, 985, None),
    ];
    let v = choose_victims(
        &running,
        &usage_of(&running),
        &t,
        &fleet,
        "acme/a",
        &gpus(2),
        &gpus(2),
        1_000_000,
    )
    .expect("victims");
    // s1 (10 s) and s2 (20 s) cover 2 GPUs; big (15 s × 2 GPUs = dearer) is not needed.
    assert_eq!(ids(&v), ["s1", "s2"]);
    let v = choose_victims(
        &running,
        &usage_of(&running),
        &t,
        &fleet,
        "acme/a",
        &gpus(3),
        &gpus(3),
        1_000_000,
    )
    .expect("victims");
    // s1 + s2 + big = 4 > 3: one small one is spared, the dearer of the two (s2).
    assert_eq!(ids(&v), ["s1", "big"]);
}

#[test]
fn borrowed_work_within_its_minimum_run_time_is_protected_until_it_ends() {
    let (t, fleet) = (team_times(), gpus(16));
    // ml's minimum run time is 60 s: c1 (started at 980 s) is protected until 1040 s.
    let running = [
        run("c1", "acme/ml", 1, Class::Borrowed, 980, None),
        run("gml", "acme/ml", 1, Class::Guaranteed, 0, None),
    ];
    assert_eq!(
        choose_victims(
            &running,
            &usage_of(&running),
            &t,
            &fleet,
            "acme/a",
            &gpus(1),
            &gpus(1),
            1_000_000
        ),
        Err(NoVictims::Protected { until_ms: 1_040_000 })
    );
    let v = choose_victims(
        &running,
        &usage_of(&running),
        &t,
        &fleet,
        "acme/a",
        &gpus(1),
        &gpus(1),
        1_040_000,
    )
    .expect("free");
    assert_eq!(ids(&v), ["c1"]);
    // Without a minimum run time nothing is protected, not even work whose start is after
    // the books' now (a node's clock ahead): b's two at equal cost, the youngest first.
    // (Before, b2 was "protected" until its start and b1 taken:
    // crates/coordinator/tests/quota.rs saw the wrong victim now and then.)
    let running = [
        run("b1", "acme/b", 1, Class::Borrowed, 999, None),
        run("b2", "acme/b", 1, Class::Borrowed, 1001, None),
    ];
    let v = choose_victims(
        &running,
        &usage_of(&running),
        &t,
        &fleet,
        "acme/a",
        &gpus(1),
        &gpus(1),
        1_000_000,
    )
    .expect("b's");
    assert_eq!(ids(&v), ["b2"]);
}

/// Borrowed work is taken only while its tenant borrows: once its paths are back within
/// their guarantees (their guaranteed work ended), it would be owed back at once and its
/// tenant would reclaim in turn. Paths that hold the claimant too are not judged; a tenant
/// no quota below them bounds is judged by its class.
#[test]
fn borrowed_work_is_taken_only_while_its_tenant_borrows() {
    let (t, fleet) = (team_times(), gpus(16));
    // b's guarantee is 1: its one borrowed GPU is all it uses.
    let alone = [run("b1", "acme/b", 1, Class::Borrowed, 100, None)];
    assert_eq!(
        choose_victims(
            &alone,
            &usage_of(&alone),
            &t,
            &fleet,
            "acme/a",
            &gpus(1),
            &gpus(1),
            1_000_000
        ),
        Err(NoVictims::Short),
        "b is within its guarantee"
    );
    // Two borrowed: b uses 2 of 1, so one is taken (the youngest), never both.
    let two = [
        run("b1", "acme/b", 1, Class::Borrowed, 100, None),
        run("b2", "acme/b", 1, Class::Borrowed, 900, None),
    ];
    let v =
        choose_victims(&two, &usage_of(&two), &t, &fleet, "acme/a", &gpus(1), &gpus(1), 1_000_000)
            .expect("one of b's");
    assert_eq!(ids(&v), ["b2"]);
    assert_eq!(
        choose_victims(&two, &usage_of(&two), &t, &fleet, "acme/a", &gpus(2), &gpus(2), 1_000_000),
        Err(NoVictims::Short),
        "the second would take b below its guarantee"
    );
    // The running list may be one node's: the usage is the fleet's. b's guaranteed work on
    // another node makes its borrowed GPU here borrowed still.
    let elsewhere = [run("g", "acme/b", 1, Class::Guaranteed, 0, None), alone[0].clone()];
    let v = choose_victims(
        &alone,
        &usage_of(&elsewhere),
        &t,
        &fleet,
        "acme/a",
        &gpus(1),
        &gpus(1),
        1_000_000,
    )
    .expect("b borrows");
    assert_eq!(ids(&v), ["b1"]);
    // acme guarantees 4 and holds the claimant: not judged. b is over its own 2; c (no quota
    // of its own, sharing acme's remainder) is judged by its class.
    let t = tree(
        r#"{"acme": {"gpus": {"H100-80GB": {"guarantee": 4}}},
            "acme/a": {"gpus": {"H100-80GB": {"guarantee": 2}}},
            "acme/b": {"gpus": {"H100-80GB": {"guarantee": 2}}}}"#,
    );
    let mut running = vec![
        run("bg", "acme/b", 2, Class::Guaranteed, 0, None),
        run("b1", "acme/b", 1, Class::Borrowed, 500, None),
        run("c1", "acme/c", 1, Class::Borrowed, 100, None),
    ];
    let v = choose_victims(
        &running,
        &usage_of(&running),
        &t,
        &fleet,
        "acme/a",
        &gpus(2),
        &gpus(2),
        1_000_000,
    )
    .expect("both");
    assert_eq!(ids(&v), ["b1", "c1"]);
    // From outside acme, acme is judged too: it uses 4 of its 4, so nothing under it holds
    // capacity lent from outside, whatever b borrows from a inside it.
    assert_eq!(
        choose_victims(
            &running,
            &usage_of(&running),
            &t,
            &fleet,
            "org-z",
            &gpus(1),
            &gpus(1),
            1_000_000
        ),
        Err(NoVictims::Short)
    );
    // One more borrowed GPU of b: acme uses 5 of 4, so one GPU of it is taken, never two.
    running.push(run("b2", "acme/b", 1, Class::Borrowed, 800, None));
    let v = choose_victims(
        &running,
        &usage_of(&running),
        &t,
        &fleet,
        "org-z",
        &gpus(1),
        &gpus(1),
        1_000_000,
    )
    .expect("b's");
    assert_eq!(ids(&v), ["b2"]);
    assert_eq!(
        choose_victims(
            &running,
            &usage_of(&running),
            &t,
            &fleet,
            "org-z",
            &gpus(2),
            &gpus(2),
            1_000_000
        ),
        Err(NoVictims::Short)
    );
}

/// For placement (the fleet has room, the claimant's node not), work whose tenants borrow
/// goes first; if it frees too little there, the work of tenants back within their
/// guarantees is taken too, and each victim says so.
/// A node other than the claim's with `cap` GPUs, `free` of them free.
fn room(node: &str, cap: u64, free: u64) -> crate::Room {
    crate::Room { node: node.into(), capacity: gpus(cap), free: gpus(free) }
}

#[test]
fn consolidation_moves_only_checkpointing_borrowed_work_that_fits_elsewhere() {
    let (t, fleet) = (team_times(), gpus(16));
    let ck = |r: Running| Running { checkpoints: true, ..r };
    // At t = 1000 s on the claim's node: b1 (1 GPU, checkpoints), b2 (2, restarts from
    // zero), m1 (ml, 1, checkpoints, started 950 s: within ml's 60 s minimum run time), a
    // gang g of b checkpointing, b's guaranteed gb1; the claimant acme/a's own a1.
    let running = [
        ck(run("b1", "acme/b", 1, Class::Borrowed, 100, None)),
        run("b2", "acme/b", 2, Class::Borrowed, 900, None),
        ck(run("m1", "acme/ml", 1, Class::Borrowed, 950, None)),
        ck(run("g1", "acme/b", 1, Class::Borrowed, 10, Some("g"))),
        ck(run("gb1", "acme/b", 1, Class::Guaranteed, 10, None)),
        ck(run("a1", "acme/a", 1, Class::Borrowed, 10, None)),
    ];
    let consolidate = |short: u64, elsewhere: &[crate::Room]| {
        let mut rooms = elsewhere.to_vec();
        let place = crate::first_fit(&mut rooms);
        crate::choose_victims_to_consolidate(
            &running,
            &t,
            &fleet,
            "acme/a",
            &gpus(short),
            1_000_000,
            place,
        )
    };
    // One GPU short, another node with one free: b1 moves, though it ran longest (it
    // loses only b's grace period, 20 s).
    let v = consolidate(1, &[room("n2", 8, 1)]).expect("b1 moves");
    assert_eq!(ids(&v), ["b1"]);
    assert_eq!(v.chosen[0].candidate.lost_s, 20);
    assert!(v.chosen[0].why.contains("consolidation"), "{v:?}");
    assert!(v.chosen[0].why.contains("node n2 has room"), "{v:?}");
    // No other node has room for it: nothing moves.
    assert_eq!(consolidate(1, &[room("n2", 8, 0)]), None);
    assert_eq!(consolidate(1, &[]), None);
    // Two short: only b1 may move (b2 restarts from zero, m1 is protected, g1 is in a
    // gang, gb1 is guaranteed, a1 is the claimant's own): none frees two.
    assert_eq!(consolidate(2, &[room("n2", 8, 8)]), None);
    // Past ml's minimum run time m1 may move too; each needs its own room: with one GPU
    // free on each of two nodes both move, with one GPU free in all only one fits.
    let later = |elsewhere: &[crate::Room]| {
        let mut rooms = elsewhere.to_vec();
        let place = crate::first_fit(&mut rooms);
        crate::choose_victims_to_consolidate(
            &running,
            &t,
            &fleet,
            "acme/a",
            &gpus(2),
            1_020_000,
            place,
        )
    };
    let v = later(&[room("n2", 8, 1), room("n3", 8, 1)]).expect("b1 and m1 move");
    let mut got = ids(&v);
    got.sort();
    assert_eq!(got, ["b1", "m1"]);
    assert_eq!(later(&[room("n2", 8, 1)]), None);
}

#[test]
fn for_placement_work_of_tenants_within_their_guarantees_is_taken_last() {
    let (t, fleet) = (team_times(), gpus(16));
    let alone = [run("b1", "acme/b", 1, Class::Borrowed, 100, None)];
    let v = choose_victims_for_placement(
        &alone,
        &usage_of(&alone),
        &t,
        &fleet,
        "acme/a",
        &gpus(1),
        &gpus(1),
        1_000_000,
    )
    .expect("b1 for placement");
    assert_eq!(ids(&v), ["b1"]);
    assert!(v.chosen[0].why.contains("back within their guarantees is taken too"), "{v:?}");
    // ml borrows (2 of its 1): its c1 goes though b1 would lose less.
    let running = [
        alone[0].clone(),
        run("c1", "acme/ml", 1, Class::Borrowed, 50, None),
        run("gml", "acme/ml", 1, Class::Guaranteed, 0, None),
    ];
    let usage = usage_of(&running);
    let v = choose_victims_for_placement(
        &running,
        &usage,
        &t,
        &fleet,
        "acme/a",
        &gpus(1),
        &gpus(1),
        1_000_000,
    )
    .expect("c1");
    assert_eq!(ids(&v), ["c1"]);
    assert!(!v.chosen[0].why.contains("back within"), "{v:?}");
    let v = choose_victims_for_placement(
        &running,
        &usage,
        &t,
        &fleet,
        "acme/a",
        &gpus(2),
        &gpus(2),
        1_000_000,
    )
    .expect("both");
    assert_eq!(ids(&v), ["b1", "c1"]);
}

#[test]
fn a_gang_is_preempted_whole() {
    let fleet = gpus(16);
    let t = team_times();
    let running = [
        run("solo", "acme/b", 1, Class::Borrowed, 1, None),
        run("gb", "acme/b", 1, Class::Guaranteed, 0, None),
        run("g-0", "acme/ml", 1, Class::Borrowed, 5, Some("train")),
        run("g-1", "acme/ml", 1, Class::Guaranteed, 5, Some("train")),
        run("g-2", "acme/ml", 1, Class::Borrowed, 6, Some("train")),
        run("g-3", "acme/ml", 1, Class::Borrowed, 6, Some("train")),
    ];
    // The gang (4 GPUs, 994 s) loses more than solo (1 GPU, 999 s): solo goes for one GPU;
    // two GPUs need the gang, taken whole, and then solo is not needed.
    let v = choose_victims(
        &running,
        &usage_of(&running),
        &t,
        &fleet,
        "acme/a",
        &gpus(1),
        &gpus(1),
        1_000_000,
    )
    .expect("victims");
    assert_eq!(ids(&v), ["solo"]);
    let v = choose_victims(
        &running,
        &usage_of(&running),
        &t,
        &fleet,
        "acme/a",
        &gpus(2),
        &gpus(2),
        1_000_000,
    )
    .expect("victims");
    assert_eq!(ids(&v), ["g-0", "g-1", "g-2", "g-3"]);
    assert!(v.chosen[0].why.contains("gang train, stopped whole"), "{v:?}");
}

/// `owed_in_order` skips asking about a request as large as one already found not owed, but
/// only among requests of the same resources: a request of CPU alone (no quota bounds it)
/// is never guaranteed, while a larger one that also asks a GPU is owed.
#[test]
fn owed_in_order_compares_only_requests_of_the_same_resources() {
    let t = tree(r#"{"acme/a": {"gpus": {"H100-80GB": {"guarantee": 2}}}}"#);
    let cpu = Resources::new().with_cpu_milli(1_000);
    let requests = [cpu.clone(), gpus(1).plus(&cpu), gpus(2), gpus(1), gpus(3)];
    // The CPU alone is borrowed; the GPU and CPU fills 1 of 2; 2 GPUs are then beyond the
    // guarantee; 1 more fits it; 3 are beyond it (as large as 2, not asked again).
    assert_eq!(
        owed_in_order(&t, &Usage::new(), "acme/a", &requests),
        vec![false, true, false, true, false]
    );
}

/// Found by the red team of 8cee148: a gang with guaranteed members is released from the
/// scratch usage as borrowed whole (`cover`: `after.release(tenant, Class::Borrowed,
/// resources)`): where its tenant holds less borrowed than the gang's size, the guaranteed
/// part stays counted, so the paths above still look over their guarantees and the next
/// victim under them is taken though its tenant no longer borrows. acme guarantees 4 and
/// holds 6: ml's gang (2 guaranteed + 1 borrowed) and b's 3 borrowed. Once the gang is gone
/// acme uses 3 of 4, so b3 must not be taken; org-b (no quota, borrowed) should be. Fixed:
/// a candidate carries its guaranteed part and leaves the count as the classes its members
/// run as.
#[test]
fn a_gang_victim_leaves_the_count_as_the_classes_its_members_run_as() {
    let t = tree(
        r#"{"acme": {"gpus": {"H100-80GB": {"guarantee": 4}}},
            "org-a": {"gpus": {"H100-80GB": {"guarantee": 6}}}}"#,
    );
    let fleet = gpus(10);
    let running = [
        run("g-0", "acme/ml", 1, Class::Guaranteed, 990, Some("train")),
        run("g-1", "acme/ml", 1, Class::Guaranteed, 990, Some("train")),
        run("g-2", "acme/ml", 1, Class::Borrowed, 990, Some("train")),
        run("b1", "acme/b", 1, Class::Borrowed, 900, None),
        run("b2", "acme/b", 1, Class::Borrowed, 900, None),
        run("b3", "acme/b", 1, Class::Borrowed, 900, None),
        run("w1", "org-b", 1, Class::Borrowed, 800, None),
        run("w2", "org-b", 1, Class::Borrowed, 800, None),
    ];
    let usage = usage_of(&running);
    let v = choose_victims(&running, &usage, &t, &fleet, "org-a", &gpus(4), &gpus(4), 1_000_000)
        .expect("victims");
    // Replay the victims as they really leave (each member as the class it runs as).
    let mut before = usage.clone();
    for c in &v.chosen {
        assert!(
            borrowing(&t, &before, &c.candidate.tenant, &c.candidate.resources, "org-a", &gpus(4)),
            "{:?} taken though {} no longer borrows (victims {:?})",
            c.candidate.ids,
            c.candidate.tenant,
            ids(&v)
        );
        for id in &c.candidate.ids {
            let r = running.iter().find(|r| &r.id == id).expect("known");
            before.release(&r.tenant, r.class, &r.resources);
        }
    }
}

/// Found by the red team of 8cee148: a tenant with no quota of its own under a guaranteed
/// ancestor that also holds the claimant is judged by its class, even where the claimant
/// does not share that ancestor's remainder with it (the claimant has a guaranteed child of
/// its own). acme guarantees 10: a 4, b 4, and the remainder 2 is ml's (no quota). ml runs
/// 2 admitted borrowed (its guaranteed work ended): within the remainder. b runs 6 of its
/// 4. a asks 2 within its guarantee: ml's cheaper work is taken, and ml is owed it back at
/// once (`admit` answers it a reclaim), while b, which borrows, keeps its work. Fixed: such
/// a tenant is judged by what the remainder's tenants use beyond the remainder.
#[test]
fn a_tenant_within_its_parents_remainder_is_not_taken_for_a_guaranteed_sibling() {
    let t = tree(
        r#"{"acme": {"gpus": {"H100-80GB": {"guarantee": 10}}},
            "acme/a": {"gpus": {"H100-80GB": {"guarantee": 4}}},
            "acme/b": {"gpus": {"H100-80GB": {"guarantee": 4}}}}"#,
    );
    let fleet = gpus(10);
    let running = [
        run("a0", "acme/a", 2, Class::Guaranteed, 0, None),
        run("bg", "acme/b", 4, Class::Guaranteed, 0, None),
        run("b1", "acme/b", 1, Class::Borrowed, 500, None),
        run("b2", "acme/b", 1, Class::Borrowed, 500, None),
        run("m1", "acme/ml", 1, Class::Borrowed, 900, None),
        run("m2", "acme/ml", 1, Class::Borrowed, 900, None),
    ];
    let usage = usage_of(&running);
    // a is owed 2 and the fleet is full.
    assert_eq!(
        admit(&t, &fleet, &usage, "acme/a", &gpus(2)),
        Decision::Reclaim { short: gpus(2), under: None }
    );
    let v = choose_victims(&running, &usage, &t, &fleet, "acme/a", &gpus(2), &gpus(2), 1_000_000)
        .expect("victims");
    let taken = ids(&v);
    // Had m1, m2 gone and a0 grown to 4: ml asking its 2 again is owed them at once.
    let mut after = usage.clone();
    after.release("acme/ml", Class::Borrowed, &gpus(2));
    after.add("acme/a", Class::Guaranteed, &gpus(2));
    assert_eq!(
        admit(&t, &fleet, &after, "acme/ml", &gpus(2)),
        Decision::Reclaim { short: gpus(2), under: None },
        "ml is within acme's remainder: taking its work is owed back at once"
    );
    assert_eq!(taken, ["b1", "b2"], "b borrows; ml, within acme's remainder, does not");
}

/// Found by the red team of b211bf2: where the claimant shares the remainder with the
/// victim's tenant, the victim was judged by its class alone, even where the remainder's
/// tenants, the claimant's request granted, stay within the remainder. acme guarantees 4
/// (no children quotas): a and b share it. a holds 1, b 1 guaranteed and 1 borrowed
/// (admitted while acme was full), so acme uses 3 of 4; org-z (no quota) borrows 3. a asks
/// 1, owed: acme then uses 4 of 4, so the capacity a is short of is org-z's. b's younger
/// borrowed GPU was taken, and b asking it again was owed it at once (and would reclaim
/// org-z's in turn). Fixed: the remainder's tenants are judged by what they use beyond it,
/// the claimant's request counted among them.
#[test]
fn a_fellow_sharer_of_the_claimants_remainder_is_taken_only_beyond_it() {
    let t = tree(r#"{"acme": {"gpus": {"H100-80GB": {"guarantee": 4}}}}"#);
    let fleet = gpus(6);
    let running = [
        run("a0", "acme/a", 1, Class::Guaranteed, 0, None),
        run("b0", "acme/b", 1, Class::Guaranteed, 0, None),
        run("b1", "acme/b", 1, Class::Borrowed, 900, None),
        run("z1", "org-z", 1, Class::Borrowed, 100, None),
        run("z2", "org-z", 1, Class::Borrowed, 100, None),
        run("z3", "org-z", 1, Class::Borrowed, 100, None),
    ];
    let usage = usage_of(&running);
    assert_eq!(
        admit(&t, &fleet, &usage, "acme/a", &gpus(1)),
        Decision::Reclaim { short: gpus(1), under: None }
    );
    let v = choose_victims(&running, &usage, &t, &fleet, "acme/a", &gpus(1), &gpus(1), 1_000_000)
        .expect("victims");
    let tenants: Vec<&str> = v.chosen.iter().map(|c| c.candidate.tenant.as_str()).collect();
    assert_eq!(
        tenants,
        ["org-z"],
        "org-z borrows; b, within acme's remainder with a's 1, does not"
    );
    for c in &v.chosen {
        let mut after = usage.clone();
        after.add("acme/a", Class::Guaranteed, &gpus(1));
        after.release(&c.candidate.tenant, Class::Borrowed, &c.candidate.resources);
        assert!(
            !owed(&t, &after, &c.candidate.tenant, &c.candidate.resources, &Resources::new()),
            "{:?} of {} taken, and owed back at once (victims {:?})",
            c.candidate.ids,
            c.candidate.tenant,
            ids(&v)
        );
    }
}

/// Found by the red team of b211bf2: a resource no quota on a tenant's chain bounds was
/// admitted as if guaranteed (`admit` asked guarantees only of the resources the chain
/// bounds), and `borrowing` followed it: a tenant could hold any amount of it, and no
/// reclaim took it back for a tenant that *is* guaranteed it. Fleet: 8 GPUs, 16 cores. a is
/// guaranteed 8 cores; b only 1 GPU (nothing bounds its CPU). b1 (1 GPU, 16 cores) is now
/// admitted borrowed, beyond b's guarantee of cores (none), though its GPU is within b's.
/// a asks 4 cores, owed, answered `Reclaim`, and takes b1 (Kueue: a queue with no nominal
/// quota of a resource borrows all it uses of it). Admitted guaranteed (the old rule),
/// `admit` answered `Wait`; with `borrowing` judging the unbounded cores by nothing, a
/// found no victim.
#[test]
fn a_resource_its_chain_does_not_bound_is_taken_back_for_the_tenant_guaranteed_it() {
    let t = tree(
        r#"{"acme/a": {"cpu_cores": {"guarantee": 8}},
            "acme/b": {"gpus": {"H100-80GB": {"guarantee": 1}}}}"#,
    );
    let fleet = gpus(8).with(Resource::Cpu, 16 * MILLI_PER_CORE);
    let b1 = Running {
        resources: gpus(1).with(Resource::Cpu, 16 * MILLI_PER_CORE),
        ..run("b1", "acme/b", 1, Class::Borrowed, 100, None)
    };
    assert_eq!(
        admit(&t, &fleet, &Usage::default(), "acme/b", &b1.resources),
        Decision::Admit {
            class: Class::Borrowed,
            over: Some(("acme/b".to_string(), Resource::Cpu))
        },
        "b's cores are guaranteed to a, none to b"
    );
    assert_eq!(
        admit(&t, &fleet, &Usage::default(), "acme/b/alice", &b1.resources),
        Decision::Admit {
            class: Class::Borrowed,
            over: Some(("acme/b".to_string(), Resource::Cpu))
        },
        "a user under b: b is where a guarantee of cores would go"
    );
    let gpu_only = gpus(1);
    assert_eq!(
        admit(&t, &fleet, &Usage::default(), "acme/b", &gpu_only),
        Decision::Admit { class: Class::Guaranteed, over: None },
        "b's GPU alone is within b's guarantee"
    );
    let running = [b1];
    let usage = usage_of(&running);
    let four = Resources::new().with(Resource::Cpu, 4 * MILLI_PER_CORE);
    assert!(owed(&t, &usage, "acme/a", &four, &Resources::new()));
    assert_eq!(
        admit(&t, &fleet, &usage, "acme/a", &four),
        Decision::Reclaim { short: four.clone(), under: None }
    );
    assert!(
        choose_victims(&running, &usage, &t, &fleet, "acme/a", &four, &four, 1_000_000).is_ok(),
        "a is owed 4 of its 8 cores; b holds all 16 with no CPU guarantee"
    );
}

/// Found by the red team of b211bf2: a tenant sharing the claimant's remainder in one
/// resource was never judged in it where the claimant sits under a guaranteed child in
/// another (that resource decided "within", the shared one nothing): the claimant waited
/// for as long as the tenant ran, though the remainder was used beyond its guarantee.
/// acme guarantees 4 GPUs (a 2 of them) and 8 cores (no child guarantees cores). ml (no
/// quota) runs 1 GPU and all 12 cores, admitted borrowed. a asks 4 cores, owed: ml's work
/// was not taken (`NoVictims::Short`). Fixed: ml shares acme's cores with a, and together
/// with a's 4 they use 16 of 8.
#[test]
fn a_remainder_used_beyond_its_guarantee_is_reclaimed_for_a_claimant_sharing_it() {
    let t = tree(
        r#"{"acme": {"gpus": {"H100-80GB": {"guarantee": 4}}, "cpu_cores": {"guarantee": 8}},
            "acme/a": {"gpus": {"H100-80GB": {"guarantee": 2}}}}"#,
    );
    let fleet = gpus(8).with(Resource::Cpu, 12 * MILLI_PER_CORE);
    let m1 = Running {
        resources: gpus(1).with(Resource::Cpu, 12 * MILLI_PER_CORE),
        ..run("m1", "acme/ml", 1, Class::Borrowed, 100, None)
    };
    let running = [m1];
    let usage = usage_of(&running);
    let four = Resources::new().with(Resource::Cpu, 4 * MILLI_PER_CORE);
    assert_eq!(
        admit(&t, &fleet, &usage, "acme/a", &four),
        Decision::Reclaim { short: four.clone(), under: None }
    );
    let v = choose_victims(&running, &usage, &t, &fleet, "acme/a", &four, &four, 1_000_000);
    assert_eq!(v.map(|v| ids(&v)), Ok(vec!["m1".to_string()]), "acme uses 12 of its 8 cores");
    // Not owed back: with a's 4, ml's 12 cores would take acme to 16 of 8.
    let mut after = Usage::new();
    after.add("acme/a", Class::Guaranteed, &four);
    assert!(!owed(&t, &after, "acme/ml", &running[0].resources, &Resources::new()));
}

/// Red team of c8372df: `borrowing` judged a resource nothing on a unit's chain bounds by
/// whether the claimant *asks* for it, so a claimant short of GPUs only, asking one core it
/// has plenty of, took the GPUs of a tenant within its own GPU guarantee (b's work is
/// borrowed only for its core) and spared c, which has no quota and borrows every GPU it
/// holds. Now such a resource decides only where the claimant is short of it (Kueue takes
/// candidates from queues borrowing what the preemptor needs).
#[test]
fn a_gpu_short_claim_asking_a_core_it_is_not_short_of_takes_the_gpu_borrower() {
    let t = tree(
        r#"{"acme/a": {"gpus": {"H100-80GB": {"guarantee": 4}}, "cpu_cores": {"guarantee": 8}},
            "acme/b": {"gpus": {"H100-80GB": {"guarantee": 4}}}}"#,
    );
    let core = Resources::new().with(Resource::Cpu, MILLI_PER_CORE);
    let fleet = gpus(8).with(Resource::Cpu, 64 * MILLI_PER_CORE);
    let b_asks = gpus(4).plus(&core);
    assert_eq!(
        admit(&t, &fleet, &Usage::new(), "acme/b", &b_asks),
        Decision::Admit { class: Class::Borrowed, over: Some(("acme/b".into(), Resource::Cpu)) }
    );
    let running = [
        Running {
            resources: gpus(4).plus(&core),
            ..run("c1", "org-c", 4, Class::Borrowed, 100, None)
        },
        Running { resources: b_asks.clone(), ..run("b1", "acme/b", 4, Class::Borrowed, 150, None) },
    ];
    let usage = usage_of(&running);
    let claim = gpus(4).plus(&core);
    let Decision::Reclaim { short, under: None } = admit(&t, &fleet, &usage, "acme/a", &claim)
    else {
        panic!("a is within its guarantees and the fleet's GPUs are lent out")
    };
    assert_eq!(short, gpus(4), "short of GPUs only");
    for asked in [gpus(4), claim] {
        let v = choose_victims(&running, &usage, &t, &fleet, "acme/a", &asked, &short, 1_000_000)
            .expect("victims");
        let ids: Vec<_> = v.chosen.iter().flat_map(|c| c.candidate.ids.clone()).collect();
        assert_eq!(ids, ["c1"], "b is within its GPU guarantee; a is short of GPUs, not cores");
    }
}

/// The same for a resource the chain bounds: b is within its GPU guarantee and beyond its
/// guarantee of cores, so its work runs borrowed; a, short of GPUs only, takes c's GPUs
/// (c borrows every GPU it holds), not b's: a unit is taken only while its tenant borrows
/// what the claimant is short of (Kueue's candidates are workloads of queues borrowing the
/// resources the preemptor needs). Before, b's GPUs were taken for the cores it borrows.
#[test]
fn a_claim_takes_no_work_whose_tenant_borrows_only_what_the_claim_is_not_short_of() {
    let t = tree(
        r#"{"acme/a": {"gpus": {"H100-80GB": {"guarantee": 4}}, "cpu_cores": {"guarantee": 8}},
            "acme/b": {"gpus": {"H100-80GB": {"guarantee": 4}}, "cpu_cores": {"guarantee": 1}}}"#,
    );
    let cores = |n: u64| Resources::new().with(Resource::Cpu, n * MILLI_PER_CORE);
    let fleet = gpus(8).with(Resource::Cpu, 64 * MILLI_PER_CORE);
    let b_asks = gpus(4).plus(&cores(2));
    assert!(matches!(
        admit(&t, &fleet, &Usage::new(), "acme/b", &b_asks),
        Decision::Admit { class: Class::Borrowed, .. }
    ));
    let running = [
        Running {
            resources: gpus(4).plus(&cores(1)),
            ..run("c1", "org-c", 4, Class::Borrowed, 100, None)
        },
        Running { resources: b_asks, ..run("b1", "acme/b", 4, Class::Borrowed, 150, None) },
    ];
    let usage = usage_of(&running);
    let claim = gpus(4).plus(&cores(1));
    let Decision::Reclaim { short, under: None } = admit(&t, &fleet, &usage, "acme/a", &claim)
    else {
        panic!("a is within its guarantees and the fleet's GPUs are lent out")
    };
    assert_eq!(short, gpus(4), "short of GPUs only");
    let v = choose_victims(&running, &usage, &t, &fleet, "acme/a", &claim, &short, 1_000_000)
        .expect("victims");
    let ids: Vec<_> = v.chosen.iter().flat_map(|c| c.candidate.ids.clone()).collect();
    assert_eq!(ids, ["c1"], "b borrows cores, not GPUs; a is short of GPUs");
    // Short of cores too, b's work (beyond its guarantee of cores) may be taken: alone it
    // covers both, and c's, which has run longer, is spared.
    let short = gpus(4).plus(&cores(2));
    let v = choose_victims(&running, &usage, &t, &fleet, "acme/a", &claim, &short, 1_000_000)
        .expect("victims");
    let ids: Vec<_> = v.chosen.iter().flat_map(|c| c.candidate.ids.clone()).collect();
    assert_eq!(ids, ["b1"]);
}

/// Red team of 7c229d3: judging a unit only by the resources the claimant is short of
/// skips every resource its chain bounds that the claim is not short of, so a unit whose
/// only short resource is one nothing bounds (and the claimant guarantees nowhere) falls
/// through to "nothing on the chain bounds any of its resources: judged by its class" —
/// although its chain does bound its GPUs and it is within that guarantee. b's unit was
/// admitted borrowed (before b's guaranteed work ended) and b is now back within its GPU
/// guarantee, the very case the module says is not taken ("it would be owed back at
/// once"); a, within its guarantee, is short of cores nobody bounds or guarantees, and
/// takes b's 4 guaranteed GPUs with the cores. Before 7c229d3 the GPUs b holds decided
/// (bounded, within guarantee: not borrowing) and nothing was taken. The public
/// `borrowing` (what the simulator and the proptests ask) says b does not borrow.
#[test]
fn red_a_claim_short_of_an_unbounded_resource_takes_no_tenant_within_the_guarantees_its_chain_bounds(
) {
    let t = tree(
        r#"{"acme/a": {"gpus": {"H100-80GB": {"guarantee": 4}}},
            "acme/b": {"gpus": {"H100-80GB": {"guarantee": 4}}}}"#,
    );
    let cores = |n: u64| Resources::new().with(Resource::Cpu, n * MILLI_PER_CORE);
    let fleet = gpus(8).with(Resource::Cpu, 16 * MILLI_PER_CORE);
    let running = [Running {
        resources: gpus(4).plus(&cores(16)),
        ..run("b1", "acme/b", 4, Class::Borrowed, 100, None)
    }];
    let usage = usage_of(&running);
    let claim = gpus(2).plus(&cores(8));
    let Decision::Reclaim { short, under: None } = admit(&t, &fleet, &usage, "acme/a", &claim)
    else {
        panic!("a is within its guarantees and b's borrowed-class unit holds the cores")
    };
    assert_eq!(short, cores(8), "short of cores only");
    assert!(
        !borrowing(&t, &usage, "acme/b", &running[0].resources, "acme/a", &claim),
        "b is within its GPU guarantee: the public rule says it borrows nothing"
    );
    let v = choose_victims(&running, &usage, &t, &fleet, "acme/a", &claim, &short, 1_000_000);
    assert_eq!(
        v.map(|v| ids(&v)),
        Err(NoVictims::Short),
        "b is within every guarantee its chain sets; its work is not a's to take"
    );
}
