"""Cloud metadata servers in every spelling are refused by the operator's endpoint check and
excepted from the bucket Jobs' NetworkPolicy (issue 28): AWS's IPv6 address, NAT64 and
IPv4-compatible forms of 169.254.169.254, Alibaba's 100.100.100.200."""

from __future__ import annotations

import pytest

from asyncgrpo.api.v1alpha1 import AdapterStoreSpec
from asyncgrpo.bucket import policy as bucket
from asyncgrpo.controller import network
from tests.operator.test_builders import run_of

METADATA = ["http://[fd00:ec2::254]", "http://[64:ff9b::a9fe:a9fe]",
            "http://[::169.254.169.254]", "http://100.100.100.200",
            "http://[::ffff:169.254.169.254]", "http://169.254.169.254:80",
            # GCP's and Oracle Cloud's IPv6 metadata, Azure's WireServer, Tencent's, and
            # the NAT64 / IPv4-compatible forms of Alibaba's
            "http://[fd20:ce::254]", "http://[fd00:c1::a9fe:a9fe]", "http://168.63.129.16",
            "http://169.254.0.23", "http://[64:ff9b::6464:64c8]", "http://[::100.100.100.200]",
            "http://[64:ff9b::168.63.129.16]"]


@pytest.mark.parametrize("endpoint", METADATA)
def test_metadata_address_literals_are_refused_without_a_dns_query(endpoint):
    store = AdapterStoreSpec(endpoint=endpoint, bucket="bkt")
    with pytest.raises(bucket.BucketError) as e:
        bucket.check_endpoint(store, resolve=False)
    assert e.value.reason == "EndpointNotAllowed"


@pytest.mark.parametrize("endpoint", ["http://10.0.0.5:9000", "http://[2001:db8::5]:9000",
                                      "http://[64:ff9b::a00:5]", "http://minio.svc:9000"])
def test_ordinary_endpoints_pass(endpoint):
    bucket.check_endpoint(AdapterStoreSpec(endpoint=endpoint, bucket="bkt"), resolve=False)


def test_the_jobs_policy_excepts_every_metadata_spelling():
    pol = network.build_bucket_policy(run_of())
    excepted = {c for rule in pol["spec"]["egress"] for peer in rule.get("to", [])
                for c in peer.get("ipBlock", {}).get("except", [])}
    assert {"169.254.0.0/16", "100.100.100.200/32", "fe80::/10", "fd00:ec2::254/128",
            "64:ff9b::a9fe:0/112", "::a9fe:0/112", "fd20:ce::254/128",
            "fd00:c1::a9fe:a9fe/128", "168.63.129.16/32", "64:ff9b::6464:64c8/128",
            "::6464:64c8/128"} <= excepted


@pytest.mark.parametrize("endpoint", METADATA)
def test_the_jobs_policy_closes_every_refused_address(endpoint):
    """Every address the endpoint check refuses lies in an except of the Jobs' policy (or is
    IPv4-mapped, which is IPv4 on the wire)."""
    import ipaddress
    import urllib.parse

    pol = network.build_bucket_policy(run_of())
    excepted = [ipaddress.ip_network(c) for rule in pol["spec"]["egress"]
                for peer in rule.get("to", []) for c in peer.get("ipBlock", {}).get("except", [])]
    ip = ipaddress.ip_address(urllib.parse.urlsplit(endpoint).hostname)
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    assert any(ip in n for n in excepted if n.version == ip.version), ip
