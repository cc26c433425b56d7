//! The GPU request grammar: `gpu=N`, `mig=PROFILE`, `mps=PCT`, `shared`.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::display::untrusted;

/// The isolation level a grant gives. Ordered from strongest to weakest isolation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Isolation {
    /// One or more whole GPUs, exclusively.
    Gpu,
    /// A MIG instance: hardware-partitioned memory and compute.
    Mig,
    /// A share of an MPS server: a thread and pinned-memory cap, no memory isolation.
    Mps,
    /// A time-sliced replica: no isolation beyond the driver's context switching.
    Shared,
}

impl Isolation {
    /// Every isolation level, strongest first.
    pub const ALL: [Isolation; 4] =
        [Isolation::Gpu, Isolation::Mig, Isolation::Mps, Isolation::Shared];

    /// The name used in requests, policies and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Isolation::Gpu => "gpu",
            Isolation::Mig => "mig",
            Isolation::Mps => "mps",
            Isolation::Shared => "shared",
        }
    }
}

impl fmt::Display for Isolation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Isolation {
    type Err = RequestError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Isolation::ALL
            .into_iter()
            .find(|i| i.as_str() == s)
            .ok_or_else(|| RequestError::UnknownKind(s.to_string()))
    }
}

/// A parsed GPU request.
///
/// On the wire and in the store it is its string form (`"mig=1g.10gb"`, the form of
/// protocol 1.0): serialised with [`fmt::Display`], deserialised with [`FromStr`], so a
/// malformed request is refused when the body is read, with the [`RequestError`] (the
/// value escaped), and everything after works on the typed value.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Deserialize)]
#[serde(try_from = "String")]
pub enum GpuRequest {
    /// `gpu=N`: N whole GPUs (1..=64).
    Gpu { count: u32 },
    /// `mig=PROFILE`: one MIG instance of a profile such as `1g.10gb`.
    Mig { profile: String },
    /// `mps=PCT`: PCT percent (1..=100) of one device's threads and memory.
    Mps { percent: u8 },
    /// `shared`: one time-sliced replica.
    Shared,
}

/// Why a request string is not a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("empty GPU request")]
    Empty,
    #[error("unknown GPU request kind `{}`: expected gpu=N, mig=PROFILE, mps=PCT or shared", untrusted(.0))]
    UnknownKind(String),
    #[error("`{kind}` needs a value: expected {expected}")]
    MissingValue { kind: &'static str, expected: &'static str },
    #[error("`shared` takes no value, got `shared={}`", untrusted(.0))]
    UnexpectedValue(String),
    #[error("bad value `{}` for `{kind}`: expected {expected}", untrusted(.value))]
    BadValue { kind: &'static str, value: String, expected: &'static str },
}

const GPU_EXPECTED: &str = "a whole number of GPUs from 1 to 64";
const MIG_EXPECTED: &str = "a MIG profile such as 1g.10gb or 3g.40gb";
const MPS_EXPECTED: &str = "a percentage from 1 to 100";

impl GpuRequest {
    /// The isolation level this request asks for.
    pub fn isolation(&self) -> Isolation {
        match self {
            GpuRequest::Gpu { .. } => Isolation::Gpu,
            GpuRequest::Mig { .. } => Isolation::Mig,
            GpuRequest::Mps { .. } => Isolation::Mps,
            GpuRequest::Shared => Isolation::Shared,
        }
    }
}

impl FromStr for GpuRequest {
    type Err = RequestError;

    fn from_str(raw: &str) -> Result<Self, Self::Err> {
        let s = raw.trim();
        if s.is_empty() {
            return Err(RequestError::Empty);
        }
        let (kind, value) = match s.split_once('=') {
            Some((k, v)) => (k.trim(), Some(v.trim())),
            None => (s, None),
        };
        match kind {
            "gpu" => {
                let v = value
                    .ok_or(RequestError::MissingValue { kind: "gpu", expected: GPU_EXPECTED })?;
                let count = parse_bounded(v, 1, 64).ok_or_else(|| RequestError::BadValue {
                    kind: "gpu",
                    value: v.to_string(),
                    expected: GPU_EXPECTED,
                })?;
                Ok(GpuRequest::Gpu { count })
            }
            "mig" => {
                let v = value
                    .ok_or(RequestError::MissingValue { kind: "mig", expected: MIG_EXPECTED })?;
                if !is_profile_name(v) {
                    return Err(RequestError::BadValue {
                        kind: "mig",
                        value: v.to_string(),
                        expected: MIG_EXPECTED,
                    });
                }
                Ok(GpuRequest::Mig { profile: v.to_string() })
            }
            "mps" => {
                let v = value
                    .ok_or(RequestError::MissingValue { kind: "mps", expected: MPS_EXPECTED })?;
                let pct = parse_bounded(v, 1, 100).ok_or_else(|| RequestError::BadValue {
                    kind: "mps",
                    value: v.to_string(),
                    expected: MPS_EXPECTED,
                })?;
                // parse_bounded guarantees 1..=100, which fits a u8.
                Ok(GpuRequest::Mps { percent: u8::try_from(pct).unwrap_or(100) })
            }
            "shared" => match value {
                None => Ok(GpuRequest::Shared),
                Some(v) => Err(RequestError::UnexpectedValue(v.to_string())),
            },
            other => Err(RequestError::UnknownKind(other.to_string())),
        }
    }
}

impl fmt::Display for GpuRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuRequest::Gpu { count } => write!(f, "gpu={count}"),
            GpuRequest::Mig { profile } => write!(f, "mig={profile}"),
            GpuRequest::Mps { percent } => write!(f, "mps={percent}"),
            GpuRequest::Shared => f.write_str("shared"),
        }
    }
}

impl TryFrom<String> for GpuRequest {
    type Error = RequestError;
    fn try_from(raw: String) -> Result<Self, Self::Error> {
        raw.parse()
    }
}

impl Serialize for GpuRequest {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

fn parse_bounded(v: &str, lo: u32, hi: u32) -> Option<u32> {
    if v.is_empty() || v.len() > 3 || !v.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    v.parse::<u32>().ok().filter(|n| (lo..=hi).contains(n))
}

/// `<N>g.<M>gb` optionally followed by `+me`, e.g. `1g.10gb`, `1g.10gb+me`, `7g.80gb`.
fn is_profile_name(v: &str) -> bool {
    let v = v.strip_suffix("+me").unwrap_or(v);
    let Some((g, mem)) = v.split_once("g.") else { return false };
    let Some(gb) = mem.strip_suffix("gb") else { return false };
    let digits = |s: &str| !s.is_empty() && s.len() <= 3 && s.bytes().all(|b| b.is_ascii_digit());
    digits(g) && digits(gb)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_each_kind() {
        assert_eq!("gpu=2".parse(), Ok(GpuRequest::Gpu { count: 2 }));
        assert_eq!(" mig=1g.10gb ".parse(), Ok(GpuRequest::Mig { profile: "1g.10gb".into() }));
        assert_eq!("mig=1g.10gb+me".parse(), Ok(GpuRequest::Mig { profile: "1g.10gb+me".into() }));
        assert_eq!("mps=25".parse(), Ok(GpuRequest::Mps { percent: 25 }));
        assert_eq!("shared".parse(), Ok(GpuRequest::Shared));
    }

    #[test]
    fn rejects_bad_requests_with_reasons() {
        assert_eq!("".parse::<GpuRequest>(), Err(RequestError::Empty));
        assert_eq!("tpu=1".parse::<GpuRequest>(), Err(RequestError::UnknownKind("tpu".into())));
        assert!(matches!("gpu".parse::<GpuRequest>(), Err(RequestError::MissingValue { .. })));
        assert!(matches!("gpu=0".parse::<GpuRequest>(), Err(RequestError::BadValue { .. })));
        assert!(matches!("gpu=-1".parse::<GpuRequest>(), Err(RequestError::BadValue { .. })));
        assert!(matches!(
            "gpu=99999999999".parse::<GpuRequest>(),
            Err(RequestError::BadValue { .. })
        ));
        assert!(matches!("mps=101".parse::<GpuRequest>(), Err(RequestError::BadValue { .. })));
        assert!(matches!("mig=big".parse::<GpuRequest>(), Err(RequestError::BadValue { .. })));
        assert!(matches!(
            "mig=1g.10gb;rm".parse::<GpuRequest>(),
            Err(RequestError::BadValue { .. })
        ));
        assert_eq!(
            "shared=2".parse::<GpuRequest>(),
            Err(RequestError::UnexpectedValue("2".into()))
        );
        let msg = "mps=500".parse::<GpuRequest>().unwrap_err().to_string();
        assert!(msg.contains("mps") && msg.contains("500") && msg.contains("1 to 100"), "{msg}");
    }

    #[test]
    fn errors_show_the_value_escaped_and_bounded() {
        let forged = "1\nlevel=error msg=forged\u{1b}[2J\0";
        for raw in [format!("gpu={forged}"), format!("tpu{forged}=1"), format!("shared={forged}")] {
            let msg = raw.parse::<GpuRequest>().unwrap_err().to_string();
            assert!(!msg.contains(['\n', '\u{1b}', '\0']), "{msg:?}");
            assert!(msg.contains("\\n"), "{msg:?}");
        }
        let huge = format!("mig={}", "x".repeat(100_000));
        let msg = huge.parse::<GpuRequest>().unwrap_err().to_string();
        assert!(
            msg.len() < 512 && msg.contains("100000 bytes in all"),
            "{} bytes: {}",
            msg.len(),
            &msg[..100]
        );
    }

    #[test]
    fn the_wire_form_is_the_string_form() {
        let req = GpuRequest::Mig { profile: "1g.10gb".into() };
        assert_eq!(serde_json::to_string(&req).expect("ser"), r#""mig=1g.10gb""#);
        assert_eq!(serde_json::from_str::<GpuRequest>(r#""mig=1g.10gb""#).expect("de"), req);
        assert_eq!(
            serde_json::from_str::<GpuRequest>(r#"" gpu=1 ""#).expect("de").to_string(),
            "gpu=1"
        );
        let err = serde_json::from_str::<GpuRequest>(r#""mig=b\nig""#).unwrap_err().to_string();
        assert!(err.contains("bad value `b\\nig` for `mig`"), "{err}");
        assert!(serde_json::from_str::<GpuRequest>("{\"Gpu\":{\"count\":1}}").is_err());
    }

    proptest! {
        #[test]
        fn display_round_trips(req in prop_oneof![
            (1u32..=64).prop_map(|count| GpuRequest::Gpu { count }),
            (1u8..=100).prop_map(|percent| GpuRequest::Mps { percent }),
            (1u32..8, 1u32..200, any::<bool>()).prop_map(|(g, m, me)| GpuRequest::Mig {
                profile: format!("{g}g.{m}gb{}", if me { "+me" } else { "" }),
            }),
            Just(GpuRequest::Shared),
        ]) {
            prop_assert_eq!(req.to_string().parse::<GpuRequest>(), Ok(req));
        }

        #[test]
        fn never_panics_on_arbitrary_input(s in ".{0,40}") {
            let _ = s.parse::<GpuRequest>();
        }
    }
}
