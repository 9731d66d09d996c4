"""Starting the real Gym on loopback: the stub model, `example_single_tool_call`, `simple_agent` twice
(with the participant mounted, and plain) and, where asked, a `legacy_agent` environment server in
front of the plain one (with the participant mounted), each a subprocess of the nemo-gym 0.7.0 env
started the way NeMo RL starts them: the resolved global config in NEMO_GYM_CONFIG_DICT, the server's
name in NEMO_GYM_CONFIG_PATH, then the server's own app.py (ours where the participant is mounted:
`serve_agent.py`, `serve_environment.py`).  Used by tests/realgym and `benchmarks.peer`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import httpx

from benchmarks.realgym.environment import REPO, ensure_env, env_python, site_packages
from gym_agent.launcher import free_port

HERE: Final = Path(__file__).resolve().parent
STARTUP_TIMEOUT_S: Final = 240.0
STOP_TIMEOUT_S: Final = 20.0


@dataclass
class Server:
    name: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


@dataclass
class RealGym:
    env: Path
    workdir: Path
    servers: dict[str, Server] = field(default_factory=dict)
    state_dir: Path = Path()
    environment_state_dir: Path = Path()
    # The resolved global config every server was started with (YAML).
    config: str = ""

    @property
    def python(self) -> str:
        return env_python(self.env)

    def run_script(
        self, script: str | Path, *args: str, timeout_s: float = 300.0
    ) -> subprocess.CompletedProcess[str]:
        """A script (a name in this folder, or a path) run in the real Gym's env, with this checkout on
        its path."""
        return subprocess.run(
            [self.python, str(HERE / script), *args],
            cwd=self.workdir,
            env=self.env_vars(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    def env_vars(self, **extra: str) -> dict[str, str]:
        """The environment a process of the real Gym's env runs with: this checkout on PYTHONPATH, no
        settings of another Gym or venv inherited."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NEMO_GYM_", "VIRTUAL_ENV"))}
        env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0", **extra)
        return env

    def start(self, name: str, argv: list[str], port: int, **env: str) -> None:
        log = self.workdir / f"{name}.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                argv, cwd=self.workdir, env=self.env_vars(**env), stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: the Ray workers it starts go with it
            )  # fmt: skip
        self.servers[name] = Server(name, port, process, log)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        pending = dict(self.servers)
        while pending:
            for name, server in list(pending.items()):
                if server.process.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with {server.process.returncode}:\n{server.log_tail()}"
                    )
                try:
                    if httpx.get(server.url + "/", timeout=2).status_code == 200:
                        del pending[name]
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {n}:\n{s.log_tail()}" for n, s in pending.items())
                raise RuntimeError(f"not up within {STARTUP_TIMEOUT_S} s: {sorted(pending)}\n{tails}")
            time.sleep(0.5)

    def stop(self) -> None:
        for server in self.servers.values():
            if server.process.poll() is None:
                os.killpg(server.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for server in self.servers.values():
            with suppress(subprocess.TimeoutExpired):
                server.process.wait(max(0.1, deadline - time.monotonic()))
            # Whatever is left of the group (a server that hung, Ray's workers): gone.
            with suppress(ProcessLookupError):
                os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait(10)


@contextmanager
def real_gym(
    workdir: Path,
    *,
    fail_every: int = 0,
    model_args: Sequence[str] = (),
    environment_server: bool = True,
) -> Iterator[RealGym]:
    """The servers up and answering; stopped (process groups and all) on exit.  `fail_every`: the stub
    model answers 500 to every Nth call; `model_args`: its other options (`stub_model.py --help`);
    `environment_server`: also the `legacy_agent` environment server."""
    env = ensure_env()
    gym = RealGym(
        env=env,
        workdir=workdir,
        state_dir=workdir / "participant-state",
        environment_state_dir=workdir / "environment-state",
    )
    names = ["head", "model", "resources", "agent", "plain_agent"] + (
        ["environment"] if environment_server else []
    )
    ports = {k: free_port() for k in names}
    (workdir / "ports.json").write_text(json.dumps(ports))
    made = gym.run_script("gym_config.py", str(workdir / "ports.json"), str(workdir / "gym.yaml"))
    if made.returncode != 0:
        raise RuntimeError(f"gym_config.py failed:\n{made.stdout[-2000:]}\n{made.stderr[-4000:]}")
    gym.config = config = (workdir / "gym.yaml").read_text()
    site = site_packages(env)
    py = gym.python
    try:
        gym.start("model", [py, str(HERE / "stub_model.py"), "--port", str(ports["model"]),
                            "--fail-every", str(fail_every), *model_args], ports["model"])  # fmt: skip
        gym.start(
            "resources",
            [py, str(site / "resources_servers" / "example_single_tool_call" / "app.py")],
            ports["resources"],
            NEMO_GYM_CONFIG_DICT=config,
            NEMO_GYM_CONFIG_PATH="example_single_tool_call",
        )
        gym.start(
            "agent",
            [py, str(HERE / "serve_agent.py")],
            ports["agent"],
            NEMO_GYM_CONFIG_DICT=config,
            NEMO_GYM_CONFIG_PATH="simple_agent",
            PARTICIPANT_STATE_DIR=str(gym.state_dir),
        )
        gym.start(
            "plain_agent",
            [py, str(site / "responses_api_agents" / "simple_agent" / "app.py")],
            ports["plain_agent"],
            NEMO_GYM_CONFIG_DICT=config,
            NEMO_GYM_CONFIG_PATH="simple_agent_plain",
        )
        if environment_server:
            gym.start(
                "environment",
                [py, str(HERE / "serve_environment.py")],
                ports["environment"],
                NEMO_GYM_CONFIG_DICT=config,
                NEMO_GYM_CONFIG_PATH="legacy_agent",
                PARTICIPANT_STATE_DIR=str(gym.environment_state_dir),
            )
        gym.wait_ready()
        yield gym
    finally:
        gym.stop()
