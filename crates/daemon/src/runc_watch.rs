//! A grant is given back the moment runc removes its container's record, whoever ran the
//! delete: tesserad watches runc's state roots (inotify) instead of waiting for the
//! wrapper to report the delete (issue 29: `tessera-runtime delete` is a plain exec of
//! runc, one fork and one round trip fewer on every container's teardown).
//!
//! runc removes `<root>/<id>/` last in a delete, after it killed the container's processes
//! and removed its cgroup. The kernel queues that removal on the root's watch before runc
//! exits, so it is queued before any caller can ask tesserad anything afterwards. The
//! controller drains the queue before every action it applies, so every answer given after
//! runc's delete returned already counts the grant as given back; and a task wakes it as
//! soon as the queue becomes readable (`crate::spawn_removals`), so the release's own work is done then,
//! not on the way of whatever action comes next. What is released, and when, is still judged by the
//! reconciler's rule ([`crate::liveness::judge`]) on what the host shows then: an event
//! only says which record to look at.
//!
//! Where inotify is not to be had, or its queue overflowed, the reconciler's pass does
//! it: later, never sooner.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Why a root cannot be watched.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("cannot start an inotify instance: {0}")]
    Init(io::Error),
    #[error("cannot watch runc's root {}: {source}", .root.display())]
    Add { root: PathBuf, source: io::Error },
    #[error("runc's root {} is not a path the kernel takes", .0.display())]
    Path(PathBuf),
    #[error("cannot read the inotify queue: {0}")]
    Read(io::Error),
    #[error("cannot duplicate the inotify descriptor: {0}")]
    Dup(io::Error),
}

/// What a drain of the queue found.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Removed {
    /// `(root, name)`: an entry of a watched root that was removed or moved away.
    pub entries: Vec<(PathBuf, String)>,
    /// Events were lost (the queue overflowed) or a watched root went away: every grant
    /// must be judged again.
    pub look_at_all: bool,
}

/// The watched roots of one inotify instance (non-blocking).
#[derive(Debug)]
pub struct RuncWatch {
    fd: OwnedFd,
    /// Every spelling of a watched root, by the kernel's watch of its directory. One
    /// directory reached by several paths (a symlink, as `/var/run` is of `/run`; a bind
    /// mount) has one watch: its removals are reported under every spelling, as each
    /// grant recorded its root by one of them.
    roots: BTreeMap<i32, Vec<PathBuf>>,
    /// Where the queue is read into: made once, as a drain runs before every answer.
    buf: Box<[u8]>,
}

const MASK: u32 = libc::IN_DELETE | libc::IN_MOVED_FROM | libc::IN_ONLYDIR;

impl RuncWatch {
    pub fn new() -> Result<RuncWatch, WatchError> {
        // SAFETY: a plain syscall with integer flags; it returns a new descriptor or -1.
        let fd = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if fd < 0 {
            return Err(WatchError::Init(io::Error::last_os_error()));
        }
        // SAFETY: `fd` was just opened by the kernel for us and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // Room for many events at once; each is a header and a NUL-padded name.
        Ok(RuncWatch { fd, roots: BTreeMap::new(), buf: vec![0u8; 64 * 1024].into_boxed_slice() })
    }

    /// Watch `root`. The kernel is asked each time, by path: the directory a spelling
    /// names is what the kernel resolves now (another spelling of a watched directory gets
    /// its watch, and is added to its spellings; a root replaced by a new directory of the
    /// same path gets a watch of its own), and a watch asked again is the same watch.
    pub fn watch(&mut self, root: &Path) -> Result<(), WatchError> {
        let c = CString::new(root.as_os_str().as_bytes())
            .map_err(|_| WatchError::Path(root.to_path_buf()))?;
        // SAFETY: `c` is a valid NUL-terminated path for the call's duration; the
        // descriptor is ours and open.
        let wd = unsafe { libc::inotify_add_watch(self.fd.as_raw_fd(), c.as_ptr(), MASK) };
        if wd < 0 {
            let source = io::Error::last_os_error();
            return Err(WatchError::Add { root: root.to_path_buf(), source });
        }
        // A spelling names one directory: the one it resolves to now.
        for (_, spellings) in self.roots.iter_mut().filter(|(w, _)| **w != wd) {
            spellings.retain(|r| r != root);
        }
        let spellings = self.roots.entry(wd).or_default();
        if !spellings.iter().any(|r| r == root) {
            spellings.push(root.to_path_buf());
        }
        Ok(())
    }

    /// Whether `root` is watched.
    pub fn watches(&self, root: &Path) -> bool {
        self.roots.values().flatten().any(|r| r == root)
    }

    /// A second descriptor of the same queue, for the task that waits until it is readable
    /// (`crate::spawn_removals`).
    pub fn readiness_fd(&self) -> Result<OwnedFd, WatchError> {
        self.fd.try_clone().map_err(WatchError::Dup)
    }

    /// Everything queued so far (never blocks).
    pub fn drain(&mut self) -> Result<Removed, WatchError> {
        let mut out = Removed::default();
        let mut buf = std::mem::take(&mut self.buf);
        let read = loop {
            // SAFETY: `buf` is valid for writes of its whole length; the descriptor is open.
            let n = unsafe {
                libc::read(self.fd.as_raw_fd(), buf.as_mut_ptr().cast::<libc::c_void>(), buf.len())
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                break match e.kind() {
                    io::ErrorKind::WouldBlock => Ok(out),
                    io::ErrorKind::Interrupted => continue,
                    _ => Err(WatchError::Read(e)),
                };
            }
            if n == 0 {
                break Ok(out);
            }
            self.parse(&buf[..n as usize], &mut out);
        };
        self.buf = buf;
        read
    }

    /// The events in `bytes` (whole events: the kernel never splits one across reads).
    fn parse(&mut self, bytes: &[u8], out: &mut Removed) {
        const HEADER: usize = std::mem::size_of::<libc::inotify_event>();
        let mut at = 0;
        while at + HEADER <= bytes.len() {
            let field = |off: usize| {
                let b = &bytes[at + off..at + off + 4];
                [b[0], b[1], b[2], b[3]]
            };
            // struct inotify_event { int wd; u32 mask; u32 cookie; u32 len; char name[]; }
            let wd = i32::from_ne_bytes(field(0));
            let mask = u32::from_ne_bytes(field(4));
            let len = u32::from_ne_bytes(field(12)) as usize;
            let name_bytes = bytes.get(at + HEADER..at + HEADER + len).unwrap_or_default();
            at += HEADER + len;
            if mask & libc::IN_Q_OVERFLOW != 0 {
                out.look_at_all = true;
                continue;
            }
            if mask & libc::IN_IGNORED != 0 {
                // The root itself went away (or was unmounted): its records with it.
                self.roots.remove(&wd);
                out.look_at_all = true;
                continue;
            }
            let Some(spellings) = self.roots.get(&wd) else { continue };
            let end = name_bytes.iter().position(|&b| b == 0).unwrap_or(name_bytes.len());
            if let Ok(name) = std::str::from_utf8(&name_bytes[..end]) {
                if !name.is_empty() {
                    out.entries.extend(spellings.iter().map(|r| (r.clone(), name.to_string())));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_removed_record_directory_is_reported_with_its_root() {
        let dir = tempfile::tempdir().expect("tmp");
        let root = dir.path().join("runc");
        std::fs::create_dir_all(root.join("c1")).expect("mkdir");
        std::fs::create_dir_all(root.join("c2")).expect("mkdir");
        std::fs::write(root.join("c1/state.json"), "{}").expect("state");
        let mut w = RuncWatch::new().expect("inotify");
        w.watch(&root).expect("watch");
        w.watch(&root).expect("twice is once");
        assert_eq!(w.drain().expect("drain"), Removed::default(), "nothing yet");
        std::fs::remove_dir_all(root.join("c1")).expect("rm");
        std::fs::rename(root.join("c2"), dir.path().join("away")).expect("mv");
        // A file inside a record, and a new record, are not removals of a record.
        std::fs::create_dir_all(root.join("c3")).expect("mkdir");
        let got = w.drain().expect("drain");
        assert_eq!(
            got.entries,
            vec![(root.clone(), "c1".to_string()), (root.clone(), "c2".to_string())]
        );
        assert!(!got.look_at_all);
        assert_eq!(w.drain().expect("drain"), Removed::default(), "drained");
    }

    #[test]
    fn a_root_reached_by_two_paths_reports_its_removals_under_both() {
        let dir = tempfile::tempdir().expect("tmp");
        let root = dir.path().join("runc");
        let link = dir.path().join("link");
        std::fs::create_dir_all(root.join("c1")).expect("mkdir");
        std::os::unix::fs::symlink(&root, &link).expect("symlink");
        let mut w = RuncWatch::new().expect("inotify");
        w.watch(&root).expect("watch");
        w.watch(&link).expect("watch the other spelling");
        assert!(w.watches(&root) && w.watches(&link));
        std::fs::remove_dir(root.join("c1")).expect("rm");
        let got = w.drain().expect("drain");
        assert_eq!(got.entries, vec![(root.clone(), "c1".into()), (link.clone(), "c1".into())]);
    }

    #[test]
    fn a_root_replaced_by_a_new_directory_is_watched_again() {
        let dir = tempfile::tempdir().expect("tmp");
        let root = dir.path().join("runc");
        let old = dir.path().join("old");
        std::fs::create_dir_all(&root).expect("mkdir");
        let mut w = RuncWatch::new().expect("inotify");
        w.watch(&root).expect("watch");
        std::fs::rename(&root, &old).expect("mv");
        std::fs::create_dir_all(root.join("new1")).expect("the new root");
        std::fs::create_dir_all(old.join("old1")).expect("mkdir");
        w.watch(&root).expect("watch the new root");
        std::fs::remove_dir(root.join("new1")).expect("rm");
        // The old directory is no longer what the spelling names.
        std::fs::remove_dir(old.join("old1")).expect("rm");
        assert_eq!(w.drain().expect("drain").entries, vec![(root.clone(), "new1".into())]);
    }

    #[test]
    fn a_queue_that_overflowed_asks_for_a_look_at_everything() {
        let max: usize = std::fs::read_to_string("/proc/sys/fs/inotify/max_queued_events")
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(16384);
        if max > 100_000 {
            return; // a host raised it past what a unit test should make
        }
        let dir = tempfile::tempdir().expect("tmp");
        let root = dir.path().join("runc");
        std::fs::create_dir_all(&root).expect("mkdir");
        for i in 0..=max {
            std::fs::create_dir(root.join(i.to_string())).expect("mkdir");
        }
        let mut w = RuncWatch::new().expect("inotify");
        w.watch(&root).expect("watch");
        for i in 0..=max {
            std::fs::remove_dir(root.join(i.to_string())).expect("rmdir");
        }
        let got = w.drain().expect("drain");
        assert!(got.look_at_all, "{} removals and no overflow seen", max + 1);
        assert!(got.entries.len() <= max);
        assert!(w.watches(&root), "an overflow keeps the watch");
    }

    #[test]
    fn a_root_that_goes_away_asks_for_a_look_at_everything() {
        let dir = tempfile::tempdir().expect("tmp");
        let root = dir.path().join("runc");
        std::fs::create_dir_all(&root).expect("mkdir");
        let mut w = RuncWatch::new().expect("inotify");
        w.watch(&root).expect("watch");
        std::fs::remove_dir(&root).expect("rmdir");
        assert!(w.drain().expect("drain").look_at_all);
        assert!(!w.watches(&root));
        let missing = dir.path().join("never");
        assert!(matches!(w.watch(&missing), Err(WatchError::Add { .. })));
    }
}
