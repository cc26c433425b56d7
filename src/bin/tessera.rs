//! tessera: the operator's command line. Flag parsing and printing only.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Tessera: GPU sharing on one node.
#[derive(Debug, Parser)]
#[command(name = "tessera", version)]
struct Cli {
    /// tesserad's API socket.
    #[arg(long, global = true, env = "TESSERA_SOCKET", default_value = tessera_api::DEFAULT_SOCKET)]
    socket: PathBuf,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Every GPU, its MIG slot map, and who holds what.
    Status {
        /// Print the daemon's JSON instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Policy files.
    Policy {
        #[command(subcommand)]
        cmd: PolicyCmd,
    },
}

#[derive(Debug, Subcommand)]
enum PolicyCmd {
    /// Check a policy file; every error names its JSON path.
    Validate { file: PathBuf },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tessera: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<(), String> {
    match cli.cmd {
        Cmd::Status { json } => {
            let status = tessera_api::Client::new(&cli.socket).status().map_err(|e| e.to_string())?;
            if json {
                let text = serde_json::to_string_pretty(&status).map_err(|e| e.to_string())?;
                println!("{text}");
            } else {
                print!("{}", tessera::render::status(&status));
            }
            Ok(())
        }
        Cmd::Policy { cmd: PolicyCmd::Validate { file } } => {
            let p = policy::Policy::load(&file).map_err(|e| e.to_string())?;
            println!(
                "{}: valid policy version {} ({} tenants, sha256 {})",
                file.display(),
                p.version(),
                p.tenants().len(),
                p.digest()
            );
            Ok(())
        }
    }
}
