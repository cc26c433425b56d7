//! A fleet on loopback for end-to-end tests: etcd, signing keys and tokens in one temp
//! dir, `tessera-coordinator` processes on that etcd, and tesserad nodes on simulated
//! H100 nodes following them. Used by `tests/fleet.rs` and `tests/quotas.rs`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use serde_json::Value;

use crate::node::{free_port, repo, Node, NodeOptions};
use crate::{fresh_bin, run_cmd, tessera_cli, wait_for, ChildProcess, OutputExt};

/// The admin credential every fleet fixture issues (admin name `alice`).
pub const ADMIN_TOKEN: &str = "admin-token-alice-0123456789abcdef";

/// How long a fixture waits for a process to come up.
pub const WITHIN: Duration = Duration::from_secs(30);

/// The token of node `node`.
pub fn node_token(node: &str) -> String {
    format!("node-token-{node}-0123456789abcdef")
}

/// The `tessera-coordinator` binary. It belongs to the `coordinator` package (the root
/// package must not link the coordinator), so cargo does not build it for root tests:
/// [`fresh_bin`] builds it once per test run into the target dir that holds `tesserad`.
pub fn coordinator_bin() -> &'static str {
    fresh_bin("tessera-coordinator")
}

/// Keys, tokens and etcd, in one temp dir; etcd is killed on drop.
#[derive(Debug)]
pub struct FleetFixture {
    pub dir: tempfile::TempDir,
    pub key_file: PathBuf,
    /// The signing key's public half, hex (what nodes pin with `--trust-key`).
    pub public_key: String,
    pub tokens_file: PathBuf,
    pub etcd_url: String,
    // Dropped last (fields drop in order): nothing that uses etcd outlives it.
    _etcd: ChildProcess,
}

impl FleetFixture {
    /// etcd and keys on loopback, with node tokens for `nodes`; fails (never skips) without
    /// etcd.
    pub fn launch(nodes: &[&str]) -> FleetFixture {
        FleetFixture::launch_with(nodes, &[])
    }

    /// [`FleetFixture::launch`] with `etcd_args` added to etcd's command line (e.g. a
    /// shorter `--election-timeout`: etcd's shortest lease is 3/2 of it).
    pub fn launch_with(nodes: &[&str], etcd_args: &[&str]) -> FleetFixture {
        let dir = tempfile::Builder::new().prefix("tessera-fleet-").tempdir().expect("tempdir");
        let key_file = dir.path().join("signing.key");
        let out =
            run_cmd(Command::new(coordinator_bin()).arg("keygen").arg("--out").arg(&key_file));
        out.assert_success("tessera-coordinator keygen");
        let public_key = out.stdout_str().trim().to_string();
        assert_eq!(public_key.len(), 64, "keygen prints the public key as hex: {public_key:?}");
        let tokens_file = dir.path().join("tokens.json");
        let node_tokens: serde_json::Map<String, Value> =
            nodes.iter().map(|n| (n.to_string(), Value::from(node_token(n)))).collect();
        let tokens = serde_json::json!({"admins": {"alice": ADMIN_TOKEN}, "nodes": node_tokens});
        std::fs::write(&tokens_file, tokens.to_string()).expect("tokens file");

        let (client, peer) = (free_port(), free_port());
        let etcd_url = format!("http://127.0.0.1:{client}");
        let peer_url = format!("http://127.0.0.1:{peer}");
        let data = dir.path().join("etcd-data");
        let etcd = ChildProcess::spawn(
            "etcd",
            "etcd",
            [
                "--name".to_string(),
                "t".into(),
                "--data-dir".into(),
                data.display().to_string(),
                "--listen-client-urls".into(),
                etcd_url.clone(),
                "--advertise-client-urls".into(),
                etcd_url.clone(),
                "--listen-peer-urls".into(),
                peer_url.clone(),
                "--initial-advertise-peer-urls".into(),
                peer_url.clone(),
                "--initial-cluster".into(),
                format!("t={peer_url}"),
                "--initial-cluster-state".into(),
                "new".into(),
            ]
            .into_iter()
            .chain(etcd_args.iter().map(|a| a.to_string())),
            std::iter::empty::<(&str, &str)>(),
            &dir.path().join("logs"),
        );
        let healthy = wait_for(
            || {
                http(&etcd_url, "GET", "/health", None, None)
                    .is_some_and(|(s, b)| s == 200 && b.contains("true"))
            },
            WITHIN,
        );
        assert!(healthy, "etcd did not become healthy:\n{}", etcd.stderr());
        FleetFixture { dir, key_file, public_key, tokens_file, etcd_url, _etcd: etcd }
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.path().join(rel)
    }

    pub fn log_dir(&self) -> PathBuf {
        self.path("logs")
    }

    /// A coordinator on `addr` over this fleet's etcd, with `extra` arguments to `serve`.
    pub fn coordinator(&self, name: &str, addr: SocketAddr, extra: &[&str]) -> Coordinator {
        let mut args = vec![
            "serve".to_string(),
            "--listen".into(),
            addr.to_string(),
            "--store".into(),
            format!("etcd:{}", self.etcd_url),
            "--etcd-prefix".into(),
            "/tessera-test".into(),
            "--signing-key".into(),
            self.key_file.display().to_string(),
            "--tokens".into(),
            self.tokens_file.display().to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let proc = ChildProcess::spawn(
            name,
            coordinator_bin(),
            args,
            [("TESSERA_LOG", "info")],
            &self.log_dir(),
        );
        let c = Coordinator { proc, url: format!("http://{addr}") };
        c.wait_healthy();
        c
    }

    /// A coordinator on a free loopback port.
    pub fn coordinator_on_free_port(&self, name: &str, extra: &[&str]) -> Coordinator {
        self.coordinator(name, SocketAddr::from(([127, 0, 0, 1], free_port())), extra)
    }

    /// A tesserad on a simulated 8×H100 node named `name` (examples/nodes/h100x8.json),
    /// bootstrapped from `policy` and following `coordinators`, with `extra` arguments.
    pub fn node(&self, name: &str, coordinators: &str, policy: &Path, extra: &[&str]) -> Node {
        let desc: Value = serde_json::from_slice(
            &std::fs::read(repo("examples/nodes/h100x8.json")).expect("node file"),
        )
        .expect("json");
        self.node_described(name, desc, coordinators, policy, extra)
    }

    /// [`FleetFixture::node`] on the simulated node `desc` (a `sim:` node file's JSON; its
    /// `node` is set to `name`).
    pub fn node_described(
        &self,
        name: &str,
        mut desc: Value,
        coordinators: &str,
        policy: &Path,
        extra: &[&str],
    ) -> Node {
        desc["node"] = Value::from(name);
        let node_file = self.path(&format!("{name}.json"));
        std::fs::write(&node_file, desc.to_string()).expect("node file");
        let token_file = self.path(&format!("{name}.token"));
        std::fs::write(&token_file, format!("{}\n", node_token(name))).expect("token file");
        std::fs::set_permissions(&token_file, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .expect("chmod");
        let mut extra_args: Vec<String> = [
            "--coordinator",
            coordinators,
            "--trust-key",
            &self.public_key,
            "--node-token",
            &token_file.display().to_string(),
            "--coordinator-poll-timeout-ms",
            "2000",
            "--coordinator-report-interval-ms",
            "300",
            "--coordinator-retry-max-ms",
            "300",
            "--usage-upload-interval-ms",
            "300",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        extra_args.extend(extra.iter().map(|s| s.to_string()));
        let node = Node::start_with(NodeOptions {
            policy: policy.to_path_buf(),
            node_file,
            pending_grace_ms: 600_000,
            extra_args,
            ..NodeOptions::default()
        });
        // The operator's step: pin the node's usage signing key at the coordinator (best
        // effort: a test whose coordinator is not up yet pins it with `register_key`).
        self.register_key(coordinators, &node);
        node
    }

    /// The node's public usage signing key, as its status shows it.
    pub fn node_key(node: &Node) -> String {
        let s = node.client().status().expect("node status");
        s.node_key.expect("the node shows its key").public_key
    }

    /// Pin `node`'s key at the first of `coordinators` that answers (as an admin would with
    /// `tessera nodes register-key`); whether one did.
    pub fn register_key(&self, coordinators: &str, node: &Node) -> bool {
        let name = node.client().status().expect("node status").node;
        let body = serde_json::json!({"public_key": Self::node_key(node)}).to_string();
        coordinators.split(',').map(str::trim).filter(|u| !u.is_empty()).any(|url| {
            let path = format!("/v1/nodes/{name}/key");
            http(url, "PUT", &path, Some(ADMIN_TOKEN), Some(body.as_bytes()))
                .is_some_and(|(s, _)| s == 200 || s == 201)
        })
    }

    /// `tessera ARGS.. --coordinator URLS --token ADMIN`.
    pub fn admin(&self, coordinators: &str, args: &[&str]) -> Output {
        tessera(&[args, &["--coordinator", coordinators, "--token", ADMIN_TOKEN]].concat())
    }

    /// Push the policy in `file` (whose version is `version`) through `tessera policy push`.
    pub fn push_file(&self, coordinators: &str, file: &Path, version: u64) {
        let out = self.admin(coordinators, &["policy", "push", &file.display().to_string()]);
        out.assert_success("tessera policy push");
        assert!(
            out.stdout_str().contains(&format!("pushed policy version {version}")),
            "{}",
            out.stdout_str()
        );
    }
}

/// A coordinator process and its URL.
#[derive(Debug)]
pub struct Coordinator {
    pub proc: ChildProcess,
    pub url: String,
}

impl Coordinator {
    pub fn wait_healthy(&self) {
        let ok = wait_for(
            || http(&self.url, "GET", "/v1/health", None, None).is_some_and(|(s, _)| s == 200),
            WITHIN,
        );
        assert!(
            ok,
            "{} did not come up at {}:\n{}",
            self.proc.name(),
            self.url,
            self.proc.stderr()
        );
    }
    /// A crash.
    pub fn kill9(&mut self) {
        self.proc.kill9();
    }
    /// SIGTERM: long polls are answered 503 so nodes move on at once.
    pub fn stop(&mut self) {
        self.proc.terminate(Duration::from_secs(10));
    }
    /// Start again on the same address and store.
    pub fn restart(&mut self) {
        self.proc.restart();
        self.wait_healthy();
    }
}

/// One HTTP/1.1 request with `Connection: close`; `None` when nothing answered.
pub fn http(
    url: &str,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: Option<&[u8]>,
) -> Option<(u16, String)> {
    let authority = url.trim_start_matches("http://");
    let mut s = TcpStream::connect(authority).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    let body = body.unwrap_or(b"");
    let mut req = format!("{method} {path} HTTP/1.1\r\nhost: {authority}\r\nconnection: close\r\ncontent-length: {}\r\n", body.len());
    if let Some(t) = token {
        req.push_str(&format!("authorization: Bearer {t}\r\n"));
    }
    req.push_str("content-type: application/json\r\n\r\n");
    s.write_all(req.as_bytes()).ok()?;
    s.write_all(body).ok()?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).ok()?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    Some((status, rest.to_string()))
}

/// `tessera ARGS..` with no coordinator or token from the environment.
pub fn tessera(args: &[&str]) -> Output {
    run_cmd(
        Command::new(tessera_cli())
            .args(args)
            .env_remove("TESSERA_COORDINATOR")
            .env_remove("TESSERA_TOKEN"),
    )
}
