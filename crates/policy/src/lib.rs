//! Tessera's policy: who a container belongs to, and what kind of GPU share that tenant
//! may have on this node.
//!
//! # The model
//!
//! * **Tenants** form a tree, `org → team → project → user`, written as slash paths
//!   (`acme`, `acme/research`, `acme/research/sandbox`, `acme/research/sandbox/guest`).
//!   Every node of the tree is a tenant.
//! * **Trust** is one of [`Trust::Untrusted`], [`Trust::Trusted`], [`Trust::Dev`]. Each
//!   org must set it; teams, projects and users inherit their parent's unless they set
//!   their own (users cannot: they take their project's).
//! * **Tiers** map each trust level to the [`Isolation`] kinds it may use. The defaults
//!   are `untrusted: gpu, mig`, `trusted: gpu, mig, mps`, `dev: all four`. Whatever the
//!   file says, untrusted tenants never get `mps` or `shared`: those give no memory
//!   isolation between tenants, so a policy that allows them is rejected at parse time.
//! * **Identity** comes only from OCI annotations that the policy names in its ordered
//!   `identity` rules (annotations that the container runtime sets, such as the CRI's
//!   pod namespace, never ones the image or the user controls). The first rule whose
//!   annotation is present decides; a value it does not map is refused rather than
//!   guessed. With no rule's annotation present, `default_tenant` applies if set, and the
//!   container is refused otherwise. The image's environment is never read for identity.
//!   A rule may name `engines`: it is then read only for containers whose
//!   [`ENGINE_ANNOTATION`] (set by tessera-runtime from its root-owned configuration file,
//!   refused in a container's config) is one of them, so an annotation that users of
//!   another engine can set themselves (podman's `--annotation`) decides nothing there.
//! * **Node pools** name groups of nodes (exact names or `prefix*` globs) and may restrict
//!   them to some subtrees of the tenant tree. A node in several pools obeys each pool's
//!   restriction; a node in no pool has none.
//!
//! # The crate
//!
//! Pure: [`Policy::parse`] turns bytes into a validated [`Policy`] or a [`PolicyError`]
//! that names the JSON path of the problem; [`Policy::resolve_identity`] and
//! [`Policy::authorize`] are decisions without side effects. The only I/O is the
//! convenience [`Policy::load`].
//!
//! ```
//! use std::collections::BTreeMap;
//! use policy::{GpuRequest, Policy, Trust};
//!
//! let policy = Policy::parse(br#"{
//!     "version": 1,
//!     "orgs": {"acme": {"trust": "untrusted", "teams": {"lab": {"trust": "dev"}}}},
//!     "identity": [{"annotation": "io.kubernetes.cri.sandbox-namespace",
//!                   "map": {"ns-lab": "acme/lab"}}]
//! }"#, "policy.json")?;
//!
//! let annotations = BTreeMap::from([
//!     ("io.kubernetes.cri.sandbox-namespace".to_string(), "ns-lab".to_string()),
//!     ("tessera.io/tenant".to_string(), "someone-else".to_string()), // never read
//! ]);
//! let tenant = policy.resolve_identity(&annotations)?;
//! assert_eq!((tenant.path.as_str(), tenant.trust), ("acme/lab", Trust::Dev));
//! assert!(policy.authorize(&tenant, &GpuRequest::Shared, "node-1").is_ok());
//!
//! let org = policy.tenant("acme").expect("in the tree");
//! let refusal = policy.authorize(&org, &GpuRequest::Mps { percent: 25 }, "node-1").unwrap_err();
//! assert_eq!(refusal.rule, "tiers.untrusted.allow");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod billing;
mod decide;
mod error;
mod health;
mod raw;
mod validate;

#[cfg(test)]
mod proptests;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;
use sha2::{Digest, Sha256};
use tessera_api::display::MAX_LINE_CHARS;
use tessera_api::untrusted;

pub use billing::{Billing, BillingMode, PreemptedWork};
pub use error::{IdentityError, PolicyError, Refusal};
pub use health::{
    FaultSettings, InterferenceSettings, TopologySettings, WorkloadClass, CLASS_ANNOTATION,
};
pub use tessera_api::{GpuRequest, Isolation};

/// How far a tenant is trusted (defined beside the grant that records it, in the API).
pub use tessera_api::Trust;

/// A node of the tenant tree with its effective (inherited) trust.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Tenant {
    /// `org`, `org/team`, `org/team/project` or `org/team/project/user`: made a
    /// [`tessera_api::TenantPath`] once, when the policy is parsed.
    pub path: tessera_api::TenantPath,
    pub trust: Trust,
}

/// A parsed and validated policy. Cheap to clone; immutable.
#[derive(Debug, Clone)]
pub struct Policy {
    pub(crate) version: u64,
    pub(crate) digest: String,
    pub(crate) tiers: Tiers,
    /// Every tenant, depth-first with children sorted by name.
    pub(crate) tenants: Vec<Tenant>,
    /// Tenant path -> index into `tenants`.
    pub(crate) index: BTreeMap<String, usize>,
    pub(crate) identity: Vec<IdentityRule>,
    pub(crate) default_tenant: Option<String>,
    /// Sorted by name.
    pub(crate) node_pools: Vec<NodePool>,
    pub(crate) prices: BTreeMap<String, Price>,
    pub(crate) mig_weights: BTreeMap<String, f64>,
    pub(crate) mps_max_percent: u8,
    pub(crate) sharing: Sharing,
    pub(crate) scrub: ScrubSettings,
    /// Fleet quotas (`quotas`), validated against the tenant tree and the catalog; empty
    /// when the policy sets none.
    pub(crate) quotas: quota::QuotaTree,
    /// How long a gang's first member waits for the rest (`gangs.timeout_s`).
    pub(crate) gang_timeout_s: u64,
    /// Showback or chargeback per path, preempted work (`billing`).
    pub(crate) billing: Billing,
    /// What an XID fault does beyond the quarantine (`faults`).
    pub(crate) faults: FaultSettings,
    /// How topology shapes placement (`topology`).
    pub(crate) topology: TopologySettings,
    /// Interference detection and its answer (`interference`).
    pub(crate) interference: InterferenceSettings,
}

/// How long a gang waits for all its members when the policy does not say.
pub const DEFAULT_GANG_TIMEOUT_S: u64 = 60;
/// The longest `gangs.timeout_s` accepted: a gang member's container create blocks while
/// it waits for the rest, and ten minutes is the most a create may reasonably wait.
pub const MAX_GANG_TIMEOUT_S: u64 = 600;

/// How devices are scrubbed between tenants.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ScrubSettings {
    /// A dirty device may go back to the tenant that last had it without a scrub.
    pub same_tenant_skip: bool,
    /// Fraction of device memory a scrub must cover, else the device is quarantined.
    pub min_coverage: f64,
    pub timeout_s: u64,
    /// Scrub starts before the device is quarantined instead.
    pub max_attempts: u32,
}

impl Default for ScrubSettings {
    fn default() -> Self {
        ScrubSettings {
            same_tenant_skip: false,
            min_coverage: 0.90,
            timeout_s: 120,
            max_attempts: 3,
        }
    }
}

/// Time-slicing: how many replicas a GPU offers and who may share one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Sharing {
    pub replicas: u32,
    /// Domain name -> tenant path prefixes; sorted by name.
    pub domains: BTreeMap<String, Vec<String>>,
}

impl Default for Sharing {
    fn default() -> Self {
        Sharing { replicas: 4, domains: BTreeMap::new() }
    }
}

/// What one GPU-hour of a model costs, by class of use.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Price {
    /// Within the tenant's guaranteed quota.
    pub reserved_per_gpu_hour: f64,
    /// Borrowed idle capacity above the guarantee.
    pub burst_per_gpu_hour: f64,
    /// Added per GPU-hour of a multi-GPU grant inside one NVLink domain.
    pub nvlink_premium_per_gpu_hour: f64,
}

#[derive(Debug, Clone)]
pub(crate) struct Tiers {
    pub untrusted: Vec<Isolation>,
    pub trusted: Vec<Isolation>,
    pub dev: Vec<Isolation>,
}

impl Tiers {
    pub fn allow(&self, trust: Trust) -> &[Isolation] {
        match trust {
            Trust::Untrusted => &self.untrusted,
            Trust::Trusted => &self.trusted,
            Trust::Dev => &self.dev,
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct IdentityRule {
    pub annotation: String,
    /// Annotation value -> tenant path (validated to exist).
    pub map: BTreeMap<String, String>,
    /// `None`: read for every container; else only for containers whose
    /// [`ENGINE_ANNOTATION`] (set by tessera-runtime, never by a container) is listed.
    pub engines: Option<Vec<String>>,
}

/// The annotation tessera-runtime sets from its configuration file's `engine` (and
/// refuses in a container's config): who ran the container, as the node's root said.
pub const ENGINE_ANNOTATION: &str = "tessera.io/engine";

#[derive(Debug, Clone)]
pub(crate) struct NodePool {
    pub name: String,
    pub nodes: Vec<NodePattern>,
    /// Tenant path prefixes allowed in the pool; `None` allows every tenant.
    pub tenants: Option<Vec<String>>,
    /// GPU model -> declared MIG layout.
    pub mig_layouts: BTreeMap<String, catalog::DeclaredLayout>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum NodePattern {
    Exact(String),
    /// `prefix*`: every node whose name starts with the prefix (a bare `*`: every node).
    Prefix(String),
}

impl NodePattern {
    pub fn matches(&self, node: &str) -> bool {
        match self {
            NodePattern::Exact(name) => node == name,
            NodePattern::Prefix(prefix) => node.starts_with(prefix.as_str()),
        }
    }
}

impl Policy {
    /// Parse and validate a policy. `source` names the file in error messages.
    pub fn parse(bytes: &[u8], source: &str) -> Result<Policy, PolicyError> {
        let raw = validate::deserialize(bytes, source)?;
        let digest = hex::encode(Sha256::digest(bytes));
        // Names in paths and messages are the file's own text: shown escaped and bounded
        // (a no-op on text a check already showed with `untrusted`).
        let shown = |text: &str| untrusted(text).max_chars(MAX_LINE_CHARS).to_string();
        validate::build(raw, digest).map_err(|p| PolicyError::Invalid {
            file: source.to_string(),
            path: shown(&p.path),
            message: shown(&p.message),
        })
    }

    /// Read and parse a policy file.
    pub fn load(path: &Path) -> Result<Policy, PolicyError> {
        let bytes = std::fs::read(path)
            .map_err(|source| PolicyError::Io { path: path.to_path_buf(), source })?;
        Policy::parse(&bytes, &path.display().to_string())
    }

    /// The policy's `version` field.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Lowercase hex SHA-256 of the exact bytes parsed.
    pub fn digest(&self) -> String {
        self.digest.clone()
    }

    /// Look up any node of the tenant tree by path.
    pub fn tenant(&self, path: &str) -> Option<Tenant> {
        self.index.get(path).and_then(|&i| self.tenants.get(i)).cloned()
    }

    /// Every node of the tenant tree: depth-first, each node before its children,
    /// siblings sorted by name.
    pub fn tenants(&self) -> Vec<Tenant> {
        self.tenants.clone()
    }

    /// The isolation kinds a trust tier may use, in the order the policy lists them.
    pub fn allowed(&self, trust: Trust) -> &[Isolation] {
        self.tiers.allow(trust)
    }

    /// The annotations that identity is read from, in rule order. Every other annotation
    /// is ignored for identity.
    pub fn identity_annotations(&self) -> Vec<&str> {
        self.identity.iter().map(|r| r.annotation.as_str()).collect()
    }

    /// The identity rules in order, as (annotation, value -> tenant map, `engines`): what
    /// `tessera doctor` explains [`Policy::resolve_identity`]'s decisions with.
    pub fn identity_rules(
        &self,
    ) -> impl Iterator<Item = (&str, &BTreeMap<String, String>, Option<&[String]>)> {
        self.identity.iter().map(|r| (r.annotation.as_str(), &r.map, r.engines.as_deref()))
    }

    /// Prices per GPU model, as declared (models without a price are free in reports).
    pub fn prices(&self) -> &BTreeMap<String, Price> {
        &self.prices
    }

    /// The fraction of a GPU a MIG profile is charged as, if the policy overrides the
    /// default of compute slices / 7.
    pub fn mig_weight(&self, profile: &str) -> Option<f64> {
        self.mig_weights.get(profile).copied()
    }

    /// The MIG layouts declared for a node (by the first pool, in name order, that matches
    /// it and declares any). Empty: the node's MIG layout is dynamic.
    pub fn mig_layouts(&self, node_name: &str) -> BTreeMap<String, catalog::DeclaredLayout> {
        self.node_pools
            .iter()
            .find(|p| !p.mig_layouts.is_empty() && p.nodes.iter().any(|n| n.matches(node_name)))
            .map(|p| p.mig_layouts.clone())
            .unwrap_or_default()
    }

    /// How devices are scrubbed between tenants (`scrub`).
    pub fn scrub(&self) -> ScrubSettings {
        self.scrub
    }

    /// The largest MPS share a container may ask for (100 unless `mps.max_percent`).
    pub fn mps_max_percent(&self) -> u8 {
        self.mps_max_percent
    }

    /// Time-sliced replicas per GPU (`sharing.replicas`, 4 by default).
    pub fn shared_replicas(&self) -> u32 {
        self.sharing.replicas
    }

    /// The sharing domain of a tenant: the first domain (by name) one of whose prefixes
    /// covers the tenant, else `tenant:<path>` — a domain of the tenant alone, so tenants
    /// nobody grouped never share a time-sliced GPU with anyone else.
    pub fn sharing_domain(&self, tenant: &str) -> String {
        self.sharing
            .domains
            .iter()
            .find(|(_, prefixes)| prefixes.iter().any(|p| decide::is_path_prefix(p, tenant)))
            .map(|(name, _)| name.clone())
            .unwrap_or_else(|| format!("tenant:{tenant}"))
    }

    /// The fleet quotas (`quotas`), validated against the tenant tree and the GPU catalog;
    /// an empty tree when the policy sets none.
    pub fn quotas(&self) -> &quota::QuotaTree {
        &self.quotas
    }

    /// Whether the policy sets any quota (then every GPU grant is admitted by the fleet).
    pub fn has_quotas(&self) -> bool {
        self.quotas.iter().next().is_some()
    }

    /// Seconds a gang's first member waits for the rest before all are refused
    /// (`gangs.timeout_s`; [`DEFAULT_GANG_TIMEOUT_S`] unless set).
    pub fn gang_timeout_s(&self) -> u64 {
        self.gang_timeout_s
    }

    /// The `billing` section (defaults when absent: showback everywhere, preempted work
    /// billed).
    pub fn billing(&self) -> &Billing {
        &self.billing
    }

    /// What an XID fault does beyond the quarantine (`faults`).
    pub fn faults(&self) -> &FaultSettings {
        &self.faults
    }

    /// How the node's NVLink and NUMA layout shapes placement (`topology`).
    pub fn topology(&self) -> TopologySettings {
        self.topology
    }

    /// Interference detection thresholds and the steps of the answer (`interference`).
    pub fn interference(&self) -> &InterferenceSettings {
        &self.interference
    }

    /// The tenant for containers that no identity rule matches, if any.
    pub fn default_tenant(&self) -> Option<&str> {
        self.default_tenant.as_deref()
    }
}
