"""A real S3-compatible server on loopback for the S3 backend's contract: moto's server mode, run as
its own process (`moto_server`), its bucket made with one plain HTTP PUT."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

STARTUP_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def moto_s3() -> Iterator[str]:
    """The endpoint URL of a fresh moto S3 server on 127.0.0.1, stopped on exit."""
    binary = shutil.which("moto_server")
    if binary is None:
        raise RuntimeError("moto_server is not installed (the dev extra brings moto[server])")
    port = _free_port()
    proc = subprocess.Popen(
        [binary, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "MOTO_ALLOW_NONEXISTENT_REGION": "1"},
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            try:
                httpx.get(f"{endpoint}/moto-api/", timeout=1.0)
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start on {endpoint}") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def make_bucket(endpoint: str, bucket: str) -> None:
    httpx.put(f"{endpoint}/{bucket}", timeout=10.0).raise_for_status()
