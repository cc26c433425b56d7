//! The checked-in kubelet device-plugin code (`src/v1beta1.rs`) is what tonic-prost-build
//! makes of `proto/deviceplugin/v1beta1/api.proto` ([`tessera_harness::codegen`]), so no
//! node build needs protoc.

#[test]
fn checked_in_device_plugin_code_matches_the_proto() {
    tessera_harness::codegen::Generated {
        manifest_dir: std::path::Path::new(env!("CARGO_MANIFEST_DIR")),
        proto: "deviceplugin/v1beta1/api.proto",
        output: "v1beta1.rs",
        checked_in: "src/v1beta1.rs",
        server: true,
        regenerate: "TESSERA_REGENERATE_PROTO=1 cargo test -p device-plugin --test codegen",
    }
    .check();
}
