"""The local S3 server: moto's `moto_server` (PyPI moto[server]) on loopback.

Product behaviour, not test scaffolding: `asyncgrpo local run` starts it when the run's
`spec.adapterStore.endpoint` is a loopback address where nothing listens (docs/local.md), so
the embedded default needs no S3 of the user's. moto is an in-memory S3 that accepts any
credentials. Tests and benchmarks start the same server (`asyncgrpo.testing.s3`).

Kept on disk: moto 5 has no persistent S3 backend, so a local run's server is given a
`data_dir` (`asyncgrpo local run --s3-dir`, default `.cache/local/s3`): its objects are
loaded from there at start and written back when it stops, as plain files
`<data_dir>/<bucket>/<key>` (a user finds `final/` there with a file browser). Every component
still speaks S3 to the server; only start and stop touch the files. What a run wrote is lost
only if the local run is killed without its clean-up (SIGKILL); the previous copy stays."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from asyncgrpo.local.net import free_port, wait_for_port


class S3Server:
    """A running moto_server; credentials are dummies it accepts."""

    access_key = "testing-access-key"
    secret_key = "testing-secret-key"
    region = "us-east-1"

    def __init__(self, port: int, proc: subprocess.Popen, log=None, host: str = "127.0.0.1",
                 data_dir: Path | None = None):
        self.port = port
        self.proc = proc
        self._log = log
        self.endpoint = f"http://{host}:{port}"
        self.data_dir = data_dir
        #: objects loaded at start and written at stop (count, bytes, seconds)
        self.restored: tuple[int, int, float] | None = None
        self.saved: tuple[int, int, float] | None = None

    @classmethod
    def start(cls, log_path: Path, port: int | None = None,
              host: str = "127.0.0.1", data_dir: Path | None = None) -> S3Server:
        """`host`: loopback, or the test node's host address so pods reach it. `data_dir`:
        where the objects are kept between starts (None: in memory only)."""
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
        server = cls(port, proc, log, host, data_dir)
        if data_dir is not None:
            try:
                server.restored = server.load(data_dir)
            except Exception:
                server.stop(save=False)
                raise
        return server

    def load(self, data_dir: Path) -> tuple[int, int, float]:
        """Every file under `<data_dir>/<bucket>/` into the server as an object."""
        t0 = time.monotonic()
        n = size = 0
        if not data_dir.is_dir():
            return 0, 0, 0.0
        s3 = self.client()
        for bucket_dir in sorted(p for p in data_dir.iterdir() if p.is_dir()):
            s3.create_bucket(Bucket=bucket_dir.name)
            for path in sorted(p for p in bucket_dir.rglob("*") if p.is_file()):
                s3.put_object(Bucket=bucket_dir.name, Key=path.relative_to(bucket_dir).as_posix(),
                              Body=path.read_bytes())
                n, size = n + 1, size + path.stat().st_size
        return n, size, time.monotonic() - t0

    def save(self, data_dir: Path) -> tuple[int, int, float]:
        """Every object of every bucket to `<data_dir>/<bucket>/<key>`, replacing the last
        copy only once the new one is whole (written beside it, then renamed)."""
        t0 = time.monotonic()
        n = size = 0
        s3 = self.client()
        data_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{data_dir.name}.saving-", dir=data_dir.parent))
        try:
            for b in s3.list_buckets().get("Buckets", []):
                root = tmp / b["Name"]
                root.mkdir()
                for page in s3.get_paginator("list_objects_v2").paginate(Bucket=b["Name"]):
                    for obj in page.get("Contents", []):
                        key = obj["Key"]
                        target = root / key
                        if key.endswith("/") or ".." in Path(key).parts or target.is_dir():
                            continue  # not a file name (S3 allows what a disk cannot)
                        target.parent.mkdir(parents=True, exist_ok=True)
                        s3.download_file(b["Name"], key, str(target))
                        n, size = n + 1, size + int(obj["Size"])
            old = data_dir.with_name(f".{data_dir.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            if data_dir.exists():
                os.rename(data_dir, old)
            os.rename(tmp, data_dir)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return n, size, time.monotonic() - t0

    def stop(self, save: bool = True) -> None:
        if save and self.data_dir is not None and self.proc.poll() is None:
            try:
                self.saved = self.save(self.data_dir)
            except Exception as err:  # noqa: BLE001 - the server must still be stopped
                print(f"local S3: objects not saved to {self.data_dir}: {err}", file=sys.stderr)
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
