//! Reloading the local policy file (`SIGHUP` to tesserad — [`crate::reload`] —,
//! `POST /v1/policy/reload`, `tessera policy reload`): whether a reload may change the
//! policy in force, the file read, the report. [`crate::Controller`] applies it
//! ([`crate::Action::ReloadPolicy`]).
//!
//! * The file given with `--policy` is read again and validated like at start
//!   ([`policy::Policy::load`]). A file that does not load changes nothing: the policy in
//!   force stays, and the error (with the file and the JSON path) is logged by the
//!   controller and returned to the caller.
//! * Only where that file is the policy in force. On a node that follows a fleet the
//!   precedence of [`crate::follow`] holds: with `--policy-overrides-fleet` the file is in
//!   force and is reloaded; without it the file is in force only as the bootstrap policy
//!   until the first signed revision, and once a signed revision (received or
//!   last-known-good) is in force a reload changes nothing and says why. The check and the
//!   swap are one step under the node lock, so a fleet revision applied meanwhile is never
//!   overwritten by the file.
//! * Grants already made keep their devices, as with a fleet revision; every decision from
//!   then on uses the reloaded policy (`tessera policy revoke-check` lists the grants it
//!   would refuse).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tracing::info;

use crate::error::CoreError;
use crate::node::ActivePolicy;

/// What a reload needs of the fleet link, on a node that follows a coordinator
/// ([`crate::follow::Fleet`]).
pub trait FleetPolicy: Send + Sync + std::fmt::Debug {
    /// Why the policy in force is not the local file, when the fleet decides it.
    fn source_reason(&self) -> Option<String>;
    /// A reload of the local file became the policy in force.
    fn note_local_reload(&self, version: u64, digest: &str);
}

/// What a reload reads and whom it must respect; set once at start
/// ([`crate::Controller::set_reload`]).
#[derive(Debug, Clone)]
pub struct ReloadSetup {
    /// The `--policy` file; `None` on a node whose policy comes only from the fleet.
    pub file: Option<PathBuf>,
    /// The fleet link, on a node that follows a coordinator.
    pub fleet: Option<Arc<dyn FleetPolicy>>,
}

/// A policy's identity in a [`ReloadReport`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyVersion {
    pub version: u64,
    /// sha256 of the policy bytes, hex.
    pub digest: String,
}

/// The answer to a successful reload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReloadReport {
    /// The file read.
    pub file: String,
    /// The policy in force before.
    pub previous: PolicyVersion,
    /// The policy in force now.
    pub current: PolicyVersion,
    /// Whether the bytes differ (a reload of an unchanged file changes nothing).
    pub changed: bool,
}

fn refused(msg: String) -> CoreError {
    CoreError::conflict(msg)
}

/// The source string of a policy loaded from `path` (as at start).
pub fn file_source(path: &Path) -> String {
    format!("file:{}", path.display())
}

/// The file to reload, if a reload may change the policy in force `active`; else why not.
/// Pure apart from reading the fleet's status.
pub fn reloadable<'a>(
    setup: Option<&'a ReloadSetup>,
    active: &ActivePolicy,
) -> Result<&'a Path, CoreError> {
    let Some(setup) = setup else {
        return Err(refused("this tesserad has no policy file to reload".into()));
    };
    let Some(file) = setup.file.as_deref() else {
        return Err(refused(format!(
            "nothing to reload: tesserad was started without --policy; the policy in force (version {}) comes \
             from {} and changes only with the fleet's signed revisions",
            active.policy.version(),
            active.source
        )));
    };
    if active.source != file_source(file) {
        let why = setup.fleet.as_ref().and_then(|f| f.source_reason()).unwrap_or_else(|| {
            format!("version {} from {} is in force", active.policy.version(), active.source)
        });
        return Err(refused(format!(
            "{} not reloaded, the policy in force is unchanged: {why}; a node that follows a fleet enforces \
             only signed revisions unless tesserad runs with --policy-overrides-fleet",
            file.display()
        )));
    }
    Ok(file)
}

/// Read and validate the file (outside the node lock).
pub fn load(file: &Path) -> Result<policy::Policy, CoreError> {
    policy::Policy::load(file).map_err(|e| {
        CoreError::bad_request(format!(
            "{e}; the policy in force is unchanged (fix the file and reload again)"
        ))
    })
}

pub fn log_reloaded(r: &ReloadReport) {
    if r.changed {
        info!(file = %r.file, previous = r.previous.version, digest = %r.current.digest,
              "policy reloaded: new decisions use version {}", r.current.version);
    } else {
        info!(file = %r.file, version = r.current.version, "policy reloaded: unchanged");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::follow::{CoordinatorConfig, Fleet};
    use ::fleet::signing;
    use tessera_api::ErrorCode;

    fn doc(v: u64) -> String {
        format!(r#"{{"version": {v}, "orgs": {{"acme": {{"trust": "dev"}}}}}}"#)
    }

    /// A fleet node's state dir: a `--policy` file of version 9 and, if `lkg`, a signed
    /// last-known-good of version 2; the policy it starts from and its setup.
    async fn fleet_node(
        lkg: bool,
        overrides: bool,
    ) -> (tempfile::TempDir, ActivePolicy, ReloadSetup) {
        let dir = tempfile::tempdir().unwrap();
        let key = ed25519_dalek::SigningKey::from_bytes(&[9; 32]);
        if lkg {
            let env = signing::sign(&key, doc(2).as_bytes(), "alice", 1).unwrap();
            let verified = signing::verify(&env, &key.verifying_key()).unwrap();
            let lkg_path = dir.path().join("fleet/last-known-good.json");
            ::fleet::agent::write_last_known_good(&lkg_path, &verified).unwrap();
        }
        let file = dir.path().join("policy.json");
        std::fs::write(&file, doc(9)).unwrap();
        let mut cfg = CoordinatorConfig::new(
            vec!["http://127.0.0.1:1".into()],
            key.verifying_key(),
            "node-token-0123456789".into(),
        );
        cfg.policy_overrides_fleet = overrides;
        let fleet = Fleet::new(&cfg, "node-a", dir.path()).unwrap();
        let active = fleet.initial_policy(Some(&file)).await.unwrap();
        let setup = ReloadSetup { file: Some(file), fleet: Some(Arc::new(fleet)) };
        (dir, active, setup)
    }

    #[tokio::test]
    async fn a_fleet_node_reloads_its_file_only_where_the_file_is_in_force() {
        // Signed last-known-good in force, no override: nothing changes, and it says why.
        let (_d, active, setup) = fleet_node(true, false).await;
        let e = reloadable(Some(&setup), &active).unwrap_err();
        assert_eq!(e.code(), ErrorCode::Conflict);
        assert!(e.message().contains("policy.json not reloaded"), "{}", e.message());
        assert!(
            e.message().contains("signed last-known-good version 2 is in force"),
            "{}",
            e.message()
        );
        assert!(e.message().contains("--policy-overrides-fleet"), "{}", e.message());

        // The operator's override: the file is in force and is what a reload reads.
        let (_d, active, setup) = fleet_node(true, true).await;
        assert_eq!(reloadable(Some(&setup), &active).unwrap(), setup.file.as_deref().unwrap());

        // Bootstrap: the unsigned file is in force until the first signed revision...
        let (_d, active, setup) = fleet_node(false, false).await;
        assert_eq!(reloadable(Some(&setup), &active).unwrap(), setup.file.as_deref().unwrap());
        // ... and once one is, a reload of the file changes nothing.
        let signed = ActivePolicy {
            policy: policy::Policy::parse(doc(3).as_bytes(), "t").unwrap(),
            source: "coordinator:http://127.0.0.1:1".into(),
        };
        let e = reloadable(Some(&setup), &signed).unwrap_err();
        assert_eq!(e.code(), ErrorCode::Conflict);
    }

    #[test]
    fn without_a_file_or_a_setup_there_is_nothing_to_reload() {
        let active = ActivePolicy {
            policy: policy::Policy::parse(doc(4).as_bytes(), "t").unwrap(),
            source: "coordinator:http://c:1".into(),
        };
        let e = reloadable(None, &active).unwrap_err();
        assert!(e.message().contains("no policy file"), "{}", e.message());
        let fleet_only = ReloadSetup { file: None, fleet: None };
        let e = reloadable(Some(&fleet_only), &active).unwrap_err();
        assert!(e.message().contains("without --policy"), "{}", e.message());
        assert!(e.message().contains("version 4"), "{}", e.message());
        // A standalone node: the file is the policy in force.
        let file = PathBuf::from("/etc/tessera/policy.json");
        let standalone = ReloadSetup { file: Some(file.clone()), fleet: None };
        let active = ActivePolicy { policy: active.policy, source: file_source(&file) };
        assert_eq!(reloadable(Some(&standalone), &active).unwrap(), file);
    }

    #[test]
    fn a_broken_file_is_a_bad_request_that_says_the_old_policy_stays() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("p.json");
        std::fs::write(&file, r#"{"version": 1, "orgs": {"acme": {"trust": "nope"}}}"#).unwrap();
        let e = load(&file).unwrap_err();
        assert_eq!(e.code(), ErrorCode::BadRequest);
        assert!(e.message().contains("orgs.acme.trust"), "{}", e.message());
        assert!(e.message().contains("the policy in force is unchanged"), "{}", e.message());
    }
}
