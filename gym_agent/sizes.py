"""An episode's sizes: how many model calls it makes (`--turns`) and how many tokens each call is sent
and generates (`--prompt-tokens`, `--gen-tokens`: means the agent draws around, seeded).

The one definition of these knobs: the reference agent's command line, `ledger simulate` and the
benchmarks all parse and pass them through here.  Plain values only (no pydantic, no torch), so the
command lines that show them stay light.
"""

from __future__ import annotations

from typing import Final

# The most model calls an episode may make (a bound, so a typo cannot ask for a million).
MAX_TURNS: Final = 1000
# A size is drawn uniformly from [mean - SPREAD * mean, mean + SPREAD * mean]: the default prompt
# mean of 12 gives prompts of 8 to 16 tokens.
SPREAD: Final = 1 / 3
# The reference agent's defaults: a tiny policy's episode (the prompt is the task's, before the first
# call; every later call is sent the whole conversation so far).
DEFAULT_PROMPT_TOKENS: Final = 12
DEFAULT_GEN_TOKENS: Final = 6
# The most tokens one mean may ask for (a real rollout's hundreds of thousands fit).
MAX_TOKENS: Final = 1_000_000


def parse_turns(text: str) -> tuple[int, int]:
    """`A:B` (or `N`): an episode's model calls, drawn between A and B; ValueError with a one-line reason."""
    low, sep, high = text.partition(":")
    try:
        bounds = (int(low), int(high if sep else low))
    except ValueError:
        raise ValueError(f"--turns {text!r} is not A:B (whole numbers, e.g. 3:6)") from None
    if not 1 <= bounds[0] <= bounds[1] <= MAX_TURNS:
        raise ValueError(f"--turns {text!r}: want 1 <= A <= B <= {MAX_TURNS}")
    return bounds


def check_tokens(mean: int, option: str) -> int:
    """A token-count mean as an option takes it; ValueError with a one-line reason."""
    if not 1 <= mean <= MAX_TOKENS:
        raise ValueError(f"{option} {mean}: want a mean between 1 and {MAX_TOKENS:,} tokens")
    return mean


def size_range(mean: int) -> tuple[int, int]:
    """The sizes a mean is drawn from (inclusive, symmetric around it, at least one token)."""
    spread = round(mean * SPREAD)
    return max(1, mean - spread), mean + spread
