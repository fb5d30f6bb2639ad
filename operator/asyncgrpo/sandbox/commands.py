"""`asyncgrpo sandbox serve` and `asyncgrpo gateway`: flags, each with an environment default.

Every flag can also come from an `ASYNCGRPO_SANDBOX_*` / `ASYNCGRPO_GATEWAY_*` variable, so
the operator's pod builders set env and never assemble command lines. Tokens come only from
the environment or a file, never from a flag: argv is world-readable in /proc.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from asyncgrpo.sandbox.quota import DEFAULT_MAX_WORKSPACE_BYTES
from asyncgrpo.wire import (
    BIND_HOST_ENV,
    GATEWAY_ENV_PREFIX,
    GATEWAY_PORT,
    GATEWAY_TOKEN_ENV,
    LOG_LEVEL_ENV,
    SANDBOX_ENV_PREFIX,
    SANDBOX_PORT,
    SANDBOX_TOKEN_ENV,
    SANDBOX_WORKSPACE,
)


def _add(p: argparse.ArgumentParser, flag: str, env: str, default, type_=str, help_=""):
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


def register(subparsers) -> None:
    bind_host = os.environ.get(BIND_HOST_ENV) or "0.0.0.0"
    sb = subparsers.add_parser("sandbox", help="the sandbox server that runs in each sandbox pod")
    sbsub = sb.add_subparsers(dest="sandbox_command", metavar="ACTION", required=True)
    serve = sbsub.add_parser("serve", help="serve exec/files/reset over HTTP")
    E = SANDBOX_ENV_PREFIX
    _add(serve, "--host", E + "HOST", bind_host)
    _add(serve, "--port", E + "PORT", SANDBOX_PORT, int)
    _add(serve, "--workspace", E + "WORKSPACE", SANDBOX_WORKSPACE, help_="root of the sessions")
    _add(serve, "--template", E + "TEMPLATE", None,
         help_="read-only directory copied into each session (the task's initial files)")
    _add(serve, "--token-file", E + "TOKEN_FILE", None, help_=f"file holding the token instead of {SANDBOX_TOKEN_ENV}")
    _add(serve, "--command-uid", E + "COMMAND_UID", "auto", _uid_arg,
         help_="uid commands run as when the server starts as root (ignored otherwise); auto: a uid "
               "of this server's own, from a range no other sandbox server on the machine holds")
    _add(serve, "--command-gid", E + "COMMAND_GID", "auto", _uid_arg,
         help_="gid for commands, as above; auto: the same number as the uid (a group of its own)")
    _add(serve, "--max-procs", E + "MAX_PROCS", 512, int, help_="RLIMIT_NPROC of commands (fork bombs)")
    _add(serve, "--max-file-bytes", E + "MAX_FILE_BYTES", 1 << 30, int, help_="RLIMIT_FSIZE of commands")
    _add(serve, "--max-memory-bytes", E + "MAX_MEMORY_BYTES", -1, int,
         help_="RLIMIT_AS of each command; 0: none; -1: --cgroup-memory-bytes when the server could "
               "make no cgroup and is not PID 1 of a pod's namespace (a local process), else none")
    _add(serve, "--cgroup-memory-bytes", E + "CGROUP_MEMORY_BYTES", 2 << 30, int,
         help_="memory of all commands together, in a cgroup the server creates where it can "
               "(root, writable cgroup fs); else the pod's limit bounds them; 0: no cgroup")
    _add(serve, "--cgroup-pids", E + "CGROUP_PIDS", 1024, int,
         help_="processes and threads of all commands together, in that cgroup")
    _add(serve, "--max-output-bytes", E + "MAX_OUTPUT_BYTES", 1 << 20, int, help_="output kept per stream")
    _add(serve, "--max-timeout-seconds", E + "MAX_TIMEOUT_SECONDS", 600.0, float)
    _add(serve, "--default-timeout-seconds", E + "DEFAULT_TIMEOUT_SECONDS", 60.0, float)
    _add(serve, "--max-body-bytes", E + "MAX_BODY_BYTES", 1 << 20, int,
         help_="largest JSON request body (a write_file's content, an inline stdin); larger stdin "
               "goes through /v1/exec/stream, fed to the command as it arrives")
    _add(serve, "--max-workspace-bytes", E + "MAX_WORKSPACE_BYTES", DEFAULT_MAX_WORKSPACE_BYTES, int,
         help_="disk the workspace may use, measured after each exec and write and every second "
               "while execs run; over it, commands are killed and sessions reset (507 workspace_full); "
               "0: not measured (a pod's emptyDir size limit still holds)")
    _add(serve, "--max-read-bytes", E + "MAX_READ_BYTES", 8 << 20, int)
    _add(serve, "--max-concurrent-execs", E + "MAX_CONCURRENT_EXECS", 64, int,
         help_="execs running at once; more wait their turn")
    _add(serve, "--shell", E + "SHELL", "/bin/bash")
    _add(serve, "--wipe-dirs", E + "WIPE_DIRS", "/tmp,/dev/shm,/dev/mqueue",
         help_="shared scratch directories a reset empties of what commands left there (root: entries "
               "of the command uid; non-root: entries of the server's uid, only as PID 1 of a pod's "
               "namespace, where nothing else lives); empty: none")
    serve.set_defaults(func=serve_sandbox)

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
    gw.set_defaults(func=serve_gateway)


def _uid_arg(value: str) -> int | None:
    return None if str(value) == "auto" else int(value)


def _uvicorn_run(app, host: str, port: int) -> int:
    import uvicorn

    uvicorn.Server(_uvicorn_config(app, host, port)).run()
    return 0


def _uvicorn_config(app, host: str, port: int, **extra):
    import uvicorn

    from asyncgrpo.sandbox.http_guard import header_timeout_protocol

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
        backlog=4096,
        h11_max_incomplete_event_size=64 * 1024,  # caps request line + headers
        **extra,
    )


def serve_sandbox(args: argparse.Namespace) -> int:
    import asyncio

    import uvicorn

    from asyncgrpo.sandbox.cgroup import CommandCgroup
    from asyncgrpo.sandbox.process import (
        CommandLimits,
        allocate_command_uid,
        find_launcher,
        harden_server_process,
        inherit_limits,
        kill_uid,
    )
    from asyncgrpo.sandbox.server import SandboxServer, ServerSettings
    from asyncgrpo.sandbox.stopping import StopSignals

    token = read_token(SANDBOX_TOKEN_ENV, args.token_file)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    log = logging.getLogger("asyncgrpo.sandbox")
    as_root = os.geteuid() == 0
    if as_root and (args.command_uid == 0 or args.command_gid == 0):
        raise SystemExit("sandbox: --command-uid/--command-gid 0 would run commands as root, with the "
                         "server's rights over its own files and token; give an unprivileged id")
    uid = gid = None
    if as_root:
        # a uid of this server's own: another sandbox's commands can neither read its files,
        # signal its commands, read their environment nor share its RLIMIT_NPROC budget
        uid = args.command_uid if args.command_uid is not None else allocate_command_uid()
        gid = args.command_gid if args.command_gid is not None else uid
        kill_uid(uid)  # leftovers of a server that held this uid and died
    cgroup = CommandCgroup.create(args.cgroup_memory_bytes, args.cgroup_pids) if as_root else None
    memory = args.max_memory_bytes
    if memory < 0:  # no cgroup and not a pod: bound each command's address space instead
        memory = args.cgroup_memory_bytes if cgroup is None and os.getpid() != 1 else 0
    limits = CommandLimits(
        max_procs=args.max_procs,
        max_file_bytes=args.max_file_bytes,
        max_memory_bytes=memory,
        uid=uid,
        gid=gid,
        launcher=find_launcher(),
    )
    if limits.uid is not None:
        _check_traversable(args.workspace, limits.uid, limits.gid)
    limits = inherit_limits(limits)
    hardening = harden_server_process()
    wipe_dirs = [d for d in args.wipe_dirs.split(",") if d.strip()] if args.wipe_dirs else []
    log.info(
        "sandbox server on %s:%s workspace=%s commands as %s hardening=%s cgroup=%s rlimit_as=%s launcher=%s",
        args.host, args.port, args.workspace,
        f"uid {limits.uid}" if as_root else "the server's uid", hardening,
        cgroup.describe() if cgroup else "none (the pod's limits bound commands)", memory or "none",
        limits.launcher,
    )
    settings = ServerSettings(
        workspace=args.workspace,
        token=token,
        template=args.template,
        max_timeout_seconds=args.max_timeout_seconds,
        default_timeout_seconds=min(args.default_timeout_seconds, args.max_timeout_seconds),
        max_output_bytes=args.max_output_bytes,
        max_read_bytes=args.max_read_bytes,
        max_body_bytes=args.max_body_bytes,
        max_concurrent_execs=args.max_concurrent_execs,
        max_workspace_bytes=args.max_workspace_bytes,
        shell=args.shell,
        limits=limits,
        cgroup=cgroup,
        wipe_dirs=wipe_dirs,
    )
    sandbox = SandboxServer(settings)
    server = uvicorn.Server(_uvicorn_config(sandbox.asgi(), args.host, args.port, timeout_graceful_shutdown=10))

    async def stop() -> None:
        if server.should_exit:
            server.force_exit = True
            return
        await sandbox.stop()  # every command is dead before the listener closes
        server.should_exit = True

    def on_stop(_signum: int) -> None:
        loop = sandbox.loop
        if loop is None:  # not serving yet: no command exists, nothing to stop first
            os._exit(0)
        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(stop()))

    if limits.launcher is None:
        log.warning("no GNU env on the PATH: commands start without a launcher (see docs/sandboxes.md)")
    StopSignals(on_stop, command_uid=limits.uid).install()
    server.run()
    return 0


def _check_traversable(path: str, uid: int, gid: int | None) -> None:
    """Refuse to start when commands (another uid) could not reach the workspace by path.

    The server enters the session directory for them, so `ls` would work while every
    absolute path (Python's sys.path, `cd $HOME`) fails; better a clear error at start.
    """
    import stat

    current = os.path.dirname(os.path.abspath(path))
    while True:
        try:
            st = os.stat(current)
        except FileNotFoundError:
            st = None
        if st is not None:
            ok = (st.st_mode & stat.S_IXOTH) or (st.st_uid == uid and st.st_mode & stat.S_IXUSR) or (
                gid is not None and st.st_gid == gid and st.st_mode & stat.S_IXGRP)
            if not ok:
                raise SystemExit(f"sandbox: commands run as uid {uid} cannot traverse {current} "
                                 f"(mode {stat.filemode(st.st_mode)}) to reach the workspace {path}; "
                                 "put the workspace under world-traversable directories")
        parent = os.path.dirname(current)
        if parent == current:
            return
        current = parent


def serve_gateway(args: argparse.Namespace) -> int:
    from asyncgrpo.sandbox.gateway import create_gateway
    from asyncgrpo.sandbox.members import member_source_from_args
    from asyncgrpo.sandbox.process import make_non_dumpable

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
    return _uvicorn_run(create_gateway(settings, source), args.host, args.port)


def _gateway_settings(args: argparse.Namespace, token: str, sandbox_token: str):
    from asyncgrpo.sandbox.gateway import GatewaySettings

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
    )
