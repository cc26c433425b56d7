//! Prometheus exposition, rebuilt from the ledger and the allocation table at each scrape
//! (the ledger is the source of truth; nothing here keeps its own counts to drift).
//!
//! `tessera_gpu_seconds_total` is a counter: closed intervals count their final
//! GPU-seconds and open ones count up to their last checkpoint (at most one heartbeat,
//! <= 5 s, behind), so it only grows while the ledger keeps its rows.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;

use metering::IntervalRecord;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tessera_api::{AllocationState, DeviceState, Isolation, NodeStatus};

type Labels = Vec<(String, String)>;

/// Render the text exposition format.
pub fn render(node: &NodeStatus, intervals: &[IntervalRecord]) -> String {
    let mut registry = Registry::with_prefix("tessera");

    let gpu_seconds = Family::<Labels, Counter<f64, AtomicU64>>::default();
    let mut totals: BTreeMap<Labels, f64> = BTreeMap::new();
    for r in intervals {
        let labels = vec![
            ("tenant".to_string(), r.start.tenant.clone()),
            ("gpu_model".to_string(), r.start.gpu_model.clone()),
            ("isolation".to_string(), r.start.isolation.as_str().to_string()),
            ("mig_profile".to_string(), r.start.mig_profile.clone().unwrap_or_default()),
        ];
        *totals.entry(labels).or_default() += r.accrued_gpu_seconds();
    }
    for (labels, v) in totals {
        gpu_seconds.get_or_create(&labels).inc_by(v);
    }
    registry.register(
        "gpu_seconds",
        "GPU-seconds used: time x fraction of a GPU, per tenant",
        gpu_seconds,
    );

    let allocations = Family::<Labels, Gauge>::default();
    let alloc_labels = |iso: Isolation, state: AllocationState| -> Labels {
        vec![
            ("isolation".to_string(), iso.as_str().to_string()),
            ("state".to_string(), format!("{state:?}").to_lowercase()),
        ]
    };
    // Every series exists, at 0 when idle: a scraper sees "none" rather than "unknown".
    for iso in Isolation::ALL {
        for state in [AllocationState::Pending, AllocationState::Running] {
            let _ = allocations.get_or_create(&alloc_labels(iso, state));
        }
    }
    for a in &node.allocations {
        allocations.get_or_create(&alloc_labels(a.isolation, a.state)).inc();
    }
    registry.register("allocations", "Live allocations on this node", allocations);

    let devices = Family::<Labels, Gauge>::default();
    for g in &node.gpus {
        let count = |kind: &str, state: DeviceState| {
            let labels = vec![
                ("kind".to_string(), kind.to_string()),
                ("state".to_string(), format!("{state:?}").to_lowercase()),
            ];
            devices.get_or_create(&labels).inc();
        };
        count("gpu", g.state);
        for i in &g.instances {
            count("mig", i.state);
        }
    }
    registry.register("devices", "GPUs and MIG instances by state", devices);

    // Every MPS share has its series, at 0 until a health check finds its caps changed.
    let cap_drift = Family::<Labels, Counter>::default();
    for sh in &node.mps_shares {
        let labels = vec![
            ("device".to_string(), sh.device.clone()),
            ("tenant".to_string(), sh.tenant.clone()),
        ];
        cap_drift.get_or_create(&labels).inc_by(u64::from(sh.cap_drifts));
    }
    registry.register(
        "mps_cap_drift",
        "MPS caps found changed (through the control socket) and set again, per share, since it was created or adopted",
        cap_drift,
    );

    // Held against driven, per tenant and container: GPU-seconds of the intervals whose
    // utilisation was sampled, and what their processes drove of them (mean SM use x time).
    let held = Family::<Labels, Counter<f64, AtomicU64>>::default();
    let driven = Family::<Labels, Counter<f64, AtomicU64>>::default();
    let mut sums: BTreeMap<Labels, (f64, f64)> = BTreeMap::new();
    for r in intervals {
        let Some(u) = &r.utilization else { continue };
        let labels = vec![
            ("tenant".to_string(), r.start.tenant.clone()),
            ("container".to_string(), r.start.container_id.clone()),
        ];
        let gs = r.accrued_gpu_seconds();
        let e = sums.entry(labels).or_default();
        e.0 += gs;
        e.1 += gs * (u.sm_percent_avg / 100.0 / r.start.fraction).min(1.0);
    }
    for (labels, (h, d)) in sums {
        held.get_or_create(&labels).inc_by(h);
        driven.get_or_create(&labels).inc_by(d);
    }
    registry.register(
        "gpu_seconds_sampled",
        "GPU-seconds held by intervals whose per-process utilisation was sampled (whole GPUs; never MIG)",
        held,
    );
    registry.register(
        "gpu_seconds_driven",
        "Of the sampled GPU-seconds, what the container's processes drove (mean SM use x time)",
        driven,
    );

    // Whole GPUs held far below what they offer over the last day, and the MIG profile
    // that fits (metering::idle): one series per container and device, value 1.
    let underdriven = Family::<Labels, Gauge>::default();
    let now = tessera_api::time::now_ms();
    let day = now.saturating_sub(24 * 3_600_000);
    let spans: Vec<metering::Span> = intervals
        .iter()
        .map(|r| {
            let (end, open) = match &r.end {
                Some(e) => (r.start_wall_ms.saturating_add(e.duration_ms), false),
                None => (r.checkpoint_wall_ms.max(r.start_wall_ms), true),
            };
            metering::Span::new(
                r.start.clone(),
                r.start_wall_ms,
                end - r.start_wall_ms,
                open,
                r.utilization.as_ref(),
                r.preempted_ms.is_some(),
            )
        })
        .collect();
    for s in metering::idle::under_driven(&spans, day, now.max(day + 1)) {
        let labels = vec![
            ("tenant".to_string(), s.tenant),
            ("container".to_string(), s.container_id),
            ("device".to_string(), s.device_uuid),
            ("fits".to_string(), s.fits),
        ];
        underdriven.get_or_create(&labels).set(1);
    }
    registry.register(
        "underdriven_gpu",
        "A whole GPU held in the last 24 h whose peak SM use (x 1.25) fits the MIG profile `fits`",
        underdriven,
    );

    let open = Gauge::<i64, std::sync::atomic::AtomicI64>::default();
    open.set(intervals.iter().filter(|r| r.end.is_none()).count() as i64);
    registry.register("open_intervals", "Ledger intervals currently open", open);

    let mut out = String::new();
    if let Err(e) = encode(&mut out, &registry) {
        return format!("# encoding metrics failed: {e}\n");
    }
    out
}
