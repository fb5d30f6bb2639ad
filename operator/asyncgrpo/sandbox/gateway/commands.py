"""`asyncgrpo gateway`: the gateway's flags, each with an environment default
(`ASYNCGRPO_GATEWAY_*`; common/serving.py), and its start."""

from __future__ import annotations

import argparse
import logging
import sys

from asyncgrpo.sandbox.common.serving import add_flag as _add
from asyncgrpo.sandbox.common.serving import bind_host as _bind_host
from asyncgrpo.sandbox.common.serving import read_token, uvicorn_run
from asyncgrpo.wire import (
    GATEWAY_ENV_PREFIX,
    GATEWAY_PORT,
    GATEWAY_TOKEN_ENV,
    SANDBOX_PORT,
    SANDBOX_TOKEN_ENV,
)


def register(subparsers) -> None:
    bind_host = _bind_host()
    gw = subparsers.add_parser("gateway", help="the per-run gateway that leases sandboxes to rollout groups")
    G = GATEWAY_ENV_PREFIX
    _add(gw, "--host", G + "HOST", bind_host)
    _add(gw, "--port", G + "PORT", GATEWAY_PORT, int)
    _add(gw, "--members", G + "MEMBERS", None,
         help_="comma-separated sandbox base URLs (a fixed list: run `reuse`); omit to watch pods on Kubernetes")
    _add(gw, "--members-file", G + "MEMBERS_FILE", None,
         help_="JSON file {name: base URL} of the sandboxes, followed while the gateway runs (the local "
               "backend's pool rewrites it as it replaces retired sandboxes); omit to watch pods")
    _add(gw, "--namespace", G + "NAMESPACE", None,
         help_="namespace of the sandbox pods (default: the gateway pod's own namespace)")
    _add(gw, "--selector", G + "SELECTOR", None, help_="label selector of the run's sandbox pods")
    _add(gw, "--sandbox-port", G + "SANDBOX_PORT", SANDBOX_PORT, int, help_="port of the sandbox server in pods")
    _add(gw, "--token-file", G + "TOKEN_FILE", None, help_=f"file holding {GATEWAY_TOKEN_ENV}")
    _add(gw, "--sandbox-token-file", G + "SANDBOX_TOKEN_FILE", None, help_=f"file holding {SANDBOX_TOKEN_ENV}")
    _add(gw, "--lease-ttl-seconds", G + "LEASE_TTL_SECONDS", 60.0, float,
         help_="a lease with no heartbeat or call for this long is taken back")
    _add(gw, "--lease-max-seconds", G + "LEASE_MAX_SECONDS", 6 * 3600.0, float,
         help_="hard limit on one lease's life, heartbeats or not")
    _add(gw, "--max-wait-seconds", G + "MAX_WAIT_SECONDS", 300.0, float,
         help_="longest a lease request may wait for a sandbox")
    _add(gw, "--health-interval-seconds", G + "HEALTH_INTERVAL_SECONDS", 5.0, float)
    _add(gw, "--health-timeout-seconds", G + "HEALTH_TIMEOUT_SECONDS", 3.0, float)
    _add(gw, "--health-failures", G + "HEALTH_FAILURES", 2, int,
         help_="consecutive failed health checks that take a sandbox out")
    _add(gw, "--max-body-bytes", G + "MAX_BODY_BYTES", 1 << 20, int,
         help_="largest JSON request body; proxied streamed execs pass their stdin through")
    _add(gw, "--max-exec-seconds", G + "MAX_EXEC_SECONDS", 600.0, float,
         help_="upper bound of a proxied exec (the sandbox enforces its own)")
    _add(gw, "--data-path", G + "DATA_PATH", "direct", help_="direct: clients call the leased sandbox "
         "themselves (the lease gives its address); proxied: through the gateway (when the "
         "trainer may not reach sandbox pods)")
    _add(gw, "--lifecycle", G + "LIFECYCLE", "fresh", help_="fresh: a sandbox serves one group, then "
         "is retired and its pod replaced by the operator; reuse: reset and leased again (trusted "
         "workloads). A fixed --members list cannot be replaced and runs reuse; a --members-file can")
    _add(gw, "--max-waiters-per-client", G + "MAX_WAITERS_PER_CLIENT", 1024, int,
         help_="lease requests one client address may have waiting; more are refused with 429")
    _add(gw, "--max-images", G + "MAX_IMAGES", 8, int,
         help_="row images (spec.sandboxes.imageColumn) leased at once; a lease for one more "
         "is refused with 429 too_many_images")
    _add(gw, "--image-idle-seconds", G + "IMAGE_IDLE_SECONDS", 600.0, float,
         help_="a row image no lease asked for this long, with no sandbox, is out of use")
    gw.set_defaults(func=serve_gateway)


def serve_gateway(args: argparse.Namespace) -> int:
    from asyncgrpo.sandbox.common.prctl import make_non_dumpable
    from asyncgrpo.sandbox.gateway.app import create_gateway
    from asyncgrpo.sandbox.gateway.members import member_source_from_args

    token = read_token(GATEWAY_TOKEN_ENV, args.token_file)
    sandbox_token = read_token(SANDBOX_TOKEN_ENV, args.sandbox_token_file)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    # popping the tokens from os.environ leaves them in /proc/<pid>/environ (the initial
    # environment block): non-dumpable makes that file root's, so a sandbox command under
    # the same uid (non-root local mode) cannot read either token
    if not make_non_dumpable():
        logging.getLogger("asyncgrpo.gateway").warning("could not make the gateway non-dumpable")
    try:
        settings = _gateway_settings(args, token, sandbox_token)
    except ValueError as err:
        raise SystemExit(f"gateway: {err}") from err
    source = member_source_from_args(args)
    return uvicorn_run(create_gateway(settings, source), args.host, args.port)


def _gateway_settings(args: argparse.Namespace, token: str, sandbox_token: str):
    from asyncgrpo.sandbox.gateway.app import GatewaySettings

    return GatewaySettings(
        token=token,
        sandbox_token=sandbox_token,
        lease_ttl_seconds=args.lease_ttl_seconds,
        lease_max_seconds=args.lease_max_seconds,
        max_wait_seconds=args.max_wait_seconds,
        health_interval_seconds=args.health_interval_seconds,
        health_timeout_seconds=args.health_timeout_seconds,
        health_failures=args.health_failures,
        max_body_bytes=args.max_body_bytes,
        max_exec_seconds=args.max_exec_seconds,
        data_path=args.data_path,
        lifecycle=args.lifecycle,
        max_waiters_per_client=args.max_waiters_per_client,
        max_images=args.max_images,
        image_idle_seconds=args.image_idle_seconds,
    )
