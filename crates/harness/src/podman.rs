//! podman (Debian's 4.3) as root for the podman tests, everything it can keep in one temp
//! dir kept there: `--root`, `--runroot`, `--tmpdir` (which also holds its file locks,
//! `lock_type = "file"`, and its events log, `--events-backend file`), storage driver vfs,
//! cgroups through cgroupfs under one parent (`--cgroup-parent` on every `run`/`create`,
//! conmon's too), no network (`netns = "none"`, its CNI config dir in the temp dir), and
//! `CONTAINERS_CONF` naming a containers.conf in the temp dir that `configure` (e.g.
//! `tessera setup podman --config FILE`) edits. No `TESSERA_*` variable reaches podman:
//! its runtime is a link to tessera-runtime in `<dir>/bin`, which reads the runtime
//! configuration beside the link (`<link>.toml`, see runtime_hook::config), since podman
//! passes its runtimes neither environment nor (from containers.conf) arguments.
//!
//! What podman 4.3 writes outside the dir whatever it is told, all removed on drop when
//! the fixture created it:
//! - runc's state, `/run/runc/<container id>`: podman gives runc no `--root` (a
//!   `--runtime-flag root=...` would not help: the `podman container cleanup` conmon runs
//!   at exit passes no runtime flags, so its `delete` would look in `/run/runc`);
//! - `/var/lib/containers/cache/blob-info-cache-v1.boltdb` (containers/image's blob cache,
//!   written by `podman import`; its directory has no setting in podman 4.3);
//! - CDI specs for `--device VENDOR/CLASS=NAME`: podman 4.3 reads only `/etc/cdi` and
//!   `/var/run/cdi` ([`Podman::cdi_spec_path`] gives a uniquely named file in the
//!   latter).
//!
//! One fixture at a time per test process (a lock), since the last two are shared.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use crate::*;

/// Debian's podman (not whatever `podman` comes first on PATH).
pub const PODMAN: &str = "/usr/bin/podman";
/// The image [`Podman::start`] imports from the harness's busybox rootfs (fully qualified:
/// a short name makes podman write its short-name alias cache under /var/cache).
pub const PODMAN_IMAGE: &str = "localhost/tessera-busybox:test";
/// Where podman 4.3 reads CDI specs (besides /etc/cdi).
pub const CDI_RUN_DIR: &str = "/var/run/cdi";
/// runc's default root: podman passes runc no `--root`.
pub const RUNC_DEFAULT_ROOT: &str = "/run/runc";
/// containers/image's blob info cache for root (`podman import` writes it).
const BLOB_CACHE_DIRS: [&str; 2] = ["/var/lib/containers/cache", "/var/lib/containers"];
const BLOB_CACHE_FILE: &str = "/var/lib/containers/cache/blob-info-cache-v1.boltdb";

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

#[derive(Debug)]
pub struct Podman {
    dir: PathBuf,
    conf: PathBuf,
    cgroup_parent: String,
    cleanup: Cleanup,
    /// Paths outside `dir` that did not exist before the fixture (removed if empty).
    created_dirs: Vec<PathBuf>,
    /// CDI spec files handed out by [`Podman::cdi_spec_path`].
    cdi_specs: Vec<PathBuf>,
    stopped: bool,
    _one: MutexGuard<'static, ()>,
}

impl Podman {
    /// Sets up the dir and containers.conf, runs `configure(containers.conf, dir)`, then
    /// imports [`PODMAN_IMAGE`].
    pub fn start(configure: impl FnOnce(&Path, &Path)) -> Podman {
        let one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
        sweep_stale_cgroups();
        let dir = short_tempdir();
        let cleanup = Cleanup::new();
        cleanup.track_dir(&dir);
        let cgroup_parent = format!("/{}", unique_name());
        cleanup.track_cgroup(&cgroup_parent);
        let created_dirs = [RUNC_DEFAULT_ROOT, CDI_RUN_DIR]
            .into_iter()
            .chain(BLOB_CACHE_DIRS)
            .map(PathBuf::from)
            .filter(|p| fs::symlink_metadata(p).is_err())
            .collect();
        fs::create_dir_all(dir.join("bin")).expect("mkdir bin");
        let conf = dir.join("containers.conf");
        let q = |p: &str| toml_str(&dir.join(p).to_string_lossy());
        // The limits podman sets by default (nofile and nproc 1048576 for root) need
        // CAP_SYS_RESOURCE, which test machines (containers, CI) may lack.
        let base = format!(
            "[containers]\nnetns = \"none\"\ndefault_ulimits = [\"nofile=1024:1024\", \
             \"nproc=4096:4096\"]\n\n[engine]\ncgroup_manager = \"cgroupfs\"\n\
             events_logger = \"file\"\nlock_type = \"file\"\n\n[network]\n\
             network_config_dir = {}\n",
            q("net")
        );
        fs::write(&conf, base).expect("containers.conf");
        configure(&conf, &dir);
        let p = Podman {
            dir,
            conf,
            cgroup_parent,
            cleanup,
            created_dirs,
            cdi_specs: Vec::new(),
            stopped: false,
            _one: one,
        };
        let rootfs = Rootfs::busybox(p.dir.join("image"));
        let tar = p.dir.join("image.tar");
        run_cmd(Command::new("tar").arg("-C").arg(&rootfs).arg("-cf").arg(&tar).arg("."))
            .assert_success("tar the busybox rootfs");
        p.podman(&["import", "--quiet", &tar.to_string_lossy(), PODMAN_IMAGE])
            .assert_success("podman import");
        let _ = fs::remove_file(&tar);
        p
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// The containers.conf podman reads (`CONTAINERS_CONF`).
    pub fn containers_conf(&self) -> &Path {
        &self.conf
    }
    /// The cgroup parent of every container and its conmon.
    pub fn cgroup_parent(&self) -> &str {
        &self.cgroup_parent
    }

    /// A link `<dir>/bin/NAME -> tessera-runtime` for `[engine.runtimes]`; its runtime
    /// configuration is [`Podman::runtime_config_of`] that link.
    pub fn runtime_link(dir: &Path, name: &str) -> PathBuf {
        let link = dir.join("bin").join(name);
        if fs::symlink_metadata(&link).is_err() {
            symlink(tessera_runtime(), &link).expect("runtime link");
        }
        link
    }

    /// The file tessera-runtime reads when run as `link`: `<link>.toml`.
    pub fn runtime_config_of(link: &Path) -> PathBuf {
        let mut f = link.as_os_str().to_owned();
        f.push(".toml");
        PathBuf::from(f)
    }

    /// `podman [the fixture's global flags] ARGS..` with only `CONTAINERS_CONF` added to
    /// the environment (every `TESSERA_*` removed); `run` and `create` get
    /// `--cgroup-parent` too. Output captured.
    pub fn podman(&self, args: &[&str]) -> Output {
        let d = |rel: &str| self.dir.join(rel);
        let mut cmd = Command::new(PODMAN);
        cmd.arg("--root")
            .arg(d("root"))
            .arg("--runroot")
            .arg(d("runroot"))
            .arg("--tmpdir")
            .arg(d("tmp"))
            .args(["--storage-driver", "vfs", "--cgroup-manager", "cgroupfs"])
            .args(["--events-backend", "file"]);
        match args.split_first() {
            Some((verb, rest)) if *verb == "run" || *verb == "create" => {
                cmd.arg(verb).args(["--cgroup-parent", &self.cgroup_parent]).args(rest);
            }
            _ => {
                cmd.args(args);
            }
        }
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("TESSERA_") {
                cmd.env_remove(k);
            }
        }
        cmd.env("CONTAINERS_CONF", &self.conf);
        output_timeout(&mut cmd, CMD_TIMEOUT).expect("run podman")
    }

    /// A path `/var/run/cdi/<unique>.yaml` for a CDI spec (podman 4.3 reads no other dir
    /// but /etc/cdi), the dir created if absent; whatever is written there is removed on
    /// drop.
    pub fn cdi_spec_path(&mut self) -> PathBuf {
        fs::create_dir_all(CDI_RUN_DIR).expect("mkdir /var/run/cdi");
        let f = Path::new(CDI_RUN_DIR).join(format!("{}.yaml", unique_name()));
        self.cleanup.track_file(&f);
        self.cdi_specs.push(f.clone());
        f
    }

    /// Every container podman knows of (full ids).
    fn container_ids(&self) -> Vec<String> {
        let out = self.podman(&["ps", "-aq", "--no-trunc"]);
        out.stdout_str().split_whitespace().map(str::to_owned).collect()
    }

    /// What must be gone once the fixture is dropped.
    pub fn footprint(&self) -> Footprint {
        let mut fp = self.cleanup.footprint();
        fp.files.extend(self.created_dirs.iter().cloned());
        fp
    }

    /// Stops everything (idempotent): `podman rm -f` every container (its conmon exits,
    /// tessera-runtime gives the grant back), runc state left in /run/runc deleted, then
    /// the generic [`Cleanup`] (processes naming the dir, such as conmon and `podman
    /// container cleanup`, cgroups, mounts, the dir), then what podman made outside it.
    pub fn stop(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        let ids = self.container_ids();
        for id in &ids {
            let _ = self.podman(&["rm", "-f", "-t", "0", id]);
        }
        for id in &ids {
            let state = Path::new(RUNC_DEFAULT_ROOT).join(id);
            if state.exists() {
                let mut cmd = Command::new(RUNC);
                cmd.args(["--root", RUNC_DEFAULT_ROOT, "delete", "-f", id]);
                let _ = output_timeout(&mut cmd, Duration::from_secs(20));
            }
            self.cleanup.track_file(state);
        }
        self.cleanup.run();
        for f in &self.cdi_specs {
            let _ = fs::remove_file(f);
        }
        // Only the ones this fixture created, and only if empty (rmdir).
        for d in &self.created_dirs {
            if d.as_path() == Path::new(BLOB_CACHE_DIRS[0]) {
                let _ = fs::remove_file(BLOB_CACHE_FILE);
            }
            let _ = fs::remove_dir(d);
        }
    }
}

impl Drop for Podman {
    fn drop(&mut self) {
        self.stop();
    }
}
