"""What the operator and the bucket Job agree on about a run's bucket: the error a setup or
cleanup fails with (`BucketError`, a reason a user can act on), the run a folder belongs to
(`Owner`), where its folder is (`run_folder`) and which endpoints may be used at all
(`check_endpoint`, the metadata addresses the Jobs' NetworkPolicy excepts).

No S3 here (the operator imports this module and never talks to a tenant's bucket); the
Job's S3 work is `asyncgrpo.bucket.folder`, over `asyncgrpo.storage`.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass

from asyncgrpo.api import layout
from asyncgrpo.api.v1alpha1 import AdapterStoreSpec


class BucketError(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


#: Cloud metadata (and host agent) servers outside 169.254.0.0/16 and fe80::/10: AWS's IPv6
#: one (fd00:ec2::254), GCP's IPv6 one (fd20:ce::254), Oracle Cloud's IPv6 one
#: (fd00:c1::a9fe:a9fe), Alibaba's (100.100.100.200) and Azure's WireServer
#: (168.63.129.16). GCP, Azure, OpenStack, DigitalOcean, Hetzner and Tencent serve theirs
#: on 169.254/16 (Tencent: 169.254.0.23). The Jobs' NetworkPolicy excepts them all
#: (`metadata_excepts`).
METADATA_NETWORKS = (ipaddress.ip_network("fd00:ec2::254/128"),
                     ipaddress.ip_network("fd20:ce::254/128"),
                     ipaddress.ip_network("fd00:c1::a9fe:a9fe/128"),
                     ipaddress.ip_network("100.100.100.200/32"),
                     ipaddress.ip_network("168.63.129.16/32"))
_LINK_LOCAL = (ipaddress.ip_network("169.254.0.0/16"), ipaddress.ip_network("fe80::/10"))
#: NAT64 (64:ff9b::/96) carries an IPv4 address in its last 32 bits.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def metadata_excepts() -> tuple[list[str], list[str]]:
    """(IPv4, IPv6) CIDRs a NetworkPolicy must except to close every metadata address in
    every spelling `is_metadata_address` refuses: the IPv4 ones also as NAT64
    (64:ff9b::a.b.c.d) and IPv4-compatible (::a.b.c.d) IPv6. IPv4-mapped ::ffff:a.b.c.d is
    IPv4 on the wire (and the API server refuses it as an IPv6 except)."""
    v4 = [n for n in _LINK_LOCAL + METADATA_NETWORKS if n.version == 4]
    v6 = [str(n) for n in _LINK_LOCAL + METADATA_NETWORKS if n.version == 6]
    for n in v4:
        for base in (int(_NAT64.network_address), 0):
            v6.append(str(ipaddress.IPv6Network((base + int(n.network_address),
                                                 96 + n.prefixlen))))
    return [str(n) for n in v4], v6


def is_metadata_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Link-local, unspecified, multicast or a known metadata address, in any spelling an
    IPv6 address can carry an IPv4 one (mapped ::ffff:a.b.c.d, compatible ::a.b.c.d, NAT64
    64:ff9b::a.b.c.d)."""
    if ip.is_link_local or ip.is_unspecified or ip.is_multicast or \
            any(ip in n for n in METADATA_NETWORKS if n.version == ip.version):
        return True
    if ip.version == 6:
        inner = None
        if ip.ipv4_mapped is not None:
            inner = ip.ipv4_mapped
        elif ip in _NAT64 or int(ip) >> 32 == 0:   # NAT64 or IPv4-compatible (::a.b.c.d)
            inner = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if inner is not None and int(inner) > 1 and is_metadata_address(inner):
            return True
    return False


def check_endpoint(store: AdapterStoreSpec, allowlist: Iterable[str] = (),
                   resolve: bool = True) -> None:
    """Refuse an endpoint the cluster admin did not allow, before any request is sent.

    `allowlist` holds endpoint URLs ("https://minio.storage:9000") or host names; empty allows
    any host except link-local (169.254.0.0/16, fe80::/10, cloud metadata) and unspecified
    addresses, which are refused unless listed explicitly. With `resolve`, host names are
    resolved, so a name pointing at a metadata address is refused too: the Job does that from
    the run's own pod; the operator checks without resolving (no DNS query for a tenant's
    name from its network position), so only an address literal is refused there.
    """
    allow = [a.rstrip("/") for a in allowlist if a]
    endpoint = store.endpoint
    if not endpoint:
        if allow and not any(a in ("aws", "s3.amazonaws.com") for a in allow):
            raise BucketError("EndpointNotAllowed", "AWS S3 (no spec.adapterStore.endpoint) "
                              "is not in the operator's endpoint allowlist")
        return
    try:
        url = urllib.parse.urlsplit(endpoint)
        host, port = url.hostname, url.port
    except ValueError:
        host = port = None
    if url.scheme not in ("http", "https") or not host or url.username or url.password \
            or url.query or url.fragment:
        raise BucketError("InvalidEndpoint", "spec.adapterStore.endpoint must be "
                          "http(s)://host[:port][/path] with a host and no credentials")
    if allow:
        if endpoint.rstrip("/") in allow or host in allow:
            return
        raise BucketError("EndpointNotAllowed", "spec.adapterStore.endpoint is not in the "
                          "operator's endpoint allowlist (Helm value adapterStore."
                          "allowedEndpoints)")
    if not resolve:
        try:
            addrs = {str(ipaddress.ip_address(host))}
        except ValueError:   # a name: resolved (and checked) by the Job
            return
    else:
        try:
            addrs = {ai[4][0] for ai in socket.getaddrinfo(host, port or 443,
                                                           type=socket.SOCK_STREAM)}
        except (OSError, UnicodeError):
            raise BucketError("EndpointUnreachable", "spec.adapterStore.endpoint: its "
                              "host name does not resolve") from None
    for addr in addrs:
        if is_metadata_address(ipaddress.ip_address(addr.split("%")[0])):
            raise BucketError("EndpointNotAllowed", "spec.adapterStore.endpoint resolves to "
                              "a link-local or metadata address; the operator refuses it "
                              "unless the cluster admin lists it in adapterStore."
                              "allowedEndpoints")


@dataclass(frozen=True)
class Owner:
    """The run a folder belongs to, as written in its marker."""

    namespace: str
    name: str
    uid: str

    def marker(self) -> bytes:
        return json.dumps({"namespace": self.namespace, "name": self.name, "uid": self.uid,
                           "writer": "asyncgrpo bucket setup"}).encode()


def run_folder(store: AdapterStoreSpec, owner: Owner) -> str:
    try:
        return layout.run_folder(store.prefix, owner.namespace, owner.name)
    except ValueError as e:
        raise BucketError("InvalidPrefix", str(e)) from None
