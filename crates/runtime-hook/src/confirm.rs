//! A GPU container made by `runc create` is confirmed by tessera-runtime's `start`, right
//! before its process runs, instead of by a prestart hook (issue 29: one process and runc's
//! hook machinery fewer on every start a shim drives, and `create` a plain exec of runc).
//!
//! - [`before_start`]: `runc start` of a container whose runc record carries the label
//!   [`CONFIRM_ANNOTATION`] (written by the wrapper into every GPU container it creates)
//!   and no marker [`CONFIRMED_MARKER`]. Its init has moved into its root and waits on
//!   runc's exec fifo; nothing of the image has run. tesserad is asked to start the grant
//!   ([`StartRequest::created`]): it checks the process runc made (namespaces, the whole
//!   mount table, the cgroup and its limits) and opens the metering interval, durably.
//!   Only then is the marker written into runc's own record directory of the container,
//!   and runc starts it. Refused, the container is deleted and its grant given back (the
//!   wrapper's `undo_create`), and the start fails with tesserad's sentence.
//! - [`check_confirmed`]: an `exec` into a container with the label and no marker is
//!   refused (runc execs into a created container), and so is a `start` whose arguments
//!   name more than one id (runc starts none of them): nothing runs with its devices
//!   before tesserad has seen the container.
//!
//! The marker lives in runc's record directory (`<root>/<id>/`, root's alone), so it goes
//! with the record: `runc delete` removes both, and an id used again starts without one.
//! `runc run` keeps the prestart hook: nothing runs between runc's create and start there.
//! A create runc refused is given back by tesserad, which watches the process that asked
//! for the grant (the wrapper, runc by its exec) and finds no record once it exited.

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tessera_api::{untrusted, Client, ClientError, ContainerId, ReleaseRequest, StartRequest};

use crate::spec::CONFIRM_ANNOTATION;

/// The file, beside runc's `state.json`, that says tesserad confirmed the container.
pub const CONFIRMED_MARKER: &str = "tessera-confirmed";
/// The bound on tesserad's answer (its checks and one durable write).
pub const CONFIRM_TIMEOUT: Duration = Duration::from_secs(8);

/// Why a created container was not confirmed, or may not start.
#[derive(Debug, thiserror::Error)]
pub enum ConfirmError {
    #[error("cannot read runc's record {}: {source}", untrusted(&.path.to_string_lossy()))]
    State { path: PathBuf, source: io::Error },
    #[error("runc's record {} has no init pid: {why}", untrusted(&.path.to_string_lossy()))]
    NoPid { path: PathBuf, why: String },
    #[error("tesserad did not confirm the container runc made: {0}")]
    Refused(Box<ClientError>),
    #[error(
        "cannot record tesserad's confirmation at {}: {source}",
        untrusted(&.path.to_string_lossy())
    )]
    Marker { path: PathBuf, source: io::Error },
    #[error("what runc made is refused before its process runs: {0}")]
    ProcessView(String),
    /// An id runc takes and [`ContainerId`] does not (runc 1.1's pattern holds the range
    /// `+`..`.`, so `a,b`): the start and exec checks find a container by its id, so one
    /// they cannot name is never created, started or exec'd into through this wrapper.
    #[error(
        "`{}` is not an id tessera-runtime can name (letters, digits, `_`, `+`, `-`, `.`), so \
         what runc makes of it could not be judged",
        untrusted(.0).max_chars(128)
    )]
    UnnamedId(String),
    #[error(
        "its GPU grant is not confirmed (tessera-runtime confirms a created container at its \
         start); refusing to run anything in it before"
    )]
    NotConfirmed,
}

/// `<root>/<id>/tessera-confirmed`.
pub fn marker(root: &Path, id: &ContainerId) -> PathBuf {
    root.join(id.as_str()).join(CONFIRMED_MARKER)
}

/// The init's pid runc recorded for container `id` (`init_process_pid` of its state).
pub fn init_pid(root: &Path, id: &ContainerId) -> Result<i32, ConfirmError> {
    let path = tessera_api::runc_state_file(root, id);
    let buf = tessera_api::read_runc_state(root, id)
        .map_err(|source| ConfirmError::State { path: path.clone(), source })?;
    #[derive(serde::Deserialize)]
    struct Record {
        init_process_pid: i32,
    }
    match serde_json::from_slice::<Record>(&buf) {
        Ok(r) if r.init_process_pid > 0 => Ok(r.init_process_pid),
        Ok(r) => Err(ConfirmError::NoPid { path, why: format!("pid {}", r.init_process_pid) }),
        Err(e) => Err(ConfirmError::NoPid { path, why: e.to_string() }),
    }
}

/// Where the init `pid` joined a pid namespace (it is not its pid 1: `NSpid`), a process of
/// that namespace in a running GPU grant's cgroup (`<socket>.grant-cgroups`), if any.
fn joined_a_grants_pid_namespace(
    proc: &Path,
    pid: i32,
    socket: &Path,
) -> Result<Option<i32>, String> {
    use std::os::unix::fs::MetadataExt;
    let status_file = proc.join(pid.to_string()).join("status");
    let status = std::fs::read_to_string(&status_file)
        .map_err(|e| format!("{}: {e}", status_file.display()))?;
    let nspid = status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .ok_or_else(|| format!("{} has no NSpid line", status_file.display()))?;
    if nspid.split_whitespace().last() == Some("1") {
        return Ok(None);
    }
    let grants = match tessera_api::cgroup::read_grant_cgroups(socket) {
        Ok(Some(g)) => g,
        Ok(None) => return Ok(None),
        Err(e) => return Err(format!("the running grants' cgroups cannot be read: {e}")),
    };
    let ns =
        |p: &str| std::fs::metadata(proc.join(p).join("ns/pid")).ok().map(|m| (m.dev(), m.ino()));
    let own =
        ns(&pid.to_string()).ok_or_else(|| format!("the pid namespace of {pid} cannot be read"))?;
    let entries = std::fs::read_dir(proc).map_err(|e| format!("{}: {e}", proc.display()))?;
    for e in entries.filter_map(Result::ok) {
        let name = e.file_name();
        let Some(n) = name.to_str().filter(|n| n.bytes().all(|b| b.is_ascii_digit())) else {
            continue;
        };
        if ns(n) != Some(own) {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(proc.join(n).join("cgroup")) else { continue };
        let Ok(cgroup) = tessera_api::cgroup::parse_proc_cgroup(&text) else { continue };
        if grants.iter().any(|g| tessera_api::cgroup::within(&cgroup, g)) {
            return Ok(n.parse().ok());
        }
    }
    Ok(None)
}

/// Whether the pid namespace at `path` (a config's `linux.namespaces` entry) is that of a
/// container without a GPU under runc root `root` (one whose record carries no grant label,
/// [`crate::spec::ALLOCATED_ANNOTATION`], as the exec check tells them; its init's namespace
/// the same file), and not the host's: a pod's
/// sandbox, whose namespace a pod sharing its process namespace joins. A GPU container
/// never shares a pid namespace, so no GPU process is in such a namespace or below it.
pub fn is_a_plain_containers_pid_namespace(root: &Path, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let id = |p: &Path| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
    let Some(joined) = id(path) else { return false };
    if id(Path::new("/proc/self/ns/pid")) == Some(joined) {
        return false;
    }
    let Ok(dir) = std::fs::read_dir(root) else { return false };
    dir.filter_map(Result::ok).any(|e| {
        let name = e.file_name();
        let Some(Ok(cid)) = name.to_str().map(ContainerId::new) else { return false };
        crate::supervise::label_hint(root, cid.as_str(), crate::spec::ALLOCATED_ANNOTATION)
            .is_none()
            && init_pid(root, &cid).is_ok_and(|pid| {
                id(&Path::new("/proc").join(pid.to_string()).join("ns/pid")) == Some(joined)
            })
    })
}

/// Whether process `pid` holds CAP_SYS_PTRACE (capability 19 of linux/capability.h) in its
/// bounding set (`CapBnd` of `/proc/<pid>/status`).
fn init_holds_ptrace(pid: i32) -> Result<bool, String> {
    let file = format!("/proc/{pid}/status");
    let text = std::fs::read_to_string(&file).map_err(|e| format!("{file}: {e}"))?;
    let bounding = text
        .lines()
        .find_map(|l| l.strip_prefix("CapBnd:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .ok_or_else(|| format!("{file} has no CapBnd line"))?;
    Ok(bounding & (1 << 19) != 0)
}

/// Asks tesserad to confirm container `id`, which `runc create` made from `bundle` in
/// `root`, and records the answer ([`CONFIRMED_MARKER`]).
pub fn confirm_created(
    client: &Client,
    root: &Path,
    id: &ContainerId,
    bundle: &str,
) -> Result<(), ConfirmError> {
    let pid = init_pid(root, id)?;
    let req = StartRequest { pid, bundle: bundle.to_string(), created: true };
    client.start(id.as_str(), &req).map_err(|e| ConfirmError::Refused(Box::new(e)))?;
    let path = marker(root, id);
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .map(drop)
        .map_err(|source| ConfirmError::Marker { path, source })
}

/// [`confirm_created`] against tesserad's socket.
pub fn confirm_at(
    socket: &Path,
    root: &Path,
    id: &ContainerId,
    bundle: &str,
) -> Result<(), ConfirmError> {
    confirm_created(&Client::new(socket).with_timeout(CONFIRM_TIMEOUT), root, id, bundle)
}

/// Whether `runc start` of `container_id`, or an exec into it, may go ahead: refused for a
/// container the wrapper created to be confirmed (its record carries
/// [`CONFIRM_ANNOTATION`], or cannot be read) that never was. Containers without a record,
/// or without the label, are runc's business (a config that writes the label itself only
/// stops its own start).
pub fn check_confirmed(root: &Path, container_id: &str) -> Result<(), ConfirmError> {
    let Ok(id) = ContainerId::new(container_id) else { return Ok(()) };
    // Confirmed: one stat. Otherwise runc's record says whether it had to be.
    if marker(root, &id).is_file()
        || crate::supervise::label_hint(root, container_id, CONFIRM_ANNOTATION).is_none()
    {
        return Ok(());
    }
    Err(ConfirmError::NotConfirmed)
}

/// [`check_confirmed`] for the arguments of `runc start` (those after the verb). runc 1.1
/// takes `start ID` and `start -- ID` alike (Go's flag package ends the flags at `--`), and
/// refuses anything else (help aside): every argument but `--` is checked as the id it may
/// be, so no spelling starts an unconfirmed container.
pub fn check_start_args(root: &Path, args: &[std::ffi::OsString]) -> Result<(), ConfirmError> {
    args.iter()
        .filter(|a| a.as_os_str() != "--")
        .try_for_each(|a| check_confirmed(root, &a.to_string_lossy()))
}

/// Why a start was refused, and what to undo: the container tesserad refused to confirm
/// (deleted, then its grant given back with `release`), or one without a GPU whose made
/// mounts were refused (deleted; no grant).
#[derive(Debug)]
pub struct StartRefusal {
    pub error: ConfirmError,
    pub undo: Option<ContainerId>,
    pub release: Option<ReleaseRequest>,
}

/// A created container without a GPU (no [`CONFIRM_ANNOTATION`]), right before its
/// process runs, judged on what runc made (the create's checks read the config; a bind
/// source swapped between them and runc's mount — a link in a volume another container
/// writes — is caught here):
/// - no mount of its table shows a path of tesserad's own (`socket` and what is listed
///   beside it, [`tessera_api::private_paths`]; [`tessera_api::mountinfo::private_in_view`]);
/// - where Yama does not keep its processes from attaching to a GPU container's
///   (`ptrace_scope` below 1, the file at `ptrace_scope` read): the pid namespace runc made
///   it is not the host's, and every procfs in its mount table shows that namespace
///   ([`tessera_api::mountinfo::foreign_procfs`], read through its root with
///   [`tessera_api::procfs`]).
pub fn check_plain_created(
    root: &Path,
    id: &ContainerId,
    socket: &Path,
    ptrace_scope: &Path,
) -> Result<(), ConfirmError> {
    let pid = match init_pid(root, id) {
        Ok(pid) => pid,
        // No record: runc refuses the start itself.
        Err(ConfirmError::State { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
            return Ok(())
        }
        Err(e) => return Err(e),
    };
    judge_plain_made(pid, None, socket, ptrace_scope)
}

/// What [`check_plain_created`] judges, for the container whose init is `pid`: after
/// runc's `pivot_root` (`rootfs` `None`: the init's table is the container's), or before it
/// (`rootfs`: the container's root on the host, as `tessera-hook plain-prestart` sees a
/// `runc run`; the container's mounts are those at or below it there).
pub fn judge_plain_made(
    pid: i32,
    rootfs: Option<&Path>,
    socket: &Path,
    ptrace_scope: &Path,
) -> Result<(), ConfirmError> {
    let proc = Path::new("/proc");
    let refuse = |why: String| Err(ConfirmError::ProcessView(why));
    let read_table = |file: &Path| {
        std::fs::read_to_string(file)
            .map_err(|e| format!("{} cannot be read: {e}", file.display()))
            .and_then(|t| {
                tessera_api::mountinfo::parse(&t).map_err(|e| format!("{}: {e}", file.display()))
            })
    };
    if !proc.join(pid.to_string()).exists() {
        // Its init is gone: runc refuses to start or exec into it itself.
        return Ok(());
    }
    let table = match read_table(&proc.join(pid.to_string()).join("mountinfo")) {
        Ok(t) => match rootfs {
            Some(r) => tessera_api::mountinfo::below(t, r),
            None => t,
        },
        Err(e) => return refuse(format!("its mount table: {e}")),
    };
    let host = match read_table(&proc.join("self/mountinfo")) {
        Ok(t) => t,
        Err(e) => return refuse(format!("the host's mount table: {e}")),
    };
    let private =
        tessera_api::mountinfo::private_places(&host, &tessera_api::private_paths(socket));
    if let Some(f) = tessera_api::mountinfo::private_in_view(&table, &private, &[]) {
        return refuse(f.to_string());
    }
    // Yama keeps it from attaching where it holds no CAP_SYS_PTRACE (which passes Yama).
    if crate::spec::read_ptrace_scope(ptrace_scope).is_some_and(|s| s >= 1) {
        match init_holds_ptrace(pid) {
            Ok(false) => return Ok(()),
            Ok(true) => {}
            Err(e) => return refuse(e),
        }
    }
    let Some(own) = tessera_api::procfs::pid_namespace(proc, pid) else {
        return refuse(format!("the pid namespace of its init {pid} cannot be read"));
    };
    if tessera_api::procfs::pid_namespace(proc, std::process::id() as i32).as_deref()
        == Some(own.as_str())
    {
        return refuse(format!("runc made it in the host's pid namespace ({own})"));
    }
    // A namespace it joined (its init is not that namespace's pid 1) holds no GPU
    // container's process: read now, from the namespace runc put it in (a path the create
    // checked may have been swapped for another's since).
    match joined_a_grants_pid_namespace(proc, pid, socket) {
        Ok(None) => {}
        Ok(Some(other)) => {
            return refuse(format!(
                "runc put it in the pid namespace {own} of a GPU container's process ({other}): \
                 it would attach to it"
            ))
        }
        Err(e) => return refuse(e),
    }
    match tessera_api::mountinfo::foreign_procfs(&table, &own, |e| match rootfs {
        None => tessera_api::procfs::shown_pid_namespace(proc, pid, &e.mount_point),
        Some(r) => {
            let at = r.join(e.mount_point.trim_start_matches('/'));
            tessera_api::procfs::shown_pid_namespace(proc, pid, at.to_str()?)
        }
    }) {
        Some(f) => refuse(f.to_string()),
        None => Ok(()),
    }
}

/// Before `runc start` (the arguments after the verb) under runc root `root`: a created
/// GPU container not yet confirmed is confirmed now, against tesserad's `socket`; see the
/// module docs. Arguments that name more than one id are [`check_start_args`]'s.
pub fn before_start(
    socket: &Path,
    root: &Path,
    args: &[std::ffi::OsString],
    ptrace_scope: &Path,
) -> Result<(), StartRefusal> {
    let refuse = |error| StartRefusal { error, undo: None, release: None };
    let ids: Vec<&std::ffi::OsString> = args.iter().filter(|a| a.as_os_str() != "--").collect();
    let [one] = ids[..] else { return check_start_args(root, args).map_err(refuse) };
    // Not an id tessera can name: never judged, so never started through this wrapper
    // (runc's own pattern takes some, `a,b`, that tessera's does not).
    let Some(Ok(id)) = one.to_str().map(ContainerId::new) else {
        return Err(refuse(ConfirmError::UnnamedId(one.to_string_lossy().into_owned())));
    };
    if marker(root, &id).is_file() {
        return Ok(());
    }
    let bundle = match crate::supervise::label_hint(root, id.as_str(), CONFIRM_ANNOTATION) {
        None => {
            return check_plain_created(root, &id, socket, ptrace_scope)
                .map_err(|error| StartRefusal { error, undo: Some(id.clone()), release: None })
        }
        // A record that cannot be read counts as one to confirm, and cannot be.
        Some(None) => return Err(refuse(ConfirmError::NotConfirmed)),
        Some(Some(bundle)) => bundle,
    };
    confirm_at(socket, root, &id, &bundle).map_err(|error| StartRefusal {
        error,
        release: Some(ReleaseRequest {
            runc_root: root.to_str().map(str::to_string),
            bundle: Some(bundle.clone()),
        }),
        undo: Some(id.clone()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(root: &Path, id: &str, state: &str) -> ContainerId {
        let id = ContainerId::new(id).expect("id");
        std::fs::create_dir_all(root.join(id.as_str())).expect("dir");
        std::fs::write(tessera_api::runc_state_file(root, &id), state).expect("state");
        id
    }

    const GPU: &str = r#"{"id":"c","init_process_pid":4242,
        "config":{"labels":["tessera.io/allocated=MIG-1","tessera.io/confirm=after-create","bundle=/b"]}}"#;

    #[test]
    fn a_gpu_container_starts_only_once_confirmed() {
        let dir = tempfile::tempdir().expect("tmp");
        let id = record(dir.path(), "c", GPU);
        let err = check_confirmed(dir.path(), "c").expect_err("never confirmed");
        assert!(matches!(err, ConfirmError::NotConfirmed), "{err}");
        assert!(err.to_string().contains("is not confirmed"), "{err}");
        std::fs::write(marker(dir.path(), &id), "").expect("marker");
        check_confirmed(dir.path(), "c").expect("confirmed");
    }

    #[test]
    fn every_spelling_of_start_runc_reads_is_checked() {
        let dir = tempfile::tempdir().expect("tmp");
        record(dir.path(), "c", GPU);
        let args = |s: &str| s.split(' ').map(std::ffi::OsString::from).collect::<Vec<_>>();
        for line in ["c", "-- c", "c --", "--help c", "x c"] {
            let err = check_start_args(dir.path(), &args(line)).expect_err(line);
            assert!(matches!(err, ConfirmError::NotConfirmed), "{line}: {err}");
        }
        check_start_args(dir.path(), &args("-- other")).expect("not a GPU container");
        check_start_args(dir.path(), &[]).expect("runc says what is missing");
    }

    #[test]
    fn a_record_that_cannot_be_read_is_a_gpu_containers_until_confirmed() {
        let dir = tempfile::tempdir().expect("tmp");
        record(dir.path(), "odd", "{not json");
        assert!(matches!(check_confirmed(dir.path(), "odd"), Err(ConfirmError::NotConfirmed)));
    }

    #[test]
    fn other_containers_start_as_runc_says() {
        let dir = tempfile::tempdir().expect("tmp");
        record(dir.path(), "plain", r#"{"init_process_pid":7,"config":{"labels":["bundle=/b"]}}"#);
        check_confirmed(dir.path(), "plain").expect("no label");
        // The grant's label alone (a config may write it): not the wrapper's create.
        let label = r#"{"config":{"labels":["tessera.io/allocated=GPU-1","bundle=/b"]}}"#;
        record(dir.path(), "labelled", label);
        check_confirmed(dir.path(), "labelled").expect("not created to be confirmed");
        check_confirmed(dir.path(), "missing").expect("no record: runc says so");
        check_confirmed(dir.path(), "../plain").expect("not an id: runc refuses it");
    }

    #[test]
    fn the_init_pid_is_runcs_record() {
        let dir = tempfile::tempdir().expect("tmp");
        let id = record(dir.path(), "c", GPU);
        assert_eq!(init_pid(dir.path(), &id).expect("pid"), 4242);
        let zero = record(dir.path(), "z", r#"{"init_process_pid":0}"#);
        assert!(matches!(init_pid(dir.path(), &zero), Err(ConfirmError::NoPid { .. })));
        let none = record(dir.path(), "n", r#"{"id":"n"}"#);
        let err = init_pid(dir.path(), &none).expect_err("no pid");
        assert!(err.to_string().contains("no init pid"), "{err}");
        let gone = ContainerId::new("gone").expect("id");
        assert!(matches!(init_pid(dir.path(), &gone), Err(ConfirmError::State { .. })));
    }
}
