//! Issue 27 end to end, with real processes on loopback: etcd, `tessera-coordinator` on it,
//! two tesserad on simulated 8×H100 nodes, and runc containers created through
//! tessera-runtime.
//!
//! * The hierarchy: acme guarantees 12 (ceiling 12), its teams trusted and dev 4 each, and
//!   the guest's team has no quota: the guest's 12 are 4 guaranteed (acme's remainder) and
//!   8 borrowed; dev's 2 and alice's 1, within their teams' guarantees, are guaranteed,
//!   reclaiming the guest's work under acme's full ceiling.
//! * A 4-pod job within its guarantee runs whole within the victims' grace period plus
//!   5 s: its pods reclaim together, not one after another.
//! * Churn: a borrower that asks again at once while an owner runs short jobs is preempted
//!   at most once per minimum run time.
//! * A container that checkpoints (`tessera.io/preemption: checkpoint`) is the one a
//!   reclaim takes (it loses only its grace period), gets SIGTERM, writes its checkpoint,
//!   and is requeued with the hint: asking again within its requeue backoff is refused
//!   saying when, and afterwards it runs again.
//! * The fair queue within a tenant: GPUs freed on a node go to the tenant's larger
//!   waiting request before its older smaller one (`quota::fair_order`).
//! * A request not owed now (its tenant's own requests waiting ahead fill its guarantee)
//!   preempts nothing however long it waits; one owed at its first ask reclaims at once.
//! * A request owed only later reclaims once owed for its path's `owed_reclaim_after_s`,
//!   told when until then, and the status shows its wait.
//! * Consolidation: a borrowed 2-GPU request its node cannot place, once it has waited as
//!   long as the moves lose, moves two of another tenant's borrowed checkpointing
//!   containers off that node (SIGTERM, checkpoint written); they resume at once on the
//!   other node, which had the room, and the request runs.

// Integration-test crates: clippy counts their helper functions as non-test code, so
// `allow-unwrap-in-tests` (clippy.toml) does not reach them; a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tessera_harness::fleet_fixture::{http, Coordinator, FleetFixture, ADMIN_TOKEN};
use tessera_harness::node::{repo, Node};
use tessera_harness::*;

const QA: &str = "quota-a";
const QB: &str = "quota-b";
/// acme/trusted/training/alice.
const ALICE: &str = "team-trusted";
/// acme/dev/notebooks/bob.
const BOB: &str = "team-dev";
/// acme/untrusted/sandbox/guest (no quota of its own team).
const GUEST: &str = "team-untrusted";

/// The example policy with `quotas`.
fn policy(quotas: Value) -> Vec<u8> {
    let mut p: Value =
        serde_json::from_slice(&std::fs::read(repo("examples/policy.json")).unwrap()).unwrap();
    p["version"] = 1.into();
    p["quotas"] = quotas;
    serde_json::to_vec_pretty(&p).unwrap()
}

/// Eight whole H100s.
fn eight_h100() -> Value {
    let gpus: Vec<Value> = (0..8).map(|_| json!({"model": "H100-80GB"})).collect();
    json!({
        "node": "unnamed",
        "majors": {"nvidia_uvm": 508, "nvidia_caps": 509},
        "sim_memory_bytes": 65536,
        "gpus": gpus,
    })
}

struct QuotaFleet {
    _fx: FleetFixture,
    coordinator: Coordinator,
    a: Node,
    b: Node,
}

impl QuotaFleet {
    fn start(quotas: Value) -> QuotaFleet {
        let fx = FleetFixture::launch(&[QA, QB]);
        let coordinator = fx.coordinator_on_free_port("coordinator", &[]);
        let file = fx.path("policy-v1.json");
        std::fs::write(&file, policy(quotas)).unwrap();
        fx.push_file(&coordinator.url, &file, 1);
        let a = fx.node_described(QA, eight_h100(), &coordinator.url, &file, &[]);
        let b = fx.node_described(QB, eight_h100(), &coordinator.url, &file, &[]);
        let f = QuotaFleet { _fx: fx, coordinator, a, b };
        f.wait_status("both nodes synced and the books ready", |s| {
            s["books_ready"] == true && s["nodes"].get(QA).is_some() && s["nodes"].get(QB).is_some()
        });
        f
    }

    fn get(&self, path: &str) -> Option<Value> {
        let (code, body) = http(&self.coordinator.url, "GET", path, Some(ADMIN_TOKEN), None)?;
        (code == 200).then(|| serde_json::from_str(&body).unwrap())
    }

    fn wait_status(&self, what: &str, f: impl Fn(&Value) -> bool) -> Value {
        let t0 = Instant::now();
        loop {
            if let Some(s) = self.get("/v1/quota/status") {
                if f(&s) {
                    return s;
                }
                assert!(t0.elapsed() < Duration::from_secs(30), "never {what}: {s:#}");
            }
            assert!(t0.elapsed() < Duration::from_secs(30), "no quota status ({what})");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The quota events of `kind` (`preempt`, `borrow`, ...), oldest first.
    fn events(&self, kind: &str) -> Vec<Value> {
        let ev = self.get("/v1/quota/events").unwrap_or(Value::Null);
        ev.as_array().into_iter().flatten().filter(|e| e["kind"] == kind).cloned().collect()
    }

    fn gpus_of(&self, s: &Value, path: &str) -> Value {
        s["paths"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["path"] == path && r["resource"] == "gpus.H100-80GB")
            .cloned()
            .unwrap_or_else(|| panic!("no row for {path} in {s:#}"))
    }
}

/// A shell loop that says it is ready, then on SIGTERM runs `on_term`.
fn looping(on_term: &str) -> Vec<String> {
    let script = format!("trap '{on_term}' TERM; echo ready; while true; do sleep 0.1; done");
    vec!["sh".into(), "-c".into(), script]
}

/// Create and start `id` (one whole GPU for the tenant behind `ns`), or the error
/// tessera-runtime gave (the container is then gone).
fn try_run(
    node: &Node,
    id: &str,
    ns: &str,
    on_term: &str,
    annotations: &[(&str, &str)],
) -> Result<(), String> {
    try_run_gpus(node, id, ns, 1, on_term, annotations)
}

/// [`try_run`] for `gpus` whole GPUs.
fn try_run_gpus(
    node: &Node,
    id: &str,
    ns: &str,
    gpus: u32,
    on_term: &str,
    annotations: &[(&str, &str)],
) -> Result<(), String> {
    let script = looping(on_term);
    let argv: Vec<&str> = script.iter().map(String::as_str).collect();
    let mut b = node.bundle(id, ns, Some(&format!("gpu={gpus}")), &argv);
    for (k, v) in annotations {
        b.annotation(k, v);
    }
    b.write();
    let out = node.fx.create_container(&b, id);
    if !out.status.success() {
        node.fx.delete_container(id, true);
        return Err(format!("{}{}", out.stdout_str(), out.stderr_str()));
    }
    node.fx.start_container(id).assert_success("runc start");
    assert!(
        wait_for(|| node.fx.container_output(id).0.contains("ready"), Duration::from_secs(10)),
        "{id} did not start: {:?}",
        node.fx.container_output(id)
    );
    Ok(())
}

/// The seconds a "retry after N s" message asks for.
fn retry_after(msg: &str) -> Option<u64> {
    let i = msg.find("retry after ")?;
    msg[i + "retry after ".len()..].split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

/// [`try_run`], retried as kubelet would while the answer asks to retry (at most every
/// `poll`), for at most `within`; the answers that asked to retry.
fn run_retrying(
    node: &Node,
    id: &str,
    ns: &str,
    on_term: &str,
    annotations: &[(&str, &str)],
    poll: Duration,
    within: Duration,
) -> Vec<String> {
    retrying(id, poll, within, || try_run(node, id, ns, on_term, annotations))
}

/// `attempt` (a create of `id`), retried as kubelet would while the answer asks to retry
/// (at most every `poll`), for at most `within`; the answers that asked to retry.
fn retrying(
    id: &str,
    poll: Duration,
    within: Duration,
    mut attempt: impl FnMut() -> Result<(), String>,
) -> Vec<String> {
    let t0 = Instant::now();
    let mut asked = Vec::new();
    loop {
        match attempt() {
            Ok(()) => return asked,
            Err(e) => {
                let wait = retry_after(&e)
                    .or_else(|| e.contains("retry").then_some(1))
                    .unwrap_or_else(|| panic!("{id}: {e}"));
                asked.push(e);
                assert!(t0.elapsed() < within, "never got {id}: {asked:#?}");
                std::thread::sleep(Duration::from_secs(wait).min(poll));
            }
        }
    }
}

/// The whole GPUs of `node` that are free (not held, not dirty or being scrubbed).
fn free_gpus(node: &Node) -> usize {
    let s = node.client().status().expect("status");
    s.gpus.iter().filter(|g| g.state == tessera_api::DeviceState::Free).count()
}

/// Asks for `id` (`gpus` whole GPUs for `ns` on `node`) until the books answer that it
/// waits in the fair queue, through the lease recalls the first asks may meet; that
/// answer.
fn ask_until_queued(node: &Node, id: &str, ns: &str, gpus: u32) -> String {
    let t0 = Instant::now();
    loop {
        let e = try_run_gpus(node, id, ns, gpus, "exit 0", &[])
            .expect_err(&format!("{id}: no room on its node"));
        if e.contains("waiting in the fair queue") {
            return e;
        }
        assert!(e.contains("the leases are recalled"), "{id}: {e}");
        assert!(t0.elapsed() < Duration::from_secs(30), "{id} never queued: {e}");
        std::thread::sleep(Duration::from_secs(retry_after(&e).unwrap_or(1)).min(POLL));
    }
}

fn class_of(node: &Node, id: &str) -> Option<String> {
    let s = node.client().status().expect("status");
    let all = serde_json::to_value(&s.allocations).unwrap();
    all.as_array()
        .unwrap()
        .iter()
        .find(|a| a["container_id"] == id)
        .and_then(|a| a["quota"]["class"].as_str().map(str::to_string))
}

/// Waits (10 s at most) for `id`'s output on `node` to contain `text`; fails saying it
/// never `did`.
fn wait_output(node: &Node, id: &str, text: &str, did: &str) {
    assert!(
        wait_for(|| node.fx.container_output(id).0.contains(text), Duration::from_secs(10)),
        "{id} never {did}: {:?}",
        node.fx.container_output(id)
    );
}

/// The node's events (`tessera status`) of `kind` for container `id`.
fn node_events(node: &Node, id: &str, kind: &str) -> Vec<String> {
    node.client()
        .status()
        .unwrap()
        .events
        .into_iter()
        .filter(|e| e.container_id.as_deref() == Some(id) && e.kind == kind)
        .map(|e| e.detail)
        .collect()
}

const POLL: Duration = Duration::from_millis(500);
const LONG: Duration = Duration::from_secs(60);

/// These tests each run etcd, a coordinator, two tesserad and their containers, and time
/// grace periods and reclaims: one at a time, so one test's load does not stretch another's
/// timings. (Under load the hierarchy test saw a fourth victim where three suffice: a claim
/// that asked again before its victim's node synced started a second reclaim. Fixed in the
/// books, `quota::books::tests::a_claimant_asking_again_before_its_victim_leaves_the_books_takes_no_second_victim`.)
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[test]
fn a_teams_guarantee_is_set_aside_inside_its_parents_and_served_by_reclaiming_the_guest() {
    let _one = one_at_a_time();
    let f = QuotaFleet::start(json!({
        "acme": {"gpus": {"H100-80GB": {"guarantee": 12, "ceiling": 12}}, "grace_period_s": 3},
        "acme/trusted": {"gpus": {"H100-80GB": {"guarantee": 4}}},
        "acme/dev": {"gpus": {"H100-80GB": {"guarantee": 4}}},
    }));
    // The guest fills acme's 12: 8 on node A, 4 on node B.
    let mut guest = Vec::new();
    for i in 1..=12 {
        let id = format!("g{i:02}");
        let node = if i <= 8 { &f.a } else { &f.b };
        run_retrying(node, &id, GUEST, "echo got-SIGTERM; exit 0", &[], POLL, LONG);
        guest.push((node, id));
    }
    let s = f.wait_status("the guest's 12 counted", |s| {
        f.gpus_of(s, "acme")["in_use"].as_u64() == Some(12_000_000)
    });
    // Only acme's remainder (12 - 4 - 4) is the guest's guarantee: 8 of its 12 borrow.
    assert_eq!(f.gpus_of(&s, "acme")["borrowed"].as_u64(), Some(8_000_000), "{s:#}");
    let classes: Vec<Option<String>> = guest.iter().map(|(n, id)| class_of(n, id)).collect();
    let guaranteed = classes.iter().filter(|c| c.as_deref() == Some("guaranteed")).count();
    assert_eq!(guaranteed, 4, "the guest's guaranteed containers: {classes:?}");

    // Dev's 2 and alice's 1, on node B where there is room, within their teams'
    // guarantees: acme's ceiling is full of the guest's borrowed work, which is reclaimed.
    let mut asked = Vec::new();
    for (id, ns) in [("d1", BOB), ("d2", BOB), ("a1", ALICE)] {
        asked.extend(run_retrying(&f.b, id, ns, "exit 0", &[], POLL, LONG));
        assert_eq!(class_of(&f.b, id).as_deref(), Some("guaranteed"), "{id}: {asked:#?}");
    }
    assert!(
        asked.iter().any(|e| e.contains("reclaiming") && e.contains("acme/untrusted")),
        "{asked:#?}"
    );
    let s = f.wait_status("acme at its ceiling with dev and alice in", |s| {
        f.gpus_of(s, "acme/dev")["in_use"].as_u64() == Some(2_000_000)
            && f.gpus_of(s, "acme/trusted")["in_use"].as_u64() == Some(1_000_000)
            && f.gpus_of(s, "acme")["in_use"].as_u64() == Some(12_000_000)
    });
    // Three of the guest's borrowed containers made way; its guaranteed 4 kept running.
    assert_eq!(f.gpus_of(&s, "acme/dev")["borrowed"].as_u64(), Some(0), "{s:#}");
    assert_eq!(f.gpus_of(&s, "acme/trusted")["borrowed"].as_u64(), Some(0), "{s:#}");
    let preempted: Vec<String> = f
        .events("preempt")
        .iter()
        .filter(|e| e["tenant"] == "acme/untrusted/sandbox/guest")
        .map(|e| e["container_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(preempted.len(), 3, "{preempted:?}");
    // What people see (`tessera quota status`, /metrics): the work lost, the preemptions
    // of the last hour, the owners' waits; and why each victim was chosen.
    let s = f.wait_status("the preemptions counted", |s| {
        f.gpus_of(s, "acme")["preemptions_last_hour"].as_u64() == Some(3)
    });
    assert!(f.gpus_of(&s, "acme")["lost"].as_u64() > Some(0), "{s:#}");
    for team in ["acme/dev", "acme/trusted"] {
        let p99 = f.gpus_of(&s, team)["owner_wait_p99_ms"].as_u64();
        assert!(p99.is_some_and(|ms| ms <= 10_000), "{team}: {s:#}");
    }
    for e in f.events("preempt") {
        assert!(e["reason"].as_str().is_some_and(|r| !r.is_empty()), "{e:#}");
    }
    for ((n, id), class) in guest.iter().zip(&classes) {
        if preempted.contains(id) {
            assert_eq!(class.as_deref(), Some("borrowed"), "{id}: only borrowed work is taken");
        } else {
            assert_eq!(n.fx.status(id).as_deref(), Some("running"), "{id} kept running");
        }
    }
    for (n, id) in guest {
        n.fx.delete_container(&id, true);
    }
    for id in ["d1", "d2", "a1"] {
        f.b.fx.delete_container(id, true);
    }
}

/// The grace period of acme/dev in [`node_a_full_of_dev`].
const DEV_GRACE_S: u64 = 3;

/// acme/trusted guaranteed 4 GPUs, acme/dev 4 (ceiling 12, grace [`DEV_GRACE_S`]); dev fills
/// node A: 4 guaranteed, then 4 borrowed that ignore SIGTERM (the worst case: each is
/// killed only when its grace period ends).
fn node_a_full_of_dev() -> QuotaFleet {
    let f = QuotaFleet::start(json!({
        "acme/trusted": {"gpus": {"H100-80GB": {"guarantee": 4}}},
        "acme/dev": {"gpus": {"H100-80GB": {"guarantee": 4, "ceiling": 12}},
                     "grace_period_s": DEV_GRACE_S},
    }));
    for i in 1..=8 {
        let on_term = if i > 4 { "echo ignoring-SIGTERM" } else { "exit 0" };
        run_retrying(&f.a, &format!("b{i}"), BOB, on_term, &[], POLL, LONG);
    }
    f.wait_status("dev's 8 counted", |s| {
        f.gpus_of(s, "acme/dev")["in_use"].as_u64() == Some(8_000_000)
    });
    f
}

#[test]
fn a_four_pod_job_within_its_guarantee_runs_whole_within_grace_plus_five_seconds() {
    let _one = one_at_a_time();
    let f = node_a_full_of_dev();
    // Alice's job: 4 pods on node A at once, each retried every 0.5 s as asked.
    let t0 = Instant::now();
    let started: Vec<(String, Duration, Vec<String>)> = std::thread::scope(|s| {
        let hs: Vec<_> = (1..=4)
            .map(|i| {
                let (node, id) = (&f.a, format!("p{i}"));
                s.spawn(move || {
                    let asked = run_retrying(node, &id, ALICE, "exit 0", &[], POLL, LONG);
                    (id, t0.elapsed(), asked)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let last = started.iter().map(|(_, d, _)| *d).max().unwrap();
    assert!(
        last <= Duration::from_secs(DEV_GRACE_S + 5),
        "the job ran whole only after {last:?} (grace {DEV_GRACE_S} s): {started:?}"
    );
    for (id, _, _) in &started {
        assert_eq!(class_of(&f.a, id).as_deref(), Some("guaranteed"), "{id}");
    }
    // The four reclaims ran together: no pod's victims waited for another pod's to go (one
    // reclaim per node and tenant at a time chose them a grace period apart), nor for the
    // other node's lease of acme/trusted to be recalled first (the pods it held back were
    // told to retry after the recall and chose their victims a sync and a retry later: the
    // likely cause of a 3,006 ms spread seen once on a loaded machine; the books' test
    // `pods_within_a_guarantee_a_lease_holds_elsewhere_start_their_reclaims_at_their_first_ask`).
    let preempts = f.events("preempt");
    assert_eq!(preempts.len(), 4, "{preempts:#?}");
    // One reclaim for each pod, its event naming the pod it was started for.
    let mut claims: Vec<String> = f
        .events("reclaim")
        .iter()
        .filter(|e| e["reason"].as_str().is_some_and(|r| r.starts_with("reclaiming: stopping")))
        .map(|e| e["container_id"].as_str().unwrap_or("(none)").to_string())
        .collect();
    claims.sort();
    assert_eq!(claims, ["p1", "p2", "p3", "p4"], "{:#?}", f.events("reclaim"));
    let ts: Vec<u64> = preempts.iter().map(|e| e["ts_ms"].as_u64().unwrap()).collect();
    let spread = ts.iter().max().unwrap() - ts.iter().min().unwrap();
    assert!(spread < DEV_GRACE_S * 1000, "victims chosen {spread} ms apart: {preempts:#?}");
    for i in 1..=8 {
        f.a.fx.delete_container(&format!("b{i}"), true);
    }
    for i in 1..=4 {
        f.a.fx.delete_container(&format!("p{i}"), true);
    }
}

/// A create within its tenant's guarantee on a node full of borrowed work, under the
/// runtime's default configuration (`quota_wait_s` 90 s): tessera-runtime asks again while
/// its reclaim runs, and the one create the engine made succeeds once the victim is gone
/// (an engine that retries on its own schedule, as kubelet does with its back-off, no
/// longer sees a failure). With `quota_wait_s = 1` the next such create fails after about
/// a second with the reclaim's answer, as every create did before.
#[test]
fn a_create_within_its_guarantee_waits_for_its_reclaim_and_starts() {
    let _one = one_at_a_time();
    let f = node_a_full_of_dev();
    // The books take victims among what a node's sync listed: wait for node A's next one.
    let counted_ms =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis()
            as u64;
    f.wait_status("node A synced its 8 holdings", |s| {
        s["nodes"][QA].as_u64().is_some_and(|ms| ms > counted_ms)
    });
    let create = |id: &str, config: &str| {
        let file = f.a.fx.path(&format!("{id}-runtime.toml"));
        std::fs::write(&file, config).unwrap();
        let script = looping("exit 0");
        let argv: Vec<&str> = script.iter().map(String::as_str).collect();
        let mut b = f.a.bundle(id, ALICE, Some("gpu=1"), &argv);
        b.write();
        let t0 = Instant::now();
        let out = f.a.fx.create_container_env(
            &b,
            id,
            &[("TESSERA_RUNTIME_CONFIG", file.to_str().unwrap())],
        );
        (out, t0.elapsed())
    };
    // The default configuration (no key): one create, answered "reclaiming" (its own
    // reclaim's event names it) and granted once its victim, which ignores SIGTERM, is
    // killed at the end of its grace period.
    let (out, took) = create("p1", "");
    assert!(out.status.success(), "{}{}", out.stdout_str(), out.stderr_str());
    f.a.fx.start_container("p1").assert_success("runc start");
    assert!(
        wait_for(|| f.a.fx.container_output("p1").0.contains("ready"), Duration::from_secs(10)),
        "p1 did not start: {:?}",
        f.a.fx.container_output("p1")
    );
    assert_eq!(class_of(&f.a, "p1").as_deref(), Some("guaranteed"));
    let reclaimed_for = |id: &str| {
        f.events("reclaim").iter().any(|e| {
            e["container_id"] == id
                && e["reason"].as_str().is_some_and(|r| r.starts_with("reclaiming: stopping"))
        })
    };
    assert!(reclaimed_for("p1"), "{:#?}", f.events("reclaim"));
    assert!(
        took >= Duration::from_secs(DEV_GRACE_S - 1)
            && took <= Duration::from_secs(DEV_GRACE_S + 5),
        "one create took {took:?}: it waited for its victim's grace ({DEV_GRACE_S} s)"
    );
    // quota_wait_s = 1: the next reclaim outlasts it; the create fails with its answer.
    let (out, took) = create("short", "quota_wait_s = 1\n");
    assert!(!out.status.success(), "{}", out.stdout_str());
    let said = format!("{}{}", out.stdout_str(), out.stderr_str());
    assert!(said.contains("reclaiming: stopping 1 borrowed container"), "{said}");
    assert!(took >= Duration::from_secs(1), "gave up after {took:?}, before its wait");
    assert!(reclaimed_for("short"), "{:#?}", f.events("reclaim"));
    f.a.fx.delete_container("short", true);
    for i in 1..=8 {
        f.a.fx.delete_container(&format!("b{i}"), true);
    }
    f.a.fx.delete_container("p1", true);
}

#[test]
fn a_borrower_asking_again_at_once_is_preempted_at_most_once_per_minimum_run_time() {
    let _one = one_at_a_time();
    const MIN_RUNTIME_S: u64 = 5;
    const RUN_FOR: Duration = Duration::from_secs(20);
    let f = QuotaFleet::start(json!({
        "acme": {"gpus": {"H100-80GB": {"ceiling": 16}}, "grace_period_s": 1,
                 "min_runtime_s": MIN_RUNTIME_S},
        "acme/trusted": {"gpus": {"H100-80GB": {"guarantee": 8}}},
    }));
    // Alice holds 7 of node A's GPUs; the guest borrows the 8th.
    for i in 1..=7 {
        run_retrying(&f.a, &format!("a{i}"), ALICE, "exit 0", &[], POLL, LONG);
    }
    run_retrying(&f.a, "g1", GUEST, "exit 0", &[], POLL, LONG);
    let t0 = Instant::now();
    let current = std::sync::atomic::AtomicUsize::new(1);
    let mut protected_answers = 0;
    let mut owner_jobs = 0;
    std::thread::scope(|s| {
        // The guest, as a Job controller would: a stopped container is replaced at once,
        // and the replacement asked for again every 0.2 s until it runs.
        let borrower = s.spawn(|| {
            let mut n = 1;
            while t0.elapsed() < RUN_FOR {
                let id = format!("g{n}");
                if f.a.fx.status(&id).as_deref() == Some("running") {
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
                f.a.fx.delete_container(&id, true);
                n += 1;
                let next = format!("g{n}");
                while t0.elapsed() < RUN_FOR {
                    if try_run(&f.a, &next, GUEST, "exit 0", &[]).is_ok() {
                        current.store(n, std::sync::atomic::Ordering::SeqCst);
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
            n
        });
        // The owner, at its worst: as soon as the guest runs again, a short job of its
        // own on the 8th GPU (started, then done).
        while t0.elapsed() < RUN_FOR {
            let back = wait_for(
                || {
                    let id = format!("g{}", current.load(std::sync::atomic::Ordering::SeqCst));
                    f.a.fx.status(&id).as_deref() == Some("running")
                },
                RUN_FOR.saturating_sub(t0.elapsed()),
            );
            if !back || t0.elapsed() >= RUN_FOR {
                break;
            }
            owner_jobs += 1;
            let id = format!("job{owner_jobs}");
            let asked = run_retrying(&f.a, &id, ALICE, "exit 0", &[], POLL, LONG);
            protected_answers +=
                asked.iter().filter(|e| e.contains("within its minimum run time")).count();
            f.a.fx.delete_container(&id, true);
        }
        let last = borrower.join().unwrap();
        f.a.fx.delete_container(&format!("g{last}"), true);
    });
    // Every preemption of the guest came at least its minimum run time after it started.
    let borrowed_at: std::collections::BTreeMap<String, u64> = f
        .events("borrow")
        .iter()
        .map(|e| (e["container_id"].as_str().unwrap().to_string(), e["ts_ms"].as_u64().unwrap()))
        .collect();
    let preempts: Vec<(String, u64)> = f
        .events("preempt")
        .iter()
        .filter(|e| e["tenant"] == "acme/untrusted/sandbox/guest")
        .map(|e| (e["container_id"].as_str().unwrap().to_string(), e["ts_ms"].as_u64().unwrap()))
        .collect();
    assert!(
        preempts.len() >= 2,
        "the owner was served by preempting ({owner_jobs} owner jobs): {preempts:?}"
    );
    let most = RUN_FOR.as_secs() / MIN_RUNTIME_S + 1;
    assert!(
        preempts.len() as u64 <= most,
        "{} preemptions in {RUN_FOR:?} with a minimum run time of {MIN_RUNTIME_S} s: {preempts:?}",
        preempts.len()
    );
    for (id, at) in &preempts {
        let from = borrowed_at.get(id).unwrap_or_else(|| panic!("no borrow event for {id}"));
        let life_ms = at - from;
        assert!(
            life_ms + 500 >= MIN_RUNTIME_S * 1000,
            "{id} preempted {life_ms} ms after it started (minimum run time {MIN_RUNTIME_S} s)"
        );
    }
    assert!(protected_answers > 0, "an owner was told the borrower's minimum run time");
    for i in 1..=7 {
        f.a.fx.delete_container(&format!("a{i}"), true);
    }
}

#[test]
fn a_checkpointing_container_gets_sigterm_writes_its_checkpoint_and_is_requeued_with_the_hint() {
    let _one = one_at_a_time();
    const GRACE_S: u64 = 3;
    const BACKOFF_S: u64 = 4;
    let f = QuotaFleet::start(json!({
        "acme/trusted": {"gpus": {"H100-80GB": {"guarantee": 4}}},
        "acme/dev": {"gpus": {"H100-80GB": {"guarantee": 4, "ceiling": 12}},
                     "grace_period_s": GRACE_S, "requeue_backoff_s": BACKOFF_S},
    }));
    let checkpoint = [("tessera.io/preemption", "checkpoint")];
    let write =
        "echo writing-checkpoint; echo step-42 > /tmp/ckpt; echo checkpoint-written; exit 0";
    // Dev on node A: 4 guaranteed, then c1 (borrowed, checkpoints), then 3 borrowed that
    // do not. They all run long enough that losing their work costs more than c1's grace.
    for i in 1..=4 {
        run_retrying(&f.a, &format!("b{i}"), BOB, "exit 0", &[], POLL, LONG);
    }
    run_retrying(&f.a, "c1", BOB, write, &checkpoint, POLL, LONG);
    for i in 5..=7 {
        run_retrying(&f.a, &format!("b{i}"), BOB, "echo got-SIGTERM; exit 0", &[], POLL, LONG);
    }
    let youngest_started = Instant::now();
    assert_eq!(class_of(&f.a, "c1").as_deref(), Some("borrowed"));
    // The precondition is the work's age itself: b5..b7 must have run longer than c1's
    // grace period, so that stopping one of them loses more than stopping c1.
    let age = Duration::from_secs(GRACE_S + 2);
    std::thread::sleep(age.saturating_sub(youngest_started.elapsed()));
    // Alice asks for 1 on node A, which dev fills: one GPU must be reclaimed.
    run_retrying(&f.a, "a1", ALICE, "exit 0", &[], POLL, LONG);
    // The victim is the one that loses least: c1, which checkpoints.
    wait_output(&f.a, "c1", "checkpoint-written", "got SIGTERM and wrote its checkpoint");
    for i in 5..=7 {
        assert_eq!(f.a.fx.status(&format!("b{i}")).as_deref(), Some("running"), "b{i}");
    }
    let why = f.events("preempt");
    assert_eq!(why.len(), 1, "{why:#?}");
    let reason = why[0]["reason"].as_str().unwrap();
    assert!(reason.contains("checkpoints on SIGTERM"), "{reason}");
    // The hint, where its owner sees it (`tessera status` on the node): SIGTERM, the grace
    // period to write the checkpoint, resume from it, and when it may run again.
    let hint = node_events(&f.a, "c1", "preempt").join("\n");
    assert!(
        hint.contains(&format!("checkpointing: SIGTERM now, {GRACE_S} s to write its checkpoint"))
            && hint.contains("resumes from it")
            && hint.contains("may borrow again from"),
        "{hint}"
    );
    // Requeued (on node B, where there is room): asked again at once, it is told to wait
    // out its backoff, then runs.
    assert!(
        wait_for(|| f.a.fx.status("c1").as_deref() != Some("running"), Duration::from_secs(10)),
        "c1 stopped"
    );
    f.a.fx.delete_container("c1", true);
    let asked = run_retrying(&f.b, "c1", BOB, write, &checkpoint, POLL, LONG);
    assert!(
        asked.iter().any(|e| {
            e.contains("was preempted 1 time")
            && e.contains(
                "it may borrow again after its requeue backoff (quotas.acme/dev.requeue_backoff_s, \
                 doubled with each preemption): retry after"
            )
        }),
        "{asked:#?}"
    );
    assert_eq!(class_of(&f.b, "c1").as_deref(), Some("borrowed"));
    f.b.fx.delete_container("c1", true);
    for id in ["b1", "b2", "b3", "b4", "b5", "b6", "b7", "a1"] {
        f.a.fx.delete_container(id, true);
    }
}

/// Within a tenant's turn its largest waiting request goes first (`quota::fair_order`), and
/// the books keep a node's freed GPUs for it (`fair_queue_blocks`): bob fills node A and
/// waits there with a 1-GPU request, then a 4-GPU one; four of his GPUs free, and the 1-GPU
/// request, the older and the first to ask again, is refused naming the larger one, which
/// runs. (Served in arrival order, the 1-GPU request takes one of the four and the 4-GPU
/// one waits for a whole node's worth to free again.)
#[test]
fn freed_gpus_go_to_the_tenants_larger_waiting_request_before_its_older_smaller_one() {
    let _one = one_at_a_time();
    let f = QuotaFleet::start(json!({
        "acme/trusted": {"gpus": {"H100-80GB": {"guarantee": 4}}},
        "acme/dev": {"gpus": {"H100-80GB": {"ceiling": 16}}},
    }));
    let bob = "acme/dev/notebooks/bob";
    for i in 1..=8 {
        run_retrying(&f.a, &format!("b{i}"), BOB, "exit 0", &[], POLL, LONG);
    }
    f.wait_status("bob's 8 counted", |s| {
        f.gpus_of(s, "acme/dev")["in_use"].as_u64() == Some(8_000_000)
    });
    // Node A is full: bob's 1-GPU request waits there, then his 4-GPU one.
    let one = try_run(&f.a, "one", BOB, "exit 0", &[]).expect_err("node A is full");
    assert!(one.contains("waiting in the fair queue"), "{one}");
    let wide = try_run_gpus(&f.a, "wide", BOB, 4, "exit 0", &[]).expect_err("node A is full");
    assert!(wide.contains("waiting in the fair queue"), "{wide}");
    // Four of bob's GPUs on node A end, and the books hear of it.
    for i in 1..=4 {
        f.a.fx.delete_container(&format!("b{i}"), true);
    }
    f.wait_status("bob's 4 released", |s| {
        f.gpus_of(s, "acme/dev")["in_use"].as_u64() == Some(4_000_000)
    });
    assert!(
        wait_for(|| free_gpus(&f.a) == 4, Duration::from_secs(10)),
        "node A's four freed GPUs scrubbed and free: {} free",
        free_gpus(&f.a)
    );
    // The 1-GPU request asks again first: the four are kept for the larger one.
    let one = match try_run(&f.a, "one", BOB, "exit 0", &[]) {
        Ok(()) => panic!(
            "bob's older 1-GPU request took one of the four freed GPUs ({:?}), his 4-GPU \
             request waiting",
            class_of(&f.a, "one")
        ),
        Err(e) => e,
    };
    assert!(
        one.contains(&format!("capacity on node {QA} is kept for tenant {bob}"))
            && one.contains("for 4 H100-80GB GPUs")
            && one.contains(&format!("it is a larger request of {bob}'s own")),
        "{one}"
    );
    assert_eq!(f.a.fx.status("one"), None, "the refused create left no container");
    // The 4-GPU request, asking again as kubelet does, runs on the four.
    let asked = retrying("wide", POLL, LONG, || try_run_gpus(&f.a, "wide", BOB, 4, "exit 0", &[]));
    assert!(asked.is_empty(), "the 4-GPU request ran at its next ask: {asked:#?}");
    assert_eq!(class_of(&f.a, "wide").as_deref(), Some("borrowed"));
    f.wait_status("bob's 4 and his 4-GPU request counted", |s| {
        f.gpus_of(s, "acme/dev")["in_use"].as_u64() == Some(8_000_000)
    });
    // The node is full again: the 1-GPU request waits for capacity to free.
    let one = try_run(&f.a, "one", BOB, "exit 0", &[]).expect_err("node A is full again");
    assert!(one.contains("waiting in the fair queue"), "{one}");
    for id in ["b5", "b6", "b7", "b8", "wide"] {
        f.a.fx.delete_container(id, true);
    }
}

/// A request not owed now never preempts (`quota::owed_behind`): alice (guarantee 4) waits
/// with a 4-GPU request on node A, full of bob's guaranteed work (nothing to reclaim), then
/// asks for 1 GPU on node B, full of the guest's borrowed work that checkpoints (grace
/// 1 s: stopping a unit loses 1 s). Her 4 ahead fill her guarantee, so the 1 is not owed:
/// asked again and again for 5 s, each answer says it preempts nothing, no preempt event is
/// recorded and no guest container gets SIGTERM. Bob's 1 on node B, owed at its first ask,
/// reclaims a guest unit at once: the same victims were there to take. (Under the
/// ski-rental rule alone, alice's 1 reclaimed once it had waited 1 s: the victim's loss.)
#[test]
fn a_request_not_owed_preempts_nothing_while_one_owed_at_once_reclaims() {
    let _one = one_at_a_time();
    let f = QuotaFleet::start(json!({
        "acme": {"grace_period_s": 1},
        "acme/trusted": {"gpus": {"H100-80GB": {"guarantee": 4}}},
        "acme/dev": {"gpus": {"H100-80GB": {"guarantee": 9}}},
    }));
    let checkpoint = [("tessera.io/preemption", "checkpoint")];
    // The guest borrows all of node B; bob fills node A within his guarantee.
    for i in 1..=8 {
        let id = format!("g{i}");
        run_retrying(&f.b, &id, GUEST, "echo got-SIGTERM; exit 0", &checkpoint, POLL, LONG);
        assert_eq!(class_of(&f.b, &id).as_deref(), Some("borrowed"), "{id}");
    }
    for i in 1..=8 {
        let id = format!("d{i}");
        run_retrying(&f.a, &id, BOB, "exit 0", &[], POLL, LONG);
        assert_eq!(class_of(&f.a, &id).as_deref(), Some("guaranteed"), "{id}");
    }
    f.wait_status("the fleet full", |s| {
        f.gpus_of(s, "acme/dev")["in_use"].as_u64() == Some(8_000_000)
    });
    // Alice's 4 on node A: owed, but only guaranteed work is there; it waits.
    ask_until_queued(&f.a, "wide", ALICE, 4);
    // Alice's 1 on node B, her 4 still asking: not owed, whatever it has waited.
    let t0 = Instant::now();
    let mut answers = Vec::new();
    while t0.elapsed() < Duration::from_secs(5) {
        let wide = try_run_gpus(&f.a, "wide", ALICE, 4, "exit 0", &[]).expect_err("A is full");
        assert!(wide.contains("waiting in the fair queue"), "{wide}");
        let waited = t0.elapsed();
        let one = match try_run(&f.b, "one", ALICE, "exit 0", &[]) {
            Ok(()) => panic!("alice's 1 ran on node B after {waited:?}: {:?}", f.events("preempt")),
            Err(e) => e,
        };
        assert!(!one.contains("reclaiming"), "alice's 1 reclaimed after {waited:?}: {one}");
        answers.push((waited, one));
        std::thread::sleep(POLL);
    }
    assert!(answers.len() >= 4, "alice's 1 asked {} times in 5 s", answers.len());
    assert_eq!(f.events("preempt"), Vec::<Value>::new(), "no preemption for alice's 1");
    for i in 1..=8 {
        let id = format!("g{i}");
        assert_eq!(f.b.fx.status(&id).as_deref(), Some("running"), "{id}");
        assert!(!f.b.fx.container_output(&id).0.contains("got-SIGTERM"), "{id} got SIGTERM");
    }
    // Each answer says why.
    for (waited, a) in &answers {
        assert!(
            a.contains("not owed now") && a.contains("so it preempts no borrowed work"),
            "after {waited:?}: {a}"
        );
    }
    // Bob's 1 on node B, within his guarantee and nothing of his waiting: owed at once, it
    // reclaims one of the guest's units.
    let asked = run_retrying(&f.b, "d9", BOB, "exit 0", &[], POLL, LONG);
    assert!(
        asked.iter().any(|e| e.contains("reclaiming") && e.contains("acme/untrusted"))
            && !asked.iter().any(|e| {
                e.contains("not owed") || e.contains("owed since") || e.contains("owed behind")
            }),
        "{asked:#?}"
    );
    assert_eq!(class_of(&f.b, "d9").as_deref(), Some("guaranteed"));
    let preempted: Vec<String> = f
        .events("preempt")
        .iter()
        .map(|e| e["container_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(preempted.len(), 1, "{preempted:?}");
    let victim = &preempted[0];
    wait_output(&f.b, victim, "got-SIGTERM", "got SIGTERM");
    for i in 1..=8 {
        f.a.fx.delete_container(&format!("d{i}"), true);
        f.b.fx.delete_container(&format!("g{i}"), true);
    }
    f.b.fx.delete_container("d9", true);
}

/// Alice (acme/trusted: guarantee 4, `owed_reclaim_after_s` 3), bob (acme/dev: guarantee
/// 9), grace periods of 1 s; the guest borrows all of node B (g1–g8, no checkpoints: a
/// victim loses all it has run) and bob fills node A within his guarantee (d1–d8), the
/// books seeing it.
fn owed_later_fleet() -> QuotaFleet {
    let f = QuotaFleet::start(json!({
        "acme": {"grace_period_s": 1},
        "acme/trusted": {"gpus": {"H100-80GB": {"guarantee": 4}}, "owed_reclaim_after_s": 3},
        "acme/dev": {"gpus": {"H100-80GB": {"guarantee": 9}}},
    }));
    for i in 1..=8 {
        let id = format!("g{i}");
        run_retrying(&f.b, &id, GUEST, "echo got-SIGTERM; exit 0", &[], POLL, LONG);
        assert_eq!(class_of(&f.b, &id).as_deref(), Some("borrowed"), "{id}");
    }
    for i in 1..=8 {
        let id = format!("d{i}");
        run_retrying(&f.a, &id, BOB, "exit 0", &[], POLL, LONG);
    }
    f.wait_status("the fleet full", |s| {
        f.gpus_of(s, "acme/dev")["in_use"].as_u64() == Some(8_000_000)
    });
    f
}

/// A request owed only behind a larger request of its tenant does not reclaim at once
/// (`quota::owed_at_once`): alice (guarantee 4, `owed_reclaim_after_s` 3) waits with a
/// 5-GPU request on node A, full of bob's guaranteed work, then asks for 1 GPU on node B,
/// full of the guest's borrowed work. Her 5 fills none of her guarantee, so the 1 is owed,
/// but not at once: its first answer says it is owed behind a larger request of its tenant
/// and when it will reclaim, and nothing is preempted; 3 s later it reclaims one guest
/// unit and runs, guaranteed. (With the at-once reclaim for every owed request, its first
/// ask reclaimed.)
#[test]
fn a_request_owed_only_behind_a_larger_one_reclaims_after_its_paths_owed_reclaim_after_s() {
    let _one = one_at_a_time();
    let f = owed_later_fleet();
    // Alice's 5 (beyond her guarantee of 4) waits on node A.
    ask_until_queued(&f.a, "five", ALICE, 5);
    let asked = Instant::now();
    let first = try_run(&f.b, "one", ALICE, "exit 0", &[]).expect_err("B is full");
    assert!(
        first.contains("owed behind a larger request of its tenant")
            && first.contains("or once owed for 3 s (quotas.acme/trusted.owed_reclaim_after_s)")
            && !first.contains("reclaiming"),
        "{first}"
    );
    assert_eq!(f.events("preempt"), Vec::<Value>::new(), "nothing preempted at its first ask");
    // Alice's 5 stays in the fair queue (it asked less than a minute ago); her 1 reclaims
    // once owed for 3 s.
    let asked_again = run_retrying(&f.b, "one", ALICE, "exit 0", &[], POLL, LONG);
    let waited = asked.elapsed();
    assert!(asked_again.iter().any(|e| e.contains("reclaiming")), "{asked_again:#?}");
    assert!(waited >= Duration::from_secs(3), "ran {waited:?} after its first ask");
    assert!(waited < Duration::from_secs(3 + 1 + 10), "ran {waited:?} after its first ask");
    assert_eq!(class_of(&f.b, "one").as_deref(), Some("guaranteed"));
    let preempt = f.events("preempt");
    assert_eq!(preempt.len(), 1, "{preempt:#?}");
    assert!(
        preempt[0]["reason"].as_str().is_some_and(|r| {
            r.contains("owed behind a larger request of its tenant")
                && r.contains("owed_reclaim_after_s (3 s)")
        }),
        "{preempt:#?}"
    );
    for i in 1..=8 {
        f.a.fx.delete_container(&format!("d{i}"), true);
        f.b.fx.delete_container(&format!("g{i}"), true);
    }
    f.b.fx.delete_container("one", true);
}

/// A request owed only later (its tenant's requests ahead served) whose victims have run
/// longer than it has waited reclaims once owed for its path's `owed_reclaim_after_s`,
/// told when until then; the policy setting reaches the books through the coordinator, and
/// the status shows the wait.
#[test]
fn a_request_owed_later_reclaims_once_owed_for_its_paths_owed_reclaim_after_s() {
    let _one = one_at_a_time();
    let f = owed_later_fleet();
    // Alice's 4 waits on node A; her 1 on node B is not owed (her 4 ahead fills her
    // guarantee).
    ask_until_queued(&f.a, "wide", ALICE, 4);
    let one = try_run(&f.b, "one", ALICE, "exit 0", &[]).expect_err("B is full");
    assert!(one.contains("not owed now"), "{one}");
    // Four of bob's end: alice's 4 runs; then it ends. Her 1 is owed from now on.
    for i in 1..=4 {
        f.a.fx.delete_container(&format!("d{i}"), true);
    }
    retrying("wide", POLL, LONG, || try_run_gpus(&f.a, "wide", ALICE, 4, "exit 0", &[]));
    f.a.fx.delete_container("wide", true);
    f.wait_status("alice's 4 gone from the books", |s| {
        f.gpus_of(s, "acme/trusted")["in_use"].as_u64() == Some(0)
    });
    let owed = Instant::now();
    let first = try_run(&f.b, "one", ALICE, "exit 0", &[]).expect_err("B is full");
    assert!(
        first.contains("would lose no more than it has waited")
            && first.contains("or once owed for 3 s (quotas.acme/trusted.owed_reclaim_after_s)"),
        "{first}"
    );
    let asked = run_retrying(&f.b, "one", ALICE, "exit 0", &[], POLL, LONG);
    let waited = owed.elapsed();
    assert!(asked.iter().any(|e| e.contains("reclaiming")), "{asked:#?}");
    assert!(waited >= Duration::from_secs(3), "ran {waited:?} after it was owed: {asked:#?}");
    assert!(waited < Duration::from_secs(3 + 1 + 10), "ran {waited:?} after it was owed");
    let preempt = f.events("preempt");
    assert_eq!(preempt.len(), 1, "{preempt:#?}");
    assert!(
        preempt[0]["reason"].as_str().is_some_and(|r| r.contains("owed_reclaim_after_s (3 s)")),
        "{preempt:#?}"
    );
    let s = f.wait_status("alice's owed-later wait counted", |s| {
        f.gpus_of(s, "acme/trusted")["owed_later_wait_p99_ms"].as_u64().is_some()
    });
    let p99 = f.gpus_of(&s, "acme/trusted")["owed_later_wait_p99_ms"].as_u64().unwrap();
    assert!((3_000..=waited.as_millis() as u64 + 1_000).contains(&p99), "{p99} ms: {s:#}");
    for i in 1..=8 {
        f.b.fx.delete_container(&format!("g{i}"), true);
    }
    for i in 5..=8 {
        f.a.fx.delete_container(&format!("d{i}"), true);
    }
    f.b.fx.delete_container("one", true);
}

/// Consolidation end to end (`quota::choose_victims_to_consolidate`,
/// `Books::consolidate_on_node`): bob (acme/dev, guarantee 2, grace 1 s) fills node A with
/// eight containers that checkpoint (b1, b2 guaranteed, b3–b8 borrowed); alice (acme/trusted,
/// guarantee 2) runs five on node B (3 borrowed), which keeps 3 GPUs free. Alice's 2-GPU
/// request on node A is borrowed and node A cannot place it: at its first ask moving work
/// would lose more than it has waited; once it has waited as long as two moves lose (1 s of
/// grace each), two of bob's borrowed containers on A get SIGTERM and write their checkpoints,
/// the rest of bob's work and all of alice's runs on, alice's request runs on A, and a moved
/// container asked again on node B runs at once (a move takes no requeue backoff).
#[test]
fn a_borrowed_request_its_node_cannot_place_moves_checkpointing_work_to_the_node_with_room() {
    let _one = one_at_a_time();
    let f = QuotaFleet::start(json!({
        "acme/trusted": {"gpus": {"H100-80GB": {"guarantee": 2, "ceiling": 16}}},
        "acme/dev": {"gpus": {"H100-80GB": {"guarantee": 2, "ceiling": 16}},
                     "grace_period_s": 1, "requeue_backoff_s": 600},
    }));
    let checkpoint = [("tessera.io/preemption", "checkpoint")];
    let write = "echo writing-checkpoint; echo step-7 > /tmp/ckpt; echo checkpoint-written; exit 0";
    let bobs: Vec<String> = (1..=8).map(|i| format!("b{i}")).collect();
    for (i, id) in bobs.iter().enumerate() {
        run_retrying(&f.a, id, BOB, write, &checkpoint, POLL, LONG);
        let class = if i < 2 { "guaranteed" } else { "borrowed" };
        assert_eq!(class_of(&f.a, id).as_deref(), Some(class), "{id}");
    }
    for i in 1..=5 {
        let id = format!("a{i}");
        run_retrying(&f.b, &id, ALICE, "echo got-SIGTERM; exit 0", &[], POLL, LONG);
    }
    f.wait_status("the books see both nodes' work", |s| {
        f.gpus_of(s, "acme/dev")["in_use"].as_u64() == Some(8_000_000)
            && f.gpus_of(s, "acme/trusted")["in_use"].as_u64() == Some(5_000_000)
    });
    assert_eq!(free_gpus(&f.b), 3);
    // Alice's 2 on node A, asked again as kubelet would.
    let t0 = Instant::now();
    let asked = retrying("big", POLL, LONG, || try_run_gpus(&f.a, "big", ALICE, 2, "exit 0", &[]));
    let ran_after = t0.elapsed();
    assert!(
        asked.iter().any(|e| e.contains("would lose more than it has waited")),
        "it first waited until moving was worth it: {asked:#?}"
    );
    assert!(
        asked.iter().any(|e| {
            e.contains(&format!(
                "consolidating: moving 2 checkpointing containers of acme/dev/notebooks/bob off \
                 node {QA}"
            ))
        }),
        "{asked:#?}"
    );
    assert!(ran_after < Duration::from_secs(20), "big ran only after {ran_after:?}: {asked:#?}");
    assert_eq!(class_of(&f.a, "big").as_deref(), Some("borrowed"));
    // The two moved: bob's borrowed containers on A, each told where there is room.
    let moves = f.events("preempt");
    assert_eq!(moves.len(), 2, "{moves:#?}");
    let moved: Vec<String> =
        moves.iter().map(|e| e["container_id"].as_str().unwrap().to_string()).collect();
    for (e, id) in moves.iter().zip(&moved) {
        assert!(bobs[2..].contains(id), "{id} is one of bob's borrowed containers: {e:#}");
        let reason = e["reason"].as_str().unwrap();
        assert!(
            reason.contains("moved for acme/trusted")
                && reason.contains(&format!("node {QB} has room for it")),
            "{reason}"
        );
        wait_output(&f.a, id, "checkpoint-written", "got SIGTERM and wrote its checkpoint");
        let hint = node_events(&f.a, id, "preempt").join("\n");
        assert!(hint.contains("resumes from it") && hint.contains("no requeue backoff"), "{hint}");
    }
    for id in bobs.iter().filter(|id| !moved.contains(id)) {
        assert_eq!(f.a.fx.status(id).as_deref(), Some("running"), "{id}");
        assert!(!f.a.fx.container_output(id).0.contains("writing-checkpoint"), "{id}");
    }
    for i in 1..=5 {
        let id = format!("a{i}");
        assert_eq!(f.b.fx.status(&id).as_deref(), Some("running"), "{id}");
        assert!(!f.b.fx.container_output(&id).0.contains("got-SIGTERM"), "{id}");
    }
    // A moved container resumes on node B at once: no requeue backoff (bob's is 600 s).
    let first = &moved[0];
    f.a.fx.delete_container(first, true);
    let asked = run_retrying(&f.b, first, BOB, write, &checkpoint, POLL, LONG);
    assert!(!asked.iter().any(|e| e.contains("requeue backoff")), "{asked:#?}");
    assert_eq!(class_of(&f.b, first).as_deref(), Some("borrowed"));
    f.b.fx.delete_container(first, true);
    for id in bobs.iter().chain(std::iter::once(&"big".to_string())) {
        f.a.fx.delete_container(id, true);
    }
    for i in 1..=5 {
        f.b.fx.delete_container(&format!("a{i}"), true);
    }
}
