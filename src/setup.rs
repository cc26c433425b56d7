//! `tessera setup`: what an engine's configuration needs to run containers through
//! tessera-runtime, as a pure edit of the configuration text (the command line reads,
//! backs up and writes the file).
//!
//! containerd: a CRI runtime handler (`tessera` by default) of type
//! `io.containerd.runc.v2` whose `BinaryName` is a link to tessera-runtime
//! ([`kubelet_link`]: `<runtime dir>/containerd-<handler>`) with the handler's own runtime
//! configuration beside it ([`kubelet_runtime_config`]: `kubelet = true`, the mark of the
//! engine kubelet drives), which passes through the pod annotations that carry GPU
//! requests (`tessera.io/gpu*`) and the container annotation the device plugin's Allocate
//! sets (`tessera.io/device-plugin`). Config version 2 (containerd 1.6, 1.7) and 3 (2.x).
//! Everything else in the file is kept as written.
//!
//! Docker: daemon.json's `runtimes.tessera.path` (and `runtimeArgs` naming a runtime
//! configuration file), every other key kept in order ([`docker`]). podman: containers.conf's
//! `[engine.runtimes] tessera = [PATH]` ([`podman`]).

use std::fmt;

use tessera_api::deviceplugin::ASSIGNMENT_ANNOTATION;
use tessera_api::untrusted;
use toml_edit::{value, Array, DocumentMut, Item, Table};

/// The pod annotation pattern a handler passes through (containerd matches with Go's
/// `path.Match`: `*` does not cross a `/`): `tessera.io/gpu` and `tessera.io/gpu.<name>`.
pub const POD_ANNOTATIONS: &str = "tessera.io/gpu*";

/// Why a configuration cannot be set up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SetupError {
    #[error("{path} is not valid TOML: {}", untrusted(.message))]
    Parse { path: String, message: String },
    #[error("{path} is not valid JSON: {}", untrusted(.message))]
    ParseJson { path: String, message: String },
    #[error(
        "{path} has no `version` key: containerd 1.x reads that as a version 1 configuration, \
         which Tessera does not edit; convert it first with `containerd config migrate > NEW` \
         (containerd 1.7 and later) or add the runtime by hand"
    )]
    VersionOne { path: String },
    #[error("{path}: `version` is {}; expected 2 (containerd 1.6, 1.7) or 3 (containerd 2.x)", untrusted(.found))]
    UnknownVersion { path: String, found: String },
    #[error("{path}: `{key}` is a {found}, expected a table")]
    NotATable { path: String, key: String, found: String },
    #[error("{path}: `{key}` is not an array of strings")]
    NotStrings { path: String, key: String },
    #[error(
        "{path}: pod_annotations pattern `{}` of runtime `{handler}` passes `{ASSIGNMENT_ANNOTATION}` \
         from pod annotations, so a pod author could forge a device-plugin assignment; \
         remove it (Tessera needs only `{POD_ANNOTATIONS}`)",
        untrusted(.pattern)
    )]
    ForgeablePattern { path: String, handler: String, pattern: String },
    #[error("invalid option: {0}")]
    Option(String),
    #[error(
        "containerd reads {path} differently from what was written: {what} (an `imports` file \
         may override the handler; `containerd --config {path} config dump` shows what containerd sees)"
    )]
    Overridden { path: String, what: String },
}

impl From<crate::engines::EngineConfigError> for SetupError {
    fn from(e: crate::engines::EngineConfigError) -> Self {
        match e {
            crate::engines::EngineConfigError::Toml { path, message } => {
                SetupError::Parse { path, message }
            }
            crate::engines::EngineConfigError::Json { path, message } => {
                SetupError::ParseJson { path, message }
            }
        }
    }
}

/// What `tessera setup containerd` writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerdOptions {
    /// The runtime handler's name (the RuntimeClass `handler`).
    pub handler: String,
    /// tessera-runtime, absolute.
    pub runtime_path: String,
    /// Make the handler containerd's default runtime.
    pub set_default: bool,
    /// The config version to write into an empty file (2 or 3).
    pub empty_version: i64,
}

/// The text before and after an edit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Edit {
    pub before: String,
    pub after: String,
    /// The config version edited (2 or 3; 0 for Docker's and podman's files, which have none).
    pub version: i64,
}

impl Edit {
    pub fn changed(&self) -> bool {
        self.before != self.after
    }
    /// A unified diff of the edit, with `path` in its headers.
    pub fn diff(&self, path: &str) -> String {
        similar::TextDiff::from_lines(&self.before, &self.after)
            .unified_diff()
            .header(path, path)
            .to_string()
    }
}

impl fmt::Display for Edit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.after)
    }
}

/// The CRI plugin's table of a config version.
fn cri_plugin(version: i64) -> &'static str {
    if version >= 3 {
        "io.containerd.cri.v1.runtime"
    } else {
        "io.containerd.grpc.v1.cri"
    }
}

/// Go's `path.Match` for the patterns containerd takes: `*` (any run of non-`/`), `?`
/// (one non-`/`), and literal characters; a `[` class is treated as matching (the
/// conservative answer for a safety check).
fn go_path_match(pattern: &[u8], name: &[u8]) -> bool {
    match pattern.split_first() {
        None => name.is_empty(),
        Some((b'*', rest)) => (0..=name.len())
            .take_while(|&i| i == 0 || name[i - 1] != b'/')
            .any(|i| go_path_match(rest, &name[i..])),
        Some((b'?', rest)) => {
            matches!(name.split_first(), Some((c, tail)) if *c != b'/' && go_path_match(rest, tail))
        }
        Some((b'[', _)) => true,
        Some((b'\\', rest)) if !rest.is_empty() => {
            matches!(name.split_first(), Some((c, tail)) if *c == rest[0] && go_path_match(&rest[1..], tail))
        }
        Some((p, rest)) => {
            matches!(name.split_first(), Some((c, tail)) if c == p && go_path_match(rest, tail))
        }
    }
}

/// Refuses a `pod_annotations` pattern of `handler` that passes [`ASSIGNMENT_ANNOTATION`]
/// from pod annotations.
fn refuse_forgeable(patterns: &[String], path: &str, handler: &str) -> Result<(), SetupError> {
    match patterns.iter().find(|p| go_path_match(p.as_bytes(), ASSIGNMENT_ANNOTATION.as_bytes())) {
        Some(bad) => Err(SetupError::ForgeablePattern {
            path: path.to_owned(),
            handler: handler.to_owned(),
            pattern: bad.clone(),
        }),
        None => Ok(()),
    }
}

/// Walks (creating as implicit tables) `keys` under `root`.
fn table_at<'a>(
    root: &'a mut Table,
    keys: &[&str],
    path: &str,
) -> Result<&'a mut Table, SetupError> {
    let mut t = root;
    let mut seen = String::new();
    for key in keys {
        if !seen.is_empty() {
            seen.push('.');
        }
        seen.push_str(key);
        let item = t.entry(key).or_insert_with(|| {
            let mut new = Table::new();
            new.set_implicit(true);
            Item::Table(new)
        });
        let found = item.type_name().to_string();
        t = item.as_table_mut().ok_or_else(|| SetupError::NotATable {
            path: path.to_owned(),
            key: seen.clone(),
            found,
        })?;
    }
    Ok(t)
}

/// Adds `wanted` to the string array `key` of `t` (created if absent), keeping what is
/// there; returns the array's strings.
fn ensure_in_array(
    t: &mut Table,
    key: &str,
    wanted: &str,
    path: &str,
    shown: &str,
) -> Result<Vec<String>, SetupError> {
    let item = t.entry(key).or_insert_with(|| value(Array::new()));
    let not_strings = || SetupError::NotStrings { path: path.to_owned(), key: shown.to_owned() };
    let arr = item.as_array_mut().ok_or_else(not_strings)?;
    let mut have = Vec::new();
    for v in arr.iter() {
        have.push(v.as_str().ok_or_else(not_strings)?.to_owned());
    }
    if !have.iter().any(|h| h == wanted) {
        arr.push(wanted);
        have.push(wanted.to_owned());
    }
    Ok(have)
}

fn valid_handler(h: &str) -> bool {
    !h.is_empty()
        && h.len() <= 63
        && h.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !h.starts_with('-')
        && !h.ends_with('-')
}

/// Edits a containerd configuration (`text` of the file at `path`, empty when absent).
/// Idempotent: editing the result again changes nothing.
pub fn containerd(text: &str, path: &str, opts: &ContainerdOptions) -> Result<Edit, SetupError> {
    if !valid_handler(&opts.handler) {
        return Err(SetupError::Option(format!(
            "handler `{}` is not a RuntimeClass handler name (a DNS label: a-z, 0-9, `-`)",
            untrusted(&opts.handler)
        )));
    }
    if !opts.runtime_path.starts_with('/') || opts.runtime_path.contains(['\n', '\r', '"']) {
        return Err(SetupError::Option(format!(
            "runtime path `{}` must be an absolute path",
            untrusted(&opts.runtime_path)
        )));
    }
    let mut doc: DocumentMut = text.parse().map_err(|e: toml_edit::TomlError| {
        SetupError::Parse { path: path.to_owned(), message: e.to_string() }
    })?;
    let version = match doc.get("version") {
        Some(v) => match v.as_integer() {
            Some(n @ (2 | 3)) => n,
            _ => {
                return Err(SetupError::UnknownVersion {
                    path: path.to_owned(),
                    found: v.to_string().trim().to_owned(),
                })
            }
        },
        None if doc.as_table().is_empty() => {
            if !matches!(opts.empty_version, 2 | 3) {
                return Err(SetupError::Option(format!(
                    "config version {} is not 2 or 3",
                    opts.empty_version
                )));
            }
            let mut fresh = DocumentMut::new();
            fresh.insert("version", value(opts.empty_version));
            doc = fresh;
            opts.empty_version
        }
        None => return Err(SetupError::VersionOne { path: path.to_owned() }),
    };
    let plugin = cri_plugin(version);
    let containerd = table_at(doc.as_table_mut(), &["plugins", plugin, "containerd"], path)?;
    // The options of the runc runtime this handler stands beside (cgroup driver, ...),
    // which tessera-runtime passes on to runc.
    let inherited: Vec<(String, Item)> = containerd
        .get("runtimes")
        .and_then(|r| r.get("runc"))
        .and_then(|r| r.get("options"))
        .and_then(Item::as_table)
        .map(|t| {
            t.iter()
                .filter(|(k, _)| *k != "BinaryName")
                .map(|(k, v)| (k.to_owned(), v.clone()))
                .collect()
        })
        .unwrap_or_default();
    if opts.set_default {
        containerd.insert("default_runtime_name", value(&opts.handler));
    }
    let shown = format!("plugins.\"{plugin}\".containerd.runtimes.{}", opts.handler);
    let runtime = table_at(containerd, &["runtimes", &opts.handler], path)?;
    runtime.set_implicit(false);
    if runtime.get("runtime_type").and_then(Item::as_str) != Some("io.containerd.runc.v2") {
        runtime.insert("runtime_type", value("io.containerd.runc.v2"));
    }
    let pods = ensure_in_array(
        runtime,
        "pod_annotations",
        POD_ANNOTATIONS,
        path,
        &format!("{shown}.pod_annotations"),
    )?;
    refuse_forgeable(&pods, path, &opts.handler)?;
    ensure_in_array(
        runtime,
        "container_annotations",
        ASSIGNMENT_ANNOTATION,
        path,
        &format!("{shown}.container_annotations"),
    )?;
    let options = table_at(runtime, &["options"], path)?;
    options.set_implicit(false);
    if options.get("BinaryName").and_then(Item::as_str) != Some(opts.runtime_path.as_str()) {
        options.insert("BinaryName", value(&opts.runtime_path));
    }
    for (k, v) in inherited {
        if !options.contains_key(&k) {
            options.insert(&k, v);
        }
    }
    Ok(Edit { before: text.to_owned(), after: doc.to_string(), version })
}

/// Checks containerd's own reading of the file (`containerd --config FILE config dump`,
/// which merges its `imports`): the handler is there as [`containerd`] wrote it, and no
/// pattern in its `pod_annotations` passes [`ASSIGNMENT_ANNOTATION`] from pods.
pub fn check_dump(
    dump: &str,
    path: &str,
    opts: &ContainerdOptions,
    version: i64,
) -> Result<(), SetupError> {
    let over = |what: String| SetupError::Overridden { path: path.to_owned(), what };
    let doc: DocumentMut = dump.parse().map_err(|e: toml_edit::TomlError| {
        over(format!("its dump is not TOML ({})", untrusted(&e.to_string())))
    })?;
    let rt = doc
        .get("plugins")
        .and_then(|p| p.get(cri_plugin(version)))
        .and_then(|p| p.get("containerd"))
        .and_then(|c| c.get("runtimes"))
        .and_then(|r| r.get(&opts.handler))
        .ok_or_else(|| over(format!("there is no runtime handler `{}`", opts.handler)))?;
    let strings = |key: &str| -> Vec<String> {
        rt.get(key)
            .and_then(Item::as_array)
            .map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect())
            .unwrap_or_default()
    };
    let binary = rt.get("options").and_then(|o| o.get("BinaryName")).and_then(Item::as_str);
    if binary != Some(opts.runtime_path.as_str()) {
        return Err(over(format!(
            "its BinaryName is {}",
            binary.map_or_else(|| "unset".to_owned(), |b| format!("`{}`", untrusted(b)))
        )));
    }
    if rt.get("runtime_type").and_then(Item::as_str) != Some("io.containerd.runc.v2") {
        return Err(over("its runtime_type is not io.containerd.runc.v2".into()));
    }
    let pods = strings("pod_annotations");
    if !pods.iter().any(|p| p == POD_ANNOTATIONS) {
        return Err(over(format!("its pod_annotations lack `{POD_ANNOTATIONS}`")));
    }
    refuse_forgeable(&pods, path, &opts.handler)?;
    if !strings("container_annotations").iter().any(|c| c == ASSIGNMENT_ANNOTATION) {
        return Err(over(format!("its container_annotations lack `{ASSIGNMENT_ANNOTATION}`")));
    }
    Ok(())
}

/// The link to tessera-runtime that containerd's CRI handler `handler` runs
/// (`BinaryName`), in `runtime_dir`: tessera-runtime run as `<dir>/containerd-<handler>`
/// reads `<dir>/containerd-<handler>.toml`, the handler's own runtime configuration.
pub fn kubelet_link(runtime_dir: &str, handler: &str) -> String {
    format!("{}/containerd-{handler}", runtime_dir.trim_end_matches('/'))
}

/// The comment a new handler configuration starts with.
const KUBELET_CONFIG_HEADER: &str = "\
# tessera-runtime's configuration for containerd's CRI handler (kubelet's engine),
# written by `tessera setup containerd`. `kubelet = true` lets the device plugin's
# assignment (tessera.io/device-plugin) be honoured for pods' containers; no other
# engine may read this file. See tessera-runtime --help for the other keys.
";

/// Edits the CRI handler's runtime configuration (`text` of the file at `path`; empty when
/// absent, or `base`, the node's default configuration, to start from): `kubelet = true`
/// set, every other key kept. The result must be a configuration tessera-runtime reads.
/// Idempotent.
pub fn kubelet_runtime_config(
    text: &str,
    path: &str,
    base: Option<&str>,
    socket: Option<&str>,
) -> Result<Edit, SetupError> {
    let start = match (text.trim().is_empty(), base) {
        (true, Some(b)) => format!("{KUBELET_CONFIG_HEADER}{b}"),
        (true, None) => KUBELET_CONFIG_HEADER.to_string(),
        (false, _) => text.to_string(),
    };
    let mut doc: DocumentMut = start.parse().map_err(|e: toml_edit::TomlError| {
        SetupError::Parse { path: path.to_owned(), message: e.to_string() }
    })?;
    let after = match doc.get("kubelet") {
        Some(k) if k.as_bool() == Some(true) => start,
        // Set where it is, keeping its comments.
        Some(_) => {
            doc.insert("kubelet", value(true));
            doc.to_string()
        }
        // Appended as a line of its own (an insert would go before the comments).
        None if start.is_empty() || start.ends_with('\n') => format!("{start}kubelet = true\n"),
        None => format!("{start}\nkubelet = true\n"),
    };
    // `tessera --socket S setup containerd`: the handler asks that tesserad.
    let after = match socket {
        Some(sock) => {
            let mut doc: DocumentMut = after.parse().map_err(|e: toml_edit::TomlError| {
                SetupError::Parse { path: path.to_owned(), message: e.to_string() }
            })?;
            if doc.get("socket").and_then(Item::as_str) == Some(sock) {
                after
            } else {
                doc.insert("socket", value(sock));
                doc.to_string()
            }
        }
        None => after,
    };
    runtime_hook::config::parse(&after, path).map_err(|e| SetupError::Option(e.to_string()))?;
    Ok(Edit { before: text.to_owned(), after, version: 0 })
}

/// The RuntimeClass that selects `handler`.
pub fn runtime_class(handler: &str) -> String {
    format!(
        "apiVersion: node.k8s.io/v1\nkind: RuntimeClass\nmetadata:\n  name: {handler}\nhandler: {handler}\n"
    )
}

// ---------------------------------------------------------------------------------------
// Docker and podman.

/// What `tessera setup docker` and `tessera setup podman` write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineOptions {
    /// The runtime's name (`docker run --runtime NAME`, `podman --runtime NAME`).
    pub name: String,
    /// tessera-runtime, absolute.
    pub runtime_path: String,
    /// Docker only: a runtime configuration file for this engine's tessera-runtime,
    /// passed as `runtimeArgs: ["--tessera-config", PATH]` (podman's runtimes take no
    /// arguments).
    pub runtime_config: Option<String>,
    /// Make it the engine's default runtime (`default-runtime`, `[engine] runtime`).
    pub set_default: bool,
}

fn check_engine_options(o: &EngineOptions) -> Result<(), SetupError> {
    if !valid_handler(&o.name) {
        return Err(SetupError::Option(format!(
            "runtime name `{}` must be 1 to 63 of a-z, 0-9 and `-`",
            untrusted(&o.name)
        )));
    }
    for (what, p) in std::iter::once(("runtime path", &o.runtime_path))
        .chain(o.runtime_config.iter().map(|c| ("runtime config", c)))
    {
        // dockerd 20.10 writes a runtime with `runtimeArgs` into a shell script, unquoted:
        // a space or a `;` there would be a second word or a second command.
        let plain = p.bytes().all(|b| b.is_ascii_alphanumeric() || b"/._+-".contains(&b));
        if !p.starts_with('/') || !plain {
            return Err(SetupError::Option(format!(
                "{what} `{}` must be an absolute path of letters, digits and `/._+-` \
                 (dockerd writes it unquoted into a shell script)",
                untrusted(p)
            )));
        }
    }
    Ok(())
}

/// A JSON value that keeps its objects' key order (daemon.json is the operator's file:
/// every other key stays where and as it was; serde_json's map would sort them).
#[derive(Debug, Clone, PartialEq)]
enum Json {
    Object(Vec<(String, Json)>),
    Array(Vec<Json>),
    Scalar(serde_json::Value),
}

impl<'de> serde::Deserialize<'de> for Json {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{Error, MapAccess, SeqAccess, Visitor};
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Json;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_bool<E: Error>(self, v: bool) -> Result<Json, E> {
                Ok(Json::Scalar(v.into()))
            }
            fn visit_i64<E: Error>(self, v: i64) -> Result<Json, E> {
                Ok(Json::Scalar(v.into()))
            }
            fn visit_u64<E: Error>(self, v: u64) -> Result<Json, E> {
                Ok(Json::Scalar(v.into()))
            }
            fn visit_f64<E: Error>(self, v: f64) -> Result<Json, E> {
                Ok(Json::Scalar(v.into()))
            }
            fn visit_str<E: Error>(self, v: &str) -> Result<Json, E> {
                Ok(Json::Scalar(v.into()))
            }
            fn visit_unit<E: Error>(self) -> Result<Json, E> {
                Ok(Json::Scalar(serde_json::Value::Null))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Json, A::Error> {
                let mut out = Vec::new();
                while let Some(v) = a.next_element()? {
                    out.push(v);
                }
                Ok(Json::Array(out))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Json, A::Error> {
                let mut out: Vec<(String, Json)> = Vec::new();
                while let Some(k) = a.next_key::<String>()? {
                    if out.iter().any(|(have, _)| *have == k) {
                        return Err(A::Error::custom(format!(
                            "duplicate key `{}` (dockerd would silently keep the last)",
                            untrusted(&k)
                        )));
                    }
                    let v = a.next_value()?;
                    out.push((k, v));
                }
                Ok(Json::Object(out))
            }
        }
        d.deserialize_any(V)
    }
}

impl Json {
    fn type_name(&self) -> &'static str {
        match self {
            Json::Object(_) => "object",
            Json::Array(_) => "array",
            Json::Scalar(serde_json::Value::String(_)) => "string",
            Json::Scalar(serde_json::Value::Null) => "null",
            Json::Scalar(serde_json::Value::Bool(_)) => "boolean",
            Json::Scalar(_) => "number",
        }
    }
    fn string(s: &str) -> Json {
        Json::Scalar(s.into())
    }
    fn get_mut(&mut self, key: &str) -> Option<&mut Json> {
        match self {
            Json::Object(o) => o.iter_mut().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }
    /// Sets `key` (in place when present, else appended); `self` must be an object.
    fn set(&mut self, key: &str, v: Json) {
        if let Json::Object(o) = self {
            match o.iter_mut().find(|(k, _)| k == key) {
                Some((_, slot)) => *slot = v,
                None => o.push((key.to_owned(), v)),
            }
        }
    }
    /// Pretty text, two-space indent, as `dockerd`'s documentation shows daemon.json.
    fn write(&self, out: &mut String, indent: usize) {
        let pad = |n: usize| "  ".repeat(n);
        match self {
            Json::Scalar(v) => out.push_str(&v.to_string()),
            Json::Array(a) if a.is_empty() => out.push_str("[]"),
            Json::Object(o) if o.is_empty() => out.push_str("{}"),
            Json::Array(a) => {
                out.push_str("[\n");
                for (i, v) in a.iter().enumerate() {
                    out.push_str(&pad(indent + 1));
                    v.write(out, indent + 1);
                    out.push_str(if i + 1 < a.len() { ",\n" } else { "\n" });
                }
                out.push_str(&pad(indent));
                out.push(']');
            }
            Json::Object(o) => {
                out.push_str("{\n");
                for (i, (k, v)) in o.iter().enumerate() {
                    out.push_str(&pad(indent + 1));
                    out.push_str(&serde_json::Value::from(k.as_str()).to_string());
                    out.push_str(": ");
                    v.write(out, indent + 1);
                    out.push_str(if i + 1 < o.len() { ",\n" } else { "\n" });
                }
                out.push_str(&pad(indent));
                out.push('}');
            }
        }
    }
}

/// Edits Docker's daemon.json (`text` of the file at `path`, empty when absent): adds
/// `runtimes.NAME = {"path": tessera-runtime[, "runtimeArgs": ["--tessera-config", FILE]]}`
/// and, with `set_default`, `"default-runtime": NAME`. Every other key is kept, in order.
/// Idempotent: editing the result again changes nothing.
pub fn docker(text: &str, path: &str, opts: &EngineOptions) -> Result<Edit, SetupError> {
    check_engine_options(opts)?;
    let mut doc: Json = if text.trim().is_empty() {
        Json::Object(Vec::new())
    } else {
        serde_json::from_str(text)
            .map_err(|e| SetupError::ParseJson { path: path.to_owned(), message: e.to_string() })?
    };
    let not_object = |key: &str, found: &Json| SetupError::NotATable {
        path: path.to_owned(),
        key: key.to_owned(),
        found: found.type_name().to_owned(),
    };
    if !matches!(doc, Json::Object(_)) {
        return Err(not_object("(the document)", &doc));
    }
    let mut runtime = vec![("path".to_owned(), Json::string(&opts.runtime_path))];
    // Without --runtime-config, the runtime keeps the configuration it was given before (it
    // may name the engine a tenant is read from): re-running setup never drops it.
    let kept_args = doc
        .get_mut("runtimes")
        .and_then(|r| r.get_mut(&opts.name))
        .and_then(|r| r.get_mut("runtimeArgs"))
        .cloned();
    match (&opts.runtime_config, kept_args) {
        (Some(cfg), _) => {
            let args = vec![Json::string(runtime_hook::config::CONFIG_ARG), Json::string(cfg)];
            runtime.push(("runtimeArgs".to_owned(), Json::Array(args)));
        }
        (None, Some(args)) => runtime.push(("runtimeArgs".to_owned(), args)),
        (None, None) => {}
    }
    if doc.get_mut("runtimes").is_none() {
        doc.set("runtimes", Json::Object(Vec::new()));
    }
    let runtimes = doc.get_mut("runtimes").expect("just set");
    if !matches!(runtimes, Json::Object(_)) {
        return Err(not_object("runtimes", runtimes));
    }
    runtimes.set(&opts.name, Json::Object(runtime));
    if opts.set_default {
        doc.set("default-runtime", Json::string(&opts.name));
    }
    let mut after = String::new();
    doc.write(&mut after, 0);
    after.push('\n');
    // An unchanged document keeps its bytes (idempotent even when written differently).
    let before_doc: Option<Json> = serde_json::from_str(text).ok();
    let after = if before_doc.as_ref() == Some(&doc) { text.to_owned() } else { after };
    Ok(Edit { before: text.to_owned(), after, version: 0 })
}

/// NVIDIA's container toolkit in an engine's configuration, found or taken out: each
/// line says what and where (`runtimes.nvidia (nvidia-container-runtime)`, ...).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NvidiaFound {
    pub lines: Vec<String>,
}

/// Takes NVIDIA's runtimes out of Docker's daemon.json (`runtimes.X` whose path is an
/// `nvidia-container-runtime*`); a `default-runtime` naming one becomes `tessera_name`.
/// With `apply` false only says what it would do (the text is unchanged).
pub fn docker_nvidia(
    text: &str,
    path: &str,
    tessera_name: &str,
    apply: bool,
) -> Result<(Edit, NvidiaFound), SetupError> {
    let unchanged = Edit { before: text.to_owned(), after: text.to_owned(), version: 0 };
    if text.trim().is_empty() {
        return Ok((unchanged, NvidiaFound::default()));
    }
    let mut doc: Json = serde_json::from_str(text)
        .map_err(|e| SetupError::ParseJson { path: path.to_owned(), message: e.to_string() })?;
    let mut found = NvidiaFound::default();
    let mut removed = Vec::new();
    if let Some(Json::Object(rts)) = doc.get_mut("runtimes") {
        for (name, rt) in rts.iter() {
            let bin = match rt {
                Json::Object(o) => o.iter().find(|(k, _)| k == "path").and_then(|(_, v)| match v {
                    Json::Scalar(serde_json::Value::String(s)) => Some(s.clone()),
                    _ => None,
                }),
                _ => None,
            };
            if let Some(b) = bin.filter(|b| crate::engines::is_nvidia_runtime(b)) {
                found.lines.push(format!("{path}: runtimes.{name} ({})", untrusted(&b)));
                removed.push(name.clone());
            }
        }
        rts.retain(|(k, _)| !removed.contains(k));
    }
    let default = match doc.get_mut("default-runtime") {
        Some(Json::Scalar(serde_json::Value::String(d))) => Some(d.clone()),
        _ => None,
    };
    if let Some(d) = default.filter(|d| removed.contains(d)) {
        found.lines.push(format!(
            "{path}: default-runtime `{d}` (becomes `{tessera_name}`: containers asking nothing get \
             no GPU, GPU requests go through Tessera)"
        ));
        doc.set("default-runtime", Json::string(tessera_name));
    }
    if !apply || found.lines.is_empty() {
        return Ok((unchanged, found));
    }
    let mut after = String::new();
    doc.write(&mut after, 0);
    after.push('\n');
    Ok((Edit { before: text.to_owned(), after, version: 0 }, found))
}

/// Takes NVIDIA's runtimes out of podman's containers.conf (`[engine.runtimes] X` whose
/// first path is an `nvidia-container-runtime*`); an `[engine] runtime` naming one
/// becomes `tessera_name`. With `apply` false only says what it would do.
pub fn podman_nvidia(
    text: &str,
    path: &str,
    tessera_name: &str,
    apply: bool,
) -> Result<(Edit, NvidiaFound), SetupError> {
    let mut doc: DocumentMut = text.parse().map_err(|e: toml_edit::TomlError| {
        SetupError::Parse { path: path.to_owned(), message: e.to_string() }
    })?;
    let mut found = NvidiaFound::default();
    let nvidia: Vec<(String, String)> = crate::engines::podman(text, path)?
        .into_iter()
        .filter(|r| crate::engines::is_nvidia_runtime(&r.binary))
        .map(|r| (r.name, r.binary))
        .collect();
    let Some(engine) = doc.get_mut("engine").and_then(Item::as_table_like_mut) else {
        return Ok((Edit { before: text.to_owned(), after: text.to_owned(), version: 0 }, found));
    };
    if let Some(rts) = engine.get_mut("runtimes").and_then(Item::as_table_like_mut) {
        for (name, bin) in &nvidia {
            found.lines.push(format!("{path}: [engine.runtimes] {name} ({})", untrusted(bin)));
            rts.remove(name);
        }
    }
    let default = engine.get("runtime").and_then(Item::as_str).map(str::to_owned);
    if let Some(d) = default.filter(|d| nvidia.iter().any(|(n, _)| n == d)) {
        found.lines.push(format!("{path}: [engine] runtime `{d}` (becomes `{tessera_name}`)"));
        engine.insert("runtime", value(tessera_name));
    }
    let after = if apply { doc.to_string() } else { text.to_owned() };
    Ok((Edit { before: text.to_owned(), after, version: 0 }, found))
}

/// Takes NVIDIA's runtimes out of containerd's CRI plugin (`runtimes.X` whose
/// `options.BinaryName` is an `nvidia-container-runtime*`); a `default_runtime_name`
/// naming one becomes `tessera_handler`. With `apply` false only says what it would do.
pub fn containerd_nvidia(
    text: &str,
    path: &str,
    tessera_handler: &str,
    apply: bool,
) -> Result<(Edit, NvidiaFound), SetupError> {
    let mut doc: DocumentMut = text.parse().map_err(|e: toml_edit::TomlError| {
        SetupError::Parse { path: path.to_owned(), message: e.to_string() }
    })?;
    let mut found = NvidiaFound::default();
    let nvidia: Vec<(String, String)> = crate::engines::containerd(text, path)?
        .into_iter()
        .filter(|r| crate::engines::is_nvidia_runtime(&r.binary))
        .map(|r| (r.name, r.binary))
        .collect();
    let plugin = cri_plugin(doc.get("version").and_then(Item::as_integer).unwrap_or(2));
    let shown = format!("plugins.\"{plugin}\".containerd");
    let c = doc
        .get_mut("plugins")
        .and_then(|p| p.get_mut(plugin))
        .and_then(|p| p.get_mut("containerd"))
        .and_then(Item::as_table_like_mut);
    let Some(c) = c else {
        return Ok((Edit { before: text.to_owned(), after: text.to_owned(), version: 0 }, found));
    };
    if let Some(rts) = c.get_mut("runtimes").and_then(Item::as_table_like_mut) {
        for (name, bin) in &nvidia {
            found.lines.push(format!("{path}: {shown}.runtimes.{name} ({})", untrusted(bin)));
            rts.remove(name);
        }
    }
    let default = c.get("default_runtime_name").and_then(Item::as_str).map(str::to_owned);
    if let Some(d) = default.filter(|d| nvidia.iter().any(|(n, _)| n == d)) {
        found.lines.push(format!(
            "{path}: {shown}.default_runtime_name `{d}` (becomes `{tessera_handler}`: every pod runs \
             through tessera-runtime, and asks for GPUs through Tessera)"
        ));
        c.insert("default_runtime_name", value(tessera_handler));
    }
    let after = if apply { doc.to_string() } else { text.to_owned() };
    Ok((Edit { before: text.to_owned(), after, version: 0 }, found))
}

/// Edits podman's containers.conf (`text` of the file at `path`, empty when absent): adds
/// `[engine.runtimes] NAME = [tessera-runtime]` and, with `set_default`, `[engine]
/// runtime = NAME`. Everything else is kept as written. Idempotent.
pub fn podman(text: &str, path: &str, opts: &EngineOptions) -> Result<Edit, SetupError> {
    check_engine_options(opts)?;
    if opts.runtime_config.is_some() {
        return Err(SetupError::Option(
            "podman passes its runtimes no arguments: give this engine's tessera-runtime its own \
             configuration as a link beside it (`ln -s tessera-runtime DIR/NAME`, the file \
             DIR/NAME.toml, then `--runtime-path DIR/NAME`; docs/INSTALL.md, podman), or use \
             /etc/tessera/runtime.toml"
                .into(),
        ));
    }
    let mut doc: DocumentMut = text.parse().map_err(|e: toml_edit::TomlError| {
        SetupError::Parse { path: path.to_owned(), message: e.to_string() }
    })?;
    let engine = table_at(doc.as_table_mut(), &["engine"], path)?;
    engine.set_implicit(false);
    if opts.set_default && engine.get("runtime").and_then(Item::as_str) != Some(opts.name.as_str())
    {
        engine.insert("runtime", value(&opts.name));
    }
    let runtimes = table_at(engine, &["runtimes"], path)?;
    runtimes.set_implicit(false);
    let have: Option<Vec<&str>> = runtimes
        .get(&opts.name)
        .and_then(Item::as_array)
        .map(|a| a.iter().filter_map(|v| v.as_str()).collect());
    if have.as_deref() != Some(&[opts.runtime_path.as_str()][..]) {
        let mut a = Array::new();
        a.push(opts.runtime_path.as_str());
        runtimes.insert(&opts.name, value(a));
    }
    Ok(Edit { before: text.to_owned(), after: doc.to_string(), version: 0 })
}

#[cfg(test)]
mod engine_tests {
    use super::*;

    fn opts() -> EngineOptions {
        EngineOptions {
            name: "tessera".into(),
            runtime_path: "/usr/local/bin/tessera-runtime".into(),
            runtime_config: None,
            set_default: false,
        }
    }

    #[test]
    fn docker_adds_the_runtime_and_keeps_every_other_key_in_order() {
        let text = "{\n  \"log-driver\": \"journald\",\n  \"runtimes\": {\"crun\": {\"path\": \"/usr/bin/crun\"}},\n  \"debug\": true,\n  \"max-concurrent-downloads\": 2.5\n}\n";
        let e = docker(text, "/etc/docker/daemon.json", &opts()).expect("edits");
        assert_eq!(
            e.after,
            "{\n  \"log-driver\": \"journald\",\n  \"runtimes\": {\n    \"crun\": {\n      \"path\": \"/usr/bin/crun\"\n    },\n    \"tessera\": {\n      \"path\": \"/usr/local/bin/tessera-runtime\"\n    }\n  },\n  \"debug\": true,\n  \"max-concurrent-downloads\": 2.5\n}\n"
        );
        let again = docker(&e.after, "f", &opts()).expect("again");
        assert!(!again.changed(), "{}", again.diff("f"));
        assert!(
            e.diff("/etc/docker/daemon.json").contains("+    \"tessera\": {"),
            "{}",
            e.diff("x")
        );
    }

    #[test]
    fn docker_empty_file_default_runtime_and_config_argument() {
        let mut o = opts();
        o.set_default = true;
        o.runtime_config = Some("/etc/tessera/runtime-docker.toml".into());
        let e = docker("", "f", &o).expect("edits");
        let v: serde_json::Value = serde_json::from_str(&e.after).expect("json");
        assert_eq!(
            v,
            serde_json::json!({
                "runtimes": {"tessera": {"path": "/usr/local/bin/tessera-runtime",
                    "runtimeArgs": ["--tessera-config", "/etc/tessera/runtime-docker.toml"]}},
                "default-runtime": "tessera"
            })
        );
        assert!(!docker(&e.after, "f", &o).expect("again").changed());
        // A changed path replaces the old entry, keeping its place.
        o.runtime_path = "/opt/tessera/tessera-runtime".into();
        let e2 = docker(&e.after, "f", &o).expect("update");
        assert!(e2.changed() && e2.after.contains("/opt/tessera/tessera-runtime"));
        assert!(!e2.after.contains("/usr/local/bin/tessera-runtime"));
    }

    #[test]
    fn docker_refuses_what_it_cannot_edit() {
        let cases = [
            ("[1]", "`(the document)` is a array"),
            ("{\"runtimes\": []}", "`runtimes` is a array"),
            ("{\"a\": 1, \"a\": 2}", "duplicate key `a`"),
            ("{\"a\": ", "f is not valid JSON: EOF while parsing"),
        ];
        for (text, want) in cases {
            let e = docker(text, "f", &opts()).expect_err(text).to_string();
            assert!(e.contains(want), "{text}: {e}");
        }
        let mut o = opts();
        o.runtime_path = "tessera-runtime".into();
        assert!(docker("", "f", &o).is_err());
        let mut o = opts();
        o.name = "Tessera".into();
        assert!(docker("", "f", &o).is_err());
    }

    #[test]
    fn docker_and_podman_lose_nvidias_runtimes_only_when_asked() {
        let nct = "{\n  \"default-runtime\": \"nvidia\",\n  \"runtimes\": {\n    \"nvidia\": {\n      \"path\": \"nvidia-container-runtime\",\n      \"runtimeArgs\": []\n    }\n  },\n  \"log-driver\": \"journald\"\n}\n";
        let e = docker(nct, "d.json", &opts()).expect("edit");
        let (same, found) = docker_nvidia(&e.after, "d.json", "tessera", false).expect("look");
        assert_eq!(
            (same.after.as_str(), found.lines.len()),
            (e.after.as_str(), 2),
            "{:?}",
            found.lines
        );
        let (out, _) = docker_nvidia(&e.after, "d.json", "tessera", true).expect("replace");
        let v: serde_json::Value = serde_json::from_str(&out.after).expect("json");
        assert_eq!(
            v,
            serde_json::json!({"default-runtime": "tessera", "log-driver": "journald",
                "runtimes": {"tessera": {"path": "/usr/local/bin/tessera-runtime"}}})
        );
        assert!(out.after.find("default-runtime") < out.after.find("log-driver"), "order kept");
        let conf = "[engine]\nruntime = \"nvidia\"\n[engine.runtimes]\nnvidia = [\"/usr/bin/nvidia-container-runtime\"]\ncrun = [\"/usr/bin/crun\"]\n";
        let e = podman(conf, "c.conf", &opts()).expect("edit");
        let (out, found) = podman_nvidia(&e.after, "c.conf", "tessera", true).expect("replace");
        assert_eq!(found.lines.len(), 2, "{:?}", found.lines);
        let d: DocumentMut = out.after.parse().expect("toml");
        assert_eq!(d["engine"]["runtime"].as_str(), Some("tessera"));
        assert!(d["engine"]["runtimes"].get("nvidia").is_none());
        assert!(
            d["engine"]["runtimes"].get("crun").is_some()
                && d["engine"]["runtimes"].get("tessera").is_some()
        );
    }

    #[test]
    fn podman_adds_the_runtime_and_keeps_the_rest() {
        let text = "# site settings\n[containers]\nlog_driver = \"k8s-file\"\n\n[engine]\nevents_logger = \"file\"\n\n[engine.runtimes]\ncrun = [\"/usr/bin/crun\"]\n";
        let e = podman(text, "/etc/containers/containers.conf", &opts()).expect("edits");
        assert_eq!(
            e.after,
            format!("{text}tessera = [\"/usr/local/bin/tessera-runtime\"]\n"),
            "{}",
            e.diff("x")
        );
        assert!(!podman(&e.after, "f", &opts()).expect("again").changed());
        let mut o = opts();
        o.set_default = true;
        let e = podman("", "f", &o).expect("empty");
        let doc: DocumentMut = e.after.parse().expect("toml");
        assert_eq!(doc["engine"]["runtime"].as_str(), Some("tessera"));
        assert_eq!(
            doc["engine"]["runtimes"]["tessera"]
                .as_array()
                .and_then(|a| a.get(0))
                .and_then(|v| v.as_str()),
            Some("/usr/local/bin/tessera-runtime")
        );
        assert!(!podman(&e.after, "f", &o).expect("again").changed());
        let e = podman("engine = 1\n", "f", &opts()).expect_err("not a table");
        assert!(e.to_string().contains("`engine` is a integer"), "{e}");
        let mut o = opts();
        o.runtime_config = Some("/x".into());
        assert!(podman("", "f", &o).expect_err("no args").to_string().contains("DIR/NAME.toml"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts() -> ContainerdOptions {
        ContainerdOptions {
            handler: "tessera".into(),
            runtime_path: "/usr/local/bin/tessera-runtime".into(),
            set_default: false,
            empty_version: 2,
        }
    }

    const V2: &str = r#"version = 2
root = "/var/lib/containerd"

# keep me
[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "registry.k8s.io/pause:3.6"
    [plugins."io.containerd.grpc.v1.cri".containerd]
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          BinaryName = ""
          SystemdCgroup = true
          Root = "/run/containerd/runc-k8s"
"#;

    fn parsed(s: &str) -> toml_edit::DocumentMut {
        s.parse().expect("valid toml out")
    }

    #[test]
    fn the_handlers_runtime_config_marks_the_kubelet_engine_and_keeps_the_rest() {
        let e = kubelet_runtime_config("", "/l/containerd-tessera.toml", None, None).expect("new");
        assert!(e.after.starts_with("# tessera-runtime's configuration"), "{}", e.after);
        assert!(e.after.ends_with("kubelet = true\n"), "{}", e.after);
        let cfg = runtime_hook::config::parse(&e.after, "f").expect("reads");
        assert!(cfg.kubelet);
        // Twice is once.
        let again = kubelet_runtime_config(&e.after, "f", None, None).expect("again");
        assert!(!again.changed());
        // A new file starts from the node's default configuration (socket, runc, ...).
        let base = "socket = \"/run/t/d.sock\"\nengine = \"containerd-k8s\"\n";
        let e = kubelet_runtime_config("", "f", Some(base), None).expect("seeded");
        let cfg = runtime_hook::config::parse(&e.after, "f").expect("reads");
        assert_eq!(cfg.socket.as_deref(), Some(std::path::Path::new("/run/t/d.sock")));
        assert_eq!((cfg.engine.as_deref(), cfg.kubelet), (Some("containerd-k8s"), true));
        // An existing file keeps every key; `kubelet = false` is turned on.
        let e = kubelet_runtime_config(
            "# mine\nlog = \"/var/log/t.log\"\nkubelet = false\n",
            "f",
            Some(base),
            None,
        )
        .expect("edit");
        assert_eq!(e.after, "# mine\nlog = \"/var/log/t.log\"\nkubelet = true\n");
        // Something tessera-runtime would refuse is refused here, untouched.
        let e =
            kubelet_runtime_config("sockt = \"/x\"\n", "f", None, None).expect_err("unknown key");
        assert!(e.to_string().contains("unknown key `sockt`"), "{e}");
        assert_eq!(
            kubelet_link("/usr/local/lib/tessera/", "tessera"),
            "/usr/local/lib/tessera/containerd-tessera"
        );
    }

    #[test]
    fn a_v2_config_gains_the_handler_and_keeps_the_rest() {
        let e = containerd(V2, "/etc/containerd/config.toml", &opts()).expect("edit");
        assert!(e.changed());
        assert_eq!(e.version, 2);
        assert!(e.after.contains("# keep me"), "{}", e.after);
        assert!(e.after.contains("sandbox_image = \"registry.k8s.io/pause:3.6\""));
        let d = parsed(&e.after);
        let rt = &d["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["tessera"];
        assert_eq!(rt["runtime_type"].as_str(), Some("io.containerd.runc.v2"));
        assert_eq!(rt["options"]["BinaryName"].as_str(), Some("/usr/local/bin/tessera-runtime"));
        assert_eq!(
            rt["options"]["SystemdCgroup"].as_bool(),
            Some(true),
            "runc's options inherited"
        );
        // runc's state root too: the handler's containers live where runc's do.
        assert_eq!(rt["options"]["Root"].as_str(), Some("/run/containerd/runc-k8s"));
        assert_eq!(
            rt["pod_annotations"].as_array().unwrap().get(0).unwrap().as_str(),
            Some(POD_ANNOTATIONS)
        );
        assert_eq!(
            rt["container_annotations"].as_array().unwrap().get(0).unwrap().as_str(),
            Some(ASSIGNMENT_ANNOTATION)
        );
        let d0 = &d["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["default_runtime_name"];
        assert_eq!(d0.as_str(), Some("runc"), "not the default unless asked");
        let diff = e.diff("/etc/containerd/config.toml");
        assert!(
            diff.contains("+++ /etc/containerd/config.toml") && diff.contains("+BinaryName"),
            "{diff}"
        );
    }

    #[test]
    fn twice_is_once() {
        for (text, version) in [(V2, 2), ("", 2), ("", 3), ("version = 3\n", 3)] {
            let o = ContainerdOptions { empty_version: version, ..opts() };
            let first = containerd(text, "c.toml", &o).expect("first");
            let second = containerd(&first.after, "c.toml", &o).expect("second");
            assert!(!second.changed(), "second run changed:\n{}", second.diff("c.toml"));
            assert_eq!(first.version, version);
        }
    }

    #[test]
    fn an_empty_file_gets_a_version_and_v3_uses_the_new_plugin_name() {
        let e =
            containerd("", "c.toml", &ContainerdOptions { empty_version: 3, ..opts() }).unwrap();
        let d = parsed(&e.after);
        assert_eq!(d["version"].as_integer(), Some(3));
        let rt = &d["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["tessera"];
        assert_eq!(rt["options"]["BinaryName"].as_str(), Some("/usr/local/bin/tessera-runtime"));
        let e = containerd("", "c.toml", &opts()).unwrap();
        assert!(e.after.starts_with("version = 2\n"), "{}", e.after);
        assert!(
            e.after.contains("[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.tessera]"),
            "{}",
            e.after
        );
    }

    #[test]
    fn existing_annotation_lists_are_extended_and_set_default_works() {
        let text = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.tessera]\n  pod_annotations = [\"example.com/x\"]\n";
        let e =
            containerd(text, "c.toml", &ContainerdOptions { set_default: true, ..opts() }).unwrap();
        let d = parsed(&e.after);
        let c = &d["plugins"]["io.containerd.grpc.v1.cri"]["containerd"];
        let pods: Vec<&str> = c["runtimes"]["tessera"]["pod_annotations"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v.as_str())
            .collect();
        assert_eq!(pods, ["example.com/x", POD_ANNOTATIONS]);
        assert_eq!(c["default_runtime_name"].as_str(), Some("tessera"));
    }

    #[test]
    fn refusals_name_the_file_and_the_problem() {
        let e = containerd("root = \"/x\"\n", "/etc/c.toml", &opts()).unwrap_err().to_string();
        assert!(e.contains("/etc/c.toml") && e.contains("version 1"), "{e}");
        let e = containerd("version = 7\n", "c.toml", &opts()).unwrap_err().to_string();
        assert!(e.contains("`version` is 7"), "{e}");
        let e =
            containerd("version = 2\nplugins = 3\n", "c.toml", &opts()).unwrap_err().to_string();
        assert!(e.contains("`plugins` is a integer") || e.contains("`plugins` is a"), "{e}");
        let e = containerd("version = [\n", "c.toml", &opts()).unwrap_err().to_string();
        assert!(e.contains("c.toml is not valid TOML"), "{e}");
        let bad = ContainerdOptions { handler: "Tessera!".into(), ..opts() };
        assert!(containerd("", "c.toml", &bad).unwrap_err().to_string().contains("handler"));
        let bad = ContainerdOptions { runtime_path: "tessera-runtime".into(), ..opts() };
        assert!(containerd("", "c.toml", &bad).unwrap_err().to_string().contains("absolute"));
    }

    #[test]
    fn a_pod_annotation_pattern_that_passes_the_assignment_is_refused() {
        for pattern in [
            "tessera.io/*",
            "tessera.io/device-*",
            "tessera.io/device-plugin",
            "tessera.io/?evice-plugin",
        ] {
            let text = format!(
                "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.tessera]\n  pod_annotations = [\"{pattern}\"]\n"
            );
            let e = containerd(&text, "c.toml", &opts()).unwrap_err();
            assert!(matches!(e, SetupError::ForgeablePattern { .. }), "{pattern}: {e}");
        }
        for pattern in ["*", "tessera.io/gpu*", "*/gpu", "example.com/*"] {
            assert!(
                !go_path_match(pattern.as_bytes(), ASSIGNMENT_ANNOTATION.as_bytes()),
                "{pattern}"
            );
        }
        assert!(go_path_match(b"tessera.io/gpu*", b"tessera.io/gpu.main"));
        assert!(go_path_match(b"tessera.io/gpu*", b"tessera.io/gpu"));
        assert!(!go_path_match(b"*", b"a/b"));
    }

    #[test]
    fn containerds_reading_is_checked_against_what_was_written() {
        let o = opts();
        let e = containerd("", "c.toml", &o).unwrap();
        check_dump(&e.after, "c.toml", &o, 2).expect("what was written reads back");
        // An import that replaced the handler's table.
        let replaced = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.tessera]\n  pod_annotations = [\"tessera.io/*\"]\n";
        let err = check_dump(replaced, "c.toml", &o, 2).unwrap_err().to_string();
        assert!(err.contains("BinaryName is unset") && err.contains("config dump"), "{err}");
        let forged =
            e.after.replace("\"tessera.io/gpu*\"", "\"tessera.io/gpu*\", \"tessera.io/*\"");
        assert!(matches!(
            check_dump(&forged, "c.toml", &o, 2),
            Err(SetupError::ForgeablePattern { .. })
        ));
        assert!(check_dump("version = 2\n", "c.toml", &o, 2)
            .unwrap_err()
            .to_string()
            .contains("no runtime handler"));
    }

    #[test]
    fn the_socket_given_to_setup_is_the_handlers() {
        let e = kubelet_runtime_config(
            "",
            "f",
            Some("socket = \"/run/a.sock\"\n"),
            Some("/run/b.sock"),
        )
        .expect("socket");
        let cfg = runtime_hook::config::parse(&e.after, "f").expect("reads");
        assert_eq!(cfg.socket.as_deref(), Some(std::path::Path::new("/run/b.sock")));
        assert!(cfg.kubelet);
        let again =
            kubelet_runtime_config(&e.after, "f", None, Some("/run/b.sock")).expect("again");
        assert!(!again.changed(), "{}", again.diff("f"));
    }

    /// An NVIDIA container toolkit node: its runtime, made the default.
    const NCT_CONTAINERD: &str = r#"version = 2
[plugins."io.containerd.grpc.v1.cri".containerd]
  default_runtime_name = "nvidia"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]
      BinaryName = "/usr/bin/nvidia-container-runtime"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
"#;

    #[test]
    fn nvidias_runtime_and_default_are_found_and_taken_out_only_when_asked() {
        let e = containerd(NCT_CONTAINERD, "c.toml", &opts()).expect("edit");
        // Found, not changed.
        let (kept, found) = containerd_nvidia(&e.after, "c.toml", "tessera", false).expect("look");
        assert_eq!(kept.after, e.after);
        assert_eq!(found.lines.len(), 2, "{:?}", found.lines);
        assert!(found.lines[0].contains("runtimes.nvidia (/usr/bin/nvidia-container-runtime)"));
        assert!(found.lines[1].contains("default_runtime_name `nvidia` (becomes `tessera`"));
        // Taken out: the handler is the default, runc stays.
        let (out, _) = containerd_nvidia(&e.after, "c.toml", "tessera", true).expect("replace");
        let d = parsed(&out.after);
        let c = &d["plugins"]["io.containerd.grpc.v1.cri"]["containerd"];
        assert_eq!(c["default_runtime_name"].as_str(), Some("tessera"));
        assert!(c["runtimes"].get("nvidia").is_none() && c["runtimes"].get("runc").is_some());
        assert!(c["runtimes"].get("tessera").is_some());
        let (again, found) =
            containerd_nvidia(&out.after, "c.toml", "tessera", true).expect("again");
        assert!(
            found.lines.is_empty()
                && !Edit { before: out.after.clone(), after: again.after, version: 2 }.changed()
        );
    }

    #[test]
    fn the_runtime_class_names_the_handler() {
        let rc = runtime_class("tessera");
        assert!(rc.contains("kind: RuntimeClass") && rc.contains("handler: tessera"));
    }

    #[test]
    fn docker_setup_keeps_a_runtimes_config_and_refuses_shell_words_in_paths() {
        let named = EngineOptions {
            name: "tessera-alice".into(),
            runtime_path: "/usr/local/bin/tessera-runtime".into(),
            runtime_config: Some("/etc/tessera/runtime-alice.toml".into()),
            set_default: false,
        };
        let first = docker("", "d.json", &named).unwrap();
        let again = docker(
            &first.after,
            "d.json",
            &EngineOptions { runtime_config: None, ..named.clone() },
        )
        .unwrap();
        assert!(!again.changed(), "the runtime's config was dropped:\n{}", again.diff("d.json"));
        for bad in
            ["/etc/tessera/runtime alice.toml", "/etc/x;touch /tmp/p.toml", "/etc/$(id).toml"]
        {
            let o = EngineOptions { runtime_config: Some(bad.into()), ..named.clone() };
            let e = docker("", "d.json", &o).unwrap_err().to_string();
            assert!(e.contains("unquoted"), "{bad}: {e}");
        }
    }
}
