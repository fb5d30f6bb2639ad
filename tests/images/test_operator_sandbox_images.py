"""The operator and sandbox images, run as the chart and the operator run them: non-root
(uid 65532), read-only root filesystem, writable /tmp only."""

from __future__ import annotations

import pytest

from tests.conftest import free_port
from tests.images import containers
from tests.images.containers import REPO, Container, podman

pytestmark = [pytest.mark.images]

READ_ONLY = ["--read-only", "--tmpfs", "/tmp:rw,mode=1777", "--cap-drop", "ALL",
             "--security-opt", "no-new-privileges"]
TOKEN = "image-test-token-0123456789abcdef"


def test_image_users_are_the_pods_uid(operator_image, sandbox_image):
    for ref in (operator_image, sandbox_image):
        user = podman("image", "inspect", "--format", "{{.Config.User}}", ref).stdout.strip()
        assert user == "65532:65532", (ref, user)


def test_operator_crd_equals_the_checked_in_crd(operator_image):
    r = podman("run", "--rm", *READ_ONLY, operator_image, "crd")
    assert r.stdout == (REPO / "crds" / "asyncgrpo.dev_asyncgrporuns.yaml").read_text()


def test_operator_help_runs_non_root_on_a_read_only_root(operator_image):
    r = podman("run", "--rm", *READ_ONLY, operator_image, "operator", "--help")
    assert "--all-namespaces" in r.stdout
    ident = podman("run", "--rm", *READ_ONLY, "--entrypoint", "id", operator_image)
    assert ident.stdout.startswith("uid=65532(asyncgrpo) gid=65532(asyncgrpo)"), ident.stdout
    # nothing outside /tmp is writable
    touch = podman("run", "--rm", *READ_ONLY, "--entrypoint", "touch", operator_image,
                   "/usr/local/x", check=False)
    assert touch.returncode != 0 and "Read-only file system" in touch.stderr


@pytest.fixture
def sandbox(sandbox_image, tmp_path):
    port = free_port()
    workspace = containers.empty_dir(tmp_path / "workspace")
    c = Container(sandbox_image, [], name_hint="sandbox", run_opts=[
        *READ_ONLY, "-v", f"{workspace}:/workspace",
        "-e", f"ASYNCGRPO_SANDBOX_TOKEN={TOKEN}", "-e", "ASYNCGRPO_SANDBOX_HOST=127.0.0.1",
        "-e", f"ASYNCGRPO_SANDBOX_PORT={port}"])
    try:
        url = f"http://127.0.0.1:{port}"
        containers.wait_http(f"{url}/healthz", c, timeout=120)
        yield url
    finally:
        c.stop()


def test_sandbox_serves_refuses_without_token_and_runs_as_its_uid(sandbox):
    """The gateway's protocol: a reset with the run token admits the next lease's secret;
    execs need that secret (the run token alone opens only the control calls)."""
    body = {"command": "id -u; id -g; touch ~/made && ls ~"}
    for headers in ({}, {"authorization": "Bearer wrong-token"},
                    {"authorization": f"Bearer {TOKEN}"}):
        status, _ = containers.http("POST", f"{sandbox}/v1/exec", body, headers=headers)
        assert status == 401, headers
    from asyncgrpo.sandbox.common.challenge import reset_call

    secret = "lease-secret-for-the-image-test"
    status, _ = containers.http("POST", f"{sandbox}/v1/reset", {}, headers={"authorization": f"Bearer {TOKEN}"})
    assert status == 401  # the token itself is never accepted on the wire
    call = reset_call(TOKEN, sandbox, secret)
    status, out = containers.http("POST", f"{sandbox}/v1/reset", {}, headers=call.headers)
    assert status == 200 and out["leased"] and call.proven_by(out), out
    lease = {"authorization": f"Bearer {secret}"}
    status, out = containers.http("POST", f"{sandbox}/v1/exec", body, headers=lease)
    assert status == 200, out
    assert out["exit_code"] == 0, out
    assert out["stdout"].split() == ["65532", "65532", "made"]
    # the token was removed from the server's environment: commands cannot see it
    status, out = containers.http("POST", f"{sandbox}/v1/exec",
                                  {"command": "env; cat /proc/1/environ 2>&1 || true"},
                                  headers=lease)
    assert status == 200 and TOKEN not in out["stdout"] + out["stderr"], out