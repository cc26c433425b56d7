//! What a node's GPUs look like right now, and the pure parsers of the host files the
//! inventory is built from (`/proc/devices`, `/proc/driver/nvidia-caps/mig-minors`).
//! The parsers take text, never paths: callers own the paths.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The major of `/dev/nvidia*` and `/dev/nvidiactl`, fixed by the driver.
pub const NVIDIA_MAJOR: u32 = 195;
/// The minor of `/dev/nvidiactl`.
pub const NVIDIACTL_MINOR: u32 = 255;
/// GPU-instance ids per GPU the driver reserves cap minors for (`gi0`..`gi14`).
pub const CAP_GIS_PER_GPU: u32 = 15;
/// Cap minors per GPU instance: one for the GI, eight for its compute instances.
pub const CAPS_PER_GI: u32 = 9;
/// Compute-instance ids per GPU instance (`ci0`..`ci7`).
pub const CAP_CIS_PER_GI: u32 = CAPS_PER_GI - 1;

/// A node's GPUs and the device majors needed to hand them out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Inventory {
    pub node: String,
    pub gpus: Vec<Gpu>,
    pub majors: Majors,
}

/// Character-device majors of the NVIDIA driver, from `/proc/devices`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Majors {
    /// `nvidia-frontend` (195 on every driver).
    pub nvidia: u32,
    pub nvidia_uvm: u32,
    /// `nvidia-caps`; absent when the driver exposes no capability devices.
    pub nvidia_caps: Option<u32>,
}

impl Majors {
    /// Every NVIDIA major this node has, ascending.
    pub fn all(&self) -> Vec<u32> {
        let mut v: Vec<u32> = [Some(self.nvidia), Some(self.nvidia_uvm), self.nvidia_caps]
            .into_iter()
            .flatten()
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }
}

/// One physical GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Gpu {
    /// NVML index.
    pub index: u32,
    /// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
    pub uuid: String,
    /// Catalog model name (e.g. `H100-80GB`), or the driver's name for a model the catalog
    /// does not know.
    pub model: String,
    /// Device minor: `/dev/nvidia<minor>`. Not necessarily the index.
    pub minor: u32,
    pub memory_mib: u64,
    /// In MIG mode the GPU is handed out only by instance, never whole.
    pub mig_enabled: bool,
    /// MIG instances, by start slot. Empty when MIG is off.
    pub instances: Vec<MigInstance>,
}

/// One MIG device: a compute instance inside a GPU instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigInstance {
    /// `MIG-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
    pub uuid: String,
    /// e.g. `3g.40gb`.
    pub profile: String,
    pub gi_id: u32,
    pub ci_id: u32,
    /// Start slot on the 8-slot memory axis.
    pub start: u8,
    /// Slots taken on the memory axis.
    pub size: u8,
    pub memory_mib: u64,
    /// `/dev/nvidia-caps/nvidia-cap<gi_cap_minor>`: access to the GPU instance.
    pub gi_cap_minor: u32,
    /// `/dev/nvidia-caps/nvidia-cap<ci_cap_minor>`: access to the compute instance.
    pub ci_cap_minor: u32,
}

/// A device of the inventory found by uuid: a whole GPU, or a MIG instance and its GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Found<'a> {
    Gpu(&'a Gpu),
    Mig(&'a Gpu, &'a MigInstance),
}

impl MigInstance {
    /// An instance of `profile` starting at memory slot `start`, as placement planning and
    /// simulation see it before a driver creates it: GI/CI ids and cap minors still 0.
    pub fn planned(
        uuid: impl Into<String>,
        profile: &crate::catalog::Profile,
        start: u8,
    ) -> MigInstance {
        MigInstance {
            uuid: uuid.into(),
            profile: profile.name.to_string(),
            gi_id: 0,
            ci_id: 0,
            start,
            size: profile.size,
            memory_mib: profile.memory_mib,
            gi_cap_minor: 0,
            ci_cap_minor: 0,
        }
    }
}

impl Found<'_> {
    /// What a container holding this device is granted; refused when the driver's UUID is
    /// not one ([`tessera_api::DeviceUuid`]): no grant names a device by a string it cannot
    /// be found by again.
    pub fn granted(&self) -> Result<tessera_api::GrantedDevice, tessera_api::InvalidDeviceUuid> {
        Ok(match *self {
            Found::Gpu(g) => tessera_api::GrantedDevice {
                uuid: g.uuid.parse()?,
                gpu_uuid: g.uuid.parse()?,
                gpu_index: g.index,
                model: g.model.clone(),
                mig_profile: None,
                placement: None,
            },
            Found::Mig(g, i) => tessera_api::GrantedDevice {
                uuid: i.uuid.parse()?,
                gpu_uuid: g.uuid.parse()?,
                gpu_index: g.index,
                model: g.model.clone(),
                mig_profile: Some(i.profile.clone()),
                placement: Some((i.start, i.size)),
            },
        })
    }
}

impl Inventory {
    /// The GPU with NVML index `index`.
    pub fn gpu(&self, index: u32) -> Option<&Gpu> {
        self.gpus.iter().find(|g| g.index == index)
    }

    /// The GPU or MIG instance with this uuid.
    pub fn find(&self, uuid: &str) -> Option<Found<'_>> {
        for gpu in &self.gpus {
            if gpu.uuid == uuid {
                return Some(Found::Gpu(gpu));
            }
            if let Some(inst) = gpu.instances.iter().find(|i| i.uuid == uuid) {
                return Some(Found::Mig(gpu, inst));
            }
        }
        None
    }
}

/// A line of a host file that is not what the driver writes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{file} line {line} `{text}`: {reason}")]
pub struct ParseError {
    /// Which file, e.g. `mig-minors`.
    pub file: &'static str,
    /// 1-based line number.
    pub line: usize,
    pub text: String,
    pub reason: String,
}

impl ParseError {
    fn new(file: &'static str, line: usize, text: &str, reason: impl Into<String>) -> Self {
        ParseError { file, line, text: text.to_string(), reason: reason.into() }
    }
}

/// The character-device section of `/proc/devices`: driver name → major.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcDevices {
    chars: BTreeMap<String, u32>,
}

impl ProcDevices {
    /// The major of the character device driver `name`.
    pub fn char_major(&self, name: &str) -> Option<u32> {
        self.chars.get(name).copied()
    }

    /// The NVIDIA majors. `nvidia-frontend` (or `nvidia` on old drivers) and `nvidia-uvm`
    /// must be present; `nvidia-caps` may be absent.
    pub fn majors(&self) -> Result<Majors, MissingMajor> {
        let nvidia = self
            .char_major("nvidia-frontend")
            .or_else(|| self.char_major("nvidia"))
            .ok_or(MissingMajor("nvidia-frontend"))?;
        let nvidia_uvm = self.char_major("nvidia-uvm").ok_or(MissingMajor("nvidia-uvm"))?;
        Ok(Majors { nvidia, nvidia_uvm, nvidia_caps: self.char_major("nvidia-caps") })
    }
}

/// A driver `/proc/devices` does not list.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no `{0}` character device in /proc/devices (is the module loaded? `nvidia-modprobe -u -c=0` loads nvidia-uvm)")]
pub struct MissingMajor(pub &'static str);

/// Parse `/proc/devices`. Only the `Character devices:` section is kept; lines before any
/// section header count as character devices.
pub fn parse_proc_devices(text: &str) -> Result<ProcDevices, ParseError> {
    const FILE: &str = "/proc/devices";
    let mut out = ProcDevices::default();
    let mut in_chars = true;
    for (n, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        if line.ends_with(':') {
            in_chars = line == "Character devices:";
            continue;
        }
        if !in_chars {
            continue;
        }
        let (major, name) = line
            .split_once(char::is_whitespace)
            .ok_or_else(|| ParseError::new(FILE, n + 1, raw, "expected `<major> <name>`"))?;
        let major: u32 = major.parse().map_err(|_| {
            ParseError::new(FILE, n + 1, raw, format!("`{major}` is not a major number"))
        })?;
        let name = name.trim();
        if name.is_empty() || name.contains(char::is_whitespace) {
            return Err(ParseError::new(FILE, n + 1, raw, "expected `<major> <name>`"));
        }
        // A driver may register several majors under one name; the first is the one
        // that matters for the devices we use.
        out.chars.entry(name.to_string()).or_insert(major);
    }
    Ok(out)
}

/// Key of an access capability: (GPU device minor, GPU-instance id, compute-instance id).
type CapKey = (u32, u32, Option<u32>);

/// The access-capability minors of `/proc/driver/nvidia-caps/mig-minors`.
///
/// Only `gpu<minor>/gi<id>[/ci<id>]/access` entries can be looked up: the `config` and
/// `monitor` capabilities are parsed (so they can never be mistaken for access caps) and
/// deliberately not exposed, because a tenant must never get them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MigMinors {
    access: BTreeMap<CapKey, u32>,
    reserved: Vec<u32>,
}

impl MigMinors {
    /// The cap minor of `gpu<gpu_minor>/gi<gi>/access` (`ci: None`) or
    /// `gpu<gpu_minor>/gi<gi>/ci<ci>/access`.
    pub fn get(&self, gpu_minor: u32, gi: u32, ci: Option<u32>) -> Option<u32> {
        self.access.get(&(gpu_minor, gi, ci)).copied()
    }

    /// How many access entries the file has.
    pub fn len(&self) -> usize {
        self.access.len()
    }

    pub fn is_empty(&self) -> bool {
        self.access.is_empty()
    }
}

/// Parse `mig-minors`: lines `config 1`, `monitor 2`, `gpu0/gi1/access 12`,
/// `gpu0/gi1/ci0/access 13`. Unknown or duplicate entries are errors, and so is an
/// access entry that reuses the `config` or `monitor` minor.
pub fn parse_mig_minors(text: &str) -> Result<MigMinors, ParseError> {
    const FILE: &str = "mig-minors";
    let mut out = MigMinors::default();
    let mut seen_reserved: Vec<&str> = Vec::new();
    let mut lines: Vec<(usize, &str, u32)> = Vec::new();
    for (n, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        let err = |reason: String| ParseError::new(FILE, n + 1, raw, reason);
        let mut fields = line.split_whitespace();
        let (Some(key), Some(value), None) = (fields.next(), fields.next(), fields.next()) else {
            return Err(err("expected `<name> <minor>`".into()));
        };
        let minor: u32 =
            value.parse().map_err(|_| err(format!("`{value}` is not a minor number")))?;
        if key == "config" || key == "monitor" {
            if seen_reserved.contains(&key) {
                return Err(err(format!("second `{key}` entry")));
            }
            seen_reserved.push(key);
            out.reserved.push(minor);
            continue;
        }
        let cap = parse_cap_key(key).map_err(err)?;
        if out.access.insert(cap, minor).is_some() {
            return Err(err(format!("second entry for `{key}`")));
        }
        lines.push((n + 1, raw, minor));
    }
    if let Some((line, raw, minor)) = lines.into_iter().find(|(_, _, m)| out.reserved.contains(m)) {
        return Err(ParseError::new(
            FILE,
            line,
            raw,
            format!("access cap minor {minor} is also the config or monitor cap"),
        ));
    }
    Ok(out)
}

fn parse_cap_key(key: &str) -> Result<CapKey, String> {
    let bad =
        || format!("expected `gpu<N>/gi<N>/access` or `gpu<N>/gi<N>/ci<N>/access`, not `{key}`");
    let parts: Vec<&str> = key.split('/').collect();
    let (gpu, gi, ci) = match parts.as_slice() {
        [gpu, gi, "access"] => (*gpu, *gi, None),
        [gpu, gi, ci, "access"] => (*gpu, *gi, Some(*ci)),
        _ => return Err(bad()),
    };
    let num = |s: &str, prefix: &str| -> Result<u32, String> {
        let digits = s.strip_prefix(prefix).ok_or_else(bad)?;
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        digits.parse().map_err(|_| bad())
    };
    let ci = match ci {
        Some(c) => Some(num(c, "ci")?),
        None => None,
    };
    Ok((num(gpu, "gpu")?, num(gi, "gi")?, ci))
}

/// The cap minor the driver gives `gpu<gpu_minor>/gi<gi>/access` (`ci: None`) or
/// `.../ci<ci>/access`: `3 + gpu_minor*135 + gi*9`, plus `1 + ci` for a compute instance.
pub fn driver_cap_minor(gpu_minor: u32, gi: u32, ci: Option<u32>) -> u32 {
    let gi_minor = 3 + gpu_minor * CAP_GIS_PER_GPU * CAPS_PER_GI + gi * CAPS_PER_GI;
    match ci {
        None => gi_minor,
        Some(ci) => gi_minor + 1 + ci,
    }
}

/// A `mig-minors` file as the driver writes it for GPUs with these device minors.
pub fn render_mig_minors(gpu_minors: &[u32]) -> String {
    let mut out = String::from("config 1\nmonitor 2\n");
    for &gpu in gpu_minors {
        for gi in 0..CAP_GIS_PER_GPU {
            out.push_str(&format!("gpu{gpu}/gi{gi}/access {}\n", driver_cap_minor(gpu, gi, None)));
            for ci in 0..CAP_CIS_PER_GI {
                out.push_str(&format!(
                    "gpu{gpu}/gi{gi}/ci{ci}/access {}\n",
                    driver_cap_minor(gpu, gi, Some(ci))
                ));
            }
        }
    }
    out
}

/// A `/proc/devices` file listing these NVIDIA majors (and a few ordinary devices).
pub fn render_proc_devices(majors: &Majors) -> String {
    let mut out = String::from("Character devices:\n  1 mem\n  4 /dev/vc/0\n  5 /dev/tty\n");
    out.push_str(&format!("{} nvidia-frontend\n", majors.nvidia));
    out.push_str(&format!("{} nvidia-uvm\n", majors.nvidia_uvm));
    if let Some(caps) = majors.nvidia_caps {
        out.push_str(&format!("{caps} nvidia-caps\n"));
    }
    out.push_str("\nBlock devices:\n  7 loop\n  8 sd\n");
    out
}

/// `Device Minor:` of `/proc/driver/nvidia/gpus/<bus id>/information`.
pub fn parse_device_minor(information: &str) -> Result<u32, ParseError> {
    const FILE: &str = "information";
    for (n, raw) in information.lines().enumerate() {
        if let Some((k, v)) = raw.split_once(':') {
            if k.trim() == "Device Minor" {
                return v.trim().parse().map_err(|_| {
                    ParseError::new(FILE, n + 1, raw, "device minor is not a number")
                });
            }
        }
    }
    Err(ParseError::new(FILE, 0, "", "no `Device Minor:` line"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PROC_DEVICES: &str = "Character devices:
  1 mem
  4 /dev/vc/0
  4 tty
195 nvidia-frontend
235 nvidia-caps
508 nvidia-uvm
510 nvidia-uvm

Block devices:
  7 loop
259 blkext
";

    #[test]
    fn parses_proc_devices() {
        let d = parse_proc_devices(PROC_DEVICES).expect("parse");
        assert_eq!(d.char_major("mem"), Some(1));
        assert_eq!(d.char_major("loop"), None, "block devices are not character devices");
        assert_eq!(d.majors(), Ok(Majors { nvidia: 195, nvidia_uvm: 508, nvidia_caps: Some(235) }));
        let old = parse_proc_devices("195 nvidia\n511 nvidia-uvm\n").expect("headerless");
        assert_eq!(old.majors(), Ok(Majors { nvidia: 195, nvidia_uvm: 511, nvidia_caps: None }));
        let no_uvm =
            parse_proc_devices("Character devices:\n195 nvidia-frontend\n").expect("parse");
        let err = no_uvm.majors().unwrap_err();
        assert!(err.to_string().contains("no `nvidia-uvm` character device"), "{err}");
    }

    #[test]
    fn proc_devices_malformed_lines_are_clear_errors() {
        let err = parse_proc_devices("Character devices:\n  1 mem\nxyz nvidia-uvm\n").unwrap_err();
        assert_eq!(err.line, 3);
        assert_eq!(
            err.to_string(),
            "/proc/devices line 3 `xyz nvidia-uvm`: `xyz` is not a major number"
        );
        let err = parse_proc_devices("Character devices:\n195\n").unwrap_err();
        assert!(err.to_string().contains("expected `<major> <name>`"), "{err}");
        let err = parse_proc_devices("195 nvidia frontend\n").unwrap_err();
        assert!(err.to_string().contains("line 1"), "{err}");
    }

    #[test]
    fn parses_mig_minors() {
        let m = parse_mig_minors("config 1\nmonitor 2\ngpu0/gi0/access 3\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\n\ngpu1/gi2/ci7/access 164\n").expect("parse");
        assert_eq!(m.get(0, 1, None), Some(12));
        assert_eq!(m.get(0, 1, Some(0)), Some(13));
        assert_eq!(m.get(1, 2, Some(7)), Some(164));
        assert_eq!(m.get(0, 2, None), None);
        assert_eq!(m.len(), 4);
    }

    #[test]
    fn mig_minors_malformed_lines_are_clear_errors() {
        let cases = [
            ("gpu0/gix/access 12", "expected `gpu<N>/gi<N>/access`"),
            ("gpu0/gi1/access twelve", "`twelve` is not a minor number"),
            ("gpu0/gi1/ci0/access", "expected `<name> <minor>`"),
            ("gpu0/gi1/access 12 13", "expected `<name> <minor>`"),
            ("gpu0/gi1/ci0/read 13", "expected `gpu<N>/gi<N>/access`"),
            ("gpu/gi1/access 13", "expected `gpu<N>/gi<N>/access`"),
            ("gpu0/gi+1/access 13", "expected `gpu<N>/gi<N>/access`"),
            ("gpu0/gi1/access 12\ngpu0/gi1/access 14", "second entry for `gpu0/gi1/access`"),
            ("config 1\nconfig 2", "second `config` entry"),
            ("config 1\ngpu0/gi1/access 1", "also the config or monitor cap"),
        ];
        for (text, want) in cases {
            let err = parse_mig_minors(text).unwrap_err();
            assert!(err.to_string().contains(want), "{text:?}: {err}");
            assert!(err.to_string().starts_with("mig-minors line "), "{err}");
        }
    }

    #[test]
    fn driver_numbering_round_trips() {
        assert_eq!(driver_cap_minor(0, 1, None), 12);
        assert_eq!(driver_cap_minor(0, 1, Some(0)), 13);
        assert_eq!(driver_cap_minor(1, 0, None), 138);
        let text = render_mig_minors(&[0, 1, 5]);
        let m = parse_mig_minors(&text).expect("parse generated");
        assert_eq!(m.len(), 3 * 15 * 9);
        for gpu in [0, 1, 5] {
            for gi in 0..15 {
                assert_eq!(m.get(gpu, gi, None), Some(driver_cap_minor(gpu, gi, None)));
                for ci in 0..8 {
                    assert_eq!(m.get(gpu, gi, Some(ci)), Some(driver_cap_minor(gpu, gi, Some(ci))));
                }
            }
        }
        assert_eq!(m.get(2, 0, None), None);
        let majors = Majors { nvidia: 195, nvidia_uvm: 508, nvidia_caps: Some(509) };
        let d = parse_proc_devices(&render_proc_devices(&majors)).expect("parse generated");
        assert_eq!(d.majors(), Ok(majors));
    }

    #[test]
    fn parses_device_minor() {
        let info = "Model: \t\t NVIDIA H100 80GB HBM3\nIRQ:   \t\t 0\nDevice Minor: \t 3\nBus Type: \t PCIe\n";
        assert_eq!(parse_device_minor(info), Ok(3));
        assert!(parse_device_minor("Model: x\n").is_err());
        assert!(parse_device_minor("Device Minor: x\n")
            .unwrap_err()
            .to_string()
            .contains("line 1"));
    }

    #[test]
    fn finds_devices_by_uuid() {
        let inst = MigInstance {
            uuid: "MIG-a".into(),
            profile: "1g.10gb".into(),
            gi_id: 1,
            ci_id: 0,
            start: 0,
            size: 1,
            memory_mib: 9856,
            gi_cap_minor: 12,
            ci_cap_minor: 13,
        };
        let gpu = Gpu {
            index: 0,
            uuid: "GPU-a".into(),
            model: "H100-80GB".into(),
            minor: 0,
            memory_mib: 81559,
            mig_enabled: true,
            instances: vec![inst.clone()],
        };
        let inv = Inventory {
            node: "n".into(),
            gpus: vec![gpu.clone()],
            majors: Majors { nvidia: 195, nvidia_uvm: 508, nvidia_caps: None },
        };
        assert_eq!(inv.find("GPU-a"), Some(Found::Gpu(&gpu)));
        assert_eq!(inv.find("MIG-a"), Some(Found::Mig(&gpu, &inst)));
        assert_eq!(inv.find("GPU-b"), None);
        assert_eq!(inv.gpu(0), Some(&gpu));
        let json = serde_json::to_string(&inv).expect("ser");
        assert_eq!(serde_json::from_str::<Inventory>(&json).expect("de"), inv);
    }
}
