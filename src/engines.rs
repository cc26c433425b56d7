//! What an engine's configuration says it runs: the runtimes of Docker's daemon.json,
//! podman's containers.conf and containerd's CRI plugin, and which one is the default.
//! Read by `tessera doctor` (which of them are Tessera's, and what configuration each
//! reads) and `tessera setup --replace-nvidia` (which are NVIDIA's). Pure: text in.

use tessera_api::untrusted;
use toml_edit::{DocumentMut, Item};

/// Why an engine's configuration cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineConfigError {
    #[error("{path} is not valid TOML: {}", untrusted(.message))]
    Toml { path: String, message: String },
    #[error("{path} is not valid JSON: {}", untrusted(.message))]
    Json { path: String, message: String },
}

/// One runtime an engine may run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Configured {
    /// `--runtime NAME`, the CRI handler.
    pub name: String,
    /// The executable the engine runs (podman: the first of its list).
    pub binary: String,
    /// Arguments the engine passes first (daemon.json `runtimeArgs`).
    pub args: Vec<String>,
    pub is_default: bool,
}

/// NVIDIA container toolkit executables an engine may run as a runtime:
/// `nvidia-container-runtime`, `nvidia-container-runtime.cdi`, `.legacy`, …
pub fn is_nvidia_runtime(binary: &str) -> bool {
    binary.rsplit('/').next().is_some_and(|b| b.starts_with("nvidia-container-runtime"))
}

/// Docker's daemon.json (empty: none). The default runtime is `default-runtime`, `runc`
/// when unset.
pub fn docker(text: &str, path: &str) -> Result<Vec<Configured>, EngineConfigError> {
    if text.trim().is_empty() {
        return Ok(Vec::new());
    }
    let v: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| EngineConfigError::Json { path: path.to_owned(), message: e.to_string() })?;
    let default = v.get("default-runtime").and_then(|d| d.as_str()).unwrap_or("runc");
    let mut out = Vec::new();
    if let Some(rts) = v.get("runtimes").and_then(|r| r.as_object()) {
        for (name, rt) in rts {
            let binary = rt.get("path").and_then(|p| p.as_str()).unwrap_or_default().to_owned();
            let args = rt
                .get("runtimeArgs")
                .and_then(|a| a.as_array())
                .map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_owned)).collect())
                .unwrap_or_default();
            out.push(Configured { name: name.clone(), binary, args, is_default: name == default });
        }
    }
    Ok(out)
}

/// podman's containers.conf (empty: none): `[engine.runtimes]`, default `[engine] runtime`.
pub fn podman(text: &str, path: &str) -> Result<Vec<Configured>, EngineConfigError> {
    let doc: DocumentMut = text.parse().map_err(|e: toml_edit::TomlError| {
        EngineConfigError::Toml { path: path.to_owned(), message: e.to_string() }
    })?;
    let engine = doc.get("engine");
    let default = engine.and_then(|e| e.get("runtime")).and_then(Item::as_str).unwrap_or("crun");
    let mut out = Vec::new();
    if let Some(rts) = engine.and_then(|e| e.get("runtimes")).and_then(Item::as_table_like) {
        for (name, paths) in rts.iter() {
            let binary = paths
                .as_array()
                .and_then(|a| a.iter().find_map(|p| p.as_str()))
                .unwrap_or_default()
                .to_owned();
            out.push(Configured {
                name: name.to_owned(),
                binary,
                args: Vec::new(),
                is_default: name == default,
            });
        }
    }
    Ok(out)
}

/// containerd's config.toml (version 2 or 3; empty: none): the CRI plugin's runtimes with
/// their `options.BinaryName` (empty: runc), default `default_runtime_name`.
pub fn containerd(text: &str, path: &str) -> Result<Vec<Configured>, EngineConfigError> {
    let doc: DocumentMut = text.parse().map_err(|e: toml_edit::TomlError| {
        EngineConfigError::Toml { path: path.to_owned(), message: e.to_string() }
    })?;
    let plugin = match doc.get("version").and_then(Item::as_integer) {
        Some(3) => "io.containerd.cri.v1.runtime",
        _ => "io.containerd.grpc.v1.cri",
    };
    let c = doc.get("plugins").and_then(|p| p.get(plugin)).and_then(|p| p.get("containerd"));
    let default =
        c.and_then(|c| c.get("default_runtime_name")).and_then(Item::as_str).unwrap_or("runc");
    let mut out = Vec::new();
    if let Some(rts) = c.and_then(|c| c.get("runtimes")).and_then(Item::as_table_like) {
        for (name, rt) in rts.iter() {
            let binary = rt
                .get("options")
                .and_then(|o| o.get("BinaryName"))
                .and_then(Item::as_str)
                .unwrap_or_default()
                .to_owned();
            out.push(Configured {
                name: name.to_owned(),
                binary,
                args: Vec::new(),
                is_default: name == default,
            });
        }
    }
    Ok(out)
}

/// Whether a CDI spec (YAML or JSON text) is NVIDIA's: its `kind` is `nvidia.com/…`.
pub fn cdi_spec_is_nvidia(text: &str) -> bool {
    if let Ok(v) = serde_json::from_str::<serde_json::Value>(text) {
        return v
            .get("kind")
            .and_then(|k| k.as_str())
            .is_some_and(|k| k.starts_with("nvidia.com/"));
    }
    // YAML: a top-level `kind:` line (a spec's only one at column 0).
    text.lines().any(|l| {
        l.strip_prefix("kind:")
            .is_some_and(|r| r.trim().trim_start_matches(['"', '\'']).starts_with("nvidia.com/"))
    })
}

/// Whether an OCI hooks.d entry (JSON) runs one of NVIDIA's hook binaries.
pub fn oci_hook_is_nvidia(text: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(text)
        .ok()
        .and_then(|v| v.pointer("/hook/path").and_then(|p| p.as_str()).map(str::to_owned))
        .is_some_and(|p| {
            let base = p.rsplit('/').next().unwrap_or_default();
            runtime_hook::docker::NVIDIA_HOOK_BINARIES.contains(&base)
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtimes_and_defaults_are_read_from_each_engine() {
        let d = docker(
            r#"{"default-runtime": "nvidia", "runtimes": {"nvidia": {"path": "nvidia-container-runtime", "runtimeArgs": []},
                "tessera": {"path": "/usr/local/bin/tessera-runtime", "runtimeArgs": ["--tessera-config", "/e/r.toml"]}}}"#,
            "d.json",
        )
        .expect("docker");
        assert_eq!(d.len(), 2);
        assert!(d[0].is_default && is_nvidia_runtime(&d[0].binary));
        assert_eq!(d[1].args, ["--tessera-config", "/e/r.toml"]);
        assert!(docker("", "d.json").expect("empty").is_empty());
        let p = podman(
            "[engine]\nruntime = \"nvidia\"\n[engine.runtimes]\nnvidia = [\"/usr/bin/nvidia-container-runtime\"]\n",
            "c.conf",
        )
        .expect("podman");
        assert!(p[0].is_default && is_nvidia_runtime(&p[0].binary), "{p:?}");
        let c = containerd(
            "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\ndefault_runtime_name = \"nvidia\"\n\
             [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.nvidia.options]\nBinaryName = \"/usr/bin/nvidia-container-runtime\"\n\
             [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\nruntime_type = \"io.containerd.runc.v2\"\n",
            "c.toml",
        )
        .expect("containerd");
        assert_eq!(c.len(), 2);
        assert!(c[0].is_default && is_nvidia_runtime(&c[0].binary) && c[1].binary.is_empty());
        assert!(!is_nvidia_runtime("/usr/local/bin/tessera-runtime"));
    }

    #[test]
    fn nvidias_cdi_specs_and_hooks_are_told_apart() {
        assert!(cdi_spec_is_nvidia("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices: []\n"));
        assert!(cdi_spec_is_nvidia("---\ncdiVersion: \"0.6.0\"\nkind: \"nvidia.com/gpu\"\n"));
        assert!(cdi_spec_is_nvidia(
            r#"{"cdiVersion":"0.5.0","kind":"nvidia.com/gpu","devices":[]}"#
        ));
        assert!(!cdi_spec_is_nvidia("cdiVersion: \"0.5.0\"\nkind: \"tessera.io/gpu\"\n"));
        assert!(oci_hook_is_nvidia(
            r#"{"version":"1.0.0","hook":{"path":"/usr/bin/nvidia-container-toolkit","args":["nvidia-container-toolkit","prestart"]},"when":{"always":true},"stages":["prestart"]}"#
        ));
        assert!(!oci_hook_is_nvidia(r#"{"hook":{"path":"/usr/bin/other"}}"#));
        assert!(!oci_hook_is_nvidia("not json"));
    }
}
