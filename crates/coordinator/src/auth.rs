//! Bearer-token credentials: who may push policies (admins) and who may watch them and
//! report as one node (nodes).
//!
//! The tokens file:
//!
//! ```json
//! {"admins": {"alice": "<token>"}, "nodes": {"node-a": "<token>", "node-b": "<token>"}}
//! ```
//!
//! Tokens are at least 16 characters and unique across the file (a token names exactly
//! one principal). Lookup is by SHA-256 of the presented token in a hash map, then a
//! constant-time comparison of the full digests: the time taken does not depend on how
//! much of a valid token an attacker has guessed, and the cost stays O(1) with 10,000
//! node tokens.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::Path;

use serde::Deserialize;
use sha2::{Digest as _, Sha256};

/// Shortest token accepted in a tokens file.
pub const MIN_TOKEN_LEN: usize = 16;

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Principal {
    Admin(String),
    Node(String),
}

impl Principal {
    pub fn name(&self) -> &str {
        match self {
            Principal::Admin(n) | Principal::Node(n) => n,
        }
    }
}

impl fmt::Display for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Principal::Admin(n) => write!(f, "admin:{n}"),
            Principal::Node(n) => write!(f, "node:{n}"),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TokensFile {
    #[serde(default)]
    admins: BTreeMap<String, String>,
    #[serde(default)]
    nodes: BTreeMap<String, String>,
}

/// Why a tokens file was refused.
#[derive(Debug, thiserror::Error)]
pub enum TokensError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("tokens file: {0}")]
    Parse(String),
    #[error("tokens file: {0}")]
    Invalid(String),
}

/// The credentials a coordinator accepts.
#[derive(Clone)]
pub struct Tokens {
    by_digest: HashMap<[u8; 32], Principal>,
    nodes: Vec<String>,
    admins: Vec<String>,
}

impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokens")
            .field("admins", &self.admins)
            .field("nodes", &self.nodes.len())
            .finish_non_exhaustive()
    }
}

fn token_digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// Compare two digests without an early exit.
fn ct_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let diff = a.iter().zip(b.iter()).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

impl Tokens {
    /// Parse a tokens file's JSON.
    pub fn parse(json: &str) -> Result<Tokens, TokensError> {
        let file: TokensFile =
            serde_json::from_str(json).map_err(|e| TokensError::Parse(e.to_string()))?;
        Tokens::from_maps(file.admins, file.nodes)
    }

    /// Read a tokens file.
    pub fn load(path: &Path) -> Result<Tokens, TokensError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| TokensError::Io { path: path.display().to_string(), source })?;
        Tokens::parse(&text)
    }

    /// Build from name → token maps.
    pub fn from_maps(
        admins: BTreeMap<String, String>,
        nodes: BTreeMap<String, String>,
    ) -> Result<Tokens, TokensError> {
        let mut by_digest = HashMap::with_capacity(admins.len() + nodes.len());
        let entries = admins
            .iter()
            .map(|(n, t)| (Principal::Admin(n.clone()), t))
            .chain(nodes.iter().map(|(n, t)| (Principal::Node(n.clone()), t)));
        for (who, token) in entries {
            crate::validate_name(
                if matches!(who, Principal::Admin(_)) { "admin name" } else { "node id" },
                who.name(),
            )
            .map_err(TokensError::Invalid)?;
            if token.len() < MIN_TOKEN_LEN
                || token.chars().any(|c| c.is_whitespace() || c.is_control())
            {
                return Err(TokensError::Invalid(format!(
                    "the token of {who} must be at least {MIN_TOKEN_LEN} characters without whitespace"
                )));
            }
            if let Some(other) = by_digest.insert(token_digest(token), who.clone()) {
                return Err(TokensError::Invalid(format!("{other} and {who} share a token")));
            }
        }
        Ok(Tokens {
            by_digest,
            nodes: nodes.into_keys().collect(),
            admins: admins.into_keys().collect(),
        })
    }

    /// Who holds this token, if anyone.
    pub fn authenticate(&self, token: &str) -> Option<Principal> {
        let d = token_digest(token);
        self.by_digest.get_key_value(&d).and_then(|(k, p)| ct_eq(k, &d).then(|| p.clone()))
    }

    /// Every node id with a credential, sorted.
    pub fn nodes(&self) -> &[String] {
        &self.nodes
    }

    /// Every admin name, sorted.
    pub fn admins(&self) -> &[String] {
        &self.admins
    }
}

/// The token of an `Authorization: Bearer <token>` header value.
pub fn bearer(header: &str) -> Option<&str> {
    let (scheme, token) = header.trim().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim()).filter(|t| !t.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: &str = r#"{"admins": {"alice": "admin-token-0123456789"},
                       "nodes": {"node-a": "node-a-token-0123456", "node-b": "node-b-token-0123456"}}"#;

    #[test]
    fn authenticates_each_principal() {
        let t = Tokens::parse(T).unwrap();
        assert_eq!(
            t.authenticate("admin-token-0123456789"),
            Some(Principal::Admin("alice".into()))
        );
        assert_eq!(t.authenticate("node-b-token-0123456"), Some(Principal::Node("node-b".into())));
        assert_eq!(t.authenticate("node-b-token-012345"), None);
        assert_eq!(t.authenticate(""), None);
        assert_eq!(t.nodes(), ["node-a", "node-b"]);
        assert!(!format!("{t:?}").contains("token-0"), "Debug never prints tokens");
    }

    #[test]
    fn refuses_weak_shared_and_misnamed_credentials() {
        let short = r#"{"admins": {"alice": "short"}}"#;
        assert!(Tokens::parse(short).unwrap_err().to_string().contains("at least 16"));
        let shared = r#"{"admins": {"alice": "same-token-0123456789"}, "nodes": {"n": "same-token-0123456789"}}"#;
        assert!(Tokens::parse(shared).unwrap_err().to_string().contains("share a token"));
        let bad = r#"{"nodes": {"../x": "node-a-token-0123456"}}"#;
        assert!(Tokens::parse(bad).is_err());
        assert!(Tokens::parse(r#"{"admin": {}}"#).is_err(), "unknown fields are errors");
    }

    #[test]
    fn parses_bearer_headers() {
        assert_eq!(bearer("Bearer abc"), Some("abc"));
        assert_eq!(bearer("bearer  abc "), Some("abc"));
        assert_eq!(bearer("Basic abc"), None);
        assert_eq!(bearer("Bearer "), None);
    }
}
