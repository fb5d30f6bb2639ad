"""The AsyncGRPORun resource, version v1alpha1: the one model every component reads.

The CRD's OpenAPI schema is generated from these classes (`asyncgrpo.api.crd`), the operator
builds children from them, the trainer and the local backend load their config through them.
Field descriptions become `kubectl explain` text, so they are written for users.

Single-field rules (types, enums, bounds, patterns, required) live in the field definitions,
so the API server enforces them through the schema. Rules that relate fields to each other
live in `asyncgrpo.api.validation`, which reports each with the path of the field to fix.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from asyncgrpo import API_GROUP, API_VERSION, KIND, default_image
from asyncgrpo.api import k8s
from asyncgrpo.api.layout import PREFIX_PATTERN
from asyncgrpo.rewards import BUILTINS as REWARD_BUILTINS
from asyncgrpo.rewards import NAMES as REWARD_NAMES
from asyncgrpo.rewards import arg_names

#: A Kubernetes resource quantity: "500m", "16Gi", 2.
Quantity = Annotated[int | str, Field(json_schema_extra={"x-kubernetes-int-or-string": True})]

#: Names of the reward functions a run may use (`asyncgrpo.rewards`' table); `python` loads
#: a user function named by `module`.
BUILTIN_REWARDS = REWARD_NAMES

DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
BUCKET_NAME = r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$"
#: An S3 endpoint: scheme, a host (name, IPv4 or [IPv6]), an optional port and path; no user
#: info, query or fragment.
ENDPOINT_URL = (r"^https?://([A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])"
                r"(:[0-9]{1,5})?(/[A-Za-z0-9._~/-]*)?$")
#: A run name: a DNS-1035 label (children become Services, whose names must start with a
#: letter).
RUN_NAME = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
#: The longest value derived from the run name is the trainer StatefulSet's pod label
#: controller-revision-hash, "<run>-trainer-<hash>" with a hash of up to 10 characters;
#: label values hold 63 characters, so 63 - len("-trainer-") - 10 = 44. (Pod names such as
#: "<run>-trainer-<ordinal>" and "<run>-sandbox-<4>" are shorter.)
MAX_RUN_NAME = 63 - len("-trainer-") - 10


class Model(BaseModel):
    """Base of every API object: camelCase on the wire, unknown fields refused."""

    # strict: "8" is not 8, "true" is not true. The API server refuses those through the
    # CRD schema, so `asyncgrpo validate` and the local backend refuse them too.
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=True,
        strict=True,
    )


class StatusModel(Model):
    """Base of the status objects: written by the operator as JSON (timestamps as strings),
    so parsed leniently."""

    model_config = ConfigDict(strict=False)


# ---------------------------------------------------------------- shared small types


class ResourceRequirements(Model):
    """Compute resources of one container, as in a Pod spec."""

    requests: dict[str, Quantity] = Field(
        max_length=32,
        default_factory=dict, description="Minimum resources, e.g. {cpu: 4, memory: 32Gi}."
    )
    limits: dict[str, Quantity] = Field(
        max_length=32,
        default_factory=dict,
        description="Maximum resources. GPUs go here too (spec.gpuResourceName, by default "
        "nvidia.com/gpu), set by the operator from gpusPerReplica unless given.",
    )


#: An environment variable, Kubernetes' own EnvVar (name, value or valueFrom).
EnvVar = k8s.EnvVar


class SecretKeyRef(Model):
    """Keys of a Secret in the run's namespace."""

    name: str = Field(pattern=DNS_SUBDOMAIN, max_length=253, description="Secret name.")
    access_key_id_key: str = Field(
        default="AWS_ACCESS_KEY_ID", description="Key holding the access key id."
    )
    secret_access_key_key: str = Field(
        default="AWS_SECRET_ACCESS_KEY", description="Key holding the secret access key."
    )



# ---------------------------------------------------------------- pod settings (placement)

#: GPU resource requested when a spec asks for GPUs and names none (per run:
#: spec.gpuResourceName; per operator: the chart's gpuResourceName).
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
#: A resource name such as nvidia.com/gpu or amd.com/gpu (a qualified name).
RESOURCE_NAME = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
_OWNED = (" The operator's own entries win and cannot be replaced: a conflicting entry is "
          "refused by `asyncgrpo validate` and the admission webhook with its field path.")


class PodSettings(Model):
    """Where and how a component's pods run, in Kubernetes' own types: one shape for every
    component. spec.pod applies to every pod of the run; a component's pod settings
    (spec.trainer.pod, spec.rollout.pod, spec.sandboxes.pod, spec.sandboxes.gatewayPod,
    spec.adapterStore.bucketJobPod) are merged over it field by field, the component
    winning. Security settings (securityContext, the service account, token mounts) are the
    operator's and are not part of this shape."""

    node_selector: dict[str, str] = Field(
        default_factory=dict, max_length=64,
        description="Node labels the pods require. Merged by key: the component's value wins.")
    tolerations: list[k8s.Toleration] = Field(
        default_factory=list, max_length=64,
        description="Taints the pods tolerate. Appended: the run-wide list, then the "
        "component's. A pod that requests GPUs also tolerates `<gpuResourceName>:NoSchedule` "
        "(Exists) unless gpuToleration is false or a toleration for that key is given.")
    gpu_toleration: bool | None = Field(
        default=None,
        description="Add the GPU pool's NoSchedule toleration to pods that request GPUs "
        "(managed clusters taint GPU nodes so). Unset: inherited, true by default.")
    affinity: k8s.Affinity | None = Field(
        default=None, description="Node and pod (anti-)affinity. Replaced whole: a "
        "component's affinity replaces the run-wide one.")
    topology_spread_constraints: list[k8s.TopologySpreadConstraint] = Field(
        default_factory=list, max_length=16,
        description="How the pods spread over zones or nodes. Replaced whole: a component's "
        "non-empty list replaces the run-wide one.")
    priority_class_name: str | None = Field(
        default=None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN,
        description="PriorityClass of the pods; the component's wins.")
    scheduler_name: str | None = Field(
        default=None, min_length=1, max_length=253,
        description="Scheduler of the pods (e.g. volcano); the component's wins.")
    image_pull_secrets: list[k8s.LocalObjectReference] = Field(
        default_factory=list, max_length=16,
        description="Secrets to pull the images with. Appended (run-wide, then the "
        "component's; a name given twice once). The run-wide list also goes on every "
        "ServiceAccount the operator makes for the run.")
    labels: dict[str, str] = Field(
        default_factory=dict, max_length=64,
        description="Extra pod labels, e.g. kueue.x-k8s.io/queue-name. Merged by key: the "
        "component's value wins. The app.kubernetes.io/* and asyncgrpo.dev/* labels are the "
        "operator's." + _OWNED)
    annotations: dict[str, str] = Field(
        default_factory=dict, max_length=64,
        description="Extra pod annotations. Merged by key: the component's value wins. "
        "asyncgrpo.dev/* and prometheus.io/* annotations are the operator's." + _OWNED)
    volumes: list[k8s.Volume] = Field(
        default_factory=list, max_length=32,
        description="Extra volumes. Merged by name: a component's volume replaces a run-wide "
        "one of the same name. The operator's volumes (config, tmp, dshm, work, cache, "
        "data, weights, workspace, model cache) keep their names." + _OWNED)
    volume_mounts: list[k8s.VolumeMount] = Field(
        default_factory=list, max_length=32,
        description="Mounts of extra volumes in the component's main container. Merged by "
        "mountPath: the component's wins. A path at or under one the operator mounts is "
        "refused." + _OWNED)
    env: list[k8s.EnvVar] = Field(
        default_factory=list, max_length=128,
        description="Extra environment variables of the main container. Merged by name: the "
        "component's wins (spec.trainer.env and spec.rollout.env win over both). Variables "
        "the operator sets for the component to work (ASYNCGRPO_*, the rendezvous, the "
        "bucket's AWS_* and the gateway tokens) cannot be replaced." + _OWNED)


class WorkloadServiceAccountSpec(Model):
    """The run's workload ServiceAccount `<run>-workload` (trainer, vLLM, bucket Jobs)."""

    annotations: dict[str, str] = Field(
        default_factory=dict, max_length=32,
        description="Annotations of `<run>-workload`, for cloud workload identity: "
        "eks.amazonaws.com/role-arn (EKS IRSA), iam.gke.io/gcp-service-account (GKE), "
        "azure.workload.identity/client-id (AKS). asyncgrpo.dev/* annotations are the "
        "operator's." + _OWNED)


class ModelCacheSpec(Model):
    """A volume mounted at the Hugging Face cache (HF_HOME) of the trainer and vLLM pods, so a
    model is downloaded once, not by every pod at every start. Give claimName or volume.

    ReadWriteMany (NFS, EFS, Filestore, CephFS): the first pod downloads, the others wait on
    the hub's file locks in the cache and read what it wrote. ReadOnlyMany (a disk filled
    once by a Job, a snapshot): set readOnly; the pods then run with HF_HUB_OFFLINE=1 and
    fail at once on a model the cache lacks."""

    claim_name: str | None = Field(
        default=None, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN,
        description="A PersistentVolumeClaim in the run's namespace.")
    volume: k8s.Volume | None = Field(
        default=None, description="Any volume instead of a claim (its name is used as is).")
    read_only: bool = Field(
        default=False, description="Mount read-only and run offline (HF_HUB_OFFLINE=1): "
        "the cache must hold the model already.")
    sub_path: str | None = Field(
        default=None, min_length=1, max_length=1024, pattern=r"^[^/].*$",
        description="A folder of the volume to mount instead of its root.")


# ---------------------------------------------------------------- model


class LoraSpec(Model):
    """LoRA adapter trained on top of the frozen base model (peft)."""

    rank: int = Field(default=16, ge=1, le=512, description="Adapter rank r.")
    alpha: int = Field(default=32, ge=1, description="Scaling alpha (scale = alpha / rank).")
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA input.")
    target_modules: list[str] = Field(
        max_length=64,
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="Module names to adapt, or ['all-linear'].",
    )


class FullFinetuningSpec(Model):
    """Full fine-tuning: every version's weights go through the bucket to each vLLM replica."""

    anchor_interval: int = Field(
        default=10, ge=1, le=10000,
        description="A full copy of the weights (anchor) every this many versions; the "
        "versions between are sparse deltas against the previous one. Smaller: more bytes "
        "per step, faster catch-up for a replica that starts or falls behind.",
    )
    local_disk: Quantity | None = Field(
        default=None,
        description="Size of each vLLM pod's emptyDir for the puller: the served full copy "
        "plus the next anchor while it downloads, so at least 2 x parameters x bytes per "
        "parameter (bfloat16: 2), e.g. 120Gi for a 30B model. Required with finetuning=full.",
    )


class ModelSpec(Model):
    """The policy's base model and how it is fine-tuned."""

    name: str = Field(
        min_length=1,
        description="Base model: a Hugging Face repo id the images can read, or a path in them.",
    )
    dtype: Literal["bfloat16", "float16", "float32"] = Field(
        default="bfloat16", description="Parameter and compute dtype."
    )
    moe: bool = Field(
        default=False,
        description="Mixture-of-experts model (Qwen3-MoE class); required for expert parallel.",
    )
    attention: Literal["auto", "tree-flex", "tree-sdpa"] = Field(
        default="auto",
        description="Tree attention path: tree-flex (FlexAttention, CUDA), tree-sdpa (exact "
        "per-tree SDPA, any device), auto (flex on CUDA, sdpa elsewhere).",
    )
    finetuning: Literal["lora", "full"] = Field(
        default="lora",
        description="lora: train an adapter, served from the bucket by name. full: train all "
        "weights, published to the bucket (anchors + sparse deltas) and pulled by a sidecar "
        "in every vLLM pod; each replica needs local disk for two full copies.",
    )
    lora: LoraSpec = Field(default_factory=LoraSpec, description="LoRA settings (finetuning=lora).")
    full: FullFinetuningSpec = Field(default_factory=FullFinetuningSpec,
                                     description="Full fine-tuning settings (finetuning=full).")
    cache: ModelCacheSpec | None = Field(
        default=None, description="A volume (a PVC) holding the Hugging Face cache of the "
        "trainer and vLLM pods; unset: an emptyDir, so each pod downloads the model.")
    chat_template: str | None = Field(
        default=None, min_length=1, max_length=262144,
        description="A Jinja chat template used instead of the tokenizer's (prompts are "
        "rendered by the trainer; vLLM receives token ids).")
    chat_template_path: str | None = Field(
        default=None, min_length=1,
        description="A file holding the chat template (in the trainer image, on a mounted "
        "volume, or locally); instead of chatTemplate.")


# ---------------------------------------------------------------- trainer


class TrainerSpec(Model):
    """The trainer: a StatefulSet of torchrun nodes running TRL's AsyncGRPOTrainer."""

    image: str = Field(default=default_image("trainer"), min_length=1,
                       description="Trainer image.")
    replicas: int = Field(default=1, ge=1, le=1024, description="Nodes (pods) of the trainer.")
    gpus_per_replica: int = Field(
        default=1, ge=0, le=16,
        description="GPUs per node; one process per GPU. 0 runs one CPU process per node.",
    )
    fsdp_size: int | None = Field(
        default=None, ge=1,
        description="Ranks each FSDP2 shard group spans; must divide the world size. "
        "Default: the world size (fully sharded, no replication).",
    )
    expert_parallel_size: int = Field(
        default=1, ge=1,
        description="Ranks experts are spread over (MoE only); must divide fsdpSize.",
    )
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements,
                                            description="Resources of each trainer pod.")
    learning_rate: float = Field(default=1e-5, gt=0, le=1, description="Peak learning rate.")
    lr_scheduler: Literal["constant", "constant_with_warmup", "linear", "cosine"] = Field(
        default="constant", description="Learning-rate schedule (transformers' names)."
    )
    warmup_steps: int = Field(default=0, ge=0, description="Linear warm-up steps.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradient clipping norm.")
    num_generations: int = Field(
        default=8, ge=2, le=1024,
        description="G: rollouts sampled per prompt; advantages are normalized within a group.",
    )
    prompts_per_step: int = Field(default=8, ge=1, description="Prompt groups per optimizer step.")
    token_budget_per_rank: int = Field(
        default=16384, ge=64,
        description="Forwarded (unique) tokens per micro-batch per rank after tree packing; "
        "must hold the longest rollout (rollout.maxModelLen).",
    )
    gradient_accumulation_steps: int = Field(
        default=1, ge=1, description="Micro-batches accumulated per optimizer step per rank."
    )
    max_staleness: int = Field(
        default=4, ge=0,
        description="Drop samples generated by a policy more than this many versions old.",
    )
    clip_epsilon: float = Field(default=0.2, gt=0, lt=1, description="PPO ratio clip epsilon.")
    # -- TRL's GRPO settings (own-task, issue 25) -- AsyncGRPOConfig in trl 1.16 has no
    # beta/KL, loss_type, reward scaling, truncated-completion masking, stop sequences or
    # max prompt length: they are not offered (docs/trainer.md says so).
    clip_epsilon_high: float | None = Field(
        default=None, gt=0, lt=10,
        description="Upper clip epsilon (DAPO's clip-higher; TRL's epsilon_high); unset: clipEpsilon.",
    )
    trl_args: dict[str, Any] = Field(
        default_factory=dict, max_length=64,
        description="Any other AsyncGRPOConfig field, as TRL names it (snake_case), passed as "
        "given; checked against TRL's fields and types at validate time. Fields the operator "
        "sets are refused with the spec field that controls them.",
    )
    total_steps: int = Field(default=1000, ge=1, description="Optimizer steps to train.")
    checkpoint_interval: int = Field(
        default=50, ge=1, description="Steps between checkpoints written to the bucket."
    )
    seed: int = Field(default=0, ge=0, description="Seed for data order and initialization.")
    metrics_port: int = Field(default=9400, ge=1024, le=65535,
                              description="Port of the trainer's Prometheus endpoint.")
    report_to: list[Literal["trackio", "wandb", "tensorboard", "mlflow", "none"]] = Field(
        default_factory=list, max_length=4,
        description="Experiment loggers TRL reports to (its `report_to`), besides the "
        "Prometheus endpoint, which is always on: trackio, wandb, tensorboard, mlflow; "
        "empty or [none]: none. The project's trainer image carries trackio and "
        "tensorboard (offline, to files in the trainer's work volume); wandb and mlflow "
        "need an image that adds them.",
    )
    report_to_secret: str | None = Field(
        default=None, min_length=1, max_length=253,
        description="Secret in the run's namespace whose keys become environment variables "
        "of the trainer pods (envFrom), for the loggers' settings and credentials: "
        "WANDB_API_KEY, WANDB_PROJECT, MLFLOW_TRACKING_URI, TRACKIO_SPACE_ID... Never "
        "copied into the run's ConfigMap, status or logs.",
    )
    env: list[EnvVar] = Field(default_factory=list, max_length=128,
                              description="Extra environment variables.")
    pod: PodSettings = Field(default_factory=PodSettings,
                             description="Placement and extras of the trainer pods, over "
                             "spec.pod.")


# ---------------------------------------------------------------- rollout (vLLM)


class SamplingSpec(Model):
    """Sampling parameters of rollouts."""

    temperature: float = Field(default=1.0, ge=0, le=10, description="Sampling temperature.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass.")
    max_completion_tokens: int = Field(
        default=1024, ge=1, description="Tokens generated per turn at most."
    )
    # own-task (issue 25): AsyncGRPOConfig's sampling fields
    top_k: int = Field(default=0, ge=-1, description="Top-k sampling; 0 or -1: off (TRL's top_k).")
    min_p: float | None = Field(default=None, ge=0, le=1, description="Min-p sampling (TRL's min_p).")
    repetition_penalty: float = Field(default=1.0, gt=0, le=10,
                                      description="Repetition penalty; 1: none (TRL's repetition_penalty).")


class RolloutSpec(Model):
    """The vLLM servers that sample rollouts from the current policy."""

    image: str = Field(default=default_image("vllm"), min_length=1,
                       description="vLLM image carrying the asyncgrpo LoRA resolver plugin.")
    replicas: int = Field(default=1, ge=1, le=1024, description="vLLM server replicas.")
    routing: Literal["affine", "service"] = Field(
        default="affine",
        description="How rollout requests reach the replicas. affine: the trainer sends each "
        "group, and every turn of its conversations, to one replica (consistent hashing "
        "with bounded load, failover to the next replica; with full fine-tuning new groups "
        "only to replicas serving the newest version), so shared prefixes hit that "
        "replica's prefix cache. service: every request through the vLLM Service, spread "
        "by kube-proxy. One replica: the same either way.",
    )
    tensor_parallel_size: int = Field(
        default=1, ge=1, le=16, description="GPUs per vLLM replica (--tensor-parallel-size)."
    )
    gpus_per_replica: int | None = Field(
        default=None, ge=0, le=16,
        description="GPUs each vLLM pod requests; unset: tensorParallelSize. 0 runs vLLM on "
        "CPU (vllm-cpu images; tiny models, tests).",
    )
    max_loras: int = Field(
        default=4, ge=1, le=64,
        description="Adapters a replica holds at once (--max-loras); policy versions in flight.",
    )
    max_lora_rank: Literal[8, 16, 32, 64, 128, 256, 320, 512] = Field(
        default=64, description="--max-lora-rank; must be >= model.lora.rank."
    )
    max_model_len: int = Field(
        default=4096, ge=16, description="Longest sequence (prompt + all turns) a rollout may reach."
    )
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0, le=1, description="Fraction of GPU memory vLLM may take."
    )
    sampling: SamplingSpec = Field(default_factory=SamplingSpec, description="Sampling parameters.")
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements,
                                            description="Resources of each vLLM pod.")
    extra_args: list[str] = Field(default_factory=list, max_length=128,
                                  description="Extra vLLM server arguments, appended as given.")
    env: list[EnvVar] = Field(default_factory=list, max_length=128,
                              description="Extra environment variables.")
    pod: PodSettings = Field(default_factory=PodSettings,
                             description="Placement and extras of the vLLM pods, over spec.pod.")


# ---------------------------------------------------------------- sandboxes


class SandboxNetworkSpec(Model):
    """Egress of sandbox pods. Everything not listed is denied; ingress only from the gateway."""

    allowed_egress_cidrs: list[str] = Field(
        max_length=256,
        default_factory=list, description="CIDRs sandboxes may reach, e.g. a package mirror."
    )
    allowed_egress_hosts: list[str] = Field(
        max_length=256,
        default_factory=list,
        description="Host names sandboxes may reach; resolved by the operator to /32 (or /128) "
        "blocks at each reconcile, and DNS egress to kube-dns is opened for them.",
    )


class SandboxImagesSpec(Model):
    """The pools of the images rows name (spec.sandboxes.imageColumn): one pool per image in
    use, all within the run's max and hardCap."""

    max_distinct: int = Field(
        default=8, ge=1, le=64,
        description="Most distinct row images leased at once; a lease for one more is refused "
        "(too_many_images) until an image has had no sandbox for idleTtlSeconds.")
    min_warm_per_image: int = Field(
        default=0, ge=0, le=64,
        description="Idle sandboxes kept ready for each row image in use (0: a row image's "
        "sandboxes start cold, on demand; the wait is reported).")


class SandboxSpec(Model):
    """Pool of sandbox pods where multi-turn rollouts run their tool calls."""

    image: str = Field(default=default_image("sandbox"), min_length=1,
                       description="Sandbox image (runs the asyncgrpo sandbox server).")
    min_warm: int = Field(default=2, ge=0, description="Idle sandboxes kept ready at least.")
    max: int = Field(default=16, ge=0, description="Most sandboxes the scaler asks for.")
    hard_cap: int = Field(default=256, ge=1, description="Never more sandbox pods than this.")
    resources: ResourceRequirements = Field(
        default_factory=lambda: ResourceRequirements(
            requests={"cpu": "250m", "memory": "512Mi"}, limits={"cpu": 1, "memory": "1Gi"}
        ),
        description="Resources of each sandbox pod.",
    )
    runtime_class_name: str | None = Field(
        default=None, description="RuntimeClass for stronger isolation, e.g. gvisor or kata."
    )
    idle_ttl_seconds: int = Field(
        default=600, ge=0, description="Delete sandboxes idle longer than this above minWarm."
    )
    exec_timeout_seconds: int = Field(
        default=60, ge=1, le=3600, description="Default timeout of one command in a sandbox."
    )
    # gateway-pool (issue 23): the lease lifecycle
    lifecycle: Literal["FreshPerGroup", "Reuse"] = Field(
        default="FreshPerGroup",
        description="FreshPerGroup: a sandbox pod serves one rollout group's lease and is then "
        "deleted and replaced (the warm pool keeps leases fast); nothing a rollout leaves behind "
        "(processes, /tmp, IPC, files) can reach the next group. Reuse: the pod is reset and "
        "leased to the next group; cheaper, for trusted workloads only.")
    network: SandboxNetworkSpec = Field(default_factory=SandboxNetworkSpec,
                                        description="Sandbox egress allow-list.")
    pod: PodSettings = Field(default_factory=PodSettings,
                             description="Placement and extras of the sandbox pods, over "
                             "spec.pod.")
    gateway_pod: PodSettings = Field(default_factory=PodSettings,
                                     description="Placement and extras of the sandbox "
                                     "gateway's pod, over spec.pod.")
    # a sandbox image per row (issue 25, SWE-style data sets)
    image_column: str | None = Field(
        default=None, min_length=1, max_length=256,
        description="A data column naming the image each row's sandbox runs (make one from "
        "any source field with spec.data.columns, e.g. {image: {field: docker_image}}); a "
        "row whose column is null or empty gets spec.sandboxes.image. The image needs only "
        "a python3 (3.11 or newer): an init container from spec.sandboxes.image puts the "
        "sandbox server in the pod. Cluster runs only.")
    images: SandboxImagesSpec = Field(
        default_factory=lambda: SandboxImagesSpec(),
        description="Pools of the rows' images (with imageColumn).")


# ---------------------------------------------------------------- adapter store


class AdapterStoreSpec(Model):
    """S3-compatible bucket holding adapters (per policy version), checkpoints and data."""

    endpoint: str | None = Field(
        default=None, max_length=2048, pattern=ENDPOINT_URL,
        description="S3 endpoint URL, http(s)://host[:port][/path] (MinIO, Ceph, GCS "
        "interop...); empty for AWS S3. The cluster admin may restrict endpoints.",
    )
    bucket: str = Field(pattern=BUCKET_NAME, description="Bucket name.")
    prefix: str = Field(
        default="asyncgrpo", min_length=1, max_length=256, pattern=PREFIX_PATTERN,
        description="Key prefix; the run writes under <prefix>/<namespace>/<run name>/. "
        "Segments of letters, digits, '.', '_', '-' joined by '/'; no empty, '.' or '..' "
        "segment, no leading or trailing '/'.")
    region: str = Field(default="us-east-1", pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$",
                        description="Bucket region.")
    credentials_secret: SecretKeyRef | None = Field(
        default=None,
        description="Secret with S3 credentials, of type Opaque and labelled "
        "asyncgrpo.dev/s3-credentials=\"true\" (any other Secret is refused: SecretNotAllowed); "
        "empty uses the pods' ambient identity (IRSA...).",
    )
    create_bucket: bool = Field(default=True, description="Create the bucket if it is missing.")
    retention: int = Field(
        default=8, ge=1,
        description="Newest adapter versions kept; never fewer than trainer.maxStaleness + 2.",
    )
    deletion_policy: Literal["Retain", "Delete"] = Field(
        default="Retain",
        description="On run deletion: Retain keeps the run's objects, Delete removes them.",
    )
    reclaim_retained_folder: bool = Field(
        default=False,
        description="Take back the folder a deleted run of the same namespace and name left "
        "behind (deletionPolicy Retain) and resume from its checkpoints; without it such a "
        "folder is refused FolderOwnedByAnotherRun. Only a folder whose ownership marker "
        "names this namespace and name is taken.")
    bucket_job_pod: PodSettings = Field(
        default_factory=PodSettings,
        description="Placement and extras of the bucket setup and cleanup Jobs' pods, over "
        "spec.pod.")


# ---------------------------------------------------------------- data, reward, harness


class ConfigMapKeyRef(Model):
    """A key of a ConfigMap in the run's namespace."""

    name: str = Field(min_length=1, description="ConfigMap name.")
    key: str = Field(default="prompts.jsonl", min_length=1, description="Key holding the data.")


#: How a data source is read; auto: a folder is a `datasets` folder, *.parquet / *.pq
#: Parquet, anything else JSON Lines.
DATA_FORMATS = ("auto", "jsonl", "parquet", "datasets")


class DataSource(Model):
    """Where rows come from and how they are stored. Give exactly one source."""

    bucket_path: str | None = Field(
        default=None, min_length=1,
        description="Object key in the adapter store's bucket (a file; for a datasets "
        "folder, the key prefix of the folder).")
    config_map: ConfigMapKeyRef | None = Field(
        default=None, description="A ConfigMap key (small data; Parquet as binaryData).")
    path: str | None = Field(
        default=None, min_length=1,
        description="A path inside the trainer image, on a volume mounted through "
        "spec.pod / spec.trainer.pod, or locally: a file, or a datasets save_to_disk folder.")
    format: Literal[DATA_FORMATS] = Field(
        default="auto",
        description="jsonl, parquet, or datasets (a datasets save_to_disk folder); auto: a "
        "folder is datasets, *.parquet / *.pq Parquet, anything else JSON Lines.")
    split: str | None = Field(
        default=None, min_length=1,
        description="Split of a datasets folder holding a DatasetDict (default train).")


class ColumnFrom(Model):
    """A column of each row made from another column: copied, or the part a regex finds."""

    field: str = Field(min_length=1, description="Column of the source row to read.")
    pattern: str | None = Field(
        default=None, min_length=1,
        description="Regular expression searched in the value (as a string); the column is "
        "its group 1 (or the whole match), stripped. No match: null (numeric_match and "
        "exact_match then leave the row unscored).")


class EvalDataSpec(DataSource):
    """A held-out set scored every evalSteps steps; its rows are read like the training
    rows (promptField, messagesField, promptTemplate, systemPrompt, columns). No source:
    `split` of the training source (a datasets folder)."""

    eval_steps: int = Field(default=10, ge=1,
                            description="Score the eval set after every this many steps "
                            "(and after the last).")
    max_rows: int = Field(default=64, ge=1, le=100000,
                          description="Rows scored each time (the first ones).")
    num_generations: int = Field(default=1, ge=1, le=64,
                                 description="Completions sampled per eval row.")
    temperature: float | None = Field(
        default=None, ge=0.0,
        description="Sampling temperature of the eval; unset: rollout.sampling.temperature.")


class DataSpec(DataSource):
    """Prompt data set: JSON Lines, Parquet or a datasets folder; one prompt per row."""

    prompt_field: str = Field(default="prompt", min_length=1,
                              description="Field holding the prompt (string or chat messages).")
    messages_field: str | None = Field(
        default=None, min_length=1,
        description="Instead of promptField: a column of chat messages (role, content); "
        "trailing assistant turns are cut off the prompt, and the last one becomes the "
        "answer column when the row has none.")
    prompt_template: str | None = Field(
        default=None, min_length=1, max_length=65536,
        description="Instead of promptField: the user message, with {column} replaced by "
        "the row's value ({{ and }} for literal braces), e.g. '{question} End with #### N.'")
    system_prompt: str | None = Field(
        default=None, min_length=1, max_length=65536,
        description="A system message put before each prompt that has none of its own.")
    columns: dict[str, ColumnFrom] = Field(
        default_factory=dict, max_length=32,
        description="Columns added to (or replaced in) each row, for the rewards: "
        "{answer: {field: answer, pattern: '####\\s*(.+)'}}.")
    shuffle: bool = Field(default=True, description="Shuffle prompts each epoch (seeded).")
    eval: EvalDataSpec | None = Field(
        default=None, description="Held-out rows scored every eval.evalSteps steps; the "
        "reward is logged (asyncgrpo_trainer_eval_reward_mean, TRL's loggers as eval_reward).")


def _reward_args_rules() -> list[dict[str, str]]:
    """CEL rules: a built-in's `args` name only its arguments (anything else would reach the
    function as a data set column and be ignored). Types are checked by `asyncgrpo validate`
    and the webhook, from the same dataclasses."""
    rules = []
    for name in REWARD_BUILTINS:
        allowed = ", ".join(f"'{a}'" for a in arg_names(name))
        rules.append({
            "rule": f"self.name != '{name}' || !has(self.args) || self.args.all(k, k in [{allowed}])",
            "message": f"{name} takes only these args: {allowed.replace(chr(39), '')}",
        })
    return rules


class RewardFunction(Model):
    """One reward term; the reward of a rollout is the weighted sum of its terms."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _reward_args_rules()})

    name: Literal[REWARD_NAMES] = Field(  # type: ignore[valid-type]
        description="Built-in reward, or python for a user function named by module."
    )
    weight: float = Field(default=1.0, description="Weight of this term.")
    module: str | None = Field(
        default=None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="For name=python: 'package.module:function' importable in the trainer image.",
    )
    args: dict[str, Any] = Field(
        max_length=32, default_factory=dict,
        description="Arguments of the function: a built-in's are listed in docs/api.md "
        "(unknown names refused); a python function's are its own keyword arguments.",
        json_schema_extra={"additionalProperties": {"x-kubernetes-preserve-unknown-fields": True}},
    )


class RewardSpec(Model):
    """How rollouts are scored."""

    functions: list[RewardFunction] = Field(min_length=1, max_length=32,
                                            description="Reward terms.")


class EnvironmentRef(Model):
    """A user's own TRL environment class (its `environment_factory`); see docs/tasks.md."""

    module: str = Field(
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="'package.module:Class' importable in the trainer image: reset(**row), "
        "public methods as tools (type hints and docstrings are their schemas), optional "
        "get_reward(). With spec.sandboxes its constructor also gets sandbox= (the group's "
        "sandbox handle).",
    )
    args: dict[str, Any] = Field(default_factory=dict, max_length=32,
                                 description="Keyword arguments of the class's constructor.")
    path: str | None = Field(
        default=None, min_length=1,
        description="A folder put first on the import path (local runs: the task's source).",
    )


class HarnessSpec(Model):
    """How a rollout is played: one completion, or a multi-turn episode with tools."""

    type: Literal["single-turn", "multi-turn"] = Field(default="single-turn",
                                                       description="Rollout harness.")
    max_turns: int = Field(default=1, ge=1, le=256, description="Assistant turns per episode.")
    tools: list[Literal["shell", "python", "read_file", "write_file"]] = Field(
        default_factory=list, description="Tools offered to the model (multi-turn, in sandboxes)."
    )
    environment: EnvironmentRef | None = Field(
        default=None,
        description="Your own environment instead of the built-in tools (multi-turn).",
    )


# ---------------------------------------------------------------- the run


class AsyncGRPORunSpec(Model):
    """Desired state of an asynchronous GRPO training run."""

    model: ModelSpec = Field(description="Base model and fine-tuning mode.")
    trainer: TrainerSpec = Field(default_factory=TrainerSpec, description="Trainer settings.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="vLLM rollout servers.")
    sandboxes: SandboxSpec | None = Field(
        default=None, description="Sandbox pool for tool calls; needed by multi-turn tools."
    )
    adapter_store: AdapterStoreSpec = Field(description="S3-compatible bucket of the run.")
    data: DataSpec = Field(description="Prompt data set.")
    reward: RewardSpec = Field(description="Reward functions.")
    harness: HarnessSpec = Field(default_factory=HarnessSpec, description="Rollout harness.")
    suspend: bool = Field(
        default=False,
        description="Scale every workload to zero, keeping the bucket; resume continues from "
        "the newest checkpoint.",
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None, ge=0,
        description="Delete the run this long after it Succeeded or Failed.",
    )
    pod: PodSettings = Field(
        default_factory=PodSettings,
        description="Placement and extras of every pod of the run (nodeSelector, "
        "tolerations, imagePullSecrets, labels...); each component's pod settings are merged "
        "over these.")
    gpu_resource_name: str | None = Field(
        default=None, max_length=253, pattern=RESOURCE_NAME,
        description="Extended resource the trainer and vLLM request GPUs as, e.g. "
        "amd.com/gpu. Unset: the operator's default (Helm value gpuResourceName, "
        "nvidia.com/gpu).")
    service_account: WorkloadServiceAccountSpec = Field(
        default_factory=WorkloadServiceAccountSpec,
        description="The run's workload ServiceAccount (cloud identity for the bucket).")


class Condition(StatusModel):
    """A Kubernetes-style condition (metav1.Condition)."""

    type: str = Field(description="Condition type, e.g. TrainerReady.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(default="", description="CamelCase reason a program can act on.")
    message: str = Field(default="", description="Human-readable detail.")
    last_transition_time: datetime | None = Field(default=None,
                                                  description="When status last changed.")
    observed_generation: int | None = Field(default=None,
                                            description="Generation the condition was set for.")


class ServedWeightsStatus(StatusModel):
    """Full fine-tuning: the weights versions the vLLM replicas serve, read from each
    replica's weights puller (replicas catch up on their own)."""

    oldest: int = Field(default=0, description="Oldest version a replica serves.")
    newest: int = Field(default=0, description="Newest version a replica serves.")
    replicas: int = Field(default=0, description="Replicas whose puller answered.")


class RolloutReplicaStatus(StatusModel):
    """One vLLM replica as the rollouts see it (docs/routing.md)."""

    replica: str = Field(description="ip:port: the trainer's router key and Prometheus' "
                         "instance of the pod's vllm:* series.")
    pod: str | None = Field(default=None, description="The vLLM pod (absent: no Running pod "
                            "has this address now; the router's count is kept).")
    requests_routed: int | None = Field(default=None, description="Rollout requests the "
                                        "trainer's router sent it (affine routing).")
    prefix_cache_queries: int | None = Field(default=None, description="Prompt tokens it "
                                             "looked up in its prefix cache (vLLM's "
                                             "vllm:prefix_cache_queries).")
    prefix_cache_hits: int | None = Field(default=None, description="Of those, tokens found "
                                          "cached (vllm:prefix_cache_hits).")
    served_version: int | None = Field(default=None, description="Full fine-tuning: the "
                                       "weights version it serves (its puller).")


class ThroughputStatus(StatusModel):
    """Training throughput, mirrored from the trainer's metrics."""

    raw_tokens_per_second: float = Field(default=0.0, description="Rollout tokens trained per s.")
    unique_tokens_per_second: float = Field(default=0.0,
                                            description="Tokens actually forwarded per s.")
    tree_compression_ratio: float = Field(default=1.0, description="Raw / forwarded tokens.")


class SandboxStatus(StatusModel):
    """Sandbox pool counts."""

    warm: int = Field(default=0, description="Ready and idle.")
    busy: int = Field(default=0, description="Leased to a rollout group.")
    starting: int = Field(default=0, description="Created, not ready yet.")
    failed: int = Field(default=0, description="Failed or unschedulable.")
    wanted: int = Field(default=0, description="Sandbox pods the pool aims for now "
                        "(minWarm, demand and max).")
    ready: str = Field(default="", description="Ready (warm + busy) / wanted, as `kubectl "
                       "get` shows it, e.g. 6/8.")
    spawned_total: int = Field(default=0, description="Sandbox pods created over the run.")


class RunOutput(StatusModel):
    """Where the run's result is: `<run folder>/final/`, written once more when training
    ends, with its manifest (`asyncgrpo pull` brings it down)."""

    bucket: str = Field(description="Bucket of the run.")
    key: str = Field(description="Key prefix of the result, ending in final/.")
    kind: Literal["lora", "full"] = Field(description="lora: a peft adapter; full: the "
                                          "model's weights with its config and tokenizer.")
    step: int = Field(default=0, description="Training step the result is from.")


class AsyncGRPORunStatus(StatusModel):
    """Observed state of the run, written by the operator."""

    phase: Literal["Pending", "Starting", "Running", "Suspended", "Succeeded", "Failed"] = Field(
        default="Pending", description="Lifecycle phase."
    )
    conditions: list[Condition] = Field(default_factory=list, description="Conditions.")
    observed_generation: int | None = Field(default=None,
                                            description="Generation last reconciled.")
    step: int = Field(default=0, description="Optimizer steps done.")
    progress: str = Field(default="", description="Steps done / spec.trainer.totalSteps, "
                          "as `kubectl get` shows it, e.g. 120/1000.")
    policy_version: int = Field(default=0, description="Newest adapter version published.")
    reward: float | None = Field(default=None, description="Mean reward of the samples of "
                                 "the trainer's last step.")
    served_weights: ServedWeightsStatus | None = Field(
        default=None, description="Full fine-tuning: weights versions served by the vLLM "
        "replicas (oldest, newest).")
    throughput: ThroughputStatus = Field(default_factory=ThroughputStatus,
                                         description="Throughput.")
    rollout_replicas: list[RolloutReplicaStatus] = Field(
        default_factory=list, max_length=64, description="Per running vLLM replica: requests "
        "routed to it, its prefix-cache queries and hits, the version it serves.")
    sandboxes: SandboxStatus = Field(default_factory=SandboxStatus, description="Sandbox counts.")
    checkpoint_identity: str | None = Field(
        default=None, max_length=4096,
        description="What the run's checkpoints depend on (model name, finetuning, LoRA rank "
        "and targets), as JSON, fixed at the first reconcile: a spec that changes it is "
        "refused by the webhook and not rolled out by the operator.")
    outputs: list[RunOutput] = Field(default_factory=list, description="The run's result "
                                     "once training finished (final/ in the bucket).")
    start_time: datetime | None = Field(default=None, description="When training started.")
    completion_time: datetime | None = Field(default=None, description="When the run finished.")


class ObjectMeta(Model):
    """The part of metadata the model reads; the rest is kept as given."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="allow",
                              strict=True)

    # Checked in asyncgrpo.api.validation: the CRD schema cannot constrain metadata.name.
    name: str = Field(default="run", description="Run name; children are named after it.")
    namespace: str | None = Field(default=None, description="Namespace.")


class AsyncGRPORun(Model):
    """An asynchronous GRPO training run."""

    api_version: Literal["asyncgrpo.dev/v1alpha1"] = Field(
        default=f"{API_GROUP}/{API_VERSION}", description="asyncgrpo.dev/v1alpha1."
    )
    kind: Literal["AsyncGRPORun"] = Field(default=KIND, description="AsyncGRPORun.")
    metadata: ObjectMeta = Field(default_factory=ObjectMeta, description="Object metadata.")
    spec: AsyncGRPORunSpec = Field(description="Desired state.")
    status: AsyncGRPORunStatus | None = Field(default=None, description="Observed state.")

    @property
    def world_size(self) -> int:
        """Trainer processes: one per GPU, or one per node on CPU."""
        t = self.spec.trainer
        return t.replicas * max(t.gpus_per_replica, 1)
