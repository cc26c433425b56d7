//! `docker run --gpus`: what dockerd writes into config.json, read as a Tessera request.
//!
//! dockerd 20.10 registers its `gpu`/`nvidia` device driver only when an executable named
//! [`NVIDIA_HOOK`] is on its PATH at start. For `--gpus` it then appends to the config
//! `NVIDIA_VISIBLE_DEVICES` (`all`; `0,1,…,N-1` for `--gpus N`; the listed ids for
//! `device=…`), maybe `NVIDIA_DRIVER_CAPABILITIES`, and a prestart hook
//! `{path: <hook on PATH>, args: [nvidia-container-runtime-hook, prestart], env: dockerd's}`.
//!
//! tessera-runtime reads that pair as a request (`all` → `gpu=<the node's GPU count>`,
//! `0,…,N-1` → `gpu=N`) and removes every [`NVIDIA_HOOK`] entry from the hooks, so the real
//! NVIDIA hook never runs. `NVIDIA_VISIBLE_DEVICES` alone (an image's `ENV`) is no request.
//! A config author who writes the hook entry by hand gets what writing `TESSERA_GPU=gpu=N`
//! gets them: a request, decided by the policy for the tenant their engine identifies;
//! never a grant, an identity or a device the policy does not give. The binary Tessera
//! installs under that name ([`standin_main`]) only refuses: a container started with
//! `--gpus` on plain runc fails instead of silently running without a GPU.

use serde_json::Value;
use tessera_api::{untrusted, GpuRequest};

/// The hook dockerd looks for on its PATH, and writes into `--gpus` containers.
pub const NVIDIA_HOOK: &str = "nvidia-container-runtime-hook";
/// The variable dockerd writes the `--gpus` devices into.
pub const VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";

/// Why Docker's `--gpus` cannot be read as a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DockerError {
    #[error("malformed config at `{path}`: {what}")]
    Shape { path: String, what: &'static str },

    #[error("docker --gpus: `{VISIBLE_DEVICES}={}`: {why}", untrusted(.value))]
    Bad { value: String, why: String },
    #[error("docker --gpus all: {0}")]
    All(String),
    #[error(
        "{phase} hook `{}` is NVIDIA's ({name}): it would give the container devices and cgroup \
         rules outside Tessera's grant; remove the NVIDIA container toolkit's hook configuration \
         (for podman and CRI-O: oci-nvidia-hook.json in the hooks.d directories) from this node",
        untrusted(.path)
    )]
    ForeignNvidiaHook { phase: String, path: String, name: &'static str },
}

/// NVIDIA binaries that, run as an OCI hook, give a container GPUs on their own terms:
/// never allowed to run in a Tessera container. `nvidia-container-runtime-hook` is also
/// dockerd's `--gpus` marker, which Tessera translates ([`find_docker_gpus`]) and removes.
pub const NVIDIA_HOOK_BINARIES: &[&str] = &[
    NVIDIA_HOOK,
    "nvidia-container-toolkit",
    "nvidia-container-cli",
    "nvidia-ctk",
    "nvidia-cdi-hook",
];

/// The NVIDIA binary a hook path is, by its own name or (a link) by what it resolves to on
/// this host, where hooks run.
fn nvidia_binary(path: &str) -> Option<&'static str> {
    let base = |p: &str| p.rsplit('/').next().map(str::to_owned);
    let mut names = vec![base(path)];
    if let Ok(target) = std::fs::canonicalize(path) {
        names.push(target.to_str().and_then(base));
    }
    names.into_iter().flatten().find_map(|n| NVIDIA_HOOK_BINARIES.iter().copied().find(|b| *b == n))
}

/// Refuses a config with an NVIDIA hook other than dockerd's `--gpus` marker, in any phase:
/// such a hook (the toolkit's `hooks.d` entry, or a link to one) mounts devices and writes
/// the devices cgroup itself, after every check of Tessera's.
pub fn refuse_foreign_nvidia_hooks(config: &Value) -> Result<(), DockerError> {
    let Some(Value::Object(hooks)) = config.get("hooks") else { return Ok(()) };
    for (phase, list) in hooks {
        for h in list.as_array().into_iter().flatten() {
            let Some(path) = h.get("path").and_then(Value::as_str) else { continue };
            match nvidia_binary(path) {
                None => {}
                Some(NVIDIA_HOOK) if path.rsplit('/').next() == Some(NVIDIA_HOOK) => {}
                Some(name) => {
                    return Err(DockerError::ForeignNvidiaHook {
                        phase: phase.clone(),
                        path: path.to_owned(),
                        name,
                    })
                }
            }
        }
    }
    Ok(())
}

/// What `--gpus` asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DockerGpus {
    /// `--gpus all`: every GPU of the node.
    All,
    /// `--gpus N` (or `device=0,…,N-1`, which dockerd writes the same way).
    Count(u32),
    /// `--gpus '"device=3,GPU-…"'`: these GPUs (indices or uuids), granted as they are or
    /// refused.
    Devices(Vec<String>),
}

impl DockerGpus {
    /// The Tessera request; `node_gpus` is asked only for `all`.
    pub fn request(
        &self,
        node_gpus: impl FnOnce() -> Result<u32, String>,
    ) -> Result<GpuRequest, DockerError> {
        let count = match self {
            DockerGpus::Count(n) => *n,
            DockerGpus::Devices(ids) => ids.len() as u32,
            DockerGpus::All => {
                let n = node_gpus().map_err(DockerError::All)?;
                if n == 0 {
                    return Err(DockerError::All("the node has no GPUs".into()));
                }
                n
            }
        };
        format!("gpu={count}")
            .parse::<GpuRequest>()
            .map_err(|e| DockerError::Bad { value: count.to_string(), why: e.to_string() })
    }
}

fn is_nvidia_hook(hook: &Value) -> bool {
    hook.get("path")
        .and_then(Value::as_str)
        .map(|p| p.rsplit('/').next() == Some(NVIDIA_HOOK))
        .unwrap_or(false)
}

/// Whether the config carries a [`NVIDIA_HOOK`] prestart entry (dockerd's `--gpus`).
pub fn has_nvidia_hook(config: &Value) -> bool {
    config
        .pointer("/hooks/prestart")
        .and_then(Value::as_array)
        .is_some_and(|hooks| hooks.iter().any(is_nvidia_hook))
}

/// Docker's `--gpus` request in a config: `None` without dockerd's hook, or with the hook
/// and no devices (`--gpus 0`, `none`, `void`, empty).
pub fn find_docker_gpus(config: &Value) -> Result<Option<DockerGpus>, DockerError> {
    if !has_nvidia_hook(config) {
        return Ok(None);
    }
    let env = match config.pointer("/process/env") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(env)) => env,
        Some(_) => {
            return Err(DockerError::Shape { path: "process.env".into(), what: "not an array" })
        }
    };
    let prefix = format!("{VISIBLE_DEVICES}=");
    // dockerd appends its value after the image's: the last one is what a process sees.
    let mut value = None;
    for (i, e) in env.iter().enumerate() {
        let s = e.as_str().ok_or_else(|| DockerError::Shape {
            path: format!("process.env[{i}]"),
            what: "not a string",
        })?;
        if let Some(v) = s.strip_prefix(&prefix) {
            value = Some(v);
        }
    }
    value.map(parse_visible_devices).transpose().map(Option::flatten)
}

/// `NVIDIA_VISIBLE_DEVICES` as dockerd writes it for `--gpus`.
pub fn parse_visible_devices(value: &str) -> Result<Option<DockerGpus>, DockerError> {
    let v = value.trim();
    match v {
        "" | "none" | "void" => return Ok(None),
        "all" => return Ok(Some(DockerGpus::All)),
        _ => {}
    }
    let ids: Vec<&str> = v.split(',').map(str::trim).collect();
    let bad = |why: &str| DockerError::Bad { value: value.to_string(), why: why.to_string() };
    if ids.iter().any(|id| id.is_empty()) {
        return Err(bad("an empty device id"));
    }
    if ids.len() > 64 {
        return Err(bad("more than 64 devices"));
    }
    // `0,1,…,N-1` is how dockerd writes `--gpus N`: a count. Anything else pins devices.
    let prefix =
        ids.iter().enumerate().all(|(i, id)| id.parse::<usize>() == Ok(i) && *id == i.to_string());
    if prefix {
        return Ok(Some(DockerGpus::Count(ids.len() as u32)));
    }
    for id in &ids {
        let index = id.len() <= 4
            && id.bytes().all(|b| b.is_ascii_digit())
            && (*id == "0" || !id.starts_with('0'));
        let uuid = id.len() <= 128
            && id.starts_with("GPU-")
            && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
        if id.starts_with("MIG-") || id.contains(':') {
            return Err(bad(
                "a MIG instance is asked for by profile, not by device: -e TESSERA_GPU=mig=<profile> \
                 or a CDI device tessera.io/gpu=mig-<profile>",
            ));
        }
        if !index && !uuid {
            return Err(bad("a device is a GPU index or a GPU-… uuid"));
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    if !ids.iter().all(|id| seen.insert(*id)) {
        return Err(bad("a device named twice"));
    }
    Ok(Some(DockerGpus::Devices(ids.into_iter().map(str::to_owned).collect())))
}

/// Removes every [`NVIDIA_HOOK`] entry from every hook list of the config; returns whether
/// one was there. The real NVIDIA hook must never run in a Tessera container: the grant's
/// devices come from tesserad.
pub fn remove_nvidia_hooks(config: &mut Value) -> Result<bool, DockerError> {
    let Some(hooks) = config.get_mut("hooks") else { return Ok(false) };
    let Some(hooks) = hooks.as_object_mut() else {
        return match hooks {
            Value::Null => Ok(false),
            _ => Err(DockerError::Shape { path: "hooks".into(), what: "not an object" }),
        };
    };
    let mut removed = false;
    for list in hooks.values_mut() {
        if let Some(list) = list.as_array_mut() {
            let before = list.len();
            list.retain(|h| !is_nvidia_hook(h));
            removed |= list.len() != before;
        }
    }
    Ok(removed)
}

/// What the binary installed as [`NVIDIA_HOOK`] does when something runs it: refuses.
/// tessera-runtime removes it from every config before runc sees it, so it runs only when
/// a `--gpus` container was started on another runtime (plain runc): that container must
/// not start believing it has a GPU.
pub fn standin_main(args: &[std::ffi::OsString]) -> i32 {
    let asked = args.get(1).map(|a| a.to_string_lossy().into_owned()).unwrap_or_default();
    match asked.as_str() {
        "--help" | "-h" | "help" => {
            println!(
                "{NVIDIA_HOOK} (Tessera's stand-in, a name for tessera-hook): lets dockerd accept \
                 `docker run --gpus`; tessera-runtime turns that into a Tessera GPU request and \
                 removes this hook. Run GPU containers with `--runtime tessera`."
            );
            0
        }
        "--version" | "-v" | "version" => {
            println!("{NVIDIA_HOOK} (tessera {})", env!("CARGO_PKG_VERSION"));
            0
        }
        _ => {
            eprintln!(
                "{NVIDIA_HOOK}: this is Tessera's stand-in: containers asking for GPUs with \
                 `--gpus` must run with `--runtime tessera` (tessera-runtime turns --gpus into a \
                 Tessera request and removes this hook); refusing to start the container"
            );
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn docker_config(env: &[&str]) -> Value {
        json!({
            "ociVersion": "1.0.2-dev",
            "process": {"args": ["sh"], "env": env},
            "hooks": {"prestart": [
                {"path": "/usr/bin/other"},
                {"path": "/usr/local/bin/nvidia-container-runtime-hook",
                 "args": ["nvidia-container-runtime-hook", "prestart"], "env": ["PATH=/bin", "HOME=/root"]}
            ]}
        })
    }

    #[test]
    fn gpus_flags_become_requests() {
        let f = |v: &str| find_docker_gpus(&docker_config(&["PATH=/bin", v]));
        assert_eq!(f("NVIDIA_VISIBLE_DEVICES=0"), Ok(Some(DockerGpus::Count(1))));
        assert_eq!(f("NVIDIA_VISIBLE_DEVICES=0,1,2"), Ok(Some(DockerGpus::Count(3))));
        assert_eq!(f("NVIDIA_VISIBLE_DEVICES=all"), Ok(Some(DockerGpus::All)));
        for none in [
            "NVIDIA_VISIBLE_DEVICES=",
            "NVIDIA_VISIBLE_DEVICES=none",
            "NVIDIA_VISIBLE_DEVICES=void",
            "X=1",
        ] {
            assert_eq!(f(none), Ok(None), "{none}");
        }
        let req = |g: DockerGpus| g.request(|| Ok(8)).map(|r| r.to_string());
        assert_eq!(req(DockerGpus::Count(2)), Ok("gpu=2".into()));
        assert_eq!(req(DockerGpus::All), Ok("gpu=8".into()));
        let e = DockerGpus::All.request(|| Ok(0)).expect_err("no GPUs");
        assert!(e.to_string().contains("the node has no GPUs"), "{e}");
        let e = DockerGpus::All.request(|| Err("cannot reach tesserad".into())).expect_err("down");
        assert_eq!(e.to_string(), "docker --gpus all: cannot reach tesserad");
    }

    #[test]
    fn the_last_value_wins_as_for_the_process() {
        // The image's ENV comes first, dockerd's --gpus value last.
        let c = docker_config(&["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_VISIBLE_DEVICES=0"]);
        assert_eq!(find_docker_gpus(&c), Ok(Some(DockerGpus::Count(1))));
    }

    #[test]
    fn an_image_env_alone_is_no_request() {
        let mut c = docker_config(&["NVIDIA_VISIBLE_DEVICES=all"]);
        c["hooks"]["prestart"].as_array_mut().expect("list").pop();
        assert_eq!(find_docker_gpus(&c), Ok(None));
        // Nor a hook of another name, nor one in another phase.
        c["hooks"]["prestart"] = json!([{"path": "/x/nvidia-container-runtime-hook.sh"}]);
        c["hooks"]["createRuntime"] = json!([{"path": "/x/nvidia-container-runtime-hook"}]);
        assert_eq!(find_docker_gpus(&c), Ok(None));
    }

    #[test]
    fn device_lists_pin_and_malformed_ones_are_refused() {
        let pins = |v: &str| match parse_visible_devices(v) {
            Ok(Some(DockerGpus::Devices(ids))) => ids,
            other => panic!("{v}: {other:?}"),
        };
        assert_eq!(pins("1"), ["1"]);
        assert_eq!(pins("0,2"), ["0", "2"]);
        assert_eq!(pins("1,0"), ["1", "0"]);
        assert_eq!(pins("GPU-8f1c-aa"), ["GPU-8f1c-aa"]);
        let req = DockerGpus::Devices(pins("3,GPU-x")).request(|| unreachable!()).expect("gpu=2");
        assert_eq!(req.to_string(), "gpu=2");
        for (v, why) in [
            ("0:1", "asked for by profile"),
            ("MIG-3f", "asked for by profile"),
            ("00", "a GPU index or a GPU-"),
            ("gpu0", "a GPU index or a GPU-"),
            ("0,0", "named twice"),
        ] {
            let e = parse_visible_devices(v).expect_err(v);
            assert!(e.to_string().contains(why), "{v}: {e}");
        }
        let e = parse_visible_devices("0,,1").expect_err("empty id");
        assert!(e.to_string().contains("an empty device id"), "{e}");
        let many: Vec<String> = (0..65).map(|i| i.to_string()).collect();
        assert!(parse_visible_devices(&many.join(",")).is_err());
        let e = parse_visible_devices("x\u{1b}[2J").expect_err("escaped");
        assert!(!e.to_string().contains('\u{1b}'), "{e}");
        let mut c = docker_config(&[]);
        c["process"]["env"] = json!(["NVIDIA_VISIBLE_DEVICES=0", 3]);
        assert_eq!(
            find_docker_gpus(&c).expect_err("shape").to_string(),
            "malformed config at `process.env[1]`: not a string"
        );
    }

    #[test]
    fn the_hook_is_removed_from_every_phase() {
        let mut c = docker_config(&["NVIDIA_VISIBLE_DEVICES=0"]);
        c["hooks"]["createContainer"] = json!([{"path": "nvidia-container-runtime-hook"}]);
        assert_eq!(remove_nvidia_hooks(&mut c), Ok(true));
        assert_eq!(c["hooks"]["prestart"], json!([{"path": "/usr/bin/other"}]));
        assert_eq!(c["hooks"]["createContainer"], json!([]));
        assert!(!has_nvidia_hook(&c));
        assert_eq!(remove_nvidia_hooks(&mut c), Ok(false));
        assert_eq!(remove_nvidia_hooks(&mut json!({})), Ok(false));
        assert!(remove_nvidia_hooks(&mut json!({"hooks": 1})).is_err());
    }

    #[test]
    fn the_standin_refuses_to_run_as_a_hook() {
        let a =
            |s: &str| -> Vec<std::ffi::OsString> { s.split_whitespace().map(Into::into).collect() };
        assert_eq!(standin_main(&a("nvidia-container-runtime-hook prestart")), 1);
        assert_eq!(standin_main(&a("nvidia-container-runtime-hook")), 1);
        assert_eq!(standin_main(&a("nvidia-container-runtime-hook --version")), 0);
    }

    #[test]
    fn nvidia_hooks_other_than_dockers_marker_are_refused_in_every_phase() {
        for (phase, path) in [
            ("prestart", "/usr/bin/nvidia-container-toolkit"),
            ("createRuntime", "nvidia-ctk"),
            ("createContainer", "/usr/local/bin/nvidia-container-cli"),
            ("poststart", "/opt/nvidia-cdi-hook"),
        ] {
            let v = serde_json::json!({"hooks": {phase: [{"path": path, "args": ["x"]}]}});
            let e = refuse_foreign_nvidia_hooks(&v).expect_err(path).to_string();
            assert!(
                e.contains(path) && e.contains(phase) && e.contains("oci-nvidia-hook.json"),
                "{e}"
            );
        }
        // A link named otherwise that resolves to the toolkit.
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("nvidia-container-toolkit");
        std::fs::write(&real, "#!/bin/sh\n").unwrap();
        let link = dir.path().join("innocent");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let v = serde_json::json!({"hooks": {"prestart": [{"path": link.to_str().unwrap()}]}});
        assert!(refuse_foreign_nvidia_hooks(&v).is_err(), "a link to the toolkit");
        // dockerd's marker passes here (it is translated and removed); other hooks pass.
        let ok = serde_json::json!({"hooks": {"prestart": [
            {"path": "/usr/bin/nvidia-container-runtime-hook", "args": ["nvidia-container-runtime-hook", "prestart"]},
            {"path": "/usr/local/bin/tessera-hook"}
        ]}});
        refuse_foreign_nvidia_hooks(&ok).expect("marker and others pass");
    }
}
