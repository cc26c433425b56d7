//! `tessera mig plan|converge`: the node's MIG layout against the declared one.

use std::path::Path;

use clap::Subcommand;

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
