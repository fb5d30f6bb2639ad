#!/usr/bin/env bash
# System packages the tests use, from Debian: promtool (Prometheus rule checks), openssl
# (test cluster keys). The cluster binaries have their own script (build-kube-binaries.sh).
set -euo pipefail
need=()
command -v promtool >/dev/null || need+=(prometheus)
command -v openssl >/dev/null || need+=(openssl)
command -v etcd >/dev/null || [[ -n "${KUBEBUILDER_ASSETS:-}" ]] || need+=(etcd-server)
((${#need[@]})) || exit 0
sudo_if() { if [[ $(id -u) -eq 0 ]]; then "$@"; else sudo "$@"; fi; }
sudo_if apt-get update -q
sudo_if env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}"
