//! Declared MIG layouts: what a policy may declare for every GPU of a model (`all-1g`,
//! `all-balanced`, or an explicit `<profile>@<start>` list), its text form, and its
//! resolution against a model of the catalog. The plan that converges a node to it is
//! `slicer::layout`.

use std::fmt;
use std::str::FromStr;

use crate::{placement_is_legal, GpuModel, LayoutError, Profile};

/// A MIG layout a policy declares for every GPU of a model.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum DeclaredLayout {
    /// Seven 1-slice instances of the model's smallest profile (`1g.10gb` on H100-80GB),
    /// at slots 0 to 6.
    All1g,
    /// One each of 3g, 2g and two 1g, the shape of mig-parted's `all-balanced`, placed so
    /// that every compute slice is used: 2g@0, 1g@2, 1g@3, 3g@4 (on H100-80GB:
    /// `2g.20gb@0, 1g.10gb@2, 1g.10gb@3, 3g.40gb@4`). The often quoted 3g@0 + 2g@4 +
    /// 1g@6 leaves slot 7 unusable and a compute slice idle.
    AllBalanced,
    /// Exactly these `(profile, start)` instances.
    Explicit(Vec<(String, u8)>),
}

impl DeclaredLayout {
    /// The `(profile, start)` instances this layout means on `model`, checked for
    /// legality, in the order they are to be created (biggest first, then by slot).
    pub fn resolve(&self, model: &GpuModel) -> Result<Vec<(&'static Profile, u8)>, LayoutError> {
        let by_slices = |slices: u8| {
            model.profiles.iter().find(|p| p.compute_slices == slices && !p.is_media_extension())
        };
        let missing = |what: &str| LayoutError::UnknownProfile {
            model: model.name,
            profile: what.to_string(),
            offered: model.profile_names().collect::<Vec<_>>().join(", "),
        };
        let mut out: Vec<(&'static Profile, u8)> = match self {
            DeclaredLayout::All1g => {
                let one = by_slices(1).ok_or_else(|| missing("1g"))?;
                one.starts.iter().map(|&s| (one, s)).collect()
            }
            DeclaredLayout::AllBalanced => {
                let one = by_slices(1).ok_or_else(|| missing("1g"))?;
                let two = by_slices(2).ok_or_else(|| missing("2g"))?;
                let three = by_slices(3).ok_or_else(|| missing("3g"))?;
                vec![(two, 0), (one, 2), (one, 3), (three, 4)]
            }
            DeclaredLayout::Explicit(list) => list
                .iter()
                .map(|(name, start)| {
                    model.profile(name).map(|p| (p, *start)).ok_or_else(|| missing(name))
                })
                .collect::<Result<_, _>>()?,
        };
        let names: Vec<(&str, u8)> = out.iter().map(|(p, s)| (p.name, *s)).collect();
        placement_is_legal(model, &names)?;
        out.sort_by_key(|&(p, s)| creation_key(p, s));
        Ok(out)
    }
}

/// Creation order on one GPU: the most compute slices first (3g before smaller ones: a
/// driver quirk), then the bigger memory footprint, then the lower slot.
fn creation_key(p: &Profile, start: u8) -> (std::cmp::Reverse<u8>, std::cmp::Reverse<u8>, u8) {
    (std::cmp::Reverse(p.compute_slices), std::cmp::Reverse(p.size), start)
}

impl fmt::Display for DeclaredLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeclaredLayout::All1g => f.write_str("all-1g"),
            DeclaredLayout::AllBalanced => f.write_str("all-balanced"),
            DeclaredLayout::Explicit(list) => {
                let parts: Vec<String> = list.iter().map(|(p, s)| format!("{p}@{s}")).collect();
                f.write_str(&parts.join(","))
            }
        }
    }
}

/// A layout spelled as text: `all-1g`, `all-balanced`, or a comma-separated list of
/// `<profile>@<start>` (`3g.40gb@4,2g.20gb@0,1g.10gb@2,1g.10gb@3`; `none` or an empty
/// string for no instances).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{text}` is not a MIG layout: {reason} (expected all-1g, all-balanced or <profile>@<start>,...)")]
pub struct ParseLayoutError {
    pub text: String,
    pub reason: String,
}

impl FromStr for DeclaredLayout {
    type Err = ParseLayoutError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let t = text.trim();
        match t {
            "all-1g" => return Ok(DeclaredLayout::All1g),
            "all-balanced" => return Ok(DeclaredLayout::AllBalanced),
            "" | "none" => return Ok(DeclaredLayout::Explicit(Vec::new())),
            _ => {}
        }
        let err = |reason: String| ParseLayoutError { text: text.to_string(), reason };
        let mut list = Vec::new();
        for part in t.split(',') {
            let part = part.trim();
            let (profile, start) =
                part.split_once('@').ok_or_else(|| err(format!("`{part}` has no `@<start>`")))?;
            let start: u8 = start
                .trim()
                .parse()
                .map_err(|_| err(format!("`{start}` in `{part}` is not a start slot")))?;
            let profile = profile.trim();
            if profile.is_empty() {
                return Err(err(format!("`{part}` has no profile")));
            }
            list.push((profile.to_string(), start));
        }
        Ok(DeclaredLayout::Explicit(list))
    }
}

impl serde::Serialize for DeclaredLayout {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for DeclaredLayout {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h100() -> &'static GpuModel {
        crate::model("H100-80GB").expect("h100")
    }

    #[test]
    fn layouts_resolve_on_every_model() {
        for m in crate::MODELS {
            for l in [DeclaredLayout::All1g, DeclaredLayout::AllBalanced] {
                let r = l.resolve(m).expect("legal");
                let compute: u8 = r.iter().map(|(p, _)| p.compute_slices).sum();
                assert_eq!(compute, 7, "{m} {l}");
            }
        }
        let bal: Vec<(&str, u8)> = DeclaredLayout::AllBalanced
            .resolve(h100())
            .expect("legal")
            .iter()
            .map(|(p, s)| (p.name, *s))
            .collect();
        // Creation order: 3g first.
        assert_eq!(bal, [("3g.40gb", 4), ("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3)]);
        let bad: DeclaredLayout = "3g.40gb@0,2g.20gb@2".parse().expect("parses");
        assert!(matches!(bad.resolve(h100()), Err(LayoutError::Overlap { .. })));
    }

    #[test]
    fn layouts_parse_and_print() {
        for t in ["all-1g", "all-balanced", "3g.40gb@4,2g.20gb@0"] {
            let l: DeclaredLayout = t.parse().expect("parse");
            assert_eq!(l.to_string(), t);
            let json = serde_json::to_string(&l).expect("ser");
            assert_eq!(serde_json::from_str::<DeclaredLayout>(&json).expect("de"), l);
        }
        assert_eq!("none".parse::<DeclaredLayout>(), Ok(DeclaredLayout::Explicit(vec![])));
        let e = "3g.40gb".parse::<DeclaredLayout>().unwrap_err();
        assert!(e.to_string().contains("`3g.40gb` has no `@<start>`"), "{e}");
        let e = "3g.40gb@x".parse::<DeclaredLayout>().unwrap_err();
        assert!(e.to_string().contains("not a start slot"), "{e}");
    }
}
