//! `tessera mig plan|converge` (the node's MIG layout against the declared one) and
//! `tessera sim` (replay a GPU-cluster trace through the real placement code).

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};

#[derive(Debug, Subcommand)]
pub enum MigCmd {
    /// What would change to reach the layout the node's pool declares.
    Plan {
        #[arg(long)]
        json: bool,
    },
    /// Destroy and create only the difference now; instances in use are never touched.
    Converge {
        #[arg(long)]
        json: bool,
    },
}

pub fn run(socket: &Path, cmd: MigCmd) -> Result<(), String> {
    let client = tessera_api::Client::new(socket);
    let (report, json): (serde_json::Value, bool) = match cmd {
        MigCmd::Plan { json } => {
            (client.call::<(), _>("GET", "/v1/mig/plan", None).map_err(|e| e.to_string())?, json)
        }
        MigCmd::Converge { json } => (
            client.call::<(), _>("POST", "/v1/mig/converge", None).map_err(|e| e.to_string())?,
            json,
        ),
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?);
        return Ok(());
    }
    print!("{}", report["text"].as_str().unwrap_or(""));
    let list = |k: &str| -> Vec<String> {
        report[k]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_string)).collect())
            .unwrap_or_default()
    };
    let (destroyed, created) = (list("destroyed"), list("created"));
    if !destroyed.is_empty() || !created.is_empty() {
        println!(
            "destroyed: {}",
            if destroyed.is_empty() { "-".into() } else { destroyed.join(", ") }
        );
        println!("created:   {}", if created.is_empty() { "-".into() } else { created.join(", ") });
    }
    match report["error"].as_str() {
        Some(e) => Err(format!("convergence stopped: {e}")),
        None => Ok(()),
    }
}

#[derive(Debug, Args)]
pub struct SimArgs {
    /// An Alibaba GPU trace CSV (e.g. data/alibaba-gpu-v2023/openb_pod_list_default.csv).
    #[arg(long, conflicts_with = "generate", required_unless_present = "generate")]
    trace: Option<PathBuf>,
    /// A generated trace instead: alibaba-like, mid-whole-bursty, small-shares, multi-gpu
    /// or uniform (seeded; see `slicer::tracegen`).
    #[arg(long)]
    generate: Option<String>,
    /// Requests of a generated trace.
    #[arg(long, default_value_t = 3000)]
    requests: usize,
    /// Seed of a generated trace.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Nodes of 8 GPUs each.
    #[arg(long, default_value_t = 2)]
    nodes: u32,
    /// GPU model of every node.
    #[arg(long, default_value = "H100-80GB")]
    gpu: String,
    /// best, first-fit, static, whole, or all (the four, compared).
    #[arg(long, default_value = "all")]
    placement: String,
    /// Tier-aware fractions: each row's tenant from this policy (MPS and time-slicing
    /// where its tier allows them). Without it every fraction is MIG or whole.
    #[arg(long)]
    policy: Option<PathBuf>,
    /// Requests that do not fit wait up to this many seconds (default: rejected at once).
    #[arg(long)]
    queue: Option<u64>,
    #[arg(long)]
    json: bool,
}

/// The node name tier checks run against (node pools may restrict tenants by name).
const SIM_NODE: &str = "sim-replay";

/// The replay's tenants from a policy: every leaf of its tenant tree (sorted by path),
/// each with what `Policy::authorize` lets it use on [`SIM_NODE`] and its sharing domain.
fn tenants_of(policy: &policy::Policy) -> slicer::Tenants {
    let all = policy.tenants();
    let mut leaves: Vec<&policy::Tenant> = all
        .iter()
        .filter(|t| !all.iter().any(|o| o.path.starts_with(&format!("{}/", t.path))))
        .collect();
    leaves.sort_by(|a, b| a.path.cmp(&b.path));
    let may =
        |t: &policy::Tenant, r: tessera_api::GpuRequest| policy.authorize(t, &r, SIM_NODE).is_ok();
    let tenants = leaves
        .into_iter()
        .map(|t| slicer::SimTenant {
            key: t.path.clone(),
            tenant: t.path.clone(),
            allow: slicer::pack::Allow {
                gpu: may(t, tessera_api::GpuRequest::Gpu { count: 1 }),
                mig: may(t, tessera_api::GpuRequest::Mig { profile: "1g.10gb".into() }),
                mps: may(t, tessera_api::GpuRequest::Mps { percent: 1 }),
                shared: may(t, tessera_api::GpuRequest::Shared),
            },
            domain: policy.sharing_domain(&t.path),
        })
        .collect();
    slicer::Tenants {
        tenants,
        rules: slicer::pack::Rules {
            mps_max_percent: policy.mps_max_percent(),
            replicas: policy.shared_replicas(),
        },
    }
}

pub fn sim(a: SimArgs) -> Result<(), String> {
    let trace = match (&a.trace, &a.generate) {
        (Some(path), _) => slicer::Trace::load_alibaba(path).map_err(|e| e.to_string())?,
        (None, Some(mix)) => slicer::tracegen::generate(
            mix.parse()?,
            a.requests,
            a.seed,
            slicer::tracegen::DEFAULT_LOAD_GPUS,
        ),
        (None, None) => return Err("give --trace FILE or --generate MIX".into()),
    };
    let placements: Vec<slicer::Placement> = if a.placement == "all" {
        slicer::Placement::ALL.to_vec()
    } else {
        vec![a.placement.parse()?]
    };
    let fractions = match &a.policy {
        Some(path) => {
            let policy = policy::Policy::load(path).map_err(|e| e.to_string())?;
            let tenants = tenants_of(&policy);
            if tenants.tenants.is_empty() {
                return Err(format!("{}: the policy has no tenant", path.display()));
            }
            slicer::Fractions::Tiers(tenants)
        }
        None => slicer::Fractions::Mig,
    };
    let queue = match a.queue {
        Some(max_wait_s) => slicer::Queue::Wait { max_wait_s },
        None => slicer::Queue::Drop,
    };
    let reports = placements
        .into_iter()
        .map(|placement| {
            let config = slicer::ReplayConfig {
                nodes: a.nodes,
                model: a.gpu.clone(),
                placement,
                fractions: fractions.clone(),
                queue,
            };
            slicer::replay_with(&trace, &config).map_err(|e| e.to_string())
        })
        .collect::<Result<Vec<_>, _>>()?;
    if a.json {
        let v = if reports.len() == 1 {
            serde_json::to_value(&reports[0])
        } else {
            serde_json::to_value(&reports)
        };
        println!(
            "{}",
            serde_json::to_string_pretty(&v.map_err(|e| e.to_string())?)
                .map_err(|e| e.to_string())?
        );
    } else {
        print!("{}", slicer::replay::comparison_table(&reports));
        println!("\nmapping: {}", slicer::MAPPING_DOC);
        if let slicer::Fractions::Tiers(t) = &fractions {
            println!("tenants (row name hashed onto them, FNV-1a mod {}):", t.tenants.len());
            for st in &t.tenants {
                println!(
                    "  {} may use {} (sharing domain {})",
                    st.tenant,
                    st.allow.label(),
                    st.domain
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_example_policy_maps_to_the_tenants_the_slicer_tests_use() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/policy.json");
        let policy = policy::Policy::load(&path).expect("example policy");
        // The same list, in the same order (the row-to-tenant hash depends on it).
        assert_eq!(tenants_of(&policy), slicer::Tenants::example());
    }
}
