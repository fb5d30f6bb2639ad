"""Keeps the test node's DNS (dnsmasq) in sync with the cluster's Services and Endpoints.

dnsmasq answers from a hosts file and re-reads it on SIGHUP; this process rewrites that file
whenever the set of names changes. The names are those cluster DNS serves on any cluster:

- `<svc>.<ns>.svc.<domain>` -> the ClusterIP, or, for a headless Service, every endpoint
  address (not-ready ones too when the Service publishes them);
- `<hostname>.<svc>.<ns>.svc.<domain>` -> an endpoint that has a hostname (StatefulSet pods
  under their governing Service), which is how torchrun's rendezvous finds trainer node 0.

Pods' resolv.conf search path (`<ns>.svc.<domain> svc.<domain> <domain>`) makes the short
forms (`<svc>`, `<svc>.<ns>`) work. Polls every half second: a few Services, a test cluster.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path


def records(services: list, endpoints: list, domain: str) -> list[tuple[str, str]]:
    """(ip, name) pairs for the hosts file; pure, so it is tested without a cluster."""
    eps = {(e.metadata.namespace, e.metadata.name): e for e in endpoints}
    out: list[tuple[str, str]] = []
    for svc in services:
        ns, name = svc.metadata.namespace, svc.metadata.name
        fqdn = f"{name}.{ns}.svc.{domain}"
        cluster_ip = svc.spec.cluster_ip
        if cluster_ip and cluster_ip != "None":
            out.append((cluster_ip, fqdn))
            continue
        ep = eps.get((ns, name))
        for subset in (ep.subsets or []) if ep is not None else []:
            addresses = list(subset.addresses or [])
            if svc.spec.publish_not_ready_addresses:
                addresses += list(subset.not_ready_addresses or [])
            for addr in addresses:
                out.append((addr.ip, fqdn))
                if addr.hostname:
                    out.append((addr.ip, f"{addr.hostname}.{fqdn}"))
    return sorted(set(out))


def render(pairs: list[tuple[str, str]]) -> str:
    return "".join(f"{ip} {name}\n" for ip, name in pairs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m asyncgrpo.testing.cluster_dns")
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--hosts", type=Path, required=True)
    parser.add_argument("--dnsmasq-pid", type=int, required=True)
    parser.add_argument("--domain", default="cluster.local")
    args = parser.parse_args(argv)

    import urllib3
    from kubernetes import client, config

    urllib3.disable_warnings()
    api = client.CoreV1Api(config.new_client_from_config(config_file=args.kubeconfig))
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    last = None
    while not stop:
        try:
            text = render(records(api.list_service_for_all_namespaces().items,
                                  api.list_endpoints_for_all_namespaces().items, args.domain))
        except Exception as e:  # noqa: BLE001 (the API server restarting: keep the last answer)
            print(f"cluster-dns: list failed: {e}", file=sys.stderr, flush=True)
            time.sleep(1)
            continue
        if text != last:
            tmp = args.hosts.with_suffix(".tmp")
            tmp.write_text(text)
            os.replace(tmp, args.hosts)
            os.kill(args.dnsmasq_pid, signal.SIGHUP)
            last = text
        time.sleep(0.5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
