"""The Ray adapter: `LedgerGym`, a drop-in for NeMo RL's `NemoGym` actor, and logprob workers as Ray
actors.  Ray is the optional extra `ray`; nothing here imports it until an actor is made."""

from trainer.ray_gym.actor import ACTOR_OPTIONS, LedgerGym, LedgerGymConfig, ledger_gym_actor
from trainer.ray_gym.rows import RowError, RowsDeadLettered

__all__ = [
    "ACTOR_OPTIONS",
    "LedgerGym",
    "LedgerGymConfig",
    "RowError",
    "RowsDeadLettered",
    "ledger_gym_actor",
]
