//! Signed policy revisions: the envelope, signing, verification and key files.
//!
//! The signature is ed25519 over a canonical byte string:
//!
//! ```text
//! tessera-policy-v1\n{version}\n{digest}\n{created_ms}\n{author}
//! ```
//!
//! where `digest` is the lowercase hex SHA-256 of the exact policy bytes. The bytes
//! travel base64-encoded in the envelope, so what a node applies is byte-for-byte what
//! the admin pushed (and `Policy::digest()` equals the envelope's digest).
//!
//! Key files hold the 32-byte ed25519 seed as 64 hex digits or as base64 (whitespace
//! around it is ignored); a public key is written the same way (hex by default).

use std::fmt;
use std::io::{Read, Write};
use std::path::Path;

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
pub use ed25519_dalek::VerifyingKey;
use ed25519_dalek::{Signature, Signer as _, SigningKey};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

/// The first line of every signed message: a domain separator and format version.
pub const SIGNING_CONTEXT: &str = "tessera-policy-v1";

/// A policy revision as stored and served: the policy bytes, who pushed them and when,
/// and the coordinator's signature over all of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SignedPolicy {
    /// The policy's own `version` field; strictly increasing across revisions.
    pub version: u64,
    /// The admin who pushed it (from the admin's credential; see the server docs).
    pub author: String,
    /// When the coordinator accepted it, Unix milliseconds.
    pub created_ms: u64,
    /// Lowercase hex SHA-256 of the policy bytes.
    pub digest: String,
    /// The policy bytes, base64 (standard alphabet, padded).
    pub policy_b64: String,
    /// [`key_id`] of the signing key (informational: the pinned key decides).
    #[serde(default)]
    pub key_id: String,
    /// Base64 ed25519 signature over [`canonical_message`]; empty when unsigned.
    #[serde(default)]
    pub signature: String,
}

impl SignedPolicy {
    /// The policy bytes, if `policy_b64` decodes.
    pub fn policy_bytes(&self) -> Result<Vec<u8>, VerifyError> {
        B64.decode(self.policy_b64.as_bytes())
            .map_err(|e| VerifyError::Malformed(format!("policy_b64 is not base64: {e}")))
    }
}

/// A revision that passed [`verify`]: safe to apply.
#[derive(Debug, Clone)]
pub struct Verified {
    pub version: u64,
    /// The exact policy bytes (what to write to disk, what the digest is of).
    pub bytes: Vec<u8>,
    pub digest: String,
    pub author: String,
    pub created_ms: u64,
    pub key_id: String,
    /// The parsed and validated policy.
    pub policy: policy::Policy,
    /// The envelope it came in (kept as last-known-good, re-verified on load).
    pub envelope: SignedPolicy,
}

/// Why a revision was not accepted. Each message says what a node operator needs to know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerifyError {
    #[error("unsigned policy: {0}")]
    Unsigned(String),
    #[error("malformed policy envelope: {0}")]
    Malformed(String),
    #[error("signed by key {key_id}, but the pinned trust key is {pinned}")]
    WrongKey { key_id: String, pinned: String },
    #[error("forged or corrupted: the signature does not verify against the pinned key {pinned}")]
    BadSignature { pinned: String },
    #[error("tampered policy bytes: the envelope claims digest {claimed} but the bytes hash to {actual}")]
    DigestMismatch { claimed: String, actual: String },
    #[error("signed bytes are not a valid policy: {0}")]
    InvalidPolicy(String),
    #[error("envelope version {envelope} differs from the policy's own version {policy}")]
    VersionMismatch { envelope: u64, policy: u64 },
}

impl VerifyError {
    /// A short machine-readable kind: `unsigned`, `malformed`, `wrong-key`, `forged`,
    /// `tampered`, `invalid-policy`, `version-mismatch`.
    pub fn kind(&self) -> &'static str {
        match self {
            VerifyError::Unsigned(_) => "unsigned",
            VerifyError::Malformed(_) => "malformed",
            VerifyError::WrongKey { .. } => "wrong-key",
            VerifyError::BadSignature { .. } => "forged",
            VerifyError::DigestMismatch { .. } => "tampered",
            VerifyError::InvalidPolicy(_) => "invalid-policy",
            VerifyError::VersionMismatch { .. } => "version-mismatch",
        }
    }
}

/// Why a revision could not be signed.
#[derive(Debug, thiserror::Error)]
pub enum SignError {
    #[error(transparent)]
    Policy(#[from] policy::PolicyError),
    #[error("author {0:?} must be non-empty and free of control characters")]
    BadAuthor(String),
}

/// Why a key file could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{what}: expected a 32-byte ed25519 key as 64 hex digits or base64, {detail}")]
    Format { what: String, detail: String },
    #[error("{what}: not a valid ed25519 public key: {detail}")]
    BadPublicKey { what: String, detail: String },
}

/// A short id of a public key: the first 16 hex digits of SHA-256 over its 32 bytes.
pub fn key_id(key: &VerifyingKey) -> String {
    let d = Sha256::digest(key.to_bytes());
    hex::encode(&d[..8])
}

/// Lowercase hex SHA-256 of `bytes` (what `policy::Policy::digest` computes).
pub fn digest_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// The exact bytes the signature covers.
pub fn canonical_message(version: u64, digest: &str, created_ms: u64, author: &str) -> Vec<u8> {
    format!("{SIGNING_CONTEXT}\n{version}\n{digest}\n{created_ms}\n{author}").into_bytes()
}

fn check_author(author: &str) -> Result<(), SignError> {
    if author.is_empty() || author.chars().any(char::is_control) {
        return Err(SignError::BadAuthor(author.to_string()));
    }
    Ok(())
}

/// Validate `bytes` as a policy and sign them. The envelope's version is the policy's own.
pub fn sign(
    key: &SigningKey,
    bytes: &[u8],
    author: &str,
    created_ms: u64,
) -> Result<SignedPolicy, SignError> {
    check_author(author)?;
    let parsed = policy::Policy::parse(bytes, "pushed policy")?;
    Ok(sign_parsed(key, &parsed, bytes, author, created_ms))
}

/// Sign bytes that were already parsed into `parsed` (the server validates first).
pub fn sign_parsed(
    key: &SigningKey,
    parsed: &policy::Policy,
    bytes: &[u8],
    author: &str,
    created_ms: u64,
) -> SignedPolicy {
    let digest = parsed.digest();
    let version = parsed.version();
    let msg = canonical_message(version, &digest, created_ms, author);
    let signature: Signature = key.sign(&msg);
    SignedPolicy {
        version,
        author: author.to_string(),
        created_ms,
        digest,
        policy_b64: B64.encode(bytes),
        key_id: key_id(&key.verifying_key()),
        signature: B64.encode(signature.to_bytes()),
    }
}

/// Check an envelope against the pinned key: signed, by that key, over these bytes,
/// which are a valid policy of the envelope's version.
pub fn verify(signed: &SignedPolicy, pinned: &VerifyingKey) -> Result<Verified, VerifyError> {
    let pinned_id = key_id(pinned);
    if signed.signature.trim().is_empty() {
        return Err(VerifyError::Unsigned(format!(
            "version {} carries no signature (a node accepts only policies signed by key {pinned_id})",
            signed.version
        )));
    }
    if !signed.key_id.is_empty() && signed.key_id != pinned_id {
        return Err(VerifyError::WrongKey { key_id: signed.key_id.clone(), pinned: pinned_id });
    }
    let bytes = signed.policy_bytes()?;
    let actual = digest_hex(&bytes);
    if actual != signed.digest {
        return Err(VerifyError::DigestMismatch { claimed: signed.digest.clone(), actual });
    }
    let sig_bytes = B64
        .decode(signed.signature.trim().as_bytes())
        .map_err(|_| VerifyError::BadSignature { pinned: pinned_id.clone() })?;
    let sig = Signature::from_slice(&sig_bytes)
        .map_err(|_| VerifyError::BadSignature { pinned: pinned_id.clone() })?;
    let msg = canonical_message(signed.version, &signed.digest, signed.created_ms, &signed.author);
    pinned
        .verify_strict(&msg, &sig)
        .map_err(|_| VerifyError::BadSignature { pinned: pinned_id })?;
    let parsed = policy::Policy::parse(&bytes, &format!("policy version {}", signed.version))
        .map_err(|e| VerifyError::InvalidPolicy(e.to_string()))?;
    if parsed.version() != signed.version {
        return Err(VerifyError::VersionMismatch {
            envelope: signed.version,
            policy: parsed.version(),
        });
    }
    Ok(Verified {
        version: signed.version,
        bytes,
        digest: signed.digest.clone(),
        author: signed.author.clone(),
        created_ms: signed.created_ms,
        key_id: signed.key_id.clone(),
        policy: parsed,
        envelope: signed.clone(),
    })
}

/// Decode a coordinator's answer into an envelope. A bare policy (not wrapped and signed)
/// is [`VerifyError::Unsigned`]; anything else that is not an envelope is malformed.
pub fn parse_envelope(bytes: &[u8]) -> Result<SignedPolicy, VerifyError> {
    match serde_json::from_slice::<SignedPolicy>(bytes) {
        Ok(env) => Ok(env),
        Err(e) => {
            if policy::Policy::parse(bytes, "answer").is_ok() {
                Err(VerifyError::Unsigned(
                    "the coordinator answered a bare policy document, not a signed envelope".into(),
                ))
            } else {
                Err(VerifyError::Malformed(e.to_string()))
            }
        }
    }
}

fn decode_32(text: &str, what: &str) -> Result<[u8; 32], KeyError> {
    let t = text.trim();
    let bytes = if t.len() == 64 && t.bytes().all(|b| b.is_ascii_hexdigit()) {
        hex::decode(t).map_err(|e| KeyError::Format { what: what.into(), detail: e.to_string() })?
    } else {
        B64.decode(t.as_bytes()).map_err(|_| KeyError::Format {
            what: what.into(),
            detail: format!("got {} characters that are neither", t.len()),
        })?
    };
    <[u8; 32]>::try_from(bytes.as_slice()).map_err(|_| KeyError::Format {
        what: what.into(),
        detail: format!("decoded to {} bytes", bytes.len()),
    })
}

/// Parse a signing key (ed25519 seed) from hex or base64 text.
pub fn parse_signing_key(text: &str, what: &str) -> Result<SigningKey, KeyError> {
    Ok(SigningKey::from_bytes(&decode_32(text, what)?))
}

/// Read a signing key file.
pub fn load_signing_key(path: &Path) -> Result<SigningKey, KeyError> {
    let text = std::fs::read_to_string(path)
        .map_err(|source| KeyError::Io { path: path.display().to_string(), source })?;
    parse_signing_key(&text, &path.display().to_string())
}

/// Parse a public key from hex or base64 text.
pub fn parse_verifying_key(text: &str, what: &str) -> Result<VerifyingKey, KeyError> {
    VerifyingKey::from_bytes(&decode_32(text, what)?)
        .map_err(|e| KeyError::BadPublicKey { what: what.into(), detail: e.to_string() })
}

/// A public key given on a command line: the key itself (hex or base64), or a file
/// holding it.
pub fn load_verifying_key(arg: &str) -> Result<VerifyingKey, KeyError> {
    match parse_verifying_key(arg, "trust key") {
        Ok(k) => Ok(k),
        Err(literal_err) => {
            let path = Path::new(arg);
            if path.exists() {
                let text = std::fs::read_to_string(path)
                    .map_err(|source| KeyError::Io { path: arg.to_string(), source })?;
                parse_verifying_key(&text, arg)
            } else {
                Err(literal_err)
            }
        }
    }
}

/// The public key as 64 hex digits.
pub fn encode_verifying_key(key: &VerifyingKey) -> String {
    hex::encode(key.to_bytes())
}

/// A fresh signing key from the kernel's CSPRNG (`/dev/urandom`).
pub fn generate_signing_key() -> Result<SigningKey, KeyError> {
    let mut seed = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut seed))
        .map_err(|source| KeyError::Io { path: "/dev/urandom".into(), source })?;
    Ok(SigningKey::from_bytes(&seed))
}

/// Write a signing key as hex to a new file with mode 0600 (never overwrites).
pub fn write_signing_key(path: &Path, key: &SigningKey) -> Result<(), KeyError> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let io = |source| KeyError::Io { path: path.display().to_string(), source };
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(io)?;
    f.write_all(format!("{}\n", hex::encode(key.to_bytes())).as_bytes()).map_err(io)?;
    f.sync_all().map_err(io)
}

/// A signing key that never prints its secret.
#[derive(Clone)]
pub struct Signer {
    key: SigningKey,
    key_id: String,
}

impl Signer {
    pub fn new(key: SigningKey) -> Self {
        let key_id = key_id(&key.verifying_key());
        Signer { key, key_id }
    }
    pub fn key(&self) -> &SigningKey {
        &self.key
    }
    pub fn key_id(&self) -> &str {
        &self.key_id
    }
    pub fn verifying_key(&self) -> VerifyingKey {
        self.key.verifying_key()
    }
}

impl fmt::Debug for Signer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Signer").field("key_id", &self.key_id).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u8) -> SigningKey {
        SigningKey::from_bytes(&[n; 32])
    }

    fn policy_bytes(version: u64) -> Vec<u8> {
        format!(r#"{{"version": {version}, "orgs": {{"acme": {{"trust": "trusted"}}}}, "default_tenant": "acme"}}"#)
            .into_bytes()
    }

    #[test]
    fn signs_and_verifies() {
        let k = key(1);
        let env = sign(&k, &policy_bytes(3), "alice", 1_700_000_000_000).unwrap();
        assert_eq!(env.version, 3);
        assert_eq!(env.key_id, key_id(&k.verifying_key()));
        let v = verify(&env, &k.verifying_key()).unwrap();
        assert_eq!(v.version, 3);
        assert_eq!(v.bytes, policy_bytes(3));
        assert_eq!(v.policy.digest(), env.digest);
        assert_eq!(v.author, "alice");
    }

    #[test]
    fn wrong_key_and_forged_signatures_are_refused() {
        let (good, evil) = (key(1), key(2));
        let env = sign(&evil, &policy_bytes(3), "mallory", 1).unwrap();
        let err = verify(&env, &good.verifying_key()).unwrap_err();
        assert_eq!(err.kind(), "wrong-key", "{err}");
        // The forger claims the pinned key's id: the signature still fails.
        let forged = SignedPolicy { key_id: key_id(&good.verifying_key()), ..env.clone() };
        let err = verify(&forged, &good.verifying_key()).unwrap_err();
        assert_eq!(err.kind(), "forged", "{err}");
        // Garbage in the signature field.
        let garbage = SignedPolicy { signature: "!!".into(), key_id: String::new(), ..env };
        assert_eq!(verify(&garbage, &good.verifying_key()).unwrap_err().kind(), "forged");
    }

    #[test]
    fn every_signed_field_is_covered() {
        let k = key(1);
        let pk = k.verifying_key();
        let env = sign(&k, &policy_bytes(3), "alice", 5).unwrap();
        let author = SignedPolicy { author: "bob".into(), ..env.clone() };
        assert_eq!(verify(&author, &pk).unwrap_err().kind(), "forged");
        let time = SignedPolicy { created_ms: 6, ..env.clone() };
        assert_eq!(verify(&time, &pk).unwrap_err().kind(), "forged");
        let version = SignedPolicy { version: 4, ..env.clone() };
        assert_eq!(verify(&version, &pk).unwrap_err().kind(), "forged");
    }

    #[test]
    fn tampered_bytes_and_digest_mismatch_are_refused() {
        let k = key(1);
        let pk = k.verifying_key();
        let env = sign(&k, &policy_bytes(3), "alice", 5).unwrap();
        // Bytes swapped, digest left: the digest check catches it.
        let swapped = SignedPolicy { policy_b64: B64.encode(policy_bytes(4)), ..env.clone() };
        let err = verify(&swapped, &pk).unwrap_err();
        assert_eq!(err.kind(), "tampered", "{err}");
        assert!(err.to_string().contains(&env.digest), "{err}");
        // Bytes and digest swapped consistently: the signature catches it.
        let both = SignedPolicy {
            policy_b64: B64.encode(policy_bytes(4)),
            digest: digest_hex(&policy_bytes(4)),
            ..env.clone()
        };
        assert_eq!(verify(&both, &pk).unwrap_err().kind(), "forged");
        let not_b64 = SignedPolicy { policy_b64: "%%%".into(), ..env };
        assert_eq!(verify(&not_b64, &pk).unwrap_err().kind(), "malformed");
    }

    #[test]
    fn unsigned_envelopes_and_bare_policies_are_refused() {
        let k = key(1);
        let env = sign(&k, &policy_bytes(3), "alice", 5).unwrap();
        let unsigned = SignedPolicy { signature: String::new(), ..env.clone() };
        let err = verify(&unsigned, &k.verifying_key()).unwrap_err();
        assert_eq!(err.kind(), "unsigned", "{err}");
        let mut json = serde_json::to_value(&env).unwrap();
        json.as_object_mut().unwrap().remove("signature");
        let parsed = parse_envelope(json.to_string().as_bytes()).unwrap();
        assert_eq!(verify(&parsed, &k.verifying_key()).unwrap_err().kind(), "unsigned");
        let err = parse_envelope(&policy_bytes(3)).unwrap_err();
        assert_eq!(err.kind(), "unsigned", "{err}");
        assert_eq!(parse_envelope(b"{\"x\":1}").unwrap_err().kind(), "malformed");
    }

    #[test]
    fn a_signed_invalid_policy_or_version_lie_is_refused() {
        // A coordinator key signing something that is not a valid policy (sign_parsed
        // bypasses validation, as a buggy or compromised signer could).
        let k = key(1);
        let bytes = br#"{"version": 2, "orgs": {}}"#;
        let digest = digest_hex(bytes);
        let msg = canonical_message(2, &digest, 1, "a");
        let env = SignedPolicy {
            version: 2,
            author: "a".into(),
            created_ms: 1,
            digest,
            policy_b64: B64.encode(bytes),
            key_id: key_id(&k.verifying_key()),
            signature: B64.encode(k.sign(&msg).to_bytes()),
        };
        let err = verify(&env, &k.verifying_key()).unwrap_err();
        assert_eq!(err.kind(), "invalid-policy", "{err}");
        assert!(err.to_string().contains("orgs"), "{err}");
        let bytes = policy_bytes(7);
        let digest = digest_hex(&bytes);
        let msg = canonical_message(8, &digest, 1, "a");
        let env = SignedPolicy {
            version: 8,
            author: "a".into(),
            created_ms: 1,
            digest,
            policy_b64: B64.encode(&bytes),
            key_id: String::new(),
            signature: B64.encode(k.sign(&msg).to_bytes()),
        };
        assert_eq!(verify(&env, &k.verifying_key()).unwrap_err().kind(), "version-mismatch");
    }

    #[test]
    fn authors_cannot_smuggle_lines() {
        assert!(matches!(sign(&key(1), &policy_bytes(1), "a\nb", 1), Err(SignError::BadAuthor(_))));
        assert!(matches!(sign(&key(1), &policy_bytes(1), "", 1), Err(SignError::BadAuthor(_))));
    }

    #[test]
    fn key_files_round_trip_in_hex_and_base64() {
        let dir = tempfile::tempdir().unwrap();
        let k = generate_signing_key().unwrap();
        let path = dir.path().join("k");
        write_signing_key(&path, &k).unwrap();
        assert!(write_signing_key(&path, &k).is_err(), "never overwrites");
        assert_eq!(load_signing_key(&path).unwrap().to_bytes(), k.to_bytes());
        let b64 = dir.path().join("k64");
        std::fs::write(&b64, format!("  {}\n", B64.encode(k.to_bytes()))).unwrap();
        assert_eq!(load_signing_key(&b64).unwrap().to_bytes(), k.to_bytes());
        let pk_hex = encode_verifying_key(&k.verifying_key());
        assert_eq!(load_verifying_key(&pk_hex).unwrap(), k.verifying_key());
        let pk_file = dir.path().join("pub");
        std::fs::write(&pk_file, &pk_hex).unwrap();
        assert_eq!(load_verifying_key(pk_file.to_str().unwrap()).unwrap(), k.verifying_key());
        assert!(parse_signing_key("abcd", "k").is_err());
        assert!(load_verifying_key("/nonexistent/key").is_err());
    }
}
