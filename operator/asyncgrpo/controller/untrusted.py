"""Typed, bounded parsers of what the operator reads from tenant-writable places.

The run's status, its children, the token Secret, the trainer's metrics, the gateway's demand
and the pullers' status are all written by code or people the operator does not trust. Every
value read from them goes through one of these functions, which either return a value of the
stated type within stated bounds or raise ValueError; callers turn that into a condition or
an event and go on. Nothing here decides anything a tenant's safety rests on.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from datetime import UTC, datetime
from typing import Any

from asyncgrpo import wire


class BadValue(ValueError):
    """A value read from a tenant-writable place that is not what it must be."""


#: the largest count (step, version, pods) taken from a tenant: beyond it the value is junk
MAX_COUNT = 2**53
#: most members a gateway may report
MAX_MEMBERS = 100_000


def count(value: Any, what: str, most: int = MAX_COUNT) -> int:
    """A non-negative integer (an int, or a float that is one, as Prometheus sends)."""
    if isinstance(value, bool):
        raise BadValue(f"{what} is not a count")
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            raise BadValue(f"{what} is not a count")
        value = int(value)
    if not isinstance(value, int) or not 0 <= value <= most:
        raise BadValue(f"{what} is not a count")
    return value


def real(value: Any, what: str) -> float:
    """A float; NaN allowed (means "not known"), infinities not."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadValue(f"{what} is not a number")
    value = float(value)
    if math.isinf(value):
        raise BadValue(f"{what} is infinite")
    return value


def json_doc(body: bytes) -> Any:
    try:
        return json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, RecursionError) as e:
        raise BadValue(f"not JSON text ({type(e).__name__})") from None


def short_text(value: Any, what: str, most: int = 253) -> str:
    if not isinstance(value, str) or len(value) > most:
        raise BadValue(f"{what} is not a short string")
    return value


def demand(body: bytes):
    """The gateway's `/v1/demand` answer as a `sandbox_scaling.Demand`."""
    from asyncgrpo.controller.sandbox_scaling import Demand

    doc = json_doc(body)
    if not isinstance(doc, dict):
        raise BadValue("the demand is not a JSON object")
    members = doc.get("members")
    members = {} if members is None else members
    if not isinstance(members, dict) or len(members) > MAX_MEMBERS:
        raise BadValue("demand members is not a bounded object")
    return Demand(**_demand_counts(doc, "demand"),
                  members={short_text(k, "a member name"): short_text(v, "a member state", 32)
                           for k, v in members.items()},
                  images=_image_demands(doc.get("images")))


#: most images a demand may list (spec.sandboxes.images.maxDistinct is at most 64, plus the
#: run's own image)
MAX_DEMAND_IMAGES = 65


def _demand_counts(doc: dict, what: str) -> dict[str, Any]:
    out: dict[str, Any] = {k: count(doc.get(k, 0), f"{what} {k}", MAX_MEMBERS)
                           for k in ("busy", "idle", "waiting", "starting")}
    out["consumption_per_second"] = min(real(doc.get("consumption_per_second", 0.0),
                                             f"{what} consumption_per_second"), MAX_MEMBERS)
    return out


def _image_demands(images: Any) -> dict:
    """The demand per image; a row image's reference must be one a pod can be made of and
    match its key, since the operator creates pods of it."""
    from asyncgrpo.controller.sandbox_scaling import ImageDemand

    if images is None:
        return {}
    if not isinstance(images, dict) or len(images) > MAX_DEMAND_IMAGES:
        raise BadValue("demand images is not a bounded object")
    out = {}
    for key, doc in images.items():
        key = short_text(key, "an image key", 32)
        if not isinstance(doc, dict):
            raise BadValue(f"demand images.{key} is not an object")
        ref = doc.get("image")
        if ref is not None and (wire.image_reference_problem(ref)
                                or wire.sandbox_image_key(ref) != key):
            raise BadValue(f"demand images.{key}.image is not the image of that key")
        idle = doc.get("idle_seconds")
        out[key] = ImageDemand(**_demand_counts(doc, f"demand images.{key}"), image=ref,
                               idle_seconds=None if idle is None else
                               real(idle, f"demand images.{key}.idle_seconds"))
    return out


def drain(body: bytes) -> bool:
    """The gateway's answer to a drain: may the pod be deleted?"""
    doc = json_doc(body)
    if not isinstance(doc, dict) or not isinstance(doc.get("safe_to_delete", False), bool):
        raise BadValue("the drain answer is not {safe_to_delete: bool}")
    return bool(doc.get("safe_to_delete"))


def puller(body: bytes) -> int | None:
    """The version a weights puller serves (`/status`), None when it serves none yet."""
    doc = json_doc(body)
    if not isinstance(doc, dict):
        raise BadValue("the puller status is not a JSON object")
    v = doc.get("served_version")
    return None if v is None else count(v, "served_version")


def metrics(body: bytes):
    """The trainer's Prometheus text as a `progress.Progress`."""
    from asyncgrpo.controller import progress

    try:
        return progress.parse(body.decode("utf-8", "replace"))
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 (the parser's own errors on hostile text)
        raise BadValue(f"not Prometheus text ({type(e).__name__})") from None


def timestamp(value: Any) -> datetime | None:
    """An RFC 3339 time as written in a status (`2026-01-02T03:04:05Z`, fractions and offsets
    allowed); None when it is not one."""
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        t = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def secret_text(data: Any, key: str, most: int = 4096) -> str | None:
    """`data[key]` of a Secret as printable UTF-8 text; None when absent; ValueError when it
    is not base64 of such text."""
    if not isinstance(data, dict) or data.get(key) in (None, ""):
        return None
    raw = data[key]
    if not isinstance(raw, str) or len(raw) > 2 * most:
        raise BadValue(f"{key} is not a short base64 string")
    try:
        text = base64.b64decode(raw, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        raise BadValue(f"{key} is not base64 of UTF-8 text") from None
    if not text or len(text) > most or not text.isprintable():
        raise BadValue(f"{key} is empty, too long or holds control characters")
    return text


#: phases a status may hold (asyncgrpo.controller.status)
PHASES = frozenset({"Pending", "Starting", "Running", "Suspended", "Succeeded", "Failed"})
_CONDITION_TEXT = ("type", "status", "reason", "message", "lastTransitionTime")


def _condition(c: Any) -> dict[str, Any] | None:
    if not isinstance(c, dict) or not isinstance(c.get("type"), str):
        return None
    out: dict[str, Any] = {k: c[k] for k in _CONDITION_TEXT
                           if isinstance(c.get(k), str) and len(c[k]) <= 32768}
    try:
        out["observedGeneration"] = count(c.get("observedGeneration", 0), "observedGeneration")
    except ValueError:
        pass
    return out


def status(doc: Any) -> dict[str, Any]:
    """The fields of a run's status the reconcile reads, typed; anything else (a tenant may
    patch the status subresource) is dropped. The status is a report, never an input to a
    safety decision: the checkpoint identity is read from the operator's own ConfigMap."""
    if not isinstance(doc, dict):
        return {}
    out: dict[str, Any] = {}
    if doc.get("phase") in PHASES:
        out["phase"] = doc["phase"]
    conds = doc.get("conditions")
    if isinstance(conds, list):
        out["conditions"] = [c for c in map(_condition, conds[:64]) if c is not None]
    for key in ("startTime", "completionTime"):
        if timestamp(doc.get(key)) is not None:
            out[key] = doc[key]
    sb = doc.get("sandboxes")
    if isinstance(sb, dict):
        try:
            out["sandboxes"] = {"spawnedTotal": count(sb.get("spawnedTotal", 0), "spawnedTotal")}
        except ValueError:
            pass
    return out
