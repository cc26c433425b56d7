//! HTTPS between the coordinator and its clients: only a client that trusts the fleet's
//! CA talks to it; tokens never go out on a connection that failed verification.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use coordinator::server::Coordinator;
use coordinator::{AgentStatus, PolicyAgent, RunningCoordinator};

use crate::common::*;

/// A CA, and a certificate for 127.0.0.1 and localhost signed by it, as PEM files.
struct Pki {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

fn pki(dir: &Path, name: &str) -> Pki {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(rcgen::DnType::CommonName, format!("{name} test CA"));
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let params =
        rcgen::CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()])
            .unwrap();
    let cert = params.signed_by(&key, &ca, &ca_key).unwrap();
    let p = Pki {
        ca: dir.join(format!("{name}-ca.pem")),
        cert: dir.join(format!("{name}-cert.pem")),
        key: dir.join(format!("{name}-key.pem")),
    };
    std::fs::write(&p.ca, ca.pem()).unwrap();
    std::fs::write(&p.cert, cert.pem()).unwrap();
    std::fs::write(&p.key, key.serialize_pem()).unwrap();
    p
}

async fn start_tls(db: &Path, pki: &Pki) -> RunningCoordinator {
    let store = Arc::new(coordinator::store::SqliteStore::open(db).expect("sqlite store"));
    let tls = coordinator::tls::server_config(&pki.cert, &pki.key).expect("server tls");
    RunningCoordinator::start_with(
        "127.0.0.1:0".parse().unwrap(),
        Coordinator::new(store, key(), tokens()),
        Some(tls),
    )
    .await
    .expect("start")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_coordinator_talks_only_to_clients_that_trust_its_ca() {
    let dir = tempfile::tempdir().unwrap();
    let fleet = pki(dir.path(), "fleet");
    let other = pki(dir.path(), "other");
    let c = start_tls(&dir.path().join("c.db"), &fleet).await;
    assert!(c.url().starts_with("https://127.0.0.1:"), "{}", c.url());
    let trusting = coordinator::tls::client_config(&fleet.ca).unwrap();

    // A client with the fleet's CA pushes and reads.
    let a = admin(&c.url()).with_tls(Some(trusting.clone()));
    a.push_policy(&policy(1), None).await.expect("push over https");
    assert_eq!(a.history().await.expect("history").len(), 1);

    // No CA: refused before connecting, naming the flag.
    let e = admin(&c.url()).push_policy(&policy(2), None).await.expect_err("no CA");
    assert!(e.to_string().contains("--coordinator-ca"), "{e}");
    // Another CA: the handshake fails, nothing is sent.
    let wrong = coordinator::tls::client_config(&other.ca).unwrap();
    let e = admin(&c.url())
        .with_tls(Some(wrong))
        .push_policy(&policy(2), None)
        .await
        .expect_err("wrong CA");
    assert!(e.to_string().contains("TLS"), "{e}");
    // Plain HTTP to the TLS port gets no HTTP answer.
    let plain = c.url().replacen("https://", "http://", 1);
    let e =
        admin(&plain).with_timeout(Duration::from_secs(5)).history().await.expect_err("plain http");
    assert!(!e.to_string().contains("200"), "{e}");
    assert_eq!(a.history().await.expect("history").len(), 1, "a refused client pushed something");

    // A node agent over https follows pushes.
    let mut cfg = agent_config(vec![c.url()], "node-a", NODE_A, dir.path().join("lkg.json"));
    cfg.tls = Some(trusting);
    let running =
        RunningAgent::start(PolicyAgent::new(cfg).expect("agent"), AgentStatus::default());
    running
        .wait_for("version 1 over https", Duration::from_secs(10), |s| s.applied_version == Some(1))
        .await;
    a.push_policy(&policy_with(2, "dev"), None).await.expect("push 2");
    running
        .wait_for("version 2 over https", Duration::from_secs(10), |s| s.applied_version == Some(2))
        .await;
    drop(running);
    c.shutdown().await;
}

#[test]
fn a_certificate_with_the_wrong_key_is_refused_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let a = pki(dir.path(), "a");
    let b = pki(dir.path(), "b");
    let e = coordinator::tls::server_config(&a.cert, &b.key).expect_err("mismatched key");
    assert!(e.to_string().contains("a-cert.pem"), "{e}");
    // A key file given as the certificate, and a certificate given as the key.
    assert!(coordinator::tls::server_config(&a.key, &a.key).is_err());
    assert!(coordinator::tls::server_config(&a.cert, &a.cert)
        .expect_err("cert as key")
        .to_string()
        .contains("a-cert.pem"));
}
