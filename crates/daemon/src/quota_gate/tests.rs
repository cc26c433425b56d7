use super::*;
use fleet::quota_wire::Victim;
use quota::QuotaSpec;
use serde_json::json;

fn tree(spec: serde_json::Value) -> QuotaTree {
    let spec: QuotaSpec = serde_json::from_value(spec).expect("spec");
    spec.validate("quotas", |_| true).expect("valid quotas")
}

fn gpus(model: &str, micro: u64) -> Resources {
    Resources::new().with(quota::Resource::gpu(model), micro)
}

const H100: &str = "H100-80GB";
const A100: &str = "A100-40GB";
const GPU: u64 = quota::MICRO_PER_GPU;

// ---- amounts ----------------------------------------------------------------------------

fn amounts_of(request: &str, models: &[&str], replicas: u32) -> BTreeMap<String, u64> {
    let r: GpuRequest = request.parse().expect("request");
    gpu_amounts(&r, models, replicas, None).expect("amounts")
}

#[test]
fn whole_gpus_count_one_each_by_model() {
    assert_eq!(amounts_of("gpu=1", &[H100], 4), BTreeMap::from([(H100.to_string(), GPU)]));
    assert_eq!(
        amounts_of("gpu=3", &[H100, H100, H100], 4),
        BTreeMap::from([(H100.into(), 3 * GPU)])
    );
    // A grant over two models counts against each.
    assert_eq!(
        amounts_of("gpu=2", &[H100, A100], 4),
        BTreeMap::from([(A100.to_string(), GPU), (H100.to_string(), GPU)])
    );
}

#[test]
fn mig_instances_count_their_compute_slices_over_seven_floored() {
    // 1/7 and 3/7 of a GPU, floored to a micro-GPU: seven 1g parts never exceed one GPU.
    assert_eq!(amounts_of("mig=1g.10gb", &[H100], 4)[H100], 142_857);
    assert_eq!(amounts_of("mig=3g.40gb", &[H100], 4)[H100], 428_571);
    assert_eq!(amounts_of("mig=7g.80gb", &[H100], 4)[H100], GPU);
    assert!(7 * amounts_of("mig=1g.10gb", &[H100], 4)[H100] <= GPU);
    assert_eq!(amounts_of("mig=1g.5gb", &[A100], 4)[A100], 142_857);
}

#[test]
fn mps_counts_its_percent_and_a_replica_one_over_the_replicas() {
    assert_eq!(amounts_of("mps=25", &[H100], 4)[H100], 250_000);
    assert_eq!(amounts_of("mps=100", &[H100], 4)[H100], GPU);
    assert_eq!(amounts_of("mps=1", &[H100], 4)[H100], 10_000);
    assert_eq!(amounts_of("shared", &[H100], 4)[H100], 250_000);
    assert_eq!(amounts_of("shared", &[H100], 3)[H100], 333_333);
    assert!(3 * amounts_of("shared", &[H100], 3)[H100] <= GPU);
}

#[test]
fn wire_amounts_carry_the_limits_and_drop_nothing_else() {
    let g = amounts_of("gpu=1", &[H100], 4);
    let a = amounts(&g, &ContainerLimits { cpu_milli: Some(1500), memory_mib: Some(2048) });
    assert_eq!(a.to_resources(), gpus(H100, GPU).with_cpu_milli(1500).with_memory_mib(2048));
    let none = amounts(&g, &ContainerLimits::default());
    assert_eq!((none.cpu_milli, none.memory_mib), (0, 0));
    assert!(checked_limits(None).is_ok());
    let e = checked_limits(Some(&ContainerLimits {
        cpu_milli: Some(ContainerLimits::MAX_CPU_MILLI + 1),
        memory_mib: None,
    }))
    .expect_err("too large");
    assert!(e.to_string().contains("limits.cpu_milli"), "{e}");
    let e = checked_limits(Some(&ContainerLimits {
        cpu_milli: None,
        memory_mib: Some(ContainerLimits::MAX_MEMORY_MIB + 1),
    }))
    .expect_err("too large");
    assert!(e.to_string().contains("limits.memory_mib"), "{e}");
}

#[test]
fn a_request_the_node_cannot_place_counts_on_the_model_most_of_its_gpus_are() {
    let inv: slicer::Inventory = serde_json::from_value(json!({
        "node": "n",
        "majors": {"nvidia": 195, "nvidia_uvm": 510, "nvidia_caps": 511},
        "gpus": [
            {"index": 0, "uuid": "GPU-0", "model": A100, "minor": 0, "memory_mib": 40960, "mig_enabled": true, "instances": []},
            {"index": 1, "uuid": "GPU-1", "model": H100, "minor": 1, "memory_mib": 81559, "mig_enabled": false, "instances": []},
            {"index": 2, "uuid": "GPU-2", "model": H100, "minor": 2, "memory_mib": 81559, "mig_enabled": false, "instances": []},
        ]
    }))
    .expect("inventory");
    let r = |s: &str| s.parse::<GpuRequest>().expect("request");
    assert_eq!(likely_model(&inv, &r("gpu=2")).as_deref(), Some(H100));
    assert_eq!(likely_model(&inv, &r("mps=50")).as_deref(), Some(H100));
    // 1g.5gb is an A100-40GB profile only; 1g.10gb an H100's.
    assert_eq!(likely_model(&inv, &r("mig=1g.5gb")).as_deref(), Some(A100));
    assert_eq!(likely_model(&inv, &r("mig=1g.10gb")).as_deref(), Some(H100));
    assert_eq!(likely_model(&inv, &r("mig=1g.12gb")), None, "no GPU here has it");
    assert_eq!(device_count(&r("gpu=3")), 3);
    assert_eq!(device_count(&r("shared")), 1);
}

// ---- gangs ------------------------------------------------------------------------------

fn annotations(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(k, v)| ((*k).to_string(), (*v).to_string())).collect()
}

#[test]
fn a_gang_is_its_name_and_size_or_nothing() {
    assert_eq!(gang_of(&annotations(&[("tessera.io/gpu", "gpu=1")])), Ok(None));
    assert_eq!(
        gang_of(&annotations(&[(GANG_ANNOTATION, "train-7.a_b"), (GANG_SIZE_ANNOTATION, "4")])),
        Ok(Some(GangRef { name: "train-7.a_b".into(), size: 4 }))
    );
    let max = MAX_GANG_SIZE.to_string();
    assert_eq!(
        gang_of(&annotations(&[(GANG_ANNOTATION, "g"), (GANG_SIZE_ANNOTATION, max.as_str())]))
            .map(|g| g.map(|g| g.size)),
        Ok(Some(MAX_GANG_SIZE))
    );
}

#[test]
fn only_checkpoint_marks_a_container_that_checkpoints_and_any_other_value_is_refused() {
    assert_eq!(checkpoints(&annotations(&[("tessera.io/gpu", "gpu=1")])), Ok(false));
    assert_eq!(checkpoints(&annotations(&[(PREEMPTION_ANNOTATION, "checkpoint")])), Ok(true));
    for v in ["Checkpoint", "checkpoint ", "", "never", "\u{1b}[31mred"] {
        let e = checkpoints(&annotations(&[(PREEMPTION_ANNOTATION, v)])).expect_err(v);
        let msg = e.to_string();
        assert!(
            msg.starts_with("annotation tessera.io/preemption `")
                && msg.contains("the one value is `checkpoint`"),
            "{msg}"
        );
        assert!(!msg.contains('\u{1b}'), "escaped: {msg}");
    }
}

#[test]
fn half_a_gang_is_refused_naming_the_missing_annotation() {
    let e = gang_of(&annotations(&[(GANG_ANNOTATION, "g")])).expect_err("no size");
    let msg = e.to_string();
    assert!(msg.contains("tessera.io/gang-size is not"), "{msg}");
    let e = gang_of(&annotations(&[(GANG_SIZE_ANNOTATION, "2")])).expect_err("no name");
    let msg = e.to_string();
    assert!(
        msg.starts_with("annotation tessera.io/gang-size is set but tessera.io/gang is not"),
        "{msg}"
    );
}

#[test]
fn malformed_gang_names_and_sizes_are_refused_by_annotation() {
    let long = "g".repeat(254);
    for name in ["", ".hidden", "-opt", "a/b", "a b", "ü", "\u{1b}[31mred", long.as_str()] {
        let e = gang_of(&annotations(&[(GANG_ANNOTATION, name), (GANG_SIZE_ANNOTATION, "2")]))
            .expect_err(name);
        let msg = e.to_string();
        assert!(msg.starts_with("annotation tessera.io/gang `"), "{msg}");
        assert!(!msg.contains('\u{1b}') && msg.len() < 400, "escaped and bounded: {msg}");
    }
    let over = (MAX_GANG_SIZE + 1).to_string();
    for size in ["0", over.as_str(), "", "two", "+4", " 4", "4 ", "-1", "4.0", "99999999999999"] {
        let e = gang_of(&annotations(&[(GANG_ANNOTATION, "g"), (GANG_SIZE_ANNOTATION, size)]))
            .expect_err(size);
        let msg = e.to_string();
        assert!(msg.starts_with("annotation tessera.io/gang-size `"), "{size:?}: {msg}");
        assert!(msg.contains("from 1 to 1024"), "{msg}");
    }
}

// ---- leases -----------------------------------------------------------------------------

fn lease(path: &str, micro: u64) -> Lease {
    Lease { path: path.into(), amounts: Amounts::from_resources(&gpus(H100, micro)) }
}

/// acme guarantees 8 H100s; acme/ml 4 with a ceiling of 6; acme/ml/x/alice has a ceiling
/// of 1 only; acme/web only a ceiling.
fn leased_tree() -> QuotaTree {
    tree(json!({
        "acme": {"gpus": {H100: {"guarantee": 8}}},
        "acme/ml": {"gpus": {H100: {"guarantee": 4, "ceiling": 6}}},
        "acme/ml/x/alice": {"gpus": {H100: {"ceiling": 1}}},
        "acme/web": {"gpus": {H100: {"ceiling": 2}}},
    }))
}

#[test]
fn a_lease_that_covers_the_holdings_and_the_request_admits() {
    let t = leased_tree();
    let leases = [lease("acme", 3 * GPU), lease("acme/ml", 2 * GPU)];
    let here = vec![("acme/ml/y/bob".to_string(), gpus(H100, GPU))];
    assert_eq!(
        lease_admits(&t, "acme/ml/y/bob", &gpus(H100, GPU), HeldLeases::Valid(&leases), &here),
        Ok(())
    );
    // A resource no quota on the chain bounds (CPU here) does not need a lease.
    let with_cpu = gpus(H100, GPU).with_cpu_milli(4000);
    assert_eq!(
        lease_admits(&t, "acme/ml/y/bob", &with_cpu, HeldLeases::Valid(&leases), &here),
        Ok(())
    );
}

#[test]
fn a_lease_that_does_not_cover_names_the_path_and_the_amounts() {
    let t = leased_tree();
    let leases = [lease("acme", 8 * GPU), lease("acme/ml", 2 * GPU)];
    // Guaranteed work within acme/ml holds 1.5 GPUs here (bob's and a project's); work
    // outside it (acme/web) does not count against acme/ml's lease.
    let here = vec![
        ("acme/ml/y/bob".to_string(), gpus(H100, GPU)),
        ("acme/ml".to_string(), gpus(H100, GPU / 2)),
        ("acme/web/z/carol".to_string(), gpus(H100, 4 * GPU)),
    ];
    let e = lease_admits(&t, "acme/ml/y/bob", &gpus(H100, GPU), HeldLeases::Valid(&leases), &here)
        .expect_err("not covered");
    assert!(e.starts_with("quota path acme/ml:"), "{e}");
    assert!(e.contains("covers 2 H100-80GB GPUs"), "{e}");
    assert!(e.contains("holds 1.5 H100-80GB GPUs"), "{e}");
    assert!(e.contains("needs 1 H100-80GB GPUs more"), "{e}");
    // Half a GPU still fits.
    assert_eq!(
        lease_admits(&t, "acme/ml/y/bob", &gpus(H100, GPU / 2), HeldLeases::Valid(&leases), &here),
        Ok(())
    );
    // An ancestor's lease bounds too: acme's covers what all of acme holds here.
    let small_org = [lease("acme", 6 * GPU), lease("acme/ml", 4 * GPU)];
    let e =
        lease_admits(&t, "acme/ml/y/bob", &gpus(H100, GPU), HeldLeases::Valid(&small_org), &here)
            .expect_err("org lease full");
    assert!(e.starts_with("quota path acme:"), "{e}");
}

#[test]
fn no_lease_or_an_expired_one_admits_nothing() {
    let t = leased_tree();
    let r = gpus(H100, GPU);
    let e = lease_admits(&t, "acme/ml/y/bob", &r, HeldLeases::None, &[]).expect_err("none");
    assert_eq!(e, "this node holds no lease");
    let e = lease_admits(&t, "acme/ml/y/bob", &r, HeldLeases::Expired { ago_s: 12 }, &[])
        .expect_err("expired");
    assert_eq!(e, "this node's leases expired 12 s ago");
    // A lease for the team but none for the org it belongs to.
    let only_team = [lease("acme/ml", 4 * GPU)];
    let e = lease_admits(&t, "acme/ml/y/bob", &r, HeldLeases::Valid(&only_team), &[])
        .expect_err("no org lease");
    assert!(e.contains("no lease for quota path acme (gpu H100-80GB)"), "{e}");
}

#[test]
fn a_ceiling_only_quota_on_the_chain_or_no_quota_at_all_needs_the_coordinator() {
    let t = leased_tree();
    let leases = [lease("acme", 8 * GPU), lease("acme/ml", 4 * GPU)];
    // alice's own ceiling cannot be checked on one node.
    let e = lease_admits(&t, "acme/ml/x/alice", &gpus(H100, GPU), HeldLeases::Valid(&leases), &[])
        .expect_err("ceiling only");
    assert!(
        e.contains(
            "quota path acme/ml/x/alice bounds gpu H100-80GB with a ceiling and no guarantee"
        ),
        "{e}"
    );
    assert!(e.contains("quotas.acme/ml/x/alice.gpus.H100-80GB"), "{e}");
    // A tenant outside every quota only ever borrows.
    let e = lease_admits(&t, "other/t", &gpus(H100, GPU), HeldLeases::Valid(&leases), &[])
        .expect_err("no quota");
    assert!(e.contains("no quota on tenant other/t's chain guarantees"), "{e}");
    // A model no quota names is not guaranteed either.
    let e = lease_admits(&t, "acme/ml/y/bob", &gpus(A100, GPU), HeldLeases::Valid(&leases), &[])
        .expect_err("unquoted model");
    assert!(e.contains("borrowed"), "{e}");
}

#[test]
fn kept_leases_stay_in_force_only_for_what_is_left_of_their_lifetime() {
    let f = LeaseFile { leases: vec![lease("acme", GPU)], lease_ttl_s: 30, sent_ms: 1_000_000 };
    let now = Instant::now();
    let at = restored_expiry(&f, 1_010_000, now).expect("20 s left");
    assert_eq!(at.duration_since(now), Duration::from_secs(20));
    assert_eq!(restored_expiry(&f, 1_030_000, now), None, "expired exactly at the end");
    assert_eq!(restored_expiry(&f, 999_999, now), None, "a clock set back is not trusted");
    let huge = LeaseFile { lease_ttl_s: u64::MAX, sent_ms: u64::MAX - 5, ..f.clone() };
    assert_eq!(restored_expiry(&huge, u64::MAX - 4, now), None, "no overflow");

    let dir = tempfile::tempdir().expect("tempdir");
    let p = dir.path().join(LEASE_FILE);
    assert_eq!(load_leases(&p), Ok(None));
    store_leases(&p, &f).expect("store");
    assert_eq!(load_leases(&p), Ok(Some(f)));
    std::fs::write(&p, b"{\"leases\": [], \"lease_ttl_s\": 1, \"sent_ms\": 1, \"x\": 2}")
        .expect("write");
    let e = load_leases(&p).expect_err("unknown field");
    assert!(e.contains(&p.display().to_string()), "{e}");
}

// ---- victims ----------------------------------------------------------------------------

fn grant(id: &str, tenant: &str, class: Option<&str>) -> Allocation {
    let mut v = json!({
        "container_id": id, "tenant": tenant, "trust": "dev", "request": "gpu=1",
        "isolation": "gpu",
        "devices": [{"uuid": format!("GPU-{id}"), "gpu_uuid": format!("GPU-{id}"), "gpu_index": 0, "model": H100}],
        "injection": {"devices": [], "env": [], "mounts": []},
        "state": "running", "pid": 100, "created_ms": 0
    });
    if let Some(c) = class {
        v["quota"] = json!({"class": c, "gpus": {H100: GPU}});
    }
    serde_json::from_value(v).expect("an allocation")
}

fn victim(node: &str, id: &str, tenant: &str) -> Victim {
    Victim {
        node: node.into(),
        container_id: id.into(),
        tenant: tenant.into(),
        grace_s: 5,
        reason: "acme/a reclaims its guarantee".into(),
        requeue: String::new(),
    }
}

#[test]
fn only_this_nodes_borrowed_grants_of_the_named_tenant_are_stopped() {
    let grants = [
        grant("borrowed", "acme/b", Some("borrowed")),
        grant("guaranteed", "acme/b", Some("guaranteed")),
        grant("unmarked", "acme/b", None),
        grant("stopping", "acme/b", Some("borrowed")),
    ];
    let victims = [
        victim("n1", "borrowed", "acme/b"),
        victim("n1", "guaranteed", "acme/b"),
        victim("n1", "unmarked", "acme/b"),
        victim("n2", "elsewhere", "acme/b"),
        victim("n1", "gone", "acme/b"),
        victim("n1", "stopping", "acme/b"),
        victim("n1", "borrowed", "acme/b"),
    ];
    let stopping = BTreeSet::from(["stopping".to_string()]);
    let VictimsHere { stop, skip } = victims_here("n1", &victims, &grants, &stopping);
    let stopped: Vec<&str> = stop.iter().map(|(v, _)| v.container_id.as_str()).collect();
    assert_eq!(stopped, ["borrowed"], "a named guaranteed or unmarked grant is never stopped");
    let why: Vec<(&str, NotStopped)> =
        skip.into_iter().map(|(v, w)| (grant_id(&victims, &v), w)).collect();
    assert_eq!(
        why,
        [
            ("guaranteed", NotStopped::NotBorrowed),
            ("unmarked", NotStopped::NotBorrowed),
            ("elsewhere", NotStopped::OtherNode),
            ("gone", NotStopped::NoGrant),
            ("stopping", NotStopped::AlreadyStopping),
            ("borrowed", NotStopped::AlreadyStopping),
        ]
    );
}

fn grant_id<'a>(victims: &'a [Victim], v: &Victim) -> &'a str {
    victims
        .iter()
        .find(|x| x.container_id == v.container_id)
        .map_or("", |x| x.container_id.as_str())
}

#[test]
fn a_victim_naming_another_tenant_than_the_grants_is_not_stopped() {
    let grants = [grant("c", "acme/b", Some("borrowed"))];
    let VictimsHere { stop, skip } =
        victims_here("n1", &[victim("n1", "c", "acme/a")], &grants, &BTreeSet::new());
    assert!(stop.is_empty());
    assert_eq!(skip[0].1, NotStopped::OtherTenant { recorded: "acme/b".into() });
}

#[test]
fn borrowed_grants_are_metered_at_the_burst_price() {
    let borrowed = grant("b", "t", Some("borrowed"));
    let guaranteed = grant("g", "t", Some("guaranteed"));
    assert_eq!(ledger_class(borrowed.quota.as_deref()), metering::Class::Burst);
    assert_eq!(ledger_class(guaranteed.quota.as_deref()), metering::Class::Guaranteed);
    assert_eq!(ledger_class(None), metering::Class::Guaranteed);
    assert_eq!(held_devices(&borrowed), ["GPU-b"]);
}

#[tokio::test]
async fn lease_grants_are_unsynced_until_a_sync_after_them_is_answered() {
    let gate = QuotaGate::new(Authority::local("n"), None);
    assert!(!gate.unsynced_lease_grants());
    gate.note_lease_grant("listed");
    gate.note_lease_grant("released");
    let taken = Instant::now();
    gate.note_lease_grant("after");
    assert!(gate.unsynced_lease_grants());
    // The sync listed one; one was released before its snapshot; one came after it.
    gate.synced(taken, &BTreeSet::from(["listed"]));
    assert!(gate.unsynced_lease_grants(), "the grant after the snapshot is not synced yet");
    gate.synced(Instant::now(), &BTreeSet::new());
    assert!(!gate.unsynced_lease_grants());
}

#[tokio::test]
async fn a_lease_lifetime_past_any_clock_is_cut_never_overflowed() {
    let gate = QuotaGate::new(Authority::local("n"), None);
    let lease = Lease { path: "acme".into(), amounts: Amounts::default() };
    gate.renew(vec![lease], u64::MAX, Instant::now(), tessera_api::time::now_ms());
    assert_eq!(gate.leases().len(), 1, "in force, for at most MAX_LEASE_TTL");
}

// ---- limits a quota needs ------------------------------------------------------------------

#[test]
fn a_container_without_a_cpu_or_memory_limit_is_refused_where_its_chain_bounds_that() {
    let t = tree(json!({
        "acme/ml": {"cpu_cores": {"ceiling": 8}},
        "acme/ml/vision": {"memory_gib": {"guarantee": 16}},
        "acme/web": {"gpus": {H100: {"guarantee": 1}}},
    }));
    let none = ContainerLimits::default();
    let cpu_only = ContainerLimits { cpu_milli: Some(500), memory_mib: None };
    let both = ContainerLimits { cpu_milli: Some(500), memory_mib: Some(1024) };
    // CPU bounded at the team: no CPU limit is refused, naming the quota and the fix.
    let e = require_limits(&t, "acme/ml/train", &none).expect_err("no CPU limit");
    let msg = e.to_string();
    assert!(msg.starts_with("quota path acme/ml bounds CPU (quotas.acme/ml.cpu_cores)"), "{msg}");
    assert!(msg.contains("resources.limits.cpu"), "{msg}");
    // Its memory, bounded nowhere on its chain, is guaranteed to vision: a limit is needed.
    let e = require_limits(&t, "acme/ml/train", &cpu_only).expect_err("no memory limit");
    assert!(e.to_string().contains("guarantees memory (quotas.acme/ml/vision.memory_gib)"), "{e}");
    assert!(require_limits(&t, "acme/ml/train", &both).is_ok());
    // Memory bounded at the project too.
    let e = require_limits(&t, "acme/ml/vision/alice", &cpu_only).expect_err("no memory limit");
    assert!(e.to_string().contains("quotas.acme/ml/vision.memory_gib"), "{e}");
    assert!(require_limits(&t, "acme/ml/vision/alice", &both).is_ok());
    // A zero limit counts as none.
    let zero = ContainerLimits { cpu_milli: Some(0), memory_mib: Some(1024) };
    assert!(require_limits(&t, "acme/ml/vision/alice", &zero).is_err());
    // Nothing on web's chain bounds memory, but vision is guaranteed it: an unlimited
    // container would take vision's memory uncounted (issue 27, red team of b211bf2).
    let e = require_limits(&t, "acme/web/site", &none).expect_err("no memory limit");
    let msg = e.to_string();
    assert!(
        msg.starts_with(
            "quota path acme/ml/vision guarantees memory (quotas.acme/ml/vision.memory_gib)"
        ),
        "{msg}"
    );
    assert!(msg.contains("resources.limits.memory"), "{msg}");
    let mem_only = ContainerLimits { cpu_milli: None, memory_mib: Some(1024) };
    assert!(require_limits(&t, "acme/web/site", &mem_only).is_ok(), "CPU is guaranteed nowhere");
    assert!(require_limits(&t, "other", &mem_only).is_ok());
    // GPU-only quotas ask nothing of the container's limits.
    let gpu_only = tree(json!({"acme/web": {"gpus": {H100: {"guarantee": 1}}}}));
    assert!(require_limits(&gpu_only, "acme/web/site", &none).is_ok());
    assert!(require_limits(&gpu_only, "other", &none).is_ok());
}

// ---- red team of c8372df -------------------------------------------------------------------

/// While the coordinator is unreachable a node admits on its lease, as guaranteed, what
/// the coordinator's `quota::admit` classes borrowed since c8372df: a request asking for a
/// resource nothing on its chain bounds but another quota guarantees (memory here, which
/// tesserad now requires every such container to set). The grant is marked guaranteed and
/// `under_lease`, so no reclaim can take it back: the hole c8372df closes stays open
/// whenever the coordinator is away.
#[test]
fn a_lease_does_not_admit_as_guaranteed_what_the_coordinator_admits_borrowed() {
    let t = tree(json!({
        "acme": {"gpus": {H100: {"guarantee": 8}}},
        "acme/ml/vision": {"memory_gib": {"guarantee": 16}},
    }));
    let asks = gpus(H100, GPU).with_memory_mib(64 * 1024);
    let fleet = gpus(H100, 8 * GPU).with_memory_mib(1024 * 1024);
    assert!(
        matches!(
            quota::admit(&t, &fleet, &quota::Usage::new(), "acme/web/x", &asks),
            quota::Decision::Admit { class: quota::Class::Borrowed, .. }
        ),
        "the coordinator admits it borrowed"
    );
    let leases = [lease("acme", 8 * GPU)];
    assert!(
        lease_admits(&t, "acme/web/x", &asks, HeldLeases::Valid(&leases), &[]).is_err(),
        "admitted under the lease as guaranteed"
    );
}
