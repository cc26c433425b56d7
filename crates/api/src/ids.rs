//! Newtypes for the names the API passes around: a container id, a device uuid, a tenant
//! path. Each is checked once, where it is made (a request body is refused when it is
//! read), and is its plain string on the wire and in the store (`"abc"`, not
//! `{"0": "abc"}`), so bodies and stored rows of earlier versions read unchanged.

use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::display::untrusted;
use crate::{validate_container_id, InvalidContainerId};

/// The string newtype boilerplate: `new` (checked), `as_str`, `Deref<Target = str>`,
/// `Display`, `FromStr`, `TryFrom<String>` (serde's way in), and serialisation as the
/// plain string.
macro_rules! string_newtype {
    ($name:ident, $err:ty, $check:expr) => {
        impl $name {
            /// Checks `s` and wraps it.
            pub fn new(s: impl Into<String>) -> Result<Self, $err> {
                let s = s.into();
                let check: fn(&str) -> Result<(), $err> = $check;
                check(&s)?;
                Ok($name(s))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }

            pub fn into_string(self) -> String {
                self.0
            }
        }

        impl Deref for $name {
            type Target = str;
            fn deref(&self) -> &str {
                &self.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl FromStr for $name {
            type Err = $err;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                $name::new(s)
            }
        }

        impl TryFrom<String> for $name {
            type Error = $err;
            fn try_from(s: String) -> Result<Self, Self::Error> {
                $name::new(s)
            }
        }

        impl From<$name> for String {
            fn from(v: $name) -> String {
                v.0
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.0 == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.0 == *other
            }
        }

        impl PartialEq<String> for $name {
            fn eq(&self, other: &String) -> bool {
                self.0 == *other
            }
        }

        impl PartialEq<$name> for String {
            fn eq(&self, other: &$name) -> bool {
                *self == other.0
            }
        }

        impl PartialEq<$name> for str {
            fn eq(&self, other: &$name) -> bool {
                self == other.0
            }
        }

        impl PartialEq<$name> for &str {
            fn eq(&self, other: &$name) -> bool {
                *self == other.0
            }
        }

        impl Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(&self.0)
            }
        }
    };
}

/// An OCI container id that passed [`validate_container_id`] (runc's rule): safe to join
/// to a directory, it names no other one.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize)]
#[serde(try_from = "String")]
pub struct ContainerId(String);

string_newtype!(ContainerId, InvalidContainerId, validate_container_id);

/// Why a string is not a device uuid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "device uuid `{}` is not a device uuid (expected GPU-… or MIG-… with at most {MAX_UUID_BYTES} \
     bytes of [A-Za-z0-9-_.], or the MIG-GPU-…/GI/CI form of older drivers)",
    untrusted(.0)
)]
pub struct InvalidDeviceUuid(pub String);

/// NVML's uuid buffer (`NVML_DEVICE_UUID_V2_BUFFER_SIZE`), less its NUL.
pub const MAX_UUID_BYTES: usize = 95;

/// The uuid of a GPU or MIG instance as NVML names it (`GPU-xxxxxxxx-xxxx-…`,
/// `MIG-xxxxxxxx-…`; drivers before R470 name MIG instances `MIG-GPU-<uuid>/<gi>/<ci>`)
/// and as the simulated node names it (the same forms; tests use short ones such as
/// `GPU-1`). Lenient on the body, strict on what could harm a message or a path: no
/// control or non-ASCII characters, no `/` except in the old MIG form, at most
/// [`MAX_UUID_BYTES`] bytes.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize)]
#[serde(try_from = "String")]
pub struct DeviceUuid(String);

string_newtype!(DeviceUuid, InvalidDeviceUuid, validate_device_uuid);

fn validate_device_uuid(s: &str) -> Result<(), InvalidDeviceUuid> {
    let body_ok = |b: &str| {
        !b.is_empty() && b.bytes().all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(&c))
    };
    let digits = |d: &str| !d.is_empty() && d.len() <= 3 && d.bytes().all(|c| c.is_ascii_digit());
    let legacy_mig = |rest: &str| {
        let mut parts = rest.split('/');
        match (parts.next(), parts.next(), parts.next(), parts.next()) {
            (Some(gpu), Some(gi), Some(ci), None) => {
                gpu.strip_prefix("GPU-").is_some_and(body_ok) && digits(gi) && digits(ci)
            }
            _ => false,
        }
    };
    let ok = s.len() <= MAX_UUID_BYTES
        && match (s.strip_prefix("GPU-"), s.strip_prefix("MIG-")) {
            (Some(rest), _) => body_ok(rest),
            (_, Some(rest)) if rest.contains('/') => legacy_mig(rest),
            (_, Some(rest)) => body_ok(rest),
            _ => false,
        };
    if ok {
        Ok(())
    } else {
        Err(InvalidDeviceUuid(s.to_string()))
    }
}

/// The levels of a tenant path, outermost first.
pub const TENANT_LEVELS: [&str; 4] = ["org", "team", "project", "user"];

/// What a name in the policy's tenant tree (one segment of a tenant path) may be.
pub const TENANT_NAME_EXPECTED: &str =
    "1 to 63 of [a-z0-9_-], starting with a lowercase letter or digit";

/// Whether `s` is a name of the policy's tenant tree: one segment of a tenant path (the
/// rule `crates/policy` checks its orgs, teams, projects and users with).
pub fn is_tenant_name(s: &str) -> bool {
    let b = s.as_bytes();
    let ok = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    (1..=63).contains(&b.len())
        && ok(b[0])
        && b[1..].iter().all(|&c| ok(c) || c == b'_' || c == b'-')
}

/// Why a string is not a tenant path.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "tenant `{}` is not a tenant path (expected org[/team[/project[/user]]], each {TENANT_NAME_EXPECTED})",
    untrusted(.0)
)]
pub struct InvalidTenantPath(pub String);

/// A tenant path, `org/team/project/user` or a prefix of it (a tenant may sit at any level
/// of the policy's tree): 1 to 4 segments, each a [`is_tenant_name`] name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize)]
#[serde(try_from = "String")]
pub struct TenantPath(String);

string_newtype!(TenantPath, InvalidTenantPath, validate_tenant_path);

fn validate_tenant_path(s: &str) -> Result<(), InvalidTenantPath> {
    let n = s.split('/').count();
    if n <= TENANT_LEVELS.len() && s.split('/').all(is_tenant_name) {
        Ok(())
    } else {
        Err(InvalidTenantPath(s.to_string()))
    }
}

impl TenantPath {
    /// The segments, org first.
    pub fn segments(&self) -> impl Iterator<Item = &str> {
        self.0.split('/')
    }
}

/// How far a tenant is trusted, ordered from least to most trusted: the tiers of the
/// policy (`policy::Trust` is this type) and the `trust` of a recorded grant. Its name on
/// the wire, in policies and in the store: `untrusted`, `trusted`, `dev`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Trust {
    /// Runs code nobody vetted: only hardware-isolated shares (whole GPU, MIG).
    Untrusted,
    /// Vetted workloads: may also share a GPU through MPS.
    Trusted,
    /// Development: may use anything, time-slicing included.
    Dev,
}

/// Why a string is not a trust tier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("trust `{}` is not a trust tier (expected one of `untrusted`, `trusted`, `dev`)", untrusted(.0))]
pub struct InvalidTrust(pub String);

impl Trust {
    /// Every trust level, least trusted first.
    pub const ALL: [Trust; 3] = [Trust::Untrusted, Trust::Trusted, Trust::Dev];

    /// The name used in policies and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Trust::Untrusted => "untrusted",
            Trust::Trusted => "trusted",
            Trust::Dev => "dev",
        }
    }
}

impl FromStr for Trust {
    type Err = InvalidTrust;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Trust::ALL.into_iter().find(|t| t.as_str() == s).ok_or_else(|| InvalidTrust(s.to_string()))
    }
}

impl PartialEq<str> for Trust {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for Trust {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

// By hand rather than derived: serde's "unknown variant" message names the tiers, and a
// value of the wrong type reads "expected one of `untrusted`, `trusted`, `dev`" instead
// of serde_json's "expected value" syntax error.
impl<'de> Deserialize<'de> for Trust {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        const NAMES: &[&str] = &["untrusted", "trusted", "dev"];
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Trust;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("one of `untrusted`, `trusted`, `dev`")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Trust, E> {
                v.parse().map_err(|_| E::unknown_variant(v, NAMES))
            }
        }
        deserializer.deserialize_str(V)
    }
}

impl fmt::Display for Trust {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn container_ids_are_checked_and_plain_strings_on_the_wire() {
        let id = ContainerId::new("a.b-c_d+e").expect("ok");
        assert_eq!(serde_json::to_string(&id).expect("ser"), r#""a.b-c_d+e""#);
        assert_eq!(serde_json::from_str::<ContainerId>(r#""a.b-c_d+e""#).expect("de"), id);
        assert_eq!(id, "a.b-c_d+e");
        for bad in ["", ".", "..", "../x", "a/b", "a\nb", "é", &"x".repeat(1025)] {
            assert!(ContainerId::new(bad).is_err(), "{bad:?}");
            let json = serde_json::to_string(bad).expect("json");
            let err = serde_json::from_str::<ContainerId>(&json).unwrap_err().to_string();
            assert!(err.contains("is not a valid container id") && !err.contains('\n'), "{err}");
        }
    }

    #[test]
    fn device_uuids_take_the_drivers_and_the_sims_forms() {
        for ok in [
            "GPU-8f6b8e5c-1a2b-3c4d-5e6f-0123456789ab",
            "MIG-8f6b8e5c-1a2b-3c4d-5e6f-0123456789ab",
            "MIG-GPU-8f6b8e5c-1a2b-3c4d-5e6f-0123456789ab/1/0",
            "GPU-1",
            "MIG-1",
            "MIG-new-3",
        ] {
            let u = DeviceUuid::new(ok).expect(ok);
            assert_eq!(serde_json::to_string(&u).expect("ser"), format!("\"{ok}\""));
        }
        let long = format!("GPU-{}", "a".repeat(MAX_UUID_BYTES - 3));
        for bad in [
            "",
            "GPU-",
            "gpu-1",
            "TPU-1",
            "GPU-1/2",
            "GPU-../x",
            "MIG-../1/0",
            "MIG-GPU-1/1",
            "MIG-GPU-1/1/0/0",
            "MIG-GPU-1/a/0",
            "GPU-1\n",
            "GPU-1 2",
            "GPU-é",
            &long,
        ] {
            let err = DeviceUuid::new(bad).unwrap_err().to_string();
            assert!(!err.contains('\n'), "{err}");
        }
    }

    #[test]
    fn trust_tiers_are_their_names_and_nothing_else() {
        for t in Trust::ALL {
            let json = format!("\"{t}\"");
            assert_eq!(serde_json::to_string(&t).expect("ser"), json);
            assert_eq!(serde_json::from_str::<Trust>(&json).expect("de"), t);
            assert_eq!(t.as_str().parse::<Trust>(), Ok(t));
        }
        assert!(Trust::Untrusted < Trust::Trusted && Trust::Trusted < Trust::Dev);
        for bad in ["", "Dev", "root", "dev ", "dev\n\u{1b}[2J"] {
            let err = bad.parse::<Trust>().unwrap_err().to_string();
            assert!(err.starts_with("trust `") && err.contains("`untrusted`"), "{err}");
            assert!(!err.contains(['\n', '\u{1b}']), "escaped: {err:?}");
        }
        // serde names the tiers for an unknown one, and expects one for a wrong type.
        let err = serde_json::from_str::<Trust>("\"root\"").unwrap_err().to_string();
        assert!(err.contains("unknown variant `root`") && err.contains("`dev`"), "{err}");
        let err = serde_json::from_str::<Trust>("3").unwrap_err().to_string();
        assert!(err.contains("expected one of `untrusted`, `trusted`, `dev`"), "{err}");
    }

    /// A stored grant (and the allocation an API answer carries) reads into the typed ids
    /// and writes back byte for byte: the newtypes are their plain strings in the store and
    /// on the wire.
    #[test]
    fn a_stored_allocation_round_trips_byte_for_byte_through_the_typed_ids() {
        let stored = concat!(
            r#"{"container_id":"ctr-1.a_b+c","tenant":"acme/trusted/training/alice","#,
            r#""trust":"trusted","request":"mig=1g.10gb","isolation":"mig","devices":[{"#,
            r#""uuid":"MIG-8f6b8e5c-1a2b-3c4d-5e6f-0123456789ab","#,
            r#""gpu_uuid":"GPU-8f6b8e5c-1a2b-3c4d-5e6f-0123456789ab","gpu_index":0,"#,
            r#""model":"H100-80GB","mig_profile":"1g.10gb","placement":[0,1]}],"#,
            r#""injection":{"devices":[],"env":[],"mounts":[]},"state":"running","pid":42,"#,
            r#""created_ms":1700000000000}"#
        );
        let a: crate::Allocation = serde_json::from_str(stored).expect("a stored grant");
        assert_eq!(a.container_id, "ctr-1.a_b+c");
        assert_eq!(a.tenant.segments().count(), 4);
        assert_eq!(a.trust, Trust::Trusted);
        assert_eq!(serde_json::to_string(&a).expect("ser"), stored);
        // A row whose ids break the rules is refused when it is read, naming which and
        // where, escaped.
        for (from, to, what) in [
            (r#""container_id":"ctr-1.a_b+c""#, r#""container_id":"../x\n""#, "container id"),
            (r#""tenant":"acme/trusted/training/alice""#, r#""tenant":"Acme/\u001b[2J""#, "tenant"),
            (r#""trust":"trusted""#, r#""trust":"root""#, "trust"),
        ] {
            let bad = stored.replace(from, to);
            assert_ne!(bad, stored);
            let err = serde_json::from_str::<crate::Allocation>(&bad).unwrap_err().to_string();
            assert!(err.contains(what) && err.contains("at line 1 column"), "{what}: {err}");
            assert!(!err.contains(['\n', '\u{1b}']), "escaped: {err:?}");
        }
    }

    #[test]
    fn tenant_paths_are_one_to_four_policy_names() {
        for ok in ["acme", "acme/ml", "acme/ml/x/alice", "a-b/c_d/0/z9"] {
            let t = TenantPath::new(ok).expect(ok);
            assert_eq!(serde_json::to_string(&t).expect("ser"), format!("\"{ok}\""));
            assert_eq!(t.segments().collect::<Vec<_>>().join("/"), ok);
        }
        for bad in ["", "/", "acme/", "/acme", "acme//ml", "Acme", "a/b/c/d/e", "-a", "a.b", "a\nb"]
        {
            let err = TenantPath::new(bad).unwrap_err().to_string();
            assert!(!err.contains('\n'), "{err}");
        }
        assert!(TenantPath::new("x".repeat(64)).is_err());
    }
}
