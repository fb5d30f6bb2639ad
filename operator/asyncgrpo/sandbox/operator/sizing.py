"""How many sandbox pods a run's pool should have: one pure function for the operator.

The lessons it encodes: never over-create (pods already being created are counted, so a
demand seen on two reconciles in a row does not create twice), move by a bounded step per
reconcile (a burst of waiting leases cannot create hundreds of pods at once, and a lull
cannot delete the warm pool), keep a few warm sandboxes ready (leases are served warm, not
cold), never exceed the run's max nor the operator's hard cap, and never shrink below what
is busy or still starting (scaling down only ever removes idle pods, chosen by the operator
from the gateway's demand `members` and drained through the gateway first).
"""

from __future__ import annotations


def desired_pool_size(
    *,
    current: int,
    busy: int,
    waiting: int,
    starting: int,
    min_warm: int,
    max_size: int,
    hard_cap: int,
    max_step: int,
) -> int:
    """Return the number of sandbox pods the pool should have after this reconcile.

    Signature (all keyword-only ints, all >= 0; negative inputs raise ValueError):

    - current: pool pods that exist now and are not being deleted nor reported unhealthy
      (unhealthy pods are replaced: delete them and do not count them). Includes `starting`.
    - busy, waiting, starting: from the gateway's `GET /v1/demand` (same keys): sandboxes
      leased, lease requests waiting for a sandbox, and pods created but not yet healthy
      (in-flight creations). Idle sandboxes need no argument: they are part of `current`.
    - min_warm: idle sandboxes to keep ready beyond what is busy and asked for.
    - max_size: the run's maximum pool size (spec); hard_cap: the operator-wide cap.
    - max_step: the most pods added or removed in one reconcile (>= 1 to move at all).

    Result: target = busy + waiting + min_warm, clamped to [min(min_warm, cap), cap] with
    cap = min(max_size, hard_cap); then moved from `current` by at most `max_step`; never
    above cap when growing, never below busy + starting when shrinking, so the result can
    exceed cap only by keeping pods that are busy or starting. The operator creates
    `result - current` pods when positive, and deletes `current - result` idle pods when
    negative.
    """
    values = {"current": current, "busy": busy, "waiting": waiting, "starting": starting,
              "min_warm": min_warm, "max_size": max_size, "hard_cap": hard_cap, "max_step": max_step}
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    cap = min(max_size, hard_cap)
    target = min(max(busy + waiting + min_warm, min(min_warm, cap)), cap)
    if target > current:
        return min(target, current + max_step)
    if target < current:
        keep = min(current, busy + starting)  # never remove what is in use or about to serve
        return max(target, current - max_step, keep)
    return current
