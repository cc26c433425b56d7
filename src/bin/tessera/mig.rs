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
    #[arg(long)]
    trace: PathBuf,
    /// Nodes of 8 GPUs each.
    #[arg(long, default_value_t = 2)]
    nodes: u32,
    /// GPU model of every node.
    #[arg(long, default_value = "H100-80GB")]
    gpu: String,
    /// best, first-fit, static, whole, or all (the four, compared).
    #[arg(long, default_value = "all")]
    placement: String,
    #[arg(long)]
    json: bool,
}

pub fn sim(a: SimArgs) -> Result<(), String> {
    let trace = slicer::Trace::load_alibaba(&a.trace).map_err(|e| e.to_string())?;
    let placements: Vec<slicer::Placement> = if a.placement == "all" {
        slicer::Placement::ALL.to_vec()
    } else {
        vec![a.placement.parse()?]
    };
    let reports = placements
        .into_iter()
        .map(|p| slicer::replay(&trace, a.nodes, &a.gpu, p).map_err(|e| e.to_string()))
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
    }
    Ok(())
}
