//! `tessera sim`: the lab's command. Its code is the `lab` crate's (crates/lab), which no
//! node binary links (tests/deps.rs), so `tessera sim` runs `tessera-sim`, the lab's
//! binary, from the directory `tessera` itself is in (`cargo install --path crates/lab`
//! puts it beside `tessera`; docs/INSTALL.md). Its arguments, `--help` included, go to it
//! untouched.

use std::ffi::OsString;
use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::Command;

/// The lab's binary.
const SIM_BIN: &str = "tessera-sim";

/// Where `tessera-sim` must be: beside this executable (never looked up on `PATH`, so
/// `tessera sim` runs the lab built and installed with this `tessera`).
fn sim_bin() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("the path of tessera itself: {e}"))?;
    let dir = exe.parent().ok_or_else(|| format!("{}: no parent directory", exe.display()))?;
    Ok(dir.join(SIM_BIN))
}

/// Replaces this process with `tessera-sim ARGS`; returns only when that fails.
pub fn exec(args: Vec<OsString>) -> Result<(), String> {
    let bin = sim_bin()?;
    if !bin.is_file() {
        return Err(format!(
            "{} not found: `tessera sim` runs the lab's binary installed beside tessera \
             (`cargo install --path crates/lab --locked --root DIR`, or `cargo build -p lab --bin \
             {SIM_BIN}` in a checkout)",
            bin.display()
        ));
    }
    let err = Command::new(&bin).arg0("tessera sim").args(args).exec();
    Err(format!("running {}: {err}", bin.display()))
}
