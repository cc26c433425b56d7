//! `tessera sim --scenario interference`: latency-sensitive services and bandwidth-heavy
//! batch jobs sharing MPS GPUs, run through the contention model
//! (`interference::contention`) twice — without the controller and with it (the same
//! `interference::Detector` and `Responder` tesserad runs) — side by side: the victims'
//! SLO-violation minutes and the GPU work served.
//!
//! A scenario (one seed of the family):
//! - 4 whole H100s shared through MPS and one H100 in MIG mode cut into three `2g.20gb`
//!   instances (where hardened services go).
//! - 6 latency-sensitive services (tenants `svc-0..5`), each an MPS share of 25%
//!   demanding 12-28% of the SMs and 10-25% of the memory bandwidth (so a `2g.20gb`
//!   instance, 2/7 of the SMs and 2/8 of the bandwidth, serves one at full speed). All
//!   start at t = 0; each instance runs 90-240 min, then the service starts again at once
//!   (a new instance).
//! - Batch jobs arriving as a Poisson process (8 an hour) from three tenants (`batch-0..2`),
//!   each 15-90 min of work: half memory-bound (an MPS share of 25%, 20-25% of the SMs,
//!   70-95% of the bandwidth), half compute-bound (25 or 50%, SMs up to their share, 5-20%
//!   of the bandwidth). A job that does not fit waits (FIFO).
//! - Placement as tesserad's MPS placement does: the most booked GPU that still fits
//!   (bookings are the shares' percentages, at most 100 per GPU); with the controller, not
//!   where an anti-affine tenant holds a share, and a hardened service's next instance on a
//!   free MIG instance.
//! - Every 10 s tick: each GPU divided by the model; a service below 90% of its solo
//!   throughput violates its SLO for that tick; the detector (confirm 3, clear 3,
//!   saturation 0.9) samples every shared GPU; the responder's steps are applied (throttle:
//!   the aggressor's cap; anti-affinity: the tenant pair; harden: the service's next
//!   instance; no stop step).
//!
//! Measured: SLO-violation minutes summed over the services; GPU work served = SM-seconds
//! used (achieved SM fraction × time, summed over every share); batch jobs completed.
//! It is a model (its assumptions: `interference::contention`, docs/GPU-HEALTH.md), never
//! the judge of the controller it drives: the end-to-end test does that.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use interference::contention::{device_activity, share_device, Demand, Load};
use interference::{Detector, DeviceSample, Responder, Settings, ShareSample, Step, Thresholds};
use serde::Serialize;

/// Seconds per tick.
pub const TICK_S: u64 = 10;
/// MPS GPUs and MIG instances of a scenario.
pub const MPS_GPUS: usize = 4;
pub const MIG_SLOTS: usize = 3;
/// The SLO: at least this fraction of solo throughput.
pub const SLO_SHARE: f64 = 0.9;

/// splitmix64.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }
}

/// One job: a service instance or a batch job.
#[derive(Debug, Clone)]
struct Job {
    id: String,
    tenant: String,
    latency: bool,
    /// Booked MPS percent.
    percent: u8,
    demand: Demand,
    arrive_s: u64,
    /// Service instances: how long it runs; batch: its work in seconds at its solo rate.
    length_s: f64,
    /// The service it is an instance of.
    service: Option<usize>,
}

/// A scenario: its jobs in arrival order (service instances are created as they end).
#[derive(Debug, Clone)]
pub struct Scenario {
    pub seed: u64,
    pub horizon_s: u64,
    services: Vec<(Demand, u8)>,
    batch: Vec<Job>,
    rng_state: u64,
}

/// One scenario of the family.
pub fn scenario(seed: u64, hours: u64) -> Scenario {
    let mut rng = Rng(seed.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ 0x6a09_e667);
    let horizon_s = hours * 3600;
    let services = (0..6)
        .map(|_| (Demand { sm: rng.range(0.12, 0.28), bw: rng.range(0.10, 0.25) }, 25u8))
        .collect();
    let mut batch = Vec::new();
    let mut t = 0.0;
    let mut n = 0;
    loop {
        t += -rng.unit().max(1e-12).ln() * 3600.0 / 8.0;
        if t >= horizon_s as f64 {
            break;
        }
        let memory_bound = rng.unit() < 0.5;
        let (percent, demand) = if memory_bound {
            (25, Demand { sm: rng.range(0.20, 0.25), bw: rng.range(0.70, 0.95) })
        } else {
            let p = if rng.unit() < 0.5 { 25 } else { 50 };
            (p, Demand { sm: rng.range(0.1, f64::from(p) / 100.0), bw: rng.range(0.05, 0.20) })
        };
        batch.push(Job {
            id: format!("job-{n}"),
            tenant: format!("batch-{}", n % 3),
            latency: false,
            percent,
            demand,
            arrive_s: t as u64,
            length_s: rng.range(15.0, 90.0) * 60.0,
            service: None,
        });
        n += 1;
    }
    Scenario { seed, horizon_s, services, batch, rng_state: rng.0 }
}

/// One run's results.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RunReport {
    pub controller: bool,
    /// Summed over the services.
    pub slo_violation_minutes: f64,
    /// SM-seconds used by every share.
    pub served_sm_seconds: f64,
    pub batch_completed: usize,
    pub batch_arrived: usize,
    pub incidents: usize,
    pub throttles: usize,
    pub anti_affinities: usize,
    pub hardened_starts: usize,
}

/// A placed job.
#[derive(Debug, Clone)]
struct Running {
    job: Job,
    /// MPS GPU index, or None on a MIG instance.
    gpu: Option<usize>,
    /// Its thread cap (fraction).
    cap: f64,
    /// Remaining: service seconds, or batch work seconds at solo rate.
    left: f64,
}

/// Run `s` without or with the controller.
pub fn run(s: &Scenario, controller: bool) -> RunReport {
    let mut rng = Rng(s.rng_state);
    let mut report = RunReport { controller, batch_arrived: s.batch.len(), ..RunReport::default() };
    let mut detector =
        Detector::new(Thresholds { min_share: SLO_SHARE, saturation: 0.9, confirm: 3, clear: 3 });
    let mut responder = Responder::new(Settings { stop_after: None, ..Settings::default() });
    let mut anti: BTreeSet<(String, String)> = BTreeSet::new();
    let mut hardened: BTreeSet<usize> = BTreeSet::new();
    let mut running: Vec<Running> = Vec::new();
    let mut waiting: VecDeque<Job> = VecDeque::new();
    let mut pending: VecDeque<Job> = s.batch.iter().cloned().collect();
    let mut instance = 0usize;
    // Every service's first instance at t = 0.
    for (i, (demand, percent)) in s.services.iter().enumerate() {
        waiting.push_back(service_job(i, *demand, *percent, 0, &mut rng, &mut instance));
    }
    let mut t = 0u64;
    while t < s.horizon_s {
        while pending.front().is_some_and(|j| j.arrive_s <= t) {
            if let Some(j) = pending.pop_front() {
                waiting.push_back(j);
            }
        }
        // Place what fits, in order (a service first: it has no queue of its own).
        let mut still = VecDeque::new();
        while let Some(job) = waiting.pop_front() {
            let hard = controller && job.service.is_some_and(|sv| hardened.contains(&sv));
            let mig_free = MIG_SLOTS - running.iter().filter(|r| r.gpu.is_none()).count();
            if hard && mig_free > 0 {
                report.hardened_starts += 1;
                if let Some(sv) = job.service {
                    hardened.remove(&sv);
                }
                running.push(Running { cap: 1.0, left: job.length_s, gpu: None, job });
                continue;
            }
            match pick(&running, &job, controller.then_some(&anti)) {
                Some(g) => {
                    let cap = f64::from(job.percent) / 100.0;
                    running.push(Running { gpu: Some(g), cap, left: job.length_s, job });
                }
                None => still.push_back(job),
            }
        }
        waiting = still;

        // Divide each GPU; count SLO violations and work; advance jobs.
        let mut samples = Vec::new();
        let mut rates: Vec<f64> = vec![0.0; running.len()];
        for g in 0..MPS_GPUS {
            let idx: Vec<usize> =
                (0..running.len()).filter(|&i| running[i].gpu == Some(g)).collect();
            if idx.is_empty() {
                continue;
            }
            let loads: Vec<Load> = idx
                .iter()
                .map(|&i| Load { demand: running[i].job.demand, cap: running[i].cap })
                .collect();
            let achieved = share_device(&loads);
            let (sm, bw) = device_activity(&achieved);
            let mut shares = Vec::new();
            for (&i, a) in idx.iter().zip(&achieved) {
                rates[i] = a.rate;
                report.served_sm_seconds += a.sm * TICK_S as f64;
                let r = &running[i];
                if r.job.latency && a.share_of_solo() < SLO_SHARE {
                    report.slo_violation_minutes += TICK_S as f64 / 60.0;
                }
                // Batch work is counted against its solo rate: alone it takes its length.
                shares.push(ShareSample {
                    id: r.job.id.clone(),
                    tenant: r.job.tenant.clone(),
                    latency: r.job.latency,
                    sm: a.sm,
                    bw: a.bw,
                    latency_ms: None,
                    booked: Some(f64::from(r.job.percent) / 100.0),
                });
                let _ = a.solo_rate;
            }
            samples.push(DeviceSample {
                device: format!("gpu{g}"),
                at_ms: t * 1000,
                sm,
                bw,
                shares,
            });
        }
        for (i, r) in running.iter().enumerate().filter(|(_, r)| r.gpu.is_none()) {
            // A 2g.20gb instance: 2/7 of the SMs and 2/8 of the bandwidth, alone.
            let rate = (2.0 / 7.0 / r.job.demand.sm).min(2.0 / 8.0 / r.job.demand.bw).min(1.0);
            rates[i] = rate;
            report.served_sm_seconds += r.job.demand.sm * rate * TICK_S as f64;
            if r.job.latency && rate < SLO_SHARE {
                report.slo_violation_minutes += TICK_S as f64 / 60.0;
            }
        }
        if controller {
            for sample in &samples {
                for f in detector.observe(sample) {
                    if matches!(f, interference::Finding::Opened(_)) {
                        report.incidents += 1;
                    }
                    let caps: BTreeMap<String, u8> = running
                        .iter()
                        .map(|r| (r.job.id.clone(), (r.cap * 100.0).round() as u8))
                        .collect();
                    for step in responder.steps(&f, |id| caps.get(id).copied()) {
                        match step {
                            Step::Throttle { incident, to_percent, .. } => {
                                if let Some(r) =
                                    running.iter_mut().find(|r| r.job.id == incident.aggressor)
                                {
                                    r.cap = f64::from(to_percent) / 100.0;
                                    report.throttles += 1;
                                }
                            }
                            Step::AntiAffinity { incident } => {
                                let mut p = [incident.victim_tenant, incident.aggressor_tenant];
                                p.sort();
                                let [a, b] = p;
                                if anti.insert((a, b)) {
                                    report.anti_affinities += 1;
                                }
                            }
                            Step::Harden { incident } => {
                                if let Some(sv) = running
                                    .iter()
                                    .find(|r| r.job.id == incident.victim)
                                    .and_then(|r| r.job.service)
                                {
                                    hardened.insert(sv);
                                }
                            }
                            Step::Stop { .. } => {}
                        }
                    }
                }
            }
        }
        // Advance; what ends leaves (a service starts again at once).
        let mut next = Vec::new();
        for (i, mut r) in running.into_iter().enumerate() {
            if r.job.latency {
                r.left -= TICK_S as f64;
            } else {
                let solo = interference::contention::solo_rate(&Load {
                    demand: r.job.demand,
                    cap: f64::from(r.job.percent) / 100.0,
                });
                r.left -= TICK_S as f64 * if solo > 0.0 { rates[i] / solo } else { 1.0 };
            }
            if r.left > 0.0 {
                next.push(r);
            } else if let Some(sv) = r.job.service {
                let (demand, percent) = s.services[sv];
                waiting.push_front(service_job(sv, demand, percent, t, &mut rng, &mut instance));
            } else {
                report.batch_completed += 1;
            }
        }
        running = next;
        t += TICK_S;
    }
    report
}

fn service_job(
    sv: usize,
    demand: Demand,
    percent: u8,
    at: u64,
    rng: &mut Rng,
    n: &mut usize,
) -> Job {
    *n += 1;
    Job {
        id: format!("svc-{sv}-{n}"),
        tenant: format!("svc-{sv}"),
        latency: true,
        percent,
        demand,
        arrive_s: at,
        length_s: rng.range(90.0, 240.0) * 60.0,
        service: Some(sv),
    }
}

/// The most booked MPS GPU that still fits `job` (none of an anti-affine tenant's).
fn pick(
    running: &[Running],
    job: &Job,
    anti: Option<&BTreeSet<(String, String)>>,
) -> Option<usize> {
    let booked = |g: usize| -> u32 {
        running.iter().filter(|r| r.gpu == Some(g)).map(|r| u32::from(r.job.percent)).sum()
    };
    let foe = |g: usize| {
        anti.is_some_and(|pairs| {
            running.iter().filter(|r| r.gpu == Some(g)).any(|r| {
                let mut p = [r.job.tenant.clone(), job.tenant.clone()];
                p.sort();
                let [a, b] = p;
                pairs.contains(&(a, b))
            })
        })
    };
    (0..MPS_GPUS)
        .filter(|&g| booked(g) + u32::from(job.percent) <= 100 && !foe(g))
        .max_by_key(|&g| (booked(g), std::cmp::Reverse(g)))
}

/// The family's results: each seed without and with the controller.
#[derive(Debug, Clone, Serialize)]
pub struct FamilyReport {
    pub hours: u64,
    pub runs: Vec<(u64, RunReport, RunReport)>,
}

impl FamilyReport {
    /// Totals over the seeds: (violation minutes without, with; served without, with).
    pub fn totals(&self) -> (f64, f64, f64, f64) {
        self.runs.iter().fold((0.0, 0.0, 0.0, 0.0), |acc, (_, a, b)| {
            (
                acc.0 + a.slo_violation_minutes,
                acc.1 + b.slo_violation_minutes,
                acc.2 + a.served_sm_seconds,
                acc.3 + b.served_sm_seconds,
            )
        })
    }
}

/// Seeds `1..=seeds` of `hours` each, without and with the controller.
pub fn family(seeds: u64, hours: u64) -> FamilyReport {
    let runs = (1..=seeds)
        .map(|seed| {
            let s = scenario(seed, hours);
            (seed, run(&s, false), run(&s, true))
        })
        .collect();
    FamilyReport { hours, runs }
}

/// The side-by-side table.
pub fn table(f: &FamilyReport) -> String {
    use std::fmt::Write as _;
    let mut out = format!(
        "interference scenario family: {} seeds x {} h; 4 MPS H100s + 3 MIG 2g.20gb; 6 latency services, batch 8/h (half memory-bound)\n",
        f.runs.len(),
        f.hours
    );
    let _ = writeln!(
        out,
        "| seed | SLO-violation min without | with | cut | SM-hours served without | with | kept | batch done without / with | incidents | throttles | anti-affinity | hardened starts |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|---|---|---|---|");
    let pct = |a: f64, b: f64| if a > 0.0 { format!("{:.1}%", b / a * 100.0) } else { "-".into() };
    for (seed, a, b) in &f.runs {
        let cut = if a.slo_violation_minutes > 0.0 {
            format!("{:.1}%", (1.0 - b.slo_violation_minutes / a.slo_violation_minutes) * 100.0)
        } else {
            "-".into()
        };
        let _ = writeln!(
            out,
            "| {seed} | {:.1} | {:.1} | {cut} | {:.2} | {:.2} | {} | {} / {} | {} | {} | {} | {} |",
            a.slo_violation_minutes,
            b.slo_violation_minutes,
            a.served_sm_seconds / 3600.0,
            b.served_sm_seconds / 3600.0,
            pct(a.served_sm_seconds, b.served_sm_seconds),
            a.batch_completed,
            b.batch_completed,
            b.incidents,
            b.throttles,
            b.anti_affinities,
            b.hardened_starts
        );
    }
    let (va, vb, sa, sb) = f.totals();
    let cut = if va > 0.0 { (1.0 - vb / va) * 100.0 } else { 0.0 };
    let _ = writeln!(
        out,
        "| all | {va:.1} | {vb:.1} | {cut:.1}% | {:.2} | {:.2} | {} | | | | | |",
        sa / 3600.0,
        sb / 3600.0,
        pct(sa, sb)
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The acceptance: on the family the controller cuts the services' SLO-violation
    /// minutes by at least 80% and keeps at least 95% of the work served without it.
    #[test]
    fn the_controller_cuts_violations_and_keeps_the_work() {
        let f = family(5, 8);
        let (va, vb, sa, sb) = f.totals();
        assert!(
            va > 60.0,
            "the family must interfere without the controller: {va} min\n{}",
            table(&f)
        );
        assert!(vb <= 0.2 * va, "violations cut by >= 80%: {va} -> {vb}\n{}", table(&f));
        assert!(sb >= 0.95 * sa, "work kept >= 95%: {sa} -> {sb}\n{}", table(&f));
        assert_eq!(family(5, 8).totals(), (va, vb, sa, sb), "seeded: the same every run");
    }
}
