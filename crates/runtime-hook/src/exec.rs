//! `runc exec` into a GPU container: the new process gets what CUDA needs to find the
//! container's share (`CUDA_VISIBLE_DEVICES`, the MPS pipe directory, ...), as the
//! container's init did.
//!
//! Engines build an exec'd process from their own copy of the container's spec (CRI
//! ExecSync, `docker exec`, `ctr task exec`), not from the config.json tessera-runtime
//! rewrote, so without this the process sees the granted devices but not which they are.
//! The values come from the bundle's config.json that runc's record of the container
//! names (both host-side: the container cannot write them). This is convenience, never
//! access. Anything unreadable leaves the exec's environment as it was.
//!
//! An exec can also give its process what the container's create was refused: runc 1.1
//! runs it with the capabilities of `--cap` or of the `--process` file (what `docker exec
//! --privileged` sends), and in the sub-cgroup `--cgroup` names, which runc checks only by
//! string prefix (`../gpuab` passes for a container at `.../gpu`). [`check_exec`] refuses,
//! for every container, a `--cgroup` that is not plainly below the container's own, and for
//! a GPU container a process holding a capability outside
//! [`spec::GPU_CAPABILITIES`](crate::spec::GPU_CAPABILITIES) (without a user namespace of
//! its own) or real-time priority — as its create would have been refused. Nor is an exec
//! let into a GPU container `runc create` made that tesserad never confirmed
//! ([`crate::confirm::check_confirmed`]): its process would hold the devices first.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::spec;
use crate::supervise;

/// The environment a grant puts into a container, which an exec'd process gets too.
pub const GRANT_ENV: &[&str] = &[
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_MPS_LOG_DIRECTORY",
    // Where a latency-sensitive container reports its own latency (docs/GPU-HEALTH.md).
    "TESSERA_LATENCY_FILE",
];

/// The largest config.json or process.json read.
const MAX_JSON: u64 = 16 << 20;

/// `runc exec` options that take a value (runc 1.1), short and long, as Go's `flag`
/// package names them: `-cwd`, `--cwd`, `-cwd=X` and `--cwd=X` are one flag.
const VALUE_FLAGS: &[&str] = &[
    "console-socket",
    "cwd",
    "env",
    "e",
    "user",
    "u",
    "additional-gids",
    "g",
    "process",
    "p",
    "apparmor",
    "process-label",
    "pid-file",
    "cap",
    "c",
    "preserve-fds",
    "cgroup",
    "pidfd-socket",
];

/// Where an exec's process is described: a `--process` file, or the command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecArgs {
    /// `--process FILE`.
    pub process: Option<PathBuf>,
    /// Every `--cap` / `-c`.
    pub caps: Vec<String>,
    /// Every `--cgroup`.
    pub cgroups: Vec<String>,
    /// The container id.
    pub container_id: String,
    /// Where the container id is in the exec's arguments.
    pub id_index: usize,
    /// Where flags may be added: before a `--`, else before the container id.
    pub flags_end: usize,
    /// `-h`/`--help` (true) among the flags: runc prints its help and runs nothing. One
    /// after the id is the exec'd command's (runc's exec does not reorder its arguments).
    pub help: bool,
}

/// Reads `runc exec`'s arguments (those after the verb). `None` when there is no
/// container id (runc will say what is wrong).
pub fn parse_exec(args: &[OsString]) -> Option<ExecArgs> {
    use crate::args::{classify, Token};
    let mut process = None;
    let (mut caps, mut cgroups) = (Vec::new(), Vec::new());
    let mut i = 0;
    let mut flags_end = None;
    let mut help = false;
    // runc's exec keeps urfave/cli from reordering (`SkipArgReorder`): Go's `flag` reads
    // flags up to the first positional argument or `--`, with one dash or two, a value
    // `=`-joined or next (any bytes, as Go's strings are).
    while i < args.len() {
        match classify(&args[i]) {
            Token::EndOfFlags => {
                flags_end = Some(i);
                i += 1;
                break;
            }
            Token::Positional => break,
            // Not flag syntax, or a name that is not UTF-8: runc refuses it.
            Token::Odd => {}
            Token::Flag { name, value } if VALUE_FLAGS.contains(&name) => {
                let value = match value {
                    Some(v) => v.to_os_string(),
                    None => {
                        i += 1;
                        args.get(i)?.clone()
                    }
                };
                match name {
                    "process" | "p" => process = Some(PathBuf::from(value)),
                    "cap" | "c" => caps.push(value.to_string_lossy().into_owned()),
                    "cgroup" => cgroups.push(value.to_string_lossy().into_owned()),
                    _ => {}
                }
            }
            // Go's `strconv.ParseBool` truths (another value is an error: runc runs nothing).
            Token::Flag { name: "h" | "help", value } => {
                help |= match value {
                    None => true,
                    Some(v) => {
                        matches!(v.to_str(), Some("1" | "t" | "T" | "true" | "TRUE" | "True"))
                    }
                };
            }
            Token::Flag { .. } => {}
        }
        i += 1;
    }
    let container_id = args.get(i)?.to_str()?.to_owned();
    Some(ExecArgs {
        process,
        caps,
        cgroups,
        container_id,
        id_index: i,
        flags_end: flags_end.unwrap_or(i),
        help,
    })
}

/// Why an exec is refused before runc runs.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error(
        "runc exec --cgroup `{}`: a sub-cgroup must be a plain relative path below the \
         container's own cgroup (runc 1.1 checks it only by string prefix, so `..` reaches a \
         sibling: another container's, a GPU grant's)",
        tessera_api::untrusted(.0)
    )]
    SubCgroup(String),
    #[error("runc exec into GPU container {}: {why}", tessera_api::untrusted(.id))]
    Gpu { id: String, why: String },
    #[error("runc exec into container {}: {why}", tessera_api::untrusted(.id))]
    Host { id: String, why: String },
}

/// The sub-cgroup of an exec's `--cgroup` value (`[<controllers>:]<path>`, runc 1.1's
/// `getSubCgroupPaths`): plainly below the container's cgroup, or refused.
fn check_sub_cgroup(value: &str) -> Result<(), ExecError> {
    let path = match value.splitn(3, ':').collect::<Vec<_>>()[..] {
        [p] | [_, p] => p,
        _ => return Ok(()), // runc refuses it itself
    };
    let plain = !path.is_empty()
        && !path.starts_with('/')
        && Path::new(path)
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_) | std::path::Component::CurDir));
    if plain {
        Ok(())
    } else {
        Err(ExecError::SubCgroup(value.to_string()))
    }
}

/// Checks an exec (the arguments after runc's `exec` verb) under runc root `root` before
/// runc runs it; see the module docs. Arguments runc cannot read are left to runc.
pub fn check_exec(root: &Path, args: &[OsString]) -> Result<(), ExecError> {
    let Some(exec) = parse_exec(args) else { return Ok(()) };
    if exec.help {
        return Ok(());
    }
    for c in &exec.cgroups {
        check_sub_cgroup(c)?;
    }
    let id = exec.container_id.clone();
    let gpu = |why: String| ExecError::Gpu { id: id.clone(), why };
    // A GPU container (tessera-runtime labelled it at create); its record unreadable counts
    // as one (fail closed).
    let bundle = match supervise::label_hint(root, &exec.container_id, spec::ALLOCATED_ANNOTATION) {
        None => return check_plain_exec(root, &exec),
        Some(Some(b)) => b,
        Some(None) => return Err(gpu("runc's record of it cannot be read".into())),
    };
    // One `runc create` made but tesserad never confirmed runs nothing, its init (held by
    // `start`) or an exec'd process (runc execs into a created container).
    crate::confirm::check_confirmed(root, &exec.container_id).map_err(|e| gpu(e.to_string()))?;
    let config = spec::load_config(Path::new(&bundle))
        .map_err(|e| gpu(format!("its config cannot be read: {e}")))?
        .value;
    let own_userns =
        config.pointer("/linux/namespaces").and_then(Value::as_array).into_iter().flatten().any(
            |n| {
                n["type"] == "user"
                    && n.get("path").and_then(Value::as_str).unwrap_or("").is_empty()
            },
        );
    let process = match &exec.process {
        Some(file) => read_process(file).map_err(gpu)?,
        None => config.get("process").cloned().unwrap_or(Value::Null),
    };
    let process = with_caps(process, &exec.caps);
    check_within_init(root, &exec.container_id, &process).map_err(gpu)?;
    if !own_userns {
        if let Some((at, cap)) =
            spec::capabilities_beyond_the_gpu_set(Some(&process), "exec process")
                .map_err(|e| gpu(e.to_string()))?
        {
            return Err(gpu(format!(
                "{at}: {} without a user namespace of its own (GPU containers hold only {})",
                tessera_api::untrusted(&cap),
                spec::GPU_CAPABILITIES.join(", ")
            )));
        }
    }
    if let Some(at) =
        spec::real_time_rlimit(Some(&process), "exec process").map_err(|e| gpu(e.to_string()))?
    {
        return Err(gpu(format!("{at}: RLIMIT_RTPRIO above 0 gives real-time priority")));
    }
    Ok(())
}

/// An exec into a container without a GPU: it adds none of [`spec::HOST_CAPABILITIES`]
/// (`--cap`, or the `--process` file's sets; `docker exec --privileged` sends them all): the
/// container's create was refused them, and an exec's process gets its own bounding set.
/// And, as for every exec ([`check_within_init`]), no capability its init does not hold.
fn check_plain_exec(root: &Path, exec: &ExecArgs) -> Result<(), ExecError> {
    let id = exec.container_id.clone();
    let host = |why: String| ExecError::Host { id: id.clone(), why };
    if let Some(c) = exec.caps.iter().find(|c| spec::HOST_CAPABILITIES.contains(&c.as_str())) {
        return Err(host(format!(
            "--cap {}: it acts on the host itself, and the host's root is every GPU of the node",
            tessera_api::untrusted(c).max_chars(64)
        )));
    }
    let process = match &exec.process {
        Some(file) => {
            let v = read_process(file).map_err(host)?;
            if let Some((at, c)) =
                spec::host_capability_in(&v, "exec process").map_err(|e| host(e.to_string()))?
            {
                return Err(host(format!(
                    "{at}: {}: it acts on the host itself, and the host's root is every GPU of \
                     the node",
                    tessera_api::untrusted(&c).max_chars(64)
                )));
            }
            v
        }
        // runc takes the process of the bundle's config as it is now.
        None => bundle_process(root, &id).map_err(host)?,
    };
    check_within_init(root, &id, &with_caps(process, &exec.caps)).map_err(host)
}

/// The process section of the config in container `id`'s bundle, as runc's exec reads it
/// without `--process` (the bundle from runc's record, its first `bundle` label).
fn bundle_process(root: &Path, id: &str) -> Result<Value, String> {
    let bundle = match supervise::label_hint(root, id, "bundle") {
        Some(Some(b)) => b,
        _ => return Err("runc's record of it names no bundle".into()),
    };
    let config = spec::load_config(Path::new(&bundle))
        .map_err(|e| format!("its config cannot be read: {e}"))?
        .value;
    Ok(config.get("process").cloned().unwrap_or(Value::Null))
}

/// `process` with each `--cap` added to the bounding, effective, permitted and ambient
/// sets, as runc adds them.
fn with_caps(mut process: Value, caps: &[String]) -> Value {
    if caps.is_empty() {
        return process;
    }
    if let Some(p) = process.as_object_mut() {
        let sets = p.entry("capabilities").or_insert_with(|| serde_json::json!({}));
        for set in ["bounding", "effective", "permitted", "ambient"] {
            if let Some(list) = sets
                .as_object_mut()
                .map(|c| c.entry(set).or_insert_with(|| Value::Array(Vec::new())))
            {
                if let Some(a) = list.as_array_mut() {
                    a.extend(caps.iter().map(|c| Value::from(c.as_str())));
                }
            }
        }
    }
    process
}

/// Linux's capabilities by number (linux/capability.h, 0 to 40).
const CAPABILITY_BITS: [&str; 41] = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_IPC_LOCK",
    "CAP_IPC_OWNER",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT",
    "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG",
    "CAP_MKNOD",
    "CAP_LEASE",
    "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP",
    "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN",
    "CAP_SYSLOG",
    "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ",
    "CAP_PERFMON",
    "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
];

/// Every exec, GPU container or not: its process (`process`, `--cap` added) holds no
/// capability, in any set, outside the bounding set runc created the container with (its
/// own record, `config.capabilities.Bounding` of `state.json` in runc's root: what the
/// create judged, not what the bundle's config says now; an init that narrowed its own
/// bounding set since, as `capsh --drop` does, still takes execs with what it was given).
/// A record that cannot be read refuses.
fn check_within_init(root: &Path, id: &str, process: &Value) -> Result<(), String> {
    let known = |c: &str| CAPABILITY_BITS.contains(&c);
    let any =
        spec::capability_where(Some(process), "exec process", known).map_err(|e| e.to_string())?;
    if any.is_none() {
        return Ok(());
    }
    let created = created_bounding_set(root, id)
        .map_err(|e| format!("what the container was created with cannot be read: {e}"))?;
    let beyond = spec::capability_where(Some(process), "exec process", |c| {
        known(c) && !created.iter().any(|b| b == c)
    })
    .map_err(|e| e.to_string())?;
    match beyond {
        Some((at, c)) => Err(format!(
            "{at}: {}: a capability the container was not created with (an exec adds none the \
             create did not give it; CAP_SYS_PTRACE is never given where processes outside its \
             pid namespace are in view)",
            tessera_api::untrusted(&c).max_chars(64)
        )),
        None => Ok(()),
    }
}

/// The bounding set runc created container `id` with, from its record under `root`.
fn created_bounding_set(root: &Path, id: &str) -> Result<Vec<String>, String> {
    let cid = tessera_api::ContainerId::new(id).map_err(|e| e.to_string())?;
    let bytes = tessera_api::read_runc_state(root, &cid).map_err(|e| e.to_string())?;
    #[derive(serde::Deserialize)]
    struct Record {
        config: Config,
    }
    #[derive(serde::Deserialize)]
    struct Config {
        #[serde(default)]
        capabilities: Option<Caps>,
    }
    #[derive(serde::Deserialize)]
    struct Caps {
        #[serde(rename = "Bounding", default)]
        bounding: Option<Vec<String>>,
    }
    let r: Record = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
    Ok(r.config.capabilities.and_then(|c| c.bounding).unwrap_or_default())
}

/// An exec's `--process` file: bounded, never through a link, its keys as runc reads them.
fn read_process(file: &Path) -> Result<Value, String> {
    let bytes = read_bounded(file).map_err(|e| format!("--process {}: {e}", file.display()))?;
    crate::canonical::parse(&bytes)
        .and_then(|v| crate::canonical::check_process_keys(&v).map(|()| v))
        .map_err(|e| format!("--process {}: {e}", file.display()))
}

/// The snapshot of an exec's `--process` file ([`snapshot_process`]): its path as runc is
/// given it (`/proc/self/fd/N`) and the descriptor, kept open (not close-on-exec) for runc.
static SNAPSHOT: std::sync::OnceLock<(PathBuf, std::os::fd::OwnedFd)> = std::sync::OnceLock::new();

/// `path` opened for reading: the snapshot's own descriptor where it names the snapshot,
/// else a regular file never reached through a link.
fn open_process_file(path: &Path) -> std::io::Result<std::fs::File> {
    use std::io::Seek as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    if let Some((at, fd)) = SNAPSHOT.get().filter(|(at, _)| at == path) {
        let _ = at;
        let mut f = std::fs::File::from(fd.try_clone()?);
        f.seek(std::io::SeekFrom::Start(0))?;
        return Ok(f);
    }
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
}

/// An exec with `--process FILE` (`args`: those after the verb): FILE read once, into a
/// memory file of this process, and `--process /proc/self/fd/N` added as the last such flag
/// (Go's flags keep the last), so the bytes judged and given the grant's environment are
/// the bytes runc reads, whatever happens to FILE meanwhile (round 11: a file swapped for a
/// link after the wrapper read it gave a GPU container's exec CAP_SYS_ADMIN). Returns the
/// arguments to use; unchanged without `--process`.
pub fn snapshot_process(args: &[OsString]) -> Result<Vec<OsString>, ExecError> {
    let Some(exec) = parse_exec(args) else { return Ok(args.to_vec()) };
    let Some(file) = &exec.process else { return Ok(args.to_vec()) };
    let id = exec.container_id.clone();
    let fail = |why: String| ExecError::Host { id: id.clone(), why };
    let bytes =
        read_bounded(file).map_err(|e| fail(format!("--process {}: {e}", file.display())))?;
    let name = c"tessera-exec-process";
    // SAFETY: memfd_create(2) with a NUL-terminated name and no flags (the descriptor stays
    // open across the exec of runc, which reads it); returns a new descriptor or -1.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), 0) };
    if fd < 0 {
        return Err(fail(format!(
            "cannot snapshot --process: {}",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by nothing else.
    let owned = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let mut f = std::fs::File::from(owned.try_clone().map_err(|e| fail(e.to_string()))?);
    std::io::Write::write_all(&mut f, &bytes).map_err(|e| fail(e.to_string()))?;
    let at = PathBuf::from(format!("/proc/self/fd/{fd}"));
    if SNAPSHOT.set((at.clone(), owned)).is_err() {
        return Err(fail("a second --process snapshot in one run".into()));
    }
    // In the caller's spelling: urfave/cli refuses `-p` and `--process` together.
    let short = args[..exec.flags_end].iter().any(|a| {
        let a = a.to_string_lossy();
        let name = a.trim_start_matches('-');
        a.starts_with('-') && (name == "p" || name.starts_with("p="))
    });
    let mut out = args[..exec.flags_end].to_vec();
    out.push(OsString::from(if short { "-p" } else { "--process" }));
    out.push(at.into_os_string());
    out.extend_from_slice(&args[exec.flags_end..]);
    Ok(out)
}

/// A regular file's bytes, at most [`MAX_JSON`], never through a link.
fn read_bounded(path: &Path) -> std::io::Result<Vec<u8>> {
    let f = open_process_file(path)?;
    if !f.metadata()?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    let mut buf = Vec::new();
    std::io::Read::read_to_end(&mut std::io::Read::take(f, MAX_JSON + 1), &mut buf)?;
    if buf.len() as u64 > MAX_JSON {
        return Err(std::io::Error::other(format!("larger than {MAX_JSON} bytes")));
    }
    Ok(buf)
}

/// The grant's environment of container `id` under runc root `root`: the [`GRANT_ENV`]
/// entries of its bundle's config.json, for a container tessera-runtime gave a grant
/// (its record carries `tessera.io/allocated`). Empty otherwise.
pub fn grant_env(root: &Path, id: &str) -> Vec<String> {
    let Some(Some(bundle)) = supervise::label_hint(root, id, spec::ALLOCATED_ANNOTATION) else {
        return Vec::new();
    };
    let Some(config) = read_json(&Path::new(&bundle).join("config.json")) else {
        return Vec::new();
    };
    config["process"]["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .filter(|e| GRANT_ENV.contains(&e.split('=').next().unwrap_or("")))
        .map(str::to_owned)
        .collect()
}

/// A regular file's JSON, opened without following a final symlink and without blocking
/// on a FIFO; anything else is `None`.
fn read_json(path: &Path) -> Option<Value> {
    let f = open_process_file(path).ok()?;
    if !f.metadata().ok()?.is_file() {
        return None;
    }
    let mut buf = Vec::new();
    std::io::Read::read_to_end(&mut std::io::Read::take(f, MAX_JSON), &mut buf).ok()?;
    serde_json::from_slice(&buf).ok()
}

/// `env` with each of `grant` set (replacing an entry of the same key).
fn merged(env: &[String], grant: &[String]) -> Vec<String> {
    let key = |e: &str| e.split('=').next().unwrap_or("").to_owned();
    let granted: Vec<String> = grant.iter().map(|g| key(g)).collect();
    env.iter()
        .filter(|e| !granted.contains(&key(e)))
        .cloned()
        .chain(grant.iter().cloned())
        .collect()
}

/// Rewrites a `--process` file's `env` to carry `grant`.
fn rewrite_process_file(path: &Path, grant: &[String]) -> std::io::Result<()> {
    let mut p = read_json(path)
        .filter(Value::is_object)
        .ok_or_else(|| std::io::Error::other("not a process object"))?;
    let env: Vec<String> = p["env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(str::to_owned)
        .collect();
    p["env"] = Value::from(merged(&env, grant));
    let text = serde_json::to_vec(&p).map_err(std::io::Error::other)?;
    if let Some((_, fd)) = SNAPSHOT.get().filter(|(at, _)| at == path) {
        // The snapshot runc reads: rewritten in place, from its start.
        let f = std::fs::File::from(fd.try_clone()?);
        f.set_len(0)?;
        std::os::unix::fs::FileExt::write_all_at(&f, &text, 0)?;
        return Ok(());
    }
    std::fs::write(path, text)
}

/// The arguments to exec runc with for `runc [global] exec EXEC_ARGS`, `args` being the
/// whole argv and `exec_at` the index of the verb: unchanged, except that a GPU
/// container's exec gets its grant's environment (in its `--process` file, or as `--env`
/// flags before the container id).
pub fn with_grant_env(root: &Path, args: &[OsString], exec_at: usize) -> Vec<OsString> {
    let rest = args.get(exec_at + 1..).unwrap_or(&[]);
    let Some(exec) = parse_exec(rest) else { return args.to_vec() };
    let grant = grant_env(root, &exec.container_id);
    if grant.is_empty() {
        return args.to_vec();
    }
    match &exec.process {
        Some(file) => {
            // Unreadable or unwritable: runc reads it next and says what is wrong.
            let _ = rewrite_process_file(file, &grant);
            args.to_vec()
        }
        None => {
            let at = exec_at + 1 + exec.flags_end;
            let mut out: Vec<OsString> = args[..at].to_vec();
            for g in &grant {
                out.push(OsStr::new("--env").to_owned());
                out.push(OsString::from(g));
            }
            out.extend_from_slice(&args[at..]);
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(s: &str) -> Vec<OsString> {
        s.split_whitespace().map(OsString::from).collect()
    }

    #[test]
    fn exec_arguments_as_runc_reads_them() {
        let e = parse_exec(&os("--process /tmp/p.json --detach --pid-file /p c1")).unwrap();
        assert_eq!(e.process, Some(PathBuf::from("/tmp/p.json")));
        assert_eq!((e.container_id.as_str(), e.id_index), ("c1", 5));
        let e = parse_exec(&os("-e A=1 --tty --user=1000 c2 sh -c true")).unwrap();
        assert_eq!((e.process, e.container_id.as_str(), e.id_index), (None, "c2", 4));
        let e = parse_exec(&os("-p=/x c3")).unwrap();
        assert_eq!(e.process, Some(PathBuf::from("/x")));
        let e = parse_exec(&os("-t -- c4 sh")).unwrap();
        assert_eq!((e.container_id.as_str(), e.id_index, e.flags_end), ("c4", 2, 1));
        assert_eq!(parse_exec(&os("--pidfd-socket /s c5")).unwrap().container_id, "c5");
        assert_eq!(parse_exec(&os("--tty")), None);
        assert_eq!(parse_exec(&os("--cwd")), None);
    }

    /// Go's `flag` package: a long flag with one dash, a short one with two, and a value
    /// that is not UTF-8 are all runc's flags; none hides the id or a capability.
    #[test]
    fn every_spelling_go_reads_as_a_flag_is_one() {
        let e = parse_exec(&os("-cwd / -cap CAP_SYS_ADMIN --c=CAP_NET_ADMIN c1 sh")).unwrap();
        assert_eq!((e.container_id.as_str(), e.id_index), ("c1", 5));
        assert_eq!(e.caps, ["CAP_SYS_ADMIN", "CAP_NET_ADMIN"]);
        let e = parse_exec(&os("-process=/f -cgroup ../x --p /g c2")).unwrap();
        assert_eq!(
            (e.process, e.cgroups, e.container_id.as_str()),
            (Some("/g".into()), vec!["../x".to_string()], "c2")
        );
        use std::os::unix::ffi::OsStringExt;
        let mut args = vec![OsString::from_vec(b"--env=\xff".to_vec())];
        args.extend(os("--cap CAP_SYS_ADMIN c3 sh"));
        let e = parse_exec(&args).expect("a value of any bytes is a value");
        assert_eq!((e.caps, e.container_id.as_str()), (vec!["CAP_SYS_ADMIN".to_string()], "c3"));
    }

    /// rt-iso3: round 6 refuses a container without a GPU that holds CAP_SYS_ADMIN (or any
    /// of `spec::HOST_CAPABILITIES`) without a user namespace at create, but its exec is
    /// judged only for GPU containers: `runc exec --cap CAP_SYS_ADMIN plain sh` (what
    /// `docker exec --privileged` sends, every capability) gives the exec'd process
    /// CAP_SYS_ADMIN in the bounding, effective, permitted and ambient sets (runc's setns
    /// process is forked from runc, not the container's init: its bounding set is the
    /// exec's own). From there: a second proc, a writable cgroup hierarchy, the host.
    #[test]
    fn rt_iso3_a_plain_containers_exec_cannot_add_a_host_capability() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let bundle = dir.path().join("bundle");
        std::fs::create_dir_all(root.join("plain")).unwrap();
        std::fs::create_dir_all(&bundle).unwrap();
        std::fs::write(
            root.join("plain/state.json"),
            serde_json::json!({"config": {"labels": [format!("bundle={}", bundle.display())]}})
                .to_string(),
        )
        .unwrap();
        std::fs::write(
            bundle.join("config.json"),
            serde_json::json!({"process": {"args": ["sh"], "capabilities": {"bounding": ["CAP_CHOWN"]}},
                               "linux": {"namespaces": [{"type": "pid"}, {"type": "mount"}]}})
            .to_string(),
        )
        .unwrap();
        let by_flag = check_exec(&root, &os("--cap CAP_SYS_ADMIN plain sh")).is_ok();
        let process = dir.path().join("process.json");
        std::fs::write(
            &process,
            r#"{"args": ["sh"], "cwd": "/", "capabilities": {"bounding": ["CAP_SYS_ADMIN"], "effective": ["CAP_SYS_ADMIN"], "permitted": ["CAP_SYS_ADMIN"]}}"#,
        )
        .unwrap();
        let by_file =
            check_exec(&root, &os(&format!("--process {} plain", process.display()))).is_ok();
        assert!(
            !by_flag && !by_file,
            "CAP_SYS_ADMIN added to a plain container's exec passed: --cap {by_flag}, --process {by_file}"
        );
    }

    /// rt-iso4 (red team, round 8's fix): where Yama's `ptrace_scope` is 1 or more, round 8
    /// lets a container without a GPU run in the host's pid namespace (hostPID monitoring
    /// pods), relying on Yama to refuse attaching to what is not a descendant, and on
    /// `check_host_capabilities` refusing such a container CAP_SYS_PTRACE at create (Yama's
    /// scope 1 and 2 let a tracer holding CAP_SYS_PTRACE in the target's user namespace
    /// attach to anything). An exec into it is judged by `check_plain_exec` against
    /// `spec::HOST_CAPABILITIES` only, which does not hold CAP_SYS_PTRACE: `runc exec --cap
    /// CAP_SYS_PTRACE hostpid sh` (or `--process` with it; `docker exec --privileged`) adds
    /// it to the exec'd process's sets (runc's setns process gets the exec's own bounding
    /// set), and that process, in the host's pid namespace, attaches to every GPU
    /// container's process: `pidfd_getfd` of its `/dev/nvidia*` descriptors, its `mem`.
    /// Seen here: `check_exec` lets both through. Not seen here: the kernel's answer (this
    /// VM has no Yama, so the hostPID container itself is refused at create).
    #[test]
    fn rt_iso4_a_plain_containers_exec_cannot_add_cap_sys_ptrace_where_it_sees_the_hosts_pids() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let bundle = dir.path().join("bundle");
        std::fs::create_dir_all(root.join("hostpid")).unwrap();
        std::fs::create_dir_all(&bundle).unwrap();
        std::fs::write(
            root.join("hostpid/state.json"),
            serde_json::json!({"config": {"labels": [format!("bundle={}", bundle.display())]}})
                .to_string(),
        )
        .unwrap();
        // No pid namespace of its own: admitted at create where Yama's scope is 1 or more.
        std::fs::write(
            bundle.join("config.json"),
            serde_json::json!({"process": {"args": ["sh"], "capabilities": {"bounding": ["CAP_KILL"]}},
                               "linux": {"namespaces": [{"type": "mount"}]}})
            .to_string(),
        )
        .unwrap();
        let by_flag = check_exec(&root, &os("--cap CAP_SYS_PTRACE hostpid sh")).is_ok();
        let process = dir.path().join("process.json");
        std::fs::write(
            &process,
            r#"{"args": ["sh"], "cwd": "/", "capabilities": {"bounding": ["CAP_SYS_PTRACE"], "effective": ["CAP_SYS_PTRACE"], "permitted": ["CAP_SYS_PTRACE"]}}"#,
        )
        .unwrap();
        let by_file =
            check_exec(&root, &os(&format!("--process {} hostpid", process.display()))).is_ok();
        assert!(
            !by_flag && !by_file,
            "CAP_SYS_PTRACE added to the exec of a plain container in the host's pid namespace \
             passed: --cap {by_flag}, --process {by_file}"
        );
    }

    /// An exec's capabilities stay within the bounding set runc recorded at create: what it
    /// holds may be added, what it does not may not, whether asked with `--cap` or written
    /// into the bundle's config since the create (round 11: runc's exec takes the bundle's
    /// process as it is now); a record without it refuses. (Round 12: judged against runc's
    /// record, not the init's live `CapBnd`, which an entrypoint may narrow.)
    #[test]
    fn an_exec_adds_no_capability_its_container_was_not_created_with() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let bundle = dir.path().join("bundle");
        std::fs::create_dir_all(&bundle).unwrap();
        let write_config = |caps: &[&str]| {
            std::fs::write(
                bundle.join("config.json"),
                serde_json::json!({"process": {"args": ["sh"], "capabilities": {"bounding": caps}}})
                    .to_string(),
            )
            .unwrap();
        };
        write_config(&["CAP_KILL"]);
        let labels = [format!("bundle={}", bundle.display())];
        for (id, config) in [
            (
                "made",
                serde_json::json!({"labels": labels,
                    "capabilities": {"Bounding": ["CAP_KILL", "CAP_SYS_PTRACE"]}}),
            ),
            ("gone", serde_json::json!(null)),
        ] {
            std::fs::create_dir_all(root.join(id)).unwrap();
            std::fs::write(
                root.join(id).join("state.json"),
                serde_json::json!({"init_process_pid": 1, "config": config}).to_string(),
            )
            .unwrap();
        }
        check_exec(&root, &os("--cap CAP_SYS_PTRACE made sh")).expect("created with it");
        let e =
            check_exec(&root, &os("--cap CAP_NET_ADMIN made sh")).expect_err("not created with");
        assert!(e.to_string().contains("CAP_NET_ADMIN: a capability the container was not"), "{e}");
        write_config(&["CAP_KILL", "CAP_NET_RAW"]);
        let e = check_exec(&root, &os("made sh")).expect_err("a bundle rewritten");
        assert!(e.to_string().contains("CAP_NET_RAW"), "{e}");
        let e = check_exec(&root, &os("--cap CAP_KILL gone sh")).expect_err("no record");
        assert!(e.to_string().contains("cannot be read"), "{e}");
    }

    /// Round 12: the snapshot's flag takes the caller's spelling (urfave/cli refuses `-p`
    /// and `--process` on one command line).
    #[test]
    fn the_process_snapshot_is_spelled_as_the_caller_spelled_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("p.json");
        std::fs::write(&file, r#"{"args": ["true"], "cwd": "/"}"#).unwrap();
        let f = file.display();
        let out = snapshot_process(&os(&format!("-p {f} c"))).expect("snapshot");
        let out: Vec<String> = out.iter().map(|a| a.to_string_lossy().into_owned()).collect();
        assert_eq!(out[..2], [String::from("-p"), f.to_string()]);
        assert_eq!(out[2], "-p");
        assert!(out[3].starts_with("/proc/self/fd/"), "{out:?}");
        assert_eq!(out[4], "c");
        assert_eq!(
            read_json(Path::new(&out[3])),
            Some(serde_json::json!({"args": ["true"], "cwd": "/"}))
        );
    }

    #[test]
    fn only_a_help_flag_before_the_id_is_runcs() {
        assert!(parse_exec(&os("--help c1")).unwrap().help);
        assert!(parse_exec(&os("-h=true -t c1 sh")).unwrap().help);
        assert!(!parse_exec(&os("--cap CAP_SYS_ADMIN c1 sh -c x -h")).unwrap().help);
        assert!(!parse_exec(&os("-- c1 ls --help")).unwrap().help);
        assert!(!parse_exec(&os("-h=false c1 sh")).unwrap().help);
    }

    #[test]
    fn the_grant_replaces_what_the_exec_asked_for_those_keys_only() {
        let env = vec!["PATH=/bin".to_string(), "CUDA_VISIBLE_DEVICES=0,1,2".to_string()];
        let grant = vec!["CUDA_VISIBLE_DEVICES=MIG-a".to_string()];
        assert_eq!(merged(&env, &grant), ["PATH=/bin", "CUDA_VISIBLE_DEVICES=MIG-a"]);
    }

    #[test]
    fn a_gpu_containers_exec_gets_the_grant_env_and_others_are_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let bundle = dir.path().join("bundle");
        std::fs::create_dir_all(root.join("gpu")).unwrap();
        std::fs::create_dir_all(root.join("plain")).unwrap();
        std::fs::create_dir_all(&bundle).unwrap();
        let state = |labels: Vec<String>| serde_json::json!({"config": {"labels": labels}});
        std::fs::write(
            root.join("gpu/state.json"),
            state(vec![
                format!("bundle={}", bundle.display()),
                "tessera.io/allocated=MIG-a".into(),
            ])
            .to_string(),
        )
        .unwrap();
        std::fs::write(
            root.join("plain/state.json"),
            state(vec![format!("bundle={}", bundle.display())]).to_string(),
        )
        .unwrap();
        std::fs::write(
            bundle.join("config.json"),
            serde_json::json!({"process": {"env": ["PATH=/bin", "CUDA_VISIBLE_DEVICES=MIG-a", "NVIDIA_VISIBLE_DEVICES=MIG-a", "SECRET=x"]}})
                .to_string(),
        )
        .unwrap();
        assert_eq!(
            grant_env(&root, "gpu"),
            ["CUDA_VISIBLE_DEVICES=MIG-a", "NVIDIA_VISIBLE_DEVICES=MIG-a"]
        );
        assert!(grant_env(&root, "plain").is_empty());
        assert!(grant_env(&root, "missing").is_empty());
        assert!(grant_env(&root, "../gpu").is_empty(), "an id runc refuses is never joined");

        let process = dir.path().join("process.json");
        std::fs::write(
            &process,
            r#"{"args": ["nvidia-smi"], "env": ["PATH=/usr/bin"], "cwd": "/"}"#,
        )
        .unwrap();
        let args = os(&format!(
            "runc --root {} exec --process {} --detach gpu",
            root.display(),
            process.display()
        ));
        assert_eq!(with_grant_env(&root, &args, 3), args, "the arguments stay");
        let p: Value = serde_json::from_slice(&std::fs::read(&process).unwrap()).unwrap();
        assert_eq!(
            p["env"],
            serde_json::json!([
                "PATH=/usr/bin",
                "CUDA_VISIBLE_DEVICES=MIG-a",
                "NVIDIA_VISIBLE_DEVICES=MIG-a"
            ])
        );
        assert_eq!(p["args"], serde_json::json!(["nvidia-smi"]));

        let args = os("runc exec -t gpu sh");
        let out = with_grant_env(&root, &args, 1);
        assert_eq!(
            out,
            os("runc exec -t --env CUDA_VISIBLE_DEVICES=MIG-a --env NVIDIA_VISIBLE_DEVICES=MIG-a gpu sh")
        );
        let args = os("runc exec -t -- gpu sh");
        assert_eq!(
            with_grant_env(&root, &args, 1),
            os("runc exec -t --env CUDA_VISIBLE_DEVICES=MIG-a --env NVIDIA_VISIBLE_DEVICES=MIG-a -- gpu sh")
        );
        let args = os("runc exec -t plain sh");
        assert_eq!(with_grant_env(&root, &args, 1), args);

        // A process file that is JSON but no object is left for runc to refuse.
        std::fs::write(&process, "[1, 2]").unwrap();
        let args = os(&format!("runc exec --process {} gpu", process.display()));
        assert_eq!(with_grant_env(&root, &args, 1), args);
        assert_eq!(std::fs::read_to_string(&process).unwrap(), "[1, 2]");
    }

    /// runc labels every annotation as key=value, then its own bundle= last, and its exec
    /// takes the *first* `bundle` label (`utils.SearchLabels`; round 11 showed runc exec'ing
    /// with the process of the directory an annotation named). The wrapper reads the labels
    /// as runc does, so it judges what runc will run; no config reaches runc with such an
    /// annotation (`spec::check_annotation_keys`, tested there and end to end in
    /// `tests/attack_round11.rs`).
    #[test]
    fn the_bundle_label_is_read_as_runcs_exec_reads_it() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let (real, evil) = (dir.path().join("real"), dir.path().join("evil"));
        for d in [root.join("c"), real.clone(), evil.clone()] {
            std::fs::create_dir_all(d).unwrap();
        }
        let labels = vec![
            format!("bundle={}", evil.display()),
            "tessera.io/allocated=x".to_string(),
            format!("bundle={}", real.display()),
        ];
        std::fs::write(
            root.join("c/state.json"),
            serde_json::json!({"config": {"labels": labels}}).to_string(),
        )
        .unwrap();
        let cfg = |v: &str| {
            serde_json::json!({"process": {"env": [format!("CUDA_VISIBLE_DEVICES={v}")]}})
                .to_string()
        };
        std::fs::write(real.join("config.json"), cfg("REAL")).unwrap();
        std::fs::write(evil.join("config.json"), cfg("LEAKED")).unwrap();
        assert_eq!(grant_env(&root, "c"), ["CUDA_VISIBLE_DEVICES=LEAKED"], "the first, as runc");
        let refused = spec::check_annotation_keys(
            &serde_json::json!({"annotations": {"bundle": evil.display().to_string()}}),
        );
        assert!(refused.is_err(), "a config naming a bundle label of its own");
        // A FIFO or a symlink where config.json should be: nothing, at once.
        std::fs::remove_file(evil.join("config.json")).unwrap();
        let fifo = std::ffi::CString::new(evil.join("config.json").to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path; mkfifo only creates a file.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        assert!(grant_env(&root, "c").is_empty());
        std::fs::remove_file(evil.join("config.json")).unwrap();
        std::os::unix::fs::symlink(real.join("config.json"), evil.join("config.json")).unwrap();
        assert!(grant_env(&root, "c").is_empty(), "read through a link");
    }
}
