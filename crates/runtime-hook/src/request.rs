//! Finding a container's GPU request in its config.json.
//!
//! A request is an annotation or, failing that, `TESSERA_GPU=...` in `process.env`. Which
//! annotation is [`tessera_api::cri::request_site`]'s call: `tessera.io/gpu` outside a pod;
//! in a pod (containerd's CRI annotations) `tessera.io/gpu.<container-name>`, or the bare
//! form for the whole pod, and nothing at all for the sandbox (pause) container. It is only
//! a request: who the container belongs to is the daemon's business (it reads the
//! annotations its policy trusts). Nothing else in the environment counts:
//! `NVIDIA_VISIBLE_DEVICES=all` from an image grants nothing.
//!
//! The device plugin's assignment (`tessera.io/device-plugin`) is kubelet's word: it is
//! honoured only where the runtime configuration is the one of the engine kubelet drives
//! (`kubelet = true`) and containerd's CRI annotations say the config is a pod's
//! container ([`check_assignment_source`]); tesserad then also wants its token.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;
use tessera_api::cri::{self, CriError, RequestScope, RequestSite};
use tessera_api::deviceplugin::{AssignmentError, IssuedAssignment, ASSIGNMENT_ANNOTATION};
use tessera_api::{untrusted, GpuRequest, RequestError, RequestSource, REQUEST_ENV};

/// Why a config's request (or annotations) could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestLookupError {
    #[error("malformed GPU request `{}` in {location}: {source}", untrusted(.raw))]
    Malformed { raw: String, location: String, source: RequestError },
    #[error(
        "conflicting GPU requests in process.env: `{REQUEST_ENV}={}` and `{REQUEST_ENV}={}`",
        untrusted(.first),
        untrusted(.second)
    )]
    Conflicting { first: String, second: String },
    #[error("malformed config at `{}`: {}", untrusted(.path), untrusted(.message))]
    Shape { path: String, message: String },
    #[error(transparent)]
    Pod(#[from] CriError),
    #[error("malformed device-plugin assignment in annotation {ASSIGNMENT_ANNOTATION}: {0}")]
    Assignment(#[from] AssignmentError),
    #[error(
        "two GPU requests for one container: {first} and {second}; a container asks in one place only"
    )]
    TwoRequests { first: String, second: String },
    #[error(
        "annotation {ASSIGNMENT_ANNOTATION} is kubelet's (the device plugin's Allocate) and is honoured only in a pod's \
         container that containerd's CRI plugin creates for kubelet: {why}; a config author asks with \
         `tessera.io/gpu` or TESSERA_GPU instead"
    )]
    NotFromKubelet { why: String },
}

/// A GPU request found in a config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoundRequest {
    pub request: GpuRequest,
    /// The text as written in the config.
    pub raw: String,
    pub source: RequestSource,
    /// The annotation it was read from (`None`: the environment).
    pub key: Option<String>,
    /// Whom it speaks for: this container, or (the bare form on a pod) the whole pod.
    pub scope: RequestScope,
}

impl FoundRequest {
    /// Where it was found, for messages.
    pub fn location(&self) -> String {
        location(self.key.as_deref())
    }
}

fn location(key: Option<&str>) -> String {
    match key {
        Some(key) => format!("annotation {key}"),
        None => format!("process.env {REQUEST_ENV}"),
    }
}

/// The parts of a config this module reads. Unknown fields are ignored (this is a view of
/// a document that runc validates, not a schema of it).
#[derive(Deserialize)]
struct View<'a> {
    #[serde(default, borrow)]
    annotations: Option<BTreeMap<&'a str, &'a str>>,
    #[serde(default, borrow)]
    process: Option<ProcessView<'a>>,
}

#[derive(Deserialize)]
struct ProcessView<'a> {
    #[serde(default, borrow)]
    env: Option<Vec<&'a str>>,
}

fn view(config: &Value) -> Result<View<'_>, RequestLookupError> {
    serde_path_to_error::deserialize(config).map_err(|e| RequestLookupError::Shape {
        path: e.path().to_string(),
        message: e.inner().to_string(),
    })
}

/// Finds the GPU request in a parsed config.json: an annotation wins over the env; a pod's
/// sandbox has none, whatever it carries. A device-plugin assignment
/// ([`ASSIGNMENT_ANNOTATION`], set by kubelet from tesserad's Allocate) is the request of
/// its container, and may not come with another one. A request that is present but does
/// not parse is an error (fail closed), never "no request".
pub fn find_request(config: &Value) -> Result<Option<FoundRequest>, RequestLookupError> {
    let v = view(config)?;
    let annotations: BTreeMap<String, String> = v
        .annotations
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    let site = cri::request_site(&annotations)?;
    // Read only where no annotation applies: an annotation wins over whatever is there.
    let env = env_request(v.process.and_then(|p| p.env).unwrap_or_default());
    if let (Some(raw), false) =
        (annotations.get(ASSIGNMENT_ANNOTATION), matches!(site, RequestSite::Sandbox))
    {
        let issued: IssuedAssignment = raw.parse()?;
        let other = match (&site, env) {
            (RequestSite::Annotation { key, .. }, _) => Some(location(Some(key))),
            (_, Ok(Some(_)) | Err(_)) => Some(location(None)),
            (_, Ok(None)) => None,
        };
        if let Some(second) = other {
            return Err(RequestLookupError::TwoRequests {
                first: location(Some(ASSIGNMENT_ANNOTATION)),
                second,
            });
        }
        return Ok(Some(FoundRequest {
            request: issued.assignment().request()?,
            raw: raw.clone(),
            source: RequestSource::Annotation,
            key: Some(ASSIGNMENT_ANNOTATION.to_owned()),
            scope: RequestScope::Container,
        }));
    }
    match site {
        RequestSite::Sandbox => Ok(None),
        RequestSite::Annotation { key, scope } => {
            let raw = &annotations[&key];
            parse(raw, RequestSource::Annotation, Some(key.clone()), scope).map(Some)
        }
        RequestSite::None => env?
            .map(|raw| parse(raw, RequestSource::Env, None, RequestScope::Container))
            .transpose(),
    }
}

/// Where the runtime reads its configuration, as far as the device plugin's assignment
/// is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineSource {
    /// The file read (`None`: the default file was absent, so all defaults).
    pub config: Option<std::path::PathBuf>,
    /// Its `kubelet = true`.
    pub kubelet: bool,
}

/// Refuses a config that carries a device-plugin assignment ([`ASSIGNMENT_ANNOTATION`])
/// and did not come from kubelet, before the annotation is read: the runtime configuration
/// must be the kubelet engine's (`kubelet = true`, which `tessera setup containerd` writes
/// for its handler: only containerd's CRI plugin runs it, and it passes container
/// annotations only from kubelet, never from pods) and containerd's own CRI annotations
/// must say it is a pod's container. A config without the annotation passes, and so does
/// a pod's sandbox (it asks for nothing, whatever it carries).
pub fn check_assignment_source(
    annotations: &BTreeMap<String, String>,
    engine: &EngineSource,
) -> Result<(), RequestLookupError> {
    if !annotations.contains_key(ASSIGNMENT_ANNOTATION)
        || matches!(cri::request_site(annotations), Ok(RequestSite::Sandbox))
    {
        return Ok(());
    }
    let why = if !engine.kubelet {
        let file = match &engine.config {
            Some(p) => format!("this runtime configuration, {},", untrusted(&p.to_string_lossy())),
            None => {
                format!("no runtime configuration ({} is absent)", crate::config::DEFAULT_CONFIG)
            }
        };
        Some(format!(
            "{file} is not the kubelet engine's (`kubelet = true`, which `tessera setup containerd` \
             writes for its handler)"
        ))
    } else {
        match cri::PodContainer::from_annotations(annotations) {
            Ok(Some(pc)) if matches!(pc.role, cri::Role::Container(_)) => None,
            Ok(Some(_)) => Some("the config is a pod's sandbox".to_string()),
            Ok(None) => Some(format!(
                "the config carries no CRI annotations ({} is absent)",
                cri::CONTAINER_TYPE
            )),
            Err(e) => Some(e.to_string()),
        }
    };
    match why {
        Some(why) => Err(RequestLookupError::NotFromKubelet { why }),
        None => Ok(()),
    }
}

/// The value of `TESSERA_GPU` in a process environment; two different ones are an error.
fn env_request(env: Vec<&str>) -> Result<Option<&str>, RequestLookupError> {
    let prefix = concat_env_prefix();
    let mut found: Option<&str> = None;
    for entry in env {
        let Some(value) = entry.strip_prefix(prefix.as_str()) else { continue };
        match found {
            Some(first) if first != value => {
                return Err(RequestLookupError::Conflicting {
                    first: first.to_string(),
                    second: value.to_string(),
                })
            }
            _ => found = Some(value),
        }
    }
    Ok(found)
}

fn concat_env_prefix() -> String {
    format!("{REQUEST_ENV}=")
}

fn parse(
    raw: &str,
    source: RequestSource,
    key: Option<String>,
    scope: RequestScope,
) -> Result<FoundRequest, RequestLookupError> {
    let request = raw.parse::<GpuRequest>().map_err(|e| RequestLookupError::Malformed {
        raw: raw.to_string(),
        location: location(key.as_deref()),
        source: e,
    })?;
    Ok(FoundRequest { request, raw: raw.to_string(), source, key, scope })
}

/// What in a config that asks for no GPU looks as if it meant to (each a sentence for the
/// person who started it): `NVIDIA_VISIBLE_DEVICES` naming devices (NVIDIA's toolkit read
/// it; an image's `ENV` or `-e` is no request here), and in a pod's container a
/// `tessera.io/gpu.<name>` whose name is this container's misspelt (at most two edits
/// away). tessera-runtime prints them on its stderr, which is the container's own while
/// runc creates it: `docker run`, `docker logs`, `podman logs` and `kubectl logs` show them.
pub fn hints(config: &Value, annotations: &BTreeMap<String, String>) -> Vec<String> {
    let mut out = Vec::new();
    let env = view(config).ok().and_then(|v| v.process.and_then(|p| p.env)).unwrap_or_default();
    let visible = env.iter().rev().find_map(|e| e.strip_prefix("NVIDIA_VISIBLE_DEVICES="));
    if let Some(v) = visible.filter(|v| !matches!(v.trim(), "" | "void" | "none")) {
        out.push(format!(
            "NVIDIA_VISIBLE_DEVICES={} in this container's environment grants nothing on a Tessera node \
             (no GPU, no device); ask with `--gpus N` (Docker), a CDI device `tessera.io/gpu=…`, the \
             annotation tessera.io/gpu or TESSERA_GPU",
            untrusted(v).max_chars(64)
        ));
    }
    if let Ok(Some(pc)) = cri::PodContainer::from_annotations(annotations) {
        if let cri::Role::Container(name) = &pc.role {
            let prefix = format!("{}.", tessera_api::REQUEST_ANNOTATION);
            for key in annotations.keys() {
                let Some(other) = key.strip_prefix(&prefix) else { continue };
                if other != name.as_str() && edit_distance(other, name) <= 2 {
                    out.push(format!(
                        "annotation {} asks for a container named `{}`, and this one is `{}`: it \
                         asks for nothing (a misspelt container name?)",
                        untrusted(key).max_chars(80),
                        untrusted(other).max_chars(63),
                        untrusted(name).max_chars(63)
                    ));
                }
            }
        }
    }
    out
}

/// Levenshtein distance of two short names (bounded: names are at most 253 bytes).
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.iter().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != cb)).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// Every annotation of the config (all of them: the daemon picks the ones it trusts).
pub fn annotations(config: &Value) -> Result<BTreeMap<String, String>, RequestLookupError> {
    Ok(view(config)?
        .annotations
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn hints_that_grant_nothing_are_said() {
        let c = json!({"process": {"env": ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=all"]}});
        let h = hints(&c, &BTreeMap::new());
        assert_eq!(h.len(), 1);
        assert!(h[0].starts_with(
            "NVIDIA_VISIBLE_DEVICES=all in this container's environment grants nothing"
        ));
        for quiet in ["void", "none", ""] {
            let c = json!({"process": {"env": [format!("NVIDIA_VISIBLE_DEVICES={quiet}")]}});
            assert!(hints(&c, &BTreeMap::new()).is_empty(), "{quiet}");
        }
        let pod = |name: &str, extra: &[(&str, &str)]| {
            let mut a: BTreeMap<String, String> = [
                ("io.kubernetes.cri.container-type", "container"),
                ("io.kubernetes.cri.container-name", name),
                ("io.kubernetes.cri.sandbox-id", "s1"),
                ("io.kubernetes.cri.sandbox-name", "p"),
                ("io.kubernetes.cri.sandbox-namespace", "ns"),
            ]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
            a.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
            a
        };
        let h = hints(&json!({}), &pod("main", &[("tessera.io/gpu.mian", "gpu=1")]));
        assert_eq!(h.len(), 1, "{h:?}");
        assert!(h[0].contains("`mian`, and this one is `main`"), "{}", h[0]);
        // A sidecar beside the asking container is not told off.
        assert!(
            hints(&json!({}), &pod("log-shipper", &[("tessera.io/gpu.main", "gpu=1")])).is_empty()
        );
        assert_eq!(edit_distance("trainer", "trianer"), 2);
    }

    fn config(annotations: Value, env: Value) -> Value {
        json!({
            "ociVersion": "1.0.2-dev",
            "process": {"args": ["sh"], "cwd": "/", "env": env},
            "root": {"path": "rootfs"},
            "annotations": annotations,
            "linux": {}
        })
    }

    #[test]
    fn annotation_request() {
        let c = config(json!({"tessera.io/gpu": "mig=1g.10gb"}), json!(["PATH=/bin"]));
        let r = find_request(&c).expect("ok").expect("some");
        assert_eq!(r.request, GpuRequest::Mig { profile: "1g.10gb".into() });
        assert_eq!(r.source, RequestSource::Annotation);
        assert_eq!(r.raw, "mig=1g.10gb");
    }

    #[test]
    fn annotation_wins_over_env() {
        let c = config(json!({"tessera.io/gpu": "gpu=1"}), json!(["TESSERA_GPU=mps=50"]));
        let r = find_request(&c).expect("ok").expect("some");
        assert_eq!(r.request, GpuRequest::Gpu { count: 1 });
        assert_eq!(r.source, RequestSource::Annotation);
    }

    #[test]
    fn env_request() {
        let c = config(json!({}), json!(["PATH=/bin", "TESSERA_GPU=mps=25"]));
        let r = find_request(&c).expect("ok").expect("some");
        assert_eq!(r.request, GpuRequest::Mps { percent: 25 });
        assert_eq!(r.source, RequestSource::Env);
        assert_eq!(r.location(), "process.env TESSERA_GPU");
    }

    #[test]
    fn nvidia_env_is_not_a_request() {
        let c = config(
            json!({"other": "x"}),
            json!([
                "NVIDIA_VISIBLE_DEVICES=all",
                "NVIDIA_DRIVER_CAPABILITIES=all",
                "CUDA_VISIBLE_DEVICES=0",
                "TESSERA_GPUX=gpu=1",
                "XTESSERA_GPU=gpu=1"
            ]),
        );
        assert_eq!(find_request(&c), Ok(None));
        // Nothing at all.
        assert_eq!(find_request(&json!({"ociVersion": "1.0.2"})), Ok(None));
        assert_eq!(find_request(&json!({"annotations": null, "process": {"env": null}})), Ok(None));
    }

    #[test]
    fn malformed_requests_fail_closed() {
        for bad in ["", "gpu=0", "tpu=1", "mig=big", "shared=1"] {
            let c = config(json!({"tessera.io/gpu": bad}), json!([]));
            let err = find_request(&c).expect_err("must fail");
            assert!(matches!(err, RequestLookupError::Malformed { .. }), "{bad}: {err}");
            assert!(err.to_string().contains("annotation tessera.io/gpu"), "{err}");
        }
        let c = config(json!({}), json!(["TESSERA_GPU=gpu=many"]));
        let err = find_request(&c).expect_err("must fail").to_string();
        assert!(err.contains("`gpu=many`") && err.contains("process.env TESSERA_GPU"), "{err}");
        // A malformed env request behind a valid annotation is not consulted.
        let c = config(json!({"tessera.io/gpu": "shared"}), json!(["TESSERA_GPU=junk"]));
        assert!(find_request(&c).expect("ok").is_some());
    }

    #[test]
    fn conflicting_env_requests_fail_closed() {
        let c = config(json!({}), json!(["TESSERA_GPU=gpu=1", "TESSERA_GPU=gpu=2"]));
        assert!(matches!(find_request(&c), Err(RequestLookupError::Conflicting { .. })));
        let c = config(json!({}), json!(["TESSERA_GPU=gpu=1", "TESSERA_GPU=gpu=1"]));
        assert!(find_request(&c).expect("ok").is_some());
    }

    #[test]
    fn shape_errors_name_the_path() {
        let c = config(json!({"tessera.io/gpu": 1}), json!([]));
        let err = find_request(&c).expect_err("must fail");
        assert!(
            matches!(&err, RequestLookupError::Shape { path, .. } if path == "annotations.tessera.io/gpu"),
            "{err}"
        );
        let c = config(json!({}), json!(["A=1", 7]));
        let err = find_request(&c).expect_err("must fail");
        assert!(
            matches!(&err, RequestLookupError::Shape { path, .. } if path == "process.env[1]"),
            "{err}"
        );
    }

    #[test]
    fn annotations_are_all_passed_on() {
        let c = config(
            json!({"io.kubernetes.cri.sandbox-namespace": "team-a", "tessera.io/gpu": "shared", "x": ""}),
            json!([]),
        );
        let a = annotations(&c).expect("ok");
        assert_eq!(a.len(), 3);
        assert_eq!(a["io.kubernetes.cri.sandbox-namespace"], "team-a");
        assert!(annotations(&json!({})).expect("ok").is_empty());
    }
    fn pod(kind: &str, name: &str, extra: Value) -> Value {
        let mut a = json!({
            "io.kubernetes.cri.container-type": kind,
            "io.kubernetes.cri.sandbox-id": "f00d",
            "io.kubernetes.cri.sandbox-name": "trainer",
            "io.kubernetes.cri.sandbox-namespace": "team-a",
        });
        if kind == "container" {
            a["io.kubernetes.cri.container-name"] = json!(name);
        }
        for (k, v) in extra.as_object().expect("object") {
            a[k] = v.clone();
        }
        config(a, json!(["TESSERA_GPU=gpu=1"]))
    }

    #[test]
    fn a_sandbox_has_no_request_even_with_annotations_and_env() {
        let c = pod("sandbox", "", json!({"tessera.io/gpu": "gpu=1", "tessera.io/gpu.x": "gpu=2"}));
        assert_eq!(find_request(&c), Ok(None));
    }

    #[test]
    fn pod_containers_read_their_own_annotation_then_the_pod_one() {
        let c = pod("container", "main", json!({"tessera.io/gpu.main": "mig=1g.10gb"}));
        let r = find_request(&c).expect("ok").expect("some");
        assert_eq!(r.request, GpuRequest::Mig { profile: "1g.10gb".into() });
        assert_eq!(
            (r.location().as_str(), r.scope),
            ("annotation tessera.io/gpu.main", RequestScope::Container)
        );
        // Another container of the same pod: its env request, not main's annotation.
        let c = pod("container", "side", json!({"tessera.io/gpu.main": "mig=1g.10gb"}));
        let r = find_request(&c).expect("ok").expect("some");
        assert_eq!((r.source, r.scope), (RequestSource::Env, RequestScope::Container));
        let c = pod("container", "main", json!({"tessera.io/gpu": "gpu=2"}));
        let r = find_request(&c).expect("ok").expect("some");
        assert_eq!((r.request, r.scope), (GpuRequest::Gpu { count: 2 }, RequestScope::Pod));
        let c = pod("container", "main", json!({"tessera.io/gpu.main": "gpu=many"}));
        let e = find_request(&c).expect_err("malformed").to_string();
        assert!(e.contains("annotation tessera.io/gpu.main"), "{e}");
        let c = pod(
            "container",
            "main",
            json!({"tessera.io/gpu": "gpu=1", "tessera.io/gpu.main": "gpu=1"}),
        );
        assert!(matches!(
            find_request(&c),
            Err(RequestLookupError::Pod(CriError::MixedForms { .. }))
        ));
    }

    const ISSUED: &str =
        "v2;tessera.io/gpu;GPU-0a1b2c3d-0000-0000-0000-000000000001;0123456789abcdef0123456789abcdef";

    #[test]
    fn a_device_plugin_assignment_is_the_request_and_stands_alone() {
        let assignment = ISSUED;
        let parsed: IssuedAssignment = assignment.parse().expect("a valid assignment");
        let parsed = parsed.assignment().clone();
        let c = pod("container", "main", json!({ASSIGNMENT_ANNOTATION: assignment}));
        // `pod` puts TESSERA_GPU in the env: that is a second request.
        let e = find_request(&c).expect_err("two requests").to_string();
        assert!(
            e.contains("annotation tessera.io/device-plugin") && e.contains("process.env"),
            "{e}"
        );
        let mut c = pod("container", "main", json!({ASSIGNMENT_ANNOTATION: assignment}));
        c["process"]["env"] = json!(["PATH=/bin"]);
        let r = find_request(&c).expect("ok").expect("some");
        assert_eq!(r.request, parsed.request().expect("a request"));
        assert_eq!(r.location(), "annotation tessera.io/device-plugin");
        let c = pod(
            "container",
            "main",
            json!({ASSIGNMENT_ANNOTATION: assignment, "tessera.io/gpu.main": "gpu=1"}),
        );
        let e = find_request(&c).expect_err("two requests").to_string();
        assert!(e.contains("tessera.io/gpu.main"), "{e}");
        let c = pod("container", "main", json!({ASSIGNMENT_ANNOTATION: "v9;x;y"}));
        assert!(matches!(find_request(&c), Err(RequestLookupError::Assignment(_))));
        // The sandbox: nothing, even with an assignment.
        let c = pod("sandbox", "", json!({ASSIGNMENT_ANNOTATION: assignment}));
        assert_eq!(find_request(&c), Ok(None));
        // An assignment without a token (the v1 text) is refused, naming what is missing.
        let mut c = pod(
            "container",
            "main",
            json!({ASSIGNMENT_ANNOTATION: "v1;tessera.io/gpu;GPU-0a1b2c3d-0000-0000-0000-000000000001"}),
        );
        c["process"]["env"] = json!(["PATH=/bin"]);
        let e = find_request(&c).expect_err("no token").to_string();
        assert!(e.contains("carries no token"), "{e}");
    }

    #[test]
    fn an_assignment_is_honoured_only_from_the_kubelet_engine_for_a_pods_container() {
        let kubelet = EngineSource {
            config: Some("/usr/local/lib/tessera/containerd-tessera.toml".into()),
            kubelet: true,
        };
        let other =
            EngineSource { config: Some("/etc/tessera/runtime.toml".into()), kubelet: false };
        let no_file = EngineSource { config: None, kubelet: false };
        let check = |c: &Value, engine: &EngineSource| {
            check_assignment_source(&annotations(c).expect("annotations"), engine)
        };
        let mut in_pod = pod("container", "main", json!({ASSIGNMENT_ANNOTATION: ISSUED}));
        in_pod["process"]["env"] = json!(["PATH=/bin"]);
        assert_eq!(check(&in_pod, &kubelet), Ok(()));
        // Any other engine's configuration: refused, naming the annotation, the file and why.
        let e = check(&in_pod, &other).expect_err("not kubelet's engine").to_string();
        assert!(
            e.contains("annotation tessera.io/device-plugin is kubelet's")
                && e.contains("/etc/tessera/runtime.toml")
                && e.contains("`kubelet = true`"),
            "{e}"
        );
        let e = check(&in_pod, &no_file).expect_err("no file").to_string();
        assert!(e.contains("/etc/tessera/runtime.toml is absent"), "{e}");
        // The kubelet engine, but a plain config (runc, ctr, podman): no CRI annotations.
        let plain = config(json!({ASSIGNMENT_ANNOTATION: ISSUED}), json!(["PATH=/bin"]));
        let e = check(&plain, &kubelet).expect_err("no pod").to_string();
        assert!(e.contains("io.kubernetes.cri.container-type is absent"), "{e}");
        assert!(check(&plain, &other).is_err());
        // Checked before the annotation is read: a forged text without a token is refused
        // for where it comes from, not for its form.
        let v1 = config(json!({ASSIGNMENT_ANNOTATION: "v1;tessera.io/gpu;GPU-1"}), json!([]));
        let e = check(&v1, &other).expect_err("v1 from a config author").to_string();
        assert!(e.contains("is kubelet's"), "{e}");
        // Requests of every other kind pass whatever the engine, and so does a sandbox.
        let c = config(json!({"tessera.io/gpu": "gpu=1"}), json!([]));
        assert_eq!(check(&c, &other), Ok(()));
        assert_eq!(check(&c, &no_file), Ok(()));
        let sandbox = pod("sandbox", "", json!({ASSIGNMENT_ANNOTATION: ISSUED}));
        assert_eq!(check(&sandbox, &other), Ok(()));
    }
}
