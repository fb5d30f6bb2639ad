"""vLLM plugin: serve ``policy-v{N}`` by resolving it from the run's S3 bucket.

Why a resolver and not ``/v1/load_lora_adapter``: the trainer then never needs to know how
many vLLM replicas exist or where they are. It publishes version N to the bucket; the first
request naming ``policy-v{N}`` on each replica downloads, verifies and loads it. Each version
is a new name, so vLLM's prefix cache never mixes KV computed under older weights.

Configuration (environment of the vLLM server; the operator sets it):

``ASYNCGRPO_ADAPTER_BUCKET``     bucket (required; without it the plugin registers nothing)
``ASYNCGRPO_ADAPTER_RUN``        run whose adapters ``policy-v{N}`` names (required unless
                                 ``ASYNCGRPO_ADAPTER_ANY_RUN=1``)
``ASYNCGRPO_ADAPTER_PREFIX``     key prefix before ``<namespace>/<run>/adapters/`` (default
                                 ``asyncgrpo``)
``ASYNCGRPO_ADAPTER_NAMESPACE``  the run's namespace (default ``default``)
``ASYNCGRPO_ADAPTER_ENDPOINT``   S3 endpoint URL (else boto3's ``AWS_ENDPOINT_URL_S3`` /
                                 ``AWS_ENDPOINT_URL``; else AWS)
``ASYNCGRPO_ADAPTER_REGION``     region (else boto3's default chain)
``ASYNCGRPO_ADAPTER_CACHE_DIR``  local directory for verified adapters (default
                                 ``adapters`` under ``$ASYNCGRPO_CACHE``, else under
                                 ``~/.cache/asyncgrpo``; give it an emptyDir)
``ASYNCGRPO_ADAPTER_NAME_PREFIX`` served-name prefix (default ``policy-v``)
``ASYNCGRPO_ADAPTER_ANY_RUN``    ``1``: also accept ``<run>/policy-v{N}`` for any run under
                                 the prefix (shared test servers; off in production)
``ASYNCGRPO_ADAPTER_ATTEMPTS``, ``ASYNCGRPO_ADAPTER_BACKOFF_S``  S3 retry budget per call
Credentials: boto3's chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, web identity...).

vLLM only consults resolvers with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``; if
``VLLM_PLUGINS`` is set it must include ``asyncgrpo_s3_lora_resolver``; the server needs
``--enable-lora`` and ``--max-lora-rank`` >= the trained rank.

Names: only the canonical ``policy-v{N}`` (``policy-v01`` and ``/policy-v1`` are not aliases:
vLLM would load the same version into a second slot). The base-model name vLLM passes is not
compared: it is the ``--model`` path of this server, and the trainer's path to the same model
differs (the manifest records the trainer's); the run's folder already names the model.

Failure behaviour: a missing, partial (no manifest), corrupt (size/sha256 mismatch) or
non-LoRA (``peft_type`` other than ``LORA``) version, or an unreachable bucket, is logged as an error naming the adapter and
``s3://bucket/key`` and the resolver returns None, so the client gets vLLM's clean
404 "does not exist" and nothing is cached: a later request retries. No exception
escapes (vLLM would turn it into a 500 carrying the endpoint URL). The local cache is
append-only: vLLM reloads evicted adapters from their path, so a served directory is never
modified or deleted while the server lives.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import threading
import time
import zlib
from pathlib import Path

from asyncgrpo import wire
from asyncgrpo.adapters.store import (
    MANIFEST,
    AdapterCorrupt,
    AdapterIncomplete,
    AdapterNotFound,
    AdapterStore,
    AdapterStoreError,
    parse_adapter_name,
)

#: peft's adapter configuration file (vLLM reads it to load the adapter).
ADAPTER_CONFIG = "adapter_config.json"
#: vLLM formats loggers under "vllm"; ours sits below it so its lines appear in the server log.
log = logging.getLogger("vllm.asyncgrpo.s3_lora_resolver")
RESOLVER_NAME = "asyncgrpo-s3"
#: Run names are DNS labels (asyncgrpo.api.layout refuses anything else as a folder segment).
_RUN_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def _truthy(v: str | None) -> bool:
    return (v or "").strip().lower() in ("1", "true", "yes", "on")


class S3AdapterResolver:
    """Name -> verified local adapter directory, independent of vLLM (testable without it).

    Cheap to build: nothing touches S3 or imports boto3 until the first name is resolved.
    """

    def __init__(self, env: dict[str, str] | None = None):
        env = dict(os.environ if env is None else env)
        self.env = env
        self.bucket = env.get(wire.ADAPTER_BUCKET_ENV, "")
        self.default_run = env.get(wire.ADAPTER_RUN_ENV, "") or None
        self.any_run = _truthy(env.get(wire.ADAPTER_ANY_RUN_ENV))
        self.name_prefix = env.get(wire.ADAPTER_NAME_PREFIX_ENV) or wire.DEFAULT_NAME_PREFIX
        self.cache_dir = Path(env.get(wire.ADAPTER_CACHE_DIR_ENV)
                              or wire.user_cache_dir(env) / "adapters")
        if not self.bucket:
            raise ValueError(f"{wire.ADAPTER_BUCKET_ENV} is not set")
        if not self.default_run and not self.any_run:
            raise ValueError(f"{wire.ADAPTER_RUN_ENV} is not set "
                             f"(or set {wire.ADAPTER_ANY_RUN_ENV}=1)")
        self._stores: dict[str, AdapterStore] = {}
        self._client = None
        self._lock = threading.Lock()

    def parse(self, lora_name: str) -> tuple[str, int] | None:
        """``policy-v3`` -> (default run, 3); ``r/policy-v3`` -> ("r", 3) when any-run is on."""
        run, slash, tail = lora_name.rpartition("/")
        if slash and not run:  # "/policy-v1" is not an alias of "policy-v1"
            return None
        if run:
            if not self.any_run or not _RUN_NAME.match(run):
                return None
        else:
            run = self.default_run or ""
            if not run:
                return None
        version = parse_adapter_name(tail, self.name_prefix)
        if version is None or version < 1:
            return None
        return run, version

    def store(self, run: str) -> AdapterStore:
        with self._lock:
            if run not in self._stores:
                if self._client is None:
                    first = AdapterStore.from_env({**self.env, wire.ADAPTER_RUN_ENV: run})
                    self._client = first.client
                    self._stores[run] = first
                else:
                    self._stores[run] = AdapterStore.from_env(
                        {**self.env, wire.ADAPTER_RUN_ENV: run}, client=self._client)
            return self._stores[run]

    def local_dir(self, run: str, version: int) -> Path:
        return self.cache_dir / run / f"v{version}"

    def resolve(self, lora_name: str) -> Path | None:
        """The verified local directory of ``lora_name``, or None (and an error logged)."""
        parsed = self.parse(lora_name)
        if parsed is None:
            return None
        run, version = parsed
        dest = self.local_dir(run, version)
        if (dest / MANIFEST).is_file():  # verified earlier; versions are immutable
            return dest if self._is_lora(lora_name, dest) else None
        t0 = time.monotonic()
        try:
            store = self.store(run)
            path, manifest = store.fetch(version, dest)
        except AdapterNotFound:
            log.warning("LoRA %r: version %d of run %r is not in the bucket (yet)",
                        lora_name, version, run)
            return None
        except AdapterIncomplete as e:
            log.error("LoRA %r refused: %s", lora_name, e)
            return None
        except AdapterCorrupt as e:
            log.error("LoRA %r refused: corrupt version: %s", lora_name, e)
            return None
        except AdapterStoreError as e:  # StoreUnavailable, request errors
            log.error("LoRA %r not resolved: %s", lora_name, e)
            return None
        except Exception as e:  # never let an error reach vLLM's 500 path
            log.error("LoRA %r not resolved: unexpected %s", lora_name, type(e).__name__)
            log.debug("resolver failure detail", exc_info=True)
            return None
        if not self._is_lora(lora_name, path):
            return None
        log.info("LoRA %r resolved: run %r version %d (step %d, %d files, %d bytes) in %.3fs",
                 lora_name, run, version, manifest.step, len(manifest.files),
                 manifest.total_bytes, time.monotonic() - t0)
        return path


    @staticmethod
    def _is_lora(lora_name: str, path: Path) -> bool:
        """vLLM loads only LoRA adapters: anything else (a P-tuning config, no config at all)
        would answer the client 400 "could not be loaded" and take a slot; refused here, the
        client gets the same clean 404 as an unknown adapter."""
        try:
            config = json.loads((path / ADAPTER_CONFIG).read_text())
        except (OSError, ValueError) as e:
            log.error("LoRA %r refused: no readable %s (%s)", lora_name, ADAPTER_CONFIG,
                      type(e).__name__)
            return False
        peft_type = config.get("peft_type") if isinstance(config, dict) else None
        if str(peft_type).upper() != "LORA":
            log.error("LoRA %r refused: peft_type %r is not LORA", lora_name, peft_type)
            return False
        return True


def _vllm_resolver(core: S3AdapterResolver):
    """Wrap the core in vLLM's LoRAResolver interface (imported only inside vLLM)."""
    from vllm.lora.request import LoRARequest
    from vllm.lora.resolver import LoRAResolver

    class AsyncgrpoS3LoRAResolver(LoRAResolver):
        def __init__(self):
            self.core = core

        async def resolve_lora(self, base_model_name: str, lora_name: str):
            # The download blocks; a thread keeps the server answering other requests.
            path = await asyncio.to_thread(self.core.resolve, lora_name)
            if path is None:
                return None
            # vLLM replaces the id with its own counter; it only has to be positive here.
            return LoRARequest(lora_name=lora_name,
                               lora_int_id=1 + (zlib.crc32(lora_name.encode()) & 0x7FFFFFFF),
                               lora_path=str(path))

    return AsyncgrpoS3LoRAResolver()


def register() -> None:
    """Entry point ``vllm.general_plugins: asyncgrpo_s3_lora_resolver``.

    vLLM calls it in every process it starts (API server, engine core, workers): it only reads
    the environment and registers an object, no network and no boto3 import.
    """
    if not os.environ.get(wire.ADAPTER_BUCKET_ENV):
        log.debug("%s unset: S3 LoRA resolver not registered", wire.ADAPTER_BUCKET_ENV)
        return
    try:
        core = S3AdapterResolver()
    except ValueError as e:
        log.error("S3 LoRA resolver not registered: %s", e)
        return
    from vllm.lora.resolver import LoRAResolverRegistry

    if not _truthy(os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")):
        log.warning("S3 LoRA resolver registered, but vLLM only consults resolvers with "
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")
    LoRAResolverRegistry.register_resolver(RESOLVER_NAME, _vllm_resolver(core))
    log.debug("S3 LoRA resolver registered for bucket %s run %s", core.bucket, core.default_run)
