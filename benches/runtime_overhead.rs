//! What tessera-runtime adds to a container start: `runc run` of one busybox container
//! (`true`), plain runc vs through tessera-runtime without a GPU request vs with a MIG
//! request (daemon round trip, durable grant, the prestart hook's confirm; the grant
//! given back by tesserad when runc removes the container), interleaved in one run so all
//! three see the same machine.
//!
//! Then (issue 15) what fleet-quota admission adds to a GPU container's start: `gpu=1`
//! on a simulated 8×H100 node without MIG through three tesserads, (a) the policy without
//! quotas, (b) with quotas and the node keeping its own books, (c) with quotas following a
//! `tessera-coordinator` on loopback (etcd-backed, tessera-harness's fleet fixture),
//! interleaved the same way; the admit round trip alone (client → coordinator); and each
//! daemon's grant round trip alone.
//!
//! Needs root, runc, busybox-static and etcd.
//! `cargo bench --bench runtime_overhead [-- N] [--quota-only|--wrapper-only]`
//! (`--quota-only`: only the issue 15 part; `--wrapper-only`: all but it). The wrapper part
//! times a single `runc run` and (issue 29) the create/start/delete sequence a shim drives
//! (in all and by step).
//! `TESSERA_BENCH_BINS=DIR`: tessera-runtime, tessera-hook and tesserad from DIR instead of
//! this build's (two builds compared in one load window). The installed build is
//! `scripts/static-shims.sh DIR` (what scripts/install.sh puts on a node: the two shims
//! linked static); without it the bench runs cargo's dynamic build of this tree.
//! runc's root, the bundles and tesserad's socket live on a tmpfs of the bench's own, as
//! `/run` is on a node; tesserad's databases and the rootfs on disk ([`run_dir`]).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tessera_harness::fleet_fixture::{node_token, FleetFixture, ADMIN_TOKEN};
use tessera_harness::ChildProcess;

/// The binaries under test: this build's, or (`TESSERA_BENCH_BINS=DIR`, for a comparison
/// of two builds in one load window) `DIR/tessera-runtime`, `DIR/tessera-hook` and
/// `DIR/tesserad`.
static BINS: std::sync::LazyLock<[String; 3]> = std::sync::LazyLock::new(|| {
    let built = [
        env!("CARGO_BIN_EXE_tessera-runtime"),
        env!("CARGO_BIN_EXE_tessera-hook"),
        env!("CARGO_BIN_EXE_tesserad"),
    ];
    match std::env::var_os("TESSERA_BENCH_BINS") {
        Some(dir) => ["tessera-runtime", "tessera-hook", "tesserad"]
            .map(|b| Path::new(&dir).join(b).to_string_lossy().into_owned()),
        None => built.map(str::to_owned),
    }
});
fn runtime() -> &'static str {
    &BINS[0]
}
fn hook() -> &'static str {
    &BINS[1]
}
fn daemon() -> &'static str {
    &BINS[2]
}

/// Pause before each timed run, so background work of the previous one is over.
const SETTLE_MS: u64 = 30;
/// The annotation the example policy reads the tenant from.
const NAMESPACE_KEY: &str = "io.kubernetes.cri.sandbox-namespace";

struct Bench {
    dir: PathBuf,
    cgroup: String,
    daemon: Option<Child>,
}

impl Drop for Bench {
    fn drop(&mut self) {
        let root = run_dir(&self.dir).join("runc");
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
        let _ = nix::mount::umount2(&run_dir(&self.dir), nix::mount::MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The bench's `/run`: a tmpfs of its own under `dir`, as `/run` is on a node (systemd
/// mounts one), holding what a node keeps there: runc's root (`/run/runc`: its state.json,
/// the exec fifo, Tessera's confirmation marker), tesserad's socket directory
/// (`/run/tessera`: the socket and the list of the grants' cgroups) and the bundles (a
/// containerd shim's are in `/run/containerd/io.containerd.runtime.v2.task/`: the
/// config.json tessera-runtime rewrites). tesserad's databases and the rootfs stay on disk
/// under `dir`, as `/var/lib/tessera` and the image layers are.
fn run_dir(dir: &Path) -> PathBuf {
    dir.join("run")
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
    eprintln!("runtime_overhead: testing {}, {}, {}", runtime(), hook(), daemon());
    let args: Vec<String> = std::env::args().skip(1).collect();
    let n: usize = args.iter().find_map(|a| a.parse().ok()).unwrap_or(200);
    let quota_only = args.iter().any(|a| a == "--quota-only");
    let wrapper_only = args.iter().any(|a| a == "--wrapper-only");
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
    std::fs::create_dir_all(run_dir(&dir)).expect("run dir");
    nix::mount::mount(
        Some("tmpfs"),
        &run_dir(&dir),
        Some("tmpfs"),
        nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV,
        Some("mode=0755,size=64m"),
    )
    .expect("a tmpfs for the bench's /run");
    std::fs::create_dir_all(run_dir(&dir).join("tessera")).expect("socket dir");
    let root = run_dir(&dir).join("runc");
    if !quota_only {
        wrapper_paths(n, &mut bench, &rootfs, &root);
        // Its daemon is idle from here on: stopped, so the next part has the machine.
        if let Some(mut d) = bench.daemon.take() {
            let _ = d.kill();
            let _ = d.wait();
        }
    }
    if !wrapper_only {
        quota_paths(n, &dir, &rootfs, &bench.cgroup, &root);
    }
}

/// Issue 2's paths: plain runc, tessera-runtime without a request, with `mig=1g.10gb`;
/// then [`parts`].
fn wrapper_paths(n: usize, bench: &mut Bench, rootfs: &Path, root: &Path) {
    let dir = bench.dir.clone();
    let socket = run_dir(&dir).join("tessera").join("d.sock");
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let child = Command::new(daemon())
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
    bench.daemon = Some(child);
    let t0 = Instant::now();
    while !socket.exists() && t0.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(20));
    }

    let cgroup = bench.cgroup.clone();
    let run = |bin: &str, kind: &str, i: usize, ann: &[(&str, &str)]| -> f64 {
        let id = format!("{kind}{i}");
        let bundle = run_dir(&dir).join("bundles").join(&id);
        runc_run(bin, root, &bundle, &config(rootfs, &cgroup, &id, ann), &socket, &id)
    };
    let gpu_ann = [(NAMESPACE_KEY, "team-untrusted"), ("tessera.io/gpu", "mig=1g.10gb")];
    // Warm caches (binaries, page cache, SQLite) before measuring.
    for i in 0..5 {
        run("runc", "w", i, &[]);
        run(runtime(), "wn", i, &[]);
        run(runtime(), "wg", i, &gpu_ann);
    }
    // runc's own share of the GPU path: the config tessera-runtime hands runc for a MIG
    // container (its device nodes, rules, mounts, env), with `/bin/true` as the prestart
    // hook, run by plain runc.
    let injected = {
        let id = "inj";
        let bundle = run_dir(&dir).join("bundles").join(id);
        std::fs::create_dir_all(&bundle).expect("bundle");
        std::fs::write(bundle.join("config.json"), config(rootfs, &cgroup, id, &gpu_ann))
            .expect("config");
        let rt = |args: &[&str]| {
            let st = Command::new(runtime())
                .arg("--root")
                .arg(root)
                .args(args)
                .env("TESSERA_RUNC", "runc")
                .env("TESSERA_SOCKET", &socket)
                .env("TESSERA_HOOK", hook())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .status()
                .expect("tessera-runtime");
            assert!(st.success(), "{args:?}");
        };
        rt(&["create", "--bundle", &bundle.to_string_lossy(), id]);
        let mut c: serde_json::Value =
            serde_json::from_slice(&std::fs::read(bundle.join("config.json")).expect("read"))
                .expect("json");
        rt(&["delete", "--force", id]);
        let _ = std::fs::remove_dir_all(&bundle);
        for h in c["hooks"]["prestart"].as_array_mut().expect("the prestart hook") {
            h["path"] = "/bin/true".into();
            h["args"] = serde_json::json!(["true"]);
        }
        c
    };
    let run_injected = |i: usize| -> f64 {
        let id = format!("i{i}");
        let mut c = injected.clone();
        c["linux"]["cgroupsPath"] = format!("{cgroup}/{id}").into();
        let bundle = run_dir(&dir).join("bundles").join(&id);
        runc_run("runc", root, &bundle, &c.to_string(), &socket, &id)
    };
    let (mut plain, mut nogpu, mut gpu, mut inj) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut d_nogpu, mut d_gpu, mut d_inj) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..n {
        // The order turns each iteration, and each run starts on a settled machine (the
        // scrub child a GPU release sets off, ~2 ms, is over): no path is always the one
        // that runs right after the GPU container's background work.
        let (mut p, mut w, mut g, mut j) = (0.0, 0.0, 0.0, 0.0);
        for k in 0..4 {
            std::thread::sleep(Duration::from_millis(SETTLE_MS));
            match (i + k) % 4 {
                0 => p = run("runc", "p", i, &[]),
                1 => w = run(runtime(), "n", i, &[]),
                2 => g = run(runtime(), "g", i, &gpu_ann),
                _ => j = run_injected(i),
            }
        }
        plain.push(p);
        nogpu.push(w);
        gpu.push(g);
        inj.push(j);
        d_nogpu.push(w - p);
        d_gpu.push(g - p);
        d_inj.push(j - p);
    }
    let (ip50, ip99, imean) = stats(inj);
    let (di50, di99, _) = stats(d_inj);
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
    println!("| tessera-runtime, mig=1g.10gb (grant + prestart hook) | {gp50:.2} | {gp99:.2} | {gmean:.2} | {:.3} |", gp50 / pp50);
    println!("| plain runc, the config tessera-runtime writes for mig=1g.10gb, hook /bin/true | {ip50:.2} | {ip99:.2} | {imean:.2} | {:.3} |", ip50 / pp50);
    println!("\nadded latency, paired per iteration (ms): no request p50 {dn50:.2} p99 {dn99:.2}; MIG request p50 {dg50:.2} p99 {dg99:.2}");
    println!("of which runc's own work on the injected config (devices, mounts, a hook): p50 {di50:.2} p99 {di99:.2}");

    // The sequence a containerd shim drives: `create`, `start`, `delete --force`, three
    // processes of BIN each time (the wrapper's work is in create and delete).
    let seq = |bin: &str, kind: &str, i: usize, ann: &[(&str, &str)]| -> [f64; 3] {
        let id = format!("{kind}{i}");
        let bundle = run_dir(&dir).join("bundles").join(&id);
        shim_sequence(bin, root, &bundle, &config(rootfs, &cgroup, &id, ann), &socket, &id)
    };
    for i in 0..5 {
        seq("runc", "sw", i, &[]);
        seq(runtime(), "sg", i, &gpu_ann);
    }
    let (mut plain, mut gpu, mut d_gpu) = (Vec::new(), Vec::new(), Vec::new());
    // Per step (create, start, delete): plain, tessera-runtime, paired difference.
    let mut by_step: [[Vec<f64>; 3]; 3] = Default::default();
    for i in 0..n {
        let (mut p, mut g) = ([0.0; 3], [0.0; 3]);
        for k in 0..2 {
            std::thread::sleep(Duration::from_millis(SETTLE_MS));
            match (i + k) % 2 {
                0 => p = seq("runc", "sp", i, &[]),
                _ => g = seq(runtime(), "sg", i, &gpu_ann),
            }
        }
        for s in 0..3 {
            by_step[s][0].push(p[s]);
            by_step[s][1].push(g[s]);
            by_step[s][2].push(g[s] - p[s]);
        }
        let (p, g) = (p.iter().sum::<f64>(), g.iter().sum::<f64>());
        plain.push(p);
        gpu.push(g);
        d_gpu.push(g - p);
    }
    let (pp50, pp99, _) = stats(plain);
    let (gp50, gp99, _) = stats(gpu);
    let (dg50, dg99, _) = stats(d_gpu);
    println!(
        "\ncreate, start, delete --force (a shim's sequence), {n} interleaved runs each (ms)\n"
    );
    println!("| path | p50 | p99 |");
    println!("|---|---|---|");
    println!("| plain runc | {pp50:.2} | {pp99:.2} |");
    println!("| tessera-runtime, mig=1g.10gb | {gp50:.2} | {gp99:.2} |");
    println!("\nadded latency of the sequence, paired per iteration (ms): MIG request p50 {dg50:.2} p99 {dg99:.2}");
    println!("\nby step (ms)\n");
    println!("| step | plain runc p50 | tessera-runtime p50 | added p50 (paired) | added p99 |");
    println!("|---|---|---|---|---|");
    for (name, [p, g, d]) in ["create", "start", "delete --force"].iter().zip(by_step) {
        let ((p50, _, _), (g50, _, _), (d50, d99, _)) = (stats(p), stats(g), stats(d));
        println!("| {name} | {p50:.2} | {g50:.2} | {d50:.2} | {d99:.2} |");
    }

    parts(n, &dir, &socket, root, &gpu_ann, rootfs, &cgroup);
}

/// `BIN create`, `BIN start`, `BIN delete --force` of `config`, as a containerd shim runs
/// them (each its own process; the container runs `true`): the milliseconds each took.
fn shim_sequence(
    bin: &str,
    root: &Path,
    bundle: &Path,
    config: &str,
    socket: &Path,
    id: &str,
) -> [f64; 3] {
    std::fs::create_dir_all(bundle).expect("bundle");
    std::fs::write(bundle.join("config.json"), config).expect("config");
    let call = |args: &[&str]| {
        let status = Command::new(bin)
            .arg("--root")
            .arg(root)
            .args(args)
            .env("TESSERA_RUNC", "runc")
            .env("TESSERA_SOCKET", socket)
            .env("TESSERA_HOOK", hook())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .status()
            .expect("run");
        assert!(status.success(), "{args:?} of {id} failed");
    };
    let b = bundle.to_string_lossy().into_owned();
    let mut steps = [0.0; 3];
    for (step, args) in steps.iter_mut().zip([
        &["create", "--bundle", &b, id][..],
        &["start", id][..],
        &["delete", "--force", id][..],
    ]) {
        let t = Instant::now();
        call(args);
        *step = t.elapsed().as_secs_f64() * 1e3;
    }
    let _ = std::fs::remove_dir_all(bundle);
    steps
}

/// `BIN --root ROOT run --bundle BUNDLE ID` of `config` (tessera-runtime asks the daemon on
/// `socket`; plain runc ignores it): the milliseconds it took. The bundle is removed after.
fn runc_run(bin: &str, root: &Path, bundle: &Path, config: &str, socket: &Path, id: &str) -> f64 {
    std::fs::create_dir_all(bundle).expect("bundle");
    std::fs::write(bundle.join("config.json"), config).expect("config");
    let start = Instant::now();
    let status = Command::new(bin)
        .arg("--root")
        .arg(root)
        .args(["run", "--bundle"])
        .arg(bundle)
        .arg(id)
        .env("TESSERA_RUNC", "runc")
        .env("TESSERA_SOCKET", socket)
        .env("TESSERA_HOOK", hook())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .status()
        .expect("run");
    let ms = start.elapsed().as_secs_f64() * 1e3;
    assert!(status.success(), "run of {id} failed");
    let _ = std::fs::remove_dir_all(bundle);
    ms
}

/// The GPU path by parts, each timed alone (so runc's jitter is not in them): the three
/// daemon round trips a GPU container makes, each after the daemon has been idle (as it is
/// between container events), and the start cost of the wrapper and of the hook process
/// against `/bin/true`.
fn parts(
    n: usize,
    dir: &Path,
    socket: &Path,
    runc_root: &Path,
    ann: &[(&str, &str)],
    rootfs: &Path,
    cgroup: &str,
) {
    let client = tessera_api::Client::new(socket).with_timeout(Duration::from_secs(30));
    let bundle = dir.join("parts-bundle");
    std::fs::create_dir_all(&bundle).expect("bundle");
    let bundle = std::fs::canonicalize(&bundle).expect("bundle");
    let annotations = ann.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    // A created container keeps the stdio runc was given: only `state`'s is read.
    let runc = |args: &[&str]| {
        let capture = args.first() == Some(&"state");
        let out = Command::new("runc")
            .arg("--root")
            .arg(runc_root)
            .args(args)
            .stdin(Stdio::null())
            .stdout(if capture { Stdio::piped() } else { Stdio::null() })
            .stderr(Stdio::inherit())
            .output()
            .expect("runc");
        assert!(out.status.success(), "runc {args:?}");
        out.stdout
    };
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
        // The confirmation names a container's init: a real one (plain runc, created and
        // not started, as tessera-runtime asks after `runc create`), as tesserad checks its
        // root, namespaces and mounts.
        let mut plain: serde_json::Value =
            serde_json::from_str(&config(rootfs, cgroup, &id, &[])).expect("json");
        // What tessera-runtime gives a GPU container: no mount propagation from the host.
        plain["linux"]["rootfsPropagation"] = "rprivate".into();
        std::fs::write(bundle.join("config.json"), plain.to_string()).expect("config");
        runc(&["create", "--bundle", &bundle.to_string_lossy(), &id]);
        let state: serde_json::Value =
            serde_json::from_slice(&runc(&["state", &id])).expect("state");
        let sreq = tessera_api::StartRequest {
            pid: state["pid"].as_i64().expect("pid") as i32,
            bundle: bundle.to_string_lossy().into_owned(),
            created: true,
        };
        start.push(timed(&mut || {
            client.start(&id, &sreq).expect("start");
        }));
        runc(&["delete", "--force", &id]);
        // The first answer after runc's delete: the grant is given back by then (by the
        // watch of runc's roots, or first thing in this request).
        release.push(timed(&mut || {
            client.allocation(&id).expect_err("given back");
        }));
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
    let (mut t_true, mut t_exec, mut t_bare, mut t_wrapper, mut t_hook) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut run_true = spawn("/bin/true", &[], &[]);
    // A process of ours that starts and exits: `tessera-hook --version` prints one line.
    let mut run_bare = spawn(hook(), &["--version"], &[]);
    // A verb the wrapper only passes on (`state`, like `start` and `kill`): its start,
    // configuration and argv read, then the exec of "runc" (here `/bin/true`). (Issue 29's
    // first runs timed `--version`, which runs runc as a child and waits: a second process
    // start on top.)
    let mut run_wrapper = spawn(runtime(), &["state", "x"], &[("TESSERA_RUNC", "/bin/true")]);
    // The same exec from a process that does nothing else, for the exec's own share.
    let mut run_exec = spawn("/bin/sh", &["-c", "exec /bin/true"], &[]);
    // Empty stdin: the hook starts, finds no OCI state and exits.
    let mut run_hook = spawn(hook(), &["prestart"], &[]);
    for _ in 0..n {
        t_true.push(timed(&mut run_true));
        t_bare.push(timed(&mut run_bare));
        t_wrapper.push(timed(&mut run_wrapper));
        t_exec.push(timed(&mut run_exec));
        t_hook.push(timed(&mut run_hook));
    }
    println!("\nby parts, {n} each, every one after a {SETTLE_MS} ms pause (ms)\n");
    println!("| part | p50 | p99 |");
    println!("|---|---|---|");
    for (name, v) in [
        ("POST /v1/allocations (grant, durable)", alloc),
        ("POST /v1/allocations/{id}/start (the confirmation at the start of a created container: checks, interval open, durable)", start),
        ("GET /v1/allocations/{id} right after runc delete (given back by then: by the watch, or first in this request)", release),
        ("GET /healthz (round trip without SQLite, for scale)", health),
        ("spawn /bin/true (baseline)", t_true),
        ("spawn tessera-hook --version (a process of ours that does nothing)", t_bare),
        ("spawn tessera-runtime state x (pass-through: exec /bin/true)", t_wrapper),
        ("spawn /bin/sh -c 'exec /bin/true' (a process that only execs)", t_exec),
        ("spawn tessera-hook with no state", t_hook),
    ] {
        let (p50, p99, _) = stats(v);
        println!("| {name} | {p50:.3} | {p99:.3} |");
    }
}

// ---------------------------------------------------------------------------------------
// Issue 15: what fleet-quota admission adds to a GPU container's start.
// ---------------------------------------------------------------------------------------

/// The tenant of the quota paths: namespace `team-trusted` is acme/trusted/training/alice,
/// whose team is guaranteed [`QUOTA_GUARANTEE`] H100s: one GPU at a time stays within it,
/// so no request borrows and none reclaims.
const QUOTA_NS: &str = "team-trusted";
const QUOTA_TENANT: &str = "acme/trusted/training/alice";
const QUOTA_PATH: &str = "acme/trusted";
const QUOTA_GUARANTEE: u64 = 4;
const H100: &str = "H100-80GB";

/// One tesserad of the quota comparison, on its own simulated 8×H100 node (no MIG).
struct QuotaDaemon {
    /// `a`, `b` or `c`: container ids of its runs start with `q{label}`.
    label: &'static str,
    what: &'static str,
    socket: PathBuf,
    client: tessera_api::Client,
    proc: ChildProcess,
}

/// A simulated node of eight whole H100s named `name`.
fn eight_h100(name: &str) -> serde_json::Value {
    let gpus: Vec<serde_json::Value> = (0..8).map(|_| serde_json::json!({"model": H100})).collect();
    serde_json::json!({
        "node": name,
        "majors": {"nvidia_uvm": 508, "nvidia_caps": 509},
        "sim_memory_bytes": 65536,
        "gpus": gpus,
    })
}

/// examples/policy.json, with or without a `quotas` section for acme/trusted.
fn quota_policy(repo: &Path, with_quotas: bool) -> serde_json::Value {
    let text = std::fs::read(repo.join("examples/policy.json")).expect("examples/policy.json");
    let mut p: serde_json::Value = serde_json::from_slice(&text).expect("policy json");
    if with_quotas {
        p["quotas"] = serde_json::json!({
            QUOTA_PATH: {"gpus": {H100: {"guarantee": QUOTA_GUARANTEE, "ceiling": 8}}}
        });
    }
    p
}

/// A tesserad on `node` (written to `dir` as a `sim:` file) with `policy`, its own state
/// dir and socket, `extra` arguments (the coordinator's, for path c); logs in `dir/logs`.
fn quota_daemon(
    label: &'static str,
    what: &'static str,
    dir: &Path,
    node: &str,
    policy: &Path,
    extra: &[String],
) -> QuotaDaemon {
    let node_file = dir.join(format!("{node}.json"));
    std::fs::write(&node_file, eight_h100(node).to_string()).expect("node file");
    let socket = dir.join(format!("{label}.sock"));
    let mut args = vec![
        "--node".to_string(),
        format!("sim:{}", node_file.display()),
        "--policy".into(),
        policy.display().to_string(),
        "--state-dir".into(),
        dir.join(format!("state-{label}")).display().to_string(),
        "--socket".into(),
        socket.display().to_string(),
    ];
    args.extend(extra.iter().cloned());
    let proc = ChildProcess::spawn(
        &format!("tesserad-{label}"),
        daemon(),
        args,
        [("TESSERA_LOG", "warn")],
        &dir.join("logs"),
    );
    let t0 = Instant::now();
    while !socket.exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "tesserad {label} did not open {}:\n{}",
            socket.display(),
            proc.stderr()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let client = tessera_api::Client::new(&socket).with_timeout(Duration::from_secs(30));
    QuotaDaemon { label, what, socket, client, proc }
}

/// The three quota paths (a: no quotas; b: quotas, the node's own books; c: quotas, a
/// coordinator on loopback over etcd) interleaved, then the admit round trip alone, then
/// each daemon's grant round trip alone. `n` of each.
fn quota_paths(n: usize, dir: &Path, rootfs: &Path, cgroup: &str, root: &Path) {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let qdir = dir.join("quota");
    std::fs::create_dir_all(&qdir).expect("quota dir");
    let plain_policy = qdir.join("policy-no-quotas.json");
    let quota_policy_file = qdir.join("policy-quotas.json");
    std::fs::write(&plain_policy, quota_policy(repo, false).to_string()).expect("policy");
    std::fs::write(&quota_policy_file, quota_policy(repo, true).to_string()).expect("policy");

    // Path c's fleet: etcd, keys and tokens (tessera-harness's fixture), one coordinator on
    // loopback, the quota policy pushed as version 1 (the same file c boots from).
    let node_c = "sim-h100-quota-c";
    let fx = FleetFixture::launch(&[node_c]);
    let coordinator = fx.coordinator_on_free_port("coordinator", &[]);
    fx.push_file(&coordinator.url, &quota_policy_file, 1);
    let token_file = qdir.join("c.token");
    std::fs::write(&token_file, format!("{}\n", node_token(node_c))).expect("token file");
    std::fs::set_permissions(&token_file, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .expect("chmod token");
    let fleet_args: Vec<String> = vec![
        "--coordinator".into(),
        coordinator.url.clone(),
        "--trust-key".into(),
        fx.public_key.clone(),
        "--node-token".into(),
        token_file.display().to_string(),
    ];

    let daemons = [
        quota_daemon("a", "policy without quotas", &qdir, "sim-h100-quota-a", &plain_policy, &[]),
        quota_daemon(
            "b",
            "quotas, the node's own books",
            &qdir,
            "sim-h100-quota-b",
            &quota_policy_file,
            &[],
        ),
        quota_daemon(
            "c",
            "quotas, coordinator on loopback (etcd)",
            &qdir,
            node_c,
            &quota_policy_file,
            &fleet_args,
        ),
    ];

    // The coordinator answers admissions only once the books heard from every node.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("tokio");
    let admin = fleet::client::Client::new(&[&coordinator.url], ADMIN_TOKEN)
        .expect("admin client")
        .with_timeout(Duration::from_secs(10));
    let t0 = Instant::now();
    loop {
        match rt.block_on(admin.quota_status()) {
            Ok(s) if s.books_ready && s.nodes.contains_key(node_c) => break,
            r => assert!(
                t0.elapsed() < Duration::from_secs(30),
                "the coordinator's books never became ready with {node_c}: {r:?}\n{}",
                daemons[2].proc.stderr()
            ),
        }
        std::thread::sleep(Duration::from_millis(100));
    }

    let ann = [(NAMESPACE_KEY, QUOTA_NS), ("tessera.io/gpu", "gpu=1")];
    let run = |d: &QuotaDaemon, id: &str| -> f64 {
        let bundle = run_dir(dir).join("bundles").join(id);
        runc_run(runtime(), root, &bundle, &config(rootfs, cgroup, id, &ann), &d.socket, id)
    };
    for i in 0..5 {
        for d in &daemons {
            run(d, &format!("qw{}{i}", d.label));
        }
    }
    let mut e2e: [Vec<f64>; 3] = Default::default();
    let mut rtt = Vec::new();
    let probe = fleet::client::Client::new(&[&coordinator.url], &node_token(node_c))
        .expect("node client")
        .with_timeout(Duration::from_secs(10));
    let admit = |id: &str| fleet::quota_wire::AdmitRequest {
        container_id: id.to_string(),
        tenant: QUOTA_TENANT.to_string(),
        amounts: fleet::quota_wire::Amounts {
            gpus: [(H100.to_string(), 1_000_000)].into_iter().collect(),
            cpu_milli: 0,
            memory_mib: 0,
        },
        gang: None,
        short_on_node: false,
        checkpoint: false,
        workload: None,
        unsynced_lease_grants: false,
    };
    for i in 0..n {
        // The same discipline as the paths above: the order turns every iteration, each
        // run after a settle pause.
        for k in 0..3 {
            std::thread::sleep(Duration::from_millis(SETTLE_MS));
            let p = (i + k) % 3;
            let d = &daemons[p];
            e2e[p].push(run(d, &format!("q{}{i}", d.label)));
        }
        // The admit round trip alone, as node c asks it (its token, a pooled keep-alive
        // connection), for a container that node never runs, given back at once.
        std::thread::sleep(Duration::from_millis(SETTLE_MS));
        let req = admit(&format!("rtt{i}"));
        let t = Instant::now();
        let answer = rt.block_on(probe.quota_admit(node_c, &req, Duration::from_secs(5)));
        rtt.push(t.elapsed().as_secs_f64() * 1e3);
        match answer {
            Ok(fleet::quota_wire::AdmitAnswer::Admitted {
                class: fleet::quota_wire::QuotaClass::Guaranteed,
                ..
            }) => {}
            other => panic!("admit round trip {i}: expected a guaranteed admission, got {other:?}"),
        }
        let rel = fleet::quota_wire::ReleaseRequest { container_id: req.container_id.clone() };
        rt.block_on(probe.quota_release(node_c, &rel)).expect("quota release");
    }

    // Each daemon's grant round trip alone (`POST /v1/allocations`, gpu=1), the grant's
    // quota mark checked outside the timing, released at once.
    let annotations: std::collections::BTreeMap<String, String> =
        ann.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let bundle = dir.join("quota-parts-bundle");
    std::fs::create_dir_all(&bundle).expect("bundle");
    let mut grant: [Vec<f64>; 3] = Default::default();
    for i in 0..n {
        for k in 0..3 {
            let p = (i + k) % 3;
            let d = &daemons[p];
            let id = format!("qg{}{i}", d.label);
            let req = tessera_api::AllocateRequest {
                container_id: id.parse().expect("container id"),
                runc_root: root.to_string_lossy().into_owned(),
                bundle: bundle.to_string_lossy().into_owned(),
                request: tessera_api::GpuRequest::Gpu { count: 1 },
                request_source: tessera_api::RequestSource::Annotation,
                annotations: annotations.clone(),
                limits: None,
            };
            std::thread::sleep(Duration::from_millis(SETTLE_MS));
            let t = Instant::now();
            let a = d.client.allocate(&req).expect("allocate gpu=1");
            grant[p].push(t.elapsed().as_secs_f64() * 1e3);
            let class = a.quota.as_ref().map(|m| (m.class, m.under_lease));
            let expected = match d.label {
                "a" => None,
                _ => Some((tessera_api::QuotaClass::Guaranteed, false)),
            };
            assert_eq!(class, expected, "path {} ({}): grant {id}'s quota mark", d.label, d.what);
            d.client.release(&id).expect("release");
        }
    }

    // Every container of path c was admitted by the coordinator (not by a lease), and the
    // books are flat again: nothing held on any node, nothing counted for the tenant.
    let log = coordinator.proc.stderr();
    let mut admits: std::collections::BTreeMap<&str, usize> = std::collections::BTreeMap::new();
    for l in log.lines().filter(|l| l.contains("quota admitted")) {
        if let Some(id) = l.split_whitespace().find_map(|w| w.strip_prefix("container=")) {
            *admits.entry(id).or_default() += 1;
        }
    }
    let once_each = (0..n).filter(|i| admits.get(format!("qc{i}").as_str()) == Some(&1)).count();
    let t0 = Instant::now();
    let in_use = loop {
        let s = rt.block_on(admin.quota_status()).expect("quota status");
        let used: u64 = s.paths.iter().filter(|r| r.path == QUOTA_PATH).map(|r| r.in_use).sum();
        if used == 0 || t0.elapsed() > Duration::from_secs(10) {
            break used;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    for d in &daemons {
        let held = d.client.status().expect("status").allocations.len();
        assert_eq!(held, 0, "path {}: grants left after the benchmark", d.label);
    }

    let stats3 = |v: &[f64]| stats(v.to_vec());
    println!(
        "\nGPU container start (gpu=1, whole H100, simulated 8xH100 node without MIG, tenant \
         {QUOTA_TENANT} within its guarantee of {QUOTA_GUARANTEE}), {n} interleaved runs each (ms)\n"
    );
    println!("| path | p50 | p99 | mean |");
    println!("|---|---|---|---|");
    for (d, v) in daemons.iter().zip(&e2e) {
        let (p50, p99, mean) = stats3(v);
        println!("| ({}) tessera-runtime, {} | {p50:.2} | {p99:.2} | {mean:.2} |", d.label, d.what);
    }
    let diff = |x: &[f64], y: &[f64]| -> Vec<f64> { x.iter().zip(y).map(|(a, b)| a - b).collect() };
    println!("\nadded latency, paired per iteration (ms; ± the 95% interval of the mean)\n");
    println!("| difference | p50 | p99 | mean |");
    println!("|---|---|---|---|");
    for (name, x, y) in [
        ("(b) - (a): quotas, own books", &e2e[1], &e2e[0]),
        ("(c) - (a): quotas, coordinator", &e2e[2], &e2e[0]),
        ("(c) - (b): coordinator vs own books", &e2e[2], &e2e[1]),
    ] {
        let d = diff(x, y);
        let ci = ci95(&d);
        let (p50, p99, mean) = stats(d);
        println!("| {name} | {p50:.2} | {p99:.2} | {mean:.2} ± {ci:.2} |");
    }
    println!("\nround trips alone, {n} each, every one after a {SETTLE_MS} ms pause (ms)\n");
    println!("| round trip | p50 | p99 | mean |");
    println!("|---|---|---|---|");
    let (r50, r99, rmean) = stats3(&rtt);
    println!("| POST /v1/nodes/{{node}}/quota/admit (client -> coordinator, loopback) | {r50:.3} | {r99:.3} | {rmean:.3} |");
    for (d, v) in daemons.iter().zip(&grant) {
        let (p50, p99, mean) = stats3(v);
        println!(
            "| ({}) POST /v1/allocations gpu=1, {} | {p50:.3} | {p99:.3} | {mean:.3} |",
            d.label, d.what
        );
    }
    println!("\ngrant round trip, paired per iteration (ms; ± the 95% interval of the mean)\n");
    println!("| difference | p50 | p99 | mean |");
    println!("|---|---|---|---|");
    for (name, x, y) in [("(b) - (a)", &grant[1], &grant[0]), ("(c) - (a)", &grant[2], &grant[0])] {
        let d = diff(x, y);
        let ci = ci95(&d);
        let (p50, p99, mean) = stats(d);
        println!("| {name} | {p50:.3} | {p99:.3} | {mean:.3} ± {ci:.3} |");
    }
    let (c50, _, _) = stats(diff(&e2e[2], &e2e[0]));
    let (g50, _, _) = stats(diff(&grant[2], &grant[0]));
    println!(
        "\nacceptance (at most one round trip added): start (c) - (a) p50 {c50:.2} ms, grant \
         (c) - (a) p50 {g50:.3} ms, against the admit round trip p50 {r50:.3} ms"
    );
    println!(
        "checks: {once_each} of path c's {n} timed containers admitted by exactly one \
         admission in the coordinator's log; tenant path {QUOTA_PATH} holds {in_use} micro-GPUs \
         in the coordinator's books at the end; no grant left on any node"
    );
    assert_eq!(once_each, n, "each path c container was admitted by the coordinator, once");
    assert_eq!(in_use, 0, "the coordinator's books are flat at the end");
    drop(daemons);
}

/// Half the width of the normal 95% interval of the mean of `v` (1.96 standard errors).
fn ci95(v: &[f64]) -> f64 {
    let n = v.len() as f64;
    if v.len() < 2 {
        return f64::NAN;
    }
    let mean = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    1.96 * (var / n).sqrt()
}

fn unsafe_is_not_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() != 0 }
}
