"""Starting reference agents as real subprocesses (for crash/restart tests and `ledger simulate`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import httpx

from gym_agent.defaults import DEFAULT_HOST, TOKEN_ENV


def free_port(host: str = DEFAULT_HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class AgentProcess:
    """`python -m gym_agent serve ...` in a subprocess; `start()` returns once /health answers.

    The state dir (generation counter, artefacts) defaults to a temporary folder owned by this object
    and kept across `restart()`, so a restarted agent has a higher execution_generation (and a new incarnation).  The token
    travels in the environment, not argv, so it never shows in a process listing.
    """

    def __init__(
        self,
        name: str,
        *,
        port: int | None = None,
        host: str = DEFAULT_HOST,
        token: str | None = None,
        seed: int = 0,
        turns: tuple[int, int] = (1, 3),
        delay_s: float = 0.0,
        state_dir: Path | None = None,
        extra_args: Sequence[str] = (),
        log_path: Path | None = None,
        startup_timeout_s: float = 60.0,
    ) -> None:
        self.name = name
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.token = token
        self.seed = seed
        self.turns = turns
        self.delay_s = delay_s
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if state_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix=f"gym-agent-{name}-")
            state_dir = Path(self._tmp.name)
        self.state_dir = state_dir
        self.log_path = log_path if log_path is not None else state_dir / "agent.log"
        self.extra_args = list(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def returncode(self) -> int | None:
        return self.process.poll() if self.process is not None else None

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "gym_agent", "serve",
            "--name", self.name,
            "--host", self.host,
            "--port", str(self.port),
            "--seed", str(self.seed),
            "--turns", f"{self.turns[0]}:{self.turns[1]}",
            "--delay-s", str(self.delay_s),
            "--state-dir", str(self.state_dir),
            "--log-level", "info",
            "--stop-with-stdin",
            *self.extra_args,
        ]  # fmt: skip

    def start(self) -> AgentProcess:
        if self.is_running():
            raise RuntimeError(f"agent {self.name} is already running (pid {self.pid})")
        env = dict(os.environ)
        env.pop(TOKEN_ENV, None)
        if self.token is not None:
            env[TOKEN_ENV] = self.token
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            # Its own session (a Ctrl-C at the terminal reaches the parent, which stops it in order);
            # stdin a pipe only this object holds the write end of: when the parent ends, however it
            # ends (SIGKILL included), the agent reads end of file and stops (`--stop-with-stdin`).
            self.process = subprocess.Popen(
                self.command(),
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.wait_healthy()
        return self

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.startup_timeout_s)
        with httpx.Client(timeout=2.0) as client:
            while True:
                if not self.is_running():
                    raise RuntimeError(
                        f"agent {self.name} exited with {self.returncode} during startup:\n{self.log_tail()}"
                    )
                try:
                    reply = client.get(f"{self.url}/health")
                    if reply.status_code == 200 and reply.json().get("agent_name") == self.name:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    self.kill()
                    raise TimeoutError(f"agent {self.name} not healthy after startup:\n{self.log_tail()}")
                time.sleep(0.05)

    def wait_exit(self, timeout_s: float = 30.0) -> int:
        if self.process is None:
            raise RuntimeError(f"agent {self.name} was never started")
        return self.process.wait(timeout_s)

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout_s`; returns the exit status."""
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self._reaped(self.process.wait(timeout_s))
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self._reaped(self.process.wait())

    def kill(self) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.kill()
        return self._reaped(self.process.wait())

    def _reaped(self, status: int) -> int:
        if self.process is not None and self.process.stdin is not None:
            self.process.stdin.close()  # the lifeline of a process that has ended
        return status

    def restart(self) -> AgentProcess:
        """Stops (if running) and starts again on the same port and state dir."""
        self.stop()
        return self.start()

    def close(self) -> None:
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> AgentProcess:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
