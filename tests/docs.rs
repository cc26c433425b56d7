//! docs/ names the tests that hold each promise (a table's "test" column, a line's
//! backticks). A test renamed or removed leaves a promise pointing at nothing; this finds
//! every such name in docs/*.md and README.md and checks that a `fn` of that name is in the
//! tree's Rust sources.
//!
//! A name is a backticked token (its last `::` segment) of snake case, at least 26
//! characters and four words: shorter identifiers in the docs are types, fields, flags
//! and functions the prose is about, not tests. Prometheus metrics (`tessera_…`), MPS
//! control commands (`get_…`, `set_…`), report and policy fields (`…_seconds`,
//! `…_per_gpu_hour`) and trace files are long too and are left out. A name ending in `*`
//! (`rt2_*`) is a prefix: some `fn` must start with it.

use std::fs;
use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`, skipping build output, reference material and git.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if path.is_dir() {
            if !matches!(name.as_ref(), "target" | "shared" | ".git" | "node_modules")
                && !name.starts_with("target")
            {
                rust_files(&path, out);
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

/// The names of every `fn` in `src`.
fn fn_names(src: &str, out: &mut Vec<String>) {
    let mut rest = src;
    while let Some(i) = rest.find("fn ") {
        let before_ok = i == 0 || !rest.as_bytes()[i - 1].is_ascii_alphanumeric();
        let after = &rest[i + 3..];
        let name: String =
            after.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        if before_ok && !name.is_empty() {
            out.push(name);
        }
        rest = after;
    }
}

/// A token of the docs that names a test (module documentation), `*` kept.
fn test_name(token: &str) -> Option<&str> {
    let last = token.trim_matches(|c| matches!(c, '(' | ')' | '.' | ':')).rsplit("::").next()?;
    let bare = last.trim_end_matches('*');
    let snake = bare.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && bare.starts_with(|c: char| c.is_ascii_lowercase());
    let long = bare.len() >= 26 && bare.matches('_').count() >= 3;
    // Long snake-case names the docs quote that are not Rust functions: Prometheus metrics,
    // MPS control commands, policy and report fields, trace files.
    let other = ["tessera_", "get_", "set_", "openb_pod_list_"].iter().any(|p| bare.starts_with(p))
        || ["_seconds", "_per_gpu_hour"].iter().any(|s| bare.ends_with(s));
    (snake && long && !other).then_some(last)
}

/// The backticked spans of `text`.
fn backticked(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

#[test]
fn every_test_the_docs_name_is_in_the_tree() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut sources = Vec::new();
    rust_files(root, &mut sources);
    let mut fns = Vec::new();
    for path in &sources {
        let src = fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        fn_names(&src, &mut fns);
    }
    assert!(fns.len() > 1_000, "premise: the tree's functions were found ({})", fns.len());
    let fns: std::collections::BTreeSet<String> = fns.into_iter().collect();

    let mut docs: Vec<PathBuf> = fs::read_dir(root.join("docs"))
        .expect("docs/")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.push(root.join("README.md"));
    docs.sort();

    let mut named = 0;
    let mut missing = Vec::new();
    for doc in &docs {
        let text = fs::read_to_string(doc).unwrap_or_else(|e| panic!("{}: {e}", doc.display()));
        for span in backticked(&text) {
            for token in span.split(|c: char| c.is_whitespace() || matches!(c, ',' | ';')) {
                let Some(name) = test_name(token) else { continue };
                named += 1;
                let found = match name.strip_suffix('*') {
                    Some(prefix) => fns.iter().any(|f| f.starts_with(prefix)),
                    None => fns.contains(name),
                };
                if !found {
                    let doc = doc.strip_prefix(root).unwrap_or(doc);
                    missing.push(format!("{}: `{name}`", doc.display()));
                }
            }
        }
    }
    assert!(named > 300, "premise: the docs' test names were found ({named})");
    assert!(missing.is_empty(), "named in docs/, no such fn in the tree: {missing:#?}");
}

#[test]
fn a_name_is_a_long_snake_case_token_and_a_star_is_a_prefix() {
    assert_eq!(
        test_name("quota::books::tests::a_claim_admitted_elsewhere_ends_its_holds"),
        Some("a_claim_admitted_elsewhere_ends_its_holds")
    );
    assert_eq!(test_name("the_simulator_counts_victims_*"), Some("the_simulator_counts_victims_*"));
    // Types, fields, constants and short functions are what the prose is about.
    assert_eq!(test_name("choose_victims"), None);
    assert_eq!(test_name("WAITING_TTL_MS"), None);
    assert_eq!(test_name("Books::consolidations_elsewhere"), None);
    assert_eq!(test_name("--checkpoint-fraction"), None);
    assert_eq!(test_name("tessera_quota_split_brain_syncs_total"), None);
    assert_eq!(test_name("set_default_active_thread_percentage"), None);
    assert_eq!(test_name("owed_later_wait_p50_seconds"), None);
    assert_eq!(backticked("a `b` c `d e` f"), ["b", "d e"]);
    let mut fns = Vec::new();
    fn_names("pub fn one() {}\nfn two_words(x: u8) {}\nlet cfn = 1; // fn", &mut fns);
    assert_eq!(fns, ["one", "two_words"]);
}
