#!/usr/bin/env bash
# The whole test suite: unit, property and end-to-end tests against real runc,
# containerd and SQLite. Needs root (runc and containerd run real containers).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
tessera_as_root scripts/test.sh "$@"
tessera_ensure_deps
cargo build --locked --bins
cargo test --workspace --locked "$@"
