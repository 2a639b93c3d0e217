# Sourced by scripts/demo and scripts/test: installs what building the workspace needs.
# etcd-client's build script runs protoc, so it must be on PATH before cargo starts.

# Runs a command as root: directly when root already, else through sudo (asking for a
# password only at a terminal); without either, says what to run instead.
as_root() {
  if [ "$(id -u)" -eq 0 ]; then
    "$@"
  elif command -v sudo >/dev/null && { sudo -n true 2>/dev/null || [ -t 0 ]; }; then
    sudo "$@"
  else
    echo "error: this needs root to run: $*" >&2
    echo "  run it once as root (or with sudo), then run this script again" >&2
    exit 1
  fi
}

# Installs the Debian packages named, once each run. A machine just booted may have its
# daily apt job holding the lock: wait for it rather than fail.
apt_install() {
  printf '==> installing Debian packages: %s\n' "$*"
  # A run killed during an earlier install leaves dpkg half-configured (its journal in
  # updates/), and apt refuses to go on until that is finished.
  if [ -n "$(ls -A /var/lib/dpkg/updates 2>/dev/null)" ]; then
    as_root env DEBIAN_FRONTEND=noninteractive dpkg --configure -a
  fi
  as_root apt-get -o DPkg::Lock::Timeout=600 update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq "$@" >/dev/null
}

# The toolchain first, before anything is installed for it: edition 2024 and the crates'
# rust-version need 1.95, and Debian's packaged cargo is older.
ensure_rust() {
  if ! command -v cargo >/dev/null; then
    echo "error: cargo is not on PATH. Install Rust 1.95 or newer with rustup:" >&2
    echo "  curl --proto '=https' -sSf https://sh.rustup.rs | sh -s -- -y && . \"\$HOME/.cargo/env\"" >&2
    exit 1
  fi
  local version
  version=$(rustc --version | awk '{print $2}')
  if ! printf '1.95.0\n%s\n' "${version%%-*}" | sort -V -C; then
    echo "error: rustc $version is older than 1.95; update it with: rustup update stable" >&2
    exit 1
  fi
}

# Whether protoc (if any) compiles the .proto read from stdin.
protoc_can_compile() {
  command -v protoc >/dev/null || return 1
  local dir
  dir=$(mktemp -d)
  cat >"$dir/probe.proto"
  protoc --proto_path="$dir" --descriptor_set_out=/dev/null "$dir/probe.proto" 2>/dev/null
  local status=$?
  rm -rf "$dir"
  return $status
}

ensure_build_deps() {
  ensure_rust
  local missing=()
  # etcd-client's protos import Google's well-known types, which protoc finds in
  # libprotobuf-dev (only recommended by protobuf-compiler, so absent on no-recommends images).
  command -v protoc >/dev/null || missing+=(protobuf-compiler)
  # A protoc that compiles an import of them has them, wherever they were installed.
  if ! printf 'syntax = "proto3";\nimport "google/protobuf/timestamp.proto";\n' |
    protoc_can_compile; then
    missing+=(libprotobuf-dev)
  fi
  # The C compiler for ring and friends, with the C library's headers (also only recommended).
  command -v cc >/dev/null || missing+=(gcc)
  [ -f /usr/include/stdio.h ] || missing+=(libc6-dev)
  command -v curl >/dev/null || missing+=(curl)
  if ((${#missing[@]})); then
    apt_install "${missing[@]}"
  fi
}
