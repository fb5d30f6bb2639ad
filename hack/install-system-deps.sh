#!/usr/bin/env bash
# System packages the tests use, from Debian: promtool (Prometheus rule checks), openssl
# (test cluster keys), and, as root, what the test cluster's real node runs on (containerd,
# runc, CNI plugins, dnsmasq for cluster DNS, iptables and conntrack for kube-proxy,
# busybox-static for the pause image). The cluster binaries have their own script
# (build-kube-binaries.sh).
set -euo pipefail
need=()
command -v promtool >/dev/null || need+=(prometheus)
command -v openssl >/dev/null || need+=(openssl)
command -v etcd >/dev/null || [[ -n "${KUBEBUILDER_ASSETS:-}" ]] || need+=(etcd-server)
if [[ $(id -u) -eq 0 ]]; then  # the node needs root; without it the node tests skip
  command -v containerd >/dev/null || need+=(containerd)
  command -v runc >/dev/null || need+=(runc)
  [[ -x /usr/lib/cni/bridge ]] || need+=(containernetworking-plugins)
  command -v dnsmasq >/dev/null || need+=(dnsmasq-base)
  command -v iptables >/dev/null || need+=(iptables)
  command -v conntrack >/dev/null || need+=(conntrack)
  command -v busybox >/dev/null || need+=(busybox-static)
  command -v nsenter >/dev/null || need+=(util-linux)
  command -v ip >/dev/null || need+=(iproute2)
fi
((${#need[@]})) || exit 0
sudo_if() { if [[ $(id -u) -eq 0 ]]; then "$@"; else sudo "$@"; fi; }
sudo_if apt-get update -q
sudo_if env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}"
