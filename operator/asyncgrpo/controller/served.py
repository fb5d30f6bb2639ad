"""Which weights version each vLLM replica serves (full fine-tuning).

Each vLLM pod's weights puller knows the version its server has swapped in (`/status`,
`served_version`). Replicas catch up on their own, so the run's status shows the spread:
the oldest and the newest version served, over the replicas that answered. The pullers run in
the tenant's pods, so the reads go through `controller.tenant_io` (a deadline for the whole
exchange, a size cap, off kopf's threads) and the answer through `untrusted.puller`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from asyncgrpo.controller import vllm
from asyncgrpo.controller.observe import Child
from asyncgrpo.wire import PULLER_PORT

#: most bytes of a puller's /status the operator reads
MAX_STATUS_BYTES = 1 << 16


@dataclass(frozen=True)
class ServedWeights:
    oldest: int
    newest: int
    replicas: int       # replicas whose puller answered with a served version

    def status(self) -> dict[str, int]:
        return {"oldest": self.oldest, "newest": self.newest, "replicas": self.replicas}


def puller_url(ip: str, port: int = PULLER_PORT) -> str:
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}/status"


def summarize(versions: list[int | None]) -> ServedWeights | None:
    known = [v for v in versions if v is not None]
    if not known:
        return None
    return ServedWeights(oldest=min(known), newest=max(known), replicas=len(known))


def running_ips(children: list[Child]) -> list[str]:
    return [c.ip for c in children if c.kind == "Pod" and c.component == vllm.COMPONENT
            and c.ip and not c.deleting and c.phase == "Running"]


def served_weights(children: list[Child], read: Callable[[str], int | None]
                   ) -> ServedWeights | None:
    """Over the run's running vLLM pods; `read(ip)` is the version one serves (or None)."""
    ips = running_ips(children)
    if not ips:
        return None
    return summarize([read(ip) for ip in ips])
