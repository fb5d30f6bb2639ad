"""The operator in a background thread of this process: for tests, benchmarks, and each
leadership term of `asyncgrpo operator --leader-election`.

Same handlers and settings as `asyncgrpo operator`, with a stop flag instead of signals,
so a test can start it, restart it mid-run, or run several side by side; a leader starts a
fresh one (fresh Runtime: indexes and expectations rebuilt from a full list) per term.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Self

from asyncgrpo.controller.metrics import OperatorMetrics
from asyncgrpo.controller.runtime import Runtime, Settings


class EmbeddedOperator:
    def __init__(self, namespaces: list[str] | None = None, settings: Settings | None = None,
                 metrics: OperatorMetrics | None = None, fence: Any = None,
                 controller: bool = True, liveness_endpoint: str | None = None):
        self.runtime = Runtime(settings or Settings(), fence=fence)
        if metrics is not None:
            self.runtime.metrics = metrics    # one Prometheus registry across terms
        self.namespaces = namespaces
        self.controller = controller
        self.liveness_endpoint = liveness_endpoint
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def _main(self) -> None:
        import kopf

        from asyncgrpo.controller import handlers

        try:
            asyncio.run(kopf.operator(
                registry=handlers.registry(self.runtime.settings, controller=self.controller),
                settings=handlers.kopf_settings(self.runtime.settings),
                clusterwide=not self.namespaces,
                namespaces=self.namespaces or (),
                standalone=True,
                liveness_endpoint=self.liveness_endpoint,
                stop_flag=self._stop,
                ready_flag=self._ready,
                memo=kopf.Memo(runtime=self.runtime),
            ))
        except BaseException as e:  # noqa: BLE001 (kept, raised again by stop())
            self.error = e

    def start(self, timeout: float = 60.0) -> Self:
        self._thread = threading.Thread(target=self._main, name="asyncgrpo-operator",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"operator not ready after {timeout}s: {self.error!r}")
        return self

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.error is not None and not isinstance(self.error, asyncio.CancelledError):
            raise self.error

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
