//! `/proc/<pid>/mountinfo`, read as the kernel writes it, and what a GPU container's mount
//! table may not hold (docs/SECURITY.md, "Mounts as the kernel made them").
//!
//! A GPU container's device rules live in its cgroup. Any writable view of a cgroup
//! hierarchy lets a process of the container move itself into another cgroup (the root's
//! `cgroup.procs`) and open every GPU; a writable sysfs lets it unbind or remove a GPU
//! another tenant holds (`/sys/bus/pci/devices/*/remove`). How a config spells such a view
//! (option order, links, `/proc/self/root`, `rbind` of a parent, a remount, a mount
//! propagated in from the host later) does not matter here: this module reads the mounts
//! the kernel actually made in the container's mount namespace. tesserad runs it at the
//! prestart confirmation, after runc made every mount of the config and before the
//! container's process runs, and a finding refuses the start.
//!
//! Pure: [`parse`] takes the text, [`findings`] judges the entries.

use std::fmt;
use std::path::{Path, PathBuf};

/// One line of `mountinfo` (proc(5)): the fields this module judges by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_id: u64,
    pub parent_id: u64,
    /// The filesystem's device, `major:minor` (field 3): one per superblock, so one per
    /// procfs instance (Linux 5.8 and later mount a new one each time).
    pub device: String,
    /// The directory of the filesystem that is the root of this mount (field 4).
    pub root: String,
    /// Where it is mounted, relative to the reading process's root (field 5).
    pub mount_point: String,
    /// Per-mount options (field 6): `ro` or `rw` first.
    pub mount_options: Vec<String>,
    /// Optional fields: `shared:N`, `master:N`, `propagate_from:N`, `unbindable`.
    pub optional: Vec<String>,
    pub fstype: String,
    pub source: String,
    /// Per-superblock options (the last field).
    pub super_options: Vec<String>,
}

impl MountEntry {
    /// Writable through this mount: read-write both per mount and per superblock.
    pub fn writable(&self) -> bool {
        let rw = |opts: &[String]| !opts.iter().any(|o| o == "ro");
        rw(&self.mount_options) && rw(&self.super_options)
    }

    /// A cgroup hierarchy (v1 or v2).
    pub fn is_cgroup(&self) -> bool {
        self.fstype == "cgroup" || self.fstype == "cgroup2"
    }

    /// Mounts made elsewhere later reach this one: a slave of a peer group outside, or
    /// itself a member of a peer group (shared).
    pub fn receives_propagation(&self) -> Option<&str> {
        self.optional
            .iter()
            .find(|o| o.starts_with("master:") || o.starts_with("shared:"))
            .map(String::as_str)
    }
}

/// Why a line of mountinfo could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("mountinfo line {line}: {why}")]
pub struct ParseError {
    pub line: usize,
    pub why: String,
}

/// The kernel escapes space, tab, newline and backslash in paths as `\ooo` octal.
fn unescape(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 4 <= b.len() {
            let oct = &b[i + 1..i + 4];
            if oct.iter().all(|c| (b'0'..=b'7').contains(c)) {
                let v = (u32::from(oct[0] - b'0') << 6)
                    | (u32::from(oct[1] - b'0') << 3)
                    | u32::from(oct[2] - b'0');
                if let Ok(byte) = u8::try_from(v) {
                    out.push(byte);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses a whole mountinfo text. A line that does not have the kernel's shape is an
/// error (the caller refuses rather than judging a table it could not read).
pub fn parse(text: &str) -> Result<Vec<MountEntry>, ParseError> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| parse_line(l).map_err(|why| ParseError { line: i + 1, why }))
        .collect()
}

fn parse_line(line: &str) -> Result<MountEntry, String> {
    let fields: Vec<&str> = line.split(' ').collect();
    let sep = fields
        .iter()
        .position(|f| *f == "-")
        .ok_or_else(|| "no `-` separator before the filesystem type".to_string())?;
    if sep < 6 || fields.len() < sep + 4 {
        return Err(format!("{} fields, separator at {sep}", fields.len()));
    }
    let num = |i: usize, what: &str| {
        fields[i].parse::<u64>().map_err(|_| format!("{what} `{}` is not a number", fields[i]))
    };
    let list = |s: &str| s.split(',').filter(|o| !o.is_empty()).map(str::to_string).collect();
    Ok(MountEntry {
        mount_id: num(0, "mount id")?,
        parent_id: num(1, "parent id")?,
        device: fields[2].to_string(),
        root: unescape(fields[3]),
        mount_point: unescape(fields[4]),
        mount_options: list(fields[5]),
        optional: fields[6..sep].iter().map(|s| s.to_string()).collect(),
        fstype: fields[sep + 1].to_string(),
        source: unescape(fields[sep + 2]),
        super_options: list(fields[sep + 3]),
    })
}

/// The entries at or below `root` (a container's root as the reader sees it), each mount
/// point made relative to it (`/` for the root itself): the mounts a container keeps once
/// runc pivots into that root, as the container will name them.
pub fn below(entries: Vec<MountEntry>, root: &std::path::Path) -> Vec<MountEntry> {
    entries
        .into_iter()
        .filter_map(|mut e| {
            let rest = std::path::Path::new(&e.mount_point).strip_prefix(root).ok()?;
            e.mount_point = format!("/{}", rest.display());
            Some(e)
        })
        .collect()
}

/// What a GPU container's mount table may not hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    /// A cgroup hierarchy that can be written: moving a process into another cgroup
    /// leaves the device rules.
    WritableCgroup { mount_point: String, fstype: String, root: String },
    /// A sysfs that can be written: unbinding or removing a GPU another tenant holds.
    WritableSysfs { mount_point: String, root: String },
    /// A mount that later mounts made outside the container reach (propagation), so what
    /// was checked at start is not what the container will see.
    Propagated { mount_point: String, tag: String },
    /// A procfs elsewhere than `/proc`: a bind of another pid namespace's (the host's),
    /// whose `/proc/<pid>/root` leads into other processes' mounts.
    Procfs { mount_point: String },
    /// A mount that shows a path of tesserad's own (its socket, its state directory with
    /// every tenant's MPS pipe directories) that the container was not given
    /// ([`private_in_view`]).
    Private { mount_point: String, what: String },
    /// A procfs (wherever mounted, `/proc` too) that shows another pid namespace than the
    /// container's own ([`foreign_procfs`]): `shows` is what it showed, `None` unreadable.
    ForeignProcfs { mount_point: String, shows: Option<String>, own: String },
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let u = crate::untrusted;
        match self {
            Finding::WritableCgroup { mount_point, fstype, root } => write!(
                f,
                "{} is a writable {fstype} hierarchy (its directory {}): a process could move \
                 itself out of its device cgroup and open every GPU",
                u(mount_point),
                u(root)
            ),
            Finding::WritableSysfs { mount_point, root } => write!(
                f,
                "{} is a writable sysfs (its directory {}): a process could unbind or remove \
                 another tenant's GPU",
                u(mount_point),
                u(root)
            ),
            Finding::Procfs { mount_point } => write!(
                f,
                "{} is a procfs other than the container's /proc: /proc/<pid>/root of the \
                 processes it shows leads into their mounts",
                u(mount_point)
            ),
            Finding::ForeignProcfs { mount_point, shows, own } => write!(
                f,
                "{} is a procfs of {} where the container's own pid namespace is {}: it shows \
                 processes outside the container, another container's GPU processes among them, \
                 to attach to (pidfd_getfd, /proc/<pid>/mem) and to enter (/proc/<pid>/root)",
                u(mount_point),
                match shows {
                    Some(ns) => format!("{}", u(ns)),
                    None => "a pid namespace that cannot be read".to_string(),
                },
                u(own)
            ),
            Finding::Private { mount_point, what } => write!(
                f,
                "{} shows {}, which is tesserad's own (its API socket answers root as root; \
                 the MPS pipe directories are every tenant's control daemons)",
                u(mount_point),
                u(what)
            ),
            Finding::Propagated { mount_point, tag } => write!(
                f,
                "{} receives mounts made outside the container ({tag}): a writable cgroup or \
                 sysfs mounted there later would reach it",
                u(mount_point)
            ),
        }
    }
}

/// What a GPU container's mount table holds that it may not: every writable cgroup
/// hierarchy and sysfs, and every mount that receives propagation from outside.
pub fn findings(entries: &[MountEntry]) -> Vec<Finding> {
    let mut out = Vec::new();
    for e in entries {
        if e.is_cgroup() && e.writable() {
            out.push(Finding::WritableCgroup {
                mount_point: e.mount_point.clone(),
                fstype: e.fstype.clone(),
                root: e.root.clone(),
            });
        } else if e.fstype == "sysfs" && e.writable() {
            out.push(Finding::WritableSysfs {
                mount_point: e.mount_point.clone(),
                root: e.root.clone(),
            });
        } else if e.fstype == "proc" && !std::path::Path::new(&e.mount_point).starts_with("/proc") {
            out.push(Finding::Procfs { mount_point: e.mount_point.clone() });
        }
        if let Some(tag) = e.receives_propagation() {
            out.push(Finding::Propagated {
                mount_point: e.mount_point.clone(),
                tag: tag.to_string(),
            });
        }
    }
    out
}

/// Where a host path lies in the host's mount table `host` (as the reader sees it): the
/// device of the mount holding it (the deepest mount point at or above it; the last listed
/// where several are stacked) and its path within that filesystem (the mount's root joined
/// with the rest). `None`: no mount holds it (a relative path).
pub fn place(host: &[MountEntry], path: &Path) -> Option<(String, PathBuf)> {
    let m = host
        .iter()
        .enumerate()
        .filter(|(_, m)| path.starts_with(&m.mount_point))
        .max_by_key(|(i, m)| (Path::new(&m.mount_point).components().count(), *i))
        .map(|(_, m)| m)?;
    let rest = path.strip_prefix(&m.mount_point).ok()?;
    Some((m.device.clone(), Path::new(&m.root).join(rest)))
}

/// A path of tesserad's own where it lies ([`place`]), named for a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Private {
    pub device: String,
    pub within: PathBuf,
    pub name: String,
}

/// Whether a mount of the filesystem on `device` at its directory `root` shows `p`: the
/// same filesystem, one directory at or below the other (a bind of an ancestor shows it, a
/// bind of a directory inside it shows part of it).
pub fn shows(device: &str, root: &Path, p: &Private) -> bool {
    device == p.device && (p.within.starts_with(root) || root.starts_with(&p.within))
}

/// The first mount of a container's table (`entries`) that shows one of tesserad's own
/// paths (`private`, placed on the host with [`place`]), read from what the kernel made:
/// however a bind's source was spelled or swapped, its entry says which filesystem and
/// which directory of it the container got. Directories the container's grant brought in
/// itself (`given`: an MPS share's pipe directory, placed the same way) and what lies
/// below them are not counted.
pub fn private_in_view(
    entries: &[MountEntry],
    private: &[Private],
    given: &[Private],
) -> Option<Finding> {
    entries.iter().find_map(|e| {
        let root = Path::new(&e.root);
        if given.iter().any(|g| g.device == e.device && root.starts_with(&g.within)) {
            return None;
        }
        private
            .iter()
            .find(|p| shows(&e.device, root, p))
            .map(|p| Finding::Private { mount_point: e.mount_point.clone(), what: p.name.clone() })
    })
}

/// The first procfs of a container's table (`entries`, mount points as the container
/// names them) that is not of the container's own pid namespace `own` (as
/// `/proc/<init>/ns/pid` reads, `pid:[N]`), read from what the kernel made, not from the
/// config that asked for it: a procfs mounted whole (root `/`) must show `own`
/// (`shows(entry)`: the namespace of the pid 1 it lists, `None` unreadable: refused), and a
/// part of one (runc's read-only `/proc/sys`, a bind of `/proc/<pid>`) must be of an
/// instance (device) a whole one showed `own` for. A bind of the host's procfs at
/// `/proc`, where the config asked for a `proc` mount or a race swapped a bind's source, is
/// caught here where the config's checks cannot see it.
pub fn foreign_procfs(
    entries: &[MountEntry],
    own: &str,
    shows: impl Fn(&MountEntry) -> Option<String>,
) -> Option<Finding> {
    // A mount another one was stacked on later (at its mount point or above it) cannot be
    // reached by its path: what is read there is the top one's.
    let visible = |i: usize| {
        let at = Path::new(&entries[i].mount_point);
        !entries[i + 1..].iter().any(|f| at.starts_with(&f.mount_point))
    };
    let is_proc = |e: &&MountEntry| e.fstype == "proc";
    let mut own_devices = std::collections::BTreeSet::new();
    for (i, e) in entries.iter().enumerate().filter(|(_, e)| is_proc(e) && e.root == "/") {
        if !visible(i) {
            continue;
        }
        match shows(e) {
            Some(ns) if ns == own => {
                own_devices.insert(e.device.as_str());
            }
            shown => {
                return Some(Finding::ForeignProcfs {
                    mount_point: e.mount_point.clone(),
                    shows: shown,
                    own: own.to_string(),
                })
            }
        }
    }
    entries.iter().filter(is_proc).find(|e| !own_devices.contains(e.device.as_str())).map(|e| {
        Finding::ForeignProcfs {
            mount_point: e.mount_point.clone(),
            shows: Some(format!(
                "the instance {} (its directory {}; no whole mount of it reachable and \
                 showing the container's own)",
                e.device, e.root
            )),
            own: own.to_string(),
        }
    })
}

/// tesserad's own `paths` (canonical) where they lie in the host's table `host`: each
/// path's own place ([`place`]), and every filesystem mounted inside one of them (a
/// latency report's tmpfs in the state directory), whole.
pub fn private_places(host: &[MountEntry], paths: &[PathBuf]) -> Vec<Private> {
    let mut out = Vec::new();
    for p in paths {
        let name = p.display().to_string();
        if let Some((device, within)) = place(host, p) {
            out.push(Private { device, within, name: name.clone() });
        }
        for m in host.iter().filter(|m| Path::new(&m.mount_point).starts_with(p)) {
            out.push(Private {
                device: m.device.clone(),
                within: PathBuf::from(&m.root),
                name: format!("{} (mounted inside {name})", m.mount_point),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOST: &str = "\
22 1 0:21 / / rw,relatime shared:1 - overlay overlay rw,lowerdir=/l
30 22 0:26 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw
31 30 0:27 / /sys/fs/cgroup rw,relatime shared:8 - tmpfs tmpfs rw,mode=755
35 31 0:31 / /sys/fs/cgroup/devices rw,relatime shared:12 - cgroup cgroup rw,devices
36 22 0:40 /a\\040b /mnt/with\\040space ro,relatime - ext4 /dev/vda rw
";

    #[test]
    fn lines_are_read_as_the_kernel_writes_them() {
        let e = parse(HOST).expect("parses");
        assert_eq!(e.len(), 5);
        assert_eq!(e[3].mount_point, "/sys/fs/cgroup/devices");
        assert_eq!(e[3].fstype, "cgroup");
        assert_eq!(e[3].super_options, vec!["rw", "devices"]);
        assert_eq!(e[3].optional, vec!["shared:12"]);
        assert_eq!(e[4].mount_point, "/mnt/with space", "octal escapes undone");
        assert_eq!(e[4].root, "/a b");
        assert!(!e[4].writable(), "ro per mount");
        assert!(e[3].writable());
    }

    #[test]
    fn only_the_mounts_below_the_root_are_the_containers() {
        let t = "\
30 22 0:26 / /sys rw - sysfs sysfs rw
40 39 0:50 / /b/rootfs rw - overlay overlay rw
41 40 0:26 / /b/rootfs/sys ro - sysfs sysfs rw
42 40 0:27 / /b/rootfsx rw - tmpfs tmpfs rw
";
        let kept = below(parse(t).expect("parses"), std::path::Path::new("/b/rootfs"));
        let points: Vec<&str> = kept.iter().map(|e| e.mount_point.as_str()).collect();
        assert_eq!(points, vec!["/", "/sys"], "the host's /sys and a sibling are not kept");
        assert_eq!(findings(&kept), vec![]);
    }

    #[test]
    fn malformed_lines_are_errors_with_their_number() {
        let err = parse("22 1 0:21 / / rw - overlay\n").expect_err("too short");
        assert_eq!(err.line, 1);
        assert!(parse("x 1 0:21 / / rw - overlay overlay rw\n").is_err(), "mount id");
        assert!(parse("22 1 0:21 / / rw overlay overlay rw\n").is_err(), "no separator");
    }

    #[test]
    fn the_host_table_has_every_finding() {
        let f = findings(&parse(HOST).expect("parses"));
        let kinds: Vec<&str> = f
            .iter()
            .map(|f| match f {
                Finding::WritableCgroup { .. } => "cgroup",
                Finding::WritableSysfs { .. } => "sysfs",
                Finding::Propagated { .. } => "propagated",
                Finding::Procfs { .. } | Finding::ForeignProcfs { .. } => "procfs",
                Finding::Private { .. } => "private",
            })
            .collect();
        assert!(kinds.contains(&"cgroup") && kinds.contains(&"sysfs"), "{kinds:?}");
        assert_eq!(kinds.iter().filter(|k| **k == "propagated").count(), 4, "{kinds:?}");
        let msg = f[0].to_string();
        assert!(msg.contains("receives mounts made outside"), "{msg}");
    }

    #[test]
    fn a_container_table_of_read_only_views_and_private_mounts_is_clean() {
        let t = "\
100 90 0:50 / / rw,relatime - overlay overlay rw
101 100 0:51 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
102 100 0:52 / /sys ro,nosuid,nodev,noexec,relatime - sysfs sysfs ro
103 102 0:53 / /sys/fs/cgroup ro,nosuid,nodev,noexec - tmpfs tmpfs ro,mode=755
104 103 0:31 /c1 /sys/fs/cgroup/devices ro,nosuid,nodev,noexec,relatime - cgroup cgroup rw,devices
";
        assert_eq!(findings(&parse(t).expect("parses")), vec![]);
        // The container's /proc and runc's binds below it are its own.
        let procs = "106 100 0:51 /sys /proc/sys ro - proc proc rw\n";
        assert_eq!(findings(&parse(procs).expect("parses")), vec![]);
        let host_proc = "107 100 0:5 / /host/proc ro - proc proc rw\n";
        assert_eq!(
            findings(&parse(host_proc).expect("parses")),
            vec![Finding::Procfs { mount_point: "/host/proc".into() }]
        );
        // A read-only superblock under a read-write mount is not writable either.
        let sb_ro = "105 100 0:54 / /x rw - cgroup2 cgroup2 ro\n";
        assert_eq!(findings(&parse(sb_ro).expect("parses")), vec![]);
    }

    /// Round 8: a procfs is the container's only where the kernel says it shows the
    /// container's pid namespace; where it is mounted and what the config asked for do not
    /// count.
    #[test]
    fn a_procfs_is_the_containers_only_if_it_shows_its_own_pid_namespace() {
        let table = |lines: &str| parse(lines).expect("table");
        let own = "pid:[4026532001]";
        let host = "pid:[4026531836]";
        // runc's usual: its own proc at /proc, /proc/sys a part of it, kcore masked.
        let usual = table(
            "100 99 0:50 / /proc rw - proc proc rw\n\
             101 100 0:50 /sys /proc/sys ro - proc proc rw\n\
             102 100 0:5 /null /proc/kcore rw - devtmpfs udev rw\n",
        );
        let shows = |at: &'static str, ns: &'static str| {
            move |e: &MountEntry| (e.mount_point == at).then(|| ns.to_string())
        };
        assert_eq!(foreign_procfs(&usual, own, shows("/proc", own)), None);
        // The host's procfs bound at /proc: the same table, another namespace.
        let f = foreign_procfs(&usual, own, shows("/proc", host)).expect("the host's at /proc");
        assert!(f.to_string().contains("/proc is a procfs of pid:[4026531836]"), "{f}");
        // Unreadable: refused.
        assert!(matches!(
            foreign_procfs(&usual, own, |_| None),
            Some(Finding::ForeignProcfs { shows: None, .. })
        ));
        // A part of another instance (a bind of the host's /proc/1 at /x).
        let part = table(
            "100 99 0:50 / /proc rw - proc proc rw\n\
             103 99 0:22 /1 /x ro - proc proc rw\n",
        );
        let f = foreign_procfs(&part, own, shows("/proc", own)).expect("a part of the host's");
        assert!(f.to_string().starts_with("/x is a procfs of the instance 0:22"), "{f}");
        // No procfs at all: nothing to judge.
        assert_eq!(foreign_procfs(&table("1 0 0:1 / / rw - tmpfs t rw\n"), own, |_| None), None);
    }

    /// Round 8: a mount shows tesserad's own path if it is of the same filesystem and one
    /// directory holds the other; the grant's own pipe directory does not count.
    #[test]
    fn a_mount_of_tesserads_own_paths_or_an_ancestor_of_them_is_found() {
        let host = parse(
            "1 0 8:1 / / rw - ext4 /dev/sda1 rw\n\
             2 1 0:30 / /run rw - tmpfs tmpfs rw\n\
             3 1 8:2 /lib /var/lib rw - ext4 /dev/sda2 rw\n",
        )
        .expect("host");
        let at = |p: &str, name: &str| {
            let (device, within) = place(&host, Path::new(p)).expect("placed");
            Private { device, within, name: name.into() }
        };
        let state = at("/var/lib/tessera", "the state directory");
        assert_eq!(
            (state.device.as_str(), state.within.as_path()),
            ("8:2", Path::new("/lib/tessera"))
        );
        let socket = at("/run/tessera/tesserad.sock", "the socket");
        let private = [state.clone(), socket];
        let pipe = at("/var/lib/tessera/mps/gpu0/acme/pipe", "a pipe directory");
        let table = |lines: &str| parse(lines).expect("table");
        // The state directory's filesystem at its root (a bind of /var/lib), and a tenant's
        // pipe directory of another share: both show it.
        for (line, mp) in [
            ("10 9 8:2 / /host rw - ext4 /dev/sda2 rw\n", "/host"),
            (
                "10 9 8:2 /lib/tessera/mps/gpu1/b/pipe /tmp/nvidia-mps ro - ext4 /dev/sda2 rw\n",
                "/tmp/nvidia-mps",
            ),
            ("10 9 0:30 /tessera /r ro - tmpfs tmpfs rw\n", "/r"),
        ] {
            let f =
                private_in_view(&table(line), &private, std::slice::from_ref(&pipe)).expect(line);
            assert!(f.to_string().starts_with(&format!("{mp} shows ")), "{f}");
        }
        // The grant's own pipe directory, and mounts of other filesystems or directories.
        for line in [
            "10 9 8:2 /lib/tessera/mps/gpu0/acme/pipe /run/nvidia-mps ro - ext4 /dev/sda2 rw\n",
            "10 9 8:1 / /host rw - ext4 /dev/sda1 rw\n",
            "10 9 8:2 /lib/other /x rw - ext4 /dev/sda2 rw\n",
            "10 9 0:30 /user /r rw - tmpfs tmpfs rw\n",
        ] {
            assert_eq!(
                private_in_view(&table(line), &private, std::slice::from_ref(&pipe)),
                None,
                "{line}"
            );
        }
    }

    /// Round 9 (rt-iso5): a foreign procfs hidden under the container's own at one mount
    /// point cannot be read there; its instance counts as foreign, and so does every part
    /// of it (a bind of its `/<pid>/mem` under `/proc`).
    #[test]
    fn a_procfs_hidden_under_another_is_not_taken_for_the_one_on_top() {
        let own = "pid:[4026532001]";
        let table = parse(
            "100 99 0:127 / /proc rw - proc proc rw\n\
             101 100 0:21 / /proc ro - proc proc rw\n\
             102 101 0:127 / /proc rw - proc proc rw\n\
             103 102 0:21 /77/mem /proc/meminfo ro - proc proc rw\n",
        )
        .expect("table");
        // Read by path, every /proc shows the top one: the container's own.
        let f = foreign_procfs(&table, own, |_| Some(own.to_string())).expect("the hidden one");
        assert!(f.to_string().contains("0:21"), "{f}");
        // Without the hidden one and its part: the container's own.
        assert_eq!(foreign_procfs(&table[..1], own, |_| Some(own.to_string())), None);
    }

    /// Round 9 (rt-iso5): a filesystem mounted inside a private path is private whole.
    #[test]
    fn a_filesystem_mounted_inside_a_private_path_is_private() {
        let host = parse(
            "1 0 8:1 / / rw - ext4 /dev/sda1 rw\n\
             2 1 0:70 / /var/lib/tessera/reports/c1 rw - tmpfs tmpfs rw\n",
        )
        .expect("host");
        let private = private_places(&host, &[PathBuf::from("/var/lib/tessera")]);
        let report = parse("10 9 0:70 / /r rw - tmpfs tmpfs rw\n").expect("table");
        let f = private_in_view(&report, &private, &[]).expect("the report's tmpfs");
        assert!(f.to_string().contains("mounted inside /var/lib/tessera"), "{f}");
    }
}
