"""The one S3 layer and the one versioned store.

Everything the trainer, vLLM's resolver plugin, the weights puller and the bucket Job keep
in or read from a bucket goes through here: adapters (`asyncgrpo.adapters.store`), full
weights (`asyncgrpo.weights.store`), checkpoints (`asyncgrpo.trainer.checkpoint`), prompt
data and the run folder's ownership marker (`asyncgrpo.bucket`). No other module sends an
S3 request (tests/test_layers.py).

* `asyncgrpo.storage.s3`: the client, retries and transient-error classification, the
  missing-key codes, `Bucket` (keys under one root, every call retried) and
  `CompleteVersions` (numbered sub-folders each marked complete by one object written last).
  Its names are re-exported here.
* `asyncgrpo.storage.versions`: the versioned store (`VersionedStore`): manifests, file
  entries, uploads with the manifest last, verified downloads, ``final/``. Adapters and
  weights are its two kinds, siblings on it.
"""

from asyncgrpo.storage.s3 import (
    MISSING_CODES,
    Bucket,
    CompleteVersions,
    StoreError,
    StoreRequestError,
    StoreUnavailable,
    client,
    error_code,
    http_status,
    is_boto,
    is_missing,
    is_transient,
    retry,
    root_cause,
)

__all__ = ["MISSING_CODES", "Bucket", "CompleteVersions", "StoreError", "StoreRequestError",
           "StoreUnavailable", "client", "error_code", "http_status", "is_boto", "is_missing",
           "is_transient", "retry", "root_cause"]
