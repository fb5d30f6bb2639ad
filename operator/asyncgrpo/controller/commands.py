"""`asyncgrpo operator`: run the kopf operator.

    asyncgrpo operator --all-namespaces --leader-election asyncgrpo-operator
    asyncgrpo operator --namespace team-a --namespace team-b

Flags have ASYNCGRPO_OPERATOR_* environment defaults, so the Helm chart sets env, not argv.
With --leader-election, replicas elect one active operator through a coordination.k8s.io
Lease (`controller.leader`); the others stand by without watching anything. Without it the
operator runs standalone.
"""

from __future__ import annotations

import argparse
import os

from asyncgrpo.wire import OPERATOR_ENV_PREFIX

E = OPERATOR_ENV_PREFIX


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
    p.add_argument("--leader-election", default=_env("LEADER_ELECTION", None), metavar="LEASE",
                   help="name of the Lease replicas elect a leader with; only the leader acts "
                        "(omit to run standalone)")
    p.add_argument("--leader-election-namespace",
                   default=_env("LEADER_ELECTION_NAMESPACE", os.environ.get("POD_NAMESPACE")),
                   help="namespace of the Lease (default: $POD_NAMESPACE)")
    p.add_argument("--lease-duration", type=int, default=int(_env("LEASE_DURATION", "15")),
                   help="seconds a standby waits after the leader's last renewal it saw")
    p.add_argument("--renew-deadline", type=float, default=float(_env("RENEW_DEADLINE", "10")),
                   help="seconds the leader keeps acting while its renewals fail")
    p.add_argument("--retry-period", type=float, default=float(_env("RETRY_PERIOD", "2")),
                   help="seconds between two tries to acquire or renew the Lease")
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
    p.add_argument("--scrapers", default=_env("SCRAPERS", ""), metavar="JSON",
                   help="JSON list of NetworkPolicy peers (namespaceSelector/podSelector) that "
                        "may scrape the runs' metrics ports; the operator itself is always "
                        "added (it reads rank 0's progress). Empty: pods labelled "
                        "app.kubernetes.io/name=prometheus in any namespace, and the operator")
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
    p.add_argument("--bucket-job-image", default=_env("BUCKET_JOB_IMAGE", None),
                   help="image of the bucket setup and cleanup Jobs (default: the operator "
                        "image of this version)")
    p.add_argument("--bucket-job-pull-policy", default=_env("BUCKET_JOB_PULL_POLICY",
                                                            "IfNotPresent"),
                   help="imagePullPolicy of the bucket Jobs")
    p.add_argument("--bucket-recheck-seconds", type=float,
                   default=float(_env("BUCKET_RECHECK_SECONDS", "600") or 600),
                   help="seconds between re-runs of a run's bucket setup Job")
    p.add_argument("--preflight", action=argparse.BooleanOptionalAction,
                   default=(_env("PREFLIGHT", "true") or "true").lower() in ("1", "true", "yes"),
                   help="run `asyncgrpo preflight` as a Job of the run's namespace (the "
                        "trainer image) before vLLM and the trainer scale up; its outcome "
                        f"is the Preflight condition. On by default; --no-preflight (or "
                        f"{E}PREFLIGHT=false) turns it off")
    p.add_argument("--gpu-resource-name", default=_env("GPU_RESOURCE_NAME", "nvidia.com/gpu"),
                   help="extended resource GPUs are requested as by runs that name none "
                        "(spec.gpuResourceName), e.g. amd.com/gpu")
    p.add_argument("--cleanup-timeout", type=float,
                   default=float(_env("CLEANUP_TIMEOUT_SECONDS", "600") or 600),
                   help="seconds a deleted run's bucket cleanup may take before it is given "
                        "up with a Warning event")
    # reads of tenants' endpoints and names (controller.tenant_io, docs/security.md)
    for flag, env, default, what in (
            ("endpoint-deadline", "ENDPOINT_DEADLINE_SECONDS", 3.0,
             "seconds one exchange with a tenant's endpoint may take, connect to last byte"),
            ("endpoint-wait", "ENDPOINT_WAIT_SECONDS", 1.0,
             "seconds one reconcile waits in all for endpoints that answered in time before"),
            ("dns-deadline", "DNS_DEADLINE_SECONDS", 2.0,
             "seconds one lookup of an allowedEgressHosts name may take"),
            ("dns-refresh", "DNS_REFRESH_SECONDS", 60.0,
             "seconds an allowedEgressHosts answer is kept before it is looked up again")):
        p.add_argument(f"--{flag}", type=float, default=float(_env(env, str(default)) or default),
                       help=f"{what} [env {E}{env}]")
    for flag, env, default, what in (
            ("endpoint-reads-per-namespace", "ENDPOINT_READS_PER_NAMESPACE", 4,
             "exchanges with one namespace's endpoints at once"),
            ("endpoint-reads-total", "ENDPOINT_READS_TOTAL", 64,
             "exchanges with tenants' endpoints at once, all namespaces")):
        p.add_argument(f"--{flag}", type=int, default=int(_env(env, str(default)) or default),
                       help=f"{what} [env {E}{env}]")
    p.add_argument("--dns-nameservers", default=_env("DNS_NAMESERVERS", ""),
                   help="comma list of DNS servers (ip or ip:port) for tenant-chosen names; "
                        f"empty: the system's [env {E}DNS_NAMESERVERS]")
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


def scraper_peers(text: str) -> list[dict] | None:
    """--scrapers: the given peers plus the operator's own (its progress scrape must keep
    working whatever Prometheus a cluster runs); None (the built-in default) when empty."""
    import json

    from asyncgrpo.controller.network import OPERATOR_SCRAPER

    if not text.strip():
        return None
    peers = json.loads(text)
    if not isinstance(peers, list) or not all(isinstance(p, dict) for p in peers):
        raise SystemExit("asyncgrpo operator: --scrapers must be a JSON list of "
                         "NetworkPolicy peers")
    return [*peers, *([] if OPERATOR_SCRAPER in peers else [OPERATOR_SCRAPER])]


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
    settings.scrapers = scraper_peers(args.scrapers)
    settings.allowed_endpoints = [e.strip() for e in args.allowed_endpoints.split(",")
                                  if e.strip()]
    settings.cleanup_timeout_seconds = args.cleanup_timeout
    settings.gpu_resource_name = args.gpu_resource_name
    if args.bucket_job_image:
        settings.bucket_job_image = args.bucket_job_image
    settings.bucket_job_pull_policy = args.bucket_job_pull_policy
    settings.bucket_recheck_seconds = args.bucket_recheck_seconds
    settings.preflight = args.preflight
    for positive in ("endpoint_deadline", "endpoint_wait", "dns_deadline", "dns_refresh",
                     "endpoint_reads_per_namespace", "endpoint_reads_total"):
        if getattr(args, positive) <= 0:
            raise SystemExit(f"asyncgrpo operator: --{positive.replace('_', '-')} must be "
                             "above 0")
    settings.endpoint_deadline_seconds = args.endpoint_deadline
    settings.endpoint_wait_seconds = args.endpoint_wait
    settings.dns_deadline_seconds = args.dns_deadline
    settings.dns_refresh_seconds = args.dns_refresh
    settings.endpoint_reads_per_namespace = args.endpoint_reads_per_namespace
    settings.endpoint_reads_total = args.endpoint_reads_total
    settings.dns_nameservers = [n.strip() for n in args.dns_nameservers.split(",") if n.strip()]
    settings.caps = Caps(sandboxes_per_run=args.cap_sandboxes_per_run,
                         sandboxes_per_namespace=args.cap_sandboxes_per_namespace,
                         vllm_replicas=args.cap_vllm_replicas,
                         trainer_replicas=args.cap_trainer_replicas)
    rt = Runtime(settings)
    if args.metrics_port:
        start_http_server(args.metrics_port, args.metrics_address, registry=rt.metrics.registry)
    kopf.configure(verbose=args.verbose)
    if args.leader_election:
        return run_with_leader_election(args, settings, rt.metrics,
                                        [] if args.all_namespaces else watched)
    asyncio.run(kopf.operator(
        registry=handlers.registry(settings),
        settings=handlers.kopf_settings(settings),
        clusterwide=args.all_namespaces,
        namespaces=watched,
        standalone=True,
        liveness_endpoint=(f"http://0.0.0.0:{args.health_port}/healthz"
                           if args.health_port else None),
        memo=kopf.Memo(runtime=rt),
    ))
    return 0


def run_with_leader_election(args: argparse.Namespace, settings, metrics,
                             watched: list[str]) -> int:
    """Stand by until the Lease is ours, then run kopf (in a thread) for as long as we hold
    it. Each term starts a fresh operator: its indexes come from a full list before any
    handler runs, exactly as after a restart. The webhook, if on, is served by every
    replica from a separate kopf instance that never writes to runs or their children."""
    import dataclasses
    import logging
    import signal
    import threading

    from asyncgrpo.controller import handlers, leader
    from asyncgrpo.controller.embedded import EmbeddedOperator
    from asyncgrpo.controller.runtime import Runtime

    log = logging.getLogger("asyncgrpo.operator")
    if not args.leader_election_namespace:
        raise SystemExit("asyncgrpo operator: --leader-election needs "
                         "--leader-election-namespace (or $POD_NAMESPACE)")
    config = leader.ElectionConfig(name=args.leader_election,
                                   namespace=args.leader_election_namespace,
                                   lease_duration=args.lease_duration,
                                   renew_deadline=args.renew_deadline,
                                   retry_period=args.retry_period)
    api = handlers.make_kube(Runtime(settings)).api
    if not api.configuration.verify_ssl:
        import urllib3

        # the elector calls every retry period: one warning at start, not one per call
        log.warning("TLS verification of the API server is off (kubeconfig)")
        urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
    # a standby imports now what the first reconcile of a term would import (boto3 and
    # the reconcile's modules): a takeover should not wait for imports
    import boto3  # noqa: F401

    import asyncgrpo.controller.reconcile  # noqa: F401

    def lost() -> None:
        # controller-runtime's answer: the process goes, and with it any handler or kopf
        # write still in flight; the Deployment restarts it as a standby
        log.error("leader election lost: exiting")
        logging.shutdown()
        os._exit(1)

    elector = leader.LeaseElector(api, config, fence=leader.Fence(on_expired=lost))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    webhook = None
    if settings.webhook is not None:
        webhook = EmbeddedOperator(watched, settings, controller=False).start()
    term_settings = dataclasses.replace(settings, webhook=None)
    current: list[EmbeddedOperator] = []
    if args.health_port:
        leader.serve_health(args.health_port, lambda: elector.healthy() and all(
            op.alive() for op in current))

    def start() -> EmbeddedOperator:
        current[:] = [EmbeddedOperator(watched, term_settings, metrics=metrics,
                                       fence=elector.fence).start()]
        return current[0]

    def stop_operator(op: EmbeddedOperator) -> None:
        current.clear()
        op.stop()

    log.info("standing by for the lease %s/%s as %s", config.namespace, config.name,
             elector.identity)
    leader.run_elected(elector, start, stop_operator, stop, lost,
                       alive=lambda op: op.alive())
    if webhook is not None:
        webhook.stop()
    return 0
