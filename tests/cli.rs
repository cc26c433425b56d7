//! The `tessera` command line and tesserad as an operator meets them (issue 29's
//! papercuts): output into a closed pipe ends quietly, a failed connection says what to
//! check, `--socket` only where it applies, internal commands out of the help, `version`
//! and `cdi list`, `setup` creating no directory, the state dir and its databases root's
//! alone, and a second tesserad on the same state dir told at once.

use std::os::unix::fs::PermissionsExt as _;
use std::os::unix::process::ExitStatusExt as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tessera_harness::node::{repo, Node};
use tessera_harness::*;

/// Runs `tessera --socket S ARGS` with stdout a pipe whose reading end is already closed
/// (what `| head -1` leaves once head has its line): it must end quietly, never panic.
fn into_closed_pipe(node: &Node, args: &[&str]) {
    let (read, write) = nix::unistd::pipe().expect("pipe");
    drop(read);
    let mut child = Command::new(tessera_cli())
        .arg("--socket")
        .arg(&node.socket)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::from(write))
        .stderr(Stdio::piped())
        .spawn()
        .expect("run tessera");
    let status = wait_child(&mut child, CMD_TIMEOUT).expect("wait").expect("ended in time");
    let mut stderr = Vec::new();
    std::io::Read::read_to_end(&mut child.stderr.take().expect("stderr"), &mut stderr)
        .expect("read");
    let out = std::process::Output { status, stdout: Vec::new(), stderr };
    let err = out.stderr_str();
    assert!(!err.contains("panicked"), "tessera {args:?} into a closed pipe:\n{err}");
    assert!(
        out.status.success() || out.status.signal() == Some(libc::SIGPIPE),
        "tessera {args:?}: {:?}\n{err}",
        out.status
    );
}

#[test]
fn the_cli_ends_quietly_into_a_closed_pipe_and_says_what_to_check() {
    let node = Node::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let daemon_json = dir.path().join("daemon.json");
    let rt = dir.path().join("runtime.toml");
    std::fs::write(&rt, "").expect("runtime config");
    let (rt_s, dj) =
        (rt.to_string_lossy().into_owned(), daemon_json.to_string_lossy().into_owned());
    for args in [
        &["usage", "--json"][..],
        &["status"],
        &["policy", "revoke-check", "--json"],
        &["cdi", "list"],
        &["setup", "docker", "--dry-run", "--config", &dj, "--runtime-config", &rt_s],
    ] {
        into_closed_pipe(&node, args);
    }

    // A connection that fails says what to check.
    let out =
        run_cmd(Command::new(tessera_cli()).args(["--socket", "/nonexistent/t.sock", "status"]));
    out.assert_failure("no tesserad");
    assert!(out.stderr_str().contains("is tesserad running?"), "{}", out.stderr_str());

    // --socket only where a tesserad is asked; setup's help does not show it.
    let out = run_cmd(
        Command::new(tessera_cli())
            .args(["--socket", "/x.sock", "policy", "validate"])
            .arg(repo("examples/policy.json")),
    );
    out.assert_failure("--socket with policy validate");
    assert!(
        out.stderr_str().contains("does not apply to `tessera policy validate`"),
        "{}",
        out.stderr_str()
    );
    let help = run_cmd(Command::new(tessera_cli()).args(["setup", "docker", "--help"]));
    assert!(!help.stdout_str().contains("--socket"), "{}", help.stdout_str());
    // Internal commands are not in the help; version and cdi list are.
    let help = run_cmd(Command::new(tessera_cli()).arg("--help")).stdout_str();
    let commands: Vec<&str> =
        help.lines().filter_map(|l| l.strip_prefix("  ")?.split_whitespace().next()).collect();
    assert!(!commands.contains(&"scrub") && !commands.contains(&"gpu-bench"), "{help}");
    assert!(help.contains("version") && help.contains("doctor"), "{help}");
    let v = node.cli(&["version"]);
    v.assert_success("tessera version");
    assert!(
        v.stdout_str().starts_with(&format!("tessera {}\n", env!("CARGO_PKG_VERSION")))
            && v.stdout_str().contains("node sim-h100"),
        "{}",
        v.stdout_str()
    );
    let list = node.cli(&["cdi", "list"]);
    list.assert_success("tessera cdi list");
    assert!(
        list.stdout_str()
            .lines()
            .any(|l| l.starts_with("tessera.io/gpu=gpu ") && l.ends_with(" gpu=1")),
        "{}",
        list.stdout_str()
    );

    // setup writes only into a directory that exists.
    let missing = dir.path().join("no-docker/daemon.json");
    let out = run_cmd(
        Command::new(tessera_cli())
            .args(["setup", "docker", "--config"])
            .arg(&missing)
            .args(["--runtime-config", &rt_s]),
    );
    out.assert_failure("setup into a missing directory");
    assert!(out.stderr_str().contains("is docker installed here?"), "{}", out.stderr_str());
    assert!(!dir.path().join("no-docker").exists(), "setup created the directory");
}

#[test]
fn the_state_dir_is_roots_alone_and_a_second_tesserad_is_told_at_once() {
    let node = Node::start();
    let mode =
        |p: &std::path::Path| std::fs::metadata(p).expect("stat").permissions().mode() & 0o777;
    assert_eq!(mode(&node.state), 0o700, "{}", node.state.display());
    for db in ["state.db", "ledger.db"] {
        assert_eq!(mode(&node.state.join(db)), 0o600, "{db}");
    }
    let other = node.fx.socket_path("d2.sock");
    let started = Instant::now();
    let out = output_timeout(
        Command::new(tesserad())
            .arg("--node")
            .arg(format!("sim:{}", repo("examples/nodes/h100x8.json").display()))
            .arg("--policy")
            .arg(repo("examples/policy.json"))
            .arg("--state-dir")
            .arg(&node.state)
            .arg("--socket")
            .arg(&other),
        Duration::from_secs(30),
    )
    .expect("run tesserad");
    out.assert_failure("a second tesserad on the same state dir");
    assert!(
        out.stderr_str()
            .contains(&format!("in use by another tesserad (pid {})", node.daemon.pid())),
        "{}",
        out.stderr_str()
    );
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    assert!(std::fs::symlink_metadata(&other).is_err(), "the second one bound a socket");
}
