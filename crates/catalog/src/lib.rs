//! The GPU catalog: models, their MIG profiles and the placement rules of the 8-slot
//! memory axis. Pure data and pure checks.
//!
//! The tables come from NVIDIA's MIG User Guide (see `shared/REFERENCE.md`). The driver is
//! the source of truth on real hardware: the NVML backend reads placements, profile ids
//! and instance memory from the driver; these tables drive the simulated backend, the
//! legality checks and the tests.
//!
//! This crate is pure (no driver, no I/O): the policy crate validates declared layouts
//! with it without linking NVML. `slicer` re-exports it as `slicer::catalog`.
//!
//! - the catalog: [`MODELS`], [`model`], [`GpuModel`], [`Profile`], [`placement_is_legal`];
//! - [`layout`]: the [`DeclaredLayout`] a policy declares per model, parsed from text.

use std::collections::BTreeMap;
use std::fmt;

pub mod layout;
pub use layout::{DeclaredLayout, ParseLayoutError};

/// Slots on the memory axis of a MIG-capable GPU.
pub const MEMORY_SLOTS: u8 = 8;
/// Compute slices of a MIG-capable GPU.
pub const COMPUTE_SLICES: u8 = 7;

/// One GPU model the catalog knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuModel {
    /// Catalog name, e.g. `H100-80GB`.
    pub name: &'static str,
    /// Total device memory as NVML reports it for this model, in MiB.
    pub memory_mib: u64,
    /// MIG profiles, in the catalog's order (1g, 1g+me, 1g double memory, 2g, 3g, 4g, 7g).
    pub profiles: &'static [Profile],
}

/// One MIG GPU-instance profile of a model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Profile {
    /// e.g. `1g.10gb`, `1g.10gb+me`, `3g.40gb`.
    pub name: &'static str,
    /// The GPU-instance profile id `nvidia-smi mig -lgip` shows (19, 20, 15, 14, 9, 5, 0).
    /// NVML's `nvmlGpuInstanceInfo_t.profileId` carries this id too.
    pub smi_id: u32,
    /// NVML's profile enum (`NVML_GPU_INSTANCE_PROFILE_*`), the argument of
    /// `nvmlDeviceGetGpuInstanceProfileInfo`.
    pub nvml_id: u32,
    /// Compute slices out of [`COMPUTE_SLICES`].
    pub compute_slices: u8,
    /// Slots taken on the 8-slot memory axis.
    pub size: u8,
    /// Legal start slots on the memory axis.
    pub starts: &'static [u8],
    /// Most instances of this profile one GPU can hold.
    pub max_instances: u8,
    /// Memory of one instance, in MiB.
    pub memory_mib: u64,
}

impl Profile {
    /// Whether this is a media-extension (`+me`) profile: at most one per GPU.
    pub fn is_media_extension(&self) -> bool {
        self.name.ends_with("+me")
    }
}

impl GpuModel {
    /// The profile called `name`, if this model offers it.
    pub fn profile(&self, name: &str) -> Option<&'static Profile> {
        self.profiles.iter().find(|p| p.name == name)
    }

    /// The profile with nvidia-smi / NVML GPU-instance profile id `smi_id`.
    pub fn profile_by_smi_id(&self, smi_id: u32) -> Option<&'static Profile> {
        self.profiles.iter().find(|p| p.smi_id == smi_id)
    }

    /// Names of every profile of this model, in catalog order.
    pub fn profile_names(&self) -> impl Iterator<Item = &'static str> {
        self.profiles.iter().map(|p| p.name)
    }
}

/// The seven profile shapes shared by every model: (suffix, smi id, nvml id, compute
/// slices, size, starts, max instances). Only names and memory differ between models.
const ALL_STARTS: &[u8] = &[0, 1, 2, 3, 4, 5, 6];
const EVEN_STARTS: &[u8] = &[0, 2, 4, 6];
const TWO_G_STARTS: &[u8] = &[0, 2, 4];
const THREE_G_STARTS: &[u8] = &[0, 4];
const ZERO_START: &[u8] = &[0];

macro_rules! profiles {
    ($one:literal, $one_me:literal, $one_double:literal, $two:literal, $three:literal, $four:literal, $seven:literal;
     $m1:expr, $m1d:expr, $m2:expr, $m3:expr, $m4:expr, $m7:expr) => {
        &[
            Profile {
                name: $one,
                smi_id: 19,
                nvml_id: 0,
                compute_slices: 1,
                size: 1,
                starts: ALL_STARTS,
                max_instances: 7,
                memory_mib: $m1,
            },
            Profile {
                name: $one_me,
                smi_id: 20,
                nvml_id: 7,
                compute_slices: 1,
                size: 1,
                starts: ALL_STARTS,
                max_instances: 1,
                memory_mib: $m1,
            },
            Profile {
                name: $one_double,
                smi_id: 15,
                nvml_id: 9,
                compute_slices: 1,
                size: 2,
                starts: EVEN_STARTS,
                max_instances: 4,
                memory_mib: $m1d,
            },
            Profile {
                name: $two,
                smi_id: 14,
                nvml_id: 1,
                compute_slices: 2,
                size: 2,
                starts: TWO_G_STARTS,
                max_instances: 3,
                memory_mib: $m2,
            },
            Profile {
                name: $three,
                smi_id: 9,
                nvml_id: 2,
                compute_slices: 3,
                size: 4,
                starts: THREE_G_STARTS,
                max_instances: 2,
                memory_mib: $m3,
            },
            Profile {
                name: $four,
                smi_id: 5,
                nvml_id: 3,
                compute_slices: 4,
                size: 4,
                starts: ZERO_START,
                max_instances: 1,
                memory_mib: $m4,
            },
            Profile {
                name: $seven,
                smi_id: 0,
                nvml_id: 4,
                compute_slices: 7,
                size: 8,
                starts: ZERO_START,
                max_instances: 1,
                memory_mib: $m7,
            },
        ]
    };
}

/// Every model the catalog knows.
///
/// Instance memory of the A100s is NVIDIA's exact figure. H100-80GB's is what NVML
/// reported on an H100 80GB HBM3 with driver 580.159.04 (2026-11-28, docs/GPU.md): 9984,
/// 20096, 40448 and 81152 MiB, not the A100-80GB figures assumed before (9856, 19968,
/// 40192, 80384); its profile ids, sizes and placements were as here. H200-141GB's figures
/// are an APPROXIMATION: the A100-80GB figures scaled by 141/80 and rounded to the MiB; the
/// NVML backend reports the driver's real numbers instead. Total memory is what NVML
/// reports for the model.
pub static MODELS: &[GpuModel] = &[
    GpuModel {
        name: "A100-40GB",
        memory_mib: 40960,
        profiles: profiles!("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb";
                            4864, 9856, 9856, 19968, 19968, 40192),
    },
    GpuModel {
        name: "A100-80GB",
        memory_mib: 81920,
        profiles: profiles!("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb";
                            9856, 19968, 19968, 40192, 40192, 80384),
    },
    GpuModel {
        name: "H100-80GB",
        memory_mib: 81559,
        profiles: profiles!("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb";
                            9984, 20096, 20096, 40448, 40448, 81152),
    },
    GpuModel {
        name: "H200-141GB",
        memory_mib: 143771,
        // 9856, 19968, 40192, 80384 MiB scaled by 141/80, rounded.
        profiles: profiles!("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb";
                            17371, 35194, 35194, 70838, 70838, 141677),
    },
];

/// The catalog model called `name` (e.g. `H100-80GB`).
pub fn model(name: &str) -> Option<&'static GpuModel> {
    MODELS.iter().find(|m| m.name == name)
}

/// Names of every catalog model.
pub fn model_names() -> impl Iterator<Item = &'static str> {
    MODELS.iter().map(|m| m.name)
}

/// Why a set of MIG placements cannot coexist on one GPU.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    #[error("{model} has no MIG profile `{profile}`; it offers {offered}")]
    UnknownProfile { model: &'static str, profile: String, offered: String },
    #[error("{profile} cannot start at slot {start}; legal start slots are {legal:?}")]
    IllegalStart { profile: String, start: u8, legal: &'static [u8] },
    #[error("{first} at slot {first_start} and {second} at slot {second_start} overlap on the memory axis (slot {slot})")]
    Overlap { first: String, first_start: u8, second: String, second_start: u8, slot: u8 },
    #[error("{count} instances of {profile}; a GPU holds at most {max}")]
    TooMany { profile: String, count: usize, max: u8 },
    #[error("{count} media-extension (+me) instances; a GPU holds at most one")]
    TooManyMediaExtensions { count: usize },
    #[error("the layout uses {used} compute slices; a GPU has {COMPUTE_SLICES}")]
    TooManyComputeSlices { used: u32 },
}

/// Check that MIG instances of `model` at these `(profile, start)` placements can coexist
/// on one GPU: every start is legal for its profile, no two instances overlap on the
/// memory axis, no profile exceeds its instance count, at most one `+me` instance, and
/// at most [`COMPUTE_SLICES`] compute slices in all.
pub fn placement_is_legal<P: AsRef<str>>(
    model: &GpuModel,
    placements: &[(P, u8)],
) -> Result<(), LayoutError> {
    let mut owner: [Option<usize>; MEMORY_SLOTS as usize] = [None; MEMORY_SLOTS as usize];
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    let mut media = 0usize;
    let mut compute = 0u32;
    for (i, (name, start)) in placements.iter().enumerate() {
        let name = name.as_ref();
        let profile = model.profile(name).ok_or_else(|| LayoutError::UnknownProfile {
            model: model.name,
            profile: name.to_string(),
            offered: model.profile_names().collect::<Vec<_>>().join(", "),
        })?;
        if !profile.starts.contains(start) {
            return Err(LayoutError::IllegalStart {
                profile: profile.name.to_string(),
                start: *start,
                legal: profile.starts,
            });
        }
        for slot in *start..start.saturating_add(profile.size) {
            // Legal starts keep every instance inside the axis; stay defensive anyway.
            let Some(cell) = owner.get_mut(usize::from(slot)) else {
                return Err(LayoutError::IllegalStart {
                    profile: profile.name.to_string(),
                    start: *start,
                    legal: profile.starts,
                });
            };
            if let Some(j) = *cell {
                let (other, other_start) = (&placements[j].0, placements[j].1);
                return Err(LayoutError::Overlap {
                    first: other.as_ref().to_string(),
                    first_start: other_start,
                    second: profile.name.to_string(),
                    second_start: *start,
                    slot,
                });
            }
            *cell = Some(i);
        }
        let count = counts.entry(profile.name).or_default();
        *count += 1;
        if *count > usize::from(profile.max_instances) {
            return Err(LayoutError::TooMany {
                profile: profile.name.to_string(),
                count: *count,
                max: profile.max_instances,
            });
        }
        if profile.is_media_extension() {
            media += 1;
            if media > 1 {
                return Err(LayoutError::TooManyMediaExtensions { count: media });
            }
        }
        compute += u32::from(profile.compute_slices);
        if compute > u32::from(COMPUTE_SLICES) {
            return Err(LayoutError::TooManyComputeSlices { used: compute });
        }
    }
    Ok(())
}

impl fmt::Display for GpuModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h100() -> &'static GpuModel {
        model("H100-80GB").expect("H100 in catalog")
    }

    #[test]
    fn catalog_matches_reference_tables() {
        assert_eq!(
            model_names().collect::<Vec<_>>(),
            ["A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB"]
        );
        let a40 = model("A100-40GB").expect("a100-40");
        assert_eq!(
            a40.profile_names().collect::<Vec<_>>(),
            ["1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"]
        );
        let mem: Vec<u64> = a40.profiles.iter().map(|p| p.memory_mib).collect();
        assert_eq!(mem, [4864, 4864, 9856, 9856, 19968, 19968, 40192]);
        let h = h100();
        // What NVML reported on an H100 80GB HBM3, driver 580.159.04 (docs/GPU.md).
        let mem: Vec<u64> = h.profiles.iter().map(|p| p.memory_mib).collect();
        assert_eq!(mem, [9984, 9984, 20096, 20096, 40448, 40448, 81152]);
        let p = h.profile("1g.10gb+me").expect("+me");
        assert_eq!(
            (p.smi_id, p.nvml_id, p.compute_slices, p.size, p.max_instances),
            (20, 7, 1, 1, 1)
        );
        let p = h.profile("1g.20gb").expect("1g double");
        assert_eq!(
            (p.smi_id, p.nvml_id, p.size, p.starts, p.max_instances),
            (15, 9, 2, EVEN_STARTS, 4)
        );
        let p = h.profile("3g.40gb").expect("3g");
        assert_eq!((p.smi_id, p.nvml_id, p.compute_slices, p.starts), (9, 2, 3, THREE_G_STARTS));
        assert_eq!(h.profile_by_smi_id(0).map(|p| p.name), Some("7g.80gb"));
        assert!(h.profile("9g.99gb").is_none());
        let h200 = model("H200-141GB").expect("h200");
        assert_eq!(h200.profile("7g.141gb").map(|p| p.memory_mib), Some(141677));
        assert!(model("B200").is_none());
        // Every model: smi ids and nvml ids are the reference's, every start keeps the
        // instance inside the axis.
        for m in MODELS {
            let ids: Vec<(u32, u32)> = m.profiles.iter().map(|p| (p.smi_id, p.nvml_id)).collect();
            assert_eq!(ids, [(19, 0), (20, 7), (15, 9), (14, 1), (9, 2), (5, 3), (0, 4)], "{m}");
            for p in m.profiles {
                assert!(p.starts.iter().all(|s| s + p.size <= MEMORY_SLOTS), "{m} {}", p.name);
                assert!(p.memory_mib < m.memory_mib, "{m} {}", p.name);
            }
        }
    }

    #[test]
    fn accepts_mixed_and_full_layouts() {
        let m = h100();
        placement_is_legal(m, &[("3g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6)]).expect("mixed");
        let sevens: Vec<(&str, u8)> = (0..7).map(|s| ("1g.10gb", s)).collect();
        placement_is_legal(m, &sevens).expect("seven 1g");
        placement_is_legal(m, &[("7g.80gb", 0)]).expect("7g");
        placement_is_legal(m, &[("4g.40gb", 0), ("3g.40gb", 4)]).expect("4g+3g");
        placement_is_legal(m, &[("3g.40gb", 4), ("3g.40gb", 0)]).expect("3g+3g");
        placement_is_legal(m, &[("1g.20gb", 6), ("1g.10gb+me", 0)])
            .expect("double at 6 and one +me");
        placement_is_legal::<&str>(m, &[]).expect("empty");
        placement_is_legal(m, &[(String::from("2g.20gb"), 2)]).expect("owned names");
    }

    #[test]
    fn rejects_illegal_starts() {
        let m = h100();
        let err = placement_is_legal(m, &[("3g.40gb", 2)]).unwrap_err();
        assert_eq!(
            err,
            LayoutError::IllegalStart {
                profile: "3g.40gb".into(),
                start: 2,
                legal: THREE_G_STARTS
            }
        );
        assert!(err.to_string().contains("cannot start at slot 2"), "{err}");
        assert!(placement_is_legal(m, &[("1g.10gb", 7)]).is_err());
        assert!(placement_is_legal(m, &[("2g.20gb", 6)]).is_err());
        assert!(placement_is_legal(m, &[("4g.40gb", 4)]).is_err());
        assert!(placement_is_legal(m, &[("7g.80gb", 1)]).is_err());
        assert!(placement_is_legal(m, &[("1g.20gb", 1)]).is_err());
    }

    #[test]
    fn rejects_overlaps() {
        let m = h100();
        let err = placement_is_legal(m, &[("3g.40gb", 0), ("2g.20gb", 2)]).unwrap_err();
        assert_eq!(
            err,
            LayoutError::Overlap {
                first: "3g.40gb".into(),
                first_start: 0,
                second: "2g.20gb".into(),
                second_start: 2,
                slot: 2
            }
        );
        assert!(matches!(
            placement_is_legal(m, &[("1g.10gb", 3), ("1g.10gb", 3)]),
            Err(LayoutError::Overlap { .. })
        ));
        assert!(matches!(
            placement_is_legal(m, &[("7g.80gb", 0), ("1g.10gb", 6)]),
            Err(LayoutError::Overlap { .. })
        ));
    }

    #[test]
    fn rejects_too_many_instances_and_slices() {
        let m = h100();
        // Four 2g fit neither the starts ({0,2,4}) nor the count; the count check names it
        // when the overlap check does not fire first, so use the 1g+me limit for counts.
        let err = placement_is_legal(m, &[("1g.10gb+me", 0), ("1g.10gb+me", 1)]).unwrap_err();
        assert_eq!(err, LayoutError::TooMany { profile: "1g.10gb+me".into(), count: 2, max: 1 });
        // 3g + 3g + 1g: 7 compute slices but 3g@0 and 3g@4 fill the memory axis.
        assert!(matches!(
            placement_is_legal(m, &[("3g.40gb", 0), ("3g.40gb", 4), ("1g.10gb", 6)]),
            Err(LayoutError::Overlap { .. })
        ));
        // 4 double-memory 1g + nothing else is fine; compute: 4 slices.
        placement_is_legal(m, &[("1g.20gb", 0), ("1g.20gb", 2), ("1g.20gb", 4), ("1g.20gb", 6)])
            .expect("4x 1g.20gb");
        let err = placement_is_legal(m, &[("nope", 0)]).unwrap_err();
        assert!(
            err.to_string().contains("H100-80GB has no MIG profile `nope`; it offers 1g.10gb, "),
            "{err}"
        );
    }

    #[test]
    fn compute_slice_limit_is_checked() {
        // No legal H100 layout exceeds 7 compute slices without overlapping, so check the
        // rule on a synthetic model with a roomier memory axis.
        static WIDE: &[Profile] = &[Profile {
            name: "4g.x",
            smi_id: 5,
            nvml_id: 3,
            compute_slices: 4,
            size: 1,
            starts: &[0, 1],
            max_instances: 2,
            memory_mib: 1,
        }];
        let m = GpuModel { name: "synthetic", memory_mib: 8, profiles: WIDE };
        let err = placement_is_legal(&m, &[("4g.x", 0), ("4g.x", 1)]).unwrap_err();
        assert_eq!(err, LayoutError::TooManyComputeSlices { used: 8 });
        assert!(err.to_string().contains("8 compute slices"), "{err}");
    }
}
