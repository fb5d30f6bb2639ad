"""Checking run files: schema errors and cross-field rules, each reported with its field path.

The API server enforces the single-field rules through the CRD schema. The rules here relate
fields to each other (world size and parallel sizes, LoRA rank and vLLM's max rank...), which a
Kubernetes 1.20 schema cannot express; `asyncgrpo validate`, the operator's admission check and
the operator's reconcile all call `validate_run`, so a bad run is refused at the earliest layer
and later layers report the same message.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from asyncgrpo import API_GROUP, KIND
from asyncgrpo.api.placement import conflicts
from asyncgrpo.api.v1alpha1 import (
    MAX_RUN_NAME,
    RUN_NAME,
    AsyncGRPORun,
    AsyncGRPORunSpec,
)
from asyncgrpo.rewards import BUILTINS as REWARD_BUILTINS
from asyncgrpo.rewards import arg_names
from asyncgrpo.wire import TRAINER_RENDEZVOUS_PORT


@dataclass(frozen=True)
class FieldError:
    """One problem with a run, at a dotted field path such as `spec.trainer.fsdpSize`."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class RunValidationError(ValueError):
    """A run that cannot be reconciled; carries every problem found."""

    def __init__(self, errors: list[FieldError]):
        self.errors = errors
        super().__init__("; ".join(str(e) for e in errors))


def _path_of(loc: Iterable[Any], data: Any) -> str:
    """Render a pydantic error location as the user's field path.

    pydantic adds union and literal tags ('int', 'literal[...]') to locations; walking the
    input keeps only the segments the user actually wrote.
    """
    path = ""
    node = data
    for seg in loc:
        if isinstance(seg, int) and isinstance(node, list) and 0 <= seg < len(node):
            path += f"[{seg}]"
            node = node[seg]
        elif isinstance(seg, str) and isinstance(node, dict):
            path += f".{seg}" if path else seg
            node = node.get(seg)
        else:
            break
    return path or "<root>"


def schema_errors(err: ValidationError, data: Any) -> list[FieldError]:
    out = []
    for e in err.errors():
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif "input" in e and e["type"] not in ("missing",) and not isinstance(e["input"], dict):
            msg = f"{msg} (got {e['input']!r})"
        out.append(FieldError(_path_of(e["loc"], data), msg))
    return out


def semantic_errors(run: AsyncGRPORun) -> list[FieldError]:
    """Rules between fields, in four groups. Each message says what to change."""
    return [*_naming_and_logging(run), *_model_and_parallelism(run),
            *_data_and_rewards(run.spec), *_harness_and_sandboxes(run.spec),
            *_placement(run.spec), *_trl_args(run.spec)]


def _placement(s: AsyncGRPORunSpec) -> Iterator[FieldError]:
    """Pod settings that would replace what the operator owns (`asyncgrpo.api.placement`)."""
    for path, message in conflicts(s):
        yield FieldError(path, message)


def _naming_and_logging(run: AsyncGRPORun) -> Iterator[FieldError]:
    """The run's name (its children's names derive from it), the trainer's ports and loggers."""
    t = run.spec.trainer
    name = run.metadata.name
    if len(name) > MAX_RUN_NAME or not re.match(RUN_NAME, name):
        yield FieldError(
            "metadata.name", f"must be at most {MAX_RUN_NAME} lower-case letters, digits "
            "and '-', starting with a letter (children's Service names are DNS-1035 labels, "
            f"and their longest label value is the name + 19 characters), got {name!r}")

    if run.spec.trainer.metrics_port == TRAINER_RENDEZVOUS_PORT:
        yield FieldError(
            "spec.trainer.metricsPort", f"{TRAINER_RENDEZVOUS_PORT} is the trainer's "
            "rendezvous port (torchrun): choose another")

    if "none" in t.report_to and len(t.report_to) > 1:
        yield FieldError(
            "spec.trainer.reportTo", f"'none' means no logger: it cannot stand beside "
            f"{[x for x in t.report_to if x != 'none']}")
    if len(set(t.report_to)) != len(t.report_to):
        yield FieldError("spec.trainer.reportTo", f"names a logger twice: {t.report_to}")
    if t.report_to_secret and not re.fullmatch(
            r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*",
            t.report_to_secret):
        yield FieldError(
            "spec.trainer.reportToSecret", f"{t.report_to_secret!r} is not a Secret name "
            "(a DNS subdomain: lower-case letters, digits, '-' and '.')")


def _model_and_parallelism(run: AsyncGRPORun) -> Iterator[FieldError]:
    """What the model, GPUs, sharding and lengths must agree on to run at all."""
    s = run.spec
    t, r, m = s.trainer, s.rollout, s.model
    if r.gpus_per_replica and r.gpus_per_replica < r.tensor_parallel_size:
        yield FieldError(
            "spec.rollout.gpusPerReplica", f"{r.gpus_per_replica} GPUs cannot hold "
            f"tensorParallelSize {r.tensor_parallel_size}: request at least as many (or 0 "
            "for a CPU vLLM)")

    world = run.world_size
    fsdp = t.fsdp_size or world
    if world % fsdp:
        yield FieldError(
            "spec.trainer.fsdpSize", f"{fsdp} must divide the world size {world} "
            f"(replicas {t.replicas} x {max(t.gpus_per_replica, 1)} processes per replica)")
    if t.expert_parallel_size > 1:
        if not m.moe:
            yield FieldError(
                "spec.trainer.expertParallelSize", "expert parallel needs a mixture-of-experts "
                "model: set spec.model.moe: true or expertParallelSize: 1")
        if fsdp % t.expert_parallel_size:
            yield FieldError(
                "spec.trainer.expertParallelSize", f"{t.expert_parallel_size} must divide "
                f"fsdpSize {fsdp} (experts are spread inside each shard group)")
    if m.finetuning == "lora" and m.lora.rank > r.max_lora_rank:
        yield FieldError(
            "spec.model.lora.rank", f"rank {m.lora.rank} is above spec.rollout.maxLoraRank "
            f"{r.max_lora_rank}: vLLM would refuse the adapter")
    if m.finetuning == "full" and m.full.local_disk is None:
        yield FieldError(
            "spec.model.full.localDisk", "full fine-tuning keeps the weights on each vLLM "
            "pod's local disk: the served full copy plus the next anchor while it downloads. "
            "Set it to at least 2 x parameters x bytes per parameter (bfloat16: 2 bytes; a 30B "
            "model needs 120Gi). The trainer's rank 0 also holds one full copy in CPU memory "
            "(the base of the next delta): give its pod that much memory on top of training.")
    if m.attention == "tree-flex" and t.gpus_per_replica == 0:
        yield FieldError(
            "spec.model.attention", "tree-flex needs GPUs (FlexAttention has no CPU backward): "
            "use tree-sdpa or auto with gpusPerReplica: 0")
    if r.sampling.max_completion_tokens >= r.max_model_len:
        yield FieldError(
            "spec.rollout.sampling.maxCompletionTokens", f"{r.sampling.max_completion_tokens} "
            f"leaves no room for a prompt in maxModelLen {r.max_model_len}")
    if t.token_budget_per_rank < r.max_model_len:
        yield FieldError(
            "spec.trainer.tokenBudgetPerRank", f"{t.token_budget_per_rank} is below "
            f"spec.rollout.maxModelLen {r.max_model_len}: the longest rollout must fit one "
            "micro-batch (rollouts are never dropped silently)")
    if s.adapter_store.retention < t.max_staleness + 2:
        yield FieldError(
            "spec.adapterStore.retention", f"{s.adapter_store.retention} must be at least "
            f"trainer.maxStaleness + 2 = {t.max_staleness + 2}: in-flight rollouts may still "
            "name those versions")


def _data_and_rewards(s: AsyncGRPORunSpec) -> Iterator[FieldError]:
    """One prompt source; reward functions with the arguments they read."""
    yield from _data(s)

    for i, fn in enumerate(s.reward.functions):
        at = f"spec.reward.functions[{i}]"
        if fn.name == "python" and not fn.module:
            yield FieldError(f"{at}.module", "name: python needs module: 'package.module:function'")
        if fn.name != "python" and fn.module:
            yield FieldError(
                f"{at}.module", f"module is only read with name: python (name is {fn.name})")
        if fn.name == "sandbox_tests" and s.sandboxes is None:
            yield FieldError(
                f"{at}.name", "sandbox_tests runs tests in a sandbox: add spec.sandboxes")
        if fn.name in REWARD_BUILTINS:
            yield from _reward_args(fn.name, fn.args, f"{at}.args")


def _reward_args(name: str, args: dict[str, Any], at: str) -> Iterator[FieldError]:
    """A built-in's args against its dataclass: unknown names (they would reach the function
    as data set columns and vanish), types, required ones; a pattern must compile."""
    unknown = sorted(set(args) - set(arg_names(name)))
    if unknown:
        yield FieldError(at, f"{name} takes no {', '.join(unknown)}; its args are "
                         f"{', '.join(arg_names(name))}")
        return
    try:  # JSON mode: strict types ("8" is not 8) from a mapping, as the run file gives them
        TypeAdapter(REWARD_BUILTINS[name].args).validate_json(json.dumps(args))
    except ValidationError as err:
        for e in err.errors():
            where = ".".join(str(p) for p in e["loc"])
            what = f"{name} needs args.{where}" if e["type"] == "missing" else e["msg"]
            yield FieldError(f"{at}.{where}" if where else at, what)
    for key in ("pattern", "extract"):
        if isinstance(args.get(key), str):
            try:
                re.compile(args[key])
            except re.error as e:
                yield FieldError(f"{at}.{key}", f"not a valid regular expression: {e}")


_SOURCES = ("bucket_path", "config_map", "path")


def _source_errors(d, at: str, *, eval_set: bool = False) -> Iterator[FieldError]:
    sources = [k for k in _SOURCES if getattr(d, k) is not None]
    if len(sources) > 1 or (not sources and not eval_set):
        yield FieldError(at, "give exactly one of bucketPath, configMap, path "
                         f"(got {len(sources) or 'none'})")
    if d.config_map is not None and d.format == "datasets":
        yield FieldError(f"{at}.format", "a ConfigMap key is one file: give a datasets "
                         "folder as path or bucketPath (or the data as jsonl / parquet)")


def _data(s: AsyncGRPORunSpec) -> Iterator[FieldError]:
    """One source per data set; one way to make the prompt; patterns and templates parse."""
    from string import Formatter

    d = s.data
    yield from _source_errors(d, "spec.data")
    ways = [f for f, v in (("messagesField", d.messages_field),
                           ("promptTemplate", d.prompt_template)) if v is not None]
    if len(ways) > 1 or (ways and d.prompt_field != "prompt"):
        yield FieldError(f"spec.data.{ways[-1]}", "give one of promptField, messagesField, "
                         "promptTemplate")
    if d.prompt_template is not None:
        try:
            names = [f for _, f, _, _ in Formatter().parse(d.prompt_template) if f is not None]
        except ValueError as e:
            yield FieldError("spec.data.promptTemplate", f"not a valid template ({e}); write "
                             "{{ and }} for literal braces")
        else:
            if not names:
                yield FieldError("spec.data.promptTemplate", "names no {column}: every "
                                 "prompt would be the same")
            bad = [n for n in names if not n.isidentifier()]
            if bad:
                yield FieldError("spec.data.promptTemplate", f"{{{bad[0]}}}: only plain "
                                 "column names, as {question}")
    for name, col in d.columns.items():
        if col.pattern is not None:
            try:
                re.compile(col.pattern)
            except re.error as e:
                yield FieldError(f"spec.data.columns.{name}.pattern",
                                 f"not a valid regular expression: {e}")
        if name == "prompt":
            yield FieldError(f"spec.data.columns.{name}", "prompt is made by promptField, "
                             "messagesField or promptTemplate")
    if d.eval is not None:
        e = d.eval
        yield from _source_errors(e, "spec.data.eval", eval_set=True)
        if not any(getattr(e, k) is not None for k in _SOURCES) and e.split is None:
            yield FieldError("spec.data.eval", "give a source (bucketPath, configMap, path) or "
                             "the split of the training data set to score")
    m = s.model
    if m.chat_template is not None and m.chat_template_path is not None:
        yield FieldError("spec.model.chatTemplatePath", "give one of chatTemplate, "
                         "chatTemplatePath")


def _trl_args(s: AsyncGRPORunSpec) -> Iterator[FieldError]:
    """spec.trainer.trlArgs against AsyncGRPOConfig's fields (the generated table)."""
    from asyncgrpo.api.trl_args import trl_args_errors

    for key, message in trl_args_errors(s.trainer.trl_args):
        yield FieldError(f"spec.trainer.trlArgs.{key}", message)


def _harness_and_sandboxes(s: AsyncGRPORunSpec) -> Iterator[FieldError]:
    """Turns and tools against the harness type; the sandbox pool's bounds and egress."""
    h = s.harness
    if h.type == "single-turn" and h.max_turns != 1:
        yield FieldError("spec.harness.maxTurns", "single-turn rollouts have exactly one turn")
    if h.tools and h.type != "multi-turn":
        yield FieldError("spec.harness.tools", "tools need harness.type: multi-turn")
    if h.environment is not None and h.type != "multi-turn":
        yield FieldError("spec.harness.environment", "an environment needs harness.type: multi-turn")
    if h.environment is not None and h.tools:
        yield FieldError("spec.harness.tools", "give tools or an environment, not both (the "
                         "environment's methods are its tools)")
    if h.tools and s.sandboxes is None:
        yield FieldError("spec.sandboxes", "tools run in sandboxes: add spec.sandboxes")

    if s.sandboxes is not None:
        sb = s.sandboxes
        if sb.min_warm > sb.max:
            yield FieldError("spec.sandboxes.minWarm", f"{sb.min_warm} is above max {sb.max}")
        if sb.max > sb.hard_cap:
            yield FieldError("spec.sandboxes.max", f"{sb.max} is above hardCap {sb.hard_cap}")
        for i, cidr in enumerate(sb.network.allowed_egress_cidrs):
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError:
                yield FieldError(
                    f"spec.sandboxes.network.allowedEgressCidrs[{i}]", f"not a CIDR: {cidr!r}")


def checkpoint_identity(spec: AsyncGRPORunSpec) -> str:
    """The fields a run's checkpoints depend on, as JSON keyed by field path.

    Resuming from a checkpoint written for another model, fine-tuning mode or adapter shape
    would load the wrong tensors (or fail late), so these fields are immutable once a run
    started: the webhook refuses a change, the operator reports it and rolls nothing out.
    The tokenizer comes from spec.model.name, so it is covered by that field.
    """
    m = spec.model
    ident: dict[str, Any] = {"spec.model.name": m.name, "spec.model.finetuning": m.finetuning}
    if m.finetuning == "lora":
        ident["spec.model.lora.rank"] = m.lora.rank
        ident["spec.model.lora.targetModules"] = sorted(m.lora.target_modules)
    return json.dumps(ident, sort_keys=True, separators=(",", ":"))


def immutable_errors(fixed: str, spec: AsyncGRPORunSpec) -> list[FieldError]:
    """One error per checkpoint-identity field that differs from `fixed` (a previous
    `checkpoint_identity`)."""
    try:
        before = json.loads(fixed)
    except ValueError:
        return []
    now = json.loads(checkpoint_identity(spec))
    return [FieldError(path, f"is immutable once the run started (its checkpoints depend on "
                       f"it): was {before.get(path)!r}, now {now.get(path)!r}; create a new "
                       "run instead")
            for path in sorted(set(before) | set(now)) if before.get(path) != now.get(path)]


def validate_run(doc: dict[str, Any]) -> tuple[AsyncGRPORun | None, list[FieldError]]:
    """Parse and check one run document; returns the run (if it parsed) and every error."""
    if not isinstance(doc, dict):
        return None, [FieldError("<root>", f"expected a mapping, got {type(doc).__name__}")]
    try:
        run = AsyncGRPORun.model_validate(doc)
    except ValidationError as e:
        return None, schema_errors(e, doc)
    return run, semantic_errors(run)


def parse_run(doc: dict[str, Any]) -> AsyncGRPORun:
    """The run, or RunValidationError with every problem."""
    run, errors = validate_run(doc)
    if errors:
        raise RunValidationError(errors)
    assert run is not None
    return run


def load_run(path: str | Path) -> AsyncGRPORun:
    """Read the single AsyncGRPORun in a YAML file (as the trainer and local backend do)."""
    runs = [d for d in yaml.safe_load_all(Path(path).read_text()) if is_run(d)]
    if len(runs) != 1:
        raise RunValidationError([FieldError("<file>", f"{path}: expected one {KIND}, "
                                             f"found {len(runs)}")])
    return parse_run(runs[0])


def is_run(doc: Any) -> bool:
    return (isinstance(doc, dict) and doc.get("kind") == KIND
            and str(doc.get("apiVersion", "")).startswith(f"{API_GROUP}/"))
