"""Names of the refusals an agent answers with (`{"error": NAME, ...}`), exactly as the real Gym spells
the phase-fence ones; both sides compare against these constants, never bare strings."""

from __future__ import annotations

from typing import Final

CHECKPOINT_CONFLICT: Final = "CheckpointConflictError"
INVALID_PHASE: Final = "InvalidPhaseError"
STALE_CHECKPOINT: Final = "StaleCheckpointError"
NOT_READY: Final = "not_ready"
GONE: Final = "gone"
RECEIPT_MISMATCH: Final = "receipt_mismatch"
UNKNOWN_EXECUTION: Final = "unknown_execution"
EXECUTION_FAILED: Final = "execution_failed"
NOT_FOUND: Final = "not_found"
SHUTTING_DOWN: Final = "shutting_down"
INVALID_REQUEST: Final = "invalid_request"
UNAUTHORIZED: Final = "unauthorized"
PAYLOAD_TOO_LARGE: Final = "payload_too_large"
CHECKPOINT_WRITE_FAILED: Final = "checkpoint_write_failed"
INTERNAL_ERROR: Final = "internal_error"
METHOD_NOT_ALLOWED: Final = "method_not_allowed"
# The agent is driven by another trainer (one trainer per agent: participant.driver).
TRAINER_CONFLICT: Final = "trainer_conflict"
