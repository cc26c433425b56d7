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

/// A device's GPU index, model, and MIG profile and GPU-instance id where it is one.
pub type DeviceLabels = (u32, String, Option<(String, u32)>);

/// What [`render_telemetry`] exports: the last telemetry sample, what the node knows of
/// each device, and the interference incidents counted since start.
#[derive(Debug, Clone, Default)]
pub struct TelemetryMetrics {
    pub hostname: String,
    pub telemetry: Option<tessera_api::telemetry::NodeTelemetry>,
    /// Device uuid -> (GPU index, model, MIG profile and GPU-instance id where MIG).
    pub devices: BTreeMap<String, DeviceLabels>,
    /// Container id -> its pod container (namespace, pod, container), where it is one.
    pub pods: BTreeMap<String, (String, String, String)>,
    /// (device, victim, aggressor, signal) -> incidents opened since start.
    pub incidents: BTreeMap<(String, String, String, String), u64>,
}

/// A label value in the text exposition format: `\`, `"` and newlines escaped.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

fn labels(pairs: &[(&str, &str)]) -> String {
    let inner: Vec<String> = pairs.iter().map(|(k, v)| format!("{k}=\"{}\"", label(v))).collect();
    format!("{{{}}}", inner.join(","))
}

/// The telemetry as Prometheus text: per device under the names dcgm-exporter uses
/// (`DCGM_FI_DEV_GPU_UTIL`, `DCGM_FI_PROF_SM_ACTIVE`, `DCGM_FI_PROF_DRAM_ACTIVE`, ... with
/// its labels `gpu`, `UUID`, `device`, `modelName`, `Hostname`, `GPU_I_PROFILE`,
/// `GPU_I_ID`, and `namespace`, `pod`, `container` where one pod container holds the
/// device alone), per container as `tessera_container_*` (with `tenant` and the pod
/// labels), and the interference incidents.
pub fn render_telemetry(m: &TelemetryMetrics) -> String {
    let Some(t) = &m.telemetry else { return String::new() };
    let mut families: BTreeMap<&str, (&str, &str, Vec<String>)> = BTreeMap::new();
    let mut put = |name: &'static str,
                   kind: &'static str,
                   help: &'static str,
                   l: String,
                   v: f64| {
        families.entry(name).or_insert((kind, help, Vec::new())).2.push(format!("{name}{l} {v}"));
    };
    // Exclusive holders by device, for dcgm-exporter's pod labels.
    let mut holders: BTreeMap<&str, Vec<&tessera_api::telemetry::ContainerUsage>> = BTreeMap::new();
    for c in &t.containers {
        holders.entry(c.device.as_str()).or_default().push(c);
    }
    for d in &t.devices {
        let Some((index, model, mig)) = m.devices.get(&d.uuid) else { continue };
        let index = index.to_string();
        let dev = format!("nvidia{index}");
        let mut l: Vec<(&str, &str)> = vec![
            ("gpu", &index),
            ("UUID", &d.uuid),
            ("device", &dev),
            ("modelName", model),
            ("Hostname", &m.hostname),
        ];
        let gi = mig.as_ref().map(|(p, gi)| (p.clone(), gi.to_string()));
        if let Some((p, gi)) = &gi {
            l.push(("GPU_I_PROFILE", p));
            l.push(("GPU_I_ID", gi));
        }
        let pod = match holders.get(d.uuid.as_str()).map(Vec::as_slice) {
            Some([one]) => m.pods.get(&one.container_id),
            _ => None,
        };
        if let Some((ns, p, c)) = pod {
            l.push(("namespace", ns));
            l.push(("pod", p));
            l.push(("container", c));
        }
        let l = labels(&l);
        if let Some(v) = d.sm_active {
            put("DCGM_FI_PROF_SM_ACTIVE", "gauge", "Ratio of cycles an SM has at least one warp assigned (Tessera: SM activity, GPM or utilisation)", l.clone(), v);
            put(
                "DCGM_FI_DEV_GPU_UTIL",
                "gauge",
                "GPU utilization (in %)",
                l.clone(),
                (v * 100.0).round(),
            );
        }
        if let Some(v) = d.dram_active {
            put(
                "DCGM_FI_PROF_DRAM_ACTIVE",
                "gauge",
                "Ratio of cycles the device memory interface is active sending or receiving data",
                l.clone(),
                v,
            );
            put(
                "DCGM_FI_DEV_MEM_COPY_UTIL",
                "gauge",
                "Memory utilization (in %)",
                l.clone(),
                (v * 100.0).round(),
            );
        }
        for (name, help, v) in [
            (
                "DCGM_FI_PROF_PCIE_TX_BYTES",
                "The rate of data transmitted over the PCIe bus, in bytes per second",
                d.pcie_tx_bytes_per_s,
            ),
            (
                "DCGM_FI_PROF_PCIE_RX_BYTES",
                "The rate of data received over the PCIe bus, in bytes per second",
                d.pcie_rx_bytes_per_s,
            ),
            (
                "DCGM_FI_PROF_NVLINK_TX_BYTES",
                "The rate of data transmitted over NVLink, in bytes per second",
                d.nvlink_tx_bytes_per_s,
            ),
            (
                "DCGM_FI_PROF_NVLINK_RX_BYTES",
                "The rate of data received over NVLink, in bytes per second",
                d.nvlink_rx_bytes_per_s,
            ),
        ] {
            if let Some(v) = v {
                put(name, "gauge", help, l.clone(), v as f64);
            }
        }
        if let Some(v) = d.power_watts {
            put("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)", l.clone(), v);
        }
        if let Some(v) = d.sm_clock_mhz {
            put(
                "DCGM_FI_DEV_SM_CLOCK",
                "gauge",
                "SM clock frequency (in MHz)",
                l.clone(),
                f64::from(v),
            );
        }
        if let Some(v) = d.mem_clock_mhz {
            put(
                "DCGM_FI_DEV_MEM_CLOCK",
                "gauge",
                "Memory clock frequency (in MHz)",
                l.clone(),
                f64::from(v),
            );
        }
        if d.uuid == d.gpu_uuid {
            put(
                "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
                "gauge",
                "Current clock throttle reasons (bitmask of nvmlClocksThrottleReason*)",
                l.clone(),
                d.throttle_mask as f64,
            );
        }
        if let Some(v) = d.ecc_corrected {
            put(
                "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
                "counter",
                "Total number of single-bit volatile ECC errors",
                l.clone(),
                v as f64,
            );
        }
        if let Some(v) = d.ecc_uncorrected {
            put(
                "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
                "counter",
                "Total number of double-bit volatile ECC errors",
                l.clone(),
                v as f64,
            );
        }
    }
    for c in &t.containers {
        let (ns, pod, ctr) = m.pods.get(&c.container_id).cloned().unwrap_or_default();
        let l = labels(&[
            ("container_id", &c.container_id),
            ("tenant", &c.tenant),
            ("namespace", &ns),
            ("pod", &pod),
            ("container", &ctr),
            ("UUID", &c.device),
            ("isolation", c.isolation.as_str()),
            ("class", c.class.map_or("", |k| k.as_str())),
        ]);
        if let Some(v) = c.sm {
            put(
                "tessera_container_sm_utilization_ratio",
                "gauge",
                "SM utilisation by the container's processes, fraction of its device",
                l.clone(),
                v,
            );
        }
        if let Some(v) = c.mem {
            put("tessera_container_mem_utilization_ratio", "gauge", "Memory (bandwidth) utilisation by the container's processes, fraction of its device", l.clone(), v);
        }
        if let Some(v) = c.mps_threads {
            put("tessera_container_mps_active_thread_percent", "gauge", "The MPS active thread percentage the container's share runs under (lowered by the interference controller's throttle)", l.clone(), f64::from(v));
        }
        if let Some(v) = c.latency_ms {
            put(
                "tessera_container_reported_latency_ms",
                "gauge",
                "The latency the container reported itself (docs/GPU-HEALTH.md)",
                l.clone(),
                v,
            );
        }
    }
    for ((device, victim, aggressor, signal), n) in &m.incidents {
        let l = labels(&[
            ("device", device),
            ("victim", victim),
            ("aggressor", aggressor),
            ("signal", signal),
        ]);
        put(
            "tessera_interference_incidents_total",
            "counter",
            "Interference incidents opened: a latency-sensitive container degraded by a co-tenant",
            l,
            *n as f64,
        );
    }
    for i in &t.incidents {
        let l = labels(&[
            ("device", &i.device),
            ("victim", &i.victim),
            ("aggressor", &i.aggressor),
            ("signal", &i.signal),
        ]);
        put(
            "tessera_interference_victim_share_ratio",
            "gauge",
            "An open incident's victim throughput as a fraction of its solo baseline",
            l,
            i.share,
        );
    }
    put(
        "tessera_telemetry_samples_total",
        "counter",
        "Telemetry samples taken since tesserad started",
        String::new(),
        t.samples as f64,
    );
    let mut out = String::new();
    for (name, (kind, help, lines)) in families {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
        for line in lines {
            out.push_str(&line);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod telemetry_tests {
    use super::*;
    use tessera_api::telemetry::{ContainerUsage, DeviceTelemetry, NodeTelemetry, Source};

    #[test]
    fn devices_carry_dcgm_names_and_labels_and_containers_their_pods() {
        let mut d = DeviceTelemetry::empty("GPU-a", "GPU-a", Source::Sim);
        d.sm_active = Some(0.5);
        d.dram_active = Some(0.25);
        d.power_watts = Some(300.0);
        let c = ContainerUsage {
            container_id: "c1".into(),
            tenant: "acme/x".into(),
            workload: Some("ns/p/main".into()),
            device: "GPU-a".into(),
            isolation: tessera_api::Isolation::Gpu,
            class: Some(tessera_api::WorkloadClass::Latency),
            sm: Some(0.5),
            mem: Some(0.25),
            mps_threads: None,
            latency_ms: Some(12.0),
        };
        let m = TelemetryMetrics {
            hostname: "node\"1".into(),
            telemetry: Some(NodeTelemetry {
                node: "n".into(),
                at_ms: 1,
                samples: 7,
                devices: vec![d],
                containers: vec![c],
                incidents: Vec::new(),
            }),
            devices: [("GPU-a".to_string(), (0, "H100-80GB".to_string(), None))].into(),
            pods: [("c1".to_string(), ("ns".to_string(), "p".to_string(), "main".to_string()))]
                .into(),
            incidents: BTreeMap::new(),
        };
        let text = render_telemetry(&m);
        assert!(text.contains("# TYPE DCGM_FI_PROF_SM_ACTIVE gauge"), "{text}");
        assert!(
            text.contains(r#"DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a",device="nvidia0",modelName="H100-80GB",Hostname="node\"1",namespace="ns",pod="p",container="main"} 50"#),
            "{text}"
        );
        assert!(text.contains(r#"tessera_container_reported_latency_ms{container_id="c1",tenant="acme/x",namespace="ns",pod="p",container="main",UUID="GPU-a",isolation="gpu",class="latency"} 12"#), "{text}");
        assert!(text.contains("tessera_telemetry_samples_total 7"), "{text}");
    }
}
