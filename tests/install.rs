//! Issue 14, items 7 and 8: Tessera as a node component — the policy reloaded by SIGHUP
//! and `tessera policy reload`, the binaries' own `--help`/`--version`, unknown ids
//! reported as unknown, the systemd units (`systemd-analyze verify`), the set of binaries
//! `cargo install` puts on a node, shell completions and man pages.

// Integration-test crates: clippy counts their helper functions as non-test code, so
// `allow-unwrap-in-tests` (clippy.toml) does not reach them; a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use tessera_harness::node::*;
use tessera_harness::*;

/// examples/policy.json with its version set to `version`, written to `path`.
fn write_policy(path: &Path, version: u64) {
    let text = std::fs::read_to_string(repo("examples/policy.json")).unwrap();
    let mut doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    doc["version"] = version.into();
    std::fs::write(path, serde_json::to_vec_pretty(&doc).unwrap()).unwrap();
}

fn policy_version(node: &Node) -> u64 {
    node.client().status().expect("status").policy.version
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn sighup_and_tessera_policy_reload_read_the_file_again_and_a_broken_one_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policy.json");
    write_policy(&file, 10);
    let mut node = Node::start_with(NodeOptions { policy: file.clone(), ..NodeOptions::default() });
    assert_eq!(policy_version(&node), 10);
    let pid = nix::unistd::Pid::from_raw(node.daemon.pid() as i32);
    let hup = || nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).unwrap();

    // SIGHUP: the new version is in force, and the daemon lives on.
    write_policy(&file, 11);
    hup();
    assert!(
        wait_for(|| policy_version(&node) == 11, Duration::from_secs(10)),
        "SIGHUP did not reload the policy:\n{}",
        node.daemon.stderr()
    );
    let status = node.client().status().unwrap();
    assert_eq!(status.policy.source, format!("file:{}", file.display()));

    // A broken file: the old policy stays, the error is logged with the file's JSON path.
    let text_of = std::fs::read_to_string(&file).unwrap();
    std::fs::write(&file, text_of.replacen("\"version\": 11", "\"version\": \"twelve\"", 1))
        .unwrap();
    hup();
    assert!(
        wait_for(
            || node.daemon.stderr().contains("policy reload refused"),
            Duration::from_secs(10)
        ),
        "no reload error logged:\n{}",
        node.daemon.stderr()
    );
    let log = node.daemon.stderr();
    let line = log.lines().rev().find(|l| l.contains("policy reload refused")).unwrap();
    assert!(line.contains("version") && line.contains("unchanged"), "{line}");
    assert_eq!(policy_version(&node), 11, "the old policy stays in force");
    assert!(node.daemon.is_running(), "SIGHUP must never stop tesserad");

    // The same over the API: the error comes back to the operator, non-zero exit.
    let out = node.cli(&["policy", "reload"]);
    assert!(!out.status.success(), "{}", text(&out.stdout));
    let err = text(&out.stderr);
    assert!(err.contains("400") && err.contains("policy.json"), "{err}");
    assert!(err.contains("the policy in force is unchanged"), "{err}");
    assert_eq!(policy_version(&node), 11);

    // Fixed: `tessera policy reload` puts it in force and says so.
    write_policy(&file, 12);
    let out = node.cli(&["policy", "reload"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let said = text(&out.stdout);
    assert!(said.contains("policy version 12 in force (was 11)"), "{said}");
    assert_eq!(policy_version(&node), 12);
    // Again without a change: nothing changes, and that is said too.
    let out = node.cli(&["policy", "reload"]);
    assert!(text(&out.stdout).contains("unchanged, policy version 12"), "{out:?}");
}

#[test]
fn an_unknown_device_uuid_is_reported_unknown_not_free() {
    let node = Node::start();
    let out = node.cli(&["device", "unquarantine", "GPU-nope"]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("404") && err.contains("unknown device GPU-nope"), "{err}");
    assert!(!err.contains("free"), "{err}");

    // A real, free GPU is still "not quarantined (free)".
    let gpu = node.client().status().unwrap().gpus[0].uuid.clone();
    let out = node.cli(&["device", "unquarantine", &gpu]);
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("409") && err.contains("is not quarantined (free)"), "{err}");

    // Not a UUID at all: refused before anything goes into a URL.
    let out = node.cli(&["device", "unquarantine", "../status"]);
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("not a device UUID"), "{out:?}");

    // An unknown container id is unknown too.
    let err = node.client().allocation("no-such-container").unwrap_err();
    assert_eq!(err.api_error().map(|e| e.code), Some(tessera_api::ErrorCode::NotFound), "{err}");
}

#[test]
fn the_runtime_and_the_hook_answer_help_and_version_themselves() {
    let runtime = |args: &[&str], runc: &str| {
        run_cmd(Command::new(tessera_runtime()).args(args).env("TESSERA_RUNC", runc))
    };
    // --version: the wrapper's line, then runc's (what `docker info` reads).
    let out = runtime(&["--version"], RUNC);
    assert!(out.status.success(), "{out:?}");
    let v = text(&out.stdout);
    let ours = v.find(&format!("tessera-runtime version {}", env!("CARGO_PKG_VERSION")));
    let runc = v.find("runc version");
    assert!(ours.is_some() && runc.is_some() && ours < runc, "{v}");
    assert!(v.contains("commit:"), "{v}");

    // --help: what the wrapper does, then runc's own help.
    for flag in ["--help", "-h", "help"] {
        let out = runtime(&[flag], RUNC);
        assert!(out.status.success(), "{flag}: {out:?}");
        let h = text(&out.stdout);
        assert!(h.contains("a runc-compatible OCI runtime"), "{flag}: {h}");
        assert!(h.contains("TESSERA_SOCKET") && h.contains("runc's own help"), "{h}");
        assert!(h.contains("runc - Open Container Initiative runtime"), "{flag}: {h}");
    }
    // A verb's help is runc's alone.
    let out = runtime(&["create", "--help"], RUNC);
    assert!(!text(&out.stdout).contains("a runc-compatible OCI runtime"), "{out:?}");
    // No runc: the wrapper's answer, then the reason, exit 1.
    let out = runtime(&["--version"], "/nonexistent/runc");
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stdout).contains("tessera-runtime version"));
    assert!(text(&out.stderr).contains("cannot run runc `/nonexistent/runc`"), "{out:?}");

    for flag in ["--help", "-h", "help"] {
        let out = run_cmd(Command::new(tessera_hook()).arg(flag));
        assert!(out.status.success(), "{flag}: {out:?}");
        assert!(text(&out.stdout).contains("tessera-hook prestart|poststop"), "{out:?}");
    }
    let out = run_cmd(Command::new(tessera_hook()).arg("--version"));
    assert!(out.status.success());
    assert_eq!(
        text(&out.stdout).trim(),
        format!("tessera-hook version {}", env!("CARGO_PKG_VERSION"))
    );
    // A phase it does not know is still an error.
    let out = run_cmd(Command::new(tessera_hook()).arg("prestop"));
    assert!(!out.status.success());
}

/// The unit files with `/usr/local/bin/` pointed at the binaries under test (verify
/// checks that every ExecStart binary exists and is executable).
fn units_for_verify(dir: &Path) -> Vec<std::path::PathBuf> {
    let bins = format!("{}/", bin_dir().display());
    ["tesserad.service", "tessera-coordinator.service"]
        .iter()
        .map(|name| {
            let unit = std::fs::read_to_string(repo(&format!("packaging/systemd/{name}"))).unwrap();
            assert!(unit.contains("ExecStart=/usr/local/bin/"), "{name}: installed path");
            let path = dir.join(name);
            std::fs::write(&path, unit.replace("/usr/local/bin/", &bins)).unwrap();
            path
        })
        .collect()
}

#[test]
fn the_systemd_units_verify_and_name_only_flags_the_binaries_have() {
    let Ok(version) = Command::new("systemd-analyze").arg("--version").output() else {
        eprintln!("SKIPPED: systemd-analyze is not installed (apt-get install systemd)");
        return;
    };
    assert!(version.status.success());
    // The coordinator's binary is another package's: built by `cargo build --workspace`.
    let _ = (tesserad(), fresh_bin("tessera-coordinator"));
    let dir = tempfile::tempdir().unwrap();
    let units = units_for_verify(dir.path());
    let out = run_cmd(Command::new("systemd-analyze").arg("verify").arg("--man=no").args(&units));
    // verify exits 0 on unknown keys and bad values, and says so on stderr: both count.
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "systemd-analyze verify:\n{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );

    // Every flag in an ExecStart is one the binary accepts.
    for (unit, bin_name, sub) in [
        ("tesserad.service", "tesserad", None),
        ("tessera-coordinator.service", "tessera-coordinator", Some("serve")),
    ] {
        let text_of = std::fs::read_to_string(repo(&format!("packaging/systemd/{unit}"))).unwrap();
        let exec = text_of.lines().find_map(|l| l.strip_prefix("ExecStart=")).unwrap();
        let mut cmd = Command::new(bin(bin_name));
        cmd.args(sub).arg("--help");
        let help = text(&run_cmd(&mut cmd).stdout);
        for flag in exec.split_whitespace().filter(|w| w.starts_with("--")) {
            assert!(help.contains(&format!("{flag} ")), "{unit}: {bin_name} has no {flag}");
        }
    }
    // The policy reload is SIGHUP, and restarts leave the MPS control daemons running.
    let unit = std::fs::read_to_string(repo("packaging/systemd/tesserad.service")).unwrap();
    for line in ["ExecReload=/bin/kill -HUP $MAINPID", "KillMode=process", "Restart=on-failure"] {
        assert!(unit.lines().any(|l| l == line), "tesserad.service lacks {line}");
    }
    for dir in
        ["ConfigurationDirectory=tessera", "StateDirectory=tessera", "RuntimeDirectory=tessera"]
    {
        assert!(unit.lines().any(|l| l == dir), "tesserad.service lacks {dir}");
    }
}

/// What `cargo install --path .` puts on a node: exactly the node's four binaries, and no
/// test double (mps-double's fake nvidia-cuda-mps-control, the harness) among the root
/// package's normal or build dependencies. `cargo metadata` answers in about a second; a
/// real `cargo install` (docs/INSTALL.md) builds everything again.
#[test]
fn cargo_install_installs_the_node_binaries_and_no_test_double() {
    let out = run_cmd(
        Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .args(["metadata", "--format-version", "1", "--no-deps", "--offline"]),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let root = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "tessera")
        .expect("the root package");
    let bins: std::collections::BTreeSet<&str> = root["targets"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["kind"].as_array().unwrap().iter().any(|k| k == "bin"))
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    let want: std::collections::BTreeSet<&str> =
        ["tesserad", "tessera-runtime", "tessera-hook", "tessera"].into();
    assert_eq!(bins, want, "the binaries `cargo install --path .` installs");
    for dep in root["dependencies"].as_array().unwrap() {
        let name = dep["name"].as_str().unwrap();
        if matches!(name, "mps-double" | "tessera-harness") {
            assert_eq!(dep["kind"], "dev", "{name} must stay a dev-dependency: {dep}");
        }
    }
    // The test double's own package is never published or installed with Tessera.
    let double = meta["packages"].as_array().unwrap().iter().find(|p| p["name"] == "mps-double");
    assert_eq!(double.unwrap()["publish"], serde_json::json!([]), "mps-double: publish = false");
}

#[test]
fn completions_and_man_pages_come_from_the_cli_definitions() {
    let cli = |args: &[&str]| run_cmd(Command::new(tessera_cli()).args(args));
    for (shell, marker) in [
        ("bash", "complete -F _tessera"),
        ("zsh", "#compdef tessera"),
        ("fish", "complete -c tessera"),
    ] {
        let out = cli(&["completions", shell]);
        assert!(out.status.success(), "{shell}: {out:?}");
        let script = text(&out.stdout);
        assert!(script.contains(marker), "{shell}: {}", &script[..script.len().min(300)]);
        // Generated from the definitions: the newest subcommands are there.
        assert!(script.contains("reload") && script.contains("unquarantine"), "{shell}");
    }
    assert!(!cli(&["completions", "tcsh"]).status.success());

    let dir = tempfile::tempdir().unwrap();
    let out = cli(&["man", "--out", &dir.path().display().to_string()]);
    assert!(out.status.success(), "{out:?}");
    let page = std::fs::read_to_string(dir.path().join("tessera-policy-reload.1")).unwrap();
    assert!(page.starts_with(".ie") || page.contains(".TH"), "roff: {page}");
    assert!(page.contains("SIGHUP"), "{page}");
    for name in ["tessera.1", "tessera-device-unquarantine.1", "tessera-completions.1"] {
        assert!(dir.path().join(name).is_file(), "{name}");
    }
}

#[test]
fn a_sighup_during_start_up_is_not_the_daemons_end() {
    // A tesserad whose state dir's lock is held by no live tesserad (a child of the last
    // one, between fork and exec) waits for it up to 10 s: a start-up that is slow for a
    // while. A `systemctl reload` then must not end it. (A live tesserad holding it is
    // said at once instead: tests/cli.rs.) Here the test holds the lock.
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    std::fs::create_dir_all(&state).unwrap();
    let lock = std::fs::File::create(state.join("tesserad.lock")).unwrap();
    lock.lock().unwrap();
    let mut second = std::process::Command::new(tesserad())
        .arg("--node")
        .arg(format!("sim:{}", repo("examples/nodes/h100x8.json").display()))
        .arg("--policy")
        .arg(repo("examples/policy.json"))
        .arg("--state-dir")
        .arg(&state)
        .arg("--socket")
        .arg(state.join("second.sock"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(700));
    let pid = nix::unistd::Pid::from_raw(second.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let alive = second.try_wait().unwrap().is_none();
    let _ = second.kill();
    let status = second.wait().unwrap();
    assert!(alive, "tesserad died of a SIGHUP during start-up: {status:?}");
}

/// Whether the ELF executable at `path` names a program interpreter (`PT_INTERP`): a
/// dynamically linked one does, a static one does not. A file that is no 64-bit
/// little-endian ELF executable, or whose program headers lie past its end, fails the test
/// naming it.
fn has_interpreter(path: &str) -> bool {
    let elf = std::fs::read(path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    let bytes = |at: usize, n: usize| -> &[u8] {
        elf.get(at..at.saturating_add(n))
            .unwrap_or_else(|| panic!("{path}: truncated ELF file ({} bytes)", elf.len()))
    };
    assert_eq!(bytes(0, 4), b"\x7fELF", "{path} is not an ELF file");
    assert_eq!(bytes(4, 2), [2, 1], "{path} is not a 64-bit little-endian ELF file");
    let u16_at = |o: usize| u16::from_le_bytes(bytes(o, 2).try_into().unwrap()) as usize;
    let phoff = u64::from_le_bytes(bytes(0x20, 8).try_into().unwrap());
    let phoff = usize::try_from(phoff).unwrap_or(usize::MAX);
    let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
    assert!(phentsize >= 4 && phnum > 0, "{path} has no program headers");
    (0..phnum).any(|i| {
        let at = phoff.saturating_add(i * phentsize);
        u32::from_le_bytes(bytes(at, 4).try_into().unwrap()) == 3 // PT_INTERP
    })
}

/// [`has_interpreter`] on a cut-off executable (an install interrupted mid-copy) names the
/// file and what is wrong with it, not a slice index.
#[test]
#[should_panic(expected = "truncated ELF file (40 bytes)")]
fn the_static_check_names_a_truncated_executable() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cut = dir.path().join("tessera-runtime");
    let elf = std::fs::read("/bin/true").expect("read /bin/true");
    std::fs::write(&cut, &elf[..40]).expect("write the cut-off copy");
    has_interpreter(cut.to_str().expect("UTF-8"));
}

/// scripts/test.sh runs the suite on the shims as scripts/install.sh installs them: linked
/// static (`scripts/static-shims.sh --dev target/shipped`, `TESSERA_BIN_DIR`), and the rest
/// as cargo built it. A `cargo test` without the script runs cargo's dynamic build and says
/// so here.
#[test]
fn the_suite_runs_the_shims_linked_static_as_installed() {
    if std::env::var_os("TESSERA_BIN_DIR").is_none() {
        eprintln!(
            "TESSERA_BIN_DIR unset: this run tests cargo's dynamic shims, not the installed ones"
        );
        return;
    }
    for bin in [tessera_runtime(), tessera_hook()] {
        assert!(
            !has_interpreter(bin),
            "{bin} is linked dynamically; scripts/install.sh installs it static"
        );
    }
    assert!(has_interpreter(tesserad()), "tesserad must stay dynamic: it dlopens NVML");
}

/// A `cargo` for scripts/static-shims.sh: "builds" each `--bin NAME` by copying
/// `$FAKE_BINS/NAME` into `$CARGO_TARGET_DIR/<profile>/` and printing cargo's JSON artifact
/// line; fails as cargo does where `$FAKE_BINS/NAME.fail` exists.
const FAKE_CARGO: &str = r#"#!/bin/sh
set -e
out="$CARGO_TARGET_DIR/debug"
for a in "$@"; do
    case "$a" in --release|release) out="$CARGO_TARGET_DIR/release" ;; esac
done
mkdir -p "$out"
want=
rustc=
for a in "$@"; do
    case "$rustc$a" in 1--*) echo "rustc: Unrecognized option: '$a'" >&2; exit 101 ;; esac
    [ "$a" = -- ] && rustc=1
    if [ -n "$want" ]; then
        if [ -e "$FAKE_BINS/$a.fail" ]; then echo "error: could not compile $a" >&2; exit 101; fi
        cp "$FAKE_BINS/$a" "$out/$a"
        echo "{\"reason\":\"compiler-artifact\",\"executable\":\"$out/$a\",\"fresh\":false}"
    fi
    want=
    [ "$a" = --bin ] && want=1
done
exit 0
"#;

/// Runs scripts/static-shims.sh ARGS from `cwd` with [`FAKE_CARGO`] building the node's
/// binaries from `bins` (NAME: the file it installs, or `None` for a build that fails).
fn static_shims(cwd: &Path, args: &[&str], bins: &[(&str, Option<&str>)]) -> std::process::Output {
    let fake = tempfile::tempdir().expect("tempdir");
    let (path_dir, bins_dir, target) =
        (fake.path().join("path"), fake.path().join("bins"), fake.path().join("target"));
    for d in [&path_dir, &bins_dir] {
        std::fs::create_dir(d).expect("fake dir");
    }
    let cargo = path_dir.join("cargo");
    std::fs::write(&cargo, FAKE_CARGO).expect("fake cargo");
    std::fs::set_permissions(&cargo, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod fake cargo");
    for (name, from) in bins {
        match from {
            Some(f) => std::fs::copy(f, bins_dir.join(name)).map(|_| ()),
            None => std::fs::write(bins_dir.join(format!("{name}.fail")), ""),
        }
        .expect("fake binary");
    }
    let path = format!("{}:{}", path_dir.display(), std::env::var("PATH").unwrap_or_default());
    run_cmd(
        Command::new(repo_root().join("scripts/static-shims.sh"))
            .args(args)
            .current_dir(cwd)
            .env("PATH", path)
            .env("FAKE_BINS", &bins_dir)
            .env("CARGO_TARGET_DIR", &target),
    )
}

/// The names in `dir`, sorted.
fn names_in(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|r| r.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// scripts/static-shims.sh (scripts/install.sh's step) installs the node's binaries all or
/// none: a shim that fails to build, or comes out dynamic, leaves DIR as it was (no new
/// tesserad beside old shims, no dynamic shim), and a relative DIR is the caller's.
#[test]
fn static_shims_installs_all_or_nothing_and_never_a_dynamic_shim() {
    // busybox is linked static, true dynamic.
    let (stat, dynamic) = ("/bin/busybox", "/bin/true");
    let cwd = tempfile::tempdir().expect("tempdir");
    let node = |shim_hook: Option<&'static str>| {
        [
            ("tesserad", Some(dynamic)),
            ("tessera", Some(dynamic)),
            ("tessera-runtime", Some(stat)),
            ("tessera-hook", shim_hook),
        ]
    };
    for (hook, why) in [(None, "could not compile"), (Some(dynamic), "not a static executable")] {
        let dir = cwd.path().join("failed");
        let out = static_shims(cwd.path(), &[dir.to_str().expect("UTF-8")], &node(hook));
        out.assert_failure("static-shims with a bad tessera-hook");
        assert!(out.stderr_str().contains(why), "{}", out.stderr_str());
        assert_eq!(
            names_in(&dir),
            Vec::<String>::new(),
            "a failed static-shims.sh installed some binaries ({why})"
        );
    }
    let out = static_shims(cwd.path(), &["bin"], &node(Some(stat)));
    out.assert_success("static-shims");
    assert_eq!(
        names_in(&cwd.path().join("bin")),
        ["tessera", "tessera-hook", "tessera-runtime", "tesserad"],
        "DIR relative to the caller's directory: {}",
        out.stderr_str()
    );
}
