#!/usr/bin/env bash
# Copies the built images from podman's store into containerd's `k8s.io` namespace (the one
# the kubelet's CRI reads), under the same names, so pods with `imagePullPolicy: Never` (or
# IfNotPresent) run them on a node with no registry.
#
# Usage: hack/import-images-containerd.sh [NAME...]   (default: all four)
# Env:   CONTAINERD_ADDRESS (ctr's own variable: the node's containerd socket)
#        IMAGE_REGISTRY, IMAGE_TAG (as for hack/build-images.sh)
# An image whose config digest containerd already holds under that name is skipped, so a
# second call costs a second.
set -euo pipefail
# shellcheck source=hack/images-lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/images-lib.sh"

names=("$@")
((${#names[@]})) || names=("${IMAGES[@]}")
ctr=(ctr -n k8s.io)

# config digest of the image containerd has under REF, or nothing
containerd_config() {
  local target
  target="$("${ctr[@]}" images ls "name==$1" 2>/dev/null | awk 'NR == 2 {print $3}')"
  [[ -n "$target" ]] || return 0
  "${ctr[@]}" content get "$target" 2>/dev/null \
    | python3 -c 'import json, sys; print(json.load(sys.stdin).get("config", {}).get("digest", ""))' \
    2>/dev/null || true
}

for name in "${names[@]}"; do
  ref="$IMAGE_REGISTRY/$name:$IMAGE_TAG"
  image_exists "$ref" || { echo "$ref is not built (hack/build-images.sh $name)" >&2; exit 1; }
  id="sha256:$(podman image inspect --format '{{.Id}}' "$ref")"
  if [[ "$(containerd_config "$ref")" == "$id" ]]; then
    log "$ref already in containerd"
    continue
  fi
  log "importing $ref into containerd (k8s.io)"
  podman save --format docker-archive "$ref" | "${ctr[@]}" images import - >&2
done
