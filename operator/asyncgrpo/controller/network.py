"""NetworkPolicies: sandboxes talk only to the gateway; the run's servers only to each other.

- sandbox pods: ingress only from the run's gateway (leases: reset, health) and the run's
  trainer (the direct data path: a lease gives the trainer the sandbox's address and a
  secret only that sandbox accepts), on the sandbox port only; egress denied except
  the spec's allow-list (CIDRs, and host names resolved by the operator to /32 or /128
  blocks, with DNS to kube-dns opened only when host names are listed);
- trainer, vLLM and gateway: ingress only from the run's own pods and from the metrics
  scrapers (Prometheus, the operator), given as NetworkPolicy peers in the operator settings.
- the bucket Jobs' pods (setup, cleanup): no ingress; egress to DNS and to the S3
  endpoint's port on any address but link-local ones (cloud metadata), or open when the run
  has no credentialsSecret (its pods' cloud identity may need the metadata server or STS).
  The rule is additive: it lets the Jobs work in a namespace whose own policies deny egress.
- the preflight Job's pod: no ingress (it imports the tenant's reward and environment modules
  and serves nothing); egress open, as the trainer's (model, tokenizer and data sources).
Egress of the trainer and vLLM stays open: they must reach the bucket and model storage,
which may be anywhere.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from asyncgrpo.api.v1alpha1 import AsyncGRPORun
from asyncgrpo.bucket import policy as bucket
from asyncgrpo.controller import bucketjob, gateway, preflightjob, sandboxes, trainer, vllm
from asyncgrpo.controller.common import COMPONENT_LABEL, metadata, name, selector, stamp
from asyncgrpo.wire import GATEWAY_PORT, PULLER_PORT, SANDBOX_PORT, VLLM_PORT

#: The operator's pods (the chart's selector labels), in any namespace: it reads rank 0's
#: progress, so it is a scraper whatever else is configured.
OPERATOR_SCRAPER: dict[str, Any] = {"namespaceSelector": {}, "podSelector": {"matchLabels": {
    "app.kubernetes.io/name": "asyncgrpo-operator"}}}
#: Default scrapers: pods named prometheus or asyncgrpo-operator, in any namespace (Helm
#: value metrics.scrapers narrows the first to one namespace or other labels).
DEFAULT_SCRAPERS: list[dict[str, Any]] = [
    {"namespaceSelector": {}, "podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "prometheus"}}},
    OPERATOR_SCRAPER,
]

KUBE_DNS_PEER = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}


def _peer(run: AsyncGRPORun, component: str) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": selector(run, component)}}


def _policy(run: AsyncGRPORun, component: str, spec: dict[str, Any]) -> dict[str, Any]:
    return stamp({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(run, component, name(run, component)),
        "spec": {"podSelector": {"matchLabels": selector(run, component)}, **spec},
    })


def host_blocks(addresses: list[str]) -> list[str]:
    """Resolved addresses as single-host CIDRs, sorted so the policy hash is stable."""
    out = set()
    for a in addresses:
        ip = ipaddress.ip_address(a)
        out.add(f"{ip}/{32 if ip.version == 4 else 128}")
    return sorted(out)


def build_sandbox_policy(run: AsyncGRPORun, resolved_hosts: list[str]) -> dict[str, Any]:
    net = run.spec.sandboxes.network  # type: ignore[union-attr]
    cidrs = sorted(set(net.allowed_egress_cidrs) | set(host_blocks(resolved_hosts)))
    egress: list[dict[str, Any]] = []
    if cidrs:
        egress.append({"to": [{"ipBlock": {"cidr": c}} for c in cidrs]})
    if net.allowed_egress_hosts:
        egress.append({"to": [KUBE_DNS_PEER], "ports": [{"protocol": "UDP", "port": 53},
                                                        {"protocol": "TCP", "port": 53}]})
    return _policy(run, sandboxes.COMPONENT, {
        "policyTypes": ["Ingress", "Egress"],
        "ingress": [{"from": [_peer(run, gateway.COMPONENT), _peer(run, trainer.COMPONENT)],
                     "ports": [{"protocol": "TCP", "port": SANDBOX_PORT}]}],
        "egress": egress,
    })


def _ingress_only(run: AsyncGRPORun, component: str, ports: list[int], peers: list[str],
                  scrapers: list[dict[str, Any]], metrics_port: int,
                  extra: list[dict[str, Any]] = ()) -> dict[str, Any]:
    tcp = [{"protocol": "TCP", "port": p} for p in ports]
    rules = [{"from": [_peer(run, c) for c in peers], "ports": tcp}]
    if scrapers:
        rules.append({"from": scrapers, "ports": [{"protocol": "TCP", "port": metrics_port}]})
    return _policy(run, component, {"policyTypes": ["Ingress"], "ingress": rules + list(extra)})


#: The component label of the NetworkPolicy of the bucket Jobs.
BUCKET_COMPONENT = "bucket"


def build_bucket_policy(run: AsyncGRPORun) -> dict[str, Any]:
    store = run.spec.adapter_store
    jobs = {k: v for k, v in selector(run, bucketjob.SETUP).items() if k != COMPONENT_LABEL}
    if store.credentials_secret is None:
        egress: list[dict[str, Any]] = [{}]
    else:
        dns = {"to": [KUBE_DNS_PEER], "ports": [{"protocol": "UDP", "port": 53},
                                                {"protocol": "TCP", "port": 53}]}
        # metadata servers in every spelling (bucket.metadata_excepts): link-local, the
        # clouds' other addresses, and their NAT64 and IPv4-compatible IPv6 forms
        v4, v6 = bucket.metadata_excepts()
        anywhere = [{"ipBlock": {"cidr": "0.0.0.0/0", "except": v4}},
                    {"ipBlock": {"cidr": "::/0", "except": v6}}]
        egress = [dns, {"to": anywhere, "ports": [
            {"protocol": "TCP", "port": p} for p in bucketjob.endpoint_ports(store.endpoint)]}]
    return stamp({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(run, BUCKET_COMPONENT),
        "spec": {"podSelector": {"matchLabels": jobs, "matchExpressions": [
                     {"key": COMPONENT_LABEL, "operator": "In",
                      "values": [bucketjob.SETUP, bucketjob.CLEANUP]}]},
                 "policyTypes": ["Ingress", "Egress"], "ingress": [], "egress": egress},
    })


def build_policies(run: AsyncGRPORun, resolved_hosts: list[str] | None = None,
                   scrapers: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    scrapers = DEFAULT_SCRAPERS if scrapers is None else scrapers
    metrics = run.spec.trainer.metrics_port
    # the trainer reaches itself (rendezvous, NCCL/gloo on any port) and is scraped
    trainer_rules = {"policyTypes": ["Ingress"], "ingress": [
        {"from": [_peer(run, trainer.COMPONENT)]},
        {"from": [_peer(run, vllm.COMPONENT)],
         "ports": [{"protocol": "TCP", "port": metrics}]},
        *([{"from": scrapers, "ports": [{"protocol": "TCP", "port": metrics}]}]
          if scrapers else []),
    ]}
    # full fine-tuning: the operator reads each replica's weights puller (served version), and
    # so does the trainer's router (version-aware routing) when routing is affine
    readers = [OPERATOR_SCRAPER] + ([_peer(run, trainer.COMPONENT)]
                                    if run.spec.rollout.routing == "affine" else [])
    pullers = [{"from": readers, "ports": [{"protocol": "TCP", "port": PULLER_PORT}]}
               ] if run.spec.model.finetuning == "full" else []
    out = [
        _policy(run, trainer.COMPONENT, trainer_rules),
        _ingress_only(run, vllm.COMPONENT, [VLLM_PORT], [trainer.COMPONENT], scrapers,
                      VLLM_PORT, pullers),
        build_bucket_policy(run),
        _policy(run, preflightjob.COMPONENT, {"policyTypes": ["Ingress"], "ingress": []}),
    ]
    if run.spec.sandboxes is not None:
        out.append(_ingress_only(run, gateway.COMPONENT, [GATEWAY_PORT], [trainer.COMPONENT],
                                 scrapers, GATEWAY_PORT))
        out.append(build_sandbox_policy(run, resolved_hosts or []))
    return out
