//! Pure placement decisions for `mps=PCT` and `shared` requests.
//!
//! MPS: a device's booked percent is the sum of its containers' requests and never exceeds
//! 100. A tenant has one control daemon per device and a daemon has one per-client cap,
//! so a tenant's second container on a device joins only with the same percent (it books
//! that percent again); a different percent goes to another device. Among the devices
//! that fit, the most booked one wins (best fit): partly used devices fill up first and
//! whole devices stay free for `gpu=N`, `mps=100` and large shares. Ties go to the device
//! listed first, so the choice is deterministic for a given input order.
//!
//! Shared (time-slicing): a GPU holds at most `replicas` containers, all of one sharing
//! domain; an empty GPU takes the domain of its first occupant. Among the GPUs that fit,
//! the fullest wins (again best fit, and it keeps empty GPUs free for other domains); ties
//! go to the first listed. Trust is not decided here: the policy refuses `shared` to
//! untrusted tenants before any placement, and only then is the domain (declared in the
//! policy) passed in.

use std::fmt;

use serde::{Deserialize, Serialize};

/// One container's booking on an MPS device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MpsShareLoad {
    pub tenant: String,
    pub percent: u8,
}

/// An MPS-capable device (whole GPU or MIG instance) and what is booked on it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MpsDeviceLoad {
    pub uuid: String,
    /// One entry per container holding a share of this device.
    pub shares: Vec<MpsShareLoad>,
}

impl MpsDeviceLoad {
    /// The booked percent (saturating; inputs over 100 are treated as full).
    pub fn used(&self) -> u32 {
        self.shares.iter().map(|s| u32::from(s.percent)).sum()
    }

    /// The percent still free.
    pub fn left(&self) -> u32 {
        100u32.saturating_sub(self.used())
    }

    /// The percent `tenant` already holds here per container, if any. A well-formed load
    /// has one percent per tenant; if not, the first one counts.
    pub fn tenant_percent(&self, tenant: &str) -> Option<u8> {
        self.shares.iter().find(|s| s.tenant == tenant).map(|s| s.percent)
    }

    /// Whether a container of `tenant` asking `percent` fits here.
    pub fn fits(&self, tenant: &str, percent: u8) -> bool {
        self.used() + u32::from(percent) <= 100
            && !matches!(self.tenant_percent(tenant), Some(p) if p != percent)
    }
}

/// Why no device takes an MPS share; `Display` says what is left where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsNoFit {
    pub percent: u8,
    pub tenant: String,
    /// (device, percent left, the percent this tenant already holds there).
    pub devices: Vec<(String, u32, Option<u8>)>,
}

impl fmt::Display for MpsNoFit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "mps={}: ", self.percent)?;
        if self.devices.is_empty() {
            return f.write_str("no device on this node offers MPS");
        }
        for (i, (uuid, left, held)) in self.devices.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            match held {
                Some(p) if *p != self.percent && *left >= u32::from(self.percent) => write!(
                    f,
                    "{uuid} has {left}% left but tenant {} holds mps={p} there (one cap per tenant per device)",
                    self.tenant
                )?,
                _ => write!(f, "{uuid} has {left}% left")?,
            }
        }
        Ok(())
    }
}

impl std::error::Error for MpsNoFit {}

/// The device that takes a container of `tenant` asking `mps=percent`: the most booked
/// device that still fits (ties: first listed).
pub fn pick_mps_device(
    devices: &[MpsDeviceLoad],
    tenant: &str,
    percent: u8,
) -> Result<String, MpsNoFit> {
    let fits = (1..=100).contains(&percent);
    let best = devices
        .iter()
        .enumerate()
        .filter(|(_, d)| fits && d.fits(tenant, percent))
        // max_by_key keeps the last maximum; the reversed index makes it the first listed.
        .max_by_key(|(i, d)| (d.used(), std::cmp::Reverse(*i)));
    match best {
        Some((_, d)) => Ok(d.uuid.clone()),
        None => Err(MpsNoFit {
            percent,
            tenant: tenant.to_string(),
            devices: devices
                .iter()
                .map(|d| (d.uuid.clone(), d.left(), d.tenant_percent(tenant)))
                .collect(),
        }),
    }
}

/// The memory cap of `percent`% of a device with `device_bytes` of memory, rounded down.
pub fn mps_mem_limit_bytes(device_bytes: u64, percent: u8) -> u64 {
    let p = u128::from(percent.min(100));
    u64::try_from(u128::from(device_bytes) * p / 100).unwrap_or(u64::MAX)
}

/// A time-sliced GPU and who is on it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedDeviceLoad {
    pub uuid: String,
    /// How many containers the policy lets share it.
    pub replicas: u32,
    /// How many hold a replica now.
    pub used: u32,
    /// The sharing domain of its occupants; None when empty.
    pub domain: Option<String>,
}

impl SharedDeviceLoad {
    /// Whether a container of `domain` may take a replica here. An occupied GPU whose
    /// domain is unknown fits nobody (fail closed).
    pub fn fits(&self, domain: &str) -> bool {
        self.used < self.replicas && (self.used == 0 || self.domain.as_deref() == Some(domain))
    }
}

/// Why no GPU takes a time-sliced replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedNoFit {
    pub domain: String,
    pub devices: Vec<SharedDeviceLoad>,
}

impl fmt::Display for SharedNoFit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "shared (sharing domain {}): ", self.domain)?;
        if self.domain.is_empty() {
            return f.write_str("no sharing domain given");
        }
        if self.devices.is_empty() {
            return f.write_str("no GPU on this node is time-sliced");
        }
        for (i, d) in self.devices.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            if d.used >= d.replicas {
                write!(f, "{} is full ({}/{} replicas)", d.uuid, d.used, d.replicas)?;
            } else {
                match &d.domain {
                    Some(other) => write!(f, "{} is held by sharing domain {other}", d.uuid)?,
                    None => write!(f, "{} has occupants of unknown domain", d.uuid)?,
                }
            }
        }
        Ok(())
    }
}

impl std::error::Error for SharedNoFit {}

/// The GPU that takes a time-sliced replica for `domain`: the fullest GPU that fits (ties:
/// first listed).
pub fn pick_shared_device(
    devices: &[SharedDeviceLoad],
    domain: &str,
) -> Result<String, SharedNoFit> {
    let best = devices
        .iter()
        .enumerate()
        .filter(|(_, d)| !domain.is_empty() && d.fits(domain))
        .max_by_key(|(i, d)| (d.used, std::cmp::Reverse(*i)));
    match best {
        Some((_, d)) => Ok(d.uuid.clone()),
        None => Err(SharedNoFit { domain: domain.to_string(), devices: devices.to_vec() }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn dev(uuid: &str, shares: &[(&str, u8)]) -> MpsDeviceLoad {
        MpsDeviceLoad {
            uuid: uuid.into(),
            shares: shares
                .iter()
                .map(|(t, p)| MpsShareLoad { tenant: (*t).into(), percent: *p })
                .collect(),
        }
    }

    #[test]
    fn the_third_tenant_goes_elsewhere_or_is_told_what_is_left_where() {
        let one = [dev("GPU-aa", &[("a", 50), ("b", 25)])];
        let e = pick_mps_device(&one, "c", 40).expect_err("no room");
        assert_eq!(e.to_string(), "mps=40: GPU-aa has 25% left");
        let two = [dev("GPU-aa", &[("a", 50), ("b", 25)]), dev("GPU-bb", &[("d", 90)])];
        assert_eq!(
            pick_mps_device(&two, "c", 40).expect_err("no room").to_string(),
            "mps=40: GPU-aa has 25% left, GPU-bb has 10% left"
        );
        let three = [dev("GPU-aa", &[("a", 50), ("b", 25)]), dev("GPU-cc", &[])];
        assert_eq!(pick_mps_device(&three, "c", 40), Ok("GPU-cc".into()));
        assert_eq!(
            pick_mps_device(&[], "c", 40).expect_err("none").to_string(),
            "mps=40: no device on this node offers MPS"
        );
    }

    #[test]
    fn best_fit_fills_the_most_booked_device_first_and_ties_go_to_the_first() {
        let devs =
            [dev("GPU-aa", &[("x", 10)]), dev("GPU-bb", &[("y", 60)]), dev("GPU-cc", &[("z", 60)])];
        assert_eq!(pick_mps_device(&devs, "t", 40), Ok("GPU-bb".into()));
        assert_eq!(pick_mps_device(&devs, "t", 41), Ok("GPU-aa".into()));
        let empty = [dev("GPU-aa", &[]), dev("GPU-bb", &[])];
        assert_eq!(pick_mps_device(&empty, "t", 100), Ok("GPU-aa".into()));
    }

    #[test]
    fn one_cap_per_tenant_per_device() {
        let devs = [dev("GPU-aa", &[("t", 25)]), dev("GPU-bb", &[])];
        assert_eq!(
            pick_mps_device(&devs, "t", 25),
            Ok("GPU-aa".into()),
            "same cap joins the daemon"
        );
        assert_eq!(
            pick_mps_device(&devs, "t", 50),
            Ok("GPU-bb".into()),
            "another cap goes elsewhere"
        );
        let e = pick_mps_device(&devs[..1], "t", 50).expect_err("conflict");
        assert_eq!(e.to_string(), "mps=50: GPU-aa has 75% left but tenant t holds mps=25 there (one cap per tenant per device)");
        assert!(pick_mps_device(&devs, "t", 0).is_err());
        assert!(pick_mps_device(&devs, "t", 101).is_err());
    }

    #[test]
    fn memory_caps_round_down() {
        assert_eq!(mps_mem_limit_bytes(80 << 30, 25), 20 << 30);
        assert_eq!(mps_mem_limit_bytes(101, 50), 50);
        assert_eq!(mps_mem_limit_bytes(u64::MAX, 100), u64::MAX);
        assert_eq!(mps_mem_limit_bytes(100, 200), 100);
    }

    fn sdev(uuid: &str, replicas: u32, used: u32, domain: Option<&str>) -> SharedDeviceLoad {
        SharedDeviceLoad { uuid: uuid.into(), replicas, used, domain: domain.map(String::from) }
    }

    #[test]
    fn shared_gpus_hold_one_domain_and_fill_up_first() {
        let devs = [
            sdev("GPU-aa", 4, 0, None),
            sdev("GPU-bb", 4, 2, Some("ml")),
            sdev("GPU-cc", 4, 3, Some("web")),
        ];
        assert_eq!(pick_shared_device(&devs, "ml"), Ok("GPU-bb".into()));
        assert_eq!(pick_shared_device(&devs, "web"), Ok("GPU-cc".into()));
        assert_eq!(pick_shared_device(&devs, "ops"), Ok("GPU-aa".into()));
        let full = [
            sdev("GPU-bb", 2, 2, Some("ml")),
            sdev("GPU-cc", 4, 1, Some("web")),
            sdev("GPU-dd", 4, 1, None),
        ];
        assert_eq!(
            pick_shared_device(&full, "ml").expect_err("no fit").to_string(),
            "shared (sharing domain ml): GPU-bb is full (2/2 replicas), GPU-cc is held by sharing domain web, \
             GPU-dd has occupants of unknown domain"
        );
        assert!(pick_shared_device(&devs, "").is_err());
        assert_eq!(
            pick_shared_device(&[sdev("GPU-ee", 4, 0, Some("stale"))], "ml"),
            Ok("GPU-ee".into()),
            "empty GPUs take any domain"
        );
    }

    proptest! {
        #[test]
        fn mps_bookings_never_exceed_100_and_refusals_are_true(
            n in 1usize..5,
            asks in proptest::collection::vec((0usize..4, 1u8..=100), 1..40),
        ) {
            let mut devs: Vec<MpsDeviceLoad> = (0..n).map(|i| dev(&format!("GPU-{i}"), &[])).collect();
            for (t, pct) in asks {
                let tenant = format!("t{t}");
                match pick_mps_device(&devs, &tenant, pct) {
                    Ok(uuid) => {
                        let d = devs.iter_mut().find(|d| d.uuid == uuid).expect("picked a listed device");
                        prop_assert!(d.fits(&tenant, pct));
                        d.shares.push(MpsShareLoad { tenant: tenant.clone(), percent: pct });
                        prop_assert!(d.used() <= 100);
                    }
                    Err(e) => {
                        prop_assert!(devs.iter().all(|d| !d.fits(&tenant, pct)));
                        prop_assert_eq!(e.devices.len(), devs.len());
                    }
                }
                for d in &devs {
                    prop_assert!(d.used() <= 100);
                    // One cap per tenant per device.
                    for s in &d.shares {
                        prop_assert_eq!(d.tenant_percent(&s.tenant), Some(s.percent));
                    }
                }
            }
        }

        #[test]
        fn mps_picks_are_the_most_booked_fitting_device(
            loads in proptest::collection::vec(proptest::collection::vec((0usize..3, 1u8..=40), 0..4), 1..6),
            pct in 1u8..=100,
        ) {
            let devs: Vec<MpsDeviceLoad> = loads.iter().enumerate().map(|(i, s)| MpsDeviceLoad {
                uuid: format!("GPU-{i}"),
                shares: s.iter().map(|(t, p)| MpsShareLoad { tenant: format!("t{t}"), percent: *p }).collect(),
            }).collect();
            if let Ok(uuid) = pick_mps_device(&devs, "t0", pct) {
                let chosen = devs.iter().position(|d| d.uuid == uuid).expect("listed");
                for (i, d) in devs.iter().enumerate() {
                    if d.fits("t0", pct) {
                        prop_assert!(d.used() < devs[chosen].used() || (d.used() == devs[chosen].used() && i >= chosen));
                    }
                }
            }
        }

        #[test]
        fn shared_gpus_never_mix_domains_or_exceed_replicas(
            replicas in proptest::collection::vec(1u32..5, 1..5),
            asks in proptest::collection::vec(0usize..4, 1..40),
            leaves in proptest::collection::vec(any::<bool>(), 40),
        ) {
            let mut devs: Vec<SharedDeviceLoad> = replicas.iter().enumerate()
                .map(|(i, r)| sdev(&format!("GPU-{i}"), *r, 0, None)).collect();
            // Occupants per device, to check the invariant from the ground truth.
            let mut occupants: Vec<Vec<String>> = vec![Vec::new(); devs.len()];
            for (k, d) in asks.iter().enumerate() {
                let domain = format!("d{d}");
                match pick_shared_device(&devs, &domain) {
                    Ok(uuid) => {
                        let i = devs.iter().position(|x| x.uuid == uuid).expect("listed");
                        occupants[i].push(domain.clone());
                        devs[i].used += 1;
                        devs[i].domain = Some(domain);
                    }
                    Err(_) => prop_assert!(devs.iter().all(|x| !x.fits(&domain))),
                }
                // Sometimes a container leaves.
                if leaves[k] {
                    if let Some(i) = occupants.iter().position(|o| !o.is_empty()) {
                        occupants[i].pop();
                        devs[i].used -= 1;
                        if devs[i].used == 0 { devs[i].domain = None; }
                    }
                }
                for (i, o) in occupants.iter().enumerate() {
                    prop_assert!(o.len() as u32 <= devs[i].replicas);
                    prop_assert!(o.windows(2).all(|w| w[0] == w[1]), "two domains on {}: {:?}", devs[i].uuid, o);
                }
            }
        }
    }
}
