//! The three ways the policy says no: a policy file that is not a policy
//! ([`PolicyError`]), a container that cannot be tied to a tenant ([`IdentityError`]),
//! and a tenant that may not have what it asked for ([`Refusal`]).

use std::fmt;
use std::path::PathBuf;

/// Why a policy file was not accepted. Every variant but `Io` names the JSON path of the
/// offending value (`orgs.acme.teams.research.trust`, `identity[0].map.team-dev`); the
/// root of the document is the empty path.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// The bytes are not JSON.
    #[error("{file}: line {line} column {column}: malformed json{}: {message}", at(path))]
    Syntax { file: String, path: String, line: usize, column: usize, message: String },
    /// JSON, but not of the policy's shape: unknown field, wrong type, unknown variant,
    /// missing field, duplicate key.
    #[error("{file}: {}: {message}{}", shown(path), position(*line, *column))]
    Schema { file: String, path: String, line: usize, column: usize, message: String },
    /// The policy's shape, but not a valid policy: bad name, dangling tenant path,
    /// untrusted tier allowing MPS, and so on.
    #[error("{file}: {}: {message}", shown(path))]
    Invalid { file: String, path: String, message: String },
    /// The file could not be read.
    #[error("{}: cannot read policy: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
}

impl PolicyError {
    /// The JSON path of the offending value (empty for the document root), if the file
    /// was read at all.
    pub fn json_path(&self) -> Option<&str> {
        match self {
            PolicyError::Syntax { path, .. }
            | PolicyError::Schema { path, .. }
            | PolicyError::Invalid { path, .. } => Some(path),
            PolicyError::Io { .. } => None,
        }
    }

    /// What was wrong, without the file name and path.
    pub fn message(&self) -> String {
        match self {
            PolicyError::Syntax { message, .. }
            | PolicyError::Schema { message, .. }
            | PolicyError::Invalid { message, .. } => message.clone(),
            PolicyError::Io { source, .. } => source.to_string(),
        }
    }
}

fn shown(path: &str) -> &str {
    if path.is_empty() {
        "(top level)"
    } else {
        path
    }
}

fn position(line: usize, column: usize) -> String {
    if line == 0 {
        String::new()
    } else {
        format!(" (line {line} column {column})")
    }
}

fn at(path: &str) -> String {
    if path.is_empty() {
        String::new()
    } else {
        format!(" in {path}")
    }
}

/// Why a container could not be tied to a tenant. Identity comes only from the
/// annotations the policy's `identity` rules name; the container fails closed otherwise.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// A trusted annotation is present but its value is not in the rule's map.
    #[error(
        "trusted annotation {annotation} has value \"{}\", which {rule} does not map to \
         any tenant: refusing (identity fails closed; other annotations are ignored and the \
         image env is never used for identity)",
        tessera_api::untrusted(value)
    )]
    Unmapped { annotation: String, value: String, rule: String },
    /// None of the trusted annotations is present and the policy has no `default_tenant`.
    #[error(
        "no trusted identity annotation is present (looked for {}) and the policy has no \
         default_tenant: refusing (other annotations are ignored and the image env is never \
         used for identity)",
        Tried(tried)
    )]
    NoIdentity { tried: Vec<String> },
}

struct Tried<'a>(&'a [String]);

impl fmt::Display for Tried<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("none: the policy has no identity rules");
        }
        f.write_str(&self.0.join(", "))
    }
}

/// A policy decision against a request. `Display` is `message`, which names the tenant,
/// its trust tier, the request and the deciding rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    /// The tenant path that was refused.
    pub tenant: String,
    /// The request as written, e.g. `mps=25`.
    pub request: String,
    /// The JSON path of the deciding rule, e.g. `tiers.untrusted.allow` or
    /// `node_pools.h100.tenants`.
    pub rule: String,
    /// The whole explanation, for operators and for the container's owner.
    pub message: String,
}
