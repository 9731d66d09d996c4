"""The config `gym eval run --no-serve` (0.7.0's `ng_collect_rollouts`: `RolloutCollectionHelper`) runs
with in `benchmarks.peer` (runs in the nemo-gym 0.7.0 env): the servers' resolved global config, the
collection's own keys, and the agent's environment server pointed at the agent itself.

0.7.0's config parser puts a `legacy_agent` environment server (`<agent>_environment_server`) in
front of every agent, and its collector sends each row to it; that server relays `/run` to the
agent byte for byte, reading neither side's contract.  Pointed at the agent's own address, the
collector's `/run` goes straight to the agent, as the trainer's does: one hop on each side.

    python collector_config.py GYM_YAML AGENT INPUT_JSONL OUTPUT_JSONL REPEATS IN_FLIGHT OUT_YAML
"""

from __future__ import annotations

import sys

from omegaconf import OmegaConf


def collector_config(
    gym_yaml: str, agent: str, input_jsonl: str, output_jsonl: str, repeats: int, in_flight: int
) -> str:
    """`repeats`: rollouts of each row (a prompt group's tries); `in_flight`: rollouts at once."""
    config = OmegaConf.create(gym_yaml)
    [(_, server)] = config[agent]["responses_api_agents"].items()
    [(_, relay)] = config[f"{agent}_environment_server"]["environment_servers"].items()
    relay.host, relay.port = server.host, server.port
    config.agent_name = agent
    config.input_jsonl_fpath = input_jsonl
    config.output_jsonl_fpath = output_jsonl
    config.num_repeats = repeats
    config.num_samples_in_parallel = in_flight
    # What follows the last rollout (metrics over the file, its health check) is no part of the
    # hand-off being compared.
    config.disable_aggregation = True
    config.disable_health_check = True
    return OmegaConf.to_yaml(config)


if __name__ == "__main__":
    gym_yaml, agent, input_jsonl, output_jsonl, repeats, in_flight, out = sys.argv[1:8]
    with open(gym_yaml) as f:
        text = collector_config(f.read(), agent, input_jsonl, output_jsonl, int(repeats), int(in_flight))
    with open(out, "w") as f:
        f.write(text)
