//! config.json as runc reads it: one canonical view, so that what Tessera decides is what
//! runc enforces.
//!
//! runc decodes config.json with Go's `encoding/json` into the runtime-spec structs. Three
//! of its rules differ from serde's, and each was used to slip past checks made on a
//! serde reading of the same bytes:
//! - **Key folding.** An object key matches a struct field case-insensitively, with
//!   Unicode simple folding (`ſ` U+017F is `s`, the Kelvin sign U+212A is `k`); an exact
//!   match is preferred. serde sees `LINUX` or `reſources` as unknown keys and keeps them;
//!   runc applies them.
//! - **Duplicates.** A later duplicate key wins (and, for an object decoded into a struct,
//!   merges into the earlier one). serde_json's `Value` keeps the last, silently.
//! - **Device numbers.** In `linux.resources.devices` an absent or `-1` major/minor is the
//!   wildcard `*`; an allow rule of type `a` (or no type) is allow-all whatever its numbers
//!   (runc's cgroup v1 emulator and the kernel both read it so); numbers outside the
//!   kernel's range are truncated on the way to `mknod` (12-bit major, 20-bit minor) or to
//!   the cgroup v2 filter (32 bits).
//!
//! This module removes the ambiguity instead of modelling it: [`parse`] refuses duplicate
//! keys anywhere, [`check_keys`] refuses, at every position where runc decodes into a
//! struct, a key that is not a field but folds onto one (and any non-ASCII key there), and
//! the typed readers ([`DeviceRule`], [`DeviceNode`]) read numbers, types and access with
//! runc's meaning and refuse what the kernel would read differently. What is left is a
//! document on which an exact-key reading (serde) and runc's reading agree, so every
//! decision made on it (allow-all, device nodes, rules, mounts, hooks, root) holds for runc.
//! The written-back config is serialized from that document: unique, exact keys.
//!
//! Unknown keys that fold onto no field are kept: runc ignores them, and so do we.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// The largest major number the kernel has (12 bits).
pub const MAX_MAJOR: i64 = (1 << 12) - 1;
/// The largest minor number the kernel has (20 bits).
pub const MAX_MINOR: i64 = (1 << 20) - 1;
/// How much of an untrusted key or value is quoted in an error.
const QUOTE_LIMIT: usize = 80;

/// Why a config.json is refused by the canonical reading.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CanonicalError {
    /// Not JSON; serde_json's message carries the line and column.
    #[error("{0}")]
    Syntax(String),
    #[error(
        "duplicate key {key} at `{at}`: runc keeps the last one and other readers the first, \
         so the config is ambiguous"
    )]
    DuplicateKey { at: String, key: Quoted },
    #[error(
        "key {key} at `{at}` is not `{field}` but runc reads it as `{field}` (Go matches keys \
         case-insensitively, with Unicode folding): write `{field}` exactly"
    )]
    FoldedKey { at: String, key: Quoted, field: &'static str },
    #[error(
        "non-ASCII key {key} at `{at}`: runc may read it as a field of the runtime spec \
         (Go folds Unicode in keys), so it is refused"
    )]
    NonAsciiKey { at: String, key: Quoted },
    /// A field has the wrong JSON type or a value runc and the kernel do not take.
    #[error("`{at}`: {message}")]
    Value { at: String, message: String },
}

/// Untrusted text for an error message, quoted: [`tessera_api::untrusted`] at most
/// [`QUOTE_LIMIT`] characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quoted(String);

impl Quoted {
    pub fn new(s: &str) -> Quoted {
        Quoted(format!("`{}`", tessera_api::untrusted(s).max_chars(QUOTE_LIMIT)))
    }
}

impl fmt::Display for Quoted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn value_err(at: &str, message: impl Into<String>) -> CanonicalError {
    CanonicalError::Value { at: at.to_string(), message: message.into() }
}

// ---------------------------------------------------------------------------------------
// Strict parsing: duplicates refused, with the JSON path
// ---------------------------------------------------------------------------------------

/// Parses JSON bytes into a `Value`, refusing a duplicate key in any object (naming its
/// path). Trailing data after the document is refused too (runc ignores it; nothing
/// legitimate writes it).
pub fn parse(bytes: &[u8]) -> Result<Value, CanonicalError> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let dup = std::cell::RefCell::new(None);
    let value = StrictSeed { at: String::new(), dup: &dup }.deserialize(&mut de);
    if let Some(e) = dup.into_inner() {
        return Err(e);
    }
    let value = value.map_err(|e| CanonicalError::Syntax(e.to_string()))?;
    de.end().map_err(|e| CanonicalError::Syntax(e.to_string()))?;
    Ok(value)
}

type DupSlot<'a> = &'a std::cell::RefCell<Option<CanonicalError>>;

/// Deserializes one JSON value at path `at`; a duplicate key is recorded in `dup` (so the
/// typed error with its path survives serde's error type) and aborts the parse.
struct StrictSeed<'a> {
    at: String,
    dup: DupSlot<'a>,
}

impl<'de> DeserializeSeed<'de> for StrictSeed<'_> {
    type Value = Value;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

fn child(at: &str, key: &str) -> String {
    if at.is_empty() {
        key.to_string()
    } else {
        format!("{at}.{key}")
    }
}

fn display_at(at: &str) -> &str {
    if at.is_empty() {
        "."
    } else {
        at
    }
}

impl<'de> Visitor<'de> for StrictSeed<'_> {
    type Value = Value;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }
    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element_seed(StrictSeed {
            at: format!("{}[{}]", self.at, out.len()),
            dup: self.dup,
        })? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if out.contains_key(&key) {
                *self.dup.borrow_mut() = Some(CanonicalError::DuplicateKey {
                    at: display_at(&self.at).to_string(),
                    key: Quoted::new(&key),
                });
                return Err(de::Error::custom("duplicate key"));
            }
            let v = map.next_value_seed(StrictSeed { at: child(&self.at, &key), dup: self.dup })?;
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}

// ---------------------------------------------------------------------------------------
// The runtime-spec's struct tree, for Go's key matching
// ---------------------------------------------------------------------------------------

/// Where in the document a value sits, as runc decodes it.
#[derive(Debug)]
pub enum Shape {
    /// A Go struct: keys match these fields (Go's folding rules).
    Struct(&'static [(&'static str, &'static Shape)]),
    /// A slice of one shape.
    List(&'static Shape),
    /// A `map[string]T`: keys are data, matched exactly.
    Map(&'static Shape),
    /// A scalar, a string slice or `interface{}`: nothing below is matched to fields.
    Leaf,
}

use Shape::{Leaf, List, Map as MapOf, Struct};

// The union of the fields of runtime-spec 1.0.2 (runc 1.1) through 1.2/1.3 (newer runc):
// a field missing here would let a fold of it through as an unknown key.
static LEAF: Shape = Leaf;
static STRINGS: Shape = Leaf;
static STRING_MAP: Shape = MapOf(&LEAF);
pub static SPEC: Shape = Struct(&[
    ("ociVersion", &LEAF),
    ("process", &PROCESS),
    ("root", &ROOT),
    ("hostname", &LEAF),
    ("domainname", &LEAF),
    ("mounts", &MOUNTS),
    ("hooks", &HOOKS),
    ("annotations", &STRING_MAP),
    ("linux", &LINUX),
    ("solaris", &SOLARIS),
    ("windows", &WINDOWS),
    ("vm", &VM),
    ("zos", &ZOS),
]);
static PROCESS: Shape = Struct(&[
    ("terminal", &LEAF),
    ("consoleSize", &BOX),
    ("user", &USER),
    ("args", &STRINGS),
    ("commandLine", &LEAF),
    ("env", &STRINGS),
    ("cwd", &LEAF),
    ("capabilities", &CAPABILITIES),
    ("rlimits", &RLIMITS),
    ("noNewPrivileges", &LEAF),
    ("apparmorProfile", &LEAF),
    ("oomScoreAdj", &LEAF),
    ("scheduler", &SCHEDULER),
    ("selinuxLabel", &LEAF),
    ("ioPriority", &IO_PRIORITY),
    ("execCPUAffinity", &EXEC_CPU_AFFINITY),
]);
static BOX: Shape = Struct(&[("height", &LEAF), ("width", &LEAF)]);
static USER: Shape = Struct(&[
    ("uid", &LEAF),
    ("gid", &LEAF),
    ("umask", &LEAF),
    ("additionalGids", &LEAF),
    ("username", &LEAF),
]);
static CAPABILITIES: Shape = Struct(&[
    ("bounding", &STRINGS),
    ("effective", &STRINGS),
    ("inheritable", &STRINGS),
    ("permitted", &STRINGS),
    ("ambient", &STRINGS),
]);
static RLIMITS: Shape = List(&RLIMIT);
static RLIMIT: Shape = Struct(&[("type", &LEAF), ("hard", &LEAF), ("soft", &LEAF)]);
static SCHEDULER: Shape = Struct(&[
    ("policy", &LEAF),
    ("nice", &LEAF),
    ("priority", &LEAF),
    ("flags", &STRINGS),
    ("runtime", &LEAF),
    ("deadline", &LEAF),
    ("period", &LEAF),
]);
static IO_PRIORITY: Shape = Struct(&[("class", &LEAF), ("priority", &LEAF)]);
static EXEC_CPU_AFFINITY: Shape = Struct(&[("initial", &LEAF), ("final", &LEAF)]);
static ROOT: Shape = Struct(&[("path", &LEAF), ("readonly", &LEAF)]);
static MOUNTS: Shape = List(&MOUNT);
static MOUNT: Shape = Struct(&[
    ("destination", &LEAF),
    ("type", &LEAF),
    ("source", &LEAF),
    ("options", &STRINGS),
    ("uidMappings", &ID_MAPPINGS),
    ("gidMappings", &ID_MAPPINGS),
]);
static ID_MAPPINGS: Shape = List(&ID_MAPPING);
static ID_MAPPING: Shape = Struct(&[("containerID", &LEAF), ("hostID", &LEAF), ("size", &LEAF)]);
static HOOKS: Shape = Struct(&[
    ("prestart", &HOOK_LIST),
    ("createRuntime", &HOOK_LIST),
    ("createContainer", &HOOK_LIST),
    ("startContainer", &HOOK_LIST),
    ("poststart", &HOOK_LIST),
    ("poststop", &HOOK_LIST),
]);
static HOOK_LIST: Shape = List(&HOOK);
static HOOK: Shape =
    Struct(&[("path", &LEAF), ("args", &STRINGS), ("env", &STRINGS), ("timeout", &LEAF)]);
static LINUX: Shape = Struct(&[
    ("uidMappings", &ID_MAPPINGS),
    ("gidMappings", &ID_MAPPINGS),
    ("sysctl", &STRING_MAP),
    ("resources", &RESOURCES),
    ("cgroupsPath", &LEAF),
    ("namespaces", &NAMESPACES),
    ("devices", &DEVICES),
    ("seccomp", &SECCOMP),
    ("rootfsPropagation", &LEAF),
    ("maskedPaths", &STRINGS),
    ("readonlyPaths", &STRINGS),
    ("mountLabel", &LEAF),
    ("intelRdt", &INTEL_RDT),
    ("personality", &PERSONALITY),
    ("timeOffsets", &TIME_OFFSETS),
    ("memoryPolicy", &MEMORY_POLICY),
    ("netDevices", &NET_DEVICES),
]);
static NAMESPACES: Shape = List(&NAMESPACE);
static NAMESPACE: Shape = Struct(&[("type", &LEAF), ("path", &LEAF)]);
static DEVICES: Shape = List(&DEVICE);
static DEVICE: Shape = Struct(&[
    ("path", &LEAF),
    ("type", &LEAF),
    ("major", &LEAF),
    ("minor", &LEAF),
    ("fileMode", &LEAF),
    ("uid", &LEAF),
    ("gid", &LEAF),
]);
static RESOURCES: Shape = Struct(&[
    ("devices", &DEVICE_RULES),
    ("memory", &MEMORY),
    ("cpu", &CPU),
    ("pids", &PIDS),
    ("blockIO", &BLOCK_IO),
    ("hugepageLimits", &HUGEPAGE_LIMITS),
    ("network", &NETWORK),
    ("rdma", &RDMA_MAP),
    ("unified", &STRING_MAP),
]);
static DEVICE_RULES: Shape = List(&DEVICE_RULE);
static DEVICE_RULE: Shape = Struct(&[
    ("allow", &LEAF),
    ("type", &LEAF),
    ("major", &LEAF),
    ("minor", &LEAF),
    ("access", &LEAF),
]);
static MEMORY: Shape = Struct(&[
    ("limit", &LEAF),
    ("reservation", &LEAF),
    ("swap", &LEAF),
    ("kernel", &LEAF),
    ("kernelTCP", &LEAF),
    ("swappiness", &LEAF),
    ("disableOOMKiller", &LEAF),
    ("useHierarchy", &LEAF),
    ("checkBeforeUpdate", &LEAF),
]);
static CPU: Shape = Struct(&[
    ("shares", &LEAF),
    ("quota", &LEAF),
    ("burst", &LEAF),
    ("period", &LEAF),
    ("realtimeRuntime", &LEAF),
    ("realtimePeriod", &LEAF),
    ("cpus", &LEAF),
    ("mems", &LEAF),
    ("idle", &LEAF),
]);
static PIDS: Shape = Struct(&[("limit", &LEAF)]);
static BLOCK_IO: Shape = Struct(&[
    ("weight", &LEAF),
    ("leafWeight", &LEAF),
    ("weightDevice", &WEIGHT_DEVICES),
    ("throttleReadBpsDevice", &THROTTLE_DEVICES),
    ("throttleWriteBpsDevice", &THROTTLE_DEVICES),
    ("throttleReadIOPSDevice", &THROTTLE_DEVICES),
    ("throttleWriteIOPSDevice", &THROTTLE_DEVICES),
]);
static WEIGHT_DEVICES: Shape = List(&WEIGHT_DEVICE);
// LinuxBlockIODevice is embedded: its major/minor are promoted.
static WEIGHT_DEVICE: Shape =
    Struct(&[("major", &LEAF), ("minor", &LEAF), ("weight", &LEAF), ("leafWeight", &LEAF)]);
static THROTTLE_DEVICES: Shape = List(&THROTTLE_DEVICE);
static THROTTLE_DEVICE: Shape = Struct(&[("major", &LEAF), ("minor", &LEAF), ("rate", &LEAF)]);
static HUGEPAGE_LIMITS: Shape = List(&HUGEPAGE_LIMIT);
static HUGEPAGE_LIMIT: Shape = Struct(&[("pageSize", &LEAF), ("limit", &LEAF)]);
static NETWORK: Shape = Struct(&[("classID", &LEAF), ("priorities", &PRIORITIES)]);
static PRIORITIES: Shape = List(&PRIORITY);
static PRIORITY: Shape = Struct(&[("name", &LEAF), ("priority", &LEAF)]);
static RDMA_MAP: Shape = MapOf(&RDMA);
static RDMA: Shape = Struct(&[("hcaHandles", &LEAF), ("hcaObjects", &LEAF)]);
static SECCOMP: Shape = Struct(&[
    ("defaultAction", &LEAF),
    ("defaultErrnoRet", &LEAF),
    ("architectures", &STRINGS),
    ("flags", &STRINGS),
    ("listenerPath", &LEAF),
    ("listenerMetadata", &LEAF),
    ("syscalls", &SYSCALLS),
]);
static SYSCALLS: Shape = List(&SYSCALL);
static SYSCALL: Shape =
    Struct(&[("names", &STRINGS), ("action", &LEAF), ("errnoRet", &LEAF), ("args", &SECCOMP_ARGS)]);
static SECCOMP_ARGS: Shape = List(&SECCOMP_ARG);
static SECCOMP_ARG: Shape =
    Struct(&[("index", &LEAF), ("value", &LEAF), ("valueTwo", &LEAF), ("op", &LEAF)]);
static INTEL_RDT: Shape = Struct(&[
    ("closID", &LEAF),
    ("schemata", &LEAF),
    ("l3CacheSchema", &LEAF),
    ("memBwSchema", &LEAF),
    ("enableCMT", &LEAF),
    ("enableMBM", &LEAF),
]);
static PERSONALITY: Shape = Struct(&[("domain", &LEAF), ("flags", &STRINGS)]);
static TIME_OFFSETS: Shape = MapOf(&TIME_OFFSET);
static TIME_OFFSET: Shape = Struct(&[("secs", &LEAF), ("nanosecs", &LEAF)]);
static MEMORY_POLICY: Shape = Struct(&[("mode", &LEAF), ("nodes", &LEAF), ("flags", &STRINGS)]);
static NET_DEVICES: Shape = MapOf(&NET_DEVICE);
static NET_DEVICE: Shape = Struct(&[("name", &LEAF)]);
static SOLARIS: Shape = Struct(&[
    ("milestone", &LEAF),
    ("limitpriv", &LEAF),
    ("maxShmMemory", &LEAF),
    ("anet", &ANETS),
    ("cappedCPU", &CAPPED_CPU),
    ("cappedMemory", &CAPPED_MEMORY),
]);
static ANETS: Shape = List(&ANET);
static ANET: Shape = Struct(&[
    ("linkname", &LEAF),
    ("lowerLink", &LEAF),
    ("allowedAddress", &LEAF),
    ("configureAllowedAddress", &LEAF),
    ("defrouter", &LEAF),
    ("linkProtection", &LEAF),
    ("macAddress", &LEAF),
]);
static CAPPED_CPU: Shape = Struct(&[("ncpus", &LEAF)]);
static CAPPED_MEMORY: Shape = Struct(&[("physical", &LEAF), ("swap", &LEAF)]);
static WINDOWS: Shape = Struct(&[
    ("layerFolders", &STRINGS),
    ("devices", &WINDOWS_DEVICES),
    ("resources", &WINDOWS_RESOURCES),
    ("credentialSpec", &LEAF),
    ("servicing", &LEAF),
    ("ignoreFlushesDuringBoot", &LEAF),
    ("hyperv", &HYPERV),
    ("network", &WINDOWS_NETWORK),
]);
static WINDOWS_DEVICES: Shape = List(&WINDOWS_DEVICE);
static WINDOWS_DEVICE: Shape = Struct(&[("id", &LEAF), ("idType", &LEAF)]);
static WINDOWS_RESOURCES: Shape =
    Struct(&[("memory", &WINDOWS_MEMORY), ("cpu", &WINDOWS_CPU), ("storage", &WINDOWS_STORAGE)]);
static WINDOWS_MEMORY: Shape = Struct(&[("limit", &LEAF)]);
static WINDOWS_CPU: Shape = Struct(&[("count", &LEAF), ("shares", &LEAF), ("maximum", &LEAF)]);
static WINDOWS_STORAGE: Shape = Struct(&[("iops", &LEAF), ("bps", &LEAF), ("sandboxSize", &LEAF)]);
static HYPERV: Shape = Struct(&[("utilityVMPath", &LEAF)]);
static WINDOWS_NETWORK: Shape = Struct(&[
    ("endpointList", &STRINGS),
    ("allowUnqualifiedDNSQuery", &LEAF),
    ("DNSSearchList", &STRINGS),
    ("networkSharedContainerName", &LEAF),
    ("networkNamespace", &LEAF),
]);
static VM: Shape =
    Struct(&[("hypervisor", &VM_PATH), ("kernel", &VM_KERNEL), ("image", &VM_IMAGE)]);
static VM_PATH: Shape = Struct(&[("path", &LEAF), ("parameters", &STRINGS)]);
static VM_KERNEL: Shape = Struct(&[("path", &LEAF), ("parameters", &STRINGS), ("initrd", &LEAF)]);
static VM_IMAGE: Shape = Struct(&[("path", &LEAF), ("format", &LEAF)]);
static ZOS: Shape = Struct(&[("devices", &DEVICES)]);

/// A key as Go's `encoding/json` compares it with a field name: ASCII case folded, and the
/// two non-ASCII runes whose simple-fold orbit holds an ASCII letter mapped onto it.
pub fn go_fold(key: &str) -> String {
    key.chars()
        .map(|c| match c {
            '\u{017F}' => 's', // LATIN SMALL LETTER LONG S
            '\u{212A}' => 'k', // KELVIN SIGN
            c => c.to_ascii_lowercase(),
        })
        .collect()
}

/// Refuses every key that runc would match to a runtime-spec field other than the way an
/// exact reading does: a fold of a field name that is not the field name, and any
/// non-ASCII key at a struct position. Keys in maps (annotations, sysctl, ...) are data
/// and are matched exactly by both.
pub fn check_keys(value: &Value) -> Result<(), CanonicalError> {
    walk(value, &SPEC, "")
}

/// [`check_keys`] for a process document (runc exec's `--process` file): the keys runc
/// would fold or match differently are refused, as in config.json's `process`.
pub fn check_process_keys(value: &Value) -> Result<(), CanonicalError> {
    walk(value, &PROCESS, "")
}

/// [`check_keys`] for a `LinuxResources` document alone (`runc update --resources`).
pub fn check_resources_keys(value: &Value) -> Result<(), CanonicalError> {
    walk(value, &RESOURCES, "")
}

fn walk(value: &Value, shape: &Shape, at: &str) -> Result<(), CanonicalError> {
    match (shape, value) {
        (Struct(fields), Value::Object(map)) => {
            for (key, v) in map {
                if let Some((_, sub)) = fields.iter().find(|(name, _)| *name == key) {
                    walk(v, sub, &child(at, key))?;
                    continue;
                }
                let folded = go_fold(key);
                if let Some((name, _)) =
                    fields.iter().find(|(name, _)| name.to_ascii_lowercase() == folded)
                {
                    return Err(CanonicalError::FoldedKey {
                        at: display_at(at).to_string(),
                        key: Quoted::new(key),
                        field: name,
                    });
                }
                if !key.is_ascii() {
                    return Err(CanonicalError::NonAsciiKey {
                        at: display_at(at).to_string(),
                        key: Quoted::new(key),
                    });
                }
            }
            Ok(())
        }
        (List(item), Value::Array(items)) => {
            for (i, v) in items.iter().enumerate() {
                walk(v, item, &format!("{at}[{i}]"))?;
            }
            Ok(())
        }
        (MapOf(item), Value::Object(map)) => {
            for (key, v) in map {
                walk(v, item, &format!("{at}[{}]", Quoted::new(key)))?;
            }
            Ok(())
        }
        // A scalar where runc wants a struct is runc's error to report; a struct where a
        // leaf is, is data (`interface{}`) or runc's error. Neither is ambiguous.
        _ => Ok(()),
    }
}

// ---------------------------------------------------------------------------------------
// Device rules and device nodes with runc's meaning
// ---------------------------------------------------------------------------------------

/// What a device cgroup rule applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum RuleKind {
    /// `a`: every device. runc reads an absent or empty type so.
    All,
    Char,
    Block,
}

impl RuleKind {
    fn letter(self) -> char {
        match self {
            RuleKind::All => 'a',
            RuleKind::Char => 'c',
            RuleKind::Block => 'b',
        }
    }
}

/// Access bits of a rule (`r`, `w`, `m`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Access(u8);

impl Access {
    pub const READ: Access = Access(1);
    pub const WRITE: Access = Access(2);
    pub const MKNOD: Access = Access(4);
    pub const ALL: Access = Access(7);
    pub const NONE: Access = Access(0);

    /// Parses runc's access string; an empty one is refused as runc refuses it.
    pub fn parse(s: &str, at: &str) -> Result<Access, CanonicalError> {
        if s.is_empty() {
            return Err(value_err(at, "empty access: runc refuses a rule without access"));
        }
        let mut a = 0;
        for c in s.chars() {
            a |= match c {
                'r' => 1,
                'w' => 2,
                'm' => 4,
                _ => {
                    return Err(value_err(
                        at,
                        format!(
                            "access {} has {}: only r, w and m exist",
                            Quoted::new(s),
                            Quoted::new(&c.to_string())
                        ),
                    ))
                }
            };
        }
        Ok(Access(a))
    }
    pub fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
    /// Read or write: the accesses that open a device (mknod only makes a node).
    pub fn opens(self) -> bool {
        self.0 & 3 != 0
    }
    pub fn union(self, o: Access) -> Access {
        Access(self.0 | o.0)
    }
    pub fn minus(self, o: Access) -> Access {
        Access(self.0 & !o.0)
    }
    pub fn intersect(self, o: Access) -> Access {
        Access(self.0 & o.0)
    }
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (bit, c) in [(1, 'r'), (2, 'w'), (4, 'm')] {
            if self.0 & bit != 0 {
                write!(f, "{c}")?;
            }
        }
        Ok(())
    }
}

/// One `linux.resources.devices` entry as runc applies it. `None` numbers are `*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceRule {
    pub allow: bool,
    pub kind: RuleKind,
    pub major: Option<u32>,
    pub minor: Option<u32>,
    pub access: Access,
}

impl fmt::Display for DeviceRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = |v: Option<u32>| v.map_or("*".to_string(), |v| v.to_string());
        write!(
            f,
            "{} {} {}:{} {}",
            if self.allow { "allow" } else { "deny" },
            self.kind.letter(),
            n(self.major),
            n(self.minor),
            self.access
        )
    }
}

fn field<'a>(obj: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

fn as_object<'a>(v: &'a Value, at: &str) -> Result<&'a Map<String, Value>, CanonicalError> {
    v.as_object().ok_or_else(|| value_err(at, "expected an object"))
}

fn opt_str<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
    at: &str,
) -> Result<Option<&'a str>, CanonicalError> {
    match field(obj, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(value_err(&child(at, key), "expected a string")),
    }
}

/// A rule number: absent, null or -1 is the wildcard; otherwise within the kernel's range.
fn rule_number(
    obj: &Map<String, Value>,
    key: &str,
    max: i64,
    at: &str,
) -> Result<Option<u32>, CanonicalError> {
    let at = child(at, key);
    let Some(v) = field(obj, key) else { return Ok(None) };
    let n = v.as_i64().ok_or_else(|| value_err(&at, format!("{v} is not a 64-bit integer")))?;
    match n {
        -1 => Ok(None),
        n if (0..=max).contains(&n) => Ok(Some(n as u32)),
        n => Err(value_err(
            &at,
            format!("{n} is outside the kernel's range (0..={max}, or -1 for any): it would be truncated or refused"),
        )),
    }
}

impl DeviceRule {
    /// Reads `linux.resources.devices[i]` with runc's meaning.
    pub fn from_value(v: &Value, at: &str) -> Result<DeviceRule, CanonicalError> {
        let obj = as_object(v, at)?;
        let allow = match field(obj, "allow") {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(value_err(&child(at, "allow"), "expected true or false")),
        };
        let kind = match opt_str(obj, "type", at)? {
            None | Some("") | Some("a") => RuleKind::All,
            Some("c") => RuleKind::Char,
            Some("b") => RuleKind::Block,
            Some(t) => {
                return Err(value_err(
                    &child(at, "type"),
                    format!("type {} is not a, b or c: runc refuses it", Quoted::new(t)),
                ))
            }
        };
        let access =
            Access::parse(opt_str(obj, "access", at)?.unwrap_or(""), &child(at, "access"))?;
        Ok(DeviceRule {
            allow,
            kind,
            major: rule_number(obj, "major", MAX_MAJOR, at)?,
            minor: rule_number(obj, "minor", MAX_MINOR, at)?,
            access,
        })
    }

    /// The rule in canonical form: explicit type and access, wildcards omitted.
    pub fn to_value(&self) -> Value {
        let mut m = Map::new();
        m.insert("allow".into(), Value::Bool(self.allow));
        m.insert("type".into(), Value::String(self.kind.letter().to_string()));
        if let Some(n) = self.major {
            m.insert("major".into(), Value::from(n));
        }
        if let Some(n) = self.minor {
            m.insert("minor".into(), Value::from(n));
        }
        m.insert("access".into(), Value::String(self.access.to_string()));
        Value::Object(m)
    }

    /// Whether this allow rule lets a character device of `major` be opened (read or
    /// written), whatever its minor: `a` rules (allow-all), and `c` rules with that major
    /// or a wildcard major.
    pub fn opens_char_major(&self, major: u32) -> bool {
        self.allow
            && self.access.opens()
            && match self.kind {
                RuleKind::All => true,
                RuleKind::Char => self.major.is_none_or(|m| m == major),
                RuleKind::Block => false,
            }
    }
}

/// What a `linux.devices` entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeKind {
    /// `c` or `u` (unbuffered character).
    Char,
    Block,
    Fifo,
}

/// One `linux.devices` entry as runc creates it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceNode {
    /// As written (runc resolves it inside the rootfs).
    pub path: String,
    pub kind: NodeKind,
    pub major: u32,
    pub minor: u32,
}

impl DeviceNode {
    /// Reads `linux.devices[i]`; numbers outside the kernel's range are refused (runc
    /// would truncate them in `mknod`: major 4291 makes a node of major 195).
    pub fn from_value(v: &Value, at: &str) -> Result<DeviceNode, CanonicalError> {
        let obj = as_object(v, at)?;
        let path = opt_str(obj, "path", at)?.unwrap_or("");
        if path.is_empty() || path.contains('\0') {
            return Err(value_err(&child(at, "path"), "a device needs a path without NUL"));
        }
        let kind = match opt_str(obj, "type", at)? {
            Some("c") | Some("u") => NodeKind::Char,
            Some("b") => NodeKind::Block,
            Some("p") => NodeKind::Fifo,
            t => {
                return Err(value_err(
                    &child(at, "type"),
                    format!(
                        "type {} is not c, u, b or p: runc refuses it",
                        Quoted::new(t.unwrap_or(""))
                    ),
                ))
            }
        };
        let number = |key: &str, max: i64| -> Result<u32, CanonicalError> {
            let at = child(at, key);
            let n = match field(obj, key) {
                None => 0, // Go's zero value
                Some(v) => v
                    .as_i64()
                    .ok_or_else(|| value_err(&at, format!("{v} is not a 64-bit integer")))?,
            };
            if (0..=max).contains(&n) {
                Ok(n as u32)
            } else {
                Err(value_err(
                    &at,
                    format!(
                        "{n} is outside the kernel's range (0..={max}): mknod would truncate it"
                    ),
                ))
            }
        };
        Ok(DeviceNode {
            path: path.to_string(),
            kind,
            major: number("major", MAX_MAJOR)?,
            minor: number("minor", MAX_MINOR)?,
        })
    }
}

/// Reads every entry of an optional array with `read`; absent or null is empty.
pub fn read_list<T>(
    v: Option<&Value>,
    at: &str,
    read: impl Fn(&Value, &str) -> Result<T, CanonicalError>,
) -> Result<Vec<T>, CanonicalError> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => {
            items.iter().enumerate().map(|(i, item)| read(item, &format!("{at}[{i}]"))).collect()
        }
        Some(_) => Err(value_err(at, "expected an array")),
    }
}

/// The rules runc 1.1 appends after the config's own (`specconv.AllowedDevices`): mknod of
/// anything, and the standard character devices.
pub const RUNC_DEFAULT_RULES: &[DeviceRule] = &{
    const fn allow(
        kind: RuleKind,
        major: Option<u32>,
        minor: Option<u32>,
        access: Access,
    ) -> DeviceRule {
        DeviceRule { allow: true, kind, major, minor, access }
    }
    use RuleKind::{Block, Char};
    [
        allow(Char, None, None, Access::MKNOD),
        allow(Block, None, None, Access::MKNOD),
        allow(Char, Some(1), Some(3), Access::ALL),
        allow(Char, Some(1), Some(8), Access::ALL),
        allow(Char, Some(1), Some(7), Access::ALL),
        allow(Char, Some(5), Some(0), Access::ALL),
        allow(Char, Some(1), Some(5), Access::ALL),
        allow(Char, Some(1), Some(9), Access::ALL),
        allow(Char, Some(136), None, Access::ALL),
        allow(Char, Some(5), Some(2), Access::ALL),
        allow(Char, Some(10), Some(200), Access::ALL),
    ]
};

/// GPU entries that open a device: (major, minor) → read/write bits; `None` is `*`.
pub type GpuOpenings = BTreeMap<(Option<u32>, Option<u32>), Access>;

/// What a container's device cgroup lets through, as cgroup v1 holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceAccess {
    /// `a *:* rwm`: every device.
    AllowAll,
    /// Only these entries: (kind, major, minor) → access; `None` is `*`.
    Only(BTreeMap<(RuleKind, Option<u32>, Option<u32>), Access>),
}

impl DeviceAccess {
    /// Applies rules in order as runc's cgroup v1 emulator does (allow-all and deny-all
    /// reset; an allow adds to an exact entry; a deny subtracts from the exact entry and
    /// may not punch a hole in a wildcard entry, which runc refuses).
    pub fn emulate<'a>(
        rules: impl IntoIterator<Item = &'a DeviceRule>,
    ) -> Result<DeviceAccess, String> {
        let mut allow_all = false;
        let mut entries: BTreeMap<(RuleKind, Option<u32>, Option<u32>), Access> = BTreeMap::new();
        for r in rules {
            if r.kind == RuleKind::All {
                allow_all = r.allow;
                entries.clear();
                continue;
            }
            let key = (r.kind, r.major, r.minor);
            // In allow-all mode the entries are exceptions denied; otherwise allowed.
            let adds = r.allow != allow_all;
            if adds {
                let e = entries.entry(key).or_default();
                *e = e.union(r.access);
            } else {
                for partial in
                    [(r.kind, None, r.minor), (r.kind, r.major, None), (r.kind, None, None)]
                {
                    if partial != key
                        && entries.get(&partial).is_some_and(|p| !p.intersect(r.access).is_empty())
                    {
                        return Err(format!(
                            "rule {r} would punch a hole in a wildcard rule, which runc refuses"
                        ));
                    }
                }
                if let Some(e) = entries.get_mut(&key) {
                    *e = e.minus(r.access);
                    if e.is_empty() {
                        entries.remove(&key);
                    }
                }
            }
        }
        Ok(if allow_all { DeviceAccess::AllowAll } else { DeviceAccess::Only(entries) })
    }

    /// The entries that open (read or write) a character device of one of `majors`, with
    /// their open bits: what the container can do with GPUs.
    pub fn gpu_openings(&self, majors: &std::collections::BTreeSet<u32>) -> Option<GpuOpenings> {
        match self {
            DeviceAccess::AllowAll => None,
            DeviceAccess::Only(entries) => Some(
                entries
                    .iter()
                    .filter(|((kind, major, _), access)| {
                        *kind == RuleKind::Char
                            && access.opens()
                            && major.is_none_or(|m| majors.contains(&m))
                    })
                    .map(|((_, major, minor), access)| {
                        ((*major, *minor), access.intersect(Access::READ.union(Access::WRITE)))
                    })
                    .collect(),
            ),
        }
    }

    /// Parses a cgroup v1 `devices.list` into the same form.
    pub fn from_devices_list(text: &str) -> Result<DeviceAccess, String> {
        let mut entries = BTreeMap::new();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let bad = || format!("unreadable devices.list line {line:?}");
            let mut parts = line.split_whitespace();
            let (kind, nums, access) = (
                parts.next().ok_or_else(bad)?,
                parts.next().ok_or_else(bad)?,
                parts.next().ok_or_else(bad)?,
            );
            let (ma, mi) = nums.split_once(':').ok_or_else(bad)?;
            let num = |s: &str| -> Result<Option<u32>, String> {
                if s == "*" {
                    Ok(None)
                } else {
                    s.parse().map(Some).map_err(|_| bad())
                }
            };
            let access = Access::parse(access, "devices.list").map_err(|e| e.to_string())?;
            let kind = match kind {
                "a" => {
                    if num(ma)?.is_none() && num(mi)?.is_none() && access == Access::ALL {
                        return Ok(DeviceAccess::AllowAll);
                    }
                    return Err(bad());
                }
                "c" => RuleKind::Char,
                "b" => RuleKind::Block,
                _ => return Err(bad()),
            };
            entries.insert((kind, num(ma)?, num(mi)?), access);
        }
        Ok(DeviceAccess::Only(entries))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rule(v: Value) -> Result<DeviceRule, CanonicalError> {
        DeviceRule::from_value(&v, "linux.resources.devices[0]")
    }

    #[test]
    fn duplicate_keys_are_refused_with_their_path() {
        let e =
            parse(br#"{"linux": {"resources": {"devices": [{"allow": false, "allow": true}]}}}"#)
                .expect_err("duplicate");
        assert_eq!(
            e,
            CanonicalError::DuplicateKey {
                at: "linux.resources.devices[0]".into(),
                key: Quoted::new("allow")
            }
        );
        let e = parse(br#"{"hooks": {}, "linux": {}, "hooks": {}}"#).expect_err("duplicate");
        assert!(e.to_string().starts_with("duplicate key `hooks` at `.`"), "{e}");
        // Annotations are a map: duplicates there are refused too (runc keeps the last).
        let e = parse(
            br#"{"annotations": {"tessera.io/gpu": "mig=1g.10gb", "tessera.io/gpu": "gpu=8"}}"#,
        )
        .expect_err("duplicate");
        assert!(e.to_string().contains("at `annotations`"), "{e}");
        assert!(
            parse(br#"{"a": {"x": 1}, "b": {"x": 1}}"#).is_ok(),
            "same key in two objects is fine"
        );
    }

    #[test]
    fn trailing_data_and_bad_json_are_refused() {
        assert!(matches!(parse(b"{} garbage"), Err(CanonicalError::Syntax(_))));
        let e = parse(b"{\"a\":\n }").expect_err("syntax");
        assert!(e.to_string().contains("line 2"), "{e}");
    }

    #[test]
    fn folded_keys_are_refused_wherever_runc_matches_fields() {
        let cases = [
            (json!({"Linux": {}}), ".", "linux"),
            (json!({"LINUX": {}}), ".", "linux"),
            (json!({"linux": {"reſources": {}}}), "linux", "resources"),
            (
                json!({"linux": {"resources": {"devices": [{"\u{212A}ind": 1, "Major": 1}]}}}),
                "linux.resources.devices[0]",
                "major",
            ),
            (json!({"hooks": {"preſtart": []}}), "hooks", "prestart"),
            (json!({"HOOKS": {}}), ".", "hooks"),
            (json!({"root": {"PATH": "/"}}), "root", "path"),
            (json!({"Root": {"path": "/"}}), ".", "root"),
            (json!({"mounts": [{"Destination": "/x"}]}), "mounts[0]", "destination"),
            (json!({"process": {"Env": []}}), "process", "env"),
            (json!({"annotationſ": {}}), ".", "annotations"),
        ];
        for (doc, at, field) in cases {
            match check_keys(&doc) {
                Err(CanonicalError::FoldedKey { at: a, field: f, .. }) => {
                    assert_eq!((a.as_str(), f), (at, field), "{doc}")
                }
                other => panic!("{doc}: {other:?}"),
            }
        }
    }

    #[test]
    fn exact_unknown_and_map_keys_pass() {
        let doc = json!({
            "ociVersion": "1.0.2", "vendorExtension": {"Linux": 1},
            "annotations": {"Linux": "x", "ſ": "y"},
            "linux": {"sysctl": {"NET.x": "1"}, "resources": {"unified": {"Memory.max": "1"}}},
            "process": {"env": ["Linux=1"]}
        });
        check_keys(&doc).expect("no ambiguity");
        let e = check_keys(&json!({"lınux": {}})).expect_err("non-ascii at a struct position");
        assert!(matches!(e, CanonicalError::NonAsciiKey { .. }), "{e:?}");
    }

    #[test]
    fn rules_read_as_runc_reads_them() {
        let r =
            rule(json!({"allow": true, "type": "c", "major": -1, "minor": -1, "access": "rwm"}))
                .expect("ok");
        assert_eq!((r.major, r.minor, r.kind), (None, None, RuleKind::Char));
        assert!(r.opens_char_major(195));
        // `a` with a major is still allow-all; so is an untyped rule.
        for v in [
            json!({"allow": true, "type": "a", "major": 195, "minor": 0, "access": "r"}),
            json!({"allow": true, "major": 195, "access": "rw"}),
            json!({"allow": true, "type": "", "access": "m"}),
        ] {
            let r = rule(v).expect("ok");
            assert_eq!(r.kind, RuleKind::All);
            assert_eq!(DeviceAccess::emulate([&r]).expect("emulates"), DeviceAccess::AllowAll);
        }
        for (v, what) in [
            (
                json!({"allow": true, "type": "c", "major": 4_294_967_491_i64, "access": "rw"}),
                "outside the kernel's range",
            ),
            (json!({"allow": true, "type": "c", "major": 4291, "access": "rw"}), "outside"),
            (json!({"allow": true, "type": "c", "major": -2, "access": "rw"}), "outside"),
            (json!({"allow": true, "type": "c", "minor": 1_048_576, "access": "rw"}), "outside"),
            (
                json!({"allow": true, "type": "c", "major": 1.5, "access": "rw"}),
                "not a 64-bit integer",
            ),
            (json!({"allow": true, "type": "u", "major": 195, "access": "rw"}), "not a, b or c"),
            (json!({"allow": true, "type": "c", "major": 195}), "empty access"),
            (json!({"allow": true, "type": "c", "major": 195, "access": "rwx"}), "only r, w and m"),
            (json!({"allow": "yes", "type": "c", "access": "m"}), "true or false"),
        ] {
            let e = rule(v.clone()).expect_err("refused");
            assert!(e.to_string().contains(what), "{v}: {e}");
        }
    }

    #[test]
    fn device_nodes_are_range_checked() {
        let n = DeviceNode::from_value(
            &json!({"path": "/dev/x", "type": "u", "major": 195, "minor": 3}),
            "d",
        )
        .expect("ok");
        assert_eq!((n.kind, n.major, n.minor), (NodeKind::Char, 195, 3));
        for v in [
            json!({"path": "/dev/x", "type": "c", "major": 4291, "minor": 0}),
            json!({"path": "/dev/x", "type": "c", "major": -1, "minor": 0}),
            json!({"path": "/dev/x", "type": "c", "major": 195, "minor": 1_048_576}),
            json!({"path": "/dev/x", "type": "z", "major": 1, "minor": 1}),
            json!({"path": "", "type": "c", "major": 1, "minor": 1}),
        ] {
            assert!(DeviceNode::from_value(&v, "d").is_err(), "{v}");
        }
    }

    #[test]
    fn emulator_follows_runc_v1() {
        let rules: Vec<DeviceRule> = [
            json!({"allow": false, "access": "rwm"}),
            json!({"allow": true, "type": "c", "major": 195, "minor": 3, "access": "rw"}),
            // A deny with a wildcard minor removes nothing (exact match only), as runc does.
            json!({"allow": false, "type": "c", "major": 195, "minor": -1, "access": "rw"}),
        ]
        .into_iter()
        .map(|v| rule(v).expect("rule"))
        .collect();
        let acc = DeviceAccess::emulate(&rules).expect("emulates");
        let gpus = acc.gpu_openings(&[195].into()).expect("not allow-all");
        assert_eq!(gpus, BTreeMap::from([((Some(195), Some(3)), Access(3))]));
        let list = "c 195:3 rw\nc *:* m\nb *:* m\n";
        assert_eq!(
            DeviceAccess::from_devices_list(list).expect("parses").gpu_openings(&[195].into()),
            Some(gpus)
        );
        // Punching a hole in a wildcard is refused by runc, so by the emulator too.
        let punch = [
            rule(json!({"allow": true, "type": "c", "major": 195, "access": "rw"})).expect("r"),
            rule(json!({"allow": false, "type": "c", "major": 195, "minor": 1, "access": "r"}))
                .expect("r"),
        ];
        assert!(DeviceAccess::emulate(&punch).is_err());
    }

    #[test]
    fn quoted_escapes_and_bounds() {
        assert_eq!(Quoted::new("a\nb\u{1b}").to_string(), "`a\\nb\\u{1b}`");
        let long = "x".repeat(100_000);
        let q = Quoted::new(&long).to_string();
        assert!(q.chars().count() < 120 && q.ends_with("[100000 bytes in all]`"), "{q}");
    }
}
