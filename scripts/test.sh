#!/usr/bin/env bash
# The whole test suite: unit, property and end-to-end tests against real runc,
# containerd and SQLite. Needs root (runc and containerd run real containers).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
tessera_ensure_deps
if [ "$(id -u)" -ne 0 ]; then
    echo "scripts/test.sh: the end-to-end tests run real containers and need root (try: sudo bash scripts/test.sh)" >&2
    exit 1
fi
cargo build --locked --bins
cargo test --workspace --locked "$@"
