"""The Gym side of the hand-off, as a library a Gym server mounts: `mount_participant(app, ...)`.

Needs only FastAPI and pydantic (what a Gym server already has) and the contract in `protocol`.
"""

from participant.evidence import Evidence, read_evidence
from participant.executions import ExecutionRegistry, Hooks, Runner, RunSession
from participant.mount import Participant, mount_participant
from participant.records import FileDamaged

__all__ = [
    "Evidence",
    "ExecutionRegistry",
    "FileDamaged",
    "Hooks",
    "Participant",
    "RunSession",
    "Runner",
    "mount_participant",
    "read_evidence",
]
