"""The bucket Job's work: the run's S3 bucket and run folder set up (bucket created if
missing, ownership marker written) and, on deletion with deletionPolicy Delete, emptied of
the run's own objects. Every S3 request goes through `asyncgrpo.storage` (one attempt
each, short timeouts: the operator retries the Job).

Every failure becomes a `BucketError` (`asyncgrpo.bucket.policy`) with a reason a user can
act on (SecretNotFound, BadCredentials, BucketNotFound, EndpointNotAllowed...) and a message
that names the bucket and the S3 error code, never the credentials or the endpoint. Nothing
here raises anything else on bad input: a malformed endpoint or region, a Secret value that
is not UTF-8 all become a BucketError.

Tenancy (see docs/security.md): the run folder is `asyncgrpo.api.layout.run_folder`
(`<prefix>/<namespace>/<name>/`). Setup writes an ownership marker holding the run's uid and
refuses a folder that has another run's marker inside it or above it; cleanup deletes only
when the marker holds the run's uid, never above its folder, and never under another run's
marker.

Where this runs (docs/security.md): only in the run's own pods, never in the operator. The
operator creates a Job in the run's namespace (`controller.bucketjob`) whose container runs
`asyncgrpo bucket setup|cleanup` (`asyncgrpo.bucket.command`) as the run's ServiceAccount,
with the run's credentials Secret as env; the operator reads neither the Secret nor the
bucket, so a tenant can make it sign nothing and send nothing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from asyncgrpo import storage
from asyncgrpo.api import layout
from asyncgrpo.api.v1alpha1 import AdapterStoreSpec
from asyncgrpo.bucket.policy import (  # noqa: F401  (re-exported: the Job's whole surface)
    BucketError,
    Owner,
    check_endpoint,
    metadata_excepts,
    run_folder,
)

_BAD_CREDENTIALS = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken",
                    "ExpiredToken", "AuthorizationHeaderMalformed"}


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


def client(store: AdapterStoreSpec, creds: Credentials | None,
           timeout: float = TIMEOUT_SECONDS):
    """An S3 client signed with the run's keys, or (None) with boto3's chain: the identity of
    the pod this runs in, which is always one of the run's own (the bucket Job)."""
    keys = None if creds is None else (creds.access_key_id, creds.secret_access_key)
    try:
        return storage.client(store.endpoint, store.region, connect_timeout_s=timeout,
                              read_timeout_s=timeout, keys=keys)
    except Exception as e:  # bad endpoint URL or region name
        if not isinstance(e, ValueError) and not storage.is_boto(e):
            raise
        raise BucketError("InvalidEndpoint", "spec.adapterStore endpoint or region is "
                          f"malformed ({type(e).__name__})") from None


def _objects(store: AdapterStoreSpec, creds: Credentials | None) -> storage.Bucket:
    """The whole bucket (absolute keys), one attempt per request: a failure ends the Job,
    whose next run the operator schedules."""
    return storage.Bucket(store.bucket, "", client(store, creds), attempts=1)


#: S3 failures the Job maps to a reason: storage's errors (code, status, cause) and the
#: local ones boto3 raises as they are (a file, a bad value).
_FAILURES = (storage.StoreError, OSError, ValueError)


def _classify(err: Exception, store: AdapterStoreSpec, action: str) -> BucketError:
    code = err.code if isinstance(err, storage.StoreError) else ""
    status = err.status if isinstance(err, storage.StoreError) else 0
    cause = err.cause if isinstance(err, storage.StoreError) and err.cause else type(err).__name__
    if code:
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
    if cause == "NoCredentialsError":
        return BucketError("NoCredentials", "no S3 credentials: set spec.adapterStore."
                           "credentialsSecret, or give the run's ServiceAccount "
                           "(<run>-workload) a cloud identity")
    if cause in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError"):
        return BucketError("EndpointUnreachable", f"{action} bucket {store.bucket!r}: the S3 "
                           "endpoint (spec.adapterStore.endpoint) is unreachable or did not "
                           "answer in time")
    return BucketError("BucketError", f"{action} bucket {store.bucket!r}: {cause}")


def _safe(store: AdapterStoreSpec, action: str, fn):
    """Run `fn` and turn every S3 or transport failure into a BucketError."""
    try:
        return fn()
    except BucketError:
        raise
    except _FAILURES as err:
        raise _classify(err, store, action) from None


def ensure_bucket(store: AdapterStoreSpec, creds: Credentials | None) -> bool:
    """Make sure the bucket exists; True if this call created it."""
    s3 = _objects(store, creds)
    try:
        s3.probe()
        return False
    except _FAILURES as err:
        missing = _classify(err, store, "checking")
        if missing.reason != "BucketNotFound" or not store.create_bucket:
            raise missing from None
    try:
        s3.create(store.region)
        return True
    except _FAILURES as err:
        if getattr(err, "code", "") in ("BucketAlreadyOwnedByYou",):
            return False
        raise _classify(err, store, "creating") from None


def _read_marker(s3: storage.Bucket, key: str) -> str | None:
    """The uid in the marker at `key`, None when there is none ("" when unreadable)."""
    got = s3.get_tagged(key, limit=4096)
    if got is None:
        return None
    try:
        return str(json.loads(got[0]).get("uid") or "")
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


def _marker(s3: storage.Bucket, key: str) -> Marker | None:
    """The marker at `key` with its listed LastModified, None when there is none. Listed, not
    read with HEAD: listings and HEAD give the time at different precisions, and every marker
    compared must come from the same clock and precision."""
    listed = s3.listing(key, limit=1)
    if not listed or listed[0]["Key"] != key:
        return None
    got = s3.get_tagged(key, limit=4096)
    if got is None:
        return None
    body, etag = got
    try:
        doc = json.loads(body)
        uid, ns, nm = (str(doc.get(k) or "") for k in ("uid", "namespace", "name"))
    except (ValueError, AttributeError):
        uid = ns = nm = ""
    return Marker(key, uid, ns, nm, listed[0]["LastModified"], etag)


def _nested_markers(s3: storage.Bucket, folder: str) -> list[Marker]:
    """Markers strictly below `folder` (other runs' folders inside it)."""
    return [Marker(o["Key"], "", "", "", o["LastModified"], "") for o in s3.listing(folder)
            if o["Key"].endswith("/" + layout.OWNER_MARKER)
            and o["Key"] != folder + layout.OWNER_MARKER]


def _enclosing_markers(s3: storage.Bucket, folder: str) -> list[Marker]:
    """Markers of folders above `folder`, nearest first."""
    found = (_marker(s3, parent + layout.OWNER_MARKER)
             for parent in reversed(layout.ancestors(folder)))
    return [m for m in found if m is not None]


def _folder(marker: Marker) -> str:
    return marker.key[:-len(layout.OWNER_MARKER)]


def _write_marker(s3: storage.Bucket, key: str, owner: Owner,
                  if_match: str | None = None) -> bool:
    """Write the marker only where none is (`If-None-Match: *`), or over the one with ETag
    `if_match`: False when another write won. A store that does not support conditional
    writes gets a plain write (the documented fallback: the caller read first, and reads
    back after)."""
    body = owner.marker()
    try:
        if if_match:
            s3.put_bytes(key, body, "application/json", if_match=if_match)
        else:
            s3.put_bytes(key, body, "application/json", if_none_match="*")
        return True
    except storage.StoreError as err:
        if err.code in _PRECONDITION:
            return False
        if err.code not in _NO_CONDITIONAL:
            raise
    s3.put_bytes(key, body, "application/json")
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
    s3 = _objects(store, creds)

    def claim() -> None:
        found = _marker(s3, key)   # read first: the fallback's guard
        wrote = False
        if found is None:
            wrote = _write_marker(s3, key, owner)
            found = _marker(s3, key)
        if found is not None and found.uid != owner.uid and reclaim and \
                (found.namespace, found.name) == (owner.namespace, owner.name):
            wrote = _write_marker(s3, key, owner, if_match=found.etag)
            found = _marker(s3, key)
        if found is None:
            raise BucketError("FolderClaimConflict", f"s3://{store.bucket}/{folder}: its "
                              "ownership marker went away while it was claimed; retried")
        if found.uid != owner.uid:
            raise _owned_by_another(store, folder, found, owner)
        for reason, others in (("FolderInsideAnotherRun", _enclosing_markers(s3, folder)),
                               ("FolderContainsAnotherRun", _nested_markers(s3, folder))):
            # a marker written after ours yields to ours (its own setup sees ours and backs
            # off); one written before keeps its folder. The store's clock has one-second
            # steps, so a tie is common: two claims written now both yield (their next setups
            # settle it), but a marker that was ours before this setup keeps its folder
            # against a newcomer of the same second, whose own setup yields to it
            older = [m for m in others
                     if m.written < found.written or (wrote and m.written == found.written)]
            if older:
                if wrote:
                    s3.delete_one(key)
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
    s3 = _objects(store, creds)

    def empty() -> int:
        try:
            found = _read_marker(s3, folder + layout.OWNER_MARKER)
        except storage.StoreError as err:
            if _classify(err, store, "emptying").reason == "BucketNotFound":
                return 0
            raise
        if found != owner.uid:
            whose = "no" if found is None else "another run's"
            raise BucketError("NotOwner", f"s3://{store.bucket}/{folder} has {whose} "
                              "ownership marker: nothing deleted")
        above = _enclosing_markers(s3, folder)
        if above:
            raise BucketError("FolderInsideAnotherRun", f"s3://{store.bucket}/{folder} lies "
                              f"inside another run's folder {_folder(above[0])}: nothing "
                              "deleted")
        others = tuple(_folder(m) for m in _nested_markers(s3, folder))
        marker = folder + layout.OWNER_MARKER
        deleted = 0
        keys = [k for k in s3.list(folder) if k != marker and not k.startswith(others)]
        if keys:
            s3.delete(keys)   # 1000 a request
            deleted += len(keys)
        s3.delete_one(marker)
        return deleted + 1

    return _safe(store, "emptying", empty)
