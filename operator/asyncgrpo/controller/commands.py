"""`asyncgrpo operator`: run the kopf operator.

    asyncgrpo operator --all-namespaces --peering asyncgrpo
    asyncgrpo operator --namespace team-a --namespace team-b

Flags have ASYNCGRPO_OPERATOR_* environment defaults, so the Helm chart sets env, not argv.
With --peering, replicas elect one active operator through kopf's peering objects (the
chart installs their CRDs); without it the operator runs standalone.
"""

from __future__ import annotations

import argparse
import os

E = "ASYNCGRPO_OPERATOR_"


def _env(name: str, default: str | None) -> str | None:
    return os.environ.get(E + name, default)


def register(subparsers) -> None:
    p = subparsers.add_parser("operator", help="run the Kubernetes operator (kopf)")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", action="append", default=None,
                       help=f"watch this namespace (repeatable) [env {E}NAMESPACES, comma list]")
    scope.add_argument("--all-namespaces", action="store_true",
                       default=_env("ALL_NAMESPACES", "") in ("1", "true"),
                       help=f"watch every namespace [env {E}ALL_NAMESPACES]")
    p.add_argument("--peering", default=_env("PEERING", None),
                   help="kopf peering name: replicas with the same name never act together "
                        "(omit to run standalone)")
    p.add_argument("--priority", type=int, default=int(_env("PRIORITY", "0") or 0),
                   help="peering priority; the highest-priority replica acts")
    p.add_argument("--peering-lifetime", type=int,
                   default=int(_env("PEERING_LIFETIME", "60") or 60),
                   help="seconds a replica's peering record lives without a keepalive")
    p.add_argument("--metrics-address", default=_env("METRICS_ADDRESS", "0.0.0.0"))
    p.add_argument("--metrics-port", type=int, default=int(_env("METRICS_PORT", "8080") or 0),
                   help="port of the Prometheus endpoint; 0 turns it off")
    p.add_argument("--health-port", type=int, default=int(_env("HEALTH_PORT", "8081") or 0),
                   help="port of /healthz (kopf's liveness endpoint); 0 turns it off")
    p.add_argument("--resync-seconds", type=float,
                   default=float(_env("RESYNC_SECONDS", "10") or 10),
                   help="seconds between reconciles of each run (status, pool, progress)")
    p.add_argument("--gateway-url", default=_env("GATEWAY_URL", None),
                   help="URL template of a run's gateway ({name}, {namespace})")
    p.add_argument("--trainer-metrics-url", default=_env("TRAINER_METRICS_URL", None),
                   help="URL template of rank 0's metrics ({name}, {namespace}, {port})")
    p.add_argument("--webhook-port", type=int, default=int(_env("WEBHOOK_PORT", "0") or 0),
                   help="serve the validating admission webhook on this port (0: off); kopf "
                        "keeps the ValidatingWebhookConfiguration validate.asyncgrpo.dev")
    p.add_argument("--webhook-cert-dir", default=_env("WEBHOOK_CERT_DIR", "/etc/asyncgrpo/webhook"),
                   help="directory with tls.crt, tls.key and ca.crt")
    p.add_argument("--webhook-service", default=_env("WEBHOOK_SERVICE", ""),
                   help="namespace/name of the Service the API server calls the webhook by")
    p.add_argument("--allowed-endpoints", default=_env("ALLOWED_ENDPOINTS", ""),
                   help="comma list of S3 endpoint URLs or hosts runs may use (empty: any "
                        "except link-local and metadata addresses)")
    p.add_argument("--bucket-wait-seconds", type=float,
                   default=float(_env("BUCKET_WAIT_SECONDS", "0.5") or 0.5),
                   help="most a reconcile waits for a bucket call (they run on bucket "
                        "workers); the rest is picked up by the next tick")
    p.add_argument("--cleanup-timeout", type=float,
                   default=float(_env("CLEANUP_TIMEOUT_SECONDS", "600") or 600),
                   help="seconds a deleted run's bucket cleanup may take before it is given "
                        "up with a Warning event")
    for flag, default, what in (("sandboxes-per-run", 256, "sandbox pods of one run"),
                                ("sandboxes-per-namespace", 512,
                                 "sandbox pods of all runs of one namespace"),
                                ("vllm-replicas", 64, "vLLM replicas of one run"),
                                ("trainer-replicas", 64, "trainer replicas of one run")):
        env = "CAP_" + flag.upper().replace("-", "_")
        p.add_argument(f"--cap-{flag}", type=int, default=int(_env(env, str(default)) or default),
                       help=f"most {what} [env {E}{env}]")
    p.add_argument("--verbose", action="store_true")
    p.set_defaults(func=run_operator)


def namespaces(args: argparse.Namespace) -> list[str]:
    if args.namespace:
        return list(args.namespace)
    env = _env("NAMESPACES", "") or ""
    return [n.strip() for n in env.split(",") if n.strip()]


def run_operator(args: argparse.Namespace) -> int:
    import asyncio
    import faulthandler
    import signal

    import kopf
    from prometheus_client import start_http_server

    from asyncgrpo.controller import handlers
    from asyncgrpo.controller.runtime import Caps, Runtime, Settings, WebhookSettings

    faulthandler.register(signal.SIGUSR1, all_threads=True)   # `kill -USR1`: dump stacks
    watched = namespaces(args)
    if not watched and not args.all_namespaces:
        raise SystemExit("asyncgrpo operator: give --namespace NS (repeatable) or --all-namespaces")
    settings = Settings(resync_seconds=args.resync_seconds)
    if args.webhook_port:
        settings.webhook = WebhookSettings(port=args.webhook_port, cert_dir=args.webhook_cert_dir,
                                           service=args.webhook_service or None)
    if args.gateway_url:
        settings.gateway_url = args.gateway_url
    if args.trainer_metrics_url:
        settings.trainer_metrics_url = args.trainer_metrics_url
    settings.peering_lifetime_seconds = args.peering_lifetime
    settings.allowed_endpoints = [e.strip() for e in args.allowed_endpoints.split(",")
                                  if e.strip()]
    settings.cleanup_timeout_seconds = args.cleanup_timeout
    settings.bucket_wait_seconds = args.bucket_wait_seconds
    settings.caps = Caps(sandboxes_per_run=args.cap_sandboxes_per_run,
                         sandboxes_per_namespace=args.cap_sandboxes_per_namespace,
                         vllm_replicas=args.cap_vllm_replicas,
                         trainer_replicas=args.cap_trainer_replicas)
    rt = Runtime(settings)
    if args.metrics_port:
        start_http_server(args.metrics_port, args.metrics_address, registry=rt.metrics.registry)
    kopf.configure(verbose=args.verbose)
    asyncio.run(kopf.operator(
        registry=handlers.registry(settings),
        settings=handlers.kopf_settings(settings),
        clusterwide=args.all_namespaces,
        namespaces=watched,
        standalone=args.peering is None,
        peering_name=args.peering,
        priority=args.priority,
        liveness_endpoint=(f"http://0.0.0.0:{args.health_port}/healthz"
                           if args.health_port else None),
        memo=kopf.Memo(runtime=rt),
    ))
    return 0
