"""Clients of the gateway and of a sandbox server, sync (tools run in threads) and async.

Errors are typed so callers can act on them: `LeaseLost` means the group's sandbox state is
gone (lease again, tell the model), `NoSandbox` means the pool had nothing free in time
(retry later), anything else is a `SandboxError` with the server's error code.
A `Heartbeats` thread keeps leases alive while a rollout thinks between tool calls (all of a
process's leases in one `/v1/heartbeats` call per interval); when the process dies the
heartbeats stop and the gateway takes the sandbox back after its TTL.

A lease is a capability: its `secret` is the credential of every call on it, and the
gateway token is sent only to take a lease. A group is this client's own: every lease
request carries the client's group key (random per client unless given, or
`ASYNCGRPO_GROUP_KEY` for the processes of one trainer that must share groups), and the
gateway joins only requests with the same key to a group, so another client naming the
same group id gets a group (and sandbox) of its own. When the gateway runs the direct data path the
lease names the sandbox's address and execs and file calls go straight there; a call that
gets no answer within its timeout plus the gateway's slack is reported to the gateway
(`/lost`), which checks the sandbox and takes it out if it is down.
"""

from __future__ import annotations

import os
import secrets
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar

import httpx

from asyncgrpo.sandbox.common.messages import (
    EXEC_STREAM_TYPE,
    ExecRequest,
    ExecResult,
    ReadResult,
    ScoreResult,
    WriteResult,
)
from asyncgrpo.wire import GATEWAY_DEMAND_PATH, GATEWAY_TOKEN_ENV, GATEWAY_URL_ENV, GROUP_KEY_ENV

_LEASE_GONE = frozenset({"lease_released", "lease_expired", "lease_unknown", "sandbox_lost", "lease_revoked"})


class SandboxError(RuntimeError):
    def __init__(self, status: int, error: str, detail: str = ""):
        super().__init__(f"{status} {error}: {detail}" if detail else f"{status} {error}")
        self.status = status
        self.error = error
        self.detail = detail


class LeaseLost(SandboxError):
    """The lease ended (expired, released, or its sandbox failed): its files are gone."""


class NoSandbox(SandboxError):
    """No sandbox became free within the wait."""


def _raise_for(r: httpx.Response) -> dict:
    if r.status_code == 200:
        return r.json()
    try:
        body = r.json()
    except ValueError:
        body = {"error": "http_error", "detail": r.text[:300]}
    if isinstance(body.get("detail"), dict) and "error" in body["detail"]:
        body = body["detail"]  # FastAPI wraps handler errors in "detail"
    error, detail = str(body.get("error", "http_error")), body.get("detail", "")
    detail = detail if isinstance(detail, str) else str(detail)
    if error in _LEASE_GONE:
        raise LeaseLost(r.status_code, error, detail)
    if r.status_code == 503 and error == "no_sandbox":
        raise NoSandbox(r.status_code, error, detail)
    raise SandboxError(r.status_code, error, detail)


#: stdin up to this size travels inside the JSON body; larger (or bytes, or an iterable of
#: bytes) goes through the streamed exec, which the sandbox feeds to the command as it arrives
INLINE_STDIN_BYTES = 64 * 1024


def _exec_call(command, stdin, **fields) -> tuple[str, dict]:
    """(route, httpx keyword arguments) of an exec: JSON, or the streamed form for large stdin.

    Built without validation (`unchecked`): the server's 422 stays the one answer to
    a malformed exec, whichever client sent it.
    """
    given = {k: v for k, v in fields.items() if v is not None}
    streamed = stdin is not None and not (isinstance(stdin, str) and len(stdin) <= INLINE_STDIN_BYTES)
    if not streamed:
        if stdin is not None:
            given["stdin"] = stdin
        return "exec", {"json": ExecRequest.unchecked(command=command, **given).body()}
    head = ExecRequest.unchecked(command=command, **given).stream_head()
    if isinstance(stdin, str):
        stdin = stdin.encode()
    if isinstance(stdin, bytes | bytearray | memoryview):
        content = head + bytes(stdin)
    else:
        content = _chain(head, stdin)
    return "exec/stream", {"content": content, "headers": {"content-type": EXEC_STREAM_TYPE}}


def _chain(first: bytes, rest):
    yield first
    yield from rest


def _http_timeout(timeout_seconds: float | None, slack: float = 5.0) -> httpx.Timeout:
    # the sandbox answers within the exec's timeout (its queueing included) plus the slack
    return httpx.Timeout((timeout_seconds or 600.0) + slack + 2.0, connect=10.0)


@dataclass
class Lease:
    lease_id: str
    group_id: str
    sandbox: str
    ttl_seconds: float
    joined: bool
    secret: str = field(default="", repr=False)
    sandbox_url: str | None = None  # set when the data path is direct
    exec_slack_seconds: float = 5.0

    @classmethod
    def from_answer(cls, d: dict) -> Lease:
        return cls(d["lease_id"], d["group_id"], d["sandbox"], d["ttl_seconds"], d["joined"], d["secret"],
                   d.get("sandbox_url"), d.get("exec_slack_seconds", 5.0))

    @property
    def auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.secret}"}


class GatewayClient:
    """Synchronous client: `lease()`, then `exec`/`read_file`/`write_file` on the lease.

    Methods take the `Lease` or its id (a lease this client took: the client keeps the
    secret; another client's lease id is of no use to it, nor to anyone).
    """

    def __init__(self, url: str | None = None, token: str | None = None, *, client: httpx.Client | None = None,
                 group_key: str | None = None):
        self.url = (url or os.environ.get(GATEWAY_URL_ENV, "")).rstrip("/")
        token = token if token is not None else os.environ.get(GATEWAY_TOKEN_ENV, "")
        if not self.url:
            raise ValueError(f"no gateway URL: pass one or set {GATEWAY_URL_ENV}")
        self._control = {"authorization": f"Bearer {token}"}
        # the credential of this client's groups: only requests carrying it join them
        self._group_key = group_key or os.environ.get(GROUP_KEY_ENV) or secrets.token_urlsafe(32)
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self.http = client or httpx.Client(
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
            timeout=httpx.Timeout(660.0, connect=10.0),
        )

    def _lease_of(self, lease: Lease | str) -> Lease:
        if isinstance(lease, Lease):
            return lease
        with self._lock:
            found = self._leases.get(lease)
        if found is None:
            raise LeaseLost(404, "lease_unknown", f"this client holds no lease {lease}")
        return found

    def _forget(self, lease: Lease) -> None:
        with self._lock:
            self._leases.pop(lease.lease_id, None)

    def lease(self, group_id: str, wait_seconds: float | None = None, image: str | None = None) -> Lease:
        """A sandbox for the group; `image`: the container image it must run (a row's own,
        spec.sandboxes.imageColumn), None for the run's. A cold image waits for its pod."""
        body: dict = {"group_id": group_id, "group_key": self._group_key}
        if wait_seconds is not None:
            body["wait_seconds"] = wait_seconds
        if image:
            body["image"] = image
        timeout = httpx.Timeout((wait_seconds if wait_seconds is not None else 300.0) + 30.0, connect=10.0)
        d = _raise_for(self.http.post(f"{self.url}/v1/leases", json=body, headers=self._control, timeout=timeout))
        lease = Lease.from_answer(d)
        with self._lock:
            self._leases[lease.lease_id] = lease
        return lease

    def heartbeat(self, lease: Lease | str) -> dict:
        lease = self._lease_of(lease)
        try:
            return _raise_for(self.http.post(f"{self.url}/v1/leases/{lease.lease_id}/heartbeat", headers=lease.auth))
        except LeaseLost:
            self._forget(lease)
            raise

    def heartbeat_many(self, leases: Iterable[Lease | str]) -> dict[str, str]:
        """Beat every lease in one call; returns the ended ones, each with its error code
        (they are forgotten here: their files are gone, the caller leases again)."""
        held: list[Lease] = []
        ended: dict[str, str] = {}
        for lease in leases:
            try:
                held.append(self._lease_of(lease))
            except LeaseLost as err:
                ended[lease if isinstance(lease, str) else lease.lease_id] = err.error
        if not held:
            return ended
        body = {"leases": [{"lease_id": x.lease_id, "secret": x.secret} for x in held]}
        answers = _raise_for(self.http.post(f"{self.url}/v1/heartbeats", json=body, headers=self._control))["leases"]
        for lease in held:
            error = answers.get(lease.lease_id, {}).get("error")
            if error in _LEASE_GONE:
                ended[lease.lease_id] = error
                self._forget(lease)
        return ended

    def release(self, lease: Lease | str, all_holders: bool = False) -> dict:
        lease = self._lease_of(lease)
        params = {"all": "true"} if all_holders else None
        try:
            out = _raise_for(self.http.delete(f"{self.url}/v1/leases/{lease.lease_id}", params=params,
                                              headers=lease.auth))
        except LeaseLost:
            self._forget(lease)
            raise
        if out.get("ended"):
            self._forget(lease)
        return out

    def _data(self, lease: Lease | str, route: str, call: dict, timeout: httpx.Timeout | None = None) -> dict:
        """`call`: httpx's body arguments (`json=` or `content=` with its headers)."""
        lease = self._lease_of(lease)
        try:
            return self._call(lease, route, call, timeout)
        except LeaseLost:
            self._forget(lease)
            raise

    def _call(self, lease: Lease, route: str, call: dict, timeout: httpx.Timeout | None) -> dict:
        call = {**call, "headers": {**lease.auth, **call.get("headers", {})},
                "timeout": timeout or httpx.USE_CLIENT_DEFAULT}
        if lease.sandbox_url is None:  # proxied data path
            return _raise_for(self.http.post(f"{self.url}/v1/leases/{lease.lease_id}/{route}", **call))
        try:
            return _raise_for(self.http.post(f"{lease.sandbox_url}/v1/{route}", **call))
        except (httpx.TimeoutException, httpx.TransportError) as err:
            # no answer: ask the gateway to check the sandbox (and take it out if it is down)
            _raise_for(self.http.post(f"{self.url}/v1/leases/{lease.lease_id}/lost", headers=lease.auth))
            raise SandboxError(504 if isinstance(err, httpx.TimeoutException) else 502, "transport_error",
                               f"{type(err).__name__}; the sandbox is up, the lease holds; "
                               "the call may or may not have run") from err

    def exec(self, lease: Lease | str, command, *, timeout_seconds: float | None = None,
             stdin: str | bytes | Iterable[bytes] | None = None, env: dict | None = None, cwd: str | None = None,
             session: str | None = None, max_output_bytes: int | None = None,
             output_encoding: str | None = None) -> ExecResult:
        """`stdin` over `INLINE_STDIN_BYTES`, bytes or an iterable of bytes is streamed."""
        lease = self._lease_of(lease)
        route, call = _exec_call(command, stdin, timeout_seconds=timeout_seconds, env=env, cwd=cwd,
                                 session=session, max_output_bytes=max_output_bytes,
                                 output_encoding=output_encoding or None)
        d = self._data(lease, route, call, _http_timeout(timeout_seconds, lease.exec_slack_seconds))
        return ExecResult.validate(d)

    def read_file(self, lease: Lease | str, path: str, *, session: str | None = None,
                  max_bytes: int | None = None) -> ReadResult:
        body = {"path": path, "session": session, "max_bytes": max_bytes}
        d = self._data(lease, "files/read", {"json": {k: v for k, v in body.items() if v is not None}})
        return ReadResult.validate(d)

    def write_file(self, lease: Lease | str, path: str, content: str, *, session: str | None = None) -> WriteResult:
        body = {"path": path, "content": content, "session": session}
        d = self._data(lease, "files/write", {"json": {k: v for k, v in body.items() if v is not None}})
        return WriteResult.validate(d)

    def score(self, lease: Lease | str, command, *, files: dict[str, str], editable: list[str],
              session: str | None = None, timeout_seconds: float | None = None,
              max_output_bytes: int | None = None) -> ScoreResult:
        """Run the row's tests where the rollout never ran (`/v1/score`), on either data path."""
        body = {"command": command, "files": files, "editable": list(editable), "session": session,
                "timeout_seconds": timeout_seconds, "max_output_bytes": max_output_bytes}
        lease = self._lease_of(lease)
        d = self._data(lease, "score", {"json": {k: v for k, v in body.items() if v is not None}},
                       _http_timeout(timeout_seconds, lease.exec_slack_seconds + 10.0))
        return ScoreResult.validate(d)

    def demand(self) -> dict:
        return _raise_for(self.http.get(f"{self.url}{GATEWAY_DEMAND_PATH}"))

    def close(self) -> None:
        self.http.close()


_SHARED: dict[str, GatewayClient] = {}  # by gateway URL and token
_SHARED_LOCK = threading.Lock()


def shared_client(url: str | None = None) -> GatewayClient:
    """One client per gateway URL in this process (its connections and its heartbeat thread).

    With the direct data path the gateway sees no calls, only heartbeats: whoever holds a
    lease through a long exec must heartbeat it (`Heartbeats`), or it expires after the TTL.
    """
    url = url or os.environ.get(GATEWAY_URL_ENV, "")
    token = os.environ.get(GATEWAY_TOKEN_ENV, "")
    with _SHARED_LOCK:
        key = f"{url}\0{token}"
        if key not in _SHARED:
            _SHARED[key] = GatewayClient(url, token)
        return _SHARED[key]


class Heartbeats:
    """One daemon thread per process that heartbeats every lease registered with it."""

    _instances: ClassVar[weakref.WeakValueDictionary] = weakref.WeakValueDictionary()
    _lock = threading.Lock()

    def __init__(self, client: GatewayClient, interval_seconds: float):
        self.client = client
        self.interval = interval_seconds
        self.leases: set[str] = set()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True, name="sandbox-lease-heartbeat")
        self._thread.start()

    @classmethod
    def for_client(cls, client: GatewayClient, interval_seconds: float) -> Heartbeats:
        with cls._lock:
            hb = cls._instances.get(id(client))
            if hb is None:
                hb = cls(client, interval_seconds)
                cls._instances[id(client)] = hb
            return hb

    def add(self, lease: Lease | str) -> None:
        with self._cond:
            self.leases.add(lease.lease_id if isinstance(lease, Lease) else lease)

    def discard(self, lease: Lease | str) -> None:
        with self._cond:
            self.leases.discard(lease.lease_id if isinstance(lease, Lease) else lease)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait(self.interval)
                leases = list(self.leases)
            if not leases:
                continue
            try:
                ended = self.client.heartbeat_many(leases)
            except Exception:  # noqa: BLE001, S112 - gateway briefly away: next beat is within TTL
                continue
            for lease_id in ended:
                self.discard(lease_id)
