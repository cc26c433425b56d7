//! `tessera cdi generate`: a CDI spec (kind `tessera.io/gpu`) whose device names are
//! Tessera requests, so CDI users (`podman run --device tessera.io/gpu=mig-1g.10gb`,
//! Docker 25+, containerd 1.7+) ask through the usual door. The spec is
//! [`tesserad::cdi`]'s, the one tesserad keeps current itself with `--cdi-spec-dir DIR`;
//! this command writes it once, from tesserad's status and the policy file.

use std::path::PathBuf;

use clap::{Args, Subcommand};
use tesserad::cdi::{spec_yaml, write_if_changed, Offer, KIND};

#[derive(Debug, Subcommand)]
pub enum CdiCmd {
    /// Write a CDI spec whose device names are Tessera requests (`gpu`, `gpu-2`, `all`,
    /// `mig-1g.10gb`, `mps-50`, `shared`), as the node (tesserad's status) and the
    /// policy allow. Writes only when the content changed; run it again after a policy or
    /// MIG layout change (docs/INSTALL.md, CDI).
    Generate(GenerateArgs),
    /// The CDI device names this node and its policy offer now, with the Tessera request
    /// each one is (`tessera.io/gpu=mig-1g.10gb  mig=1g.10gb`).
    List {
        /// The policy that decides which kinds are offered [default: the file tesserad
        /// enforces].
        #[arg(long)]
        policy: Option<PathBuf>,
    },
}

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// Where to write the spec (`-` for stdout). podman 4.3 reads /etc/cdi and /var/run/cdi.
    #[arg(long, default_value = "/etc/cdi/tessera.yaml")]
    output: PathBuf,
    /// The policy that decides which kinds are offered [default: the file tesserad
    /// enforces, when its status names one; else every kind].
    #[arg(long)]
    policy: Option<PathBuf>,
}

/// tesserad's status and the policy that decides the offer.
fn offer(
    socket: &std::path::Path,
    policy: Option<PathBuf>,
) -> Result<(tessera_api::NodeStatus, Offer), String> {
    let status = tessera_api::Client::new(socket).status().map_err(|e| e.to_string())?;
    let policy_file = policy.or_else(|| {
        status.policy.source.strip_prefix("file:").map(PathBuf::from).filter(|p| p.is_file())
    });
    let policy = match &policy_file {
        Some(f) => Some(policy::Policy::load(f).map_err(|e| e.to_string())?),
        None => None,
    };
    let offer = Offer::new(&status, policy.as_ref());
    Ok((status, offer))
}

pub fn run(socket: &std::path::Path, cmd: CdiCmd) -> Result<(), String> {
    let a = match cmd {
        CdiCmd::Generate(a) => a,
        CdiCmd::List { policy } => {
            let (_, offer) = offer(socket, policy)?;
            let devices = offer.devices();
            let width = devices.iter().map(|(n, _)| n.len()).max().unwrap_or(0) + KIND.len() + 1;
            for (name, request) in devices {
                println!("{:<width$}  {request}", format!("{KIND}={name}"));
            }
            return Ok(());
        }
    };
    let (status, offer) = offer(socket, a.policy.clone())?;
    let header = format!(
        "`tessera cdi generate`, node {}, policy version {} ({})",
        status.node, status.policy.version, status.policy.source
    );
    let yaml = spec_yaml(&offer, &header);
    if a.output.as_os_str() == "-" {
        print!("{yaml}");
        return Ok(());
    }
    let shown = a.output.display();
    if !write_if_changed(&a.output, &yaml).map_err(|e| e.to_string())? {
        println!("{shown}: up to date ({} devices)", offer.devices().len());
        return Ok(());
    }
    let names: Vec<String> = offer.devices().into_iter().map(|(n, _)| n).collect();
    println!("{shown}: wrote {KIND}={{{}}}", names.join(","));
    Ok(())
}
