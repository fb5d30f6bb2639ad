"""The puller: keeps one vLLM replica on the newest full-weights version in the bucket.

Runs as a sidecar process in the vLLM pod (``asyncgrpo weights pull``), not as a
``vllm.general_plugins`` thread, because:

* vLLM calls a general plugin in every process it starts (API server, engine core, workers):
  a thread there would run several times per replica, and the API-server process is the only
  one that may pause the engine;
* the swap goes through the server's own routes (``/pause?mode=keep`` ->
  ``/collective_rpc asyncgrpo_reload_weights`` -> ``/update_weight_version`` -> ``/resume``), which are
  plain HTTP from beside the server, and the server's dev-mode routes then never need to be
  reachable from outside the pod (the sidecar talks to it on loopback);
* the pod's readiness can wait for the sidecar: a fresh or restarted replica becomes Ready
  only after it loaded the newest anchor and its deltas (``/ready`` below), while vLLM's own
  ``/health`` knows nothing about weight versions;
* a crash of the puller (a bad file, a full disk) never takes the inference engine down.

Each round: list the bucket, plan the chain from the local copy to the newest version
(deltas after the local version, or the newest anchor and its deltas), download each file
to local disk (serving goes on), verify size and sha256 (the store does), apply deltas to the
local full copy in place, then swap once. A corrupt or partial version is refused and
remembered (versions are immutable): the replica keeps serving what it has and waits for
the next anchor. After each swap the puller compares the served log-probs of the manifest's
probe (if the trainer put one there) with the trainer's and records the difference.

State on disk (``work_dir``): ``current/`` holds the local full copy and ``STATE.json``
(``{"version": N}``, or ``{"version": null, "applying": N}`` while a delta is written into
it: a puller killed mid-apply starts again from an anchor).
"""

from __future__ import annotations

import functools
import http.client
import ipaddress
import json
import logging
import os
import shutil
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from asyncgrpo.storage import StoreError, StoreUnavailable
from asyncgrpo.weights.format import DELTA_FILE, DeltaMismatch, apply_deltas
from asyncgrpo.weights.shards import assemble_anchor
from asyncgrpo.weights.store import (
    ANCHOR,
    WeightsCorrupt,
    WeightsManifest,
    WeightsNotFound,
    WeightStore,
)
from asyncgrpo.weights.vllm_worker import RELOAD_METHOD

log = logging.getLogger(__name__)
STATE = "STATE.json"


class SwapFailed(RuntimeError):
    """vLLM refused or failed a step of the swap."""


class _FromAddress(urllib.request.HTTPHandler):
    """Plain HTTP from a given local address (the source of every connection it opens)."""

    def __init__(self, address: str):
        super().__init__()
        self.address = address

    def http_open(self, req):
        return self.do_open(functools.partial(http.client.HTTPConnection,
                                              source_address=(self.address, 0)), req)


def _opener(base_url: str) -> urllib.request.OpenerDirector:
    """Calls to a loopback address come *from* that address: the dev-route guard admits a
    client whose address is the server's (its own pod, asyncgrpo.weights.guard). In a pod
    that is 127.0.0.1 either way; the local backend's pods have one loopback address each,
    where an unbound client would come from 127.0.0.1 and be refused."""
    host = urllib.parse.urlsplit(base_url).hostname
    try:
        loopback = host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    return urllib.request.build_opener(*([_FromAddress(host)] if loopback else []))


class VLLMControl:
    """The few HTTP calls the puller makes to its own vLLM (loopback, dev-mode routes)."""

    def __init__(self, base_url: str, timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._opener = _opener(self.base_url)

    def call(self, method: str, path: str, body: dict | None = None,
             timeout: float | None = None) -> tuple[int, object]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with self._opener.open(req, timeout=timeout or self.timeout_s) as resp:
                raw, status = resp.read(), resp.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        try:
            return status, json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return status, raw.decode(errors="replace")

    def healthy(self) -> bool:
        try:
            return self.call("GET", "/health", timeout=5)[0] == 200
        except OSError:
            return False

    def _ok(self, what: str, method: str, path: str, body: dict | None = None) -> object:
        status, doc = self.call(method, path, body)
        if status != 200:
            raise SwapFailed(f"{what}: vLLM answered {status}: {str(doc)[:300]}")
        return doc

    def weight_version(self) -> str | None:
        """The version the server says it serves (``/update_weight_version`` sets it)."""
        try:
            status, doc = self.call("GET", "/weight_info", timeout=10)
        except OSError:
            return None
        if status != 200:
            return None
        if isinstance(doc, dict):
            doc = doc.get("weight_version")
        return None if doc is None else str(doc)

    def swap(self, weights_dir: Path, version: int) -> None:
        """Pause (in-flight requests keep their place), reload from the local copy, name
        the version, resume; resume is attempted whatever failed before it."""
        self._ok("pause", "POST", "/pause?mode=keep")
        try:
            # vLLM's reload_weights plus the expert repack it skips on CPU MoE
            # (asyncgrpo.weights.vllm_worker; vLLM runs with its --worker-extension-cls)
            self._ok("reload_weights", "POST", "/collective_rpc",
                     {"method": RELOAD_METHOD, "kwargs": {"weights_path": str(weights_dir)}})
            self._ok("reset_prefix_cache", "POST", "/reset_prefix_cache")
            self._ok("update_weight_version", "POST", "/update_weight_version",
                     {"new_version": str(version)})
        finally:
            self._ok("resume", "POST", "/resume")

    def resume_if_paused(self) -> bool:
        """Resume a server left paused (True if it was): a puller killed between ``/pause``
        and ``/resume`` leaves every request to its replica frozen until someone resumes."""
        status, doc = self.call("GET", "/is_paused", timeout=10)
        if status == 200 and isinstance(doc, dict) and doc.get("is_paused"):
            self._ok("resume", "POST", "/resume")
            return True
        return False

    def next_logprob(self, model: str, token_ids: list[int]) -> float:
        """Log-prob of the greedy token after ``token_ids``, generated: through the prefix
        cache, unlike prompt log-probs."""
        doc = self._ok("completion", "POST", "/v1/completions", {
            "model": model, "prompt": [int(t) for t in token_ids], "max_tokens": 1,
            "temperature": 0.0, "logprobs": 1})
        return float(doc["choices"][0]["logprobs"]["token_logprobs"][0])  # type: ignore[index]

    def served_model(self) -> str:
        doc = self._ok("models", "GET", "/v1/models")
        return str(doc["data"][0]["id"])  # type: ignore[index]


class Puller:
    """Follows the run's weights manifests for one vLLM replica (see module docstring)."""

    def __init__(self, store: WeightStore, vllm: VLLMControl, work_dir: str | Path, *,
                 poll_s: float = 2.0, probe: bool = True):
        self.store = store
        self.vllm = vllm
        self.work_dir = Path(work_dir)
        self.current = self.work_dir / "current"
        self.incoming = self.work_dir / "incoming"
        self.poll_s = poll_s
        self.probe = probe
        self.local_version: int | None = self._read_state()
        self.served_version: int | None = None
        self.served_tag: str | None = None
        self.latest_seen: int | None = None
        self.refused: dict[int, str] = {}
        self.ready = False
        self.swapping: int | None = None  # the version between /pause and /resume
        self.history: list[dict] = []  # one entry per swap (bounded)
        self.errors = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()

    # -- local copy --------------------------------------------------------------------------

    def _read_state(self) -> int | None:
        try:
            doc = json.loads((self.current / STATE).read_text())
            return None if doc.get("version") is None else int(doc["version"])
        except (OSError, ValueError, TypeError):
            return None

    def _write_state(self, doc: dict) -> None:
        tmp = self.current / (STATE + ".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.current / STATE)

    def _take_anchor(self, m: WeightsManifest) -> None:
        dest = self.incoming / f"v{m.version}"
        self.store.fetch(m.version, dest, manifest=m)  # verified before it appears
        if m.sharded:  # one file per trainer rank: assemble the checkpoint layout beside it
            built = self.incoming / f"v{m.version}.assembled"
            shutil.rmtree(built, ignore_errors=True)
            try:
                assemble_anchor(dest, m.shards["tensors"], built)
            except (DeltaMismatch, ValueError, KeyError, OSError) as err:
                shutil.rmtree(built, ignore_errors=True)
                raise WeightsCorrupt(f"v{m.version}: shards do not assemble: {err}") from None
            finally:
                shutil.rmtree(dest, ignore_errors=True)
            (built / "manifest.json").write_text(m.to_json())
            os.rename(built, dest)
        old = self.work_dir / "previous"
        shutil.rmtree(old, ignore_errors=True)
        if self.current.exists():
            os.rename(self.current, old)
        os.rename(dest, self.current)
        self._write_state({"version": m.version})
        shutil.rmtree(old, ignore_errors=True)
        self.local_version = m.version

    def _take_delta(self, m: WeightsManifest) -> None:
        if m.base != self.local_version:
            raise WeightsCorrupt(f"delta v{m.version} applies to v{m.base}, local copy is "
                                 f"v{self.local_version}")
        dest = self.incoming / f"v{m.version}"
        self.store.fetch(m.version, dest, manifest=m)
        self._write_state({"version": None, "applying": m.version})
        self.local_version = None
        try:
            files = sorted(m.files) if m.sharded else [DELTA_FILE]  # one per rank, or one
            apply_deltas(self.current, [dest / f for f in files])
        except DeltaMismatch:
            # apply_delta checks everything before writing: the copy is still at base
            self._write_state({"version": m.base})
            self.local_version = m.base
            raise
        finally:
            shutil.rmtree(dest, ignore_errors=True)
        self._write_state({"version": m.version})
        self.local_version = m.version

    def _plan(self, latest: int) -> list[WeightsManifest]:
        plan = self.store.plan(self.local_version, latest)
        if any(m.version in self.refused for m in plan) and plan and plan[0].kind != ANCHOR:
            plan = self.store.plan(None, latest)  # skip a refused delta: start from an anchor
        if any(m.version in self.refused for m in plan):
            return []  # no usable chain yet: wait for the next anchor
        return plan

    # -- one round ---------------------------------------------------------------------------

    def round(self) -> bool:
        """Catch up once; True when a new version is being served after it."""
        try:
            latest = self.store.latest()
        except StoreError as err:
            self.errors += 1
            log.warning("weights: cannot list the bucket: %s", err)
            return False
        self.latest_seen = latest
        if latest is None:  # nothing published yet: the base model is the policy
            self.ready = True
            return False
        if not self._vllm_has(self.served_version):
            self.served_version = None  # vLLM restarted under us: swap the local copy back in
        try:
            applied = self._catch_up(latest)
        except StoreUnavailable as err:
            self.errors += 1
            log.warning("weights: %s", err)
            return False
        target = self.local_version
        if target is None or target == self.served_version:
            if self.served_version is not None and self._caught_up(latest):
                self.ready = True
            return False
        return self._swap(target, applied)

    def _caught_up(self, latest: int) -> bool:
        """Nothing newer than the served version can be had (all newer ones refused)."""
        return all(v in self.refused for v in range(self.served_version + 1, latest + 1))

    def _catch_up(self, latest: int) -> WeightsManifest | None:
        """Bring the local copy to the newest version that is not refused; returns the last
        version applied (None if nothing changed).

        Tries ``latest`` first; when its chain holds a refused version it tries the version
        below (whose chain may start at an older anchor), down to the local version. A
        version already pruned ends the search: nothing older exists.
        """
        applied = None
        floor = self.local_version or 0
        for target in range(latest, floor, -1):
            if target in self.refused or self.local_version == target:
                if self.local_version == target:
                    return applied
                continue
            try:
                plan = self._plan(target)
            except WeightsNotFound:
                return applied
            except StoreUnavailable:
                raise
            except WeightsCorrupt as err:  # a manifest of its chain is unusable: so is it
                self.refused[target] = str(err)[:300]
                log.error("weights v%d refused: no usable chain: %s", target, err)
                continue
            except StoreError as err:
                self.errors += 1
                log.warning("weights: chain to v%d not read: %s", target, err)
                return applied
            for m in plan:
                try:
                    (self._take_anchor if m.kind == ANCHOR else self._take_delta)(m)
                    applied = m
                except (WeightsCorrupt, DeltaMismatch) as err:
                    self.refused[m.version] = str(err)[:300]
                    log.error("weights v%d refused: %s; serving v%s", m.version, err,
                              self.served_version)
                    break
                except StoreUnavailable:
                    raise
                except StoreError as err:
                    self.errors += 1
                    log.warning("weights v%d not fetched: %s", m.version, err)
                    return applied
            if self.local_version == target:
                return applied
        return applied

    def build_local_copy(self, version: int) -> Path:
        """The checkpoint-layout folder of ``version``, built from the bucket exactly as a
        replica builds it (anchor, assembled from rank files when sharded, then deltas):
        the trainer's final/ of a sharded run, whose ranks each hold only a shard, comes
        from here. Raises WeightsCorrupt when that version cannot be built."""
        self._catch_up(version)
        if self.local_version != version:
            reason = self.refused.get(version) or "its chain is not complete in the bucket"
            raise WeightsCorrupt(f"v{version} cannot be built: {reason}")
        return self.current

    def _vllm_has(self, version: int | None) -> bool:
        if version is None:
            return True
        tag = self.vllm.weight_version()
        return tag is None or tag == str(version)

    def _swap(self, version: int, manifest: WeightsManifest | None) -> bool:
        probe = (manifest.extra.get("probe") if self.probe and manifest is not None
                 and manifest.version == version else None)
        if probe and "next_logprob" in probe:
            try:  # cache the probe's prefix under the old weights: the check below must see it
                self.vllm.next_logprob(self.vllm.served_model(), probe["token_ids"])
            except (SwapFailed, OSError, KeyError, ValueError, TypeError):
                pass
        t0 = time.time()
        # read by the trainer's router: a replica mid-swap gets no new group
        with self._lock:
            self.swapping = version
        try:
            self.vllm.swap(self.current, version)
        except (SwapFailed, OSError) as err:
            self.errors += 1
            log.error("weights v%d: swap failed: %s", version, err)
            return False
        finally:
            with self._lock:
                self.swapping = None
        record = {"version": version, "swapped_at": time.time(), "swap_s": time.time() - t0}
        if manifest is None or manifest.version != version:
            try:
                manifest = self.store.manifest(version)
            except StoreError:
                manifest = None
        if self.probe and manifest is not None and "probe" in manifest.extra:
            record.update(self._probe(manifest.extra["probe"]))
        with self._lock:
            self.served_version = version
            self.ready = True
            self.history.append(record)
            del self.history[:-200]
        log.info("weights v%d served (swap %.3fs%s)", version, record["swap_s"],
                 f", probe max diff {record['probe_max_diff']:.2e}"
                 if "probe_max_diff" in record else "")
        return True

    def _probe(self, probe: dict) -> dict:
        from asyncgrpo.adapters.probe import ProbeError, compare, served_prompt_logprobs

        try:
            served = served_prompt_logprobs(self.vllm.base_url, self.vllm.served_model(),
                                            probe["token_ids"])
            cmp = compare(served, probe["logprobs"])
            out = {"probe_max_diff": cmp.max_abs_diff, "probe_mean_diff": cmp.mean_abs_diff}
            if "next_logprob" in probe:
                served_next = self.vllm.next_logprob(self.vllm.served_model(), probe["token_ids"])
                out["probe_cached_diff"] = abs(served_next - float(probe["next_logprob"]))
        except (ProbeError, SwapFailed, OSError, KeyError, ValueError, TypeError) as err:
            return {"probe_error": str(err)[:300]}
        return out

    # -- loop and status ---------------------------------------------------------------------

    def status(self) -> dict:
        with self._lock:
            return {"ready": self.ready, "served_version": self.served_version,
                    "swapping": self.swapping,
                    "local_version": self.local_version, "latest_seen": self.latest_seen,
                    "refused": {str(k): v for k, v in sorted(self.refused.items())},
                    "errors": self.errors, "history": list(self.history)}

    def run(self) -> None:
        """Rounds until :meth:`stop`; waits for vLLM to answer first."""
        while not self._stop.is_set() and not self.vllm.healthy():
            self._stop.wait(1.0)
        # Before any catching up (an anchor's download may take minutes at 30B): requests to
        # this replica must not stay frozen by a predecessor killed mid-swap. What it serves
        # until the next swap is labelled by the last /update_weight_version, an older or equal
        # version: staleness is overestimated, never under.
        try:
            if self.vllm.resume_if_paused():
                log.warning("weights: vLLM was left paused (a puller stopped mid-swap): resumed")
        except (SwapFailed, OSError) as err:
            self.errors += 1
            log.warning("weights: could not check vLLM's pause state: %s", err)
        while not self._stop.is_set():
            try:
                changed = self.round()
            except Exception:  # the puller must outlive any one bad round
                self.errors += 1
                log.exception("weights: round failed")
                changed = False
            if not changed:
                self._stop.wait(self.poll_s)

    def stop(self) -> None:
        self._stop.set()

    def serve_status(self, host: str, port: int) -> ThreadingHTTPServer:
        """``/ready`` (200 once caught up after start, for the pod's readiness probe) and
        ``/status`` (JSON) on a thread."""
        puller = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/ready":
                    code, body = (200, b"ready\n") if puller.ready else (503, b"catching up\n")
                    ctype = "text/plain"
                elif self.path == "/status":
                    code, body = 200, json.dumps(puller.status()).encode()
                    ctype = "application/json"
                else:
                    code, body, ctype = 404, b"not found\n", "text/plain"
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer((host, port), Handler)
        threading.Thread(target=server.serve_forever, daemon=True, name="puller-status").start()
        return server
