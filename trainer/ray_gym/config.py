"""`LedgerGym`'s configuration: NeMo RL's `NemoGymConfig` with one `ledger` section (`LedgerGymConfig`),
read by NeMo RL's keys (the TypedDict is NeMo RL's: its other keys are left to it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from eventstore.events import Mode
from protocol.ids import Identifier
from trainer.manifest import config_fingerprint
from trainer.ray_gym.rows import DEFAULT_GROUP_PREFIX

LEDGER_SECTION = "ledger"
# NeMo RL's `NemoGymConfig` is a TypedDict it owns: read by its keys, its other keys left to it.
NemoGymConfigLike = Mapping[str, Any]


class LedgerGymConfig(BaseModel):
    """The `ledger` section: where the log is, who the trainer is, how groups are driven, and how the
    Gym servers are reached (`agents` outright, a running Gym's `head_server_url`, or neither: they
    are started from `NemoGymConfig` as NeMo RL starts them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    db_url: str
    trainer_id: Identifier | None = None
    mode: Mode = "prompt_group"
    # Budgets: attempts per sibling, how long one attempt may run, how long one call waits for its groups.
    max_tries: int = Field(default=4, ge=1)
    max_infra_failures: int | None = Field(default=None, ge=1)
    max_data_failures: int | None = Field(default=None, ge=1)
    rollout_timeout_s: float = Field(default=600.0, gt=0)
    prepare_timeout_s: float = Field(default=300.0, gt=0)
    park_grace_s: float = Field(default=1.0, gt=0)
    call_budget_s: float = Field(default=6 * 3600.0, gt=0)
    # Rows per prompt group when a call holds several equal prompts side by side (rows.py).
    num_generations: int | None = Field(default=None, ge=1)
    group_prefix: str = DEFAULT_GROUP_PREFIX
    # Reaching the agents: outright (nothing started), or through a running Gym's head server.
    agents: dict[Identifier, str] = Field(default_factory=dict)
    head_server_url: str | None = None
    agent_token: str | None = None
    # Starting Gym: the interpreter that has nemo_gym (None: this one), the servers' working directory
    # (local server folders are found there first), the address the servers bind and advertise (None:
    # NeMo RL's, every interface for the head server and this node's address), the spin-up bound.
    gym_python: str | None = None
    gym_workdir: str | None = None
    gym_host: str | None = None
    gym_dotenv_path: str | None = None
    spinup_timeout_s: float = Field(default=900.0, gt=0)
    # Serve the log's figures on /metrics from inside the actor (the `metrics` extra); 0: a free port.
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    metrics_addr: str = "127.0.0.1"
    # The trainer's checkpoints (NeMo RL's `checkpointing.checkpoint_dir`): at `_spinup` the log is
    # restored to the checkpoint NeMo RL loads from it (its newest `step_N`, by NeMo RL's own rule),
    # read from the manifest there.  `restore_checkpoint` names one outright instead (a checkpoint
    # directory, or the trainer's checkpoint name).  Neither: the log's newest cut of this trainer.
    checkpoint_dir: str | None = None
    restore_checkpoint: str | None = None

    def fingerprint(self) -> str:
        """What decides which groups a call's rows become and whose they are: a checkpoint saved
        under other values is refused at restore."""
        return config_fingerprint(
            {
                "trainer_id": self.trainer_id,
                "mode": self.mode,
                "group_prefix": self.group_prefix,
                "num_generations": self.num_generations,
            }
        )


def split_config(config: Any) -> tuple[dict[str, Any], LedgerGymConfig]:
    """(the NemoGymConfig, its `ledger` section) from what the actor was made with."""
    if isinstance(config, LedgerGymConfig):
        return {}, config
    if not isinstance(config, Mapping):
        raise TypeError(
            f"LedgerGym takes a NemoGymConfig mapping or a LedgerGymConfig, not {type(config).__name__}"
        )
    cfg = dict(config)
    inner = dict(cfg.get("initial_global_config_dict") or {})
    section = cfg.pop(LEDGER_SECTION, None)
    if section is None:
        section = inner.pop(LEDGER_SECTION, None)
        if "initial_global_config_dict" in cfg:
            cfg["initial_global_config_dict"] = inner
    if section is None:
        if "db_url" in cfg:  # a LedgerGymConfig given as a plain dict
            return {}, _validated(cfg)
        raise ValueError(
            "LedgerGym needs a `ledger` section in its NemoGymConfig (env.nemo_gym.ledger: db_url, ...)"
        )
    return cfg, _validated(section)


def _validated(section: Any) -> LedgerGymConfig:
    try:
        return LedgerGymConfig.model_validate(dict(section))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "ledger"
        raise ValueError(f"ledger.{where}: {first['msg']}") from None
