"""Which retry budget a Gym `failure_kind` spends: infrastructure or data.

A Gym reply names what went wrong in the Gym's shared, low-cardinality vocabulary (`failure_kind`,
`<domain>_<condition>`, or an environment's own `<server>:<kind>`); the name says what kind of thing
failed and nothing about retrying, so the trainer decides that here.  Infrastructure: reaching
another process, a deadline, a sandbox or session provider, cancellation and process lifecycle,
persistence, a judge that could not be reached: another try may well succeed.  Data: the harness or
the verifier failed on this sample, or the judge's verdict could not be read: the prompt (or what
the policy made of it) may be at fault.  A name outside the vocabulary (an environment's own) is
counted as data: it names the environment's handling of this sample.
"""

from __future__ import annotations

from typing import Final, Literal

FailureBudget = Literal["infra", "data"]

# The domains of the Gym's vocabulary that are infrastructure as a whole.
_INFRA_DOMAINS: Final = ("transport_", "provider_", "session_")
INFRA_FAILURE_KINDS: Final = frozenset(
    {
        "agent_timeout",
        "agent_request_failed",  # something in front of the agent answered: the rollout never ran
        "judge_failed",  # the judge could not be reached or answered nothing
        "cancelled",
        "kill_shaped",
        "shutdown",
        "persistence_failed",
        "cohort_incomplete",
    }
)
DATA_FAILURE_KINDS: Final = frozenset(
    {"agent_run_error", "agent_command_not_allowed", "judge_unparseable", "verifier_error"}
)


# `RunFailed` kinds (the trainer's own record of how an attempt failed) that say the prompt or its
# result is at fault, not the infrastructure; of those, the ones no retry can get past (the agent
# refused the request itself: 400, 413, 422, and a new attempt sends the same request).
DATA_RUN_FAILURES: Final = frozenset({"env", "verify", "refused"})
FINAL_RUN_FAILURES: Final = frozenset({"refused"})


def budget_of_failure_kind(kind: str) -> FailureBudget:
    """The budget a try that failed with the Gym's `failure_kind` spends."""
    if kind in INFRA_FAILURE_KINDS or kind.startswith(_INFRA_DOMAINS):
        return "infra"
    return "data"
