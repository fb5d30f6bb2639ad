"""What a local run prints per step and at its end, from the trainer's real status-file
shape and its real metrics endpoint (`TrainerMetrics`, fed logging windows shaped as TRL's
AsyncGRPOTrainer writes them; a real training run is tests/local/test_local_backend.py's)."""

from __future__ import annotations

import json

import pytest

from asyncgrpo.api import load_run
from asyncgrpo.local import progress
from asyncgrpo.local.backend import LocalBackend, _ProgressFollower
from asyncgrpo.trainer.metrics import TrainerMetrics
from tests.api.invalid_specs import REPO


def trl_window(step: int) -> dict[str, float]:
    """One logging window as TRL's async trainer reduces it (as in tests/observability)."""
    return {"reward": 0.1 * step, "reward_std": 0.05, "batch/packing_ratio": 2.5,
            "perf/step_s": 2.0, "perf/rollout_wait_s": 0.5, "perf/fwd_bwd_s": 1.2,
            "perf/optimizer_s": 0.2, "perf/forwarded_tok_s_wall_clock": 400.0 + 20 * step}


class FakeTrainer:
    """Writes the status file as S3AdapterGRPOTrainer.write_status does, and serves the
    real metrics endpoint."""

    def __init__(self, path, resumed_from_step=None):
        self.path, self.resumed = path, resumed_from_step
        self.metrics = TrainerMetrics()
        self.port = self.metrics.serve(0, host="127.0.0.1")
        self.history: list[dict] = []
        self.published: list[dict] = []

    def publish(self, version: int, step: int) -> None:
        self.published.append({"version": version, "step": step})
        self.write(step, version)

    def log(self, step: int) -> None:
        logs = trl_window(step)
        self.metrics.update_from_logs(logs)
        self.history.append({k: logs.get(k) for k in ("reward", "reward_std", "loss",
                                                      "perf/step_s")} | {"step": step})
        self.write(step, step + 1)

    def write(self, step: int, version: int) -> None:
        self.path.write_text(json.dumps({
            "step": step, "policy_version": version, "resumed_from_step": self.resumed,
            "published": self.published, "history": self.history}))


@pytest.fixture
def follow(tmp_path):
    """(backend, lines said, the fake trainer, a follower scraping its endpoint)."""
    said: list[str] = []
    backend = LocalBackend(load_run(REPO / "examples" / "local-tiny.yaml"), tmp_path / "work",
                           say=said.append)
    backend.workdir.mkdir()
    pod = backend.workdir / "local-tiny-trainer-0" / "work"
    pod.mkdir(parents=True)
    backend.status_path = pod / "status.json"
    trainers = []

    def start(resumed_from_step=None):
        trainer = FakeTrainer(backend.status_path, resumed_from_step)
        trainers.append(trainer)
        url = f"http://127.0.0.1:{trainer.port}/metrics"
        return backend, said, trainer, _ProgressFollower(backend, [url])

    yield start
    for t in trainers:
        t.metrics.close()


def test_no_line_before_the_first_step_then_tokens_and_compression_per_step(follow):
    backend, said, trainer, follower = follow()
    follower.poll()                      # no status file yet
    trainer.publish(1, 0)                # the base policy is published before any step
    follower.poll()
    assert said == []                    # never "step 0: reward None"
    for step in (1, 2):
        trainer.log(step)
        follower.poll()
        follower.poll()                  # the same step is said once
    assert said == [
        ("step 1/20: reward 0.100 ± 0.050, policy v2, 1050 tokens/s raw, 420 unique, "
        "tree compression 2.50x"),
        ("step 2/20: reward 0.200 ± 0.050, policy v3, 1100 tokens/s raw, 440 unique, "
        "tree compression 2.50x")]
    records = progress.load(backend.progress_path)
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["metrics"]["asyncgrpo_trainer_step_seconds_count"] == 1.0


def test_steps_logged_between_two_polls_are_each_said(follow):
    _, said, trainer, follower = follow()
    trainer.log(1)
    trainer.log(2)
    trainer.log(3)
    follower.poll()
    assert said == [
        "step 1/20: reward 0.100 ± 0.050",
        "step 2/20: reward 0.200 ± 0.050",
        ("step 3/20: reward 0.300 ± 0.050, policy v4, 1150 tokens/s raw, 460 unique, "
         "tree compression 2.50x")]


def test_a_resumed_run_says_so_once(follow):
    _, said, trainer, follower = follow(resumed_from_step=10)
    trainer.publish(12, 10)
    follower.poll()
    trainer.log(11)
    follower.poll()
    assert said[0] == "resumed from step 10 (checkpoint in the bucket)"
    assert said[1].startswith("step 11/20: reward 1.100")
    assert sum("resumed" in line for line in said) == 1


def test_a_step_the_endpoint_no_longer_answers_for_is_said_without_figures(follow):
    _, said, trainer, follower = follow()
    trainer.log(1)
    trainer.metrics.close()              # the trainer exited after its last log
    follower.poll()
    assert said == ["step 1/20: reward 0.100 ± 0.050, policy v2"]


def test_the_summary_says_steps_rewards_throughput_and_where_things_are(follow):
    backend, _said, trainer, follower = follow()
    trainer.publish(1, 0)
    for step in range(1, 5):
        trainer.log(step)
        follower.poll()
    checkpoint = backend.status_path.parent / "output" / "checkpoint-4"
    checkpoint.mkdir(parents=True)
    (checkpoint.parent / "checkpoint-2").mkdir()
    text = backend.summary()
    assert text.splitlines() == [
        "run local-tiny finished: step 4, policy versions published: v1..v1",
        "mean reward: first 2 steps 0.150, last 2 steps 0.350",
        "mean over 4 steps: 1125 tokens/s raw, 450 unique, tree compression 2.50x",
        f"last checkpoint: {checkpoint}",
        f"logs and trainer status in {backend.workdir}",
        (f"progress in {backend.progress_path} (draw it: asyncgrpo report --local "
        f"{backend.workdir})")]


def test_parse_metrics_sums_replicas_and_keeps_states():
    text = ('# TYPE vllm:generation_tokens_total counter\n'
            'vllm:generation_tokens_total{pod="a"} 10\n'
            'vllm:generation_tokens_total{pod="b"} 5\n'
            '# TYPE asyncgrpo_gateway_sandboxes gauge\n'
            'asyncgrpo_gateway_sandboxes{state="busy"} 2\n'
            'asyncgrpo_gateway_sandboxes{state="warm"} 1\n'
            '# TYPE other_metric gauge\nother_metric 3\n')
    assert progress.parse_metrics(text) == {
        "vllm:generation_tokens_total": 15.0,
        'asyncgrpo_gateway_sandboxes{state="busy"}': 2.0,
        'asyncgrpo_gateway_sandboxes{state="warm"}': 1.0}
