"""Clients of the gateway and of a sandbox server, sync (tools run in threads) and async.

Errors are typed so callers can act on them: `LeaseLost` means the group's sandbox state is
gone (lease again, tell the model), `NoSandbox` means the pool had nothing free in time
(retry later), anything else is a `SandboxError` with the server's error code.
A `Heartbeats` thread keeps leases alive while a rollout thinks between tool calls; when the
process dies the heartbeats stop and the gateway takes the sandbox back after its TTL.
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from typing import ClassVar

import httpx

GATEWAY_URL_ENV = "ASYNCGRPO_GATEWAY_URL"
GATEWAY_TOKEN_ENV = "ASYNCGRPO_GATEWAY_TOKEN"


_LEASE_GONE = frozenset({"lease_released", "lease_expired", "lease_unknown", "sandbox_lost"})


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


def _exec_body(command, timeout_seconds, stdin, env, cwd, session, max_output_bytes) -> dict:
    body: dict = {"command": command}
    for key, value in (("timeout_seconds", timeout_seconds), ("stdin", stdin), ("env", env),
                       ("cwd", cwd), ("session", session), ("max_output_bytes", max_output_bytes)):
        if value is not None:
            body[key] = value
    return body


def _http_timeout(timeout_seconds: float | None) -> httpx.Timeout:
    return httpx.Timeout((timeout_seconds or 600.0) + 60.0, connect=10.0)


@dataclass
class Lease:
    lease_id: str
    group_id: str
    sandbox: str
    ttl_seconds: float
    joined: bool


class GatewayClient:
    """Synchronous client: `lease()`, then `exec`/`read_file`/`write_file` on the lease id."""

    def __init__(self, url: str | None = None, token: str | None = None, *, client: httpx.Client | None = None):
        self.url = (url or os.environ.get(GATEWAY_URL_ENV, "")).rstrip("/")
        token = token if token is not None else os.environ.get(GATEWAY_TOKEN_ENV, "")
        if not self.url:
            raise ValueError(f"no gateway URL: pass one or set {GATEWAY_URL_ENV}")
        self.http = client or httpx.Client(
            headers={"authorization": f"Bearer {token}"},
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
            timeout=httpx.Timeout(660.0, connect=10.0),
        )

    def lease(self, group_id: str, wait_seconds: float | None = None) -> Lease:
        body: dict = {"group_id": group_id}
        if wait_seconds is not None:
            body["wait_seconds"] = wait_seconds
        timeout = httpx.Timeout((wait_seconds if wait_seconds is not None else 300.0) + 30.0, connect=10.0)
        d = _raise_for(self.http.post(f"{self.url}/v1/leases", json=body, timeout=timeout))
        return Lease(d["lease_id"], d["group_id"], d["sandbox"], d["ttl_seconds"], d["joined"])

    def heartbeat(self, lease_id: str) -> dict:
        return _raise_for(self.http.post(f"{self.url}/v1/leases/{lease_id}/heartbeat"))

    def release(self, lease_id: str, all_holders: bool = False) -> dict:
        params = {"all": "true"} if all_holders else None
        return _raise_for(self.http.delete(f"{self.url}/v1/leases/{lease_id}", params=params))

    def exec(self, lease_id: str, command, *, timeout_seconds: float | None = None, stdin: str | None = None,
             env: dict | None = None, cwd: str | None = None, session: str | None = None,
             max_output_bytes: int | None = None) -> dict:
        body = _exec_body(command, timeout_seconds, stdin, env, cwd, session, max_output_bytes)
        return _raise_for(self.http.post(f"{self.url}/v1/leases/{lease_id}/exec", json=body,
                                         timeout=_http_timeout(timeout_seconds)))

    def read_file(self, lease_id: str, path: str, *, session: str | None = None,
                  max_bytes: int | None = None) -> dict:
        body = {"path": path, "session": session, "max_bytes": max_bytes}
        return _raise_for(self.http.post(f"{self.url}/v1/leases/{lease_id}/files/read",
                                         json={k: v for k, v in body.items() if v is not None}))

    def write_file(self, lease_id: str, path: str, content: str, *, session: str | None = None) -> dict:
        body = {"path": path, "content": content, "session": session}
        return _raise_for(self.http.post(f"{self.url}/v1/leases/{lease_id}/files/write",
                                         json={k: v for k, v in body.items() if v is not None}))

    def demand(self) -> dict:
        return _raise_for(self.http.get(f"{self.url}/v1/demand"))

    def close(self) -> None:
        self.http.close()


class AsyncSandboxClient:
    """Async client of either the gateway (with a lease id) or one sandbox server (without)."""

    def __init__(self, url: str, token: str, *, client: httpx.AsyncClient | None = None):
        self.url = url.rstrip("/")
        self.http = client or httpx.AsyncClient(
            headers={"authorization": f"Bearer {token}"},
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024),
            timeout=httpx.Timeout(660.0, connect=10.0),
        )

    def _base(self, lease_id: str | None) -> str:
        return f"{self.url}/v1/leases/{lease_id}" if lease_id else f"{self.url}/v1"

    async def lease(self, group_id: str, wait_seconds: float | None = None) -> Lease:
        body: dict = {"group_id": group_id}
        if wait_seconds is not None:
            body["wait_seconds"] = wait_seconds
        d = _raise_for(await self.http.post(f"{self.url}/v1/leases", json=body))
        return Lease(d["lease_id"], d["group_id"], d["sandbox"], d["ttl_seconds"], d["joined"])

    async def release(self, lease_id: str, all_holders: bool = False) -> dict:
        params = {"all": "true"} if all_holders else None
        return _raise_for(await self.http.delete(f"{self.url}/v1/leases/{lease_id}", params=params))

    async def exec(self, command, *, lease_id: str | None = None, timeout_seconds: float | None = None,
                   stdin: str | None = None, env: dict | None = None, cwd: str | None = None,
                   session: str | None = None, max_output_bytes: int | None = None) -> dict:
        body = _exec_body(command, timeout_seconds, stdin, env, cwd, session, max_output_bytes)
        return _raise_for(await self.http.post(f"{self._base(lease_id)}/exec", json=body,
                                               timeout=_http_timeout(timeout_seconds)))

    async def reset(self) -> dict:
        return _raise_for(await self.http.post(f"{self.url}/v1/reset"))

    async def aclose(self) -> None:
        await self.http.aclose()


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

    def add(self, lease_id: str) -> None:
        with self._cond:
            self.leases.add(lease_id)

    def discard(self, lease_id: str) -> None:
        with self._cond:
            self.leases.discard(lease_id)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait(self.interval)
                leases = list(self.leases)
            for lease_id in leases:
                try:
                    self.client.heartbeat(lease_id)
                except LeaseLost:
                    self.discard(lease_id)
                except Exception:  # noqa: BLE001, S110 - gateway briefly away: next beat is within TTL
                    pass
