//! `revoke-check`: the grants the policy in force would refuse now, and stopping them.
//!
//! A new policy governs new decisions only ([`Node::set_policy`]): grants made under an
//! older one keep running. This verb lists them — every recorded grant is put to the
//! policy in force again ([`refused`], pure: the recorded tenant, looked up by path in this
//! policy with the trust it gives it, and the recorded request, through
//! [`policy::Policy::authorize`] on this node) — and stops them on request ([`stop`]):
//! SIGTERM to the container's init, SIGKILL after a grace period if it still runs, each
//! signal only to the process the grant recorded (its pid *and* start time,
//! [`Host::signal`]). Nothing is released here: the grant goes the way of every grant,
//! when runc has removed the container (tessera-runtime's release after `delete`, or the
//! reconciler), so no device is handed on while a process of the container may still run.
//!
//! What is checked is the tenant a grant was made to, not the identity rules that chose
//! it: the annotations are not recorded with a grant, so a policy that maps the same
//! annotation value to another tenant does not show here.

use std::time::{Duration, Instant};

use policy::{Policy, Tenant};
use serde::{Deserialize, Serialize};
use tessera_api::cri::Workload;
use tessera_api::{untrusted, Allocation, AllocationState};
use tracing::warn;

use super::{internal, Node};
use crate::error::CoreError;
use crate::host::{Host, Signal};

/// Seconds between SIGTERM and SIGKILL when the request names none.
pub const DEFAULT_GRACE_S: u64 = 30;
/// The longest grace period a stop may ask for (the request waits for it).
pub const MAX_GRACE_S: u64 = 300;
/// How long a process may take to disappear after SIGKILL before the stop reports it alive.
const AFTER_KILL: Duration = Duration::from_secs(5);
/// How often the stop looks whether the signalled processes are gone.
const POLL: Duration = Duration::from_millis(100);

/// One grant the policy in force would refuse now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refused {
    pub container_id: String,
    /// The tenant path the grant was made to.
    pub tenant: String,
    /// The trust tier recorded with the grant (the policy's own may differ).
    pub trust: String,
    /// The request as granted (`gpu=1`, `mig=1g.10gb`, ...).
    pub request: String,
    pub state: AllocationState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<i32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload: Option<Workload>,
    /// The JSON path of the rule that refuses it (`tiers.untrusted.allow`, `orgs`, ...).
    pub rule: String,
    /// The refusal, as a new request would get it.
    pub message: String,
}

impl Refused {
    /// Grant `a`, refused by `rule` with `message`.
    pub(crate) fn of(a: &Allocation, rule: String, message: String) -> Refused {
        Refused {
            container_id: a.container_id.to_string(),
            tenant: a.tenant.to_string(),
            trust: a.trust.to_string(),
            request: a.request.to_string(),
            state: a.state,
            pid: a.pid,
            workload: a.workload.clone(),
            rule,
            message,
        }
    }
}

/// `GET /v1/revoke-check`: the answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RevokeCheck {
    pub policy_version: u64,
    pub policy_digest: String,
    pub policy_source: String,
    /// How many grants were checked.
    pub checked: usize,
    /// The grants the policy refuses, by container id.
    pub refused: Vec<Refused>,
}

/// `POST /v1/revoke-check/stop`: the request.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StopRequest {
    /// Seconds between SIGTERM and SIGKILL, 0 to [`MAX_GRACE_S`] (default
    /// [`DEFAULT_GRACE_S`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grace_s: Option<u64>,
    /// Stop only these containers; each must be refused now (else nothing is stopped).
    /// Empty: every refused grant.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub containers: Vec<String>,
}

/// What a stop did to one container.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum StopOutcome {
    /// Its init exited within the grace period after SIGTERM.
    Terminated,
    /// Its init still ran after the grace period and was sent SIGKILL; it is gone.
    Killed,
    /// Its init had exited before (or its pid names another process now): nothing sent.
    AlreadyGone,
    /// Not signalled: the container has not started, or its start time was not recorded.
    Skipped,
    /// A signal could not be sent, or the process outlived SIGKILL.
    Failed,
}

/// One container of a stop.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stopped {
    #[serde(flatten)]
    pub refused: Refused,
    pub outcome: StopOutcome,
    /// What happened, in words.
    pub detail: String,
}

/// `POST /v1/revoke-check/stop`: the answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StopReport {
    pub policy_version: u64,
    pub grace_s: u64,
    pub stopped: Vec<Stopped>,
}

/// The grants `policy` would refuse on node `node`, by container id: each grant's recorded
/// tenant and request through [`Policy::authorize`] (the tenant looked up by path, with the
/// trust this policy gives it; a tenant it no longer has is refused by rule `orgs`).
pub fn refused(policy: &Policy, node: &str, grants: &[Allocation]) -> Vec<Refused> {
    let mut out: Vec<Refused> = grants
        .iter()
        .filter_map(|a| {
            // The recorded trust only names the tier in a refusal of an unknown tenant:
            // `authorize` uses the policy's own trust for a tenant it has.
            let tenant = policy
                .tenant(&a.tenant)
                .unwrap_or_else(|| Tenant { path: a.tenant.clone(), trust: a.trust });
            let refusal = policy.authorize(&tenant, &a.request, node).err()?;
            Some(Refused::of(a, refusal.rule, refusal.message))
        })
        .collect();
    out.sort_by(|a, b| a.container_id.cmp(&b.container_id));
    out
}

/// A refused grant to stop, with what identifies its init.
#[derive(Debug, Clone)]
pub struct Target {
    pub refused: Refused,
    /// The recorded start time of `refused.pid`.
    pub pid_start: Option<u64>,
}

/// Why grants were stopped: the policy in force refuses them (`revoke-check --stop`), or
/// a quota reclaim took them (borrowed work).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopCause {
    Revoked,
    Preempted,
    /// The device is quarantined by an XID fault and the policy stops its holders.
    Fault,
    /// The aggressor of an interference the earlier steps did not end.
    Interference,
}

impl StopCause {
    /// The event kind recorded for each stop.
    pub fn event(self) -> &'static str {
        match self {
            StopCause::Revoked => "revoke",
            StopCause::Preempted => "preempt",
            StopCause::Fault => "xid",
            StopCause::Interference => "interference",
        }
    }

    /// The log line's words.
    fn what(self) -> &'static str {
        match self {
            StopCause::Revoked => "revoked grant",
            StopCause::Preempted => "preempted borrowed grant",
            StopCause::Fault => "stopped holder of a faulty device",
            StopCause::Interference => "stopped interfering grant",
        }
    }
}

/// What a stop signals, taken under the node lock and carried out without it ([`stop`]).
#[derive(Debug)]
pub struct StopPlan {
    pub targets: Vec<Target>,
    /// The host to signal through.
    pub host: std::sync::Arc<dyn Host>,
    pub policy_version: u64,
}

/// The stop's grace period: `grace_s` within `0..=MAX_GRACE_S`, or the default.
pub fn grace(req: &StopRequest) -> Result<Duration, CoreError> {
    match req.grace_s {
        None => Ok(Duration::from_secs(DEFAULT_GRACE_S)),
        Some(s) if s <= MAX_GRACE_S => Ok(Duration::from_secs(s)),
        Some(s) => Err(CoreError::bad_request(format!(
            "grace_s {s} is too long: at most {MAX_GRACE_S} seconds between SIGTERM and SIGKILL"
        ))),
    }
}

/// Stop `targets`: SIGTERM to each init, then wait up to `grace` for them to exit, then
/// SIGKILL to those still running (and up to 5 s for them to go). Every signal goes only
/// to the process with the recorded pid and start time ([`Host::signal`]). Blocking: run it
/// outside the node lock.
pub fn stop(host: &dyn Host, targets: Vec<Target>, grace: Duration) -> Vec<Stopped> {
    stop_polling(host, targets, grace, POLL, AFTER_KILL)
}

/// [`stop`], with its polling period and its wait after SIGKILL as parameters (tests).
fn stop_polling(
    host: &dyn Host,
    targets: Vec<Target>,
    grace: Duration,
    poll: Duration,
    after_kill: Duration,
) -> Vec<Stopped> {
    let done = |t: Target, outcome, detail: String| Stopped { refused: t.refused, outcome, detail };
    let mut out = Vec::new();
    let mut waiting: Vec<(Target, i32, u64)> = Vec::new();
    for t in targets {
        match (t.refused.state, t.refused.pid, t.pid_start) {
            (AllocationState::Pending, _, _) | (_, None, _) => out.push(done(
                t,
                StopOutcome::Skipped,
                "not started: no process to signal (its grant goes once runc no longer knows the container)"
                    .into(),
            )),
            (_, Some(pid), None) => out.push(done(
                t,
                StopOutcome::Skipped,
                format!(
                    "no start time recorded for pid {pid}: it cannot be told from a recycled pid, so it is not \
                     signalled (stop the container with its engine)"
                ),
            )),
            (_, Some(pid), Some(start)) => match host.signal(pid, start, Signal::Term) {
                Ok(true) => waiting.push((t, pid, start)),
                Ok(false) => out.push(done(
                    t,
                    StopOutcome::AlreadyGone,
                    format!("its init (pid {pid}) had exited already; nothing sent"),
                )),
                Err(e) => out.push(done(t, StopOutcome::Failed, format!("SIGTERM: {e}"))),
            },
        }
    }
    let t0 = Instant::now();
    let gone = |pid: i32, start: u64| host.pid_start_time(pid) != Some(start);
    loop {
        let (exited, left): (Vec<_>, Vec<_>) =
            waiting.into_iter().partition(|&(_, pid, start)| gone(pid, start));
        waiting = left;
        for (t, pid, _) in exited {
            let after = t0.elapsed().as_secs_f64();
            out.push(done(
                t,
                StopOutcome::Terminated,
                format!("its init (pid {pid}) exited {after:.1} s after SIGTERM"),
            ));
        }
        if waiting.is_empty() || t0.elapsed() >= grace {
            break;
        }
        std::thread::sleep(poll.min(grace.saturating_sub(t0.elapsed())));
    }
    let mut killed = Vec::new();
    for (t, pid, start) in waiting {
        match host.signal(pid, start, Signal::Kill) {
            Ok(true) => killed.push((t, pid, start)),
            Ok(false) => out.push(done(
                t,
                StopOutcome::Terminated,
                format!(
                    "its init (pid {pid}) exited at the end of the {} s grace period",
                    grace.as_secs()
                ),
            )),
            Err(e) => out.push(done(t, StopOutcome::Failed, format!("SIGKILL: {e}"))),
        }
    }
    let t1 = Instant::now();
    while !killed.is_empty() {
        let (exited, left): (Vec<_>, Vec<_>) =
            killed.into_iter().partition(|&(_, pid, start)| gone(pid, start));
        killed = left;
        for (t, pid, _) in exited {
            out.push(done(
                t,
                StopOutcome::Killed,
                format!(
                    "its init (pid {pid}) still ran {} s after SIGTERM: SIGKILL",
                    grace.as_secs()
                ),
            ));
        }
        if t1.elapsed() >= after_kill {
            for (t, pid, _) in killed.drain(..) {
                out.push(done(
                    t,
                    StopOutcome::Failed,
                    format!(
                        "its init (pid {pid}) still runs {:.1} s after SIGKILL",
                        after_kill.as_secs_f64()
                    ),
                ));
            }
            break;
        }
        if !killed.is_empty() {
            std::thread::sleep(poll);
        }
    }
    out.sort_by(|a, b| a.refused.container_id.cmp(&b.refused.container_id));
    out
}

impl Node {
    /// The grants the policy in force would refuse now ([`refused`]).
    pub fn revoke_check(&self) -> Result<RevokeCheck, CoreError> {
        let grants = self.allocations()?;
        Ok(RevokeCheck {
            policy_version: self.policy.policy.version(),
            policy_digest: self.policy.policy.digest(),
            policy_source: self.policy.source.clone(),
            checked: grants.len(),
            refused: refused(&self.policy.policy, &self.inventory.node, &grants),
        })
    }

    /// What a stop will signal: the refused grants (those `req` names, each of which must
    /// be refused now; all when it names none), each recorded as a `revoke` event before
    /// anything is sent.
    pub fn revoke_targets(&mut self, req: &StopRequest) -> Result<StopPlan, CoreError> {
        let grace = grace(req)?;
        let records = self.store.all().map_err(internal)?;
        let grants: Vec<Allocation> = records.iter().map(|r| r.allocation.clone()).collect();
        let refused = refused(&self.policy.policy, &self.inventory.node, &grants);
        let version = self.policy.policy.version();
        for id in &req.containers {
            if !grants.iter().any(|a| a.container_id == *id) {
                return Err(CoreError::not_found(format!(
                    "no grant for container {}; nothing stopped",
                    untrusted(id)
                )));
            }
            if !refused.iter().any(|r| r.container_id == *id) {
                return Err(CoreError::conflict(format!(
                    "policy version {version} allows the grant of container {}; nothing stopped",
                    untrusted(id)
                )));
            }
        }
        let targets: Vec<Target> = refused
            .into_iter()
            .filter(|r| req.containers.is_empty() || req.containers.contains(&r.container_id))
            .map(|r| {
                let pid_start = records
                    .iter()
                    .find(|rec| rec.allocation.container_id == r.container_id)
                    .and_then(|rec| rec.pid_start);
                Target { refused: r, pid_start }
            })
            .collect();
        for t in &targets {
            let detail = format!(
                "stopping: policy version {version} refuses it ({}): SIGTERM, SIGKILL after {} s",
                t.refused.rule,
                grace.as_secs()
            );
            if let Err(e) = self.store.event("revoke", Some(&t.refused.container_id), &detail) {
                warn!("cannot record a revocation: {e}");
            }
        }
        Ok(StopPlan { targets, host: self.host.clone(), policy_version: version })
    }

    /// Record what a stop did: one event per container (`revoke` or `preempt`, with the
    /// outcome) and a log line.
    pub fn record_stops(&mut self, cause: StopCause, stopped: &[Stopped]) {
        for s in stopped {
            let r = &s.refused;
            warn!(container = %r.container_id, tenant = %r.tenant, request = %r.request, rule = %r.rule,
                  outcome = ?s.outcome, "{}: {}", cause.what(), s.detail);
            let detail = format!("{:?}: {}", s.outcome, s.detail);
            if let Err(e) = self.store.event(cause.event(), Some(&r.container_id), &detail) {
                warn!("cannot record a stop ({}): {e}", cause.event());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};
    use std::sync::Mutex;

    use super::*;
    use crate::liveness::CgroupProcs;
    use tessera_api::ErrorCode;

    const POLICY: &[u8] = include_bytes!("../../../../examples/policy.json");

    fn policy_with(edit: impl FnOnce(&mut serde_json::Value)) -> Policy {
        let mut v: serde_json::Value = serde_json::from_slice(POLICY).expect("json");
        edit(&mut v);
        Policy::parse(&serde_json::to_vec(&v).expect("json"), "test.json").expect("policy")
    }

    fn grant(id: &str, tenant: &str, trust: &str, request: &str) -> Allocation {
        serde_json::from_value(serde_json::json!({
            "container_id": id, "tenant": tenant, "trust": trust, "request": request,
            "isolation": request.split('=').next().unwrap_or(request),
            "devices": [], "injection": {"devices": [], "env": [], "mounts": []},
            "state": "running", "pid": 100, "created_ms": 0
        }))
        .expect("an allocation")
    }

    fn ids(r: &[Refused]) -> Vec<&str> {
        r.iter().map(|r| r.container_id.as_str()).collect()
    }

    #[test]
    fn grants_the_policy_still_allows_are_not_listed() {
        let p = policy_with(|_| {});
        let grants = [
            grant("a", "acme/trusted/training/alice", "trusted", "gpu=1"),
            grant("b", "acme/dev/notebooks/bob", "dev", "shared"),
            grant("c", "acme/untrusted/sandbox/guest", "untrusted", "mig=1g.10gb"),
        ];
        assert_eq!(refused(&p, "h100-node", &grants), vec![]);
    }

    #[test]
    fn a_tier_that_no_longer_allows_the_isolation_refuses_by_its_rule() {
        let p = policy_with(|v| {
            v["version"] = 2.into();
            v["tiers"]["trusted"]["allow"] = serde_json::json!(["mig", "mps"]);
        });
        let grants = [
            grant("alice-gpu", "acme/trusted/training/alice", "trusted", "gpu=1"),
            grant("alice-mig", "acme/trusted/training/alice", "trusted", "mig=1g.10gb"),
            grant("bob-gpu", "acme/dev/notebooks/bob", "dev", "gpu=1"),
        ];
        let r = refused(&p, "h100-node", &grants);
        assert_eq!(ids(&r), ["alice-gpu"]);
        assert_eq!(r[0].rule, "tiers.trusted.allow");
        assert_eq!(
            (r[0].tenant.as_str(), r[0].request.as_str()),
            ("acme/trusted/training/alice", "gpu=1")
        );
        assert!(r[0].message.contains("may not use gpu isolation"), "{}", r[0].message);
        assert_eq!(r[0].pid, Some(100));
    }

    #[test]
    fn a_tenant_moved_to_a_lower_tier_is_judged_by_its_new_trust() {
        // Bob's team becomes untrusted: his time-sliced grant goes, his whole GPU stays.
        let p = policy_with(|v| v["orgs"]["acme"]["teams"]["dev"]["trust"] = "untrusted".into());
        let grants = [
            grant("bob-shared", "acme/dev/notebooks/bob", "dev", "shared"),
            grant("bob-gpu", "acme/dev/notebooks/bob", "dev", "gpu=1"),
        ];
        let r = refused(&p, "n", &grants);
        assert_eq!(ids(&r), ["bob-shared"]);
        assert_eq!(r[0].rule, "tiers.untrusted.allow");
        assert_eq!(r[0].trust, "dev", "the trust recorded with the grant is kept");
    }

    #[test]
    fn a_tenant_the_policy_no_longer_has_is_refused_by_orgs() {
        let p = policy_with(|v| {
            v["orgs"]["acme"]["teams"]["dev"]["projects"]
                .as_object_mut()
                .expect("projects")
                .remove("scratch");
            v["identity"][0]["map"].as_object_mut().expect("map").remove("team-scratch");
        });
        let r = refused(&p, "n", &[grant("dave", "acme/dev/scratch/dave", "dev", "gpu=1")]);
        assert_eq!(ids(&r), ["dave"]);
        assert_eq!(r[0].rule, "orgs");
    }

    #[test]
    fn a_node_pool_closed_to_the_tenant_refuses_by_its_pool() {
        let p = policy_with(|v| {
            v["node_pools"]["secure"] =
                serde_json::json!({"nodes": ["gpu-secure-*"], "tenants": ["acme/trusted"]});
        });
        let grants = [
            grant("bob", "acme/dev/notebooks/bob", "dev", "gpu=1"),
            grant("alice", "acme/trusted/training/alice", "trusted", "gpu=1"),
        ];
        assert_eq!(
            refused(&p, "gpu-other-1", &grants),
            vec![],
            "the pool does not cover this node"
        );
        let r = refused(&p, "gpu-secure-1", &grants);
        assert_eq!(ids(&r), ["bob"]);
        assert_eq!(r[0].rule, "node_pools.secure.tenants");
    }

    #[test]
    fn mps_shares_above_a_lowered_cap_are_refused() {
        let p = policy_with(|v| v["mps"] = serde_json::json!({"max_percent": 25}));
        let grants = [
            grant("small", "acme/trusted/training/alice", "trusted", "mps=25"),
            grant("big", "acme/trusted/training/alice", "trusted", "mps=50"),
        ];
        let r = refused(&p, "n", &grants);
        assert_eq!(ids(&r), ["big"]);
        assert_eq!(r[0].rule, "mps.max_percent");
    }

    #[test]
    fn grace_is_bounded() {
        assert_eq!(grace(&StopRequest::default()).expect("default"), Duration::from_secs(30));
        let at = |s| grace(&StopRequest { grace_s: Some(s), containers: vec![] });
        assert_eq!(at(0).expect("0"), Duration::ZERO);
        assert_eq!(at(MAX_GRACE_S).expect("max"), Duration::from_secs(MAX_GRACE_S));
        let e = at(MAX_GRACE_S + 1).expect_err("too long");
        assert_eq!(e.code(), ErrorCode::BadRequest);
        assert!(e.message().contains("at most 300"), "{}", e.message());
    }

    /// Processes in memory: pid -> (start, what it does on SIGTERM), and what was sent.
    #[derive(Debug, Default)]
    struct Procs {
        live: BTreeMap<i32, (u64, OnTerm)>,
        sent: Vec<(i32, Signal)>,
        /// SIGKILL fails for these pids (a kernel error).
        kill_fails: BTreeSet<i32>,
        /// These survive SIGKILL (a process stuck in the kernel).
        unkillable: BTreeSet<i32>,
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum OnTerm {
        Exit,
        Ignore,
    }

    #[derive(Debug, Default)]
    struct FakeHost(Mutex<Procs>);

    impl Host for FakeHost {
        fn pid_start_time(&self, pid: i32) -> Option<u64> {
            self.0.lock().expect("lock").live.get(&pid).map(|p| p.0)
        }
        fn container_processes(&self, _init: Option<i32>, _cg: Option<&str>) -> BTreeSet<u32> {
            BTreeSet::new()
        }
        fn container_cgroup(&self, _pid: i32) -> Result<String, String> {
            Err("none".into())
        }
        fn cgroup_procs(&self, _rel: &str) -> CgroupProcs {
            CgroupProcs::NotRecorded
        }
        fn watches_exits(&self) -> bool {
            false
        }
        fn container_mounts(
            &self,
            _pid: i32,
            _bundle: &std::path::Path,
            _created: bool,
        ) -> Result<Vec<tessera_api::mountinfo::MountEntry>, String> {
            Ok(Vec::new())
        }
        fn shared_namespaces(&self, _pid: i32) -> Result<Vec<&'static str>, String> {
            Ok(Vec::new())
        }
        fn pid_namespace(&self, _pid: i32) -> Option<String> {
            None
        }
        fn host_mounts(&self) -> Result<Vec<tessera_api::mountinfo::MountEntry>, String> {
            Ok(Vec::new())
        }
        fn procfs_shows(
            &self,
            _pid: i32,
            _bundle: &std::path::Path,
            _created: bool,
            _mount_point: &str,
        ) -> Option<String> {
            None
        }
        fn cgroup_intruders(&self, _rel: &str, _init: i32) -> Vec<(i32, u64)> {
            Vec::new()
        }
        fn signal(&self, pid: i32, start: u64, signal: Signal) -> Result<bool, String> {
            let mut p = self.0.lock().expect("lock");
            if p.live.get(&pid).map(|x| x.0) != Some(start) {
                return Ok(false);
            }
            if signal == Signal::Kill && p.kill_fails.contains(&pid) {
                return Err("EPERM".into());
            }
            p.sent.push((pid, signal));
            let on_term = p.live[&pid].1;
            match signal {
                Signal::Term if on_term == OnTerm::Exit => {
                    p.live.remove(&pid);
                }
                Signal::Kill if !p.unkillable.contains(&pid) => {
                    p.live.remove(&pid);
                }
                _ => {}
            }
            Ok(true)
        }
    }

    fn target(id: &str, pid: Option<i32>, start: Option<u64>, state: AllocationState) -> Target {
        let mut a = grant(id, "acme/trusted/training/alice", "trusted", "gpu=1");
        a.pid = pid;
        a.state = state;
        let p = policy_with(|v| v["tiers"]["trusted"]["allow"] = serde_json::json!(["mig"]));
        let refused = refused(&p, "n", &[a]).pop().expect("refused");
        Target { refused, pid_start: start }
    }

    fn outcomes(s: &[Stopped]) -> Vec<(&str, StopOutcome)> {
        s.iter().map(|s| (s.refused.container_id.as_str(), s.outcome)).collect()
    }

    #[test]
    fn a_stop_terms_then_kills_only_what_outlives_the_grace_and_only_the_recorded_process() {
        let host = FakeHost::default();
        {
            let mut p = host.0.lock().expect("lock");
            p.live.insert(10, (1000, OnTerm::Exit));
            p.live.insert(11, (1100, OnTerm::Ignore));
            // Pid 12 was recycled: another process has it now.
            p.live.insert(12, (9999, OnTerm::Exit));
            p.live.insert(14, (1400, OnTerm::Ignore));
        }
        let running = AllocationState::Running;
        let targets = vec![
            target("polite", Some(10), Some(1000), running),
            target("stubborn", Some(11), Some(1100), running),
            target("recycled", Some(12), Some(1200), running),
            target("pending", None, None, AllocationState::Pending),
            target("unrecorded", Some(14), None, running),
        ];
        let t0 = Instant::now();
        let out = stop_polling(
            &host,
            targets,
            Duration::from_millis(300),
            Duration::from_millis(10),
            Duration::from_secs(5),
        );
        let took = t0.elapsed();
        assert_eq!(
            outcomes(&out),
            [
                ("pending", StopOutcome::Skipped),
                ("polite", StopOutcome::Terminated),
                ("recycled", StopOutcome::AlreadyGone),
                ("stubborn", StopOutcome::Killed),
                ("unrecorded", StopOutcome::Skipped),
            ]
        );
        let p = host.0.lock().expect("lock");
        assert_eq!(p.sent, [(10, Signal::Term), (11, Signal::Term), (11, Signal::Kill)]);
        assert!(p.live.contains_key(&12) && p.live.contains_key(&14), "never signalled");
        assert!(took >= Duration::from_millis(300), "SIGKILL only after the grace: {took:?}");
        assert!(took < Duration::from_secs(3), "{took:?}");
    }

    #[test]
    fn a_stop_where_everything_exits_at_sigterm_does_not_wait_for_the_grace() {
        let host = FakeHost::default();
        host.0.lock().expect("lock").live.insert(10, (1, OnTerm::Exit));
        let t0 = Instant::now();
        let out = stop(
            &host,
            vec![target("a", Some(10), Some(1), AllocationState::Running)],
            Duration::from_secs(MAX_GRACE_S),
        );
        assert_eq!(outcomes(&out), [("a", StopOutcome::Terminated)]);
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    }

    #[test]
    fn failures_to_kill_are_reported_not_hidden() {
        let host = FakeHost::default();
        {
            let mut p = host.0.lock().expect("lock");
            p.live.insert(20, (1, OnTerm::Ignore));
            p.live.insert(21, (1, OnTerm::Ignore));
            p.kill_fails.insert(20);
            p.unkillable.insert(21);
        }
        let running = AllocationState::Running;
        let out = stop_polling(
            &host,
            vec![
                target("eperm", Some(20), Some(1), running),
                target("stuck", Some(21), Some(1), running),
            ],
            Duration::ZERO,
            Duration::from_millis(50),
            Duration::from_millis(200),
        );
        assert_eq!(
            outcomes(&out),
            [("eperm", StopOutcome::Failed), ("stuck", StopOutcome::Failed)]
        );
        assert!(out[0].detail.contains("SIGKILL: EPERM"), "{}", out[0].detail);
        assert!(out[1].detail.contains("after SIGKILL"), "{}", out[1].detail);
    }
}
