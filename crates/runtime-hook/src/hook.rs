//! `tessera-hook prestart|poststop|plain-prestart`: the OCI hook runc runs around a GPU
//! container (and, `plain-prestart`, in a `runc run` of a container without a GPU).
//!
//! runc runs it with the OCI state JSON on stdin, the env written into config.json
//! (only `TESSERA_SOCKET`), and a 10 s timeout. The hook reads nothing else: not the
//! container's rootfs, not its config, and it trusts no path from the state: it only hands
//! `bundle` back to the daemon, which compares it with what it recorded.
//!
//! - `prestart`: the daemon confirms the allocation against the container's pid and opens
//!   the metering interval. Any failure exits 1, so runc fails the start (fail closed).
//! - `plain-prestart`: no daemon asked; the mounts runc made below the rootfs named in the
//!   bundle's config (the one tessera-runtime checked and wrote) are judged as a created
//!   container's are at its start ([`crate::confirm::judge_plain_made`]); a finding exits 1.
//! - `poststop`: the daemon releases the allocation. tessera-runtime no longer writes this
//!   hook (it releases after runc removes the container, a process spawn sooner); the
//!   phase stays for containers whose config an earlier version wrote, and for runtimes
//!   other than tessera-runtime that want to release through a hook. If the daemon cannot
//!   be reached (or
//!   does not answer in time) the hook warns and exits 0: the container is gone either
//!   way, and tesserad's reconciler releases allocations whose container no longer exists
//!   in runc's state root, so nothing leaks. A daemon that answers with an error exits 1
//!   (runc logs it; the container is already deleted).

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::Read;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::mpsc;
use std::time::Duration;

use serde::Deserialize;
use tessera_api::display::MAX_LINE_CHARS;
use tessera_api::{untrusted, Client, ClientError, ReleaseRequest, StartRequest, DEFAULT_SOCKET};

/// The largest OCI state accepted on stdin.
pub const MAX_STATE_BYTES: u64 = 1 << 20;
/// The bound on the whole daemon call (runc kills the hook at 10 s).
pub const HOOK_DEADLINE: Duration = Duration::from_secs(8);

/// Why the hook failed.
#[derive(Debug, thiserror::Error)]
pub enum HookError {
    #[error("usage: tessera-hook prestart|poststop|plain-prestart (OCI state on stdin)")]
    Usage,
    #[error("unknown hook phase `{}`: expected prestart, poststop or plain-prestart", untrusted(.0))]
    UnknownPhase(String),
    #[error("cannot read the OCI state from stdin: {0}")]
    Read(std::io::Error),
    #[error("OCI state on stdin is larger than {MAX_STATE_BYTES} bytes")]
    TooLarge,
    #[error("malformed OCI state on stdin at `{path}`, line {line} column {column}: {message}")]
    Malformed { path: String, line: usize, column: usize, message: String },
    #[error("invalid OCI state: {0}")]
    Invalid(String),
    #[error("container {}: {source}", untrusted(.id))]
    Daemon { id: String, source: Box<ClientError> },
    #[error("container {}: tesserad did not answer within {secs} s", untrusted(.id), secs = HOOK_DEADLINE.as_secs())]
    Timeout { id: String },
    #[error("container {}: {source}", untrusted(.id))]
    Made { id: String, source: crate::confirm::ConfirmError },
}

/// Which hook runc is running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Prestart,
    Poststop,
    /// The prestart of a `runc run` of a container without a GPU: what runc made is judged
    /// here, before `pivot_root` ([`crate::confirm::judge_plain_made`]); no daemon asked.
    PlainPrestart,
}

impl FromStr for Phase {
    type Err = HookError;
    fn from_str(s: &str) -> Result<Self, HookError> {
        match s {
            "prestart" => Ok(Phase::Prestart),
            "poststop" => Ok(Phase::Poststop),
            "plain-prestart" => Ok(Phase::PlainPrestart),
            other => Err(HookError::UnknownPhase(other.to_string())),
        }
    }
}

/// The OCI state runc writes to a hook's stdin (runtime-spec "State"). Required fields
/// are required; unknown fields are ignored so a newer runtime-spec still works.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HookState {
    pub oci_version: String,
    pub id: String,
    pub status: String,
    /// Absent once the container has stopped (runc omits it).
    #[serde(default)]
    pub pid: Option<i32>,
    pub bundle: String,
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
}

/// Reads the state from stdin, at most [`MAX_STATE_BYTES`]; errors give the position.
pub fn read_state(input: impl Read) -> Result<HookState, HookError> {
    let mut buf = Vec::with_capacity(4096);
    input.take(MAX_STATE_BYTES + 1).read_to_end(&mut buf).map_err(HookError::Read)?;
    if buf.len() as u64 > MAX_STATE_BYTES {
        return Err(HookError::TooLarge);
    }
    parse_state(&buf)
}

/// Parses the OCI state JSON.
pub fn parse_state(bytes: &[u8]) -> Result<HookState, HookError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    let state: HookState = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        HookError::Malformed {
            path,
            line: inner.line(),
            column: inner.column(),
            message: strip_position(&inner.to_string()),
        }
    })?;
    de.end().map_err(|e| HookError::Malformed {
        path: ".".into(),
        line: e.line(),
        column: e.column(),
        message: strip_position(&e.to_string()),
    })?;
    if state.id.is_empty() {
        return Err(HookError::Invalid("empty container id".into()));
    }
    Ok(state)
}

/// serde_json appends " at line L column C" to its messages; the error reports those itself.
fn strip_position(msg: &str) -> String {
    match msg.rfind(" at line ") {
        Some(i) => msg[..i].to_string(),
        None => msg.to_string(),
    }
}

/// What a successful hook run did, for the exit code and the one line it prints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HookOutcome {
    Started,
    Released,
    /// poststop could not reach the daemon: a warning, exit 0.
    ReleaseDeferred(String),
}

/// Runs `f` on a thread and waits at most `deadline` for it. On timeout the thread is left
/// behind; the hook process exits right after.
fn with_deadline<T: Send + 'static>(
    deadline: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(deadline).ok()
}

/// The container's pid a prestart hook needs from runc's state.
fn prestart_pid(state: &HookState) -> Result<i32, HookError> {
    match state.pid {
        Some(p) if p > 0 => Ok(p),
        other => Err(HookError::Invalid(format!(
            "container {}: prestart needs the container's pid, got {other:?}",
            untrusted(&state.id)
        ))),
    }
}

/// Runs one phase against a daemon socket.
pub fn run_hook(
    phase: Phase,
    state: &HookState,
    client: &Client,
    deadline: Duration,
) -> Result<HookOutcome, HookError> {
    let id = state.id.clone();
    match phase {
        Phase::Prestart => {
            let pid = prestart_pid(state)?;
            let req = StartRequest { pid, bundle: state.bundle.clone(), created: false };
            let (c, call_id) = (client.clone(), id.clone());
            match with_deadline(deadline, move || c.start(&call_id, &req)) {
                Some(Ok(_)) => Ok(HookOutcome::Started),
                Some(Err(source)) => Err(HookError::Daemon { id, source: Box::new(source) }),
                None => Err(HookError::Timeout { id }),
            }
        }
        Phase::PlainPrestart => {
            let pid = prestart_pid(state)?;
            // runc's own state names the bundle; its config is the one tessera-runtime
            // checked and wrote.
            let made = |why: String| HookError::Made {
                id: id.clone(),
                source: crate::confirm::ConfirmError::ProcessView(why),
            };
            let rootfs = tessera_api::bundle_root(std::path::Path::new(&state.bundle))
                .map_err(|e| made(format!("its root: {e}")))?;
            crate::confirm::judge_plain_made(
                pid,
                Some(&rootfs),
                client.socket(),
                std::path::Path::new(crate::spec::YAMA_PTRACE_SCOPE),
            )
            .map_err(|source| HookError::Made { id, source })?;
            Ok(HookOutcome::Started)
        }
        Phase::Poststop => {
            // runc runs poststop after removing the container's state; the hook does not
            // know the runc root, so it names the bundle, and tesserad checks the rest.
            let (c, call_id) = (client.clone(), id.clone());
            let req = ReleaseRequest { runc_root: None, bundle: Some(state.bundle.clone()) };
            match with_deadline(deadline, move || c.release_container(&call_id, &req)) {
                Some(Ok(())) => Ok(HookOutcome::Released),
                Some(Err(e @ (ClientError::Connect { .. } | ClientError::Io { .. }))) => {
                    Ok(HookOutcome::ReleaseDeferred(format!("container {}: {e}", untrusted(&id))))
                }
                Some(Err(source)) => Err(HookError::Daemon { id, source: Box::new(source) }),
                None => Ok(HookOutcome::ReleaseDeferred(HookError::Timeout { id }.to_string())),
            }
        }
    }
}

/// Runs the hook from its argv (`tessera-hook prestart|poststop`) with `TESSERA_SOCKET` from
/// the environment; returns the exit code.
///
/// Without `TESSERA_SOCKET` (tessera-runtime always writes it into the hook's entry), the
/// runtime configuration file's `socket` applies ([`crate::config`]). Run under the name
/// `nvidia-container-runtime-hook` (a link Docker's `--gpus` needs), it is the refusing
/// stand-in [`crate::docker::standin_main`].
pub fn hook_main(args: Vec<OsString>, stdin: impl Read) -> i32 {
    let invoked = args.first().map(std::path::Path::new).and_then(|p| p.file_name());
    if invoked.is_some_and(|n| n == crate::docker::NVIDIA_HOOK) {
        return crate::docker::standin_main(&args);
    }
    let socket = match std::env::var_os("TESSERA_SOCKET").filter(|s| !s.is_empty()) {
        Some(s) => PathBuf::from(s),
        None => match crate::config::ConfigSource::choose(None).load() {
            Ok(c) => c.socket.unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET)),
            Err(e) => {
                eprintln!("{}", untrusted(&format!("tessera-hook: {e}")).max_chars(MAX_LINE_CHARS));
                return 1;
            }
        },
    };
    hook_main_with(args, stdin, &socket)
}

/// [`hook_main`] with the socket given.
pub fn hook_main_with(args: Vec<OsString>, stdin: impl Read, socket: &std::path::Path) -> i32 {
    let result = (|| {
        let phase = match args.get(1).map(|a| a.to_str()) {
            Some(Some(p)) => p.parse::<Phase>()?,
            Some(None) => return Err(HookError::UnknownPhase(args[1].to_string_lossy().into())),
            None => return Err(HookError::Usage),
        };
        let state = read_state(stdin)?;
        let client = Client::new(socket).with_timeout(HOOK_DEADLINE);
        run_hook(phase, &state, &client, HOOK_DEADLINE)
    })();
    match result {
        Ok(HookOutcome::Started | HookOutcome::Released) => 0,
        Ok(HookOutcome::ReleaseDeferred(why)) => {
            let line = format!(
                "tessera-hook: warning: {why}; the allocation will be released by tesserad's reconciler"
            );
            eprintln!("{}", untrusted(&line).max_chars(MAX_LINE_CHARS));
            0
        }
        Err(e) => {
            eprintln!("{}", untrusted(&format!("tessera-hook: {e}")).max_chars(MAX_LINE_CHARS));
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;
    use std::path::Path;

    /// What runc 1.1 writes to a prestart hook.
    const PRESTART_STATE: &str = r#"{"ociVersion":"1.0.2-dev","id":"abc","status":"creating","pid":4242,"bundle":"/run/containerd/io.containerd.runtime.v2.task/k8s.io/abc","annotations":{"tessera.io/gpu":"mig=1g.10gb"}}"#;
    /// What runc 1.1 writes to a poststop hook (no pid).
    const POSTSTOP_STATE: &str =
        r#"{"ociVersion":"1.0.2-dev","id":"abc","status":"stopped","bundle":"/b"}"#;

    /// Serves one HTTP answer on a fresh socket; returns the request it received.
    fn serve_once(
        answer: &'static str,
    ) -> (tempfile::TempDir, PathBuf, std::thread::JoinHandle<String>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("d.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        let h = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().expect("accept");
            crate::test_support::answer_one(&mut s, answer)
        });
        (dir, path, h)
    }

    fn argv(phase: &str) -> Vec<OsString> {
        vec!["tessera-hook".into(), phase.into()]
    }

    const ALLOCATION: &str = r#"{"container_id":"abc","tenant":"org/a","trust":"trusted","request":"mig=1g.10gb","isolation":"mig","devices":[],"injection":{"devices":[],"env":[],"mounts":[]},"state":"running","pid":4242,"created_ms":1}"#;

    #[test]
    fn parses_runc_state() {
        let s = parse_state(PRESTART_STATE.as_bytes()).expect("parses");
        assert_eq!(s.id, "abc");
        assert_eq!(s.pid, Some(4242));
        assert_eq!(s.status, "creating");
        assert_eq!(s.annotations.len(), 1);
        let s = parse_state(POSTSTOP_STATE.as_bytes()).expect("parses");
        assert_eq!(s.pid, None);
        // Unknown fields from a newer runtime are tolerated.
        let s = parse_state(br#"{"ociVersion":"1.2.0","id":"x","status":"creating","pid":1,"bundle":"/b","future":{"a":1}}"#)
            .expect("parses");
        assert_eq!(s.id, "x");
    }

    #[test]
    fn malformed_state_names_the_position() {
        let err = parse_state(b"{\"ociVersion\":\"1.0.2\",\n\"id\":\"abc\",\n\"pid\":\"12\"}")
            .expect_err("must fail");
        match &err {
            HookError::Malformed { path, line, column, .. } => {
                assert_eq!(path, "pid");
                assert_eq!(*line, 3);
                assert!(*column > 0);
            }
            other => panic!("{other}"),
        }
        let msg = err.to_string();
        assert!(msg.contains("`pid`") && msg.contains("line 3"), "{msg}");

        let err = parse_state(br#"{"ociVersion":"1","id":"a","status":"creating","pid":1}"#)
            .expect_err("must fail");
        assert!(err.to_string().contains("missing field `bundle`"), "{err}");
        let err = parse_state(b"{\"id\": ").expect_err("must fail");
        assert!(matches!(err, HookError::Malformed { line: 1, .. }), "{err}");
        let err =
            parse_state(br#"{"ociVersion":"1","id":"a","status":"s","bundle":"/b"} trailing"#)
                .expect_err("must fail");
        assert!(matches!(err, HookError::Malformed { .. }), "{err}");
        let err = parse_state(br#"{"ociVersion":"1","id":"","status":"s","bundle":"/b"}"#)
            .expect_err("must fail");
        assert!(matches!(err, HookError::Invalid(_)), "{err}");
    }

    #[test]
    fn oversized_state_is_refused() {
        let big = vec![b' '; MAX_STATE_BYTES as usize + 10];
        assert!(matches!(read_state(&big[..]), Err(HookError::TooLarge)));
    }

    #[test]
    fn prestart_confirms_with_pid_and_bundle() {
        let answer: &'static str = Box::leak(
            format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{ALLOCATION}", ALLOCATION.len())
                .into_boxed_str(),
        );
        let (_d, sock, h) = serve_once(answer);
        let code = hook_main_with(argv("prestart"), PRESTART_STATE.as_bytes(), &sock);
        assert_eq!(code, 0);
        let req = h.join().expect("join");
        assert!(req.starts_with("POST /v1/allocations/abc/start HTTP/1.1\r\n"), "{req}");
        let body = &req[req.find("\r\n\r\n").expect("body") + 4..];
        let body: serde_json::Value = serde_json::from_str(body).expect("json body");
        assert_eq!(
            body,
            serde_json::json!({"pid": 4242, "bundle": "/run/containerd/io.containerd.runtime.v2.task/k8s.io/abc"})
        );
    }

    #[test]
    fn prestart_fails_closed() {
        // Daemon refuses.
        let (_d, sock, _h) = serve_once(
            "HTTP/1.1 409 Conflict\r\ncontent-length: 53\r\n\r\n{\"code\":\"conflict\",\"message\":\"bundle does not match\"}",
        );
        assert_eq!(hook_main_with(argv("prestart"), PRESTART_STATE.as_bytes(), &sock), 1);
        // Daemon missing.
        assert_eq!(
            hook_main_with(
                argv("prestart"),
                PRESTART_STATE.as_bytes(),
                Path::new("/nonexistent/t.sock")
            ),
            1
        );
        // No pid.
        let state = parse_state(POSTSTOP_STATE.as_bytes()).expect("parses");
        let err = run_hook(Phase::Prestart, &state, &Client::new("/nonexistent"), HOOK_DEADLINE)
            .expect_err("must fail");
        assert!(matches!(err, HookError::Invalid(_)), "{err}");
        // Malformed state, bad usage.
        assert_eq!(hook_main_with(argv("prestart"), &b"{"[..], Path::new("/x")), 1);
        assert_eq!(
            hook_main_with(argv("createRuntime"), PRESTART_STATE.as_bytes(), Path::new("/x")),
            1
        );
        assert_eq!(
            hook_main_with(vec!["tessera-hook".into()], PRESTART_STATE.as_bytes(), Path::new("/x")),
            1
        );
    }

    #[test]
    fn prestart_times_out() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("slow.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        let _h = std::thread::spawn(move || {
            let (_s, _) = listener.accept().expect("accept");
            std::thread::sleep(Duration::from_secs(5));
        });
        let state = parse_state(PRESTART_STATE.as_bytes()).expect("parses");
        let err =
            run_hook(Phase::Prestart, &state, &Client::new(&path), Duration::from_millis(200))
                .expect_err("must fail");
        assert!(matches!(err, HookError::Timeout { .. }), "{err}");
        let out =
            run_hook(Phase::Poststop, &state, &Client::new(&path), Duration::from_millis(200))
                .expect("ok");
        assert!(matches!(out, HookOutcome::ReleaseDeferred(_)), "{out:?}");
    }

    #[test]
    fn poststop_releases() {
        let (_d, sock, h) = serve_once("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}");
        assert_eq!(hook_main_with(argv("poststop"), POSTSTOP_STATE.as_bytes(), &sock), 0);
        let req = h.join().expect("join");
        assert!(req.starts_with("DELETE /v1/allocations/abc HTTP/1.1\r\n"), "{req}");
        assert!(req.ends_with(r#"{"bundle":"/b"}"#), "the release names the bundle: {req}");
    }

    #[test]
    fn poststop_tolerates_a_missing_daemon_but_not_an_error() {
        let state = parse_state(POSTSTOP_STATE.as_bytes()).expect("parses");
        let out =
            run_hook(Phase::Poststop, &state, &Client::new("/nonexistent/t.sock"), HOOK_DEADLINE)
                .expect("ok");
        assert!(
            matches!(&out, HookOutcome::ReleaseDeferred(m) if m.contains("cannot reach tesserad")),
            "{out:?}"
        );
        assert_eq!(
            hook_main_with(
                argv("poststop"),
                POSTSTOP_STATE.as_bytes(),
                Path::new("/nonexistent/t.sock")
            ),
            0
        );
        let (_d, sock, _h) = serve_once(
            "HTTP/1.1 500 Internal\r\ncontent-length: 41\r\n\r\n{\"code\":\"internal\",\"message\":\"disk full\"}",
        );
        assert_eq!(hook_main_with(argv("poststop"), POSTSTOP_STATE.as_bytes(), &sock), 1);
    }
}
