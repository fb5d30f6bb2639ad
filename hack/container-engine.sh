# Picks the engine that builds the images (sourced by hack/build-images.sh; also run by the tests:
# `bash hack/container-engine.sh` prints "ENGINE<TAB>why").
#
# A CLI on the PATH is not an engine: machines of this project's kind ship a `docker` client with
# no daemon behind it and no buildx, whose legacy builder refuses `--secret`. Docker is picked
# only when its daemon answers (`docker info`) and BuildKit is there (`docker buildx version`);
# otherwise podman, which hack/images-lib.sh installs from the distribution when missing.
# CONTAINER_ENGINE=podman|docker overrides the choice.
# shellcheck shell=bash

pick_container_engine() {
  ENGINE_REASON=""
  if [[ -n "${CONTAINER_ENGINE:-}" ]]; then
    case "$CONTAINER_ENGINE" in
      podman|docker) ENGINE="$CONTAINER_ENGINE"; ENGINE_REASON="CONTAINER_ENGINE=$CONTAINER_ENGINE" ;;
      *) echo "CONTAINER_ENGINE must be podman or docker, not '$CONTAINER_ENGINE'" >&2; return 2 ;;
    esac
    return 0
  fi
  if command -v podman >/dev/null; then
    ENGINE=podman; ENGINE_REASON="podman is installed"; return 0
  fi
  ENGINE=podman
  if ! command -v docker >/dev/null; then
    ENGINE_REASON="no docker client; podman will be installed"
  elif ! timeout 20 docker info >/dev/null 2>&1; then
    ENGINE_REASON="a docker client but no daemon answers (docker info failed); podman will be installed"
  elif ! timeout 20 docker buildx version >/dev/null 2>&1; then
    ENGINE_REASON="docker's daemon answers but BuildKit (buildx) is missing, and the legacy builder refuses --secret; podman will be installed"
  else
    ENGINE=docker; ENGINE_REASON="docker's daemon answers and BuildKit (buildx) is there"
  fi
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  pick_container_engine || exit $?
  printf '%s\t%s\n' "$ENGINE" "$ENGINE_REASON"
fi
