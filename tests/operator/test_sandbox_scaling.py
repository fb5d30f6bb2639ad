"""Pool planning and create-expectations, with a stale cache played by hand."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.api.v1alpha1 import AsyncGRPORun, SandboxImagesSpec, SandboxSpec
from asyncgrpo.controller import sandbox_scaling as scaling
from asyncgrpo.controller.sandbox_scaling import (
    Demand,
    Expectations,
    ImageDemand,
    PodView,
    free_names,
    plan,
    plan_images,
    refill_warm,
)
from asyncgrpo.wire import sandbox_image_key
from tests.operator.helpers import example

SPEC = SandboxSpec(min_warm=2, max=20, hard_cap=25, idle_ttl_seconds=60)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def pods(*names, **kw):
    return [PodView(name=n, phase="Running", ready=True, **kw) for n in names]


def test_without_a_signal_the_pool_grows_to_min_warm_and_never_shrinks():
    assert plan(SPEC, [], set(), set(), None, 0).create == 2
    p = plan(SPEC, pods(*"abcdef"), set(), set(), None, excess_for=10_000)
    assert (p.create, p.delete) == (0, [])


def test_demand_sizes_the_pool_within_max_and_step():
    d = Demand(busy=2, waiting=30, members={"a": "busy", "b": "busy"})
    assert plan(SPEC, pods("a", "b"), set(), set(), d, 0).create == 18          # max 20
    assert plan(SPEC, pods("a", "b"), set(), set(), d, 0, max_step=5).create == 5


def test_a_stale_cache_never_over_creates():
    """Tick 1 creates 10; the cache still shows 2 on tick 2: expectations count the 10."""
    clock = Clock()
    exp = Expectations(ttl=300, clock=clock)
    d = Demand(busy=2, waiting=8, members={"a": "busy", "b": "busy"})
    cache = pods("a", "b")
    adds, dels = exp.observe("r", [p.name for p in cache])
    first = plan(SPEC, cache, adds, dels, d, 0)
    assert first.create == 10
    for i in range(first.create):
        exp.expect_create("r", f"new-{i}")
    clock.t = 1
    adds, dels = exp.observe("r", [p.name for p in cache])    # the watch has not caught up
    assert plan(SPEC, cache, adds, dels, d, 0).create == 0
    cache += [PodView(name=f"new-{i}") for i in range(4)]     # partly caught up
    adds, dels = exp.observe("r", [p.name for p in cache])
    assert len(adds) == 6
    assert plan(SPEC, cache, adds, dels, d, 0).create == 0


def test_expectations_expire_so_a_lost_event_cannot_freeze_the_pool():
    clock = Clock()
    exp = Expectations(ttl=300, clock=clock)
    exp.expect_create("r", "ghost")
    assert exp.observe("r", []) == ({"ghost"}, set())
    clock.t = 301
    assert exp.observe("r", []) == (set(), set())


def test_deletions_are_expected_until_the_cache_drops_them():
    exp = Expectations()
    exp.expect_delete("r", "a")
    assert exp.observe("r", ["a", "b"]) == (set(), {"a"})
    assert exp.observe("r", ["b"]) == (set(), set())


def test_scale_down_waits_for_idle_ttl_then_removes_idle_pods_only():
    live = pods("busy1", "busy2", "w1", "w2", "w3", "w4", "w5", "w6")
    d = Demand(busy=2, members={"busy1": "busy", "busy2": "busy", **{
        f"w{i}": "warm" for i in range(1, 7)}})
    assert plan(SPEC, live, set(), set(), d, excess_for=59).delete == []
    victims = plan(SPEC, live, set(), set(), d, excess_for=60).delete
    assert len(victims) == 4 and not {"busy1", "busy2"} & set(victims)


def test_failed_pods_are_kept_counted_and_go_first():
    live = pods("ok1", "ok2") + [PodView(name="bad", phase="Failed", failed=True)]
    d = Demand(busy=0, members={"ok1": "warm", "ok2": "warm"})
    p = plan(SPEC, live, set(), set(), d, excess_for=0)
    assert (p.create, p.replace) == (0, [])                # not replaced in a loop
    p = plan(SandboxSpec(min_warm=2, max=20, idle_ttl_seconds=0), live, set(), set(), d, 0)
    assert p.delete == ["bad"]                             # first to go on shrink


def test_gateway_unhealthy_pods_are_replaced():
    live = pods("a", "b")
    d = Demand(busy=0, members={"a": "warm", "b": "unhealthy"})
    p = plan(SPEC, live, set(), set(), d, 0)
    assert p.replace == ["b"] and p.create == 1


def test_retired_pods_are_deleted_and_replaced_in_the_same_reconcile():
    """FreshPerGroup: a pod that served its group is replaced at once, so the warm pool
    refills at the rate groups consume it (minWarm 2: two warm kept beside the busy one)."""
    live = pods("a", "b", "c", "d")
    d = Demand(busy=1, members={"a": "busy", "b": "retired", "c": "retired", "d": "warm"})
    p = plan(SandboxSpec(min_warm=2, max=10, hard_cap=10), live, set(), set(), d, 0)
    assert p.replace == ["b", "c"] and p.create == 1 and p.live == 2


def test_the_warm_pool_covers_what_is_consumed_while_replacements_start():
    """FreshPerGroup consumes a pod per lease: at 0.4 sandboxes/s, before any pod has
    started, the pool keeps 0.4 x (10 s resync + 10 s assumed start) = 8 more warm than
    minWarm, so a lease does not wait for a replacement."""
    live = pods("a", "b")
    steady = Demand(busy=0, members={"a": "warm", "b": "warm"})
    assert plan(SPEC, live, set(), set(), steady, 0).create == 0
    busy = Demand(busy=0, members={"a": "warm", "b": "warm"}, consumption_per_second=0.4)
    assert plan(SPEC, live, set(), set(), busy, 0).create == 8
    assert refill_warm(2, float("nan"), 20.0) == 2 and refill_warm(2, -1.0, 20.0) == 2


def test_the_refill_horizon_follows_how_fast_this_runs_pods_start():
    """On the test node under load pods took 7 to 18 s to start and a fixed 15 s horizon let
    the default pool (minWarm 4 at 0.5 leases/s) run dry (docs/benchmarks/sandbox-pool.md):
    the horizon is one resync plus the upper quartile of the run's own pod starts."""
    slow = [scaling.PodView(name=n, phase="Running", ready=True, start_seconds=t)
            for n, t in zip("abcd", (6.0, 9.0, 18.0, 30.0))]
    d = Demand(busy=0, members=dict.fromkeys("abcd", "warm"), consumption_per_second=0.5)
    spec = SandboxSpec(min_warm=4, max=64, hard_cap=64)
    # horizon 10 + 30 = 40 s: 4 + 0.5 x 40 = 24 wanted, 4 there
    assert plan(spec, slow, set(), set(), d, 0, resync_seconds=10.0).create == 20
    assert scaling.refill_horizon([], 10.0) == 10.0 + scaling.DEFAULT_POD_START_SECONDS
    assert scaling.refill_horizon([5000.0, float("inf")], 5.0) == 5.0 + scaling.MAX_POD_START_SECONDS


def test_a_pods_start_is_read_from_its_creation_and_ready_condition():
    from asyncgrpo.controller.observe import summarize

    def pod(created, ready_at, ready="True"):
        return {"kind": "Pod", "metadata": {"name": "p", "creationTimestamp": created},
                "status": {"phase": "Running", "conditions": [
                    {"type": "Ready", "status": ready, "lastTransitionTime": ready_at}]}}

    assert summarize(pod("2026-12-03T06:00:00Z", "2026-12-03T06:00:12Z")).start_seconds == 12.0
    assert summarize(pod("2026-12-03T06:00:00Z", "2026-12-03T06:00:12Z", "False")).start_seconds is None
    for bad in ("yesterday", "2026-12-03T05:00:00Z", 7):  # not a time, or before creation
        assert summarize(pod("2026-12-03T06:00:00Z", bad)).start_seconds is None


def test_a_hostile_consumption_rate_is_refused_as_data():
    from asyncgrpo.controller import untrusted

    assert untrusted.demand(b'{"consumption_per_second": 0.5}').consumption_per_second == 0.5
    for bad in (b'{"consumption_per_second": "x"}', b'{"consumption_per_second": 1e400}'):
        try:
            untrusted.demand(bad)
        except ValueError:
            continue
        raise AssertionError(bad)


def test_the_gateway_gets_the_lease_lifecycle():
    from asyncgrpo.controller import gateway
    run = AsyncGRPORun.model_validate(example("multi-turn-sandboxes.yaml"))
    env = {e["name"]: e.get("value") for e in gateway.build_deployment(run)["spec"]["template"]["spec"]
           ["containers"][0]["env"]}
    assert env["ASYNCGRPO_GATEWAY_LIFECYCLE"] == "fresh"  # the default
    run.spec.sandboxes.lifecycle = "Reuse"
    env = {e["name"]: e.get("value") for e in gateway.build_deployment(run)["spec"]["template"]["spec"]
           ["containers"][0]["env"]}
    assert env["ASYNCGRPO_GATEWAY_LIFECYCLE"] == "reuse"


def test_hard_cap_is_never_crossed():
    spec = SandboxSpec(min_warm=0, max=10, hard_cap=10)
    d = Demand(busy=10, waiting=50)
    p = plan(spec, pods(*[f"p{i}" for i in range(8)]), {"x1"}, set(), d, 0)
    assert p.create == 1


def test_suspend_deletes_every_pod():
    p = plan(SPEC, pods("a", "b"), set(), set(), Demand(busy=2), 0, suspended=True)
    assert p.replace == ["a", "b"] and p.create == 0


# ---------------------------------------------------------------- names by ordinal


def test_pod_names_take_the_lowest_free_ordinals():
    taken = {"r-sandbox-0", "r-sandbox-2", "r-sandbox-ab12"}
    assert free_names("r-sandbox", taken, 3) == ["r-sandbox-1", "r-sandbox-3", "r-sandbox-4"]
    assert free_names("r-sandbox", taken, 0) == []


class ApiServer:
    """Names only: a create of a name that exists is refused (AlreadyExists), as the API
    server does; `history` keeps each state, so a lagging cache is an older state."""

    def __init__(self):
        self.history: list[frozenset[str]] = [frozenset()]

    def create(self, name: str) -> bool:
        now = self.history[-1]
        self.history.append(now | {name})
        return name not in now


def tick(server: ApiServer, exp: Expectations, view: frozenset[str], desired: int) -> None:
    """One reconcile of one actor: plan from its view and expectations, create by ordinal."""
    adds, dels = exp.observe("r", view)
    p = plan(SandboxSpec(min_warm=desired, max=50, hard_cap=60), pods(*view), adds, dels,
             None, 0)
    for name in free_names("r-sandbox", set(view) | adds, p.create):
        exp.expect_create("r", name)
        server.create(name)


@given(st.lists(st.tuples(st.integers(1, 12), st.integers(0, 20), st.booleans()),
                min_size=1, max_size=30))
def test_failovers_with_lagging_caches_never_over_create(steps):
    """Any number of failovers: each new leader starts with no expectations and a cache that
    may lag any number of writes behind. Named by ordinal, the pool never holds more pods
    than the largest size ever asked (it would with random names: the lag is re-created)."""
    server = ApiServer()
    exp = Expectations()
    most = 0
    for desired, lag, failover in steps:
        if failover:
            exp = Expectations()           # a new leader: nothing carried over
        view = server.history[max(0, len(server.history) - 1 - lag)]
        most = max(most, desired)
        tick(server, exp, view, desired)
        assert len(server.history[-1]) <= most


def test_two_actors_with_the_same_view_collide_instead_of_adding():
    """The old leader's last tick and the new leader's first, from the same cache: the
    second one's creations are refused, the pool is exactly the desired size."""
    server = ApiServer()
    for name in ("r-sandbox-0", "r-sandbox-1", "r-sandbox-2"):
        server.create(name)
    view = server.history[-1]
    old, new = Expectations(), Expectations()
    tick(server, old, view, 5)
    tick(server, new, view, 5)
    assert sorted(server.history[-1]) == [f"r-sandbox-{i}" for i in range(5)]


# ---------------------------------------------------------------- a pool per row image

A = "registry.example/swe/task-a:1"
B = "registry.example/swe/task-b:1"


def _image_pods(image, *names, **kw):
    return [PodView(name=n, phase="Running", ready=True, image_key=sandbox_image_key(image),
                    image=image, **kw) for n in names]


def _by_key(plans):
    return {ip.key: ip for ip in plans}


def test_one_image_plans_as_the_single_pool_did():
    """A gateway without per-image demand, and a run without row images, plan exactly as
    `plan` did: the run's own image is the whole pool."""
    d = Demand(busy=2, waiting=30, members={"a": "busy", "b": "busy"})
    (only,) = plan_images(SPEC, pods("a", "b"), {}, set(), d, {})
    assert only.key == "default" and only.image is None
    assert only.plan == plan(SPEC, pods("a", "b"), set(), set(), d, 0)


def test_a_row_image_with_waiting_leases_gets_pods_of_its_image_cold():
    d = Demand(members={"d0": "warm", "d1": "warm"}, idle=2, waiting=3, images={
        "default": ImageDemand(idle=2, idle_seconds=0.0),
        sandbox_image_key(A): ImageDemand(waiting=3, image=A, idle_seconds=0.0)})
    plans = _by_key(plan_images(SPEC, pods("d0", "d1"), {}, set(), d, {}))
    assert plans[sandbox_image_key(A)].image == A and plans[sandbox_image_key(A)].plan.create == 3
    assert plans["default"].plan.create == 0   # its minWarm 2 is there
    # minWarmPerImage keeps warm pods of a row image in use, beyond what waits
    spec = SPEC.model_copy(update={"images": SandboxImagesSpec(min_warm_per_image=1)})
    assert _by_key(plan_images(spec, pods("d0", "d1"), {}, set(), d, {}))[
        sandbox_image_key(A)].plan.create == 4


def test_all_images_together_stay_within_max_the_most_waiting_first():
    spec = SandboxSpec(min_warm=1, max=6, hard_cap=25, idle_ttl_seconds=60)
    d = Demand(members={"d0": "busy", "d1": "busy", "a0": "busy"}, images={
        "default": ImageDemand(busy=2, waiting=1, idle_seconds=0.0),
        sandbox_image_key(A): ImageDemand(busy=1, waiting=2, image=A, idle_seconds=0.0),
        sandbox_image_key(B): ImageDemand(waiting=5, image=B, idle_seconds=0.0)})
    plans = plan_images(spec, pods("d0", "d1") + _image_pods(A, "a0"), {}, set(), d, {})
    assert plans[0].image == B   # the room went to the most waiting first
    creates = {ip.image: ip.plan.create for ip in plans}
    assert sum(creates.values()) == 3 and creates == {B: 3, None: 0, A: 0}   # 6 - 3 live
    # the pending creations of one image count toward the whole run's max
    again = plan_images(spec, pods("d0", "d1") + _image_pods(A, "a0"),
                        {"p0": sandbox_image_key(B), "p1": sandbox_image_key(B),
                         "p2": sandbox_image_key(B)}, set(), d, {})
    assert sum(ip.plan.create for ip in again) == 0


def test_a_row_image_out_of_use_loses_its_pods_after_idle_ttl():
    d = Demand(members={"a0": "warm", "a1": "warm"}, images={
        sandbox_image_key(A): ImageDemand(idle=2, image=A, idle_seconds=500.0)})
    spec = SPEC.model_copy(update={"images": SandboxImagesSpec(min_warm_per_image=1)})
    key = sandbox_image_key(A)
    soon = _by_key(plan_images(spec, _image_pods(A, "a0", "a1"), {}, set(), d, {key: 10.0}))[key]
    assert soon.plan.delete == [] and soon.plan.target == 0   # not used for idleTtl: no warm kept
    later = _by_key(plan_images(spec, _image_pods(A, "a0", "a1"), {}, set(), d, {key: 61.0}))[key]
    assert sorted(later.plan.delete) == ["a0", "a1"]
    # used lately: minWarmPerImage is kept
    recent = Demand(members=d.members, images={key: ImageDemand(idle=2, image=A, idle_seconds=5.0)})
    kept = _by_key(plan_images(spec, _image_pods(A, "a0", "a1"), {}, set(), recent, {key: 61.0}))[key]
    assert kept.plan.delete == ["a0"]


def test_a_row_images_demand_that_is_not_its_keys_image_is_refused_as_data():
    from asyncgrpo.controller import untrusted

    good = untrusted.demand(json.dumps({"images": {sandbox_image_key(A): {
        "image": A, "waiting": 2, "idle_seconds": 1.5}}}).encode())
    assert good.images[sandbox_image_key(A)] == ImageDemand(waiting=2, image=A, idle_seconds=1.5)
    for bad in ({sandbox_image_key(A): {"image": B}},            # another image under A's key
                {sandbox_image_key("a b"): {"image": "a b"}},    # not a reference
                {"default": {"waiting": "x"}},
                {f"i{n}": {} for n in range(100)}):              # unbounded
        try:
            untrusted.demand(json.dumps({"images": bad}).encode())
        except ValueError:
            continue
        raise AssertionError(bad)


def test_a_row_images_pod_runs_its_image_with_the_server_from_an_init_container():
    from asyncgrpo import wire
    from asyncgrpo.controller import sandboxes
    from asyncgrpo.controller.observe import summarize

    run = AsyncGRPORun.model_validate(example("multi-turn-sandboxes.yaml"))
    own, row = sandboxes.build_pod(run, "0"), sandboxes.build_pod(run, "1", image=A)
    assert own["metadata"]["labels"][wire.SANDBOX_IMAGE_LABEL] == "default"
    assert "initContainers" not in own["spec"]
    (init,) = row["spec"]["initContainers"]
    (main,) = row["spec"]["containers"]
    assert init["image"] == run.spec.sandboxes.image
    assert init["command"] == ["asyncgrpo", "sandbox", "bundle", wire.SANDBOX_SERVER_BUNDLE_DIR]
    assert main["image"] == A and main["command"][:3] == ["python3", "-I", "-S"]
    assert {"name": "server", "mountPath": wire.SANDBOX_SERVER_BUNDLE_DIR, "readOnly": True} \
        in main["volumeMounts"]
    assert init["securityContext"] == main["securityContext"]   # non-root, no escalation
    # one template: a row image's pod is not outdated
    assert row["metadata"]["annotations"]["asyncgrpo.dev/spec-hash"] == sandboxes.current_hash(run)
    seen = summarize(row)
    assert (seen.image_key, seen.image) == (sandbox_image_key(A), A)
    # an annotation naming another image than the label's key is not believed
    row["metadata"]["annotations"]["asyncgrpo.dev/sandbox-image-ref"] = B
    assert summarize(row).image is None
