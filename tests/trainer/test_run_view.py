"""The trainer's view of the run (`asyncgrpo.trainer.main.run_view`) holds everything it reads.

The operator restarts the trainer only when this view changes, so a field the trainer reads
but the view leaves out would be a change that never reaches a running trainer. Each example
is cut down to its view (every other field back to its default) and must configure TRL, the
LoRA, the harness, the rewards, the data and the bucket exactly as the whole run does.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncgrpo.api import AsyncGRPORun, RolloutSpec, load_run
from asyncgrpo.trainer.main import READS, environment_factory, lora_config, run_view, trl_config
from asyncgrpo.trainer.runtime_env import RuntimeEnv

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
ENV = RuntimeEnv.from_env({"ASYNCGRPO_VLLM_URL": "http://v:8000", "ASYNCGRPO_WORK_DIR": "/w",
                           "ASYNCGRPO_GATEWAY_URL": "http://g:8080"})


def cut_to_view(run: AsyncGRPORun) -> AsyncGRPORun:
    doc = run.model_dump(mode="json", by_alias=True, exclude_none=True)
    return AsyncGRPORun.model_validate({**doc, "spec": run_view(run)})


def what_the_trainer_builds(run: AsyncGRPORun) -> dict:
    spec = run.spec
    factory = environment_factory(run, ENV)
    s = spec.adapter_store
    return {
        "trl": trl_config(run, ENV, use_cpu=True).to_dict(),
        "lora": lora_config(spec).to_dict() if spec.model.finetuning == "lora" else None,
        "harness": None if factory is None else factory.config,
        "rewards": spec.reward.model_dump(),
        "data": spec.data.model_dump(),
        "bucket": (s.bucket, s.prefix, s.endpoint, s.region, s.retention),
        "max_turns": spec.harness.max_turns,
        "world": run.world_size,
        "full": spec.model.full.model_dump(),
        "trainer": spec.trainer.model_dump(),
    }


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_a_run_cut_to_the_trainers_view_trains_the_same(example):
    run = load_run(example)
    narrowed = cut_to_view(run)
    # the cut is real: what the view leaves out is back to its default
    assert narrowed.spec.rollout.model_dump(exclude={"sampling"}) == \
        RolloutSpec().model_dump(exclude={"sampling"})
    assert set(narrowed.spec.model_dump(by_alias=True, exclude_defaults=True)) <= set(READS)
    assert what_the_trainer_builds(narrowed) == what_the_trainer_builds(run)


def test_fields_outside_the_view_leave_the_trainer_config_unchanged():
    run = load_run(EXAMPLES[0])
    doc = run.model_dump(mode="json", by_alias=True, exclude_none=True)
    doc["spec"]["rollout"] |= {"maxLoraRank": 512, "maxLoras": 9, "maxModelLen": 777,
                               "replicas": 7, "gpuMemoryUtilization": 0.5}
    doc["spec"]["adapterStore"] |= {"createBucket": False, "deletionPolicy": "Delete"}
    other = AsyncGRPORun.model_validate(doc)
    assert run_view(other) == run_view(run)
    assert what_the_trainer_builds(other) == what_the_trainer_builds(run)
    # and a field inside it changes both
    doc["spec"]["rollout"]["sampling"] = {"temperature": 0.25}
    inside = AsyncGRPORun.model_validate(doc)
    assert run_view(inside) != run_view(run)
    assert what_the_trainer_builds(inside)["trl"]["temperature"] == 0.25
