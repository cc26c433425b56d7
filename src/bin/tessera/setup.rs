//! `tessera setup ENGINE`: reads the engine's configuration, edits it with
//! [`tessera::setup`], prints the diff (`--dry-run`) or backs the file up and writes it.

use std::fs;
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use tessera::doctor::{self as diag, Engine as DiagEngine, Runtime};
use tessera::setup::{self, ContainerdOptions, NvidiaFound};

use crate::doctor::{self, CheckArgs};

#[derive(Debug, Subcommand)]
pub enum SetupCmd {
    /// Add a `tessera` runtime handler to containerd's CRI plugin (config version 2 for
    /// containerd 1.6/1.7, 3 for 2.x): its `BinaryName` a link `containerd-<handler>` to
    /// tessera-runtime in the runtime directory, with the handler's own runtime
    /// configuration beside it (`kubelet = true`). Prints the matching RuntimeClass.
    /// Idempotent.
    Containerd(ContainerdArgs),
    /// Add a `tessera` runtime to Docker's daemon.json (`docker run --runtime tessera`),
    /// keeping every other key. Idempotent.
    Docker(EngineArgs),
    /// Add a `tessera` runtime to podman's containers.conf (`podman run --runtime tessera`).
    /// Idempotent.
    Podman(EngineArgs),
}

#[derive(Debug, Args)]
pub struct EngineArgs {
    /// The engine's configuration file (created when absent) [default:
    /// /etc/docker/daemon.json, /etc/containers/containers.conf].
    #[arg(long)]
    config: Option<PathBuf>,
    /// The runtime's name (`--runtime NAME`).
    #[arg(long, default_value = "tessera")]
    name: String,
    /// tessera-runtime's absolute path [default: beside this `tessera`, else
    /// /usr/local/bin/tessera-runtime].
    #[arg(long)]
    runtime_path: Option<PathBuf>,
    /// Docker only: a tessera-runtime configuration file for this engine (daemon.json
    /// `runtimeArgs`), e.g. one naming its `engine` for identity [default: none, so
    /// /etc/tessera/runtime.toml].
    #[arg(long)]
    runtime_config: Option<PathBuf>,
    /// Make it the engine's default runtime.
    #[arg(long)]
    set_default: bool,
    /// Print the change as a unified diff and write nothing.
    #[arg(long)]
    dry_run: bool,
    /// Disable NVIDIA's container toolkit: its runtimes (a default runtime naming one
    /// becomes this one), its OCI hooks and CDI specs, each with a backup. Without it
    /// they are only warned of.
    #[arg(long)]
    replace_nvidia: bool,
    #[command(flatten)]
    checks: CheckArgs,
}

#[derive(Debug, Args)]
pub struct ContainerdArgs {
    /// containerd's configuration file (created when absent).
    #[arg(long, default_value = "/etc/containerd/config.toml")]
    config: PathBuf,
    /// The runtime handler (and RuntimeClass) name.
    #[arg(long, default_value = "tessera")]
    handler: String,
    /// tessera-runtime's absolute path [default: beside this `tessera`, else
    /// /usr/local/bin/tessera-runtime].
    #[arg(long)]
    runtime_path: Option<PathBuf>,
    /// Where the handler's link to tessera-runtime (`containerd-<handler>`) and its
    /// runtime configuration (`containerd-<handler>.toml`, `kubelet = true`) go; root's
    /// alone. A new configuration starts from /etc/tessera/runtime.toml when that exists.
    #[arg(long, default_value = "/usr/local/lib/tessera")]
    runtime_dir: PathBuf,
    /// Make the handler containerd's default runtime (pods without a RuntimeClass too).
    #[arg(long)]
    set_default: bool,
    /// The config version for a new or empty file: 2 (containerd 1.6, 1.7) or 3 (2.x).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(i64).range(2..=3))]
    config_version: i64,
    /// Print the change as a unified diff and write nothing.
    #[arg(long)]
    dry_run: bool,
    /// Disable NVIDIA's container toolkit: its runtimes (a default runtime naming one
    /// becomes this handler), its OCI hooks and CDI specs, each with a backup. Without it
    /// they are only warned of.
    #[arg(long)]
    replace_nvidia: bool,
    #[command(flatten)]
    checks: CheckArgs,
}

fn default_runtime_path() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join("tessera-runtime")))
        .filter(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("/usr/local/bin/tessera-runtime"))
}

/// `socket`: tesserad's, for the policy it enforces; `explicit`: given with `--socket`
/// (then also written into the CRI handler's runtime configuration).
pub fn run(cmd: SetupCmd, socket: &Path, explicit: bool) -> Result<(), String> {
    match cmd {
        SetupCmd::Containerd(a) => containerd(a, socket, explicit),
        SetupCmd::Docker(a) => engine(Engine::Docker, a, socket),
        SetupCmd::Podman(a) => engine(Engine::Podman, a, socket),
    }
}

/// The engine's configuration is written only into a directory that exists: a missing one
/// means the engine is not installed, or the path is mistyped.
fn check_dir(config: &Path, engine: &str) -> Result<(), String> {
    let dir = config.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if dir.is_dir() {
        return Ok(());
    }
    Err(format!(
        "{} does not exist: is {engine} installed here? (tessera setup writes {} only into a \
         directory that exists; nothing was created)",
        dir.display(),
        config.display()
    ))
}

/// Refuses a configuration that traps (`tessera doctor`'s identity and configuration
/// traps), printing the report otherwise.
fn check_traps(report: &diag::Report, shown: &str) -> Result<(), String> {
    let traps: Vec<String> =
        report.setup_traps().map(|f| format!("  {}: {}", f.subject, f.text)).collect();
    if !traps.is_empty() {
        return Err(format!(
            "not writing {shown}: with it, the node would trap (`tessera doctor`):\n{}",
            traps.join("\n")
        ));
    }
    for f in report.findings.iter().filter(|f| f.kind != diag::Kind::Nvidia) {
        let mark = if f.severity == diag::Severity::Warning { "warning: " } else { "" };
        println!("doctor: {mark}{}: {}", f.subject, f.text);
    }
    Ok(())
}

/// NVIDIA's toolkit: with `apply`, the files are disabled (or, with `dry_run`, said);
/// without, everything found is warned of.
fn nvidia_files_and_warnings(
    found: &NvidiaFound,
    checks: &CheckArgs,
    engine: &str,
    apply: bool,
    dry_run: bool,
) -> Result<(), String> {
    let files = doctor::nvidia_files(&checks.cdi_dirs(), &checks.hooks_dirs());
    if !apply {
        if found.lines.is_empty() && files.is_empty() {
            return Ok(());
        }
        eprintln!(
            "warning: NVIDIA's container toolkit is still configured here, so GPUs stay reachable \
             outside Tessera's policy:"
        );
        for l in &found.lines {
            eprintln!("  {l}");
        }
        for (f, what) in &files {
            eprintln!("  {} ({what})", f.display());
        }
        eprintln!("run `tessera setup {engine} --replace-nvidia` to disable them (with backups)");
        return Ok(());
    }
    for l in &found.lines {
        let verb = if dry_run { "would disable" } else { "disabled" };
        println!("{verb} {l}");
    }
    for (f, what) in &files {
        if dry_run {
            println!(
                "would disable {} ({what}): renamed to {}.tessera-disabled-<time>",
                f.display(),
                f.display()
            );
        } else {
            let to = doctor::disable_file(f)?;
            println!("disabled {} ({what}): renamed to {}", f.display(), to.display());
        }
    }
    Ok(())
}

/// tessera-hook for the `--gpus` link: beside tessera-runtime (followed through links),
/// else beside this `tessera`; `None` when neither has one.
fn hook_for(runtime_path: &Path) -> Option<PathBuf> {
    let beside = |p: &Path| p.parent().map(|d| d.join("tessera-hook")).filter(|h| h.is_file());
    fs::canonicalize(runtime_path)
        .ok()
        .and_then(|p| beside(&p))
        .or_else(|| beside(runtime_path))
        .or_else(|| std::env::current_exe().ok().and_then(|e| beside(&e)))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Engine {
    Docker,
    Podman,
}

fn engine(which: Engine, a: EngineArgs, socket: &Path) -> Result<(), String> {
    let (default_config, restart) = match which {
        Engine::Docker => ("/etc/docker/daemon.json", "systemctl restart docker"),
        Engine::Podman => (
            "/etc/containers/containers.conf",
            "nothing to restart: podman reads it on every command",
        ),
    };
    let config = resolve(&a.config.clone().unwrap_or_else(|| PathBuf::from(default_config)))?;
    let engine_name = match which {
        Engine::Docker => "docker",
        Engine::Podman => "podman",
    };
    check_dir(&config, engine_name)?;
    let shown = config.display().to_string();
    let text = match fs::read_to_string(&config) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(format!("cannot read {shown}: {e}")),
    };
    let runtime_path = a.runtime_path.clone().unwrap_or_else(default_runtime_path);
    let opts = setup::EngineOptions {
        name: a.name.clone(),
        runtime_path: runtime_path.to_string_lossy().into_owned(),
        runtime_config: a.runtime_config.as_ref().map(|p| p.to_string_lossy().into_owned()),
        set_default: a.set_default,
    };
    let edit = match which {
        Engine::Docker => setup::docker(&text, &shown, &opts),
        Engine::Podman => setup::podman(&text, &shown, &opts),
    }
    .map_err(|e| e.to_string())?;
    // NVIDIA's runtimes in the same file: taken out with --replace-nvidia, else warned of.
    let (nv, found) = match which {
        Engine::Docker => setup::docker_nvidia(&edit.after, &shown, &a.name, a.replace_nvidia),
        Engine::Podman => setup::podman_nvidia(&edit.after, &shown, &a.name, a.replace_nvidia),
    }
    .map_err(|e| e.to_string())?;
    let edit = setup::Edit { before: edit.before, after: nv.after, version: 0 };
    // What the result means, checked before anything is written.
    let (diag_engine, configured) = match which {
        Engine::Docker => (DiagEngine::Docker, tessera::engines::docker(&edit.after, &shown)),
        Engine::Podman => (DiagEngine::Podman, tessera::engines::podman(&edit.after, &shown)),
    };
    let configured = configured.map_err(|e| e.to_string())?;
    let ours = [runtime_path.to_string_lossy().into_owned()];
    let runtimes = doctor::tessera_runtimes(diag_engine, &configured, &ours);
    let policy = doctor::find_policy(a.checks.policy.as_deref(), socket)?;
    check_traps(&diag::diagnose(policy.as_ref(), &runtimes, Vec::new()), &shown)?;
    if a.dry_run {
        if edit.changed() {
            print!("{}", edit.diff(&shown));
        } else {
            println!("{shown}: already set up for runtime `{}`; nothing to change", a.name);
        }
        return nvidia_files_and_warnings(&found, &a.checks, engine_name, a.replace_nvidia, true);
    }
    if !edit.changed() {
        println!("{shown}: already set up for runtime `{}`; nothing changed", a.name);
    } else {
        match write_with_backup(&config, &edit.after)? {
            Some(b) => println!("{shown}: wrote runtime `{}` (backup: {})", a.name, b.display()),
            None => println!("{shown}: wrote runtime `{}` (new file)", a.name),
        }
        println!("to apply it: {restart}");
    }
    if !Path::new(&runtime_path).is_file() {
        eprintln!(
            "warning: {} does not exist yet; install tessera-runtime there before containers use it",
            runtime_path.display()
        );
    }
    if let Some(c) = a.runtime_config.as_ref().filter(|c| !c.is_file()) {
        eprintln!("warning: runtime config {} does not exist yet; tessera-runtime refuses to run without it", c.display());
    }
    nvidia_files_and_warnings(&found, &a.checks, engine_name, a.replace_nvidia, false)?;
    if which == Engine::Docker {
        match hook_for(&runtime_path) {
            Some(hook) => println!(
                "`docker run --gpus` needs an executable named nvidia-container-runtime-hook on dockerd's \
                 PATH when dockerd starts, e.g.: ln -sf {} /usr/local/bin/nvidia-container-runtime-hook",
                hook.display()
            ),
            None => println!(
                "`docker run --gpus` needs an executable named nvidia-container-runtime-hook on dockerd's \
                 PATH when dockerd starts: install tessera-hook (beside tessera-runtime) and link it there \
                 under that name"
            ),
        }
    }
    Ok(())
}

/// The file to edit: a symlinked config is edited where it points (replacing the link
/// with a regular file would leave the file the engine reads unchanged).
fn resolve(path: &Path) -> Result<PathBuf, String> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => fs::canonicalize(path)
            .map_err(|e| format!("{} is a symlink that cannot be followed: {e}", path.display())),
        _ => Ok(path.to_path_buf()),
    }
}

/// containerd's own reading of `config` (`containerd --config FILE config dump`), or
/// `None` where no containerd binary is on PATH.
fn containerd_dump(config: &Path) -> Result<Option<String>, String> {
    let out = match std::process::Command::new("containerd")
        .arg("--config")
        .arg(config)
        .args(["config", "dump"])
        .output()
    {
        Ok(o) => o,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot run containerd config dump: {e}")),
    };
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(format!(
            "containerd cannot read {}: {}",
            config.display(),
            tessera_api::untrusted(err.trim())
        ));
    }
    Ok(Some(String::from_utf8_lossy(&out.stdout).into_owned()))
}

/// The handler's link and its runtime configuration, as they are to be.
struct KubeletRuntime {
    link: PathBuf,
    target: PathBuf,
    config: PathBuf,
    edit: setup::Edit,
}

impl KubeletRuntime {
    fn plan(
        dir: &Path,
        handler: &str,
        target: &Path,
        socket: Option<&str>,
    ) -> Result<KubeletRuntime, String> {
        if !dir.is_absolute() {
            return Err(format!("--runtime-dir {} must be an absolute path", dir.display()));
        }
        let link = PathBuf::from(setup::kubelet_link(&dir.to_string_lossy(), handler));
        let mut config = link.clone().into_os_string();
        config.push(".toml");
        let config = PathBuf::from(config);
        let shown = config.display().to_string();
        let text = match fs::read_to_string(&config) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(format!("cannot read {shown}: {e}")),
        };
        let base = match text.is_empty() {
            true => fs::read_to_string(runtime_hook::config::DEFAULT_CONFIG).ok(),
            false => None,
        };
        let edit = setup::kubelet_runtime_config(&text, &shown, base.as_deref(), socket)
            .map_err(|e| e.to_string())?;
        Ok(KubeletRuntime { link, target: target.to_path_buf(), config, edit })
    }

    /// The link as it is now: `Ok(true)` when it already points at the target.
    fn link_is_current(&self) -> Result<bool, String> {
        match fs::symlink_metadata(&self.link) {
            Ok(m) if m.file_type().is_symlink() => {
                Ok(fs::read_link(&self.link).ok().as_deref() == Some(self.target.as_path()))
            }
            Ok(_) => Err(format!(
                "{} exists and is not a link: not replacing it (remove it, or choose another --runtime-dir)",
                self.link.display()
            )),
            Err(_) => Ok(false),
        }
    }

    fn dry_run(&self) -> Result<(), String> {
        if !self.link_is_current()? {
            println!("would link {} -> {}", self.link.display(), self.target.display());
        }
        if self.edit.changed() {
            print!("{}", self.edit.diff(&self.config.display().to_string()));
        }
        Ok(())
    }

    fn write(&self) -> Result<(), String> {
        let dir = self.link.parent().unwrap_or(Path::new("/"));
        fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        if !self.link_is_current()? {
            let mut tmp = self.link.clone().into_os_string();
            tmp.push(".tessera-tmp");
            let tmp = PathBuf::from(tmp);
            let _ = fs::remove_file(&tmp);
            std::os::unix::fs::symlink(&self.target, &tmp)
                .and_then(|()| fs::rename(&tmp, &self.link))
                .map_err(|e| format!("cannot link {}: {e}", self.link.display()))?;
            println!("linked {} -> {}", self.link.display(), self.target.display());
        }
        if self.edit.changed() {
            write_with_backup(&self.config, &self.edit.after)?;
            println!(
                "{}: wrote `kubelet = true` (the CRI handler's runtime configuration)",
                self.config.display()
            );
        }
        Ok(())
    }
}

fn containerd(a: ContainerdArgs, socket: &Path, explicit_socket: bool) -> Result<(), String> {
    let config = resolve(&a.config)?;
    check_dir(&config, "containerd")?;
    let a = ContainerdArgs { config, ..a };
    let shown = a.config.display().to_string();
    let text = match fs::read_to_string(&a.config) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(format!("cannot read {shown}: {e}")),
    };
    let runtime_path = a.runtime_path.clone().unwrap_or_else(default_runtime_path);
    // containerd runs the link; tessera-runtime, run as it, reads the configuration beside
    // it: the kubelet engine's, which no other engine reads.
    let socket_setting = explicit_socket.then(|| socket.to_string_lossy().into_owned());
    let kubelet =
        KubeletRuntime::plan(&a.runtime_dir, &a.handler, &runtime_path, socket_setting.as_deref())?;
    let opts = ContainerdOptions {
        handler: a.handler.clone(),
        runtime_path: kubelet.link.to_string_lossy().into_owned(),
        set_default: a.set_default,
        empty_version: a.config_version,
    };
    let edit = setup::containerd(&text, &shown, &opts).map_err(|e| e.to_string())?;
    let (nv, found) = setup::containerd_nvidia(&edit.after, &shown, &a.handler, a.replace_nvidia)
        .map_err(|e| e.to_string())?;
    let edit = setup::Edit { before: edit.before, after: nv.after, version: edit.version };
    // What the result means, with the handler's configuration as it is to be.
    let configured =
        tessera::engines::containerd(&edit.after, &shown).map_err(|e| e.to_string())?;
    let (ours, others): (Vec<_>, Vec<_>) =
        configured.into_iter().partition(|c| c.name == a.handler);
    let mut runtimes = doctor::tessera_runtimes(DiagEngine::Containerd, &others, &[]);
    runtimes.extend(ours.iter().map(|c| {
        Runtime {
            engine: DiagEngine::Containerd,
            name: c.name.clone(),
            config_file: kubelet.config.display().to_string(),
            config: runtime_hook::config::parse(
                &kubelet.edit.after,
                &kubelet.config.display().to_string(),
            )
            .map_err(|e| e.to_string()),
            is_default: c.is_default,
        }
    }));
    let policy = doctor::find_policy(a.checks.policy.as_deref(), socket)?;
    check_traps(&diag::diagnose(policy.as_ref(), &runtimes, Vec::new()), &shown)?;
    if a.dry_run {
        kubelet.dry_run()?;
        if edit.changed() {
            print!("{}", edit.diff(&shown));
        } else {
            println!(
                "{shown}: already set up for runtime handler `{}`; nothing to change",
                a.handler
            );
        }
        return nvidia_files_and_warnings(&found, &a.checks, "containerd", a.replace_nvidia, true);
    }
    kubelet.write()?;
    if !edit.changed() {
        println!("{shown}: already set up for runtime handler `{}`; nothing changed", a.handler);
    } else {
        let backup = write_with_backup(&a.config, &edit.after)?;
        // What containerd makes of the file (its `imports` merged): if that is not the
        // handler as written, put the original back.
        let verdict = containerd_dump(&a.config).and_then(|dump| match dump {
            Some(d) => {
                setup::check_dump(&d, &shown, &opts, edit.version).map_err(|e| e.to_string())
            }
            None => {
                eprintln!("note: no containerd on PATH; the result was not read back through it");
                Ok(())
            }
        });
        if let Err(e) = verdict {
            let restored = match &backup {
                Some(b) => fs::copy(b, &a.config).map(drop),
                None => fs::remove_file(&a.config),
            };
            return Err(match restored {
                Ok(()) => format!("{e}; {shown} was restored"),
                Err(r) => format!("{e}; restoring {shown} failed too: {r}"),
            });
        }
        match backup {
            Some(b) => {
                println!("{shown}: wrote runtime handler `{}` (backup: {})", a.handler, b.display())
            }
            None => println!("{shown}: wrote runtime handler `{}` (new file)", a.handler),
        }
        println!("restart containerd to apply it: systemctl restart containerd");
    }
    if !Path::new(&runtime_path).is_file() {
        eprintln!(
            "warning: {} does not exist yet; install tessera-runtime there before pods use the handler",
            runtime_path.display()
        );
    }
    nvidia_files_and_warnings(&found, &a.checks, "containerd", a.replace_nvidia, false)?;
    println!("\n# The RuntimeClass that selects it (kubectl apply -f -):");
    print!("{}", setup::runtime_class(&a.handler));
    Ok(())
}

/// Copies `path` to a new `<file>.tessera-backup-<unix seconds>[-N]`, never over an
/// earlier backup.
fn backup_copy(path: &Path) -> Result<PathBuf, String> {
    let stamp = tessera_api::time::now_ms() / 1000;
    for n in 0..1000 {
        let mut b = path.as_os_str().to_owned();
        b.push(format!(".tessera-backup-{stamp}"));
        if n > 0 {
            b.push(format!("-{n}"));
        }
        let b = PathBuf::from(b);
        let mut out = match fs::OpenOptions::new().write(true).create_new(true).open(&b) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(format!("cannot create backup {}: {e}", b.display())),
        };
        let copied = fs::File::open(path)
            .and_then(|mut src| std::io::copy(&mut src, &mut out))
            .and_then(|_| out.sync_all());
        return copied.map(|()| b.clone()).map_err(|e| {
            let _ = fs::remove_file(&b);
            format!("cannot back {} up to {}: {e}", path.display(), b.display())
        });
    }
    Err(format!("cannot find a free backup name beside {}", path.display()))
}

/// Copies the file (when it exists) to a new backup ([`backup_copy`]), then
/// replaces it atomically (same mode), and returns the backup's path.
fn write_with_backup(path: &Path, text: &str) -> Result<Option<PathBuf>, String> {
    let shown = path.display();
    let mode = fs::metadata(path).map(|m| m.permissions().mode() & 0o7777).ok();
    let backup = match mode {
        Some(_) => Some(backup_copy(path)?),
        None => None,
    };
    // The engine's config keeps its mode.
    tessera_api::durable::replace(
        path,
        text.as_bytes(),
        mode.unwrap_or(0o644),
        tessera_api::durable::Sync::Durable,
    )
    .map_err(|e| format!("cannot write {shown}: {e}"))?;
    Ok(backup)
}
