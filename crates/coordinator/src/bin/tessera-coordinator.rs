//! tessera-coordinator: the fleet coordinator. Flag parsing only; see the `coordinator` crate.
//! It lives in this package, not the root `tessera` one, so that the node's binaries never
//! link the coordinator's server and stores (etcd-client, tonic, prost).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Tessera fleet coordinator: signed, versioned policy for every node; fleet usage.
#[derive(Debug, Parser)]
#[command(name = "tessera-coordinator", version)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// Address to listen on, e.g. 127.0.0.1:7443.
    #[arg(long)]
    listen: SocketAddr,
    /// Store: sqlite:PATH (embedded) or etcd:URL[,URL] (several coordinators).
    #[arg(long)]
    store: coordinator::StoreSpec,
    /// Root of every etcd key (several fleets can share one etcd).
    #[arg(long, default_value = "/tessera")]
    etcd_prefix: String,
    /// The ed25519 signing key (hex or base64 seed; see `keygen`).
    #[arg(long)]
    signing_key: PathBuf,
    /// Credentials: {"admins": {"NAME": "TOKEN"}, "nodes": {"NODE": "TOKEN"}}.
    #[arg(long)]
    tokens: PathBuf,
    /// Serve HTTPS with this certificate chain (PEM, leaf first); needs --tls-key.
    /// Without it the API is plain HTTP: keep it on loopback or behind a TLS proxy, the
    /// bearer tokens would cross the network readable.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Delete uploaded usage intervals that ended more than this many days ago (checked
    /// hourly); 0 keeps them forever.
    #[arg(long, default_value_t = 400)]
    usage_retention_days: u64,
    /// etcd: compact the cluster's history (every key's old values; compaction is
    /// cluster-wide), keeping the revisions of the last this many seconds. 0 never
    /// compacts: then run etcd with --auto-compaction-mode/--auto-compaction-retention.
    #[arg(long, default_value_t = coordinator::store::DEFAULT_HISTORY_RETENTION.as_secs())]
    etcd_compaction_retention_s: u64,
    /// Fleet quotas: how long a lease handed to a node is good for (the node admits
    /// work within guarantees on its own under it while it cannot reach a coordinator).
    #[arg(long, default_value_t = coordinator::quota_routes::DEFAULT_LEASE_TTL.as_secs(), value_parser = clap::value_parser!(u64).range(1..=86_400))]
    quota_lease_ttl_s: u64,
    /// Fleet quotas on etcd: the TTL of the etcd lease by which one coordinator decides
    /// the books (the others pass quota calls on to it). A killed leader is followed
    /// after at most this; etcd grants at least its own minimum (3/2 of its election
    /// timeout: 2 s with etcd's defaults).
    #[arg(long, default_value_t = coordinator::quota_routes::DEFAULT_LEADER_TTL.as_secs(), value_parser = clap::value_parser!(u64).range(1..=600))]
    quota_leader_ttl_s: u64,
    /// This coordinator's URL as the other coordinators reach it (they pass quota calls
    /// on to the one that decides). Default: http(s)://LISTEN, with the host name where
    /// --listen is 0.0.0.0 or [::].
    #[arg(long)]
    advertise_url: Option<String>,
    /// The CA (PEM) the other coordinators' certificates are checked against when quota
    /// calls are passed on to an https:// leader.
    #[arg(long)]
    peer_ca: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Serve the coordinator API until SIGTERM or SIGINT.
    Serve(Box<ServeArgs>),
    /// Write a new signing key (mode 0600, never overwrites) and print its public key,
    /// which nodes pin with `tesserad --trust-key`.
    Keygen {
        #[arg(long)]
        out: PathBuf,
        /// Also write the public key (hex) to this file.
        #[arg(long)]
        public_out: Option<PathBuf>,
    },
    /// Print the public key of a signing key file.
    Pubkey {
        #[arg(long)]
        signing_key: PathBuf,
    },
}

fn main() -> ExitCode {
    tessera_api::init_logging();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tessera-coordinator: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<(), String> {
    use coordinator::signing;
    match cli.cmd {
        Cmd::Serve(args) => {
            let ServeArgs {
                listen,
                store,
                etcd_prefix,
                signing_key,
                tokens,
                tls_cert,
                tls_key,
                usage_retention_days,
                etcd_compaction_retention_s,
                quota_lease_ttl_s,
                quota_leader_ttl_s,
                advertise_url,
                peer_ca,
            } = *args;
            if let Some(u) = &advertise_url {
                if !(u.starts_with("http://") || u.starts_with("https://")) || u.len() > 2048 {
                    return Err(format!(
                        "--advertise-url {u:?}: expected an http:// or https:// URL"
                    ));
                }
            }
            let tls = tls_cert.zip(tls_key);
            let usage_retention = (usage_retention_days > 0).then(|| {
                std::time::Duration::from_secs(usage_retention_days.saturating_mul(24 * 3600))
            });
            let opts = coordinator::ServeOptions {
                listen,
                store,
                etcd_prefix,
                signing_key,
                tokens,
                tls,
                usage_retention,
                etcd_compaction: (etcd_compaction_retention_s > 0)
                    .then(|| std::time::Duration::from_secs(etcd_compaction_retention_s)),
                quota_lease_ttl: std::time::Duration::from_secs(quota_lease_ttl_s),
                quota_leader_ttl: std::time::Duration::from_secs(quota_leader_ttl_s),
                advertise_url: advertise_url.map(|u| u.trim_end_matches('/').to_string()),
                peer_ca,
            };
            let rt = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .map_err(|e| format!("cannot start the async runtime: {e}"))?;
            rt.block_on(coordinator::server::run(opts)).map_err(|e| e.to_string())
        }
        Cmd::Keygen { out, public_out } => {
            let key = signing::generate_signing_key().map_err(|e| e.to_string())?;
            signing::write_signing_key(&out, &key).map_err(|e| e.to_string())?;
            let public = signing::encode_verifying_key(&key.verifying_key());
            if let Some(p) = public_out {
                std::fs::write(&p, format!("{public}\n"))
                    .map_err(|e| format!("{}: {e}", p.display()))?;
            }
            println!("{public}");
            Ok(())
        }
        Cmd::Pubkey { signing_key } => {
            let key = signing::load_signing_key(&signing_key).map_err(|e| e.to_string())?;
            println!("{}", signing::encode_verifying_key(&key.verifying_key()));
            Ok(())
        }
    }
}
