//! `tessera-hook prestart|poststop`: the OCI hook tessera-runtime writes into GPU
//! containers' config.json. See the `runtime_hook` crate.

fn main() {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if let Some(query) = runtime_hook::about::hook_query(&args) {
        std::process::exit(runtime_hook::about::hook_answer(query, env!("CARGO_PKG_VERSION")));
    }
    let code = runtime_hook::hook_main(args, std::io::stdin().lock());
    std::process::exit(code);
}
