//! `runc update` read the way runc 1.1 reads it, for a GPU container: what was admitted
//! cannot grow by itself (docs/QUOTAS.md, "Updates").
//!
//! runc 1.1.5's `update` (its `update.go`, over urfave/cli v1.22 and Go's `flag`):
//! - its arguments are reordered (every argument starting with `-`, and the argument after
//!   one without `=` unless that starts with `-`, go first; everything from `--` on stays
//!   last), then parsed by Go's `flag` with the update's flag set: `-x` and `--x` alike, a
//!   value `=`-joined or the next argument (even one starting with `-`), the last of a
//!   flag given twice wins, an unknown flag or a bad boolean or integer is an error, and
//!   both forms of one flag (`-r` and `--resources`, `-h` and `--help`) are an error;
//! - `--help` shows the help and changes nothing; exactly one container id is needed;
//! - `--resources FILE` (or `-` for the standard input) is JSON `LinuxResources` decoded
//!   over zero values, and then every other flag is ignored; otherwise `--cpu-quota`
//!   (`strconv.ParseInt`), `--cpu-period` (`ParseUint`) and `--memory` (`-1`, or go-units'
//!   `RAMInBytes`: `4g`, `1.5GiB`, ...) are read; a value left out is 0 ("unchanged");
//! - device rules in an update are not applied by runc 1.1 at all (it sets
//!   `SkipDevices`), and `unified` (cgroup v2 files written as given) is refused by runc
//!   on cgroup v1.
//!
//! For a GPU container the wrapper refuses what it cannot read exactly as runc does (the
//! canonical JSON reading of [`crate::canonical`]: duplicate keys, keys runc folds onto a
//! field, `null` where runc would dereference it), any device rule that allows something
//! (Tessera's rules stay as granted, whatever a later runc might do with them), and any
//! `unified` entry (it could set `cpu.max` or `memory.max` past what was admitted). Deny
//! rules pass: containerd's CRI sends its spec's rules (a deny-all) with every update.

use std::ffi::{OsStr, OsString};

use serde_json::Value;
use tessera_api::{untrusted, RecordedLimits, UpdateRequest};

use crate::canonical::{self, DeviceRule};

/// The most `--resources` JSON read.
pub const MAX_RESOURCES_BYTES: usize = 1 << 20;

/// Why an update of a GPU container is refused before runc runs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UpdateError {
    /// Its arguments, as runc would refuse them (or as the wrapper cannot read them).
    #[error("runc update: {0}")]
    Args(String),
    /// The `--resources` JSON.
    #[error("runc update --resources: {0}")]
    Resources(String),
    /// A flag value runc would refuse.
    #[error("runc update: invalid value {value} for --{flag}: {why}")]
    Value { flag: &'static str, value: String, why: String },
}

/// The update's flags (runc 1.1.5) and their kinds.
const FLAGS: &[(&str, Kind)] = &[
    ("resources", Kind::Str),
    ("r", Kind::Str),
    ("blkio-weight", Kind::Int),
    ("cpu-period", Kind::Str),
    ("cpu-quota", Kind::Str),
    ("cpu-share", Kind::Str),
    ("cpu-rt-period", Kind::Str),
    ("cpu-rt-runtime", Kind::Str),
    ("cpuset-cpus", Kind::Str),
    ("cpuset-mems", Kind::Str),
    ("kernel-memory", Kind::Str),
    ("kernel-memory-tcp", Kind::Str),
    ("memory", Kind::Str),
    ("memory-reservation", Kind::Str),
    ("memory-swap", Kind::Str),
    ("pids-limit", Kind::Int),
    ("l3-cache-schema", Kind::Str),
    ("mem-bw-schema", Kind::Str),
    ("help", Kind::Bool),
    ("h", Kind::Bool),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Bool,
    Int,
    Str,
}

/// A `runc update` command line, read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpdateArgs {
    /// Every positional argument (runc needs exactly one: the container id).
    pub positional: Vec<String>,
    /// The last value of each flag given (`r` under `resources`).
    pub values: std::collections::BTreeMap<&'static str, String>,
    /// `--help` (or `-h`) is set: runc shows its help and changes nothing.
    pub help: bool,
}

impl UpdateArgs {
    /// The container id, if exactly one was given.
    pub fn container_id(&self) -> Option<&str> {
        match self.positional.as_slice() {
            [id] => Some(id),
            _ => None,
        }
    }

    /// `--resources`, when given and not empty (runc reads the flags otherwise).
    pub fn resources(&self) -> Option<&str> {
        self.values.get("resources").map(String::as_str).filter(|v| !v.is_empty())
    }
}

/// urfave/cli v1.22's `reorderArgs`.
fn reorder(args: &[String]) -> Vec<String> {
    let (mut flags, mut rest) = (Vec::new(), Vec::new());
    let mut read_value = false;
    for (i, arg) in args.iter().enumerate() {
        if arg == "--" {
            rest.extend(args[i..].iter().cloned());
            break;
        }
        if read_value && !arg.starts_with('-') {
            read_value = false;
            flags.push(arg.clone());
            continue;
        }
        read_value = false;
        if arg != "-" && arg.starts_with('-') {
            flags.push(arg.clone());
            read_value = !arg.contains('=');
        } else {
            rest.push(arg.clone());
        }
    }
    flags.extend(rest);
    flags
}

/// Go's `strconv.ParseBool`.
fn go_bool(v: &str) -> Option<bool> {
    match v {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Some(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Some(false),
        _ => None,
    }
}

/// Reads `runc update`'s arguments (those after the verb) as runc 1.1.5 does. Arguments
/// that are not UTF-8 are refused.
pub fn parse_args(args: &[OsString]) -> Result<UpdateArgs, UpdateError> {
    let args: Vec<String> = args
        .iter()
        .map(|a| {
            a.to_str().map(str::to_string).ok_or_else(|| {
                UpdateError::Args(format!(
                    "argument {} is not UTF-8",
                    untrusted(&a.to_string_lossy())
                ))
            })
        })
        .collect::<Result<_, _>>()?;
    let args = reorder(&args);
    let mut values = std::collections::BTreeMap::new();
    let mut visited = std::collections::BTreeSet::new();
    let mut bools = std::collections::BTreeMap::new();
    let mut i = 0;
    let mut positional = Vec::new();
    while i < args.len() {
        let s = &args[i];
        if s.len() < 2 || !s.starts_with('-') {
            positional.extend(args[i..].iter().cloned());
            break;
        }
        let dashes = if s.as_bytes()[1] == b'-' { 2 } else { 1 };
        if dashes == 2 && s.len() == 2 {
            positional.extend(args[i + 1..].iter().cloned());
            break;
        }
        let name = &s[dashes..];
        if name.is_empty() || name.starts_with('-') || name.starts_with('=') {
            return Err(UpdateError::Args(format!("bad flag syntax: {}", untrusted(s))));
        }
        i += 1;
        // Go looks for `=` from the name's second byte on.
        let (name, inline) = match name.bytes().skip(1).position(|b| b == b'=') {
            Some(j) => (&name[..j + 1], Some(name[j + 2..].to_string())),
            None => (name, None),
        };
        let Some(&(flag, kind)) = FLAGS.iter().find(|(n, _)| *n == name) else {
            return Err(UpdateError::Args(format!(
                "flag provided but not defined: -{}",
                untrusted(name).max_chars(64)
            )));
        };
        visited.insert(flag);
        match kind {
            Kind::Bool => {
                let v = match &inline {
                    None => true,
                    Some(v) => go_bool(v).ok_or_else(|| {
                        UpdateError::Args(format!(
                            "invalid boolean value {} for -{flag}",
                            untrusted(v).max_chars(64)
                        ))
                    })?,
                };
                bools.insert(flag, v);
            }
            // An int flag runc cannot read fails runc before it changes anything; its
            // value (blkio weight, pids) is nothing the quotas count: not checked here.
            Kind::Int | Kind::Str => {
                let v = match inline {
                    Some(v) => v,
                    None => {
                        let v = args.get(i).cloned().ok_or_else(|| {
                            UpdateError::Args(format!("flag needs an argument: -{flag}"))
                        })?;
                        i += 1;
                        v
                    }
                };
                let key = if flag == "r" { "resources" } else { flag };
                values.insert(key, v);
            }
        }
    }
    for (a, b) in [("resources", "r"), ("help", "h")] {
        if visited.contains(a) && visited.contains(b) {
            return Err(UpdateError::Args(format!(
                "Cannot use two forms of the same flag: {b} {a}"
            )));
        }
    }
    let help = bools.values().any(|v| *v);
    Ok(UpdateArgs { positional, values, help })
}

/// go-units v0.4's `RAMInBytes` (binary units): `^(\d+(\.\d+)*) ?([kKmMgGtTpP])?[iI]?[bB]?$`,
/// the number read as a float (more than one `.` is an error), times the unit, converted
/// to int64 as Go on amd64 does (out of range: the smallest int64).
pub fn ram_in_bytes(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() && b[i].is_ascii_digit() {
        i += 1;
    }
    if i == 0 {
        return None;
    }
    // (\.\d+)*
    loop {
        if i < b.len() && b[i] == b'.' && b.get(i + 1).is_some_and(u8::is_ascii_digit) {
            i += 1;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
        } else {
            break;
        }
    }
    let number = &s[..i];
    let mut rest = &s[i..];
    if let Some(r) = rest.strip_prefix(' ') {
        rest = r;
    }
    let mut unit = None;
    if let Some(c) = rest.chars().next().filter(|c| "kKmMgGtTpP".contains(*c)) {
        unit = Some(c.to_ascii_lowercase());
        rest = &rest[1..];
    }
    if let Some(r) = rest.strip_prefix(['i', 'I']) {
        rest = r;
    }
    if let Some(r) = rest.strip_prefix(['b', 'B']) {
        rest = r;
    }
    if !rest.is_empty() {
        return None;
    }
    if number.matches('.').count() > 1 {
        return None; // strconv.ParseFloat refuses it
    }
    let size: f64 = number.parse().ok()?;
    if !size.is_finite() {
        return None; // ParseFloat: ErrRange
    }
    let mul: f64 = match unit {
        None => 1.0,
        Some('k') => 1024.0,
        Some('m') => 1024.0 * 1024.0,
        Some('g') => 1024.0 * 1024.0 * 1024.0,
        Some('t') => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        Some(_) => 1024.0 * 1024.0 * 1024.0 * 1024.0 * 1024.0,
    };
    let bytes = size * mul;
    // 2^63, exactly representable.
    let limit = 2f64.powi(63);
    if (-limit..limit).contains(&bytes) {
        Some(bytes as i64)
    } else {
        Some(i64::MIN)
    }
}

/// What runc 1.1 reads from the update's flags (no `--resources`): CPU quota and period
/// and the memory limit, 0 where not given.
pub fn flag_values(args: &UpdateArgs) -> Result<UpdateRequest, UpdateError> {
    let get = |k: &str| args.values.get(k).filter(|v| !v.is_empty());
    // Real-time CPU is outside CFS bandwidth: a GPU container never gets any (as at create).
    for flag in ["cpu-rt-period", "cpu-rt-runtime"] {
        if let Some(v) = get(flag).filter(|v| !v.trim_start_matches(['+', '0']).is_empty()) {
            return Err(UpdateError::Value {
                flag,
                value: format!("`{}`", untrusted(v).max_chars(64)),
                why: "real-time CPU time is not bounded by the CPU quota a GPU container was \
                      admitted with; GPU containers get none"
                    .into(),
            });
        }
    }
    let mut out = UpdateRequest::default();
    if let Some(v) = get("cpu-period") {
        out.cpu_period = go_uint10(v).ok_or_else(|| value_err("cpu-period", v))?;
    }
    if let Some(v) = get("cpu-quota") {
        out.cpu_quota = go_int10(v).ok_or_else(|| value_err("cpu-quota", v))?;
    }
    if let Some(v) = get("memory") {
        out.memory_limit =
            if v == "-1" { -1 } else { ram_in_bytes(v).ok_or_else(|| value_err("memory", v))? };
    }
    out.cpuset_cpus = get("cpuset-cpus").cloned();
    out.cpuset_mems = get("cpuset-mems").cloned();
    Ok(out)
}

fn value_err(flag: &'static str, v: &str) -> UpdateError {
    UpdateError::Value {
        flag,
        value: format!("`{}`", untrusted(v).max_chars(64)),
        why: "runc would refuse it".into(),
    }
}

/// Go's `strconv.ParseUint(s, 10, 64)`.
fn go_uint10(s: &str) -> Option<u64> {
    (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())).then(|| s.parse().ok()).flatten()
}

/// Go's `strconv.ParseInt(s, 10, 64)`.
fn go_int10(s: &str) -> Option<i64> {
    let digits = s.strip_prefix(['+', '-']).unwrap_or(s);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.strip_prefix('+').unwrap_or(s).parse().ok()
}

/// What runc 1.1 reads from `--resources` JSON for a GPU container: CPU quota and period
/// and the memory limit, 0 where absent. Refused: JSON runc and an exact reading could
/// read differently ([`canonical::parse`], [`canonical::check_resources_keys`]); `null`
/// for `memory`, `cpu` or the values read (runc dereferences them); values runc would not
/// decode; an allow rule in `devices`; any `unified` entry.
pub fn resources_values(bytes: &[u8]) -> Result<UpdateRequest, UpdateError> {
    let bad = |m: String| UpdateError::Resources(m);
    let v = canonical::parse(bytes).map_err(|e| bad(e.to_string()))?;
    canonical::check_resources_keys(&v).map_err(|e| bad(e.to_string()))?;
    let Some(obj) = v.as_object() else {
        return Err(bad("expected a JSON object (LinuxResources)".into()));
    };
    if let Some(devices) = obj.get("devices").filter(|d| !d.is_null()) {
        let rules = canonical::read_list(Some(devices), "devices", DeviceRule::from_value)
            .map_err(|e| bad(e.to_string()))?;
        if let Some(r) = rules.iter().find(|r| r.allow) {
            return Err(bad(format!(
                "device rule `{r}` allows a device: an update never changes a GPU container's device \
                 rules (runc 1.1 ignores them; Tessera refuses any that allows)"
            )));
        }
    }
    if let Some(u) = obj.get("unified").and_then(Value::as_object).filter(|u| !u.is_empty()) {
        let keys: Vec<String> =
            u.keys().take(4).map(|k| format!("`{}`", untrusted(k).max_chars(40))).collect();
        return Err(bad(format!(
            "unified cgroup v2 settings ({}) in an update of a GPU container are refused: they can set \
             cpu.max or memory.max past what was admitted; use cpu and memory",
            keys.join(", ")
        )));
    }
    let section = |key: &str| -> Result<Option<&serde_json::Map<String, Value>>, UpdateError> {
        match obj.get(key) {
            None => Ok(None),
            Some(Value::Object(m)) => Ok(Some(m)),
            Some(Value::Null) => Err(bad(format!("`{key}` is null: runc 1.1 would crash on it"))),
            Some(_) => Err(bad(format!("`{key}` is not an object"))),
        }
    };
    let int = |m: Option<&serde_json::Map<String, Value>>, at: &str, key: &str, unsigned: bool| {
        let Some(v) = m.and_then(|m| m.get(key)) else { return Ok(None) };
        let n = match v {
            Value::Null => {
                return Err(bad(format!("`{at}.{key}` is null: runc 1.1 would crash on it")))
            }
            Value::Number(n) if unsigned => n.as_u64().map(i128::from),
            Value::Number(n) => n.as_i64().map(i128::from),
            _ => None,
        };
        n.map(Some).ok_or_else(|| {
            bad(format!(
                "`{at}.{key}`: {} is not {} runc reads",
                untrusted(&v.to_string()).max_chars(64),
                if unsigned { "an unsigned 64-bit integer" } else { "a 64-bit integer" }
            ))
        })
    };
    let cpu = section("cpu")?;
    let memory = section("memory")?;
    for key in ["realtimeRuntime", "realtimePeriod"] {
        if int(cpu, "cpu", key, key == "realtimePeriod")?.is_some_and(|v| v != 0) {
            return Err(bad(format!(
                "`cpu.{key}`: real-time CPU time is not bounded by the CPU quota a GPU container \
                 was admitted with; GPU containers get none"
            )));
        }
    }
    let mut out = UpdateRequest::default();
    if let Some(q) = int(cpu, "cpu", "quota", false)? {
        out.cpu_quota = q as i64;
    }
    if let Some(p) = int(cpu, "cpu", "period", true)? {
        out.cpu_period = p as u64;
    }
    if let Some(l) = int(memory, "memory", "limit", false)? {
        out.memory_limit = l as i64;
    }
    // `cpus` and `mems` are Go strings: `null` leaves them empty (unchanged), anything
    // but a string is a decoding error to runc.
    for (key, slot) in [("cpus", &mut out.cpuset_cpus), ("mems", &mut out.cpuset_mems)] {
        match cpu.and_then(|m| m.get(key)) {
            None | Some(Value::Null) => {}
            Some(Value::String(v)) => *slot = Some(v.clone()).filter(|v| !v.is_empty()),
            Some(v) => {
                return Err(bad(format!(
                    "`cpu.{key}`: {} is not a string",
                    untrusted(&v.to_string()).max_chars(64)
                )))
            }
        }
    }
    Ok(out)
}

/// The update's container id candidates, for telling whether any is a GPU container
/// before anything is refused: every positional argument of the update's arguments as the
/// parser reads them, or, when they cannot be read (runc may still read them: a value
/// that is not UTF-8 is fine to Go), every argument (an id may start with `-`; one that
/// is not UTF-8 is no id runc accepts).
pub fn id_candidates(args: &[OsString]) -> Vec<String> {
    match parse_args(args) {
        Ok(a) => a.positional,
        Err(_) => args.iter().filter_map(|a| a.to_str()).map(str::to_string).collect(),
    }
}

/// What runc's record of container `id` under `root` holds of its CPU and memory values
/// (`config.cgroups` of its `state.json`: runc writes the recorded quota or period with an
/// update that names only the other); `None` when it cannot be read.
pub fn recorded_limits(root: &std::path::Path, id: &str) -> Option<RecordedLimits> {
    let id = tessera_api::ContainerId::new(id).ok()?;
    let buf = tessera_api::read_runc_state(root, &id).ok()?;
    let state: Value = serde_json::from_slice(&buf).ok()?;
    let cg = state.pointer("/config/cgroups")?;
    Some(RecordedLimits {
        cpu_quota: cg["cpu_quota"].as_i64().unwrap_or(0),
        cpu_period: cg["cpu_period"].as_u64().unwrap_or(0),
        memory: cg["memory"].as_i64().unwrap_or(0),
        cpuset_cpus: cg["cpuset_cpus"].as_str().unwrap_or_default().to_string(),
        cpuset_mems: cg["cpuset_mems"].as_str().unwrap_or_default().to_string(),
    })
}

/// `runc update --resources - ID` after the global arguments `global` (argv\[1..verb\]).
pub fn resources_argv(global: &[OsString], container_id: &str) -> Vec<OsString> {
    let mut out: Vec<OsString> = global.to_vec();
    out.extend(["update", "--resources", "-"].map(OsString::from));
    out.push(OsStr::new(container_id).to_os_string());
    out
}

/// The `--resources` JSON that sets `limits` back.
pub fn restore_json(limits: &tessera_api::KernelLimits) -> Vec<u8> {
    let quota = limits.cpu_quota.map_or(-1, |q| i64::try_from(q).unwrap_or(i64::MAX));
    let memory = limits.memory.map_or(-1, |m| i64::try_from(m).unwrap_or(i64::MAX));
    serde_json::json!({
        "cpu": {"quota": quota, "period": limits.cpu_period},
        "memory": {"limit": memory},
    })
    .to_string()
    .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn argv(s: &str) -> Vec<OsString> {
        s.split_whitespace().map(OsString::from).collect()
    }

    fn parse(s: &str) -> Result<UpdateArgs, UpdateError> {
        parse_args(&argv(s))
    }

    fn values(s: &str) -> UpdateRequest {
        flag_values(&parse(s).expect("parses")).expect("values")
    }

    #[test]
    fn flags_are_read_as_runc_reads_them() {
        let a = parse("--cpu-quota 200000 --cpu-period=100000 --memory 4g c1").expect("parses");
        assert_eq!(a.container_id(), Some("c1"));
        let v = flag_values(&a).expect("values");
        assert_eq!((v.cpu_quota, v.cpu_period, v.memory_limit), (200_000, 100_000, 4 << 30));
        // After the id (urfave reorders), single dash, the last of two wins.
        let v = values("c1 -memory 1m --memory 2m -cpu-quota=-1");
        assert_eq!((v.cpu_quota, v.memory_limit), (-1, 2 << 20));
        // `-1` as the next argument is taken as the value by Go's flag.
        assert_eq!(values("--memory=-1 --cpu-quota -1 c1").memory_limit, -1);
        assert_eq!(parse("--memory=-1 --cpu-quota -1 c1").expect("ok").container_id(), Some("c1"));
        // Nothing given: nothing changes.
        let v = values("c1");
        assert_eq!((v.cpu_quota, v.cpu_period, v.memory_limit), (0, 0, 0));
        // `--` ends the flags.
        let a = parse("--memory 1g -- -x").expect("parses");
        assert_eq!(a.container_id(), Some("-x"));
    }

    #[test]
    fn urfave_reordering_decides_what_is_a_value() {
        // `-1` after a value flag is moved with the flags, and Go takes it as the value.
        for line in ["c1 --memory -1", "--memory -1 c1", "c1 --memory -1 --cpu-quota -1"] {
            let a = parse(line).expect("parses");
            assert_eq!(a.container_id(), Some("c1"), "{line}");
            assert_eq!(flag_values(&a).expect("values").memory_limit, -1, "{line}");
        }
        // After `-1` the id is moved with the flags; Go stops at it and what follows is
        // positional: three arguments, which runc refuses.
        let a = parse("--memory -1 c1 --cpu-quota -1").expect("parses");
        assert_eq!(a.positional, ["c1", "--cpu-quota", "-1"]);
        // A value flag last takes the id as its value: no id left.
        let a = parse("c1 --cpu-quota").expect("parses");
        assert_eq!(
            (a.container_id(), a.values.get("cpu-quota").map(String::as_str)),
            (None, Some("c1"))
        );
        // A boolean flag moves the next argument too, and does not take it.
        let a = parse("--help c1").expect("parses");
        assert_eq!((a.help, a.container_id()), (true, Some("c1")));
    }

    #[test]
    fn what_runc_refuses_is_refused() {
        for bad in [
            "--nope 1 c1",
            "-r x --resources y c1",
            "--help -h c1",
            "--help=maybe c1",
            "---x c1",
            "-=x c1",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
        assert!(parse("--pids-limit 0x10 c1").is_ok());
        assert!(parse("--help c1").expect("parses").help);
        assert!(!parse("--help=false c1").expect("parses").help);
        for (flag, bad) in [
            ("cpu-quota", "1.5"),
            ("cpu-period", "-1"),
            ("cpu-period", "+5"),
            ("memory", "1.2.3g"),
            ("memory", "-2"),
        ] {
            let a = parse(&format!("--{flag}={bad} c1")).expect("parses");
            assert!(flag_values(&a).is_err(), "--{flag} {bad}");
        }
        // --resources makes every other flag's value unread.
        let a = parse("-r /x --memory bogus c1").expect("parses");
        assert_eq!(a.resources(), Some("/x"));
        // An empty --resources is no --resources.
        let a = parse("-r= --memory 1k c1").expect("parses");
        assert_eq!(a.resources(), None);
        assert_eq!(flag_values(&a).expect("values").memory_limit, 1024);
    }

    #[test]
    fn memory_sizes_are_go_units_ram_in_bytes() {
        for (s, want) in [
            ("4g", 4 << 30),
            ("4G", 4 << 30),
            ("4gb", 4 << 30),
            ("4GiB", 4 << 30),
            ("4 g", 4 << 30),
            ("1.5k", 1536),
            ("512", 512),
            ("0.5", 0),
            ("1b", 1),
            ("16p", 16i64 << 50),
        ] {
            assert_eq!(ram_in_bytes(s), Some(want), "{s}");
        }
        assert_eq!(ram_in_bytes("4 gb"), Some(4 << 30));
        for s in ["", "g", "-1", "1.2.3", "1.", "1e9", "4gib ", "4  g", "1xb", "٣"] {
            assert_eq!(ram_in_bytes(s), None, "{s:?}");
        }
        // Beyond int64: Go's conversion gives the smallest int64 (a negative limit).
        assert_eq!(ram_in_bytes("99999999999p"), Some(i64::MIN));
    }

    #[test]
    fn cpu_sets_are_read_from_flags_and_json() {
        let v = values("--cpuset-cpus 0-3 --cpuset-mems=1 c");
        assert_eq!((v.cpuset_cpus.as_deref(), v.cpuset_mems.as_deref()), (Some("0-3"), Some("1")));
        assert_eq!(values("--cpuset-cpus= c").cpuset_cpus, None, "empty: unchanged");
        let j = resources_values(br#"{"cpu": {"cpus": "0,2", "mems": null}}"#).expect("json");
        assert_eq!((j.cpuset_cpus.as_deref(), j.cpuset_mems), (Some("0,2"), None));
        let e = resources_values(br#"{"cpu": {"cpus": 3}}"#).expect_err("not a string");
        assert!(e.to_string().contains("`cpu.cpus`: 3 is not a string"), "{e}");
    }

    #[test]
    fn resources_json_is_read_canonically() {
        let v = resources_values(
            br#"{"cpu": {"quota": 1600000, "period": 100000, "shares": 2},
                 "memory": {"limit": 17179869184, "swap": 17179869184},
                 "devices": [{"allow": false, "access": "rwm"}], "pids": {"limit": 10}}
"#,
        )
        .expect("reads");
        assert_eq!((v.cpu_quota, v.cpu_period, v.memory_limit), (1_600_000, 100_000, 16 << 30));
        assert_eq!(resources_values(br#"{"memory": {"limit": -1}}"#).expect("ok").memory_limit, -1);
        assert_eq!(resources_values(b"{}").expect("ok"), UpdateRequest::default());
        for (bad, why) in [
            (&br#"{"memory": {"limit": 1, "limit": 2}}"#[..], "duplicate"),
            (br#"{"Memory": {"limit": 1}}"#, "runc reads it as"),
            (br#"{"memory": {"LIMIT": 1}}"#, "runc reads it as"),
            (br#"{"cpu": {"quota": 1, "period": -1}}"#, "unsigned"),
            (br#"{"cpu": {"quota": 1.5}}"#, "64-bit"),
            (br#"{"cpu": {"quota": "1"}}"#, "64-bit"),
            (br#"{"memory": null}"#, "null"),
            (br#"{"memory": {"limit": null}}"#, "null"),
            (
                br#"{"devices": [{"allow": true, "type": "c", "major": 195, "access": "rwm"}]}"#,
                "allows",
            ),
            (br#"{"devices": [{"allow": true, "access": "rwm"}]}"#, "allows"),
            (br#"{"unified": {"cpu.max": "max"}}"#, "unified"),
            (br#"[]"#, "object"),
            (b"", "EOF"),
            (br#"{"memory": {"limit": 1}} x"#, "trailing"),
        ] {
            let e = resources_values(bad).expect_err(why).to_string();
            assert!(
                e.to_lowercase().contains(&why.to_lowercase()),
                "{}: {e}",
                String::from_utf8_lossy(bad)
            );
        }
        let e = resources_values(br#"{"unified": {"\u001b[2J": "1"}}"#).expect_err("unified");
        assert!(!e.to_string().contains('\u{1b}'), "{e}");
    }

    #[test]
    fn an_update_the_parser_cannot_read_names_every_argument_as_a_possible_id() {
        use std::os::unix::ffi::OsStringExt;
        // Go reads a value that is not UTF-8; this parser refuses it. The GPU container
        // `-gpu` must still be looked at.
        let args = vec![
            OsString::from("--cpuset-mems"),
            OsString::from_vec(vec![0xff]),
            OsString::from("--cpu-quota"),
            OsString::from("1600000"),
            OsString::from("--"),
            OsString::from("-gpu"),
        ];
        assert!(parse_args(&args).is_err());
        assert!(id_candidates(&args).contains(&"-gpu".to_string()));
    }

    #[test]
    fn restores_and_argv() {
        let l = tessera_api::KernelLimits {
            cpu_quota: None,
            cpu_period: 100_000,
            memory: Some(1 << 29),
        };
        let v = resources_values(&restore_json(&l)).expect("reads back");
        assert_eq!((v.cpu_quota, v.cpu_period, v.memory_limit), (-1, 100_000, 1 << 29));
        let a = resources_argv(&argv("--root /r --log /l"), "c1");
        assert_eq!(a, argv("--root /r --log /l update --resources - c1"));
    }

    proptest::proptest! {
        #[test]
        fn never_panics(words in proptest::collection::vec("(-{0,3})[a-z0-9=./-]{0,8}", 0..8)) {
            let args: Vec<OsString> = words.into_iter().map(OsString::from).collect();
            if let Ok(a) = parse_args(&args) {
                let _ = flag_values(&a);
            }
            let _ = id_candidates(&args);
        }

        #[test]
        fn ram_never_panics(s in "[0-9. kKmMgGiIbB]{0,12}") {
            let _ = ram_in_bytes(&s);
        }
    }
}
