"""Reads of tenants' endpoints and names (controller.tenant_io) against real loopback servers:
a dripping HTTP server, an oversized answer, a DNS server that never answers. What is checked
is behaviour (who got an answer, what the problem says, how many exchanges ran at once), never
a duration."""

from __future__ import annotations

import time

import pytest

from asyncgrpo.controller import untrusted
from asyncgrpo.controller.tenant_io import Limits, TenantIO
from asyncgrpo.testing.waiting import wait_for
from tests.operator.helpers import JsonServer
from tests.operator.peers import Dns, Drip


@pytest.fixture
def drip():
    d = Drip(every=0.2)
    yield d
    d.close()


@pytest.fixture
def good():
    s = JsonServer()
    s.set_text("/metrics", "asyncgrpo_trainer_step 7\n")
    s.set_json("/demand", {"busy": 1, "idle": 2, "members": {"p-0": "busy"}})
    yield s
    s.close()


def settle(io: TenantIO, key, *args, **kw):
    """Read until a finished reading of a new exchange is there."""
    return wait_for(lambda: io.read(key, *args, **kw), what=f"a reading of {key}")


def test_a_dripping_endpoint_is_cut_at_the_deadline_and_reported(drip):
    io = TenantIO(Limits(deadline=1.0))
    try:
        # no wait: the caller gets what there is (nothing yet) while the exchange runs
        assert io.read(("ns", "r", "m"), "ns", drip.base + "/metrics", untrusted.metrics,
                       max_bytes=1 << 20) is None
        reading = settle(io, ("ns", "r", "m"), "ns", drip.base + "/metrics", untrusted.metrics,
                         max_bytes=1 << 20)
        assert reading.problem is not None and reading.problem[0] == "EndpointSlow"
        assert reading.value is None
    finally:
        io.close()


def test_a_slow_endpoint_is_not_waited_for_again(drip):
    io = TenantIO(Limits(deadline=1.0))
    try:
        key = ("ns", "r", "m")
        first = io.read(key, "ns", drip.base, untrusted.metrics, max_bytes=1 << 20, wait=30)
        assert first is not None and first.problem[0] == "EndpointSlow"
        # the next read starts a new exchange but, the endpoint being slow, returns at once
        # with the last reading: the new exchange is still running when it returns
        second = io.read(key, "ns", drip.base, untrusted.metrics, max_bytes=1 << 20, wait=30)
        assert second is first
        assert not io._slots[key].future.done()
    finally:
        io.close()


def test_an_answer_over_the_cap_is_an_error_not_a_truncated_document(good):
    io = TenantIO()
    try:
        good.set_text("/big", "asyncgrpo_trainer_step 1\n" + "#" * 5000)
        r = io.read(("n", "r", "big"), "n", good.base + "/big", untrusted.metrics,
                    max_bytes=4096, wait=10)
        assert r.problem[0] == "ResponseTooLarge"
        r = io.read(("n", "r", "ok"), "n", good.base + "/metrics", untrusted.metrics,
                    max_bytes=4096, wait=10)
        assert r.ok and r.value.step == 7
    finally:
        io.close()


@pytest.mark.parametrize("body, reason", [
    ("asyncgrpo_trainer_step +Inf\n", "BadResponse"),
    ("asyncgrpo_trainer_step -3\n", "BadResponse"),
    ("asyncgrpo_trainer_step NaN\n", "BadResponse"),
    ("asyncgrpo_trainer_step{ 1\n", "BadResponse"),
])
def test_hostile_metrics_are_a_problem_not_an_exception(good, body, reason):
    io = TenantIO()
    try:
        good.set_text("/m", body)
        r = io.read(("n", "r", "m"), "n", good.base + "/m", untrusted.metrics,
                    max_bytes=4096, wait=10)
        assert r.problem is not None and r.problem[0] == reason
    finally:
        io.close()


@pytest.mark.parametrize("doc", [[], "x", {"busy": "many"}, {"busy": -1},
                                 {"members": []}, {"members": {"p": 1}}, {"idle": True}])
def test_hostile_demand_is_refused_by_its_parser(doc):
    import json

    with pytest.raises(ValueError):
        untrusted.demand(json.dumps(doc).encode())


def test_one_namespace_of_dripping_endpoints_cannot_take_another_namespaces_turn(drip, good):
    io = TenantIO(Limits(deadline=30.0, per_namespace=2, total=8))
    try:
        for i in range(6):
            io.read(("noisy", f"r{i}", "m"), "noisy", drip.base, untrusted.metrics,
                    max_bytes=1 << 20)
        wait_for(lambda: drip.open == 2, what="two exchanges of the noisy namespace")
        r = io.read(("quiet", "r", "m"), "quiet", good.base + "/metrics", untrusted.metrics,
                    max_bytes=1 << 20, wait=10)
        assert r is not None and r.ok and r.value.step == 7
        # the noisy namespace never had more than its two slots, however many it asked for
        time.sleep(0.5)
        assert drip.accepted == 2
    finally:
        drip.close()
        io.close()


def test_names_resolve_off_the_callers_thread_with_a_deadline_and_a_cache():
    server = Dns({"good.test": "10.1.2.3"})
    io = TenantIO(Limits(dns_deadline=0.5, nameservers=[server.server]))
    try:
        hosts = ["good.test", "stall.test", "192.0.2.7"]
        found, missing = io.resolve("ns", hosts, ttl=60)
        # literals need no lookup; the names are being looked up, nothing waited for
        assert found == ["192.0.2.7"] and sorted(missing) == ["good.test", "stall.test"]
        wait_for(lambda: "10.1.2.3" in io.resolve("ns", hosts, ttl=60)[0], what="good.test")
        found, missing = io.resolve("ns", hosts, ttl=60)
        assert found == ["10.1.2.3", "192.0.2.7"] and missing == ["stall.test"]
        assert server.queries.get("stall.test.", 0) >= 1
        # cached: no new query for the good name within its ttl
        asked = server.queries["good.test."]
        io.resolve("ns", hosts, ttl=60)
        assert server.queries["good.test."] == asked
    finally:
        io.close()
        server.close()


def test_a_read_queued_behind_its_namespaces_slow_exchanges_is_not_waited_for(drip, good):
    """A run's healthy endpoint in a namespace whose slots its dripping neighbours hold: the
    read would queue for their whole deadline, so the caller (a kopf worker) does not wait
    for it; it gets what there is (nothing yet) and the reading arrives later. Before, each
    such reconcile held its worker for the whole wait (bench/noisy_tenants.py phase C: mean
    reconcile 68 ms -> 515 ms)."""
    io = TenantIO(Limits(deadline=2.0, per_namespace=2))
    try:
        for i in range(2):   # both of the namespace's slots dripped to
            io.read(("ns", f"drip{i}", "m"), "ns", drip.base, untrusted.metrics,
                    max_bytes=1 << 20)
        wait_for(lambda: drip.open == 2, what="two dripping exchanges")
        # wait=30 is longer than the drips' deadline: a waited read would come back with
        # the answer once a slot freed
        key = ("ns", "healthy", "m")
        assert io.read(key, "ns", good.base + "/metrics", untrusted.metrics,
                       max_bytes=1 << 20, wait=30) is None
        reading = settle(io, key, "ns", good.base + "/metrics", untrusted.metrics,
                         max_bytes=1 << 20)
        assert reading.ok and reading.value is not None
        # another namespace's read still waits for its answer (its slots are free)
        other = io.read(("other", "r", "m"), "other", good.base + "/metrics",
                        untrusted.metrics, max_bytes=1 << 20, wait=30)
        assert other is not None and other.ok
    finally:
        io.close()
