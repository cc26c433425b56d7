//! A stand-alone front for the scrub crate's command-line entries, for lent-GPU runs
//! before (or without) the `tessera` binary:
//!
//! ```text
//! tessera-scrub scrub --device UUID [--json] [--sim-mem FILE] [--sim-faults FILE]
//! tessera-scrub gpu-bench peak|fill|count …
//! ```

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let code = match args.first().map(String::as_str) {
        Some("scrub") => scrub::scrub_cli_main(args),
        Some("gpu-bench") => scrub::gpu_bench_main(args),
        _ => {
            eprintln!("usage: tessera-scrub scrub …|gpu-bench …");
            2
        }
    };
    std::process::exit(code);
}
