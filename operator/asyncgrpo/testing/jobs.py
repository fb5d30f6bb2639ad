"""A kubelet for the bucket Jobs' pods on the test cluster (which has no node).

The test cluster runs the real Job controller: it creates the pod of each bucket Job and sets
the Job's Complete or Failed condition from the pod's phase. Nothing runs the pod, so this
does, as a kubelet would: it resolves the container's env (values, and `secretKeyRef` read
from the API server with the test's admin client; a missing Secret or key becomes the
kubelet's CreateContainerConfigError), runs the container's command (`asyncgrpo bucket ...`)
as a local process with only that env, and writes the pod's status: phase, exit code and the
termination message the command wrote.

The process gets no credentials of this machine: without the Secret's keys it has only
boto3's chain, which here finds nothing (no ~/.aws, instance metadata disabled), as a pod
whose ServiceAccount has no cloud identity.
"""

from __future__ import annotations

import base64
import os
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from asyncgrpo import wire
from asyncgrpo.controller.bucketjob import CLEANUP, SETUP
from asyncgrpo.controller.kube import path, request
from asyncgrpo.controller.preflightjob import COMPONENT as PREFLIGHT

SELECTOR = f"app.kubernetes.io/component in ({SETUP},{CLEANUP},{PREFLIGHT})"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class BucketJobKubelet:
    """Runs every bucket Job pod of the cluster, except in namespaces put on `hold`."""

    def __init__(self, api_client, interval: float = 0.3, workers: int = 4,
                 hub_cache: str | os.PathLike | None = None):
        self.api = api_client
        #: a hub cache (asyncgrpo.testing.hub) the preflight pods see the hub through
        self.hub_cache = hub_cache
        self.interval = interval
        self.held: set[str] = set()
        self.ran: list[tuple[str, str, int, str]] = []   # (namespace, pod, exit, message)
        self._seen: set[str] = set()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="job-kubelet")
        self._thread = threading.Thread(target=self._loop, daemon=True, name="job-kubelet")

    def start(self) -> BucketJobKubelet:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def hold(self, namespace: str) -> None:
        """Never run a pod of `namespace` (as if no node would take it)."""
        self.held.add(namespace)

    # ------------------------------------------------------------------ loop

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                pods = request(self.api, "GET", "/api/v1/pods",
                               query=[("labelSelector", SELECTOR)])["items"]
            except Exception:  # noqa: BLE001, S112 - the API server restarting: try again
                continue
            for pod in pods:
                meta = pod["metadata"]
                if meta["uid"] in self._seen or meta.get("deletionTimestamp") \
                        or meta["namespace"] in self.held \
                        or (pod.get("status") or {}).get("phase", "Pending") != "Pending":
                    continue
                self._seen.add(meta["uid"])
                self._pool.submit(self._run, pod)

    def _secret_value(self, ns: str, ref: dict[str, Any]) -> str:
        from kubernetes.client.exceptions import ApiException

        try:
            secret = request(self.api, "GET", path("Secret", ns, ref["name"]))
        except ApiException as e:
            if e.status == 404:
                raise LookupError(f'secret "{ref["name"]}" not found') from None
            raise
        data = secret.get("data") or {}
        if ref["key"] not in data:
            raise LookupError(f"couldn't find key {ref['key']} in Secret {ns}/{ref['name']}")
        # the bytes as they are, as a kubelet passes them (non-UTF-8 stays non-UTF-8)
        return base64.b64decode(data[ref["key"]]).decode("utf-8", "surrogateescape")

    def _config_maps(self, ns: str, pod: dict[str, Any], container: dict[str, Any],
                     root: str) -> dict[str, str]:
        """Mount path -> local folder for each ConfigMap volume of the container, its keys
        written there as files (the preflight Job reads the run file and the data so)."""
        volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
        out = {}
        for m in container.get("volumeMounts") or []:
            cm = (volumes.get(m["name"]) or {}).get("configMap")
            if cm is None:
                continue
            data = request(self.api, "GET", path("ConfigMap", ns, cm["name"])).get("data") or {}
            items = cm.get("items") or [{"key": k, "path": k} for k in data]
            folder = os.path.join(root, "mounts", m["name"])
            os.makedirs(folder, exist_ok=True)
            for item in items:
                Path(folder, item["path"]).write_text(data.get(item["key"], ""))
            out[m["mountPath"]] = folder
        return out

    def _run(self, pod: dict[str, Any]) -> None:
        import subprocess

        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        container = pod["spec"]["containers"][0]
        env: dict[str, str] = {}
        try:
            for e in container.get("env") or []:
                if "value" in e:
                    env[e["name"]] = e["value"]
                elif "secretKeyRef" in (e.get("valueFrom") or {}):
                    env[e["name"]] = self._secret_value(ns, e["valueFrom"]["secretKeyRef"])
        except LookupError as err:
            self._status(ns, name, container["name"], waiting=str(err))
            return
        with tempfile.TemporaryDirectory(prefix="job-kubelet-") as tmp:
            log = os.path.join(tmp, "termination-log")
            env.update({"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                        "PYTHONPATH": os.pathsep.join(sys.path),
                        "HOME": tmp, "AWS_EC2_METADATA_DISABLED": "true",
                        "AWS_CONFIG_FILE": os.devnull,
                        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                        wire.TERMINATION_LOG_ENV: log})
            if self.hub_cache is not None and env.get("HF_HOME", "").startswith(wire.CACHE_DIR):
                # the pod's cache volume, here a folder of its own; the hub (no network
                # here) is the seeded cache, as a cluster whose hub or model cache has them
                env.update({"HF_HOME": os.path.join(tmp, "hf"),
                            "HF_HUB_CACHE": str(self.hub_cache), "HF_HUB_OFFLINE": "1"})
            cmd = container["command"] + (container.get("args") or [])
            assert cmd[0] == "asyncgrpo", cmd   # the image's entry point
            mounts = self._config_maps(ns, pod, container, tmp)
            for mount, folder in sorted(mounts.items(), key=lambda m: -len(m[0])):
                cmd = [folder + a[len(mount):] if a.startswith(mount + "/") else a for a in cmd]
            started = _now()
            try:
                proc = subprocess.run([sys.executable, "-m", "asyncgrpo.cli", *cmd[1:]],
                                      env=env, capture_output=True, timeout=120, check=False)
                code = proc.returncode
            except subprocess.TimeoutExpired:
                code = 137
            message = Path(log).read_text() if os.path.exists(log) else ""
        self.ran.append((ns, name, code, message))
        self._status(ns, name, container["name"], exit_code=code, message=message,
                     started=started)

    def _status(self, ns: str, name: str, container: str, *, waiting: str | None = None,
                exit_code: int = 0, message: str = "", started: str = "") -> None:
        if waiting is not None:
            state = {"waiting": {"reason": "CreateContainerConfigError", "message": waiting}}
            phase = "Pending"
        else:
            state = {"terminated": {"exitCode": exit_code, "message": message,
                                    "reason": "Completed" if exit_code == 0 else "Error",
                                    "startedAt": started, "finishedAt": _now()}}
            phase = "Succeeded" if exit_code == 0 else "Failed"
        body = {"status": {"phase": phase, "startTime": started or _now(),
                           "containerStatuses": [{"name": container, "ready": False,
                                                  "restartCount": 0, "image": "x",
                                                  "imageID": "", "state": state}]}}
        try:
            request(self.api, "PATCH", path("Pod", ns, name) + "/status", body,
                    "application/merge-patch+json")
        except Exception:  # noqa: BLE001, S110 - the pod went with its Job
            pass
