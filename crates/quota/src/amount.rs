//! Resources and their fixed-point amounts.
//!
//! Every amount is a `u64` in the resource's own unit, so sums and comparisons are exact:
//!
//! - a GPU model: micro-GPUs (1 GPU = [`MICRO_PER_GPU`]). A fraction of a GPU (a MIG slice's
//!   slices / 7, an MPS percent / 100, 1 / replicas: `metering::fraction`) is floored to a
//!   micro-GPU ([`gpu_micro`]), so the parts of one GPU never count as more than the GPU;
//!   each grant is undercounted by less than a millionth of a GPU;
//! - CPU: millicores (an OCI spec's `cpu.quota / cpu.period`, as Kubernetes counts it);
//! - memory: MiB (an OCI spec's `memory.limit`, rounded up to a MiB by the caller).

use std::collections::BTreeMap;
use std::fmt;

/// Micro-GPUs in one GPU.
pub const MICRO_PER_GPU: u64 = 1_000_000;
/// Millicores in one CPU core.
pub const MILLI_PER_CORE: u64 = 1_000;
/// MiB in one GiB.
pub const MIB_PER_GIB: u64 = 1_024;

/// One kind of resource a quota can bound.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Resource {
    /// GPUs of one catalog model (`H100-80GB`), in micro-GPUs.
    Gpu(String),
    /// CPU, in millicores.
    Cpu,
    /// Memory, in MiB.
    Memory,
}

impl Resource {
    /// A GPU model's resource.
    pub fn gpu(model: &str) -> Self {
        Resource::Gpu(model.to_string())
    }

    /// `amount` of this resource for people: `1.5 H100-80GB GPUs`, `2.5 CPU cores`,
    /// `4096 MiB of memory`.
    pub fn show(&self, amount: u64) -> String {
        match self {
            Resource::Gpu(model) => {
                format!("{} {model} GPUs", decimal(amount, MICRO_PER_GPU, 6))
            }
            Resource::Cpu => format!("{} CPU cores", decimal(amount, MILLI_PER_CORE, 3)),
            Resource::Memory => format!("{amount} MiB of memory"),
        }
    }

    /// The JSON path segment of this resource in a quota entry (`gpus.H100-80GB`,
    /// `cpu_cores`, `memory_gib`).
    pub fn spec_path(&self) -> String {
        match self {
            Resource::Gpu(model) => format!("gpus.{model}"),
            Resource::Cpu => "cpu_cores".to_string(),
            Resource::Memory => "memory_gib".to_string(),
        }
    }
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Resource::Gpu(model) => write!(f, "gpu {model}"),
            Resource::Cpu => f.write_str("cpu"),
            Resource::Memory => f.write_str("memory"),
        }
    }
}

/// `value / per` with at most `places` decimals, trailing zeros dropped.
fn decimal(value: u64, per: u64, places: usize) -> String {
    let whole = value / per;
    let frac = value % per;
    if frac == 0 {
        return whole.to_string();
    }
    let digits = format!("{frac:0places$}");
    format!("{whole}.{}", digits.trim_end_matches('0'))
}

/// A fraction of one GPU (as `metering::fraction` computes it) in micro-GPUs, floored; `None`
/// unless `fraction` is finite and in `[0, 1]`.
pub fn gpu_micro(fraction: f64) -> Option<u64> {
    if fraction.is_finite() && (0.0..=1.0).contains(&fraction) {
        // Floor, so n parts of one GPU never sum above the GPU. The cast is exact: the
        // value is at most 1e6.
        Some((fraction * MICRO_PER_GPU as f64).floor() as u64)
    } else {
        None
    }
}

/// An amount of each of several resources. Zero amounts are not kept, so absent and zero
/// are the same (and compare equal).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resources(BTreeMap<Resource, u64>);

impl Resources {
    /// Nothing.
    pub fn new() -> Self {
        Self::default()
    }

    /// This, plus `amount` of `resource`.
    pub fn with(mut self, resource: Resource, amount: u64) -> Self {
        self.add_one(resource, amount);
        self
    }

    /// This, plus `gpus` whole GPUs of `model`.
    pub fn with_gpus(self, model: &str, gpus: u64) -> Self {
        self.with(Resource::gpu(model), gpus.saturating_mul(MICRO_PER_GPU))
    }

    /// This, plus `millicores` of CPU.
    pub fn with_cpu_milli(self, millicores: u64) -> Self {
        self.with(Resource::Cpu, millicores)
    }

    /// This, plus `mib` of memory.
    pub fn with_memory_mib(self, mib: u64) -> Self {
        self.with(Resource::Memory, mib)
    }

    /// The amount of `resource` (0 if absent).
    pub fn get(&self, resource: &Resource) -> u64 {
        self.0.get(resource).copied().unwrap_or(0)
    }

    /// Every resource with a non-zero amount.
    pub fn iter(&self) -> impl Iterator<Item = (&Resource, u64)> {
        self.0.iter().filter(|(_, &a)| a > 0).map(|(r, &a)| (r, a))
    }

    /// `resource`'s amount becomes `amount` (none kept when zero).
    pub fn set(&mut self, resource: &Resource, amount: u64) {
        if amount == 0 {
            self.0.remove(resource);
        } else if let Some(slot) = self.0.get_mut(resource) {
            *slot = amount;
        } else {
            self.0.insert(resource.clone(), amount);
        }
    }

    /// Whether every amount is zero.
    pub fn is_empty(&self) -> bool {
        self.iter().next().is_none()
    }

    fn add_one(&mut self, resource: Resource, amount: u64) {
        if amount == 0 {
            return;
        }
        let slot = self.0.entry(resource).or_insert(0);
        *slot = slot.saturating_add(amount);
    }

    /// Adds `other` (saturating).
    pub fn add(&mut self, other: &Resources) {
        for (r, a) in other.iter() {
            self.add_one(r.clone(), a);
        }
    }

    /// Takes `other` away, never below zero.
    pub fn sub(&mut self, other: &Resources) {
        for (r, a) in other.iter() {
            if let Some(slot) = self.0.get_mut(r) {
                *slot = slot.saturating_sub(a);
                if *slot == 0 {
                    self.0.remove(r);
                }
            }
        }
    }

    /// `self + other`.
    pub fn plus(&self, other: &Resources) -> Resources {
        let mut out = self.clone();
        out.add(other);
        out
    }

    /// `self - other`, each amount floored at zero.
    pub fn minus(&self, other: &Resources) -> Resources {
        let mut out = self.clone();
        out.sub(other);
        out
    }

    /// `self`, each amount at most that of `cap` (a resource `cap` lacks: none of it).
    pub fn at_most(&self, cap: &Resources) -> Resources {
        self.minus(&self.minus(cap))
    }

    /// Whether every amount of `self` is at most that of `other`.
    pub fn fits_in(&self, other: &Resources) -> bool {
        self.iter().all(|(r, a)| a <= other.get(r))
    }

    /// Only the resources `keep` accepts.
    pub fn only(&self, keep: impl Fn(&Resource) -> bool) -> Resources {
        Resources(self.0.iter().filter(|(r, _)| keep(r)).map(|(r, &a)| (r.clone(), a)).collect())
    }

    /// What `capacity` bounds of `self`: every GPU model (one it lacks is one it has none
    /// of), and CPU and memory only where it names them (else the nodes bound them).
    pub fn bounded_by(&self, capacity: &Resources) -> Resources {
        self.only(|r| matches!(r, Resource::Gpu(_)) || capacity.get(r) > 0)
    }

    /// The first resource (in order) of which `self` has more than `other`.
    pub fn first_excess(&self, other: &Resources) -> Option<(&Resource, u64)> {
        self.iter().find(|&(r, a)| a > other.get(r))
    }
}

impl fmt::Display for Resources {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("nothing");
        }
        let parts: Vec<String> = self.iter().map(|(r, a)| r.show(a)).collect();
        f.write_str(&parts.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fractions_floor_so_the_parts_of_a_gpu_never_exceed_it() {
        for parts in 1..=64u32 {
            let each = gpu_micro(1.0 / f64::from(parts)).expect("in range");
            assert!(each * u64::from(parts) <= MICRO_PER_GPU, "{parts} parts");
            assert!(each * u64::from(parts) + u64::from(parts) > MICRO_PER_GPU, "{parts}");
        }
        assert_eq!(gpu_micro(3.0 / 7.0), Some(428_571));
        assert_eq!(gpu_micro(1.0), Some(MICRO_PER_GPU));
        for bad in [-0.1, 1.1, f64::NAN, f64::INFINITY] {
            assert_eq!(gpu_micro(bad), None, "{bad}");
        }
    }

    #[test]
    fn amounts_show_in_their_units() {
        assert_eq!(Resource::gpu("H100-80GB").show(1_500_000), "1.5 H100-80GB GPUs");
        assert_eq!(Resource::gpu("H100-80GB").show(142_857), "0.142857 H100-80GB GPUs");
        assert_eq!(Resource::Cpu.show(2_500), "2.5 CPU cores");
        assert_eq!(Resource::Memory.show(4096), "4096 MiB of memory");
        let r = Resources::new().with_gpus("A100-40GB", 2).with_cpu_milli(1000);
        assert_eq!(r.to_string(), "2 A100-40GB GPUs, 1 CPU cores");
        assert_eq!(Resources::new().with_cpu_milli(0).to_string(), "nothing");
    }

    #[test]
    fn arithmetic_is_exact_and_floored_at_zero() {
        let a = Resources::new().with_gpus("H100-80GB", 3).with_memory_mib(10);
        let b = Resources::new().with_gpus("H100-80GB", 5).with_cpu_milli(7);
        assert_eq!(a.minus(&b), Resources::new().with_memory_mib(10));
        assert_eq!(a.plus(&b).get(&Resource::gpu("H100-80GB")), 8 * MICRO_PER_GPU);
        assert!(!a.fits_in(&b));
        assert_eq!(a.first_excess(&b), Some((&Resource::Memory, 10)));
        assert!(Resources::new().with_gpus("H100-80GB", 3).fits_in(&b));
        // At most `b` of each: memory `b` lacks is none.
        assert_eq!(a.at_most(&b), Resources::new().with_gpus("H100-80GB", 3));
    }
}
