"""`asyncgrpo sandbox serve`: the sandbox server's flags, each with an environment default
(`ASYNCGRPO_SANDBOX_*`; common/serving.py), and its start: command uid, limits, hardening.
`asyncgrpo sandbox bundle DEST`: the server as a folder that runs in a task's own image
(`portable`), whose entry serves through `portable_main` with the same flags."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from asyncgrpo.sandbox.common.serving import add_flag as _add
from asyncgrpo.sandbox.common.serving import bind_host as _bind_host
from asyncgrpo.sandbox.common.serving import read_token, uvicorn_config
from asyncgrpo.sandbox.server.quota import DEFAULT_MAX_WORKSPACE_BYTES
from asyncgrpo.wire import (
    SANDBOX_ENV_PREFIX,
    SANDBOX_PORT,
    SANDBOX_TOKEN_ENV,
    SANDBOX_WORKSPACE,
)


def register(subparsers) -> None:
    sb = subparsers.add_parser("sandbox", help="the sandbox server that runs in each sandbox pod")
    sbsub = sb.add_subparsers(dest="sandbox_command", metavar="ACTION", required=True)
    add_serve(sbsub)
    bundle = sbsub.add_parser(
        "bundle", help="write the server as a self-contained folder that a task's own image runs "
        "with its python3 (python3 -I -S DEST/asyncgrpo-sandbox.py serve)")
    bundle.add_argument("dest", metavar="DEST", help="the folder (made if missing; its bundle replaced)")
    bundle.set_defaults(func=write_bundle)


def portable_main(argv: list[str]) -> int:
    """The bundle's entry (`portable`): `asyncgrpo-sandbox.py serve [flags]`, as `asyncgrpo sandbox serve`."""
    parser = argparse.ArgumentParser(prog="asyncgrpo-sandbox.py",
                                     description="the asyncgrpo sandbox server, run by a task image's python3")
    add_serve(parser.add_subparsers(dest="sandbox_command", metavar="ACTION", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


def write_bundle(args: argparse.Namespace) -> int:
    import time

    from asyncgrpo.sandbox.server.portable import BundleError
    from asyncgrpo.sandbox.server.portable import write_bundle as write

    t0 = time.monotonic()
    try:
        entry = write(args.dest)
    except BundleError as err:
        print(f"asyncgrpo sandbox bundle: {err}", file=sys.stderr)
        return 1
    print(f"asyncgrpo sandbox bundle: wrote {entry} in {time.monotonic() - t0:.2f}s", file=sys.stderr)
    return 0


def default_shell() -> str:
    """bash where the image has it, else /bin/sh (a task's own image may have no bash)."""
    return "/bin/bash" if os.access("/bin/bash", os.X_OK) else "/bin/sh"


def add_serve(actions) -> None:
    """The `serve` action and its flags, on `asyncgrpo sandbox` and on the bundle's entry."""
    bind_host = _bind_host()
    serve = actions.add_parser("serve", help="serve exec/files/reset over HTTP")
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
    _add(serve, "--shell", E + "SHELL", default_shell(), help_="the shell of string commands")
    _add(serve, "--wipe-dirs", E + "WIPE_DIRS", "/tmp,/dev/shm,/dev/mqueue",
         help_="shared scratch directories a reset empties of what commands left there (root: entries "
               "of the command uid; non-root: entries of the server's uid, only as PID 1 of a pod's "
               "namespace, where nothing else lives); empty: none")
    serve.set_defaults(func=serve_sandbox)


def _uid_arg(value: str) -> int | None:
    return None if str(value) == "auto" else int(value)


def serve_sandbox(args: argparse.Namespace) -> int:
    import asyncio

    import uvicorn

    from asyncgrpo.sandbox.server.app import SandboxServer, ServerSettings
    from asyncgrpo.sandbox.server.cgroup import CommandCgroup
    from asyncgrpo.sandbox.server.process import (
        CommandLimits,
        allocate_command_uid,
        find_launcher,
        harden_server_process,
        inherit_limits,
        kill_uid,
    )
    from asyncgrpo.sandbox.server.stopping import StopSignals

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
    server = uvicorn.Server(uvicorn_config(sandbox.asgi(), args.host, args.port, timeout_graceful_shutdown=10))

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
