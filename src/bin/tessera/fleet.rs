//! The fleet coordinator's side of the command line: policy push, history and diff,
//! nodes, fleet-wide usage. The work is in `fleet::client` (the fleet crate); this file parses and
//! prints.

use std::fmt::Write as _;

use ::fleet::client::blocking::block_on;
use ::fleet::client::{Client, ClientError};
use ::fleet::{FleetUsage, FleetUsageRequest, NodeRecord, RevisionSummary};
use clap::{Args, Subcommand};

/// Where the coordinator is and who is asking.
#[derive(Debug, Clone, Args)]
pub struct CoordinatorArgs {
    /// The coordinator's URL, e.g. http://127.0.0.1:7400 (several: comma-separated, tried in order).
    #[arg(long, env = "TESSERA_COORDINATOR")]
    pub coordinator: Option<String>,
    /// The bearer token (an admin token for push, history, nodes and usage).
    #[arg(long, env = "TESSERA_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// For an https:// coordinator: the CA certificate (PEM) that signed its certificate.
    #[arg(long, env = "TESSERA_COORDINATOR_CA")]
    pub coordinator_ca: Option<std::path::PathBuf>,
    /// Verify revisions (policy diff) against this public key (hex, base64 or a file)
    /// instead of the key the coordinator announces at /v1/health.
    #[arg(long, env = "TESSERA_TRUST_KEY")]
    pub trust_key: Option<String>,
}

impl CoordinatorArgs {
    fn need(&self) -> Result<(&str, &str), String> {
        let url = self
            .coordinator
            .as_deref()
            .filter(|u| !u.trim().is_empty())
            .ok_or("no coordinator: give --coordinator URL or set TESSERA_COORDINATOR")?;
        let token = self
            .token
            .as_deref()
            .filter(|t| !t.trim().is_empty())
            .ok_or("no credential: give --token TOKEN or set TESSERA_TOKEN (an admin token of the coordinator)")?;
        Ok((url, token.trim()))
    }

    /// A client of the coordinator(s), verifying https:// ones against `--coordinator-ca`.
    pub(crate) fn client(&self) -> Result<Client, String> {
        let (url, token) = self.need()?;
        let tls = match &self.coordinator_ca {
            Some(ca) => Some(
                ::fleet::tls::client_config(ca).map_err(|e| format!("--coordinator-ca: {e}"))?,
            ),
            None => None,
        };
        Ok(Client::new(&[url], token).map_err(explain)?.with_tls(tls))
    }

    /// The key revisions are verified against: `--trust-key`, else the coordinator's own.
    fn key(&self, client: &Client) -> Result<::fleet::signing::VerifyingKey, String> {
        match &self.trust_key {
            Some(k) => {
                ::fleet::signing::load_verifying_key(k).map_err(|e| format!("--trust-key: {e}"))
            }
            None => block_on(client.announced_key()).map_err(explain),
        }
    }
}

/// Policy commands that talk to the coordinator.
#[derive(Debug, Subcommand)]
pub enum PolicyFleetCmd {
    /// Push a policy: validated, versioned, signed, and sent to every node. Its
    /// "version" must be greater than the latest pushed one.
    Push {
        file: std::path::PathBuf,
        /// Who is pushing, recorded next to the admin credential's name.
        #[arg(long)]
        author: Option<String>,
        /// Print the stored revision as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        fleet: CoordinatorArgs,
    },
    /// Every stored policy version, newest first.
    History {
        /// Print JSON (oldest first, as the coordinator answers).
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        fleet: CoordinatorArgs,
    },
    /// What changed between two stored versions (a unified diff).
    Diff {
        a: u64,
        b: u64,
        #[command(flatten)]
        fleet: CoordinatorArgs,
    },
}

/// Say what a coordinator error means for the person at the terminal.
pub(crate) fn explain(e: ClientError) -> String {
    match e.status() {
        Some(401) => format!("{e} (the token is not known to the coordinator)"),
        Some(403) => format!("{e} (this needs an admin token)"),
        _ => e.to_string(),
    }
}

pub fn policy(cmd: PolicyFleetCmd) -> Result<(), String> {
    match cmd {
        PolicyFleetCmd::Push { file, author, json, fleet } => {
            let client = fleet.client()?;
            let bytes = std::fs::read(&file).map_err(|e| format!("{}: {e}", file.display()))?;
            // Check here first: errors name the file and the JSON path, and nothing is sent.
            let parsed = policy::Policy::parse(&bytes, &file.display().to_string())
                .map_err(|e| e.to_string())?;
            let rev = block_on(client.push_policy(&bytes, author.as_deref())).map_err(explain)?;
            if rev.digest != parsed.digest() {
                return Err(format!(
                    "the coordinator stored digest {} for version {}, not this file's {}",
                    rev.digest,
                    rev.version,
                    parsed.digest()
                ));
            }
            if json {
                println!("{}", serde_json::to_string_pretty(&rev).map_err(|e| e.to_string())?);
            } else {
                println!(
                    "pushed policy version {} (sha256 {}, signed by key {}, author {}); nodes pick it up now",
                    rev.version,
                    short(&rev.digest),
                    rev.key_id,
                    rev.author
                );
            }
            Ok(())
        }
        PolicyFleetCmd::History { json, fleet } => {
            let revs = block_on(fleet.client()?.history()).map_err(explain)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&revs).map_err(|e| e.to_string())?);
            } else {
                print!("{}", render_history(&revs));
            }
            Ok(())
        }
        PolicyFleetCmd::Diff { a, b, fleet } => {
            let client = fleet.client()?;
            let key = fleet.key(&client)?;
            let diff = block_on(client.diff(a, b, &key)).map_err(explain)?;
            if diff.is_empty() {
                println!("versions {a} and {b} are identical");
            } else {
                print!("{diff}");
                if !diff.ends_with('\n') {
                    println!();
                }
            }
            Ok(())
        }
    }
}

/// `tessera nodes`.
#[derive(Debug, Clone, clap::Args)]
pub struct NodesArgs {
    #[command(flatten)]
    pub fleet: CoordinatorArgs,
    /// Print the coordinator's JSON.
    #[arg(long)]
    pub json: bool,
    #[command(subcommand)]
    pub cmd: Option<NodesCmd>,
}

/// What `tessera nodes` can do besides listing.
#[derive(Debug, Clone, Subcommand)]
pub enum NodesCmd {
    /// Pin a node's public key at the coordinator (what signs its usage uploads; the node
    /// prints it at start and `tessera status` shows it). Uploads signed by any other key
    /// are refused.
    RegisterKey {
        node: String,
        /// The node's ed25519 public key: 64 hex digits, base64, or a file holding it.
        key: String,
        /// Replace a different key already pinned (a lost or rotated node key).
        #[arg(long)]
        replace: bool,
        #[command(flatten)]
        fleet: CoordinatorArgs,
    },
}

pub fn nodes(args: &NodesArgs) -> Result<(), String> {
    if let Some(NodesCmd::RegisterKey { node, key, replace, fleet }) = &args.cmd {
        let fleet = if fleet.coordinator.is_some() { fleet } else { &args.fleet };
        let key = ::fleet::signing::load_verifying_key(key).map_err(|e| e.to_string())?;
        let hex = ::fleet::signing::encode_verifying_key(&key);
        let rec =
            block_on(fleet.client()?.register_node_key(node, &hex, *replace)).map_err(explain)?;
        println!(
            "node {} key {} pinned (by {}): the coordinator stores usage from {} only if this key signed it",
            rec.node, rec.key_id, rec.registered_by, rec.node
        );
        return Ok(());
    }
    let client = args.fleet.client()?;
    let nodes = block_on(client.nodes()).map_err(explain)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&nodes).map_err(|e| e.to_string())?);
    } else {
        // The quota books' view (who decides, each node's last sync), when there are any.
        // Without quotas in force nodes do not sync: nothing to show.
        let quota = block_on(client.quota_status()).ok().filter(|q| !q.paths.is_empty());
        let now = tessera_api::time::now_ms();
        print!("{}", render_nodes(&nodes, quota.as_ref(), now));
    }
    Ok(())
}

pub fn usage(
    args: &CoordinatorArgs,
    from_ms: u64,
    to_ms: u64,
    by: &str,
    json: bool,
    csv: bool,
) -> Result<(), String> {
    let client = args.client()?;
    let by: metering::GroupBy = by.parse().map_err(|e: metering::LedgerError| e.to_string())?;
    // Priced by the coordinator with the newest revision that verifies against its signing
    // key (the policy nodes enforce), as each node prices with the policy in force.
    let req = FleetUsageRequest {
        query: metering::UsageQuery::new(from_ms, to_ms, by, metering::Prices::default()),
        nodes: None,
        price_with_policy: true,
    };
    let fleet = block_on(client.usage_query(&req)).map_err(explain)?;
    for s in &fleet.skipped {
        eprintln!("tessera: not priced with policy {s}");
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&fleet).map_err(|e| e.to_string())?);
    } else if csv {
        print!("{}", fleet.report.to_csv());
    } else {
        print!("{}", render_fleet_usage(&fleet));
    }
    Ok(())
}

fn short(digest: &str) -> &str {
    &digest[..digest.len().min(12)]
}

/// Columns padded to their widest cell (the last one is left ragged).
pub(crate) fn table(rows: &[Vec<String>]) -> String {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|c| rows.iter().filter_map(|r| r.get(c)).map(|s| s.chars().count()).max().unwrap_or(0))
        .collect();
    let mut out = String::new();
    for r in rows {
        let mut line = String::new();
        for (c, cell) in r.iter().enumerate() {
            if c + 1 == r.len() {
                line.push_str(cell);
            } else {
                let _ = write!(line, "{cell:<w$}  ", w = widths[c]);
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// `tessera nodes`: node, applied version, where it came from, health, last contact, last
/// quota sync, problem; then, when there are quota books, who decides them.
pub fn render_nodes(
    nodes: &[NodeRecord],
    quota: Option<&::fleet::quota_wire::QuotaStatus>,
    now_ms: u64,
) -> String {
    if nodes.is_empty() {
        return "no nodes: the coordinator's tokens file names none and none has reported\n".into();
    }
    let mut header = String::new();
    if let Some(q) = quota {
        header = render_authority(q, now_ms);
    }
    let mut rows =
        vec![["NODE", "VERSION", "SOURCE", "HEALTH", "LAST CONTACT", "QUOTA SYNC", "PROBLEM"]
            .map(String::from)
            .to_vec()];
    for n in nodes {
        let version = n.applied_version.map_or_else(|| "-".to_string(), |v| v.to_string());
        let contact = n.last_contact_ms.map_or_else(|| "never".to_string(), |t| ago(now_ms, t));
        let health = if n.stale && n.last_contact_ms.is_some() {
            format!("{} (stale)", n.health)
        } else {
            n.health.clone()
        };
        let problem = n
            .last_rejection
            .as_deref()
            .or(n.last_error.as_deref())
            .unwrap_or("")
            .replace('\n', " ");
        let synced = match quota {
            None => "-".to_string(),
            Some(q) => {
                q.nodes.get(&n.node).map_or_else(|| "not in the books".into(), |t| ago(now_ms, *t))
            }
        };
        rows.push(vec![
            n.node.clone(),
            version,
            n.source.clone(),
            health,
            contact,
            synced,
            problem,
        ]);
    }
    // The table first (scripts read it from its header line), then who decides.
    table(&rows) + &header
}

pub(crate) fn ago(now_ms: u64, t: u64) -> String {
    let s = now_ms.saturating_sub(t) / 1000;
    match s {
        0..=119 => format!("{s}s ago"),
        120..=7199 => format!("{}m ago", s / 60),
        _ => format!("{}h ago", s / 3600),
    }
}

/// `tessera policy history`: newest first.
pub fn render_history(revs: &[RevisionSummary]) -> String {
    if revs.is_empty() {
        return "no policy pushed yet\n".into();
    }
    let mut sorted: Vec<&RevisionSummary> = revs.iter().collect();
    sorted.sort_by_key(|r| std::cmp::Reverse(r.version));
    let mut rows =
        vec![["VERSION", "CREATED (UTC)", "SHA256", "KEY", "AUTHOR"].map(String::from).to_vec()];
    for r in sorted {
        rows.push(vec![
            r.version.to_string(),
            tessera_api::time::format_utc(r.created_ms),
            short(&r.digest).to_string(),
            match &r.problem {
                None => r.key_id.clone(),
                Some(p) => format!(
                    "UNVERIFIED ({}; claims {})",
                    p.split(':').next().unwrap_or("refused"),
                    if r.key_id.is_empty() { "no key" } else { r.key_id.as_str() }
                ),
            },
            r.author.clone(),
        ]);
    }
    table(&rows)
}

fn render_fleet_usage(f: &FleetUsage) -> String {
    let mut out = tessera::render::usage(&f.report);
    if !f.nodes.is_empty() {
        let mut rows =
            vec![["node", "GPU-seconds", "cost", "intervals"].map(String::from).to_vec()];
        for n in &f.nodes {
            rows.push(vec![
                n.node.clone(),
                format!("{:.3}", n.gpu_seconds),
                format!("{:.4}", n.cost),
                n.intervals.to_string(),
            ]);
        }
        out.push_str("\nby node (closed intervals uploaded by each node)\n");
        out.push_str(&table(&rows));
    }
    out
}

/// Who decides the books, and through which coordinator this answer came.
pub fn render_authority(st: &::fleet::quota_wire::QuotaStatus, now_ms: u64) -> String {
    let mut out = String::new();
    match &st.authority {
        Some(a) if a.term == 0 => out.push_str(&format!(
            "decided by coordinator {} alone (no election: its books are in its memory), since {} ({})\n",
            a.url,
            tessera_api::time::format_utc(a.since_ms),
            ago(now_ms, a.since_ms)
        )),
        Some(a) => out.push_str(&format!(
            "decided by coordinator {} (elected through etcd, term {}), since {} ({})\n",
            a.url,
            a.term,
            tessera_api::time::format_utc(a.since_ms),
            ago(now_ms, a.since_ms)
        )),
        None => {}
    }
    if let Some(v) = &st.via {
        out.push_str(&format!("answered through coordinator {v}, which passes quota calls on\n"));
    }
    if !st.coordinators.is_empty() {
        let list: Vec<String> = st
            .coordinators
            .iter()
            .map(|c| format!("{}{}", c.url, if c.leader { " (decides)" } else { " (standby)" }))
            .collect();
        out.push_str(&format!("coordinators in the election: {}\n", list.join(", ")));
    }
    for w in &st.warnings {
        out.push_str(&format!("WARNING: {}\n", w.replace('\n', " ")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align() {
        let t = table(&[
            vec!["a".into(), "bb".into(), "c".into()],
            vec!["ddd".into(), "e".into(), "".into()],
        ]);
        assert_eq!(t, "a    bb  c\nddd  e\n");
    }
}
