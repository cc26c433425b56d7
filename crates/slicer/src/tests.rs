//! Tests across modules: the simulated backend on the example nodes, choice and
//! injection on their inventories, and property tests of the pure decisions.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use proptest::prelude::*;
// Explicit beats the two globs: `Strategy` here is proptest's.
use proptest::strategy::Strategy;
use tessera_api::{DeviceNode, GpuRequest, GrantedDevice};

use crate::catalog::{self, MODELS};
use crate::inventory::driver_cap_minor;
use crate::*;

fn example(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/nodes").join(name)
}

fn open_example(name: &str) -> (tempfile::TempDir, SimBackend, Inventory) {
    let dir = tempfile::tempdir().expect("tempdir");
    let sim = SimBackend::open(&example(name), dir.path()).expect("open sim");
    let inv = sim.inventory().expect("inventory");
    (dir, sim, inv)
}

fn req(s: &str) -> GpuRequest {
    s.parse().expect("request")
}

fn held(uuids: &[&str]) -> BTreeSet<String> {
    uuids.iter().map(|s| s.to_string()).collect()
}

fn is_uuid(s: &str, prefix: &str) -> bool {
    let Some(rest) = s.strip_prefix(prefix).and_then(|r| r.strip_prefix('-')) else { return false };
    let groups: Vec<&str> = rest.split('-').collect();
    groups.iter().map(|g| g.len()).eq([8, 4, 4, 4, 12])
        && groups
            .iter()
            .all(|g| g.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()))
}

fn dev(path: &str, major: i64, minor: i64) -> DeviceNode {
    DeviceNode { path: path.into(), major, minor, file_mode: 0o666 }
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write");
    p
}

// ---------------------------------------------------------------- simulated backend

#[test]
fn sim_realises_the_h100_example() {
    let (_dir, sim, inv) = open_example("h100x8.json");
    assert_eq!(sim.describe(), format!("sim:{}", example("h100x8.json").display()));
    assert_eq!(inv.node, "sim-h100-0");
    assert_eq!(inv.majors, Majors { nvidia: 195, nvidia_uvm: 508, nvidia_caps: Some(509) });
    assert_eq!(inv.gpus.len(), 8);
    for (i, g) in inv.gpus.iter().enumerate() {
        assert_eq!(g.index as usize, i);
        assert_eq!(g.minor as usize, i);
        assert_eq!(g.model, "H100-80GB");
        assert_eq!(g.memory_mib, 81559);
        assert!(is_uuid(&g.uuid, "GPU"), "{}", g.uuid);
        assert_eq!(g.mig_enabled, i < 3);
        for inst in &g.instances {
            assert!(is_uuid(&inst.uuid, "MIG"), "{}", inst.uuid);
            assert_eq!(inst.ci_id, 0);
            assert_eq!(inst.gi_cap_minor, driver_cap_minor(g.minor, inst.gi_id, None));
            assert_eq!(inst.ci_cap_minor, driver_cap_minor(g.minor, inst.gi_id, Some(0)));
        }
    }
    // gpu0: 3g created first (gi 1), then 2g (gi 2), then 1g (gi 3); listed by start.
    let g0: Vec<(&str, u32, u8, u8, u64, u32, u32)> = inv.gpus[0]
        .instances
        .iter()
        .map(|i| {
            (
                i.profile.as_str(),
                i.gi_id,
                i.start,
                i.size,
                i.memory_mib,
                i.gi_cap_minor,
                i.ci_cap_minor,
            )
        })
        .collect();
    assert_eq!(
        g0,
        [
            ("3g.40gb", 1, 0, 4, 40448, 12, 13),
            ("2g.20gb", 2, 4, 2, 20096, 21, 22),
            ("1g.10gb", 3, 6, 1, 9984, 30, 31)
        ]
    );
    let g1: Vec<(u32, u8)> = inv.gpus[1].instances.iter().map(|i| (i.gi_id, i.start)).collect();
    assert_eq!(g1, (1..=7).zip(0..7).collect::<Vec<_>>());
    let g2: Vec<(&str, u8)> =
        inv.gpus[2].instances.iter().map(|i| (i.profile.as_str(), i.start)).collect();
    assert_eq!(g2, [("2g.20gb", 0), ("2g.20gb", 2), ("1g.10gb", 4), ("1g.10gb", 5)]);
    assert!(inv.gpus[3..].iter().all(|g| g.instances.is_empty()));
    // Every uuid on the node is distinct.
    let all: BTreeSet<&str> = inv
        .gpus
        .iter()
        .flat_map(|g| {
            std::iter::once(g.uuid.as_str()).chain(g.instances.iter().map(|i| i.uuid.as_str()))
        })
        .collect();
    assert_eq!(all.len(), 8 + 3 + 7 + 4);
}

#[test]
fn sim_writes_host_files_and_memory_files() {
    let (dir, sim, inv) = open_example("h100x8.json");
    let simdir = dir.path().join("sim");
    assert_eq!(sim.sim_dir(), simdir);
    for f in ["node.json", "proc-devices", "mig-minors"] {
        assert!(simdir.join(f).is_file(), "{f}");
    }
    let minors = std::fs::read_to_string(sim.mig_minors_path()).expect("mig-minors");
    assert!(minors.starts_with("config 1\nmonitor 2\ngpu0/gi0/access 3\n"), "{}", &minors[..60]);
    assert!(minors.contains("\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\n"));
    assert!(minors.contains("\ngpu7/gi14/ci7/access 1082\n"));
    let devices = std::fs::read_to_string(sim.proc_devices_path()).expect("proc-devices");
    assert!(
        devices.contains("\n195 nvidia-frontend\n508 nvidia-uvm\n509 nvidia-caps\n"),
        "{devices}"
    );
    // One memory file per assignable device: MIG instances on MIG GPUs, else the GPU.
    let mut expected = BTreeSet::new();
    for g in &inv.gpus {
        if g.mig_enabled {
            expected.extend(g.instances.iter().map(|i| sim.memory_file(&i.uuid)));
            assert!(!sim.memory_file(&g.uuid).exists(), "no memory file for a MIG parent");
        } else {
            expected.insert(sim.memory_file(&g.uuid));
        }
    }
    assert_eq!(expected.len(), 3 + 7 + 4 + 5);
    let on_disk: BTreeSet<PathBuf> = std::fs::read_dir(simdir.join("mem"))
        .expect("mem dir")
        .map(|e| e.expect("entry").path())
        .collect();
    assert_eq!(on_disk, expected);
    for p in &expected {
        let bytes = std::fs::read(p).expect("read mem");
        assert_eq!(bytes.len(), 65536, "{}", p.display());
        assert!(bytes.iter().all(|&b| b == 0));
    }
    // No temporary files are left behind.
    assert!(std::fs::read_dir(&simdir).expect("sim dir").all(|e| !e
        .expect("e")
        .file_name()
        .to_string_lossy()
        .ends_with(".tmp")));
    // The memory path never leaves the mem directory.
    assert_eq!(
        sim.memory_file("../../etc/passwd"),
        simdir.join("mem").join("______etc_passwd.bin")
    );
}

#[test]
fn sim_state_survives_reopen() {
    let dir = tempfile::tempdir().expect("tempdir");
    let node = example("h100x8.json");
    let first = SimBackend::open(&node, dir.path()).expect("open");
    let inv1 = first.inventory().expect("inventory");
    let mig = inv1.gpus[0].instances[0].uuid.clone();
    std::fs::write(first.memory_file(&mig), vec![0xAB; 65536]).expect("tenant writes a secret");
    // Change the persisted hardware (as a later MIG reconfiguration would): drop gpu0's
    // 1g instance. A reopen must keep it that way, not re-derive from the node file.
    let state_path = dir.path().join("sim/node.json");
    let mut state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&state_path).expect("read")).expect("json");
    let instances = state["gpus"][0]["instances"].as_array_mut().expect("instances");
    instances.pop();
    std::fs::write(&state_path, serde_json::to_vec(&state).expect("ser")).expect("write");
    drop(first);

    let second = SimBackend::open(&node, dir.path()).expect("reopen");
    let inv2 = second.inventory().expect("inventory");
    assert_eq!(inv2.gpus[0].instances.len(), 2);
    assert_eq!(inv2.gpus[1..], inv1.gpus[1..]);
    assert_eq!(inv2.gpus[0].instances[..], inv1.gpus[0].instances[..2]);
    let mem = std::fs::read(second.memory_file(&mig)).expect("mem");
    assert!(mem.iter().all(|&b| b == 0xAB), "device memory survives a reopen");

    // A fresh state dir realises the same uuids: they are derived, not random.
    let other = tempfile::tempdir().expect("tempdir");
    let inv3 = SimBackend::open(&node, other.path()).expect("open").inventory().expect("inventory");
    assert_eq!(inv3, inv1);
}

#[test]
fn sim_rejects_state_of_another_node() {
    let dir = tempfile::tempdir().expect("tempdir");
    SimBackend::open(&example("h100x8.json"), dir.path()).expect("open");
    let err = SimBackend::open(&example("a100-40x4.json"), dir.path()).unwrap_err();
    assert!(matches!(err, BackendError::StateMismatch { .. }), "{err}");
    assert!(
        err.to_string().contains("node is `sim-h100-0` in the state but `sim-a100-0`"),
        "{err}"
    );

    let renamed = write(
        dir.path(),
        "fewer.json",
        r#"{"node": "sim-h100-0", "gpus": [{"model": "H100-80GB"}, {"model": "H100-80GB"}]}"#,
    );
    let err = SimBackend::open(&renamed, dir.path()).unwrap_err();
    assert!(
        err.to_string().contains("the state has 8 GPUs but the node file describes 2"),
        "{err}"
    );
    assert!(err.to_string().contains("remove "), "{err}");

    let models =
        (0..8).map(
            |i| if i == 5 { r#"{"model": "H200-141GB"}"# } else { r#"{"model": "H100-80GB"}"# },
        );
    let text =
        format!(r#"{{"node": "sim-h100-0", "gpus": [{}]}}"#, models.collect::<Vec<_>>().join(","));
    let other = write(dir.path(), "models.json", &text);
    let err = SimBackend::open(&other, dir.path()).unwrap_err();
    assert!(
        err.to_string()
            .contains("gpus[5] is a H100-80GB in the state but a H200-141GB in the node file"),
        "{err}"
    );

    // A memory file of the wrong size is caught on reopen.
    let sim = SimBackend::open(&example("h100x8.json"), dir.path()).expect("reopen");
    let uuid = sim.inventory().expect("inv").gpus[3].uuid.clone();
    std::fs::write(sim.memory_file(&uuid), b"short").expect("truncate");
    let err = SimBackend::open(&example("h100x8.json"), dir.path()).unwrap_err();
    assert!(err.to_string().contains("is 5 bytes, not 65536"), "{err}");
}

#[test]
fn sim_node_file_errors_name_the_field() {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state");
    let cases = [
        (r#"{"node": "n", "gpus": [{"model": "H100-80GB", "mig": [{"profile": "3g.40gb", "start": 2}]}]}"#,
         "gpus[0].mig: 3g.40gb cannot start at slot 2"),
        (r#"{"node": "n", "gpus": [{"model": "H100-80GB"}, {"model": "H100-80GB", "mig": [{"profile": "3g.40gb", "start": 0}, {"profile": "2g.20gb", "start": 2}]}]}"#,
         "gpus[1].mig: 3g.40gb at slot 0 and 2g.20gb at slot 2 overlap"),
        (r#"{"node": "n", "gpus": [{"model": "A100-40GB", "mig": [{"profile": "1g.10gb+me", "start": 0}]}]}"#,
         "gpus[0].mig: A100-40GB has no MIG profile `1g.10gb+me`"),
        (r#"{"node": "n", "gpus": [{"model": "H100-80GB"}, {"model": "B200"}]}"#,
         "gpus[1].model: unknown GPU model `B200`; known: A100-40GB, A100-80GB, H100-80GB, H200-141GB"),
        (r#"{"node": "n", "gpus": [{"model": "H100-80GB", "mig": [{"profile": "1g.10gb", "start": "x"}]}]}"#,
         "gpus[0].mig[0].start: invalid type"),
        (r#"{"node": "n", "gpus": [{"model": "H100-80GB", "migs": []}]}"#, "gpus[0].migs: unknown field `migs`, expected one of `model`, `mig`, `nvlink`, `numa_node`, `cpus`"),
        (r#"{"node": "n", "majors": {"nvidia_uvm": 195}, "gpus": [{"model": "H100-80GB"}]}"#, "majors: majors must be distinct"),
        (r#"{"node": "n", "gpus": []}"#, "gpus: a node has 1 to 64 GPUs, not 0"),
        (r#"{"node": "a/b", "gpus": [{"model": "H100-80GB"}]}"#, "node: `a/b` is not a node name"),
        (r#"{"node": "n", "sim_memory_bytes": 0, "gpus": [{"model": "H100-80GB"}]}"#, "sim_memory_bytes: 0 is not between"),
        (r#"{"node": "n""#, "EOF while parsing"),
    ];
    for (i, (text, want)) in cases.iter().enumerate() {
        let path = write(dir.path(), &format!("bad{i}.json"), text);
        let err = SimBackend::open(&path, &state).unwrap_err();
        let msg = err.to_string();
        assert!(msg.starts_with(&path.display().to_string()), "{msg}");
        assert!(msg.contains(want), "case {i}: want {want:?} in {msg}");
    }
    assert!(!state.exists(), "a bad node file materialises nothing");
    let err = SimBackend::open(&dir.path().join("missing.json"), &state).unwrap_err();
    assert!(matches!(err, BackendError::Io { .. }), "{err}");
}

#[test]
fn sim_defaults_and_a_driver_without_caps() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = write(
        dir.path(),
        "n.json",
        r#"{"node": "tiny", "majors": {"nvidia_caps": null}, "gpus": [{"model": "H200-141GB", "mig": [{"profile": "1g.18gb", "start": 3}]}, {"model": "A100-80GB", "mig": []}]}"#,
    );
    let sim = SimBackend::open(&path, &dir.path().join("state")).expect("open");
    let inv = sim.inventory().expect("inventory");
    assert_eq!(inv.majors, Majors { nvidia: 195, nvidia_uvm: 508, nvidia_caps: None });
    assert!(
        inv.gpus[1].mig_enabled && inv.gpus[1].instances.is_empty(),
        "empty mig list = MIG on, no instances"
    );
    let inst = &inv.gpus[0].instances[0];
    assert_eq!(
        (inst.profile.as_str(), inst.start, inst.size, inst.memory_mib),
        ("1g.18gb", 3, 1, 17371)
    );
    let len = std::fs::metadata(sim.memory_file(&inst.uuid)).expect("mem").len();
    assert_eq!(len, sim::DEFAULT_SIM_MEMORY_BYTES);
    let grant = choose(&inv, &BTreeSet::new(), &req("mig=1g.18gb")).expect("fits");
    assert_eq!(injection(&inv, &grant).unwrap_err(), InjectError::NoCapsMajor(inst.uuid.clone()));
    // Nothing whole to give: both GPUs are in MIG mode.
    let err = choose(&inv, &BTreeSet::new(), &req("gpu=1")).unwrap_err();
    assert!(err.to_string().contains("2 in MIG mode"), "{err}");
}

#[test]
fn sim_inventory_fails_closed_on_a_broken_mig_minors() {
    let (_dir, sim, _) = open_example("a100-40x4.json");
    std::fs::write(sim.mig_minors_path(), "config 1\nmonitor 2\ngpu0/gi1/access 12\n")
        .expect("write");
    let err = sim.inventory().unwrap_err();
    assert!(err.to_string().contains("no `gpu0/gi1/ci0/access` entry"), "{err}");
    std::fs::write(sim.mig_minors_path(), "config 1\ngpu0/gi1/acces 12\n").expect("write");
    let err = sim.inventory().unwrap_err();
    assert!(matches!(err, BackendError::Parse { .. }), "{err}");
    assert!(err.to_string().contains("mig-minors line 2"), "{err}");
}

#[test]
fn sim_realises_the_a100_example() {
    let (_dir, _sim, inv) = open_example("a100-40x4.json");
    assert_eq!(inv.node, "sim-a100-0");
    assert_eq!(inv.gpus.len(), 4);
    assert!(inv.gpus.iter().all(|g| g.model == "A100-40GB" && g.memory_mib == 40960));
    let g0: Vec<(&str, u32, u8, u8, u64)> = inv.gpus[0]
        .instances
        .iter()
        .map(|i| (i.profile.as_str(), i.gi_id, i.start, i.size, i.memory_mib))
        .collect();
    assert_eq!(g0, [("3g.20gb", 1, 0, 4, 19968), ("3g.20gb", 2, 4, 4, 19968)]);
    assert!(!inv.gpus[1].mig_enabled);
}

// ---------------------------------------------------------------- choose

#[test]
fn choose_whole_gpus_lowest_index_first() {
    let (_dir, _sim, inv) = open_example("h100x8.json");
    let none = BTreeSet::new();
    let got = choose(&inv, &none, &req("gpu=1")).expect("fits");
    assert_eq!(
        got,
        [GrantedDevice {
            uuid: inv.gpus[3].uuid.parse().expect("uuid"),
            gpu_uuid: inv.gpus[3].uuid.parse().expect("uuid"),
            gpu_index: 3,
            model: "H100-80GB".into(),
            mig_profile: None,
            placement: None,
        }]
    );
    let got = choose(&inv, &none, &req("gpu=5")).expect("fits");
    assert_eq!(got.iter().map(|d| d.gpu_index).collect::<Vec<_>>(), [3, 4, 5, 6, 7]);
    let h = held(&[&inv.gpus[3].uuid, &inv.gpus[5].uuid]);
    let got = choose(&inv, &h, &req("gpu=2")).expect("fits");
    assert_eq!(got.iter().map(|d| d.gpu_index).collect::<Vec<_>>(), [4, 6]);
    let err = choose(&inv, &h, &req("gpu=4")).unwrap_err();
    assert_eq!(err, NoFit::NotEnoughGpus { asked: 4, free: 3, whole: 5, held: 2, mig: 3 });
    assert_eq!(
        err.to_string(),
        "gpu=4: only 3 whole GPU(s) free (5 not in MIG mode, 2 of them held; 3 in MIG mode, handed out only by instance)"
    );
    assert!(choose(&inv, &none, &req("gpu=6")).is_err(), "MIG GPUs are never handed out whole");
}

#[test]
fn choose_mig_instances_lowest_gpu_and_start_first() {
    let (_dir, _sim, inv) = open_example("h100x8.json");
    let got = choose(&inv, &BTreeSet::new(), &req("mig=1g.10gb")).expect("fits");
    let g0_1g = &inv.gpus[0].instances[2];
    assert_eq!(
        got,
        [GrantedDevice {
            uuid: g0_1g.uuid.parse().expect("uuid"),
            gpu_uuid: inv.gpus[0].uuid.parse().expect("uuid"),
            gpu_index: 0,
            model: "H100-80GB".into(),
            mig_profile: Some("1g.10gb".into()),
            placement: Some((6, 1)),
        }]
    );
    let got = choose(&inv, &held(&[&g0_1g.uuid]), &req("mig=1g.10gb")).expect("fits");
    assert_eq!((got[0].gpu_index, got[0].placement), (1, Some((0, 1))));
    let got = choose(&inv, &BTreeSet::new(), &req("mig=2g.20gb")).expect("fits");
    assert_eq!((got[0].gpu_index, got[0].placement), (0, Some((4, 2))));

    let three = inv.gpus[0].instances[0].uuid.clone();
    let got = choose(&inv, &BTreeSet::new(), &req("mig=3g.40gb")).expect("fits");
    assert_eq!(got[0].uuid, three);
    let err = choose(&inv, &held(&[&three]), &req("mig=3g.40gb")).unwrap_err();
    assert_eq!(err.to_string(), "mig=3g.40gb: all 1 instances of 3g.40gb on this node are held");

    // All 1g.10gb held: 1 on gpu0, 7 on gpu1, 2 on gpu2.
    let all_1g: Vec<&str> = inv
        .gpus
        .iter()
        .flat_map(|g| &g.instances)
        .filter(|i| i.profile == "1g.10gb")
        .map(|i| i.uuid.as_str())
        .collect();
    let err = choose(&inv, &held(&all_1g), &req("mig=1g.10gb")).unwrap_err();
    assert_eq!(err, NoFit::AllHeld { profile: "1g.10gb".into(), count: 10 });

    let err = choose(&inv, &BTreeSet::new(), &req("mig=9g.99gb")).unwrap_err();
    assert_eq!(
        err.to_string(),
        "mig=9g.99gb: no GPU on this node offers MIG profile 9g.99gb; offered: 1g.10gb, 1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb"
    );
    let err = choose(&inv, &BTreeSet::new(), &req("mig=7g.80gb")).unwrap_err();
    assert_eq!(
        err.to_string(),
        "mig=7g.80gb: no 7g.80gb instance exists on this node (MIG instances: 1g.10gb x10, 2g.20gb x3, 3g.40gb x1); the MIG layout would have to change"
    );
}

#[test]
fn choose_on_the_a100_example() {
    let (_dir, _sim, inv) = open_example("a100-40x4.json");
    let first = choose(&inv, &BTreeSet::new(), &req("mig=3g.20gb")).expect("fits");
    assert_eq!(first[0].placement, Some((0, 4)));
    let second = choose(&inv, &held(&[&first[0].uuid]), &req("mig=3g.20gb")).expect("fits");
    assert_eq!(second[0].placement, Some((4, 4)));
    let err = choose(&inv, &BTreeSet::new(), &req("mig=1g.10gb")).unwrap_err();
    assert!(
        matches!(err, NoFit::NoInstance { .. }),
        "1g.10gb is an A100-40GB profile, just not realised: {err}"
    );
    let err = choose(&inv, &BTreeSet::new(), &req("mig=1g.20gb")).unwrap_err();
    assert!(
        err.to_string()
            .contains("offered: 1g.5gb, 1g.5gb+me, 1g.10gb, 2g.10gb, 3g.20gb, 4g.20gb, 7g.40gb"),
        "{err}"
    );
    let got = choose(&inv, &BTreeSet::new(), &req("gpu=3")).expect("fits");
    assert_eq!(got.iter().map(|d| d.gpu_index).collect::<Vec<_>>(), [1, 2, 3]);
}

#[test]
fn choose_refuses_sharing_kinds_for_now() {
    let (_dir, _sim, inv) = open_example("h100x8.json");
    for r in ["mps=50", "shared"] {
        let err = choose(&inv, &BTreeSet::new(), &req(r)).unwrap_err();
        assert_eq!(err, NoFit::NotSupported { request: r.into() });
        assert!(
            err.to_string().contains("MPS / time-sliced sharing is not supported yet"),
            "{err}"
        );
    }
}

#[test]
fn choose_is_deterministic_whatever_the_inventory_order() {
    let (_dir, _sim, inv) = open_example("h100x8.json");
    let mut shuffled = inv.clone();
    shuffled.gpus.reverse();
    for g in &mut shuffled.gpus {
        g.instances.reverse();
    }
    let h = held(&[&inv.gpus[1].instances[0].uuid, &inv.gpus[4].uuid]);
    for r in ["gpu=1", "gpu=3", "mig=1g.10gb", "mig=2g.20gb", "mig=3g.40gb"] {
        let a = choose(&inv, &h, &req(r)).expect("fits");
        assert_eq!(a, choose(&inv, &h, &req(r)).expect("fits"), "{r}");
        assert_eq!(a, choose(&shuffled, &h, &req(r)).expect("fits"), "{r}");
    }
}

#[test]
fn choose_skips_instances_of_a_gpu_held_whole() {
    // Defensive: should a MIG GPU's uuid ever be held, its instances are not handed out.
    let (_dir, _sim, inv) = open_example("h100x8.json");
    let got = choose(&inv, &held(&[&inv.gpus[0].uuid]), &req("mig=1g.10gb")).expect("fits");
    assert_eq!(got[0].gpu_index, 1);
}

// ---------------------------------------------------------------- injection

#[test]
fn injection_for_a_mig_instance_is_exact() {
    let (_dir, _sim, inv) = open_example("h100x8.json");
    let grant = choose(&inv, &BTreeSet::new(), &req("mig=3g.40gb")).expect("fits");
    let inj = injection(&inv, &grant).expect("inject");
    assert_eq!(
        inj.devices,
        [
            dev("/dev/nvidia-caps/nvidia-cap12", 509, 12),
            dev("/dev/nvidia-caps/nvidia-cap13", 509, 13),
            dev("/dev/nvidia-uvm", 508, 0),
            dev("/dev/nvidia-uvm-tools", 508, 1),
            dev("/dev/nvidia0", 195, 0),
            dev("/dev/nvidiactl", 195, 255),
        ]
    );
    let uuid = &grant[0].uuid;
    assert_eq!(
        inj.env,
        [format!("CUDA_VISIBLE_DEVICES={uuid}"), format!("NVIDIA_VISIBLE_DEVICES={uuid}")]
    );
    assert!(inj.mounts.is_empty());

    // A 1g on gpu1 (device minor 1): gi1 there is cap 3 + 135 + 9 = 147, ci0 148.
    let g1 = &inv.gpus[1].instances[0];
    let grant = GrantedDevice {
        uuid: g1.uuid.parse().expect("uuid"),
        gpu_uuid: inv.gpus[1].uuid.parse().expect("uuid"),
        gpu_index: 1,
        model: "H100-80GB".into(),
        mig_profile: Some("1g.10gb".into()),
        placement: Some((0, 1)),
    };
    let inj = injection(&inv, &[grant]).expect("inject");
    let paths: Vec<(&str, i64)> = inj.devices.iter().map(|d| (d.path.as_str(), d.minor)).collect();
    assert_eq!(
        paths,
        [
            ("/dev/nvidia-caps/nvidia-cap147", 147),
            ("/dev/nvidia-caps/nvidia-cap148", 148),
            ("/dev/nvidia-uvm", 0),
            ("/dev/nvidia-uvm-tools", 1),
            ("/dev/nvidia1", 1),
            ("/dev/nvidiactl", 255)
        ]
    );
}

#[test]
fn injection_for_whole_gpus_is_exact() {
    let (_dir, _sim, inv) = open_example("h100x8.json");
    let grant = choose(&inv, &BTreeSet::new(), &req("gpu=1")).expect("fits");
    let inj = injection(&inv, &grant).expect("inject");
    assert_eq!(
        inj.devices,
        [
            dev("/dev/nvidia-uvm", 508, 0),
            dev("/dev/nvidia-uvm-tools", 508, 1),
            dev("/dev/nvidia3", 195, 3),
            dev("/dev/nvidiactl", 195, 255),
        ]
    );
    let u = &inv.gpus[3].uuid;
    assert_eq!(
        inj.env,
        [format!("CUDA_VISIBLE_DEVICES={u}"), format!("NVIDIA_VISIBLE_DEVICES={u}")]
    );

    let mut grant = choose(&inv, &BTreeSet::new(), &req("gpu=2")).expect("fits");
    grant.push(grant[0].clone()); // duplicates collapse
    let inj = injection(&inv, &grant).expect("inject");
    let paths: Vec<&str> = inj.devices.iter().map(|d| d.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "/dev/nvidia-uvm",
            "/dev/nvidia-uvm-tools",
            "/dev/nvidia3",
            "/dev/nvidia4",
            "/dev/nvidiactl"
        ]
    );
    let list = format!("{},{}", inv.gpus[3].uuid, inv.gpus[4].uuid);
    assert_eq!(inj.env[0], format!("CUDA_VISIBLE_DEVICES={list}"));
}

#[test]
fn injection_fails_closed() {
    let (_dir, _sim, inv) = open_example("h100x8.json");
    assert_eq!(injection(&inv, &[]).unwrap_err(), InjectError::NoDevices);
    let mut g = choose(&inv, &BTreeSet::new(), &req("gpu=1")).expect("fits");
    g[0].uuid = "GPU-nope".parse().expect("uuid");
    assert_eq!(injection(&inv, &g).unwrap_err(), InjectError::UnknownDevice("GPU-nope".into()));
    let parent = GrantedDevice {
        uuid: inv.gpus[0].uuid.parse().expect("uuid"),
        gpu_uuid: inv.gpus[0].uuid.parse().expect("uuid"),
        gpu_index: 0,
        model: "H100-80GB".into(),
        mig_profile: None,
        placement: None,
    };
    assert_eq!(
        injection(&inv, &[parent]).unwrap_err(),
        InjectError::MigParent(inv.gpus[0].uuid.clone())
    );
    let mut g = choose(&inv, &BTreeSet::new(), &req("mig=1g.10gb")).expect("fits");
    g[0].gpu_uuid = inv.gpus[1].uuid.parse().expect("uuid");
    assert!(matches!(injection(&inv, &g).unwrap_err(), InjectError::WrongParent { .. }));
    // A cap minor that is config (1) or monitor (2) is never handed out.
    let g = choose(&inv, &BTreeSet::new(), &req("mig=1g.10gb")).expect("fits");
    let mut bad = inv.clone();
    bad.gpus[0].instances[2].ci_cap_minor = 1;
    assert_eq!(
        injection(&bad, &g).unwrap_err(),
        InjectError::BadCapMinor { uuid: g[0].uuid.to_string(), minor: 1 }
    );
    let mut no_caps = inv.clone();
    no_caps.majors.nvidia_caps = None;
    assert!(matches!(injection(&no_caps, &g).unwrap_err(), InjectError::NoCapsMajor(_)));
}

// ---------------------------------------------------------------- properties

/// An independent oracle of layout legality: slot bitmask, counts, +me, compute.
fn oracle_legal(model: &GpuModel, layout: &[(&'static str, u8)]) -> bool {
    let mut used = 0u16;
    let mut compute = 0u32;
    let mut media = 0;
    for (name, start) in layout {
        let Some(p) = model.profile(name) else { return false };
        if !p.starts.contains(start) {
            return false;
        }
        let mask = ((1u16 << p.size) - 1) << start;
        if used & mask != 0 {
            return false;
        }
        used |= mask;
        compute += u32::from(p.compute_slices);
        media += usize::from(p.is_media_extension());
        if layout.iter().filter(|(n, _)| n == name).count() > usize::from(p.max_instances) {
            return false;
        }
    }
    compute <= 7 && media <= 1
}

/// (model index, list of (profile index, start choice)) → a list of legal-start placements.
fn raw_layout() -> impl Strategy<Value = (usize, Vec<(usize, usize)>)> {
    (0..MODELS.len(), prop::collection::vec((0..7usize, 0..7usize), 0..9))
}

fn placements(model: &'static GpuModel, picks: &[(usize, usize)]) -> Vec<(&'static str, u8)> {
    picks
        .iter()
        .map(|&(p, s)| {
            let prof = &model.profiles[p % model.profiles.len()];
            (prof.name, prof.starts[s % prof.starts.len()])
        })
        .collect()
}

/// Keep each placement only if the layout so far stays legal.
fn greedy(model: &'static GpuModel, candidates: &[(&'static str, u8)]) -> Vec<(&'static str, u8)> {
    let mut out: Vec<(&'static str, u8)> = Vec::new();
    for c in candidates {
        out.push(*c);
        if placement_is_legal(model, &out).is_err() {
            out.pop();
        }
    }
    out
}

/// (model index, MIG layout candidates or `None` for MIG off).
type GpuSpec = (usize, Option<Vec<(usize, usize)>>);

fn build_inventory(specs: &[GpuSpec]) -> Inventory {
    let mut gpus = Vec::new();
    for (i, (m, mig)) in specs.iter().enumerate() {
        let model = &MODELS[*m % MODELS.len()];
        let index = i as u32;
        let minor = 7 - index; // minors need not follow indices
        let instances = match mig {
            None => Vec::new(),
            Some(picks) => greedy(model, &placements(model, picks))
                .into_iter()
                .enumerate()
                .map(|(k, (name, start))| {
                    let prof = model.profile(name).expect("catalog profile");
                    let gi = k as u32 + 1;
                    MigInstance {
                        uuid: format!("MIG-{i}-{gi}"),
                        profile: name.to_string(),
                        gi_id: gi,
                        ci_id: 0,
                        start,
                        size: prof.size,
                        memory_mib: prof.memory_mib,
                        gi_cap_minor: driver_cap_minor(minor, gi, None),
                        ci_cap_minor: driver_cap_minor(minor, gi, Some(0)),
                    }
                })
                .collect(),
        };
        gpus.push(Gpu {
            index,
            uuid: format!("GPU-{i}"),
            model: model.name.to_string(),
            minor,
            memory_mib: model.memory_mib,
            mig_enabled: mig.is_some(),
            instances,
        });
    }
    Inventory {
        node: "prop".into(),
        gpus,
        majors: Majors { nvidia: 195, nvidia_uvm: 508, nvidia_caps: Some(509) },
    }
}

fn request() -> impl Strategy<Value = GpuRequest> {
    let profile_names: Vec<&'static str> =
        MODELS.iter().flat_map(|m| m.profiles.iter().map(|p| p.name)).chain(["9g.99gb"]).collect();
    prop_oneof![
        (1u32..6).prop_map(|count| GpuRequest::Gpu { count }),
        prop::sample::select(profile_names)
            .prop_map(|p| GpuRequest::Mig { profile: p.to_string() }),
        Just(GpuRequest::Shared),
        (1u8..=100).prop_map(|percent| GpuRequest::Mps { percent }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, .. ProptestConfig::default() })]

    #[test]
    fn placement_is_legal_agrees_with_an_independent_oracle((m, picks) in raw_layout()) {
        let model = &MODELS[m];
        let layout = placements(model, &picks);
        prop_assert_eq!(placement_is_legal(model, &layout).is_ok(), oracle_legal(model, &layout), "{:?}", layout);
    }

    #[test]
    fn greedy_layouts_never_overlap((m, picks) in raw_layout()) {
        let model = &MODELS[m];
        let layout = greedy(model, &placements(model, &picks));
        prop_assert!(placement_is_legal(model, &layout).is_ok());
        let mut slots = [0u8; 8];
        for (name, start) in &layout {
            let size = model.profile(name).map(|p| p.size).unwrap_or(0);
            for s in *start..start + size {
                slots[usize::from(s)] += 1;
            }
        }
        prop_assert!(slots.iter().all(|&n| n <= 1), "{:?}", layout);
        // Order does not matter to legality.
        let mut reversed = layout.clone();
        reversed.reverse();
        prop_assert!(placement_is_legal(model, &reversed).is_ok());
    }

    #[test]
    fn choose_never_returns_held_or_mig_parent_devices(
        specs in prop::collection::vec(
            (0..MODELS.len(), prop::option::of(prop::collection::vec((0..7usize, 0..7usize), 0..9))),
            1..6,
        ),
        held_bits in prop::collection::vec(any::<bool>(), 64),
        req in request(),
    ) {
        let inv = build_inventory(&specs);
        let all: Vec<String> = inv.gpus.iter()
            .flat_map(|g| std::iter::once(g.uuid.clone()).chain(g.instances.iter().map(|i| i.uuid.clone())))
            .collect();
        let held: BTreeSet<String> = all.iter().zip(held_bits.iter().cycle()).filter(|(_, &h)| h).map(|(u, _)| u.clone()).collect();
        match choose(&inv, &held, &req) {
            Ok(devices) => {
                prop_assert!(!devices.is_empty());
                let distinct: BTreeSet<&str> = devices.iter().map(|d| d.uuid.as_str()).collect();
                prop_assert_eq!(distinct.len(), devices.len());
                for d in &devices {
                    prop_assert!(!held.contains(d.uuid.as_str()), "held device {} handed out", d.uuid);
                    prop_assert!(!held.contains(d.gpu_uuid.as_str()), "device of a held GPU {} handed out", d.gpu_uuid);
                    match inv.find(&d.uuid) {
                        Some(Found::Gpu(g)) => prop_assert!(!g.mig_enabled, "MIG parent {} handed out whole", g.uuid),
                        Some(Found::Mig(g, i)) => {
                            prop_assert_eq!(&g.uuid, &d.gpu_uuid);
                            prop_assert_eq!(Some(i.profile.clone()), d.mig_profile.clone());
                        }
                        None => prop_assert!(false, "unknown device {}", d.uuid),
                    }
                }
                match &req {
                    GpuRequest::Gpu { count } => prop_assert_eq!(devices.len(), *count as usize),
                    GpuRequest::Mig { .. } => prop_assert_eq!(devices.len(), 1),
                    _ => prop_assert!(false, "sharing kinds are not supported yet"),
                }
                prop_assert_eq!(choose(&inv, &held, &req), Ok(devices.clone()), "deterministic");
                let inj = injection(&inv, &devices);
                prop_assert!(inj.is_ok(), "{:?}", inj);
                let inj = inj.unwrap_or_default();
                for node in &inj.devices {
                    prop_assert!(node.path != "/dev/nvidia-caps/nvidia-cap1" && node.path != "/dev/nvidia-caps/nvidia-cap2");
                }
            }
            Err(NoFit::NotEnoughGpus { free, .. }) => {
                let free_whole = inv.gpus.iter().filter(|g| !g.mig_enabled && !held.contains(&g.uuid)).count();
                prop_assert_eq!(free, free_whole);
                if let GpuRequest::Gpu { count } = req { prop_assert!(free_whole < count as usize); }
            }
            Err(NoFit::AllHeld { profile, .. }) | Err(NoFit::NoInstance { profile, .. }) => {
                let free = inv.gpus.iter().filter(|g| g.mig_enabled && !held.contains(&g.uuid))
                    .flat_map(|g| &g.instances)
                    .any(|i| i.profile == profile && !held.contains(&i.uuid));
                prop_assert!(!free);
            }
            Err(NoFit::UnknownProfile { profile, .. }) => {
                let offered = inv.gpus.iter().any(|g| catalog::model(&g.model).is_some_and(|m| m.profile(&profile).is_some()));
                prop_assert!(!offered);
            }
            Err(NoFit::NoRoom { .. }) => prop_assert!(false, "choose never plans placements"),
            Err(NoFit::NotSupported { .. }) => {
                let sharing = matches!(req, GpuRequest::Mps { .. } | GpuRequest::Shared);
                prop_assert!(sharing);
            }
            Err(NoFit::BadUuid(u)) => prop_assert!(false, "the generated UUIDs are valid: {u}"),
        }
    }
}

#[test]
fn a_device_whose_driver_uuid_is_not_one_is_never_granted() {
    // The driver's word is the inventory's: a GPU or MIG instance whose UUID is not a
    // `GPU-…`/`MIG-…` name (here with a newline and a slash) is refused by name, never
    // granted under a string the store, the ledger and the unquarantine route could not
    // find it by again.
    let (_dir, _sim, mut inv) = open_example("h100x8.json");
    for g in &mut inv.gpus {
        g.uuid = format!("{}\n/../x", g.uuid);
    }
    let err = choose(&inv, &BTreeSet::new(), &req("gpu=1")).expect_err("refused");
    assert!(matches!(err, NoFit::BadUuid(_)), "{err:?}");
    let text = err.to_string();
    assert!(text.starts_with("the driver reports a device UUID Tessera does not accept"), "{text}");
    assert!(text.contains("\\n"), "escaped: {text}");
    // A well-formed inventory is granted as before.
    let (_dir, _sim, inv) = open_example("h100x8.json");
    let g = choose(&inv, &BTreeSet::new(), &req("gpu=1")).expect("fits");
    assert!(inv.gpus.iter().any(|x| g[0].uuid == x.uuid), "{g:?}");
}
