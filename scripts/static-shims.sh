#!/usr/bin/env bash
# The node's binaries as they are installed: tessera-runtime (started once per runc verb an
# engine runs) and tessera-hook (runc's prestart hook on `runc run`) linked static
# (`-C target-feature=+crt-static`: no ld.so, no libc.so or libgcc_s to map and relocate,
# about 0.3 ms less per process: docs/PERFORMANCE.md, issue 29), tesserad and tessera as
# cargo links them (tesserad dlopens NVML, which a static glibc cannot do safely).
#
#   scripts/static-shims.sh DIR          release build: the four node binaries in DIR
#                                         (scripts/install.sh, the benchmark)
#   scripts/static-shims.sh --dev DIR    dev build: the two static shims in DIR and a link to
#                                         every other binary of target/debug (scripts/test.sh
#                                         runs the suite on DIR: TESSERA_BIN_DIR)
#
# Cargo cannot give one binary of a package its own target features, so this is a second
# build step: `cargo rustc` relinks the binary static in target/<profile>/ and the copy in
# DIR is kept; the next `cargo build` links the one in target/ dynamic again.
set -euo pipefail
profile=release
if [ "${1:-}" = "--dev" ]; then
    profile=dev
    shift
fi
dir=${1:?usage: scripts/static-shims.sh [--dev] DIR}
cd "$(dirname "$0")/.."
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
target=${CARGO_TARGET_DIR:-target}
out=$target/$([ "$profile" = dev ] && echo debug || echo release)
if [ "$profile" = release ]; then
    cargo build --release --locked --bin tesserad --bin tessera
    for bin in tesserad tessera; do
        # `install` unlinks first: a running tesserad's file is replaced, not written into.
        install -m 0755 "$out/$bin" "$dir/$bin"
    done
else
    # Everything the tests run, as cargo built it; the shims are replaced below.
    for f in "$out"/*; do
        name=$(basename "$f")
        if [ -f "$f" ] && [ -x "$f" ] && [ "$name" != tessera-runtime ] && [ "$name" != tessera-hook ]; then
            ln -sfn "$(cd "$out" && pwd)/$name" "$dir/$name"
        fi
    done
fi
for bin in tessera-runtime tessera-hook; do
    cargo rustc --profile "$profile" --locked -p tessera --bin "$bin" -- -C target-feature=+crt-static
    install -m 0755 "$out/$bin" "$dir/$bin"
    # A dynamic one would not be what is installed: refuse it.
    if ! head -c 4 "$dir/$bin" | grep -q ELF || readelf -l "$dir/$bin" | grep -q INTERP; then
        echo "static-shims: $dir/$bin is not a static executable" >&2
        exit 1
    fi
done
echo "static-shims: static tessera-runtime and tessera-hook in $dir ($profile)"
