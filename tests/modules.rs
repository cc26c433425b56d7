//! No import cycle between the modules of one crate (issue 24): in every crate of the
//! workspace (each `src/lib.rs`, `src/main.rs`, `src/bin/*.rs` and `src/bin/*/main.rs` of
//! the root package and of `crates/*`), the modules that are children of one parent depend
//! on each other without a cycle, so each has a room of its own: a route module never
//! borrows from another route module, it shares a module below both.
//!
//! How it is checked: every source file of the crate is read (the module tree followed from
//! the crate root through `mod NAME;`, `#[path]` and inline `mod NAME { ... }`), comments
//! and string literals are dropped, and every path that starts with `crate::`, `super::` or
//! `self::` — in `use` trees (`use crate::{a::B, c::{D, E}}`) and anywhere else
//! (`crate::a::f()`) — is resolved to the deepest module it names. A reference from module
//! `p::a::x` to `p::b::y` is an edge `a → b` among the children of `p`; a reference to an
//! ancestor or a descendant (`super::*`, a child's items) is not an edge, and neither is
//! one to the crate root (its re-exports). Every strongly connected set of two or more
//! siblings is a cycle. Paths through a crate's own name or macros that expand to paths
//! are not seen; `include!`d (generated) files are not read. Test modules
//! (`#[cfg(test)] mod NAME`) are not read either: a test may drive the whole crate (a
//! node test through the controller) without that making the node depend on it.
//!
//! A cycle allowed for a while is listed in [`KNOWN`] (none now) and must match exactly,
//! so that breaking one fails here until it is taken off the list.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Cycles allowed for now, each as (crate root, parent module, the cycle's modules, sorted):
/// none. tesserad's (controller, exits, fleet, node, reload) is gone (issue 24): the
/// reload's two steps are a controller method over `policy_reload`, `reload.rs` is only
/// the signal source, the API starts a container's exit watch, the node owns its
/// `EXITED_REASON`. A cycle that comes back fails here.
const KNOWN: &[(&str, &str, &[&str])] = &[];

/// The workspace's packages: the root one and `crates/*`.
fn package_dirs(repo: &Path) -> Vec<PathBuf> {
    let mut dirs = vec![repo.to_path_buf()];
    let mut members: Vec<PathBuf> = std::fs::read_dir(repo.join("crates"))
        .expect("crates/")
        .map(|e| e.expect("a crates/ entry").path())
        .filter(|p| p.join("Cargo.toml").is_file())
        .collect();
    members.sort();
    dirs.extend(members);
    dirs
}

/// The crate roots of a package's `src`.
fn crate_roots(pkg: &Path) -> Vec<PathBuf> {
    let src = pkg.join("src");
    let mut roots: Vec<PathBuf> =
        ["lib.rs", "main.rs"].iter().map(|f| src.join(f)).filter(|p| p.is_file()).collect();
    if let Ok(bins) = std::fs::read_dir(src.join("bin")) {
        let mut more: Vec<PathBuf> = bins
            .map(|e| e.expect("a bin entry").path())
            .filter_map(|p| {
                if p.extension().is_some_and(|e| e == "rs") {
                    Some(p)
                } else {
                    Some(p.join("main.rs")).filter(|m| m.is_file())
                }
            })
            .collect();
        more.sort();
        roots.extend(more);
    }
    roots
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Ident(String),
    Str(String),
    PathSep,
    Punct(char),
}

/// Rust source as tokens, without comments; string literals kept whole (for `#[path]`),
/// char literals and lifetimes dropped, numbers and operators as punctuation.
fn lex(src: &str) -> Vec<Tok> {
    let c: Vec<char> = src.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let ident_char = |ch: char| ch.is_alphanumeric() || ch == '_';
    while i < c.len() {
        let ch = c[i];
        let next = c.get(i + 1).copied();
        if ch == '/' && next == Some('/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && next == Some('*') {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if ch == '"' || ((ch == 'b' || ch == 'r' || ch == 'c') && raw_or_byte_string(&c, i))
        {
            let (s, end) = string_literal(&c, i);
            out.push(Tok::Str(s));
            i = end;
        } else if ch == '\'' {
            // A char literal ('a', '\n', '\u{1F600}') or a lifetime ('a, 'static).
            if next == Some('\\') {
                i += 3;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if c.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                i += 1;
                while i < c.len() && ident_char(c[i]) {
                    i += 1;
                }
            }
        } else if ch == '$' && next.is_some_and(ident_char) {
            let start = i;
            i += 1;
            while i < c.len() && ident_char(c[i]) {
                i += 1;
            }
            out.push(Tok::Ident(c[start..i].iter().collect()));
        } else if ident_char(ch) {
            let start = i;
            while i < c.len() && ident_char(c[i]) {
                i += 1;
            }
            // `r#ident`: a raw identifier.
            if c[start..i] == ['r'] && c.get(i) == Some(&'#') {
                let s = i + 1;
                i = s;
                while i < c.len() && ident_char(c[i]) {
                    i += 1;
                }
                out.push(Tok::Ident(c[s..i].iter().collect()));
            } else {
                out.push(Tok::Ident(c[start..i].iter().collect()));
            }
        } else if ch == ':' && next == Some(':') {
            out.push(Tok::PathSep);
            i += 2;
        } else {
            if !ch.is_whitespace() {
                out.push(Tok::Punct(ch));
            }
            i += 1;
        }
    }
    out
}

/// Whether a string literal with a prefix (`b"`, `r"`, `r#"`, `br"`, `c"`, ...) starts at `i`.
fn raw_or_byte_string(c: &[char], i: usize) -> bool {
    if i > 0 && (c[i - 1].is_alphanumeric() || c[i - 1] == '_') {
        return false;
    }
    let mut j = i;
    while j < c.len() && j < i + 2 && matches!(c[j], 'b' | 'r' | 'c') {
        j += 1;
    }
    while j < c.len() && c[j] == '#' {
        j += 1;
    }
    c.get(j) == Some(&'"')
}

/// The string literal starting at `i` (any prefix), and where it ends.
fn string_literal(c: &[char], mut i: usize) -> (String, usize) {
    let mut raw = false;
    while matches!(c[i], 'b' | 'r' | 'c') {
        raw |= c[i] == 'r';
        i += 1;
    }
    let mut hashes = 0;
    while c[i] == '#' {
        hashes += 1;
        i += 1;
    }
    i += 1; // the opening quote
    let start = i;
    loop {
        if i >= c.len() {
            return (c[start..].iter().collect(), i);
        }
        if !raw && c[i] == '\\' {
            i += 2;
            continue;
        }
        if c[i] == '"' && (0..hashes).all(|k| c.get(i + 1 + k) == Some(&'#')) {
            return (c[start..i].iter().collect(), i + 1 + hashes);
        }
        i += 1;
    }
}

/// One crate's module tree and the references between its modules.
#[derive(Debug, Default)]
struct Crate {
    /// Every module, as its path from the crate root (the root is the empty path).
    modules: BTreeSet<Vec<String>>,
    /// (from, to): every `crate::`/`super::`/`self::` path, resolved to a module path
    /// (the deepest module it names), from the module it is written in.
    refs: Vec<(Vec<String>, Vec<String>)>,
}

fn read_crate(root: &Path) -> Crate {
    let mut krate = Crate::default();
    let mut raw_refs = Vec::new();
    read_file(root, &[], true, &mut krate, &mut raw_refs);
    for (from, path) in raw_refs {
        // The deepest module the path names; an item of the root resolves to the root.
        let to = (0..=path.len())
            .rev()
            .map(|n| path[..n].to_vec())
            .find(|p| krate.modules.contains(p))
            .unwrap_or_default();
        krate.refs.push((from, to));
    }
    krate
}

/// Reads the module in `file` at `module`, with its children (`mod_rs`: a crate root or a
/// `mod.rs`, whose children live beside it).
fn read_file(
    file: &Path,
    module: &[String],
    mod_rs: bool,
    krate: &mut Crate,
    refs: &mut Vec<(Vec<String>, Vec<String>)>,
) {
    let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let toks = lex(&text);
    krate.modules.insert(module.to_vec());
    let dir = file.parent().expect("a source file's directory").to_path_buf();
    let child_dir = if mod_rs {
        dir.clone()
    } else {
        dir.join(file.file_stem().expect("a file name").to_string_lossy().as_ref())
    };
    // Inline modules open here: (the module path, the brace depth its body is at).
    let mut stack: Vec<(Vec<String>, usize)> = vec![(module.to_vec(), 0)];
    let mut depth = 0usize;
    let mut path_attr: Option<String> = None;
    let mut i = 0;
    while i < toks.len() {
        let here = stack.last().expect("the file's module").0.clone();
        match &toks[i] {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => {
                depth = depth.saturating_sub(1);
                if stack.len() > 1 && stack.last().is_some_and(|(_, d)| *d > depth) {
                    stack.pop();
                }
            }
            Tok::Punct('#')
                if matches!(
                    &toks[i + 1..],
                    [Tok::Punct('['), Tok::Ident(c), Tok::Punct('('), Tok::Ident(t), Tok::Punct(')'), Tok::Punct(']'), Tok::Ident(m), ..]
                        if c == "cfg" && t == "test" && m == "mod"
                ) =>
            {
                // `#[cfg(test)] mod NAME ...`: test code may drive the whole crate (a node
                // test through the controller); it is not part of the module graph.
                let mut j = i + 8; // the module's name
                if toks.get(j + 1) == Some(&Tok::Punct('{')) {
                    let mut open = 0usize;
                    j += 1;
                    while j < toks.len() {
                        match toks[j] {
                            Tok::Punct('{') => open += 1,
                            Tok::Punct('}') => {
                                open -= 1;
                                if open == 0 {
                                    break;
                                }
                            }
                            _ => {}
                        }
                        j += 1;
                    }
                } else {
                    j += 1; // `;`
                }
                i = j + 1;
                continue;
            }
            Tok::Punct('#') => {
                // `#[path = "file.rs"]`, for the next `mod NAME;`.
                if let [Tok::Punct('['), Tok::Ident(p), Tok::Punct('='), Tok::Str(s), Tok::Punct(']'), ..] =
                    &toks[i + 1..]
                {
                    if p == "path" {
                        path_attr = Some(s.clone());
                    }
                }
            }
            Tok::Ident(kw) if kw == "mod" => {
                if let (Some(Tok::Ident(name)), Some(next)) = (toks.get(i + 1), toks.get(i + 2)) {
                    let mut child = here.clone();
                    child.push(name.clone());
                    match next {
                        Tok::Punct(';') => {
                            // Only modules declared at the file's own level have files of
                            // their own here (inline modules' children are not used).
                            let (path, child_mod_rs) = match path_attr.take() {
                                Some(p) => (dir.join(p), true),
                                None => {
                                    let base = if stack.len() == 1 {
                                        child_dir.clone()
                                    } else {
                                        stack[1..].iter().fold(child_dir.clone(), |d, (m, _)| {
                                            d.join(m.last().expect("an inline module's name"))
                                        })
                                    };
                                    let flat = base.join(format!("{name}.rs"));
                                    if flat.is_file() {
                                        (flat, false)
                                    } else {
                                        (base.join(name).join("mod.rs"), true)
                                    }
                                }
                            };
                            read_file(&path, &child, child_mod_rs, krate, refs);
                            i += 3;
                            continue;
                        }
                        Tok::Punct('{') => {
                            krate.modules.insert(child.clone());
                            depth += 1;
                            stack.push((child, depth));
                            path_attr = None;
                            i += 3;
                            continue;
                        }
                        _ => {}
                    }
                }
            }
            Tok::Ident(kw) if kw == "use" => {
                let end = toks[i..]
                    .iter()
                    .position(|t| *t == Tok::Punct(';'))
                    .map_or(toks.len(), |n| i + n);
                let mut paths = Vec::new();
                use_tree(&toks[i + 1..end], &mut paths);
                for p in paths {
                    if let Some(abs) = resolve(&here, &p) {
                        refs.push((here.clone(), abs));
                    }
                }
                i = end;
                continue;
            }
            Tok::Ident(start) if matches!(start.as_str(), "crate" | "super" | "self") => {
                let after_in = i > 0 && toks[i - 1] == Tok::Ident("in".into());
                if !after_in && toks.get(i + 1) == Some(&Tok::PathSep) {
                    let mut p = vec![start.clone()];
                    let mut j = i + 1;
                    while toks.get(j) == Some(&Tok::PathSep) {
                        match toks.get(j + 1) {
                            Some(Tok::Ident(seg)) => {
                                p.push(seg.clone());
                                j += 2;
                            }
                            _ => break,
                        }
                    }
                    if let Some(abs) = resolve(&here, &p) {
                        refs.push((here.clone(), abs));
                    }
                    i = j;
                    continue;
                }
            }
            _ => {}
        }
        i += 1;
    }
}

/// The paths of a `use` tree (`a::b::{c, d::{e, f}}, g`), each as its segments: a glob
/// (`a::*`) and `a::{self}` are `a`; a rename (`as x`) does not change the path.
fn use_tree(toks: &[Tok], out: &mut Vec<Vec<String>>) {
    let mut i = 0;
    while i < toks.len() {
        let before = i;
        use_subtree(toks, &mut i, &[], out);
        match toks.get(i) {
            Some(Tok::Punct(',')) => i += 1,
            _ if i == before => i += 1,
            _ => {}
        }
    }
}

fn use_subtree(toks: &[Tok], i: &mut usize, prefix: &[String], out: &mut Vec<Vec<String>>) {
    let mut path = prefix.to_vec();
    loop {
        match toks.get(*i) {
            Some(Tok::Ident(s)) if s == "as" => {
                *i += 2;
                break;
            }
            Some(Tok::Ident(s)) => {
                if !(s == "self" && path.len() == prefix.len() && !prefix.is_empty()) {
                    path.push(s.clone());
                }
                *i += 1;
            }
            Some(Tok::PathSep) => *i += 1,
            Some(Tok::Punct('*')) => {
                *i += 1;
                break;
            }
            Some(Tok::Punct('{')) => {
                *i += 1;
                loop {
                    let before = *i;
                    use_subtree(toks, i, &path, out);
                    match toks.get(*i) {
                        Some(Tok::Punct(',')) => *i += 1,
                        Some(Tok::Punct('}')) => {
                            *i += 1;
                            return;
                        }
                        _ if *i == before => return,
                        _ => {}
                    }
                }
            }
            _ => break,
        }
    }
    if !path.is_empty() {
        out.push(path);
    }
}

/// `path` (written in module `here`) as a path from the crate root, if it is one of ours.
fn resolve(here: &[String], path: &[String]) -> Option<Vec<String>> {
    let mut at: Vec<String> = here.to_vec();
    let mut rest = path;
    match rest.first().map(String::as_str) {
        Some("crate") => {
            at.clear();
            rest = &rest[1..];
        }
        Some("self") => rest = &rest[1..],
        Some("super") => {}
        _ => return None, // another crate, std, or a name in scope
    }
    while rest.first().map(String::as_str) == Some("super") {
        at.pop()?;
        rest = &rest[1..];
    }
    at.extend(rest.iter().cloned());
    Some(at)
}

/// A cycle among siblings: their parent, the modules of one strongly connected set, and
/// the edges between them (who uses whom).
type Cycle = (Vec<String>, BTreeSet<String>, Vec<(String, String)>);

/// The cycles among siblings.
fn sibling_cycles(krate: &Crate) -> Vec<Cycle> {
    // parent -> child -> children it depends on
    let mut graphs: BTreeMap<Vec<String>, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for (from, to) in &krate.refs {
        let k = from.iter().zip(to).take_while(|(a, b)| a == b).count();
        if k == from.len() || k == to.len() {
            continue; // an ancestor, a descendant or itself
        }
        graphs
            .entry(from[..k].to_vec())
            .or_default()
            .entry(from[k].clone())
            .or_default()
            .insert(to[k].clone());
    }
    let mut out = Vec::new();
    for (parent, graph) in graphs {
        for scc in strongly_connected(&graph) {
            if scc.len() > 1 {
                let edges = graph
                    .iter()
                    .filter(|(from, _)| scc.contains(*from))
                    .flat_map(|(from, tos)| {
                        tos.iter()
                            .filter(|to| scc.contains(*to))
                            .map(|to| (from.clone(), to.clone()))
                    })
                    .collect();
                out.push((parent.clone(), scc, edges));
            }
        }
    }
    out
}

/// Tarjan's strongly connected components.
fn strongly_connected(g: &BTreeMap<String, BTreeSet<String>>) -> Vec<BTreeSet<String>> {
    struct State<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<BTreeSet<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a str) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        let g = s.g;
        for w in g.get(v).into_iter().flatten() {
            let w = w.as_str();
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if s.on_stack.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut scc = BTreeSet::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                scc.insert(w.to_string());
                if w == v {
                    break;
                }
            }
            s.out.push(scc);
        }
    }
    let mut s = State {
        g,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    let nodes: BTreeSet<&str> = g
        .iter()
        .flat_map(|(k, vs)| std::iter::once(k.as_str()).chain(vs.iter().map(String::as_str)))
        .collect();
    for v in nodes {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.out
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A cycle as reported and as [`KNOWN`] lists it: (crate root relative to the repo,
/// parent module, the cycle's modules).
type Found = (String, String, Vec<String>);

/// Every crate root's cycles, with the edges of each.
fn all_cycles() -> BTreeMap<Found, Vec<(String, String)>> {
    let repo = repo();
    let mut found = BTreeMap::new();
    for pkg in package_dirs(&repo) {
        for root in crate_roots(&pkg) {
            let rel = root.strip_prefix(&repo).expect("under the repo").display().to_string();
            for (parent, scc, edges) in sibling_cycles(&read_crate(&root)) {
                found.insert((rel.clone(), parent.join("::"), scc.into_iter().collect()), edges);
            }
        }
    }
    found
}

#[test]
fn no_module_of_a_crate_depends_on_a_sibling_that_depends_on_it() {
    let found = all_cycles();
    let known: BTreeSet<Found> = KNOWN
        .iter()
        .map(|(root, parent, mods)| {
            (root.to_string(), parent.to_string(), mods.iter().map(|m| m.to_string()).collect())
        })
        .collect();
    let show = |s: &Found| {
        let parent = if s.1.is_empty() { "the crate root".to_string() } else { s.1.clone() };
        format!("{}: under {parent}: {}", s.0, s.2.join(" <-> "))
    };
    let new: Vec<String> = found
        .iter()
        .filter(|(k, _)| !known.contains(*k))
        .map(|(k, edges)| {
            let uses: Vec<String> = edges.iter().map(|(a, b)| format!("{a} uses {b}")).collect();
            format!("{} ({})", show(k), uses.join(", "))
        })
        .collect();
    assert!(
        new.is_empty(),
        "import cycles between sibling modules (move what both need into a module below \
         them):\n{}",
        new.join("\n")
    );
    let gone: Vec<String> = known.iter().filter(|k| !found.contains_key(*k)).map(show).collect();
    assert!(gone.is_empty(), "no longer cycles: take them off KNOWN:\n{}", gone.join("\n"));
    for (root, _, _) in &known {
        assert!(root.starts_with("crates/daemon/"), "KNOWN is for tesserad only: {root}");
    }
}

/// The check sees what it must: a two-module cycle in a crate written here, through a `use`
/// group, a `super::` path and an expression path, and none where the edges go one way.
#[test]
fn the_cycle_check_finds_a_cycle_and_no_false_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = dir.path();
    std::fs::write(src.join("lib.rs"), "mod a;\nmod b;\npub mod c;\nmod low;\n").expect("lib.rs");
    std::fs::write(
        src.join("a.rs"),
        "use crate::{low::X, b::{self, Y}};\n// crate::c::f()\nfn f() { let _ = \"crate::c::g\"; }\n",
    )
    .expect("a.rs");
    std::fs::write(src.join("b.rs"), "pub fn g() { super::a::f(); crate::low::h(); }\n")
        .expect("b.rs");
    std::fs::write(
        src.join("c.rs"),
        "mod inner { use super::super::low::X; }\n#[cfg(test)]\nmod tests { use super::*; }\n",
    )
    .expect("c.rs");
    std::fs::write(
        src.join("low.rs"),
        "pub struct X;\npub fn h() {}\nfn q(x: &'static str) -> char { 'c' }\n",
    )
    .expect("low.rs");
    let krate = read_crate(&src.join("lib.rs"));
    let cycles = sibling_cycles(&krate);
    let want: BTreeSet<String> = ["a", "b"].iter().map(|s| s.to_string()).collect();
    let edges = vec![("a".to_string(), "b".to_string()), ("b".to_string(), "a".to_string())];
    assert_eq!(cycles, vec![(Vec::<String>::new(), want, edges)], "{krate:?}");
    // The comment and the string in a.rs made no edge to c; c's inner module reaches low.
    let a = vec!["a".to_string()];
    assert!(!krate.refs.iter().any(|(from, to)| from == &a && to[0] == "c"), "{:?}", krate.refs);
    assert!(krate
        .refs
        .iter()
        .any(|(from, to)| from == &["c".to_string(), "inner".to_string()]
            && to == &["low".to_string()]));
}
