//! Text rendering of node status for people: one block per GPU, with MIG instances drawn
//! on the 8-slot memory axis so the layout (and its holes) is visible at a glance.

use std::fmt::Write;

use tessera_api::{GpuStatus, MigInstanceStatus, NodeStatus};

/// Width of one memory slot in the slot map.
const SLOT: usize = 9;

/// Render the whole node.
pub fn status(s: &NodeStatus) -> String {
    let mut out = String::new();
    let short = |d: &str| d.chars().take(12).collect::<String>();
    let _ = writeln!(out, "node {}   backend {}", s.node, s.backend);
    let _ = writeln!(
        out,
        "policy v{} ({}, sha256 {})",
        s.policy.version,
        s.policy.source,
        short(&s.policy.digest)
    );
    if let Some(c) = &s.policy.coordinator {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let contact = c.last_contact_ms.map_or_else(
            || "never".to_string(),
            |t| format!("{}s ago", now.saturating_sub(t) / 1000),
        );
        let link = match (&c.current, c.connected) {
            (Some(u), true) => format!("connected to {u}"),
            (Some(u), false) => format!("not connected (last used {u})"),
            (None, _) => "not connected".to_string(),
        };
        let _ = writeln!(
            out,
            "  fleet: {} as node {}, {link}, last contact {contact}, trust key {}",
            c.health, c.node_id, c.trust_key_id
        );
        if let Some(why) = &c.source_reason {
            // Names files the operator chose: shown escaped, like every text from outside.
            let _ =
                writeln!(out, "  policy source: {}", tessera_api::untrusted(why).max_chars(1024));
        }
        if let Some(r) = &c.last_rejection {
            let _ = writeln!(
                out,
                "  refused policy version {} ({}) from {}: {}",
                r.version, r.kind, r.coordinator, r.reason
            );
        }
        if let Some(e) = &c.last_error {
            let _ = writeln!(out, "  last error: {e}");
        }
        if let Some(u) = &c.usage {
            let _ = writeln!(
                out,
                "  usage uploads: through chain seq {}, {} pending, {} accepted, {} duplicates{}",
                u.uploaded_through_seq,
                u.pending,
                u.accepted,
                u.duplicates,
                u.last_error.as_deref().map(|e| format!(", last error: {e}")).unwrap_or_default()
            );
        }
    }
    if let Some(k) = &s.node_key {
        let _ = writeln!(
            out,
            "node key {} (id {}): signs this node's usage uploads",
            k.public_key, k.key_id
        );
    }
    let held = s.allocations.len();
    let _ = writeln!(
        out,
        "{} GPUs, {held} allocation{}",
        s.gpus.len(),
        if held == 1 { "" } else { "s" }
    );
    for g in &s.gpus {
        out.push('\n');
        gpu(&mut out, g, s);
    }
    if !s.mps_shares.is_empty() {
        let _ = writeln!(out, "\nmps shares (one control daemon per tenant and device)");
        for m in &s.mps_shares {
            let pid = m.pid.map(|p| format!("pid {p}")).unwrap_or_else(|| "no daemon".into());
            let _ = writeln!(
                out,
                "  {:<44} {:<32} {:>3}% threads, {} MiB pinned  {:<10} {pid}  restarts {}  containers {}",
                m.device,
                m.tenant,
                m.percent,
                m.mem_limit_bytes >> 20,
                m.state,
                m.restarts,
                m.holders.join(",")
            );
        }
    }
    if !s.allocations.is_empty() {
        let _ = writeln!(out, "\nallocations");
        // Columns as wide as their widest cell: a long pod name or tenant moves the rest
        // of every row, not just its own.
        let rows: Vec<[String; 5]> = s
            .allocations
            .iter()
            .map(|a| {
                let devs = a.devices.iter().map(|d| d.uuid.as_str()).collect::<Vec<_>>().join(",");
                let pid = a.pid.map(|p| format!("pid {p}")).unwrap_or_else(|| "not started".into());
                [
                    who(a.workload.as_ref().map(|w| w.display_name()).as_deref(), &a.container_id),
                    a.tenant.to_string(),
                    a.request.to_string(),
                    format!("{:?}", a.state).to_lowercase(),
                    format!("{devs}  ({pid}){}", quota_mark(a.quota.as_deref())),
                ]
            })
            .collect();
        let w = widths(&rows);
        for r in &rows {
            let _ = writeln!(
                out,
                "  {:<w0$} {:<w1$} {:<w2$} {:<w3$} {}",
                r[0],
                r[1],
                r[2],
                r[3],
                r[4],
                w0 = w[0],
                w1 = w[1],
                w2 = w[2],
                w3 = w[3]
            );
        }
    }
    if !s.events.is_empty() {
        let _ = writeln!(out, "\nrecent events");
        let rows: Vec<[String; 4]> = s
            .events
            .iter()
            .take(8)
            .map(|e| {
                [
                    tessera_api::time::format_utc(e.ts_ms),
                    e.kind.to_string(),
                    match &e.container_id {
                        Some(id) => who(e.workload.as_deref(), id),
                        None => "-".to_string(),
                    },
                    cut_at_word(&e.detail, EVENT_DETAIL_CHARS),
                ]
            })
            .collect();
        let w = widths(&rows);
        for r in &rows {
            let _ = writeln!(
                out,
                "  {} {:<w1$} {:<w2$} {}",
                r[0],
                r[1],
                r[2],
                r[3],
                w1 = w[1],
                w2 = w[2]
            );
        }
    }
    out
}

/// The most characters of an event's detail `status` shows.
const EVENT_DETAIL_CHARS: usize = 160;

/// Each column's width: its widest cell, in characters.
fn widths<const N: usize>(rows: &[[String; N]]) -> [usize; N] {
    let mut w = [0; N];
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    w
}

/// `text` whole when it fits in `max` characters, else cut at the last space before
/// the limit (mid-word only for a word longer than the limit) with `…`.
fn cut_at_word(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_string();
    }
    let head: String = text.chars().take(max.saturating_sub(1)).collect();
    let cut = match head.rfind(' ') {
        Some(i) if i > 0 => head[..i].trim_end(),
        _ => head.as_str(),
    };
    format!("{cut}…")
}

/// `  borrowed beyond P (burst price, reclaimable)` for borrowed work, `  guaranteed under
/// lease` for work a node admitted alone; else nothing. Before it, the CPU and memory the
/// grant counts against its quotas, where it counts any (`  CPU 0.75 cores, 1024 MiB`).
fn quota_mark(mark: Option<&tessera_api::QuotaMark>) -> String {
    let limits = match mark {
        Some(m) if m.cpu_milli > 0 || m.memory_mib > 0 => {
            let cores = format!("{}.{:03}", m.cpu_milli / 1000, m.cpu_milli % 1000);
            let cores = cores.trim_end_matches('0').trim_end_matches('.');
            format!("  CPU {cores} cores, {} MiB", m.memory_mib)
        }
        _ => String::new(),
    };
    limits + &quota_class(mark)
}

fn quota_class(mark: Option<&tessera_api::QuotaMark>) -> String {
    match mark {
        Some(m) if m.class == tessera_api::QuotaClass::Borrowed => format!(
            "  borrowed{} (burst price, reclaimable)",
            m.over
                .as_deref()
                .map(|o| format!(" beyond {}", tessera_api::untrusted(o)))
                .unwrap_or_default()
        ),
        Some(m) if m.under_lease => "  guaranteed under lease".into(),
        _ => String::new(),
    }
}

/// A container as people know it: `namespace/pod/container (id…)` for a pod's container
/// (the id's first 12 characters: the name is a label, the id is what runc knows), else
/// the id.
fn who(workload: Option<&str>, container_id: &str) -> String {
    match workload {
        Some(w) => {
            let short: String = container_id.chars().take(12).collect();
            format!("{w} ({short})")
        }
        None => container_id.to_string(),
    }
}

/// `tenant (namespace/pod/container, id)` for a pod's container, `tenant (id)` otherwise.
fn holder(h: &tessera_api::Holder) -> String {
    match &h.workload {
        Some(w) => format!("{} ({w}, {})", h.tenant, h.container_id),
        None => format!("{} ({})", h.tenant, h.container_id),
    }
}

/// A usage report as a table: group, GPU-seconds, GPU-hours, cost.
pub fn usage(r: &metering::UsageReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "usage by {} from {} to {}",
        r.by.as_str(),
        tessera_api::time::format_utc(r.from_ms),
        tessera_api::time::format_utc(r.to_ms)
    );
    let label = |row: &metering::UsageRow| match &row.name {
        Some(name) => format!("{} ({name})", row.group),
        None => row.group.clone(),
    };
    let width = r.rows.iter().map(|x| label(x).len()).max().unwrap_or(5).max(5);
    let _ = writeln!(
        out,
        "{:<width$}  {:>14}  {:>10}  {:>10}  {:>9}  {:>13}  {:>12}  {:>10}  {:>10}  {:>9}",
        "group",
        "GPU-seconds",
        "GPU-hours",
        "cost",
        "intervals",
        "used/reserved",
        "floor GPU-h",
        "floor idle",
        "burst cost",
        "premium"
    );
    for row in r.rows.iter().chain(std::iter::once(&r.total)) {
        // Only where utilisation was sampled (whole GPUs with NVML; never MIG).
        let used = if row.sampled_gpu_seconds > 0.0 {
            format!("{:.0}%", 100.0 * row.used_gpu_seconds / row.sampled_gpu_seconds)
        } else {
            "-".to_string()
        };
        let idle = if row.floor_gpu_seconds > 0.0 {
            format!("{:.0}%", 100.0 * row.floor_idle_gpu_seconds / row.floor_gpu_seconds)
        } else {
            "-".to_string()
        };
        let _ = writeln!(
            out,
            "{:<width$}  {:>14.3}  {:>10.4}  {:>10.4}  {:>9}  {:>13}  {:>12.4}  {:>10}  {:>10.4}  {:>9.4}",
            label(row),
            row.gpu_seconds,
            row.gpu_seconds / 3600.0,
            row.cost,
            row.intervals,
            used,
            row.floor_gpu_seconds / 3600.0,
            idle,
            row.burst_cost,
            row.premium_cost
        );
    }
    let t = &r.total;
    if t.chargeback_cost > 0.0 || t.showback_cost > 0.0 {
        let _ = writeln!(
            out,
            "charged (chargeback) {:.4}, shown only (showback) {:.4}",
            t.chargeback_cost, t.showback_cost
        );
    }
    if r.floors_billed {
        let _ = writeln!(
            out,
            "floors: each quota path's own guarantee billed at the reserved rate{}, used or not",
            r.floors_until_ms
                .filter(|u| *u < r.to_ms)
                .map(|u| format!(" up to {}", tessera_api::time::format_utc(u)))
                .unwrap_or_default()
        );
    } else if t.in_floor_gpu_seconds > 0.0 {
        let _ = writeln!(
            out,
            "{:.3} GPU-seconds ran inside guarantees: their floors are billed once, in the fleet's report (tessera usage --coordinator)",
            t.in_floor_gpu_seconds
        );
    }
    if t.preempted_gpu_seconds > 0.0 {
        let _ = writeln!(
            out,
            "lost to preemption: {:.3} GPU-seconds, worth {:.4}, {}",
            t.preempted_gpu_seconds,
            t.preempted_cost,
            match r.preempted {
                metering::Preempted::Bill => "billed (billing.preempted: bill)".to_string(),
                metering::Preempted::Waive =>
                    format!("not billed: {:.4} waived (billing.preempted: waive)", t.waived_cost),
            }
        );
    }
    if r.open_intervals > 0 {
        let _ = writeln!(out, "{} interval(s) still open, counted up to now", r.open_intervals);
    }
    if !r.unpriced_models.is_empty() {
        let _ =
            writeln!(out, "no price in the policy for: {} (cost 0)", r.unpriced_models.join(", "));
    }
    if !r.under_driven.is_empty() {
        let _ = writeln!(out, "\nunder-driven (right-sizing suggestions)");
        for s in &r.under_driven {
            let who = s.name.as_deref().unwrap_or(&s.container_id);
            let _ = writeln!(out, "  {who} ({}, {}): {}", s.tenant, s.device_uuid, s.message);
        }
    }
    out
}

/// Who shares a device, and how (`mps 50%+25%`, `time-sliced 2/4 (notebooks)`).
fn sharing(s: &NodeStatus, uuid: &str) -> Option<String> {
    let shares: Vec<&tessera_api::ShareGrant> = s
        .allocations
        .iter()
        .filter_map(|a| a.share.as_ref())
        .filter(|sh| sh.device == uuid)
        .collect();
    let first = shares.first()?;
    Some(match first.kind {
        tessera_api::Isolation::Mps => {
            let pcts: Vec<String> =
                shares.iter().map(|sh| format!("{}%", sh.percent.unwrap_or(0))).collect();
            format!("shared: mps {} ({} containers)", pcts.join("+"), shares.len())
        }
        _ => format!(
            "shared: time-sliced {}/{} replicas (domain {})",
            shares.len(),
            first.replicas.unwrap_or(0),
            first.domain.as_deref().unwrap_or("?")
        ),
    })
}

/// `dirty after …`, `quarantined: …`, with the last scrub's numbers.
fn lifecycle(l: Option<&tessera_api::Lifecycle>) -> String {
    let Some(l) = l else { return String::new() };
    match &l.last_scrub {
        Some(r) => format!(
            "{} [last scrub: {}, {}/{} bytes, {} non-zero words, {:.3} s]",
            l.detail,
            if r.ok { "ok" } else { "FAILED" },
            r.bytes_covered,
            r.bytes_total,
            r.nonzero_words,
            r.seconds
        ),
        None => l.detail.clone(),
    }
}

fn gpu(out: &mut String, g: &GpuStatus, s: &NodeStatus) {
    let mode = if g.mig_enabled { "MIG" } else { "whole" };
    let _ = writeln!(
        out,
        "GPU {}  {}  {}  minor {}  {} MiB  {mode}",
        g.index, g.model, g.uuid, g.minor, g.memory_mib
    );
    if !g.mig_enabled {
        match (&g.holder, sharing(s, &g.uuid)) {
            _ if g.lifecycle.is_some() && g.holder.is_none() => {
                let _ = writeln!(out, "  {}", lifecycle(g.lifecycle.as_ref()));
            }
            (Some(h), _) => {
                let _ = writeln!(out, "  held by {}", holder(h));
            }
            (None, Some(how)) => {
                let _ = writeln!(out, "  {how}");
            }
            (None, None) => {
                let _ = writeln!(out, "  free");
            }
        }
        return;
    }
    let _ = writeln!(out, "  {}", slot_axis());
    let _ = writeln!(out, "  {}", slot_map(&g.instances));
    for i in &g.instances {
        let who = match (&i.holder, sharing(s, &i.uuid)) {
            _ if i.lifecycle.is_some() && i.holder.is_none() => lifecycle(i.lifecycle.as_ref()),
            (Some(h), _) => format!("held by {}", holder(h)),
            (None, Some(how)) => how,
            (None, None) => "free".into(),
        };
        let _ = writeln!(
            out,
            "  {:<11} slots {}-{}  gi {} ci {}  {}  {who}",
            i.profile,
            i.start,
            i.start + i.size - 1,
            i.gi_id,
            i.ci_id,
            i.uuid
        );
    }
}

fn slot_axis() -> String {
    (0..8).map(|s| format!("{:<SLOT$}", s)).collect::<String>().trim_end().to_string()
}

/// One line, 8 slots wide: `[profile*]` per instance (`*` = held), `.` for empty slots.
pub fn slot_map(instances: &[MigInstanceStatus]) -> String {
    let mut cells: Vec<Option<&MigInstanceStatus>> = vec![None; 8];
    for i in instances {
        for s in i.start..(i.start + i.size).min(8) {
            cells[s as usize] = Some(i);
        }
    }
    let mut line = String::new();
    let mut s = 0usize;
    while s < 8 {
        match cells[s] {
            Some(i) if i.start as usize == s => {
                let width = SLOT * i.size as usize;
                let mark = if i.holder.is_some() {
                    "*"
                } else if i.lifecycle.is_some() {
                    "!"
                } else {
                    ""
                };
                let label: String =
                    format!("{}{mark}", i.profile).chars().take(width.saturating_sub(2)).collect();
                let _ = write!(line, "[{label:^w$}]", w = width - 2);
                s += i.size as usize;
            }
            _ => {
                let _ = write!(line, "{:<SLOT$}", ".");
                s += 1;
            }
        }
    }
    line.trim_end().to_string()
}

/// `tessera top`: each device's activity, then who uses it, then open interference
/// incidents. Tenant, pod and container names come from outside: shown escaped.
pub fn top(t: &tessera_api::telemetry::NodeTelemetry) -> String {
    let mut out = String::new();
    let esc = |v: &str| tessera_api::untrusted(v).max_chars(64).to_string();
    let pct = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{:.0}%", v * 100.0));
    let _ = writeln!(out, "node {}   telemetry sample {} at {} ms", t.node, t.samples, t.at_ms);
    if t.samples == 0 {
        let _ = writeln!(out, "no telemetry sample yet");
        return out;
    }
    for d in &t.devices {
        let kind = if d.uuid == d.gpu_uuid { "GPU" } else { "  MIG" };
        let power = d.power_watts.map_or_else(|| "-".to_string(), |w| format!("{w:.0} W"));
        let clocks = match (d.sm_clock_mhz, d.mem_clock_mhz) {
            (Some(s), Some(m)) => format!("{s}/{m} MHz"),
            _ => "-".to_string(),
        };
        let throttle = if d.throttle_reasons.is_empty() {
            String::new()
        } else {
            format!("  throttled: {}", d.throttle_reasons.join(","))
        };
        let _ = writeln!(
            out,
            "{kind} {}  SM {:>4}  mem-bw {:>4}  {power:>6}  {clocks}  ({:?}){throttle}",
            d.uuid,
            pct(d.sm_active),
            pct(d.dram_active),
            d.source
        );
        for c in t.containers.iter().filter(|c| c.device == d.uuid) {
            let who = c.workload.as_deref().map_or_else(|| esc(&c.container_id), esc);
            let mut extra = String::new();
            if let Some(th) = c.mps_threads {
                let _ = write!(extra, "  mps threads {th}%");
            }
            if let Some(l) = c.latency_ms {
                let _ = write!(extra, "  latency {l:.1} ms");
            }
            let _ = writeln!(
                out,
                "      {:<28} {:<36} {:<6} {:<7} SM {:>4}  mem {:>4}{extra}",
                who,
                esc(&c.tenant),
                c.isolation.as_str(),
                c.class.map_or("-", |k| k.as_str()),
                pct(c.sm),
                pct(c.mem)
            );
        }
    }
    if !t.incidents.is_empty() {
        let _ = writeln!(out, "interference:");
        for i in &t.incidents {
            let _ = writeln!(
                out,
                "  {}: {} ({}) at {:.0}% of solo, degraded by {} ({}) through {}; steps: {}",
                i.device,
                esc(&i.victim),
                esc(&i.victim_tenant),
                i.share * 100.0,
                esc(&i.aggressor),
                esc(&i.aggressor_tenant),
                i.signal,
                if i.steps.is_empty() { "none yet".to_string() } else { i.steps.join(", ") }
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_api::{DeviceState, Holder};

    fn inst(profile: &str, start: u8, size: u8, held: bool) -> MigInstanceStatus {
        MigInstanceStatus {
            uuid: format!("MIG-{start}"),
            profile: profile.into(),
            gi_id: 1,
            ci_id: 0,
            start,
            size,
            memory_mib: 1,
            state: if held { DeviceState::Assigned } else { DeviceState::Free },
            holder: held.then(|| Holder {
                container_id: "c".parse().expect("valid"),
                tenant: "t".parse().expect("valid"),
                workload: None,
            }),
            lifecycle: None,
        }
    }

    #[test]
    fn slot_map_draws_instances_at_their_slots_and_marks_held_ones() {
        let map = slot_map(&[
            inst("3g.40gb", 0, 4, false),
            inst("2g.20gb", 4, 2, true),
            inst("1g.10gb", 7, 1, false),
        ]);
        assert_eq!(map.len(), 8 * SLOT);
        assert!(map.starts_with("[             3g.40gb              ]"), "{map}");
        assert!(map.contains("[    2g.20gb*    ]"), "{map}");
        // slot 6 is empty, slot 7 holds the 1g.
        assert!(map.contains("]. "), "{map}");
        assert!(map.ends_with("[1g.10gb]"), "{map}");
    }

    #[test]
    fn slot_map_of_an_empty_gpu_is_all_dots() {
        assert_eq!(slot_map(&[]).matches('.').count(), 8);
    }

    /// A fleet node's status, as `GET /v1/status` sends it.
    fn fleet_status(source_reason: Option<&str>) -> NodeStatus {
        let mut v = serde_json::json!({
            "node": "gpu01", "backend": "sim:x", "gpus": [], "allocations": [],
            "policy": {"version": 3, "source": "last-known-good:/s/fleet/last-known-good.json",
                       "digest": "ab", "coordinator": {
                "urls": ["http://c:7400"], "node_id": "gpu01", "trust_key_id": "4f1c",
                "health": "ok", "connected": true, "last_known_good": "/s/lkg.json",
                "last_error": null}}
        });
        if let Some(why) = source_reason {
            v["policy"]["coordinator"]["source_reason"] = why.into();
        }
        serde_json::from_value(v).expect("a status")
    }

    #[test]
    fn borrowed_grants_are_shown_as_such() {
        let mut s = fleet_status(None);
        let grant = |id: &str, quota: serde_json::Value| -> tessera_api::Allocation {
            let mut v = serde_json::json!({
                "container_id": id, "tenant": "acme/dev/notebooks/bob", "trust": "dev",
                "request": "gpu=1", "isolation": "gpu", "devices": [],
                "injection": {"devices": [], "env": [], "mounts": []},
                "state": "running", "pid": 7, "created_ms": 1
            });
            if !quota.is_null() {
                v["quota"] = quota;
            }
            serde_json::from_value(v).expect("an allocation")
        };
        s.allocations = vec![
            grant(
                "lent",
                serde_json::json!({"class": "borrowed",
                "over": "quotas.acme/dev.gpus.H100-80GB.guarantee"}),
            ),
            grant("leased", serde_json::json!({"class": "guaranteed", "under_lease": true})),
            grant(
                "limited",
                serde_json::json!({"class": "guaranteed", "cpu_milli": 750, "memory_mib": 1024}),
            ),
            grant("plain", serde_json::Value::Null),
        ];
        let text = status(&s);
        let line = |id: &str| text.lines().find(|l| l.contains(id)).expect(&text).to_string();
        assert!(
            line("lent").ends_with(
                "borrowed beyond quotas.acme/dev.gpus.H100-80GB.guarantee (burst price, reclaimable)"
            ),
            "{text}"
        );
        assert!(line("leased").ends_with("guaranteed under lease"), "{text}");
        assert!(line("limited").ends_with("(pid 7)  CPU 0.75 cores, 1024 MiB"), "{text}");
        assert!(line("plain").ends_with("(pid 7)"), "{text}");
    }

    #[test]
    fn status_rows_line_up_and_events_are_cut_between_words() {
        let mut s = fleet_status(None);
        let grant = |id: &str, tenant: &str, workload: serde_json::Value| {
            let mut v = serde_json::json!({
                "container_id": id, "tenant": tenant, "trust": "dev", "request": "mig=1g.10gb",
                "isolation": "mig", "devices": [], "injection": {"devices": [], "env": [], "mounts": []},
                "state": "running", "pid": 7, "created_ms": 1
            });
            if !workload.is_null() {
                v["workload"] = workload;
            }
            serde_json::from_value::<tessera_api::Allocation>(v).expect("an allocation")
        };
        s.allocations = vec![
            grant("a", "acme/x", serde_json::Value::Null),
            grant(
                "0123456789abcdef0123",
                "acme/a-rather-long-team-name/with-a-project/and-a-user",
                serde_json::json!({"namespace": "team-with-a-long-namespace", "pod": "trainer-7c9f8d-abcde", "container": "main", "sandbox_id": "s1"}),
            ),
        ];
        let long = "refused: tenant acme/untrusted/sandbox/guest (trust untrusted) may not use mps isolation (request mps=50): tiers.untrusted.allow permits gpu, mig only and nothing else here";
        s.events = vec![
            tessera_api::EventStatus {
                ts_ms: 1,
                kind: "refuse".into(),
                container_id: Some("x".into()),
                workload: None,
                detail: long.into(),
            },
            tessera_api::EventStatus {
                ts_ms: 2,
                kind: "grant".into(),
                container_id: None,
                workload: None,
                detail: "short".into(),
            },
        ];
        let text = status(&s);
        let rows: Vec<&str> = text.lines().filter(|l| l.contains("mig=1g.10gb")).collect();
        assert_eq!(rows.len(), 2, "{text}");
        let col = |l: &str, what: &str| l.find(what).expect(l);
        assert_eq!(col(rows[0], "mig=1g.10gb"), col(rows[1], "mig=1g.10gb"), "{text}");
        assert_eq!(col(rows[0], "acme/"), col(rows[1], "acme/"), "{text}");
        let ev: Vec<&str> =
            text.lines().filter(|l| l.contains("refuse") || l.contains("grant ")).collect();
        assert_eq!(col(ev[0], "refused:"), col(ev[1], "short"), "{text}");
        assert!(ev[0].ends_with("permits gpu, mig only and…"), "{}", ev[0]);
        assert_eq!(cut_at_word("abc def", 7), "abc def");
        assert_eq!(cut_at_word("abcdefghij", 5), "abcd…");
    }

    #[test]
    fn status_says_why_the_policy_in_force_is_in_force() {
        let why = "signed last-known-good version 3 is in force; the unsigned --policy file \
                   /etc/p\x1b[2J.json (version 9) is ignored on a node that follows a fleet";
        let text = status(&fleet_status(Some(why)));
        let line = text.lines().find(|l| l.contains("policy source:")).expect(&text);
        assert!(line.contains("signed last-known-good version 3 is in force"), "{line}");
        assert!(line.contains("(version 9) is ignored"), "{line}");
        // The file name is the operator's: a control character is shown escaped.
        assert!(!line.contains('\x1b'), "{line:?}");
        // Without a reason there is no such line.
        assert!(!status(&fleet_status(None)).contains("policy source:"));
    }
}
