//! `tessera policy diff A B`: a unified line diff of two policies, pretty-printed with
//! sorted keys first so that formatting and key order never show up as changes.

use std::fmt::Write as _;

/// Lines of context around each change.
const CONTEXT: usize = 3;

/// Largest table the LCS may build (lines a x lines b); beyond it the diff degrades to
/// "everything removed, everything added".
const MAX_CELLS: usize = 16_000_000;

/// A unified diff (`---`/`+++`/`@@` hunks, 3 lines of context) of two policy documents.
/// JSON input is pretty-printed with sorted keys first; anything else is diffed as
/// text. Returns an empty string when the two are the same.
pub fn diff_policies(a: &str, b: &str) -> String {
    diff_labeled("a", a, "b", b)
}

/// [`diff_policies`] with names for the two sides (e.g. `version 3`, `version 4`).
pub fn diff_labeled(a_label: &str, a: &str, b_label: &str, b: &str) -> String {
    let (a, b) = (normalize(a), normalize(b));
    let (al, bl): (Vec<&str>, Vec<&str>) = (a.lines().collect(), b.lines().collect());
    let ops = line_ops(&al, &bl);
    if ops.iter().all(|o| matches!(o, Op::Same(..))) {
        return String::new();
    }
    let mut out = format!("--- {a_label}\n+++ {b_label}\n");
    for hunk in hunks(&ops) {
        let ops = &ops[hunk.0..hunk.1];
        let a_start = ops.iter().find_map(|o| o.a_index()).unwrap_or(0);
        let b_start = ops.iter().find_map(|o| o.b_index()).unwrap_or(0);
        let a_len = ops.iter().filter(|o| o.a_index().is_some()).count();
        let b_len = ops.iter().filter(|o| o.b_index().is_some()).count();
        let _ = writeln!(out, "@@ -{},{a_len} +{},{b_len} @@", a_start + 1, b_start + 1);
        for o in ops {
            let _ = match *o {
                Op::Same(i, _) => writeln!(out, " {}", al[i]),
                Op::Del(i) => writeln!(out, "-{}", al[i]),
                Op::Add(j) => writeln!(out, "+{}", bl[j]),
            };
        }
    }
    out
}

fn sorted(v: serde_json::Value) -> serde_json::Value {
    match v {
        serde_json::Value::Object(m) => {
            let mut entries: Vec<(String, serde_json::Value)> = m.into_iter().collect();
            entries.sort_by(|x, y| x.0.cmp(&y.0));
            serde_json::Value::Object(entries.into_iter().map(|(k, v)| (k, sorted(v))).collect())
        }
        serde_json::Value::Array(a) => {
            serde_json::Value::Array(a.into_iter().map(sorted).collect())
        }
        other => other,
    }
}

fn normalize(text: &str) -> String {
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(v) => serde_json::to_string_pretty(&sorted(v)).unwrap_or_else(|_| text.to_string()),
        Err(_) => text.to_string(),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Same(usize, usize),
    Del(usize),
    Add(usize),
}

impl Op {
    fn a_index(&self) -> Option<usize> {
        match *self {
            Op::Same(i, _) | Op::Del(i) => Some(i),
            Op::Add(_) => None,
        }
    }
    fn b_index(&self) -> Option<usize> {
        match *self {
            Op::Same(_, j) | Op::Add(j) => Some(j),
            Op::Del(_) => None,
        }
    }
}

/// Longest-common-subsequence edit script, common prefix and suffix trimmed first.
fn line_ops(a: &[&str], b: &[&str]) -> Vec<Op> {
    let prefix = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let suffix =
        a[prefix..].iter().rev().zip(b[prefix..].iter().rev()).take_while(|(x, y)| x == y).count();
    let (am, bm) = (&a[prefix..a.len() - suffix], &b[prefix..b.len() - suffix]);
    let mut ops: Vec<Op> = (0..prefix).map(|i| Op::Same(i, i)).collect();
    let (n, m) = (am.len(), bm.len());
    if n.saturating_mul(m) > MAX_CELLS {
        ops.extend((0..n).map(|i| Op::Del(prefix + i)));
        ops.extend((0..m).map(|j| Op::Add(prefix + j)));
    } else {
        // lcs[i][j]: LCS length of am[i..] and bm[j..].
        let w = m + 1;
        let mut lcs = vec![0u32; (n + 1) * w];
        for i in (0..n).rev() {
            for j in (0..m).rev() {
                lcs[i * w + j] = if am[i] == bm[j] {
                    lcs[(i + 1) * w + j + 1] + 1
                } else {
                    lcs[(i + 1) * w + j].max(lcs[i * w + j + 1])
                };
            }
        }
        let (mut i, mut j) = (0, 0);
        while i < n || j < m {
            if i < n && j < m && am[i] == bm[j] {
                ops.push(Op::Same(prefix + i, prefix + j));
                i += 1;
                j += 1;
            } else if i < n && (j == m || lcs[(i + 1) * w + j] >= lcs[i * w + j + 1]) {
                ops.push(Op::Del(prefix + i));
                i += 1;
            } else {
                ops.push(Op::Add(prefix + j));
                j += 1;
            }
        }
    }
    let (a_off, b_off) = (a.len() - suffix, b.len() - suffix);
    ops.extend((0..suffix).map(|k| Op::Same(a_off + k, b_off + k)));
    ops
}

/// Ranges of `ops` to print: each change with up to CONTEXT unchanged lines around it,
/// overlapping ranges merged.
fn hunks(ops: &[Op]) -> Vec<(usize, usize)> {
    let mut out: Vec<(usize, usize)> = Vec::new();
    for (k, o) in ops.iter().enumerate() {
        if matches!(o, Op::Same(..)) {
            continue;
        }
        let (s, e) = (k.saturating_sub(CONTEXT), (k + CONTEXT + 1).min(ops.len()));
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identical_documents_have_no_diff() {
        assert_eq!(diff_policies(r#"{"b":1,"a":2}"#, "{\n \"a\": 2, \"b\": 1}"), "");
    }

    #[test]
    fn shows_changed_lines_with_context() {
        let a =
            r#"{"version": 1, "orgs": {"acme": {"trust": "untrusted"}, "beta": {"trust": "dev"}}}"#;
        let b =
            r#"{"version": 2, "orgs": {"acme": {"trust": "trusted"}, "beta": {"trust": "dev"}}}"#;
        let d = diff_labeled("version 1", a, "version 2", b);
        assert!(d.starts_with("--- version 1\n+++ version 2\n@@ "), "{d}");
        assert!(
            d.contains("-      \"trust\": \"untrusted\"\n+      \"trust\": \"trusted\"\n"),
            "{d}"
        );
        assert!(d.contains("-  \"version\": 1\n+  \"version\": 2\n"), "{d}");
        assert!(d.contains("   \"orgs\": {\n"), "context lines start with a space: {d}");
    }

    #[test]
    fn far_apart_changes_make_separate_hunks() {
        let a: String = (0..30).map(|i| format!("line {i}\n")).collect();
        let b = a.replace("line 2\n", "line two\n").replace("line 25\n", "");
        let d = diff_policies(&a, &b);
        assert_eq!(d.matches("@@ ").count(), 2, "{d}");
        assert!(d.contains("@@ -1,6 +1,6 @@\n"), "{d}");
        assert!(d.contains("-line 25\n"), "{d}");
        assert!(!d.contains("line 12"), "{d}");
    }

    #[test]
    fn additions_and_removals_at_the_ends() {
        let d = diff_policies("a\nb\n", "a\nb\nc\n");
        assert!(d.ends_with(" a\n b\n+c\n"), "{d}");
        let d = diff_policies("x\na\n", "a\n");
        assert!(d.contains("-x\n a\n"), "{d}");
    }
}
