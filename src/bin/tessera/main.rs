//! tessera: the operator's command line. Flag parsing and printing only.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bill;
mod cdi;
mod doctor;
mod fleet;
mod mig;
mod quota;
mod revoke;
mod setup;
mod sim;

/// Tessera: GPU sharing on one node.
#[derive(Debug, Parser)]
#[command(name = "tessera", version)]
struct Cli {
    /// tesserad's API socket, for the commands that ask tesserad (status, usage, version,
    /// doctor, setup, mig, device, cdi, policy reload and revoke-check) [default:
    /// $TESSERA_SOCKET, else /run/tessera/tesserad.sock].
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

impl Cli {
    /// The socket: `--socket`, else `TESSERA_SOCKET`, else the default.
    fn socket(&self) -> PathBuf {
        self.socket
            .clone()
            .or_else(|| {
                std::env::var_os("TESSERA_SOCKET").filter(|v| !v.is_empty()).map(PathBuf::from)
            })
            .unwrap_or_else(|| PathBuf::from(tessera_api::DEFAULT_SOCKET))
    }
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// This tessera's version and, when it answers, tesserad's node, backend and policy.
    #[command(visible_alias = "info")]
    Version {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Every GPU, its MIG slot map, and who holds what.
    Status {
        /// Print the daemon's JSON instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// Who uses what on each GPU now: device activity (SM, memory bandwidth, power, clocks,
    /// throttle reasons) and each container's share, with open interference incidents.
    Top {
        /// Print the daemon's JSON instead of the table.
        #[arg(long)]
        json: bool,
        /// Redraw every N seconds until interrupted.
        #[arg(long, value_name = "SECONDS")]
        watch: Option<u64>,
    },
    /// GPU-seconds and the bill per group (floors, bursts, the topology premium, idle),
    /// from the node's ledger or, with --coordinator, the fleet's; --verify checks the
    /// ledger's hash chain (node) or the bill against its signed intervals and policy
    /// (fleet, or offline with --file); --export writes the bill with its proofs.
    Usage {
        /// Start of the window: now, -2h, Unix seconds or 2026-11-21T12:00:00Z.
        #[arg(long, default_value = "-24h", allow_hyphen_values = true)]
        from: String,
        /// End of the window (exclusive).
        #[arg(long, default_value = "now", allow_hyphen_values = true)]
        to: String,
        /// Group by a level of the tenant tree (org, team, project, user), the container,
        /// or the Kubernetes namespace or pod (`-` groups what ran outside pods).
        #[arg(long, default_value = "team", value_parser = ["org", "team", "project", "user", "container", "namespace", "pod"])]
        by: String,
        /// Print JSON (stable: the same ledger and query give the same bytes).
        #[arg(long, conflicts_with = "csv")]
        json: bool,
        /// Print CSV.
        #[arg(long)]
        csv: bool,
        /// Verify instead of report: the node's ledger (its hash chain, and the
        /// coordinator's copy on a fleet node); with --coordinator the fleet's bill for the
        /// window; with --file an exported bill, offline. Exits 1 naming the first row
        /// that does not verify.
        #[arg(long)]
        verify: bool,
        /// With --verify: an exported bill (`--export FILE.json`) to check offline.
        #[arg(long, requires = "verify", value_name = "FILE")]
        file: Option<PathBuf>,
        /// Pin a node's public key for --verify (NODE=KEY, KEY as hex, base64 or a file);
        /// nodes not pinned are checked against the key the bill names.
        #[arg(long = "node-key", value_name = "NODE=KEY", requires = "verify")]
        node_keys: Vec<String>,
        /// With --coordinator: write the fleet's bill with everything it rests on (the signed
        /// policy revision, every node's signed chain segments) to FILE: JSON, or CSV with
        /// the revision and chain heads in `#` lines for a name ending in .csv.
        #[arg(long, value_name = "FILE", conflicts_with = "verify")]
        export: Option<PathBuf>,
        /// Ask a fleet coordinator for fleet-wide usage instead of this node's ledger.
        #[command(flatten)]
        fleet: fleet::CoordinatorArgs,
    },
    /// Every node known to the fleet coordinator: applied policy version, last contact, health.
    Nodes(fleet::NodesArgs),
    /// Fleet quotas on the coordinator: `status` (the quota tree, nodes, reclaims),
    /// `events` (borrows, reclaims, preemptions, refusals).
    Quota {
        #[command(subcommand)]
        cmd: quota::QuotaCmd,
    },
    /// The node's MIG layout against the one its pool declares.
    Mig {
        #[command(subcommand)]
        cmd: mig::MigCmd,
    },
    /// Replay a GPU-cluster trace through the real placement code, or run the fleet quota
    /// simulator (no daemon needed): runs `tessera-sim`, the lab's binary, installed beside
    /// tessera; `tessera sim --help` lists its options.
    #[command(disable_help_flag = true)]
    Sim {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Zero and verify one device's memory (run by tesserad in a child process):
    /// `--device UUID [--json] [--sim-mem FILE] [--sim-faults FILE] [--reserve-mib N]`.
    /// Internal: not in the help.
    #[command(disable_help_flag = true, hide = true)]
    Scrub {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// GPU measurements for a lent machine: `peak`, `fill PATTERN`, `count PATTERN`.
    /// Internal: not in the help.
    #[command(name = "gpu-bench", disable_help_flag = true, hide = true)]
    GpuBench {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Devices: bring a quarantined one back after a successful scrub.
    Device {
        #[command(subcommand)]
        cmd: DeviceCmd,
    },
    /// CDI devices (`tessera.io/gpu=...`) that are Tessera requests.
    Cdi {
        #[command(subcommand)]
        cmd: cdi::CdiCmd,
    },
    /// What the engines' configurations, tessera-runtime's configurations and the policy
    /// make of a container: per engine runtime, the identity rule it meets and the tenant
    /// it lands on; every trap (a pod refused or billed to the wrong tenant, GPU requests
    /// refused, a broken runtime configuration, NVIDIA's toolkit still configured).
    /// Exits 1 on a trap.
    Doctor(doctor::DoctorArgs),
    /// Configure a container engine to run containers through tessera-runtime; refuses a
    /// configuration `tessera doctor` finds a trap in.
    Setup {
        #[command(subcommand)]
        cmd: setup::SetupCmd,
    },
    /// Policy files.
    Policy {
        #[command(subcommand)]
        cmd: PolicyCmd,
    },
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell) for tessera.
    Completions { shell: clap_complete::Shell },
    /// Write tessera's man pages (tessera.1 and one per subcommand) into a directory.
    Man {
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
enum DeviceCmd {
    /// Scrub a quarantined device again; it returns to service only if the scrub succeeds.
    Unquarantine { uuid: String },
}

#[derive(Debug, Subcommand)]
enum PolicyCmd {
    /// Check a policy file; every error names its JSON path.
    Validate { file: PathBuf },
    /// Make tesserad read its --policy file again (as SIGHUP does); a file that does not
    /// validate changes nothing, and neither does a reload on a fleet node whose signed
    /// policy is in force (the answer says why).
    Reload,
    /// The running grants the policy in force would refuse now (tenant, request, rule,
    /// why); `--stop` stops them (SIGTERM, SIGKILL after `--grace` seconds).
    RevokeCheck(revoke::RevokeArgs),
    #[command(flatten)]
    Fleet(fleet::PolicyFleetCmd),
}

fn main() -> ExitCode {
    // SAFETY: the first thing main does, before any thread exists; setting a signal's
    // disposition to its default touches no memory. Rust starts programs with SIGPIPE
    // ignored, so a write to a closed pipe (`tessera usage --json | head -1`) made
    // `println!` panic; with the default, tessera ends quietly as every Unix filter does.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    // The scrub child and the GPU bench print their own reports and choose their exit code.
    match &cli.cmd {
        Cmd::Scrub { args } => return code(scrub::scrub_cli_main(args.clone())),
        Cmd::GpuBench { args } => return code(scrub::gpu_bench_main(args.clone())),
        _ => {}
    }
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tessera: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A device UUID goes into the URL path: only the characters of `GPU-…`/`MIG-…` UUIDs,
/// so nothing the daemon would read as another path is ever sent.
fn check_device_uuid(uuid: &str) -> Result<(), String> {
    let ok = !uuid.is_empty()
        && uuid.len() <= 128
        && uuid.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "unknown device {}: not a device UUID (GPU-… or MIG-…, see `tessera status`)",
            tessera_api::untrusted(uuid).max_chars(128)
        ))
    }
}

fn code(c: i32) -> ExitCode {
    ExitCode::from(u8::try_from(c).unwrap_or(1))
}

/// The subcommand's name when it asks no tesserad (so `--socket` means nothing to it).
fn without_socket(cmd: &Cmd) -> Option<&'static str> {
    match cmd {
        Cmd::Usage { fleet, .. } if fleet.coordinator.is_some() => Some("usage --coordinator"),
        Cmd::Nodes(_) => Some("nodes"),
        Cmd::Quota { .. } => Some("quota"),
        Cmd::Sim { .. } => Some("sim"),
        Cmd::Scrub { .. } => Some("scrub"),
        Cmd::GpuBench { .. } => Some("gpu-bench"),
        Cmd::Completions { .. } => Some("completions"),
        Cmd::Man { .. } => Some("man"),
        Cmd::Policy { cmd: PolicyCmd::Validate { .. } } => Some("policy validate"),
        Cmd::Policy { cmd: PolicyCmd::Fleet(_) } => Some("policy (fleet)"),
        _ => None,
    }
}

fn run(cli: Cli) -> Result<(), String> {
    if let (Some(s), Some(name)) = (&cli.socket, without_socket(&cli.cmd)) {
        return Err(format!(
            "--socket {} does not apply to `tessera {name}`, which asks no tesserad",
            s.display()
        ));
    }
    let socket = cli.socket();
    match cli.cmd {
        Cmd::Version { json } => version(&socket, json),
        Cmd::Status { json } => {
            let status = tessera_api::Client::new(&socket).status().map_err(|e| e.to_string())?;
            if json {
                let text = serde_json::to_string_pretty(&status).map_err(|e| e.to_string())?;
                println!("{text}");
            } else {
                print!("{}", tessera::render::status(&status));
            }
            Ok(())
        }
        Cmd::Top { json, watch } => {
            let client = tessera_api::Client::new(&socket);
            loop {
                let t = client.telemetry().map_err(|e| e.to_string())?;
                if json {
                    let text = serde_json::to_string_pretty(&t).map_err(|e| e.to_string())?;
                    println!("{text}");
                } else {
                    if watch.is_some() {
                        // Clear the screen and go home, as `watch` does.
                        print!("\x1b[2J\x1b[H");
                    }
                    print!("{}", tessera::render::top(&t));
                }
                match watch {
                    Some(s) => std::thread::sleep(std::time::Duration::from_secs(s.clamp(1, 3600))),
                    None => return Ok(()),
                }
            }
        }
        Cmd::Usage { from, to, by, json, csv, verify, file, node_keys, export, fleet } => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0);
            let from_ms =
                tessera::timespec::parse(&from, now).map_err(|e| format!("--from: {e}"))?;
            let to_ms = tessera::timespec::parse(&to, now).map_err(|e| format!("--to: {e}"))?;
            if let Some(path) = file {
                return bill::verify(&fleet, &bill::read(&path)?, &node_keys, json);
            }
            if fleet.coordinator.is_some() {
                if verify {
                    let export = bill::fetch(&fleet, from_ms, to_ms, &by)?;
                    return bill::verify(&fleet, &export, &node_keys, json);
                }
                if let Some(path) = export {
                    let bill = bill::fetch(&fleet, from_ms, to_ms, &by)?;
                    bill::write(&bill, &path)?;
                    println!(
                        "wrote the bill ({} intervals of {} nodes, total cost {:.6}) with its proofs to {}; check it with: tessera usage --verify --file {}",
                        bill.report.total.intervals,
                        bill.nodes.len(),
                        bill.report.total.cost,
                        path.display(),
                        path.display()
                    );
                    return Ok(());
                }
                return fleet::usage(&fleet, from_ms, to_ms, &by, json, csv);
            }
            if verify {
                return bill::verify_node(&socket, json);
            }
            if export.is_some() {
                return Err("--export needs --coordinator: a bill with its proofs is the fleet's (a node's ledger is checked with --verify)".into());
            }
            let path = format!("/v1/usage?from_ms={from_ms}&to_ms={to_ms}&by={by}");
            let report: metering::UsageReport = tessera_api::Client::new(&socket)
                .call::<(), _>("GET", &path, None)
                .map_err(|e| e.to_string())?;
            if json {
                println!("{}", report.to_json());
            } else if csv {
                print!("{}", report.to_csv());
            } else {
                print!("{}", tessera::render::usage(&report));
            }
            Ok(())
        }
        Cmd::Nodes(args) => fleet::nodes(&args),
        Cmd::Quota { cmd } => quota::run(cmd),
        Cmd::Mig { cmd } => mig::run(&socket, cmd),
        Cmd::Scrub { .. } | Cmd::GpuBench { .. } => Ok(()),
        Cmd::Device { cmd: DeviceCmd::Unquarantine { uuid } } => {
            check_device_uuid(&uuid)?;
            let r: serde_json::Value = tessera_api::Client::new(&socket)
                .call::<(), _>("POST", &format!("/v1/devices/{uuid}/unquarantine"), None)
                .map_err(|e| e.to_string())?;
            let state = r["state"]["state"].as_str().unwrap_or("?");
            if state == "free" {
                println!("{uuid}: scrubbed and verified, back in service");
                Ok(())
            } else {
                Err(format!(
                    "{uuid}: still {state}: {}",
                    r["state"]["reason"].as_str().or(r["error"].as_str()).unwrap_or("scrub failed")
                ))
            }
        }
        Cmd::Sim { args } => sim::exec(args),
        Cmd::Completions { shell } => {
            use clap::CommandFactory as _;
            // Into memory first: clap_complete panics on a write error (a closed pipe).
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "tessera", &mut script);
            use std::io::Write as _;
            match std::io::stdout().write_all(&script) {
                Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.to_string()),
                _ => Ok(()),
            }
        }
        Cmd::Man { out } => {
            use clap::CommandFactory as _;
            std::fs::create_dir_all(&out).map_err(|e| format!("--out {}: {e}", out.display()))?;
            clap_mangen::generate_to(Cli::command(), &out)
                .map_err(|e| format!("writing man pages to {}: {e}", out.display()))?;
            println!("man pages written to {}", out.display());
            Ok(())
        }
        Cmd::Setup { cmd } => setup::run(cmd, &socket, cli.socket.is_some()),
        Cmd::Cdi { cmd } => cdi::run(&socket, cmd),
        Cmd::Doctor(a) => doctor::run(a, &socket),
        Cmd::Policy { cmd: PolicyCmd::Fleet(cmd) } => fleet::policy(cmd),
        Cmd::Policy { cmd: PolicyCmd::RevokeCheck(args) } => revoke::run(&socket, args),
        Cmd::Policy { cmd: PolicyCmd::Reload } => {
            let r: tesserad::policy_reload::ReloadReport = tessera_api::Client::new(&socket)
                .call::<(), _>("POST", "/v1/policy/reload", None)
                .map_err(|e| e.to_string())?;
            if r.changed {
                println!(
                    "{}: policy version {} in force (was {}), sha256 {}",
                    r.file, r.current.version, r.previous.version, r.current.digest
                );
            } else {
                println!(
                    "{}: unchanged, policy version {} in force (sha256 {})",
                    r.file, r.current.version, r.current.digest
                );
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

/// `tessera version`: this binary's version, and what tesserad says of itself when it
/// answers (a daemon that does not is reported, not an error: the version is still known).
fn version(socket: &std::path::Path, json: bool) -> Result<(), String> {
    let mine = env!("CARGO_PKG_VERSION");
    let status =
        tessera_api::Client::new(socket).with_timeout(std::time::Duration::from_secs(5)).status();
    if json {
        let daemon = match &status {
            Ok(s) => serde_json::json!({
                "socket": socket.display().to_string(),
                "node": s.node, "backend": s.backend, "gpus": s.gpus.len(),
                "policy": {"version": s.policy.version, "source": s.policy.source,
                           "sha256": s.policy.digest},
            }),
            Err(e) => {
                serde_json::json!({"socket": socket.display().to_string(), "error": e.to_string()})
            }
        };
        let v = serde_json::json!({"tessera": mine, "tesserad": daemon});
        println!("{}", serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?);
        return Ok(());
    }
    println!("tessera {mine}");
    match status {
        Ok(s) => println!(
            "tesserad at {}: node {}, backend {}, {} GPUs, policy version {} ({})",
            socket.display(),
            s.node,
            s.backend,
            s.gpus.len(),
            s.policy.version,
            s.policy.source
        ),
        Err(e) => println!("tesserad: {e}"),
    }
    Ok(())
}
