//! `fake-nvidia-cuda-mps-control`: a TEST DOUBLE of NVIDIA's `nvidia-cuda-mps-control`.
//!
//! It is not a GPU feature and shares no GPU: it speaks the documented control protocol
//! (see [`mpsd::protocol`]) so the supervisor, tesserad and the end-to-end tests can run
//! on machines without NVIDIA's binary or a GPU. Production uses the real binary
//! (`tesserad --mps-control /usr/bin/nvidia-cuda-mps-control`).
//!
//! Like the real binary:
//! - `-d` starts the control daemon in the background (`-f`: in the foreground). It takes
//!   `CUDA_MPS_PIPE_DIRECTORY` (default `/tmp/nvidia-mps`), `CUDA_MPS_LOG_DIRECTORY`
//!   (default `/var/log/nvidia-mps`) and `CUDA_VISIBLE_DEVICES` from its environment,
//!   writes `<pipe dir>/nvidia-cuda-mps-control.pid`, listens on the unix socket
//!   `<pipe dir>/control` and logs to `<log dir>/control.log`. The launcher exits 0 once
//!   the daemon is ready, 1 if a daemon already serves the pipe dir.
//! - Without arguments it is the client: it reads commands from stdin, one a line, sends
//!   each to the daemon and prints the answers; with no daemon it prints
//!   `Cannot find MPS control daemon process` and exits 1.
//! - Caps are daemon state: `set_default_*` values apply to servers started afterwards;
//!   the driver's display of pinned-memory limits is copied (1 GiB and more: whole GiB,
//!   rounded down). A restarted daemon starts from defaults (100% threads, no memory
//!   limit), as the real one loses its settings.
//! - `start_server -uid U` starts a stand-in server process (this binary with
//!   `--fake-mps-server`; it dies with its daemon) so server PIDs are real PIDs.
//! - `quit` stops the servers, removes the PID file and the socket, and ends the daemon.
//!
//! Test-double-only additions (never in the real binary):
//! - `<pipe dir>/fake-state.json`: the daemon's whole state, rewritten after every
//!   command, so tests can inspect caps, servers and the order of commands
//!   ([`FakeState`]).
//! - `FAKE_MPS_CRASH_AFTER_MS=N` in the daemon's environment: the daemon kills itself
//!   with SIGKILL N ms after it is ready (leaving its PID file and socket behind, like a
//!   crash), to simulate crash loops.
//!
//! Links: the pipe dir is reachable from containers, so the double never follows a link
//! there. Every file it writes (the PID file, its state) is a fresh temp file created with
//! `O_CREAT|O_EXCL|O_NOFOLLOW` in the pipe dir (which must be a directory of its own user,
//! not a link), renamed into place; its logs are opened with `O_NOFOLLOW`; a symbolic link
//! found where it writes (or where its socket goes) is refused with an error that says so:
//! the launcher exits 1 naming it, the daemon logs it to `control.log` and writes nothing.
//!
//! Wording of answers that NVIDIA does not document (errors, an unset memory limit shown
//! as `0M`) is this double's own.
//!
//! A crate of its own (`publish = false`), so nothing a user installs (`cargo install`,
//! the root package's binaries) contains it. The binary keeps its name and lands in the
//! target dir beside the others (`target/<profile>/fake-nvidia-cuda-mps-control`), where
//! the end-to-end harness finds it; `cargo build --workspace --bins` builds it.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use mpsd::layout::{CONTROL_SOCKET, PID_FILE};
use mpsd::protocol::{Command, DeviceRef, NO_DAEMON};

/// The state file the double keeps in its pipe dir.
pub const STATE_FILE: &str = "fake-state.json";
/// The crash hook's environment variable.
pub const CRASH_AFTER_ENV: &str = "FAKE_MPS_CRASH_AFTER_MS";
/// What the launcher prints when a daemon already serves the pipe dir.
pub const ALREADY_RUNNING: &str = "An instance of this daemon is already running";

/// One stand-in MPS server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FakeServer {
    pub pid: u32,
    pub uid: u32,
    pub active_thread_percentage: f64,
    /// Device ordinal -> limit in MiB.
    pub pinned_mem_limit_mib: BTreeMap<u32, u64>,
    pub clients: Vec<u32>,
}

/// The double's whole state, as written to `<pipe dir>/fake-state.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FakeState {
    pub pid: u32,
    pub pipe_dir: PathBuf,
    /// `CUDA_VISIBLE_DEVICES` as the daemon saw it.
    pub visible_devices: Vec<String>,
    pub default_active_thread_percentage: f64,
    /// Device ordinal -> default limit in MiB (exact, not as displayed).
    pub default_pinned_mem_limit_mib: BTreeMap<u32, u64>,
    pub servers: Vec<FakeServer>,
    /// Every command received, in order.
    pub commands: Vec<String>,
}

impl FakeState {
    /// Read the state a fake daemon left in `pipe_dir`.
    pub fn read(pipe_dir: &Path) -> Option<FakeState> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(pipe_dir.join(STATE_FILE))
            .ok()?;
        let mut bytes = Vec::new();
        f.read_to_end(&mut bytes).ok()?;
        serde_json::from_slice(&bytes).ok()
    }
}

/// Refuse `path` if it is a symbolic link (the pipe dir is reachable from containers: a
/// link there may point anywhere on the host).
fn refuse_link(path: &Path) -> Result<(), String> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => Err(format!(
            "refusing to use {}: it is a symbolic link (planted?); nothing written through it",
            path.display()
        )),
        _ => Ok(()),
    }
}

/// Write `bytes` to `dir/name` without ever following a link: `dir` must be a directory
/// (not a link) of this process's user, `dir/name` must not be a symbolic link; the bytes go
/// to a fresh temp file (`O_CREAT|O_EXCL|O_NOFOLLOW`, a name of this process's) that is then
/// renamed over `dir/name` (a rename replaces a link, never follows it).
fn write_no_follow(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), String> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let meta = std::fs::symlink_metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    if !meta.is_dir() {
        return Err(format!("refusing to write into {}: not a directory", dir.display()));
    }
    let me = nix::unistd::geteuid().as_raw();
    if meta.uid() != me {
        return Err(format!(
            "refusing to write into {}: owned by uid {}, not by uid {me}",
            dir.display(),
            meta.uid()
        ));
    }
    let path = dir.join(name);
    refuse_link(&path)?;
    let tmp = dir.join(format!(
        ".{name}.{}.{}.tmp",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .mode(0o644)
        .open(&tmp)
        .map_err(|e| format!("refusing to write {}: {e}", tmp.display()))?;
    let written = f.write_all(bytes).and_then(|()| std::fs::rename(&tmp, &path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!("cannot write {}: {e}", path.display()));
    }
    Ok(())
}

/// The entry point of the `fake-nvidia-cuda-mps-control` binary; returns the exit code.
pub fn main() -> i32 {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.as_slice() {
        [] => client(),
        ["-d"] => daemon(true),
        ["-f"] => daemon(false),
        ["--fake-mps-server", ppid] => server_standin(ppid),
        ["-h" | "--help"] => {
            println!("fake-nvidia-cuda-mps-control: a TEST DOUBLE of nvidia-cuda-mps-control\nusage: fake-nvidia-cuda-mps-control [-d | -f]");
            0
        }
        _ => {
            eprintln!("usage: fake-nvidia-cuda-mps-control [-d | -f]");
            2
        }
    }
}

struct Env {
    pipe_dir: PathBuf,
    log_dir: PathBuf,
    visible: Vec<String>,
}

fn env() -> Env {
    let var = |k: &str, d: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map_or_else(|| PathBuf::from(d), PathBuf::from)
    };
    Env {
        pipe_dir: var("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps"),
        log_dir: var("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps"),
        visible: std::env::var("CUDA_VISIBLE_DEVICES")
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect(),
    }
}

fn client() -> i32 {
    let env = env();
    let mut input = String::new();
    if std::io::stdin().read_to_string(&mut input).is_err() {
        eprintln!("cannot read commands from stdin");
        return 1;
    }
    let socket = env.pipe_dir.join(CONTROL_SOCKET);
    if let Err(e) = refuse_link(&socket) {
        eprintln!("{e}");
        return 1;
    }
    for line in input.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let Ok(mut stream) = UnixStream::connect(&socket) else {
            println!("{NO_DAEMON}");
            return 1;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
        let mut answer = String::new();
        let sent = stream
            .write_all(format!("{line}\n").as_bytes())
            .and_then(|()| stream.shutdown(std::net::Shutdown::Write))
            .and_then(|()| stream.read_to_string(&mut answer).map(drop));
        if sent.is_err() {
            println!("{NO_DAEMON}");
            return 1;
        }
        print!("{answer}");
    }
    0
}

fn log(log_dir: &Path, file: &str, msg: &str) {
    let now =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let line = format!(
        "[{}.{:03} Control {}] {msg}\n",
        now.as_secs(),
        now.subsec_millis(),
        std::process::id()
    );
    use std::os::unix::fs::OpenOptionsExt;
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(log_dir.join(file))
    {
        let _ = f.write_all(line.as_bytes());
    }
}

fn daemon(background: bool) -> i32 {
    let env = env();
    for dir in [&env.pipe_dir, &env.log_dir] {
        if let Err(e) = std::fs::create_dir_all(dir) {
            eprintln!("cannot create {}: {e}", dir.display());
            return 1;
        }
    }
    let socket = env.pipe_dir.join(CONTROL_SOCKET);
    for name in [CONTROL_SOCKET, PID_FILE, STATE_FILE] {
        if let Err(e) = refuse_link(&env.pipe_dir.join(name)) {
            eprintln!("{e}");
            return 1;
        }
    }
    if UnixStream::connect(&socket).is_ok() {
        eprintln!("{ALREADY_RUNNING}");
        return 1;
    }
    let _ = std::fs::remove_file(&socket);
    let listener = match UnixListener::bind(&socket) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("cannot listen on {}: {e}", socket.display());
            return 1;
        }
    };
    if !background {
        return serve(&env, &listener, None);
    }
    let (ready_r, ready_w) = match nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("pipe: {e}");
            return 1;
        }
    };
    // SAFETY: this process is single-threaded here (nothing has spawned a thread yet), so
    // the child may go on running ordinary Rust code after the fork.
    match unsafe { nix::unistd::fork() } {
        Err(e) => {
            eprintln!("fork: {e}");
            1
        }
        Ok(nix::unistd::ForkResult::Parent { .. }) => {
            drop(ready_w);
            let mut byte = [0u8; 1];
            let mut r = std::fs::File::from(ready_r);
            // The child writes one byte once it serves; EOF without it means it died.
            match r.read(&mut byte) {
                Ok(1) => 0,
                _ => {
                    eprintln!(
                        "the control daemon failed to start; see {}",
                        env.log_dir.join("control.log").display()
                    );
                    1
                }
            }
        }
        Ok(nix::unistd::ForkResult::Child) => {
            drop(ready_r);
            let _ = nix::unistd::setsid();
            if let Ok(null) = std::fs::OpenOptions::new().read(true).write(true).open("/dev/null") {
                let _ = nix::unistd::dup2_stdin(&null);
                let _ = nix::unistd::dup2_stdout(&null);
                let _ = nix::unistd::dup2_stderr(&null);
            }
            serve(&env, &listener, Some(std::fs::File::from(ready_w)))
        }
    }
}

struct Daemon<'a> {
    env: &'a Env,
    state: FakeState,
    children: BTreeMap<u32, Child>,
}

fn serve(env: &Env, listener: &UnixListener, ready: Option<std::fs::File>) -> i32 {
    let pid = std::process::id();
    let pid_file = env.pipe_dir.join(PID_FILE);
    if let Err(e) = write_no_follow(&env.pipe_dir, PID_FILE, format!("{pid}\n").as_bytes()) {
        log(&env.log_dir, "control.log", &e);
        return 1;
    }
    let mut d = Daemon {
        env,
        state: FakeState {
            pid,
            pipe_dir: env.pipe_dir.clone(),
            visible_devices: env.visible.clone(),
            default_active_thread_percentage: 100.0,
            default_pinned_mem_limit_mib: BTreeMap::new(),
            servers: Vec::new(),
            commands: Vec::new(),
        },
        children: BTreeMap::new(),
    };
    d.persist();
    let socket = env.pipe_dir.join(CONTROL_SOCKET);
    log(
        &env.log_dir,
        "control.log",
        &format!("Starting control daemon using socket {}", socket.display()),
    );
    log(
        &env.log_dir,
        "control.log",
        &format!(
            "To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY={}",
            env.pipe_dir.display()
        ),
    );
    if let Some(mut r) = ready {
        let _ = r.write_all(b"R");
    }
    if let Some(ms) = std::env::var(CRASH_AFTER_ENV).ok().and_then(|v| v.trim().parse::<u64>().ok())
    {
        let log_dir = env.log_dir.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(ms));
            log(
                &log_dir,
                "control.log",
                &format!("{CRASH_AFTER_ENV}={ms}: the test double crashes now"),
            );
            let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
        });
    }
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        let _ = stream.set_write_timeout(Some(Duration::from_secs(5)));
        let mut line = String::new();
        {
            let mut reader = BufReader::new((&stream).take(4096));
            if reader.read_line(&mut line).is_err() {
                continue;
            }
        }
        let line = line.trim().to_string();
        log(&env.log_dir, "control.log", "NEW UI");
        log(&env.log_dir, "control.log", &format!("Cmd:{line}"));
        let (answer, quit) = d.handle(&line);
        d.persist();
        let _ = stream.write_all(answer.as_bytes());
        log(&env.log_dir, "control.log", "UI closed");
        if quit {
            d.stop_servers();
            let _ = std::fs::remove_file(&pid_file);
            let _ = std::fs::remove_file(&socket);
            d.persist();
            log(&env.log_dir, "control.log", "Exit");
            return 0;
        }
    }
    0
}

/// A memory limit as the driver displays it: whole GiB (rounded down) from 1 GiB up.
fn display_limit(mib: u64) -> String {
    if mib >= 1024 {
        format!("{}G", mib / 1024)
    } else {
        format!("{mib}M")
    }
}

impl Daemon<'_> {
    fn persist(&self) {
        if let Ok(bytes) = serde_json::to_vec_pretty(&self.state) {
            if let Err(e) = write_no_follow(&self.env.pipe_dir, STATE_FILE, &bytes) {
                log(&self.env.log_dir, "control.log", &e);
            }
        }
    }

    fn ordinal(&self, dev: &DeviceRef) -> Option<u32> {
        let n = match dev {
            DeviceRef::Ordinal(n) => *n,
            DeviceRef::Uuid(u) => u32::try_from(
                self.state
                    .visible_devices
                    .iter()
                    .position(|v| v == u || v.starts_with(u.as_str()))?,
            )
            .ok()?,
        };
        let count = self.state.visible_devices.len().max(1);
        (usize::try_from(n).ok()? < count).then_some(n)
    }

    fn reap(&mut self) {
        let dead: Vec<u32> = self
            .children
            .iter_mut()
            .filter_map(|(pid, c)| matches!(c.try_wait(), Ok(Some(_)) | Err(_)).then_some(*pid))
            .collect();
        for pid in dead {
            self.children.remove(&pid);
            self.state.servers.retain(|s| s.pid != pid);
            log(&self.env.log_dir, "control.log", &format!("Server {pid} exited"));
        }
    }

    fn stop_servers(&mut self) {
        for (pid, mut c) in std::mem::take(&mut self.children) {
            let _ = c.kill();
            let _ = c.wait();
            log(&self.env.log_dir, "server.log", &format!("Server {pid} shut down"));
        }
        self.state.servers.clear();
    }

    fn server(&mut self, pid: u32) -> Option<&mut FakeServer> {
        self.state.servers.iter_mut().find(|s| s.pid == pid)
    }

    /// The answer to one command line, and whether the daemon quits.
    fn handle(&mut self, line: &str) -> (String, bool) {
        self.state.commands.push(line.to_string());
        self.reap();
        let cmd = match Command::parse(line) {
            Ok(c) => c,
            Err(e) => return (format!("Invalid command: {e}\n"), false),
        };
        let not_found = |pid: u32| format!("Server {pid} not found\n");
        let bad_device = |d: &DeviceRef| format!("Invalid device {d}\n");
        let answer = match cmd {
            Command::Quit => return (String::new(), true),
            Command::GetServerList => {
                self.state.servers.iter().map(|s| format!("{}\n", s.pid)).collect()
            }
            Command::StartServer { uid } => {
                if self.state.servers.iter().any(|s| s.uid == uid) {
                    String::new()
                } else {
                    match self.spawn_server(uid) {
                        Ok(()) => String::new(),
                        Err(e) => format!("Failed to start server: {e}\n"),
                    }
                }
            }
            Command::ShutdownServer { pid, .. } => match self.children.remove(&pid) {
                Some(mut c) => {
                    let _ = c.kill();
                    let _ = c.wait();
                    self.state.servers.retain(|s| s.pid != pid);
                    log(&self.env.log_dir, "server.log", &format!("Server {pid} shut down"));
                    String::new()
                }
                None => not_found(pid),
            },
            Command::GetClientList { server_pid } => match self.server(server_pid) {
                Some(s) => s.clients.iter().map(|c| format!("{c}\n")).collect(),
                None => not_found(server_pid),
            },
            Command::TerminateClient { server_pid, client_pid } => match self.server(server_pid) {
                Some(s) => {
                    s.clients.retain(|c| *c != client_pid);
                    String::new()
                }
                None => not_found(server_pid),
            },
            Command::SetDefaultActiveThreadPercentage(p) => {
                self.state.default_active_thread_percentage = f64::from(p);
                String::new()
            }
            Command::GetDefaultActiveThreadPercentage => {
                format!("{:.1}\n", self.state.default_active_thread_percentage)
            }
            Command::SetActiveThreadPercentage { server_pid, percent } => {
                match self.server(server_pid) {
                    Some(s) => {
                        s.active_thread_percentage = f64::from(percent);
                        String::new()
                    }
                    None => not_found(server_pid),
                }
            }
            Command::GetActiveThreadPercentage { server_pid } => match self.server(server_pid) {
                Some(s) => format!("{:.1}\n", s.active_thread_percentage),
                None => not_found(server_pid),
            },
            Command::SetDefaultDevicePinnedMemLimit { device, limit } => {
                match self.ordinal(&device) {
                    Some(n) => {
                        self.state.default_pinned_mem_limit_mib.insert(n, limit.mib());
                        String::new()
                    }
                    None => bad_device(&device),
                }
            }
            Command::GetDefaultDevicePinnedMemLimit { device } => match self.ordinal(&device) {
                Some(n) => format!(
                    "{}\n",
                    display_limit(
                        self.state.default_pinned_mem_limit_mib.get(&n).copied().unwrap_or(0)
                    )
                ),
                None => bad_device(&device),
            },
            Command::SetDevicePinnedMemLimit { server_pid, device, limit } => {
                let n = self.ordinal(&device);
                match (self.server(server_pid), n) {
                    (Some(s), Some(n)) => {
                        s.pinned_mem_limit_mib.insert(n, limit.mib());
                        String::new()
                    }
                    (None, _) => not_found(server_pid),
                    (_, None) => bad_device(&device),
                }
            }
            Command::GetDevicePinnedMemLimit { server_pid, device } => {
                let n = self.ordinal(&device);
                match (self.server(server_pid), n) {
                    (Some(s), Some(n)) => {
                        format!(
                            "{}\n",
                            display_limit(s.pinned_mem_limit_mib.get(&n).copied().unwrap_or(0))
                        )
                    }
                    (None, _) => not_found(server_pid),
                    (_, None) => bad_device(&device),
                }
            }
        };
        (answer, false)
    }

    fn spawn_server(&mut self, uid: u32) -> std::io::Result<()> {
        let exe = std::env::current_exe()?;
        let child = std::process::Command::new(exe)
            .arg("--fake-mps-server")
            .arg(std::process::id().to_string())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        let pid = child.id();
        self.children.insert(pid, child);
        self.state.servers.push(FakeServer {
            pid,
            uid,
            active_thread_percentage: self.state.default_active_thread_percentage,
            pinned_mem_limit_mib: self.state.default_pinned_mem_limit_mib.clone(),
            clients: Vec::new(),
        });
        log(&self.env.log_dir, "server.log", &format!("Server {pid} has started for uid {uid}"));
        Ok(())
    }
}

/// The stand-in server: lives until killed or until its daemon dies.
fn server_standin(ppid: &str) -> i32 {
    let _ = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL);
    // The daemon may have died before the death signal was armed.
    if Some(nix::unistd::getppid().as_raw()) != ppid.parse::<i32>().ok() {
        return 1;
    }
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mpsd::protocol::MemLimit;

    #[test]
    fn limits_are_displayed_as_the_driver_does() {
        assert_eq!(display_limit(0), "0M");
        assert_eq!(display_limit(512), "512M");
        assert_eq!(display_limit(1044), "1G");
        assert_eq!(display_limit(20 * 1024), "20G");
        // What the supervisor sets, the displayed form matches.
        for mib in [1u64, 512, 1023, 1024, 1044, 20_389, 40 * 1024] {
            let set = MemLimit::from_mib(mib).expect("limit");
            let shown = MemLimit::parse(&display_limit(mib)).expect("parses");
            assert!(set.readback_matches(shown), "{mib}");
        }
    }
}
