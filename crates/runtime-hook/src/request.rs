//! Finding a container's GPU request in its config.json.
//!
//! A request is the annotation [`REQUEST_ANNOTATION`] (`tessera.io/gpu`) or, failing that,
//! `TESSERA_GPU=...` in `process.env`. It is only a request: who the container belongs to
//! is the daemon's business (it reads the annotations its policy trusts). Nothing else in
//! the environment counts: `NVIDIA_VISIBLE_DEVICES=all` from an image grants nothing.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::Value;
use tessera_api::{
    untrusted, GpuRequest, RequestError, RequestSource, REQUEST_ANNOTATION, REQUEST_ENV,
};

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
}

/// A GPU request found in a config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoundRequest {
    pub request: GpuRequest,
    /// The text as written in the config.
    pub raw: String,
    pub source: RequestSource,
}

impl FoundRequest {
    /// Where it was found, for messages.
    pub fn location(&self) -> String {
        location(self.source)
    }
}

fn location(source: RequestSource) -> String {
    match source {
        RequestSource::Annotation => format!("annotation {REQUEST_ANNOTATION}"),
        RequestSource::Env => format!("process.env {REQUEST_ENV}"),
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

/// Finds the GPU request in a parsed config.json: the annotation wins over the env. A
/// request that is present but does not parse is an error (fail closed), never "no request".
pub fn find_request(config: &Value) -> Result<Option<FoundRequest>, RequestLookupError> {
    let v = view(config)?;
    if let Some(raw) = v.annotations.as_ref().and_then(|a| a.get(REQUEST_ANNOTATION)) {
        return parse(raw, RequestSource::Annotation).map(Some);
    }
    let prefix = concat_env_prefix();
    let mut found: Option<&str> = None;
    for entry in v.process.and_then(|p| p.env).unwrap_or_default() {
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
    found.map(|raw| parse(raw, RequestSource::Env)).transpose()
}

fn concat_env_prefix() -> String {
    format!("{REQUEST_ENV}=")
}

fn parse(raw: &str, source: RequestSource) -> Result<FoundRequest, RequestLookupError> {
    let request = raw.parse::<GpuRequest>().map_err(|e| RequestLookupError::Malformed {
        raw: raw.to_string(),
        location: location(source),
        source: e,
    })?;
    Ok(FoundRequest { request, raw: raw.to_string(), source })
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
}
