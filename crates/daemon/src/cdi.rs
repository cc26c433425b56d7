//! CDI (Container Device Interface) specs whose device names are Tessera requests: kind
//! `tessera.io/gpu`, devices `gpu`, `gpu-N`, `all`, `mig-<profile>`, `mps-<pct>`, `shared`,
//! as far as the node and the policy offer them. Each device's only edit is the request
//! (`TESSERA_GPU=<request>` in the env): no device node, mount or hook, so the grant is still
//! made by tesserad when tessera-runtime creates the container, for the tenant the policy
//! identifies, or refused. A CDI device used without tessera-runtime gives nothing.
//!
//! cdiVersion 0.5.0: the newest podman 4.3 (Debian 12) reads (0.6.0 added annotations,
//! which this spec does not need).
//!
//! Two writers share this module: `tessera cdi generate` (once, from tesserad's status and
//! the policy file) and tesserad itself with `--cdi-spec-dir DIR` ([`spawn`]): it writes
//! `DIR/tessera.yaml` at start and again whenever what it offers changes (a policy
//! reloaded or pushed by the fleet, a MIG layout re-cut), only when the content differs.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tessera_api::{Isolation, NodeStatus, REQUEST_ENV};
use tracing::{info, warn};

use crate::{Action, Controller, Outcome};

/// The CDI kind (vendor/class) of Tessera's devices.
pub const KIND: &str = "tessera.io/gpu";
pub const CDI_VERSION: &str = "0.5.0";
/// The `mps-PCT` devices offered (those at most the policy's `mps.max_percent`).
const MPS_PERCENTS: [u8; 6] = [10, 20, 25, 33, 50, 100];

/// The file tesserad writes in `--cdi-spec-dir`.
pub const SPEC_FILE: &str = "tessera.yaml";
/// The longest tesserad goes without reading the node again for its spec (a change that
/// no action reported).
pub const RESYNC: Duration = Duration::from_secs(5);

/// Why a spec could not be written.
#[derive(Debug, thiserror::Error)]
pub enum CdiError {
    #[error("CDI spec {path}: cannot write: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("CDI spec: cannot read the node: {0}")]
    Node(String),
}

/// What the node and the policy offer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offer {
    pub gpus: u32,
    pub mig_profiles: BTreeSet<String>,
    pub allowed: BTreeSet<Isolation>,
    pub mps_max_percent: u8,
}

impl Offer {
    /// What a request can be granted here: `gpu`/`gpu-N`/`all` up to the healthy GPUs not
    /// in MIG mode (what `docker --gpus all` counts too), `mig-<profile>` for every profile
    /// of a healthy MIG-mode GPU's model where MIG is cut on demand
    /// ([`NodeStatus::mig_cut_on_demand`]), else for the instances cut now. A quarantined device offers nothing: a GPU quarantined (by ECC, an XID or a
    /// failed scrub) is not counted, and a cut instance's profile is named only while an
    /// instance of it is not quarantined (so an XID that takes the last instance of a
    /// declared layout's profile drops `mig-<profile>` from the spec).
    pub fn new(status: &NodeStatus, policy: Option<&policy::Policy>) -> Offer {
        let dynamic = status.mig_cut_on_demand;
        let healthy: Vec<&tessera_api::GpuStatus> =
            status.gpus.iter().filter(|g| !gpu_quarantined(g)).collect();
        let mut mig_profiles: BTreeSet<String> = healthy
            .iter()
            .flat_map(|g| {
                g.instances
                    .iter()
                    .filter(|i| i.state != tessera_api::DeviceState::Quarantined)
                    .map(|i| i.profile.clone())
            })
            .collect();
        if dynamic {
            for g in healthy.iter().filter(|g| g.mig_enabled) {
                if let Some(m) = slicer::catalog::model(&g.model) {
                    mig_profiles.extend(m.profiles.iter().map(|p| p.name.to_string()));
                }
            }
        }
        let mig_profiles =
            mig_profiles.into_iter().filter(|p| valid_name(&mig_device_name(p))).collect();
        let (allowed, mps_max_percent) = match policy {
            Some(p) => (
                [policy::Trust::Untrusted, policy::Trust::Trusted, policy::Trust::Dev]
                    .into_iter()
                    .flat_map(|t| p.allowed(t).iter().copied())
                    .collect(),
                p.mps_max_percent(),
            ),
            None => (Isolation::ALL.into_iter().collect(), 100),
        };
        let gpus = healthy.iter().filter(|g| !g.mig_enabled).count() as u32;
        Offer { gpus, mig_profiles, allowed, mps_max_percent }
    }

    /// (CDI device name, Tessera request), in a stable order.
    pub fn devices(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        if self.allowed.contains(&Isolation::Gpu) && self.gpus > 0 {
            out.push(("gpu".to_owned(), "gpu=1".to_owned()));
            for n in 2..=self.gpus.min(64) {
                out.push((format!("gpu-{n}"), format!("gpu={n}")));
            }
            out.push(("all".to_owned(), format!("gpu={}", self.gpus.min(64))));
        }
        if self.allowed.contains(&Isolation::Mig) {
            for p in &self.mig_profiles {
                out.push((mig_device_name(p), format!("mig={p}")));
            }
        }
        if self.allowed.contains(&Isolation::Mps) && self.gpus > 0 {
            for pct in MPS_PERCENTS.into_iter().filter(|p| *p <= self.mps_max_percent) {
                out.push((format!("mps-{pct}"), format!("mps={pct}")));
            }
        }
        if self.allowed.contains(&Isolation::Shared) && self.gpus > 0 {
            out.push(("shared".to_owned(), "shared".to_owned()));
        }
        out
    }
}

/// Whether the GPU itself is quarantined. A GPU in MIG mode shows `mig-parent` as its
/// state, so its lifecycle (`quarantined: <reason>`, `node::lifecycle_detail`) says it.
fn gpu_quarantined(g: &tessera_api::GpuStatus) -> bool {
    g.state == tessera_api::DeviceState::Quarantined
        || g.lifecycle.as_ref().is_some_and(|l| l.detail.starts_with("quarantined"))
}

/// The CDI device of a MIG profile: `mig-1g.10gb`; a `+me` profile is written `-me`
/// (`mig-1g.10gb-me`: CDI names have no `+`), as its Kubernetes resource is.
pub fn mig_device_name(profile: &str) -> String {
    format!("mig-{}", profile.replace('+', "-"))
}

/// CDI's device name rule: a letter or digit, then letters, digits, `_ . : -`.
fn valid_name(n: &str) -> bool {
    let b = n.as_bytes();
    !b.is_empty()
        && b[0].is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || b"_.:-".contains(c))
}

/// The spec's YAML (every string JSON-quoted, which YAML reads as is).
pub fn spec_yaml(offer: &Offer, header: &str) -> String {
    let q = |s: &str| serde_json::Value::from(s).to_string();
    let mut y = format!(
        "# Generated by {header}.\n# Each device is a Tessera GPU \
         request; tesserad grants it (or refuses) when tessera-runtime creates the container.\n\
         cdiVersion: {}\nkind: {}\ndevices:\n",
        q(CDI_VERSION),
        q(KIND)
    );
    for (name, request) in offer.devices() {
        y.push_str(&format!(
            "  - name: {}\n    containerEdits:\n      env:\n        - {}\n",
            q(&name),
            q(&format!("{REQUEST_ENV}={request}"))
        ));
    }
    y.push_str("containerEdits: {}\n");
    y
}

/// Writes `yaml` to `path` (its directory created; a temporary file renamed over it, so
/// engines never read half a spec) unless the file already holds exactly that. Returns
/// whether it wrote.
pub fn write_if_changed(path: &Path, yaml: &str) -> Result<bool, CdiError> {
    let err = |source| CdiError::Write { path: path.to_path_buf(), source };
    if std::fs::read_to_string(path).ok().as_deref() == Some(yaml) {
        return Ok(false);
    }
    tessera_api::durable::replace(
        path,
        yaml.as_bytes(),
        0o644,
        tessera_api::durable::Sync::Durable,
    )
    .map_err(err)?;
    Ok(true)
}

/// tesserad's spec for its node and the policy in force now.
fn current_spec(ctl: &Controller) -> Result<(String, usize), CdiError> {
    let (status, policy) = match ctl.apply(Action::CdiInputs) {
        Ok(Outcome::CdiInputs(inputs)) => *inputs,
        Ok(_) => return Err(CdiError::Node("unexpected answer to a status read".into())),
        Err(e) => return Err(CdiError::Node(e.to_string())),
    };
    let offer = Offer::new(&status, Some(&policy));
    let header = format!(
        "tesserad, node {}, policy version {} ({})",
        status.node, status.policy.version, status.policy.source
    );
    Ok((spec_yaml(&offer, &header), offer.devices().len()))
}

/// Writes `dir/tessera.yaml` for the node now (blocking; at start, before the socket
/// serves, so engines started after tesserad find it).
pub fn write_now(ctl: &Controller, dir: &Path) -> Result<bool, CdiError> {
    let (yaml, devices) = current_spec(ctl)?;
    let path = dir.join(SPEC_FILE);
    let wrote = write_if_changed(&path, &yaml)?;
    if wrote {
        info!(path = %path.display(), devices, "CDI spec written");
    }
    Ok(wrote)
}

/// Keeps `dir/tessera.yaml` current: after every action that may have changed what the
/// node offers ([`Controller::changes`]) and at least every [`RESYNC`]. A failure is
/// logged once until a write succeeds again; the old spec stays.
pub fn spawn(ctl: Arc<Controller>, dir: PathBuf) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut changes = ctl.changes();
        let mut failing = false;
        loop {
            tokio::select! {
                r = changes.changed() => if r.is_err() { return },
                _ = tokio::time::sleep(RESYNC) => {}
            }
            let (c, d) = (ctl.clone(), dir.clone());
            match tokio::task::spawn_blocking(move || write_now(&c, &d)).await {
                Ok(Ok(_)) => failing = false,
                Ok(Err(e)) if !failing => {
                    failing = true;
                    warn!("{e}; the last spec stays");
                }
                Err(e) if !failing => {
                    failing = true;
                    warn!("CDI spec task failed: {e}");
                }
                _ => {}
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offer(allowed: &[Isolation], mps: u8) -> Offer {
        Offer {
            gpus: 3,
            mig_profiles: ["1g.10gb".to_string(), "3g.40gb".to_string()].into(),
            allowed: allowed.iter().copied().collect(),
            mps_max_percent: mps,
        }
    }

    #[test]
    fn devices_follow_the_node_and_the_policy() {
        let names = |o: &Offer| {
            o.devices().into_iter().map(|(n, r)| format!("{n}:{r}")).collect::<Vec<_>>()
        };
        assert_eq!(
            names(&offer(&Isolation::ALL, 25)),
            [
                "gpu:gpu=1",
                "gpu-2:gpu=2",
                "gpu-3:gpu=3",
                "all:gpu=3",
                "mig-1g.10gb:mig=1g.10gb",
                "mig-3g.40gb:mig=3g.40gb",
                "mps-10:mps=10",
                "mps-20:mps=20",
                "mps-25:mps=25",
                "shared:shared"
            ]
        );
        assert_eq!(
            names(&offer(&[Isolation::Mig], 100)),
            ["mig-1g.10gb:mig=1g.10gb", "mig-3g.40gb:mig=3g.40gb"]
        );
        let mut none = offer(&Isolation::ALL, 100);
        none.gpus = 0;
        none.mig_profiles.clear();
        assert!(none.devices().is_empty());
    }

    #[test]
    fn every_request_parses_and_every_name_is_a_cdi_name() {
        for (name, request) in offer(&Isolation::ALL, 100).devices() {
            assert!(valid_name(&name), "{name}");
            request.parse::<tessera_api::GpuRequest>().unwrap_or_else(|e| panic!("{request}: {e}"));
        }
        assert!(!valid_name("-x") && !valid_name("a/b") && !valid_name(""));
    }

    /// Issue 26: a quarantined device offers nothing (the spec drops what only it offered).
    #[test]
    fn quarantined_devices_offer_nothing() {
        let inst = |uuid: &str, profile: &str, state: &str| {
            serde_json::json!({"uuid": uuid, "profile": profile, "gi_id": 1, "ci_id": 0,
                "start": 0, "size": 1, "memory_mib": 1, "state": state})
        };
        let gpu = |uuid: &str, mig: bool, state: &str, detail: Option<&str>, instances| {
            let mut g = serde_json::json!({"index": 0, "uuid": uuid, "model": "H100-80GB",
                "minor": 0, "memory_mib": 1, "mig_enabled": mig, "state": state,
                "instances": instances});
            if let Some(d) = detail {
                g["lifecycle"] = serde_json::json!({ "detail": d });
            }
            g
        };
        let status = |gpus: Vec<serde_json::Value>| -> NodeStatus {
            serde_json::from_value(serde_json::json!({"node": "n", "backend": "sim",
                "policy": {"version": 1, "source": "f", "digest": "d"},
                "gpus": gpus, "allocations": []}))
            .expect("status")
        };
        let mig = |a: &str, b: &str| vec![inst("MIG-a", "1g.10gb", a), inst("MIG-b", "3g.40gb", b)];
        let before = Offer::new(
            &status(vec![
                gpu("GPU-m", true, "migparent", None, mig("free", "free")),
                gpu("GPU-w", false, "free", None, vec![]),
            ]),
            None,
        );
        // Instances cut by a declared layout (not on demand); `gpu`/`all` count the GPU
        // not in MIG mode.
        assert_eq!(before.gpus, 1);
        assert_eq!(before.mig_profiles, ["1g.10gb".to_string(), "3g.40gb".into()].into());
        // XID 94 on MIG-b: its profile goes; XID 48 on GPU-w: no whole GPU left.
        let after = Offer::new(
            &status(vec![
                gpu("GPU-m", true, "migparent", None, mig("free", "quarantined")),
                gpu("GPU-w", false, "quarantined", Some("quarantined: XID 48"), vec![]),
            ]),
            None,
        );
        assert_eq!(after.gpus, 0);
        assert_eq!(after.mig_profiles, ["1g.10gb".to_string()].into());
        assert!(!after.devices().iter().any(|(n, _)| n == "gpu" || n == "all"));
        // The MIG GPU quarantined whole: nothing of it.
        let whole = Offer::new(
            &status(vec![gpu(
                "GPU-m",
                true,
                "migparent",
                Some("quarantined: XID 95"),
                mig("quarantined", "quarantined"),
            )]),
            None,
        );
        assert_eq!((whole.gpus, whole.mig_profiles.len()), (0, 0));
        assert!(whole.devices().is_empty());
    }

    /// Only what can be granted: no `gpu-N` past the GPUs that are not in MIG mode (`all`
    /// is their count, as for `docker --gpus all`), and every MIG profile the node can cut
    /// (not only the ones cut now), `+me` written `-me`.
    #[test]
    fn only_grantable_names_and_every_cuttable_profile() {
        let status: NodeStatus = serde_json::from_value(serde_json::json!({
            "node": "n1", "backend": "sim", "allocations": [], "mig_cut_on_demand": true,
            "policy": {"version": 1, "digest": "x", "source": "f"},
            "gpus": [
                {"index": 0, "uuid": "GPU-0", "model": "H100-80GB", "minor": 0, "memory_mib": 81920,
                 "mig_enabled": true, "state": "free", "instances": [
                    {"uuid": "MIG-1", "profile": "3g.40gb", "gi_id": 1, "ci_id": 0, "start": 0, "size": 4,
                     "memory_mib": 40192, "state": "free"}]},
                {"index": 1, "uuid": "GPU-1", "model": "H100-80GB", "minor": 1, "memory_mib": 81920,
                 "mig_enabled": false, "state": "free", "instances": []},
                {"index": 2, "uuid": "GPU-2", "model": "H100-80GB", "minor": 2, "memory_mib": 81920,
                 "mig_enabled": false, "state": "free", "instances": []}
            ]
        }))
        .expect("status");
        let o = Offer::new(&status, None);
        let names: Vec<String> = o.devices().into_iter().map(|(n, r)| format!("{n}:{r}")).collect();
        assert!(
            names.contains(&"all:gpu=2".to_string()) && names.contains(&"gpu-2:gpu=2".to_string()),
            "{names:?}"
        );
        assert!(!names.iter().any(|n| n.starts_with("gpu-3")), "{names:?}");
        for p in ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"] {
            assert!(names.contains(&format!("mig-{p}:mig={p}")), "{p}: {names:?}");
        }
        assert!(names.contains(&"mig-1g.10gb-me:mig=1g.10gb+me".to_string()), "{names:?}");
        for (_, request) in o.devices() {
            request.parse::<tessera_api::GpuRequest>().unwrap_or_else(|e| panic!("{request}: {e}"));
        }
    }

    #[test]
    fn the_spec_carries_only_the_request() {
        let y = spec_yaml(&offer(&[Isolation::Shared], 100), "node n");
        assert_eq!(
            y.lines().skip(2).collect::<Vec<_>>(),
            [
                "cdiVersion: \"0.5.0\"",
                "kind: \"tessera.io/gpu\"",
                "devices:",
                "  - name: \"shared\"",
                "    containerEdits:",
                "      env:",
                "        - \"TESSERA_GPU=shared\"",
                "containerEdits: {}",
            ]
        );
    }
}
