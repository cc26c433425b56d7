//! The host, in one place: what tesserad reads of the machine it runs on — processes
//! (`/proc`), cgroups, runc's state root, the clock — and the one thing it does to it:
//! signal a container's init ([`Host::signal`], for `revoke-check --stop`). [`Host`] is
//! the seam; [`LinuxHost`] is the real machine; tests implement the trait over a fixture
//! tree with the same parsers ([`crate::liveness`]), so no code path asks "is this the
//! real /proc?".

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};

use crate::liveness::{self, CgroupProcs};

/// What tesserad reads of the host.
pub trait Host: Send + Sync + fmt::Debug {
    /// Start time (clock ticks since boot) of `pid`, or `None` if it is not alive (a
    /// zombie counts as gone).
    fn pid_start_time(&self, pid: i32) -> Option<u64>;
    /// The processes of a container whose init is `init` and whose grant recorded
    /// `cgroup` ([`liveness::container_processes`]: the cgroup's, else the init's tree):
    /// the one mapping of processes to containers, for telemetry and metering.
    fn container_processes(&self, init: Option<i32>, cgroup: Option<&str>) -> BTreeSet<u32>;
    /// The cgroup holding `pid`'s device rules, relative to the cgroup mount root, checked
    /// to list `pid` ([`liveness::container_cgroup`]).
    fn container_cgroup(&self, pid: i32) -> Result<String, String>;
    /// How many processes are in cgroup `rel` and below it.
    fn cgroup_procs(&self, rel: &str) -> CgroupProcs;
    /// The CPU and memory limits the kernel enforces on `pid`'s own cgroups
    /// ([`crate::limits::read_limits`]). A host that cannot tell says why.
    fn cgroup_limits(
        &self,
        pid: i32,
    ) -> Result<(tessera_api::KernelLimits, crate::limits::CgroupVersion), String> {
        let _ = pid;
        Err("this host does not read cgroup limits".into())
    }
    /// Whether runc has a record of container `id` under `runc_root`.
    fn runc_state_exists(&self, runc_root: &Path, id: &str) -> bool {
        tessera_api::runc_state_exists(runc_root, id)
    }
    /// The init runc recorded for container `id` under `runc_root`: its pid and start time
    /// (`init_process_pid`, `init_process_start` of its `state.json`, the start time as
    /// [`Host::pid_start_time`] reads it); `None` without a record that says both.
    fn runc_init(&self, runc_root: &Path, id: &str) -> Option<(i32, u64)> {
        #[derive(serde::Deserialize)]
        struct Init {
            init_process_pid: i32,
            init_process_start: u64,
        }
        let id = tessera_api::ContainerId::new(id).ok()?;
        let buf = tessera_api::read_runc_state(runc_root, &id).ok()?;
        let init: Init = serde_json::from_slice(&buf).ok()?;
        (init.init_process_pid > 0).then_some((init.init_process_pid, init.init_process_start))
    }
    /// The host's online CPUs and NUMA nodes (`/sys/devices/system/{cpu,node}/online`),
    /// for a grant's CPU set (`topology.pin_cpus`); `None` where it cannot tell (then
    /// nothing is pinned).
    fn cpu_layout(&self) -> Option<(Vec<u32>, Vec<u32>)> {
        None
    }
    /// Unix milliseconds now.
    fn now_ms(&self) -> u64 {
        tessera_api::time::now_ms()
    }
    /// Whether the pids this host reports are this kernel's processes, so a pidfd can watch
    /// them exit (false for a fixture: its pids name nothing).
    fn watches_exits(&self) -> bool;
    /// The mounts a container keeps, as the kernel lists them (`/proc/<pid>/mountinfo` of
    /// its init), each mount point shown as the container will see it. What a GPU
    /// container may not hold is judged on these ([`tessera_api::mountinfo::findings`]).
    ///
    /// - `created` (asked once `runc create` returned): the init has moved into the
    ///   container's root and waits to exec. Its root must be the bundle's `root.path`,
    ///   and the whole table is the container's (the kernel lists a process's mounts
    ///   relative to its root and leaves out those it cannot reach).
    /// - otherwise (the prestart hook, before runc's `pivot_root`, when the namespace still
    ///   holds the host's mounts): those at or below the bundle's `root.path`.
    fn container_mounts(
        &self,
        pid: i32,
        bundle: &Path,
        created: bool,
    ) -> Result<Vec<tessera_api::mountinfo::MountEntry>, String>;
    /// The processes in cgroup `rel` (and below it) that are not of the container whose
    /// init is `init`: in another pid namespace than the init's (every process of a
    /// container, `runc exec` ones included, is in its pid namespace). Each with its start
    /// time, for [`Host::signal`].
    fn cgroup_intruders(&self, rel: &str, init: i32) -> Vec<(i32, u64)>;
    /// The namespaces (`mnt`, `pid`) that `pid` shares with tesserad itself: a GPU
    /// container in the host's mount or pid namespace sees the host's cgroups.
    fn shared_namespaces(&self, pid: i32) -> Result<Vec<&'static str>, String>;
    /// The pid namespace `pid` is in (`pid:[N]`); `None`: unreadable.
    fn pid_namespace(&self, pid: i32) -> Option<String>;
    /// tesserad's own mount table (`/proc/self/mountinfo`): where the paths no container
    /// may see lie ([`tessera_api::mountinfo::place`]).
    fn host_mounts(&self) -> Result<Vec<tessera_api::mountinfo::MountEntry>, String>;
    /// The pid namespace the procfs at `mount_point` of the container whose init is `pid`
    /// shows (mount points as [`Host::container_mounts`] names them, with the same `bundle`
    /// and `created`); `None`: unreadable ([`tessera_api::procfs::shown_pid_namespace`]).
    fn procfs_shows(
        &self,
        pid: i32,
        bundle: &Path,
        created: bool,
        mount_point: &str,
    ) -> Option<String>;
    /// Send `signal` to `pid` only if it is still the process that started at `start`
    /// (clock ticks since boot, as [`Host::pid_start_time`] reads it). `Ok(false)`: it is
    /// gone, or the pid names another process now; nothing was sent.
    fn signal(&self, pid: i32, start: u64, signal: Signal) -> Result<bool, String>;
}

/// The signals tesserad sends (to a container's init, when a revoked grant is stopped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// SIGTERM: asks the process to stop (a container init without a handler ignores it).
    Term,
    /// SIGKILL.
    Kill,
}

impl Signal {
    pub fn name(self) -> &'static str {
        match self {
            Signal::Term => "SIGTERM",
            Signal::Kill => "SIGKILL",
        }
    }

    fn number(self) -> libc::c_int {
        match self {
            Signal::Term => libc::SIGTERM,
            Signal::Kill => libc::SIGKILL,
        }
    }
}

/// A pidfd of process `pid` (`pidfd_open(2)`, Linux 5.3): it names that process, not a later
/// one of the same pid.
pub fn pidfd_open(pid: i32) -> std::io::Result<std::os::fd::OwnedFd> {
    // SAFETY: a plain syscall with integer arguments; it returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened by the kernel for us and nothing else owns it.
    Ok(unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) })
}

/// Signal `pid` if it is the process that started at `start`, on the real machine. A pidfd
/// pins the process before its start time is checked, so the signal cannot reach a process
/// that took the pid over in between. Kernels without pidfds (< 5.3) fall back to a check
/// then `kill(2)`, which leaves that (tiny) window open.
fn signal_process(pid: i32, start: u64, signal: Signal) -> Result<bool, String> {
    let started = || liveness::pid_start_time(Path::new(PROC_ROOT), pid) == Some(start);
    let failed = |what: &str, e: std::io::Error| format!("{what} of pid {pid}: {e}");
    let fd = match pidfd_open(pid) {
        Ok(fd) => fd,
        Err(e) => {
            return match e.raw_os_error() {
                Some(libc::ESRCH) => Ok(false),
                Some(libc::ENOSYS) => {
                    if !started() {
                        return Ok(false);
                    }
                    // SAFETY: kill(2) takes integers and touches no memory of ours.
                    if unsafe { libc::kill(pid, signal.number()) } == 0 {
                        Ok(true)
                    } else {
                        let e = std::io::Error::last_os_error();
                        match e.raw_os_error() {
                            Some(libc::ESRCH) => Ok(false),
                            _ => Err(failed(signal.name(), e)),
                        }
                    }
                }
                _ => Err(failed("pidfd_open", e)),
            };
        }
    };
    // The pidfd names the process that had `pid` when it was opened: if that process has
    // the recorded start time, the signal below reaches it or nothing.
    if !started() {
        return Ok(false);
    }
    let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
    // SAFETY: pidfd_send_signal(pidfd, sig, NULL, 0): integer arguments and a null siginfo
    // pointer, which the kernel reads as "a plain kill".
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            raw,
            signal.number(),
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if r == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        // It exited after the check.
        Some(libc::ESRCH) => Ok(false),
        _ => Err(failed(signal.name(), e)),
    }
}

/// The machine tesserad runs on: `/proc` and `/sys/fs/cgroup`.
#[derive(Debug, Clone, Default)]
pub struct LinuxHost;

/// Where Linux mounts the cgroup hierarchies (v1: one directory per hierarchy, e.g.
/// `devices/`; v2: the unified tree itself).
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// Where Linux shows processes.
pub const PROC_ROOT: &str = "/proc";

impl Host for LinuxHost {
    fn cpu_layout(&self) -> Option<(Vec<u32>, Vec<u32>)> {
        let read = |p: &str| {
            std::fs::read_to_string(p)
                .ok()
                .and_then(|t| tessera_api::cpulist::parse_cpulist(&t).ok())
        };
        let cpus = read("/sys/devices/system/cpu/online")?;
        // A kernel without NUMA has no node directory: one node, 0.
        let nodes = read("/sys/devices/system/node/online").unwrap_or_else(|| vec![0]);
        Some((cpus, nodes))
    }
    fn pid_start_time(&self, pid: i32) -> Option<u64> {
        liveness::pid_start_time(Path::new(PROC_ROOT), pid)
    }
    fn container_processes(&self, init: Option<i32>, cgroup: Option<&str>) -> BTreeSet<u32> {
        liveness::container_processes(Path::new(PROC_ROOT), Path::new(CGROUP_ROOT), init, cgroup)
    }
    fn container_cgroup(&self, pid: i32) -> Result<String, String> {
        liveness::container_cgroup(Path::new(PROC_ROOT), Path::new(CGROUP_ROOT), pid)
    }
    fn cgroup_procs(&self, rel: &str) -> CgroupProcs {
        liveness::cgroup_procs(Path::new(CGROUP_ROOT), rel)
    }
    fn cgroup_limits(
        &self,
        pid: i32,
    ) -> Result<(tessera_api::KernelLimits, crate::limits::CgroupVersion), String> {
        crate::limits::read_limits(Path::new(PROC_ROOT), Path::new(CGROUP_ROOT), pid)
    }
    fn watches_exits(&self) -> bool {
        true
    }
    fn container_mounts(
        &self,
        pid: i32,
        bundle: &Path,
        created: bool,
    ) -> Result<Vec<tessera_api::mountinfo::MountEntry>, String> {
        let root = tessera_api::bundle_root(bundle)?;
        let proc = Path::new(PROC_ROOT).join(pid.to_string());
        if !created {
            let all = read_mount_table(&proc.join("mountinfo"))?;
            return Ok(tessera_api::mountinfo::below(all, &root));
        }
        // Read through the process's own root: the same file as the bundle's root, or the
        // table is of some other root than the one checked.
        if !same_file(&proc.join("root"), &root)? {
            return Err(format!(
                "its root is not the bundle's root {}: runc did not move it into the root that was checked",
                tessera_api::untrusted(&root.to_string_lossy())
            ));
        }
        let all = read_mount_table(&proc.join("mountinfo"))?;
        // Read again after the table: a root that moved while it was read is refused.
        if !same_file(&proc.join("root"), &root)? {
            return Err("its root moved while its mount table was read".into());
        }
        Ok(tessera_api::mountinfo::below(all, Path::new("/")))
    }
    fn cgroup_intruders(&self, rel: &str, init: i32) -> Vec<(i32, u64)> {
        use std::os::unix::fs::MetadataExt;
        let proc = Path::new(PROC_ROOT);
        let pidns = |pid: i32| {
            std::fs::metadata(proc.join(pid.to_string()).join("ns/pid")).ok().map(|m| m.ino())
        };
        let Some(theirs) = pidns(init) else { return Vec::new() };
        liveness::cgroup_pids(Path::new(CGROUP_ROOT), rel)
            .into_iter()
            .filter(|&p| pidns(p).is_some_and(|ns| ns != theirs))
            .filter_map(|p| Some((p, liveness::pid_start_time(proc, p)?)))
            .collect()
    }
    fn shared_namespaces(&self, pid: i32) -> Result<Vec<&'static str>, String> {
        let mut shared = Vec::new();
        for ns in ["mnt", "pid"] {
            let theirs = Path::new(PROC_ROOT).join(pid.to_string()).join("ns").join(ns);
            let ours = Path::new(PROC_ROOT).join("self/ns").join(ns);
            if same_file(&theirs, &ours)? {
                shared.push(ns);
            }
        }
        Ok(shared)
    }
    fn pid_namespace(&self, pid: i32) -> Option<String> {
        tessera_api::procfs::pid_namespace(Path::new(PROC_ROOT), pid)
    }
    fn host_mounts(&self) -> Result<Vec<tessera_api::mountinfo::MountEntry>, String> {
        read_mount_table(&Path::new(PROC_ROOT).join("self/mountinfo"))
    }
    fn procfs_shows(
        &self,
        pid: i32,
        bundle: &Path,
        created: bool,
        mount_point: &str,
    ) -> Option<String> {
        let proc = Path::new(PROC_ROOT);
        if created {
            return tessera_api::procfs::shown_pid_namespace(proc, pid, mount_point);
        }
        // Before runc's pivot_root the init's root is the host's: the mount is below the
        // bundle's root there.
        let root = tessera_api::bundle_root(bundle).ok()?;
        let at = root.join(mount_point.trim_start_matches('/'));
        tessera_api::procfs::shown_pid_namespace(proc, pid, at.to_str()?)
    }
    fn signal(&self, pid: i32, start: u64, signal: Signal) -> Result<bool, String> {
        signal_process(pid, start, signal)
    }
}

/// The pid namespace every process of a directory-tree host is in.
pub const FIXTURE_PID_NAMESPACE: &str = "pid:[4026530000]";

/// Whether `a` and `b` (followed) are the same file: same device and inode.
fn same_file(a: &Path, b: &Path) -> Result<bool, String> {
    use std::os::unix::fs::MetadataExt;
    let id = |p: &Path| {
        std::fs::metadata(p)
            .map(|m| (m.dev(), m.ino()))
            .map_err(|e| format!("cannot read {}: {e}", p.display()))
    };
    Ok(id(a)? == id(b)?)
}

/// Reads and parses a mountinfo file; unreadable or malformed is an error (a table that
/// cannot be read is never judged clean).
fn read_mount_table(file: &Path) -> Result<Vec<tessera_api::mountinfo::MountEntry>, String> {
    let text = std::fs::read_to_string(file)
        .map_err(|e| format!("cannot read {}: {e}", file.display()))?;
    tessera_api::mountinfo::parse(&text).map_err(|e| format!("{}: {e}", file.display()))
}

/// A host read from a directory tree laid out like the real one (`<dir>/proc/<pid>/stat`,
/// `<dir>/cgroup/<rel>/cgroup.procs`): for tests, and for running tesserad against a
/// recorded machine. Its pids are never watched with pidfds, and never really signalled:
/// a signal is appended to `<proc>/<pid>/signals` (its name and a newline), and SIGKILL
/// also removes `<proc>/<pid>` (the process is gone). What SIGTERM does is up to the
/// fixture (a process that handles it exits: remove its directory).
#[derive(Debug, Clone)]
pub struct TreeHost {
    pub proc_root: PathBuf,
    pub cgroup_root: PathBuf,
}

impl Host for TreeHost {
    fn pid_start_time(&self, pid: i32) -> Option<u64> {
        liveness::pid_start_time(&self.proc_root, pid)
    }
    fn container_processes(&self, init: Option<i32>, cgroup: Option<&str>) -> BTreeSet<u32> {
        liveness::container_processes(&self.proc_root, &self.cgroup_root, init, cgroup)
    }
    fn container_cgroup(&self, pid: i32) -> Result<String, String> {
        liveness::container_cgroup(&self.proc_root, &self.cgroup_root, pid)
    }
    fn cgroup_procs(&self, rel: &str) -> CgroupProcs {
        liveness::cgroup_procs(&self.cgroup_root, rel)
    }
    fn cgroup_limits(
        &self,
        pid: i32,
    ) -> Result<(tessera_api::KernelLimits, crate::limits::CgroupVersion), String> {
        crate::limits::read_limits(&self.proc_root, &self.cgroup_root, pid)
    }
    fn watches_exits(&self) -> bool {
        false
    }
    /// `<proc>/<pid>/mountinfo` where the fixture has one (all of it: a fixture's table is
    /// the container's); none is an empty table.
    fn container_mounts(
        &self,
        pid: i32,
        _bundle: &Path,
        _created: bool,
    ) -> Result<Vec<tessera_api::mountinfo::MountEntry>, String> {
        let file = self.proc_root.join(pid.to_string()).join("mountinfo");
        if file.exists() {
            read_mount_table(&file)
        } else {
            Ok(Vec::new())
        }
    }
    /// A fixture has no pid namespaces to tell apart.
    fn cgroup_intruders(&self, _rel: &str, _init: i32) -> Vec<(i32, u64)> {
        Vec::new()
    }
    /// A fixture's processes share nothing with this one.
    fn shared_namespaces(&self, _pid: i32) -> Result<Vec<&'static str>, String> {
        Ok(Vec::new())
    }
    /// A fixture's processes are all in [`FIXTURE_PID_NAMESPACE`].
    fn pid_namespace(&self, _pid: i32) -> Option<String> {
        Some(FIXTURE_PID_NAMESPACE.to_string())
    }
    /// `<proc>/self/mountinfo` where the fixture has one; none is an empty table.
    fn host_mounts(&self) -> Result<Vec<tessera_api::mountinfo::MountEntry>, String> {
        let file = self.proc_root.join("self/mountinfo");
        if file.exists() {
            read_mount_table(&file)
        } else {
            Ok(Vec::new())
        }
    }
    /// What `<proc>/<pid>/procfs-shows` says for `mount_point` (lines `MOUNT_POINT NS`;
    /// `-` for unreadable), else [`FIXTURE_PID_NAMESPACE`]: a fixture's procfs are its own
    /// unless it says otherwise.
    fn procfs_shows(
        &self,
        pid: i32,
        _bundle: &Path,
        _created: bool,
        mount_point: &str,
    ) -> Option<String> {
        let file = self.proc_root.join(pid.to_string()).join("procfs-shows");
        let text = std::fs::read_to_string(file).unwrap_or_default();
        match text.lines().find_map(|l| l.strip_prefix(mount_point)?.strip_prefix(' ')) {
            Some("-") => None,
            Some(ns) => Some(ns.to_string()),
            None => Some(FIXTURE_PID_NAMESPACE.to_string()),
        }
    }
    fn signal(&self, pid: i32, start: u64, signal: Signal) -> Result<bool, String> {
        if self.pid_start_time(pid) != Some(start) {
            return Ok(false);
        }
        let dir = self.proc_root.join(pid.to_string());
        let log = dir.join("signals");
        let io = |e: std::io::Error| format!("{}: {e}", log.display());
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&log).map_err(io)?;
        std::io::Write::write_all(&mut f, format!("{}\n", signal.name()).as_bytes()).map_err(io)?;
        if signal == Signal::Kill {
            std::fs::remove_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_real_host_sees_this_process() {
        let me = i32::try_from(std::process::id()).expect("pid fits");
        assert!(LinuxHost.pid_start_time(me).is_some());
        assert!(LinuxHost.container_processes(Some(me), None).contains(&std::process::id()));
        assert!(LinuxHost.watches_exits());
    }

    #[test]
    fn a_tree_host_reads_only_its_tree() {
        let dir = tempfile::tempdir().expect("tempdir");
        let host =
            TreeHost { proc_root: dir.path().join("proc"), cgroup_root: dir.path().join("cg") };
        let me = i32::try_from(std::process::id()).expect("pid fits");
        assert_eq!(host.pid_start_time(me), None, "the real process is not in the tree");
        let p = dir.path().join("proc/42");
        std::fs::create_dir_all(&p).expect("mkdir");
        std::fs::write(
            p.join("stat"),
            "42 (sh) S 1 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10",
        )
        .expect("stat");
        assert_eq!(host.pid_start_time(42), Some(987_654));
        assert!(!host.watches_exits());
        // Signals are recorded, only for the process that started then; SIGKILL ends it.
        assert_eq!(host.signal(42, 1, Signal::Term), Ok(false), "another start time");
        assert_eq!(host.signal(42, 987_654, Signal::Term), Ok(true));
        assert_eq!(std::fs::read_to_string(p.join("signals")).expect("log"), "SIGTERM\n");
        assert_eq!(host.pid_start_time(42), Some(987_654), "SIGTERM alone ends nothing");
        assert_eq!(host.signal(42, 987_654, Signal::Kill), Ok(true));
        assert_eq!(host.pid_start_time(42), None);
        assert_eq!(host.signal(42, 987_654, Signal::Kill), Ok(false), "gone");
    }

    #[test]
    fn the_real_host_signals_only_the_process_that_started_then() {
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("spawn");
        let pid = i32::try_from(child.id()).expect("pid fits");
        let start = LinuxHost.pid_start_time(pid).expect("alive");
        // Another start time: a recycled pid. Nothing is sent.
        assert_eq!(LinuxHost.signal(pid, start + 1, Signal::Term), Ok(false));
        assert!(child.try_wait().expect("wait").is_none(), "still running");
        assert_eq!(LinuxHost.signal(pid, start, Signal::Term), Ok(true));
        let status = child.wait().expect("wait");
        assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(libc::SIGTERM));
        // Reaped: the pid names nothing now.
        assert_eq!(LinuxHost.signal(pid, start, Signal::Kill), Ok(false));
    }
}
