# Sourced by scripts/demo and scripts/test: installs what building the workspace needs.
# etcd-client's build script runs protoc, so it must be on PATH before cargo starts.
ensure_build_deps() {
  local missing=()
  command -v protoc >/dev/null || missing+=(protobuf-compiler)
  command -v cc >/dev/null || missing+=(gcc)
  command -v curl >/dev/null || missing+=(curl)
  if ((${#missing[@]})); then
    printf '==> installing Debian packages: %s\n' "${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}
