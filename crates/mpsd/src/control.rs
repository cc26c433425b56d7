//! The hardware seam: how the supervisor reaches an MPS control daemon.
//!
//! [`ProcessControl`] is the one real implementation: it runs a control binary, either
//! NVIDIA's `nvidia-cuda-mps-control` or the test double `fake-nvidia-cuda-mps-control`
//! (they speak the same protocol; tesserad picks one by path, `--mps-control PATH`).
//!
//! Every run of the binary gets a cleared environment holding only a fixed `PATH`,
//! `CUDA_VISIBLE_DEVICES=<device uuid>`, `CUDA_MPS_PIPE_DIRECTORY`, `CUDA_MPS_LOG_DIRECTORY`
//! and what [`ProcessControl::with_env`] adds, so nothing of tesserad's own environment
//! (`LD_PRELOAD`, `CUDA_*`, proxies...) reaches the daemon or the GPU.

use std::ffi::OsStr;
use std::fmt;
use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::layout::PID_FILE;
use crate::protocol::{sanitize, Command, NO_DAEMON};
use crate::MpsError;

/// One control daemon's identity: the device it serves and its directories.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DaemonSpec {
    /// The device UUID (`GPU-...` or `MIG-...`), the daemon's whole `CUDA_VISIBLE_DEVICES`.
    pub device: String,
    pub pipe_dir: PathBuf,
    pub log_dir: PathBuf,
    /// When set, the daemon (and the servers it starts) run in a private mount namespace
    /// with this directory bound on `/dev/shm`, the same directory the share's containers
    /// get as their `/dev/shm` (MPS clients and servers talk through shared memory).
    /// Needs CAP_SYS_ADMIN.
    pub shm_dir: Option<PathBuf>,
}

/// How the supervisor reaches MPS control daemons.
pub trait MpsControl: Send + Sync + fmt::Debug {
    /// Start a control daemon for `spec` (`<binary> -d`) and return its PID once it is up.
    fn start_daemon(&self, spec: &DaemonSpec) -> Result<u32, MpsError>;
    /// Send one command to the daemon of `spec`; return its answer (stdout).
    fn send(&self, spec: &DaemonSpec, cmd: &Command) -> Result<String, MpsError>;
    /// The PID of the live control daemon of `spec`, if there is one: from the PID file
    /// the daemon writes into its pipe dir, checked against the process table so a dead
    /// daemon's recycled PID is never taken for it.
    fn daemon_pid(&self, spec: &DaemonSpec) -> Option<u32>;
    /// SIGKILL the control daemon `pid` of `spec`, if it still is that daemon.
    fn kill_daemon(&self, spec: &DaemonSpec, pid: u32) -> Result<(), MpsError>;
}

/// A control binary path tesserad cannot run as meant.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BinaryPathError {
    #[error("the MPS control binary path is empty")]
    Empty,
    /// A relative path with a directory in it: every control process runs in `/`, where
    /// it would name another file than the one meant.
    #[error(
        "{}: a relative path; the MPS control binary runs with `/` as its working \
         directory, where this names another file: give an absolute path (or a bare name \
         to look up in PATH)",
        .0.display()
    )]
    Relative(PathBuf),
}

/// Checks the control binary tesserad is given (`--mps-control`): an absolute path, or a
/// bare name (looked up in PATH when it runs); a relative path with a directory in it is
/// refused, since [`ProcessControl`] runs it from `/`.
pub fn check_binary(path: &Path) -> Result<(), BinaryPathError> {
    if path.as_os_str().is_empty() {
        return Err(BinaryPathError::Empty);
    }
    if path.is_relative() && path.components().count() > 1 {
        return Err(BinaryPathError::Relative(path.to_path_buf()));
    }
    Ok(())
}

/// Runs a control binary.
#[derive(Debug, Clone)]
pub struct ProcessControl {
    binary: PathBuf,
    proc_root: PathBuf,
    command_timeout: Duration,
    start_timeout: Duration,
    extra_env: Vec<(String, String)>,
}

/// The `PATH` every control process gets (after the binary's own directory, where the real
/// daemon's `nvidia-cuda-mps-server` lives).
const SAFE_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// At most this much of an answer is kept.
const MAX_ANSWER: usize = 64 * 1024;

impl ProcessControl {
    /// Use the control binary at `binary`, `/proc` as the process table, 10 s per command.
    pub fn new(binary: impl Into<PathBuf>) -> ProcessControl {
        ProcessControl {
            binary: binary.into(),
            proc_root: PathBuf::from("/proc"),
            command_timeout: Duration::from_secs(10),
            start_timeout: Duration::from_secs(10),
            extra_env: Vec::new(),
        }
    }

    /// Read processes from `proc_root` instead of `/proc`.
    pub fn with_proc_root(mut self, proc_root: impl Into<PathBuf>) -> Self {
        self.proc_root = proc_root.into();
        self
    }

    /// How long one command, and one daemon start, may take.
    pub fn with_timeouts(mut self, command: Duration, start: Duration) -> Self {
        self.command_timeout = command;
        self.start_timeout = start;
        self
    }

    /// Add a variable to every control process's environment (the test double's hooks,
    /// e.g. `FAKE_MPS_CRASH_AFTER_MS`; nothing the real binary needs).
    pub fn with_env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.extra_env.push((key.into(), value.into()));
        self
    }

    pub fn binary(&self) -> &Path {
        &self.binary
    }

    fn command(&self, spec: &DaemonSpec) -> std::process::Command {
        let mut path = String::new();
        if let Some(dir) = self
            .binary
            .parent()
            .and_then(Path::to_str)
            .filter(|d| !d.is_empty() && !d.contains(':'))
        {
            path.push_str(dir);
            path.push(':');
        }
        path.push_str(SAFE_PATH);
        let mut cmd = std::process::Command::new(&self.binary);
        cmd.env_clear()
            .env("PATH", path)
            .env("CUDA_VISIBLE_DEVICES", &spec.device)
            .env("CUDA_MPS_PIPE_DIRECTORY", &spec.pipe_dir)
            .env("CUDA_MPS_LOG_DIRECTORY", &spec.log_dir)
            .envs(self.extra_env.iter().map(|(k, v)| (k, v)))
            .current_dir("/");
        cmd
    }

    fn spawn_err(&self, source: std::io::Error) -> MpsError {
        MpsError::Spawn { binary: self.binary.clone(), source }
    }

    /// Whether `pid` is a live control daemon of this binary for `spec`.
    fn is_our_daemon(&self, pid: u32, spec: &DaemonSpec) -> bool {
        let dir = self.proc_root.join(pid.to_string());
        match std::fs::read_to_string(dir.join("stat")) {
            Ok(stat) => {
                if matches!(proc_state(&stat), None | Some('Z' | 'X')) {
                    reap(pid);
                    return false;
                }
            }
            Err(_) => return false,
        }
        let Ok(cmdline) = std::fs::read(dir.join("cmdline")) else { return false };
        let mut args = cmdline.split(|b| *b == 0).filter(|a| !a.is_empty());
        let Some(argv0) = args.next() else { return false };
        let want = self.binary.file_name().map(OsStr::as_bytes);
        let got = Path::new(OsStr::from_bytes(argv0)).file_name().map(OsStr::as_bytes);
        if want.is_none() || want != got {
            return false;
        }
        if !args.any(|a| a == b"-d" || a == b"-f") {
            return false;
        }
        // Where the environment is readable (root, or our own uid), it must name this pipe
        // dir: a PID recycled into another share's daemon is not this share's daemon.
        if let Ok(environ) = std::fs::read(dir.join("environ")) {
            let key = b"CUDA_MPS_PIPE_DIRECTORY=";
            if let Some(v) =
                environ.split(|b| *b == 0).find_map(|kv| kv.strip_prefix(key.as_slice()))
            {
                return Path::new(OsStr::from_bytes(v)) == spec.pipe_dir;
            }
        }
        true
    }
}

/// The state letter of a `/proc/PID/stat` line (after the parenthesised command name,
/// which may itself hold spaces and parentheses).
fn proc_state(stat: &str) -> Option<char> {
    stat[stat.rfind(')')? + 1..].split_ascii_whitespace().next()?.chars().next()
}

/// Reap `pid` if it is a zombie child of ours (it is when tesserad is a subreaper or PID 1);
/// harmless otherwise.
fn reap(pid: u32) {
    let Ok(raw) = i32::try_from(pid) else { return };
    let _ = nix::sys::wait::waitpid(
        nix::unistd::Pid::from_raw(raw),
        Some(nix::sys::wait::WaitPidFlag::WNOHANG),
    );
}

/// Wait for `child` up to `timeout`; None if it is still running.
fn wait_timeout(child: &mut Child, timeout: Duration) -> std::io::Result<Option<ExitStatus>> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(1);
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(25));
    }
}

/// Read all of `r`, keeping the first [`MAX_ANSWER`] bytes.
fn drain(mut r: impl Read) -> Vec<u8> {
    let mut kept = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match r.read(&mut buf) {
            Ok(0) | Err(_) => return kept,
            Ok(n) => {
                let room = MAX_ANSWER.saturating_sub(kept.len());
                kept.extend_from_slice(&buf[..n.min(room)]);
            }
        }
    }
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (None, Some(s)) => format!("killed by signal {s}"),
        _ => "unknown status".into(),
    }
}

/// Make `command` run in a new mount namespace (propagation from the host kept one-way)
/// with `shm` bound on `/dev/shm`.
fn private_shm(command: &mut std::process::Command, shm: &Path) -> Result<(), MpsError> {
    use std::ffi::CString;
    use std::os::unix::process::CommandExt;
    let bad = |e: std::ffi::NulError| {
        MpsError::io(shm, std::io::Error::new(std::io::ErrorKind::InvalidInput, e))
    };
    // Everything the child needs is allocated before the fork: between fork and exec only
    // async-signal-safe calls are made.
    let source = CString::new(shm.as_os_str().as_bytes()).map_err(bad)?;
    let target = CString::new("/dev/shm").map_err(bad)?;
    let root = CString::new("/").map_err(bad)?;
    let none = CString::new("none").map_err(bad)?;
    let hook = move || -> std::io::Result<()> {
        let check =
            |rc: libc::c_int| if rc == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) };
        // SAFETY: unshare takes no pointers; it only changes this (child) process.
        check(unsafe { libc::unshare(libc::CLONE_NEWNS) })?;
        // SAFETY: the CStrings outlive the calls (the closure owns them); null data and
        // fstype pointers are allowed for remount-propagation and bind mounts.
        check(unsafe {
            libc::mount(
                none.as_ptr(),
                root.as_ptr(),
                std::ptr::null(),
                libc::MS_REC | libc::MS_SLAVE,
                std::ptr::null(),
            )
        })?;
        // SAFETY: as above.
        check(unsafe {
            libc::mount(
                source.as_ptr(),
                target.as_ptr(),
                std::ptr::null(),
                libc::MS_BIND,
                std::ptr::null(),
            )
        })
    };
    // SAFETY: the hook runs between fork and exec and makes only async-signal-safe system
    // calls (unshare, mount) on memory allocated before the fork.
    unsafe { command.pre_exec(hook) };
    Ok(())
}

fn make_dir(path: &Path, mode: u32) -> Result<(), MpsError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(path).map_err(|e| MpsError::io(path, e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| MpsError::io(path, e))
}

impl MpsControl for ProcessControl {
    fn start_daemon(&self, spec: &DaemonSpec) -> Result<u32, MpsError> {
        // Containers reach the pipe dir through a bind mount and connect to the sockets in
        // it as any uid: world-searchable, writable by root only. The log dir is root's.
        make_dir(&spec.pipe_dir, 0o755)?;
        make_dir(&spec.log_dir, 0o700)?;
        if let Some(pid) = self.daemon_pid(spec) {
            return Err(MpsError::DaemonDidNotStart {
                pipe_dir: spec.pipe_dir.clone(),
                detail: format!("a control daemon (pid {pid}) already serves it"),
            });
        }
        // No live daemon: a PID file left by a dead one would only confuse the next reader.
        let pid_file = spec.pipe_dir.join(PID_FILE);
        let _ = std::fs::remove_file(&pid_file);

        let out_path = spec.log_dir.join("tesserad-start.log");
        let out = File::create(&out_path).map_err(|e| MpsError::io(&out_path, e))?;
        let err = out.try_clone().map_err(|e| MpsError::io(&out_path, e))?;
        let mut command = self.command(spec);
        command.arg("-d").stdin(Stdio::null()).stdout(Stdio::from(out)).stderr(Stdio::from(err));
        if let Some(shm) = &spec.shm_dir {
            make_dir(shm, 0o1777)?;
            private_shm(&mut command, shm)?;
        }
        let mut child = spawn_retrying(&mut command).map_err(|e| self.spawn_err(e))?;
        let started = Instant::now();
        let failed = |detail: String| MpsError::DaemonDidNotStart {
            pipe_dir: spec.pipe_dir.clone(),
            detail,
        };
        let said = || sanitize(std::fs::read_to_string(&out_path).unwrap_or_default().trim(), 400);
        match wait_timeout(&mut child, self.start_timeout).map_err(|e| self.spawn_err(e))? {
            Some(status) if status.success() => {}
            Some(status) => {
                return Err(failed(format!(
                    "`{} -d` ended with {}: {}",
                    self.binary.display(),
                    describe(status),
                    said()
                )))
            }
            None => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(failed(format!(
                    "`{} -d` did not return within {:?}",
                    self.binary.display(),
                    self.start_timeout
                )));
            }
        }
        // The launcher returned; wait for the daemon's PID file.
        loop {
            if let Some(pid) = self.daemon_pid(spec) {
                return Ok(pid);
            }
            if started.elapsed() >= self.start_timeout {
                return Err(failed(format!(
                    "no live control daemon wrote {} within {:?}: {}",
                    pid_file.display(),
                    self.start_timeout,
                    said()
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn send(&self, spec: &DaemonSpec, cmd: &Command) -> Result<String, MpsError> {
        let line = cmd.render();
        let mut command = self.command(spec);
        command.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = spawn_retrying(&mut command).map_err(|e| self.spawn_err(e))?;
        if let Some(mut stdin) = child.stdin.take() {
            // A client that exits before reading its stdin breaks the pipe: its exit status
            // and output tell what happened, so the write error itself is not the story.
            let _ = stdin.write_all(format!("{line}\n").as_bytes());
        }
        let out = child.stdout.take().map(|o| std::thread::spawn(move || drain(o)));
        let err = child.stderr.take().map(|e| std::thread::spawn(move || drain(e)));
        let status =
            wait_timeout(&mut child, self.command_timeout).map_err(|e| self.spawn_err(e))?;
        let Some(status) = status else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(MpsError::Timeout {
                command: line,
                pipe_dir: spec.pipe_dir.clone(),
                after_ms: u64::try_from(self.command_timeout.as_millis()).unwrap_or(u64::MAX),
            });
        };
        let join = |h: Option<std::thread::JoinHandle<Vec<u8>>>| {
            h.and_then(|h| h.join().ok())
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .unwrap_or_default()
        };
        let (stdout, stderr) = (join(out), join(err));
        if stdout.contains(NO_DAEMON) || stderr.contains(NO_DAEMON) {
            return Err(MpsError::NoDaemon { pipe_dir: spec.pipe_dir.clone() });
        }
        if !status.success() {
            return Err(MpsError::CommandFailed {
                command: line,
                pipe_dir: spec.pipe_dir.clone(),
                status: describe(status),
                output: sanitize(format!("{stdout}{stderr}").trim(), 400),
            });
        }
        Ok(stdout)
    }

    fn daemon_pid(&self, spec: &DaemonSpec) -> Option<u32> {
        // The pipe dir is reachable from containers: never read through a link there.
        let text = {
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(spec.pipe_dir.join(PID_FILE))
                .ok()?;
            let mut text = String::new();
            Read::take(&mut f, 64).read_to_string(&mut text).ok()?;
            text
        };
        let pid: u32 = text.trim().parse().ok().filter(|p| *p > 1)?;
        self.is_our_daemon(pid, spec).then_some(pid)
    }

    fn kill_daemon(&self, spec: &DaemonSpec, pid: u32) -> Result<(), MpsError> {
        if !self.is_our_daemon(pid, spec) {
            return Ok(());
        }
        let raw =
            i32::try_from(pid).map_err(|_| MpsError::Invalid(format!("pid {pid} out of range")))?;
        match nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(raw),
            nix::sys::signal::Signal::SIGKILL,
        ) {
            Ok(()) | Err(nix::errno::Errno::ESRCH) => {
                reap(pid);
                Ok(())
            }
            Err(e) => Err(MpsError::io(spec.pipe_dir.join(PID_FILE), std::io::Error::from(e))),
        }
    }
}

/// Spawn, retrying for up to ~100 ms while the binary is "text file busy" (ETXTBSY): a
/// binary being replaced (a driver upgrade) or just written, whose write descriptor a
/// concurrent fork in another thread briefly holds, is about to become executable.
fn spawn_retrying(command: &mut std::process::Command) -> std::io::Result<std::process::Child> {
    let mut tries = 0;
    loop {
        match command.spawn() {
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && tries < 20 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(5));
            }
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_state_skips_hostile_command_names() {
        assert_eq!(proc_state("12 (a) b) S 1 2"), Some('S'));
        assert_eq!(proc_state("12 (x) Z 1"), Some('Z'));
        assert_eq!(proc_state("garbage"), None);
    }

    /// A spec for device GPU-a with its dirs under `dir`.
    fn test_spec(dir: &Path) -> DaemonSpec {
        DaemonSpec {
            device: "GPU-a".into(),
            pipe_dir: dir.join("p"),
            log_dir: dir.join("l"),
            shm_dir: None,
        }
    }

    /// An executable shell script `dir/name` running `body`.
    fn script(dir: &Path, name: &str, body: &str) -> std::path::PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("script");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        path
    }

    fn fake_proc(root: &Path, pid: u32, stat: &str, cmdline: &[&str], environ: Option<&[&str]>) {
        let dir = root.join(pid.to_string());
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("stat"), stat).expect("stat");
        let mut c = cmdline.join("\0");
        c.push('\0');
        std::fs::write(dir.join("cmdline"), c).expect("cmdline");
        if let Some(env) = environ {
            std::fs::write(dir.join("environ"), env.join("\0")).expect("environ");
        }
    }

    #[test]
    fn a_pid_file_is_believed_only_for_a_live_control_daemon_of_that_pipe_dir() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let proc_root = tmp.path().join("proc");
        let pipe = tmp.path().join("pipe");
        std::fs::create_dir_all(&pipe).expect("mkdir");
        let spec = DaemonSpec {
            device: "GPU-a".into(),
            pipe_dir: pipe.clone(),
            log_dir: tmp.path().join("log"),
            shm_dir: None,
        };
        let ctl =
            ProcessControl::new("/usr/bin/nvidia-cuda-mps-control").with_proc_root(&proc_root);
        let pipe_env = format!("CUDA_MPS_PIPE_DIRECTORY={}", pipe.display());

        fake_proc(
            &proc_root,
            100,
            "100 (nvidia-cuda-mps) S 1",
            &["/usr/bin/nvidia-cuda-mps-control", "-d"],
            Some(&[&pipe_env]),
        );
        fake_proc(&proc_root, 101, "101 (bash) S 1", &["/bin/bash"], None);
        fake_proc(
            &proc_root,
            102,
            "102 (nvidia-cuda-mps) Z 1",
            &["/usr/bin/nvidia-cuda-mps-control", "-d"],
            None,
        );
        fake_proc(
            &proc_root,
            103,
            "103 (nvidia-cuda-mps) S 1",
            &["nvidia-cuda-mps-control", "-d"],
            Some(&["CUDA_MPS_PIPE_DIRECTORY=/elsewhere"]),
        );
        fake_proc(&proc_root, 104, "104 (nvidia-cuda-mps) S 1", &["nvidia-cuda-mps-control"], None);
        fake_proc(
            &proc_root,
            105,
            "105 (nvidia-cuda-mps) S 1",
            &["./nvidia-cuda-mps-control", "-d"],
            None,
        );

        let with_pid = |text: &str| {
            std::fs::write(pipe.join(PID_FILE), text).expect("pid file");
            ctl.daemon_pid(&spec)
        };
        assert_eq!(with_pid("100\n"), Some(100));
        assert_eq!(with_pid("101"), None, "recycled into another program");
        assert_eq!(with_pid("102"), None, "zombie");
        assert_eq!(with_pid("103"), None, "another pipe dir's daemon");
        assert_eq!(with_pid("104"), None, "a client, not a daemon");
        assert_eq!(with_pid("105"), Some(105), "environ unreadable: the binary and -d decide");
        assert_eq!(with_pid("999"), None, "no such process");
        assert_eq!(with_pid("1"), None);
        assert_eq!(with_pid("garbage"), None);
        std::fs::remove_file(pipe.join(PID_FILE)).expect("rm");
        assert_eq!(ctl.daemon_pid(&spec), None);
    }

    #[test]
    fn a_missing_binary_is_a_spawn_error() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let spec = test_spec(tmp.path());
        let ctl = ProcessControl::new(tmp.path().join("no-such-binary"));
        assert!(matches!(ctl.send(&spec, &Command::GetServerList), Err(MpsError::Spawn { .. })));
        assert!(matches!(ctl.start_daemon(&spec), Err(MpsError::Spawn { .. })));
    }

    #[test]
    fn a_hanging_binary_times_out() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let script = script(tmp.path(), "hang", "exec sleep 30");
        let spec = test_spec(tmp.path());
        let ctl = ProcessControl::new(&script)
            .with_timeouts(Duration::from_millis(200), Duration::from_millis(200));
        let t = Instant::now();
        assert!(matches!(ctl.send(&spec, &Command::GetServerList), Err(MpsError::Timeout { .. })));
        assert!(t.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn the_environment_is_cleared_but_for_the_mps_variables() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let script = script(tmp.path(), "envdump", "env | sort");
        let spec = test_spec(tmp.path());
        let ctl = ProcessControl::new(&script).with_env("FAKE_MPS_CRASH_AFTER_MS", "5");
        let out = ctl.send(&spec, &Command::GetServerList).expect("runs");
        let keys: Vec<&str> =
            out.lines().filter_map(|l| l.split_once('=').map(|(k, _)| k)).collect();
        for k in &keys {
            assert!(
                [
                    "PATH",
                    "PWD",
                    "SHLVL",
                    "_",
                    "CUDA_VISIBLE_DEVICES",
                    "CUDA_MPS_PIPE_DIRECTORY",
                    "CUDA_MPS_LOG_DIRECTORY",
                    "FAKE_MPS_CRASH_AFTER_MS"
                ]
                .contains(k),
                "unexpected variable {k} in {out}"
            );
        }
        assert!(out.contains("CUDA_VISIBLE_DEVICES=GPU-a\n"), "{out}");
        assert!(out.contains(&format!("PATH={}:/usr/local/sbin", tmp.path().display())), "{out}");
    }

    #[test]
    fn failures_and_missing_daemons_are_told_apart() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let nod = script(tmp.path(), "nodaemon", &format!("echo '{NO_DAEMON}'\nexit 1"));
        let fail = script(tmp.path(), "fail", "echo boom >&2\nexit 3");
        let spec = test_spec(tmp.path());
        assert!(matches!(
            ProcessControl::new(&nod).send(&spec, &Command::Quit),
            Err(MpsError::NoDaemon { .. })
        ));
        let e = ProcessControl::new(&fail).send(&spec, &Command::Quit).expect_err("fails");
        assert!(e.to_string().contains("exit status 3") && e.to_string().contains("boom"), "{e}");
    }
}

#[cfg(test)]
mod binary_path_tests {
    use super::*;

    #[test]
    fn a_relative_control_binary_with_a_directory_is_refused_naming_it() {
        assert_eq!(check_binary(Path::new("/usr/bin/nvidia-cuda-mps-control")), Ok(()));
        assert_eq!(check_binary(Path::new("nvidia-cuda-mps-control")), Ok(()));
        for rel in ["bin/fake-nvidia-cuda-mps-control", "./fake", "../x/y"] {
            let e = check_binary(Path::new(rel)).expect_err(rel);
            assert_eq!(e, BinaryPathError::Relative(PathBuf::from(rel)));
            let text = e.to_string();
            assert!(text.starts_with(rel) && text.contains("give an absolute path"), "{text}");
        }
        assert_eq!(check_binary(Path::new("")), Err(BinaryPathError::Empty));
    }
}
