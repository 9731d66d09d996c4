"""What a `ledger simulate` run is asked to do: the one place its settings live.

`SimConfig` is filled by the command's options (`cli/simulate.py`, one keyword per option) and read by
the drivers (`simulation/run.py`, `simulation/ray_run.py`) and the benchmarks; a new knob is a field
here with its default, an option there, and its use in a driver.  This module imports no trainer, no
agent and no torch, so `ledger --help` and option errors cost nothing.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from gym_agent.sizes import DEFAULT_GEN_TOKENS, DEFAULT_PROMPT_TOKENS

if TYPE_CHECKING:  # the wire models (pydantic) are imported when faults are parsed, not by `--help`
    from protocol.wire import FaultRates

DEFAULT_FAULTS: Final = "drop_reply=0.05,fail=0.05,hang=0.01"
FAULT_NAMES: Final = ("drop_reply", "fail", "hang", "crash_after")
# A run id is the prefix of its group ids and its trainer id: short, and safe in a file name.
RUN_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,23}")


@dataclass
class SimConfig:
    agents: int = 2
    agent_urls: dict[str, str] = field(default_factory=dict)
    groups: int = 24
    siblings: int = 4
    mode: str = "prompt_group"
    faults: str = DEFAULT_FAULTS
    checkpoint_every_s: float = 2.0
    prepare_timeout_s: float = 30.0
    rollout_timeout_s: float = 10.0
    park_grace_s: float = 1.0
    seed: int = 0
    # Rollouts (attempts) in flight at once, the concurrency a user sets (as a collector's
    # `num_samples_in_parallel`): a group is admitted as soon as the attempts in flight fall below it.
    # None: `window_per_agent` groups' siblings an agent (keeps the agents, one model thread each,
    # responsive).
    in_flight: int | None = None
    window_per_agent: int = 3
    turns: tuple[int, int] = (1, 3)
    # Token-count means of the reference agents' prompts and of each model call's generation
    # (gym_agent.sizes), and whether they skip the model (each call's tokens drawn at its size).
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    gen_tokens: int = DEFAULT_GEN_TOKENS
    zero_work: bool = False
    # The reference agents answer each call's token arrays inside the reply too, as a real Gym agent
    # does (`gym --inline-tokens`).
    inline_tokens: bool = False
    # The run's target level (docs/turns.md): at `turn` the agents started here keep continuations
    # (--turn-continuation) and replacement tries resume them.
    target_level: str = "sibling"
    # Stop the trainer this often and recover it from the log, until the run ends (None: never).
    kill_trainer_every_s: float | None = None
    agent_delay_s: float = 0.02
    # The reference agents' model-call and tool durations, MEAN[:SPREAD] seconds (gym_agent.durations);
    # None: none beyond agent_delay_s.
    call_seconds: str | None = None
    tool_seconds: str | None = None
    # The reference agents cut a model call at a token boundary when a checkpoint parks its try
    # (`gym --generation-cuts`), instead of the checkpoint waiting for the whole call.
    generation_cuts: bool = False
    # Start the reference resources server (gym_resources) for the run and have each turn of the
    # agents it starts call these of its resources, comma-separated (None: no tools).
    resources: str | None = None
    # The agents keep continuations at any level, so that what a level redoes is counted from the
    # same evidence (set for both runs of `--compare-level`).
    measure_turns: bool = False
    # Rounds (and failures of each kind) a group may spend.  The default fault mix fails about one
    # prompt-group round in five (5 % environment failures and 1 % hangs over 4 siblings), so 4 rounds
    # dead-lettered a group in about one run of 48 groups in ten; 8 makes that about one in 40,000.
    max_tries: int = 8
    # The run's id: the prefix of its group and checkpoint ids, and its trainer id (each run is its own
    # trainer, so runs on one log never drive or claim each other's groups).  Empty: a new one.
    run_id: str = ""
    # Carry on the run `run_id` names: recover its trainer from the log (every group it left open is
    # driven to a seal or dead-lettered), then submit what it never submitted.
    resume: bool = False
    # The agents' control token: sent on every call to them, and required by the agents a run starts
    # (given in their environment, never on a command line).  None: agents without one.
    agent_token: str | None = field(default=None, repr=False)
    # State directories of agents given by URL, for their durable execution evidence.
    agent_state_dirs: dict[str, Path] = field(default_factory=dict)
    # Where the agents this run starts keep their state (one folder per agent), so that a resumed run
    # restarts the same agents; None: a temporary folder each, gone with the run.
    agent_state_root: Path | None = None
    # Fields every `/run` row carries besides the prompt (e.g. a NeMo RL row's `agent_ref`).
    row_fields: dict[str, Any] = field(default_factory=dict)
    # The workload's `fail` fault is an environment failure (a masked reply): retried, so the run
    # exercises replacements (a trainer's default keeps a masked reply as a result).
    mask_sample_retries: bool = True
    # A run in which no group of it moves for this long stops as stalled (None: derived from the
    # timeouts, `stall_after_s()`): nothing waits for ever.
    stall_timeout_s: float | None = None

    def agent_args(self) -> list[str]:
        """The options of the reference agents a run starts that carry its sizes and durations (and,
        at target level turn, that they keep continuations)."""
        # At level turn the agents resume; with trainer kills at any level they keep continuations
        # too, so what a level redoes is counted from the same evidence (their continuation index).
        keep = self.target_level == "turn" or self.kill_trainer_every_s is not None or self.measure_turns
        args = ["--turn-continuation"] if keep else []
        args += ["--prompt-tokens", str(self.prompt_tokens), "--gen-tokens", str(self.gen_tokens)]
        if self.zero_work:
            args.append("--zero-work")
        if self.inline_tokens:
            args.append("--inline-tokens")
        if self.call_seconds is not None:
            args += ["--call-seconds", self.call_seconds]
        if self.tool_seconds is not None:
            args += ["--tool-seconds", self.tool_seconds]
        if self.generation_cuts:
            args.append("--generation-cuts")
        return args

    def episode_s(self) -> float:
        """How long an episode's model calls and tools take at most, but for about one in 10,000 calls
        (each call's mean + 4 spreads, per turn): what a derived rollout timeout allows."""
        from gym_agent.durations import parse_durations

        call = parse_durations(self.call_seconds).longest_s() if self.call_seconds is not None else 0.0
        tool = (
            parse_durations(self.tool_seconds, "--tool-seconds").longest_s()
            if self.tool_seconds is not None
            else 0.0
        )
        return self.turns[1] * (self.agent_delay_s + call) + (self.turns[1] - 1) * tool

    def window(self, agents: int) -> int:
        """The rollouts the run keeps in flight at once: `in_flight`, or its default."""
        return self.in_flight or max(1, self.window_per_agent * self.siblings * max(1, agents))

    def stall_after_s(self) -> float:
        """Seconds without any group of the run moving before it is declared stalled: longer than one
        try may legitimately take (its rollout timeout, a retire within its 30 s budget, a checkpoint's
        prepare deadline), with room to spare."""
        if self.stall_timeout_s is not None:
            return self.stall_timeout_s
        return 2 * (self.rollout_timeout_s + 30.0 + self.prepare_timeout_s)


def run_state_dir(run_id: str) -> Path:
    """Where the agents `ledger simulate` starts for run `run_id` keep their state: kept while the run
    may be resumed, removed once it ends."""
    from gym_agent.defaults import cache_home

    return cache_home() / "simulate" / run_id


@dataclass
class Fault:
    rates: FaultRates
    crash_after: int | None


def parse_faults(text: str) -> Fault:
    """`drop_reply=P,fail=P,hang=P,crash_after=N` (each optional); ValueError with a one-line reason."""
    from pydantic import ValidationError

    from protocol.wire import FaultRates

    values: dict[str, float] = {}
    crash: int | None = None
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not value:
            raise ValueError(f"fault {part!r} is not NAME=VALUE ({', '.join(FAULT_NAMES)})")
        if name == "crash_after":
            if not value.isdigit():
                raise ValueError(f"crash_after={value} is not a whole number of runs (e.g. crash_after=20)")
            crash = int(value)
        elif name in FAULT_NAMES:
            try:
                rate = float(value)
            except ValueError:
                raise ValueError(f"{name}={value} is not a number (a rate between 0 and 1)") from None
            if not math.isfinite(rate) or not 0 <= rate <= 1:
                raise ValueError(f"{name}={value} is not a rate: it is between 0 and 1 (e.g. {name}=0.05)")
            values[name] = rate
        else:
            raise ValueError(f"unknown fault {name!r} ({', '.join(FAULT_NAMES)})")
    try:
        return Fault(FaultRates(**values), crash)
    except ValidationError as exc:  # the wire model's own bounds, should they ever be narrower
        raise ValueError(f"faults {text!r}: {exc.errors()[0]['msg']}") from None


def derived_rollout_timeout_s(config: SimConfig, floor_s: float) -> float:
    """A rollout timeout for `config`'s durations: twice its longest episode (its model calls queue on
    the agents' model threads and wait out checkpoints too), and at least `floor_s`."""
    return max(floor_s, round(2 * config.episode_s(), 1))
