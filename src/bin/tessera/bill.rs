//! `tessera usage --verify` and `--export`: bills that prove themselves. A node's ledger is
//! checked by its daemon (its hash chain, and on a fleet node the coordinator's copy); a
//! fleet bill is fetched with everything it rests on and checked here, or read from a file
//! and checked offline ([`fleet::proof::verify_bill`]).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use ::fleet::client::blocking::block_on;
use ::fleet::proof::{BillCheck, BillExport};
use ::fleet::signing::VerifyingKey;

use crate::fleet::{explain, CoordinatorArgs};

/// `--node-key NODE=KEY` pins, checked.
pub fn node_keys(pins: &[String]) -> Result<BTreeMap<String, VerifyingKey>, String> {
    let mut out = BTreeMap::new();
    for p in pins {
        let (node, key) = p.split_once('=').ok_or_else(|| {
            format!("--node-key {}: expected NODE=KEY", tessera_api::untrusted(p).max_chars(200))
        })?;
        ::fleet::validate_node_id(node).map_err(|e| format!("--node-key: {e}"))?;
        let k = ::fleet::signing::load_verifying_key(key)
            .map_err(|e| format!("--node-key {node}: {e}"))?;
        out.insert(node.to_string(), k);
    }
    Ok(out)
}

/// The node's own ledger, checked by its daemon.
pub fn verify_node(socket: &Path, json: bool) -> Result<(), String> {
    let r: metering::ChainReport = tessera_api::Client::new(socket)
        .call::<(), _>("GET", "/v1/usage/verify", None)
        .map_err(|e| e.to_string())?;
    if json {
        println!("{}", serde_json::to_string_pretty(&r).map_err(|e| e.to_string())?);
    } else {
        print!("{}", render_chain(&r));
    }
    match r.problems.first() {
        None => Ok(()),
        Some(p) => Err(format!("the ledger does not verify: first at {p}")),
    }
}

fn render_chain(r: &metering::ChainReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "ledger {}: {} links for {} closed intervals ({} open), head seq {} sha256 {}",
        r.ledger_id, r.links, r.closed_rows, r.open_rows, r.head.seq, r.head.hash
    );
    if let Some(remote) = &r.remote {
        let _ = writeln!(out, "{remote}");
    }
    if r.problems.is_empty() {
        let _ = writeln!(out, "every link verifies");
    }
    for p in &r.problems {
        let _ = writeln!(out, "DOES NOT VERIFY: {p}");
    }
    out
}

/// The key a fleet bill's policy revision is checked against: `--trust-key`, else the one
/// the coordinator announces (said so: pin yours).
fn trust_key(args: &CoordinatorArgs, export: &BillExport) -> Result<(VerifyingKey, bool), String> {
    match &args.trust_key {
        Some(k) => ::fleet::signing::load_verifying_key(k)
            .map(|k| (k, true))
            .map_err(|e| format!("--trust-key: {e}")),
        None => ::fleet::signing::parse_verifying_key(
            &export.coordinator_key,
            "the export's coordinator key",
        )
        .map(|k| (k, false))
        .map_err(|e| e.to_string()),
    }
}

/// Fetch the fleet's bill for the window with its proofs.
pub fn fetch(
    args: &CoordinatorArgs,
    from_ms: u64,
    to_ms: u64,
    by: &str,
) -> Result<BillExport, String> {
    let by: metering::GroupBy = by.parse().map_err(|e: metering::LedgerError| e.to_string())?;
    block_on(args.client()?.usage_export(from_ms, to_ms, by, None)).map_err(explain)
}

/// Read a bill export from a file.
pub fn read(file: &Path) -> Result<BillExport, String> {
    let bytes = std::fs::read(file).map_err(|e| format!("{}: {e}", file.display()))?;
    serde_json::from_slice(&bytes)
        .map_err(|e| format!("{}: not a bill export: {e}", file.display()))
}

/// Check a bill and print what was checked; an error names the first thing that does not
/// verify.
pub fn verify(
    args: &CoordinatorArgs,
    export: &BillExport,
    pins: &[String],
    json: bool,
) -> Result<(), String> {
    let (key, pinned) = trust_key(args, export)?;
    let check = ::fleet::proof::verify_bill(export, &key, &node_keys(pins)?);
    if json {
        println!("{}", serde_json::to_string_pretty(&check).map_err(|e| e.to_string())?);
    } else {
        print!("{}", render_check(export, &check, pinned));
    }
    match check.problems.first() {
        None => Ok(()),
        Some(p) => Err(format!("the bill does not verify: {p}")),
    }
}

fn render_check(export: &BillExport, c: &BillCheck, trust_pinned: bool) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "bill from {} to {} (made {}), priced with policy version {}",
        tessera_api::time::format_utc(export.query.from_ms),
        tessera_api::time::format_utc(export.query.to_ms),
        tessera_api::time::format_utc(export.made_ms),
        c.policy_version.map_or_else(|| "none".to_string(), |v| v.to_string())
    );
    let _ = writeln!(
        out,
        "checked {} intervals in {} signed segments of {} nodes; total {:.6} GPU-seconds, cost {:.6}",
        c.intervals, c.segments, c.nodes, export.report.total.gpu_seconds, export.report.total.cost
    );
    if !trust_pinned {
        let _ = writeln!(
            out,
            "note: the policy revision was checked against the key the export names ({}); give --trust-key to check it against yours",
            export.coordinator_key
        );
    }
    if !c.unpinned_nodes.is_empty() {
        let _ = writeln!(
            out,
            "note: node keys taken from the export for {}; give --node-key NODE=KEY to check against yours",
            c.unpinned_nodes.join(", ")
        );
    }
    if c.problems.is_empty() {
        let _ = writeln!(out, "the bill verifies: every interval is signed by its node, every link recomputes, and the bill follows from them and the signed revision");
    }
    for p in &c.problems {
        let _ = writeln!(out, "DOES NOT VERIFY: {p}");
    }
    out
}

/// Write `export` to `file`: JSON (everything, checkable offline), or, for a `.csv` name,
/// the bill's CSV after `#` lines naming the policy revision and every chain head.
pub fn write(export: &BillExport, file: &Path) -> Result<(), String> {
    let text = if file.extension().is_some_and(|e| e.eq_ignore_ascii_case("csv")) {
        csv(export)
    } else {
        serde_json::to_string_pretty(export).map_err(|e| e.to_string())? + "\n"
    };
    std::fs::write(file, text).map_err(|e| format!("{}: {e}", file.display()))
}

/// The bill as CSV, after comment lines that say what it rests on.
pub fn csv(export: &BillExport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# {} from_ms={} to_ms={} made_ms={}",
        ::fleet::proof::EXPORT_FORMAT,
        export.query.from_ms,
        export.query.to_ms,
        export.made_ms
    );
    match &export.policy {
        Some(p) => {
            let _ = writeln!(
                out,
                "# policy version={} sha256={} signed_by_key={} coordinator_key={}",
                p.version, p.digest, p.key_id, export.coordinator_key
            );
        }
        None => {
            let _ = writeln!(out, "# policy none (nothing priced)");
        }
    }
    for n in &export.nodes {
        for h in &n.heads {
            let _ = writeln!(
                out,
                "# chain node={} ledger={} head_seq={} head_sha256={} node_key={}",
                n.node,
                h.ledger_id,
                h.seq,
                h.hash,
                n.public_key.as_deref().unwrap_or("none")
            );
        }
    }
    out.push_str(&export.report.to_csv());
    out
}
