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

/// One line of `mountinfo` (proc(5)): the fields this module judges by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountEntry {
    pub mount_id: u64,
    pub parent_id: u64,
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
                Finding::Procfs { .. } => "procfs",
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
}
