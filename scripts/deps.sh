# shellcheck shell=bash
# Installs the Debian packages Tessera's demo and tests use, if any is missing.
# Sourced by scripts/demo.sh and scripts/test.sh.

# protobuf-compiler and libprotobuf-dev (protoc's well-known types, only a recommendation
# of protobuf-compiler, so skipped by --no-install-recommends): the coordinator's etcd client.
# docker.io (dockerd 20.10) and podman (4.3): tests/docker.rs and tests/podman.rs run them with
# the runtime that `tessera setup docker` / `tessera setup podman` writes.
TESSERA_APT_PACKAGES=(runc containerd busybox-static protobuf-compiler libprotobuf-dev etcd-server sqlite3 gcc docker.io podman systemd)

# Run the calling script as root: as it is when already root, else again through sudo,
# keeping PATH (rustup's cargo lives in the user's ~/.cargo/bin). Usage:
# tessera_as_root "$0" "$@"
tessera_as_root() {
    [ "$(id -u)" -eq 0 ] && return 0
    local script=$1
    shift
    command -v sudo >/dev/null || { echo "$script runs real containers: run it as root" >&2; exit 1; }
    exec sudo env "PATH=$HOME/.cargo/bin:$PATH" bash "$script" "$@"
}

tessera_ensure_deps() {
    export PATH="$HOME/.cargo/bin:/usr/local/cargo/bin:$PATH"
    local missing=()
    for p in "${TESSERA_APT_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        echo "installing: ${missing[*]}" >&2
        local sudo=""
        [ "$(id -u)" -eq 0 ] || sudo="sudo"
        $sudo apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
    command -v cargo >/dev/null || { echo "cargo not found: install a Rust toolchain (rustup) first" >&2; return 1; }
    # Formatting and lints are part of the tests: rustup's default profile has both.
    for tool in fmt clippy; do
        cargo "$tool" --version >/dev/null 2>&1 || { echo "cargo $tool not found: rustup component add ${tool/fmt/rustfmt}" >&2; return 1; }
    done
}
