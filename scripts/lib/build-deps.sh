# Sourced by scripts/demo and scripts/test: installs what building the workspace needs.
# etcd-client's build script runs protoc, so it must be on PATH before cargo starts.

# Runs a command as root: directly when root already, else through passwordless sudo.
as_root() {
  if [ "$(id -u)" -eq 0 ]; then
    "$@"
  else
    sudo -n "$@"
  fi
}

# Installs the Debian packages named, once each run.
apt_install() {
  printf '==> installing Debian packages: %s\n' "$*"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

ensure_build_deps() {
  local missing=()
  command -v protoc >/dev/null || missing+=(protobuf-compiler)
  command -v cc >/dev/null || missing+=(gcc)
  command -v curl >/dev/null || missing+=(curl)
  if ((${#missing[@]})); then
    apt_install "${missing[@]}"
  fi
}
