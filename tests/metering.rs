//! Issue 6 end to end: per-container GPU-seconds from real runc containers, usage reports,
//! Prometheus metrics, and exactly-once accounting through `kill -9`.

// Integration-test crates: clippy counts their helper functions as non-test code, so
// `allow-unwrap-in-tests` (clippy.toml) does not reach them; a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use tessera_api::{AllocateRequest, RequestSource, StartRequest};
use tessera_harness::node::*;
use tessera_harness::*;

fn usage_json(node: &Node, by: &str) -> serde_json::Value {
    let out = node.cli(&["usage", "--from", "-1h", "--to", "now", "--by", by, "--json"]);
    out.assert_success("tessera usage --json");
    serde_json::from_str(&out.stdout_str()).expect("usage json")
}

/// Sum of `tessera_gpu_seconds_total` samples per tenant label.
fn metric_totals(text: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in text.lines().filter(|l| l.starts_with("tessera_gpu_seconds_total{")) {
        let tenant =
            line.split("tenant=\"").nth(1).and_then(|r| r.split('"').next()).expect("tenant label");
        let v: f64 = line.rsplit(' ').next().and_then(|v| v.parse().ok()).expect("value");
        *out.entry(tenant.to_string()).or_default() += v;
    }
    out
}

#[test]
fn three_tenants_known_durations_usage_and_metrics_agree() {
    let port = free_port();
    let node = Node::start_with(NodeOptions {
        extra_args: vec![
            "--metrics".into(),
            format!("127.0.0.1:{port}"),
            "--checkpoint-interval-ms".into(),
            "500".into(),
        ],
        ..Default::default()
    });
    let secs = 5.0;
    // (id, namespace, request, tenant, expected fraction of a GPU)
    let runs = [
        ("u", "team-untrusted", "mig=1g.10gb", "acme/untrusted/sandbox/guest", 1.0 / 7.0),
        ("t", "team-trusted", "gpu=2", "acme/trusted/training/alice", 2.0),
        ("d", "team-dev", "mig=3g.40gb", "acme/dev/notebooks/bob", 3.0 / 7.0),
    ];
    let bundles: Vec<Bundle> = runs
        .iter()
        .map(|(id, ns, req, _, _)| node.bundle(id, ns, Some(req), &["sleep", &secs.to_string()]))
        .collect();
    let started = Instant::now();
    let fx = &node.fx;
    std::thread::scope(|s| {
        let handles: Vec<_> = runs
            .iter()
            .zip(&bundles)
            .map(|((id, ..), b)| s.spawn(move || fx.run_container(b, id)))
            .collect();
        for h in handles {
            h.join().expect("join").assert_success("metered container");
        }
    });
    let wall = started.elapsed().as_secs_f64();

    let report = usage_json(&node, "user");
    let rows: BTreeMap<String, f64> = report["rows"]
        .as_array()
        .expect("rows")
        .iter()
        .map(|r| {
            (
                r["group"].as_str().expect("group").to_string(),
                r["gpu_seconds"].as_f64().expect("secs"),
            )
        })
        .collect();
    for (_, _, req, tenant, fraction) in &runs {
        // Each container ran its 5 s sleep between its start and its exit, and all of it
        // inside the runs' wall time: the interval lies between the two (1% for clocks),
        // whatever the machine's load adds around the sleep.
        let (want, most) = (secs * fraction, wall * fraction);
        let got = rows.get(*tenant).copied().unwrap_or(0.0);
        assert!(
            got >= want * 0.99 && got <= most * 1.01,
            "{tenant} {req}: {got} GPU-s, want {want}..{most} (runs took {wall:.2} s)"
        );
    }
    let sum: f64 = rows.values().sum();
    let total = report["total"]["gpu_seconds"].as_f64().expect("total");
    assert!((sum - total).abs() < 1e-6, "per-tenant sum {sum} != node total {total}");
    // Costs: the example policy prices H100-80GB.
    assert!(report["total"]["cost"].as_f64().expect("cost") > 0.0, "{report}");
    assert_eq!(report["open_intervals"], 0);

    // The same query twice gives the same bytes.
    let a = node
        .cli(&["usage", "--from", "0", "--to", "4102444800", "--by", "team", "--json"])
        .stdout_str();
    let b = node
        .cli(&["usage", "--from", "0", "--to", "4102444800", "--by", "team", "--json"])
        .stdout_str();
    assert_eq!(a, b);

    // /metrics shows the same totals.
    let text = http_get(port, "/metrics");
    let metrics = metric_totals(&text);
    for (tenant, v) in &rows {
        let m = metrics.get(tenant).copied().unwrap_or(0.0);
        assert!((m - v).abs() < 1e-3, "{tenant}: metrics {m} vs usage {v}\n{text}");
    }
    assert!(text.contains("tessera_devices{"), "{text}");
    assert!(text.contains("tessera_allocations"), "{text}");

    // A person's view: the table and CSV forms exist and carry the total.
    let table = node.cli(&["usage", "--from", "-1h", "--by", "team"]).stdout_str();
    assert!(table.contains("acme/trusted") && table.contains("TOTAL"), "{table}");
    let csv = node.cli(&["usage", "--from", "-1h", "--by", "org", "--csv"]).stdout_str();
    assert!(
        csv.starts_with(&format!("{}\n", metering::CSV_HEADER))
            && csv.starts_with("group,gpu_seconds,cost,intervals,")
            && csv.contains("\nTOTAL,"),
        "{csv}"
    );
}

fn alloc_req_in(id: &str, request: &str, bundle: &str) -> AllocateRequest {
    AllocateRequest {
        container_id: id.parse().expect("a valid container id"),
        runc_root: "/nonexistent".into(),
        bundle: bundle.into(),
        request: request.parse().expect("a well-formed request"),
        request_source: RequestSource::Annotation,
        annotations: [(NS.to_string(), "team-dev".to_string())].into_iter().collect(),
        limits: None,
    }
}

/// Retry an idempotent call until the daemon answers (it may be down between a kill and
/// its restart).
fn retry<T>(what: &str, mut f: impl FnMut() -> Result<T, tessera_api::ClientError>) -> T {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match f() {
            Ok(v) => return v,
            // Down (between a kill and its restart), or out of capacity while released
            // devices are still being scrubbed: both pass.
            Err(e)
                if (e.api_error().is_none()
                    || e.api_error()
                        .is_some_and(|a| a.code == tessera_api::ErrorCode::NoCapacity))
                    && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

#[test]
fn kill9_during_1000_interval_events_counts_every_interval_exactly_once() {
    let port = free_port();
    let mut node = Node::start_with(NodeOptions {
        pending_grace_ms: 600_000,
        extra_args: vec![
            "--metrics".into(),
            format!("127.0.0.1:{port}"),
            "--checkpoint-interval-ms".into(),
            "100".into(),
        ],
        ..Default::default()
    });
    let requests = ["gpu=1", "mig=1g.10gb", "mig=2g.20gb", "gpu=2"];
    let mut rng = rand::rngs::StdRng::seed_from_u64(6);
    let mut kills = 0;
    let mut next_kill = Instant::now() + Duration::from_millis(rng.gen_range(50..400));
    // 500 containers x (start + release) = 1,000 interval events.
    for i in 0..500 {
        let id = format!("m{i}");
        let r = requests[i % requests.len()];
        let c = node.client();
        let init = node.fx.fake_container(&id);
        retry("allocate", || c.allocate(&alloc_req_in(&id, r, &init.bundle_str())));
        if Instant::now() >= next_kill {
            node.crash_and_restart();
            kills += 1;
            next_kill = Instant::now() + Duration::from_millis(rng.gen_range(50..400));
        }
        let c = node.client();
        retry("start", || {
            c.start(&id, &StartRequest { pid: init.pid, bundle: init.bundle_str(), created: false })
        });
        if Instant::now() >= next_kill {
            node.crash_and_restart();
            kills += 1;
            next_kill = Instant::now() + Duration::from_millis(rng.gen_range(50..400));
        }
        let c = node.client();
        drop(init); // the container is gone: its release is granted
        retry("release", || c.release(&id));
    }
    assert!(kills >= 5, "only {kills} kills: the test did not exercise crashes");

    // Totals reconcile: usage == metrics == sum of intervals, nothing left open.
    let report = usage_json(&node, "container");
    let total = report["total"]["gpu_seconds"].as_f64().expect("total");
    assert_eq!(report["open_intervals"], 0, "every started interval was closed");
    let metrics: f64 = metric_totals(&http_get(port, "/metrics")).values().sum();
    assert!((metrics - total).abs() < 1e-3, "metrics {metrics} vs usage {total}");

    // Look inside the ledger itself once the daemon has stopped.
    node.daemon.terminate(Duration::from_secs(10));
    let ledger = metering::Ledger::open(
        &node.state.join("ledger.db"),
        std::sync::Arc::new(metering::SystemClock),
    )
    .expect("ledger opens cleanly");
    assert_eq!(ledger.recovered(), 0, "a clean stop leaves nothing open");
    let rows = ledger.intervals().expect("intervals");
    let mut per_device: BTreeMap<(String, String), Vec<(u64, u64)>> = BTreeMap::new();
    let mut sum = 0.0;
    for r in &rows {
        let end = r
            .end
            .as_ref()
            .expect("closed exactly once (an end is written once, by trigger-guarded update)");
        sum += end.gpu_seconds;
        per_device
            .entry((r.start.container_id.clone(), r.start.device_uuid.clone()))
            .or_default()
            .push((r.start_wall_ms, r.start_wall_ms + end.duration_ms));
    }
    // Every container was metered, and no two intervals of one device of one container
    // overlap: nothing is counted twice.
    let containers: std::collections::BTreeSet<&str> =
        rows.iter().map(|r| r.start.container_id.as_str()).collect();
    assert_eq!(containers.len(), 500, "every started container has intervals");
    for ((c, d), mut spans) in per_device {
        spans.sort();
        for w in spans.windows(2) {
            assert!(w[0].1 <= w[1].0 + 1, "{c}/{d}: intervals overlap: {w:?}");
        }
    }
    assert!((sum - total).abs() < 1e-3, "ledger sum {sum} vs report {total}");
    eprintln!("1,000 interval events, {kills} kill -9 restarts, {} intervals, {total:.3} GPU-s, reconciled", rows.len());
}

#[test]
fn malformed_usage_queries_get_clear_errors() {
    let node = Node::start();
    for (args, needle) in [
        (&["usage", "--from", "yesterday"][..], "not a time"),
        (&["usage", "--by", "planet"][..], "planet"),
        (&["usage", "--from", "now", "--to", "-1h"][..], "from"),
    ] {
        let out = node.cli(args);
        out.assert_failure("bad usage query");
        assert!(out.stderr_str().contains(needle), "{args:?}: {}", out.stderr_str());
    }
    let c = node.client();
    for (path, needle) in [
        ("/v1/usage?from_ms=10&to_ms=5", "from"),
        ("/v1/usage?from_ms=1&to_ms=5&by=galaxy", "galaxy"),
        ("/v1/usage?from_ms=1&to_ms=5&color=red", "unknown usage parameter"),
        ("/v1/usage?to_ms=5", "from_ms"),
        ("/v1/usage?from_ms=-1&to_ms=5", "Unix milliseconds"),
    ] {
        let r = c.raw("GET", path, None).expect("answer");
        assert_eq!(r.status, 400, "{path}");
        let body = String::from_utf8_lossy(&r.body);
        assert!(body.contains(needle), "{path}: {body}");
    }
}

#[test]
fn a_corrupted_ledger_is_detected_at_start_and_left_untouched() {
    let mut node = Node::start();
    // Put some intervals in, then stop cleanly.
    let b = node.bundle("c", "team-trusted", Some("gpu=1"), &["true"]);
    node.fx.run_container(&b, "c").assert_success("run");
    node.daemon.terminate(Duration::from_secs(10));
    let path = node.state.join("ledger.db");
    let mut bytes = std::fs::read(&path).expect("read ledger");
    assert!(bytes.len() >= 4096, "ledger is {} bytes", bytes.len());
    let n = bytes.len();
    for b in &mut bytes[n / 2..] {
        *b = 0x5A;
    }
    bytes[..16].copy_from_slice(b"garbage!garbage!");
    std::fs::write(&path, &bytes).expect("scribble");
    node.daemon.restart();
    let exit = node.daemon.wait_exit(Duration::from_secs(20));
    assert!(exit.is_some_and(|s| !s.success()), "tesserad must refuse a corrupt ledger");
    let err = node.daemon.stderr();
    assert!(err.contains("ledger") && err.contains(&path.display().to_string()), "{err}");
    assert_eq!(std::fs::read(&path).expect("read"), bytes, "the corrupt ledger was modified");
}

#[test]
fn utilisation_is_recorded_where_available_and_never_invented_for_mig() {
    let node = Node::start_with(NodeOptions {
        extra_args: vec!["--util-interval-ms".into(), "100".into()],
        ..Default::default()
    });
    let b = node.bundle("whole", "team-trusted", Some("gpu=1"), &["sleep", "300"]);
    node.fx.run_detached(&b, "whole");
    let b = node.bundle("mig", "team-untrusted", Some("mig=1g.10gb"), &["sleep", "300"]);
    node.fx.run_detached(&b, "mig");
    let a = node.client().allocation("whole").expect("grant");
    let gpu = a.devices[0].gpu_uuid.clone();
    // The simulated GPU's per-process feed: the container's init uses 40% of the SM, a
    // stranger's process 30% (it must not be charged to the container).
    let pid = node.fx.container_pid("whole").expect("pid");
    let feed = node.state.join("sim/util");
    std::fs::create_dir_all(&feed).expect("feed dir");
    std::fs::write(
        feed.join(format!("{gpu}.json")),
        format!(r#"[{{"pid": {pid}, "sm_percent": 40}}, {{"pid": 1, "sm_percent": 30}}]"#),
    )
    .expect("feed");
    std::thread::sleep(Duration::from_millis(1500));
    node.fx.delete_container("whole", true).assert_success("delete");
    node.fx.delete_container("mig", true).assert_success("delete");

    let report = usage_json(&node, "container");
    let row = |c: &str| {
        report["rows"]
            .as_array()
            .and_then(|r| r.iter().find(|x| x["group"] == c))
            .cloned()
            .expect("row")
    };
    let whole = row("whole");
    let (sampled, used) = (
        whole["sampled_gpu_seconds"].as_f64().expect("s"),
        whole["used_gpu_seconds"].as_f64().expect("u"),
    );
    assert!(sampled > 0.0, "{whole}");
    // Samples before the feed existed count as idle (0%), so the mean is at most 40%.
    let ratio = used / sampled;
    assert!(
        ratio > 0.05 && ratio <= 0.4 + 1e-9,
        "used/reserved {ratio} for 40% SM on a whole GPU: {whole}"
    );
    let mig = row("mig");
    assert_eq!(
        mig["sampled_gpu_seconds"].as_f64(),
        Some(0.0),
        "MIG has no per-process utilisation: {mig}"
    );
    let table = node.cli(&["usage", "--from", "-1h", "--by", "container"]).stdout_str();
    assert!(table.contains("used/reserved"), "{table}");
}

#[test]
fn metering_stops_when_the_container_exits_not_when_it_is_deleted() {
    // The reconciler is slowed to 10 minutes: only the exit watch can close the interval.
    let node =
        Node::start_with(NodeOptions { reconcile_interval_ms: 600_000, ..Default::default() });
    let b = node.bundle("short", "team-trusted", Some("gpu=1"), &["sleep", "1"]);
    node.fx.run_detached(&b, "short");
    let c = node.client();
    let pid = node.fx.container_pid("short").expect("pid");
    assert!(wait_for(
        || !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        Duration::from_secs(10)
    ));
    // Stopped but not deleted: the grant is held for a while longer.
    std::thread::sleep(Duration::from_secs(3));
    assert!(c.allocation("short").is_ok(), "the grant went before the delete");
    let report = usage_json(&node, "container");
    assert_eq!(report["open_intervals"], 0, "the interval is still open after the exit: {report}");
    let secs = report["total"]["gpu_seconds"].as_f64().expect("total");
    assert!(
        (0.9..1.5).contains(&secs),
        "billed {secs} GPU-s for a 1 s container kept 3 s longer before its delete"
    );
    node.fx.delete_container("short", false).assert_success("delete");
    assert!(c.allocation("short").is_err());
    let after = usage_json(&node, "container")["total"]["gpu_seconds"].as_f64().expect("total");
    assert_eq!(after, secs, "the delete billed more time");
}
