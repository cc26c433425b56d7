//! What tessera-runtime adds to a container start: `runc run` of one busybox container
//! (`true`), plain runc vs through tessera-runtime without a GPU request vs with a MIG
//! request (daemon round trip, durable grant, prestart confirm, release by the wrapper
//! once runc has removed the container), interleaved in one run so all three see the
//! same machine.
//!
//! Needs root, runc and busybox-static. `cargo bench --bench runtime_overhead [-- N]`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const RUNTIME: &str = env!("CARGO_BIN_EXE_tessera-runtime");
const HOOK: &str = env!("CARGO_BIN_EXE_tessera-hook");
const DAEMON: &str = env!("CARGO_BIN_EXE_tesserad");
/// Pause before each timed run, so background work of the previous one is over.
const SETTLE_MS: u64 = 30;

struct Bench {
    dir: PathBuf,
    cgroup: String,
    daemon: Option<Child>,
}

impl Drop for Bench {
    fn drop(&mut self) {
        let root = self.dir.join("runc-root");
        if let Ok(out) = Command::new("runc").arg("--root").arg(&root).args(["list", "-q"]).output()
        {
            for id in String::from_utf8_lossy(&out.stdout).lines() {
                let _ = Command::new("runc")
                    .arg("--root")
                    .arg(&root)
                    .args(["delete", "-f", id])
                    .status();
            }
        }
        if let Some(mut d) = self.daemon.take() {
            let _ = d.kill();
            let _ = d.wait();
        }
        if let Ok(hier) = std::fs::read_dir("/sys/fs/cgroup") {
            for h in hier.flatten() {
                let base = h.path().join(self.cgroup.trim_start_matches('/'));
                if let Ok(children) = std::fs::read_dir(&base) {
                    for c in children.flatten() {
                        if c.path().is_dir() {
                            let _ = std::fs::remove_dir(c.path());
                        }
                    }
                }
                let _ = std::fs::remove_dir(&base);
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn config(rootfs: &Path, cgroup: &str, id: &str, annotations: &[(&str, &str)]) -> String {
    let ann: serde_json::Map<String, serde_json::Value> = annotations
        .iter()
        .map(|(k, v)| (k.to_string(), serde_json::Value::String(v.to_string())))
        .collect();
    serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {"terminal": false, "user": {"uid": 0, "gid": 0}, "cwd": "/", "args": ["/bin/busybox", "true"],
                    "env": ["PATH=/bin"], "noNewPrivileges": true},
        "root": {"path": rootfs, "readonly": true},
        "hostname": "bench",
        "annotations": ann,
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}
        ],
        "linux": {
            "cgroupsPath": format!("{cgroup}/{id}"),
            "resources": {"devices": [{"allow": false, "access": "rwm"}]},
            "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "network"}]
        }
    })
    .to_string()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn stats(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    (percentile(&v, 0.5), percentile(&v, 0.99), v.iter().sum::<f64>() / v.len() as f64)
}

fn main() {
    let n: usize = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(200);
    if unsafe_is_not_root() {
        eprintln!("runtime_overhead: needs root (real runc containers); skipped");
        return;
    }
    let dir = PathBuf::from(format!("/tmp/tessera-bench-{}", std::process::id()));
    let mut bench = Bench {
        dir: dir.clone(),
        cgroup: format!("/tessera-bench-{}", std::process::id()),
        daemon: None,
    };
    let rootfs = dir.join("rootfs");
    std::fs::create_dir_all(rootfs.join("bin")).expect("rootfs");
    for d in ["dev", "proc", "tmp"] {
        std::fs::create_dir_all(rootfs.join(d)).expect("rootfs dir");
    }
    std::fs::copy("/bin/busybox", rootfs.join("bin/busybox")).expect("busybox");
    let socket = dir.join("d.sock");
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let daemon = Command::new(DAEMON)
        .arg("--node")
        .arg(format!("sim:{}", repo.join("examples/nodes/h100x8.json").display()))
        .arg("--policy")
        .arg(repo.join("examples/policy.json"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .arg("--socket")
        .arg(&socket)
        .env("TESSERA_LOG", "warn")
        .stderr(Stdio::inherit())
        .spawn()
        .expect("tesserad");
    bench.daemon = Some(daemon);
    let t0 = Instant::now();
    while !socket.exists() && t0.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(20));
    }

    let root = dir.join("runc-root");
    let run = |bin: &str, kind: &str, i: usize, ann: &[(&str, &str)]| -> f64 {
        let id = format!("{kind}{i}");
        let bundle = dir.join("bundles").join(&id);
        std::fs::create_dir_all(&bundle).expect("bundle");
        std::fs::write(bundle.join("config.json"), config(&rootfs, &bench.cgroup, &id, ann))
            .expect("config");
        let start = Instant::now();
        let status = Command::new(bin)
            .arg("--root")
            .arg(&root)
            .args(["run", "--bundle"])
            .arg(&bundle)
            .arg(&id)
            .env("TESSERA_RUNC", "runc")
            .env("TESSERA_SOCKET", &socket)
            .env("TESSERA_HOOK", HOOK)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .status()
            .expect("run");
        let ms = start.elapsed().as_secs_f64() * 1e3;
        assert!(status.success(), "{kind} run {i} failed");
        let _ = std::fs::remove_dir_all(&bundle);
        ms
    };
    let gpu_ann = [
        ("io.kubernetes.cri.sandbox-namespace", "team-untrusted"),
        ("tessera.io/gpu", "mig=1g.10gb"),
    ];
    // Warm caches (binaries, page cache, SQLite) before measuring.
    for i in 0..5 {
        run("runc", "w", i, &[]);
        run(RUNTIME, "wn", i, &[]);
        run(RUNTIME, "wg", i, &gpu_ann);
    }
    let (mut plain, mut nogpu, mut gpu) = (Vec::new(), Vec::new(), Vec::new());
    let (mut d_nogpu, mut d_gpu) = (Vec::new(), Vec::new());
    for i in 0..n {
        // The order turns each iteration, and each run starts on a settled machine (the
        // scrub child a GPU release sets off, ~2 ms, is over): no path is always the one
        // that runs right after the GPU container's background work.
        let (mut p, mut w, mut g) = (0.0, 0.0, 0.0);
        for k in 0..3 {
            std::thread::sleep(Duration::from_millis(SETTLE_MS));
            match (i + k) % 3 {
                0 => p = run("runc", "p", i, &[]),
                1 => w = run(RUNTIME, "n", i, &[]),
                _ => g = run(RUNTIME, "g", i, &gpu_ann),
            }
        }
        plain.push(p);
        nogpu.push(w);
        gpu.push(g);
        d_nogpu.push(w - p);
        d_gpu.push(g - p);
    }
    let (pp50, pp99, pmean) = stats(plain);
    let (np50, np99, nmean) = stats(nogpu);
    let (gp50, gp99, gmean) = stats(gpu);
    let (dn50, dn99, _) = stats(d_nogpu);
    let (dg50, dg99, _) = stats(d_gpu);
    println!("runc run of one busybox `true` container, {n} interleaved runs each (ms)\n");
    println!("| path | p50 | p99 | mean | ratio to plain (p50) |");
    println!("|---|---|---|---|---|");
    println!("| plain runc | {pp50:.2} | {pp99:.2} | {pmean:.2} | 1.00 |");
    println!(
        "| tessera-runtime, no GPU request | {np50:.2} | {np99:.2} | {nmean:.2} | {:.3} |",
        np50 / pp50
    );
    println!("| tessera-runtime, mig=1g.10gb (grant + hooks) | {gp50:.2} | {gp99:.2} | {gmean:.2} | {:.3} |", gp50 / pp50);
    println!("\nadded latency, paired per iteration (ms): no request p50 {dn50:.2} p99 {dn99:.2}; MIG request p50 {dg50:.2} p99 {dg99:.2}");

    parts(n, &dir, &socket, &root, &gpu_ann);
}

/// The GPU path by parts, each timed alone (so runc's jitter is not in them): the three
/// daemon round trips a GPU container makes, each after the daemon has been idle (as it is
/// between container events), and the start cost of the wrapper and of the hook process
/// against `/bin/true`.
fn parts(n: usize, dir: &Path, socket: &Path, runc_root: &Path, ann: &[(&str, &str)]) {
    let client = tessera_api::Client::new(socket).with_timeout(Duration::from_secs(30));
    let bundle = dir.join("parts-bundle");
    std::fs::create_dir_all(&bundle).expect("bundle");
    let annotations = ann.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let timed = |f: &mut dyn FnMut()| {
        std::thread::sleep(Duration::from_millis(SETTLE_MS));
        let t = Instant::now();
        f();
        t.elapsed().as_secs_f64() * 1e3
    };
    let (mut alloc, mut start, mut release, mut health) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..n {
        let id = format!("parts{i}");
        let req = tessera_api::AllocateRequest {
            container_id: id.parse().expect("container id"),
            runc_root: runc_root.to_string_lossy().into_owned(),
            bundle: bundle.to_string_lossy().into_owned(),
            request: tessera_api::GpuRequest::Mig { profile: "1g.10gb".into() },
            request_source: tessera_api::RequestSource::Annotation,
            annotations: std::collections::BTreeMap::clone(&annotations),
            limits: None,
        };
        alloc.push(timed(&mut || {
            client.allocate(&req).expect("allocate");
        }));
        let sreq = tessera_api::StartRequest {
            pid: std::process::id() as i32,
            bundle: bundle.to_string_lossy().into_owned(),
        };
        start.push(timed(&mut || {
            client.start(&id, &sreq).expect("start");
        }));
        release.push(timed(&mut || client.release(&id).expect("release")));
        health.push(timed(&mut || {
            client.raw("GET", "/healthz", None).expect("healthz");
        }));
    }
    let spawn = |program: &str, args: &[&str], env: &[(&str, &str)]| {
        let mut cmd = Command::new(program);
        cmd.args(args).envs(env.iter().copied());
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
        move || {
            let _ = cmd.status().expect("spawn");
        }
    };
    let (mut t_true, mut t_wrapper, mut t_hook) = (Vec::new(), Vec::new(), Vec::new());
    let mut run_true = spawn("/bin/true", &[], &[]);
    // `--version` passes straight through: the wrapper's start, argv parse and exec.
    let mut run_wrapper = spawn(RUNTIME, &["--version"], &[("TESSERA_RUNC", "/bin/true")]);
    // Empty stdin: the hook starts, finds no OCI state and exits.
    let mut run_hook = spawn(HOOK, &["prestart"], &[]);
    for _ in 0..n {
        t_true.push(timed(&mut run_true));
        t_wrapper.push(timed(&mut run_wrapper));
        t_hook.push(timed(&mut run_hook));
    }
    println!("\nby parts, {n} each, every one after a {SETTLE_MS} ms pause (ms)\n");
    println!("| part | p50 | p99 |");
    println!("|---|---|---|");
    for (name, v) in [
        ("POST /v1/allocations (grant, durable)", alloc),
        ("POST /v1/allocations/{id}/start (prestart hook's call: interval open, durable)", start),
        ("DELETE /v1/allocations/{id} (the wrapper's release: interval close, durable)", release),
        ("GET /healthz (round trip without SQLite, for scale)", health),
        ("spawn /bin/true (baseline)", t_true),
        ("spawn tessera-runtime --version, exec /bin/true", t_wrapper),
        ("spawn tessera-hook with no state", t_hook),
    ] {
        let (p50, p99, _) = stats(v);
        println!("| {name} | {p50:.3} | {p99:.3} |");
    }
}

fn unsafe_is_not_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() != 0 }
}
