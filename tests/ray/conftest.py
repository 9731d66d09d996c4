"""NeMo RL-shaped rows for the Ray adapter's tests."""

from __future__ import annotations

from typing import Any


def plain(value: Any) -> Any:
    """A result with its tensors as lists (comparable with ==)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def nemo_rows(prompts: int, generations: int, agents: list[str], tag: str = "") -> list[dict[str, Any]]:
    """What NeMo RL's `_prepare_nemo_gym_rows` hands the Gym actor: a prompt's rows contiguous."""
    rows: list[dict[str, Any]] = []
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

__all__ = ["make_agent", "nemo_rows", "plain", "sqlite_store"]
