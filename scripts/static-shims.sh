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
#
# All or nothing: every binary is built and checked (a shim must come out static) into a
# staging directory inside DIR first; only then is each renamed into place, so a failed
# build leaves DIR as it was, and a running tesserad's or a starting shim's file is replaced
# by rename, never unlinked or written into. A relative DIR is the caller's.
set -euo pipefail
# `exe=$(built ...)`: a failure inside the substitution ends the script too.
shopt -s inherit_errexit
profile=release
if [ "${1:-}" = "--dev" ]; then
    profile=dev
    shift
fi
dir=${1:?usage: scripts/static-shims.sh [--dev] DIR}
mkdir -p -- "$dir"
dir=$(cd -- "$dir" && pwd)
cd "$(dirname "$0")/.."
stage=$(mktemp -d "$dir/.static-shims.XXXXXX")
trap 'rm -rf -- "$stage"' EXIT

# The path of the executable cargo just built (from its JSON messages: wherever a
# build.target-dir, CARGO_TARGET_DIR or --target put it, never a stale one).
built() { # BIN, then the cargo command line: cargo SUBCOMMAND ARGS...
    local bin=$1 exe
    shift
    exe=$("$1" "$2" --message-format=json-render-diagnostics "${@:3}" |
        sed -n 's|.*"executable":"\([^"]*/'"$bin"'\)".*|\1|p' | tail -n 1)
    if [ -z "$exe" ] || [ ! -f "$exe" ]; then
        echo "static-shims: cargo named no executable for $bin" >&2
        exit 1
    fi
    cp -- "$exe" "$stage/$bin"
    chmod 0755 "$stage/$bin"
    echo "$exe"
}

for bin in tessera-runtime tessera-hook; do
    exe=$(built "$bin" cargo rustc --profile "$profile" --locked -p tessera --bin "$bin" \
        -- -C target-feature=+crt-static)
    # A dynamic one would not be what is installed: refuse it (fail closed: readelf must
    # read the program headers, and a static executable has no PT_INTERP).
    if ! headers=$(readelf -lW "$stage/$bin" 2>&1); then
        echo "static-shims: $exe is not an ELF executable: $headers" >&2
        exit 1
    fi
    case $headers in
    *INTERP*) ;;
    *LOAD*) continue ;;
    esac
    echo "static-shims: $exe is not a static executable" >&2
    exit 1
done
if [ "$profile" = release ]; then
    for bin in tesserad tessera; do
        built "$bin" cargo build --release --locked --bin "$bin" >/dev/null
    done
else
    # Everything the tests run, as cargo built it (beside the shims).
    out=$(cd "$(dirname "$exe")" && pwd)
    for f in "$out"/*; do
        name=$(basename "$f")
        if [ -f "$f" ] && [ -x "$f" ] && [ "$name" != tessera-runtime ] && [ "$name" != tessera-hook ]; then
            ln -sfn "$f" "$stage/$name"
        fi
    done
fi
for f in "$stage"/*; do
    mv -f -- "$f" "$dir/"
done
echo "static-shims: static tessera-runtime and tessera-hook in $dir ($profile)"
