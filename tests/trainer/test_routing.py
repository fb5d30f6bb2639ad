"""The router's ring, loads, pins, failures and versions, without a cluster or a server."""

from __future__ import annotations

import asyncio
import random

import pytest

from asyncgrpo import wire
from asyncgrpo.trainer import routing
from asyncgrpo.trainer.routing import HashRing, Router, RoutingConfig, capacity


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


REPLICAS = [f"10.0.0.{i}:8000" for i in range(1, 5)]


def _open(router: Router, groups) -> dict:
    """Start one rollout of each group and route its first request."""
    out = {}
    for g in groups:
        router.start(g)
        out[g] = router.route(g)[0]
    return out


def test_every_request_of_a_group_goes_to_its_replica_while_it_is_in_flight():
    router = Router(REPLICAS)
    first = _open(router, range(40))
    for _turn in range(3):  # later turns and later rollouts of the same groups
        for g in range(40):
            router.start(g)
            assert router.route(g) == (first[g], False)
    assert len(set(first.values())) == 4  # and the groups spread


def test_no_replica_holds_more_than_the_bound_of_groups_in_flight():
    rng = random.Random(0)
    for n in (2, 3, 4, 7):
        router = Router(REPLICAS[:2] + [f"r{i}:1" for i in range(n - 2)])
        live: list[int] = []
        for g in range(400):
            if live and rng.random() < 0.45:  # groups finish in any order
                done = live.pop(rng.randrange(len(live)))
                router.finish(done)
            router.start(g)
            router.route(g)
            live.append(g)
            loads = [router.load(r) for r in router.replicas]
            assert sum(loads) == len(live)
            assert max(loads) <= capacity(len(live), n), (n, loads)


def test_the_bound_is_at_most_a_quarter_above_the_mean_or_the_mean_rounded_up():
    assert capacity(8, 2) == 5        # mean 4: 1.25x
    assert capacity(2, 2) == 1        # 1.25x the mean rounds below 2: one each
    assert capacity(3, 2) == 2        # the mean rounded up
    assert capacity(100, 4) == 31


def test_keys_that_all_hash_to_one_replica_spill_to_the_next_instead_of_pinning_it():
    ring = HashRing(REPLICAS[:2])
    hot = [k for k in range(1000) if next(ring.walk(k)) == REPLICAS[0]][:10]
    router = Router(REPLICAS[:2])
    placed = _open(router, hot)
    # without the bound all ten would sit on the first replica; with it, at most 1.25x the mean
    assert [router.load(r) for r in REPLICAS[:2]] == [capacity(10, 2), 10 - capacity(10, 2)]
    assert capacity(10, 2) == 6, placed


def test_removing_a_replica_moves_only_its_groups():
    router = Router(REPLICAS)
    first = _open(router, range(60))
    router.set_replicas(REPLICAS[:3])
    for g, r in first.items():
        now, _ = router.route(g)
        if r in REPLICAS[:3]:
            assert now == r
        else:
            assert now in REPLICAS[:3]


def test_a_new_replica_gets_new_groups():
    router = Router(REPLICAS[:2])
    _open(router, range(20))
    router.set_replicas(REPLICAS[:3])
    new = _open(router, range(20, 60))
    assert sum(r == REPLICAS[2] for r in new.values()) >= 10  # the bound fills it first


def test_a_failed_replica_loses_its_groups_until_its_cool_down_ends():
    clock = Clock()
    router = Router(REPLICAS[:2], clock=clock)
    first = _open(router, range(10))
    bad = first[0]
    router.failed(bad)
    moved, placed = router.route(0)
    assert moved != bad and placed
    assert router.route(0) == (moved, False)  # the conversation stays where it went
    assert all(router.route(g)[0] != bad for g in range(10))
    clock.t += routing.COOLDOWN_S + 0.1
    assert router.healthy(bad)
    router.failed(bad)  # again: twice as long
    clock.t += routing.COOLDOWN_S + 0.1
    assert not router.healthy(bad)
    router.failed(moved)
    assert router.route(99) == (None, False)  # none healthy: the caller uses the Service


def test_new_groups_go_to_replicas_serving_the_newest_version_and_none_mid_swap():
    router = Router(REPLICAS[:3])
    old = _open(router, range(12))
    a, b, c = REPLICAS[:3]
    router.set_version(a, 4, swapping=False)
    router.set_version(b, 3, swapping=False)      # behind
    router.set_version(c, 4, swapping=True)       # mid-swap
    new = _open(router, range(12, 40))
    assert set(new.values()) == {a}
    # groups already placed keep their replica (a paused replica's requests just wait)
    assert all(router.route(g)[0] == r for g, r in old.items())
    router.set_version(b, 4, swapping=False)
    router.set_version(c, 4, swapping=False)
    # caught up: eligible again, and the bound sends them the new groups first (a is full)
    assert set(_open(router, range(40, 80)).values()) >= {b, c}


def test_with_no_replica_serving_the_newest_eligible_any_healthy_one_serves():
    clock = Clock()
    router = Router(REPLICAS[:2], clock=clock)
    router.set_version(REPLICAS[0], 5, swapping=True)
    router.set_version(REPLICAS[1], 4, swapping=False)
    router.failed(REPLICAS[1])
    router.start(1)
    assert router.route(1)[0] == REPLICAS[0]


def test_config_from_the_environment():
    assert RoutingConfig.from_env({}) is None
    cfg = RoutingConfig.from_env({wire.VLLM_REPLICAS_ENV: "run-vllm-replicas:8123",
                                  wire.VLLM_PULLER_PORT_ENV: "8100"})
    assert (cfg.replicas, cfg.port, cfg.puller_port) == ("run-vllm-replicas", 8123, 8100)
    assert cfg.static is None
    cfg = RoutingConfig.from_env({wire.VLLM_REPLICAS_ENV: "run-vllm-replicas"})
    assert cfg.port == wire.VLLM_PORT and cfg.puller_port is None
    cfg = RoutingConfig.from_env(
        {wire.VLLM_REPLICAS_ENV: "http://127.0.0.2:8001, http://[::1]:8002,"})
    assert cfg.static == ["127.0.0.2:8001", "[::1]:8002"] and cfg.puller_port is None


def test_a_dns_name_resolves_to_its_addresses():
    pytest.importorskip("trl")
    from asyncgrpo.trainer.routed_loop import resolve

    got = asyncio.run(resolve(RoutingConfig("localhost", port=8000)))
    assert "127.0.0.1:8000" in got
    assert asyncio.run(resolve(RoutingConfig("no-such-host.invalid"))) is None


def test_the_rollout_workers_routing_numbers_become_per_replica_series():
    from prometheus_client.parser import text_string_to_metric_families

    from asyncgrpo.trainer.metrics import TrainerMetrics

    def series(m):
        return {(s.name, s.labels.get("replica")): s.value
                for f in text_string_to_metric_families(m.exposition().decode())
                for s in f.samples if "rollout_r" in s.name and not s.name.endswith("_created")}

    m = TrainerMetrics()
    a, b = "10.0.0.1:8000", "[fd00::2]:8000"
    # one TRL logging window, reduced per key as TRL does (counters summed, gauges averaged)
    m.update_from_logs({f"routing/{a}/requests_total": 30.0, f"routing/{b}/requests_total": 28.0,
                        f"routing/{a}/groups_total": 4.0, f"routing/{b}/failovers_total": 1.0,
                        f"routing/{a}/groups_in_flight": 2.0, f"routing/{b}/groups_in_flight": 1.5,
                        f"routing/{a}/served_version": 7.0, "reward": 0.5})
    m.update_from_logs({f"routing/{a}/requests_total": 2.0, f"routing/{a}/groups_in_flight": 1.0})
    got = series(m)
    p = "asyncgrpo_trainer_rollout_"
    assert got[(p + "routed_requests_total", a)] == 32 and got[(p + "routed_requests_total", b)] == 28
    assert got[(p + "routed_groups_total", a)] == 4
    assert got[(p + "route_failovers_total", b)] == 1
    # a replica that never failed has its failovers counter at 0 (a counter born at its
    # first increment is invisible to rate(): the dashboard's failovers panel was empty)
    m.update_from_logs({f"routing/{a}/failovers_total": 0.0})
    assert series(m)[(p + "route_failovers_total", a)] == 0
    assert got[(p + "replica_groups_in_flight", a)] == 1.0
    # b left the replica set: its gauges go, its counters stay (Prometheus' rate needs them)
    assert (p + "replica_groups_in_flight", b) not in got
    assert got[(p + "replica_served_version", a)] == 7.0


class _ClosesKeptAliveConnections:
    """An HTTP server that answers the first request of each connection (keep-alive) and
    closes the connection, unanswered, when a second request arrives on it: what a client
    sees when it reuses a connection that vLLM's uvicorn closed after its 5 s idle timeout,
    without waiting for the race."""

    def __init__(self):
        self.answered = 0
        self.closed_unanswered = 0

    async def handle(self, reader, writer):
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if served:
                    self.closed_unanswered += 1
                    break
                body = b'{"choices": [{"text": "ok"}]}'
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Connection: keep-alive\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(body), body))
                await writer.drain()
                served += 1
                self.answered += 1
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def test_a_kept_alive_connection_the_server_closed_is_not_the_replicas_failure():
    """The routing bench (2026-12-03) saw 28 false failovers in one run: a request sent on a
    pooled connection vLLM had just closed failed with ServerDisconnectedError, and the router
    marked a healthy replica down and moved its groups. The request now goes once more to the
    same replica on a new connection."""
    pytest.importorskip("trl")
    from collections import defaultdict

    import aiohttp

    from asyncgrpo.trainer import routed_loop

    server = _ClosesKeptAliveConnections()

    async def scenario():
        servers = [await asyncio.start_server(server.handle, host, 0)
                   for host in ("127.0.0.1", "127.0.0.2")]
        replicas = [f"{s.sockets[0].getsockname()[0]}:{s.sockets[0].getsockname()[1]}"
                    for s in servers]
        # the loop's own parts only (TRL's constructor would spawn nothing this needs)
        loop = routed_loop.RoutedRolloutLoop.__new__(routed_loop.RoutedRolloutLoop)
        loop.router, loop._unkeyed, loop._counters = Router(), 0, defaultdict(float)
        loop.router.set_replicas(replicas)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(
                keepalive_timeout=60)) as pooled, aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True)) as fresh:
            loop.session = loop._route_session = pooled   # TRL's session, the routed one
            loop._fresh_session = fresh
            routed_loop._group.set(7)
            loop.router.start(7)
            home = loop.router.route(7)[0]
            answers = [await loop._post("/v1/completions", {"prompt": "x"}, timeout=10)
                       for _ in range(4)]   # every request after the first meets a closed one
        for s in servers:
            s.close()
        return loop, home, answers

    loop, home, answers = asyncio.run(scenario())
    assert answers == [{"choices": [{"text": "ok"}]}] * 4
    assert server.closed_unanswered == 2   # requests 2 and 4 met a closed connection
    failovers = {k: v for k, v in loop._counters.items() if "failover" in k or "retry" in k}
    assert not failovers, failovers
    assert loop._counters[f"routing/{home}/requests_total"] == 4
    assert loop.router.healthy(home)
