//! `tessera sim` (the `tessera-sim` binary): replay a GPU-cluster trace through the real
//! placement code, or with `--quota-modes` through the fleet simulator of
//! [`crate::quota_sim`], or run a built-in scenario. [`run`] reads the files named and
//! returns the text to print; the binary only prints it.

use std::fmt::Write as _;
use std::path::PathBuf;

use clap::Parser;

use crate::pack::{Allow, Rules};
use crate::quota_jobs::{quota_jobs, quota_tenants};
use crate::quota_sim;
use crate::replay::Trace;
use crate::replay::{self, Fractions, Placement, Queue, ReplayConfig, SimTenant, Tenants};
use crate::tracegen;

/// Replay a GPU-cluster trace through the real placement code (no daemon needed).
#[derive(Debug, Parser)]
#[command(name = "tessera sim", version)]
pub struct SimArgs {
    /// An Alibaba GPU trace CSV (e.g. data/alibaba-gpu-v2023/openb_pod_list_default.csv).
    #[arg(
        long,
        conflicts_with = "generate",
        required_unless_present_any = ["generate", "scenario", "quota_family"]
    )]
    pub trace: Option<PathBuf>,
    /// A generated trace instead: alibaba-like, mid-whole-bursty, small-shares, multi-gpu
    /// or uniform (seeded; see `lab::tracegen`).
    #[arg(long)]
    pub generate: Option<String>,
    /// Requests of a generated trace.
    #[arg(long, default_value_t = 3000)]
    pub requests: usize,
    /// Seed of a generated trace.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Nodes of 8 GPUs each.
    #[arg(long, default_value_t = 2)]
    pub nodes: u32,
    /// GPU model of every node.
    #[arg(long, default_value = "H100-80GB")]
    pub gpu: String,
    /// best, first-fit, static, whole, or all (the four, compared).
    #[arg(long, default_value = "all")]
    pub placement: String,
    /// Tier-aware fractions: each row's tenant from this policy (MPS and time-slicing
    /// where its tier allows them). Without it every fraction is MIG or whole. With
    /// --quota-modes: the tenant tree and `quotas` to simulate.
    #[arg(long)]
    pub policy: Option<PathBuf>,
    /// Requests that do not fit wait up to this many seconds (default: rejected at once).
    #[arg(long)]
    pub queue: Option<u64>,
    /// Fleet quotas: run the trace through static partitions (one per guarantee, no
    /// borrowing), one FIFO queue (no quotas, EASY backfill), the same FIFO kept within
    /// the policy's ceilings, and Tessera's quotas (borrowing, the fair queue, reclaim
    /// after the grace period) side by side, every
    /// request waiting until it runs (needs --policy). Rows go to the leaves of the
    /// policy's tenant tree that have a quota on their chain, sorted by path: row `name`
    /// to leaf number FNV-1a-64(name) mod their count. A row asks num_gpu whole GPUs, or
    /// gpu_milli/1000 of one GPU when num_gpu = 1 and 0 < gpu_milli < 1000 (num_gpu = 0:
    /// skipped), from creation_time for deletion_time - creation_time seconds.
    #[arg(long, requires = "policy", conflicts_with_all = ["queue", "placement", "scenario"])]
    pub quota_modes: bool,
    /// With --quota-modes: the share of jobs (0 to 1) that write a checkpoint on SIGTERM
    /// (`tessera.io/preemption: checkpoint`) and resume from it after a preemption; the
    /// others restart from zero. A row checkpoints when FNV-1a-64 of `checkpoint:` and its
    /// name, mod 1,000,000, is below the share times 1,000,000.
    #[arg(long, default_value_t = 0.0)]
    pub checkpoint_fraction: f64,
    /// The quota acceptance table (needs --policy): FIFO with backfill against quotas on
    /// the three shared pod lists (from --data, default data/alibaba-gpu-v2023) and the
    /// generated mixes (--requests, --seed) at 2 and 4 nodes, each cell judged against
    /// the promises (useful utilisation at least 95% of FIFO's, owner wait p99 at most
    /// 300 s) and, where one is not kept, whether FIFO kept within the policy's ceilings
    /// does any better and what accounts for it (`lab::quota_table`); then the sums over
    /// every cell, the shared lists' and the generated family's. In Markdown; takes tens
    /// of seconds in a release build.
    #[arg(
        long,
        requires = "policy",
        conflicts_with_all = ["trace", "generate", "quota_modes", "queue", "placement", "scenario"]
    )]
    pub quota_family: bool,
    /// Where --quota-family finds the shared pod lists.
    #[arg(long, default_value = "data/alibaba-gpu-v2023")]
    pub data: PathBuf,
    /// A built-in scenario instead of a trace: `drf`, the DRF paper's example (one node of
    /// 9 CPUs and 18 GB; A's tasks <1 CPU, 4 GB>, B's <3 CPU, 1 GB>, both always asking)
    /// under Tessera's fair queue with no quota; `interference`, latency services and
    /// bandwidth-heavy batch jobs on MPS GPUs without and with the interference controller
    /// (`lab::contention_sim`, 5 seeds of 8 hours).
    #[arg(long, conflicts_with_all = ["trace", "generate", "policy", "queue", "placement"])]
    pub scenario: Option<String>,
    #[arg(long)]
    pub json: bool,
}

/// The node name tier checks run against (node pools may restrict tenants by name).
const SIM_NODE: &str = "sim-replay";

/// The replay's tenants from a policy: every leaf of its tenant tree (sorted by path),
/// each with what `Policy::authorize` lets it use on [`SIM_NODE`] and its sharing domain.
pub fn tenants_of(policy: &policy::Policy) -> Tenants {
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
        .map(|t| SimTenant {
            key: t.path.to_string(),
            tenant: t.path.to_string(),
            allow: Allow {
                gpu: may(t, tessera_api::GpuRequest::Gpu { count: 1 }),
                mig: may(t, tessera_api::GpuRequest::Mig { profile: "1g.10gb".into() }),
                mps: may(t, tessera_api::GpuRequest::Mps { percent: 1 }),
                shared: may(t, tessera_api::GpuRequest::Shared),
            },
            domain: policy.sharing_domain(&t.path),
        })
        .collect();
    Tenants {
        tenants,
        rules: Rules {
            mps_max_percent: policy.mps_max_percent(),
            replicas: policy.shared_replicas(),
        },
    }
}

fn to_json(v: &impl serde::Serialize) -> Result<String, String> {
    serde_json::to_string_pretty(v).map(|s| s + "\n").map_err(|e| e.to_string())
}

/// Runs `tessera sim` with `a`: the text it prints on success.
pub fn run(a: &SimArgs) -> Result<String, String> {
    if let Some(name) = &a.scenario {
        return scenario(name, a.json);
    }
    if !(0.0..=1.0).contains(&a.checkpoint_fraction) {
        return Err(format!(
            "--checkpoint-fraction {}: expected a share of the jobs from 0 to 1",
            a.checkpoint_fraction
        ));
    }
    if a.quota_family {
        return quota_family(a);
    }
    let trace = match (&a.trace, &a.generate) {
        (Some(path), _) => Trace::load_alibaba(path).map_err(|e| e.to_string())?,
        (None, Some(mix)) => {
            tracegen::generate(mix.parse()?, a.requests, a.seed, tracegen::DEFAULT_LOAD_GPUS)
        }
        (None, None) => return Err("give --trace FILE or --generate MIX".into()),
    };
    if a.quota_modes {
        return quota_modes(a, &trace);
    }
    let placements: Vec<Placement> =
        if a.placement == "all" { Placement::ALL.to_vec() } else { vec![a.placement.parse()?] };
    let fractions = match &a.policy {
        Some(path) => {
            let policy = policy::Policy::load(path).map_err(|e| e.to_string())?;
            let tenants = tenants_of(&policy);
            if tenants.tenants.is_empty() {
                return Err(format!("{}: the policy has no tenant", path.display()));
            }
            Fractions::Tiers(tenants)
        }
        None => Fractions::Mig,
    };
    let queue = match a.queue {
        Some(max_wait_s) => Queue::Wait { max_wait_s },
        None => Queue::Drop,
    };
    let reports = placements
        .into_iter()
        .map(|placement| {
            let config = ReplayConfig {
                nodes: a.nodes,
                model: a.gpu.clone(),
                placement,
                fractions: fractions.clone(),
                queue,
            };
            replay::replay_with(&trace, &config).map_err(|e| e.to_string())
        })
        .collect::<Result<Vec<_>, _>>()?;
    if a.json {
        return if reports.len() == 1 { to_json(&reports[0]) } else { to_json(&reports) };
    }
    let mut out = replay::comparison_table(&reports);
    let _ = writeln!(out, "\nmapping: {}", replay::MAPPING_DOC);
    if let Fractions::Tiers(t) = &fractions {
        let _ =
            writeln!(out, "tenants (row name hashed onto them, FNV-1a mod {}):", t.tenants.len());
        for st in &t.tenants {
            let _ = writeln!(
                out,
                "  {} may use {} (sharing domain {})",
                st.tenant,
                st.allow.label(),
                st.domain
            );
        }
    }
    Ok(out)
}

/// How `tessera sim --quota-modes` turns trace rows into jobs; printed with its results.
const QUOTA_MAPPING_DOC: &str = "\
Mapping of trace rows to jobs (--quota-modes):
- Tenants: the leaves of the policy's tenant tree that have a quota on their chain, sorted \
by path; row `name` belongs to leaf number FNV-1a-64(name) mod their count (the hash the \
replay uses for tiers), so each gets about the same share of rows.
- num_gpu = 0: CPU-only; skipped. num_gpu >= 2, or gpu_milli = 0 or >= 1000: num_gpu whole \
GPUs on one node. num_gpu = 1 with 0 < gpu_milli < 1000: gpu_milli/1000 of one GPU (a \
fraction of one GPU's bin). CPU and memory are not simulated.
- It arrives at creation_time and runs deletion_time - creation_time seconds once started \
(again in full after a preemption); it waits until it runs. The horizon is the trace's \
end (latest deletion_time).";

/// `tenant`'s GPU quota as people read it: the innermost limits on its chain.
pub fn quota_text(tree: &quota::QuotaTree, tenant: &str, model: &str) -> String {
    let gpu = quota::Resource::gpu(model);
    let show = |v: Option<u64>| v.map(|m| gpu.show(m).replace(&format!(" {model} GPUs"), ""));
    let mut parts = Vec::new();
    for q in tree.chain(tenant) {
        let Some(l) = q.limits.get(&gpu) else { continue };
        let mut here = Vec::new();
        if let Some(g) = show(l.guarantee) {
            here.push(format!("guarantee {g}"));
        }
        if let Some(c) = show(l.ceiling) {
            here.push(format!("ceiling {c}"));
        }
        if let Some(x) = show(l.lending_limit) {
            here.push(format!("lending limit {x}"));
        }
        parts.push(format!("{} ({})", q.path, here.join(", ")));
    }
    if parts.is_empty() {
        "no GPU quota".into()
    } else {
        format!("{}; grace {} s", parts.join(" < "), tree.grace_period_s(tenant))
    }
}

fn quota_modes(a: &SimArgs, trace: &Trace) -> Result<String, String> {
    let path = a.policy.as_ref().ok_or("--quota-modes needs --policy FILE")?;
    let policy = policy::Policy::load(path).map_err(|e| e.to_string())?;
    if slicer::catalog::model(&a.gpu).is_none() {
        let known: Vec<&str> = slicer::catalog::model_names().collect();
        return Err(format!(
            "--gpu {}: unknown GPU model, expected one of {}",
            tessera_api::untrusted(&a.gpu),
            known.join(", ")
        ));
    }
    let tenants = quota_tenants(&policy);
    if tenants.is_empty() {
        return Err(format!(
            "{}: no leaf tenant has a quota on its chain: --quota-modes needs a `quotas` section",
            path.display()
        ));
    }
    let (jobs, skipped) = quota_jobs(trace, &tenants, &a.gpu, a.checkpoint_fraction);
    let fleet = quota_sim::Fleet {
        nodes: a.nodes,
        gpus_per_node: replay::GPUS_PER_NODE,
        model: a.gpu.clone(),
        cpu_milli_per_node: None,
        memory_mib_per_node: None,
    };
    let reports =
        quota_sim::run_modes(&jobs, &fleet, policy.quotas(), None).map_err(|e| e.to_string())?;
    let rows = |t: &str| jobs.iter().filter(|j| j.tenant == t).count();
    if a.json {
        let tenants: Vec<serde_json::Value> = tenants
            .iter()
            .map(|t| {
                serde_json::json!({
                    "tenant": t,
                    "rows": rows(t),
                    "quota": quota_text(policy.quotas(), t, &a.gpu),
                })
            })
            .collect();
        return to_json(&serde_json::json!({
            "trace": trace.source,
            "rows_skipped": skipped,
            "mapping": QUOTA_MAPPING_DOC,
            "tenants": tenants,
            "reports": reports,
        }));
    }
    let mut out = format!(
        "{}: {} jobs ({} rows without GPU skipped) on {} nodes x {} {}\n",
        trace.source,
        jobs.len(),
        skipped,
        a.nodes,
        replay::GPUS_PER_NODE,
        a.gpu
    );
    out.push_str(&quota_sim::comparison_table(&reports));
    if let Some(st) = reports.iter().find(|r| r.mode == quota_sim::Mode::Static) {
        let parts: Vec<String> =
            st.partitions.iter().map(|p| format!("{} {} GPUs", p.owner, p.gpus)).collect();
        let _ = writeln!(out, "\nstatic partitions: {}", parts.join(", "));
    }
    out.push_str("\ntenants (rows: trace rows mapped to it):\n");
    for t in &tenants {
        let _ =
            writeln!(out, "  {t}: {} rows; {}", rows(t), quota_text(policy.quotas(), t, &a.gpu));
    }
    let _ = writeln!(out, "\n{QUOTA_MAPPING_DOC}");
    Ok(out)
}

/// `--quota-family`: the acceptance table ([`crate::quota_table`]).
fn quota_family(a: &SimArgs) -> Result<String, String> {
    let path = a.policy.as_ref().ok_or("--quota-family needs --policy FILE")?;
    let policy = policy::Policy::load(path).map_err(|e| e.to_string())?;
    let traces = tracegen::family(Some(&a.data), a.requests, a.seed).map_err(|e| e.to_string())?;
    let mut cells = Vec::new();
    for t in &traces {
        for nodes in crate::quota_table::NODES {
            cells.push(crate::quota_table::cell(t, nodes, &policy, &a.gpu, a.checkpoint_fraction)?);
        }
    }
    if a.json {
        let rows: Vec<serde_json::Value> = cells
            .iter()
            .map(|c| {
                serde_json::json!({
                    "trace": c.trace, "nodes": c.nodes,
                    "checkpoint_fraction": c.checkpoint_fraction,
                    "ratio": c.ratio(), "ratio_within_ceilings": c.ratio_within_ceilings(),
                    "accounted_ratio": c.accounted_ratio(),
                    "utilisation": c.utilisation().label(), "owner_wait": c.owner_wait().label(),
                    "fifo": c.fifo, "fifo_ceilings": c.fifo_ceilings, "quotas": c.quotas,
                    "shape": c.shape,
                })
            })
            .collect();
        return to_json(&rows);
    }
    Ok(format!(
        "{} (checkpointing: {:.0}% of the jobs; generated mixes: {} requests, seed {})\n\n{}",
        path.display(),
        a.checkpoint_fraction * 100.0,
        a.requests,
        a.seed,
        crate::quota_table::markdown(&cells)
    ))
}

fn scenario(name: &str, json: bool) -> Result<String, String> {
    if name == "interference" {
        let f = crate::contention_sim::family(5, 8);
        return if json { to_json(&f) } else { Ok(crate::contention_sim::table(&f)) };
    }
    if name != "drf" {
        return Err(format!(
            "--scenario {}: unknown scenario, expected drf or interference",
            tessera_api::untrusted(name)
        ));
    }
    let s = quota_sim::drf_example();
    let report = quota_sim::run(&s.jobs, &s.fleet, &s.tree, quota_sim::Mode::Quotas, s.horizon_s)
        .map_err(|e| e.to_string())?;
    if json {
        return to_json(&report);
    }
    let mut out = format!(
        "DRF (Ghodsi et al. 2011, section 4): one node of 9 CPUs and 18 GB; drf/a's tasks ask \
         <1 CPU, 4 GB>, drf/b's <3 CPU, 1 GB>, {} each waiting from t=0 (1,000 s each); no \
         quota, so the fair queue is pure DRF. At t={} s:\n",
        quota_sim::DRF_BACKLOG,
        s.horizon_s.unwrap_or(0)
    );
    out.push_str(&quota_sim::tenant_table(&report));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    fn example(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples").join(name)
    }

    #[test]
    fn the_example_policy_maps_to_the_tenants_the_slicer_tests_use() {
        let policy = policy::Policy::load(&example("policy.json")).expect("example policy");
        // The same list, in the same order (the row-to-tenant hash depends on it).
        assert_eq!(tenants_of(&policy), Tenants::example());
    }

    #[test]
    fn the_quota_sim_example_has_four_teams_whose_guarantees_fill_two_nodes() {
        let policy = policy::Policy::load(&example("quota-sim.json")).expect("example policy");
        let tenants = quota_tenants(&policy);
        assert_eq!(tenants, ["acme/explore", "acme/inference", "acme/research", "acme/training"]);
        let gpu = quota::Resource::gpu("H100-80GB");
        let guarantees: u64 = policy
            .quotas()
            .iter()
            .filter_map(|q| q.limits.get(&gpu).and_then(|l| l.guarantee))
            .sum();
        assert_eq!(guarantees, 2 * u64::from(replay::GPUS_PER_NODE) * quota::MICRO_PER_GPU);
        let explore = quota_text(policy.quotas(), "acme/explore", "H100-80GB");
        assert_eq!(explore, "acme/explore (ceiling 8); grace 30 s");
    }

    #[test]
    fn trace_rows_map_to_jobs_by_name_hash_whole_gpus_and_fractions() {
        assert_eq!(slicer::fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(slicer::fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        let csv = "name,num_gpu,gpu_milli,creation_time,deletion_time\n\
                   p0,0,0,0,10\np1,1,1000,5,15\np2,1,460,6,7\np3,8,0,9,9\np4,2,500,1,3\n";
        let trace = Trace::parse_alibaba("t.csv", csv).expect("parses");
        let tenants = vec!["o/a".to_string(), "o/b".to_string(), "o/c".to_string()];
        let (jobs, skipped) = quota_jobs(&trace, &tenants, "H100-80GB", 0.0);
        assert_eq!(skipped, 1);
        let gpu = quota::Resource::gpu("H100-80GB");
        let got: Vec<(&str, u64, u64, u64)> = jobs
            .iter()
            .map(|j| (j.id.as_str(), j.resources.get(&gpu), j.arrival_s, j.duration_s))
            .collect();
        assert_eq!(
            got,
            [
                ("p1", 1_000_000, 5, 10),
                ("p2", 460_000, 6, 1),
                ("p3", 8_000_000, 9, 0),
                ("p4", 2_000_000, 1, 2),
            ]
        );
        for j in &jobs {
            let want = &tenants[(slicer::fnv1a64(j.id.as_bytes()) % 3) as usize];
            assert_eq!(&j.tenant, want);
        }
    }
}
