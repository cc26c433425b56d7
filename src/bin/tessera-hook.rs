//! `tessera-hook prestart|poststop`: the OCI hook tessera-runtime writes into GPU
//! containers' config.json. See the `runtime_hook` crate.

fn main() {
    let code = runtime_hook::hook_main(std::env::args_os().collect(), std::io::stdin().lock());
    std::process::exit(code);
}
