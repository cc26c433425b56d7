//! Pods as containerd's CRI plugin presents them to a runtime: which container of a pod a
//! config.json is, and which annotation holds its GPU request.
//!
//! containerd writes the `io.kubernetes.cri.*` annotations itself, after the pod and
//! container annotations its runtime handler passes through (`pod_annotations`,
//! `container_annotations`), so a pod author cannot override them. Tessera reads from them:
//! - the role: a sandbox (pause) container never takes a grant, whatever it carries;
//! - the container name, which selects a per-container request
//!   `tessera.io/gpu.<container-name>`;
//! - the pod's namespace, name and uid, and the sandbox id, for status and usage
//!   ([`Workload`]). The tenant is still decided by the policy's identity annotations.
//!
//! A bare `tessera.io/gpu` on a pod applies to a pod with exactly one application
//! container: containerd copies pod annotations to every container of the pod, so the
//! daemon refuses the second container of a sandbox that asks through the bare form
//! ([`RequestScope::Pod`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::{untrusted, REQUEST_ANNOTATION};

/// `sandbox` or `container`.
pub const CONTAINER_TYPE: &str = "io.kubernetes.cri.container-type";
/// The container's name in the pod spec.
pub const CONTAINER_NAME: &str = "io.kubernetes.cri.container-name";
/// The sandbox (pod) id: the id of its pause container.
pub const SANDBOX_ID: &str = "io.kubernetes.cri.sandbox-id";
/// The pod's name.
pub const SANDBOX_NAME: &str = "io.kubernetes.cri.sandbox-name";
/// The pod's namespace.
pub const SANDBOX_NAMESPACE: &str = "io.kubernetes.cri.sandbox-namespace";
/// The pod's uid (containerd 1.7 and later).
pub const SANDBOX_UID: &str = "io.kubernetes.cri.sandbox-uid";

/// The value of [`CONTAINER_TYPE`] on a pod's sandbox (pause) container.
pub const TYPE_SANDBOX: &str = "sandbox";
/// The value of [`CONTAINER_TYPE`] on an application (or init) container.
pub const TYPE_CONTAINER: &str = "container";

/// The longest name or namespace accepted (Kubernetes allows 253 for a pod name).
const MAX_NAME: usize = 253;

/// Why the CRI annotations of a container cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CriError {
    #[error(
        "pod {pod} carries both `{REQUEST_ANNOTATION}` and per-container `{REQUEST_ANNOTATION}.<container-name>` \
         annotations ({}): use only the per-container form",
        untrusted(.per_container)
    )]
    MixedForms { pod: String, per_container: String },
    #[error("annotation {key} is {}: expected {expected}", untrusted(.value))]
    Malformed { key: &'static str, value: String, expected: &'static str },
    #[error("annotation {key} is missing on a CRI container (containerd sets it on every container of a pod)")]
    Missing { key: &'static str },
}

/// Which container of a pod this is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// The pod's sandbox (pause) container: never a grant.
    Sandbox,
    /// An application or init container, by its name in the pod spec.
    Container(String),
}

/// A pod's container as status, events and usage name it: what people know.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Workload {
    pub namespace: String,
    pub pod: String,
    /// Absent where containerd does not tell it (1.6).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    /// The container's name; absent for the sandbox.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    /// The sandbox id, which the pod's containers share.
    pub sandbox_id: String,
}

impl Workload {
    /// `namespace/pod/container` (or `namespace/pod` for the sandbox).
    pub fn display_name(&self) -> String {
        match &self.container {
            Some(c) => format!("{}/{}/{}", self.namespace, self.pod, c),
            None => format!("{}/{}", self.namespace, self.pod),
        }
    }
    /// `namespace/pod`.
    pub fn pod_name(&self) -> String {
        format!("{}/{}", self.namespace, self.pod)
    }
}

/// A CRI container's place in its pod, read from containerd's own annotations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodContainer {
    pub role: Role,
    pub workload: Workload,
}

fn get<'a>(a: &'a BTreeMap<String, String>, key: &str) -> Option<&'a str> {
    a.get(key).map(String::as_str)
}

/// A namespace, pod or container name as Kubernetes admits it: 1 to 253 of lowercase
/// letters, digits, `-` and `.`, starting and ending with a letter or digit (a DNS
/// subdomain; namespaces and container names are stricter labels of the same alphabet).
/// containerd only copies what the API server accepted; anything else did not come from
/// it, and nothing outside this alphabet reaches a table, a CSV cell or a log line.
pub fn valid_name(v: &str) -> bool {
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    !v.is_empty()
        && v.len() <= MAX_NAME
        && v.bytes().all(|b| alnum(b) || b == b'-' || b == b'.')
        && v.bytes().next().is_some_and(alnum)
        && v.bytes().last().is_some_and(alnum)
}

/// A sandbox id or pod uid: 1 to 253 of letters, digits, `-`, `_` and `.`, starting with
/// a letter or digit (containerd's 64-hex ids, Kubernetes' UUIDs).
pub fn valid_id(v: &str) -> bool {
    !v.is_empty()
        && v.len() <= MAX_NAME
        && v.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        && v.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
}

/// What one kind of value may be.
#[derive(Clone, Copy)]
enum Kind {
    Name,
    Id,
}

fn name(
    a: &BTreeMap<String, String>,
    key: &'static str,
    kind: Kind,
    required: bool,
) -> Result<Option<String>, CriError> {
    let Some(v) = get(a, key) else {
        return if required { Err(CriError::Missing { key }) } else { Ok(None) };
    };
    let (ok, expected) = match kind {
        Kind::Name => (valid_name(v), "a Kubernetes name (1 to 253 of a-z, 0-9, `-`, `.`)"),
        Kind::Id => (valid_id(v), "an id (1 to 253 of A-Z, a-z, 0-9, `-`, `_`, `.`)"),
    };
    if !ok {
        return Err(CriError::Malformed { key, value: v.to_owned(), expected });
    }
    Ok(Some(v.to_owned()))
}

impl Workload {
    /// Checks every field as [`PodContainer::from_annotations`] does (for a workload that
    /// was stored or sent rather than read from annotations).
    pub fn validate(&self) -> Result<(), String> {
        let names = [
            ("namespace", Some(&self.namespace)),
            ("pod", Some(&self.pod)),
            ("container", self.container.as_ref()),
        ];
        let ids = [("pod_uid", self.pod_uid.as_ref()), ("sandbox_id", Some(&self.sandbox_id))];
        for (field, v) in names {
            if let Some(v) = v.filter(|v| !valid_name(v)) {
                return Err(format!(
                    "workload {field} `{}` is not a Kubernetes name",
                    untrusted(v)
                ));
            }
        }
        for (field, v) in ids {
            if let Some(v) = v.filter(|v| !valid_id(v)) {
                return Err(format!("workload {field} `{}` is not an id", untrusted(v)));
            }
        }
        Ok(())
    }
}

impl PodContainer {
    /// `None` when the config is not a CRI container (no [`CONTAINER_TYPE`]).
    pub fn from_annotations(a: &BTreeMap<String, String>) -> Result<Option<Self>, CriError> {
        let Some(kind) = get(a, CONTAINER_TYPE) else { return Ok(None) };
        let role = match kind {
            TYPE_SANDBOX => Role::Sandbox,
            TYPE_CONTAINER => Role::Container(
                name(a, CONTAINER_NAME, Kind::Name, true)?
                    .ok_or(CriError::Missing { key: CONTAINER_NAME })?,
            ),
            other => {
                return Err(CriError::Malformed {
                    key: CONTAINER_TYPE,
                    value: other.to_owned(),
                    expected: "`sandbox` or `container`",
                })
            }
        };
        let missing = |key| CriError::Missing { key };
        let workload = Workload {
            namespace: name(a, SANDBOX_NAMESPACE, Kind::Name, true)?
                .ok_or(missing(SANDBOX_NAMESPACE))?,
            pod: name(a, SANDBOX_NAME, Kind::Name, true)?.ok_or(missing(SANDBOX_NAME))?,
            pod_uid: name(a, SANDBOX_UID, Kind::Id, false)?,
            container: match &role {
                Role::Sandbox => None,
                Role::Container(n) => Some(n.clone()),
            },
            sandbox_id: name(a, SANDBOX_ID, Kind::Id, true)?.ok_or(missing(SANDBOX_ID))?,
        };
        Ok(Some(PodContainer { role, workload }))
    }
}

/// Who a request annotation speaks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RequestScope {
    /// This container alone: `tessera.io/gpu.<name>` in a pod, or `tessera.io/gpu` outside
    /// one.
    Container,
    /// The bare `tessera.io/gpu` on a pod: every container of the pod carries it, so it
    /// holds only for a pod with one application container.
    Pod,
}

/// Where a container's GPU request is to be read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestSite {
    /// A sandbox container: no request, whatever it carries.
    Sandbox,
    /// The annotation `key` holds the request.
    Annotation { key: String, scope: RequestScope },
    /// No request annotation applies (the environment may still hold one).
    None,
}

/// The per-container request annotation of a container named `name`.
pub fn per_container_key(name: &str) -> String {
    format!("{REQUEST_ANNOTATION}.{name}")
}

/// Which annotation holds this container's request. Outside a pod it is the bare
/// `tessera.io/gpu`. In a pod: nothing for the sandbox; `tessera.io/gpu.<name>` for the
/// container `name`; otherwise the bare form, for the whole pod. A pod that carries both
/// forms is refused: which one would count is a guess.
pub fn request_site(a: &BTreeMap<String, String>) -> Result<RequestSite, CriError> {
    let Some(pc) = PodContainer::from_annotations(a)? else {
        return Ok(match a.contains_key(REQUEST_ANNOTATION) {
            true => RequestSite::Annotation {
                key: REQUEST_ANNOTATION.to_owned(),
                scope: RequestScope::Container,
            },
            false => RequestSite::None,
        });
    };
    let Role::Container(name) = &pc.role else { return Ok(RequestSite::Sandbox) };
    let prefix = format!("{REQUEST_ANNOTATION}.");
    let per: Vec<&str> =
        a.keys().filter(|k| k.starts_with(&prefix)).map(String::as_str).take(4).collect();
    if !per.is_empty() && a.contains_key(REQUEST_ANNOTATION) {
        return Err(CriError::MixedForms {
            pod: pc.workload.pod_name(),
            per_container: per.join(", "),
        });
    }
    let own = per_container_key(name);
    if a.contains_key(&own) {
        return Ok(RequestSite::Annotation { key: own, scope: RequestScope::Container });
    }
    if a.contains_key(REQUEST_ANNOTATION) {
        return Ok(RequestSite::Annotation {
            key: REQUEST_ANNOTATION.to_owned(),
            scope: RequestScope::Pod,
        });
    }
    Ok(RequestSite::None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ann(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn pod(kind: &str, name: Option<&str>, extra: &[(&str, &str)]) -> BTreeMap<String, String> {
        let mut a = ann(&[
            (CONTAINER_TYPE, kind),
            (SANDBOX_ID, "0123abcd"),
            (SANDBOX_NAME, "trainer"),
            (SANDBOX_NAMESPACE, "team-a"),
        ]);
        if let Some(n) = name {
            a.insert(CONTAINER_NAME.into(), n.into());
        }
        a.extend(ann(extra));
        a
    }

    #[test]
    fn outside_a_pod_only_the_bare_annotation_counts() {
        let a = ann(&[("tessera.io/gpu", "gpu=1"), ("tessera.io/gpu.main", "mig=1g.10gb")]);
        assert_eq!(
            request_site(&a).unwrap(),
            RequestSite::Annotation {
                key: "tessera.io/gpu".into(),
                scope: RequestScope::Container
            }
        );
        assert_eq!(request_site(&ann(&[("x", "y")])).unwrap(), RequestSite::None);
    }

    #[test]
    fn a_sandbox_never_has_a_request_whatever_it_carries() {
        let a = pod(
            TYPE_SANDBOX,
            None,
            &[("tessera.io/gpu", "gpu=1"), ("tessera.io/gpu.pause", "gpu=1")],
        );
        assert_eq!(request_site(&a).unwrap(), RequestSite::Sandbox);
        let pc = PodContainer::from_annotations(&a).unwrap().unwrap();
        assert_eq!(pc.role, Role::Sandbox);
        assert_eq!(pc.workload.display_name(), "team-a/trainer");
    }

    #[test]
    fn the_per_container_form_selects_by_container_name() {
        let extra = [("tessera.io/gpu.main", "mig=1g.10gb"), ("tessera.io/gpu.side", "gpu=1")];
        let main = pod(TYPE_CONTAINER, Some("main"), &extra);
        assert_eq!(
            request_site(&main).unwrap(),
            RequestSite::Annotation {
                key: "tessera.io/gpu.main".into(),
                scope: RequestScope::Container
            }
        );
        let other = pod(TYPE_CONTAINER, Some("logger"), &extra);
        assert_eq!(request_site(&other).unwrap(), RequestSite::None);
        let w = PodContainer::from_annotations(&main).unwrap().unwrap().workload;
        assert_eq!(w.display_name(), "team-a/trainer/main");
        assert_eq!(w.sandbox_id, "0123abcd");
    }

    #[test]
    fn the_bare_form_in_a_pod_speaks_for_the_pod() {
        let a = pod(TYPE_CONTAINER, Some("main"), &[("tessera.io/gpu", "gpu=1")]);
        assert_eq!(
            request_site(&a).unwrap(),
            RequestSite::Annotation { key: "tessera.io/gpu".into(), scope: RequestScope::Pod }
        );
    }

    #[test]
    fn mixing_the_forms_is_refused_naming_both() {
        let a = pod(
            TYPE_CONTAINER,
            Some("main"),
            &[("tessera.io/gpu", "gpu=1"), ("tessera.io/gpu.main", "gpu=1")],
        );
        let e = request_site(&a).unwrap_err().to_string();
        assert!(e.contains("team-a/trainer") && e.contains("tessera.io/gpu.main"), "{e}");
        assert!(e.contains("use only the per-container form"), "{e}");
    }

    #[test]
    fn malformed_or_missing_cri_annotations_are_errors_not_guesses() {
        let bad_type = pod("pause", None, &[]);
        assert!(matches!(
            request_site(&bad_type),
            Err(CriError::Malformed { key: CONTAINER_TYPE, .. })
        ));
        let no_name = pod(TYPE_CONTAINER, None, &[("tessera.io/gpu", "gpu=1")]);
        assert_eq!(request_site(&no_name), Err(CriError::Missing { key: CONTAINER_NAME }));
        let slash = pod(TYPE_CONTAINER, Some("a/b"), &[]);
        let e = request_site(&slash).unwrap_err().to_string();
        assert!(e.contains(CONTAINER_NAME) && e.contains("a/b"), "{e}");
        let mut no_ns = pod(TYPE_CONTAINER, Some("main"), &[]);
        no_ns.remove(SANDBOX_NAMESPACE);
        assert_eq!(request_site(&no_ns), Err(CriError::Missing { key: SANDBOX_NAMESPACE }));
        for bad in ["=1+2", "-", "Main", "a\\b", "main-", ".x"] {
            let e = request_site(&pod(TYPE_CONTAINER, Some(bad), &[])).unwrap_err();
            assert!(matches!(e, CriError::Malformed { key: CONTAINER_NAME, .. }), "{bad}: {e}");
        }
        assert!(valid_name("trainer-0.a") && valid_id("0123abcd-ef") && !valid_id("-x"));
        let ctl = pod(TYPE_CONTAINER, Some("m\u{1b}[2J"), &[]);
        let e = request_site(&ctl).unwrap_err().to_string();
        assert!(!e.contains('\u{1b}'), "escaped: {e}");
    }
}
