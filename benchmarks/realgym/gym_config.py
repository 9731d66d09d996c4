"""The global config of the real-Gym servers, resolved the way NeMo RL does it (runs in the nemo-gym 0.7.0 env):
`GlobalConfigDictParserConfig(initial_global_config_dict=..., skip_load_from_cli=True)`, then the
resolved dict as YAML for every server's `NEMO_GYM_CONFIG_DICT`.  The `legacy_agent` environment
server is in it where PORTS_JSON names a port for it (`environment`).

    python gym_config.py PORTS_JSON OUT_YAML
"""

from __future__ import annotations

import json
import sys

from nemo_gym.global_config import GlobalConfigDictParser, GlobalConfigDictParserConfig
from omegaconf import DictConfig, OmegaConf

HOST = "127.0.0.1"


def agent(port: int) -> dict[str, object]:
    return {
        "responses_api_agents": {
            "simple_agent": {
                "entrypoint": "app.py",
                "host": HOST,
                "port": port,
                "resources_server": {"type": "resources_servers", "name": "example_single_tool_call"},
                "model_server": {"type": "responses_api_models", "name": "policy_model"},
            }
        }
    }


def config(ports: dict[str, int]) -> DictConfig:
    initial: dict[str, object] = {
        "head_server": {"host": HOST, "port": ports["head"]},
        "policy_model": {
            "responses_api_models": {
                "stub_model": {"entrypoint": "app.py", "host": HOST, "port": ports["model"]}
            }
        },
        "example_single_tool_call": {
            "resources_servers": {
                "example_single_tool_call": {
                    "entrypoint": "app.py",
                    "domain": "agent",
                    "host": HOST,
                    "port": ports["resources"],
                }
            }
        },
        # The same real agent twice: with the participant mounted, and plain (reduced mode).
        "simple_agent": agent(ports["agent"]),
        "simple_agent_plain": agent(ports["plain_agent"]),
    }
    if "environment" in ports:
        # The 0.7.0 path: an environment server relaying /run to the plain agent (the participant is
        # mounted on the environment server: serve_environment.py).  Only where asked: the Gym's
        # collector sends an agent's rows through the environment server in front of it.
        initial["legacy_agent"] = {
            "environment_servers": {
                "legacy_agent": {
                    "entrypoint": "app.py",
                    "host": HOST,
                    "port": ports["environment"],
                    "agent_server": {"type": "responses_api_agents", "name": "simple_agent_plain"},
                    "cleanup_timeout_seconds": 180,
                }
            }
        }
    return GlobalConfigDictParser().parse(
        GlobalConfigDictParserConfig(
            initial_global_config_dict=OmegaConf.create(initial),
            skip_load_from_cli=True,
            skip_load_from_dotenv=True,
        )
    )


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        ports = json.load(f)
    with open(sys.argv[2], "w") as f:
        f.write(OmegaConf.to_yaml(config(ports)))
