"""Errors the rollout coordinator raises to its caller."""

from __future__ import annotations


class RolloutError(Exception):
    """Base of the coordinator's own errors."""


class FencedOff(RolloutError):
    """Another coordinator appended to a stream this one writes: this one is stale and has stopped for good."""


class StreamExists(RolloutError):
    """An append meant to start a stream found it started by another writer; nothing was written."""

    def __init__(self, stream: str, version: int) -> None:
        super().__init__(f"stream {stream!r} already exists (at version {version}); nothing was written")
        self.stream = stream
        self.version = version


class AgentShared(RolloutError):
    """An agent this trainer was given is driven by another trainer: refused at `start()` (one trainer
    per agent; participant.driver says why)."""


class NotOwned(RolloutError):
    """An act on an attempt or debt another trainer owns (or at an agent this one does not drive): refused,
    nothing done (projections.ownership)."""


class CoordinatorStopped(RolloutError):
    """The coordinator was closed (or fenced off, or lost its database) and accepts no more work."""


class UnknownGroup(RolloutError):
    """A call names a group the log does not know."""


class NotSealed(RolloutError):
    """Only a sealed group can be claimed for training."""


class AlreadyClaimed(RolloutError):
    """A group is trained on once (unless a restore rolled the claim back)."""


class ClaimWhilePrepared(RolloutError):
    """A claim made while this trainer's checkpoint is prepared and undecided: the trainer saves its
    state meanwhile, so a claim now would land inside the cut without being in what it saved.  Claim
    after the decision (`RolloutCoordinator.wait_checkpoint_decided`)."""


class InvalidRow(RolloutError, ValueError):
    """A group's payload makes no `/run` row an agent takes (a number or text JSON cannot carry,
    nesting past the cap): refused at submit, before anything is recorded."""


class GroupConflict(RolloutError, ValueError):
    """`submit` named a group id the log already holds with another request: group ids are never reused."""


class LogprobsMismatch(RolloutError, ValueError):
    """Logprobs a trainer computed do not fit the sealed attempt's token records (or the attempt is not sealed)."""


class CheckpointRefused(RolloutError):
    """A checkpoint call that does not fit the checkpoint's state; nothing was written or sent."""


class CheckpointBusy(CheckpointRefused):
    """Another checkpoint is prepared and undecided: it must be committed or aborted first."""


class CheckpointDecided(CheckpointRefused):
    """The checkpoint is already committed or aborted in the log (ids are never reused)."""


class UnknownCheckpoint(CheckpointRefused):
    """Commit or abort named a checkpoint this coordinator has not prepared."""
