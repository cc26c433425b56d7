//! Usage reports: clip intervals to a window, roll them up the tenant tree, price them.
//!
//! All of it is a pure function of the interval spans ([`aggregate`]); the ledger only
//! reads the spans out of SQLite. Amounts are summed as integers of millionths
//! (micro-GPU-seconds, micro-currency), each interval rounded once, so every level's
//! total is exactly the sum of its children and the same query gives byte-identical
//! output.

use std::collections::BTreeMap;
use std::fmt;
use std::fmt::Write as _;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use tessera_api::cri::Workload;

use crate::error::LedgerError;
use crate::interval::Class;

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
    /// For [`Class::Guaranteed`] intervals.
    pub reserved_per_gpu_hour: f64,
    /// For [`Class::Burst`] intervals.
    pub burst_per_gpu_hour: f64,
}

impl Rate {
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
/// group by, the prices to apply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageQuery {
    pub from_ms: u64,
    pub to_ms: u64,
    pub by: GroupBy,
    #[serde(default)]
    pub prices: Prices,
}

impl UsageQuery {
    /// Checks the window and the prices.
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
            ] {
                if !(v.is_finite() && v >= 0.0) {
                    return Err(LedgerError::BadQuery(format!(
                        "price {name} of model {model} must be a finite number >= 0, got {v}"
                    )));
                }
            }
        }
        Ok(())
    }
}

/// One group's usage in the window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UsageRow {
    pub group: String,
    /// Sum of clipped duration (s) x fraction, in millionths exactly.
    pub gpu_seconds: f64,
    /// gpu_seconds / 3600 x the rate of the interval's model and class.
    pub cost: f64,
    /// Intervals that touch the window.
    pub intervals: u64,
    /// GPU-seconds of the intervals whose utilisation was sampled (whole GPUs where NVML
    /// offers per-process utilisation; never MIG).
    #[serde(default)]
    pub sampled_gpu_seconds: f64,
    /// Of those, the GPU-seconds actually used (mean SM use of the whole GPU x time):
    /// used / sampled is used-vs-reserved.
    #[serde(default)]
    pub used_gpu_seconds: f64,
    /// By container: `namespace/pod/container` where the container was a pod's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
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
}

impl UsageReport {
    /// Pretty JSON; stable: the same report always gives the same bytes.
    pub fn to_json(&self) -> String {
        match serde_json::to_string_pretty(self) {
            Ok(s) => s,
            // Unreachable for this type (string keys, finite numbers); keep it a value.
            Err(e) => format!("{{\"error\": {:?}}}", e.to_string()),
        }
    }

    /// CSV: header `group,gpu_seconds,cost,intervals`, one line per row, then `TOTAL`.
    /// Numbers have exactly six decimals. The group is written by
    /// [`tessera_api::display::csv_cell`]: a group that a spreadsheet would run as a
    /// formula (a container id `+1`, `-2+3`) is a quoted cell that starts with `'`.
    pub fn to_csv(&self) -> String {
        let mut out = String::from("group,gpu_seconds,cost,intervals\n");
        for row in self.rows.iter().chain(std::iter::once(&self.total)) {
            // Writing into a String cannot fail.
            let _ = writeln!(
                out,
                "{},{:.6},{:.6},{}",
                tessera_api::display::csv_cell(&row.group),
                row.gpu_seconds,
                row.cost,
                row.intervals
            );
        }
        out
    }
}

/// One interval as the report sees it: where it lies in wall time and what it is worth.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    pub container_id: String,
    pub tenant: String,
    pub gpu_model: String,
    pub class: Class,
    pub fraction: f64,
    /// `[start_ms, end_ms)` in wall milliseconds; `end_ms = start_ms + duration`, the
    /// duration being monotonic where possible (so a wall-clock step moves no usage).
    pub start_ms: u64,
    pub end_ms: u64,
    pub open: bool,
    /// Used / reserved: mean SM fraction of the GPU used over the fraction reserved, where
    /// utilisation was sampled.
    pub used_ratio: Option<f64>,
    /// The pod container, where the interval is one's.
    pub workload: Option<Workload>,
}

impl Span {
    /// Milliseconds of this span inside `[from, to)`.
    pub fn overlap_ms(&self, from: u64, to: u64) -> u64 {
        self.end_ms.min(to).saturating_sub(self.start_ms.max(from))
    }

    /// Whether the span counts as an interval of the window: it overlaps it, or it is
    /// empty and starts inside it.
    pub fn touches(&self, from: u64, to: u64) -> bool {
        self.overlap_ms(from, to) > 0 || (self.start_ms >= from && self.start_ms < to)
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Acc {
    micro_gs: u128,
    micro_cost: u128,
    intervals: u64,
    /// GPU-seconds of intervals with utilisation samples, and what they used of them.
    micro_sampled: u128,
    micro_used: u128,
}

impl Acc {
    fn add(&mut self, o: &Acc) {
        self.micro_gs += o.micro_gs;
        self.micro_cost += o.micro_cost;
        self.intervals += o.intervals;
        self.micro_sampled += o.micro_sampled;
        self.micro_used += o.micro_used;
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

/// Builds the report for `q` from spans. Pure: spans that do not touch the window are
/// ignored; the rest are clipped to it.
pub fn aggregate(spans: &[Span], q: &UsageQuery) -> Result<UsageReport, LedgerError> {
    q.validate()?;
    let mut total = Acc::default();
    let mut levels: BTreeMap<GroupBy, BTreeMap<String, Acc>> = BTreeMap::new();
    let mut unpriced = std::collections::BTreeSet::new();
    let mut open = 0u64;
    for s in spans.iter().filter(|s| s.touches(q.from_ms, q.to_ms)) {
        let overlap = s.overlap_ms(q.from_ms, q.to_ms);
        #[allow(clippy::cast_precision_loss)]
        let micro_gs = round_u128(overlap as f64 * s.fraction * 1000.0);
        let rate = match q.prices.per_model.get(&s.gpu_model) {
            Some(r) => r.for_class(s.class),
            None => {
                if micro_gs > 0 {
                    unpriced.insert(s.gpu_model.clone());
                }
                0.0
            }
        };
        #[allow(clippy::cast_precision_loss)]
        let micro_cost = round_u128(micro_gs as f64 * rate / 3600.0);
        let (micro_sampled, micro_used) = match s.used_ratio {
            #[allow(clippy::cast_precision_loss)]
            Some(r) => (micro_gs, round_u128(micro_gs as f64 * r)),
            None => (0, 0),
        };
        let acc = Acc { micro_gs, micro_cost, intervals: 1, micro_sampled, micro_used };
        total.add(&acc);
        open += u64::from(s.open);
        for by in GroupBy::ALL {
            levels.entry(by).or_default().entry(by.key_of(s)).or_default().add(&acc);
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
        gpu_seconds: micros_to_f64(a.micro_gs),
        cost: micros_to_f64(a.micro_cost),
        intervals: a.intervals,
        sampled_gpu_seconds: micros_to_f64(a.micro_sampled),
        used_gpu_seconds: micros_to_f64(a.micro_used),
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
                gpu_seconds: micros_to_f64(sum.micro_gs),
                cost: micros_to_f64(sum.micro_cost),
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
        UsageQuery { from_ms: from, to_ms: to, by, prices: Prices::default() }
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
        bad.prices
            .per_model
            .insert("H100".into(), Rate { reserved_per_gpu_hour: -1.0, burst_per_gpu_hour: 1.0 });
        assert!(matches!(aggregate(&[], &bad), Err(LedgerError::BadQuery(_))));
        assert!(matches!("node".parse::<GroupBy>(), Err(LedgerError::BadQuery(_))));
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
        assert_eq!(
            csv,
            "group,gpu_seconds,cost,intervals\n\
             \"'\t=1+1\",1.000000,0.000000,1\n\
             \"'\r=1+1\",1.000000,0.000000,1\n\
             \"'+1\",1.000000,0.000000,1\n\
             TOTAL,3.000000,0.000000,3\n"
        );
        // Outside pods, `-` groups by namespace: a cell that starts with `-` is escaped too.
        let csv = aggregate(&spans[2..], &q(0, 1_000, GroupBy::Namespace)).expect("r").to_csv();
        assert!(csv.contains("\n\"'-\",1.000000,"), "{csv}");
    }

    #[test]
    fn csv_has_header_rows_and_total() {
        let spans = [span("a,b", "c1", 0, 3_600_000, 1.0), span("z", "c2", 0, 1_800_000, 1.0)];
        let mut query = q(0, 3_600_000, GroupBy::Org);
        query
            .prices
            .per_model
            .insert("H100".into(), Rate { reserved_per_gpu_hour: 2.0, burst_per_gpu_hour: 3.0 });
        let r = aggregate(&spans, &query).expect("report");
        assert_eq!(
            r.to_csv(),
            "group,gpu_seconds,cost,intervals\n\
             \"a,b\",3600.000000,2.000000,1\n\
             z,1800.000000,1.000000,1\n\
             TOTAL,5400.000000,3.000000,2\n"
        );
    }
}
