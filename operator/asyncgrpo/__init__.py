"""asyncgrpo: a Kubernetes-native operator for asynchronous GRPO with tree-packed training.

The import package is `asyncgrpo`; its source root is the repository's `operator/` folder
(there is deliberately no importable package named `operator`, which would shadow the
standard library module that kopf and many others import).
"""

__version__ = "0.1.0"

#: Where the project's images are published; each is tagged with this package's version.
IMAGE_REPOSITORY = "ghcr.io/asyncgrpo"

API_GROUP = "asyncgrpo.dev"
API_VERSION = "v1alpha1"
KIND = "AsyncGRPORun"
#: The resource name of KIND (`kubectl get asyncgrporuns`, the CRD's spec.names.plural).
PLURAL = "asyncgrporuns"


def default_image(name: str) -> str:
    """The released image `name` (trainer, vllm, sandbox, operator) of this version."""
    return f"{IMAGE_REPOSITORY}/{name}:{__version__}"
