//! Container images without a registry: an OCI image-layout archive built here from the
//! static busybox (the same files as [`crate::Rootfs::busybox`]), which `ctr images import`
//! loads into containerd's `k8s.io` namespace, where the CRI plugin finds it.
//!
//! One uncompressed layer shared by two images:
//! - [`BUSYBOX_IMAGE`]: `sh` by default, for application containers;
//! - [`PAUSE_IMAGE`]: the sandbox image, a shell that sleeps until it is killed (or exits 0
//!   on SIGTERM/SIGINT), as the `pause` image does.
//!
//! The archive is built once per test process (a few MB, a few milliseconds) and written
//! into each fixture that imports it.

use std::fs;
use std::path::Path;
use std::sync::OnceLock;

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::{APPLETS, BUSYBOX, DEFAULT_PATH_ENV};

/// The image application containers run (`sh` by default; `/bin` holds the busybox
/// applets the bundles' rootfs has).
pub const BUSYBOX_IMAGE: &str = "tessera.test/busybox:1";
/// The sandbox ("pause") image the CRI fixture configures as `sandbox_image`.
pub const PAUSE_IMAGE: &str = "tessera.test/pause:1";

const MEDIA_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const MEDIA_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const MEDIA_LAYER: &str = "application/vnd.oci.image.layer.v1.tar";
/// What the pause image runs: sleep until killed, exit 0 on SIGTERM/SIGINT.
const PAUSE_SCRIPT: &str = "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done";

/// The OCI image-layout archive (a tar) holding [`BUSYBOX_IMAGE`] and [`PAUSE_IMAGE`].
pub fn image_archive() -> &'static [u8] {
    static ARCHIVE: OnceLock<Vec<u8>> = OnceLock::new();
    ARCHIVE.get_or_init(build_archive)
}

/// Writes [`image_archive`] to `path`.
pub fn write_image_archive(path: &Path) {
    fs::write(path, image_archive())
        .unwrap_or_else(|e| panic!("write image archive {}: {e}", path.display()));
}

fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

fn build_archive() -> Vec<u8> {
    let layer = busybox_layer();
    let layer_digest = format!("sha256:{}", sha256_hex(&layer));
    let mut blobs: Vec<(String, Vec<u8>)> = vec![(layer_digest.clone(), layer.clone())];
    let mut manifests = Vec::new();
    let images: [(&str, Value); 2] = [
        (BUSYBOX_IMAGE, json!({"Env": [DEFAULT_PATH_ENV], "Cmd": ["sh"], "WorkingDir": "/"})),
        (
            PAUSE_IMAGE,
            json!({
                "Env": [DEFAULT_PATH_ENV],
                "Entrypoint": ["/bin/sh", "-c", PAUSE_SCRIPT],
                "WorkingDir": "/"
            }),
        ),
    ];
    for (name, config) in images {
        let config = json!({
            "architecture": "amd64",
            "os": "linux",
            "config": config,
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
            "history": [{"created_by": "tessera-harness (busybox-static)"}]
        });
        let config = serde_json::to_vec(&config).expect("serialize image config");
        let config_digest = format!("sha256:{}", sha256_hex(&config));
        let manifest = json!({
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": {"mediaType": MEDIA_CONFIG, "digest": config_digest, "size": config.len()},
            "layers": [{"mediaType": MEDIA_LAYER, "digest": layer_digest, "size": layer.len()}]
        });
        let manifest = serde_json::to_vec(&manifest).expect("serialize image manifest");
        let manifest_digest = format!("sha256:{}", sha256_hex(&manifest));
        let tag = name.rsplit_once(':').map_or("latest", |(_, t)| t);
        manifests.push(json!({
            "mediaType": MEDIA_MANIFEST,
            "digest": manifest_digest,
            "size": manifest.len(),
            "annotations": {
                "io.containerd.image.name": name,
                "org.opencontainers.image.ref.name": tag
            },
            "platform": {"architecture": "amd64", "os": "linux"}
        }));
        blobs.push((config_digest, config));
        blobs.push((manifest_digest, manifest));
    }
    let index = json!({"schemaVersion": 2, "manifests": manifests});

    let mut tar = Tar::default();
    tar.file("oci-layout", 0o644, br#"{"imageLayoutVersion":"1.0.0"}"#);
    tar.file("index.json", 0o644, &serde_json::to_vec(&index).expect("serialize index"));
    tar.dir("blobs", 0o755);
    tar.dir("blobs/sha256", 0o755);
    for (digest, data) in &blobs {
        let hex = digest.strip_prefix("sha256:").expect("sha256 digest");
        tar.file(&format!("blobs/sha256/{hex}"), 0o644, data);
    }
    tar.finish()
}

/// The rootfs of [`crate::Rootfs::busybox`] as a tar layer.
fn busybox_layer() -> Vec<u8> {
    let busybox = fs::read(BUSYBOX).unwrap_or_else(|e| panic!("read {BUSYBOX}: {e}"));
    let mut tar = Tar::default();
    for d in ["bin", "dev", "proc", "sys", "etc", "root"] {
        tar.dir(d, 0o755);
    }
    tar.dir("tmp", 0o1777);
    tar.file("bin/busybox", 0o755, &busybox);
    for applet in APPLETS {
        tar.symlink(&format!("bin/{applet}"), "busybox");
    }
    tar.file(
        "etc/passwd",
        0o644,
        b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
    );
    tar.file("etc/group", 0o644, b"root:x:0:\nnogroup:x:65534:\n");
    tar.finish()
}

/// A minimal ustar writer: regular files, directories and symlinks, owned by root,
/// mtime 0, names under 100 bytes (all this module writes).
#[derive(Debug, Default)]
struct Tar {
    out: Vec<u8>,
}

impl Tar {
    fn header(&mut self, name: &str, mode: u32, size: usize, kind: u8, link: &str) {
        assert!(name.len() < 100 && link.len() < 100, "tar name too long: {name} -> {link}");
        let mut h = [0u8; 512];
        h[..name.len()].copy_from_slice(name.as_bytes());
        let octal = |h: &mut [u8; 512], at: usize, width: usize, v: u64| {
            let s = format!("{v:0w$o}", w = width - 1);
            h[at..at + width - 1].copy_from_slice(s.as_bytes());
        };
        octal(&mut h, 100, 8, u64::from(mode));
        octal(&mut h, 108, 8, 0); // uid
        octal(&mut h, 116, 8, 0); // gid
        octal(&mut h, 124, 12, size as u64);
        octal(&mut h, 136, 12, 0); // mtime
        h[148..156].copy_from_slice(b"        "); // checksum counts as spaces
        h[156] = kind;
        h[157..157 + link.len()].copy_from_slice(link.as_bytes());
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        h[265..269].copy_from_slice(b"root");
        h[297..301].copy_from_slice(b"root");
        let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
        let s = format!("{sum:06o}\0 ");
        h[148..156].copy_from_slice(s.as_bytes());
        self.out.extend_from_slice(&h);
    }

    fn file(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.header(name, mode, data.len(), b'0', "");
        self.out.extend_from_slice(data);
        let pad = (512 - data.len() % 512) % 512;
        self.out.resize(self.out.len() + pad, 0);
    }

    fn dir(&mut self, name: &str, mode: u32) {
        self.header(&format!("{name}/"), mode, 0, b'5', "");
    }

    fn symlink(&mut self, name: &str, target: &str) {
        self.header(name, 0o777, 0, b'2', target);
    }

    fn finish(mut self) -> Vec<u8> {
        self.out.resize(self.out.len() + 1024, 0);
        self.out
    }
}
