"""A sandbox image per row, through a real gateway and real sandbox servers.

The members file says each sandbox's image key, as a pod's `asyncgrpo.dev/sandbox-image`
label does on a cluster; each server's template holds a file naming its image, so what a
rollout's command reads proves which sandbox it got. The trainer's harness asks for the
row's image (`image_column`), and the code-fix reward scores in a sandbox of the row's image.
"""

from __future__ import annotations

import json

import httpx
import pytest

from asyncgrpo.sandbox.client.environment import SandboxEnvironmentFactory
from asyncgrpo.sandbox.client.gateway_client import GatewayClient, NoSandbox, SandboxError
from asyncgrpo.wire import sandbox_image_key
from tests.sandbox.conftest import GW_TOKEN, start_gateway, start_sandbox, wait_until

TASK_A = "registry.example/swe/task-a:1"
TASK_B = "registry.example/swe/task-b:1"
RUN_IMAGE = "ghcr.io/asyncgrpo/sandbox:0.1.0"


@pytest.fixture
def gateway(tmp_path, monkeypatch):
    """Two sandboxes of the run's own image, two of TASK_A, none of TASK_B; max 2 row images."""
    members, sbs = {}, []
    for name, image in (("own-0", None), ("own-1", None), ("a-0", TASK_A), ("a-1", TASK_A)):
        template = tmp_path / f"template-{name}"
        template.mkdir()
        (template / "IMAGE").write_text(image or "own")
        sb = start_sandbox(tmp_path, name, "--template", str(template))
        sbs.append(sb)
        members[name] = {"url": sb.url, "image": sandbox_image_key(image)}
    (tmp_path / "members.json").write_text(json.dumps(members))
    gw = start_gateway(tmp_path, None, "--members-file", str(tmp_path / "members.json"),
                       "--health-interval-seconds", "0.3", "--lifecycle", "reuse",
                       "--max-images", "2")
    monkeypatch.setenv("ASYNCGRPO_GATEWAY_TOKEN", GW_TOKEN)
    wait_until(lambda: httpx.get(f"{gw.url}/v1/demand").json()["idle"] == 4, 30, what="pool warm")
    yield gw
    gw.stop()
    for s in sbs:
        s.stop()


def test_a_row_naming_an_image_gets_a_sandbox_of_it_and_one_naming_none_the_runs(gateway):
    factory = SandboxEnvironmentFactory(num_generations=2, gateway_url=gateway.url, tools=["shell"],
                                        image_column="image", default_image=RUN_IMAGE,
                                        heartbeat_seconds=0.5)
    envs = [factory() for _ in range(4)]
    rows = [{"prompt": "x", "image": TASK_A}, {"prompt": "x", "image": TASK_A},
            {"prompt": "x", "image": None}, {"prompt": "x", "image": RUN_IMAGE}]
    for env, row in zip(envs, rows):
        env.reset(**row)
    seen = [env.shell("cat IMAGE") for env in envs]
    assert seen == [f"exit code: 0\nstdout:\n{x}" for x in (TASK_A, TASK_A, "own", "own")]
    d = httpx.get(f"{gateway.url}/v1/demand").json()
    a = d["images"][sandbox_image_key(TASK_A)]
    assert (a["image"], a["busy"], a["idle"]) == (TASK_A, 2, 0)
    assert d["images"]["default"]["busy"] == 2
    for env in envs:
        env.get_reward()


def test_an_image_without_sandboxes_waits_and_is_reported_and_a_third_is_refused(gateway):
    client = GatewayClient(gateway.url, GW_TOKEN)
    with pytest.raises(NoSandbox):   # no pod of TASK_B: the lease waits, then gives up
        client.lease("group-b", wait_seconds=1.0, image=TASK_B)
    d = httpx.get(f"{gateway.url}/v1/demand").json()
    assert d["images"][sandbox_image_key(TASK_B)]["image"] == TASK_B  # the operator's cue
    assert d["idle"] == 4   # no sandbox of another image was handed out instead
    with pytest.raises(SandboxError) as refused:   # TASK_A and TASK_B in use: max 2
        client.lease("group-c", wait_seconds=1.0, image="registry.example/swe/task-c:1")
    assert refused.value.status == 429 and refused.value.error == "too_many_images"
    assert "maxDistinct" in refused.value.detail
    with pytest.raises(SandboxError) as malformed:
        client.lease("group-d", wait_seconds=1.0, image="Not An/Image")
    assert malformed.value.status == 422
    lease = client.lease("group-a", wait_seconds=5.0, image=TASK_A)
    assert lease.sandbox in ("a-0", "a-1")
    client.release(lease, all_holders=True)


def test_the_code_fix_reward_scores_each_completion_in_its_rows_image(gateway):
    from asyncgrpo.rewards import SandboxTestsArgs
    from asyncgrpo.sandbox.client.rewards import sandbox_tests

    test = 'test "$(cat IMAGE)" = "$EXPECTED"'   # passes only in a sandbox of the row's image
    args = SandboxTestsArgs(gateway_url=gateway.url, image_column="image", extract=False,
                            lease_wait_seconds=10)
    rewards = sandbox_tests(["x", "x", "x"], args,
                            image=[TASK_A, None, TASK_A],
                            test_command=[f"EXPECTED={TASK_A}; {test}", f"EXPECTED=own; {test}",
                                          f"EXPECTED=own; {test}"])
    assert rewards == [1.0, 1.0, 0.0]
