//! Checked-in generated gRPC code (the CRI client here, the kubelet device-plugin API in
//! `crates/device-plugin`) is what tonic-prost-build makes of its proto, so no build needs
//! protoc and nobody edits generated code by hand. One check for both: regenerate into a
//! temp dir and compare, or write it back with `TESSERA_REGENERATE_PROTO=1`. Without
//! protoc (`apt-get install protobuf-compiler`, or `$PROTOC`) the check is skipped with the
//! reason printed.

use std::path::{Path, PathBuf};
use std::process::Command;

/// One proto and the file its generated code is checked in as.
#[derive(Debug, Clone)]
pub struct Generated<'a> {
    /// The crate's directory (`env!("CARGO_MANIFEST_DIR")`); `proto/` is under it.
    pub manifest_dir: &'a Path,
    /// The proto, relative to `proto/`.
    pub proto: &'a str,
    /// The file tonic-prost-build writes for its package (`runtime.v1.rs`).
    pub output: &'a str,
    /// The checked-in copy, relative to the crate.
    pub checked_in: &'a str,
    /// Whether the server side is generated too.
    pub server: bool,
    /// The command that regenerates it, for messages.
    pub regenerate: &'a str,
}

/// The protoc prost-build would run, if it can run.
fn protoc() -> Result<PathBuf, String> {
    let p = std::env::var_os("PROTOC").map(PathBuf::from).unwrap_or_else(|| "protoc".into());
    match Command::new(&p).arg("--version").output() {
        Ok(o) if o.status.success() => Ok(p),
        Ok(o) => Err(format!("{} --version failed: {}", p.display(), o.status)),
        Err(e) => Err(format!("cannot run {}: {e}", p.display())),
    }
}

impl Generated<'_> {
    fn generate(&self, protoc: &Path) -> String {
        let out = tempfile::tempdir().expect("temp dir for generated code");
        std::env::set_var("PROTOC", protoc);
        let proto_dir = self.manifest_dir.join("proto");
        tonic_prost_build::configure()
            .build_server(self.server)
            .build_client(true)
            // Both users connect their own unix-socket channels: no `connect(uri)` helper.
            .build_transport(false)
            .emit_rerun_if_changed(false)
            .out_dir(out.path())
            .compile_protos(&[proto_dir.join(self.proto)], &[proto_dir])
            .unwrap_or_else(|e| panic!("tonic-prost-build on proto/{}: {e}", self.proto));
        let path = out.path().join(self.output);
        std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("read generated {}: {e}", path.display()))
    }

    /// Panics, naming the first differing line and the command that regenerates, when the
    /// checked-in file is not what the proto generates.
    pub fn check(&self) {
        let protoc = match protoc() {
            Ok(p) => p,
            Err(why) => {
                println!("skipped: protoc is needed to regenerate {} ({why})", self.checked_in);
                return;
            }
        };
        let generated = self.generate(&protoc);
        let checked_in_path = self.manifest_dir.join(self.checked_in);
        if std::env::var_os("TESSERA_REGENERATE_PROTO").is_some() {
            std::fs::write(&checked_in_path, &generated)
                .unwrap_or_else(|e| panic!("write {}: {e}", checked_in_path.display()));
            println!("regenerated {}", checked_in_path.display());
            return;
        }
        let checked_in = std::fs::read_to_string(&checked_in_path)
            .unwrap_or_else(|e| panic!("read {}: {e}", checked_in_path.display()));
        if checked_in != generated {
            let first = checked_in
                .lines()
                .zip(generated.lines())
                .position(|(a, b)| a != b)
                .map_or_else(|| "the line counts differ".to_owned(), |i| format!("line {}", i + 1));
            panic!(
                "{} is not what the proto generates (first difference: {first}); regenerate \
                 with `{}`",
                checked_in_path.display(),
                self.regenerate
            );
        }
    }
}
