"""Who may stop the sandbox server: its stop signals are read with their sender, and a
command's are ignored.

A command in the non-root mode pods use runs under the server's own uid, so the kernel lets
it signal the server. `kill -TERM 1` then started uvicorn's graceful shutdown: the listener
closed while the attacker's exec kept the server alive, and a process the command had left
behind (`setsid`) bound the port and answered as the sandbox. So:

- SIGTERM and SIGINT are blocked in every thread of the server (the mask is set before any
  thread starts) and read by one thread with `sigwaitinfo`, which tells the sender's pid;
  commands get them unblocked again by their launcher (`process.launch_argv`);
- PID 1 of its PID namespace (a pod; `unshare --pid --fork` here): a signal from outside the
  namespace (the kubelet, the container runtime) or from the kernel has sender pid 0, and
  every process that can see the server is inside the pod, i.e. the server or a command. So
  only pid 0 stops it. SIGKILL and SIGSTOP from inside the namespace are never delivered
  to its init (pid_namespaces(7)): a command cannot stop a PID-1 server at all;
- otherwise (a local process): a signal from one of the server's descendants, or from a
  process of the command uid, is ignored. This is the best a server without a uid of its
  own can do: a command of the same uid can still SIGKILL or SIGSTOP it, and a sender that
  exited before it was looked at counts as outside. Full protection needs the server as
  PID 1 (a pod) or commands under another uid (root mode).

A trusted stop runs `on_stop` in the event loop: the server kills every command before it
closes its listener (`SandboxServer.stop`), so no process of the sandbox outlives it to
take its port.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

from asyncgrpo.sandbox.server.process import STOP_SIGNALS, descendants

log = logging.getLogger("asyncgrpo.sandbox.server.stopping")


def _ignore_in_handler(signum, _frame) -> None:
    # Only reached if a thread had the signal unblocked, which the server never does; a
    # handler must exist at all so that PID 1 of a namespace receives the signal (the
    # kernel drops signals its init leaves at SIG_DFL).
    log.warning("stop signal %d reached a handler (sender unknown): ignored", signum)


class StopSignals:
    """Reads SIGTERM/SIGINT with their sender; calls `on_stop(signum)` for trusted ones only."""

    def __init__(self, on_stop: Callable[[int], None], command_uid: int | None = None):
        self.on_stop = on_stop
        self.command_uid = command_uid
        self.pid1 = os.getpid() == 1
        self.ignored = 0

    def install(self) -> None:
        """Call in the main thread before any other thread starts (they inherit the mask)."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, _ignore_in_handler)
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        threading.Thread(target=self._wait, name="stop-signals", daemon=True).start()

    def trusted(self, sender_pid: int, sender_uid: int) -> bool:
        if sender_pid == 0:
            return True  # from outside our PID namespace, or the kernel (a terminal's ^C)
        if self.pid1:
            return False  # inside the pod's namespace: the server itself or a command
        if sender_pid == os.getpid():
            return True
        if self.command_uid is not None and sender_uid == self.command_uid:
            return False
        return sender_pid not in descendants(os.getpid())

    def _wait(self) -> None:
        while True:
            info = signal.sigwaitinfo(STOP_SIGNALS)
            if self.trusted(info.si_pid, info.si_uid):
                log.warning("signal %d from pid %d: stopping (commands first)", info.si_signo, info.si_pid)
                self.on_stop(info.si_signo)
            else:
                self.ignored += 1
                log.warning("signal %d from pid %d (a command of this sandbox): ignored",
                            info.si_signo, info.si_pid)
