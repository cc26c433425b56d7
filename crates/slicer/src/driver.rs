//! The host's NVIDIA user-space driver files a CUDA container needs (libcuda, NVML, the
//! PTX JIT, nvidia-smi, ...), found on the host and bind-mounted read-only into the
//! container at `/usr/local/nvidia/lib64` and `/usr/local/nvidia/bin` — the directories
//! NVIDIA's CUDA images already put on `LD_LIBRARY_PATH` and `PATH`. Nothing is written
//! into the container's rootfs and no `ldconfig` runs inside it (the incumbent's hook
//! does both, which is where its symlink CVEs lived); runc creates the mount targets with
//! its own rootfs-confined path resolution.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use tessera_api::BindMount;

/// Library name prefixes (sonames) of the driver's user-space part a CUDA workload uses.
pub const DRIVER_LIBS: &[&str] = &[
    "libcuda.so",
    "libcudadebugger.so",
    "libnvidia-ml.so",
    "libnvidia-ptxjitcompiler.so",
    "libnvidia-nvvm.so",
    "libnvidia-gpucomp.so",
    "libnvidia-allocator.so",
    "libnvidia-cfg.so",
    "libnvidia-opencl.so",
];

/// Driver utilities a container may run.
pub const DRIVER_BINS: &[&str] = &["nvidia-smi", "nvidia-debugdump"];

/// Where the libraries appear in the container.
pub const CONTAINER_LIB_DIR: &str = "/usr/local/nvidia/lib64";
/// Where the utilities appear in the container.
pub const CONTAINER_BIN_DIR: &str = "/usr/local/nvidia/bin";

/// `(soname, host path)` of every 64-bit x86 entry of `ldconfig -p` output.
pub fn parse_ldconfig(text: &str) -> Vec<(String, PathBuf)> {
    text.lines()
        .filter_map(|l| {
            let (left, path) = l.trim().split_once(" => ")?;
            let (name, flags) = left.split_once(' ')?;
            flags.contains("x86-64").then(|| (name.to_string(), PathBuf::from(path.trim())))
        })
        .collect()
}

/// The driver's bind mounts: for each driver library soname in `ldconfig` (first entry
/// wins, as the loader's cache order does), the host file it resolves to (symlinks
/// resolved on the host, so the container gets a regular file, never a link), mounted at
/// its soname under [`CONTAINER_LIB_DIR`]; and each driver utility found in `bin_dirs`.
/// Entries whose host file does not exist or is not a regular file are skipped.
pub fn driver_mounts(ldconfig: &[(String, PathBuf)], bin_dirs: &[PathBuf]) -> Vec<BindMount> {
    let mut libs: BTreeMap<&str, PathBuf> = BTreeMap::new();
    for (soname, path) in ldconfig {
        if !DRIVER_LIBS.iter().any(|p| soname.starts_with(p)) || libs.contains_key(soname.as_str())
        {
            continue;
        }
        if let Some(real) = regular_file(path) {
            libs.insert(soname, real);
        }
    }
    let mut out: Vec<BindMount> = libs
        .into_iter()
        .map(|(soname, real)| mount(&real, &format!("{CONTAINER_LIB_DIR}/{soname}")))
        .collect();
    for bin in DRIVER_BINS {
        if let Some(real) = bin_dirs.iter().find_map(|d| regular_file(&d.join(bin))) {
            out.push(mount(&real, &format!("{CONTAINER_BIN_DIR}/{bin}")));
        }
    }
    out
}

fn regular_file(p: &Path) -> Option<PathBuf> {
    let real = std::fs::canonicalize(p).ok()?;
    std::fs::metadata(&real).ok().filter(|m| m.is_file()).map(|_| real)
}

fn mount(source: &Path, destination: &str) -> BindMount {
    BindMount {
        source: source.display().to_string(),
        destination: destination.to_string(),
        read_only: true,
    }
}

/// Run the host's `ldconfig -p` and collect the driver mounts; an empty list if ldconfig
/// cannot run (a node without the driver's libraries gets device nodes only).
pub fn discover(ldconfig_bin: &Path, bin_dirs: &[PathBuf]) -> Vec<BindMount> {
    let out = std::process::Command::new(ldconfig_bin).arg("-p").env_clear().output();
    match out {
        Ok(o) if o.status.success() => {
            driver_mounts(&parse_ldconfig(&String::from_utf8_lossy(&o.stdout)), bin_dirs)
        }
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ldconfig_output_keeping_x86_64_only() {
        let text = "537 libs found in cache `/etc/ld.so.cache'\n\
            \tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1\n\
            \tlibcuda.so.1 (libc6) => /usr/lib/i386-linux-gnu/libcuda.so.1\n\
            \tlibz.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libz.so.1\n\
            garbage line\n";
        let e = parse_ldconfig(text);
        assert_eq!(e.len(), 2);
        assert_eq!(
            e[0],
            ("libcuda.so.1".to_string(), PathBuf::from("/usr/lib/x86_64-linux-gnu/libcuda.so.1"))
        );
    }

    #[test]
    fn mounts_resolve_links_on_the_host_and_skip_what_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("libcuda.so.560.35.03");
        std::fs::write(&real, b"elf").unwrap();
        std::os::unix::fs::symlink(&real, dir.path().join("libcuda.so.1")).unwrap();
        let bins = dir.path().join("bin");
        std::fs::create_dir_all(&bins).unwrap();
        std::fs::write(bins.join("nvidia-smi"), b"#!").unwrap();
        let entries = vec![
            ("libcuda.so.1".to_string(), dir.path().join("libcuda.so.1")),
            ("libcuda.so.1".to_string(), dir.path().join("shadowed")),
            ("libnvidia-ml.so.1".to_string(), dir.path().join("missing.so")),
            ("libz.so.1".to_string(), real.clone()),
        ];
        let m = driver_mounts(&entries, &[dir.path().join("nope"), bins.clone()]);
        let got: Vec<(String, String, bool)> =
            m.iter().map(|b| (b.source.clone(), b.destination.clone(), b.read_only)).collect();
        let real = std::fs::canonicalize(&real).unwrap().display().to_string();
        let smi = std::fs::canonicalize(bins.join("nvidia-smi")).unwrap().display().to_string();
        assert_eq!(
            got,
            [
                (real, "/usr/local/nvidia/lib64/libcuda.so.1".to_string(), true),
                (smi, "/usr/local/nvidia/bin/nvidia-smi".to_string(), true),
            ]
        );
    }

    #[test]
    fn discovery_on_a_driverless_host_finds_nothing() {
        let m = discover(Path::new("/sbin/ldconfig"), &[PathBuf::from("/usr/bin")]);
        assert!(m.iter().all(|b| b.destination.starts_with("/usr/local/nvidia/")), "{m:?}");
        assert!(discover(Path::new("/nonexistent/ldconfig"), &[]).is_empty());
    }
}
