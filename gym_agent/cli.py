"""The reference agent's command line: `ledger gym serve ...` and `python -m gym_agent serve ...`."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Annotated

import typer

from gym_agent.defaults import DEFAULT_HOST, TOKEN_ENV
from gym_agent.sizes import DEFAULT_GEN_TOKENS, DEFAULT_PROMPT_TOKENS

app = typer.Typer(no_args_is_help=True, help="The reference Gym agent (checkpoint participant).")


@app.callback()
def _group() -> None:
    """The reference Gym agent (checkpoint participant)."""


@app.command()
def serve(
    name: Annotated[str, typer.Option(help="Agent name (reported by /capabilities; keys the state dir).")],
    port: Annotated[int, typer.Option(help="TCP port to listen on.")],
    host: Annotated[str, typer.Option(help="Interface to bind.")] = DEFAULT_HOST,
    token: Annotated[
        str | None,
        typer.Option(
            envvar=TOKEN_ENV, show_envvar=True, help="Bearer token required on every route but /health."
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the simulated environment.")] = 0,
    turns: Annotated[str, typer.Option(help="Model calls per episode, MIN:MAX (or N).")] = "1:3",
    prompt_tokens: Annotated[
        int,
        typer.Option(
            "--prompt-tokens",
            help="Mean tokens of an episode's prompt (drawn per task within a third of it; seeded).",
        ),
    ] = DEFAULT_PROMPT_TOKENS,
    gen_tokens: Annotated[
        int,
        typer.Option(
            "--gen-tokens",
            help="Mean tokens each model call generates (drawn per call within a third of it). Every "
            "call after the first is sent the whole conversation so far.",
        ),
    ] = DEFAULT_GEN_TOKENS,
    delay_s: Annotated[float, typer.Option("--delay-s", help="Extra seconds held at each model call.")] = 0.0,
    call_seconds: Annotated[
        str | None,
        typer.Option(
            "--call-seconds",
            help="Each model call's duration, MEAN[:SPREAD] seconds (gamma-distributed, drawn per call).",
        ),
    ] = None,
    tool_seconds: Annotated[
        str | None,
        typer.Option("--tool-seconds", help="Each tool's duration between two model calls, MEAN[:SPREAD]."),
    ] = None,
    resources_url: Annotated[
        str | None,
        typer.Option(
            "--resources-url",
            help="A resources server (`ledger gym resources`) whose tools each turn calls (docs/turns.md).",
        ),
    ] = None,
    resources: Annotated[
        str,
        typer.Option(help="Which of its resources each turn calls, comma-separated (empty: all)."),
    ] = "",
    generation_cuts: Annotated[
        bool,
        typer.Option(
            "--generation-cuts",
            help="Cut a model call at a token boundary when a checkpoint parks its try, and go on from "
            "that prefix after the resume (instead of the checkpoint waiting for the whole call).",
        ),
    ] = False,
    state_dir: Annotated[
        Path | None,
        typer.Option(
            help="Keeps the execution-generation counter and checkpoint artefacts "
            "[default: ~/.cache/rollout-ledger/gym-agent/NAME]."
        ),
    ] = None,
    policy: Annotated[str, typer.Option(help="Policy spec, e.g. 'tiny' or 'tiny:seed=1'.")] = "tiny",
    zero_work: Annotated[
        bool,
        typer.Option("--zero-work", help="Benchmarks: no model calls, each turn a fixed tiny token record."),
    ] = False,
    inline_tokens: Annotated[
        bool,
        typer.Option(
            "--inline-tokens",
            help="Also answer each model call's token arrays inside the reply, on its output message "
            "(prompt_token_ids, generation_token_ids, generation_log_probs), as a real Gym agent does.",
        ),
    ] = False,
    turn_continuation: Annotated[
        bool,
        typer.Option(
            "--turn-continuation",
            help="Save a continuation at each turn boundary and resume replacement tries from one "
            "(declares turn_continuation: groups may run at target level turn).",
        ),
    ] = False,
    log_level: Annotated[str, typer.Option(help="uvicorn/agent log level.")] = "info",
    access_log: Annotated[bool, typer.Option(help="Log every request line.")] = False,
    stop_with_stdin: Annotated[
        bool,
        typer.Option(
            "--stop-with-stdin",
            hidden=True,
            help="Stop (as on SIGTERM) when stdin reaches its end: the process that started this agent "
            "holds the other end, so the agent stops with it however it ends (the launcher's lifeline).",
        ),
    ] = False,
) -> None:
    """Serve a reference Gym agent until SIGTERM/SIGINT."""
    if stop_with_stdin:
        _stop_when_stdin_ends()
    try:
        from gym_agent.episode import EpisodeTooLong
        from gym_agent.server import run_server
    except ImportError as exc:  # the reference agent's own extra: uvicorn, and torch for its policy
        typer.echo(
            f"error: ledger gym serve needs the `agent` extra (uvicorn, torch; {exc.name} is not "
            "installed): pip install -c requirements/constraints.txt '.[agent]'",
            err=True,
        )
        raise typer.Exit(2) from None
    from pydantic import SecretStr, ValidationError

    from gym_agent.config import AgentConfig, parse_turns
    from gym_agent.durations import parse_durations
    from gym_agent.sizes import check_tokens

    try:
        config = AgentConfig(
            name=name,
            host=host,
            port=port,
            token=SecretStr(token) if token else None,
            seed=seed,
            turns=parse_turns(turns),
            prompt_tokens=check_tokens(prompt_tokens, "--prompt-tokens"),
            gen_tokens=check_tokens(gen_tokens, "--gen-tokens"),
            delay_s=delay_s,
            call_seconds=parse_durations(call_seconds) if call_seconds is not None else None,
            tool_seconds=parse_durations(tool_seconds, "--tool-seconds")
            if tool_seconds is not None
            else None,
            generation_cuts=generation_cuts,
            state_dir=state_dir,
            policy=policy,
            zero_work=zero_work,
            inline_tokens=inline_tokens,
            turn_continuation=turn_continuation,
            resources_url=resources_url,
            resources=tuple(n for n in resources.split(",") if n),
            log_level=log_level.lower(),
            access_log=access_log,
        )
    except (ValueError, ValidationError) as exc:
        raise typer.BadParameter(str(exc)) from None
    from participant.records import FileDamaged

    try:
        status = run_server(config)
    except EpisodeTooLong as exc:  # the policy cannot hold what these sizes draw: refused, not cut
        raise typer.BadParameter(str(exc)) from None
    except FileDamaged as exc:  # a file of the state directory no crash could have left: not started
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(status)


@app.command("resources")
def resources_server(
    port: Annotated[int, typer.Option(help="TCP port to listen on.")],
    state_dir: Annotated[Path, typer.Option(help="Where its sessions' journal is kept.")],
    host: Annotated[str, typer.Option(help="Interface to bind.")] = DEFAULT_HOST,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
) -> None:
    """Serve the reference resources server (bank: export_restore, mailer: restart_only, calculator:
    stateless) until SIGTERM/SIGINT."""
    try:
        from gym_resources.server import run_server
    except ImportError as exc:
        typer.echo(f"error: ledger gym resources needs uvicorn ({exc.name} is not installed)", err=True)
        raise typer.Exit(2) from None
    from participant.records import FileDamaged

    try:
        status = run_server(state_dir, host, port, log_level.lower())
    except FileDamaged as exc:  # a journal no crash could have left: not started
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(status)


def _stop_when_stdin_ends(grace_s: float = 30.0) -> None:
    """A thread that waits for stdin's end of file, then asks this process to stop as SIGTERM does,
    again each second (a SIGTERM that lands before the server installed its handlers is lost), and
    ends it outright once `grace_s` has passed: an orphaned agent never outlives its parent for long."""

    # The file descriptor, not sys.stdin: a daemon thread blocked inside a buffered reader holds its
    # lock, and the interpreter aborts at shutdown when it cannot take it ("Fatal Python error").
    fd = sys.stdin.fileno()

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(fd, 4096):
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="stop-with-stdin", daemon=True).start()
