//! Which cgroup holds a container's device rules, in one form for tesserad and
//! tessera-runtime: relative to the cgroup mount root, `<controllers>/<path>` on cgroup v1
//! (`devices/kubepods/pod1/c1`), `<path>` on v2.
//!
//! tesserad records the cgroup of every running GPU grant ([`parse_proc_cgroup`] of the
//! container's init at prestart) and lists them beside its socket
//! ([`write_grant_cgroups`]); tessera-runtime computes where runc 1.1 will put a new
//! container ([`runc_cgroup`]) and refuses one that would join a grant's cgroup or one
//! below it — a process there keeps the grant's device rules (docs/SECURITY.md, "A
//! container's cgroup is its own").

use std::path::{Component, Path, PathBuf};

use crate::untrusted;

/// The device-rule cgroup in a `/proc/<pid>/cgroup` text: the v1 line whose controllers
/// include `devices`, else the v2 (`0::`) line.
pub fn parse_proc_cgroup(text: &str) -> Result<String, String> {
    let (prefix, path) = device_hierarchy(text)?;
    let rel = if prefix.is_empty() {
        path.trim_start_matches('/').to_string()
    } else {
        format!("{prefix}{path}")
    };
    let p = Path::new(&rel);
    if p.is_absolute() || p.components().any(|c| !matches!(c, Component::Normal(_))) {
        return Err(format!("cgroup path {} is not a plain relative path", untrusted(&rel)));
    }
    Ok(rel)
}

/// The device hierarchy's line of a `/proc/<pid>/cgroup` text: (`<controllers>` for v1 or
/// `""` for v2, the cgroup path as listed).
fn device_hierarchy(text: &str) -> Result<(String, String), String> {
    let mut devices = Vec::new();
    let mut unified = Vec::new();
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if controllers.split(',').any(|c| c == "devices") {
            devices.push((controllers.to_string(), path.to_string()));
        } else if controllers.is_empty() {
            unified.push((String::new(), path.to_string()));
        }
    }
    match (devices.len(), unified.len()) {
        (1, _) => Ok(devices.remove(0)),
        (0, 1) => Ok(unified.remove(0)),
        (0, 0) => Err("no devices (cgroup v1) or unified (v2) cgroup is listed".into()),
        _ => Err("more than one devices or unified cgroup is listed".into()),
    }
}

/// runc's `CleanPath`: `filepath.Clean`, and a relative path cannot climb above its base.
fn clean(path: &str) -> (bool, PathBuf) {
    let absolute = path.starts_with('/');
    let mut out = PathBuf::new();
    for c in Path::new(path).components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::ParentDir => {
                out.pop();
            }
            _ => {}
        }
    }
    (absolute, out)
}

/// systemd's slice expansion (`a-b.slice` is `/a.slice/a-b.slice`), as runc's
/// `ExpandSlice`.
fn expand_slice(slice: &str) -> Result<PathBuf, String> {
    let bad = || format!("invalid systemd slice name {}", untrusted(slice));
    let name = slice.strip_suffix(".slice").filter(|n| !n.is_empty()).ok_or_else(bad)?;
    if slice.contains('/') {
        return Err(bad());
    }
    if name == "-" {
        return Ok(PathBuf::new());
    }
    let mut path = PathBuf::new();
    let mut prefix = String::new();
    for component in name.split('-') {
        if component.is_empty() {
            return Err(bad());
        }
        path.push(format!("{prefix}{component}.slice"));
        prefix.push_str(component);
        prefix.push('-');
    }
    Ok(path)
}

/// Where runc 1.1 puts a new container's device cgroup, in [`parse_proc_cgroup`]'s form:
/// from `linux.cgroupsPath` (absent or empty: the container id), the cgroup driver
/// (`systemd`: `slice:prefix:name`), and the `/proc/self/cgroup` text of the process that
/// runs runc (a relative path is below its cgroup on v1, below that cgroup's parent on v2).
pub fn runc_cgroup(
    cgroups_path: Option<&str>,
    container_id: &str,
    systemd: bool,
    own_proc_cgroup: &str,
) -> Result<String, String> {
    let (prefix, own) = device_hierarchy(own_proc_cgroup)?;
    let path: PathBuf = if systemd {
        let (slice, unit) = match cgroups_path.filter(|p| !p.is_empty()) {
            None => ("system.slice".to_string(), format!("runc-{container_id}.scope")),
            Some(p) => {
                let parts: Vec<&str> = p.split(':').collect();
                let [slice, scope_prefix, name] = parts[..] else {
                    return Err(format!(
                        "linux.cgroupsPath {} is not slice:prefix:name (the systemd driver's form)",
                        untrusted(p)
                    ));
                };
                let slice = if slice.is_empty() { "system.slice" } else { slice };
                let unit = if name.ends_with(".slice") {
                    name.to_string()
                } else if scope_prefix.is_empty() {
                    format!("{name}.scope")
                } else {
                    format!("{scope_prefix}-{name}.scope")
                };
                (slice.to_string(), unit)
            }
        };
        expand_slice(&slice)?.join(unit)
    } else {
        let p = cgroups_path.filter(|p| !p.is_empty()).unwrap_or(container_id);
        match clean(p) {
            (true, abs) => abs,
            // v1: below the caller's own cgroup of the hierarchy (runc's
            // `GetOwnCgroupPath`); v2: below its parent (runc's fs2 `_defaultDirPath`
            // takes `filepath.Dir` of the caller's cgroup, which holds processes).
            (false, rel) => {
                let mut base = clean(&own).1;
                if prefix.is_empty() {
                    base.pop();
                }
                base.join(rel)
            }
        }
    };
    let path = path.to_string_lossy().into_owned();
    Ok(if prefix.is_empty() { path } else { format!("{prefix}/{path}") })
}

/// [`runc_cgroup`]'s result as a path alone (v1: without the devices hierarchy's
/// `<controllers>/` in front), the same in every hierarchy runc's cgroupfs driver uses.
pub fn runc_cgroup_path(
    cgroups_path: Option<&str>,
    container_id: &str,
    systemd: bool,
    own_proc_cgroup: &str,
) -> Result<String, String> {
    let (prefix, _) = device_hierarchy(own_proc_cgroup)?;
    let full = runc_cgroup(cgroups_path, container_id, systemd, own_proc_cgroup)?;
    Ok(match full.strip_prefix(&format!("{prefix}/")) {
        Some(p) if !prefix.is_empty() => p.to_string(),
        _ => full,
    })
}

/// How many processes cgroup `rel` ([`parse_proc_cgroup`]'s form) and the cgroups below it
/// hold, under the cgroup mount `root`: 0 where it does not exist. A cgroup that cannot be
/// read is an error (never taken for empty).
pub fn procs_within(root: &Path, rel: &str) -> std::io::Result<usize> {
    let mut todo = vec![root.join(rel)];
    let mut count = 0;
    while let Some(dir) = todo.pop() {
        let text = match std::fs::read_to_string(dir.join("cgroup.procs")) {
            Ok(t) => t,
            // Gone, or a directory that was never a cgroup: nothing in it.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        count += text.lines().filter(|l| !l.trim().is_empty()).count();
        for entry in std::fs::read_dir(&dir)?.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                todo.push(entry.path());
            }
        }
    }
    Ok(count)
}

/// Whether cgroup `a` is `b` or below it (both in [`parse_proc_cgroup`]'s form).
pub fn within(a: &str, b: &str) -> bool {
    Path::new(a).starts_with(Path::new(b))
}

/// Beside tesserad's socket: the cgroups of the running GPU grants, one per line.
pub fn grant_cgroups_path(socket: &Path) -> PathBuf {
    beside(socket, ".grant-cgroups")
}

/// The file named `socket` + `suffix`.
fn beside(socket: &Path, suffix: &str) -> PathBuf {
    let mut s = socket.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// `file`'s text; `None` where there is no such file.
fn read_if_there(file: &Path) -> std::io::Result<Option<String>> {
    match std::fs::read_to_string(file) {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Writes the list (at [`grant_cgroups_path`]) atomically: a file beside it, then rename,
/// mode 0644.
pub fn write_grant_cgroups<'a>(
    list: &Path,
    cgroups: impl IntoIterator<Item = &'a str>,
) -> std::io::Result<()> {
    let text: String = cgroups.into_iter().map(|c| format!("{c}\n")).collect();
    crate::write_beside(list, text.as_bytes())
}

/// Beside tesserad's socket: its process id. Its cgroups (read from `/proc/<pid>/cgroup` at
/// each check, so that wherever systemd or an operator moves it counts) hold tesserad and
/// the MPS daemons it starts: no container may join them or a cgroup above them
/// ([`read_daemon_cgroups`]).
pub fn daemon_pid_path(socket: &Path) -> PathBuf {
    beside(socket, ".pid")
}

/// Beside tesserad's socket: the cgroups it started in, one per line (every hierarchy's
/// path, relative). Kept after it stops: the MPS daemons it started stay there.
pub fn daemon_cgroups_path(socket: &Path) -> PathBuf {
    beside(socket, ".cgroups")
}

/// The path of every hierarchy a `/proc/<pid>/cgroup` text names (v1 lines and the v2
/// one), relative (`""`: the root): runc's cgroupfs driver puts a container at one path in
/// every hierarchy, so each of them is a cgroup the process is in.
pub fn hierarchy_paths(text: &str) -> Vec<String> {
    let mut out: Vec<String> = text
        .lines()
        .filter_map(|l| l.splitn(3, ':').nth(2))
        .map(|p| p.trim_start_matches('/').to_string())
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Writes this process's id at [`daemon_pid_path`] and adds the cgroups it runs in to
/// [`daemon_cgroups_path`] ([`record_daemon_cgroups`]).
pub fn write_daemon_files(socket: &Path) -> std::io::Result<()> {
    record_daemon_cgroups(socket)?;
    crate::write_beside(&daemon_pid_path(socket), format!("{}\n", std::process::id()).as_bytes())
}

/// Adds the cgroups this process runs in now to those listed at [`daemon_cgroups_path`]
/// (atomically, mode 0644; unchanged, not rewritten): tesserad calls it at its start and
/// whenever it starts an MPS daemon, which stays in the cgroup it was started in after
/// tesserad is moved, stopped or gone.
pub fn record_daemon_cgroups(socket: &Path) -> std::io::Result<()> {
    let own = std::fs::read_to_string("/proc/self/cgroup")?;
    let file = daemon_cgroups_path(socket);
    let listed: Vec<String> =
        read_if_there(&file)?.map(|t| t.lines().map(str::to_string).collect()).unwrap_or_default();
    let mut all = listed.clone();
    all.extend(hierarchy_paths(&own));
    all.sort();
    all.dedup();
    if all == listed {
        return Ok(());
    }
    let lines: String = all.iter().map(|p| format!("{p}\n")).collect();
    crate::write_beside(&file, lines.as_bytes())
}

/// The cgroups (every hierarchy's path, relative) of the tesserad beside `socket`: those it
/// started in ([`daemon_cgroups_path`], kept after it stops: its MPS daemons stay there)
/// and, while the process whose id is beside the socket runs, those it is in now. Empty
/// when neither file is there; an error when one cannot be read otherwise (the caller
/// refuses: fail closed).
pub fn read_daemon_cgroups(socket: &Path, proc_root: &Path) -> Result<Vec<String>, String> {
    let read = |file: &Path| {
        read_if_there(file).map_err(|e| format!("cannot read {}: {e}", file.display()))
    };
    let mut out: Vec<String> = read(&daemon_cgroups_path(socket))?
        .map(|t| t.lines().map(|l| l.trim_start_matches('/').to_string()).collect())
        .unwrap_or_default();
    let file = daemon_pid_path(socket);
    if let Some(text) = read(&file)? {
        let pid: u32 = text.trim().parse().map_err(|_| {
            format!("{} holds {}, not a process id", file.display(), untrusted(text.trim()))
        })?;
        if let Some(now) = read(&proc_root.join(pid.to_string()).join("cgroup"))? {
            out.extend(hierarchy_paths(&now));
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// Reads [`grant_cgroups_path`]: `None` when there is no file (no tesserad has written
/// one), the cgroups it lists otherwise.
pub fn read_grant_cgroups(socket: &Path) -> std::io::Result<Option<Vec<String>>> {
    Ok(read_if_there(&grant_cgroups_path(socket))?
        .map(|t| t.lines().filter(|l| !l.is_empty()).map(str::to_string).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_daemons_cgroups_are_where_it_started_and_where_its_process_is_now() {
        let d = tempfile::tempdir().expect("tmp");
        let socket = d.path().join("tesserad.sock");
        let proc_root = d.path().join("proc");
        assert_eq!(read_daemon_cgroups(&socket, &proc_root), Ok(vec![]), "no file written");
        // Where it started (kept after it stops: its MPS daemons stay there), every
        // hierarchy (v1's pids and memory apart from devices).
        let started = "12:pids:/system.slice/tesserad.service\n10:devices:/system.slice\n\
                       0::/system.slice/tesserad.service\n";
        let paths = hierarchy_paths(started);
        assert_eq!(paths, vec!["system.slice", "system.slice/tesserad.service"]);
        std::fs::write(daemon_cgroups_path(&socket), paths.join("\n")).expect("cgroups");
        std::fs::write(daemon_pid_path(&socket), "4242\n").expect("pid");
        assert_eq!(read_daemon_cgroups(&socket, &proc_root), Ok(paths.clone()), "gone");
        // Moved since: both count.
        std::fs::create_dir_all(proc_root.join("4242")).expect("proc");
        std::fs::write(proc_root.join("4242/cgroup"), "0::/elsewhere\n").expect("moved");
        let got = read_daemon_cgroups(&socket, &proc_root).expect("read");
        assert_eq!(got, vec!["elsewhere", "system.slice", "system.slice/tesserad.service"]);
        std::fs::write(daemon_pid_path(&socket), "x/../1\n").expect("pid");
        let e = read_daemon_cgroups(&socket, &proc_root).expect_err("not an id");
        assert!(e.contains("not a process id"), "{e}");
    }

    #[test]
    fn procs_within_counts_a_cgroup_and_every_cgroup_below_it() {
        let d = tempfile::tempdir().expect("tmp");
        let cg = d.path().join("devices/pod/c");
        std::fs::create_dir_all(cg.join("child/grand")).expect("dirs");
        std::fs::write(cg.join("cgroup.procs"), "").expect("procs");
        std::fs::write(cg.join("child/cgroup.procs"), "12\n").expect("procs");
        std::fs::write(cg.join("child/grand/cgroup.procs"), "13\n14\n").expect("procs");
        assert_eq!(procs_within(d.path(), "devices/pod/c").expect("read"), 3);
        assert_eq!(procs_within(d.path(), "devices/pod/c/child/grand").expect("read"), 2);
        assert_eq!(procs_within(d.path(), "devices/pod/none").expect("read"), 0, "not made yet");
    }

    const V1: &str = "5:devices:/user.slice\n4:memory:/m\n0::/\n";
    const V2: &str = "0::/user.slice/session-1.scope\n";

    #[test]
    fn the_device_cgroup_is_read_from_proc() {
        assert_eq!(parse_proc_cgroup("5:devices:/a/b\n0::/\n").as_deref(), Ok("devices/a/b"));
        assert_eq!(parse_proc_cgroup("3:cpu,devices:/a\n").as_deref(), Ok("cpu,devices/a"));
        assert_eq!(parse_proc_cgroup("0::/a/b\n").as_deref(), Ok("a/b"));
        assert!(parse_proc_cgroup("1:cpu:/a\n").is_err());
        assert!(parse_proc_cgroup("5:devices:/a/../b\n").is_err());
    }

    #[test]
    fn cgroupfs_paths_are_placed_as_runc_places_them() {
        let at = |p: Option<&str>, own: &str| runc_cgroup(p, "c1", false, own).expect("path");
        assert_eq!(at(Some("/tessera/c1"), V1), "devices/tessera/c1");
        assert_eq!(at(Some("/a/../b//c/"), V1), "devices/b/c");
        // Relative: below the caller's own cgroup, and `..` cannot climb out of it.
        assert_eq!(at(Some("x"), V1), "devices/user.slice/x");
        assert_eq!(at(Some("../../x"), V1), "devices/user.slice/x");
        // None: the container id, relative.
        assert_eq!(at(None, V1), "devices/user.slice/c1");
        assert_eq!(at(Some("/k/c"), V2), "k/c");
        // v2: below the parent of the caller's cgroup, as runc 1.1's fs2 driver puts it.
        assert_eq!(at(None, V2), "user.slice/c1");
        assert_eq!(at(Some("x/y"), V2), "user.slice/x/y");
        assert_eq!(at(Some("../../x"), V2), "user.slice/x");
        assert_eq!(at(Some("x"), "0::/\n"), "x");
        assert_eq!(at(Some("x"), "0::/a\n"), "x");
    }

    #[test]
    fn systemd_paths_expand_their_slice() {
        let at = |p: Option<&str>| runc_cgroup(p, "c1", true, V1).expect("path");
        assert_eq!(at(None), "devices/system.slice/runc-c1.scope");
        assert_eq!(
            at(Some("kubepods-besteffort.slice:cri-containerd:abc")),
            "devices/kubepods.slice/kubepods-besteffort.slice/cri-containerd-abc.scope"
        );
        assert_eq!(at(Some("-.slice::x.slice")), "devices/x.slice");
        assert!(runc_cgroup(Some("a:b"), "c1", true, V1).is_err());
        assert!(runc_cgroup(Some("a--b.slice:p:n"), "c1", true, V1).is_err());
    }

    #[test]
    fn within_is_by_component() {
        assert!(within("devices/a/b", "devices/a"));
        assert!(within("devices/a", "devices/a"));
        assert!(!within("devices/ab", "devices/a"));
    }

    #[test]
    fn the_file_is_written_beside_the_socket_and_read_back() {
        let dir = tempfile::tempdir().expect("tmp");
        let socket = dir.path().join("t.sock");
        assert_eq!(read_grant_cgroups(&socket).expect("read"), None);
        write_grant_cgroups(&grant_cgroups_path(&socket), ["devices/a", "devices/b c"])
            .expect("write");
        assert_eq!(
            read_grant_cgroups(&socket).expect("read"),
            Some(vec!["devices/a".to_string(), "devices/b c".to_string()])
        );
    }
}
