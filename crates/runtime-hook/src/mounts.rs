//! A GPU container's mounts, read as runc 1.1 makes them (docs/SECURITY.md, "Mounts as
//! runc makes them").
//!
//! What a mount gives the container is decided by runc and the kernel, not by how the
//! config spells it:
//! - **Options apply in order** (runc's `parseMountOptions`): `ro` then `rw` is read-write,
//!   `bind` or `rbind` anywhere makes a bind mount whatever `type` says (`rbind` brings
//!   every submount of the source), `rro`/`rrw` set or clear read-only recursively — on
//!   bind mounts only (runc 1.1 applies them after a bind and after nothing else), with a
//!   set winning over a clear (the kernel's `mount_setattr`). A bind keeps the source
//!   mount's read-only flag unless runc remounts it, which it does only when an option
//!   beyond `bind`/`rbind`/`remount` is set, and then exactly as `ro` says.
//! - **The source is a host path the kernel resolves**: relative to the bundle, through
//!   links and `..`, through `/proc/self/root` (runc's own root, the host's). Tessera asks
//!   the kernel ([`HostFacts::canonical`]) and judges what the path is *on the host*: the
//!   filesystem of the mount holding it, and for `rbind` every mount below it. A source
//!   under `/proc` is refused outright: `/proc/self/cwd`, `/proc/self/fd/N` and the like
//!   name runc's init there and this process here.
//! - **A mount can change what a later one sees**: a `remount` changes the flags of a
//!   mount made before it, and a bind of a path inside the bundle where an earlier mount
//!   of the config landed binds what that mount made. Both are refused.
//! - **Propagation**: runc makes the container's mounts slaves of the host's unless told
//!   otherwise, so a mount made on the host later (or by another container sharing a
//!   peer group) appears inside. GPU containers get `rootfsPropagation: rprivate`;
//!   shared or slave propagation, on the root or on a mount, is refused.
//!
//! For a GPU container, any view of a cgroup hierarchy or of sysfs that is writable is
//! refused, naming the mount and why. This is the early answer, with the config's own
//! index; the last word is tesserad's reading of the mounts runc actually made
//! ([`tessera_api::mountinfo`], at the prestart confirmation).

use std::path::{Component, Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;
use tessera_api::mountinfo::MountEntry;
use tessera_api::untrusted;

/// Why a GPU container's mounts are refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MountError {
    #[error("malformed config at `{}`: {}", untrusted(.at), untrusted(.why))]
    Shape { at: String, why: String },
    /// A writable view of a cgroup hierarchy (or sysfs) in the container.
    #[error("{at}: {why}: a GPU container could rewrite its own device rules and open every GPU")]
    CgroupWritable { at: String, why: String },
    #[error("{at}: {why}: a GPU container could unbind or remove another tenant's GPU")]
    SysfsWritable { at: String, why: String },
    /// Something whose meaning to runc differs from its reading here, or that changes a
    /// mount after it was judged.
    #[error("{at}: {why}")]
    Unjudgeable { at: String, why: String },
}

fn shape(at: impl Into<String>, why: impl Into<String>) -> MountError {
    MountError::Shape { at: at.into(), why: why.into() }
}

/// Mount propagation, as runc's table names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Propagation {
    Private,
    Slave,
    Shared,
    Unbindable,
}

/// One mount of the config as runc 1.1 will make it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountPlan {
    pub index: usize,
    pub destination: String,
    /// The filesystem type runc mounts (`bind` for any bind).
    pub fstype: String,
    pub source: Option<String>,
    pub bind: bool,
    /// `rbind`: every submount of the source comes along.
    pub recursive: bool,
    /// `MS_RDONLY` after every option in order.
    pub read_only: bool,
    /// `MS_REMOUNT`.
    pub remount: bool,
    /// Whether runc remounts a bind to apply its flags (an option beyond
    /// `bind`/`rbind`/`remount` is set).
    pub bind_remount: bool,
    /// `rro`/`rrw` (bind mounts only): `Some(true)` read-only all the way down.
    pub rec_read_only: Option<bool>,
    pub propagation: Vec<Propagation>,
}

impl MountPlan {
    fn at(&self) -> String {
        format!("mounts[{}] ({})", self.index, untrusted(&self.destination))
    }
}

#[derive(Deserialize)]
struct MountView {
    destination: String,
    #[serde(default, rename = "type")]
    typ: Option<String>,
    #[serde(default)]
    source: Option<String>,
    #[serde(default)]
    options: Option<Vec<String>>,
}

/// runc 1.1's mount flag table: option → (clears?, is read-only, is bind, is recursive,
/// is remount). Options not here are filesystem data (or propagation, or `r*` attributes).
fn flag(option: &str) -> Option<(bool, Flag)> {
    Some(match option {
        "ro" => (false, Flag::ReadOnly),
        "rw" => (true, Flag::ReadOnly),
        "bind" => (false, Flag::Bind),
        "rbind" => (false, Flag::RecursiveBind),
        "remount" => (false, Flag::Remount),
        "defaults" => (false, Flag::None),
        "acl" | "dirsync" | "iversion" | "lazytime" | "mand" | "noatime" | "nodev"
        | "nodiratime" | "noexec" | "nosuid" | "nosymfollow" | "relatime" | "silent"
        | "strictatime" | "sync" => (false, Flag::Other),
        "async" | "atime" | "dev" | "diratime" | "exec" | "loud" | "noacl" | "noiversion"
        | "nolazytime" | "nomand" | "norelatime" | "nostrictatime" | "suid" | "symfollow" => {
            (true, Flag::Other)
        }
        _ => return None,
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Flag {
    None,
    ReadOnly,
    Bind,
    RecursiveBind,
    Remount,
    Other,
}

fn propagation(option: &str) -> Option<Propagation> {
    Some(match option {
        "private" | "rprivate" => Propagation::Private,
        "slave" | "rslave" => Propagation::Slave,
        "shared" | "rshared" => Propagation::Shared,
        "unbindable" | "runbindable" => Propagation::Unbindable,
        _ => return None,
    })
}

/// The mounts of a config (its canonical view), each as runc will make it.
pub fn plans(spec: &Value) -> Result<Vec<MountPlan>, MountError> {
    let items = match spec.get("mounts") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(shape("mounts", "expected an array")),
    };
    items
        .iter()
        .enumerate()
        .map(|(index, v)| {
            let at = format!("mounts[{index}]");
            let m: MountView =
                serde_json::from_value(v.clone()).map_err(|e| shape(&at, e.to_string()))?;
            Ok(plan(index, m))
        })
        .collect()
}

fn plan(index: usize, m: MountView) -> MountPlan {
    let (mut read_only, mut bind, mut recursive, mut remount, mut other) =
        (false, false, false, false, false);
    let (mut rec_set, mut rec_clear) = (false, false);
    let mut prop = Vec::new();
    for o in m.options.iter().flatten() {
        if let Some((clear, f)) = flag(o) {
            match f {
                Flag::ReadOnly => read_only = !clear,
                Flag::Bind => bind = true,
                Flag::RecursiveBind => (bind, recursive) = (true, true),
                Flag::Remount => remount = true,
                // A clearing flag clears a bit that may not be set: runc still remounts
                // only when some bit beyond bind/rec/remount is set at the end; `rw`
                // alone leaves none set.
                Flag::Other => other |= !clear,
                Flag::None => {}
            }
        } else if let Some(p) = propagation(o) {
            prop.push(p);
        } else if o == "rro" {
            rec_set = true;
        } else if o == "rrw" {
            rec_clear = true;
        }
    }
    // The kernel's mount_setattr clears `attr_clr`, then sets `attr_set`: a set wins.
    let rec_read_only = match (rec_set, rec_clear) {
        (true, _) => Some(true),
        (false, true) => Some(false),
        _ => None,
    };
    let fstype = if bind { "bind".to_string() } else { m.typ.unwrap_or_default() };
    MountPlan {
        index,
        destination: m.destination,
        fstype,
        source: m.source,
        bind,
        recursive,
        read_only,
        remount,
        bind_remount: read_only || other,
        rec_read_only: if bind { rec_read_only } else { None },
        propagation: prop,
    }
}

/// What the host's kernel says about paths and mounts (the seam: [`LinuxHostFacts`] on a
/// node, a table in tests).
pub trait HostFacts {
    /// The path the kernel resolves `p` to (links, `..`, `/proc/self/root`), or `None`
    /// if it does not exist.
    fn canonical(&self, p: &Path) -> Option<PathBuf>;
    /// The host's mount table.
    fn mounts(&self) -> &[MountEntry];
}

/// The machine this process runs on: the kernel's path resolution and
/// `/proc/self/mountinfo`.
#[derive(Debug)]
pub struct LinuxHostFacts {
    mounts: Vec<MountEntry>,
}

impl LinuxHostFacts {
    /// Reads this process's mount table.
    pub fn read() -> Result<Self, MountError> {
        let at = "/proc/self/mountinfo";
        let text = std::fs::read_to_string(at).map_err(|e| shape(at, e.to_string()))?;
        let mounts = tessera_api::mountinfo::parse(&text).map_err(|e| shape(at, e.to_string()))?;
        Ok(LinuxHostFacts { mounts })
    }
}

impl HostFacts for LinuxHostFacts {
    fn canonical(&self, p: &Path) -> Option<PathBuf> {
        std::fs::canonicalize(p).ok()
    }
    fn mounts(&self) -> &[MountEntry] {
        &self.mounts
    }
}

/// `filepath.Clean` of an absolute path, lexically: `.` and `..` resolved, no trailing `/`.
fn clean(p: &Path) -> PathBuf {
    let mut out = PathBuf::from("/");
    for c in p.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    out
}

/// `a` is `b` or below it, component-wise.
fn within(a: &Path, b: &Path) -> bool {
    a.starts_with(b)
}

/// The mount of the host table holding `p`: the deepest mount point at or above it (the
/// last listed, where several are stacked on one point).
fn holding<'a>(mounts: &'a [MountEntry], p: &Path) -> Option<&'a MountEntry> {
    mounts
        .iter()
        .enumerate()
        .filter(|(_, m)| within(p, Path::new(&m.mount_point)))
        .max_by_key(|(i, m)| (Path::new(&m.mount_point).components().count(), *i))
        .map(|(_, m)| m)
}

/// A bind's source as runc hands it to mount(2): runc joins a relative source to the
/// bundle with `filepath.Join`, which cleans `..` lexically; an absolute one goes as
/// written, and the kernel resolves `..` after the links before it.
fn joined_source(bundle: &Path, source: &str) -> PathBuf {
    let raw = Path::new(source);
    if raw.is_absolute() {
        raw.to_path_buf()
    } else {
        clean(&bundle.join(raw))
    }
}

/// [`joined_source`] where the host resolves it now (links followed), lexically where it
/// does not exist.
fn resolved_source(bundle: &Path, source: &str, host: &dyn HostFacts) -> PathBuf {
    let joined = joined_source(bundle, source);
    host.canonical(&joined).unwrap_or_else(|| clean(&joined))
}

/// The procfs a bind of `resolved` (as the host resolves it) brings along: the one holding
/// it, or, for a recursive bind, one mounted below it.
fn procfs_brought<'a>(
    mounts: &'a [MountEntry],
    resolved: &Path,
    recursive: bool,
) -> Option<&'a MountEntry> {
    holding(mounts, resolved).filter(|m| m.fstype == "proc").or_else(|| {
        recursive
            .then(|| {
                mounts.iter().find(|m| {
                    let mp = Path::new(&m.mount_point);
                    m.fstype == "proc" && mp != resolved && within(mp, resolved)
                })
            })
            .flatten()
    })
}

/// A container without a GPU (a GPU container refuses every such bind, [`check_sources`]):
/// the first bind that brings a procfs of the host's mount table along (its source on one,
/// or one below a recursive bind's source; sources resolved as the host resolves them now,
/// `bundle`-relative ones from the bundle), as where in the config and which procfs. Such a
/// view shows processes outside the container's pid namespace, every GPU container's among
/// them, read-only or not ([`crate::spec::check_process_view`] decides).
pub fn procfs_bind(
    spec: &Value,
    bundle: &Path,
    host: &dyn HostFacts,
) -> Result<Option<(String, String)>, MountError> {
    let bundle = host.canonical(bundle).unwrap_or_else(|| clean(bundle));
    for p in plans(spec)? {
        let (true, Some(source)) = (p.bind, p.source.as_deref()) else { continue };
        let resolved = resolved_source(&bundle, source, host);
        if let Some(m) = procfs_brought(host.mounts(), &resolved, p.recursive) {
            let what = format!(
                "a bind of {} brings the procfs at {} along",
                untrusted(source).max_chars(200),
                untrusted(&m.mount_point).max_chars(200)
            );
            return Ok(Some((p.at(), what)));
        }
    }
    Ok(None)
}

/// Every container: no bind shows a path of tesserad's own (`private`, canonical: its
/// socket, its state directory with every tenant's MPS pipe directories; see
/// [`tessera_api::private_paths`]). A bind shows one where its source (as the host
/// resolves it now, `bundle`-relative ones from the bundle) is that path, inside it, or an
/// ancestor on the same filesystem ([`tessera_api::mountinfo::shows`]), or, for a recursive
/// bind, an ancestor on any. What the create's checks cannot see (a source swapped before
/// runc's mount) is read again from the mounts runc made ([`tessera_api::mountinfo::private_in_view`]).
/// `given`: the (source, destination) of each bind the container's grant injected (an MPS
/// share's pipe directory), not judged.
pub fn check_private_binds(
    spec: &Value,
    bundle: &Path,
    host: &dyn HostFacts,
    private: &[PathBuf],
    given: &[(&str, &str)],
) -> Result<(), MountError> {
    let bundle = host.canonical(bundle).unwrap_or_else(|| clean(bundle));
    let mounts = host.mounts();
    let placed = tessera_api::mountinfo::private_places(mounts, private);
    for p in plans(spec)? {
        let (true, Some(source)) = (p.bind, p.source.as_deref()) else { continue };
        if given.contains(&(source, p.destination.as_str())) {
            continue;
        }
        let resolved = resolved_source(&bundle, source, host);
        let Some((device, root)) = tessera_api::mountinfo::place(mounts, &resolved) else {
            continue;
        };
        // By filesystem and directory; by path too: inside one (a filesystem mounted there
        // later), or, recursive, above one.
        let hit = placed
            .iter()
            .find(|at| tessera_api::mountinfo::shows(&device, &root, at))
            .map(|at| at.name.clone())
            .or_else(|| {
                private
                    .iter()
                    .find(|path| {
                        resolved.starts_with(path) || (p.recursive && path.starts_with(&resolved))
                    })
                    .map(|path| path.display().to_string())
            });
        if let Some(path) = hit {
            return Err(MountError::Unjudgeable {
                at: p.at(),
                why: format!(
                    "a bind of {} shows {}, which is tesserad's own (its API socket answers root \
                     as root; its state directory holds every tenant's MPS control daemons)",
                    untrusted(source).max_chars(200),
                    path
                ),
            });
        }
    }
    Ok(())
}

/// What a view shows, for a message.
fn kind(m: &MountEntry) -> Option<&'static str> {
    match m.fstype.as_str() {
        "cgroup" => Some("a cgroup hierarchy"),
        "cgroup2" => Some("a cgroup2 hierarchy"),
        "sysfs" => Some("sysfs"),
        _ => None,
    }
}

fn refusal(plan: &MountPlan, what: &str, why: String) -> MountError {
    if what == "sysfs" {
        MountError::SysfsWritable { at: plan.at(), why }
    } else {
        MountError::CgroupWritable { at: plan.at(), why }
    }
}

/// Checks a GPU container's mounts (its canonical config, its bundle directory, the root
/// runc will use) against what runc 1.1 and the host's kernel will make of them.
pub fn check(
    spec: &Value,
    bundle: &Path,
    rootfs: &Path,
    host: &dyn HostFacts,
) -> Result<(), MountError> {
    check_options(spec)?;
    check_sources(spec, bundle, rootfs, host)
}

/// What can be judged from the config alone: the root's propagation, and each mount's
/// options (remounts, propagation, cgroup and sysfs filesystems mounted anew).
pub fn check_options(spec: &Value) -> Result<(), MountError> {
    check_root_propagation(spec)?;
    for p in plans(spec)? {
        check_flags(&p)?;
    }
    Ok(())
}

/// What needs the host: each bind mount's source where the kernel resolves it, and what
/// it brings along.
pub fn check_sources(
    spec: &Value,
    bundle: &Path,
    rootfs: &Path,
    host: &dyn HostFacts,
) -> Result<(), MountError> {
    let plans = plans(spec)?;
    let bundle = host.canonical(bundle).unwrap_or_else(|| clean(bundle));
    let rootfs = host.canonical(rootfs).unwrap_or_else(|| clean(rootfs));
    for (i, p) in plans.iter().enumerate() {
        check_bind(p, &plans[..i], &bundle, &rootfs, host)?;
    }
    Ok(())
}

/// `linux.rootfsPropagation`: absent, `private` or `rprivate` (made `rprivate`).
fn check_root_propagation(spec: &Value) -> Result<(), MountError> {
    match spec.pointer("/linux/rootfsPropagation") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(s)) if matches!(s.as_str(), "" | "private" | "rprivate") => Ok(()),
        Some(Value::String(s)) => Err(MountError::Unjudgeable {
            at: "linux.rootfsPropagation".into(),
            why: format!(
                "`{}` lets mounts made outside the container after its start appear inside a \
                 GPU container (a writable cgroup among them); GPU containers use rprivate",
                untrusted(s)
            ),
        }),
        Some(_) => Err(shape("linux.rootfsPropagation", "expected a string")),
    }
}

/// Makes a GPU container's mount propagation private all the way down: runc's default
/// (`rslave`) would let host mounts made later appear inside.
pub fn make_private(spec: &mut Value) -> Result<(), MountError> {
    check_root_propagation(spec)?;
    let linux = spec
        .get_mut("linux")
        .and_then(Value::as_object_mut)
        .ok_or_else(|| shape("linux", "expected an object"))?;
    linux.insert("rootfsPropagation".into(), Value::from("rprivate"));
    Ok(())
}

/// The filesystems runc may mount anew in a container on a Tessera node: each gives the
/// container an instance of its own (or of its namespace's: `proc` of its pid namespace,
/// `sysfs` of its network namespace, `mqueue` of its IPC namespace, `cgroup` of its cgroup
/// namespace), never the host's. Anything else may be one the kernel has a single instance
/// of for the whole host (`binfmt_misc`: an interpreter the host's execs run; `devtmpfs`:
/// the host's `/dev`; `debugfs`, `tracefs`, `securityfs`, `bpf`, `configfs`, `efivarfs`,
/// ...) or mount host paths by its options (`overlay`'s `lowerdir`), which no bind check
/// here reads: refused, for every container. (`bind` as a type without the bind option is
/// no filesystem: the kernel refuses it.)
pub const OWN_INSTANCE_FILESYSTEMS: &[&str] =
    &["proc", "sysfs", "tmpfs", "ramfs", "devpts", "mqueue", "cgroup", "cgroup2", "bind"];

/// A container without a GPU (a GPU container's mounts are judged more closely, with the
/// host's mount table: [`check`]): sysfs mounted anew is the host's kernel objects but for
/// the network namespace's (`/sys/bus/pci/devices/<gpu>/remove`), and cgroup2 (or a v1
/// hierarchy) without a cgroup namespace the host's whole hierarchy: read-only.
pub fn check_kernel_views_read_only(spec: &Value) -> Result<(), MountError> {
    for p in plans(spec)? {
        if !p.bind && matches!(p.fstype.as_str(), "sysfs" | "cgroup" | "cgroup2") && !p.read_only {
            return Err(MountError::Unjudgeable {
                at: p.at(),
                why: format!(
                    "{} mounted writable (options in order leave it read-write): the host's \
                     kernel objects or cgroups, tesserad's and every GPU grant's included",
                    p.fstype
                ),
            });
        }
    }
    Ok(())
}

/// A container without a GPU (a GPU container's binds are judged where the kernel resolves
/// them, [`check_sources`]): a writable bind whose source (as the host resolves it now,
/// links followed; `bundle`-relative sources from the bundle) is the host's `/proc` or
/// `/sys`, or at or below the container's own `proc`, `sysfs` or cgroup mount of an earlier
/// entry (runc makes the mounts in order, in the container's mount namespace: a bind of
/// `rootfs/proc` after the `proc` mount is that proc, outside the paths runc keeps
/// read-only). A read-only bind of them stays (monitoring agents read the host's).
pub fn check_proc_binds(spec: &Value, bundle: &Path, rootfs: &Path) -> Result<(), MountError> {
    let plans = plans(spec)?;
    let canonical_rootfs = std::fs::canonicalize(rootfs).unwrap_or_else(|_| rootfs.to_path_buf());
    let mut kernel_views: Vec<PathBuf> = vec![PathBuf::from("/proc"), PathBuf::from("/sys")];
    for p in &plans {
        if !p.bind {
            if matches!(p.fstype.as_str(), "proc" | "sysfs" | "cgroup" | "cgroup2") {
                let inside = clean(Path::new(&p.destination));
                let rel = inside.strip_prefix("/").unwrap_or(&inside).to_path_buf();
                kernel_views.push(rootfs.join(&rel));
                kernel_views.push(canonical_rootfs.join(&rel));
            }
            continue;
        }
        if p.read_only {
            continue;
        }
        let Some(source) = p.source.as_deref() else { continue };
        let joined = bundle.join(source);
        let resolved = std::fs::canonicalize(&joined).unwrap_or_else(|_| clean(&joined));
        if let Some(view) = kernel_views.iter().find(|v| within(&resolved, v)) {
            return Err(MountError::Unjudgeable {
                at: p.at(),
                why: format!(
                    "a writable bind of {} ({}): a proc, sysfs or cgroup view outside the paths \
                     runc keeps read-only (the host's sysctls, kernel objects and cgroups)",
                    untrusted(source).max_chars(200),
                    view.display()
                ),
            });
        }
    }
    Ok(())
}

/// A container without a GPU (a GPU container's mounts are made private all the way down,
/// [`make_private`]): no mount of it is shared with the host's peer group —
/// `linux.rootfsPropagation` `shared`/`rshared`, or a mount's `shared`/`rshared` option —
/// so what runc makes for it (a bind whose source was swapped after these checks among
/// them) does not spread to the host and from there into other containers' volumes after
/// their own judgement. Receiving the host's mounts (`slave`, Kubernetes' HostToContainer)
/// stays.
pub fn check_no_shared_propagation(spec: &Value) -> Result<(), MountError> {
    if let Some(Value::String(p)) = spec.pointer("/linux/rootfsPropagation") {
        if matches!(p.as_str(), "shared" | "rshared") {
            return Err(MountError::Unjudgeable {
                at: "linux.rootfsPropagation".into(),
                why: format!(
                    "`{}`: the mounts runc makes for the container would spread to the host and \
                     into other containers after their checks (Kubernetes' Bidirectional \
                     propagation, a privileged pod's)",
                    untrusted(p)
                ),
            });
        }
    }
    for p in plans(spec)? {
        if p.propagation.contains(&Propagation::Shared) {
            return Err(MountError::Unjudgeable {
                at: p.at(),
                why: "a shared mount: what is mounted under it spreads to the host and into \
                      other containers after their checks"
                    .into(),
            });
        }
    }
    Ok(())
}

/// Every container, GPU or not: each filesystem runc mounts anew is one of
/// [`OWN_INSTANCE_FILESYSTEMS`], and `proc` is mounted at `/proc` only (runc keeps
/// `/proc/sys` and the rest read-only and masked by path: a second `proc` elsewhere would
/// be a writable `/proc/sys`, the host's `kernel.core_pattern` where the container has no
/// user namespace of its own).
pub fn check_filesystems(spec: &Value) -> Result<(), MountError> {
    for p in plans(spec)? {
        if p.bind {
            continue;
        }
        if !OWN_INSTANCE_FILESYSTEMS.contains(&p.fstype.as_str()) {
            return Err(MountError::Unjudgeable {
                at: p.at(),
                why: format!(
                    "a mount of type `{}`: containers on this node may mount anew only \
                     filesystems each gets its own instance of ({}); others may be the host's \
                     own (binfmt_misc runs a container's interpreter for the host's execs, \
                     devtmpfs is the host's /dev) or reach host paths through their options",
                    untrusted(&p.fstype).max_chars(64),
                    OWN_INSTANCE_FILESYSTEMS[..OWN_INSTANCE_FILESYSTEMS.len() - 1].join(", ")
                ),
            });
        }
        if p.fstype == "proc" && clean(Path::new(&p.destination)) != Path::new("/proc") {
            return Err(MountError::Unjudgeable {
                at: p.at(),
                why: format!(
                    "proc mounted at {}: runc keeps /proc/sys read-only and /proc/kcore masked \
                     by path, under /proc only; a second proc elsewhere would leave them \
                     writable (the host's sysctls)",
                    untrusted(&p.destination).max_chars(200)
                ),
            });
        }
    }
    Ok(())
}

fn check_flags(p: &MountPlan) -> Result<(), MountError> {
    if p.remount {
        return Err(MountError::Unjudgeable {
            at: p.at(),
            why: "`remount` changes the flags of a mount made before it (a read-only cgroup \
                  mount made writable)"
                .into(),
        });
    }
    if let Some(prop) =
        p.propagation.iter().find(|x| matches!(x, Propagation::Slave | Propagation::Shared))
    {
        return Err(MountError::Unjudgeable {
            at: p.at(),
            why: format!(
                "{} propagation lets mounts made outside the container after its start appear \
                 inside a GPU container",
                if *prop == Propagation::Slave { "slave" } else { "shared" }
            ),
        });
    }
    if !p.bind {
        // A filesystem runc mounts anew: read-only exactly when `ro` is the last word
        // (runc applies no `rro` here).
        let what = match p.fstype.as_str() {
            "cgroup" | "cgroup2" => format!("a {} mount", p.fstype),
            "sysfs" => "sysfs".to_string(),
            _ => return Ok(()),
        };
        if !p.read_only {
            let why = format!("{what} that is writable (options in order leave it read-write)");
            return Err(refusal(p, if p.fstype == "sysfs" { "sysfs" } else { "cgroup" }, why));
        }
    }
    Ok(())
}

fn check_bind(
    p: &MountPlan,
    earlier: &[MountPlan],
    bundle: &Path,
    rootfs: &Path,
    host: &dyn HostFacts,
) -> Result<(), MountError> {
    if !p.bind {
        return Ok(());
    }
    let Some(source) = p.source.as_deref() else { return Ok(()) };
    let joined = joined_source(bundle, source);
    let lexical = clean(&joined);
    if within(&lexical, Path::new("/proc")) {
        return Err(MountError::Unjudgeable {
            at: p.at(),
            why: format!(
                "a bind from {}: paths under /proc name runc's init there and this process here",
                untrusted(source)
            ),
        });
    }
    // Where the kernel resolves it (lexically where it does not exist yet: runc creates
    // the destinations of earlier mounts, and a source that is still missing then fails
    // runc's mount; one that appears otherwise is the prestart check's).
    let exists = host.canonical(&joined);
    let resolved = exists.clone().unwrap_or_else(|| lexical.clone());
    if within(&resolved, Path::new("/proc")) {
        return Err(MountError::Unjudgeable {
            at: p.at(),
            why: format!(
                "a bind from {} resolves under /proc ({}): it names runc's init there and this \
                 process here",
                untrusted(source),
                resolved.display()
            ),
        });
    }
    // Inside the bundle, where an earlier mount of this config lands: runc binds what that
    // mount made, not what is there now.
    if within(&resolved, bundle) {
        for e in earlier {
            let dest = clean(&rootfs.join(e.destination.trim_start_matches('/')));
            if within(&resolved, &dest) || within(&dest, &resolved) {
                return Err(MountError::Unjudgeable {
                    at: p.at(),
                    why: format!(
                        "a bind from {}, where mounts[{}] ({}) is mounted before it: runc binds \
                         what that mount made",
                        untrusted(source),
                        e.index,
                        untrusted(&e.destination)
                    ),
                });
            }
        }
    }
    if exists.is_none() {
        return Ok(());
    }
    let mounts = host.mounts();
    // A procfs of another pid namespace, read-only or not: `/proc/<pid>/root` of any process
    // it shows leads into that process's mounts (a writable cgroupfs among them), and
    // writes through it go where that process's mount allows.
    if let Some(m) = procfs_brought(mounts, &resolved, p.recursive) {
        return Err(MountError::Unjudgeable {
            at: p.at(),
            why: format!(
                "a bind of {} brings the procfs at {} along: /proc/<pid>/root of the processes it \
                 shows leads into their mounts",
                untrusted(source),
                untrusted(&m.mount_point)
            ),
        });
    }
    // The top of the bind: the source's own mount, flags as runc leaves them.
    if let Some(top) = holding(mounts, &resolved) {
        if let Some(what) = kind(top) {
            let writable = match p.rec_read_only {
                Some(ro) => !ro,
                None if p.bind_remount => !p.read_only,
                None => top.writable(),
            };
            if writable && super_writable(top) {
                let why = format!(
                    "a bind of {} ({what}) that is writable{}",
                    untrusted(source),
                    if resolved != lexical {
                        format!(" (the kernel resolves it to {})", resolved.display())
                    } else {
                        String::new()
                    }
                );
                return Err(refusal(p, what, why));
            }
        }
    }
    if p.recursive {
        // Every mount below the source comes along with its own flags; only `rro` changes
        // them.
        for sub in mounts.iter().filter(|m| {
            let mp = Path::new(&m.mount_point);
            mp != resolved && within(mp, &resolved)
        }) {
            let Some(what) = kind(sub) else { continue };
            let writable = match p.rec_read_only {
                Some(ro) => !ro,
                None => sub.writable(),
            };
            if writable && super_writable(sub) {
                let why = format!(
                    "an rbind of {} brings {} ({what}) along, writable ({})",
                    untrusted(source),
                    untrusted(&sub.mount_point),
                    if p.read_only {
                        "`ro` reaches only the top of an rbind; `rro` reaches below"
                    } else {
                        "it is writable on the host"
                    }
                );
                return Err(refusal(p, what, why));
            }
        }
    }
    Ok(())
}

fn super_writable(m: &MountEntry) -> bool {
    !m.super_options.iter().any(|o| o == "ro")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::collections::BTreeMap;

    /// A host of a table and a link map.
    struct Table {
        mounts: Vec<MountEntry>,
        links: BTreeMap<PathBuf, PathBuf>,
    }

    impl HostFacts for Table {
        fn canonical(&self, p: &Path) -> Option<PathBuf> {
            let c = clean(p);
            // /proc/self/root/X is X; a link prefix is replaced.
            let c = c.strip_prefix("/proc/self/root").map(|r| Path::new("/").join(r)).unwrap_or(c);
            for (from, to) in &self.links {
                if let Ok(rest) = c.strip_prefix(from) {
                    return Some(to.join(rest));
                }
            }
            Some(c)
        }
        fn mounts(&self) -> &[MountEntry] {
            &self.mounts
        }
    }

    fn v1_host() -> Table {
        let text = "\
22 1 0:21 / / rw,relatime - overlay overlay rw
30 22 0:26 / /sys rw,nosuid - sysfs sysfs rw
31 30 0:27 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755
35 31 0:31 / /sys/fs/cgroup/devices rw - cgroup cgroup rw,devices
36 31 0:32 / /sys/fs/cgroup/cpu ro - cgroup cgroup rw,cpu
";
        Table {
            mounts: tessera_api::mountinfo::parse(text).expect("table"),
            links: [(PathBuf::from("/b/rootfs/link"), PathBuf::from("/sys/fs/cgroup"))].into(),
        }
    }

    fn with(mounts: Value) -> Value {
        json!({"process": {}, "linux": {}, "mounts": mounts})
    }

    fn judge(mounts: Value) -> Result<(), MountError> {
        check(&with(mounts), Path::new("/b"), Path::new("/b/rootfs"), &v1_host())
    }

    fn bind(source: &str, options: &[&str]) -> Value {
        json!([{"destination": "/cg", "type": "bind", "source": source, "options": options}])
    }

    #[test]
    fn options_are_read_in_order_as_runc_reads_them() {
        let p = |o: &[&str]| {
            plan(
                0,
                MountView {
                    destination: "/x".into(),
                    typ: Some("none".into()),
                    source: Some("/s".into()),
                    options: Some(o.iter().map(|s| s.to_string()).collect()),
                },
            )
        };
        assert!(!p(&["bind", "ro", "rw"]).read_only, "the last of ro/rw wins");
        assert!(p(&["rw", "ro"]).read_only);
        assert!(p(&["rbind", "bind"]).recursive, "bind after rbind keeps the recursion");
        assert_eq!(p(&["rbind", "rro", "rrw"]).rec_read_only, Some(true), "a set wins");
        assert_eq!(p(&["rbind", "rrw"]).rec_read_only, Some(false));
        assert_eq!(p(&["rro"]).rec_read_only, None, "no bind: runc applies no rro");
        assert_eq!(p(&["bind"]).fstype, "bind", "any type is a bind with the flag");
        assert!(!p(&["bind", "rw"]).bind_remount, "rw alone sets no flag to remount with");
        assert!(p(&["bind", "nosuid"]).bind_remount);
        assert!(p(&["remount"]).remount);
    }

    /// Round 8: where a container without a GPU gets a procfs by a bind (read-only or
    /// not): on one, below a recursive bind, or through a link in its image; not below a
    /// plain bind (its submounts stay behind).
    #[test]
    fn a_bind_that_brings_a_procfs_along_is_found_however_it_is_spelled() {
        let mut host = v1_host();
        host.mounts.extend(
            tessera_api::mountinfo::parse("40 22 0:40 / /proc rw - proc proc rw\n").expect("proc"),
        );
        host.links.insert(PathBuf::from("/b/rootfs/p"), PathBuf::from("/proc"));
        let found = |source: &str, options: &[&str]| {
            procfs_bind(&with(bind(source, options)), Path::new("/b"), &host).expect("judged")
        };
        for (source, options) in [
            ("/proc", &["rbind", "ro"][..]),
            ("/proc/1", &["bind", "ro"]),
            ("/", &["rbind", "rro"]),
            ("rootfs/p/1", &["bind"]),
            ("/sys/../proc", &["bind", "ro"]),
        ] {
            let (at, what) = found(source, options)
                .unwrap_or_else(|| panic!("{source} {options:?} brought no procfs"));
            assert_eq!(at, "mounts[0] (/cg)", "{source}");
            assert!(what.contains("the procfs at /proc"), "{source}: {what}");
        }
        assert_eq!(found("/", &["bind", "ro"]), None, "a plain bind of / brings no submount");
        assert_eq!(found("/sys/fs/cgroup", &["rbind", "ro"]), None, "no procfs below it");
    }

    /// Round 8 (rt-iso4): no bind shows tesserad's own paths: the state directory, a pipe
    /// directory inside it, an ancestor on the same filesystem (a plain bind of it holds
    /// them), or on another one when recursive; a plain bind of an ancestor whose
    /// filesystem does not hold them, and unrelated paths, stay.
    #[test]
    fn no_bind_shows_tesserads_own_paths() {
        let mut host = v1_host();
        host.mounts.extend(
            tessera_api::mountinfo::parse(
                "50 22 8:2 / /var/lib rw - ext4 /dev/sda2 rw\n51 22 0:60 / /run rw - tmpfs t rw\n",
            )
            .expect("more"),
        );
        host.links.insert(PathBuf::from("/b/rootfs/s"), PathBuf::from("/var/lib/tessera"));
        let private = [PathBuf::from("/run/tessera/d.sock"), PathBuf::from("/var/lib/tessera")];
        let judge = |source: &str, options: &[&str]| {
            check_private_binds(&with(bind(source, options)), Path::new("/b"), &host, &private, &[])
        };
        for (source, options) in [
            ("/var/lib/tessera", &["rbind", "ro"][..]),
            ("/var/lib/tessera/mps/GPU-1/acme/pipe", &["bind", "ro"]),
            ("/var/lib", &["bind", "ro"]),
            ("/run", &["bind"]),
            ("/run/tessera/d.sock", &["bind"]),
            ("/var", &["rbind", "ro"]),
            ("rootfs/s/mps", &["bind"]),
        ] {
            let e = judge(source, options).expect_err(source);
            assert!(e.to_string().contains("tesserad's own"), "{source}: {e}");
        }
        for (source, options) in
            [("/var", &["bind", "ro"][..]), ("/var/lib/other", &["rbind"]), ("/srv", &["rbind"])]
        {
            judge(source, options).unwrap_or_else(|e| panic!("{source}: {e}"));
        }
        // What the grant injected (its source at its destination) is its own; the same
        // source at another destination is not.
        let pipe = "/var/lib/tessera/mps/GPU-1/acme/pipe";
        let given = [(pipe, "/cg")];
        check_private_binds(
            &with(bind(pipe, &["rbind"])),
            Path::new("/b"),
            &host,
            &private,
            &given,
        )
        .expect("the grant's own pipe directory");
        let elsewhere = [(pipe, "/run/nvidia-mps")];
        check_private_binds(
            &with(bind(pipe, &["rbind"])),
            Path::new("/b"),
            &host,
            &private,
            &elsewhere,
        )
        .expect_err("the same directory where the grant did not put it");
    }

    #[test]
    fn the_issues_instances_are_refused() {
        let e = judge(bind("/sys/fs/cgroup/devices", &["bind", "ro", "rw"])).expect_err("ro,rw");
        assert!(e.to_string().contains("mounts[0] (/cg)"), "{e}");
        assert!(e.to_string().contains("rewrite its own device rules"), "{e}");
        let e = judge(bind("/proc/self/root/sys/fs/cgroup/devices", &["bind", "ro"]))
            .expect_err("/proc/self/root");
        assert!(e.to_string().contains("/proc"), "{e}");
        assert!(judge(bind("/proc/self/root/sys/fs/cgroup", &["rbind", "ro"])).is_err());
    }

    #[test]
    fn sources_are_judged_where_the_kernel_resolves_them() {
        // A link inside the rootfs to the host's cgroupfs; relative to the bundle.
        let e = judge(bind("rootfs/link/devices", &["bind", "rw"])).expect_err("link");
        assert!(e.to_string().contains("resolves it to /sys/fs/cgroup/devices"), "{e}");
        assert!(judge(bind("/sys/fs/cgroup/../cgroup/devices", &["bind"])).is_err(), "..");
        // A bind of a read-only host mount with no flag to remount stays read-only.
        assert!(judge(bind("/sys/fs/cgroup/cpu", &["bind"])).is_ok());
        // ... and is made writable by runc's remount when another flag is set.
        assert!(judge(bind("/sys/fs/cgroup/cpu", &["bind", "nosuid"])).is_err());
        // A read-only bind of a cgroup is fine; so is rro.
        assert!(judge(bind("/sys/fs/cgroup/devices", &["bind", "rw", "ro"])).is_ok());
        assert!(judge(bind("/sys/fs/cgroup/devices", &["rbind", "rro"])).is_ok());
    }

    #[test]
    fn an_rbind_brings_every_submount_with_its_own_flags() {
        let e = judge(bind("/sys/fs", &["rbind", "ro"])).expect_err("rbind ro of a parent");
        assert!(e.to_string().contains("`rro` reaches below"), "{e}");
        assert!(judge(bind("/sys/fs", &["rbind", "rro"])).is_ok());
        // Not recursive: the submounts stay behind (an empty tmpfs dir is no cgroup).
        assert!(judge(bind("/sys/fs/cgroup", &["bind", "ro"])).is_ok());
        // sysfs itself, writable.
        let e = judge(bind("/sys", &["bind", "rw"])).expect_err("sysfs");
        assert!(e.to_string().contains("remove another tenant's GPU"), "{e}");
    }

    #[test]
    fn filesystems_mounted_anew_are_read_only_only_by_their_last_word() {
        let fs = |t: &str, o: &[&str]| {
            judge(json!([{"destination": "/x", "type": t, "source": t, "options": o}]))
        };
        assert!(fs("cgroup", &["ro", "rw"]).is_err());
        assert!(fs("cgroup2", &["nosuid"]).is_err());
        assert!(fs("cgroup", &["rw", "ro"]).is_ok());
        assert!(fs("sysfs", &["rro"]).is_err(), "runc applies rro to binds only");
        assert!(fs("sysfs", &["ro"]).is_ok());
        assert!(fs("tmpfs", &["rw"]).is_ok());
    }

    #[test]
    fn no_writable_bind_of_a_proc_sysfs_or_cgroup_view_the_hosts_or_its_own() {
        let dir = tempfile::tempdir().expect("tmp");
        let bundle = dir.path();
        let rootfs = bundle.join("rootfs");
        std::fs::create_dir_all(rootfs.join("proc")).expect("proc dir");
        std::os::unix::fs::symlink("proc", rootfs.join("p")).expect("link");
        let spec = |binds: Value| {
            let mut m = vec![json!({"destination": "/proc", "type": "proc", "source": "proc"})];
            m.extend(binds.as_array().expect("list").iter().cloned());
            json!({"root": {"path": "rootfs"}, "mounts": m})
        };
        let check = |binds: Value| check_proc_binds(&spec(binds), bundle, &rootfs);
        for source in ["rootfs/proc", "rootfs/proc/sys", "rootfs/p", "/proc", "/proc/sys", "/sys"] {
            let e = check(json!([{"destination": "/p2", "type": "bind", "source": source,
                                  "options": ["rbind", "rw"]}]))
            .expect_err(source);
            assert!(e.to_string().contains("writable bind"), "{source}: {e}");
        }
        // Read-only binds of them stay; other sources stay.
        check(json!([{"destination": "/host/proc", "type": "bind", "source": "/proc",
                      "options": ["rbind", "ro"]}]))
        .expect("read-only");
        check(json!([{"destination": "/data", "type": "bind", "source": "/tmp",
                      "options": ["rbind", "rw"]}]))
        .expect("another source");
        // The container's own proc counts only once mounted: a bind before it is of the
        // image's directory.
        let before = json!({"root": {"path": "rootfs"}, "mounts": [
            {"destination": "/p2", "type": "bind", "source": "rootfs/proc", "options": ["rbind"]},
            {"destination": "/proc", "type": "proc", "source": "proc"}]});
        check_proc_binds(&before, bundle, &rootfs).expect("before the proc mount");
    }

    #[test]
    fn only_filesystems_of_a_containers_own_are_mounted_anew_and_proc_at_proc() {
        let judge = |m: Value| check_filesystems(&json!({ "mounts": m }));
        for fstype in ["binfmt_misc", "devtmpfs", "tracefs", "debugfs", "overlay", "nfs", ""] {
            for options in [vec![], vec!["ro"], vec!["nosuid", "noexec", "nodev"]] {
                let m = json!([{"destination": "/x", "type": fstype, "source": fstype,
                                "options": options}]);
                let e = judge(m).expect_err(fstype);
                assert!(e.to_string().contains("own instance"), "{fstype}: {e}");
            }
        }
        // A bind whose type says binfmt_misc is a bind (judged as one elsewhere).
        let m = json!([{"destination": "/x", "type": "binfmt_misc", "source": "rootfs/tmp",
                        "options": ["bind", "ro"]}]);
        judge(m).expect("a bind");
        // runc spec's own mounts, and Docker's.
        let m = json!([
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts"},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm"},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue"},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["ro"]},
            {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
             "options": ["ro"]}
        ]);
        judge(m).expect("the defaults");
        for dest in ["/proc2", "/tmp/p", "/proc/../p", "/"] {
            let m = json!([{"destination": dest, "type": "proc", "source": "proc"}]);
            let e = judge(m).expect_err(dest);
            assert!(e.to_string().contains("proc mounted at"), "{dest}: {e}");
        }
        let m = json!([{"destination": "/proc/./", "type": "proc", "source": "proc"}]);
        judge(m).expect("/proc, written otherwise");
    }

    /// Red team, round 6: `sysfs` and `cgroup2` are no filesystem of a container's own where
    /// it can write them. sysfs in a new network namespace is the host's kernel objects
    /// (`/sys/bus/pci/devices/<gpu>/remove`, `/sys/module/*/parameters`) but for
    /// `/sys/class/net`; `cgroup2` without a cgroup namespace of its own (runc spec's config
    /// has none) is the host's whole hierarchy (`cgroup.kill` of tesserad's cgroup; on v2,
    /// `cgroup.procs` of a GPU grant's cgroup). `check_filesystems` runs for every container
    /// and lets both through read-write (only a GPU container's are judged read-only).
    #[test]
    fn rt_iso2_no_container_mounts_a_writable_sysfs_or_the_hosts_cgroup2_anew() {
        let judge = |m: Value| {
            check_kernel_views_read_only(&json!({
                "mounts": m,
                "linux": {"namespaces": [{"type": "pid"}, {"type": "network"}, {"type": "mount"}]}
            }))
        };
        let m = json!([{"destination": "/sys", "type": "sysfs", "source": "sysfs",
                        "options": ["nosuid", "noexec", "nodev", "rw"]}]);
        judge(m).expect_err("a writable sysfs: the host's kernel objects");
        let m = json!([{"destination": "/cg2", "type": "cgroup2", "source": "cgroup2",
                        "options": ["nosuid", "noexec", "nodev", "rw"]}]);
        judge(m).expect_err("a writable cgroup2 without a cgroup namespace: the host's hierarchy");
    }

    #[test]
    fn what_changes_a_mount_after_it_was_judged_is_refused() {
        let m = json!([
            {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup", "options": ["ro"]},
            {"destination": "/sys/fs/cgroup/devices", "type": "bind", "source": "/x", "options": ["bind", "remount", "rw"]}
        ]);
        assert!(judge(m).expect_err("remount").to_string().contains("remount"));
        let m = json!([
            {"destination": "/a", "type": "bind", "source": "/sys/fs/cgroup/devices", "options": ["bind", "ro"]},
            {"destination": "/b", "type": "bind", "source": "rootfs/a", "options": ["bind", "nosuid"]}
        ]);
        let e = judge(m).expect_err("bind of an earlier mount");
        assert!(e.to_string().contains("mounts[0] (/a) is mounted before it"), "{e}");
        let e = judge(bind("/srv", &["bind", "rslave"])).expect_err("slave");
        assert!(e.to_string().contains("slave propagation"), "{e}");
        let mut spec = with(json!([]));
        spec["linux"]["rootfsPropagation"] = json!("rshared");
        assert!(check(&spec, Path::new("/b"), Path::new("/b/rootfs"), &v1_host()).is_err());
        spec["linux"]["rootfsPropagation"] = json!("private");
        make_private(&mut spec).expect("private is fine");
        assert_eq!(spec["linux"]["rootfsPropagation"], "rprivate");
    }

    #[test]
    fn a_bind_that_brings_a_procfs_along_is_refused_read_only_or_not() {
        let mut host = v1_host();
        host.mounts.extend(
            tessera_api::mountinfo::parse("40 22 0:5 / /proc rw,nosuid - proc proc rw\n")
                .expect("proc"),
        );
        let judge = |m: Value| check(&with(m), Path::new("/b"), Path::new("/b/rootfs"), &host);
        let e = judge(bind("/", &["rbind", "rro"])).expect_err("the host's / with its /proc");
        assert!(e.to_string().contains("procfs at /proc"), "{e}");
        // Not recursive: the host's / alone brings no procfs.
        assert!(judge(bind("/", &["bind", "ro"])).is_ok());
    }

    #[test]
    fn ordinary_mounts_pass() {
        let m = json!([
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "ro"]},
            {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup", "options": ["ro"]},
            {"destination": "/data", "type": "bind", "source": "/srv/data", "options": ["rbind", "rprivate", "rw"]}
        ]);
        judge(m).expect("docker's and containerd's defaults");
    }
}
