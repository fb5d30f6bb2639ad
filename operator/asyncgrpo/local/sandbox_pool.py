"""The local backend's sandbox pool: the operator's part of `spec.sandboxes` on one machine.

On a cluster the operator creates sandbox pods, the gateway watches them, and the operator
deletes the ones the gateway reports `retired` (lifecycle FreshPerGroup: the pod served its
one group) or `unhealthy`, and creates replacements, sized by the gateway's demand signal
(`asyncgrpo.controller.sandbox_scaling`). Locally `LocalSandboxPool` does the same with processes:

- each sandbox pod is built by the operator's builder (`controller.sandboxes.build_pod`,
  named `<run>-sandbox-local<n>`, never a name twice) and translated like every other pod
  (`asyncgrpo.local.pods`), with a loopback address and volume directories of its own;
- the gateway follows the pool's members file (`placement.members_file`, a JSON object
  pod name -> URL, replaced atomically; `--members-file`, `sandbox.gateway.members.FileMembers`) as
  a cluster gateway follows its pod watch;
- every `POLL_SECONDS` the pool reads the gateway's `/v1/demand` (the open route the
  operator reads): a member in `REPLACED_STATES` (retired, unhealthy) or whose process
  exited is discarded, its process group stopped, its directories (workspace, /tmp) deleted,
  and its name dropped from the file; then the pool grows to the sandbox sizing rule's target
  (`sizing.desired_pool_size`: busy + waiting + warm, the warm count `refill_warm` of
  `max(1, minWarm)` and what groups consume over `REFILL_HORIZON_SECONDS`),
  capped at `min(max, hardCap)` (at least one). A new process is a member at once; the
  gateway health-checks and resets it before any group gets it, as it does a new pod.

So with FreshPerGroup no group's lease ever reaches a process, a workspace or a /tmp another
group used; with Reuse the gateway resets its members between groups and the pool only
replaces the ones that fail. The pool never shrinks during a run (a cluster drains idle
pods after `idleTtlSeconds`); its processes end with the run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from asyncgrpo import wire
from asyncgrpo.api import AsyncGRPORun
from asyncgrpo.controller import sandboxes
from asyncgrpo.controller.sandbox_scaling import REPLACED_STATES, Demand, refill_warm
from asyncgrpo.local.placement import (
    Pod,
    add_pod,
    drop_pod,
    members_file,
    named_port,
)
from asyncgrpo.local.pods import LocalPlacement, LocalProcess, translate_pod
from asyncgrpo.local.processes import ManagedProcess
from asyncgrpo.sandbox.gateway.pool import BUSY, RETIRED, WARM
from asyncgrpo.sandbox.operator.sizing import desired_pool_size

log = logging.getLogger("asyncgrpo.local.sandbox_pool")

#: how often the pool reads the gateway's demand (the operator: every resync, 10 s)
POLL_SECONDS = 0.25
#: seconds between a sandbox being consumed and its replacement serving locally: a poll, a
#: server process start (1-3 s on a loaded 2-core machine), the gateway's startup probe
#: (0.25 s) and a reset; the warm count covers this much consumption
REFILL_HORIZON_SECONDS = 5.0
#: a discarded sandbox server gets this long to stop after SIGTERM (it kills its commands)
STOP_SECONDS = 5.0
#: after a sandbox process exits before it ever served, creations pause this long, doubled
#: per such exit in a row (a broken image or flag must not become a start/exit loop)
FAILURE_BACKOFF_SECONDS = (0.5, 30.0)


@dataclass
class _Sandbox:
    pod: Pod
    url: str
    process: LocalProcess
    proc: ManagedProcess
    served: bool = False  # the gateway listed it warm or busy once


class LocalSandboxPool:
    """The run's sandbox processes and the members file the gateway follows.

    `start()` starts the first pods (the ones `placement.run_pods` built) and waits for
    their readiness probes; `follow(gateway_url)` starts the thread that keeps the pool;
    `stop()` ends the thread and every sandbox process. `tick(demand)` is one round of it."""

    def __init__(self, run: AsyncGRPORun, placement: LocalPlacement, workdir: Path,
                 pods: list[Pod], say: Callable[[str], None] = print):
        sb = run.spec.sandboxes
        if sb is None:
            raise ValueError("the run has no spec.sandboxes")
        self.run = run
        self.placement = placement
        self.workdir = workdir
        self.say = say
        self.lifecycle = sb.lifecycle
        self.warm = max(1, sb.min_warm)
        self.cap = max(1, min(sb.max, sb.hard_cap))
        self.members_file = members_file(workdir)
        self.sandboxes: dict[str, _Sandbox] = {}
        #: sandboxes discarded, stopped and deleted so far, and how many the pool started
        self.discarded = 0
        self.created = 0
        self._first = list(pods)
        self._ordinal = len(pods)
        self._last_address: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._demand_url: str | None = None
        self._failures = 0          # sandbox processes in a row that exited before serving
        self._cleaner = ThreadPoolExecutor(max_workers=4, thread_name_prefix="sandbox-cleanup")
        self._hold_until = 0.0      # no creation before this (time.monotonic)

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        """The first sandbox pods, each until its readiness probe answers, then the file."""
        from asyncgrpo.local.backend import wait_ready  # the backend imports this module

        with self._lock:
            for pod in self._first:
                self._start(pod)
            self._write()
        for box in list(self.sandboxes.values()):
            if box.process.ready_url:
                wait_ready(box.proc, box.process.ready_url, box.process.ready_timeout_s)

    def follow(self, gateway_url: str) -> None:
        """Keep the pool from the gateway's demand (`gateway_url`: its base URL)."""
        self._demand_url = gateway_url.rstrip("/") + wire.GATEWAY_DEMAND_PATH
        self._thread = threading.Thread(target=self._loop, daemon=True, name="sandbox-pool")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._lock:
            boxes = list(self.sandboxes.values())
        for box in boxes:  # side by side: each server kills its commands, then exits
            self._cleaner.submit(box.proc.stop, STOP_SECONDS)
        self._cleaner.shutdown(wait=True)  # and the discarded ones stopped and deleted

    def _loop(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            try:
                self.tick(self.demand())
            except Exception as err:  # noqa: BLE001 - a failed round is retried at the next
                log.warning("sandbox pool round failed: %s", err)

    def demand(self) -> Demand | None:
        """The gateway's demand signal; None while it does not answer."""
        try:
            with urllib.request.urlopen(self._demand_url, timeout=2) as resp:
                return Demand.from_json(json.loads(resp.read()))
        except (OSError, ValueError):
            return None

    # ------------------------------------------------------------------ one round
    def tick(self, demand: Demand | None) -> None:
        """Discard the members the gateway is done with (or whose process exited), then grow
        to the sizing rule's target; rewrite the members file if anything changed."""
        with self._lock:
            if self._stop.is_set():
                return
            members = demand.members if demand is not None else {}
            changed = False
            for name, box in list(self.sandboxes.items()):
                state = members.get(name)
                if state in (WARM, BUSY):
                    box.served, self._failures = True, 0
                if state in REPLACED_STATES or not box.proc.running:
                    if not box.proc.running and not box.served:
                        self._failed(box)
                    self._discard(name, keep_log=state != RETIRED)
                    changed = True
            current = len(self.sandboxes)
            if demand is None:
                target = max(current, min(self.warm, self.cap))
            else:
                unknown = sum(1 for n in self.sandboxes if n not in members)
                target = desired_pool_size(
                    current=current, busy=min(demand.busy, current), waiting=demand.waiting,
                    starting=min(demand.starting + unknown, current),
                    min_warm=refill_warm(self.warm, demand.consumption_per_second,
                                         REFILL_HORIZON_SECONDS),
                    max_size=self.cap, hard_cap=self.cap, max_step=self.cap)
            if time.monotonic() < self._hold_until:
                target = current
            for _ in range(target - current):
                self._create()
                changed = True
            if changed:
                self._write()

    def _failed(self, box: _Sandbox) -> None:
        self._failures += 1
        first, most = FAILURE_BACKOFF_SECONDS
        pause = min(most, first * 2 ** (self._failures - 1))
        self._hold_until = time.monotonic() + pause
        self.say(f"sandbox {box.pod.name} exited with {box.proc.proc.returncode} before it "
                 f"served (see {box.proc.log_path}); next sandbox in {pause:g} s")

    def _create(self) -> None:
        built = sandboxes.build_pod(self.run, f"local{self._ordinal}")
        self._ordinal += 1
        pod = Pod(built["metadata"]["name"], sandboxes.COMPONENT, built["metadata"]["labels"],
                  built["spec"])
        self.placement = add_pod(self.placement, self.run, pod, self.workdir,
                                 after=self._last_address)
        self._last_address = self.placement.addresses[pod.name]
        self._start(pod)

    def _start(self, pod: Pod) -> None:
        """Start the pod's process (not waiting for it: the gateway health-checks members)."""
        from asyncgrpo.local.backend import start_process

        (lp,) = translate_pod(pod.name, pod.spec, self.placement)
        proc = start_process(lp, self.workdir, started=[], wait=False)
        url = (f"http://{self.placement.addresses[pod.name]}:"
               f"{named_port(pod, 'http', self.placement.ports)}")
        self.sandboxes[pod.name] = _Sandbox(pod, url, lp, proc)
        self.created += 1

    def _discard(self, name: str, keep_log: bool) -> None:
        """Out of the pool now; its process group stopped and its pod's directories (its
        workspace and /tmp emptyDirs) deleted in the background, so a round never waits for a
        server to exit; its log deleted too, unless it failed (kept for a look)."""
        box = self.sandboxes.pop(name)
        self.placement = drop_pod(self.placement, name)
        self._cleaner.submit(self._clean, box, keep_log)

    def _clean(self, box: _Sandbox, keep_log: bool) -> None:
        box.proc.stop(timeout=STOP_SECONDS)
        shutil.rmtree(self.workdir / box.pod.name, ignore_errors=True)
        if not keep_log:
            box.proc.log_path.unlink(missing_ok=True)
        with self._lock:
            self.discarded += 1

    def _write(self) -> None:
        doc = {name: box.url for name, box in self.sandboxes.items()}
        tmp = self.members_file.with_name(self.members_file.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, self.members_file)  # the gateway never reads half a file

    # ------------------------------------------------------------------ views
    def pid(self, name: str) -> int | None:
        """The server process of the sandbox pod `name`, while the pool has it."""
        with self._lock:
            box = self.sandboxes.get(name)
            return box.proc.proc.pid if box is not None else None

    def members(self) -> dict[str, str]:
        with self._lock:
            return {name: box.url for name, box in self.sandboxes.items()}


def start_sandbox_part(run: AsyncGRPORun, pods: list[Pod], procs: dict[str, list[LocalProcess]],
                       placement: LocalPlacement, workdir: Path, *, started: list,
                       say: Callable[[str], None] = print) -> tuple[LocalSandboxPool, LocalProcess]:
    """What `asyncgrpo local run` starts for `spec.sandboxes`: the pool's first sandbox pods
    (until ready), then the gateway pod (until ready), then the pool following the gateway.
    `pods`/`procs`: the run's pods and their translation; both parts are added to `started`
    (what the caller stops, the gateway before the pool). Returns the pool and the gateway."""
    from asyncgrpo.controller import gateway
    from asyncgrpo.local.backend import start_process

    pool = LocalSandboxPool(run, placement, workdir,
                            [p for p in pods if p.component == sandboxes.COMPONENT], say=say)
    started.append(pool)
    pool.start()
    (gw_pod,) = [p for p in pods if p.component == gateway.COMPONENT]
    (gw,) = procs[gw_pod.name]
    start_process(gw, workdir, started=started, wait=True)
    pool.follow(gw.ready_url.rsplit("/", 1)[0])
    return pool, gw
