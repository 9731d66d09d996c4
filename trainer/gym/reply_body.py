"""A `/run` body's JSON, its router choices held as their text (`protocol.routes.RoutesText`).

A MoE reply's `routed_experts` (a list a token of a list a layer of k experts: 16,000 small lists at
8,000 tokens) cost the trainer more as Python lists than all of the reply's other numbers together:
made by the parse, walked by the cyclic collector while the reply waits for its ACK, freed after it.
Here they are never made: each output item's router choices whose text `protocol.routes` takes are
cut out of the body before msgspec parses it, and put back as that text
(`protocol.routes.loads_holding_routes`).  The values a reader gets are the body's JSON either way.
"""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.routes import loads_holding_routes
from protocol.token_codec import reply_output_of


def decode_body(body: bytes | bytearray) -> Any:
    """The body's JSON, as `msgspec.json.decode(body)` gives it, but for each output item's router
    choices held as a `RoutesText` where their text allows; raises `msgspec.DecodeError` where
    msgspec refuses the body."""
    return loads_holding_routes(body, msgspec.json.decode, reply_output_of)


__all__ = ["decode_body"]
