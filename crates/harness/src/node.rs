//! A running tesserad on the simulated H100 node, with a fixture whose runtime is
//! tessera-runtime: the world of the end-to-end tests.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tessera_api::Client;

use crate::*;

/// The CRI annotation the example policy identifies tenants by.
pub const NS: &str = "io.kubernetes.cri.sandbox-namespace";

/// A path in the repository.
pub fn repo(p: &str) -> PathBuf {
    repo_root().join(p)
}

/// How to start the daemon.
#[derive(Debug, Clone)]
pub struct NodeOptions {
    pub policy: PathBuf,
    pub node_file: PathBuf,
    /// `--pending-grace-ms`: by default tesserad's own (60 s), so the reconciler's clock
    /// never decides a create. A GPU container's grant is pending from tesserad's answer to
    /// the wrapper until the prestart hook confirms it, and runc (1.1) writes the container's
    /// `state.json` only after its prestart hooks ran: until the confirm, nothing but this
    /// grace keeps the grant from the reconciler. That window (the wrapper's config edit,
    /// runc's start-up, cgroup and mount set-up, the hook's start) measured 40–100 ms idle
    /// and up to 333 ms with both cores of a 2-core machine busy; the 1.5 s this default
    /// once was raced it on a loaded CI runner (the create failed in its prestart hook:
    /// "has no GPU allocation on this node"). A test about reclaiming never-started grants
    /// sets a short grace itself.
    pub pending_grace_ms: u64,
    /// `--reconcile-interval-ms`: short by default, so tests see vanished containers soon.
    pub reconcile_interval_ms: u64,
    pub extra_args: Vec<String>,
    /// Environment added to the daemon's (beside `TESSERA_LOG=info`), kept across restarts.
    pub env: Vec<(String, String)>,
}

impl Default for NodeOptions {
    fn default() -> Self {
        NodeOptions {
            policy: repo("examples/policy.json"),
            node_file: repo("examples/nodes/h100x8.json"),
            pending_grace_ms: 60_000,
            reconcile_interval_ms: 200,
            extra_args: Vec::new(),
            env: Vec::new(),
        }
    }
}

#[derive(Debug)]
pub struct Node {
    pub fx: Fixture,
    pub daemon: ChildProcess,
    pub socket: PathBuf,
    pub state: PathBuf,
}

impl Node {
    pub fn start() -> Node {
        Node::start_with(NodeOptions::default())
    }

    pub fn start_with(o: NodeOptions) -> Node {
        let mut fx = Fixture::new();
        let socket = fx.socket_path("d.sock");
        let state = fx.path("state");
        let mut args: Vec<String> = vec![
            "--node".into(),
            format!("sim:{}", o.node_file.display()),
            "--policy".into(),
            o.policy.display().to_string(),
            "--state-dir".into(),
            state.display().to_string(),
            "--socket".into(),
            socket.display().to_string(),
            "--reconcile-interval-ms".into(),
            o.reconcile_interval_ms.to_string(),
            "--pending-grace-ms".into(),
            o.pending_grace_ms.to_string(),
        ];
        args.extend(o.extra_args);
        let mut env = vec![("TESSERA_LOG".to_string(), "info".to_string())];
        env.extend(o.env);
        let daemon = fx.spawn("tesserad", tesserad(), &args, env);
        assert!(
            wait_for_socket(&socket, Duration::from_secs(20)),
            "tesserad did not come up:\n{}",
            daemon.stderr()
        );
        let s = socket.display().to_string();
        // The tests see each quota answer as the engine's retry would: a create whose
        // reclaim runs fails at once (`quota_wait_s = 0`), unless a test names another
        // runtime configuration (`TESSERA_RUNTIME_CONFIG` for one call: `Fixture::create_container_env`).
        let config = fx.path("runtime-test.toml");
        std::fs::write(&config, "quota_wait_s = 0\n").expect("runtime config");
        let config = config.display().to_string();
        fx.set_runtime(
            tessera_runtime(),
            &[
                ("TESSERA_RUNC", RUNC),
                ("TESSERA_SOCKET", &s),
                ("TESSERA_HOOK", tessera_hook()),
                ("TESSERA_RUNTIME_CONFIG", &config),
            ],
        );
        Node { fx, daemon, socket, state }
    }

    /// What the simulated device `uuid` runs from now on, as the sim backend reads it
    /// (`<state>/sim/load/<uuid>.json`, written whole): (pid, SM demand, bandwidth demand)
    /// per process.
    pub fn set_sim_load(&self, uuid: &str, load: &[(i32, f64, f64)]) {
        let dir = self.state.join("sim/load");
        std::fs::create_dir_all(&dir).expect("sim load dir");
        let v: Vec<serde_json::Value> = load
            .iter()
            .map(|(pid, sm, bw)| serde_json::json!({"pid": pid, "sm": sm, "bw": bw}))
            .collect();
        let tmp = dir.join(format!("{uuid}.tmp"));
        std::fs::write(&tmp, serde_json::to_vec(&v).expect("load json")).expect("write load");
        std::fs::rename(&tmp, dir.join(format!("{uuid}.json"))).expect("rename load");
    }

    /// Telemetry samples tesserad has taken so far (0 while it cannot say).
    pub fn telemetry_samples(&self) -> u64 {
        self.client().telemetry().map(|t| t.samples).unwrap_or(0)
    }

    /// Waits until `n` more telemetry samples were taken (what the detector has seen);
    /// fails the test, with the daemon's log, after `within`.
    pub fn wait_telemetry_samples(&self, n: u64, within: std::time::Duration) {
        let from = self.telemetry_samples();
        assert!(
            crate::wait_for(|| self.telemetry_samples() >= from + n, within),
            "telemetry did not advance by {n} samples:\n{}",
            self.daemon.stderr()
        );
    }

    pub fn client(&self) -> Client {
        Client::new(&self.socket).with_timeout(Duration::from_secs(10))
    }

    /// Wait until the daemon answers again (after a restart).
    pub fn wait_ready(&self) {
        let c = self.client();
        assert!(
            wait_for(|| c.status().is_ok(), Duration::from_secs(20)),
            "tesserad did not come back:\n{}",
            self.daemon.stderr()
        );
    }

    /// kill -9 the daemon and start it again on the same state.
    pub fn crash_and_restart(&mut self) {
        self.daemon.kill9();
        self.restart();
    }

    /// Start the (stopped) daemon again with the same arguments.
    pub fn restart(&mut self) {
        self.daemon.restart();
        self.fx.cleanup().track_pid(self.daemon.pid());
        self.wait_ready();
    }

    /// A bundle running `args` for the tenant behind namespace `ns`, asking for `request`.
    pub fn bundle(&self, id: &str, ns: &str, request: Option<&str>, args: &[&str]) -> Bundle {
        let mut b = self.fx.bundle(id);
        b.args(args).annotation(NS, ns);
        if let Some(r) = request {
            b.annotation("tessera.io/gpu", r);
        }
        b.write();
        b
    }

    /// (container id, tenant, request) of every allocation the daemon holds now.
    pub fn grants(&self) -> Vec<(String, String, String)> {
        self.client()
            .status()
            .expect("status")
            .allocations
            .iter()
            .map(|a| (a.container_id.to_string(), a.tenant.to_string(), a.request.to_string()))
            .collect()
    }

    /// A tessera-runtime configuration file's text (docs/INSTALL.md) for this daemon: its
    /// socket, runc as found on PATH (absolute, as the file requires), the hook under test,
    /// and `engine` when given.
    pub fn runtime_config(&self, engine: Option<&str>) -> String {
        let runc = crate::run_cmd(Command::new("sh").args(["-c", "command -v runc"]));
        let runc = String::from_utf8_lossy(&runc.stdout).trim().to_string();
        assert!(runc.starts_with('/'), "runc on PATH, absolute: `{runc}`");
        let mut t = format!(
            "socket = \"{}\"\nrunc = \"{runc}\"\nhook = \"{}\"\n",
            self.socket.display(),
            crate::tessera_hook()
        );
        if let Some(e) = engine {
            t.push_str(&format!("engine = \"{e}\"\n"));
        }
        t
    }

    /// `tessera ARGS..` against this daemon.
    pub fn cli(&self, args: &[&str]) -> std::process::Output {
        run_cmd(
            std::process::Command::new(tessera_cli()).arg("--socket").arg(&self.socket).args(args),
        )
    }
}

/// A free TCP port on 127.0.0.1 (bound and released; fine for tests on one machine).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// `GET http://127.0.0.1:PORT/PATH` body, with a plain HTTP/1.0 request.
pub fn http_get(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read");
    out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or(out)
}

/// The example policy with the interference controller on (it confirms and clears after
/// `confirm` samples; a throttle halves the cap), `settings` merged into its
/// `interference` section and `extra` at the top level.
pub fn write_interference_policy(
    path: &Path,
    confirm: u32,
    settings: serde_json::Value,
    extra: serde_json::Value,
) {
    let mut v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(repo("examples/policy.json")).expect("policy"))
            .expect("policy json");
    v["interference"] = serde_json::json!({
        "enabled": true,
        "confirm_samples": confirm,
        "clear_samples": confirm,
        "throttle_factor_percent": 50,
    });
    if let serde_json::Value::Object(m) = settings {
        for (k, x) in m {
            v["interference"][k] = x;
        }
    }
    if let serde_json::Value::Object(m) = extra {
        for (k, x) in m {
            v[k] = x;
        }
    }
    std::fs::write(path, serde_json::to_vec_pretty(&v).expect("json")).expect("write policy");
}

/// A simulated node on MPS for interference tests, its files under `files`: `gpus` whole
/// H100s and one in MIG mode (a hardened start's), the MPS control test double (health
/// checks every 200 ms), telemetry every `interval_ms`, and the interference controller on
/// ([`write_interference_policy`]) with `settings` merged into its section.
pub fn start_interference_node(
    files: &Path,
    gpus: usize,
    confirm: u32,
    interval_ms: u64,
    settings: serde_json::Value,
) -> Node {
    let (policy, node_file) = (files.join("policy.json"), files.join("node.json"));
    write_interference_policy(&policy, confirm, settings, serde_json::json!({}));
    let mut list: Vec<&str> = vec![r#"{"model": "H100-80GB"}"#; gpus];
    list.push(r#"{"model": "H100-80GB", "mig": []}"#);
    std::fs::write(&node_file, format!(r#"{{"node": "sim-mps", "gpus": [{}]}}"#, list.join(",")))
        .expect("node file");
    let node = Node::start_with(NodeOptions {
        policy,
        node_file,
        extra_args: vec![
            "--mps-control".into(),
            crate::fresh_bin("fake-nvidia-cuda-mps-control").into(),
            "--mps-health-interval-ms".into(),
            "200".into(),
            "--telemetry-interval-ms".into(),
            interval_ms.to_string(),
        ],
        ..Default::default()
    });
    node.fx.cleanup().track_dir(files);
    node
}
