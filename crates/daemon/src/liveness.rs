//! Is a container still there? Pure judgement over facts read from the host (`/proc`,
//! runc's state root), with every host path a parameter.

use std::path::Path;

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
    /// Milliseconds since the allocation was granted.
    pub age_ms: u64,
}

/// Decide whether an allocation's container is gone.
///
/// - Running: alive while its init pid lives with the recorded start time (a recycled pid
///   has another start time).
/// - Pending (granted, not yet confirmed by the prestart hook): alive while runc knows the
///   container, or while younger than `grace_ms` (runc creates its state after we answer).
pub fn judge(
    state: AllocationState,
    recorded_pid_start: Option<u64>,
    facts: &Facts,
    grace_ms: u64,
) -> Liveness {
    match state {
        AllocationState::Running => match (facts.pid_start_now, recorded_pid_start) {
            (Some(now), Some(then)) if now == then => Liveness::Alive,
            (Some(_), None) => Liveness::Alive,
            (Some(_), Some(_)) => Liveness::Gone("container pid was recycled by another process".into()),
            (None, _) => Liveness::Gone("container process exited".into()),
        },
        AllocationState::Pending => {
            if facts.runc_state_exists || facts.age_ms < grace_ms {
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

/// `pid` and every process descending from it (a container's processes, from its init),
/// read from `proc_root`.
pub fn process_tree(proc_root: &Path, pid: i32) -> std::collections::BTreeSet<u32> {
    let mut children: std::collections::BTreeMap<u32, Vec<u32>> = std::collections::BTreeMap::new();
    if let Ok(entries) = std::fs::read_dir(proc_root) {
        for e in entries.flatten() {
            let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
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
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn facts(state: bool, pid: Option<u64>, age: u64) -> Facts {
        Facts { runc_state_exists: state, pid_start_now: pid, age_ms: age }
    }

    #[test]
    fn running_follows_the_pid_and_its_start_time() {
        assert_eq!(judge(AllocationState::Running, Some(5), &facts(true, Some(5), 0), 1000), Liveness::Alive);
        assert!(matches!(judge(AllocationState::Running, Some(5), &facts(true, Some(9), 0), 1000), Liveness::Gone(m) if m.contains("recycled")));
        assert!(matches!(judge(AllocationState::Running, Some(5), &facts(true, None, 0), 1000), Liveness::Gone(_)));
    }

    #[test]
    fn pending_lives_while_runc_knows_it_or_within_grace() {
        assert_eq!(judge(AllocationState::Pending, None, &facts(true, None, 10_000_000), 1000), Liveness::Alive);
        assert_eq!(judge(AllocationState::Pending, None, &facts(false, None, 999), 1000), Liveness::Alive);
        assert!(matches!(judge(AllocationState::Pending, None, &facts(false, None, 1000), 1000), Liveness::Gone(_)));
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
