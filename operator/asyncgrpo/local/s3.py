"""The local S3 server: moto's `moto_server` (PyPI moto[server]) on loopback.

Product behaviour, not test scaffolding: `asyncgrpo local run` starts it when the run's
`spec.adapterStore.endpoint` is a loopback address where nothing listens (docs/local.md), so
the embedded default needs no S3 of the user's. moto is an in-memory S3 that accepts any
credentials: good for one machine's run, never a store to keep. Tests and benchmarks start
the same server (`asyncgrpo.testing.s3`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from asyncgrpo.local.net import free_port, wait_for_port


class S3Server:
    """A running moto_server; credentials are dummies it accepts."""

    access_key = "testing-access-key"
    secret_key = "testing-secret-key"
    region = "us-east-1"

    def __init__(self, port: int, proc: subprocess.Popen, log=None, host: str = "127.0.0.1"):
        self.port = port
        self.proc = proc
        self._log = log
        self.endpoint = f"http://{host}:{port}"

    @classmethod
    def start(cls, log_path: Path, port: int | None = None,
              host: str = "127.0.0.1") -> S3Server:
        """`host`: loopback, or the test node's host address so pods reach it."""
        port = port or free_port(host)
        log = open(log_path, "w")  # noqa: SIM115 (moto writes it until stop())
        moto = Path(sys.executable).parent / "moto_server"
        if not moto.exists():
            raise FileNotFoundError(f"{moto} not found: install moto[server] (the dev extra)")
        proc = subprocess.Popen(
            [str(moto), "-H", host, "-p", str(port)],
            stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "MOTO_ALLOW_NONEXISTENT_REGION": "true"},
        )
        try:
            wait_for_port(port, host=host, proc=proc)
        except Exception:
            proc.kill()
            log.close()
            raise
        return cls(port, proc, log, host)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        if self._log is not None:
            self._log.close()

    def client(self):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
        )

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ENDPOINT_URL_S3": self.endpoint,
        }
