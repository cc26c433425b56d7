//! Issue 11, the property: what Tessera decides about a config.json is what runc enforces.
//!
//! Generated configs (seeded, so a failure replays) mix device rules of every type and
//! wildcard spelling, device nodes with in- and out-of-range numbers, and hostile key
//! spellings — case and Unicode folds of field names (`Linux`, `reſources`, `hookſ`,
//! `MAJOR`), duplicate keys, a folded `Root` — written as raw JSON text, so the order and
//! the duplicates reach runc exactly as generated. Each goes through what tessera-runtime
//! does (canonical parse, rootfs check, GPU checks, injection of a MIG grant); every config
//! Tessera accepts is then created with real runc, and what runc did is read back:
//! - the devices cgroup runc wrote (`devices.list`) opens exactly the injected GPU nodes,
//!   and equals, entry for entry, Tessera's own model of it (`DeviceAccess::emulate`);
//! - the prestart hook Tessera wrote is the one runc ran;
//! - the root runc uses is the root Tessera checked.

// Integration-test crates: clippy counts their helper functions as non-test code, so
// `allow-unwrap-in-tests` (clippy.toml) does not reach them; a panic is the failure report.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::Path;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use runtime_hook::canonical::{self, DeviceAccess, DeviceRule, RuleKind};
use runtime_hook::spec::{self, HookConfig};
use serde_json::{json, Value};
use tessera_api::{DeviceNode, Injection};
use tessera_harness::*;

/// The simulated node's majors: nvidia, nvidia-uvm, nvidia-caps.
const GPU_MAJORS: [u32; 3] = [195, 508, 509];
const CASES: usize = 128;

/// A JSON document as text will hold it: object members in order, duplicates allowed.
#[derive(Debug, Clone)]
enum J {
    Obj(Vec<(String, J)>),
    Arr(Vec<J>),
    V(Value),
}

impl J {
    fn from(v: &Value) -> J {
        match v {
            Value::Object(m) => J::Obj(m.iter().map(|(k, v)| (k.clone(), J::from(v))).collect()),
            Value::Array(a) => J::Arr(a.iter().map(J::from).collect()),
            v => J::V(v.clone()),
        }
    }
    fn write(&self, out: &mut String) {
        match self {
            J::V(v) => out.push_str(&v.to_string()),
            J::Arr(items) => {
                out.push('[');
                for (i, it) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    it.write(out);
                }
                out.push(']');
            }
            J::Obj(members) => {
                out.push('{');
                for (i, (k, v)) in members.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    out.push_str(&Value::from(k.as_str()).to_string());
                    out.push(':');
                    v.write(out);
                }
                out.push('}');
            }
        }
    }
    /// The member list of the object at `path` (keys, exact).
    fn obj_at(&mut self, path: &[&str]) -> &mut Vec<(String, J)> {
        let J::Obj(members) = self else { panic!("not an object") };
        match path.split_first() {
            None => members,
            Some((k, rest)) => members
                .iter_mut()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v)
                .unwrap_or_else(|| panic!("no {k}"))
                .obj_at(rest),
        }
    }
}

fn text(j: &J) -> String {
    let mut s = String::new();
    j.write(&mut s);
    s
}

fn pick<'a, T>(rng: &mut StdRng, items: &'a [T]) -> &'a T {
    &items[rng.gen_range(0..items.len())]
}

/// A device rule with any type, wildcard spelling, number and access.
fn random_rule(rng: &mut StdRng) -> Value {
    let mut r = serde_json::Map::new();
    r.insert("allow".into(), json!(rng.gen_bool(0.8)));
    let hazard = rng.gen_bool(0.15);
    let types: &[&str] = if hazard { &["a", "", "-", "u"] } else { &["c", "c", "c", "c", "b"] };
    match *pick(rng, types) {
        "-" => {}
        t => {
            r.insert("type".into(), json!(t));
        }
    }
    let number = |rng: &mut StdRng, gpu: bool| -> Option<i64> {
        match rng.gen_range(0..24) {
            0..=1 => None,
            2..=3 => Some(-1),
            4 => Some(*pick(rng, &[4291_i64, 4_294_967_491, -2, 1 << 20])),
            5..=9 => Some(rng.gen_range(234..512)),
            _ if gpu => Some(i64::from(*pick(rng, &GPU_MAJORS))),
            _ => Some(rng.gen_range(0..300)),
        }
    };
    if let Some(m) = number(rng, true) {
        r.insert("major".into(), json!(m));
    }
    if let Some(m) = number(rng, false) {
        r.insert("minor".into(), json!(m));
    }
    let accesses: &[&str] =
        if rng.gen_bool(0.1) { &["", "-", "rwx"] } else { &["rwm", "rw", "r", "w", "m"] };
    match *pick(rng, accesses) {
        "-" => {}
        a => {
            r.insert("access".into(), json!(a));
        }
    }
    Value::Object(r)
}

/// A device node, NVIDIA or not, in range or not.
fn random_node(rng: &mut StdRng) -> Value {
    let n = rng.gen_range(0..8);
    let path = pick(
        rng,
        &[
            "/dev/nvidia{n}",
            "/dev/x{n}",
            "/dev/nvidia-caps/nvidia-cap{n}",
            "dev/nvidia{n}",
            "/dev/gpu{n}",
        ],
    )
    .replace("{n}", &(n + 10).to_string());
    let major = match rng.gen_range(0..10) {
        0 => 4291, // 195 once mknod truncates it
        1 => rng.gen_range(234..512),
        _ => i64::from(*pick(rng, &GPU_MAJORS)),
    };
    json!({"path": path, "type": *pick(rng, &["c", "u", "b"]), "major": major, "minor": n, "fileMode": 438, "uid": 0, "gid": 0})
}

/// The hostile spellings, each of which runc reads as a field serde does not see.
#[derive(Debug, Clone, Copy)]
enum Hostile {
    /// `"Linux": {...}` after `linux`: runc merges it in (its device rules replace ours).
    FoldedLinux,
    /// `linux.reſources`.
    FoldedResources,
    /// `"hookſ": {"prestart": []}`: runc drops the prestart hook.
    FoldedHooks,
    /// `"MAJOR": 195` in a rule for /dev/null.
    FoldedMajor,
    /// A second `linux` object, later in the text.
    DuplicateLinux,
    /// `root` spelled `Root` (pointing at another rootfs).
    FoldedRoot,
}

const HOSTILE: [Hostile; 6] = [
    Hostile::FoldedLinux,
    Hostile::FoldedResources,
    Hostile::FoldedHooks,
    Hostile::FoldedMajor,
    Hostile::DuplicateLinux,
    Hostile::FoldedRoot,
];

fn gpu_rule(minor: i64) -> Value {
    json!({"allow": true, "type": "c", "major": 195, "minor": minor, "access": "rw"})
}

fn apply_hostile(doc: &mut J, h: Hostile) {
    let grab = J::from(&json!({"resources": {"devices": [gpu_rule(7)]}}));
    match h {
        Hostile::FoldedLinux => doc.obj_at(&[]).push(("Linux".into(), grab)),
        Hostile::FoldedResources => doc
            .obj_at(&["linux"])
            .push(("reſources".into(), J::from(&json!({"devices": [gpu_rule(7)]})))),
        Hostile::FoldedHooks => {
            doc.obj_at(&[]).push(("hookſ".into(), J::from(&json!({"prestart": []}))))
        }
        Hostile::FoldedMajor => {
            let rule = J::from(
                &json!({"allow": true, "type": "c", "major": 1, "minor": 7, "access": "rw", "MAJOR": 195}),
            );
            let linux = doc.obj_at(&["linux", "resources"]);
            let (_, devices) = linux.iter_mut().find(|(k, _)| k == "devices").expect("devices");
            let J::Arr(items) = devices else { panic!("devices") };
            items.push(rule);
        }
        Hostile::DuplicateLinux => doc.obj_at(&[]).push(("linux".into(), grab)),
        Hostile::FoldedRoot => {
            let top = doc.obj_at(&[]);
            let (k, v) = top.iter_mut().find(|(k, _)| k == "root").expect("root");
            *k = "Root".into();
            *v = J::from(&json!({"path": "rootfs2"}));
        }
    }
}

fn mig_injection() -> Injection {
    let dev = |path: &str, major: i64, minor: i64| DeviceNode {
        path: path.into(),
        major,
        minor,
        file_mode: 0o666,
    };
    Injection {
        devices: vec![
            dev("/dev/nvidiactl", 195, 255),
            dev("/dev/nvidia-uvm", 508, 0),
            dev("/dev/nvidia-uvm-tools", 508, 1),
            dev("/dev/nvidia0", 195, 0),
            dev("/dev/nvidia-caps/nvidia-cap12", 509, 12),
            dev("/dev/nvidia-caps/nvidia-cap13", 509, 13),
        ],
        env: vec!["CUDA_VISIBLE_DEVICES=MIG-test".into()],
        mounts: Vec::new(),
        gpu_majors: GPU_MAJORS.iter().map(|&m| i64::from(m)).collect(),
        cpuset: None,
    }
}

/// GPU entries of a devices.list that open (r or w) a GPU node: (major, minor) → "rw".
fn gpu_openings(list: &str) -> BTreeMap<(Option<u32>, Option<u32>), String> {
    let mut out = BTreeMap::new();
    for line in list.lines() {
        let mut parts = line.split_whitespace();
        let (kind, nums, access) =
            (parts.next().unwrap(), parts.next().unwrap(), parts.next().unwrap());
        let (ma, mi) = nums.split_once(':').unwrap();
        let num = |s: &str| if s == "*" { None } else { Some(s.parse::<u32>().unwrap()) };
        let opens: String = access.chars().filter(|c| *c == 'r' || *c == 'w').collect();
        let gpu = kind == "a" || (kind == "c" && num(ma).is_none_or(|m| GPU_MAJORS.contains(&m)));
        if gpu && !opens.is_empty() {
            out.insert((num(ma), num(mi)), opens);
        }
    }
    out
}

/// What kind of refusal an error is, for the summary.
fn refusal_class(e: &spec::SpecError) -> &'static str {
    use runtime_hook::canonical::CanonicalError as C;
    use spec::SpecError as S;
    match e {
        S::Canonical { source: C::DuplicateKey { .. }, .. } => "duplicate key",
        S::Canonical { source: C::FoldedKey { .. } | C::NonAsciiKey { .. }, .. } => "folded key",
        S::AllowAll { .. } => "allow-all rule",
        S::AnyCharDevice { .. } => "any-major rule",
        S::Ambiguous(C::Value { message, .. }) if message.contains("range") => {
            "number out of range"
        }
        S::Ambiguous(C::Value { .. }) => "value runc refuses",
        S::BadInjection(_) => "rules runc cannot apply",
        _ => "other",
    }
}

#[test]
fn what_tessera_decides_is_what_runc_enforces() {
    let fx = Fixture::new();
    let marker = fx.path("hook-ran");
    let hook = fx.path("hook.sh");
    fs::write(&hook, format!("#!/bin/sh\ncat > /dev/null\necho \"$1\" >> {}\n", marker.display()))
        .unwrap();
    fs::set_permissions(&hook, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let hooks = HookConfig { path: hook.clone(), socket: fx.path("unused.sock"), prestart: true };
    let inj = mig_injection();
    let want: BTreeMap<(Option<u32>, Option<u32>), String> = inj
        .devices
        .iter()
        .map(|d| ((Some(d.major as u32), Some(d.minor as u32)), "rw".to_string()))
        .collect();
    let majors: BTreeSet<u32> = GPU_MAJORS.into();

    let seed: u64 =
        std::env::var("SPEC_VS_RUNC_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(11);
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut accepted, mut refused, mut hostile_refused, mut nontrivial) = (0, 0, 0, 0);
    let mut reasons: BTreeMap<&'static str, usize> = BTreeMap::new();
    for case in 0..CASES {
        let id = format!("c{case}");
        let mut b = fx.bundle(&id);
        Rootfs::busybox(b.dir().join("rootfs2"));
        fs::write(b.rootfs().join("which-root"), "rootfs").unwrap();
        fs::write(b.dir().join("rootfs2/which-root"), "rootfs2").unwrap();
        b.args(&["sleep", "30"]);
        let rules: Vec<Value> = (0..rng.gen_range(0..4)).map(|_| random_rule(&mut rng)).collect();
        let nodes: Vec<Value> = (0..rng.gen_range(0..3)).map(|_| random_node(&mut rng)).collect();
        b.mutate(|c| {
            c["linux"]["resources"]["devices"].as_array_mut().unwrap().extend(rules.clone());
            c["linux"]["devices"] = json!(nodes);
        });
        let mut doc = J::from(b.config());
        let hostile = rng.gen_bool(0.25).then(|| *pick(&mut rng, &HOSTILE));
        if let Some(h) = hostile {
            apply_hostile(&mut doc, h);
        }
        let raw = text(&doc);
        let label = format!("case {case} (seed {seed}, hostile {hostile:?}): {raw}");

        // What tessera-runtime does with the bytes, up to the write.
        let decided = (|| -> Result<Value, spec::SpecError> {
            let mut v = spec::parse_config(&b.config_path(), raw.as_bytes())?;
            spec::check_rootfs(b.dir(), &v)?;
            spec::check_gpu_spec(&v)?;
            spec::apply_injection(&mut v, &inj, &hooks)?;
            Ok(v)
        })();
        let v = match decided {
            Err(e) => {
                refused += 1;
                if hostile.is_some() {
                    hostile_refused += 1;
                }
                let msg = e.to_string();
                *reasons.entry(refusal_class(&e)).or_insert(0) += 1;
                assert!(msg.len() < 600 && !msg.contains('\n'), "bounded, one line: {msg}");
                continue;
            }
            Ok(v) => v,
        };
        accepted += 1;
        // Tessera's model of what runc will write.
        let rules: Vec<DeviceRule> = v["linux"]["resources"]["devices"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
            .map(|(i, r)| DeviceRule::from_value(r, &format!("[{i}]")).unwrap())
            .collect();
        if rules.iter().any(|r| {
            r.allow && r.kind != RuleKind::All && !(r.major.is_some_and(|m| majors.contains(&m)))
        }) {
            nontrivial += 1;
        }
        let model =
            DeviceAccess::emulate(rules.iter().chain(canonical::RUNC_DEFAULT_RULES)).unwrap();
        let checked_root = v["root"]["path"].as_str().map(|p| b.dir().join(p));

        fs::write(b.config_path(), serde_json::to_vec(&v).unwrap()).unwrap();
        let _ = fs::remove_file(&marker);
        let out = fx.create_container(&b, &id);
        assert!(
            out.status.success(),
            "{label}\nrunc refused what Tessera accepted: {}",
            out.stderr_str()
        );

        // The devices cgroup runc wrote.
        let list = devices_list(&b.cgroups_path());
        assert_eq!(
            gpu_openings(&list),
            want,
            "{label}\nrunc's devices.list opens other GPU nodes:\n{list}"
        );
        assert_eq!(
            DeviceAccess::from_devices_list(&list).unwrap(),
            model,
            "{label}\nTessera's model differs from runc:\n{list}"
        );
        assert_eq!(model.gpu_openings(&majors).map(|m| m.len()), Some(want.len()), "{label}");
        // The hook runc ran.
        let ran = fs::read_to_string(&marker).unwrap_or_default();
        assert_eq!(ran.trim(), "prestart", "{label}\nrunc did not run Tessera's prestart hook");
        // The root runc uses.
        let pid = fx.container_pid(&id).expect("created container has a pid");
        let seen = fs::read_to_string(format!("/proc/{pid}/root/which-root")).unwrap();
        let checked = checked_root.expect("accepted config has a root");
        assert_eq!(
            Path::new(&checked).file_name().unwrap().to_str().unwrap(),
            seen,
            "{label}\nrunc uses another root"
        );

        fx.delete_container(&id, true).assert_success("delete");
    }
    eprintln!("{CASES} cases: {accepted} accepted and checked against runc ({nontrivial} with other allow rules), {refused} refused ({hostile_refused} hostile): {reasons:?}");
    assert!(accepted >= CASES / 4, "too few accepted for the property to mean much: {accepted}");
    assert!(nontrivial >= 5, "too few accepted configs with rules of their own: {nontrivial}");
}

/// Issue 23, the property for mounts: what Tessera decides about a GPU container's mounts is
/// what runc and the kernel make of them.
///
/// Generated mount lists (seeded: `SPEC_VS_RUNC_SEED`) mix every type runc treats apart
/// (bind under any `type`, `cgroup`, `cgroup2`, `sysfs`, `tmpfs`), options in any order with
/// duplicates (`ro`/`rw`, `bind`/`rbind`, `rro`/`rrw`, `remount`, propagation), and sources
/// spelled every way the kernel resolves: links (in the fixture and inside the bundle,
/// relative to it), `..`, `/proc/self/root`, and parents of the cgroup mount point (bind
/// and rbind). Tessera's decision is the wrapper's checks and then tesserad's reading of
/// the mounts runc made (the prestart check, here on the created container's table). For
/// every config both accept, real runc runs it and a probe inside the container opens for
/// writing a control file of every cgroup hierarchy and sysfs it can see (a read-only
/// view refuses the open with EROFS; nothing is written) and opens every GPU node: no
/// hierarchy may be writable, and the GPU nodes it can open must be exactly the granted
/// ones.
#[test]
fn the_mounts_tessera_accepts_give_no_writable_cgroup_or_sysfs_in_runc() {
    const MOUNT_CASES: usize = 128;
    let fx = Fixture::new();
    let marker = fx.path("hook-ran");
    let hook = fx.path("hook.sh");
    fs::write(&hook, format!("#!/bin/sh\ncat > /dev/null\necho \"$1\" >> {}\n", marker.display()))
        .unwrap();
    fs::set_permissions(&hook, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let hooks = HookConfig { path: hook.clone(), socket: fx.path("unused.sock"), prestart: true };
    let inj = mig_injection();
    // Spellings that lead to the host's cgroups (or not) through links.
    let link = fx.path("cglink");
    std::os::unix::fs::symlink("/sys/fs/cgroup", &link).unwrap();
    let plain = fx.path("plain");
    fs::create_dir_all(&plain).unwrap();
    let link = link.display().to_string();
    let sources: Vec<String> = vec![
        "/sys/fs/cgroup".into(),
        "/sys/fs/cgroup/devices".into(),
        "/sys/fs/cgroup/cpu".into(),
        "/sys/fs".into(),
        "/sys".into(),
        "/proc/self/root/sys/fs/cgroup/devices".into(),
        "/sys/fs/cgroup/../cgroup/devices".into(),
        format!("{link}/devices"),
        link.clone(),
        "bundle-link".into(),
        "bundle-link/../devices".into(),
        plain.display().to_string(),
        plain.display().to_string(),
        "/etc".into(),
        "rootfs/m0".into(),
    ];
    let types = ["bind", "bind", "bind", "none", "cgroup", "cgroup2", "sysfs", "tmpfs"];
    let options = [
        "bind", "rbind", "ro", "ro", "ro", "rw", "rro", "rro", "rrw", "nosuid", "nodev",
        "rprivate", "private",
    ];
    // Rarer: each refused outright, so a few suffice.
    let hazards = ["remount", "rslave", "shared"];
    let facts = runtime_hook::mounts::LinuxHostFacts::read().unwrap();
    let seed: u64 =
        std::env::var("SPEC_VS_RUNC_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(23);
    let mut rng = StdRng::seed_from_u64(seed);
    let (mut accepted, mut refused, mut at_prestart, mut runc_refused, mut views) = (0, 0, 0, 0, 0);
    let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
    let probe = "awk '{for(i=7;i<=NF;i++) if($i==\"-\"){print $5, $(i+1)}}' /proc/self/mountinfo | \
                 while read -r mp t; do \
                   case $t in \
                     cgroup|cgroup2) f=\"$mp/cgroup.procs\";; \
                     sysfs) f=$(find \"$mp\" -maxdepth 3 -name uevent -type f 2>/dev/null | head -n 1);; \
                     *) continue;; \
                   esac; \
                   [ -n \"$f\" ] && [ -f \"$f\" ] || continue; echo \"V $mp\"; \
                   if (exec 3>>\"$f\") 2>/dev/null; then echo \"W $mp $t\"; fi; \
                 done; \
                 for d in /dev/nvidia* /dev/nvidia-caps/*; do \
                   [ -c \"$d\" ] || continue; \
                   e=$( (exec 3<\"$d\") 2>&1 ) && { echo \"O $d\"; continue; }; \
                   case $e in *'not permitted'*) ;; *) echo \"O $d\";; esac; \
                 done";
    for case in 0..MOUNT_CASES {
        let id = format!("m{case}");
        let mut b = fx.bundle(&id);
        b.args(&["sleep", "30"]);
        std::os::unix::fs::symlink("/sys/fs/cgroup", b.dir().join("bundle-link")).unwrap();
        let n = rng.gen_range(1..3);
        let mut mounts = Vec::new();
        for i in 0..n {
            let typ = *pick(&mut rng, &types);
            let mut opts: Vec<&str> = (0..rng.gen_range(0..5))
                .map(|_| {
                    if rng.gen_bool(0.04) {
                        *pick(&mut rng, &hazards)
                    } else {
                        *pick(&mut rng, &options)
                    }
                })
                .collect();
            // Mostly with the flag that makes it one (without it runc mounts a filesystem
            // called "bind", which does not exist).
            if typ == "bind" && rng.gen_bool(0.8) {
                let at = rng.gen_range(0..=opts.len());
                opts.insert(at, if rng.gen_bool(0.5) { "bind" } else { "rbind" });
            }
            let source = pick(&mut rng, &sources).clone();
            mounts.push(json!({"destination": format!("/m{i}"), "type": typ, "source": source,
                               "options": opts}));
        }
        let root_prop = *pick(
            &mut rng,
            &[None, None, None, None, None, None, None, None, Some("rslave"), Some("rprivate")],
        );
        b.mutate(|c| {
            c["mounts"].as_array_mut().unwrap().extend(mounts.clone());
            if let Some(p) = root_prop {
                c["linux"]["rootfsPropagation"] = json!(p);
            }
        });
        let raw = serde_json::to_string(b.config()).unwrap();
        let label = format!("case {case} (seed {seed}): mounts {mounts:?}, root {root_prop:?}");
        let decided = (|| -> Result<Value, spec::SpecError> {
            let mut v = spec::parse_config(&b.config_path(), raw.as_bytes())?;
            spec::check_rootfs(b.dir(), &v)?;
            spec::check_gpu_spec(&v)?;
            spec::check_host_facts(b.dir(), &v, &facts)?;
            spec::apply_injection(&mut v, &inj, &hooks)?;
            Ok(v)
        })();
        let v = match decided {
            Err(e) => {
                refused += 1;
                let msg = e.to_string();
                assert!(msg.len() < 600 && !msg.contains('\n'), "bounded, one line: {msg}");
                let class = msg.split(": ").nth(1).unwrap_or("?").chars().take(40).collect();
                *reasons.entry(class).or_insert(0) += 1;
                continue;
            }
            Ok(v) => v,
        };
        fs::write(b.config_path(), serde_json::to_vec(&v).unwrap()).unwrap();
        let out = fx.create_container(&b, &id);
        if !out.status.success() {
            // runc refuses some mounts for reasons of its own (a `bind` type without the
            // flag, a missing source): nothing runs.
            runc_refused += 1;
            if std::env::var_os("SPEC_VS_RUNC_VERBOSE").is_some() {
                eprintln!("{label}\nrunc: {}", out.stderr_str());
            }
            continue;
        }
        let pid = fx.container_pid(&id).expect("created container has a pid");
        // tesserad's check at prestart, on the table runc made.
        let table = tessera_api::mountinfo::parse(
            &fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap(),
        )
        .unwrap();
        if !tessera_api::mountinfo::findings(&table).is_empty() {
            at_prestart += 1;
            fx.delete_container(&id, true).assert_success("delete");
            continue;
        }
        accepted += 1;
        fx.start_container(&id).assert_success("start");
        let seen = fx.exec(&id, &["sh", "-c", probe]);
        seen.assert_success("probe");
        let seen = String::from_utf8_lossy(&seen.stdout).to_string();
        views += seen.lines().filter(|l| l.starts_with("V ")).count();
        let writable: Vec<&str> = seen.lines().filter(|l| l.starts_with("W ")).collect();
        assert!(writable.is_empty(), "{label}\nwritable inside: {writable:?}\nmounts: {table:?}");
        let opened: BTreeSet<String> =
            seen.lines().filter_map(|l| l.strip_prefix("O ")).map(str::to_string).collect();
        let granted: BTreeSet<String> = inj.devices.iter().map(|d| d.path.clone()).collect();
        assert_eq!(opened, granted, "{label}\nGPU nodes the container opens");
        fx.delete_container(&id, true).assert_success("delete");
    }
    eprintln!(
        "{MOUNT_CASES} mount cases: {accepted} accepted and probed ({views} cgroup/sysfs views \
         seen read-only), {refused} refused by the wrapper, {at_prestart} at prestart, \
         {runc_refused} refused by runc: {reasons:?}"
    );
    assert!(accepted >= MOUNT_CASES / 8, "too few accepted for the property to mean much");
    assert!(views >= accepted, "every accepted container sees at least one read-only view");
}
