//! The policy reference (docs/POLICY.md) and the JSON Schema (schemas/policy.schema.json)
//! against the parser: every field the parser accepts is documented and in the schema,
//! and nothing else is; the example policies validate against the schema.
//!
//! The parser's fields are asked of the parser itself: an unknown field at each object's
//! path makes serde list the fields that object accepts (`deny_unknown_fields`).

#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;
use std::path::PathBuf;

fn repo(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").join(p)
}

/// Every object of the policy: its documented path, and a policy with an unknown field
/// `zz_probe` in that object (`@` marks where).
const OBJECTS: &[(&str, &str)] = &[
    ("", r#"{"version": 1, "orgs": {}, @}"#),
    ("tiers", r#"{"version": 1, "orgs": {}, "tiers": {@}}"#),
    ("tiers.<tier>", r#"{"version": 1, "orgs": {}, "tiers": {"dev": {@}}}"#),
    ("orgs.<org>", r#"{"version": 1, "orgs": {"a": {@}}}"#),
    ("orgs.<org>.teams.<team>", r#"{"version": 1, "orgs": {"a": {"teams": {"t": {@}}}}}"#),
    (
        "orgs.<org>.teams.<team>.projects.<project>",
        r#"{"version": 1, "orgs": {"a": {"teams": {"t": {"projects": {"p": {@}}}}}}}"#,
    ),
    ("identity[]", r#"{"version": 1, "orgs": {}, "identity": [{@}]}"#),
    ("node_pools.<pool>", r#"{"version": 1, "orgs": {}, "node_pools": {"p": {@}}}"#),
    ("prices.<model>", r#"{"version": 1, "orgs": {}, "prices": {"m": {@}}}"#),
    ("mps", r#"{"version": 1, "orgs": {}, "mps": {@}}"#),
    ("sharing", r#"{"version": 1, "orgs": {}, "sharing": {@}}"#),
    ("scrub", r#"{"version": 1, "orgs": {}, "scrub": {@}}"#),
    ("quotas.<tenant>", r#"{"version": 1, "orgs": {}, "quotas": {"a": {@}}}"#),
    (
        "quotas.<tenant>.gpus.<model>",
        r#"{"version": 1, "orgs": {}, "quotas": {"a": {"gpus": {"m": {@}}}}}"#,
    ),
    (
        "quotas.<tenant>.cpu_cores",
        r#"{"version": 1, "orgs": {}, "quotas": {"a": {"cpu_cores": {@}}}}"#,
    ),
    (
        "quotas.<tenant>.memory_gib",
        r#"{"version": 1, "orgs": {}, "quotas": {"a": {"memory_gib": {@}}}}"#,
    ),
    ("gangs", r#"{"version": 1, "orgs": {}, "gangs": {@}}"#),
    ("billing", r#"{"version": 1, "orgs": {}, "billing": {@}}"#),
    ("faults", r#"{"version": 1, "orgs": {}, "faults": {@}}"#),
    ("topology", r#"{"version": 1, "orgs": {}, "topology": {@}}"#),
    ("interference", r#"{"version": 1, "orgs": {}, "interference": {@}}"#),
];

/// The fields serde says the object at `probe`'s `@` accepts.
fn accepted(probe: &str) -> BTreeSet<String> {
    let doc = probe.replace('@', r#""zz_probe": 1"#);
    let err = policy::Policy::parse(doc.as_bytes(), "probe.json").unwrap_err().to_string();
    let list = err
        .split_once("unknown field `zz_probe`, expected ")
        .unwrap_or_else(|| panic!("{probe}: not an unknown-field error: {err}"))
        .1;
    let list = list.strip_prefix("one of ").unwrap_or(list);
    list.split('`').skip(1).step_by(2).map(str::to_string).collect()
}

/// Every field path the parser accepts, as docs/POLICY.md writes them.
fn parser_fields() -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (path, probe) in OBJECTS {
        let fields = accepted(probe);
        assert!(!fields.is_empty(), "{path}: no fields");
        for f in fields {
            out.insert(if path.is_empty() { f } else { format!("{path}.{f}") });
        }
    }
    out
}

/// The field paths in docs/POLICY.md's tables: the first cell of each row.
fn documented_fields() -> BTreeSet<String> {
    let text = std::fs::read_to_string(repo("docs/POLICY.md")).unwrap();
    text.lines()
        .filter_map(|l| l.strip_prefix("| `"))
        .filter_map(|l| l.split_once('`'))
        .map(|(field, _)| field.to_string())
        .collect()
}

#[test]
fn the_reference_documents_exactly_the_fields_the_parser_accepts() {
    let parser = parser_fields();
    let docs = documented_fields();
    let missing: Vec<_> = parser.difference(&docs).collect();
    let extra: Vec<_> = docs.difference(&parser).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "docs/POLICY.md is out of step with crates/policy/src/raw.rs:\n  accepted but not \
         documented: {missing:?}\n  documented but not accepted: {extra:?}"
    );
    // The fields a user once found only in a validation error.
    for f in [
        "default_tenant",
        "mig_weights",
        "scrub.min_coverage",
        "identity[].engines",
        "quotas.<tenant>.gpus.<model>.lending_limit",
        "quotas.<tenant>.grace_period_s",
        "gangs.timeout_s",
    ] {
        assert!(docs.contains(f), "{f}");
    }
}

fn schema() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(repo("schemas/policy.schema.json")).unwrap())
        .unwrap()
}

/// The schema object at a documented path (`<tier>` is each tier, checked through `dev`;
/// another `<name>` steps into a map's values, `[]` into a list's items).
fn schema_at<'a>(mut node: &'a serde_json::Value, path: &str) -> &'a serde_json::Value {
    if path.is_empty() {
        return node;
    }
    for step in path.split('.') {
        let (name, list) = match step.strip_suffix("[]") {
            Some(n) => (n, true),
            None => (step, false),
        };
        node = if name == "<tier>" {
            &node["properties"]["dev"]
        } else if name.starts_with('<') {
            &node["additionalProperties"]
        } else {
            &node["properties"][name]
        };
        if list {
            node = &node["items"];
        }
        assert!(node.is_object(), "schema has nothing at {path} ({step})");
    }
    node
}

#[test]
fn the_schema_has_exactly_the_parsers_fields_and_refuses_others() {
    let schema = schema();
    for (path, probe) in OBJECTS {
        let node = schema_at(&schema, path);
        let props: BTreeSet<String> =
            node["properties"].as_object().unwrap().keys().cloned().collect();
        assert_eq!(props, accepted(probe), "schema properties at `{path}`");
        assert_eq!(node["additionalProperties"], false, "`{path}` must refuse unknown fields");
    }
    // Each tier has the same shape as `dev`.
    let tiers = &schema["properties"]["tiers"]["properties"];
    assert_eq!(tiers["untrusted"], tiers["dev"]);
    assert_eq!(tiers["trusted"], tiers["dev"]);
}

#[test]
fn the_example_policies_validate_against_the_schema_and_broken_ones_do_not() {
    let validator = jsonschema::validator_for(&schema()).unwrap();
    let mut examples = Vec::new();
    for dir in ["examples", "tests/testdata"] {
        let Ok(entries) = std::fs::read_dir(repo(dir)) else { continue };
        for e in entries.flatten() {
            let p = e.path();
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            if name.contains("policy") && name.ends_with(".json") {
                examples.push(p);
            }
        }
    }
    assert!(examples.iter().any(|p| p.ends_with("examples/policy.json")), "{examples:?}");
    for p in &examples {
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
        // What the parser accepts, the schema accepts.
        if policy::Policy::load(p).is_ok() {
            let errors: Vec<String> = validator.iter_errors(&doc).map(|e| e.to_string()).collect();
            assert!(errors.is_empty(), "{}: {errors:?}", p.display());
        }
    }
    let good: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(repo("examples/policy.json")).unwrap())
            .unwrap();
    for (what, edit) in [
        ("a typo", r#"{"verison": 2}"#),
        ("a trust level", r#"{"orgs": {"acme": {"trust": "root"}}}"#),
        ("mps over 100 %", r#"{"mps": {"max_percent": 101}}"#),
        ("version 0", r#"{"version": 0}"#),
        ("a scrub field typo", r#"{"scrub": {"timeout": 5}}"#),
    ] {
        let mut bad = good.clone();
        let edit: serde_json::Map<String, serde_json::Value> = serde_json::from_str(edit).unwrap();
        for (k, v) in edit {
            bad[k] = v;
        }
        assert!(!validator.is_valid(&bad), "the schema accepts {what}");
        let text = serde_json::to_vec(&bad).unwrap();
        assert!(policy::Policy::parse(&text, "bad.json").is_err(), "the parser accepts {what}");
    }
}

/// `examples/policy.json` with `edit`'s top-level fields replaced.
fn example_with(edit: serde_json::Value) -> serde_json::Value {
    let mut doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(repo("examples/policy.json")).unwrap())
            .unwrap();
    for (k, v) in edit.as_object().unwrap() {
        doc[k] = v.clone();
    }
    doc
}

/// A `quotas` section with every field, on the example policy's tenants.
fn full_quotas() -> serde_json::Value {
    serde_json::json!({
        "quotas": {
            "acme": {
                "gpus": {
                    "H100-80GB": {"guarantee": 16, "ceiling": 24, "lending_limit": 8},
                    "A100-40GB": {"ceiling": 1000000}
                },
                "cpu_cores": {"guarantee": 256, "ceiling": 512, "lending_limit": 0},
                "memory_gib": {"guarantee": 2048, "ceiling": 4096, "lending_limit": 1024},
                "grace_period_s": 3600
            },
            "acme/trusted": {
                "gpus": {"H100-80GB": {"guarantee": 8, "ceiling": 16}},
                "memory_gib": {"ceiling": 512}
            },
            "acme/trusted/training/alice": {
                "gpus": {"H100-80GB": {"ceiling": 0.5}, "H200-141GB": {"ceiling": 0.25}},
                "cpu_cores": {"guarantee": 0.5},
                "grace_period_s": 0
            },
            "acme/dev": {"gpus": {"A100-80GB": {"guarantee": 0.142857}}}
        },
        "gangs": {"timeout_s": 600}
    })
}

#[test]
fn a_full_quotas_section_validates_and_broken_ones_do_not() {
    let validator = jsonschema::validator_for(&schema()).unwrap();
    let good = example_with(full_quotas());
    let errors: Vec<String> = validator.iter_errors(&good).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "the schema refuses a full quotas section: {errors:?}");
    let text = serde_json::to_vec(&good).unwrap();
    let parsed = policy::Policy::parse(&text, "good.json").unwrap();
    assert_eq!(parsed.quotas().iter().count(), 4);
    assert_eq!(parsed.gang_timeout_s(), 600);

    // Each edit replaces `quotas` (or `gangs`): both the schema and the parser refuse it.
    for (what, edit) in [
        ("an unknown field in a quota entry", r#"{"quotas": {"acme": {"gpu": {}}}}"#),
        (
            "an unknown field in a GPU model's limits",
            r#"{"quotas": {"acme": {"gpus": {"H100-80GB": {"ceiling": 1, "burst": 2}}}}}"#,
        ),
        (
            "an unknown field in the CPU limits",
            r#"{"quotas": {"acme": {"cpu_cores": {"ceiling": 1, "limit": 2}}}}"#,
        ),
        (
            "an unknown field in the memory limits",
            r#"{"quotas": {"acme": {"memory_gib": {"ceiling": 1, "min": 0}}}}"#,
        ),
        ("an unknown GPU model", r#"{"quotas": {"acme": {"gpus": {"B200": {"ceiling": 1}}}}}"#),
        ("a key that is no tenant path", r#"{"quotas": {"Acme": {}}}"#),
        ("a tenant path too deep", r#"{"quotas": {"a/b/c/d/e": {}}}"#),
        ("a negative amount", r#"{"quotas": {"acme": {"cpu_cores": {"guarantee": -1}}}}"#),
        ("an amount above 1e6", r#"{"quotas": {"acme": {"cpu_cores": {"ceiling": 1000001}}}}"#),
        ("neither guarantee nor ceiling", r#"{"quotas": {"acme": {"memory_gib": {}}}}"#),
        (
            "a lending limit without a guarantee",
            r#"{"quotas": {"acme": {"memory_gib": {"ceiling": 4, "lending_limit": 1}}}}"#,
        ),
        ("a grace period above the bound", r#"{"quotas": {"acme": {"grace_period_s": 3601}}}"#),
        (
            "an owed reclaim delay above a day",
            r#"{"quotas": {"acme": {"owed_reclaim_after_s": 86401}}}"#,
        ),
        ("a fractional grace period", r#"{"quotas": {"acme": {"grace_period_s": 1.5}}}"#),
        ("a quota entry as an array", r#"{"quotas": {"acme": [{}, null, null, 60]}}"#),
        ("limits as an array", r#"{"quotas": {"acme": {"cpu_cores": [1, 2]}}}"#),
        ("quotas as an array", r#"{"quotas": []}"#),
        ("a gang timeout of 0", r#"{"gangs": {"timeout_s": 0}}"#),
        ("a gang timeout above 600 s", r#"{"gangs": {"timeout_s": 601}}"#),
        ("an unknown field in gangs", r#"{"gangs": {"timeout": 5}}"#),
    ] {
        let bad = example_with(serde_json::from_str(edit).unwrap());
        assert!(!validator.is_valid(&bad), "the schema accepts {what}");
        let text = serde_json::to_vec(&bad).unwrap();
        assert!(policy::Policy::parse(&text, "bad.json").is_err(), "the parser accepts {what}");
    }
}

#[test]
fn the_schemas_quota_and_gang_bounds_are_the_crates() {
    let schema = schema();
    let entry = schema_at(&schema, "quotas.<tenant>");
    // GPU models: exactly the catalog's.
    let models: BTreeSet<&str> = entry["properties"]["gpus"]["propertyNames"]["enum"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_str().unwrap())
        .collect();
    assert_eq!(models, catalog::model_names().collect::<BTreeSet<_>>());
    // The bounds the parser checks.
    let grace = &entry["properties"]["grace_period_s"];
    assert_eq!(
        (grace["minimum"].as_u64(), grace["maximum"].as_u64()),
        (Some(0), Some(quota::MAX_GRACE_PERIOD_S))
    );
    for (field, max) in [
        ("min_runtime_s", quota::MAX_MIN_RUNTIME_S),
        ("requeue_backoff_s", quota::MAX_REQUEUE_BACKOFF_S),
        ("owed_reclaim_after_s", quota::MAX_OWED_RECLAIM_AFTER_S),
    ] {
        let f = &entry["properties"][field];
        assert_eq!((f["minimum"].as_u64(), f["maximum"].as_u64()), (Some(0), Some(max)), "{field}");
    }
    let gangs = &schema_at(&schema, "gangs")["properties"]["timeout_s"];
    assert_eq!(
        (gangs["minimum"].as_u64(), gangs["maximum"].as_u64()),
        (Some(1), Some(policy::MAX_GANG_TIMEOUT_S))
    );
    // The three resources' limits share one shape (their descriptions name the unit).
    let shape = |path: &str| {
        let mut node = schema_at(&schema, path).clone();
        for field in ["guarantee", "ceiling", "lending_limit"] {
            node["properties"][field].as_object_mut().unwrap().remove("description");
        }
        node
    };
    assert_eq!(shape("quotas.<tenant>.cpu_cores"), shape("quotas.<tenant>.gpus.<model>"));
    assert_eq!(shape("quotas.<tenant>.memory_gib"), shape("quotas.<tenant>.gpus.<model>"));
    // Quota keys: the schema's pattern is the API's tenant path.
    let keys = jsonschema::validator_for(&entry_keys(&schema)).unwrap();
    for key in [
        "acme",
        "acme/ml",
        "a/b/c/d",
        "a_b-c/0",
        "a/b/c/d/e",
        "Acme",
        "acme/",
        "/acme",
        "-a",
        "_a",
        "a//b",
        "a b",
        "acme\n",
    ]
    .into_iter()
    .map(String::from)
    .chain(["a".repeat(63), "a".repeat(64)])
    {
        assert_eq!(
            keys.is_valid(&serde_json::json!(key)),
            tessera_api::TenantPath::new(key.as_str()).is_ok(),
            "{key:?}"
        );
    }
}

/// The schema of a quota key (`quotas`' `propertyNames`).
fn entry_keys(schema: &serde_json::Value) -> serde_json::Value {
    let keys = schema["properties"]["quotas"]["propertyNames"].clone();
    assert!(keys.is_object(), "quotas has no propertyNames");
    keys
}
