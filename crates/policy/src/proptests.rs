//! Property tests: random tenant trees, tiers and node pools against a small model of
//! the decisions, the untrusted-isolation invariant, and parsing arbitrary bytes.

use std::collections::BTreeMap;

use proptest::prelude::*;
use serde_json::{json, Map, Value};

use super::*;

/// Sibling names chosen so that some are string prefixes of others (`a`, `ab`, `abc`):
/// node-pool restrictions must compare whole path segments.
const NAMES: [&str; 4] = ["a", "a-b", "ab", "abc"];
const NODES: [&str; 6] = ["n-1", "n-2", "n-10", "m-1", "x", ""];
const PATTERNS: [&str; 5] = ["n-*", "n-1", "m-1", "*", "n-1*"];

#[derive(Debug, Clone)]
struct GenProject {
    trust: Option<Trust>,
    users: usize,
}

#[derive(Debug, Clone)]
struct GenTeam {
    trust: Option<Trust>,
    projects: Vec<GenProject>,
}

#[derive(Debug, Clone)]
struct GenOrg {
    trust: Trust,
    teams: Vec<GenTeam>,
}

#[derive(Debug, Clone)]
struct GenPool {
    patterns: Vec<usize>,
    /// Indices into the list of tenants, reduced modulo its length.
    tenants: Option<Vec<usize>>,
}

#[derive(Debug, Clone)]
struct GenPolicy {
    orgs: Vec<GenOrg>,
    tiers: [Vec<Isolation>; 3],
    pools: Vec<GenPool>,
}

fn trust() -> impl Strategy<Value = Trust> {
    prop_oneof![Just(Trust::Untrusted), Just(Trust::Trusted), Just(Trust::Dev)]
}

/// A non-empty subset of `kinds`, in a shuffled order.
fn allow_list(kinds: &'static [Isolation]) -> impl Strategy<Value = Vec<Isolation>> {
    proptest::sample::subsequence(kinds, 1..=kinds.len()).prop_shuffle()
}

fn gen_policy() -> impl Strategy<Value = GenPolicy> {
    let project = (proptest::option::of(trust()), 0..=3usize)
        .prop_map(|(trust, users)| GenProject { trust, users });
    let team = (proptest::option::of(trust()), proptest::collection::vec(project, 0..=3))
        .prop_map(|(trust, projects)| GenTeam { trust, projects });
    let org = (trust(), proptest::collection::vec(team, 0..=3))
        .prop_map(|(trust, teams)| GenOrg { trust, teams });
    let pool = (
        proptest::sample::subsequence(vec![0usize, 1, 2, 3, 4], 1..=3),
        proptest::option::of(proptest::collection::vec(any::<usize>(), 0..=3)),
    )
        .prop_map(|(patterns, tenants)| GenPool { patterns, tenants });
    (
        proptest::collection::vec(org, 1..=3),
        allow_list(&[Isolation::Gpu, Isolation::Mig]),
        allow_list(&Isolation::ALL),
        allow_list(&Isolation::ALL),
        proptest::collection::vec(pool, 0..=3),
    )
        .prop_map(|(orgs, u, t, d, pools)| GenPolicy { orgs, tiers: [u, t, d], pools })
}

fn isolation_names(list: &[Isolation]) -> Value {
    Value::Array(list.iter().map(|i| json!(i.as_str())).collect())
}

/// Every tenant path with the trust the model expects, depth-first.
fn model_tenants(g: &GenPolicy) -> Vec<(String, Trust)> {
    let mut out = Vec::new();
    for (o, org) in g.orgs.iter().enumerate() {
        let op = NAMES[o].to_string();
        out.push((op.clone(), org.trust));
        for (t, team) in org.teams.iter().enumerate() {
            let tp = format!("{op}/{}", NAMES[t]);
            let tt = team.trust.unwrap_or(org.trust);
            out.push((tp.clone(), tt));
            for (p, project) in team.projects.iter().enumerate() {
                let pp = format!("{tp}/{}", NAMES[p]);
                let pt = project.trust.unwrap_or(tt);
                out.push((pp.clone(), pt));
                for user in &NAMES[..project.users] {
                    out.push((format!("{pp}/{user}"), pt));
                }
            }
        }
    }
    out
}

fn pool_tenants(g: &GenPolicy, pool: &GenPool) -> Option<Vec<String>> {
    let all = model_tenants(g);
    pool.tenants.as_ref().map(|idx| {
        let mut list: Vec<String> = Vec::new();
        for i in idx {
            let path = all[i % all.len()].0.clone();
            if !list.contains(&path) {
                list.push(path);
            }
        }
        list
    })
}

fn to_json(g: &GenPolicy) -> Value {
    let mut orgs = Map::new();
    for (o, org) in g.orgs.iter().enumerate() {
        let mut teams = Map::new();
        for (t, team) in org.teams.iter().enumerate() {
            let mut projects = Map::new();
            for (p, project) in team.projects.iter().enumerate() {
                let mut pj = json!({"users": NAMES[..project.users]});
                if let Some(trust) = project.trust {
                    pj["trust"] = json!(trust);
                }
                projects.insert(NAMES[p].to_string(), pj);
            }
            let mut tj = json!({"projects": projects});
            if let Some(trust) = team.trust {
                tj["trust"] = json!(trust);
            }
            teams.insert(NAMES[t].to_string(), tj);
        }
        orgs.insert(NAMES[o].to_string(), json!({"trust": org.trust, "teams": teams}));
    }
    let mut pools = Map::new();
    for (i, pool) in g.pools.iter().enumerate() {
        let nodes: Vec<&str> = pool.patterns.iter().map(|&p| PATTERNS[p]).collect();
        let mut pj = json!({"nodes": nodes});
        if let Some(list) = pool_tenants(g, pool) {
            pj["tenants"] = json!(list);
        }
        pools.insert(format!("pool{i}"), pj);
    }
    json!({
        "version": 1,
        "tiers": {
            "untrusted": {"allow": isolation_names(&g.tiers[0])},
            "trusted": {"allow": isolation_names(&g.tiers[1])},
            "dev": {"allow": isolation_names(&g.tiers[2])}
        },
        "orgs": orgs,
        "node_pools": pools
    })
}

fn model_pattern_matches(pattern: &str, node: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => node.starts_with(prefix),
        None => node == pattern,
    }
}

fn model_is_under(prefix: &str, path: &str) -> bool {
    let p: Vec<&str> = prefix.split('/').collect();
    let t: Vec<&str> = path.split('/').collect();
    p.len() <= t.len() && p.iter().zip(&t).all(|(a, b)| a == b)
}

fn model_authorize(g: &GenPolicy, path: &str, trust: Trust, iso: Isolation, node: &str) -> bool {
    let tier = match trust {
        Trust::Untrusted => &g.tiers[0],
        Trust::Trusted => &g.tiers[1],
        Trust::Dev => &g.tiers[2],
    };
    if !tier.contains(&iso) {
        return false;
    }
    g.pools.iter().all(|pool| {
        let in_pool = pool.patterns.iter().any(|&p| model_pattern_matches(PATTERNS[p], node));
        match pool_tenants(g, pool) {
            Some(list) if in_pool => list.iter().any(|prefix| model_is_under(prefix, path)),
            _ => true,
        }
    })
}

fn request_of(iso: Isolation, n: u8) -> GpuRequest {
    match iso {
        Isolation::Gpu => GpuRequest::Gpu { count: u32::from(n % 8) + 1 },
        Isolation::Mig => GpuRequest::Mig { profile: format!("{}g.{}gb", n % 7 + 1, n % 80 + 1) },
        Isolation::Mps => GpuRequest::Mps { percent: n % 100 + 1 },
        Isolation::Shared => GpuRequest::Shared,
    }
}

/// A JSON value built from the policy's own vocabulary, so that random documents get
/// deep into the schema before failing.
fn policy_like() -> impl Strategy<Value = Value> {
    let words = proptest::sample::select(vec![
        "version",
        "tiers",
        "untrusted",
        "trusted",
        "dev",
        "allow",
        "orgs",
        "trust",
        "teams",
        "projects",
        "users",
        "identity",
        "annotation",
        "map",
        "default_tenant",
        "node_pools",
        "nodes",
        "tenants",
        "gpu",
        "mig",
        "mps",
        "shared",
        "acme",
        "acme/x",
        "a*",
        "*",
        "",
        "X",
    ]);
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        (-2i64..5).prop_map(Value::from),
        words.clone().prop_map(Value::from),
    ];
    leaf.prop_recursive(5, 64, 6, move |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::vec((words.clone(), inner), 0..5).prop_map(|kv| Value::Object(
                kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
            )),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn decisions_match_the_model_and_untrusted_never_shares(g in gen_policy(), n in any::<u8>()) {
        let policy = parse_ok(&to_json(&g))?;
        let model = model_tenants(&g);
        let got: Vec<(String, Trust)> =
            policy.tenants().into_iter().map(|t| (t.path.into_string(), t.trust)).collect();
        // The generator's names are in sorted order, so depth-first order matches.
        prop_assert_eq!(&got, &model);
        for tenant in policy.tenants() {
            for iso in Isolation::ALL {
                let request = request_of(iso, n);
                for node in NODES {
                    let decision = policy.authorize(&tenant, &request, node);
                    if tenant.trust == Trust::Untrusted && matches!(iso, Isolation::Mps | Isolation::Shared) {
                        prop_assert!(decision.is_err(), "untrusted {} got {}", tenant.path, request);
                    }
                    let want = model_authorize(&g, &tenant.path, tenant.trust, iso, node);
                    prop_assert_eq!(decision.is_ok(), want, "{} {} on {:?}: {:?}", tenant.path, request, node, decision);
                    if let Err(r) = decision {
                        prop_assert!(r.message.contains(tenant.path.as_str()));
                        let shown_trust = format!("(trust {})", tenant.trust);
                        prop_assert!(r.message.contains(&shown_trust), "{}", r.message);
                        prop_assert!(r.message.contains(&request.to_string()));
                        prop_assert!(r.message.contains(&r.rule));
                    }
                }
            }
        }
    }

    #[test]
    fn claimed_trust_never_widens_a_grant(g in gen_policy(), claimed in trust(), n in any::<u8>()) {
        let policy = parse_ok(&to_json(&g))?;
        for tenant in policy.tenants() {
            let forged = Tenant { path: tenant.path.clone(), trust: claimed };
            for iso in Isolation::ALL {
                let request = request_of(iso, n);
                prop_assert_eq!(
                    policy.authorize(&forged, &request, "n-1").is_ok(),
                    policy.authorize(&tenant, &request, "n-1").is_ok()
                );
            }
        }
    }

    #[test]
    fn untrusted_tiers_with_mps_or_shared_never_parse(
        g in gen_policy(),
        allow in allow_list(&Isolation::ALL),
    ) {
        prop_assume!(allow.iter().any(|i| matches!(i, Isolation::Mps | Isolation::Shared)));
        let mut v = to_json(&g);
        v["tiers"]["untrusted"]["allow"] = isolation_names(&allow);
        let bytes = serde_json::to_vec(&v).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let err = Policy::parse(&bytes, "p.json").err();
        let first = allow.iter().position(|i| matches!(i, Isolation::Mps | Isolation::Shared)).unwrap_or(0);
        let want = format!("tiers.untrusted.allow[{first}]");
        prop_assert!(matches!(&err, Some(PolicyError::Invalid { path, .. }) if *path == want), "{:?}", err);
    }

    #[test]
    fn identity_reads_only_the_rule_annotations(
        extra in proptest::collection::btree_map("[a-z./-]{0,12}", ".{0,8}", 0..6),
        ns in proptest::option::of(prop_oneof![Just("team-a"), Just("team-b"), Just("other")]),
    ) {
        let policy = parse_ok(&json!({
            "version": 1,
            "orgs": {"acme": {"trust": "untrusted", "teams": {"a": {}, "b": {"trust": "dev"}}}},
            "identity": [{"annotation": "ns", "map": {"team-a": "acme/a", "team-b": "acme/b"}}],
        }))?;
        let mut only_rule = BTreeMap::new();
        if let Some(ns) = ns {
            only_rule.insert("ns".to_string(), ns.to_string());
        }
        let mut all = extra.clone();
        all.remove("ns");
        all.extend(only_rule.clone());
        prop_assert_eq!(policy.resolve_identity(&all), policy.resolve_identity(&only_rule));
    }

    #[test]
    fn parse_never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = Policy::parse(&bytes, "fuzz.json");
    }

    #[test]
    fn parse_never_panics_on_mutated_policies(
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6),
    ) {
        let mut bytes = include_bytes!("../../../examples/policy.json").to_vec();
        for (at, byte) in edits {
            let i = at % bytes.len();
            bytes[i] = byte;
        }
        let _ = Policy::parse(&bytes, "fuzz.json");
    }

    #[test]
    fn parse_never_panics_on_policy_shaped_json(v in policy_like()) {
        let bytes = serde_json::to_vec(&v).map_err(|e| TestCaseError::fail(e.to_string()))?;
        if let Err(e) = Policy::parse(&bytes, "fuzz.json") {
            prop_assert!(!e.to_string().is_empty());
        }
    }
}

fn parse_ok(v: &Value) -> Result<Policy, TestCaseError> {
    let bytes = serde_json::to_vec(v).map_err(|e| TestCaseError::fail(e.to_string()))?;
    Policy::parse(&bytes, "gen.json").map_err(|e| TestCaseError::fail(format!("{e}\n{v:#}")))
}
