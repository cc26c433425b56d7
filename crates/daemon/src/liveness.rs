//! Is a container still there? Pure judgement over facts read from the host (`/proc`,
//! runc's state root, the cgroup filesystem), with every host path a parameter.
//!
//! A running container's grant ends only when runc no longer has the container *and* no
//! process is left in its cgroup: its init exiting is not enough. A container without its
//! own pid namespace (a pod member sharing the pod's) can leave a worker running after
//! its init exits, and runc keeps the container's device cgroup rules until `runc delete`;
//! giving its GPU to another tenant then would share it with that worker.

use std::path::{Path, PathBuf};

use tessera_api::AllocationState;

/// What the reconciler concluded about one allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Liveness {
    Alive,
    Gone(String),
}

/// Facts about one allocation's container, read from the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Facts {
    /// Whether `<runc_root>/<id>/state.json` exists.
    pub runc_state_exists: bool,
    /// The start time of the recorded pid now, if that pid is alive.
    pub pid_start_now: Option<u64>,
    /// The processes in the container's recorded cgroup.
    pub cgroup: CgroupProcs,
    /// Milliseconds since the allocation was granted.
    pub age_ms: u64,
    /// What is known of the processes that asked for the grant ([`crate::requesters`]).
    pub requester: Requester,
}

/// The processes that asked for a grant not yet confirmed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Requester {
    /// Not watched (no pidfd; a tesserad started since, and runc has no record).
    Unknown,
    /// One still runs: its `runc create` or `run` is under way.
    Running,
    /// Every one has exited: whatever runc made of the create is on record.
    Exited,
}

/// What the container's cgroup holds now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CgroupProcs {
    /// No cgroup was recorded: a grant not started yet, or recorded by a tesserad of
    /// store schema 1 whose init was gone before its cgroup could be filled in.
    NotRecorded,
    /// How many processes are in it and in the cgroups below it (0 when it is gone).
    Count(usize),
    /// It could not be read (not "gone": nothing is concluded from it).
    Unreadable(String),
}

/// Decide whether an allocation's container is gone.
///
/// - Running: alive while runc has the container in its root, or a process is left in its
///   cgroup (or below it), or the cgroup cannot be read, or its init pid lives with the
///   recorded start time (a recycled pid has another start time). Gone only when none of
///   these holds. A grant with no recorded cgroup (schema 1) is gone when runc has no
///   container and its init has exited.
/// - Pending (granted, not yet confirmed by the prestart hook or the wrapper's `start`):
///   alive while runc knows the container, or while a process is in the cgroup a refused
///   start recorded (or that cgroup cannot be read); gone once every process that asked for it has
///   exited and runc does not know it ([`crate::requesters`]: runc's create or run, which
///   the wrapper became, is over and made nothing), alive while one of them runs; where
///   they are not known, alive while younger than `grace_ms`. runc (1.1) writes `state.json` only
///   after the prestart hooks ran, so during a create (our answer, runc's set-up, the
///   hook's confirm) only the grace keeps the grant: it must outlast the slowest create
///   (tesserad's default is 60 s).
pub fn judge(
    state: AllocationState,
    recorded_pid_start: Option<u64>,
    facts: &Facts,
    grace_ms: u64,
) -> Liveness {
    match state {
        AllocationState::Running => {
            let init_alive = match (facts.pid_start_now, recorded_pid_start) {
                (Some(now), Some(then)) => now == then,
                (Some(_), None) => true,
                (None, _) => false,
            };
            if facts.runc_state_exists || init_alive {
                return Liveness::Alive;
            }
            let recycled = if facts.pid_start_now.is_some() {
                " (its pid now names another process)"
            } else {
                ""
            };
            match &facts.cgroup {
                CgroupProcs::Count(0) => Liveness::Gone(format!(
                    "runc no longer has the container, its init exited{recycled} and no process is left in its cgroup"
                )),
                CgroupProcs::Count(_) | CgroupProcs::Unreadable(_) => Liveness::Alive,
                CgroupProcs::NotRecorded => Liveness::Gone(format!(
                    "runc no longer has the container and its init exited{recycled} (no cgroup recorded)"
                )),
            }
        }
        AllocationState::Pending => {
            // A cgroup is recorded on a pending grant when its start was refused: runc
            // wrote the grant's device rules into it at the create, and a process still in
            // it (another container's, sharing it) keeps them.
            let cgroup_held = matches!(facts.cgroup, CgroupProcs::Count(n) if n > 0)
                || matches!(facts.cgroup, CgroupProcs::Unreadable(_));
            if facts.runc_state_exists || cgroup_held {
                return Liveness::Alive;
            }
            match facts.requester {
                Requester::Exited => {
                    return Liveness::Gone(
                        "the runtime that asked for it exited and runc has no record of the \
                         container"
                            .to_string(),
                    )
                }
                Requester::Running => return Liveness::Alive,
                Requester::Unknown => {}
            }
            if facts.age_ms < grace_ms {
                Liveness::Alive
            } else {
                Liveness::Gone(format!(
                    "container never started and runc does not know it after {} s",
                    facts.age_ms / 1000
                ))
            }
        }
    }
}

/// The cgroup of `pid` that holds its device rules, relative to the cgroup mount root:
/// `<controllers>/<path>` from the line of `/proc/<pid>/cgroup` naming the `devices`
/// controller (cgroup v1), else `<path>` from the `0::` line (v2). Checked, not assumed:
/// a cgroup name may contain a newline, which would forge a line of that file, so the
/// answer stands only if `pid` is listed in that cgroup's `cgroup.procs` under
/// `cgroup_root`.
pub fn container_cgroup(proc_root: &Path, cgroup_root: &Path, pid: i32) -> Result<String, String> {
    let file = proc_root.join(pid.to_string()).join("cgroup");
    let text = std::fs::read_to_string(&file)
        .map_err(|e| format!("cannot read {}: {e}", file.display()))?;
    let rel = parse_proc_cgroup(&text)?;
    let procs = cgroup_root.join(&rel).join("cgroup.procs");
    let listed = std::fs::read_to_string(&procs)
        .map_err(|e| format!("cannot read {}: {e}", procs.display()))?;
    if !listed.lines().any(|l| l.trim().parse::<i32>() == Ok(pid)) {
        return Err(format!(
            "pid {pid} is not in {} (its cgroup is not what {} says)",
            procs.display(),
            file.display()
        ));
    }
    Ok(rel)
}

/// The device-rule cgroup in a `/proc/<pid>/cgroup` text (see [`container_cgroup`]).
pub use tessera_api::cgroup::parse_proc_cgroup;

/// The processes in cgroup `rel` under `cgroup_root` and in every cgroup below it (none
/// for a cgroup that cannot be read).
pub fn cgroup_pids(cgroup_root: &Path, rel: &str) -> Vec<i32> {
    let mut todo: Vec<PathBuf> = vec![cgroup_root.join(rel)];
    let mut out = Vec::new();
    while let Some(dir) = todo.pop() {
        if let Ok(text) = std::fs::read_to_string(dir.join("cgroup.procs")) {
            out.extend(text.lines().filter_map(|l| l.trim().parse::<i32>().ok()));
        }
        if let Ok(entries) = std::fs::read_dir(&dir) {
            todo.extend(
                entries
                    .flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path()),
            );
        }
    }
    out
}

/// How many processes are in the cgroup `rel` under `cgroup_root` and in every cgroup
/// below it (a process in a child cgroup keeps the parent's device rules). A cgroup that
/// no longer exists holds none.
pub fn cgroup_procs(cgroup_root: &Path, rel: &str) -> CgroupProcs {
    let top = cgroup_root.join(rel);
    let mut todo: Vec<PathBuf> = vec![top.clone()];
    let mut count = 0;
    while let Some(dir) = todo.pop() {
        match std::fs::read_to_string(dir.join("cgroup.procs")) {
            Ok(text) => count += text.lines().filter(|l| !l.trim().is_empty()).count(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if dir == top && top.exists() {
                    return CgroupProcs::Unreadable(format!(
                        "{} has no cgroup.procs",
                        top.display()
                    ));
                }
                continue; // gone (or a child removed while we looked)
            }
            Err(e) => {
                return CgroupProcs::Unreadable(format!(
                    "{}: {e}",
                    dir.join("cgroup.procs").display()
                ))
            }
        }
        if let Ok(entries) = std::fs::read_dir(&dir) {
            todo.extend(
                entries
                    .flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path()),
            );
        }
    }
    CgroupProcs::Count(count)
}

/// Start time (clock ticks since boot, field 22) of `pid`, or None if it is not alive.
pub fn pid_start_time(proc_root: &Path, pid: i32) -> Option<u64> {
    if pid <= 0 {
        return None;
    }
    let stat = std::fs::read_to_string(proc_root.join(pid.to_string()).join("stat")).ok()?;
    parse_start_time(&stat)
}

/// Parse field 22 of a /proc/PID/stat line. The command name (field 2) is in parentheses
/// and may itself contain spaces and parentheses, so fields are counted after the last ')'.
pub fn parse_start_time(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?;
    if state == "Z" || state == "X" {
        return None; // a zombie holds no GPU
    }
    // `state` was field 3; start time is field 22, i.e. 18 further on.
    fields.nth(18)?.parse().ok()
}

/// The processes of a container, for telemetry and per-process metering alike: every
/// process in its grant's recorded `cgroup` and the cgroups below it (what runc put there:
/// its init, the init's descendants and the processes `runc exec` started, which descend
/// from no process of the container), read from `cgroup_root`; a grant recorded without
/// its cgroup (none is read before prestart) falls back to the init's process tree.
pub fn container_processes(
    proc_root: &Path,
    cgroup_root: &Path,
    init: Option<i32>,
    cgroup: Option<&str>,
) -> std::collections::BTreeSet<u32> {
    match (cgroup, init) {
        (Some(rel), _) => cgroup_pids(cgroup_root, rel)
            .into_iter()
            .filter_map(|p| u32::try_from(p).ok())
            .collect(),
        (None, Some(pid)) => process_tree(proc_root, pid),
        (None, None) => std::collections::BTreeSet::new(),
    }
}

/// `pid` and every process descending from it (a container's processes, from its init),
/// read from `proc_root`.
pub fn process_tree(proc_root: &Path, pid: i32) -> std::collections::BTreeSet<u32> {
    let mut children: std::collections::BTreeMap<u32, Vec<u32>> = std::collections::BTreeMap::new();
    if let Ok(entries) = std::fs::read_dir(proc_root) {
        for e in entries.flatten() {
            let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { continue };
            if let Some(ppid) = parse_ppid(&stat) {
                children.entry(ppid).or_default().push(p);
            }
        }
    }
    let mut out = std::collections::BTreeSet::new();
    let Ok(root) = u32::try_from(pid) else { return out };
    let mut todo = vec![root];
    while let Some(p) = todo.pop() {
        if out.insert(p) {
            todo.extend(children.get(&p).into_iter().flatten().copied());
        }
    }
    out
}

/// Field 4 (ppid) of a /proc/PID/stat line, counted after the command name's last ')'.
pub fn parse_ppid(stat: &str) -> Option<u32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_ascii_whitespace().nth(1)?.parse().ok()
}

pub use tessera_api::runc_state_exists;

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(state: bool, pid: Option<u64>, age: u64) -> Facts {
        Facts {
            runc_state_exists: state,
            pid_start_now: pid,
            cgroup: CgroupProcs::NotRecorded,
            age_ms: age,
            requester: Requester::Unknown,
        }
    }

    fn running(pid_now: Option<u64>, runc: bool, cgroup: CgroupProcs) -> Liveness {
        let f = Facts {
            runc_state_exists: runc,
            pid_start_now: pid_now,
            cgroup,
            age_ms: 10_000_000,
            requester: Requester::Exited,
        };
        judge(AllocationState::Running, Some(5), &f, 1000)
    }

    #[test]
    fn running_ends_only_when_runc_has_no_container_and_the_cgroup_is_empty() {
        use CgroupProcs::{Count, Unreadable};
        // Init alive with its start time: alive, whatever else.
        assert_eq!(running(Some(5), false, Count(0)), Liveness::Alive);
        // Init exited, runc still has the container (stopped, not deleted): alive.
        assert_eq!(running(None, true, Count(0)), Liveness::Alive);
        assert_eq!(running(Some(9), true, Count(0)), Liveness::Alive);
        // Init exited, a worker left in the cgroup (shared pid namespace): alive, with or
        // without runc's record.
        assert_eq!(running(None, true, Count(1)), Liveness::Alive);
        assert_eq!(running(None, false, Count(3)), Liveness::Alive);
        assert_eq!(running(Some(9), false, Count(1)), Liveness::Alive);
        // The cgroup cannot be read: nothing is concluded.
        assert_eq!(running(None, false, Unreadable("EACCES".into())), Liveness::Alive);
        // No runc record, no process in the cgroup: gone (a recycled pid is not the init).
        assert!(
            matches!(running(None, false, Count(0)), Liveness::Gone(m) if m.contains("no process is left"))
        );
        assert!(
            matches!(running(Some(9), false, Count(0)), Liveness::Gone(m) if m.contains("another process"))
        );
    }

    #[test]
    fn running_without_a_recorded_cgroup_follows_runc_and_the_init() {
        assert_eq!(
            judge(AllocationState::Running, Some(5), &facts(true, Some(5), 0), 1000),
            Liveness::Alive
        );
        assert_eq!(
            judge(AllocationState::Running, Some(5), &facts(true, None, 0), 1000),
            Liveness::Alive
        );
        assert_eq!(
            judge(AllocationState::Running, None, &facts(false, Some(7), 0), 1000),
            Liveness::Alive
        );
        assert!(
            matches!(judge(AllocationState::Running, Some(5), &facts(false, Some(9), 0), 1000), Liveness::Gone(m) if m.contains("another process"))
        );
        assert!(
            matches!(judge(AllocationState::Running, Some(5), &facts(false, None, 0), 1000), Liveness::Gone(m) if m.contains("no cgroup recorded"))
        );
    }

    #[test]
    fn finds_the_device_cgroup_in_proc_cgroup() {
        let v1 = "12:pids:/k8s/c1\n5:devices:/k8s/c1\n4:cpu,cpuacct:/k8s/c1\n1:name=systemd:/k8s/c1\n0::/\n";
        assert_eq!(parse_proc_cgroup(v1), Ok("devices/k8s/c1".into()));
        assert_eq!(parse_proc_cgroup("3:devices,freezer:/x\n"), Ok("devices,freezer/x".into()));
        assert_eq!(
            parse_proc_cgroup("0::/system.slice/c1.scope\n"),
            Ok("system.slice/c1.scope".into())
        );
        assert_eq!(parse_proc_cgroup("5:devices:/\n"), Ok("devices/".into()));
        // A newline in a cgroup name forges lines: two devices lines are refused.
        let forged = "5:devices:/a\n5:devices:/elsewhere\n4:memory:/a\n5:devices:/elsewhere\n";
        assert!(parse_proc_cgroup(forged).is_err());
        assert!(parse_proc_cgroup("0::/a\n0::/b\n").is_err());
        assert!(parse_proc_cgroup("").is_err());
        assert!(parse_proc_cgroup("5:devices:/../../etc\n").is_err());
    }

    #[test]
    fn the_cgroup_must_hold_the_pid_it_was_read_for() {
        let d = tempfile::tempdir().expect("tmp");
        let (proc_root, cg_root) = (d.path().join("proc"), d.path().join("cgroup"));
        std::fs::create_dir_all(proc_root.join("42")).expect("mkdir");
        std::fs::create_dir_all(cg_root.join("devices/k8s/c1/sub")).expect("mkdir");
        std::fs::write(proc_root.join("42/cgroup"), "5:devices:/k8s/c1\n0::/\n").expect("write");
        std::fs::write(cg_root.join("devices/k8s/c1/cgroup.procs"), "7\n").expect("write");
        std::fs::write(cg_root.join("devices/k8s/c1/sub/cgroup.procs"), "").expect("write");
        let e = container_cgroup(&proc_root, &cg_root, 42).unwrap_err();
        assert!(e.contains("is not in"), "{e}");
        std::fs::write(cg_root.join("devices/k8s/c1/cgroup.procs"), "7\n42\n").expect("write");
        assert_eq!(container_cgroup(&proc_root, &cg_root, 42), Ok("devices/k8s/c1".into()));
        assert!(container_cgroup(&proc_root, &cg_root, 43).is_err());
        // Processes are counted below the cgroup too; a removed cgroup holds none.
        assert_eq!(cgroup_procs(&cg_root, "devices/k8s/c1"), CgroupProcs::Count(2));
        std::fs::write(cg_root.join("devices/k8s/c1/cgroup.procs"), "").expect("write");
        std::fs::write(cg_root.join("devices/k8s/c1/sub/cgroup.procs"), "99\n").expect("write");
        assert_eq!(cgroup_procs(&cg_root, "devices/k8s/c1"), CgroupProcs::Count(1));
        std::fs::remove_dir_all(cg_root.join("devices/k8s")).expect("rm");
        assert_eq!(cgroup_procs(&cg_root, "devices/k8s/c1"), CgroupProcs::Count(0));
        std::fs::create_dir_all(cg_root.join("devices/odd")).expect("mkdir");
        assert!(matches!(cgroup_procs(&cg_root, "devices/odd"), CgroupProcs::Unreadable(_)));
    }

    #[test]
    fn our_own_cgroup_is_found_on_this_host() {
        // Wherever this test runs, the answer names a cgroup that lists us (or the host
        // has no cgroup filesystem at /sys/fs/cgroup, and says so).
        let me = std::process::id() as i32;
        match container_cgroup(Path::new("/proc"), Path::new("/sys/fs/cgroup"), me) {
            Ok(rel) => assert!(
                matches!(cgroup_procs(Path::new("/sys/fs/cgroup"), &rel), CgroupProcs::Count(n) if n >= 1)
            ),
            Err(e) => assert!(e.contains("cannot read"), "{e}"),
        }
    }

    #[test]
    fn pending_lives_while_runc_knows_it_or_within_grace() {
        assert_eq!(
            judge(AllocationState::Pending, None, &facts(true, None, 10_000_000), 1000),
            Liveness::Alive
        );
        assert_eq!(
            judge(AllocationState::Pending, None, &facts(false, None, 999), 1000),
            Liveness::Alive
        );
        assert!(matches!(
            judge(AllocationState::Pending, None, &facts(false, None, 1000), 1000),
            Liveness::Gone(_)
        ));
    }

    #[test]
    fn pending_ends_within_the_grace_once_its_requesters_exited_without_a_record() {
        let gone = |runc: bool| Facts { requester: Requester::Exited, ..facts(runc, None, 5) };
        let why = match judge(AllocationState::Pending, None, &gone(false), 60_000) {
            Liveness::Gone(why) => why,
            other => panic!("a pending grant nobody can create: {other:?}"),
        };
        assert!(why.contains("exited and runc has no record"), "{why}");
        // runc made the container before its requester exited: it waits for the start.
        assert_eq!(judge(AllocationState::Pending, None, &gone(true), 60_000), Liveness::Alive);
        // A start refused in a cgroup another process is in: that process has the rules.
        for cgroup in [CgroupProcs::Count(1), CgroupProcs::Unreadable("EACCES".into())] {
            let shared = Facts { cgroup, ..gone(false) };
            assert_eq!(judge(AllocationState::Pending, None, &shared, 60_000), Liveness::Alive);
        }
        let emptied = Facts { cgroup: CgroupProcs::Count(0), ..gone(false) };
        assert!(matches!(
            judge(AllocationState::Pending, None, &emptied, 60_000),
            Liveness::Gone(_)
        ));
        // A create under way, however long it takes, keeps its grant past the grace.
        let creating = Facts { requester: Requester::Running, ..facts(false, None, 120_000) };
        assert_eq!(judge(AllocationState::Pending, None, &creating, 60_000), Liveness::Alive);
    }

    #[test]
    fn parses_stat_lines_with_hostile_command_names() {
        let line = "1234 (evil) 1 2 3) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10 18446744073709551615";
        assert_eq!(parse_start_time(line), Some(987654));
        let zombie = "1234 (x) Z 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 0 0";
        assert_eq!(parse_start_time(zombie), None);
        assert_eq!(parse_start_time("garbage"), None);
    }

    #[test]
    fn a_containers_processes_are_its_cgroups_not_its_inits_descendants() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (proc_root, cg_root) = (dir.path().join("proc"), dir.path().join("cgroup"));
        // Init 10 with a child 11; 20 was started by `runc exec` (its parent is on the host)
        // and sits in the container's cgroup (and 21 in a child cgroup of it).
        for (pid, ppid) in [(10, 1), (11, 10), (20, 99), (21, 99)] {
            std::fs::create_dir_all(proc_root.join(pid.to_string())).expect("mkdir");
            std::fs::write(
                proc_root.join(format!("{pid}/stat")),
                format!("{pid} (x) S {ppid} 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 5 0"),
            )
            .expect("write");
        }
        std::fs::create_dir_all(cg_root.join("k8s/c1/sub")).expect("mkdir");
        std::fs::write(cg_root.join("k8s/c1/cgroup.procs"), "10\n11\n20\n").expect("write");
        std::fs::write(cg_root.join("k8s/c1/sub/cgroup.procs"), "21\n").expect("write");
        let by_cgroup = container_processes(&proc_root, &cg_root, Some(10), Some("k8s/c1"));
        assert_eq!(by_cgroup.into_iter().collect::<Vec<_>>(), [10, 11, 20, 21]);
        let by_tree = container_processes(&proc_root, &cg_root, Some(10), None);
        assert_eq!(by_tree.into_iter().collect::<Vec<_>>(), [10, 11], "no cgroup recorded");
        assert!(container_processes(&proc_root, &cg_root, None, None).is_empty());
    }

    #[test]
    fn finds_a_process_tree() {
        let mut child = std::process::Command::new("sleep").arg("5").spawn().expect("spawn");
        let me = std::process::id();
        let tree = process_tree(Path::new("/proc"), me as i32);
        assert!(tree.contains(&me) && tree.contains(&child.id()), "{tree:?}");
        child.kill().expect("kill");
        child.wait().expect("wait");
        assert_eq!(parse_ppid("5 (a) b) S 42 5 5"), Some(42));
    }

    #[test]
    fn reads_our_own_start_time() {
        let me = std::process::id() as i32;
        assert!(pid_start_time(Path::new("/proc"), me).is_some());
        assert_eq!(pid_start_time(Path::new("/proc"), -1), None);
    }
}
