"""Checkpoints: a two-phase commit with presumed abort across the trainer and every agent, in three
rooms by phase: prepare and decide (`_prepare.py`), a prepare's 409 answered (`_unblock.py`), and
after the decision: finishing, recovery and reconciling an agent (`_finish.py`)."""

from trainer.checkpoints._finish import Finisher
from trainer.checkpoints._outcomes import CheckpointOutcome, PreparedCheckpoint
from trainer.checkpoints._prepare import Checkpoints
from trainer.checkpoints._unblock import Unblocker

__all__ = ["CheckpointOutcome", "Checkpoints", "Finisher", "PreparedCheckpoint", "Unblocker"]
