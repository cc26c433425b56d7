//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::Path;
use std::sync::Arc;

use metering::{Class, IntervalStart, Ledger, ManualClock};
use tessera_api::Isolation;

/// 2026-01-01T00:00:00Z in Unix ms: a round wall-clock origin.
pub const T0: u64 = 1_767_225_600_000;

pub fn clock() -> Arc<ManualClock> {
    Arc::new(ManualClock::new(T0, 1_000_000))
}

pub fn open(path: &Path, clock: &Arc<ManualClock>) -> Ledger {
    Ledger::open(path, clock.clone()).expect("open ledger")
}

pub fn start(container: &str, tenant: &str, device: &str) -> IntervalStart {
    IntervalStart {
        container_id: container.to_string(),
        tenant: tenant.to_string(),
        node: "node-a".to_string(),
        gpu_uuid: format!("GPU-{device}"),
        gpu_model: "H100-80GB".to_string(),
        device_uuid: format!("GPU-{device}"),
        isolation: Isolation::Gpu,
        mig_profile: None,
        fraction: 1.0,
        class: Class::Guaranteed,
        workload: None,
        nvlink_domain: None,
    }
}

pub fn mig(container: &str, tenant: &str, device: &str, slices: u8) -> IntervalStart {
    IntervalStart {
        device_uuid: format!("MIG-{device}"),
        isolation: Isolation::Mig,
        mig_profile: Some(format!("{slices}g.10gb")),
        fraction: metering::fraction(Isolation::Mig, Some(slices), None, None, None),
        ..start(container, tenant, device)
    }
}

pub fn sha(path: &Path) -> Vec<u8> {
    use sha2::Digest;
    sha2::Sha256::digest(std::fs::read(path).expect("read file")).to_vec()
}
