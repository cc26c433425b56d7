//! What the kubelet device plugin hands to a container, and how that becomes a request.
//!
//! tesserad advertises its capacity to kubelet as extended resources (`tessera.io/gpu`,
//! `tessera.io/mig-1g.10gb`, `tessera.io/mps`, `tessera.io/shared`). When kubelet admits a
//! pod, it picks device ids of a resource and calls the plugin's `Allocate`; the plugin
//! answers with no device nodes and no mounts (Tessera injects devices at create, after
//! policy), only the container annotation [`ASSIGNMENT_ANNOTATION`] whose value is a
//! [`PluginAssignment`]: the resource and the ids kubelet chose. tessera-runtime reads it as
//! the container's request ([`PluginAssignment::request`]) and tesserad makes the grant on
//! exactly those devices.
//!
//! The text form of an assignment is `v1;<resource>;<id>[,<id>…]`, for example
//! `v1;tessera.io/mps;GPU-1:mps:0,GPU-1:mps:1`: versioned (an unknown version is refused,
//! not guessed at), bounded ([`MAX_ASSIGNMENT_BYTES`], [`MAX_DEVICE_IDS`],
//! [`MAX_DEVICE_ID_BYTES`]), and strict (no spaces, no empty or repeated id, every id a
//! [`DeviceId`] of the kind its resource serves). tesserad records assignments in this
//! form.
//!
//! The annotation is an [`IssuedAssignment`]: `v2;<resource>;<id>[,<id>…];<token>`, the
//! assignment and the [`AssignmentToken`] (128 random bits, 32 lowercase hex digits) that
//! tesserad recorded for it when its `Allocate` answered. Anyone who writes a config can
//! write the annotation; only kubelet (through the plugin's root-only sockets) is handed a
//! token, and tesserad honours an assignment only with a token it issued for exactly those
//! ids. A `v1` annotation (no token) is refused.
//!
//! Device ids ([`DeviceId`]) name what kubelet counts: a whole GPU by its uuid, a MIG
//! instance by its uuid, a MIG instance not cut yet by its placement
//! (`GPU-…:mig:1g.10gb:3`), one percent of a GPU's MPS capacity (`GPU-…:mps:17`), one
//! time-slice replica (`GPU-…:shared:2`). At most 63 bytes, kubelet's limit.

use std::fmt;
use std::str::FromStr;

use crate::display::untrusted;
use crate::ids::DeviceUuid;
use crate::request::GpuRequest;

/// The container annotation the device plugin's `Allocate` returns.
pub const ASSIGNMENT_ANNOTATION: &str = "tessera.io/device-plugin";

/// The version prefix of an assignment's text form (as recorded by tesserad).
pub const ASSIGNMENT_VERSION: &str = "v1";

/// The version prefix of the annotation: an assignment with its token.
pub const ANNOTATION_VERSION: &str = "v2";

/// Hex digits of an [`AssignmentToken`] (128 bits).
pub const TOKEN_HEX_DIGITS: usize = 32;

/// The longest assignment text read.
pub const MAX_ASSIGNMENT_BYTES: usize = 16 * 1024;

/// The most device ids one assignment names (an MPS grant is at most 100 units).
pub const MAX_DEVICE_IDS: usize = 128;

/// The longest device id (kubelet's limit for `Device.ID`).
pub const MAX_DEVICE_ID_BYTES: usize = 63;

/// The most time-slice replicas a GPU is advertised with (ids `GPU-…:shared:0..N`).
pub const MAX_REPLICAS: u32 = 256;

/// The domain of every resource name Tessera advertises.
pub const RESOURCE_DOMAIN: &str = "tessera.io";
/// Whole GPUs: one id per GPU.
pub const RESOURCE_GPU: &str = "tessera.io/gpu";
/// MPS percent: one id per percent of one GPU's MPS capacity.
pub const RESOURCE_MPS: &str = "tessera.io/mps";
/// Time-slice replicas: one id per replica.
pub const RESOURCE_SHARED: &str = "tessera.io/shared";
/// MIG instances of one profile: `tessera.io/mig-<profile>` (see [`PluginResource::Mig`]).
pub const RESOURCE_MIG_PREFIX: &str = "tessera.io/mig-";

/// One resource name the plugin serves.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PluginResource {
    /// [`RESOURCE_GPU`].
    Gpu,
    /// `tessera.io/mig-<profile>`, with the MIG profile as the request grammar names it
    /// (`1g.10gb`, `1g.10gb+me`). A resource name may not hold `+` (Kubernetes' qualified
    /// name rule), so `+me` is written `-me` in the name: `tessera.io/mig-1g.10gb-me`.
    Mig(String),
    /// [`RESOURCE_MPS`].
    Mps,
    /// [`RESOURCE_SHARED`].
    Shared,
}

impl PluginResource {
    /// The resource name kubelet and pods use.
    pub fn name(&self) -> String {
        match self {
            PluginResource::Gpu => RESOURCE_GPU.to_string(),
            PluginResource::Mps => RESOURCE_MPS.to_string(),
            PluginResource::Shared => RESOURCE_SHARED.to_string(),
            PluginResource::Mig(profile) => {
                let p = profile.strip_suffix("+me").map_or(profile.clone(), |p| format!("{p}-me"));
                format!("{RESOURCE_MIG_PREFIX}{p}")
            }
        }
    }

    /// The resource a MIG profile is served as, when `profile` is a profile name.
    pub fn mig(profile: &str) -> Result<Self, AssignmentError> {
        match format!("mig={profile}").parse::<GpuRequest>() {
            Ok(GpuRequest::Mig { profile }) => Ok(PluginResource::Mig(profile)),
            _ => Err(AssignmentError::UnknownResource(format!("{RESOURCE_MIG_PREFIX}{profile}"))),
        }
    }
}

impl fmt::Display for PluginResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

impl FromStr for PluginResource {
    type Err = AssignmentError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let unknown = || AssignmentError::UnknownResource(s.to_string());
        match s {
            RESOURCE_GPU => Ok(PluginResource::Gpu),
            RESOURCE_MPS => Ok(PluginResource::Mps),
            RESOURCE_SHARED => Ok(PluginResource::Shared),
            _ => {
                let name = s.strip_prefix(RESOURCE_MIG_PREFIX).ok_or_else(unknown)?;
                if name.contains('+') {
                    return Err(unknown());
                }
                let profile =
                    name.strip_suffix("-me").map_or(name.to_string(), |p| format!("{p}+me"));
                let r = PluginResource::mig(&profile).map_err(|_| unknown())?;
                // One spelling per resource: the parse must give back the same name.
                if r.name() == s {
                    Ok(r)
                } else {
                    Err(unknown())
                }
            }
        }
    }
}

/// Why a text is not an assignment, or an assignment not a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AssignmentError {
    #[error("device-plugin assignment is {0} bytes, more than the {MAX_ASSIGNMENT_BYTES} allowed")]
    TooLong(usize),
    #[error(
        "device-plugin assignment `{}` is not of the form {ASSIGNMENT_VERSION};<resource>;<id>[,<id>...]",
        untrusted(.0)
    )]
    Syntax(String),
    #[error(
        "device-plugin assignment version `{}` is not understood (this build reads {ASSIGNMENT_VERSION})",
        untrusted(.0)
    )]
    Version(String),
    #[error(
        "device-plugin resource `{}` is not one Tessera serves (expected {RESOURCE_GPU}, {RESOURCE_MPS}, {RESOURCE_SHARED} or {RESOURCE_MIG_PREFIX}<profile> such as {RESOURCE_MIG_PREFIX}1g.10gb)",
        untrusted(.0)
    )]
    UnknownResource(String),
    #[error("device-plugin assignment names no device")]
    NoDevices,
    #[error("device-plugin assignment names {0} devices, more than the {MAX_DEVICE_IDS} allowed")]
    TooManyDevices(usize),
    #[error(
        "device id `{}` is not a device id (expected GPU-…, MIG-…, GPU-…:mig:<profile>:<start>, GPU-…:mps:<0-99> or GPU-…:shared:<replica>, at most {MAX_DEVICE_ID_BYTES} bytes)",
        untrusted(.0)
    )]
    BadDeviceId(String),
    #[error("device id `{id}` is not a device of {resource}")]
    WrongKind { resource: String, id: String },
    #[error("{resource} devices {first} and {second} are on different GPUs: one grant is one GPU's share")]
    SpreadOverGpus { resource: String, first: String, second: String },
    #[error("device id `{}` is named twice", untrusted(.0))]
    DuplicateDevice(String),
    #[error("{count} devices of {resource} are not one grant: expected {expected}")]
    Count { resource: String, count: usize, expected: &'static str },
    #[error(
        "device-plugin assignment `{}` carries no token: only an assignment that tesserad's own Allocate \
         issued ({ANNOTATION_VERSION};<resource>;<ids>;<token>) is honoured",
        untrusted(.0)
    )]
    NoToken(String),
    #[error(
        "device-plugin token `{}` is not a token (expected {TOKEN_HEX_DIGITS} lowercase hex digits)",
        untrusted(.0)
    )]
    BadToken(String),
}

/// The resource and the device ids kubelet chose for one container.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PluginAssignment {
    resource: String,
    device_ids: Vec<String>,
}

/// One device id the plugin advertises; see the module documentation.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DeviceId {
    /// A whole GPU (MIG off): its uuid.
    Gpu(DeviceUuid),
    /// A MIG instance that exists: its uuid.
    Instance(DeviceUuid),
    /// A MIG instance of `profile` to be cut at `start` on `gpu`: `GPU-…:mig:<profile>:<start>`.
    Placement { gpu: DeviceUuid, profile: String, start: u8 },
    /// One percent of `gpu`'s MPS capacity: `GPU-…:mps:<unit>`, unit 0 to 99.
    MpsUnit { gpu: DeviceUuid, unit: u8 },
    /// One time-slice replica of `gpu`: `GPU-…:shared:<replica>`.
    Replica { gpu: DeviceUuid, replica: u32 },
}

impl DeviceId {
    /// The GPU uuid of every id but [`DeviceId::Instance`] (whose GPU only the inventory knows).
    pub fn gpu(&self) -> Option<&DeviceUuid> {
        match self {
            DeviceId::Gpu(g)
            | DeviceId::Placement { gpu: g, .. }
            | DeviceId::MpsUnit { gpu: g, .. }
            | DeviceId::Replica { gpu: g, .. } => Some(g),
            DeviceId::Instance(_) => None,
        }
    }
}

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceId::Gpu(u) | DeviceId::Instance(u) => f.write_str(u),
            DeviceId::Placement { gpu, profile, start } => write!(f, "{gpu}:mig:{profile}:{start}"),
            DeviceId::MpsUnit { gpu, unit } => write!(f, "{gpu}:mps:{unit}"),
            DeviceId::Replica { gpu, replica } => write!(f, "{gpu}:shared:{replica}"),
        }
    }
}

impl FromStr for DeviceId {
    type Err = AssignmentError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || AssignmentError::BadDeviceId(s.to_string());
        if s.len() > MAX_DEVICE_ID_BYTES {
            return Err(bad());
        }
        // A plain decimal without sign or leading zero (one spelling per id).
        let number = |t: &str, max: u32| -> Option<u32> {
            let plain = !t.is_empty()
                && t.len() <= 3
                && t.bytes().all(|b| b.is_ascii_digit())
                && (t == "0" || !t.starts_with('0'));
            plain.then(|| t.parse::<u32>().ok()).flatten().filter(|n| *n <= max)
        };
        let gpu_uuid =
            |t: &str| DeviceUuid::new(t).ok().filter(|u| u.starts_with("GPU-")).ok_or_else(bad);
        let parts: Vec<&str> = s.split(':').collect();
        let id = match parts.as_slice() {
            [one] if one.starts_with("GPU-") => DeviceId::Gpu(gpu_uuid(one)?),
            [one] if one.starts_with("MIG-") => {
                DeviceId::Instance(DeviceUuid::new(*one).map_err(|_| bad())?)
            }
            [gpu, "mig", profile, start] => {
                let Ok(GpuRequest::Mig { profile }) = format!("mig={profile}").parse() else {
                    return Err(bad());
                };
                let start = number(start, 7).ok_or_else(bad)?;
                DeviceId::Placement {
                    gpu: gpu_uuid(gpu)?,
                    profile,
                    start: u8::try_from(start).map_err(|_| bad())?,
                }
            }
            [gpu, "mps", unit] => {
                let unit = number(unit, 99).ok_or_else(bad)?;
                DeviceId::MpsUnit {
                    gpu: gpu_uuid(gpu)?,
                    unit: u8::try_from(unit).map_err(|_| bad())?,
                }
            }
            [gpu, "shared", replica] => DeviceId::Replica {
                gpu: gpu_uuid(gpu)?,
                replica: number(replica, MAX_REPLICAS - 1).ok_or_else(bad)?,
            },
            _ => return Err(bad()),
        };
        // One spelling per id: what parses must print back the same.
        if id.to_string() == s {
            Ok(id)
        } else {
            Err(bad())
        }
    }
}

impl PluginResource {
    /// Whether `id` is a device of this resource: a GPU uuid for [`PluginResource::Gpu`],
    /// an instance uuid or a placement of the profile for [`PluginResource::Mig`], MPS
    /// units for [`PluginResource::Mps`], replicas for [`PluginResource::Shared`]. (That an
    /// instance uuid is of the profile only the inventory knows.)
    pub fn accepts(&self, id: &DeviceId) -> bool {
        match (self, id) {
            (PluginResource::Gpu, DeviceId::Gpu(_))
            | (PluginResource::Mig(_), DeviceId::Instance(_))
            | (PluginResource::Mps, DeviceId::MpsUnit { .. })
            | (PluginResource::Shared, DeviceId::Replica { .. }) => true,
            (PluginResource::Mig(p), DeviceId::Placement { profile, .. }) => p == profile,
            _ => false,
        }
    }
}

impl PluginAssignment {
    /// Checks and wraps: `resource` must be one [`PluginResource`] name, `device_ids`
    /// 1 to [`MAX_DEVICE_IDS`] distinct [`DeviceId`]s of that resource (kept in the order
    /// given).
    pub fn new(
        resource: impl Into<String>,
        device_ids: Vec<String>,
    ) -> Result<Self, AssignmentError> {
        let resource = resource.into();
        let typed = resource.parse::<PluginResource>()?;
        if device_ids.is_empty() {
            return Err(AssignmentError::NoDevices);
        }
        if device_ids.len() > MAX_DEVICE_IDS {
            return Err(AssignmentError::TooManyDevices(device_ids.len()));
        }
        let mut seen = std::collections::HashSet::new();
        for id in &device_ids {
            let parsed: DeviceId = id.parse()?;
            if !typed.accepts(&parsed) {
                return Err(AssignmentError::WrongKind { resource, id: id.clone() });
            }
            if !seen.insert(id.as_str()) {
                return Err(AssignmentError::DuplicateDevice(id.clone()));
            }
        }
        Ok(PluginAssignment { resource, device_ids })
    }

    /// The device ids, typed (each was checked by [`PluginAssignment::new`]).
    pub fn devices(&self) -> Vec<DeviceId> {
        self.device_ids.iter().filter_map(|id| id.parse().ok()).collect()
    }

    /// The resource name (`tessera.io/gpu`, …).
    pub fn resource(&self) -> &str {
        &self.resource
    }

    /// The resource, typed.
    pub fn plugin_resource(&self) -> PluginResource {
        // `new` checked that it parses.
        self.resource.parse().unwrap_or(PluginResource::Gpu)
    }

    /// The device ids, in kubelet's order.
    pub fn device_ids(&self) -> &[String] {
        &self.device_ids
    }

    /// The request this assignment is: `tessera.io/gpu` × N is `gpu=N`, one
    /// `tessera.io/mig-P` is `mig=P`, `tessera.io/mps` × N is `mps=N`, one
    /// `tessera.io/shared` is `shared`. Other counts are no single grant and are refused.
    pub fn request(&self) -> Result<GpuRequest, AssignmentError> {
        let n = self.device_ids.len();
        let count = |expected: &'static str| AssignmentError::Count {
            resource: self.resource.clone(),
            count: n,
            expected,
        };
        match self.plugin_resource() {
            PluginResource::Gpu => {
                let count_ok = u32::try_from(n).ok().filter(|c| (1..=64).contains(c));
                let c = count_ok.ok_or_else(|| count("1 to 64 GPUs"))?;
                Ok(GpuRequest::Gpu { count: c })
            }
            PluginResource::Mig(profile) if n == 1 => Ok(GpuRequest::Mig { profile }),
            PluginResource::Mig(_) => Err(count("one MIG instance per container")),
            PluginResource::Mps => {
                let pct = u8::try_from(n).ok().filter(|p| (1..=100).contains(p));
                let p = pct.ok_or_else(|| count("1 to 100 percent of one GPU"))?;
                let devices = self.devices();
                if let Some(other) = devices.iter().find(|d| d.gpu() != devices[0].gpu()) {
                    return Err(AssignmentError::SpreadOverGpus {
                        resource: self.resource.clone(),
                        first: devices[0].to_string(),
                        second: other.to_string(),
                    });
                }
                Ok(GpuRequest::Mps { percent: p })
            }
            PluginResource::Shared if n == 1 => Ok(GpuRequest::Shared),
            PluginResource::Shared => Err(count("one time-slice replica per container")),
        }
    }
}

impl fmt::Display for PluginAssignment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{ASSIGNMENT_VERSION};{};{}", self.resource, self.device_ids.join(","))
    }
}

impl FromStr for PluginAssignment {
    type Err = AssignmentError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() > MAX_ASSIGNMENT_BYTES {
            return Err(AssignmentError::TooLong(s.len()));
        }
        let mut parts = s.split(';');
        let (Some(version), Some(resource), Some(ids), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            // A future version may have another shape: name the version when there is one.
            return match s.split_once(';') {
                Some((v, _)) if v != ASSIGNMENT_VERSION && v.starts_with('v') => {
                    Err(AssignmentError::Version(v.to_string()))
                }
                _ => Err(AssignmentError::Syntax(s.to_string())),
            };
        };
        if version != ASSIGNMENT_VERSION {
            return Err(AssignmentError::Version(version.to_string()));
        }
        if ids.is_empty() {
            return Err(AssignmentError::NoDevices);
        }
        let n = ids.split(',').count();
        if n > MAX_DEVICE_IDS {
            return Err(AssignmentError::TooManyDevices(n));
        }
        PluginAssignment::new(resource, ids.split(',').map(str::to_string).collect())
    }
}

/// The token tesserad issues with an assignment: 128 random bits as 32 lowercase hex
/// digits. Shown in full only by [`IssuedAssignment`]'s text (the annotation);
/// [`AssignmentToken::short`] and `Debug` show its first 8 digits.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AssignmentToken(String);

impl AssignmentToken {
    /// The token of 16 random bytes.
    pub fn from_bytes(bytes: [u8; 16]) -> AssignmentToken {
        use fmt::Write as _;
        let mut hex = String::with_capacity(TOKEN_HEX_DIGITS);
        for b in bytes {
            let _ = write!(hex, "{b:02x}");
        }
        AssignmentToken(hex)
    }

    /// The 32 hex digits.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Its first 8 digits and `…`, for messages and logs.
    pub fn short(&self) -> String {
        format!("{}…", &self.0[..8])
    }
}

impl fmt::Debug for AssignmentToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AssignmentToken({})", self.short())
    }
}

impl FromStr for AssignmentToken {
    type Err = AssignmentError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let hex = |b: u8| b.is_ascii_digit() || (b'a'..=b'f').contains(&b);
        if s.len() == TOKEN_HEX_DIGITS && s.bytes().all(hex) {
            Ok(AssignmentToken(s.to_string()))
        } else {
            Err(AssignmentError::BadToken(s.to_string()))
        }
    }
}

/// What `Allocate` puts in the annotation: the assignment and its token
/// (`v2;<resource>;<id>[,<id>…];<token>`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IssuedAssignment {
    assignment: PluginAssignment,
    token: AssignmentToken,
}

impl IssuedAssignment {
    pub fn new(assignment: PluginAssignment, token: AssignmentToken) -> IssuedAssignment {
        IssuedAssignment { assignment, token }
    }

    pub fn assignment(&self) -> &PluginAssignment {
        &self.assignment
    }

    pub fn token(&self) -> &AssignmentToken {
        &self.token
    }
}

impl fmt::Display for IssuedAssignment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let a = &self.assignment;
        write!(
            f,
            "{ANNOTATION_VERSION};{};{};{}",
            a.resource,
            a.device_ids.join(","),
            self.token.as_str()
        )
    }
}

impl FromStr for IssuedAssignment {
    type Err = AssignmentError;

    /// Strict as [`PluginAssignment`]'s form; a `v1` text (no token) is
    /// [`AssignmentError::NoToken`].
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() > MAX_ASSIGNMENT_BYTES {
            return Err(AssignmentError::TooLong(s.len()));
        }
        match s.split_once(';') {
            Some((ASSIGNMENT_VERSION, _)) => {
                // Say it is tokenless only of a text that is an assignment otherwise.
                s.parse::<PluginAssignment>()?;
                return Err(AssignmentError::NoToken(s.to_string()));
            }
            Some((ANNOTATION_VERSION, _)) => {}
            Some((v, _)) if v.starts_with('v') => {
                return Err(AssignmentError::Version(v.to_string()))
            }
            _ => return Err(AssignmentError::Syntax(s.to_string())),
        }
        let Some((body, token)) = s.rsplit_once(';') else {
            return Err(AssignmentError::Syntax(s.to_string()));
        };
        // `v2;<resource>;<ids>` is `v1;<resource>;<ids>` and the token after it.
        let rest = &body[ANNOTATION_VERSION.len()..];
        let assignment = format!("{ASSIGNMENT_VERSION}{rest}")
            .parse::<PluginAssignment>()
            .map_err(|e| match e {
                AssignmentError::Syntax(_) => AssignmentError::Syntax(s.to_string()),
                other => other,
            })?;
        Ok(IssuedAssignment { assignment, token: token.parse()? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn resource_names_round_trip() {
        for (r, name) in [
            (PluginResource::Gpu, "tessera.io/gpu"),
            (PluginResource::Mps, "tessera.io/mps"),
            (PluginResource::Shared, "tessera.io/shared"),
            (PluginResource::Mig("1g.10gb".into()), "tessera.io/mig-1g.10gb"),
            (PluginResource::Mig("1g.10gb+me".into()), "tessera.io/mig-1g.10gb-me"),
            (PluginResource::Mig("7g.80gb".into()), "tessera.io/mig-7g.80gb"),
        ] {
            assert_eq!(r.name(), name);
            assert_eq!(name.parse::<PluginResource>(), Ok(r));
        }
        for bad in [
            "tessera.io/GPU",
            "tessera.io/mig-",
            "tessera.io/mig-big",
            "tessera.io/mig-1g.10gb+me",
            "tessera.io/mig-1g.10gb-me-me",
            "nvidia.com/gpu",
            "tessera.io/gpu ",
            "",
        ] {
            assert!(
                matches!(bad.parse::<PluginResource>(), Err(AssignmentError::UnknownResource(_))),
                "{bad}"
            );
        }
        assert!(PluginResource::mig("x").is_err());
    }

    #[test]
    fn device_ids_have_one_spelling() {
        let gpu = DeviceUuid::new("GPU-0a1b").expect("uuid");
        for (text, id) in [
            ("GPU-0a1b", DeviceId::Gpu(gpu.clone())),
            ("MIG-77", DeviceId::Instance(DeviceUuid::new("MIG-77").expect("uuid"))),
            (
                "GPU-0a1b:mig:1g.10gb+me:6",
                DeviceId::Placement { gpu: gpu.clone(), profile: "1g.10gb+me".into(), start: 6 },
            ),
            ("GPU-0a1b:mps:0", DeviceId::MpsUnit { gpu: gpu.clone(), unit: 0 }),
            ("GPU-0a1b:mps:99", DeviceId::MpsUnit { gpu: gpu.clone(), unit: 99 }),
            ("GPU-0a1b:shared:12", DeviceId::Replica { gpu: gpu.clone(), replica: 12 }),
        ] {
            assert_eq!(text.parse::<DeviceId>(), Ok(id.clone()), "{text}");
            assert_eq!(id.to_string(), text);
        }
        // A full NVML uuid fits kubelet's 63 bytes in every form.
        let long = "GPU-fef8089b-4820-abfc-e83e-94318197576e";
        for text in [format!("{long}:mig:1g.10gb+me:6"), format!("{long}:mps:99")] {
            assert!(
                text.len() <= MAX_DEVICE_ID_BYTES && text.parse::<DeviceId>().is_ok(),
                "{text}"
            );
        }
        for bad in [
            "",
            "GPU-",
            "gpu-1",
            "MIG-1:mps:0",
            "GPU-1:mps:100",
            "GPU-1:mps:07",
            "GPU-1:mps:+7",
            "GPU-1:mps:",
            "GPU-1:mps:1:2",
            "GPU-1:shared:256",
            "GPU-1:mig:1g.10gb:8",
            "GPU-1:mig:big:0",
            "GPU-1:mig: 1g.10gb:0",
            "GPU-1:tpu:0",
            "GPU-1/2",
            "GPU-é",
            &format!("GPU-{}", "a".repeat(60)),
        ] {
            assert!(
                matches!(bad.parse::<DeviceId>(), Err(AssignmentError::BadDeviceId(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn text_form_round_trips() {
        let a = PluginAssignment::new("tessera.io/mps", ids(&["GPU-1:mps:0", "GPU-1:mps:1"]))
            .expect("valid");
        let text = a.to_string();
        assert_eq!(text, "v1;tessera.io/mps;GPU-1:mps:0,GPU-1:mps:1");
        assert_eq!(text.parse::<PluginAssignment>(), Ok(a.clone()));
        assert_eq!(a.resource(), "tessera.io/mps");
        assert_eq!(a.device_ids(), ids(&["GPU-1:mps:0", "GPU-1:mps:1"]).as_slice());
        assert_eq!(a.plugin_resource(), PluginResource::Mps);
        assert_eq!(a.devices().len(), 2);
    }

    #[test]
    fn requests_follow_the_resource_and_count() {
        let req = |r: &str, v: Vec<String>| PluginAssignment::new(r, v).expect("valid").request();
        let n_of = |f: &dyn Fn(usize) -> String, n: usize| (0..n).map(f).collect::<Vec<_>>();
        let gpus = |n| n_of(&|i| format!("GPU-{i}"), n);
        let units = |n| n_of(&|i| format!("GPU-a:mps:{i}"), n);
        assert_eq!(req("tessera.io/gpu", gpus(2)), Ok(GpuRequest::Gpu { count: 2 }));
        assert_eq!(req("tessera.io/mps", units(25)), Ok(GpuRequest::Mps { percent: 25 }));
        assert_eq!(req("tessera.io/mps", units(100)), Ok(GpuRequest::Mps { percent: 100 }));
        assert_eq!(req("tessera.io/shared", ids(&["GPU-a:shared:3"])), Ok(GpuRequest::Shared));
        assert_eq!(
            req("tessera.io/mig-1g.10gb-me", ids(&["GPU-a:mig:1g.10gb+me:2"])),
            Ok(GpuRequest::Mig { profile: "1g.10gb+me".into() })
        );
        assert_eq!(
            req("tessera.io/mig-3g.40gb", ids(&["MIG-x"])),
            Ok(GpuRequest::Mig { profile: "3g.40gb".into() })
        );
        for (r, v) in [
            ("tessera.io/gpu", gpus(65)),
            ("tessera.io/shared", ids(&["GPU-a:shared:0", "GPU-a:shared:1"])),
            ("tessera.io/mig-1g.10gb", ids(&["MIG-a", "MIG-b"])),
        ] {
            let n = v.len();
            let e = req(r, v).unwrap_err();
            assert!(matches!(e, AssignmentError::Count { .. }), "{r} {n}: {e}");
            assert!(e.to_string().contains(r) && e.to_string().contains(&n.to_string()), "{e}");
        }
        // MPS units of two GPUs are no single grant.
        let e = req("tessera.io/mps", ids(&["GPU-a:mps:0", "GPU-b:mps:1"])).unwrap_err();
        assert!(matches!(e, AssignmentError::SpreadOverGpus { .. }), "{e}");
        assert!(e.to_string().contains("GPU-b:mps:1"), "{e}");
    }

    #[test]
    fn ids_must_be_of_their_resource() {
        for (r, id) in [
            ("tessera.io/gpu", "MIG-1"),
            ("tessera.io/gpu", "GPU-1:mps:0"),
            ("tessera.io/mps", "GPU-1"),
            ("tessera.io/shared", "GPU-1:mps:0"),
            ("tessera.io/mig-1g.10gb", "GPU-1"),
            ("tessera.io/mig-1g.10gb", "GPU-1:mig:2g.20gb:0"),
        ] {
            let e = PluginAssignment::new(r, ids(&[id])).unwrap_err();
            assert!(matches!(e, AssignmentError::WrongKind { .. }), "{r} {id}: {e}");
        }
    }

    #[test]
    fn strict_parse_refuses_with_reasons() {
        let err = |s: &str| s.parse::<PluginAssignment>().unwrap_err();
        assert!(matches!(err(""), AssignmentError::Syntax(_)));
        assert!(matches!(err("v1;tessera.io/gpu"), AssignmentError::Syntax(_)));
        assert!(matches!(err("v1;tessera.io/gpu;GPU-1;x"), AssignmentError::Syntax(_)));
        assert!(matches!(err("v2;tessera.io/gpu;GPU-1"), AssignmentError::Version(_)));
        assert!(matches!(err("v2;whatever"), AssignmentError::Version(_)));
        assert!(matches!(err("V1;tessera.io/gpu;GPU-1"), AssignmentError::Version(_)));
        assert!(matches!(err(" v1;tessera.io/gpu;GPU-1"), AssignmentError::Version(_)));
        assert!(matches!(err("v1;tessera.io/tpu;GPU-1"), AssignmentError::UnknownResource(_)));
        assert!(matches!(err("v1;tessera.io/gpu;"), AssignmentError::NoDevices));
        assert!(matches!(err("v1;tessera.io/gpu;GPU-1,"), AssignmentError::BadDeviceId(_)));
        assert!(matches!(err("v1;tessera.io/gpu;GPU-1, GPU-2"), AssignmentError::BadDeviceId(_)));
        assert!(matches!(
            err("v1;tessera.io/gpu;GPU-1,GPU-1"),
            AssignmentError::DuplicateDevice(_)
        ));
        assert!(matches!(err("v1;tessera.io/gpu;GPU-é"), AssignmentError::BadDeviceId(_)));
        let many: Vec<String> = (0..=MAX_DEVICE_IDS).map(|i| format!("GPU-{i}")).collect();
        let text = format!("v1;tessera.io/gpu;{}", many.join(","));
        assert_eq!(err(&text), AssignmentError::TooManyDevices(MAX_DEVICE_IDS + 1));
        assert!(matches!(err(&"v1;tessera.io/gpu;".repeat(2000)), AssignmentError::TooLong(_)));
        assert_eq!(
            PluginAssignment::new("tessera.io/gpu", Vec::new()),
            Err(AssignmentError::NoDevices)
        );
    }

    const TOKEN: &str = "0123456789abcdef0123456789abcdef";

    #[test]
    fn the_annotation_is_the_assignment_and_its_token() {
        let a = PluginAssignment::new("tessera.io/mps", ids(&["GPU-1:mps:0", "GPU-1:mps:1"]))
            .expect("valid");
        let token = AssignmentToken::from_bytes([
            0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef, 0x01, 0x23, 0x45, 0x67, 0x89, 0xab,
            0xcd, 0xef,
        ]);
        assert_eq!(token.as_str(), TOKEN);
        assert_eq!(format!("{token:?}"), "AssignmentToken(01234567…)", "no full token in logs");
        let issued = IssuedAssignment::new(a.clone(), token.clone());
        let text = issued.to_string();
        assert_eq!(text, format!("v2;tessera.io/mps;GPU-1:mps:0,GPU-1:mps:1;{TOKEN}"));
        assert_eq!(text.parse::<IssuedAssignment>(), Ok(issued.clone()));
        assert_eq!((issued.assignment(), issued.token()), (&a, &token));
        // The recorded form stays v1, and still parses.
        assert_eq!(a.to_string(), "v1;tessera.io/mps;GPU-1:mps:0,GPU-1:mps:1");
    }

    #[test]
    fn an_annotation_without_a_good_token_is_refused() {
        let err = |s: &str| s.parse::<IssuedAssignment>().unwrap_err();
        // v1: an assignment, but no token.
        let e = err("v1;tessera.io/gpu;GPU-1");
        assert!(matches!(e, AssignmentError::NoToken(_)), "{e}");
        assert!(e.to_string().contains("carries no token"), "{e}");
        // A v1 text that is no assignment says what is wrong with it first.
        assert!(matches!(err("v1;tessera.io/tpu;GPU-1"), AssignmentError::UnknownResource(_)));
        for bad_token in [
            "",
            "0123456789abcdef0123456789abcde",
            "0123456789abcdef0123456789abcdef0",
            "0123456789ABCDEF0123456789ABCDEF",
            "0123456789abcdef0123456789abcdeg",
            " 123456789abcdef0123456789abcdef",
        ] {
            let e = err(&format!("v2;tessera.io/gpu;GPU-1;{bad_token}"));
            assert!(matches!(e, AssignmentError::BadToken(_)), "{bad_token:?}: {e}");
        }
        assert!(matches!(err("v2;tessera.io/gpu;GPU-1"), AssignmentError::Syntax(_)));
        assert!(matches!(
            err(&format!("v2;tessera.io/gpu;GPU-1;x;{TOKEN}")),
            AssignmentError::Syntax(_)
        ));
        assert!(matches!(
            err(&format!("v2;tessera.io/gpu;GPU-1,GPU-1;{TOKEN}")),
            AssignmentError::DuplicateDevice(_)
        ));
        assert!(matches!(err(&format!("v3;x;y;{TOKEN}")), AssignmentError::Version(_)));
        assert!(matches!(err("junk"), AssignmentError::Syntax(_)));
        let e = err(&format!("v2;tessera.io/gpu;GPU-1;{}\n", &TOKEN[1..]));
        assert!(!e.to_string().contains('\n'), "{e}");
        assert!(matches!(err(&"v2;".repeat(10_000)), AssignmentError::TooLong(_)));
    }

    #[test]
    fn errors_are_escaped_and_bounded() {
        let forged = "v1;tessera.io/gpu\nlevel=error msg=forged\u{1b}[2J;GPU-1";
        let msg = forged.parse::<PluginAssignment>().unwrap_err().to_string();
        assert!(!msg.contains(['\n', '\u{1b}']), "{msg:?}");
        assert!(msg.contains("\\n"), "{msg}");
        let msg = "v1;tessera.io/gpu;GPU-1\n".parse::<PluginAssignment>().unwrap_err().to_string();
        assert!(!msg.contains('\n') && msg.contains("GPU-1\\n"), "{msg:?}");
        let huge = format!("v1;tessera.io/gpu;{}", "é".repeat(5000));
        let msg = huge.parse::<PluginAssignment>().unwrap_err().to_string();
        assert!(msg.len() < 1024, "{} bytes", msg.len());
        let huge = format!("x{}", "y".repeat(10_000));
        let msg = huge.parse::<PluginAssignment>().unwrap_err().to_string();
        assert!(msg.len() < 1024 && msg.contains("10001 bytes in all"), "{msg}");
    }
}
