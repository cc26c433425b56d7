//! A node builds without the fleet coordinator and without protoc (issues 12 and 13):
//! tesserad, tessera-runtime, tessera-hook and the CLI link the `fleet` crate (wire types,
//! verification, client, agent), never `coordinator`, whose server and etcd store bring
//! etcd-client into a build; and no node package runs a code generator at build time
//! (prost-build, tonic-build, tonic-prost-build, protoc-*): gRPC code a node needs (the
//! kubelet device-plugin API in `device-plugin`) is generated once and checked in, so
//! tonic and prost themselves are fine. Asks `cargo tree` for each node package's normal
//! and build dependencies (not dev: tests may regenerate code).
//!
//! The policy crate is pure (issue 12): it validates declared MIG layouts against the
//! `catalog` crate, never `slicer`, so it links no NVML.
//!
//! The lab (issue 24: the trace replay, the packer, the adversary, the trace generators and
//! the quota simulator, `crates/lab`) is linked by no node or coordinator binary: `tessera
//! sim` runs the lab's own binary, `tessera-sim`.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

/// The packages a node builds: the root package (tesserad, tessera-runtime, tessera-hook,
/// tessera) and the library crates they are made of.
const NODE_PACKAGES: &[&str] = &[
    "tessera",
    "tesserad",
    "runtime-hook",
    "fleet",
    "tessera-api",
    "policy",
    "catalog",
    "slicer",
    "metering",
    "mpsd",
    "scrub",
    "device-plugin",
];

/// Crates no node build may pull in: the coordinator stack (its allocator included),
/// and build-time code generators (which need protoc).
fn forbidden(name: &str) -> bool {
    matches!(
        name,
        "coordinator"
            | "etcd-client"
            | "mimalloc"
            | "libmimalloc-sys"
            | "prost-build"
            | "tonic-build"
            | "tonic-prost-build"
    ) || name.starts_with("protoc-")
}

/// Normal and build edges: a generator runs from a build script.
const EDGES: &str = "normal,build";

fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.current_dir(env!("CARGO_MANIFEST_DIR"));
    cmd
}

fn tree(args: &[&str]) -> String {
    let out = cargo().arg("tree").args(args).output().expect("running cargo tree");
    assert!(
        out.status.success(),
        "cargo tree {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 from cargo tree")
}

#[test]
fn node_packages_do_not_depend_on_the_coordinator_stack() {
    let mut found = Vec::new();
    for pkg in NODE_PACKAGES {
        let listing = tree(&["-e", EDGES, "-p", pkg, "--prefix", "none"]);
        let mut bad: Vec<&str> = listing
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|name| forbidden(name))
            .collect();
        bad.sort_unstable();
        bad.dedup();
        for name in bad {
            // Who pulls it in, for the failure message.
            let why = tree(&["-e", EDGES, "-p", pkg, "-i", name, "--depth", "3"]);
            found.push(format!("{pkg} depends on {name}:\n{why}"));
        }
    }
    assert!(
        found.is_empty(),
        "node packages must build without the coordinator (use the `fleet` crate) and without \
         protoc (check generated code in):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_coordinator_still_has_its_stores() {
    // The check above is only meaningful if `cargo tree` does list these crates where they
    // are: the coordinator's etcd store, whose build script runs a code generator.
    let listing = tree(&["-e", EDGES, "-p", "coordinator", "--prefix", "none"]);
    let names: Vec<&str> = listing.lines().filter_map(|l| l.split_whitespace().next()).collect();
    for want in ["etcd-client", "fleet"] {
        assert!(names.contains(&want), "coordinator's tree lacks {want}:\n{listing}");
    }
    assert!(
        names.iter().any(|n| forbidden(n) && n.ends_with("-build")),
        "coordinator's tree shows no code generator:\n{listing}"
    );
    // And the device plugin links the gRPC runtime the check lets through.
    let listing = tree(&["-e", EDGES, "-p", "device-plugin", "--prefix", "none"]);
    let names: Vec<&str> = listing.lines().filter_map(|l| l.split_whitespace().next()).collect();
    for want in ["tonic", "prost"] {
        assert!(names.contains(&want), "device-plugin's tree lacks {want}:\n{listing}");
    }
}

#[test]
fn policy_builds_without_nvml_or_slicer() {
    let listing = tree(&["-e", "normal", "-p", "policy", "--prefix", "none"]);
    let names: Vec<&str> = listing.lines().filter_map(|l| l.split_whitespace().next()).collect();
    assert!(names.contains(&"catalog"), "policy's tree lacks catalog:\n{listing}");
    for bad in ["slicer", "nvml-wrapper", "nvml-wrapper-sys", "cudarc"] {
        assert!(!names.contains(&bad), "policy depends on {bad}:\n{listing}");
    }
    // The check is only meaningful if `cargo tree` lists nvml-wrapper where it is.
    let slicer = tree(&["-e", "normal", "-p", "slicer", "--prefix", "none"]);
    assert!(slicer.lines().any(|l| l.starts_with("nvml-wrapper ")), "slicer's tree:\n{slicer}");
}

/// `cargo metadata` of the workspace (its own packages only).
fn metadata() -> serde_json::Value {
    let out = cargo()
        .args(["metadata", "--format-version", "1", "--no-deps", "--locked"])
        .output()
        .expect("running cargo metadata");
    assert!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("cargo metadata's JSON")
}

/// The package that builds binary `bin`, from `cargo metadata` (so a binary moving to
/// another package is followed, not missed).
fn package_of_bin(meta: &serde_json::Value, bin: &str) -> String {
    let packages = meta["packages"].as_array().expect("packages");
    let mut found = packages.iter().filter(|p| {
        p["targets"].as_array().is_some_and(|ts| {
            ts.iter().any(|t| {
                t["name"] == bin
                    && t["kind"].as_array().is_some_and(|k| k.iter().any(|k| k == "bin"))
            })
        })
    });
    let pkg = found.next().unwrap_or_else(|| panic!("no package builds a binary `{bin}`"));
    assert!(found.next().is_none(), "two packages build a binary `{bin}`");
    pkg["name"].as_str().expect("a package name").to_string()
}

#[test]
fn no_node_or_coordinator_binary_links_the_lab() {
    let meta = metadata();
    let mut found = Vec::new();
    for bin in ["tesserad", "tessera-runtime", "tessera-hook", "tessera", "tessera-coordinator"] {
        let pkg = package_of_bin(&meta, bin);
        let listing = tree(&["-e", EDGES, "-p", &pkg, "--prefix", "none"]);
        if listing.lines().any(|l| l.split_whitespace().next() == Some("lab")) {
            let why = tree(&["-e", EDGES, "-p", &pkg, "-i", "lab", "--depth", "3"]);
            found.push(format!("{bin} (package {pkg}) links lab:\n{why}"));
        }
    }
    assert!(
        found.is_empty(),
        "the lab is research: no node or coordinator binary may link it (tessera sim runs \
         tessera-sim):\n{}",
        found.join("\n")
    );
    // The check is only meaningful if `cargo tree` lists the lab where it is: its own
    // binary's package, built on slicer and quota.
    assert_eq!(package_of_bin(&meta, "tessera-sim"), "lab");
    let listing = tree(&["-e", "normal", "-p", "lab", "--prefix", "none"]);
    let names: Vec<&str> = listing.lines().filter_map(|l| l.split_whitespace().next()).collect();
    for want in ["lab", "slicer", "quota"] {
        assert!(names.contains(&want), "lab's tree lacks {want}:\n{listing}");
    }
}

/// The crate graph block of docs/ARCHITECTURE.md: crate → its workspace dependencies.
/// One line per crate, `NAME ─▶ DEP, DEP, ...` or `NAME` alone for a leaf; text in
/// parentheses is commentary, and so is a leading `test only:`.
fn documented_graph(doc: &str) -> Result<BTreeMap<String, BTreeSet<String>>, String> {
    let start = doc.find("The crate graph").ok_or("no `The crate graph` paragraph")?;
    let open =
        doc[start..].find("```\n").ok_or("no code block after `The crate graph`")? + start + 4;
    let close = doc[open..].find("```").ok_or("the crate graph's block is not closed")? + open;
    let mut graph = BTreeMap::new();
    for (n, line) in doc[open..close].lines().enumerate() {
        let mut text = String::new();
        let mut depth = 0usize;
        for ch in line.chars() {
            match ch {
                '(' => depth += 1,
                ')' => depth = depth.saturating_sub(1),
                _ if depth == 0 => text.push(ch),
                _ => {}
            }
        }
        let text = text.trim();
        let text = text.strip_prefix("test only:").unwrap_or(text).trim();
        if text.is_empty() {
            continue;
        }
        let (name, deps) = match text.split_once('─') {
            Some((name, rest)) => {
                let rest =
                    rest.strip_prefix('▶').ok_or(format!("line {}: `─` without `▶`", n + 1))?;
                let deps: BTreeSet<String> = rest
                    .split(',')
                    .map(|d| d.trim().to_string())
                    .filter(|d| !d.is_empty())
                    .collect();
                (name.trim(), deps)
            }
            None => (text, BTreeSet::new()),
        };
        if name.contains(char::is_whitespace)
            || deps.iter().any(|d| d.contains(char::is_whitespace))
        {
            return Err(format!("line {}: not `crate ─▶ dep, dep`: {line}", n + 1));
        }
        if graph.insert(name.to_string(), deps).is_some() {
            return Err(format!("line {}: {name} is listed twice", n + 1));
        }
    }
    Ok(graph)
}

/// Normal dependencies between the workspace's packages, from `cargo metadata`.
fn metadata_graph(meta: &serde_json::Value) -> BTreeMap<String, BTreeSet<String>> {
    let packages = meta["packages"].as_array().expect("packages");
    let ours: BTreeSet<&str> = packages.iter().filter_map(|p| p["name"].as_str()).collect();
    packages
        .iter()
        .map(|p| {
            let deps = p["dependencies"]
                .as_array()
                .expect("dependencies")
                .iter()
                .filter(|d| d["kind"].is_null()) // normal, not dev or build
                .filter_map(|d| d["name"].as_str())
                .filter(|d| ours.contains(d))
                .map(str::to_string)
                .collect();
            (p["name"].as_str().expect("a package name").to_string(), deps)
        })
        .collect()
}

#[test]
fn the_crate_graph_in_architecture_md_is_cargo_metadatas() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/ARCHITECTURE.md");
    let doc = std::fs::read_to_string(path).expect("docs/ARCHITECTURE.md");
    let documented = documented_graph(&doc).unwrap_or_else(|e| panic!("{path}: {e}"));
    let actual = metadata_graph(&metadata());
    let mut wrong = Vec::new();
    for (name, deps) in &actual {
        match documented.get(name) {
            None => wrong.push(format!("{name} is not in the graph (it depends on {deps:?})")),
            Some(d) if d != deps => wrong.push(format!(
                "{name}: the graph says {d:?}, cargo metadata {deps:?} (missing {:?}, extra {:?})",
                deps.difference(d).collect::<Vec<_>>(),
                d.difference(deps).collect::<Vec<_>>()
            )),
            Some(_) => {}
        }
    }
    for name in documented.keys().filter(|n| !actual.contains_key(*n)) {
        wrong.push(format!("{name} is in the graph but is no workspace package"));
    }
    assert!(wrong.is_empty(), "{path}, the crate graph:\n{}", wrong.join("\n"));
}
