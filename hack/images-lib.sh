# Shared settings of the image scripts (sourced, not run): where things are cached, how podman
# is called on this kind of machine, and the names the images get.
#
# Why a containers.conf of our own: on these machines crun fails on the hybrid cgroup layout
# and the default rlimits are above what the host grants, so podman runs with runc and lower
# ulimits. Builds use `--isolation chroot` for the same reason. An existing $CONTAINERS_CONF is
# respected.
# shellcheck shell=bash

ASYNCGRPO_CACHE="${ASYNCGRPO_CACHE:-$HOME/.cache/asyncgrpo}"
IMAGES_CACHE="$ASYNCGRPO_CACHE/images"
WHEELS_DIR="$ASYNCGRPO_CACHE/wheels"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# Names: the operator's defaults (asyncgrpo.api) and the chart's image.repository + appVersion.
IMAGE_REGISTRY="${IMAGE_REGISTRY:-ghcr.io/asyncgrpo}"
IMAGE_TAG="${IMAGE_TAG:-$(sed -n 's/^version = "\(.*\)"/\1/p' "$REPO_ROOT/pyproject.toml" | head -1)}"
IMAGES=(operator sandbox trainer vllm)

# Official bases and the local stand-ins used where they cannot be pulled.
PYTHON_IMAGE_OFFICIAL="docker.io/library/python:3.11.11-slim-bookworm"
VLLM_IMAGE_OFFICIAL="docker.io/vllm/vllm-openai:v0.32.0"
PYTHON_IMAGE_STANDIN="localhost/asyncgrpo-standin/python:3.11-slim-bookworm"
VLLM_IMAGE_STANDIN="localhost/asyncgrpo-standin/vllm-openai:v0.32.0-cpu"
TORCH_VERSION="2.13.0"

if [[ -z "${CONTAINERS_CONF:-}" ]]; then
  mkdir -p "$IMAGES_CACHE"
  export CONTAINERS_CONF="$IMAGES_CACHE/containers.conf"
  cat >"$CONTAINERS_CONF.$$" <<'CONF'
# written by hack/images-lib.sh: runc (crun fails on hybrid cgroups) and rlimits the host grants
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
CONF
  mv "$CONTAINERS_CONF.$$" "$CONTAINERS_CONF"
fi

# pip on the host reads its settings and fetches the CPU torch wheel: the project venv's when
# there is one (a fresh Debian may have no python3-pip), else the system's.
HOST_PYTHON="${HOST_PYTHON:-$REPO_ROOT/.venv/bin/python}"
[[ -x "$HOST_PYTHON" ]] || HOST_PYTHON=python3

log() { echo "[images] $*" >&2; }

sudo_if() { if [[ $(id -u) -eq 0 ]]; then "$@"; else sudo "$@"; fi; }

# podman (with buildah inside) from Debian when missing; the Docker path is documented in README.
ensure_podman() {
  command -v podman >/dev/null && command -v runc >/dev/null && return 0
  log "installing podman, buildah, runc from the distribution"
  sudo_if apt-get update -q
  sudo_if env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    podman buildah runc mmdebstrap uidmap containernetworking-plugins iptables catatonit
}

image_exists() { podman image exists "$1"; }

image_label() { podman image inspect --format "{{ index .Labels \"$2\" }}" "$1" 2>/dev/null; }

# Build-time configuration for pip inside builds, never stored in an image: a pip.conf and the
# CA bundle, handed to RUN steps as build secrets (BuildKit and buildah: --secret id=...).
# The host's index settings are carried over; find-links points at the wheel directory that
# podman mounts into build steps (-v), which holds the CPU torch.
write_build_pip_conf() {
  local conf="$IMAGES_CACHE/build-pip.conf"
  local index extra
  index="$(pip_config global.index-url)"
  extra="$(pip_config global.extra-index-url | tr ' ' '\n' | grep -v '^file:' | tr '\n' ' ')"
  {
    echo "# written by hack/images-lib.sh; mounted into build steps only"
    echo "[global]"
    echo "cert = /run/secrets/cacert"
    echo "find-links = /wheels"
    [[ -n "$index" ]] && echo "index-url = $index"
    [[ -n "${extra// /}" ]] && echo "extra-index-url = $extra"
    echo "disable-pip-version-check = true"
  } >"$conf.$$"
  mv "$conf.$$" "$conf"  # atomic: builds may run side by side
  echo "$conf"
}

pip_config() { "$HOST_PYTHON" -m pip config get "$1" 2>/dev/null | grep -v '^ERROR' || true; }

ca_bundle() {
  local f
  for f in "${SSL_CERT_FILE:-}" /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt; do
    [[ -n "$f" && -f "$f" ]] && { echo "$f"; return; }
  done
  return 1
}

# The CPU torch wheel for TORCH_VARIANT=cpu builds, cached in $WHEELS_DIR: pip takes it from the
# host's configuration (here a file on disk) or from PyTorch's CPU index.
ensure_torch_wheel() {
  mkdir -p "$WHEELS_DIR"
  if compgen -G "$WHEELS_DIR/torch-$TORCH_VERSION+cpu-*.whl" >/dev/null; then return 0; fi
  log "fetching the CPU torch $TORCH_VERSION wheel into $WHEELS_DIR"
  local args=(-q --no-deps --only-binary=:all: --python-version 3.11
              --platform manylinux_2_28_x86_64 -d "$WHEELS_DIR" "torch==$TORCH_VERSION+cpu")
  "$HOST_PYTHON" -m pip download "${args[@]}" 2>/dev/null \
    || "$HOST_PYTHON" -m pip download --index-url https://download.pytorch.org/whl/cpu "${args[@]}"
}

# buildah through podman with the settings this machine needs; extra arguments pass through.
# WITH_WHEELS=1 mounts the wheel directory (CPU torch) at /wheels: only for CPU torch builds, as
# pip would otherwise prefer 2.13.0+cpu over the CUDA 2.13.0 too.
build() {
  local secrets=(--secret "id=pipconf,src=$(write_build_pip_conf)")
  [[ "${WITH_WHEELS:-0}" == 1 ]] && secrets+=(--volume "$WHEELS_DIR:/wheels:ro")
  local ca
  ca="$(ca_bundle)" && secrets+=(--secret "id=cacert,src=$ca")
  podman build --isolation chroot --network host --pull=never --layers \
    "${secrets[@]}" "$@"
}
