//! A GPU container's CPU and memory limits, from its config.json, for the fleet's quotas
//! (`cpu_cores` and `memory_gib` count a container's limits: docs/QUOTAS.md).
//!
//! runc reads `linux.resources.cpu.quota` and `linux.resources.memory.limit` as int64 and
//! `linux.resources.cpu.period` as uint64; Kubernetes sets `quota = millicores × period /
//! 1000`. The limits are read from the canonical view ([`crate::canonical`]): the keys are
//! runc's own spelling there.

use serde_json::Value;
use tessera_api::{untrusted, ContainerLimits};

/// The kernel's CFS period when a config names none, in µs.
pub const DEFAULT_CPU_PERIOD_US: i128 = 100_000;

/// Why a config's limits cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitsError {
    /// A value runc would not read as an integer (runc refuses such a config).
    #[error("{at}: expected an integer, found {found}")]
    NotInteger { at: &'static str, found: String },
    /// A negative CFS period.
    #[error("{at}: {value} is negative")]
    Negative { at: &'static str, value: i128 },
    /// More than a quota can ever count.
    #[error("{at}: {what} is above the largest {kind} limit Tessera counts ({max})")]
    TooLarge { at: &'static str, what: String, kind: &'static str, max: String },
}

/// The CPU and memory limits of `config` (the canonical view of a config.json), in
/// millicores (`quota × 1000 / period`, period 0 or absent meaning the kernel's 100000 µs)
/// and MiB, each rounded up so a quota's ceiling is never crossed by rounding. A quota or
/// limit that is absent, `null` or not positive (`-1` is runc's "unlimited") is no limit;
/// `None` when neither is set. A value that is not an integer, a negative period, or a
/// limit above [`ContainerLimits::MAX_CPU_MILLI`] / [`ContainerLimits::MAX_MEMORY_MIB`] is
/// an error naming it.
pub fn limits_of(config: &Value) -> Result<Option<ContainerLimits>, LimitsError> {
    let resources = config.pointer("/linux/resources");
    let int = |at: &'static str, ptr: &str| -> Result<Option<i128>, LimitsError> {
        match resources.and_then(|r| r.pointer(ptr)) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Number(n)) => match (n.as_i64(), n.as_u64()) {
                (Some(i), _) => Ok(Some(i128::from(i))),
                (None, Some(u)) => Ok(Some(i128::from(u))),
                _ => Err(LimitsError::NotInteger { at, found: n.to_string() }),
            },
            Some(other) => Err(LimitsError::NotInteger {
                at,
                found: untrusted(&other.to_string()).max_chars(64).to_string(),
            }),
        }
    };
    let quota = int("linux.resources.cpu.quota", "/cpu/quota")?;
    let period = int("linux.resources.cpu.period", "/cpu/period")?;
    let limit = int("linux.resources.memory.limit", "/memory/limit")?;
    if let Some(p) = period.filter(|p| *p < 0) {
        return Err(LimitsError::Negative { at: "linux.resources.cpu.period", value: p });
    }
    let cpu_milli = match quota.filter(|q| *q > 0) {
        None => None,
        Some(q) => {
            let p = period.filter(|p| *p > 0).unwrap_or(DEFAULT_CPU_PERIOD_US);
            // At most i64::MAX × 1000 + u64::MAX: well inside i128.
            let milli = (q * 1000 + p - 1) / p;
            match u64::try_from(milli) {
                Ok(m) if m <= ContainerLimits::MAX_CPU_MILLI => Some(m),
                _ => {
                    return Err(LimitsError::TooLarge {
                        at: "linux.resources.cpu.quota",
                        what: format!("quota {q} over period {p} ({milli} millicores)"),
                        kind: "CPU",
                        max: format!("{} millicores", ContainerLimits::MAX_CPU_MILLI),
                    })
                }
            }
        }
    };
    let memory_mib = match limit.filter(|l| *l > 0) {
        None => None,
        Some(bytes) => {
            let mib = (bytes + (1 << 20) - 1) >> 20;
            match u64::try_from(mib) {
                Ok(m) if m <= ContainerLimits::MAX_MEMORY_MIB => Some(m),
                _ => {
                    return Err(LimitsError::TooLarge {
                        at: "linux.resources.memory.limit",
                        what: format!("{bytes} bytes"),
                        kind: "memory",
                        max: format!("{} MiB", ContainerLimits::MAX_MEMORY_MIB),
                    })
                }
            }
        }
    };
    Ok((cpu_milli.is_some() || memory_mib.is_some())
        .then_some(ContainerLimits { cpu_milli, memory_mib }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cfg(resources: Value) -> Value {
        json!({"ociVersion": "1.0.2", "linux": {"resources": resources}})
    }

    fn limits(cpu: Option<u64>, mem: Option<u64>) -> Option<ContainerLimits> {
        Some(ContainerLimits { cpu_milli: cpu, memory_mib: mem })
    }

    #[test]
    fn kubernetes_limits_read_back_as_written() {
        // 500m and 2Gi, as kubelet writes them.
        let c = cfg(json!({"cpu": {"quota": 50_000, "period": 100_000},
                           "memory": {"limit": 2_147_483_648_i64}}));
        assert_eq!(limits_of(&c), Ok(limits(Some(500), Some(2048))));
        // 333m (kubelet: quota 33300) and 2.5 cores over a 50 ms period.
        let c = cfg(json!({"cpu": {"quota": 33_300, "period": 100_000}}));
        assert_eq!(limits_of(&c), Ok(limits(Some(333), None)));
        let c = cfg(json!({"cpu": {"quota": 125_000, "period": 50_000}}));
        assert_eq!(limits_of(&c), Ok(limits(Some(2500), None)));
    }

    #[test]
    fn a_missing_period_is_the_kernels_and_amounts_round_up() {
        let c = cfg(json!({"cpu": {"quota": 20_000}}));
        assert_eq!(limits_of(&c), Ok(limits(Some(200), None)));
        let c = cfg(json!({"cpu": {"quota": 1, "period": 0}}));
        assert_eq!(limits_of(&c), Ok(limits(Some(1), None)), "1 µs per 100 ms rounds up to 1m");
        let c = cfg(json!({"memory": {"limit": 1}}));
        assert_eq!(limits_of(&c), Ok(limits(None, Some(1))), "one byte counts as a MiB");
        let c = cfg(json!({"memory": {"limit": 1_048_577}}));
        assert_eq!(limits_of(&c), Ok(limits(None, Some(2))));
    }

    #[test]
    fn absent_or_unlimited_is_no_limit() {
        for c in [
            json!({"ociVersion": "1.0.2"}),
            json!({"linux": {}}),
            cfg(json!({})),
            cfg(json!({"cpu": {"shares": 1024}})),
            cfg(json!({"cpu": {"quota": -1, "period": 100_000}, "memory": {"limit": -1}})),
            cfg(json!({"cpu": {"quota": 0}, "memory": {"limit": 0}})),
            cfg(json!({"cpu": {"quota": null}, "memory": null})),
            cfg(json!({"cpu": {"period": 100_000}})),
        ] {
            assert_eq!(limits_of(&c), Ok(None), "{c}");
        }
    }

    #[test]
    fn hostile_values_are_refused_by_name_never_wrapped() {
        let err = |r: Value| limits_of(&cfg(r)).expect_err("refused").to_string();
        let e = err(json!({"cpu": {"quota": "50000"}}));
        assert!(e.contains("linux.resources.cpu.quota") && e.contains("integer"), "{e}");
        let e = err(json!({"cpu": {"quota": 50_000.5}}));
        assert!(e.contains("linux.resources.cpu.quota") && e.contains("50000.5"), "{e}");
        let e = err(json!({"cpu": {"quota": 100, "period": -5}}));
        assert!(e.contains("linux.resources.cpu.period") && e.contains("negative"), "{e}");
        let e = err(json!({"memory": {"limit": {"bytes": 1}}}));
        assert!(e.contains("linux.resources.memory.limit"), "{e}");
        // The largest int64 quota over a 1 µs period: refused, not wrapped round.
        let e = err(json!({"cpu": {"quota": i64::MAX, "period": 1}}));
        assert!(e.contains("above the largest CPU limit"), "{e}");
        let e = err(json!({"memory": {"limit": i64::MAX}}));
        assert!(e.contains("above the largest memory limit"), "{e}");
        // The largest quota over the largest period: half a core, computed without overflow.
        let c = cfg(json!({"cpu": {"quota": i64::MAX, "period": u64::MAX}}));
        assert_eq!(limits_of(&c), Ok(limits(Some(500), None)));
        // A tiny quota over a huge period still counts (rounded up), never as 0.
        let c = cfg(json!({"cpu": {"quota": 1, "period": u64::MAX}}));
        assert_eq!(limits_of(&c), Ok(limits(Some(1), None)));
        // A control character in a refused value is escaped.
        let e = err(json!({"cpu": {"quota": "\u{1b}[31m"}}));
        assert!(!e.contains('\u{1b}'), "{e}");
        // The largest accepted values pass.
        let c = cfg(json!({"cpu": {"quota": 1_000_000_000_i64, "period": 1000},
                           "memory": {"limit": 1_024_000_000_i64 << 20}}));
        assert_eq!(
            limits_of(&c),
            Ok(limits(Some(ContainerLimits::MAX_CPU_MILLI), Some(ContainerLimits::MAX_MEMORY_MIB)))
        );
    }
}
