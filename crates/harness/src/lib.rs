//! End-to-end test harness: real runc, real containerd, busybox rootfs, and a cleanup
//! guard that leaves no process, mount, cgroup or runc container behind.
//!
//! A crate of its own (compiled once, not into every test binary): the root package's
//! integration tests use it as a dev-dependency with `use tessera_harness::*;`.
//!
//! ```ignore
//! let fx = Fixture::new();                       // /tmp/ts-XXXXXXXX, runc root inside it
//! let mut b = fx.bundle("c1");                   // busybox rootfs + runc-spec-like config
//! b.args(&["echo", "hi"]).write();
//! let out = fx.run_container(&b, "c1");          // foreground `runc run`, output captured
//! out.assert_success("runc run");
//! let fp = fx.footprint();
//! drop(fx);                                      // runc delete -f, kill, umount, rmdir cgroups
//! assert_no_leftovers(&fp);
//! ```
//!
//! Kubernetes' path: `Containerd::builder().cri().start()` runs containerd with its CRI
//! plugin (images imported without a registry, pods on host networking) and
//! [`Containerd::cri`] gives a blocking CRI client ([`cri::Cri`]) that drives pods as
//! kubelet does; see the [`cri`] module.
//!
//! Everything a test creates lives under one short temp dir (`/tmp/ts-XXXXXXXX`, so unix
//! sockets fit in `sun_path`), every container cgroup under one parent
//! (`/tessera-test-<pid>-<n>`), every runc state under `<dir>/runc-root`. Cleanup only
//! touches those, plus the PIDs it was told about and processes whose command line names
//! the fixture's unique dir.
#![allow(dead_code)]

pub mod attack;
pub mod codegen;
pub mod cri;
pub mod docker;
pub mod fleet_fixture;
pub mod node;
pub mod podman;

use std::ffi::{OsStr, OsString};
use std::fs;
use std::io::{self, Read, Write as _};
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{mpsc, Arc, Mutex, Once, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use nix::mount::{umount2, MntFlags};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::{json, Value};

/// The static busybox the rootfs is built from.
pub const BUSYBOX: &str = "/bin/busybox";
/// The real runc (also used by cleanup, whatever runtime a fixture runs).
pub const RUNC: &str = "runc";
pub const CONTAINERD: &str = "containerd";
pub const CTR: &str = "ctr";
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// `PATH` of `runc spec`; ctr's `--rootfs` containers get no env at all without it.
pub const DEFAULT_PATH_ENV: &str =
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// Upper bound for one runc / ctr invocation before the harness kills it.
pub const CMD_TIMEOUT: Duration = Duration::from_secs(60);
/// Upper bound for one command run during cleanup.
const CLEANUP_CMD_TIMEOUT: Duration = Duration::from_secs(20);
/// Prefix of every cgroup parent and containerd namespace the harness creates.
pub const NAME_PREFIX: &str = "tessera-test-";

/// `tessera-runtime`, the OCI runtime wrapper under test.
pub fn tessera_runtime() -> &'static str {
    bin("tessera-runtime")
}

/// `tessera-hook`, the prestart hook under test.
pub fn tessera_hook() -> &'static str {
    bin("tessera-hook")
}

/// `tesserad`, the node daemon under test.
pub fn tesserad() -> &'static str {
    bin("tesserad")
}

/// `tessera`, the CLI under test.
pub fn tessera_cli() -> &'static str {
    bin("tessera")
}

/// The repository root (examples/, data/ and the workspace manifest live there).
pub fn repo_root() -> &'static Path {
    // This crate is crates/harness.
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

/// The directory holding the workspace binaries: `$TESSERA_BIN_DIR` when set, else the
/// profile directory the running test executable was built into (`target/<profile>/`:
/// test executables live in its `deps/`). One way to find every binary: see [`bin`].
pub fn bin_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        if let Some(d) = std::env::var_os("TESSERA_BIN_DIR") {
            return PathBuf::from(d);
        }
        let exe = std::env::current_exe().expect("the path of the running test executable");
        let dir = exe.parent().expect("the test executable's directory");
        match dir.file_name() {
            Some(n) if n == "deps" => dir.parent().expect("the profile directory").to_path_buf(),
            _ => dir.to_path_buf(),
        }
    })
}

/// The path of workspace binary `name` in [`bin_dir`].
///
/// Cargo builds the root package's binaries (`tesserad`, `tessera`, `tessera-runtime`,
/// `tessera-hook`, `fake-nvidia-cuda-mps-control`) before running its integration tests;
/// a binary of another package is not (see [`fresh_bin`]). Panics naming the binary and
/// the command that builds it when it is missing.
pub fn bin(name: &str) -> &'static str {
    static BINS: Mutex<Vec<(String, &'static str)>> = Mutex::new(Vec::new());
    let mut bins = BINS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, p)) = bins.iter().find(|(n, _)| n == name) {
        return p;
    }
    let path = bin_dir().join(name);
    assert!(
        path.is_file(),
        "workspace binary `{name}` not found at {}: build it with `cargo build --workspace \
         --bins` (same profile as the tests), or point TESSERA_BIN_DIR at the directory \
         holding it",
        path.display()
    );
    let p: &'static str =
        Box::leak(path.to_str().expect("a UTF-8 binary path").to_string().into_boxed_str());
    bins.push((name.to_string(), p));
    p
}

/// [`bin`], after building `name` once per test process with `cargo build --workspace
/// --bin NAME` into the target dir and profile of [`bin_dir`] (a no-op when it is fresh,
/// e.g. after `cargo build --workspace --bins`): for binaries of other packages than the
/// root one (cargo builds only the root package's for its integration tests), which could
/// otherwise be missing or stale. With `$TESSERA_BIN_DIR` set nothing is built.
pub fn fresh_bin(name: &str) -> &'static str {
    static BUILT: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if std::env::var_os("TESSERA_BIN_DIR").is_none() && !built.iter().any(|n| n == name) {
        let profile_dir = bin_dir();
        let target_dir = profile_dir.parent().expect("the target dir");
        let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") | None => "dev",
            Some(p) => p,
        };
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let out = Command::new(cargo)
            .args(["build", "--quiet", "--workspace", "--bin", name, "--profile", profile])
            .arg("--target-dir")
            .arg(target_dir)
            .current_dir(repo_root())
            .output()
            .expect("running cargo build");
        assert!(
            out.status.success(),
            "cargo build --workspace --bin {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        built.push(name.to_string());
    }
    drop(built);
    bin(name)
}

/// Applets linked into the busybox rootfs.
const APPLETS: &[&str] = &[
    "sh", "ls", "cat", "stat", "sleep", "echo", "test", "[", "true", "false", "find", "grep",
    "readlink", "dd", "od", "hexdump", "head", "tail", "wc", "mkdir", "touch", "env", "id",
    "printf", "cut", "tr", "sed", "awk", "ps", "kill", "rm", "ln", "xxd", "timeout", "mknod",
    "chmod", "uname", "hostname", "mount", "cp", "mv",
];

// ---------------------------------------------------------------------------------------
// Small utilities
// ---------------------------------------------------------------------------------------

static NEXT_NAME: AtomicU32 = AtomicU32::new(0);

/// A name unique on this machine for the life of this process: `tessera-test-<pid>-<n>`.
/// Used as cgroup parent and containerd namespace.
pub fn unique_name() -> String {
    format!("{NAME_PREFIX}{}-{}", std::process::id(), NEXT_NAME.fetch_add(1, Ordering::SeqCst))
}

/// A fresh short directory `/tmp/ts-XXXXXXXX` (canonical path). The caller owns removal
/// (a [`Cleanup`] does it when the dir is tracked).
pub fn short_tempdir() -> PathBuf {
    let dir = tempfile::Builder::new()
        .prefix("ts-")
        .rand_bytes(8)
        .tempdir_in("/tmp")
        .expect("create temp dir under /tmp")
        .keep();
    fs::canonicalize(&dir).expect("canonicalize temp dir")
}

/// A socket path short enough for `sun_path` (< 108 bytes), in its own fresh temp dir,
/// removed when the returned `TempDir` drops.
pub fn tmp_socket_path() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::Builder::new()
        .prefix("ts-")
        .rand_bytes(8)
        .tempdir_in("/tmp")
        .expect("create socket dir under /tmp");
    let path = dir.path().join("s.sock");
    assert_sun_path_fits(&path);
    (dir, path)
}

fn assert_sun_path_fits(path: &Path) {
    let len = path.as_os_str().len();
    assert!(len < 108, "socket path {} is {len} bytes, too long for sun_path", path.display());
}

/// Polls `cond` every 10 ms until it holds or `timeout` passes; returns its last value.
pub fn wait_for(mut cond: impl FnMut() -> bool, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(10));
    }
}

/// Waits until a unix socket at `path` accepts a connection.
pub fn wait_for_socket(path: &Path, timeout: Duration) -> bool {
    wait_for(|| std::os::unix::net::UnixStream::connect(path).is_ok(), timeout)
}

/// Convenience accessors and assertions on a command's [`Output`].
pub trait OutputExt {
    fn stdout_str(&self) -> String;
    fn stderr_str(&self) -> String;
    /// Panics, showing both streams, unless the command exited 0.
    fn assert_success(&self, what: &str) -> &Self;
    /// Panics, showing both streams, if the command exited 0.
    fn assert_failure(&self, what: &str) -> &Self;
}

impl OutputExt for Output {
    fn stdout_str(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
    fn stderr_str(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }
    fn assert_success(&self, what: &str) -> &Self {
        assert!(
            self.status.success(),
            "{what} failed: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.status,
            self.stdout_str(),
            self.stderr_str()
        );
        self
    }
    fn assert_failure(&self, what: &str) -> &Self {
        assert!(
            !self.status.success(),
            "{what} unexpectedly succeeded\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.stdout_str(),
            self.stderr_str()
        );
        self
    }
}

fn drain<R: Read + Send + 'static>(mut r: R) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let mut buf = [0u8; 8192];
        loop {
            match r.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.send(buf[..n].to_vec()).is_err() {
                        break;
                    }
                }
            }
        }
    });
    rx
}

fn collect(rx: &mpsc::Receiver<Vec<u8>>, deadline: Instant) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(chunk) => out.extend(chunk),
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                // Something (a daemonised grandchild) still holds the pipe: keep what we have.
                out.extend(rx.try_iter().flatten());
                break;
            }
        }
    }
    out
}

/// Like [`Command::output`] (stdin is /dev/null) but kills the command after `timeout`
/// (returning `ErrorKind::TimedOut` with what it printed), and does not hang when a
/// grandchild keeps the output pipes open after the command itself exited.
pub fn output_timeout(cmd: &mut Command, timeout: Duration) -> io::Result<Output> {
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn()?;
    let out_rx = drain(child.stdout.take().expect("piped stdout"));
    let err_rx = drain(child.stderr.take().expect("piped stderr"));
    let status = wait_child(&mut child, timeout)?;
    let grace = Instant::now() + Duration::from_secs(2);
    let stdout = collect(&out_rx, grace);
    let stderr = collect(&err_rx, grace);
    match status {
        Some(status) => Ok(Output { status, stdout, stderr }),
        None => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "{cmd:?} timed out after {timeout:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
                String::from_utf8_lossy(&stdout),
                String::from_utf8_lossy(&stderr)
            ),
        )),
    }
}

/// Waits for `child` up to `timeout`; on timeout SIGKILLs and reaps it and returns None.
pub fn wait_child(child: &mut Child, timeout: Duration) -> io::Result<Option<ExitStatus>> {
    let deadline = Instant::now() + timeout;
    let mut nap = Duration::from_millis(1);
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(None);
        }
        thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(20));
    }
}

/// Runs `cmd` under [`CMD_TIMEOUT`], panicking only if it cannot be spawned or times out.
pub fn run_cmd(cmd: &mut Command) -> Output {
    output_timeout(cmd, CMD_TIMEOUT).unwrap_or_else(|e| panic!("running {cmd:?}: {e}"))
}

// ---------------------------------------------------------------------------------------
// /proc: processes and mounts
// ---------------------------------------------------------------------------------------

/// Field 22 (starttime) of /proc/<pid>/stat, to tell a process from a later PID reuse.
pub fn proc_starttime(pid: i32) -> Option<u64> {
    proc_stat_field(pid, 19)?.parse().ok()
}

fn proc_state(pid: i32) -> Option<char> {
    proc_stat_field(pid, 0)?.chars().next()
}

/// `idx` counts fields after the `(comm)` field: 0 = state, 19 = starttime.
fn proc_stat_field(pid: i32, idx: usize) -> Option<String> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(idx).map(str::to_owned)
}

/// True if `pid` exists and is not a zombie (and, when given, started at `starttime`).
pub fn pid_alive(pid: i32, starttime: Option<u64>) -> bool {
    match proc_state(pid) {
        None | Some('Z') | Some('X') => false,
        Some(_) => starttime.is_none() || proc_starttime(pid) == starttime,
    }
}

/// The command line of `pid`, NULs turned into spaces; None if gone or a kernel thread.
pub fn proc_cmdline(pid: i32) -> Option<String> {
    let raw = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    if raw.is_empty() {
        return None;
    }
    let s: String = String::from_utf8_lossy(&raw).replace('\0', " ");
    Some(s.trim_end().to_owned())
}

fn all_pids() -> Vec<i32> {
    let Ok(rd) = fs::read_dir("/proc") else { return Vec::new() };
    rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok()).collect()
}

/// Live (non-zombie) processes other than this one whose command line contains `needle`
/// as a whole path (followed by `/`, a space or the end).
pub fn processes_mentioning(needle: &str) -> Vec<(i32, String)> {
    let me = std::process::id() as i32;
    all_pids()
        .into_iter()
        .filter(|&pid| pid != me)
        .filter_map(|pid| {
            let cmd = proc_cmdline(pid)?;
            let hit = cmd.match_indices(needle).any(|(i, _)| {
                matches!(cmd[i + needle.len()..].chars().next(), None | Some('/') | Some(' '))
            });
            (hit && pid_alive(pid, None)).then_some((pid, cmd))
        })
        .collect()
}

/// Live processes (not this one) with an environment variable whose value is `needle` or
/// a path below it.
pub fn processes_whose_env_mentions(needle: &str) -> Vec<i32> {
    let me = std::process::id() as i32;
    all_pids()
        .into_iter()
        .filter(|&pid| pid != me)
        .filter(|&pid| {
            fs::read(format!("/proc/{pid}/environ")).is_ok_and(|env| {
                env.split(|&b| b == 0).filter_map(|kv| kv.splitn(2, |&b| b == b'=').nth(1)).any(
                    |v| {
                        v.strip_prefix(needle.as_bytes())
                            .is_some_and(|rest| rest.is_empty() || rest[0] == b'/')
                    },
                )
            })
        })
        .filter(|&pid| pid_alive(pid, None))
        .collect()
}

/// Terminates the processes it holds when dropped, whatever happens to the test: for
/// daemons a test learns of (MPS control daemons), whose command lines do not name the
/// fixture, so its cleanup cannot find them.
#[derive(Debug, Default)]
pub struct KillOnDrop(pub Vec<u32>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        for pid in &self.0 {
            terminate_pid(*pid as i32, None, Duration::from_secs(2));
        }
    }
}

/// SIGTERM, then SIGKILL after `grace`, unless the process is gone (or its PID reused).
pub fn terminate_pid(pid: i32, starttime: Option<u64>, grace: Duration) {
    if pid <= 1 || !pid_alive(pid, starttime) {
        return;
    }
    let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
    if !wait_for(|| !pid_alive(pid, starttime), grace) {
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        wait_for(|| !pid_alive(pid, starttime), Duration::from_secs(5));
    }
}

fn kill9(pid: i32) {
    if pid > 1 {
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
    }
}

/// Undo the octal escapes of /proc/self/mountinfo (`\040` for space etc.).
fn unescape_mount_path(s: &str) -> PathBuf {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    PathBuf::from(String::from_utf8_lossy(&out).into_owned())
}

/// (mount point, fs type) for every line of /proc/self/mountinfo.
pub fn mounts() -> Vec<(PathBuf, String)> {
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines()
        .filter_map(|line| {
            let mut halves = line.splitn(2, " - ");
            let pre: Vec<&str> = halves.next()?.split(' ').collect();
            let fstype = halves.next()?.split(' ').next()?.to_owned();
            Some((unescape_mount_path(pre.get(4)?), fstype))
        })
        .collect()
}

/// Mount points at or below `dir`, deepest first.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> =
        mounts().into_iter().map(|(p, _)| p).filter(|p| p.starts_with(dir)).collect();
    v.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    v.dedup();
    v
}

fn unmount_all_under(dir: &Path) {
    // Stacked mounts show up once per layer; loop until nothing is left (bounded).
    for _ in 0..16 {
        let found = mounts_under(dir);
        if found.is_empty() {
            return;
        }
        for m in found {
            if let Err(e) = umount2(&m, MntFlags::MNT_DETACH) {
                eprintln!("harness: umount {}: {e}", m.display());
            }
        }
    }
}

/// Unix socket paths (from /proc/net/unix) that process `pid` holds open.
fn unix_sockets_of(pid: i32) -> Vec<PathBuf> {
    let inodes: Vec<String> = fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|rd| {
            rd.filter_map(|e| {
                let link = fs::read_link(e.ok()?.path()).ok()?;
                let s = link.to_str()?;
                Some(s.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
            })
            .collect()
        })
        .unwrap_or_default();
    let table = fs::read_to_string("/proc/net/unix").unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let path = f.get(7)?;
            (path.starts_with('/') && inodes.iter().any(|i| i == f[6])).then(|| PathBuf::from(path))
        })
        .collect()
}

// ---------------------------------------------------------------------------------------
// cgroups (v1 hierarchies, plus the hybrid unified mount)
// ---------------------------------------------------------------------------------------

/// Mount points of every cgroup / cgroup2 hierarchy.
pub fn cgroup_mounts() -> Vec<PathBuf> {
    mounts().into_iter().filter(|(_, t)| t == "cgroup" || t == "cgroup2").map(|(p, _)| p).collect()
}

fn cgroup_rel(cgroup_path: &str) -> &str {
    cgroup_path.trim_start_matches('/')
}

/// Existing directories for `cgroup_path` (e.g. `/tessera-test-1-0/c1`) in all hierarchies.
pub fn cgroup_dirs(cgroup_path: &str) -> Vec<PathBuf> {
    let rel = cgroup_rel(cgroup_path);
    if rel.is_empty() {
        return Vec::new();
    }
    cgroup_mounts().into_iter().map(|m| m.join(rel)).filter(|p| p.is_dir()).collect()
}

/// `devices.list` of a container's cgroup (its `linux.cgroupsPath`) in the v1 devices
/// hierarchy, read while the container exists.
pub fn devices_list(cgroups_path: &str) -> String {
    let p =
        Path::new(CGROUP_ROOT).join("devices").join(cgroup_rel(cgroups_path)).join("devices.list");
    fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

/// PIDs in one cgroup directory.
pub fn cgroup_procs(dir: &Path) -> Vec<i32> {
    fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

fn subdirs_post_order(dir: &Path, out: &mut Vec<PathBuf>) {
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                subdirs_post_order(&e.path(), out);
            }
        }
    }
    out.push(dir.to_path_buf());
}

/// Removes `cgroup_path` and everything below it in every hierarchy, deepest first,
/// SIGKILLing whatever still runs inside (it is ours: the path was created for a test).
pub fn remove_cgroup_tree(cgroup_path: &str) {
    for top in cgroup_dirs(cgroup_path) {
        let mut dirs = Vec::new();
        subdirs_post_order(&top, &mut dirs);
        for d in dirs {
            remove_cgroup_dir(&d);
        }
    }
}

fn remove_cgroup_dir(d: &Path) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        for pid in cgroup_procs(d) {
            kill9(pid);
        }
        match fs::remove_dir(d) {
            Ok(()) => return,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return,
            Err(e) if Instant::now() >= deadline => {
                eprintln!("harness: rmdir {}: {e} (procs {:?})", d.display(), cgroup_procs(d));
                return;
            }
            Err(_) => thread::sleep(Duration::from_millis(20)),
        }
    }
}

static STALE_SWEEP: Once = Once::new();

/// Once per test process: removes `tessera-test-<pid>-*` cgroups left by earlier test
/// processes that no longer exist (e.g. a run killed with SIGKILL).
fn sweep_stale_cgroups() {
    STALE_SWEEP.call_once(|| {
        for m in cgroup_mounts() {
            let Ok(rd) = fs::read_dir(&m) else { continue };
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let Some(rest) = name.strip_prefix(NAME_PREFIX) else { continue };
                let Some(Ok(pid)) = rest.split('-').next().map(str::parse::<i32>) else {
                    continue;
                };
                if !Path::new(&format!("/proc/{pid}")).exists() {
                    remove_cgroup_tree(&format!("/{name}"));
                }
            }
        }
    });
}

// ---------------------------------------------------------------------------------------
// Rootfs and bundles
// ---------------------------------------------------------------------------------------

/// Minimal root filesystems for test containers.
#[derive(Debug)]
pub struct Rootfs;

impl Rootfs {
    /// Populates `dir` (created if needed) with a copy of the static busybox, applet
    /// symlinks in /bin, empty /dev /proc /sys /tmp /root, and /etc/passwd, /etc/group.
    /// Busybox is copied, not hard-linked: a container writing its rootfs must not be able
    /// to modify the host's /bin/busybox. Returns `dir`.
    pub fn busybox(dir: impl AsRef<Path>) -> PathBuf {
        let dir = dir.as_ref();
        for sub in ["bin", "dev", "proc", "sys", "tmp", "etc", "root"] {
            fs::create_dir_all(dir.join(sub)).expect("create rootfs dir");
        }
        fs::set_permissions(dir.join("tmp"), fs::Permissions::from_mode(0o1777))
            .expect("chmod rootfs /tmp");
        fs::copy(BUSYBOX, dir.join("bin/busybox")).expect("copy /bin/busybox");
        for applet in APPLETS {
            let link = dir.join("bin").join(applet);
            if fs::symlink_metadata(&link).is_err() {
                symlink("busybox", &link).expect("symlink applet");
            }
        }
        fs::write(
            dir.join("etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
        )
        .expect("write /etc/passwd");
        fs::write(dir.join("etc/group"), "root:x:0:\nnogroup:x:65534:\n")
            .expect("write /etc/group");
        dir.to_path_buf()
    }
}

/// The config.json `runc spec` writes (runc 1.1), made non-interactive: terminal false,
/// rootfs writable, and a unique `linux.cgroupsPath`.
pub fn default_spec(args: &[&str], cgroups_path: &str) -> Value {
    let caps = json!(["CAP_AUDIT_WRITE", "CAP_KILL", "CAP_NET_BIND_SERVICE"]);
    json!({
        "ociVersion": "1.0.2-dev",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": [DEFAULT_PATH_ENV, "TERM=xterm"],
            "cwd": "/",
            "capabilities": {
                "bounding": caps, "effective": caps, "permitted": caps, "ambient": caps
            },
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
            "noNewPrivileges": true
        },
        "root": {"path": "rootfs", "readonly": false},
        "hostname": "tessera-test",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
             "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
             "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]}
        ],
        "linux": {
            "cgroupsPath": cgroups_path,
            "resources": {"devices": [{"allow": false, "access": "rwm"}]},
            "namespaces": [
                {"type": "pid"}, {"type": "network"}, {"type": "ipc"}, {"type": "uts"},
                {"type": "mount"}
            ],
            "maskedPaths": [
                "/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
                "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/sys/firmware",
                "/proc/scsi"
            ],
            "readonlyPaths": [
                "/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"
            ]
        }
    })
}

/// An OCI bundle: `<dir>/rootfs` (busybox) and `<dir>/config.json`. Setters edit the
/// in-memory spec; nothing reaches disk until [`Bundle::write`].
#[derive(Debug, Clone)]
pub struct Bundle {
    dir: PathBuf,
    config: Value,
}

impl Bundle {
    /// Creates `dir` with a busybox rootfs and the default spec (`sh`), with a fresh
    /// cgroups path `/tessera-test-<pid>-<n>/<dir name>`. Prefer [`Fixture::bundle`], which
    /// puts the cgroup under the fixture's parent.
    pub fn new(dir: impl AsRef<Path>) -> Bundle {
        let dir = dir.as_ref().to_path_buf();
        Rootfs::busybox(dir.join("rootfs"));
        let leaf = dir.file_name().map(|n| n.to_string_lossy().into_owned());
        let cg = format!("/{}/{}", unique_name(), leaf.unwrap_or_else(|| "bundle".into()));
        Bundle { dir, config: default_spec(&["sh"], &cg) }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
    pub fn rootfs(&self) -> PathBuf {
        self.dir.join("rootfs")
    }
    pub fn config_path(&self) -> PathBuf {
        self.dir.join("config.json")
    }
    pub fn config(&self) -> &Value {
        &self.config
    }
    pub fn config_mut(&mut self) -> &mut Value {
        &mut self.config
    }
    /// `linux.cgroupsPath` of the spec.
    pub fn cgroups_path(&self) -> String {
        self.config["linux"]["cgroupsPath"].as_str().unwrap_or_default().to_owned()
    }

    /// Replaces `process.args`.
    pub fn args(&mut self, args: &[&str]) -> &mut Self {
        self.config["process"]["args"] = json!(args);
        self
    }
    /// Appends one `KEY=VALUE` to `process.env`.
    pub fn env(&mut self, kv: &str) -> &mut Self {
        push(&mut self.config["process"]["env"], json!(kv));
        self
    }
    /// Sets one OCI annotation.
    pub fn annotation(&mut self, key: &str, value: &str) -> &mut Self {
        let a = &mut self.config["annotations"];
        if !a.is_object() {
            *a = json!({});
        }
        a[key] = json!(value);
        self
    }
    /// Sets `linux.cgroupsPath` (keep it under a `/tessera-test-*` parent so it is cleaned).
    pub fn set_cgroups_path(&mut self, path: &str) -> &mut Self {
        self.config["linux"]["cgroupsPath"] = json!(path);
        self
    }
    /// Adds a device node to `linux.devices` (kind `c` or `b`, mode 0666, root-owned).
    /// runc creates it with mknod; access still needs [`Bundle::allow_device`].
    pub fn device(&mut self, path: &str, kind: char, major: i64, minor: i64) -> &mut Self {
        let dev = json!({
            "path": path, "type": kind.to_string(), "major": major, "minor": minor,
            "fileMode": 0o666, "uid": 0, "gid": 0
        });
        push(&mut self.config["linux"]["devices"], dev);
        self
    }
    /// Appends an allow rule to `linux.resources.devices` (None = wildcard).
    pub fn allow_device(
        &mut self,
        kind: char,
        major: Option<i64>,
        minor: Option<i64>,
        access: &str,
    ) -> &mut Self {
        let mut rule = json!({"allow": true, "type": kind.to_string(), "access": access});
        if let Some(m) = major {
            rule["major"] = json!(m);
        }
        if let Some(m) = minor {
            rule["minor"] = json!(m);
        }
        push(&mut self.config["linux"]["resources"]["devices"], rule);
        self
    }
    /// Appends an OCI hook to `hooks.<stage>` (`prestart`, `createRuntime`, `poststop`..).
    /// `args` is the full argv, `args[0]` included, as the OCI spec wants.
    pub fn hook(&mut self, stage: &str, path: &str, args: &[&str], env: &[&str]) -> &mut Self {
        let mut h = json!({"path": path, "args": args});
        if !env.is_empty() {
            h["env"] = json!(env);
        }
        push(&mut self.config["hooks"][stage], h);
        self
    }
    /// Arbitrary edit of the spec.
    pub fn mutate(&mut self, f: impl FnOnce(&mut Value)) -> &mut Self {
        f(&mut self.config);
        self
    }
    /// Writes config.json (pretty JSON).
    pub fn write(&mut self) -> &mut Self {
        let data = serde_json::to_vec_pretty(&self.config).expect("serialize spec");
        fs::write(self.config_path(), data).expect("write config.json");
        self
    }
}

/// Pushes onto a JSON array, turning null into an empty array first.
fn push(slot: &mut Value, item: Value) {
    if !slot.is_array() {
        *slot = json!([]);
    }
    slot.as_array_mut().expect("array").push(item);
}

// ---------------------------------------------------------------------------------------
// Cleanup guard and leftover checks
// ---------------------------------------------------------------------------------------

/// What a fixture may leave behind, for [`assert_no_leftovers`] after it is gone.
#[derive(Debug, Clone, Default)]
pub struct Footprint {
    /// Must not exist; no mount below them; no live process naming them.
    pub dirs: Vec<PathBuf>,
    /// Must not exist in any cgroup hierarchy.
    pub cgroups: Vec<String>,
    /// Must not be alive (PID, starttime).
    pub pids: Vec<(i32, Option<u64>)>,
    /// Must not exist (e.g. shim sockets under /run/containerd/s).
    pub files: Vec<PathBuf>,
    /// Must hold no runc container state (only relevant when outside `dirs`).
    pub runc_roots: Vec<PathBuf>,
}

/// Everything in `fp` that is still there, one line each.
pub fn leftovers(fp: &Footprint) -> Vec<String> {
    let mut found = Vec::new();
    for &(pid, st) in &fp.pids {
        if pid_alive(pid, st) {
            found.push(format!("process {pid} alive: {:?}", proc_cmdline(pid)));
        }
    }
    for d in &fp.dirs {
        let needle = d.to_string_lossy();
        for (pid, cmd) in processes_mentioning(&needle) {
            found.push(format!("process {pid} mentions {needle}: {cmd}"));
        }
        for m in mounts_under(d) {
            found.push(format!("mount left: {}", m.display()));
        }
        if d.exists() {
            found.push(format!("dir left: {}", d.display()));
        }
    }
    for cg in &fp.cgroups {
        for d in cgroup_dirs(cg) {
            found.push(format!("cgroup left: {}", d.display()));
        }
    }
    for f in &fp.files {
        if fs::symlink_metadata(f).is_ok() {
            found.push(format!("file left: {}", f.display()));
        }
    }
    for r in &fp.runc_roots {
        for id in runc_container_ids(r) {
            found.push(format!("runc container left: {id} in {}", r.display()));
        }
    }
    found
}

/// Panics listing every leftover of `fp`.
pub fn assert_no_leftovers(fp: &Footprint) {
    let found = leftovers(fp);
    assert!(found.is_empty(), "leftovers after cleanup:\n  {}", found.join("\n  "));
}

/// Container ids with state in a runc root; also looks one level down, since the
/// containerd shim uses `<runc-root>/<namespace>/<id>`.
pub fn runc_container_ids(root: &Path) -> Vec<String> {
    runc_states(root).into_iter().map(|(_, id)| id).collect()
}

/// (runc root, id) for every container state below `root`.
fn runc_states(root: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    let Ok(rd) = fs::read_dir(root) else { return out };
    for e in rd.flatten() {
        let p = e.path();
        if !p.is_dir() {
            continue;
        }
        if p.join("state.json").exists() {
            out.push((root.to_path_buf(), e.file_name().to_string_lossy().into_owned()));
        } else if let Ok(inner) = fs::read_dir(&p) {
            for c in inner.flatten() {
                if c.path().join("state.json").exists() {
                    out.push((p.clone(), c.file_name().to_string_lossy().into_owned()));
                }
            }
        }
    }
    out
}

#[derive(Debug, Default, Clone)]
struct Tracked {
    dirs: Vec<PathBuf>,
    runc_roots: Vec<PathBuf>,
    pids: Vec<(i32, Option<u64>)>,
    cgroups: Vec<String>,
    files: Vec<PathBuf>,
}

/// Per-test cleanup guard. On [`Cleanup::run`] or drop, in this order:
/// `runc --root R delete -f` every container under each tracked runc root (then kills
/// its init if runc could not), SIGTERM→SIGKILL tracked PIDs, SIGKILL live processes whose
/// command line names a tracked dir, removes tracked cgroups in every hierarchy (deepest
/// first, killing what is inside), unmounts everything under tracked dirs, removes tracked
/// files and dirs. Never panics; problems are printed to stderr.
#[derive(Debug, Default)]
pub struct Cleanup {
    tracked: Mutex<Tracked>,
    dirty: AtomicBool,
}

impl Cleanup {
    pub fn new() -> Cleanup {
        Cleanup::default()
    }
    fn with<R>(&self, f: impl FnOnce(&mut Tracked) -> R) -> R {
        self.dirty.store(true, Ordering::SeqCst);
        let mut t = self.tracked.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut t)
    }
    /// A dir owned by the test: removed, unmounted below, its processes killed.
    pub fn track_dir(&self, dir: impl Into<PathBuf>) {
        let d = dir.into();
        self.with(|t| {
            if !t.dirs.contains(&d) {
                t.dirs.push(d)
            }
        });
    }
    /// A runc `--root` whose containers are force-deleted.
    pub fn track_runc_root(&self, root: impl Into<PathBuf>) {
        let r = root.into();
        self.with(|t| {
            if !t.runc_roots.contains(&r) {
                t.runc_roots.push(r)
            }
        });
    }
    /// A process to stop (its starttime is recorded now, so a reused PID is left alone).
    pub fn track_pid(&self, pid: u32) {
        let pid = pid as i32;
        let st = proc_starttime(pid);
        self.with(|t| t.pids.push((pid, st)));
    }
    /// A cgroup path (as in `linux.cgroupsPath`) to remove in every hierarchy. A path
    /// below a `/tessera-test-*` parent also tracks that parent.
    pub fn track_cgroup(&self, path: &str) {
        let path = format!("/{}", cgroup_rel(path));
        if path == "/" {
            return;
        }
        let first = path[1..].split('/').next().unwrap_or_default().to_owned();
        self.with(|t| {
            if !t.cgroups.contains(&path) {
                t.cgroups.push(path.clone());
            }
            let parent = format!("/{first}");
            if first.starts_with(NAME_PREFIX) && !t.cgroups.contains(&parent) {
                t.cgroups.push(parent);
            }
        });
    }
    /// A file outside the tracked dirs to remove.
    pub fn track_file(&self, path: impl Into<PathBuf>) {
        let f = path.into();
        self.with(|t| t.files.push(f));
    }

    pub fn footprint(&self) -> Footprint {
        let t = self.tracked.lock().unwrap_or_else(|p| p.into_inner()).clone();
        Footprint {
            dirs: t.dirs,
            cgroups: t.cgroups,
            pids: t.pids,
            files: t.files,
            runc_roots: t.runc_roots,
        }
    }

    /// Does the whole cleanup now (idempotent; drop repeats it only if more was tracked).
    pub fn run(&self) {
        self.dirty.store(false, Ordering::SeqCst);
        let t = self.tracked.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut extra_cgroups = Vec::new();

        // 1. runc containers (this also runs their poststop hooks, with the real runc).
        for root in &t.runc_roots {
            for (r, id) in runc_states(root) {
                let state = fs::read_to_string(r.join(&id).join("state.json"))
                    .ok()
                    .and_then(|s| serde_json::from_str::<Value>(&s).ok());
                let mut cmd = Command::new(RUNC);
                cmd.arg("--root").arg(&r).args(["delete", "-f", &id]);
                match output_timeout(&mut cmd, CLEANUP_CMD_TIMEOUT) {
                    Ok(o) if o.status.success() => {}
                    Ok(o) => eprintln!("harness: runc delete -f {id}: {}", o.stderr_str().trim()),
                    Err(e) => eprintln!("harness: runc delete -f {id}: {e}"),
                }
                if let Some(state) = state {
                    if let Some(pid) = state["init_process_pid"].as_i64() {
                        let st = state["init_process_start"].as_u64();
                        if pid_alive(pid as i32, st) {
                            kill9(pid as i32);
                        }
                    }
                    if let Some(paths) = state["cgroup_paths"].as_object() {
                        for p in paths.values().filter_map(Value::as_str) {
                            extra_cgroups.push(p.to_owned());
                        }
                    }
                }
            }
        }

        // 2. recorded PIDs.
        for &(pid, st) in &t.pids {
            terminate_pid(pid, st, Duration::from_secs(2));
        }

        // 3. anything still naming our dirs (daemons, shims, hooks) in its command line,
        //    or in its environment: MPS control daemons are told their pipe directory only
        //    there, and one restarted by tesserad's supervisor after a test collected the
        //    pids it knew of would otherwise outlive the test.
        for d in &t.dirs {
            let d = d.to_string_lossy();
            for pid in processes_mentioning(&d)
                .into_iter()
                .map(|(pid, _)| pid)
                .chain(processes_whose_env_mentions(&d))
            {
                kill9(pid);
            }
        }

        // 4. cgroups, deepest first.
        let mut cgs = t.cgroups.clone();
        cgs.sort_by_key(|c| std::cmp::Reverse(c.matches('/').count()));
        for cg in &cgs {
            remove_cgroup_tree(cg);
        }
        for abs in extra_cgroups {
            let p = Path::new(&abs);
            if p.starts_with(CGROUP_ROOT) && p.is_dir() {
                let mut dirs = Vec::new();
                subdirs_post_order(p, &mut dirs);
                dirs.iter().for_each(|d| remove_cgroup_dir(d));
            }
        }

        // 5. mounts, 6. files and dirs.
        for d in &t.dirs {
            unmount_all_under(d);
        }
        for f in &t.files {
            let _ = fs::remove_file(f);
        }
        for d in t.dirs.iter().chain(&t.runc_roots) {
            if let Err(e) = fs::remove_dir_all(d) {
                if e.kind() != io::ErrorKind::NotFound {
                    eprintln!("harness: remove {}: {e}", d.display());
                }
            }
        }
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if self.dirty.load(Ordering::SeqCst) {
            self.run();
        }
    }
}

// ---------------------------------------------------------------------------------------
// Child processes (daemons)
// ---------------------------------------------------------------------------------------

/// A long-running process (daemon) started by a test: stdout/stderr appended to
/// `<log_dir>/<name>.stdout|.stderr` across restarts; SIGTERM→SIGKILL on drop.
#[derive(Debug)]
pub struct ChildProcess {
    name: String,
    program: OsString,
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    log_dir: PathBuf,
    child: Option<Child>,
    starttime: Option<u64>,
}

impl ChildProcess {
    /// Starts `program args..` with `env` added to this process's environment.
    pub fn spawn<A, S, E, K, V>(
        name: &str,
        program: impl AsRef<OsStr>,
        args: A,
        env: E,
        log_dir: &Path,
    ) -> ChildProcess
    where
        A: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
        E: IntoIterator<Item = (K, V)>,
        K: AsRef<OsStr>,
        V: AsRef<OsStr>,
    {
        fs::create_dir_all(log_dir).expect("create log dir");
        let mut cp = ChildProcess {
            name: name.to_owned(),
            program: program.as_ref().to_owned(),
            args: args.into_iter().map(|a| a.as_ref().to_owned()).collect(),
            env: env
                .into_iter()
                .map(|(k, v)| (k.as_ref().to_owned(), v.as_ref().to_owned()))
                .collect(),
            log_dir: log_dir.to_path_buf(),
            child: None,
            starttime: None,
        };
        cp.start();
        cp
    }

    fn log_file(&self, stream: &str) -> fs::File {
        fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_dir.join(format!("{}.{stream}", self.name)))
            .expect("open child log")
    }

    fn start(&mut self) {
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(self.log_file("stdout"))
            .stderr(self.log_file("stderr"));
        let child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
        self.starttime = proc_starttime(child.id() as i32);
        self.child = Some(child);
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    /// PID of the current incarnation (0 if stopped).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).unwrap_or(0)
    }
    /// True while the current incarnation has not exited.
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }
    /// Waits up to `timeout` for the process to exit by itself.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        let c = self.child.as_mut()?;
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(st)) = c.try_wait() {
                return Some(st);
            }
            if Instant::now() >= deadline {
                return None;
            }
            thread::sleep(Duration::from_millis(10));
        }
    }
    /// SIGKILL (a crash), reaped. Returns the exit status.
    pub fn kill9(&mut self) -> Option<ExitStatus> {
        let mut c = self.child.take()?;
        let _ = c.kill();
        c.wait().ok()
    }
    /// SIGTERM, SIGKILL after `grace`, reaped. None if it had to be SIGKILLed.
    pub fn terminate(&mut self, grace: Duration) -> Option<ExitStatus> {
        let mut c = self.child.take()?;
        if let Ok(Some(st)) = c.try_wait() {
            return Some(st);
        }
        let _ = kill(Pid::from_raw(c.id() as i32), Signal::SIGTERM);
        // None: it ignored SIGTERM for `grace` and was SIGKILLed (and reaped).
        wait_child(&mut c, grace).ok().flatten()
    }
    /// Stops the current incarnation (SIGKILL if still running) and starts a new one with
    /// the same program, args and env.
    pub fn restart(&mut self) {
        self.kill9();
        self.start();
    }
    /// What the process wrote to stdout so far (all incarnations).
    pub fn stdout(&self) -> String {
        fs::read_to_string(self.log_dir.join(format!("{}.stdout", self.name))).unwrap_or_default()
    }
    /// What the process wrote to stderr so far (all incarnations).
    pub fn stderr(&self) -> String {
        fs::read_to_string(self.log_dir.join(format!("{}.stderr", self.name))).unwrap_or_default()
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        self.terminate(Duration::from_secs(3));
    }
}

// ---------------------------------------------------------------------------------------
// Fixture: temp dir + runc
// ---------------------------------------------------------------------------------------

/// The runtime binary a fixture drives: plain runc, or tessera-runtime with
/// `TESSERA_RUNC=runc`.
#[derive(Debug, Clone)]
pub struct Runtime {
    pub bin: PathBuf,
    pub env: Vec<(String, String)>,
}

/// One test's world: a short temp dir, a runc root inside it, a cgroup parent, a
/// runtime binary, and the [`Cleanup`] guard (run on drop).
#[derive(Debug)]
pub struct Fixture {
    dir: PathBuf,
    name: String,
    runtime: Runtime,
    cleanup: Cleanup,
}

impl Default for Fixture {
    fn default() -> Self {
        Fixture::new()
    }
}

impl Fixture {
    /// A fixture driving plain `runc`.
    pub fn new() -> Fixture {
        Fixture::with_runtime(RUNC, &[])
    }

    /// A fixture driving `bin` (e.g. [`tessera_runtime`]) with `env` added.
    pub fn with_runtime(bin: impl Into<PathBuf>, env: &[(&str, &str)]) -> Fixture {
        sweep_stale_cgroups();
        let dir = short_tempdir();
        let name = unique_name();
        let cleanup = Cleanup::new();
        cleanup.track_dir(&dir);
        cleanup.track_runc_root(dir.join("runc-root"));
        cleanup.track_cgroup(&format!("/{name}"));
        fs::create_dir_all(dir.join("runc-root")).expect("create runc root");
        fs::create_dir_all(dir.join("logs")).expect("create log dir");
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Fixture { dir, name, runtime: Runtime { bin: bin.into(), env }, cleanup }
    }

    /// Changes the runtime binary used by the runc helpers from now on.
    pub fn set_runtime(&mut self, bin: impl Into<PathBuf>, env: &[(&str, &str)]) {
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        self.runtime = Runtime { bin: bin.into(), env };
    }

    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }
    /// The fixture's temp dir (`/tmp/ts-XXXXXXXX`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// `dir/rel`.
    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.join(rel)
    }
    /// `tessera-test-<pid>-<n>`.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Cgroup parent of this fixture's bundles: `/tessera-test-<pid>-<n>`.
    pub fn cgroup_parent(&self) -> String {
        format!("/{}", self.name)
    }
    /// The `--root` given to every runc invocation.
    pub fn runc_root(&self) -> PathBuf {
        self.dir.join("runc-root")
    }
    /// Where daemons log and `create` stores container output.
    pub fn log_dir(&self) -> PathBuf {
        self.dir.join("logs")
    }
    /// A unix socket path inside the fixture dir (checked to fit `sun_path`).
    pub fn socket_path(&self, name: &str) -> PathBuf {
        let p = self.dir.join(name);
        assert_sun_path_fits(&p);
        p
    }
    pub fn cleanup(&self) -> &Cleanup {
        &self.cleanup
    }
    /// Runs the cleanup now (drop would do it anyway).
    pub fn run_cleanup(&self) {
        self.cleanup.run();
    }
    pub fn footprint(&self) -> Footprint {
        self.cleanup.footprint()
    }

    /// A bundle at `dir/bundles/<id>` whose cgroup is `<cgroup_parent>/<id>`.
    pub fn bundle(&self, id: &str) -> Bundle {
        let mut b = Bundle::new(self.dir.join("bundles").join(id));
        b.set_cgroups_path(&format!("{}/{id}", self.cgroup_parent()));
        b
    }

    fn runtime_cmd(&self, args: &[&str], env: &[(&str, &str)]) -> Command {
        let mut cmd = Command::new(&self.runtime.bin);
        cmd.arg("--root").arg(self.runc_root()).args(args);
        cmd.envs(self.runtime.env.iter().map(|(k, v)| (k, v)));
        cmd.envs(env.iter().copied());
        cmd
    }

    /// `<runtime> --root <runc_root> ARGS..` with `env` added; output captured.
    pub fn runc(&self, args: &[&str], env: &[(&str, &str)]) -> Output {
        run_cmd(&mut self.runtime_cmd(args, env))
    }

    /// Foreground `run --bundle B ID` (the bundle must be written); returns when the
    /// container exits, with its stdout/stderr (and runc's) captured.
    pub fn run_container(&self, bundle: &Bundle, id: &str) -> Output {
        self.cleanup.track_cgroup(&bundle.cgroups_path());
        let b = bundle.dir().to_string_lossy().into_owned();
        self.runc(&["run", "--bundle", &b, id], &[])
    }

    /// `create --bundle B ID`. The container's stdio goes to `logs/<id>.out|.err` (read
    /// them with [`Fixture::container_output`]); the returned Output holds what those files
    /// held when create returned (runc's own errors included).
    pub fn create_container(&self, bundle: &Bundle, id: &str) -> Output {
        self.create_container_env(bundle, id, &[])
    }

    /// [`Fixture::create_container`] with `env` added to the runtime's.
    pub fn create_container_env(&self, bundle: &Bundle, id: &str, env: &[(&str, &str)]) -> Output {
        self.cleanup.track_cgroup(&bundle.cgroups_path());
        let (out_path, err_path) = self.container_log_paths(id);
        let b = bundle.dir().to_string_lossy().into_owned();
        let mut cmd = self.runtime_cmd(&["create", "--bundle", &b, id], env);
        cmd.stdin(Stdio::null())
            .stdout(fs::File::create(&out_path).expect("create container stdout file"))
            .stderr(fs::File::create(&err_path).expect("create container stderr file"));
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
        let status = wait_child(&mut child, CMD_TIMEOUT)
            .expect("wait runc create")
            .unwrap_or_else(|| panic!("{cmd:?} timed out"));
        if let Some(pid) = self.container_pid(id) {
            self.cleanup.track_pid(pid as u32);
        }
        Output {
            status,
            stdout: fs::read(&out_path).unwrap_or_default(),
            stderr: fs::read(&err_path).unwrap_or_default(),
        }
    }

    fn container_log_paths(&self, id: &str) -> (PathBuf, PathBuf) {
        (self.log_dir().join(format!("{id}.out")), self.log_dir().join(format!("{id}.err")))
    }

    /// (stdout, stderr) written so far by a container made with [`Fixture::create_container`].
    pub fn container_output(&self, id: &str) -> (String, String) {
        let (o, e) = self.container_log_paths(id);
        (fs::read_to_string(o).unwrap_or_default(), fs::read_to_string(e).unwrap_or_default())
    }

    pub fn start_container(&self, id: &str) -> Output {
        self.runc(&["start", id], &[])
    }
    /// `kill ID SIGNAL` (e.g. "KILL", "TERM").
    pub fn kill_container(&self, id: &str, signal: &str) -> Output {
        self.runc(&["kill", id, signal], &[])
    }
    pub fn delete_container(&self, id: &str, force: bool) -> Output {
        if force {
            self.runc(&["delete", "-f", id], &[])
        } else {
            self.runc(&["delete", id], &[])
        }
    }
    /// `exec ID ARGS..` in a running container (no tty), output captured.
    pub fn exec(&self, id: &str, args: &[&str]) -> Output {
        let mut a = vec!["exec", id];
        a.extend_from_slice(args);
        self.runc(&a, &[])
    }
    /// Parsed `state ID`, or None if runc does not know the container.
    pub fn state(&self, id: &str) -> Option<Value> {
        let out = self.runc(&["state", id], &[]);
        if !out.status.success() {
            return None;
        }
        serde_json::from_slice(&out.stdout).ok()
    }
    /// `status` of `state ID` ("created", "running", "stopped"), or None.
    pub fn status(&self, id: &str) -> Option<String> {
        self.state(id)?["status"].as_str().map(str::to_owned)
    }
    /// Host PID of the container's init, or None.
    pub fn container_pid(&self, id: &str) -> Option<i32> {
        let pid = self.state(id)?["pid"].as_i64()?;
        (pid > 0).then_some(pid as i32)
    }
    /// create + start, asserting both; returns the init's host PID.
    pub fn run_detached(&self, bundle: &Bundle, id: &str) -> i32 {
        self.create_container(bundle, id).assert_success("runc create");
        self.start_container(id).assert_success("runc start");
        self.container_pid(id).expect("running container has a pid")
    }

    /// A stand-in for a container's init, for tests that drive tesserad's API without
    /// runc: a process in mount and pid namespaces of its own (`unshare`), alone in a
    /// cgroup of its own (`<cgroup_parent>/fake-<id>`, every hierarchy), and a bundle
    /// whose config.json names its root — what tesserad's prestart confirmation checks of
    /// a container. Killed (with its namespaces) when dropped.
    pub fn fake_container(&self, id: &str) -> FakeContainer {
        let bundle = self.dir.join("fake").join(id);
        fs::create_dir_all(bundle.join("rootfs")).expect("fake bundle");
        fs::write(bundle.join("config.json"), r#"{"root": {"path": "rootfs"}}"#)
            .expect("fake config");
        let mut unshare = Command::new("unshare")
            .args(["--mount", "--pid", "--fork", "--kill-child", "sleep", "3600"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn unshare");
        self.cleanup.track_pid(unshare.id());
        let children = format!("/proc/{0}/task/{0}/children", unshare.id());
        let mut pid = None;
        let found = wait_for(
            || {
                pid = fs::read_to_string(&children)
                    .ok()
                    .and_then(|t| t.split_whitespace().next()?.parse::<i32>().ok());
                pid.is_some()
            },
            Duration::from_secs(10),
        );
        if !found {
            let _ = unshare.kill();
            panic!("unshare started no child");
        }
        let pid = pid.expect("found");
        let cgroup = format!("{}/fake-{id}", self.cgroup_parent());
        self.cleanup.track_cgroup(&cgroup);
        for m in cgroup_mounts() {
            let dir = m.join(cgroup_rel(&cgroup));
            if fs::create_dir_all(&dir).is_ok() {
                let _ = fs::write(dir.join("cgroup.procs"), pid.to_string());
            }
        }
        FakeContainer { pid, bundle, unshare }
    }

    /// Starts a daemon with logs in `log_dir()`; its PID is also tracked by the cleanup.
    pub fn spawn<A, S, E, K, V>(
        &self,
        name: &str,
        program: impl AsRef<OsStr>,
        args: A,
        env: E,
    ) -> ChildProcess
    where
        A: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
        E: IntoIterator<Item = (K, V)>,
        K: AsRef<OsStr>,
        V: AsRef<OsStr>,
    {
        let cp = ChildProcess::spawn(name, program, args, env, &self.log_dir());
        self.cleanup.track_pid(cp.pid());
        cp
    }
}

/// See [`Fixture::fake_container`].
#[derive(Debug)]
pub struct FakeContainer {
    /// The stand-in init's pid (in the host's pid namespace).
    pub pid: i32,
    /// Its bundle: `config.json` naming `rootfs`.
    pub bundle: PathBuf,
    unshare: Child,
}

impl FakeContainer {
    /// The bundle as the hook sends it.
    pub fn bundle_str(&self) -> String {
        self.bundle.display().to_string()
    }
}

impl Drop for FakeContainer {
    fn drop(&mut self) {
        // The stand-in first, so that unshare (its parent) reaps it: a zombie is still
        // listed in its cgroup, and a release checks the cgroup is empty.
        kill9(self.pid);
        let _ = wait_child(&mut self.unshare, Duration::from_secs(5));
        let _ = self.unshare.kill();
        let _ = self.unshare.wait();
    }
}

// ---------------------------------------------------------------------------------------
// containerd
// ---------------------------------------------------------------------------------------

/// Plugins this harness never needs; CRI in particular would open ports and want CNI.
const DISABLED_PLUGINS: &[&str] = &[
    "io.containerd.grpc.v1.cri",
    "io.containerd.internal.v1.opt",
    "io.containerd.snapshotter.v1.aufs",
    "io.containerd.snapshotter.v1.btrfs",
    "io.containerd.snapshotter.v1.zfs",
    "io.containerd.snapshotter.v1.devmapper",
    "io.containerd.tracing.processor.v1.otlp",
    "io.containerd.internal.v1.tracing",
];

/// Where containerd-shim-runc-v2 puts its sockets, whatever containerd's config says.
const SHIM_SOCKET_DIR: &str = "/run/containerd/s";

fn toml_str(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// Makes TOML to append from the fixture dir.
type AppendFn = dyn Fn(&Path) -> String + Send + Sync;
/// Edits the written config: (config file, fixture dir).
type EditFn = dyn Fn(&Path, &Path) + Send + Sync;

/// A caller's hook on the containerd config: see [`ContainerdBuilder::extra_config_with`]
/// and [`ContainerdBuilder::before_start`].
#[derive(Clone)]
enum ConfigHook {
    Append(Arc<AppendFn>),
    Edit(Arc<EditFn>),
}

impl std::fmt::Debug for ConfigHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ConfigHook::Append(_) => "ConfigHook::Append(..)",
            ConfigHook::Edit(_) => "ConfigHook::Edit(..)",
        })
    }
}

/// Options for [`Containerd`].
#[derive(Debug, Clone)]
pub struct ContainerdBuilder {
    env: Vec<(String, String)>,
    runc_binary: String,
    extra_config: String,
    cri: bool,
    hooks: Vec<ConfigHook>,
}

impl ContainerdBuilder {
    /// Environment for containerd, which passes it on to shims and so to the runtime
    /// (e.g. `TESSERA_SOCKET`, `TESSERA_RUNC`).
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_owned(), value.to_owned()));
        self
    }
    /// Default `--runc-binary` for [`Containerd::ctr_run`] (default `runc`).
    pub fn runc_binary(mut self, bin: impl AsRef<Path>) -> Self {
        self.runc_binary = bin.as_ref().to_string_lossy().into_owned();
        self
    }
    /// TOML appended to the generated config.
    pub fn extra_config(mut self, toml: &str) -> Self {
        self.extra_config.push_str(toml);
        self.extra_config.push('\n');
        self
    }
    /// TOML appended to the generated config, made from the fixture dir (known only at
    /// start): e.g. a CRI runtime handler whose `options.Root` is `<dir>/runc-tessera`.
    pub fn extra_config_with(
        mut self,
        f: impl Fn(&Path) -> String + Send + Sync + 'static,
    ) -> Self {
        self.hooks.push(ConfigHook::Append(Arc::new(f)));
        self
    }
    /// Called with (config file, fixture dir) once the config is written and before
    /// containerd starts: e.g. to run `tessera setup containerd` on the file.
    pub fn before_start(mut self, f: impl Fn(&Path, &Path) + Send + Sync + 'static) -> Self {
        self.hooks.push(ConfigHook::Edit(Arc::new(f)));
        self
    }
    /// Enables containerd's CRI plugin ([`Containerd::cri`] connects a client): stream
    /// server on 127.0.0.1 port 0, snapshotter overlayfs, CNI dirs in the fixture (pods
    /// use host networking), `default_runtime_name = "runc"` with its runc root
    /// [`Containerd::runc_root`], sandbox image [`cri::PAUSE_IMAGE`]. [`cri::BUSYBOX_IMAGE`]
    /// and the pause image are imported into the `k8s.io` namespace before `start`
    /// returns. Every CRI runtime handler in the final config (extra TOML included) must
    /// set `options.Root` inside the fixture dir (start panics otherwise); those roots are
    /// tracked by the cleanup.
    pub fn cri(mut self) -> Self {
        self.cri = true;
        self
    }

    /// Starts containerd on a fresh temp dir and waits until `ctr version` answers.
    pub fn start(self) -> Containerd {
        sweep_stale_cgroups();
        let dir = short_tempdir();
        let namespace = unique_name();
        let socket = dir.join("c.sock");
        assert_sun_path_fits(&socket);
        let cleanup = Cleanup::new();
        cleanup.track_dir(&dir);
        cleanup.track_runc_root(dir.join("runc"));
        cleanup.track_cgroup(&format!("/{namespace}"));
        let created_run_containerd = !Path::new("/run/containerd").exists();

        let disabled: Vec<String> = DISABLED_PLUGINS
            .iter()
            .filter(|p| !(self.cri && **p == CRI_PLUGIN))
            .map(|p| toml_str(p))
            .collect();
        let mut extra = if self.cri { cri_config(&dir) } else { String::new() };
        extra.push_str(&self.extra_config);
        for hook in &self.hooks {
            if let ConfigHook::Append(f) = hook {
                extra.push_str(&f(&dir));
                extra.push('\n');
            }
        }
        let config = format!(
            "version = 2\nroot = {root}\nstate = {state}\ndisabled_plugins = [{disabled}]\n\
             oom_score = 0\n\n[grpc]\n  address = {sock}\n  tcp_address = \"\"\n\n\
             [ttrpc]\n  address = \"\"\n\n[debug]\n  address = \"\"\n  level = \"info\"\n\n\
             [metrics]\n  address = \"\"\n\n[cgroup]\n  path = \"\"\n\n{extra}",
            root = toml_str(&dir.join("root").to_string_lossy()),
            state = toml_str(&dir.join("state").to_string_lossy()),
            disabled = disabled.join(", "),
            sock = toml_str(&socket.to_string_lossy()),
        );
        let config_path = dir.join("containerd.toml");
        fs::File::create(&config_path)
            .and_then(|mut f| f.write_all(config.as_bytes()))
            .expect("write containerd config");
        for sub in ["runc", "fifo", "logs"] {
            fs::create_dir_all(dir.join(sub)).expect("create containerd fixture dir");
        }
        for hook in &self.hooks {
            if let ConfigHook::Edit(f) = hook {
                f(&config_path, &dir);
            }
        }
        let final_config = fs::read_to_string(&config_path).expect("read containerd config");
        let roots = cri_runtime_roots(&final_config, &dir).unwrap_or_else(|e| panic!("{e}"));
        for root in roots {
            fs::create_dir_all(&root).expect("create runtime root");
            cleanup.track_runc_root(root);
        }

        let process = ChildProcess::spawn(
            "containerd",
            CONTAINERD,
            [OsStr::new("--config"), config_path.as_os_str()],
            self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())),
            &dir.join("logs"),
        );
        let pid = process.pid() as i32;
        cleanup.track_pid(process.pid());
        let ctd = Containerd {
            dir,
            socket,
            namespace,
            runc_binary: self.runc_binary,
            process: Some(process),
            cleanup,
            created_run_containerd,
            cri: self.cri,
        };
        // Stop waiting early if it died (e.g. a bad config): the log says why.
        wait_for(|| !pid_alive(pid, None) || ctd.ctr_ok(), Duration::from_secs(20));
        assert!(ctd.ctr_ok(), "containerd did not come up:\n{}", ctd.log());
        if ctd.cri {
            ctd.import_cri_images();
        }
        ctd
    }
}

/// The CRI plugin's id, in [`DISABLED_PLUGINS`] unless [`ContainerdBuilder::cri`].
const CRI_PLUGIN: &str = "io.containerd.grpc.v1.cri";

/// The CRI plugin's section of the config (version 2, containerd 1.6/1.7) for a fixture
/// in `dir`: nothing outside `dir` (the plugin's own root and state default to
/// `<root>/io.containerd.grpc.v1.cri` and `<state>/io.containerd.grpc.v1.cri`).
/// `restrict_oom_score_adj`: the sandbox's -998 needs CAP_SYS_RESOURCE, which test
/// machines (containers, CI) may lack; it clamps to containerd's own score instead.
fn cri_config(dir: &Path) -> String {
    let p = |rel: &str| toml_str(&dir.join(rel).to_string_lossy());
    format!(
        "[plugins.\"{CRI_PLUGIN}\"]\n  stream_server_address = \"127.0.0.1\"\n  \
         stream_server_port = \"0\"\n  sandbox_image = {pause}\n  enable_selinux = false\n  \
         disable_apparmor = true\n  enable_tls_streaming = false\n  \
         restrict_oom_score_adj = true\n\n\
         [plugins.\"{CRI_PLUGIN}\".containerd]\n  snapshotter = \"overlayfs\"\n  \
         default_runtime_name = \"runc\"\n  disable_snapshot_annotations = true\n\n\
         [plugins.\"{CRI_PLUGIN}\".containerd.runtimes.runc]\n  \
         runtime_type = \"io.containerd.runc.v2\"\n\n\
         [plugins.\"{CRI_PLUGIN}\".containerd.runtimes.runc.options]\n  \
         BinaryName = \"runc\"\n  Root = {runc_root}\n  SystemdCgroup = false\n\n\
         [plugins.\"{CRI_PLUGIN}\".cni]\n  bin_dir = {cni_bin}\n  conf_dir = {cni_conf}\n\n",
        pause = toml_str(cri::PAUSE_IMAGE),
        runc_root = p("runc"),
        cni_bin = p("cni/bin"),
        cni_conf = p("cni/conf"),
    )
}

/// The `options.Root` of every CRI runtime handler in a containerd config (version 2 or
/// 3, table headers as `tessera setup containerd` and containerd's own dump write them).
/// An error names a handler that has none, or one outside `dir`: its containers would
/// live in containerd's default runc root, beyond the fixture's cleanup.
pub fn cri_runtime_roots(config: &str, dir: &Path) -> Result<Vec<PathBuf>, String> {
    const PREFIXES: &[&str] = &[
        "plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.",
        "plugins.\"io.containerd.cri.v1.runtime\".containerd.runtimes.",
    ];
    // handler name -> Root, in order of appearance.
    let mut handlers: Vec<(String, Option<String>)> = Vec::new();
    let mut options_of: Option<String> = None;
    for line in config.lines() {
        let line = line.trim();
        if let Some(header) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            options_of = None;
            let header = header.trim();
            let Some(rest) = PREFIXES.iter().find_map(|p| header.strip_prefix(p)) else {
                continue;
            };
            let (name, sub) = match rest.strip_prefix('"') {
                Some(quoted) => match quoted.split_once('"') {
                    Some((n, sub)) => (n.to_owned(), sub.to_owned()),
                    None => continue,
                },
                None => match rest.split_once('.') {
                    Some((n, sub)) => (n.to_owned(), format!(".{sub}")),
                    None => (rest.to_owned(), String::new()),
                },
            };
            if !handlers.iter().any(|(n, _)| *n == name) {
                handlers.push((name.clone(), None));
            }
            if sub == ".options" {
                options_of = Some(name);
            }
        } else if let Some(h) = &options_of {
            let Some((key, value)) = line.split_once('=') else { continue };
            if key.trim() == "Root" {
                let v = value.trim().trim_matches(|c| c == '"' || c == '\'');
                if let Some(slot) = handlers.iter_mut().find(|(n, _)| n == h) {
                    slot.1 = Some(v.to_owned());
                }
            }
        }
    }
    handlers
        .into_iter()
        .map(|(name, root)| {
            let root = root.map(PathBuf::from).ok_or_else(|| {
                format!(
                    "CRI runtime handler {name:?} has no options.Root: its containers would \
                     live in containerd's default runc root, outside the fixture {}",
                    dir.display()
                )
            })?;
            if root.is_absolute() && root.starts_with(dir) && !root.to_string_lossy().contains("..")
            {
                Ok(root)
            } else {
                Err(format!(
                    "CRI runtime handler {name:?} has options.Root {} outside the fixture {}",
                    root.display(),
                    dir.display()
                ))
            }
        })
        .collect()
}

/// A private containerd: root, state, socket, runc root and fifo dir all under one temp
/// dir, its own namespace (`tessera-test-<pid>-<n>`, also the cgroup parent of its
/// containers). Stopped and cleaned on drop.
#[derive(Debug)]
pub struct Containerd {
    dir: PathBuf,
    socket: PathBuf,
    namespace: String,
    runc_binary: String,
    process: Option<ChildProcess>,
    cleanup: Cleanup,
    created_run_containerd: bool,
    cri: bool,
}

impl Containerd {
    pub fn builder() -> ContainerdBuilder {
        ContainerdBuilder {
            env: Vec::new(),
            runc_binary: RUNC.to_owned(),
            extra_config: String::new(),
            cri: false,
            hooks: Vec::new(),
        }
    }
    /// containerd with default options.
    pub fn start() -> Containerd {
        Containerd::builder().start()
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
    pub fn socket(&self) -> &Path {
        &self.socket
    }
    pub fn namespace(&self) -> &str {
        &self.namespace
    }
    /// ctr's default cgroup parent for this namespace: `/<namespace>`.
    pub fn cgroup_parent(&self) -> String {
        format!("/{}", self.namespace)
    }
    /// `--runc-root` given to shims; containers live in `<runc_root>/<namespace>/<id>`.
    pub fn runc_root(&self) -> PathBuf {
        self.dir.join("runc")
    }
    /// containerd's PID (0 once stopped).
    pub fn pid(&self) -> u32 {
        self.process.as_ref().map(ChildProcess::pid).unwrap_or(0)
    }
    /// containerd's log so far.
    pub fn log(&self) -> String {
        self.process.as_ref().map(ChildProcess::stderr).unwrap_or_default()
    }
    /// The bundle dir containerd hands the shim (config.json as the runtime sees it).
    pub fn bundle_dir(&self, id: &str) -> PathBuf {
        self.dir.join("state/io.containerd.runtime.v2.task").join(&self.namespace).join(id)
    }
    pub fn cleanup(&self) -> &Cleanup {
        &self.cleanup
    }
    pub fn footprint(&self) -> Footprint {
        self.cleanup.footprint()
    }

    fn ctr_cmd(&self, args: &[&str]) -> Command {
        self.ctr_cmd_in(&self.namespace, args)
    }

    fn ctr_cmd_in(&self, namespace: &str, args: &[&str]) -> Command {
        let mut cmd = Command::new(CTR);
        cmd.arg("--address").arg(&self.socket).arg("--namespace").arg(namespace).args(args);
        cmd
    }

    /// `ctr --address S --namespace k8s.io ARGS..` (the CRI plugin's namespace).
    pub fn ctr_k8s(&self, args: &[&str]) -> Output {
        run_cmd(&mut self.ctr_cmd_in(cri::CRI_NAMESPACE, args))
    }

    /// A CRI client on this containerd (started with [`ContainerdBuilder::cri`]): pod log
    /// dirs under `<dir>/pods`, pod cgroups under [`Containerd::cgroup_parent`].
    pub fn cri(&self) -> cri::Cri {
        assert!(self.cri, "containerd fixture started without ContainerdBuilder::cri()");
        cri::Cri::connect(&self.socket, &self.dir.join("pods"), &self.cgroup_parent())
            .unwrap_or_else(|e| panic!("{e}\n{}", self.log()))
    }

    /// A runc root for a CRI runtime handler's `options.Root`: `<dir>/runc-<handler>`,
    /// inside the fixture (tracked once the config names it).
    pub fn runtime_root_in(dir: &Path, handler: &str) -> PathBuf {
        dir.join(format!("runc-{handler}"))
    }

    /// Imports the harness images ([`cri::image_archive`]) into `k8s.io` and waits until
    /// the CRI plugin sees them.
    fn import_cri_images(&self) {
        let archive = self.dir.join("images.tar");
        cri::write_image_archive(&archive);
        let a = archive.to_string_lossy();
        self.ctr_k8s(&["images", "import", "--snapshotter", "overlayfs", &a])
            .assert_success("ctr images import");
        let _ = fs::remove_file(&archive);
        let client = self.cri();
        for image in [cri::BUSYBOX_IMAGE, cri::PAUSE_IMAGE] {
            let seen = wait_for(
                || matches!(client.image_status(image), Ok(Some(_))),
                Duration::from_secs(10),
            );
            assert!(
                seen,
                "the CRI plugin does not see imported image {image}: {:?}\n{}",
                client.image_status(image),
                self.log()
            );
        }
    }

    /// `ctr --address S --namespace NS ARGS..`, output captured.
    pub fn ctr(&self, args: &[&str]) -> Output {
        run_cmd(&mut self.ctr_cmd(args))
    }

    /// `ctr run --rootfs [defaults] FLAGS ROOTFS ID CMD..`. `--rootfs` is a boolean flag in
    /// ctr 1.6: the rootfs dir is the first positional argument. Defaults added unless
    /// already in `flags`: `--rm` (unless `-d`/`--detach`), `--runc-binary <builder's>`,
    /// `--env PATH=..` (ctr gives a `--rootfs` container no env at all); always
    /// `--runc-root` and `--fifo-dir` inside the fixture. A `--cgroup P` is tracked for
    /// cleanup (keep it under [`Containerd::cgroup_parent`]).
    pub fn ctr_run(&self, rootfs: &Path, id: &str, flags: &[&str], cmd: &[&str]) -> Output {
        let has = |f: &str| flags.iter().any(|x| *x == f || x.starts_with(&format!("{f}=")));
        let mut args: Vec<String> = vec!["run".into(), "--rootfs".into()];
        if !has("--rm") && !has("-d") && !has("--detach") {
            args.push("--rm".into());
        }
        if !has("--runc-binary") {
            args.extend(["--runc-binary".into(), self.runc_binary.clone()]);
        }
        if !flags.iter().any(|f| f.starts_with("PATH=")) {
            args.extend(["--env".into(), DEFAULT_PATH_ENV.into()]);
        }
        args.extend(["--runc-root".into(), self.runc_root().to_string_lossy().into_owned()]);
        args.extend(["--fifo-dir".into(), self.dir.join("fifo").to_string_lossy().into_owned()]);
        for (i, f) in flags.iter().enumerate() {
            if *f == "--cgroup" {
                if let Some(p) = flags.get(i + 1) {
                    self.cleanup.track_cgroup(p);
                }
            } else if let Some(p) = f.strip_prefix("--cgroup=") {
                self.cleanup.track_cgroup(p);
            }
        }
        args.extend(flags.iter().map(|s| s.to_string()));
        args.push(rootfs.to_string_lossy().into_owned());
        args.push(id.to_owned());
        args.extend(cmd.iter().map(|s| s.to_string()));
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        self.ctr(&refs)
    }

    /// Live containerd-shim processes started for this containerd (by its socket path).
    pub fn shims(&self) -> Vec<i32> {
        processes_mentioning(&self.socket.to_string_lossy())
            .into_iter()
            .filter(|(_, cmd)| cmd.contains("containerd-shim"))
            .map(|(pid, _)| pid)
            .collect()
    }

    /// SIGKILLs containerd (a crash); shims and containers keep running.
    pub fn kill9(&mut self) {
        if let Some(p) = self.process.as_mut() {
            p.kill9();
        }
    }

    /// Starts containerd again on the same dirs and config (after [`Containerd::kill9`],
    /// or killing it first) and waits until it answers.
    pub fn restart(&mut self) {
        let p = self.process.as_mut().expect("containerd fixture already stopped");
        p.restart();
        self.cleanup.track_pid(p.pid());
        let ready = wait_for(|| self.ctr_ok(), Duration::from_secs(20));
        assert!(ready, "containerd did not come back:\n{}", self.log());
    }

    fn ctr_ok(&self) -> bool {
        let mut cmd = Command::new(CTR);
        cmd.arg("--address").arg(&self.socket).arg("version");
        matches!(output_timeout(&mut cmd, Duration::from_secs(5)), Ok(o) if o.status.success())
    }

    fn list_ids(&self, namespace: &str, what: &str) -> Vec<String> {
        let mut cmd = self.ctr_cmd_in(namespace, &[what, "ls", "-q"]);
        match output_timeout(&mut cmd, CLEANUP_CMD_TIMEOUT) {
            Ok(o) if o.status.success() => o.stdout_str().lines().map(str::to_owned).collect(),
            _ => Vec::new(),
        }
    }

    /// Stops everything (idempotent): through containerd first (tasks rm -f, containers
    /// rm, so shims exit cleanly), then SIGTERM→SIGKILL containerd, SIGKILL leftover shims
    /// (removing their sockets under /run/containerd/s), then the generic [`Cleanup`].
    pub fn stop(&mut self) {
        let Some(mut process) = self.process.take() else { return };
        if process.is_running() {
            let mut namespaces = vec![self.namespace.clone()];
            if self.cri {
                namespaces.push(cri::CRI_NAMESPACE.to_owned());
            }
            for ns in &namespaces {
                for id in self.list_ids(ns, "tasks") {
                    let _ = output_timeout(
                        &mut self.ctr_cmd_in(ns, &["tasks", "rm", "-f", &id]),
                        CLEANUP_CMD_TIMEOUT,
                    );
                }
                for id in self.list_ids(ns, "containers") {
                    let _ = output_timeout(
                        &mut self.ctr_cmd_in(ns, &["containers", "rm", &id]),
                        CLEANUP_CMD_TIMEOUT,
                    );
                }
            }
        }
        process.terminate(Duration::from_secs(5));
        for pid in self.shims() {
            for sock in unix_sockets_of(pid) {
                if sock.starts_with(SHIM_SOCKET_DIR) {
                    self.cleanup.track_file(sock);
                }
            }
            kill9(pid);
            wait_for(|| !pid_alive(pid, None), Duration::from_secs(5));
        }
        self.cleanup.run();
        if self.created_run_containerd {
            // Only removes them if empty: another containerd may have started meanwhile.
            let _ = fs::remove_dir(SHIM_SOCKET_DIR);
            let _ = fs::remove_dir("/run/containerd");
        }
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        self.stop();
    }
}
