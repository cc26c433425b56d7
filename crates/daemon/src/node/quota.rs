//! Fleet quotas, the node's state of them ([`crate::quota_gate`] has the protocol): devices held
//! for a reclaim's claimant, the holdings a sync reports, the containers a reclaim stops.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use fleet::quota_wire::{Holding, SyncRequest, Victim};
use tessera_api::{Allocation, QuotaClass};
use tracing::{debug, warn};

use super::revoke::{Refused, Stopped, Target};
use super::{internal, Node};
use crate::error::CoreError;
use crate::quota_gate::{self, NotStopped};

/// A device kept for a reclaim's claimant: other tenants' plans treat it as taken until
/// `until`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceHold {
    pub tenant: String,
    pub until: Instant,
}

/// What a reclaim stops on this node: taken under the lock, carried out without it.
#[derive(Debug)]
pub struct PreemptPlan {
    /// Grace period → the containers stopped with it.
    pub groups: Vec<(Duration, Vec<Target>)>,
    /// Container → its recorded cgroup (how a stop tells that nothing of it runs on).
    pub cgroups: std::collections::BTreeMap<String, String>,
    pub host: std::sync::Arc<dyn crate::host::Host>,
}

/// How long, after its init is gone, a stopped victim's cgroup may take to empty before
/// its grant is left to the usual release (the other processes of its pid namespace are
/// killed by the kernel with its init).
pub const EMPTY_WAIT: Duration = Duration::from_secs(5);

/// The stopped victims whose cgroup holds no process now, waiting up to `wait` (polling
/// every `poll`) for them to empty: only those whose init is known to be gone, and that
/// have a recorded cgroup. Blocking: call without the node lock.
pub fn emptied(
    host: &dyn crate::host::Host,
    stopped: &[Stopped],
    cgroups: &std::collections::BTreeMap<String, String>,
    wait: Duration,
    poll: Duration,
) -> Vec<String> {
    use super::revoke::StopOutcome as O;
    let mut left: Vec<(&str, &str)> = stopped
        .iter()
        .filter(|s| matches!(s.outcome, O::Terminated | O::Killed | O::AlreadyGone))
        .filter_map(|s| {
            let id = s.refused.container_id.as_str();
            cgroups.get(id).map(|cg| (id, cg.as_str()))
        })
        .collect();
    let mut out = Vec::new();
    let t0 = Instant::now();
    loop {
        left.retain(|(id, cg)| {
            let empty = matches!(host.cgroup_procs(cg), crate::liveness::CgroupProcs::Count(0));
            if empty {
                out.push((*id).to_string());
            }
            !empty
        });
        if left.is_empty() || t0.elapsed() >= wait {
            break;
        }
        std::thread::sleep(poll);
    }
    out.sort();
    out
}

impl PreemptPlan {
    /// The containers of the plan.
    pub fn containers(&self) -> Vec<String> {
        self.groups
            .iter()
            .flat_map(|(_, t)| t.iter().map(|t| t.refused.container_id.clone()))
            .collect()
    }
}

impl Node {
    /// Devices held for a tenant other than `tenant`, now.
    pub(super) fn held_for_others(&self, tenant: &str) -> BTreeSet<String> {
        let now = Instant::now();
        self.quota_holds
            .iter()
            .filter(|(_, h)| h.tenant != tenant && h.until > now)
            .map(|(u, _)| u.clone())
            .collect()
    }

    /// Why `uuid` is held, for a refusal.
    pub(super) fn hold_detail(&self, uuid: &str) -> Option<String> {
        let h = self.quota_holds.get(uuid).filter(|h| h.until > Instant::now())?;
        let left = h.until.saturating_duration_since(Instant::now()).as_secs();
        Some(format!("held for tenant {} after a quota reclaim (for {left} s more)", h.tenant))
    }

    /// Keep `devices` for `tenant` until `until`; expired holds are dropped.
    pub(crate) fn hold_devices(&mut self, tenant: &str, devices: &[String], until: Instant) {
        let now = Instant::now();
        self.quota_holds.retain(|_, h| h.until > now);
        for d in devices {
            self.quota_holds.insert(d.clone(), DeviceHold { tenant: tenant.to_string(), until });
        }
    }

    /// A grant of `tenant` took `devices`: their holds for it are done.
    pub(super) fn holds_used(&mut self, tenant: &str, devices: &[String]) {
        for d in devices {
            if self.quota_holds.get(d).is_some_and(|h| h.tenant == tenant) {
                self.quota_holds.remove(d);
            }
        }
    }

    /// The containers whose marked grants were released since the last call (for the
    /// coordinator's `quota/release`).
    pub(crate) fn take_quota_released(&mut self) -> Vec<String> {
        std::mem::take(&mut self.quota_released)
    }

    /// This node's guaranteed holdings, by tenant.
    pub(super) fn guaranteed_here(&self) -> Result<Vec<(String, ::quota::Resources)>, CoreError> {
        Ok(self
            .allocations()?
            .into_iter()
            .filter_map(|a| {
                let m = a.quota.as_ref().filter(|m| m.class == QuotaClass::Guaranteed)?;
                Some((a.tenant.into_string(), quota_gate::mark_amounts(m).to_resources()))
            })
            .collect())
    }

    /// What a sync reports: the node's capacity and every marked grant (the leases are the
    /// gate's to add); `None` under a policy without quotas (nothing to sync).
    pub(crate) fn quota_snapshot(&self) -> Result<Option<SyncRequest>, CoreError> {
        if !self.policy.policy.has_quotas() {
            return Ok(None);
        }
        let holdings = self
            .allocations()?
            .into_iter()
            .filter_map(|a| {
                let m = a.quota.as_ref()?;
                Some(Holding {
                    container_id: a.container_id.to_string(),
                    tenant: a.tenant.to_string(),
                    amounts: quota_gate::mark_amounts(m),
                    class: m.class,
                    started_ms: a.created_ms,
                    gang: m.gang.clone(),
                    workload: a.workload.as_ref().map(|w| w.display_name()),
                    under_lease: m.under_lease,
                    checkpoint: m.checkpoint,
                })
            })
            .collect();
        Ok(Some(SyncRequest {
            capacity: quota_gate::capacity(&self.inventory),
            holdings,
            leases: Vec::new(),
            stopping: Vec::new(),
            last_authority: None,
        }))
    }

    /// What stopping `victims` means on this node: only this node's borrowed grants of the
    /// tenant each names and not being stopped already ([`quota_gate::victims_here`]; the
    /// others are logged and left alone). Each is recorded as a `preempt` event before
    /// anything is sent; with `hold_for`, the devices they hold are kept for that tenant
    /// until the given time.
    pub(crate) fn preempt_targets(
        &mut self,
        node: &str,
        victims: &[Victim],
        stopping: &BTreeSet<String>,
        hold_for: Option<(&str, Instant)>,
    ) -> Result<PreemptPlan, CoreError> {
        let records = self.store.all().map_err(internal)?;
        let grants: Vec<Allocation> = records.iter().map(|r| r.allocation.clone()).collect();
        let quota_gate::VictimsHere { stop, skip } =
            quota_gate::victims_here(node, victims, &grants, stopping);
        for (v, why) in skip {
            match why {
                NotStopped::OtherNode => {
                    debug!(container = %v.container_id, node = %v.node, "reclaim victim on another node")
                }
                NotStopped::AlreadyStopping => {
                    debug!(container = %v.container_id, "reclaim victim already being stopped")
                }
                NotStopped::NoGrant => {
                    warn!(container = %v.container_id, "the coordinator named a reclaim victim this node holds no grant for; ignored")
                }
                NotStopped::NotBorrowed => warn!(container = %v.container_id, tenant = %v.tenant,
                    "the coordinator named a reclaim victim that is not borrowed work on this node; ignored: only borrowed grants are stopped for a reclaim"),
                NotStopped::OtherTenant { recorded } => {
                    warn!(container = %v.container_id, named = %v.tenant, recorded = %recorded,
                    "the coordinator named a reclaim victim of another tenant than the grant's; ignored")
                }
            }
        }
        let mut groups: Vec<(Duration, Vec<Target>)> = Vec::new();
        let mut held = Vec::new();
        for (v, a) in stop {
            let grace = Duration::from_secs(v.grace_s.min(::quota::MAX_GRACE_PERIOD_S));
            let requeue = if v.requeue.is_empty() {
                String::new()
            } else {
                format!("; requeue: {}", tessera_api::untrusted(&v.requeue).max_chars(512))
            };
            let detail = format!(
                "stopping borrowed work for a quota reclaim: {}: SIGTERM, SIGKILL after {} s{requeue}",
                tessera_api::untrusted(&v.reason).max_chars(512),
                grace.as_secs()
            );
            if let Err(e) = self.store.event("preempt", Some(&a.container_id), &detail) {
                warn!("cannot record a preemption: {e}");
            }
            // Its ledger intervals: work lost to preemption (`billing.preempted`).
            if let Err(e) = self.ledger.mark_preempted(&a.container_id) {
                warn!(container = %a.container_id, "cannot mark its intervals preempted: {e}");
            }
            held.extend(quota_gate::held_devices(&a));
            let pid_start = records
                .iter()
                .find(|r| r.allocation.container_id == a.container_id)
                .and_then(|r| r.pid_start);
            let target =
                Target { refused: Refused::of(&a, "quotas".into(), v.reason.clone()), pid_start };
            match groups.iter_mut().find(|(g, _)| *g == grace) {
                Some((_, ts)) => ts.push(target),
                None => groups.push((grace, vec![target])),
            }
        }
        if let Some((tenant, until)) = hold_for {
            self.hold_devices(tenant, &held, until);
        }
        let cgroups = records
            .iter()
            .filter(|r| {
                groups.iter().any(|(_, ts)| {
                    ts.iter().any(|t| t.refused.container_id == r.allocation.container_id)
                })
            })
            .filter_map(|r| r.cgroup.clone().map(|cg| (r.allocation.container_id.to_string(), cg)))
            .collect();
        Ok(PreemptPlan { groups, cgroups, host: self.host.clone() })
    }

    /// Give back the grants of stopped victims whose cgroup is empty (checked again here,
    /// under the lock): a reclaim's claimant must not wait for the victim's engine to
    /// delete a container that runs nothing. (A revocation waits for that instead: there
    /// is nobody to give the devices to.) Returns the containers released.
    pub(crate) fn release_preempted(&mut self, ids: &[String]) -> Vec<String> {
        let mut out = Vec::new();
        for id in ids {
            let rec = match self.store.get(id) {
                Ok(Some(r)) => r,
                Ok(None) => continue,
                Err(e) => {
                    warn!(container = %id, "cannot read a preempted grant: {e}");
                    continue;
                }
            };
            let borrowed =
                rec.allocation.quota.as_ref().is_some_and(|m| m.class == QuotaClass::Borrowed);
            let empty = rec.cgroup.as_deref().is_some_and(|cg| {
                matches!(self.host.cgroup_procs(cg), crate::liveness::CgroupProcs::Count(0))
            });
            if !(borrowed && empty) {
                continue;
            }
            let why = "preempted for a quota reclaim: no process of it runs";
            match self.drop_allocation(id, why) {
                Ok(_) => {
                    if let Err(e) =
                        self.store.event("preempt", Some(id), &format!("released: {why}"))
                    {
                        warn!("cannot record a preemption: {e}");
                    }
                    out.push(id.clone());
                }
                Err(e) => {
                    warn!(container = %id, "releasing a preempted grant failed: {}", e.message())
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::Path;
    use std::sync::Arc;

    use fleet::quota_wire::{Amounts, GangRef, Lease};
    use tessera_api::{AllocateRequest, ContainerLimits, ErrorCode, QuotaMark, RequestSource};

    use super::*;
    use crate::node::{ActivePolicy, Admission, NodeParts, Prepared, QuotaMode};
    use crate::quota_gate::QuotaGate;

    const POLICY: &[u8] = include_bytes!("../../../../examples/policy.json");
    const H100: &str = "H100-80GB";
    const GPU: u64 = ::quota::MICRO_PER_GPU;
    const ALICE: &str = "acme/trusted/training/alice";
    const BOB: &str = "acme/dev/notebooks/bob";

    fn repo(p: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(p)
    }

    /// The example policy; with `quotas`, acme/trusted guarantees 2 H100s and acme/dev 1
    /// (ceiling 5).
    fn node(state: &Path, quotas: bool) -> Node {
        node_on(state, quotas, Arc::new(crate::LinuxHost))
    }

    /// [`node`] on `host`; acme/dev's borrowed work gets a grace period of 1 s.
    fn node_on(state: &Path, quotas: bool, host: Arc<dyn crate::host::Host>) -> Node {
        node_weighing(state, quotas, host, None)
    }

    /// [`node_on`], with the policy's `mig_weights` set to `weights` when given.
    fn node_weighing(
        state: &Path,
        quotas: bool,
        host: Arc<dyn crate::host::Host>,
        weights: Option<serde_json::Value>,
    ) -> Node {
        let mut v: serde_json::Value = serde_json::from_slice(POLICY).expect("json");
        if let Some(w) = weights {
            v["mig_weights"] = w;
        }
        if quotas {
            v["quotas"] = serde_json::json!({
                "acme/trusted": {"gpus": {H100: {"guarantee": 2}}},
                "acme/dev": {"gpus": {H100: {"guarantee": 1, "ceiling": 5}}, "grace_period_s": 1},
            });
        }
        let policy = policy::Policy::parse(&serde_json::to_vec(&v).expect("json"), "test.json")
            .expect("policy");
        let backend =
            slicer::SimBackend::open(&repo("examples/nodes/h100x8.json"), state).expect("sim");
        let control = mpsd::ProcessControl::new("/nonexistent/nvidia-cuda-mps-control");
        Node::new(NodeParts {
            backend: Box::new(backend),
            policy: ActivePolicy { policy, source: "test".into() },
            store: crate::store::Store::open(&state.join("state.db")).expect("store"),
            ledger: metering::Ledger::open(
                &state.join("ledger.db"),
                Arc::new(metering::SystemClock),
            )
            .expect("ledger"),
            mps: Arc::new(mpsd::Supervisor::new(Arc::new(control), state.to_path_buf())),
            host,
            pending_grace: Duration::from_secs(60),
            dynamic_mig: false,
            scrub: crate::node::ScrubSetup { exe: "/nonexistent/tessera".into(), sim_faults: None },
        })
        .expect("node")
    }

    fn req(id: &str, ns: &str, request: &str) -> AllocateRequest {
        AllocateRequest {
            container_id: tessera_api::ContainerId::new(id).expect("id"),
            runc_root: "/run/tessera-test-runc".into(),
            bundle: format!("/b/{id}"),
            request: request.parse().expect("request"),
            request_source: RequestSource::Annotation,
            annotations: BTreeMap::from([(
                "io.kubernetes.cri.sandbox-namespace".to_string(),
                ns.to_string(),
            )]),
            limits: None,
        }
    }

    fn ask(n: &mut Node, r: &AllocateRequest) -> Box<crate::node::allocate::QuotaAsk> {
        match n.prepare_allocate(r, QuotaMode::On).expect("prepared") {
            Prepared::Ask(a) => a,
            Prepared::Granted(a) => panic!("granted without asking: {a:?}"),
        }
    }

    fn kinds(n: &Node) -> Vec<(String, String)> {
        n.store
            .recent_events(50)
            .expect("events")
            .into_iter()
            .map(|e| (e.kind, e.container_id.unwrap_or_default()))
            .collect()
    }

    #[test]
    fn a_grant_under_quotas_asks_first_and_then_carries_its_mark() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut n = node(dir.path(), true);
        let mut r = req("c1", "team-dev", "gpu=2");
        r.annotations.insert(tessera_api::GANG_ANNOTATION.into(), "g1".into());
        r.annotations.insert(tessera_api::GANG_SIZE_ANNOTATION.into(), "2".into());
        r.limits = Some(ContainerLimits { cpu_milli: Some(1500), memory_mib: Some(1024) });
        let a = ask(&mut n, &r);
        assert_eq!(a.admit.tenant, BOB);
        assert_eq!(
            a.admit.amounts,
            Amounts {
                gpus: BTreeMap::from([(H100.to_string(), 2 * GPU)]),
                cpu_milli: 1500,
                memory_mib: 1024
            }
        );
        assert_eq!(a.admit.gang, Some(GangRef { name: "g1".into(), size: 2 }));
        assert!(!a.admit.short_on_node && a.no_capacity.is_none());
        assert!(n.allocations().expect("list").is_empty(), "nothing granted before the answer");

        let over = "quota path acme/dev, gpu H100-80GB".to_string();
        let admitted = Admission::Fleet { class: QuotaClass::Borrowed, over: Some(over.clone()) };
        let g = n.finish_allocate(&r, &a.admit, &admitted).expect("granted");
        assert_eq!(
            g.quota,
            Some(Box::new(QuotaMark {
                class: QuotaClass::Borrowed,
                over: Some(over),
                under_lease: false,
                gpus: BTreeMap::from([(H100.to_string(), 2 * GPU)]),
                cpu_milli: 1500,
                memory_mib: 1024,
                gang: Some("g1".into()),
                checkpoint: false,
            }))
        );
        assert!(kinds(&n).contains(&("borrow".into(), "c1".into())), "{:?}", kinds(&n));
        // A retry is the same grant, asked nothing.
        assert!(matches!(
            n.prepare_allocate(&r, QuotaMode::On),
            Ok(Prepared::Granted(x)) if *x == g
        ));
        // The sync reports it as borrowed, with what it counts as.
        let snap = n.quota_snapshot().expect("snapshot").expect("quotas on");
        assert_eq!(snap.holdings.len(), 1);
        let h = &snap.holdings[0];
        assert_eq!(
            (h.container_id.as_str(), h.class),
            ("c1", fleet::quota_wire::QuotaClass::Borrowed)
        );
        assert_eq!((h.gang.as_deref(), h.amounts.cpu_milli), (Some("g1"), 1500));
        assert_eq!(snap.capacity.gpus[H100], 8 * GPU, "every GPU of the node, whole");
        // Its release is reported to the coordinator once.
        assert!(n.release("c1", "test").expect("released"));
        assert_eq!(n.take_quota_released(), ["c1"]);
        assert!(n.take_quota_released().is_empty());
    }

    #[test]
    fn without_quotas_the_gate_grants_at_once_and_marks_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut n = node(dir.path(), false);
        let r = req("c1", "team-dev", "gpu=1");
        match n.prepare_allocate(&r, QuotaMode::On).expect("granted") {
            Prepared::Granted(a) => assert_eq!(a.quota, None),
            Prepared::Ask(a) => panic!("asked: {a:?}"),
        }
        assert_eq!(n.quota_snapshot().expect("snapshot"), None, "no quotas, no sync");
        assert!(n.release("c1", "test").expect("released"));
        assert!(n.take_quota_released().is_empty(), "an unmarked grant is not the books'");
    }

    #[test]
    fn malformed_gang_annotations_are_refused_and_recorded() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut n = node(dir.path(), true);
        let mut r = req("c1", "team-dev", "gpu=1");
        r.annotations.insert(tessera_api::GANG_ANNOTATION.into(), "g1".into());
        let e = n.prepare_allocate(&r, QuotaMode::On).expect_err("refused");
        assert_eq!((e.code(), e.rule()), (ErrorCode::BadRequest, Some("gang")));
        assert!(e.message().contains("tessera.io/gang-size"), "{}", e.message());
        assert!(kinds(&n).contains(&("refuse".into(), "c1".into())));
    }

    #[test]
    fn a_node_without_room_asks_short_on_node() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut n = node(dir.path(), true);
        // The 5 whole GPUs of the node.
        n.allocate(&req("full", "team-research", "gpu=5")).expect("fills the node");
        let r = req("c1", "team-trusted", "gpu=1");
        let a = ask(&mut n, &r);
        assert!(a.admit.short_on_node);
        assert_eq!(a.admit.amounts.gpus[H100], GPU, "counted on the node's model");
        assert_eq!(a.no_capacity.as_ref().map(|e| e.code()), Some(ErrorCode::NoCapacity));
        // A MIG profile no GPU here has: the node's own refusal, nothing asked.
        let e = n
            .prepare_allocate(&req("c2", "team-trusted", "mig=1g.5gb"), QuotaMode::On)
            .expect_err("never here");
        assert_eq!(e.code(), ErrorCode::NoCapacity);
        assert!(kinds(&n).contains(&("refuse".into(), "c2".into())));
    }

    #[test]
    fn a_reclaim_stops_only_borrowed_work_and_holds_the_devices_for_the_claimant() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut n = node(dir.path(), true);
        for (id, class) in
            [("borrowed", QuotaClass::Borrowed), ("guaranteed", QuotaClass::Guaranteed)]
        {
            let r = req(id, "team-dev", "gpu=1");
            let a = ask(&mut n, &r);
            n.finish_allocate(&r, &a.admit, &Admission::Fleet { class, over: None })
                .expect("granted");
        }
        let victim = |id: &str| Victim {
            node: "sim-h100-0".into(),
            container_id: id.into(),
            tenant: BOB.into(),
            grace_s: 7,
            reason: format!("{ALICE} reclaims its guarantee of 2 H100-80GB GPUs"),
            requeue: String::new(),
        };
        let until = Instant::now() + Duration::from_secs(60);
        let plan = n
            .preempt_targets(
                "sim-h100-0",
                &[victim("borrowed"), victim("guaranteed")],
                &BTreeSet::new(),
                Some((ALICE, until)),
            )
            .expect("plan");
        assert_eq!(plan.containers(), ["borrowed"], "a named guaranteed grant is never stopped");
        assert_eq!(plan.groups[0].0, Duration::from_secs(7));
        assert!(kinds(&n).contains(&("preempt".into(), "borrowed".into())));
        assert!(!kinds(&n).iter().any(|(k, c)| k == "preempt" && c == "guaranteed"));
        let held: Vec<String> = n.quota_holds.keys().cloned().collect();
        let borrowed_dev = n.allocation("borrowed").expect("grant").devices[0].uuid.clone();
        assert_eq!(held, [borrowed_dev]);

        // Holds on the free GPUs too: another tenant's plan treats them as taken, naming
        // why; the claimant's takes one, and its hold is done.
        let free: Vec<String> = n
            .inventory
            .gpus
            .iter()
            .filter(|g| !g.mig_enabled)
            .map(|g| g.uuid.clone())
            .filter(|u| !n.store.claimed().expect("claims").contains(u))
            .collect();
        assert_eq!(free.len(), 3);
        n.hold_devices(ALICE, &free, until);
        let e = n.allocate(&req("dave", "team-scratch", "gpu=1")).expect_err("held");
        assert_eq!(e.code(), ErrorCode::NoCapacity);
        assert!(e.message().contains(&format!("held for tenant {ALICE}")), "{}", e.message());
        let r = req("alice", "team-trusted", "gpu=1");
        let a = ask(&mut n, &r);
        let g = n
            .finish_allocate(
                &r,
                &a.admit,
                &Admission::Fleet { class: QuotaClass::Guaranteed, over: None },
            )
            .expect("the claimant gets it");
        assert!(free.iter().any(|u| u == g.devices[0].uuid.as_str()));
        assert!(!n.quota_holds.contains_key(g.devices[0].uuid.as_str()), "used: no longer held");
    }

    /// A gate whose coordinator is never reached here (the lease alone decides), holding a
    /// lease of 1 GPU for acme/trusted for a minute.
    fn gate_with_a_lease_of_one_gpu() -> Arc<QuotaGate> {
        let one_gpu =
            Amounts { gpus: BTreeMap::from([(H100.to_string(), GPU)]), ..Amounts::default() };
        QuotaGate::out_of_reach(vec![Lease { path: "acme/trusted".into(), amounts: one_gpu }])
    }

    /// The coordinator unreachable: `gate`'s lease decides.
    fn under_lease(gate: &QuotaGate) -> Admission<'_> {
        Admission::Lease {
            leases: gate,
            since_ms: tessera_api::time::now_ms(),
            why: "connection refused".into(),
        }
    }

    #[tokio::test]
    async fn under_a_lease_only_guaranteed_work_it_covers_is_admitted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut n = node(dir.path(), true);
        let gate = gate_with_a_lease_of_one_gpu();
        let lease_admission = under_lease(&gate);

        let r = req("a1", "team-trusted", "gpu=1");
        let a = ask(&mut n, &r);
        let g = n.finish_allocate(&r, &a.admit, &lease_admission).expect("within the lease");
        let mark = g.quota.expect("marked");
        assert_eq!((mark.class, mark.under_lease), (QuotaClass::Guaranteed, true));

        // The lease is used up: a second GPU waits for the coordinator.
        let r = req("a2", "team-trusted", "gpu=1");
        let a = ask(&mut n, &r);
        let e = n.finish_allocate(&r, &a.admit, &lease_admission).expect_err("beyond the lease");
        assert_eq!((e.code(), e.rule()), (ErrorCode::Refused, Some("quotas")));
        assert!(
            e.message().contains("the quota coordinator is unreachable since"),
            "{}",
            e.message()
        );
        assert!(e.message().contains("connection refused"), "{}", e.message());
        assert!(
            e.message()
                .contains("quota path acme/trusted: this node's lease covers 1 H100-80GB GPUs"),
            "{}",
            e.message()
        );
        assert!(kinds(&n).contains(&("refuse".into(), "a2".into())));
        assert!(n.allocation("a2").is_err(), "nothing granted");

        // A team with a guarantee but no lease on this node: refused, naming the path.
        let r = req("b1", "team-dev", "gpu=1");
        let a = ask(&mut n, &r);
        let e = n.finish_allocate(&r, &a.admit, &lease_admission).expect_err("no lease");
        assert!(e.message().contains("no lease for quota path acme/dev"), "{}", e.message());
    }

    /// An ask of the coordinator still in flight (a gang member waiting for its gang, say)
    /// may be counted by the books within this node's lease: a grant under the lease made
    /// meanwhile counts it as held, so the lease is not taken twice.
    #[tokio::test]
    async fn under_a_lease_an_ask_still_in_flight_counts_as_held() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut n = node(dir.path(), true);
        let gate = gate_with_a_lease_of_one_gpu();
        let lease_admission = under_lease(&gate);

        // A member of 1 GPU of a team within acme/trusted asked the coordinator and waits.
        let member = req("m1", "team-trusted", "gpu=1");
        let asked = ask(&mut n, &member);
        let in_flight = gate.asking("m1", &asked.admit.tenant, &asked.admit.amounts);
        let r = req("a1", "team-trusted", "gpu=1");
        let a = ask(&mut n, &r);
        let e = n
            .finish_allocate(&r, &a.admit, &lease_admission)
            .expect_err("the lease is the member's while its ask is in flight");
        assert_eq!((e.code(), e.rule()), (ErrorCode::Refused, Some("quotas")));
        assert!(
            e.message().contains("guaranteed work within it holds 1 H100-80GB GPUs here"),
            "{}",
            e.message()
        );
        assert!(n.allocation("a1").is_err(), "nothing granted");
        assert!(!gate.unsynced_lease_grants(), "nothing granted, nothing marked unsynced");
        // Its own ask does not count against itself, and once settled the ask counts no more.
        assert!(gate.asked_here("m1").is_empty());
        drop(in_flight);
        let g = n.finish_allocate(&r, &a.admit, &lease_admission).expect("the member gave up");
        assert!(g.quota.expect("marked").under_lease);
    }

    /// An ask that registers while a grant under the lease is being committed (after that
    /// grant's decision read what was in flight) says a lease grant is unsynced: the books
    /// do not count it within this node's lease, which the grant did not count it against.
    #[tokio::test]
    async fn an_ask_during_a_lease_grant_says_a_lease_grant_is_unsynced() {
        use std::sync::atomic::{AtomicU8, Ordering};
        /// 0: not run; 1: the ask said no lease grant was unsynced; 2: it said one was.
        static SEEN: AtomicU8 = AtomicU8::new(0);
        let dir = tempfile::tempdir().expect("tempdir");
        let mut n = node(dir.path(), true);
        let gate = gate_with_a_lease_of_one_gpu();
        let lease_admission = under_lease(&gate);
        // A member of 1 GPU of a team within acme/trusted asks the coordinator (which
        // answers it) while a1's grant under the lease is being committed.
        fn member_asks(gate: &QuotaGate) {
            let amounts =
                Amounts { gpus: BTreeMap::from([(H100.to_string(), GPU)]), ..Amounts::default() };
            let _in_flight = gate.asking("m1", "team-trusted", &amounts);
            let flag = gate.unsynced_lease_grants();
            SEEN.store(if flag { 2 } else { 1 }, Ordering::SeqCst);
        }
        *gate.while_committing.lock().expect("hook") = Some(member_asks);
        let r = req("a1", "team-trusted", "gpu=1");
        let a = ask(&mut n, &r);
        let g = n.finish_allocate(&r, &a.admit, &lease_admission).expect("within the lease");
        assert!(g.quota.expect("marked").under_lease);
        assert_eq!(
            SEEN.load(Ordering::SeqCst),
            2,
            "the member's ask, not counted by a1's grant under the lease, said no lease \
             grant was unsynced (the books may count it within the lease: taken twice)"
        );
        assert!(gate.unsynced_lease_grants(), "a1 is unsynced");
    }

    /// The controller with the node's own books (no coordinator): guarantees, borrowing,
    /// the ceiling, and a reclaim that stops borrowed work and holds its devices for the
    /// claimant, whose retry gets them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_node_without_a_coordinator_is_its_own_fleet() {
        use crate::controller::{Action, Controller, Outcome};
        let dir = tempfile::tempdir().expect("tempdir");
        let ctl = Controller::new(node(dir.path(), true));
        let gate = QuotaGate::new(crate::quota_gate::Authority::local("sim-h100-0"), None);
        ctl.set_quota(gate.clone());
        let grant = |id: &str, ns: &str, request: &str| {
            let r = ctl.apply(Action::Allocate { req: req(id, ns, request), requester: None });
            // Grants a millisecond apart: "youngest" is well defined.
            std::thread::sleep(Duration::from_millis(3));
            match r {
                Ok(Outcome::Allocation(a)) => Ok(*a),
                Ok(other) => panic!("{other:?}"),
                Err(e) => Err(e),
            }
        };
        let class = |a: &tessera_api::Allocation| a.quota.as_ref().map(|m| m.class);
        let b1 = grant("b1", "team-dev", "gpu=1").expect("within acme/dev's guarantee");
        assert_eq!(class(&b1), Some(QuotaClass::Guaranteed));
        let b2 = grant("b2", "team-dev", "gpu=1").expect("borrowed");
        assert_eq!(class(&b2), Some(QuotaClass::Borrowed));
        assert!(b2
            .quota
            .as_ref()
            .and_then(|m| m.over.as_deref())
            .is_some_and(|o| o.contains("acme/dev")));
        let b3 = grant("b3", "team-dev", "gpu=3").expect("borrowed up to the ceiling");
        assert_eq!(class(&b3), Some(QuotaClass::Borrowed));
        let e = grant("b4", "team-dev", "gpu=1").expect_err("the ceiling");
        assert_eq!(e.code(), ErrorCode::Refused, "{e:?}");
        assert_eq!(e.rule(), Some("quotas.acme/dev.gpus.H100-80GB.ceiling"), "{e:?}");

        // Alice, within her guarantee, on a node whose whole GPUs bob holds.
        let e = grant("a1", "team-trusted", "gpu=1").expect_err("reclaiming");
        assert_eq!(e.code(), ErrorCode::Reclaiming, "{e:?}");
        assert!(e.message().contains("retry after"), "{}", e.message());
        // Asked again at once (tessera-runtime holding the create open): the same answer,
        // recorded once (each record is a synced write).
        let again = grant("a1", "team-trusted", "gpu=1").expect_err("still reclaiming");
        assert_eq!(again.code(), ErrorCode::Reclaiming, "{again:?}");
        let events = ctl.locked(|n| Ok(kinds(n))).expect("events");
        let refused_a1 = events.iter().filter(|(k, c)| k == "refuse" && c == "a1").count();
        assert_eq!(refused_a1, 1, "{events:?}");
        // One `preempt` event when the stop starts, one with what it did.
        let victims: Vec<String> = events
            .iter()
            .filter(|(k, _)| k == "preempt")
            .map(|(_, c)| c.clone())
            .collect::<BTreeSet<String>>()
            .into_iter()
            .collect();
        assert!(!victims.is_empty(), "{events:?}");
        assert!(victims.iter().all(|v| v == "b2" || v == "b3"), "only borrowed work: {victims:?}");
        // The victims never started (no process to signal); runc removed them: released.
        // Their devices are cleaned (no scrubber here) and held for alice.
        let freed: Vec<String> = ctl
            .locked(|n| {
                let mut freed = Vec::new();
                for v in &victims {
                    freed.extend(crate::quota_gate::held_devices(&n.allocation(v)?));
                    n.release(v, "test: the victim's container is gone")?;
                }
                for d in &freed {
                    n.set_state(d, &scrub::DeviceState::Free, None)?;
                }
                Ok(freed)
            })
            .expect("released");
        // The stop threads are done once the stopping set is empty.
        for _ in 0..200 {
            if gate.stopping().is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        ctl.apply(Action::Reconcile).expect("reconcile reports the releases");
        // Someone else cannot take what is held for alice.
        let e = grant("d1", "team-scratch", "gpu=1").expect_err("held");
        assert!(e.message().contains(&format!("held for tenant {ALICE}")), "{e:?}");
        let a1 = grant("a1", "team-trusted", "gpu=1").expect("the retry is granted");
        assert_eq!(class(&a1), Some(QuotaClass::Guaranteed));
        assert!(freed.iter().any(|u| u == a1.devices[0].uuid.as_str()), "on a freed device");
    }

    /// Issue 24: the quota gate counted a MIG grant as compute slices / 7 while the ledger
    /// billed it with the policy's `mig_weights` (docs/QUOTAS.md says they agree). A
    /// weighted 1g.10gb now counts in the books exactly what its interval bills.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_weighted_mig_grant_counts_in_the_quota_gate_what_the_ledger_bills() {
        use crate::controller::{Action, Controller, Outcome};
        let dir = tempfile::tempdir().expect("tempdir");
        let (proc_root, cgroup_root) = (dir.path().join("proc"), dir.path().join("cgroup"));
        let host =
            crate::TreeHost { proc_root: proc_root.clone(), cgroup_root: cgroup_root.clone() };
        let weights = serde_json::json!({"1g.10gb": 0.25});
        let ctl = Controller::new(node_weighing(
            &dir.path().join("state"),
            true,
            Arc::new(host),
            Some(weights),
        ));
        ctl.set_quota(QuotaGate::new(crate::quota_gate::Authority::local("sim-h100-0"), None));
        let a = match ctl
            .apply(Action::Allocate { req: req("m1", "team-dev", "mig=1g.10gb"), requester: None })
        {
            Ok(Outcome::Allocation(a)) => *a,
            other => panic!("{other:?}"),
        };
        let counted = a.quota.as_ref().and_then(|m| m.gpus.get(H100).copied());
        // Its container starts (a fixture process alone in its cgroup): metering opens.
        let pid = 4343;
        let p = proc_root.join(pid.to_string());
        std::fs::create_dir_all(&p).expect("mkdir");
        std::fs::write(
            p.join("stat"),
            format!("{pid} (sh) S 1 {pid} {pid} 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 5 1000 10"),
        )
        .expect("stat");
        std::fs::write(p.join("cgroup"), "5:devices:/c/m1\n0::/\n").expect("cgroup");
        let cg = cgroup_root.join("devices/c/m1");
        std::fs::create_dir_all(&cg).expect("mkdir");
        std::fs::write(cg.join("cgroup.procs"), format!("{pid}\n")).expect("procs");
        let start = tessera_api::StartRequest { pid, bundle: "/b/m1".into(), created: false };
        ctl.apply(Action::Start { container_id: "m1".parse().expect("valid"), req: start })
            .expect("started");
        let billed = ctl
            .locked(|n| n.intervals())
            .expect("intervals")
            .iter()
            .find(|r| r.start.container_id == "m1")
            .map(|r| r.start.fraction)
            .expect("an open interval");
        assert_eq!(billed, 0.25, "the ledger bills the policy's weight");
        assert_eq!(counted, ::quota::gpu_micro(billed), "the books count what is billed");
    }

    /// A victim that ignores SIGTERM is killed after its quota path's grace period, and
    /// once nothing of it runs (its cgroup is empty) its grant is given back at once,
    /// without waiting for its engine to delete the stopped container; the claimant's
    /// retry gets the device.
    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_stopped_victim_whose_processes_are_gone_gives_its_grant_back() {
        use crate::controller::{Action, Controller, Outcome};
        let dir = tempfile::tempdir().expect("tempdir");
        let (proc_root, cgroup_root) = (dir.path().join("proc"), dir.path().join("cgroup"));
        let host =
            crate::TreeHost { proc_root: proc_root.clone(), cgroup_root: cgroup_root.clone() };
        let state = dir.path().join("state");
        let ctl = Controller::new(node_on(&state, true, Arc::new(host)));
        let gate = QuotaGate::new(crate::quota_gate::Authority::local("sim-h100-0"), None);
        ctl.set_quota(gate.clone());
        let allocate = |id: &str, ns: &str, request: &str| match ctl
            .apply(Action::Allocate { req: req(id, ns, request), requester: None })
        {
            Ok(Outcome::Allocation(a)) => Ok(*a),
            Ok(other) => panic!("{other:?}"),
            Err(e) => Err(e),
        };
        // A process of container b2: pid 4242 in cgroup /c/b2, ignoring SIGTERM.
        let pid = 4242;
        let p = proc_root.join(pid.to_string());
        std::fs::create_dir_all(&p).expect("mkdir");
        std::fs::write(
            p.join("stat"),
            format!(
                "{pid} (sh) S 1 {pid} {pid} 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10"
            ),
        )
        .expect("stat");
        std::fs::write(p.join("cgroup"), "5:devices:/c/b2\n0::/\n").expect("cgroup");
        let cg = cgroup_root.join("devices/c/b2");
        std::fs::create_dir_all(&cg).expect("mkdir");
        std::fs::write(cg.join("cgroup.procs"), format!("{pid}\n")).expect("procs");

        let b1 = allocate("b1", "team-dev", "gpu=1").expect("guaranteed");
        assert_eq!(b1.quota.as_ref().map(|m| m.class), Some(QuotaClass::Guaranteed));
        std::thread::sleep(Duration::from_millis(3));
        let b2 = allocate("b2", "team-dev", "gpu=4").expect("borrowed: the rest of the node");
        assert_eq!(b2.quota.as_ref().map(|m| m.class), Some(QuotaClass::Borrowed));
        let start = tessera_api::StartRequest { pid, bundle: "/b/b2".into(), created: false };
        ctl.apply(Action::Start { container_id: "b2".parse().expect("valid"), req: start })
            .expect("started");

        let e = allocate("a1", "team-trusted", "gpu=1").expect_err("reclaiming");
        assert_eq!(e.code(), ErrorCode::Reclaiming, "{e:?}");
        // The kernel's part: once SIGKILL took the init, its cgroup empties.
        let t0 = Instant::now();
        while p.exists() {
            assert!(t0.elapsed() < Duration::from_secs(10), "never killed");
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(t0.elapsed() >= Duration::from_millis(500), "SIGKILL only after the grace period");
        std::fs::write(cg.join("cgroup.procs"), "").expect("empty");
        let t0 = Instant::now();
        while !gate.stopping().is_empty() {
            assert!(t0.elapsed() < Duration::from_secs(10), "the stop never ended");
            std::thread::sleep(Duration::from_millis(20));
        }
        let (held, events) = ctl
            .locked(|n| {
                Ok((n.allocation("b2").is_ok(), n.store.recent_events(50).expect("events")))
            })
            .expect("read");
        assert!(!held, "the victim's grant is given back");
        let details: Vec<String> = events
            .iter()
            .filter(|e| e.kind == "preempt" && e.container_id.as_deref() == Some("b2"))
            .map(|e| e.detail.clone())
            .collect();
        assert!(details.iter().any(|d| d.starts_with("Killed:")), "{details:?}");
        assert!(details.iter().any(|d| d.starts_with("released: preempted")), "{details:?}");
        assert!(ctl.locked(|n| n.allocation("b1")).is_ok(), "guaranteed work untouched");

        // Scrubbed (no scrubber here), then the claimant's retry gets one of them.
        let freed: Vec<String> = b2.devices.iter().map(|d| d.uuid.to_string()).collect();
        ctl.locked(|n| {
            for d in &freed {
                n.set_state(d, &scrub::DeviceState::Free, None)?;
            }
            Ok(())
        })
        .expect("cleaned");
        let a1 = allocate("a1", "team-trusted", "gpu=1").expect("the retry is granted");
        assert!(freed.iter().any(|u| u == a1.devices[0].uuid.as_str()));
    }
}
