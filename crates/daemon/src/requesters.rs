//! The process that asked for a grant, watched until the grant is confirmed (issue 29).
//!
//! tessera-runtime asks for a grant, rewrites the bundle's config and then *execs* runc
//! (`runc create`, `runc run`): it is no longer runc's parent, waiting to give the grant
//! back when runc refuses the container. tesserad does that instead. At the grant it keeps
//! a pidfd of the process on the other end of the API socket (the kernel's
//! `SO_PEERPIDFD`, or `pidfd_open` of its `SO_PEERCRED` pid on kernels before 6.5): the
//! wrapper, which becomes runc by the exec, so the pidfd becomes readable when runc exits.
//! runc writes a container's record (`state.json`) before its create or run returns, and
//! removes what it made when it fails, so once every process that asked for a grant not
//! yet confirmed has exited, runc's record says all: none, and nothing can start with the
//! grant — it is given back ([`crate::liveness::judge`]); one, and the grant waits for the
//! confirmation at `start` or for runc's delete of the record.
//!
//! A requester tesserad cannot watch (no pidfd, a pid of another pid namespace) changes
//! nothing: the grant is kept for the pending grace, as before. A watch that names the
//! wrong process (a pid reused before `pidfd_open`: only without `SO_PEERPIDFD`) can only
//! tell of an exit after the requester's own, which had already ended the create.
//!
//! State is this process's memory. A restarted tesserad counts a grant not yet confirmed
//! whose container runc has a record of as asked for by processes that all exited (runc
//! writes the record at the end of its create), at its start and at every reconciler pass
//! (a create in flight across the restart that finished since); one without a record (a
//! create in flight, or one deleted while tesserad was down) falls back on the grace, which
//! the watch shortens, not replaces.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use tessera_api::ContainerId;

/// `SO_PEERPIDFD` (Linux 6.5; the generic and x86 value): a pidfd of the peer that
/// connected, taken by the kernel at `connect`, so it cannot name a later process.
const SO_PEERPIDFD: libc::c_int = 77;

/// Why the requesters cannot be watched.
#[derive(Debug, thiserror::Error)]
pub enum RequesterError {
    #[error("cannot start an epoll instance for the requesters: {0}")]
    Init(io::Error),
    #[error("cannot watch the requester of container {id}: {source}")]
    Add { id: ContainerId, source: io::Error },
    #[error("cannot read the requesters' epoll queue: {0}")]
    Wait(io::Error),
    #[error("cannot duplicate the requesters' epoll descriptor: {0}")]
    Dup(io::Error),
}

/// A pidfd of the process on the other end of an API connection.
pub fn peer_pidfd(socket: RawFd, pid: Option<i32>) -> Option<OwnedFd> {
    let mut fd: libc::c_int = -1;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `fd`, a c_int that lives for the
    // call; `socket` is the caller's open descriptor.
    let r = unsafe {
        libc::getsockopt(
            socket,
            libc::SOL_SOCKET,
            SO_PEERPIDFD,
            (&mut fd as *mut libc::c_int).cast::<libc::c_void>(),
            &mut len,
        )
    };
    if r == 0 && fd >= 0 {
        // SAFETY: the kernel just gave us this descriptor; nothing else owns it.
        return Some(unsafe { OwnedFd::from_raw_fd(fd) });
    }
    // Before Linux 6.5: the pid, as the kernel translated it into our pid namespace (0
    // where the peer is not visible in it).
    crate::host::pidfd_open(pid.filter(|p| *p > 0)?).ok()
}

/// The requesters of one grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Grant {
    /// The grant's `created_ms`: an id granted again is another grant.
    created_ms: u64,
    /// Requesters still running.
    live: u32,
}

/// The requesters of the grants not yet confirmed, each a pidfd in one epoll set.
#[derive(Debug)]
pub struct Requesters {
    epoll: OwnedFd,
    /// By epoll token: the grant's id, its `created_ms`, the pidfd.
    watched: BTreeMap<u64, (ContainerId, u64, OwnedFd)>,
    grants: BTreeMap<ContainerId, Grant>,
    next: u64,
}

impl Requesters {
    pub fn new() -> Result<Self, RequesterError> {
        // SAFETY: epoll_create1 takes a flag and returns a new descriptor or -1.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(RequesterError::Init(io::Error::last_os_error()));
        }
        // SAFETY: the descriptor is new and ours alone.
        let epoll = unsafe { OwnedFd::from_raw_fd(fd) };
        Ok(Requesters { epoll, watched: BTreeMap::new(), grants: BTreeMap::new(), next: 0 })
    }

    /// Watch `pidfd`, a requester of grant `id` made at `created_ms`. A requester that
    /// has already exited is reported by the next [`Requesters::drain`].
    pub fn watch(
        &mut self,
        id: &ContainerId,
        created_ms: u64,
        pidfd: OwnedFd,
    ) -> Result<(), RequesterError> {
        if self.grants.get(id).is_some_and(|g| g.created_ms != created_ms) {
            self.forget(id);
        }
        let token = self.next;
        self.next += 1;
        let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: token };
        // SAFETY: both descriptors are open; `ev` is valid for the call.
        let r = unsafe {
            libc::epoll_ctl(self.epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, pidfd.as_raw_fd(), &mut ev)
        };
        if r < 0 {
            let source = io::Error::last_os_error();
            return Err(RequesterError::Add { id: id.clone(), source });
        }
        self.watched.insert(token, (id.clone(), created_ms, pidfd));
        self.grants.entry(id.clone()).or_insert(Grant { created_ms, live: 0 }).live += 1;
        Ok(())
    }

    /// Stop watching the requesters of `id` (its grant was confirmed or ended).
    pub fn forget(&mut self, id: &ContainerId) {
        if self.grants.remove(id).is_none() {
            return;
        }
        let tokens: Vec<u64> =
            self.watched.iter().filter(|(_, (i, _, _))| i == id).map(|(t, _)| *t).collect();
        for t in tokens {
            self.unwatch(t);
        }
    }

    fn unwatch(&mut self, token: u64) -> Option<(ContainerId, u64)> {
        let (id, created_ms, fd) = self.watched.remove(&token)?;
        // SAFETY: both descriptors are open; a null event is allowed for EPOLL_CTL_DEL.
        unsafe {
            libc::epoll_ctl(
                self.epoll.as_raw_fd(),
                libc::EPOLL_CTL_DEL,
                fd.as_raw_fd(),
                std::ptr::null_mut(),
            )
        };
        Some((id, created_ms))
    }

    /// The grants whose every requester has exited since the last drain: `(id,
    /// created_ms)`. Never blocks.
    pub fn drain(&mut self) -> Result<Vec<(ContainerId, u64)>, RequesterError> {
        let mut out = Vec::new();
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 32];
        loop {
            // SAFETY: `events` is valid for writes of its whole length; the descriptor is
            // open; a timeout of 0 never blocks.
            let n = unsafe {
                libc::epoll_wait(
                    self.epoll.as_raw_fd(),
                    events.as_mut_ptr(),
                    events.len() as i32,
                    0,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(RequesterError::Wait(e));
            }
            let n = n as usize;
            for ev in &events[..n] {
                let token = ev.u64;
                let Some((id, created_ms)) = self.unwatch(token) else { continue };
                let Some(g) = self.grants.get_mut(&id).filter(|g| g.created_ms == created_ms)
                else {
                    continue;
                };
                g.live = g.live.saturating_sub(1);
                if g.live == 0 {
                    out.push((id, created_ms));
                }
            }
            if n < events.len() {
                return Ok(out);
            }
        }
    }

    /// Counts grant `id` made at `created_ms` as asked for by processes that all exited:
    /// a tesserad started after its create finished (runc's record exists).
    pub fn mark_exited(&mut self, id: &ContainerId, created_ms: u64) {
        if self.grants.get(id).is_some_and(|g| g.created_ms == created_ms) {
            return;
        }
        self.forget(id);
        self.grants.insert(id.clone(), Grant { created_ms, live: 0 });
    }

    /// What is known of the requesters of grant `id` made at `created_ms`.
    pub fn state(&self, id: &ContainerId, created_ms: u64) -> crate::liveness::Requester {
        use crate::liveness::Requester;
        match self.grants.get(id).filter(|g| g.created_ms == created_ms) {
            None => Requester::Unknown,
            Some(g) if g.live > 0 => Requester::Running,
            Some(_) => Requester::Exited,
        }
    }

    /// A second descriptor of the epoll set, readable when a requester exited (for the
    /// task that wakes the controller).
    pub fn readiness_fd(&self) -> Result<OwnedFd, RequesterError> {
        self.epoll.try_clone().map_err(RequesterError::Dup)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::liveness::Requester;
    use std::process::{Command, Stdio};

    fn pidfd_of(child: &std::process::Child) -> OwnedFd {
        crate::host::pidfd_open(i32::try_from(child.id()).expect("pid")).expect("pidfd_open")
    }

    fn id(s: &str) -> ContainerId {
        ContainerId::new(s).expect("id")
    }

    #[test]
    fn a_grant_is_reported_once_every_requester_has_exited() {
        let mut w = Requesters::new().expect("epoll");
        let mut a = Command::new("cat").stdin(Stdio::piped()).spawn().expect("cat");
        let mut b = Command::new("cat").stdin(Stdio::piped()).spawn().expect("cat");
        w.watch(&id("c"), 7, pidfd_of(&a)).expect("watch a");
        w.watch(&id("c"), 7, pidfd_of(&b)).expect("watch b");
        assert!(w.drain().expect("drain").is_empty(), "both run");
        drop(a.stdin.take());
        a.wait().expect("a exits");
        assert!(w.drain().expect("drain").is_empty(), "b still runs");
        assert_eq!(w.state(&id("c"), 7), Requester::Running);
        drop(b.stdin.take());
        b.wait().expect("b exits");
        assert_eq!(w.drain().expect("drain"), vec![(id("c"), 7)]);
        assert_eq!(w.state(&id("c"), 7), Requester::Exited);
        assert_eq!(w.state(&id("c"), 8), Requester::Unknown, "another grant of the id");
        assert!(w.drain().expect("drain").is_empty(), "reported once");
        w.forget(&id("c"));
        assert_eq!(w.state(&id("c"), 7), Requester::Unknown);
    }

    #[test]
    fn an_exit_before_the_watch_is_seen_and_a_forgotten_grant_is_not() {
        let mut w = Requesters::new().expect("epoll");
        let mut gone = Command::new("true").spawn().expect("true");
        let fd = pidfd_of(&gone);
        gone.wait().expect("exits");
        w.watch(&id("early"), 1, fd).expect("watch");
        let mut c = Command::new("true").spawn().expect("true");
        w.watch(&id("confirmed"), 2, pidfd_of(&c)).expect("watch");
        w.forget(&id("confirmed"));
        c.wait().expect("exits");
        assert_eq!(w.drain().expect("drain"), vec![(id("early"), 1)]);
    }

    #[test]
    fn the_id_granted_again_replaces_the_old_grants_requesters() {
        let mut w = Requesters::new().expect("epoll");
        let mut old = Command::new("cat").stdin(Stdio::piped()).spawn().expect("cat");
        w.watch(&id("c"), 1, pidfd_of(&old)).expect("watch");
        let mut new = Command::new("true").spawn().expect("true");
        w.watch(&id("c"), 2, pidfd_of(&new)).expect("watch");
        new.wait().expect("exits");
        drop(old.stdin.take());
        old.wait().expect("exits");
        assert_eq!(w.drain().expect("drain"), vec![(id("c"), 2)]);
    }

    #[test]
    fn a_grant_marked_exited_counts_so_until_asked_again() {
        let mut w = Requesters::new().expect("epoll");
        w.mark_exited(&id("c"), 3);
        assert_eq!(w.state(&id("c"), 3), Requester::Exited);
        let mut again = Command::new("cat").stdin(Stdio::piped()).spawn().expect("cat");
        w.watch(&id("c"), 3, pidfd_of(&again)).expect("watch");
        assert_eq!(w.state(&id("c"), 3), Requester::Running, "a create of the same id runs again");
        drop(again.stdin.take());
        again.wait().expect("exits");
        assert_eq!(w.drain().expect("drain"), vec![(id("c"), 3)]);
    }

    #[test]
    fn a_unix_peer_is_named_by_its_pidfd() {
        let (a, b) = std::os::unix::net::UnixStream::pair().expect("pair");
        let fd = peer_pidfd(a.as_raw_fd(), Some(std::process::id() as i32)).expect("pidfd");
        // The peer is this process: its pidfd is not readable while it runs.
        let mut w = Requesters::new().expect("epoll");
        w.watch(&id("me"), 1, fd).expect("watch");
        assert!(w.drain().expect("drain").is_empty());
        drop(b);
    }
}
