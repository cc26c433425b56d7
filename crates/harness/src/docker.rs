//! A private dockerd (Debian's docker.io 20.10) for the Docker tests: `--iptables=false
//! --bridge=none`, data-root, exec-root, pidfile and socket in one temp dir, its own
//! containerd (dockerd starts one under the exec-root), every container under one cgroup
//! parent, and `daemon.json` edited by `tessera setup docker` before it starts. Only PATH
//! is given to it (a dir holding the `nvidia-container-runtime-hook` link that `--gpus`
//! needs); no `TESSERA_*` variable: runtimes find tesserad through their runtime config.
//! Stopped and cleaned on drop: containers, dockerd, its containerd and shims, mounts,
//! cgroups, the temp dir.

use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use crate::*;

/// Debian's dockerd and docker CLI (not whatever `docker` comes first on PATH).
pub const DOCKERD: &str = "/usr/sbin/dockerd";
pub const DOCKER: &str = "/usr/bin/docker";
/// The image [`Dockerd::start`] imports from the harness's busybox rootfs.
pub const DOCKER_IMAGE: &str = "tessera-busybox:test";

#[derive(Debug)]
pub struct Dockerd {
    dir: PathBuf,
    socket: PathBuf,
    cgroup_parent: String,
    process: Option<ChildProcess>,
    cleanup: Cleanup,
}

impl Dockerd {
    /// Starts dockerd after `configure(daemon.json, dir)` has set the file up (e.g. with
    /// `tessera setup docker`), imports [`DOCKER_IMAGE`] and returns once it answers.
    pub fn start(configure: impl FnOnce(&Path, &Path)) -> Dockerd {
        sweep_stale_cgroups();
        let dir = short_tempdir();
        let cleanup = Cleanup::new();
        cleanup.track_dir(&dir);
        let cgroup_parent = format!("/{}", unique_name());
        cleanup.track_cgroup(&cgroup_parent);
        let exec = dir.join("exec");
        for rt in ["runc", "tessera", "tessera-alice", "tessera-typo", "nvidia"] {
            cleanup.track_runc_root(exec.join(format!("runtime-{rt}")).join("moby"));
        }
        let socket = dir.join("docker.sock");
        assert_sun_path_fits(&socket);
        let bin = dir.join("bin");
        fs::create_dir_all(&bin).expect("mkdir bin");
        symlink(tessera_hook(), bin.join("nvidia-container-runtime-hook")).expect("hook link");
        let config = dir.join("daemon.json");
        let base = json!({"cgroup-parent": cgroup_parent, "storage-driver": "overlay2"});
        fs::write(&config, serde_json::to_vec_pretty(&base).expect("json")).expect("daemon.json");
        configure(&config, &dir);
        let path = format!(
            "{}:{}",
            bin.display(),
            std::env::var("PATH").unwrap_or_else(|_| "/usr/sbin:/usr/bin:/sbin:/bin".into())
        );
        let arg = |s: &Path| s.as_os_str().to_owned();
        let args = vec![
            OsStr::new("--config-file").to_owned(),
            arg(&config),
            "--iptables=false".into(),
            "--ip-masq=false".into(),
            "--bridge=none".into(),
            "--data-root".into(),
            arg(&dir.join("data")),
            "--exec-root".into(),
            arg(&exec),
            "--pidfile".into(),
            arg(&dir.join("docker.pid")),
            "-H".into(),
            format!("unix://{}", socket.display()).into(),
        ];
        let process =
            ChildProcess::spawn("dockerd", DOCKERD, args, [("PATH", path)], &dir.join("logs"));
        cleanup.track_pid(process.pid());
        let pid = process.pid() as i32;
        let d = Dockerd { dir, socket, cgroup_parent, process: Some(process), cleanup };
        wait_for(
            || !pid_alive(pid, None) || d.docker(&["version"]).status.success(),
            Duration::from_secs(30),
        );
        assert!(d.docker(&["version"]).status.success(), "dockerd did not come up:\n{}", d.log());
        let rootfs = Rootfs::busybox(d.dir.join("image"));
        let tar = d.dir.join("image.tar");
        run_cmd(Command::new("tar").arg("-C").arg(&rootfs).arg("-cf").arg(&tar).arg("."))
            .assert_success("tar the busybox rootfs");
        let out = d.docker(&["import", &tar.to_string_lossy(), DOCKER_IMAGE]);
        out.assert_success("docker import");
        d
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// The cgroup parent of every container (daemon.json `cgroup-parent`).
    pub fn cgroup_parent(&self) -> &str {
        &self.cgroup_parent
    }
    pub fn log(&self) -> String {
        self.process.as_ref().map(ChildProcess::stderr).unwrap_or_default()
    }

    /// `docker -H unix://SOCKET ARGS..`, output captured.
    pub fn docker(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new(DOCKER);
        cmd.arg("-H").arg(format!("unix://{}", self.socket.display())).args(args);
        output_timeout(&mut cmd, CMD_TIMEOUT).expect("run docker")
    }

    /// A container's cgroup (v1 path under each controller), by its full id.
    pub fn container_cgroup(&self, id: &str) -> String {
        format!("{}/{id}", self.cgroup_parent)
    }

    /// Stops everything (idempotent).
    pub fn stop(&mut self) {
        let Some(mut process) = self.process.take() else { return };
        if process.is_running() {
            let ids = self.docker(&["ps", "-aq"]);
            for id in ids.stdout_str().split_whitespace() {
                let _ = self.docker(&["rm", "-f", id]);
            }
        }
        // dockerd stops its containerd on SIGTERM; the cleanup kills anything left that
        // names the dir (containerd, shims) and unmounts what is under it.
        process.terminate(Duration::from_secs(15));
        self.cleanup.run();
    }
}

impl Drop for Dockerd {
    fn drop(&mut self) {
        self.stop();
    }
}
