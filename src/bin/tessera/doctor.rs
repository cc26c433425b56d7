//! `tessera doctor`: reads the engines' configurations, tessera-runtime's configurations
//! and the policy, and prints [`tessera::doctor`]'s report; exits 1 on a trap. Also the
//! reading `tessera setup` checks its result with, and the NVIDIA toolkit files (CDI
//! specs, OCI hooks) that `--replace-nvidia` disables.

use std::fs;
use std::path::{Path, PathBuf};

use clap::Args;
use runtime_hook::config::{ConfigSource, DEFAULT_CONFIG};
use tessera::doctor::{self, Engine, Finding, Kind, Runtime, Severity};
use tessera::engines::{self, Configured};

/// Where podman 4.3 and NVIDIA's toolkit keep CDI specs.
pub const CDI_DIRS: [&str; 2] = ["/etc/cdi", "/var/run/cdi"];
/// Where podman and CRI-O read OCI hooks (NVIDIA's toolkit installs oci-nvidia-hook.json).
pub const HOOKS_DIRS: [&str; 2] =
    ["/usr/share/containers/oci/hooks.d", "/etc/containers/oci/hooks.d"];

#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// Docker's daemon.json.
    #[arg(long, default_value = "/etc/docker/daemon.json")]
    pub docker_config: PathBuf,
    /// podman's containers.conf.
    #[arg(long, default_value = "/etc/containers/containers.conf")]
    pub podman_config: PathBuf,
    /// containerd's config.toml.
    #[arg(long, default_value = "/etc/containerd/config.toml")]
    pub containerd_config: PathBuf,
    #[command(flatten)]
    pub checks: CheckArgs,
}

/// What `doctor` and `setup` read besides the engine's configuration.
#[derive(Debug, Args, Clone)]
pub struct CheckArgs {
    /// The policy identity is checked against [default: /etc/tessera/policy.json, else
    /// the file tesserad enforces].
    #[arg(long)]
    pub policy: Option<PathBuf>,
    /// A directory of CDI specs to look for NVIDIA's in (repeatable) [default: /etc/cdi,
    /// /var/run/cdi].
    #[arg(long = "cdi-dir", value_name = "DIR")]
    pub cdi_dirs: Vec<PathBuf>,
    /// A directory of OCI hooks to look for NVIDIA's in (repeatable) [default:
    /// /usr/share/containers/oci/hooks.d, /etc/containers/oci/hooks.d].
    #[arg(long = "hooks-dir", value_name = "DIR")]
    pub hooks_dirs: Vec<PathBuf>,
}

impl CheckArgs {
    fn dirs(given: &[PathBuf], default: &[&str]) -> Vec<PathBuf> {
        if given.is_empty() {
            default.iter().map(PathBuf::from).collect()
        } else {
            given.to_vec()
        }
    }
    pub fn cdi_dirs(&self) -> Vec<PathBuf> {
        Self::dirs(&self.cdi_dirs, &CDI_DIRS)
    }
    pub fn hooks_dirs(&self) -> Vec<PathBuf> {
        Self::dirs(&self.hooks_dirs, &HOOKS_DIRS)
    }
}

/// The policy to check against, and where it came from; `None` when there is none.
pub fn find_policy(arg: Option<&Path>, socket: &Path) -> Result<Option<policy::Policy>, String> {
    if let Some(p) = arg {
        return policy::Policy::load(p).map(Some).map_err(|e| e.to_string());
    }
    let etc = Path::new("/etc/tessera/policy.json");
    if etc.is_file() {
        return policy::Policy::load(etc).map(Some).map_err(|e| e.to_string());
    }
    let status =
        tessera_api::Client::new(socket).with_timeout(std::time::Duration::from_secs(5)).status();
    let file = status
        .ok()
        .and_then(|s| s.policy.source.strip_prefix("file:").map(PathBuf::from))
        .filter(|p| p.is_file());
    match file {
        Some(f) => policy::Policy::load(&f).map(Some).map_err(|e| e.to_string()),
        None => Ok(None),
    }
}

/// Whether the engine runs tessera-runtime as `binary` (its own name, or a link to it), or
/// it is one of `ours` (what setup is writing: it may not exist yet).
fn is_tessera(binary: &str, ours: &[String]) -> bool {
    let base = |p: &Path| p.file_name().is_some_and(|n| n == "tessera-runtime");
    ours.iter().any(|o| o == binary)
        || base(Path::new(binary))
        || fs::canonicalize(binary).is_ok_and(|p| base(&p))
}

/// The configuration tessera-runtime reads when the engine runs it as `c`: the
/// `--tessera-config` argument, else `BINARY.toml` beside it, else the default file.
fn runtime_config(c: &Configured) -> (String, Result<runtime_hook::config::RuntimeConfig, String>) {
    let source = match c.args.iter().position(|a| a == runtime_hook::config::CONFIG_ARG) {
        Some(i) => {
            ConfigSource::Named(PathBuf::from(c.args.get(i + 1).cloned().unwrap_or_default()))
        }
        None => {
            let beside = PathBuf::from(format!("{}.toml", c.binary));
            if c.binary.starts_with('/') && beside.symlink_metadata().is_ok() {
                ConfigSource::Named(beside)
            } else {
                ConfigSource::Default(PathBuf::from(DEFAULT_CONFIG))
            }
        }
    };
    let shown = match &source {
        ConfigSource::Named(p) => p.display().to_string(),
        ConfigSource::Default(p) if p.exists() => p.display().to_string(),
        ConfigSource::Default(p) => format!("{} (absent: every default)", p.display()),
    };
    (shown, source.load().map_err(|e| e.to_string()))
}

/// The Tessera runtimes among `configured` (an engine's runtimes), each with its
/// configuration read.
pub fn tessera_runtimes(
    engine: Engine,
    configured: &[Configured],
    ours: &[String],
) -> Vec<Runtime> {
    configured
        .iter()
        .filter(|c| is_tessera(&c.binary, ours))
        .map(|c| {
            let (config_file, config) = runtime_config(c);
            Runtime { engine, name: c.name.clone(), config_file, config, is_default: c.is_default }
        })
        .collect()
}

/// NVIDIA's runtimes in an engine's configuration: traps (GPUs reachable outside Tessera).
pub fn nvidia_runtimes(engine: Engine, file: &Path, configured: &[Configured]) -> Vec<Finding> {
    configured
        .iter()
        .filter(|c| engines::is_nvidia_runtime(&c.binary))
        .map(|c| Finding {
            severity: Severity::Trap,
            kind: Kind::Nvidia,
            subject: format!(
                "{} runtime `{}`{}",
                engine.name(),
                c.name,
                if c.is_default { " (the default)" } else { "" }
            ),
            text: format!(
                "{} runs NVIDIA's {}: its containers get GPUs outside Tessera's policy; \
                 `tessera setup {} --replace-nvidia` removes it",
                file.display(),
                c.binary,
                engine.name()
            ),
        })
        .collect()
}

/// NVIDIA's CDI specs and OCI hooks in `cdi_dirs` and `hooks_dirs`: (file, what).
pub fn nvidia_files(cdi_dirs: &[PathBuf], hooks_dirs: &[PathBuf]) -> Vec<(PathBuf, &'static str)> {
    let mut out = Vec::new();
    let scan = |dirs: &[PathBuf],
                exts: &[&str],
                test: fn(&str) -> bool,
                what: &'static str,
                out: &mut Vec<_>| {
        for d in dirs {
            let Ok(entries) = fs::read_dir(d) else { continue };
            let mut files: Vec<PathBuf> =
                entries.filter_map(|e| e.ok()).map(|e| e.path()).collect();
            files.sort();
            for f in files {
                let ext = f.extension().and_then(|e| e.to_str()).unwrap_or_default();
                if !exts.contains(&ext) || !f.is_file() {
                    continue;
                }
                let small = fs::metadata(&f).is_ok_and(|m| m.len() <= 4 << 20);
                if small && fs::read_to_string(&f).is_ok_and(|t| test(&t)) {
                    out.push((f, what));
                }
            }
        }
    };
    scan(
        cdi_dirs,
        &["yaml", "yml", "json"],
        engines::cdi_spec_is_nvidia,
        "NVIDIA CDI spec",
        &mut out,
    );
    scan(hooks_dirs, &["json"], engines::oci_hook_is_nvidia, "NVIDIA OCI hook", &mut out);
    out
}

/// The traps of [`nvidia_files`].
pub fn nvidia_file_findings(files: &[(PathBuf, &'static str)]) -> Vec<Finding> {
    files
        .iter()
        .map(|(f, what)| Finding {
            severity: Severity::Trap,
            kind: Kind::Nvidia,
            subject: f.display().to_string(),
            text: format!(
                "{what}: engines that read it give its devices outside Tessera's policy; \
                 `tessera setup ... --replace-nvidia` disables it"
            ),
        })
        .collect()
}

/// Disables `file` by renaming it to `FILE.tessera-disabled-<unix seconds>` (engines read
/// only `*.json`/`*.yaml` there): the backup is the file itself. Returns the new name.
pub fn disable_file(file: &Path) -> Result<PathBuf, String> {
    let stamp = tessera_api::time::now_ms() / 1000;
    for n in 0..1000 {
        let mut to = file.as_os_str().to_owned();
        to.push(format!(".tessera-disabled-{stamp}"));
        if n > 0 {
            to.push(format!("-{n}"));
        }
        let to = PathBuf::from(to);
        if to.symlink_metadata().is_ok() {
            continue;
        }
        return fs::rename(file, &to)
            .map(|()| to)
            .map_err(|e| format!("cannot disable {}: {e}", file.display()));
    }
    Err(format!("cannot find a free name beside {}", file.display()))
}

fn read(path: &Path) -> Result<Option<String>, String> {
    match fs::read_to_string(path) {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    }
}

/// The report for the node as its files are now.
pub fn report(a: &DoctorArgs, socket: &Path) -> Result<doctor::Report, String> {
    let policy = find_policy(a.checks.policy.as_deref(), socket)?;
    let mut runtimes = Vec::new();
    let mut nvidia = Vec::new();
    type Reader = fn(&str, &str) -> Result<Vec<Configured>, engines::EngineConfigError>;
    let engines: [(Engine, &Path, Reader); 3] = [
        (Engine::Docker, &a.docker_config, engines::docker),
        (Engine::Podman, &a.podman_config, engines::podman),
        (Engine::Containerd, &a.containerd_config, engines::containerd),
    ];
    for (engine, file, reader) in engines {
        let Some(text) = read(file)? else { continue };
        let configured = reader(&text, &file.display().to_string()).map_err(|e| e.to_string())?;
        runtimes.extend(tessera_runtimes(engine, &configured, &[]));
        nvidia.extend(nvidia_runtimes(engine, file, &configured));
    }
    nvidia
        .extend(nvidia_file_findings(&nvidia_files(&a.checks.cdi_dirs(), &a.checks.hooks_dirs())));
    let mut r = doctor::diagnose(policy.as_ref(), &runtimes, nvidia);
    r.findings.extend(doctor::kernel_findings(runtime_hook::spec::read_ptrace_scope(Path::new(
        runtime_hook::spec::YAMA_PTRACE_SCOPE,
    ))));
    Ok(r)
}

pub fn run(a: DoctorArgs, socket: &Path) -> Result<(), String> {
    let r = report(&a, socket)?;
    print!("{}", r.render());
    match r.traps().count() {
        0 => Ok(()),
        n => Err(format!("{n} trap{} (see above)", if n == 1 { "" } else { "s" })),
    }
}
