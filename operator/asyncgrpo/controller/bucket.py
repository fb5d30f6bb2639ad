"""The run's S3 bucket and run folder: set up (bucket created if missing, ownership marker
written) and, on deletion with deletionPolicy Delete, emptied of the run's own objects.

Every failure becomes a `BucketError` with a reason a user can act on (SecretNotFound,
BadCredentials, BucketNotFound, EndpointNotAllowed...) and a message that names the bucket
and the S3 error code, never the credentials or the endpoint. Nothing here raises anything
else on bad input: a malformed endpoint or region, a Secret value that is not UTF-8 all
become a BucketError.

Tenancy (see docs/security.md): the run folder is `asyncgrpo.api.layout.run_folder`
(`<prefix>/<namespace>/<name>/`). Setup writes an ownership marker holding the run's uid and
refuses a folder that has another run's marker inside it or above it; cleanup deletes only
when the marker holds the run's uid, never above its folder, and never under another run's
marker.

Where this runs (docs/security.md): only in the run's own pods, never in the operator. The
operator creates a Job in the run's namespace (`controller.bucketjob`) whose container runs
`asyncgrpo bucket setup|cleanup` (`controller.bucket_commands`) as the run's ServiceAccount,
with the run's credentials Secret as env; the operator reads neither the Secret nor the
bucket, so a tenant can make it sign nothing and send nothing.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from asyncgrpo.api import layout
from asyncgrpo.api.v1alpha1 import AdapterStoreSpec

_BAD_CREDENTIALS = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken",
                    "ExpiredToken", "AuthorizationHeaderMalformed"}


class BucketError(Exception):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Credentials:
    access_key_id: str
    secret_access_key: str

    def __repr__(self) -> str:  # never print a secret
        return "Credentials(<redacted>)"


def credentials_from_env(env: Mapping[str, str]) -> Credentials | None:
    """The run's keys as the Job's container got them (secretKeyRef env); None without them:
    then boto3's own chain runs, i.e. the identity of the pod's ServiceAccount (IRSA, GKE
    workload identity), never the operator's."""
    key_id, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    if key_id is None and secret is None:
        return None
    values = {}
    for key, value in (("AWS_ACCESS_KEY_ID", key_id), ("AWS_SECRET_ACCESS_KEY", secret)):
        if value is None:
            raise BucketError("SecretKeyMissing", f"the credentials Secret gave no {key}")
        try:
            # a kubelet passes the Secret's bytes; Python decodes non-UTF-8 as surrogates
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise BucketError("SecretInvalid", f"the credentials Secret's {key} is not "
                              "UTF-8 text") from None
        value = value.strip()
        if not value or not value.isprintable():
            raise BucketError("SecretInvalid", f"the credentials Secret's {key} is empty "
                              "or holds control characters")
        values[key] = value
    return Credentials(values["AWS_ACCESS_KEY_ID"], values["AWS_SECRET_ACCESS_KEY"])


#: Seconds an S3 call may take: short, so a silent endpoint ends the Job in seconds with
#: EndpointUnreachable instead of holding it until its deadline.
TIMEOUT_SECONDS = 3.0


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


def client(store: AdapterStoreSpec, creds: Credentials | None,
           timeout: float = TIMEOUT_SECONDS):
    """An S3 client signed with the run's keys, or (None) with boto3's chain: the identity of
    the pod this runs in, which is always one of the run's own (the bucket Job)."""
    from asyncgrpo import storage

    keys = None if creds is None else (creds.access_key_id, creds.secret_access_key)
    try:
        return storage.client(store.endpoint, store.region, connect_timeout_s=timeout,
                              read_timeout_s=timeout, keys=keys)
    except (ValueError, BotoCoreError) as e:  # bad endpoint URL or region name
        raise BucketError("InvalidEndpoint", "spec.adapterStore endpoint or region is "
                          f"malformed ({type(e).__name__})") from None


def _classify(err: Exception, store: AdapterStoreSpec, action: str) -> BucketError:
    from botocore.exceptions import (
        ConnectTimeoutError,
        EndpointConnectionError,
        NoCredentialsError,
        ReadTimeoutError,
    )

    if isinstance(err, ClientError):
        code = str(err.response.get("Error", {}).get("Code", "Unknown"))
        status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in _BAD_CREDENTIALS:
            return BucketError("BadCredentials", f"{action} bucket {store.bucket!r}: the "
                               f"credentials were refused ({code})")
        if code in ("AccessDenied", "403") or status == 403:
            return BucketError("AccessDenied", f"{action} bucket {store.bucket!r}: access "
                               "denied; grant the credentials s3:ListBucket, s3:GetObject, "
                               "s3:PutObject and s3:DeleteObject on it")
        if code in ("NoSuchBucket", "404") or status == 404:
            return BucketError("BucketNotFound", f"bucket {store.bucket!r} does not exist and "
                               "spec.adapterStore.createBucket is false")
        return BucketError("BucketError", f"{action} bucket {store.bucket!r}: S3 error {code}")
    if isinstance(err, NoCredentialsError):
        return BucketError("NoCredentials", "no S3 credentials: set spec.adapterStore."
                           "credentialsSecret, or give the run's ServiceAccount "
                           "(<run>-workload) a cloud identity")
    if isinstance(err, (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError)):
        return BucketError("EndpointUnreachable", f"{action} bucket {store.bucket!r}: the S3 "
                           "endpoint (spec.adapterStore.endpoint) is unreachable or did not "
                           "answer in time")
    return BucketError("BucketError", f"{action} bucket {store.bucket!r}: {type(err).__name__}")


def _safe(store: AdapterStoreSpec, action: str, fn):
    """Run `fn` and turn every S3 or transport failure into a BucketError."""
    try:
        return fn()
    except BucketError:
        raise
    except (BotoCoreError, ClientError, OSError, ValueError) as err:
        raise _classify(err, store, action) from None


def ensure_bucket(store: AdapterStoreSpec, creds: Credentials | None) -> bool:
    """Make sure the bucket exists; True if this call created it."""
    s3 = client(store, creds)
    try:
        s3.head_bucket(Bucket=store.bucket)
        return False
    except (BotoCoreError, ClientError, OSError, ValueError) as err:
        missing = _classify(err, store, "checking")
        if missing.reason != "BucketNotFound" or not store.create_bucket:
            raise missing from None
    try:
        kw: dict[str, Any] = {"Bucket": store.bucket}
        if store.region != "us-east-1":
            kw["CreateBucketConfiguration"] = {"LocationConstraint": store.region}
        s3.create_bucket(**kw)
        return True
    except (BotoCoreError, ClientError, OSError, ValueError) as err:
        code = getattr(err, "response", {}).get("Error", {}).get("Code")
        if code in ("BucketAlreadyOwnedByYou",):
            return False
        raise _classify(err, store, "creating") from None


@dataclass(frozen=True)
class Owner:
    """The run a folder belongs to, as written in its marker."""

    namespace: str
    name: str
    uid: str

    def marker(self) -> bytes:
        return json.dumps({"namespace": self.namespace, "name": self.name, "uid": self.uid,
                           "writer": "asyncgrpo bucket setup"}).encode()


def _read_marker(s3, store: AdapterStoreSpec, key: str) -> str | None:
    """The uid in the marker at `key`, None when there is none ("" when unreadable)."""
    try:
        body = s3.get_object(Bucket=store.bucket, Key=key)["Body"].read(4096)
    except ClientError as err:
        code = str(err.response.get("Error", {}).get("Code"))
        if code in ("NoSuchKey", "404"):
            return None
        raise
    try:
        return str(json.loads(body).get("uid") or "")
    except (ValueError, AttributeError):
        return ""


@dataclass(frozen=True)
class Marker:
    """One ownership marker as the store holds it: whose (uid "" when unreadable) and when
    the store wrote it (its LastModified, as listed)."""

    key: str
    uid: str
    namespace: str
    name: str
    written: datetime
    etag: str


#: S3 error codes of a store that does not support conditional writes (`If-None-Match`).
_NO_CONDITIONAL = {"NotImplemented", "501", "InvalidArgument", "InvalidRequest"}
#: ... and of a conditional write that lost to another one.
_PRECONDITION = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}


def _code(err: ClientError) -> str:
    return str(err.response.get("Error", {}).get("Code"))


def _marker(s3, store: AdapterStoreSpec, key: str) -> Marker | None:
    """The marker at `key` with its listed LastModified, None when there is none. Listed, not
    read with HEAD: listings and HEAD give the time at different precisions, and every marker
    compared must come from the same clock and precision."""
    listed = s3.list_objects_v2(Bucket=store.bucket, Prefix=key, MaxKeys=1).get("Contents")
    if not listed or listed[0]["Key"] != key:
        return None
    try:
        got = s3.get_object(Bucket=store.bucket, Key=key)
    except ClientError as err:
        if _code(err) in ("NoSuchKey", "404"):
            return None
        raise
    body = got["Body"].read(4096)
    try:
        doc = json.loads(body)
        uid, ns, nm = (str(doc.get(k) or "") for k in ("uid", "namespace", "name"))
    except (ValueError, AttributeError):
        uid = ns = nm = ""
    return Marker(key, uid, ns, nm, listed[0]["LastModified"], str(got.get("ETag") or ""))


def _nested_markers(s3, store: AdapterStoreSpec, folder: str) -> list[Marker]:
    """Markers strictly below `folder` (other runs' folders inside it)."""
    out = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=store.bucket,
                                                             Prefix=folder):
        for o in page.get("Contents", []):
            key = o["Key"]
            if key.endswith("/" + layout.OWNER_MARKER) and key != folder + layout.OWNER_MARKER:
                out.append(Marker(key, "", "", "", o["LastModified"], ""))
    return out


def _enclosing_markers(s3, store: AdapterStoreSpec, folder: str) -> list[Marker]:
    """Markers of folders above `folder`, nearest first."""
    found = (_marker(s3, store, parent + layout.OWNER_MARKER)
             for parent in reversed(layout.ancestors(folder)))
    return [m for m in found if m is not None]


def _folder(marker: Marker) -> str:
    return marker.key[:-len(layout.OWNER_MARKER)]


def _write_marker(s3, store: AdapterStoreSpec, key: str, owner: Owner,
                  if_match: str | None = None) -> bool:
    """Write the marker only where none is (`If-None-Match: *`), or over the one with ETag
    `if_match`: False when another write won. A store that does not support conditional
    writes gets a plain write (the documented fallback: the caller read first, and reads
    back after)."""
    kw: dict[str, Any] = {"Bucket": store.bucket, "Key": key, "Body": owner.marker(),
                          "ContentType": "application/json"}
    try:
        s3.put_object(**kw, **({"IfMatch": if_match} if if_match else {"IfNoneMatch": "*"}))
        return True
    except ClientError as err:
        code = _code(err)
        if code in _PRECONDITION:
            return False
        if code not in _NO_CONDITIONAL:
            raise
    s3.put_object(**kw)
    return True


def _claim_conflict(reason: str, store: AdapterStoreSpec, folder: str, other: str) -> BucketError:
    if reason == "FolderInsideAnotherRun":
        return BucketError(reason, f"s3://{store.bucket}/{folder} lies inside another run's "
                           f"folder {other}: choose another prefix")
    return BucketError(reason, f"s3://{store.bucket}/{folder} contains another run's folder "
                       f"{other}: choose another prefix")


def _owned_by_another(store: AdapterStoreSpec, folder: str, found: Marker,
                      owner: Owner) -> BucketError:
    hint = ""
    if (found.namespace, found.name) == (owner.namespace, owner.name):
        hint = (" (a deleted run of this namespace and name retained it: set "
                "spec.adapterStore.reclaimRetainedFolder to take it back and resume)")
    return BucketError("FolderOwnedByAnotherRun", f"s3://{store.bucket}/{folder} belongs to "
                       f"another run (its ownership marker holds another uid){hint}; use "
                       "another name or prefix, or remove that folder")


def run_folder(store: AdapterStoreSpec, owner: Owner) -> str:
    try:
        return layout.run_folder(store.prefix, owner.namespace, owner.name)
    except ValueError as e:
        raise BucketError("InvalidPrefix", str(e)) from None


def setup_run_folder(store: AdapterStoreSpec, creds: Credentials | None,
                     owner: Owner, reclaim: bool = False) -> bool:
    """Ensure the bucket and claim the run folder with the ownership marker.

    Refused (BucketError) when the folder holds another run's marker, sits inside another
    run's folder, or contains one. Idempotent for the same run. True if the bucket was created.

    The claim is atomic (docs/security.md, "Bucket folders"): the marker is written with
    `If-None-Match: *`, so of two runs claiming one folder exactly one write lands; and it is
    written *before* the folders above and below are checked, so of two runs nesting into
    each other at once the later writer always sees the earlier one's marker. The older
    marker (the store's LastModified) keeps the folder; a run whose fresh marker is not older
    than a conflicting one removes its own and is refused (at the same instant both are:
    their next setups, one after the other, settle it). A store that ignores or refuses
    conditional writes gets the fallback: read before writing and read back after, which
    leaves a window of one round trip for two claims of the very same folder.

    `reclaim` (spec.adapterStore.reclaimRetainedFolder): a folder whose marker names this
    run's namespace and name with another uid (a run of this name deleted with Retain) is
    taken over, by a write conditional on that marker's ETag.
    """
    folder = run_folder(store, owner)
    key = folder + layout.OWNER_MARKER
    created = ensure_bucket(store, creds)
    s3 = client(store, creds)

    def claim() -> None:
        found = _marker(s3, store, key)   # read first: the fallback's guard
        wrote = False
        if found is None:
            wrote = _write_marker(s3, store, key, owner)
            found = _marker(s3, store, key)
        if found is not None and found.uid != owner.uid and reclaim and \
                (found.namespace, found.name) == (owner.namespace, owner.name):
            wrote = _write_marker(s3, store, key, owner, if_match=found.etag)
            found = _marker(s3, store, key)
        if found is None:
            raise BucketError("FolderClaimConflict", f"s3://{store.bucket}/{folder}: its "
                              "ownership marker went away while it was claimed; retried")
        if found.uid != owner.uid:
            raise _owned_by_another(store, folder, found, owner)
        for reason, others in (("FolderInsideAnotherRun", _enclosing_markers(s3, store, folder)),
                               ("FolderContainsAnotherRun", _nested_markers(s3, store, folder))):
            # a marker written after ours yields to ours (its own setup sees ours and backs
            # off); one written before keeps its folder. The store's clock has one-second
            # steps, so a tie is common: two claims written now both yield (their next setups
            # settle it), but a marker that was ours before this setup keeps its folder
            # against a newcomer of the same second, whose own setup yields to it
            older = [m for m in others
                     if m.written < found.written or (wrote and m.written == found.written)]
            if older:
                if wrote:
                    s3.delete_object(Bucket=store.bucket, Key=key)
                raise _claim_conflict(reason, store, folder, _folder(older[0]))

    _safe(store, "claiming the run folder in", claim)
    return created


def cleanup_run_folder(store: AdapterStoreSpec, creds: Credentials | None,
                       owner: Owner) -> int:
    """Delete the run's own objects; returns how many. Idempotent.

    Deletes nothing unless the folder's marker holds the run's uid and no folder above it is
    another run's; skips everything under another run's marker; the marker goes last, so a
    cleanup cut short can be finished by the same run.
    """
    folder = run_folder(store, owner)
    s3 = client(store, creds)

    def empty() -> int:
        try:
            found = _read_marker(s3, store, folder + layout.OWNER_MARKER)
        except ClientError as err:
            if _classify(err, store, "emptying").reason == "BucketNotFound":
                return 0
            raise
        if found != owner.uid:
            whose = "no" if found is None else "another run's"
            raise BucketError("NotOwner", f"s3://{store.bucket}/{folder} has {whose} "
                              "ownership marker: nothing deleted")
        above = _enclosing_markers(s3, store, folder)
        if above:
            raise BucketError("FolderInsideAnotherRun", f"s3://{store.bucket}/{folder} lies "
                              f"inside another run's folder {_folder(above[0])}: nothing "
                              "deleted")
        others = tuple(_folder(m) for m in _nested_markers(s3, store, folder))
        marker = folder + layout.OWNER_MARKER
        deleted = 0
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=store.bucket,
                                                                 Prefix=folder):
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])
                    if o["Key"] != marker and not o["Key"].startswith(others)]
            if keys:
                s3.delete_objects(Bucket=store.bucket, Delete={"Objects": keys, "Quiet": True})
                deleted += len(keys)
        s3.delete_object(Bucket=store.bucket, Key=marker)
        return deleted + 1

    return _safe(store, "emptying", empty)
