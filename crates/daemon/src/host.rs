//! The host, in one place: what tesserad reads of the machine it runs on — processes
//! (`/proc`), cgroups, runc's state root, the clock. [`Host`] is the seam; [`LinuxHost`]
//! reads the real machine; tests implement the trait over a fixture tree with the same
//! parsers ([`crate::liveness`]), so no code path asks "is this the real /proc?".

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};

use crate::liveness::{self, CgroupProcs};

/// What tesserad reads of the host.
pub trait Host: Send + Sync + fmt::Debug {
    /// Start time (clock ticks since boot) of `pid`, or `None` if it is not alive (a
    /// zombie counts as gone).
    fn pid_start_time(&self, pid: i32) -> Option<u64>;
    /// `pid` and every process descending from it.
    fn process_tree(&self, pid: i32) -> BTreeSet<u32>;
    /// The cgroup holding `pid`'s device rules, relative to the cgroup mount root, checked
    /// to list `pid` ([`liveness::container_cgroup`]).
    fn container_cgroup(&self, pid: i32) -> Result<String, String>;
    /// How many processes are in cgroup `rel` and below it.
    fn cgroup_procs(&self, rel: &str) -> CgroupProcs;
    /// Whether runc has a record of container `id` under `runc_root`.
    fn runc_state_exists(&self, runc_root: &Path, id: &str) -> bool {
        tessera_api::runc_state_exists(runc_root, id)
    }
    /// Unix milliseconds now.
    fn now_ms(&self) -> u64 {
        tessera_api::time::now_ms()
    }
    /// Whether the pids this host reports are this kernel's processes, so a pidfd can watch
    /// them exit (false for a fixture: its pids name nothing).
    fn watches_exits(&self) -> bool;
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
    fn pid_start_time(&self, pid: i32) -> Option<u64> {
        liveness::pid_start_time(Path::new(PROC_ROOT), pid)
    }
    fn process_tree(&self, pid: i32) -> BTreeSet<u32> {
        liveness::process_tree(Path::new(PROC_ROOT), pid)
    }
    fn container_cgroup(&self, pid: i32) -> Result<String, String> {
        liveness::container_cgroup(Path::new(PROC_ROOT), Path::new(CGROUP_ROOT), pid)
    }
    fn cgroup_procs(&self, rel: &str) -> CgroupProcs {
        liveness::cgroup_procs(Path::new(CGROUP_ROOT), rel)
    }
    fn watches_exits(&self) -> bool {
        true
    }
}

/// A host read from a directory tree laid out like the real one (`<dir>/proc/<pid>/stat`,
/// `<dir>/cgroup/<rel>/cgroup.procs`): for tests, and for running tesserad against a
/// recorded machine. Its pids are never watched with pidfds.
#[derive(Debug, Clone)]
pub struct TreeHost {
    pub proc_root: PathBuf,
    pub cgroup_root: PathBuf,
}

impl Host for TreeHost {
    fn pid_start_time(&self, pid: i32) -> Option<u64> {
        liveness::pid_start_time(&self.proc_root, pid)
    }
    fn process_tree(&self, pid: i32) -> BTreeSet<u32> {
        liveness::process_tree(&self.proc_root, pid)
    }
    fn container_cgroup(&self, pid: i32) -> Result<String, String> {
        liveness::container_cgroup(&self.proc_root, &self.cgroup_root, pid)
    }
    fn cgroup_procs(&self, rel: &str) -> CgroupProcs {
        liveness::cgroup_procs(&self.cgroup_root, rel)
    }
    fn watches_exits(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_real_host_sees_this_process() {
        let me = i32::try_from(std::process::id()).expect("pid fits");
        assert!(LinuxHost.pid_start_time(me).is_some());
        assert!(LinuxHost.process_tree(me).contains(&std::process::id()));
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
    }
}
