//! From bytes to a [`Policy`]: structural errors from serde (with the path that
//! `serde_path_to_error` tracked), then semantic checks that report paths in the same
//! format (`identity[0].map.team-dev`).

use std::collections::{BTreeMap, BTreeSet};

use serde_json::error::Category;
use tessera_api::{untrusted, Isolation};

use crate::raw::{Object, RawIdentityRule, RawNodePool, RawOrg, RawPolicy, RawTier, RawTiers};
use crate::{
    IdentityRule, NodePattern, NodePool, Policy, PolicyError, Price, Tenant, Tiers, Trust,
};

/// A semantic problem: where, and what was expected.
#[derive(Debug)]
pub(crate) struct Problem {
    pub path: String,
    pub message: String,
}

fn problem(path: impl Into<String>, message: impl Into<String>) -> Problem {
    Problem { path: path.into(), message: message.into() }
}

const NAME_EXPECTED: &str =
    "expected 1 to 63 characters of a-z, 0-9, `_` and `-`, starting with a letter or digit";
const TENANT_EXPECTED: &str = "expected org, org/team, org/team/project or org/team/project/user";
/// The tenant tree's levels and names are the API's ([`tessera_api::TenantPath`]).
use tessera_api::ids::TENANT_LEVELS as LEVELS;

pub(crate) fn deserialize(bytes: &[u8], file: &str) -> Result<RawPolicy, PolicyError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let raw: Object<RawPolicy> = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = shown_path(e.path());
        from_json(e.into_inner(), path, file)
    })?;
    de.end().map_err(|e| from_json(e, String::new(), file))?;
    Ok(raw.0)
}

/// The JSON path serde_path_to_error tracked, as the semantic checks write theirs
/// (`orgs.acme.teams`, `identity[0].map`), each key shown with [`untrusted`] (a key is
/// whatever the file says: a newline or ESC in it is escaped, a 10,000-character key cut).
/// The segments where it lost track (inside a value that never finished parsing) are left
/// out.
fn shown_path(path: &serde_path_to_error::Path) -> String {
    use serde_path_to_error::Segment;
    let mut out = String::new();
    for segment in path {
        match segment {
            Segment::Seq { index } => out.push_str(&format!("[{index}]")),
            Segment::Map { key } | Segment::Enum { variant: key } => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(&untrusted(key).to_string());
            }
            Segment::Unknown => {}
        }
    }
    out
}

/// The longest message a structural error shows: serde's own (an unknown field and the
/// fields expected, a wrong type) are a few hundred characters; the rest is the file's
/// text quoted back.
const MAX_SCHEMA_MESSAGE_CHARS: usize = 1024;

fn from_json(e: serde_json::Error, path: String, file: &str) -> PolicyError {
    let (line, column) = (e.line(), e.column());
    let full = e.to_string();
    // serde_json appends the position; we report it in our own words. serde quotes the
    // offending text back (`unknown field `…``, `invalid type: string "…"`): escaped and
    // bounded like any text from the file.
    let message = full.strip_suffix(&format!(" at line {line} column {column}")).unwrap_or(&full);
    let message = untrusted(message).max_chars(MAX_SCHEMA_MESSAGE_CHARS).to_string();
    let file = file.to_string();
    match e.classify() {
        Category::Data => PolicyError::Schema { file, path, line, column, message },
        Category::Syntax | Category::Eof | Category::Io => {
            PolicyError::Syntax { file, path, line, column, message }
        }
    }
}

/// `[a-z0-9][a-z0-9_-]{0,62}`: one segment of a tenant path
/// ([`tessera_api::ids::is_tenant_name`], the one definition).
pub(crate) fn is_name(s: &str) -> bool {
    tessera_api::ids::is_tenant_name(s)
}

fn check_name(path: &str, name: &str) -> Result<(), Problem> {
    if is_name(name) {
        Ok(())
    } else {
        Err(problem(path, format!("invalid name `{name}`: {NAME_EXPECTED}")))
    }
}

pub(crate) fn build(raw: RawPolicy, digest: String) -> Result<Policy, Problem> {
    if raw.version < 1 {
        return Err(problem("version", "version must be at least 1, got 0"));
    }
    let tiers = build_tiers(&raw.tiers)?;
    let tenants = build_tree(&raw.orgs.0)?;
    let index: BTreeMap<String, usize> =
        tenants.iter().enumerate().map(|(i, t)| (t.path.to_string(), i)).collect();
    let identity = build_identity(&raw.identity, &index)?;
    if let Some(default) = &raw.default_tenant {
        check_tenant_ref("default_tenant", default, &index)?;
    }
    let node_pools = raw
        .node_pools
        .0
        .iter()
        .map(|(name, pool)| build_pool(name, pool, &index))
        .collect::<Result<Vec<_>, _>>()?;
    let mut prices = BTreeMap::new();
    for (model, p) in &raw.prices.0 {
        let at = format!("prices.{model}");
        if model.trim().is_empty() {
            return Err(problem("prices", "a GPU model name may not be empty"));
        }
        let reserved = check_rate(&format!("{at}.reserved_per_gpu_hour"), p.reserved_per_gpu_hour)?;
        let burst = match p.burst_per_gpu_hour {
            Some(b) => check_rate(&format!("{at}.burst_per_gpu_hour"), b)?,
            None => reserved,
        };
        let premium = match p.nvlink_premium_per_gpu_hour {
            Some(n) => check_rate(&format!("{at}.nvlink_premium_per_gpu_hour"), n)?,
            None => 0.0,
        };
        prices.insert(
            model.clone(),
            Price {
                reserved_per_gpu_hour: reserved,
                burst_per_gpu_hour: burst,
                nvlink_premium_per_gpu_hour: premium,
            },
        );
    }
    let mut mig_weights = BTreeMap::new();
    for (profile, &w) in &raw.mig_weights.0 {
        let at = format!("mig_weights.{profile}");
        if format!("mig={profile}").parse::<tessera_api::GpuRequest>().is_err() {
            return Err(problem(
                at,
                format!("`{profile}` is not a MIG profile name such as 1g.10gb"),
            ));
        }
        if !(w.is_finite() && w > 0.0 && w <= 1.0) {
            return Err(problem(
                at,
                format!("weight must be a fraction of one GPU in (0, 1], got {w}"),
            ));
        }
        mig_weights.insert(profile.clone(), w);
    }
    let mps_max_percent = match &raw.mps {
        None => 100,
        Some(m) => match u8::try_from(m.max_percent) {
            Ok(p) if (1..=100).contains(&p) => p,
            _ => {
                return Err(problem(
                    "mps.max_percent",
                    format!("expected a percentage from 1 to 100, got {}", m.max_percent),
                ))
            }
        },
    };
    let sharing = match &raw.sharing {
        None => crate::Sharing::default(),
        Some(sh) => {
            if !(1..=64).contains(&sh.replicas) {
                return Err(problem(
                    "sharing.replicas",
                    format!("expected 1 to 64 replicas per GPU, got {}", sh.replicas),
                ));
            }
            let mut domains = BTreeMap::new();
            let mut owner: BTreeMap<&str, &str> = BTreeMap::new();
            for (name, prefixes) in &sh.domains.0 {
                let at = format!("sharing.domains.{name}");
                check_name(&at, name)?;
                if prefixes.is_empty() {
                    return Err(problem(at, "a sharing domain needs at least one tenant path"));
                }
                for (i, prefix) in prefixes.iter().enumerate() {
                    let p_at = format!("{at}[{i}]");
                    check_tenant_ref(&p_at, prefix, &index)?;
                    if let Some(other) = owner.insert(prefix.as_str(), name.as_str()) {
                        return Err(problem(p_at, format!("tenant {prefix} is already in sharing domain {other}: a tenant belongs to one domain")));
                    }
                }
                domains.insert(name.clone(), prefixes.clone());
            }
            crate::Sharing { replicas: sh.replicas, domains }
        }
    };
    let mut scrub = crate::ScrubSettings::default();
    if let Some(sc) = &raw.scrub {
        if let Some(v) = sc.same_tenant_skip {
            scrub.same_tenant_skip = v;
        }
        if let Some(c) = sc.min_coverage {
            if !(c.is_finite() && c > 0.0 && c <= 1.0) {
                return Err(problem(
                    "scrub.min_coverage",
                    format!("expected a fraction in (0, 1], got {c}"),
                ));
            }
            scrub.min_coverage = c;
        }
        if let Some(t) = sc.timeout_s {
            if !(1..=3600).contains(&t) {
                return Err(problem(
                    "scrub.timeout_s",
                    format!("expected 1 to 3600 seconds, got {t}"),
                ));
            }
            scrub.timeout_s = t;
        }
        if let Some(m) = sc.max_attempts {
            if !(1..=10).contains(&m) {
                return Err(problem(
                    "scrub.max_attempts",
                    format!("expected 1 to 10 attempts, got {m}"),
                ));
            }
            scrub.max_attempts = m;
        }
    }
    let quotas = match &raw.quotas {
        None => quota::QuotaTree::default(),
        Some(spec) => spec
            .validate("quotas", |t| index.contains_key(t))
            .map_err(|e| problem(e.path, e.message))?,
    };
    let mut gang_timeout_s = crate::DEFAULT_GANG_TIMEOUT_S;
    if let Some(t) = raw.gangs.as_ref().and_then(|g| g.timeout_s) {
        if !(1..=crate::MAX_GANG_TIMEOUT_S).contains(&t) {
            return Err(problem(
                "gangs.timeout_s",
                format!("expected 1 to {} seconds, got {t}", crate::MAX_GANG_TIMEOUT_S),
            ));
        }
        gang_timeout_s = t;
    }
    let billing = match &raw.billing {
        None => crate::billing::Billing::default(),
        Some(b) => b.build(|at, tenant| check_tenant_ref(at, tenant, &index))?,
    };
    let faults = build_faults(raw.faults.as_ref())?;
    let topology = build_topology(raw.topology.as_ref());
    let interference = build_interference(raw.interference.as_ref(), |t| index.contains_key(t))?;
    Ok(Policy {
        billing,
        faults,
        topology,
        interference,
        quotas,
        gang_timeout_s,
        scrub,
        mps_max_percent,
        sharing,
        prices,
        mig_weights,
        version: raw.version,
        digest,
        tiers,
        tenants,
        index,
        identity,
        default_tenant: raw.default_tenant,
        node_pools,
    })
}

fn check_rate(path: &str, rate: f64) -> Result<f64, Problem> {
    if rate.is_finite() && rate >= 0.0 {
        Ok(rate)
    } else {
        Err(problem(path, format!("a rate per GPU-hour must be a finite number >= 0, got {rate}")))
    }
}

fn build_tiers(raw: &RawTiers) -> Result<Tiers, Problem> {
    let check = |trust: Trust, tier: &RawTier| -> Result<Vec<Isolation>, Problem> {
        let path = format!("tiers.{trust}.allow");
        if tier.allow.is_empty() {
            return Err(problem(
                path,
                "empty allow list: expected at least one of gpu, mig, mps, shared \
                 (to keep a tier from the node, give its tenants no identity instead)",
            ));
        }
        let allow: Vec<Isolation> = tier.allow.iter().map(|n| n.0).collect();
        for (i, iso) in allow.iter().enumerate() {
            let at = format!("{path}[{i}]");
            // The invariant the whole runtime leans on: MPS and time-slicing share a
            // GPU's memory between tenants, so untrusted code never gets them.
            if trust == Trust::Untrusted && !matches!(iso, Isolation::Gpu | Isolation::Mig) {
                return Err(problem(
                    at,
                    format!(
                        "untrusted tenants may only use gpu or mig isolation, not {iso}: \
                         {iso} gives no memory isolation between tenants"
                    ),
                ));
            }
            if let Some(first) = allow[..i].iter().position(|x| x == iso) {
                return Err(problem(
                    at,
                    format!("duplicate isolation `{iso}`: already listed at {path}[{first}]"),
                ));
            }
        }
        Ok(allow)
    };
    Ok(Tiers {
        untrusted: check(Trust::Untrusted, &raw.untrusted)?,
        trusted: check(Trust::Trusted, &raw.trusted)?,
        dev: check(Trust::Dev, &raw.dev)?,
    })
}

/// A tenant path of the tree, its names checked ([`check_name`]): typed here, once.
fn tenant_path(at: &str, path: &str) -> Result<tessera_api::TenantPath, Problem> {
    tessera_api::TenantPath::new(path).map_err(|e| problem(at, e.to_string()))
}

fn build_tree(orgs: &BTreeMap<String, Object<RawOrg>>) -> Result<Vec<Tenant>, Problem> {
    if orgs.is_empty() {
        return Err(problem("orgs", "no orgs: expected at least one org"));
    }
    let mut out = Vec::new();
    for (org_name, org) in orgs {
        let org_at = format!("orgs.{org_name}");
        check_name(&org_at, org_name)?;
        let org_trust = org.trust.ok_or_else(|| {
            problem(
                format!("{org_at}.trust"),
                "missing trust: every org must set one of untrusted, trusted, dev \
                 (its teams, projects and users inherit it)",
            )
        })?;
        out.push(Tenant { path: tenant_path(&org_at, org_name)?, trust: org_trust });
        for (team_name, team) in &org.teams.0 {
            let team_at = format!("{org_at}.teams.{team_name}");
            check_name(&team_at, team_name)?;
            let team_trust = team.trust.unwrap_or(org_trust);
            let team_path = format!("{org_name}/{team_name}");
            out.push(Tenant { path: tenant_path(&team_at, &team_path)?, trust: team_trust });
            for (project_name, project) in &team.projects.0 {
                let project_at = format!("{team_at}.projects.{project_name}");
                check_name(&project_at, project_name)?;
                let project_trust = project.trust.unwrap_or(team_trust);
                let project_path = format!("{team_path}/{project_name}");
                out.push(Tenant {
                    path: tenant_path(&project_at, &project_path)?,
                    trust: project_trust,
                });
                let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
                for (i, user) in project.users.iter().enumerate() {
                    let at = format!("{project_at}.users[{i}]");
                    check_name(&at, user)?;
                    if let Some(first) = seen.insert(user, i) {
                        return Err(problem(
                            at,
                            format!(
                                "duplicate user `{user}`: already listed at \
                                 {project_at}.users[{first}]"
                            ),
                        ));
                    }
                }
                for user in seen.keys() {
                    out.push(Tenant {
                        path: tenant_path(&project_at, &format!("{project_path}/{user}"))?,
                        trust: project_trust,
                    });
                }
            }
        }
    }
    Ok(out)
}

/// A reference to a tenant (identity target, default_tenant, pool restriction) must be a
/// well-formed path to an existing node of the tree.
fn check_tenant_ref(at: &str, path: &str, index: &BTreeMap<String, usize>) -> Result<(), Problem> {
    let segments: Vec<&str> = path.split('/').collect();
    if segments.len() > LEVELS.len() || !segments.iter().all(|s| is_name(s)) {
        return Err(problem(at, format!("malformed tenant path `{path}`: {TENANT_EXPECTED}")));
    }
    if index.contains_key(path) {
        return Ok(());
    }
    // Name the deepest existing ancestor, so a typo is easy to find.
    let mut parent = String::new();
    for (depth, segment) in segments.iter().enumerate() {
        let here = if depth == 0 { segment.to_string() } else { format!("{parent}/{segment}") };
        if !index.contains_key(&here) {
            let level = LEVELS[depth];
            let message = if depth == 0 {
                format!("no tenant `{path}`: there is no org `{segment}` in orgs")
            } else {
                format!(
                    "no tenant `{path}`: {} `{parent}` has no {level} `{segment}`",
                    LEVELS[depth - 1]
                )
            };
            return Err(problem(at, message));
        }
        parent = here;
    }
    Err(problem(at, format!("no tenant `{path}` in orgs")))
}

fn build_identity(
    rules: &[Object<RawIdentityRule>],
    index: &BTreeMap<String, usize>,
) -> Result<Vec<IdentityRule>, Problem> {
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    let mut out = Vec::with_capacity(rules.len());
    for (i, rule) in rules.iter().enumerate() {
        let at = format!("identity[{i}]");
        let name = rule.annotation.as_str();
        if name.is_empty() {
            return Err(problem(
                format!("{at}.annotation"),
                "empty annotation name: expected the name of an annotation that the \
                 container runtime sets, e.g. io.kubernetes.cri.sandbox-namespace",
            ));
        }
        if name.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(problem(
                format!("{at}.annotation"),
                format!("malformed annotation name {name:?}: expected no whitespace or control characters"),
            ));
        }
        if let Some(first) = seen.insert(name, i) {
            return Err(problem(
                format!("{at}.annotation"),
                format!(
                    "duplicate annotation `{name}`: identity[{first}] already reads it, so \
                     this rule could never decide"
                ),
            ));
        }
        if rule.map.0.is_empty() {
            return Err(problem(
                format!("{at}.map"),
                "empty map: expected at least one annotation value mapped to a tenant path",
            ));
        }
        for (value, target) in &rule.map.0 {
            check_tenant_ref(&format!("{at}.map.{value}"), target, index)?;
        }
        if let Some(engines) = &rule.engines {
            if engines.is_empty() {
                return Err(problem(
                    format!("{at}.engines"),
                    "empty list: a rule for no engine could never decide; remove `engines` to \
                     read the rule for every container",
                ));
            }
            for (j, e) in engines.iter().enumerate() {
                if !valid_engine(e) {
                    return Err(problem(
                        format!("{at}.engines[{j}]"),
                        format!(
                            "malformed engine name {e:?}: expected 1 to 63 of a-z, 0-9, `.`, `_`, \
                             `-`, starting with a letter or digit (a runtime.toml `engine`)"
                        ),
                    ));
                }
                if engines[..j].contains(e) {
                    return Err(problem(
                        format!("{at}.engines[{j}]"),
                        format!("duplicate engine `{e}`"),
                    ));
                }
            }
        }
        out.push(IdentityRule {
            annotation: rule.annotation.clone(),
            map: rule.map.0.clone(),
            engines: rule.engines.clone(),
        });
    }
    Ok(out)
}

/// tessera-runtime's rule for its configuration's `engine` (crates/runtime-hook config.rs).
fn valid_engine(name: &str) -> bool {
    let b = name.as_bytes();
    (1..=63).contains(&b.len())
        && (b[0].is_ascii_lowercase() || b[0].is_ascii_digit())
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"._-".contains(c))
}

fn parse_node_pattern(s: &str) -> Option<NodePattern> {
    let (body, glob) = match s.strip_suffix('*') {
        Some(prefix) => (prefix, true),
        None => (s, false),
    };
    let ok = body.bytes().all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c));
    match (ok, glob) {
        (true, true) => Some(NodePattern::Prefix(body.to_string())),
        (true, false) if !body.is_empty() => Some(NodePattern::Exact(body.to_string())),
        _ => None,
    }
}

fn build_pool(
    name: &str,
    raw: &RawNodePool,
    index: &BTreeMap<String, usize>,
) -> Result<NodePool, Problem> {
    let at = format!("node_pools.{name}");
    check_name(&at, name)?;
    if raw.nodes.is_empty() {
        return Err(problem(
            format!("{at}.nodes"),
            "empty nodes list: expected at least one node name or prefix glob such as sim-h100-*",
        ));
    }
    let mut nodes = Vec::with_capacity(raw.nodes.len());
    for (i, node) in raw.nodes.iter().enumerate() {
        let node_at = format!("{at}.nodes[{i}]");
        let pattern = parse_node_pattern(node).ok_or_else(|| {
            problem(
                &node_at,
                format!(
                    "malformed node pattern `{node}`: expected an exact node name or a prefix \
                     followed by one trailing `*` (letters, digits, `.`, `_`, `-`)"
                ),
            )
        })?;
        if let Some(first) = raw.nodes[..i].iter().position(|n| n == node) {
            return Err(problem(
                node_at,
                format!("duplicate node pattern `{node}`: already listed at {at}.nodes[{first}]"),
            ));
        }
        nodes.push(pattern);
    }
    let tenants = match &raw.tenants {
        None => None,
        Some(list) => {
            let mut seen = BTreeSet::new();
            for (i, tenant) in list.iter().enumerate() {
                let tenant_at = format!("{at}.tenants[{i}]");
                check_tenant_ref(&tenant_at, tenant, index)?;
                if !seen.insert(tenant.as_str()) {
                    return Err(problem(tenant_at, format!("duplicate tenant `{tenant}`")));
                }
            }
            Some(list.clone())
        }
    };
    let mut mig_layouts = BTreeMap::new();
    for (model_name, text) in &raw.mig_layouts.0 {
        let l_at = format!("{at}.mig_layouts.{model_name}");
        let model = catalog::model(model_name).ok_or_else(|| {
            let known: Vec<&str> = catalog::MODELS.iter().map(|m| m.name).collect();
            problem(
                &l_at,
                format!("unknown GPU model `{model_name}`: expected one of {}", known.join(", ")),
            )
        })?;
        let layout: catalog::DeclaredLayout =
            text.parse().map_err(|e| problem(&l_at, format!("malformed layout `{text}`: {e}")))?;
        layout.resolve(model).map_err(|e| {
            problem(&l_at, format!("layout `{text}` is not legal on {model_name}: {e}"))
        })?;
        mig_layouts.insert(model_name.clone(), layout);
    }
    Ok(NodePool { name: name.to_string(), nodes, tenants, mig_layouts })
}

// The node-health sections (issue 26).

/// The longest grace a fault or interference stop may wait (as revoke's).
const MAX_GRACE_S: u64 = 300;

pub(crate) fn build_faults(
    raw: Option<&crate::raw::Object<crate::raw::RawFaults>>,
) -> Result<crate::health::FaultSettings, Problem> {
    let mut out = crate::health::FaultSettings::default();
    let Some(raw) = raw else { return Ok(out) };
    for (i, xid) in raw.ignore_xids.iter().enumerate() {
        if *xid == 0 || *xid > 65_535 {
            return Err(problem(
                format!("faults.ignore_xids[{i}]"),
                format!("expected an XID from 1 to 65535, got {xid}"),
            ));
        }
        if [48u64, 63, 64, 79, 94, 95].contains(xid) {
            return Err(problem(
                format!("faults.ignore_xids[{i}]"),
                format!("XID {xid} is a hardware fault; it cannot be ignored"),
            ));
        }
    }
    out.ignore_xids = raw.ignore_xids.clone();
    out.ignore_xids.sort_unstable();
    out.ignore_xids.dedup();
    if let Some(s) = raw.stop_holders {
        out.stop_holders = s;
    }
    if let Some(g) = raw.grace_s {
        out.grace_s = grace("faults.grace_s", g)?;
    }
    Ok(out)
}

fn grace(path: &str, g: u64) -> Result<u64, Problem> {
    if g > MAX_GRACE_S {
        return Err(problem(path, format!("expected 0 to {MAX_GRACE_S} seconds, got {g}")));
    }
    Ok(g)
}

pub(crate) fn build_topology(
    raw: Option<&crate::raw::Object<crate::raw::RawTopology>>,
) -> crate::health::TopologySettings {
    let Some(raw) = raw else { return crate::health::TopologySettings::default() };
    crate::health::TopologySettings {
        isolate_nvlink_domains: raw.isolate_nvlink_domains.unwrap_or(false),
        pin_cpus: raw.pin_cpus.unwrap_or(false),
    }
}

pub(crate) fn build_interference(
    raw: Option<&crate::raw::Object<crate::raw::RawInterference>>,
    tenant_known: impl Fn(&str) -> bool,
) -> Result<crate::health::InterferenceSettings, Problem> {
    let mut out = crate::health::InterferenceSettings::default();
    let Some(raw) = raw else { return Ok(out) };
    if let Some(e) = raw.enabled {
        out.enabled = e;
    }
    for (prefix, class) in &raw.classes.0 {
        let at = format!("interference.classes.{prefix}");
        if !tenant_known(prefix) {
            return Err(problem(at.clone(), format!("`{prefix}` is no tenant of this policy")));
        }
        out.classes.insert(prefix.clone(), *class);
    }
    let fraction = |path: &str, v: Option<f64>, default: f64| -> Result<f64, Problem> {
        match v {
            None => Ok(default),
            Some(f) if f.is_finite() && f > 0.0 && f < 1.0 => Ok(f),
            Some(f) => Err(problem(path, format!("expected a fraction in (0, 1), got {f}"))),
        }
    };
    out.min_share = fraction("interference.min_share", raw.min_share, out.min_share)?;
    out.saturation = fraction("interference.saturation", raw.saturation, out.saturation)?;
    let samples = |path: &str, v: Option<u32>, default: u32| -> Result<u32, Problem> {
        match v {
            None => Ok(default),
            Some(n) if (1..=1000).contains(&n) => Ok(n),
            Some(n) => Err(problem(path, format!("expected 1 to 1000 samples, got {n}"))),
        }
    };
    out.confirm_samples =
        samples("interference.confirm_samples", raw.confirm_samples, out.confirm_samples)?;
    out.clear_samples =
        samples("interference.clear_samples", raw.clear_samples, out.clear_samples)?;
    if raw.stop_after_samples.is_some() {
        out.stop_after_samples =
            Some(samples("interference.stop_after_samples", raw.stop_after_samples, 0)?);
    }
    if let Some(f) = raw.throttle_factor_percent {
        if f >= 100 {
            return Err(problem(
                "interference.throttle_factor_percent",
                format!("expected 0 (no throttle) to 99 percent, got {f}"),
            ));
        }
        out.throttle_factor_percent = f;
    }
    if let Some(m) = raw.min_percent {
        if !(1..=100).contains(&m) {
            return Err(problem(
                "interference.min_percent",
                format!("expected a percentage from 1 to 100, got {m}"),
            ));
        }
        out.min_percent = m;
    }
    if let Some(a) = raw.anti_affinity {
        out.anti_affinity = a;
    }
    if let Some(h) = raw.harden {
        out.harden = h;
    }
    if let Some(g) = raw.stop_grace_s {
        out.stop_grace_s = grace("interference.stop_grace_s", g)?;
    }
    Ok(out)
}
