"""The wire contract between the operator's pods and the programs in them: one home for each fact.

The builders (`asyncgrpo.controller`) write environment variables, ports and paths into pod
specs; the programs in the images (`asyncgrpo.cli` subcommands, the trainer's `RuntimeEnv`,
vLLM's resolver plugin, the sandbox client) read them; the local backend rewrites them.
Each name and number below is spelled once, here, and both sides import it, so a rename on
one side cannot leave the other reading a variable nobody sets. Standard library only: the
operator, trainer, sandbox and vLLM images all import this module.

Which program reads a variable, and what it means to a user, is documented where it is read
(`asyncgrpo.trainer.runtime_env` for the trainer, `asyncgrpo.adapters.vllm_plugin` for the
resolver, the `--help` of each CLI flag); this module only names them.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from pathlib import Path

# -- ports the programs listen on ------------------------------------------------------------
#: vLLM's OpenAI-compatible server (the Service in front of every replica)
VLLM_PORT = 8000
#: `asyncgrpo gateway`
GATEWAY_PORT = 8080
#: `asyncgrpo sandbox serve`, in each sandbox pod
SANDBOX_PORT = 8000
#: `asyncgrpo weights pull`, the puller sidecar of a vLLM pod (full fine-tuning): /ready
PULLER_PORT = 8100
#: torchrun's static rendezvous on trainer node 0 (the metrics port must differ)
TRAINER_RENDEZVOUS_PORT = 29500

# -- paths inside the pods (the root filesystem is read-only: these are volume mounts) -------
#: where the run's ConfigMap is mounted; the run file is CONFIG_MOUNT/CONFIG_KEY
CONFIG_MOUNT = "/etc/asyncgrpo"
CONFIG_KEY = "run.yaml"
#: where a `spec.data.configMap` source is mounted in the trainer (the key is the file name)
DATA_DIR = "/etc/asyncgrpo/data"
#: the trainer's scratch (TRL's output dir, checkpoint staging, status.json)
TRAINER_WORK_DIR = "/var/lib/asyncgrpo"
#: where TRL's offline loggers write (trackio's database, tensorboard's event files): in the
#: work emptyDir, so a local run keeps them under its work directory
LOGGER_DIR = f"{TRAINER_WORK_DIR}/loggers"
#: caches (Hugging Face, verified adapters, the puller's full copy) live under this emptyDir
CACHE_DIR = "/var/cache/asyncgrpo"
HF_HOME = f"{CACHE_DIR}/hf"
ADAPTER_CACHE_DIR = f"{CACHE_DIR}/adapters"
WEIGHTS_DIR = f"{CACHE_DIR}/weights"
#: root of the sandbox server's sessions
SANDBOX_WORKSPACE = "/workspace"
#: where the kubelet reads a container's termination message (Kubernetes' default path)
TERMINATION_LOG = "/dev/termination-log"

# -- routes of `asyncgrpo gateway` the operator calls (asyncgrpo.sandbox.gateway.app serves them) --
#: open route: the pool's demand signal
GATEWAY_DEMAND_PATH = "/v1/demand"
#: control route (gateway token): stop leasing one member; {name} is the sandbox pod
GATEWAY_DRAIN_PATH = "/v1/members/{name}/drain"

# -- served adapter names --------------------------------------------------------------------
#: version N of a run's policy is served as f"{DEFAULT_NAME_PREFIX}{N}" unless
#: ADAPTER_NAME_PREFIX_ENV says otherwise; it ends in "-v" (TRL's naming scheme)
DEFAULT_NAME_PREFIX = "policy-v"

# -- environment variables -------------------------------------------------------------------
#: every variable the operator sets or the programs read starts with it (a pod's own env may
#: not set one: asyncgrpo.api.placement)
ENV_PREFIX = "ASYNCGRPO_"
#: every server's default bind host (the local backend gives each pod its own loopback
#: address; in a pod it is unset: all interfaces)
BIND_HOST_ENV = "ASYNCGRPO_BIND_HOST"
LOG_LEVEL_ENV = "ASYNCGRPO_LOG_LEVEL"

# the trainer (asyncgrpo.trainer.runtime_env documents each)
VLLM_URL_ENV = "ASYNCGRPO_VLLM_URL"
#: group-affine routing over the vLLM replicas (asyncgrpo.trainer.routing): a host name whose
#: DNS A/AAAA records are the ready replicas (the headless Service), or a comma-separated list
#: of replica roots; unset: every request goes to VLLM_URL_ENV (the Service)
VLLM_REPLICAS_ENV = "ASYNCGRPO_VLLM_REPLICAS"
#: full fine-tuning: the replicas' puller port, read for their served version (version-aware
#: routing); unset: versions are not consulted
VLLM_PULLER_PORT_ENV = "ASYNCGRPO_VLLM_PULLER_PORT"
GATEWAY_URL_ENV = "ASYNCGRPO_GATEWAY_URL"
S3_ENDPOINT_ENV = "ASYNCGRPO_S3_ENDPOINT"
RUN_NAME_ENV = "ASYNCGRPO_RUN_NAME"
WORK_DIR_ENV = "ASYNCGRPO_WORK_DIR"
METRICS_PORT_ENV = "ASYNCGRPO_METRICS_PORT"
PROBE_TOLERANCE_ENV = "ASYNCGRPO_PROBE_TOLERANCE"
RETRY_ATTEMPTS_ENV = "ASYNCGRPO_RETRY_ATTEMPTS"
RETRY_BACKOFF_ENV = "ASYNCGRPO_RETRY_BACKOFF_S"
MAX_STEPS_ENV = "ASYNCGRPO_MAX_STEPS"
DATA_DIR_ENV = "ASYNCGRPO_DATA_DIR"
FAULT_CORRUPT_VERSIONS_ENV = "ASYNCGRPO_FAULT_CORRUPT_VERSIONS"
TERMINATION_LOG_ENV = "ASYNCGRPO_TERMINATION_LOG"
# the trainer pod's torchrun command line (asyncgrpo.controller.trainer.torchrun_command)
NNODES_ENV = "ASYNCGRPO_NNODES"
NPROC_ENV = "ASYNCGRPO_NPROC"
MASTER_ADDR_ENV = "ASYNCGRPO_MASTER_ADDR"
MASTER_PORT_ENV = "ASYNCGRPO_MASTER_PORT"

# the run's bucket, read by the trainer, vLLM's resolver plugin and the weights puller
ADAPTER_BUCKET_ENV = "ASYNCGRPO_ADAPTER_BUCKET"
ADAPTER_RUN_ENV = "ASYNCGRPO_ADAPTER_RUN"
ADAPTER_PREFIX_ENV = "ASYNCGRPO_ADAPTER_PREFIX"
ADAPTER_NAMESPACE_ENV = "ASYNCGRPO_ADAPTER_NAMESPACE"
ADAPTER_ENDPOINT_ENV = "ASYNCGRPO_ADAPTER_ENDPOINT"
ADAPTER_REGION_ENV = "ASYNCGRPO_ADAPTER_REGION"
ADAPTER_NAME_PREFIX_ENV = "ASYNCGRPO_ADAPTER_NAME_PREFIX"
ADAPTER_ATTEMPTS_ENV = "ASYNCGRPO_ADAPTER_ATTEMPTS"
ADAPTER_BACKOFF_ENV = "ASYNCGRPO_ADAPTER_BACKOFF_S"
ADAPTER_CACHE_DIR_ENV = "ASYNCGRPO_ADAPTER_CACHE_DIR"
ADAPTER_ANY_RUN_ENV = "ASYNCGRPO_ADAPTER_ANY_RUN"

# the bucket Job (`asyncgrpo bucket setup|cleanup`), besides the run's bucket variables
RUN_UID_ENV = "ASYNCGRPO_RUN_UID"
CREATE_BUCKET_ENV = "ASYNCGRPO_ADAPTER_CREATE_BUCKET"
ALLOWED_ENDPOINTS_ENV = "ASYNCGRPO_ALLOWED_ENDPOINTS"
RECLAIM_RETAINED_ENV = "ASYNCGRPO_ADAPTER_RECLAIM_RETAINED"  # spec.adapterStore.reclaimRetainedFolder

# the weights puller sidecar (`asyncgrpo weights pull`)
WEIGHTS_VLLM_URL_ENV = "ASYNCGRPO_WEIGHTS_VLLM_URL"
WEIGHTS_DIR_ENV = "ASYNCGRPO_WEIGHTS_DIR"
WEIGHTS_HOST_ENV = "ASYNCGRPO_WEIGHTS_HOST"
WEIGHTS_PORT_ENV = "ASYNCGRPO_WEIGHTS_PORT"
WEIGHTS_POLL_ENV = "ASYNCGRPO_WEIGHTS_POLL_S"
WEIGHTS_DOWNLOAD_CONCURRENCY_ENV = "ASYNCGRPO_WEIGHTS_DOWNLOAD_CONCURRENCY"

# `asyncgrpo sandbox serve` and `asyncgrpo gateway`: every flag --x-y has the variable
# <PREFIX>X_Y; the ones the builders set are named here
SANDBOX_ENV_PREFIX = "ASYNCGRPO_SANDBOX_"
GATEWAY_ENV_PREFIX = "ASYNCGRPO_GATEWAY_"
SANDBOX_TOKEN_ENV = SANDBOX_ENV_PREFIX + "TOKEN"
SANDBOX_PORT_ENV = SANDBOX_ENV_PREFIX + "PORT"
SANDBOX_WORKSPACE_ENV = SANDBOX_ENV_PREFIX + "WORKSPACE"
SANDBOX_DEFAULT_TIMEOUT_ENV = SANDBOX_ENV_PREFIX + "DEFAULT_TIMEOUT_SECONDS"
SANDBOX_MAX_TIMEOUT_ENV = SANDBOX_ENV_PREFIX + "MAX_TIMEOUT_SECONDS"
#: the gateway's bearer token, also read by the trainer's sandbox client
GATEWAY_TOKEN_ENV = GATEWAY_ENV_PREFIX + "TOKEN"
GATEWAY_PORT_ENV = GATEWAY_ENV_PREFIX + "PORT"
GATEWAY_SELECTOR_ENV = GATEWAY_ENV_PREFIX + "SELECTOR"
GATEWAY_NAMESPACE_ENV = GATEWAY_ENV_PREFIX + "NAMESPACE"
GATEWAY_SANDBOX_PORT_ENV = GATEWAY_ENV_PREFIX + "SANDBOX_PORT"
GATEWAY_MAX_EXEC_ENV = GATEWAY_ENV_PREFIX + "MAX_EXEC_SECONDS"
GATEWAY_MEMBERS_ENV = GATEWAY_ENV_PREFIX + "MEMBERS"
#: a JSON file {member name: base URL} the gateway follows (the local backend's sandbox pool
#: keeps it: asyncgrpo.local.sandbox_pool); members it drops are removed, new ones added
GATEWAY_MEMBERS_FILE_ENV = GATEWAY_ENV_PREFIX + "MEMBERS_FILE"
GATEWAY_LIFECYCLE_ENV = GATEWAY_ENV_PREFIX + "LIFECYCLE"
#: the most distinct sandbox images the gateway leases at once (spec.sandboxes.images.maxDistinct)
GATEWAY_MAX_IMAGES_ENV = GATEWAY_ENV_PREFIX + "MAX_IMAGES"
#: seconds a row image no lease asked for (and without sandboxes) stays in use
GATEWAY_IMAGE_IDLE_ENV = GATEWAY_ENV_PREFIX + "IMAGE_IDLE_SECONDS"

# -- a sandbox image per row (spec.sandboxes.imageColumn) ---------------------------------------
#: label of every sandbox pod: which image it runs, as `sandbox_image_key` spells it; the
#: gateway leases a group only a member whose label matches the image the lease asks for
SANDBOX_IMAGE_LABEL = "asyncgrpo.dev/sandbox-image"
#: the key of the run's own `spec.sandboxes.image` (and of a lease that names no image)
DEFAULT_SANDBOX_IMAGE_KEY = "default"
#: where a pod of a row's image finds the self-contained sandbox server an init container
#: from the run's sandbox image writes (`asyncgrpo sandbox bundle`), and the entry it runs
#: with the image's own python3
SANDBOX_SERVER_BUNDLE_DIR = "/opt/asyncgrpo-server"
SANDBOX_SERVER_BUNDLE_ENTRY = f"{SANDBOX_SERVER_BUNDLE_DIR}/asyncgrpo-sandbox.py"
_IMAGE_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_IMAGE_HOST = r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*(?::[0-9]{1,5})?/)?"
#: a container image reference as the distribution spec's grammar writes one:
#: [host[:port]/]path[:tag][@sha256:digest], at most 512 characters
IMAGE_REFERENCE = (rf"^{_IMAGE_HOST}{_IMAGE_PART}(?:/{_IMAGE_PART})*"
                   r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$")
IMAGE_REFERENCE_MAX = 512


def image_reference_problem(ref: object) -> str | None:
    """Why `ref` is not an image a pod can be made of; None when it is one."""
    if not isinstance(ref, str) or not ref:
        return f"an image reference is a non-empty string, not {type(ref).__name__} {ref!r}"[:200]
    if len(ref) > IMAGE_REFERENCE_MAX:
        return f"an image reference has at most {IMAGE_REFERENCE_MAX} characters, not {len(ref)}"
    if not re.match(IMAGE_REFERENCE, ref):
        return (f"{ref[:200]!r} is not an image reference ([host[:port]/]path[:tag]"
                "[@sha256:digest], lower-case path)")
    return None


def sandbox_image_key(ref: str | None) -> str:
    """The label value of the pods of image `ref` (None: the run's own image): a digest, since a
    reference is longer than a label value may be and holds '/', ':' and '@'."""
    if not ref:
        return DEFAULT_SANDBOX_IMAGE_KEY
    return "i" + hashlib.sha256(ref.encode()).hexdigest()[:20]


#: set by a user (never by the operator) for the processes of one trainer that must share
#: sandbox groups; read by asyncgrpo.sandbox.client.gateway_client
GROUP_KEY_ENV = "ASYNCGRPO_GROUP_KEY"

#: `asyncgrpo operator`: every flag has an ASYNCGRPO_OPERATOR_* default (the chart sets them)
OPERATOR_ENV_PREFIX = "ASYNCGRPO_OPERATOR_"

# -- outside the pods: a developer's or a test machine's cache ---------------------------------
#: the cluster binaries, the vLLM CPU venv, images, helm (hack/*.sh honour it too)
CACHE_ENV = "ASYNCGRPO_CACHE"
#: the vLLM CPU venv (hack/setup-vllm-venv.sh), default venv-vllm under the cache
VLLM_VENV_ENV = "ASYNCGRPO_VLLM_VENV"


def user_cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """$ASYNCGRPO_CACHE, default ~/.cache/asyncgrpo: the machine-wide cache of the tools
    and tests (never used inside a pod, whose caches are under CACHE_DIR)."""
    return Path(env.get(CACHE_ENV) or Path.home() / ".cache" / "asyncgrpo")

# -- facts both sides compute from the same variables ----------------------------------------
#: Largest |served - trained| log-prob on the trainer's probe that still counts as in sync.
DEFAULT_PROBE_TOLERANCE = 0.05


def probe_tolerance(env: Mapping[str, str]) -> float:
    """The probe tolerance a trainer with this environment uses.

    The trainer reads it from its own environment; the operator reads the same variable
    from `spec.trainer.env`, so a run that overrides it gets an AdapterInSync condition that
    agrees with the trainer's ServedPolicyMatches.
    """
    raw = env.get(PROBE_TOLERANCE_ENV)
    if raw in (None, ""):
        return DEFAULT_PROBE_TOLERANCE
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{PROBE_TOLERANCE_ENV}={raw!r} is not a number") from None
