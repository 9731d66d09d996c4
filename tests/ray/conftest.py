"""NeMo RL-shaped rows for the Ray adapter's tests."""

from __future__ import annotations

from typing import Any


def nemo_rows(prompts: int, generations: int, agents: list[str], tag: str = "") -> list[dict[str, Any]]:
    """What NeMo RL's `_prepare_nemo_gym_rows` hands the Gym actor: a prompt's rows contiguous."""
    rows = []
    for p in range(prompts):
        for _ in range(generations):
            rows.append(
                {
                    "agent_ref": {"name": agents[p % len(agents)]},
                    "responses_create_params": {
                        "input": [{"role": "user", "content": f"{tag}{p}+{p}?"}],
                        "temperature": 1.0,
                        "top_p": 1.0,
                        "max_output_tokens": 64,
                    },
                    "_ng_task_index": p,
                    "_rowidx": len(rows),
                }
            )
    return rows


from tests.rollout.conftest import make_agent, sqlite_store  # noqa: E402  (the same real agents and log)

__all__ = ["make_agent", "nemo_rows", "sqlite_store"]
