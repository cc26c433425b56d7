#!/usr/bin/env bash
# The whole test suite: formatting, lints, then unit, property and end-to-end tests against real runc,
# containerd and SQLite. Needs root (runc and containerd run real containers).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/deps.sh
tessera_as_root scripts/test.sh "$@"
tessera_ensure_deps
# Habits that hold themselves: an unformatted file or a lint fails the run.
cargo fmt --all --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo build --locked --workspace --bins
# The suite runs the shims as scripts/install.sh installs them: linked static.
scripts/static-shims.sh --dev target/shipped
export TESSERA_BIN_DIR="$PWD/target/shipped"
cargo test --workspace --locked "$@"
