//! Which pid namespace a container's procfs mounts show, read from the kernel through the
//! container init's root (the effect beside [`crate::mountinfo::foreign_procfs`], which
//! judges). Used where a created container is checked before its process runs: tesserad's
//! confirmation of a GPU container, tessera-runtime's `start` of one without a GPU.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// `struct open_how` of openat2(2) (libc's is non-exhaustive: not built outside it).
#[repr(C)]
struct OpenHow {
    flags: u64,
    mode: u64,
    resolve: u64,
}

/// `readlink <proc_root>/<pid>/ns/pid` (`pid:[N]`): the pid namespace `pid` is in.
pub fn pid_namespace(proc_root: &Path, pid: i32) -> Option<String> {
    let link = std::fs::read_link(proc_root.join(pid.to_string()).join("ns/pid")).ok()?;
    Some(link.to_string_lossy().into_owned())
}

/// The pid namespace the procfs mounted at `mount_point` (as the container names it) in
/// the container whose init is `pid` shows: that of the pid 1 it lists. The mount point is
/// opened inside the init's root with no link followed (`openat2`, `RESOLVE_IN_ROOT |
/// RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS`), so a link planted on the way cannot lead
/// the reading to another procfs than the one mounted there. `None` where any of it cannot
/// be read (no such pid 1, an older kernel without `openat2`): the caller refuses.
pub fn shown_pid_namespace(proc_root: &Path, pid: i32, mount_point: &str) -> Option<String> {
    let root = std::fs::File::open(proc_root.join(pid.to_string()).join("root")).ok()?;
    let rel = mount_point.trim_start_matches('/');
    let rel =
        CString::new(Path::new(if rel.is_empty() { "." } else { rel }).as_os_str().as_bytes())
            .ok()?;
    let mut how = OpenHow {
        flags: (libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) as u64,
        mode: 0,
        resolve: libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS,
    };
    // The kernel answers EAGAIN where a mount or rename elsewhere raced a scoped lookup:
    // asked again a few times.
    let fd = (0..8).find_map(|_| {
        // SAFETY: openat2(2) with a directory descriptor we own for the call, a
        // NUL-terminated path that outlives it, and an `open_how` of the size passed; it
        // reads both and returns a new descriptor or -1, touching no other memory.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                root.as_raw_fd(),
                rel.as_ptr(),
                &mut how as *mut OpenHow,
                std::mem::size_of::<OpenHow>(),
            )
        };
        match i32::try_from(fd) {
            Ok(fd) if fd >= 0 => Some(Some(fd)),
            _ if std::io::Error::last_os_error().raw_os_error() == Some(libc::EAGAIN) => None,
            _ => Some(None),
        }
    })??;
    // SAFETY: `fd` was just returned by openat2 and is owned by nothing else.
    let dir = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut buf = [0u8; 64];
    // SAFETY: readlinkat(2) on a descriptor we own, a NUL-terminated literal path, and a
    // buffer whose length is passed; it writes at most that many bytes.
    let n = unsafe {
        libc::readlinkat(
            dir.as_raw_fd(),
            c"1/ns/pid".as_ptr(),
            buf.as_mut_ptr().cast::<libc::c_char>(),
            buf.len(),
        )
    };
    let n = usize::try_from(n).ok().filter(|n| *n > 0 && *n < buf.len())?;
    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This process's own /proc (its root is the host's here) shows what pid 1's link
    /// says (unreadable where pid 1 holds a capability this test does not: then both are
    /// `None`; tests/attack_round6.rs reads real containers, whose pid 1 is runc's init); a
    /// mount point that is not a procfs, or is reached through a link, shows nothing.
    #[test]
    fn the_procfs_at_proc_shows_the_namespace_of_its_pid_1() {
        let me = std::process::id() as i32;
        let proc = Path::new("/proc");
        let own = pid_namespace(proc, me).expect("own pid namespace");
        assert!(own.starts_with("pid:["), "{own}");
        assert_eq!(shown_pid_namespace(proc, me, "/proc"), pid_namespace(proc, 1));
        assert_eq!(shown_pid_namespace(proc, me, "/nonexistent"), None);
        assert_eq!(shown_pid_namespace(proc, me, "/sys"), None, "not a procfs");
        let dir = tempfile::tempdir().expect("tmp");
        let link = dir.path().join("p");
        std::os::unix::fs::symlink("/proc/self", &link).expect("link");
        // Through the link, pid 1 would be read as ... /proc/self/1 (none); the link itself
        // is refused before that.
        assert_eq!(shown_pid_namespace(proc, me, link.to_str().expect("utf-8")), None);
    }
}
