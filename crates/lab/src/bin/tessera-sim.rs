//! tessera-sim: `tessera sim`, the lab's command (`tessera sim` runs this binary, installed
//! beside it). Flag parsing and printing only: [`lab::cli`] does the work.

use std::process::ExitCode;

use clap::Parser as _;

fn main() -> ExitCode {
    let args = lab::cli::SimArgs::parse();
    match lab::cli::run(&args) {
        Ok(out) => {
            print!("{out}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tessera sim: {e}");
            ExitCode::FAILURE
        }
    }
}
