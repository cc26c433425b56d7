//! TLS for the coordinator's HTTP: the certificate and key it serves with, and the CA its
//! clients (node agents, the CLI) verify it against. Bearer tokens then never cross a
//! network in clear text. PEM files; rustls with the ring provider; TLS 1.2 and 1.3.
//!
//! Clients trust exactly the CA file they are given (no system roots): a fleet's
//! coordinator certificate comes from the fleet's own CA.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::ring::default_provider;
use rustls::RootCertStore;
pub use rustls::{ClientConfig, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// Why a TLS configuration could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {why}")]
    File { path: PathBuf, why: String },
    #[error("TLS configuration: {0}")]
    Config(String),
}

fn file_err(path: &Path, why: impl std::fmt::Display) -> TlsError {
    TlsError::File { path: path.to_path_buf(), why: why.to_string() }
}

/// Every certificate in a PEM file (at least one).
fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_err(path, format!("cannot read PEM certificates: {e}")))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_err(path, format!("malformed PEM certificate: {e}")))?;
    if certs.is_empty() {
        return Err(file_err(path, "no certificate (expected a PEM `BEGIN CERTIFICATE` block)"));
    }
    Ok(certs)
}

/// The server side: `cert` (PEM chain, leaf first) and its private `key` (PEM, PKCS#8,
/// PKCS#1 or SEC1).
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, TlsError> {
    let chain = certs(cert)?;
    let key = PrivateKeyDer::from_pem_file(key)
        .map_err(|e| file_err(key, format!("no usable PEM private key: {e}")))?;
    let cfg = ServerConfig::builder_with_provider(Arc::new(default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| {
            TlsError::Config(format!("{} does not go with its key: {e}", cert.display()))
        })?;
    Ok(Arc::new(cfg))
}

/// The client side: trust the CA certificate(s) in `ca` (PEM) and nothing else.
pub fn client_config(ca: &Path) -> Result<Arc<ClientConfig>, TlsError> {
    let mut roots = RootCertStore::empty();
    for c in certs(ca)? {
        roots.add(c).map_err(|e| file_err(ca, format!("not a usable CA certificate: {e}")))?;
    }
    let cfg = ClientConfig::builder_with_provider(Arc::new(default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(Arc::new(cfg))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_empty_and_garbage_files_are_named() {
        let d = tempfile::tempdir().expect("tmp");
        let missing = d.path().join("missing.pem");
        let e = client_config(&missing).expect_err("missing");
        assert!(matches!(&e, TlsError::File { path, .. } if path == &missing), "{e}");
        let empty = d.path().join("empty.pem");
        std::fs::write(&empty, "").expect("write");
        let e = client_config(&empty).expect_err("empty");
        assert!(e.to_string().contains("no certificate"), "{e}");
        let junk = d.path().join("junk.pem");
        std::fs::write(
            &junk,
            "-----BEGIN CERTIFICATE-----\nnot base64!!\n-----END CERTIFICATE-----\n",
        )
        .expect("write");
        let e = client_config(&junk).expect_err("junk");
        assert!(e.to_string().contains(&junk.display().to_string()), "{e}");
        let e = server_config(&empty, &missing).expect_err("server");
        assert!(e.to_string().contains("empty.pem"), "{e}");
    }
}
