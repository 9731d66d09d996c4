"""The agent's own `/run` reply, read once: its body parsed in C, and the reply kept as it was parsed.

A mounted agent's reply crosses the participant once: its body (what the agent's own `/run` wrote) is
parsed, validated as a `RunReply` (`protocol.wire.gym_reply`), and its canonical JSON written for the
digest the receipt names.  A real Gym agent's reply carries its model calls' token arrays, tens of
thousands of numbers at 9k tokens, so each pass over them shows in the agent's CPU
(benchmarks/peer.py: the mounted agent against the plain one).  Two passes are left out here:

- the parse is orjson's (C; about a third faster than pydantic's on such a body) wherever orjson
  reads the body as pydantic's parser does.  orjson refuses `NaN`, `Infinity` and a number past a
  double's range, and reads an integer past 64 bits as a float; a body holding any of them, or any
  text orjson refuses, is read by pydantic's parser instead, so the validation below refuses it
  with its own words, exactly as before.  An integer past 64 bits has at least 19 digits in a row:
  a body with such a run goes to pydantic's parser (one search in C over the body's digit classes);
- the reply is kept as parsed (`ParsedReply`): its JSON-valued fields hold the parser's values,
  which a dump would copy item by item into equal ones (`RunReply.parsed_payload`), and it holds no
  number JSON cannot carry (the validation refused those), so its canonical JSON skips that search.
"""

from __future__ import annotations

from typing import Any, Final

import orjson
from pydantic_core import from_json

from protocol.wire import RunReply

# Each byte's class: a digit becomes `d`, anything else `.`; a run of 19 digits is then one search.
_DIGIT_CLASS: Final = bytes(ord("d") if chr(b).isdigit() and b < 128 else ord(".") for b in range(256))
_LONG_DIGITS: Final = b"d" * 19


class ParsedReply(RunReply):
    """A reply validated from JSON this process parsed (the agent's own `/run` body): its JSON-valued
    fields hold JSON values already, kept as they are (`parsed_payload`), never copied."""


def read_reply_body(raw: bytes) -> Any:
    """`raw` parsed as pydantic's parser reads it (ValueError where it is no JSON): by orjson where
    both read it alike, else by pydantic's parser."""
    if _LONG_DIGITS not in raw.translate(_DIGIT_CLASS):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # NaN, Infinity, 1e999, bad UTF-8, past orjson's nesting: pydantic's parser decides
    return from_json(raw)
