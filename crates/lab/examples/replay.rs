//! The four-placement comparison on a trace, as `tessera sim` will print it.
//!
//! `cargo run -p lab --release --example replay -- [TRACE] [NODES...] [--json]`
//! (defaults: the Alibaba default pod list and 8 nodes of 8 H100-80GB). Several node
//! counts print one table each.

use std::path::PathBuf;
use std::process::ExitCode;

use lab::replay::{comparison_table, replay, Placement, Trace, MAPPING_DOC};

const DEFAULT_TRACE: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/../../data/alibaba-gpu-v2023/openb_pod_list_default.csv");

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let json = args.iter().any(|a| a == "--json");
    let mut path = PathBuf::from(DEFAULT_TRACE);
    let mut nodes: Vec<u32> = Vec::new();
    for a in args.iter().filter(|a| *a != "--json") {
        match a.parse::<u32>() {
            Ok(n) => nodes.push(n),
            Err(_) => path = PathBuf::from(a),
        }
    }
    if nodes.is_empty() {
        nodes.push(8);
    }
    let trace = match Trace::load_alibaba(&path) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    if !json {
        println!("{MAPPING_DOC}\n");
    }
    for n in nodes {
        let mut reports = Vec::new();
        for p in Placement::ALL {
            match replay(&trace, n, "H100-80GB", p) {
                Ok(r) => reports.push(r),
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::FAILURE;
                }
            }
        }
        if json {
            match serde_json::to_string_pretty(&reports) {
                Ok(s) => println!("{s}"),
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::FAILURE;
                }
            }
        } else {
            println!("{}", comparison_table(&reports));
        }
    }
    ExitCode::SUCCESS
}
