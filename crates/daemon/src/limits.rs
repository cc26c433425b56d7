//! A container's CPU and memory limits as the kernel enforces them (its cgroup's files,
//! cgroup v1 and v2), and what a `runc update` makes them (runc 1.1's rules), for the
//! fleet's quotas: what was admitted cannot grow by itself (docs/QUOTAS.md, "Updates").
//!
//! Pure, except [`read_limits`] (the files under a `/proc` and a cgroup root, given).
//!
//! runc 1.1's `update` (its `update.go` and `libcontainer/cgroups/fs`, `fs2`):
//! - the update's quota `q` and period `p` (0: not given) become the container's config:
//!   both or neither as given; only one given, the other is the value runc recorded in its
//!   `state.json` (the config of the create or the last update);
//! - cgroup v1 writes `cpu.cfs_period_us` when the config's period is not 0, and
//!   `cpu.cfs_quota_us` when its quota is not 0 (any negative quota is unlimited to the
//!   kernel); what it does not write keeps its value;
//! - cgroup v2 writes `cpu.max` when either is not 0: the quota if positive, else `max`
//!   (unlimited), and the period, or 100000 when it is 0;
//! - memory: 0 writes nothing, -1 is unlimited (`max` on v2), any other negative value is
//!   refused by the kernel, a positive one is the limit (the kernel rounds it down to a
//!   page, and clamps it to its largest).

use std::path::{Component, Path};

use tessera_api::{untrusted, ContainerLimits, KernelLimits, UpdateRequest};

/// The period the kernel (and runc on cgroup v2) uses when none is set, in µs.
pub const DEFAULT_PERIOD_US: u64 = 100_000;
/// The largest memory limit cgroup v1 reports: `PAGE_COUNTER_MAX` pages of 4 KiB, what
/// `-1` (unlimited) reads back as. Anything from here up is unlimited.
pub const V1_UNLIMITED_MEMORY: u64 = 0x7FFF_FFFF_FFFF_F000;

/// Which cgroup hierarchy holds a container's CPU and memory controllers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    /// One hierarchy per controller (`cpu.cfs_quota_us`, `memory.limit_in_bytes`).
    V1,
    /// The unified hierarchy (`cpu.max`, `memory.max`).
    V2,
}

/// Where a process's CPU and memory limits are: the directories (relative to the cgroup
/// mount root) of its `cpu` and `memory` cgroups, from its `/proc/<pid>/cgroup` text: the
/// cgroup v1 lines naming those controllers (`4:cpu,cpuacct:/a/b` is
/// `cpu,cpuacct/a/b`), else the v2 line (`0::/a/b` is `a/b`). A path that is not plain
/// (`..`, empty components) is refused: it could name another cgroup.
pub fn limit_dirs(text: &str) -> Result<(String, String, CgroupVersion), String> {
    let mut cpu = Vec::new();
    let mut memory = Vec::new();
    let mut unified = Vec::new();
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let rel = |path: &str| format!("{controllers}{path}");
        if controllers.split(',').any(|c| c == "cpu") {
            cpu.push(rel(path));
        }
        if controllers.split(',').any(|c| c == "memory") {
            memory.push(rel(path));
        }
        if controllers.is_empty() {
            unified.push(path.trim_start_matches('/').to_string());
        }
    }
    let (cpu, memory, version) = match (cpu.as_slice(), memory.as_slice(), unified.as_slice()) {
        ([c], [m], _) => (c.clone(), m.clone(), CgroupVersion::V1),
        ([], [], [u]) => (u.clone(), u.clone(), CgroupVersion::V2),
        _ => {
            return Err(format!(
                "expected one cpu and one memory cgroup (v1) or one unified cgroup (v2), found \
                 {} cpu, {} memory and {} unified lines",
                cpu.len(),
                memory.len(),
                unified.len()
            ))
        }
    };
    for rel in [&cpu, &memory] {
        let plain = Path::new(rel).components().all(|c| matches!(c, Component::Normal(_)));
        if !plain && !rel.is_empty() {
            return Err(format!("cgroup path {} is not a plain relative path", untrusted(rel)));
        }
    }
    Ok((cpu, memory, version))
}

fn number<T: std::str::FromStr>(file: &str, text: &str) -> Result<T, String> {
    let t = text.trim();
    t.parse::<T>().map_err(|_| format!("{file}: `{}` is not a number", untrusted(t).max_chars(64)))
}

/// `cpu.cfs_quota_us` (v1): any negative value is unlimited.
pub fn parse_v1_quota(text: &str) -> Result<Option<u64>, String> {
    let q: i64 = number("cpu.cfs_quota_us", text)?;
    Ok(u64::try_from(q).ok())
}

/// `cpu.cfs_period_us` (v1).
pub fn parse_v1_period(text: &str) -> Result<u64, String> {
    number("cpu.cfs_period_us", text)
}

/// `memory.limit_in_bytes` (v1): [`V1_UNLIMITED_MEMORY`] and above is unlimited.
pub fn parse_v1_memory(text: &str) -> Result<Option<u64>, String> {
    let m: u64 = number("memory.limit_in_bytes", text)?;
    Ok((m < V1_UNLIMITED_MEMORY).then_some(m))
}

/// `cpu.max` (v2): `QUOTA PERIOD` or `max PERIOD`.
pub fn parse_v2_cpu_max(text: &str) -> Result<(Option<u64>, u64), String> {
    let mut words = text.split_whitespace();
    let (Some(q), Some(p), None) = (words.next(), words.next(), words.next()) else {
        return Err(format!("cpu.max: `{}` is not `QUOTA PERIOD`", untrusted(text).max_chars(64)));
    };
    let quota = match q {
        "max" => None,
        q => Some(number("cpu.max", q)?),
    };
    Ok((quota, number("cpu.max", p)?))
}

/// `memory.max` (v2): `max` or bytes.
pub fn parse_v2_memory_max(text: &str) -> Result<Option<u64>, String> {
    match text.trim() {
        "max" => Ok(None),
        m => number("memory.max", m).map(Some),
    }
}

/// The limits the kernel enforces on `pid`'s own cgroups, from the files under
/// `cgroup_root` (`/sys/fs/cgroup`) that `/proc/<pid>/cgroup` under `proc_root` names.
/// Checked, not assumed: each directory must list `pid` in its `cgroup.procs` (a cgroup
/// name may hold a newline that forges a line of `/proc/<pid>/cgroup`).
pub fn read_limits(
    proc_root: &Path,
    cgroup_root: &Path,
    pid: i32,
) -> Result<(KernelLimits, CgroupVersion), String> {
    let file = proc_root.join(pid.to_string()).join("cgroup");
    let text = read_small(&file)?;
    let (cpu, memory, version) = limit_dirs(&text)?;
    let (cpu, memory) = (cgroup_root.join(cpu), cgroup_root.join(memory));
    for dir in [&cpu, &memory] {
        let procs = read_small(&dir.join("cgroup.procs"))?;
        if !procs.lines().any(|l| l.trim().parse::<i32>() == Ok(pid)) {
            return Err(format!(
                "pid {pid} is not in {} (its cgroup is not what {} says)",
                dir.join("cgroup.procs").display(),
                file.display()
            ));
        }
    }
    let read = |dir: &Path, name: &str| read_small(&dir.join(name));
    let limits = match version {
        CgroupVersion::V1 => KernelLimits {
            cpu_quota: parse_v1_quota(&read(&cpu, "cpu.cfs_quota_us")?)?,
            cpu_period: parse_v1_period(&read(&cpu, "cpu.cfs_period_us")?)?,
            memory: parse_v1_memory(&read(&memory, "memory.limit_in_bytes")?)?,
        },
        CgroupVersion::V2 => {
            let (cpu_quota, cpu_period) = parse_v2_cpu_max(&read(&cpu, "cpu.max")?)?;
            KernelLimits {
                cpu_quota,
                cpu_period,
                memory: parse_v2_memory_max(&read(&memory, "memory.max")?)?,
            }
        }
    };
    Ok((limits, version))
}

/// A small kernel file (at most 64 KiB read).
fn read_small(path: &Path) -> Result<String, String> {
    let f =
        std::fs::File::open(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut text = String::new();
    std::io::Read::read_to_string(&mut std::io::Read::take(f, 64 << 10), &mut text)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    Ok(text)
}

/// What runc 1.1's `update` makes the limits of a cgroup whose limits are `current`
/// (module docs), if its writes succeed. An update runc or the kernel would refuse (a
/// negative memory limit other than -1) is an error naming it.
pub fn after_update(
    version: CgroupVersion,
    current: &KernelLimits,
    update: &UpdateRequest,
) -> Result<KernelLimits, String> {
    let (q, p) = (update.cpu_quota, update.cpu_period);
    let recorded = update.recorded.clone().unwrap_or_default();
    // update.go: both or neither as given; one given, the other as runc recorded it.
    let (config_q, config_p) = match (q != 0, p != 0) {
        (false, false) => (0, 0),
        (true, true) => (q, p),
        (true, false) => (q, recorded.cpu_period),
        (false, true) => (recorded.cpu_quota, p),
    };
    let mut out = *current;
    match version {
        CgroupVersion::V1 => {
            if config_p != 0 {
                out.cpu_period = config_p;
            }
            if config_q != 0 {
                out.cpu_quota = u64::try_from(config_q).ok();
            }
        }
        CgroupVersion::V2 => {
            if config_q != 0 || config_p != 0 {
                out.cpu_quota = u64::try_from(config_q).ok().filter(|q| *q > 0);
                out.cpu_period = if config_p == 0 { DEFAULT_PERIOD_US } else { config_p };
            }
        }
    }
    match update.memory_limit {
        0 => {}
        -1 => out.memory = None,
        m if m < 0 => {
            return Err(format!(
                "memory limit {m} is neither a limit nor -1 (unlimited): the kernel refuses it"
            ))
        }
        m => out.memory = Some(m as u64),
    }
    Ok(out)
}

/// What `limits` count as for the fleet's quotas: millicores (`quota × 1000 / period`, a
/// period of 0 being the kernel's 100000 µs) and MiB, each rounded up, as
/// `tessera-runtime` counts a config's limits at create; unlimited is `None`. A limit
/// above what a quota can count ([`ContainerLimits::MAX_CPU_MILLI`],
/// [`ContainerLimits::MAX_MEMORY_MIB`]) is an error naming it.
pub fn counted(limits: &KernelLimits) -> Result<ContainerLimits, String> {
    let cpu_milli = match limits.cpu_quota {
        None => None,
        Some(q) => {
            let p = if limits.cpu_period == 0 { DEFAULT_PERIOD_US } else { limits.cpu_period };
            let milli = (u128::from(q) * 1000).div_ceil(u128::from(p));
            match u64::try_from(milli) {
                Ok(m) if m <= ContainerLimits::MAX_CPU_MILLI => Some(m),
                _ => {
                    return Err(format!(
                        "a CPU quota of {q} µs per {p} µs ({milli} millicores) is above the \
                         largest CPU limit Tessera counts ({} millicores)",
                        ContainerLimits::MAX_CPU_MILLI
                    ))
                }
            }
        }
    };
    let memory_mib = match limits.memory {
        None => None,
        Some(bytes) => {
            let mib = bytes.div_ceil(1 << 20);
            if mib > ContainerLimits::MAX_MEMORY_MIB {
                return Err(format!(
                    "a memory limit of {bytes} bytes is above the largest memory limit Tessera \
                     counts ({} MiB)",
                    ContainerLimits::MAX_MEMORY_MIB
                ));
            }
            Some(mib)
        }
    };
    Ok(ContainerLimits { cpu_milli, memory_mib })
}

/// Whether `now` holds more than `admitted` of CPU or memory (unlimited holds more than
/// any limit; a resource `admitted` leaves unlimited bounds nothing).
pub fn exceeds(now: &ContainerLimits, admitted: &ContainerLimits) -> bool {
    let more = |now: Option<u64>, admitted: Option<u64>| match (now, admitted) {
        (_, None) => false,
        (None, Some(_)) => true,
        (Some(n), Some(a)) => n > a,
    };
    more(now.cpu_milli, admitted.cpu_milli) || more(now.memory_mib, admitted.memory_mib)
}

/// Whether an update's CPU list (or memory nodes) `asked` keeps a container whose grant
/// pins its CPUs to its GPUs' (`topology.pin_cpus`) within what it may have: the pinned
/// set `pin`, or what runc set before (`recorded`, empty when runc set none). An update
/// may narrow the set, never widen it; `Err` says which entries are outside both.
pub fn check_cpuset(what: &str, asked: &str, pin: &str, recorded: &str) -> Result<(), String> {
    use tessera_api::cpulist::parse_cpulist;
    let asked_set = parse_cpulist(asked)
        .map_err(|e| format!("{what} `{}`: {e}", untrusted(asked).max_chars(64)))?;
    let within = |base: &str| {
        !base.trim().is_empty()
            && parse_cpulist(base).is_ok_and(|b| asked_set.iter().all(|c| b.contains(c)))
    };
    if within(pin) || within(recorded) {
        return Ok(());
    }
    let have = if recorded.trim().is_empty() { pin } else { recorded };
    Err(format!(
        "{what} `{}` is wider than the set its grant pins to its GPUs ({pin}) and what it has \
         ({have}): an update may narrow it, never widen it",
        untrusted(asked).max_chars(64)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_api::RecordedLimits;

    const HALF_CORE: KernelLimits =
        KernelLimits { cpu_quota: Some(50_000), cpu_period: 100_000, memory: Some(512 << 20) };

    fn update(q: i64, p: u64, m: i64) -> UpdateRequest {
        UpdateRequest {
            runc_root: "/run/runc".into(),
            cpu_quota: q,
            cpu_period: p,
            memory_limit: m,
            recorded: Some(RecordedLimits {
                cpu_quota: 50_000,
                cpu_period: 100_000,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn proc_cgroup_lines_name_the_cpu_and_memory_directories() {
        let v1 = "12:pids:/x\n4:cpu,cpuacct:/ts/c1\n3:cpuset:/ts/c1\n9:memory:/ts/c1\n0::/ts/c1\n";
        assert_eq!(
            limit_dirs(v1),
            Ok(("cpu,cpuacct/ts/c1".into(), "memory/ts/c1".into(), CgroupVersion::V1))
        );
        assert_eq!(limit_dirs("0::/a/b\n"), Ok(("a/b".into(), "a/b".into(), CgroupVersion::V2)));
        assert_eq!(limit_dirs("0::/\n"), Ok((String::new(), String::new(), CgroupVersion::V2)));
        // A forged second line, and paths that leave their hierarchy: refused.
        assert!(limit_dirs("4:cpu:/a\n4:cpu:/b\n9:memory:/a\n").is_err());
        assert!(limit_dirs("4:cpu:/a/../../b\n9:memory:/a\n").unwrap_err().contains("plain"));
        assert!(limit_dirs("4:cpuset:/a\n9:memory:/a\n").is_err(), "cpuset is not cpu");
    }

    #[test]
    fn the_files_read_as_the_kernel_writes_them() {
        assert_eq!(parse_v1_quota("-1\n"), Ok(None));
        assert_eq!(parse_v1_quota("50000\n"), Ok(Some(50_000)));
        assert_eq!(parse_v1_period("100000\n"), Ok(100_000));
        assert_eq!(parse_v1_memory("9223372036854771712\n"), Ok(None));
        assert_eq!(parse_v1_memory("536870912\n"), Ok(Some(512 << 20)));
        assert_eq!(parse_v2_cpu_max("max 100000\n"), Ok((None, 100_000)));
        assert_eq!(parse_v2_cpu_max("25000 50000\n"), Ok((Some(25_000), 50_000)));
        assert_eq!(parse_v2_memory_max("max\n"), Ok(None));
        assert_eq!(parse_v2_memory_max("1073741824\n"), Ok(Some(1 << 30)));
        for bad in ["", "x", "1 2 3", "\u{1b}[2J 1"] {
            assert!(parse_v2_cpu_max(bad).is_err(), "{bad:?}");
        }
        let e = parse_v1_memory("\u{1b}[31m").unwrap_err();
        assert!(!e.contains('\u{1b}'), "{e}");
    }

    #[test]
    fn an_update_sets_what_it_names_and_keeps_the_rest() {
        use CgroupVersion::{V1, V2};
        let after = |v, u: &UpdateRequest| after_update(v, &HALF_CORE, u).expect("valid");
        // Nothing named: nothing changes, on either version.
        for v in [V1, V2] {
            assert_eq!(after(v, &update(0, 0, 0)), HALF_CORE);
        }
        // Both: both; memory alone: memory alone.
        let both = after(V1, &update(200_000, 50_000, 1 << 30));
        assert_eq!(
            both,
            KernelLimits { cpu_quota: Some(200_000), cpu_period: 50_000, memory: Some(1 << 30) }
        );
        // A period alone keeps the recorded quota: a shorter period is more CPU.
        let p = after(V1, &update(0, 10_000, 0));
        assert_eq!((p.cpu_quota, p.cpu_period), (Some(50_000), 10_000));
        assert_eq!(counted(&p).expect("counts").cpu_milli, Some(5_000));
        // On v2 a period alone with nothing recorded is `max PERIOD`: unlimited.
        let mut u = update(0, 10_000, 0);
        u.recorded = Some(RecordedLimits::default());
        assert_eq!(after(V2, &u).cpu_quota, None);
        assert_eq!(after(V1, &u).cpu_quota, Some(50_000), "v1 writes no quota then");
        // A quota alone keeps the recorded period (v2 writes it with the quota).
        let q = after(V2, &update(150_000, 0, 0));
        assert_eq!((q.cpu_quota, q.cpu_period), (Some(150_000), 100_000));
        // Any negative quota and -1 memory: unlimited.
        let unl = after(V1, &update(-5, 0, -1));
        assert_eq!((unl.cpu_quota, unl.memory), (None, None));
        let unl = after(V2, &update(-1, 0, -1));
        assert_eq!((unl.cpu_quota, unl.memory), (None, None));
        // Another negative memory value is the kernel's refusal.
        let e = after_update(V1, &HALF_CORE, &update(0, 0, -2)).unwrap_err();
        assert!(e.contains("-2"), "{e}");
    }

    #[test]
    fn limits_count_as_a_create_counts_them_rounded_up() {
        let c = |q, p, m| counted(&KernelLimits { cpu_quota: q, cpu_period: p, memory: m });
        assert_eq!(
            c(Some(50_000), 100_000, Some(512 << 20)),
            Ok(ContainerLimits { cpu_milli: Some(500), memory_mib: Some(512) })
        );
        assert_eq!(
            c(Some(1), u64::MAX, Some(1)),
            Ok(ContainerLimits { cpu_milli: Some(1), memory_mib: Some(1) })
        );
        assert_eq!(c(None, 100_000, None), Ok(ContainerLimits::default()));
        assert_eq!(c(Some(1000), 0, None).expect("counts").cpu_milli, Some(10));
        assert!(c(Some(u64::MAX), 1000, None).unwrap_err().contains("largest CPU limit"));
        assert!(c(None, 1, Some(u64::MAX - 1)).unwrap_err().contains("largest memory limit"));
    }

    #[test]
    fn more_than_admitted_is_any_raise_or_unlimited_where_bounded() {
        let l = |c, m| ContainerLimits { cpu_milli: c, memory_mib: m };
        let admitted = l(Some(1000), Some(1024));
        assert!(!exceeds(&l(Some(1000), Some(1024)), &admitted));
        assert!(!exceeds(&l(Some(500), Some(10)), &admitted));
        assert!(exceeds(&l(Some(1001), Some(10)), &admitted));
        assert!(exceeds(&l(Some(10), None), &admitted));
        assert!(!exceeds(&l(None, None), &l(None, None)), "nothing admitted bounds nothing");
    }

    #[test]
    fn a_pinned_cpu_set_may_narrow_never_widen() {
        assert_eq!(check_cpuset("cpus", "0", "0-1", "0-1"), Ok(()));
        assert_eq!(check_cpuset("cpus", "1", "0-1", ""), Ok(()));
        // A set recorded before create refused sets disjoint from the pin (an older
        // tesserad) bounds its updates: narrowing it never widens anything.
        assert_eq!(check_cpuset("cpus", "3", "0-1", "3"), Ok(()));
        let e = check_cpuset("cpus", "0-1", "0", "0").expect_err("wider");
        assert!(e.contains("`0-1` is wider") && e.contains("what it has (0): an update"), "{e}");
        assert!(!e.contains("  "), "one space between words: {e}");
        assert!(check_cpuset("cpus", "0,7", "0", "").is_err());
        let e = check_cpuset("mems", "x\u{1b}", "0", "0").expect_err("unreadable");
        assert!(e.starts_with("mems `x") && !e.contains('\u{1b}'), "{e}");
    }
}
