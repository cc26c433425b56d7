//! What `tessera-runtime` and `tessera-hook` say about themselves: `--help` and
//! `--version`.
//!
//! The wrapper answers first and then lets runc answer (as nvidia-container-runtime does):
//! `tessera-runtime --version` prints its own version line and then runc's, so `docker
//! info` (which takes the last `... version ...` line and the `commit:` line) still shows
//! the runc underneath; `--help` prints what the wrapper does and then runc's own help, so
//! every runc flag stays documented. Verbs and their help (`create --help`, `help
//! create`) are runc's alone ([`crate::RuncInvocation::wrapper_query`]).

use std::ffi::{OsStr, OsString};
use std::io::Write;

pub use crate::args::WrapperQuery;

/// The wrapper's own help; runc's follows it.
pub fn runtime_help(version: &str) -> String {
    format!(
        "tessera-runtime {version}: a runc-compatible OCI runtime that gives GPU containers their share of \
         the node's GPUs (Tessera).

Usage: tessera-runtime [runc's global flags] VERB [runc's flags] [CONTAINER]

Every runc verb and flag is accepted and passed on. For `create` and `run` of a container
that asks for a GPU (the annotation `tessera.io/gpu`, else `TESSERA_GPU` in the process
environment), tesserad is asked for a grant, the grant is written into the bundle's
config.json, and runc runs it; any other container and verb goes to runc unchanged
(GPU device nodes and rules in a container without a grant are removed first).

Configuration: {config_arg} FILE (first argument), else ${config_env}, else the file
beside this program's path (argv[0] + `.toml`, for a link run by an engine that passes no
arguments), else {config} (socket, runc, hook, log, engine, quota_wait_s,
kubelet); the environment overrides the file:
  TESSERA_RUNC    the runc binary (default: `runc` on PATH)
  TESSERA_SOCKET  tesserad's API socket (default: {socket})
  TESSERA_HOOK    the prestart hook (default: tessera-hook beside this binary)

See docs/INSTALL.md. `tessera-runtime --version` prints this wrapper's version, then runc's.
"
    ,
        socket = tessera_api::DEFAULT_SOCKET,
        config_arg = crate::config::CONFIG_ARG,
        config_env = crate::config::CONFIG_ENV,
        config = crate::config::DEFAULT_CONFIG,
    )
}

/// The hook's help.
pub fn hook_help(version: &str) -> String {
    format!(
        "tessera-hook {version}: the OCI hook tessera-runtime writes into GPU containers' config.json.

Usage: tessera-hook prestart|poststop   (runc runs it, with the OCI state JSON on stdin)

  prestart   confirm the container's grant with tesserad (its pid and bundle) and start
             metering; any failure exits 1 and runc fails the start
  poststop   give the grant back (written by earlier versions; tessera-runtime now
             releases itself once runc has removed the container)

Environment:
  TESSERA_SOCKET  tesserad's API socket (default: {socket})
",
        socket = tessera_api::DEFAULT_SOCKET
    )
}

/// `tessera-hook --help|-h|help` or `--version|-v|version` (argv\[1\], alone).
pub fn hook_query(args: &[OsString]) -> Option<WrapperQuery> {
    if args.len() != 2 {
        return None;
    }
    match args[1].to_str()?.trim_start_matches('-') {
        "help" | "h" => Some(WrapperQuery::Help),
        "version" | "v" => Some(WrapperQuery::Version),
        _ => None,
    }
}

/// Answer `query` for `tessera-runtime`: its own text on `out`, then runc's (`runc
/// --help` or `runc --version`, run as a child with the same stdout). Returns the exit
/// code: runc's, or 1 (with the reason on stderr) when runc cannot be run.
pub fn runtime_answer(query: WrapperQuery, version: &str, runc: &OsStr) -> i32 {
    let mut out = std::io::stdout().lock();
    let flag = match query {
        WrapperQuery::Help => {
            let _ = write!(out, "{}", runtime_help(version));
            let _ = writeln!(out, "\nrunc's own help (`{}`):\n", runc.to_string_lossy());
            "--help"
        }
        WrapperQuery::Version => {
            let _ = writeln!(out, "tessera-runtime version {version}");
            "--version"
        }
    };
    let _ = out.flush();
    drop(out);
    match std::process::Command::new(runc).arg(flag).status() {
        Ok(status) => status.code().unwrap_or(1),
        Err(e) => {
            eprintln!(
                "tessera-runtime: cannot run runc `{}` (set TESSERA_RUNC): {e}",
                tessera_api::untrusted(&runc.to_string_lossy())
            );
            1
        }
    }
}

/// Answer `query` for `tessera-hook`. Returns the exit code.
pub fn hook_answer(query: WrapperQuery, version: &str) -> i32 {
    match query {
        WrapperQuery::Help => print!("{}", hook_help(version)),
        WrapperQuery::Version => println!("tessera-hook version {version}"),
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<OsString> {
        std::iter::once("tessera-hook").chain(s.split_whitespace()).map(OsString::from).collect()
    }

    #[test]
    fn the_hook_answers_help_and_version_alone() {
        assert_eq!(hook_query(&argv("--help")), Some(WrapperQuery::Help));
        assert_eq!(hook_query(&argv("-h")), Some(WrapperQuery::Help));
        assert_eq!(hook_query(&argv("help")), Some(WrapperQuery::Help));
        assert_eq!(hook_query(&argv("--version")), Some(WrapperQuery::Version));
        assert_eq!(hook_query(&argv("-v")), Some(WrapperQuery::Version));
        for phase in ["prestart", "poststop", "", "--help extra", "nonsense"] {
            assert_eq!(hook_query(&argv(phase)), None, "{phase:?}");
        }
    }

    #[test]
    fn the_help_names_what_an_operator_sets() {
        let h = runtime_help("9.9.9");
        for want in [
            "tessera-runtime 9.9.9",
            "TESSERA_RUNC",
            "TESSERA_SOCKET",
            "TESSERA_HOOK",
            crate::config::DEFAULT_CONFIG,
        ] {
            assert!(h.contains(want), "{want} missing from:\n{h}");
        }
        assert!(hook_help("9.9.9").contains("prestart|poststop"));
    }
}
