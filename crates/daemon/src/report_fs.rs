//! Where a latency-sensitive container's report file lives: on a tmpfs of its own, one
//! page and two inodes (`size=4k,nr_inodes=2`, `nosuid,nodev,noexec`), never on the
//! filesystem of tesserad's state (docs/SECURITY.md section 7). The container writes the
//! file through a read-write bind; the kernel refuses a write past 4 KiB (`ENOSPC`), so a
//! tenant cannot grow the filesystem that holds `state.db` and `ledger.db`.
//!
//! [`create`] mounts the tmpfs on a staging directory, makes the file in it, binds that
//! file onto `<state>/reports/<id>` (the path the grant's bind and the reader use), then
//! detaches the staging mount: the bind alone keeps the tmpfs alive, so one mount per
//! container is left to undo. [`remove`] undoes it (release), [`sweep`] undoes those of
//! grants no longer recorded (startup).
//!
//! The mounts are made in the mount namespace of pid 1, where runc (started by the engine)
//! resolves the bind's source: a service manager may give tesserad a namespace of its own
//! (systemd does for `ProtectSystem=`) whose mounts never reach the host, and runc would
//! then bind the empty file underneath, on the state filesystem. A forked child enters
//! pid 1's namespace (`setns`, which a multi-threaded process cannot do for itself) and
//! makes them; tesserad sees them where its namespace receives the host's mounts.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// The tmpfs options: one page for the report and two inodes (its root and the file).
pub const OPTIONS: &std::ffi::CStr = c"size=4k,nr_inodes=2,mode=0700";
/// The most a report file can hold (bytes): what the kernel enforces through [`OPTIONS`].
pub const MAX_BYTES: u64 = 4096;
/// Mounts stacked on one path that a detach undoes at most.
const MAX_STACKED: usize = 16;
/// The mount namespace the mounts are made in.
const HOST_MNT_NS: &str = "/proc/1/ns/mnt";

fn cpath(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path holds a NUL byte"))
}

/// One step of a mount job, its strings made before the fork (the child allocates nothing).
#[derive(Debug)]
enum Op {
    /// The bounded tmpfs on a directory.
    Tmpfs(CString),
    /// A new regular file (not following a link) with exactly this mode.
    File(CString, libc::mode_t),
    /// Bind the first onto the second.
    Bind(CString, CString),
    /// Detach every mount stacked on it (none is fine).
    Detach(CString),
    /// Remove the file (none is fine).
    Unlink(CString),
    /// Remove the directory (none is fine).
    Rmdir(CString),
}

impl Op {
    fn describe(&self) -> String {
        let s = |c: &CString| c.to_string_lossy().into_owned();
        match self {
            Op::Tmpfs(t) => format!("mounting a tmpfs on {}", s(t)),
            Op::File(p, _) => format!("creating {}", s(p)),
            Op::Bind(a, b) => format!("binding {} onto {}", s(a), s(b)),
            Op::Detach(t) => format!("unmounting {}", s(t)),
            Op::Unlink(p) => format!("removing {}", s(p)),
            Op::Rmdir(p) => format!("removing {}", s(p)),
        }
    }

    /// Carry it out: 0, or the errno. Async-signal-safe (it runs in a forked child): raw
    /// syscalls on strings made before the fork, no allocation.
    fn run(&self) -> i32 {
        let errno = || io::Error::last_os_error().raw_os_error().unwrap_or(libc::EIO);
        let rc = |r: libc::c_int| if r == 0 { 0 } else { errno() };
        let none_is_fine = |e: i32| if e == libc::ENOENT { 0 } else { e };
        match self {
            Op::Tmpfs(t) => {
                let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
                let (fs, opts) = (c"tmpfs".as_ptr(), OPTIONS.as_ptr().cast());
                // SAFETY: NUL-terminated strings (`t` owned by `self`, the rest static)
                // alive across the call.
                rc(unsafe { libc::mount(fs, t.as_ptr(), fs, flags, opts) })
            }
            Op::File(p, mode) => {
                let flags = libc::O_WRONLY
                    | libc::O_CREAT
                    | libc::O_EXCL
                    | libc::O_NOFOLLOW
                    | libc::O_CLOEXEC;
                // SAFETY: `p` is a NUL-terminated string owned by `self`.
                let fd = unsafe { libc::open(p.as_ptr(), flags, *mode) };
                if fd < 0 {
                    return errno();
                }
                // SAFETY: `fd` is the descriptor just opened, ours alone.
                let e = rc(unsafe { libc::fchmod(fd, *mode) });
                // SAFETY: as above; not used after this.
                unsafe { libc::close(fd) };
                e
            }
            Op::Bind(a, b) => {
                let null = std::ptr::null();
                // SAFETY: `a` and `b` are NUL-terminated strings owned by `self`; the type
                // and data of a bind may be null.
                rc(unsafe { libc::mount(a.as_ptr(), b.as_ptr(), null, libc::MS_BIND, null.cast()) })
            }
            Op::Detach(t) => {
                for _ in 0..MAX_STACKED {
                    let flags = libc::MNT_DETACH | libc::UMOUNT_NOFOLLOW;
                    // SAFETY: `t` is a NUL-terminated string owned by `self`.
                    if unsafe { libc::umount2(t.as_ptr(), flags) } != 0 {
                        let e = errno();
                        return if e == libc::EINVAL { 0 } else { none_is_fine(e) };
                    }
                }
                0
            }
            // SAFETY: `p` is a NUL-terminated string owned by `self`.
            Op::Unlink(p) => none_is_fine(rc(unsafe { libc::unlink(p.as_ptr()) })),
            // SAFETY: `p` is a NUL-terminated string owned by `self`.
            Op::Rmdir(p) => none_is_fine(rc(unsafe { libc::rmdir(p.as_ptr()) })),
        }
    }
}

/// Carry out `ops` in order in a child in pid 1's mount namespace (tesserad's own where
/// pid 1's cannot be opened); the first that fails stops it, and is the error (what, and
/// the errno).
fn in_host_namespace(ops: &[Op]) -> io::Result<()> {
    // Where pid 1 is not ours to enter (a sandbox whose init hides its namespaces from
    // root), tesserad shares the namespace the engine runs in, or mounts nothing anyone
    // could use: its own namespace it is.
    let ns = match std::fs::File::open(HOST_MNT_NS) {
        Ok(f) => Some(f),
        Err(e) if e.kind() == io::ErrorKind::PermissionDenied => None,
        Err(e) => return Err(io::Error::new(e.kind(), format!("{HOST_MNT_NS}: {e}"))),
    };
    let ns_fd = ns.as_ref().map_or(-1, std::os::fd::AsRawFd::as_raw_fd);
    let mut pipe = [0i32; 2];
    // SAFETY: `pipe` is an array of two ints, as pipe2(2) writes.
    if unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the child only makes async-signal-safe syscalls on memory prepared before
    // the fork and ends with `_exit`; it never returns into Rust code.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: the child (see above): setns, the ops' syscalls, write, _exit.
        unsafe {
            let mut report = [-1i32, 0];
            if ns_fd >= 0 && libc::setns(ns_fd, libc::CLONE_NEWNS) != 0 {
                report[1] = *libc::__errno_location();
            } else {
                for (i, op) in ops.iter().enumerate() {
                    let e = op.run();
                    if e != 0 {
                        report = [i32::try_from(i).unwrap_or(i32::MAX), e];
                        break;
                    }
                }
            }
            let code = i32::from(report[1] != 0);
            if code != 0 {
                libc::write(pipe[1], report.as_ptr().cast(), std::mem::size_of_val(&report));
            }
            libc::_exit(code);
        }
    }
    let fork_error = (pid < 0).then(io::Error::last_os_error);
    // SAFETY: our end of the pipe's writer; closing it lets the read below see EOF.
    unsafe { libc::close(pipe[1]) };
    let mut report = [0i32; 2];
    let mut status = 0;
    if fork_error.is_none() {
        // SAFETY: reads at most the array's bytes into it; waits for our own child.
        unsafe {
            libc::read(pipe[0], report.as_mut_ptr().cast(), std::mem::size_of_val(&report));
            while libc::waitpid(pid, &mut status, 0) < 0
                && io::Error::last_os_error().raw_os_error() == Some(libc::EINTR)
            {}
        }
    }
    // SAFETY: our end of the pipe's reader, not used after this.
    unsafe { libc::close(pipe[0]) };
    if let Some(e) = fork_error {
        return Err(e);
    }
    if report[1] != 0 {
        let what = usize::try_from(report[0])
            .ok()
            .and_then(|i| ops.get(i))
            .map_or_else(|| format!("entering {HOST_MNT_NS}"), Op::describe);
        return Err(io::Error::new(
            io::Error::from_raw_os_error(report[1]).kind(),
            format!("{what}: {}", io::Error::from_raw_os_error(report[1])),
        ));
    }
    if !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        return Err(io::Error::other(format!("the mount helper ended with status {status}")));
    }
    Ok(())
}

/// The staging directory of `report` (`<state>/reports.stage/<id>`), beside the reports.
fn stage_of(report: &Path) -> io::Result<PathBuf> {
    let (Some(dir), Some(name)) = (report.parent(), report.file_name()) else {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "no directory or file name"));
    };
    let mut stage = dir.as_os_str().to_owned();
    stage.push(".stage");
    Ok(PathBuf::from(stage).join(name))
}

/// Make `report` the one file of a bounded tmpfs of its own, empty, writable by the
/// container's user (0666). Whatever was at `report` before (a stale mount, a file, a link)
/// is removed first; on an error nothing is left mounted.
pub fn create(report: &Path) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    let stage = stage_of(report)?;
    for dir in [report.parent(), Some(stage.as_path())].into_iter().flatten() {
        std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    }
    let (r, st, file) = (cpath(report)?, cpath(&stage)?, cpath(&stage.join("latency_ms"))?);
    let made = in_host_namespace(&[
        Op::Detach(r.clone()),
        Op::Unlink(r.clone()),
        Op::Detach(st.clone()),
        Op::Tmpfs(st.clone()),
        Op::File(file.clone(), 0o666),
        Op::File(r.clone(), 0o600),
        Op::Bind(file, r.clone()),
        Op::Detach(st.clone()),
        Op::Rmdir(st.clone()),
    ]);
    if made.is_err() {
        let _ = in_host_namespace(&[
            Op::Detach(r.clone()),
            Op::Unlink(r),
            Op::Detach(st.clone()),
            Op::Rmdir(st),
        ]);
    }
    made
}

/// Undo [`create`]: detach what is mounted at `report` and remove the file. Nothing there
/// is not an error.
pub fn remove(report: &Path) -> io::Result<()> {
    let r = cpath(report)?;
    in_host_namespace(&[Op::Detach(r.clone()), Op::Unlink(r)])
}

/// At startup: undo the report files in `dir` whose container `keep` does not name, and any
/// staging mount left by a crash in [`create`]. Returns what could not be removed.
pub fn sweep(dir: &Path, keep: impl Fn(&str) -> bool) -> Vec<String> {
    let mut failed = Vec::new();
    let stage = stage_of(&dir.join("x")).ok().and_then(|s| s.parent().map(Path::to_path_buf));
    for (d, staged) in [(Some(dir.to_path_buf()), false), (stage, true)] {
        let Some(d) = d else { continue };
        let Ok(entries) = std::fs::read_dir(&d) else { continue };
        for e in entries.flatten() {
            if !staged && e.file_name().to_str().is_some_and(&keep) {
                continue;
            }
            let p = e.path();
            let done = cpath(&p).and_then(|c| {
                let last = if staged { Op::Rmdir(c.clone()) } else { Op::Unlink(c.clone()) };
                in_host_namespace(&[Op::Detach(c), last])
            });
            if let Err(e) = done {
                failed.push(format!("{}: {e}", p.display()));
            }
        }
    }
    failed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root() -> bool {
        // SAFETY: geteuid(2) takes nothing and cannot fail.
        unsafe { libc::geteuid() == 0 }
    }

    #[test]
    fn a_report_file_holds_one_page_and_goes_without_a_trace() {
        if !root() {
            eprintln!("skipped: mounting a tmpfs needs root");
            return;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let reports = dir.path().join("reports");
        let report = reports.join("c1");
        create(&report).expect("create");
        // The kernel bounds it: the 2nd page is refused.
        let mut f = std::fs::OpenOptions::new().write(true).open(&report).expect("open");
        let e = std::io::Write::write_all(&mut f, &vec![b'7'; 3 * 4096]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
        drop(f);
        assert_eq!(std::fs::metadata(&report).expect("stat").len(), MAX_BYTES);
        use std::os::unix::fs::MetadataExt;
        assert_ne!(
            std::fs::metadata(&report).expect("stat").dev(),
            std::fs::metadata(dir.path()).expect("stat").dev(),
            "not on the state filesystem"
        );
        assert!(!dir.path().join("reports.stage/c1").exists(), "the staging mount is gone");
        // Made again (a stale one is replaced), and swept when no grant keeps it.
        create(&report).expect("again");
        assert_eq!(std::fs::metadata(&report).expect("stat").len(), 0);
        create(&reports.join("c2")).expect("c2");
        assert!(sweep(&reports, |id| id == "c2").is_empty());
        assert!(!report.exists() && reports.join("c2").exists());
        remove(&reports.join("c2")).expect("remove");
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
        assert!(!mounts.contains(&dir.path().display().to_string()), "{mounts}");
    }
}
