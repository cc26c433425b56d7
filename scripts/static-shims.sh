#!/usr/bin/env bash
# Builds the two binaries every GPU container start spawns — tessera-runtime (once per
# runc verb the engine runs) and tessera-hook (runc's prestart hook) — statically linked
# (`-C target-feature=+crt-static`: no ld.so, no libgcc_s/libc.so to map and relocate), and
# puts them in DIR with a normal (dynamic) tesserad and tessera beside them. tesserad stays
# dynamic: it dlopens NVML, which a static glibc cannot do safely.
#
#   scripts/static-shims.sh DIR
#   TESSERA_BENCH_BINS=DIR cargo bench --bench runtime_overhead -- 100 --wrapper-only
#
# docs/PERFORMANCE.md ("Issue 29: where the rest goes, and what was tried") has what it
# saves. Cargo cannot give one binary of a package its own target features, so this is a
# second build step; `cargo build` afterwards builds the two binaries dynamic again.
set -euo pipefail
dir=${1:?usage: scripts/static-shims.sh DIR}
cd "$(dirname "$0")/.."
mkdir -p "$dir"
target=${CARGO_TARGET_DIR:-target}
cargo build --release --locked --bin tesserad --bin tessera
cp "$target/release/tesserad" "$target/release/tessera" "$dir/"
for bin in tessera-runtime tessera-hook; do
    cargo rustc --release --locked -p tessera --bin "$bin" -- -C target-feature=+crt-static
    cp "$target/release/$bin" "$dir/"
    # A dynamic one here would measure nothing new: refuse it.
    if readelf -l "$dir/$bin" | grep -q INTERP; then
        echo "static-shims: $dir/$bin is dynamically linked" >&2
        exit 1
    fi
done
echo "static tessera-runtime and tessera-hook (and dynamic tesserad, tessera) in $dir"
