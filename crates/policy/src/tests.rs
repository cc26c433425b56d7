use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::*;
use crate::decide::is_path_prefix;

const NS: &str = "io.kubernetes.cri.sandbox-namespace";

/// A valid policy exercising every section, as a JSON value to mutate.
fn base() -> Value {
    json!({
        "version": 3,
        "orgs": {
            "acme": {
                "trust": "trusted",
                "teams": {
                    "research": {
                        "trust": "untrusted",
                        "projects": {
                            "sandbox": {"users": ["guest", "alice"]},
                            "vetted": {"trust": "trusted", "users": ["carol"]}
                        }
                    },
                    "platform": {
                        "projects": {"notebooks": {"trust": "dev", "users": ["bob"]}}
                    }
                }
            },
            "globex": {"trust": "untrusted"}
        },
        "identity": [
            {"annotation": NS, "map": {
                "team-untrusted": "acme/research/sandbox/guest",
                "team-trusted": "acme/platform",
                "team-dev": "acme/platform/notebooks/bob"
            }}
        ],
        "node_pools": {
            "h100": {"nodes": ["sim-h100-*", "gpu-node-7"], "tenants": ["acme/research", "globex"]}
        }
    })
}

fn parse_value(v: &Value) -> Result<Policy, PolicyError> {
    let bytes = serde_json::to_vec_pretty(v).expect("serialize");
    Policy::parse(&bytes, "policy.json")
}

fn ok(v: &Value) -> Policy {
    parse_value(v).unwrap_or_else(|e| panic!("expected a valid policy, got: {e}"))
}

fn base_with(edit: impl FnOnce(&mut Value)) -> Value {
    let mut v = base();
    edit(&mut v);
    v
}

/// Parse, expect a failure, and check its variant, path and message.
#[track_caller]
fn expect_err(v: &Value, kind: &str, path: &str, message_part: &str) -> PolicyError {
    let err = parse_value(v).expect_err("expected an error");
    let actual_kind = match &err {
        PolicyError::Syntax { .. } => "syntax",
        PolicyError::Schema { .. } => "schema",
        PolicyError::Invalid { .. } => "invalid",
        PolicyError::Io { .. } => "io",
    };
    assert_eq!(actual_kind, kind, "{err}");
    assert_eq!(err.json_path(), Some(path), "{err}");
    assert!(err.message().contains(message_part), "{:?} not in: {err}", message_part);
    let shown = err.to_string();
    assert!(shown.starts_with("policy.json: "), "{shown}");
    assert!(shown.contains(path), "{shown}");
    err
}

fn remove(v: &mut Value, key: &str) {
    if let Some(o) = v.as_object_mut() {
        o.remove(key);
    }
}

fn annotations(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn gpu() -> GpuRequest {
    GpuRequest::Gpu { count: 1 }
}
fn mig() -> GpuRequest {
    GpuRequest::Mig { profile: "1g.10gb".into() }
}
fn mps() -> GpuRequest {
    GpuRequest::Mps { percent: 25 }
}

fn request_of(iso: Isolation) -> GpuRequest {
    match iso {
        Isolation::Gpu => gpu(),
        Isolation::Mig => mig(),
        Isolation::Mps => mps(),
        Isolation::Shared => GpuRequest::Shared,
    }
}

// ---------------------------------------------------------------- the example policy

#[test]
fn example_policy_parses_and_decides() {
    let bytes = include_bytes!("../../../examples/policy.json");
    let p = Policy::parse(bytes, "examples/policy.json").expect("example policy");
    assert_eq!(p.version(), 1);
    let paths: Vec<String> = p.tenants().into_iter().map(|t| t.path.into_string()).collect();
    assert_eq!(
        paths,
        [
            "acme",
            "acme/dev",
            "acme/dev/notebooks",
            "acme/dev/notebooks/bob",
            "acme/dev/scratch",
            "acme/dev/scratch/dave",
            "acme/trusted",
            "acme/trusted/training",
            "acme/trusted/training/alice",
            "acme/trusted/training/carol",
            "acme/untrusted",
            "acme/untrusted/sandbox",
            "acme/untrusted/sandbox/guest",
        ]
    );
    assert_eq!(p.identity_annotations(), [NS]);
    // Docker and podman runs (no identity annotation) land on the guest, as shipped.
    assert_eq!(p.default_tenant(), Some("acme/untrusted/sandbox/guest"));
    let who = |ns: &str| p.resolve_identity(&annotations(&[(NS, ns)])).expect("identity");
    let guest = who("team-untrusted");
    let alice = who("team-trusted");
    let bob = who("team-dev");
    assert_eq!(
        guest,
        Tenant {
            path: "acme/untrusted/sandbox/guest".parse().expect("tenant path"),
            trust: Trust::Untrusted
        }
    );
    assert_eq!(
        alice,
        Tenant {
            path: "acme/trusted/training/alice".parse().expect("tenant path"),
            trust: Trust::Trusted
        }
    );
    assert_eq!(
        bob,
        Tenant { path: "acme/dev/notebooks/bob".parse().expect("tenant path"), trust: Trust::Dev }
    );
    assert_eq!(who("team-research").path, "acme/trusted/training/carol");
    assert_eq!(p.sharing_domain(&bob.path), "notebooks");
    assert_eq!(p.sharing_domain(&who("team-scratch").path), "tenant:acme/dev/scratch/dave");
    assert_eq!(p.mps_max_percent(), 75);
    for node in ["sim-h100-0", "sim-h100", "elsewhere"] {
        let allowed = |t: &Tenant, r: &GpuRequest| p.authorize(t, r, node).is_ok();
        assert!(allowed(&guest, &gpu()) && allowed(&guest, &mig()));
        assert!(!allowed(&guest, &mps()) && !allowed(&guest, &GpuRequest::Shared));
        assert!(allowed(&alice, &mps()) && !allowed(&alice, &GpuRequest::Shared));
        assert!(allowed(&bob, &GpuRequest::Shared));
    }
    assert!(matches!(
        p.resolve_identity(&annotations(&[(NS, "kube-system")])),
        Err(IdentityError::Unmapped { .. })
    ));
}

// ---------------------------------------------------------------- basics

#[test]
fn minimal_policy_gets_default_tiers() {
    let p = ok(&json!({"version": 1, "orgs": {"solo": {"trust": "dev"}}}));
    assert_eq!(p.allowed(Trust::Untrusted), [Isolation::Gpu, Isolation::Mig]);
    assert_eq!(p.allowed(Trust::Trusted), [Isolation::Gpu, Isolation::Mig, Isolation::Mps]);
    assert_eq!(p.allowed(Trust::Dev), Isolation::ALL);
    assert_eq!(
        p.tenants(),
        [Tenant { path: "solo".parse().expect("tenant path"), trust: Trust::Dev }]
    );
    assert!(p.identity_annotations().is_empty());
}

#[test]
fn partial_tiers_keep_the_other_defaults() {
    let p = ok(&base_with(|v| v["tiers"] = json!({"trusted": {"allow": ["mig"]}})));
    assert_eq!(p.allowed(Trust::Trusted), [Isolation::Mig]);
    assert_eq!(p.allowed(Trust::Untrusted), [Isolation::Gpu, Isolation::Mig]);
    assert_eq!(p.allowed(Trust::Dev), Isolation::ALL);
}

#[test]
fn digest_is_sha256_of_the_exact_bytes() {
    let a = br#"{"version": 1, "orgs": {"x": {"trust": "dev"}}}"#;
    let b = br#"{"version": 1,  "orgs": {"x": {"trust": "dev"}}}"#;
    let pa = Policy::parse(a, "a").expect("a");
    let pb = Policy::parse(b, "b").expect("b");
    assert_eq!(pa.digest(), hex::encode(Sha256::digest(a)));
    assert_eq!(pa.digest().len(), 64);
    assert_ne!(pa.digest(), pb.digest());
}

#[test]
fn trust_names_and_order() {
    assert_eq!(Trust::Untrusted.to_string(), "untrusted");
    assert_eq!(Trust::Trusted.to_string(), "trusted");
    assert_eq!(Trust::Dev.to_string(), "dev");
    assert!(Trust::Untrusted < Trust::Trusted && Trust::Trusted < Trust::Dev);
    for t in Trust::ALL {
        let s = serde_json::to_string(&t).expect("ser");
        assert_eq!(s, format!("\"{t}\""));
        assert_eq!(serde_json::from_str::<Trust>(&s).expect("de"), t);
    }
    let e = serde_json::from_str::<Trust>("\"Dev\"").unwrap_err().to_string();
    assert!(
        e.contains("unknown variant `Dev`, expected one of `untrusted`, `trusted`, `dev`"),
        "{e}"
    );
    let t = serde_json::to_value(Tenant {
        path: "a/b".parse().expect("tenant path"),
        trust: Trust::Dev,
    })
    .expect("ser");
    assert_eq!(t, json!({"path": "a/b", "trust": "dev"}));
}

#[test]
fn load_reads_files_and_names_them_in_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let good = dir.path().join("policy.json");
    std::fs::write(&good, serde_json::to_vec(&base()).expect("ser")).expect("write");
    assert_eq!(Policy::load(&good).expect("load").version(), 3);

    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, br#"{"version": 1, "orgs": {"a": {"trust": "trustd"}}}"#).expect("write");
    let e = Policy::load(&bad).unwrap_err().to_string();
    assert!(e.starts_with(&format!("{}: orgs.a.trust: unknown variant", bad.display())), "{e}");

    let missing = dir.path().join("missing.json");
    let e = Policy::load(&missing).unwrap_err();
    assert!(matches!(e, PolicyError::Io { .. }), "{e}");
    assert_eq!(e.json_path(), None);
    assert!(
        e.to_string().starts_with(&format!("{}: cannot read policy", missing.display())),
        "{e}"
    );
}

// ---------------------------------------------------------------- tenant tree

#[test]
fn trust_is_inherited_down_the_tree() {
    let p = ok(&base());
    let trust = |path: &str| p.tenant(path).map(|t| t.trust);
    assert_eq!(trust("acme"), Some(Trust::Trusted));
    assert_eq!(trust("acme/research"), Some(Trust::Untrusted)); // own
    assert_eq!(trust("acme/research/sandbox"), Some(Trust::Untrusted)); // from team
    assert_eq!(trust("acme/research/sandbox/guest"), Some(Trust::Untrusted)); // from project
    assert_eq!(trust("acme/research/vetted"), Some(Trust::Trusted)); // raised again
    assert_eq!(trust("acme/research/vetted/carol"), Some(Trust::Trusted));
    assert_eq!(trust("acme/platform"), Some(Trust::Trusted)); // from org
    assert_eq!(trust("acme/platform/notebooks/bob"), Some(Trust::Dev));
    assert_eq!(trust("globex"), Some(Trust::Untrusted));
}

#[test]
fn tenants_are_depth_first_and_sorted() {
    let p = ok(&base());
    let paths: Vec<String> = p.tenants().into_iter().map(|t| t.path.into_string()).collect();
    assert_eq!(
        paths,
        [
            "acme",
            "acme/platform",
            "acme/platform/notebooks",
            "acme/platform/notebooks/bob",
            "acme/research",
            "acme/research/sandbox",
            "acme/research/sandbox/alice",
            "acme/research/sandbox/guest",
            "acme/research/vetted",
            "acme/research/vetted/carol",
            "globex",
        ]
    );
    for t in p.tenants() {
        assert_eq!(p.tenant(&t.path), Some(t));
    }
    for missing in ["", "acme/", "/acme", "acme/research/sandbox/bob", "acme//research", "ACME"] {
        assert_eq!(p.tenant(missing), None, "{missing}");
    }
}

// ---------------------------------------------------------------- structural errors

#[test]
fn unknown_fields_are_errors_at_every_depth() {
    let cases: Vec<(Value, &str, &str)> = vec![
        (base_with(|v| v["versoin"] = json!(1)), "versoin", "unknown field `versoin`"),
        (
            base_with(|v| v["tiers"] = json!({"trusted": {"allow": ["gpu"], "deny": []}})),
            "tiers.trusted.deny",
            "unknown field `deny`, expected `allow`",
        ),
        (
            base_with(|v| v["tiers"] = json!({"superuser": {"allow": ["gpu"]}})),
            "tiers.superuser",
            "unknown field `superuser`",
        ),
        (
            base_with(|v| v["orgs"]["acme"]["quota"] = json!(3)),
            "orgs.acme.quota",
            "unknown field `quota`, expected `trust` or `teams`",
        ),
        (
            base_with(|v| v["orgs"]["acme"]["teams"]["research"]["colour"] = json!("red")),
            "orgs.acme.teams.research.colour",
            "unknown field `colour`, expected `trust` or `projects`",
        ),
        (
            base_with(|v| {
                v["orgs"]["acme"]["teams"]["research"]["projects"]["sandbox"]["user"] = json!([])
            }),
            "orgs.acme.teams.research.projects.sandbox.user",
            "unknown field `user`, expected `trust` or `users`",
        ),
        (
            base_with(|v| v["identity"][0]["env"] = json!("TENANT")),
            "identity[0].env",
            "unknown field `env`, expected one of `annotation`, `map`, `engines`",
        ),
        (
            base_with(|v| v["node_pools"]["h100"]["tenant"] = json!([])),
            "node_pools.h100.tenant",
            "unknown field `tenant`, expected one of `nodes`, `tenants`, `mig_layouts`",
        ),
    ];
    for (v, path, msg) in cases {
        expect_err(&v, "schema", path, msg);
    }
}

#[test]
fn wrong_types_are_errors_with_paths() {
    expect_err(
        &base_with(|v| v["version"] = json!("3")),
        "schema",
        "version",
        "invalid type: string \"3\", expected u64",
    );
    expect_err(
        &base_with(|v| v["version"] = json!(-1)),
        "schema",
        "version",
        "invalid value: integer `-1`, expected u64",
    );
    expect_err(
        &base_with(|v| v["version"] = json!(1.5)),
        "schema",
        "version",
        "invalid type: floating point",
    );
    expect_err(&base_with(|v| v["orgs"] = json!([])), "schema", "orgs", "expected an object");
    expect_err(
        &base_with(|v| v["orgs"]["acme"] = json!(["trusted"])),
        "schema",
        "orgs.acme",
        "invalid type: sequence, expected an object",
    );
    expect_err(
        &base_with(|v| {
            v["orgs"]["acme"]["teams"]["research"]["projects"]["sandbox"]["users"] = json!("guest")
        }),
        "schema",
        "orgs.acme.teams.research.projects.sandbox.users",
        "invalid type: string \"guest\", expected a sequence",
    );
    expect_err(
        &base_with(|v| {
            v["orgs"]["acme"]["teams"]["research"]["projects"]["sandbox"]["users"][1] = json!(7)
        }),
        "schema",
        "orgs.acme.teams.research.projects.sandbox.users[1]",
        "invalid type: integer `7`, expected a string",
    );
    expect_err(
        &base_with(|v| v["identity"] = json!({})),
        "schema",
        "identity",
        "expected a sequence",
    );
    expect_err(
        &base_with(|v| v["identity"][0]["map"]["team-dev"] = json!(["acme"])),
        "schema",
        "identity[0].map.team-dev",
        "expected a string",
    );
    expect_err(
        &base_with(|v| v["default_tenant"] = json!(1)),
        "schema",
        "default_tenant",
        "expected a string",
    );
    expect_err(
        &base_with(|v| v["node_pools"]["h100"]["nodes"] = json!("sim-*")),
        "schema",
        "node_pools.h100.nodes",
        "expected a sequence",
    );
    expect_err(&json!([]), "schema", "", "invalid type: sequence, expected an object");
    expect_err(&json!("policy"), "schema", "", "expected an object");
}

#[test]
fn missing_required_fields() {
    let e =
        expect_err(&base_with(|v| remove(v, "version")), "schema", "", "missing field `version`");
    assert!(e.to_string().starts_with("policy.json: (top level): missing field `version`"), "{e}");
    expect_err(&base_with(|v| remove(v, "orgs")), "schema", "", "missing field `orgs`");
    expect_err(
        &base_with(|v| v["identity"][0] = json!({"annotation": NS})),
        "schema",
        "identity[0]",
        "missing field `map`",
    );
    expect_err(
        &base_with(|v| v["tiers"] = json!({"dev": {}})),
        "schema",
        "tiers.dev",
        "missing field `allow`",
    );
    expect_err(
        &base_with(|v| v["node_pools"]["h100"] = json!({"tenants": []})),
        "schema",
        "node_pools.h100",
        "missing field `nodes`",
    );
}

#[test]
fn bad_trust_names_the_path_and_the_choices() {
    let e = expect_err(
        &base_with(|v| v["orgs"]["acme"]["teams"]["research"]["trust"] = json!("trustd")),
        "schema",
        "orgs.acme.teams.research.trust",
        "unknown variant `trustd`, expected one of `untrusted`, `trusted`, `dev`",
    );
    assert!(e.to_string().starts_with("policy.json: orgs.acme.teams.research.trust: unknown variant `trustd`, expected one of `untrusted`, `trusted`, `dev` (line "), "{e}");
    expect_err(
        &base_with(|v| {
            v["orgs"]["acme"]["teams"]["research"]["projects"]["sandbox"]["trust"] = json!(2)
        }),
        "schema",
        "orgs.acme.teams.research.projects.sandbox.trust",
        "invalid type: integer `2`, expected one of `untrusted`, `trusted`, `dev`",
    );
}

#[test]
fn bad_isolation_names_the_element() {
    expect_err(
        &base_with(|v| v["tiers"] = json!({"dev": {"allow": ["gpu", "mig", "timeslice"]}})),
        "schema",
        "tiers.dev.allow[2]",
        "unknown variant `timeslice`, expected one of `gpu`, `mig`, `mps`, `shared`",
    );
    expect_err(
        &base_with(|v| v["tiers"] = json!({"dev": {"allow": [null]}})),
        "schema",
        "tiers.dev.allow[0]",
        "invalid type: null, expected one of `gpu`, `mig`, `mps`, `shared`",
    );
}

#[test]
fn duplicate_keys_are_errors() {
    let text =
        br#"{"version": 1, "orgs": {"acme": {"trust": "dev"}, "acme": {"trust": "untrusted"}}}"#;
    let e = Policy::parse(text, "policy.json").unwrap_err();
    assert!(matches!(e, PolicyError::Schema { .. }), "{e}");
    assert_eq!(e.json_path(), Some("orgs.acme"));
    assert!(e.message().contains("duplicate key `acme`"), "{e}");

    let text = br#"{"version": 1, "orgs": {"a": {"trust": "dev"}},
        "identity": [{"annotation": "x", "map": {"v": "a", "v": "a"}}]}"#;
    let e = Policy::parse(text, "policy.json").unwrap_err();
    assert_eq!(e.json_path(), Some("identity[0].map.v"), "{e}");

    let text = br#"{"version": 1, "version": 2, "orgs": {"a": {"trust": "dev"}}}"#;
    let e = Policy::parse(text, "policy.json").unwrap_err();
    assert!(e.message().contains("duplicate field `version`"), "{e}");
}

#[test]
fn malformed_json_reports_line_and_column() {
    let text = b"{\n  \"version\": 1,\n  \"orgs\": {\"acme\": {\"trust\": \"dev\",}}\n}";
    let e = Policy::parse(text, "policy.json").unwrap_err();
    match &e {
        PolicyError::Syntax { line, column, path, message, .. } => {
            assert_eq!((*line, *column), (3, 36), "{e}");
            assert_eq!(path, "orgs.acme");
            assert_eq!(message, "trailing comma");
        }
        other => panic!("expected a syntax error, got {other:?}"),
    }
    assert_eq!(
        e.to_string(),
        "policy.json: line 3 column 36: malformed json in orgs.acme: trailing comma"
    );

    let e = Policy::parse(b"{\"version\": 1, \"orgs\": {", "p.json").unwrap_err();
    assert!(matches!(e, PolicyError::Syntax { line: 1, .. }), "{e:?}");
    assert!(e.to_string().contains("EOF while parsing"), "{e}");

    let e =
        Policy::parse(b"{\"version\": 1, \"orgs\": {\"a\": {\"trust\": \"dev\"}}} {}", "p.json")
            .unwrap_err();
    assert!(e.to_string().contains("trailing characters"), "{e}");

    let e = Policy::parse(b"", "p.json").unwrap_err();
    assert!(matches!(e, PolicyError::Syntax { .. }), "{e:?}");

    let e = Policy::parse(b"{\"version\": 1, \"orgs\": {\"\xff\": {}}}", "p.json").unwrap_err();
    assert!(matches!(e, PolicyError::Syntax { .. }), "{e:?}");
}

// ---------------------------------------------------------------- semantic errors

#[test]
fn version_must_be_positive() {
    expect_err(&base_with(|v| v["version"] = json!(0)), "invalid", "version", "at least 1");
}

#[test]
fn names_are_checked_with_their_paths() {
    let long = "a".repeat(64);
    let max = "a".repeat(63);
    let mut ok_v = base();
    ok_v["orgs"][max.as_str()] = json!({"trust": "dev", "teams": {"0_a-b": {}}});
    ok(&ok_v);

    let bad_org = |name: &str| {
        let mut v = base();
        v["orgs"][name] = json!({"trust": "dev"});
        v
    };
    for name in ["Acme", "-acme", "_acme", "ac.me", "ac/me", "", "ac me", "ácme", long.as_str()] {
        let path = format!("orgs.{name}");
        expect_err(
            &bad_org(name),
            "invalid",
            &path,
            &format!("invalid name `{name}`: expected 1 to 63 characters"),
        );
    }
    expect_err(
        &base_with(|v| v["orgs"]["acme"]["teams"]["Research"] = json!({})),
        "invalid",
        "orgs.acme.teams.Research",
        "invalid name `Research`",
    );
    expect_err(
        &base_with(|v| v["orgs"]["acme"]["teams"]["research"]["projects"]["sand box"] = json!({})),
        "invalid",
        "orgs.acme.teams.research.projects.sand box",
        "invalid name `sand box`",
    );
    expect_err(
        &base_with(|v| {
            v["orgs"]["acme"]["teams"]["research"]["projects"]["sandbox"]["users"] =
                json!(["guest", "Eve"])
        }),
        "invalid",
        "orgs.acme.teams.research.projects.sandbox.users[1]",
        "invalid name `Eve`",
    );
    expect_err(
        &base_with(|v| v["orgs"]["acme"]["teams"]["research"]["projects"]["sandbox"]["users"] = json!(["guest", "al", "guest"])),
        "invalid",
        "orgs.acme.teams.research.projects.sandbox.users[2]",
        "duplicate user `guest`: already listed at orgs.acme.teams.research.projects.sandbox.users[0]",
    );
    expect_err(
        &base_with(|v| v["node_pools"]["H100"] = json!({"nodes": ["x"]})),
        "invalid",
        "node_pools.H100",
        "invalid name `H100`",
    );
}

#[test]
fn orgs_need_trust_and_there_must_be_one() {
    let e = expect_err(
        &base_with(|v| remove(&mut v["orgs"]["globex"], "trust")),
        "invalid",
        "orgs.globex.trust",
        "missing trust: every org must set one of untrusted, trusted, dev",
    );
    assert!(e.to_string().starts_with("policy.json: orgs.globex.trust: missing trust"), "{e}");
    expect_err(
        &json!({"version": 1, "orgs": {}}),
        "invalid",
        "orgs",
        "no orgs: expected at least one org",
    );
}

#[test]
fn untrusted_tier_may_never_allow_mps_or_shared() {
    let e = expect_err(
        &base_with(|v| v["tiers"] = json!({"untrusted": {"allow": ["gpu", "mig", "mps"]}})),
        "invalid",
        "tiers.untrusted.allow[2]",
        "untrusted tenants may only use gpu or mig isolation, not mps",
    );
    assert_eq!(
        e.to_string(),
        "policy.json: tiers.untrusted.allow[2]: untrusted tenants may only use gpu or mig \
         isolation, not mps: mps gives no memory isolation between tenants"
    );
    expect_err(
        &base_with(|v| v["tiers"] = json!({"untrusted": {"allow": ["shared"]}})),
        "invalid",
        "tiers.untrusted.allow[0]",
        "untrusted tenants may only use gpu or mig isolation, not shared",
    );
    // The same kinds are fine for the other tiers.
    ok(&base_with(|v| {
        v["tiers"] = json!({"trusted": {"allow": ["shared"]}, "dev": {"allow": ["mps"]}})
    }));
    ok(&base_with(|v| v["tiers"] = json!({"untrusted": {"allow": ["mig"]}})));
}

#[test]
fn allow_lists_are_non_empty_without_duplicates() {
    expect_err(
        &base_with(|v| v["tiers"] = json!({"trusted": {"allow": []}})),
        "invalid",
        "tiers.trusted.allow",
        "empty allow list",
    );
    expect_err(
        &base_with(|v| v["tiers"] = json!({"dev": {"allow": ["gpu", "mps", "gpu"]}})),
        "invalid",
        "tiers.dev.allow[2]",
        "duplicate isolation `gpu`: already listed at tiers.dev.allow[0]",
    );
}

#[test]
fn identity_targets_must_be_in_the_tree() {
    let e = expect_err(
        &base_with(|v| v["identity"][0]["map"]["team-dev"] = json!("acme/platform/notebook/bob")),
        "invalid",
        "identity[0].map.team-dev",
        "no tenant `acme/platform/notebook/bob`: team `acme/platform` has no project `notebook`",
    );
    assert!(e.to_string().starts_with("policy.json: identity[0].map.team-dev: no tenant"), "{e}");
    expect_err(
        &base_with(|v| v["identity"][0]["map"]["team-dev"] = json!("initech")),
        "invalid",
        "identity[0].map.team-dev",
        "there is no org `initech`",
    );
    expect_err(
        &base_with(|v| {
            v["identity"][0]["map"]["team-dev"] = json!("acme/research/sandbox/mallory")
        }),
        "invalid",
        "identity[0].map.team-dev",
        "project `acme/research/sandbox` has no user `mallory`",
    );
    for malformed in
        ["", "acme/", "/acme", "acme//research", "a/b/c/d/e", "Acme", "acme/research sandbox"]
    {
        expect_err(
            &base_with(|v| v["identity"][0]["map"]["team-dev"] = json!(malformed)),
            "invalid",
            "identity[0].map.team-dev",
            &format!("malformed tenant path `{malformed}`: expected org, org/team"),
        );
    }
    // Any depth is a valid target.
    for target in ["acme", "acme/research", "acme/research/sandbox", "acme/research/sandbox/alice"]
    {
        ok(&base_with(|v| v["identity"][0]["map"]["team-dev"] = json!(target)));
    }
}

#[test]
fn identity_rules_are_well_formed() {
    expect_err(
        &base_with(|v| v["identity"][0]["annotation"] = json!("")),
        "invalid",
        "identity[0].annotation",
        "empty annotation name",
    );
    expect_err(
        &base_with(|v| v["identity"][0]["annotation"] = json!("a b")),
        "invalid",
        "identity[0].annotation",
        "malformed annotation name",
    );
    expect_err(
        &base_with(|v| v["identity"][0]["map"] = json!({})),
        "invalid",
        "identity[0].map",
        "empty map",
    );
    expect_err(
        &base_with(
            |v| v["identity"] = json!([{"annotation": "x", "map": {"a": "acme"}}, {"annotation": "x", "map": {"b": "acme"}}]),
        ),
        "invalid",
        "identity[1].annotation",
        "duplicate annotation `x`: identity[0] already reads it",
    );
}

#[test]
fn default_tenant_must_be_in_the_tree() {
    expect_err(
        &base_with(|v| v["default_tenant"] = json!("acme/nobody")),
        "invalid",
        "default_tenant",
        "org `acme` has no team `nobody`",
    );
    let p = ok(&base_with(|v| v["default_tenant"] = json!("globex")));
    assert_eq!(p.default_tenant(), Some("globex"));
    let p = ok(&base_with(|v| v["default_tenant"] = Value::Null));
    assert_eq!(p.default_tenant(), None);
}

#[test]
fn node_pools_are_well_formed() {
    for bad in ["", "sim-*-x", "*sim", "**", "sim h100", "sim/1*", "sim?"] {
        expect_err(
            &base_with(|v| v["node_pools"]["h100"]["nodes"] = json!(["ok", bad])),
            "invalid",
            "node_pools.h100.nodes[1]",
            &format!("malformed node pattern `{bad}`"),
        );
    }
    for good in ["*", "node.example.com", "GPU_Node-7", "sim-h100-*"] {
        ok(&base_with(|v| v["node_pools"]["h100"]["nodes"] = json!([good])));
    }
    expect_err(
        &base_with(|v| v["node_pools"]["h100"]["nodes"] = json!([])),
        "invalid",
        "node_pools.h100.nodes",
        "empty nodes list",
    );
    expect_err(
        &base_with(|v| v["node_pools"]["h100"]["nodes"] = json!(["a", "b", "a"])),
        "invalid",
        "node_pools.h100.nodes[2]",
        "duplicate node pattern `a`: already listed at node_pools.h100.nodes[0]",
    );
    expect_err(
        &base_with(|v| {
            v["node_pools"]["h100"]["tenants"] = json!(["acme/research", "acme/reserch"])
        }),
        "invalid",
        "node_pools.h100.tenants[1]",
        "no tenant `acme/reserch`: org `acme` has no team `reserch`",
    );
    expect_err(
        &base_with(|v| v["node_pools"]["h100"]["tenants"] = json!(["acme", "acme"])),
        "invalid",
        "node_pools.h100.tenants[1]",
        "duplicate tenant `acme`",
    );
}

// ---------------------------------------------------------------- identity

#[test]
fn identity_comes_from_the_trusted_annotation() {
    let p = ok(&base());
    let t = p.resolve_identity(&annotations(&[(NS, "team-dev")])).expect("identity");
    assert_eq!(
        t,
        Tenant {
            path: "acme/platform/notebooks/bob".parse().expect("tenant path"),
            trust: Trust::Dev
        }
    );
    let t = p.resolve_identity(&annotations(&[(NS, "team-trusted")])).expect("identity");
    assert_eq!(
        t,
        Tenant { path: "acme/platform".parse().expect("tenant path"), trust: Trust::Trusted }
    );
}

#[test]
fn spoofed_annotations_are_ignored() {
    let p = ok(&base());
    // A trusted annotation decides, whatever else the container claims.
    let spoof = annotations(&[
        (NS, "team-untrusted"),
        ("tessera.io/tenant", "acme/platform/notebooks/bob"),
        ("tessera.io/trust", "dev"),
        ("io.kubernetes.cri.sandbox-namespace ", "team-dev"),
    ]);
    let t = p.resolve_identity(&spoof).expect("identity");
    assert_eq!(t.path, "acme/research/sandbox/guest");
    assert_eq!(t.trust, Trust::Untrusted);

    // Untrusted annotations alone identify nobody.
    let only_spoof = annotations(&[("tessera.io/tenant", "acme/platform/notebooks/bob")]);
    let e = p.resolve_identity(&only_spoof).unwrap_err();
    assert_eq!(e, IdentityError::NoIdentity { tried: vec![NS.to_string()] });
    let msg = e.to_string();
    assert!(msg.contains(NS) && msg.contains("the image env is never used for identity"), "{msg}");

    // ... and with a default tenant they get the default, not what they claimed.
    let p = ok(&base_with(|v| v["default_tenant"] = json!("globex")));
    let t = p.resolve_identity(&only_spoof).expect("default");
    assert_eq!(t, Tenant { path: "globex".parse().expect("tenant path"), trust: Trust::Untrusted });
    assert_eq!(p.resolve_identity(&BTreeMap::new()).expect("default").path, "globex");
}

#[test]
fn an_unmapped_hostile_value_is_shown_escaped_and_bounded() {
    let p = ok(&base_with(|_| {}));
    let value = format!("team\nlevel=error msg=forged\u{1b}[2J{}", "x".repeat(100_000));
    let msg = p.resolve_identity(&annotations(&[(NS, &value)])).unwrap_err().to_string();
    assert!(!msg.contains(['\n', '\u{1b}']), "{msg:?}");
    assert!(msg.contains("team\\nlevel=error") && msg.len() < 1024, "{} bytes", msg.len());
}

#[test]
fn unmapped_values_fail_closed_even_with_a_default() {
    let p = ok(&base_with(|v| v["default_tenant"] = json!("globex")));
    for value in ["team-unknown", "", "TEAM-DEV", "team-dev "] {
        let e = p.resolve_identity(&annotations(&[(NS, value)])).unwrap_err();
        assert_eq!(
            e,
            IdentityError::Unmapped {
                annotation: NS.into(),
                value: value.into(),
                rule: "identity[0].map".into()
            }
        );
        let msg = e.to_string();
        assert!(msg.contains(NS) && msg.contains(&format!("{value:?}")), "{msg}");
        assert!(msg.contains("identity[0].map"), "{msg}");
        assert!(msg.contains("the image env is never used for identity"), "{msg}");
    }
}

#[test]
fn first_present_rule_decides() {
    let p = ok(&base_with(|v| {
        v["identity"] = json!([
            {"annotation": "runtime/namespace", "map": {"ns-a": "acme/research"}},
            {"annotation": "runtime/pool", "map": {"pool-b": "globex"}}
        ])
    }));
    assert_eq!(p.identity_annotations(), ["runtime/namespace", "runtime/pool"]);
    let both = annotations(&[("runtime/namespace", "ns-a"), ("runtime/pool", "pool-b")]);
    assert_eq!(p.resolve_identity(&both).expect("first").path, "acme/research");
    let second = annotations(&[("runtime/pool", "pool-b")]);
    assert_eq!(p.resolve_identity(&second).expect("second").path, "globex");
    // The first rule's annotation is present but unmapped: refused, not passed on.
    let e = p
        .resolve_identity(&annotations(&[
            ("runtime/namespace", "other"),
            ("runtime/pool", "pool-b"),
        ]))
        .unwrap_err();
    assert!(matches!(&e, IdentityError::Unmapped { rule, .. } if rule == "identity[0].map"), "{e}");
    let e = p.resolve_identity(&annotations(&[("runtime/pool", "x")])).unwrap_err();
    assert!(matches!(&e, IdentityError::Unmapped { rule, .. } if rule == "identity[1].map"), "{e}");
    let e = p.resolve_identity(&BTreeMap::new()).unwrap_err();
    assert_eq!(
        e,
        IdentityError::NoIdentity {
            tried: vec!["runtime/namespace".into(), "runtime/pool".into()]
        }
    );
    assert!(e.to_string().contains("runtime/namespace, runtime/pool"), "{e}");
}

#[test]
fn no_rules_means_default_or_nobody() {
    let p = ok(
        &json!({"version": 1, "orgs": {"solo": {"trust": "trusted"}}, "default_tenant": "solo"}),
    );
    let t = p.resolve_identity(&annotations(&[(NS, "anything")])).expect("default");
    assert_eq!(t, Tenant { path: "solo".parse().expect("tenant path"), trust: Trust::Trusted });
    let p = ok(&json!({"version": 1, "orgs": {"solo": {"trust": "trusted"}}}));
    let e = p.resolve_identity(&annotations(&[(NS, "anything")])).unwrap_err();
    assert_eq!(e, IdentityError::NoIdentity { tried: vec![] });
    assert!(e.to_string().contains("no identity rules"), "{e}");
}

// ---------------------------------------------------------------- authorize

#[test]
fn authorize_every_tier_and_isolation_with_default_tiers() {
    let p = ok(&json!({"version": 1, "orgs": {
        "u": {"trust": "untrusted"}, "t": {"trust": "trusted"}, "d": {"trust": "dev"}
    }}));
    let expected = |trust: Trust, iso: Isolation| match trust {
        Trust::Untrusted => matches!(iso, Isolation::Gpu | Isolation::Mig),
        Trust::Trusted => iso != Isolation::Shared,
        Trust::Dev => true,
    };
    for (path, trust) in [("u", Trust::Untrusted), ("t", Trust::Trusted), ("d", Trust::Dev)] {
        let tenant = p.tenant(path).expect("tenant");
        assert_eq!(tenant.trust, trust);
        for iso in Isolation::ALL {
            let got = p.authorize(&tenant, &request_of(iso), "node-1");
            assert_eq!(got.is_ok(), expected(trust, iso), "{trust} {iso}: {got:?}");
            if let Err(r) = got {
                assert_eq!(r.rule, format!("tiers.{trust}.allow"));
                assert_eq!(r.tenant, path);
                assert_eq!(r.request, request_of(iso).to_string());
            }
        }
    }
}

#[test]
fn authorize_follows_custom_tiers() {
    let p = ok(&json!({"version": 1,
        "tiers": {"untrusted": {"allow": ["mig"]}, "trusted": {"allow": ["gpu"]}, "dev": {"allow": ["shared", "mps"]}},
        "orgs": {"u": {"trust": "untrusted"}, "t": {"trust": "trusted"}, "d": {"trust": "dev"}}}));
    let allowed = |path: &str, iso: Isolation| {
        p.authorize(&p.tenant(path).expect("tenant"), &request_of(iso), "n").is_ok()
    };
    let grid: Vec<(&str, Isolation, bool)> = vec![
        ("u", Isolation::Gpu, false),
        ("u", Isolation::Mig, true),
        ("u", Isolation::Mps, false),
        ("u", Isolation::Shared, false),
        ("t", Isolation::Gpu, true),
        ("t", Isolation::Mig, false),
        ("t", Isolation::Mps, false),
        ("t", Isolation::Shared, false),
        ("d", Isolation::Gpu, false),
        ("d", Isolation::Mig, false),
        ("d", Isolation::Mps, true),
        ("d", Isolation::Shared, true),
    ];
    for (path, iso, want) in grid {
        assert_eq!(allowed(path, iso), want, "{path} {iso}");
    }
    let r = p.authorize(&p.tenant("d").expect("d"), &gpu(), "n").unwrap_err();
    assert_eq!(r.message, "tenant d (trust dev) may not use gpu isolation (request gpu=1): tiers.dev.allow permits shared, mps");
}

#[test]
fn refusal_names_tenant_trust_request_and_rule() {
    let p = ok(&base());
    let guest = p.tenant("acme/research/sandbox/guest").expect("guest");
    let r = p.authorize(&guest, &mps(), "other-node").unwrap_err();
    assert_eq!(
        r,
        Refusal {
            tenant: "acme/research/sandbox/guest".into(),
            request: "mps=25".into(),
            rule: "tiers.untrusted.allow".into(),
            message: "tenant acme/research/sandbox/guest (trust untrusted) may not use mps \
                      isolation (request mps=25): tiers.untrusted.allow permits gpu, mig"
                .into(),
        }
    );
    assert_eq!(r.to_string(), r.message);
}

#[test]
fn authorize_believes_the_policy_not_the_caller() {
    let p = ok(&base());
    // A tenant value claiming more trust than the policy gives it.
    let liar = Tenant {
        path: "acme/research/sandbox/guest".parse().expect("tenant path"),
        trust: Trust::Dev,
    };
    let r = p.authorize(&liar, &GpuRequest::Shared, "n").unwrap_err();
    assert_eq!(r.rule, "tiers.untrusted.allow");
    assert!(r.message.contains("(trust untrusted)"), "{r}");
    // A tenant the policy does not know is refused outright.
    let ghost = Tenant { path: "acme/ghost".parse().expect("tenant path"), trust: Trust::Dev };
    let r = p.authorize(&ghost, &gpu(), "n").unwrap_err();
    assert_eq!(r.rule, "orgs");
    assert_eq!(r.message, "tenant acme/ghost (trust dev) is not in policy version 3 (request gpu=1): orgs has no such tenant");
}

// ---------------------------------------------------------------- node pools

#[test]
fn path_prefixes_are_segment_wise() {
    assert!(is_path_prefix("acme", "acme"));
    assert!(is_path_prefix("acme", "acme/research"));
    assert!(is_path_prefix("acme/research", "acme/research/sandbox/guest"));
    assert!(!is_path_prefix("acme/re", "acme/research"));
    assert!(!is_path_prefix("acm", "acme"));
    assert!(!is_path_prefix("acme/research", "acme"));
    assert!(!is_path_prefix("acme/research", "acme/researchers"));
}

#[test]
fn pool_restrictions_use_tenant_path_prefixes() {
    let p = ok(&json!({"version": 1,
        "orgs": {"acme": {"trust": "trusted", "teams": {
            "re": {"projects": {"x": {"users": ["u"]}}},
            "research": {"projects": {"y": {"users": ["v"]}}}
        }}, "globex": {"trust": "trusted"}},
        "node_pools": {"h100": {"nodes": ["sim-h100-*", "gpu-node-7"], "tenants": ["acme/re"]}}}));
    let at =
        |tenant: &str, node: &str| p.authorize(&p.tenant(tenant).expect("tenant"), &gpu(), node);
    // In the pool: only the acme/re subtree.
    for node in ["sim-h100-0", "sim-h100-", "gpu-node-7"] {
        assert!(at("acme/re", node).is_ok());
        assert!(at("acme/re/x/u", node).is_ok());
        for outsider in ["acme", "acme/research", "acme/research/y/v", "globex"] {
            let r = at(outsider, node).unwrap_err();
            assert_eq!(r.rule, "node_pools.h100.tenants", "{outsider} on {node}");
            assert_eq!(
                r.message,
                format!("tenant {outsider} (trust trusted) may not use node {node} (request gpu=1): node_pools.h100.tenants permits acme/re")
            );
        }
    }
    // Outside the pool (no glob or exact match): no restriction.
    for node in ["sim-h100", "sim-h10", "gpu-node-70", "gpu-node-", "other", ""] {
        assert!(at("globex", node).is_ok(), "{node}");
        assert!(at("acme/research/y/v", node).is_ok(), "{node}");
    }
}

#[test]
fn pools_without_tenants_restrict_nobody_and_empty_lists_everybody() {
    let p = ok(&json!({"version": 1,
        "orgs": {"a": {"trust": "dev"}},
        "node_pools": {"open": {"nodes": ["*"]}, "closed": {"nodes": ["locked-*"], "tenants": []}}}));
    let a = p.tenant("a").expect("a");
    assert!(p.authorize(&a, &GpuRequest::Shared, "anything").is_ok());
    let r = p.authorize(&a, &gpu(), "locked-1").unwrap_err();
    assert_eq!(r.rule, "node_pools.closed.tenants");
    assert!(r.message.ends_with("node_pools.closed.tenants permits no tenant"), "{r}");
}

#[test]
fn every_matching_pool_must_admit_the_tenant() {
    let p = ok(&json!({"version": 1,
    "orgs": {"acme": {"trust": "trusted", "teams": {"a": {}, "b": {}}}},
    "node_pools": {
        "big": {"nodes": ["gpu-*"], "tenants": ["acme"]},
        "special": {"nodes": ["gpu-special-1"], "tenants": ["acme/a"]}
    }}));
    let at = |t: &str, node: &str| p.authorize(&p.tenant(t).expect("t"), &mig(), node);
    assert!(at("acme/a", "gpu-special-1").is_ok());
    assert!(at("acme/b", "gpu-2").is_ok());
    assert_eq!(at("acme/b", "gpu-special-1").unwrap_err().rule, "node_pools.special.tenants");
    assert_eq!(at("acme", "gpu-special-1").unwrap_err().rule, "node_pools.special.tenants");
}

#[test]
fn tier_is_checked_before_pools() {
    let p = ok(&base());
    let outsider = p.tenant("acme/platform").expect("t");
    let r = p.authorize(&outsider, &GpuRequest::Shared, "sim-h100-1").unwrap_err();
    assert_eq!(r.rule, "tiers.trusted.allow");
    let r = p.authorize(&outsider, &mps(), "sim-h100-1").unwrap_err();
    assert_eq!(r.rule, "node_pools.h100.tenants");
    assert!(p.authorize(&outsider, &mps(), "sim-a100-1").is_ok());
}

#[cfg(test)]
mod price_tests {
    use crate::Policy;

    const BASE: &str = r#""version": 1, "orgs": {"acme": {"trust": "trusted"}}"#;

    fn parse(extra: &str) -> Result<Policy, crate::PolicyError> {
        Policy::parse(format!("{{{BASE}, {extra}}}").as_bytes(), "p.json")
    }

    #[test]
    fn prices_and_weights_parse_with_burst_defaulting_to_reserved() {
        let p = parse(r#""prices": {"H100-80GB": {"reserved_per_gpu_hour": 2.5, "burst_per_gpu_hour": 1.0}, "A100-40GB": {"reserved_per_gpu_hour": 1.25}}, "mig_weights": {"1g.10gb": 0.125}"#)
            .expect("valid");
        assert_eq!(p.prices()["H100-80GB"].burst_per_gpu_hour, 1.0);
        assert_eq!(p.prices()["A100-40GB"].burst_per_gpu_hour, 1.25);
        assert_eq!(p.mig_weight("1g.10gb"), Some(0.125));
        assert_eq!(p.mig_weight("2g.20gb"), None);
    }

    #[test]
    fn bad_prices_and_weights_name_their_path() {
        for (extra, path) in [
            (
                r#""prices": {"H100-80GB": {"reserved_per_gpu_hour": -1}}"#,
                "prices.H100-80GB.reserved_per_gpu_hour",
            ),
            (
                r#""prices": {"H100-80GB": {"reserved_per_gpu_hour": 1, "burst": 2}}"#,
                "prices.H100-80GB",
            ),
            (r#""mig_weights": {"1g.10gb": 1.5}"#, "mig_weights.1g.10gb"),
            (r#""mig_weights": {"big": 0.5}"#, "mig_weights.big"),
            (r#""mig_weights": {"1g.10gb": "half"}"#, "mig_weights.1g.10gb"),
            (
                r#""prices": {"H100-80GB": {"reserved_per_gpu_hour": 1, "nvlink_premium_per_gpu_hour": -0.5}}"#,
                "prices.H100-80GB.nvlink_premium_per_gpu_hour",
            ),
        ] {
            let e = parse(extra).expect_err(extra);
            assert!(e.to_string().contains(path), "{extra}: {e}");
        }
    }

    #[test]
    fn the_topology_premium_defaults_to_nothing() {
        let p = parse(r#""prices": {"H100-80GB": {"reserved_per_gpu_hour": 2.5, "nvlink_premium_per_gpu_hour": 0.5}, "A100-40GB": {"reserved_per_gpu_hour": 1}}"#)
            .expect("valid");
        assert_eq!(p.prices()["H100-80GB"].nvlink_premium_per_gpu_hour, 0.5);
        assert_eq!(p.prices()["A100-40GB"].nvlink_premium_per_gpu_hour, 0.0);
    }
}

#[cfg(test)]
mod billing_tests {
    use crate::{BillingMode, Policy, PreemptedWork};

    const BASE: &str = r#""version": 1, "orgs": {"acme": {"trust": "trusted", "teams": {
        "ml": {"projects": {"cv": {"users": ["alice"]}}}, "lab": {}}}}"#;

    fn parse(extra: &str) -> Result<Policy, crate::PolicyError> {
        Policy::parse(format!("{{{BASE}, {extra}}}").as_bytes(), "p.json")
    }

    #[test]
    fn modes_are_per_path_inherited_and_default_to_showback() {
        let none = Policy::parse(format!("{{{BASE}}}").as_bytes(), "p.json").expect("valid");
        assert_eq!(none.billing().mode_of("acme/ml"), BillingMode::Showback);
        assert_eq!(none.billing().preempted, PreemptedWork::Bill);
        let p = parse(
            r#""billing": {"default_mode": "chargeback", "modes": {"acme/lab": "showback", "acme/ml/cv": "chargeback"}, "preempted": "waive"}"#,
        )
        .expect("valid");
        let b = p.billing();
        assert_eq!(b.mode_of("acme/lab"), BillingMode::Showback);
        assert_eq!(b.mode_of("acme/ml/cv/alice"), BillingMode::Chargeback);
        assert_eq!(b.mode_of("acme/ml"), BillingMode::Chargeback, "the default");
        assert_eq!(b.preempted, PreemptedWork::Waive);
    }

    #[test]
    fn bad_billing_names_its_path() {
        for (extra, path, what) in [
            (
                r#""billing": {"modes": {"acme/nope": "chargeback"}}"#,
                "billing.modes.acme/nope",
                "no team `nope`",
            ),
            (
                r#""billing": {"modes": {"Acme": "chargeback"}}"#,
                "billing.modes.Acme",
                "malformed tenant path",
            ),
            (
                r#""billing": {"modes": {"acme": "charge"}}"#,
                "billing.modes.acme",
                "unknown variant `charge`",
            ),
            (r#""billing": {"default_mode": 1}"#, "billing.default_mode", "expected"),
            (r#""billing": {"preempted": "free"}"#, "billing.preempted", "`bill`"),
            (r#""billing": {"mode": "chargeback"}"#, "billing", "unknown field `mode`"),
            (
                r#""billing": {"modes": {"acme": "showback", "acme": "chargeback"}}"#,
                "billing.modes",
                "duplicate",
            ),
        ] {
            let e = parse(extra).expect_err(extra).to_string();
            assert!(e.contains(path) && e.contains(what), "{extra}: {e}");
        }
    }
}

#[cfg(test)]
mod sharing_tests {
    use crate::{GpuRequest, Policy, Trust};

    const BASE: &str = r#""version": 1, "orgs": {"acme": {"trust": "dev", "teams": {
        "ml": {"projects": {"nb": {"users": ["a", "b"]}}},
        "web": {"projects": {"x": {"users": ["c"]}}}}}}"#;

    fn parse(extra: &str) -> Result<Policy, crate::PolicyError> {
        Policy::parse(format!("{{{BASE}, {extra}}}").as_bytes(), "p.json")
    }

    #[test]
    fn domains_group_tenants_and_the_rest_share_with_themselves() {
        let p = parse(r#""sharing": {"replicas": 3, "domains": {"notebooks": ["acme/ml"]}}"#)
            .expect("valid");
        assert_eq!(p.shared_replicas(), 3);
        assert_eq!(p.sharing_domain("acme/ml/nb/a"), "notebooks");
        assert_eq!(p.sharing_domain("acme/ml/nb/b"), "notebooks");
        assert_eq!(p.sharing_domain("acme/web/x/c"), "tenant:acme/web/x/c");
        assert_eq!(p.sharing_domain("acme/mlops"), "tenant:acme/mlops", "segment-wise prefixes");
    }

    #[test]
    fn mps_cap_is_enforced_by_authorize() {
        let p = parse(r#""mps": {"max_percent": 50}"#).expect("valid");
        let t = p.tenant("acme/ml/nb/a").expect("tenant");
        assert_eq!(t.trust, Trust::Dev);
        p.authorize(&t, &GpuRequest::Mps { percent: 50 }, "n").expect("50 allowed");
        let r = p.authorize(&t, &GpuRequest::Mps { percent: 60 }, "n").unwrap_err();
        assert_eq!(r.rule, "mps.max_percent");
        assert!(r.message.contains("60") && r.message.contains("50"), "{}", r.message);
    }

    #[test]
    fn bad_sharing_and_mps_sections_name_their_path() {
        for (extra, path) in [
            (r#""mps": {"max_percent": 0}"#, "mps.max_percent"),
            (r#""mps": {"max_percent": 101}"#, "mps.max_percent"),
            (r#""sharing": {"replicas": 0}"#, "sharing.replicas"),
            (r#""sharing": {"replicas": 2, "domains": {"d": []}}"#, "sharing.domains.d"),
            (
                r#""sharing": {"replicas": 2, "domains": {"d": ["acme/nope"]}}"#,
                "sharing.domains.d[0]",
            ),
            (
                r#""sharing": {"replicas": 2, "domains": {"d": ["acme/ml"], "e": ["acme/ml"]}}"#,
                "sharing.domains.e[0]",
            ),
            (r#""sharing": {"replicas": 2, "domain": {}}"#, "sharing"),
        ] {
            let e = parse(extra).expect_err(extra);
            assert!(e.to_string().contains(path), "{extra}: {e}");
        }
    }
}

#[cfg(test)]
mod layout_tests {
    use crate::Policy;

    fn parse(pool: &str) -> Result<Policy, crate::PolicyError> {
        Policy::parse(
            format!(r#"{{"version": 1, "orgs": {{"acme": {{"trust": "trusted"}}}}, "node_pools": {{"p": {pool}}}}}"#).as_bytes(),
            "p.json",
        )
    }

    #[test]
    fn declared_layouts_parse_per_model_and_match_nodes() {
        let p = parse(r#"{"nodes": ["gpu-*"], "mig_layouts": {"H100-80GB": "all-1g", "A100-40GB": "3g.20gb@0,3g.20gb@4"}}"#)
            .expect("valid");
        let l = p.mig_layouts("gpu-7");
        assert_eq!(l.len(), 2);
        assert_eq!(l["H100-80GB"].to_string(), "all-1g");
        assert!(p.mig_layouts("cpu-1").is_empty(), "a node in no such pool is dynamic");
    }

    #[test]
    fn bad_layouts_name_their_path() {
        for (pool, path) in [
            (
                r#"{"nodes": ["n"], "mig_layouts": {"V100": "all-1g"}}"#,
                "node_pools.p.mig_layouts.V100",
            ),
            (
                r#"{"nodes": ["n"], "mig_layouts": {"H100-80GB": "some-1g"}}"#,
                "node_pools.p.mig_layouts.H100-80GB",
            ),
            (
                r#"{"nodes": ["n"], "mig_layouts": {"H100-80GB": "3g.40gb@0,3g.40gb@2"}}"#,
                "node_pools.p.mig_layouts.H100-80GB",
            ),
        ] {
            let e = parse(pool).expect_err(pool);
            assert!(e.to_string().contains(path), "{pool}: {e}");
        }
    }
}

#[test]
fn engine_limited_rules_are_read_only_for_their_engines() {
    let p = ok(&base_with(|v| {
        v["identity"] = json!([
            {"annotation": NS, "engines": ["containerd-k8s"], "map": {"team-untrusted": "acme/research/sandbox/guest"}},
            {"annotation": "tessera.io/engine", "map": {"docker-alice": "acme/platform/notebooks/bob"}}
        ]);
        v["default_tenant"] = json!("globex");
    }));
    let who = |pairs: &[(&str, &str)]| p.resolve_identity(&annotations(pairs)).map(|t| t.path);
    // The engine annotation (tessera-runtime's, from its root-owned config) decides.
    assert_eq!(
        who(&[(ENGINE_ANNOTATION, "docker-alice")]).as_deref(),
        Ok("acme/platform/notebooks/bob")
    );
    // The namespace rule is read only for the engine it names: a podman user's own
    // `--annotation` is ignored there, and the default applies.
    assert_eq!(who(&[(NS, "team-untrusted")]).as_deref(), Ok("globex"));
    // An engine the engine rule does not map is refused, not defaulted (fail closed).
    assert!(who(&[(NS, "team-untrusted"), (ENGINE_ANNOTATION, "podman")]).is_err());
    assert_eq!(
        who(&[(NS, "team-untrusted"), (ENGINE_ANNOTATION, "containerd-k8s")]).as_deref(),
        Ok("acme/research/sandbox/guest")
    );
    // A rule without `engines` is read for every container, as before.
    assert_eq!(
        ok(&base())
            .resolve_identity(&annotations(&[(NS, "team-dev"), (ENGINE_ANNOTATION, "x")]))
            .map(|t| t.path)
            .as_deref(),
        Ok("acme/platform/notebooks/bob")
    );
}

#[test]
fn engine_lists_are_validated_with_their_paths() {
    let with = |engines: Value| base_with(|v| v["identity"][0]["engines"] = engines);
    expect_err(&with(json!([])), "invalid", "identity[0].engines", "empty list");
    expect_err(
        &with(json!(["ok", "Bad"])),
        "invalid",
        "identity[0].engines[1]",
        "malformed engine name",
    );
    expect_err(
        &with(json!(["a", "a"])),
        "invalid",
        "identity[0].engines[1]",
        "duplicate engine `a`",
    );
    expect_err(&with(json!("a")), "schema", "identity[0].engines", "");
    ok(&with(json!(["docker-alice", "podman.bob_2"])));
}

// ---------------------------------------------------------------- quotas and gangs

/// `base()` with a `quotas` section.
fn with_quotas(quotas: Value) -> Value {
    base_with(|v| v["quotas"] = quotas)
}

/// The GPU resource of the H100 model, which most cases bound.
fn h100() -> quota::Resource {
    quota::Resource::gpu("H100-80GB")
}

#[test]
fn a_quotas_section_parses_into_the_tree_with_inherited_grace_periods() {
    let p = ok(&base_with(|v| {
        v["quotas"] = json!({
            "acme": {"gpus": {"H100-80GB": {"guarantee": 16, "ceiling": 16}}, "grace_period_s": 120},
            "acme/research": {
                "gpus": {"H100-80GB": {"guarantee": 4, "ceiling": 12, "lending_limit": 2},
                         "A100-40GB": {"ceiling": 0.5}},
                "cpu_cores": {"guarantee": 64, "ceiling": 128},
                "memory_gib": {"ceiling": 1024}
            },
            "acme/research/sandbox/guest": {"gpus": {"H100-80GB": {"ceiling": 2}}, "grace_period_s": 0},
            "globex": {"cpu_cores": {"guarantee": 0.5}}
        });
        v["gangs"] = json!({"timeout_s": 600});
    }));
    assert!(p.has_quotas());
    assert_eq!(p.gang_timeout_s(), 600);
    assert_eq!(MAX_GANG_TIMEOUT_S, 600);
    let q = p.quotas();
    let paths: Vec<&str> = q.iter().map(|x| x.path.as_str()).collect();
    assert_eq!(paths, ["acme", "acme/research", "acme/research/sandbox/guest", "globex"]);
    let research = q.get("acme/research").expect("acme/research has a quota");
    let micro = quota::MICRO_PER_GPU;
    assert_eq!(
        research.limits[&h100()],
        quota::Limit {
            guarantee: Some(4 * micro),
            ceiling: Some(12 * micro),
            lending_limit: Some(2 * micro)
        }
    );
    assert_eq!(research.limits[&quota::Resource::gpu("A100-40GB")].ceiling, Some(micro / 2));
    assert_eq!(
        research.limits[&quota::Resource::Cpu],
        quota::Limit { guarantee: Some(64_000), ceiling: Some(128_000), lending_limit: None }
    );
    assert_eq!(research.limits[&quota::Resource::Memory].ceiling, Some(1024 * 1024));
    assert_eq!(research.limits.len(), 4, "{research:?}");
    assert_eq!(q.get("globex").expect("globex").limits[&quota::Resource::Cpu].guarantee, Some(500));
    // The chain of a user, innermost first; a grant counts against each.
    let chain: Vec<&str> =
        q.chain("acme/research/sandbox/guest").map(|x| x.path.as_str()).collect();
    assert_eq!(chain, ["acme/research/sandbox/guest", "acme/research", "acme"]);
    assert!(q.get("acme/platform").is_none());
    // Grace periods: set, inherited from the nearest ancestor, or the default.
    assert_eq!(q.grace_period_s("acme"), 120);
    assert_eq!(q.grace_period_s("acme/research"), 120);
    assert_eq!(q.grace_period_s("acme/research/vetted/carol"), 120);
    assert_eq!(q.grace_period_s("acme/research/sandbox/guest"), 0);
    assert_eq!(q.grace_period_s("globex"), quota::DEFAULT_GRACE_PERIOD_S);
}

#[test]
fn without_quotas_or_gangs_the_defaults_hold() {
    for v in [
        base(),
        base_with(|v| v["quotas"] = json!({})),
        base_with(|v| v["gangs"] = json!({})),
        base_with(|v| v["quotas"] = json!({"acme": {}})),
    ] {
        let p = ok(&v);
        assert_eq!(p.gang_timeout_s(), DEFAULT_GANG_TIMEOUT_S);
        assert_eq!(DEFAULT_GANG_TIMEOUT_S, 60);
        // An entry that bounds nothing is a quota that bounds nothing.
        assert!(p.quotas().iter().all(|q| q.limits.is_empty()), "{v}");
        assert_eq!(p.has_quotas(), v["quotas"].get("acme").is_some(), "{v}");
    }
    assert!(!ok(&base()).has_quotas());
    assert_eq!(ok(&base()).quotas(), &quota::QuotaTree::default());
}

#[test]
fn quota_errors_name_their_json_path() {
    let h100 = |limits: Value| json!({"gpus": {"H100-80GB": limits}});
    let cases: Vec<(Value, &str, &str, &str)> = vec![
        // Keys: tenant paths of the tree.
        (
            json!({"acme/nope": h100(json!({"ceiling": 1}))}),
            "invalid",
            "quotas.acme/nope",
            "no tenant `acme/nope` in orgs: a quota must name a node of the tenant tree",
        ),
        (
            json!({"Acme": {}}),
            "invalid",
            "quotas.Acme",
            "`Acme` is not a tenant path: expected org[/team[/project[/user]]]",
        ),
        (json!({"acme/": {}}), "invalid", "quotas.acme/", "is not a tenant path"),
        (json!({"a/b/c/d/e": {}}), "invalid", "quotas.a/b/c/d/e", "is not a tenant path"),
        // GPU models: the catalog's.
        (
            json!({"acme": {"gpus": {"B200": {"ceiling": 1}}}}),
            "invalid",
            "quotas.acme.gpus.B200",
            "unknown GPU model `B200`: expected one of A100-40GB, A100-80GB, H100-80GB, \
             H200-141GB",
        ),
        // Amounts and their order.
        (
            json!({"acme": h100(json!({"guarantee": 4, "ceiling": 2}))}),
            "invalid",
            "quotas.acme.gpus.H100-80GB.ceiling",
            "the ceiling (2) is below the guarantee (4): a ceiling must be at least the \
             guarantee",
        ),
        (
            json!({"acme": {"memory_gib": {"guarantee": 8, "lending_limit": 9}}}),
            "invalid",
            "quotas.acme.memory_gib.lending_limit",
            "the lending limit (9) is above the guarantee (8)",
        ),
        (
            json!({"acme": h100(json!({"ceiling": 8, "lending_limit": 1}))}),
            "invalid",
            "quotas.acme.gpus.H100-80GB.lending_limit",
            "a lending limit needs a guarantee to lend from",
        ),
        (
            json!({"acme": {"cpu_cores": {}}}),
            "invalid",
            "quotas.acme.cpu_cores",
            "expected a guarantee, a ceiling or both",
        ),
        (
            json!({"acme": {"cpu_cores": {"ceiling": 1_000_001}}}),
            "invalid",
            "quotas.acme.cpu_cores.ceiling",
            "expected a number from 0 to 1000000, got 1000001",
        ),
        (
            json!({"acme": h100(json!({"guarantee": -0.5}))}),
            "invalid",
            "quotas.acme.gpus.H100-80GB.guarantee",
            "expected a number from 0 to 1000000, got -0.5",
        ),
        (
            json!({"acme": {"grace_period_s": 3601}}),
            "invalid",
            "quotas.acme.grace_period_s",
            "expected 0 to 3600 seconds, got 3601",
        ),
        // Children's guarantees fit in their parent's guarantee, else its ceiling.
        (
            json!({
                "acme": h100(json!({"guarantee": 4})),
                "acme/research": h100(json!({"guarantee": 3})),
                "acme/platform": h100(json!({"guarantee": 2}))
            }),
            "invalid",
            "quotas.acme.gpus.H100-80GB.guarantee",
            "the guarantees under acme sum to 5 H100-80GB GPUs (acme/platform 2 H100-80GB \
             GPUs, acme/research 3 H100-80GB GPUs), more than its guarantee of 4 H100-80GB \
             GPUs: children's guarantees must fit in their parent's",
        ),
        (
            json!({
                "acme": {"cpu_cores": {"ceiling": 8}},
                "acme/research/sandbox/guest": {"cpu_cores": {"guarantee": 8.5}}
            }),
            "invalid",
            "quotas.acme.cpu_cores.ceiling",
            "the guarantees under acme sum to 8.5 CPU cores",
        ),
        // The shape: unknown fields, wrong types, the array spelling of an object.
        (
            json!({"acme": {"gpu": {}}}),
            "schema",
            "quotas.acme.gpu",
            "unknown field `gpu`, expected one of `gpus`, `cpu_cores`, `memory_gib`, \
             `grace_period_s`",
        ),
        (
            json!({"acme": h100(json!({"ceiling": 1, "burst": 2}))}),
            "schema",
            "quotas.acme.gpus.H100-80GB.burst",
            "unknown field `burst`, expected one of `guarantee`, `ceiling`, `lending_limit`",
        ),
        (json!({"acme": [{}, null, null, 60]}), "schema", "quotas.acme", "expected an object"),
        (json!({"acme": {"cpu_cores": [1, 2]}}), "schema", "quotas.acme.cpu_cores", "an object"),
        (json!({"acme": h100(json!("all"))}), "schema", "quotas.acme.gpus.H100-80GB", "object"),
        (
            json!({"acme": {"grace_period_s": 1.5}}),
            "schema",
            "quotas.acme.grace_period_s",
            "invalid type: floating point `1.5`",
        ),
        (
            json!({"acme": h100(json!({"ceiling": "4"}))}),
            "schema",
            "quotas.acme.gpus.H100-80GB.ceiling",
            "invalid type: string \"4\", expected f64",
        ),
        (json!(["acme"]), "schema", "quotas", "expected an object"),
    ];
    for (quotas, kind, path, message) in cases {
        expect_err(&with_quotas(quotas), kind, path, message);
    }
}

#[test]
fn a_key_given_twice_in_quotas_is_refused_at_its_path() {
    let doc = |quotas: &str| {
        format!(r#"{{"version": 1, "orgs": {{"acme": {{"trust": "dev"}}}}, "quotas": {quotas}}}"#)
    };
    for (quotas, path, message) in [
        (
            r#"{"acme": {"cpu_cores": {"ceiling": 1}}, "acme": {"cpu_cores": {"ceiling": 2}}}"#,
            "quotas.acme",
            "duplicate key `acme`: each name may appear once",
        ),
        (
            r#"{"acme": {"gpus": {"H100-80GB": {"ceiling": 1}, "H100-80GB": {"ceiling": 2}}}}"#,
            "quotas.acme.gpus.H100-80GB",
            "duplicate key `H100-80GB`",
        ),
        (
            r#"{"acme": {"cpu_cores": {"ceiling": 1, "ceiling": 2}}}"#,
            // serde finds a field given twice at the end of its object.
            "quotas.acme.cpu_cores",
            "duplicate field `ceiling`",
        ),
    ] {
        let e = Policy::parse(doc(quotas).as_bytes(), "policy.json").unwrap_err();
        assert!(matches!(e, PolicyError::Schema { .. }), "{e}");
        assert_eq!(e.json_path(), Some(path), "{e}");
        assert!(e.message().contains(message), "{e}");
    }
}

#[test]
fn gang_timeouts_are_bounded() {
    let with = |gangs: Value| base_with(|v| v["gangs"] = gangs);
    for t in [1, 60, 599, MAX_GANG_TIMEOUT_S] {
        assert_eq!(ok(&with(json!({"timeout_s": t}))).gang_timeout_s(), t);
    }
    expect_err(
        &with(json!({"timeout_s": 0})),
        "invalid",
        "gangs.timeout_s",
        "expected 1 to 600 seconds, got 0",
    );
    expect_err(
        &with(json!({"timeout_s": 601})),
        "invalid",
        "gangs.timeout_s",
        "expected 1 to 600 seconds, got 601",
    );
    expect_err(
        &with(json!({"timeout_s": 3600})),
        "invalid",
        "gangs.timeout_s",
        "expected 1 to 600 seconds, got 3600",
    );
    expect_err(&with(json!({"timeout_s": -1})), "schema", "gangs.timeout_s", "invalid value");
    expect_err(
        &with(json!({"timeout": 5})),
        "schema",
        "gangs.timeout",
        "unknown field `timeout`, expected `timeout_s`",
    );
    expect_err(&with(json!([60])), "schema", "gangs", "expected an object");
}

/// The error is one line of printable text, at most `max` characters.
#[track_caller]
fn assert_shown_safely(e: &PolicyError, max: usize) -> String {
    let shown = e.to_string();
    assert!(!shown.chars().any(char::is_control), "{shown:?}");
    assert!(shown.chars().count() <= max, "{} characters: {shown}", shown.chars().count());
    shown
}

#[test]
fn hostile_keys_in_quotas_are_shown_escaped_and_bounded() {
    let long = "a".repeat(10_000);
    let ansi = "acme\n\u{1b}[2J";

    // A key that is no tenant path (the quota crate's check).
    let e = parse_value(&with_quotas(json!({ &long: {} }))).unwrap_err();
    let cut = format!("quotas.{}…[10000 bytes in all]", "a".repeat(256));
    assert_eq!(e.json_path(), Some(cut.as_str()));
    assert!(e.message().contains("is not a tenant path"), "{e}");
    assert_shown_safely(&e, 1_000);
    let e = parse_value(&with_quotas(json!({ ansi: {} }))).unwrap_err();
    assert_eq!(e.json_path(), Some("quotas.acme\\n\\u{1b}[2J"));
    assert!(assert_shown_safely(&e, 1_000).contains("`acme\\n\\u{1b}[2J` is not a tenant path"));

    // A GPU model that is not the catalog's.
    let model = format!("H100\u{1b}[31m\r\n{long}");
    let e = parse_value(&with_quotas(json!({"acme": {"gpus": { &model: {"ceiling": 1}}}})))
        .unwrap_err();
    assert!(e.json_path().is_some_and(|p| p.starts_with("quotas.acme.gpus.H100\\u{1b}[31m\\r\\n")));
    assert!(assert_shown_safely(&e, 1_000).contains("unknown GPU model"));

    // Structural errors (serde's) under a hostile key: the tracked path and the field
    // name serde quotes back.
    let e = parse_value(&with_quotas(json!({ ansi: {"zz": 1} }))).unwrap_err();
    assert!(matches!(e, PolicyError::Schema { .. }), "{e}");
    assert_eq!(e.json_path(), Some("quotas.acme\\n\\u{1b}[2J.zz"));
    assert_shown_safely(&e, 1_000);
    let field = format!("zz\u{1b}[2J\n{long}");
    let e = parse_value(&with_quotas(json!({"acme": { &field: 1 }}))).unwrap_err();
    assert!(e.message().starts_with("unknown field `zz\\u{1b}[2J\\n"), "{e}");
    assert_shown_safely(&e, 2_000);
    let e = parse_value(&with_quotas(json!({ &long: {"gpus": 7} }))).unwrap_err();
    assert!(e.json_path().is_some_and(|p| p.ends_with("…[10000 bytes in all].gpus")), "{e}");
    assert_shown_safely(&e, 1_000);
    let text = format!(
        r#"{{"version": 1, "orgs": {{"acme": {{"trust": "dev"}}}},
            "quotas": {{"{long}\u001b": {{}}, "{long}\u001b": {{}}}}}}"#
    );
    let e = Policy::parse(text.as_bytes(), "policy.json").unwrap_err();
    assert!(e.message().contains("duplicate key"), "{e}");
    assert_shown_safely(&e, 1_500);

    // Elsewhere in the policy too: an org name is the file's own text.
    let e = parse_value(&base_with(|v| v["orgs"][ansi] = json!({"trust": "dev"}))).unwrap_err();
    assert_eq!(e.json_path(), Some("orgs.acme\\n\\u{1b}[2J"));
    assert_shown_safely(&e, 1_000);
}

/// Issue 26: the node-health sections, their defaults, and errors at their paths.
#[test]
fn faults_topology_and_interference_are_read_and_checked() {
    let p = ok(&base());
    assert_eq!(p.faults(), &FaultSettings::default());
    assert!(p.interference().enabled && !p.topology().pin_cpus);
    let p = ok(&base_with(|v| {
        v["faults"] = json!({"ignore_xids": [92, 92], "stop_holders": true, "grace_s": 5});
        v["topology"] = json!({"isolate_nvlink_domains": true});
        v["interference"] = json!({"classes": {"acme/platform": "latency", "acme": "batch"},
            "stop_after_samples": 6});
    }));
    assert_eq!(p.faults().ignore_xids, [92]);
    assert!(p.faults().stop_holders && p.topology().isolate_nvlink_domains);
    let i = p.interference();
    assert_eq!(i.stop_after_samples, Some(6));
    use tessera_api::WorkloadClass::{Batch, Latency};
    assert_eq!(i.class_of("acme/platform/notebooks/bob", None), Latency, "longest prefix");
    assert_eq!(i.class_of("acme/research/sandbox/guest", None), Batch);
    assert_eq!(i.class_of("acme/platform/notebooks/bob", Some(Batch)), Batch, "declared wins");
    assert_eq!(i.class_of("globex", None), Batch, "unlisted");
    expect_err(
        &base_with(|v| v["faults"] = json!({"ignore_xids": [95]})),
        "invalid",
        "faults.ignore_xids[0]",
        "XID 95 is a hardware fault",
    );
    expect_err(
        &base_with(|v| v["faults"] = json!({"grace_s": 301})),
        "invalid",
        "faults.grace_s",
        "expected 0 to 300 seconds",
    );
    expect_err(
        &base_with(|v| v["interference"] = json!({"classes": {"nobody": "latency"}})),
        "invalid",
        "interference.classes.nobody",
        "is no tenant",
    );
    expect_err(
        &base_with(|v| v["interference"] = json!({"classes": {"acme": "fast"}})),
        "schema",
        "interference.classes.acme",
        "unknown variant `fast`",
    );
    expect_err(
        &base_with(|v| v["interference"] = json!({"min_share": 1.5})),
        "invalid",
        "interference.min_share",
        "expected a fraction in (0, 1)",
    );
    expect_err(
        &base_with(|v| v["interference"] = json!({"throttle_factor_percent": 100})),
        "invalid",
        "interference.throttle_factor_percent",
        "0 (no throttle) to 99",
    );
    expect_err(
        &base_with(|v| v["topology"] = json!({"pin": true})),
        "schema",
        "topology.pin",
        "unknown field `pin`",
    );
}
