"""A throwaway PostgreSQL cluster on a free loopback port: a test and benchmark helper, never production.

PostgreSQL refuses to run as root; when we are root the cluster is created
and run as the `postgres` user (`runuser`), in a temporary directory.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

import psycopg


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgCluster:
    def __init__(self, settings: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="ledger-pg-"))
        self.data = self.dir / "data"
        self.log = self.dir / "server.log"
        self.settings = {"listen_addresses": "127.0.0.1", "max_connections": "200", **(settings or {})}
        self._as_postgres = os.geteuid() == 0

    # Commands run as `postgres` when we are root.
    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = ["runuser", "-u", "postgres", "--", *args] if self._as_postgres else list(args)
        return subprocess.run(cmd, check=check, capture_output=True, text=True)

    def start(self) -> PgCluster:
        if self._as_postgres:
            shutil.chown(self.dir, "postgres", "postgres")
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "-A",
            "trust",
            "--no-sync",
            "--data-checksums",
            "-E",
            "UTF8",
        )
        with open(self.data / "postgresql.conf", "a") as conf:
            conf.write(f"\nport = {self.port}\nunix_socket_directories = '{self.dir}'\n")
            for key, value in self.settings.items():
                conf.write(f"{key} = '{value}'\n")
        self.pg_ctl("start")
        return self

    def pg_ctl(self, action: str, *extra: str) -> None:
        result = self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60", action, *extra, check=False
        )
        if result.returncode != 0:
            log = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(f"pg_ctl {action} failed: {result.stderr}\n{log[-2000:]}")

    def restart(self) -> None:
        self.pg_ctl("restart", "-m", "fast")

    def stop(self) -> None:
        if self.data.exists():
            self._run("pg_ctl", "-D", str(self.data), "-w", "-m", "immediate", "stop", check=False)
        shutil.rmtree(self.dir, ignore_errors=True)

    def url(self, database: str = "postgres", user: str = "postgres", password: str | None = None) -> str:
        auth = user if password is None else f"{user}:{password}"
        return f"postgresql+psycopg://{auth}@127.0.0.1:{self.port}/{database}"

    def dsn(self, database: str = "postgres") -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname={database}"

    def create_database(self, name: str | None = None) -> str:
        name = name or f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return name

    def drop_database(self, name: str) -> None:
        with psycopg.connect(self.dsn(), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def __enter__(self) -> PgCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
