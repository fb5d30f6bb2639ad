"""The trainer's plumbing: one value, no default that repeats the model's (issue 27)."""

from __future__ import annotations

import dataclasses

import pytest

from asyncgrpo.trainer.plumbing import TrainerPlumbing

FROM_THE_SPEC = {"samples_per_plan", "retention", "max_staleness", "anchor_interval"}


def test_fields_that_come_from_the_spec_have_no_default_of_their_own():
    missing = dataclasses.MISSING
    no_default = {f.name for f in dataclasses.fields(TrainerPlumbing)
                  if f.default is missing and f.default_factory is missing}
    assert FROM_THE_SPEC <= no_default


def test_a_served_prefix_outside_trls_scheme_is_refused():
    base = {"store": None, "samples_per_plan": 8, "retention": 8, "max_staleness": 1,
                "anchor_interval": 10, "retry_attempts": 1, "retry_backoff_s": 0.1}
    assert TrainerPlumbing(served_prefix="policy-v", **base).served_prefix == "policy-v"
    with pytest.raises(ValueError, match="must end in '-v'"):
        TrainerPlumbing(served_prefix="policy", **base)
