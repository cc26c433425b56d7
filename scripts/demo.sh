#!/usr/bin/env bash
# Tessera's main job on an embedded default: a simulated 8x H100 node (some GPUs in MIG
# mode), tesserad deciding by examples/policy.json, and real runc containers of tenants of
# different trust asking for whole GPUs, MIG instances, MPS shares and time-sliced
# replicas through tessera-runtime. Shows what each container got, what was refused and
# why, the node's status, the scrub of every released device, and the GPU-seconds each
# tenant used; then cleans everything up. Needs root (real containers).
#
# MPS runs through fake-nvidia-cuda-mps-control, a test double that speaks the documented
# control protocol (the real nvidia-cuda-mps-control needs an NVIDIA driver).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
tessera_as_root scripts/demo.sh "$@"
tessera_ensure_deps

cargo build --locked --workspace --bins -q
BIN=$PWD/target/debug
WORK=$(mktemp -d /tmp/tessera-demo.XXXXXX)
SOCK=$WORK/tesserad.sock
ROOT=$WORK/runc
CG=tessera-demo-$$
export TESSERA_SOCKET=$SOCK TESSERA_RUNC=$(command -v runc) TESSERA_HOOK=$BIN/tessera-hook

cleanup() {
    set +e
    for id in $(runc --root "$ROOT" list -q 2>/dev/null); do runc --root "$ROOT" delete -f "$id" >/dev/null 2>&1; done
    [ -n "${DAEMON:-}" ] && kill "$DAEMON" 2>/dev/null && wait "$DAEMON" 2>/dev/null
    # MPS control daemons of the demo (the test double), if any survived their containers.
    for p in $(pgrep -f fake-nvidia-cuda-mps-control); do
        tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -q "$WORK" && kill "$p" 2>/dev/null
    done
    for c in /sys/fs/cgroup/*/"$CG"; do [ -d "$c" ] && find "$c" -depth -type d -exec rmdir {} \; 2>/dev/null; done
    rm -rf "$WORK"
}
trap cleanup EXIT

say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

say "starting tesserad on a simulated 8x H100-80GB node"
"$BIN/tesserad" --node sim:examples/nodes/h100x8.json --policy examples/policy.json \
    --state-dir "$WORK/state" --socket "$SOCK" \
    --mps-control "$BIN/fake-nvidia-cuda-mps-control" 2>"$WORK/tesserad.log" &
DAEMON=$!
for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.05; done
"$BIN/tessera" policy validate examples/policy.json

# A busybox rootfs shared by every container (read-only root).
mkdir -p "$WORK/rootfs"/{bin,dev,proc,sys,tmp,etc}
cp /bin/busybox "$WORK/rootfs/bin/busybox"
for t in sh ls cat echo sleep; do ln -s busybox "$WORK/rootfs/bin/$t"; done

# bundle ID NAMESPACE REQUEST: write a bundle whose container shows its GPU devices.
bundle() {
    local id=$1 ns=$2 req=$3 b=$WORK/bundles/$1 ann=""
    mkdir -p "$b"
    [ -n "$req" ] && ann="\"tessera.io/gpu\": \"$req\","
    cat >"$b/config.json" <<JSON
{
  "ociVersion": "1.0.2",
  "process": {
    "terminal": false, "user": {"uid": 0, "gid": 0}, "cwd": "/",
    "args": ["sh", "-c", "echo \"[\$(hostname)] CUDA_VISIBLE_DEVICES=\$CUDA_VISIBLE_DEVICES \${CUDA_MPS_PIPE_DIRECTORY:+CUDA_MPS_PIPE_DIRECTORY=\$CUDA_MPS_PIPE_DIRECTORY}\"; ls -l /dev/nvidia* /dev/nvidia-caps/* 2>/dev/null | sed 's/^/    /'; sleep 600"],
    "env": ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=all", "LD_PRELOAD=/tmp/evil.so"],
    "noNewPrivileges": true
  },
  "root": {"path": "$WORK/rootfs", "readonly": true},
  "hostname": "$id",
  "annotations": {$ann "io.kubernetes.cri.sandbox-namespace": "$ns"},
  "mounts": [
    {"destination": "/proc", "type": "proc", "source": "proc"},
    {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
    {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev"]},
    {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]}
  ],
  "linux": {
    "cgroupsPath": "/$CG/$id",
    "resources": {"devices": [{"allow": false, "access": "rwm"}]},
    "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "network"}]
  }
}
JSON
}

# run ID NAMESPACE REQUEST: start a container through tessera-runtime (as containerd would).
run() {
    bundle "$1" "$2" "$3"
    if "$BIN/tessera-runtime" --root "$ROOT" run -d --bundle "$WORK/bundles/$1" "$1" \
        >"$WORK/$1.out" 2>"$WORK/$1.err" </dev/null; then
        sleep 0.3
        echo "$1 ($2, ${3:-no request}): started"
        cat "$WORK/$1.out"
    else
        echo "$1 ($2, ${3:-no request}): REFUSED"
        sed 's/^/    /' "$WORK/$1.err"
    fi
}

say "three tenants of different trust ask for GPUs (their images also set NVIDIA_VISIBLE_DEVICES=all and LD_PRELOAD: ignored)"
run untrusted-mig team-untrusted mig=1g.10gb
run trusted-gpus  team-trusted   gpu=2
run dev-mig       team-dev       mig=3g.40gb
run plain         team-dev       ""

say "trusted tenants share one GPU through MPS, each with its own capped control daemon"
run alice-mps     team-trusted   mps=50
run carol-mps     team-research  mps=25

say "dev tenants time-slice a GPU, only within their sharing domain"
run bob-shared-1  team-dev       shared
run bob-shared-2  team-dev       shared

say "what the policy refuses, and why"
run untrusted-mps team-untrusted mps=25
run spoofed       team-nobody    gpu=1
run too-big       team-trusted   gpu=8

say "tessera status"
"$BIN/tessera" status

say "stopping the containers: tessera-runtime's delete frees their devices, and each is scrubbed"
for id in $(runc --root "$ROOT" list -q); do "$BIN/tessera-runtime" --root "$ROOT" delete -f "$id"; done
sleep 1
"$BIN/tessera" status | grep -E "^node|allocation|free after scrub|quarantined|dirty" | head -12

say "GPU-seconds per user, from the ledger (time x fraction of a GPU, priced by the policy)"
"$BIN/tessera" usage --from -10m --by user
