"""Where the gateway learns which sandboxes exist: a fixed list, a file, or a watch on pods.

On Kubernetes the gateway lists and then watches the run's sandbox pods by label selector
in one namespace (RBAC: get/list/watch on pods there, nothing else), so the API server is
asked once per pod change, never per exec. A pod is a member once it is Running with an
IP and not being deleted; readiness is the gateway's own health check, not the kubelet's,
because a sandbox must also pass a reset before it is handed out. The watch resumes from
its last resourceVersion and lists again when the server says that version is gone (410).

Locally (`asyncgrpo local run`) the backend's sandbox pool (`asyncgrpo.local.sandbox_pool`)
plays the operator's part: it starts sandbox server processes and keeps their list in a
file, replaced atomically on each change; `FileMembers` follows that file as the pod watch
follows pods, so retired members are removed and their replacements added.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from urllib.parse import urlparse

from asyncgrpo.wire import DEFAULT_SANDBOX_IMAGE_KEY, SANDBOX_IMAGE_LABEL

log = logging.getLogger("asyncgrpo.sandbox.gateway.members")

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def _check_url(u: str) -> str:
    if urlparse(u).scheme not in ("http", "https") or not urlparse(u).netloc:
        raise ValueError(f"not a sandbox base URL: {u!r}")
    return u


class StaticMembers:
    """A fixed list of sandbox base URLs (`--members`); the name of each is its host:port.

    Nothing replaces a member of a fixed list, so the gateway runs such a pool `reuse`."""

    replaces_members = False

    def __init__(self, urls: Iterable[str]):
        self.urls = [_check_url(u.strip().rstrip("/")) for u in urls if u.strip()]

    async def run(self, pool) -> None:
        for u in self.urls:
            pool.upsert(urlparse(u).netloc, u)


class FileMembers:
    """Members from a JSON file `{name: base URL}` that another process keeps (the local
    backend's pool), read again whenever it changes (checked every `interval` seconds). A
    member may also be `{"url": URL, "image": key}`: a sandbox of a row's image (its
    `wire.sandbox_image_key`), as a pod's label says it.

    A name that leaves the file is removed (its lease, if any, ends `sandbox_lost`), a new
    one added; the writer replaces retired members, so lifecycle `fresh` works. A missing
    file is an empty pool; an unreadable one is logged and the members are kept as they are.
    """

    replaces_members = True

    def __init__(self, path: str, interval: float = 0.1):
        self.path = path
        self.interval = interval

    def read(self) -> dict[str, tuple[str, str]]:
        """{name: (base URL, image key)}."""
        try:
            with open(self.path) as f:
                doc = json.load(f)
        except FileNotFoundError:
            return {}
        if not isinstance(doc, dict):
            raise ValueError(f"{self.path}: not a JSON object of member name -> URL")  # noqa: TRY004
        out = {}
        for name, value in doc.items():
            url, image = value, DEFAULT_SANDBOX_IMAGE_KEY
            if isinstance(value, dict):
                url, image = value.get("url", ""), str(value.get("image") or image)
            out[str(name)] = (_check_url(str(url).strip().rstrip("/")), image)
        return out

    async def run(self, pool) -> None:
        seen = None
        while True:
            try:
                st = os.stat(self.path)
                key = (st.st_ino, st.st_mtime_ns, st.st_size)
            except FileNotFoundError:
                key = None
            if key != seen:
                try:
                    members = self.read()
                except (OSError, ValueError) as err:
                    log.warning("members file %s unreadable: %s; members kept", self.path, err)
                else:
                    seen = key
                    for name in [n for n in pool.members if n not in members]:
                        pool.remove(name)
                    for name, (url, image) in members.items():
                        m = pool.members.get(name)
                        if m is None or m.url != url or m.image != image:
                            pool.upsert(name, url, image)
            await asyncio.sleep(self.interval)


def pod_member(pod, port: int) -> tuple[str, str | None]:
    """(pod name, base URL) or (name, None) when the pod cannot serve (yet or any more)."""
    name = pod.metadata.name
    if pod.metadata.deletion_timestamp is not None:
        return name, None
    status = pod.status
    if status is None or status.phase != "Running" or not status.pod_ip:
        return name, None
    host = f"[{status.pod_ip}]" if ":" in status.pod_ip else status.pod_ip
    return name, f"http://{host}:{port}"


def pod_image_key(pod) -> str:
    """The key of the image the pod runs (its `asyncgrpo.dev/sandbox-image` label, set by the
    operator); a pod without one runs the run's own image."""
    labels = pod.metadata.labels or {}
    return labels.get(SANDBOX_IMAGE_LABEL) or DEFAULT_SANDBOX_IMAGE_KEY


class KubernetesPodWatch:
    """Members from the pods matching `selector` in `namespace` (a list, then a watch).

    The operator deletes retired pods and creates new ones, so lifecycle `fresh` works."""

    replaces_members = True

    def __init__(self, namespace: str, selector: str, port: int):
        if not selector:
            raise ValueError("a label selector is required to find the run's sandbox pods")
        self.namespace = namespace
        self.selector = selector
        self.port = port
        self._stop = threading.Event()

    def _api(self):
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return client.CoreV1Api()

    async def run(self, pool) -> None:
        loop = asyncio.get_running_loop()

        def apply(kind: str, pod) -> None:
            name, url = pod_member(pod, self.port)
            if kind == "DELETED" or url is None:
                pool.remove(name)
            else:
                pool.upsert(name, url, pod_image_key(pod))

        def resync(names: set[str]) -> None:
            for name in [n for n in pool.members if n not in names]:
                pool.remove(name)

        thread = threading.Thread(target=self._watch, args=(loop, apply, resync), daemon=True,
                                  name="sandbox-pod-watch")
        thread.start()
        try:
            while thread.is_alive():
                await asyncio.sleep(1.0)
        finally:
            self._stop.set()

    def _watch(self, loop, apply, resync) -> None:
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        api = None
        version = None
        while not self._stop.is_set():
            try:
                api = api or self._api()
                if version is None:
                    pods = api.list_namespaced_pod(self.namespace, label_selector=self.selector)
                    names = {p.metadata.name for p in pods.items}
                    loop.call_soon_threadsafe(resync, names)
                    for p in pods.items:
                        loop.call_soon_threadsafe(apply, "ADDED", p)
                    version = pods.metadata.resource_version
                w = watch.Watch()
                for event in w.stream(
                    api.list_namespaced_pod, self.namespace, label_selector=self.selector,
                    resource_version=version, timeout_seconds=300, allow_watch_bookmarks=True,
                ):
                    if self._stop.is_set():
                        w.stop()
                        return
                    obj = event["object"]
                    version = obj.metadata.resource_version or version
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        loop.call_soon_threadsafe(apply, event["type"], obj)
            except ApiException as err:
                if err.status == 410:  # our resourceVersion is too old: list again
                    version = None
                    continue
                log.warning("pod watch failed (%s); retrying", err.status)
                time.sleep(2.0)
            except Exception as err:  # noqa: BLE001 - API server restart, network blip: back off, resume
                log.warning("pod watch error: %s; retrying", err)
                time.sleep(2.0)


def member_source_from_args(args):
    if getattr(args, "members_file", None):
        return FileMembers(args.members_file)
    if args.members:
        try:
            return StaticMembers(args.members.split(","))
        except ValueError as err:
            raise SystemExit(f"gateway: --members: {err}") from err
    namespace = args.namespace
    if not namespace and os.path.exists(SERVICE_ACCOUNT_NAMESPACE):
        with open(SERVICE_ACCOUNT_NAMESPACE) as f:
            namespace = f.read().strip()
    if not namespace or not args.selector:
        raise SystemExit(
            "gateway: give --members URL,... or --members-file PATH (local) or --selector "
            "(and --namespace outside a pod)"
        )
    return KubernetesPodWatch(namespace, args.selector, args.sandbox_port)
