//! The policy file exactly as written: serde types with no meaning attached yet.
//! Every struct denies unknown fields and every map denies duplicate keys, so a typo is
//! an error at its path rather than a silent default.

use std::fmt;
use std::marker::PhantomData;

use serde::de::value::MapAccessDeserializer;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use std::ops::Deref;
use tessera_api::Isolation;

use crate::Trust;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawPolicy {
    pub version: u64,
    #[serde(default)]
    pub tiers: Object<RawTiers>,
    pub orgs: UniqueMap<Object<RawOrg>>,
    #[serde(default)]
    pub identity: Vec<Object<RawIdentityRule>>,
    #[serde(default)]
    pub default_tenant: Option<String>,
    #[serde(default)]
    pub node_pools: UniqueMap<Object<RawNodePool>>,
    /// GPU model -> rates per GPU-hour.
    #[serde(default)]
    pub prices: UniqueMap<Object<RawPrice>>,
    /// MIG profile -> fraction of a GPU it is charged as (default: compute slices / 7).
    #[serde(default)]
    pub mig_weights: UniqueMap<f64>,
    #[serde(default)]
    pub mps: Option<Object<RawMps>>,
    #[serde(default)]
    pub sharing: Option<Object<RawSharing>>,
    #[serde(default)]
    pub scrub: Option<Object<RawScrub>>,
    /// Fleet quotas per tenant path (docs/QUOTAS.md): parsed by the `quota` crate.
    #[serde(default)]
    pub quotas: Option<quota::QuotaSpec>,
    #[serde(default)]
    pub gangs: Option<Object<RawGangs>>,
    /// Showback or chargeback per path, preempted work (docs/CHARGEBACK.md).
    #[serde(default)]
    pub billing: Option<Object<RawBilling>>,
    #[serde(default)]
    pub faults: Option<Object<RawFaults>>,
    #[serde(default)]
    pub topology: Option<Object<RawTopology>>,
    #[serde(default)]
    pub interference: Option<Object<RawInterference>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawGangs {
    #[serde(default)]
    pub timeout_s: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawScrub {
    #[serde(default)]
    pub same_tenant_skip: Option<bool>,
    #[serde(default)]
    pub min_coverage: Option<f64>,
    #[serde(default)]
    pub timeout_s: Option<u64>,
    #[serde(default)]
    pub max_attempts: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawMps {
    /// The largest `mps=PCT` any container may ask for.
    pub max_percent: u32,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawSharing {
    /// Time-sliced replicas per GPU.
    pub replicas: u32,
    /// Domain name -> tenant path prefixes whose containers may share a GPU.
    #[serde(default)]
    pub domains: UniqueMap<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawPrice {
    pub reserved_per_gpu_hour: f64,
    /// Defaults to the reserved rate.
    #[serde(default)]
    pub burst_per_gpu_hour: Option<f64>,
    /// Added per GPU-hour of a multi-GPU grant inside one NVLink domain (default 0).
    #[serde(default)]
    pub nvlink_premium_per_gpu_hour: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawTiers {
    #[serde(default = "RawTier::untrusted")]
    pub untrusted: Object<RawTier>,
    #[serde(default = "RawTier::trusted")]
    pub trusted: Object<RawTier>,
    #[serde(default = "RawTier::dev")]
    pub dev: Object<RawTier>,
}

impl Default for RawTiers {
    fn default() -> Self {
        RawTiers {
            untrusted: RawTier::untrusted(),
            trusted: RawTier::trusted(),
            dev: RawTier::dev(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawTier {
    pub allow: Vec<IsolationName>,
}

impl RawTier {
    fn of(allow: &[Isolation]) -> Object<Self> {
        Object(RawTier { allow: allow.iter().copied().map(IsolationName).collect() })
    }
    fn untrusted() -> Object<Self> {
        Self::of(&[Isolation::Gpu, Isolation::Mig])
    }
    fn trusted() -> Object<Self> {
        Self::of(&[Isolation::Gpu, Isolation::Mig, Isolation::Mps])
    }
    fn dev() -> Object<Self> {
        Self::of(&Isolation::ALL)
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawOrg {
    #[serde(default)]
    pub trust: Option<Trust>,
    #[serde(default)]
    pub teams: UniqueMap<Object<RawTeam>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawTeam {
    #[serde(default)]
    pub trust: Option<Trust>,
    #[serde(default)]
    pub projects: UniqueMap<Object<RawProject>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawProject {
    #[serde(default)]
    pub trust: Option<Trust>,
    #[serde(default)]
    pub users: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawIdentityRule {
    pub annotation: String,
    pub map: UniqueMap<String>,
    /// Read only for containers of these engines (the `tessera.io/engine` annotation that
    /// tessera-runtime sets from its root-owned configuration file).
    #[serde(default)]
    pub engines: Option<Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawNodePool {
    pub nodes: Vec<String>,
    #[serde(default)]
    pub tenants: Option<Vec<String>>,
    /// GPU model -> declared MIG layout (`all-1g`, `all-balanced`, `3g.40gb@0,2g.20gb@4`).
    #[serde(default)]
    pub mig_layouts: UniqueMap<String>,
}

/// A JSON object read into a sorted map, refusing duplicate keys (one definition for
/// every reader of documents: [`tessera_api::UniqueMap`]).
pub(crate) use tessera_api::UniqueMap;

/// A struct that may only be written as a JSON object. serde's derived impls also accept
/// an array of the fields in order (`"acme": ["dev"]`), a second spelling nobody should
/// rely on; this wrapper refuses it.
#[derive(Debug, Default)]
pub(crate) struct Object<T>(pub T);

impl<T> Deref for Object<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(ObjectVisitor(PhantomData))
    }
}

struct ObjectVisitor<T>(PhantomData<T>);

impl<'de, T: Deserialize<'de>> Visitor<'de> for ObjectVisitor<T> {
    type Value = Object<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object")
    }

    fn visit_map<A: MapAccess<'de>>(self, access: A) -> Result<Self::Value, A::Error> {
        T::deserialize(MapAccessDeserializer::new(access)).map(Object)
    }
}

/// Deserialize a string naming one of `names`' values, with serde's usual "unknown
/// variant" message and an "expected one of ..." message for a value of the wrong type
/// (serde_json reports a derived enum given a number as a syntax error).
pub(crate) fn deserialize_named<'de, D, T>(
    deserializer: D,
    names: &'static [&'static str],
    from: fn(&str) -> Option<T>,
) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
{
    struct NameVisitor<T> {
        names: &'static [&'static str],
        from: fn(&str) -> Option<T>,
    }
    impl<'de, T> Visitor<'de> for NameVisitor<T> {
        type Value = T;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            let quoted: Vec<String> = self.names.iter().map(|n| format!("`{n}`")).collect();
            write!(f, "one of {}", quoted.join(", "))
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<T, E> {
            (self.from)(v).ok_or_else(|| E::unknown_variant(v, self.names))
        }
    }
    deserializer.deserialize_str(NameVisitor { names, from })
}

/// An isolation kind as written in an `allow` list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct IsolationName(pub Isolation);

impl<'de> Deserialize<'de> for IsolationName {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        const NAMES: &[&str] = &["gpu", "mig", "mps", "shared"];
        deserialize_named(deserializer, NAMES, |s| s.parse::<Isolation>().ok().map(IsolationName))
    }
}

// The node-health sections (`crate::health`).

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawFaults {
    #[serde(default)]
    pub ignore_xids: Vec<u64>,
    #[serde(default)]
    pub stop_holders: Option<bool>,
    #[serde(default)]
    pub grace_s: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawTopology {
    #[serde(default)]
    pub isolate_nvlink_domains: Option<bool>,
    #[serde(default)]
    pub pin_cpus: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawInterference {
    #[serde(default)]
    pub enabled: Option<bool>,
    #[serde(default)]
    pub classes: UniqueMap<tessera_api::WorkloadClass>,
    #[serde(default)]
    pub min_share: Option<f64>,
    #[serde(default)]
    pub saturation: Option<f64>,
    #[serde(default)]
    pub confirm_samples: Option<u32>,
    #[serde(default)]
    pub clear_samples: Option<u32>,
    #[serde(default)]
    pub throttle_factor_percent: Option<u8>,
    #[serde(default)]
    pub min_percent: Option<u8>,
    #[serde(default)]
    pub anti_affinity: Option<bool>,
    #[serde(default)]
    pub harden: Option<bool>,
    #[serde(default)]
    pub stop_after_samples: Option<u32>,
    #[serde(default)]
    pub stop_grace_s: Option<u64>,
}

/// `billing` as written ([`crate::billing::Billing`] once checked).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawBilling {
    #[serde(default)]
    pub default_mode: Option<crate::billing::BillingMode>,
    #[serde(default)]
    pub modes: UniqueMap<crate::billing::BillingMode>,
    #[serde(default)]
    pub preempted: Option<crate::billing::PreemptedWork>,
}

impl RawBilling {
    /// Checks every path names a tenant of the tree (`check` reports the problem at its
    /// JSON path, `billing.modes.<tenant>`).
    pub(crate) fn build<E>(
        &self,
        check: impl Fn(&str, &str) -> Result<(), E>,
    ) -> Result<crate::billing::Billing, E> {
        for tenant in self.modes.0.keys() {
            check(&format!("billing.modes.{tenant}"), tenant)?;
        }
        Ok(crate::billing::Billing {
            default_mode: self.default_mode.unwrap_or_default(),
            modes: self.modes.0.clone(),
            preempted: self.preempted.unwrap_or_default(),
        })
    }
}
