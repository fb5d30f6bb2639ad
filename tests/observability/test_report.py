"""`asyncgrpo report`: what it accepts, what it says when it cannot read its source, the local
run it draws from a work folder, and pictures with round ticks and labels that fit."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from asyncgrpo import report
from asyncgrpo.cli import main as cli_main
from asyncgrpo.local import progress
from asyncgrpo.testing import prometheus as p
from asyncgrpo.testing.net import free_port
from asyncgrpo.trainer.metrics import TrainerMetrics
from tests.observability.conftest import needs_prometheus


def test_host_port_gets_http_and_urls_stay():
    assert report.prometheus_url("localhost:9090") == "http://localhost:9090"
    assert report.prometheus_url("prom.monitoring:9090/") == "http://prom.monitoring:9090"
    assert report.prometheus_url("https://prom.example.com") == "https://prom.example.com"


@needs_prometheus
def test_a_prometheus_given_as_host_port_is_asked(tmp_path, capsys):
    with p.PrometheusServer(tmp_path / "prom", []) as prom:
        rc = cli_main(["report", "math", "--prometheus", f"127.0.0.1:{prom.port}",
                       "--since", "5m", "--out", str(tmp_path / "out")])
    assert rc == 0
    assert capsys.readouterr().out.startswith(
        f"{len(report.dashboard_panels())} panels in {tmp_path / 'out'}/index.md; no data for")


def test_an_unreachable_prometheus_is_one_line_and_a_failure():
    """Through the console entry point, as a person meets it: one line on stderr, no
    traceback, a non-zero exit."""
    port = free_port()
    done = subprocess.run([sys.executable, "-m", "asyncgrpo.cli", "report", "math",
                           "--prometheus", f"127.0.0.1:{port}"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        (f"asyncgrpo report: cannot reach Prometheus at http://127.0.0.1:{port}: "
        "[Errno 111] Connection refused")]


def test_a_local_folder_without_progress_is_one_line(tmp_path, capsys):
    assert cli_main(["report", "--local", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"asyncgrpo report: no progress.jsonl in {tmp_path}")
    assert len(err.splitlines()) == 1


def trl_window(step: int) -> dict[str, float]:
    return {"reward": 0.05 * step, "reward_std": 0.1, "sample/staleness_mean": 0.5,
            "sample/staleness_max": 1.0, "batch/packing_ratio": 2.0 + 0.1 * step,
            "perf/step_s": 2.0, "perf/rollout_wait_s": 0.5, "perf/fwd_bwd_s": 1.2,
            "perf/optimizer_s": 0.2, "perf/forwarded_tok_s_wall_clock": 300.0 + 10 * step}


def local_records(steps: int = 12) -> list[dict]:
    """Records as the local backend keeps them: the real trainer endpoint's exposition fed
    TRL-shaped windows, plus vLLM's counter and gauge, one record per step 3 s apart."""
    trainer, history, out = TrainerMetrics(), [], []
    for step in range(1, steps + 1):
        logs = trl_window(step)
        trainer.update_from_logs(logs)
        history.append({"reward": logs["reward"], "reward_std": logs["reward_std"],
                        "perf/step_s": 2.0, "step": step})
        text = trainer.exposition().decode() + (
            "# TYPE vllm:generation_tokens_total counter\n"
            f'vllm:generation_tokens_total{{model_name="m"}} {100 * step}\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{model_name="m"}} {0.01 * step}\n')
        rec = progress.record({"step": step, "policy_version": step + 1, "history": history},
                              progress.parse_metrics(text), now=1000.0 + 3 * step)
        out.append(rec)
    return out


def test_a_local_run_is_drawn_from_its_work_folder(tmp_path, capsys):
    work = tmp_path / "work"
    work.mkdir()
    for rec in local_records():
        progress.append(work / progress.PROGRESS_FILE, rec)
    out = tmp_path / "report"
    assert cli_main(["report", "--local", str(work), "--out", str(out)]) == 0
    drawn = {f.name: f.read_text() for f in out.glob("*.svg")}
    assert capsys.readouterr().out == f"{len(drawn)} panels in {out}/index.md\n"
    # what a local run without sandboxes feeds, each with its lines; nothing without data
    for prefix, legend in (("training-throughput", "work raw"),
                           ("reward-mean-and-spread", "work mean + std"),
                           ("policy-lag", "work max"),
                           ("tree-compression", "work"),
                           ("step-time", "work waiting for rollouts"),
                           ("vllm-generation-tokens-s", "work vLLM"),
                           ("vllm-kv-cache-usage", "work vLLM")):
        svg = next(v for k, v in drawn.items() if k.startswith(prefix))
        assert "<polyline" in svg and f">{legend}<" in svg, prefix
    assert len(drawn) == 7
    assert "no data" not in "".join(drawn.values())
    gen = next(v for k, v in drawn.items() if k.startswith("vllm-generation"))
    assert ">30<" in gen   # 100 tokens per 3 s: ~33/s, drawn up to the round 40 (ticks 0..40)


def test_per_interval_rates_and_histogram_means():
    recs = local_records(3)
    rate = report._per_interval(recs, "vllm:generation_tokens_total")
    assert [round(v, 3) for _, v in rate] == [33.333, 33.333]
    step = report._per_interval(recs, "asyncgrpo_trainer_step_seconds_sum",
                                "asyncgrpo_trainer_step_seconds_count")
    assert [v for _, v in step] == [2.0, 2.0]


@pytest.mark.parametrize(("lo", "hi", "ticks"), [
    (0, 0.546, [0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6]),
    (0, 1092, [0, 200, 400, 600, 800, 1000, 1200]),
    (0, 3.7, [0, 1, 2, 3, 4]),
    (-0.23, 0.41, [-0.4, -0.2, 0, 0.2, 0.4, 0.6]),
    (0, 0, [0, 0.2, 0.4, 0.6, 0.8, 1.0]),
])
def test_ticks_are_round_1_2_5_steps_covering_the_data(lo, hi, ticks):
    assert report.nice_ticks(lo, hi) == pytest.approx(ticks)


def _labels(svg: str) -> list[tuple[float, str, str]]:
    return [(float(x), anchor, text) for x, anchor, text in re.findall(
        r'<text x="([\d.]+)" y="[\d.]+" text-anchor="(\w+)">([^<]*)</text>', svg)]


def test_tick_labels_are_round_and_fit_in_the_picture():
    """The old picture: y ticks at a quarter of the maximum (0.273, 0.546) and its last x
    label, centred on the right edge, cut ("1.4 mi")."""
    t0 = 1_700_000_000.0
    for step_s, xticks, unit in ((8.0, ["0", "20", "40", "60", "80"], "seconds"),
                                 (9.0 * 60 / 10, ["0", "2", "4", "6", "8"], "minutes")):
        panel = report.Panel("Reward", "", [report.Series("a", [(t0 + step_s * i, 0.0546 * i)
                                                                for i in range(11)])])
        svg = report.svg(panel, width=720)
        labels = _labels(svg)
        ys = [t for x, a, t in labels if a == "end" and x < 64]
        assert ys == ["0.0", "0.1", "0.2", "0.3", "0.4", "0.5", "0.6"]
        xs = [(x, a, t) for x, a, t in labels if a != "end" or x > 64]
        assert [t for _, _, t in xs] == xticks
        for x, anchor, text in xs:   # every label inside the picture (0.56 em a character)
            half = 0.56 * 11 * len(text) / 2
            assert (x + half if anchor == "middle" else x) <= 720, (x, anchor, text)
        assert f"{unit} since the first point" in svg


def test_a_long_legend_wraps_and_the_plot_keeps_its_height():
    t0 = 1_700_000_000.0
    series = [report.Series(f"run-with-a-long-name state-{i}", [(t0, i), (t0 + 60, i + 1)])
              for i in range(6)]
    svg = report.svg(report.Panel("Sandboxes by state", "", series))
    plot = re.search(r'<rect x="64" y="30" width="\d+" height="(\d+)"', svg)
    assert plot and int(plot.group(1)) >= 150
    legend_y = {int(y) for y in re.findall(r'<rect x="[\d.]+" y="(\d+)" width="10"', svg)}
    assert len(legend_y) == 2   # 6 entries, three to a row in 632 px
    for x, name in re.findall(r'<text x="([\d.]+)" y="\d+">(run-with[^<]*)</text>', svg):
        assert float(x) + 0.56 * 11 * len(name) <= 720


def test_a_panel_whose_points_share_one_instant_is_drawn():
    """CI (stop 32): a panel fed once in a 5 min window had all points at one timestamp, and
    the x scale's 1e-9 s span vanished next to an epoch of 1.8e9 s (ZeroDivisionError)."""
    t0 = 1_796_309_253.837
    for values in ([0.0], [0.0, 0.0], [3.0, 1.0]):
        series = [report.Series(f"s{i}", [(t0, v)]) for i, v in enumerate(values)]
        svg = report.svg(report.Panel("Policy lag", "steps", series))
        assert svg.endswith("</svg>") and "nan" not in svg.lower()
        assert _labels(svg)   # ticks are drawn
