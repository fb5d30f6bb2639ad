"""Where a run's objects live in its bucket: the one function every reader and writer calls.

    <prefix>/<namespace>/<name>/
        .asyncgrpo-owner.json      ownership marker: the run's uid, written at bucket setup
        adapters/v{N}/...          the policy versions vLLM resolves
        checkpoints/step-.../...   trainer checkpoints
        (further sub-folders, e.g. weights/, are added under the same folder)

Why the namespace is in the path: two runs with the same name in two namespaces (two tenants)
must never share objects, and a run's cleanup must never reach another tenant's. Why a
marker: the prefix is user-chosen, so a folder can still sit above or below another run's
folder (prefix `p/team-b` + namespace `team-a` nests under `p/team-b/team-a/`); bucket setup
refuses a folder with another run's marker above or below it, and cleanup deletes only when
the marker holds the run's own uid and skips anything under another marker.

The trainer (adapters, checkpoints), vLLM's resolver, the local backend and the operator's
setup and cleanup all call `run_folder`; nothing else joins these segments.
"""

from __future__ import annotations

import re

#: Namespace of a run that has none (local backend, `asyncgrpo validate`): kubectl's default.
DEFAULT_NAMESPACE = "default"

#: Ownership marker, directly inside the run folder. Starts with '.', which no prefix
#: segment may, so a marker can never be mistaken for a folder.
OWNER_MARKER = ".asyncgrpo-owner.json"

#: One prefix segment: letters, digits, '.', '_', '-', never starting with '.' (so no '.'
#: or '..' segment and no hidden name that could shadow a marker).
PREFIX_SEGMENT = r"[A-Za-z0-9_-][A-Za-z0-9._-]*"
#: A whole prefix: segments joined by single '/', no leading or trailing '/', not empty.
PREFIX_PATTERN = rf"^{PREFIX_SEGMENT}(/{PREFIX_SEGMENT})*$"
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def check_prefix(prefix: str) -> None:
    """Raise ValueError unless `prefix` is a safe key prefix (see PREFIX_PATTERN)."""
    if not re.match(PREFIX_PATTERN, prefix or ""):
        raise ValueError(f"bucket prefix {prefix!r} must be segments of letters, digits, "
                         "'.', '_' or '-' joined by single '/', with no empty, '.' or '..' "
                         "segment and no leading or trailing '/'")


def run_folder(prefix: str, namespace: str | None, name: str) -> str:
    """The run's folder, `<prefix>/<namespace>/<name>/` (always ending in '/').

    Raises ValueError for anything that could escape or alias the layout: a bad prefix, a
    namespace or name that is not a DNS label.
    """
    check_prefix(prefix)
    namespace = namespace or DEFAULT_NAMESPACE
    for what, value in (("namespace", namespace), ("name", name)):
        if not _NAME.match(value or ""):
            raise ValueError(f"run {what} {value!r} is not a DNS label")
    return f"{prefix}/{namespace}/{name}/"


def ancestors(folder: str) -> list[str]:
    """Every proper ancestor folder of `folder` ('a/b/c/' -> ['a/', 'a/b/']), outermost first."""
    parts = folder.strip("/").split("/")
    return ["/".join(parts[:i]) + "/" for i in range(1, len(parts))]
