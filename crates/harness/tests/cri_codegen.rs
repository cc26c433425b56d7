//! The checked-in CRI code (`src/cri/runtime.v1.rs`) is what tonic-prost-build makes of
//! `proto/runtime/v1/api.proto`, so nobody needs protoc to build the harness and nobody
//! edits generated code by hand.
//!
//! Regenerate after changing the proto or the generator settings:
//! `TESSERA_REGENERATE_PROTO=1 cargo test -p tessera-harness --test cri_codegen`.
//! Without protoc (`apt-get install protobuf-compiler`, or `$PROTOC`) the check is skipped
//! with the reason printed.

use std::path::{Path, PathBuf};
use std::process::Command;

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
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

/// Generates the client code into a fresh dir and returns the text of `runtime.v1.rs`.
fn generate(protoc: &Path) -> String {
    let out = tempfile::tempdir().expect("temp dir for generated code");
    std::env::set_var("PROTOC", protoc);
    let proto_dir = manifest_dir().join("proto");
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(true)
        // The harness connects its own unix-socket channel; no `connect(uri)` helper.
        .build_transport(false)
        .emit_rerun_if_changed(false)
        .out_dir(out.path())
        .compile_protos(&[proto_dir.join("runtime/v1/api.proto")], &[proto_dir])
        .expect("tonic-prost-build on proto/runtime/v1/api.proto");
    std::fs::read_to_string(out.path().join("runtime.v1.rs")).expect("read generated runtime.v1.rs")
}

#[test]
fn checked_in_cri_code_matches_the_proto() {
    let protoc = match protoc() {
        Ok(p) => p,
        Err(why) => {
            println!("skipped: protoc is needed to regenerate the CRI code ({why})");
            return;
        }
    };
    let generated = generate(&protoc);
    let checked_in_path = manifest_dir().join("src/cri/runtime.v1.rs");
    if std::env::var_os("TESSERA_REGENERATE_PROTO").is_some() {
        std::fs::write(&checked_in_path, &generated).expect("write src/cri/runtime.v1.rs");
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
            "{} is not what the proto generates (first difference: {first}); regenerate with \
             `TESSERA_REGENERATE_PROTO=1 cargo test -p tessera-harness --test cri_codegen`",
            checked_in_path.display()
        );
    }
}
