"""What `asyncgrpo sandbox serve` and `asyncgrpo gateway` share: flags with an environment
default, tokens read from the environment or a file, and the uvicorn server both run.

Every flag can also come from an `ASYNCGRPO_SANDBOX_*` / `ASYNCGRPO_GATEWAY_*` variable, so
the operator's pod builders set env and never assemble command lines. Tokens come only from
the environment or a file, never from a flag: argv is world-readable in /proc.
"""

from __future__ import annotations

import argparse
import os

from asyncgrpo.wire import BIND_HOST_ENV, LOG_LEVEL_ENV


def bind_host() -> str:
    return os.environ.get(BIND_HOST_ENV) or "0.0.0.0"


def add_flag(p: argparse.ArgumentParser, flag: str, env: str, default, type_=str, help_=""):
    # argparse runs `type` on a string default, so a value from the environment is parsed
    # (and rejected) exactly like one from the command line
    p.add_argument(flag, default=os.environ.get(env, default), type=type_,
                   help=f"{help_} [env {env}; default {default}]".strip())


def read_token(env_name: str, file_path: str | None) -> str:
    """Read the token, then drop it from this process's environment so no child inherits it."""
    token = os.environ.pop(env_name, "")
    if file_path:
        with open(file_path) as f:
            token = f.read().strip()
    if not token:
        raise SystemExit(f"no token: set {env_name} (or --token-file); every request must carry it")
    return token


def uvicorn_run(app, host: str, port: int) -> int:
    import uvicorn

    uvicorn.Server(uvicorn_config(app, host, port)).run()
    return 0


def uvicorn_config(app, host: str, port: int, **extra):
    import uvicorn

    from asyncgrpo.sandbox.common.http_guard import header_timeout_protocol

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=os.environ.get(LOG_LEVEL_ENV, "warning").lower(),
        access_log=False,
        timeout_keep_alive=30,  # the gateway's client drops idle connections at 15 s
        # h11 enforces the header size cap below (httptools would not); the subclass closes
        # connections that do not finish their request head within 10 s
        http=header_timeout_protocol(on_expire=getattr(app, "on_reject", None)),
        # asyncio's own loop: uvicorn would pick uvloop wherever it is installed (uvicorn
        # [standard], trackio, ...), and uvloop's subprocess_exec refuses user/group: every
        # exec of a sandbox that drops to the command uid would answer 500
        loop="asyncio",
        ws="none",  # no websocket route: never import a websockets library (the server's bundle has none)
        backlog=4096,
        h11_max_incomplete_event_size=64 * 1024,  # caps request line + headers
        **extra,
    )
