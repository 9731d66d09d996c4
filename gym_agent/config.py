"""The settings of one reference Gym agent process."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from gym_agent.defaults import DEFAULT_HOST, TOKEN_ENV, cache_home, default_state_dir
from gym_agent.durations import Durations
from gym_agent.sizes import DEFAULT_GEN_TOKENS, DEFAULT_PROMPT_TOKENS, MAX_TOKENS, parse_turns
from protocol.ids import Identifier
from protocol.wire import MAX_BODY_BYTES

# Re-exported: the defaults live in gym_agent.defaults (light enough for `ledger --help`).
__all__ = ["DEFAULT_HOST", "TOKEN_ENV", "AgentConfig", "cache_home", "default_state_dir", "parse_turns"]


class AgentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Identifier
    host: str = DEFAULT_HOST
    port: int = Field(default=0, ge=0, le=65535)
    # SecretStr keeps the token out of reprs and logs.
    token: SecretStr | None = None
    seed: int = 0
    turns: tuple[int, int] = (1, 3)
    # Token-count means the agent draws each episode's prompt and each model call's generation around
    # (gym_agent.sizes); every call after the first is sent the whole conversation so far.
    prompt_tokens: int = Field(default=DEFAULT_PROMPT_TOKENS, ge=1, le=MAX_TOKENS)
    gen_tokens: int = Field(default=DEFAULT_GEN_TOKENS, ge=1, le=MAX_TOKENS)
    delay_s: float = Field(default=0.0, ge=0)
    # Each model call's duration (beside delay_s) and each tool's, between two calls (gym_agent.durations).
    call_seconds: Durations | None = None
    tool_seconds: Durations | None = None
    # Cut a model call at a token boundary when a checkpoint parks its try, and go on from there after
    # the resume (gym_agent.decode), instead of making the checkpoint wait for the whole call.
    generation_cuts: bool = False
    # Benchmarks: skip the model; each model call's tokens are drawn at the sizes above (gym_agent.episode).
    zero_work: bool = False
    # Answer each model call's token arrays inside the reply too, on the call's output message, as a
    # real Gym agent does (`token_id_capture`): the reply then carries every token as JSON.
    inline_tokens: bool = False
    # Save a continuation at each turn boundary and resume replacement tries from one (docs/turns.md):
    # declares `turn_continuation`, so groups may run at target level `turn`.
    turn_continuation: bool = False
    # A resources server (gym_resources) whose tools each turn calls, and which of its resources
    # (empty: all of them).
    resources_url: str | None = None
    resources: tuple[str, ...] = ()
    state_dir: Path | None = None
    policy: str = "tiny"
    temperature: float = Field(default=1.0, gt=0)
    max_body_bytes: int = Field(default=MAX_BODY_BYTES, gt=0)
    # Seconds uvicorn waits for open requests after a stop signal before it cancels them.
    graceful_shutdown_s: float = Field(default=3.0, ge=0)
    model_threads: int = Field(default=1, ge=1)
    log_level: str = "info"
    access_log: bool = False

    @model_validator(mode="after")
    def _check_turns(self) -> AgentConfig:
        if not 1 <= self.turns[0] <= self.turns[1]:
            raise ValueError(f"turns needs 1 <= min <= max, got {self.turns}")
        return self

    @property
    def resolved_state_dir(self) -> Path:
        return self.state_dir if self.state_dir is not None else default_state_dir(self.name)

    def token_value(self) -> str | None:
        return self.token.get_secret_value() if self.token is not None else None
