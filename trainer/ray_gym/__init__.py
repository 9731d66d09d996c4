"""The Ray adapter: `LedgerGym`, NeMo RL's `NemoGym` actor with the ledger inside, and logprob workers as
Ray actors.  Ray is the optional extra `ray`; nothing here imports it until an actor is made."""

from trainer.ray_gym.actor import ACTOR_OPTIONS, LedgerGym, ledger_gym_actor
from trainer.ray_gym.config import LedgerGymConfig, split_config
from trainer.ray_gym.results import ResultDataError
from trainer.ray_gym.rows import CallBudgetSpent, RowError, RowsDeadLettered, RowsLostToInfrastructure
from trainer.ray_gym.spinup import SpinupError

__all__ = [
    "ACTOR_OPTIONS",
    "CallBudgetSpent",
    "LedgerGym",
    "LedgerGymConfig",
    "ResultDataError",
    "RowError",
    "RowsDeadLettered",
    "RowsLostToInfrastructure",
    "SpinupError",
    "ledger_gym_actor",
    "split_config",
]
