//! Usage reports: clip intervals to a window, roll them up the tenant tree, price them.
//!
//! All of it is a pure function of the interval spans and the bill's terms
//! ([`aggregate`], [`crate::bill`]); the ledger only
//! reads the spans out of SQLite. Amounts are summed as integers of millionths
//! (micro-GPU-seconds, micro-currency), each interval rounded once, so every level's
//! total is exactly the sum of its children and the same query gives byte-identical
//! output.

use std::collections::BTreeMap;
use std::fmt;
use std::fmt::Write as _;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::bill::{Mode, Preempted, Terms};
use crate::error::LedgerError;
use crate::idle::Suggestion;
use crate::interval::Class;
pub use crate::span::Span;

/// The level of the tenant tree a report groups by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GroupBy {
    Org,
    Team,
    Project,
    User,
    Container,
    /// The Kubernetes namespace of a pod container (`-`: not a pod's).
    Namespace,
    /// `namespace/pod` of a pod container (`-`: not a pod's).
    Pod,
}

/// The group of intervals that belong to no pod, by namespace or pod.
pub const NOT_A_POD: &str = "-";

impl GroupBy {
    /// Every level: the tenant tree root first, the container, then the pod view.
    pub const ALL: [GroupBy; 7] = [
        GroupBy::Org,
        GroupBy::Team,
        GroupBy::Project,
        GroupBy::User,
        GroupBy::Container,
        GroupBy::Namespace,
        GroupBy::Pod,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            GroupBy::Org => "org",
            GroupBy::Team => "team",
            GroupBy::Project => "project",
            GroupBy::User => "user",
            GroupBy::Container => "container",
            GroupBy::Namespace => "namespace",
            GroupBy::Pod => "pod",
        }
    }

    /// How many tenant segments a group key at this level keeps (`None`: the container).
    fn depth(self) -> Option<usize> {
        match self {
            GroupBy::Org => Some(1),
            GroupBy::Team => Some(2),
            GroupBy::Project => Some(3),
            GroupBy::User => Some(4),
            GroupBy::Container | GroupBy::Namespace | GroupBy::Pod => None,
        }
    }

    /// The group an interval of `tenant` / `container_id` falls in at this level. A tenant
    /// path shorter than the level groups under its own path (`acme/ml` by user is
    /// `acme/ml`).
    pub fn key(self, tenant: &str, container_id: &str) -> String {
        match self.depth() {
            Some(d) => tenant_prefix(tenant, d).to_string(),
            None => container_id.to_string(),
        }
    }

    /// The group a span falls in at this level: [`GroupBy::key`] for the tenant levels and
    /// the container, the pod's namespace or `namespace/pod` for the pod view.
    pub fn key_of(self, s: &Span) -> String {
        match (self, &s.workload) {
            (GroupBy::Namespace, Some(w)) => w.namespace.clone(),
            (GroupBy::Pod, Some(w)) => w.pod_name(),
            (GroupBy::Namespace | GroupBy::Pod, None) => NOT_A_POD.to_string(),
            _ => self.key(&s.tenant, &s.container_id),
        }
    }
}

impl fmt::Display for GroupBy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for GroupBy {
    type Err = LedgerError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        GroupBy::ALL.into_iter().find(|g| g.as_str() == s).ok_or_else(|| {
            LedgerError::BadQuery(format!(
                "unknown grouping `{}`: expected org, team, project, user, container, namespace or pod",
                tessera_api::untrusted(s)
            ))
        })
    }
}

/// The first `depth` segments of a tenant path (all of it when it is shorter).
fn tenant_prefix(tenant: &str, depth: usize) -> &str {
    match tenant.match_indices('/').nth(depth.saturating_sub(1)) {
        Some((i, _)) if depth > 0 => &tenant[..i],
        _ => tenant,
    }
}

/// Prices of one GPU model, per GPU-hour (a whole-GPU-hour; a fraction pays pro rata).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rate {
    /// Floors (each path's own guarantee, used or not) and guaranteed work no floor covers.
    pub reserved_per_gpu_hour: f64,
    /// Borrowed ([`Class::Burst`]) work, by consumption.
    pub burst_per_gpu_hour: f64,
    /// Added per GPU-hour of a multi-GPU grant inside one NVLink domain.
    #[serde(default)]
    pub nvlink_premium_per_gpu_hour: f64,
}

impl Rate {
    /// A rate without a topology premium.
    pub fn new(reserved_per_gpu_hour: f64, burst_per_gpu_hour: f64) -> Rate {
        Rate { reserved_per_gpu_hour, burst_per_gpu_hour, nvlink_premium_per_gpu_hour: 0.0 }
    }

    pub fn for_class(&self, class: Class) -> f64 {
        match class {
            Class::Guaranteed => self.reserved_per_gpu_hour,
            Class::Burst => self.burst_per_gpu_hour,
        }
    }
}

/// The price list a report is computed with, keyed by GPU model name.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Prices {
    #[serde(default)]
    pub per_model: BTreeMap<String, Rate>,
}

/// What to report: the window `[from_ms, to_ms)` in Unix milliseconds, the level to
/// group by, the prices and terms to apply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageQuery {
    pub from_ms: u64,
    pub to_ms: u64,
    pub by: GroupBy,
    #[serde(default)]
    pub prices: Prices,
    /// Floors, modes, preemption ([`Terms`]); the default bills everything by consumption.
    #[serde(default)]
    pub terms: Terms,
}

impl UsageQuery {
    /// A query with the given prices and default terms.
    pub fn new(from_ms: u64, to_ms: u64, by: GroupBy, prices: Prices) -> UsageQuery {
        UsageQuery { from_ms, to_ms, by, prices, terms: Terms::default() }
    }

    /// Checks the window, the prices and the terms.
    pub fn validate(&self) -> Result<(), LedgerError> {
        if self.from_ms >= self.to_ms {
            return Err(LedgerError::BadQuery(format!(
                "the window is empty: from_ms ({}) must be before to_ms ({}); the window is [from, to)",
                self.from_ms, self.to_ms
            )));
        }
        if i64::try_from(self.to_ms).is_err() {
            return Err(LedgerError::BadQuery(format!(
                "to_ms ({}) is beyond the ledger's time range (at most {})",
                self.to_ms,
                i64::MAX
            )));
        }
        for (model, rate) in &self.prices.per_model {
            for (name, v) in [
                ("reserved_per_gpu_hour", rate.reserved_per_gpu_hour),
                ("burst_per_gpu_hour", rate.burst_per_gpu_hour),
                ("nvlink_premium_per_gpu_hour", rate.nvlink_premium_per_gpu_hour),
            ] {
                if !(v.is_finite() && v >= 0.0) {
                    return Err(LedgerError::BadQuery(format!(
                        "price {name} of model {model} must be a finite number >= 0, got {v}"
                    )));
                }
            }
        }
        self.terms.validate()
    }
}

/// One group's usage and bill in the window.
///
/// `cost` is the bill: `floor_cost + on_demand_cost + burst_cost + premium_cost -
/// waived_cost`, split by mode into `chargeback_cost + showback_cost`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UsageRow {
    pub group: String,
    /// GPU-seconds held by containers: clipped duration (s) x fraction, in millionths
    /// exactly. Floors are not in it (`floor_gpu_seconds`).
    pub gpu_seconds: f64,
    /// What the group is billed (see the type's docs).
    pub cost: f64,
    /// Intervals that touch the window.
    pub intervals: u64,
    /// GPU-seconds of the intervals whose utilisation was sampled (whole GPUs where NVML
    /// offers per-process utilisation; never MIG): held, against ...
    #[serde(default)]
    pub sampled_gpu_seconds: f64,
    /// ... the GPU-seconds driven (mean SM use of the whole GPU x time): used / sampled is
    /// used-vs-reserved.
    #[serde(default)]
    pub used_gpu_seconds: f64,
    /// By container: `namespace/pod/container` where the container was a pod's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The floors (own guarantees) held in the window, in GPU-seconds, and their cost at
    /// the reserved rate.
    #[serde(default)]
    pub floor_gpu_seconds: f64,
    #[serde(default)]
    pub floor_cost: f64,
    /// Of the floors: GPU-seconds of guaranteed work that ran in them, and what was held
    /// but not used (`floor - used`, per floor, never below 0).
    #[serde(default)]
    pub floor_used_gpu_seconds: f64,
    #[serde(default)]
    pub floor_idle_gpu_seconds: f64,
    /// Guaranteed work inside a floor: paid by the floor, no further cost.
    #[serde(default)]
    pub in_floor_gpu_seconds: f64,
    /// Guaranteed work no floor covers, at the reserved rate.
    #[serde(default)]
    pub on_demand_gpu_seconds: f64,
    #[serde(default)]
    pub on_demand_cost: f64,
    /// Borrowed work at the burst rate.
    #[serde(default)]
    pub burst_gpu_seconds: f64,
    #[serde(default)]
    pub burst_cost: f64,
    /// Multi-GPU grants inside one NVLink domain: the topology premium.
    #[serde(default)]
    pub premium_gpu_seconds: f64,
    #[serde(default)]
    pub premium_cost: f64,
    /// Work of intervals a quota reclaim stopped (lost to preemption), what it costs, and
    /// what of that was not billed (`billing.preempted: waive`).
    #[serde(default)]
    pub preempted_gpu_seconds: f64,
    #[serde(default)]
    pub preempted_cost: f64,
    #[serde(default)]
    pub waived_cost: f64,
    /// The bill by the mode of the path each charge belongs to.
    #[serde(default)]
    pub chargeback_cost: f64,
    #[serde(default)]
    pub showback_cost: f64,
}

/// The total of one level of the tree: equal at every level, by construction and by check.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LevelTotal {
    pub by: GroupBy,
    /// How many groups this level has in the window.
    pub groups: u64,
    pub gpu_seconds: f64,
    pub cost: f64,
    pub intervals: u64,
}

/// A usage report. Serialize it with [`UsageReport::to_json`] or [`UsageReport::to_csv`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UsageReport {
    pub from_ms: u64,
    pub to_ms: u64,
    pub by: GroupBy,
    /// Sorted by group.
    pub rows: Vec<UsageRow>,
    /// The node total; its group is `TOTAL`.
    pub total: UsageRow,
    /// The total of every level, org to container, each checked against its children
    /// and the node total.
    pub levels: Vec<LevelTotal>,
    /// How many of the counted intervals were still open (counted up to now).
    pub open_intervals: u64,
    /// GPU models with usage in the window but no price: their cost is 0.
    pub unpriced_models: Vec<String>,
    /// Whether floors were billed (a fleet's report; a node that is its own fleet), and up
    /// to when.
    #[serde(default)]
    pub floors_billed: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub floors_until_ms: Option<u64>,
    /// Whether work lost to preemption is billed.
    #[serde(default)]
    pub preempted: Preempted,
    /// Whole GPUs held well below what they offer, with the MIG profile that fits
    /// ([`crate::idle`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub under_driven: Vec<Suggestion>,
}

/// The CSV header of [`UsageReport::to_csv`].
pub const CSV_HEADER: &str = "group,gpu_seconds,cost,intervals,floor_gpu_seconds,floor_cost,\
floor_idle_gpu_seconds,in_floor_gpu_seconds,on_demand_gpu_seconds,on_demand_cost,\
burst_gpu_seconds,burst_cost,premium_gpu_seconds,premium_cost,preempted_gpu_seconds,\
waived_cost,chargeback_cost,showback_cost,sampled_gpu_seconds,used_gpu_seconds";

impl UsageReport {
    /// Pretty JSON; stable: the same report always gives the same bytes.
    pub fn to_json(&self) -> String {
        match serde_json::to_string_pretty(self) {
            Ok(s) => s,
            // Unreachable for this type (string keys, finite numbers); keep it a value.
            Err(e) => format!("{{\"error\": {:?}}}", e.to_string()),
        }
    }

    /// CSV: header [`CSV_HEADER`], one line per row, then `TOTAL`. Numbers have exactly six
    /// decimals. The group is written by [`tessera_api::display::csv_cell`]: a group that
    /// a spreadsheet would run as a formula (a container id `+1`, `-2+3`) is a quoted cell
    /// that starts with `'`.
    pub fn to_csv(&self) -> String {
        let mut out = format!("{CSV_HEADER}\n");
        for row in self.rows.iter().chain(std::iter::once(&self.total)) {
            let _ = write!(out, "{},", tessera_api::display::csv_cell(&row.group));
            let _ = write!(out, "{:.6},{:.6},{}", row.gpu_seconds, row.cost, row.intervals);
            for v in [
                row.floor_gpu_seconds,
                row.floor_cost,
                row.floor_idle_gpu_seconds,
                row.in_floor_gpu_seconds,
                row.on_demand_gpu_seconds,
                row.on_demand_cost,
                row.burst_gpu_seconds,
                row.burst_cost,
                row.premium_gpu_seconds,
                row.premium_cost,
                row.preempted_gpu_seconds,
                row.waived_cost,
                row.chargeback_cost,
                row.showback_cost,
                row.sampled_gpu_seconds,
                row.used_gpu_seconds,
            ] {
                let _ = write!(out, ",{v:.6}");
            }
            out.push('\n');
        }
        out
    }
}

/// Everything a report sums, in millionths.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Acc {
    gs: u128,
    cost: u128,
    intervals: u64,
    /// GPU-seconds of intervals with utilisation samples, and what they used of them.
    sampled: u128,
    used: u128,
    floor_gs: u128,
    floor_cost: u128,
    floor_used: u128,
    floor_idle: u128,
    in_floor_gs: u128,
    on_demand_gs: u128,
    on_demand_cost: u128,
    burst_gs: u128,
    burst_cost: u128,
    premium_gs: u128,
    premium_cost: u128,
    preempted_gs: u128,
    preempted_cost: u128,
    waived_cost: u128,
    chargeback: u128,
    showback: u128,
}

impl Acc {
    fn add(&mut self, o: &Acc) {
        self.gs += o.gs;
        self.cost += o.cost;
        self.intervals += o.intervals;
        self.sampled += o.sampled;
        self.used += o.used;
        self.floor_gs += o.floor_gs;
        self.floor_cost += o.floor_cost;
        self.floor_used += o.floor_used;
        self.floor_idle += o.floor_idle;
        self.in_floor_gs += o.in_floor_gs;
        self.on_demand_gs += o.on_demand_gs;
        self.on_demand_cost += o.on_demand_cost;
        self.burst_gs += o.burst_gs;
        self.burst_cost += o.burst_cost;
        self.premium_gs += o.premium_gs;
        self.premium_cost += o.premium_cost;
        self.preempted_gs += o.preempted_gs;
        self.preempted_cost += o.preempted_cost;
        self.waived_cost += o.waived_cost;
        self.chargeback += o.chargeback;
        self.showback += o.showback;
    }

    /// Books `cost` under the mode of the path it belongs to.
    fn bill(&mut self, cost: u128, mode: Mode) {
        self.cost = cost;
        match mode {
            Mode::Chargeback => self.chargeback = cost,
            Mode::Showback => self.showback = cost,
        }
    }
}

fn micros_to_f64(m: u128) -> f64 {
    // Exact for totals below 2^53 millionths (about 285 GPU-years); rounding beyond.
    #[allow(clippy::cast_precision_loss)]
    let v = m as f64;
    v / 1e6
}

/// Rounds a non-negative finite f64 to an integer (saturating).
fn round_u128(x: f64) -> u128 {
    if x.is_finite() && x > 0.0 {
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let v = x.round() as u128;
        v
    } else {
        0
    }
}

/// Micro-currency for `micro_gs` micro-GPU-seconds at `rate` per GPU-hour, rounded once.
fn money(micro_gs: u128, rate: f64) -> u128 {
    #[allow(clippy::cast_precision_loss)]
    round_u128(micro_gs as f64 * rate / 3600.0)
}

/// The group of a floor at `path` when grouping by container (a container id never has a
/// `:`, so it cannot collide with one).
pub fn floor_group(path: &str) -> String {
    format!("floor:{path}")
}

/// Builds the report for `q` from spans. Pure: spans that do not touch the window are
/// ignored; the rest are clipped to it. Floors come from `q.terms` (see [`crate::bill`]).
pub fn aggregate(spans: &[Span], q: &UsageQuery) -> Result<UsageReport, LedgerError> {
    q.validate()?;
    let terms = &q.terms;
    let mut total = Acc::default();
    let mut levels: BTreeMap<GroupBy, BTreeMap<String, Acc>> = BTreeMap::new();
    let mut unpriced = std::collections::BTreeSet::new();
    let mut open = 0u64;
    // Guaranteed work inside each floor, by (floor path, model).
    let mut floor_used: BTreeMap<(String, String), u128> = BTreeMap::new();
    let rate_of = |model: &str, micro: u128, unpriced: &mut std::collections::BTreeSet<String>| {
        let r = q.prices.per_model.get(model).copied();
        if r.is_none() && micro > 0 {
            unpriced.insert(model.to_string());
        }
        r.unwrap_or(Rate::new(0.0, 0.0))
    };
    for s in spans.iter().filter(|s| s.touches(q.from_ms, q.to_ms)) {
        let overlap = s.overlap_ms(q.from_ms, q.to_ms);
        #[allow(clippy::cast_precision_loss)]
        let gs = round_u128(overlap as f64 * s.fraction * 1000.0);
        let rate = rate_of(&s.gpu_model, gs, &mut unpriced);
        let mut a = Acc { gs, intervals: 1, ..Acc::default() };
        if let Some(r) = s.used_ratio {
            #[allow(clippy::cast_precision_loss)]
            let used = round_u128(gs as f64 * r);
            (a.sampled, a.used) = (gs, used);
        }
        match (s.class, terms.floor_of(&s.tenant, &s.gpu_model)) {
            (Class::Burst, _) => {
                (a.burst_gs, a.burst_cost) = (gs, money(gs, rate.burst_per_gpu_hour));
            }
            (Class::Guaranteed, Some(path)) => {
                a.in_floor_gs = gs;
                *floor_used.entry((path.to_string(), s.gpu_model.clone())).or_default() += gs;
            }
            (Class::Guaranteed, None) => {
                (a.on_demand_gs, a.on_demand_cost) = (gs, money(gs, rate.reserved_per_gpu_hour));
            }
        }
        if s.nvlink {
            (a.premium_gs, a.premium_cost) = (gs, money(gs, rate.nvlink_premium_per_gpu_hour));
        }
        let consumption = a.burst_cost + a.on_demand_cost + a.premium_cost;
        if s.preempted {
            (a.preempted_gs, a.preempted_cost) = (gs, consumption);
            if terms.preempted == Preempted::Waive {
                a.waived_cost = consumption;
            }
        }
        a.bill(consumption - a.waived_cost, terms.mode_of(&s.tenant));
        total.add(&a);
        open += u64::from(s.open);
        for by in GroupBy::ALL {
            levels.entry(by).or_default().entry(by.key_of(s)).or_default().add(&a);
        }
    }

    // The floors: each path's own guarantee over [from, min(to, as_of)).
    let floor_end = q.to_ms.min(terms.as_of_ms.unwrap_or(q.to_ms));
    let floor_ms = u128::from(floor_end.saturating_sub(q.from_ms));
    let own_floors = terms.own_floors();
    // Where floors stop matters only where there are floors: a report without any stays
    // byte-identical from one query to the next.
    let floors_until_ms = (terms.bill_floors && !own_floors.is_empty()).then_some(floor_end);
    for ((path, model), own) in own_floors {
        let used = floor_used.remove(&(path.clone(), model.clone())).unwrap_or(0);
        // micro-GPUs x ms / 1000 = micro-GPU-seconds.
        let floor_gs = if terms.bill_floors { u128::from(own) * floor_ms / 1000 } else { 0 };
        if floor_gs == 0 && used == 0 {
            continue;
        }
        let rate = rate_of(&model, floor_gs, &mut unpriced);
        let mut a = Acc {
            floor_gs,
            floor_cost: money(floor_gs, rate.reserved_per_gpu_hour),
            floor_used: used,
            floor_idle: floor_gs.saturating_sub(used),
            ..Acc::default()
        };
        a.bill(a.floor_cost, terms.mode_of(&path));
        total.add(&a);
        for by in GroupBy::ALL {
            let key = match by {
                GroupBy::Container => floor_group(&path),
                GroupBy::Namespace | GroupBy::Pod => NOT_A_POD.to_string(),
                _ => by.key(&path, ""),
            };
            levels.entry(by).or_default().entry(key).or_default().add(&a);
        }
    }

    check_levels(&levels, &total)?;

    // By container, the pod container's name beside its id.
    let names: BTreeMap<&str, String> = spans
        .iter()
        .filter_map(|s| Some((s.container_id.as_str(), s.workload.as_ref()?.display_name())))
        .collect();
    let row = |group: &str, a: &Acc| UsageRow {
        name: match q.by {
            GroupBy::Container => names.get(group).cloned(),
            _ => None,
        },
        group: group.to_string(),
        gpu_seconds: micros_to_f64(a.gs),
        cost: micros_to_f64(a.cost),
        intervals: a.intervals,
        sampled_gpu_seconds: micros_to_f64(a.sampled),
        used_gpu_seconds: micros_to_f64(a.used),
        floor_gpu_seconds: micros_to_f64(a.floor_gs),
        floor_cost: micros_to_f64(a.floor_cost),
        floor_used_gpu_seconds: micros_to_f64(a.floor_used),
        floor_idle_gpu_seconds: micros_to_f64(a.floor_idle),
        in_floor_gpu_seconds: micros_to_f64(a.in_floor_gs),
        on_demand_gpu_seconds: micros_to_f64(a.on_demand_gs),
        on_demand_cost: micros_to_f64(a.on_demand_cost),
        burst_gpu_seconds: micros_to_f64(a.burst_gs),
        burst_cost: micros_to_f64(a.burst_cost),
        premium_gpu_seconds: micros_to_f64(a.premium_gs),
        premium_cost: micros_to_f64(a.premium_cost),
        preempted_gpu_seconds: micros_to_f64(a.preempted_gs),
        preempted_cost: micros_to_f64(a.preempted_cost),
        waived_cost: micros_to_f64(a.waived_cost),
        chargeback_cost: micros_to_f64(a.chargeback),
        showback_cost: micros_to_f64(a.showback),
    };
    let rows =
        levels.get(&q.by).map(|m| m.iter().map(|(g, a)| row(g, a)).collect()).unwrap_or_default();
    let level_totals = GroupBy::ALL
        .into_iter()
        .map(|by| {
            let groups = levels.get(&by);
            let mut sum = Acc::default();
            groups.into_iter().flat_map(|m| m.values()).for_each(|a| sum.add(a));
            LevelTotal {
                by,
                groups: groups.map_or(0, |m| m.len() as u64),
                gpu_seconds: micros_to_f64(sum.gs),
                cost: micros_to_f64(sum.cost),
                intervals: sum.intervals,
            }
        })
        .collect();
    Ok(UsageReport {
        from_ms: q.from_ms,
        to_ms: q.to_ms,
        by: q.by,
        rows,
        total: row("TOTAL", &total),
        levels: level_totals,
        open_intervals: open,
        unpriced_models: unpriced.into_iter().collect(),
        floors_billed: terms.bill_floors,
        floors_until_ms,
        preempted: terms.preempted,
        under_driven: crate::idle::under_driven(spans, q.from_ms, q.to_ms),
    })
}

/// Every level sums to the node total, and every tenant group is the sum of its
/// children one level down (a child's parent is its key cut to the parent's depth).
fn check_levels(
    levels: &BTreeMap<GroupBy, BTreeMap<String, Acc>>,
    total: &Acc,
) -> Result<(), LedgerError> {
    let empty = BTreeMap::new();
    for by in GroupBy::ALL {
        let mut sum = Acc::default();
        levels.get(&by).unwrap_or(&empty).values().for_each(|a| sum.add(a));
        if &sum != total {
            return Err(LedgerError::Inconsistent(format!(
                "the {by} level sums to {sum:?} but the node total is {total:?}"
            )));
        }
    }
    let tenant_levels = [GroupBy::Org, GroupBy::Team, GroupBy::Project, GroupBy::User];
    for pair in tenant_levels.windows(2) {
        let (parent, child) = (pair[0], pair[1]);
        let depth = parent.depth().unwrap_or(0);
        let mut sums: BTreeMap<&str, Acc> = BTreeMap::new();
        for (key, acc) in levels.get(&child).unwrap_or(&empty) {
            sums.entry(tenant_prefix(key, depth)).or_default().add(acc);
        }
        let parents = levels.get(&parent).unwrap_or(&empty);
        let same = parents.len() == sums.len()
            && parents.iter().all(|(k, a)| sums.get(k.as_str()) == Some(a));
        if !same {
            return Err(LedgerError::Inconsistent(format!(
                "the {parent} groups are not the sums of their {child} children"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_api::Isolation;

    fn span(tenant: &str, container: &str, start: u64, end: u64, fraction: f64) -> Span {
        Span {
            container_id: container.to_string(),
            tenant: tenant.to_string(),
            gpu_model: "H100".to_string(),
            class: Class::Guaranteed,
            fraction,
            start_ms: start,
            end_ms: end,
            open: false,
            used_ratio: None,
            workload: None,
            device_uuid: format!("GPU-{container}"),
            isolation: Isolation::Gpu,
            nvlink: false,
            preempted: false,
            samples: 0,
            sm_peak: None,
        }
    }

    #[test]
    fn used_vs_reserved_rolls_up_only_where_sampled() {
        let mut a = span("acme/ml/x/alice", "c1", 0, 10_000, 0.5);
        a.used_ratio = Some(0.8); // 40% of the GPU used of 50% reserved
        let b = span("acme/ml/x/bob", "c2", 0, 10_000, 1.0); // not sampled (e.g. MIG)
        let r = aggregate(&[a, b], &q(0, 10_000, GroupBy::Team)).expect("report");
        let team = &r.rows[0];
        assert_eq!(team.gpu_seconds, 15.0);
        assert_eq!(team.sampled_gpu_seconds, 5.0);
        assert_eq!(team.used_gpu_seconds, 4.0);
        assert_eq!((r.total.sampled_gpu_seconds, r.total.used_gpu_seconds), (5.0, 4.0));
        // Clipping to half the window halves both.
        let mut a = span("acme/ml/x/alice", "c1", 0, 10_000, 0.5);
        a.used_ratio = Some(0.8);
        let r = aggregate(&[a], &q(0, 5_000, GroupBy::User)).expect("report");
        assert_eq!((r.total.sampled_gpu_seconds, r.total.used_gpu_seconds), (2.5, 2.0));
    }

    fn q(from: u64, to: u64, by: GroupBy) -> UsageQuery {
        UsageQuery::new(from, to, by, Prices::default())
    }

    #[test]
    fn tenant_prefixes() {
        assert_eq!(tenant_prefix("a/b/c/d", 1), "a");
        assert_eq!(tenant_prefix("a/b/c/d", 2), "a/b");
        assert_eq!(tenant_prefix("a/b/c/d", 4), "a/b/c/d");
        assert_eq!(tenant_prefix("a/b", 4), "a/b");
        assert_eq!(GroupBy::User.key("acme/ml", "c1"), "acme/ml");
        assert_eq!(GroupBy::Container.key("acme/ml", "c1"), "c1");
    }

    #[test]
    fn spans_are_clipped_to_the_window() {
        let spans = [
            span("a", "before", 0, 1_000, 1.0),
            span("a", "straddle-left", 500, 2_500, 1.0),
            span("a", "inside", 1_200, 1_700, 0.5),
            span("a", "straddle-right", 2_500, 4_000, 0.25),
            span("a", "after", 3_000, 5_000, 1.0),
            span("a", "empty-inside", 1_100, 1_100, 1.0),
        ];
        let r = aggregate(&spans, &q(1_000, 3_000, GroupBy::Container)).expect("report");
        let got: Vec<(&str, f64, u64)> =
            r.rows.iter().map(|r| (r.group.as_str(), r.gpu_seconds, r.intervals)).collect();
        assert_eq!(
            got,
            vec![
                ("empty-inside", 0.0, 1),
                ("inside", 0.25, 1),
                ("straddle-left", 1.5, 1),
                ("straddle-right", 0.125, 1),
            ]
        );
        assert_eq!(r.total.gpu_seconds, 1.875);
        assert_eq!(r.total.intervals, 4);
    }

    #[test]
    fn short_tenants_group_under_their_own_path() {
        let spans =
            [span("acme/ml", "c1", 0, 1_000, 1.0), span("acme/ml/cv/bob", "c2", 0, 2_000, 1.0)];
        let r = aggregate(&spans, &q(0, 10_000, GroupBy::User)).expect("report");
        let groups: Vec<&str> = r.rows.iter().map(|r| r.group.as_str()).collect();
        assert_eq!(groups, ["acme/ml", "acme/ml/cv/bob"]);
        let r = aggregate(&spans, &q(0, 10_000, GroupBy::Team)).expect("report");
        assert_eq!(r.rows.len(), 1);
        assert_eq!(r.rows[0].gpu_seconds, 3.0);
    }

    #[test]
    fn empty_and_inverted_windows_are_refused() {
        for (from, to) in [(5, 5), (6, 5)] {
            let err = aggregate(&[], &q(from, to, GroupBy::Org)).expect_err("bad window");
            assert!(matches!(err, LedgerError::BadQuery(_)), "{err}");
            assert!(err.to_string().contains("must be before to_ms"), "{err}");
        }
        let mut bad = q(0, 1, GroupBy::Org);
        bad.prices.per_model.insert("H100".into(), Rate::new(-1.0, 1.0));
        assert!(matches!(aggregate(&[], &bad), Err(LedgerError::BadQuery(_))));
        assert!(matches!("node".parse::<GroupBy>(), Err(LedgerError::BadQuery(_))));
    }

    /// Each CSV line cut after its first four cells (group, GPU-seconds, cost, intervals).
    fn first_cells(csv: &str) -> Vec<String> {
        csv.lines()
            .map(|l| {
                let mut cut = l.len();
                let (mut quoted, mut commas) = (false, 0);
                for (i, c) in l.char_indices() {
                    match c {
                        '"' => quoted = !quoted,
                        ',' if !quoted => {
                            commas += 1;
                            if commas == 4 {
                                cut = i;
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                l[..cut].to_string()
            })
            .collect()
    }

    #[test]
    fn csv_groups_that_start_a_formula_are_escaped_even_with_control_characters() {
        // The ledger refuses control characters in ids; the report escapes them anyway.
        let spans = [
            span("a", "\t=1+1", 0, 1_000, 1.0),
            span("a", "\r=1+1", 0, 1_000, 1.0),
            span("a", "+1", 0, 1_000, 1.0),
        ];
        let csv = aggregate(&spans, &q(0, 1_000, GroupBy::Container)).expect("report").to_csv();
        assert!(csv.starts_with(&format!("{CSV_HEADER}\n")), "{csv}");
        assert_eq!(
            first_cells(&csv)[1..],
            [
                "\"'\t=1+1\",1.000000,0.000000,1",
                "\"'\r=1+1\",1.000000,0.000000,1",
                "\"'+1\",1.000000,0.000000,1",
                "TOTAL,3.000000,0.000000,3"
            ]
        );
        // Outside pods, `-` groups by namespace: a cell that starts with `-` is escaped too.
        let csv = aggregate(&spans[2..], &q(0, 1_000, GroupBy::Namespace)).expect("r").to_csv();
        assert!(csv.contains("\n\"'-\",1.000000,"), "{csv}");
    }

    #[test]
    fn csv_has_header_rows_and_total() {
        let spans = [span("a,b", "c1", 0, 3_600_000, 1.0), span("z", "c2", 0, 1_800_000, 1.0)];
        let mut query = q(0, 3_600_000, GroupBy::Org);
        query.prices.per_model.insert("H100".into(), Rate::new(2.0, 3.0));
        let r = aggregate(&spans, &query).expect("report");
        let csv = r.to_csv();
        assert_eq!(csv.lines().next(), Some(CSV_HEADER));
        assert_eq!(
            first_cells(&csv)[1..],
            [
                "\"a,b\",3600.000000,2.000000,1",
                "z,1800.000000,1.000000,1",
                "TOTAL,5400.000000,3.000000,2"
            ]
        );
        // Every line has every column.
        let columns = CSV_HEADER.split(',').count();
        assert!(csv.lines().skip(2).all(|l| l.split(',').count() == columns), "{csv}");
    }

    fn priced(from: u64, to: u64, by: GroupBy) -> UsageQuery {
        let mut query = q(from, to, by);
        query.prices.per_model.insert(
            "H100".into(),
            Rate {
                reserved_per_gpu_hour: 2.0,
                burst_per_gpu_hour: 3.0,
                nvlink_premium_per_gpu_hour: 0.5,
            },
        );
        query.terms.guarantees.insert("acme/ml".into(), [("H100".to_string(), 4_000_000)].into());
        query.terms.bill_floors = true;
        query
    }

    const HOUR: u64 = 3_600_000;

    #[test]
    fn floors_are_billed_used_or_not_and_bursts_by_consumption() {
        // acme/ml holds a floor of 4 and runs nothing for an hour: 4 GPU-hours at 2.0.
        let r = aggregate(&[], &priced(0, HOUR, GroupBy::Team)).expect("report");
        let ml = &r.rows[0];
        assert_eq!((ml.group.as_str(), ml.floor_gpu_seconds), ("acme/ml", 14_400.0));
        assert_eq!((ml.floor_cost, ml.cost), (8.0, 8.0));
        assert_eq!((ml.floor_used_gpu_seconds, ml.floor_idle_gpu_seconds), (0.0, 14_400.0));
        assert_eq!(ml.gpu_seconds, 0.0, "a floor is not held by a container");
        assert!(r.floors_billed);

        // One guaranteed GPU inside the floor (no extra cost), one borrowed GPU (3.0/h), a
        // tenant without a guarantee (2.0/h, on demand), a 2-GPU NVLink grant inside the
        // floor (premium 0.5/h on each).
        let mut borrowed = span("acme/ml/x/bob", "b", 0, HOUR, 1.0);
        borrowed.class = Class::Burst;
        let mut nv1 = span("acme/ml/x/carol", "nv", 0, HOUR, 1.0);
        nv1.nvlink = true;
        let mut nv2 = nv1.clone();
        nv2.device_uuid = "GPU-nv-2".into();
        let spans = [
            span("acme/ml/x/alice", "a", 0, HOUR, 1.0),
            borrowed,
            span("beta", "c", 0, HOUR, 0.5),
            nv1,
            nv2,
        ];
        let r = aggregate(&spans, &priced(0, HOUR, GroupBy::Team)).expect("report");
        let ml = r.rows.iter().find(|x| x.group == "acme/ml").expect("acme/ml");
        assert_eq!(ml.floor_cost, 8.0);
        assert_eq!(ml.floor_used_gpu_seconds, 3.0 * 3600.0, "alice and carol's two GPUs");
        assert_eq!(ml.floor_idle_gpu_seconds, 3600.0);
        assert_eq!(ml.in_floor_gpu_seconds, 3.0 * 3600.0);
        assert_eq!((ml.burst_gpu_seconds, ml.burst_cost), (3600.0, 3.0));
        assert_eq!((ml.premium_gpu_seconds, ml.premium_cost), (7200.0, 1.0));
        assert_eq!(ml.cost, 8.0 + 3.0 + 1.0);
        let beta = r.rows.iter().find(|x| x.group == "beta").expect("beta");
        assert_eq!(
            (beta.on_demand_gpu_seconds, beta.on_demand_cost, beta.cost),
            (1800.0, 1.0, 1.0)
        );
        assert_eq!(r.total.cost, 13.0);
        // By container, the floor is a group of its own.
        let r = aggregate(&spans, &priced(0, HOUR, GroupBy::Container)).expect("report");
        let floor = r.rows.iter().find(|x| x.group == "floor:acme/ml").expect("floor row");
        assert_eq!(floor.floor_cost, 8.0);
        assert_eq!(r.rows.iter().find(|x| x.group == "a").expect("a").cost, 0.0);
    }

    #[test]
    fn floors_stop_at_as_of_and_are_not_billed_on_fleet_nodes() {
        let mut query = priced(0, 2 * HOUR, GroupBy::Org);
        query.terms.as_of_ms = Some(HOUR / 2);
        let r = aggregate(&[], &query).expect("report");
        assert_eq!((r.total.floor_gpu_seconds, r.total.cost), (7_200.0, 4.0));
        assert_eq!(r.floors_until_ms, Some(HOUR / 2));
        query.terms.bill_floors = false;
        let inside = span("acme/ml/x/alice", "a", 0, HOUR, 1.0);
        let r = aggregate(&[inside], &query).expect("report");
        assert_eq!((r.total.floor_gpu_seconds, r.total.cost), (0.0, 0.0));
        assert_eq!(r.total.floor_used_gpu_seconds, 3600.0, "still shown as inside its floor");
    }

    #[test]
    fn modes_split_the_bill_and_preempted_work_is_reported_and_waived_when_asked() {
        let mut gone = span("acme/ml/x/bob", "b", 0, HOUR, 1.0);
        gone.class = Class::Burst;
        gone.preempted = true;
        let mut query = priced(0, HOUR, GroupBy::Org);
        query.terms.modes.insert("acme/ml".into(), Mode::Chargeback);
        let r = aggregate(std::slice::from_ref(&gone), &query).expect("report");
        assert_eq!((r.total.preempted_gpu_seconds, r.total.preempted_cost), (3600.0, 3.0));
        assert_eq!((r.total.waived_cost, r.total.cost), (0.0, 11.0), "billed by default");
        assert_eq!((r.total.chargeback_cost, r.total.showback_cost), (11.0, 0.0));
        query.terms.preempted = Preempted::Waive;
        query.terms.modes.clear();
        let r = aggregate(&[gone], &query).expect("report");
        assert_eq!((r.total.waived_cost, r.total.cost), (3.0, 8.0));
        assert_eq!((r.total.chargeback_cost, r.total.showback_cost), (0.0, 8.0));
        assert_eq!(r.preempted, Preempted::Waive);
    }

    #[test]
    fn a_whole_gpu_driven_lightly_is_under_driven_and_a_busy_one_is_not() {
        let mut light = span("acme/ml", "light", 0, HOUR, 1.0);
        light.gpu_model = "H100-80GB".into();
        (light.used_ratio, light.samples, light.sm_peak) = (Some(0.04), 100, Some(6.0));
        let mut busy = light.clone();
        busy.container_id = "busy".into();
        (busy.used_ratio, busy.sm_peak) = (Some(0.85), Some(95.0));
        let mut few = light.clone();
        (few.container_id, few.samples) = ("few".into(), 2);
        let r = aggregate(&[light, busy, few], &q(0, HOUR, GroupBy::Container)).expect("report");
        assert_eq!(r.under_driven.len(), 1, "{:#?}", r.under_driven);
        let s = &r.under_driven[0];
        assert_eq!((s.container_id.as_str(), s.fits.as_str()), ("light", "1g.10gb"));
        assert_eq!(
            s.message,
            "held a whole H100-80GB at 4.0% SM (peak 6.0%) for 1.0 h: a 1g.10gb instance (1/7 of the GPU) fits"
        );
    }
}
