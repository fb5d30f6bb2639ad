"""The per-run gateway: the one address the trainer needs for sandboxes.

It leases sandboxes to rollout groups, takes them back when the group releases or goes
quiet, checks their health, and publishes the demand signal the operator scales on.
`pool.Pool` holds the leases and members and every change of their state (grant, join,
release, expiry, drain, take-out); `Gateway` talks HTTP to both sides and decides from what
it hears when a sandbox is down: a failed health probe (but not a merely slow one while its
lease has a call in flight), a proxied call with no answer past its timeout plus the
slack, or a holder's `/lost` report confirmed by a probe. It then tells the Pool.

A lease is a capability: the lease answer carries a secret that the leased sandbox alone
accepts, for that lease alone. With `data_path="direct"` (default) it also carries the
sandbox's address, and the client sends execs and file calls straight there: the gateway
is off the data path. With `data_path="proxied"` (for clusters where the trainer may not
reach sandbox pods) the gateway forwards them, the lease secret still being the credential.
Every call on a lease (heartbeat, release, data calls) needs that lease's secret; the
run-wide gateway token opens only the control calls (lease, pool listing, drain). A group
is joined only by a request carrying the group's own key (`group_key`, see `pool`): every
holder of the run token can name any group id, so the id is no credential.

Lifecycle (`lifecycle`): `fresh` (default) retires a sandbox once its group's lease ends;
the operator deletes the pod and creates a new one, the warm pool absorbing the pod start.
`reuse` resets it for the next group (trusted workloads only). A member source that cannot
replace its members (a fixed `--members` list) runs `reuse`, and says so in the demand signal
and the log; the local backend's `--members-file` can (its pool replaces retired processes).
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
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from asyncgrpo import wire
from asyncgrpo.sandbox.common.challenge import reset_call
from asyncgrpo.sandbox.common.http_guard import (
    Grant,
    GuardMiddleware,
    Refused,
    exception_handlers,
    json_endpoint,
    loads,
    parse_body,
)
from asyncgrpo.sandbox.common.messages import (
    EXEC_STREAM_TYPE,
    ApiError,
    ExecRequest,
    HeartbeatsRequest,
    LeaseRequest,
    ScoreRequest,
    read_stream_head,
)
from asyncgrpo.sandbox.gateway.metrics import GatewayMetrics
from asyncgrpo.sandbox.gateway.pool import (
    FRESH,
    RETIRED,
    REUSE,
    STARTING,
    LeaseGone,
    Member,
    NoSandbox,
    Pool,
    TooManyImages,
    TooManyWaiters,
    group_scope,
)
from asyncgrpo.wire import image_reference_problem

log = logging.getLogger("asyncgrpo.sandbox.gateway.app")

# extra time a proxied exec may take beyond its own timeout (kill, drain, transfer); the
# sandbox counts its queueing in the timeout, so a sandbox silent past this is hung
EXEC_SLACK_SECONDS = 5.0
_FILE_CALL_SECONDS = 60.0
# a member not yet answering (a pod or process just started) is probed this often until it
# does, as a kubelet's startup probe: it turns warm within this of listening, not a health round
STARTUP_PROBE_SECONDS = 0.25
# a scoring run's setup before its command starts (sweep, reading the editable files, wipe,
# writing the row's files): waited for on top of an exec's timeout and slack
SCORE_SETUP_SECONDS = 10.0
_LEASE_PATH = re.compile(r"^/v1/leases/([^/]+)(/[a-z/]*)?$")
_STREAM_PATH = re.compile(r"^/v1/leases/[^/]+/exec/stream$")


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
    max_body_bytes: int = 1 << 20
    max_exec_seconds: float = 600.0
    reset_timeout_seconds: float = 120.0
    data_path: str = "direct"  # or "proxied": see the module docstring
    lifecycle: str = FRESH  # or REUSE: see the module docstring
    max_waiters_per_client: int = 1024
    max_images: int = 8  # row images leased at once (spec.sandboxes.images.maxDistinct)
    image_idle_seconds: float = 600.0

    def __post_init__(self):
        if self.data_path not in ("direct", "proxied"):
            raise ValueError(f"data_path must be 'direct' or 'proxied', not {self.data_path!r}")
        if self.lifecycle not in (FRESH, REUSE):
            raise ValueError(f"lifecycle must be {FRESH!r} or {REUSE!r}, not {self.lifecycle!r}")
        if self.max_waiters_per_client < 1:
            raise ValueError("max_waiters_per_client must be at least 1")
        if self.max_images < 1:
            raise ValueError("max_images must be at least 1")


_GONE_ERRORS = {"released": "lease_released", "expired": "lease_expired", "sandbox_lost": "sandbox_lost",
                "unknown": "lease_unknown"}


def _gone(err: LeaseGone) -> JSONResponse:
    detail = {
        "released": "the lease was released",
        "expired": "the lease expired: no call or heartbeat within the lease TTL",
        "sandbox_lost": "the sandbox behind this lease failed; its state is lost; lease again",
        "unknown": "no such lease",
    }[err.reason]
    status = 404 if err.reason == "unknown" else 410
    return JSONResponse({"error": _GONE_ERRORS[err.reason], "detail": detail, "lease_id": err.lease_id},
                        status_code=status)


class _Upstream:
    """The gateway's client of the sandboxes.

    aiohttp rather than httpx: the proxy hop is the gateway's whole per-exec cost, and
    aiohttp spends about a sixth of httpx's CPU per request (measured here). Idle
    connections are closed after 15 s, before the sandbox's own 30 s keep-alive ends them,
    so a request never lands on a connection the server is closing.
    """

    def __init__(self, token: str):
        # no credential by default: health checks carry none, a reset its own (challenge)
        self.headers = {"content-type": "application/json"}
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            headers=self.headers,
            connector=aiohttp.TCPConnector(limit=4096, limit_per_host=0, keepalive_timeout=15),
        )

    async def request(self, method: str, url: str, timeout: float, body=None,
                      secret: str | None = None, content_type: str | None = None,
                      headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """`secret`: a lease's (the data calls of that lease); `headers`: e.g. a reset's
        credential; `body`: bytes, or an async iterator of bytes sent as it comes (a streamed exec)."""
        t = aiohttp.ClientTimeout(total=timeout, sock_connect=5.0)
        headers = dict(headers or {})
        if secret:
            headers["authorization"] = f"Bearer {secret}"
        if content_type:
            headers["content-type"] = content_type
        async with self.session.request(method, url, data=body, timeout=t, headers=headers or None) as r:
            return r.status, await r.read()

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


_CONNECTION_ERRORS = (aiohttp.ClientError, OSError)


class Gateway:
    """The gateway's state (pool, upstream client, metrics) and its routes, one method each.

    Routed by Starlette, not FastAPI: lease operations are the gateway's own hot path, and
    FastAPI's per-request signature and dependency work was a large share of the app's CPU
    per lease operation. Bodies are still validated by the `messages` models (`parse_body`).
    """

    def __init__(self, settings: GatewaySettings, source):
        self.settings = settings
        self.source = source
        self.metrics = GatewayMetrics()
        self.http = _Upstream(settings.sandbox_token)
        lifecycle = settings.lifecycle
        if lifecycle == FRESH and not getattr(source, "replaces_members", False):
            log.warning("lifecycle fresh needs members that are replaced once retired (sandbox pods); "
                        "%s cannot, so sandboxes are reset and reused", type(source).__name__)
            lifecycle = REUSE
        self.pool = Pool(
            reset_fn=self.reset_member,
            retire_fn=self.retire_member,
            metrics=self.metrics,
            lease_ttl_seconds=settings.lease_ttl_seconds,
            lease_max_seconds=settings.lease_max_seconds,
            lifecycle=lifecycle,
            max_waiters_per_client=settings.max_waiters_per_client,
            max_images=settings.max_images,
            image_idle_seconds=settings.image_idle_seconds,
        )
        self._token = settings.token.encode()

    # wiring -----------------------------------------------------------------------------
    def asgi(self) -> GuardMiddleware:
        routes = []
        for method, path, handler in (
            ("POST", "/v1/leases", self.lease),
            ("POST", "/v1/leases/{lease_id}/heartbeat", self.heartbeat),
            ("POST", "/v1/heartbeats", self.heartbeats),
            ("DELETE", "/v1/leases/{lease_id}", self.release),
            ("POST", "/v1/leases/{lease_id}/lost", self.report_lost),
            ("POST", "/v1/leases/{lease_id}/exec", self.exec_),
            ("POST", "/v1/leases/{lease_id}/exec/stream", self.exec_stream),
            ("POST", "/v1/leases/{lease_id}/files/read", self.read),
            ("POST", "/v1/leases/{lease_id}/files/write", self.write),
            ("POST", "/v1/leases/{lease_id}/score", self.score),
            ("GET", wire.GATEWAY_DEMAND_PATH, self.demand),
            ("GET", "/v1/pool", self.pool_view),
            ("POST", wire.GATEWAY_DRAIN_PATH, self.drain),
            ("GET", "/healthz", self.healthz),
            ("GET", "/metrics", self.prom),
        ):
            routes.append(Route(path, json_endpoint(handler), methods=[method]))
        app = Starlette(routes=routes, lifespan=self._lifespan, exception_handlers=exception_handlers())
        app.state.pool = self.pool
        return GuardMiddleware(
            app,
            authorize=self.authorize,
            max_body_bytes=self.settings.max_body_bytes,
            open_paths=frozenset({"/healthz", "/metrics", wire.GATEWAY_DEMAND_PATH}),
            streamed=lambda path: _STREAM_PATH.match(path) is not None,
            on_reject=lambda reason: self.metrics.rejected.labels(reason=reason).inc(),
        )

    @asynccontextmanager
    async def _lifespan(self, _app):
        await self.http.start()
        tasks = [asyncio.create_task(t) for t in (self.source.run(self.pool), self._health_loop(),
                                                   self._startup_loop(), self._expiry_loop())]
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await self.pool.close()
            await self.http.close()

    def authorize(self, path: str, presented: str | None) -> Grant | None:
        """Lease routes open with that lease's secret only; the rest with the run token."""
        if presented is None:
            return None
        m = _LEASE_PATH.match(path)
        if m is None:
            return Grant("control") if hmac.compare_digest(presented.encode(), self._token) else None
        verdict = self.pool.check(m.group(1), presented)
        if verdict == "ok":
            return Grant("lease", lease_id=m.group(1))
        if verdict == "refused":
            return None
        err = _gone(LeaseGone(m.group(1), verdict))
        raise Refused(err.status_code, loads(err.body)["error"], loads(err.body)["detail"])

    # the sandboxes' side ------------------------------------------------------------------
    async def reset_member(self, m: Member) -> bool:
        """Reset the sandbox and install the secret of its next lease (one reset, one secret)."""
        secret = secrets.token_urlsafe(32)
        # the token is never sent: the credential is made with it, the secret rides sealed,
        # and the answer must prove the sandbox knows the token (asyncgrpo.sandbox.common.challenge)
        call = reset_call(self.settings.sandbox_token, m.url, secret)
        m.next_secret = None
        try:
            status, answer = await self.http.request("POST", f"{m.url}/v1/reset", self.settings.reset_timeout_seconds,
                                                     call.body, headers=call.headers)
            if status == 200 and not call.proven_by(answer):
                log.warning("reset of %s: the answer does not prove the sandbox token: not a sandbox of ours",
                            m.name)
                return False
            if status == 200:
                m.next_secret = secret
            return status == 200
        except (TimeoutError, *_CONNECTION_ERRORS) as err:
            log.warning("reset of %s failed: %s", m.name, err)
            return False

    async def retire_member(self, m: Member) -> None:
        """A retired sandbox (its one group is done): revoke that lease's secret there and stop
        its commands at once, installing none, so the direct data path is closed before the
        operator deletes the pod. Best effort: the pod is deleted either way."""
        call = reset_call(self.settings.sandbox_token, m.url, None)  # revoke, install none
        try:
            await self.http.request("POST", f"{m.url}/v1/reset", self.settings.reset_timeout_seconds,
                                    call.body, headers=call.headers)
        except (TimeoutError, *_CONNECTION_ERRORS) as err:
            log.info("revoking retired %s failed (it is deleted anyway): %s", m.name, err)

    async def healthy(self, m: Member) -> tuple[bool, str, bool]:
        """(answered 200, why not, whether it was only slow)."""
        try:
            status, _ = await self.http.request("GET", f"{m.url}/healthz", self.settings.health_timeout_seconds)
            return status == 200, f"health returned {status}", False
        except TimeoutError as err:  # aiohttp's ServerTimeoutError is one too
            return False, f"health check timed out: {type(err).__name__}", True
        except _CONNECTION_ERRORS as err:
            return False, f"health check failed: {type(err).__name__}", False

    async def probe(self, m: Member) -> None:
        ok, reason, slow = await self.healthy(m)
        if ok:
            self.pool.health_ok(m.name)
            return
        lease = self.pool.leases.get(m.lease_id) if m.lease_id else None
        if slow and lease is not None and lease.in_flight:
            # a sandbox busy with a heavy command answers slowly, but it answers its exec:
            # only a refused or dropped connection takes a leased sandbox out mid-call
            return
        self.pool.health_failed(m.name, reason, self.settings.health_failures)

    async def _health_loop(self) -> None:
        while True:
            members = [m for m in self.pool.members.values() if m.state != RETIRED]
            if members:
                await asyncio.gather(*(self.probe(m) for m in members), return_exceptions=True)
            await asyncio.sleep(self.settings.health_interval_seconds)

    async def _startup_loop(self) -> None:
        """New members (state `starting`) probed every STARTUP_PROBE_SECONDS: a fresh sandbox
        that replaced a retired one serves as soon as it listens (a failed probe of a
        starting member counts for nothing)."""
        while True:
            await asyncio.sleep(STARTUP_PROBE_SECONDS)
            starting = [m for m in self.pool.members.values() if m.state == STARTING]
            if starting:
                await asyncio.gather(*(self.probe(m) for m in starting), return_exceptions=True)

    async def _expiry_loop(self) -> None:
        while True:
            await asyncio.sleep(max(0.2, min(self.settings.lease_ttl_seconds / 4, 5.0)))
            self.pool.expire()

    # leases ---------------------------------------------------------------------------------
    async def lease(self, request: Request):
        req = await parse_body(request, LeaseRequest)
        s, pool = self.settings, self.pool
        wait = min(s.max_wait_seconds if req.wait_seconds is None else req.wait_seconds, s.max_wait_seconds)
        scope = group_scope(req.group_id, req.group_key)
        if req.image is not None and (problem := image_reference_problem(req.image)):
            raise ApiError(422, "invalid_request", [{"loc": ["image"], "msg": problem}])
        try:  # a join or a warm sandbox: no wait, no tasks
            hit = pool.try_acquire(req.group_id, scope=scope, image=req.image)
        except TooManyImages as err:
            return JSONResponse(
                {"error": "too_many_images", "detail": str(err)},
                status_code=429, headers={"retry-after": str(int(s.image_idle_seconds))})
        if hit is None:
            # the queue a wait goes in, and the bound it counts against: the caller's address
            # (every client holds the same run token, so nothing it sends could name it)
            client = request.client.host if request.client else ""
            acquiring = asyncio.ensure_future(pool.acquire(req.group_id, wait, client=client, scope=scope,
                                                           image=req.image))
            gone = asyncio.ensure_future(_until_disconnected(request))
            try:
                # a client that hangs up while waiting gives its place in the queue up
                await asyncio.wait({acquiring, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                if not acquiring.done():
                    acquiring.cancel()
            # cancel() only asks: the task is not done (nor cancelled) until it has run its
            # own clean-up, so a hang-up is "not done" here (reading its result raised
            # InvalidStateError, a 500 and a traceback for every waiter that left)
            if not acquiring.done() or acquiring.cancelled():
                return Response(status_code=499)  # nobody reads it
            try:
                hit = acquiring.result()
            except TooManyWaiters as err:
                return JSONResponse(
                    {"error": "too_many_waiters",
                     "detail": f"this client ({client}) already has {err.bound} lease requests waiting; "
                               "wait for one to be served before asking again"},
                    status_code=429, headers={"retry-after": "1"})
            except NoSandbox:
                return JSONResponse(
                    {"error": "no_sandbox", "detail": f"no sandbox free within {wait:g}s", "demand": _small(pool)},
                    status_code=503, headers={"retry-after": "1"},
                )
        lease, joined = hit
        body = {
            "lease_id": lease.id,
            "secret": lease.secret,
            "group_id": lease.group_id,
            "sandbox": lease.member,
            "data_path": s.data_path,
            "holders": lease.holders,
            "joined": joined,
            "ttl_seconds": s.lease_ttl_seconds,
            "exec_slack_seconds": EXEC_SLACK_SECONDS,
            "waited_seconds": round(lease.waited_seconds, 6),
            "image": pool.members[lease.member].image,
        }
        if s.data_path == "direct":
            body["sandbox_url"] = pool.members[lease.member].url
        return body

    async def heartbeat(self, request: Request):
        lease_id = request.path_params["lease_id"]
        try:
            lease = self.pool.touch(lease_id)
        except LeaseGone as err:
            return _gone(err)
        return {"lease_id": lease_id, "holders": lease.holders, "ttl_seconds": self.settings.lease_ttl_seconds}

    async def heartbeats(self, request: Request):
        """Each lease beaten if its secret opens it, else its end reason (or `unauthorized`)."""
        req = await parse_body(request, HeartbeatsRequest)
        out: dict[str, dict] = {}
        for held in req.leases:
            verdict = self.pool.check(held.lease_id, held.secret)
            if verdict == "ok":
                out[held.lease_id] = {"holders": self.pool.touch(held.lease_id).holders}
            elif verdict == "refused":
                out[held.lease_id] = {"error": "unauthorized"}
            else:
                out[held.lease_id] = {"error": _GONE_ERRORS[verdict]}
        return {"ttl_seconds": self.settings.lease_ttl_seconds, "leases": out}

    async def release(self, request: Request):
        lease_id = request.path_params["lease_id"]
        all_holders = _query_bool(request, "all")
        try:
            return self.pool.release(lease_id, all_holders=all_holders)
        except LeaseGone as err:
            return _gone(err)

    async def report_lost(self, request: Request):
        """A direct call to the leased sandbox got no answer in time: check it now, eject if down."""
        lease_id = request.path_params["lease_id"]
        try:
            lease, member = self.pool.get(lease_id)
        except LeaseGone as err:
            return _gone(err)
        alive, reason, _slow = await self.healthy(member)
        if alive:
            return {"lease_id": lease_id, "ended": False, "sandbox": member.name}
        if self.pool.leases.get(lease_id) is lease:
            self.pool.lost(member.name, f"reported by the lease holder; {reason}")
        return _gone(LeaseGone(lease_id, "sandbox_lost"))

    # the proxied data path ---------------------------------------------------------------------
    async def exec_(self, request: Request) -> Response:
        body, timeout = self._capped_exec(await request.body())
        return await self._forward(request.path_params["lease_id"], "/v1/exec", body, timeout)

    async def exec_stream(self, request: Request) -> Response:
        """A streamed exec: its first line capped like any exec, then stdin passed on as it comes."""
        chunks = request.stream()
        head, rest = await read_stream_head(chunks, self.settings.max_body_bytes)
        head, timeout = self._capped_exec(head)

        async def body():
            yield head + b"\n" + rest
            try:
                async for chunk in chunks:
                    if chunk:
                        yield chunk
            except ClientDisconnect:
                return

        return await self._forward(request.path_params["lease_id"], "/v1/exec/stream", body(), timeout,
                                   EXEC_STREAM_TYPE)

    async def read(self, request: Request) -> Response:
        body = await request.body()
        return await self._forward(request.path_params["lease_id"], "/v1/files/read", body, _FILE_CALL_SECONDS)

    async def write(self, request: Request) -> Response:
        body = await request.body()
        return await self._forward(request.path_params["lease_id"], "/v1/files/write", body, _FILE_CALL_SECONDS)

    async def score(self, request: Request) -> Response:
        """A rollout's scoring (`/v1/score`): its timeout capped like an exec's, and its answer
        waited for a while longer (the sandbox sweeps and writes the scoring session first)."""
        body, timeout = self._capped_exec(await request.body(), ScoreRequest)
        if timeout != _FILE_CALL_SECONDS:
            timeout += SCORE_SETUP_SECONDS
        return await self._forward(request.path_params["lease_id"], "/v1/score", body, timeout)

    def _capped_exec(self, raw: bytes, model=ExecRequest) -> tuple[bytes, float]:
        """The exec with its timeout capped at ours, and how long to wait for its answer.

        The sandbox must give up before we do, so a slow command ends as a timed-out result
        and never as a dropped connection. A body that is no valid exec goes on unchanged:
        the sandbox refuses it with its own error.
        """
        cap = self.settings.max_exec_seconds
        try:
            req = model.validate(loads(raw))
        except ValueError:  # bad JSON, or `messages.Invalid`
            return raw, _FILE_CALL_SECONDS
        req.timeout_seconds = min(req.timeout_seconds or cap, cap)
        return json.dumps(req.dump(exclude_unset=True)).encode(), req.timeout_seconds + EXEC_SLACK_SECONDS

    async def _forward(self, lease_id: str, path: str, body, timeout: float, content_type: str | None = None):
        # looked up after the last await before the call: between here and `in_flight += 1`
        # nothing can end the lease or hand its sandbox to another group
        pool = self.pool
        try:
            lease, member = pool.get(lease_id)
        except LeaseGone as err:
            return _gone(err)
        lease.in_flight += 1
        lease.last_seen = pool.clock()
        t0 = time.monotonic()
        try:
            status, content = await self.http.request("POST", member.url + path, timeout, body,
                                                      secret=lease.secret, content_type=content_type)
        except TimeoutError:
            # the sandbox bounds every call by its timeout (queueing included): silence past
            # that plus the slack means it is hung, not slow. Out now, the group leases again.
            self.metrics.proxy_errors.inc()
            if pool.leases.get(lease_id) is lease:
                pool.lost(member.name, f"{path} got no answer within {timeout:g}s")
            return JSONResponse(
                {"error": "sandbox_lost", "lease_id": lease_id, "sandbox": member.name,
                 "detail": f"the sandbox did not answer within {timeout:g}s and was taken out; "
                           "its state is lost: lease again"}, status_code=504)
        except _CONNECTION_ERRORS as err:
            self.metrics.proxy_errors.inc()
            alive, _, _ = await self.healthy(member)
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
        if path.startswith("/v1/exec"):
            self.metrics.exec_seconds.observe(time.monotonic() - t0)
        return Response(content, status_code=status, media_type="application/json")

    # views and control ---------------------------------------------------------------------------
    async def demand(self, _request: Request):
        return self.pool.demand()

    async def pool_view(self, _request: Request):
        """For people and the operator: states and ids, never a secret or a group's name."""
        pool = self.pool
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

    async def drain(self, request: Request):
        return self.pool.drain(request.path_params["name"])

    async def healthz(self, _request: Request):
        return {"status": "ok", "members": len(self.pool.members)}

    async def prom(self, _request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


_TRUE, _FALSE = frozenset({"1", "on", "t", "true", "y", "yes"}), frozenset({"0", "off", "f", "false", "n", "no"})


def _query_bool(request: Request, name: str) -> bool:
    """A boolean query parameter, read as FastAPI (pydantic) did; absent is False."""
    raw = request.query_params.get(name)
    if raw is None or raw.lower() in _FALSE:
        return False
    if raw.lower() in _TRUE:
        return True
    raise ApiError(422, "invalid_request", f"query parameter {name!r} must be a boolean, not {raw!r}")


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_gateway(settings: GatewaySettings, source) -> GuardMiddleware:
    return Gateway(settings, source).asgi()


def _small(pool: Pool) -> dict:
    d = pool.demand()
    return {k: d[k] for k in ("busy", "idle", "waiting", "starting", "unhealthy", "retired")}

