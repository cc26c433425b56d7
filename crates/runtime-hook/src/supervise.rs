//! Running runc as a child instead of exec'ing it, for the runs after which the wrapper
//! has work left: `runc update` of a GPU container ([`crate::update`]: tesserad records
//! what the kernel enforces afterwards) and the `runc delete --force` that undoes a
//! created container tesserad refused to confirm. `create` and `run` are plain execs:
//! tesserad gives back a grant whose requester exited without runc making its container.
//!
//! While runc runs, the signals a supervisor sends to the wrapper are passed on to runc
//! (which passes them to the container, as it does when it is the process signalled).
//! Signals the kernel sends to the whole foreground process group — Ctrl-C, Ctrl-\,
//! a terminal resize — already reach runc, which shares the group; they are not sent a
//! second time.

use std::ffi::OsStr;
use std::io;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::Path;
use std::process::{Command, ExitStatus};

/// The signals passed on to runc.
pub const FORWARDED: &[libc::c_int] = &[
    libc::SIGHUP,
    libc::SIGINT,
    libc::SIGQUIT,
    libc::SIGTERM,
    libc::SIGUSR1,
    libc::SIGUSR2,
    libc::SIGWINCH,
    libc::SIGCONT,
    libc::SIGALRM,
];

/// How often the wait looks at the child even without a SIGCHLD.
const POLL: libc::timespec = libc::timespec { tv_sec: 0, tv_nsec: 100_000_000 };

/// A signal set of `signals`.
fn sigset(signals: &[libc::c_int]) -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it before any other use, and
    // sigaddset only fails for invalid signal numbers, which FORWARDED and SIGCHLD are not.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for &s in signals {
            libc::sigaddset(&mut set, s);
        }
        set
    }
}

/// Whether a signal was sent by a process (kill, sigqueue, tgkill), not by the kernel on
/// behalf of a terminal.
pub fn sent_by_a_process(si_code: libc::c_int) -> bool {
    matches!(si_code, libc::SI_USER | libc::SI_QUEUE | libc::SI_TKILL)
}

/// Runs `program args`, passing [`FORWARDED`] signals sent to this process on to it, and
/// returns how it ended. The child starts with this process's original signal mask.
pub fn run_forwarding(program: &OsStr, args: &[impl AsRef<OsStr>]) -> io::Result<ExitStatus> {
    run_forwarding_input(program, args, None)
}

/// [`run_forwarding`], with `input` (when given) as the child's standard input: written
/// from a thread of its own and closed (a child that stops reading early ends the write).
pub fn run_forwarding_input(
    program: &OsStr,
    args: &[impl AsRef<OsStr>],
    input: Option<Vec<u8>>,
) -> io::Result<ExitStatus> {
    let mut waited: Vec<libc::c_int> = FORWARDED.to_vec();
    waited.push(libc::SIGCHLD);
    let set = sigset(&waited);
    // SAFETY: sigset_t is plain data, filled in by pthread_sigmask below.
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are valid for the call. The mask is this thread's; in the
    // wrapper it is the only thread. Where other threads exist (tests), a SIGCHLD may be
    // taken by one of them, which the periodic `try_wait` below covers.
    if unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let restore = |old: &libc::sigset_t| {
        // SAFETY: `old` is the mask pthread_sigmask returned above.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, old, std::ptr::null_mut()) };
    };
    // A fork (`Command` with a `pre_exec` step), not `posix_spawn`: glibc's posix_spawn
    // sets the C library's internal signals (32 and 33) to SIG_IGN in the child it makes,
    // and no spawn attribute undoes it (`posix_spawnattr_setsigdefault` drops them); an
    // ignored signal survives exec, into runc, runc init and the container's process. A
    // fork execs with them as this process has them (handled: at their default). It costs
    // ~0.2 ms of CPU per create and delete (docs/PERFORMANCE.md, issue 29).
    let mut cmd = Command::new(program);
    cmd.args(args);
    if input.is_some() {
        cmd.stdin(std::process::Stdio::piped());
    }
    let child_mask = old;
    // SAFETY: the closure runs in the child between fork and exec; it only calls
    // pthread_sigmask (async-signal-safe) on a copy of the mask owned by the closure.
    unsafe {
        cmd.pre_exec(move || {
            if libc::pthread_sigmask(libc::SIG_SETMASK, &child_mask, std::ptr::null_mut()) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            restore(&old);
            return Err(e);
        }
    };
    if let (Some(bytes), Some(mut stdin)) = (input, child.stdin.take()) {
        std::thread::spawn(move || {
            // A child that exits without reading it all: the write fails, nothing more.
            let _ = io::Write::write_all(&mut stdin, &bytes);
        });
    }
    let pid = child.id() as libc::pid_t;
    let status = loop {
        // SAFETY: siginfo_t is plain data written by sigtimedwait.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set`, `info` and `POLL` are valid for the call.
        let sig = unsafe { libc::sigtimedwait(&set, &mut info, &POLL) };
        if sig < 0 {
            match io::Error::last_os_error().raw_os_error() {
                Some(libc::EINTR) => continue,
                // The poll interval passed: look at the child below.
                Some(libc::EAGAIN) => {}
                // Cannot wait for signals: wait for the child without forwarding.
                _ => break child.wait(),
            }
        } else if sig != libc::SIGCHLD {
            if sent_by_a_process(info.si_code) {
                // SAFETY: plain syscall; `pid` is our child, not yet reaped (so not reused).
                unsafe { libc::kill(pid, sig) };
            }
            continue;
        }
        match child.try_wait() {
            Ok(Some(status)) => break Ok(status),
            Ok(None) => {}
            Err(e) => break Err(e),
        }
    };
    restore(&old);
    status
}

/// The exit code a shell would report for `status`: the code, or 128 + the signal.
pub fn exit_code(status: ExitStatus) -> i32 {
    status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0))
}

/// Whether runc's record of `container_id` in `root` carries the `annotation` label, and
/// what it says of the container: `Some(bundle)` when it carries the label (the wrapper
/// writes `tessera.io/allocated` into every GPU container's config, and
/// `tessera.io/confirm` into every GPU create; runc keeps annotations as `key=value`
/// labels) or exists but cannot be read; `None` for a container without it, a missing
/// record, or an id runc would refuse (never joined to the root: `../x` would name another
/// directory).
///
/// Only a hint, to spare containers without GPUs a look at their config or the daemon (an
/// outage must not affect them): the label is the config author's to set, so it never
/// decides what a grant allows — an `update` or `exec` it names is judged on the
/// container's config and by tesserad, and a record that cannot be read counts as
/// labelled.
pub fn label_hint(root: &Path, container_id: &str, annotation: &str) -> Option<Option<String>> {
    let id = tessera_api::ContainerId::new(container_id).ok()?;
    let buf = match tessera_api::read_runc_state(root, &id) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return None,
        Err(_) => return Some(None),
    };
    // Only the labels are read (the rest, mounts and devices, skipped unparsed: a third of
    // what a `serde_json::Value` of the whole record cost, issue 29). A record of another
    // shape cannot be read: the daemon is asked.
    #[derive(serde::Deserialize)]
    struct Record {
        #[serde(default)]
        config: Config,
    }
    #[derive(Default, serde::Deserialize)]
    struct Config {
        #[serde(default)]
        labels: Vec<serde_json::Value>,
    }
    let Ok(state) = serde_json::from_slice::<Record>(&buf) else { return Some(None) };
    // Read as runc reads them (`utils.SearchLabels`): each label split at its first `=`,
    // the first label of a key wins. runc writes every annotation as a `key=value` label,
    // then its own `bundle=<dir>` last; an exec finds its bundle by the *first* `bundle`
    // label, so an annotation named `bundle` (or a key holding `=`) would name another:
    // tessera-runtime refuses such annotations at create (`spec::check_annotation_keys`).
    let labels: Vec<(&str, &str)> = state
        .config
        .labels
        .iter()
        .filter_map(|l| l.as_str())
        .map(|l| l.split_once('=').unwrap_or((l, "")))
        .collect();
    if !labels.iter().any(|(k, _)| *k == annotation) {
        return None;
    }
    Some(labels.iter().find(|(k, _)| *k == "bundle").map(|(_, v)| v.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_are_what_a_shell_reports() {
        assert_eq!(exit_code(ExitStatus::from_raw(0)), 0);
        assert_eq!(exit_code(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code(ExitStatus::from_raw(libc::SIGKILL)), 128 + 9);
    }

    #[test]
    fn only_signals_sent_by_processes_are_forwarded() {
        assert!(sent_by_a_process(libc::SI_USER));
        assert!(sent_by_a_process(libc::SI_QUEUE));
        assert!(sent_by_a_process(libc::SI_TKILL));
        assert!(!sent_by_a_process(libc::SI_KERNEL));
    }

    #[test]
    fn input_is_the_childs_standard_input() {
        let st = run_forwarding_input(
            OsStr::new("/bin/sh"),
            &["-c", "test \"$(cat)\" = hello"],
            Some(b"hello".to_vec()),
        )
        .expect("runs");
        assert_eq!(exit_code(st), 0);
        // A child that reads nothing of a large input still ends.
        let st = run_forwarding_input(
            OsStr::new("/bin/sh"),
            &["-c", "exit 3"],
            Some(vec![b'x'; 1 << 20]),
        )
        .expect("runs");
        assert_eq!(exit_code(st), 3);
    }

    #[test]
    fn child_exit_status_is_returned() {
        let st = run_forwarding(OsStr::new("/bin/sh"), &["-c", "exit 7"]).expect("runs");
        assert_eq!(exit_code(st), 7);
        let st = run_forwarding(OsStr::new("/bin/sh"), &["-c", "kill -TERM $$"]).expect("runs");
        assert_eq!(exit_code(st), 128 + libc::SIGTERM);
        assert!(run_forwarding(OsStr::new("/nonexistent/runc"), &["x"]).is_err());
    }

    /// The child starts with the mask the wrapper was started with, empty or not, never
    /// with the signals the wait blocks.
    #[test]
    fn the_child_starts_with_the_original_signal_mask() {
        let blocked = |expected: &str| {
            let script =
                format!("test \"$(grep SigBlk /proc/self/status)\" = \"SigBlk:\t{expected}\"");
            exit_code(run_forwarding(OsStr::new("/bin/sh"), &["-c", &script]).expect("runs"))
        };
        // This test's thread: nothing blocked, as in the wrapper started by an engine.
        assert_eq!(blocked("0000000000000000"), 0, "an empty mask stays empty");
        let usr1 = sigset(&[libc::SIGUSR1]);
        // SAFETY: valid pointers; only this test's thread's mask changes, and is restored.
        unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &usr1, std::ptr::null_mut()) };
        let code = blocked(&format!("{:016x}", 1u64 << (libc::SIGUSR1 - 1)));
        // SAFETY: as above.
        unsafe { libc::pthread_sigmask(libc::SIG_UNBLOCK, &usr1, std::ptr::null_mut()) };
        assert_eq!(code, 0, "a blocked SIGUSR1 stays blocked in the child");
    }

    /// runc gets none of the wrapper's own descriptors (its files, its connection to
    /// tesserad, the stdin pipe's write end): all are opened close-on-exec. The child's
    /// descriptors are compared by what they point at, not by number: the shell keeps
    /// descriptors of its own from 10 up, which may carry the numbers ours had (a flake
    /// seen once in CI: "descriptor 11 of the wrapper reached the child").
    #[test]
    fn the_child_gets_none_of_the_wrappers_descriptors() {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir().expect("tmp");
        let path = d.path().join("f");
        let file = std::fs::File::create(&path).expect("file");
        let (a, b) = std::os::unix::net::UnixStream::pair().expect("socket pair");
        let socket = |fd: i32| {
            let ino = std::fs::metadata(format!("/proc/self/fd/{fd}")).expect("fd").ino();
            format!("socket:[{ino}]")
        };
        let ours = [path.display().to_string(), socket(a.as_raw_fd()), socket(b.as_raw_fd())];
        let out = d.path().join("fds");
        let script = format!(
            "for f in /proc/$$/fd/*; do echo \"${{f##*/}} $(readlink $f)\"; done > {}; \
             cat > /dev/null",
            out.display()
        );
        let st = run_forwarding_input(OsStr::new("/bin/sh"), &["-c", &script], Some(vec![b'x']))
            .expect("runs");
        assert_eq!(exit_code(st), 0);
        let listed = std::fs::read_to_string(&out).expect("listed");
        let fds: Vec<(&str, &str)> = listed.lines().filter_map(|l| l.split_once(' ')).collect();
        assert!(fds.iter().any(|(n, _)| *n == "0"), "stdin, the pipe: {fds:?}");
        for target in &ours {
            assert!(
                !fds.iter().any(|(_, t)| t == target),
                "{target}, the wrapper's, reached the child: {fds:?}"
            );
        }
        drop(file);
    }

    #[test]
    fn the_label_hint_is_read_from_runc_state() {
        let d = tempfile::tempdir().expect("tmp");
        let root = d.path().join("root");
        let write = |dir: &Path, text: &str| {
            std::fs::create_dir_all(dir).expect("mkdir");
            std::fs::write(dir.join("state.json"), text).expect("write");
        };
        write(
            &root.join("gpu"),
            r#"{"config":{"labels":["a=b","tessera.io/allocated=MIG-1","bundle=/x"]}}"#,
        );
        write(&root.join("plain"), r#"{"config":{"labels":["bundle=/x"]}}"#);
        write(&root.join("junk"), "{not json");
        write(&root.join("odd"), r#"{"config":{"labels":"tessera.io/allocated=MIG-1"}}"#);
        write(&root.join("bare"), r#"{"id":"bare"}"#);
        write(
            &root.join("mixed"),
            r#"{"config":{"labels":[1,"tessera.io/allocated=MIG-1",null,"bundle=/m"]}}"#,
        );
        // A record outside the root, reachable only through a path in the id.
        write(
            &d.path().join("evil"),
            r#"{"config":{"labels":["tessera.io/allocated=GPU-1","bundle=/e"]}}"#,
        );
        let a = "tessera.io/allocated";
        assert_eq!(label_hint(&root, "gpu", a), Some(Some("/x".into())));
        assert_eq!(label_hint(&root, "plain", a), None);
        assert_eq!(label_hint(&root, "junk", a), Some(None), "unreadable: ask the daemon");
        assert_eq!(label_hint(&root, "odd", a), Some(None), "another shape: ask the daemon");
        assert_eq!(label_hint(&root, "bare", a), None, "no labels, no GPU label");
        assert_eq!(label_hint(&root, "mixed", a), Some(Some("/m".into())));
        assert_eq!(label_hint(&root, "missing", a), None);
        for id in ["../evil", "..", ".", "a/../../evil", ""] {
            assert_eq!(label_hint(&root, id, a), None, "{id:?} was joined to the root");
        }
        assert!(tessera_api::runc_state_exists(&root, "gpu"));
        assert!(!tessera_api::runc_state_exists(&root, "missing"));
        assert!(!tessera_api::runc_state_exists(&root, "../evil"));
    }
}
