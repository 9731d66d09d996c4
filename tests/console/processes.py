"""`ledger` as a user runs it: the console as a process, and the other commands the tests compare it with."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

ROOT = Path(__file__).parents[2]
LEDGER = [sys.executable, "-m", "cli.main"]
# Far above what a start takes on a busy 2-core machine; reached only if the console never says where it is.
START_BOUND_S = 120.0
STOP_BOUND_S = 30.0


def run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 600.0
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LEDGER, *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def ledger(*args: str, env: dict[str, str] | None = None, timeout: float = 600.0) -> str:
    """Runs `ledger ARGS` and returns its stdout (AssertionError with its output on a non-zero exit)."""
    done = run(*args, env=env, timeout=timeout)
    if done.returncode != 0:
        raise AssertionError(
            f"ledger {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        )
    return done.stdout


def status_json(db: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    value: dict[str, Any] = json.loads(ledger("status", "--db", db, "--json", env=env))
    return value


class ConsoleProcess:
    """`ledger console --port 0 ...` in a process of its own; `url` once it said where it listens."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.args = ["console", "--port", "0", *args]
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen[str] | None = None
        self.url = ""
        self.output: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()

    def start(self) -> ConsoleProcess:
        self.process = subprocess.Popen(
            [*LEDGER, *self.args],
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + START_BOUND_S
        while not self.url:
            left = deadline - time.monotonic()
            try:
                line = self._lines.get(timeout=max(0.1, left))
            except queue.Empty:
                line = ""
            if line is None or left <= 0:
                self.stop()
                raise AssertionError(f"ledger console did not say where it listens:\n{self.log()}")
            if line.startswith("ledger console: "):
                self.url = line.split()[2]
        return self

    def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)
            self._lines.put(line.strip())
        self._lines.put(None)

    def log(self) -> str:
        return "".join(self.output)

    def stop(self) -> int:
        """SIGTERM, then its exit status (it must stop within STOP_BOUND_S)."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(STOP_BOUND_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(
                f"ledger console did not stop within {STOP_BOUND_S} s of SIGTERM:\n{self.log()}"
            ) from None

    def __enter__(self) -> ConsoleProcess:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        status = self.stop()
        if kind is None:
            assert status == 0, f"ledger console exited {status}:\n{self.log()}"
