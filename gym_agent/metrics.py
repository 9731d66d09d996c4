"""The reference agent's `/metrics`: what the Gym side knows, in Prometheus' text format.

The trainer's figures come from the log; an agent's come from its own execution registry, the state it
answers `/status` and `/debug/runs` from: results it holds unacknowledged (the debts it is owed),
executions by state, its execution generation (restarts), and executions beyond one per try.
`prometheus_client` (the `metrics` extra) is imported when `/metrics` is asked for.
"""

from __future__ import annotations

from protocol.wire import AgentStatus, Phase

PHASES: tuple[Phase, ...] = ("idle", "preparing", "prepared", "committing", "committed_paused")


def render(agent_name: str, status: AgentStatus, runs: dict[str, int]) -> tuple[bytes, str]:
    """(body, content type) of one scrape."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    labels = ["agent"]

    def gauge(name: str, doc: str, value: float) -> None:
        Gauge(f"gym_agent_{name}", doc, labels, registry=registry).labels(agent_name).set(value)

    gauge(
        "completed_unacknowledged",
        "Finished results held until the trainer ACKs them.",
        status.completed_unacknowledged,
    )
    gauge("running", "Executions running.", status.running)
    gauge(
        "park_requested", "Executions asked to park at their next model-call boundary.", status.park_requested
    )
    gauge("parked", "Executions parked for a checkpoint.", status.parked)
    gauge(
        "execution_generation",
        "This process's execution generation (one more per restart).",
        status.execution_generation,
    )
    gauge("tries_executed", "Distinct tries this process has executed.", len(runs))
    gauge(
        "duplicate_executions",
        "Executions beyond the first of a try.",
        sum(n - 1 for n in runs.values() if n > 1),
    )
    phase = Gauge(
        "gym_agent_checkpoint_phase",
        "1 for the agent's checkpoint phase.",
        [*labels, "phase"],
        registry=registry,
    )
    for name in PHASES:
        phase.labels(agent_name, name).set(1.0 if status.phase == name else 0.0)
    return generate_latest(registry), CONTENT_TYPE_LATEST
