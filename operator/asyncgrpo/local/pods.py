"""The one translation of the operator's pods into local processes (no containers, no root).

`asyncgrpo local run` does not know how to start a trainer, vLLM or a sandbox: it asks the
operator's builders (`asyncgrpo.controller`) for the pods of the run, exactly as on a
cluster, and `translate` turns one container of one pod into (argv, env, cwd) with the
help of a `LocalPlacement`: plain data that says what a kubelet, the images, cluster DNS
and the Secrets would have provided. Everything that differs between a cluster and this
machine is in that object; the rules below are the only code, and docs/local.md lists them.

Rules, applied to the container's command + args and to every env value:

* image -> runtime: the image's ENV (parsed from images/<x>/Dockerfile) comes first, then
  the placement's ambient env (what a node gives every pod: S3 credentials, PATH), then
  the container's env; `command[0]` is found on PATH, whose head is the image's bin dirs
  (the project venv for the trainer and sandbox images, the vLLM venv for vLLM).
* mountPath -> local directory: a path equal to or under a volume mount is rewritten by
  prefix to the directory the placement gives that volume (ConfigMap contents written
  there, emptyDirs fresh). Other image paths are left as they are, and so are the
  placement's host paths: the run's own local files (a model under /tmp is the machine's,
  not the pod's /tmp emptyDir), visible to every process as a hostPath volume would be.
* Service / pod DNS names -> the pod's loopback address (127.x.y.z; any of them binds
  without configuration), `name:port` -> `address:local port`; `0.0.0.0` -> the pod's
  address, and ASYNCGRPO_BIND_HOST names it to servers that bind without a host flag.
  A pod's own loopback (`127.0.0.1`, `localhost`: how a sidecar reaches the container beside
  it) -> the pod's address too, except the placement's machine endpoints (a loopback S3
  endpoint is the machine's, reached as written).
* containers: every container of a pod is a process (`translate_pod`); they share the pod's
  address, its volumes' directories and its ports, as containers of a pod do.
* ports: a port is the same inside every pod unless the placement remaps it (a program
  that binds every interface, torch's TCPStore, shares the port space of the machine);
  numbers are rewritten only where they name a port: `host:PORT`, a variable whose name
  ends in `_PORT`, and the value of an argument `--...port`.
* valueFrom: secretKeyRef -> the placement's secrets; fieldRef -> pod name, namespace,
  pod address. HOSTNAME is the pod name (a kubelet sets it; dash does not).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from asyncgrpo.wire import BIND_HOST_ENV


class PodTranslationError(ValueError):
    """A pod uses something the placement cannot provide locally; the message says what."""


@dataclass(frozen=True)
class ImageRuntime:
    """What an image provides: programs (bin dirs searched first) and its ENV."""

    bin_dirs: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class LocalPlacement:
    """Everything local that a cluster would have provided, as data."""

    images: Mapping[str, ImageRuntime]              # image reference -> runtime
    addresses: Mapping[str, str]                    # pod name -> loopback address
    hosts: Mapping[str, str]                        # DNS name (Service, pod.service) -> pod name
    volumes: Mapping[str, Mapping[str, str]]        # pod name -> volume name -> local dir
    cwd: str                                        # where relative paths of the run resolve
    ports: Mapping[int, int] = field(default_factory=dict)  # container port -> local port
    secrets: Mapping[tuple[str, str], str] = field(default_factory=dict)  # (secret, key)
    env: Mapping[str, str] = field(default_factory=dict)  # ambient: under the pod's env
    overrides: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # pod -> env, last
    pythonpath: tuple[str, ...] = ()                # first on PYTHONPATH (this checkout)
    namespace: str = "default"
    cpus: Mapping[str, frozenset[int]] = field(default_factory=dict)  # pod -> cpus (pinning)
    host_paths: tuple[str, ...] = ()                # absolute paths never rewritten
    machine_endpoints: tuple[str, ...] = ()         # loopback `host[:port]`s never rewritten


@dataclass(frozen=True)
class LocalProcess:
    """One container as a process: what to exec, and where it answers its readiness probe.
    `container` is None for a pod's first container and the name of any other (a sidecar)."""

    pod: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    ready_url: str | None = None
    ready_timeout_s: float = 120.0
    cpus: frozenset[int] | None = None
    container: str | None = None

    @property
    def name(self) -> str:
        """`<pod>` for the first container, `<pod>.<container>` for a sidecar (log names)."""
        return self.pod if self.container is None else f"{self.pod}.{self.container}"


def parse_dockerfile_env(text: str) -> dict[str, str]:
    """The ENV of a Dockerfile's last stage (`ENV K=V ...` lines, continuations joined)."""
    text = text.replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if line.upper().startswith("FROM "):
            env = {}  # a new stage starts from its base's ENV, not the previous stage's
        elif line.upper().startswith("ENV "):
            for k, v in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=(\"[^\"]*\"|\S+)", line[4:]):
                env[k] = v.strip('"')
    return env


def _names_path(text: str, path: str) -> bool:
    """`text` starts with `path` or a path under it, up to a word's end (`/a/b:/c` names
    `/a/b`: PYTHONPATH's separator ends it)."""
    path = path.rstrip("/")
    rest = text[len(path):]
    return text.startswith(path) and (rest == "" or rest[0] in "/ \t\n\"':;,")


class _Rewriter:
    """The string rules of the module docstring for one pod, in one pass (a replacement is
    never scanned again, so a local path that happens to contain a Service name stays)."""

    def __init__(self, pod: str, container: dict, p: LocalPlacement):
        self.p = p
        self.address = p.addresses[pod]
        local_dirs = p.volumes.get(pod, {})
        self.mounts: dict[str, str] = {}
        for m in container.get("volumeMounts", []):
            if m["name"] not in local_dirs:
                raise PodTranslationError(f"pod {pod}: volume {m['name']!r} "
                                          f"({m['mountPath']}) has no local directory")
            self.mounts[m["mountPath"].rstrip("/") or "/"] = str(
                Path(local_dirs[m["name"]]) / m.get("subPath", ""))
        self.pattern = re.compile(
            rf"(?<![\w./-])(?P<mount>{_alternation(self.mounts)})(?=$|[/\s\"':;,])"
            rf"|(?<![\w.-])(?P<host>{_alternation(p.hosts)}|0\.0\.0\.0|{_OWN_LOOPBACK})"
            r"(?::(?P<port>\d+))?(?![\w.-])")

    def port(self, port: int | str) -> str:
        return str(self.p.ports.get(int(port), int(port)))

    def string(self, s: str) -> str:
        return self.pattern.sub(self._replace, s)

    def _replace(self, m: re.Match) -> str:
        if m["mount"] is not None:
            rest = m.string[m.start():]
            if any(_names_path(rest, h) for h in self.p.host_paths):
                return m[0]
            return self.mounts[m["mount"]]
        if m["host"] == "0.0.0.0":
            address = self.address
        elif re.fullmatch(_OWN_LOOPBACK, m["host"]):
            if m[0] in self.p.machine_endpoints:
                return m[0]
            address = self.address
        else:
            pod = self.p.hosts[m["host"]]
            if pod not in self.p.addresses:
                raise PodTranslationError(f"{m['host']} names pod {pod}, which has no "
                                          "local address")
            address = self.p.addresses[pod]
        return address + (f":{self.port(m['port'])}" if m["port"] else "")


#: a pod's own loopback names
_OWN_LOOPBACK = r"127\.0\.0\.1|localhost"
_PORT_FLAG = re.compile(r"^(--[\w-]*port)(=\"?)(\d+)(\"?)$")


def _alternation(names) -> str:
    # longest first: `run-trainer-0.run-trainer` before `run-trainer`; none: never matches
    return "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True)) or r"(?!)"


def _value_from(ref: dict, pod: str, address: str, p: LocalPlacement) -> str | None:
    if "secretKeyRef" in ref:
        s = ref["secretKeyRef"]
        value = p.secrets.get((s["name"], s["key"]))
        if value is None and not s.get("optional"):
            raise PodTranslationError(f"pod {pod}: no local value for key {s['key']!r} of "
                                      f"Secret {s['name']!r}")
        return value
    if "fieldRef" in ref:
        path = ref["fieldRef"]["fieldPath"]
        fields = {"metadata.name": pod, "metadata.namespace": p.namespace,
                  "status.podIP": address, "spec.nodeName": "localhost"}
        if path not in fields:
            raise PodTranslationError(f"pod {pod}: fieldRef {path} is not available locally")
        return fields[path]
    raise PodTranslationError(f"pod {pod}: valueFrom {sorted(ref)} is not available locally")


def translate_pod(pod: str, spec: dict, p: LocalPlacement) -> list[LocalProcess]:
    """Every container of the pod named `pod` (its `spec`), in order: the first is the pod's
    main process, the others its sidecars."""
    return [translate(pod, c, p, sidecar=i > 0) for i, c in enumerate(spec["containers"])]


def translate(pod: str, container: dict, p: LocalPlacement, *,
              sidecar: bool = False) -> LocalProcess:
    """The local process for `container` of the pod named `pod`. Pure: reads no file and
    starts nothing."""
    image = p.images.get(container["image"])
    if image is None:
        raise PodTranslationError(f"pod {pod}: no local runtime for image {container['image']}")
    if not container.get("command"):
        raise PodTranslationError(f"pod {pod}: container {container['name']} relies on its "
                                  "image's ENTRYPOINT; locally a command is needed")
    if pod not in p.addresses:
        raise PodTranslationError(f"pod {pod} has no local address")
    rw = _Rewriter(pod, container, p)

    # literal values are rewritten; values from Secrets and the ambient env are not
    env: dict[str, str] = {k: _port_env(k, rw.string(v), rw) for k, v in image.env.items()}
    env.update(p.env)
    for e in container.get("env", []):
        if "valueFrom" in e:
            value = _value_from(e["valueFrom"], pod, rw.address, p)
            if value is not None:
                env[e["name"]] = value
        else:
            env[e["name"]] = _port_env(e["name"], rw.string(e.get("value", "")), rw)
    env["HOSTNAME"] = pod
    env[BIND_HOST_ENV] = rw.address
    env["PATH"] = ":".join([*image.bin_dirs, *filter(None, [env.get("PATH")])])
    env["PYTHONPATH"] = ":".join([*p.pythonpath, *filter(None, [env.get("PYTHONPATH")])])
    env.update(p.overrides.get(pod, {}))

    argv = [*container["command"], *container.get("args", [])]
    out: list[str] = []
    for word in argv:
        if out and re.fullmatch(r"--[\w-]*port", out[-1]) and word.isdigit():
            out.append(rw.port(word))
            continue
        word = rw.string(word)
        m = _PORT_FLAG.match(word)
        out.append(f"{m[1]}{m[2]}{rw.port(m[3])}{m[4]}" if m else word)

    ready_url, timeout = _probe(container, rw)
    return LocalProcess(pod=pod, argv=out, env=env, cwd=p.cwd, ready_url=ready_url,
                        ready_timeout_s=timeout, cpus=p.cpus.get(pod),
                        container=container["name"] if sidecar else None)


def _port_env(name: str, value: str, rw: _Rewriter) -> str:
    return rw.port(value) if name.endswith("_PORT") and value.isdigit() else value


def _probe(container: dict, rw: _Rewriter) -> tuple[str | None, float]:
    """Readiness probe URL on the pod's address, and how long startup may take (the
    startup probe's budget when there is one)."""
    probe = container.get("readinessProbe") or container.get("startupProbe") or {}
    get = probe.get("httpGet")
    if not get:
        return None, 120.0
    port = get["port"]
    if isinstance(port, str) and not port.isdigit():
        named = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
        if port not in named:
            raise PodTranslationError(f"probe port {port!r} is not a port of the container")
        port = named[port]
    startup = container.get("startupProbe") or {}
    budget = (startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
              if startup else 120.0)
    return f"http://{rw.address}:{rw.port(port)}{get.get('path', '/')}", float(budget)
