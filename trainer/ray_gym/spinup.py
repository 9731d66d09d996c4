"""Starting or finding the Gym servers a `LedgerGym` drives, the way NeMo RL's `NemoGym._spinup` does.

Three ways, chosen by the `ledger` section:

- `agents`: base URLs given outright; nothing is started;
- `head_server_url`: a Gym already running; its head server's resolved global config
  (`/global_config_dict_yaml`, what Gym's own `ServerClient` reads) names every server, and each
  `responses_api_agents` server is an agent, under its top-level name (a row's `agent_ref.name`);
- otherwise started: the global config NeMo RL builds (`global_config_for`: the policy model's
  name, key and base URLs, a head server on a free port of the Gym port range, the default host, the
  port range, the connection limits, the Ray cluster to join) handed to Gym's `RunHelper` in a host
  process (`gym_host.py`, run by the interpreter that has `nemo_gym`), then found as above.

The host process lives as long as the actor: it stops its servers when its standard input closes,
so a killed actor leaves no servers behind, and a restarted one starts them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final

import httpx

# NeMo RL's own defaults (nemo_rl/distributed/virtual_cluster.py): Gym's servers take ports here.
GYM_PORT_RANGE: Final = (5000, 5999)
HOST_SCRIPT: Final = Path(__file__).with_name("gym_host.py")
# Keys NeMo RL takes off `env.nemo_gym` before the rest goes to Gym (its own knobs), and ours.
NOT_FOR_GYM: Final = ("ledger", "effort_levels", "pad_dynamic_image_shapes")
AGENT_SERVER_TYPE: Final = "responses_api_agents"
STOP_TIMEOUT_S: Final = 8.0  # NeMo RL's shutdown waits 10 s for the whole actor


class SpinupError(RuntimeError):
    """The Gym servers could not be started or found (one line: what, where)."""


def free_port(low: int, high: int, host: str = "127.0.0.1") -> int:
    """A port of [low, high) free on `host` now (the head server binds it right after)."""
    for port in range(low, high):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host if host != "0.0.0.0" else "", port))
            except OSError:
                continue
            return port
    raise SpinupError(f"no free port in the Gym port range [{low}, {high})")


def global_config_for(
    cfg: Mapping[str, Any], *, host: str, bind_host: str, ray_address: str | None
) -> dict[str, Any]:
    """The global config dict NeMo RL's `NemoGym._spinup` hands Gym's `RunHelper`, from `NemoGymConfig`."""
    config = {
        k: v for k, v in dict(cfg.get("initial_global_config_dict") or {}).items() if k not in NOT_FOR_GYM
    }
    config["policy_model_name"] = cfg["model_name"]
    config["policy_api_key"] = "dummy_key"  # no key is needed for training
    config["policy_base_url"] = list(cfg["base_urls"])
    config.setdefault("default_host", host)
    low = int(cfg.get("port_range_low", GYM_PORT_RANGE[0]))
    high = int(cfg.get("port_range_high", GYM_PORT_RANGE[1]))
    config["port_range_low"], config["port_range_high"] = low, high
    config.setdefault("global_aiohttp_connector_limit_per_host", 16_384)
    config.setdefault("global_aiohttp_connector_limit", 65_536)
    if ray_address:
        config["ray_head_node_address"] = ray_address
    config["head_server"] = {"host": bind_host, "port": free_port(low, high, bind_host)}
    return config


def agents_of(global_config: Mapping[str, Any]) -> dict[str, str]:
    """Every agent server the resolved global config names: top-level name -> base URL."""
    agents: dict[str, str] = {}
    for name, section in global_config.items():
        if not isinstance(section, Mapping) or not isinstance(section.get(AGENT_SERVER_TYPE), Mapping):
            continue
        for server in section[AGENT_SERVER_TYPE].values():
            if isinstance(server, Mapping) and server.get("host") and server.get("port"):
                agents[str(name)] = f"http://{server['host']}:{int(server['port'])}"
                break
    return agents


async def read_global_config(head_server_url: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """The head server's resolved global config (a YAML document sent as a JSON string)."""
    import yaml

    url = head_server_url.rstrip("/") + "/global_config_dict_yaml"
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            response = await client.get(url)
            response.raise_for_status()
    except httpx.HTTPError as exc:
        raise SpinupError(f"no Gym head server answers at {head_server_url}: {exc}") from None
    document = response.json()
    parsed = yaml.safe_load(document if isinstance(document, str) else json.dumps(document))
    if not isinstance(parsed, dict):
        raise SpinupError(f"the Gym head server at {head_server_url} sent no global config")
    return parsed


@dataclass
class GymHost:
    """A running `gym_host.py` and what it started."""

    process: asyncio.subprocess.Process
    head_server_url: str
    log_path: Path
    log: IO[bytes] = field(repr=False)

    def alive(self) -> bool:
        return self.process.returncode is None

    def log_tail(self, chars: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_bytes()[-chars:].decode(errors="replace")
        return ""

    async def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Closes its input (it shuts its servers down), then SIGTERM, then SIGKILL, each bounded."""
        if self.process.stdin is not None and not self.process.stdin.is_closing():
            self.process.stdin.close()
        for action in (None, self.process.terminate, self.process.kill):
            if self.process.returncode is not None:
                break
            if action is not None:
                with contextlib.suppress(ProcessLookupError):
                    action()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.process.wait(), timeout_s / 3)
        self.log.close()


async def start_gym(
    global_config: dict[str, Any],
    *,
    python: str | None,
    workdir: str | None,
    connect_host: str,
    log_dir: Path,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 900.0,
    dotenv_path: str | None = None,
) -> GymHost:
    """Starts the host and waits (at most `timeout_s`) until Gym says every server is up."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"gym-host-{os.getpid()}-{int(time.time() * 1000)}.log"
    log = open(log_path, "ab")  # noqa: SIM115 - closed by GymHost.stop
    process = await asyncio.create_subprocess_exec(
        python or sys.executable,
        str(HOST_SCRIPT),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=log,
        cwd=workdir or os.getcwd(),
        env={**os.environ, **(env or {})},
        start_new_session=True,  # its own process group: a signal to the actor's group does not stop it
    )
    head = global_config["head_server"]
    host = GymHost(process, f"http://{connect_host}:{int(head['port'])}", log_path, log)
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(
        json.dumps({"global_config": global_config, "dotenv_path": dotenv_path}).encode() + b"\n"
    )
    await process.stdin.drain()
    try:
        line = await asyncio.wait_for(process.stdout.readline(), timeout_s)
    except TimeoutError:
        await host.stop()
        raise SpinupError(
            f"the Gym servers were not up within {timeout_s:g} s (log {log_path}): {host.log_tail(300)!r}"
        ) from None
    answer = json.loads(line) if line.strip() else {"error": f"the Gym host exited ({process.returncode})"}
    if not answer.get("ready"):
        await host.stop()
        raise SpinupError(f"Gym could not start its servers: {answer.get('error')} (log {log_path})")
    return host
