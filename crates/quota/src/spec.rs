//! The `quotas` section as written ([`QuotaSpec`], serde) and its validation into a
//! [`QuotaTree`], with errors that name the JSON path of the offending value
//! (`quotas.acme/ml.gpus.H100-80GB.ceiling`), as `crates/policy` reports its own.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use serde::de::value::MapAccessDeserializer;
use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use tessera_api::untrusted;

use crate::amount::{Resource, Resources, MIB_PER_GIB, MICRO_PER_GPU, MILLI_PER_CORE};

/// The grace period between SIGTERM and SIGKILL when none is written.
pub const DEFAULT_GRACE_PERIOD_S: u64 = 30;
/// The longest grace period a quota may set.
pub const MAX_GRACE_PERIOD_S: u64 = 3_600;
/// The longest minimum run time a quota may set (a day).
pub const MAX_MIN_RUNTIME_S: u64 = 86_400;
/// The longest `owed_reclaim_after_s`: a day.
pub const MAX_OWED_RECLAIM_AFTER_S: u64 = 86_400;
/// The longest base a requeue backoff may set.
pub const MAX_REQUEUE_BACKOFF_S: u64 = 3_600;
/// A requeue backoff doubles with each preemption of the same work up to this many times
/// its base, and never beyond [`MAX_REQUEUE_BACKOFF_S`].
pub const REQUEUE_BACKOFF_DOUBLINGS: u32 = 6;
/// The largest amount a limit may name, in its unit (GPUs, cores, GiB).
pub const MAX_LIMIT: f64 = 1_000_000.0;

/// The policy's `quotas` section as written: tenant path → its quota. Duplicate keys are
/// refused (serde_json would keep the last one silently).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(transparent)]
pub struct QuotaSpec(pub UniqueMap<QuotaEntry>);

/// One tenant path's quota as written: a JSON object only, never serde's array of the
/// fields in order.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, remote = "Self")]
pub struct QuotaEntry {
    /// GPU catalog model → limits in GPU-equivalents.
    #[serde(default)]
    pub gpus: UniqueMap<Limits>,
    /// Limits in CPU cores.
    #[serde(default)]
    pub cpu_cores: Option<Limits>,
    /// Limits in GiB of memory.
    #[serde(default)]
    pub memory_gib: Option<Limits>,
    /// Seconds between SIGTERM and SIGKILL when this path's borrowed work is reclaimed
    /// (default: the nearest ancestor's, else [`DEFAULT_GRACE_PERIOD_S`]).
    #[serde(default)]
    pub grace_period_s: Option<u64>,
    /// Seconds borrowed work of this path runs before a reclaim may take it, like KAI's
    /// min runtime or Slurm's `PreemptExemptTime` (default: the nearest ancestor's, else 0).
    #[serde(default)]
    pub min_runtime_s: Option<u64>,
    /// Seconds work of this path preempted by a reclaim waits before it may borrow again,
    /// doubled with each further preemption of the same work (default: the nearest
    /// ancestor's, else 0: no backoff).
    #[serde(default)]
    pub requeue_backoff_s: Option<u64>,
    /// Seconds a request of this path owed, but not at once when it first asked (behind a
    /// larger request of its tenant, or only after its tenant's backlog ahead of it was
    /// served), waits while owed before it reclaims whatever its victims would lose; 0: at
    /// once, as a request owed at once when it first asks (Kueue's reclaim within the
    /// cohort). Default: the nearest ancestor's, else none: it reclaims only when its
    /// victims would lose no more than its waiting has cost (the ski-rental rule).
    #[serde(default)]
    pub owed_reclaim_after_s: Option<u64>,
}

/// The limits on one resource, in its unit as written (GPUs, cores, GiB): a JSON object
/// only, never serde's array of the fields in order.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(deny_unknown_fields, remote = "Self")]
pub struct Limits {
    /// What this path is always given when it asks (default: nothing of its own).
    #[serde(default)]
    pub guarantee: Option<f64>,
    /// What this path may never exceed, borrowed or not (default: no limit here).
    #[serde(default)]
    pub ceiling: Option<f64>,
    /// How much of the unused guarantee others may borrow (default: all of it).
    #[serde(default)]
    pub lending_limit: Option<f64>,
}

/// A struct read only from a JSON object. serde's derived impls also accept an array of the
/// fields in order (`"acme": [{}, null, null, 60]`), a second spelling that the policy
/// refuses everywhere else (and its JSON Schema does not describe); the derive with
/// `remote = "Self"` gives the fields' reader as an inherent function, and the trait impl
/// hands it only a map.
trait FromFields<'de>: Sized {
    /// The derived reader of the struct's fields.
    fn from_fields<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error>;
}

struct ObjectOf<T>(PhantomData<T>);

impl<'de, T: FromFields<'de>> Visitor<'de> for ObjectOf<T> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object")
    }

    fn visit_map<A: MapAccess<'de>>(self, access: A) -> Result<T, A::Error> {
        T::from_fields(MapAccessDeserializer::new(access))
    }
}

impl<'de> FromFields<'de> for QuotaEntry {
    fn from_fields<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        QuotaEntry::deserialize(deserializer)
    }
}

impl<'de> Deserialize<'de> for QuotaEntry {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(ObjectOf(PhantomData))
    }
}

impl<'de> FromFields<'de> for Limits {
    fn from_fields<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Limits::deserialize(deserializer)
    }
}

impl<'de> Deserialize<'de> for Limits {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(ObjectOf(PhantomData))
    }
}

/// Why a `quotas` section is not valid: where (the JSON path) and what.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
pub struct SpecError {
    /// The JSON path of the offending value, from the policy's root.
    pub path: String,
    /// What is wrong there.
    pub message: String,
}

fn err(path: impl Into<String>, message: impl Into<String>) -> SpecError {
    SpecError { path: path.into(), message: message.into() }
}

/// One resource's validated limits, in the resource's unit (micro-GPUs, millicores, MiB).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limit {
    pub guarantee: Option<u64>,
    pub ceiling: Option<u64>,
    pub lending_limit: Option<u64>,
}

/// One tenant path's validated quota.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quota {
    /// The tenant path (`acme/ml`).
    pub path: String,
    /// Resource → its limits; resources not named are not bounded at this path.
    pub limits: BTreeMap<Resource, Limit>,
    /// Seconds between SIGTERM and SIGKILL (inherited, else the default).
    pub grace_period_s: u64,
    /// Seconds borrowed work runs before a reclaim may take it (inherited, else 0).
    pub min_runtime_s: u64,
    /// Base of the requeue backoff after a preemption, seconds (inherited, else 0).
    pub requeue_backoff_s: u64,
    /// How long a request owed only later waits while owed before it reclaims whatever
    /// its victims lose, seconds (inherited, else `None`: the ski-rental rule only).
    pub owed_reclaim_after_s: Option<u64>,
}

impl Quota {
    /// The guarantees this path sets.
    pub fn guarantees(&self) -> Resources {
        self.limits
            .iter()
            .filter_map(|(r, l)| l.guarantee.map(|g| (r, g)))
            .fold(Resources::new(), |acc, (r, g)| acc.with(r.clone(), g))
    }
}

/// A validated `quotas` section: the quota of every path that has one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QuotaTree {
    quotas: BTreeMap<String, Quota>,
}

/// `path` and its ancestors, innermost first: `a/b/c`, `a/b`, `a`.
pub fn chain(path: &str) -> impl Iterator<Item = &str> {
    let mut next = Some(path);
    std::iter::from_fn(move || {
        let here = next?;
        next = here.rfind('/').map(|i| &here[..i]);
        Some(here)
    })
}

/// Whether `path` is `ancestor` or inside it.
pub fn is_within(path: &str, ancestor: &str) -> bool {
    path == ancestor
        || (path.len() > ancestor.len()
            && path.starts_with(ancestor)
            && path.as_bytes()[ancestor.len()] == b'/')
}

impl QuotaTree {
    /// The quota set on exactly `path`.
    pub fn get(&self, path: &str) -> Option<&Quota> {
        self.quotas.get(path)
    }

    /// Every quota, by path.
    pub fn iter(&self) -> impl Iterator<Item = &Quota> {
        self.quotas.values()
    }

    /// The quotas on `tenant` and its ancestors, innermost first.
    pub fn chain<'a>(&'a self, tenant: &'a str) -> impl Iterator<Item = &'a Quota> + 'a {
        chain(tenant).filter_map(move |p| self.quotas.get(p))
    }

    /// The grace period for reclaiming `tenant`'s work: the innermost quota's on its chain.
    pub fn grace_period_s(&self, tenant: &str) -> u64 {
        self.chain(tenant).next().map_or(DEFAULT_GRACE_PERIOD_S, |q| q.grace_period_s)
    }

    /// How long `tenant`'s borrowed work runs before a reclaim may take it: the innermost
    /// quota's on its chain (0: at once).
    pub fn min_runtime_s(&self, tenant: &str) -> u64 {
        self.chain(tenant).next().map_or(0, |q| q.min_runtime_s)
    }

    /// How long a request of `tenant` owed, but not at once when it first asked, waits while
    /// owed before it reclaims whatever its victims would lose: the innermost quota's on its
    /// chain (`None`: only under the ski-rental rule, [`crate::worth_reclaiming`]).
    pub fn owed_reclaim_after_s(&self, tenant: &str) -> Option<u64> {
        self.chain(tenant).next().and_then(|q| q.owed_reclaim_after_s)
    }

    /// How long work of `tenant` preempted `preemptions` times (at least once) waits before
    /// it may borrow again: the innermost quota's `requeue_backoff_s` on its chain, doubled
    /// for each preemption after the first, at most [`REQUEUE_BACKOFF_DOUBLINGS`] times and
    /// never beyond [`MAX_REQUEUE_BACKOFF_S`]. 0 when no quota sets one.
    pub fn requeue_backoff_s(&self, tenant: &str, preemptions: u32) -> u64 {
        let base = self.chain(tenant).next().map_or(0, |q| q.requeue_backoff_s);
        let doublings = preemptions.saturating_sub(1).min(REQUEUE_BACKOFF_DOUBLINGS);
        base.saturating_mul(1 << doublings).min(MAX_REQUEUE_BACKOFF_S.max(base))
    }
}

impl QuotaTree {
    /// The first quota, in path order, that guarantees `resource`, if any.
    pub fn guarantor(&self, resource: &Resource) -> Option<&Quota> {
        self.iter().find(|q| q.limits.get(resource).is_some_and(|l| l.guarantee.is_some()))
    }

    /// The nearest descendants of `path` that guarantee `resource`: those with no quota
    /// strictly between them and `path` that guarantees it too.
    pub fn guaranteed_children<'a>(
        &'a self,
        path: &'a str,
        resource: &'a Resource,
    ) -> impl Iterator<Item = &'a Quota> + 'a {
        let guarantees = move |p: &str| {
            self.get(p).and_then(|q| q.limits.get(resource)).is_some_and(|l| l.guarantee.is_some())
        };
        self.iter().filter(move |d| {
            d.path != path
                && is_within(&d.path, path)
                && guarantees(&d.path)
                && !chain(&d.path).skip(1).take_while(|p| *p != path).any(guarantees)
        })
    }
}

impl QuotaSpec {
    /// Validates the section found at JSON path `at` (`quotas` in a policy).
    /// `tenant_exists` says whether a tenant path is a node of the policy's tenant tree.
    ///
    /// Checks: every key is a tenant path of the tree; every GPU model is a catalog model;
    /// every amount is a finite number in `[0, 1e6]`; a ceiling is at least the guarantee;
    /// a lending limit is at most the guarantee (and needs one); and the guarantees of a
    /// path's nearest descendants that set one fit in its guarantee (or, where it sets
    /// none, in its ceiling).
    pub fn validate(
        &self,
        at: &str,
        tenant_exists: impl Fn(&str) -> bool,
    ) -> Result<QuotaTree, SpecError> {
        let mut quotas = BTreeMap::new();
        for (key, entry) in &self.0 .0 {
            let here = format!("{at}.{}", untrusted(key));
            if tessera_api::TenantPath::new(key.as_str()).is_err() {
                return Err(err(
                    &here,
                    format!(
                        "`{}` is not a tenant path: expected org[/team[/project[/user]]], \
                         each {}",
                        untrusted(key),
                        tessera_api::ids::TENANT_NAME_EXPECTED
                    ),
                ));
            }
            if !tenant_exists(key) {
                return Err(err(
                    &here,
                    format!(
                        "no tenant `{key}` in orgs: a quota must name a node of the tenant tree"
                    ),
                ));
            }
            let mut limits = BTreeMap::new();
            for (model, l) in &entry.gpus.0 {
                let l_at = format!("{here}.gpus.{}", untrusted(model));
                if catalog::model(model).is_none() {
                    let known: Vec<&str> = catalog::model_names().collect();
                    return Err(err(
                        l_at,
                        format!(
                            "unknown GPU model `{}`: expected one of {}",
                            untrusted(model),
                            known.join(", ")
                        ),
                    ));
                }
                limits.insert(Resource::gpu(model), limit(&l_at, l, MICRO_PER_GPU as f64)?);
            }
            if let Some(l) = &entry.cpu_cores {
                limits.insert(
                    Resource::Cpu,
                    limit(&format!("{here}.cpu_cores"), l, MILLI_PER_CORE as f64)?,
                );
            }
            if let Some(l) = &entry.memory_gib {
                limits.insert(
                    Resource::Memory,
                    limit(&format!("{here}.memory_gib"), l, MIB_PER_GIB as f64)?,
                );
            }
            for (field, value, max) in [
                ("grace_period_s", entry.grace_period_s, MAX_GRACE_PERIOD_S),
                ("min_runtime_s", entry.min_runtime_s, MAX_MIN_RUNTIME_S),
                ("requeue_backoff_s", entry.requeue_backoff_s, MAX_REQUEUE_BACKOFF_S),
                ("owed_reclaim_after_s", entry.owed_reclaim_after_s, MAX_OWED_RECLAIM_AFTER_S),
            ] {
                if let Some(v) = value.filter(|v| *v > max) {
                    return Err(err(
                        format!("{here}.{field}"),
                        format!("expected 0 to {max} seconds, got {v}"),
                    ));
                }
            }
            quotas.insert(key.clone(), (limits, entry.clone()));
        }
        // Times are inherited: parents come before children in path order.
        let mut tree = QuotaTree::default();
        for (path, (limits, entry)) in quotas {
            let parent = chain(&path).skip(1).find_map(|p| tree.quotas.get(p));
            let inherit = |own: Option<u64>, of: fn(&Quota) -> u64, default: u64| {
                own.unwrap_or_else(|| parent.map_or(default, of))
            };
            let quota = Quota {
                path: path.clone(),
                limits,
                grace_period_s: inherit(
                    entry.grace_period_s,
                    |q| q.grace_period_s,
                    DEFAULT_GRACE_PERIOD_S,
                ),
                min_runtime_s: inherit(entry.min_runtime_s, |q| q.min_runtime_s, 0),
                requeue_backoff_s: inherit(entry.requeue_backoff_s, |q| q.requeue_backoff_s, 0),
                owed_reclaim_after_s: entry
                    .owed_reclaim_after_s
                    .or_else(|| parent.and_then(|q| q.owed_reclaim_after_s)),
            };
            tree.quotas.insert(path, quota);
        }
        check_nesting(&tree, at)?;
        Ok(tree)
    }
}

/// One resource's limits in its unit (`per` of them to one as written).
fn limit(at: &str, l: &Limits, per: f64) -> Result<Limit, SpecError> {
    let amount = |name: &str, v: Option<f64>| -> Result<Option<u64>, SpecError> {
        match v {
            None => Ok(None),
            Some(v) if v.is_finite() && (0.0..=MAX_LIMIT).contains(&v) => {
                // Exact for every value a person writes with up to 6 decimals.
                Ok(Some((v * per).round() as u64))
            }
            Some(v) => Err(err(
                format!("{at}.{name}"),
                format!("expected a number from 0 to {MAX_LIMIT}, got {v}"),
            )),
        }
    };
    let out = Limit {
        guarantee: amount("guarantee", l.guarantee)?,
        ceiling: amount("ceiling", l.ceiling)?,
        lending_limit: amount("lending_limit", l.lending_limit)?,
    };
    if out.guarantee.is_none() && out.ceiling.is_none() {
        return Err(err(at, "expected a guarantee, a ceiling or both"));
    }
    if let (Some(g), Some(c)) = (out.guarantee, out.ceiling) {
        if c < g {
            return Err(err(
                format!("{at}.ceiling"),
                format!(
                    "the ceiling ({}) is below the guarantee ({}): a ceiling must be at least \
                     the guarantee",
                    fmt_num(l.ceiling),
                    fmt_num(l.guarantee)
                ),
            ));
        }
    }
    match (out.lending_limit, out.guarantee) {
        (Some(_), None) => Err(err(
            format!("{at}.lending_limit"),
            "a lending limit needs a guarantee to lend from",
        )),
        (Some(lend), Some(g)) if lend > g => Err(err(
            format!("{at}.lending_limit"),
            format!(
                "the lending limit ({}) is above the guarantee ({}): only a guarantee can be lent",
                fmt_num(l.lending_limit),
                fmt_num(l.guarantee)
            ),
        )),
        _ => Ok(out),
    }
}

fn fmt_num(v: Option<f64>) -> String {
    v.map_or_else(String::new, |v| v.to_string())
}

/// Children's guarantees fit in their parent's: for every path P and resource r that P
/// bounds, the guarantees of P's nearest descendants that set a guarantee of r sum to at
/// most P's guarantee of r, or its ceiling where it sets no guarantee.
fn check_nesting(tree: &QuotaTree, at: &str) -> Result<(), SpecError> {
    for parent in tree.iter() {
        for (resource, limit) in &parent.limits {
            let (bound, what) = match (limit.guarantee, limit.ceiling) {
                (Some(g), _) => (g, "guarantee"),
                (None, Some(c)) => (c, "ceiling"),
                (None, None) => continue,
            };
            let nearest: Vec<(&str, u64)> = tree
                .iter()
                .filter(|d| d.path != parent.path && is_within(&d.path, &parent.path))
                .filter_map(|d| {
                    let g = d.limits.get(resource)?.guarantee?;
                    // Nearest: no quota strictly between sets a guarantee of this resource.
                    let shadowed =
                        chain(&d.path).skip(1).take_while(|p| *p != parent.path).any(|p| {
                            tree.get(p)
                                .and_then(|q| q.limits.get(resource))
                                .is_some_and(|l| l.guarantee.is_some())
                        });
                    (!shadowed).then_some((d.path.as_str(), g))
                })
                .collect();
            let sum: u64 = nearest.iter().map(|(_, g)| g).sum();
            if sum > bound {
                let parts: Vec<String> =
                    nearest.iter().map(|(p, g)| format!("{p} {}", resource.show(*g))).collect();
                return Err(err(
                    format!("{at}.{}.{}.{what}", parent.path, resource.spec_path()),
                    format!(
                        "the guarantees under {} sum to {} ({}), more than its {what} of {}: \
                         children's guarantees must fit in their parent's",
                        parent.path,
                        resource.show(sum),
                        parts.join(", "),
                        resource.show(bound)
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// A JSON object read into a sorted map, refusing duplicate keys.
pub use tessera_api::UniqueMap;
