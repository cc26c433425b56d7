#!/usr/bin/env bash
# Installs the node's four binaries into PREFIX/bin (default /usr/local): tesserad and
# tessera, and tessera-runtime and tessera-hook linked static (scripts/static-shims.sh; they
# start on every container start). All four or none, each replaced by rename (a running
# tesserad keeps its file). `cargo install --path . --locked --root PREFIX` installs the
# same four, all dynamically linked.
#
#   scripts/install.sh [PREFIX]
set -euo pipefail
prefix=${1:-/usr/local}
install -d -- "$prefix/bin"
"$(dirname "$0")/static-shims.sh" "$prefix/bin"
