"""desired_pool_size: worked cases from the scaler's life, then properties over all inputs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncgrpo.sandbox.operator.sizing import desired_pool_size


def size(**kw):
    base = {"current": 0, "busy": 0, "waiting": 0, "starting": 0, "min_warm": 0, "max_size": 100,
            "hard_cap": 1000, "max_step": 10}
    return desired_pool_size(**{**base, **kw})


def test_cold_start_creates_the_warm_floor():
    assert size(current=0, min_warm=4) == 4


def test_a_burst_grows_by_at_most_one_step():
    assert size(current=8, busy=8, waiting=64, min_warm=2) == 18


def test_pods_already_starting_are_not_created_twice():
    # 5 waiting, 5 pods created last reconcile and not healthy yet: nothing more to create
    assert size(current=5, starting=5, waiting=5) == 5


def test_never_above_the_run_max_nor_the_hard_cap():
    assert size(current=0, waiting=500, max_size=50, max_step=1000) == 50
    assert size(current=0, waiting=500, max_size=50, hard_cap=20, max_step=1000) == 20


def test_shrinks_idle_pods_by_a_step_but_keeps_the_warm_floor():
    assert size(current=40, busy=2, min_warm=4, max_step=10) == 30
    assert size(current=8, busy=2, min_warm=4, max_step=10) == 6


def test_never_shrinks_below_busy_or_starting_even_past_a_lowered_cap():
    assert size(current=30, busy=25, starting=3, max_size=10, max_step=100) == 28


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="max_step"):
        size(max_step=-1)
    with pytest.raises(ValueError, match="busy"):
        size(busy=1.5)


counts = st.integers(min_value=0, max_value=500)


@settings(max_examples=400, deadline=None)
@given(current=counts, busy=counts, waiting=counts, starting=counts, min_warm=st.integers(0, 50),
       max_size=counts, hard_cap=counts, max_step=st.integers(0, 100))
def test_properties(current, busy, waiting, starting, min_warm, max_size, hard_cap, max_step):
    busy, starting = min(busy, current), min(starting, max(0, current - min(busy, current)))
    kw = {"current": current, "busy": busy, "waiting": waiting, "starting": starting, "min_warm": min_warm,
          "max_size": max_size, "hard_cap": hard_cap, "max_step": max_step}
    out = desired_pool_size(**kw)
    cap = min(max_size, hard_cap)
    target = min(max(busy + waiting + min_warm, min(min_warm, cap)), cap)
    assert abs(out - current) <= max_step  # bounded step
    if out > current:
        assert out <= cap and out <= target  # growth never passes the caps nor the need
    if out < current:
        assert out >= target and out >= busy + starting  # only idle pods go
    if max_step > 0 and current < target:
        assert out > current  # progress toward the need
    if max_step > 0 and current > max(target, busy + starting):
        assert out < current  # and back down when the need is gone
    # repeating the reconcile with nothing else changing converges and then stays put
    seen = current
    for _ in range(1000):
        nxt = desired_pool_size(**{**kw, "current": seen})
        if nxt == seen:
            break
        seen = nxt
    assert desired_pool_size(**{**kw, "current": seen}) == seen
    if max_step > 0:
        assert seen == max(target, min(current, busy + starting)) or seen == target
