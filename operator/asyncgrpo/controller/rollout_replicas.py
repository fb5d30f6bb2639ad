"""Per vLLM replica, in the run's status: requests routed, prefix-cache queries and hits, the
served version (`status.rolloutReplicas`; docs/routing.md).

Three sources, each read where it is true:

- **requests routed**: the trainer's router counts them (`asyncgrpo_trainer_rollout_routed_
  requests_total{replica}` on the metrics page the operator already reads, `progress.parse`);
- **prefix-cache queries and hits**: vLLM's own counters (`vllm:prefix_cache_queries_total`,
  `vllm:prefix_cache_hits_total`) on each Running vLLM pod's `/metrics`, the page Prometheus
  scrapes (the vLLM NetworkPolicy admits the operator as a scraper on that port);
- **served version** (full fine-tuning): each pod's weights puller, as for `servedWeights`;
  the router's own view (`..._replica_served_version{replica}`) when the puller said nothing.

A replica is `ip:port`, the router's key and Prometheus' `instance` of that pod's series, so
the three meet on it. The pages are the tenant's: read through `controller.tenant_io`, parsed
here typed and bounded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from asyncgrpo.controller import untrusted
from asyncgrpo.controller.observe import Child
from asyncgrpo.controller.served import running_ips
from asyncgrpo.wire import VLLM_PORT

#: most bytes of a vLLM pod's /metrics the operator reads (a few hundred KiB with histograms)
MAX_VLLM_METRICS_BYTES = 4 << 20
#: most replicas listed in the status (the router's labels come from a tenant's page)
MAX_REPLICAS = 64
_QUERIES = "vllm:prefix_cache_queries_total"
_HITS = "vllm:prefix_cache_hits_total"


@dataclass(frozen=True)
class PrefixCache:
    queries: int
    hits: int


def vllm_prefix_cache(body: bytes) -> PrefixCache | None:
    """vLLM's prefix-cache counters from its /metrics (summed over its engines), None when
    the page has neither."""
    sums = {_QUERIES: 0.0, _HITS: 0.0}
    found = False
    try:
        for family in text_string_to_metric_families(body.decode("utf-8", "replace")):
            for s in family.samples:
                if s.name in sums:
                    sums[s.name] += untrusted.real(s.value, s.name)
                    found = True
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 (the parser's own errors on hostile text)
        raise untrusted.BadValue(f"not Prometheus text ({type(e).__name__})") from None
    if not found:
        return None
    return PrefixCache(queries=untrusted.count(sums[_QUERIES], _QUERIES),
                       hits=untrusted.count(sums[_HITS], _HITS))


def replica_key(ip: str, port: int = VLLM_PORT) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def summarize(children: list[Child], routed: dict[str, dict[str, int]] | None,
              read_cache: Callable[[str], PrefixCache | None],
              versions: dict[str, int | None] | None = None) -> list[dict]:
    """One entry per Running vLLM pod (sorted by replica), then replicas the router still
    counts that no pod has now (gone: their requests stay in the record).

    `routed`: replica -> {"requests": n, "version": v} from the trainer's page; `read_cache(ip)`
    reads one pod's counters; `versions`: ip -> the version its puller serves."""
    routed = routed or {}
    versions = versions or {}
    running = set(running_ips(children))
    pods = {c.ip: c.name for c in children if c.kind == "Pod" and c.ip in running}
    out: dict[str, dict] = {}
    for ip in sorted(pods):
        key = replica_key(ip)
        entry: dict = {"replica": key, "pod": pods[ip]}
        r = routed.get(key, {})
        if "requests" in r:
            entry["requestsRouted"] = r["requests"]
        cache = read_cache(ip)
        if cache is not None:
            entry["prefixCacheQueries"] = cache.queries
            entry["prefixCacheHits"] = cache.hits
        version = versions.get(ip)
        if version is None:
            version = r.get("version")
        if version is not None:
            entry["servedVersion"] = version
        out[key] = entry
    for key in sorted(routed):
        if key not in out and len(out) < MAX_REPLICAS and "requests" in routed[key]:
            out[key] = {"replica": key, "requestsRouted": routed[key]["requests"]}
    return list(out.values())[:MAX_REPLICAS]
