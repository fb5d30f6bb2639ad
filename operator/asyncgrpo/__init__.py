"""asyncgrpo: a Kubernetes-native operator for asynchronous GRPO with tree-packed training.

The import package is `asyncgrpo`; its source root is the repository's `operator/` folder
(there is deliberately no importable package named `operator`, which would shadow the
standard library module that kopf and many others import).
"""

__version__ = "0.1.0"

API_GROUP = "asyncgrpo.dev"
API_VERSION = "v1alpha1"
KIND = "AsyncGRPORun"
