//! What the attack-round tests (`tests/attack_round*.rs`) share: a container created and
//! started through the runtime, a GPU container to attack, the busybox script that reads
//! its memory, and a runc that stands for a racer.

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use crate::node::Node;
use crate::{Bundle, OutputExt, RUNC};

/// `create` then `start` through the node's runtime; the stderr of the first that failed.
pub fn create_and_start(node: &Node, b: &Bundle, id: &str) -> Result<(), String> {
    let out = node.fx.create_container(b, id);
    if !out.status.success() {
        return Err(out.stderr_str());
    }
    let out = node.fx.start_container(id);
    if !out.status.success() {
        return Err(out.stderr_str());
    }
    Ok(())
}

/// A runc for `TESSERA_RUNC` that stands for a racer: at `verb`, after tessera-runtime's
/// checks and before runc runs, each path of `swaps` (in a directory the attacker writes,
/// a bind source of the config) is replaced with a link to its target; then the real runc
/// runs.
pub fn racing_runc(b: &Bundle, verb: &str, swaps: &[(&Path, &Path)]) -> PathBuf {
    let racer = b.dir().join(format!("racing-runc-{verb}"));
    let mut swap = String::new();
    for (v, t) in swaps {
        swap.push_str(&format!("rm -rf {v} && ln -s {t} {v}; ", v = v.display(), t = t.display()));
    }
    fs::write(
        &racer,
        format!(
            "#!/bin/sh\nfor a in \"$@\"; do [ \"$a\" = {verb} ] && {{ {swap} }}; done\n\
             exec {RUNC} \"$@\"\n"
        ),
    )
    .expect("write the racer");
    fs::set_permissions(&racer, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("make the racer executable");
    racer
}

/// A read-only recursive bind of `source` at `destination`.
pub fn ro_bind(source: &Path, destination: &str) -> Value {
    json!({"destination": destination, "type": "bind", "source": source.to_str().expect("utf-8"),
           "options": ["rbind", "ro"]})
}

/// The busybox script that reads a process's first mapping through its procfs directory
/// `dir` (`/hostproc/<pid>`, a bind of `/proc/<pid>`), 16 bytes from its `mem` (attach
/// mode, as `pidfd_getfd`); prints (and leaves in `/tmp/read`) how many it read.
pub fn read_mem(dir: &str) -> String {
    format!(
        "a=$(head -n1 {dir}/maps | cut -d- -f1); \
         dd if={dir}/mem of=/tmp/stolen bs=1 skip=$((0x$a)) count=16 2>/dev/null; \
         wc -c < /tmp/stolen > /tmp/read; cat /tmp/read"
    )
}

/// A GPU container of team-trusted (`victim`, `gpu=1`, `sleep 300`) created and started;
/// its init's pid.
pub fn victim(node: &Node) -> i32 {
    let mut victim = node.bundle("victim", "team-trusted", Some("gpu=1"), &["sleep", "300"]);
    victim.write();
    create_and_start(node, &victim, "victim").expect("the GPU container runs");
    node.fx.container_pid("victim").expect("the GPU container's pid")
}

/// A count a script printed; 0 where it printed none.
pub fn count(s: &str) -> u64 {
    s.trim().parse().unwrap_or(0)
}
