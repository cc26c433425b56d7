//! `tessera quota status|events`: the fleet coordinator's quota books for the operator.
//! The work is in `fleet::client`; this file parses and prints.

use std::path::PathBuf;

use ::fleet::client::blocking::block_on;
use ::fleet::quota_wire::{NodeRemoval, PathStatus, QuotaEvent, QuotaStatus};
use clap::{Args, Subcommand};

use crate::fleet::{ago, explain, render_authority, table, CoordinatorArgs};

// The units the wire names (`PathStatus::unit`): micro-GPUs, millicores, MiB.
const MICRO_PER_GPU: u64 = 1_000_000;
const MILLI_PER_CORE: u64 = 1_000;
const MIB_PER_GIB: u64 = 1_024;

/// Where the coordinator is, and the admin credential (`--token`, or `--token-file`).
#[derive(Debug, Clone, Args)]
pub struct QuotaArgs {
    #[command(flatten)]
    pub fleet: CoordinatorArgs,
    /// Read the admin token from this file (instead of --token / TESSERA_TOKEN, which
    /// shows in the process list).
    #[arg(long, conflicts_with = "token")]
    pub token_file: Option<PathBuf>,
    /// Print the coordinator's JSON.
    #[arg(long)]
    pub json: bool,
}

/// Fleet quotas on the coordinator.
#[derive(Debug, Subcommand)]
pub enum QuotaCmd {
    /// Every quota path and resource: guarantee, ceiling, in use, borrowed, lent, leased,
    /// waiting, dominant share; the nodes' last syncs; reclaims in progress.
    Status(QuotaArgs),
    /// Recent borrows, reclaims, preemptions (with the reason), refusals, nodes removed
    /// and gangs, oldest first.
    Events(QuotaArgs),
    /// Take a node out of the quota books at once (a dead node, before its lease runs out):
    /// its holdings, admissions not yet listed and leases are no longer counted. A node
    /// that is alive comes back at its next sync.
    NodeRemove {
        /// The node's id.
        node: String,
        #[command(flatten)]
        args: QuotaArgs,
    },
}

impl QuotaArgs {
    fn client(&self) -> Result<::fleet::client::Client, String> {
        let mut fleet = self.fleet.clone();
        if let Some(f) = &self.token_file {
            let text = std::fs::read_to_string(f)
                .map_err(|e| format!("--token-file {}: {e}", f.display()))?;
            let token = text.trim();
            if token.is_empty() {
                return Err(format!("--token-file {}: the file is empty", f.display()));
            }
            fleet.token = Some(token.to_string());
        }
        fleet.client()
    }
}

pub fn run(cmd: QuotaCmd) -> Result<(), String> {
    match cmd {
        QuotaCmd::Status(args) => {
            let st = block_on(args.client()?.quota_status()).map_err(explain)?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&st).map_err(|e| e.to_string())?);
            } else {
                print!("{}", render_status(&st, tessera_api::time::now_ms()));
            }
            Ok(())
        }
        QuotaCmd::Events(args) => {
            let ev = block_on(args.client()?.quota_events()).map_err(explain)?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&ev).map_err(|e| e.to_string())?);
            } else {
                print!("{}", render_events(&ev));
            }
            Ok(())
        }
        QuotaCmd::NodeRemove { node, args } => {
            let r = block_on(args.client()?.quota_remove_node(&node)).map_err(explain)?;
            if args.json {
                println!("{}", serde_json::to_string_pretty(&r).map_err(|e| e.to_string())?);
            } else {
                print!("{}", render_removal(&r, tessera_api::time::now_ms()));
            }
            Ok(())
        }
    }
}

/// `tessera quota node-remove`.
pub fn render_removal(r: &NodeRemoval, now_ms: u64) -> String {
    let mut held: Vec<String> = r
        .held
        .gpus
        .iter()
        .map(|(m, n)| format!("{} {m} GPUs", two_places(*n, MICRO_PER_GPU)))
        .collect();
    if r.held.cpu_milli > 0 {
        held.push(format!("{} CPU cores", two_places(r.held.cpu_milli, MILLI_PER_CORE)));
    }
    if r.held.memory_mib > 0 {
        held.push(format!("{} GiB", two_places(r.held.memory_mib, MIB_PER_GIB)));
    }
    let mut out = format!(
        "node {} left the quota books (last sync {}): {} holding(s) ({}), {} admission(s) not yet listed{}\n",
        r.node,
        ago(now_ms, r.last_sync_ms),
        r.holdings,
        if held.is_empty() { "nothing".to_string() } else { held.join(", ") },
        r.pending,
        if r.leases.is_empty() {
            String::new()
        } else {
            format!(", leases of {}", r.leases.join(", "))
        }
    );
    if let Some(w) = &r.warning {
        out.push_str(&format!("warning: {w}\n"));
    }
    out
}

/// `value / per` with up to 2 decimals, trailing zeros dropped.
fn two_places(value: u64, per: u64) -> String {
    let hundredths = (u128::from(value) * 100 / u128::from(per.max(1))) as u64;
    let (whole, frac) = (hundredths / 100, hundredths % 100);
    match frac {
        0 => whole.to_string(),
        f if f % 10 == 0 => format!("{whole}.{}", f / 10),
        f => format!("{whole}.{f:02}"),
    }
}

/// An amount in the resource's unit for people: GPUs, cores, GiB.
fn amount(p: &PathStatus, v: u64) -> String {
    let per = match p.unit.as_str() {
        "micro-GPU" => MICRO_PER_GPU,
        "millicore" => MILLI_PER_CORE,
        _ => MIB_PER_GIB,
    };
    two_places(v, per)
}

/// `gpus.H100-80GB` → `H100-80GB GPUs`, `cpu_cores` → `CPU cores`, `memory_gib` → `GiB`.
fn resource_name(resource: &str) -> String {
    match resource.strip_prefix("gpus.") {
        Some(model) => format!("{model} GPUs"),
        None if resource == "cpu_cores" => "CPU cores".into(),
        None => "memory GiB".into(),
    }
}

/// `tessera quota status`: the tree (children indented under parents), then the nodes and
/// the reclaims in progress.
pub fn render_status(st: &QuotaStatus, now_ms: u64) -> String {
    let mut out = format!(
        "quotas of policy version {}; books {}\n",
        st.policy_version,
        if st.books_ready {
            "ready"
        } else {
            "REBUILDING (not every known node has synced since the coordinator started; nodes admit within their leases)"
        }
    );
    let mut cap: Vec<String> = st
        .capacity
        .gpus
        .iter()
        .map(|(m, n)| format!("{} {m} GPUs", two_places(*n, MICRO_PER_GPU)))
        .collect();
    if st.capacity.cpu_milli > 0 {
        cap.push(format!("{} CPU cores", two_places(st.capacity.cpu_milli, MILLI_PER_CORE)));
    }
    if st.capacity.memory_mib > 0 {
        cap.push(format!("{} GiB", two_places(st.capacity.memory_mib, MIB_PER_GIB)));
    }
    out.push_str(&render_authority(st, now_ms));
    out.push_str(&format!(
        "fleet capacity: {}\n",
        if cap.is_empty() { "none reported".to_string() } else { cap.join(", ") }
    ));
    // What the policy validator says of the guarantees on these nodes.
    for f in &st.shape {
        let head = if f.cannot { "cannot honour" } else { "shape warning" };
        out.push_str(&format!(
            "{head} ({}): {}\n",
            tessera_api::untrusted(&f.resource),
            tessera_api::untrusted(&f.message).max_chars(tessera_api::display::MAX_LINE_CHARS)
        ));
    }
    out.push('\n');
    if st.paths.is_empty() {
        out.push_str("no quotas in the policy in force\n");
    } else {
        let mut rows = vec![[
            "QUOTA PATH",
            "RESOURCE",
            "GUARANTEE",
            "CEILING",
            "IN USE",
            "BORROWED",
            "LENT",
            "LEASED",
            "WAITING",
            "DOMINANT SHARE",
        ]
        .map(String::from)
        .to_vec()];
        let mut last = "";
        for p in &st.paths {
            let depth = p.path.matches('/').count();
            let name = if p.path == last {
                String::new()
            } else {
                format!("{}{}", "  ".repeat(depth), p.path)
            };
            last = &p.path;
            rows.push(vec![
                name,
                resource_name(&p.resource),
                p.guarantee.map_or_else(|| "-".into(), |g| amount(p, g)),
                p.ceiling.map_or_else(|| "-".into(), |c| amount(p, c)),
                amount(p, p.in_use),
                amount(p, p.borrowed),
                amount(p, p.lent),
                amount(p, p.leased),
                amount(p, p.waiting),
                format!("{:.2}", p.dominant_share),
            ]);
        }
        out.push_str(&table(&rows));
        out.push_str(&render_preemption(st));
    }
    out.push('\n');
    if st.nodes.is_empty() {
        out.push_str("no node has synced since the coordinator started\n");
    } else {
        let mut rows = vec![["NODE", "LAST SYNC"].map(String::from).to_vec()];
        for (n, t) in &st.nodes {
            rows.push(vec![n.clone(), ago(now_ms, *t)]);
        }
        out.push_str(&table(&rows));
    }
    if !st.preempting.is_empty() {
        out.push_str("\nreclaims in progress (containers being stopped)\n");
        let mut rows =
            vec![["NODE", "CONTAINER", "TENANT", "GRACE", "WHY"].map(String::from).to_vec()];
        for v in &st.preempting {
            rows.push(vec![
                v.node.clone(),
                v.container_id.clone(),
                v.tenant.clone(),
                format!("{} s", v.grace_s),
                v.reason.replace('\n', " "),
            ]);
        }
        out.push_str(&table(&rows));
    }
    out
}

/// Seconds from ms, for people: `0.5 s`, `42 s`, `1 h 3 min`.
fn wait(ms: Option<u64>) -> String {
    match ms {
        None => "-".into(),
        Some(ms) if ms < 10_000 => format!("{} s", two_places(ms, 1000)),
        Some(ms) if ms < 3_600_000 => format!("{} s", ms / 1000),
        Some(ms) => format!("{} h {} min", ms / 3_600_000, ms % 3_600_000 / 60_000),
    }
}

/// What preemption costs each path and how long its owed requests waited, then why its
/// requests wait.
fn render_preemption(st: &QuotaStatus) -> String {
    let mut out = String::from(
        "\npreemption (work lost: the resource × the seconds its victims had run, the grace \
         period for work that checkpoints; owner wait: owed requests, first ask to admission; \
         owed later: requests owed only once their tenant's requests ahead were served, from \
         when a reclaim first found them owed to admission)\n",
    );
    let mut rows = vec![[
        "QUOTA PATH",
        "RESOURCE",
        "WORK LOST (×h)",
        "PREEMPTIONS LAST HOUR",
        "OWNER WAIT P50",
        "OWNER WAIT P99",
        "OWED LATER P50",
        "OWED LATER P99",
    ]
    .map(String::from)
    .to_vec()];
    for p in &st.paths {
        rows.push(vec![
            p.path.clone(),
            resource_name(&p.resource),
            amount(p, p.lost / 3600),
            p.preemptions_last_hour.to_string(),
            wait(p.owner_wait_p50_ms),
            wait(p.owner_wait_p99_ms),
            wait(p.owed_later_wait_p50_ms),
            wait(p.owed_later_wait_p99_ms),
        ]);
    }
    out.push_str(&table(&rows));
    let waiting: Vec<&PathStatus> = st.paths.iter().filter(|p| !p.waiting_why.is_empty()).collect();
    if !waiting.is_empty() {
        out.push_str("\nwhy work waits\n");
        let mut seen: Vec<&str> = Vec::new();
        for p in waiting {
            if seen.contains(&p.path.as_str()) {
                continue;
            }
            seen.push(&p.path);
            for why in &p.waiting_why {
                out.push_str(&format!("  {}: {}\n", p.path, why.replace('\n', " ")));
            }
        }
    }
    out
}

/// `tessera quota events`.
pub fn render_events(ev: &[QuotaEvent]) -> String {
    if ev.is_empty() {
        return "no quota events since the coordinator started\n".into();
    }
    let mut rows = vec![["TIME (UTC)", "KIND", "TENANT", "NODE", "CONTAINER", "REASON"]
        .map(String::from)
        .to_vec()];
    for e in ev {
        rows.push(vec![
            tessera_api::time::format_utc(e.ts_ms),
            e.kind.as_str().to_string(),
            e.tenant.clone().unwrap_or_else(|| "-".into()),
            e.node.clone().unwrap_or_else(|| "-".into()),
            e.container_id.clone().unwrap_or_else(|| "-".into()),
            e.reason.replace('\n', " "),
        ]);
    }
    table(&rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(path: &str, resource: &str, unit: &str, g: Option<u64>, in_use: u64) -> PathStatus {
        PathStatus {
            path: path.into(),
            resource: resource.into(),
            unit: unit.into(),
            guarantee: g,
            ceiling: None,
            in_use,
            borrowed: 0,
            lent: 0,
            leased: 0,
            waiting: 0,
            dominant_share: 0.125,
            lost: 0,
            preemptions_last_hour: 0,
            owner_wait_p50_ms: None,
            owner_wait_p99_ms: None,
            owed_later_wait_p50_ms: None,
            owed_later_wait_p99_ms: None,
            waiting_why: vec![],
        }
    }

    #[test]
    fn amounts_show_in_gpus_cores_and_gib_with_two_decimals() {
        assert_eq!(two_places(1_500_000, 1_000_000), "1.5");
        assert_eq!(two_places(142_857, 1_000_000), "0.14");
        assert_eq!(two_places(4_000_000, 1_000_000), "4");
        assert_eq!(two_places(2_250, 1_000), "2.25");
        assert_eq!(two_places(1_536, 1_024), "1.5");
    }

    #[test]
    fn status_is_a_tree_with_nodes_and_reclaims() {
        let st = QuotaStatus {
            policy_version: 4,
            capacity: ::fleet::quota_wire::Amounts {
                gpus: [("H100-80GB".to_string(), 16_000_000)].into(),
                ..Default::default()
            },
            paths: vec![
                row("acme", "gpus.H100-80GB", "micro-GPU", Some(8_000_000), 2_500_000),
                PathStatus {
                    lost: 2 * 3600 * 1_500_000,
                    preemptions_last_hour: 4,
                    owner_wait_p50_ms: Some(1_200),
                    owner_wait_p99_ms: Some(33_000),
                    owed_later_wait_p50_ms: Some(95_000),
                    owed_later_wait_p99_ms: Some(7_500_000),
                    waiting_why: vec!["no capacity on node n1 for 1 H100-80GB GPUs".into()],
                    ..row("acme/ml", "gpus.H100-80GB", "micro-GPU", None, 1_000_000)
                },
                row("acme/ml", "cpu_cores", "millicore", Some(64_000), 1_500),
            ],
            books_ready: false,
            nodes: [("n1".to_string(), 90_000)].into(),
            preempting: vec![::fleet::quota_wire::Victim {
                node: "n1".into(),
                container_id: "c7".into(),
                tenant: "acme/b".into(),
                grace_s: 30,
                reason: "reclaimed for acme/a".into(),
                requeue: String::new(),
            }],
            authority: None,
            coordinators: vec![],
            via: None,
            warnings: vec![],
            shape: vec![::fleet::quota_wire::ShapeFinding {
                paths: vec!["acme".into()],
                resource: "gpus.H100-80GB".into(),
                cannot: false,
                kind: ::fleet::quota_wire::ShapeKind::NoHeadroom {
                    guaranteed: 16_000_000,
                    capacity: 16_000_000,
                },
                message: "the guarantees take all 16 H100-80GB GPUs of the fleet\u{1b}[2J".into(),
            }, ::fleet::quota_wire::ShapeFinding {
                paths: vec!["acme/a".into()],
                resource: "gpus.H100-80GB\n".into(),
                cannot: true,
                kind: ::fleet::quota_wire::ShapeKind::NoNode { anchor: 6, largest_node: 8, searched: true },
                message: "no layout of the guarantees on these nodes keeps one node free enough for the largest pod within the guarantee of acme/a (a pod of 6 GPUs)".into(),
            }],
        };
        let text = render_status(&st, 100_000);
        // The validator's word on the fleet's shape: acme's 16 take every GPU.
        assert!(
            text.contains("fleet capacity: 16 H100-80GB GPUs\nshape warning (gpus.H100-80GB): the guarantees take all 16 H100-80GB GPUs of the fleet\\u{1b}[2J\n"),
            "{text}"
        );
        // A promise this fleet cannot keep is said as such, every field escaped.
        assert!(
            text.contains("\ncannot honour (gpus.H100-80GB\\n): no layout of the guarantees on these nodes keeps one node free enough for the largest pod within the guarantee of acme/a (a pod of 6 GPUs)\n"),
            "{text}"
        );
        assert!(text.starts_with("quotas of policy version 4; books REBUILDING"), "{text}");
        assert!(text.contains("fleet capacity: 16 H100-80GB GPUs\n"), "{text}");
        let lines: Vec<&str> = text.lines().collect();
        let acme = lines.iter().find(|l| l.starts_with("acme ")).expect("acme row");
        assert!(
            acme.contains("H100-80GB GPUs") && acme.contains(" 8 ") && acme.contains(" 2.5 "),
            "{acme}"
        );
        assert!(lines.iter().any(|l| l.starts_with("  acme/ml ")), "{text}");
        let cpu = lines.iter().find(|l| l.contains("CPU cores")).expect("cpu row");
        assert!(
            cpu.trim_start().starts_with("CPU cores")
                && cpu.contains(" 64 ")
                && cpu.contains(" 1.5 "),
            "{cpu}"
        );
        assert!(text.contains("n1    10s ago"), "{text}");
        // What preemption cost acme/ml: 3 GPU-hours lost, 4 preemptions in the last hour,
        // owner waits of 1.2 s and 33 s, owed-later waits of 95 s and 2 h 5 min; and why
        // its work waits.
        let ml = lines
            .iter()
            .find(|l| l.starts_with("acme/ml ") && l.contains(" 3 "))
            .unwrap_or_else(|| panic!("no preemption row for acme/ml in {text}"));
        assert!(ml.contains(" 4 ") && ml.contains("1.2 s") && ml.contains("33 s"), "{ml}");
        assert!(ml.contains(" 95 s ") && ml.ends_with("2 h 5 min"), "{ml}");
        assert!(
            text.contains("why work waits\n  acme/ml: no capacity on node n1 for 1 H100-80GB GPUs"),
            "{text}"
        );
        assert!(
            text.contains("reclaims in progress") && text.contains("c7") && text.contains("30 s"),
            "{text}"
        );
    }
}
