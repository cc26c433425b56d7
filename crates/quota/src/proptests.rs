//! Generated cases: admission keeps every ceiling and every guarantee, whatever the order
//! of requests and releases; victims free what is short, only borrowed work, gangs whole.

use proptest::prelude::*;

use crate::*;

const H100: &str = "H100-80GB";
const PATHS: &[&str] = &["acme", "acme/a", "acme/b", "acme/a/p", "acme/a/p/u", "acme/b/q"];

/// A random valid tree: each path may get a GPU guarantee and a ceiling (in quarter GPUs);
/// invalid combinations (children above parents) are dropped by validation itself.
fn arb_tree() -> impl Strategy<Value = QuotaTree> {
    arb_tree_in(PATHS, 4, 40)
}

/// A random valid tree over `paths`: each path may get a guarantee and a ceiling of H100s,
/// each a whole number of `1/steps` GPUs up to `max_steps` of them; invalid combinations
/// (children above parents) are dropped by validation itself.
pub(crate) fn arb_tree_in(
    paths: &'static [&'static str],
    steps: u64,
    max_steps: u64,
) -> impl Strategy<Value = QuotaTree> {
    arb_tree_lending(paths, steps, max_steps, false)
}

/// [`arb_tree_in`], and with `lending` a guarantee may also get a lending limit (a whole
/// number of `1/steps` GPUs, at most the guarantee).
pub(crate) fn arb_tree_lending(
    paths: &'static [&'static str],
    steps: u64,
    max_steps: u64,
    lending: bool,
) -> impl Strategy<Value = QuotaTree> {
    let one = (any::<bool>(), 0..=max_steps, 0..=max_steps, any::<bool>());
    prop::collection::vec((one, any::<bool>(), 0..=max_steps), paths.len()).prop_filter_map(
        "valid",
        move |limits| {
            let mut entries = Vec::new();
            for (((on, g, extra, has_g), has_lend, lend), path) in limits.iter().zip(paths) {
                if !on {
                    continue;
                }
                let lend = *lend.min(g) as f64 / steps as f64;
                let g = *g as f64 / steps as f64;
                let c = g + *extra as f64 / steps as f64;
                let body = if *has_g && lending && *has_lend {
                    format!(r#"{{"guarantee": {g}, "ceiling": {c}, "lending_limit": {lend}}}"#)
                } else if *has_g {
                    format!(r#"{{"guarantee": {g}, "ceiling": {c}}}"#)
                } else {
                    format!(r#"{{"ceiling": {c}}}"#)
                };
                entries.push(format!(r#""{path}": {{"gpus": {{"{H100}": {body}}}}}"#));
            }
            let spec: QuotaSpec =
                serde_json::from_str(&format!("{{{}}}", entries.join(","))).ok()?;
            spec.validate("quotas", |t| paths.contains(&t)).ok()
        },
    )
}

#[derive(Debug, Clone)]
enum Op {
    Ask { tenant: usize, quarters: u64 },
    Release { nth: usize },
}

fn arb_ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![
            3 => (0..PATHS.len(), 1u64..=12).prop_map(|(tenant, quarters)| Op::Ask { tenant, quarters }),
            1 => any::<usize>().prop_map(|nth| Op::Release { nth }),
        ],
        1..60,
    )
}

/// [`owed_in_order`] and [`owed_behind`] of each of `requests` answer as [`owed`] asked of
/// it with the owed ones before it counted ahead.
fn same_as_owed_of_each(
    tree: &QuotaTree,
    usage: &Usage,
    tenant: &str,
    requests: &[Resources],
) -> Result<(), TestCaseError> {
    let fast = owed_in_order(tree, usage, tenant, requests);
    let mut ahead = Resources::new();
    for (i, r) in requests.iter().enumerate() {
        let slow = owed(tree, usage, tenant, r, &ahead);
        prop_assert_eq!(fast[i], slow, "request {} of {:?}", i, requests);
        prop_assert_eq!(owed_behind(tree, usage, tenant, r, &requests[..i]), slow);
        if slow {
            ahead.add(r);
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn admission_never_crosses_a_ceiling_nor_counts_borrowed_as_guaranteed(
        tree in arb_tree(),
        fleet_gpus in 1u64..=24,
        ops in arb_ops(),
    ) {
        let fleet = Resources::new().with_gpus(H100, fleet_gpus);
        let gpu = Resource::gpu(H100);
        let mut usage = Usage::new();
        let mut held: Vec<(&str, Class, Resources)> = Vec::new();
        for op in ops {
            match op {
                Op::Ask { tenant, quarters } => {
                    let tenant = PATHS[tenant];
                    let req = Resources::new().with(gpu.clone(), quarters * MICRO_PER_GPU / 4);
                    if let Decision::Admit { class, .. } = admit(&tree, &fleet, &usage, tenant, &req) {
                        usage.add(tenant, class, &req);
                        held.push((tenant, class, req));
                    }
                }
                Op::Release { nth } => {
                    if !held.is_empty() {
                        let (t, c, r) = held.remove(nth % held.len());
                        usage.release(t, c, &r);
                    }
                }
            }
            prop_assert!(usage.total().total().fits_in(&fleet), "capacity crossed");
            for q in tree.iter() {
                let l = q.limits[&gpu];
                let of = usage.of(&q.path);
                if let Some(c) = l.ceiling {
                    prop_assert!(of.total().get(&gpu) <= c, "ceiling of {} crossed", q.path);
                }
                if let Some(g) = l.guarantee {
                    prop_assert!(of.guaranteed.get(&gpu) <= g, "guarantee of {} overcounted", q.path);
                }
            }
        }
    }

    #[test]
    fn victims_cover_the_shortfall_with_borrowed_units_and_whole_gangs(
        items in prop::collection::vec((0usize..4, 1u64..=4, any::<bool>(), 0u64..100, prop::option::of(0u8..3)), 0..20),
        short in 1u64..=12,
    ) {
        let tenants = ["acme/a", "acme/b", "acme/b/q", "org-c"];
        let running: Vec<Running> = items
            .iter()
            .enumerate()
            .map(|(i, &(t, n, borrowed, started, gang))| Running {
                id: format!("c{i}"),
                tenant: tenants[t].into(),
                resources: Resources::new().with_gpus(H100, n),
                class: if borrowed { Class::Borrowed } else { Class::Guaranteed },
                started_ms: started * 1000,
                // Gangs do not cross tenants.
                gang: gang.map(|g| format!("{}-{g}", tenants[t])),
                checkpoints: started % 3 == 0,
            })
            .collect();
        let fleet = Resources::new().with_gpus(H100, 64);
        let need = Resources::new().with_gpus(H100, short);
        let gang_of = |r: &Running| r.gang.clone();
        // What could be taken at most: every unit with a borrowed member, outside acme/a.
        let takeable: u64 = running
            .iter()
            .filter(|r| !is_within(&r.tenant, "acme/a"))
            .filter(|r| r.class == Class::Borrowed
                || gang_of(r).is_some_and(|g| running.iter().any(|o| o.gang.as_ref() == Some(&g) && o.class == Class::Borrowed)))
            .map(|r| r.resources.get(&Resource::gpu(H100)))
            .sum();
        let tree = QuotaTree::default();
        match choose_victims(&running, &crate::tests::usage_of(&running), &tree, &fleet, "acme/a", &need, &need, 200_000) {
            Err(NoVictims::Protected { .. }) => prop_assert!(false, "no minimum run time set"),
            Err(NoVictims::Short) => prop_assert!(takeable < short * MICRO_PER_GPU),
            Ok(v) => {
                let v: Vec<String> = v.chosen.iter().flat_map(|c| c.candidate.ids.clone()).collect();
                let chosen: Vec<&Running> = running.iter().filter(|r| v.contains(&r.id)).collect();
                prop_assert_eq!(chosen.len(), v.len(), "no duplicates");
                let freed: u64 = chosen.iter().map(|r| r.resources.get(&Resource::gpu(H100))).sum();
                prop_assert!(freed >= short * MICRO_PER_GPU);
                // Only what is needed: without any one chosen unit, the rest falls short.
                let unit = |r: &Running| r.gang.clone().unwrap_or_else(|| r.id.clone());
                let units: std::collections::BTreeSet<String> = chosen.iter().map(|r| unit(r)).collect();
                for u in &units {
                    let rest: u64 = chosen
                        .iter()
                        .filter(|r| &unit(r) != u)
                        .map(|r| r.resources.get(&Resource::gpu(H100)))
                        .sum();
                    prop_assert!(rest < short * MICRO_PER_GPU, "unit {} was not needed", u);
                }
                for r in &chosen {
                    prop_assert!(!is_within(&r.tenant, "acme/a"));
                    if let Some(g) = &r.gang {
                        for o in running.iter().filter(|o| o.gang.as_ref() == Some(g)) {
                            prop_assert!(v.contains(&o.id), "gang {} split", g);
                        }
                    } else {
                        prop_assert_eq!(r.class, Class::Borrowed);
                    }
                }
            }
        }
    }
}

proptest! {
    /// `Usage` keeps every path's subtree total as it goes (issue 28): what `of` reads is
    /// what summing the tenants within the path gives, after any adds and releases (a
    /// release of more than is held gives back only what is held).
    #[test]
    fn usage_subtree_totals_are_the_sums_over_the_tenants_within(
        ops in prop::collection::vec((0..PATHS.len(), any::<bool>(), any::<bool>(), 0u64..5), 0..60)
    ) {
        let mut u = Usage::new();
        for (tenant, add, guaranteed, n) in ops {
            let class = if guaranteed { Class::Guaranteed } else { Class::Borrowed };
            let r = Resources::new().with_gpus(H100, n);
            if add {
                u.add(PATHS[tenant], class, &r);
            } else {
                u.release(PATHS[tenant], class, &r);
            }
        }
        for path in PATHS.iter().chain(["acme/ab", "acme/a/p/u/x", "other"].iter()) {
            let mut sum = Held::default();
            for (t, h) in u.tenants() {
                if is_within(t, path) {
                    sum.guaranteed.add(&h.guaranteed);
                    sum.borrowed.add(&h.borrowed);
                }
            }
            prop_assert_eq!(u.of(path), sum, "{}", path);
        }
        let mut all = Held::default();
        for (_, h) in u.tenants() {
            all.guaranteed.add(&h.guaranteed);
            all.borrowed.add(&h.borrowed);
        }
        prop_assert_eq!(u.total(), all);
    }

    /// [`owed_in_order`]'s shortcut (a request at least as large as one found not owed
    /// before it is not owed) gives what asking [`owed`] of each request gives, with the
    /// owed ones before it counted ahead; CPU is asked too by some (a request then covers a
    /// smaller GPU-only one without being comparable the other way).
    #[test]
    fn owed_in_order_answers_as_owed_asked_of_each_request(
        tree in arb_tree(),
        held in prop::collection::vec((0..PATHS.len(), any::<bool>(), 0u64..=8), 0..8),
        tenant in 0..PATHS.len(),
        asks in prop::collection::vec((0u64..=12, prop::option::of(0u64..=2)), 0..12),
    ) {
        let mut usage = Usage::new();
        for (t, guaranteed, quarters) in held {
            let class = if guaranteed { Class::Guaranteed } else { Class::Borrowed };
            usage.add(PATHS[t], class, &Resources::new().with(Resource::gpu(H100), quarters * MICRO_PER_GPU / 4));
        }
        let tenant = PATHS[tenant];
        let requests: Vec<Resources> = asks
            .iter()
            .map(|&(quarters, cores)| {
                let r = Resources::new().with(Resource::gpu(H100), quarters * MICRO_PER_GPU / 4);
                match cores {
                    Some(c) => r.with(Resource::Cpu, c * MILLI_PER_CORE),
                    None => r,
                }
            })
            .collect();
        same_as_owed_of_each(&tree, &usage, tenant, &requests)?;
    }
}

/// Tenants asked about by [`owed_in_order_answers_as_owed_over_every_resource`]: the tree's
/// paths, one under its deepest and one outside it.
const TENANTS: &[&str] =
    &["acme", "acme/a", "acme/b", "acme/a/p", "acme/a/p/u", "acme/b/q", "acme/a/p/u/x", "org-c"];

/// One resource's limits at one path, in `1/steps` of its unit: a guarantee, a ceiling
/// above it (or alone), a lending limit at most the guarantee; `None` where the path does
/// not bound it.
fn limits_json(l: &Option<(Option<u64>, Option<u64>, Option<u64>)>, steps: u64) -> Option<String> {
    let (g, extra, lend) = (*l)?;
    let v = |x: u64| x as f64 / steps as f64;
    let mut parts = Vec::new();
    if let Some(g) = g {
        parts.push(format!(r#""guarantee": {}"#, v(g)));
        if let Some(lend) = lend {
            parts.push(format!(r#""lending_limit": {}"#, v(lend.min(g))));
        }
    }
    if let Some(extra) = extra {
        parts.push(format!(r#""ceiling": {}"#, v(g.unwrap_or(0) + extra)));
    }
    (!parts.is_empty()).then(|| format!("{{{}}}", parts.join(", ")))
}

/// A random valid tree over [`PATHS`] bounding H100s (quarters), CPU (half cores) and
/// memory (GiB): guarantees, ceilings and lending limits of each, any combination.
fn arb_tree_every_resource() -> impl Strategy<Value = QuotaTree> {
    let one = |max: u64| {
        prop::option::weighted(
            0.5,
            (prop::option::of(0..=max), prop::option::of(0..=max), prop::option::of(0..=max)),
        )
    };
    prop::collection::vec((one(16), one(16), one(16)), PATHS.len()).prop_filter_map(
        "valid",
        move |limits| {
            let mut entries = Vec::new();
            for ((gpu, cpu, mem), path) in limits.iter().zip(PATHS) {
                let mut fields = Vec::new();
                if let Some(b) = limits_json(gpu, 4) {
                    fields.push(format!(r#""gpus": {{"{H100}": {b}}}"#));
                }
                if let Some(b) = limits_json(cpu, 2) {
                    fields.push(format!(r#""cpu_cores": {b}"#));
                }
                if let Some(b) = limits_json(mem, 1) {
                    fields.push(format!(r#""memory_gib": {b}"#));
                }
                if !fields.is_empty() {
                    entries.push(format!(r#""{path}": {{{}}}"#, fields.join(", ")));
                }
            }
            let spec: QuotaSpec =
                serde_json::from_str(&format!("{{{}}}", entries.join(","))).ok()?;
            spec.validate("quotas", |t| PATHS.contains(&t)).ok()
        },
    )
}

/// Some of H100s (any micro-GPU fraction up to 4, or none), CPU (millicores up to 8 cores)
/// and memory (MiB up to 16 GiB), each maybe absent or zero.
fn arb_amounts() -> impl Strategy<Value = Resources> {
    let gpu = prop_oneof![
        Just(0u64),
        (1u64..=16).prop_map(|q| q * MICRO_PER_GPU / 4),
        0u64..=4 * MICRO_PER_GPU
    ];
    let cpu =
        prop::option::of(prop_oneof![Just(0u64), (1u64..=16).prop_map(|h| h * 500), 0u64..=8_000]);
    let mem = prop::option::of(prop_oneof![
        Just(0u64),
        (1u64..=16).prop_map(|g| g * MIB_PER_GIB),
        0u64..=16 * MIB_PER_GIB
    ]);
    (gpu, cpu, mem).prop_map(|(g, c, m)| {
        let mut r = Resources::new().with(Resource::gpu(H100), g);
        if let Some(c) = c {
            r = r.with(Resource::Cpu, c);
        }
        if let Some(m) = m {
            r = r.with(Resource::Memory, m);
        }
        r
    })
}

proptest! {
    /// [`owed_in_order_answers_as_owed_asked_of_each_request`] over every resource and
    /// limit (red team of 6fd3c60): GPU, CPU and memory guarantees, ceilings (so
    /// `Reclaim { under }` where other tenants' borrowed work fills one) and lending
    /// limits, fractional and zero amounts, other tenants' guaranteed, borrowed and leased
    /// usage, tenants under and outside the tree, and requests repeated exactly.
    #[test]
    fn owed_in_order_answers_as_owed_over_every_resource(
        tree in arb_tree_every_resource(),
        held in prop::collection::vec((0..TENANTS.len(), 0u8..3, arb_amounts()), 0..8),
        tenant in 0..TENANTS.len(),
        asks in prop::collection::vec((arb_amounts(), any::<bool>()), 0..12),
    ) {
        let mut usage = Usage::new();
        for (t, how, r) in &held {
            match how {
                0 => usage.add(TENANTS[*t], Class::Guaranteed, r),
                1 => usage.add(TENANTS[*t], Class::Borrowed, r),
                _ => usage.add_leased(TENANTS[*t], r),
            }
        }
        let tenant = TENANTS[tenant];
        let mut requests: Vec<Resources> = Vec::new();
        for (r, again) in asks {
            // Some asked again exactly as the one before.
            match requests.last() {
                Some(last) if again => requests.push(last.clone()),
                _ => requests.push(r),
            }
        }
        same_as_owed_of_each(&tree, &usage, tenant, &requests)?;
    }
}

proptest! {
    /// Where the fleet is short, a reclaim takes work only of tenants that borrow, each
    /// still borrowing with the victims taken before it gone: never a tenant within its
    /// guarantee, and never one further below it than its last victim.
    #[test]
    fn a_reclaim_takes_only_from_tenants_that_borrow_and_never_far_below_a_guarantee(
        tree in arb_tree(),
        items in prop::collection::vec((1usize..PATHS.len(), 1u64..=3, any::<bool>(), 0u64..100), 0..16),
        short in 1u64..=8,
    ) {
        let claimant = "acme/a/p/u";
        let running: Vec<Running> = items
            .iter()
            .enumerate()
            .map(|(i, &(t, n, borrowed, started))| Running {
                id: format!("c{i}"),
                tenant: PATHS[t].into(),
                resources: Resources::new().with_gpus(H100, n),
                class: if borrowed { Class::Borrowed } else { Class::Guaranteed },
                started_ms: started * 1000,
                gang: None,
                checkpoints: false,
            })
            .collect();
        let usage = crate::tests::usage_of(&running);
        let fleet = Resources::new().with_gpus(H100, 64);
        let need = Resources::new().with_gpus(H100, short);
        let Ok(v) = choose_victims(&running, &usage, &tree, &fleet, claimant, &need, &need, 200_000) else {
            return Ok(());
        };
        let chosen: Vec<&Running> = v
            .chosen
            .iter()
            .flat_map(|c| c.candidate.ids.iter())
            .map(|id| running.iter().find(|r| &r.id == id).expect("known"))
            .collect();
        // Each, with the victims before it gone, still borrowed when taken: nothing was
        // taken from a tenant once it no longer did.
        let mut before = usage.clone();
        for r in &chosen {
            prop_assert!(
                borrowing(&tree, &before, &r.tenant, &r.resources, claimant, &need),
                "{} taken from a tenant that no longer borrows",
                r.id
            );
            before.release(&r.tenant, r.class, &r.resources);
        }
    }
}

/// `usage` with every tenant's work counted as guaranteed (what it uses,
/// whatever class it was admitted with): a tenant owed here is within its guarantees by
/// what it really uses.
fn total_view(usage: &Usage) -> Usage {
    let mut u = Usage::new();
    for (t, h) in usage.tenants() {
        u.add(t, Class::Guaranteed, &h.total());
    }
    u
}

/// The outermost paths guaranteeing each resource: their guarantees summed.
fn top_guarantees(tree: &QuotaTree) -> Resources {
    let mut out = Resources::new();
    for q in tree.iter() {
        for (r, l) in &q.limits {
            let Some(g) = l.guarantee else { continue };
            let inner = chain(&q.path).skip(1).any(|p| {
                tree.get(p).and_then(|a| a.limits.get(r)).is_some_and(|l| l.guarantee.is_some())
            });
            if !inner {
                out.add(&Resources::new().with(r.clone(), g));
            }
        }
    }
    out
}

#[derive(Debug, Clone)]
enum Hist {
    Ask { tenant: usize, r: Resources },
    Release { nth: usize },
}

fn arb_hist() -> impl Strategy<Value = Vec<Hist>> {
    prop::collection::vec(
        prop_oneof![
            4 => (0..TENANTS.len(), arb_amounts()).prop_map(|(tenant, r)| Hist::Ask { tenant, r }),
            1 => any::<usize>().prop_map(|nth| Hist::Release { nth }),
        ],
        1..80,
    )
}

/// Replays `hist` against `fleet`, then `fill` (tenants asking `unit` each in turn until
/// none is admitted): what runs, each admitted as `admit` said.
fn replay_filled(
    tree: &QuotaTree,
    fleet: &Resources,
    hist: &[Hist],
    fill: &[usize],
    unit: &Resources,
) -> (Vec<Running>, Usage) {
    let mut hist = hist.to_vec();
    if !fill.is_empty() {
        for _ in 0..24 {
            hist.extend(fill.iter().map(|&tenant| Hist::Ask { tenant, r: unit.clone() }));
        }
    }
    replay(tree, fleet, &hist)
}

/// Replays `hist` against `fleet`: what runs, each admitted as `admit` said.
fn replay(tree: &QuotaTree, fleet: &Resources, hist: &[Hist]) -> (Vec<Running>, Usage) {
    let mut usage = Usage::new();
    let mut held: Vec<Running> = Vec::new();
    for (i, h) in hist.iter().enumerate() {
        match h {
            Hist::Ask { tenant, r } => {
                let tenant = TENANTS[*tenant];
                if r.is_empty() {
                    continue;
                }
                if let Decision::Admit { class, .. } = admit(tree, fleet, &usage, tenant, r) {
                    usage.add(tenant, class, r);
                    held.push(Running {
                        id: format!("c{i:03}"),
                        tenant: tenant.into(),
                        resources: r.clone(),
                        class,
                        started_ms: i as u64 * 1000,
                        gang: None,
                        checkpoints: false,
                    });
                }
            }
            Hist::Release { nth } => {
                if !held.is_empty() {
                    let r = held.remove(nth % held.len());
                    usage.release(&r.tenant, r.class, &r.resources);
                }
            }
        }
    }
    (held, usage)
}

fn red_fleet() -> Resources {
    Resources::new()
        .with_gpus(H100, 4)
        .with(Resource::Cpu, 8 * MILLI_PER_CORE)
        .with(Resource::Memory, 16 * MIB_PER_GIB)
}

/// A claim replayed on `hist`: where `admit` answers it `Reclaim` and it is owed, no victim
/// chosen for it is within its tenant's guarantees by what the tenant uses, with the
/// victims before it gone and the claim granted: it would be owed its work back at once.
fn check_no_victim_owed_back(
    tree: &QuotaTree,
    fleet: &Resources,
    hist: &[Hist],
    claimant: &str,
    req: &Resources,
) -> Result<(), TestCaseError> {
    let (running, usage) = replay(tree, fleet, hist);
    if req.is_empty() {
        return Ok(());
    }
    let Decision::Reclaim { short, under } = admit(tree, fleet, &usage, claimant, req) else {
        return Ok(());
    };
    if !owed(tree, &usage, claimant, req, &Resources::new()) {
        return Ok(());
    }
    let running: Vec<Running> = running
        .into_iter()
        .filter(|r| under.as_ref().is_none_or(|p| is_within(&r.tenant, p)))
        .collect();
    let Ok(v) = choose_victims(&running, &usage, tree, fleet, claimant, req, &short, 1_000_000)
    else {
        return Ok(());
    };
    let mut after = usage.clone();
    after.add(claimant, Class::Guaranteed, req);
    for c in &v.chosen {
        let mut without = after.clone();
        without.release(&c.candidate.tenant, Class::Guaranteed, &c.candidate.guaranteed);
        without.release(
            &c.candidate.tenant,
            Class::Borrowed,
            &c.candidate.resources.minus(&c.candidate.guaranteed),
        );
        prop_assert!(
            !owed(
                tree,
                &total_view(&without),
                &c.candidate.tenant,
                &c.candidate.resources,
                &Resources::new()
            ),
            "{:?} of {} ({}) taken for {} asking {} (short {}) though within its guarantees \
             by use; victims {:?}; running {:#?}",
            c.candidate.ids,
            c.candidate.tenant,
            c.candidate.resources,
            claimant,
            req,
            short,
            v.chosen.iter().map(|c| c.candidate.ids.clone()).collect::<Vec<_>>(),
            running
        );
        after = without;
    }
    Ok(())
}

/// A claim replayed on `hist` then `fill`: where `admit` answers it `Reclaim`, it is owed
/// by what its tenant uses as well as by class (its own borrowed work is never its victim)
/// for resources its chain guarantees, and the outermost guarantees fit in the fleet,
/// victims are found.
fn check_owed_finds_victims(
    tree: &QuotaTree,
    fleet: &Resources,
    (hist, fill): (&[Hist], &[usize]),
    claimant: &str,
    req: &Resources,
) -> Result<(), TestCaseError> {
    if !top_guarantees(tree).fits_in(fleet) || req.is_empty() {
        return Ok(());
    }
    let (running, usage) = replay_filled(tree, fleet, hist, fill, req);
    let Decision::Reclaim { short, under } = admit(tree, fleet, &usage, claimant, req) else {
        return Ok(());
    };
    if !owed(tree, &usage, claimant, req, &Resources::new()) {
        return Ok(());
    }
    // Owed by what it uses too: where its own borrowed work holds its guarantee, that work
    // is what keeps it waiting (none of it is ever its victim).
    if !owed(tree, &total_view(&usage), claimant, req, &Resources::new()) {
        return Ok(());
    }
    // Only what its chain guarantees (a resource no quota on its chain bounds is admitted
    // guaranteed only where no quota guarantees it: nobody owes it that).
    let guaranteed = |r: &Resource| {
        tree.chain(claimant).any(|q| q.limits.get(r).is_some_and(|l| l.guarantee.is_some()))
    };
    if req.iter().any(|(r, _)| !guaranteed(r)) {
        return Ok(());
    }
    // Known and left: a ceiling crossed at a path that guarantees none of what is short
    // (guarantees need not fit under it: work within them may fill it).
    let ceiling_only = under.as_ref().is_some_and(|p| {
        short.iter().any(|(s, _)| {
            tree.get(p).and_then(|q| q.limits.get(s)).is_none_or(|l| l.guarantee.is_none())
        })
    });
    if ceiling_only {
        return Ok(());
    }
    let running: Vec<Running> = running
        .into_iter()
        .filter(|r| under.as_ref().is_none_or(|p| is_within(&r.tenant, p)))
        .collect();
    let got = choose_victims(&running, &usage, tree, fleet, claimant, req, &short, 1_000_000);
    prop_assert!(
        got.is_ok(),
        "{} asking {} (short {}, under {:?}) finds no victims: {:?}; running {:#?}; tree {:#?}",
        claimant,
        req,
        short,
        under,
        got,
        running,
        tree
    );
    Ok(())
}

/// Cases of the red team's generated claims: 256, or `QUOTA_RED_TEAM_CASES` (the red team
/// of b211bf2 ran 100,000 of each).
fn red_cases() -> u32 {
    std::env::var("QUOTA_RED_TEAM_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(256)
}

fn arb_gpu_hist() -> impl Strategy<Value = Vec<Hist>> {
    prop::collection::vec(
        prop_oneof![
            4 => (0..TENANTS.len(), 1u64..=3)
                .prop_map(|(tenant, n)| Hist::Ask { tenant, r: Resources::new().with_gpus(H100, n) }),
            1 => any::<usize>().prop_map(|nth| Hist::Release { nth }),
        ],
        1..60,
    )
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: red_cases(),
        max_local_rejects: u32::MAX,
        ..ProptestConfig::default()
    })]

    /// Red team of b211bf2: no victim is owed back at once ([`check_no_victim_owed_back`]),
    /// every resource and limit.
    #[test]
    fn no_victim_is_owed_back_at_once_by_what_its_tenant_uses(
        tree in arb_tree_every_resource(),
        hist in arb_hist(),
        claimant in 0..TENANTS.len(),
        req in arb_amounts(),
    ) {
        check_no_victim_owed_back(&tree, &red_fleet(), &hist, TENANTS[claimant], &req)?;
    }

    /// Red team of b211bf2: an owed claimant finds victims where the guarantees fit
    /// ([`check_owed_finds_victims`]), every resource and limit.
    #[test]
    fn a_claimant_owed_by_what_it_uses_finds_victims_where_the_guarantees_fit(
        tree in arb_tree_every_resource(),
        hist in arb_hist(),
        fill in prop::collection::vec(0..TENANTS.len(), 0..6),
        claimant in 0..TENANTS.len(),
        req in arb_amounts(),
    ) {
        check_owed_finds_victims(&tree, &red_fleet(), (&hist, &fill), TENANTS[claimant], &req)?;
    }

    /// [`no_victim_is_owed_back_at_once_by_what_its_tenant_uses`] in whole GPUs, a fleet
    /// of 6 that the history fills.
    #[test]
    fn no_victim_is_owed_back_at_once_whole_gpus_and_lending_limits(
        tree in arb_tree_lending(PATHS, 1, 6, true),
        hist in arb_gpu_hist(),
        claimant in 0..TENANTS.len(),
        n in 1u64..=3,
    ) {
        let fleet = Resources::new().with_gpus(H100, 6);
        let req = Resources::new().with_gpus(H100, n);
        check_no_victim_owed_back(&tree, &fleet, &hist, TENANTS[claimant], &req)?;
    }

    /// [`a_claimant_owed_by_what_it_uses_finds_victims_where_the_guarantees_fit`] in whole
    /// GPUs, a fleet of 6 that the history fills.
    #[test]
    fn a_claimant_owed_finds_victims_whole_gpus_and_lending_limits(
        tree in arb_tree_lending(PATHS, 1, 6, true),
        hist in arb_gpu_hist(),
        fill in prop::collection::vec(0..TENANTS.len(), 0..6),
        claimant in 0..TENANTS.len(),
        n in 1u64..=3,
    ) {
        let fleet = Resources::new().with_gpus(H100, 6);
        let req = Resources::new().with_gpus(H100, n);
        check_owed_finds_victims(&tree, &fleet, (&hist, &fill), TENANTS[claimant], &req)?;
    }
}
