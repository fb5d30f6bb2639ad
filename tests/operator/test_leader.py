"""Leader election on a Lease (`controller.leader`): the fence alone, then two electors
against the real API server, including a leader cut off from it (a real unreachable
address, not a mock) while the standby takes over."""

from __future__ import annotations

import threading
import time

import pytest

from asyncgrpo.controller.leader import ElectionConfig, Fence, LeaseElector, NotLeader
from tests.operator.helpers import wait_for


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_the_fence_refuses_writes_from_its_deadline_on():
    clock = Clock()
    fence = Fence(clock)
    with pytest.raises(NotLeader), fence.write():
        pass
    fence.open_until(10.0)
    with fence.write():
        pass
    clock.t = 10.0
    with pytest.raises(NotLeader), fence.write():
        pass


def test_an_expired_deadline_calls_the_hook_a_close_does_not():
    """A leader frozen past its deadline (the hook exits the process) is told apart from
    one that closed its own fence on a graceful stop."""
    clock, calls = Clock(), []
    fence = Fence(clock, on_expired=lambda: calls.append(clock.t))
    assert not fence.allows() and calls == []      # never opened: nothing expired
    fence.open_until(5.0)
    assert fence.allows()
    clock.t = 6.0
    with pytest.raises(NotLeader), fence.write():
        pass
    assert calls == [6.0]
    fence.close()
    assert not fence.allows() and calls == [6.0]


def test_closing_the_fence_waits_for_the_writes_in_flight():
    fence = Fence()
    fence.open_until(time.monotonic() + 60)
    entered, release = threading.Event(), threading.Event()

    def writer():
        with fence.write():
            entered.set()
            release.wait(10)
    t = threading.Thread(target=writer)
    t.start()
    entered.wait(10)
    assert fence.close(timeout=0.2) is False      # one write still in flight
    with pytest.raises(NotLeader), fence.write():   # but no new one gets through
        pass
    release.set()
    assert fence.close(timeout=10) is True
    t.join()


def test_election_timing_must_be_ordered_like_client_go():
    with pytest.raises(ValueError):
        ElectionConfig(lease_duration=5, renew_deadline=5, retry_period=1)
    with pytest.raises(ValueError):
        ElectionConfig(lease_duration=5, renew_deadline=2, retry_period=2)


CONFIG = {"lease_duration": 3, "renew_deadline": 1.5, "retry_period": 0.3}


@pytest.fixture
def lease_ns(api):
    return api.namespace("lease")


@pytest.mark.cluster
def test_one_leader_and_a_release_hands_over_at_once(kube_client, lease_ns):
    config = ElectionConfig(name="l", namespace=lease_ns, **CONFIG)
    a = LeaseElector(kube_client, config, identity="a")
    b = LeaseElector(kube_client, config, identity="b")
    stop = threading.Event()
    assert a.try_acquire_or_renew() and a.fence.is_open()
    assert not b.try_acquire_or_renew() and not b.fence.is_open()
    assert a.try_acquire_or_renew()               # renewing is acquiring again
    a.fence.close()
    a.release()
    assert b.acquire(stop) and b.fence.is_open()  # no wait for the lease duration
    assert not a.try_acquire_or_renew()


@pytest.mark.cluster
def test_a_leader_cut_off_stops_acting_before_the_standby_starts(kube_client, lease_ns):
    """The leader's renewals fail (its API address is dead); the standby takes over only
    after lease_duration, by then the leader's fence has been closed for a while; sampled
    every few ms, the two fences are never open together."""
    from kubernetes import client

    config = ElectionConfig(name="l", namespace=lease_ns, **CONFIG)
    a = LeaseElector(kube_client, config, identity="a")
    b = LeaseElector(kube_client, config, identity="b")
    stop = threading.Event()
    assert a.acquire(stop)
    cfg = client.Configuration()
    cfg.host = "http://127.0.0.1:1"               # nothing listens: every renewal fails
    results: dict[str, bool] = {}
    threads = [threading.Thread(target=lambda: results.update(a_lost=a.hold(stop))),
               threading.Thread(target=lambda: results.update(b=b.acquire(stop)))]
    try:
        for t in threads:
            t.start()
        time.sleep(1.0)                           # a renews, b sees it renewing
        assert "b" not in results
        a.api = client.ApiClient(cfg)             # from now on a's renewals fail
        both = 0
        deadline = time.monotonic() + 15
        while "b" not in results and time.monotonic() < deadline:
            both += a.fence.is_open() and b.fence.is_open()
            time.sleep(0.005)
        wait_for(lambda: "a_lost" in results, timeout=10, what="a gives up")
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert results == {"b": True, "a_lost": True}
    assert both == 0
    assert b.fence.is_open() and not a.fence.is_open()
