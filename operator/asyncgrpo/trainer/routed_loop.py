"""TRL's rollout loop sending each group's requests to one vLLM replica (`trainer.routing`).

Why here and not in a proxy: the rollout loop is the one place that knows which requests
belong to one group and to one conversation (TRL runs each rollout as its own asyncio task,
`_generate_one(..., group_id=...)`, and awaits every turn inside it), and a router in
front of vLLM would add a hop and a process to every request for knowledge it would have to
guess from the prompt's bytes.

Where the replicas come from (`ASYNCGRPO_VLLM_REPLICAS`): the operator names the vLLM pods'
**headless Service** (`<run>-vllm-replicas`), whose DNS records are the Ready pods' addresses,
re-resolved every `refresh_s`. Least privilege: the trainer keeps running with no
ServiceAccount token (`<run>-workload` mounts none) and no Role; reading EndpointSlices
would need both, for the same list DNS already gives, and a list the operator writes into
the run's ConfigMap would lag by a reconcile and a kubelet sync. Readiness gates the DNS
records, so a replica still loading (or, with full fine-tuning, whose puller has not caught
up) gets nothing. Tests and benchmarks pass a comma-separated list of roots instead.

Version-aware (full fine-tuning, `ASYNCGRPO_VLLM_PULLER_PORT`): each replica's puller
`/status` (`served_version`, `swapping`) is read every `refresh_s` (1 s deadline each).

Failover: a connection error, a timeout or a 5xx marks the replica down for a cool-down and
the same request goes at once to the group's next replica; the conversation's later turns
follow it there. Without any healthy replica the request goes to the Service
(`ASYNCGRPO_VLLM_URL`), as without routing.

Kept-alive connections are not failures: vLLM's uvicorn closes a connection idle for 5 s
(`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`) and aiohttp keeps one 15 s by default, so a request sent on
a connection the server has just closed fails (`ServerDisconnectedError`, "Can not write
request body") from a healthy replica; the routing bench saw 28 such false failovers in one
run, each marking a healthy replica down and moving its groups. The routed requests use a
session of their own whose idle connections are dropped after `KEEPALIVE_S` (under the
server's 5 s), and a request that fails on a reused connection is sent once more to the same
replica on a new one before it counts as the replica's failure.

Metrics pushed through TRL's metrics queue (`asyncgrpo.trainer.metrics` maps them):
`routing/<replica>/requests_total`, `.../groups_total`, `.../failovers_total`,
`.../groups_in_flight`, `.../served_version`; `<replica>` is `host:port`, Prometheus'
`instance` label of that vLLM pod's own `vllm:*` series.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from contextvars import ContextVar

import aiohttp
from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

from asyncgrpo.trainer.routing import Router, RoutingConfig

log = logging.getLogger(__name__)

#: the group of the rollout this task runs (set around TRL's `_generate_one`)
_group: ContextVar[object] = ContextVar("asyncgrpo_route_group", default=None)
PULLER_TIMEOUT_S = 1.0
_TRANSPORT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError,
                     asyncio.TimeoutError, TimeoutError, ConnectionResetError)
#: idle routed connections are closed after this (vLLM's uvicorn closes them after 5 s)
KEEPALIVE_S = 4.0


def _stale_connection(err: BaseException) -> bool:
    """A failure of a connection the server may have closed while it was idle in the pool:
    the server went away before answering, or the request could not be written. A new
    connection that cannot be made (refused, unreachable) is the replica's own failure."""
    if isinstance(err, aiohttp.ServerDisconnectedError):
        return True
    return isinstance(err, aiohttp.ClientOSError) and not isinstance(
        err, aiohttp.ClientConnectorError)


def _hostport(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _host(replica: str) -> str:
    return replica.rsplit(":", 1)[0]


async def resolve(cfg: RoutingConfig) -> list[str] | None:
    """The replicas now (`host:port`); None when the name does not resolve (keep the last)."""
    if (static := cfg.static) is not None:
        return static
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(
            cfg.replicas, cfg.port, type=socket.SOCK_STREAM)
    except (socket.gaierror, OSError) as err:
        log.warning("routing: %s does not resolve (%s); keeping the last replicas",
                    cfg.replicas, err)
        return None
    return sorted({_hostport(info[4][0], cfg.port) for info in infos})


class RoutedRolloutLoop(_AsyncRolloutLoop):
    """TRL's loop; with `routing=` each request goes to its group's replica."""

    def __init__(self, *args, routing: RoutingConfig | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._routing = routing
        self.router = Router(c=routing.load_factor) if routing is not None else None
        self._unkeyed = 0
        self._route_session: aiohttp.ClientSession | None = None
        self._fresh_session: aiohttp.ClientSession | None = None

    # -- replicas and versions -------------------------------------------------------------

    async def refresh_replicas(self) -> None:
        replicas = await resolve(self._routing)
        if replicas is not None and self.router.set_replicas(replicas):
            log.info("routing over %d vLLM replicas: %s", len(replicas), ", ".join(replicas))
        if self._routing.puller_port is not None and self._route_session is not None:
            await asyncio.gather(*(self._read_puller(r) for r in self.router.replicas))

    async def _read_puller(self, replica: str) -> None:
        url = f"http://{_host(replica)}:{self._routing.puller_port}/status"
        try:
            async with self._route_session.get(
                    url, timeout=aiohttp.ClientTimeout(total=PULLER_TIMEOUT_S)) as resp:
                doc = await resp.json(content_type=None) if resp.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError, ValueError):
            doc = {}
        version = doc.get("served_version") if isinstance(doc, dict) else None
        swapping = bool(doc.get("swapping")) if isinstance(doc, dict) else False
        self.router.set_version(replica, version if isinstance(version, int) else None,
                                swapping)

    async def _follow(self, stop_event: asyncio.Event) -> None:
        while not stop_event.is_set():
            await asyncio.sleep(self._routing.refresh_s)
            try:
                await self.refresh_replicas()
            except Exception:  # routing must never take the rollouts down
                log.exception("routing: refresh failed")

    @contextlib.asynccontextmanager
    async def sessions(self, limit: int):
        """The routed requests' two connection pools, as the rollout loop holds them (benches
        and tests use the same): kept-alive connections closed after KEEPALIVE_S, before
        vLLM's own idle close, and fresh connections for the one resend of a request a closed
        keep-alive broke. Yields the kept-alive one."""
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(
                limit=limit, keepalive_timeout=KEEPALIVE_S)) as session, \
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(
                    limit=limit, force_close=True)) as fresh:
            self._route_session, self._fresh_session = session, fresh
            try:
                yield session
            finally:
                self._route_session = self._fresh_session = None

    async def _run_loops(self, stop_event: asyncio.Event) -> None:
        if self.router is None:
            return await super()._run_loops(stop_event)
        async with self.sessions(self.max_inflight_tasks):
            await self.refresh_replicas()
            follower = asyncio.create_task(self._follow(stop_event))
            try:
                await super()._run_loops(stop_event)
            finally:
                follower.cancel()
                await asyncio.gather(follower, return_exceptions=True)

    # -- one rollout, its requests ---------------------------------------------------------

    async def _generate_one(self, *args, group_id: int = 0, **kwargs):
        if self.router is None:
            return await super()._generate_one(*args, group_id=group_id, **kwargs)
        token = _group.set(group_id)
        self.router.start(group_id)
        try:
            return await super()._generate_one(*args, group_id=group_id, **kwargs)
        finally:
            self.router.finish(group_id)
            _group.reset(token)

    async def _post(self, path: str, payload: dict, timeout: float, max_retries: int = 3):
        if self.router is None or not self.router.replicas:
            return await super()._post(path, payload, timeout, max_retries)
        group = _group.get()
        if group is None:  # not inside a rollout: spread
            self._unkeyed += 1
            group = ("unkeyed", self._unkeyed)
        client_timeout = aiohttp.ClientTimeout(total=timeout)
        for attempt in range(max_retries):
            replica, placed = self.router.route(group)
            if replica is None:  # none healthy: the Service, as without routing
                return await super()._post(path, payload, timeout, max_retries)
            if placed:
                self._counters[f"routing/{replica}/groups_total"] += 1
            self._counters[f"routing/{replica}/requests_total"] += 1
            try:
                try:
                    content = await self._send(self._route_session, replica, path, payload,
                                               client_timeout)
                except _TRANSPORT_ERRORS as err:
                    if not _stale_connection(err):
                        raise
                    log.info("vLLM replica %s: %s on a kept-alive connection; sending %s "
                             "again on a new one", replica, type(err).__name__, path)
                    content = await self._send(self._fresh_session, replica, path, payload,
                                               client_timeout)
                self.router.succeeded(replica)
                return content
            except aiohttp.ClientResponseError as err:
                if err.status < 500:  # the request's own fault: TRL's retry decides
                    raise
                failure = err
            except _TRANSPORT_ERRORS as err:
                failure = err
            self.router.failed(replica)
            self._counters[f"routing/{replica}/failovers_total"] += 1
            self._counters["rollout/vllm_retry_total"] += 1
            log.warning("vLLM replica %s failed %s (%s: %s); group %s moves", replica, path,
                        type(failure).__name__, failure, group)
            if attempt >= max_retries - 1:
                raise failure
            if not any(self.router.healthy(r) for r in self.router.replicas):
                await asyncio.sleep(min(2 ** attempt, 16))

    @staticmethod
    async def _send(session: aiohttp.ClientSession, replica: str, path: str, payload: dict,
                    timeout: aiohttp.ClientTimeout) -> dict:
        async with session.post(f"http://{replica}{path}", json=payload,
                                timeout=timeout) as response:
            response.raise_for_status()
            content = await response.json()
        return content if content else {}

    def _push_metrics(self, values):
        if self.router is not None:
            values = dict(values)
            for r in self.router.replicas:
                values[f"routing/{r}/groups_in_flight"] = float(self.router.load(r))
                for counter in ("requests_total", "groups_total", "failovers_total"):
                    # every replica's counters exist from the first window, at 0 when
                    # nothing happened: rate() sees no counter before its first sample
                    values.setdefault(f"routing/{r}/{counter}", 0.0)
                st = self.router.state(r)
                if st is not None and st.served_version is not None:
                    values[f"routing/{r}/served_version"] = float(st.served_version)
        super()._push_metrics(values)
