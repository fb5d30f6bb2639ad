"""`asyncgrpo weights pull`: the puller sidecar of a vLLM pod (full fine-tuning)."""

from __future__ import annotations

import argparse
import logging
import os
import signal

from asyncgrpo import wire


def register(subparsers) -> None:
    p = subparsers.add_parser("weights", help="full fine-tuning weights (the vLLM-side puller)")
    wsub = p.add_subparsers(dest="weights_command", required=True)
    pull = wsub.add_parser(
        "pull", help="keep the vLLM server beside this process on the newest weights version",
        description="Follows <run folder>/weights/ in the run's bucket (ASYNCGRPO_ADAPTER_* "
        "variables, as for the LoRA resolver), applies each version to a local full copy and "
        "swaps it into the vLLM server (dev-mode routes, loopback). See docs/weights.md.")
    env = os.environ.get
    pull.add_argument("--vllm-url", default=env(wire.WEIGHTS_VLLM_URL_ENV,
                                                f"http://127.0.0.1:{wire.VLLM_PORT}"))
    pull.add_argument("--work-dir", default=env(wire.WEIGHTS_DIR_ENV, wire.WEIGHTS_DIR),
                      help="local full copy (give it an emptyDir sized for two full copies)")
    # every interface in a pod; the local backend's pod address (BIND_HOST_ENV) on one machine
    pull.add_argument("--host", default=env(wire.WEIGHTS_HOST_ENV)
                      or env(wire.BIND_HOST_ENV) or "0.0.0.0")
    # /ready and /status: the vLLM pod's readiness probe asks it
    pull.add_argument("--port", type=int, default=int(env(wire.WEIGHTS_PORT_ENV, wire.PULLER_PORT)))
    pull.add_argument("--poll-seconds", type=float, default=float(env(wire.WEIGHTS_POLL_ENV, "2")))
    pull.add_argument("--download-concurrency", type=int,
                      default=int(env(wire.WEIGHTS_DOWNLOAD_CONCURRENCY_ENV, "0")) or None,
                      help="files of one version fetched at once (a sharded version's rank "
                      "files), default 8")
    pull.set_defaults(func=_pull)


def _pull(args: argparse.Namespace) -> int:
    from asyncgrpo.weights.puller import Puller, VLLMControl
    from asyncgrpo.weights.store import WeightStore

    logging.basicConfig(level=os.environ.get(wire.LOG_LEVEL_ENV, "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    store = WeightStore.from_env(**({"download_concurrency": args.download_concurrency}
                                    if args.download_concurrency else {}))
    puller = Puller(store, VLLMControl(args.vllm_url), args.work_dir,
                    poll_s=args.poll_seconds)
    server = puller.serve_status(args.host, args.port)
    signal.signal(signal.SIGTERM, lambda *_: puller.stop())
    try:
        puller.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
    return 0
