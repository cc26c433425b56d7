//! `tessera-runtime`: a runc-compatible wrapper that gives GPU containers their share.
//! See the `runtime_hook` crate.

fn main() {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // `--help` and `--version`: the wrapper's own answer, then runc's.
    if let Some(code) = about(args.clone()) {
        std::process::exit(code);
    }
    std::process::exit(runtime_hook::runtime_main(args));
}

/// Answers `--help` and `--version` (after an optional `--tessera-config FILE`), with the
/// runc the wrapper would run; `None` for everything else.
fn about(mut args: Vec<std::ffi::OsString>) -> Option<i32> {
    use runtime_hook::config::{take_config_arg, ConfigSource};
    let file = take_config_arg(&mut args).ok()?;
    let query = runtime_hook::parse_runc_args(args.get(1..)?).ok()?.wrapper_query()?;
    // A broken configuration file is runtime_main's to report; help still answers.
    let config = ConfigSource::choose_beside(file, args.first().map(|a| a.as_os_str()))
        .load()
        .unwrap_or_default();
    let runc =
        runtime_hook::RuntimeEnv::from_process(&config).map_or_else(|_| "runc".into(), |e| e.runc);
    Some(runtime_hook::about::runtime_answer(query, env!("CARGO_PKG_VERSION"), &runc))
}
