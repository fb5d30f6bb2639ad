"""`asyncgrpo tree verify|bench` through the real CLI entry point."""

import json

from asyncgrpo.cli import main
from asyncgrpo.trainer.tree import objective
from asyncgrpo.trainer.tree.rollout import dump_rollouts, load_rollouts
from asyncgrpo.trainer.tree.synthetic import agentic_rollouts, synthetic_rollouts


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_verify_passes_and_reports_what_it_compared(tmp_path, capsys):
    path = tmp_path / "rollouts.jsonl"
    dump_rollouts(synthetic_rollouts(groups=2, generations=3, prompt=16, completion=8, turns=2), path)
    assert load_rollouts(path)[0].group_id == "group-0"
    assert main(["tree", "verify", str(path), "--model", "moe", "--ranks", "2", "--budget", "64"]) == 0
    result = last_json(capsys.readouterr().out)
    assert result["ok"] and result["dropped"] == 0 and result["rollouts"] == 12
    assert result["tokens_forwarded"] < result["tokens_raw"]
    assert len(result["rank_tokens"]) == 2
    for key in ("max_logprob_abs_diff", "loss_abs_diff", "max_grad_abs_diff", "max_grad_rel_diff"):
        assert 0 <= result[key] <= 1e-4


def uneven_file(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    dump_rollouts(synthetic_rollouts(groups=3, generations=3, prompt=24, completion=12, turns=2, seed=1), path)
    return path


def test_verify_trains_the_planned_step_and_catches_a_per_micro_batch_normalisation(tmp_path, capsys,
                                                                                   monkeypatch):
    """Budget 90 on 2 ranks plans 5 micro-batches of 18/30/30/12/18 trained tokens for one step."""
    argv = ["tree", "verify", str(uneven_file(tmp_path)), "--ranks", "2", "--budget", "90"]
    assert main(argv) == 0
    result = last_json(capsys.readouterr().out)
    assert result["steps"] == 1 and result["step_trained_tokens"] == [result["trained_tokens"]]
    assert len(set(result["micro_batch_trained_tokens"])) > 1

    def trl_rule(batches):
        """TRL 1.16.0: each micro-batch by its own trained tokens, then / gradient accumulation."""
        for b in batches:
            b["tree_step_n_tokens"] = b["global_n_tokens"] * len(batches)
            b["tree_step_rows"] = b["tree_real_rows"] * len(batches)

    monkeypatch.setattr(objective, "stamp_step", trl_rule)
    assert main(argv) == 1
    result = last_json(capsys.readouterr().out)
    assert not result["ok"] and result["loss_abs_diff"] > 1e-4
    assert any(p.startswith("max_grad_rel_diff") for p in result["problems"])


def test_verify_accumulates_several_steps_and_fillers_stay_out_of_the_metrics(tmp_path, capsys):
    argv = ["tree", "verify", str(uneven_file(tmp_path)), "--ranks", "3", "--budget", "90", "--grad-accum", "2"]
    assert main(argv) == 0
    result = last_json(capsys.readouterr().out)
    assert result["steps"] == 2 and sum(result["step_trained_tokens"]) == result["trained_tokens"]

    one = tmp_path / "one.jsonl"
    one.write_text('{"group_id": "g", "input_ids": [5, 6, 7, 8, 9, 10], "completion_mask": [0, 0, 1, 1, 1, 1], '
                   '"advantage": 0.5, "old_log_probs": [0, 0, -6, -6.5, -5.9, -6.1]}\n')
    assert main(["tree", "verify", str(one), "--ranks", "3"]) == 0
    result = last_json(capsys.readouterr().out)
    assert result["filler_rows"] == 2 and result["max_metric_abs_diff"] <= 1e-5


def test_verify_refuses_a_budget_of_zero(tmp_path, capsys):
    assert main(["tree", "verify", str(uneven_file(tmp_path)), "--budget", "0"]) == 2
    assert "fixed count of samples per micro-batch" in capsys.readouterr().err


def test_verify_rejects_a_budget_smaller_than_a_rollout(tmp_path, capsys):
    path = tmp_path / "rollouts.jsonl"
    dump_rollouts(synthetic_rollouts(groups=1, generations=2, prompt=16, completion=8), path)
    assert main(["tree", "verify", str(path), "--budget", "10"]) == 2
    assert "exceed the per-rank token budget of 10" in capsys.readouterr().err


def test_verify_reports_a_malformed_line(tmp_path, capsys):
    path = tmp_path / "rollouts.jsonl"
    path.write_text('{"group_id": "g", "input_ids": [1, 2], "completion_mask": [0], "advantage": 1}\n')
    assert main(["tree", "verify", str(path)]) == 2
    assert "rollouts.jsonl:1" in capsys.readouterr().err


def test_verify_rejects_token_ids_outside_the_tiny_vocabulary(tmp_path, capsys):
    path = tmp_path / "rollouts.jsonl"
    path.write_text('{"group_id": "g", "input_ids": [1, 600], "completion_mask": [0, 1], "advantage": 1}\n')
    assert main(["tree", "verify", str(path)]) == 2
    assert "below the tiny model's vocabulary of 512" in capsys.readouterr().err


def test_bench_prints_a_table_and_a_json_line(capsys):
    argv = ["tree", "bench", "--groups", "1", "--generations", "3", "--prompt", "32", "--completion", "8",
            "--repeats", "1", "--threads", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    result = last_json(out)
    assert "speedup" in out.splitlines()[-3]
    for key in ("tree_s", "sequence_s", "speedup", "ideal_speedup", "efficiency", "tree_peak_mb",
                "sequence_peak_mb"):
        assert result[key] > 0
    assert result["ideal_speedup"] == (3 * 40) / (32 + 3 * 8)


def test_bench_on_a_file_plans_the_trainers_micro_batches_and_reports_the_flop_ideal(tmp_path, capsys):
    path = tmp_path / "agentic.jsonl"
    dump_rollouts(agentic_rollouts(groups=2, generations=3, turns=3, system=16, prompt=16, completion=8, tool=8),
                  path)
    argv = ["tree", "bench", "--file", str(path), "--budget", "90", "--ranks", "2", "--model", "moe",
            "--repeats", "1", "--threads", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    result = last_json(out)
    assert "FLOP ideal" in out and result["source"] == "file" and result["rollouts"] == 18
    assert result["micro_batches"] >= 2 and result["ranks"] == 2
    assert result["tokens_distinct"] <= result["tokens_forwarded"] < result["tokens_raw"]
    assert 1 < result["flop_ideal_speedup"] < result["ideal_speedup"]
    assert result["efficiency_flop"] == result["speedup"] / result["flop_ideal_speedup"]


def test_flop_model_counts_linear_attention_and_head_from_the_config():
    from asyncgrpo.trainer.tiny import tiny_config
    from asyncgrpo.trainer.tree.flops import FlopModel

    dense = FlopModel.of(tiny_config("dense"))
    # 2 layers x 2 FLOPs x (q, o: 64x64 each; k, v: 64x32 each; MLP 3 x 64x128)
    assert dense.per_token == 2 * 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)
    assert dense.per_pair == 2 * 2 * 2 * 4 * 16 and dense.per_term == 2 * 64 * 512
    moe = FlopModel.of(tiny_config("moe"))  # router 64x4 + 2 routed experts of 3 x 64x64
    assert moe.per_token == 2 * 2 * (2 * 64 * 64 + 2 * 64 * 32 + 64 * 4 + 2 * 3 * 64 * 64)
    assert dense.step(10, 55, 4) == 3 * (10 * dense.per_token + 55 * dense.per_pair + 4 * dense.per_term)
