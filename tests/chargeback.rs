//! Issue 25 end to end, with real processes on loopback: etcd, `tessera-coordinator` on it,
//! two tesserad on simulated 8×H100 nodes, runc containers created through
//! tessera-runtime, the `tessera` CLI.
//!
//! * Two prices: team A (`acme/trusted`, chargeback) holds a guarantee of 4 and runs
//!   nothing: the fleet's bill for the hour charges it the floor, 4 GPU-hours at the
//!   reserved 2.5 = 10.0, all of it idle. Team B (`acme/dev`, showback) has only a ceiling:
//!   its containers run borrowed and are billed their GPU-seconds at the burst rate 1.0;
//!   a 2-GPU grant the placement puts inside one NVLink domain (the simulated nodes have
//!   NVLink pairs) pays the topology premium 0.5 per GPU-hour on top, single GPUs do not.
//!   The billing window is the query's (`--from -1h --to now`): a floor is billed over the
//!   window asked for, up to the time the bill is made, so no test waits an hour.
//! * The idle made visible: a container holding a whole GPU at 4% simulated SM appears in
//!   the under-driven report (node, fleet and Prometheus) with the 1g.10gb profile; one at
//!   90% does not.
//! * A ledger that proves itself: the bill verifies from the signed intervals and the
//!   signed revision (online and offline from its export); a forged upload (another node's
//!   key) and a replayed one are refused; an interval edited in a node's ledger file and rows
//!   cut off the end of one are named by `tessera usage --verify`.

// Integration-test crates: clippy counts their helper functions as non-test code, so
// `allow-unwrap-in-tests` (clippy.toml) does not reach them; a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use serde_json::{json, Value};
use tessera_harness::fleet_fixture::{
    http, node_token, tessera, Coordinator, FleetFixture, ADMIN_TOKEN,
};
use tessera_harness::node::{repo, Node};
use tessera_harness::*;

const NA: &str = "bill-a";
const NB: &str = "bill-b";
/// Team B (dev, a ceiling only: it borrows): bob.
const B_NS: &str = "team-dev";

/// The example policy with the prices, quotas and billing of the acceptance.
fn policy() -> Vec<u8> {
    let mut p: Value =
        serde_json::from_slice(&std::fs::read(repo("examples/policy.json")).unwrap()).unwrap();
    p["prices"]["H100-80GB"] = json!({
        "reserved_per_gpu_hour": 2.5,
        "burst_per_gpu_hour": 1.0,
        "nvlink_premium_per_gpu_hour": 0.5
    });
    p["quotas"] = json!({
        "acme/trusted": {"gpus": {"H100-80GB": {"guarantee": 4}}},
        "acme/dev": {"gpus": {"H100-80GB": {"ceiling": 8}}},
    });
    p["billing"] = json!({"default_mode": "showback", "modes": {"acme/trusted": "chargeback"}});
    serde_json::to_vec_pretty(&p).unwrap()
}

/// Eight whole H100s, NVLink pairs (0,1) (2,3) (4,5) (6,7).
fn eight_h100() -> Value {
    let gpus: Vec<Value> =
        (0..8).map(|i| json!({"model": "H100-80GB", "nvlink": [i ^ 1]})).collect();
    json!({
        "node": "unnamed",
        "majors": {"nvidia_uvm": 508, "nvidia_caps": 509},
        "sim_memory_bytes": 65536,
        "gpus": gpus,
    })
}

struct Fleet {
    fx: FleetFixture,
    coordinator: Coordinator,
    a: Node,
    b: Node,
    /// Node A's Prometheus endpoint.
    metrics: String,
}

impl Fleet {
    fn start() -> Fleet {
        let fx = FleetFixture::launch(&[NA, NB]);
        let coordinator = fx.coordinator_on_free_port("coordinator", &[]);
        let file = fx.path("policy-v1.json");
        std::fs::write(&file, policy()).unwrap();
        fx.push_file(&coordinator.url, &file, 1);
        let util = ["--util-interval-ms", "100"];
        let metrics = format!("127.0.0.1:{}", tessera_harness::node::free_port());
        let with_metrics = ["--util-interval-ms", "100", "--metrics", &metrics];
        let a = fx.node_described(NA, eight_h100(), &coordinator.url, &file, &with_metrics);
        let b = fx.node_described(NB, eight_h100(), &coordinator.url, &file, &util);
        let f = Fleet { fx, coordinator, a, b, metrics: format!("http://{metrics}") };
        let ready = wait_for(
            || {
                f.admin_get("/v1/quota/status").is_some_and(|s| {
                    s["books_ready"] == true
                        && s["nodes"].get(NA).is_some()
                        && s["nodes"].get(NB).is_some()
                })
            },
            Duration::from_secs(30),
        );
        assert!(ready, "the quota books never saw both nodes");
        f
    }

    fn admin_get(&self, path: &str) -> Option<Value> {
        let (code, body) = http(&self.coordinator.url, "GET", path, Some(ADMIN_TOKEN), None)?;
        (code == 200).then(|| serde_json::from_str(&body).unwrap())
    }

    /// `tessera usage --coordinator URL ... --json` for the last hour, by `by`.
    fn fleet_usage(&self, by: &str) -> Value {
        let out = self.fx.admin(
            &self.coordinator.url,
            &["usage", "--from", "-1h", "--to", "now", "--by", by, "--json"],
        );
        out.assert_success("tessera usage --coordinator");
        serde_json::from_str(&out.stdout_str()).unwrap()
    }
}

fn row<'a>(report: &'a Value, group: &str) -> &'a Value {
    report["rows"]
        .as_array()
        .and_then(|r| r.iter().find(|x| x["group"] == group))
        .unwrap_or_else(|| panic!("no row {group} in {report:#}"))
}

fn f(v: &Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or_else(|| panic!("no number {k} in {v:#}"))
}

/// Create and start `id` (`gpus` whole GPUs for the tenant behind `ns`), running until killed.
fn run(node: &Node, id: &str, ns: &str, gpus: u32) -> i32 {
    let req = format!("gpu={gpus}");
    let b = node.bundle(id, ns, Some(&req), &["sh", "-c", "while true; do sleep 0.1; done"]);
    node.fx.run_detached(&b, id)
}

/// The node's usage report by container (its own ledger), as JSON.
fn node_usage(node: &Node) -> Value {
    let out = node.cli(&["usage", "--from", "-1h", "--to", "now", "--by", "container", "--json"]);
    out.assert_success("tessera usage");
    serde_json::from_str(&out.stdout_str()).unwrap()
}

fn under_driven<'a>(report: &'a Value, container: &str) -> Option<&'a Value> {
    report["under_driven"].as_array()?.iter().find(|s| s["container_id"] == container)
}

/// Every interval of `node` is closed (its containers' exits seen) and uploaded: the
/// coordinator holds its chain up to the last link (a fresh ledger: one link per interval).
fn wait_uploaded(node: &Node) {
    let done = wait_for(
        || {
            let r = node_usage(node);
            let closed = r["total"]["intervals"].as_u64().unwrap();
            if r["open_intervals"] != 0 || closed == 0 {
                return false;
            }
            let s = node.client().status().unwrap();
            let u = s.policy.coordinator.and_then(|c| c.usage);
            u.is_some_and(|u| u.uploaded_through_seq == closed && u.last_error.is_none())
        },
        Duration::from_secs(30),
    );
    assert!(
        done,
        "{}'s usage was never all uploaded: {:#?}",
        node.state.display(),
        node.client().status().unwrap().policy.coordinator
    );
}

#[test]
fn floors_bursts_idle_and_a_ledger_that_proves_itself() {
    let mut fleet = Fleet::start();
    let light_id = bill_and_prove(&fleet);
    files_edited_behind_tesserad_are_named(&mut fleet, &light_id);
}

/// Everything up to the ledger files' tampering; returns the id of the `light` interval.
fn bill_and_prove(fleet: &Fleet) -> String {
    let (a, b) = (&fleet.a, &fleet.b);

    // --- The idle made visible: two whole GPUs on node A, driven at 4% and at 90%. ---
    let light = run(a, "light", B_NS, 1);
    let busy = run(a, "busy", B_NS, 1);
    let feed = a.state.join("sim/util");
    std::fs::create_dir_all(&feed).unwrap();
    for (id, pid, sm) in [("light", light, 4), ("busy", busy, 90)] {
        let gpu = a.client().allocation(id).unwrap().devices[0].gpu_uuid.clone();
        std::fs::write(
            feed.join(format!("{gpu}.json")),
            format!(r#"[{{"pid": {pid}, "sm_percent": {sm}}}]"#),
        )
        .unwrap();
    }
    // Until the busy one has been seen at 90% (so it has a peak) and the light one is named.
    let seen = wait_for(
        || {
            let r = node_usage(a);
            let busy = row(&r, "busy");
            under_driven(&r, "light").is_some()
                && f(busy, "sampled_gpu_seconds") > 0.0
                && f(busy, "used_gpu_seconds") / f(busy, "sampled_gpu_seconds") > 0.3
        },
        Duration::from_secs(30),
    );
    let r = node_usage(a);
    assert!(seen, "never sampled both: {r:#}");
    let s = under_driven(&r, "light").unwrap();
    assert_eq!(s["fits"], "1g.10gb", "{s:#}");
    assert!(
        s["message"].as_str().unwrap().starts_with("held a whole H100-80GB at ")
            && s["message"].as_str().unwrap().ends_with("a 1g.10gb instance (1/7 of the GPU) fits"),
        "{s:#}"
    );
    assert!(under_driven(&r, "busy").is_none(), "a GPU driven at 90% is not under-driven: {r:#}");
    let table = a.cli(&["usage", "--from", "-1h", "--by", "container"]).stdout_str();
    assert!(table.contains("under-driven") && table.contains("1g.10gb instance"), "{table}");
    // Prometheus: held against driven, and the under-driven GPU with the profile that fits.
    // /metrics reads open intervals as of their last checkpoint (<= 5 s behind the report
    // above): wait until the checkpoint carries the samples.
    let scrape = || {
        let (code, text) = http(&fleet.metrics, "GET", "/metrics", None, None).unwrap();
        assert_eq!(code, 200, "{text}");
        text
    };
    let series = |text: &str, name: &str, container: &str| -> Option<String> {
        let c = format!("container=\"{container}\"");
        text.lines().find(|l| l.starts_with(name) && l.contains(&c)).map(str::to_string)
    };
    let value = |line: &str| line.rsplit(' ').next().unwrap().parse::<f64>().unwrap();
    let driven = |text: &str, c: &str| {
        series(text, "tessera_gpu_seconds_driven_total{", c).map_or(0.0, |l| value(&l))
    };
    let checkpointed = wait_for(
        || {
            let text = scrape();
            series(&text, "tessera_underdriven_gpu{", "light").is_some()
                && driven(&text, "busy") > 0.0
        },
        Duration::from_secs(30),
    );
    let text = scrape();
    assert!(checkpointed, "/metrics never showed the light GPU under-driven:\n{text}");
    let light_line = series(&text, "tessera_underdriven_gpu{", "light").unwrap();
    assert!(light_line.contains("fits=\"1g.10gb\"") && value(&light_line) == 1.0, "{light_line}");
    assert!(series(&text, "tessera_underdriven_gpu{", "busy").is_none(), "{text}");
    let sampled =
        |c: &str| series(&text, "tessera_gpu_seconds_sampled_total{", c).map_or(0.0, |l| value(&l));
    // Driven against held: busy (90%) drives most of what it holds, light (4%) little.
    assert!(driven(&text, "busy") > 0.3 * sampled("busy"), "{text}");
    assert!(sampled("light") > 0.0 && driven(&text, "light") < 0.1 * sampled("light"), "{text}");

    // B's work is borrowed (acme/dev has a ceiling, no guarantee): the burst rate. Run one
    // more on node B, and a 2-GPU grant the placement puts inside one NVLink domain (the
    // topology premium), then stop everything.
    run(b, "other", B_NS, 1);
    run(b, "pair", B_NS, 2);
    let pair = b.client().allocation("pair").unwrap();
    assert_eq!(pair.devices.len(), 2, "{pair:#?}");
    let domain = pair.nvlink_domain.unwrap_or_else(|| panic!("no NVLink domain: {pair:#?}"));
    let note = pair.topology.clone().unwrap_or_default();
    assert!(note.starts_with(&format!("NVLink domain {domain}")), "{pair:#?}");
    for (node, id) in [(a, "light"), (a, "busy"), (b, "other"), (b, "pair")] {
        assert_eq!(
            node.client().allocation(id).unwrap().quota.map(|q| q.class),
            Some(tessera_api::QuotaClass::Borrowed),
            "{id}"
        );
        node.fx.delete_container(id, true).assert_success("delete");
    }
    wait_uploaded(a);
    wait_uploaded(b);

    // --- Two prices, from the coordinator's copy. ---
    let bill = fleet.fleet_usage("team");
    let report = &bill["report"];
    let trusted = row(report, "acme/trusted");
    // Runs nothing, holds 4 for the hour: 4 x 3600 GPU-seconds at 2.5/h = 10.0, charged.
    assert_eq!(f(trusted, "floor_gpu_seconds"), 14_400.0, "{trusted:#}");
    assert_eq!(f(trusted, "floor_idle_gpu_seconds"), 14_400.0);
    assert_eq!(f(trusted, "floor_cost"), 10.0);
    assert_eq!((f(trusted, "cost"), f(trusted, "chargeback_cost")), (10.0, 10.0));
    assert_eq!(f(trusted, "gpu_seconds"), 0.0);
    let dev = row(report, "acme/dev");
    let burst = f(dev, "burst_gpu_seconds");
    assert!(burst > 0.0 && burst == f(dev, "gpu_seconds"), "all of B's work borrowed: {dev:#}");
    // Each interval's amount is rounded once to a millionth: by hand, within half a
    // millionth per interval.
    let within = 0.5e-6 * f(dev, "intervals") + 1e-9;
    // By hand: GPU-seconds / 3600 x 1.0.
    let by_hand = burst / 3600.0 * 1.0;
    assert!((f(dev, "burst_cost") - by_hand).abs() <= within, "{dev:#}");
    // The topology premium: the 2-GPU grant inside one NVLink domain, both devices, and
    // nothing else (the single GPUs carry none): GPU-seconds / 3600 x 0.5 on top.
    let by_container = fleet.fleet_usage("container");
    let rows = &by_container["report"];
    let pair_gs = f(row(rows, "pair"), "gpu_seconds");
    assert!(pair_gs > 0.0 && f(row(rows, "pair"), "intervals") == 2.0, "{rows:#}");
    assert_eq!(f(dev, "premium_gpu_seconds"), pair_gs, "{dev:#}");
    for single in ["light", "busy", "other"] {
        assert_eq!(f(row(rows, single), "premium_gpu_seconds"), 0.0, "{single}: {rows:#}");
    }
    let premium_by_hand = pair_gs / 3600.0 * 0.5;
    assert!((f(dev, "premium_cost") - premium_by_hand).abs() <= within, "{dev:#}");
    assert!(f(dev, "premium_cost") > 0.0, "{dev:#}");
    let pair = row(rows, "pair");
    assert!(
        (f(pair, "cost") - pair_gs / 3600.0 * (1.0 + 0.5)).abs() <= 2.5e-6,
        "the pair pays burst and premium: {pair:#}"
    );
    assert!(
        (f(dev, "cost") - (f(dev, "burst_cost") + f(dev, "premium_cost"))).abs() < 1e-9,
        "{dev:#}"
    );
    assert_eq!(f(dev, "showback_cost"), f(dev, "cost"), "acme/dev is shown, not charged");
    assert_eq!(f(dev, "chargeback_cost"), 0.0);
    assert_eq!(f(dev, "floor_cost"), 0.0, "no guarantee, no floor");
    assert!((f(&report["total"], "cost") - (10.0 + f(dev, "cost"))).abs() < 1e-9, "{report:#}");
    eprintln!(
        "bill: acme/trusted floor {} GPU-s, cost {} (charged); acme/dev burst {} GPU-s, cost {}, premium {} GPU-s, cost {} (shown); total {}",
        f(trusted, "floor_gpu_seconds"),
        f(trusted, "cost"),
        burst,
        f(dev, "burst_cost"),
        pair_gs,
        f(dev, "premium_cost"),
        f(&report["total"], "cost")
    );
    // The fleet view has the nodes' utilisation: the light GPU is named there too.
    let s = under_driven(&by_container["report"], "light")
        .unwrap_or_else(|| panic!("{by_container:#}"));
    assert_eq!(s["fits"], "1g.10gb");
    assert!(under_driven(&by_container["report"], "busy").is_none());

    // --- The bill proves itself: online, and offline from its export. ---
    let node_key =
        |n: &Node| format!("{}={}", n.client().status().unwrap().node, FleetFixture::node_key(n));
    let pins = [
        "--trust-key",
        &fleet.fx.public_key,
        "--node-key",
        &node_key(a),
        "--node-key",
        &node_key(b),
    ];
    let url = fleet.coordinator.url.clone();
    let verify = |extra: &[&str]| {
        let args: Vec<&str> = ["usage", "--from", "-1h", "--to", "now", "--by", "team", "--verify"]
            .iter()
            .copied()
            .chain(extra.iter().copied())
            .chain(pins.iter().copied())
            .collect();
        fleet.fx.admin(&url, &args)
    };
    let out = verify(&[]);
    out.assert_success("tessera usage --coordinator --verify");
    assert!(out.stdout_str().contains("the bill verifies"), "{}", out.stdout_str());
    let export = fleet.fx.path("bill.json");
    let out = fleet.fx.admin(
        &url,
        &[
            "usage",
            "--from",
            "-1h",
            "--to",
            "now",
            "--by",
            "team",
            "--export",
            &export.display().to_string(),
        ],
    );
    out.assert_success("tessera usage --export");
    let csv_file = fleet.fx.path("bill.csv");
    fleet
        .fx
        .admin(
            &url,
            &[
                "usage",
                "--from",
                "-1h",
                "--by",
                "team",
                "--export",
                &csv_file.display().to_string(),
            ],
        )
        .assert_success("tessera usage --export csv");
    let csv = std::fs::read_to_string(&csv_file).unwrap();
    assert!(
        csv.contains("# policy version=1 sha256=") && csv.contains(&format!("# chain node={NA} ")),
        "{csv}"
    );
    // Offline: no coordinator, only the file and the keys the team pinned.
    let offline = tessera(
        &[&["usage", "--verify", "--file", &export.display().to_string()][..], &pins[..]].concat(),
    );
    offline.assert_success("tessera usage --verify --file");
    assert!(offline.stdout_str().contains("the bill verifies"), "{}", offline.stdout_str());
    // The same file with one interval made cheaper: named.
    let mut doc: Value = serde_json::from_slice(&std::fs::read(&export).unwrap()).unwrap();
    let first = &mut doc["nodes"][0]["segments"][0]["intervals"][0];
    let id = first["id"].as_str().unwrap().to_string();
    first["gpu_seconds"] = json!(0.001);
    let edited = fleet.fx.path("bill-edited.json");
    std::fs::write(&edited, doc.to_string()).unwrap();
    let out = tessera(
        &[&["usage", "--verify", "--file", &edited.display().to_string()][..], &pins[..]].concat(),
    );
    assert!(!out.status.success(), "an edited export verified: {}", out.stdout_str());
    assert!(
        out.stderr_str().contains(&id) && out.stderr_str().contains("changed after it closed"),
        "{}",
        out.stderr_str()
    );

    // --- Forged and replayed uploads are refused and count nothing. ---
    let before = f(&fleet.fleet_usage("team")["report"]["total"], "gpu_seconds");
    let exported: fleet::proof::BillExport =
        serde_json::from_slice(&std::fs::read(&export).unwrap()).unwrap();
    let a_proof = exported.nodes.iter().find(|n| n.node == NA).unwrap();
    let seg = &a_proof.segments[0];
    // Replayed: A's own, genuinely signed first upload, sent again.
    let replay = serde_json::to_vec(&fleet::UsageUpload {
        intervals: seg.intervals.clone(),
        segment: Some(seg.signed.clone()),
    })
    .unwrap();
    let path = format!("/v1/nodes/{NA}/usage");
    let (code, body) = http(&url, "POST", &path, Some(&node_token(NA)), Some(&replay)).unwrap();
    assert_eq!(code, 409, "{body}");
    assert!(body.contains("replayed"), "{body}");
    // Forged: node B's key (its operator holds it, and A's token leaked) signing, as node A,
    // a made-up run (a copy of A's last one under a new id) that extends A's chain exactly
    // where the coordinator holds it: the links recompute and the segment is next, so only
    // the signature stops it.
    let b_key = fleet::signing::load_signing_key(&b.state.join("fleet/node.key")).unwrap();
    let forger = fleet::signing::Signer::new(b_key);
    let head = a_proof.heads.iter().find(|h| h.ledger_id == seg.signed.ledger_id).unwrap();
    let last = a_proof.segments.iter().flat_map(|s| &s.intervals).last().unwrap();
    let seq = head.seq + 1;
    let mut made_up = last.clone();
    made_up.id = metering::IntervalId(format!("{NA}-{}-{}", seg.signed.ledger_id, 1000 + seq));
    made_up.start.container_id = "made-up".into();
    let hash = made_up.expected_hash(&head.hash, seq);
    made_up.chain = Some(metering::ChainLink { seq, prev: head.hash.clone(), hash });
    let fake = vec![made_up];
    let forged = fleet::proof::sign_segment(&forger, NA, &seg.signed.ledger_id, &fake).unwrap();
    // Once naming B's key (wrong-key), once claiming A's key id (forged: the signature is
    // what is checked, not the name of the key).
    let mut claims_a = forged.clone();
    claims_a.key_id = seg.signed.key_id.clone();
    for (segment, kind) in [(forged, "wrong-key"), (claims_a, "forged")] {
        let body_bytes = serde_json::to_vec(&fleet::UsageUpload {
            intervals: fake.clone(),
            segment: Some(segment),
        })
        .unwrap();
        let (code, body) =
            http(&url, "POST", &path, Some(&node_token(NA)), Some(&body_bytes)).unwrap();
        assert_eq!(code, 403, "{kind}: {body}");
        assert!(body.contains(kind), "{kind}: {body}");
    }
    let after = f(&fleet.fleet_usage("team")["report"]["total"], "gpu_seconds");
    assert_eq!(after, before, "nothing refused was counted");
    let refusals = fleet.admin_get("/v1/audit/refusals").unwrap();
    let kinds: Vec<&str> = refusals
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["action"] == "upload usage")
        .filter_map(|r| r["why"].as_str()?.split(':').next())
        .collect();
    assert!(
        ["replayed-or-out-of-order", "wrong-key", "forged"].iter().all(|k| kinds.contains(k)),
        "{refusals:#}"
    );

    // Before any tampering, both nodes' ledgers verify (and match the coordinator's copy).
    for n in [a, b] {
        let ok = n.cli(&["usage", "--verify"]);
        ok.assert_success("tessera usage --verify on a node");
        assert!(ok.stdout_str().contains("every link verifies"), "{}", ok.stdout_str());
        assert!(
            ok.stdout_str().contains("the coordinator holds this ledger up to chain seq"),
            "{}",
            ok.stdout_str()
        );
    }
    a_proof
        .segments
        .iter()
        .flat_map(|s| &s.intervals)
        .find(|i| i.start.container_id == "light")
        .map(|i| i.id.to_string())
        .unwrap()
}

/// A node's ledger file edited behind tesserad's back.
fn files_edited_behind_tesserad_are_named(fleet: &mut Fleet, light_id: &str) {
    // Node A: the `light` interval's GPU-seconds halved in the file (the triggers dropped
    // first, as anyone with the file and sqlite3 can).
    tamper(
        &mut fleet.a,
        "DROP TRIGGER intervals_closed_rows_are_final;
         UPDATE intervals SET gpu_seconds = gpu_seconds / 2, duration_ms = duration_ms / 2
             WHERE container_id = 'light';",
    );
    let out = fleet.a.cli(&["usage", "--verify"]);
    assert!(!out.status.success(), "an edited ledger verified:\n{}", out.stdout_str());
    assert!(
        out.stdout_str().contains(&format!("interval {light_id}"))
            && out.stdout_str().contains("changed after it closed"),
        "{}",
        out.stdout_str()
    );
    // Node B: its last row and link deleted. The file's chain is whole, only shorter: the
    // coordinator's copy (signed by B) names what was cut.
    tamper(
        &mut fleet.b,
        "DROP TRIGGER intervals_append_only; DROP TRIGGER chain_append_only;
         DELETE FROM intervals WHERE seq = (SELECT interval_seq FROM chain ORDER BY chain_seq DESC LIMIT 1);
         DELETE FROM chain WHERE chain_seq = (SELECT MAX(chain_seq) FROM chain);",
    );
    let out = fleet.b.cli(&["usage", "--verify"]);
    assert!(!out.status.success(), "a cut ledger verified:\n{}", out.stdout_str());
    assert!(out.stdout_str().contains("rows were cut off"), "{}", out.stdout_str());
}

/// Stop `node`'s tesserad, run `edit` (SQL) on its ledger file, start it again.
fn tamper(node: &mut Node, edit: &str) {
    node.daemon.terminate(Duration::from_secs(10));
    let conn = rusqlite::Connection::open(node.state.join("ledger.db")).unwrap();
    conn.execute_batch(edit).unwrap();
    drop(conn);
    node.restart();
}
