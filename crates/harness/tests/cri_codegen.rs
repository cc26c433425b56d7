//! The checked-in CRI code (`src/cri/runtime.v1.rs`) is what tonic-prost-build makes of
//! `proto/runtime/v1/api.proto` ([`tessera_harness::codegen`]).

#[test]
fn checked_in_cri_code_matches_the_proto() {
    tessera_harness::codegen::Generated {
        manifest_dir: std::path::Path::new(env!("CARGO_MANIFEST_DIR")),
        proto: "runtime/v1/api.proto",
        output: "runtime.v1.rs",
        checked_in: "src/cri/runtime.v1.rs",
        server: false,
        regenerate: "TESSERA_REGENERATE_PROTO=1 cargo test -p tessera-harness --test cri_codegen",
    }
    .check();
}
