//! `tessera-runtime`: a runc-compatible wrapper that gives GPU containers their share.
//! See the `runtime_hook` crate.

fn main() {
    std::process::exit(runtime_hook::runtime_main(std::env::args_os().collect()));
}
