#!/usr/bin/env bash
# Builds the four images (operator, sandbox, trainer, vllm) from images/*/Dockerfile and tags
# them as the chart and the operator's defaults expect: $IMAGE_REGISTRY/<name>:$IMAGE_TAG
# (ghcr.io/asyncgrpo/<name>:<pyproject version>).
#
# Usage: hack/build-images.sh [NAME...]     (default: all four)
# Env:   TORCH_VARIANT=cpu|cuda (trainer torch; default cuda, `make images` passes cpu)
#        IMAGE_REGISTRY, IMAGE_TAG  (names; e.g. your registry for `podman push`)
#        ASYNCGRPO_STANDIN=auto|1|0 (bases: hack/build-base-images.sh)
#        CONTAINER_ENGINE=podman|docker (default: hack/container-engine.sh picks a working one)
#
# Fast when nothing changed: bases are cached (hack/build-base-images.sh), podman reuses its
# layers, and the Dockerfiles install dependencies from pyproject.toml before copying the
# code, so a code change rebuilds only the small code layers. Each image carries a label with
# the hash of its inputs (Dockerfile, pyproject.toml, README.md, operator/, build arguments,
# base image); an image whose label matches is not rebuilt at all.
# Per-image times (0: up to date) go to stderr and to ~/.cache/asyncgrpo/images/last-build.tsv.
set -euo pipefail
# shellcheck source=hack/images-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/images-lib.sh"

TORCH_VARIANT="${TORCH_VARIANT:-cuda}"
# shellcheck source=hack/container-engine.sh
source "$(dirname "${BASH_SOURCE[0]}")/container-engine.sh"
pick_container_engine
engine="$ENGINE"
log "engine: $engine ($ENGINE_REASON)"
names=("$@")
timings="$IMAGES_CACHE/last-build.tsv"
mkdir -p "$IMAGES_CACHE"
# a full build starts the record afresh; builds of single images (the tests) append to it
((${#names[@]})) || { names=("${IMAGES[@]}"); : >"$timings"; }

# Hash of everything a build reads from the repository (the .dockerignore'd context) + args.
inputs_hash() {
  local name="$1"; shift
  {
    printf '%s\n' "$@"
    cd "$REPO_ROOT"
    find images/"$name"/Dockerfile images/constraints.txt .dockerignore pyproject.toml README.md operator -type f \
      -not -path '*/__pycache__/*' -not -name '*.pyc' -not -path '*.egg-info/*' -print0 \
      | sort -z | xargs -0 sha256sum
  } | sha256sum | cut -c1-32
}

timed() {
  local label="$1" start=$SECONDS; shift
  "$@"
  printf '%s\t%s\n' "$label" "$((SECONDS - start))" >>"$timings"
  log "$label: $((SECONDS - start)) s"
}

if [[ "$engine" == docker ]]; then
  # A normal Docker host: official bases, BuildKit secrets for the host's pip settings.
  for name in "${names[@]}"; do
    args=(--build-arg "TORCH_VARIANT=$TORCH_VARIANT" --secret "id=pipconf,src=$(write_build_pip_conf)")
    ca="$(ca_bundle)" && args+=(--secret "id=cacert,src=$ca")
    timed "$name" docker build "${args[@]}" -f "$REPO_ROOT/images/$name/Dockerfile" \
      -t "$IMAGE_REGISTRY/$name:$IMAGE_TAG" "$REPO_ROOT"
  done
  exit 0  # (DOCKER_BUILDKIT=1 on Docker < 23: the Dockerfiles use RUN --mount)
fi

ensure_podman
start=$SECONDS
python_base=""; vllm_base=""; vllm_job=""
for name in "${names[@]}"; do
  case "$name" in
    operator|sandbox|trainer|vllm) ;;
    *) echo "unknown image: $name (one of: ${IMAGES[*]})" >&2; exit 2 ;;
  esac
done
# The python base first (the vLLM stand-in is built on it), then the vLLM base in the
# background while the other images build: on a fresh machine that is the longest step.
python_base="$(bash "$REPO_ROOT/hack/build-base-images.sh" python | cut -d= -f2-)"
if [[ " ${names[*]} " == *" vllm "* ]]; then
  bash "$REPO_ROOT/hack/build-base-images.sh" vllm >"$IMAGES_CACHE/vllm-base.out" &
  vllm_job=$!
  trap 'kill "$vllm_job" 2>/dev/null || true' EXIT  # a failed build leaves nothing running
fi
printf 'python-base\t%s\n' "$((SECONDS - start))" >>"$timings"

# vllm last: it waits for its base
ordered=()
for name in "${names[@]}"; do [[ "$name" == vllm ]] || ordered+=("$name"); done
[[ -z "$vllm_job" ]] || ordered+=(vllm)
for name in "${ordered[@]}"; do
  if [[ "$name" == vllm ]]; then
    wait "$vllm_job" || { echo "building the vLLM base failed" >&2; exit 1; }
    vllm_base="$(cut -d= -f2- "$IMAGES_CACHE/vllm-base.out")"
    printf 'vllm-base\t%s\n' "$((SECONDS - start))" >>"$timings"
  fi
  ref="$IMAGE_REGISTRY/$name:$IMAGE_TAG"
  args=()
  wheels=0
  case "$name" in
    vllm) args+=(--build-arg "VLLM_IMAGE=$vllm_base") ; base="$vllm_base" ;;
    *) args+=(--build-arg "PYTHON_IMAGE=$python_base") ; base="$python_base" ;;
  esac
  if [[ "$name" == trainer ]]; then
    args+=(--build-arg "TORCH_VARIANT=$TORCH_VARIANT")
    if [[ "$TORCH_VARIANT" == cpu ]]; then
      # the CPU wheel from the cache directory, not PyPI's CUDA build or a remote index
      ensure_torch_wheel
      args+=(--build-arg "TORCH_CPU_INDEX_URL=")
      wheels=1
    fi
  fi
  key="$(inputs_hash "$name" "${args[@]}" "$(podman image inspect --format '{{.Id}}' "$base")")"
  if image_exists "$ref" && [[ "$(image_label "$ref" dev.asyncgrpo.inputs)" == "$key" ]]; then
    log "$ref is up to date"
    printf '%s\t0\n' "$name" >>"$timings"
    continue
  fi
  log "building $ref"
  WITH_WHEELS=$wheels timed "$name" build "${args[@]}" --label "dev.asyncgrpo.inputs=$key" \
    -f "$REPO_ROOT/images/$name/Dockerfile" -t "$ref" "$REPO_ROOT"
done
podman images --format '{{.Repository}}:{{.Tag}}\t{{.Size}}' | grep -F "$IMAGE_REGISTRY/" >&2 || true
