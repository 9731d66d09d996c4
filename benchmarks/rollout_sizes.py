"""The size options every benchmark that runs rollouts takes: `--prompt-tokens`, `--gen-tokens` (means
the reference agents draw around) and `--turns` (model calls per rollout), parsed by the agent's own
definitions (`gym_agent.sizes`), plus `--zero-work` where the agents would otherwise run the tiny
policy (it holds 256 tokens: real sizes need zero work)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from gym_agent.sizes import check_tokens, parse_turns


def _tokens(option: str) -> Callable[[str], int]:
    """An argparse type: a token-count mean, else its one-line error."""

    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{option} {text!r} is not a whole number") from None
        try:
            return check_tokens(value, option)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return check


def positive(text: str) -> int:
    """An argparse type: a whole number of at least 1 (rollouts, rounds), else its one-line error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


def _turns(text: str) -> tuple[int, int]:
    try:
        return parse_turns(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_size_options(
    parser: argparse.ArgumentParser,
    *,
    prompt_tokens: int,
    gen_tokens: int,
    turns: str,
    zero_work_option: bool = False,
) -> None:
    """Adds the options with this benchmark's defaults (`turns` as the option takes it)."""
    parser.add_argument(
        "--prompt-tokens",
        type=_tokens("--prompt-tokens"),
        default=prompt_tokens,
        help=f"Mean tokens of a rollout's prompt, drawn within a third of it (default {prompt_tokens}).",
    )
    parser.add_argument(
        "--gen-tokens",
        type=_tokens("--gen-tokens"),
        default=gen_tokens,
        help=f"Mean tokens each model call generates (default {gen_tokens}).",
    )
    parser.add_argument(
        "--turns",
        type=_turns,
        default=parse_turns(turns),
        help=f"Model calls per rollout, A:B or N, each sent the whole conversation so far (default {turns}).",
    )
    if zero_work_option:
        parser.add_argument(
            "--zero-work",
            action="store_true",
            help="The agents run no model: each call's tokens are drawn at its size (needed past the "
            "tiny policy's 256 tokens).",
        )


def size_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The `SimConfig` fields the options set."""
    return {
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "turns": args.turns,
        "zero_work": bool(getattr(args, "zero_work", False)),
    }
