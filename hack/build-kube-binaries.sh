#!/usr/bin/env bash
# Builds the test cluster's Kubernetes binaries from Debian's `kubernetes` source package
# (no registry serves them here) and caches them: the control plane (kube-apiserver,
# kube-controller-manager, kube-scheduler) and the node (kubelet, kube-proxy).
#
# Output: $ASYNCGRPO_CACHE/kube/bin/{kube-apiserver,kube-controller-manager,kube-scheduler,
#         kubelet,kube-proxy,etcd}
# Skips everything when the cached binaries exist. Set KUBEBUILDER_ASSETS to use envtest
# binaries instead (the test harness prefers them; this script is then not needed).
set -euo pipefail

cache="${ASYNCGRPO_CACHE:-$HOME/.cache/asyncgrpo}/kube"
bin="$cache/bin"
components=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy)
missing=()
for c in "${components[@]}"; do [[ -x "$bin/$c" ]] || missing+=("$c"); done
if ((${#missing[@]} == 0)) && [[ -x "$bin/etcd" ]]; then
  echo "kube binaries cached in $bin"
  exit 0
fi
mkdir -p "$bin" "$cache/src"

sudo_if() { if [[ $(id -u) -eq 0 ]]; then "$@"; else sudo "$@"; fi; }

need_pkgs=()
for p in golang-go rsync etcd-server golang-github-modern-go-reflect2-dev dpkg-dev; do
  dpkg -s "$p" >/dev/null 2>&1 || need_pkgs+=("$p")
done
if ! ls /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null | xargs grep -qs "deb-src"; then
  # Source packages need a deb-src entry; add one for the running Debian release.
  codename=$(. /etc/os-release && echo "$VERSION_CODENAME")
  sudo_if tee /etc/apt/sources.list.d/asyncgrpo-debian-src.sources >/dev/null <<SRC
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: $codename
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  sudo_if apt-get update -q
fi
if ((${#need_pkgs[@]})); then
  sudo_if apt-get update -q
  sudo_if env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need_pkgs[@]}"
fi

cd "$cache/src"
if ! ls -d kubernetes-*/ >/dev/null 2>&1; then
  apt-get source --download-only kubernetes
  dpkg-source --no-check -x kubernetes_*.dsc
fi
src=$(ls -d "$cache"/src/kubernetes-*/ | head -n1)
cd "$src"

# Go >= 1.18 needs a newer modern-go/reflect2 than the one vendored with 1.20: with the old
# one the server crashes on the first custom object. Debian ships the fixed sources.
rm -rf vendor/github.com/modern-go/reflect2
cp -r /usr/share/gocode/src/github.com/modern-go/reflect2 vendor/github.com/modern-go/reflect2
rm -rf vendor/github.com/modern-go/reflect2/.git

export GOFLAGS=-mod=vendor GO111MODULE=on KUBE_GIT_VERSION=v1.20.2 KUBE_GIT_TREE_STATE=clean
# Only what is missing: a cache from before the node existed keeps its control plane.
make WHAT="${missing[*]/#/cmd/}" GOFLAGS=-mod=vendor KUBE_VERBOSE=1
for c in "${missing[@]}"; do
  out=$(find _output -type f -name "$c" -path '*bin*' | head -n1)
  cp "$out" "$bin/"
done
ln -sf "$(command -v etcd)" "$bin/etcd"
# The build tree is large; the binaries are all the tests need.
cd "$cache" && rm -rf "$cache/src"
echo "kube binaries built into $bin"
