"""Real Prometheus, real components as local processes: a sandbox gateway and two sandbox
servers, the trainer's metrics endpoint. Every dashboard panel and rule that these feed
returns data through Prometheus's HTTP API, and two forced faults (a sandbox that dies, a
trainer whose step stops moving) fire their alerts from the chart's own rules file.

The trainer endpoint is the real `TrainerMetrics` server, fed with logging windows shaped as
TRL's AsyncGRPOTrainer writes them (a real training run is the node e2e's part)."""

from __future__ import annotations

import httpx
import pytest

from asyncgrpo import report
from asyncgrpo.cli import main as cli_main
from asyncgrpo.testing import prometheus as p
from asyncgrpo.trainer.metrics import TrainerMetrics
from tests.observability.conftest import needs_prometheus
from tests.sandbox.conftest import GW_TOKEN, start_gateway, start_sandbox, wait_until

LABELS = {"namespace": "team-a", "run": "math"}

pytestmark = [needs_prometheus]


def trl_window(step: int) -> dict[str, float]:
    """One logging window as TRL's async trainer reduces it (keys of
    trl.experimental.async_grpo.async_grpo_trainer)."""
    return {"reward": 0.25 + 0.05 * step, "reward_std": 0.1, "sample/staleness_mean": 0.5,
            "sample/staleness_max": 1.0, "sample/dropped_stale_total": 1.0,
            "sample/rollout_queue_size": 3.0, "batch/packing_ratio": 2.5,
            "perf/step_s": 2.0, "perf/rollout_wait_s": 0.5, "perf/fwd_bwd_s": 1.2,
            "perf/optimizer_s": 0.2, "perf/weight_sync_s": 0.1,
            "perf/forwarded_tok_s_wall_clock": 400.0,
            # the rollout worker's affine routing over two replicas (trainer.routed_loop)
            "routing/10.1.0.7:8000/requests_total": 12.0, "routing/10.1.0.8:8000/requests_total": 9.0,
            "routing/10.1.0.8:8000/failovers_total": 1.0,
            "routing/10.1.0.7:8000/groups_in_flight": 2.0,
            "routing/10.1.0.8:8000/groups_in_flight": 1.0}


@pytest.fixture
def components(tmp_path):
    sbs = [start_sandbox(tmp_path, f"sb{i}") for i in range(2)]
    gw = start_gateway(tmp_path, [s.url for s in sbs], "--health-interval-seconds", "0.3",
                       "--health-failures", "1")
    trainer, stalled = TrainerMetrics(), TrainerMetrics()
    ports = [trainer.serve(0, host="127.0.0.1"), stalled.serve(0, host="127.0.0.1")]
    try:
        yield {"gateway": gw, "sandboxes": sbs, "trainer": trainer, "stalled": stalled,
               "targets": [f"127.0.0.1:{port}" for port in ports]}
    finally:
        trainer.close()
        stalled.close()
        gw.stop()
        for s in sbs:
            s.stop()


def test_every_panel_and_rule_the_components_feed_has_data_and_faults_fire(components,
                                                                          tmp_path):
    gw, sbs, trainer = components["gateway"], components["sandboxes"], components["trainer"]
    jobs = [
        p.static_job("trainer", components["targets"][:1],
                     {**LABELS, "pod": "math-trainer-0", "component": "trainer"}),
        p.static_job("stalled-trainer", components["targets"][1:],
                     {"namespace": "team-a", "run": "stuck", "pod": "stuck-trainer-0",
                      "component": "trainer"}),
        p.static_job("gateway", [gw.url.removeprefix("http://")],
                     {**LABELS, "pod": "math-gateway-0", "component": "gateway"}),
        p.static_job("sandbox", [s.url.removeprefix("http://") for s in sbs],
                     {**LABELS, "component": "sandbox"}),
    ]
    rules = p.rules_file(tmp_path / "rules.yaml", hold="0s")
    # the fault: a trainer stuck at step 5 since before Prometheus began to watch it
    components["stalled"].set("step", 5)
    with p.PrometheusServer(tmp_path / "prom", jobs, rule_files=[rules]) as prom:
        prom.wait_for_targets_up(5)
        # the other trains three steps, each seen by Prometheus
        for step in (1, 2, 3):
            trainer.update_from_logs(trl_window(step))
            trainer.set("step", step)
            trainer.set("policy_version", step)
            seen = f'asyncgrpo_trainer_step{{run="math"}} == {step}'
            prom.wait(lambda q=seen: prom.query(q), what=f"step {step} scraped")
        # rollouts lease sandboxes and run tools through the gateway
        wait_until(lambda: httpx.get(f"{gw.url}/v1/demand").json()["idle"] == 2, 30,
                   what="both sandboxes warm")
        auth = {"authorization": f"Bearer {GW_TOKEN}"}
        for g in range(3):
            lease = httpx.post(f"{gw.url}/v1/leases", json={"group_id": f"g{g}"}, headers=auth,
                               timeout=60).json()
            h = {"authorization": f"Bearer {lease['secret']}"}
            r = httpx.post(f"{gw.url}/v1/leases/{lease['lease_id']}/exec",
                           json={"command": "echo hi"}, headers=h, timeout=60)
            assert r.status_code == 200, r.text
            httpx.delete(f"{gw.url}/v1/leases/{lease['lease_id']}", headers=h, timeout=60)
        # the fault: a sandbox dies; the gateway's health check takes it out of service
        wait_until(lambda: httpx.get(f"{gw.url}/v1/demand").json()["idle"] == 2, 30,
                   what="both sandboxes warm again")
        sbs[1].kill()
        try:
            wait_until(lambda: "asyncgrpo_gateway_sandbox_failures_total{" in
                       httpx.get(f"{gw.url}/metrics").text, 30, what="a failure counted")
        except AssertionError:
            raise AssertionError(gw.logs()[-3000:]) from None
        prom.wait(lambda: prom.query("asyncgrpo_gateway_sandbox_failures_total"),
                  what="Prometheus scraped the gateway's count of the dead sandbox")

        running = {"trainer", "gateway", "sandbox"}
        result = [p.missing_data(prom, running)]

        def all_have_data():
            result[0] = p.missing_data(prom, running)
            return not result[0][0]
        assert prom.wait(lambda: all_have_data() or None, timeout=60,
                         what=lambda: f"data for {[c.source for c in result[0][0]]}")
        skipped = result[0][1]
        # what this test cannot feed is exactly what needs vLLM, the operator, or a full
        # fine-tuning run's weights pullers
        assert {c for s in skipped for c in s.components} - running == \
            {"vllm", "operator", "weights"}
        checked = len(p.panel_queries() + p.rule_queries()) - len(skipped)
        assert checked >= 20, checked

        # the chart's alerts, evaluated by Prometheus on the real series
        firing = prom.wait(lambda: {"AsyncGRPOGatewaySandboxFailures", "AsyncGRPOTrainerStalled"}
                           <= prom.firing() and prom.firing(), timeout=60,
                           what=f"the fault alerts firing (now: {prom.alerts()})")
        assert "AsyncGRPOLeaseWaitTimeouts" not in firing
        stalled = {a["labels"]["run"] for a in prom.alerts()
                   if a["labels"]["alertname"] == "AsyncGRPOTrainerStalled"}
        assert stalled == {"stuck"}
        alert = next(a for a in prom.alerts()
                     if a["labels"]["alertname"] == "AsyncGRPOGatewaySandboxFailures")
        assert (alert["labels"]["namespace"], alert["labels"]["run"]) == ("team-a", "math")
        # the recording rules Prometheus loaded are the chart's, and evaluate without error
        loaded = {r["name"] for g in prom.rules() for r in g["rules"]}
        assert {c.source.split(": ")[1].split(" ")[0] for c in p.rule_queries()} <= loaded
        assert all(r["health"] == "ok" for g in prom.rules() for r in g["rules"])

        # `asyncgrpo report` draws the main panels from query_range: the ones these
        # components feed have lines, and nothing of the other run leaks into this one
        out = tmp_path / "report"
        rc = cli_main(["report", "math", "--namespace", "team-a", "--prometheus", prom.url,
                       "--since", "5m", "--step", "1s", "--out", str(out)])
        assert rc == 0
        drawn = {f.name: f.read_text() for f in out.glob("*.svg")}
        assert len(drawn) == len(report.dashboard_panels())
        for panel, legend in (("reward-mean-and-spread", "math mean + std"),
                              ("step-time-waiting-for-rollouts-vs-training", "math training"),
                              ("gateway-lease-wait-p50-p99", "math p99"),
                              ("gateway-execs-s", "math")):
            svg = next(v for k, v in drawn.items() if k.startswith(panel))
            assert "<polyline" in svg and legend in svg, panel
        assert "stuck" not in "".join(drawn.values())
        assert "no data" in next(v for k, v in drawn.items() if k.startswith("vllm"))
        index = (out / "index.md").read_text()
        assert all(f"]({name})" in index for name in drawn)


def test_docs_list_every_metric_with_a_unit():
    """docs/observability.md has a row for every metric the components export."""
    from asyncgrpo.controller.metrics import OperatorMetrics
    from asyncgrpo.sandbox.gateway.metrics import GatewayMetrics
    from asyncgrpo.sandbox.server.metrics import SandboxMetrics
    from asyncgrpo.trainer.metrics import METRICS, PREFIX

    doc = (p.REPO / "docs" / "observability.md").read_text()
    rows = {line.split("|")[1].strip().strip("`"): line for line in doc.splitlines()
            if line.startswith("| `")}
    names = {m.name + ("_total" if m.type == "counter" else "")
             for r in (OperatorMetrics().registry, GatewayMetrics().registry,
                       SandboxMetrics().registry) for m in r.collect()}
    names |= {PREFIX + n for n in METRICS} | {PREFIX + "node_info"}
    names |= {n + "_total" if n.endswith(("_hits", "_queries", "_tokens")) else n
              for n in p.VLLM_METRICS}
    assert names <= set(rows), names - set(rows)
    for name in names:   # a unit column that says something
        cells = [c.strip() for c in rows[name].split("|")]
        assert all(cells[1:-1]), rows[name]
