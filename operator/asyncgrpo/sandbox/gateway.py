"""The per-run gateway: the one address the trainer needs for sandboxes.

It leases sandboxes to rollout groups, takes them back when the group releases or goes
quiet, checks their health, and publishes the demand signal the operator scales on. HTTP
only translates; every decision about sandboxes and leases is in `pool.Pool`.

A lease is a capability: the lease answer carries a secret that the leased sandbox alone
accepts, for that lease alone. With `data_path="direct"` (default) it also carries the
sandbox's address, and the client sends execs and file calls straight there: the gateway
is off the data path. With `data_path="proxied"` (for clusters where the trainer may not
reach sandbox pods) the gateway forwards them, the lease secret still being the credential.
Every call on a lease (heartbeat, release, data calls) needs that lease's secret; the
run-wide gateway token opens only the control calls (lease, pool listing, drain).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from asyncgrpo.sandbox.http_guard import Grant, GuardMiddleware, Refused, loads, parse_body
from asyncgrpo.sandbox.metrics import GatewayMetrics
from asyncgrpo.sandbox.pool import LeaseGone, Member, NoSandbox, Pool

log = logging.getLogger("asyncgrpo.sandbox.gateway")

# extra time a proxied exec may take beyond its own timeout (kill, drain, transfer); the
# sandbox counts its queueing in the timeout, so a sandbox silent past this is hung
EXEC_SLACK_SECONDS = 5.0
_FILE_CALL_SECONDS = 60.0
_LEASE_PATH = re.compile(r"^/v1/leases/([^/]+)(/[a-z/]*)?$")


@dataclass
class GatewaySettings:
    token: str
    sandbox_token: str
    lease_ttl_seconds: float = 60.0
    lease_max_seconds: float = 6 * 3600.0
    max_wait_seconds: float = 300.0
    health_interval_seconds: float = 5.0
    health_timeout_seconds: float = 3.0
    health_failures: int = 2
    max_body_bytes: int = 4 << 20
    max_exec_seconds: float = 600.0
    reset_timeout_seconds: float = 120.0
    data_path: str = "direct"  # or "proxied": see the module docstring

    def __post_init__(self):
        if self.data_path not in ("direct", "proxied"):
            raise ValueError(f"data_path must be 'direct' or 'proxied', not {self.data_path!r}")


class LeaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    group_id: str = Field(min_length=1, max_length=256)
    wait_seconds: float | None = Field(None, ge=0)


def _gone(err: LeaseGone) -> JSONResponse:
    detail = {
        "released": "the lease was released",
        "expired": "the lease expired: no call or heartbeat within the lease TTL",
        "sandbox_lost": "the sandbox behind this lease failed; its state is lost; lease again",
        "unknown": "no such lease",
    }[err.reason]
    status = 404 if err.reason == "unknown" else 410
    return JSONResponse({"error": f"lease_{err.reason}" if err.reason != "sandbox_lost" else "sandbox_lost",
                         "detail": detail, "lease_id": err.lease_id}, status_code=status)


class _Upstream:
    """The gateway's client of the sandboxes.

    aiohttp rather than httpx: the proxy hop is the gateway's whole per-exec cost, and
    aiohttp spends about a sixth of httpx's CPU per request (measured here). Idle
    connections are closed after 15 s, before the sandbox's own 30 s keep-alive ends them,
    so a request never lands on a connection the server is closing.
    """

    def __init__(self, token: str):
        self.headers = {"authorization": f"Bearer {token}", "content-type": "application/json"}
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            headers=self.headers,
            connector=aiohttp.TCPConnector(limit=4096, limit_per_host=0, keepalive_timeout=15),
        )

    async def request(self, method: str, url: str, timeout: float, body: bytes | None = None,
                      secret: str | None = None) -> tuple[int, bytes]:
        """`secret`: a lease's, replacing the run token (the data calls of that lease)."""
        t = aiohttp.ClientTimeout(total=timeout, sock_connect=5.0)
        headers = {"authorization": f"Bearer {secret}"} if secret else None
        async with self.session.request(method, url, data=body, timeout=t, headers=headers) as r:
            return r.status, await r.read()

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


_CONNECTION_ERRORS = (aiohttp.ClientError, OSError)


def create_gateway(settings: GatewaySettings, source) -> GuardMiddleware:
    metrics = GatewayMetrics()
    http = _Upstream(settings.sandbox_token)

    async def reset_member(m: Member) -> bool:
        """Reset the sandbox and install the secret of its next lease (one reset, one secret)."""
        secret = secrets.token_urlsafe(32)
        body = b'{"lease_secret": "' + secret.encode() + b'"}'
        m.next_secret = None
        try:
            status, _ = await http.request("POST", f"{m.url}/v1/reset", settings.reset_timeout_seconds, body)
            if status == 200:
                m.next_secret = secret
            return status == 200
        except (TimeoutError, *_CONNECTION_ERRORS) as err:
            log.warning("reset of %s failed: %s", m.name, err)
            return False

    async def healthy(m: Member) -> tuple[bool, str, bool]:
        """(answered 200, why not, whether it was only slow)."""
        try:
            status, _ = await http.request("GET", f"{m.url}/healthz", settings.health_timeout_seconds)
            return status == 200, f"health returned {status}", False
        except TimeoutError as err:  # aiohttp's ServerTimeoutError is one too
            return False, f"health check timed out: {type(err).__name__}", True
        except _CONNECTION_ERRORS as err:
            return False, f"health check failed: {type(err).__name__}", False

    pool = Pool(
        reset_fn=reset_member,
        metrics=metrics,
        lease_ttl_seconds=settings.lease_ttl_seconds,
        lease_max_seconds=settings.lease_max_seconds,
    )

    async def probe(m: Member) -> None:
        ok, reason, slow = await healthy(m)
        if ok:
            pool.health_ok(m.name)
            return
        lease = pool.leases.get(m.lease_id) if m.lease_id else None
        if slow and lease is not None and lease.in_flight:
            # a sandbox busy with a heavy command answers slowly, but it answers its exec:
            # only a refused or dropped connection takes a leased sandbox out mid-call
            return
        pool.health_failed(m.name, reason, settings.health_failures)

    async def health_loop() -> None:
        while True:
            members = list(pool.members.values())
            if members:
                await asyncio.gather(*(probe(m) for m in members), return_exceptions=True)
            await asyncio.sleep(settings.health_interval_seconds)

    async def expiry_loop() -> None:
        while True:
            await asyncio.sleep(max(0.2, min(settings.lease_ttl_seconds / 4, 5.0)))
            pool.expire()

    @asynccontextmanager
    async def lifespan(_app):
        await http.start()
        tasks = [asyncio.create_task(t) for t in (source.run(pool), health_loop(), expiry_loop())]
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await pool.close()
            await http.close()

    app = FastAPI(title="asyncgrpo sandbox gateway", lifespan=lifespan, docs_url=None, redoc_url=None)

    async def until_disconnected(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    @app.post("/v1/leases")
    async def lease(request: Request):
        req = await parse_body(request, LeaseRequest)
        wait = min(settings.max_wait_seconds if req.wait_seconds is None else req.wait_seconds,
                   settings.max_wait_seconds)
        acquiring = asyncio.ensure_future(pool.acquire(req.group_id, wait))
        gone = asyncio.ensure_future(until_disconnected(request))
        try:
            # a client that hangs up while waiting gives its place in the queue up
            await asyncio.wait({acquiring, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not acquiring.done():
                acquiring.cancel()
        if acquiring.cancelled():
            return Response(status_code=499)  # nobody reads it
        try:
            lease, joined = acquiring.result()
        except NoSandbox:
            return JSONResponse(
                {"error": "no_sandbox", "detail": f"no sandbox free within {wait:g}s", "demand": _small(pool)},
                status_code=503, headers={"retry-after": "1"},
            )
        member = pool.members[lease.member]
        body = {
            "lease_id": lease.id,
            "secret": lease.secret,
            "group_id": lease.group_id,
            "sandbox": lease.member,
            "data_path": settings.data_path,
            "holders": lease.holders,
            "joined": joined,
            "ttl_seconds": settings.lease_ttl_seconds,
            "exec_slack_seconds": EXEC_SLACK_SECONDS,
            "waited_seconds": round(lease.waited_seconds, 6),
        }
        if settings.data_path == "direct":
            body["sandbox_url"] = member.url
        return body

    @app.post("/v1/leases/{lease_id}/heartbeat")
    async def heartbeat(lease_id: str):
        try:
            lease = pool.touch(lease_id)
        except LeaseGone as err:
            return _gone(err)
        return {"lease_id": lease_id, "holders": lease.holders, "ttl_seconds": settings.lease_ttl_seconds}

    @app.delete("/v1/leases/{lease_id}")
    async def release(lease_id: str, all: bool = False):
        try:
            return pool.release(lease_id, all_holders=all)
        except LeaseGone as err:
            return _gone(err)

    @app.post("/v1/leases/{lease_id}/lost")
    async def report_lost(lease_id: str):
        """A direct call to the leased sandbox got no answer in time: check it now, eject if down."""
        try:
            lease, member = pool.get(lease_id)
        except LeaseGone as err:
            return _gone(err)
        alive, reason, _slow = await healthy(member)
        if alive:
            return {"lease_id": lease_id, "ended": False, "sandbox": member.name}
        if pool.leases.get(lease_id) is lease:
            pool.lost(member.name, f"reported by the lease holder; {reason}")
        return _gone(LeaseGone(lease_id, "sandbox_lost"))

    async def forward(lease_id: str, request: Request, path: str) -> Response:
        body = await request.body()
        # looked up after the last await before the call: between here and `in_flight += 1`
        # nothing can end the lease or hand its sandbox to another group
        try:
            lease, member = pool.get(lease_id)
        except LeaseGone as err:
            return _gone(err)
        timeout = _FILE_CALL_SECONDS
        if path == "/v1/exec":
            # the sandbox must give up before we do: cap the exec's own timeout at ours, so a
            # slow command ends as a timed-out result and never as a dropped connection
            try:
                doc = loads(body)
                asked = doc.get("timeout_seconds") or settings.max_exec_seconds
                doc["timeout_seconds"] = min(float(asked), settings.max_exec_seconds)
                body = json.dumps(doc).encode()
                timeout = doc["timeout_seconds"] + EXEC_SLACK_SECONDS
            except (ValueError, TypeError, AttributeError, OverflowError):
                pass  # the sandbox refuses the body itself, with its own error
        lease.in_flight += 1
        lease.last_seen = pool.clock()
        t0 = time.monotonic()
        try:
            status, content = await http.request("POST", member.url + path, timeout, body, secret=lease.secret)
        except TimeoutError:
            # the sandbox bounds every call by its timeout (queueing included): silence past
            # that plus the slack means it is hung, not slow. Out now, the group leases again.
            metrics.proxy_errors.inc()
            if pool.leases.get(lease_id) is lease:
                pool.lost(member.name, f"{path} got no answer within {timeout:g}s")
            return JSONResponse(
                {"error": "sandbox_lost", "lease_id": lease_id, "sandbox": member.name,
                 "detail": f"the sandbox did not answer within {timeout:g}s and was taken out; "
                           "its state is lost: lease again"}, status_code=504)
        except _CONNECTION_ERRORS as err:
            metrics.proxy_errors.inc()
            alive, _, _ = await healthy(member)
            if alive:  # the connection failed, the sandbox did not: keep the lease
                return JSONResponse(
                    {"error": "proxy_error", "lease_id": lease_id, "sandbox": member.name,
                     "detail": f"the call failed in transit ({type(err).__name__}); the sandbox is up, "
                               "the lease holds; the call may or may not have run"}, status_code=502)
            if pool.leases.get(lease_id) is lease:
                pool.lost(member.name, f"{path} failed: {type(err).__name__}")
            return JSONResponse(
                {"error": "sandbox_lost", "lease_id": lease_id, "sandbox": member.name,
                 "detail": f"the sandbox failed during the call ({type(err).__name__}); its state is "
                           "lost; the lease is ended: lease again"},
                status_code=502,
            )
        finally:
            lease.in_flight -= 1
            lease.last_seen = pool.clock()
        if path == "/v1/exec":
            metrics.exec_seconds.observe(time.monotonic() - t0)
        return Response(content, status_code=status, media_type="application/json")

    @app.post("/v1/leases/{lease_id}/exec")
    async def exec_(lease_id: str, request: Request):
        return await forward(lease_id, request, "/v1/exec")

    @app.post("/v1/leases/{lease_id}/files/read")
    async def read(lease_id: str, request: Request):
        return await forward(lease_id, request, "/v1/files/read")

    @app.post("/v1/leases/{lease_id}/files/write")
    async def write(lease_id: str, request: Request):
        return await forward(lease_id, request, "/v1/files/write")

    @app.get("/v1/demand")
    async def demand():
        return pool.demand()

    @app.get("/v1/pool")
    async def pool_view():
        """For people and the operator: states and ids, never a secret or a group's name."""
        now = pool.clock()
        return {
            "members": [
                {"name": m.name, "url": m.url, "state": m.state, "lease_id": m.lease_id,
                 "reason": m.reason, "seconds_in_state": round(now - m.since, 3)}
                for m in pool.members.values()
            ],
            "leases": [
                {"lease_id": lease.id, "sandbox": lease.member,
                 "holders": lease.holders, "in_flight": lease.in_flight,
                 "idle_seconds": round(now - lease.last_seen, 3)}
                for lease in pool.leases.values()
            ],
        }

    @app.post("/v1/members/{name}/drain")
    async def drain(name: str):
        return pool.drain(name)

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok", "members": len(pool.members)}

    @app.get("/metrics")
    async def prom():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    token = settings.token.encode()

    def authorize(path: str, presented: str | None) -> Grant | None:
        """Lease routes open with that lease's secret only; the rest with the run token."""
        if presented is None:
            return None
        m = _LEASE_PATH.match(path)
        if m is None:
            return Grant("control") if hmac.compare_digest(presented.encode(), token) else None
        verdict = pool.check(m.group(1), presented)
        if verdict == "ok":
            return Grant("lease", lease_id=m.group(1))
        if verdict == "refused":
            return None
        err = _gone(LeaseGone(m.group(1), verdict))
        raise Refused(err.status_code, loads(err.body)["error"], loads(err.body)["detail"])

    app.state.pool = pool
    return GuardMiddleware(
        app,
        authorize=authorize,
        max_body_bytes=settings.max_body_bytes,
        open_paths=frozenset({"/healthz", "/metrics", "/v1/demand"}),
        on_reject=lambda reason: metrics.rejected.labels(reason=reason).inc(),
    )


def _small(pool: Pool) -> dict:
    d = pool.demand()
    return {k: d[k] for k in ("busy", "idle", "waiting", "starting", "unhealthy")}

