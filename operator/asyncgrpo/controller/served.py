"""Which weights version each vLLM replica serves (full fine-tuning).

Each vLLM pod's weights puller knows the version its server has swapped in (`/status`,
`served_version`). Replicas catch up on their own, so the run's status shows the spread:
the oldest and the newest version served, over the replicas that answered. Read from each
pod's IP with a short timeout, all replicas at once, so a silent pod costs the reconcile
at most one timeout.
"""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from asyncgrpo.controller.observe import Child
from asyncgrpo.wire import PULLER_PORT

#: at most this many replicas are read at once (the rest wait their turn)
MAX_PARALLEL = 8


@dataclass(frozen=True)
class ServedWeights:
    oldest: int
    newest: int
    replicas: int       # replicas whose puller answered with a served version

    def status(self) -> dict[str, int]:
        return {"oldest": self.oldest, "newest": self.newest, "replicas": self.replicas}


def read_puller(ip: str, port: int = PULLER_PORT, timeout: float = 1.0) -> int | None:
    """The version one replica serves; None if its puller does not answer or serves none."""
    host = f"[{ip}]" if ":" in ip else ip
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/status", timeout=timeout) as resp:
            doc = json.loads(resp.read(1 << 20))
    except (OSError, ValueError):
        return None
    version = doc.get("served_version") if isinstance(doc, dict) else None
    return version if isinstance(version, int) and not isinstance(version, bool) else None


def summarize(versions: list[int | None]) -> ServedWeights | None:
    known = [v for v in versions if v is not None]
    if not known:
        return None
    return ServedWeights(oldest=min(known), newest=max(known), replicas=len(known))


def served_weights(children: list[Child], read=read_puller) -> ServedWeights | None:
    """Over the run's running vLLM pods."""
    ips = [c.ip for c in children if c.kind == "Pod" and c.component == "vllm"
           and c.ip and not c.deleting and c.phase == "Running"]
    if not ips:
        return None
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(ips))) as pool:
        return summarize(list(pool.map(read, ips)))
