#!/usr/bin/env bash
# The checks that need a GPU (docs/GPU.md), in two halves, so a lent GPU machine (which
# has no Rust toolchain and no network) needs one call:
#
#   bash scripts/gpu-checks.sh build          # here: build, stage the binaries in .gpu/
#   bash scripts/gpu-checks.sh run [DIR]      # there (carry .gpu): results in DIR, else $OUT
#
# Read-only for the GPU's configuration: it never changes MIG mode or layout, never resets
# the GPU, never changes persistence or compute mode, clocks or power limits (the telemetry,
# topology and XID-event steps 07-09 only read). It allocates, memsets and runs
# kernels (the scrub and its benchmark), and starts an MPS control daemon on a pipe
# directory of its own only if nvidia-cuda-mps-control is installed.
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=.gpu

build() {
    set -e
    grep -qx "/$STAGE/" .git/info/exclude 2>/dev/null || echo "/$STAGE/" >>.git/info/exclude
    mkdir -p "$STAGE"
    cargo build --release --bins -p tessera
    local tests
    # slicer's unit-test binary: the ignored NVML checks run below. It also holds the
    # backend conformance suite (slicer::conformance is compiled only into slicer's tests or
    # with its `conformance` feature), which this script never runs: it re-cuts MIG.
    tests=$(cargo test --release -p slicer --lib --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        print(m["executable"])' | tail -1)
    [ -n "$tests" ] || { echo "gpu-checks: no slicer test binary found" >&2; exit 1; }
    cp target/release/tessera "$STAGE/tessera"
    cp target/release/tesserad "$STAGE/tesserad"
    cp "$tests" "$STAGE/slicer-tests"
    du -sh "$STAGE"
    echo "staged in $STAGE/: carry it, then run: bash scripts/gpu-checks.sh run"
}

# step NAME CMD...: runs CMD, its output (and exit code) into DIR/NAME.txt.
step() {
    local name=$1
    shift
    echo "== $name: $*"
    { echo "\$ $*"; "$@"; echo "exit: $?"; } >"$DIR/$name.txt" 2>&1
    tail -n 30 "$DIR/$name.txt"
}

mps_probe() {
    if ! command -v nvidia-cuda-mps-control >/dev/null; then
        echo "nvidia-cuda-mps-control: not installed"
        return 0
    fi
    local pipe log uuid
    pipe=$(mktemp -d /tmp/tessera-mps-pipe.XXXXXX)
    log=$(mktemp -d /tmp/tessera-mps-log.XXXXXX)
    uuid=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
    export CUDA_MPS_PIPE_DIRECTORY=$pipe CUDA_MPS_LOG_DIRECTORY=$log CUDA_VISIBLE_DEVICES=$uuid
    nvidia-cuda-mps-control -d || { echo "could not start the control daemon"; return 0; }
    for cmd in get_server_list "set_default_active_thread_percentage 50" \
        get_default_active_thread_percentage "set_default_device_pinned_mem_limit $uuid 4G" \
        "get_default_device_pinned_mem_limit $uuid"; do
        echo "> $cmd"
        echo "$cmd" | timeout 10 nvidia-cuda-mps-control
        echo "(exit $?)"
    done
    # Issue 11: a CUDA client through a read-only bind of the pipe dir (as containers get
    # it), then the caps of the server it started (the health check compares them).
    # (The pattern must not be 0: gpu-bench refuses it. 2026-11-28's first run passed 0x0,
    # so its client never ran.)
    echo "> CUDA client with the pipe dir read-only"
    ls -la "$pipe"
    unshare -m sh -c "mount --bind '$pipe' '$pipe' && mount -o remount,bind,ro '$pipe' &&
        touch '$pipe/probe' 2>&1; timeout 60 '$STAGE/tessera' gpu-bench fill 0xA5A5A5A5 --device $uuid"
    echo "(exit $?)"
    ls -la "$pipe"
    echo "> get_server_list after the read-only client"
    echo get_server_list | timeout 10 nvidia-cuda-mps-control
    echo "> CUDA client with the pipe dir read-write"
    timeout 60 "$STAGE/tessera" gpu-bench fill 0xA5A5A5A5 --device "$uuid"
    echo "(exit $?)"
    local server
    server=$(echo get_server_list | timeout 10 nvidia-cuda-mps-control | head -1)
    echo "server: ${server:-none}"
    if [ -n "$server" ]; then
        for cmd in "get_active_thread_percentage $server" "get_device_pinned_mem_limit $server $uuid"; do
            echo "> $cmd"
            echo "$cmd" | timeout 10 nvidia-cuda-mps-control
            echo "(exit $?)"
        done
    fi
    echo quit | timeout 10 nvidia-cuda-mps-control
    sleep 1
    cat "$log/control.log" 2>/dev/null | tail -20
    rm -rf "$pipe" "$log"
}

# tesserad itself on the real driver (--node nvml), the real MPS control binary and the
# real scrub child, on a state dir and socket of its own: what it says of the GPU, its
# telemetry through `tessera top`, its metrics and CDI spec; then stopped. Read-only for
# the GPU's configuration like the rest (it creates no MIG instance: none is asked for).
daemon_probe() {
    local d mps pid
    d=$(mktemp -d /tmp/tessera-daemon.XXXXXX)
    mps=$(command -v nvidia-cuda-mps-control || echo nvidia-cuda-mps-control)
    "$STAGE/tesserad" --node nvml --policy examples/policy.json --state-dir "$d/state" \
        --socket "$d/sock" --mps-control "$mps" --scrub-exe "$PWD/$STAGE/tessera" \
        --metrics 127.0.0.1:9400 --cdi-spec-dir "$d/cdi" >"$d/log" 2>&1 &
    pid=$!
    for _ in $(seq 1 100); do
        [ -S "$d/sock" ] && break
        sleep 0.1
    done
    local t=("$STAGE/tessera" --socket "$d/sock")
    echo "> tessera version --json"
    "${t[@]}" version --json
    echo "> tessera status"
    "${t[@]}" status
    "${t[@]}" status --json
    sleep 3 # two telemetry reads (1 s apart by default) and a scrub pass
    echo "> tessera top --json"
    "${t[@]}" top --json
    echo "> /metrics (tessera_*)"
    python3 -c 'import urllib.request; print(urllib.request.urlopen("http://127.0.0.1:9400/metrics", timeout=5).read().decode())' |
        grep -E '^tessera_' | head -60
    echo "> CDI spec"
    head -60 "$d/cdi/tessera.yaml"
    kill "$pid"
    wait "$pid"
    echo "tesserad exit: $?"
    echo "> tesserad log"
    tail -60 "$d/log"
    rm -rf "$d"
}

run() {
    DIR=${1:-${OUT:-/tmp/tessera-gpu-checks}}
    mkdir -p "$DIR"
    [ -x "$STAGE/tessera" ] || { echo "gpu-checks: $STAGE/tessera missing: run 'build' here and carry $STAGE" >&2; exit 1; }
    step 00-device bash -c 'date -u; nvidia-smi -L; nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,memory.used,mig.mode.current,ecc.mode.current --format=csv'
    step 01-nvml-inventory "$STAGE/slicer-tests" --ignored --nocapture --test-threads 1 nvml_prints_the_inventory
    step 02-mig-profiles "$STAGE/slicer-tests" --ignored --nocapture --test-threads 1 nvml_driver_profiles_against_the_catalog
    local uuid
    uuid=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
    # Issue 5 (a): scrub bandwidth vs a plain cuMemsetD32 on the same buffer, same run.
    step 03-scrub-bandwidth "$STAGE/tessera" gpu-bench peak --device "$uuid" --reps 5
    # Issue 5 (b): a pattern left by one process, counted by the next: without, then with a scrub.
    step 04-leak-without-scrub bash -c "'$STAGE/tessera' gpu-bench fill 0xDEADBEEF --device $uuid && '$STAGE/tessera' gpu-bench count 0xDEADBEEF --device $uuid"
    step 05-leak-with-scrub bash -c "'$STAGE/tessera' gpu-bench fill 0xDEADBEEF --device $uuid && '$STAGE/tessera' scrub --device $uuid --json && '$STAGE/tessera' gpu-bench count 0xDEADBEEF --device $uuid --expect-zero"
    step 06-mps-protocol mps_probe
    # Issue 26, read-only: NVML telemetry (GPM where Hopper), per-process utilisation,
    # topology, device health and the XID event set (drained, never injected); and what
    # nvidia-smi says of the same, to compare.
    step 07-telemetry-topology-events "$STAGE/slicer-tests" --ignored --nocapture --test-threads 1 nvml_telemetry_topology_and_events
    step 08-smi-topology bash -c 'nvidia-smi topo -m; for b in /sys/bus/pci/devices/*; do [ -e "$b/numa_node" ] && grep -qi 0x10de "$b/vendor" 2>/dev/null && echo "$(basename "$b") numa $(cat "$b/numa_node") cpus $(cat "$b/local_cpulist")"; done'
    step 09-smi-telemetry bash -c 'nvidia-smi --query-gpu=index,uuid,utilization.gpu,utilization.memory,power.draw,clocks.sm,clocks.mem,ecc.errors.corrected.volatile.total,ecc.errors.uncorrected.volatile.total,pcie.link.gen.current --format=csv; nvidia-smi --query-gpu=clocks_event_reasons.active --format=csv || nvidia-smi --query-gpu=clocks_throttle_reasons.active --format=csv; nvidia-smi nvlink --status; nvidia-smi -q -d ROW_REMAPPER,PAGE_RETIREMENT'
    step 10-tesserad daemon_probe
    echo "results in $DIR"
}

case "${1:-}" in
build) build ;;
run) run "${2:-}" ;;
daemon)
    # The tesserad step alone (10), into DIR.
    DIR=${2:-${OUT:-/tmp/tessera-gpu-checks}}
    mkdir -p "$DIR"
    step 10-tesserad daemon_probe
    ;;
mps)
    # The MPS step alone (06), into DIR.
    DIR=${2:-${OUT:-/tmp/tessera-gpu-checks}}
    mkdir -p "$DIR"
    step 06-mps-protocol mps_probe
    ;;
*)
    echo "usage: bash scripts/gpu-checks.sh build | run [DIR] | mps [DIR] | daemon [DIR]" >&2
    exit 2
    ;;
esac
