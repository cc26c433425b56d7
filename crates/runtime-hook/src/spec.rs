//! config.json: load it safely, check it can hold a GPU, apply tesserad's [`Injection`],
//! and write it back atomically.
//!
//! ## Why a `serde_json::Value` and not `oci_spec::runtime::Spec`
//! The document is parsed once into a `serde_json::Value` and edited in place; only the
//! sections we touch are read through typed views (oci-spec's `LinuxDevice` and
//! `LinuxDeviceCgroup`, small local structs elsewhere) and new entries are built with
//! oci-spec's builders so their field names follow the runtime spec. Reasons:
//! - oci-spec's `Spec` has no catch-all field: anything it does not model (a newer
//!   runtime-spec field, a vendor extension) would be silently dropped on write-back
//!   (see the test `oci_spec_spec_drops_unknown_fields`), and its `#[serde(default)]`
//!   fields would write defaults the caller never set.
//! - Its enums are closed: a config that runc accepts (a new capability, namespace or
//!   rlimit name) could fail to parse, and this code sits on the start path of every
//!   container, including those that never asked for a GPU.
//!
//! Object key order is not preserved on write-back (serde_json's map is sorted unless
//! `preserve_order` is on); key order carries no meaning in config.json.

use std::collections::BTreeSet;
use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use oci_spec::runtime::{HookBuilder, LinuxDeviceBuilder, LinuxDeviceType, MountBuilder, Spec};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tessera_api::Injection;

use crate::canonical::{
    self, CanonicalError, DeviceAccess, DeviceNode, DeviceRule, NodeKind, RuleKind,
};

/// The bundle's config file name.
pub const CONFIG_FILE: &str = "config.json";
/// The largest config.json accepted.
pub const MAX_CONFIG_BYTES: u64 = 64 << 20;
/// Annotation listing the granted device UUIDs, for people reading the config.
pub const ALLOCATED_ANNOTATION: &str = "tessera.io/allocated";
/// Annotation of a GPU container made by `runc create` (value [`CONFIRM_AFTER_CREATE`]):
/// `tessera-runtime start` has tesserad confirm it before `runc start`, and `exec` refuses
/// it until then ([`crate::confirm`]).
pub const CONFIRM_ANNOTATION: &str = "tessera.io/confirm";
/// The value of [`CONFIRM_ANNOTATION`].
pub const CONFIRM_AFTER_CREATE: &str = "after-create";
/// Seconds runc gives each tessera hook before killing it.
pub const HOOK_TIMEOUT_SECS: i64 = 10;
/// The NVIDIA character-device major (`/dev/nvidia<N>`, `/dev/nvidiactl`): always treated
/// as a GPU major, whatever the injection holds.
pub const NVIDIA_MAJOR: i64 = 195;
/// Device paths under this prefix are NVIDIA devices (`/dev/nvidia0`, `/dev/nvidiactl`,
/// `/dev/nvidia-uvm`, `/dev/nvidia-caps/...`).
pub const NVIDIA_PATH_PREFIX: &str = "/dev/nvidia";

/// The cgroup runc 1.1 will put the container of `spec` in ([`tessera_api::cgroup::runc_cgroup`]
/// of its `linux.cgroupsPath`); `systemd` and `own_proc_cgroup` as for
/// [`check_cgroup_is_free`].
pub fn runc_cgroup_of(
    spec: &Value,
    container_id: &str,
    systemd: bool,
    own_proc_cgroup: &str,
) -> Result<String, SpecError> {
    let path = match spec.pointer("/linux/cgroupsPath") {
        None | Some(Value::Null) => None,
        Some(Value::String(p)) => Some(p.as_str()),
        Some(_) => return Err(shape("linux.cgroupsPath", "expected a string")),
    };
    tessera_api::cgroup::runc_cgroup(path, container_id, systemd, own_proc_cgroup)
        .map_err(|why| SpecError::CgroupTaken { at: "linux.cgroupsPath".into(), why })
}

/// Refuses a container (any container, GPU or not) that runc would put into the cgroup of
/// a running GPU grant, below it or above it: below, its processes would keep that grant's
/// device rules — another tenant's GPU, open while the grant's own container runs and after
/// it is gone; above, its limits bind the grant's container and a create runc fails kills
/// everything in its cgroup tree (runc's `destroy` without a pid namespace of its own).
/// `grants` is tesserad's list beside its socket; `systemd` runc's `--systemd-cgroup`;
/// `own_proc_cgroup` the `/proc/self/cgroup` text of this process, which runs runc (a
/// relative `cgroupsPath` is below its cgroup). `daemon`: tesserad's own cgroups (every
/// hierarchy's path: runc's cgroupfs driver uses one path in all), where its MPS daemons
/// run: a container may not be in one or above one (below it binds only itself).
pub fn check_cgroup_is_free(
    spec: &Value,
    container_id: &str,
    systemd: bool,
    own_proc_cgroup: &str,
    grants: &[String],
    daemon: &[String],
) -> Result<(), SpecError> {
    if grants.is_empty() && daemon.is_empty() {
        return Ok(());
    }
    let cgroup = runc_cgroup_of(spec, container_id, systemd, own_proc_cgroup)?;
    let at = "linux.cgroupsPath".to_string();
    use tessera_api::cgroup::within;
    // tesserad's own cgroup, where the MPS daemons of every tenant run too: runc would write
    // the container's device rules and limits there (or above it, binding it), and its
    // pause and `kill --all` would reach them. A cgroup below it binds only itself.
    let path = match spec.pointer("/linux/cgroupsPath") {
        Some(Value::String(p)) => Some(p.as_str()),
        _ => None,
    };
    let raw = tessera_api::cgroup::runc_cgroup_path(path, container_id, systemd, own_proc_cgroup)
        .map_err(|why| SpecError::CgroupTaken { at: at.clone(), why })?;
    if let Some(d) = daemon.iter().find(|d| within(d, &raw)) {
        return Err(SpecError::CgroupTaken {
            at,
            why: format!(
                "runc would put the container in cgroup /{}, {} a cgroup tesserad runs in \
                 (/{}), where the GPU service and every tenant's MPS daemons run: the \
                 container's device rules, limits and signals would reach them",
                tessera_api::untrusted(&raw),
                if raw == *d { "which is" } else { "above" },
                tessera_api::untrusted(d)
            ),
        });
    }
    if let Some(g) = grants.iter().find(|g| within(&cgroup, g) || within(g, &cgroup)) {
        return Err(SpecError::CgroupTaken {
            at,
            why: format!(
                "runc would put the container in cgroup {}, {} the cgroup of a running GPU \
                 container ({}); a container's cgroup must be its own (runc kills what is left in \
                 a failed container's cgroup tree, and a parent's limits bind its children)",
                tessera_api::untrusted(&cgroup),
                if cgroup == *g {
                    "which is"
                } else if within(&cgroup, g) {
                    "below"
                } else {
                    "above"
                },
                tessera_api::untrusted(g)
            ),
        });
    }
    Ok(())
}

/// Why config.json could not be read, edited or written.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error(
        "refusing to open {path}: it is a symbolic link (links in a bundle are never followed)"
    )]
    Symlink { path: PathBuf },
    #[error("{path} is not a regular file")]
    NotRegular { path: PathBuf },
    #[error("{path} is larger than {MAX_CONFIG_BYTES} bytes")]
    TooLarge { path: PathBuf },
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    /// Not JSON, or JSON that runc would read differently (see [`crate::canonical`]).
    #[error("{path}: {source}")]
    Canonical { path: PathBuf, source: CanonicalError },
    /// A section that runc reads differently from an exact reading, or a value it and the
    /// kernel do not take (no file path: the caller adds it).
    #[error(transparent)]
    Ambiguous(#[from] CanonicalError),
    /// JSON, but a field has the wrong shape; `path` is the JSON path (`linux.devices[2].major`).
    #[error("malformed config at `{}`: {}", tessera_api::untrusted(.path), tessera_api::untrusted(.message))]
    Shape { path: String, message: String },
    #[error("config has no `linux` section: a GPU container needs Linux devices and cgroup device rules")]
    NoLinux,
    #[error(
        "annotation `{}` would set the systemd unit property `{}` of the container's cgroup \
         (runc passes `org.systemd.property.*` to systemd with the systemd cgroup driver): device \
         access is decided by runc's device rules and Tessera's grants, never by an annotation",
        tessera_api::untrusted(.key),
        tessera_api::untrusted(.property)
    )]
    DeviceProperty { key: String, property: String },
    #[error("config has no `process` section")]
    NoProcess,
    #[error(
        "linux.resources.devices[{index}] ({rule}) allows every device: a GPU container must \
         not have an allow-all device rule (is it privileged?)"
    )]
    AllowAll { index: usize, rule: String },
    #[error(
        "linux.resources.devices[{index}] ({rule}) opens character devices of any major, \
         GPUs included: a GPU container may open only the GPUs it was granted"
    )]
    AnyCharDevice { index: usize, rule: String },
    #[error(
        "linux.resources.devices[{index}] ({rule}) opens block devices of any major: the \
         node's disks, and every file on them; name the block devices a GPU container needs"
    )]
    AnyBlockDevice { index: usize, rule: String },
    #[error(
        "linux.resources.devices[{index}] ({rule}) opens character devices of any major, GPUs \
         included, and the container asked for no GPU: ask for one with tessera.io/gpu, or \
         narrow the rule"
    )]
    GpuWithoutGrant { index: usize, rule: String },
    #[error("invalid injection from tesserad: {0}")]
    BadInjection(String),
    #[error("cannot write {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error(
        "hostile rootfs: {path} is a symbolic link (to {target}); runc would create device \
         nodes, links or directories through it outside the container, so the container is \
         refused"
    )]
    HostileRootfs { path: PathBuf, target: String },
    #[error("cannot inspect the rootfs at {path}: {source}")]
    Rootfs { path: PathBuf, source: std::io::Error },
    /// A root path runc would resolve differently from a plain join (see [`check_rootfs`]).
    #[error("root.path {}: {why}", tessera_api::untrusted(.path))]
    RootPath { path: String, why: &'static str },
    /// Something that lets the container change its own devices cgroup after runc set it.
    #[error("{at}: {why}: a GPU container could rewrite its own device rules and open every GPU")]
    DeviceCgroupWritable { at: String, why: String },
    /// A capability that acts on the host itself, in any container.
    #[error("{at}: {why}")]
    HostCapability { at: String, why: String },
    /// A container without a GPU that sees processes outside its own pid namespace on a
    /// node whose kernel lets it attach to a GPU container's processes
    /// ([`check_process_view`]).
    #[error("{at}: {why}")]
    ProcessView { at: String, why: String },
    /// Real-time CPU for a GPU container.
    #[error("{at}: {why}: real-time CPU time is not bounded by the CPU quota a GPU container is admitted with; GPU containers get none")]
    RealTime { at: String, why: String },
    /// A container that would join the cgroup of a running GPU grant.
    #[error("{at}: {why}")]
    CgroupTaken { at: String, why: String },
    /// A GPU container's mounts, as runc will make them ([`crate::mounts`]).
    #[error(transparent)]
    Mount(#[from] crate::mounts::MountError),
    /// A config whose own CPU set (or memory nodes) shares nothing with the set its GPUs
    /// are pinned to (`topology.pin_cpus`).
    #[error(
        "linux.resources.cpu.{key} `{}` shares no entry with the set its GPUs are pinned to \
         ({pin}) under the policy's topology.pin_cpus: a GPU container runs on its GPUs' \
         CPUs and memory nodes; ask for a set that meets {pin}, or none",
        tessera_api::untrusted(.asked).max_chars(64)
    )]
    CpusetOffGpus { key: &'static str, asked: String, pin: String },
}

fn shape(path: impl Into<String>, message: impl Into<String>) -> SpecError {
    SpecError::Shape { path: path.into(), message: message.into() }
}

/// Where the tessera hooks are and what they are told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HookConfig {
    /// Absolute path of the `tessera-hook` binary on the host.
    pub path: PathBuf,
    /// Absolute path of tesserad's socket, passed as `TESSERA_SOCKET` (the hook's only env).
    pub socket: PathBuf,
    /// Whether the container is confirmed by `tessera-hook prestart` (a `runc run`, where
    /// nothing runs between runc making the container and starting it) or by
    /// tessera-runtime itself at the container's `start`, after `runc create` returned (no
    /// hook is written: one process fewer, and the checks see the container's finished
    /// root).
    pub prestart: bool,
}

/// A config.json as read from a bundle, with what is needed to write it back.
#[derive(Debug, Clone)]
pub struct LoadedConfig {
    pub path: PathBuf,
    pub value: Value,
    mode: u32,
    uid: u32,
    gid: u32,
}

/// Reads and parses `<bundle>/config.json`, refusing a symlink (`O_NOFOLLOW`), anything
/// but a regular file, and more than [`MAX_CONFIG_BYTES`].
pub fn load_config(bundle: &Path) -> Result<LoadedConfig, SpecError> {
    let path = bundle.join(CONFIG_FILE);
    let read_err = |source| SpecError::Read { path: path.clone(), source };
    let file = match OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(&path) {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => return Err(SpecError::Symlink { path }),
        Err(e) => return Err(read_err(e)),
    };
    let meta = file.metadata().map_err(read_err)?;
    if !meta.file_type().is_file() {
        return Err(SpecError::NotRegular { path });
    }
    if meta.len() > MAX_CONFIG_BYTES {
        return Err(SpecError::TooLarge { path });
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize + 1);
    file.take(MAX_CONFIG_BYTES + 1).read_to_end(&mut bytes).map_err(read_err)?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(SpecError::TooLarge { path });
    }
    let value = parse_config(&path, &bytes)?;
    Ok(LoadedConfig { path, value, mode: meta.mode() & 0o7777, uid: meta.uid(), gid: meta.gid() })
}

/// Refuses a rootfs through which runc would write outside the container.
///
/// runc 1.1 creates `/dev/fd`, `/dev/stdin`, `/dev/stdout`, `/dev/stderr` and `/dev/ptmx`
/// with plain path joins: if the image's `/dev` is a symlink to a host path, those links
/// land on the host (seen with runc 1.1.5, non-GPU containers too). Device nodes are made
/// with a secure join, but an image that ships `/dev/nvidia*` links is refused as well:
/// nothing legitimate needs them. Only `lstat` is used; nothing in the rootfs is followed,
/// opened or executed.
///
/// The rootfs checked is the one runc uses: runc takes `filepath.Join(bundle, root.path)`,
/// The prefix of annotations runc (with the systemd cgroup driver) turns into properties of
/// the container's systemd scope unit.
pub const SYSTEMD_PROPERTY_PREFIX: &str = "org.systemd.property.";

/// Refuses, in every config, an annotation that would set a systemd unit property deciding
/// device access (`DeviceAllow`, `DevicePolicy`, and BPF programs, which is how systemd
/// enforces device rules on cgroup v2) or handing the cgroup subtree to the container
/// (`Delegate`). With the cgroupfs driver runc ignores them; refusing them everywhere keeps
/// a node's device isolation independent of its cgroup driver.
pub fn check_systemd_properties(spec: &Value) -> Result<(), SpecError> {
    let Some(Value::Object(annotations)) = spec.get("annotations") else { return Ok(()) };
    for key in annotations.keys() {
        let Some(property) = key.strip_prefix(SYSTEMD_PROPERTY_PREFIX) else { continue };
        let denied =
            property.starts_with("Device") || property.starts_with("BPF") || property == "Delegate";
        if denied {
            return Err(SpecError::DeviceProperty {
                key: key.clone(),
                property: property.to_owned(),
            });
        }
    }
    Ok(())
}

/// which cleans `..` lexically where the kernel would resolve it through links, and an empty
/// or null path is the bundle directory itself. Neither has a legitimate use, so both are
/// refused rather than modelled.
pub fn check_rootfs(bundle: &Path, spec: &Value) -> Result<(), SpecError> {
    let root = match spec.get("root") {
        None | Some(Value::Null) => return Ok(()), // runc itself refuses a config without a root
        Some(Value::Object(r)) => r,
        Some(_) => return Err(shape("root", "expected an object")),
    };
    let root = match root.get("path") {
        None | Some(Value::Null) => "",
        Some(Value::String(p)) => p.as_str(),
        Some(_) => return Err(shape("root.path", "expected a string")),
    };
    let bad = |why| Err(SpecError::RootPath { path: root.to_string(), why });
    if root.is_empty() {
        return bad("is empty: runc would use the bundle directory itself as the rootfs");
    }
    if root.contains('\0') {
        return bad("has a NUL byte");
    }
    if has_dotdot(root) {
        return bad("has a `..` component: runc removes it lexically, the kernel resolves it through links, so the checked rootfs would not be runc's");
    }
    let rootfs = bundle.join(root); // an absolute root.path replaces the bundle
    let dev = rootfs.join("dev");
    let lstat = |p: &Path| match std::fs::symlink_metadata(p) {
        Ok(m) => Ok(Some(m)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(SpecError::Rootfs { path: p.to_path_buf(), source }),
    };
    let refuse = |p: &Path| SpecError::HostileRootfs {
        path: p.to_path_buf(),
        target: std::fs::read_link(p)
            .map(|t| t.display().to_string())
            .unwrap_or_else(|_| "?".into()),
    };
    // runc 1.1.5 takes a `proc` or `sysfs` destination that already starts with the rootfs's
    // path (as a string) for a host path, unjoined, and makes its directories there: a
    // destination spelled as the rootfs's host path (or a sibling's, `<rootfs>-x`) is no
    // path in the container, whatever its type.
    let canonical = std::fs::canonicalize(&rootfs).ok();
    for p in crate::mounts::plans(spec)? {
        let dest = normalize(&p.destination);
        let names_rootfs = [Some(&rootfs), canonical.as_ref()]
            .into_iter()
            .flatten()
            .filter_map(|r| r.to_str())
            .any(|r| dest.starts_with(r.trim_end_matches('/')));
        if names_rootfs {
            return Err(shape(
                format!("mounts[{}].destination", p.index),
                format!(
                    "{} starts with the rootfs's path on the host: runc would take it for a \
                     host path, not one in the container",
                    tessera_api::untrusted(&p.destination).max_chars(200)
                ),
            ));
        }
    }
    // runc 1.1.5 makes the directories of a `proc` or `sysfs` destination with a plain join
    // (`os.MkdirAll(filepath.Join(rootfs, dest))`, the destination cleaned as a rooted
    // path), following the image's links to the host, before it resolves the destination
    // safely (CVE-2024-45310's class): a link on the way is refused.
    for p in crate::mounts::plans(spec)? {
        if p.bind || !matches!(p.fstype.as_str(), "proc" | "sysfs") {
            continue;
        }
        let mut at = rootfs.clone();
        for part in normalize(&p.destination).split('/').filter(|c| !c.is_empty()) {
            at.push(part);
            match lstat(&at)? {
                Some(m) if m.file_type().is_symlink() => return Err(refuse(&at)),
                Some(_) => {}
                None => break,
            }
        }
    }
    match lstat(&dev)? {
        Some(m) if m.file_type().is_symlink() => return Err(refuse(&dev)),
        Some(m) if m.is_dir() => {}
        _ => return Ok(()),
    }
    let entries = std::fs::read_dir(&dev)
        .map_err(|source| SpecError::Rootfs { path: dev.clone(), source })?;
    for entry in entries {
        let entry = entry.map_err(|source| SpecError::Rootfs { path: dev.clone(), source })?;
        if !entry.file_name().to_string_lossy().starts_with("nvidia") {
            continue;
        }
        let p = entry.path();
        if lstat(&p)?.is_some_and(|m| m.file_type().is_symlink()) {
            return Err(refuse(&p));
        }
    }
    Ok(())
}

/// Parses config.json bytes into the canonical view ([`crate::canonical`]): duplicate keys
/// and keys runc would fold onto a field are refused, for every container. Errors name the
/// file and the line and column or JSON path.
pub fn parse_config(path: &Path, bytes: &[u8]) -> Result<Value, SpecError> {
    let canonical = |source| SpecError::Canonical { path: path.to_path_buf(), source };
    let value = canonical::parse(bytes).map_err(canonical)?;
    if !value.is_object() {
        return Err(shape(".", "config.json must be a JSON object"));
    }
    canonical::check_keys(&value).map_err(canonical)?;
    Ok(value)
}

/// Writes the config back atomically: a new file beside it (same mode and owner), fsync,
/// rename over the old one, fsync the directory. The rename replaces the directory entry
/// itself, so a link planted meanwhile is replaced, never followed.
pub fn save_config(cfg: &LoadedConfig) -> Result<(), SpecError> {
    let dir = cfg.path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(".{CONFIG_FILE}.tessera-{}.tmp", std::process::id()));
    let write_err = |source| SpecError::Write { path: cfg.path.clone(), source };
    let bytes = serde_json::to_vec(&cfg.value)
        .map_err(|e| write_err(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))?;
    // A leftover from a crashed earlier run of this pid would make create_new fail.
    let _ = std::fs::remove_file(&tmp);
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(cfg.mode)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        // The umask may have narrowed the mode; keep the original exactly.
        f.set_permissions(std::fs::Permissions::from_mode(cfg.mode))?;
        let meta = f.metadata()?;
        if meta.uid() != cfg.uid || meta.gid() != cfg.gid {
            // Best effort: only root may give a file away, and an unchanged owner is not
            // a reason to fail a container start.
            let _ = std::os::unix::fs::fchown(&f, Some(cfg.uid), Some(cfg.gid));
        }
        f.write_all(&bytes)?;
        // No fsync: runc reads this file right after we exec it, on the same host, and a
        // crash before then abandons the create (the caller writes a fresh bundle). The
        // rename is what matters: a reader sees the old file or the new one, never half.
        std::fs::rename(&tmp, &cfg.path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(write_err)
}

/// Deserializes a sub-document through a typed view, naming the JSON path on error.
fn typed<T: DeserializeOwned>(v: &Value, at: &str) -> Result<T, SpecError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let inner = e.path().to_string();
        let path = match inner.as_str() {
            "." => at.to_string(),
            p if p.starts_with('[') => format!("{at}{p}"),
            p => format!("{at}.{p}"),
        };
        shape(path, e.inner().to_string())
    })
}

/// Each element of an optional array, typed; `null`/absent is empty.
fn typed_items<T: DeserializeOwned>(v: Option<&Value>, at: &str) -> Result<Vec<T>, SpecError> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => {
            items.iter().enumerate().map(|(i, item)| typed(item, &format!("{at}[{i}]"))).collect()
        }
        Some(_) => Err(shape(at, "expected an array")),
    }
}

/// The grant's CPU set and memory nodes (`topology.pin_cpus`): written where the config
/// sets none; where it sets its own (kubelet's CPU manager), their intersection. A config
/// whose own set shares nothing with the pin is refused ([`SpecError::CpusetOffGpus`]):
/// kept, it would run the container on CPUs local to another tenant's GPUs; emptied, it
/// would leave it without a CPU.
fn pin_cpuset(
    resources: &mut Map<String, Value>,
    pin: &tessera_api::CpuSet,
) -> Result<(), SpecError> {
    use tessera_api::cpulist::{intersect, parse_cpulist, render_cpulist};
    let bad =
        |e: tessera_api::cpulist::CpuListError| SpecError::BadInjection(format!("cpuset: {e}"));
    let cpus = parse_cpulist(&pin.cpus).map_err(bad)?;
    let mems = pin.mems.as_deref().map(parse_cpulist).transpose().map_err(bad)?;
    let cpu = object_entry(resources, "cpu", "linux.resources.cpu")?;
    let mut merge = |key: &'static str, want: &[u32]| -> Result<(), SpecError> {
        let at = format!("linux.resources.cpu.{key}");
        let have = match cpu.get(key) {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s.trim().is_empty() => None,
            Some(Value::String(s)) => {
                Some((s.clone(), parse_cpulist(s).map_err(|e| shape(&at, e.to_string()))?))
            }
            Some(_) => return Err(shape(&at, "expected a string")),
        };
        let set = match have {
            None => want.to_vec(),
            Some((asked, h)) => match intersect(&h, want) {
                i if i.is_empty() => {
                    return Err(SpecError::CpusetOffGpus { key, asked, pin: render_cpulist(want) })
                }
                i => i,
            },
        };
        cpu.insert(key.to_string(), Value::String(render_cpulist(&set)));
        Ok(())
    };
    merge("cpus", &cpus)?;
    if let Some(m) = mems {
        merge("mems", &m)?;
    }
    Ok(())
}

fn object_entry<'a>(
    parent: &'a mut Map<String, Value>,
    key: &str,
    at: &str,
) -> Result<&'a mut Map<String, Value>, SpecError> {
    let slot = parent.entry(key).or_insert(Value::Null);
    if slot.is_null() {
        *slot = Value::Object(Map::new());
    }
    slot.as_object_mut().ok_or_else(|| shape(at, "expected an object"))
}

/// The array under `key`, created if absent or null.
fn array_entry<'a>(
    parent: &'a mut Map<String, Value>,
    key: &str,
    at: &str,
) -> Result<&'a mut Vec<Value>, SpecError> {
    let slot = parent.entry(key).or_insert(Value::Null);
    if slot.is_null() {
        *slot = Value::Array(Vec::new());
    }
    slot.as_array_mut().ok_or_else(|| shape(at, "expected an array"))
}

fn to_value<T: Serialize>(v: &T) -> Result<Value, SpecError> {
    serde_json::to_value(v).map_err(|e| SpecError::BadInjection(e.to_string()))
}

/// A path with `.`/`..`/repeated slashes resolved lexically, always absolute.
fn normalize(path: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    format!("/{}", parts.join("/"))
}

fn is_nvidia_path(path: &str) -> bool {
    normalize(path).starts_with(NVIDIA_PATH_PREFIX)
}

/// Why an allow rule cannot stay in a GPU container's config, if it cannot: it opens
/// every device (any allow rule of type `a`, which runc and the kernel read as allow-all
/// whatever its numbers), or character devices of any major for reading or writing, or
/// block devices of any major (Docker's `--device-cgroup-rule 'b *:* rwm'`: with
/// `CAP_MKNOD`, in the GPU allow-list, every disk of the node).
fn refuse_rule(index: usize, r: &DeviceRule) -> Option<SpecError> {
    if r.allow && r.kind == RuleKind::All {
        Some(SpecError::AllowAll { index, rule: r.to_string() })
    } else if opens_any_char_major(r) {
        Some(SpecError::AnyCharDevice { index, rule: r.to_string() })
    } else if r.allow && r.kind == RuleKind::Block && r.major.is_none() && r.access.opens() {
        Some(SpecError::AnyBlockDevice { index, rule: r.to_string() })
    } else {
        None
    }
}

/// An allow rule that reads or writes character devices of any major (GPUs included).
fn opens_any_char_major(r: &DeviceRule) -> bool {
    r.allow && r.kind == RuleKind::Char && r.major.is_none() && r.access.opens()
}

/// An allow rule for a character major of the GPU.
fn is_gpu_rule(r: &DeviceRule, gpu_majors: &BTreeSet<u32>) -> bool {
    r.allow && r.kind == RuleKind::Char && r.major.is_some_and(|m| gpu_majors.contains(&m))
}

/// A device node at an NVIDIA path or of a GPU character major.
fn is_gpu_node(d: &DeviceNode, gpu_majors: &BTreeSet<u32>) -> bool {
    is_nvidia_path(&d.path) || (d.kind == NodeKind::Char && gpu_majors.contains(&d.major))
}

/// The rules of `linux.resources.devices`, read with runc's meaning.
fn device_rules(linux: &Map<String, Value>) -> Result<Vec<DeviceRule>, SpecError> {
    let rules = match linux.get("resources") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(res)) => res.get("devices"),
        Some(_) => return Err(shape("linux.resources", "expected an object")),
    };
    Ok(canonical::read_list(rules, "linux.resources.devices", DeviceRule::from_value)?)
}

/// The entries of `linux.devices`, numbers range-checked.
fn device_nodes(linux: &Map<String, Value>) -> Result<Vec<DeviceNode>, SpecError> {
    Ok(canonical::read_list(linux.get("devices"), "linux.devices", DeviceNode::from_value)?)
}

/// Just what is read of a mount.
#[derive(Deserialize)]
struct MountView {
    destination: String,
}

/// Just what is read of a namespace.
#[derive(Deserialize)]
struct NamespaceView {
    #[serde(rename = "type")]
    typ: String,
    #[serde(default)]
    path: Option<String>,
}

/// Just what is read of a hook.
#[derive(Deserialize)]
struct HookView {
    path: String,
}

/// Checks that a config can take a GPU injection, before anything is allocated: it has
/// `process` and `linux` sections, the device sections read as runc reads them (numbers in
/// the kernel's range, known types and access), and no allow rule opens every device or
/// character devices of any major.
pub fn check_gpu_spec(spec: &Value) -> Result<(), SpecError> {
    let root = spec.as_object().ok_or_else(|| shape(".", "config.json must be a JSON object"))?;
    match root.get("process") {
        Some(Value::Object(_)) => {}
        None | Some(Value::Null) => return Err(SpecError::NoProcess),
        Some(_) => return Err(shape("process", "expected an object")),
    }
    let linux = match root.get("linux") {
        Some(Value::Object(l)) => l,
        None | Some(Value::Null) => return Err(SpecError::NoLinux),
        Some(_) => return Err(shape("linux", "expected an object")),
    };
    device_nodes(linux)?;
    let rules = device_rules(linux)?;
    if let Some(e) = rules.iter().enumerate().find_map(|(i, r)| refuse_rule(i, r)) {
        return Err(e);
    }
    check_cgroup_stays(spec, root, linux)
}

/// Capabilities that act on the host itself, whatever namespaces the container has but a
/// user namespace of its own: mounts and cgroups (`CAP_SYS_ADMIN`: a second proc, the
/// devices hierarchy, binfmt_misc), kernel modules, raw I/O and kernel memory (`CAP_BPF`,
/// `CAP_PERFMON`, `CAP_SYS_RAWIO`), files by handle outside the mount namespace
/// (`CAP_DAC_READ_SEARCH`), reboot and kexec, the security modules' policy.
pub const HOST_CAPABILITIES: &[&str] = &[
    "CAP_SYS_ADMIN",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_DAC_READ_SEARCH",
    "CAP_BPF",
    "CAP_PERFMON",
    "CAP_SYS_BOOT",
    "CAP_MAC_ADMIN",
    "CAP_MAC_OVERRIDE",
];

/// A container without a GPU (a GPU container's allow-list, [`GPU_CAPABILITIES`], is
/// stricter): none without a user namespace of its own holds one of
/// [`HOST_CAPABILITIES`] in any set: with one, the container undoes every check of its
/// config from inside (mounts a second proc, the host's binfmt_misc, a cgroup hierarchy),
/// and the host's root is every GPU of the node.
pub fn check_host_capabilities(spec: &Value) -> Result<(), SpecError> {
    let namespaces =
        typed_items::<NamespaceView>(spec.pointer("/linux/namespaces"), "linux.namespaces")?;
    let own = |typ: &str| {
        namespaces.iter().any(|n| n.typ == typ && n.path.as_deref().unwrap_or("").is_empty())
    };
    // A mount namespace joined by path: runc mounts the container's mounts there and
    // pivot_root()s every process of it (the host's, another container's) into the image.
    if let Some(n) = namespaces.iter().find(|n| n.typ == "mount" && !own("mount")) {
        return Err(SpecError::HostCapability {
            at: "linux.namespaces".into(),
            why: format!(
                "a mount namespace joined by path ({}): runc would make its mounts and pivot_root \
                 there, moving every process of that namespace into the container's rootfs",
                tessera_api::untrusted(n.path.as_deref().unwrap_or("")).max_chars(200)
            ),
        });
    }
    // A user namespace of its own counts only where it does not map the host's root.
    let linux = spec.pointer("/linux").and_then(Value::as_object);
    let maps_root = match linux {
        Some(l) if own("user") => maps_host_root(l)?.is_some(),
        _ => false,
    };
    if own("user") && !maps_root {
        return Ok(());
    }
    // In the host's pid namespace (or another's joined by path), ptrace reaches the host's
    // processes: `/proc/<pid>/root` is the host's `/`.
    let ptrace_reaches_host = !own("pid");
    let found = capability_where(spec.get("process"), "process", |c| {
        HOST_CAPABILITIES.contains(&c) || (ptrace_reaches_host && c == "CAP_SYS_PTRACE")
    })?;
    let Some((at, c)) = found else { return Ok(()) };
    let why = if c == "CAP_SYS_PTRACE" {
        "CAP_SYS_PTRACE without a pid namespace of its own: /proc/<pid>/root of the host's \
         processes is the host's root"
            .to_string()
    } else {
        format!(
            "{} without a user namespace of its own (or with one that maps the host's root): it \
             acts on the host itself (mounts, cgroups, kernel memory), and the host's root is \
             every GPU of the node; no container on this node holds it",
            tessera_api::untrusted(&c).max_chars(64)
        )
    };
    Err(SpecError::HostCapability { at, why })
}

/// Where the kernel's Yama module says which processes may attach to which.
pub const YAMA_PTRACE_SCOPE: &str = "/proc/sys/kernel/yama/ptrace_scope";

/// Yama's ptrace scope as the file at `path` says it; `None` where the file is absent (no
/// Yama in this kernel) or says something else than a number.
pub fn read_ptrace_scope(path: &std::path::Path) -> Option<u32> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// How a container sees processes outside its own pid namespace, if it does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProcessView {
    /// No pid namespace of its own: the host's (`docker run --pid=host`, `hostPID: true`).
    HostPidNamespace,
    /// A pid namespace joined by this path (another container's, a pod's, the host's).
    JoinedPidNamespace(String),
    /// A bind that brings a procfs along ([`crate::mounts::procfs_bind`]): where, and what.
    ProcfsBind { at: String, what: String },
}

impl ProcessView {
    /// What it is, for a message.
    pub fn describe(&self) -> String {
        match self {
            ProcessView::HostPidNamespace => "no pid namespace of its own (the host's)".into(),
            ProcessView::JoinedPidNamespace(path) => format!(
                "the pid namespace at {} joined",
                tessera_api::untrusted(path).max_chars(200)
            ),
            ProcessView::ProcfsBind { what, .. } => what.clone(),
        }
    }
}

/// The pid namespace part of a [`ProcessView`]: none of its own, or one joined by path.
pub fn shared_pid_namespace(spec: &Value) -> Result<Option<ProcessView>, SpecError> {
    let namespaces =
        typed_items::<NamespaceView>(spec.pointer("/linux/namespaces"), "linux.namespaces")?;
    Ok(match namespaces.iter().find(|n| n.typ == "pid") {
        None => Some(ProcessView::HostPidNamespace),
        Some(n) => match n.path.as_deref().unwrap_or("") {
            "" => None,
            path => Some(ProcessView::JoinedPidNamespace(path.to_string())),
        },
    })
}

/// A container without a GPU that sees processes outside its own pid namespace (`view`:
/// the host's pid namespace, one joined by path, or a bind of a procfs, read-only or not)
/// sees every GPU container's processes, and the kernel's ptrace check lets a process of the
/// same uid whose capabilities cover the target's *attach* to one: `pidfd_getfd(2)` copies
/// its open `/dev/nvidia*` descriptors (the devices cgroup judges `open(2)` only, so the
/// copy drives the GPU), `/proc/<pid>/mem` reads and writes its memory. Yama's
/// `ptrace_scope` of 1 or more refuses attach-mode access to any process that is not a
/// descendant, whatever the uid (`CAP_SYS_PTRACE`, which passes it, is refused to such a
/// container by [`check_host_capabilities`]). So such a container runs only where Yama
/// says 1 or more; `ptrace_scope` is what [`read_ptrace_scope`] read (`None`: no Yama).
/// Read-mode access stays, as on any node that admits `hostPID` (Kubernetes' Pod Security
/// baseline forbids it): the GPU containers' files through `/proc/<pid>/root`, their
/// environment; reopening a descriptor's device node is the devices cgroup's to refuse.
pub fn check_process_view(
    spec: &Value,
    view: Option<ProcessView>,
    ptrace_scope: Option<u32>,
) -> Result<(), SpecError> {
    let Some(view) = view else { return Ok(()) };
    // CAP_SYS_PTRACE passes Yama at every scope but 3 (a tracer holding it in the target's
    // user namespace attaches to anything), and the commoncap check whatever the uids.
    if let Some((at, _)) =
        capability_where(spec.get("process"), "process", |c| c == "CAP_SYS_PTRACE")?
    {
        return Err(SpecError::ProcessView {
            at,
            why: format!(
                "CAP_SYS_PTRACE where processes outside the container's own pid namespace are \
                 in view ({}): it attaches to any GPU container's process, Yama or not",
                view.describe()
            ),
        });
    }
    if ptrace_scope.is_some_and(|s| s >= 1) {
        return Ok(());
    }
    let at = match &view {
        ProcessView::HostPidNamespace | ProcessView::JoinedPidNamespace(_) => {
            "linux.namespaces".to_string()
        }
        ProcessView::ProcfsBind { at, .. } => at.clone(),
    };
    let shared = view.describe();
    let kernel = match ptrace_scope {
        Some(s) => format!("Yama's ptrace_scope is {s}"),
        None => "this kernel has no Yama ptrace_scope".to_string(),
    };
    Err(SpecError::ProcessView {
        at,
        why: format!(
            "processes outside the container's own pid namespace in view ({shared}) where \
             {kernel}: a process of the same uid attaches to any GPU container's process it \
             sees, takes its open GPU descriptors with pidfd_getfd past the devices cgroup and \
             reads its memory; set the sysctl kernel.yama.ptrace_scope=1 on this node (attach \
             only to descendants), or give the container a pid namespace of its own and no \
             procfs bind"
        ),
    })
}

/// The first of [`HOST_CAPABILITIES`] a process section holds in any set, with the set:
/// what an exec into a container without a GPU may not add.
pub fn host_capability_in(
    process: &Value,
    at: &str,
) -> Result<Option<(String, String)>, SpecError> {
    capability_where(Some(process), at, |c| HOST_CAPABILITIES.contains(&c))
}

/// What `runc spec` (1.1) makes read-only in every container; kept in a GPU container's
/// `linux.readonlyPaths` whatever its config lists.
pub const READONLY_PATHS: &[&str] =
    &["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"];

/// What `runc spec` (1.1) masks in every container; kept in a GPU container's
/// `linux.maskedPaths` whatever its config lists.
pub const MASKED_PATHS: &[&str] = &[
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/sys/firmware",
    "/proc/scsi",
];

/// linux.readonlyPaths and linux.maskedPaths: runc protects /proc/sys and the rest only
/// where the config lists them; every container on a Tessera node gets at least `runc
/// spec`'s lists (its root may be the host's: a writable /proc/sys is the host's
/// `kernel.core_pattern`, a helper the host's root runs). Whether anything was added.
fn protect_proc(linux: &mut serde_json::Map<String, Value>) -> Result<bool, SpecError> {
    let mut added = false;
    for (key, defaults) in [("readonlyPaths", READONLY_PATHS), ("maskedPaths", MASKED_PATHS)] {
        let list = array_entry(linux, key, &format!("linux.{key}"))?;
        for p in defaults {
            // Only the very spelling counts: runc hands each entry to mount(2) as written
            // and skips one the kernel cannot find (`/proc/none/../sys` is ENOENT, though
            // it cleans to /proc/sys). A second entry for the same path costs nothing.
            if !list.iter().any(|v| v.as_str() == Some(*p)) {
                list.push(Value::from(*p));
                added = true;
            }
        }
    }
    Ok(added)
}

/// [`protect_proc`] for a container without a GPU (its config is written back only where
/// something was added). Whether anything was.
pub fn keep_proc_protected(spec: &mut Value) -> Result<bool, SpecError> {
    let root =
        spec.as_object_mut().ok_or_else(|| shape(".", "config.json must be a JSON object"))?;
    let linux = object_entry(root, "linux", "linux")?;
    protect_proc(linux)
}

/// The capability sets runc applies.
const CAPABILITY_SETS: [&str; 5] = ["bounding", "effective", "permitted", "inheritable", "ambient"];

/// The capabilities a GPU container's processes may hold without a user namespace of its
/// own — an allow-list, not a deny-list: Docker's default set, and `CAP_IPC_LOCK` (pinned
/// memory for RDMA and NCCL) and `CAP_SYS_PTRACE` (profilers and debuggers, within the
/// container's own pid namespace). Everything else reaches past the container or its
/// limits: `CAP_SYS_ADMIN` (mounts a cgroup hierarchy and rewrites its device rules),
/// `CAP_DAC_READ_SEARCH` (`open_by_handle_at` leaves the mount namespace), `CAP_SYS_MODULE`,
/// `CAP_SYS_RAWIO`, `CAP_SYS_NICE` (real-time scheduling is outside the CPU quota),
/// `CAP_SYS_TIME`, `CAP_BPF`, `CAP_PERFMON`, `CAP_NET_ADMIN` and the rest.
pub const GPU_CAPABILITIES: &[&str] = &[
    "CAP_AUDIT_WRITE",
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_IPC_LOCK",
    "CAP_KILL",
    "CAP_MKNOD",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_RAW",
    "CAP_SETFCAP",
    "CAP_SETGID",
    "CAP_SETPCAP",
    "CAP_SETUID",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
];

/// The capabilities of a process section (`process` of config.json, or the `--process` of
/// an exec) that are outside [`GPU_CAPABILITIES`], with the set each is in.
pub fn capabilities_beyond_the_gpu_set(
    process: Option<&Value>,
    at: &str,
) -> Result<Option<(String, String)>, SpecError> {
    capability_where(process, at, |c| !GPU_CAPABILITIES.contains(&c))
}

/// The first capability of a process section (any set, in [`CAPABILITY_SETS`]' order) that
/// `pick` takes, with the set it is in.
pub fn capability_where(
    process: Option<&Value>,
    at: &str,
    pick: impl Fn(&str) -> bool,
) -> Result<Option<(String, String)>, SpecError> {
    let Some(Value::Object(caps)) = process.and_then(|p| p.get("capabilities")) else {
        return Ok(None);
    };
    for set in CAPABILITY_SETS {
        let at = format!("{at}.capabilities.{set}");
        let names: Vec<String> = typed_items(caps.get(set), &at)?;
        if let Some(c) = names.iter().find(|c| pick(c.as_str())) {
            return Ok(Some((at, c.clone())));
        }
    }
    Ok(None)
}

/// A process's `RLIMIT_RTPRIO` above 0: real-time priority without `CAP_SYS_NICE`.
pub fn real_time_rlimit(process: Option<&Value>, at: &str) -> Result<Option<String>, SpecError> {
    let Some(list) = process.and_then(|p| p.get("rlimits")) else { return Ok(None) };
    let items: Vec<Value> = typed_items(Some(list), &format!("{at}.rlimits"))?;
    for (i, r) in items.iter().enumerate() {
        if r.get("type").and_then(Value::as_str) != Some("RLIMIT_RTPRIO") {
            continue;
        }
        let above = |k: &str| r.get(k).and_then(Value::as_u64).is_some_and(|v| v > 0);
        if above("hard") || above("soft") {
            return Ok(Some(format!("{at}.rlimits[{i}]")));
        }
    }
    Ok(None)
}

/// A user namespace mapping that takes in the host's root (uid or gid 0): inside it the
/// container's root is the host's, and the mounts runc made there are its own to remount.
fn maps_host_root(linux: &Map<String, Value>) -> Result<Option<String>, SpecError> {
    #[derive(Deserialize)]
    struct IdMapping {
        #[serde(rename = "hostID")]
        host_id: u32,
        size: u32,
    }
    for key in ["uidMappings", "gidMappings"] {
        let at = format!("linux.{key}");
        let maps: Vec<IdMapping> = typed_items(linux.get(key), &at)?;
        // Host ids are unsigned: only a range that starts at 0 takes 0 in.
        if let Some(i) = maps.iter().position(|m| m.host_id == 0 && m.size > 0) {
            return Ok(Some(format!("{at}[{i}]")));
        }
    }
    Ok(None)
}

/// Refuses what would let the container change its devices cgroup after runc set it (the
/// device rules decided above then mean nothing), reach the host's cgroups another way, or
/// take more CPU than its quota counts:
/// - a capability outside [`GPU_CAPABILITIES`] without a new user namespace (an
///   allow-list: `CAP_SYS_ADMIN` mounts the cgroup hierarchy and writes `devices.allow`,
///   checked against the initial user namespace; `CAP_DAC_READ_SEARCH` leaves the mount
///   namespace with `open_by_handle_at`; ...);
/// - a user namespace whose mappings take in the host's uid or gid 0;
/// - no mount namespace of its own (none, or one joined by path): runc would make the
///   container's mounts in a namespace others use, and the container would see theirs;
/// - no pid namespace of its own (none, or one joined by path): `/proc/<pid>/root` of
///   another container's process leads into that container's mounts (a writable cgroupfs
///   of a container without a GPU among them);
/// - real-time CPU (`linux.resources.cpu.realtimeRuntime`/`realtimePeriod`,
///   `RLIMIT_RTPRIO`): outside the CFS quota its CPU is admitted by;
/// - any mount whose options leave a cgroup hierarchy or sysfs writable, remount an
///   earlier mount, or let later mounts propagate in ([`crate::mounts::check_options`];
///   bind sources are judged where the kernel resolves them, [`crate::mounts::check_sources`]).
fn check_cgroup_stays(
    spec: &Value,
    root: &Map<String, Value>,
    linux: &Map<String, Value>,
) -> Result<(), SpecError> {
    let namespaces = typed_items::<NamespaceView>(linux.get("namespaces"), "linux.namespaces")?;
    let new_ns = |typ: &str| {
        namespaces.iter().any(|n| n.typ == typ && n.path.as_deref().unwrap_or("").is_empty())
    };
    if new_ns("user") {
        if let Some(at) = maps_host_root(linux)? {
            return Err(SpecError::DeviceCgroupWritable {
                at,
                why: "a user namespace that maps the host's root (uid or gid 0): its root is the \
                      host's, and the mounts runc made in it are its own to remount read-write"
                    .into(),
            });
        }
    } else if let Some((at, cap)) = capabilities_beyond_the_gpu_set(root.get("process"), "process")?
    {
        return Err(SpecError::DeviceCgroupWritable {
            at,
            why: format!(
                "{} without a user namespace of its own (GPU containers hold only {})",
                tessera_api::untrusted(&cap),
                GPU_CAPABILITIES.join(", ")
            ),
        });
    }
    if !new_ns("mount") {
        return Err(SpecError::DeviceCgroupWritable {
            at: "linux.namespaces".into(),
            why: "no mount namespace of its own (runc would mount into a namespace others use, \
                  and the container would see their mounts)"
                .into(),
        });
    }
    if !new_ns("pid") {
        return Err(SpecError::DeviceCgroupWritable {
            at: "linux.namespaces".into(),
            why: "no pid namespace of its own (/proc/<pid>/root of a process it shares one with \
                  leads into that process's mounts)"
                .into(),
        });
    }
    if let Some(at) = real_time_rlimit(root.get("process"), "process")? {
        return Err(SpecError::RealTime {
            at,
            why: "RLIMIT_RTPRIO above 0 gives real-time priority".into(),
        });
    }
    for key in ["realtimeRuntime", "realtimePeriod"] {
        let v = linux.get("resources").and_then(|r| r.get("cpu")).and_then(|c| c.get(key));
        if v.is_some_and(|v| !v.is_null() && v.as_i64() != Some(0) && v.as_u64() != Some(0)) {
            return Err(SpecError::RealTime {
                at: format!("linux.resources.cpu.{key}"),
                why: "a real-time CPU budget".into(),
            });
        }
    }
    crate::mounts::check_options(spec)?;
    Ok(())
}

/// What a GPU container's config means on this host, judged with the kernel's facts: its
/// bind mounts where the kernel resolves them ([`crate::mounts::check_sources`]).
pub fn check_host_facts(
    bundle: &Path,
    spec: &Value,
    host: &dyn crate::mounts::HostFacts,
) -> Result<(), SpecError> {
    let root = match spec.pointer("/root/path") {
        Some(Value::String(p)) => bundle.join(p),
        _ => bundle.join("rootfs"),
    };
    crate::mounts::check_sources(spec, bundle, &root, host)?;
    Ok(())
}

fn utf8(p: &Path, what: &str) -> Result<String, SpecError> {
    p.to_str()
        .map(str::to_string)
        .ok_or_else(|| SpecError::BadInjection(format!("{what} {p:?} is not valid UTF-8")))
}

fn has_dotdot(p: &str) -> bool {
    p.split('/').any(|c| c == "..")
}

fn validate_injection(inj: &Injection, hooks: &HookConfig) -> Result<(), SpecError> {
    let bad = |m: String| Err(SpecError::BadInjection(m));
    for d in &inj.devices {
        if !d.path.starts_with("/dev/") || has_dotdot(&d.path) || d.path.contains('\0') {
            return bad(format!(
                "device path `{}` must be an absolute path under /dev without `..`",
                d.path
            ));
        }
        if !(0..=canonical::MAX_MAJOR).contains(&d.major)
            || !(0..=canonical::MAX_MINOR).contains(&d.minor)
        {
            return bad(format!(
                "device {} has an impossible number {}:{}",
                d.path, d.major, d.minor
            ));
        }
        if d.file_mode > 0o7777 {
            return bad(format!("device {} has an impossible mode {:o}", d.path, d.file_mode));
        }
    }
    for e in &inj.env {
        match e.split_once('=') {
            Some((k, _)) if !k.is_empty() && !e.contains('\0') => {}
            _ => return bad(format!("env entry `{e}` is not KEY=VALUE")),
        }
    }
    for m in &inj.mounts {
        if !m.destination.starts_with('/')
            || has_dotdot(&m.destination)
            || m.destination.contains('\0')
        {
            return bad(format!(
                "mount destination `{}` must be absolute and without `..`",
                m.destination
            ));
        }
        if !m.source.starts_with('/') || has_dotdot(&m.source) || m.source.contains('\0') {
            return bad(format!("mount source `{}` must be absolute and without `..`", m.source));
        }
    }
    if !hooks.path.is_absolute() {
        return bad(format!("hook path {} is not absolute", hooks.path.display()));
    }
    if !hooks.socket.is_absolute() {
        return bad(format!("socket path {} is not absolute", hooks.socket.display()));
    }
    Ok(())
}

/// Applies an injection to a parsed config.json, in place:
/// - `linux.devices`: every NVIDIA device already there is removed (path under
///   `/dev/nvidia`, or a character device with major 195, an injected major, or the major
///   of such a path), as is any device at an injected path; then the injected devices are
///   added (type `c`, uid 0, gid 0).
/// - `linux.resources.devices`: allow rules for those majors are removed; a deny-all rule
///   is put first if there is none; one `c major:minor rwm` allow rule per injected device
///   is appended after the existing rules. An allow-all rule is refused ([`SpecError::AllowAll`]).
/// - `process.env`: each injected `KEY=VALUE` replaces the existing `KEY` (or is appended).
/// - `mounts`: mounts at an injected destination or under `/dev/nvidia` are removed; the
///   injected bind mounts are appended (`rbind, ro|rw, nosuid, nodev`).
/// - `hooks.prestart`: any earlier entry for the same hook binary is removed, and where
///   `hooks.prestart` says so `tessera-hook prestart` is appended, whose whole env is
///   `TESSERA_SOCKET=...` (and an annotation [`CONFIRM_ANNOTATION`] is removed); where it
///   does not, that annotation says that tessera-runtime confirms the container after
///   `runc create`. Entries for that
///   binary in `hooks.poststop` (written by earlier versions) are removed: the wrapper
///   itself releases the grant once runc has deleted the container (see `runtime`).
///
/// On error the config may be partly edited: callers discard it.
pub fn apply_injection(
    spec: &mut Value,
    inj: &Injection,
    hooks: &HookConfig,
) -> Result<(), SpecError> {
    validate_injection(inj, hooks)?;
    check_gpu_spec(spec)?;
    // No mount made outside after the checks reaches the container (runc's default is
    // rslave).
    crate::mounts::make_private(spec)?;
    let hook_path = utf8(&hooks.path, "hook path")?;
    let socket = utf8(&hooks.socket, "socket path")?;
    let root =
        spec.as_object_mut().ok_or_else(|| shape(".", "config.json must be a JSON object"))?;

    let linux = object_entry(root, "linux", "linux")?;
    protect_proc(linux)?;

    // linux.devices
    let injected_paths: BTreeSet<String> = inj.devices.iter().map(|d| normalize(&d.path)).collect();
    // Every major of the driver (the daemon sends them all: nvidia, uvm, caps), the
    // injected ones, and 195 always. (What a config claims about a major decides nothing.)
    let gpu_majors: BTreeSet<u32> = inj
        .devices
        .iter()
        .map(|d| d.major)
        .chain(inj.gpu_majors.iter().copied())
        .chain([NVIDIA_MAJOR])
        .filter_map(|m| u32::try_from(m).ok())
        .collect();
    let existing = device_nodes(linux)?;
    let devices = array_entry(linux, "devices", "linux.devices")?;
    let kept: Vec<Value> = std::mem::take(devices)
        .into_iter()
        .zip(&existing)
        .filter(|(_, d)| {
            !(is_gpu_node(d, &gpu_majors) || injected_paths.contains(&normalize(&d.path)))
        })
        .map(|(v, _)| v)
        .collect();
    *devices = kept;
    for d in &inj.devices {
        let dev = LinuxDeviceBuilder::default()
            .path(&d.path)
            .typ(LinuxDeviceType::C)
            .major(d.major)
            .minor(d.minor)
            .file_mode(d.file_mode)
            .uid(0u32)
            .gid(0u32)
            .build()
            .map_err(|e| SpecError::BadInjection(e.to_string()))?;
        devices.push(to_value(&dev)?);
    }

    // linux.resources.devices (rules that open every device or any major were refused by
    // check_gpu_spec above): allow rules for a GPU major removed; every kept rule rewritten
    // in canonical form (explicit type and access, wildcards omitted), deny-all first, then
    // one allow per injected node.
    let rules = device_rules(linux)?;
    let deny_all = DeviceRule {
        allow: false,
        kind: RuleKind::All,
        major: None,
        minor: None,
        access: canonical::Access::ALL,
    };
    let mut kept: Vec<DeviceRule> =
        rules.into_iter().filter(|r| !is_gpu_rule(r, &gpu_majors)).collect();
    if kept.first().is_none_or(|r| r.allow || r.kind != RuleKind::All) {
        kept.insert(0, deny_all);
    }
    let mut granted = BTreeSet::new();
    for d in &inj.devices {
        // validate_injection checked the numbers fit.
        let (major, minor) = (d.major as u32, d.minor as u32);
        granted.insert((Some(major), Some(minor)));
        let rule = DeviceRule {
            allow: true,
            kind: RuleKind::Char,
            major: Some(major),
            minor: Some(minor),
            access: canonical::Access::ALL,
        };
        if !kept.contains(&rule) {
            kept.push(rule);
        }
    }
    // What runc will enforce (these rules, then its own defaults) must open exactly the
    // granted GPU devices: checked on the rewritten rules, not assumed.
    let access = DeviceAccess::emulate(kept.iter().chain(canonical::RUNC_DEFAULT_RULES))
        .map_err(|e| SpecError::BadInjection(format!("device rules cannot be applied: {e}")))?;
    let opened: BTreeSet<(Option<u32>, Option<u32>)> = access
        .gpu_openings(&gpu_majors)
        .map(|m| m.into_keys().collect())
        .ok_or_else(|| SpecError::BadInjection("device rules would allow every device".into()))?;
    if opened != granted {
        return Err(SpecError::BadInjection(format!(
            "device rules would open GPU devices {opened:?}, not exactly the granted {granted:?}"
        )));
    }
    let resources = object_entry(linux, "resources", "linux.resources")?;
    resources
        .insert("devices".into(), Value::Array(kept.iter().map(DeviceRule::to_value).collect()));
    if let Some(pin) = &inj.cpuset {
        pin_cpuset(resources, pin)?;
    }

    // process.env
    let process = object_entry(root, "process", "process")?;
    let env_items: Vec<String> = typed_items(process.get("env"), "process.env")?;
    let mut env = env_items;
    for entry in &inj.env {
        let key = entry.split_once('=').map_or(entry.as_str(), |(k, _)| k);
        let same_key = |e: &String| e.split_once('=').map_or(e.as_str(), |(k, _)| k) == key;
        match env.iter().position(same_key) {
            Some(first) => {
                env[first] = entry.clone();
                let mut i = first + 1;
                while i < env.len() {
                    if same_key(&env[i]) {
                        env.remove(i);
                    } else {
                        i += 1;
                    }
                }
            }
            None => env.push(entry.clone()),
        }
    }
    process.insert("env".into(), Value::from(env));

    // mounts
    let existing: Vec<MountView> = typed_items(root.get("mounts"), "mounts")?;
    let destinations: BTreeSet<String> =
        inj.mounts.iter().map(|m| normalize(&m.destination)).collect();
    let mounts = array_entry(root, "mounts", "mounts")?;
    let kept: Vec<Value> = std::mem::take(mounts)
        .into_iter()
        .zip(&existing)
        .filter(|(_, m)| {
            let d = normalize(&m.destination);
            !(destinations.contains(&d) || d.starts_with(NVIDIA_PATH_PREFIX))
        })
        .map(|(v, _)| v)
        .collect();
    *mounts = kept;
    for m in &inj.mounts {
        let options = ["rbind", if m.read_only { "ro" } else { "rw" }, "nosuid", "nodev"];
        let mount = MountBuilder::default()
            .destination(&m.destination)
            .typ("bind")
            .source(&m.source)
            .options(options.iter().map(|s| s.to_string()).collect::<Vec<_>>())
            .build()
            .map_err(|e| SpecError::BadInjection(e.to_string()))?;
        mounts.push(to_value(&mount)?);
    }

    // hooks
    let hooks_obj = object_entry(root, "hooks", "hooks")?;
    for phase in ["prestart", "poststop"] {
        let at = format!("hooks.{phase}");
        let list = without_hook(hooks_obj, phase, &at, &hook_path)?;
        if phase == "prestart" && hooks.prestart {
            let hook = HookBuilder::default()
                .path(&hook_path)
                .args(vec!["tessera-hook".to_string(), phase.to_string()])
                .env(vec![format!("TESSERA_SOCKET={socket}")])
                .timeout(HOOK_TIMEOUT_SECS)
                .build()
                .map_err(|e| SpecError::BadInjection(e.to_string()))?;
            list.push(to_value(&hook)?);
        }
    }
    if hooks_obj.get("poststop").and_then(Value::as_array).is_some_and(Vec::is_empty) {
        hooks_obj.remove("poststop");
    }
    if !hooks.prestart {
        let annotations = object_entry(root, "annotations", "annotations")?;
        annotations.insert(CONFIRM_ANNOTATION.into(), Value::String(CONFIRM_AFTER_CREATE.into()));
    } else if let Some(annotations) = root.get_mut("annotations").and_then(Value::as_object_mut) {
        // A run is confirmed by its hook: the bundle may still say otherwise from an earlier
        // create this wrapper rewrote, which would hold the run's container for one never
        // confirmed (crate::confirm::check_confirmed refuses its execs).
        annotations.remove(CONFIRM_ANNOTATION);
    }
    Ok(())
}

/// Every container: no annotation named `bundle`, and none whose key holds `=`. runc
/// records each annotation as a `key=value` label before its own `bundle=<dir>`, and reads
/// them back split at the first `=`, the first of a key winning: an exec would take its
/// process from the directory such an annotation names, and a key `tessera.io/allocated=x`
/// would read as tessera-runtime's own grant label.
pub fn check_annotation_keys(spec: &Value) -> Result<(), SpecError> {
    let Some(Value::Object(map)) = spec.get("annotations") else { return Ok(()) };
    match map.keys().find(|k| k.as_str() == "bundle" || k.contains('=')) {
        Some(k) => Err(SpecError::ProcessView {
            at: format!("annotations[{}]", tessera_api::untrusted(k).max_chars(128)),
            why: "runc records annotations as `key=value` labels beside its own `bundle=<dir>` \
                  and reads them back split at the first `=`: this key would stand for another \
                  label (an exec takes its process from the first `bundle` label)"
                .into(),
        }),
        None => Ok(()),
    }
}

/// `hooks.<phase>` of a config's hooks object (`at` for messages), without any entry whose
/// path is `hook_path` (tessera-hook's own); the list, to add to.
fn without_hook<'a>(
    hooks_obj: &'a mut Map<String, Value>,
    phase: &str,
    at: &str,
    hook_path: &str,
) -> Result<&'a mut Vec<Value>, SpecError> {
    let existing: Vec<HookView> = typed_items(hooks_obj.get(phase), at)?;
    let list = array_entry(hooks_obj, phase, at)?;
    let kept: Vec<Value> = std::mem::take(list)
        .into_iter()
        .zip(&existing)
        .filter(|(_, h)| h.path != hook_path)
        .map(|(v, _)| v)
        .collect();
    *list = kept;
    Ok(list)
}

/// The first `hooks.createRuntime` or `hooks.createContainer` entry of a config, by where it
/// is: runc 1.1 runs them after the prestart hooks and before `pivot_root`.
pub fn hooks_after_prestart(spec: &Value) -> Option<String> {
    ["createRuntime", "createContainer"].into_iter().find_map(|phase| {
        let list = spec.pointer(&format!("/hooks/{phase}"))?.as_array()?;
        (!list.is_empty()).then(|| format!("hooks.{phase}[0]"))
    })
}

/// A container without a GPU: [`ALLOCATED_ANNOTATION`] and [`CONFIRM_ANNOTATION`] removed
/// from its annotations (runc records them as labels; the exec and start checks tell a GPU
/// container by them). Returns whether one was there.
pub fn strip_own_annotations(spec: &mut Value) -> Result<bool, SpecError> {
    let Some(annotations) = spec.get_mut("annotations") else { return Ok(false) };
    let Some(map) = annotations.as_object_mut() else {
        return Err(shape("annotations", "expected an object"));
    };
    let a = map.remove(ALLOCATED_ANNOTATION).is_some();
    let c = map.remove(CONFIRM_ANNOTATION).is_some();
    Ok(a || c)
}

/// A `runc run` of a container without a GPU: `tessera-hook plain-prestart` (at
/// `hook_path`, with tesserad's `socket`) is added to its prestart hooks, where runc runs it
/// after making the mounts and before `pivot_root`: what runc made is judged there, as a
/// created container's is at its `start` ([`crate::confirm::judge_plain_made`]).
pub fn add_plain_prestart(
    spec: &mut Value,
    hook_path: &str,
    socket: &str,
) -> Result<(), SpecError> {
    let root = spec.as_object_mut().ok_or_else(|| shape("", "expected an object"))?;
    let hooks_obj = object_entry(root, "hooks", "hooks")?;
    // One of ours, whatever an earlier run of this bundle left.
    let list = without_hook(hooks_obj, "prestart", "hooks.prestart", hook_path)?;
    let hook = HookBuilder::default()
        .path(hook_path)
        .args(vec!["tessera-hook".to_string(), "plain-prestart".to_string()])
        .env(vec![format!("TESSERA_SOCKET={socket}")])
        .timeout(HOOK_TIMEOUT_SECS)
        .build()
        .map_err(|e| SpecError::BadInjection(e.to_string()))?;
    list.push(to_value(&hook)?);
    Ok(())
}

/// No grant, no GPU: for a container that asked for no GPU, removes every device node at an
/// NVIDIA path or of a GPU character major (`gpu_majors`: the driver's, 195 always) and every
/// allow rule of those majors, and refuses a character rule of any major that reads or
/// writes (it would open GPUs). Returns whether anything was removed: a config with nothing
/// of the GPU in it is left exactly as it was. An allow rule of type `a` (a privileged
/// container: the node's root, whose boundary no device rule is) is left to the engine.
pub fn strip_ungranted_gpus(
    spec: &mut Value,
    gpu_majors: &BTreeSet<u32>,
) -> Result<bool, SpecError> {
    let Some(Value::Object(linux)) = spec.get_mut("linux") else { return Ok(false) };
    let nodes = device_nodes(linux)?;
    let rules = device_rules(linux)?;
    if let Some((index, r)) = rules.iter().enumerate().find(|(_, r)| opens_any_char_major(r)) {
        return Err(SpecError::GpuWithoutGrant { index, rule: r.to_string() });
    }
    let gpu_node = |d: &DeviceNode| is_gpu_node(d, gpu_majors);
    let gpu_rule = |r: &DeviceRule| is_gpu_rule(r, gpu_majors);
    if !nodes.iter().any(gpu_node) && !rules.iter().any(gpu_rule) {
        return Ok(false);
    }
    if let Some(list) = linux.get_mut("devices").and_then(Value::as_array_mut) {
        let kept: Vec<Value> = std::mem::take(list)
            .into_iter()
            .zip(&nodes)
            .filter(|(_, d)| !gpu_node(d))
            .map(|(v, _)| v)
            .collect();
        *list = kept;
    }
    if let Some(list) =
        linux.get_mut("resources").and_then(|r| r.get_mut("devices")).and_then(Value::as_array_mut)
    {
        let kept: Vec<Value> = std::mem::take(list)
            .into_iter()
            .zip(&rules)
            .filter(|(_, r)| !gpu_rule(r))
            .map(|(v, _)| v)
            .collect();
        *list = kept;
    }
    Ok(true)
}

/// Records the granted device UUIDs in the `tessera.io/allocated` annotation.
pub fn annotate_allocation<'a>(
    spec: &mut Value,
    uuids: impl IntoIterator<Item = &'a str>,
) -> Result<(), SpecError> {
    let root =
        spec.as_object_mut().ok_or_else(|| shape(".", "config.json must be a JSON object"))?;
    let annotations = object_entry(root, "annotations", "annotations")?;
    let list: Vec<&str> = uuids.into_iter().collect();
    annotations.insert(ALLOCATED_ANNOTATION.into(), Value::String(list.join(",")));
    Ok(())
}

/// [`apply_injection`] for an `oci_spec::runtime::Spec`, for callers that hold one. It
/// goes through a `Value`, so it keeps only what `Spec` models (see the module docs); the
/// runtime wrapper edits the `Value` directly.
pub fn apply_injection_to_spec(
    spec: &mut Spec,
    inj: &Injection,
    hooks: &HookConfig,
) -> Result<(), SpecError> {
    let mut v = serde_json::to_value(&*spec).map_err(|e| shape(".", e.to_string()))?;
    apply_injection(&mut v, inj, hooks)?;
    *spec = typed(&v, "")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use tessera_api::{BindMount, DeviceNode};

    const RUNC_SPEC: &str = include_str!("../testdata/runc-spec.json");
    const CRI: &str = include_str!("../testdata/containerd-cri.json");

    fn hooks() -> HookConfig {
        HookConfig {
            path: "/usr/local/bin/tessera-hook".into(),
            socket: "/run/tessera/tesserad.sock".into(),
            prestart: true,
        }
    }

    fn dev(path: &str, major: i64, minor: i64) -> DeviceNode {
        DeviceNode { path: path.into(), major, minor, file_mode: 0o666 }
    }

    /// A MIG injection: control devices, the parent GPU, two capability nodes.
    fn mig_injection() -> Injection {
        Injection {
            devices: vec![
                dev("/dev/nvidiactl", 195, 255),
                dev("/dev/nvidia-uvm", 508, 0),
                dev("/dev/nvidia-uvm-tools", 508, 1),
                dev("/dev/nvidia0", 195, 0),
                dev("/dev/nvidia-caps/nvidia-cap12", 237, 12),
                dev("/dev/nvidia-caps/nvidia-cap13", 237, 13),
            ],
            env: vec![
                "CUDA_VISIBLE_DEVICES=MIG-11111111-2222-3333-4444-555555555555".into(),
                "NVIDIA_VISIBLE_DEVICES=void".into(),
            ],
            mounts: vec![BindMount {
                source: "/run/tessera/mps/t1".into(),
                destination: "/run/nvidia-mps".into(),
                read_only: true,
            }],
            gpu_majors: vec![195, 237, 508],
            cpuset: None,
        }
    }

    /// Issue 26: `topology.pin_cpus`: the grant's CPUs and memory nodes, merged with what
    /// the config sets (kubelet's CPU manager); a config set disjoint from the pin is
    /// refused, naming the rule and both sets (never kept, never emptied).
    #[test]
    fn the_cpuset_follows_the_gpus_and_meets_the_configs_own() {
        let mut inj = mig_injection();
        inj.cpuset = Some(tessera_api::CpuSet { cpus: "16-31".into(), mems: Some("1".into()) });
        let mut v = parse(RUNC_SPEC);
        apply_injection(&mut v, &inj, &hooks()).expect("applies");
        assert_eq!(v["linux"]["resources"]["cpu"]["cpus"], "16-31");
        assert_eq!(v["linux"]["resources"]["cpu"]["mems"], "1");
        let mut v = parse(RUNC_SPEC);
        v["linux"]["resources"]["cpu"] = json!({"cpus": "0-3,20-23", "mems": "0"});
        let e = apply_injection(&mut v, &inj, &hooks()).expect_err("mems disjoint");
        assert!(
            matches!(&e, SpecError::CpusetOffGpus { key: "mems", .. })
                && e.to_string().contains("topology.pin_cpus")
                && e.to_string().contains("`0`")
                && e.to_string().contains("(1)"),
            "{e}"
        );
        let mut v = parse(RUNC_SPEC);
        v["linux"]["resources"]["cpu"] = json!({"cpus": "0-3,20-23", "mems": "0-1"});
        apply_injection(&mut v, &inj, &hooks()).expect("applies");
        assert_eq!(v["linux"]["resources"]["cpu"]["cpus"], "20-23", "the intersection");
        assert_eq!(v["linux"]["resources"]["cpu"]["mems"], "1");
        let mut v = parse(RUNC_SPEC);
        v["linux"]["resources"]["cpu"] = json!({"cpus": "0-3"});
        let e = apply_injection(&mut v, &inj, &hooks()).expect_err("cpus disjoint");
        assert!(
            e.to_string().starts_with("linux.resources.cpu.cpus `0-3` shares no entry with the set its GPUs are pinned to (16-31) under the policy's topology.pin_cpus"),
            "{e}"
        );
        inj.cpuset = Some(tessera_api::CpuSet { cpus: "0-x".into(), mems: None });
        let e = apply_injection(&mut parse(RUNC_SPEC), &inj, &hooks()).expect_err("bad list");
        assert!(e.to_string().contains("cpuset"), "{e}");
    }

    fn parse(s: &str) -> Value {
        parse_config(Path::new("config.json"), s.as_bytes()).expect("fixture parses")
    }

    fn strs(v: &Value) -> Vec<String> {
        serde_json::from_value(v.clone()).expect("string array")
    }

    #[test]
    fn runc_spec_injection_is_exact() {
        let mut v = parse(RUNC_SPEC);
        let before = v.clone();
        let inj = mig_injection();
        apply_injection(&mut v, &inj, &hooks()).expect("applies");

        assert_eq!(
            v["linux"]["devices"],
            json!([
                {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255, "fileMode": 438, "uid": 0, "gid": 0},
                {"path": "/dev/nvidia-uvm", "type": "c", "major": 508, "minor": 0, "fileMode": 438, "uid": 0, "gid": 0},
                {"path": "/dev/nvidia-uvm-tools", "type": "c", "major": 508, "minor": 1, "fileMode": 438, "uid": 0, "gid": 0},
                {"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0, "fileMode": 438, "uid": 0, "gid": 0},
                {"path": "/dev/nvidia-caps/nvidia-cap12", "type": "c", "major": 237, "minor": 12, "fileMode": 438, "uid": 0, "gid": 0},
                {"path": "/dev/nvidia-caps/nvidia-cap13", "type": "c", "major": 237, "minor": 13, "fileMode": 438, "uid": 0, "gid": 0}
            ])
        );
        assert_eq!(
            v["linux"]["resources"]["devices"],
            json!([
                {"allow": false, "type": "a", "access": "rwm"},
                {"allow": true, "type": "c", "major": 195, "minor": 255, "access": "rwm"},
                {"allow": true, "type": "c", "major": 508, "minor": 0, "access": "rwm"},
                {"allow": true, "type": "c", "major": 508, "minor": 1, "access": "rwm"},
                {"allow": true, "type": "c", "major": 195, "minor": 0, "access": "rwm"},
                {"allow": true, "type": "c", "major": 237, "minor": 12, "access": "rwm"},
                {"allow": true, "type": "c", "major": 237, "minor": 13, "access": "rwm"}
            ])
        );
        assert_eq!(
            strs(&v["process"]["env"]),
            vec![
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "TERM=xterm",
                "CUDA_VISIBLE_DEVICES=MIG-11111111-2222-3333-4444-555555555555",
                "NVIDIA_VISIBLE_DEVICES=void",
            ]
        );
        let mounts = v["mounts"].as_array().expect("mounts");
        assert_eq!(mounts.len(), before["mounts"].as_array().expect("mounts").len() + 1);
        assert_eq!(
            mounts.last(),
            Some(&json!({
                "destination": "/run/nvidia-mps", "type": "bind", "source": "/run/tessera/mps/t1",
                "options": ["rbind", "ro", "nosuid", "nodev"]
            }))
        );
        assert_eq!(
            v["hooks"],
            json!({
                "prestart": [{
                    "path": "/usr/local/bin/tessera-hook", "args": ["tessera-hook", "prestart"],
                    "env": ["TESSERA_SOCKET=/run/tessera/tesserad.sock"], "timeout": 10
                }]
            })
        );
        // Nothing else changed.
        let mut rest = v.clone();
        let mut rest_before = before.clone();
        for doc in [&mut rest, &mut rest_before] {
            let o = doc.as_object_mut().expect("object");
            o.remove("mounts");
            o.remove("hooks");
            o["process"].as_object_mut().expect("process").remove("env");
            let linux = o["linux"].as_object_mut().expect("linux");
            linux.remove("devices");
            linux["resources"].as_object_mut().expect("resources").remove("devices");
            // Mount propagation made private (runc's default is rslave).
            linux.remove("rootfsPropagation");
        }
        assert_eq!(v["linux"]["rootfsPropagation"], "rprivate");
        assert_eq!(rest, rest_before);
    }

    #[test]
    fn smuggled_gpu_devices_and_rules_are_removed() {
        let mut v = parse(CRI);
        apply_injection(&mut v, &mig_injection(), &hooks()).expect("applies");
        let paths: Vec<&str> = v["linux"]["devices"]
            .as_array()
            .expect("devices")
            .iter()
            .filter_map(|d| d["path"].as_str())
            .collect();
        // /dev/nvidia1 (by path) and /dev/./gpu-alias (major 195) are gone; the rest stay.
        assert_eq!(
            paths,
            vec![
                "/dev/fuse",
                "/dev/sda",
                "/dev/nvidiactl",
                "/dev/nvidia-uvm",
                "/dev/nvidia-uvm-tools",
                "/dev/nvidia0",
                "/dev/nvidia-caps/nvidia-cap12",
                "/dev/nvidia-caps/nvidia-cap13"
            ]
        );
        let rules = v["linux"]["resources"]["devices"].as_array().expect("rules");
        // The `c 195:1 rw` allow rule from the config is gone; the others keep their order,
        // the deny-all stays first, ours come after.
        assert_eq!(
            rules[..7].to_vec(),
            vec![
                json!({"allow": false, "type": "a", "access": "rwm"}),
                json!({"allow": true, "type": "c", "access": "m"}),
                json!({"allow": true, "type": "b", "access": "m"}),
                json!({"allow": true, "type": "c", "major": 1, "minor": 3, "access": "rwm"}),
                json!({"allow": true, "type": "c", "major": 136, "access": "rwm"}),
                json!({"allow": true, "type": "c", "major": 5, "minor": 2, "access": "rwm"}),
                json!({"allow": true, "type": "c", "major": 10, "minor": 200, "access": "rwm"}),
            ]
        );
        assert_eq!(rules.len(), 7 + 6);
        assert!(rules[7..].iter().all(|r| r["allow"] == json!(true) && r["type"] == json!("c")));
        // The bind mount of /dev/nvidia1 is gone too.
        let dests: Vec<&str> = v["mounts"]
            .as_array()
            .expect("mounts")
            .iter()
            .filter_map(|m| m["destination"].as_str())
            .collect();
        assert_eq!(dests, vec!["/proc", "/dev", "/etc/hosts", "/run/nvidia-mps"]);
    }

    #[test]
    fn env_overrides_image_values() {
        let mut v = parse(CRI);
        let mut inj = mig_injection();
        inj.env.push("CUDA_VISIBLE_DEVICES=MIG-second-wins".into());
        v["process"]["env"].as_array_mut().expect("env").push(json!("CUDA_VISIBLE_DEVICES=7"));
        apply_injection(&mut v, &inj, &hooks()).expect("applies");
        let env = strs(&v["process"]["env"]);
        assert_eq!(
            env,
            vec![
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "HOSTNAME=trainer-0",
                "NVIDIA_VISIBLE_DEVICES=void",
                "CUDA_VISIBLE_DEVICES=MIG-second-wins",
                "LD_PRELOAD=/evil.so",
            ]
        );
    }

    #[test]
    fn hooks_get_only_the_socket_env() {
        let mut v = parse(CRI);
        apply_injection(&mut v, &mig_injection(), &hooks()).expect("applies");
        let hs = v["hooks"]["prestart"].as_array().expect("hooks");
        assert_eq!(hs.len(), 1);
        assert_eq!(hs[0]["env"], json!(["TESSERA_SOCKET=/run/tessera/tesserad.sock"]));
        assert_eq!(hs[0]["args"], json!(["tessera-hook", "prestart"]));
        // No poststop hook: the wrapper releases after runc deletes the container.
        assert_eq!(v["hooks"].get("poststop"), None);
        // Other hooks are left alone.
        assert_eq!(v["hooks"]["createContainer"][0]["path"], json!("/usr/bin/other-hook"));
    }

    #[test]
    fn an_earlier_versions_poststop_hook_is_removed_and_others_are_kept() {
        let mut v = parse(CRI);
        v["hooks"]["poststop"] = json!([
            {"path": "/usr/local/bin/tessera-hook", "args": ["tessera-hook", "poststop"]},
            {"path": "/usr/bin/other-hook", "args": ["other-hook"]}
        ]);
        apply_injection(&mut v, &mig_injection(), &hooks()).expect("applies");
        assert_eq!(
            v["hooks"]["poststop"],
            json!([{"path": "/usr/bin/other-hook", "args": ["other-hook"]}])
        );
        let mut only_ours = parse(CRI);
        only_ours["hooks"]["poststop"] = json!([{"path": "/usr/local/bin/tessera-hook"}]);
        apply_injection(&mut only_ours, &mig_injection(), &hooks()).expect("applies");
        assert_eq!(only_ours["hooks"].get("poststop"), None);
    }

    #[test]
    fn applying_twice_is_idempotent() {
        let mut once = parse(CRI);
        apply_injection(&mut once, &mig_injection(), &hooks()).expect("applies");
        let mut twice = once.clone();
        apply_injection(&mut twice, &mig_injection(), &hooks()).expect("applies again");
        assert_eq!(once, twice);
    }

    #[test]
    fn allow_all_rules_are_refused() {
        // runc reads an allow rule of type `a` (or no type) as allow-all, whatever its numbers.
        for rule in [
            json!({"allow": true, "access": "rwm"}),
            json!({"allow": true, "type": "", "access": "m"}),
            json!({"allow": true, "type": "a", "access": "rw"}),
            json!({"allow": true, "type": "a", "major": 195, "minor": 0, "access": "r"}),
            json!({"allow": true, "type": "a", "major": -1, "minor": -1, "access": "rwm"}),
        ] {
            let mut v = parse(RUNC_SPEC);
            v["linux"]["resources"]["devices"].as_array_mut().expect("rules").push(rule.clone());
            let err = apply_injection(&mut v, &mig_injection(), &hooks()).expect_err("must fail");
            assert!(matches!(err, SpecError::AllowAll { index: 1, .. }), "{rule}: {err}");
            assert!(check_gpu_spec(&v).is_err());
        }
        // A character rule with an absent or -1 major opens every GPU (Docker's
        // `--device-cgroup-rule 'c *:* rwm'` writes -1), whatever the minor.
        for rule in [
            json!({"allow": true, "type": "c", "access": "rwm"}),
            json!({"allow": true, "type": "c", "major": -1, "minor": -1, "access": "rwm"}),
            json!({"allow": true, "type": "c", "major": -1, "minor": 0, "access": "r"}),
            json!({"allow": true, "type": "c", "minor": 0, "access": "w"}),
        ] {
            let mut v = parse(RUNC_SPEC);
            v["linux"]["resources"]["devices"].as_array_mut().expect("rules").push(rule.clone());
            let err = apply_injection(&mut v, &mig_injection(), &hooks()).expect_err("must fail");
            assert!(matches!(err, SpecError::AnyCharDevice { index: 1, .. }), "{rule}: {err}");
            assert!(check_gpu_spec(&v).is_err());
        }
        // Numbers the kernel would read differently, and what runc refuses, are refused.
        for rule in [
            json!({"allow": true, "type": "c", "major": 4_294_967_491_i64, "minor": 0, "access": "rw"}),
            json!({"allow": true, "type": "c", "major": 4291, "minor": 0, "access": "rw"}),
            json!({"allow": true, "type": "c", "major": -2, "access": "rw"}),
            json!({"allow": true, "type": "u", "major": 195, "access": "rw"}),
            json!({"allow": true, "type": "c", "major": 195}),
        ] {
            let mut v = parse(RUNC_SPEC);
            v["linux"]["resources"]["devices"].as_array_mut().expect("rules").push(rule.clone());
            let err = apply_injection(&mut v, &mig_injection(), &hooks()).expect_err("must fail");
            assert!(err.to_string().starts_with("`linux.resources.devices[1]"), "{rule}: {err}");
            assert!(check_gpu_spec(&v).is_err());
        }
        // Block devices of any major (every disk of the node) are refused too.
        for rule in [
            json!({"allow": true, "type": "b", "access": "rwm"}),
            json!({"allow": true, "type": "b", "major": -1, "minor": 0, "access": "r"}),
        ] {
            let mut v = parse(RUNC_SPEC);
            v["linux"]["resources"]["devices"].as_array_mut().expect("rules").push(rule.clone());
            let err = apply_injection(&mut v, &mig_injection(), &hooks()).expect_err("refused");
            assert!(matches!(err, SpecError::AnyBlockDevice { index: 1, .. }), "{rule}: {err}");
        }
        // mknod-only wildcards, block rules of one major and deny rules stay.
        for rule in [
            json!({"allow": true, "type": "c", "access": "m"}),
            json!({"allow": true, "type": "c", "major": -1, "minor": -1, "access": "m"}),
            json!({"allow": true, "type": "b", "access": "m"}),
            json!({"allow": true, "type": "b", "major": 7, "minor": 0, "access": "rw"}),
            json!({"allow": false, "type": "c", "access": "rwm"}),
        ] {
            let mut v = parse(RUNC_SPEC);
            v["linux"]["resources"]["devices"].as_array_mut().expect("rules").push(rule.clone());
            apply_injection(&mut v, &mig_injection(), &hooks()).expect("applies");
        }
    }

    #[test]
    fn no_container_holds_a_capability_that_acts_on_the_host_without_a_user_namespace() {
        for cap in HOST_CAPABILITIES {
            for set in ["bounding", "effective", "permitted", "inheritable", "ambient"] {
                let v = json!({"process": {"capabilities": {set: ["CAP_CHOWN", cap]}}});
                let e = check_host_capabilities(&v).expect_err(cap);
                assert!(e.to_string().contains(cap), "{set} {cap}: {e}");
            }
            // In a user namespace of its own the capability is that namespace's.
            let v = json!({"process": {"capabilities": {"effective": [cap]}},
                           "linux": {"namespaces": [{"type": "user"}]}});
            check_host_capabilities(&v).expect(cap);
            // One joined by path is another's: no user namespace of its own.
            let v = json!({"process": {"capabilities": {"effective": [cap]}},
                           "linux": {"namespaces": [{"type": "user", "path": "/proc/1/ns/user"}]}});
            check_host_capabilities(&v).expect_err(cap);
        }
        // Docker's, podman's and containerd's defaults (and NET_ADMIN) pass.
        let v = json!({"process": {"capabilities": {"bounding": [
            "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD",
            "CAP_NET_RAW", "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP",
            "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
            "CAP_NET_ADMIN"]}}});
        check_host_capabilities(&v).expect("defaults");
    }

    /// rt-iso3: a plain container in the host's pid namespace (none of its own, as with
    /// `docker run --pid=host`) holding CAP_SYS_PTRACE opens `/proc/1/root`: the host's
    /// root filesystem, writable, as the host's root (ptrace_may_access passes with the
    /// capability). CAP_SYS_PTRACE is missing from HOST_CAPABILITIES and nothing asks for a
    /// pid namespace of its own here.
    #[test]
    fn rt_iso3_cap_sys_ptrace_in_the_hosts_pid_namespace_is_refused() {
        for ns in [
            json!([{"type": "mount"}]),
            json!([{"type": "mount"}, {"type": "pid", "path": "/proc/1/ns/pid"}]),
        ] {
            let v = json!({"process": {"capabilities": {"bounding": ["CAP_CHOWN", "CAP_SYS_PTRACE"],
                                                         "effective": ["CAP_SYS_PTRACE"],
                                                         "permitted": ["CAP_SYS_PTRACE"]}},
                           "linux": {"namespaces": ns}});
            assert!(
                check_host_capabilities(&v).is_err(),
                "CAP_SYS_PTRACE without a pid namespace of its own passed: /proc/1/root is the host's /"
            );
        }
    }

    /// rt-iso3: a plain container with a new user namespace whose mappings take in the
    /// host's uid 0 passes check_host_capabilities with CAP_SYS_ADMIN: its euid is
    /// GLOBAL_ROOT_UID (sysctl and sysfs permission checks pass), and the read-only mounts
    /// runc made in its mount namespace are its own to remount read-write (/proc/sys, the
    /// read-only sysfs). The GPU path refuses such a mapping (`maps_host_root`); the plain
    /// path never looks.
    #[test]
    fn rt_iso3_a_user_namespace_mapping_host_root_does_not_license_host_capabilities() {
        let v = json!({"process": {"capabilities": {"bounding": ["CAP_SYS_ADMIN"],
                                                     "effective": ["CAP_SYS_ADMIN"],
                                                     "permitted": ["CAP_SYS_ADMIN"]}},
                       "linux": {"namespaces": [{"type": "user"}, {"type": "mount"}, {"type": "pid"}],
                                 "uidMappings": [{"containerID": 0, "hostID": 0, "size": 65536}],
                                 "gidMappings": [{"containerID": 0, "hostID": 0, "size": 65536}]}});
        assert!(
            check_host_capabilities(&v).is_err(),
            "CAP_SYS_ADMIN in a user namespace mapping host uid 0 passed"
        );
    }

    #[test]
    fn no_container_joins_tesserads_cgroup_or_one_above_it() {
        let own = "0::/user.slice/session-1.scope\n";
        let at = |p: &str| json!({"linux": {"cgroupsPath": p}});
        let daemon = ["system.slice/tesserad.service".to_string()];
        for p in ["/system.slice/tesserad.service", "/system.slice", "/"] {
            let e = check_cgroup_is_free(&at(p), "c1", false, own, &[], &daemon).expect_err(p);
            assert!(e.to_string().contains("a cgroup tesserad runs in"), "{p}: {e}");
        }
        for p in
            ["/system.slice/tesserad.service/child", "/system.slice/docker-1.scope", "/kubepods"]
        {
            check_cgroup_is_free(&at(p), "c1", false, own, &[], &daemon).expect(p);
        }
        // No tesserad id beside the socket, no grant: nothing to check.
        check_cgroup_is_free(&at("/system.slice"), "c1", false, own, &[], &[]).expect("none");
    }

    /// Red team, round 6: on cgroup v1 tesserad's cgroup is read from the devices line of
    /// `/proc/<pid>/cgroup` only; runc's cgroupfs driver puts a container at the same path
    /// in every hierarchy. systemd realizes a service's cgroup only in the controllers it
    /// (or a sibling) needs: `pids` (TasksAccounting, on by default), `memory`, the
    /// name=systemd one, while its devices line may stay `/system.slice` (or `/`). A plain
    /// container at `/system.slice/tesserad.service` is below that devices cgroup, so
    /// allowed, and runc writes its `pids.max`/`memory.limit_in_bytes` into the cgroup
    /// tesserad and every tenant's MPS daemons run in (their forks fail, the OOM killer
    /// picks them), and `runc kill --all`/`delete --force` of a container without a pid
    /// namespace signals the pids of its devices cgroup.
    #[test]
    fn rt_iso2_tesserads_cgroup_is_every_hierarchy_it_runs_in_not_only_devices() {
        let daemon_proc = "\
12:pids:/system.slice/tesserad.service
11:memory:/system.slice/tesserad.service
10:devices:/system.slice
9:freezer:/
1:name=systemd:/system.slice/tesserad.service
0::/system.slice/tesserad.service
";
        let daemon = tessera_api::cgroup::hierarchy_paths(daemon_proc);
        let own = "10:devices:/user.slice\n12:pids:/user.slice\n0::/user.slice\n";
        let spec = json!({"linux": {"cgroupsPath": "/system.slice/tesserad.service",
                                    "resources": {"pids": {"limit": 1}}}});
        let got = check_cgroup_is_free(&spec, "c1", false, own, &[], &daemon);
        assert!(
            got.is_err(),
            "a container at tesserad's pids and memory cgroup passed (tesserad's cgroup read as \
             {daemon:?}, from its devices line only)"
        );
    }

    /// Red team, round 6: an entry counts for `/proc/sys` only where runc's mount(2) of it
    /// reaches `/proc/sys`. runc 1.1.5 passes each readonlyPaths/maskedPaths entry to the
    /// kernel as written and skips one that does not exist; the kernel walks `..` after the
    /// component before it, so `/proc/tessera-none/../sys` is ENOENT (skipped) while
    /// `normalize` reads it as `/proc/sys` and adds nothing.
    #[test]
    fn rt_iso2_an_entry_runc_skips_does_not_stand_for_proc_sys() {
        let mut v = json!({"linux": {
            "readonlyPaths": ["/proc/tessera-none/../sys"],
            "maskedPaths": ["/proc/tessera-none/../kcore"]
        }});
        keep_proc_protected(&mut v).expect("ok");
        let has = |key: &str, p: &str| {
            v["linux"][key].as_array().expect("list").iter().any(|e| e.as_str() == Some(p))
        };
        assert!(
            has("readonlyPaths", "/proc/sys") && has("maskedPaths", "/proc/kcore"),
            "runc skips the entries the config lists (ENOENT) and nothing stands for /proc/sys \
             and /proc/kcore: {}",
            v["linux"]
        );
    }

    #[test]
    fn proc_sys_stays_read_only_and_kcore_masked_whatever_the_config_lists() {
        for (ro, masked) in [
            (json!([]), json!([])),
            (json!(null), json!(null)),
            (json!(["/x"]), json!(["/proc//kcore"])),
        ] {
            let mut v = parse(RUNC_SPEC);
            v["linux"]["readonlyPaths"] = ro.clone();
            v["linux"]["maskedPaths"] = masked.clone();
            apply_injection(&mut v, &mig_injection(), &hooks()).expect("applies");
            let has = |key: &str, p: &str| strs(&v["linux"][key]).iter().any(|s| normalize(s) == p);
            for p in READONLY_PATHS {
                assert!(has("readonlyPaths", p), "{ro} {p}");
            }
            for p in MASKED_PATHS {
                assert!(has("maskedPaths", p), "{masked} {p}");
            }
        }
        // runc spec's own lists are left as they are.
        let mut v = parse(RUNC_SPEC);
        let before = (v["linux"]["readonlyPaths"].clone(), v["linux"]["maskedPaths"].clone());
        apply_injection(&mut v, &mig_injection(), &hooks()).expect("applies");
        assert_eq!(
            (v["linux"]["readonlyPaths"].clone(), v["linux"]["maskedPaths"].clone()),
            before
        );
    }

    #[test]
    fn missing_sections_are_created_or_refused() {
        let mut v = json!({"ociVersion": "1.0.2", "process": {"args": ["sh"]},
                           "linux": {"namespaces": [{"type": "pid"}, {"type": "mount"}]}});
        apply_injection(&mut v, &mig_injection(), &hooks()).expect("applies");
        // No deny-all rule existed: one is put first.
        assert_eq!(
            v["linux"]["resources"]["devices"][0],
            json!({"allow": false, "type": "a", "access": "rwm"})
        );
        assert_eq!(v["linux"]["devices"].as_array().map(Vec::len), Some(6));
        assert_eq!(
            strs(&v["process"]["env"]),
            vec![
                "CUDA_VISIBLE_DEVICES=MIG-11111111-2222-3333-4444-555555555555",
                "NVIDIA_VISIBLE_DEVICES=void"
            ]
        );

        let mut v = json!({"process": {}});
        assert!(matches!(
            apply_injection(&mut v, &mig_injection(), &hooks()),
            Err(SpecError::NoLinux)
        ));
        let mut v = json!({"process": {}, "linux": null});
        assert!(matches!(
            apply_injection(&mut v, &mig_injection(), &hooks()),
            Err(SpecError::NoLinux)
        ));
        let mut v = json!({"linux": {}});
        assert!(matches!(
            apply_injection(&mut v, &mig_injection(), &hooks()),
            Err(SpecError::NoProcess)
        ));
    }

    #[test]
    fn bad_injections_are_refused() {
        let cases: [fn(&mut Injection); 8] = [
            |i| i.mounts[0].destination = "relative/x".into(),
            |i| i.mounts[0].destination = "/run/../etc".into(),
            |i| i.mounts[0].source = "/run/tessera/../../etc".into(),
            |i| i.devices[0].path = "/dev/../etc/shadow".into(),
            |i| i.devices[0].path = "/tmp/nvidia0".into(),
            |i| i.devices[0].major = -1,
            |i| i.env.push("NOEQUALS".into()),
            |i| i.env.push("=value".into()),
        ];
        for (n, mutate) in cases.iter().enumerate() {
            let mut inj = mig_injection();
            mutate(&mut inj);
            let mut v = parse(RUNC_SPEC);
            let err = apply_injection(&mut v, &inj, &hooks()).expect_err("must fail");
            assert!(matches!(err, SpecError::BadInjection(_)), "case {n}: {err}");
        }
        let mut v = parse(RUNC_SPEC);
        let rel = HookConfig { path: "tessera-hook".into(), socket: "/s".into(), prestart: true };
        assert!(matches!(
            apply_injection(&mut v, &mig_injection(), &rel),
            Err(SpecError::BadInjection(_))
        ));
    }

    #[test]
    fn read_write_mounts() {
        let mut v = parse(RUNC_SPEC);
        let mut inj = Injection::default();
        inj.mounts.push(BindMount {
            source: "/a".into(),
            destination: "/b".into(),
            read_only: false,
        });
        apply_injection(&mut v, &inj, &hooks()).expect("applies");
        let last = v["mounts"].as_array().and_then(|m| m.last()).expect("mount");
        assert_eq!(last["options"], json!(["rbind", "rw", "nosuid", "nodev"]));
    }

    #[test]
    fn shape_errors_name_the_json_path() {
        let mut v = parse(CRI);
        v["linux"]["devices"][2]["major"] = json!("195");
        let err = apply_injection(&mut v, &mig_injection(), &hooks()).expect_err("must fail");
        assert!(
            matches!(&err, SpecError::Ambiguous(CanonicalError::Value { at, .. }) if at == "linux.devices[2].major"),
            "{err}"
        );
        let mut v = parse(CRI);
        v["linux"]["resources"]["devices"] = json!({"allow": true});
        let err = apply_injection(&mut v, &mig_injection(), &hooks()).expect_err("must fail");
        assert!(
            matches!(&err, SpecError::Ambiguous(CanonicalError::Value { at, .. }) if at == "linux.resources.devices"),
            "{err}"
        );
        let mut v = parse(CRI);
        v["process"]["env"] = json!(["A=1", {"x": 1}]);
        let err = apply_injection(&mut v, &mig_injection(), &hooks()).expect_err("must fail");
        assert!(matches!(&err, SpecError::Shape { path, .. } if path == "process.env[1]"), "{err}");
    }

    #[test]
    fn annotation_lists_granted_uuids() {
        let mut v = parse(RUNC_SPEC);
        annotate_allocation(&mut v, ["MIG-a", "MIG-b"]).expect("annotates");
        assert_eq!(v["annotations"][ALLOCATED_ANNOTATION], json!("MIG-a,MIG-b"));
        let mut v = parse(CRI);
        annotate_allocation(&mut v, ["GPU-x"]).expect("annotates");
        assert_eq!(v["annotations"][ALLOCATED_ANNOTATION], json!("GPU-x"));
        assert_eq!(v["annotations"]["tessera.io/gpu"], json!("mig=1g.10gb"));
    }

    #[test]
    fn round_trip_keeps_unknown_fields() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join(CONFIG_FILE), CRI).expect("write");
        std::fs::set_permissions(
            dir.path().join(CONFIG_FILE),
            std::fs::Permissions::from_mode(0o640),
        )
        .expect("chmod");
        let mut cfg = load_config(dir.path()).expect("loads");
        apply_injection(&mut cfg.value, &mig_injection(), &hooks()).expect("applies");
        save_config(&cfg).expect("saves");
        let back = load_config(dir.path()).expect("loads again");
        assert_eq!(back.value, cfg.value);
        assert_eq!(
            back.value["org.example.topLevelExtension"],
            json!({"nested": {"deep": [1, 2, 3]}})
        );
        assert_eq!(
            back.value["process"]["org.example.futureProcessField"],
            json!({"keep": ["me", 1, true, null]})
        );
        assert_eq!(back.value["linux"]["org.example.futureLinuxField"], json!(3.5));
        assert_eq!(back.value["linux"]["namespaces"][6], json!({"type": "time"}));
        assert_eq!(
            back.value["process"]["ioPriority"],
            json!({"class": "IOPRIO_CLASS_BE", "priority": 4})
        );
        let mode =
            std::fs::metadata(dir.path().join(CONFIG_FILE)).expect("stat").permissions().mode();
        assert_eq!(mode & 0o7777, 0o640);
        // No temp file is left behind.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("ls")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from(CONFIG_FILE)]);
        // Untouched round trip is lossless.
        let plain = load_config(dir.path()).expect("loads");
        save_config(&plain).expect("saves");
        assert_eq!(load_config(dir.path()).expect("loads").value, plain.value);
    }

    #[test]
    fn oci_spec_spec_drops_unknown_fields() {
        // Why this module edits a Value: a Spec round trip loses what Spec does not model.
        let spec: Spec = serde_json::from_str(CRI).expect("Spec parses the CRI fixture");
        let back = serde_json::to_value(&spec).expect("serializes");
        assert!(back.get("org.example.topLevelExtension").is_none());
        // The typed convenience still applies the same injection.
        let mut spec: Spec = serde_json::from_str(RUNC_SPEC).expect("Spec parses runc spec");
        apply_injection_to_spec(&mut spec, &mig_injection(), &hooks()).expect("applies");
        let devices = spec.linux().as_ref().and_then(|l| l.devices().clone()).expect("devices");
        assert_eq!(devices.len(), 6);
        let prestart = spec.hooks().as_ref().and_then(|h| h.prestart().clone()).expect("prestart");
        assert_eq!(
            prestart[0].env().as_deref(),
            Some(&["TESSERA_SOCKET=/run/tessera/tesserad.sock".to_string()][..])
        );
    }

    #[test]
    fn symlinked_config_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("real.json"), RUNC_SPEC).expect("write");
        std::os::unix::fs::symlink("real.json", dir.path().join(CONFIG_FILE)).expect("symlink");
        let err = load_config(dir.path()).expect_err("must fail");
        assert!(matches!(err, SpecError::Symlink { .. }), "{err}");
        assert!(err.to_string().contains("symbolic link"), "{err}");
    }

    #[test]
    fn non_regular_and_missing_configs_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        assert!(matches!(load_config(dir.path()), Err(SpecError::Read { .. })));
        std::fs::create_dir(dir.path().join(CONFIG_FILE)).expect("mkdir");
        assert!(matches!(load_config(dir.path()), Err(SpecError::NotRegular { .. })));
    }

    #[test]
    fn malformed_config_names_file_line_and_column() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            dir.path().join(CONFIG_FILE),
            "{\n  \"ociVersion\": \"1.0.2\",\n  \"process\": {\n    \"args\": [\"sh\"\n  }\n}\n",
        )
        .expect("write");
        let err = load_config(dir.path()).expect_err("must fail");
        let msg = err.to_string();
        assert!(msg.contains(&dir.path().join(CONFIG_FILE).display().to_string()), "{msg}");
        assert!(msg.contains("line 5 column 3"), "{msg}");
        std::fs::write(dir.path().join(CONFIG_FILE), "[1, 2]").expect("write");
        assert!(matches!(load_config(dir.path()), Err(SpecError::Shape { .. })));
    }

    #[test]
    fn normalize_paths() {
        assert_eq!(normalize("/dev/./nvidia0"), "/dev/nvidia0");
        assert_eq!(normalize("/dev//x/../nvidia-caps/nvidia-cap1"), "/dev/nvidia-caps/nvidia-cap1");
        assert_eq!(normalize("/../../dev/nvidiactl"), "/dev/nvidiactl");
        assert_eq!(normalize("dev/nvidia0"), "/dev/nvidia0");
        assert!(is_nvidia_path("/dev/nvidia-uvm"));
        assert!(!is_nvidia_path("/dev/fuse"));
    }

    #[test]
    fn a_container_without_a_grant_keeps_no_gpu() {
        let majors: BTreeSet<u32> = [195, 508, 509].into();
        // Nothing of the GPU: untouched, byte for byte.
        let mut v = parse(RUNC_SPEC);
        let before = v.clone();
        assert!(!strip_ungranted_gpus(&mut v, &majors).expect("ok"));
        assert_eq!(v, before);
        // Smuggled nodes and rules of every GPU major (any path) go; the rest stays.
        v["linux"]["devices"] = json!([
            {"path": "/dev/stolen", "type": "c", "major": 195, "minor": 3},
            {"path": "/dev/nvidia-uvm", "type": "c", "major": 508, "minor": 0},
            {"path": "/dev/cap", "type": "u", "major": 509, "minor": 1},
            {"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229}
        ]);
        v["linux"]["resources"]["devices"].as_array_mut().expect("rules").extend([
            json!({"allow": true, "type": "c", "major": 195, "minor": 3, "access": "rw"}),
            json!({"allow": true, "type": "c", "major": 508, "access": "rwm"}),
            json!({"allow": true, "type": "c", "major": 10, "minor": 229, "access": "rwm"}),
            json!({"allow": true, "type": "c", "access": "m"}),
        ]);
        assert!(strip_ungranted_gpus(&mut v, &majors).expect("ok"));
        assert_eq!(
            v["linux"]["devices"],
            json!([{"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229}])
        );
        let rules = v["linux"]["resources"]["devices"].as_array().expect("rules");
        assert!(
            rules.iter().all(|r| r["major"] != json!(195) && r["major"] != json!(508)),
            "{rules:?}"
        );
        assert!(rules.iter().any(|r| r["major"] == json!(10)), "other rules stay: {rules:?}");
        // A character rule of any major that reads or writes is refused.
        let mut v = parse(RUNC_SPEC);
        v["linux"]["resources"]["devices"]
            .as_array_mut()
            .expect("rules")
            .push(json!({"allow": true, "type": "c", "major": -1, "minor": 3, "access": "rw"}));
        let e = strip_ungranted_gpus(&mut v, &majors).expect_err("refused");
        assert!(matches!(e, SpecError::GpuWithoutGrant { index: 1, .. }), "{e}");
    }

    proptest::proptest! {
        /// Whatever GPU devices and rules a config smuggles in, after injection the only
        /// allow rules touching a GPU major are the injected ones, and the only NVIDIA
        /// device nodes are the injected ones.
        #[test]
        fn only_injected_gpu_devices_survive(
            smuggled in proptest::collection::vec((0u8..3, 0i64..300, 0i64..300, proptest::bool::ANY), 0..8),
        ) {
            let mut v = parse(RUNC_SPEC);
            v["linux"]["devices"] = json!([]);
            for (kind, major, minor, by_path) in &smuggled {
                let path = if *by_path { format!("/dev/nvidia{minor}") } else { format!("/dev/x{minor}") };
                // 195, uvm, caps, or any other dynamic major (the kernel hands out 234..=511).
                let major = match kind { 0 => 195, 1 => 508, _ => 234 + *major };
                v["linux"]["devices"].as_array_mut().expect("devices").push(json!({
                    "path": path, "type": "c", "major": major, "minor": minor
                }));
                v["linux"]["resources"]["devices"].as_array_mut().expect("rules").push(json!({
                    "allow": true, "type": "c", "major": major, "minor": minor, "access": "rwm"
                }));
            }
            let inj = mig_injection();
            apply_injection(&mut v, &inj, &hooks()).expect("applies");
            let gpu_majors: BTreeSet<i64> = inj.devices.iter().map(|d| d.major).collect();
            let injected: BTreeSet<(i64, i64)> = inj.devices.iter().map(|d| (d.major, d.minor)).collect();
            for r in v["linux"]["resources"]["devices"].as_array().expect("rules") {
                if r["allow"] == json!(true) {
                    if let Some(m) = r["major"].as_i64() {
                        if gpu_majors.contains(&m) {
                            let minor = r["minor"].as_i64().expect("minor");
                            proptest::prop_assert!(injected.contains(&(m, minor)), "{r}");
                        }
                    }
                }
            }
            for d in v["linux"]["devices"].as_array().expect("devices") {
                let path = d["path"].as_str().expect("path");
                let m = d["major"].as_i64().expect("major");
                if path.starts_with("/dev/nvidia") || gpu_majors.contains(&m) {
                    proptest::prop_assert!(inj.devices.iter().any(|i| i.path == path), "{d}");
                }
            }
        }
    }
}

#[cfg(test)]
mod rootfs_tests {
    use super::*;

    fn spec_with_root(root: &str) -> Value {
        serde_json::json!({"root": {"path": root}})
    }

    #[test]
    fn a_dev_symlink_is_refused_whatever_it_points_to() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join("rootfs")).expect("mkdir");
        std::os::unix::fs::symlink("/tmp", dir.path().join("rootfs/dev")).expect("symlink");
        let e = check_rootfs(dir.path(), &spec_with_root("rootfs")).expect_err("refused");
        assert!(matches!(e, SpecError::HostileRootfs { .. }), "{e}");
        assert!(e.to_string().contains("/tmp"), "{e}");
        // Relative links too.
        std::fs::remove_file(dir.path().join("rootfs/dev")).expect("rm");
        std::os::unix::fs::symlink("../../..", dir.path().join("rootfs/dev")).expect("symlink");
        assert!(check_rootfs(dir.path(), &spec_with_root("rootfs")).is_err());
    }

    #[test]
    fn a_link_on_the_way_to_a_proc_or_sysfs_destination_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join("rootfs/real")).expect("mkdir");
        std::os::unix::fs::symlink("/tmp", dir.path().join("rootfs/x")).expect("symlink");
        let spec = |fstype: &str, dest: &str, options: &[&str]| {
            serde_json::json!({"root": {"path": "rootfs"}, "mounts": [
                {"destination": dest, "type": fstype, "source": fstype, "options": options}
            ]})
        };
        for fstype in ["proc", "sysfs"] {
            for dest in ["/x/made/sub", "/real/../x/made", "/x"] {
                let e =
                    check_rootfs(dir.path(), &spec(fstype, dest, &["ro"])).expect_err("refused");
                assert!(matches!(e, SpecError::HostileRootfs { .. }), "{fstype} {dest}: {e}");
            }
            // No link on the way: runc makes the directories inside the rootfs.
            assert!(check_rootfs(dir.path(), &spec(fstype, "/real/made/sub", &["ro"])).is_ok());
        }
        // Other types and binds: runc resolves their destinations inside the rootfs.
        assert!(check_rootfs(dir.path(), &spec("tmpfs", "/x/made", &[])).is_ok());
        assert!(check_rootfs(dir.path(), &spec("sysfs", "/x/made", &["bind"])).is_ok());
    }

    /// Red team, round 6: runc 1.1.5 takes a `proc`/`sysfs` destination that already starts
    /// with the rootfs's path (a string prefix) as a host path, unjoined
    /// (`if !strings.HasPrefix(dest, rootfs) { dest = filepath.Join(rootfs, dest) }`), and
    /// `os.MkdirAll`s it through the image's links. The check walks
    /// `rootfs.join(destination)` (`<rootfs>/<rootfs>/x/...`, absent) and finds no link: the
    /// image's `/x -> /tmp` makes `/tmp/made/sub` on the host. A sibling of the rootfs
    /// (`<rootfs>-evil/made`, a string prefix) is made on the host with no link at all.
    #[test]
    fn rt_iso2_a_destination_spelled_as_the_rootfs_host_path_is_walked_as_runc_walks_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bundle = std::fs::canonicalize(dir.path()).expect("canonical");
        std::fs::create_dir_all(bundle.join("rootfs/real")).expect("mkdir");
        std::os::unix::fs::symlink("/tmp", bundle.join("rootfs/x")).expect("symlink");
        let rootfs = bundle.join("rootfs").display().to_string();
        let spec = |dest: &str| {
            serde_json::json!({"root": {"path": "rootfs"}, "mounts": [
                {"destination": dest, "type": "sysfs", "source": "sysfs", "options": ["ro"]}
            ]})
        };
        for dest in [format!("{rootfs}/x/made/sub"), format!("{rootfs}-evil/made")] {
            let got = check_rootfs(&bundle, &spec(&dest));
            assert!(
                got.is_err(),
                "sysfs at {dest}: runc 1.1.5 makes its directories on the host (unjoined: it \
                 starts with the rootfs {rootfs}), and the check passed it"
            );
        }
    }

    #[test]
    fn nvidia_links_under_dev_are_refused_and_plain_dev_dirs_pass() {
        let dir = tempfile::tempdir().expect("tempdir");
        let dev = dir.path().join("rootfs/dev");
        std::fs::create_dir_all(&dev).expect("mkdir");
        std::fs::write(dev.join("null-ish"), b"").expect("file");
        std::os::unix::fs::symlink("/proc/self/fd", dev.join("fd")).expect("fd link is fine");
        check_rootfs(dir.path(), &spec_with_root("rootfs")).expect("plain /dev passes");
        // Absolute root.path works as well as a relative one.
        let abs = dir.path().join("rootfs").display().to_string();
        check_rootfs(Path::new("/nonexistent"), &spec_with_root(&abs)).expect("absolute root");
        std::os::unix::fs::symlink("/etc", dev.join("nvidia-caps")).expect("symlink");
        let e = check_rootfs(dir.path(), &spec_with_root("rootfs")).expect_err("refused");
        assert!(e.to_string().contains("nvidia-caps"), "{e}");
    }

    #[test]
    fn a_missing_dev_or_root_is_left_to_runc() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(dir.path().join("rootfs")).expect("mkdir");
        check_rootfs(dir.path(), &spec_with_root("rootfs")).expect("no /dev");
        check_rootfs(dir.path(), &serde_json::json!({})).expect("no root");
    }

    #[test]
    fn systemd_properties_that_decide_device_access_are_refused_in_every_config() {
        for key in [
            "org.systemd.property.DeviceAllow",
            "org.systemd.property.DevicePolicy",
            "org.systemd.property.BPFProgram",
            "org.systemd.property.Delegate",
        ] {
            let v = serde_json::json!({"annotations": {key: "'/dev/nvidia0 rw'"}});
            let e = check_systemd_properties(&v).expect_err(key).to_string();
            assert!(e.contains(key) && e.contains("never by an annotation"), "{e}");
        }
        let ok = serde_json::json!({"annotations": {"org.systemd.property.TimeoutStopUSec": "uint64 5000000", "x": "y"}});
        check_systemd_properties(&ok).expect("other properties pass");
        check_systemd_properties(&serde_json::json!({})).expect("no annotations");
    }
}
